//! The switch-over of a pending client as the process sees it: the client switches at
//! the first call that finds its acceptor attached (or drops its SAN object for good when
//! its server turned out plain), the application's epoll sets move to the mirror and back
//! (a downgrade), and a thread about to sleep drives the other end of an in-process
//! connection first, since it may be the only thread that ever would.

use core::ffi::c_int;
use core::sync::atomic::Ordering;

use super::provider::provider;
use super::service::watch_socket;
use super::socket::{Phase, SanSocket};
use super::table::{
    forget_name, in_process_indices, in_process_peer, lock, orphaned, slot, SanObject, COUNTERS,
    LIVE,
};
use crate::discovery::canonical_addr;
use crate::real;
use crate::record::{flags, Bypass, DataPath};
use crate::registry::registry;

/// A pending client whose acceptor attached switches now (any hook may call this before
/// acting on the socket). Errors break the connection, as in the data path.
pub(super) fn switch_pending(fd: c_int, index: u32) {
    if orphaned(index) {
        return;
    }
    let mut slot = lock(index);
    let _ = switch_if_attached(fd, index, &mut slot);
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
    if socket.phase != Phase::Pending || !socket.peer_attached(fd) {
        return Ok(());
    }
    if socket.switch(fd).is_ok() {
        tracing::debug!(fd, name = %socket.name, "SAN client switched");
        COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
        move_epoll_registrations(index, fd, socket);
        if let Some(record) = registry().get(index) {
            socket.registrations_changed(record);
        }
        Ok(())
    } else {
        Err(break_connection(fd, index, slot))
    }
}

/// Drops the SAN object of a pending client whose server turned out plain (a byte arrived on
/// TCP while the segment was not attached): from now on the socket is plain TCP.
pub(super) fn downgrade_pending(index: u32, slot: &mut Option<SanObject>) {
    // (We declined the acceptor's connect ourselves: the peer is capable, and is not to be
    // remembered as plain.)
    let declined = matches!(slot, Some(SanObject::Socket(socket)) if socket.declined_locally());
    // A shm acceptor that gave up before attaching removed our segment's name (a plain
    // server never touches it).
    let peer_declined = !declined
        && matches!(slot, Some(SanObject::Socket(socket))
        if !socket.is_verbs() && !socket.is_private() && provider().is_some_and(|provider| {
            !provider.dir.handle().contains(socket.name.as_str())
        }));
    if peer_declined {
        tracing::debug!(
            index,
            "pending SAN client: the acceptor declined, staying on TCP"
        );
    } else if declined {
        tracing::debug!(
            index,
            "pending SAN client: no resources for the SAN, staying on TCP"
        );
    } else {
        tracing::debug!(index, "pending SAN client: plain server, staying on TCP");
    }
    let reason = if declined {
        Bypass::SanResources
    } else if peer_declined {
        Bypass::PeerResources
    } else {
        Bypass::PeerNotCapable
    };
    drop_pending(index, slot, reason);
    if let Some(record) = registry().get(index) {
        if let (false, (_, Some(peer))) = (declined || peer_declined, record.addresses()) {
            if let Some(provider) = provider() {
                provider.negative.mark_plain(canonical_addr(peer));
            }
        }
    }
    if !declined && !peer_declined {
        COUNTERS.peer_plain.fetch_add(1, Ordering::Relaxed);
    }
}

/// A pending client that is about to be shared with another process (fork, exec, spawn)
/// withdraws its segment when no acceptor has attached: from now on it is plain TCP, exactly
/// (its bytes so far went on TCP, and no acceptor can attach any more). False when the
/// acceptor attached first (the caller switches and downgrades it instead), or over verbs.
pub(super) fn withdraw_pending(index: u32, slot: &mut Option<SanObject>) -> bool {
    let withdrawn = matches!(slot, Some(SanObject::Socket(socket))
        if socket.phase == Phase::Pending && socket.withdraw());
    if !withdrawn {
        return false;
    }
    tracing::debug!(index, "pending SAN client withdrew: staying on TCP");
    drop_pending(index, slot, Bypass::Downgraded);
    true
}

/// Drops the SAN object of pending client `index` (its slot `slot`): the socket is plain TCP
/// from now on, for `reason`.
fn drop_pending(index: u32, slot: &mut Option<SanObject>, reason: Bypass) {
    if let Some(SanObject::Socket(socket)) = slot.take() {
        drop(socket);
        LIVE.fetch_sub(1, Ordering::Relaxed);
        forget_name(index);
    }
    if let Some(record) = registry().get(index) {
        record.set_flag(flags::SAN, false);
        record.path.store(DataPath::Tcp as u32, Ordering::Release);
        record.bypass.store(reason as u32, Ordering::Release);
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

/// A socket that became SAN after the application added it to epoll sets: the sets now watch
/// the mirror in its place (same events, same data).
fn move_epoll_registrations(index: u32, fd: c_int, socket: &mut SanSocket) {
    // Every caller has just switched the socket: a verbs connection's events go to the
    // service thread from now on.
    watch_socket(index, socket);
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
    // Registrations the application removed go now, not along.
    super::epoll_removal::remove_all_from_kernel(record, from);
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

/// Epoll sets that watch the mirror of `socket` watch the TCP socket again (and `poll`/`select`
/// wait on it too).
pub(super) fn epoll_back_to_tcp(index: u32, fd: c_int, socket: &mut SanSocket) {
    if socket.epoll_on_tcp {
        return;
    }
    socket.epoll_on_tcp = true;
    if let Some(mirror) = socket.mirror_fd() {
        repoint_epoll_registrations(index, mirror, fd);
    }
}

/// Both ends of this connection live in this process, and the thread that would drive the
/// other end may be this very one (a single-threaded program talking to itself): drive the
/// other end here — switch it if it is a pending client whose segment is attached, else pump
/// its session. `try_lock` only, so two waiters can never deadlock. True when it did work.
pub(super) fn assist_in_process_peer(index: u32) -> bool {
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
        Phase::Pending => {
            let Some(fd) = registry().get(other).map(|r| r.fd.load(Ordering::Relaxed)) else {
                return false;
            };
            if !peer.peer_attached(fd) {
                return false;
            }
            if peer.switch(fd).is_ok() {
                COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
                move_epoll_registrations(other, fd, peer);
                true
            } else {
                false
            }
        }
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
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("assist_all_in_process");
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
            Phase::Pending => {
                let Some(fd) = registry().get(index).map(|r| r.fd.load(Ordering::Relaxed)) else {
                    continue;
                };
                if !socket.peer_attached(fd) {
                    continue;
                }
                if socket.switch(fd).is_ok() {
                    COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
                    move_epoll_registrations(index, fd, socket);
                }
            }
            Phase::Switched => socket.service(),
        }
    }
}
