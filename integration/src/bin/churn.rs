//! Concurrency and signal-safety churn: several threads create, dup, dup2, epoll-register and
//! close TCP sockets (and connect/accept real connections) as fast as they can, while a
//! signal fires into them whose handler itself creates and closes a socket, i.e. runs the
//! hooks re-entrantly on top of an interrupted hook. Afterwards every fd is closed again, so
//! the process's published stats must list exactly the one listener still open.
//!
//! Usage: `churn [ROUNDS]` (default 2000 per thread). Prints a summary; exits non-zero on any
//! failed call.

use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use preload_core::record::SocketState;

const THREADS: usize = 4;

static HANDLER_RUNS: AtomicUsize = AtomicUsize::new(0);
static HANDLER_FAILURES: AtomicUsize = AtomicUsize::new(0);
static WORKERS_FINISHED: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_signal(_: c_int) {
    // Only async-signal-safe calls: socket, close, and atomics.
    // SAFETY: plain socket creation and close of our own fd.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 || libc::close(fd) != 0 {
            HANDLER_FAILURES.fetch_add(1, Ordering::Relaxed);
        }
    }
    HANDLER_RUNS.fetch_add(1, Ordering::Relaxed);
}

fn must(rc: c_int, what: &str) -> c_int {
    if rc < 0 {
        eprintln!("churn: {what} failed: {}", std::io::Error::last_os_error());
        std::process::exit(1);
    }
    rc
}

fn tcp_socket() -> c_int {
    // SAFETY: plain socket creation.
    must(
        unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) },
        "socket",
    )
}

fn close(fd: c_int) {
    // SAFETY: closing an fd this program owns.
    must(unsafe { libc::close(fd) }, "close");
}

fn worker(rounds: usize, port: u16) {
    let address = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
        },
        sin_zero: [0; 8],
    };
    for round in 0..rounds {
        let first = tcp_socket();
        let second = tcp_socket();
        // SAFETY: dup family and epoll calls on fds this thread owns.
        unsafe {
            let copy = must(libc::dup(first), "dup");
            let high = must(
                libc::fcntl(first, libc::F_DUPFD_CLOEXEC, 500),
                "F_DUPFD_CLOEXEC",
            );
            must(libc::dup2(first, second), "dup2");
            let epfd = must(libc::epoll_create1(libc::EPOLL_CLOEXEC), "epoll_create1");
            let mut event = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: round as u64,
            };
            must(
                libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, copy, &mut event),
                "epoll_ctl",
            );
            if round % 50 == 0 {
                let len = std::mem::size_of_val(&address) as libc::socklen_t;
                let target = (&address as *const libc::sockaddr_in).cast::<libc::sockaddr>();
                // EINTR from the signal is a legitimate outcome of a blocking connect.
                let rc = libc::connect(high, target, len);
                if rc != 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                    must(rc, "connect");
                }
            }
            for fd in [epfd, high, copy, second, first] {
                close(fd);
            }
        }
    }
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|arg| arg.parse().ok())
        .unwrap_or(2000);
    // NOTE(unwrap): a test program; a failed setup or a panicked thread must end the run
    // loudly (the integration test then sees a non-zero exit), so `expect` is the intent here.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind listener");
    let port = listener.local_addr().expect("local_addr").port();
    listener
        .set_nonblocking(true)
        .expect("nonblocking listener");
    // SAFETY: installing a plain handler (SA_RESTART so the workers' calls mostly resume).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_signal as *const () as usize;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGUSR1, &action, std::ptr::null_mut());
    }
    let done = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..THREADS)
        .map(|_| {
            std::thread::spawn(move || {
                worker(rounds, port);
                WORKERS_FINISHED.fetch_add(1, Ordering::AcqRel);
            })
        })
        .collect();
    // Workers are joined only after the signaller stopped: a pthread_t stays valid for
    // pthread_kill until its thread is joined.
    let targets: Vec<libc::pthread_t> = workers
        .iter()
        .map(std::os::unix::thread::JoinHandleExt::as_pthread_t)
        .collect();
    let signaller = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            while !done.load(Ordering::Acquire) {
                for &target in &targets {
                    // SAFETY: the target threads are not joined before `done` is set.
                    unsafe { libc::pthread_kill(target, libc::SIGUSR1) };
                }
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        })
    };
    // Drain the connections the workers make, closing them at once.
    while WORKERS_FINISHED.load(Ordering::Acquire) < THREADS {
        while let Ok((stream, _)) = listener.accept() {
            drop(stream);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    done.store(true, Ordering::Release);
    signaller.join().expect("signaller panicked");
    for worker in workers {
        worker.join().expect("worker panicked");
    }
    while let Ok((stream, _)) = listener.accept() {
        drop(stream);
    }
    let failures = HANDLER_FAILURES.load(Ordering::Relaxed);
    println!(
        "churn: {THREADS} threads x {rounds} rounds done, handler failures {failures}, signals handled: {}",
        HANDLER_RUNS.load(Ordering::Relaxed) > 0
    );
    match integration::own_published_connections() {
        None => println!("published: none"),
        Some(live) => {
            let listeners = live
                .iter()
                .filter(|c| c.state == SocketState::Listener)
                .count();
            println!(
                "published after churn: {} live, {listeners} listener",
                live.len()
            );
            for c in live.iter().filter(|c| c.state != SocketState::Listener) {
                println!(
                    "  left: fd {} refs {} {:?} flags {:#x} {:?} {:?} {:?}->{:?}",
                    c.fd, c.fd_refs, c.state, c.flags, c.path, c.bypass, c.local, c.peer
                );
            }
        }
    }
    if failures != 0 {
        std::process::exit(1);
    }
}
