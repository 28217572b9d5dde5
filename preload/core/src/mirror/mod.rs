//! The readiness mirror: kernel-visible readiness for a SAN socket.
//!
//! The design is in `docs/ARCHITECTURE.md` ("Readiness: a mirror socketpair per SAN socket").
//! A [`Mirror`] owns the *watched end*, one end of an `AF_UNIX` stream socketpair; the other end, the *raising end*, goes to
//! the peer process (with [`send_fd`]) and is closed here. The epoll/poll/select hooks wait on
//! the watched end in place of the application's fd, so every kernel waiting feature (ET, ONESHOT,
//! EXCLUSIVE, nested epoll, epoll sets shared across fork) works unchanged. The words of a
//! [`MirrorWords`] that both processes map keep the watched end's readiness equal to the session's.
//!
//! # Readable (IN): tokens
//!
//! The watched end is readable while it holds a *token* byte. The shared `readable` word counts the tokens
//! written to the watched end (or being written) that no lowering has claimed; we keep a local count of
//! tokens claimed but not yet arrived. Invariant: `tokens in the watched end + tokens being written ==
//! readable + claimed_unread`.
//!
//! * The peer, after pushing data, calls [`raise_readable`]: if the count is zero it CASes it
//!   0→1 and writes one token to the raising end (a rising edge). With the count up it returns without a
//!   system call — unless we asked for an edge per arrival (below).
//! * We, when our receive queue became empty, call [`Mirror::lower_readable`]: it claims the
//!   count (swap to 0), then re-checks for data (Dekker with the peer's push: `SeqCst` fences
//!   on both sides, so at least one of the two sees the other). Data present: it hands the
//!   claimed count back and leaves the tokens in the watched end. No data: it consumes the claimed tokens
//!   that have arrived; one still being written (the producer is between its count update and
//!   its write, [`ReadLowering::TokenInFlight`]) is consumed by a later lowering.
//!
//! So no wake-up is lost (data pushed after our claim finds the count at zero and raises; data
//! pushed before it is seen by our re-check) and no newer edge loses its token: we consume
//! only as many tokens as we claimed. The only imprecision is spurious readiness: a claimed
//! token that arrives after we emptied the queue makes the watched end readable once with nothing to read.
//! The kernel allows that of any socket (another thread may have read first), the hooks drop
//! such an event after checking the session, and the next lowering removes it. (A producer
//! *stopped* between its count update and its write, e.g. by SIGSTOP, delays the wake-up for
//! its data until it runs again; a producer killed there closes the raising end, which wakes us with HUP.)
//!
//! **Edge-triggered waiters.** By default the peer writes one token per rising edge, so an
//! edge-triggered waiter gets one event per rising edge. A TCP socket signals again for every
//! segment that arrives while it is already readable, and programs can tell the difference (a
//! reader that stops before `EAGAIN` waits for the next arrival). So while an edge-triggered
//! epoll registration watches the watched end, we set [`Mirror::set_edge_per_arrival`] in our words, and
//! the peer then writes a token on every raise (up to 64 unclaimed): a
//! write to the raising end while the watched end already holds unread bytes wakes epoll again, exactly as an arriving
//! segment does. The count covers those tokens too, so lowering stays exact.
//!
//! **No local raise for IN.** Only the raising end writes into the watched end's receive queue, so we cannot make the watched end
//! readable ourselves, and the token protocol never needs to: it never consumes a token before
//! knowing the queue is empty. Readability from local causes is terminal and is expressed by
//! shutdown: [`Mirror::set_read_hup`] (peer FIN learnt from the session, or an error to
//! report), which makes the watched end readable for good.
//!
//! # Writable (OUT): filling the watched end's send buffer
//!
//! The watched end is writable (for `AF_UNIX`) while 4 × its queued bytes ≤ its `SO_SNDBUF`. The watched end gets the
//! smallest send buffer the kernel allows; [`Mirror::lower_writable`] writes filler bytes into
//! the watched end until `EAGAIN` (they queue in the raising end, [`Mirror::last_fill_bytes`] tells how many), *then*
//! puts the `write_lowered` flag up and re-checks for space. The peer, after returning space,
//! calls [`raise_writable`]: with the flag up it CASes it 1→0 and drains the filler queued in
//! the raising end (one short read takes it all), which makes the watched end writable and wakes its waiters. Because
//! the flag goes up only after the fill, a peer's drain can never precede the fill it is meant
//! to undo; a drain racing with a *newer* fill can eat part of it, which leaves the watched end spuriously
//! writable until our next lowering (a write then finds no space, and lowering again fills).
//!
//! **Local raise for OUT (necessary).** If the re-check finds space and we win the CAS back
//! (the peer checked the flag before we raised it and will not drain), the watched end is full and nobody
//! will drain it. We then raise writability locally by *enlarging* the watched end's `SO_SNDBUF`: the kernel
//! re-evaluates writability and wakes waiters on that `setsockopt`. The filler stays parked in
//! the raising end (bounded: one fill), and the next lowering shrinks the buffer again, which makes the watched end
//! unwritable with no new filler.
//!
//! # Hang-up and errors
//!
//! | event                               | call                          | The watched end reports            |
//! |-------------------------------------|-------------------------------|------------------------|
//! | peer's FIN (peer side)              | [`mirror_peer_fin`]`(raising)`      | IN, RDHUP              |
//! | peer's FIN learnt locally           | [`Mirror::set_read_hup`]      | IN, RDHUP              |
//! | our `shutdown(SHUT_WR)`             | [`Mirror::shutdown_write`]    | OUT (as TCP), no HUP   |
//! | both of the above                   |                               | IN, RDHUP, HUP         |
//! | peer closes the raising end or dies             | (kernel)                      | IN, RDHUP, HUP (+ERR)  |
//!
//! **What differs from TCP.** A TCP peer that dies sends a FIN (our side: IN|RDHUP, HUP only
//! after our own shutdown) or, if it had unread data, an RST (ERR|HUP). The watched end shows HUP at once
//! when the raising end closes. It shows ERR (the socket's `sk_err = ECONNRESET`) only if the raising end still held
//! unread filler, i.e. the peer died while we were lowered-writable — the case where TCP would
//! answer our next send with an RST. The watched end cannot show other errors: the hook reports the session's
//! error on the next call, and the watched end being readable (HUP) is what makes the application make that
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
    /// Tokens written to the watched end (or being written) that no lowering has claimed yet: nonzero
    /// while the watched end is raised readable. 1 per rising edge, plus one per further arrival while
    /// `edge_per_arrival` is set.
    readable: AtomicU32,
    /// 1 while the watched end is filled and the peer owes a drain of the raising end when space returns.
    write_lowered: AtomicU32,
    /// Set by the owner of the watched end while an edge-triggered epoll registration watches it: the peer
    /// then writes a token for every arrival, not only for the rising edge.
    edge_per_arrival: AtomicU32,
    /// Set by the owner of the watched end when it left the application's call with stream bytes it could
    /// not transmit yet (no credits, or the handshake not done): nobody in its process may
    /// call in for a long time, so the peer, when it next transmits (its `Hello`, returned
    /// credits), nudges the owner's process to move them (`san::nudge`).
    progress_wanted: AtomicU32,
    /// Threads of the owner inside a send or receive call on the socket. Such a call drives
    /// the connection before it returns (asleep in it, the peer's next message wakes it), and
    /// its end re-checks the inbound queue after leaving ([`MirrorWords::leave_call`]): while
    /// one is under way, the peer need not nudge the owner's process for what it transmits.
    in_call: AtomicU32,
}

// Both processes map these words: their layout is part of the segment format.
const _: () = assert!(size_of::<MirrorWords>() == 20 && core::mem::align_of::<MirrorWords>() == 4);

/// Most tokens queued in the watched end at once in the edge-per-arrival mode. Far below what the raising end's send
/// buffer holds (each one-byte token costs one skb), so a token write never meets `EAGAIN`;
/// arrivals beyond it, before the owner reads anything, make no further edge.
const MAX_QUEUED_TOKENS: u32 = 64;

impl MirrorWords {
    /// Initial state: the watched end not readable, writable, one token per rising edge.
    pub const fn new() -> MirrorWords {
        MirrorWords {
            readable: AtomicU32::new(0),
            write_lowered: AtomicU32::new(0),
            edge_per_arrival: AtomicU32::new(0),
            progress_wanted: AtomicU32::new(0),
            in_call: AtomicU32::new(0),
        }
    }

    /// The owner's side: one of its threads enters a send or receive call on the socket.
    pub fn enter_call(&self) {
        self.in_call.fetch_add(1, Ordering::Relaxed);
    }

    /// The owner's side: a call counted by [`MirrorWords::enter_call`] ends. The caller then
    /// asks for a nudge if it leaves bytes untransmitted ([`MirrorWords::set_progress_wanted`],
    /// whose fence orders this before its re-check of the inbound queue).
    pub fn leave_call(&self) {
        // (Saturating: a count left wrong by a bug must not read as a call forever under way.)
        let _ = self
            .in_call
            .fetch_update(Ordering::Release, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// The owner's side: whether it waits for the peer's help to transmit what it queued
    /// (see the field). A store only when the value changes.
    ///
    /// Setting it is followed by a full fence: the owner then re-checks its inbound queue,
    /// and the peer, which publishes there before [`MirrorWords::take_progress_wanted`],
    /// either sees the word or has its message seen.
    pub fn set_progress_wanted(&self, wanted: bool) {
        let wanted = u32::from(wanted);
        if self.progress_wanted.load(Ordering::Relaxed) != wanted {
            self.progress_wanted.store(wanted, Ordering::Release);
        }
        if wanted != 0 {
            fence(Ordering::SeqCst);
        }
    }

    /// The peer's side, after publishing what it transmitted: true (once) if the owner asked
    /// for a nudge since the last call and none of its threads is inside a call now. A call
    /// under way sees what was published (it drives before it returns, and its end re-checks
    /// the inbound queue after [`MirrorWords::leave_call`]), so the request stays for a later
    /// transmission, when the owner may be idle.
    pub fn take_progress_wanted(&self) -> bool {
        // Pairs with the fence in `set_progress_wanted`: either the owner's re-check after
        // leaving its call sees what we published, or we see the call ended.
        fence(Ordering::SeqCst);
        self.in_call.load(Ordering::Relaxed) == 0
            && self.progress_wanted.load(Ordering::Relaxed) != 0
            && self.progress_wanted.swap(0, Ordering::AcqRel) != 0
    }

    /// Whether the watched end is raised readable (unclaimed tokens counted): a poll that
    /// begins with it raised returns at once.
    pub fn is_readable_raised(&self) -> bool {
        self.readable.load(Ordering::Relaxed) != 0
    }

    /// Tokens written to the watched end (or being written) that no lowering has claimed.
    pub fn unclaimed_tokens(&self) -> u32 {
        self.readable.load(Ordering::Relaxed)
    }

    /// Whether the peer writes a token for every arrival (see
    /// [`Mirror::set_edge_per_arrival`]).
    pub fn is_edge_per_arrival(&self) -> bool {
        self.edge_per_arrival.load(Ordering::Relaxed) != 0
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
    /// Nothing was counted or owed: the watched end was not readable (no system call made).
    NotRaised,
    /// The token is consumed: the watched end is no longer readable (unless at end of file); any later
    /// push raises it again.
    Lowered,
    /// Data arrived meanwhile: the watched end stays readable. Read again instead of reporting `EAGAIN`.
    StillReadable,
    /// Lowered, but a token this lowering claimed is still being written by the peer: the watched end
    /// turns readable shortly, spuriously (the next lowering consumes it).
    TokenInFlight,
    /// The watched end is at end of file (peer FIN, [`Mirror::set_read_hup`] or peer death): it stays
    /// readable for good.
    Hangup,
}

/// What [`Mirror::lower_writable`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WriteLowering {
    /// The watched end is unwritable until the peer calls [`raise_writable`].
    Lowered,
    /// Space returned meanwhile and the watched end was raised again locally: write instead of `EAGAIN`.
    StillWritable,
    /// Space returned meanwhile and the peer is draining the raising end: the watched end turns writable shortly.
    RaisePending,
    /// Writing was shut down ([`Mirror::shutdown_write`]): like TCP, the watched end stays writable.
    Shutdown,
    /// The raising end is closed (the peer is gone): the watched end shows HUP.
    Hangup,
}

/// What [`raise_readable`] / [`raise_writable`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Raise {
    /// The flag was already in the raised state: nothing to do (no system call).
    AlreadyRaised,
    /// This call made an edge (wrote a token / drained the raising end).
    Raised,
    /// The watched end is closed or shut down for reading: nobody is waiting any more.
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

/// The filler for lowering writability; larger than any minimal send buffer, so one `send`
/// usually fills the watched end (it returns short when the buffer is full).
static FILLER: [u8; 16 << 10] = [0; 16 << 10];

/// Request for the lowered state: the kernel clamps it up to its minimum (`SOCK_MIN_SNDBUF`).
const SMALL_SNDBUF_REQUEST: libc::c_int = 1;
/// Request for the locally raised state (doubled by the kernel, capped by `wmem_max`).
const LARGE_SNDBUF_REQUEST: libc::c_int = 256 << 10;

// ---------------------------------------------------------------------------------------------
// Our side
// ---------------------------------------------------------------------------------------------

/// Our watched end of a SAN socket's readiness mirror, with the shared words `W` points to.
#[derive(Debug)]
pub struct Mirror<W: Deref<Target = MirrorWords>> {
    words: W,
    m: OwnedFd,
    small_sndbuf: libc::c_int,
    large_sndbuf: libc::c_int,
    sndbuf_is_large: bool,
    write_shut: bool,
    last_fill: usize,
    /// Tokens a lowering claimed (took off the count) that had not arrived in the watched end yet: the
    /// next lowerings consume them as they arrive.
    claimed_unread: u32,
}

/// The two ends of a mirror's socketpair, both at or above the internal descriptor floor
/// (see [`move_internal_fd`]), before they become a [`Mirror`].
#[derive(Debug)]
pub struct MirrorEnds {
    m: OwnedFd,
    k: OwnedFd,
}

impl MirrorEnds {
    /// Creates the socketpair (both ends nonblocking, close-on-exec).
    ///
    /// # Errors
    /// The `socketpair` failure, or `EMFILE` when no number above the application's is free.
    pub fn new() -> Result<MirrorEnds, MirrorError> {
        let mut fds = [0 as libc::c_int; 2];
        let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
        // SAFETY: `fds` has room for the two descriptors.
        if unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) } != 0 {
            return Err(MirrorError::last_os("socketpair"));
        }
        // SAFETY: socketpair returned two fresh descriptors owned by nobody else.
        let (m, k) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let moved = |fd| {
            move_internal_fd(fd).map_err(|_| MirrorError::Os {
                op: "move the mirror above the application's descriptors",
                errno: libc::EMFILE,
            })
        };
        Ok(MirrorEnds {
            m: moved(m)?,
            k: moved(k)?,
        })
    }
}

impl<W: Deref<Target = MirrorWords>> Mirror<W> {
    /// Creates the socketpair (both ends nonblocking, close-on-exec) and returns the mirror and
    /// the raising end, to be passed with [`send_fd`] and then dropped.
    ///
    /// `words` must be in their initial state ([`MirrorWords::new`], or zeroed memory).
    ///
    /// # Errors
    /// System-call failures, and [`MirrorError::SendBufferLimit`] when the host forbids the
    /// send-buffer sizes the OUT protocol needs.
    pub fn new(words: W) -> Result<(Mirror<W>, OwnedFd), MirrorError> {
        Self::with_ends(words, MirrorEnds::new()?)
    }

    /// As [`Mirror::new`], over a socketpair made beforehand (a connection that must not
    /// need a new descriptor at the moment its mirror is set up).
    ///
    /// # Errors
    /// As [`Mirror::new`].
    pub fn with_ends(words: W, ends: MirrorEnds) -> Result<(Mirror<W>, OwnedFd), MirrorError> {
        let MirrorEnds { m, k } = ends;
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
            claimed_unread: 0,
        };
        Ok((mirror, k))
    }

    /// The shared words.
    pub fn words(&self) -> &MirrorWords {
        &self.words
    }

    /// Bytes the last [`lower_writable`](Self::lower_writable) wrote to make the watched end unwritable
    /// (0 if filler was already parked).
    pub fn last_fill_bytes(&self) -> usize {
        self.last_fill
    }

    /// The effective `SO_SNDBUF` of the watched end in the lowered and the locally raised state.
    pub fn send_buffer_sizes(&self) -> (i32, i32) {
        (self.small_sndbuf, self.large_sndbuf)
    }

    /// The watched end's current readiness (`poll` with a zero timeout): a `POLL*` bit set.
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

    /// Lowers the watched end's readability because our receive queue became empty (see the module docs).
    /// `data_available` re-reads the receive queue after the count went to zero.
    ///
    /// # Errors
    /// An unexpected `recv` failure.
    pub fn lower_readable(
        &mut self,
        data_available: impl FnOnce() -> bool,
    ) -> Result<ReadLowering, MirrorError> {
        if self.words.readable.load(Ordering::Acquire) == 0 && self.claimed_unread == 0 {
            return Ok(ReadLowering::NotRaised);
        }
        // Claim every token counted so far: a producer that raises from now on sees zero and
        // makes a new edge.
        let claimed = self.words.readable.swap(0, Ordering::AcqRel);
        // Pairs with the fence in `raise_readable`: either the producer sees the count at zero
        // (and sends a new token) or we see its data below.
        fence(Ordering::SeqCst);
        if data_available() {
            // The claimed tokens stand for the data that is there: hand them back, untouched.
            if claimed > 0 {
                self.words.readable.fetch_add(claimed, Ordering::AcqRel);
            }
            return Ok(ReadLowering::StillReadable);
        }
        self.claimed_unread = self.claimed_unread.saturating_add(claimed);
        // Consume exactly the claimed tokens that have arrived. Tokens are alike, so one taken
        // here may be a newer edge's while a claimed one is still in flight; the count stays
        // right either way (queued + in flight == count + claimed_unread), and the late
        // token makes the watched end readable for that newer edge.
        let mut sink = [0u8; MAX_QUEUED_TOKENS as usize * 2];
        while self.claimed_unread > 0 {
            let want = (self.claimed_unread as usize).min(sink.len());
            // SAFETY: `sink` is writable for `want` ≤ its length.
            let n = unsafe {
                libc::recv(
                    self.m.as_raw_fd(),
                    sink.as_mut_ptr().cast(),
                    want,
                    libc::MSG_DONTWAIT,
                )
            };
            match n {
                n if n > 0 => self.claimed_unread -= n as u32,
                0 => return Ok(ReadLowering::Hangup),
                _ => match errno::get() {
                    libc::EAGAIN => return Ok(ReadLowering::TokenInFlight),
                    // the raising end closed with filler unread: the peer is gone (the error is reported
                    // once).
                    libc::ECONNRESET => return Ok(ReadLowering::Hangup),
                    errno => {
                        return Err(MirrorError::Os {
                            op: "consume mirror tokens",
                            errno,
                        })
                    }
                },
            }
        }
        Ok(ReadLowering::Lowered)
    }

    /// Asks the peer for a token on every arrival (`true`: an edge-triggered epoll
    /// registration watches the watched end) or only on the rising edge (`false`). A write to the raising end while
    /// the watched end already holds unread tokens is a new edge for epoll, as an arriving segment is for
    /// a TCP socket.
    pub fn set_edge_per_arrival(&self, on: bool) {
        self.words
            .edge_per_arrival
            .store(u32::from(on), Ordering::Relaxed);
    }

    /// Lowers the watched end's writability because we ran out of credits or send space (see the module
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

    /// Makes the watched end writable without the peer: enlarges its send buffer over the parked filler.
    /// `setsockopt(SO_SNDBUF)` calls the socket's write-space callback, which wakes waiters.
    fn raise_writable_local(&mut self) -> Result<(), MirrorError> {
        set_sndbuf(self.m.as_fd(), LARGE_SNDBUF_REQUEST)?;
        self.sndbuf_is_large = true;
        Ok(())
    }

    /// Mirrors our own `shutdown(SHUT_WR)`: `shutdown(M, SHUT_WR)`, and the watched end stays writable from
    /// now on, as a TCP socket does (a write then fails with `EPIPE` at once instead of
    /// blocking). Together with a read hang-up, the watched end reports HUP.
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

    /// Marks the watched end at end of file from our side: it reports IN|RDHUP for good. For a peer FIN
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
    /// The watched end: what the epoll/poll/select hooks wait on.
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

/// Raises the other side's the watched end readable after we pushed data to it (we hold its raising end). One
/// token per rising edge, and no system call while the watched end is raised; when that side asked for an
/// edge per arrival ([`Mirror::set_edge_per_arrival`]), a token for every call (up to
/// 64 unclaimed).
pub fn raise_readable(words: &MirrorWords, k: BorrowedFd<'_>) -> Raise {
    // Pairs with the fence in `Mirror::lower_readable`: the data we pushed before this call is
    // visible to the consumer's re-check, or we see its count at zero.
    fence(Ordering::SeqCst);
    let counted = if words.edge_per_arrival.load(Ordering::Relaxed) != 0 {
        words
            .readable
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |count| {
                (count < MAX_QUEUED_TOKENS).then_some(count + 1)
            })
            .is_ok()
    } else {
        words.readable.load(Ordering::Relaxed) == 0
            && words
                .readable
                .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    };
    if !counted {
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
        // EPIPE: the watched end closed or shut for reading, nobody waits. (EAGAIN cannot happen: at most
        // MAX_QUEUED_TOKENS tokens plus a few in flight are ever queued.)
        Raise::MirrorClosed
    }
}

/// Raises the other side's the watched end writable after we returned space or credits to it (we hold
/// its raising end): drains the raising end if that side lowered writability.
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
    // Bounded: a peer that keeps writing into its watched end (a hostile one) must not keep
    // this thread here; the backlog of a sound one fits one read.
    for _ in 0..MAX_DRAIN_READS {
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
            // the watched end shut for writing or closed: nothing to wait for any more.
            0 => return Raise::MirrorClosed,
            // EAGAIN: nothing was queued (the filler was already drained by an older raise).
            _ => return Raise::Raised,
        }
    }
    Raise::Raised
}

/// Most reads [`raise_writable`] makes to drain the other side's filler.
const MAX_DRAIN_READS: usize = 8;

/// Mirrors our FIN to the other side: `shutdown(K, SHUT_WR)`, so its watched end reports IN|RDHUP.
/// Keep the raising end open until the session is over: closing it is what reports HUP.
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
    // A descriptor that cannot leave the application's numbers is refused (closed).
    let received = received
        .map(move_internal_fd)
        .transpose()
        .map_err(|_| MirrorError::Os {
            op: "move a received descriptor above the application's",
            errno: libc::EMFILE,
        })?;
    Ok((n as usize, received))
}

/// Moves a descriptor the library keeps for itself above the numbers the application uses
/// (see [`san_shm::relocate_internal_fd`], shared with the provider's own descriptors).
pub use san_shm::relocate_internal_fd;

/// As [`relocate_internal_fd`], failing (`EMFILE`) when the descriptor cannot be moved: for
/// the descriptors a SAN connection is set up with (see [`san_shm::move_internal_fd`]).
pub use san_shm::move_internal_fd;

#[cfg(test)]
mod tests;
