//! The negative-capability cache: "plain server" answers per (address, port), remembered for a
//! while so that repeated connections to a plain server skip even the listener probe
//! ([`crate::discovery::probe_listener`]). Lock-free.

use core::hash::{Hash, Hasher};
use core::sync::atomic::{AtomicU64, Ordering};
use std::net::SocketAddr;
use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use crate::discovery::{canonical_addr, probe_listener_checked};

/// Configuration of a [`NegativeCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NegativeCacheConfig {
    /// How long a "plain server" answer is trusted. A server restarted with sandirect within
    /// this time is treated as plain until the entry expires.
    pub ttl: Duration,
    /// Maximum number of entries (rounded up to a multiple of the associativity, 4, and to a
    /// power of two). When full, the entry closest to expiry in the set is replaced.
    pub capacity: usize,
}

impl Default for NegativeCacheConfig {
    fn default() -> Self {
        NegativeCacheConfig {
            ttl: Duration::from_secs(10),
            capacity: 1024,
        }
    }
}

/// The answer of [`NegativeCache::probe`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PeerKind {
    /// A listener marker exists: the server is preloaded.
    Preloaded,
    /// No marker in this network namespace, but a marker file in the shared segment
    /// directory: the server is preloaded in another network namespace.
    PreloadedThroughDirectory,
    /// No marker (the answer is now cached).
    Plain,
    /// The cache said plain; no probe was made.
    PlainCached,
    /// No marker of ours, but the listener on this host is preloaded by another user (not
    /// cached: the answer must stay this precise).
    OtherUser,
    /// The probe could not be made (no descriptor for it): nothing is known or cached.
    Unknown,
}

/// Ways per set.
const WAYS: usize = 4;
/// Bits of an entry holding the deadline (milliseconds since the cache was created: 34 years).
const DEADLINE_BITS: u32 = 40;
const DEADLINE_MASK: u64 = (1 << DEADLINE_BITS) - 1;

/// "Plain server" answers per (address, port), each with an expiry.
///
/// Lock-free and allocation-free after construction: a set-associative table of `AtomicU64`
/// entries, each packing a 24-bit fingerprint of the address (beside the bits that chose the
/// set) and a 40-bit deadline, so an entry is read and replaced in one atomic access and can
/// never be seen torn. The price of fingerprints is a rare false "plain" for an address that
/// shares set and fingerprint with a cached one (about 4 in 2^24 per lookup in a full set):
/// that connection stays on TCP, which is always correct. Concurrent inserts into one set may
/// overwrite each other; the loser is probed again next time.
#[derive(Debug)]
pub struct NegativeCache {
    entries: Box<[AtomicU64]>,
    set_mask: usize,
    ttl_ms: u64,
    epoch: Instant,
}

impl NegativeCache {
    /// An empty cache.
    pub fn new(config: NegativeCacheConfig) -> NegativeCache {
        let sets = config.capacity.div_ceil(WAYS).max(1).next_power_of_two();
        let ttl_ms = u64::try_from(config.ttl.as_millis())
            .unwrap_or(u64::MAX)
            .min(DEADLINE_MASK / 2);
        NegativeCache {
            entries: (0..sets * WAYS).map(|_| AtomicU64::new(0)).collect(),
            set_mask: sets - 1,
            ttl_ms,
            epoch: Instant::now(),
        }
    }

    /// Number of entries the cache can hold.
    pub fn capacity(&self) -> usize {
        self.entries.len()
    }

    fn now_ms(&self, now: Instant) -> u64 {
        let elapsed = now.saturating_duration_since(self.epoch).as_millis();
        u64::try_from(elapsed)
            .unwrap_or(u64::MAX)
            .min(DEADLINE_MASK)
    }

    /// The set's entries and the fingerprint of `server`.
    fn locate(&self, server: SocketAddr) -> (&[AtomicU64], u64) {
        let server = canonical_addr(server);
        // SipHash with fixed keys: deterministic, allocation-free. Adversarial collisions only
        // cost extra probes.
        let mut hasher = std::hash::DefaultHasher::new();
        server.ip().hash(&mut hasher);
        server.port().hash(&mut hasher);
        let hash = hasher.finish();
        let set = (hash as usize) & self.set_mask;
        let fingerprint = (hash >> DEADLINE_BITS).max(1);
        (&self.entries[set * WAYS..(set + 1) * WAYS], fingerprint)
    }

    /// Whether `server` is known to be plain now.
    pub fn is_plain(&self, server: SocketAddr) -> bool {
        self.is_plain_at(server, Instant::now())
    }

    /// [`is_plain`](Self::is_plain) at a given time (for tests and for callers that already
    /// read the clock).
    pub fn is_plain_at(&self, server: SocketAddr, now: Instant) -> bool {
        let (set, fingerprint) = self.locate(server);
        let now = self.now_ms(now);
        set.iter().any(|entry| {
            let value = entry.load(Ordering::Relaxed);
            value >> DEADLINE_BITS == fingerprint && value & DEADLINE_MASK > now
        })
    }

    /// Records that `server` has no marker.
    pub fn mark_plain(&self, server: SocketAddr) {
        self.mark_plain_at(server, Instant::now());
    }

    /// [`mark_plain`](Self::mark_plain) at a given time.
    pub fn mark_plain_at(&self, server: SocketAddr, now: Instant) {
        let (set, fingerprint) = self.locate(server);
        let now = self.now_ms(now);
        let deadline = now.saturating_add(self.ttl_ms).min(DEADLINE_MASK);
        let value = fingerprint << DEADLINE_BITS | deadline;
        // Refresh our own entry if present, else take the entry closest to (or past) expiry.
        let victim = set
            .iter()
            .find(|entry| entry.load(Ordering::Relaxed) >> DEADLINE_BITS == fingerprint)
            .or_else(|| {
                set.iter()
                    .min_by_key(|entry| entry.load(Ordering::Relaxed) & DEADLINE_MASK)
            });
        if let Some(entry) = victim {
            entry.store(value, Ordering::Relaxed);
        }
    }

    /// Drops the entry of `server`, if any (e.g. after learning it became preloaded).
    pub fn forget(&self, server: SocketAddr) {
        let (set, fingerprint) = self.locate(server);
        for entry in set {
            let value = entry.load(Ordering::Relaxed);
            if value >> DEADLINE_BITS == fingerprint {
                // Lose gracefully to a concurrent replacement.
                let _ = entry.compare_exchange(value, 0, Ordering::Relaxed, Ordering::Relaxed);
            }
        }
    }

    /// The client's whole discovery step: the cache, else [`probe_listener_checked`], then the
    /// marker files of the segment directory `dir` when given (caching a negative answer).
    pub fn probe(&self, server: SocketAddr, dir: Option<BorrowedFd<'_>>) -> PeerKind {
        if self.is_plain(server) {
            return PeerKind::PlainCached;
        }
        let Some(preloaded) = probe_listener_checked(server) else {
            return PeerKind::Unknown;
        };
        if preloaded {
            PeerKind::Preloaded
        } else if crate::discovery::preloaded_listener_of_another_user(server).is_some() {
            PeerKind::OtherUser
        } else if dir.is_some_and(|dir| crate::discovery::probe_listener_in_dir(dir, server)) {
            PeerKind::PreloadedThroughDirectory
        } else {
            self.mark_plain(server);
            PeerKind::Plain
        }
    }
}
