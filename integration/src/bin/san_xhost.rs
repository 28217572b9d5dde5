//! Cross-host echo over plain blocking `std::net` sockets, for the verbs SAN tests in the
//! soft-RDMA VM (two addresses of one guest stand for two hosts). It knows nothing of
//! sandirect: run it natively and under the preload.
//!
//! ```text
//! san_xhost server ADDR              # listens on ADDR:0, prints "port N", serves one client
//! san_xhost client ADDR:PORT LOCAL BYTES   # binds LOCAL:0, streams BYTES, checks the echo
//! ```
//!
//! The client streams BYTES of a seeded pattern (in a thread, 24 000-byte writes) and shuts
//! down writing; the server echoes everything until end-of-file, then shuts down; the client
//! checks that the echo equals the pattern. The server first sends a 64-byte banner the client
//! reads before streaming, so both directions start with the acceptor's bytes and the
//! client's bytes cross while the connection may still be switching.
//!
//! Each side prints `<side> ok bytes=N checksum=X path=P` where P is the data path the
//! interposer published for the connection (`tcp` natively or when nothing is published).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::FromRawFd;

use preload_core::record::{DataPath, SocketState};

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

/// The data path published for this process's connection on local port `port`.
fn published_path(port: u16) -> String {
    let Some(dir) = preload_core::stats::default_dir() else {
        return "tcp".into();
    };
    let path = dir.join(std::process::id().to_string());
    let Ok(Ok(connections)) = preload_core::stats::read_file(&path) else {
        return "tcp".into();
    };
    connections
        .iter()
        .filter(|c| c.state == SocketState::San || c.state == SocketState::ConnectedTcp)
        .find(|c| c.local.is_some_and(|a| a.port() == port))
        .map_or_else(
            || "tcp".into(),
            |c| match c.path {
                DataPath::SanShm => "san-shm".into(),
                DataPath::SanVerbs => "san-verbs".into(),
                other => other.label().to_owned(),
            },
        )
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
    let path = published_path(local_port);
    stream.shutdown(Shutdown::Write)?;
    Ok(format!(
        "server ok bytes={} checksum={:016x} path={path}",
        received.len(),
        checksum(&received)
    ))
}

/// A TCP socket bound to `local`:0 and connected to `server` (what a client with a source
/// address does; the kernel picks the port at bind).
fn connect_from(local: std::net::Ipv4Addr, server: SocketAddr) -> std::io::Result<TcpStream> {
    let SocketAddr::V4(server) = server else {
        return Err(std::io::Error::other("IPv4 only"));
    };
    let sockaddr = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = core::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket(2); the descriptor is owned by the stream below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let bind = sockaddr(local, 0);
    // SAFETY: a valid sockaddr_in of `len` bytes.
    if unsafe { libc::bind(fd, (&bind as *const libc::sockaddr_in).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let peer = sockaddr(*server.ip(), server.port());
    // SAFETY: as above.
    if unsafe { libc::connect(fd, (&peer as *const libc::sockaddr_in).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stream)
}

fn client(server: SocketAddr, local: std::net::Ipv4Addr, bytes: usize) -> std::io::Result<String> {
    let mut stream = connect_from(local, server)?;
    let local_port = stream.local_addr()?.port();
    let mut banner = [0u8; 64];
    stream.read_exact(&mut banner)?;
    if &banner != BANNER {
        return Err(std::io::Error::other("banner corrupted"));
    }
    let data = pattern(bytes);
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
    let path = published_path(local_port);
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
            println!("{}", client(server, local, bytes)?);
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
