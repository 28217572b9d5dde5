//! Two-process benchmark of the shared-memory provider (`cargo bench -p san-shm`).
//!
//! * 64-byte ping-pong over `ShmConnection` with the adaptive wait, and again with spinning
//!   disabled (always sleep on the futex): median/p99 round-trip time and CPU time per round
//!   trip (both processes).
//! * RDMA read bandwidth over CMA for 4 KiB .. 4 MiB.
//!
//! The binary re-executes itself as the peer (environment variable `SAN_SHM_BENCH_PEER`).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use san_api::{
    Access, Completion, CompletionKind, LocalSegment, MemRange, RecvSlot, RemoteDescriptor,
    RemoteKey,
};
use san_api::{SanConnection, SanDomain, SlotConfig, WrId};
use san_shm::{
    ConnectionConfig, SegmentConfig, ShmConnection, ShmDir, ShmDomain, ShmSegment, WaitResult,
};

const PEER_ENV: &str = "SAN_SHM_BENCH_PEER";
const SPIN_ENV: &str = "SAN_SHM_BENCH_SPIN_US";
const ROUNDS: usize = 20_000;
const RDMA_BUFFER: usize = 4 << 20;

struct Link {
    conn: ShmConnection,
    completions: Vec<Completion>,
    next_wr: u64,
}

impl Link {
    fn new(conn: ShmConnection) -> Link {
        let mut link = Link {
            conn,
            completions: Vec::new(),
            next_wr: 0,
        };
        for slot in 0..link.conn.slot_config().recv_slots {
            link.conn
                .post_recv(WrId(0), RecvSlot(slot))
                .expect("post receive");
        }
        link
    }

    fn send(&mut self, bytes: &[u8]) {
        self.next_wr += 1;
        while self.conn.post_send(WrId(self.next_wr), bytes).is_err() {
            assert!(self.conn.is_up(), "connection went down");
            self.completions.clear();
            self.conn.poll_completions(&mut self.completions, 64);
        }
    }

    /// Waits for the next message, copies it into `out`, re-posts its slot.
    fn recv(&mut self, out: &mut Vec<u8>) {
        loop {
            self.completions.clear();
            self.conn.poll_completions(&mut self.completions, 64);
            let mut got = false;
            for completion in std::mem::take(&mut self.completions) {
                if let CompletionKind::Recv { slot, len } = completion.kind {
                    assert!(
                        completion.status.is_ok(),
                        "receive failed: {:?}",
                        completion.status
                    );
                    out.clear();
                    out.extend_from_slice(self.conn.recv_slot(slot, len));
                    self.conn.post_recv(WrId(0), slot).expect("repost");
                    got = true;
                }
            }
            if got {
                return;
            }
            assert_ne!(
                self.conn.wait(Duration::from_secs(10)),
                WaitResult::Disconnected,
                "peer gone"
            );
        }
    }
}

fn config(spin: Duration) -> ConnectionConfig {
    ConnectionConfig {
        spin_limit: spin,
        rnr_timeout: Duration::from_secs(5),
        ..ConnectionConfig::default()
    }
}

fn peer(dir: &ShmDir, spin: Duration) {
    let mut domain = ShmDomain::default();
    let segment = ShmSegment::attach(dir, "bench").expect("attach");
    let mut link =
        Link::new(ShmConnection::new(segment, &domain, config(spin)).expect("connection"));
    let buffer = vec![0x5Au8; RDMA_BUFFER];
    let range = MemRange::new(buffer.as_ptr() as u64, RDMA_BUFFER as u64);
    let reg = domain
        .register(range, Access::REMOTE_READ)
        .expect("register");
    let mut message = Vec::new();
    loop {
        link.recv(&mut message);
        match message.first() {
            Some(b'P') => link.send(&message),
            Some(b'D') => {
                let mut reply = reg.rkey.map_or(0, |k| k.0).to_le_bytes().to_vec();
                reply.extend_from_slice(&range.addr.to_le_bytes());
                link.send(&reply);
            }
            Some(b'C') => {
                let cpu = san_shm::process_cpu_time().as_nanos() as u64;
                link.send(&cpu.to_le_bytes());
            }
            _ => break,
        }
    }
    link.completions.clear();
    link.conn.poll_completions(&mut link.completions, 64);
}

fn start(dir: &ShmDir, spin: Duration) -> (Link, ShmDomain, std::process::Child) {
    let segment = ShmSegment::create(
        dir,
        "bench",
        &SegmentConfig::new(SlotConfig {
            send_slots: 16,
            recv_slots: 16,
            slot_size: 256,
        }),
    )
    .expect("create segment");
    let domain = ShmDomain::default();
    let conn = ShmConnection::new(segment, &domain, config(spin)).expect("connection");
    let child = Command::new(std::env::current_exe().expect("own path"))
        .env(PEER_ENV, dir.path())
        .env(SPIN_ENV, spin.as_micros().to_string())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn peer");
    let mut link = Link::new(conn);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !link.conn.is_peer_attached() {
        assert!(Instant::now() < deadline, "peer did not attach");
        let _ = link.conn.wait(Duration::from_millis(100));
    }
    link.completions.clear();
    link.conn.poll_completions(&mut link.completions, 64);
    (link, domain, child)
}

fn cpu_of_peer(link: &mut Link) -> Duration {
    let mut reply = Vec::new();
    link.send(b"C");
    link.recv(&mut reply);
    Duration::from_nanos(u64::from_le_bytes(reply[..8].try_into().unwrap_or([0; 8])))
}

fn ping_pong(dir: &ShmDir, label: &str, spin: Duration) {
    let (mut link, _domain, mut child) = start(dir, spin);
    let mut message = vec![b'P'; 64];
    let mut reply = Vec::new();
    for _ in 0..1000 {
        link.send(&message);
        link.recv(&mut reply);
    }
    let peer_cpu_before = cpu_of_peer(&mut link);
    let cpu_before = san_shm::process_cpu_time();
    let stats_before = link.conn.stats();
    let mut rtts = Vec::with_capacity(ROUNDS);
    let started = Instant::now();
    for round in 0..ROUNDS {
        message[1..9].copy_from_slice(&(round as u64).to_le_bytes());
        let t = Instant::now();
        link.send(&message);
        link.recv(&mut reply);
        rtts.push(t.elapsed());
        assert_eq!(reply, message);
    }
    let wall = started.elapsed();
    let cpu = san_shm::process_cpu_time() - cpu_before;
    let peer_cpu = cpu_of_peer(&mut link) - peer_cpu_before;
    let stats = link.conn.stats();
    link.send(b"Q");
    let _ = child.wait();
    rtts.sort();
    let per_op = |d: Duration| d.as_secs_f64() * 1e6 / ROUNDS as f64;
    println!(
        "ping-pong 64 B, {label:<28} median RTT {:>7.2} µs  p99 {:>7.2} µs  mean {:>7.2} µs | CPU/RTT: us {:>6.2} µs + peer {:>6.2} µs | spins paid off {} wasted {} sleeps {} wake-ups sent {}",
        rtts[ROUNDS / 2].as_secs_f64() * 1e6,
        rtts[ROUNDS * 99 / 100].as_secs_f64() * 1e6,
        per_op(wall),
        per_op(cpu),
        per_op(peer_cpu),
        stats.spins_paid_off - stats_before.spins_paid_off,
        stats.spins_wasted - stats_before.spins_wasted,
        stats.sleeps - stats_before.sleeps,
        stats.wakeups_sent - stats_before.wakeups_sent,
    );
}

fn rdma_read_bandwidth(dir: &ShmDir) {
    let (mut link, mut domain, mut child) = start(dir, Duration::from_micros(35));
    let mut reply = Vec::new();
    link.send(b"D");
    link.recv(&mut reply);
    let rkey = RemoteKey(u32::from_le_bytes(reply[..4].try_into().unwrap_or([0; 4])));
    let remote_addr = u64::from_le_bytes(reply[4..12].try_into().unwrap_or([0; 8]));
    let mut sink = vec![0u8; RDMA_BUFFER];
    let range = MemRange::new(sink.as_mut_ptr() as u64, RDMA_BUFFER as u64);
    let reg = domain
        .register(range, Access::LOCAL_WRITE)
        .expect("register sink");
    assert!(
        link.conn.capabilities().rdma_read,
        "CMA not permitted here: no RDMA read to measure"
    );
    let mut size = 4096u64;
    while size <= RDMA_BUFFER as u64 {
        let iterations = ((256u64 << 20) / size).clamp(16, 20_000);
        let local = LocalSegment {
            range: MemRange::new(range.addr, size),
            lkey: reg.lkey,
        };
        let remote = RemoteDescriptor {
            addr: remote_addr,
            len: size,
            rkey,
        };
        let started = Instant::now();
        for i in 0..iterations {
            link.conn
                .post_read(WrId(i), local, remote)
                .expect("post read");
            loop {
                link.completions.clear();
                link.conn.poll_completions(&mut link.completions, 64);
                if let Some(done) = link
                    .completions
                    .iter()
                    .find(|c| c.kind == CompletionKind::Read)
                {
                    assert!(done.status.is_ok(), "read failed: {:?}", done.status);
                    break;
                }
            }
        }
        let elapsed = started.elapsed();
        println!(
            "RDMA read (CMA) {:>8} B: {:>8.2} GB/s  {:>8.2} µs/op",
            size,
            (size * iterations) as f64 / elapsed.as_secs_f64() / 1e9,
            elapsed.as_secs_f64() * 1e6 / iterations as f64
        );
        size *= 4;
    }
    assert!(
        sink.iter().all(|b| *b == 0x5A),
        "the reads delivered the peer's bytes"
    );
    link.send(b"Q");
    let _ = child.wait();
}

fn main() {
    if let Ok(dir) = std::env::var(PEER_ENV) {
        let spin = std::env::var(SPIN_ENV)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(35);
        let dir = ShmDir::open(&PathBuf::from(dir)).expect("bench directory");
        peer(&dir, Duration::from_micros(spin));
        return;
    }
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let path = PathBuf::from(format!("/dev/shm/san-shm-bench-{}", std::process::id()));
    let dir = ShmDir::open(&path).expect("bench directory");
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("san-shm benchmark ({cpus} CPUs, {ROUNDS} round trips per run)");
    ping_pong(&dir, "adaptive (spin ≤ 35 µs)", Duration::from_micros(35));
    ping_pong(&dir, "sleep only (no spin)", Duration::ZERO);
    rdma_read_bandwidth(&dir);
    let _ = std::fs::remove_dir_all(&path);
}
