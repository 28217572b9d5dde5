//! How fast the simulation itself runs (figures are printed, never asserted): the switch's
//! deterministic simulation runs thousands of seeds, so the fabric's own cost per message
//! and per byte bounds how many it can afford.
//!
//! `cargo bench -p san-sim --bench fabric`

use std::time::Instant;

use san_api::{
    Access, CompletionKind, LocalSegment, RecvSlot, SanConnection, SanDomain, SlotConfig, WrId,
};
use san_sim::{FaultConfig, SimFabric};

const SLOTS: SlotConfig = SlotConfig {
    send_slots: 16,
    recv_slots: 16,
    slot_size: 4096,
};

/// Streams `count` sends of `size` bytes with a full window, re-posting receives as they
/// complete. Returns (seconds, fabric events run).
fn stream_sends(faults: FaultConfig, count: u64, size: usize) -> (f64, u64) {
    let fabric = SimFabric::new(1, faults);
    let a = fabric.add_endpoint();
    let b = fabric.add_endpoint();
    let (mut tx, mut rx) = fabric.connect(a, b, SLOTS, SLOTS).unwrap();
    for slot in 0..SLOTS.recv_slots {
        rx.post_recv(WrId(0), RecvSlot(slot)).unwrap();
    }
    let message = vec![0x5a; size];
    let mut completions = Vec::new();
    let (mut posted, mut received, mut in_flight) = (0u64, 0u64, 0u16);
    let start = Instant::now();
    while received < count {
        while in_flight < SLOTS.send_slots && posted < count {
            tx.post_send(WrId(posted), &message).unwrap();
            posted += 1;
            in_flight += 1;
        }
        fabric.step();
        completions.clear();
        tx.poll_completions(&mut completions, 64);
        in_flight -= completions.len() as u16;
        completions.clear();
        rx.poll_completions(&mut completions, 64);
        for c in &completions {
            if let CompletionKind::Recv { slot, len } = c.kind {
                assert_eq!(rx.recv_slot(slot, len).len(), size);
                rx.post_recv(WrId(0), slot).unwrap();
                received += 1;
            }
        }
    }
    (start.elapsed().as_secs_f64(), fabric.steps())
}

/// RDMA-writes `count` buffers of `size` bytes. Returns seconds.
fn rdma_writes(count: u64, size: u64) -> f64 {
    let fabric = SimFabric::new(2, FaultConfig::default());
    let a = fabric.add_endpoint();
    let b = fabric.add_endpoint();
    let (mut tx, _rx) = fabric.connect(a, b, SLOTS, SLOTS).unwrap();
    let src = fabric.alloc(a, size).unwrap();
    fabric.write(a, src, &vec![7; size as usize]).unwrap();
    let sink = fabric.alloc(b, size).unwrap();
    let src_reg = fabric.domain(a).register(src, Access::NONE).unwrap();
    let sink_reg = fabric
        .domain(b)
        .register(sink, Access::REMOTE_WRITE)
        .unwrap();
    let remote = sink_reg.remote_descriptor(sink).unwrap();
    let mut completions = Vec::new();
    let start = Instant::now();
    for i in 0..count {
        let local = LocalSegment {
            range: src,
            lkey: src_reg.lkey,
        };
        tx.post_write(WrId(i), local, remote).unwrap();
        fabric.run_until_idle(usize::MAX);
        completions.clear();
        tx.poll_completions(&mut completions, 4);
        assert_eq!(completions[0].status, Ok(()));
    }
    start.elapsed().as_secs_f64()
}

fn main() {
    // `cargo bench` passes `--bench`; under `cargo test --all-targets` this runs as a quick
    // smoke test with a hundredth of the work.
    let scale = if std::env::args().any(|arg| arg == "--bench") {
        1
    } else {
        100
    };
    let faults = FaultConfig {
        completion_delay: 0.1,
        reorder: 0.1,
        delayed_repost: 0.1,
        ..FaultConfig::default()
    };
    for (name, config) in [("no faults", FaultConfig::default()), ("faults on", faults)] {
        for size in [64usize, 4096] {
            let count = 200_000 / scale;
            let (secs, steps) = stream_sends(config, count, size);
            println!(
                "sends {size:>5} B, {name:<9}: {:>8.0} messages/s, {:>8.0} events/s",
                count as f64 / secs,
                steps as f64 / secs
            );
        }
    }
    for size in [64 * 1024u64, 4 << 20] {
        let count = ((256 << 20) / size / scale).max(1);
        let secs = rdma_writes(count, size);
        println!(
            "rdma write {:>5} KiB: {:>8.0} MB/s of simulated copying, {:>8.0} writes/s",
            size / 1024,
            (count * size) as f64 / secs / 1e6,
            count as f64 / secs
        );
    }
}
