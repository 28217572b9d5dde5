//! Removing a SAN socket's epoll registration lazily.
//!
//! Event loops remove and add their sockets' registrations around every request (the
//! `ae` loop of redis and of its benchmark: five `epoll_ctl` calls per request, three of
//! them a removal or the addition after one). Over TCP each is a system call the kernel
//! needs; for a SAN socket, watched through its mirror, a removal can wait: the kernel keeps
//! the mirror's registration, the record marks it removed (`REMOVED_BY_APPLICATION`), and
//!
//! * an addition in the same instance revives it, with one `EPOLL_CTL_MOD` only when its
//!   events or data changed (none for a loop that removes and adds the same interest);
//! * a wait that gets an event of it drops the event and removes it from the kernel then
//!   (so a mirror that stays ready cannot make waits return over and over);
//! * whatever moves or ends the registrations (a downgrade to TCP, the socket's last close,
//!   the instance nested in another, a record out of slots) removes it from the kernel
//!   first.
//!
//! What the application sees is the kernel's behaviour: `ENOENT` for a second removal or a
//! change of a removed registration, no event from a removed one, `EEXIST` for a second
//! addition (the kernel's own answer). Only plain level-triggered registrations in an
//! instance that is not nested are removed so: an edge-triggered or one-shot one would be
//! re-armed differently by a change than by an addition, an exclusive one cannot be changed,
//! and an outer instance would see a nested one ready for an event that is then dropped.

use core::ffi::c_int;
use core::sync::atomic::{AtomicUsize, Ordering};

use super::epoll_index;
use super::epoll_output;
use super::table::{lock, orphaned, SanObject};
use crate::fdtable::table;
use crate::real;
use crate::record::{SocketRecord, EPOLL_SLOTS, KEPT_BY_US, REMOVED_BY_APPLICATION};
use crate::registry::registry;

/// How many registrations may be removed by the application and not yet by the kernel (an
/// upper bound: only what saw a mark set lowers it). Zero spares the waits any look-up.
static REMOVED: AtomicUsize = AtomicUsize::new(0);

/// Whether some registration may be removed by the application and not yet by the kernel
/// (one atomic load).
pub fn any_removed() -> bool {
    REMOVED.load(Ordering::Relaxed) != 0
}

/// Registration flags that keep a removal immediate (see the module documentation).
const EXACT_ONLY: u32 = (libc::EPOLLET | libc::EPOLLONESHOT | libc::EPOLLEXCLUSIVE) as u32;

/// What [`epoll_ctl_on_mirror`] did with the application's call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handled {
    /// Done here: the call returns 0, and the socket's registrations changed (the caller
    /// tells the SAN path, see `epoll_registrations_changed`).
    Done,
    /// The call fails with this errno, as the kernel's would.
    Failed(c_int),
}

/// An `epoll_ctl(epfd, op, …)` of SAN socket `index`, watched through its mirror `mirror`
/// (`event`: the application's, for `ADD`/`MOD`). `None`: the kernel call is made as usual
/// (anything a removal still due stood in the way of is out of it by then).
pub fn epoll_ctl_on_mirror(
    epfd: c_int,
    op: c_int,
    index: u32,
    mirror: c_int,
    event: Option<libc::epoll_event>,
) -> Option<Handled> {
    if orphaned(index) {
        return None;
    }
    let record = registry().get(index)?;
    // (The slot's lock orders this against a wait removing the same registration.)
    let mut slot = lock(index);
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return None;
    };
    if socket.mirror_fd() != Some(mirror) {
        return None;
    }
    if matches!(op, libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD) {
        // The kernel reports a readable file at once to a registration added or changed:
        // arrival tokens that reads left in the mirror go first.
        socket.settle_edge_tokens();
    }
    let current = record
        .kernel_registrations()
        .find(|&(registered_in, _, _)| registered_in == epfd);
    let removed = current.is_some_and(|(_, events, _)| events & REMOVED_BY_APPLICATION != 0);
    let plain = |events: u32| events & EXACT_ONLY == 0 && !table().lookup(epfd).is_nested_epoll();
    if let (libc::EPOLL_CTL_MOD, false, Some((_, events, data)), Some(wanted)) =
        (op, removed, current, event)
    {
        if epoll_output::modify(epfd, index, socket, record, (events, data), wanted) {
            return Some(Handled::Done);
        }
    }
    match op {
        libc::EPOLL_CTL_DEL if removed => Some(Handled::Failed(libc::ENOENT)),
        libc::EPOLL_CTL_DEL => {
            let (_, events, _) = current?;
            if !plain(events) {
                return None;
            }
            record.mark_removed_by_application(epfd);
            REMOVED.fetch_add(1, Ordering::AcqRel);
            Some(Handled::Done)
        }
        libc::EPOLL_CTL_MOD if removed => Some(Handled::Failed(libc::ENOENT)),
        libc::EPOLL_CTL_ADD if removed => {
            let (_, kernel_events, kernel_data) = current?;
            let wanted = event.filter(|event| plain(event.events));
            let Some(mut wanted) = wanted else {
                // Added back as something a change cannot make: as a fresh addition.
                remove_from_kernel(record, epfd, mirror);
                return None;
            };
            // The kernel's events (without the marks of ours).
            let kernel_events = kernel_events & !(REMOVED_BY_APPLICATION | KEPT_BY_US);
            if epoll_output::keep(
                epfd,
                index,
                socket,
                record,
                (kernel_events, kernel_data),
                wanted,
            ) {
                one_less();
                return Some(Handled::Done);
            }
            if kernel_events != wanted.events || kernel_data != { wanted.u64 } {
                // SAFETY: the application's instance and our mirror, a live event.
                let rc = unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, mirror, &mut wanted) };
                if rc != 0 {
                    remove_from_kernel(record, epfd, mirror);
                    return None;
                }
            }
            // (The slot exists: storing the events clears the mark.)
            record.register_epoll(epfd, wanted.events, wanted.u64);
            one_less();
            Some(Handled::Done)
        }
        libc::EPOLL_CTL_ADD
            if current.is_none() && record.kernel_registrations().count() >= EPOLL_SLOTS =>
        {
            // Removed registrations must not cost a new one its slot (the socket would have
            // to leave the SAN): out of the kernel with them first.
            remove_all_from_kernel(record, mirror);
            None
        }
        _ => None,
    }
}

/// Whether an event a wait on `epfd` got, with `data`, is one of a registration the
/// application removed; it is then removed from the kernel, and the caller drops the event.
pub fn drop_removed_event(epfd: c_int, data: u64) -> bool {
    if REMOVED.load(Ordering::Acquire) == 0 {
        return false;
    }
    let Some(index) = epoll_index::lookup(epfd, data) else {
        return false;
    };
    remove_removed_of(index, epfd, data)
}

/// Another registration (of descriptor `fd`, any descriptor) takes `data` in `epfd`: a
/// removed registration with the same data leaves the kernel first, or a wait could not
/// tell its events from the new one's. Costs an atomic load while none is removed.
pub fn before_registering(epfd: c_int, data: u64, index: Option<u32>) {
    if REMOVED.load(Ordering::Acquire) == 0 {
        return;
    }
    if let Some(other) = epoll_index::lookup(epfd, data).filter(|&other| Some(other) != index) {
        remove_removed_of(other, epfd, data);
    }
}

/// Removes SAN socket `index`'s registration in `epfd` with `data` from the kernel if the
/// application removed it; true if it did.
fn remove_removed_of(index: u32, epfd: c_int, data: u64) -> bool {
    if orphaned(index) {
        return false;
    }
    let Some(record) = registry().get(index) else {
        return false;
    };
    let is_removed = |record: &SocketRecord| {
        record
            .kernel_registrations()
            .any(|(e, events, d)| e == epfd && d == data && events & REMOVED_BY_APPLICATION != 0)
    };
    if !is_removed(record) {
        return false;
    }
    let slot = lock(index);
    let Some(SanObject::Socket(socket)) = slot.as_ref() else {
        return false;
    };
    // (Added back meanwhile: the event is the application's.)
    if !is_removed(record) {
        return false;
    }
    if let Some(mirror) = socket.mirror_fd() {
        remove_from_kernel(record, epfd, mirror);
    }
    drop(slot);
    epoll_index::update(index, record);
    true
}

/// Removes from the kernel every registration of `record` the application removed, from the
/// instances that hold it under `fd` (the mirror); the caller holds the socket's slot.
pub fn remove_all_from_kernel(record: &SocketRecord, fd: c_int) {
    // (Each removal clears its slot; the slots are atomics, read one by one.)
    for (epfd, events, _) in record.kernel_registrations() {
        if events & REMOVED_BY_APPLICATION != 0 {
            remove_from_kernel(record, epfd, fd);
        }
    }
}

/// Removes from the kernel the registrations of `record` in `epfd` the application removed
/// (each under `fd`, the mirror); the caller holds the socket's slot.
pub fn remove_removed_in(record: &SocketRecord, epfd: c_int, fd: c_int) {
    if record
        .kernel_registrations()
        .any(|(e, events, _)| e == epfd && events & REMOVED_BY_APPLICATION != 0)
    {
        remove_from_kernel(record, epfd, fd);
    }
}

/// The kernel forgets `fd` in `epfd`, and the record the registration it marked removed.
fn remove_from_kernel(record: &SocketRecord, epfd: c_int, fd: c_int) {
    // SAFETY: plain epoll_ctl(2) on the application's instance and our mirror. (An
    // instance closed meanwhile answers EBADF: nothing is left to remove.)
    unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, core::ptr::null_mut()) };
    record.unregister_epoll(epfd);
    one_less();
}

/// One registration fewer is removed by the application only.
fn one_less() {
    let _ = REMOVED.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
}
