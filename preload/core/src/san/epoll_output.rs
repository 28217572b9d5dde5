//! Output interest kept in user space.
//!
//! Event loops ask for `EPOLLOUT` around every write: `ae` (redis, its benchmark, wrk) turns
//! a connection's registration from `EPOLLIN` to `EPOLLIN|EPOLLOUT` when it has a request to
//! send, writes it when the wait reports the socket writable, and turns it back: two
//! `epoll_ctl` calls per request, each a system call the kernel needs over TCP. A SAN socket's
//! writability is known from its session without the kernel, so such a change can stay here:
//! the kernel's registration (the mirror's) keeps `EPOLLIN`, the record marks the application's
//! `EPOLLOUT` ([`OUTPUT_KEPT_BY_US`]), and
//!
//! * a wait on that instance reports `EPOLLOUT` for it from the session while it is plainly
//!   writable (switched, room for a send, no error, shutdown or end of the peer's stream),
//!   together with what a zero-timeout kernel wait reports (merged into the kernel's event of
//!   the same registration, or added), as the kernel reports a writable level-triggered
//!   registration at every wait;
//! * the change back to `EPOLLIN` is the record's alone;
//! * whatever the session cannot answer plainly (no room, an error, a shutdown) makes the
//!   change the kernel's after all (`EPOLL_CTL_MOD` with the application's events: the
//!   mirror's writability then answers), and so does anything else: another change, the
//!   instance registered in another, duplicated or shared with a child by `fork`, a thread of
//!   this process asleep in a wait on the instance when the change is made (the kernel would
//!   wake it), a wait with room for one event.
//!
//! Only plain level-triggered registrations (no `EPOLLET`, `EPOLLONESHOT`, `EPOLLEXCLUSIVE`)
//! of an instance this process created (by the number the application uses for it) are kept
//! so. Everything here is lock-free: entries are atomics, claimed and cleared by
//! compare-and-swap, so a `fork` never finds one of them held.

use core::ffi::c_int;
use core::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::socket::SanSocket;
use super::table::{lock, orphaned, SanObject};
use crate::fdtable::table;
use crate::real;
use crate::record::{
    application_events, flags, SocketRecord, INPUT_DROPPED_BY_US, KEPT_BY_US, OUTPUT_KEPT_BY_US,
    REMOVED_BY_APPLICATION,
};
use crate::registry::registry;

/// Epoll instances numbered below this may have output kept.
const INSTANCES: usize = 1024;
/// Registrations whose output may be kept at once (more are the kernel's).
const CAPACITY: usize = 64;
/// Most kept outputs one wait reports (more are handed to the kernel).
pub const REPORTED_PER_WAIT: usize = 16;

/// Registration flags that keep a change the kernel's.
const EXACT_ONLY: u32 = (libc::EPOLLET | libc::EPOLLONESHOT | libc::EPOLLEXCLUSIVE) as u32;
const OUTPUT: u32 = libc::EPOLLOUT as u32;
const INPUT: u32 = libc::EPOLLIN as u32;

/// Per instance number: the generation it was created in, plus one (0: not one of ours).
static CREATED_IN: [AtomicU32; INSTANCES] = [const { AtomicU32::new(0) }; INSTANCES];
/// Per instance number: this process's threads inside a wait on it.
static WAITERS: [AtomicU32; INSTANCES] = [const { AtomicU32::new(0) }; INSTANCES];
/// Raised when an instance may be used under another number or by another process (a `dup`
/// of one, a `fork`): instances created before stop keeping output.
static GENERATION: AtomicU32 = AtomicU32::new(0);
/// The kept registrations: `epfd << 32 | (index + 1)`, 0 for a free entry.
static KEPT: [AtomicU64; CAPACITY] = [const { AtomicU64::new(0) }; CAPACITY];
/// Entries taken in [`KEPT`] (an upper bound; zero spares the waits any look).
static TAKEN: AtomicUsize = AtomicUsize::new(0);

fn slot(epfd: c_int) -> Option<usize> {
    usize::try_from(epfd).ok().filter(|&n| n < INSTANCES)
}

fn entry(epfd: c_int, index: u32) -> u64 {
    (u64::from(epfd as u32) << 32) | (u64::from(index) + 1)
}

fn parts(entry: u64) -> (c_int, u32) {
    (
        (entry >> 32) as u32 as c_int,
        (entry as u32).wrapping_sub(1),
    )
}

/// Epoll instance `epfd` was just created by this process.
pub fn instance_created(epfd: c_int) {
    if let Some(n) = slot(epfd) {
        CREATED_IN[n].store(GENERATION.load(Ordering::Acquire) + 1, Ordering::Release);
    }
}

/// Epoll instance number `epfd` is gone (closed, or now names something else).
pub fn instance_gone(epfd: c_int) {
    if let Some(n) = slot(epfd) {
        CREATED_IN[n].store(0, Ordering::Release);
    }
    for kept in &KEPT {
        let value = kept.load(Ordering::Acquire);
        if value != 0 && parts(value).0 == epfd {
            clear(kept, value);
        }
    }
}

/// An instance may be used under another number or by another process from now on (a `dup`
/// of one, a `fork`): every kept output becomes the kernel's, and the instances that exist
/// keep none from now on.
pub fn instances_shared() {
    GENERATION.fetch_add(1, Ordering::AcqRel);
    hand_all_to_kernel(|_| true);
}

/// Epoll instance `epfd` was registered in another: the outer instance watches its readiness,
/// which kept outputs are not part of. They become the kernel's.
pub fn instance_nested(epfd: c_int) {
    hand_all_to_kernel(|e| e == epfd);
}

fn eligible(epfd: c_int) -> bool {
    slot(epfd).is_some_and(|n| {
        CREATED_IN[n].load(Ordering::Acquire) == GENERATION.load(Ordering::Acquire) + 1
    }) && !table().lookup(epfd).is_nested_epoll()
}

/// Counts a thread inside a wait on `epfd` until dropped: a change made meanwhile by another
/// thread goes to the kernel, which would wake this one.
pub struct Waiting(Option<usize>);

/// A thread begins a wait on `epfd` (see [`Waiting`]). Before it looks at the kept outputs:
/// either it sees an output kept meanwhile, or the thread keeping it sees this wait.
pub fn begin_wait(epfd: c_int) -> Waiting {
    let n = slot(epfd);
    if let Some(n) = n {
        WAITERS[n].fetch_add(1, Ordering::SeqCst);
    }
    Waiting(n)
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(n) = self.0 {
            WAITERS[n].fetch_sub(1, Ordering::Release);
        }
    }
}

fn remember(epfd: c_int, index: u32) -> bool {
    let value = entry(epfd, index);
    if KEPT
        .iter()
        .any(|kept| kept.load(Ordering::Acquire) == value)
    {
        return true;
    }
    for kept in &KEPT {
        if kept
            .compare_exchange(0, value, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            TAKEN.fetch_add(1, Ordering::AcqRel);
            return true;
        }
    }
    false
}

fn forget(epfd: c_int, index: u32) {
    let value = entry(epfd, index);
    for kept in &KEPT {
        if kept.load(Ordering::Acquire) == value {
            clear(kept, value);
        }
    }
}

fn clear(kept: &AtomicU64, value: u64) {
    if kept
        .compare_exchange(value, 0, Ordering::AcqRel, Ordering::Relaxed)
        .is_ok()
    {
        TAKEN.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `record`'s registration in `epfd` while its output is kept (and the application has not
/// removed it): the stored events (the kernel's with our bits) and its data.
fn kept_registration(record: &SocketRecord, epfd: c_int) -> Option<(u32, u64)> {
    record
        .kernel_registrations()
        .find(|&(e, events, _)| {
            e == epfd && events & OUTPUT_KEPT_BY_US != 0 && events & REMOVED_BY_APPLICATION == 0
        })
        .map(|(_, events, data)| (events, data))
}

/// The stored events that keep `wanted` here while the kernel's registration is `kernel`
/// (plain level-triggered, no `EPOLLOUT`): `wanted` asks for output as well, or for output
/// in place of input. `None`: another change, the kernel's.
fn kept_form(kernel: u32, wanted: u32) -> Option<u32> {
    if kernel & (OUTPUT | EXACT_ONLY | REMOVED_BY_APPLICATION | KEPT_BY_US) != 0 {
        return None;
    }
    if wanted == kernel | OUTPUT {
        Some(kernel | OUTPUT_KEPT_BY_US)
    } else if kernel & INPUT != 0 && wanted == (kernel & !INPUT) | OUTPUT {
        Some(kernel | OUTPUT_KEPT_BY_US | INPUT_DROPPED_BY_US)
    } else {
        None
    }
}

/// Keeps the application's change of SAN socket `index`'s registration in `epfd` (whose
/// kernel registration is `kernel` with `data`, the slot locked, `socket`) to `wanted` here,
/// if it can be (see the module documentation); true if it did (no kernel call: the caller
/// answers 0). Stores the kept form over whatever the record held for `epfd`.
pub fn keep(
    epfd: c_int,
    index: u32,
    socket: &SanSocket,
    record: &SocketRecord,
    (kernel, data): (u32, u64),
    wanted: libc::epoll_event,
) -> bool {
    let (wanted_events, wanted_data) = (wanted.events, wanted.u64);
    let Some(stored) = kept_form(kernel, wanted_events) else {
        return false;
    };
    if wanted_data != data || !eligible(epfd) || !socket.plainly_writable() {
        return false;
    }
    if !remember(epfd, index) {
        return false;
    }
    record.register_epoll(epfd, stored, data);
    // Pairs with `begin_wait`: a thread of ours that began a wait on this instance before
    // the mark was set may be asleep in the kernel, which would wake it for this change.
    fence(Ordering::SeqCst);
    if slot(epfd).is_some_and(|n| WAITERS[n].load(Ordering::SeqCst) != 0) {
        record.register_epoll(epfd, kernel, data);
        forget(epfd, index);
        return false;
    }
    true
}

/// An `EPOLL_CTL_MOD` of SAN socket `index` (its slot locked, `socket`), watched through its
/// mirror in `epfd`, whose registration there stores `current` with `data`, to `wanted`.
/// True: done here, no kernel call; false: the kernel's (anything kept for the registration
/// is forgotten, the caller records the application's events).
pub fn modify(
    epfd: c_int,
    index: u32,
    socket: &SanSocket,
    record: &SocketRecord,
    (current, data): (u32, u64),
    wanted: libc::epoll_event,
) -> bool {
    let (wanted_events, wanted_data) = (wanted.events, wanted.u64);
    if current & KEPT_BY_US == 0 {
        return keep(epfd, index, socket, record, (current, data), wanted);
    }
    let kernel = current & !KEPT_BY_US;
    let application = application_events(current);
    if wanted_data == data && wanted_events == application {
        return true;
    }
    forget(epfd, index);
    if wanted_data == data && wanted_events == kernel {
        // What the kernel holds: nothing kept any more.
        record.register_epoll(epfd, kernel, data);
        return true;
    }
    if keep(epfd, index, socket, record, (kernel, data), wanted) {
        return true;
    }
    // The kernel takes the change; it must hold what the application has first, so that a
    // change the kernel refuses (`EINVAL`) leaves the application's registration as it was.
    set_in_kernel(record, socket, epfd, application, data);
    false
}

/// A kept output found writable by a wait (see [`ready_outputs`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadyOutput {
    /// The registration's data.
    pub data: u64,
    /// The application asked for output alone: the kernel's `EPOLLIN` for it is dropped.
    pub drop_input: bool,
}

/// A wait on `epfd` begins (after [`begin_wait`]): the registrations whose kept output is
/// writable now go to `ready` (as many as fit); the others' outputs become the kernel's (not
/// plainly writable, or no room to report them). Returns how many are ready.
pub fn ready_outputs(epfd: c_int, ready: &mut [ReadyOutput]) -> usize {
    if TAKEN.load(Ordering::Acquire) == 0 {
        return 0;
    }
    let mut found = 0;
    for kept in &KEPT {
        let value = kept.load(Ordering::Acquire);
        if value == 0 || parts(value).0 != epfd {
            continue;
        }
        let index = parts(value).1;
        let record = registry().get(index).filter(|record| {
            !orphaned(index)
                && record.flags() & flags::SAN != 0
                && kept_registration(record, epfd).is_some()
        });
        let Some(record) = record else {
            clear(kept, value);
            continue;
        };
        let mut guard = lock(index);
        let Some(SanObject::Socket(socket)) = guard.as_mut() else {
            clear(kept, value);
            continue;
        };
        let Some((stored, data)) = kept_registration(record, epfd) else {
            clear(kept, value);
            continue;
        };
        if found < ready.len() && socket.plainly_writable() {
            ready[found] = ReadyOutput {
                data,
                drop_input: stored & INPUT_DROPPED_BY_US != 0,
            };
            found += 1;
        } else {
            hand_to_kernel(record, socket, epfd);
            clear(kept, value);
        }
    }
    found
}

/// Reports the kept outputs found writable (`ready`, from [`ready_outputs`]) in a wait's
/// events: `events[..kept]` are the kernel's (corrected), the slice's length is the
/// caller's `maxevents`. An output joins the kernel's event of the same registration (whose
/// `EPOLLIN` goes when the application asked for output alone), or follows as an event of
/// its own. Returns the new count.
pub fn merge(events: &mut [libc::epoll_event], kept: usize, ready: &[ReadyOutput]) -> usize {
    let mut total = kept;
    for output in ready {
        if let Some(event) = events[..kept]
            .iter_mut()
            .find(|event| event.u64 == output.data)
        {
            if output.drop_input {
                event.events &= !INPUT;
            }
            event.events |= OUTPUT;
        } else if total < events.len() {
            events[total] = libc::epoll_event {
                events: OUTPUT,
                u64: output.data,
            };
            total += 1;
        }
    }
    total
}

/// The kept output of `record`'s registration in `epfd` becomes the kernel's (its slot
/// locked, `socket`): the kernel's registration is changed to the application's events.
fn hand_to_kernel(record: &SocketRecord, socket: &SanSocket, epfd: c_int) {
    if let Some((stored, data)) = kept_registration(record, epfd) {
        set_in_kernel(record, socket, epfd, application_events(stored), data);
    }
}

/// The kernel's registration of `socket`'s mirror in `epfd` becomes `events` with `data`, and
/// the record says so.
fn set_in_kernel(record: &SocketRecord, socket: &SanSocket, epfd: c_int, events: u32, data: u64) {
    let mut event = libc::epoll_event { events, u64: data };
    if let Some(mirror) = socket.mirror_fd() {
        // SAFETY: the application's instance, our mirror, a live event. (An instance closed
        // meanwhile answers EBADF: nothing is left to change.)
        unsafe { real::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, mirror, &mut event) };
    }
    record.register_epoll(epfd, events, data);
}

/// Every kept output of an instance `which` accepts becomes the kernel's.
fn hand_all_to_kernel(which: impl Fn(c_int) -> bool) {
    if TAKEN.load(Ordering::Acquire) == 0 {
        return;
    }
    for kept in &KEPT {
        let value = kept.load(Ordering::Acquire);
        if value == 0 || !which(parts(value).0) {
            continue;
        }
        let (epfd, index) = parts(value);
        if !orphaned(index) {
            if let Some(record) = registry().get(index) {
                if let Some(SanObject::Socket(socket)) = lock(index).as_ref() {
                    hand_to_kernel(record, socket, epfd);
                }
            }
        }
        clear(kept, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_pack_the_instance_and_the_index() {
        for (epfd, index) in [(0, 0), (3, 7), (1023, u32::MAX - 1), (c_int::MAX, 12)] {
            let value = entry(epfd, index);
            assert_ne!(value, 0, "an entry is never the free value");
            assert_eq!(parts(value), (epfd, index));
        }
    }

    #[test]
    fn outputs_join_the_kernels_event_or_follow_it() {
        let event = |events: u32, data: u64| libc::epoll_event { events, u64: data };
        let ready = |data: u64, drop_input: bool| ReadyOutput { data, drop_input };
        let mut events = [event(INPUT, 5), event(INPUT, 6), event(0, 0), event(0, 0)];
        let total = merge(
            &mut events,
            2,
            &[
                ready(5, false),
                ready(6, true),
                ready(9, false),
                ready(11, false),
            ],
        );
        assert_eq!(total, 4, "two joined the kernel's events, two added");
        assert_eq!({ events[0].events }, INPUT | OUTPUT);
        assert_eq!(
            { events[1].events },
            OUTPUT,
            "input not asked for is dropped"
        );
        assert_eq!(({ events[2].events }, { events[2].u64 }), (OUTPUT, 9));
        assert_eq!(({ events[3].events }, { events[3].u64 }), (OUTPUT, 11));
        let mut full = [event(INPUT, 1)];
        assert_eq!(
            merge(&mut full, 1, &[ready(2, false)]),
            1,
            "no room: a later wait"
        );
    }

    #[test]
    fn only_output_added_or_put_in_place_of_input_is_kept() {
        let rdhup = libc::EPOLLRDHUP as u32;
        assert_eq!(
            kept_form(INPUT, INPUT | OUTPUT),
            Some(INPUT | OUTPUT_KEPT_BY_US)
        );
        assert_eq!(
            kept_form(INPUT | rdhup, OUTPUT | rdhup),
            Some(INPUT | rdhup | OUTPUT_KEPT_BY_US | INPUT_DROPPED_BY_US)
        );
        for stored in [
            kept_form(INPUT | rdhup, INPUT | rdhup | OUTPUT),
            kept_form(INPUT, OUTPUT),
        ] {
            let stored = stored.expect("kept");
            assert_eq!(
                application_events(stored) & (INPUT | OUTPUT),
                if stored & INPUT_DROPPED_BY_US != 0 {
                    OUTPUT
                } else {
                    INPUT | OUTPUT
                }
            );
        }
        assert_eq!(
            kept_form(INPUT, INPUT | OUTPUT | rdhup),
            None,
            "another bit changed"
        );
        assert_eq!(
            kept_form(INPUT | OUTPUT, INPUT | OUTPUT),
            None,
            "the kernel's"
        );
        assert_eq!(kept_form(0, OUTPUT), Some(OUTPUT_KEPT_BY_US));
        let edge = libc::EPOLLET as u32;
        assert_eq!(
            kept_form(INPUT | edge, INPUT | OUTPUT | edge),
            None,
            "edge-triggered"
        );
        assert_eq!(
            kept_form(INPUT | REMOVED_BY_APPLICATION, INPUT | OUTPUT),
            None
        );
    }
}
