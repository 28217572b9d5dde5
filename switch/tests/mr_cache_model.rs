//! Model-based property test of the registration cache: random sequences of get / release /
//! stale release / invalidate / release_owner / injected domain failures, checked step by
//! step against a naive reference model by `switch::mr_cache::fuzzing::check_ops` (see its
//! docs for the full list of rules: no registration overlapping an invalidated range is
//! ever handed out again, exact reference counts, exposure exactly while a remote reference
//! is held, no leak between cache and domain, bounds, stale handles, `check_invariants`).

use proptest::collection::vec;
use proptest::prelude::*;
use switch::mr_cache::fuzzing::{check_ops, Op};
use switch::mr_cache::CacheConfig;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (any::<u8>(), any::<u8>(), any::<u8>(), any::<u8>())
            .prop_map(|(owner, start, len, access)| Op::Get { owner, start, len, access }),
        4 => any::<u8>().prop_map(|pick| Op::Release { pick }),
        1 => any::<u8>().prop_map(|pick| Op::ReleaseStale { pick }),
        2 => (any::<u16>(), any::<u16>()).prop_map(|(start, len)| Op::Invalidate { start, len }),
        1 => any::<u8>().prop_map(|owner| Op::ReleaseOwner { owner }),
        1 => any::<bool>().prop_map(|out_of_resources| Op::FailNextRegister { out_of_resources }),
        1 => Just(Op::FailNextExpose),
    ]
}

/// Tight bounds (eviction and overshoot all the time) as well as roomy ones (long-lived
/// idle entries, many hits).
fn config() -> impl Strategy<Value = CacheConfig> {
    prop_oneof![
        (1usize..=8, 1u64..=32).prop_map(|(entries, kib)| CacheConfig {
            max_entries: entries,
            max_bytes: kib * 1024
        }),
        (8usize..=64, 32u64..=1024).prop_map(|(entries, kib)| CacheConfig {
            max_entries: entries,
            max_bytes: kib * 1024
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn the_cache_follows_the_model(config in config(), ops in vec(op(), 1..300)) {
        check_ops(config, &ops);
    }
}

/// A sequence that walks the main rules in order, so a regression shows up here with a
/// readable history before the random search finds it.
#[test]
fn a_scripted_sequence_follows_the_model() {
    use Op::*;
    let remote_write = 4;
    let ops = [
        Get {
            owner: 0,
            start: 0,
            len: 15,
            access: 0,
        }, // miss: 4 KiB at BASE
        Get {
            owner: 1,
            start: 4,
            len: 3,
            access: 0,
        }, // hit: inside
        Get {
            owner: 0,
            start: 16,
            len: 15,
            access: remote_write,
        }, // miss, exposed to owner 0
        Get {
            owner: 1,
            start: 16,
            len: 15,
            access: remote_write,
        }, // miss: owner 1 may not share
        Release { pick: 2 },
        Invalidate { start: 10, len: 0 }, // cuts the first entry
        ReleaseStale { pick: 0 },
        ReleaseOwner { owner: 1 },
        FailNextExpose,
        Get {
            owner: 0,
            start: 16,
            len: 15,
            access: remote_write,
        },
        FailNextRegister {
            out_of_resources: false,
        },
        Get {
            owner: 2,
            start: 60,
            len: 31,
            access: 1,
        },
    ];
    let stats = check_ops(
        CacheConfig {
            max_entries: 4,
            max_bytes: 64 * 1024,
        },
        &ops,
    );
    assert!(
        stats.hits >= 1 && stats.invalidated_references >= 1 && stats.registration_failures == 1,
        "{stats:?}"
    );
}
