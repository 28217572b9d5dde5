//! Sockets with high descriptor numbers (fds ≥ 65536 work). It knows nothing of
//! sandirect: run it natively and under the preload, and compare.
//!
//! ```text
//! high_fds FIRST_FD CONNECTIONS
//! ```
//!
//! Raises the soft `RLIMIT_NOFILE` to the hard limit, fills every descriptor number below
//! FIRST_FD (with `/dev/null`), so that the listener, CONNECTIONS client sockets and their
//! accepted peers (all in this process) get numbers from FIRST_FD on, as on a busy server.
//! Then, on every connection: 1 MiB each way in one blocking write (buffered by the
//! connection) and a checksummed read; `poll()` and `epoll` readiness of the high numbers;
//! `dup2` of one socket to a higher number, `close` of the original, and another exchange
//! through the copy. Prints
//!
//! ```text
//! lowest socket fd: N          (>= FIRST_FD)
//! exchanged: CONNECTIONS x 2 MiB ok
//! poll: ok
//! epoll: ok
//! dup2: ok
//! paths: <the data path published for each connected socket>
//! ```
//!
//! and exits non-zero on the first failure (with the reason on stderr). The hard limit must
//! allow FIRST_FD + 3 × CONNECTIONS + 100 descriptors, or the program fails saying so.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const EXCHANGE: usize = 1 << 20;

fn fail(message: String) -> std::io::Error {
    std::io::Error::other(message)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

fn raise_limit(needed: u64) -> std::io::Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write one `struct rlimit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if limit.rlim_max < needed {
        return Err(fail(format!(
            "RLIMIT_NOFILE hard limit {} is below the {needed} descriptors needed",
            limit.rlim_max
        )));
    }
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: as above.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Fills every free number below `first` with `/dev/null` (kept open until exit).
fn fill_below(first: i32) -> std::io::Result<Vec<std::fs::File>> {
    let mut fillers = Vec::new();
    loop {
        let file = std::fs::File::open("/dev/null")?;
        if file.as_raw_fd() >= first {
            return Ok(fillers);
        }
        fillers.push(file);
    }
}

fn exchange(client: &mut TcpStream, server: &mut TcpStream, seed: u8) -> std::io::Result<()> {
    let there = pattern(seed, EXCHANGE);
    let back = pattern(seed.wrapping_add(128), EXCHANGE);
    client.write_all(&there)?;
    server.write_all(&back)?;
    let mut got = vec![0u8; EXCHANGE];
    server.read_exact(&mut got)?;
    if got != there {
        return Err(fail(format!("client → server bytes differ (seed {seed})")));
    }
    client.read_exact(&mut got)?;
    if got != back {
        return Err(fail(format!("server → client bytes differ (seed {seed})")));
    }
    Ok(())
}

fn poll_readable(fd: i32) -> std::io::Result<bool> {
    let mut entry = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut entry, 1, 1000) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n == 1 && entry.revents & libc::POLLIN != 0)
}

fn check_poll(client: &mut TcpStream, server: &mut TcpStream) -> std::io::Result<()> {
    let fd = server.as_raw_fd();
    let mut entry = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    if unsafe { libc::poll(&mut entry, 1, 0) } != 0 {
        return Err(fail(format!("fd {fd} readable before anything was sent")));
    }
    client.write_all(b"p")?;
    if !poll_readable(fd)? {
        return Err(fail(format!("poll never reported fd {fd} readable")));
    }
    let mut byte = [0u8; 1];
    server.read_exact(&mut byte)?;
    Ok(())
}

fn check_epoll(pairs: &mut [(TcpStream, TcpStream)]) -> std::io::Result<()> {
    // SAFETY: epoll_create1 has no memory preconditions; the fd is owned below.
    let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if epfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    let epoll = unsafe { OwnedFd::from_raw_fd(epfd) };
    for (_, server) in pairs.iter() {
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: server.as_raw_fd() as u64,
        };
        // SAFETY: valid epoll fd, socket fd and event.
        if unsafe {
            libc::epoll_ctl(
                epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                server.as_raw_fd(),
                &mut event,
            )
        } != 0
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    let (client, server) = pairs.last_mut().expect("at least one connection");
    client.write_all(b"e")?;
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 8];
    // SAFETY: `events` holds 8 entries.
    let n = unsafe { libc::epoll_wait(epoll.as_raw_fd(), events.as_mut_ptr(), 8, 1000) };
    if n != 1 || events[0].u64 != server.as_raw_fd() as u64 {
        return Err(fail(format!(
            "epoll_wait returned {n} event(s), expected fd {} alone",
            server.as_raw_fd()
        )));
    }
    let mut byte = [0u8; 1];
    server.read_exact(&mut byte)?;
    Ok(())
}

/// `dup2` of the server end to a number above every other, `close` of the original,
/// another exchange through the copy. Returns the pair with the copy in place.
fn check_dup2(
    client: TcpStream,
    server: TcpStream,
    target: i32,
) -> std::io::Result<(TcpStream, TcpStream)> {
    // SAFETY: both numbers are valid; `target` is free (above every descriptor we opened).
    if unsafe { libc::dup2(server.as_raw_fd(), target) } != target {
        return Err(std::io::Error::last_os_error());
    }
    drop(server);
    // SAFETY: dup2 just made `target` a descriptor this function owns.
    let mut copy = unsafe { TcpStream::from_raw_fd(target) };
    let mut client = client;
    exchange(&mut client, &mut copy, 77)?;
    Ok((client, copy))
}

fn main() -> std::io::Result<()> {
    let usage = || fail("usage: high_fds FIRST_FD CONNECTIONS (1..=16)".into());
    let mut args = std::env::args().skip(1);
    let first: i32 = args.next().and_then(|n| n.parse().ok()).ok_or_else(usage)?;
    let connections: usize = args
        .next()
        .and_then(|n| n.parse().ok())
        .filter(|n| (1..=16).contains(n))
        .ok_or_else(usage)?;
    raise_limit(first as u64 + 3 * connections as u64 + 100)?;
    let _fillers = fill_below(first)?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let mut pairs = Vec::with_capacity(connections);
    for _ in 0..connections {
        let client = TcpStream::connect(address)?;
        let (server, _) = listener.accept()?;
        pairs.push((client, server));
    }
    let lowest = pairs
        .iter()
        .flat_map(|(c, s)| [c.as_raw_fd(), s.as_raw_fd()])
        .chain(std::iter::once(listener.as_raw_fd()))
        .min()
        .unwrap_or(-1);
    println!("lowest socket fd: {lowest}");
    for (seed, (client, server)) in pairs.iter_mut().enumerate() {
        exchange(client, server, seed as u8)?;
    }
    println!("exchanged: {connections} x 2 MiB ok");
    let (client, server) = pairs.first_mut().expect("at least one connection");
    check_poll(client, server)?;
    println!("poll: ok");
    check_epoll(&mut pairs)?;
    println!("epoll: ok");
    let highest = pairs
        .iter()
        .flat_map(|(c, s)| [c.as_raw_fd(), s.as_raw_fd()])
        .max()
        .unwrap_or(first);
    let (client, server) = pairs.remove(0);
    let moved = check_dup2(client, server, highest + 50)?;
    pairs.insert(0, moved);
    println!("dup2: ok");
    let paths: Vec<String> = pairs
        .iter()
        .flat_map(|(c, s)| {
            [
                integration::published_path_of_fd(c.as_raw_fd()),
                integration::published_path_of_fd(s.as_raw_fd()),
            ]
        })
        .collect();
    println!("paths: {}", paths.join(" "));
    Ok(())
}
