//! Connections between processes of different users (`docs/ARCHITECTURE.md`, "Other users").
//!
//! **Policy.** `SANDIRECT_OTHER_USERS` names the other users (uids) whose processes this
//! process's connections may use the SAN with; both ends must name each other. Unset (the
//! default), nothing here runs and nothing costs anything.
//!
//! **A segment private to the connection.** Nothing of such a connection is put in either
//! user's segment directory: the client makes its segment as an anonymous memory file sealed
//! against resizing (`san_shm::ShmSegment::create_private`) and hands its descriptor to its
//! acceptor alone, over the exchange (`SCM_RIGHTS`). No `process_vm_*` ever reaches across:
//! large writes go through the segment's window.
//!
//! **Who hands the segment over.** The acceptor must finish without waiting for the client's
//! application, which may be blocked anywhere. So each client process with such pending
//! connections keeps one **offer thread**, blocked in `poll` on their exchange listeners (and
//! an eventfd that tells it the set changed): when an acceptor connects, the thread checks its
//! credentials (`SO_PEERCRED`: one of the users the policy names), passes the segment's
//! descriptor and keeps the connection for the socket's switch; a connection of anyone else
//! is closed unread and the thread waits on. The acceptor (whose checks are in
//! [`client_exchange`]: a named user that owns the connection's client end) waits for the
//! segment (bounded, see [`SEGMENT_WAIT`]) after queueing its own mirror end and words page,
//! attaches, then writes the switch marker followed by the segment's token, which the client
//! must find first on TCP before it switches (see `SanSocket::private_marker`): the exact
//! rule is unchanged.
//!
//! **What is exposed.** The segment carries only this connection's bytes, which the peer
//! would have read from TCP anyway; every value read from it is validated by the provider
//! (a scribbling peer breaks its own connection); its size is sealed (no `SIGBUS`).

use core::sync::atomic::{AtomicI32, AtomicU32, Ordering};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::exchange;
use crate::guard::ReentrancyGuard;

/// How long an acceptor waits for its client's offer thread to pass the segment (it answers
/// in tens of microseconds; past this the connection stays on TCP). The wait is inside the
/// first call that uses the connection, so it bounds what a client that never answers costs
/// the server.
pub(super) const SEGMENT_WAIT: Duration = Duration::from_millis(50);

/// Whether the policy names any other user.
pub(crate) fn enabled() -> bool {
    !crate::settings::other_users().is_empty()
}

/// Whether the policy lets this process's connections use the SAN with processes of `uid`
/// (our own user always may).
pub(crate) fn allowed(uid: u32) -> bool {
    uid == crate::discovery::effective_uid() || crate::settings::other_users().contains(&uid)
}

/// Acceptor of connection `local` ← `peer` whose client its own user's checks did not find:
/// our connection to the exchange of a pending client of another user, when one listens for
/// this connection, runs as a user the policy names, **and** owns the connection's client end
/// (the kernel's socket table says whose socket `peer` → `local` is): a process of a named
/// user that took the exchange name before the client cannot pass for it. `None`: the client
/// is plain (a probe of three system calls; the check costs four more only when a listener
/// answered).
pub(super) fn client_exchange(
    name: &crate::discovery::SegmentName,
    local: std::net::SocketAddr,
    peer: std::net::SocketAddr,
) -> Option<OwnedFd> {
    let link = exchange::connect_to_other_user(name, &allowed).ok()?;
    let uid = exchange::peer_uid(link.as_fd())?;
    (crate::listener_owner::connection_owner(peer, local) == Some(uid)).then_some(link)
}

/// One pending client's offer: its exchange listener and its private segment's descriptor,
/// until an acceptor the policy allows connects; then that connection.
pub(super) struct Offer {
    /// The process that registered it: a fork child's copy of the list holds its parent's,
    /// which the child's thread leaves alone (their locks may have been copied held).
    pid: u32,
    listener: OwnedFd,
    state: Mutex<OfferState>,
}

struct OfferState {
    /// The segment's descriptor, until it was passed on.
    segment: Option<OwnedFd>,
    /// The acceptor's connection, once it was given the segment.
    link: Option<OwnedFd>,
}

impl Offer {
    fn state(&self) -> MutexGuard<'_, OfferState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The pending offers of this process, which the offer thread watches.
static OFFERS: Mutex<Vec<Arc<Offer>>> = Mutex::new(Vec::new());

fn offers() -> MutexGuard<'static, Vec<Arc<Offer>>> {
    OFFERS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The list's lock, held across `fork` (see `super::with_library_locks`): the offer thread
/// takes it briefly, and a child must not inherit it held.
pub(super) fn hold() -> MutexGuard<'static, Vec<Arc<Offer>>> {
    offers()
}

/// The eventfd that tells the offer thread its set changed (-1: none yet).
static WAKE: AtomicI32 = AtomicI32::new(-1);
/// The process whose offer thread runs (a fork child starts its own).
static THREAD_PID: AtomicU32 = AtomicU32::new(0);

/// A pending client's registration with the offer thread; dropped when the socket switched,
/// gave up or closed (the listener and the segment's descriptor go with it).
pub(crate) struct PendingOffer(Arc<Offer>);

impl core::fmt::Debug for PendingOffer {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PendingOffer").finish_non_exhaustive()
    }
}

impl PendingOffer {
    /// Registers `listener` (the client's exchange listener for another user) and `segment`
    /// (its private segment's descriptor) with the offer thread, started on first use.
    /// `None` when the thread cannot run (the connection then stays on TCP).
    pub(crate) fn new(listener: OwnedFd, segment: OwnedFd) -> Option<PendingOffer> {
        if !ensure_thread() {
            return None;
        }
        let offer = Arc::new(Offer {
            pid: std::process::id(),
            listener,
            state: Mutex::new(OfferState {
                segment: Some(segment),
                link: None,
            }),
        });
        offers().push(offer.clone());
        wake();
        Some(PendingOffer(offer))
    }

    /// The acceptor's connection, once the offer thread gave it the segment.
    pub(crate) fn take_link(&self) -> Option<OwnedFd> {
        self.0.state().link.take()
    }
}

impl Drop for PendingOffer {
    fn drop(&mut self) {
        offers().retain(|offer| !Arc::ptr_eq(offer, &self.0));
        // The thread drops its copy at its next round (the listener closes then).
        wake();
    }
}

fn wake() {
    let fd = WAKE.load(Ordering::Acquire);
    if fd >= 0 {
        let one = 1u64;
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }
}

/// Starts this process's offer thread unless it runs. False when it cannot.
fn ensure_thread() -> bool {
    let pid = std::process::id();
    if THREAD_PID.load(Ordering::Acquire) == pid {
        return true;
    }
    let _offers = offers();
    if THREAD_PID.load(Ordering::Acquire) == pid {
        return true;
    }
    // A fork child inherits the parent's eventfd (and offers it withdrew): a fresh one.
    // SAFETY: plain eventfd(2).
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return false;
    }
    // SAFETY: just returned by the kernel, owned by nobody else.
    let Ok(wake) = crate::mirror::move_internal_fd(unsafe { OwnedFd::from_raw_fd(fd) }) else {
        return false;
    };
    let raw = std::os::fd::IntoRawFd::into_raw_fd(wake);
    if !crate::process::spawn_internal_thread("sandirect-offer", move || serve(raw)) {
        // SAFETY: our own descriptor, never published.
        unsafe { libc::close(raw) };
        return false;
    }
    WAKE.store(raw, Ordering::Release);
    THREAD_PID.store(pid, Ordering::Release);
    true
}

/// The offer thread: waits on the pending offers' listeners and passes each its segment.
fn serve(wake: libc::c_int) {
    // Our own calls must not go through the hooks' SAN logic.
    let _inside = ReentrancyGuard::enter();
    let mut watched: Vec<Arc<Offer>> = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::new();
    let pid = std::process::id();
    loop {
        watched.clear();
        watched.extend(
            offers()
                .iter()
                .filter(|offer| offer.pid == pid && offer.state().segment.is_some())
                .cloned(),
        );
        fds.clear();
        fds.push(libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(watched.iter().map(|offer| libc::pollfd {
            fd: offer.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        // SAFETY: `fds` holds `fds.len()` pollfds; every descriptor in it is kept open by
        // `watched` until the next round.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            if crate::errno::get() == libc::EINTR {
                continue;
            }
            // (Out of memory for the set.) The next offer starts another thread.
            THREAD_PID.store(0, Ordering::Release);
            return;
        }
        if fds[0].revents != 0 {
            let mut count = 0u64;
            // SAFETY: an 8-byte read from our eventfd (nonblocking).
            unsafe { libc::read(wake, (&mut count as *mut u64).cast(), 8) };
        }
        for (offer, entry) in watched.iter().zip(&fds[1..]) {
            if entry.revents != 0 {
                let _ = crate::guard::contained(|| hand_over(offer));
            }
        }
    }
}

/// Accepts the connections queued on `offer`'s listener: the first of a user the policy
/// allows gets the segment and is kept for the switch; the others are closed unread.
fn hand_over(offer: &Offer) {
    loop {
        // SAFETY: plain accept4(2) on our listener; the peer address is not wanted.
        let fd = unsafe {
            libc::accept4(
                offer.listener.as_raw_fd(),
                core::ptr::null_mut(),
                core::ptr::null_mut(),
                libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            if !matches!(crate::errno::get(), libc::EAGAIN | libc::EINTR) {
                // Out of descriptors: the connection stays queued; look again a little
                // later rather than spin on it.
                std::thread::sleep(Duration::from_millis(10));
            }
            return;
        }
        // SAFETY: just returned by the kernel, owned by nobody else.
        let link = unsafe { OwnedFd::from_raw_fd(fd) };
        if !exchange::peer_uid(link.as_fd()).is_some_and(allowed) {
            continue;
        }
        let Ok(link) = crate::mirror::move_internal_fd(link) else {
            continue;
        };
        let mut state = offer.state();
        let Some(segment) = state.segment.take() else {
            return;
        };
        if exchange::send(link.as_fd(), segment.as_fd(), exchange::SEGMENT) {
            state.link = Some(link);
            return;
        }
        state.segment = Some(segment);
    }
}

/// Acceptor: waits up to `timeout` for the private segment's descriptor on exchange
/// connection `link`.
pub(super) fn receive_segment(link: BorrowedFd<'_>, timeout: Duration) -> Option<OwnedFd> {
    let mut entry = libc::pollfd {
        fd: link.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd.
    let ready = unsafe {
        crate::real::poll(
            &mut entry,
            1,
            timeout.as_millis().min(i32::MAX as u128) as libc::c_int,
        )
    };
    if ready != 1 {
        return None;
    }
    exchange::receive(link, exchange::SEGMENT)
}
