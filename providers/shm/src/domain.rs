//! [`ShmDomain`]: per-process memory registration, and how exposures reach the peers.
//!
//! **Registration is bookkeeping, not pinning.** `process_vm_readv`/`process_vm_writev` walk
//! the target's page tables at copy time and fault pages in as needed, so unpinned (even
//! swapped-out) memory works and no `mlock` is needed. Registering records the range and its
//! rights; `register` only checks that the range is mapped (`mincore`).
//!
//! **Keys.** lkeys count up from 1 and are never reused. An rkey is
//! `generation << RKEY_INDEX_BITS | index`: `index` names one of [`EXPOSURE_ENTRIES`] entries of
//! the exposure table, `generation` is bumped every time the entry is handed out again, so a
//! revoked rkey can never become valid again. An entry whose generation space is exhausted is
//! retired for the life of the domain.
//!
//! **Publication (the design choice).** A domain is per process, but the peer checks rkeys
//! against a table in each connection's segment. The domain owns the authoritative table and
//! *mirrors* it into the owner-side exposure table of every connection set up with it
//! ([`ShmConnection::new`](crate::ShmConnection::new) registers the segment with the domain,
//! which first copies all current exposures in). Every expose, revoke and deregister rewrites
//! the entry (a seqlock, see `layout::ExposureEntry`) in every live segment under the domain
//! lock before returning, so a revocation is visible to every peer when `revoke_remote`
//! returns. Like a verbs protection domain, an rkey is valid on every connection of the domain.
//!
//! A transfer already past its rkey check when a revocation lands may still complete (the
//! check and the copy are not atomic, exactly as with an RDMA NIC); a later one fails.

use core::sync::atomic::{fence, Ordering};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use san_api::{
    Access, Capabilities, CompletionError, LocalKey, LocalSegment, MemRange, RegisterError,
    Registration, RemoteKey, SanDomain,
};

use crate::layout::{
    ExposureEntry, Geometry, EXPOSURE_ENTRIES, MAX_SLOTS, MAX_SLOT_SIZE, RKEY_INDEX_BITS,
};
use crate::sys::{self, GrantedRange, Mapping};

pub(crate) const INDEX_MASK: u32 = EXPOSURE_ENTRIES - 1;
/// Longest wait of a revocation for the peers' copies under way (one 1 MiB chunk takes well
/// under a millisecond; a peer that died mid-copy never ends its announcement).
const COPY_DRAIN_LIMIT: std::time::Duration = std::time::Duration::from_secs(1);
const MAX_GENERATION: u32 = u32::MAX >> RKEY_INDEX_BITS;
/// Largest single RDMA read or write.
pub const MAX_RDMA_LEN: u64 = 1 << 30;

/// Options of a domain.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DomainConfig {
    /// Never use CMA: RDMA writes go through the shared window and RDMA read is not offered
    /// (what happens anyway where the kernel forbids `process_vm_*`).
    pub force_window: bool,
}

#[derive(Clone, Copy, Debug)]
struct Reg {
    range: MemRange,
    access: Access,
    rkey: Option<u32>,
}

#[derive(Clone, Copy, Debug, Default)]
struct ExposureSlot {
    generation: u32,
    lkey: Option<u32>,
}

struct PublishedTable {
    map: Weak<Mapping>,
    geometry: Geometry,
    side: usize,
}

struct DomainState {
    next_lkey: u32,
    regs: HashMap<u32, Reg>,
    slots: Vec<ExposureSlot>,
    free: VecDeque<u32>,
    tables: Vec<PublishedTable>,
}

/// The state a domain shares with its connections.
pub(crate) struct DomainShared {
    state: Mutex<DomainState>,
    pub(crate) config: DomainConfig,
}

/// Per-process memory registration for the shared-memory provider.
pub struct ShmDomain {
    shared: Arc<DomainShared>,
}

impl Default for ShmDomain {
    fn default() -> Self {
        Self::new(DomainConfig::default())
    }
}

impl core::fmt::Debug for ShmDomain {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ShmDomain")
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

/// Capabilities of the provider under `config`. A connection's own
/// [`ShmConnection::capabilities`](crate::ShmConnection::capabilities) is authoritative: it
/// also knows whether the kernel lets us reach that particular peer with CMA.
pub(crate) fn capabilities(config: &DomainConfig, cma_permitted: bool) -> Capabilities {
    Capabilities {
        rdma_read: cma_permitted && !config.force_window,
        write_with_imm: false,
        read_sink_needs_remote_write: false,
        active_side_sends_first: false,
        max_slot_size: MAX_SLOT_SIZE,
        max_slots: MAX_SLOTS,
        max_inline: MAX_SLOT_SIZE,
        max_rdma_len: MAX_RDMA_LEN,
    }
}

fn write_entry(
    map: &Mapping,
    geometry: &Geometry,
    side: usize,
    index: u32,
    rkey: u32,
    access: Access,
    range: MemRange,
) {
    let entry: &ExposureEntry = map.get(geometry.exposure_entry(side, index as usize));
    let seq = entry.seq.load(Ordering::Relaxed);
    entry.seq.store(seq.wrapping_add(1) | 1, Ordering::Relaxed);
    fence(Ordering::Release);
    entry.rkey.store(rkey, Ordering::Relaxed);
    entry
        .access
        .store(u32::from(access.bits()), Ordering::Relaxed);
    entry.addr.store(range.addr, Ordering::Relaxed);
    entry.len.store(range.len, Ordering::Relaxed);
    entry
        .seq
        .store((seq | 1).wrapping_add(1), Ordering::Release);
}

/// Reads the peer's exposure entry for `rkey` (seqlock reader). `None` unless the entry is
/// stable, names exactly this rkey, and grants some right.
pub(crate) fn read_exposure(
    map: &Mapping,
    geometry: &Geometry,
    side: usize,
    rkey: RemoteKey,
) -> Option<(Access, MemRange)> {
    const ATTEMPTS: usize = 64;
    let entry: &ExposureEntry =
        map.get(geometry.exposure_entry(side, (rkey.0 & INDEX_MASK) as usize));
    for _ in 0..ATTEMPTS {
        let before = entry.seq.load(Ordering::Acquire);
        if before & 1 == 1 {
            core::hint::spin_loop();
            continue;
        }
        let key = entry.rkey.load(Ordering::Relaxed);
        let access = Access::from_bits_truncate(entry.access.load(Ordering::Relaxed) as u8);
        let range = MemRange::new(
            entry.addr.load(Ordering::Relaxed),
            entry.len.load(Ordering::Relaxed),
        );
        fence(Ordering::Acquire);
        if entry.seq.load(Ordering::Relaxed) != before {
            continue;
        }
        return (key == rkey.0 && rkey.0 != 0 && access.is_remote()).then_some((access, range));
    }
    None
}

impl ShmDomain {
    /// A domain with no registrations.
    pub fn new(config: DomainConfig) -> ShmDomain {
        let state = DomainState {
            next_lkey: 1,
            regs: HashMap::new(),
            slots: vec![ExposureSlot::default(); EXPOSURE_ENTRIES as usize],
            free: (0..EXPOSURE_ENTRIES).collect(),
            tables: Vec::new(),
        };
        ShmDomain {
            shared: Arc::new(DomainShared {
                state: Mutex::new(state),
                config,
            }),
        }
    }

    /// The configuration.
    pub fn config(&self) -> DomainConfig {
        self.shared.config
    }

    pub(crate) fn shared(&self) -> &Arc<DomainShared> {
        &self.shared
    }

    /// Another handle on the same domain (same registrations and exposure tables), for the
    /// connector, which sets connections up while the caller keeps registering.
    pub(crate) fn handle(&self) -> ShmDomain {
        ShmDomain {
            shared: Arc::clone(&self.shared),
        }
    }

    fn state(&self) -> MutexGuard<'_, DomainState> {
        self.shared.lock()
    }

    /// Runs `f` with the domain's lock held: a `fork()` made inside `f` leaves no other
    /// thread inside the domain (the child could never take the lock).
    pub fn while_locked<R>(&self, f: impl FnOnce() -> R) -> R {
        let _state = self.state();
        f()
    }
}

impl DomainShared {
    fn lock(&self) -> MutexGuard<'_, DomainState> {
        // A panic while holding the lock cannot leave the tables half-written in a way that
        // matters more than losing the domain; keep serving.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Mirrors all current exposures into `side`'s table of a new connection's segment and
    /// keeps it updated from now on.
    pub(crate) fn publish_to(&self, map: &Arc<Mapping>, geometry: Geometry, side: usize) {
        let mut state = self.lock();
        for reg in state.regs.values() {
            if let Some(rkey) = reg.rkey {
                write_entry(
                    map,
                    &geometry,
                    side,
                    rkey & INDEX_MASK,
                    rkey,
                    reg.access,
                    reg.range,
                );
            }
        }
        state.tables.retain(|table| table.map.strong_count() > 0);
        state.tables.push(PublishedTable {
            map: Arc::downgrade(map),
            geometry,
            side,
        });
    }

    /// Checks a local segment of a work request: a live lkey whose range contains it, with
    /// local-write rights when the provider writes it.
    pub(crate) fn local_segment(
        &self,
        segment: &LocalSegment,
        needs_write: bool,
    ) -> Result<GrantedRange, CompletionError> {
        let state = self.lock();
        let reg = state
            .regs
            .get(&segment.lkey.0)
            .ok_or(CompletionError::LocalProtection)?;
        let allowed = segment.range.len > 0
            && reg.range.contains(&segment.range)
            && (!needs_write || reg.access.contains(Access::LOCAL_WRITE));
        allowed
            .then_some(GrantedRange {
                addr: segment.range.addr,
                len: segment.range.len,
            })
            .ok_or(CompletionError::LocalProtection)
    }

    /// Checks a peer's access to our memory against the authoritative table (used when
    /// applying window writes).
    pub(crate) fn exposed(
        &self,
        rkey: u32,
        range: MemRange,
        needs: Access,
    ) -> Result<GrantedRange, CompletionError> {
        let state = self.lock();
        let slot = state
            .slots
            .get((rkey & INDEX_MASK) as usize)
            .ok_or(CompletionError::RemoteAccess)?;
        let reg = slot
            .lkey
            .and_then(|lkey| state.regs.get(&lkey))
            .ok_or(CompletionError::RemoteAccess)?;
        let allowed = reg.rkey == Some(rkey)
            && reg.access.contains(needs)
            && reg.range.contains(&range)
            && range.len > 0;
        allowed
            .then_some(GrantedRange {
                addr: range.addr,
                len: range.len,
            })
            .ok_or(CompletionError::RemoteAccess)
    }
}

impl DomainState {
    fn publish(&mut self, index: u32, rkey: u32, access: Access, range: MemRange) {
        self.tables.retain(|table| table.map.strong_count() > 0);
        for table in &self.tables {
            if let Some(map) = table.map.upgrade() {
                write_entry(
                    &map,
                    &table.geometry,
                    table.side,
                    index,
                    rkey,
                    access,
                    range,
                );
            }
        }
    }

    /// After revoking entry `index`: waits until no peer has a CMA copy under way in it
    /// (see `ExposureEntry::copies_in_flight`), so the memory can be reused once revocation
    /// returns. A peer's copy announced before it saw the revocation is still running; one
    /// announced after sees the revoked key and does not copy. Bounded by
    /// [`COPY_DRAIN_LIMIT`], after which an announcement nobody will end is cleared.
    fn wait_for_copies(&self, index: u32) {
        fence(Ordering::SeqCst);
        let deadline = std::time::Instant::now() + COPY_DRAIN_LIMIT;
        for table in &self.tables {
            let Some(map) = table.map.upgrade() else {
                continue;
            };
            let entry: &ExposureEntry =
                map.get(table.geometry.exposure_entry(table.side, index as usize));
            while entry.copies_in_flight.load(Ordering::SeqCst) != 0 {
                if std::time::Instant::now() >= deadline {
                    entry.copies_in_flight.store(0, Ordering::SeqCst);
                    break;
                }
                std::thread::yield_now();
            }
        }
    }

    fn expose(&mut self, lkey: u32, remote: Access) -> Result<u32, RegisterError> {
        let reg = *self.regs.get(&lkey).ok_or(RegisterError::UnknownKey)?;
        self.revoke(lkey);
        let index = self.free.pop_front().ok_or(RegisterError::OutOfResources)?;
        let slot = &mut self.slots[index as usize];
        slot.generation += 1;
        slot.lkey = Some(lkey);
        let rkey = slot.generation << RKEY_INDEX_BITS | index;
        let access = Access::from_bits_truncate(
            (reg.access.bits() & Access::LOCAL_WRITE.bits())
                | (remote.bits() & !Access::LOCAL_WRITE.bits()),
        );
        if let Some(reg) = self.regs.get_mut(&lkey) {
            reg.rkey = Some(rkey);
            reg.access = access;
        }
        self.publish(index, rkey, access, reg.range);
        Ok(rkey)
    }

    fn revoke(&mut self, lkey: u32) {
        let Some(reg) = self.regs.get_mut(&lkey) else {
            return;
        };
        let Some(rkey) = reg.rkey.take() else { return };
        let index = rkey & INDEX_MASK;
        self.publish(index, 0, Access::NONE, MemRange::new(0, 0));
        self.wait_for_copies(index);
        let slot = &mut self.slots[index as usize];
        slot.lkey = None;
        if slot.generation < MAX_GENERATION {
            self.free.push_back(index);
        }
    }
}

impl SanDomain for ShmDomain {
    fn capabilities(&self) -> Capabilities {
        // Optimistic about CMA; the connection's capabilities say what holds for its peer.
        capabilities(&self.shared.config, true)
    }

    fn register(&mut self, range: MemRange, access: Access) -> Result<Registration, RegisterError> {
        if range.len == 0 || range.addr.checked_add(range.len).is_none() {
            return Err(RegisterError::BadAddress);
        }
        if !sys::range_is_mapped(range.addr, range.len) {
            return Err(RegisterError::BadAddress);
        }
        let mut state = self.state();
        let lkey = state.next_lkey;
        state.next_lkey = lkey.checked_add(1).ok_or(RegisterError::OutOfResources)?;
        state.regs.insert(
            lkey,
            Reg {
                range,
                access,
                rkey: None,
            },
        );
        let rkey = if access.is_remote() {
            match state.expose(lkey, access) {
                Ok(rkey) => Some(RemoteKey(rkey)),
                Err(e) => {
                    state.regs.remove(&lkey);
                    return Err(e);
                }
            }
        } else {
            None
        };
        Ok(Registration {
            range,
            access,
            lkey: LocalKey(lkey),
            rkey,
        })
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        let mut state = self.state();
        if !state.regs.contains_key(&lkey.0) {
            return Err(RegisterError::UnknownKey);
        }
        state.revoke(lkey.0);
        state.regs.remove(&lkey.0);
        Ok(())
    }

    fn revoke_remote(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        let mut state = self.state();
        if !state.regs.contains_key(&lkey.0) {
            return Err(RegisterError::UnknownKey);
        }
        state.revoke(lkey.0);
        Ok(())
    }

    fn expose_remote(
        &mut self,
        lkey: LocalKey,
        access: Access,
    ) -> Result<RemoteKey, RegisterError> {
        if !access.is_remote() {
            return Err(RegisterError::Unsupported);
        }
        self.state().expose(lkey.0, access).map(RemoteKey)
    }

    /// Withdraws from every exposure table (ours and every connection's segment) each
    /// exposure still naming memory in `range`: a peer must never reach pages whose mapping
    /// is about to change. The switch's cache has deregistered its own registrations over
    /// `range` already; this catches registrations it does not own. Local registrations
    /// stay: their lkeys are checked against their ranges on every use, and their owner
    /// learns of the change through its own cache.
    fn memory_invalidated(&mut self, range: MemRange) {
        let mut state = self.state();
        let exposed: Vec<u32> = state
            .regs
            .iter()
            .filter(|(_, reg)| reg.rkey.is_some() && reg.range.overlaps(&range))
            .map(|(&lkey, _)| lkey)
            .collect();
        for lkey in exposed {
            state.revoke(lkey);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buffer_range(buffer: &[u8]) -> MemRange {
        MemRange::new(buffer.as_ptr() as u64, buffer.len() as u64)
    }

    #[test]
    fn invalidation_withdraws_exposures_over_the_range_and_nothing_else() {
        let buffer = vec![0u8; 3 * 4096];
        let whole = buffer_range(&buffer);
        let first = MemRange::new(whole.addr, 4096);
        let last = MemRange::new(whole.addr + 2 * 4096, 4096);
        let mut domain = ShmDomain::default();
        let gone = domain.register(first, Access::REMOTE_READ).unwrap();
        let kept = domain.register(last, Access::REMOTE_WRITE).unwrap();
        let local = domain.register(first, Access::LOCAL_WRITE).unwrap();
        let shared = domain.shared().clone();

        domain.memory_invalidated(MemRange::new(first.addr + 100, 8));
        assert_eq!(
            shared.exposed(gone.rkey.unwrap().0, first, Access::REMOTE_READ),
            Err(CompletionError::RemoteAccess),
            "an exposure over the invalidated range no longer lets the peer in"
        );
        assert!(shared
            .exposed(kept.rkey.unwrap().0, last, Access::REMOTE_WRITE)
            .is_ok());
        let segment = LocalSegment {
            range: first,
            lkey: local.lkey,
        };
        assert!(
            shared.local_segment(&segment, true).is_ok(),
            "local use stays"
        );
        // The registration itself survives: it can be exposed again under a fresh rkey.
        let again = domain
            .expose_remote(gone.lkey, Access::REMOTE_READ)
            .unwrap();
        assert_ne!(Some(again), gone.rkey);
    }

    #[test]
    fn revoked_rkeys_are_never_handed_out_again() {
        let buffer = vec![0u8; 8192];
        let mut domain = ShmDomain::default();
        let reg = domain
            .register(buffer_range(&buffer), Access::REMOTE_READ)
            .unwrap();
        let mut seen = std::collections::HashSet::new();
        seen.insert(reg.rkey.unwrap());
        // Cycle far more than the table size so indices are reused with new generations.
        for _ in 0..3 * EXPOSURE_ENTRIES {
            domain.revoke_remote(reg.lkey).unwrap();
            let rkey = domain
                .expose_remote(reg.lkey, Access::REMOTE_WRITE)
                .unwrap();
            assert!(seen.insert(rkey), "rkey {rkey:?} reused");
        }
    }

    #[test]
    fn checks_follow_rights_ranges_and_revocation() {
        let buffer = vec![0u8; 8192];
        let range = buffer_range(&buffer);
        let mut domain = ShmDomain::default();
        let reg = domain.register(range, Access::REMOTE_WRITE).unwrap();
        let rkey = reg.rkey.unwrap().0;
        let shared = domain.shared().clone();
        assert!(shared.exposed(rkey, range, Access::REMOTE_WRITE).is_ok());
        assert_eq!(
            shared.exposed(rkey, range, Access::REMOTE_READ),
            Err(CompletionError::RemoteAccess)
        );
        let beyond = MemRange::new(range.addr + 1, range.len);
        assert_eq!(
            shared.exposed(rkey, beyond, Access::REMOTE_WRITE),
            Err(CompletionError::RemoteAccess)
        );
        let local = LocalSegment {
            range,
            lkey: reg.lkey,
        };
        assert_eq!(
            shared.local_segment(&local, true),
            Err(CompletionError::LocalProtection),
            "no LOCAL_WRITE"
        );
        assert!(shared.local_segment(&local, false).is_ok());
        domain.revoke_remote(reg.lkey).unwrap();
        assert_eq!(
            shared.exposed(rkey, range, Access::REMOTE_WRITE),
            Err(CompletionError::RemoteAccess)
        );
        assert!(
            shared.local_segment(&local, false).is_ok(),
            "revoke keeps local use"
        );
        domain.deregister(reg.lkey).unwrap();
        assert_eq!(
            shared.local_segment(&local, false),
            Err(CompletionError::LocalProtection)
        );
        assert_eq!(domain.deregister(reg.lkey), Err(RegisterError::UnknownKey));
    }

    #[test]
    fn unmapped_ranges_are_refused() {
        let mut domain = ShmDomain::default();
        assert_eq!(
            domain.register(MemRange::new(0x1000, 4096), Access::NONE),
            Err(RegisterError::BadAddress)
        );
        assert_eq!(
            domain.register(MemRange::new(u64::MAX - 10, 100), Access::NONE),
            Err(RegisterError::BadAddress)
        );
    }
}
