//! Cross-host echo over plain blocking `std::net` sockets, for the verbs SAN tests in the
//! soft-RDMA VM (two addresses of one guest stand for two hosts). It knows nothing of
//! sandirect: run it natively and under the preload.
//!
//! ```text
//! san_xhost server ADDR              # listens on ADDR:0, prints "port N", serves one client
//! san_xhost client ADDR:PORT LOCAL BYTES [CHUNK]  # binds LOCAL:0, streams BYTES, checks the echo
//! san_xhost sink ADDR                 # as server, but reads until end-of-file or an error
//! san_xhost flood ADDR:PORT LOCAL     # as client, but writes until an error
//! ```
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
//! Each side prints `<side> ok bytes=N checksum=X path=P tcp=S/R san=S/R`: the data path and
//! byte counters the interposer published for the connection (`tcp` and zeros natively).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener};

use preload_core::record::{Counter, DataPath, SocketState};

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

/// What the interposer published for this process's connection on local port `port`:
/// `path=P tcp=SENT/RECEIVED san=SENT/RECEIVED` (SAN bytes: inline plus rendezvous), or
/// `path=tcp` with zero counts when nothing is published (natively).
fn published(port: u16) -> String {
    let none = || "path=tcp tcp=0/0 san=0/0 rdv=0/0".to_owned();
    let Some(dir) = preload_core::stats::default_dir() else {
        return none();
    };
    let path = dir.join(std::process::id().to_string());
    let Ok(Ok(connections)) = preload_core::stats::read_file(&path) else {
        return none();
    };
    connections
        .iter()
        .filter(|c| c.state == SocketState::San || c.state == SocketState::ConnectedTcp)
        .find(|c| c.local.is_some_and(|a| a.port() == port))
        .map_or_else(none, |c| {
            let path = match c.path {
                DataPath::SanShm => "san-shm".to_owned(),
                DataPath::SanVerbs => "san-verbs".to_owned(),
                other => other.label().to_lowercase(),
            };
            let n = |counter: Counter| c.counters[counter as usize];
            format!(
                "path={path} tcp={}/{} san={}/{} rdv={}/{}",
                n(Counter::TcpSent),
                n(Counter::TcpReceived),
                n(Counter::SanInlineSent) + n(Counter::SanRendezvousSent),
                n(Counter::SanInlineReceived) + n(Counter::SanRendezvousReceived),
                n(Counter::SanRendezvousSent),
                n(Counter::SanRendezvousReceived),
            )
        })
}

fn serve(listener: TcpListener) -> std::io::Result<String> {
    let (mut stream, _) = listener.accept()?;
    let local_port = stream.local_addr()?.port();
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
    let report = published(local_port);
    stream.shutdown(Shutdown::Write)?;
    Ok(format!(
        "server ok bytes={} checksum={:016x} {report}",
        received.len(),
        checksum(&received)
    ))
}

fn client(
    server: SocketAddr,
    local: std::net::Ipv4Addr,
    bytes: usize,
    chunk: usize,
) -> std::io::Result<String> {
    let mut stream = integration::connect_from(local, server)?;
    let local_port = stream.local_addr()?.port();
    let mut banner = [0u8; 64];
    stream.read_exact(&mut banner)?;
    if &banner != BANNER {
        return Err(std::io::Error::other("banner corrupted"));
    }
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
    let report = published(local_port);
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

fn sink(listener: TcpListener) -> std::io::Result<String> {
    let (mut stream, _) = listener.accept()?;
    println!("accepted");
    std::io::stdout().flush()?;
    let mut buf = vec![0u8; 64 << 10];
    let result = loop {
        match stream.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(_) => {}
            Err(e) => break Err(e),
        }
    };
    Ok(stopped("server", result))
}

fn flood(server: SocketAddr, local: std::net::Ipv4Addr) -> std::io::Result<String> {
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

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or_default();
    match arg(1) {
        "server" => {
            let ip: std::net::IpAddr = arg(2).parse().map_err(std::io::Error::other)?;
            let listener = TcpListener::bind((ip, 0))?;
            println!("port {}", listener.local_addr()?.port());
            std::io::stdout().flush()?;
            println!("{}", serve(listener)?);
        }
        "client" => {
            let server: SocketAddr = arg(2).parse().map_err(std::io::Error::other)?;
            let local = arg(3).parse().map_err(std::io::Error::other)?;
            let bytes = arg(4).parse().map_err(std::io::Error::other)?;
            let chunk = arg(5).parse().unwrap_or(24_000);
            println!("{}", client(server, local, bytes, chunk)?);
        }
        "sink" => {
            let ip: std::net::IpAddr = arg(2).parse().map_err(std::io::Error::other)?;
            let listener = TcpListener::bind((ip, 0))?;
            println!("port {}", listener.local_addr()?.port());
            std::io::stdout().flush()?;
            println!("{}", sink(listener)?);
        }
        "flood" => {
            let server: SocketAddr = arg(2).parse().map_err(std::io::Error::other)?;
            let local = arg(3).parse().map_err(std::io::Error::other)?;
            println!("{}", flood(server, local)?);
        }
        other => {
            eprintln!(
                "usage: san_xhost server ADDR | client ADDR:PORT LOCAL BYTES (got {other:?})"
            );
            std::process::exit(2);
        }
    }
    Ok(())
}
