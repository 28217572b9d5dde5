//! Two-process (or in-process) echo over plain blocking `std::net` sockets, for the SAN
//! switch-over tests. It knows nothing of sandirect: run it natively and under the preload.
//!
//! ```text
//! san_echo server PROTOCOL [CONNECTIONS]     # prints "port N", serves CONNECTIONS (default 1)
//!                                            # connections one after another, a report each
//! san_echo client PORT PROTOCOL BYTES [ROUNDS] # ROUNDS (default 1) connections one after
//!                                            # another, a report each
//! san_echo inprocess PROTOCOL BYTES          # both ends in one process (threads)
//! (`SAN_ECHO_HOST`: the address the server listens on and the client connects to, for
//! peers in two containers; the loopback address by default)
//! ```
//!
//! With several rounds the client reads one line on stdin before each round after the first
//! (and stops, failing, at end of input): the test decides when the next connection is made,
//! e.g. after it changed something under the running processes.
//!
//! Protocols:
//! * `client-first`: the client streams BYTES of a seeded pattern and shuts down writing; the
//!   server echoes everything back until EOF; the client checks the echo.
//! * `server-first`: the server first sends a 64-byte banner, then behaves as `client-first`;
//!   the client reads the banner before sending.
//! * `early`: as `client-first`, but the server sleeps 200 ms before `accept()`, so the client's
//!   first bytes are written before the acceptor exists (they travel over TCP while pending).
//!
//! * `paced`: as `client-first`, but the client spreads its BYTES over about two seconds
//!   (a pause after every chunk), so the connection lives through many of the interposer's
//!   periodic liveness checks while data flows both ways.
//!
//! * `write-then-read`: as `client-first`, but the client writes all BYTES in one blocking
//!   `write_all` before it reads anything (one thread), counting on the connection's buffers
//!   to hold what the echo sends back meanwhile, as loopback TCP does for ~10 MB.
//!
//! * `exchange`: the client sends an 8-byte length N and then, in one blocking `write_all`,
//!   N bytes; the server, having read the length, writes N bytes of its own in one
//!   `write_all` before reading the client's: both write before either reads, as far as the
//!   connection's buffers let them (on loopback TCP several MB).
//!
//! * `sink` (server) / `flood` (client): the client writes until an error, the server reads
//!   until end-of-file or an error; each prints `<side> stopped: <how>` (for peer-death tests:
//!   kill one side and time the other's exit).
//!
//! * `timeouts`: `SO_RCVTIMEO`/`SO_SNDTIMEO` on blocking calls. The server sets a receive
//!   timeout on its listener before `accept()` (the accepted socket inherits it); after one
//!   byte each way (the connection has switched), its next read must fail with `EAGAIN` after it; the client sets one with `set_read_timeout` and
//!   its first read must fail likewise (the server sends nothing for 500 ms). Then the client
//!   sends BYTES (after an 8-byte length), sets a send timeout and writes until a write fails
//!   with `EAGAIN` (the server no longer reads), and shuts down writing; the server drains
//!   to end-of-file.
//!
//! Each side reports `ok bytes=N checksum=X path=P` where P is the data path the interposer
//! published for its connection (`tcp` natively or when nothing is published).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Duration;

use integration::pattern::{fnv1a, XorShift64};

/// How long a `paced` client takes to send its bytes.
const PACED_DURATION: Duration = Duration::from_secs(2);

const BANNER: &[u8; 64] = b"sandirect-banner:0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJK";

fn pattern(len: usize) -> Vec<u8> {
    XorShift64::new(0x9e37_79b9_7f4a_7c15).low_bytes(len)
}

/// The data path the interposer published for this process's connected socket from `local`
/// to `peer` (ports), or `tcp` when nothing is published. Both ports: in one process (the
/// `inprocess` mode) the other end's socket has the same two ports the other way round, and
/// may be closing by the time this end asks.
fn published_path(local: u16, peer: u16) -> String {
    integration::published_path_where(|c| {
        c.local.is_some_and(|a| a.port() == local) && c.peer.is_some_and(|a| a.port() == peer)
    })
}

fn stopped(side: &str, result: std::io::Result<()>) -> String {
    match result {
        Ok(()) => format!("{side} stopped: eof"),
        Err(e) => format!("{side} stopped: {:?}", e.kind()),
    }
}

fn sink(mut stream: TcpStream) -> String {
    let mut buf = vec![0u8; 64 << 10];
    let result = loop {
        match stream.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(_) => {}
            Err(e) => break Err(e),
        }
    };
    stopped("server", result)
}

fn flood(mut stream: TcpStream) -> String {
    let chunk = pattern(64 << 10);
    let result = loop {
        if let Err(e) = stream.write_all(&chunk) {
            break Err(e);
        }
    };
    stopped("client", result)
}

/// The receive timeout of the `timeouts` protocol's first reads.
const READ_TIMEOUT: Duration = Duration::from_millis(150);
/// Its send timeout.
const WRITE_TIMEOUT: Duration = Duration::from_millis(200);

/// One blocking call that must fail with `EAGAIN` once `timeout` has passed, not before
/// (std reports `EAGAIN` as `WouldBlock`).
fn times_out<T: std::fmt::Debug>(
    what: &str,
    timeout: Duration,
    call: impl FnOnce() -> std::io::Result<T>,
) -> std::io::Result<()> {
    let start = std::time::Instant::now();
    let result = call();
    let elapsed = start.elapsed();
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && elapsed >= timeout => Ok(()),
        other => Err(std::io::Error::other(format!(
            "{what}: {other:?} after {elapsed:?}, expected EAGAIN after {timeout:?}"
        ))),
    }
}

/// `result`, its error prefixed by the step that failed.
fn context<T>(step: &str, result: std::io::Result<T>) -> std::io::Result<T> {
    result.map_err(|e| std::io::Error::new(e.kind(), format!("{step}: {e}")))
}

/// `read_exact`, retrying reads that a receive timeout cut short (boundedly).
fn read_exact_retrying(stream: &mut TcpStream, mut buf: &mut [u8]) -> std::io::Result<()> {
    let mut timeouts = 0;
    while !buf.is_empty() {
        match stream.read(buf) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && timeouts < 100 => timeouts += 1,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Before the listener's port is announced: a connection the kernel completes from then on
/// is cloned from the listener with what is set here (an option set after the announcement
/// raced the client's connect: under load the connection was sometimes complete first, and
/// the accepted socket then had no receive timeout, natively as over the SAN).
fn prepare_listener(listener: &TcpListener, protocol: &str) -> std::io::Result<()> {
    if protocol == "timeouts" {
        set_read_timeout_inherited(listener)?;
    }
    Ok(())
}

/// `SO_RCVTIMEO` on the listener, for its accepted sockets to inherit (as the kernel copies it).
fn set_read_timeout_inherited(listener: &TcpListener) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let timeout = libc::timeval {
        tv_sec: 0,
        tv_usec: READ_TIMEOUT.as_micros() as libc::suseconds_t,
    };
    // SAFETY: setsockopt(2) with a timeval of the stated size.
    let rc = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn serve_timeouts(listener: &TcpListener) -> std::io::Result<String> {
    let (mut stream, peer) = listener.accept()?;
    // One byte each way first: the connection has switched (over the SAN) before the
    // timeouts are tried (the switch-over window is not what this checks).
    let mut hello = [0u8; 1];
    context("server hello", read_exact_retrying(&mut stream, &mut hello))?;
    context("server hello answer", stream.write_all(b"k"))?;
    let answered = std::time::Instant::now();
    let mut buf = [0u8; 64 << 10];
    times_out(
        "server read (timeout inherited from the listener)",
        READ_TIMEOUT,
        || stream.read(&mut buf),
    )?;
    std::thread::sleep(Duration::from_millis(500).saturating_sub(answered.elapsed()));
    context("server go", stream.write_all(b"go"))?;
    let mut length = [0u8; 8];
    context(
        "server length",
        read_exact_retrying(&mut stream, &mut length),
    )?;
    let mut received = vec![0u8; u64::from_le_bytes(length) as usize];
    context(
        "server data",
        read_exact_retrying(&mut stream, &mut received),
    )?;
    let path = published_path(stream.local_addr()?.port(), peer.port());
    // Not reading until the client's flood filled the connection and a write of it timed
    // out (well within this sleep); then draining it to the end.
    std::thread::sleep(Duration::from_millis(1500));
    let mut timeouts = 0;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && timeouts < 100 => timeouts += 1,
            Err(e) => return Err(e),
        }
    }
    Ok(format!(
        "server ok bytes={} checksum={:016x} path={path}",
        received.len(),
        fnv1a(&received)
    ))
}

fn client_timeouts(mut stream: TcpStream, port: u16, bytes: usize) -> std::io::Result<String> {
    let local_port = stream.local_addr()?.port();
    context("client hello", stream.write_all(b"h"))?;
    let mut answer = [0u8; 1];
    context("client hello answer", stream.read_exact(&mut answer))?;
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    let mut go = [0u8; 2];
    times_out("client read", READ_TIMEOUT, || stream.read(&mut go))?;
    if let Err(e) = read_exact_retrying(&mut stream, &mut go) {
        // Where the connection stood (pending on TCP, or switched), and where the server
        // stands (its threads, both sides' published counters), say which side lost it.
        let path = published_path(local_port, port);
        let stat_dir = preload_core::stats::default_dir();
        let others: Vec<u32> = stat_dir
            .as_deref()
            .map(integration::hang::publishing_pids)
            .unwrap_or_default()
            .into_iter()
            .filter(|&pid| pid != std::process::id())
            .collect();
        eprintln!(
            "{}",
            integration::hang::report(&others, stat_dir.as_deref())
        );
        return Err(std::io::Error::new(
            e.kind(),
            format!("client go (path {path}): {e}"),
        ));
    }
    if &go != b"go" {
        return Err(std::io::Error::other("go corrupted"));
    }
    let data = pattern(bytes);
    context(
        "client length",
        stream.write_all(&(bytes as u64).to_le_bytes()),
    )?;
    context("client data", stream.write_all(&data))?;
    let path = published_path(local_port, port);
    // The server reads no more until we stop: a write must time out (bounded: 1 GiB).
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    let chunk = vec![0x5au8; 64 << 10];
    let mut flooded = 0usize;
    let mut timed_out = false;
    while flooded < 1 << 30 {
        let start = std::time::Instant::now();
        match stream.write(&chunk) {
            Ok(n) => flooded += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if start.elapsed() < WRITE_TIMEOUT {
                    return Err(std::io::Error::other(format!(
                        "client write: EAGAIN after {:?}, before the timeout",
                        start.elapsed()
                    )));
                }
                timed_out = true;
                break;
            }
            Err(e) => return Err(e),
        }
    }
    if !timed_out {
        return Err(std::io::Error::other("client write: 1 GiB and no timeout"));
    }
    stream.shutdown(Shutdown::Write)?;
    Ok(format!(
        "client ok bytes={bytes} checksum={:016x} path={path}",
        fnv1a(&data)
    ))
}

fn serve(listener: &TcpListener, protocol: &str) -> std::io::Result<String> {
    if protocol == "timeouts" {
        return serve_timeouts(listener);
    }
    if protocol == "early" {
        std::thread::sleep(Duration::from_millis(200));
    }
    let (mut stream, peer) = listener.accept()?;
    if protocol == "sink" {
        println!("accepted");
        std::io::stdout().flush()?;
        return Ok(sink(stream));
    }
    if protocol == "server-first" {
        stream.write_all(BANNER)?;
    }
    if protocol == "exchange" {
        let mut header = [0u8; 8];
        stream.read_exact(&mut header)?;
        let bytes = u64::from_le_bytes(header) as usize;
        stream.write_all(&pattern(bytes).iter().map(|b| !b).collect::<Vec<u8>>())?;
        let mut received = vec![0u8; bytes];
        stream.read_exact(&mut received)?;
        let path = published_path(stream.local_addr()?.port(), peer.port());
        return Ok(format!(
            "server ok bytes={} checksum={:016x} path={path}",
            received.len(),
            fnv1a(&received)
        ));
    }
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
    let path = published_path(stream.local_addr()?.port(), peer.port());
    stream.shutdown(Shutdown::Write)?;
    Ok(format!(
        "server ok bytes={} checksum={:016x} path={path}",
        received.len(),
        fnv1a(&received)
    ))
}

/// The address the server listens on and the client connects to: `SAN_ECHO_HOST` (for
/// peers in two containers), else the loopback address.
fn host() -> String {
    std::env::var("SAN_ECHO_HOST").unwrap_or_else(|_| "127.0.0.1".to_owned())
}

fn client(port: u16, protocol: &str, bytes: usize) -> std::io::Result<String> {
    let mut stream = TcpStream::connect((host().as_str(), port))?;
    let local_port = stream.local_addr()?.port();
    if protocol == "timeouts" {
        return client_timeouts(stream, port, bytes);
    }
    if protocol == "flood" {
        println!("connected");
        std::io::stdout().flush()?;
        return Ok(flood(stream));
    }
    if protocol == "server-first" {
        let mut banner = [0u8; 64];
        stream.read_exact(&mut banner)?;
        if &banner != BANNER {
            return Err(std::io::Error::other("banner corrupted"));
        }
    }
    let data = pattern(bytes);
    if protocol == "exchange" {
        stream.write_all(&(bytes as u64).to_le_bytes())?;
        stream.write_all(&data)?;
        let mut theirs = vec![0u8; bytes];
        stream.read_exact(&mut theirs)?;
        let inverted: Vec<u8> = theirs.iter().map(|b| !b).collect();
        return check_echo(inverted, bytes, local_port, port);
    }
    if protocol == "write-then-read" {
        stream.write_all(&data)?;
        stream.shutdown(Shutdown::Write)?;
        let mut echo = Vec::with_capacity(bytes);
        stream.read_to_end(&mut echo)?;
        return check_echo(echo, bytes, local_port, port);
    }
    let mut writer = stream.try_clone()?;
    const CHUNK: usize = 24_000;
    let pause = if protocol == "paced" {
        PACED_DURATION / bytes.div_ceil(CHUNK).max(1) as u32
    } else {
        Duration::ZERO
    };
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        for chunk in data.chunks(CHUNK) {
            writer.write_all(chunk)?;
            std::thread::sleep(pause);
        }
        writer.shutdown(Shutdown::Write)
    });
    let mut echo = Vec::with_capacity(bytes);
    stream.read_to_end(&mut echo)?;
    sender
        .join()
        .map_err(|_| std::io::Error::other("sender panicked"))??;
    check_echo(echo, bytes, local_port, port)
}

fn check_echo(
    echo: Vec<u8>,
    bytes: usize,
    local_port: u16,
    server_port: u16,
) -> std::io::Result<String> {
    let path = published_path(local_port, server_port);
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
        "client ok bytes={} checksum={:016x} path={path}",
        echo.len(),
        fnv1a(&echo)
    ))
}

/// An optional count argument: 1 when absent.
fn count_or_one(arg: &str) -> std::io::Result<usize> {
    if arg.is_empty() {
        return Ok(1);
    }
    arg.parse().map_err(std::io::Error::other)
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or_default();
    match arg(1) {
        "server" => {
            let listener = TcpListener::bind((host().as_str(), 0))?;
            prepare_listener(&listener, arg(2))?;
            let connections = count_or_one(arg(3))?;
            println!("port {}", listener.local_addr()?.port());
            std::io::stdout().flush()?;
            for _ in 0..connections {
                println!("{}", serve(&listener, arg(2))?);
                std::io::stdout().flush()?;
            }
        }
        "client" => {
            let port = arg(2).parse().map_err(std::io::Error::other)?;
            let bytes = arg(4).parse().map_err(std::io::Error::other)?;
            let rounds = count_or_one(arg(5))?;
            for round in 0..rounds {
                if round > 0 {
                    let mut line = String::new();
                    if std::io::stdin().read_line(&mut line)? == 0 {
                        return Err(std::io::Error::other(format!(
                            "no go-ahead for round {round} of {rounds}"
                        )));
                    }
                }
                println!("{}", client(port, arg(3), bytes)?);
                std::io::stdout().flush()?;
            }
        }
        "inprocess" => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let port = listener.local_addr()?.port();
            let protocol = arg(2).to_owned();
            prepare_listener(&listener, &protocol)?;
            let bytes = arg(3).parse().map_err(std::io::Error::other)?;
            let server = std::thread::spawn(move || serve(&listener, &protocol));
            println!("{}", client(port, arg(2), bytes)?);
            let report = server
                .join()
                .map_err(|_| std::io::Error::other("server panicked"))??;
            println!("{report}");
        }
        other => {
            eprintln!("usage: san_echo server|client|inprocess … (got {other:?})");
            std::process::exit(2);
        }
    }
    Ok(())
}
