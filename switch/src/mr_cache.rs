//! # The registration cache
//!
//! Registering memory with a SAN device (pinning the pages and handing them to the NIC) costs
//! tens of microseconds; copying a small buffer costs nanoseconds. Rendezvous transfers
//! therefore go through this cache, keyed by virtual address, as Windows Sockets Direct
//! prescribes ("caching registered memory"):
//!
//! * **Local-access buffers** stay registered after [`MrCache::release`]; a later
//!   [`MrCache::get`] for a range an idle entry *contains*, with at most the entry's rights,
//!   is a *hit* and costs no domain call.
//! * **Remote-access buffers** stay registered too, but the moment the last reference that
//!   asked for remote access goes away the cache calls [`SanDomain::revoke_remote`], so the
//!   peer's descriptor dies with the rendezvous. A later remote hit, which needs an entry of
//!   exactly the range asked (the peer's key reaches the whole registration, and the memory
//!   around a buffer is none of the peer's business), calls [`SanDomain::expose_remote`],
//!   which yields a *new* rkey: a stale descriptor never works again.
//! * **Invalidation** ([`MrCache::invalidate`], the analogue of
//!   `WSPMemoryRegistrationCacheCallback`) drops and deregisters every entry overlapping the
//!   range, referenced or not, and hands back the references that were still held so the
//!   driver can tell their sessions. An entry is never handed out after an overlapping range
//!   was invalidated.
//!
//! ## References, handles and owners
//! Every successful `get` creates one *reference* and returns an [`MrHandle`] naming it (slot
//! index + generation). Handles are per reference, not per entry: releasing a handle twice,
//! or releasing a handle whose entry was invalidated, is detected (the generation no longer
//! matches) and is a counted no-op. A slot whose generation would wrap is retired for good,
//! so a handle is never aliased to a later reference.
//!
//! Every reference is tagged with an [`OwnerId`] (a connection). [`MrCache::release_owner`]
//! drops exactly that owner's references, as if each were released: remote exposure held
//! only through them is revoked, and **nothing is deregistered** because of it. Rationale:
//! registrations belong to the process-wide protection domain, not to a connection; once the
//! rkey is revoked the closing peer cannot reach the memory, and the pinned pages stay useful
//! for the other connections of the process (idle entries are bounded by LRU eviction and
//! dropped by invalidation as usual).
//!
//! ## Remote exposure is per owner
//! An entry is exposed to at most one owner at a time ([`EntryInfo::exposed_to`]). A remote
//! `get` shares an exposed entry only with references of the same owner, and only if the
//! exposed rights cover the request (widening would need a new rkey while the old one is in
//! a peer's hands). Otherwise the lookup continues and, failing that, registers a second,
//! overlapping entry. This way a revocation never depends on a *different* connection
//! finishing its transfer, and one peer never learns an rkey that another peer's rendezvous
//! keeps alive. Exposure grants exactly the remote rights asked for, not the entry's.
//!
//! ## Lookup and its cost
//! Entries live in a slab; `by_start: BTreeSet<(start, entry index)>` orders them by start
//! address (overlapping entries of different rights or owners may share a start). An entry
//! of length at most `max_len` (the longest live entry, kept exact through a multiset of
//! lengths) can contain `[addr, end)` only if its start lies in `[end - max_len, addr]`, so
//! the lookup walks that window backwards from `addr` and takes the first usable entry: a
//! hit on the buffer's own start is found at the first step, O(log n). Before the walk, the
//! entry the previous `get` handed out is tried (O(1)): transfers tend to reuse one buffer
//! back to back. Any usable entry is a correct answer, so the shortcut changes cost only.
//! Worst case the window
//! holds every entry (one huge registration far below many small ones) and the walk is
//! O(n), with n bounded by [`CacheConfig::max_entries`] (plus documented overshoot).
//! Invalidation walks the window `[addr - max_len, end)`, same bounds.
//!
//! ## Bounds
//! [`CacheConfig`] bounds the number of entries and the registered bytes. After inserting a
//! registration, and whenever an entry becomes idle, least-recently-released *idle* entries
//! are evicted (deregistered) until the cache is within bounds. Referenced entries are never
//! evicted: when everything is referenced and a new registration exceeds the bounds it still
//! **succeeds** (counted in [`CacheStats::overshoots`]), and the cache shrinks back as
//! references are released. Failing instead would turn a soft cache limit into a hard send
//! failure (ENOBUFS) while the memory in question is needed by in-flight transfers anyway;
//! the hard limit is the domain's own (`RLIMIT_MEMLOCK`), and when the domain reports
//! [`RegisterError::OutOfResources`] the cache evicts every idle entry and retries once.
//! So between calls: over a bound ⇒ no idle entry is left.
//!
//! ## Domain failures
//! A failed `expose_remote` on a hit makes the entry *doomed* (never handed out again,
//! deregistered once idle) and the `get` proceeds as a miss. A failed `revoke_remote` dooms
//! the entry too, so that deregistration (which kills every rkey) follows as soon as the last
//! reference goes. A failed `deregister` is counted ([`CacheStats::domain_errors`]) and the
//! entry is forgotten anyway: the cache cannot do better than the domain.
//!
//! Not done (optional in the spec): merging adjacent or overlapping ranges into one larger
//! registration. An idle entry fully covered by a new registration with at least its rights
//! is dropped at once (it could never be preferred again); that is all the merging there is.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;
use core::fmt;

use san_api::{Access, LocalKey, MemRange, RegisterError, Registration, RemoteKey, SanDomain};

#[doc(hidden)]
pub mod fuzzing;
#[cfg(test)]
mod tests;

/// The "no index" marker of the intrusive lists (slab indices never reach it: see
/// [`MrCache::get`]'s capacity check).
const NIL: u32 = u32::MAX;

/// Bounds of the cache. Both hold between calls unless every entry is referenced (see the
/// module docs on overshoot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheConfig {
    /// Most registrations kept, referenced ones included.
    pub max_entries: usize,
    /// Most bytes kept registered, referenced ones included.
    pub max_bytes: u64,
}

impl Default for CacheConfig {
    /// 1024 registrations, 256 MiB.
    fn default() -> Self {
        Self {
            max_entries: 1024,
            max_bytes: 256 << 20,
        }
    }
}

/// Who holds a reference: the switch uses its connection id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OwnerId(pub u64);

/// Names one reference taken by [`MrCache::get`]. Stale handles (released, invalidated,
/// dropped by [`MrCache::release_owner`]) are recognised and never alias a later reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MrHandle {
    slot: u32,
    generation: u32,
}

/// Counters, cumulative since [`MrCache::new`] except the last two (current values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct CacheStats {
    /// Calls to [`MrCache::get`] (`= hits + misses`).
    pub gets: u64,
    /// Gets served by a cached registration.
    pub hits: u64,
    /// Gets that needed a new registration (including failed and rejected ones).
    pub misses: u64,
    /// Calls to [`MrCache::invalidate`].
    pub invalidation_calls: u64,
    /// Entries dropped by invalidation.
    pub invalidated_entries: u64,
    /// References that were still held on invalidated entries (handed back to the caller).
    pub invalidated_references: u64,
    /// Successful [`SanDomain::register`] calls.
    pub registrations: u64,
    /// Gets that failed: the domain refused the registration, or the range was empty or
    /// wrapped the address space.
    pub registration_failures: u64,
    /// Successful [`SanDomain::deregister`] calls.
    pub deregistrations: u64,
    /// Successful [`SanDomain::revoke_remote`] calls.
    pub revocations: u64,
    /// Successful [`SanDomain::expose_remote`] calls (a remote hit on a revoked entry).
    pub re_exposures: u64,
    /// Idle entries deregistered to respect the bounds or to free resources for a retry.
    pub evictions: u64,
    /// Idle entries deregistered because a new registration covers them with at least
    /// their rights.
    pub subsumed: u64,
    /// Registrations kept beyond a bound because every entry was referenced.
    pub overshoots: u64,
    /// References dropped by [`MrCache::release`] or [`MrCache::release_owner`].
    pub releases: u64,
    /// [`MrCache::release`] calls with a stale handle (no-ops).
    pub stale_releases: u64,
    /// Calls to [`MrCache::release_owner`].
    pub owner_releases: u64,
    /// Domain calls that failed where the cache had to carry on (deregister, revoke,
    /// expose on a hit).
    pub domain_errors: u64,
    /// Bytes registered now.
    pub bytes_registered: u64,
    /// Entries cached now.
    pub entries: usize,
}

/// A snapshot of one cached registration, for diagnostics and the model checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct EntryInfo {
    /// The registration (`rkey` present exactly while exposed to a peer).
    pub registration: Registration,
    /// References held.
    pub refs: u32,
    /// References that asked for remote access.
    pub remote_refs: u32,
    /// The owner whose peer may reach the entry now.
    pub exposed_to: Option<OwnerId>,
    /// False once the entry is doomed (a domain call failed): never handed out again.
    pub reusable: bool,
}

/// A broken internal invariant, reported by [`MrCache::check_invariants`]. Always a bug in
/// the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct InvariantViolation {
    /// The rule that does not hold.
    pub rule: &'static str,
    /// The entry slab index concerned, when there is one.
    pub entry: Option<u32>,
}

impl fmt::Display for InvariantViolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.entry {
            Some(index) => write!(
                f,
                "registration cache invariant broken at entry {index}: {}",
                self.rule
            ),
            None => write!(f, "registration cache invariant broken: {}", self.rule),
        }
    }
}

impl core::error::Error for InvariantViolation {}

/// Who may reach an entry from the wire, and with which key.
#[derive(Clone, Copy, Debug)]
struct Exposure {
    rkey: RemoteKey,
    /// The remote rights granted (a subset of the entry's).
    access: Access,
    owner: OwnerId,
}

/// A cached registration. Vacant slab slots keep stale data with `live == false`.
#[derive(Clone, Debug)]
struct Entry {
    range: MemRange,
    access: Access,
    lkey: LocalKey,
    exposure: Option<Exposure>,
    refs: u32,
    remote_refs: u32,
    /// Head of the doubly linked list of this entry's references (through `RefSlot`).
    first_ref: u32,
    lru_prev: u32,
    lru_next: u32,
    in_lru: bool,
    doomed: bool,
    live: bool,
}

/// One reference. `generation` changes every time the slot is freed.
#[derive(Clone, Debug)]
struct RefSlot {
    generation: u32,
    live: bool,
    entry: u32,
    owner: OwnerId,
    remote: bool,
    prev: u32,
    next: u32,
}

/// The registration cache. Sans-IO: every call that may touch the domain takes it as an
/// argument. See the module docs for the rules it follows.
#[derive(Debug)]
pub struct MrCache {
    config: CacheConfig,
    entries: Vec<Entry>,
    free_entries: Vec<u32>,
    slots: Vec<RefSlot>,
    free_slots: Vec<u32>,
    by_start: BTreeSet<(u64, u32)>,
    /// Multiset of live entry lengths; its largest key is `max_len`.
    lengths: BTreeMap<u64, u32>,
    max_len: u64,
    live_entries: usize,
    bytes: u64,
    /// Least recently released idle entry (evicted first).
    lru_head: u32,
    lru_tail: u32,
    /// The entry the last successful `get` handed out (NIL if none or since removed): checked
    /// before the tree walk.
    last_used: u32,
    /// Reused buffer of entry indices for invalidation and subsumption.
    scratch: Vec<u32>,
    stats: CacheStats,
}

/// The remote part of a set of rights.
fn remote_part(access: Access) -> Access {
    Access::from_bits_truncate(access.bits() & (Access::REMOTE_READ | Access::REMOTE_WRITE).bits())
}

impl MrCache {
    /// An empty cache with the given bounds.
    pub fn new(config: CacheConfig) -> Self {
        Self {
            config,
            entries: Vec::new(),
            free_entries: Vec::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_start: BTreeSet::new(),
            lengths: BTreeMap::new(),
            max_len: 0,
            live_entries: 0,
            bytes: 0,
            lru_head: NIL,
            lru_tail: NIL,
            last_used: NIL,
            scratch: Vec::new(),
            stats: CacheStats::default(),
        }
    }

    /// The bounds this cache was built with.
    pub fn config(&self) -> CacheConfig {
        self.config
    }

    /// A reference to a registration containing `range` with at least `access`: a cached one
    /// if possible (re-exposed to the peer if remote rights are asked and it was revoked),
    /// else a new one. The returned registration carries an `rkey` exactly when `access`
    /// has remote rights.
    ///
    /// # Errors
    /// [`RegisterError::BadAddress`] for an empty range or one wrapping the address space
    /// (the domain is not called), [`RegisterError::OutOfResources`] if the reference table
    /// is full, or whatever the domain's `register` (or `expose_remote` for a new
    /// registration the provider did not expose) returned. A failure leaves no entry behind.
    pub fn get<D: SanDomain>(
        &mut self,
        domain: &mut D,
        owner: OwnerId,
        range: MemRange,
        access: Access,
    ) -> Result<(MrHandle, Registration), RegisterError> {
        self.stats.gets += 1;
        if range.len == 0 || range.addr.checked_add(range.len).is_none() {
            self.stats.misses += 1;
            self.stats.registration_failures += 1;
            return Err(RegisterError::BadAddress);
        }
        // Slab indices must stay below NIL; 4 billion live references or entries means the
        // caller leaks handles, and the answer is the same as the domain's would be.
        if self.free_slots.is_empty() && self.slots.len() >= NIL as usize
            || self.free_entries.is_empty() && self.entries.len() >= NIL as usize
        {
            self.stats.misses += 1;
            self.stats.registration_failures += 1;
            return Err(RegisterError::OutOfResources);
        }
        let remote_access = remote_part(access);
        let remote = access.is_remote();

        if let Some(index) = self.find_usable(range, access, owner) {
            if self.expose_if_needed(domain, index, owner, remote_access) {
                self.stats.hits += 1;
                self.last_used = index;
                let handle = self.attach_ref(index, owner, remote);
                return Ok((handle, self.registration_of(index, remote)));
            }
            // The entry is doomed now; fall through to a fresh registration.
        }
        self.stats.misses += 1;
        self.register_new(domain, owner, range, access)
    }

    /// Drops the reference `handle` names. A stale handle (already released, invalidated,
    /// dropped by [`release_owner`](Self::release_owner)) is a counted no-op.
    pub fn release<D: SanDomain>(&mut self, domain: &mut D, handle: MrHandle) {
        match self.live_slot(handle) {
            Some(slot) => {
                self.stats.releases += 1;
                self.detach_ref(domain, slot);
            }
            None => self.stats.stale_releases += 1,
        }
    }

    /// Drops and deregisters every entry overlapping `range` (the virtual-to-physical mapping
    /// changes or changed). Returns the references that were still held on them, with their
    /// owners: their handles are stale from now on, and their sessions must never post an
    /// operation with those registrations again.
    ///
    /// Then tells the domain ([`SanDomain::memory_invalidated`], exactly once per call, also
    /// when nothing overlapped) so a provider can drop VA-keyed state of its own.
    pub fn invalidate<D: SanDomain>(
        &mut self,
        domain: &mut D,
        range: MemRange,
    ) -> Vec<(MrHandle, OwnerId)> {
        let affected = self.drop_overlapping(domain, range);
        domain.memory_invalidated(range);
        affected
    }

    /// The body of [`invalidate`](Self::invalidate) before the provider callback.
    fn drop_overlapping<D: SanDomain>(
        &mut self,
        domain: &mut D,
        range: MemRange,
    ) -> Vec<(MrHandle, OwnerId)> {
        self.stats.invalidation_calls += 1;
        let mut affected = Vec::new();
        if range.len == 0 || self.live_entries == 0 {
            return affected;
        }
        // An overlapping entry starts before `range.end()` and ends after `range.addr`, so
        // (being at most `max_len` long) it starts at or after `range.addr - max_len`.
        let lowest_start = range.addr.saturating_sub(self.max_len);
        let mut overlapping = core::mem::take(&mut self.scratch);
        overlapping.clear();
        overlapping.extend(
            self.by_start
                .range((lowest_start, 0)..(range.end(), 0))
                .filter(|&&(_, index)| self.entries[index as usize].range.overlaps(&range))
                .map(|&(_, index)| index),
        );
        for &index in &overlapping {
            let mut slot = self.entries[index as usize].first_ref;
            while slot != NIL {
                let reference = &self.slots[slot as usize];
                let next = reference.next;
                affected.push((
                    MrHandle {
                        slot,
                        generation: reference.generation,
                    },
                    reference.owner,
                ));
                self.free_slot(slot);
                slot = next;
            }
            let entry = &mut self.entries[index as usize];
            self.stats.invalidated_references += u64::from(entry.refs);
            entry.first_ref = NIL;
            entry.refs = 0;
            entry.remote_refs = 0;
            // The deregistration kills the rkey too: no separate revoke.
            entry.exposure = None;
            self.stats.invalidated_entries += 1;
            self.remove_entry(domain, index);
        }
        self.scratch = overlapping;
        affected
    }

    /// Drops every reference held by `owner` (a connection about to close), exactly as if
    /// each had been [`release`](Self::release)d: remote exposure held through them is
    /// revoked; the entries stay cached for other connections. Returns how many references
    /// were dropped. Cost: one pass over the reference table.
    pub fn release_owner<D: SanDomain>(&mut self, domain: &mut D, owner: OwnerId) -> usize {
        self.stats.owner_releases += 1;
        let mut dropped = 0;
        for slot in 0..self.slots.len() {
            let reference = &self.slots[slot];
            if reference.live && reference.owner == owner {
                dropped += 1;
                // `slot` < slots.len() ≤ NIL (checked in `get`), so it fits.
                self.detach_ref(domain, slot as u32);
            }
        }
        self.stats.releases += dropped as u64;
        dropped
    }

    /// The registration `handle` refers to (with the rkey if it asked for remote access),
    /// or `None` once the handle is stale (released or invalidated).
    pub fn registration(&self, handle: MrHandle) -> Option<Registration> {
        let slot = self.live_slot(handle)?;
        let reference = &self.slots[slot as usize];
        Some(self.registration_of(reference.entry, reference.remote))
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            bytes_registered: self.bytes,
            entries: self.live_entries,
            ..self.stats
        }
    }

    /// Every cached registration, in address order.
    pub fn entries(&self) -> impl Iterator<Item = EntryInfo> + '_ {
        self.by_start.iter().map(|&(_, index)| {
            let entry = &self.entries[index as usize];
            EntryInfo {
                registration: Registration {
                    range: entry.range,
                    access: entry.access,
                    lkey: entry.lkey,
                    rkey: entry.exposure.map(|exposure| exposure.rkey),
                },
                refs: entry.refs,
                remote_refs: entry.remote_refs,
                exposed_to: entry.exposure.map(|exposure| exposure.owner),
                reusable: !entry.doomed,
            }
        })
    }

    /// Checks every internal invariant (O(entries + references)); the simulation calls it
    /// after every step.
    ///
    /// # Errors
    /// The first invariant found broken.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let fail = |rule: &'static str, entry: Option<u32>| Err(InvariantViolation { rule, entry });
        let mut live = 0usize;
        let mut bytes = 0u64;
        let mut idle = 0usize;
        let mut total_refs = 0usize;
        let mut lengths: BTreeMap<u64, u32> = BTreeMap::new();
        for (index, entry) in self.entries.iter().enumerate() {
            let id = Some(index as u32);
            if !entry.live {
                if entry.in_lru {
                    return fail("a vacant entry is in the LRU list", id);
                }
                continue;
            }
            live += 1;
            bytes += entry.range.len;
            *lengths.entry(entry.range.len).or_default() += 1;
            if entry.range.len == 0 || entry.range.addr.checked_add(entry.range.len).is_none() {
                return fail("an entry's range is empty or wraps", id);
            }
            if !self.by_start.contains(&(entry.range.addr, index as u32)) {
                return fail("a live entry is missing from the address index", id);
            }
            if entry.range.len > self.max_len {
                return fail("an entry is longer than max_len", id);
            }
            let (mut refs, mut remote_refs) = (0u32, 0u32);
            let mut previous = NIL;
            let mut slot = entry.first_ref;
            while slot != NIL {
                let Some(reference) = self.slots.get(slot as usize) else {
                    return fail("a reference list points outside the table", id);
                };
                if !reference.live || reference.entry != index as u32 || reference.prev != previous
                {
                    return fail("a reference list is not well linked", id);
                }
                refs += 1;
                if refs > entry.refs {
                    return fail("a reference list is longer than the count", id);
                }
                if reference.remote {
                    remote_refs += 1;
                    if entry.exposure.map(|exposure| exposure.owner) != Some(reference.owner) {
                        return fail("a remote reference's owner is not the exposed-to owner", id);
                    }
                }
                previous = slot;
                slot = reference.next;
            }
            total_refs += refs as usize;
            if refs != entry.refs || remote_refs != entry.remote_refs {
                return fail("reference counts disagree with the reference list", id);
            }
            if entry.exposure.is_some() != (entry.remote_refs > 0) {
                return fail(
                    "an entry is exposed without remote references, or vice versa",
                    id,
                );
            }
            if let Some(exposure) = entry.exposure {
                if !entry.access.contains(exposure.access) || !exposure.access.is_remote() {
                    return fail("exposed rights are not remote rights of the entry", id);
                }
            }
            if entry.in_lru != (entry.refs == 0) {
                return fail("an entry is in the LRU list exactly when it is idle", id);
            }
            if entry.doomed && entry.refs == 0 {
                return fail("a doomed entry outlived its last reference", id);
            }
            idle += usize::from(entry.in_lru);
        }
        if live != self.live_entries || live != self.by_start.len() || bytes != self.bytes {
            return fail("entry count or byte total is out of date", None);
        }
        if lengths != self.lengths
            || self.max_len != lengths.last_key_value().map_or(0, |(&len, _)| len)
        {
            return fail("the length multiset or max_len is out of date", None);
        }
        if self.slots.iter().filter(|slot| slot.live).count() != total_refs {
            return fail("a live reference belongs to no entry's list", None);
        }
        for &slot in &self.free_slots {
            if self
                .slots
                .get(slot as usize)
                .is_none_or(|reference| reference.live)
            {
                return fail("the free reference list names a live slot", None);
            }
        }
        for &index in &self.free_entries {
            if self
                .entries
                .get(index as usize)
                .is_none_or(|entry| entry.live)
            {
                return fail("the free entry list names a live entry", None);
            }
        }
        // Walk the LRU list: well linked, exactly the idle entries.
        let (mut walked, mut previous, mut index) = (0usize, NIL, self.lru_head);
        while index != NIL {
            let Some(entry) = self.entries.get(index as usize) else {
                return fail("the LRU list points outside the slab", None);
            };
            if !entry.in_lru || entry.lru_prev != previous || walked >= idle {
                return fail("the LRU list is not well linked", Some(index));
            }
            walked += 1;
            previous = index;
            index = entry.lru_next;
        }
        if walked != idle || self.lru_tail != previous {
            return fail("the LRU list does not hold exactly the idle entries", None);
        }
        if self.last_used != NIL
            && !self
                .entries
                .get(self.last_used as usize)
                .is_some_and(|entry| entry.live)
        {
            return fail(
                "the last-used shortcut names a removed entry",
                Some(self.last_used),
            );
        }
        if self.over_bounds() && idle > 0 {
            return fail(
                "over a bound while idle entries could have been evicted",
                None,
            );
        }
        Ok(())
    }

    // ----- lookup -------------------------------------------------------------------------

    /// An entry that may serve the request: the last entry handed out if it can (buffers are
    /// reused back to back), else the nearest-starting one walking down from `range.addr`.
    fn find_usable(&self, range: MemRange, access: Access, owner: OwnerId) -> Option<u32> {
        if self.last_used != NIL && self.can_serve(self.last_used, range, access, owner) {
            return Some(self.last_used);
        }
        if range.len > self.max_len {
            return None; // also keeps the window below well formed
        }
        // A containing entry starts at or below `addr` and ends at or above `end`.
        let lowest_start = range.end().saturating_sub(self.max_len);
        self.by_start
            // One bounded end: the walk stops by itself at `lowest_start`, which saves the
            // second tree descent a two-sided range would cost on every hit.
            .range(..=(range.addr, NIL))
            .rev()
            .take_while(|&&(start, _)| start >= lowest_start)
            .map(|&(_, index)| index)
            .find(|&index| self.can_serve(index, range, access, owner))
    }

    /// True when live entry `index` may serve `get(owner, range, access)`: not doomed,
    /// containing (for a remote request: exactly the range, since the peer's key reaches the
    /// whole registration, and memory around the buffer is no business of the peer's), with
    /// the rights, and either not exposed, or exposed to the same owner with at least the
    /// remote rights asked (a local request ignores exposure).
    fn can_serve(&self, index: u32, range: MemRange, access: Access, owner: OwnerId) -> bool {
        let entry = &self.entries[index as usize];
        let remote_access = remote_part(access);
        !entry.doomed
            && if remote_access.is_remote() {
                entry.range == range
            } else {
                entry.range.contains(&range)
            }
            && entry.access.contains(access)
            && match entry.exposure {
                Some(exposure) if remote_access.is_remote() => {
                    exposure.owner == owner && exposure.access.contains(remote_access)
                }
                _ => true,
            }
    }

    /// Makes sure `index` is exposed to `owner` with `remote_access` if that is non-empty.
    /// On failure the entry is doomed (and dropped if idle) and false is returned.
    fn expose_if_needed<D: SanDomain>(
        &mut self,
        domain: &mut D,
        index: u32,
        owner: OwnerId,
        remote_access: Access,
    ) -> bool {
        let entry = &self.entries[index as usize];
        if !remote_access.is_remote() || entry.exposure.is_some() {
            // `find_usable` checked an existing exposure's owner and rights.
            return true;
        }
        match domain.expose_remote(entry.lkey, remote_access) {
            Ok(rkey) => {
                self.stats.re_exposures += 1;
                self.entries[index as usize].exposure = Some(Exposure {
                    rkey,
                    access: remote_access,
                    owner,
                });
                true
            }
            Err(_) => {
                self.stats.domain_errors += 1;
                self.doom(domain, index);
                false
            }
        }
    }

    fn registration_of(&self, index: u32, remote: bool) -> Registration {
        let entry = &self.entries[index as usize];
        Registration {
            range: entry.range,
            access: entry.access,
            lkey: entry.lkey,
            rkey: if remote {
                entry.exposure.map(|exposure| exposure.rkey)
            } else {
                None
            },
        }
    }

    // ----- misses -------------------------------------------------------------------------

    fn register_new<D: SanDomain>(
        &mut self,
        domain: &mut D,
        owner: OwnerId,
        range: MemRange,
        access: Access,
    ) -> Result<(MrHandle, Registration), RegisterError> {
        let registration = match domain.register(range, access) {
            Ok(registration) => Ok(registration),
            // Idle cached registrations may be what exhausts the pinning limit: give them up
            // and try once more.
            Err(RegisterError::OutOfResources) if self.lru_head != NIL => {
                while self.lru_head != NIL {
                    self.evict(domain, self.lru_head);
                }
                domain.register(range, access)
            }
            Err(error) => Err(error),
        };
        let mut registration = match registration {
            Ok(registration) => registration,
            Err(error) => {
                self.stats.registration_failures += 1;
                return Err(error);
            }
        };
        self.stats.registrations += 1;
        let remote_access = remote_part(access);
        let exposure = if !remote_access.is_remote() {
            registration.rkey = None;
            None
        } else {
            // The contract exposes remote rights at registration; tolerate a provider that
            // does not by exposing explicitly.
            let rkey = match registration.rkey {
                Some(rkey) => rkey,
                None => match domain.expose_remote(registration.lkey, remote_access) {
                    Ok(rkey) => rkey,
                    Err(error) => {
                        self.stats.registration_failures += 1;
                        self.deregister(domain, registration.lkey);
                        return Err(error);
                    }
                },
            };
            Some(Exposure {
                rkey,
                access: remote_access,
                owner,
            })
        };
        let index = self.insert_entry(Entry {
            range,
            access,
            lkey: registration.lkey,
            exposure,
            refs: 0,
            remote_refs: 0,
            first_ref: NIL,
            lru_prev: NIL,
            lru_next: NIL,
            in_lru: false,
            doomed: false,
            live: true,
        });
        self.last_used = index;
        let handle = self.attach_ref(index, owner, exposure.is_some());
        self.drop_subsumed(domain, index);
        if !self.trim_to_bounds(domain) {
            self.stats.overshoots += 1;
        }
        Ok((handle, self.registration_of(index, exposure.is_some())))
    }

    /// Deregisters idle entries starting inside the new entry `index` that it covers with at
    /// least their rights: every request they could serve, it serves too.
    fn drop_subsumed<D: SanDomain>(&mut self, domain: &mut D, index: u32) {
        let new = &self.entries[index as usize];
        let (range, access) = (new.range, new.access);
        let mut covered = core::mem::take(&mut self.scratch);
        covered.clear();
        covered.extend(
            self.by_start
                .range((range.addr, 0)..(range.end(), 0))
                .map(|&(_, other)| other)
                .filter(|&other| {
                    let entry = &self.entries[other as usize];
                    other != index
                        && entry.in_lru
                        && range.contains(&entry.range)
                        && access.contains(entry.access)
                }),
        );
        for &other in &covered {
            self.stats.subsumed += 1;
            self.remove_entry(domain, other);
        }
        self.scratch = covered;
    }

    // ----- bounds -------------------------------------------------------------------------

    fn over_bounds(&self) -> bool {
        self.live_entries > self.config.max_entries || self.bytes > self.config.max_bytes
    }

    /// Evicts idle entries, least recently released first, until within bounds. False if
    /// still over a bound (everything left is referenced).
    fn trim_to_bounds<D: SanDomain>(&mut self, domain: &mut D) -> bool {
        while self.over_bounds() {
            if self.lru_head == NIL {
                return false;
            }
            self.evict(domain, self.lru_head);
        }
        true
    }

    fn evict<D: SanDomain>(&mut self, domain: &mut D, index: u32) {
        self.stats.evictions += 1;
        self.remove_entry(domain, index);
    }

    // ----- references ---------------------------------------------------------------------

    fn live_slot(&self, handle: MrHandle) -> Option<u32> {
        let reference = self.slots.get(handle.slot as usize)?;
        (reference.live && reference.generation == handle.generation).then_some(handle.slot)
    }

    fn attach_ref(&mut self, index: u32, owner: OwnerId, remote: bool) -> MrHandle {
        let first = self.entries[index as usize].first_ref;
        let fresh = RefSlot {
            generation: 0,
            live: true,
            entry: index,
            owner,
            remote,
            prev: NIL,
            next: first,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                let reference = &mut self.slots[slot as usize];
                *reference = RefSlot {
                    generation: reference.generation,
                    ..fresh
                };
                slot
            }
            None => {
                // `get` checked that the table has room below NIL.
                self.slots.push(fresh);
                (self.slots.len() - 1) as u32
            }
        };
        if first != NIL {
            self.slots[first as usize].prev = slot;
        }
        let entry = &mut self.entries[index as usize];
        entry.first_ref = slot;
        entry.refs += 1;
        entry.remote_refs += u32::from(remote);
        if entry.in_lru {
            self.lru_unlink(index);
        }
        MrHandle {
            slot,
            generation: self.slots[slot as usize].generation,
        }
    }

    /// Unlinks the live reference `slot` from its entry, frees it and applies the release
    /// rules (revoke when the last remote reference goes, LRU when the last one goes).
    fn detach_ref<D: SanDomain>(&mut self, domain: &mut D, slot: u32) {
        let RefSlot {
            entry: index,
            remote,
            prev,
            next,
            ..
        } = self.slots[slot as usize];
        if prev != NIL {
            self.slots[prev as usize].next = next;
        } else {
            self.entries[index as usize].first_ref = next;
        }
        if next != NIL {
            self.slots[next as usize].prev = prev;
        }
        self.free_slot(slot);

        let entry = &mut self.entries[index as usize];
        entry.refs -= 1;
        if remote {
            entry.remote_refs -= 1;
            if entry.remote_refs == 0 {
                entry.exposure = None;
                let lkey = entry.lkey;
                match domain.revoke_remote(lkey) {
                    Ok(()) => self.stats.revocations += 1,
                    Err(_) => {
                        // The peer might still reach it: deregistration must follow.
                        self.stats.domain_errors += 1;
                        self.entries[index as usize].doomed = true;
                    }
                }
            }
        }
        let entry = &self.entries[index as usize];
        if entry.refs == 0 {
            if entry.doomed {
                self.remove_entry(domain, index);
            } else {
                self.lru_push_back(index);
                self.trim_to_bounds(domain);
            }
        }
    }

    fn free_slot(&mut self, slot: u32) {
        let reference = &mut self.slots[slot as usize];
        reference.live = false;
        // A slot whose generation would wrap is retired, so no handle is ever aliased.
        if let Some(generation) = reference.generation.checked_add(1) {
            reference.generation = generation;
            self.free_slots.push(slot);
        }
    }

    // ----- entries ------------------------------------------------------------------------

    fn insert_entry(&mut self, entry: Entry) -> u32 {
        let (addr, len) = (entry.range.addr, entry.range.len);
        let index = match self.free_entries.pop() {
            Some(index) => {
                self.entries[index as usize] = entry;
                index
            }
            None => {
                // `get` checked that the slab has room below NIL.
                self.entries.push(entry);
                (self.entries.len() - 1) as u32
            }
        };
        self.by_start.insert((addr, index));
        *self.lengths.entry(len).or_default() += 1;
        self.max_len = self.max_len.max(len);
        self.live_entries += 1;
        self.bytes += len;
        index
    }

    /// Marks `index` as never to be handed out again; drops it now if idle.
    fn doom<D: SanDomain>(&mut self, domain: &mut D, index: u32) {
        let entry = &mut self.entries[index as usize];
        entry.doomed = true;
        if entry.refs == 0 {
            self.remove_entry(domain, index);
        }
    }

    /// Forgets entry `index` (which must have no references left in the table) and
    /// deregisters it.
    fn remove_entry<D: SanDomain>(&mut self, domain: &mut D, index: u32) {
        if self.entries[index as usize].in_lru {
            self.lru_unlink(index);
        }
        if self.last_used == index {
            self.last_used = NIL;
        }
        let entry = &mut self.entries[index as usize];
        entry.live = false;
        entry.doomed = false;
        entry.exposure = None;
        let (range, lkey) = (entry.range, entry.lkey);
        self.free_entries.push(index);
        self.by_start.remove(&(range.addr, index));
        if let Some(count) = self.lengths.get_mut(&range.len) {
            *count -= 1;
            if *count == 0 {
                self.lengths.remove(&range.len);
                if range.len == self.max_len {
                    self.max_len = self.lengths.last_key_value().map_or(0, |(&len, _)| len);
                }
            }
        }
        self.live_entries -= 1;
        self.bytes -= range.len;
        self.deregister(domain, lkey);
    }

    fn deregister<D: SanDomain>(&mut self, domain: &mut D, lkey: LocalKey) {
        match domain.deregister(lkey) {
            Ok(()) => self.stats.deregistrations += 1,
            Err(_) => self.stats.domain_errors += 1,
        }
    }

    // ----- LRU list of idle entries -------------------------------------------------------

    fn lru_push_back(&mut self, index: u32) {
        let tail = self.lru_tail;
        let entry = &mut self.entries[index as usize];
        entry.in_lru = true;
        entry.lru_prev = tail;
        entry.lru_next = NIL;
        if tail != NIL {
            self.entries[tail as usize].lru_next = index;
        } else {
            self.lru_head = index;
        }
        self.lru_tail = index;
    }

    fn lru_unlink(&mut self, index: u32) {
        let entry = &mut self.entries[index as usize];
        let (prev, next) = (entry.lru_prev, entry.lru_next);
        entry.in_lru = false;
        entry.lru_prev = NIL;
        entry.lru_next = NIL;
        if prev != NIL {
            self.entries[prev as usize].lru_next = next;
        } else {
            self.lru_head = next;
        }
        if next != NIL {
            self.entries[next as usize].lru_prev = prev;
        } else {
            self.lru_tail = prev;
        }
    }
}
