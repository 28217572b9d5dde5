//! The table of SAN objects: one slot per socket record index, each behind its own mutex
//! (see "Locking" in `san`), the count of live objects, the process-wide counters, and the
//! names that pair the two ends of an in-process connection.

use core::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::socket::SanSocket;
use super::stashed::Stashed;
use super::unclaimed::Unclaimed;
use crate::discovery::ListenerMarker;
use crate::fdtable::FdEntry;
use crate::record::{flags, Bypass, SocketRecord};
use crate::registry::registry;

/// What the slot of a socket record holds.
#[derive(Debug)]
pub(crate) enum SanObject {
    /// A listening socket's published marker.
    Marker(ListenerMarker),
    /// A connected socket on (or about to switch to) the SAN.
    Socket(Box<SanSocket>),
    /// A downgraded socket whose stash still holds bytes received over the SAN.
    Stashed(Box<Stashed>),
    /// An accepted connection from a SAN client that no call has used yet: it attaches in
    /// the process that uses it first (see `super::accept`).
    Unclaimed(Box<Unclaimed>),
}

pub(super) type ObjectSlot = Mutex<Option<SanObject>>;

const SLOTS_PER_CHUNK: usize = 1024;
const CHUNKS: usize = crate::registry::MAX_CHUNKS;

/// ObjectSlot chunks, allocated on first use and never freed (record indices are reused, so the
/// number of slots is bounded by the most sockets ever open at once).
static SLOT_CHUNKS: [AtomicPtr<ObjectSlot>; CHUNKS] =
    [const { AtomicPtr::new(core::ptr::null_mut()) }; CHUNKS];

/// Sockets with a SAN object (pending or switched): while zero, poll/select pay nothing.
pub(super) static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Counters of the SAN path (process-wide, for diagnostics and tests).
#[derive(Debug, Default)]
pub struct SanCounters {
    /// Connections that switched to the SAN (both sides count).
    pub switched: AtomicU64,
    /// Client connections that stayed on TCP because the server is plain (probe or cache).
    pub peer_plain: AtomicU64,
    /// Of those, answered by the negative cache without a probe.
    pub plain_cached: AtomicU64,
    /// Set-ups or switches that failed on a resource and fell back to TCP.
    pub fallbacks: AtomicU64,
    /// Connections moved back to kernel TCP live (fork, exec, or the peer's).
    pub downgraded: AtomicU64,
}

pub(super) static COUNTERS: SanCounters = SanCounters {
    switched: AtomicU64::new(0),
    peer_plain: AtomicU64::new(0),
    plain_cached: AtomicU64::new(0),
    fallbacks: AtomicU64::new(0),
    downgraded: AtomicU64::new(0),
};

/// The process-wide counters.
pub fn counters() -> &'static SanCounters {
    &COUNTERS
}

/// The slot of record index `index` (its chunk allocated on first use).
pub(super) fn slot(index: u32) -> &'static ObjectSlot {
    let chunk_index = (index as usize / SLOTS_PER_CHUNK).min(CHUNKS - 1);
    let chunk = &SLOT_CHUNKS[chunk_index];
    let mut base = chunk.load(Ordering::Acquire);
    if base.is_null() {
        let fresh: Box<[ObjectSlot]> = (0..SLOTS_PER_CHUNK).map(|_| Mutex::new(None)).collect();
        let fresh = Box::into_raw(fresh).cast::<ObjectSlot>();
        match chunk.compare_exchange(
            core::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => base = fresh,
            Err(winner) => {
                // SAFETY: `fresh` came from Box::into_raw of a slice of this length just
                // above and was never published.
                drop(unsafe {
                    Box::from_raw(core::ptr::slice_from_raw_parts_mut(fresh, SLOTS_PER_CHUNK))
                });
                base = winner;
            }
        }
    }
    // SAFETY: `base` points to SLOTS_PER_CHUNK slots that are never freed; the offset is
    // reduced modulo the chunk size.
    unsafe { &*base.add(index as usize % SLOTS_PER_CHUNK) }
}

/// Locks the slot of record index `index` (a poisoned lock is taken over: the object
/// stays usable).
pub(super) fn lock(index: u32) -> MutexGuard<'static, Option<SanObject>> {
    slot(index)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The SAN slot index of `entry` when its socket has a SAN object (the data-path check:
/// one flag load for tracked sockets).
#[inline]
pub fn san_index(entry: FdEntry) -> Option<u32> {
    let index = entry.socket_index()?;
    let record = registry().get(index)?;
    (record.flags() & flags::SAN != 0).then_some(index)
}

/// Sockets by segment name, for connections whose two ends are both in this process.
static BY_NAME: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());

/// The name list's lock (also held across `fork()`, see `super::with_library_locks`).
pub(super) fn by_name() -> MutexGuard<'static, Vec<(String, u32)>> {
    BY_NAME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The other socket of an in-process connection named `name`.
pub(super) fn in_process_peer(name: &crate::discovery::SegmentName, index: u32) -> Option<u32> {
    by_name()
        .iter()
        .find(|(n, i)| *i != index && n == name.as_str())
        .map(|&(_, i)| i)
}

/// How many entries of [`BY_NAME`] share their name with another (sockets whose peer is in
/// this process). Kept exact under the `BY_NAME` lock so that waits in processes without
/// in-process connections (every real application) skip the name list entirely.
static PAIRED: AtomicUsize = AtomicUsize::new(0);

/// Sockets whose peer is in this process (both ends listed by name), or `None` when there
/// are none (the common case: one atomic load, no lock, no allocation).
pub(super) fn in_process_indices() -> Option<Vec<u32>> {
    if PAIRED.load(Ordering::Acquire) == 0 {
        return None;
    }
    let names = by_name();
    let paired: Vec<u32> = names
        .iter()
        .filter(|(name, index)| names.iter().any(|(n, i)| i != index && n == name))
        .map(|&(_, index)| index)
        .collect();
    (!paired.is_empty()).then_some(paired)
}

/// How many entries become paired when one joins the entries named `name` (or
/// unpaired when one leaves them): a first partner pairs both.
fn pairing_change(names: &[(String, u32)], name: &str) -> usize {
    match names.iter().filter(|(n, _)| n == name).count() {
        0 => 0,
        1 => 2,
        _ => 1,
    }
}

/// Removes socket `index` from the name list, keeping [`PAIRED`] exact.
fn remove_name(names: &mut Vec<(String, u32)>, index: u32) {
    let Some(position) = names.iter().position(|&(_, i)| i == index) else {
        return;
    };
    let (name, _) = names.swap_remove(position);
    PAIRED.fetch_sub(pairing_change(names, &name), Ordering::AcqRel);
}

/// Forgets the name of socket `index` (its SAN object is gone).
pub(super) fn forget_name(index: u32) {
    remove_name(&mut by_name(), index);
}

/// Puts `socket` into the slot of record index `index` (listed by its name, counted live,
/// the record flagged SAN).
pub(super) fn insert(index: u32, record: &'static SocketRecord, socket: SanSocket) {
    list_name(index, &socket);
    *lock(index) = Some(SanObject::Socket(Box::new(socket)));
    record.set_flag(flags::SAN, true);
    LIVE.fetch_add(1, Ordering::Relaxed);
}

/// Puts `socket` into `slot`, the held slot of record index `index`, in place of the
/// unclaimed accepted connection it was (already counted live; see `super::accept`).
pub(super) fn insert_claimed(
    slot: &mut Option<SanObject>,
    index: u32,
    record: &'static SocketRecord,
    socket: SanSocket,
) {
    list_name(index, &socket);
    *slot = Some(SanObject::Socket(Box::new(socket)));
    record.set_flag(flags::SAN, true);
    record.set_flag(flags::UNCLAIMED, false);
}

fn list_name(index: u32, socket: &SanSocket) {
    let mut names = by_name();
    remove_name(&mut names, index);
    let name = socket.name.as_str();
    let paired = pairing_change(&names, name);
    names.push((name.to_owned(), index));
    PAIRED.fetch_add(paired, Ordering::AcqRel);
}

/// The socket's record is gone, or it is a fork child's copy (see `after_fork_in_child`):
/// its SAN object is not to be touched.
pub(super) fn orphaned(index: u32) -> bool {
    registry()
        .get(index)
        .is_none_or(|record| record.bypass() == Bypass::AfterFork)
}

/// Which claim of record `index` a call starts on (see [`still_claimed`]).
pub(super) fn claim_of(index: u32) -> u32 {
    registry()
        .get(index)
        .map_or(u32::MAX, |record| record.generation.load(Ordering::Acquire))
}

/// Whether record `index` still holds the socket a call started on (`claim` from
/// [`claim_of`]). Another thread may close the socket while this one sleeps in a call, and
/// the number and the record may go to a new socket or file at once: the kernel keeps such a
/// call on the old socket, and this one must not go on with, or fall back to a real call on,
/// whatever holds the number now.
pub(super) fn still_claimed(index: u32, claim: u32) -> bool {
    registry().get(index).is_some_and(|record| {
        record.generation.load(Ordering::Acquire) == claim
            && record.state() != crate::record::SocketState::Free
    })
}

/// Number of sockets currently with a SAN object.
pub fn live_sockets() -> usize {
    #[cfg(test)]
    if crate::guard::seam::pretending_live() {
        return LIVE.load(Ordering::Relaxed).max(1);
    }
    LIVE.load(Ordering::Relaxed)
}

/// Whether the record of socket `index` has `flag` set.
pub(super) fn record_flag(index: u32, flag: u32) -> bool {
    registry()
        .get(index)
        .is_some_and(|record| record.flags() & flag != 0)
}
