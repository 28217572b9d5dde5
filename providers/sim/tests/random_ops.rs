//! Randomised workloads under every random fault at once: the contract's invariants must
//! hold for every seed (exactly one completion per request, sends delivered as an in-order
//! prefix, successful sends delivered, RDMA data exact, no violations from correct use).

mod common;

use std::collections::BTreeMap;

use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use san_api::{Access, CompletionKind, RecvSlot, Registration, SanConnection, SlotConfig, WrId};
use san_sim::{FaultConfig, SimConnection, SimFabric};

const FAULTS: FaultConfig = FaultConfig {
    completion_delay: 0.2,
    completion_delay_max_ticks: 300,
    reorder: 0.2,
    reorder_max_ticks: 40,
    delayed_repost: 0.2,
    repost_delay_max_ticks: 30,
    registration_failure: 0.0,
    qp_error: 0.002,
};

const SLOTS: SlotConfig = SlotConfig {
    send_slots: 4,
    recv_slots: 4,
    slot_size: 64,
};

/// One direction of a connection as the test sees it.
#[derive(Default)]
struct Direction {
    next_seq: u64,
    delivered: u64,
    /// wr_id → message sequence number of posted sends.
    sends: BTreeMap<u64, u64>,
}

struct Side {
    conn: SimConnection,
    /// Outstanding requests by wr_id (removed at their completion).
    outstanding: BTreeMap<u64, &'static str>,
    sends_in_flight: u16,
    /// Sends from this side.
    out: Direction,
    source: Registration,
    sink: Registration,
    /// The bytes each outstanding RDMA write must leave in the peer's sink.
    expected_writes: BTreeMap<u64, (u64, Vec<u8>)>,
}

#[test]
fn random_workloads_under_random_faults_keep_the_contract() {
    let (mut broken_runs, mut delivered, mut rnr_retries) = (0, 0, 0);
    for seed in 0..150u64 {
        let outcome = run_seed(seed);
        broken_runs += usize::from(outcome.broken);
        delivered += outcome.delivered;
        rnr_retries += outcome.rnr_retries;
    }
    // The workload must actually have exercised both healthy and broken connections.
    assert!(
        broken_runs > 0 && broken_runs < 150,
        "{broken_runs} of 150 runs broke"
    );
    assert!(delivered > 150 * 50, "only {delivered} messages delivered");
    assert!(rnr_retries > 0);
}

struct Outcome {
    broken: bool,
    delivered: u64,
    rnr_retries: u64,
}

fn run_seed(seed: u64) -> Outcome {
    let fabric = SimFabric::new(seed, FAULTS);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xfeed);
    let eps = [fabric.add_endpoint(), fabric.add_endpoint()];
    let mut sides: Vec<Side> = Vec::new();
    let (conn_a, conn_b) = fabric.connect(eps[0], eps[1], SLOTS, SLOTS).unwrap();
    for (ep, conn) in [(eps[0], conn_a), (eps[1], conn_b)] {
        let mut domain = fabric.domain(ep);
        let source = registered(&fabric, &mut domain, ep, 16 * 1024, None, Access::NONE);
        let sink = registered(
            &fabric,
            &mut domain,
            ep,
            16 * 1024,
            None,
            Access::REMOTE_WRITE,
        );
        sides.push(Side {
            conn,
            outstanding: BTreeMap::new(),
            sends_in_flight: 0,
            out: Direction::default(),
            source,
            sink,
            expected_writes: BTreeMap::new(),
        });
    }
    let mut next_wr = 0u64;
    for side in &mut sides {
        for slot in 0..SLOTS.recv_slots {
            side.conn.post_recv(WrId(next_wr), RecvSlot(slot)).unwrap();
            side.outstanding.insert(next_wr, "recv");
            next_wr += 1;
        }
    }
    let mut write_busy = [false, false];
    for _ in 0..400 {
        let who = rng.gen_range(0..2usize);
        let peer = 1 - who;
        match rng.gen_range(0..4) {
            0 | 1 if sides[who].sends_in_flight < SLOTS.send_slots => {
                let side = &mut sides[who];
                let seq = side.out.next_seq;
                let len = rng.gen_range(8..=64usize);
                let mut message = seq.to_le_bytes().to_vec();
                message.resize(len, seq as u8);
                if side.conn.post_send(WrId(next_wr), &message).is_ok() {
                    side.out.sends.insert(next_wr, seq);
                    side.out.next_seq += 1;
                    side.outstanding.insert(next_wr, "send");
                    side.sends_in_flight += 1;
                }
                next_wr += 1;
            }
            2 if !write_busy[who] => {
                // One write in flight per direction, so the expected sink content is exact.
                let len = rng.gen_range(1..=16 * 1024u64);
                let offset = rng.gen_range(0..=16 * 1024 - len);
                let bytes = pattern(len as usize, rng.gen());
                let source = sides[who].source;
                fabric
                    .write(eps[who], source.range.slice(0, len).unwrap(), &bytes)
                    .unwrap();
                let sink = sides[peer].sink;
                let remote = sink
                    .remote_descriptor(sink.range.slice(offset, len).unwrap())
                    .unwrap();
                let side = &mut sides[who];
                if side
                    .conn
                    .post_write(WrId(next_wr), segment(&source, 0, len), remote)
                    .is_ok()
                {
                    side.outstanding.insert(next_wr, "write");
                    side.expected_writes.insert(next_wr, (offset, bytes));
                    write_busy[who] = true;
                }
                next_wr += 1;
            }
            _ => {
                fabric.step();
            }
        }
        for who in 0..2 {
            next_wr = drain_side(
                &fabric,
                &mut sides,
                who,
                eps,
                next_wr,
                &mut write_busy,
                seed,
            );
        }
    }
    // Let everything finish (faults keep delaying but never stall forever).
    let mut rounds = 0;
    while fabric.step()
        || sides
            .iter()
            .any(|s| !s.outstanding.is_empty() && !s.conn.is_broken())
    {
        rounds += 1;
        assert!(rounds < 1_000_000, "seed {seed}: no progress");
        for who in 0..2 {
            next_wr = drain_side(
                &fabric,
                &mut sides,
                who,
                eps,
                next_wr,
                &mut write_busy,
                seed,
            );
        }
        if fabric.is_idle() {
            break;
        }
    }
    for who in 0..2 {
        drain_side(
            &fabric,
            &mut sides,
            who,
            eps,
            next_wr,
            &mut write_busy,
            seed,
        );
    }
    let broken = sides[0].conn.is_broken();
    for side in &sides {
        if broken {
            assert!(
                side.outstanding.is_empty(),
                "seed {seed}: {:?}",
                side.outstanding
            );
        } else {
            // Only the re-posted receives remain.
            assert!(
                side.outstanding.values().all(|&what| what == "recv"),
                "seed {seed}"
            );
        }
    }
    assert_eq!(fabric.violations(), vec![], "seed {seed}");
    Outcome {
        broken,
        delivered: sides[0].out.delivered + sides[1].out.delivered,
        rnr_retries: fabric.counters(eps[0]).rnr_retries + fabric.counters(eps[1]).rnr_retries,
    }
}

/// Takes every completion of side `who`, checking them; re-posts consumed receives.
fn drain_side(
    fabric: &SimFabric,
    sides: &mut [Side],
    who: usize,
    eps: [san_sim::EndpointId; 2],
    mut next_wr: u64,
    write_busy: &mut [bool; 2],
    seed: u64,
) -> u64 {
    let peer = 1 - who;
    for c in drain(&mut sides[who].conn) {
        let what = sides[who]
            .outstanding
            .remove(&c.wr_id.0)
            .unwrap_or_else(|| panic!("seed {seed}: unknown or repeated completion {c:?}"));
        match c.kind {
            CompletionKind::Send => {
                assert_eq!(what, "send");
                sides[who].sends_in_flight -= 1;
                let seq = sides[who].out.sends[&c.wr_id.0];
                if c.status.is_ok() {
                    assert!(
                        seq < sides[who].out.delivered,
                        "seed {seed}: send {seq} completed OK but was not delivered"
                    );
                }
            }
            CompletionKind::Recv { slot, len } => {
                assert_eq!(what, "recv");
                if c.status.is_ok() {
                    let bytes = sides[who].conn.recv_slot(slot, len).to_vec();
                    let seq = u64::from_le_bytes(bytes[..8].try_into().unwrap());
                    let expected = sides[peer].out.delivered;
                    assert_eq!(seq, expected, "seed {seed}: out-of-order or lost message");
                    sides[peer].out.delivered += 1;
                    if sides[who].conn.post_recv(WrId(next_wr), slot).is_ok() {
                        sides[who].outstanding.insert(next_wr, "recv");
                    }
                    next_wr += 1;
                }
            }
            CompletionKind::Write => {
                assert_eq!(what, "write");
                write_busy[who] = false;
                let (offset, bytes) = sides[who].expected_writes.remove(&c.wr_id.0).unwrap();
                if c.status.is_ok() {
                    let sink = sides[peer].sink;
                    let landed = fabric
                        .read(
                            eps[peer],
                            sink.range.slice(offset, bytes.len() as u64).unwrap(),
                        )
                        .unwrap();
                    assert!(landed == bytes, "seed {seed}: write landed wrong bytes");
                }
            }
            CompletionKind::Read => panic!("seed {seed}: no reads were posted"),
        }
    }
    next_wr
}
