//! Test support for the registration cache, shared by its unit tests, the model-based
//! proptest, the benches and the cargo-fuzz target: a recording [`FakeDomain`] that checks
//! how the cache drives it, and [`check_ops`], which runs an operation sequence against the
//! cache and a naive reference model and **panics** at the first rule the cache breaks.
//! Not part of the switch's API; nothing here is reachable from peer bytes.
//!
//! The fuzz target is one line:
//! `fuzz_target!(|data: &[u8]| { switch::mr_cache::fuzzing::run_ops(data); });`
//! and a corpus replay test calls [`run_ops`] on every corpus file.

use alloc::collections::BTreeMap;
use alloc::vec::Vec;

use san_api::{
    Access, Capabilities, LocalKey, MemRange, RegisterError, Registration, RemoteKey, SanDomain,
};

use super::{remote_part, CacheConfig, CacheStats, EntryInfo, MrCache, MrHandle, OwnerId};

/// One call the cache made on the domain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DomainCall {
    /// `register(range, access)`.
    Register(MemRange, Access),
    /// `deregister(lkey)`.
    Deregister(LocalKey),
    /// `revoke_remote(lkey)`.
    RevokeRemote(LocalKey),
    /// `expose_remote(lkey, access)`.
    ExposeRemote(LocalKey, Access),
}

/// What the fake domain holds for one live registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FakeRegistration {
    /// Registered range.
    pub range: MemRange,
    /// Registered rights.
    pub access: Access,
    /// The rkey peers may use now (`None` while revoked).
    pub rkey: Option<RemoteKey>,
    /// The remote rights that rkey grants.
    pub exposed: Access,
    /// Order of registration (1 for the first): tells registrations made before an
    /// invalidation from later ones.
    pub serial: u64,
}

/// A protection domain in memory: records every call, fails on demand (one-shot failures,
/// an optional pinning limit) and notes every use that breaks the `SanDomain` contract
/// (deregistering an unknown key, revoking what is not exposed, exposing twice...) in
/// `misuse`. Keys are never reused, so a revoked or deregistered rkey never works again.
#[derive(Clone, Debug, Default)]
pub struct FakeDomain {
    /// Every call, in order.
    pub calls: Vec<DomainCall>,
    /// Live registrations by lkey.
    pub live: BTreeMap<LocalKey, FakeRegistration>,
    /// The next `register` fails with this.
    pub fail_register: Option<RegisterError>,
    /// The next `deregister` fails with this (and the registration stays).
    pub fail_deregister: Option<RegisterError>,
    /// The next `revoke_remote` fails with this (and the rkey stays valid).
    pub fail_revoke: Option<RegisterError>,
    /// The next `expose_remote` fails with this.
    pub fail_expose: Option<RegisterError>,
    /// `register` fails with `OutOfResources` when the pinned bytes would exceed this.
    pub pinned_limit: Option<u64>,
    /// Contract violations by the caller.
    pub misuse: Vec<&'static str>,
    /// Successful registrations so far (the last serial handed out).
    pub registrations: u64,
    /// Every `memory_invalidated(range)` callback, with how many entries `calls` held when
    /// it came (tells what the cache had deregistered by then).
    pub invalidated: Vec<(MemRange, usize)>,
    next_key: u32,
}

impl FakeDomain {
    /// An empty domain that never fails.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes registered now.
    pub fn pinned_bytes(&self) -> u64 {
        self.live
            .values()
            .map(|registration| registration.range.len)
            .sum()
    }

    /// True when a peer presenting `rkey` for `range` with `access` would be let in, as a
    /// provider checks an incoming RDMA read or write.
    pub fn accepts(&self, rkey: RemoteKey, range: MemRange, access: Access) -> bool {
        self.live.values().any(|registration| {
            registration.rkey == Some(rkey)
                && registration.range.contains(&range)
                && registration.exposed.contains(access)
        })
    }

    /// How many calls so far satisfy `matches`.
    pub fn count_calls(&self, matches: impl Fn(&DomainCall) -> bool) -> usize {
        self.calls.iter().filter(|call| matches(call)).count()
    }

    fn fresh_key(&mut self) -> u32 {
        self.next_key += 1;
        self.next_key
    }
}

impl SanDomain for FakeDomain {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rdma_read: true,
            write_with_imm: true,
            read_sink_needs_remote_write: false,
            active_side_sends_first: false,
            max_slot_size: 4096,
            max_slots: 64,
            max_inline: 64,
            max_rdma_len: 1 << 30,
        }
    }

    fn register(&mut self, range: MemRange, access: Access) -> Result<Registration, RegisterError> {
        self.calls.push(DomainCall::Register(range, access));
        if let Some(error) = self.fail_register.take() {
            return Err(error);
        }
        if range.len == 0 || range.addr.checked_add(range.len).is_none() {
            self.misuse.push("register of an empty or wrapping range");
            return Err(RegisterError::BadAddress);
        }
        if self
            .pinned_limit
            .is_some_and(|limit| self.pinned_bytes() + range.len > limit)
        {
            return Err(RegisterError::OutOfResources);
        }
        let lkey = LocalKey(self.fresh_key());
        let rkey = access.is_remote().then(|| RemoteKey(self.fresh_key()));
        self.registrations += 1;
        self.live.insert(
            lkey,
            FakeRegistration {
                range,
                access,
                rkey,
                exposed: remote_part(access),
                serial: self.registrations,
            },
        );
        Ok(Registration {
            range,
            access,
            lkey,
            rkey,
        })
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        self.calls.push(DomainCall::Deregister(lkey));
        if let Some(error) = self.fail_deregister.take() {
            return Err(error);
        }
        if self.live.remove(&lkey).is_none() {
            self.misuse.push("deregister of an unknown key");
            return Err(RegisterError::UnknownKey);
        }
        Ok(())
    }

    fn revoke_remote(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        self.calls.push(DomainCall::RevokeRemote(lkey));
        if let Some(error) = self.fail_revoke.take() {
            return Err(error);
        }
        let Some(registration) = self.live.get_mut(&lkey) else {
            self.misuse.push("revoke of an unknown key");
            return Err(RegisterError::UnknownKey);
        };
        if registration.rkey.is_none() {
            self.misuse
                .push("revoke of a registration that is not exposed");
        }
        registration.rkey = None;
        registration.exposed = Access::NONE;
        Ok(())
    }

    fn expose_remote(
        &mut self,
        lkey: LocalKey,
        access: Access,
    ) -> Result<RemoteKey, RegisterError> {
        self.calls.push(DomainCall::ExposeRemote(lkey, access));
        if let Some(error) = self.fail_expose.take() {
            return Err(error);
        }
        let rkey = RemoteKey(self.fresh_key());
        let Some(registration) = self.live.get_mut(&lkey) else {
            self.misuse.push("expose of an unknown key");
            return Err(RegisterError::UnknownKey);
        };
        if registration.rkey.is_some() {
            self.misuse.push("expose of a registration already exposed");
        }
        if !access.is_remote() || !registration.access.contains(access) {
            self.misuse
                .push("expose with rights the registration lacks");
            return Err(RegisterError::Unsupported);
        }
        registration.rkey = Some(rkey);
        registration.exposed = access;
        Ok(rkey)
    }

    fn memory_invalidated(&mut self, range: MemRange) {
        self.invalidated.push((range, self.calls.len()));
    }
}

/// One step of an operation sequence. Fields are raw and mapped into a small address window
/// (so ranges overlap, contain each other and share starts often) by [`check_ops`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// `get` by owner `owner % 3` of `[BASE + (start % 64) * 256, + (len % 32 + 1) * 256)`
    /// with rights `access & 7`.
    Get {
        /// Owner selector.
        owner: u8,
        /// Start selector.
        start: u8,
        /// Length selector.
        len: u8,
        /// Rights bits.
        access: u8,
    },
    /// `release` of the held handle number `pick % held`.
    Release {
        /// Handle selector.
        pick: u8,
    },
    /// `release` of a handle already stale (double release, invalidated, owner-released).
    ReleaseStale {
        /// Handle selector.
        pick: u8,
    },
    /// `invalidate` of `[BASE + (start % 1536) * 16, + (len % 512 + 1) * 16)`: byte-level
    /// partial overlaps of the `Get` ranges.
    Invalidate {
        /// Start selector.
        start: u16,
        /// Length selector.
        len: u16,
    },
    /// `release_owner` of owner `owner % 3`.
    ReleaseOwner {
        /// Owner selector.
        owner: u8,
    },
    /// The domain's next `register` fails (with `OutOfResources` or `BadAddress`).
    FailNextRegister {
        /// Which error.
        out_of_resources: bool,
    },
    /// The domain's next `expose_remote` fails.
    FailNextExpose,
}

/// Base of the address window the ops use.
const BASE: u64 = 0x10_0000;

/// Decodes `bytes` into a cache configuration and an operation sequence, and runs
/// [`check_ops`] on them. Any input is valid; the function panics only when the cache
/// breaks a rule. This is the body of the cache fuzz target.
pub fn run_ops(bytes: &[u8]) -> CacheStats {
    let mut input = bytes.iter().copied();
    let mut next = || input.next();
    let config = CacheConfig {
        max_entries: 1 + usize::from(next().unwrap_or(3) % 8),
        max_bytes: (1 + u64::from(next().unwrap_or(15) % 32)) * 1024,
    };
    let mut ops = Vec::new();
    while let Some(tag) = next() {
        let op = match tag % 8 {
            0..=2 => {
                let (Some(who), Some(start), Some(len)) = (next(), next(), next()) else {
                    break;
                };
                Op::Get {
                    owner: who >> 3,
                    access: who & 7,
                    start,
                    len,
                }
            }
            3 => Op::Release { pick: tag >> 3 },
            4 => Op::ReleaseStale { pick: tag >> 3 },
            5 => {
                let (Some(a), Some(b), Some(c), Some(d)) = (next(), next(), next(), next()) else {
                    break;
                };
                Op::Invalidate {
                    start: u16::from_le_bytes([a, b]),
                    len: u16::from_le_bytes([c, d]),
                }
            }
            6 => Op::ReleaseOwner { owner: tag >> 3 },
            _ if tag & 8 == 0 => Op::FailNextRegister {
                out_of_resources: tag & 16 != 0,
            },
            _ => Op::FailNextExpose,
        };
        ops.push(op);
    }
    check_ops(config, &ops)
}

/// A reference the model knows to be held.
#[derive(Clone, Copy, Debug)]
struct Held {
    handle: MrHandle,
    owner: OwnerId,
    access: Access,
    registration: Registration,
}

/// The reference model: what the caller holds and what happened, checked by naive scans.
struct Model {
    config: CacheConfig,
    held: Vec<Held>,
    stale: Vec<MrHandle>,
    /// Invalidated ranges with the domain's registration count at that moment: no
    /// registration with a serial up to that count and overlapping the range may be handed
    /// out afterwards.
    invalidations: Vec<(MemRange, u64)>,
    /// Registrations whose re-exposure failed: never to be handed out again.
    doomed: Vec<LocalKey>,
}

/// Most stale handles remembered for `ReleaseStale` (older ones are forgotten).
const STALE_MEMORY: usize = 256;

impl Model {
    fn retire(&mut self, handle: MrHandle) {
        if self.stale.len() == STALE_MEMORY {
            self.stale.remove(0);
        }
        self.stale.push(handle);
    }

    /// The registrations that could serve `get(owner, range, access)` under the cache's
    /// rules (containment, or the exact range for remote access; rights; one exposed-to
    /// owner; not doomed).
    fn usable(
        &self,
        domain: &FakeDomain,
        owner: OwnerId,
        range: MemRange,
        access: Access,
    ) -> Vec<LocalKey> {
        let remote_access = remote_part(access);
        domain
            .live
            .iter()
            .filter(|(lkey, registration)| {
                let remote_holders = || {
                    self.held.iter().filter(move |held| {
                        held.registration.lkey == **lkey && held.access.is_remote()
                    })
                };
                !self.doomed.contains(lkey)
                    && if access.is_remote() {
                        registration.range == range
                    } else {
                        registration.range.contains(&range)
                    }
                    && registration.access.contains(access)
                    && (!access.is_remote()
                        || remote_holders().next().is_none()
                        || (remote_holders().all(|held| held.owner == owner)
                            && registration.exposed.contains(remote_access)))
            })
            .map(|(&lkey, _)| lkey)
            .collect()
    }
}

/// Runs `ops` against a fresh cache with `config` and the reference model, checking after
/// every step that the cache never hands out a registration overlapping a range invalidated
/// after it was registered, hits whenever a usable registration is cached, counts references
/// exactly, exposes a registration to peers exactly while a remote reference is held, holds
/// exactly the registrations the domain holds (no leak either way), respects its bounds
/// unless everything is referenced, treats stale handles as no-ops, never misuses the domain
/// and passes [`MrCache::check_invariants`]. Ends by releasing every owner and invalidating
/// everything, after which the domain must hold nothing. Panics at the first broken rule;
/// returns the final counters (so callers can tell which paths a sequence exercised).
pub fn check_ops(config: CacheConfig, ops: &[Op]) -> CacheStats {
    let mut cache = MrCache::new(config);
    let mut domain = FakeDomain::new();
    let mut model = Model {
        config,
        held: Vec::new(),
        stale: Vec::new(),
        invalidations: Vec::new(),
        doomed: Vec::new(),
    };
    for (step, &op) in ops.iter().enumerate() {
        apply(&mut cache, &mut domain, &mut model, op, step);
        check_state(&cache, &domain, &model, step);
    }
    for owner in 0..3 {
        cache.release_owner(&mut domain, OwnerId(owner));
    }
    model.held.clear();
    let left_over = cache.invalidate(&mut domain, MemRange::new(0, u64::MAX));
    assert!(
        left_over.is_empty(),
        "references survived release_owner of every owner"
    );
    assert!(
        domain.live.is_empty(),
        "registrations leaked past a full invalidation"
    );
    check_state(&cache, &domain, &model, ops.len());
    cache.stats()
}

fn apply(cache: &mut MrCache, domain: &mut FakeDomain, model: &mut Model, op: Op, step: usize) {
    match op {
        Op::Get {
            owner,
            start,
            len,
            access,
        } => {
            let owner = OwnerId(u64::from(owner % 3));
            let access = Access::from_bits_truncate(access);
            // Remote hits need the exact range: remote requests come from a few buffers, as
            // the rendezvous sends of a program reusing its buffers do.
            let (start, len) = if access.is_remote() {
                (start % 8, len % 4)
            } else {
                (start, len)
            };
            let range = MemRange::new(
                BASE + u64::from(start % 64) * 256,
                (u64::from(len % 32) + 1) * 256,
            );
            get(cache, domain, model, owner, range, access, step);
        }
        Op::Release { pick } => {
            if model.held.is_empty() {
                return;
            }
            let held = model.held.swap_remove(usize::from(pick) % model.held.len());
            let releases = cache.stats().releases;
            cache.release(domain, held.handle);
            assert_eq!(
                cache.stats().releases,
                releases + 1,
                "step {step}: release not counted"
            );
            model.retire(held.handle);
        }
        Op::ReleaseStale { pick } => {
            if model.stale.is_empty() {
                return;
            }
            let handle = model.stale[usize::from(pick) % model.stale.len()];
            let (before, calls) = (cache.stats(), domain.calls.len());
            cache.release(domain, handle);
            let after = cache.stats();
            assert_eq!(
                after.stale_releases,
                before.stale_releases + 1,
                "step {step}: stale release not counted"
            );
            assert_eq!(
                after.releases, before.releases,
                "step {step}: a stale release dropped a reference"
            );
            assert_eq!(
                domain.calls.len(),
                calls,
                "step {step}: a stale release touched the domain"
            );
        }
        Op::Invalidate { start, len } => {
            let range = MemRange::new(
                BASE + u64::from(start % 1536) * 16,
                (u64::from(len % 512) + 1) * 16,
            );
            let callbacks_before = domain.invalidated.len();
            let mut affected = cache.invalidate(domain, range);
            assert_eq!(
                domain.invalidated.get(callbacks_before..),
                Some(&[(range, domain.calls.len())][..]),
                "step {step}: not exactly one memory_invalidated callback, last, with the range"
            );
            let (gone, kept): (Vec<Held>, Vec<Held>) = model
                .held
                .iter()
                .partition(|held| held.registration.range.overlaps(&range));
            assert_eq!(
                affected.len(),
                gone.len(),
                "step {step}: invalidation returned the wrong references"
            );
            for held in &gone {
                let position = affected
                    .iter()
                    .position(|&(handle, owner)| handle == held.handle && owner == held.owner);
                let Some(position) = position else {
                    panic!("step {step}: invalidation did not report held reference {held:?}");
                };
                affected.swap_remove(position);
                model.retire(held.handle);
            }
            model.held = kept;
            model.invalidations.push((range, domain.registrations));
            assert!(
                domain
                    .live
                    .values()
                    .all(|registration| !registration.range.overlaps(&range)),
                "step {step}: an overlapping registration survived invalidation"
            );
        }
        Op::ReleaseOwner { owner } => {
            let owner = OwnerId(u64::from(owner % 3));
            let dropped = cache.release_owner(domain, owner);
            let (gone, kept): (Vec<Held>, Vec<Held>) =
                model.held.iter().partition(|held| held.owner == owner);
            assert_eq!(
                dropped,
                gone.len(),
                "step {step}: release_owner dropped the wrong number"
            );
            for held in gone {
                model.retire(held.handle);
            }
            model.held = kept;
        }
        Op::FailNextRegister { out_of_resources } => {
            domain.fail_register = Some(if out_of_resources {
                RegisterError::OutOfResources
            } else {
                RegisterError::BadAddress
            });
        }
        Op::FailNextExpose => domain.fail_expose = Some(RegisterError::OutOfResources),
    }
}

fn get(
    cache: &mut MrCache,
    domain: &mut FakeDomain,
    model: &mut Model,
    owner: OwnerId,
    range: MemRange,
    access: Access,
    step: usize,
) {
    let usable = model.usable(domain, owner, range, access);
    let (before, calls, serial) = (cache.stats(), domain.calls.len(), domain.registrations);
    let (register_armed, expose_armed) =
        (domain.fail_register.is_some(), domain.fail_expose.is_some());
    let result = cache.get(domain, owner, range, access);
    let after = cache.stats();
    assert_eq!(after.gets, before.gets + 1, "step {step}: get not counted");

    let expose_failed = expose_armed && domain.fail_expose.is_none();
    if expose_failed {
        let failed = domain.calls[calls..].iter().find_map(|call| match *call {
            DomainCall::ExposeRemote(lkey, _) => Some(lkey),
            _ => None,
        });
        let Some(failed) = failed else {
            panic!("step {step}: an expose failure was consumed without an expose call");
        };
        model.doomed.push(failed);
    }
    let registered = domain.registrations > serial;
    match result {
        Ok((handle, registration)) => {
            assert!(
                registration.range.contains(&range) && registration.access.contains(access),
                "step {step}: {registration:?} does not serve {range:?} {access:?}"
            );
            let Some(held_by_domain) = domain.live.get(&registration.lkey) else {
                panic!("step {step}: handed out {registration:?}, which the domain does not hold");
            };
            assert_eq!(
                (held_by_domain.range, held_by_domain.access),
                (registration.range, registration.access),
                "step {step}: registration differs from the domain's"
            );
            for &(invalidated, registrations_then) in &model.invalidations {
                assert!(
                    held_by_domain.serial > registrations_then || !invalidated.overlaps(&registration.range),
                    "step {step}: handed out {registration:?} after {invalidated:?} was invalidated"
                );
            }
            if access.is_remote() {
                let Some(rkey) = registration.rkey else {
                    panic!("step {step}: remote get without an rkey");
                };
                assert!(
                    domain.accepts(rkey, range, remote_part(access)),
                    "step {step}: the peer cannot use the rkey handed out"
                );
            } else {
                assert_eq!(
                    registration.rkey, None,
                    "step {step}: local get carries an rkey"
                );
            }
            if registered {
                assert_eq!(
                    after.misses,
                    before.misses + 1,
                    "step {step}: miss not counted"
                );
                assert!(
                    held_by_domain.serial > serial,
                    "step {step}: registered but handed out an old one"
                );
            } else {
                assert_eq!(after.hits, before.hits + 1, "step {step}: hit not counted");
                assert!(
                    usable.contains(&registration.lkey),
                    "step {step}: hit on {registration:?}, which cannot serve this get"
                );
            }
            assert!(
                usable.is_empty() || expose_failed || !registered,
                "step {step}: registered anew although {usable:?} could serve {range:?} {access:?}"
            );
            assert!(
                model.held.iter().all(|held| held.handle != handle)
                    && !model.stale.contains(&handle),
                "step {step}: handle {handle:?} aliases another reference"
            );
            model.held.push(Held {
                handle,
                owner,
                access,
                registration,
            });
        }
        Err(error) => {
            assert!(
                register_armed,
                "step {step}: get failed ({error}) without an injected failure"
            );
            assert_eq!(
                after.registration_failures,
                before.registration_failures + 1,
                "step {step}: failure not counted"
            );
            assert!(
                domain
                    .live
                    .values()
                    .all(|registration| registration.serial <= serial),
                "step {step}: a failed get left a registration behind"
            );
        }
    }
}

fn check_state(cache: &MrCache, domain: &FakeDomain, model: &Model, step: usize) {
    if let Err(violation) = cache.check_invariants() {
        panic!("step {step}: {violation}");
    }
    assert!(
        domain.misuse.is_empty(),
        "step {step}: the cache misused the domain: {:?}",
        domain.misuse
    );
    let stats = cache.stats();
    assert_eq!(
        stats.gets,
        stats.hits + stats.misses,
        "step {step}: gets != hits + misses"
    );
    assert_eq!(
        stats.entries,
        domain.live.len(),
        "step {step}: the cache and the domain disagree on how many"
    );
    assert_eq!(
        stats.bytes_registered,
        domain.pinned_bytes(),
        "step {step}: byte count out of date"
    );

    let entries: Vec<EntryInfo> = cache.entries().collect();
    for entry in &entries {
        let lkey = entry.registration.lkey;
        let Some(held_by_domain) = domain.live.get(&lkey) else {
            panic!("step {step}: cached {entry:?} is unknown to the domain");
        };
        assert_eq!(
            (held_by_domain.range, held_by_domain.access),
            (entry.registration.range, entry.registration.access),
            "step {step}: cached entry differs from the domain's registration"
        );
        let holders = model
            .held
            .iter()
            .filter(|held| held.registration.lkey == lkey);
        let remote_holders: Vec<&Held> = holders
            .clone()
            .filter(|held| held.access.is_remote())
            .collect();
        assert_eq!(
            entry.refs as usize,
            holders.count(),
            "step {step}: wrong reference count on {entry:?}"
        );
        assert_eq!(
            entry.remote_refs as usize,
            remote_holders.len(),
            "step {step}: wrong remote count"
        );
        assert_eq!(
            held_by_domain.rkey.is_some(),
            !remote_holders.is_empty(),
            "step {step}: {entry:?} exposed to peers iff a remote reference is held: broken"
        );
        assert_eq!(
            entry.registration.rkey, held_by_domain.rkey,
            "step {step}: rkey out of date"
        );
        assert_eq!(
            entry.exposed_to,
            remote_holders.first().map(|held| held.owner),
            "step {step}: exposed to the wrong owner"
        );
        assert!(
            remote_holders
                .iter()
                .all(|held| Some(held.owner) == entry.exposed_to),
            "step {step}: one registration exposed to two owners"
        );
    }
    for held in &model.held {
        assert_eq!(
            cache.registration(held.handle),
            Some(held.registration),
            "step {step}: a held handle no longer names its registration"
        );
    }
    for &handle in &model.stale {
        assert_eq!(
            cache.registration(handle),
            None,
            "step {step}: a stale handle still resolves"
        );
    }
    let over =
        stats.entries > model.config.max_entries || stats.bytes_registered > model.config.max_bytes;
    assert!(
        !over || entries.iter().all(|entry| entry.refs > 0),
        "step {step}: over a bound with idle entries left"
    );
}
