//! Socket-semantics conformance program.
//!
//! Runs a table of cases against loopback TCP using `libc` directly (the calls C programs make)
//! and prints one line per case, `case-name: <observed result>`. The integration test runs it
//! natively and under `LD_PRELOAD=libsandirect.so` and requires identical output: whatever the
//! interposer does, a program must not be able to tell.
//!
//! Observations are chosen to be deterministic on an idle loopback (errno names, byte counts,
//! flag bits; never fd numbers or ports). Every case runs under `alarm(20)`, and every wait is
//! a bounded `poll`, so a bug cannot hang the suite: SIGALRM kills the process and the test
//! sees a missing line.
//!
//! Usage: `conformance [CASE-NAME-SUBSTRING]`.

use std::ffi::{c_int, c_void};
use std::mem::{size_of, zeroed};
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::time::Duration;

use integration::{errno, errno_name, outcome};

type CaseResult = Result<String, String>;

/// A setup step failed: report which and the errno.
fn check(rc: isize, step: &str) -> Result<isize, String> {
    if rc < 0 {
        Err(format!("setup-failed {step} {}", errno_name(errno())))
    } else {
        Ok(rc)
    }
}

fn check_fd(rc: c_int, step: &str) -> Result<Fd, String> {
    check(rc as isize, step).map(|_| Fd(rc))
}

/// An owned fd, closed on drop.
struct Fd(c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        if self.0 >= 0 {
            // SAFETY: we own the fd.
            unsafe { libc::close(self.0) };
        }
    }
}

impl Fd {
    fn raw(&self) -> c_int {
        self.0
    }

    fn into_raw(mut self) -> c_int {
        std::mem::replace(&mut self.0, -1)
    }
}

fn set_int_opt(fd: c_int, level: c_int, name: c_int, value: c_int) -> Result<(), String> {
    // SAFETY: pointer to a live int of the stated size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const c_int).cast(),
            size_of::<c_int>() as u32,
        )
    };
    check(rc as isize, "setsockopt").map(|_| ())
}

fn get_int_opt(fd: c_int, level: c_int, name: c_int) -> Result<c_int, String> {
    let mut value: c_int = -1;
    let mut len = size_of::<c_int>() as libc::socklen_t;
    // SAFETY: pointers to live locals.
    let rc =
        unsafe { libc::getsockopt(fd, level, name, (&mut value as *mut c_int).cast(), &mut len) };
    check(rc as isize, "getsockopt").map(|_| value)
}

#[derive(Clone, Copy, PartialEq)]
enum Family {
    V4,
    V6,
}

/// An address of the loopback (or any-address for v6 dual-stack) as sockaddr_storage.
fn sockaddr(family: Family, any: bool, port: u16) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero sockaddr_storage is valid.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    match family {
        Family::V4 => {
            // SAFETY: sockaddr_storage is large enough and suitably aligned for sockaddr_in.
            let sin = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = port.to_be();
            sin.sin_addr.s_addr = u32::from_be_bytes([127, 0, 0, 1]).to_be();
            (storage, size_of::<libc::sockaddr_in>() as u32)
        }
        Family::V6 => {
            // SAFETY: as above for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut storage as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = port.to_be();
            if !any {
                sin6.sin6_addr.s6_addr[15] = 1;
            }
            (storage, size_of::<libc::sockaddr_in6>() as u32)
        }
    }
}

fn domain(family: Family) -> c_int {
    match family {
        Family::V4 => libc::AF_INET,
        Family::V6 => libc::AF_INET6,
    }
}

fn local_port(fd: c_int) -> Result<u16, String> {
    // SAFETY: zeroed storage is valid.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: pointers to live locals of the stated size.
    let rc =
        unsafe { libc::getsockname(fd, &mut storage as *mut _ as *mut libc::sockaddr, &mut len) };
    check(rc as isize, "getsockname")?;
    // SAFETY: both sockaddr_in and sockaddr_in6 keep the port at the same offset.
    Ok(u16::from_be(unsafe {
        (*(&storage as *const _ as *const libc::sockaddr_in)).sin_port
    }))
}

/// A listening socket on loopback (`any` + V6: the dual-stack wildcard).
fn listener_on(family: Family, any: bool) -> Result<(Fd, u16), String> {
    // SAFETY: plain socket creation.
    let fd = check_fd(
        unsafe { libc::socket(domain(family), libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) },
        "socket",
    )?;
    set_int_opt(fd.raw(), libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)?;
    if family == Family::V6 && any {
        set_int_opt(fd.raw(), libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, 0)?;
    }
    let (addr, len) = sockaddr(family, any, 0);
    // SAFETY: addr is a valid sockaddr of `len` bytes.
    check(
        // SAFETY: addr is a valid sockaddr of `len` bytes.
        unsafe { libc::bind(fd.raw(), &addr as *const _ as *const libc::sockaddr, len) } as isize,
        "bind",
    )?;
    // SAFETY: fd is a bound socket.
    check(unsafe { libc::listen(fd.raw(), 16) } as isize, "listen")?;
    let port = local_port(fd.raw())?;
    Ok((fd, port))
}

fn listener() -> Result<(Fd, u16), String> {
    listener_on(Family::V4, false)
}

fn connect_to(family: Family, port: u16, extra_type: c_int) -> Result<(Fd, isize), String> {
    // SAFETY: plain socket creation.
    let fd = check_fd(
        unsafe { libc::socket(domain(family), libc::SOCK_STREAM | extra_type, 0) },
        "socket",
    )?;
    let (addr, len) = sockaddr(family, false, port);
    // SAFETY: addr is a valid sockaddr of `len` bytes.
    let rc = unsafe { libc::connect(fd.raw(), &addr as *const _ as *const libc::sockaddr, len) };
    Ok((fd, rc as isize))
}

fn accept_one(listener: &Fd) -> Result<Fd, String> {
    wait_for(listener.raw(), libc::POLLIN, 5000)?;
    // SAFETY: null address pointers are allowed.
    check_fd(
        unsafe { libc::accept4(listener.raw(), null_mut(), null_mut(), libc::SOCK_CLOEXEC) },
        "accept4",
    )
}

/// A connected pair over loopback: (client, server side).
fn pair_on(family: Family) -> Result<(Fd, Fd), String> {
    let (listener, port) = listener_on(family, false)?;
    let (client, rc) = connect_to(family, port, libc::SOCK_CLOEXEC)?;
    check(rc, "connect")?;
    let server = accept_one(&listener)?;
    Ok((client, server))
}

fn pair() -> Result<(Fd, Fd), String> {
    pair_on(Family::V4)
}

/// Polls one fd; returns revents (0 on timeout).
fn poll_one(fd: c_int, events: i16, timeout_ms: c_int) -> Result<i16, String> {
    let mut pfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    check(rc as isize, "poll")?;
    Ok(pfd.revents)
}

fn wait_for(fd: c_int, events: i16, timeout_ms: c_int) -> Result<i16, String> {
    let revents = poll_one(fd, events, timeout_ms)?;
    if revents == 0 {
        return Err("timeout waiting for readiness".into());
    }
    Ok(revents)
}

fn write_all(fd: c_int, bytes: &[u8]) -> Result<(), String> {
    // SAFETY: valid buffer.
    let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
    if n as usize != bytes.len() {
        return Err(format!("short write {}", outcome(n)));
    }
    Ok(())
}

fn read_some(fd: c_int, max: usize) -> (isize, Vec<u8>) {
    let mut buf = vec![0u8; max];
    // SAFETY: valid buffer of `max` bytes.
    let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), max) };
    let error = errno();
    buf.truncate(n.max(0) as usize);
    if n < 0 {
        // Restore errno for `outcome` after Vec operations.
        // SAFETY: writing the thread's errno.
        unsafe { *libc::__errno_location() = error };
    }
    (n, buf)
}

fn read_text(fd: c_int) -> Result<String, String> {
    wait_for(fd, libc::POLLIN, 5000)?;
    let (n, buf) = read_some(fd, 256);
    if n < 0 {
        return Ok(outcome(n));
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

fn revents_text(revents: i16) -> String {
    let names = [
        (libc::POLLIN, "IN"),
        (libc::POLLOUT, "OUT"),
        (libc::POLLERR, "ERR"),
        (libc::POLLHUP, "HUP"),
        (libc::POLLRDHUP, "RDHUP"),
        (libc::POLLNVAL, "NVAL"),
    ]
    .map(|(bit, name)| (bit as u16 as u64, name));
    integration::bit_names(revents as u16 as u64, &names, "|", "none")
}

fn epoll_events_text(events: u32) -> String {
    let names = [
        (libc::EPOLLIN, "IN"),
        (libc::EPOLLOUT, "OUT"),
        (libc::EPOLLERR, "ERR"),
        (libc::EPOLLHUP, "HUP"),
        (libc::EPOLLRDHUP, "RDHUP"),
    ];
    let parts: Vec<_> = names
        .iter()
        .filter(|(bit, _)| events & *bit as u32 != 0)
        .map(|(_, name)| *name)
        .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join("|")
    }
}

fn epoll_new() -> Result<Fd, String> {
    // SAFETY: plain epoll creation.
    check_fd(
        unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) },
        "epoll_create1",
    )
}

fn epoll_add(epfd: c_int, op: c_int, fd: c_int, events: u32, data: u64) -> isize {
    let mut event = libc::epoll_event { events, u64: data };
    // SAFETY: live event struct.
    (unsafe { libc::epoll_ctl(epfd, op, fd, &mut event) }) as isize
}

/// epoll_wait once; returns the (data, events) pairs.
fn epoll_collect(epfd: c_int, timeout_ms: c_int) -> Result<Vec<(u64, u32)>, String> {
    // SAFETY: zeroed epoll_event array is valid.
    let mut events: [libc::epoll_event; 8] = unsafe { zeroed() };
    // SAFETY: live array of 8.
    let n = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), 8, timeout_ms) };
    check(n as isize, "epoll_wait")?;
    Ok(events[..n as usize]
        .iter()
        .map(|event| ({ event.u64 }, { event.events }))
        .collect())
}

fn settle() {
    std::thread::sleep(Duration::from_millis(30));
}

// ---- cases ------------------------------------------------------------------------------------

fn bad_fds() -> CaseResult {
    let mut buf = [0u8; 4];
    // SAFETY: invalid fds are the point; buffers are valid.
    let read_neg = unsafe { libc::read(-1, buf.as_mut_ptr().cast(), 4) };
    let read_neg = outcome(read_neg);
    // SAFETY: as above.
    let close_neg = outcome(unsafe { libc::close(-1) } as isize);
    // SAFETY: as above; 987654 is beyond any fd this program opens.
    let send_big = outcome(unsafe { libc::send(987_654, buf.as_ptr().cast(), 4, 0) });
    let mut fds = [0; 2];
    // SAFETY: array of two ints.
    check(
        // SAFETY: array of two ints.
        unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } as isize,
        "pipe",
    )?;
    let (pipe_r, pipe_w) = (Fd(fds[0]), Fd(fds[1]));
    // SAFETY: pipe fds are valid but not sockets.
    let send_pipe = outcome(unsafe { libc::send(pipe_w.raw(), buf.as_ptr().cast(), 4, 0) });
    let sockopt_pipe = match get_int_opt(pipe_r.raw(), libc::SOL_SOCKET, libc::SO_ERROR) {
        Ok(value) => value.to_string(),
        Err(_) => errno_name(errno()),
    };
    // SAFETY: as above.
    let shutdown_pipe = outcome(unsafe { libc::shutdown(pipe_r.raw(), libc::SHUT_RDWR) } as isize);
    let closed = pipe_w.into_raw();
    // SAFETY: closing then using a closed fd.
    unsafe { libc::close(closed) };
    // SAFETY: as above.
    let write_closed = outcome(unsafe { libc::write(closed, buf.as_ptr().cast(), 4) });
    Ok(format!(
        "read(-1)={read_neg} close(-1)={close_neg} send(987654)={send_big} send(pipe)={send_pipe} \
         getsockopt(pipe)={sockopt_pipe} shutdown(pipe)={shutdown_pipe} write(closed)={write_closed}"
    ))
}

fn nonblocking_connect() -> CaseResult {
    let (listener, port) = listener()?;
    let (client, rc) = connect_to(Family::V4, port, libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC)?;
    let first = if rc < 0 {
        errno_name(errno())
    } else {
        "connected-at-once".into()
    };
    let revents = wait_for(client.raw(), libc::POLLOUT, 5000)?;
    let so_error = errno_name(get_int_opt(client.raw(), libc::SOL_SOCKET, libc::SO_ERROR)?);
    let (addr, len) = sockaddr(Family::V4, false, port);
    // SAFETY: valid sockaddr.
    let again = unsafe {
        libc::connect(
            client.raw(),
            &addr as *const _ as *const libc::sockaddr,
            len,
        )
    };
    let server = accept_one(&listener)?;
    drop(server);
    Ok(format!(
        "connect={first} poll={} SO_ERROR={so_error} connect-again={}",
        revents_text(revents),
        outcome(again as isize)
    ))
}

fn refused_connect() -> CaseResult {
    // A port that was just bound and released, with nothing listening.
    let port = {
        // SAFETY: plain socket creation.
        let probe = check_fd(
            unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) },
            "socket",
        )?;
        let (addr, len) = sockaddr(Family::V4, false, 0);
        // SAFETY: valid sockaddr.
        check(
            // SAFETY: valid sockaddr.
            unsafe { libc::bind(probe.raw(), &addr as *const _ as *const libc::sockaddr, len) }
                as isize,
            "bind",
        )?;
        local_port(probe.raw())?
    };
    let (nonblocking, rc) = connect_to(Family::V4, port, libc::SOCK_NONBLOCK)?;
    let first = if rc < 0 {
        errno_name(errno())
    } else {
        "0".into()
    };
    let revents = wait_for(nonblocking.raw(), libc::POLLOUT, 5000)?;
    let so_error = errno_name(get_int_opt(
        nonblocking.raw(),
        libc::SOL_SOCKET,
        libc::SO_ERROR,
    )?);
    let so_error_again = errno_name(get_int_opt(
        nonblocking.raw(),
        libc::SOL_SOCKET,
        libc::SO_ERROR,
    )?);
    let (_blocking, blocking_rc) = connect_to(Family::V4, port, 0)?;
    let blocking = outcome(blocking_rc);
    Ok(format!(
        "nonblocking connect={first} poll={} SO_ERROR={so_error} then {so_error_again}; blocking connect={blocking}",
        revents_text(revents & (libc::POLLOUT | libc::POLLERR | libc::POLLHUP))
    ))
}

fn half_close() -> CaseResult {
    let (client, server) = pair()?;
    write_all(client.raw(), b"ping")?;
    // SAFETY: valid socket.
    check(
        // SAFETY: valid socket.
        unsafe { libc::shutdown(client.raw(), libc::SHUT_WR) } as isize,
        "shutdown",
    )?;
    let got = read_text(server.raw())?;
    let eof = read_text(server.raw())?;
    let eof = if eof.is_empty() {
        "EOF".to_owned()
    } else {
        eof
    };
    write_all(server.raw(), b"pong")?;
    let reply = read_text(client.raw())?;
    let buf = [0u8; 1];
    // SAFETY: valid buffer; writing after SHUT_WR must fail with EPIPE (MSG_NOSIGNAL: no signal).
    let write_after =
        outcome(unsafe { libc::send(client.raw(), buf.as_ptr().cast(), 1, libc::MSG_NOSIGNAL) });
    Ok(format!("server read {got:?} then {eof}; server wrote, client read {reply:?}; client send after SHUT_WR={write_after}"))
}

fn reset_by_peer() -> CaseResult {
    let (client, server) = pair()?;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: live linger struct.
    check(
        // SAFETY: live linger struct.
        unsafe {
            libc::setsockopt(
                server.raw(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                size_of::<libc::linger>() as u32,
            )
        } as isize,
        "SO_LINGER",
    )?;
    drop(server); // close with linger 0 sends RST
    let revents = wait_for(client.raw(), libc::POLLIN, 5000)?;
    let (first, _) = read_some(client.raw(), 16);
    let first = outcome(first);
    let (second, _) = read_some(client.raw(), 16);
    Ok(format!(
        "poll={} read={first} then read={}",
        revents_text(revents & (libc::POLLIN | libc::POLLERR | libc::POLLHUP)),
        outcome(second)
    ))
}

fn so_error_and_type() -> CaseResult {
    let (client, server) = pair()?;
    let error = errno_name(get_int_opt(client.raw(), libc::SOL_SOCKET, libc::SO_ERROR)?);
    let ty = get_int_opt(server.raw(), libc::SOL_SOCKET, libc::SO_TYPE)? == libc::SOCK_STREAM;
    let domain = get_int_opt(client.raw(), libc::SOL_SOCKET, libc::SO_DOMAIN)? == libc::AF_INET;
    let listening = get_int_opt(client.raw(), libc::SOL_SOCKET, libc::SO_ACCEPTCONN)?;
    Ok(format!(
        "SO_ERROR={error} SO_TYPE=stream:{ty} SO_DOMAIN=inet:{domain} SO_ACCEPTCONN={listening}"
    ))
}

fn fionread_siocoutq() -> CaseResult {
    let (client, server) = pair()?;
    write_all(server.raw(), b"hello")?;
    wait_for(client.raw(), libc::POLLIN, 5000)?;
    settle();
    let mut available: c_int = -1;
    // SAFETY: FIONREAD writes an int.
    check(
        // SAFETY: FIONREAD writes an int.
        unsafe { libc::ioctl(client.raw(), libc::FIONREAD, &mut available) } as isize,
        "FIONREAD",
    )?;
    let mut unsent: c_int = -1;
    // SAFETY: SIOCOUTQ (== TIOCOUTQ) writes an int.
    let rc = unsafe { libc::ioctl(server.raw(), libc::TIOCOUTQ, &mut unsent) };
    check(rc as isize, "SIOCOUTQ")?;
    Ok(format!(
        "FIONREAD={available} SIOCOUTQ-after-delivery={unsent}"
    ))
}

fn accept4_flags() -> CaseResult {
    let (listener, port) = listener()?;
    let (_c1, rc1) = connect_to(Family::V4, port, 0)?;
    check(rc1, "connect")?;
    let (_c2, rc2) = connect_to(Family::V4, port, 0)?;
    check(rc2, "connect")?;
    wait_for(listener.raw(), libc::POLLIN, 5000)?;
    // SAFETY: accepting with flags; null address pointers allowed.
    let flagged = check_fd(
        unsafe {
            libc::accept4(
                listener.raw(),
                null_mut(),
                null_mut(),
                libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            )
        },
        "accept4",
    )?;
    wait_for(listener.raw(), libc::POLLIN, 5000)?;
    // SAFETY: as above.
    let plain = check_fd(
        unsafe { libc::accept(listener.raw(), null_mut(), null_mut()) },
        "accept",
    )?;
    let describe = |fd: &Fd| {
        // SAFETY: F_GETFL/F_GETFD on a valid fd.
        let fl = unsafe { libc::fcntl(fd.raw(), libc::F_GETFL) };
        // SAFETY: as above.
        let fd_flags = unsafe { libc::fcntl(fd.raw(), libc::F_GETFD) };
        format!(
            "nonblock={} cloexec={}",
            fl & libc::O_NONBLOCK != 0,
            fd_flags & libc::FD_CLOEXEC != 0
        )
    };
    let mut buf = [0u8; 4];
    // SAFETY: valid buffer; nothing to read on a nonblocking socket.
    let would_block = outcome(unsafe { libc::recv(flagged.raw(), buf.as_mut_ptr().cast(), 4, 0) });
    Ok(format!(
        "accept4(NONBLOCK|CLOEXEC): {} recv={would_block}; accept: {}",
        describe(&flagged),
        describe(&plain)
    ))
}

/// `accept4` with the address buffers applications pass: room for any address, room for
/// half of one (the kernel truncates and says the full length), none, and a length the
/// process may not read (`EFAULT`); on a loopback and on a wildcard listener. Each accepted
/// connection carries an exchange both ways, and its peer is the client's own address.
fn accept_address_buffers() -> CaseResult {
    let mut report = Vec::new();
    // A page the process may not touch, for the unreadable length.
    // SAFETY: an anonymous private mapping, unmapped below.
    let page = unsafe {
        libc::mmap(
            null_mut(),
            4096,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if page == libc::MAP_FAILED {
        return Err("mmap".into());
    }
    for (any, label) in [(false, "loopback"), (true, "wildcard")] {
        let (listener, port) = listener_on(Family::V4, any)?;
        for variant in ["whole", "half", "none", "unreadable-length"] {
            let (client, rc) = connect_to(Family::V4, port, libc::SOCK_CLOEXEC)?;
            check(rc, "connect")?;
            wait_for(listener.raw(), libc::POLLIN, 5000)?;
            // SAFETY: zeroed storage is valid.
            let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
            let mut len: libc::socklen_t = match variant {
                "whole" => size_of::<libc::sockaddr_storage>() as libc::socklen_t,
                "half" => 8,
                _ => 0,
            };
            let (addr, len_ptr): (*mut libc::sockaddr, *mut libc::socklen_t) = match variant {
                "none" => (null_mut(), null_mut()),
                "unreadable-length" => (&mut storage as *mut _ as *mut _, page.cast()),
                _ => (&mut storage as *mut _ as *mut _, &mut len),
            };
            // SAFETY: the buffers are ours (or deliberately unreadable: the kernel says EFAULT).
            let fd = unsafe { libc::accept4(listener.raw(), addr, len_ptr, libc::SOCK_CLOEXEC) };
            if fd < 0 {
                report.push(format!("{label}/{variant}: {}", outcome(-1)));
                continue;
            }
            let server = Fd(fd);
            let client_port = local_port(client.raw())?;
            // SAFETY: sockaddr_in keeps the port at this offset; zeroed where not written.
            let seen_port = u16::from_be(unsafe {
                (*(&storage as *const _ as *const libc::sockaddr_in)).sin_port
            });
            let exchange = echo_once(&client, &server, variant.as_bytes())?;
            report.push(format!(
                "{label}/{variant}: len={len} family={} peer-port-matches={} exchange={exchange}",
                storage.ss_family,
                seen_port == client_port,
            ));
        }
    }
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(page, 4096) };
    Ok(report.join("; "))
}

/// `message` from client to server and back; "ok" when both arrive intact.
fn echo_once(client: &Fd, server: &Fd, message: &[u8]) -> Result<&'static str, String> {
    for (from, to) in [(client, server), (server, client)] {
        // SAFETY: a valid buffer of its length.
        let sent = unsafe { libc::send(from.raw(), message.as_ptr().cast(), message.len(), 0) };
        check(sent, "send")?;
        let mut got = vec![0u8; message.len()];
        // SAFETY: a valid buffer of its length.
        let n = unsafe {
            libc::recv(
                to.raw(),
                got.as_mut_ptr().cast(),
                got.len(),
                libc::MSG_WAITALL,
            )
        };
        check(n, "recv")?;
        if got[..n as usize] != *message {
            return Ok("corrupted");
        }
    }
    Ok("ok")
}

fn dup_and_close_order() -> CaseResult {
    let (client, server) = pair()?;
    // SAFETY: dup of a valid fd.
    let copy = check_fd(unsafe { libc::dup(client.raw()) }, "dup")?;
    // SAFETY: F_DUPFD_CLOEXEC of a valid fd.
    let copy2 = check_fd(
        unsafe { libc::fcntl(client.raw(), libc::F_DUPFD_CLOEXEC, 100) },
        "F_DUPFD_CLOEXEC",
    )?;
    // SAFETY: F_GETFD.
    let copy2_cloexec = unsafe { libc::fcntl(copy2.raw(), libc::F_GETFD) } & libc::FD_CLOEXEC != 0;
    drop(client);
    write_all(copy.raw(), b"via-dup")?;
    let got = read_text(server.raw())?;
    drop(copy);
    write_all(copy2.raw(), b"via-fcntl")?;
    let got2 = read_text(server.raw())?;
    drop(copy2);
    let eof = read_text(server.raw())?;
    Ok(format!("after closing the original: {got:?}; after closing the dup: {got2:?} (F_DUPFD_CLOEXEC cloexec={copy2_cloexec}); after the last close: {:?}", if eof.is_empty() { "EOF" } else { &eof }))
}

fn dup2_over_tracked() -> CaseResult {
    let (client_a, server_a) = pair()?;
    let (client_b, server_b) = pair()?;
    // dup2 a onto b: b's socket loses this fd; writes on b's number now go to a's connection.
    // SAFETY: valid fds.
    check(
        // SAFETY: valid fds.
        unsafe { libc::dup2(client_a.raw(), client_b.raw()) } as isize,
        "dup2",
    )?;
    write_all(client_b.raw(), b"to-a")?;
    let on_a = read_text(server_a.raw())?;
    let b_eof = read_text(server_b.raw())?;
    // SAFETY: dup3 onto the same fd is EINVAL.
    let same = outcome(unsafe { libc::dup3(client_a.raw(), client_a.raw(), 0) } as isize);
    Ok(format!(
        "write via dup2 target reached a: {on_a:?}; b's peer saw {:?}; dup3(fd,fd)={same}",
        if b_eof.is_empty() { "EOF" } else { &b_eof }
    ))
}

fn epoll_edge_triggered() -> CaseResult {
    let (client, server) = pair()?;
    let epfd = epoll_new()?;
    check(
        epoll_add(
            epfd.raw(),
            libc::EPOLL_CTL_ADD,
            server.raw(),
            (libc::EPOLLIN | libc::EPOLLET) as u32,
            7,
        ),
        "epoll_ctl",
    )?;
    let mut counts = Vec::new();
    for chunk in [&b"one"[..], b"two"] {
        write_all(client.raw(), chunk)?;
        settle();
        let first = epoll_collect(epfd.raw(), 2000)?;
        let again = epoll_collect(epfd.raw(), 0)?;
        counts.push(format!("{}+{}", first.len(), again.len()));
    }
    Ok(format!(
        "events per arrival (unread data stays unreported): {}",
        counts.join(",")
    ))
}

/// An edge-triggered reader that reads every arrival to `EAGAIN` (nginx's way), for more
/// rounds than a mirror keeps arrival tokens unread: one event per arrival, none after the
/// read; then what a re-arming change, `poll` and a level-triggered registration in a second
/// instance report with nothing to read, and after one more arrival.
fn epoll_edge_triggered_read_to_empty() -> CaseResult {
    let (client, server) = pair()?;
    let epfd = epoll_new()?;
    let edge = (libc::EPOLLIN | libc::EPOLLET) as u32;
    check(
        epoll_add(epfd.raw(), libc::EPOLL_CTL_ADD, server.raw(), edge, 7),
        "epoll_ctl",
    )?;
    let mut rounds = Vec::new();
    for round in 0..80u32 {
        let message = format!("m{round:02}");
        write_all(client.raw(), message.as_bytes())?;
        let first = epoll_collect(epfd.raw(), 5000)?;
        let mut received = Vec::new();
        let drained = loop {
            let mut buf = [0u8; 64];
            // SAFETY: valid buffer of 64 bytes.
            let n = unsafe {
                libc::recv(
                    server.raw(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                break outcome(n);
            }
            received.extend_from_slice(&buf[..n as usize]);
        };
        let again = epoll_collect(epfd.raw(), 0)?;
        let intact = received == message.as_bytes();
        rounds.push(format!(
            "{}+{} {} {drained}",
            first.len(),
            again.len(),
            if intact { "intact" } else { "CHANGED" }
        ));
    }
    rounds.dedup();
    let rearm = outcome(epoll_add(
        epfd.raw(),
        libc::EPOLL_CTL_MOD,
        server.raw(),
        edge,
        8,
    ));
    let after_rearm = epoll_collect(epfd.raw(), 0)?.len();
    let polled = revents_text(poll_one(server.raw(), libc::POLLIN, 0)?);
    let level = epoll_new()?;
    check(
        epoll_add(
            level.raw(),
            libc::EPOLL_CTL_ADD,
            server.raw(),
            libc::EPOLLIN as u32,
            9,
        ),
        "epoll_ctl",
    )?;
    let level_idle = epoll_collect(level.raw(), 0)?.len();
    write_all(client.raw(), b"end")?;
    let edge_after = epoll_collect(epfd.raw(), 5000)?.len();
    let level_after = epoll_collect(level.raw(), 5000)?.len();
    let polled_after = revents_text(poll_one(server.raw(), libc::POLLIN, 5000)?);
    Ok(format!(
        "rounds (events+after read, bytes, last read): {}; re-arm={rearm} then {after_rearm} \
         events; poll with nothing to read: {polled}; level-triggered instance: {level_idle} \
         events; after one more arrival: edge {edge_after}, level {level_after}, poll {polled_after}",
        rounds.join(", ")
    ))
}

/// Output asked for around every write, as `ae` event loops do (redis, wrk): a
/// level-triggered registration changed to `EPOLLIN|EPOLLOUT` before a write and back after
/// it, over many requests; then with the send buffer full (no `EPOLLOUT` until the peer reads),
/// a change made while another thread sleeps in a wait on the instance (the change wakes
/// it), and the instance waited on under a second number (`dup`).
fn epoll_output_around_writes() -> CaseResult {
    let (client, server) = pair()?;
    set_nonblocking(client.raw())?;
    let epfd = epoll_new()?;
    let (input, output) = (libc::EPOLLIN as u32, libc::EPOLLOUT as u32);
    let ctl = |op: c_int, events: u32| outcome(epoll_add(epfd.raw(), op, client.raw(), events, 3));
    let wait = |epfd: c_int, timeout: c_int| -> Result<String, String> {
        let events = epoll_collect(epfd, timeout)?;
        Ok(if events.is_empty() {
            "none".into()
        } else {
            events
                .iter()
                .map(|(data, ev)| format!("{data}:{}", epoll_events_text(*ev)))
                .collect::<Vec<_>>()
                .join(",")
        })
    };
    let mut steps = vec![format!("add={}", ctl(libc::EPOLL_CTL_ADD, input))];
    let mut rounds = Vec::new();
    for round in 0..40u32 {
        let asked = ctl(libc::EPOLL_CTL_MOD, input | output);
        let writable = wait(epfd.raw(), 2000)?;
        let request = format!("q{round:02}");
        write_all(client.raw(), request.as_bytes())?;
        let dropped = ctl(libc::EPOLL_CTL_MOD, input);
        let idle = wait(epfd.raw(), 0)?;
        let (_, got) = read_some(server.raw(), 64);
        write_all(server.raw(), b"answer")?;
        let answered = wait(epfd.raw(), 2000)?;
        let (_, reply) = read_some(client.raw(), 64);
        rounds.push(format!(
            "mod={asked} {writable} write mod={dropped} {idle} server got {:?}; {answered} {:?}",
            got == request.as_bytes(),
            String::from_utf8_lossy(&reply)
        ));
    }
    rounds.dedup();
    steps.push(format!("rounds: {}", rounds.join(" | ")));
    // The same with removals, as `ae` does when a socket's interest turns from input to
    // output and back: removed, then added for output alone, written, removed, added for
    // input; in one round the peer sends something unasked while output alone is wanted.
    let mut rounds = Vec::new();
    for round in 0..40u32 {
        let unasked = round == 20;
        if unasked {
            write_all(server.raw(), b"unasked")?;
        }
        let removed = ctl(libc::EPOLL_CTL_DEL, 0);
        let added = ctl(libc::EPOLL_CTL_ADD, output);
        let writable = wait(epfd.raw(), 2000)?;
        let request = format!("r{round:02}");
        write_all(client.raw(), request.as_bytes())?;
        let removed_again = ctl(libc::EPOLL_CTL_DEL, 0);
        let added_again = ctl(libc::EPOLL_CTL_ADD, input);
        let (_, got) = read_some(server.raw(), 64);
        write_all(server.raw(), b"answer")?;
        let answered = wait(epfd.raw(), 2000)?;
        // (Both messages, however the stream cuts them.)
        let expected = if unasked { 13 } else { 6 };
        let mut reply = Vec::new();
        for _ in 0..100 {
            let (_, bytes) = read_some(client.raw(), 64);
            reply.extend_from_slice(&bytes);
            if reply.len() >= expected {
                break;
            }
            settle();
        }
        rounds.push(format!(
            "del={removed} add={added} {writable} write del={removed_again} add={added_again} \
             server got {:?}; {answered} {:?}",
            got == request.as_bytes(),
            String::from_utf8_lossy(&reply)
        ));
    }
    rounds.dedup();
    steps.push(format!("with removals: {}", rounds.join(" | ")));
    // The send buffer full: no output until the peer reads it all.
    steps.push(format!("mod={}", ctl(libc::EPOLL_CTL_MOD, input | output)));
    let chunk = [7u8; 65536];
    let mut written = 0usize;
    let filled = loop {
        // SAFETY: valid buffer.
        let n = unsafe { libc::write(client.raw(), chunk.as_ptr().cast(), chunk.len()) };
        if n <= 0 {
            break outcome(n);
        }
        written += n as usize;
        if written > 256 << 20 {
            break "never full".to_owned();
        }
    };
    // (Whether it reports output right now depends on how much the peer's side took in
    // meanwhile, over TCP as over the SAN: not asserted.)
    let _ = wait(epfd.raw(), 0)?;
    steps.push(format!("filled: {filled}"));
    let mut read = 0usize;
    let mut buf = vec![0u8; 1 << 20];
    while read < written {
        // SAFETY: valid buffer.
        let n = unsafe { libc::read(server.raw(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            break;
        }
        read += n as usize;
    }
    steps.push(format!(
        "peer read all {}; {}",
        read == written,
        wait(epfd.raw(), 2000)?
    ));
    steps.push(format!("mod={}", ctl(libc::EPOLL_CTL_MOD, input)));
    steps.push(format!("idle {}", wait(epfd.raw(), 0)?));
    // A change the kernel refuses leaves the registration as it was.
    steps.push(format!("mod={}", ctl(libc::EPOLL_CTL_MOD, input | output)));
    let exclusive = libc::EPOLLEXCLUSIVE as u32;
    steps.push(format!(
        "mod exclusive={}; {}",
        ctl(libc::EPOLL_CTL_MOD, input | exclusive),
        wait(epfd.raw(), 2000)?
    ));
    // Waits made by system call number (`syscall(2)`) report it too.
    let raw_wait = |number: libc::c_long| -> String {
        // SAFETY: zeroed epoll_event array is valid.
        let mut events: [libc::epoll_event; 4] = unsafe { zeroed() };
        // SAFETY: a live array of 4 events, no signal mask (its size argument is then unused).
        let n = unsafe {
            libc::syscall(
                number,
                epfd.raw(),
                events.as_mut_ptr(),
                4,
                2000,
                0usize,
                8usize,
            )
        };
        if n < 0 {
            return outcome(n as isize);
        }
        events[..n as usize]
            .iter()
            .map(|event| format!("{}:{}", { event.u64 }, epoll_events_text(event.events)))
            .collect::<Vec<_>>()
            .join(",")
    };
    steps.push(format!(
        "epoll_pwait by number: {}",
        raw_wait(libc::SYS_epoll_pwait)
    ));
    #[cfg(target_arch = "x86_64")]
    steps.push(format!(
        "epoll_wait by number: {}",
        raw_wait(libc::SYS_epoll_wait)
    ));
    steps.push(format!("mod={}", ctl(libc::EPOLL_CTL_MOD, input)));
    // Another thread asleep in a wait on the instance: the change wakes it.
    let sleeper_epfd = epfd.raw();
    let sleeper = std::thread::spawn(move || {
        let start = std::time::Instant::now();
        let events = epoll_collect(sleeper_epfd, 5000);
        (events, start.elapsed() < Duration::from_millis(2500))
    });
    std::thread::sleep(Duration::from_millis(100));
    steps.push(format!("mod={}", ctl(libc::EPOLL_CTL_MOD, input | output)));
    let (events, prompt) = sleeper.join().map_err(|_| "sleeper panicked".to_owned())?;
    let events = events?;
    steps.push(format!(
        "sleeping thread woke with {:?} promptly {prompt}",
        events
            .iter()
            .map(|(data, ev)| format!("{data}:{}", epoll_events_text(*ev)))
            .collect::<Vec<_>>()
    ));
    steps.push(format!("mod={}", ctl(libc::EPOLL_CTL_MOD, input)));
    // The instance under a second number.
    // SAFETY: plain dup.
    let second = Fd(unsafe { libc::dup(epfd.raw()) });
    check(second.raw() as isize, "dup")?;
    steps.push(format!("mod={}", ctl(libc::EPOLL_CTL_MOD, input | output)));
    steps.push(format!("through the dup: {}", wait(second.raw(), 2000)?));
    steps.push(format!("mod={}", ctl(libc::EPOLL_CTL_MOD, input)));
    steps.push(format!("through the dup, idle: {}", wait(second.raw(), 0)?));
    Ok(steps.join("; "))
}

/// Registrations removed and added again, as event loops do around every request: what the
/// calls answer, and which events each wait reports in between.
fn epoll_remove_and_add_again() -> CaseResult {
    let (client, server) = pair()?;
    let epfd = epoll_new()?;
    let ctl = |op: c_int, events: u32, data: u64| {
        outcome(epoll_add(epfd.raw(), op, server.raw(), events, data))
    };
    let (input, output) = (libc::EPOLLIN as u32, libc::EPOLLOUT as u32);
    let wait = |timeout: c_int| -> Result<String, String> {
        let events = epoll_collect(epfd.raw(), timeout)?;
        Ok(if events.is_empty() {
            "none".into()
        } else {
            events
                .iter()
                .map(|(data, ev)| format!("{data}:{}", epoll_events_text(*ev)))
                .collect::<Vec<_>>()
                .join(",")
        })
    };
    let mut steps = Vec::new();
    // Watched for output (always writable here), removed: no event afterwards.
    steps.push(format!("add-out={}", ctl(libc::EPOLL_CTL_ADD, output, 1)));
    steps.push(format!("wait={}", wait(0)?));
    steps.push(format!("del={}", ctl(libc::EPOLL_CTL_DEL, 0, 0)));
    steps.push(format!("wait-after-del={}", wait(50)?));
    steps.push(format!("del-again={}", ctl(libc::EPOLL_CTL_DEL, 0, 0)));
    steps.push(format!(
        "mod-after-del={}",
        ctl(libc::EPOLL_CTL_MOD, input, 2)
    ));
    // Data arrives while nothing watches the socket: unreported until it is added again.
    write_all(client.raw(), b"ping")?;
    settle();
    steps.push(format!("wait-with-data={}", wait(50)?));
    steps.push(format!("add-in={}", ctl(libc::EPOLL_CTL_ADD, input, 3)));
    steps.push(format!("add-twice={}", ctl(libc::EPOLL_CTL_ADD, input, 4)));
    steps.push(format!("wait={}", wait(2000)?));
    // Removed and added back with other data and events, several times in a row.
    for round in 0..3u64 {
        let del = ctl(libc::EPOLL_CTL_DEL, 0, 0);
        let add = ctl(libc::EPOLL_CTL_ADD, output, 10 + round);
        let modify = ctl(libc::EPOLL_CTL_MOD, input | output, 20 + round);
        steps.push(format!("round{round}={del}/{add}/{modify}/{}", wait(0)?));
    }
    let mut buf = [0u8; 8];
    // SAFETY: our buffer, our socket.
    let got = unsafe { libc::recv(server.raw(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    steps.push(format!("recv={got}"));
    steps.push(format!("del={}", ctl(libc::EPOLL_CTL_DEL, 0, 0)));
    steps.push(format!("wait-after-del={}", wait(50)?));
    // Removed with data unread, its data then given to the other end: only that one's events.
    write_all(client.raw(), b"x")?;
    steps.push(format!("add-in={}", ctl(libc::EPOLL_CTL_ADD, input, 30)));
    steps.push(format!("del={}", ctl(libc::EPOLL_CTL_DEL, 0, 0)));
    let other = outcome(epoll_add(
        epfd.raw(),
        libc::EPOLL_CTL_ADD,
        client.raw(),
        input,
        30,
    ));
    steps.push(format!("other-add={other}"));
    steps.push(format!("other-wait={}", wait(50)?));
    write_all(server.raw(), b"pong")?;
    settle();
    steps.push(format!("other-wait-with-data={}", wait(2000)?));
    steps.push(format!("and-again={}", wait(0)?));
    Ok(steps.join(" "))
}

fn epoll_oneshot() -> CaseResult {
    let (client, server) = pair()?;
    let epfd = epoll_new()?;
    check(
        epoll_add(
            epfd.raw(),
            libc::EPOLL_CTL_ADD,
            server.raw(),
            (libc::EPOLLIN | libc::EPOLLONESHOT) as u32,
            1,
        ),
        "epoll_ctl",
    )?;
    write_all(client.raw(), b"a")?;
    let first = epoll_collect(epfd.raw(), 2000)?.len();
    write_all(client.raw(), b"b")?;
    settle();
    let disarmed = epoll_collect(epfd.raw(), 50)?.len();
    check(
        epoll_add(
            epfd.raw(),
            libc::EPOLL_CTL_MOD,
            server.raw(),
            (libc::EPOLLIN | libc::EPOLLONESHOT) as u32,
            1,
        ),
        "rearm",
    )?;
    let rearmed = epoll_collect(epfd.raw(), 2000)?.len();
    Ok(format!(
        "first={first} while-disarmed={disarmed} after-rearm={rearmed}"
    ))
}

fn epoll_rdhup() -> CaseResult {
    let (client, server) = pair()?;
    let epfd = epoll_new()?;
    check(
        epoll_add(
            epfd.raw(),
            libc::EPOLL_CTL_ADD,
            server.raw(),
            (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
            3,
        ),
        "epoll_ctl",
    )?;
    // SAFETY: valid socket.
    check(
        // SAFETY: valid socket.
        unsafe { libc::shutdown(client.raw(), libc::SHUT_WR) } as isize,
        "shutdown",
    )?;
    let events = epoll_collect(epfd.raw(), 2000)?;
    let text: Vec<_> = events
        .iter()
        .map(|(data, ev)| format!("data={data} {}", epoll_events_text(*ev)))
        .collect();
    Ok(text.join(";"))
}

fn epoll_exclusive() -> CaseResult {
    let (_client, server) = pair()?;
    let epfd = epoll_new()?;
    let add = outcome(epoll_add(
        epfd.raw(),
        libc::EPOLL_CTL_ADD,
        server.raw(),
        (libc::EPOLLIN | libc::EPOLLEXCLUSIVE) as u32,
        1,
    ));
    let modify = outcome(epoll_add(
        epfd.raw(),
        libc::EPOLL_CTL_MOD,
        server.raw(),
        (libc::EPOLLIN | libc::EPOLLEXCLUSIVE) as u32,
        1,
    ));
    let dup_add = outcome(epoll_add(
        epfd.raw(),
        libc::EPOLL_CTL_ADD,
        server.raw(),
        libc::EPOLLIN as u32,
        1,
    ));
    // SAFETY: deleting with a null event is allowed since Linux 2.6.9.
    let del = outcome(unsafe {
        libc::epoll_ctl(epfd.raw(), libc::EPOLL_CTL_DEL, server.raw(), null_mut())
    } as isize);
    let del_again = outcome(unsafe {
        // SAFETY: as above.
        libc::epoll_ctl(epfd.raw(), libc::EPOLL_CTL_DEL, server.raw(), null_mut())
    } as isize);
    Ok(format!("ADD(EXCLUSIVE)={add} MOD(EXCLUSIVE)={modify} ADD-again={dup_add} DEL={del} DEL-again={del_again}"))
}

fn epoll_two_sets_and_nested() -> CaseResult {
    let (client, server) = pair()?;
    let (first, second, outer) = (epoll_new()?, epoll_new()?, epoll_new()?);
    check(
        epoll_add(
            first.raw(),
            libc::EPOLL_CTL_ADD,
            server.raw(),
            libc::EPOLLIN as u32,
            11,
        ),
        "add1",
    )?;
    check(
        epoll_add(
            second.raw(),
            libc::EPOLL_CTL_ADD,
            server.raw(),
            libc::EPOLLIN as u32,
            22,
        ),
        "add2",
    )?;
    check(
        epoll_add(
            outer.raw(),
            libc::EPOLL_CTL_ADD,
            first.raw(),
            libc::EPOLLIN as u32,
            33,
        ),
        "nest",
    )?;
    write_all(client.raw(), b"x")?;
    let nested = epoll_collect(outer.raw(), 2000)?;
    let in_first = epoll_collect(first.raw(), 2000)?;
    let in_second = epoll_collect(second.raw(), 2000)?;
    let loop_rc = outcome(epoll_add(
        first.raw(),
        libc::EPOLL_CTL_ADD,
        outer.raw(),
        libc::EPOLLIN as u32,
        44,
    ));
    // Closing the socket removes it from both sets.
    drop(server);
    let after_close =
        epoll_collect(first.raw(), 50)?.len() + epoll_collect(second.raw(), 50)?.len();
    Ok(format!("outer={nested:?} first={in_first:?} second={in_second:?} loop-add={loop_rc} after-close={after_close}"))
}

/// A level-triggered epoll registration after its reader drained the socket (what event
/// loops do between requests): no event without data — also not through an epoll instance
/// nested in another, nor once the registration turns one-shot — and an event as soon as
/// data comes.
fn epoll_level_triggered_after_drain() -> CaseResult {
    let (client, server) = pair()?;
    set_nonblocking(server.raw())?;
    let epfd = epoll_new()?;
    check(
        epoll_add(
            epfd.raw(),
            libc::EPOLL_CTL_ADD,
            server.raw(),
            libc::EPOLLIN as u32,
            5,
        ),
        "epoll_ctl",
    )?;
    let mut report = Vec::new();
    for round in 0..3 {
        write_all(client.raw(), format!("request {round}").as_bytes())?;
        let ready = epoll_collect(epfd.raw(), 2000)?;
        let (n, bytes) = read_some(server.raw(), 256);
        let drained = outcome(read_some(server.raw(), 256).0);
        let idle_now = epoll_collect(epfd.raw(), 0)?.len();
        let idle_later = epoll_collect(epfd.raw(), 50)?.len();
        let polled = revents_text(poll_one(server.raw(), libc::POLLIN, 0)?);
        report.push(format!(
            "{ready:?} read {n} {:?} then {drained}; idle {idle_now}+{idle_later}, poll {polled}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    let outer = epoll_new()?;
    check(
        epoll_add(
            outer.raw(),
            libc::EPOLL_CTL_ADD,
            epfd.raw(),
            libc::EPOLLIN as u32,
            9,
        ),
        "nest",
    )?;
    let outer_idle = epoll_collect(outer.raw(), 50)?.len();
    write_all(client.raw(), b"nested")?;
    let outer_ready = epoll_collect(outer.raw(), 2000)?;
    let inner_ready = epoll_collect(epfd.raw(), 0)?;
    let (n, _) = read_some(server.raw(), 256);
    let outer_after = epoll_collect(outer.raw(), 50)?.len();
    report.push(format!(
        "nested: idle {outer_idle}, then {outer_ready:?} {inner_ready:?}, read {n}, idle {outer_after}"
    ));
    let (client2, server2) = pair()?;
    let epfd2 = epoll_new()?;
    check(
        epoll_add(
            epfd2.raw(),
            libc::EPOLL_CTL_ADD,
            server2.raw(),
            libc::EPOLLIN as u32,
            6,
        ),
        "epoll_ctl",
    )?;
    write_all(client2.raw(), b"before")?;
    let before = epoll_collect(epfd2.raw(), 2000)?.len();
    let (n, _) = read_some(server2.raw(), 256);
    check(
        epoll_add(
            epfd2.raw(),
            libc::EPOLL_CTL_MOD,
            server2.raw(),
            (libc::EPOLLIN | libc::EPOLLONESHOT) as u32,
            6,
        ),
        "oneshot",
    )?;
    let oneshot_idle = epoll_collect(epfd2.raw(), 50)?.len();
    write_all(client2.raw(), b"after")?;
    let oneshot = epoll_collect(epfd2.raw(), 2000)?;
    let disarmed = epoll_collect(epfd2.raw(), 50)?.len();
    report.push(format!(
        "one-shot: {before} read {n}, idle {oneshot_idle}, then {oneshot:?}, disarmed {disarmed}"
    ));
    Ok(report.join("; "))
}

fn poll_and_select() -> CaseResult {
    let (client, server) = pair()?;
    let idle = revents_text(poll_one(server.raw(), libc::POLLIN, 50)?);
    write_all(client.raw(), b"data")?;
    let ready = revents_text(poll_one(server.raw(), libc::POLLIN, 2000)?);
    let select_ready = {
        // SAFETY: fd_set manipulation on a zeroed set with an fd below FD_SETSIZE.
        unsafe {
            let mut set: libc::fd_set = zeroed();
            libc::FD_ZERO(&mut set);
            libc::FD_SET(server.raw(), &mut set);
            let mut timeout = libc::timeval {
                tv_sec: 2,
                tv_usec: 0,
            };
            let n = libc::select(
                server.raw() + 1,
                &mut set,
                null_mut(),
                null_mut(),
                &mut timeout,
            );
            format!(
                "{} set={}",
                outcome(n as isize),
                libc::FD_ISSET(server.raw(), &set)
            )
        }
    };
    read_text(server.raw())?;
    let select_timeout = {
        // SAFETY: as above.
        unsafe {
            let mut set: libc::fd_set = zeroed();
            libc::FD_SET(server.raw(), &mut set);
            let mut timeout = libc::timeval {
                tv_sec: 0,
                tv_usec: 50_000,
            };
            outcome(libc::select(
                server.raw() + 1,
                &mut set,
                null_mut(),
                null_mut(),
                &mut timeout,
            ) as isize)
        }
    };
    let ppoll_timeout = {
        let mut pfd = libc::pollfd {
            fd: server.raw(),
            events: libc::POLLIN,
            revents: 0,
        };
        let timeout = libc::timespec {
            tv_sec: 0,
            tv_nsec: 50_000_000,
        };
        // SAFETY: live pollfd and timespec.
        outcome(unsafe { libc::ppoll(&mut pfd, 1, &timeout, null()) } as isize)
    };
    // Both directions shut: POLLHUP.
    // SAFETY: valid sockets.
    unsafe {
        libc::shutdown(client.raw(), libc::SHUT_WR);
        libc::shutdown(server.raw(), libc::SHUT_WR);
    }
    settle();
    let hup = revents_text(poll_one(
        server.raw(),
        libc::POLLIN | libc::POLLRDHUP,
        2000,
    )?);
    let mut nval = libc::pollfd {
        fd: 987_654,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: live pollfd.
    let nval_n = unsafe { libc::poll(&mut nval, 1, 0) };
    Ok(format!(
        "idle={idle} ready={ready} select={select_ready} select-timeout={select_timeout} ppoll-timeout={ppoll_timeout} hup={hup} bad-fd={nval_n}:{}",
        revents_text(nval.revents)
    ))
}

/// A `select()` over `read` and `write` (descriptors below `FD_SETSIZE`) with a timeout in
/// microseconds: its result, which of `read` and `write` it left set (`r`/`w` per descriptor,
/// `-` for cleared), and whether the time not waited it wrote back is `0` or `left` (more than
/// zero, less than asked).
fn select_sets(read: &[c_int], write: &[c_int], timeout_us: i64) -> String {
    // SAFETY: zeroed fd_sets are valid; FD_SET on them with descriptors below FD_SETSIZE.
    let (mut read_set, mut write_set): (libc::fd_set, libc::fd_set) =
        unsafe { (zeroed(), zeroed()) };
    for &fd in read {
        // SAFETY: as above.
        unsafe { libc::FD_SET(fd, &mut read_set) };
    }
    for &fd in write {
        // SAFETY: as above.
        unsafe { libc::FD_SET(fd, &mut write_set) };
    }
    let nfds = read.iter().chain(write).max().map_or(0, |fd| fd + 1);
    let mut timeout = libc::timeval {
        tv_sec: timeout_us / 1_000_000,
        tv_usec: timeout_us % 1_000_000,
    };
    // SAFETY: live sets and timeval.
    let rc = unsafe {
        libc::select(
            nfds,
            &mut read_set,
            &mut write_set,
            null_mut(),
            &mut timeout,
        )
    };
    let result = outcome(rc as isize);
    let marks = |fds: &[c_int], set: &libc::fd_set, mark: char| -> String {
        fds.iter()
            .map(|&fd| {
                // SAFETY: live sets, descriptors below FD_SETSIZE.
                if unsafe { libc::FD_ISSET(fd, set) } {
                    mark
                } else {
                    '-'
                }
            })
            .collect()
    };
    let left_us = timeout.tv_sec * 1_000_000 + timeout.tv_usec;
    let left = if left_us == 0 {
        "0"
    } else if left_us > 0 && left_us < timeout_us {
        "left"
    } else {
        "unchanged"
    };
    format!(
        "{result} {}/{} {left}",
        marks(read, &read_set, 'r'),
        marks(write, &write_set, 'w')
    )
}

/// A pipe: (read end, write end).
fn pipe_pair() -> Result<(Fd, Fd), String> {
    let mut ends = [0; 2];
    check(
        // SAFETY: pipe2 writes two descriptors into `ends`.
        unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } as isize,
        "pipe2",
    )?;
    Ok((Fd(ends[0]), Fd(ends[1])))
}

/// Writes `bytes` to `server`, reads them back and reads once more (`EAGAIN`): the state a
/// reader that waits in poll() for its next message is in (over the SAN the mirror may be
/// left raised, lazily, with nothing to read).
fn drain_after(client: &Fd, server: &Fd, bytes: &[u8]) -> Result<String, String> {
    write_all(client.raw(), bytes)?;
    wait_for(server.raw(), libc::POLLIN, 2000)?;
    let (n, _) = read_some(server.raw(), 256);
    Ok(format!(
        "read {n} then {}",
        outcome(read_some(server.raw(), 256).0)
    ))
}

/// Poll and select on a socket whose queue a read just emptied (over the SAN its mirror may be
/// left raised by lazy lowering): no readiness without data, timeouts that run out, negative
/// descriptors ignored, select's sets rewritten and its time not waited written back.
fn poll_and_select_after_drain() -> CaseResult {
    let (client, server) = pair()?;
    set_nonblocking(server.raw())?;
    let mut report = Vec::new();
    for round in 0..3 {
        let drained = drain_after(&client, &server, format!("request {round}").as_bytes())?;
        let now = revents_text(poll_one(server.raw(), libc::POLLIN, 0)?);
        let later = revents_text(poll_one(server.raw(), libc::POLLIN | libc::POLLRDHUP, 30)?);
        let selected_now = select_sets(&[server.raw()], &[], 0);
        let selected_later = select_sets(&[server.raw()], &[server.raw()], 30_000);
        let selected_idle = select_sets(&[server.raw()], &[], 30_000);
        report.push(format!(
            "{drained}; poll {now}/{later}; select {selected_now}, {selected_later}, {selected_idle}"
        ));
    }
    // A drained socket beside a ready pipe and two entries the kernel ignores.
    let (pipe_read, pipe_write) = pipe_pair()?;
    report.push(drain_after(&client, &server, b"again")?);
    write_all(pipe_write.raw(), b"p")?;
    let mut fds = [
        libc::pollfd {
            fd: -1,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: server.raw(),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        },
        libc::pollfd {
            fd: pipe_read.raw(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: -7,
            events: libc::POLLOUT,
            revents: 0,
        },
    ];
    // SAFETY: a live array of four entries.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), 4, 2000) };
    let revents: Vec<_> = fds.iter().map(|f| revents_text(f.revents)).collect();
    let selected = select_sets(&[server.raw(), pipe_read.raw()], &[server.raw()], 2_000_000);
    // The timeout of ppoll: nothing comes.
    let mut one = libc::pollfd {
        fd: server.raw(),
        events: libc::POLLIN,
        revents: 0,
    };
    let timeout = libc::timespec {
        tv_sec: 0,
        tv_nsec: 30_000_000,
    };
    // SAFETY: live pollfd and timespec, no mask.
    let ppolled = outcome(unsafe { libc::ppoll(&mut one, 1, &timeout, null()) } as isize);
    report.push(format!(
        "poll {} [{}], select {selected}, ppoll {ppolled} {}",
        outcome(rc as isize),
        revents.join(" "),
        revents_text(one.revents)
    ));
    Ok(report.join("; "))
}

static POLL_SIGNALS: AtomicUsize = AtomicUsize::new(0);

extern "C" fn count_usr1(_: c_int) {
    POLL_SIGNALS.fetch_add(1, Ordering::SeqCst);
}

/// Runs `act` on a helper thread right after this thread announces, through the returned
/// closure, that it is about to wait: the arrival then lands while the wait begins (over the
/// SAN: while it looks for the next message before sleeping).
fn soon(
    act: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> (impl FnOnce(), std::thread::JoinHandle<Result<(), String>>) {
    let go = std::sync::Arc::new(AtomicBool::new(false));
    let seen = go.clone();
    let helper = std::thread::spawn(move || {
        let start = std::time::Instant::now();
        // Bounded: the waiting thread announces itself at once.
        while !seen.load(Ordering::Acquire) {
            if start.elapsed() > Duration::from_secs(5) {
                return Err("the waiter never started".to_string());
            }
            std::hint::spin_loop();
        }
        // A few microseconds into the wait.
        let begun = std::time::Instant::now();
        while begun.elapsed() < Duration::from_micros(5) {
            std::hint::spin_loop();
        }
        act()
    });
    (move || go.store(true, Ordering::Release), helper)
}

fn sigset_of(signals: &[c_int]) -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set; sigaddset with valid signals.
    unsafe {
        let mut set: libc::sigset_t = zeroed();
        libc::sigemptyset(&mut set);
        for &signal in signals {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// Arrivals while poll, select, ppoll and pselect wait on a socket whose queue a read just
/// emptied: a message, a message beside a descriptor that stays silent, a FIN, and signals
/// that ppoll's and pselect's masks hold back or let in.
fn poll_and_select_arrivals() -> CaseResult {
    let (client, server) = pair()?;
    set_nonblocking(server.raw())?;
    let (pipe_read, _pipe_write) = pipe_pair()?;
    let client_fd = client.raw();
    let mut report = Vec::new();

    report.push(drain_after(&client, &server, b"first")?);
    let (begin, helper) = soon(move || write_all(client_fd, b"message"));
    begin();
    let polled = poll_one(server.raw(), libc::POLLIN, 2000);
    join(helper)?;
    report.push(format!(
        "poll {} {:?}",
        revents_text(polled?),
        read_text(server.raw())?
    ));

    report.push(drain_after(&client, &server, b"second")?);
    let mut fds = [
        libc::pollfd {
            fd: pipe_read.raw(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: server.raw(),
            events: libc::POLLIN | libc::POLLOUT,
            revents: 0,
        },
    ];
    // Writable at once: the wait returns at once, without reporting input.
    // SAFETY: a live array of two entries.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, 2000) };
    report.push(format!(
        "poll in+out {} [{} {}]",
        outcome(rc as isize),
        revents_text(fds[0].revents),
        revents_text(fds[1].revents)
    ));
    fds[1].events = libc::POLLIN;
    let (begin, helper) = soon(move || write_all(client_fd, b"pair"));
    begin();
    // SAFETY: as above.
    let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, 2000) };
    join(helper)?;
    report.push(format!(
        "poll pair {} [{} {}] {:?}",
        outcome(rc as isize),
        revents_text(fds[0].revents),
        revents_text(fds[1].revents),
        read_text(server.raw())?
    ));

    report.push(drain_after(&client, &server, b"third")?);
    let (begin, helper) = soon(move || write_all(client_fd, b"selected"));
    begin();
    let selected = select_sets(&[pipe_read.raw(), server.raw()], &[], 2_000_000);
    join(helper)?;
    report.push(format!("select {selected} {:?}", read_text(server.raw())?));

    // ppoll whose mask holds SIGUSR1 back: the handler runs only once the call returned.
    // SAFETY: installing a handler of ours (the default is put back below).
    unsafe {
        let mut action: libc::sigaction = zeroed();
        action.sa_sigaction = count_usr1 as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGUSR1, &action, null_mut());
    }
    // SAFETY: pthread_self has no preconditions.
    let target = unsafe { libc::pthread_self() };
    let target = target as usize;
    report.push(drain_after(&client, &server, b"fourth")?);
    let (begin, helper) = soon(move || {
        // SAFETY: the target thread outlives this helper (joined below).
        unsafe { libc::pthread_kill(target as libc::pthread_t, libc::SIGUSR1) };
        write_all(client_fd, b"masked")
    });
    let hold_usr1 = sigset_of(&[libc::SIGUSR1]);
    let mut one = libc::pollfd {
        fd: server.raw(),
        events: libc::POLLIN,
        revents: 0,
    };
    let timeout = libc::timespec {
        tv_sec: 2,
        tv_nsec: 0,
    };
    begin();
    // SAFETY: live pollfd, timespec and mask.
    let rc = unsafe { libc::ppoll(&mut one, 1, &timeout, &hold_usr1) };
    join(helper)?;
    // Whether the signal came before the call or during it, its handler has run by now.
    report.push(format!(
        "ppoll {} {} signals {} {:?}",
        outcome(rc as isize),
        revents_text(one.revents),
        POLL_SIGNALS.load(Ordering::SeqCst),
        read_text(server.raw())?
    ));

    // pselect whose mask lets in SIGUSR1, which this thread blocks: EINTR.
    report.push(drain_after(&client, &server, b"fifth")?);
    let blocked = sigset_of(&[libc::SIGUSR1]);
    // SAFETY: a valid set; the previous mask is not needed (restored as empty below).
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &blocked, null_mut()) };
    let before = POLL_SIGNALS.load(Ordering::SeqCst);
    let (begin, helper) = soon(move || {
        std::thread::sleep(Duration::from_millis(20));
        // SAFETY: as above.
        unsafe { libc::pthread_kill(target as libc::pthread_t, libc::SIGUSR1) };
        Ok(())
    });
    let let_in = sigset_of(&[]);
    // SAFETY: zeroed fd_set; the server's descriptor is below FD_SETSIZE.
    let mut set: libc::fd_set = unsafe { zeroed() };
    // SAFETY: as above.
    unsafe { libc::FD_SET(server.raw(), &mut set) };
    begin();
    // SAFETY: live set, timespec and mask.
    let rc = unsafe {
        libc::pselect(
            server.raw() + 1,
            &mut set,
            null_mut(),
            null_mut(),
            &timeout,
            &let_in,
        )
    };
    let interrupted = outcome(rc as isize);
    join(helper)?;
    // SAFETY: as above.
    unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &blocked, null_mut()) };
    // SAFETY: the default disposition back.
    unsafe { libc::signal(libc::SIGUSR1, libc::SIG_DFL) };
    report.push(format!(
        "pselect {interrupted} signals {}",
        POLL_SIGNALS.load(Ordering::SeqCst) - before
    ));

    // The peer's FIN arrives.
    report.push(drain_after(&client, &server, b"last")?);
    let (begin, helper) = soon(move || {
        // SAFETY: a valid socket.
        check(
            unsafe { libc::shutdown(client_fd, libc::SHUT_WR) } as isize,
            "shutdown",
        )
        .map(|_| ())
    });
    begin();
    let fin = poll_one(server.raw(), libc::POLLIN | libc::POLLRDHUP, 2000);
    join(helper)?;
    report.push(format!(
        "fin {} then {}",
        revents_text(fin?),
        outcome(read_some(server.raw(), 256).0)
    ));
    Ok(report.join("; "))
}

extern "C" {
    // glibc's FORTIFY_SOURCE entry points (debug/poll_chk.c, debug/ppoll_chk.c): what `poll`
    // and `ppoll` become in a program built with `-D_FORTIFY_SOURCE=2` when the compiler knows
    // the array's size (`fdslen`, in bytes). glibc calls its own poll/ppoll inside, so an
    // interposer must hook these two as well.
    fn __poll_chk(
        fds: *mut libc::pollfd,
        nfds: libc::nfds_t,
        timeout: c_int,
        fdslen: libc::size_t,
    ) -> c_int;
    fn __ppoll_chk(
        fds: *mut libc::pollfd,
        nfds: libc::nfds_t,
        timeout: *const libc::timespec,
        sigmask: *const libc::sigset_t,
        fdslen: libc::size_t,
    ) -> c_int;
}

/// One fd through `__poll_chk` (`ppoll`: through `__ppoll_chk`) with a 5 s bound: the return
/// value, revents and whether it returned at once (well under the bound) or waited.
fn fortified_poll_one(fd: c_int, events: i16, ppoll: bool) -> String {
    let mut fds = [libc::pollfd {
        fd,
        events,
        revents: 0,
    }];
    let fdslen = size_of_val(&fds);
    let start = std::time::Instant::now();
    let rc = if ppoll {
        let timeout = libc::timespec {
            tv_sec: 5,
            tv_nsec: 0,
        };
        // SAFETY: a live array of one pollfd, `fdslen` its size in bytes; a live timespec.
        unsafe { __ppoll_chk(fds.as_mut_ptr(), 1, &timeout, null(), fdslen) }
    } else {
        // SAFETY: a live array of one pollfd, `fdslen` its size in bytes.
        unsafe { __poll_chk(fds.as_mut_ptr(), 1, 5000, fdslen) }
    };
    let rc = outcome(rc as isize);
    let waited = if start.elapsed() < Duration::from_secs(1) {
        "at-once".to_string()
    } else {
        format!("after-{}s", start.elapsed().as_secs())
    };
    format!("{rc}:{}:{waited}", revents_text(fds[0].revents))
}

/// A program built with `-D_FORTIFY_SOURCE=2` waits through `__poll_chk`/`__ppoll_chk`: on an
/// established pair (carried over the SAN when both ends are preloaded; the first round trip
/// makes sure of the switch-over) they report readability in both directions, writability, the
/// peer's FIN and then both FINs exactly as `poll`/`ppoll` do.
fn fortify_poll() -> CaseResult {
    let (client, server) = pair()?;
    write_all(client.raw(), b"a")?;
    read_text(server.raw())?;
    write_all(server.raw(), b"b")?;
    read_text(client.raw())?;

    write_all(client.raw(), b"ping")?;
    let poll_in = fortified_poll_one(server.raw(), libc::POLLIN, false);
    write_all(server.raw(), b"pong")?;
    let ppoll_in = fortified_poll_one(client.raw(), libc::POLLIN, true);
    let got = read_text(server.raw())?;
    let reply = read_text(client.raw())?;
    let poll_out = fortified_poll_one(client.raw(), libc::POLLOUT, false);
    // The peer's FIN (RDHUP), then ours too (HUP).
    // SAFETY: a valid socket.
    unsafe { libc::shutdown(client.raw(), libc::SHUT_WR) };
    settle();
    let peer_shut = fortified_poll_one(server.raw(), libc::POLLIN | libc::POLLRDHUP, true);
    // SAFETY: a valid socket.
    unsafe { libc::shutdown(server.raw(), libc::SHUT_WR) };
    settle();
    let both_shut = fortified_poll_one(server.raw(), libc::POLLIN | libc::POLLRDHUP, false);
    let (eof, _) = read_some(server.raw(), 16);
    Ok(format!(
        "poll_chk-in={poll_in} ppoll_chk-in={ppoll_in} read {got:?}/{reply:?} poll_chk-out={poll_out} ppoll_chk-peer-shut={peer_shut} poll_chk-both-shut={both_shut} read={}",
        outcome(eof)
    ))
}

/// `__poll_chk`/`__ppoll_chk` with `nfds` beyond `fdslen` end the process as glibc's
/// `__chk_fail` does (SIGABRT), checked in a forked child.
fn fortify_poll_overflow() -> CaseResult {
    let mut results = Vec::new();
    for ppoll in [false, true] {
        // SAFETY: the child makes async-signal-safe calls only (the check fails before any
        // wait) and _exits if it survives.
        let pid = unsafe { libc::fork() };
        check(pid as isize, "fork")?;
        if pid == 0 {
            // SAFETY: child: no core file, glibc's message to /dev/null, then two pollfds
            // claimed in an array of one.
            unsafe {
                let no_core = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::setrlimit(libc::RLIMIT_CORE, &no_core);
                let null_fd = libc::open(c"/dev/null".as_ptr(), libc::O_WRONLY);
                libc::dup2(null_fd, 2);
                let mut fds = [libc::pollfd {
                    fd: -1,
                    events: 0,
                    revents: 0,
                }];
                let fdslen = size_of_val(&fds);
                let timeout = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                if ppoll {
                    __ppoll_chk(fds.as_mut_ptr(), 2, &timeout, null(), fdslen);
                } else {
                    __poll_chk(fds.as_mut_ptr(), 2, 0, fdslen);
                }
                libc::_exit(0);
            }
        }
        let mut status = 0;
        check(
            // SAFETY: waiting for our child.
            unsafe { libc::waitpid(pid, &mut status, 0) } as isize,
            "waitpid",
        )?;
        let name = if ppoll { "ppoll_chk" } else { "poll_chk" };
        let ended = if libc::WIFSIGNALED(status) {
            format!("signal-{}", libc::WTERMSIG(status))
        } else {
            format!("exit-{}", libc::WEXITSTATUS(status))
        };
        results.push(format!("{name}={ended}"));
    }
    Ok(results.join(" "))
}

static SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr1(_: c_int) {
    SIGNALLED.store(true, Ordering::SeqCst);
}

fn eintr() -> CaseResult {
    let (_client, server) = pair()?;
    // SAFETY: installing a handler without SA_RESTART.
    unsafe {
        let mut action: libc::sigaction = zeroed();
        action.sa_sigaction = on_usr1 as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        action.sa_flags = 0;
        libc::sigaction(libc::SIGUSR1, &action, null_mut());
    }
    // SAFETY: pthread_self has no preconditions.
    let target = unsafe { libc::pthread_self() };
    let interrupt_later = move || {
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: the target thread outlives this helper (joined below).
        unsafe { libc::pthread_kill(target, libc::SIGUSR1) };
    };
    let helper = std::thread::spawn(interrupt_later);
    let mut buf = [0u8; 8];
    // SAFETY: valid buffer; blocks until the signal.
    let recv = outcome(unsafe { libc::recv(server.raw(), buf.as_mut_ptr().cast(), 8, 0) });
    helper.join().map_err(|_| "helper panicked")?;
    let epfd = epoll_new()?;
    check(
        epoll_add(
            epfd.raw(),
            libc::EPOLL_CTL_ADD,
            server.raw(),
            libc::EPOLLIN as u32,
            1,
        ),
        "epoll_ctl",
    )?;
    let helper = std::thread::spawn(interrupt_later);
    // SAFETY: zeroed events array.
    let mut events: [libc::epoll_event; 1] = unsafe { zeroed() };
    // SAFETY: live array; blocks until the signal.
    let wait =
        outcome(unsafe { libc::epoll_wait(epfd.raw(), events.as_mut_ptr(), 1, 10_000) } as isize);
    helper.join().map_err(|_| "helper panicked")?;
    Ok(format!(
        "recv={recv} epoll_wait={wait} handler-ran={}",
        SIGNALLED.load(Ordering::SeqCst)
    ))
}

static RESTART_SIGNALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr2(_: c_int) {
    RESTART_SIGNALLED.store(true, Ordering::SeqCst);
}

/// A handler installed with SA_RESTART: a blocking recv interrupted by it is restarted and
/// returns the data that arrives later (no EINTR).
fn eintr_restart() -> CaseResult {
    let (client, server) = pair()?;
    // SAFETY: installing a handler with SA_RESTART (every other handler of this program is
    // restored to the default first: the restart rule is per signal).
    unsafe {
        libc::signal(libc::SIGUSR1, libc::SIG_DFL);
        let mut action: libc::sigaction = zeroed();
        action.sa_sigaction = on_usr2 as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        action.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGUSR2, &action, null_mut());
    }
    // SAFETY: pthread_self has no preconditions.
    let target = unsafe { libc::pthread_self() };
    let writer = client.raw();
    let helper = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: the target thread outlives this helper (joined below).
        unsafe { libc::pthread_kill(target, libc::SIGUSR2) };
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: the client socket outlives this helper (joined below).
        unsafe { libc::send(writer, b"restart!".as_ptr().cast(), 8, 0) };
    });
    let mut buf = [0u8; 8];
    // SAFETY: valid buffer; blocks across the signal until the data.
    let recv = outcome(unsafe { libc::recv(server.raw(), buf.as_mut_ptr().cast(), 8, 0) });
    helper.join().map_err(|_| "helper panicked")?;
    Ok(format!(
        "recv={recv} data={} handler-ran={}",
        String::from_utf8_lossy(&buf),
        RESTART_SIGNALLED.load(Ordering::SeqCst)
    ))
}

fn recv_flags() -> CaseResult {
    let (client, server) = pair()?;
    write_all(client.raw(), b"abcdef")?;
    wait_for(server.raw(), libc::POLLIN, 5000)?;
    settle();
    let mut peek = [0u8; 3];
    // SAFETY: valid buffer.
    let peeked = unsafe { libc::recv(server.raw(), peek.as_mut_ptr().cast(), 3, libc::MSG_PEEK) };
    let mut all = [0u8; 6];
    // SAFETY: valid buffer.
    let got = unsafe { libc::recv(server.raw(), all.as_mut_ptr().cast(), 6, 0) };
    // SAFETY: valid buffer; nothing queued.
    let dontwait = outcome(unsafe {
        libc::recv(server.raw(), all.as_mut_ptr().cast(), 6, libc::MSG_DONTWAIT)
    });
    // MSG_WAITALL: the peer sends 10 bytes in two pieces with a pause in between.
    let writer_fd = client.raw();
    let writer = std::thread::spawn(move || {
        // SAFETY: valid fd (owned by the main thread until join).
        unsafe { libc::write(writer_fd, b"12345".as_ptr().cast(), 5) };
        std::thread::sleep(Duration::from_millis(50));
        // SAFETY: as above.
        unsafe { libc::write(writer_fd, b"67890".as_ptr().cast(), 5) };
    });
    let mut whole = [0u8; 10];
    // SAFETY: valid buffer.
    let waitall = unsafe {
        libc::recv(
            server.raw(),
            whole.as_mut_ptr().cast(),
            10,
            libc::MSG_WAITALL,
        )
    };
    writer.join().map_err(|_| "writer panicked")?;
    // SAFETY: valid buffer; zero-length send.
    let zero = outcome(unsafe { libc::send(client.raw(), whole.as_ptr().cast(), 0, 0) });
    let after_zero = revents_text(poll_one(server.raw(), libc::POLLIN, 50)?);
    Ok(format!(
        "peek={}:{:?} recv={}:{:?} dontwait={dontwait} waitall={}:{:?} zero-send={zero} peer-after-zero-send={after_zero}",
        outcome(peeked),
        String::from_utf8_lossy(&peek),
        outcome(got),
        String::from_utf8_lossy(&all),
        outcome(waitall),
        String::from_utf8_lossy(&whole)
    ))
}

fn peer_text(fd: c_int) -> Result<String, String> {
    // SAFETY: zeroed storage.
    let mut storage: libc::sockaddr_storage = unsafe { zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: live storage of the stated length.
    check(
        // SAFETY: live storage of the stated length.
        unsafe { libc::getpeername(fd, &mut storage as *mut _ as *mut libc::sockaddr, &mut len) }
            as isize,
        "getpeername",
    )?;
    Ok(match c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: AF_INET storage holds a sockaddr_in.
            let sin = unsafe { &*(&storage as *const _ as *const libc::sockaddr_in) };
            format!(
                "inet {}",
                std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))
            )
        }
        libc::AF_INET6 => {
            // SAFETY: AF_INET6 storage holds a sockaddr_in6.
            let sin6 = unsafe { &*(&storage as *const _ as *const libc::sockaddr_in6) };
            format!("inet6 {}", std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr))
        }
        other => format!("family {other}"),
    })
}

fn ipv6_and_mapped() -> CaseResult {
    let (client, server) = pair_on(Family::V6)?;
    write_all(client.raw(), b"six")?;
    let got = read_text(server.raw())?;
    let v6_peer = peer_text(server.raw())?;
    let (dual, port) = listener_on(Family::V6, true)?;
    let (v4_client, rc) = connect_to(Family::V4, port, 0)?;
    check(rc, "connect v4 to dual-stack")?;
    let mapped_server = accept_one(&dual)?;
    write_all(v4_client.raw(), b"mapped")?;
    let got_mapped = read_text(mapped_server.raw())?;
    let mapped_peer = peer_text(mapped_server.raw())?;
    let client_view = peer_text(v4_client.raw())?;
    Ok(format!("v6 {got:?} from {v6_peer}; v4-mapped {got_mapped:?} from {mapped_peer}, client sees {client_view}"))
}

fn high_fd() -> CaseResult {
    // 70000 exercises the fd table's second level; where the hard RLIMIT_NOFILE is lower and
    // cannot be raised (no CAP_SYS_RESOURCE), the highest permitted fd is used instead.
    const WANTED: c_int = 70_000;
    // SAFETY: zeroed rlimit, then get/set on this process.
    let (target, label) = unsafe {
        let mut limit: libc::rlimit = zeroed();
        check(
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) as isize,
            "getrlimit",
        )?;
        let wanted = WANTED as libc::rlim_t + 10;
        let raised = libc::rlimit {
            rlim_cur: wanted.max(limit.rlim_cur),
            rlim_max: wanted.max(limit.rlim_max),
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
            (WANTED, "70000")
        } else {
            limit.rlim_cur = limit.rlim_max;
            check(
                libc::setrlimit(libc::RLIMIT_NOFILE, &limit) as isize,
                "setrlimit",
            )?;
            ((limit.rlim_max - 1) as c_int, "hard-limit-minus-1")
        }
    };
    let high_target = target;
    let (client, server) = pair()?;
    // SAFETY: dup2 to a high number.
    let high = check_fd(
        unsafe { libc::dup2(client.raw(), high_target) },
        "dup2 high",
    )?;
    drop(client);
    write_all(high.raw(), b"from-70000")?;
    let got = read_text(server.raw())?;
    write_all(server.raw(), b"to-70000")?;
    let back = read_text(high.raw())?;
    // SAFETY: F_GETFD on the high fd.
    let cloexec = unsafe { libc::fcntl(high.raw(), libc::F_GETFD) } & libc::FD_CLOEXEC != 0;
    drop(high);
    let buf = [0u8; 1];
    // SAFETY: writing to a now-closed fd.
    let after = outcome(unsafe { libc::write(high_target, buf.as_ptr().cast(), 1) });
    let eof = read_text(server.raw())?;
    Ok(format!("fd {label}: peer read {got:?}; fd read {back:?}; cloexec={cloexec}; after close write={after}, peer {:?}", if eof.is_empty() { "EOF" } else { &eof }))
}

fn sendfile_and_splice() -> CaseResult {
    let (client, server) = pair()?;
    let path = std::env::temp_dir().join(format!("sandirect-conformance-{}", std::process::id()));
    std::fs::write(&path, b"file-contents").map_err(|e| e.to_string())?;
    let file = std::fs::File::open(&path).map_err(|e| e.to_string())?;
    std::fs::remove_file(&path).map_err(|e| e.to_string())?;
    use std::os::fd::AsRawFd;
    let mut offset: libc::off_t = 0;
    // SAFETY: valid fds and offset pointer.
    let sent = unsafe { libc::sendfile(client.raw(), file.as_raw_fd(), &mut offset, 13) };
    let sent = outcome(sent);
    wait_for(server.raw(), libc::POLLIN, 5000)?;
    settle();
    let mut fds = [0; 2];
    // SAFETY: array of two ints.
    check(
        // SAFETY: array of two ints.
        unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } as isize,
        "pipe",
    )?;
    let (pipe_r, pipe_w) = (Fd(fds[0]), Fd(fds[1]));
    // SAFETY: socket → pipe splice.
    let spliced =
        outcome(unsafe { libc::splice(server.raw(), null_mut(), pipe_w.raw(), null_mut(), 64, 0) });
    let (_, through_pipe) = read_some(pipe_r.raw(), 64);
    // pipe → socket.
    write_all(pipe_w.raw(), b"back")?;
    // SAFETY: pipe → socket splice.
    let spliced_back =
        outcome(unsafe { libc::splice(pipe_r.raw(), null_mut(), server.raw(), null_mut(), 4, 0) });
    let back = read_text(client.raw())?;
    Ok(format!(
        "sendfile={sent} offset={offset}; splice socket->pipe={spliced} {:?}; splice pipe->socket={spliced_back} {back:?}",
        String::from_utf8_lossy(&through_pipe)
    ))
}

/// `sendfile` without an offset reads from the file position, which advances by what was
/// sent: a count past the end of the file is cut short there, and at the end it sends 0.
fn sendfile_from_file_position() -> CaseResult {
    use std::os::fd::AsRawFd;
    const LEN: usize = 48 << 10;
    let (client, server) = pair()?;
    let path = std::env::temp_dir().join(format!(
        "sandirect-conformance-position-{}",
        std::process::id()
    ));
    let body: Vec<u8> = (0..LEN).map(|i| (i * 131 % 251) as u8).collect();
    std::fs::write(&path, &body).map_err(|e| e.to_string())?;
    let file = std::fs::File::open(&path).map_err(|e| e.to_string())?;
    std::fs::remove_file(&path).map_err(|e| e.to_string())?;
    let mut counts = Vec::new();
    for count in [32 << 10, 32 << 10, 4096] {
        // SAFETY: valid fds, no offset pointer.
        let sent = unsafe { libc::sendfile(client.raw(), file.as_raw_fd(), null_mut(), count) };
        // SAFETY: plain lseek on our file.
        let position = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_CUR) };
        counts.push(format!("{} at {position}", outcome(sent)));
    }
    let mut got = Vec::new();
    for _ in 0..100 {
        if got.len() >= LEN {
            break;
        }
        if poll_one(server.raw(), libc::POLLIN, 100)? == 0 {
            continue;
        }
        let (n, bytes) = read_some(server.raw(), LEN - got.len());
        if n <= 0 {
            break;
        }
        got.extend_from_slice(&bytes);
    }
    Ok(format!(
        "sendfile {}; peer read {} bytes, intact={}",
        counts.join(", "),
        got.len(),
        got == body
    ))
}

/// `sendfile` with an offset reads there and moves the offset, never the file position: a
/// count larger than a chunk is sent whole, one past the end of the file is cut short at
/// the end, and at the end it sends 0.
fn sendfile_with_offset() -> CaseResult {
    use std::os::fd::AsRawFd;
    const LEN: usize = (200 << 10) + 123;
    const START: usize = 1000;
    let (client, server) = pair()?;
    let path = std::env::temp_dir().join(format!(
        "sandirect-conformance-offset-{}",
        std::process::id()
    ));
    let body: Vec<u8> = (0..LEN).map(|i| (i * 131 % 251) as u8).collect();
    std::fs::write(&path, &body).map_err(|e| e.to_string())?;
    let file = std::fs::File::open(&path).map_err(|e| e.to_string())?;
    std::fs::remove_file(&path).map_err(|e| e.to_string())?;
    let mut offset = START as libc::off_t;
    let mut counts = Vec::new();
    for count in [100_000, 64 << 10, 1 << 20, 4096] {
        // SAFETY: valid fds and offset pointer.
        let sent = unsafe { libc::sendfile(client.raw(), file.as_raw_fd(), &mut offset, count) };
        // SAFETY: plain lseek on our file.
        let position = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_CUR) };
        counts.push(format!(
            "{} to offset {offset} (position {position})",
            outcome(sent)
        ));
    }
    let want = LEN - START;
    let mut got = Vec::new();
    for _ in 0..100 {
        if got.len() >= want {
            break;
        }
        if poll_one(server.raw(), libc::POLLIN, 100)? == 0 {
            continue;
        }
        let (n, bytes) = read_some(server.raw(), want - got.len());
        if n <= 0 {
            break;
        }
        got.extend_from_slice(&bytes);
    }
    Ok(format!(
        "sendfile {}; peer read {} bytes, intact={}",
        counts.join(", "),
        got.len(),
        got == body[START..]
    ))
}

/// A nonblocking `sendfile` with an offset into a socket nobody reads: the counts are as large
/// as the socket takes (megabytes, in several calls: over the SAN partly straight into the
/// reader's slots, partly into the send buffer), then `EAGAIN`;
/// the offset moves by exactly what was sent and the file position stays; once the peer
/// reads, the rest follows after each wait for writability, and the peer gets the file intact.
fn sendfile_nonblocking_until_full() -> CaseResult {
    use std::os::fd::AsRawFd;
    const LEN: usize = 24 << 20;
    const COUNT: usize = 1 << 20;
    let (client, server) = pair()?;
    let path =
        std::env::temp_dir().join(format!("sandirect-conformance-full-{}", std::process::id()));
    let body: Vec<u8> = (0..LEN).map(|i| (i * 131 % 251) as u8).collect();
    std::fs::write(&path, &body).map_err(|e| e.to_string())?;
    let file = std::fs::File::open(&path).map_err(|e| e.to_string())?;
    std::fs::remove_file(&path).map_err(|e| e.to_string())?;
    // SAFETY: setting O_NONBLOCK on our socket.
    unsafe {
        let flags = libc::fcntl(client.raw(), libc::F_GETFL);
        libc::fcntl(client.raw(), libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
    let mut offset: libc::off_t = 0;
    let mut sent_before_full = 0usize;
    let mut calls_before_full = 0usize;
    let mut full = false;
    while !full && (offset as usize) < LEN {
        // SAFETY: valid fds and offset pointer.
        let sent = unsafe { libc::sendfile(client.raw(), file.as_raw_fd(), &mut offset, COUNT) };
        if sent > 0 {
            sent_before_full += sent as usize;
            calls_before_full += 1;
        } else if sent < 0 && errno() == libc::EAGAIN {
            full = true;
        } else {
            return Err(format!(
                "sendfile into a socket nobody reads: {}",
                outcome(sent)
            ));
        }
    }
    let exact_before_full = offset as usize == sent_before_full;
    let mut sent_total = sent_before_full;
    let mut got = Vec::with_capacity(LEN);
    let mut waits = 0;
    while got.len() < LEN && waits < 2000 {
        if (offset as usize) < LEN && poll_one(client.raw(), libc::POLLOUT, 0)? & libc::POLLOUT != 0
        {
            // SAFETY: valid fds and offset pointer.
            let sent =
                unsafe { libc::sendfile(client.raw(), file.as_raw_fd(), &mut offset, COUNT) };
            if sent > 0 {
                sent_total += sent as usize;
            } else if !(sent < 0 && errno() == libc::EAGAIN) {
                return Err(format!("sendfile once writable: {}", outcome(sent)));
            }
        }
        if poll_one(server.raw(), libc::POLLIN, 10)? == 0 {
            waits += 1;
            continue;
        }
        let (n, bytes) = read_some(server.raw(), 1 << 20);
        if n <= 0 {
            break;
        }
        got.extend_from_slice(&bytes);
    }
    // SAFETY: plain lseek on our file.
    let position = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_CUR) };
    Ok(format!(
        "EAGAIN once full: {full}, after at least 1 MiB: {}, in several calls: {}; \
         offset moved exactly: {}, file position {position}; peer read {} bytes, intact={}",
        sent_before_full >= 1 << 20,
        calls_before_full > 1,
        exact_before_full && offset as usize == sent_total,
        got.len(),
        got == body
    ))
}

/// Reads of nothing: `recv` of 0 bytes answers `EAGAIN` when nonblocking with nothing
/// queued, else 0; `read` and `readv` of nothing answer 0 whatever the socket holds.
fn zero_length_reads() -> CaseResult {
    let (client, server) = pair()?;
    let fd = server.raw();
    let mut byte = [0u8; 1];
    let buf = byte.as_mut_ptr().cast::<libc::c_void>();
    let empty_iov = [libc::iovec {
        iov_base: buf,
        iov_len: 0,
    }];
    let mut report = Vec::new();
    let round = |label: &str, report: &mut Vec<String>| {
        // SAFETY: zero-length calls on our socket with a valid buffer.
        let dontwait = outcome(unsafe { libc::recv(fd, buf, 0, libc::MSG_DONTWAIT) });
        // SAFETY: as above.
        let read = outcome(unsafe { libc::read(fd, buf, 0) });
        // SAFETY: as above; one iovec of length 0.
        let readv = outcome(unsafe { libc::readv(fd, empty_iov.as_ptr(), 1) });
        // SAFETY: toggling O_NONBLOCK on our socket.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) };
        // SAFETY: as above.
        let nonblock_recv = outcome(unsafe { libc::recv(fd, buf, 0, 0) });
        // SAFETY: as above.
        let nonblock_read = outcome(unsafe { libc::read(fd, buf, 0) });
        // SAFETY: as above.
        unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
        report.push(format!(
            "{label}: recv(DONTWAIT)={dontwait} read={read} readv={readv} nonblocking recv={nonblock_recv} read={nonblock_read}"
        ));
    };
    round("empty", &mut report);
    write_all(client.raw(), b"x")?;
    wait_for(fd, libc::POLLIN, 5000)?;
    settle();
    round("queued", &mut report);
    // SAFETY: valid one-byte buffer.
    let got = outcome(unsafe { libc::recv(fd, buf, 1, 0) });
    report.push(format!("then recv(1)={got} {:?}", byte[0] as char));
    // SAFETY: shutting down our own socket.
    unsafe { libc::shutdown(client.raw(), libc::SHUT_WR) };
    wait_for(fd, libc::POLLIN, 5000)?;
    settle();
    let buf = byte.as_mut_ptr().cast::<libc::c_void>();
    // SAFETY: zero-length call on our socket.
    let at_end = outcome(unsafe { libc::recv(fd, buf, 0, libc::MSG_DONTWAIT) });
    report.push(format!("after FIN: recv(DONTWAIT)={at_end}"));
    Ok(report.join("; "))
}

fn mmsg() -> CaseResult {
    let (client, server) = pair()?;
    let mut payloads = [*b"aaaa", *b"bbbb", *b"cccc"];
    let mut iovecs: Vec<libc::iovec> = payloads
        .iter_mut()
        .map(|p| libc::iovec {
            iov_base: p.as_mut_ptr().cast(),
            iov_len: 4,
        })
        .collect();
    // SAFETY: zeroed mmsghdr is valid; fields set below.
    let mut messages: Vec<libc::mmsghdr> = iovecs
        .iter_mut()
        .map(|iov| {
            // SAFETY: an all-zero mmsghdr is valid.
            let mut msg: libc::mmsghdr = unsafe { zeroed() };
            msg.msg_hdr.msg_iov = iov;
            msg.msg_hdr.msg_iovlen = 1;
            msg
        })
        .collect();
    // SAFETY: three initialised messages.
    let sent = unsafe { libc::sendmmsg(client.raw(), messages.as_mut_ptr(), 3, 0) };
    let lens: Vec<u32> = messages.iter().map(|m| m.msg_len).collect();
    wait_for(server.raw(), libc::POLLIN, 5000)?;
    settle();
    let mut received = Vec::new();
    for _ in 0..12 {
        let mut buffers = [[0u8; 4]; 3];
        let mut iovs: Vec<libc::iovec> = buffers
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: 4,
            })
            .collect();
        let mut headers: Vec<libc::mmsghdr> = iovs
            .iter_mut()
            .map(|iov| {
                // SAFETY: zeroed mmsghdr is valid.
                let mut msg: libc::mmsghdr = unsafe { zeroed() };
                msg.msg_hdr.msg_iov = iov;
                msg.msg_hdr.msg_iovlen = 1;
                msg
            })
            .collect();
        // SAFETY: three initialised headers; nonblocking so the loop cannot hang.
        let n = unsafe {
            libc::recvmmsg(
                server.raw(),
                headers.as_mut_ptr(),
                3,
                libc::MSG_DONTWAIT,
                null_mut(),
            )
        };
        if n <= 0 {
            break;
        }
        for (header, buffer) in headers.iter().zip(&buffers).take(n as usize) {
            received.extend_from_slice(&buffer[..header.msg_len as usize]);
        }
        if received.len() >= 12 {
            break;
        }
    }
    let mut msg: libc::msghdr = {
        // SAFETY: zeroed msghdr is valid.
        unsafe { zeroed() }
    };
    let mut one = *b"z";
    let mut iov = libc::iovec {
        iov_base: one.as_mut_ptr().cast::<c_void>(),
        iov_len: 1,
    };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    // SAFETY: initialised msghdr.
    let sendmsg = outcome(unsafe { libc::sendmsg(client.raw(), &msg, 0) });
    let got = read_text(server.raw())?;
    Ok(format!(
        "sendmmsg={} lens={lens:?} received={:?} sendmsg={sendmsg} {got:?}",
        outcome(sent as isize),
        String::from_utf8_lossy(&received)
    ))
}

fn fork_and_close_range() -> CaseResult {
    let (client, server) = pair()?;
    // SAFETY: the child only makes async-signal-safe calls and _exits.
    let pid = unsafe { libc::fork() };
    check(pid as isize, "fork")?;
    if pid == 0 {
        // SAFETY: child: write on the inherited socket, close everything, report via exit code.
        unsafe {
            let ok = libc::write(client.raw(), b"child".as_ptr().cast(), 5) == 5;
            let closed = libc::close_range(3, !0u32, 0) == 0;
            let after = libc::write(client.raw(), b"x".as_ptr().cast(), 1);
            let ebadf = after < 0 && *libc::__errno_location() == libc::EBADF;
            libc::_exit(if ok && closed && ebadf { 0 } else { 1 });
        }
    }
    let mut status = 0;
    // SAFETY: waiting for our child.
    check(
        // SAFETY: waiting for our child.
        unsafe { libc::waitpid(pid, &mut status, 0) } as isize,
        "waitpid",
    )?;
    let child_ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    let got = read_text(server.raw())?;
    write_all(client.raw(), b"parent")?;
    let parent = read_text(server.raw())?;
    // close_range with CLOEXEC only marks; the fd stays usable.
    // SAFETY: valid range on our own fds.
    let mark = outcome(unsafe {
        libc::close_range(
            client.raw() as u32,
            client.raw() as u32,
            libc::CLOSE_RANGE_CLOEXEC as c_int,
        )
    } as isize);
    // SAFETY: F_GETFD.
    let cloexec = unsafe { libc::fcntl(client.raw(), libc::F_GETFD) } & libc::FD_CLOEXEC != 0;
    // SAFETY: invalid range.
    let bad = outcome(unsafe { libc::close_range(10, 5, 0) } as isize);
    // vfork + _exit: the parent resumes with its stack intact.
    let marker = std::hint::black_box(0x5a5a_u32);
    // SAFETY: the vfork child only calls _exit.
    let vpid = unsafe {
        #[allow(deprecated)]
        let vpid = libc::vfork();
        if vpid == 0 {
            libc::_exit(7);
        }
        vpid
    };
    let mut vstatus = 0;
    // SAFETY: waiting for our child.
    unsafe { libc::waitpid(vpid, &mut vstatus, 0) };
    let vfork_ok = libc::WIFEXITED(vstatus)
        && libc::WEXITSTATUS(vstatus) == 7
        && std::hint::black_box(marker) == 0x5a5a;
    Ok(format!("child wrote {got:?} and close_range(3,~0) closed it: {child_ok}; parent still writes: {parent:?}; CLOSE_RANGE_CLOEXEC={mark} cloexec={cloexec}; close_range(10,5)={bad}; vfork ok={vfork_ok}"))
}

/// Runs `talk` on a connection to `port` made by a client in a process of its own (so that the
/// server's forks do not copy the client's socket), returns what `talk` reported and reaps it.
fn in_client_process(
    port: u16,
    talk: impl FnOnce(c_int) -> Result<String, String>,
) -> Result<ClientProcess, String> {
    let mut pipe = [0 as c_int; 2];
    // SAFETY: a two-int array for pipe2.
    check(
        // SAFETY: as above.
        unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } as isize,
        "pipe2",
    )?;
    let (report_read, report_write) = (Fd(pipe[0]), Fd(pipe[1]));
    // SAFETY: this program is single-threaded; the child runs `talk` and _exits.
    let pid = unsafe { libc::fork() };
    check(pid as isize, "fork")?;
    if pid == 0 {
        drop(report_read);
        let report = connect_to(Family::V4, port, libc::SOCK_CLOEXEC)
            .and_then(|(client, rc)| check(rc, "connect").and_then(|_| talk(client.raw())))
            .unwrap_or_else(|error| format!("client FAILED {error}"));
        let _ = write_all(report_write.raw(), report.as_bytes());
        // SAFETY: ends the client process without running the parent's exit handlers.
        unsafe { libc::_exit(0) };
    }
    drop(report_write);
    Ok(ClientProcess { pid, report_read })
}

/// A client process started by [`in_client_process`].
struct ClientProcess {
    pid: libc::pid_t,
    report_read: Fd,
}

impl ClientProcess {
    /// Waits for the client's report (until it exits) and reaps it.
    fn report(self) -> Result<String, String> {
        let mut report = Vec::new();
        loop {
            wait_for(self.report_read.raw(), libc::POLLIN, 10_000)?;
            let (n, bytes) = read_some(self.report_read.raw(), 4096);
            if n <= 0 {
                break;
            }
            report.extend_from_slice(&bytes[..n as usize]);
        }
        reap(self.pid)?;
        Ok(String::from_utf8_lossy(&report).into_owned())
    }
}

/// Waits for child `pid`; true when it exited with status 0.
fn reap(pid: libc::pid_t) -> Result<bool, String> {
    let mut status = 0;
    // SAFETY: waiting for our child.
    check(
        // SAFETY: as above.
        unsafe { libc::waitpid(pid, &mut status, 0) } as isize,
        "waitpid",
    )?;
    Ok(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0)
}

/// A server that forks per connection: the child serves the accepted connection, the parent
/// closes its copy right after the fork (PostgreSQL's postmaster, `ForkingMixIn`). The client
/// is a process of its own.
fn fork_per_connection() -> CaseResult {
    let (listener, port) = listener_on(Family::V4, false)?;
    let client = in_client_process(port, |fd| {
        write_all(fd, b"request")?;
        let reply = read_exactly_text(fd, 5)?;
        wait_for(fd, libc::POLLIN, 5000)?;
        let (after, _) = read_some(fd, 16);
        Ok(format!(
            "client got {reply:?}, then read={}",
            outcome(after)
        ))
    })?;
    let server = accept_one(&listener)?;
    // SAFETY: this program is single-threaded; the child serves and _exits.
    let pid = unsafe { libc::fork() };
    check(pid as isize, "fork")?;
    if pid == 0 {
        let served = read_exactly_text(server.raw(), 7).is_ok_and(|request| request == "request")
            && write_all(server.raw(), b"reply").is_ok();
        // SAFETY: ends the server child.
        unsafe { libc::_exit(if served { 0 } else { 1 }) };
    }
    drop(server);
    let served = reap(pid)?;
    Ok(format!(
        "server child served: {served}; {}",
        client.report()?
    ))
}

/// Both processes use an accepted connection after a fork: the child writes and exits, then
/// the parent writes and reads. The client is a process of its own.
fn fork_and_both_use() -> CaseResult {
    let (listener, port) = listener_on(Family::V4, false)?;
    let client = in_client_process(port, |fd| {
        let got = read_exactly_text(fd, 12)?;
        write_all(fd, b"back")?;
        Ok(format!("client read {got:?}"))
    })?;
    let server = accept_one(&listener)?;
    // SAFETY: this program is single-threaded; the child writes and _exits.
    let pid = unsafe { libc::fork() };
    check(pid as isize, "fork")?;
    if pid == 0 {
        let sent = write_all(server.raw(), b"child").is_ok();
        // SAFETY: ends the child.
        unsafe { libc::_exit(if sent { 0 } else { 1 }) };
    }
    let child_ok = reap(pid)?;
    write_all(server.raw(), b"+parent")?;
    let back = read_exactly_text(server.raw(), 4)?;
    Ok(format!(
        "child wrote: {child_ok}; server read {back:?}; {}",
        client.report()?
    ))
}

// ---- close and exit -----------------------------------------------------------------------------

/// `send` with `MSG_NOSIGNAL` (no SIGPIPE), as text.
fn send_text(fd: c_int, bytes: &[u8]) -> String {
    // SAFETY: valid buffer.
    outcome(unsafe { libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_NOSIGNAL) })
}

/// Sets `SO_LINGER` 0: the next close is abortive (RST).
fn linger_zero(fd: c_int) -> Result<(), String> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: live linger struct of the stated size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            size_of::<libc::linger>() as u32,
        )
    };
    check(rc as isize, "SO_LINGER").map(|_| ())
}

/// The peer closed gracefully: our first send is accepted (the peer's kernel answers it with
/// a reset), the later ones fail with EPIPE; reads see end of stream.
fn close_then_send() -> CaseResult {
    let (client, server) = pair()?;
    write_all(client.raw(), b"x")?;
    read_text(server.raw())?;
    drop(server);
    wait_for(client.raw(), libc::POLLIN, 5000)?;
    settle();
    let first = send_text(client.raw(), b"hello");
    settle();
    let second = send_text(client.raw(), b"hello");
    let third = send_text(client.raw(), b"hello");
    let read = outcome(read_some(client.raw(), 16).0);
    Ok(format!(
        "send={first} then send={second} send={third} read={read}"
    ))
}

/// The peer reset the connection (SO_LINGER 0): a read reports ECONNRESET once, then end of
/// stream, and sends fail with EPIPE.
fn close_reset_then_send() -> CaseResult {
    let (client, server) = pair()?;
    write_all(client.raw(), b"x")?;
    read_text(server.raw())?;
    linger_zero(server.raw())?;
    drop(server);
    wait_for(client.raw(), libc::POLLIN, 5000)?;
    let first = outcome(read_some(client.raw(), 16).0);
    let second = outcome(read_some(client.raw(), 16).0);
    let send = send_text(client.raw(), b"x");
    let again = send_text(client.raw(), b"x");
    Ok(format!(
        "read={first} read={second} send={send} send={again}"
    ))
}

/// What poll, ppoll and epoll report on our end after the peer's plain close(): readable
/// with RDHUP, writable, no error and no hang-up (our side has not shut down).
fn close_readiness_after_peer_close() -> CaseResult {
    let (client, server) = pair()?;
    write_all(server.raw(), b"bye")?;
    read_text(client.raw())?;
    drop(server);
    let wanted = libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP;
    wait_for(client.raw(), libc::POLLRDHUP, 5000)?;
    settle();
    let polled = revents_text(poll_one(client.raw(), wanted, 1000)?);
    let mut pfd = libc::pollfd {
        fd: client.raw(),
        events: wanted,
        revents: 0,
    };
    let zero = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: one live pollfd, a live timespec, no mask.
    let rc = unsafe { libc::ppoll(&mut pfd, 1, &zero, null()) };
    check(rc as isize, "ppoll")?;
    let ppolled = revents_text(pfd.revents);
    let epfd = epoll_new()?;
    let events = (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP) as u32;
    check(
        epoll_add(epfd.raw(), libc::EPOLL_CTL_ADD, client.raw(), events, 7),
        "epoll_ctl",
    )?;
    let epolled = epoll_collect(epfd.raw(), 1000)?
        .iter()
        .map(|(data, events)| format!("{data}:{}", epoll_events_text(*events)))
        .collect::<Vec<_>>()
        .join(",");
    let read = outcome(read_some(client.raw(), 16).0);
    let polled_after_eof = revents_text(poll_one(client.raw(), wanted, 1000)?);
    Ok(format!(
        "poll={polled} ppoll={ppolled} epoll={epolled} read={read} poll={polled_after_eof}"
    ))
}

/// Closing with unread bytes in our receive queue resets the peer: its read fails with
/// ECONNRESET, then sees end of stream, and its sends fail with EPIPE.
fn close_with_unread_data() -> CaseResult {
    let (client, server) = pair()?;
    write_all(client.raw(), b"never read")?;
    wait_for(server.raw(), libc::POLLIN, 5000)?;
    settle();
    drop(server);
    let revents = wait_for(client.raw(), libc::POLLIN, 5000)?;
    let first = outcome(read_some(client.raw(), 16).0);
    let second = outcome(read_some(client.raw(), 16).0);
    let send = send_text(client.raw(), b"x");
    Ok(format!(
        "poll={} read={first} read={second} send={send}",
        revents_text(revents & (libc::POLLIN | libc::POLLERR))
    ))
}

/// Closing with bytes the peer has not taken yet (it is not reading): close() returns at
/// once, also on a blocking socket, and the peer still reads every byte, then end of stream.
fn close_with_unsent_data() -> CaseResult {
    let (client, server) = pair()?;
    // A round trip first: the connection is fully set up (over the SAN, switched).
    write_all(client.raw(), b"x")?;
    read_text(server.raw())?;
    write_all(server.raw(), b"y")?;
    read_text(client.raw())?;
    set_nonblocking(client.raw())?;
    let pattern: Vec<u8> = (0..64 << 10).map(|i: u32| (i % 251) as u8).collect();
    let mut sent = 0usize;
    // Until the socket takes no more (the kernel's buffers, or the SAN's), at most 8 MiB.
    while sent < 8 << 20 {
        let offset = sent % pattern.len();
        // SAFETY: a live buffer of the stated length.
        let n = unsafe {
            libc::send(
                client.raw(),
                pattern[offset..].as_ptr().cast(),
                pattern.len() - offset,
                libc::MSG_NOSIGNAL,
            )
        };
        if n <= 0 {
            break;
        }
        sent += n as usize;
    }
    let flags = check(
        // SAFETY: plain fcntl.
        unsafe { libc::fcntl(client.raw(), libc::F_GETFL) } as isize,
        "F_GETFL",
    )? as c_int;
    check(
        // SAFETY: plain fcntl: back to blocking, the case a lingering close would wait in.
        unsafe { libc::fcntl(client.raw(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } as isize,
        "F_SETFL",
    )?;
    let started = std::time::Instant::now();
    drop(client);
    let close = if started.elapsed() < std::time::Duration::from_millis(200) {
        "at once"
    } else {
        "late"
    };
    let mut received = 0usize;
    let mut intact = true;
    let end = loop {
        let (n, bytes) = read_some(server.raw(), 256 << 10);
        if n <= 0 {
            break outcome(n);
        }
        for (i, byte) in bytes.iter().enumerate() {
            intact &= *byte == pattern[(received + i) % pattern.len()];
        }
        received += bytes.len();
    };
    if sent < 256 << 10 {
        return Err(format!("the socket took only {sent} bytes"));
    }
    Ok(format!(
        "close returned {close}, the peer read {} bytes{} then {end}",
        if received == sent { "all" } else { "not all" },
        if intact { "" } else { " (corrupt)" }
    ))
}

/// Another thread closes a socket while this one is blocked reading it, and the number is
/// reused at once (a Unix socket here) and written to: the blocked read must never return the new
/// file's bytes. (The kernel keeps the blocked call on the old socket, which ends with the
/// old peer's close.)
fn close_while_blocked_in_recv() -> CaseResult {
    let (client, server) = pair()?;
    // The connection is set up (over the SAN, switched) before the read blocks.
    write_all(client.raw(), b"x")?;
    read_text(server.raw())?;
    let fd = server.into_raw();
    let reader = std::thread::spawn(move || read_some(fd, 16).1);
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut pipe = [0 as c_int; 2];
    check(
        // SAFETY: a two-element array for socketpair(2).
        unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, pipe.as_mut_ptr()) }
            as isize,
        "socketpair",
    )?;
    let (pipe_read, pipe_write) = (Fd(pipe[0]), Fd(pipe[1]));
    // SAFETY: closes the number the reader is blocked on, as the application's other
    // thread would; nothing else owns it.
    unsafe { libc::close(fd) };
    // The number goes to the pipe's read end (a lower number may have been free).
    // SAFETY: plain dup2 of our own pipe onto the number just closed.
    let reused = unsafe { libc::dup2(pipe_read.raw(), fd) } == fd;
    let _reused_number = Fd(fd);
    write_all(pipe_write.raw(), b"NEW")?;
    std::thread::sleep(std::time::Duration::from_millis(200));
    drop(client);
    let got = reader.join().map_err(|_| "reader panicked")?;
    Ok(format!(
        "number reused: {reused}, the blocked read returned the new file's bytes: {}",
        got.windows(3).any(|w| w == b"NEW")
    ))
}

// ---- in-process pair ----------------------------------------------------------------------------

/// A connection whose client runs `client` in another thread of this process once the
/// connection was accepted; the accepted socket is returned.
fn threaded_pair(
    client: impl FnOnce(Fd) -> Result<(), String> + Send + 'static,
) -> Result<(Fd, std::thread::JoinHandle<Result<(), String>>), String> {
    let (listener, port) = listener()?;
    let (accepted_tx, accepted_rx) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::spawn(move || {
        let (fd, rc) = connect_to(Family::V4, port, libc::SOCK_CLOEXEC)?;
        check(rc, "connect")?;
        accepted_rx.recv().map_err(|_| "not accepted")?;
        client(fd)
    });
    let server = accept_one(&listener)?;
    accepted_tx.send(()).map_err(|_| "client thread gone")?;
    Ok((server, thread))
}

fn join(thread: std::thread::JoinHandle<Result<(), String>>) -> Result<(), String> {
    thread.join().map_err(|_| "client thread panicked")?
}

fn set_nonblocking(fd: c_int) -> Result<(), String> {
    // SAFETY: plain fcntl calls.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    check(flags as isize, "F_GETFL")?;
    // SAFETY: as above.
    check(
        // SAFETY: as above.
        unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } as isize,
        "F_SETFL",
    )
    .map(|_| ())
}

/// select() on one fd for reading, with a timeout in milliseconds: "readable" or "timeout".
fn select_readable(fd: c_int, timeout_ms: i64) -> Result<String, String> {
    // SAFETY: zeroed fd_set is valid; FD_ZERO/FD_SET on it.
    let mut set: libc::fd_set = unsafe { zeroed() };
    // SAFETY: `fd` < FD_SETSIZE in this program.
    unsafe { libc::FD_SET(fd, &mut set) };
    let mut timeout = libc::timeval {
        tv_sec: timeout_ms / 1000,
        tv_usec: (timeout_ms % 1000) * 1000,
    };
    // SAFETY: live set and timeval.
    let rc = unsafe { libc::select(fd + 1, &mut set, null_mut(), null_mut(), &mut timeout) };
    check(rc as isize, "select")?;
    // SAFETY: a live set.
    Ok(if rc > 0 && unsafe { libc::FD_ISSET(fd, &set) } {
        "readable".into()
    } else {
        format!("{rc} ready")
    })
}

/// The acceptor goes nonblocking and finds nothing to read; the client thread then sends,
/// and a select() on the acceptor reports it readable and the data is there.
fn in_process_select_after_eagain() -> CaseResult {
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (server, thread) = threaded_pair(move |client| {
        go_rx.recv().map_err(|_| "no go")?;
        std::thread::sleep(Duration::from_millis(50));
        write_all(client.raw(), b"hello")?;
        go_rx.recv().map_err(|_| "no end")?;
        Ok(())
    })?;
    set_nonblocking(server.raw())?;
    let (first, _) = read_some(server.raw(), 16);
    let first = outcome(first);
    go_tx.send(()).map_err(|_| "client gone")?;
    let selected = select_readable(server.raw(), 5000)?;
    let (n, bytes) = read_some(server.raw(), 16);
    let got = if n < 0 {
        outcome(n)
    } else {
        String::from_utf8_lossy(&bytes).into_owned()
    };
    go_tx.send(()).map_err(|_| "client gone")?;
    join(thread)?;
    Ok(format!("recv={first} select={selected} recv={got:?}"))
}

/// The client thread sends ten bytes; nonblocking reads of seven take them all: 7, then 3,
/// then EAGAIN.
fn in_process_partial_nonblocking_reads() -> CaseResult {
    let (sent_tx, sent_rx) = std::sync::mpsc::channel::<()>();
    let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
    let (server, thread) = threaded_pair(move |client| {
        write_all(client.raw(), b"0123456789")?;
        sent_tx.send(()).map_err(|_| "main gone")?;
        end_rx.recv().map_err(|_| "no end")?;
        Ok(())
    })?;
    sent_rx.recv().map_err(|_| "client gone")?;
    settle();
    set_nonblocking(server.raw())?;
    let reads: Vec<String> = (0..3)
        .map(|_| {
            let (n, bytes) = read_some(server.raw(), 7);
            if n < 0 {
                outcome(n)
            } else {
                format!("{:?}", String::from_utf8_lossy(&bytes))
            }
        })
        .collect();
    end_tx.send(()).map_err(|_| "client gone")?;
    join(thread)?;
    Ok(format!("reads {}", reads.join(" ")))
}

/// The client thread writes a message in pieces (as a buffered text stream flushes) and
/// closes at once; the reader reads until end of stream and gets all of it.
fn in_process_write_and_close() -> CaseResult {
    let (server, thread) = threaded_pair(move |client| {
        write_all(client.raw(), b"hello ")?;
        write_all(client.raw(), b"world\n")?;
        drop(client);
        Ok(())
    })?;
    join(thread)?;
    let mut got = Vec::new();
    let end = loop {
        let (n, bytes) = read_some(server.raw(), 4);
        if n <= 0 {
            break if n == 0 { "EOF".to_owned() } else { outcome(n) };
        }
        got.extend_from_slice(&bytes);
    };
    Ok(format!(
        "read {:?} then {end}",
        String::from_utf8_lossy(&got)
    ))
}

/// A bound on every blocking read of `fds`: a read that gets nothing fails (`EAGAIN`) after
/// 3 s instead of hanging.
fn bound_reads(fds: &[c_int]) -> Result<(), String> {
    let timeout = libc::timeval {
        tv_sec: 3,
        tv_usec: 0,
    };
    for &fd in fds {
        // SAFETY: a valid timeval.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        check(rc as isize, "SO_RCVTIMEO")?;
    }
    Ok(())
}

/// Reads through `reader` until `want` bytes came or a bounded wait ran out.
fn read_exactly(
    fd: c_int,
    want: usize,
    reader: impl Fn(c_int, &mut [u8]) -> isize,
) -> Result<String, String> {
    let mut got = Vec::new();
    for _ in 0..50 {
        if got.len() >= want {
            break;
        }
        if poll_one(fd, libc::POLLIN, 100)? == 0 {
            continue;
        }
        let mut buf = vec![0u8; want - got.len()];
        let n = reader(fd, &mut buf);
        if n <= 0 {
            return Ok(format!(
                "{:?} then {}",
                String::from_utf8_lossy(&got),
                outcome(n)
            ));
        }
        got.extend_from_slice(&buf[..n as usize]);
    }
    Ok(String::from_utf8_lossy(&got).into_owned())
}

/// Socket I/O through libc's `syscall()` with the raw numbers, interleaved with the ordinary
/// calls on a connection that has carried data already: the stream order is kept.
fn raw_syscall_io() -> CaseResult {
    let (client, server) = pair()?;
    bound_reads(&[client.raw(), server.raw()])?;
    write_all(client.raw(), b"a")?;
    let first = read_text(server.raw())?;
    let raw_write = |fd: c_int, bytes: &[u8]| -> isize {
        // SAFETY: a valid buffer of `bytes.len()` bytes.
        (unsafe { libc::syscall(libc::SYS_write, fd, bytes.as_ptr(), bytes.len()) }) as isize
    };
    let raw_read = |fd: c_int, buf: &mut [u8]| -> isize {
        // SAFETY: a valid buffer of `buf.len()` bytes.
        (unsafe { libc::syscall(libc::SYS_read, fd, buf.as_mut_ptr(), buf.len()) }) as isize
    };
    let wrote_b = raw_write(client.raw(), b"b");
    write_all(client.raw(), b"c")?;
    // SAFETY: a valid buffer; no address.
    let sent_d = unsafe {
        libc::syscall(
            libc::SYS_sendto,
            client.raw(),
            b"d".as_ptr(),
            1usize,
            0,
            null::<c_void>(),
            0,
        )
    };
    let iov = [libc::iovec {
        iov_base: b"ef".as_ptr().cast_mut().cast(),
        iov_len: 2,
    }];
    // SAFETY: one valid iovec.
    let wrote_ef = unsafe { libc::syscall(libc::SYS_writev, client.raw(), iov.as_ptr(), 1) };
    let forward = read_exactly(server.raw(), 5, raw_read)?;
    // The other way: recvfrom and recvmsg by number.
    let wrote_pong = raw_write(server.raw(), b"pong");
    let back = read_exactly(client.raw(), 4, |fd, buf| {
        // SAFETY: a valid buffer; no address.
        (unsafe {
            libc::syscall(
                libc::SYS_recvfrom,
                fd,
                buf.as_mut_ptr(),
                buf.len(),
                0,
                null_mut::<c_void>(),
                null_mut::<c_void>(),
            )
        }) as isize
    })?;
    write_all(server.raw(), b"tail")?;
    let tail = read_exactly(client.raw(), 4, |fd, buf| {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: a zeroed msghdr with one valid iovec.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        // SAFETY: as above.
        (unsafe { libc::syscall(libc::SYS_recvmsg, fd, &mut msg, 0) }) as isize
    })?;
    // A number that is not socket I/O passes straight through.
    // SAFETY: getpid has no arguments.
    let pid_matches =
        unsafe { libc::syscall(libc::SYS_getpid) } == i64::from(unsafe { libc::getpid() });
    Ok(format!(
        "{first:?}; raw write={wrote_b} sendto={sent_d} writev={wrote_ef} read {forward:?}; raw write={wrote_pong} recvfrom {back:?}; recvmsg {tail:?}; getpid passes: {pid_matches}"
    ))
}

extern "C" {
    /// The C stream `fprintf` (declared here with the one string argument used).
    #[link_name = "fprintf"]
    fn fprintf_str(stream: *mut libc::FILE, format: *const libc::c_char, ...) -> c_int;
}

/// A line read with `fgets`, or what went wrong.
fn stdio_line(stream: *mut libc::FILE) -> String {
    let mut line = [0 as libc::c_char; 128];
    // SAFETY: a valid stream and a buffer of the stated length.
    let got = unsafe { libc::fgets(line.as_mut_ptr(), line.len() as c_int, stream) };
    if got.is_null() {
        return format!("fgets failed {}", errno_name(errno()));
    }
    // SAFETY: fgets NUL-terminated the buffer.
    unsafe { std::ffi::CStr::from_ptr(line.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// stdio on both ends of a connection that has carried data already (`fdopen` of copies of
/// the socket, `fprintf` + `fflush`, `fgets`), with bytes waiting before the stream is opened;
/// then the socket itself carries on.
fn stdio_on_socket() -> CaseResult {
    let (client, server) = pair()?;
    bound_reads(&[client.raw(), server.raw()])?;
    write_all(client.raw(), b"a")?;
    let first = read_text(server.raw())?;
    write_all(server.raw(), b"hello\n")?;
    settle();
    let open = |fd: c_int, mode: &std::ffi::CStr| -> Result<(*mut libc::FILE, c_int), String> {
        // SAFETY: dup of an open descriptor.
        let copy = check(unsafe { libc::dup(fd) } as isize, "dup")? as c_int;
        // SAFETY: an open descriptor and a valid mode.
        let stream = unsafe { libc::fdopen(copy, mode.as_ptr()) };
        if stream.is_null() {
            return Err(format!("setup-failed fdopen {}", errno_name(errno())));
        }
        Ok((stream, copy))
    };
    let (reader, reader_fd) = open(client.raw(), c"r")?;
    let (writer, _) = open(client.raw(), c"w")?;
    // SAFETY: a valid stream.
    let numbered = unsafe { libc::fileno(reader) } == reader_fd;
    let hello = stdio_line(reader);
    // SAFETY: a valid stream and format.
    let printed = unsafe { fprintf_str(writer, c"reply %d\n".as_ptr(), 42 as c_int) };
    // SAFETY: a valid stream.
    let flushed = unsafe { libc::fflush(writer) };
    let reply = read_text(server.raw())?;
    let (both, _) = open(server.raw(), c"r+")?;
    // SAFETY: a valid stream and format.
    unsafe { fprintf_str(both, c"%s\n".as_ptr(), c"ping".as_ptr()) };
    // SAFETY: a valid stream.
    unsafe { libc::fflush(both) };
    let ping = stdio_line(reader);
    // SAFETY: a valid stream and format.
    unsafe { fprintf_str(writer, c"pong\n".as_ptr()) };
    // SAFETY: a valid stream.
    unsafe { libc::fflush(writer) };
    let pong = stdio_line(both);
    // SAFETY: streams opened above, each closed once (with its own descriptor).
    let closed = unsafe {
        [
            libc::fclose(reader),
            libc::fclose(writer),
            libc::fclose(both),
        ]
    };
    write_all(client.raw(), b"after")?;
    let after = read_text(server.raw())?;
    Ok(format!(
        "{first:?}; fileno ok: {numbered}; fgets {hello:?}; fprintf={printed} fflush={flushed} -> {reply:?}; r+ {ping:?} {pong:?}; fclose {closed:?}; then {after:?}"
    ))
}

// ---- bad buffers and fault handlers --------------------------------------------------------

const PAGE: usize = 4096;
/// An address no process maps: below the kernel's lowest mappable address.
const UNMAPPED: usize = 0x1000;

/// Two pages: the first readable and writable (filled with a pattern), the second
/// inaccessible (`PROT_NONE`). Unmapped on drop.
struct BadMemory {
    base: *mut u8,
}

impl BadMemory {
    fn new() -> Result<BadMemory, String> {
        // SAFETY: a fresh anonymous mapping of our own.
        let base = unsafe {
            libc::mmap(
                null_mut(),
                2 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(format!("setup-failed mmap {}", errno_name(errno())));
        }
        let memory = BadMemory { base: base.cast() };
        for i in 0..PAGE {
            // SAFETY: inside the first page.
            unsafe { *memory.base.add(i) = b'a' + (i % 26) as u8 };
        }
        memory.protect_wall(libc::PROT_NONE)?;
        Ok(memory)
    }

    /// The first byte of the inaccessible page.
    fn wall(&self) -> *mut u8 {
        self.base.wrapping_add(PAGE)
    }

    fn protect_wall(&self, protection: c_int) -> Result<(), String> {
        // SAFETY: the second page of our own mapping.
        let rc = unsafe { libc::mprotect(self.wall().cast(), PAGE, protection) };
        check(rc as isize, "mprotect").map(|_| ())
    }
}

impl Drop for BadMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), 2 * PAGE) };
    }
}

fn iovec(base: *mut u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: base.cast(),
        iov_len: len,
    }
}

/// A message header over `iov`.
fn message(iov: &mut [libc::iovec]) -> libc::msghdr {
    // SAFETY: plain data, zero is valid.
    let mut msg: libc::msghdr = unsafe { zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    msg
}

/// Two round trips: over the SAN both ends have switched by then.
fn exchange(client: &Fd, server: &Fd) -> Result<(), String> {
    for _ in 0..2 {
        write_all(client.raw(), b"ping")?;
        read_exactly_text(server.raw(), 4)?;
        write_all(server.raw(), b"pong")?;
        read_exactly_text(client.raw(), 4)?;
    }
    Ok(())
}

/// Reads exactly `len` bytes (bounded waits), as text.
fn read_exactly_text(fd: c_int, len: usize) -> Result<String, String> {
    let mut got = Vec::new();
    while got.len() < len {
        wait_for(fd, libc::POLLIN, 5000)?;
        let (n, bytes) = read_some(fd, len - got.len());
        if n <= 0 {
            return Err(format!("read {}", outcome(n)));
        }
        got.extend_from_slice(&bytes);
    }
    Ok(String::from_utf8_lossy(&got).into_owned())
}

/// Every call of the send and receive family with a buffer (or vector, or message) the
/// process may not access answers EFAULT: nothing of a send is taken, the bytes of a receive
/// stay, and the connection goes on with every byte intact.
fn bad_buffers() -> CaseResult {
    let (client, server) = pair()?;
    exchange(&client, &server)?;
    let memory = BadMemory::new()?;
    let wall = memory.wall();
    let good = memory.base;
    let unmapped = UNMAPPED as *mut u8;
    let c = client.raw();
    let mut sends = Vec::new();
    // SAFETY: the kernel, or the preload, checks each address of the calls below; none is
    // dereferenced here.
    unsafe {
        sends.push(outcome(libc::send(c, wall.cast(), 100, 0)));
        sends.push(outcome(libc::write(c, unmapped.cast(), 100)));
        sends.push(outcome(libc::write(c, null(), 10)));
        // 50 good bytes, then the wall.
        sends.push(outcome(libc::send(
            c,
            wall.sub(50).cast(),
            100,
            libc::MSG_DONTWAIT,
        )));
        let mut good_then_bad = [iovec(good, 100), iovec(wall, 100)];
        sends.push(outcome(libc::writev(c, good_then_bad.as_ptr(), 2)));
        let mut good_then_unmapped = [iovec(good, 100), iovec(unmapped, 10)];
        let msg = message(&mut good_then_unmapped);
        sends.push(outcome(libc::sendmsg(c, &msg, 0)));
        // The vector and the message themselves unreadable.
        sends.push(outcome(libc::writev(c, unmapped.cast(), 1)));
        sends.push(outcome(libc::sendmsg(c, unmapped.cast(), 0)));
        let _ = &mut good_then_bad;
    }
    // None of them took a byte: the peer reads exactly what follows.
    write_all(c, b"after the bad sends")?;
    let after_sends = read_exactly_text(server.raw(), 19)?;

    // One message queued for the client, then the same kinds of bad receives.
    write_all(server.raw(), &[b'm'; 100])?;
    wait_for(c, libc::POLLIN, 5000)?;
    settle();
    let mut first = [0u8; 10];
    let mut receives = Vec::new();
    // SAFETY: as above.
    unsafe {
        receives.push(outcome(libc::recv(c, wall.cast(), 100, 0)));
        receives.push(outcome(libc::read(c, unmapped.cast(), 100)));
        receives.push(outcome(libc::read(c, null_mut(), 10)));
        receives.push(outcome(libc::recv(c, wall.sub(10).cast(), 100, 0)));
        receives.push(outcome(libc::recv(c, wall.cast(), 100, libc::MSG_PEEK)));
        receives.push(outcome(libc::recv(c, wall.cast(), 100, libc::MSG_WAITALL)));
        let good_then_bad = [iovec(first.as_mut_ptr(), 10), iovec(wall, 100)];
        receives.push(outcome(libc::readv(c, good_then_bad.as_ptr(), 2)));
        let mut good_then_unmapped = [iovec(first.as_mut_ptr(), 10), iovec(unmapped, 100)];
        let mut msg = message(&mut good_then_unmapped);
        receives.push(outcome(libc::recvmsg(c, &mut msg, 0)));
        receives.push(outcome(libc::readv(c, unmapped.cast(), 1)));
        receives.push(outcome(libc::recvmsg(c, unmapped.cast(), 0)));
    }
    let mut queued: c_int = -1;
    // SAFETY: FIONREAD into our int.
    unsafe { libc::ioctl(c, libc::FIONREAD, &mut queued) };
    let (n, bytes) = read_some(c, 200);
    let intact = n == 100 && bytes.iter().all(|&b| b == b'm');
    // recvfrom on a connected socket: no address, so addrlen is written (0) only when an
    // address buffer is given, and an addrlen the process may not write is EFAULT after the
    // bytes were taken.
    write_all(server.raw(), b"abc")?;
    wait_for(c, libc::POLLIN, 5000)?;
    let mut small = [0u8; 8];
    let mut addrlen: libc::socklen_t = 77;
    // SAFETY: our buffer and length; no address buffer.
    let without_addr = outcome(unsafe {
        libc::recvfrom(c, small.as_mut_ptr().cast(), 8, 0, null_mut(), &mut addrlen)
    });
    let kept = addrlen;
    write_all(server.raw(), b"def")?;
    wait_for(c, libc::POLLIN, 5000)?;
    // SAFETY: zeroed storage is valid.
    let mut from: libc::sockaddr_storage = unsafe { zeroed() };
    // SAFETY: our buffers; the kernel (or the preload) checks the bad addrlen.
    let bad_addrlen = outcome(unsafe {
        libc::recvfrom(
            c,
            small.as_mut_ptr().cast(),
            8,
            0,
            (&mut from as *mut libc::sockaddr_storage).cast(),
            UNMAPPED as *mut libc::socklen_t,
        )
    });
    // SAFETY: our buffer; nonblocking.
    let left = outcome(unsafe { libc::recv(c, small.as_mut_ptr().cast(), 8, libc::MSG_DONTWAIT) });
    // Both directions still work.
    write_all(c, b"client still writes")?;
    let from_client = read_exactly_text(server.raw(), 19)?;
    write_all(server.raw(), b"server still writes")?;
    let from_server = read_exactly_text(c, 19)?;
    Ok(format!(
        "sends [{}] then {after_sends:?}; receives [{}] with {queued} bytes left, read {} intact={intact}; recvfrom without address {without_addr} addrlen {kept}, into a bad addrlen {bad_addrlen} then {left}; then {from_client:?} / {from_server:?}",
        sends.join(" "),
        receives.join(" "),
        outcome(n)
    ))
}

/// What an application's fault handler saw, for `fault_handlers`.
static FAULTS: AtomicUsize = AtomicUsize::new(0);
static FAULT_CODE: AtomicI32 = AtomicI32::new(0);
static FAULT_AT_WALL: AtomicBool = AtomicBool::new(false);
static FAULT_BLOCKED_USR1: AtomicBool = AtomicBool::new(false);
static FAULT_BLOCKED_SEGV: AtomicBool = AtomicBool::new(false);
/// The inaccessible page the case faults on; the handler opens it so the access succeeds
/// when it runs again.
static FAULT_WALL: AtomicUsize = AtomicUsize::new(0);

/// Records what it was called with, then opens the wall (a fault there runs again and
/// succeeds; a sent signal just returns).
extern "C" fn on_fault_info(_: c_int, info: *mut libc::siginfo_t, _: *mut c_void) {
    FAULTS.fetch_add(1, Ordering::SeqCst);
    // SAFETY: the kernel's siginfo_t; querying our own mask; our own wall page.
    unsafe {
        let code = (*info).si_code;
        FAULT_CODE.store(code, Ordering::SeqCst);
        let wall = FAULT_WALL.load(Ordering::SeqCst);
        FAULT_AT_WALL.store((*info).si_addr() as usize == wall, Ordering::SeqCst);
        let mut mask: libc::sigset_t = zeroed();
        libc::pthread_sigmask(libc::SIG_BLOCK, null(), &mut mask);
        FAULT_BLOCKED_USR1.store(
            libc::sigismember(&mask, libc::SIGUSR1) == 1,
            Ordering::SeqCst,
        );
        FAULT_BLOCKED_SEGV.store(
            libc::sigismember(&mask, libc::SIGSEGV) == 1,
            Ordering::SeqCst,
        );
        if code > 0 {
            libc::mprotect(
                wall as *mut c_void,
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
            );
        }
    }
}

/// A plain handler: counts, and opens the wall.
extern "C" fn on_fault_plain(_: c_int) {
    FAULTS.fetch_add(1, Ordering::SeqCst);
    // SAFETY: our own wall page.
    unsafe {
        libc::mprotect(
            FAULT_WALL.load(Ordering::SeqCst) as *mut c_void,
            PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
        )
    };
}

extern "C" {
    /// glibc's System V `signal` (the libc crate does not declare it).
    fn sysv_signal(signum: c_int, handler: libc::sighandler_t) -> libc::sighandler_t;
    /// glibc's `siginterrupt` (the libc crate does not declare it).
    fn siginterrupt(signum: c_int, interrupt: c_int) -> c_int;
}

/// A disposition as text: which handler (`default`, `ignore`, `info`, `plain`, `other`),
/// the flags and the first word of the mask as the kernel reports them.
fn disposition_text(action: &libc::sigaction) -> String {
    let handler = match action.sa_sigaction {
        libc::SIG_DFL => "default",
        libc::SIG_IGN => "ignore",
        h if h == on_fault_info as *const () as usize => "info",
        h if h == on_fault_plain as *const () as usize => "plain",
        _ => "other",
    };
    // SAFETY: a sigset_t is at least 8 bytes; the kernel's set is its first 64 bits.
    let mask = unsafe {
        (&action.sa_mask as *const libc::sigset_t)
            .cast::<u64>()
            .read()
    };
    format!("{handler}/{:#x}/{mask:#x}", action.sa_flags)
}

fn segv_disposition() -> libc::sigaction {
    // SAFETY: plain data, zero is valid; a query into our own struct.
    unsafe {
        let mut action: libc::sigaction = zeroed();
        libc::sigaction(libc::SIGSEGV, null(), &mut action);
        action
    }
}

/// Writes to the wall (outside any call): the fault goes to the application's handler.
fn touch_wall(wall: *mut u8) -> u8 {
    // SAFETY: the wall faults until the handler opens it; the write then succeeds.
    unsafe {
        core::ptr::write_volatile(wall, 7);
        core::ptr::read_volatile(wall)
    }
}

/// A forked child that sets `disposition` for `signal`, then makes that fault: how it ended.
fn child_fault(signal: c_int, disposition: libc::sighandler_t) -> Result<String, String> {
    // SAFETY: plain data, zero is valid.
    let mut action: libc::sigaction = unsafe { zeroed() };
    action.sa_sigaction = disposition;
    child_fault_with(signal, &action)
}

/// A forked child that sets `action` for `signal`, then makes that fault: how it ended.
fn child_fault_with(signal: c_int, action: &libc::sigaction) -> Result<String, String> {
    // SAFETY: the child only sets a disposition, limits its core and faults.
    let pid = unsafe { libc::fork() };
    check(pid as isize, "fork")?;
    if pid == 0 {
        // SAFETY: child: async-signal-safe calls, then the fault; _exit if it survives.
        unsafe {
            let no_core = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            libc::setrlimit(libc::RLIMIT_CORE, &no_core);
            libc::sigaction(signal, action, null_mut());
            if signal == libc::SIGBUS {
                // A page of a file past its end.
                let fd = libc::memfd_create(c"sandirect-conformance".as_ptr(), 0);
                let page = libc::mmap(
                    null_mut(),
                    PAGE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                );
                core::ptr::write_volatile(page.cast::<u8>(), 1);
            } else {
                let wall = libc::mmap(
                    null_mut(),
                    PAGE,
                    libc::PROT_NONE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                core::ptr::write_volatile(wall.cast::<u8>(), 1);
            }
            libc::_exit(0);
        }
    }
    let mut status = 0;
    check(
        // SAFETY: waiting for our child.
        unsafe { libc::waitpid(pid, &mut status, 0) } as isize,
        "waitpid",
    )?;
    Ok(if libc::WIFSIGNALED(status) {
        format!("signal-{}", libc::WTERMSIG(status))
    } else {
        format!("exit-{}", libc::WEXITSTATUS(status))
    })
}

/// The application's fault handlers work as without the preload, after connections switched
/// (and the preload's own handler went in): a setting is reported back exactly as made, a
/// fault outside a socket call reaches the application's handler with its signal
/// information and mask, a fault inside one is EFAULT and never reaches it, the one-shot and
/// BSD forms behave as glibc's, and the default (or an ignored fault) kills as it would.
fn fault_handlers() -> CaseResult {
    let (client, server) = pair()?;
    exchange(&client, &server)?;
    let memory = BadMemory::new()?;
    let wall = memory.wall();
    FAULT_WALL.store(wall as usize, Ordering::SeqCst);
    let original = segv_disposition();
    let runtime = disposition_text(&original);
    // SAFETY: plain data, zero is valid; sigemptyset/sigaddset fill our own set.
    let mut action: libc::sigaction = unsafe { zeroed() };
    action.sa_sigaction = on_fault_info as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO;
    // SAFETY: our own set.
    unsafe {
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaddset(&mut action.sa_mask, libc::SIGUSR1);
    }
    // SAFETY: plain data, zero is valid.
    let mut previous: libc::sigaction = unsafe { zeroed() };
    // SAFETY: our own structs.
    let set = unsafe { libc::sigaction(libc::SIGSEGV, &action, &mut previous) };
    let previous_is_runtime =
        previous.sa_sigaction == original.sa_sigaction && previous.sa_flags == original.sa_flags;
    let reported = segv_disposition();
    let same_restorer =
        reported.sa_restorer.map(|f| f as usize) == original.sa_restorer.map(|f| f as usize);
    // A bad buffer inside a call: EFAULT, and the handler does not run.
    // SAFETY: the call checks the address.
    let send = outcome(unsafe { libc::send(client.raw(), wall.cast(), 100, 0) });
    let handled_in_call = FAULTS.load(Ordering::SeqCst);
    // A fault of the application's own: its handler runs.
    let value = touch_wall(wall);
    let first = format!(
        "faults={} code={} at-wall={} usr1-blocked={} segv-blocked={} value={value}",
        FAULTS.load(Ordering::SeqCst),
        FAULT_CODE.load(Ordering::SeqCst),
        FAULT_AT_WALL.load(Ordering::SeqCst),
        FAULT_BLOCKED_USR1.load(Ordering::SeqCst),
        FAULT_BLOCKED_SEGV.load(Ordering::SeqCst),
    );
    memory.protect_wall(libc::PROT_NONE)?;
    // A SIGSEGV sent, not a fault: the handler runs with the sender's code.
    // SAFETY: raising a signal whose handler just records it.
    unsafe { libc::raise(libc::SIGSEGV) };
    let sent = format!(
        "faults={} code={}",
        FAULTS.load(Ordering::SeqCst),
        FAULT_CODE.load(Ordering::SeqCst)
    );
    // glibc's BSD signal, after siginterrupt.
    // SAFETY: setting dispositions of our own handlers.
    let (interrupt, bsd_previous) = unsafe {
        (
            siginterrupt(libc::SIGSEGV, 1),
            libc::signal(libc::SIGSEGV, on_fault_plain as *const () as usize),
        )
    };
    let bsd = disposition_text(&segv_disposition());
    touch_wall(wall);
    memory.protect_wall(libc::PROT_NONE)?;
    // SAFETY: as above.
    unsafe { siginterrupt(libc::SIGSEGV, 0) };
    let restarting = disposition_text(&segv_disposition());
    // System V's one-shot handler: runs once, then the default is back.
    // SAFETY: as above.
    let sysv_previous = unsafe { sysv_signal(libc::SIGSEGV, on_fault_plain as *const () as usize) };
    let sysv = disposition_text(&segv_disposition());
    touch_wall(wall);
    let after_one_shot = disposition_text(&segv_disposition());
    let faults = FAULTS.load(Ordering::SeqCst);
    // The default and an ignored fault kill, by the same signal (children).
    let default_child = child_fault(libc::SIGSEGV, libc::SIG_DFL)?;
    let ignored_child = child_fault(libc::SIGSEGV, libc::SIG_IGN)?;
    let bus_child = child_fault(libc::SIGBUS, libc::SIG_DFL)?;
    // The Rust runtime's handler (on its alternate stack) resets the default and returns.
    let runtime_child = child_fault_with(libc::SIGSEGV, &original)?;
    // SAFETY: the runtime's disposition back.
    unsafe { libc::sigaction(libc::SIGSEGV, &original, null_mut()) };
    let restored = disposition_text(&segv_disposition());
    write_all(client.raw(), b"still connected")?;
    let still = read_exactly_text(server.raw(), 15)?;
    Ok(format!(
        "runtime {runtime}; set={set} previous-is-runtime={previous_is_runtime} reported {} same-restorer={same_restorer}; bad send {send} handler-runs={handled_in_call}; own fault: {first}; raised: {sent}; siginterrupt={interrupt} signal previous-is-info={} then {bsd}, restarting {restarting}; sysv previous-is-plain={} {sysv} then {after_one_shot}; faults={faults}; children: default {default_child}, ignored {ignored_child}, bus {bus_child}, runtime {runtime_child}; restored {restored}; {still:?}",
        disposition_text(&reported),
        bsd_previous == on_fault_info as *const () as usize,
        sysv_previous == on_fault_plain as *const () as usize,
    ))
}

/// A named case.
type Case = (&'static str, fn() -> CaseResult);

const CASES: &[Case] = &[
    ("bad-fds", bad_fds),
    ("nonblocking-connect", nonblocking_connect),
    ("refused-connect", refused_connect),
    ("half-close", half_close),
    ("reset-by-peer", reset_by_peer),
    ("so-error-and-type", so_error_and_type),
    ("fionread-siocoutq", fionread_siocoutq),
    ("accept4-flags", accept4_flags),
    ("accept-address-buffers", accept_address_buffers),
    ("dup-and-close-order", dup_and_close_order),
    ("dup2-over-tracked", dup2_over_tracked),
    ("epoll-edge-triggered", epoll_edge_triggered),
    (
        "epoll-edge-triggered-read-to-empty",
        epoll_edge_triggered_read_to_empty,
    ),
    ("epoll-remove-and-add-again", epoll_remove_and_add_again),
    ("epoll-output-around-writes", epoll_output_around_writes),
    ("epoll-oneshot", epoll_oneshot),
    ("epoll-rdhup", epoll_rdhup),
    ("epoll-exclusive", epoll_exclusive),
    ("epoll-two-sets-and-nested", epoll_two_sets_and_nested),
    (
        "epoll-level-triggered-after-drain",
        epoll_level_triggered_after_drain,
    ),
    ("poll-and-select", poll_and_select),
    ("poll-and-select-arrivals", poll_and_select_arrivals),
    ("poll-and-select-after-drain", poll_and_select_after_drain),
    ("fortify-poll", fortify_poll),
    ("fortify-poll-overflow", fortify_poll_overflow),
    ("eintr", eintr),
    ("eintr-restart", eintr_restart),
    ("recv-flags", recv_flags),
    ("ipv6-and-v4-mapped", ipv6_and_mapped),
    ("high-fd", high_fd),
    ("sendfile-and-splice", sendfile_and_splice),
    ("sendfile-from-file-position", sendfile_from_file_position),
    ("sendfile-with-offset", sendfile_with_offset),
    (
        "sendfile-nonblocking-until-full",
        sendfile_nonblocking_until_full,
    ),
    ("zero-length-reads", zero_length_reads),
    ("mmsg", mmsg),
    ("fork-and-close-range", fork_and_close_range),
    ("fork-per-connection", fork_per_connection),
    ("fork-and-both-use", fork_and_both_use),
    ("close-then-send", close_then_send),
    ("close-reset-then-send", close_reset_then_send),
    (
        "close-readiness-after-peer-close",
        close_readiness_after_peer_close,
    ),
    ("close-with-unread-data", close_with_unread_data),
    ("close-with-unsent-data", close_with_unsent_data),
    ("close-while-blocked-in-recv", close_while_blocked_in_recv),
    (
        "in-process-select-after-eagain",
        in_process_select_after_eagain,
    ),
    (
        "in-process-partial-nonblocking-reads",
        in_process_partial_nonblocking_reads,
    ),
    ("in-process-write-and-close", in_process_write_and_close),
    ("raw-syscall-io", raw_syscall_io),
    ("stdio-on-socket", stdio_on_socket),
    ("bad-buffers", bad_buffers),
    ("fault-handlers", fault_handlers),
];

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    // SIGPIPE must not kill the suite: writes to closed peers are observed as EPIPE.
    // SAFETY: setting a disposition.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    for (name, case) in CASES
        .iter()
        .filter(|(name, _)| name.contains(filter.as_str()))
    {
        // SAFETY: alarm has no preconditions; SIGALRM's default action ends a hung run.
        unsafe { libc::alarm(20) };
        let line = match case() {
            Ok(observed) => observed,
            Err(problem) => format!("FAILED {problem}"),
        };
        println!("{name}: {line}");
    }
    // SAFETY: cancel the last alarm.
    unsafe { libc::alarm(0) };
}
