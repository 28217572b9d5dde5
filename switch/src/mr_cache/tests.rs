//! Unit tests of the registration cache, one spec rule each, against the recording
//! [`FakeDomain`].

use alloc::vec::Vec;

use super::fuzzing::{run_ops, DomainCall, FakeDomain};
use super::*;

const A: OwnerId = OwnerId(1);
const B: OwnerId = OwnerId(2);
const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const LOCAL: Access = Access::NONE;

fn roomy() -> MrCache {
    MrCache::new(CacheConfig {
        max_entries: 64,
        max_bytes: 1 << 30,
    })
}

fn page(n: u64) -> MemRange {
    MemRange::new(0x10_0000 + n * 4 * KIB, 4 * KIB)
}

fn registers(domain: &FakeDomain) -> usize {
    domain.count_calls(|call| matches!(call, DomainCall::Register(..)))
}

fn deregistered(domain: &FakeDomain) -> Vec<LocalKey> {
    domain
        .calls
        .iter()
        .filter_map(|call| match *call {
            DomainCall::Deregister(lkey) => Some(lkey),
            _ => None,
        })
        .collect()
}

/// `get` that must succeed, checking the invariants afterwards.
fn take(
    cache: &mut MrCache,
    domain: &mut FakeDomain,
    owner: OwnerId,
    range: MemRange,
    access: Access,
) -> (MrHandle, Registration) {
    let taken = cache.get(domain, owner, range, access).unwrap();
    cache.check_invariants().unwrap();
    taken
}

/// A get immediately released: leaves an idle cached entry. Returns its lkey.
fn cache_idle(
    cache: &mut MrCache,
    domain: &mut FakeDomain,
    range: MemRange,
    access: Access,
) -> LocalKey {
    let (handle, registration) = take(cache, domain, A, range, access);
    cache.release(domain, handle);
    cache.check_invariants().unwrap();
    registration.lkey
}

#[test]
fn a_repeated_get_hits_and_registers_once() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let first = cache_idle(&mut cache, &mut domain, page(0), LOCAL);
    let (_, again) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    assert_eq!(again.lkey, first);
    assert_eq!(again.rkey, None);
    assert_eq!(registers(&domain), 1);
    let stats = cache.stats();
    assert_eq!(
        (stats.gets, stats.hits, stats.misses, stats.registrations),
        (2, 1, 1, 1)
    );
    assert_eq!((stats.entries, stats.bytes_registered), (1, 4 * KIB));
}

#[test]
fn a_hit_needs_an_entry_containing_the_whole_range() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let cached = MemRange::new(0x10_0000, 64 * KIB);
    let lkey = cache_idle(&mut cache, &mut domain, cached, LOCAL);
    for inside in [
        MemRange::new(0x10_0000, 1),
        MemRange::new(0x10_8000, 100),
        MemRange::new(0x10_F000, 4 * KIB),
        cached,
    ] {
        let (_, registration) = take(&mut cache, &mut domain, A, inside, LOCAL);
        assert_eq!(
            registration.lkey, lkey,
            "{inside:?} lies inside the cached entry"
        );
    }
    assert_eq!(registers(&domain), 1);
    let sticking_out = [
        MemRange::new(0x0F_FFFF, 2),           // one byte before
        MemRange::new(0x10_F000, 4 * KIB + 1), // one byte past the end
        MemRange::new(0x11_0000, 4 * KIB),     // adjacent, after
    ];
    for (n, outside) in sticking_out.into_iter().enumerate() {
        let (_, registration) = take(&mut cache, &mut domain, A, outside, LOCAL);
        assert_ne!(registration.lkey, lkey, "{outside:?} is not contained");
        assert_eq!(registers(&domain), 2 + n);
    }
}

#[test]
fn a_remote_request_exposes_exactly_its_range_never_a_containing_entry() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let big = MemRange::new(0x10_0000, 64 * MIB);
    let lkey = cache_idle(&mut cache, &mut domain, big, Access::REMOTE_READ);
    let part = MemRange::new(0x10_0000, 4 * MIB);
    let (_, registration) = take(&mut cache, &mut domain, A, part, Access::REMOTE_READ);
    assert_ne!(
        registration.lkey, lkey,
        "a new registration of just the part"
    );
    let rkey = registration.rkey.unwrap();
    assert!(domain.accepts(rkey, part, Access::REMOTE_READ));
    assert!(
        !domain.accepts(
            rkey,
            MemRange::new(part.end(), 4 * KIB),
            Access::REMOTE_READ
        ),
        "the peer's key must not reach past the buffer sent"
    );
    // A local request inside it still hits the big entry.
    let (_, local) = take(&mut cache, &mut domain, A, part, LOCAL);
    assert!(local.lkey == lkey || local.lkey == registration.lkey);
}

#[test]
fn more_rights_than_cached_is_a_miss_never_a_hit_with_missing_rights() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let read_only = cache_idle(&mut cache, &mut domain, page(0), LOCAL);

    let (writable, registration) = take(&mut cache, &mut domain, A, page(0), Access::LOCAL_WRITE);
    assert_ne!(registration.lkey, read_only);
    assert!(registration.access.contains(Access::LOCAL_WRITE));
    // The idle read-only entry can serve nothing the new one cannot: dropped at once.
    assert_eq!(deregistered(&domain), [read_only]);
    assert_eq!(cache.stats().subsumed, 1);
    cache.release(&mut domain, writable);

    // Fewer rights than cached is a hit.
    let (_, narrower) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    assert_eq!(narrower.lkey, registration.lkey);
    // Remote rights the entry lacks: a miss again.
    let (_, remote) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_READ);
    assert_ne!(remote.lkey, registration.lkey);
    assert!(remote.access.contains(Access::REMOTE_READ) && remote.rkey.is_some());
    assert_eq!(registers(&domain), 3);
    // The writable entry was referenced, so it was not subsumed.
    assert_eq!(cache.stats().entries, 2);
}

#[test]
fn only_idle_entries_inside_a_new_registration_with_fewer_rights_are_subsumed() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let sticking_out = cache_idle(
        &mut cache,
        &mut domain,
        MemRange::new(page(1).addr, 2 * 4 * KIB),
        LOCAL,
    );
    let more_rights = cache_idle(&mut cache, &mut domain, page(1), Access::REMOTE_READ);
    let (_, new) = take(&mut cache, &mut domain, A, page(1), Access::LOCAL_WRITE);
    assert!(
        deregistered(&domain).is_empty(),
        "dropped an entry serving requests the new one cannot"
    );
    assert!(domain.live.contains_key(&sticking_out) && domain.live.contains_key(&more_rights));
    assert_eq!((cache.stats().subsumed, cache.stats().entries), (0, 3));
    let (_, bigger) = take(
        &mut cache,
        &mut domain,
        A,
        MemRange::new(page(0).addr, 3 * 4 * KIB),
        Access::LOCAL_WRITE,
    );
    assert_eq!(
        deregistered(&domain),
        [sticking_out],
        "only the idle, covered, weaker entry goes"
    );
    assert_ne!(bigger.lkey, new.lkey);
}

#[test]
fn invalidation_drops_partial_overlaps_at_start_middle_and_end_and_nothing_else() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let first = MemRange::new(0x10_000, 0x1000);
    let second = MemRange::new(0x20_000, 0x1000);
    let third = MemRange::new(0x30_000, 0x1000);
    let neighbour = MemRange::new(0x31_000, 0x1000);
    let keys: Vec<LocalKey> = [first, second, third, neighbour]
        .into_iter()
        .map(|range| cache_idle(&mut cache, &mut domain, range, LOCAL))
        .collect();

    let cuts = [
        (MemRange::new(0x0F_000, 0x1001), keys[0]), // covers the first byte
        (MemRange::new(0x20_800, 0x10), keys[1]),   // inside
        (MemRange::new(0x30_FFF, 1), keys[2]),      // the last byte, touching the neighbour
    ];
    for (n, (cut, victim)) in cuts.into_iter().enumerate() {
        assert!(
            cache.invalidate(&mut domain, cut).is_empty(),
            "nothing was referenced"
        );
        cache.check_invariants().unwrap();
        assert_eq!(deregistered(&domain).len(), n + 1);
        assert_eq!(
            deregistered(&domain)[n],
            victim,
            "{cut:?} overlaps exactly one entry"
        );
        assert!(!domain.live.contains_key(&victim));
    }
    let stats = cache.stats();
    assert_eq!(
        (
            stats.invalidation_calls,
            stats.invalidated_entries,
            stats.entries
        ),
        (3, 3, 1)
    );

    let (_, survivor) = take(&mut cache, &mut domain, A, neighbour, LOCAL);
    assert_eq!(
        survivor.lkey, keys[3],
        "the adjacent entry does not overlap and must survive"
    );
    for range in [first, second, third] {
        let (_, fresh) = take(&mut cache, &mut domain, A, range, LOCAL);
        assert!(
            !keys.contains(&fresh.lkey),
            "an invalidated entry was handed out again"
        );
    }
}

#[test]
fn one_invalidation_drops_every_overlapping_entry_including_one_starting_far_below() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let big = cache_idle(&mut cache, &mut domain, MemRange::new(0, 16 * MIB), LOCAL);
    let small: Vec<LocalKey> = (0..4)
        .map(|n| cache_idle(&mut cache, &mut domain, page(n), Access::LOCAL_WRITE))
        .collect();
    let outside = cache_idle(
        &mut cache,
        &mut domain,
        MemRange::new(32 * MIB, 4 * KIB),
        LOCAL,
    );

    cache.invalidate(&mut domain, MemRange::new(page(1).addr, 2 * 4 * KIB));
    cache.check_invariants().unwrap();
    let mut gone = deregistered(&domain);
    gone.sort();
    assert_eq!(gone, [big, small[1], small[2]]);
    assert!(
        domain.live.contains_key(&small[0])
            && domain.live.contains_key(&small[3])
            && domain.live.contains_key(&outside)
    );
}

#[test]
fn every_invalidation_calls_the_provider_back_once_after_deregistering() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let hit = cache_idle(&mut cache, &mut domain, page(0), LOCAL);
    let (_held, held) = take(&mut cache, &mut domain, A, page(1), Access::REMOTE_READ);
    let kept = cache_idle(&mut cache, &mut domain, page(4), LOCAL);

    let cut = MemRange::new(page(0).addr + 16, 5 * KIB);
    cache.invalidate(&mut domain, cut);
    assert_eq!(domain.invalidated.len(), 1, "one callback per invalidation");
    let (range, calls_before) = domain.invalidated[0];
    assert_eq!(range, cut, "the callback names the invalidated range");
    assert_eq!(calls_before, domain.calls.len(), "no domain call after it");
    let mut gone = deregistered(&domain);
    gone.sort();
    assert_eq!(
        gone,
        [hit, held.lkey],
        "both overlapping entries went first"
    );
    assert!(domain.live.contains_key(&kept));

    // Nothing overlaps now, and an empty range overlaps nothing: still one callback each,
    // because the provider's own VA-keyed state may name the range regardless.
    let elsewhere = MemRange::new(60 * MIB, 4 * KIB);
    cache.invalidate(&mut domain, elsewhere);
    cache.invalidate(&mut domain, MemRange::new(page(4).addr, 0));
    assert_eq!(
        domain
            .invalidated
            .iter()
            .map(|&(range, _)| range)
            .collect::<Vec<_>>(),
        [cut, elsewhere, MemRange::new(page(4).addr, 0)]
    );
    assert_eq!(
        deregistered(&domain).len(),
        2,
        "no entry was dropped by those"
    );

    // The same holds on an empty cache (the early return).
    let (mut empty, mut fresh) = (roomy(), FakeDomain::new());
    empty.invalidate(&mut fresh, cut);
    assert_eq!(fresh.invalidated, [(cut, 0)]);
}

#[test]
fn invalidating_a_referenced_entry_deregisters_at_once_and_hands_back_its_references() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let (held_by_a, registration) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_WRITE);
    let (held_by_b, _) = take(&mut cache, &mut domain, B, page(0), LOCAL);
    let (unrelated, _) = take(&mut cache, &mut domain, B, page(5), LOCAL);
    let rkey = registration.rkey.unwrap();

    let mut affected = cache.invalidate(&mut domain, MemRange::new(page(0).addr + 8, 8));
    cache.check_invariants().unwrap();
    affected.sort_by_key(|&(_, owner)| owner);
    assert_eq!(affected, [(held_by_a, A), (held_by_b, B)]);
    assert_eq!(
        deregistered(&domain),
        [registration.lkey],
        "deregistered although still referenced"
    );
    assert!(!domain.accepts(rkey, page(0), Access::REMOTE_WRITE));
    assert_eq!(cache.registration(held_by_a), None);
    assert_eq!(cache.registration(held_by_b), None);
    assert!(cache.registration(unrelated).is_some());
    assert_eq!(cache.stats().invalidated_references, 2);

    // The sessions release their handles later: harmless, counted, no domain call.
    let calls = domain.calls.len();
    cache.release(&mut domain, held_by_a);
    cache.release(&mut domain, held_by_b);
    assert_eq!(domain.calls.len(), calls);
    assert_eq!(
        (cache.stats().stale_releases, cache.stats().releases),
        (2, 0)
    );

    let (_, fresh) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    assert_ne!(fresh.lkey, registration.lkey);
}

#[test]
fn releasing_a_remote_buffer_revokes_it_and_a_hit_re_exposes_it_with_a_new_rkey() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let (handle, first) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_WRITE);
    let old_rkey = first.rkey.unwrap();
    assert!(domain.accepts(old_rkey, page(0), Access::REMOTE_WRITE));

    cache.release(&mut domain, handle);
    assert_eq!(
        domain.calls.last(),
        Some(&DomainCall::RevokeRemote(first.lkey))
    );
    assert!(
        !domain.accepts(old_rkey, page(0), Access::REMOTE_WRITE),
        "the peer can still reach a released buffer"
    );
    assert!(
        domain.live.contains_key(&first.lkey),
        "the revoked buffer stays registered for reuse"
    );

    let (_, again) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_WRITE);
    assert_eq!(again.lkey, first.lkey);
    assert_eq!(registers(&domain), 1);
    let new_rkey = again.rkey.unwrap();
    assert_ne!(new_rkey, old_rkey);
    assert!(domain.accepts(new_rkey, page(0), Access::REMOTE_WRITE));
    assert!(
        !domain.accepts(old_rkey, page(0), Access::REMOTE_WRITE),
        "a stale descriptor works again"
    );
    let stats = cache.stats();
    assert_eq!(
        (stats.hits, stats.revocations, stats.re_exposures),
        (1, 1, 1)
    );
}

#[test]
fn exposure_ends_with_the_last_remote_reference_even_while_local_ones_remain() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let (remote1, registration) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_READ);
    let (remote2, shared) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_READ);
    let (local, local_view) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    let rkey = registration.rkey.unwrap();
    assert_eq!(
        shared.rkey,
        Some(rkey),
        "one owner's references share the exposure"
    );
    assert_eq!(
        local_view.rkey, None,
        "a local reference does not carry the rkey"
    );

    cache.release(&mut domain, remote1);
    assert!(
        domain.accepts(rkey, page(0), Access::REMOTE_READ),
        "revoked while a remote reference is held"
    );
    cache.release(&mut domain, remote2);
    assert!(!domain.accepts(rkey, page(0), Access::REMOTE_READ));
    assert_eq!(
        cache.registration(local).map(|r| r.lkey),
        Some(registration.lkey)
    );
    assert!(domain.live.contains_key(&registration.lkey));
    assert_eq!(cache.stats().revocations, 1);
    cache.check_invariants().unwrap();
}

#[test]
fn a_remote_exposure_is_never_shared_with_another_owner() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let (a_handle, a_registration) =
        take(&mut cache, &mut domain, A, page(0), Access::REMOTE_WRITE);
    let (b_handle, b_registration) =
        take(&mut cache, &mut domain, B, page(0), Access::REMOTE_WRITE);
    assert_ne!(
        b_registration.lkey, a_registration.lkey,
        "B would reuse the rkey A's peer holds"
    );
    assert_ne!(b_registration.rkey, a_registration.rkey);
    // A local get by B may use A's exposed entry: it gets no rkey.
    let (_, b_local) = take(&mut cache, &mut domain, B, page(0), LOCAL);
    assert_eq!(b_local.rkey, None);

    cache.release(&mut domain, a_handle);
    assert!(!domain.accepts(a_registration.rkey.unwrap(), page(0), Access::REMOTE_WRITE));
    assert!(domain.accepts(b_registration.rkey.unwrap(), page(0), Access::REMOTE_WRITE));
    cache.release(&mut domain, b_handle);
    assert_eq!(cache.stats().revocations, 2);
}

#[test]
fn a_same_owner_remote_hit_never_widens_a_live_exposure() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let both = Access::REMOTE_READ | Access::REMOTE_WRITE;
    let lkey = cache_idle(&mut cache, &mut domain, page(0), both);
    let (_, reader) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_READ);
    assert_eq!(reader.lkey, lkey);
    assert_eq!(
        domain.live[&lkey].exposed,
        Access::REMOTE_READ,
        "exposure grants only the rights asked"
    );
    let (_, writer) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_WRITE);
    assert_ne!(
        writer.lkey, lkey,
        "widening would need a new rkey while the old one is out"
    );
}

#[test]
fn idle_entries_are_evicted_least_recently_released_first() {
    let mut cache = MrCache::new(CacheConfig {
        max_entries: 3,
        max_bytes: u64::MAX,
    });
    let mut domain = FakeDomain::new();
    let keys: Vec<LocalKey> = (0..3)
        .map(|n| cache_idle(&mut cache, &mut domain, page(n), LOCAL))
        .collect();
    // Reuse the oldest: page 1 becomes the least recently released.
    cache_idle(&mut cache, &mut domain, page(0), LOCAL);

    cache_idle(&mut cache, &mut domain, page(3), LOCAL);
    assert_eq!(deregistered(&domain), [keys[1]]);
    cache_idle(&mut cache, &mut domain, page(4), LOCAL);
    assert_eq!(deregistered(&domain), [keys[1], keys[2]]);
    assert_eq!(cache.stats().evictions, 2);
    let (_, survivor) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    assert_eq!(survivor.lkey, keys[0]);
}

#[test]
fn the_byte_bound_evicts_idle_entries() {
    let mut cache = MrCache::new(CacheConfig {
        max_entries: 100,
        max_bytes: 64 * KIB,
    });
    let mut domain = FakeDomain::new();
    let half = |n: u64| MemRange::new(n * MIB, 32 * KIB);
    let first = cache_idle(&mut cache, &mut domain, half(0), LOCAL);
    cache_idle(&mut cache, &mut domain, half(1), LOCAL);
    assert!(deregistered(&domain).is_empty(), "64 KiB fit exactly");
    cache_idle(&mut cache, &mut domain, half(2), LOCAL);
    assert_eq!(deregistered(&domain), [first]);
    assert_eq!(cache.stats().bytes_registered, 64 * KIB);
    assert_eq!(domain.pinned_bytes(), 64 * KIB);
}

#[test]
fn when_everything_is_referenced_registration_overshoots_then_shrinks_back() {
    let mut cache = MrCache::new(CacheConfig {
        max_entries: 2,
        max_bytes: u64::MAX,
    });
    let mut domain = FakeDomain::new();
    let handles: Vec<MrHandle> = (0..3)
        .map(|n| take(&mut cache, &mut domain, A, page(n), LOCAL).0)
        .collect();
    let stats = cache.stats();
    assert_eq!(
        (stats.entries, stats.overshoots, stats.evictions),
        (3, 1, 0)
    );

    cache.release(&mut domain, handles[1]);
    cache.check_invariants().unwrap();
    let stats = cache.stats();
    assert_eq!(
        (stats.entries, stats.evictions),
        (2, 1),
        "back within bounds as soon as an entry idles"
    );
    cache.release(&mut domain, handles[0]);
    assert_eq!(
        cache.stats().entries,
        2,
        "within bounds: the idle entry stays cached"
    );
}

#[test]
fn release_owner_drops_only_that_owners_references_and_keeps_entries_for_reuse() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let (a_local, local_registration) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    let (a_remote, remote_registration) =
        take(&mut cache, &mut domain, A, page(1), Access::REMOTE_WRITE);
    let (b_local, _) = take(&mut cache, &mut domain, B, page(0), LOCAL);

    assert_eq!(cache.release_owner(&mut domain, A), 2);
    cache.check_invariants().unwrap();
    assert!(
        deregistered(&domain).is_empty(),
        "closing a connection deregisters nothing"
    );
    assert!(!domain.accepts(
        remote_registration.rkey.unwrap(),
        page(1),
        Access::REMOTE_WRITE
    ));
    assert_eq!(cache.registration(a_local), None);
    assert_eq!(cache.registration(a_remote), None);
    assert!(
        cache.registration(b_local).is_some(),
        "B's reference must survive A's close"
    );
    assert_eq!(cache.release_owner(&mut domain, A), 0);

    let (_, again) = take(&mut cache, &mut domain, B, page(1), Access::REMOTE_WRITE);
    assert_eq!(
        again.lkey, remote_registration.lkey,
        "kept for reuse by other connections"
    );
    let (_, local_again) = take(&mut cache, &mut domain, B, page(0), LOCAL);
    assert_eq!(local_again.lkey, local_registration.lkey);
    assert_eq!(registers(&domain), 2);
    let stats = cache.stats();
    assert_eq!(
        (stats.owner_releases, stats.releases, stats.revocations),
        (2, 2, 1)
    );
}

#[test]
fn stale_handles_are_counted_no_ops_and_never_alias_a_later_reference() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let (first, _) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    cache.release(&mut domain, first);
    cache.release(&mut domain, first);
    assert_eq!(
        (cache.stats().releases, cache.stats().stale_releases),
        (1, 1)
    );

    let (second, _) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    assert_ne!(second, first, "the reused slot must carry a new generation");
    cache.release(&mut domain, first);
    assert!(
        cache.registration(second).is_some(),
        "a stale release dropped someone else's reference"
    );
    assert_eq!(cache.entries().next().map(|entry| entry.refs), Some(1));
    assert_eq!(cache.stats().stale_releases, 2);
}

#[test]
fn a_slot_whose_generation_would_wrap_is_retired() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let (handle, _) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    cache.slots[handle.slot as usize].generation = u32::MAX;
    let last = MrHandle {
        slot: handle.slot,
        generation: u32::MAX,
    };
    cache.release(&mut domain, last);
    assert_eq!(cache.stats().releases, 1);
    let (next, _) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    assert_ne!(
        next.slot, last.slot,
        "a slot at the last generation was reused"
    );
    cache.release(&mut domain, last);
    assert_eq!(cache.stats().stale_releases, 1);
}

#[test]
fn a_failed_registration_leaves_no_entry_and_is_counted() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    domain.fail_register = Some(RegisterError::BadAddress);
    assert_eq!(
        cache.get(&mut domain, A, page(0), LOCAL),
        Err(RegisterError::BadAddress)
    );
    let calls = domain.calls.len();
    assert_eq!(
        cache.get(&mut domain, A, MemRange::new(0x1000, 0), LOCAL),
        Err(RegisterError::BadAddress)
    );
    assert_eq!(
        cache.get(&mut domain, A, MemRange::new(u64::MAX - 1, 2), LOCAL),
        Err(RegisterError::BadAddress)
    );
    assert_eq!(
        domain.calls.len(),
        calls,
        "malformed ranges must not reach the domain"
    );
    cache.check_invariants().unwrap();
    let stats = cache.stats();
    assert_eq!(
        (stats.gets, stats.misses, stats.registration_failures),
        (3, 3, 3)
    );
    assert_eq!(
        (stats.entries, stats.registrations, stats.bytes_registered),
        (0, 0, 0)
    );
    assert!(domain.live.is_empty());
    // The failure is not sticky.
    take(&mut cache, &mut domain, A, page(0), LOCAL);
}

#[test]
fn out_of_resources_evicts_idle_entries_and_retries_once() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    domain.pinned_limit = Some(64 * KIB);
    let held = take(
        &mut cache,
        &mut domain,
        A,
        MemRange::new(0, 16 * KIB),
        LOCAL,
    );
    cache_idle(&mut cache, &mut domain, MemRange::new(MIB, 16 * KIB), LOCAL);
    cache_idle(
        &mut cache,
        &mut domain,
        MemRange::new(2 * MIB, 16 * KIB),
        LOCAL,
    );

    take(
        &mut cache,
        &mut domain,
        A,
        MemRange::new(3 * MIB, 32 * KIB),
        LOCAL,
    );
    assert_eq!(cache.stats().evictions, 2);
    assert_eq!(registers(&domain), 5, "one failed attempt, one retry");
    assert!(
        cache.registration(held.0).is_some(),
        "a referenced entry was evicted"
    );

    // Nothing idle left to give up: the failure reaches the caller.
    assert_eq!(
        cache.get(&mut domain, A, MemRange::new(4 * MIB, 32 * KIB), LOCAL),
        Err(RegisterError::OutOfResources)
    );
    assert_eq!(registers(&domain), 6);
    assert_eq!(cache.stats().registration_failures, 1);
}

#[test]
fn a_failed_re_exposure_drops_the_entry_and_registers_afresh() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let old = cache_idle(&mut cache, &mut domain, page(0), Access::REMOTE_READ);
    domain.fail_expose = Some(RegisterError::OutOfResources);
    let (_, fresh) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_READ);
    assert_ne!(fresh.lkey, old);
    assert!(domain.accepts(fresh.rkey.unwrap(), page(0), Access::REMOTE_READ));
    assert_eq!(deregistered(&domain), [old]);
    let stats = cache.stats();
    assert_eq!(
        (stats.domain_errors, stats.misses, stats.hits, stats.entries),
        (1, 2, 0, 1)
    );
}

#[test]
fn a_failed_revocation_dooms_the_entry_until_its_last_reference_goes() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let (remote, registration) = take(&mut cache, &mut domain, A, page(0), Access::REMOTE_WRITE);
    let (local, _) = take(&mut cache, &mut domain, A, page(0), LOCAL);
    domain.fail_revoke = Some(RegisterError::UnknownKey);
    cache.release(&mut domain, remote);
    cache.check_invariants().unwrap();
    assert_eq!(cache.stats().domain_errors, 1);
    assert!(
        cache.registration(local).is_some(),
        "the local reference stays usable"
    );

    let (other, fresh) = take(&mut cache, &mut domain, B, page(0), LOCAL);
    assert_ne!(
        fresh.lkey, registration.lkey,
        "a doomed entry was handed out"
    );
    cache.release(&mut domain, local);
    assert_eq!(
        deregistered(&domain),
        [registration.lkey],
        "deregistration must end the peer's access"
    );
    assert!(!domain.accepts(registration.rkey.unwrap(), page(0), Access::REMOTE_WRITE));
    cache.release(&mut domain, other);
    cache.check_invariants().unwrap();
}

#[test]
fn a_failed_deregistration_is_counted_and_the_entry_forgotten() {
    let mut cache = MrCache::new(CacheConfig {
        max_entries: 1,
        max_bytes: u64::MAX,
    });
    let mut domain = FakeDomain::new();
    cache_idle(&mut cache, &mut domain, page(0), LOCAL);
    domain.fail_deregister = Some(RegisterError::UnknownKey);
    cache_idle(&mut cache, &mut domain, page(1), LOCAL);
    let stats = cache.stats();
    assert_eq!(
        (stats.domain_errors, stats.deregistrations, stats.entries),
        (1, 0, 1)
    );
}

#[test]
fn the_lookup_window_shrinks_when_the_longest_entry_goes() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    let big = cache_idle(&mut cache, &mut domain, MemRange::new(0, 64 * MIB), LOCAL);
    for n in 0..8 {
        cache_idle(
            &mut cache,
            &mut domain,
            MemRange::new(n * MIB, 4 * KIB),
            Access::LOCAL_WRITE,
        );
    }
    assert_eq!(cache.max_len, 64 * MIB);
    let (_, far) = take(
        &mut cache,
        &mut domain,
        A,
        MemRange::new(60 * MIB, 4 * KIB),
        LOCAL,
    );
    assert_eq!(
        far.lkey, big,
        "an entry starting 60 MiB below still contains the range"
    );

    cache.invalidate(&mut domain, MemRange::new(63 * MIB, 1));
    assert_eq!(cache.max_len, 4 * KIB);
    cache.check_invariants().unwrap();
    let (_, small) = take(
        &mut cache,
        &mut domain,
        A,
        MemRange::new(3 * MIB, 4 * KIB),
        LOCAL,
    );
    assert_eq!(
        small.access,
        Access::LOCAL_WRITE,
        "the small entry still hits"
    );
}

#[test]
fn check_invariants_reports_corruption() {
    let (mut cache, mut domain) = (roomy(), FakeDomain::new());
    take(&mut cache, &mut domain, A, page(0), LOCAL);
    let index = cache.by_start.iter().next().unwrap().1 as usize;
    cache.entries[index].refs += 1;
    assert!(cache.check_invariants().is_err());
    cache.entries[index].refs -= 1;
    cache.check_invariants().unwrap();
    cache.bytes += 1;
    assert!(cache.check_invariants().is_err());
}

/// The fuzz body on pseudo-random inputs (xorshift, fixed seeds): must find nothing, and
/// the inputs must reach every path the checks are about.
#[test]
fn run_ops_holds_on_pseudo_random_inputs() {
    run_ops(&[]);
    let mut total = CacheStats::default();
    for seed in 1..=48u64 {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let bytes: Vec<u8> = (0..3000)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        let stats = run_ops(&bytes);
        total.hits += stats.hits;
        total.misses += stats.misses;
        total.invalidated_references += stats.invalidated_references;
        total.revocations += stats.revocations;
        total.re_exposures += stats.re_exposures;
        total.evictions += stats.evictions;
        total.overshoots += stats.overshoots;
        total.stale_releases += stats.stale_releases;
        total.subsumed += stats.subsumed;
        total.domain_errors += stats.domain_errors;
        total.registration_failures += stats.registration_failures;
    }
    let reached = [
        ("hits", total.hits),
        ("misses", total.misses),
        ("invalidated references", total.invalidated_references),
        ("revocations", total.revocations),
        ("re-exposures", total.re_exposures),
        ("evictions", total.evictions),
        ("overshoots", total.overshoots),
        ("stale releases", total.stale_releases),
        ("subsumptions", total.subsumed),
        ("failed re-exposures", total.domain_errors),
        ("failed registrations", total.registration_failures),
    ];
    for (path, count) in reached {
        assert!(
            count > 0,
            "the pseudo-random inputs never reach {path}: {total:?}"
        );
    }
}
