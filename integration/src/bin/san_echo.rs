//! Two-process (or in-process) echo over plain blocking `std::net` sockets, for the SAN
//! switch-over tests. It knows nothing of sandirect: run it natively and under the preload.
//!
//! ```text
//! san_echo server PROTOCOL            # prints "port N", serves one connection, prints a report
//! san_echo client PORT PROTOCOL BYTES # prints a report
//! san_echo inprocess PROTOCOL BYTES   # both ends in one process (threads)
//! ```
//!
//! Protocols:
//! * `client-first`: the client streams BYTES of a seeded pattern and shuts down writing; the
//!   server echoes everything back until EOF; the client checks the echo.
//! * `server-first`: the server first sends a 64-byte banner, then behaves as `client-first`;
//!   the client reads the banner before sending.
//! * `early`: as `client-first`, but the server sleeps 200 ms before `accept()`, so the client's
//!   first bytes are written before the acceptor exists (they travel over TCP while pending).
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
//! Each side reports `ok bytes=N checksum=X path=P` where P is the data path the interposer
//! published for its connection (`tcp` natively or when nothing is published).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Duration;

const BANNER: &[u8; 64] = b"sandirect-banner:0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJK";

fn pattern(len: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn checksum(data: &[u8]) -> u64 {
    // FNV-1a: order-sensitive, so a reordered or duplicated chunk changes it.
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
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

fn serve(listener: TcpListener, protocol: &str) -> std::io::Result<String> {
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
            checksum(&received)
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
        checksum(&received)
    ))
}

fn client(port: u16, protocol: &str, bytes: usize) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let local_port = stream.local_addr()?.port();
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
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        for chunk in data.chunks(24_000) {
            writer.write_all(chunk)?;
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
        checksum(&echo)
    ))
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or_default();
    match arg(1) {
        "server" => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            println!("port {}", listener.local_addr()?.port());
            std::io::stdout().flush()?;
            println!("{}", serve(listener, arg(2))?);
        }
        "client" => {
            let port = arg(2).parse().map_err(std::io::Error::other)?;
            let bytes = arg(4).parse().map_err(std::io::Error::other)?;
            println!("{}", client(port, arg(3), bytes)?);
        }
        "inprocess" => {
            let listener = TcpListener::bind("127.0.0.1:0")?;
            let port = listener.local_addr()?.port();
            let protocol = arg(2).to_owned();
            let bytes = arg(3).parse().map_err(std::io::Error::other)?;
            let server = std::thread::spawn(move || serve(listener, &protocol));
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
