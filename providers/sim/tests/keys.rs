//! Protection-domain semantics: key checking, revocation, re-exposure, deregistration,
//! registration failures, and the memory model (unmap, map_at, violations).

mod common;

use std::collections::BTreeSet;

use common::*;
use san_api::{
    Access, CompletionError, CompletionKind, LocalKey, MemRange, RegisterError, SanConnection,
    SanDomain, WrId,
};
use san_sim::{FaultConfig, SimError, SimFabric, ViolationKind, PAGE_SIZE};

#[test]
fn keys_are_unique_and_never_reused() {
    let mut p = Pair::new(1, FaultConfig::default());
    let range = p.fabric.alloc(p.a, 4096).unwrap();
    let mut seen = BTreeSet::new();
    for _ in 0..100 {
        let reg = p
            .dom_a
            .register(range, Access::LOCAL_WRITE | Access::REMOTE_READ)
            .unwrap();
        assert!(seen.insert(reg.lkey.0), "lkey reused");
        assert!(
            seen.insert(reg.rkey.unwrap().0),
            "rkey reused or equal to an lkey"
        );
        p.dom_a.revoke_remote(reg.lkey).unwrap();
        let again = p
            .dom_a
            .expose_remote(reg.lkey, Access::REMOTE_WRITE)
            .unwrap();
        assert!(seen.insert(again.0), "re-exposed rkey reused");
        p.dom_a.deregister(reg.lkey).unwrap();
    }
    // The other endpoint's keys are distinct from these too.
    let other = p.fabric.alloc(p.b, 4096).unwrap();
    let reg = p.dom_b.register(other, Access::REMOTE_WRITE).unwrap();
    assert!(!seen.contains(&reg.lkey.0) && !seen.contains(&reg.rkey.unwrap().0));
    assert_eq!(p.fabric.live_registrations(p.a), 0);
    assert_eq!(p.fabric.live_registrations(p.b), 1);
}

#[test]
fn domain_calls_with_dead_keys_fail_with_unknown_key() {
    let mut p = Pair::new(2, FaultConfig::default());
    let range = p.fabric.alloc(p.a, 100).unwrap();
    let reg = p.dom_a.register(range, Access::REMOTE_WRITE).unwrap();
    p.dom_a.deregister(reg.lkey).unwrap();
    assert_eq!(p.dom_a.deregister(reg.lkey), Err(RegisterError::UnknownKey));
    assert_eq!(
        p.dom_a.revoke_remote(reg.lkey),
        Err(RegisterError::UnknownKey)
    );
    assert_eq!(
        p.dom_a.expose_remote(reg.lkey, Access::REMOTE_READ),
        Err(RegisterError::UnknownKey)
    );
    // A key of another domain is unknown here.
    let other = p.fabric.alloc(p.b, 100).unwrap();
    let reg_b = p.dom_b.register(other, Access::NONE).unwrap();
    assert_eq!(
        p.dom_a.deregister(reg_b.lkey),
        Err(RegisterError::UnknownKey)
    );
    assert_eq!(p.fabric.live_registrations(p.b), 1);
}

#[test]
fn a_revoked_rkey_fails_and_a_re_exposed_one_works() {
    let mut p = Pair::new(3, FaultConfig::default());
    let src = registered(
        &p.fabric,
        &mut p.dom_a,
        p.a,
        4096,
        Some(&pattern(4096, 1)),
        Access::NONE,
    );
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        4096,
        None,
        Access::REMOTE_WRITE,
    );
    let stale = sink.remote_descriptor(sink.range).unwrap();
    p.dom_b.revoke_remote(sink.lkey).unwrap();
    p.conn_a
        .post_write(WrId(1), segment(&src, 0, 4096), stale)
        .unwrap();
    p.run();
    let completions = drain(&mut p.conn_a);
    assert_eq!(completions.len(), 1);
    assert_eq!(completions[0].status, Err(CompletionError::RemoteAccess));
    assert_eq!(
        p.fabric.read(p.b, sink.range).unwrap(),
        vec![0; 4096],
        "nothing landed"
    );
    assert!(
        p.fabric.violations().is_empty(),
        "a revoked rkey failing is expected"
    );
    let counters = p.fabric.counters(p.a);
    assert_eq!(counters.remote_access_failures, 1);
    assert_eq!(counters.stale_rkey_accesses, 1);
    assert_eq!(p.fabric.counters(p.b).accesses_rejected, 1);
    assert!(
        p.conn_a.is_broken(),
        "a remote access error breaks the connection"
    );

    // Re-expose: the new rkey works on a fresh connection, the stale one still fails.
    let fresh_rkey = p
        .dom_b
        .expose_remote(sink.lkey, Access::REMOTE_WRITE)
        .unwrap();
    assert_ne!(fresh_rkey, stale.rkey);
    let (mut conn_a2, _conn_b2) = p.fabric.connect(p.a, p.b, SLOTS, SLOTS).unwrap();
    let fresh = san_api::RemoteDescriptor {
        rkey: fresh_rkey,
        ..stale
    };
    conn_a2
        .post_write(WrId(2), segment(&src, 0, 4096), fresh)
        .unwrap();
    p.run();
    assert_eq!(drain(&mut conn_a2)[0].status, Ok(()));
    assert_eq!(p.fabric.read(p.b, sink.range).unwrap(), pattern(4096, 1));

    let (mut conn_a3, _conn_b3) = p.fabric.connect(p.a, p.b, SLOTS, SLOTS).unwrap();
    conn_a3
        .post_write(WrId(3), segment(&src, 0, 4096), stale)
        .unwrap();
    p.run();
    assert_eq!(
        drain(&mut conn_a3)[0].status,
        Err(CompletionError::RemoteAccess)
    );
}

#[test]
fn remote_access_needs_the_right_rights_and_bounds() {
    for (access, op_is_read, offset, len, ok) in [
        (Access::REMOTE_READ, true, 0, 4096, true),
        (Access::REMOTE_READ, false, 0, 4096, false), // write into read-only exposure
        (Access::REMOTE_WRITE, true, 0, 4096, false), // read from write-only exposure
        (Access::REMOTE_WRITE, false, 4000, 200, false), // leaves the registration
        (Access::REMOTE_WRITE, false, 4000, 96, true),
    ] {
        let mut p = Pair::new(4, FaultConfig::default());
        let local = registered(
            &p.fabric,
            &mut p.dom_a,
            p.a,
            8192,
            None,
            Access::LOCAL_WRITE,
        );
        let target = registered(&p.fabric, &mut p.dom_b, p.b, 4096, None, access);
        let remote = san_api::RemoteDescriptor {
            addr: target.range.addr + offset,
            len,
            rkey: target.rkey.unwrap(),
        };
        let seg = segment(&local, 0, len);
        if op_is_read {
            p.conn_a.post_read(WrId(1), seg, remote).unwrap();
        } else {
            p.conn_a.post_write(WrId(1), seg, remote).unwrap();
        }
        p.run();
        let status = drain(&mut p.conn_a)[0].status;
        let expected = if ok {
            Ok(())
        } else {
            Err(CompletionError::RemoteAccess)
        };
        assert_eq!(
            status, expected,
            "{access:?} read={op_is_read} +{offset} len {len}"
        );
        assert!(p.fabric.violations().is_empty());
    }
}

#[test]
fn an_lkey_used_after_deregistration_is_a_violation() {
    let mut p = Pair::new(5, FaultConfig::default());
    let src = registered(&p.fabric, &mut p.dom_a, p.a, 4096, None, Access::NONE);
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        4096,
        None,
        Access::REMOTE_WRITE,
    );
    p.dom_a.deregister(src.lkey).unwrap();
    p.conn_a
        .post_write(
            WrId(7),
            segment(&src, 0, 100),
            sink.remote_descriptor(sink.range).unwrap(),
        )
        .unwrap();
    p.run();
    let completions = drain(&mut p.conn_a);
    assert_eq!(completions[0].status, Err(CompletionError::LocalProtection));
    let violations = p.fabric.violations();
    assert_eq!(violations.len(), 1);
    let v = violations[0];
    assert_eq!(
        v.kind,
        ViolationKind::DeregisteredLocalKey { lkey: src.lkey }
    );
    assert_eq!(
        (v.endpoint, v.conn, v.wr_id),
        (p.a, Some(p.conn_a.id()), Some(WrId(7)))
    );
    assert!(v.to_string().contains("deregistered"), "{v}");
    assert_eq!(p.fabric.counters(p.a).violations, 1);
}

#[test]
fn deregistering_while_a_request_is_in_flight_is_caught_at_execution() {
    let mut p = Pair::new(6, FaultConfig::default());
    let src = registered(&p.fabric, &mut p.dom_a, p.a, 4096, None, Access::NONE);
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        4096,
        None,
        Access::REMOTE_WRITE,
    );
    p.conn_a
        .post_write(
            WrId(1),
            segment(&src, 0, 100),
            sink.remote_descriptor(sink.range).unwrap(),
        )
        .unwrap();
    p.dom_a.deregister(src.lkey).unwrap();
    p.run();
    assert_eq!(p.fabric.violation_count(), 1);
}

#[test]
fn local_segments_outside_their_registration_or_never_registered_are_violations() {
    let mut p = Pair::new(7, FaultConfig::default());
    let src = registered(&p.fabric, &mut p.dom_a, p.a, 4096, None, Access::NONE);
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        8192,
        None,
        Access::REMOTE_WRITE,
    );
    let outside = san_api::LocalSegment {
        range: MemRange::new(src.range.addr + 4000, 200),
        lkey: src.lkey,
    };
    p.conn_a
        .post_write(
            WrId(1),
            outside,
            sink.remote_descriptor(sink.range).unwrap(),
        )
        .unwrap();
    p.run();
    let (mut conn_a2, _b2) = p.fabric.connect(p.a, p.b, SLOTS, SLOTS).unwrap();
    let forged = san_api::LocalSegment {
        range: src.range,
        lkey: LocalKey(999_999),
    };
    conn_a2
        .post_write(WrId(2), forged, sink.remote_descriptor(sink.range).unwrap())
        .unwrap();
    p.run();
    let kinds: Vec<ViolationKind> = p.fabric.violations().iter().map(|v| v.kind).collect();
    assert!(
        matches!(kinds[0], ViolationKind::OutsideRegistration { .. }),
        "{kinds:?}"
    );
    assert_eq!(
        kinds[1],
        ViolationKind::UnknownLocalKey {
            lkey: LocalKey(999_999)
        }
    );
    assert_eq!(kinds.len(), 2);
}

#[test]
fn registering_unmapped_memory_fails_with_bad_address() {
    let mut p = Pair::new(8, FaultConfig::default());
    let range = p.fabric.alloc(p.a, 3 * PAGE_SIZE).unwrap();
    assert_eq!(
        p.dom_a
            .register(MemRange::new(range.addr + 3 * PAGE_SIZE, 1), Access::NONE),
        Err(RegisterError::BadAddress),
        "the guard page after an allocation is unmapped"
    );
    assert_eq!(
        p.dom_a.register(MemRange::new(range.addr, 0), Access::NONE),
        Err(RegisterError::BadAddress)
    );
    p.fabric
        .unmap(p.a, MemRange::new(range.addr + PAGE_SIZE, PAGE_SIZE))
        .unwrap();
    assert_eq!(
        p.dom_a.register(range, Access::NONE),
        Err(RegisterError::BadAddress)
    );
    assert!(p
        .dom_a
        .register(MemRange::new(range.addr, PAGE_SIZE), Access::NONE)
        .is_ok());
    assert_eq!(p.fabric.counters(p.a).registration_failures, 3);
    assert_eq!(p.fabric.live_registrations(p.a), 1);
}

#[test]
fn injected_registration_failures_fail_exactly_the_next_n_calls() {
    let mut p = Pair::new(9, FaultConfig::default());
    let range = p.fabric.alloc(p.a, 4096).unwrap();
    p.fabric.fail_next_registrations(p.a, 2).unwrap();
    assert_eq!(
        p.dom_a.register(range, Access::NONE),
        Err(RegisterError::OutOfResources)
    );
    // The other endpoint is unaffected.
    let other = p.fabric.alloc(p.b, 4096).unwrap();
    assert!(p.dom_b.register(other, Access::NONE).is_ok());
    assert_eq!(
        p.dom_a.register(range, Access::NONE),
        Err(RegisterError::OutOfResources)
    );
    assert!(p.dom_a.register(range, Access::NONE).is_ok());
    assert_eq!(p.fabric.live_registrations(p.a), 1);
}

#[test]
fn random_registration_failures_follow_their_probability() {
    let faults = FaultConfig {
        registration_failure: 0.25,
        ..FaultConfig::default()
    };
    let mut p = Pair::new(10, faults);
    let range = p.fabric.alloc(p.a, 4096).unwrap();
    let failures = (0..2_000)
        .filter(|_| match p.dom_a.register(range, Access::NONE) {
            Ok(reg) => {
                p.dom_a.deregister(reg.lkey).unwrap();
                false
            }
            Err(e) => {
                assert_eq!(e, RegisterError::OutOfResources);
                true
            }
        })
        .count();
    assert!(
        (400..600).contains(&failures),
        "{failures} of 2000 at p=0.25"
    );
}

#[test]
fn unmap_then_map_at_gives_new_bytes_and_the_stale_registration_is_a_violation() {
    let mut p = Pair::new(11, FaultConfig::default());
    let old_bytes = pattern(8192, 1);
    let buf = registered(
        &p.fabric,
        &mut p.dom_a,
        p.a,
        8192,
        Some(&old_bytes),
        Access::NONE,
    );
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        8192,
        None,
        Access::REMOTE_WRITE,
    );
    let remote = sink.remote_descriptor(sink.range).unwrap();

    // The application frees the buffer and gets new memory at the same address.
    p.fabric.unmap(p.a, buf.range).unwrap();
    assert_eq!(
        p.fabric.read(p.a, buf.range),
        Err(SimError::Unmapped {
            addr: buf.range.addr
        })
    );
    let again = p.fabric.map_at(p.a, buf.range.addr, 8192).unwrap();
    assert_eq!(again.addr, buf.range.addr);
    let new_bytes = pattern(8192, 2);
    p.fabric.write(p.a, again, &new_bytes).unwrap();
    assert_eq!(p.fabric.read(p.a, again).unwrap(), new_bytes);
    assert_eq!(
        p.fabric.live_registrations(p.a),
        1,
        "unmap does not deregister"
    );

    // Using the old registration (the cache was not told) is a violation, and moves nothing.
    p.conn_a
        .post_write(WrId(1), segment(&buf, 0, 8192), remote)
        .unwrap();
    p.run();
    assert_eq!(
        drain(&mut p.conn_a)[0].status,
        Err(CompletionError::LocalProtection)
    );
    let violations = p.fabric.violations();
    assert_eq!(violations.len(), 1);
    assert_eq!(
        violations[0].kind,
        ViolationKind::RegisteredMemoryUnmapped {
            lkey: buf.lkey,
            registered: buf.range
        }
    );
    assert_eq!(p.fabric.read(p.b, sink.range).unwrap(), vec![0; 8192]);

    // After invalidation (deregister) a fresh registration moves the *new* bytes.
    p.dom_a.deregister(buf.lkey).unwrap();
    let fresh = p.dom_a.register(again, Access::NONE).unwrap();
    let (mut conn_a2, _b2) = p.fabric.connect(p.a, p.b, SLOTS, SLOTS).unwrap();
    conn_a2
        .post_write(WrId(2), segment(&fresh, 0, 8192), remote)
        .unwrap();
    p.run();
    assert_eq!(drain(&mut conn_a2)[0].status, Ok(()));
    assert_eq!(p.fabric.read(p.b, sink.range).unwrap(), new_bytes);
    assert_eq!(p.fabric.violation_count(), 1);
}

#[test]
fn alloc_never_reuses_addresses_and_endpoints_do_not_share_them() {
    let fabric = SimFabric::new(12, FaultConfig::default());
    let a = fabric.add_endpoint();
    let b = fabric.add_endpoint();
    let mut ranges = Vec::new();
    for len in [1, 4096, 4097, 100_000] {
        let r = fabric.alloc(a, len).unwrap();
        assert_eq!(r.addr % PAGE_SIZE, 0);
        assert_eq!(r.len, len);
        fabric.unmap(a, r).unwrap();
        ranges.push(r);
    }
    ranges.push(fabric.alloc(a, 10).unwrap());
    ranges.push(fabric.alloc(b, 10).unwrap());
    for (i, x) in ranges.iter().enumerate() {
        for y in &ranges[i + 1..] {
            assert!(!x.overlaps(y), "{x:?} and {y:?}");
        }
    }
    assert_eq!(fabric.alloc(a, 0), Err(SimError::InvalidLength));
    assert!(matches!(
        fabric.write(a, MemRange::new(ranges[4].addr, 3), b"ab"),
        Err(SimError::LengthMismatch { .. })
    ));
}

#[test]
fn the_memory_handle_and_the_fabric_see_the_same_address_space() {
    let fabric = SimFabric::new(13, FaultConfig::default());
    let ep = fabric.add_endpoint();
    let memory = fabric.memory(ep);
    let range = memory.alloc(10).unwrap();
    memory.write(range, b"0123456789").unwrap();
    assert_eq!(fabric.read(ep, range).unwrap(), b"0123456789");
    memory.unmap(range).unwrap();
    assert!(fabric.read(ep, range).is_err());
    memory.map_at(range.addr, 10).unwrap();
    assert_eq!(fabric.read(ep, range).unwrap(), vec![0; 10]);
}

#[test]
fn live_registrations_drain_to_zero_when_everything_is_deregistered() {
    let mut p = Pair::new(14, FaultConfig::default());
    let mut keys = Vec::new();
    for i in 1..=10u64 {
        let r = p.fabric.alloc(p.a, i * 1000).unwrap();
        keys.push(p.dom_a.register(r, Access::REMOTE_READ).unwrap().lkey);
    }
    assert_eq!(p.fabric.live_registrations(p.a), 10);
    assert_eq!(p.dom_a.live_registrations(), 10);
    for (i, lkey) in keys.iter().enumerate() {
        p.dom_a.deregister(*lkey).unwrap();
        assert_eq!(p.fabric.live_registrations(p.a), 9 - i);
    }
    let c = p.fabric.counters(p.a);
    assert_eq!(
        (c.registrations, c.deregistrations, c.registrations_live),
        (10, 10, 0)
    );
}

#[test]
fn sends_need_no_registration_and_move_no_registered_memory() {
    // Sends copy from the caller's slice: no key is involved, so nothing to violate.
    let mut p = Pair::new(15, FaultConfig::default());
    p.conn_b.post_recv(WrId(1), san_api::RecvSlot(0)).unwrap();
    p.conn_a.post_send(WrId(2), b"abc").unwrap();
    p.run();
    assert_eq!(
        drain(&mut p.conn_b)[0].kind,
        CompletionKind::Recv {
            slot: san_api::RecvSlot(0),
            len: 3
        }
    );
    assert_eq!(p.fabric.live_registrations(p.a), 0);
    assert_eq!(p.fabric.violation_count(), 0);
}
