//! Session throughput over the `san-sim` fabric, per send size (64 B .. 4 MiB).
//!
//! `cargo bench -p switch --bench session_throughput` prints, per size: wall-clock MB/s and
//! messages/s of the whole stack (sessions + generic driver + registration cache + simulated
//! fabric, so this measures the switch's CPU cost per byte, not a network), the simulated
//! rate in virtual ticks (1 tick ≈ 1 µs in the fabric's timing model), and the split between
//! inline bytes and rendezvous (RDMA) bytes. Sends at or above the negotiated rendezvous
//! threshold use rendezvous (READ mode: the receiver can RDMA-read), with application
//! buffers registered through the cache and reused, as a real application would.
//! Figures are printed, never asserted.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Instant;

use common::{Pair, PairConfig};
use san_api::{Access, MemRange, SlotConfig};
use switch::error::{RecvError, SendError};
use switch::session::{Event, RecvFlags, SendFlags, SessionConfig};

const SIZES: [usize; 9] = [
    64,
    256,
    1024,
    4096,
    16 * 1024,
    64 * 1024,
    256 * 1024,
    1 << 20,
    4 << 20,
];

/// Bytes moved per size (more for small sizes would only repeat the same loop).
const BYTES_PER_SIZE: usize = 32 << 20;

struct Figures {
    messages: usize,
    bytes: u64,
    seconds: f64,
    ticks: u64,
    inline: u64,
    rendezvous: u64,
}

fn config() -> PairConfig {
    PairConfig {
        slots: SlotConfig {
            send_slots: 16,
            recv_slots: 32,
            slot_size: 4096,
        },
        session: SessionConfig {
            send_buffer: 256 * 1024,
            rendezvous_threshold: 64 * 1024,
            credit_update_threshold: 0,
            // As the intra-host sessions run: reads copy straight out of the slots, sends
            // straight into them.
            receive_in_slots: true,
            send_in_slots: true,
        },
        ..PairConfig::default()
    }
}

fn run(size: usize) -> Figures {
    let mut pair = Pair::established(config());
    let threshold = pair.a.session.rendezvous_threshold().unwrap() as usize;
    let messages = (BYTES_PER_SIZE / size).clamp(8, 100_000);
    let data = vec![0x5Au8; size];
    let mut sink = vec![0u8; size.min(256 * 1024)];

    // Rendezvous buffers, allocated once and registered through the cache each time (hits).
    let src = pair.fabric.alloc(pair.a.ep, size as u64).unwrap();
    pair.fabric.write(pair.a.ep, src, &data).unwrap();
    let dst = pair.fabric.alloc(pair.b.ep, size as u64).unwrap();

    let start_ticks = pair.fabric.now();
    let started = Instant::now();
    let mut received = 0u64;
    let total = (messages * size) as u64;
    for _ in 0..messages {
        if size >= threshold {
            let prefix = pair.a.session.max_rendezvous_prefix().min(size - 1);
            let rest = MemRange::new(src.addr + prefix as u64, (size - prefix) as u64);
            let registered = pair.a.register(rest, Access::REMOTE_READ).unwrap();
            pair.a
                .session
                .send_rendezvous(&data[..prefix], registered)
                .unwrap();
        } else {
            let mut sent = 0;
            while sent < size {
                let sending = pair.a.session.send_into_slots(
                    &data[sent..],
                    SendFlags::default(),
                    &mut pair.a.conn,
                );
                match sending {
                    Ok(n) => sent += n,
                    Err(SendError::WouldBlock) => {
                        pair.run();
                        received += drain(&mut pair, &mut sink, dst);
                    }
                    Err(e) => panic!("send: {e}"),
                }
            }
        }
        pair.run();
        received += drain(&mut pair, &mut sink, dst);
        pair.a.events.clear();
    }
    while received < total {
        pair.run();
        let got = drain(&mut pair, &mut sink, dst);
        assert!(got > 0, "stalled at {received} of {total}");
        received += got;
    }
    let seconds = started.elapsed().as_secs_f64();
    let stats = pair.a.session.stats();
    Figures {
        messages,
        bytes: total,
        seconds,
        ticks: pair.fabric.now() - start_ticks,
        inline: stats.bytes_inline,
        rendezvous: stats.bytes_rendezvous,
    }
}

/// Receives everything available at B: inline into `buf`, remote segments zero-copy into
/// `dst` (registered through the cache, reused).
fn drain(pair: &mut Pair, buf: &mut [u8], dst: MemRange) -> u64 {
    let mut got = 0u64;
    loop {
        match pair
            .b
            .session
            .recv_from_slots(buf, RecvFlags::default(), &pair.b.conn)
        {
            Ok(0) | Err(RecvError::WouldBlock) => return got,
            Ok(n) => got += n as u64,
            Err(RecvError::RemoteSegment { len }) => {
                let range = MemRange::new(dst.addr, len.min(dst.len));
                let registered = pair.b.register(range, Access::LOCAL_WRITE).unwrap();
                let ticket = pair
                    .b
                    .session
                    .post_recv(registered, RecvFlags::default())
                    .unwrap();
                pair.run();
                let done = pair.b.events.iter().find_map(|e| match e {
                    Event::RecvComplete { ticket: t, result } if *t == ticket => Some(*result),
                    _ => None,
                });
                pair.b.events.clear();
                got += done.expect("receive completed").expect("receive succeeded");
            }
            Err(e) => panic!("recv: {e}"),
        }
    }
}

fn main() {
    // `cargo test --benches` runs this binary with `--bench` absent: keep that quick.
    let quick = !std::env::args().any(|a| a == "--bench");
    println!(
        "{:>9} {:>8} {:>10} {:>12} {:>12} {:>9} {:>9}",
        "size", "msgs", "wall MB/s", "wall msg/s", "sim MB/s", "inline%", "rndv%"
    );
    for size in SIZES {
        if quick && size > 64 * 1024 {
            continue;
        }
        let f = run(size);
        let mb = f.bytes as f64 / 1e6;
        let moved = (f.inline + f.rendezvous).max(1) as f64;
        println!(
            "{:>9} {:>8} {:>10.1} {:>12.0} {:>12.1} {:>8.1}% {:>8.1}%",
            size,
            f.messages,
            mb / f.seconds,
            f.messages as f64 / f.seconds,
            // ticks are microseconds in the timing model: bytes per µs = MB/s.
            f.bytes as f64 / f.ticks.max(1) as f64,
            100.0 * f.inline as f64 / moved,
            100.0 * f.rendezvous as f64 / moved,
        );
    }
}
