//! Cross-host echo over plain blocking `std::net` sockets, for the verbs SAN tests in the
//! soft-RDMA VM (two addresses of one guest stand for two hosts). It knows nothing of
//! sandirect: run it natively and under the preload.
//!
//! ```text
//! san_xhost server ADDR [GO_FILE]    # listens on ADDR:0, prints "port N", serves one client
//!                                     # (with GO_FILE: accepts only once that file exists)
//! san_xhost client ADDR:PORT LOCAL BYTES [CHUNK]  # binds LOCAL:0, streams BYTES, checks the echo
//! san_xhost sink ADDR                 # as server, but reads until end-of-file or an error
//! san_xhost flood ADDR:PORT LOCAL     # as client, but writes until an error
//! san_xhost answer ADDR               # answers one 4-byte request, then reads until the end
//! san_xhost interrupted-client ADDR:PORT LOCAL  # a round trip, then a read a signal breaks
//! san_xhost receiver ADDR             # as server, one way: reads until end-of-file
//! san_xhost sender ADDR:PORT LOCAL BYTES [CHUNK]  # as client, one way: streams BYTES
//! san_xhost fork-server ADDR N        # accepts N clients, forks a child per connection
//! san_xhost fork-client ADDR:PORT LOCAL BYTES [CHUNK]  # as client, the I/O in a fork child
//! san_xhost multi-server ADDR N       # accepts N clients, serves each in a thread
//! san_xhost multi-client ADDR:PORT LOCAL N BYTES [CHUNK]  # N connections at once, each a client
//! ```
//!
//! `receiver`/`sender` move BYTES one way (no echo, nothing held in memory: the pattern is
//! generated and both sides checksum as the bytes go), then the receiver answers with one
//! byte so the sender knows everything arrived before it reads its counters.
//!
//! `fork-server` is the classic forking server: the parent accepts, forks, closes its copy and
//! accepts the next; the child serves the connection as `server` does (banner, echo) and
//! prints its `server ok` line. `fork-client` connects and reads the banner in the parent,
//! then forks: the child streams and checks the echo, the parent closes its copy. The path
//! they report is the child's (a fork moves SAN connections back to TCP first:
//! `docs/ARCHITECTURE.md`, "fork and exec").
//!
//! `multi-client` opens its N connections one after another and reads each banner while the
//! earlier ones stay open (so each connection's set-up meets the resources the earlier ones
//! hold, e.g. pinned memory under `RLIMIT_MEMLOCK`), then converses on all of them at once.
//! Both sides print a line per connection, then `<side> all ok conns=N san=K tcp=M`.
//!
//! `sink`/`flood` are for peer-death tests: each prints `accepted`/`connected` once the
//! connection is up and `<side> stopped: <how>` at the end; kill one side and time the other.
//!
//! The client streams BYTES of a seeded pattern (in a thread, CHUNK-byte writes, default
//! 24 000; 4 MiB writes take the rendezvous) and shuts
//! down writing; the server echoes everything until end-of-file, then shuts down; the client
//! checks that the echo equals the pattern. The server first sends a 64-byte banner the client
//! reads before streaming, so both directions start with the acceptor's bytes and the
//! client's bytes cross while the connection may still be switching.
//!
//! Each side prints `<side> ok bytes=N checksum=X path=P tcp=S/R san=S/R rdv=S/R reason=W`:
//! the data path, byte counters and TCP reason (`-`, `downgraded`, …) the interposer published
//! for the connection (`tcp`, zeros and `-` natively).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use integration::pattern::XorShift64;
use preload_core::record::{Counter, DataPath, SocketState};

const BANNER: &[u8; 64] = b"sandirect-banner:0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJK";

/// The test stream: a xorshift sequence, eight bytes per step, generated piece by piece (a
/// 256 MiB stream is never held in memory; word steps keep the debug build fast enough for
/// the emulated guest).
struct Pattern {
    generator: XorShift64,
    /// The current word and how many of its bytes were handed out.
    word: [u8; 8],
    used: usize,
}

impl Pattern {
    fn new() -> Pattern {
        Pattern {
            generator: XorShift64::new(0x9e37_79b9_7f4a_7c15),
            word: [0; 8],
            used: 8,
        }
    }

    fn next_word(&mut self) -> [u8; 8] {
        self.generator.next_u64().to_le_bytes()
    }

    fn fill(&mut self, out: &mut [u8]) {
        let leftover = (8 - self.used).min(out.len());
        out[..leftover].copy_from_slice(&self.word[self.used..self.used + leftover]);
        self.used += leftover;
        let mut words = out[leftover..].chunks_exact_mut(8);
        for word in &mut words {
            word.copy_from_slice(&self.next_word());
        }
        let tail = words.into_remainder();
        if !tail.is_empty() {
            self.word = self.next_word();
            tail.copy_from_slice(&self.word[..tail.len()]);
            self.used = tail.len();
        }
    }
}

fn pattern(len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    Pattern::new().fill(&mut data);
    data
}

/// An FNV-1a-style checksum over little-endian 64-bit words, fed piece by piece (the pieces
/// may split words anywhere): order-sensitive, so a reordered or duplicated chunk changes it.
struct Checksum {
    hash: u64,
    pending: [u8; 8],
    pending_len: usize,
}

const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl Checksum {
    fn new() -> Checksum {
        Checksum {
            hash: 0xcbf2_9ce4_8422_2325,
            pending: [0; 8],
            pending_len: 0,
        }
    }

    fn mix(hash: u64, word: u64) -> u64 {
        (hash ^ word).wrapping_mul(FNV_PRIME).rotate_left(23)
    }

    fn feed(&mut self, mut data: &[u8]) {
        if self.pending_len > 0 {
            let take = (8 - self.pending_len).min(data.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&data[..take]);
            self.pending_len += take;
            data = &data[take..];
            if self.pending_len < 8 {
                return;
            }
            self.hash = Self::mix(self.hash, u64::from_le_bytes(self.pending));
            self.pending_len = 0;
        }
        let mut words = data.chunks_exact(8);
        for word in &mut words {
            let word: [u8; 8] = word.try_into().unwrap_or_default();
            self.hash = Self::mix(self.hash, u64::from_le_bytes(word));
        }
        let tail = words.remainder();
        self.pending[..tail.len()].copy_from_slice(tail);
        self.pending_len = tail.len();
    }

    /// The checksum of everything fed so far (a partial last word counts with its length).
    fn value(&self) -> u64 {
        if self.pending_len == 0 {
            return self.hash;
        }
        let mut last = [0u8; 8];
        last[..self.pending_len].copy_from_slice(&self.pending[..self.pending_len]);
        Self::mix(
            Self::mix(self.hash, u64::from_le_bytes(last)),
            self.pending_len as u64,
        )
    }
}

fn checksum(data: &[u8]) -> u64 {
    let mut sum = Checksum::new();
    sum.feed(data);
    sum.value()
}

/// What the interposer published for this process's connected socket `fd` (by descriptor: a
/// server's connections all share its local port):
/// `path=P tcp=SENT/RECEIVED san=SENT/RECEIVED` (SAN bytes: inline plus rendezvous), or
/// `path=tcp` with zero counts when nothing is published (natively).
fn published(fd: std::os::fd::RawFd) -> String {
    let none = || "path=tcp tcp=0/0 san=0/0 rdv=0/0 reason=-".to_owned();
    let Some(connections) = integration::own_published_connections() else {
        return none();
    };
    connections
        .iter()
        .filter(|c| c.state == SocketState::San || c.state == SocketState::ConnectedTcp)
        .find(|c| c.fd == fd)
        .map_or_else(none, |c| {
            let path = match c.path {
                DataPath::SanShm => "san-shm".to_owned(),
                DataPath::SanVerbs => "san-verbs".to_owned(),
                other => other.label().to_lowercase(),
            };
            let n = |counter: Counter| c.counters[counter as usize];
            format!(
                "path={path} tcp={}/{} san={}/{} rdv={}/{} reason={}",
                n(Counter::TcpSent),
                n(Counter::TcpReceived),
                n(Counter::SanInlineSent) + n(Counter::SanRendezvousSent),
                n(Counter::SanInlineReceived) + n(Counter::SanRendezvousReceived),
                n(Counter::SanRendezvousSent),
                n(Counter::SanRendezvousReceived),
                c.bypass.label(),
            )
        })
}

fn serve(listener: TcpListener) -> std::io::Result<String> {
    let (stream, _) = listener.accept()?;
    serve_stream(stream)
}

fn serve_stream(mut stream: TcpStream) -> std::io::Result<String> {
    let fd = stream.as_raw_fd();
    stream.write_all(BANNER)?;
    let mut received = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        received.extend_from_slice(&buf[..n]);
        stream.write_all(&buf[..n])?;
    }
    let report = published(fd);
    stream.shutdown(Shutdown::Write)?;
    Ok(format!(
        "server ok bytes={} checksum={:016x} {report}",
        received.len(),
        checksum(&received)
    ))
}

fn client(
    server: SocketAddr,
    local: std::net::IpAddr,
    bytes: usize,
    chunk: usize,
) -> std::io::Result<String> {
    let mut stream = integration::connect_from(local, server)?;
    read_banner(&mut stream)?;
    converse(stream, bytes, chunk)
}

fn read_banner(stream: &mut TcpStream) -> std::io::Result<()> {
    let mut banner = [0u8; 64];
    stream.read_exact(&mut banner)?;
    if &banner != BANNER {
        return Err(std::io::Error::other("banner corrupted"));
    }
    Ok(())
}

/// The client's side after the banner: streams the pattern, checks the echo.
fn converse(mut stream: TcpStream, bytes: usize, chunk: usize) -> std::io::Result<String> {
    let fd = stream.as_raw_fd();
    let data = pattern(bytes);
    let mut writer = stream.try_clone()?;
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        for piece in data.chunks(chunk.max(1)) {
            writer.write_all(piece)?;
        }
        writer.shutdown(Shutdown::Write)
    });
    let mut echo = Vec::with_capacity(bytes);
    stream.read_to_end(&mut echo)?;
    sender
        .join()
        .map_err(|_| std::io::Error::other("sender panicked"))??;
    let report = published(fd);
    let expected = pattern(bytes);
    if echo != expected {
        let first_bad = echo
            .iter()
            .zip(&expected)
            .position(|(a, b)| a != b)
            .unwrap_or(echo.len().min(expected.len()));
        return Err(std::io::Error::other(format!(
            "echo differs: got {} bytes, expected {bytes}, first difference at {first_bad}",
            echo.len()
        )));
    }
    Ok(format!(
        "client ok bytes={} checksum={:016x} {report}",
        echo.len(),
        checksum(&echo)
    ))
}

fn stopped(side: &str, result: std::io::Result<()>) -> String {
    match result {
        Ok(()) => format!("{side} stopped: eof"),
        Err(e) => format!("{side} stopped: {:?}", e.kind()),
    }
}

/// Answers one 4-byte request with 4 bytes, then reads until the connection ends.
fn answer(listener: TcpListener) -> std::io::Result<String> {
    let (mut stream, _) = listener.accept()?;
    let mut request = [0u8; 4];
    stream.read_exact(&mut request)?;
    stream.write_all(b"pong")?;
    Ok(stopped("server", read_until_end(&mut stream)))
}

/// An idle connection under TCP keepalive (1 s idle, probes 1 s apart, 2 of them): one round
/// trip, then a read that blocks until the connection ends, reported with the time it took.
/// When the peer's host vanishes (its packets dropped), Linux ends such a read with
/// `ETIMEDOUT` after about 3 s; over the SAN the same must happen.
fn keepalive_client(server: SocketAddr, local: std::net::IpAddr) -> std::io::Result<String> {
    let mut stream = integration::connect_from(local, server)?;
    let fd = stream.as_raw_fd();
    for (level, option, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 2),
    ] {
        // SAFETY: setsockopt(2) with one int.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                option,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    stream.write_all(b"ping")?;
    let mut answer = [0u8; 4];
    stream.read_exact(&mut answer)?;
    println!("idle {}", published(fd));
    std::io::stdout().flush()?;
    let start = std::time::Instant::now();
    let result = read_until_end(&mut stream);
    Ok(format!(
        "{} after {:.1} s",
        stopped("client", result),
        start.elapsed().as_secs_f64()
    ))
}

/// Set by [`on_interrupt`].
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_interrupt(_: libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// One round trip, then a request the server does not answer and a blocking read for the
/// answer, interrupted 100 ms later by a signal whose handler was installed without
/// `SA_RESTART`: Linux ends the read with `EINTR`. Over the SAN a blocked reader waiting for
/// an answer polls the completion queue first (`SANDIRECT_VERBS_POLLS`), and the signal
/// comes while it polls: the read must still end with `EINTR`, not sleep on.
fn interrupted_client(server: SocketAddr, local: std::net::IpAddr) -> std::io::Result<String> {
    let mut stream = integration::connect_from(local, server)?;
    stream.write_all(b"ping")?;
    let mut answer = [0u8; 4];
    stream.read_exact(&mut answer)?;
    let path = published(stream.as_raw_fd());
    // (`answer` reads on until the end without answering: the read below waits for an
    // answer, the kind of read that polls.)
    stream.write_all(b"wait")?;
    // SAFETY: installs a plain handler (it only stores to an atomic) without SA_RESTART.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_interrupt as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        action.sa_flags = 0;
        if libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    // SAFETY: pthread_self has no preconditions.
    let reader = unsafe { libc::pthread_self() };
    let signaller = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(100));
        // SAFETY: the reading thread outlives this one (joined below).
        unsafe { libc::pthread_kill(reader, libc::SIGUSR1) };
    });
    let start = std::time::Instant::now();
    let mut buf = [0u8; 16];
    // One read(2) (`read_exact` would retry after EINTR).
    let outcome = match stream.read(&mut buf) {
        Ok(n) => format!("read {n} bytes"),
        Err(error) => format!("{:?}", error.kind()),
    };
    let took = start.elapsed().as_secs_f64();
    signaller
        .join()
        .map_err(|_| std::io::Error::other("the signalling thread panicked"))?;
    stream.shutdown(Shutdown::Write)?;
    Ok(format!(
        "client read: {outcome} after {took:.1} s, handler ran: {} ({path})",
        INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
    ))
}

fn sink(listener: TcpListener) -> std::io::Result<String> {
    let (mut stream, _) = listener.accept()?;
    println!("accepted");
    std::io::stdout().flush()?;
    Ok(stopped("server", read_until_end(&mut stream)))
}

/// Reads and drops everything until end-of-file (`Ok`) or an error.
fn read_until_end(stream: &mut TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {}
            Err(e) => return Err(e),
        }
    }
}

fn flood(server: SocketAddr, local: std::net::IpAddr) -> std::io::Result<String> {
    let mut stream = integration::connect_from(local, server)?;
    println!("connected");
    std::io::stdout().flush()?;
    let chunk = pattern(64 << 10);
    let result = loop {
        if let Err(e) = stream.write_all(&chunk) {
            break Err(e);
        }
    };
    Ok(stopped("client", result))
}

/// One way, receiving side: checksums everything until end-of-file, then answers one byte.
fn receive(listener: TcpListener) -> std::io::Result<String> {
    let (mut stream, _) = listener.accept()?;
    let fd = stream.as_raw_fd();
    let mut sum = Checksum::new();
    let mut total = 0usize;
    let mut buf = vec![0u8; 256 << 10];
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        sum.feed(&buf[..n]);
        total += n;
    }
    let report = published(fd);
    stream.write_all(b"!")?;
    stream.shutdown(Shutdown::Write)?;
    Ok(format!(
        "server ok bytes={total} checksum={:016x} {report}",
        sum.value()
    ))
}

/// One way, sending side: streams BYTES of the pattern in CHUNK-byte writes, shuts down
/// writing and waits for the receiver's one-byte answer.
fn send(
    server: SocketAddr,
    local: std::net::IpAddr,
    bytes: usize,
    chunk: usize,
) -> std::io::Result<String> {
    let mut stream = integration::connect_from(local, server)?;
    let fd = stream.as_raw_fd();
    let mut generator = Pattern::new();
    let mut sum = Checksum::new();
    let mut piece = vec![0u8; chunk.clamp(1, 8 << 20)];
    let mut sent = 0usize;
    while sent < bytes {
        let len = piece.len().min(bytes - sent);
        generator.fill(&mut piece[..len]);
        sum.feed(&piece[..len]);
        stream.write_all(&piece[..len])?;
        sent += len;
    }
    stream.shutdown(Shutdown::Write)?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    if answer != b"!" {
        return Err(std::io::Error::other(format!(
            "receiver answered {answer:?}, not one '!'"
        )));
    }
    let report = published(fd);
    Ok(format!(
        "client ok bytes={sent} checksum={:016x} {report}",
        sum.value()
    ))
}

/// Forks; the child runs `child` and leaves with its status (its line printed and flushed),
/// never returning. Returns the child's pid in the parent.
fn fork_into(child: impl FnOnce() -> std::io::Result<String>) -> std::io::Result<libc::pid_t> {
    std::io::stdout().flush()?;
    // SAFETY: fork(2); the child only runs the closure below and leaves through _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid > 0 {
        return Ok(pid);
    }
    let status = match child() {
        Ok(line) => {
            println!("{line}");
            0
        }
        Err(error) => {
            eprintln!("san_xhost child: {error}");
            1
        }
    };
    let _ = std::io::stdout().flush();
    // SAFETY: leaves the child without running the parent's exit handlers twice.
    unsafe { libc::_exit(status) }
}

/// Waits for `pid`; true when it exited with status 0.
fn child_succeeded(pid: libc::pid_t) -> bool {
    let mut status = 0;
    // SAFETY: waitpid(2) on our own child with a valid status pointer.
    let rc = unsafe { libc::waitpid(pid, &mut status, 0) };
    rc == pid && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
}

/// The forking server: accept in the parent, fork, the child serves, the parent closes its
/// copy and accepts the next. Fails unless every child served its connection.
fn fork_server(listener: TcpListener, connections: usize) -> std::io::Result<()> {
    let mut children = Vec::new();
    for _ in 0..connections {
        let (stream, _) = listener.accept()?;
        children.push(fork_into(move || serve_stream(stream))?);
        // (`stream` moved into the closure: the parent's copy is closed when fork_into
        // returns.)
    }
    let failed = children
        .into_iter()
        .filter(|&pid| !child_succeeded(pid))
        .count();
    if failed > 0 {
        return Err(std::io::Error::other(format!(
            "{failed} of {connections} children failed"
        )));
    }
    Ok(())
}

/// The forking client: connects and reads the banner (the connection is up, and on the SAN
/// when both sides are preloaded), then forks; the child converses, the parent closes.
fn fork_client(
    server: SocketAddr,
    local: std::net::IpAddr,
    bytes: usize,
    chunk: usize,
) -> std::io::Result<()> {
    let mut stream = integration::connect_from(local, server)?;
    read_banner(&mut stream)?;
    let pid = fork_into(move || converse(stream, bytes, chunk))?;
    if child_succeeded(pid) {
        Ok(())
    } else {
        Err(std::io::Error::other("the client child failed"))
    }
}

/// The threaded server: accepts `connections` clients, serves each in a thread (as `server`
/// does), prints each connection's line and then the tally of their paths.
fn multi_server(listener: TcpListener, connections: usize) -> std::io::Result<()> {
    let mut servers = Vec::new();
    for _ in 0..connections {
        let (stream, _) = listener.accept()?;
        servers.push(std::thread::spawn(move || serve_stream(stream)));
    }
    let lines = joined(servers)?;
    print_tally("server", &lines)
}

/// The client of `multi-server`: `connections` connections, each set up (its banner read)
/// while the earlier ones stay open, then all conversing at once.
fn multi_client(
    server: SocketAddr,
    local: std::net::IpAddr,
    connections: usize,
    bytes: usize,
    chunk: usize,
) -> std::io::Result<()> {
    let mut streams = Vec::new();
    for _ in 0..connections {
        let mut stream = integration::connect_from(local, server)?;
        read_banner(&mut stream)?;
        streams.push(stream);
    }
    let clients = streams
        .into_iter()
        .map(|stream| std::thread::spawn(move || converse(stream, bytes, chunk)))
        .collect();
    let lines = joined(clients)?;
    print_tally("client", &lines)
}

/// Every thread's line, or the first error.
fn joined(
    threads: Vec<std::thread::JoinHandle<std::io::Result<String>>>,
) -> std::io::Result<Vec<String>> {
    threads
        .into_iter()
        .map(|thread| {
            thread
                .join()
                .map_err(|_| std::io::Error::other("a connection's thread panicked"))?
        })
        .collect()
}

/// Prints each connection's line, then `<side> all ok conns=N san=K tcp=M`.
fn print_tally(side: &str, lines: &[String]) -> std::io::Result<()> {
    for line in lines {
        println!("{line}");
    }
    let san = lines.iter().filter(|l| l.contains(" path=san-")).count();
    println!(
        "{side} all ok conns={} san={san} tcp={}",
        lines.len(),
        lines.len() - san
    );
    Ok(())
}

/// Binds a listener on `ip` (an argument) and announces its port on stdout.
fn listen_announced(ip: &str) -> std::io::Result<TcpListener> {
    let ip: std::net::IpAddr = ip.parse().map_err(std::io::Error::other)?;
    let listener = TcpListener::bind((ip, 0))?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    Ok(listener)
}

/// Waits (up to two minutes) until `path` exists: a test holds a server's `accept()` back
/// while it does something to the connection that is waiting in the backlog.
fn wait_for_file(path: &str) -> std::io::Result<()> {
    let started = std::time::Instant::now();
    while !std::path::Path::new(path).exists() {
        if started.elapsed() > std::time::Duration::from_secs(120) {
            return Err(std::io::Error::other(format!("{path} did not appear")));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Ok(())
}

/// Argument `i`, parsed.
fn parsed<T>(args: &[String], i: usize) -> std::io::Result<T>
where
    T: std::str::FromStr,
    T::Err: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let text = args.get(i).map(String::as_str).unwrap_or_default();
    text.parse().map_err(std::io::Error::other)
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or_default();
    let chunk = || arg(5).parse().unwrap_or(24_000);
    match arg(1) {
        "server" => {
            let listener = listen_announced(arg(2))?;
            if !arg(3).is_empty() {
                wait_for_file(arg(3))?;
            }
            println!("{}", serve(listener)?);
        }
        "sink" => println!("{}", sink(listen_announced(arg(2))?)?),
        "answer" => println!("{}", answer(listen_announced(arg(2))?)?),
        "keepalive-client" => println!(
            "{}",
            keepalive_client(parsed(&args, 2)?, parsed(&args, 3)?)?
        ),
        "interrupted-client" => println!(
            "{}",
            interrupted_client(parsed(&args, 2)?, parsed(&args, 3)?)?
        ),
        "receiver" => println!("{}", receive(listen_announced(arg(2))?)?),
        "fork-server" => {
            let connections = arg(3).parse().unwrap_or(1);
            fork_server(listen_announced(arg(2))?, connections)?;
        }
        "client" => println!(
            "{}",
            client(
                parsed(&args, 2)?,
                parsed(&args, 3)?,
                parsed(&args, 4)?,
                chunk()
            )?
        ),
        "flood" => println!("{}", flood(parsed(&args, 2)?, parsed(&args, 3)?)?),
        "sender" => println!(
            "{}",
            send(
                parsed(&args, 2)?,
                parsed(&args, 3)?,
                parsed(&args, 4)?,
                chunk()
            )?
        ),
        "fork-client" => fork_client(
            parsed(&args, 2)?,
            parsed(&args, 3)?,
            parsed(&args, 4)?,
            chunk(),
        )?,
        "multi-server" => multi_server(listen_announced(arg(2))?, parsed(&args, 3)?)?,
        "multi-client" => multi_client(
            parsed(&args, 2)?,
            parsed(&args, 3)?,
            parsed(&args, 4)?,
            parsed(&args, 5)?,
            arg(6).parse().unwrap_or(24_000),
        )?,
        other => {
            eprintln!(
                "usage: san_xhost server|sink|answer|receiver|fork-server|multi-server ADDR [N] | \
                 client|flood|sender|fork-client|keepalive-client ADDR:PORT LOCAL [BYTES [CHUNK]] | \
                 multi-client ADDR:PORT LOCAL N BYTES [CHUNK] (got {other:?})"
            );
            std::process::exit(2);
        }
    }
    Ok(())
}
