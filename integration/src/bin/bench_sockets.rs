//! The socket benchmark: ping-pong RTT at 64 B and streaming from 64 B to 4 MiB messages,
//! between two processes, for six variants interleaved in every round:
//!
//! * `TCP`       — kernel TCP over loopback, nothing preloaded;
//! * `sandirect` — both processes preloaded (the SAN path once it exists, TCP through the hooks
//!   until then; the path actually taken is read from the published records and printed);
//! * `fallback`  — only the client preloaded: TCP through the hooks, the cost of being there;
//!
//! and three yardsticks, no sockets at all, each the bound a target is stated against:
//!
//! * `raw ring`  — two SPSC byte rings in a `MAP_SHARED` file with the same spin-then-futex
//!   wait as the shm provider (two copies);
//! * `process_vm_readv` (streams only) — the receiver copies each message straight out of the
//!   sender's buffer, which the sender offers through a shared file and gets back once the
//!   copy is done (the raw ring's wait): one copy, the fastest transfer between two processes
//!   the kernel offers, the bound of a single-copy path;
//! * `sched_yield hand-off` (same-core ping-pong only) — a shared page, each process calling
//!   `sched_yield` until it is its turn: the cheapest hand-off between two processes on one
//!   CPU, with no sleep or wake-up.
//!
//! The ping-pong runs three ways: blocking ends; `epoll` ends (nonblocking sockets waited on
//! with `epoll_wait`, as event-driven programs wait; the raw ring has no such form, so its
//! blocking ping-pong is the yardstick there too); and `same-core`, the blocking ping-pong
//! with both processes pinned to one CPU (`sched_setaffinity` before `exec`; skipped with the
//! reason printed where only one CPU is usable or pinning is refused), where every hand-off is
//! a context switch and nothing can spin on another CPU. A yardstick runs only the tests its
//! target names and the fallback path is not measured on one core (`-` in the tables). The
//! ratio table sets sandirect against each yardstick where a target does: its RTT against the
//! raw ring's (blocking and epoll ends) and against the `sched_yield` hand-off's (same-core),
//! its stream bandwidth against `process_vm_readv`'s (judged from 256 KiB).
//!
//! Each round runs every variant once (in a rotating order, so drift and warm-up hit all
//! variants alike) as a fresh server and client process pair, and a second, pinned pair for
//! the same-core test; each test is calibrated to a time slice and measured. Ratios are the
//! median of the per-round ratios; CPU time per operation is the sum of both processes'
//! `getrusage` times over the measured run. The benchmark prints; it never fails a build (exit
//! status 0 unless it could not run at all).
//!
//! `bench_sockets [--quick] [--seconds N] [--preload PATH]` (the orchestrator). The same binary
//! is the server and the client of every pair (`--role server|client`). The roles also run by
//! hand across two addresses, with C-style sockets and a chosen test list, for the side-by-side
//! run with rsocket in the soft-RDMA guest (`integration/softroce/bench-rsocket.sh`); see
//! `USAGE` below.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use ring::RingEnd;

/// Message sizes of the streaming tests.
const STREAM_SIZES: [usize; 9] = [
    64,
    256,
    1 << 10,
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
    4 << 20,
];
/// Largest stream message size a client may ask for by hand (`--tests SIZE`): beyond the
/// benchmark's own sizes, for measuring where a path starts to pay.
const LARGEST_BY_HAND: usize = 64 << 20;
/// Message size of the ping-pong test.
const RTT_SIZE: usize = 64;

/// One measurement kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Test {
    /// Ping-pong of `RTT_SIZE`-byte messages between blocking ends; the figure is the
    /// round-trip time.
    PingPong,
    /// The same ping-pong with both ends' sockets nonblocking and waited on with `epoll_wait`
    /// (how event-driven servers and clients wait).
    EpollPingPong,
    /// The blocking ping-pong with both processes pinned to one CPU: every hand-off is a
    /// context switch, nothing can spin on another CPU.
    SameCorePingPong,
    /// One-way stream of messages of this size; the figure is the throughput.
    Stream(usize),
}

impl Test {
    fn all() -> Vec<Test> {
        [Test::PingPong, Test::EpollPingPong, Test::SameCorePingPong]
            .into_iter()
            .chain(STREAM_SIZES.iter().map(|&size| Test::Stream(size)))
            .collect()
    }

    fn size(self) -> usize {
        match self {
            Test::PingPong | Test::EpollPingPong | Test::SameCorePingPong => RTT_SIZE,
            Test::Stream(size) => size,
        }
    }

    fn is_ping_pong(self) -> bool {
        !matches!(self, Test::Stream(_))
    }

    fn label(self) -> String {
        match self {
            Test::PingPong => format!("rtt {}", human_size(RTT_SIZE)),
            Test::EpollPingPong => format!("rtt {} epoll", human_size(RTT_SIZE)),
            Test::SameCorePingPong => format!("rtt {} same-core", human_size(RTT_SIZE)),
            Test::Stream(size) => format!("stream {}", human_size(size)),
        }
    }

    /// Wire code in the test header. The same-core ping-pong is the blocking one on the wire:
    /// the placement is the orchestrator's (it pins the pair), not the protocol's.
    fn code(self) -> u32 {
        match self {
            Test::PingPong | Test::SameCorePingPong => 1,
            Test::Stream(_) => 2,
            Test::EpollPingPong => 3,
        }
    }

    /// The word `--tests` takes for this test (none for the same-core placement, which a
    /// client cannot give itself).
    fn word(self) -> Option<String> {
        match self {
            Test::PingPong => Some("rtt".into()),
            Test::EpollPingPong => Some("rtt-epoll".into()),
            Test::SameCorePingPong => None,
            Test::Stream(size) => Some(size.to_string()),
        }
    }
}

fn human_size(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b.is_multiple_of(1 << 20) => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b.is_multiple_of(1 << 10) => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

/// The variants, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Tcp,
    Sandirect,
    Fallback,
    RawRing,
    ProcessVmReadv,
    YieldHandOff,
}

const VARIANTS: [Variant; 6] = [
    Variant::Tcp,
    Variant::Sandirect,
    Variant::Fallback,
    Variant::RawRing,
    Variant::ProcessVmReadv,
    Variant::YieldHandOff,
];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Tcp => "TCP",
            Variant::Sandirect => "sandirect",
            Variant::Fallback => "fallback",
            Variant::RawRing => "raw ring",
            Variant::ProcessVmReadv => "process_vm_readv",
            Variant::YieldHandOff => "sched_yield hand-off",
        }
    }

    fn client_preloaded(self) -> bool {
        matches!(self, Variant::Sandirect | Variant::Fallback)
    }

    fn server_preloaded(self) -> bool {
        self == Variant::Sandirect
    }

    /// Whether this variant takes part in `test`. The yardsticks run only the tests whose
    /// target names them; the raw ring has no epoll form (its epoll ratio is taken against its
    /// blocking ping-pong), and the fallback path is not measured on one core.
    fn runs(self, test: Test) -> bool {
        match self {
            Variant::Tcp | Variant::Sandirect => true,
            Variant::Fallback => test != Test::SameCorePingPong,
            Variant::RawRing => test != Test::EpollPingPong,
            Variant::ProcessVmReadv => matches!(test, Test::Stream(_)),
            Variant::YieldHandOff => test == Test::SameCorePingPong,
        }
    }

    /// The shared-memory channel the pair talks over instead of a TCP connection.
    fn channel(self) -> Option<Channel> {
        match self {
            Variant::RawRing => Some(Channel::RawRing),
            Variant::ProcessVmReadv => Some(Channel::ProcessVmReadv),
            Variant::YieldHandOff => Some(Channel::YieldHandOff),
            Variant::Tcp | Variant::Sandirect | Variant::Fallback => None,
        }
    }
}

/// The socket-free channels of the yardsticks, each set up in a file the orchestrator creates
/// and both processes map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Channel {
    RawRing,
    ProcessVmReadv,
    YieldHandOff,
}

impl Channel {
    /// The command-line option naming the channel's file.
    fn option(self) -> &'static str {
        match self {
            Channel::RawRing => "--ring",
            Channel::ProcessVmReadv => "--vm-readv",
            Channel::YieldHandOff => "--yield-page",
        }
    }

    /// What the client prints as its data path.
    fn path_label(self) -> &'static str {
        match self {
            Channel::RawRing => "raw-ring",
            Channel::ProcessVmReadv => "process_vm_readv",
            Channel::YieldHandOff => "sched_yield",
        }
    }

    fn create(self, path: &Path) -> io::Result<()> {
        match self {
            Channel::RawRing => ring::create(path),
            Channel::ProcessVmReadv => vm_readv::create(path),
            Channel::YieldHandOff => yield_hand_off::create(path),
        }
    }

    fn open(self, path: &Path, side: ring::Side) -> io::Result<Box<dyn Transport>> {
        Ok(match self {
            Channel::RawRing => Box::new(RingEnd::open(path, side)?),
            Channel::ProcessVmReadv => Box::new(vm_readv::VmReadvEnd::open(path, side)?),
            Channel::YieldHandOff => Box::new(yield_hand_off::YieldEnd::open(path, side)?),
        })
    }
}

/// CPU time (user + system) this process used so far, in nanoseconds.
fn cpu_time_ns() -> u64 {
    // SAFETY: an all-zero rusage is valid; getrusage fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0;
    }
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1_000;
    ns(usage.ru_utime) + ns(usage.ru_stime)
}

// ---------------------------------------------------------------------------------------------
// Transports: a byte pipe in each direction
// ---------------------------------------------------------------------------------------------

/// A full-duplex byte stream: exact sends and receives.
trait Transport {
    fn send(&mut self, bytes: &[u8]) -> io::Result<()>;
    fn receive(&mut self, bytes: &mut [u8]) -> io::Result<()>;

    /// Switches between blocking calls and nonblocking ones waited on with `epoll_wait`
    /// (both ends switch for the epoll ping-pong, each on its own). Only sockets have the
    /// event-driven form.
    fn set_event_driven(&mut self, on: bool) -> io::Result<()> {
        if on {
            Err(io::Error::other("this transport has no event-driven form"))
        } else {
            Ok(())
        }
    }
}

impl Transport for RingEnd {
    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.write_all(bytes)
    }

    fn receive(&mut self, bytes: &mut [u8]) -> io::Result<()> {
        self.read_exact(bytes)
    }
}

/// A connected TCP socket, blocking or (event-driven) nonblocking with an epoll instance that
/// watches it.
struct Socket {
    stream: TcpStream,
    epoll: Option<std::os::fd::OwnedFd>,
    /// The events the epoll instance waits for (EPOLLIN or EPOLLOUT).
    watching: u32,
    event_driven: bool,
}

/// How long an event-driven end waits for its socket before it calls the peer lost.
const EVENT_TIMEOUT: Duration = Duration::from_secs(10);

impl Socket {
    fn new(stream: TcpStream) -> io::Result<Socket> {
        stream.set_nodelay(true)?;
        Ok(Socket {
            stream,
            epoll: None,
            watching: 0,
            event_driven: false,
        })
    }

    /// Waits until the socket is ready for `events` (one of EPOLLIN, EPOLLOUT).
    fn wait_for(&mut self, events: u32) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let epoll = self
            .epoll
            .as_ref()
            .ok_or_else(|| io::Error::other("not event-driven"))?
            .as_raw_fd();
        if self.watching != events {
            let mut interest = libc::epoll_event { events, u64: 0 };
            // SAFETY: both descriptors are open and ours; interest is a valid epoll_event.
            let rc = unsafe {
                libc::epoll_ctl(
                    epoll,
                    libc::EPOLL_CTL_MOD,
                    self.stream.as_raw_fd(),
                    &mut interest,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            self.watching = events;
        }
        loop {
            let mut ready = libc::epoll_event { events: 0, u64: 0 };
            // SAFETY: room for exactly one event, as maxevents says.
            let count =
                unsafe { libc::epoll_wait(epoll, &mut ready, 1, EVENT_TIMEOUT.as_millis() as i32) };
            match count {
                1 => return Ok(()),
                0 => return Err(io::Error::other("no socket event for 10 s")),
                _ => {
                    let error = io::Error::last_os_error();
                    if error.kind() != io::ErrorKind::Interrupted {
                        return Err(error);
                    }
                }
            }
        }
    }
}

impl Transport for Socket {
    fn send(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        if !self.event_driven {
            return self.stream.write_all(bytes);
        }
        while !bytes.is_empty() {
            match self.stream.write(bytes) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(written) => bytes = &bytes[written..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait_for(libc::EPOLLOUT as u32)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn receive(&mut self, mut bytes: &mut [u8]) -> io::Result<()> {
        if !self.event_driven {
            return self.stream.read_exact(bytes);
        }
        while !bytes.is_empty() {
            match self.stream.read(bytes) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(read) => bytes = &mut bytes[read..],
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait_for(libc::EPOLLIN as u32)?
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn set_event_driven(&mut self, on: bool) -> io::Result<()> {
        use std::os::fd::{AsRawFd, FromRawFd};
        if on == self.event_driven {
            return Ok(());
        }
        if on && self.epoll.is_none() {
            // SAFETY: plain epoll_create1 with a constant flag.
            let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: fd is a fresh epoll instance that nothing else owns.
            let epoll = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
            let mut interest = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: 0,
            };
            // SAFETY: both descriptors are open and ours; interest is a valid epoll_event.
            let rc = unsafe {
                libc::epoll_ctl(
                    epoll.as_raw_fd(),
                    libc::EPOLL_CTL_ADD,
                    self.stream.as_raw_fd(),
                    &mut interest,
                )
            };
            if rc != 0 {
                return Err(io::Error::last_os_error());
            }
            self.epoll = Some(epoll);
            self.watching = libc::EPOLLIN as u32;
        }
        self.stream.set_nonblocking(on)?;
        self.event_driven = on;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Server and client roles
// ---------------------------------------------------------------------------------------------

/// Test header: code, message size, message count (code 0 ends the session).
const HEADER_BYTES: usize = 16;

fn encode_header(code: u32, size: usize, count: u64) -> [u8; HEADER_BYTES] {
    let mut header = [0u8; HEADER_BYTES];
    header[0..4].copy_from_slice(&code.to_le_bytes());
    header[4..8].copy_from_slice(&(size as u32).to_le_bytes());
    header[8..16].copy_from_slice(&count.to_le_bytes());
    header
}

fn decode_header(header: &[u8; HEADER_BYTES]) -> (u32, usize, u64) {
    let word = |range: std::ops::Range<usize>| {
        let mut raw = [0u8; 8];
        raw[..range.len()].copy_from_slice(&header[range]);
        u64::from_le_bytes(raw)
    };
    (word(0..4) as u32, word(4..8) as usize, word(8..16))
}

/// Serves tests until the client ends the session: for each, receives (and for the ping-pongs
/// echoes) the messages, event-driven for the epoll ping-pong, then acknowledges with the CPU
/// time the run cost this process.
fn serve(transport: &mut dyn Transport) -> io::Result<()> {
    let mut buffer = vec![0u8; LARGEST_BY_HAND];
    loop {
        let mut header = [0u8; HEADER_BYTES];
        transport.receive(&mut header)?;
        let (code, size, count) = decode_header(&header);
        if code == 0 {
            return Ok(());
        }
        if size == 0 || size > buffer.len() {
            return Err(io::Error::other(format!("bad message size {size}")));
        }
        let event_driven = code == Test::EpollPingPong.code();
        let echo = code == Test::PingPong.code() || event_driven;
        transport.set_event_driven(event_driven)?;
        let cpu_before = cpu_time_ns();
        let message = &mut buffer[..size];
        for _ in 0..count {
            transport.receive(message)?;
            if echo {
                transport.send(message)?;
            }
        }
        let cpu = cpu_time_ns().saturating_sub(cpu_before);
        let mut ack = [0u8; 16];
        ack[0..8].copy_from_slice(&cpu.to_le_bytes());
        ack[8..16].copy_from_slice(&count.to_le_bytes());
        transport.send(&ack)?;
        transport.set_event_driven(false)?;
    }
}

/// One measured run: messages, wall time, CPU time of client and server.
#[derive(Clone, Copy, Debug, Default)]
struct Run {
    count: u64,
    elapsed_ns: u64,
    client_cpu_ns: u64,
    server_cpu_ns: u64,
}

fn run_test(transport: &mut dyn Transport, test: Test, count: u64) -> io::Result<Run> {
    let size = test.size();
    let sent: Vec<u8> = (0..size).map(|i| i as u8).collect();
    let mut echo = sent.clone();
    transport.send(&encode_header(test.code(), size, count))?;
    transport.set_event_driven(test == Test::EpollPingPong)?;
    let cpu_before = cpu_time_ns();
    let start = Instant::now();
    for _ in 0..count {
        transport.send(&sent)?;
        if test.is_ping_pong() {
            transport.receive(&mut echo)?;
            // A 64-byte compare per round trip: the figures are only worth something if the
            // bytes came back intact.
            if echo != sent {
                return Err(io::Error::other("the echo differs from the message sent"));
            }
        }
    }
    let mut ack = [0u8; 16];
    transport.receive(&mut ack)?;
    let elapsed_ns = start.elapsed().as_nanos() as u64;
    let client_cpu_ns = cpu_time_ns().saturating_sub(cpu_before);
    transport.set_event_driven(false)?;
    let (server_cpu_ns, echoed_count) = {
        let (cpu, count_field) = ack.split_at(8);
        let word = |bytes: &[u8]| {
            let mut raw = [0u8; 8];
            raw.copy_from_slice(bytes);
            u64::from_le_bytes(raw)
        };
        (word(cpu), word(count_field))
    };
    if echoed_count != count {
        return Err(io::Error::other("server acknowledged a different count"));
    }
    Ok(Run {
        count,
        elapsed_ns: elapsed_ns.max(1),
        client_cpu_ns,
        server_cpu_ns,
    })
}

/// Runs each of `tests` (once per kind) unmeasured for about `warmup`, before any figure is
/// taken. Under emulation (TCG) a process's code is translated anew wherever address-space
/// randomization placed it, so its first few hundred milliseconds run several times slower
/// than the rest; the larger a system's code path, the longer (measured in the soft-RDMA
/// guest: a 64-byte round trip over sandirect took 1.5-2.2 ms in the first 300 ms slice of a
/// process and 0.4-0.6 ms after it, 0.6-0.9 ms in the first slice with randomization off;
/// rsocket's first slice was 1.5× its later ones). Applied to every variant alike.
fn warm_up(transport: &mut dyn Transport, warmup: Duration, tests: &[Test]) -> io::Result<()> {
    let mut seen: Vec<Test> = Vec::new();
    for &test in tests {
        if seen.contains(&test) {
            continue;
        }
        seen.push(test);
        let (mut spent, mut count) = (Duration::ZERO, 1u64);
        while spent < warmup {
            spent += Duration::from_nanos(run_test(transport, test, count)?.elapsed_ns);
            count = (count * 2).min(1 << 20);
        }
    }
    Ok(())
}

/// Runs `tests`: for each, calibration runs (also the warm-up) growing from one message until
/// they last an eighth of `slice`, then the measured run scaled to `slice`. Prints one
/// `result` line per test. The session stays open ([`end_session`] ends it).
fn client(transport: &mut dyn Transport, slice: Duration, tests: &[Test]) -> io::Result<()> {
    const MOST_MESSAGES: f64 = 50_000_000.0;
    let slice_ns = slice.as_nanos() as f64;
    for &test in tests {
        let mut count = 1u64;
        let calibration = loop {
            let run = run_test(transport, test, count)?;
            let elapsed = run.elapsed_ns as f64;
            if elapsed >= slice_ns / 8.0 || count as f64 >= MOST_MESSAGES {
                break run;
            }
            let growth = (slice_ns / 8.0 / elapsed).clamp(2.0, 16.0);
            count = (count as f64 * growth).ceil() as u64;
        };
        let per_message = calibration.elapsed_ns as f64 / calibration.count as f64;
        let count = (slice_ns / per_message.max(1.0)).clamp(1.0, MOST_MESSAGES);
        let run = run_test(transport, test, count as u64)?;
        println!(
            "result {} {} {} {} {} {}",
            test.code(),
            test.size(),
            run.count,
            run.elapsed_ns,
            run.client_cpu_ns,
            run.server_cpu_ns
        );
    }
    Ok(())
}

/// Tells the server that no test follows.
fn end_session(transport: &mut dyn Transport) -> io::Result<()> {
    transport.send(&encode_header(0, 0, 0))
}

/// The data path the interposer recorded for this process's connected sockets ("none" when
/// it is not preloaded or publishes nothing).
fn own_published_path() -> String {
    let Some(connections) = integration::own_published_connections() else {
        return "none".into();
    };
    let mut labels: Vec<&str> = connections
        .iter()
        .filter(|c| {
            matches!(
                c.state,
                preload_core::record::SocketState::ConnectedTcp
                    | preload_core::record::SocketState::San
            )
        })
        .map(|c| c.path.label())
        .collect();
    labels.dedup();
    if labels.is_empty() {
        "none".into()
    } else {
        labels.join("+")
    }
}

/// A listener made by `listen` on a port below the automatic local port range (20000-31999,
/// from this process's id on), else on one the kernel picks: after the benchmark's connection
/// churn the automatic range is full of TIME_WAIT entries and `bind` to port 0 can fail.
fn listen_outside_the_ephemeral_range(
    listen: impl Fn(u16) -> io::Result<TcpListener>,
) -> io::Result<TcpListener> {
    let mut candidate = (std::process::id() as u16).wrapping_mul(7919) % 12_000;
    for _ in 0..200 {
        candidate = (candidate + 61) % 12_000;
        if let Ok(listener) = listen(20_000 + candidate) {
            return Ok(listener);
        }
    }
    listen(0)
}

fn role_main(args: &Arguments) -> io::Result<()> {
    let slice = args.slice;
    match (args.role.as_deref(), &args.channel) {
        (Some("server"), None) => {
            let stream = match args.sockets {
                SocketStyle::Std => {
                    let listener = listen_outside_the_ephemeral_range(|port| {
                        TcpListener::bind((args.address, port))
                    })?;
                    println!("port {}", listener.local_addr()?.port());
                    io::stdout().flush()?;
                    listener.accept()?.0
                }
                SocketStyle::C => {
                    let listener = listen_outside_the_ephemeral_range(|port| {
                        c_sockets::listen(args.address, port)
                    })?;
                    println!("port {}", listener.local_addr()?.port());
                    io::stdout().flush()?;
                    c_sockets::accept(&listener)?
                }
            };
            serve(&mut Socket::new(stream)?)
        }
        (Some("server"), Some((channel, path))) => {
            let mut end = channel.open(path, ring::Side::Server)?;
            println!("ready");
            io::stdout().flush()?;
            serve(end.as_mut())
        }
        (Some("client"), None) => {
            let port = args
                .port
                .ok_or_else(|| io::Error::other("client needs --port"))?;
            let stream = match (args.sockets, args.source) {
                (SocketStyle::Std, None) => TcpStream::connect((args.address, port))?,
                (style, source) => c_sockets::connect(style, source, args.address, port)?,
            };
            let mut socket = Socket::new(stream)?;
            if args.fork_after_first && args.tests.len() > 1 {
                return forked_client(socket, slice, &args.tests);
            }
            warm_up(&mut socket, args.warmup, &args.tests)?;
            client(&mut socket, slice, &args.tests)?;
            end_session(&mut socket)?;
            println!("path {}", own_published_path());
            Ok(())
        }
        (Some("client"), Some((channel, path))) => {
            let mut end = channel.open(path, ring::Side::Client)?;
            client(end.as_mut(), slice, &args.tests)?;
            end_session(end.as_mut())?;
            println!("path {}", channel.path_label());
            Ok(())
        }
        _ => Err(io::Error::other("--role must be server or client")),
    }
}

/// A forked client (a pre-forking program's pattern): the first test runs in this process,
/// which then forks; the child runs the other tests on the inherited connection and ends the
/// session, while the parent closes its copy and waits for the child. The child prints the
/// data path it saw.
fn forked_client(mut socket: Socket, slice: Duration, tests: &[Test]) -> io::Result<()> {
    client(&mut socket, slice, &tests[..1])?;
    io::stdout().flush()?;
    // SAFETY: this process has a single thread (the role processes start none), so the child
    // may run any code; it only uses the inherited connection and exits.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(io::Error::last_os_error());
    }
    if child == 0 {
        client(&mut socket, slice, &tests[1..])?;
        end_session(&mut socket)?;
        println!("path {}", own_published_path());
        io::stdout().flush()?;
        return Ok(());
    }
    drop(socket);
    let mut status = 0;
    // SAFETY: waiting for our own child, with a valid pointer for its status.
    if unsafe { libc::waitpid(child, &mut status, 0) } != child {
        return Err(io::Error::last_os_error());
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "the forked child failed (wait status {status:#x})"
        )))
    }
}

/// How the role processes make their TCP sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SocketStyle {
    /// Rust `std::net`'s way (the default): `SOCK_CLOEXEC` in the socket type, `accept4`.
    Std,
    /// A C program's way: `socket(AF_INET, SOCK_STREAM, 0)` and `accept` — what rsocket's
    /// preload (`librspreload.so`) takes over, unlike `std::net`'s sockets.
    C,
}

/// Sockets made with the libc calls a C program uses, wrapped in `std::net` types for I/O
/// (whose reads and writes are `recv`/`send`).
mod c_sockets {
    use std::io;
    use std::net::{Ipv4Addr, TcpListener, TcpStream};
    use std::os::fd::{AsRawFd, FromRawFd};

    use super::SocketStyle;

    fn sockaddr(ip: Ipv4Addr, port: u16) -> libc::sockaddr_in {
        libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(ip).to_be(),
            },
            sin_zero: [0; 8],
        }
    }

    const SOCKADDR_LEN: libc::socklen_t = core::mem::size_of::<libc::sockaddr_in>() as _;

    /// A TCP socket of `style`, owned by a `TcpStream` (closed when dropped).
    fn socket(style: SocketStyle) -> io::Result<TcpStream> {
        let flags = match style {
            SocketStyle::Std => libc::SOCK_CLOEXEC,
            SocketStyle::C => 0,
        };
        // SAFETY: plain socket call with constant arguments.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | flags, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh socket that nothing else owns.
        Ok(unsafe { TcpStream::from_raw_fd(fd) })
    }

    fn bind(socket: &impl AsRawFd, ip: Ipv4Addr, port: u16) -> io::Result<()> {
        let address = sockaddr(ip, port);
        // SAFETY: a valid sockaddr_in of SOCKADDR_LEN bytes.
        let rc = unsafe {
            libc::bind(
                socket.as_raw_fd(),
                (&address as *const libc::sockaddr_in).cast(),
                SOCKADDR_LEN,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// A listener on `ip`, an ephemeral port.
    pub fn listen(ip: Ipv4Addr, port: u16) -> io::Result<TcpListener> {
        let socket = socket(SocketStyle::C)?;
        bind(&socket, ip, port)?;
        // SAFETY: listen on a socket we own.
        if unsafe { libc::listen(socket.as_raw_fd(), 16) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: moving ownership of the descriptor from the stream to the listener.
        Ok(unsafe { TcpListener::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(socket)) })
    }

    /// One connection from `listener`, by `accept` (not `accept4`).
    pub fn accept(listener: &TcpListener) -> io::Result<TcpStream> {
        // SAFETY: accept without asking for the peer's address.
        let fd = unsafe {
            libc::accept(
                listener.as_raw_fd(),
                core::ptr::null_mut(),
                core::ptr::null_mut(),
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is the accepted connection, owned by nobody else.
        Ok(unsafe { TcpStream::from_raw_fd(fd) })
    }

    /// A connection to `ip:port` from a socket of `style`, bound to `source` first if given.
    pub fn connect(
        style: SocketStyle,
        source: Option<Ipv4Addr>,
        ip: Ipv4Addr,
        port: u16,
    ) -> io::Result<TcpStream> {
        let socket = socket(style)?;
        if let Some(source) = source {
            bind(&socket, source, 0)?;
        }
        let peer = sockaddr(ip, port);
        // SAFETY: a valid sockaddr_in of SOCKADDR_LEN bytes.
        let rc = unsafe {
            libc::connect(
                socket.as_raw_fd(),
                (&peer as *const libc::sockaddr_in).cast(),
                SOCKADDR_LEN,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(socket)
    }
}

// ---------------------------------------------------------------------------------------------
// Orchestrator
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct Arguments {
    quick: bool,
    seconds: Option<u64>,
    preload: Option<PathBuf>,
    /// Orchestrator: also write every round's raw figures here (JSON).
    json: Option<PathBuf>,
    role: Option<String>,
    port: Option<u16>,
    /// The yardstick channel (and its file) instead of a TCP connection.
    channel: Option<(Channel, PathBuf)>,
    slice: Duration,
    /// Server: the address to listen on; client: the server's address.
    address: Ipv4Addr,
    /// Client: the local address to bind before connecting.
    source: Option<Ipv4Addr>,
    sockets: SocketStyle,
    /// Client: the tests to run, in order.
    tests: Vec<Test>,
    /// Client: fork after the first test; the child runs the others.
    fork_after_first: bool,
    /// Client: how long each test runs unmeasured first (see [`warm_up`]).
    warmup: Duration,
}

/// `rtt`, `rtt-epoll` or a stream message size in bytes (at most [`LARGEST_BY_HAND`]).
fn parse_test(word: &str) -> Result<Test, String> {
    if let Some(test) = Test::all()
        .into_iter()
        .find(|test| test.word().as_deref() == Some(word))
    {
        return Ok(test);
    }
    let largest = LARGEST_BY_HAND;
    match word.parse::<usize>() {
        Ok(size) if (1..=largest).contains(&size) => Ok(Test::Stream(size)),
        _ => Err(format!(
            "bad test {word:?}: rtt, rtt-epoll or a stream size of 1..={largest} bytes"
        )),
    }
}

fn parse_address(text: &str, name: &str) -> Result<Ipv4Addr, String> {
    text.parse()
        .map_err(|_| format!("{name} needs an IPv4 address"))
}

fn parse_arguments() -> Result<Arguments, String> {
    let mut args = Arguments {
        quick: false,
        seconds: None,
        preload: None,
        json: None,
        role: None,
        port: None,
        channel: None,
        slice: Duration::from_millis(100),
        address: Ipv4Addr::LOCALHOST,
        source: None,
        sockets: SocketStyle::Std,
        // Every test a client can run by itself (the same-core placement is the orchestrator's).
        tests: Test::all()
            .into_iter()
            .filter(|test| test.word().is_some())
            .collect(),
        fork_after_first: false,
        warmup: Duration::ZERO,
    };
    let mut words = std::env::args().skip(1);
    while let Some(word) = words.next() {
        let mut value = |name: &str| words.next().ok_or(format!("{name} needs a value"));
        match word.as_str() {
            "--quick" => args.quick = true,
            "--seconds" => {
                args.seconds = Some(value("--seconds")?.parse().map_err(|_| "bad --seconds")?)
            }
            "--preload" => args.preload = Some(value("--preload")?.into()),
            "--json" => args.json = Some(value("--json")?.into()),
            "--role" => args.role = Some(value("--role")?),
            "--port" => args.port = Some(value("--port")?.parse().map_err(|_| "bad --port")?),
            "--ring" => args.channel = Some((Channel::RawRing, value("--ring")?.into())),
            "--vm-readv" => {
                args.channel = Some((Channel::ProcessVmReadv, value("--vm-readv")?.into()))
            }
            "--yield-page" => {
                args.channel = Some((Channel::YieldHandOff, value("--yield-page")?.into()))
            }
            "--slice-ms" => {
                let ms: u64 = value("--slice-ms")?.parse().map_err(|_| "bad --slice-ms")?;
                args.slice = Duration::from_millis(ms.max(1));
            }
            "--address" => args.address = parse_address(&value("--address")?, "--address")?,
            "--source" => args.source = Some(parse_address(&value("--source")?, "--source")?),
            "--c-sockets" => args.sockets = SocketStyle::C,
            "--tests" => {
                args.tests = value("--tests")?
                    .split(',')
                    .map(parse_test)
                    .collect::<Result<_, _>>()?
            }
            "--fork-after-first" => args.fork_after_first = true,
            "--warmup-ms" => {
                let ms: u64 = value("--warmup-ms")?
                    .parse()
                    .map_err(|_| "bad --warmup-ms")?;
                args.warmup = Duration::from_millis(ms);
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(args)
}

const USAGE: &str = "usage: bench_sockets [--quick] [--seconds N] [--preload libsandirect.so]
                     [--json FILE]   (every round's raw figures, for scripts/bench.sh)
   or: bench_sockets --role server [--address IP] [--c-sockets]       (prints \"port N\")
   or: bench_sockets --role client --port N [--address IP] [--source IP] [--c-sockets]
                     [--tests rtt,rtt-epoll,SIZE,...] [--slice-ms MS] [--warmup-ms MS]
                     [--fork-after-first]
       (one pair by hand, e.g. across two hosts; the client prints \"result CODE SIZE COUNT
       ELAPSED_NS CLIENT_CPU_NS SERVER_CPU_NS\" per test, then \"path P\")";

/// A child of the orchestrator, killed if still running when dropped.
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// What one variant's process pair measured in one round: one run per test asked for.
struct PairResult {
    runs: Vec<Run>,
    path: String,
}

struct Orchestrator {
    exe: PathBuf,
    library: Option<PathBuf>,
    scratch: PathBuf,
    slice: Duration,
}

/// Makes `command`'s process (and so everything it starts) run on `cpu` only, from before
/// its `exec`: the preloaded library's own threads are pinned too.
fn pin_to_cpu(command: &mut Command, cpu: usize) {
    use std::os::unix::process::CommandExt;
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: cpu < CPU_SETSIZE (it came from a cpu_set_t) and set is a valid cpu_set_t.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: the hook runs in the forked child before exec; it only makes one
    // async-signal-safe system call on a set built before the fork.
    unsafe {
        command.pre_exec(move || {
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        })
    };
}

/// The CPU the same-core pairs share (the last this process may use), or why there is none.
fn same_core_cpu(exe: &Path) -> Result<usize, String> {
    // SAFETY: an all-zero cpu_set_t is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid cpu_set_t of the size passed.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return Err(format!(
            "sched_getaffinity failed: {}",
            io::Error::last_os_error()
        ));
    }
    let usable: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: cpu < CPU_SETSIZE and set is a valid cpu_set_t.
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect();
    let cpu = match usable.as_slice() {
        [] | [_] => {
            return Err("only one CPU is usable (the other rtt rows already share it)".to_owned())
        }
        [.., last] => *last,
    };
    // A pinned process that does nothing, so that a refused affinity shows here once and not
    // as a failed pair in every round.
    let mut probe = Command::new(exe);
    probe
        .arg("--help")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    pin_to_cpu(&mut probe, cpu);
    match probe.status() {
        Ok(_) => Ok(cpu),
        Err(error) => Err(format!("sched_setaffinity to CPU {cpu} refused: {error}")),
    }
}

impl Orchestrator {
    fn command(&self, preloaded: bool, cpu: Option<usize>) -> Command {
        let mut command = Command::new(&self.exe);
        command
            .env_remove("LD_PRELOAD")
            .env("SANDIRECT_STAT_DIR", self.scratch.join("stat"))
            .env("SANDIRECT_SHM_DIR", self.scratch.join("segments"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let (true, Some(library)) = (preloaded, &self.library) {
            command.env("LD_PRELOAD", library);
        }
        if let Some(cpu) = cpu {
            pin_to_cpu(&mut command, cpu);
        }
        command
    }

    /// Runs `tests` on one fresh process pair of `variant`, both pinned to `cpu` if given.
    fn run_pair(
        &self,
        variant: Variant,
        round: usize,
        tests: &[Test],
        cpu: Option<usize>,
    ) -> io::Result<PairResult> {
        let slice_ms = self.slice.as_millis().to_string();
        // The same-core ping-pong is the blocking one run by a pinned pair.
        let words: Vec<String> = tests
            .iter()
            .filter_map(|&test| match test {
                Test::SameCorePingPong => Test::PingPong.word(),
                other => other.word(),
            })
            .collect();
        let mut server_command = self.command(variant.server_preloaded(), cpu);
        server_command.args(["--role", "server"]);
        let mut client_command = self.command(variant.client_preloaded(), cpu);
        client_command.args(["--role", "client", "--slice-ms", &slice_ms]);
        client_command.args(["--tests", &words.join(",")]);
        let channel_path = self.scratch.join(format!("channel-{round}"));
        if let Some(channel) = variant.channel() {
            channel.create(&channel_path)?;
            server_command.arg(channel.option()).arg(&channel_path);
            client_command.arg(channel.option()).arg(&channel_path);
        }
        let outcome = self.run_processes(server_command, client_command);
        let _ = std::fs::remove_file(&channel_path);
        let output = outcome?;
        let mut runs = Vec::new();
        let mut path = "none".to_owned();
        for line in output.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            match fields.as_slice() {
                ["result", _, _, count, elapsed, client_cpu, server_cpu] => {
                    let number = |text: &str| text.parse::<u64>().unwrap_or(0);
                    runs.push(Run {
                        count: number(count).max(1),
                        elapsed_ns: number(elapsed).max(1),
                        client_cpu_ns: number(client_cpu),
                        server_cpu_ns: number(server_cpu),
                    });
                }
                ["path", label] => path = (*label).to_owned(),
                _ => {}
            }
        }
        if runs.len() != tests.len() {
            return Err(io::Error::other(format!(
                "{} client reported {} of {} tests",
                variant.label(),
                runs.len(),
                tests.len()
            )));
        }
        Ok(PairResult { runs, path })
    }

    /// Starts the server, then the client (with the port the server printed, if any); returns
    /// the client's output once both ended.
    fn run_processes(
        &self,
        mut server_command: Command,
        mut client_command: Command,
    ) -> io::Result<String> {
        let mut server = Worker(server_command.spawn()?);
        let server_stdout = server
            .0
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("server stdout"))?;
        let mut server_lines = BufReader::new(server_stdout).lines();
        let first = server_lines
            .next()
            .transpose()?
            .ok_or_else(|| io::Error::other("server ended before it was ready"))?;
        if let Some(port) = first.strip_prefix("port ") {
            client_command.args(["--port", port]);
        }
        let mut client = Worker(client_command.spawn()?);
        watch_pair(&mut server, &mut client)?;
        let output = client_output(client)?;
        let _ = server.0.wait();
        Ok(output)
    }
}

/// How long a pair may run before it counts as hung (a full run's pair takes seconds).
const PAIR_TIMEOUT: Duration = Duration::from_secs(120);

/// Waits (asleep, on both processes' pidfds) until the client exits. A server that fails
/// first ends the pair with an error: the yardsticks' channels give the client no end of file
/// when their server is gone, it would wait forever. So does a pair still running after
/// [`PAIR_TIMEOUT`]. (Both are killed when their `Worker` is dropped.) Without pidfds the
/// client is simply waited for.
fn watch_pair(server: &mut Worker, client: &mut Worker) -> io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let pidfd = |child: &Child| -> Option<OwnedFd> {
        // SAFETY: pidfd_open of our own unreaped child, no flags.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id(), 0) };
        // SAFETY: on success fd is a fresh descriptor that nothing else owns.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
    };
    let (Some(client_fd), Some(server_fd)) = (pidfd(&client.0), pidfd(&server.0)) else {
        return Ok(());
    };
    let deadline = Instant::now() + PAIR_TIMEOUT;
    let mut server_ended = false;
    loop {
        if client.0.try_wait()?.is_some() {
            return Ok(());
        }
        if !server_ended {
            if let Some(status) = server.0.try_wait()? {
                if !status.success() {
                    return Err(io::Error::other(format!("server failed: {status}")));
                }
                server_ended = true;
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::other(format!(
                "pair still running after {} s",
                PAIR_TIMEOUT.as_secs()
            )));
        }
        let mut fds = [
            libc::pollfd {
                fd: client_fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: server_fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // An ended server's pidfd stays readable: then watch the client alone.
        let watched = if server_ended { 1 } else { 2 };
        // SAFETY: `watched` valid pollfds.
        unsafe {
            libc::poll(
                fds.as_mut_ptr(),
                watched,
                left.as_millis().min(60_000) as i32,
            )
        };
    }
}

fn client_output(mut client: Worker) -> io::Result<String> {
    let mut output = String::new();
    if let Some(mut stdout) = client.0.stdout.take() {
        stdout.read_to_string(&mut output)?;
    }
    let status = client.0.wait()?;
    if !status.success() {
        return Err(io::Error::other(format!("client failed: {status}")));
    }
    Ok(output)
}

/// The figure a test is judged by: RTT in ns for ping-pong, bytes/s for streaming.
fn figure(test: Test, run: &Run) -> f64 {
    let per_message = run.elapsed_ns as f64 / run.count as f64;
    match test {
        Test::Stream(size) => size as f64 * 1e9 / per_message,
        _ => per_message,
    }
}

fn cpu_per_op(run: &Run) -> f64 {
    (run.client_cpu_ns + run.server_cpu_ns) as f64 / run.count as f64
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    })
}

fn format_figure(test: Test, value: Option<f64>) -> String {
    match (test, value) {
        (_, None) => "n/a".into(),
        (Test::Stream(_), Some(bytes_per_second)) => {
            format!("{:.0} MB/s", bytes_per_second / 1e6)
        }
        (_, Some(ns)) => format!("{:.1} us", ns / 1e3),
    }
}

fn format_cpu(value: Option<f64>) -> String {
    match value {
        None => "n/a".into(),
        Some(ns) if ns >= 10_000.0 => format!("{:.0} us", ns / 1e3),
        Some(ns) => format!("{ns:.0} ns"),
    }
}

/// A ratio against its target: `(value, met)`; `lower_is_better` for latency ratios.
fn judged(ratio: Option<f64>, target: Option<(f64, bool)>) -> String {
    match (ratio, target) {
        (None, _) => "n/a".into(),
        (Some(r), None) => format!("{r:.2}"),
        (Some(r), Some((goal, lower_is_better))) => {
            let met = if lower_is_better {
                r <= goal
            } else {
                r >= goal
            };
            let relation = if lower_is_better { "<=" } else { ">=" };
            format!(
                "{r:.2} ({relation}{goal} {})",
                if met { "met" } else { "NOT met" }
            )
        }
    }
}

fn main() -> ExitCode {
    let args = match parse_arguments() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("bench_sockets: {message}");
            return ExitCode::from(2);
        }
    };
    if args.role.is_some() {
        return match role_main(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("bench_sockets {:?}: {error}", args.role);
                ExitCode::FAILURE
            }
        };
    }
    match orchestrate(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench_sockets: {error}");
            ExitCode::FAILURE
        }
    }
}

fn default_library(exe: &Path) -> Option<PathBuf> {
    exe.parent()
        .map(|dir| dir.join("libsandirect.so"))
        .filter(|path| path.is_file())
}

fn orchestrate(args: &Arguments) -> io::Result<()> {
    let exe = std::env::current_exe()?;
    let library = args.preload.clone().or_else(|| default_library(&exe));
    if let Some(library) = &library {
        if !library.is_file() {
            return Err(io::Error::other(format!(
                "{} does not exist",
                library.display()
            )));
        }
    }
    let budget = Duration::from_secs(args.seconds.unwrap_or(if args.quick { 10 } else { 60 }));
    let slice = if args.quick {
        Duration::from_millis(10)
    } else {
        Duration::from_millis(100)
    };
    let scratch = std::env::temp_dir().join(format!("sandirect-bench-{}", std::process::id()));
    for dir in [
        scratch.clone(),
        scratch.join("stat"),
        scratch.join("segments"),
    ] {
        std::fs::create_dir_all(&dir)?;
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    }
    let orchestrator = Orchestrator {
        exe,
        library: library.clone(),
        scratch: scratch.clone(),
        slice,
    };
    let same_core = match same_core_cpu(&orchestrator.exe) {
        Ok(cpu) => Some(cpu),
        Err(reason) => {
            println!("skipped {}: {reason}", Test::SameCorePingPong.label());
            None
        }
    };
    let plan = Plan {
        tests: Test::all(),
        same_core: same_core.is_some(),
        preload: library.is_some(),
    };
    println!(
        "bench_sockets: {} s budget, {} variants, {} tests, slice {} ms, same-core CPU {}, \
         preload {}",
        budget.as_secs(),
        VARIANTS.len(),
        plan.tests.len(),
        slice.as_millis(),
        same_core.map_or("none".into(), |cpu| cpu.to_string()),
        library
            .as_ref()
            .map_or("NONE (sandirect and fallback rows are n/a)".into(), |l| l
                .display()
                .to_string())
    );
    // results[round][variant][test] = that run (None where the variant does not run the test or
    // its pair failed).
    let mut results: Vec<Round> = Vec::new();
    let mut paths = vec![String::from("n/a"); VARIANTS.len()];
    let started = Instant::now();
    // Rounds until the budget is spent (the first round's duration predicts the next), at least
    // two so that every figure is a median of more than one pairing.
    let mut round = 0;
    while round < 2 || started.elapsed() * (round as u32 + 1) / round as u32 <= budget {
        let mut row: Round = vec![vec![None; plan.tests.len()]; VARIANTS.len()];
        for offset in 0..VARIANTS.len() {
            let index = (round + offset) % VARIANTS.len();
            let variant = VARIANTS[index];
            // One pair for the unpinned tests, one pinned pair for the same-core test.
            for pinned in [false, true] {
                let chosen: Vec<usize> = (0..plan.tests.len())
                    .filter(|&t| {
                        plan.runs(variant, t) && (plan.tests[t] == Test::SameCorePingPong) == pinned
                    })
                    .collect();
                if chosen.is_empty() {
                    continue;
                }
                let tests: Vec<Test> = chosen.iter().map(|&t| plan.tests[t]).collect();
                let cpu = same_core.filter(|_| pinned);
                match orchestrator.run_pair(variant, round, &tests, cpu) {
                    Ok(pair) => {
                        if !pinned || paths[index] == "n/a" {
                            paths[index] = pair.path;
                        }
                        for (&t, run) in chosen.iter().zip(pair.runs) {
                            row[index][t] = Some(run);
                        }
                    }
                    Err(error) => eprintln!(
                        "round {round}: {}{}: {error}",
                        variant.label(),
                        if pinned { " (same-core)" } else { "" }
                    ),
                }
            }
        }
        results.push(row);
        round += 1;
    }
    let _ = std::fs::remove_dir_all(&scratch);
    println!(
        "{round} rounds in {:.1} s; data path seen by the client: {}",
        started.elapsed().as_secs_f64(),
        VARIANTS
            .iter()
            .zip(&paths)
            .map(|(v, p)| format!("{} = {p}", v.label()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    print_tables(&plan, &results);
    if let Some(path) = &args.json {
        std::fs::write(path, raw_json(&plan, &results, &paths).to_string())?;
    }
    Ok(())
}

/// One round's runs: `[variant][test]`, in the order of [`VARIANTS`] and of the plan's tests.
type Round = Vec<Vec<Option<Run>>>;

/// What this run measures: the tests, and which variants run which of them here.
struct Plan {
    tests: Vec<Test>,
    /// Whether the same-core pairs can be pinned here.
    same_core: bool,
    /// Whether there is a library to preload.
    preload: bool,
}

impl Plan {
    /// Whether `variant` runs test number `test` in this run.
    fn runs(&self, variant: Variant, test: usize) -> bool {
        let test = self.tests[test];
        variant.runs(test)
            && (self.same_core || test != Test::SameCorePingPong)
            && (self.preload || !(variant.client_preloaded() || variant.server_preloaded()))
    }

    /// Whether `variant` belongs in test number `test`'s row: it runs the test here, or would
    /// but there is no library to preload (then its cell says n/a, not "not run").
    fn shows(&self, variant: Variant, test: usize) -> bool {
        let kind = self.tests[test];
        variant.runs(kind) && (self.same_core || kind != Test::SameCorePingPong)
    }
}

/// Every round's raw figures, per test and variant (`null` where a pair failed or the variant
/// does not run the test), the variants each test has, and the data path each variant's
/// client saw: what `bench` folds into its report.
fn raw_json(plan: &Plan, results: &[Round], paths: &[String]) -> serde_json::Value {
    use serde_json::json;
    let tests: Vec<serde_json::Value> = plan
        .tests
        .iter()
        .enumerate()
        .map(|(t, &test)| {
            let rounds: Vec<serde_json::Value> = results
                .iter()
                .map(|round| {
                    let variants: serde_json::Map<String, serde_json::Value> = VARIANTS
                        .iter()
                        .enumerate()
                        .map(|(v, variant)| {
                            let value = round[v][t].map_or(serde_json::Value::Null, |run| {
                                json!({
                                    "count": run.count,
                                    "elapsed_ns": run.elapsed_ns,
                                    "client_cpu_ns": run.client_cpu_ns,
                                    "server_cpu_ns": run.server_cpu_ns,
                                })
                            });
                            (variant.label().to_owned(), value)
                        })
                        .collect();
                    serde_json::Value::Object(variants)
                })
                .collect();
            let variants: Vec<&str> = VARIANTS
                .iter()
                .filter(|&&v| plan.shows(v, t))
                .map(|v| v.label())
                .collect();
            json!({
                "name": test.label(),
                "kind": if test.is_ping_pong() { "rtt" } else { "stream" },
                "size": test.size(),
                "variants": variants,
                "rounds": rounds,
            })
        })
        .collect();
    let paths: serde_json::Map<String, serde_json::Value> = VARIANTS
        .iter()
        .zip(paths)
        .map(|(variant, path)| (variant.label().to_owned(), json!(path)))
        .collect();
    json!({ "tests": tests, "paths": paths })
}

/// Width of the test column of the tables.
const LABEL_WIDTH: usize = 18;

fn print_tables(plan: &Plan, results: &[Round]) {
    let tests = &plan.tests;
    println!();
    print!("{:<LABEL_WIDTH$}", "test (median)");
    for variant in VARIANTS {
        let heading = if variant == Variant::Tcp {
            "TCP  fig / cpu-op"
        } else {
            variant.label()
        };
        print!(" {heading:>24}");
    }
    println!();
    for (t, &test) in tests.iter().enumerate() {
        print!("{:<LABEL_WIDTH$}", test.label());
        for (v, &variant) in VARIANTS.iter().enumerate() {
            let cell = if plan.shows(variant, t) {
                let runs: Vec<Run> = results.iter().filter_map(|r| r[v][t]).collect();
                let fig = median(runs.iter().map(|run| figure(test, run)).collect());
                let cpu = median(runs.iter().map(cpu_per_op).collect());
                format!("{} / {}", format_figure(test, fig), format_cpu(cpu))
            } else {
                "-".to_owned()
            };
            print!(" {cell:>24}");
        }
        println!();
    }
    println!();
    println!(
        "{:<LABEL_WIDTH$} {:>22} {:>22} {:>22} {:>26} {:>22}",
        "ratio (median)",
        "sandirect/TCP",
        "sandirect/raw ring",
        "fallback/TCP",
        "sandirect/vm_readv",
        "sandirect/yield"
    );
    let index = |variant: Variant| VARIANTS.iter().position(|&v| v == variant).unwrap_or(0);
    let [tcp, sandirect, fallback, raw, vm_readv, yield_hand_off] = VARIANTS.map(index);
    let blocking_rtt = tests.iter().position(|&t| t == Test::PingPong);
    for (t, &test) in tests.iter().enumerate() {
        // Median of the per-round ratios of variant a's figure in this test to variant b's in
        // test tb (latency or throughput; `invert` turns a latency ratio into a speed one).
        let ratio = |a: usize, b: usize, tb: Option<usize>, invert: bool| {
            let tb = tb?;
            median(
                results
                    .iter()
                    .filter_map(|r| {
                        let (x, y) = (r[a][t]?, r[b][tb]?);
                        let (fx, fy) = (figure(test, &x), figure(tests[tb], &y));
                        Some(if invert { fy / fx } else { fx / fy })
                    })
                    .collect(),
            )
        };
        let same = Some(t);
        let not_run = || "-".to_owned();
        let [over_tcp, over_raw, fallback_speed, over_vm_readv, over_yield] = match test {
            // Latency ratios (lower is better), fallback as speed (TCP RTT / fallback RTT).
            Test::PingPong => [
                judged(ratio(sandirect, tcp, same, false), Some((0.2, true))),
                judged(ratio(sandirect, raw, same, false), Some((1.5, true))),
                judged(ratio(fallback, tcp, same, true), Some((0.97, false))),
                not_run(),
                not_run(),
            ],
            // The raw ring has no event-driven form: its blocking ping-pong is the yardstick.
            Test::EpollPingPong => [
                judged(ratio(sandirect, tcp, same, false), Some((0.2, true))),
                judged(
                    ratio(sandirect, raw, blocking_rtt, false),
                    Some((1.5, true)),
                ),
                judged(ratio(fallback, tcp, same, true), Some((0.97, false))),
                not_run(),
                not_run(),
            ],
            Test::SameCorePingPong => [
                judged(ratio(sandirect, tcp, same, false), None),
                judged(ratio(sandirect, raw, same, false), None),
                not_run(),
                not_run(),
                judged(
                    ratio(sandirect, yield_hand_off, same, false),
                    Some((1.3, true)),
                ),
            ],
            // Throughput ratios (higher is better).
            Test::Stream(size) => [
                judged(ratio(sandirect, tcp, same, false), Some((2.0, false))),
                judged(ratio(sandirect, raw, same, false), None),
                judged(ratio(fallback, tcp, same, false), Some((0.97, false))),
                judged(
                    ratio(sandirect, vm_readv, same, false),
                    (size >= 256 << 10).then_some((0.8, false)),
                ),
                not_run(),
            ],
        };
        println!(
            "{:<LABEL_WIDTH$} {over_tcp:>22} {over_raw:>22} {fallback_speed:>22} \
             {over_vm_readv:>26} {over_yield:>22}",
            test.label(),
        );
    }
    println!();
    println!(
        "rtt rows: latency ratios (sandirect/TCP <= 0.2; sandirect/raw ring <= 1.5, for epoll \
         against the raw ring's blocking rtt as it has no epoll form; same-core sandirect/yield \
         <= 1.3); fallback/TCP as speed (>= 0.97). stream rows: throughput ratios (sandirect/TCP \
         >= 2, fallback/TCP >= 0.97, sandirect/vm_readv >= 0.8 from 256 KiB). cpu-op: CPU time \
         of both processes per message (per round trip for rtt). -: not run."
    );
}

/// A file both processes of a pair map `MAP_SHARED`: the orchestrator creates it zeroed, each
/// end maps it.
mod shared_file {
    use std::io;
    use std::path::Path;

    /// Creates the zeroed file of `bytes` bytes.
    pub fn create(path: &Path, bytes: usize) -> io::Result<()> {
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(path)?;
        file.set_len(bytes as u64)
    }

    /// One process's mapping of the whole file.
    pub struct Mapping {
        base: *mut u8,
        bytes: usize,
    }

    impl Mapping {
        /// Maps the file created by [`create`] with the same size.
        pub fn open(path: &Path, bytes: usize) -> io::Result<Mapping> {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)?;
            if file.metadata()?.len() != bytes as u64 {
                return Err(io::Error::other("shared file has the wrong size"));
            }
            // SAFETY: mapping a file we opened read-write, of exactly `bytes` bytes.
            let base = unsafe {
                libc::mmap(
                    core::ptr::null_mut(),
                    bytes,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            Ok(Mapping {
                base: base.cast(),
                bytes,
            })
        }

        /// The page-aligned start of the mapping, valid for its whole length while `self`
        /// lives.
        pub fn base(&self) -> *mut u8 {
            self.base
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: unmapping our own mapping once.
            unsafe { libc::munmap(self.base.cast(), self.bytes) };
        }
    }
}

/// The raw shared-memory ring baseline: two single-producer single-consumer byte rings in one
/// `MAP_SHARED` file, one per direction, with the shm provider's wait discipline — spin while
/// the peer runs, bounded near one wake-up's cost (35 µs), then sleep on a futex that the peer
/// rings only when we said we sleep. The wait ([`ring::wait_until`], [`ring::notify`]) is also the
/// process_vm_readv channel's, so both yardsticks wait alike.
mod ring {
    use std::io;
    use std::path::Path;
    use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use super::shared_file::{self, Mapping};

    /// Bytes of each ring (a power of two).
    const CAPACITY: usize = 4 << 20;
    const SPIN_LIMIT: Duration = Duration::from_micros(35);
    const RUNNING: u32 = 0;
    const ASLEEP: u32 = 1;
    const WAKING: u32 = 2;

    /// One cache line (two, against adjacent-line prefetch) per shared word.
    #[repr(C, align(128))]
    pub struct Padded<T>(pub T);

    /// One process's published state: whether it runs or sleeps, its futex word, and the CPU
    /// it last waited on. All zero (running, on CPU 0) is its initial state.
    #[repr(C)]
    pub struct SideControl {
        running: Padded<AtomicU32>,
        bell: Padded<AtomicU32>,
        cpu: Padded<AtomicU32>,
    }

    /// Whether this process may run on more than one CPU (else spinning only delays the peer).
    pub fn several_cpus() -> bool {
        std::thread::available_parallelism().map_or(1, |n| n.get()) > 1
    }

    /// Wakes the peer if it said it sleeps (Dekker with [`wait_until`]: our store of what it
    /// waits for, a SeqCst fence, then the load of its state).
    pub fn notify(peer: &SideControl) {
        fence(Ordering::SeqCst);
        if peer.running.0.load(Ordering::SeqCst) == ASLEEP
            && peer
                .running
                .0
                .compare_exchange(ASLEEP, WAKING, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            peer.bell.0.fetch_add(1, Ordering::SeqCst);
            futex_wake(&peer.bell.0);
        }
    }

    /// Waits until `ready()`: spins while the peer runs (up to [`SPIN_LIMIT`]), then sleeps
    /// on our bell after publishing `ASLEEP` and re-checking. Spinning on the CPU the peer
    /// needs would starve it for the whole spin — and a peer being woken tends to be
    /// placed on its waker's CPU — so then it yields between checks instead.
    pub fn wait_until(
        me: &SideControl,
        peer: &SideControl,
        several_cpus: bool,
        ready: impl Fn() -> bool,
    ) {
        if ready() {
            return;
        }
        // SAFETY: sched_getcpu has no preconditions.
        let cpu = unsafe { libc::sched_getcpu() } as u32;
        me.cpu.0.store(cpu, Ordering::Relaxed);
        let peer_state = peer.running.0.load(Ordering::Relaxed);
        if several_cpus && peer_state != ASLEEP {
            let share_cpu = peer_state == WAKING || peer.cpu.0.load(Ordering::Relaxed) == cpu;
            let start = Instant::now();
            let mut spins = 0u32;
            loop {
                if ready() {
                    return;
                }
                if share_cpu {
                    std::thread::yield_now();
                } else {
                    core::hint::spin_loop();
                }
                spins = spins.wrapping_add(1);
                if (share_cpu || spins.is_multiple_of(64))
                    && (start.elapsed() >= SPIN_LIMIT
                        || peer.running.0.load(Ordering::Relaxed) == ASLEEP)
                {
                    break;
                }
            }
        }
        loop {
            let seen = me.bell.0.load(Ordering::SeqCst);
            me.running.0.store(ASLEEP, Ordering::SeqCst);
            if ready() {
                me.running.0.store(RUNNING, Ordering::SeqCst);
                return;
            }
            futex_wait(&me.bell.0, seen, Duration::from_millis(50));
            me.running.0.store(RUNNING, Ordering::SeqCst);
            if ready() {
                return;
            }
        }
    }

    /// One direction: bytes produced and consumed so far.
    #[repr(C)]
    struct RingControl {
        head: Padded<AtomicU64>,
        tail: Padded<AtomicU64>,
    }

    #[repr(C)]
    struct Layout {
        sides: [SideControl; 2],
        rings: [RingControl; 2],
    }

    const DATA_OFFSET: usize = 4096;
    const FILE_BYTES: usize = DATA_OFFSET + 2 * CAPACITY;
    const _: () = assert!(core::mem::size_of::<Layout>() <= DATA_OFFSET);

    /// Which end of the pair this process is.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Side {
        Client = 0,
        Server = 1,
    }

    /// Creates the (zeroed) shared file.
    pub fn create(path: &Path) -> io::Result<()> {
        shared_file::create(path, FILE_BYTES)
    }

    /// This process's end: it produces into one ring and consumes from the other.
    pub struct RingEnd {
        mapping: Mapping,
        side: Side,
        several_cpus: bool,
    }

    impl RingEnd {
        /// Maps the shared file created by [`create`].
        pub fn open(path: &Path, side: Side) -> io::Result<RingEnd> {
            Ok(RingEnd {
                mapping: Mapping::open(path, FILE_BYTES)?,
                side,
                several_cpus: several_cpus(),
            })
        }

        fn layout(&self) -> &Layout {
            // SAFETY: the mapping is FILE_BYTES long, page aligned, and lives as long as self;
            // Layout holds only atomics, valid for every bit pattern (the file starts zeroed).
            unsafe { &*self.mapping.base().cast::<Layout>() }
        }

        fn data(&self, ring: usize) -> *mut u8 {
            // SAFETY: ring < 2; the offset stays inside the mapping.
            unsafe { self.mapping.base().add(DATA_OFFSET + ring * CAPACITY) }
        }

        fn me(&self) -> &SideControl {
            &self.layout().sides[self.side as usize]
        }

        fn peer(&self) -> &SideControl {
            &self.layout().sides[1 - self.side as usize]
        }

        /// The ring we produce into (client → server is ring 0).
        fn outgoing(&self) -> usize {
            self.side as usize
        }

        fn incoming(&self) -> usize {
            1 - self.side as usize
        }

        pub fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
            let ring = &self.layout().rings[self.outgoing()];
            let free = || {
                let head = ring.head.0.load(Ordering::Relaxed);
                let tail = ring.tail.0.load(Ordering::SeqCst);
                CAPACITY as u64 - head.wrapping_sub(tail)
            };
            while !bytes.is_empty() {
                wait_until(self.me(), self.peer(), self.several_cpus, || free() > 0);
                let head = ring.head.0.load(Ordering::Relaxed);
                let offset = head as usize % CAPACITY;
                let length = bytes.len().min(free() as usize).min(CAPACITY - offset);
                // SAFETY: [offset, offset + length) lies in our ring's data area and is free
                // (between head and tail + CAPACITY): the consumer does not read it until we
                // publish the new head below.
                unsafe {
                    core::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        self.data(self.outgoing()).add(offset),
                        length,
                    )
                };
                ring.head.0.store(head + length as u64, Ordering::Release);
                notify(self.peer());
                bytes = &bytes[length..];
            }
            Ok(())
        }

        pub fn read_exact(&mut self, mut bytes: &mut [u8]) -> io::Result<()> {
            let ring = &self.layout().rings[self.incoming()];
            let available = || {
                let head = ring.head.0.load(Ordering::SeqCst);
                head.wrapping_sub(ring.tail.0.load(Ordering::Relaxed))
            };
            while !bytes.is_empty() {
                wait_until(self.me(), self.peer(), self.several_cpus, || {
                    available() > 0
                });
                let tail = ring.tail.0.load(Ordering::Relaxed);
                let offset = tail as usize % CAPACITY;
                let length = bytes.len().min(available() as usize).min(CAPACITY - offset);
                // SAFETY: [offset, offset + length) holds published bytes (Acquire-ordered by
                // the SeqCst head load above) that the producer does not touch until we publish
                // the new tail below.
                unsafe {
                    core::ptr::copy_nonoverlapping(
                        self.data(self.incoming()).add(offset),
                        bytes.as_mut_ptr(),
                        length,
                    )
                };
                ring.tail.0.store(tail + length as u64, Ordering::Release);
                notify(self.peer());
                bytes = &mut bytes[length..];
            }
            Ok(())
        }
    }

    fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
        let timeout = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: a shared (not PRIVATE: two processes) futex wait on a live u32 in our mapping;
        // the kernel re-checks the value atomically.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                &timeout as *const libc::timespec,
            )
        };
    }

    fn futex_wake(word: &AtomicU32) {
        // SAFETY: a shared futex wake on a live u32 in our mapping.
        unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1) };
    }
}

/// The single-copy yardstick: the receiver copies each message straight out of the sender's
/// buffer with `process_vm_readv` — one copy, the fastest transfer between two processes the
/// kernel offers. Per direction the shared file holds one offer (the sender's buffer address
/// and length, a count of offers posted and one of offers taken); the sender waits until its
/// offer is taken before it returns, as a socket's caller may rewrite its buffer once the send
/// returned. Both wait with the raw ring's spin-then-futex discipline.
mod vm_readv {
    use std::io;
    use std::path::Path;
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    use super::ring::{self, Padded, Side, SideControl};
    use super::shared_file::{self, Mapping};

    /// One direction's offer.
    #[repr(C)]
    struct Offer {
        /// Offers posted so far; the newest one's buffer is `buffer`.
        posted: Padded<AtomicU64>,
        /// Offers the receiver finished copying.
        taken: Padded<AtomicU64>,
        /// Address and length, in the sender's address space, of the newest offer's bytes.
        buffer: Padded<[AtomicU64; 2]>,
    }

    #[repr(C)]
    struct Layout {
        sides: [SideControl; 2],
        /// Each end's process id, for its peer's `process_vm_readv`.
        pids: [Padded<AtomicU32>; 2],
        /// Client → server is offer 0.
        offers: [Offer; 2],
    }

    const FILE_BYTES: usize = 4096;
    const _: () = assert!(core::mem::size_of::<Layout>() <= FILE_BYTES);

    /// Creates the (zeroed) shared file.
    pub fn create(path: &Path) -> io::Result<()> {
        shared_file::create(path, FILE_BYTES)
    }

    pub struct VmReadvEnd {
        mapping: Mapping,
        side: Side,
        several_cpus: bool,
        /// Whether the peer may read this process's memory (see [`Self::let_peer_read`]).
        peer_may_read: bool,
        /// Bytes of the current incoming offer already copied.
        consumed: u64,
    }

    impl VmReadvEnd {
        /// Maps the shared file created by [`create`] and publishes this process's id.
        pub fn open(path: &Path, side: Side) -> io::Result<VmReadvEnd> {
            let end = VmReadvEnd {
                mapping: Mapping::open(path, FILE_BYTES)?,
                side,
                several_cpus: ring::several_cpus(),
                peer_may_read: false,
                consumed: 0,
            };
            end.layout().pids[side as usize]
                .0
                .store(std::process::id(), Ordering::SeqCst);
            Ok(end)
        }

        fn layout(&self) -> &Layout {
            // SAFETY: the mapping is FILE_BYTES long, page aligned, and lives as long as self;
            // Layout holds only atomics, valid for every bit pattern (the file starts zeroed).
            unsafe { &*self.mapping.base().cast::<Layout>() }
        }

        fn me(&self) -> &SideControl {
            &self.layout().sides[self.side as usize]
        }

        fn peer(&self) -> &SideControl {
            &self.layout().sides[1 - self.side as usize]
        }

        fn peer_pid(&self) -> io::Result<libc::pid_t> {
            match self.layout().pids[1 - self.side as usize]
                .0
                .load(Ordering::SeqCst)
            {
                0 => Err(io::Error::other(
                    "the peer has not published its process id",
                )),
                pid => Ok(pid as libc::pid_t),
            }
        }

        /// Under Yama's `ptrace_scope` 1 only an ancestor may read a process's memory unless
        /// the process names its reader; the two ends are siblings. Before our first offer the
        /// peer has published its id: the server published it before it said it is ready, the
        /// client before its first offer, which the server reads before it offers anything.
        fn let_peer_read(&mut self) -> io::Result<()> {
            if self.peer_may_read {
                return Ok(());
            }
            let peer = self.peer_pid()?;
            // SAFETY: PR_SET_PTRACER takes a process id and ignores the other arguments.
            let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, peer as libc::c_ulong, 0, 0, 0) };
            // EINVAL: no Yama, nothing to allow.
            if rc != 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
                return Err(io::Error::last_os_error());
            }
            self.peer_may_read = true;
            Ok(())
        }

        pub fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
            if bytes.is_empty() {
                return Ok(());
            }
            self.let_peer_read()?;
            let offer = &self.layout().offers[self.side as usize];
            offer.buffer.0[0].store(bytes.as_ptr() as u64, Ordering::Relaxed);
            offer.buffer.0[1].store(bytes.len() as u64, Ordering::Relaxed);
            let sequence = offer.posted.0.load(Ordering::Relaxed) + 1;
            offer.posted.0.store(sequence, Ordering::Release);
            ring::notify(self.peer());
            ring::wait_until(self.me(), self.peer(), self.several_cpus, || {
                offer.taken.0.load(Ordering::SeqCst) == sequence
            });
            Ok(())
        }

        pub fn read_exact(&mut self, mut bytes: &mut [u8]) -> io::Result<()> {
            let offer = &self.layout().offers[1 - self.side as usize];
            // Copied out of the current offer so far (kept in self between calls).
            let mut consumed = self.consumed;
            while !bytes.is_empty() {
                ring::wait_until(self.me(), self.peer(), self.several_cpus, || {
                    offer.posted.0.load(Ordering::SeqCst) != offer.taken.0.load(Ordering::Relaxed)
                });
                // An offer is posted after its sender published its process id.
                let pid = self.peer_pid()?;
                let address = offer.buffer.0[0].load(Ordering::Relaxed);
                let length = offer.buffer.0[1].load(Ordering::Relaxed);
                let wanted = (length - consumed).min(bytes.len() as u64) as usize;
                let local = libc::iovec {
                    iov_base: bytes.as_mut_ptr().cast(),
                    iov_len: wanted,
                };
                let remote = libc::iovec {
                    iov_base: (address + consumed) as *mut libc::c_void,
                    iov_len: wanted,
                };
                // SAFETY: `local` is our own writable buffer of `wanted` bytes; `remote` names
                // bytes of the peer's offered buffer, which it leaves alone until we take the
                // offer (the kernel checks the peer's side).
                let copied = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
                if copied < 0 {
                    return Err(io::Error::last_os_error());
                }
                if copied == 0 {
                    return Err(io::Error::other("process_vm_readv copied nothing"));
                }
                consumed += copied as u64;
                bytes = &mut bytes[copied as usize..];
                if consumed == length {
                    consumed = 0;
                    let taken = offer.taken.0.load(Ordering::Relaxed);
                    offer.taken.0.store(taken + 1, Ordering::Release);
                    ring::notify(self.peer());
                }
            }
            self.consumed = consumed;
            Ok(())
        }
    }

    impl super::Transport for VmReadvEnd {
        fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
            self.write_all(bytes)
        }

        fn receive(&mut self, bytes: &mut [u8]) -> io::Result<()> {
            self.read_exact(bytes)
        }
    }
}

/// The same-core yardstick: two processes on one CPU pass messages through a shared page,
/// each calling `sched_yield` until it is its turn — the cheapest hand-off between two
/// processes that share a CPU, with no sleep or wake-up. Per direction a mailbox holds up to
/// `SLOT` bytes and their count (0: empty). A wait gives up after `PATIENCE` without the
/// peer's turn, so a lost peer ends the pair instead of yielding forever.
mod yield_hand_off {
    use std::cell::UnsafeCell;
    use std::io;
    use std::path::Path;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::{Duration, Instant};

    use super::ring::{Padded, Side};
    use super::shared_file::{self, Mapping};

    const SLOT: usize = 256;
    const PATIENCE: Duration = Duration::from_secs(1);

    #[repr(C)]
    struct Mailbox {
        /// Bytes in `bytes` (0: the mailbox is the sender's to fill).
        length: Padded<AtomicU32>,
        bytes: UnsafeCell<[u8; SLOT]>,
    }

    #[repr(C)]
    struct Layout {
        /// Client → server is mailbox 0.
        mailboxes: [Mailbox; 2],
    }

    const FILE_BYTES: usize = 4096;
    const _: () = assert!(core::mem::size_of::<Layout>() <= FILE_BYTES);

    /// Creates the (zeroed) shared page.
    pub fn create(path: &Path) -> io::Result<()> {
        shared_file::create(path, FILE_BYTES)
    }

    pub struct YieldEnd {
        mapping: Mapping,
        side: Side,
        /// Bytes of the incoming mailbox already taken.
        consumed: usize,
    }

    /// Yields the CPU until `ready()`; an error after [`PATIENCE`].
    fn yield_until(ready: impl Fn() -> bool) -> io::Result<()> {
        let start = Instant::now();
        let mut yields = 0u32;
        while !ready() {
            std::thread::yield_now();
            yields = yields.wrapping_add(1);
            if yields.is_multiple_of(64) && start.elapsed() > PATIENCE {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "sched_yield hand-off: the peer took no turn for 1 s",
                ));
            }
        }
        Ok(())
    }

    impl YieldEnd {
        pub fn open(path: &Path, side: Side) -> io::Result<YieldEnd> {
            Ok(YieldEnd {
                mapping: Mapping::open(path, FILE_BYTES)?,
                side,
                consumed: 0,
            })
        }

        fn layout(&self) -> &Layout {
            // SAFETY: the mapping is FILE_BYTES long, page aligned, and lives as long as self;
            // Layout is an atomic and bytes, valid for every bit pattern, and its bytes are
            // only touched through the UnsafeCell by the mailbox's owner of the moment.
            unsafe { &*self.mapping.base().cast::<Layout>() }
        }
    }

    impl super::Transport for YieldEnd {
        fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
            let mailbox = &self.layout().mailboxes[self.side as usize];
            for chunk in bytes.chunks(SLOT) {
                yield_until(|| mailbox.length.0.load(Ordering::Acquire) == 0)?;
                // SAFETY: an empty mailbox is ours until we publish its length; the chunk fits.
                unsafe {
                    core::ptr::copy_nonoverlapping(
                        chunk.as_ptr(),
                        mailbox.bytes.get().cast::<u8>(),
                        chunk.len(),
                    )
                };
                mailbox
                    .length
                    .0
                    .store(chunk.len() as u32, Ordering::Release);
            }
            Ok(())
        }

        fn receive(&mut self, mut bytes: &mut [u8]) -> io::Result<()> {
            let mailbox = &self.layout().mailboxes[1 - self.side as usize];
            // Taken out of the current mailbox so far (kept in self between calls).
            let mut consumed = self.consumed;
            while !bytes.is_empty() {
                yield_until(|| mailbox.length.0.load(Ordering::Acquire) != 0)?;
                let length = mailbox.length.0.load(Ordering::Acquire) as usize;
                let taken = (length - consumed).min(bytes.len());
                // SAFETY: a full mailbox is ours until we empty it; consumed + taken <= length
                // <= SLOT.
                unsafe {
                    core::ptr::copy_nonoverlapping(
                        mailbox.bytes.get().cast::<u8>().add(consumed),
                        bytes.as_mut_ptr(),
                        taken,
                    )
                };
                consumed += taken;
                bytes = &mut bytes[taken..];
                if consumed == length {
                    consumed = 0;
                    mailbox.length.0.store(0, Ordering::Release);
                }
            }
            self.consumed = consumed;
            Ok(())
        }
    }
}
