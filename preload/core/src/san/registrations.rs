//! The process-wide memory registrations of the SAN path: one `ShmDomain` and one
//! [`MrCache`] in front of it, shared by every SAN socket of the process (a registration
//! belongs to the protection domain, not to a connection).
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

use san_api::{Access, MemRange, RegisterError};
use san_shm::ShmDomain;
use switch::mr_cache::{CacheConfig, MrCache, MrHandle, OwnerId};
use switch::session::{MrHandleId, RegisteredRange};

/// The environment variable of the test knob (see the module docs).
pub(super) const REFUSE_REGISTRATIONS_ENV: &str = "SANDIRECT_SAN_REFUSE_REGISTRATIONS";

/// The domain, the cache and the handle table (see the module docs).
pub(super) struct Registrations {
    domain: ShmDomain,
    cache: MrCache,
    handles: HashMap<MrHandleId, (MrHandle, OwnerId)>,
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
        let refuse_left = std::env::var(REFUSE_REGISTRATIONS_ENV)
            .ok()
            .and_then(|value| value.trim().parse().ok())
            .unwrap_or(0);
        SharedRegistrations(Mutex::new(Registrations {
            domain,
            cache: MrCache::new(CacheConfig::default()),
            handles: HashMap::new(),
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
    /// The domain (connections are set up with it).
    pub(super) fn domain(&self) -> &ShmDomain {
        &self.domain
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
        let (handle, registration) = self.cache.get(&mut self.domain, owner, range, access)?;
        let id = MrHandleId(self.next_handle);
        self.next_handle += 1;
        self.handles.insert(id, (handle, owner));
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
        }
    }

    /// Drops every reference `owner` still holds (its socket is closing).
    pub(super) fn release_owner(&mut self, owner: OwnerId) {
        self.handles.retain(|_, (_, held_by)| *held_by != owner);
        self.cache.release_owner(&mut self.domain, owner);
    }
}
