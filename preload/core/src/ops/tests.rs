//! Hook behaviour on real kernel sockets: tracking across the socket, descriptor, data and
//! readiness families.

use core::ffi::{c_int, c_uint};
use core::sync::atomic::Ordering;

use libc::socklen_t;

use super::*;
use crate::errno;
use crate::fdtable::table;
use crate::record::{flags, Counter, SocketState};
use crate::registry::registry;
use crate::track::record_of;

fn refs(fd: c_int) -> Option<(u32, u32)> {
    let (index, record) = record_of(table().lookup(fd))?;
    Some((index, record.fd_refs.load(Ordering::Acquire)))
}

fn tcp_socket(extra: c_int) -> c_int {
    // SAFETY: plain socket creation through the op.
    let fd = unsafe { socket(libc::AF_INET, libc::SOCK_STREAM | extra, 0) };
    assert!(fd >= 0);
    fd
}

#[test]
fn dup_family_keeps_one_socket_object_until_the_last_close() {
    let fd = tcp_socket(libc::SOCK_CLOEXEC);
    let entry = table().lookup(fd);
    assert!(entry.cloexec());
    let (index, refs_after_socket) = refs(fd).expect("TCP socket must be tracked");
    assert_eq!(refs_after_socket, 1);
    // SAFETY: dup/fcntl/dup3 on our own fd.
    let (copy, copy2) = unsafe { (dup(fd), fcntl(fd, libc::F_DUPFD_CLOEXEC, 200)) };
    assert!(copy >= 0 && copy2 >= 200);
    assert_eq!(refs(copy), Some((index, 3)));
    assert!(!table().lookup(copy).cloexec(), "dup clears close-on-exec");
    assert!(table().lookup(copy2).cloexec(), "F_DUPFD_CLOEXEC sets it");
    // SAFETY: closing our fds.
    assert_eq!(unsafe { close(fd) }, 0);
    assert!(table().lookup(fd).is_none());
    assert_eq!(
        refs(copy),
        Some((index, 2)),
        "the copies keep the object alive"
    );
    // SAFETY: as above.
    unsafe { close(copy) };
    let record = registry().get(index).unwrap();
    assert_eq!(record.state(), SocketState::TcpCandidate);
    // SAFETY: as above.
    unsafe { close(copy2) };
    assert_eq!(
        record.state(),
        SocketState::Free,
        "last close frees the object"
    );
}

#[test]
fn dup2_onto_a_tracked_fd_releases_the_old_socket() {
    let (a, b) = (tcp_socket(0), tcp_socket(0));
    let (index_a, _) = refs(a).unwrap();
    let (index_b, _) = refs(b).unwrap();
    // SAFETY: our fds.
    assert_eq!(unsafe { dup2(a, b) }, b);
    assert_eq!(refs(b), Some((index_a, 2)));
    assert_eq!(registry().get(index_b).unwrap().state(), SocketState::Free);
    // A foreign fd dup2'ed over a tracked one untracks it.
    let mut pipe = [0; 2];
    // SAFETY: pipe creation.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    // SAFETY: our fds.
    assert_eq!(unsafe { dup3(pipe[0], b, libc::O_CLOEXEC) }, b);
    assert!(table().lookup(b).is_none());
    assert_eq!(refs(a), Some((index_a, 1)));
    // SAFETY: our fds.
    unsafe {
        close(a);
        close(b);
        close(pipe[0]);
        close(pipe[1]);
    }
}

#[test]
fn flags_and_epoll_registrations_are_tracked() {
    let fd = tcp_socket(0);
    let (_, record) = record_of(table().lookup(fd)).unwrap();
    // SAFETY: fcntl/ioctl on our fd with valid arguments.
    unsafe {
        fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK as usize);
        assert_ne!(record.flags() & flags::NONBLOCK, 0);
        let off: c_int = 0;
        ioctl(fd, libc::FIONBIO, &off as *const c_int as usize);
        assert_eq!(record.flags() & flags::NONBLOCK, 0);
        fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC as usize);
    }
    assert!(table().lookup(fd).cloexec());
    // SAFETY: epoll calls with live event structs.
    let epfd = unsafe { epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(table().lookup(epfd).is_epoll());
    let mut event = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 99,
    };
    // SAFETY: as above.
    let added = unsafe { epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut event) };
    assert_eq!(added, 0);
    assert_eq!(
        record.epoll_registrations().collect::<Vec<_>>(),
        vec![(epfd, libc::EPOLLIN as u32, 99)]
    );
    // Closing the epoll instance forgets its registrations.
    // SAFETY: our fd.
    unsafe { close(epfd) };
    assert_eq!(record.epoll_registrations().count(), 0);
    // SAFETY: our fd.
    unsafe { close(fd) };
}

#[test]
fn close_range_untracks_and_cloexec_marks() {
    let fds: Vec<c_int> = (0..3).map(|_| tcp_socket(0)).collect();
    let (low, high) = (*fds.iter().min().unwrap(), *fds.iter().max().unwrap());
    let cloexec_flag = libc::CLOSE_RANGE_CLOEXEC as c_int;
    // SAFETY: marking our own fds close-on-exec.
    let marked = unsafe { close_range(low as c_uint, high as c_uint, cloexec_flag) };
    assert_eq!(marked, 0);
    assert!(fds.iter().all(|&fd| table().lookup(fd).cloexec()));
    for &fd in &fds {
        // SAFETY: closing exactly our own fd (one at a time: other tests own fds between).
        let closed = unsafe { close_range(fd as c_uint, fd as c_uint, 0) };
        assert_eq!(closed, 0);
        assert!(table().lookup(fd).is_none());
    }
    // SAFETY: invalid range: EINVAL, nothing untracked.
    assert_eq!(unsafe { close_range(10, 5, 0) }, -1);
    assert_eq!(errno::get(), libc::EINVAL);
}

#[test]
fn connect_listen_accept_record_roles_addresses_and_bytes() {
    let listener = tcp_socket(0);
    let any = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = core::mem::size_of_val(&any) as socklen_t;
    // SAFETY: valid sockaddr for our socket.
    unsafe {
        assert_eq!(
            bind(listener, (&any as *const libc::sockaddr_in).cast(), len),
            0
        );
        assert_eq!(listen(listener, 4), 0);
    }
    let (_, listening) = record_of(table().lookup(listener)).unwrap();
    assert_eq!(listening.state(), SocketState::Listener);
    let bound = listening.addresses().0.unwrap();
    let client = tcp_socket(0);
    let mut target = any;
    target.sin_port = bound.port().to_be();
    // SAFETY: valid sockaddr; blocking loopback connect.
    let connected = unsafe { connect(client, (&target as *const libc::sockaddr_in).cast(), len) };
    assert_eq!(connected, 0);
    // SAFETY: accept with null address pointers.
    let server = unsafe {
        accept4(
            listener,
            core::ptr::null_mut(),
            core::ptr::null_mut(),
            libc::SOCK_NONBLOCK,
        )
    };
    assert!(server >= 0);
    let (_, client_record) = record_of(table().lookup(client)).unwrap();
    let (_, server_record) = record_of(table().lookup(server)).unwrap();
    assert_eq!(client_record.state(), SocketState::ConnectedTcp);
    assert_ne!(client_record.flags() & flags::CLIENT, 0);
    assert_ne!(server_record.flags() & flags::SERVER, 0);
    assert_ne!(server_record.flags() & flags::NONBLOCK, 0);
    assert_eq!(client_record.addresses().1, Some(bound));
    assert_eq!(server_record.addresses().0, Some(bound));
    assert_eq!(server_record.addresses().1, client_record.addresses().0);
    // SAFETY: valid buffers.
    unsafe {
        assert_eq!(write(client, b"12345".as_ptr().cast(), 5), 5);
        let mut buf = [0u8; 8];
        let mut pfd = libc::pollfd {
            fd: server,
            events: libc::POLLIN,
            revents: 0,
        };
        poll(&mut pfd, 1, 2000);
        assert_eq!(recv(server, buf.as_mut_ptr().cast(), 8, 0), 5);
        assert_eq!(shutdown(client, libc::SHUT_WR), 0);
    }
    assert_eq!(client_record.counter(Counter::TcpSent), 5);
    assert_eq!(server_record.counter(Counter::TcpReceived), 5);
    assert_ne!(client_record.flags() & flags::SHUT_WR, 0);
    // SAFETY: our fds.
    unsafe {
        close(client);
        close(server);
        close(listener);
    }
}

#[test]
fn so_error_settles_a_nonblocking_connect() {
    let loopback = |port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
        },
        sin_zero: [0; 8],
    };
    let so_error = |fd: c_int| {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let mut value: c_int = -1;
        let mut len = core::mem::size_of::<c_int>() as socklen_t;
        // SAFETY: live pollfd and int.
        unsafe {
            poll(&mut pfd, 1, 2000);
            getsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_ERROR,
                (&mut value as *mut c_int).cast(),
                &mut len,
            );
        }
        value
    };
    // Port 1 on loopback refuses: the socket goes back to being a candidate.
    let refused = tcp_socket(libc::SOCK_NONBLOCK);
    let target = loopback(1);
    // SAFETY: valid sockaddr.
    let rc = unsafe { connect(refused, (&target as *const libc::sockaddr_in).cast(), 16) };
    assert_eq!((rc, errno::get()), (-1, libc::EINPROGRESS));
    let (_, record) = record_of(table().lookup(refused)).unwrap();
    assert_eq!(record.state(), SocketState::ConnectedTcp);
    assert_ne!(record.flags() & flags::CONNECTING, 0);
    assert_eq!(so_error(refused), libc::ECONNREFUSED);
    assert_eq!(record.state(), SocketState::TcpCandidate);
    assert_eq!(record.flags() & (flags::CONNECTING | flags::CLIENT), 0);
    // SAFETY: our fd.
    unsafe { close(refused) };
}

#[test]
fn errno_of_the_real_call_survives_bookkeeping() {
    let fd = tcp_socket(0);
    let unreachable = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 1u16.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: valid sockaddr; nothing listens on port 1.
    let rc = unsafe { connect(fd, (&unreachable as *const libc::sockaddr_in).cast(), 16) };
    assert_eq!((rc, errno::get()), (-1, libc::ECONNREFUSED));
    // SAFETY: closing a never-opened fd.
    assert_eq!((unsafe { close(-7) }, errno::get()), (-1, libc::EBADF));
    // SAFETY: our fd.
    unsafe { close(fd) };
}

/// Runs `hook` with the library's work at `site` made to panic once (a bug stand-in): the
/// hook must catch it (counted as an internal fault) and return; unwinding out of a hook into
/// C would abort the host program.
fn with_panic_at(site: &'static str, hook: impl FnOnce() -> c_int) -> c_int {
    use crate::guard::{internal_faults, seam};
    let faults = internal_faults();
    seam::pretend_live(true);
    seam::arm(site);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(hook));
    let fired = !seam::armed();
    seam::arm("");
    seam::pretend_live(false);
    assert!(fired, "the work at {site} did not run");
    let rc = result.unwrap_or_else(|_| panic!("a panic at {site} unwound out of the hook"));
    assert!(
        internal_faults() > faults,
        "the panic at {site} was not counted"
    );
    rc
}

#[test]
fn a_panic_in_readiness_and_process_hooks_gives_the_real_result() {
    let mut ends = [0; 2];
    // SAFETY: pipe writes two descriptors into `ends`.
    let rc = unsafe { libc::pipe(ends.as_mut_ptr()) };
    assert_eq!(rc, 0);
    let [r, w] = ends;
    // SAFETY: writing one byte to our pipe.
    let written = unsafe { libc::write(w, b"x".as_ptr().cast(), 1) };
    assert_eq!(written, 1);
    let mut fds = [libc::pollfd {
        fd: r,
        events: libc::POLLIN,
        revents: 0,
    }];
    let rc = with_panic_at("poll_fds", || {
        // SAFETY: our own array (as for every hook below: our arrays, sets, descriptors).
        unsafe { poll(fds.as_mut_ptr(), 1, 0) }
    });
    assert_eq!((rc, fds[0].fd, fds[0].revents), (1, r, libc::POLLIN));
    let rc = with_panic_at("poll_fds", || {
        // SAFETY: as above.
        unsafe {
            ppoll(
                fds.as_mut_ptr(),
                1,
                &libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                },
                core::ptr::null(),
            )
        }
    });
    assert_eq!(rc, 1);

    // SAFETY: as above.
    let epfd = unsafe { epoll_create1(libc::EPOLL_CLOEXEC) };
    let mut event = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 7,
    };
    // SAFETY: as above.
    let rc = unsafe { epoll_ctl(epfd, libc::EPOLL_CTL_ADD, r, &mut event) };
    assert_eq!(rc, 0);
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 4];
    for site in ["assist_all_in_process", "correct_epoll_events"] {
        let rc = with_panic_at(site, || {
            // SAFETY: as above.
            unsafe { epoll_wait(epfd, events.as_mut_ptr(), 4, 0) }
        });
        assert_eq!((rc, events[0].u64), (1, 7), "{site}");
    }
    // SAFETY: as above.
    let empty = unsafe { epoll_create1(libc::EPOLL_CLOEXEC) };
    let rc = with_panic_at("service_all", || {
        // SAFETY: as above.
        unsafe { epoll_wait(empty, events.as_mut_ptr(), 4, 0) }
    });
    assert_eq!(rc, 0);

    // SAFETY: plain data, zero is valid.
    let mut set: libc::fd_set = unsafe { core::mem::zeroed() };
    let rc = with_panic_at("select_pollfds", || {
        // SAFETY: as above.
        unsafe {
            libc::FD_ZERO(&mut set);
            libc::FD_SET(r, &mut set);
        }
        let mut zero = libc::timeval {
            tv_sec: 0,
            tv_usec: 0,
        };
        // SAFETY: as above.
        unsafe {
            select(
                r + 1,
                &mut set,
                core::ptr::null_mut(),
                core::ptr::null_mut(),
                &mut zero,
            )
        }
    });
    // SAFETY: reading our own set.
    let readable = unsafe { libc::FD_ISSET(r, &set) };
    assert_eq!((rc, readable), (1, true));

    // The child exits at once (it is a copy of this test process).
    let pid = with_panic_at("before_fork", || {
        // SAFETY: as above.
        let pid = unsafe { fork() };
        if pid == 0 {
            // SAFETY: the child leaves at once.
            unsafe { libc::_exit(0) };
        }
        pid
    });
    assert!(pid > 0);
    let mut status = 0;
    // SAFETY: reaping our own child.
    let reaped = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(reaped, pid);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);

    let argv = [c"true".as_ptr().cast_mut(), core::ptr::null_mut()];
    let mut child = 0;
    let rc = with_panic_at("downgrade_all", || {
        // SAFETY: as above; a NULL-terminated argv, no file actions or attributes.
        unsafe {
            posix_spawn(
                &mut child,
                c"/bin/true".as_ptr(),
                core::ptr::null(),
                core::ptr::null(),
                argv.as_ptr(),
                core::ptr::null(),
            )
        }
    });
    assert_eq!(rc, 0);
    // SAFETY: reaping our own child.
    let reaped = unsafe { libc::waitpid(child, &mut status, 0) };
    assert_eq!(reaped, child);
    for fd in [r, w, epfd, empty] {
        // SAFETY: closing our own descriptors.
        unsafe { close(fd) };
    }
}
