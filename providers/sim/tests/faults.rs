//! Fault injection: connection errors and flushing, receiver-not-ready, crashes, memory
//! vanishing under an exposed registration, delays and reordering, and determinism.

mod common;

use std::collections::BTreeMap;

use common::*;
use san_api::{
    Access, Completion, CompletionError, CompletionKind, PostError, RecvSlot, SanConnection,
    SanDomain, WrId,
};
use san_sim::{FaultConfig, SimFabric, SimTiming, ViolationKind};

fn count_by_wr(completions: &[Completion]) -> BTreeMap<u64, usize> {
    let mut counts = BTreeMap::new();
    for c in completions {
        *counts.entry(c.wr_id.0).or_default() += 1;
    }
    counts
}

#[test]
fn a_qp_error_flushes_every_outstanding_request_of_both_sides_once() {
    let mut p = Pair::new(1, FaultConfig::default());
    let src = registered(&p.fabric, &mut p.dom_a, p.a, 4096, None, Access::NONE);
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        4096,
        None,
        Access::REMOTE_WRITE,
    );
    // b has 3 receives for 5 sends: two sends will sit in RNR retry.
    for slot in 0..3 {
        p.conn_b
            .post_recv(WrId(100 + slot), RecvSlot(slot as u16))
            .unwrap();
    }
    for i in 0..5 {
        p.conn_a.post_send(WrId(i), b"m").unwrap();
    }
    p.conn_a
        .post_write(
            WrId(5),
            segment(&src, 0, 64),
            sink.remote_descriptor(sink.range).unwrap(),
        )
        .unwrap();
    p.conn_b.post_send(WrId(200), b"nobody listens").unwrap();
    // Let the first sends land, then break the connection mid-flight.
    p.fabric.run_until(p.fabric.now() + 12);
    assert!(p.conn_a.outstanding_requests() > 0);
    p.fabric.inject_qp_error(p.conn_a.id()).unwrap();
    p.run();
    assert_eq!(p.conn_a.outstanding_requests(), 0);
    assert_eq!(p.conn_b.outstanding_requests(), 0);
    assert_eq!(p.conn_a.queued_completions(), 6, "nothing handed out yet");

    let at_a = drain(&mut p.conn_a);
    let at_b = drain(&mut p.conn_b);
    assert_eq!(count_by_wr(&at_a), (0..6).map(|i| (i, 1)).collect());
    let mut b_expected: BTreeMap<u64, usize> = (100..103).map(|i| (i, 1)).collect();
    b_expected.insert(200, 1);
    assert_eq!(count_by_wr(&at_b), b_expected);

    let errors_a: Vec<_> = at_a.iter().filter_map(|c| c.status.err()).collect();
    assert_eq!(
        errors_a[0],
        CompletionError::RetryExceeded,
        "the first carries the cause"
    );
    assert!(errors_a[1..].iter().all(|&e| e == CompletionError::Flushed));
    assert!(at_b
        .iter()
        .all(|c| c.status.is_ok() || c.status == Err(CompletionError::Flushed)));
    // Flushed receives report their slot (so the switch can account for it) and no bytes.
    for c in at_b
        .iter()
        .filter(|c| c.status.is_err() && c.wr_id.0 >= 100 && c.wr_id.0 < 103)
    {
        assert!(matches!(c.kind, CompletionKind::Recv { len: 0, .. }));
    }

    assert_eq!(
        p.conn_a.post_send(WrId(9), b"x"),
        Err(PostError::Disconnected)
    );
    assert_eq!(
        p.conn_b.post_recv(WrId(9), RecvSlot(7)),
        Err(PostError::Disconnected)
    );
    assert!(p.conn_a.is_broken() && p.conn_b.is_broken());
    assert_eq!(p.fabric.counters(p.a).qp_errors, 1);
    assert_eq!(p.fabric.counters(p.b).qp_errors, 1);
}

#[test]
fn random_qp_errors_still_give_exactly_one_completion_per_request() {
    let faults = FaultConfig {
        qp_error: 0.05,
        completion_delay: 0.2,
        reorder: 0.2,
        ..FaultConfig::default()
    };
    let mut broke = 0;
    for seed in 0..60 {
        let mut p = Pair::new(seed, faults);
        post_all_recvs(&mut p.conn_b, 1_000);
        let mut posted = 0u64;
        for i in 0..SLOTS.send_slots as u64 {
            if p.conn_a.post_send(WrId(i), b"payload").is_ok() {
                posted += 1;
            }
        }
        p.run();
        let at_a = drain(&mut p.conn_a);
        assert_eq!(
            count_by_wr(&at_a),
            (0..posted).map(|i| (i, 1)).collect(),
            "seed {seed}"
        );
        let at_b = drain(&mut p.conn_b);
        assert!(count_by_wr(&at_b).values().all(|&n| n == 1));
        if p.conn_a.is_broken() {
            broke += 1;
            // Everything b had posted completed: delivered ones OK, the rest flushed.
            assert_eq!(at_b.len(), SLOTS.recv_slots as usize, "seed {seed}");
        }
    }
    assert!(broke > 0, "qp_error never fired");
}

#[test]
fn a_send_waits_out_a_delayed_re_post_with_rnr_retries_and_then_succeeds() {
    let mut p = Pair::new(2, FaultConfig::default());
    p.conn_a.post_send(WrId(1), b"early").unwrap();
    // Receiver not ready for a while (under the retry budget of 7 × 10 ticks).
    p.fabric.run_until(p.fabric.now() + 40);
    assert!(drain(&mut p.conn_a).is_empty(), "still retrying");
    assert!(p.fabric.counters(p.a).rnr_retries >= 2);
    p.conn_b.post_recv(WrId(2), RecvSlot(0)).unwrap();
    p.run();
    assert_eq!(drain(&mut p.conn_a)[0].status, Ok(()));
    let got = drain(&mut p.conn_b);
    assert_eq!(recv_bytes(&p.conn_b, &got[0]), b"early");
    assert!(!p.conn_a.is_broken());
    assert_eq!(p.fabric.counters(p.a).rnr_failures, 0);
}

#[test]
fn the_delayed_re_post_fault_provokes_rnr_retries_that_recover() {
    let faults = FaultConfig {
        delayed_repost: 1.0,
        repost_delay_max_ticks: 30,
        ..FaultConfig::default()
    };
    let mut p = Pair::new(3, faults);
    // Receives are posted *before* the sends, yet become usable only later.
    post_all_recvs(&mut p.conn_b, 100);
    for i in 0..SLOTS.send_slots as u64 {
        p.conn_a.post_send(WrId(i), &[i as u8]).unwrap();
    }
    p.run();
    let sends = drain(&mut p.conn_a);
    assert!(sends.iter().all(|c| c.status == Ok(())));
    let got: Vec<u8> = drain(&mut p.conn_b)
        .iter()
        .map(|c| recv_bytes(&p.conn_b, c)[0])
        .collect();
    assert_eq!(
        got,
        (0..SLOTS.send_slots as u8).collect::<Vec<_>>(),
        "order kept"
    );
    assert!(
        p.fabric.counters(p.a).rnr_retries > 0,
        "the fault had no effect"
    );
}

#[test]
fn rnr_exhaustion_fails_the_send_and_breaks_the_connection() {
    let timing = SimTiming {
        rnr_retry_limit: 3,
        rnr_retry_interval_ticks: 5,
        ..SimTiming::default()
    };
    let mut p = Pair::on(SimFabric::with_timing(4, FaultConfig::default(), timing));
    p.conn_a.post_send(WrId(1), b"lost").unwrap();
    p.conn_a.post_send(WrId(2), b"behind").unwrap();
    p.conn_b.post_send(WrId(3), b"other way").unwrap();
    let start = p.fabric.now();
    p.run();
    let at_a = drain(&mut p.conn_a);
    assert_eq!(at_a[0].wr_id, WrId(1));
    assert_eq!(at_a[0].status, Err(CompletionError::ReceiverNotReady));
    assert_eq!(
        at_a[1].status,
        Err(CompletionError::Flushed),
        "the send behind it"
    );
    assert_eq!(
        drain(&mut p.conn_b)[0].status,
        Err(CompletionError::Flushed)
    );
    let counters = p.fabric.counters(p.a);
    assert_eq!((counters.rnr_retries, counters.rnr_failures), (3, 1));
    assert!(p.fabric.now() - start >= 15, "three retries 5 ticks apart");
    assert!(p.conn_b.is_broken());
}

#[test]
fn a_crashed_endpoint_breaks_its_peers_after_the_detection_delay() {
    let mut p = Pair::new(5, FaultConfig::default());
    let fabric = p.fabric.clone();
    let c = fabric.add_endpoint();
    let (mut conn_c, _conn_b_c) = fabric.connect(c, p.b, SLOTS, SLOTS).unwrap();
    let sink = registered(&fabric, &mut p.dom_b, p.b, 4096, None, Access::REMOTE_WRITE);
    post_all_recvs(&mut p.conn_a, 10);
    p.conn_a.post_send(WrId(1), b"to b").unwrap();
    p.conn_b.post_recv(WrId(2), RecvSlot(0)).unwrap();
    p.conn_b.post_recv(WrId(3), RecvSlot(1)).unwrap();
    let crashed_at = fabric.now();
    fabric.crash(p.b).unwrap();
    p.run();

    let at_a = drain(&mut p.conn_a);
    assert_eq!(count_by_wr(&at_a).len(), 1 + SLOTS.recv_slots as usize);
    let errors: Vec<_> = at_a.iter().map(|c| c.status).collect();
    assert_eq!(errors[0], Err(CompletionError::RetryExceeded));
    assert!(errors[1..]
        .iter()
        .all(|&s| s == Err(CompletionError::Flushed)));
    assert!(fabric.now() >= crashed_at + SimTiming::default().peer_loss_detection_ticks);
    // An idle peer connection (c had nothing outstanding) learns at its next post.
    assert!(conn_c.is_broken());
    assert_eq!(
        conn_c.post_send(WrId(1), b"x"),
        Err(PostError::Disconnected)
    );
    // The crashed side reports nothing, its memory and keys are gone.
    assert!(drain(&mut p.conn_b).is_empty());
    assert_eq!(
        p.conn_b.post_send(WrId(5), b"x"),
        Err(PostError::Disconnected)
    );
    assert!(!fabric.is_alive(p.b));
    assert_eq!(fabric.live_registrations(p.b), 0);
    assert!(fabric.read(p.b, sink.range).is_err());
    assert!(p.dom_b.register(sink.range, Access::NONE).is_err());
}

#[test]
fn a_dropped_connection_is_noticed_by_the_peer_only_when_it_needs_it() {
    let mut p = Pair::new(6, FaultConfig::default());
    p.conn_a.post_recv(WrId(1), RecvSlot(0)).unwrap();
    let Pair {
        fabric,
        mut conn_a,
        conn_b,
        ..
    } = p;
    drop(conn_b);
    fabric.run_until_idle(1_000);
    assert!(
        !conn_a.is_broken(),
        "a posted receive alone does not notice"
    );
    conn_a.post_send(WrId(2), b"anyone?").unwrap();
    fabric.run_until_idle(1_000);
    let got = drain(&mut conn_a);
    assert_eq!(got.len(), 2);
    assert_eq!(got[0].status, Err(CompletionError::RetryExceeded));
    assert_eq!(
        got[0].wr_id,
        WrId(1),
        "oldest outstanding request carries the cause"
    );
    assert_eq!(got[1].status, Err(CompletionError::Flushed));
}

#[test]
fn memory_invalidated_mid_rendezvous_fails_the_peer_access_without_violation() {
    let mut p = Pair::new(7, FaultConfig::default());
    let src = registered(&p.fabric, &mut p.dom_a, p.a, 8192, None, Access::NONE);
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        8192,
        None,
        Access::REMOTE_WRITE,
    );
    let remote = sink.remote_descriptor(sink.range).unwrap();
    p.conn_a
        .post_write(WrId(1), segment(&src, 0, 8192), remote)
        .unwrap();
    let gone = p.fabric.invalidate_remote(p.b, sink.lkey).unwrap();
    assert!(gone.contains(&sink.range));
    // What the cache's invalidation does for the unmapped range, before the fabric runs on.
    p.dom_b.deregister(sink.lkey).unwrap();
    p.run();
    assert_eq!(
        drain(&mut p.conn_a)[0].status,
        Err(CompletionError::RemoteAccess)
    );
    assert!(p.fabric.violations().is_empty());
    let counters = p.fabric.counters(p.a);
    assert_eq!(counters.stale_rkey_accesses, 1);
    assert_eq!(counters.vanished_memory_accesses, 0);
    assert_eq!(p.fabric.live_registrations(p.b), 0);
}

#[test]
fn a_peer_reaching_vanished_memory_through_a_live_rkey_is_a_violation_of_the_owner() {
    let mut p = Pair::new(8, FaultConfig::default());
    let src = registered(&p.fabric, &mut p.dom_a, p.a, 8192, None, Access::NONE);
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        8192,
        None,
        Access::REMOTE_WRITE,
    );
    let remote = sink.remote_descriptor(sink.range).unwrap();
    p.fabric.invalidate_remote(p.b, sink.lkey).unwrap();
    // The cache is not told: the registration and its rkey stay live.
    p.conn_a
        .post_write(WrId(1), segment(&src, 0, 8192), remote)
        .unwrap();
    p.run();
    assert_eq!(
        drain(&mut p.conn_a)[0].status,
        Err(CompletionError::RemoteAccess)
    );
    let violations = p.fabric.violations();
    assert_eq!(violations.len(), 1);
    assert_eq!(violations[0].endpoint, p.b);
    assert_eq!(violations[0].wr_id, Some(WrId(1)));
    assert_eq!(
        violations[0].kind,
        ViolationKind::RemoteAccessToUnmappedMemory {
            lkey: sink.lkey,
            registered: sink.range
        }
    );
    assert_eq!(p.fabric.counters(p.a).vanished_memory_accesses, 1);
    assert_eq!(p.fabric.counters(p.b).violations, 1);
}

#[test]
fn long_tail_completion_delays_hold_completions_back_but_keep_queue_order() {
    let faults = FaultConfig {
        completion_delay: 1.0,
        completion_delay_max_ticks: 500,
        ..FaultConfig::default()
    };
    let mut slowest = 0;
    for seed in 0..10 {
        let mut p = Pair::new(seed, faults);
        post_all_recvs(&mut p.conn_b, 100);
        for i in 0..8 {
            p.conn_a.post_send(WrId(i), b"x").unwrap();
        }
        let start = p.fabric.now();
        p.run();
        slowest = slowest.max(p.fabric.now() - start);
        let order: Vec<u64> = drain(&mut p.conn_a).iter().map(|c| c.wr_id.0).collect();
        assert_eq!(
            order,
            (0..8).collect::<Vec<_>>(),
            "no reorder fault, so in order"
        );
    }
    let max_latency = SimTiming::default().max_latency_ticks;
    assert!(
        slowest > 10 * max_latency,
        "delays never exceeded {slowest} ticks"
    );
}

#[test]
fn reordering_lets_completions_overtake_only_when_the_fault_is_on() {
    let run = |faults: FaultConfig| {
        let mut out_of_order = 0;
        for seed in 0..40 {
            let mut p = Pair::new(seed, faults);
            let src = registered(&p.fabric, &mut p.dom_a, p.a, 4096, None, Access::NONE);
            let sink = registered(
                &p.fabric,
                &mut p.dom_b,
                p.b,
                4096,
                None,
                Access::REMOTE_WRITE,
            );
            post_all_recvs(&mut p.conn_b, 100);
            for i in 0..8u64 {
                if i % 2 == 0 {
                    let remote = sink.remote_descriptor(sink.range).unwrap();
                    p.conn_a
                        .post_write(WrId(i), segment(&src, 0, 4096), remote)
                        .unwrap();
                } else {
                    p.conn_a.post_send(WrId(i), b"x").unwrap();
                }
            }
            p.run();
            let order: Vec<u64> = drain(&mut p.conn_a).iter().map(|c| c.wr_id.0).collect();
            assert_eq!(order.len(), 8);
            if order.windows(2).any(|w| w[0] > w[1]) {
                out_of_order += 1;
            }
            // Receives are never reordered.
            let recvs: Vec<u64> = drain(&mut p.conn_b).iter().map(|c| c.wr_id.0).collect();
            assert_eq!(recvs, vec![100, 101, 102, 103]);
        }
        out_of_order
    };
    assert_eq!(run(FaultConfig::default()), 0);
    let reordering = FaultConfig {
        reorder: 0.5,
        ..FaultConfig::default()
    };
    assert!(run(reordering) > 0);
}

#[test]
fn a_reordered_read_can_fetch_its_data_after_a_later_send_arrived() {
    // Without a fence, "read done" sent right after posting the read can reach the peer
    // before the read fetched the data: the peer then overwrites its buffer and the reader
    // gets the new bytes. That is the bug the switch must avoid (send only after the read
    // completion); the fabric must be able to show it.
    let check = |faults: FaultConfig| {
        let mut stale_reads = 0;
        for seed in 0..40 {
            let mut p = Pair::new(seed, faults);
            let src = registered(
                &p.fabric,
                &mut p.dom_b,
                p.b,
                4096,
                Some(&[1; 4096]),
                Access::REMOTE_READ,
            );
            let sink = registered(
                &p.fabric,
                &mut p.dom_a,
                p.a,
                4096,
                None,
                Access::LOCAL_WRITE,
            );
            p.conn_b.post_recv(WrId(1), RecvSlot(0)).unwrap();
            let remote = src.remote_descriptor(src.range).unwrap();
            p.conn_a
                .post_read(WrId(2), segment(&sink, 0, 4096), remote)
                .unwrap();
            p.conn_a.post_send(WrId(3), b"done").unwrap();
            loop {
                assert!(p.fabric.step());
                if !drain(&mut p.conn_b).is_empty() {
                    // The (buggy) peer reuses its buffer as soon as "done" arrives.
                    p.fabric.write(p.b, src.range, &[2; 4096]).unwrap();
                    break;
                }
            }
            p.run();
            assert!(drain(&mut p.conn_a).iter().all(|c| c.status.is_ok()));
            if p.fabric.read(p.a, sink.range).unwrap() == vec![2; 4096] {
                stale_reads += 1;
            }
        }
        stale_reads
    };
    assert_eq!(
        check(FaultConfig::default()),
        0,
        "in order, the read always saw 1s"
    );
    let reordering = FaultConfig {
        reorder: 1.0,
        ..FaultConfig::default()
    };
    assert!(check(reordering) > 0);
}

/// Drives a fixed, busy scenario and returns every completion with its tick.
fn trace(seed: u64) -> Vec<(u64, u64, u64, Completion)> {
    let faults = FaultConfig {
        completion_delay: 0.3,
        reorder: 0.3,
        delayed_repost: 0.3,
        qp_error: 0.002,
        ..FaultConfig::default()
    };
    let fabric = SimFabric::new(seed, faults);
    let a = fabric.add_endpoint();
    let b = fabric.add_endpoint();
    let mut dom_a = fabric.domain(a);
    let mut dom_b = fabric.domain(b);
    let src = registered(
        &fabric,
        &mut dom_a,
        a,
        65536,
        Some(&pattern(65536, 9)),
        Access::NONE,
    );
    let sink = registered(&fabric, &mut dom_b, b, 65536, None, Access::REMOTE_WRITE);
    let mut conns: Vec<_> = (0..3)
        .map(|_| fabric.connect(a, b, SLOTS, SLOTS).unwrap())
        .collect();
    let mut events = Vec::new();
    for (i, (ca, cb)) in conns.iter_mut().enumerate() {
        post_all_recvs(cb, 0);
        for j in 0..6u64 {
            let _ = ca.post_send(WrId(j), &pattern(100, j as u8));
            let remote = sink.remote_descriptor(sink.range).unwrap();
            let _ = ca.post_write(
                WrId(100 + j),
                segment(&src, j * 1000, 1000 * (i as u64 + 1)),
                remote,
            );
        }
    }
    while fabric.step() {
        for (i, (ca, cb)) in conns.iter_mut().enumerate() {
            for (side, conn) in [(0, &mut *ca), (1, &mut *cb)] {
                for c in drain(conn) {
                    events.push((fabric.now(), i as u64, side, c));
                }
            }
        }
    }
    events
}

#[test]
fn the_same_seed_gives_the_same_run_and_different_seeds_differ() {
    let first = trace(42);
    assert!(first.len() > 20, "scenario too small: {}", first.len());
    assert_eq!(first, trace(42));
    let distinct = (0..5).filter(|&s| trace(s) != first).count();
    assert_eq!(distinct, 5, "every other seed schedules differently");
}

#[test]
fn the_trace_keeps_the_latest_happenings_within_its_capacity() {
    let mut p = Pair::new(9, FaultConfig::default());
    p.fabric.set_trace_capacity(4);
    post_all_recvs(&mut p.conn_b, 0);
    for i in 0..6 {
        p.conn_a.post_send(WrId(i), b"x").unwrap();
    }
    p.run();
    let trace = p.fabric.trace();
    assert_eq!(trace.len(), 4);
    assert!(trace.iter().all(|line| line.starts_with("t=")), "{trace:?}");
    assert!(
        trace.last().unwrap().contains("complete qp0 wr 5 send"),
        "{trace:?}"
    );
    p.fabric.inject_qp_error(p.conn_b.id()).unwrap();
    let trace = p.fabric.trace();
    assert!(
        trace.iter().any(|line| line.contains("qp1 enters error")),
        "{trace:?}"
    );
    p.fabric.set_trace_capacity(0);
    p.fabric.crash(p.a).unwrap();
    assert!(p.fabric.trace().is_empty(), "off means nothing recorded");
}
