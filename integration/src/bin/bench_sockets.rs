//! The socket benchmark: ping-pong RTT at 64 B and streaming from 64 B to
//! 4 MiB messages, between two processes, for four variants interleaved in every round:
//!
//! * `TCP`       — kernel TCP over loopback, nothing preloaded;
//! * `sandirect` — both processes preloaded (the SAN path once it exists, TCP through the hooks
//!   until then; the path actually taken is read from the published records and printed);
//! * `fallback`  — only the client preloaded: TCP through the hooks, the cost of being there;
//! * `raw ring`  — the yardstick: two SPSC byte rings in a `MAP_SHARED` file with the same
//!   spin-then-futex wait as the shm provider, no sockets at all.
//!
//! Each round runs every variant once (in a rotating order, so drift and warm-up hit all
//! variants alike) as a fresh server and client process pair; each test is calibrated to a
//! time slice and measured. Ratios are the median of the per-round ratios; CPU time per
//! operation is the sum of both processes' `getrusage` times over the measured run. The
//! benchmark prints; it never fails a build (exit status 0 unless it could not run at all).
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
/// Message size of the ping-pong test.
const RTT_SIZE: usize = 64;

/// One measurement kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Test {
    /// Ping-pong of `RTT_SIZE`-byte messages; the figure is the round-trip time.
    PingPong,
    /// One-way stream of messages of this size; the figure is the throughput.
    Stream(usize),
}

impl Test {
    fn all() -> Vec<Test> {
        std::iter::once(Test::PingPong)
            .chain(STREAM_SIZES.iter().map(|&size| Test::Stream(size)))
            .collect()
    }

    fn size(self) -> usize {
        match self {
            Test::PingPong => RTT_SIZE,
            Test::Stream(size) => size,
        }
    }

    fn label(self) -> String {
        match self {
            Test::PingPong => format!("rtt {}", human_size(RTT_SIZE)),
            Test::Stream(size) => format!("stream {}", human_size(size)),
        }
    }

    /// Wire code in the test header.
    fn code(self) -> u32 {
        match self {
            Test::PingPong => 1,
            Test::Stream(_) => 2,
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

/// The four variants, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Tcp,
    Sandirect,
    Fallback,
    RawRing,
}

const VARIANTS: [Variant; 4] = [
    Variant::Tcp,
    Variant::Sandirect,
    Variant::Fallback,
    Variant::RawRing,
];

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Tcp => "TCP",
            Variant::Sandirect => "sandirect",
            Variant::Fallback => "fallback",
            Variant::RawRing => "raw ring",
        }
    }

    fn client_preloaded(self) -> bool {
        matches!(self, Variant::Sandirect | Variant::Fallback)
    }

    fn server_preloaded(self) -> bool {
        self == Variant::Sandirect
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
}

impl Transport for TcpStream {
    fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.write_all(bytes)
    }

    fn receive(&mut self, bytes: &mut [u8]) -> io::Result<()> {
        self.read_exact(bytes)
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

/// Serves tests until the client ends the session: for each, receives (and for ping-pong
/// echoes) the messages, then acknowledges with the CPU time the run cost this process.
fn serve(transport: &mut dyn Transport) -> io::Result<()> {
    let mut buffer = vec![0u8; STREAM_SIZES.iter().copied().max().unwrap_or(RTT_SIZE)];
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
        let cpu_before = cpu_time_ns();
        let message = &mut buffer[..size];
        for _ in 0..count {
            transport.receive(message)?;
            if code == Test::PingPong.code() {
                transport.send(message)?;
            }
        }
        let cpu = cpu_time_ns().saturating_sub(cpu_before);
        let mut ack = [0u8; 16];
        ack[0..8].copy_from_slice(&cpu.to_le_bytes());
        ack[8..16].copy_from_slice(&count.to_le_bytes());
        transport.send(&ack)?;
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
    let cpu_before = cpu_time_ns();
    let start = Instant::now();
    for _ in 0..count {
        transport.send(&sent)?;
        if test == Test::PingPong {
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
    match (args.role.as_deref(), &args.ring) {
        (Some("server"), None) => {
            let mut stream = match args.sockets {
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
            stream.set_nodelay(true)?;
            serve(&mut stream)
        }
        (Some("server"), Some(ring)) => {
            let mut end = RingEnd::open(ring, ring::Side::Server)?;
            println!("ready");
            io::stdout().flush()?;
            serve(&mut end)
        }
        (Some("client"), None) => {
            let port = args
                .port
                .ok_or_else(|| io::Error::other("client needs --port"))?;
            let mut stream = match (args.sockets, args.source) {
                (SocketStyle::Std, None) => TcpStream::connect((args.address, port))?,
                (style, source) => c_sockets::connect(style, source, args.address, port)?,
            };
            stream.set_nodelay(true)?;
            if args.fork_after_first && args.tests.len() > 1 {
                return forked_client(stream, slice, &args.tests);
            }
            warm_up(&mut stream, args.warmup, &args.tests)?;
            client(&mut stream, slice, &args.tests)?;
            end_session(&mut stream)?;
            println!("path {}", own_published_path());
            Ok(())
        }
        (Some("client"), Some(ring)) => {
            let mut end = RingEnd::open(ring, ring::Side::Client)?;
            client(&mut end, slice, &args.tests)?;
            end_session(&mut end)?;
            println!("path raw-ring");
            Ok(())
        }
        _ => Err(io::Error::other("--role must be server or client")),
    }
}

/// A forked client (a pre-forking program's pattern): the first test runs in this process,
/// which then forks; the child runs the other tests on the inherited connection and ends the
/// session, while the parent closes its copy and waits for the child. The child prints the
/// data path it saw.
fn forked_client(mut stream: TcpStream, slice: Duration, tests: &[Test]) -> io::Result<()> {
    client(&mut stream, slice, &tests[..1])?;
    io::stdout().flush()?;
    // SAFETY: this process has a single thread (the role processes start none), so the child
    // may run any code; it only uses the inherited connection and exits.
    let child = unsafe { libc::fork() };
    if child < 0 {
        return Err(io::Error::last_os_error());
    }
    if child == 0 {
        client(&mut stream, slice, &tests[1..])?;
        end_session(&mut stream)?;
        println!("path {}", own_published_path());
        io::stdout().flush()?;
        return Ok(());
    }
    drop(stream);
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
    ring: Option<PathBuf>,
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

/// `rtt` or a stream message size in bytes (at most the largest of [`STREAM_SIZES`]).
fn parse_test(word: &str) -> Result<Test, String> {
    if word == "rtt" {
        return Ok(Test::PingPong);
    }
    let largest = STREAM_SIZES.iter().copied().max().unwrap_or(RTT_SIZE);
    match word.parse::<usize>() {
        Ok(size) if (1..=largest).contains(&size) => Ok(Test::Stream(size)),
        _ => Err(format!(
            "bad test {word:?}: rtt or a stream size of 1..={largest} bytes"
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
        ring: None,
        slice: Duration::from_millis(100),
        address: Ipv4Addr::LOCALHOST,
        source: None,
        sockets: SocketStyle::Std,
        tests: Test::all(),
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
            "--ring" => args.ring = Some(value("--ring")?.into()),
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
                     [--tests rtt,SIZE,...] [--slice-ms MS] [--warmup-ms MS]
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

/// What one variant's process pair measured in one round.
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

impl Orchestrator {
    fn command(&self, preloaded: bool) -> Command {
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
        command
    }

    fn run_pair(&self, variant: Variant, round: usize) -> io::Result<PairResult> {
        let slice_ms = self.slice.as_millis().to_string();
        let mut server_command = self.command(variant.server_preloaded());
        server_command.args(["--role", "server"]);
        let mut client_command = self.command(variant.client_preloaded());
        client_command.args(["--role", "client", "--slice-ms", &slice_ms]);
        let ring_path = self.scratch.join(format!("ring-{round}"));
        if variant == Variant::RawRing {
            ring::create(&ring_path)?;
            server_command.arg("--ring").arg(&ring_path);
            client_command.arg("--ring").arg(&ring_path);
        }
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
        let client = Worker(client_command.spawn()?);
        let output = client_output(client)?;
        let _ = server.0.wait();
        let _ = std::fs::remove_file(&ring_path);
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
        if runs.len() != Test::all().len() {
            return Err(io::Error::other(format!(
                "{} client reported {} of {} tests",
                variant.label(),
                runs.len(),
                Test::all().len()
            )));
        }
        Ok(PairResult { runs, path })
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
        Test::PingPong => per_message,
        Test::Stream(size) => size as f64 * 1e9 / per_message,
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
        (Test::PingPong, Some(ns)) => format!("{:.1} us", ns / 1e3),
        (Test::Stream(_), Some(bytes_per_second)) => {
            format!("{:.0} MB/s", bytes_per_second / 1e6)
        }
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
    println!(
        "bench_sockets: {} s budget, {} variants x {} tests per round, slice {} ms, preload {}",
        budget.as_secs(),
        VARIANTS.len(),
        Test::all().len(),
        slice.as_millis(),
        library
            .as_ref()
            .map_or("NONE (sandirect and fallback rows are n/a)".into(), |l| l
                .display()
                .to_string())
    );
    // results[round][variant] = the pair's runs (None when the pair failed or is unavailable).
    let mut results: Vec<Vec<Option<Vec<Run>>>> = Vec::new();
    let mut paths = vec![String::from("n/a"); VARIANTS.len()];
    let started = Instant::now();
    // Rounds until the budget is spent (the first round's duration predicts the next), at least
    // two so that every figure is a median of more than one pairing.
    let mut round = 0;
    while round < 2 || started.elapsed() * (round as u32 + 1) / round as u32 <= budget {
        let mut row = vec![None; VARIANTS.len()];
        for offset in 0..VARIANTS.len() {
            let index = (round + offset) % VARIANTS.len();
            let variant = VARIANTS[index];
            if (variant.client_preloaded() || variant.server_preloaded()) && library.is_none() {
                continue;
            }
            match orchestrator.run_pair(variant, round) {
                Ok(pair) => {
                    paths[index] = pair.path;
                    row[index] = Some(pair.runs);
                }
                Err(error) => eprintln!("round {round}: {}: {error}", variant.label()),
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
    print_tables(&results);
    if let Some(path) = &args.json {
        std::fs::write(path, raw_json(&results, &paths).to_string())?;
    }
    Ok(())
}

/// Every round's raw figures, per test and variant (`null` where a pair failed), with the data
/// path each variant's client saw: what `bench` folds into its report.
fn raw_json(results: &[Vec<Option<Vec<Run>>>], paths: &[String]) -> serde_json::Value {
    use serde_json::json;
    let tests: Vec<serde_json::Value> = Test::all()
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
                            let run = round[v].as_ref().and_then(|runs| runs.get(t));
                            let value = run.map_or(serde_json::Value::Null, |run| {
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
            json!({
                "name": test.label(),
                "kind": match test { Test::PingPong => "rtt", Test::Stream(_) => "stream" },
                "size": test.size(),
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

fn print_tables(results: &[Vec<Option<Vec<Run>>>]) {
    let tests = Test::all();
    let run_of = |round: &Vec<Option<Vec<Run>>>, variant: usize, test: usize| {
        round[variant]
            .as_ref()
            .and_then(|runs| runs.get(test))
            .copied()
    };
    println!();
    println!(
        "{:<14} {:>26} {:>26} {:>26} {:>26}",
        "test (median)", "TCP  fig / cpu-op", "sandirect", "fallback", "raw ring"
    );
    for (t, &test) in tests.iter().enumerate() {
        let cells: Vec<String> = (0..VARIANTS.len())
            .map(|v| {
                let runs: Vec<Run> = results.iter().filter_map(|r| run_of(r, v, t)).collect();
                let fig = median(runs.iter().map(|run| figure(test, run)).collect());
                let cpu = median(runs.iter().map(cpu_per_op).collect());
                format!("{} / {}", format_figure(test, fig), format_cpu(cpu))
            })
            .collect();
        println!(
            "{:<14} {:>26} {:>26} {:>26} {:>26}",
            test.label(),
            cells[0],
            cells[1],
            cells[2],
            cells[3]
        );
    }
    println!();
    println!(
        "{:<14} {:>24} {:>24} {:>24}",
        "ratio (median)", "sandirect/TCP", "sandirect/raw ring", "fallback/TCP"
    );
    let [tcp, sandirect, fallback, raw] = [0, 1, 2, 3];
    for (t, &test) in tests.iter().enumerate() {
        // Per-round ratio of the figures of variants a and b (latency or throughput).
        let ratio = |a: usize, b: usize, invert: bool| {
            median(
                results
                    .iter()
                    .filter_map(|r| {
                        let (x, y) = (run_of(r, a, t)?, run_of(r, b, t)?);
                        let (fx, fy) = (figure(test, &x), figure(test, &y));
                        Some(if invert { fy / fx } else { fx / fy })
                    })
                    .collect(),
            )
        };
        let (over_tcp, over_raw, fallback_speed) = match test {
            // Latency ratios (lower is better), fallback as speed (TCP RTT / fallback RTT).
            Test::PingPong => (
                judged(ratio(sandirect, tcp, false), Some((0.2, true))),
                judged(ratio(sandirect, raw, false), Some((1.5, true))),
                judged(ratio(fallback, tcp, true), Some((0.97, false))),
            ),
            // Throughput ratios (higher is better).
            Test::Stream(_) => (
                judged(ratio(sandirect, tcp, false), Some((2.0, false))),
                judged(ratio(sandirect, raw, false), None),
                judged(ratio(fallback, tcp, false), Some((0.97, false))),
            ),
        };
        println!(
            "{:<14} {:>24} {:>24} {:>24}",
            test.label(),
            over_tcp,
            over_raw,
            fallback_speed
        );
    }
    println!();
    println!(
        "rtt rows: latency ratios (sandirect/TCP <= 0.2, sandirect/raw ring <= 1.5); fallback/TCP \
         as speed (>= 0.97). stream rows: throughput ratios (sandirect/TCP >= 2, fallback/TCP >= \
         0.97). cpu-op: CPU time of both processes per message (per round trip for rtt)."
    );
}

/// The raw shared-memory ring baseline: two single-producer single-consumer byte rings in one
/// `MAP_SHARED` file, one per direction, with the shm provider's wait discipline — spin while
/// the peer runs, bounded near one wake-up's cost (35 µs), then sleep on a futex that the peer
/// rings only when we said we sleep.
mod ring {
    use std::io;
    use std::path::Path;
    use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    /// Bytes of each ring (a power of two).
    const CAPACITY: usize = 4 << 20;
    const SPIN_LIMIT: Duration = Duration::from_micros(35);
    const RUNNING: u32 = 0;
    const ASLEEP: u32 = 1;
    const WAKING: u32 = 2;

    /// One cache line (two, against adjacent-line prefetch) per shared word.
    #[repr(C, align(128))]
    struct Padded<T>(T);

    /// One process's published state: whether it runs or sleeps, its futex word, and the CPU
    /// it last waited on.
    #[repr(C)]
    struct SideControl {
        running: Padded<AtomicU32>,
        bell: Padded<AtomicU32>,
        cpu: Padded<AtomicU32>,
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
        let file = std::fs::OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(path)?;
        file.set_len(FILE_BYTES as u64)
    }

    /// This process's end: it produces into one ring and consumes from the other.
    pub struct RingEnd {
        base: *mut u8,
        side: Side,
        multi_cpu: bool,
    }

    impl RingEnd {
        /// Maps the shared file created by [`create`].
        pub fn open(path: &Path, side: Side) -> io::Result<RingEnd> {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)?;
            if file.metadata()?.len() != FILE_BYTES as u64 {
                return Err(io::Error::other("ring file has the wrong size"));
            }
            // SAFETY: mapping a file we opened read-write, of exactly FILE_BYTES bytes.
            let base = unsafe {
                libc::mmap(
                    core::ptr::null_mut(),
                    FILE_BYTES,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    0,
                )
            };
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let multi_cpu = std::thread::available_parallelism().map_or(1, |n| n.get()) > 1;
            Ok(RingEnd {
                base: base.cast(),
                side,
                multi_cpu,
            })
        }

        fn layout(&self) -> &Layout {
            // SAFETY: the mapping is FILE_BYTES long, page aligned, and lives as long as self;
            // Layout holds only atomics, valid for every bit pattern (the file starts zeroed).
            unsafe { &*self.base.cast::<Layout>() }
        }

        fn data(&self, ring: usize) -> *mut u8 {
            // SAFETY: ring < 2; the offset stays inside the mapping.
            unsafe { self.base.add(DATA_OFFSET + ring * CAPACITY) }
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

        /// Wakes the peer if it said it sleeps (Dekker with [`wait`](Self::wait): our store
        /// of head/tail, a SeqCst fence, then the load of its state).
        fn notify_peer(&self) {
            fence(Ordering::SeqCst);
            let peer = self.peer();
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
        fn wait(&self, ready: impl Fn(&Self) -> bool) {
            if ready(self) {
                return;
            }
            // SAFETY: sched_getcpu has no preconditions.
            let cpu = unsafe { libc::sched_getcpu() } as u32;
            self.me().cpu.0.store(cpu, Ordering::Relaxed);
            let peer_state = self.peer().running.0.load(Ordering::Relaxed);
            if self.multi_cpu && peer_state != ASLEEP {
                let share_cpu =
                    peer_state == WAKING || self.peer().cpu.0.load(Ordering::Relaxed) == cpu;
                let start = Instant::now();
                let mut spins = 0u32;
                loop {
                    if ready(self) {
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
                            || self.peer().running.0.load(Ordering::Relaxed) == ASLEEP)
                    {
                        break;
                    }
                }
            }
            let me = self.me();
            loop {
                let seen = me.bell.0.load(Ordering::SeqCst);
                me.running.0.store(ASLEEP, Ordering::SeqCst);
                if ready(self) {
                    me.running.0.store(RUNNING, Ordering::SeqCst);
                    return;
                }
                futex_wait(&me.bell.0, seen, Duration::from_millis(50));
                me.running.0.store(RUNNING, Ordering::SeqCst);
                if ready(self) {
                    return;
                }
            }
        }

        pub fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
            let ring_index = self.outgoing();
            while !bytes.is_empty() {
                let free = |end: &Self| {
                    let ring = &end.layout().rings[ring_index];
                    let head = ring.head.0.load(Ordering::Relaxed);
                    let tail = ring.tail.0.load(Ordering::SeqCst);
                    CAPACITY as u64 - head.wrapping_sub(tail)
                };
                self.wait(|end| free(end) > 0);
                let ring = &self.layout().rings[ring_index];
                let head = ring.head.0.load(Ordering::Relaxed);
                let offset = head as usize % CAPACITY;
                let length = bytes.len().min(free(self) as usize).min(CAPACITY - offset);
                // SAFETY: [offset, offset + length) lies in our ring's data area and is free
                // (between head and tail + CAPACITY): the consumer does not read it until we
                // publish the new head below.
                unsafe {
                    core::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        self.data(ring_index).add(offset),
                        length,
                    )
                };
                ring.head.0.store(head + length as u64, Ordering::Release);
                self.notify_peer();
                bytes = &bytes[length..];
            }
            Ok(())
        }

        pub fn read_exact(&mut self, mut bytes: &mut [u8]) -> io::Result<()> {
            let ring_index = self.incoming();
            while !bytes.is_empty() {
                let available = |end: &Self| {
                    let ring = &end.layout().rings[ring_index];
                    let head = ring.head.0.load(Ordering::SeqCst);
                    head.wrapping_sub(ring.tail.0.load(Ordering::Relaxed))
                };
                self.wait(|end| available(end) > 0);
                let ring = &self.layout().rings[ring_index];
                let tail = ring.tail.0.load(Ordering::Relaxed);
                let offset = tail as usize % CAPACITY;
                let length = bytes
                    .len()
                    .min(available(self) as usize)
                    .min(CAPACITY - offset);
                // SAFETY: [offset, offset + length) holds published bytes (Acquire-ordered by
                // the SeqCst head load above) that the producer does not touch until we publish
                // the new tail below.
                unsafe {
                    core::ptr::copy_nonoverlapping(
                        self.data(ring_index).add(offset),
                        bytes.as_mut_ptr(),
                        length,
                    )
                };
                ring.tail.0.store(tail + length as u64, Ordering::Release);
                self.notify_peer();
                bytes = &mut bytes[length..];
            }
            Ok(())
        }
    }

    impl Drop for RingEnd {
        fn drop(&mut self) {
            // SAFETY: unmapping our own mapping once.
            unsafe { libc::munmap(self.base.cast(), FILE_BYTES) };
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
