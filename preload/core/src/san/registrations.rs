//! The process-wide memory registrations of the SAN path: one `ShmDomain` and one
//! [`MrCache`] in front of it, shared by every SAN socket of the process (a registration
//! belongs to the protection domain, not to a connection). Each verbs protection domain
//! (one per local address, `super::verbs`) has its own, of the same type.
//!
//! # Verbs: memory changes
//! A verbs registration pins the pages it was made on. Before every cache lookup on a verbs
//! domain the domain's memory-change monitor is asked for what changed under its
//! registrations (`take_memory_changes`, see `docs/ARCHITECTURE.md`, "Registration cache
//! invalidation") and each range is invalidated in the cache. A registration the monitor does
//! not watch (or every registration, when the monitor is not running) is invalidated as soon
//! as its transfer released it: it is never reused from the cache.
//!
//! # Locking
//! One mutex guards the domain and the cache. It is the innermost lock of the SAN path (taken
//! with a socket's lock held, never the reverse) and it is held only for bookkeeping: a
//! cache lookup or a domain call (the shm domain's `register` is a `mincore` check, no
//! pinning), never while blocking.
//!
//! # Handles
//! The session names registrations by [`MrHandleId`]; the cache by [`MrHandle`]. The table
//! here maps one to the other, with the owning socket, so that a socket's close can drop
//! exactly its own references ([`MrCache::release_owner`]) and forget their ids.
//!
//! # Test knob
//! `SANDIRECT_SAN_REFUSE_REGISTRATIONS=N` (read once): the first `N` registrations this
//! process asks for fail as if the domain were out of resources. The integration tests use it
//! to check that a refused sender registration is `ENOBUFS` with nothing sent, and that a
//! refused receiver registration ends the rendezvous without losing a byte. Not for
//! production use.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use san_api::{
    Access, Capabilities, LocalKey, MemRange, RegisterError, Registration, RemoteKey, SanDomain,
};
use san_shm::ShmDomain;
use san_verbs_loader::LoadedDomain;
use switch::mr_cache::{CacheConfig, MrCache, MrHandle, OwnerId};
use switch::session::{MrHandleId, RegisteredRange};

/// The protection domain behind a cache.
pub(super) enum AnyDomain {
    /// The intra-host shared-memory domain.
    Shm(ShmDomain),
    /// A verbs protection domain (one device).
    Verbs(LoadedDomain),
    /// Unit tests: keys for this process's own memory, which the simulated link's RDMA
    /// copies between (see `super::in_process_tests`).
    #[cfg(test)]
    Test(super::in_process_tests::TestDomain),
}

impl SanDomain for AnyDomain {
    fn capabilities(&self) -> Capabilities {
        match self {
            AnyDomain::Shm(d) => d.capabilities(),
            AnyDomain::Verbs(d) => d.capabilities(),
            #[cfg(test)]
            AnyDomain::Test(d) => d.capabilities(),
        }
    }

    fn register(&mut self, range: MemRange, access: Access) -> Result<Registration, RegisterError> {
        match self {
            AnyDomain::Shm(d) => d.register(range, access),
            AnyDomain::Verbs(d) => d.register(range, access),
            #[cfg(test)]
            AnyDomain::Test(d) => d.register(range, access),
        }
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        match self {
            AnyDomain::Shm(d) => d.deregister(lkey),
            AnyDomain::Verbs(d) => d.deregister(lkey),
            #[cfg(test)]
            AnyDomain::Test(d) => d.deregister(lkey),
        }
    }

    fn revoke_remote(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        match self {
            AnyDomain::Shm(d) => d.revoke_remote(lkey),
            AnyDomain::Verbs(d) => d.revoke_remote(lkey),
            #[cfg(test)]
            AnyDomain::Test(d) => d.revoke_remote(lkey),
        }
    }

    fn expose_remote(
        &mut self,
        lkey: LocalKey,
        access: Access,
    ) -> Result<RemoteKey, RegisterError> {
        match self {
            AnyDomain::Shm(d) => d.expose_remote(lkey, access),
            AnyDomain::Verbs(d) => d.expose_remote(lkey, access),
            #[cfg(test)]
            AnyDomain::Test(d) => d.expose_remote(lkey, access),
        }
    }

    fn memory_invalidated(&mut self, range: MemRange) {
        match self {
            AnyDomain::Shm(d) => d.memory_invalidated(range),
            AnyDomain::Verbs(d) => d.memory_invalidated(range),
            #[cfg(test)]
            AnyDomain::Test(d) => d.memory_invalidated(range),
        }
    }
}

/// The domain, the cache and the handle table (see the module docs).
pub(super) struct Registrations {
    domain: AnyDomain,
    cache: MrCache,
    handles: HashMap<MrHandleId, (MrHandle, OwnerId)>,
    /// Verbs references that must leave the cache once released (unwatched memory).
    uncached: HashMap<MrHandleId, MemRange>,
    next_handle: u64,
    /// Registrations still to refuse (the test knob).
    refuse_left: u64,
}

impl core::fmt::Debug for Registrations {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Registrations")
            .field("held", &self.handles.len())
            .field("cache", &self.cache.stats())
            .finish_non_exhaustive()
    }
}

/// The registrations behind their lock.
pub(super) struct SharedRegistrations(Mutex<Registrations>);

impl core::fmt::Debug for SharedRegistrations {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("SharedRegistrations")
    }
}

impl SharedRegistrations {
    /// A fresh domain and cache; reads the test knob.
    pub(super) fn new(domain: ShmDomain) -> SharedRegistrations {
        Self::with_domain(AnyDomain::Shm(domain))
    }

    /// A fresh cache in front of a verbs domain.
    pub(super) fn verbs(domain: LoadedDomain) -> SharedRegistrations {
        Self::with_domain(AnyDomain::Verbs(domain))
    }

    /// Unit tests: a fresh cache in front of a test domain (one per simulated pair, so that
    /// a test's refusals and registrations are its own).
    #[cfg(test)]
    pub(super) fn test(domain: super::in_process_tests::TestDomain) -> SharedRegistrations {
        Self::with_domain(AnyDomain::Test(domain))
    }

    fn with_domain(domain: AnyDomain) -> SharedRegistrations {
        let refuse_left = crate::settings::refused_registrations();
        SharedRegistrations(Mutex::new(Registrations {
            domain,
            cache: MrCache::new(CacheConfig::default()),
            handles: HashMap::new(),
            uncached: HashMap::new(),
            next_handle: 1,
            refuse_left,
        }))
    }

    /// The lock (a panic elsewhere cannot leave the bookkeeping in a state worse than losing
    /// a cached entry: keep serving).
    pub(super) fn lock(&self) -> MutexGuard<'_, Registrations> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Registrations {
    /// The shm domain (shm connections are set up with it); `None` for a verbs cache.
    pub(super) fn domain(&self) -> Option<&ShmDomain> {
        match &self.domain {
            AnyDomain::Shm(domain) => Some(domain),
            AnyDomain::Verbs(_) => None,
            #[cfg(test)]
            AnyDomain::Test(_) => None,
        }
    }

    /// Unit tests: the test domain, if this cache is in front of one.
    #[cfg(test)]
    pub(super) fn test_domain(&self) -> Option<&super::in_process_tests::TestDomain> {
        match &self.domain {
            AnyDomain::Test(domain) => Some(domain),
            _ => None,
        }
    }

    /// Unit tests: how many references the sockets hold.
    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.handles.len()
    }

    /// Unit tests: the next `count` registrations fail as if the domain were out of
    /// resources (the test knob's effect, for one cache).
    #[cfg(test)]
    pub(super) fn refuse_next(&mut self, count: u64) {
        self.refuse_left = count;
    }

    /// The verbs domain (rdma_cm set-up runs on it); `None` for the shm cache.
    pub(super) fn verbs_domain(&mut self) -> Option<&mut LoadedDomain> {
        match &mut self.domain {
            AnyDomain::Verbs(domain) => Some(domain),
            AnyDomain::Shm(_) => None,
            #[cfg(test)]
            AnyDomain::Test(_) => None,
        }
    }

    /// Verbs: applies the memory changes collected since the last lookup. False when the
    /// monitor is not running (nothing may then stay cached past its transfer).
    fn apply_memory_changes(&mut self) -> bool {
        let AnyDomain::Verbs(domain) = &mut self.domain else {
            return true;
        };
        let Ok(changes) = domain.take_memory_changes() else {
            return false;
        };
        for range in changes {
            for (handle, _) in self.cache.invalidate(&mut self.domain, range) {
                // Stale from now on: the session's later release of it is ignored.
                self.handles.retain(|_, (held, _)| *held != handle);
            }
        }
        true
    }

    /// A reference to a registration of `len` bytes at `addr` with `access`, for `owner`.
    pub(super) fn register(
        &mut self,
        owner: OwnerId,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<RegisteredRange, RegisterError> {
        if self.refuse_left > 0 {
            self.refuse_left -= 1;
            return Err(RegisterError::OutOfResources);
        }
        let range = MemRange { addr, len };
        let monitored = self.apply_memory_changes();
        let (handle, registration) = self.cache.get(&mut self.domain, owner, range, access)?;
        let id = MrHandleId(self.next_handle);
        self.next_handle += 1;
        self.handles.insert(id, (handle, owner));
        if let AnyDomain::Verbs(domain) = &self.domain {
            if !monitored || domain.is_watched(registration.lkey) != Some(true) {
                self.uncached.insert(id, range);
            }
        }
        Ok(RegisteredRange {
            range,
            registration,
            handle: id,
        })
    }

    /// Drops the references the session released (unknown ids are ignored: their owner
    /// already closed).
    pub(super) fn release(&mut self, ids: &[MrHandleId]) {
        for id in ids {
            if let Some((handle, _)) = self.handles.remove(id) {
                self.cache.release(&mut self.domain, handle);
            }
            if let Some(range) = self.uncached.remove(id) {
                for (handle, _) in self.cache.invalidate(&mut self.domain, range) {
                    self.handles.retain(|_, (held, _)| *held != handle);
                }
            }
        }
    }

    /// Drops every reference `owner` still holds (its socket is closing).
    pub(super) fn release_owner(&mut self, owner: OwnerId) {
        self.handles.retain(|_, (_, held_by)| *held_by != owner);
        self.cache.release_owner(&mut self.domain, owner);
        let handles = &self.handles;
        let mut gone = Vec::new();
        self.uncached.retain(|id, range| {
            let held = handles.contains_key(id);
            if !held {
                gone.push(*range);
            }
            held
        });
        for range in gone {
            for (handle, _) in self.cache.invalidate(&mut self.domain, range) {
                self.handles.retain(|_, (held, _)| *held != handle);
            }
        }
    }
}
