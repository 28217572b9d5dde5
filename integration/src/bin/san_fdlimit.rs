//! Echo connections made one at a time by a process that lowers its descriptor limit before
//! each one: for tests of a connection whose set-up runs out of descriptors at some step.
//! It knows nothing of sandirect: run it natively and under the preload.
//!
//! ```text
//! san_fdlimit server N LIMITED             # prints "port P", echoes N connections in turn
//! san_fdlimit client PORT N BYTES LIMITED  # N connections in turn, BYTES each way on each
//! ```
//!
//! With `LIMITED` 1, before connection `i` is made (`connect` or `accept`) the process sets
//! its soft `RLIMIT_NOFILE` to its lowest free descriptor number + 1 + `i`: room for the
//! connection's own socket and at most `i` more descriptors (those open above the limit
//! stay open, and numbers above the limit are not handed out); the limit is restored once the
//! connection's bytes are checked. The client streams a seeded pattern (a second thread),
//! shuts down writing and checks the echo it reads back to end-of-file; the server echoes to
//! end-of-file and shuts down writing. Each side prints one line per connection:
//! `<side> <i> ok bytes=N checksum=X path=P reason=R` (the data path and fallback reason the
//! interposer published, `tcp`/`-` natively) or `<side> <i> failed: <error>`; it exits
//! non-zero if a connection failed.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use integration::pattern::{fnv1a, XorShift64};

fn pattern(len: usize) -> Vec<u8> {
    XorShift64::new(0x9e37_79b9_7f4a_7c15).low_bytes(len)
}

fn soft_limit() -> libc::rlim_t {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `struct rlimit`.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    limit.rlim_cur
}

fn set_soft_limit(soft: libc::rlim_t) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `struct rlimit`; setrlimit reads one.
    let rc = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = soft.min(limit.rlim_max);
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit)
    };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
}

/// The lowest descriptor number not open now (the one the next socket gets).
fn lowest_free_fd() -> libc::rlim_t {
    (0..)
        // SAFETY: F_GETFD only asks whether the number is open.
        .find(|&fd| unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0)
        .unwrap_or(0) as libc::rlim_t
}

/// Lowers the soft limit for connection `i` (see the module docs); returns the old limit.
fn limit_for(i: usize, limited: bool) -> Option<libc::rlim_t> {
    if !limited {
        return None;
    }
    let old = soft_limit();
    set_soft_limit(lowest_free_fd() + 1 + i as libc::rlim_t);
    Some(old)
}

/// What the interposer published for `fd`: `path=P reason=R`.
fn published(fd: i32) -> String {
    use preload_core::record::{DataPath, SocketState};
    let info = integration::own_published_connections().and_then(|connections| {
        connections
            .into_iter()
            .filter(|c| c.state == SocketState::San || c.state == SocketState::ConnectedTcp)
            .find(|c| c.fd == fd)
    });
    match info {
        Some(c) => {
            let path = match c.path {
                DataPath::SanShm => "san-shm",
                other => other.label(),
            };
            format!("path={path} reason={}", c.bypass.label())
        }
        None => "path=tcp reason=-".into(),
    }
}

fn echo(mut stream: TcpStream, old: Option<libc::rlim_t>) -> std::io::Result<String> {
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
    stream.shutdown(Shutdown::Write)?;
    if let Some(old) = old {
        set_soft_limit(old);
    }
    Ok(format!(
        "bytes={} checksum={:016x} {}",
        received.len(),
        fnv1a(&received),
        published(stream.as_raw_fd())
    ))
}

fn serve(count: usize, limited: bool) -> std::io::Result<Vec<std::io::Result<String>>> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::io::stdout().flush()?;
    let mut reports = Vec::new();
    for i in 0..count {
        let old = limit_for(i, limited);
        let report = listener.accept().and_then(|(stream, _)| echo(stream, old));
        if let (Err(_), Some(old)) = (&report, old) {
            set_soft_limit(old);
        }
        reports.push(report);
    }
    Ok(reports)
}

fn stream_and_check(port: u16, data: &[u8], limited: bool, i: usize) -> std::io::Result<String> {
    let old = limit_for(i, limited);
    let result = (|| {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
        // The writer shares the socket (no `try_clone`: a copy would cost a descriptor).
        let echo = std::thread::scope(|scope| {
            let writer = scope.spawn(|| -> std::io::Result<()> {
                for chunk in data.chunks(24_000) {
                    (&stream).write_all(chunk)?;
                }
                stream.shutdown(Shutdown::Write)
            });
            let mut echo = Vec::with_capacity(data.len());
            let read = (&stream).read_to_end(&mut echo);
            writer
                .join()
                .map_err(|_| std::io::Error::other("writer panicked"))??;
            read.map(|_| echo)
        })?;
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
        if let Some(old) = old {
            set_soft_limit(old);
        }
        Ok(format!(
            "bytes={} checksum={:016x} {}",
            echo.len(),
            fnv1a(&echo),
            published(stream.as_raw_fd())
        ))
    })();
    if let Some(old) = old {
        set_soft_limit(old);
    }
    result
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let number = |i: usize| -> usize {
        args.get(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("argument {i} must be a number"))
    };
    let (side, results) = match args.get(1).map(String::as_str) {
        Some("server") => ("server", serve(number(2), number(3) != 0)),
        Some("client") => {
            // A first socket, made before any limit, so that the interposer's record file
            // (where the paths are read from) exists.
            drop(TcpListener::bind("127.0.0.1:0"));
            let (port, count, bytes, limited) =
                (number(2) as u16, number(3), number(4), number(5) != 0);
            let data = pattern(bytes);
            let results = (0..count)
                .map(|i| stream_and_check(port, &data, limited, i))
                .collect();
            ("client", Ok(results))
        }
        _ => {
            eprintln!(
                "usage: san_fdlimit server N LIMITED | san_fdlimit client PORT N BYTES LIMITED"
            );
            std::process::exit(2);
        }
    };
    let results = results.unwrap_or_else(|error| {
        println!("{side} failed: {error}");
        std::process::exit(1);
    });
    integration::print_connection_reports(side, results);
}
