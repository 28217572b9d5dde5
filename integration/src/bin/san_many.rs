//! Several echo connections between two processes, all open at the same time: for tests of
//! what happens when the resources connections hold (segment files, descriptors) run out.
//! It knows nothing of sandirect: run it natively and under the preload.
//!
//! ```text
//! san_many server N                     # prints "port P", echoes N connections, prints N reports
//! san_many client PORT N BYTES [reopen]  # opens N connections, then streams BYTES on each in turn
//! san_many sequence PORT BYTES…          # one connection after another, each closed before
//!                                        # the next opens, streaming BYTES on the i-th
//! ```
//!
//! The client connects all N first and keeps every one open until the last is done, so
//! whatever a connection holds is held by all at once. On each in turn it streams BYTES of a
//! seeded pattern (a writer thread), shuts down writing and checks the echo it reads back.
//! With `reopen`, it then closes the first connection and makes one more (connection N; the
//! server must then be told N + 1): whatever the first held is free again by then.
//! Each side prints one line per connection, in connection order:
//! `<side> <i> ok bytes=N checksum=X path=P reason=R` (P and R: the data path and fallback
//! reason the interposer published for the connection, `tcp` and `-` natively), or
//! `<side> <i> failed: <error>`; it exits non-zero if a connection failed.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use integration::pattern::{fnv1a, XorShift64};
use integration::published_path_of_fd;

/// The fallback reason the interposer published for `fd` (`-` when none is published).
fn published_reason_of_fd(fd: i32) -> String {
    use preload_core::record::SocketState;
    integration::own_published_connections()
        .and_then(|connections| {
            connections
                .into_iter()
                .filter(|c| c.state == SocketState::San || c.state == SocketState::ConnectedTcp)
                .find(|c| c.fd == fd)
        })
        .map_or_else(|| "-".to_owned(), |c| c.bypass.label().to_owned())
}

fn pattern(len: usize) -> Vec<u8> {
    XorShift64::new(0x2545_f491_4f6c_dd1d).low_bytes(len)
}

/// Echoes `stream` until end-of-file; the report line's fields after `ok`.
fn echo(mut stream: TcpStream) -> std::io::Result<String> {
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
    let path = published_path_of_fd(stream.as_raw_fd());
    let reason = published_reason_of_fd(stream.as_raw_fd());
    stream.shutdown(Shutdown::Write)?;
    Ok(format!(
        "bytes={} checksum={:016x} path={path} reason={reason}",
        received.len(),
        fnv1a(&received)
    ))
}

fn serve(count: usize) -> std::io::Result<Vec<std::io::Result<String>>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let mut echoes = Vec::new();
    for _ in 0..count {
        let (stream, _) = listener.accept()?;
        echoes.push(std::thread::spawn(move || echo(stream)));
    }
    Ok(echoes
        .into_iter()
        .map(|e| {
            e.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("panicked")))
        })
        .collect())
}

/// Streams `data` over `stream` and checks the echo; the report line's fields after `ok`.
fn stream_and_check(stream: &TcpStream, data: &[u8]) -> std::io::Result<String> {
    let mut writer = stream.try_clone()?;
    let sent = data.to_vec();
    let sender = std::thread::spawn(move || -> std::io::Result<()> {
        for chunk in sent.chunks(24_000) {
            writer.write_all(chunk)?;
        }
        writer.shutdown(Shutdown::Write)
    });
    let mut echo = Vec::with_capacity(data.len());
    let read = (&*stream).read_to_end(&mut echo);
    sender
        .join()
        .map_err(|_| std::io::Error::other("sender panicked"))??;
    read?;
    if echo != data {
        let first_bad = echo
            .iter()
            .zip(data)
            .position(|(a, b)| a != b)
            .unwrap_or(echo.len().min(data.len()));
        return Err(std::io::Error::other(format!(
            "echo differs: got {} bytes, expected {}, first difference at {first_bad}",
            echo.len(),
            data.len()
        )));
    }
    Ok(format!(
        "bytes={} checksum={:016x} path={} reason={}",
        echo.len(),
        fnv1a(&echo),
        published_path_of_fd(stream.as_raw_fd()),
        published_reason_of_fd(stream.as_raw_fd())
    ))
}

fn client(
    port: u16,
    count: usize,
    bytes: usize,
    reopen: bool,
) -> std::io::Result<Vec<std::io::Result<String>>> {
    let mut streams = (0..count)
        .map(|_| TcpStream::connect(("127.0.0.1", port)))
        .collect::<std::io::Result<Vec<_>>>()?;
    let data = pattern(bytes);
    // Every connection stays open until the loop is done.
    let mut reports: Vec<_> = streams
        .iter()
        .map(|stream| stream_and_check(stream, &data))
        .collect();
    if reopen && !streams.is_empty() {
        drop(streams.remove(0));
        let again = TcpStream::connect(("127.0.0.1", port))?;
        reports.push(stream_and_check(&again, &data));
    }
    Ok(reports)
}

/// One connection per entry of `sizes`, each streamed, checked and closed before the next is
/// opened (a client that reconnects for every request, in the small).
fn sequence(port: u16, sizes: &[usize]) -> Vec<std::io::Result<String>> {
    sizes
        .iter()
        .map(|&bytes| {
            let stream = TcpStream::connect(("127.0.0.1", port))?;
            stream_and_check(&stream, &pattern(bytes))
        })
        .collect()
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let number = |i: usize| -> usize {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("argument {i} must be a number"))
    };
    let (side, results) = match args.get(1).map(String::as_str) {
        Some("server") => ("server", serve(number(2))?),
        Some("client") => {
            let reopen = match args.get(5).map(String::as_str) {
                None => false,
                Some("reopen") => true,
                Some(other) => panic!("argument 5 must be `reopen`, not {other:?}"),
            };
            let port = number(2) as u16;
            ("client", client(port, number(3), number(4), reopen)?)
        }
        Some("sequence") => {
            let sizes: Vec<usize> = (3..args.len()).map(number).collect();
            ("client", sequence(number(2) as u16, &sizes))
        }
        _ => {
            eprintln!(
                "usage: san_many server N | san_many client PORT N BYTES [reopen] | \
                 san_many sequence PORT BYTES…"
            );
            std::process::exit(2);
        }
    };
    integration::print_connection_reports(side, results);
    Ok(())
}
