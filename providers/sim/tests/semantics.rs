//! The "Required behaviour" of `san-api`, checked on the simulated fabric without faults:
//! ordering, one completion per work request, slot accounting, RDMA data movement.

mod common;

use std::collections::BTreeMap;

use common::*;
use san_api::{
    Access, Capabilities, CompletionKind, PostError, RecvSlot, RemoteDescriptor, SanConnection,
    SlotConfig, WrId,
};
use san_sim::{FaultConfig, SimFabric};

#[test]
fn sends_arrive_in_posting_order_with_exactly_one_completion_each() {
    for seed in 0..20 {
        let mut p = Pair::new(seed, FaultConfig::default());
        let total = 200u64;
        let mut received = Vec::new();
        let mut send_completions: BTreeMap<u64, usize> = BTreeMap::new();
        let mut recv_completions: BTreeMap<u64, usize> = BTreeMap::new();
        let mut next_send = 0u64;
        let mut next_recv_wr = 1_000_000u64;
        let mut in_flight = 0u16;
        post_all_recvs(&mut p.conn_b, next_recv_wr);
        next_recv_wr += 100;
        while received.len() < total as usize {
            // Keep the send window full: the message carries its own sequence number.
            while in_flight < SLOTS.send_slots && next_send < total {
                let len = (next_send % 37) as usize + 8;
                let mut message = next_send.to_le_bytes().to_vec();
                message.resize(len, next_send as u8);
                p.conn_a.post_send(WrId(next_send), &message).unwrap();
                next_send += 1;
                in_flight += 1;
            }
            assert!(p.fabric.step(), "fabric went idle with work outstanding");
            for c in drain(&mut p.conn_a) {
                assert_eq!(c.status, Ok(()));
                assert_eq!(c.kind, CompletionKind::Send);
                *send_completions.entry(c.wr_id.0).or_default() += 1;
                in_flight -= 1;
            }
            for c in drain(&mut p.conn_b) {
                assert_eq!(c.status, Ok(()));
                *recv_completions.entry(c.wr_id.0).or_default() += 1;
                let bytes = recv_bytes(&p.conn_b, &c);
                let seq = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                assert_eq!(bytes.len(), (seq % 37) as usize + 8);
                received.push(seq);
                let CompletionKind::Recv { slot, .. } = c.kind else {
                    unreachable!()
                };
                p.conn_b.post_recv(WrId(next_recv_wr), slot).unwrap();
                next_recv_wr += 1;
            }
        }
        p.run();
        for c in drain(&mut p.conn_a) {
            *send_completions.entry(c.wr_id.0).or_default() += 1;
        }
        assert_eq!(received, (0..total).collect::<Vec<_>>(), "seed {seed}");
        assert_eq!(send_completions.len(), total as usize);
        assert!(send_completions.values().all(|&n| n == 1));
        assert!(recv_completions.values().all(|&n| n == 1));
        let counters = p.fabric.counters(p.a);
        assert_eq!(counters.messages_sent, total);
        assert_eq!(p.fabric.counters(p.b).messages_received, total);
    }
}

#[test]
fn sends_consume_receives_in_the_order_they_were_posted() {
    let mut p = Pair::new(1, FaultConfig::default());
    for (wr, slot) in [(10, 5), (11, 2), (12, 7)] {
        p.conn_b.post_recv(WrId(wr), RecvSlot(slot)).unwrap();
    }
    for (i, word) in [&b"first"[..], b"second", b"third"].iter().enumerate() {
        p.conn_a.post_send(WrId(i as u64), word).unwrap();
    }
    p.run();
    let got: Vec<(u64, CompletionKind, Vec<u8>)> = drain(&mut p.conn_b)
        .iter()
        .map(|c| (c.wr_id.0, c.kind, recv_bytes(&p.conn_b, c)))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                10,
                CompletionKind::Recv {
                    slot: RecvSlot(5),
                    len: 5
                },
                b"first".to_vec()
            ),
            (
                11,
                CompletionKind::Recv {
                    slot: RecvSlot(2),
                    len: 6
                },
                b"second".to_vec()
            ),
            (
                12,
                CompletionKind::Recv {
                    slot: RecvSlot(7),
                    len: 5
                },
                b"third".to_vec()
            ),
        ]
    );
}

#[test]
fn slot_bytes_stay_valid_until_the_slot_is_posted_again() {
    let mut p = Pair::new(2, FaultConfig::default());
    p.conn_b.post_recv(WrId(1), RecvSlot(3)).unwrap();
    p.conn_a.post_send(WrId(2), b"payload").unwrap();
    p.run();
    assert_eq!(
        p.conn_b.recv_slot(RecvSlot(3), 7),
        b"",
        "not handed out yet"
    );
    let completions = drain(&mut p.conn_b);
    assert_eq!(completions.len(), 1);
    // Still readable after more fabric activity (a send that finds no receive posted and
    // keeps retrying), and shorter reads are prefixes.
    p.conn_a.post_send(WrId(3), b"other").unwrap();
    p.fabric.run_until(p.fabric.now() + 30);
    assert!(p.fabric.counters(p.a).rnr_retries > 0);
    assert_eq!(p.conn_b.recv_slot(RecvSlot(3), 7), b"payload");
    assert_eq!(p.conn_b.recv_slot(RecvSlot(3), 3), b"pay");
    p.conn_b.post_recv(WrId(4), RecvSlot(3)).unwrap();
    // The pending "other" send retries (RNR) and lands now; before the completion is
    // handed out the slot shows nothing.
    assert_eq!(p.conn_b.recv_slot(RecvSlot(3), 7), b"");
    p.run();
    let completions = drain(&mut p.conn_b);
    assert_eq!(completions.len(), 1);
    assert_eq!(recv_bytes(&p.conn_b, &completions[0]), b"other");
}

#[test]
fn send_slots_bound_sends_in_flight_until_their_completions_are_polled() {
    let mut p = Pair::new(3, FaultConfig::default());
    post_all_recvs(&mut p.conn_b, 100);
    for i in 0..SLOTS.send_slots {
        p.conn_a.post_send(WrId(u64::from(i)), b"x").unwrap();
    }
    assert_eq!(
        p.conn_a.post_send(WrId(99), b"x"),
        Err(PostError::QueueFull)
    );
    p.run();
    // Completed but not handed out: the slots are still the switch's.
    assert_eq!(
        p.conn_a.post_send(WrId(99), b"x"),
        Err(PostError::QueueFull)
    );
    let mut out = Vec::new();
    assert_eq!(p.conn_a.poll_completions(&mut out, 2), 2);
    p.conn_a.post_send(WrId(100), b"x").unwrap();
    p.conn_a.post_send(WrId(101), b"x").unwrap();
    assert_eq!(
        p.conn_a.post_send(WrId(102), b"x"),
        Err(PostError::QueueFull)
    );
}

#[test]
fn posting_errors_follow_the_contract() {
    let mut p = Pair::new(4, FaultConfig::default());
    p.conn_b.post_recv(WrId(1), RecvSlot(0)).unwrap();
    assert_eq!(
        p.conn_b.post_recv(WrId(2), RecvSlot(0)),
        Err(PostError::QueueFull)
    );
    assert_eq!(
        p.conn_b.post_recv(WrId(3), RecvSlot(SLOTS.recv_slots)),
        Err(PostError::InvalidArgument)
    );
    let too_long = vec![0u8; SLOTS.slot_size as usize + 1];
    assert_eq!(
        p.conn_a.post_send(WrId(4), &too_long),
        Err(PostError::TooLong)
    );
    p.conn_a
        .post_send(WrId(5), &too_long[..SLOTS.slot_size as usize])
        .unwrap();
    p.conn_a.post_send(WrId(6), b"").unwrap();
    p.conn_b.post_recv(WrId(7), RecvSlot(1)).unwrap();
    p.run();
    let lens: Vec<CompletionKind> = drain(&mut p.conn_b).iter().map(|c| c.kind).collect();
    assert_eq!(
        lens,
        vec![
            CompletionKind::Recv {
                slot: RecvSlot(0),
                len: SLOTS.slot_size
            },
            CompletionKind::Recv {
                slot: RecvSlot(1),
                len: 0
            },
        ]
    );
}

#[test]
fn rdma_write_lands_exactly_at_the_target_offset() {
    let mut p = Pair::new(5, FaultConfig::default());
    let source = pattern(10_000, 7);
    let src = registered(
        &p.fabric,
        &mut p.dom_a,
        p.a,
        10_000,
        Some(&source),
        Access::NONE,
    );
    let sink_fill = vec![0xEE; 20_000];
    let sink = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        20_000,
        Some(&sink_fill),
        Access::REMOTE_WRITE,
    );
    // Bytes 1000..7000 of the source go to offset 5000 of the sink (crossing pages).
    let remote = sink
        .remote_descriptor(sink.range.slice(5_000, 6_000).unwrap())
        .unwrap();
    p.conn_a
        .post_write(WrId(1), segment(&src, 1_000, 6_000), remote)
        .unwrap();
    p.run();
    let completions = drain(&mut p.conn_a);
    assert_eq!(completions.len(), 1);
    assert_eq!(completions[0].kind, CompletionKind::Write);
    assert_eq!(completions[0].status, Ok(()));
    let after = p.fabric.read(p.b, sink.range).unwrap();
    assert!(
        after[..5_000].iter().all(|&b| b == 0xEE),
        "before the target untouched"
    );
    assert_eq!(&after[5_000..11_000], &source[1_000..7_000]);
    assert!(
        after[11_000..].iter().all(|&b| b == 0xEE),
        "after the target untouched"
    );
    let counters = p.fabric.counters(p.a);
    assert_eq!(
        (counters.rdma_writes, counters.bytes_rdma_written),
        (1, 6_000)
    );
    assert!(
        drain(&mut p.conn_b).is_empty(),
        "a write completes only at the writer"
    );
}

#[test]
fn rdma_read_fetches_exactly_the_named_remote_bytes_into_the_sink() {
    let mut p = Pair::new(6, FaultConfig::default());
    let source = pattern(9_000, 3);
    let src = registered(
        &p.fabric,
        &mut p.dom_b,
        p.b,
        9_000,
        Some(&source),
        Access::REMOTE_READ,
    );
    let sink = registered(
        &p.fabric,
        &mut p.dom_a,
        p.a,
        9_000,
        None,
        Access::LOCAL_WRITE,
    );
    let remote = src
        .remote_descriptor(src.range.slice(4_000, 5_000).unwrap())
        .unwrap();
    p.conn_a
        .post_read(WrId(9), segment(&sink, 100, 4_500), remote)
        .unwrap();
    p.run();
    let completions = drain(&mut p.conn_a);
    assert_eq!(completions.len(), 1);
    assert_eq!(
        (completions[0].kind, completions[0].status),
        (CompletionKind::Read, Ok(()))
    );
    let after = p.fabric.read(p.a, sink.range).unwrap();
    assert!(after[..100].iter().all(|&b| b == 0));
    assert_eq!(&after[100..4_600], &source[4_000..8_500]);
    assert!(after[4_600..].iter().all(|&b| b == 0));
    assert_eq!(p.fabric.counters(p.a).bytes_rdma_read, 4_500);
}

#[test]
fn rdma_write_data_is_visible_when_a_later_send_arrives_even_with_every_fault_on() {
    let faults = FaultConfig {
        completion_delay: 0.5,
        reorder: 0.5,
        delayed_repost: 0.3,
        ..FaultConfig::default()
    };
    for seed in 0..50 {
        let mut p = Pair::new(seed, faults);
        let src = registered(&p.fabric, &mut p.dom_a, p.a, 64 * 1024, None, Access::NONE);
        let sink = registered(
            &p.fabric,
            &mut p.dom_b,
            p.b,
            64 * 1024,
            None,
            Access::REMOTE_WRITE,
        );
        post_all_recvs(&mut p.conn_b, 1_000);
        for round in 0..6u8 {
            let bytes = pattern(64 * 1024, round);
            p.fabric.write(p.a, src.range, &bytes).unwrap();
            let remote = sink.remote_descriptor(sink.range).unwrap();
            p.conn_a
                .post_write(
                    WrId(u64::from(round) * 2),
                    segment(&src, 0, 64 * 1024),
                    remote,
                )
                .unwrap();
            p.conn_a
                .post_send(WrId(u64::from(round) * 2 + 1), &[round])
                .unwrap();
            // Run until the "done" message is received, then check the data at once.
            loop {
                assert!(
                    p.fabric.step(),
                    "seed {seed}: idle before the message arrived"
                );
                let got = drain(&mut p.conn_b);
                if let Some(c) = got.first() {
                    assert_eq!(recv_bytes(&p.conn_b, c), vec![round]);
                    assert_eq!(
                        p.fabric.read(p.b, sink.range).unwrap(),
                        bytes,
                        "seed {seed}"
                    );
                    let CompletionKind::Recv { slot, .. } = c.kind else {
                        unreachable!()
                    };
                    p.conn_b
                        .post_recv(WrId(5_000 + u64::from(round)), slot)
                        .unwrap();
                    break;
                }
            }
            // The source may only be rewritten once the write completed.
            p.run();
            let done = drain(&mut p.conn_a);
            assert_eq!(done.len(), 2);
            assert!(done.iter().all(|c| c.status == Ok(())));
        }
    }
}

#[test]
fn rdma_posts_with_malformed_segments_are_invalid_arguments() {
    let mut p = Pair::new(7, FaultConfig::default());
    let src = registered(
        &p.fabric,
        &mut p.dom_a,
        p.a,
        4096,
        None,
        Access::LOCAL_WRITE,
    );
    let remote = RemoteDescriptor {
        addr: 0x1000,
        len: 100,
        rkey: san_api::RemoteKey(1),
    };
    assert_eq!(
        p.conn_a.post_write(WrId(1), segment(&src, 0, 0), remote),
        Err(PostError::InvalidArgument),
        "empty segment"
    );
    assert_eq!(
        p.conn_a.post_write(WrId(2), segment(&src, 0, 101), remote),
        Err(PostError::InvalidArgument),
        "remote shorter than local"
    );
    assert_eq!(
        p.conn_a.post_read(WrId(3), segment(&src, 0, 101), remote),
        Err(PostError::InvalidArgument)
    );
    p.run();
    assert!(
        drain(&mut p.conn_a).is_empty(),
        "rejected posts complete nothing"
    );
}

#[test]
fn read_less_endpoints_refuse_rdma_reads_and_iwarp_sinks_need_remote_write() {
    let fabric = SimFabric::new(8, FaultConfig::default());
    let no_read = fabric.add_endpoint();
    let iwarp = fabric.add_endpoint();
    let peer = fabric.add_endpoint();
    let base = fabric.capabilities(no_read);
    fabric
        .set_capabilities(
            no_read,
            Capabilities {
                rdma_read: false,
                ..base
            },
        )
        .unwrap();
    fabric
        .set_capabilities(
            iwarp,
            Capabilities {
                read_sink_needs_remote_write: true,
                ..base
            },
        )
        .unwrap();
    let slots = SlotConfig {
        send_slots: 2,
        recv_slots: 2,
        slot_size: 64,
    };
    let (mut conn_nr, _peer_nr) = fabric.connect(no_read, peer, slots, slots).unwrap();
    let (mut conn_iw, _peer_iw) = fabric.connect(iwarp, peer, slots, slots).unwrap();
    assert!(!conn_nr.capabilities().rdma_read);
    assert!(conn_iw.capabilities().read_sink_needs_remote_write);

    let mut peer_dom = fabric.domain(peer);
    let src = registered(
        &fabric,
        &mut peer_dom,
        peer,
        4096,
        None,
        Access::REMOTE_READ,
    );
    let remote = src.remote_descriptor(src.range).unwrap();
    let mut nr_dom = fabric.domain(no_read);
    let sink_nr = registered(
        &fabric,
        &mut nr_dom,
        no_read,
        4096,
        None,
        Access::LOCAL_WRITE,
    );
    assert_eq!(
        conn_nr.post_read(WrId(1), segment(&sink_nr, 0, 4096), remote),
        Err(PostError::InvalidArgument)
    );

    let mut iw_dom = fabric.domain(iwarp);
    let sink_iw = registered(&fabric, &mut iw_dom, iwarp, 4096, None, Access::LOCAL_WRITE);
    conn_iw
        .post_read(WrId(2), segment(&sink_iw, 0, 4096), remote)
        .unwrap();
    fabric.run_until_idle(10_000);
    let completions = drain(&mut conn_iw);
    assert_eq!(completions.len(), 1);
    assert_eq!(
        completions[0].status,
        Err(san_api::CompletionError::LocalProtection)
    );
    let violations = fabric.violations();
    assert_eq!(violations.len(), 1);
    assert!(matches!(
        violations[0].kind,
        san_sim::ViolationKind::MissingLocalRights { .. }
    ));

    // Registered as the iWARP rule asks, the same read works.
    let (mut conn_iw2, _peer_iw2) = fabric.connect(iwarp, peer, slots, slots).unwrap();
    let sink_ok = registered(
        &fabric,
        &mut iw_dom,
        iwarp,
        4096,
        None,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
    );
    conn_iw2
        .post_read(WrId(3), segment(&sink_ok, 0, 4096), remote)
        .unwrap();
    fabric.run_until_idle(10_000);
    assert_eq!(drain(&mut conn_iw2)[0].status, Ok(()));
}

#[test]
fn completions_of_different_connections_interleave() {
    // Two connections posting at the same time: over seeds, each one sometimes finishes
    // first (the schedule is seeded, not connection-ordered).
    let mut first_finisher = [0usize; 2];
    for seed in 0..40 {
        let fabric = SimFabric::new(seed, FaultConfig::default());
        let a = fabric.add_endpoint();
        let b = fabric.add_endpoint();
        let mut conns: Vec<_> = (0..2)
            .map(|_| fabric.connect(a, b, SLOTS, SLOTS).unwrap())
            .collect();
        for (i, (conn_a, conn_b)) in conns.iter_mut().enumerate() {
            conn_b.post_recv(WrId(0), RecvSlot(0)).unwrap();
            conn_a.post_send(WrId(i as u64), b"go").unwrap();
        }
        let winner = loop {
            assert!(fabric.step());
            let done: Vec<usize> = (0..2)
                .filter(|&i| !drain(&mut conns[i].1).is_empty())
                .collect();
            if let Some(&i) = done.first() {
                break i;
            }
        };
        first_finisher[winner] += 1;
    }
    assert!(
        first_finisher[0] > 0 && first_finisher[1] > 0,
        "{first_finisher:?}"
    );
}

#[test]
fn a_message_longer_than_the_receivers_slots_breaks_the_connection() {
    let fabric = SimFabric::new(9, FaultConfig::default());
    let a = fabric.add_endpoint();
    let b = fabric.add_endpoint();
    let small = SlotConfig {
        slot_size: 16,
        ..SLOTS
    };
    let (mut conn_a, mut conn_b) = fabric.connect(a, b, SLOTS, small).unwrap();
    conn_b.post_recv(WrId(1), RecvSlot(0)).unwrap();
    conn_a.post_send(WrId(2), &[0; 17]).unwrap();
    fabric.run_until_idle(1_000);
    assert_eq!(
        drain(&mut conn_a)[0].status,
        Err(san_api::CompletionError::Fatal)
    );
    let at_b = drain(&mut conn_b);
    assert_eq!(at_b[0].status, Err(san_api::CompletionError::Flushed));
    assert_eq!(conn_b.recv_slot(RecvSlot(0), 17), b"", "no partial message");
}

#[test]
fn slot_configurations_beyond_the_endpoints_capabilities_are_refused() {
    let fabric = SimFabric::new(10, FaultConfig::default());
    let a = fabric.add_endpoint();
    let b = fabric.add_endpoint();
    let caps = fabric.capabilities(a);
    let too_big = SlotConfig {
        slot_size: caps.max_slot_size + 1,
        ..SLOTS
    };
    let too_many = SlotConfig {
        recv_slots: caps.max_slots + 1,
        ..SLOTS
    };
    let none = SlotConfig {
        send_slots: 0,
        ..SLOTS
    };
    for bad in [too_big, too_many, none] {
        assert_eq!(
            fabric.connect(a, b, SLOTS, bad).err(),
            Some(san_sim::SimError::InvalidSlotConfig)
        );
    }
    assert!(fabric.connect(a, b, SLOTS, SLOTS).is_ok());
}
