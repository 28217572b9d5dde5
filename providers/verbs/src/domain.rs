//! The protection domain and its registration table ([`SanDomain`]).
//!
//! ## How `revoke_remote` works, and why this way
//! A [`LocalKey`] handed out here is a provider handle, not the hardware lkey: the table
//! maps it to the *current* memory region. Revoking registers the same range again with
//! local rights only, and then deregisters the exposed region, whose rkey dies with it.
//! The pages are pinned throughout (by the new region before the old one goes), the
//! caller's `LocalKey` stays valid, and the next `expose_remote` registers a fresh region.
//! Alternatives rejected: type-2 memory windows (bind/invalidate) are not implemented by
//! siw, and `ibv_rereg_mr` is implemented by neither rxe (6.1) nor siw for key changes;
//! deregistering and keeping the pages pinned with `mlock` would also change the lkey.
//! Costs: a revoke/expose is one registration (no data copy), and the pinned-page
//! accounting briefly counts the range twice.
//!
//! ## Memory changes
//! Every range is handed to the process-wide memory-change monitor ([`crate::monitor`]) before
//! it is pinned. The changes it reports are collected by [`VerbsDomain::take_memory_changes`],
//! whose caller (the registration cache's driver) invalidates each returned range in the
//! cache; meanwhile a registration overlapping a reported change is never used for a local
//! operation: posting with it completes with a local protection error.
//!
//! Revoked and deregistered rkeys go to a bounded quarantine; a new region whose rkey is
//! still quarantined is replaced, so a peer holding a stale descriptor never reaches a new
//! registration through a recycled key.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use san_api::{
    Access, Capabilities, LocalKey, MemRange, RegisterError, Registration, RemoteKey, SanDomain,
};

use crate::cm;
use crate::device::Device;
use crate::monitor::{
    Coverage, EventCounts, MemoryChanges, Monitor, MonitorUnavailable, SubscriberId,
};
use crate::mr::MemoryRegion;
use crate::pd::ProtectionDomain;
use crate::VerbsSetupError;

/// How many recently revoked rkeys are never handed out again.
const QUARANTINE: usize = 4096;
/// Attempts to get an rkey outside the quarantine before giving up.
const FRESH_KEY_ATTEMPTS: usize = 8;
const KNOWN_RIGHTS: u8 =
    Access::LOCAL_WRITE.bits() | Access::REMOTE_READ.bits() | Access::REMOTE_WRITE.bits();

/// A protection domain on one RDMA device ([`SanDomain`]). Connections set up with it keep
/// its state alive.
pub struct VerbsDomain {
    pub(crate) shared: Arc<DomainShared>,
}

pub(crate) struct DomainShared {
    // Field order is drop order: every region is deregistered before the PD is freed.
    table: Mutex<RegistrationTable>,
    pub(crate) pd: ProtectionDomain,
    monitor: Result<(&'static Monitor, SubscriberId), MonitorUnavailable>,
}

struct Entry {
    range: MemRange,
    access: Access,
    region: MemoryRegion,
    /// The monitor reports changes to this range's mapping.
    watched: bool,
    /// A change to the mapping was collected: never used again, only deregistered.
    stale: bool,
}

#[derive(Default)]
struct RegistrationTable {
    entries: HashMap<u32, Entry>,
    next_handle: u32,
    quarantined: HashSet<u32>,
    quarantine_order: VecDeque<u32>,
}

/// What a connection needs to post an RDMA operation on a registration.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ResolvedKey {
    pub(crate) range: MemRange,
    pub(crate) access: Access,
    pub(crate) hardware_lkey: u32,
}

impl VerbsDomain {
    /// Opens a domain on the device named `name` (the first device for `None`).
    ///
    /// # Errors
    /// [`VerbsSetupError::NoDevice`] without RDMA devices (on a host without RDMA support,
    /// librdmacm fails with ENOSYS/ENODEV) or without one of that name.
    pub fn open(name: Option<&str>) -> Result<Self, VerbsSetupError> {
        Self::on_device(Device::by_name(name)?)
    }

    /// Opens a domain on the device that serves the local address `ip`.
    ///
    /// # Errors
    /// [`VerbsSetupError::NoDevice`] when no RDMA device serves it.
    pub fn open_for_address(ip: IpAddr) -> Result<Self, VerbsSetupError> {
        Self::on_device(cm::device_for_local_ip(ip)?)
    }

    fn on_device(device: Device) -> Result<Self, VerbsSetupError> {
        let pd = ProtectionDomain::allocate(device)?;
        let monitor = Monitor::get().map(|monitor| (monitor, monitor.subscribe()));
        Ok(Self {
            shared: Arc::new(DomainShared {
                table: Mutex::new(RegistrationTable::default()),
                pd,
                monitor,
            }),
        })
    }

    /// Collects the mapping changes under this domain's registrations since the last call:
    /// munmap, mremap, madvise(DONTNEED/FREE), brk shrinking, glibc's internal unmaps. Every
    /// change made before this call started is included. Registrations overlapping them are
    /// marked stale here (refused for local operations from now on).
    ///
    /// The caller must pass each range to `MrCache::invalidate` **before its next
    /// `MrCache::get`**; that is what keeps a cache hit from naming pages that are no longer
    /// mapped at the address. Cost when nothing changed: two uncontended mutex locks.
    pub fn take_memory_changes(&self) -> MemoryChanges {
        let Ok((monitor, id)) = self.shared.monitor else {
            return MemoryChanges::default();
        };
        // The table lock is held across the take, so that no `resolve` can fall between a
        // change leaving the pending queue and its registrations being marked stale.
        // Lock order everywhere: table, then monitor (the service thread takes only the latter).
        let mut table = self.shared.lock();
        let changes = monitor.take(id);
        if !changes.is_empty() {
            for entry in table.entries.values_mut() {
                if changes.ranges().iter().any(|r| r.overlaps(&entry.range)) {
                    entry.stale = true;
                }
            }
        }
        drop(table);
        changes
    }

    /// The memory-change monitor's event counts, or why it is not running (then no
    /// registration is watched and the cache must not keep registrations past their use).
    ///
    /// # Errors
    /// [`MonitorUnavailable`] if userfaultfd could not be set up in this process.
    pub fn memory_monitor(&self) -> Result<EventCounts, MonitorUnavailable> {
        self.shared
            .monitor
            .map(|(monitor, _)| monitor.event_counts())
    }

    /// Whether changes to the mapping under the registration `lkey` are reported (`None` for
    /// an unknown key). An unwatched registration (file-backed or shared memory, or no
    /// monitor) must be invalidated by the caller once its transfer is done, not cached.
    pub fn is_watched(&self, lkey: LocalKey) -> Option<bool> {
        self.shared.lock().entries.get(&lkey.0).map(|e| e.watched)
    }

    /// The device name (e.g. `rxe0`).
    pub fn device_name(&self) -> &str {
        &self.shared.pd.device.name
    }

    /// True for an iWARP device (siw), false for InfiniBand/RoCE (rxe).
    pub fn is_iwarp(&self) -> bool {
        self.shared.pd.device.iwarp
    }

    /// Number of live registrations (for tests and statistics).
    pub fn registration_count(&self) -> usize {
        self.shared.lock().entries.len()
    }
}

impl DomainShared {
    fn lock(&self) -> MutexGuard<'_, RegistrationTable> {
        // A panic while holding the lock cannot leave the table inconsistent (every
        // mutation is a single insert/replace/remove), so poisoning is ignored.
        self.table
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The registration behind a provider `LocalKey`, if live and its mapping unchanged
    /// (neither collected as stale nor overlapping a change not yet collected).
    pub(crate) fn resolve(&self, lkey: LocalKey) -> Option<ResolvedKey> {
        // Table lock held across the pending check (see `take_memory_changes`).
        let table = self.lock();
        let entry = table.entries.get(&lkey.0).filter(|entry| !entry.stale)?;
        if let Ok((monitor, id)) = self.monitor {
            if monitor.overlaps_pending(id, &entry.range) {
                return None;
            }
        }
        Some(ResolvedKey {
            range: entry.range,
            access: entry.access,
            hardware_lkey: entry.region.lkey(),
        })
    }

    /// Hands `range` to the monitor (before pinning it, so no change can slip in between).
    fn watch(&self, range: MemRange) -> bool {
        match self.monitor {
            Ok((monitor, _)) => monitor.watch(range) == Coverage::Watched,
            Err(_) => false,
        }
    }

    /// Registers `range`; remote rights get an rkey outside the quarantine.
    fn register_region(
        &self,
        table: &RegistrationTable,
        range: MemRange,
        access: Access,
    ) -> Result<MemoryRegion, RegisterError> {
        if !access.is_remote() {
            return MemoryRegion::register(&self.pd, range.addr, range.len, access);
        }
        // Regions whose rkey collides stay alive until we have a fresh one, so that the
        // device cannot hand the same key straight back.
        let mut colliding = Vec::new();
        for _ in 0..FRESH_KEY_ATTEMPTS {
            let region = MemoryRegion::register(&self.pd, range.addr, range.len, access)?;
            if !table.quarantined.contains(&region.rkey()) {
                return Ok(region);
            }
            colliding.push(region);
        }
        Err(RegisterError::OutOfResources)
    }
}

impl Drop for DomainShared {
    fn drop(&mut self) {
        if let Ok((monitor, id)) = self.monitor {
            monitor.unsubscribe(id);
        }
    }
}

impl RegistrationTable {
    fn quarantine(&mut self, rkey: u32) {
        if self.quarantined.insert(rkey) {
            self.quarantine_order.push_back(rkey);
            if self.quarantine_order.len() > QUARANTINE {
                if let Some(oldest) = self.quarantine_order.pop_front() {
                    self.quarantined.remove(&oldest);
                }
            }
        }
    }

    fn new_handle(&mut self) -> Option<u32> {
        // Handles are never 0 and never a live one; u32 space is far larger than any
        // registration count the kernel allows.
        for _ in 0..=self.entries.len() {
            self.next_handle = self.next_handle.wrapping_add(1).max(1);
            if !self.entries.contains_key(&self.next_handle) {
                return Some(self.next_handle);
            }
        }
        None
    }
}

fn validate(range: MemRange, access: Access, device: &Device) -> Result<(), RegisterError> {
    if range.len == 0 || range.addr == 0 || range.addr.checked_add(range.len).is_none() {
        return Err(RegisterError::BadAddress);
    }
    if usize::try_from(range.len).is_err() || range.len > device.max_mr_size {
        return Err(RegisterError::OutOfResources);
    }
    if access.bits() & !KNOWN_RIGHTS != 0 {
        return Err(RegisterError::Unsupported);
    }
    Ok(())
}

impl SanDomain for VerbsDomain {
    fn capabilities(&self) -> Capabilities {
        self.shared.pd.device.capabilities
    }

    fn register(&mut self, range: MemRange, access: Access) -> Result<Registration, RegisterError> {
        validate(range, access, &self.shared.pd.device)?;
        let watched = self.shared.watch(range);
        let mut table = self.shared.lock();
        let region = self.shared.register_region(&table, range, access)?;
        let handle = table.new_handle().ok_or(RegisterError::OutOfResources)?;
        let rkey = access.is_remote().then(|| RemoteKey(region.rkey()));
        table.entries.insert(
            handle,
            Entry {
                range,
                access,
                region,
                watched,
                stale: false,
            },
        );
        Ok(Registration {
            range,
            access,
            lkey: LocalKey(handle),
            rkey,
        })
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        let mut table = self.shared.lock();
        let entry = table
            .entries
            .remove(&lkey.0)
            .ok_or(RegisterError::UnknownKey)?;
        if entry.access.is_remote() {
            table.quarantine(entry.region.rkey());
        }
        drop(entry);
        Ok(())
    }

    fn revoke_remote(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        let mut table = self.shared.lock();
        let (range, access, watched, stale) = match table.entries.get(&lkey.0) {
            Some(entry) if entry.access.is_remote() => {
                (entry.range, entry.access, entry.watched, entry.stale)
            }
            Some(_) => return Ok(()),
            None => return Err(RegisterError::UnknownKey),
        };
        let local_only = Access::from_bits_truncate(access.bits() & Access::LOCAL_WRITE.bits());
        // Pin again with local rights before the exposed region goes: the pages never
        // become unpinned, and a failure leaves the registration as it was.
        let region = self.shared.register_region(&table, range, local_only)?;
        let old = table.entries.insert(
            lkey.0,
            Entry {
                range,
                access: local_only,
                region,
                watched,
                stale,
            },
        );
        if let Some(old) = old {
            table.quarantine(old.region.rkey());
        }
        Ok(())
    }

    fn expose_remote(
        &mut self,
        lkey: LocalKey,
        access: Access,
    ) -> Result<RemoteKey, RegisterError> {
        if !access.is_remote() || access.bits() & !KNOWN_RIGHTS != 0 {
            return Err(RegisterError::Unsupported);
        }
        let mut table = self.shared.lock();
        let (range, current, watched) = match table.entries.get(&lkey.0) {
            Some(entry) if entry.stale => return Err(RegisterError::BadAddress),
            Some(entry) => (entry.range, entry.access, entry.watched),
            None => return Err(RegisterError::UnknownKey),
        };
        let wanted =
            Access::from_bits_truncate(current.bits() & Access::LOCAL_WRITE.bits()) | access;
        let region = self.shared.register_region(&table, range, wanted)?;
        let rkey = RemoteKey(region.rkey());
        let old = table.entries.insert(
            lkey.0,
            Entry {
                range,
                access: wanted,
                region,
                watched,
                stale: false,
            },
        );
        if let Some(old) = old.filter(|old| old.access.is_remote()) {
            table.quarantine(old.region.rkey());
        }
        Ok(rkey)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quarantine_is_bounded_and_forgets_the_oldest_key_first() {
        let mut table = RegistrationTable::default();
        for rkey in 0..QUARANTINE as u32 {
            table.quarantine(rkey);
        }
        table.quarantine(7); // already quarantined: no double entry
        assert_eq!(table.quarantine_order.len(), QUARANTINE);
        table.quarantine(QUARANTINE as u32);
        assert!(!table.quarantined.contains(&0), "the oldest key left");
        assert!(table.quarantined.contains(&1) && table.quarantined.contains(&(QUARANTINE as u32)));
        assert_eq!(table.quarantined.len(), table.quarantine_order.len());
    }

    #[test]
    fn handles_are_never_zero_even_when_the_counter_wraps() {
        let mut table = RegistrationTable {
            next_handle: u32::MAX - 1,
            ..RegistrationTable::default()
        };
        assert_eq!(table.new_handle(), Some(u32::MAX));
        assert_eq!(table.new_handle(), Some(1), "0 is skipped");
    }
}
