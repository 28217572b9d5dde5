//! The hooks' SAN data path: send/recv loops with Linux semantics (blocking, `O_NONBLOCK`,
//! `MSG_DONTWAIT`, `MSG_PEEK`, `MSG_WAITALL`, `SO_RCVTIMEO`/`SO_SNDTIMEO`), the pending
//! client's counted TCP path and switch-over, and `poll()` substitution.
//!
//! Every function takes the socket's lock, works without blocking, and releases the lock
//! around the one place it blocks (`poll()` on the mirror and/or the TCP socket).

use core::ffi::c_int;
use core::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::downgrade;
use super::kernel::{next_piece, recv_tcp, remaining_pieces, scatter, send_on_tcp, RawBuf};
use super::provider::provider;
use super::socket::stream::SinkRefused;
use super::socket::wait::{AfterPolling, WaitFds};
use super::socket::{Phase, SanSocket, DOWNGRADED, REMOTE_SEGMENT_AHEAD};
use super::table::{
    forget_name, in_process_indices, in_process_peer, lock, orphaned, record_flag, san_index, slot,
    SanObject, COUNTERS, LIVE,
};
use super::tunables::{poll_budget, wait_slice, HANDSHAKE_WAIT, MARKER_WAIT};
use crate::discovery::canonical_addr;
use crate::record::{flags, Bypass, Counter, DataPath};
use crate::registry::registry;
use crate::{errno, real};
use switch::session::SendTicket;

fn fail(code: c_int) -> isize {
    if code != libc::EAGAIN {
        tracing::debug!(errno = code, "SAN call fails");
    }
    errno::set(code);
    -1
}

/// The deadline `SO_RCVTIMEO`/`SO_SNDTIMEO` (`option`) sets for a blocking call that starts
/// now; `None` without one. Asked of the kernel only when the record's flag for the option
/// says it may be set (see `record::flags::RCVTIMEO`).
fn timeout_of(index: u32, fd: c_int, option: c_int) -> Option<Instant> {
    if !crate::record::timeout_flag(option).is_some_and(|flag| record_flag(index, flag)) {
        return None;
    }
    let mut value = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let mut len = core::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `value`.
    let rc = unsafe {
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&mut value as *mut libc::timeval).cast(),
            &mut len,
        )
    };
    if rc != 0 || (value.tv_sec == 0 && value.tv_usec == 0) {
        return None;
    }
    let timeout = Duration::from_secs(value.tv_sec.max(0) as u64)
        + Duration::from_micros(value.tv_usec.max(0) as u64);
    Instant::now().checked_add(timeout)
}

/// Blocks (lock released) until the socket may make progress, the deadline passes
/// (`EAGAIN`), or a signal arrives (`EINTR`).
fn block(
    index: u32,
    fd: c_int,
    fds: Option<WaitFds>,
    deadline: Option<Instant>,
) -> Result<(), c_int> {
    let Some(fds) = fds else { return Ok(()) };
    if assist_in_process_peer(index) {
        // The peer made progress on our behalf: re-check before sleeping.
        if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
            socket.finish_wait(&fds, true);
        }
        return Ok(());
    }
    // Verbs, a reader: poll before sleeping when that pays; signals held back meanwhile are
    // let in atomically by the sleep below.
    let held_signals = match fds.spin.then(|| poll_with_signals_held(index, &fds)) {
        Some(Polled::Done) => return Ok(()),
        Some(Polled::Sleep(outer)) => Some(outer),
        Some(Polled::NotHeld) | None => None,
    };
    let mut pollfds = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; 4];
    let mut count = 0;
    let mut bell_at = None;
    if let Some(link) = fds.link {
        pollfds[count] = libc::pollfd {
            fd: link,
            events: libc::POLLIN,
            revents: 0,
        };
        count += 1;
    }
    if let Some(bell) = fds.bell {
        bell_at = Some(count);
        pollfds[count] = libc::pollfd {
            fd: bell,
            events: libc::POLLIN,
            revents: 0,
        };
        count += 1;
    }
    if let Some(mirror) = fds.mirror {
        pollfds[count] = libc::pollfd {
            fd: mirror,
            events: fds.mirror_events,
            revents: 0,
        };
        count += 1;
    }
    if fds.tcp_events != 0 {
        pollfds[count] = libc::pollfd {
            fd,
            events: fds.tcp_events,
            revents: 0,
        };
        count += 1;
    }
    // (No clock read without a deadline: under emulation it is a system call.)
    let slice = deadline
        .map_or(wait_slice(), |d| {
            d.saturating_duration_since(Instant::now())
                .min(wait_slice())
        })
        .min(fds.cap.unwrap_or(wait_slice()));
    let rc = match held_signals.as_ref() {
        // SAFETY: `count` valid pollfds.
        None => unsafe {
            real::poll(
                pollfds.as_mut_ptr(),
                count as libc::nfds_t,
                slice.as_millis().max(1) as c_int,
            )
        },
        Some(outer) => {
            let millis = slice.as_millis().max(1) as u64;
            let timeout = libc::timespec {
                tv_sec: (millis / 1000) as libc::time_t,
                tv_nsec: ((millis % 1000) * 1_000_000) as libc::c_long,
            };
            // SAFETY: `count` valid pollfds; the caller's own mask while asleep, so a signal
            // that came while we polled interrupts this sleep as it would have the call.
            let rc = unsafe {
                real::ppoll(pollfds.as_mut_ptr(), count as libc::nfds_t, &timeout, outer)
            };
            let saved = errno::get();
            // SAFETY: restores the caller's own mask.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, outer, core::ptr::null_mut()) };
            errno::set(saved);
            rc
        }
    };
    let interrupted = rc < 0 && errno::get() == libc::EINTR;
    // Verbs: the connection's own fd woke us (it is first in the set): collect its channel
    // and connection events, as the service thread does when it wakes on them.
    let link_ready = fds.link.is_some() && rc > 0 && pollfds[0].revents != 0;
    let bell_rung = bell_at.is_some_and(|at| rc > 0 && pollfds[at].revents != 0);
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        // (First: the service thread's watch, resumed by `finish_wait`, would otherwise
        // report the same event again and wake it to contend for this lock.)
        if link_ready {
            socket.collect_link_events();
        }
        socket.finish_wait(&fds, bell_rung);
    }
    if interrupted {
        // The kernel restarts a socket call interrupted by a handler installed with
        // SA_RESTART unless the socket has a timeout (signal(7)); poll() never restarts, so
        // decide here. Which signal arrived is unknown: restart only when every installed
        // handler asked for it.
        if deadline.is_none() && every_handler_restarts() {
            return Ok(());
        }
        return Err(libc::EINTR);
    }
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return Err(libc::EAGAIN);
    }
    Ok(())
}

/// What [`poll_with_signals_held`] leaves the wait to do.
enum Polled {
    /// News came (or the queue was settled for sleeping and the call looks again): the
    /// wait is over, the caller's signal mask restored.
    Done,
    /// Nothing came: sleep, letting in the signals held back with this mask (the caller's).
    Sleep(libc::sigset_t),
    /// Signals could not be held back: sleep at once, without polling.
    NotHeld,
}

/// [`poll_before_sleeping`] with every signal held back, then the outcome applied to the
/// socket's wait (see [`SanSocket::polled`]).
fn poll_with_signals_held(index: u32, fds: &WaitFds) -> Polled {
    let mut outer = core::mem::MaybeUninit::<libc::sigset_t>::uninit();
    let mut all = core::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigfillset initialises `all`; pthread_sigmask writes the previous mask into
    // `outer` (only read when the call succeeded).
    let blocked = unsafe {
        libc::sigfillset(all.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_BLOCK, all.as_ptr(), outer.as_mut_ptr()) == 0
    };
    if !blocked {
        return Polled::NotHeld;
    }
    // SAFETY: written by the successful pthread_sigmask above.
    let outer = unsafe { outer.assume_init() };
    let found = poll_before_sleeping(index);
    let after = match lock(index).as_mut() {
        Some(SanObject::Socket(socket)) => {
            let after = socket.polled(found);
            match after {
                AfterPolling::Found => socket.finish_polled_wait(fds),
                AfterPolling::LookAgain => socket.finish_wait(fds, false),
                AfterPolling::Sleep => {}
            }
            after
        }
        _ => AfterPolling::Found,
    };
    if after == AfterPolling::Sleep {
        return Polled::Sleep(outer);
    }
    // SAFETY: restores the caller's own mask.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &outer, core::ptr::null_mut()) };
    Polled::Done
}

/// A blocked verbs reader polls the completion queue, its lock taken per round so other
/// threads keep using the socket, until there is news or the budget
/// ([`poll_budget`]) is spent. Signals are held back meanwhile (the caller's
/// mask is restored by the sleep that follows, or at once when news came): a signal that
/// arrives while we poll must still interrupt the sleep, as it would have interrupted the
/// call (`EINTR` for a handler without `SA_RESTART`); delivered at once, it would be gone
/// before the sleep and a program that breaks a blocking read with `alarm()` would hang.
fn poll_before_sleeping(index: u32) -> bool {
    for _ in 0..poll_budget() {
        match lock(index).as_mut() {
            Some(SanObject::Socket(socket)) => {
                if socket.poll_round() {
                    return true;
                }
            }
            _ => return true,
        }
        std::hint::spin_loop();
    }
    false
}

/// Whether every signal with a handler has `SA_RESTART` (then an interrupted blocking call is
/// restarted, whichever signal it was). Only asked after an `EINTR`.
fn every_handler_restarts() -> bool {
    // Faults are delivered to the faulting instruction, never to a sleeping poll (and the
    // Rust runtime installs SIGSEGV/SIGBUS handlers without SA_RESTART).
    const SYNCHRONOUS: [c_int; 6] = [
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGILL,
        libc::SIGFPE,
        libc::SIGTRAP,
        libc::SIGSYS,
    ];
    (1..=libc::SIGRTMAX()).all(|signal| {
        if SYNCHRONOUS.contains(&signal) {
            return true;
        }
        // SAFETY: plain data, zero is valid.
        let mut action: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: querying (not changing) the disposition into our struct.
        let rc = unsafe { libc::sigaction(signal, core::ptr::null(), &mut action) };
        rc != 0
            || action.sa_sigaction == libc::SIG_DFL
            || action.sa_sigaction == libc::SIG_IGN
            || action.sa_flags & libc::SA_RESTART != 0
    })
}

/// Both ends of this connection live in this process, and the thread that would drive the
/// other end may be this very one (a single-threaded program talking to itself): drive the
/// other end here — switch it if it is a pending client whose segment is attached, else pump
/// its session. `try_lock` only, so two waiters can never deadlock. True when it did work.
fn assist_in_process_peer(index: u32) -> bool {
    let name = match lock(index).as_ref() {
        Some(SanObject::Socket(socket))
            if socket.peer_in_process() || socket.phase == Phase::Pending =>
        {
            socket.name
        }
        _ => return false,
    };
    let Some(other) = in_process_peer(&name, index) else {
        return false;
    };
    let Ok(mut slot) = slot(other).try_lock() else {
        return false;
    };
    let Some(SanObject::Socket(peer)) = slot.as_mut() else {
        return false;
    };
    match peer.phase {
        Phase::Pending if peer.peer_attached() => {
            let Some(fd) = registry().get(other).map(|r| r.fd.load(Ordering::Relaxed)) else {
                return false;
            };
            if peer.switch(fd).is_ok() {
                COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
                move_epoll_registrations(other, fd, peer);
                true
            } else {
                false
            }
        }
        Phase::Pending => false,
        Phase::Switched => {
            peer.service();
            false
        }
    }
}

/// Before a poll-style wait: drives every connection whose two ends are both in this process
/// (the thread about to sleep may be the only one that would ever drive the other end).
/// Costs nothing without in-process connections.
pub fn assist_all_in_process() {
    let indices: Vec<u32> = match in_process_indices() {
        Some(indices) => indices,
        None => return,
    };
    // A handshake needs a round trip per side: three passes let a pending client switch, the
    // acceptor answer, and the client flush what it queued meanwhile.
    for _pass in 0..3 {
        assist_pass(&indices);
    }
}

fn assist_pass(indices: &[u32]) {
    for &index in indices {
        let Ok(mut slot) = slot(index).try_lock() else {
            continue;
        };
        let Some(SanObject::Socket(socket)) = slot.as_mut() else {
            continue;
        };
        match socket.phase {
            Phase::Pending if socket.peer_attached() => {
                let Some(fd) = registry().get(index).map(|r| r.fd.load(Ordering::Relaxed)) else {
                    continue;
                };
                if socket.switch(fd).is_ok() {
                    COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
                    move_epoll_registrations(index, fd, socket);
                }
            }
            Phase::Pending => {}
            Phase::Switched => socket.service(),
        }
    }
}

/// Drops the SAN object of a pending client whose server turned out plain (a byte arrived on
/// TCP while the segment was not attached): from now on the socket is plain TCP.
fn downgrade_pending(index: u32, slot: &mut Option<SanObject>) {
    // (We declined the acceptor's connect ourselves: the peer is capable, and is not to be
    // remembered as plain.)
    let declined = matches!(slot, Some(SanObject::Socket(socket)) if socket.declined_locally());
    if declined {
        tracing::debug!(
            index,
            "pending SAN client: no resources for the SAN, staying on TCP"
        );
    } else {
        tracing::debug!(index, "pending SAN client: plain server, staying on TCP");
    }
    if let Some(SanObject::Socket(socket)) = slot.take() {
        drop(socket);
        LIVE.fetch_sub(1, Ordering::Relaxed);
        forget_name(index);
    }
    if let Some(record) = registry().get(index) {
        record.set_flag(flags::SAN, false);
        record.path.store(DataPath::Tcp as u32, Ordering::Release);
        let reason = if declined {
            Bypass::SanResources
        } else {
            Bypass::PeerNotCapable
        };
        record.bypass.store(reason as u32, Ordering::Release);
        if let (false, (_, Some(peer))) = (declined, record.addresses()) {
            if let Some(provider) = provider() {
                provider.negative.mark_plain(canonical_addr(peer));
            }
        }
    }
    if !declined {
        COUNTERS.peer_plain.fetch_add(1, Ordering::Relaxed);
    }
}

/// The switch failed after the acceptor committed to the SAN: the connection cannot go on.
fn break_connection(fd: c_int, index: u32, slot: &mut Option<SanObject>) -> c_int {
    if let Some(SanObject::Socket(socket)) = slot.take() {
        drop(socket);
        LIVE.fetch_sub(1, Ordering::Relaxed);
        forget_name(index);
    }
    COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
    if let Some(record) = registry().get(index) {
        record.set_flag(flags::SAN, false);
        record.path.store(DataPath::Tcp as u32, Ordering::Release);
        record
            .bypass
            .store(Bypass::NoProvider as u32, Ordering::Release);
    }
    // SAFETY: plain shutdown(2) of the application's socket.
    unsafe { real::shutdown(fd, libc::SHUT_RDWR) };
    libc::ECONNRESET
}

/// A pending client whose segment is attached switches now. Returns `Err(errno)` if the
/// connection broke.
pub(super) fn switch_if_attached(
    fd: c_int,
    index: u32,
    slot: &mut Option<SanObject>,
) -> Result<(), c_int> {
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return Ok(());
    };
    if socket.phase != Phase::Pending || !socket.peer_attached() {
        return Ok(());
    }
    if socket.switch(fd).is_ok() {
        tracing::debug!(fd, name = %socket.name, "SAN client switched");
        COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
        move_epoll_registrations(index, fd, socket);
        if let Some(record) = registry().get(index) {
            let edge_triggered = record
                .epoll_registrations()
                .any(|(_, events, _)| events & libc::EPOLLET as u32 != 0);
            socket.set_edge_per_arrival(edge_triggered);
        }
        Ok(())
    } else {
        Err(break_connection(fd, index, slot))
    }
}

/// A socket that became SAN after the application added it to epoll sets: the sets now watch
/// the mirror in its place (same events, same data).
fn move_epoll_registrations(index: u32, fd: c_int, socket: &mut SanSocket) {
    // Every caller has just switched the socket: a verbs connection's events go to the
    // service thread from now on.
    super::service::watch_socket(index, socket);
    let Some(mirror) = socket.mirror_fd() else {
        return;
    };
    if repoint_epoll_registrations(index, fd, mirror) {
        socket.set_watched();
    }
}

/// Every epoll set that holds socket `index`'s registration under `from` holds it under `to`
/// instead (same events, same data). True when there was any.
pub(super) fn repoint_epoll_registrations(index: u32, from: c_int, to: c_int) -> bool {
    let Some(record) = registry().get(index) else {
        return false;
    };
    let mut any = false;
    for (epfd, events, data) in record.epoll_registrations() {
        any = true;
        let mut event = libc::epoll_event { events, u64: data };
        // SAFETY: plain epoll_ctl(2) calls on the application's epoll instance.
        unsafe {
            real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, from, core::ptr::null_mut());
            real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, to, &mut event);
        }
    }
    any
}

/// `send`/`write`/`writev`/`sendmsg` on a SAN socket. `None`: not (or no longer) a SAN
/// socket — the caller makes the real call.
pub fn send_iov(fd: c_int, index: u32, bufs: &[RawBuf], send_flags: c_int) -> Option<isize> {
    let sent = send_iov_inner(fd, index, bufs, send_flags);
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        socket.leaving_call();
        socket.note_call(sent.is_some_and(|n| n > 0), false);
    }
    sent
}

fn send_iov_inner(fd: c_int, index: u32, bufs: &[RawBuf], send_flags: c_int) -> Option<isize> {
    if orphaned(index) {
        return Some(fail(libc::ECONNRESET));
    }
    if record_flag(index, flags::STASHED) {
        // Sending is plain TCP; only reads see the stash.
        return None;
    }
    let total: usize = bufs.iter().map(|b| b.len).fold(0, usize::saturating_add);
    let nonblocking = send_flags & libc::MSG_DONTWAIT != 0 || record_flag(index, flags::NONBLOCK);
    let deadline = (!nonblocking)
        .then(|| timeout_of(index, fd, libc::SO_SNDTIMEO))
        .flatten();
    let urgent = send_flags & libc::MSG_OOB != 0;
    let mut done = 0usize;
    // Set when the receiver turned a rendezvous of this call down: the rest goes inline.
    let mut inline_only = false;
    // Since when this call waits with the peer's data unread (`absorb_if_stalled`).
    let mut stalled_since = None;
    loop {
        let mut slot = lock(index);
        if let Err(code) = switch_if_attached(fd, index, &mut slot) {
            return Some(if done > 0 { done as isize } else { fail(code) });
        }
        downgrade::settle(fd, index, &mut slot);
        let Some(SanObject::Socket(socket)) = slot.as_mut() else {
            return if done > 0 { Some(done as isize) } else { None };
        };
        let wait = if socket.phase == Phase::Pending {
            // Counted TCP send (nonblocking under the lock, so the count is exact).
            let n = send_on_tcp(fd, index, bufs, done, send_flags);
            if n > 0 {
                socket.count_tcp_sent(n as u64);
                done += n as usize;
                if done >= total || nonblocking {
                    return Some(done as isize);
                }
                continue;
            }
            if n == 0 && total == 0 {
                return Some(0);
            }
            let code = errno::get();
            if code != libc::EAGAIN || nonblocking {
                return Some(if done > 0 { done as isize } else { fail(code) });
            }
            socket.prepare_wait(libc::POLLOUT)
        } else {
            let piece = next_piece(bufs, done);
            if !socket.queues_without_drive(piece.len()) {
                socket.service();
            }
            if total == 0 {
                return Some(0);
            }
            socket.wake_pending_client(fd);
            if !nonblocking && !urgent && !inline_only && socket.wants_rendezvous(piece.len()) {
                match socket.start_send_rendezvous(piece) {
                    Ok(ticket) => {
                        drop(slot);
                        match wait_send_rendezvous(index, fd, ticket) {
                            Ok(0) => {
                                // The receiver could not take it zero-copy and nothing was
                                // consumed: this call sends the rest inline.
                                inline_only = true;
                                continue;
                            }
                            Ok(n) => {
                                done += n;
                                if n < piece.len() || done >= total {
                                    return Some(done as isize);
                                }
                                continue;
                            }
                            Err(code) => return Some(send_failed(done, code, send_flags)),
                        }
                    }
                    // The connection is downgrading: the rest goes on TCP.
                    Err(DOWNGRADED) => continue,
                    // Another thread's rendezvous is in progress: wait for it to end.
                    Err(libc::EAGAIN) => {
                        let wait = socket.prepare_send_wait();
                        drop(slot);
                        if let Err(code) = block(index, fd, wait, deadline) {
                            return Some(if done > 0 { done as isize } else { fail(code) });
                        }
                        continue;
                    }
                    Err(code) => return Some(send_failed(done, code, send_flags)),
                }
            }
            match socket.send(piece, urgent) {
                Ok(n) => {
                    socket.service();
                    done += n;
                    if done >= total {
                        return Some(done as isize);
                    }
                    continue;
                }
                Err(DOWNGRADED) => {
                    // Our stream goes on on TCP (after the session's queued bytes and its
                    // `Downgrade`): nonblocking under the lock, waiting like a pending client.
                    let n = send_on_tcp(fd, index, bufs, done, send_flags);
                    if n > 0 {
                        done += n as usize;
                        if done >= total || nonblocking {
                            return Some(done as isize);
                        }
                        continue;
                    }
                    let code = errno::get();
                    if code != libc::EAGAIN || nonblocking {
                        return Some(if done > 0 { done as isize } else { fail(code) });
                    }
                    socket.prepare_wait(libc::POLLOUT)
                }
                Err(libc::EAGAIN) => {
                    if nonblocking {
                        // A short count, like EAGAIN, tells an edge-triggered caller to wait
                        // for EPOLLOUT: `M` must be lowered so that the peer's returned room
                        // makes that edge (room that appeared meanwhile: send on).
                        if socket.lower_writable() {
                            return Some(if done > 0 {
                                done as isize
                            } else {
                                fail(libc::EAGAIN)
                            });
                        }
                        continue;
                    }
                    match socket.blocked_send_wait(&mut stalled_since) {
                        Some(wait) => Some(wait),
                        None => continue,
                    }
                }
                Err(code) => return Some(send_failed(done, code, send_flags)),
            }
        };
        drop(slot);
        if let Err(code) = block(index, fd, wait, deadline) {
            return Some(if done > 0 { done as isize } else { fail(code) });
        }
    }
}

/// A send failed with `code` after `done` bytes: the count if any, else the error (and
/// SIGPIPE for a broken stream unless `MSG_NOSIGNAL`, as the kernel does).
fn send_failed(done: usize, code: c_int, send_flags: c_int) -> isize {
    if done > 0 {
        return done as isize;
    }
    if code == libc::EPIPE && send_flags & libc::MSG_NOSIGNAL == 0 {
        // SAFETY: raising SIGPIPE, as the kernel does for a broken stream.
        unsafe { libc::raise(libc::SIGPIPE) };
    }
    fail(code)
}

/// Waits (lock released while sleeping) until rendezvous send `ticket` completes: the bytes
/// it delivered, or the errno. Neither signals nor `SO_SNDTIMEO` end the wait: until the
/// session reports completion the peer may still be reading the application's buffer.
fn wait_send_rendezvous(index: u32, fd: c_int, ticket: SendTicket) -> Result<usize, c_int> {
    let mut stalled_since = None;
    loop {
        let wait = {
            let mut slot = lock(index);
            let Some(SanObject::Socket(socket)) = slot.as_mut() else {
                // Closed by another thread (its close drove the transfer to an end).
                return Err(libc::EBADF);
            };
            socket.service();
            if let Some(result) = socket.take_send_completion(ticket) {
                return result;
            }
            // The completion message raises our writability (every message from the peer
            // does); unread data, which only the application can consume once this send
            // returns, must not keep the wait awake (but a stalled peer's is absorbed).
            match socket.blocked_send_wait(&mut stalled_since) {
                Some(wait) => Some(wait),
                None => continue,
            }
        };
        let _ = block(index, fd, wait, None);
    }
}

/// The rendezvous segment at the head of the stream, zero-copy into the caller's buffers
/// after `done` bytes (the first remaining buffer; with `peek`, a staging buffer of the whole
/// remaining length, scattered). `Ok(Some(n))`: `n` bytes received; `Ok(None)`: nothing
/// yet, read on (the segment was turned down, or another thread is receiving it).
/// Like a rendezvous send, the wait ignores signals and deadlines (the buffer is in use).
fn recv_rendezvous(
    index: u32,
    fd: c_int,
    bufs: &[RawBuf],
    done: usize,
    peek: bool,
) -> Result<Option<usize>, c_int> {
    let mut staging = Vec::new();
    let target: &mut [u8] = if peek {
        let want: usize = bufs.iter().map(|b| b.len).sum::<usize>() - done;
        staging.resize(want, 0u8);
        &mut staging
    } else {
        let Some(first) = remaining_pieces(bufs, done).next() else {
            return Ok(Some(0));
        };
        if first.iov_base.is_null() {
            return Err(libc::EFAULT);
        }
        // SAFETY: the caller's buffer is writable for its length during the hook call, which
        // does not return before the receive into it completed.
        unsafe { core::slice::from_raw_parts_mut(first.iov_base.cast::<u8>(), first.iov_len) }
    };
    let ticket = {
        let mut slot = lock(index);
        let Some(SanObject::Socket(socket)) = slot.as_mut() else {
            return Err(libc::EBADF);
        };
        match socket.start_recv_rendezvous(target, peek) {
            Ok(ticket) => ticket,
            Err(SinkRefused::Rejected) => return Ok(None),
            Err(SinkRefused::Errno(libc::EAGAIN)) => {
                let wait = socket.prepare_wait(0);
                drop(slot);
                block(index, fd, wait, None)?;
                return Ok(None);
            }
            Err(SinkRefused::Errno(code)) => return Err(code),
        }
    };
    let received = loop {
        let wait = {
            let mut slot = lock(index);
            let Some(SanObject::Socket(socket)) = slot.as_mut() else {
                return Err(libc::EBADF);
            };
            socket.service();
            if let Some(result) = socket.take_recv_completion(ticket, peek) {
                if !peek {
                    socket.settle_readable();
                }
                break result?;
            }
            socket.prepare_completion_wait()
        };
        let _ = block(index, fd, wait, None);
    };
    if peek {
        scatter(bufs, done, &staging[..received.min(staging.len())]);
    }
    Ok(Some(received))
}

/// Copies SAN stream bytes into `bufs` after `done` bytes: `Ok(n)` (0 at end of stream).
fn recv_into(
    socket: &mut SanSocket,
    bufs: &[RawBuf],
    done: usize,
    peek: bool,
) -> Result<usize, c_int> {
    if peek {
        // A peek must see the stream from its start in every buffer: read once, scatter.
        let want: usize = bufs.iter().map(|b| b.len).sum::<usize>() - done;
        let mut staging = vec![0u8; want];
        let n = socket.recv(&mut staging, true)?;
        scatter(bufs, done, &staging[..n]);
        return Ok(n);
    }
    let mut copied = 0;
    for buf in remaining_pieces(bufs, done) {
        if buf.iov_base.is_null() {
            break;
        }
        // SAFETY: the caller's buffer is writable for its length during the hook call.
        let target =
            unsafe { core::slice::from_raw_parts_mut(buf.iov_base.cast::<u8>(), buf.iov_len) };
        match socket.recv(target, false) {
            Ok(n) => {
                copied += n;
                if n < target.len() {
                    break;
                }
            }
            Err(code) if copied == 0 => return Err(code),
            Err(_) => break,
        }
    }
    Ok(copied)
}

/// `recv`/`read`/`readv`/`recvmsg` on a SAN socket. `None`: not (or no longer) a SAN socket.
pub fn recv_iov(fd: c_int, index: u32, bufs: &[RawBuf], recv_flags: c_int) -> Option<isize> {
    let result = recv_iov_inner(fd, index, bufs, recv_flags);
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        socket.note_call(false, result.is_some_and(|n| n > 0));
    }
    if tracing::enabled!(tracing::Level::TRACE) {
        let first = bufs.first().filter(|b| !b.ptr.is_null());
        let shown = match (result, first) {
            (Some(n), Some(buf)) if n > 0 => {
                // SAFETY: the first `n.min(len)` bytes of the caller's buffer were just written.
                let bytes = unsafe {
                    core::slice::from_raw_parts(buf.ptr, (n as usize).min(buf.len).min(24))
                };
                String::from_utf8_lossy(bytes).into_owned()
            }
            _ => String::new(),
        };
        tracing::trace!(
            fd,
            ?result,
            errno = errno::get(),
            recv_flags,
            shown,
            "SAN recv"
        );
    }
    result
}

fn recv_iov_inner(fd: c_int, index: u32, bufs: &[RawBuf], recv_flags: c_int) -> Option<isize> {
    if orphaned(index) {
        return Some(fail(libc::ECONNRESET));
    }
    if record_flag(index, flags::STASHED) {
        return downgrade::recv_stashed(fd, index, bufs, recv_flags);
    }
    let total: usize = bufs.iter().map(|b| b.len).fold(0, usize::saturating_add);
    let peek = recv_flags & libc::MSG_PEEK != 0;
    let wait_all = recv_flags & libc::MSG_WAITALL != 0 && !peek;
    let nonblocking = recv_flags & libc::MSG_DONTWAIT != 0 || record_flag(index, flags::NONBLOCK);
    let deadline = (!nonblocking)
        .then(|| timeout_of(index, fd, libc::SO_RCVTIMEO))
        .flatten();
    let mut done = 0usize;
    let partial = |done: usize, code: c_int| if done > 0 { done as isize } else { fail(code) };
    // Set when this call consumed the switch marker: the acceptor wrote it because it has
    // data (or a FIN) for us, queued until our Hello reaches it. A nonblocking reader woken by
    // the marker waits that one round trip (bounded) rather than seeing a spurious EAGAIN.
    let mut handshake_deadline: Option<Instant> = None;
    loop {
        let mut slot = lock(index);
        if let Err(code) = switch_if_attached(fd, index, &mut slot) {
            return Some(partial(done, code));
        }
        if downgrade::settle(fd, index, &mut slot) {
            return if done > 0 { Some(done as isize) } else { None };
        }
        let Some(SanObject::Socket(socket)) = slot.as_mut() else {
            return if done > 0 { Some(done as isize) } else { None };
        };
        let wait = if socket.phase == Phase::Pending {
            // Is there a byte on TCP, and is the segment attached? (The exact rule.)
            let mut byte = 0u8;
            // SAFETY: one writable byte.
            let n = unsafe {
                real::recv(
                    fd,
                    (&mut byte as *mut u8).cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n < 0 && errno::get() == libc::EAGAIN {
                if nonblocking {
                    return Some(fail(libc::EAGAIN));
                }
                socket.prepare_wait(libc::POLLIN)
            } else if socket.peer_attached_settled() {
                if n == 1 {
                    // The marker: consume it; the switch happens at the top of the loop.
                    socket.consume_marker(fd);
                    socket.marker_consumed();
                    handshake_deadline = Instant::now().checked_add(HANDSHAKE_WAIT);
                }
                continue;
            } else {
                // A plain server's data, EOF or an error: this connection is plain TCP.
                downgrade_pending(index, &mut slot);
                return None;
            }
        } else {
            socket.service();
            if total == 0 {
                return Some(0);
            }
            let backlog = socket.tcp_backlog();
            // After the peer's `Downgrade` (and the bytes before it) its stream goes on on TCP.
            let downgraded_read = backlog == Some(0) && socket.reads_on_tcp();
            if downgraded_read {
                socket.consume_marker_blocking(fd, MARKER_WAIT);
            }
            let from_tcp = match backlog {
                Some(0) if downgraded_read => Some(u64::MAX),
                Some(0) => None,
                Some(left) => Some(left),
                None if socket.tcp_eof() => None,
                None => Some(u64::MAX),
            };
            if let Some(limit) = from_tcp {
                let n = recv_tcp(fd, bufs, done, limit, recv_flags);
                if n > 0 {
                    if !peek {
                        socket.count_tcp_received(n as u64);
                        if let Some(record) = registry().get(index) {
                            record.count(Counter::TcpReceived, n as u64);
                        }
                        if socket.tcp_backlog() == Some(0) {
                            // The client's TCP bytes are done: the mirror must now say exactly
                            // whether the session has more (an edge-triggered reader that got
                            // a short read waits for the next edge).
                            socket.settle_readable();
                        }
                    }
                    done += n as usize;
                    if wait_all && done < total {
                        continue;
                    }
                    return Some(done as isize);
                }
                if n == 0 && downgraded_read {
                    return Some(done as isize);
                }
                if n == 0 {
                    // TCP end-of-file: before the client's count is known it may still be
                    // racing its Hello (sent before its FIN): look once more.
                    socket.service();
                    if socket.tcp_backlog().is_none() {
                        socket.set_tcp_eof();
                        return Some(done as isize);
                    }
                    if socket.tcp_backlog() != Some(0) {
                        // The client died or broke the protocol before its bytes arrived.
                        return Some(partial(done, libc::ECONNRESET));
                    }
                    continue;
                }
                let code = errno::get();
                if code != libc::EAGAIN {
                    return Some(partial(done, code));
                }
                let tcp_only = backlog != Some(0) && socket.is_broken();
                if tcp_only {
                    // The session ended while the client's TCP bytes were still due (it
                    // closed or died while pending, before its Hello): the rest of them, and
                    // the end of its stream, come on TCP alone, and the mirror, which fired
                    // its last edge (hang-up) already, cannot report them. Waiters watch TCP
                    // from now on (an edge-triggered one saw EAGAIN and waits for an edge).
                    if !socket.epoll_on_tcp {
                        tracing::debug!(fd, name = %socket.name, "session gone before the client's TCP bytes: waiting on TCP");
                    }
                    downgrade::epoll_back_to_tcp(index, fd, socket);
                }
                if done > 0 && !wait_all {
                    return Some(done as isize);
                }
                if nonblocking {
                    return Some(partial(done, libc::EAGAIN));
                }
                if tcp_only {
                    Some(SanSocket::tcp_wait(libc::POLLIN))
                } else {
                    // The client's Hello (SAN) or its pending bytes (TCP) will wake us.
                    socket.prepare_wait(libc::POLLIN)
                }
            } else {
                match recv_into(socket, bufs, done, peek) {
                    Ok(n) => {
                        if n == 0 && total > 0 {
                            tracing::debug!(fd, done, "SAN end of stream");
                        }
                        if n > 0 {
                            socket.service();
                            if !peek {
                                socket.settle_readable();
                            }
                        }
                        done += n;
                        if n > 0 && wait_all && done < total {
                            continue;
                        }
                        return Some(done as isize);
                    }
                    Err(libc::EAGAIN) => {
                        if done > 0 && !wait_all {
                            return Some(done as isize);
                        }
                        let in_handshake = handshake_deadline.is_some_and(|d| Instant::now() < d);
                        if nonblocking && !in_handshake {
                            if socket.lower_readable() {
                                return Some(partial(done, libc::EAGAIN));
                            }
                            continue;
                        }
                        if in_handshake {
                            // Bounded: give up with EAGAIN at the deadline.
                            let wait = socket.prepare_wait(0);
                            drop(slot);
                            if block(index, fd, wait, handshake_deadline).is_err() {
                                handshake_deadline = None;
                            }
                            continue;
                        }
                        socket.prepare_read_wait()
                    }
                    // The peer's `Downgrade` was just taken in: the next turn reads TCP.
                    Err(DOWNGRADED) => continue,
                    Err(REMOTE_SEGMENT_AHEAD) => {
                        drop(slot);
                        match recv_rendezvous(index, fd, bufs, done, peek) {
                            Ok(None) => continue,
                            Ok(Some(n)) => {
                                done += n;
                                if n > 0 && wait_all && done < total {
                                    continue;
                                }
                                return Some(done as isize);
                            }
                            Err(code) => return Some(partial(done, code)),
                        }
                    }
                    Err(code) => return Some(partial(done, code)),
                }
            }
        };
        drop(slot);
        if let Err(code) = block(index, fd, wait, deadline) {
            return Some(partial(done, code));
        }
    }
}

/// A pending client whose acceptor attached switches now (any hook may call this before
/// acting on the socket). Errors break the connection, as in the data path.
pub(super) fn switch_pending(fd: c_int, index: u32) {
    if orphaned(index) {
        return;
    }
    let mut slot = lock(index);
    let _ = switch_if_attached(fd, index, &mut slot);
}

/// `shutdown()` on a SAN socket (the pending client's record flags carry it into the session
/// at the switch).
pub(super) fn shutdown(fd: c_int, index: u32, how: c_int) {
    if orphaned(index) {
        return;
    }
    switch_pending(fd, index);
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        if socket.phase == Phase::Switched {
            if how != libc::SHUT_RD {
                socket.wake_pending_client(fd);
            }
            socket.shutdown(how);
        }
    }
}

/// `poll()`/`ppoll()` on a set containing SAN sockets: each switched SAN socket's entry is
/// watched through its mirror `M` (the caller polls `fds` as rewritten, then calls
/// [`poll_fds`] again with `restore` to put the application's fds back).
///
/// Returns the original fds of the rewritten entries (to restore), or an empty vector when
/// nothing was rewritten.
pub fn poll_fds(
    fds: &mut [libc::pollfd],
    restore: Option<&[(usize, c_int)]>,
) -> Vec<(usize, c_int)> {
    if let Some(saved) = restore {
        for &(position, fd) in saved {
            if let Some(entry) = fds.get_mut(position) {
                entry.fd = fd;
                correct_revents(entry);
            }
        }
        return Vec::new();
    }
    let mut saved = Vec::new();
    if LIVE.load(Ordering::Relaxed) == 0 {
        return saved;
    }
    // A set without SAN sockets is not ours to drive: no allocation, no lock (the in-process
    // assist matters only to a wait that depends on a SAN socket).
    let mut assisted = false;
    for (position, entry) in fds.iter_mut().enumerate() {
        let Some(index) = san_index(crate::fdtable::table().lookup(entry.fd)) else {
            continue;
        };
        if !assisted {
            assisted = true;
            assist_all_in_process();
        }
        if orphaned(index) {
            continue;
        }
        switch_pending(entry.fd, index);
        let mut slot = lock(index);
        downgrade::settle(entry.fd, index, &mut slot);
        let mirror = match slot.as_mut() {
            Some(SanObject::Socket(socket))
                if socket.phase == Phase::Switched && !socket.epoll_on_tcp =>
            {
                socket.set_watched();
                // (The service thread must hear of arrivals while this thread sleeps.)
                socket.settle_direct_wait();
                socket.mirror_fd()
            }
            // Bytes in the stash: its eventfd (readable) stands in; the socket's own state
            // is added back afterwards.
            Some(SanObject::Stashed(stashed))
                if stashed.stash.remaining() > 0 && entry.events & libc::POLLIN != 0 =>
            {
                Some(stashed.stash.ready_fd())
            }
            _ => None,
        };
        drop(slot);
        if let Some(mirror) = mirror {
            saved.push((position, entry.fd));
            entry.fd = mirror;
        }
    }
    saved
}

/// Makes a SAN entry's `revents` (as the mirror reported them) agree with the session: a
/// spurious IN (a token for a handshake or a credit, no data) is lowered and dropped; ERR and
/// RDHUP, which the mirror cannot show, are added from the session's state.
fn correct_revents(entry: &mut libc::pollfd) {
    let Some(index) = san_index(crate::fdtable::table().lookup(entry.fd)) else {
        return;
    };
    let mut slot = lock(index);
    if let Some(SanObject::Stashed(_)) = slot.as_ref() {
        // The eventfd said "stash readable"; the rest is the socket's own state now.
        let mut own = libc::pollfd {
            fd: entry.fd,
            events: entry.events,
            revents: 0,
        };
        // SAFETY: one pollfd, zero timeout.
        unsafe { real::poll(&mut own, 1, 0) };
        entry.revents = own.revents | (entry.revents & libc::POLLIN);
        return;
    }
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return;
    };
    if socket.epoll_on_tcp {
        return;
    }
    if entry.revents & libc::POLLHUP != 0 {
        socket.mirror_hung_up();
    }
    socket.service();
    let readiness = socket.readiness();
    if entry.revents & libc::POLLIN != 0
        && !readiness.readable
        && !socket.tcp_bytes_pending()
        && socket.lower_readable()
    {
        entry.revents &= !libc::POLLIN;
    }
    if readiness.error {
        entry.revents |= libc::POLLERR;
    }
    if readiness.read_hup && entry.events & libc::POLLRDHUP != 0 {
        entry.revents |= libc::POLLRDHUP;
    }
}

/// After `epoll_wait` returned `events` for `epfd`: a SAN socket reported readable only
/// because of a handshake or credit token (no data, no FIN) has its mirror lowered and the
/// IN bit dropped, as `correct_revents` does for `poll`; events left empty are removed.
/// Returns the new count. A level-triggered reader then never sees readiness without data
/// (strict clients such as wrk treat that `EAGAIN` as an error).
pub fn correct_epoll_events(epfd: c_int, events: &mut [libc::epoll_event]) -> usize {
    if LIVE.load(Ordering::Relaxed) == 0 {
        return events.len();
    }
    let mut kept = 0;
    for position in 0..events.len() {
        let mut event = events[position];
        if event.events & libc::EPOLLIN as u32 != 0 {
            let data = event.u64;
            let mut found = None;
            registry().for_each_live(|index, record| {
                if found.is_none()
                    && record.flags() & flags::SAN != 0
                    && record
                        .epoll_registrations()
                        .any(|(e, _, d)| e == epfd && d == data)
                {
                    found = Some(index);
                }
            });
            if let Some(index) = found.filter(|&index| !orphaned(index)) {
                let mut slot = lock(index);
                // A pending client is watched on its TCP socket. IN there with the segment
                // attached is the acceptor's switch marker, not data: switch now (the
                // registration moves to the mirror, which rises when the acceptor's first
                // bytes arrive) and judge the event like a switched socket's below. Without
                // the segment (a plain server's data) the kernel's report stands.
                if let Some(fd) = registry().get(index).map(|r| r.fd.load(Ordering::Acquire)) {
                    let _ = switch_if_attached(fd, index, &mut slot);
                }
                if let Some(SanObject::Socket(socket)) = slot
                    .as_mut()
                    .filter(|o| matches!(o, SanObject::Socket(s) if s.phase == Phase::Switched))
                {
                    if event.events & libc::EPOLLHUP as u32 != 0 {
                        socket.mirror_hung_up();
                    }
                    socket.service();
                    let readiness = socket.readiness();
                    if !readiness.readable && !socket.tcp_bytes_pending() && socket.lower_readable()
                    {
                        event.events &= !(libc::EPOLLIN as u32);
                    }
                    if readiness.error {
                        event.events |= libc::EPOLLERR as u32;
                    }
                }
            }
        }
        if event.events != 0 {
            events[kept] = event;
            kept += 1;
        }
    }
    kept
}

/// FIONREAD on a SAN socket; `None` when the kernel's answer is the right one (pending).
pub fn readable_bytes(fd: c_int, index: u32) -> Option<c_int> {
    if orphaned(index) {
        return None;
    }
    switch_pending(fd, index);
    // Both ends in this thread: let the other end deliver what it has queued.
    assist_in_process_peer(index);
    let mut slot = lock(index);
    downgrade::settle(fd, index, &mut slot);
    if let Some(SanObject::Stashed(stashed)) = slot.as_ref() {
        let mut tcp_queued: c_int = 0;
        // SAFETY: FIONREAD writes one int.
        unsafe {
            real::ioctl(
                fd,
                libc::FIONREAD as _,
                (&mut tcp_queued as *mut c_int) as usize,
            )
        };
        let bytes = stashed.stash.remaining() + usize::try_from(tcp_queued).unwrap_or(0);
        return Some(c_int::try_from(bytes).unwrap_or(c_int::MAX));
    }
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return None;
    };
    if socket.phase != Phase::Switched {
        return None;
    }
    socket.service();
    let mut tcp_queued: c_int = 0;
    // SAFETY: FIONREAD writes one int.
    unsafe {
        real::ioctl(
            fd,
            libc::FIONREAD as _,
            (&mut tcp_queued as *mut c_int) as usize,
        )
    };
    let bytes = socket.readable_bytes(usize::try_from(tcp_queued).unwrap_or(0));
    Some(c_int::try_from(bytes).unwrap_or(c_int::MAX))
}

/// `select()`/`pselect()` over a set containing SAN sockets, carried out as `ppoll()` so the
/// mirrors can stand in for them. `None`: no SAN socket in the sets, make the real call.
///
/// # Safety
/// The sets must be null or valid `fd_set`s; `timeout` and `sigmask` null or valid.
pub unsafe fn select_via_poll(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> Option<c_int> {
    if LIVE.load(Ordering::Relaxed) == 0 || !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        return None;
    }
    // SAFETY: per the contract, each set is null or valid.
    let is_set =
        |set: *mut libc::fd_set, fd: c_int| !set.is_null() && unsafe { libc::FD_ISSET(fd, set) };
    // A set without SAN sockets goes to the kernel untouched: no allocation, no lock.
    let any_san = (0..nfds).any(|fd| {
        (is_set(readfds, fd) || is_set(writefds, fd) || is_set(exceptfds, fd))
            && san_index(crate::fdtable::table().lookup(fd)).is_some()
    });
    if !any_san {
        return None;
    }
    let mut pollfds = Vec::new();
    for fd in 0..nfds {
        let mut events = 0;
        if is_set(readfds, fd) {
            events |= libc::POLLIN;
        }
        if is_set(writefds, fd) {
            events |= libc::POLLOUT;
        }
        if is_set(exceptfds, fd) {
            events |= libc::POLLPRI;
        }
        if events != 0 {
            pollfds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    let saved = poll_fds(&mut pollfds, None);
    // SAFETY: valid pollfds; timeout and sigmask per the contract.
    let rc = unsafe {
        real::ppoll(
            pollfds.as_mut_ptr(),
            pollfds.len() as libc::nfds_t,
            timeout,
            sigmask,
        )
    };
    let error = errno::get();
    poll_fds(&mut pollfds, Some(&saved));
    if rc < 0 {
        errno::set(error);
        return Some(rc);
    }
    if pollfds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
        errno::set(libc::EBADF);
        return Some(-1);
    }
    let mut count = 0;
    for set in [readfds, writefds, exceptfds] {
        if !set.is_null() {
            // SAFETY: a valid set per the contract.
            unsafe { libc::FD_ZERO(set) };
        }
    }
    for p in &pollfds {
        let mark = |set: *mut libc::fd_set, wanted: bool, count: &mut c_int| {
            if wanted && !set.is_null() {
                // SAFETY: a valid set; `p.fd < nfds ≤ FD_SETSIZE`.
                unsafe { libc::FD_SET(p.fd, set) };
                *count += 1;
            }
        };
        let readable = p.events & libc::POLLIN != 0
            && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        let writable =
            p.events & libc::POLLOUT != 0 && p.revents & (libc::POLLOUT | libc::POLLERR) != 0;
        let exceptional = p.events & libc::POLLPRI != 0 && p.revents & libc::POLLPRI != 0;
        mark(readfds, readable, &mut count);
        mark(writefds, writable, &mut count);
        mark(exceptfds, exceptional, &mut count);
    }
    Some(count)
}
