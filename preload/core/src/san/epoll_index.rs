//! Which SAN socket an epoll event names: (epoll instance, event data) → registry index,
//! kept as sockets join the SAN path and as the application adds, changes and removes their
//! registrations. Correcting the events of a wait then costs one lookup per event, not a
//! pass over every socket of the process (which made a server's wait cost grow with its
//! connection count).
//!
//! An entry is a hint: the caller checks the socket's record still holds the registration.
//! The lock is a leaf (nothing else is locked while it is held) and is held across `fork`
//! (`san::with_library_locks`).

use core::ffi::c_int;
use std::sync::{Mutex, MutexGuard, PoisonError};

use rustc_hash::FxHashMap;

use crate::record::{SocketRecord, EPOLL_SLOTS};

/// The (epoll instance, event data) keys of one socket's registrations.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
struct Keys {
    keys: [(c_int, u64); EPOLL_SLOTS],
    len: usize,
}

impl Keys {
    fn of(record: &SocketRecord) -> Keys {
        let mut keys = Keys::default();
        // (Those the application removed too: a wait must find them to drop their events.)
        for (epfd, _, data) in record.kernel_registrations().take(EPOLL_SLOTS) {
            keys.keys[keys.len] = (epfd, data);
            keys.len += 1;
        }
        keys
    }

    fn as_slice(&self) -> &[(c_int, u64)] {
        &self.keys[..self.len]
    }
}

/// The index proper. (Hashed with FxHash: the keys are the application's own epoll data, and
/// an `epoll_ctl` that only changes a registration's events, which event loops make twice a
/// request, finds the keys unchanged and writes nothing.)
#[derive(Default)]
pub(super) struct Index {
    by_registration: FxHashMap<(c_int, u64), u32>,
    registrations_of: FxHashMap<u32, Keys>,
}

static INDEX: Mutex<Option<Index>> = Mutex::new(None);

fn locked() -> MutexGuard<'static, Option<Index>> {
    INDEX.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Holds the lock (for `fork`: no other thread is then inside it).
pub(super) fn hold() -> MutexGuard<'static, Option<Index>> {
    locked()
}

/// Socket `index` (on the SAN path) is registered as `record` says now.
pub(super) fn update(index: u32, record: &SocketRecord) {
    let now = Keys::of(record);
    let mut guard = locked();
    let map = guard.get_or_insert_with(Index::default);
    if map.registrations_of.get(&index) == Some(&now) {
        return;
    }
    map.remove(index);
    for &key in now.as_slice() {
        map.by_registration.insert(key, index);
    }
    if now.len > 0 {
        map.registrations_of.insert(index, now);
    }
}

/// Socket `index` left the SAN path.
pub(super) fn forget(index: u32) {
    if let Some(map) = locked().as_mut() {
        map.remove(index);
    }
}

/// The SAN socket registered in `epfd` with `data`, if one is known.
pub(super) fn lookup(epfd: c_int, data: u64) -> Option<u32> {
    locked()
        .as_ref()?
        .by_registration
        .get(&(epfd, data))
        .copied()
}

impl Index {
    fn remove(&mut self, index: u32) {
        if let Some(keys) = self.registrations_of.remove(&index) {
            for key in keys.as_slice() {
                if self.by_registration.get(key) == Some(&index) {
                    self.by_registration.remove(key);
                }
            }
        }
    }
}
