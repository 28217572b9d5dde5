//! A nonblocking echo server driven by epoll (level- or edge-triggered) or poll, with several
//! blocking clients in threads of the same process. Knows nothing of sandirect.
//!
//! ```text
//! san_epoll level|edge|poll CLIENTS BYTES
//! ```
//! Prints `clients ok N` when every client got its exact echo back, and
//! `server paths san-shm=A tcp=B`: the data paths the interposer published for the accepted
//! sockets once they carried their echo (all `tcp` natively).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::RawFd;

use integration::pattern::XorShift64;
use preload_core::record::{flags, DataPath};

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    XorShift64::new(seed | 1).low_bytes(len)
}

fn check(rc: libc::c_int, what: &str) -> libc::c_int {
    assert!(rc >= 0, "{what}: {}", std::io::Error::last_os_error());
    rc
}

#[derive(Default)]
struct Conn {
    out: Vec<u8>,
    eof: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Level,
    Edge,
    Poll,
}

fn would_block() -> bool {
    std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN)
}

/// Reads what is available (everything until EAGAIN when `drain`); returns false at EOF.
fn read_some(fd: RawFd, conn: &mut Conn, drain: bool) {
    let mut buf = [0u8; 16 << 10];
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n > 0 {
            conn.out.extend_from_slice(&buf[..n as usize]);
            if !drain {
                return;
            }
            continue;
        }
        if n == 0 {
            conn.eof = true;
        } else {
            assert!(would_block(), "read: {}", std::io::Error::last_os_error());
        }
        return;
    }
}

/// Writes as much pending output as the socket takes.
fn flush(fd: RawFd, conn: &mut Conn) {
    while !conn.out.is_empty() {
        // SAFETY: `out` is readable for its length.
        let n = unsafe {
            libc::send(
                fd,
                conn.out.as_ptr().cast(),
                conn.out.len(),
                libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            assert!(would_block(), "send: {}", std::io::Error::last_os_error());
            return;
        }
        conn.out.drain(..n as usize);
    }
}

fn published_path(fd: RawFd) -> Option<DataPath> {
    integration::own_published_connections()?
        .iter()
        .find(|c| c.fd == fd && c.flags & flags::SERVER != 0)
        .map(|c| c.path)
}

fn serve(listener: RawFd, mode: Mode, clients: usize) -> (usize, usize) {
    let mut conns: HashMap<RawFd, Conn> = HashMap::new();
    let (mut san, mut tcp, mut finished) = (0, 0, 0);
    // SAFETY: plain epoll_create1.
    let epfd = check(
        unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) },
        "epoll_create1",
    );
    let edge = if mode == Mode::Edge {
        libc::EPOLLET as u32
    } else {
        0
    };
    let register = |op, fd: RawFd, out: bool| {
        let mut events = libc::EPOLLIN as u32 | libc::EPOLLRDHUP as u32 | edge;
        if out || mode == Mode::Edge {
            events |= libc::EPOLLOUT as u32;
        }
        let mut event = libc::epoll_event {
            events,
            u64: fd as u64,
        };
        // SAFETY: valid epoll_ctl arguments.
        check(
            unsafe { libc::epoll_ctl(epfd, op, fd, &mut event) },
            "epoll_ctl",
        );
    };
    if mode != Mode::Poll {
        register(libc::EPOLL_CTL_ADD, listener, false);
    }
    while finished < clients {
        let mut ready: Vec<(RawFd, bool, bool)> = Vec::new();
        if mode == Mode::Poll {
            let mut fds = vec![libc::pollfd {
                fd: listener,
                events: libc::POLLIN,
                revents: 0,
            }];
            for (&fd, conn) in &conns {
                let mut events = libc::POLLIN;
                if !conn.out.is_empty() {
                    events |= libc::POLLOUT;
                }
                fds.push(libc::pollfd {
                    fd,
                    events,
                    revents: 0,
                });
            }
            // SAFETY: `fds` is a valid array.
            check(
                unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as _, 10_000) },
                "poll",
            );
            for p in &fds {
                if p.revents != 0 {
                    ready.push((
                        p.fd,
                        p.revents & !libc::POLLOUT != 0,
                        p.revents & libc::POLLOUT != 0,
                    ));
                }
            }
        } else {
            let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
            // SAFETY: `events` is writable for 16 entries.
            let n = check(
                unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), 16, 10_000) },
                "epoll_wait",
            );
            for e in &events[..n as usize] {
                let bits = e.events;
                ready.push((
                    e.u64 as RawFd,
                    bits & !(libc::EPOLLOUT as u32) != 0,
                    bits & libc::EPOLLOUT as u32 != 0,
                ));
            }
        }
        assert!(
            !ready.is_empty(),
            "the server waited 10 s without any readiness"
        );
        for (fd, readable, writable) in ready {
            if fd == listener {
                loop {
                    // SAFETY: plain accept4.
                    let conn = unsafe {
                        libc::accept4(
                            listener,
                            core::ptr::null_mut(),
                            core::ptr::null_mut(),
                            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                        )
                    };
                    if conn < 0 {
                        assert!(
                            would_block(),
                            "accept4: {}",
                            std::io::Error::last_os_error()
                        );
                        break;
                    }
                    conns.insert(conn, Conn::default());
                    if mode != Mode::Poll {
                        register(libc::EPOLL_CTL_ADD, conn, false);
                    }
                    if mode == Mode::Level {
                        break; // level-triggered: the rest is reported again
                    }
                }
                continue;
            }
            let Some(conn) = conns.get_mut(&fd) else {
                continue;
            };
            if readable {
                read_some(fd, conn, mode == Mode::Edge);
            }
            if readable || writable {
                flush(fd, conn);
            }
            if mode == Mode::Level {
                register(libc::EPOLL_CTL_MOD, fd, !conn.out.is_empty());
            }
            if conn.eof && conn.out.is_empty() {
                // The path the connection took (an accepted connection attaches to the SAN at
                // its first use, not inside `accept`).
                match published_path(fd) {
                    Some(DataPath::SanShm) => san += 1,
                    _ => tcp += 1,
                }
                conns.remove(&fd);
                // SAFETY: our connection fd.
                unsafe {
                    libc::shutdown(fd, libc::SHUT_WR);
                    libc::close(fd);
                }
                finished += 1;
            }
        }
    }
    // SAFETY: our epoll fd.
    unsafe { libc::close(epfd) };
    (san, tcp)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = match args.get(1).map(String::as_str) {
        Some("level") => Mode::Level,
        Some("edge") => Mode::Edge,
        Some("poll") => Mode::Poll,
        other => panic!("usage: san_epoll level|edge|poll CLIENTS BYTES (got {other:?})"),
    };
    let clients: usize = args[2].parse().unwrap();
    let bytes: usize = args[3].parse().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let listener_fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    let workers: Vec<_> = (0..clients)
        .map(|i| {
            std::thread::spawn(move || {
                let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
                let data = pattern(i as u64 + 7, bytes);
                let mut writer = stream.try_clone().unwrap();
                let sent = data.clone();
                let sender = std::thread::spawn(move || {
                    writer.write_all(&sent).unwrap();
                    writer.shutdown(Shutdown::Write).unwrap();
                });
                let mut echo = Vec::new();
                stream.read_to_end(&mut echo).unwrap();
                sender.join().unwrap();
                echo == data
            })
        })
        .collect();
    let (san, tcp) = serve(listener_fd, mode, clients);
    let ok = workers
        .into_iter()
        .map(|w| w.join().unwrap())
        .filter(|&ok| ok)
        .count();
    println!("clients ok {ok}");
    println!("server paths san-shm={san} tcp={tcp}");
}
