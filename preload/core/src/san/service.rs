//! The SAN path's background threads, and the work they share with the application's
//! waits:
//!
//! * the verbs **service thread** (one per process, started with the first verbs
//!   connection): it sleeps on what [`super::verbs::watcher::Watcher`] holds and drives a verbs
//!   socket's session when its connection has events, settles owed links on its tick, and
//!   sweeps every verbs socket once a second while idle;
//! * the **nudge responder** (one per process with an intra-host connection, see `nudge`):
//!   it services every SAN socket when a peer that is downgrading nudges us;
//! * [`service_all`], the safety net of the sliced waits, and [`settle_all_owed`], run
//!   before a thread sleeps on readiness.

use core::ffi::c_int;
use core::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::time::Duration;

use super::kernel::socket_option;
use super::nudge::{bind_nudge_socket, receive, Received};
use super::socket::{Phase, SanSocket};
use super::table::{lock, slot, SanObject, LIVE};
use super::verbs::link::links_owed;
use super::verbs::watcher::{self, Watched};
use crate::discovery::effective_uid;
use crate::guard::ReentrancyGuard;
use crate::real;
use crate::record::{flags, Bypass};
use crate::registry::registry;

/// The service thread's tick while links are owed: an owed link whose application made no
/// call for a whole tick is settled (its queue armed, the service thread's watch resumed).
/// Until then an arrival on it wakes nobody but the application's next call on the socket,
/// which polls the queue itself: a thread of the same program that sleeps on the socket's
/// readiness (epoll on another thread) learns of it up to two ticks late.
const OWED_TICK_MS: c_int = 2;

// The verbs service thread.

/// A switched verbs socket (its slot lock held by the caller): its connection's events go
/// to the service thread from now on; the completion channel is armed here.
pub(super) fn watch_socket(index: u32, socket: &mut SanSocket) {
    let Some(link) = socket.verbs_link_mut() else {
        return;
    };
    let tcp = registry()
        .get(index)
        .map(|record| record.fd.load(Ordering::Acquire));
    if link.watch(index, tcp, start) {
        LIVE_VERBS.fetch_add(1, Ordering::Relaxed);
        socket.service_verbs_event();
    }
}

/// Sockets ever watched (the sweep is skipped while none).
static LIVE_VERBS: AtomicU32 = AtomicU32::new(0);

/// Starts the verbs service thread (once per process): true when it runs.
pub(super) fn start() -> bool {
    static STARTED: OnceLock<bool> = OnceLock::new();
    *STARTED.get_or_init(|| crate::process::spawn_internal_thread("sandirect-verbs", service_loop))
}

fn service_loop() {
    // Our own calls (epoll, poll inside the provider, mirror tokens) must not go through the
    // SAN logic of the hooks.
    let _inside = ReentrancyGuard::enter();
    let Some(watcher) = watcher::watcher() else {
        return;
    };
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
    loop {
        let timeout = if links_owed() { OWED_TICK_MS } else { 1000 };
        let n = watcher.wait(&mut events, timeout);
        if n < 0 {
            if crate::errno::get() == libc::EINTR {
                continue;
            }
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        // A panic of ours is counted and this round given up; the thread goes on serving
        // (ended, it would leave every verbs socket of the process unserved).
        let _ = crate::guard::contained(|| {
            if links_owed() {
                settle_idle_owed();
            }
            if n == 0 {
                sweep();
                return;
            }
            for event in &events[..n as usize] {
                match watcher.dispatch(event.u64) {
                    Watched::Socket(index) => service_socket(index),
                    Watched::KernelSocket(index) => check_kernel_socket(index),
                    Watched::Handled => {}
                }
            }
        });
    }
}

/// Drives switched verbs socket `index` after an event of its connection, raises its mirror,
/// and re-arms its completion channel.
fn service_socket(index: u32) {
    let mut slot = lock(index);
    if let Some(SanObject::Socket(socket)) = slot.as_mut() {
        socket.service_verbs_event();
    }
}

/// The kernel TCP socket of verbs socket `index` reported an error or hang-up. If the TCP
/// connection is over (state `CLOSE`) because the kernel could not reach the peer's host
/// (a keepalive or retransmission timeout, an unreachable host or network) while the SAN
/// session runs, the session ends with that error.
///
/// Anything else is left to the session: a graceful end (both directions shut down: `CLOSE`
/// with no error) or a reset (the peer's kernel answered, so its host is alive; what its
/// process did reaches us over the SAN as a `Fin` or `Rst`, in order after its data: acting on
/// the TCP reset, which can overtake that data, would lose it, e.g. when a client closes
/// before the switch marker arrived and its kernel answers the marker with a reset).
fn check_kernel_socket(index: u32) {
    let Some(fd) = registry()
        .get(index)
        .map(|record| record.fd.load(Ordering::Acquire))
    else {
        return;
    };
    let mut slot = lock(index);
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return;
    };
    if socket.phase != Phase::Switched || !socket.is_verbs() {
        return;
    }
    if kernel_tcp_state(fd) != Some(TCP_CLOSE) {
        return;
    }
    // (Reading `SO_ERROR` consumes it; the session reports it to the application instead.)
    match take_socket_error(fd) {
        Some(
            errno @ (libc::ETIMEDOUT
            | libc::EHOSTUNREACH
            | libc::ENETUNREACH
            | libc::EHOSTDOWN
            | libc::ENETDOWN),
        ) => socket.kernel_connection_failed(errno),
        other => tracing::debug!(
            index,
            ?other,
            "kernel connection closed; the session goes on"
        ),
    }
}

/// `TCP_CLOSE` of the kernel's TCP states (`include/net/tcp_states.h`; `libc` has no name
/// for it): the connection is over.
const TCP_CLOSE: u8 = 7;

/// `TCP_INFO`'s state of socket `fd` (`None`: not a TCP socket, or the call failed).
fn kernel_tcp_state(fd: RawFd) -> Option<u8> {
    socket_option::<libc::tcp_info>(fd, libc::IPPROTO_TCP, libc::TCP_INFO)
        .map(|info| info.tcpi_state)
}

/// Reads (and so clears) socket `fd`'s pending error, `SO_ERROR`.
fn take_socket_error(fd: RawFd) -> Option<c_int> {
    socket_option::<c_int>(fd, libc::SOL_SOCKET, libc::SO_ERROR)
}

/// The service thread's tick: every owed link whose application made no call since the last
/// tick is settled (see [`OWED_TICK_MS`]).
fn settle_idle_owed() {
    for_each_verbs_socket(|socket| {
        if socket
            .verbs_link_mut()
            .is_some_and(|link| link.owed() && link.idle_since_last_tick())
        {
            socket.settle_direct_wait();
        }
    });
}

/// Before a thread sleeps on readiness (epoll, poll, select): every owed link is settled, so
/// the service thread hears of arrivals on it while this thread sleeps. One atomic load when
/// nothing is owed.
pub(crate) fn settle_all_owed() {
    if !links_owed() {
        return;
    }
    for_each_verbs_socket(SanSocket::settle_direct_wait);
}

/// Runs `f` on every SAN socket of this process not in use by another thread (`try_lock`).
fn for_each_verbs_socket(mut f: impl FnMut(&mut SanSocket)) {
    let mut indices = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::SAN != 0 {
            indices.push(index);
        }
    });
    for index in indices {
        if let Ok(mut slot) = slot(index).try_lock() {
            if let Some(SanObject::Socket(socket)) = slot.as_mut() {
                f(socket);
            }
        }
    }
}

/// The safety net (once a second while idle): every verbs socket is serviced and re-armed.
fn sweep() {
    if LIVE_VERBS.load(Ordering::Relaxed) == 0 {
        return;
    }
    for_each_verbs_socket(SanSocket::service_verbs_event);
}

// The nudge responder.

/// The responder's socket in this process (-1: none).
static RESPONDER_FD: AtomicI32 = AtomicI32::new(-1);
/// The pid whose responder was set up (or tried): a fork child sees its parent's and sets up
/// its own.
static RESPONDER_PID: AtomicU32 = AtomicU32::new(0);

/// Makes sure this process answers nudges: on first use per process, binds the nudge name and
/// starts the responder thread. Called as an intra-host SAN connection is installed.
pub(crate) fn ensure_responder() {
    let pid = std::process::id();
    let claimed = RESPONDER_PID.load(Ordering::Acquire);
    if claimed == pid {
        return;
    }
    // One thread sets up per process; a failed set-up is not retried (the fork then waits
    // its budget for idle peers, as it would without nudges).
    if RESPONDER_PID
        .compare_exchange(claimed, pid, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    match bind_nudge_socket(super::link::own_pid(), super::provider::segment_dir()) {
        Ok((socket, in_dir)) => {
            NUDGE_FILE.store(in_dir, Ordering::Release);
            if let (true, Some(provider)) = (in_dir, super::provider::provider()) {
                super::nudge::sweep_stale_files(provider.dir.handle());
            }
            let raw = socket.into_raw_fd();
            RESPONDER_FD.store(raw, Ordering::Release);
            // The new thread's own start-up (std's thread bookkeeping) happens before we
            // return: the application's steady state must see no allocation of ours.
            let ready = ReadySignal::new();
            let signal = ready.as_ref().map(ReadySignal::fd);
            let started = crate::process::spawn_internal_thread("sandirect-nudge", move || {
                if let Some(fd) = signal {
                    ReadySignal::ring(fd);
                }
                respond(raw)
            });
            if !started {
                tracing::debug!("nudge responder: thread not started");
                close_responder_socket();
            } else if let Some(ready) = ready {
                ready.wait(1000);
            }
        }
        Err(op) => {
            tracing::debug!(
                op,
                errno = crate::errno::get(),
                "nudge responder not set up: idle peers cannot be hurried"
            );
        }
    }
}

/// Whether this process's nudge socket is a file in the segment directory (removed at exit).
static NUDGE_FILE: AtomicBool = AtomicBool::new(false);

/// At exit: the nudge socket file of this process goes (a fork child that never made its own
/// responder has none: its copy of the flag belongs to the parent's pid).
pub(crate) fn at_exit() {
    if NUDGE_FILE.load(Ordering::Acquire)
        && RESPONDER_PID.load(Ordering::Acquire) == std::process::id()
    {
        if let Some(provider) = super::provider::provider() {
            super::nudge::remove_nudge_file(super::link::own_pid(), provider.dir.handle());
        }
    }
}

fn close_responder_socket() {
    let fd = RESPONDER_FD.swap(-1, Ordering::AcqRel);
    if fd >= 0 {
        // SAFETY: our own descriptor, taken out of the static first so it closes once.
        unsafe { libc::close(fd) };
    }
}

/// fork child: the responder thread was not copied; close the inherited socket so the name
/// dies with the parent. Async-signal-safe (one atomic swap, one `close`).
pub(crate) fn after_fork_in_child() {
    close_responder_socket();
}

/// The responder thread: waits for nudges, then services every SAN socket once per batch.
fn respond(fd: c_int) {
    // Our own calls (recvmsg, and everything servicing does) must not go through the hooks'
    // SAN logic.
    let _inside = ReentrancyGuard::enter();
    let uid = effective_uid();
    loop {
        match receive(fd, uid, 0) {
            Received::Nudge => {}
            Received::Ignored | Received::Interrupted => continue,
            Received::Closed => return,
        }
        // Nudges that queued meanwhile are served by this same round.
        while matches!(
            receive(fd, uid, libc::MSG_DONTWAIT),
            Received::Nudge | Received::Ignored
        ) {}
        // (A panic of ours is counted; the responder keeps answering.)
        let _ = crate::guard::contained(|| service_every(Wait::ForBusySockets));
    }
}

/// A one-shot "started" signal from a new thread (an eventfd: no allocation on either side).
struct ReadySignal(OwnedFd);

impl ReadySignal {
    fn new() -> Option<ReadySignal> {
        // SAFETY: plain eventfd(2).
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        (raw >= 0).then(|| {
            // SAFETY: a fresh descriptor owned by nobody else.
            let owned = unsafe { OwnedFd::from_raw_fd(raw) };
            ReadySignal(crate::mirror::relocate_internal_fd(owned))
        })
    }

    fn fd(&self) -> libc::c_int {
        std::os::fd::AsRawFd::as_raw_fd(&self.0)
    }

    /// From the new thread. The descriptor stays open until [`ReadySignal::wait`] returns.
    fn ring(fd: libc::c_int) {
        let one = 1u64;
        // SAFETY: an 8-byte write to the eventfd.
        unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
    }

    /// Waits (bounded) for the ring. The descriptor is closed once rung; a thread that has
    /// not rung in time keeps it (leaked), so its late write can never hit a number the
    /// application got meanwhile.
    fn wait(self, timeout_ms: libc::c_int) {
        let mut pfd = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, bounded timeout.
        let rc = unsafe { real::poll(&mut pfd, 1, timeout_ms) };
        if rc != 1 {
            core::mem::forget(self);
        }
    }
}

/// Services every switched SAN socket of this process once (`try_lock`: a socket in use by
/// another thread is being serviced anyway). The safety net of the sliced waits.
pub fn service_all() {
    service_every(Wait::No);
}

/// Whether [`service_every`] waits for a socket another thread holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Skip it: that thread services it.
    No,
    /// Wait for it (the nudge responder): the thread may be an application thread about to
    /// leave the call in which it asked for the nudge, and it will not service the socket
    /// again before its next call. Skipped, the nudge was lost and the peer, which consumed
    /// the request, never nudged again: the bytes waited for the application's next call
    /// (a sender that wrote more than the reader's slots hold and then slept).
    ForBusySockets,
}

fn service_every(wait: Wait) {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("service_all");
    if LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut indices = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::SAN != 0 && record.bypass() != Bypass::AfterFork {
            indices.push(index);
        }
    });
    for index in indices {
        let mut slot = match slot(index).try_lock() {
            Ok(slot) => slot,
            Err(_) if wait == Wait::ForBusySockets => lock(index),
            Err(_) => continue,
        };
        if let Some(SanObject::Socket(socket)) = slot.as_mut() {
            if socket.phase == Phase::Switched {
                socket.service();
                socket.leaving_call(false);
            }
        }
    }
}
