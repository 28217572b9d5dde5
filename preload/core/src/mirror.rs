//! The readiness mirror: kernel-visible readiness for a SAN socket.
//!
//! The design is in `docs/ARCHITECTURE.md` ("Readiness: a mirror socketpair per SAN socket").
//! A [`Mirror`] owns `M`, one end of an `AF_UNIX` stream socketpair; the other end `K` goes to
//! the peer process (with [`send_fd`]) and is closed here. The epoll/poll/select hooks wait on
//! `M` in place of the application's fd, so every kernel waiting feature (ET, ONESHOT,
//! EXCLUSIVE, nested epoll, epoll sets shared across fork) works unchanged. Two flags in a
//! [`MirrorWords`] that both processes map keep `M`'s readiness equal to the session's.
//!
//! # Readable (IN): tokens
//!
//! `M` is readable while it holds a *token* byte. Invariant: `tokens in M + tokens being
//! written == readable flag` (0 or 1), except transiently 2 during a lowering (below).
//!
//! * The peer, after pushing data, calls [`raise_readable`]: if the flag is down it CASes it
//!   0→1 and writes one token to `K`. With the flag up it returns without a system call.
//! * We, when our receive queue became empty, call [`Mirror::lower_readable`]: with the flag
//!   up, it first *peeks* that the token has arrived, then puts the flag down, then re-checks
//!   for data (Dekker with the peer's push: `SeqCst` fences on both sides, so at least one of
//!   the two sees the other). Data present: it CASes the flag back up and keeps the token (or,
//!   if a producer won the CAS and sends a new token, consumes only the old one). No data: it
//!   consumes exactly the one token it peeked; a token sent by a producer after the flag went
//!   down is a newer edge's and stays.
//!
//! So no wake-up is lost (data pushed after our flag store finds the flag down and raises; data
//! pushed before it is seen by our re-check) and no newer edge's token is drained. The only
//! imprecision is spurious readiness: a token still in flight when we lower (the producer is
//! between its CAS and its write; [`ReadLowering::TokenInFlight`]) arrives after we emptied
//! the queue, so `M` is readable once with nothing to read. The kernel allows that of any
//! socket (another thread may have read first), and the next lowering removes it. (A producer
//! *stopped* between its CAS and its write, e.g. by SIGSTOP, delays the wake-up for its data
//! until it runs again; a producer killed there closes `K`, which wakes us with HUP.)
//!
//! **Edge-triggered waiters** get one event per rising edge (per token). A TCP socket may
//! signal again for every segment that arrives while it is already readable; an ET
//! application must read until `EAGAIN` either way, so it cannot tell the difference, and the
//! hooks report `EAGAIN` only after a lowering, which re-arms the edge.
//!
//! **No local raise for IN.** Only `K` writes into `M`'s receive queue, so we cannot make `M`
//! readable ourselves, and the token protocol never needs to: it never consumes a token before
//! knowing the queue is empty. Readability from local causes is terminal and is expressed by
//! shutdown: [`Mirror::set_read_hup`] (peer FIN learnt from the session, or an error to
//! report), which makes `M` readable for good.
//!
//! # Writable (OUT): filling M's send buffer
//!
//! `M` is writable (for `AF_UNIX`) while 4 × its queued bytes ≤ its `SO_SNDBUF`. `M` gets the
//! smallest send buffer the kernel allows; [`Mirror::lower_writable`] writes filler bytes into
//! `M` until `EAGAIN` (they queue in `K`, [`Mirror::last_fill_bytes`] tells how many), *then*
//! puts the `write_lowered` flag up and re-checks for space. The peer, after returning space,
//! calls [`raise_writable`]: with the flag up it CASes it 1→0 and drains the filler queued in
//! `K` (one short read takes it all), which makes `M` writable and wakes its waiters. Because
//! the flag goes up only after the fill, a peer's drain can never precede the fill it is meant
//! to undo; a drain racing with a *newer* fill can eat part of it, which leaves `M` spuriously
//! writable until our next lowering (a write then finds no space, and lowering again fills).
//!
//! **Local raise for OUT (necessary).** If the re-check finds space and we win the CAS back
//! (the peer checked the flag before we raised it and will not drain), `M` is full and nobody
//! will drain it. We then raise writability locally by *enlarging* `M`'s `SO_SNDBUF`: the kernel
//! re-evaluates writability and wakes waiters on that `setsockopt`. The filler stays parked in
//! `K` (bounded: one fill), and the next lowering shrinks the buffer again, which makes `M`
//! unwritable with no new filler.
//!
//! # Hang-up and errors
//!
//! | event                               | call                          | `M` reports            |
//! |-------------------------------------|-------------------------------|------------------------|
//! | peer's FIN (peer side)              | [`mirror_peer_fin`]`(K)`      | IN, RDHUP              |
//! | peer's FIN learnt locally           | [`Mirror::set_read_hup`]      | IN, RDHUP              |
//! | our `shutdown(SHUT_WR)`             | [`Mirror::shutdown_write`]    | OUT (as TCP), no HUP   |
//! | both of the above                   |                               | IN, RDHUP, HUP         |
//! | peer closes `K` or dies             | (kernel)                      | IN, RDHUP, HUP (+ERR)  |
//!
//! **What differs from TCP.** A TCP peer that dies sends a FIN (our side: IN|RDHUP, HUP only
//! after our own shutdown) or, if it had unread data, an RST (ERR|HUP). `M` shows HUP at once
//! when `K` closes. It shows ERR (the socket's `sk_err = ECONNRESET`) only if `K` still held
//! unread filler, i.e. the peer died while we were lowered-writable — the case where TCP would
//! answer our next send with an RST. `M` cannot show other errors: the hook reports the session's
//! error on the next call, and `M` being readable (HUP) is what makes the application make that
//! call. Urgent data (EPOLLPRI) is not mirrored (`AF_UNIX` `MSG_OOB` could, if ever needed).
//!
//! # Concurrency contract
//!
//! One [`Mirror`] per SAN socket, used by one thread at a time (`&mut self`: the hook layer's
//! per-socket lock serialises it); any number of peer threads may call [`raise_readable`] and
//! [`raise_writable`] concurrently. The caller must call `raise_*` *after* publishing the data or
//! space (any store; the fences here order it), and must report `EAGAIN` to the application only
//! after a lowering returned [`ReadLowering::Lowered`] / [`WriteLowering::Lowered`] (or a state
//! that says the flag was already down): the other results mean data or space is there.

use core::mem::size_of;
use core::ops::Deref;
use core::sync::atomic::{fence, AtomicU32, Ordering};
use core::{fmt, ptr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::errno;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Errors of the mirror (rustls-style: each variant a cause a caller may act on).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MirrorError {
    /// `net.core.wmem_max` is too small to raise writability locally (see the module docs);
    /// the socket must stay on TCP.
    SendBufferLimit {
        /// Effective `SO_SNDBUF` when lowered.
        small: i32,
        /// Largest effective `SO_SNDBUF` the kernel granted.
        large: i32,
    },
    /// [`send_fd`] needs at least one payload byte (a stream socket carries ancillary data only
    /// with data).
    EmptyPayload,
    /// [`recv_fd`]: the sender's descriptors did not fit our control buffer (the kernel closed
    /// the excess).
    AncillaryTruncated,
    /// The token we peeked was gone when we consumed it: someone else reads `M`.
    TokenStolen,
    /// An unexpected system-call failure.
    Os {
        /// What was being done.
        op: &'static str,
        /// The `errno`.
        errno: i32,
    },
}

impl MirrorError {
    fn last_os(op: &'static str) -> MirrorError {
        MirrorError::Os {
            op,
            errno: errno::get(),
        }
    }
}

impl fmt::Display for MirrorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MirrorError::SendBufferLimit { small, large } => write!(
                f,
                "SO_SNDBUF cannot grow enough to raise writability (lowered {small}, max {large}): \
                 raise net.core.wmem_max"
            ),
            MirrorError::EmptyPayload => f.write_str("passing a descriptor needs a payload byte"),
            MirrorError::AncillaryTruncated => f.write_str("received descriptors were truncated"),
            MirrorError::TokenStolen => f.write_str("mirror token consumed by someone else"),
            MirrorError::Os { op, errno } => {
                write!(f, "{op}: {}", std::io::Error::from_raw_os_error(*errno))
            }
        }
    }
}

impl std::error::Error for MirrorError {}

// ---------------------------------------------------------------------------------------------
// Shared words
// ---------------------------------------------------------------------------------------------

/// The mirror's shared state: mapped by both processes (an anonymous shared mapping in tests, a
/// field of the shm segment in production). All-zero bytes are a valid initial value.
#[repr(C)]
#[derive(Debug, Default)]
pub struct MirrorWords {
    /// 1 while a token is in `M` or being written to it (the current readable edge).
    readable: AtomicU32,
    /// 1 while `M` is filled and the peer owes a drain of `K` when space returns.
    write_lowered: AtomicU32,
}

// Both processes map these words: their layout is part of the segment format.
const _: () = assert!(size_of::<MirrorWords>() == 8 && core::mem::align_of::<MirrorWords>() == 4);

impl MirrorWords {
    /// Both flags down: `M` not readable, writable.
    pub const fn new() -> MirrorWords {
        MirrorWords {
            readable: AtomicU32::new(0),
            write_lowered: AtomicU32::new(0),
        }
    }

    /// Whether the readable flag is up (diagnostics).
    pub fn is_readable_raised(&self) -> bool {
        self.readable.load(Ordering::Relaxed) != 0
    }

    /// Whether writability is lowered and awaiting the peer (diagnostics).
    pub fn is_write_lowered(&self) -> bool {
        self.write_lowered.load(Ordering::Relaxed) != 0
    }
}

// ---------------------------------------------------------------------------------------------
// Results
// ---------------------------------------------------------------------------------------------

/// What [`Mirror::lower_readable`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReadLowering {
    /// The flag was already down: `M` was not readable (no system call made).
    NotRaised,
    /// The token is consumed: `M` is no longer readable (unless at end of file); any later
    /// push raises it again.
    Lowered,
    /// Data arrived meanwhile: `M` stays readable. Read again instead of reporting `EAGAIN`.
    StillReadable,
    /// The current edge's token is still being written by the peer: `M` will turn readable
    /// shortly (spuriously if the data was already consumed; lower again then).
    TokenInFlight,
    /// `M` is at end of file (peer FIN, [`Mirror::set_read_hup`] or peer death): it stays
    /// readable for good.
    Hangup,
}

/// What [`Mirror::lower_writable`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WriteLowering {
    /// `M` is unwritable until the peer calls [`raise_writable`].
    Lowered,
    /// Space returned meanwhile and `M` was raised again locally: write instead of `EAGAIN`.
    StillWritable,
    /// Space returned meanwhile and the peer is draining `K`: `M` turns writable shortly.
    RaisePending,
    /// Writing was shut down ([`Mirror::shutdown_write`]): like TCP, `M` stays writable.
    Shutdown,
    /// `K` is closed (the peer is gone): `M` shows HUP.
    Hangup,
}

/// What [`raise_readable`] / [`raise_writable`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Raise {
    /// The flag was already in the raised state: nothing to do (no system call).
    AlreadyRaised,
    /// This call made the edge (wrote the token / drained `K`).
    Raised,
    /// `M` is closed or shut down for reading: nobody is waiting any more.
    MirrorClosed,
}

// ---------------------------------------------------------------------------------------------
// System-call helpers
// ---------------------------------------------------------------------------------------------

fn set_sndbuf(fd: BorrowedFd<'_>, request: libc::c_int) -> Result<libc::c_int, MirrorError> {
    // SAFETY: `request` is a c_int of the given size.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&request as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(MirrorError::last_os("setsockopt SO_SNDBUF"));
    }
    let mut effective: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `effective`.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&mut effective as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(MirrorError::last_os("getsockopt SO_SNDBUF"));
    }
    Ok(effective)
}

/// `recv(fd, 1 byte, flags | MSG_DONTWAIT)`: `Ok(true)` a byte, `Ok(false)` end of file.
fn recv_one(fd: BorrowedFd<'_>, flags: libc::c_int) -> Result<bool, i32> {
    let mut byte = 0u8;
    // SAFETY: one writable byte.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            flags | libc::MSG_DONTWAIT,
        )
    };
    match n {
        1 => Ok(true),
        0 => Ok(false),
        _ => Err(errno::get()),
    }
}

/// The filler for lowering writability; larger than any minimal send buffer, so one `send`
/// usually fills `M` (it returns short when the buffer is full).
static FILLER: [u8; 16 << 10] = [0; 16 << 10];

/// Request for the lowered state: the kernel clamps it up to its minimum (`SOCK_MIN_SNDBUF`).
const SMALL_SNDBUF_REQUEST: libc::c_int = 1;
/// Request for the locally raised state (doubled by the kernel, capped by `wmem_max`).
const LARGE_SNDBUF_REQUEST: libc::c_int = 256 << 10;

// ---------------------------------------------------------------------------------------------
// Our side
// ---------------------------------------------------------------------------------------------

/// Our end `M` of a SAN socket's readiness mirror, with the shared words `W` points to.
#[derive(Debug)]
pub struct Mirror<W: Deref<Target = MirrorWords>> {
    words: W,
    m: OwnedFd,
    small_sndbuf: libc::c_int,
    large_sndbuf: libc::c_int,
    sndbuf_is_large: bool,
    write_shut: bool,
    last_fill: usize,
}

impl<W: Deref<Target = MirrorWords>> Mirror<W> {
    /// Creates the socketpair (both ends nonblocking, close-on-exec) and returns the mirror and
    /// the peer's end `K`, to be passed with [`send_fd`] and then dropped.
    ///
    /// `words` must be in their initial state ([`MirrorWords::new`], or zeroed memory).
    ///
    /// # Errors
    /// System-call failures, and [`MirrorError::SendBufferLimit`] when the host forbids the
    /// send-buffer sizes the OUT protocol needs.
    pub fn new(words: W) -> Result<(Mirror<W>, OwnedFd), MirrorError> {
        let mut fds = [0 as libc::c_int; 2];
        let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
        // SAFETY: `fds` has room for the two descriptors.
        if unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) } != 0 {
            return Err(MirrorError::last_os("socketpair"));
        }
        // SAFETY: socketpair returned two fresh descriptors owned by nobody else.
        let (m, k) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let large = set_sndbuf(m.as_fd(), LARGE_SNDBUF_REQUEST)?;
        let small = set_sndbuf(m.as_fd(), SMALL_SNDBUF_REQUEST)?;
        // A fill stops once the queued bytes reach `small`, overshooting by at most one
        // segment of at most `small / 2`; the raised state needs 4 × that within `large`.
        if i64::from(large) < 4 * (i64::from(small) * 3 / 2 + 4096) {
            return Err(MirrorError::SendBufferLimit { small, large });
        }
        let mirror = Mirror {
            words,
            m,
            small_sndbuf: small,
            large_sndbuf: large,
            sndbuf_is_large: false,
            write_shut: false,
            last_fill: 0,
        };
        Ok((mirror, k))
    }

    /// The shared words.
    pub fn words(&self) -> &MirrorWords {
        &self.words
    }

    /// Bytes the last [`lower_writable`](Self::lower_writable) wrote to make `M` unwritable
    /// (0 if filler was already parked).
    pub fn last_fill_bytes(&self) -> usize {
        self.last_fill
    }

    /// The effective `SO_SNDBUF` of `M` in the lowered and the locally raised state.
    pub fn send_buffer_sizes(&self) -> (i32, i32) {
        (self.small_sndbuf, self.large_sndbuf)
    }

    /// `M`'s current readiness (`poll` with a zero timeout): a `POLL*` bit set.
    ///
    /// # Errors
    /// `poll` failures.
    pub fn poll_now(&self) -> Result<libc::c_short, MirrorError> {
        let mut pfd = libc::pollfd {
            fd: self.m.as_raw_fd(),
            events: libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, 0) } < 0 {
            return Err(MirrorError::last_os("poll mirror"));
        }
        Ok(pfd.revents)
    }

    /// Lowers `M`'s readability because our receive queue became empty (see the module docs).
    /// `data_available` re-reads the receive queue after the flag went down.
    ///
    /// # Errors
    /// An unexpected `recv` failure, or [`MirrorError::TokenStolen`].
    pub fn lower_readable(
        &mut self,
        data_available: impl FnOnce() -> bool,
    ) -> Result<ReadLowering, MirrorError> {
        if self.words.readable.load(Ordering::Acquire) == 0 {
            return Ok(ReadLowering::NotRaised);
        }
        match recv_one(self.m.as_fd(), libc::MSG_PEEK) {
            Ok(true) => {}
            Ok(false) => return Ok(ReadLowering::Hangup),
            Err(libc::EAGAIN) => return Ok(ReadLowering::TokenInFlight),
            // `K` closed with filler unread: the peer is gone (the error is reported once).
            Err(libc::ECONNRESET) => return Ok(ReadLowering::Hangup),
            Err(errno) => {
                return Err(MirrorError::Os {
                    op: "peek mirror token",
                    errno,
                })
            }
        }
        self.words.readable.store(0, Ordering::Relaxed);
        // Pairs with the fence in `raise_readable`: either the producer sees the flag down (and
        // sends a new token) or we see its data below.
        fence(Ordering::SeqCst);
        let outcome = if data_available() {
            let kept =
                self.words
                    .readable
                    .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed);
            if kept.is_ok() {
                // The peeked token stands for the data that is there.
                return Ok(ReadLowering::StillReadable);
            }
            // A producer raised a new edge: its token replaces ours.
            ReadLowering::StillReadable
        } else {
            ReadLowering::Lowered
        };
        match recv_one(self.m.as_fd(), 0) {
            Ok(true) => Ok(outcome),
            Ok(false) | Err(libc::EAGAIN) => Err(MirrorError::TokenStolen),
            Err(libc::ECONNRESET) => Ok(ReadLowering::Hangup),
            Err(errno) => Err(MirrorError::Os {
                op: "consume mirror token",
                errno,
            }),
        }
    }

    /// Lowers `M`'s writability because we ran out of credits or send space (see the module
    /// docs). `space_available` re-reads the send state after the flag went up.
    ///
    /// # Errors
    /// Unexpected `send`/`setsockopt` failures.
    pub fn lower_writable(
        &mut self,
        space_available: impl FnOnce() -> bool,
    ) -> Result<WriteLowering, MirrorError> {
        if self.write_shut {
            return Ok(WriteLowering::Shutdown);
        }
        if self.sndbuf_is_large {
            set_sndbuf(self.m.as_fd(), SMALL_SNDBUF_REQUEST)?;
            self.sndbuf_is_large = false;
        }
        self.last_fill = 0;
        loop {
            // SAFETY: FILLER is a valid readable buffer of this length.
            let n = unsafe {
                libc::send(
                    self.m.as_raw_fd(),
                    FILLER.as_ptr().cast(),
                    FILLER.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                match errno::get() {
                    libc::EAGAIN => break,
                    libc::EPIPE | libc::ECONNRESET => return Ok(WriteLowering::Hangup),
                    errno => {
                        return Err(MirrorError::Os {
                            op: "fill mirror",
                            errno,
                        })
                    }
                }
            }
            self.last_fill += n as usize;
            if (n as usize) < FILLER.len() {
                // A short write stops exactly when the send buffer is full.
                break;
            }
        }
        // Only now may the peer drain: its drain cannot precede the fill it undoes.
        self.words.write_lowered.store(1, Ordering::Relaxed);
        // Pairs with the fence in `raise_writable`.
        fence(Ordering::SeqCst);
        if !space_available() {
            return Ok(WriteLowering::Lowered);
        }
        let took_back =
            self.words
                .write_lowered
                .compare_exchange(1, 0, Ordering::AcqRel, Ordering::Relaxed);
        if took_back.is_err() {
            return Ok(WriteLowering::RaisePending);
        }
        self.raise_writable_local()?;
        Ok(WriteLowering::StillWritable)
    }

    /// Makes `M` writable without the peer: enlarges its send buffer over the parked filler.
    /// `setsockopt(SO_SNDBUF)` calls the socket's write-space callback, which wakes waiters.
    fn raise_writable_local(&mut self) -> Result<(), MirrorError> {
        set_sndbuf(self.m.as_fd(), LARGE_SNDBUF_REQUEST)?;
        self.sndbuf_is_large = true;
        Ok(())
    }

    /// Mirrors our own `shutdown(SHUT_WR)`: `shutdown(M, SHUT_WR)`, and `M` stays writable from
    /// now on, as a TCP socket does (a write then fails with `EPIPE` at once instead of
    /// blocking). Together with a read hang-up, `M` reports HUP.
    ///
    /// # Errors
    /// `shutdown`/`setsockopt` failures.
    pub fn shutdown_write(&mut self) -> Result<(), MirrorError> {
        if self.write_shut {
            return Ok(());
        }
        shutdown(self.m.as_fd(), libc::SHUT_WR, "shutdown mirror for writing")?;
        self.write_shut = true;
        self.words.write_lowered.store(0, Ordering::Relaxed);
        self.raise_writable_local()
    }

    /// Marks `M` at end of file from our side: it reports IN|RDHUP for good. For a peer FIN
    /// learnt from the session (rather than mirrored by the peer with [`mirror_peer_fin`]), or a
    /// local error the application must wake up for.
    ///
    /// # Errors
    /// `shutdown` failures.
    pub fn set_read_hup(&mut self) -> Result<(), MirrorError> {
        shutdown(self.m.as_fd(), libc::SHUT_RD, "shutdown mirror for reading")
    }
}

impl<W: Deref<Target = MirrorWords>> AsFd for Mirror<W> {
    /// `M`: what the epoll/poll/select hooks wait on.
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.m.as_fd()
    }
}

fn shutdown(fd: BorrowedFd<'_>, how: libc::c_int, op: &'static str) -> Result<(), MirrorError> {
    // SAFETY: plain shutdown(2) on a descriptor we hold.
    if unsafe { libc::shutdown(fd.as_raw_fd(), how) } != 0 && errno::get() != libc::ENOTCONN {
        return Err(MirrorError::last_os(op));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The peer's side
// ---------------------------------------------------------------------------------------------

/// Raises the other side's `M` readable after we pushed data to it (we hold its `K`). At most
/// one token per rising edge; no system call while the flag is up.
pub fn raise_readable(words: &MirrorWords, k: BorrowedFd<'_>) -> Raise {
    // Pairs with the fence in `Mirror::lower_readable`: the data we pushed before this call is
    // visible to the consumer's re-check, or we see its flag down.
    fence(Ordering::SeqCst);
    if words.readable.load(Ordering::Relaxed) != 0
        || words
            .readable
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
    {
        return Raise::AlreadyRaised;
    }
    let token = 1u8;
    // SAFETY: one readable byte.
    let n = unsafe {
        libc::send(
            k.as_raw_fd(),
            (&token as *const u8).cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n == 1 {
        Raise::Raised
    } else {
        // EPIPE: `M` closed or shut for reading, nobody waits. (EAGAIN cannot happen: at most
        // two tokens are ever queued.)
        Raise::MirrorClosed
    }
}

/// Raises the other side's `M` writable after we returned space or credits to it (we hold
/// its `K`): drains `K` if that side lowered writability.
pub fn raise_writable(words: &MirrorWords, k: BorrowedFd<'_>) -> Raise {
    // Pairs with the fence in `Mirror::lower_writable`.
    fence(Ordering::SeqCst);
    if words.write_lowered.load(Ordering::Relaxed) == 0
        || words
            .write_lowered
            .compare_exchange(1, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
    {
        return Raise::AlreadyRaised;
    }
    // Every filler byte of the edge we now own was queued before that side raised the flag,
    // so one read that comes back short has taken all of them. Reading on until EAGAIN would
    // also eat the filler of a *newer* lowering racing with us and leave that side spuriously
    // writable. The sink holds the largest possible backlog (parked filler plus one fill).
    let mut sink = [0u8; 16 << 10];
    loop {
        // SAFETY: `sink` is writable for its length.
        let n = unsafe {
            libc::recv(
                k.as_raw_fd(),
                sink.as_mut_ptr().cast(),
                sink.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            n if n as usize == sink.len() => continue,
            n if n > 0 => return Raise::Raised,
            // `M` shut for writing or closed: nothing to wait for any more.
            0 => return Raise::MirrorClosed,
            // EAGAIN: nothing was queued (the filler was already drained by an older raise).
            _ => return Raise::Raised,
        }
    }
}

/// Mirrors our FIN to the other side: `shutdown(K, SHUT_WR)`, so its `M` reports IN|RDHUP.
/// Keep `K` open until the session is over: closing it is what reports HUP.
///
/// # Errors
/// `shutdown` failures.
pub fn mirror_peer_fin(k: BorrowedFd<'_>) -> Result<(), MirrorError> {
    shutdown(k, libc::SHUT_WR, "shutdown mirror peer end")
}

// ---------------------------------------------------------------------------------------------
// Descriptor passing
// ---------------------------------------------------------------------------------------------

/// Control buffer with room for a few descriptors (extras a hostile sender adds are closed),
/// aligned for `cmsghdr`.
#[repr(C, align(8))]
struct ControlBuffer([u8; 64]);

const MAX_RECEIVED_FDS: usize = 4;

/// Sends `fd` over the Unix socket `socket` with `SCM_RIGHTS`, along with `payload` (at least
/// one byte). Returns the payload bytes sent (the descriptor travels with the first).
///
/// # Errors
/// [`MirrorError::EmptyPayload`]; `sendmsg` failures (`EAGAIN` on a full nonblocking socket).
pub fn send_fd(
    socket: BorrowedFd<'_>,
    fd: BorrowedFd<'_>,
    payload: &[u8],
) -> Result<usize, MirrorError> {
    if payload.is_empty() {
        return Err(MirrorError::EmptyPayload);
    }
    let mut control = ControlBuffer([0; 64]);
    // SAFETY: pure size arithmetic.
    let space = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as usize;
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr().cast_mut().cast(),
        iov_len: payload.len(),
    };
    // SAFETY: msghdr is plain data; zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at a control buffer of `space` ≤ 64 bytes, so the first header
    // exists and has room for one c_int of data.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
        ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
    }
    // SAFETY: `msg` and everything it points to are valid for the call; iov is only read.
    let n = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(MirrorError::last_os("sendmsg SCM_RIGHTS"));
    }
    Ok(n as usize)
}

/// Receives payload bytes into `buf` and the descriptor sent with them, if any (close-on-exec).
/// Returns `(0, None)` at end of file. Surplus descriptors are closed.
///
/// # Errors
/// [`MirrorError::AncillaryTruncated`] (any received descriptors are closed); `recvmsg`
/// failures.
pub fn recv_fd(
    socket: BorrowedFd<'_>,
    buf: &mut [u8],
) -> Result<(usize, Option<OwnedFd>), MirrorError> {
    let mut control = ControlBuffer([0; 64]);
    // SAFETY: pure size arithmetic.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_RECEIVED_FDS * size_of::<libc::c_int>()) as u32) } as usize;
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is plain data; zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space.min(control.0.len()) as _;
    // SAFETY: `msg` and the buffers it points to are valid and writable for the call.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(MirrorError::last_os("recvmsg SCM_RIGHTS"));
    }
    let mut received: Option<OwnedFd> = None;
    // SAFETY: the kernel filled `msg_controllen` bytes of well-formed headers; the CMSG_*
    // macros stay within them.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                let header = libc::CMSG_LEN(0) as usize;
                let count =
                    ((*cmsg).cmsg_len as usize).saturating_sub(header) / size_of::<libc::c_int>();
                for index in 0..count {
                    let raw = ptr::read_unaligned(data.add(index));
                    // Every descriptor received is ours to own (and close if surplus).
                    let owned = OwnedFd::from_raw_fd(raw);
                    if received.is_none() {
                        received = Some(owned);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(MirrorError::AncillaryTruncated);
    }
    Ok((n as usize, received))
}
