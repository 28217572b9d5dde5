//! The readiness mirror, as the application sees it through the kernel: level- and
//! edge-triggered epoll, ONESHOT, EXCLUSIVE, nested epoll, half-close compared with a real TCP
//! connection, peer death, descriptor passing, and two-process stress tests that hunt for lost
//! wake-ups. The "data" and "space" of a session are modelled as counters beside the mirror
//! words in a `MAP_SHARED` mapping, exactly as a segment would hold them.

use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::ops::Deref;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use preload_core::mirror::{
    mirror_peer_fin, raise_readable, raise_writable, recv_fd, send_fd, Mirror, MirrorError,
    MirrorWords, Raise, ReadLowering, WriteLowering,
};

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

/// What a segment would hold for one direction: the mirror words and the session state the
/// mirror must track.
#[repr(C)]
struct Shared {
    words: MirrorWords,
    /// Items in our receive queue.
    data: AtomicU64,
    /// Credits we may send with.
    space: AtomicU64,
    /// Items the sender side has sent (OUT stress).
    sent: AtomicU64,
    /// Odd while the peer is between publishing and raising.
    peer_epoch: AtomicU64,
    /// Set by the peer when it is finished.
    done: AtomicU32,
}

/// A zeroed `MAP_SHARED | MAP_ANONYMOUS` mapping holding a [`Shared`]: shared with children
/// forked after its creation. All-zero atomics are valid initial values.
struct SharedMap(*mut Shared);

impl SharedMap {
    fn new() -> SharedMap {
        // SAFETY: anonymous mapping, no file; checked for failure below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                std::mem::size_of::<Shared>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        SharedMap(ptr.cast())
    }
}

impl Deref for SharedMap {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        // SAFETY: the mapping is page-aligned, zero-filled (valid for atomics) and lives until
        // drop.
        unsafe { &*self.0 }
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; no reference outlives `self`.
        unsafe { libc::munmap(self.0.cast(), std::mem::size_of::<Shared>()) };
    }
}

/// A forked child inherits every descriptor of this multi-threaded test process, including
/// other tests' the raising end ends, which would keep their mirrors from hanging up. Tests that depend on
/// a close being seen hold this for reading; tests that fork hold it for writing.
static FORK_LOCK: RwLock<()> = RwLock::new(());

fn no_fork_now() -> RwLockReadGuard<'static, ()> {
    FORK_LOCK
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn forking() -> RwLockWriteGuard<'static, ()> {
    FORK_LOCK
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Forks; the child runs `body` and exits 0, or 1 if it panicked.
fn fork_child(body: impl FnOnce()) -> libc::pid_t {
    // SAFETY: the child runs only `body` (no locks are held by other threads that it needs:
    // glibc's malloc is fork-safe) and exits with `_exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // A child must not outlive a parent whose assertion failed (it may be waiting for it).
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).is_ok();
        // SAFETY: leaving the child without running the parent's atexit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    pid
}

fn wait_child(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: reaping our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    status
}

fn epoll_create() -> OwnedFd {
    // SAFETY: plain epoll_create1.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fresh descriptor.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn epoll_ctl(epfd: BorrowedFd<'_>, op: i32, fd: RawFd, events: u32) {
    let mut event = libc::epoll_event {
        events,
        u64: fd as u64,
    };
    // SAFETY: valid descriptors and event.
    let rc = unsafe { libc::epoll_ctl(epfd.as_raw_fd(), op, fd, &mut event) };
    assert_eq!(rc, 0, "epoll_ctl: {}", std::io::Error::last_os_error());
}

/// The events of one `epoll_wait`, as `(events, data)` pairs.
fn epoll_wait(epfd: BorrowedFd<'_>, timeout_ms: i32) -> Vec<(u32, u64)> {
    let mut events = [libc::epoll_event { events: 0, u64: 0 }; 8];
    loop {
        // SAFETY: `events` is writable for 8 entries.
        let n = unsafe { libc::epoll_wait(epfd.as_raw_fd(), events.as_mut_ptr(), 8, timeout_ms) };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        assert!(n >= 0, "epoll_wait: {}", std::io::Error::last_os_error());
        return events[..n as usize]
            .iter()
            .map(|e| (e.events, e.u64))
            .collect();
    }
}

fn poll_fd(fd: BorrowedFd<'_>) -> i16 {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    assert!(unsafe { libc::poll(&mut pfd, 1, 0) } >= 0);
    pfd.revents
}

fn readable(fd: BorrowedFd<'_>) -> bool {
    poll_fd(fd) & libc::POLLIN != 0
}

fn writable(fd: BorrowedFd<'_>) -> bool {
    poll_fd(fd) & libc::POLLOUT != 0
}

/// Tiny deterministic PRNG for random pauses (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A random pause: usually none, sometimes a spin, a yield or a short sleep, so the two
    /// processes interleave at many different points.
    fn pause(&mut self) {
        match self.next() % 512 {
            0 => std::thread::sleep(Duration::from_micros(50)),
            1..=15 => std::thread::yield_now(),
            16..=47 => (0..self.next() % 200).for_each(|_| std::hint::spin_loop()),
            _ => {}
        }
    }

    /// A longer pause, for the side that must not outrun the other.
    fn pause_long(&mut self) {
        match self.next() % 64 {
            0 => std::thread::sleep(Duration::from_micros(20)),
            1..=3 => std::thread::yield_now(),
            4..=31 => (0..self.next() % 2_000).for_each(|_| std::hint::spin_loop()),
            _ => {}
        }
    }
}

/// Pushes one item and raises, as a peer does; the epoch brackets the pair.
fn push(shared: &Shared, k: BorrowedFd<'_>) -> Raise {
    shared.peer_epoch.fetch_add(1, Ordering::SeqCst);
    shared.data.fetch_add(1, Ordering::Release);
    let raise = raise_readable(&shared.words, k);
    shared.peer_epoch.fetch_add(1, Ordering::SeqCst);
    raise
}

/// Pops up to `n` items; lowers the mirror once the queue is empty. Returns the lowering, if
/// one was made.
fn pop(shared: &Shared, mirror: &mut Mirror<&MirrorWords>, n: u64) -> Option<ReadLowering> {
    let _ = shared
        .data
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
            Some(d.saturating_sub(n))
        });
    if shared.data.load(Ordering::Acquire) == 0 {
        Some(
            mirror
                .lower_readable(|| shared.data.load(Ordering::Acquire) > 0)
                .unwrap(),
        )
    } else {
        None
    }
}

// ---------------------------------------------------------------------------------------------
// Single process
// ---------------------------------------------------------------------------------------------

#[test]
fn readable_edge_is_raised_once_and_lowered() {
    let words = MirrorWords::new();
    let (mut mirror, k) = Mirror::new(&words).unwrap();
    assert_eq!(
        poll_fd(mirror.as_fd()),
        libc::POLLOUT,
        "fresh mirror: writable only"
    );
    assert_eq!(
        mirror.lower_readable(|| false).unwrap(),
        ReadLowering::NotRaised
    );

    assert_eq!(raise_readable(&words, k.as_fd()), Raise::Raised);
    assert!(readable(mirror.as_fd()));
    assert_eq!(
        raise_readable(&words, k.as_fd()),
        Raise::AlreadyRaised,
        "one token per edge"
    );

    assert_eq!(
        mirror.lower_readable(|| false).unwrap(),
        ReadLowering::Lowered
    );
    assert!(!readable(mirror.as_fd()));
    assert!(!words.is_readable_raised());
    assert_eq!(
        raise_readable(&words, k.as_fd()),
        Raise::Raised,
        "a new edge after lowering"
    );
    assert!(readable(mirror.as_fd()));
}

#[test]
fn lowering_keeps_the_token_when_data_reappears() {
    let words = MirrorWords::new();
    let (mut mirror, k) = Mirror::new(&words).unwrap();
    raise_readable(&words, k.as_fd());
    assert_eq!(
        mirror.lower_readable(|| true).unwrap(),
        ReadLowering::StillReadable
    );
    assert!(readable(mirror.as_fd()));
    assert!(words.is_readable_raised());
    assert_eq!(raise_readable(&words, k.as_fd()), Raise::AlreadyRaised);
    assert_eq!(
        mirror.lower_readable(|| false).unwrap(),
        ReadLowering::Lowered
    );
    assert!(!readable(mirror.as_fd()));
}

#[test]
fn level_triggered_epoll_reports_in_exactly_while_data_is_available() {
    let shared = SharedMap::new();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    let epfd = epoll_create();
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        libc::EPOLLIN as u32,
    );
    let mut rng = Rng(0x1234_5678);
    for step in 0..5_000 {
        if rng.next().is_multiple_of(2) {
            for _ in 0..=rng.next() % 3 {
                push(&shared, k.as_fd());
            }
        } else {
            pop(&shared, &mut mirror, 1 + rng.next() % 3);
        }
        let available = shared.data.load(Ordering::Acquire) > 0;
        let events = epoll_wait(epfd.as_fd(), 0);
        let reported = events.iter().any(|(e, _)| e & libc::EPOLLIN as u32 != 0);
        assert_eq!(
            reported,
            available,
            "step {step}: data {}",
            shared.data.load(Ordering::Relaxed)
        );
    }
}

#[test]
fn edge_triggered_epoll_gives_one_event_per_rising_edge() {
    let shared = SharedMap::new();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    let epfd = epoll_create();
    let events = (libc::EPOLLIN | libc::EPOLLET) as u32;
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        events,
    );

    assert!(epoll_wait(epfd.as_fd(), 0).is_empty());
    for edge in 0..100 {
        push(&shared, k.as_fd());
        push(&shared, k.as_fd());
        assert_eq!(
            epoll_wait(epfd.as_fd(), 0).len(),
            1,
            "edge {edge}: one event"
        );
        assert!(
            epoll_wait(epfd.as_fd(), 0).is_empty(),
            "edge {edge}: reported once"
        );
        push(&shared, k.as_fd());
        assert!(
            epoll_wait(epfd.as_fd(), 0).is_empty(),
            "still readable: no new edge"
        );
        assert_eq!(pop(&shared, &mut mirror, 3), Some(ReadLowering::Lowered));
        assert!(epoll_wait(epfd.as_fd(), 0).is_empty());
    }
}

#[test]
fn edge_per_arrival_gives_an_event_for_every_arrival_while_data_is_unread() {
    let shared = SharedMap::new();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    mirror.set_edge_per_arrival(true);
    assert!(shared.words.is_edge_per_arrival());
    let epfd = epoll_create();
    let events = (libc::EPOLLIN | libc::EPOLLET) as u32;
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        events,
    );
    for round in 0..50 {
        for arrival in 0..3 {
            assert_eq!(push(&shared, k.as_fd()), Raise::Raised);
            assert_eq!(
                epoll_wait(epfd.as_fd(), 0).len(),
                1,
                "round {round}, arrival {arrival}: an event although earlier data is unread"
            );
            assert!(epoll_wait(epfd.as_fd(), 0).is_empty(), "reported once");
        }
        assert_eq!(pop(&shared, &mut mirror, 3), Some(ReadLowering::Lowered));
        assert!(
            !readable(mirror.as_fd()),
            "every token of the round consumed"
        );
        assert!(epoll_wait(epfd.as_fd(), 0).is_empty());
    }
    // Back to one token per rising edge.
    mirror.set_edge_per_arrival(false);
    push(&shared, k.as_fd());
    assert_eq!(push(&shared, k.as_fd()), Raise::AlreadyRaised);
    assert_eq!(epoll_wait(epfd.as_fd(), 0).len(), 1);
    assert_eq!(pop(&shared, &mut mirror, 2), Some(ReadLowering::Lowered));
    assert!(!readable(mirror.as_fd()));
}

#[test]
fn edge_per_arrival_bounds_the_tokens_queued_in_the_mirror() {
    let shared = SharedMap::new();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    mirror.set_edge_per_arrival(true);
    let raised = (0..1_000)
        .filter(|_| push(&shared, k.as_fd()) == Raise::Raised)
        .count();
    assert!(
        (1..1_000).contains(&raised),
        "{raised} tokens for 1000 unread arrivals"
    );
    assert!(readable(mirror.as_fd()));
    // Data still there: the tokens stay.
    assert_eq!(
        mirror.lower_readable(|| true).unwrap(),
        ReadLowering::StillReadable
    );
    assert!(readable(mirror.as_fd()));
    assert_eq!(
        pop(&shared, &mut mirror, 1_000),
        Some(ReadLowering::Lowered)
    );
    assert!(!readable(mirror.as_fd()), "all {raised} tokens consumed");
    assert_eq!(
        push(&shared, k.as_fd()),
        Raise::Raised,
        "a new edge after lowering"
    );
    assert!(readable(mirror.as_fd()));
}

#[test]
fn oneshot_reports_once_until_rearmed() {
    let shared = SharedMap::new();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    let epfd = epoll_create();
    let fd = mirror.as_fd().as_raw_fd();
    let events = (libc::EPOLLIN | libc::EPOLLONESHOT) as u32;
    epoll_ctl(epfd.as_fd(), libc::EPOLL_CTL_ADD, fd, events);
    push(&shared, k.as_fd());
    assert_eq!(epoll_wait(epfd.as_fd(), 0).len(), 1);
    pop(&shared, &mut mirror, 1);
    push(&shared, k.as_fd());
    assert!(readable(mirror.as_fd()));
    assert!(
        epoll_wait(epfd.as_fd(), 0).is_empty(),
        "disarmed after one event"
    );
    epoll_ctl(epfd.as_fd(), libc::EPOLL_CTL_MOD, fd, events);
    assert_eq!(epoll_wait(epfd.as_fd(), 0).len(), 1, "re-armed");
}

#[test]
fn nested_epoll_sees_the_mirror() {
    let shared = SharedMap::new();
    let (mirror, k) = Mirror::new(&shared.words).unwrap();
    let inner = epoll_create();
    let outer = epoll_create();
    epoll_ctl(
        inner.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        libc::EPOLLIN as u32,
    );
    epoll_ctl(
        outer.as_fd(),
        libc::EPOLL_CTL_ADD,
        inner.as_raw_fd(),
        libc::EPOLLIN as u32,
    );
    assert!(epoll_wait(outer.as_fd(), 0).is_empty());
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| epoll_wait(outer.as_fd(), 2_000));
        std::thread::sleep(Duration::from_millis(50));
        push(&shared, k.as_fd());
        let events = waiter.join().unwrap();
        assert_eq!(events.len(), 1, "outer epoll woke for the inner one");
        assert_eq!(events[0].1, inner.as_raw_fd() as u64);
    });
    let inner_events = epoll_wait(inner.as_fd(), 0);
    assert_eq!(
        inner_events,
        vec![(libc::EPOLLIN as u32, mirror.as_fd().as_raw_fd() as u64)]
    );
}

#[test]
fn exclusive_waiters_are_woken() {
    let shared = SharedMap::new();
    let (mirror, k) = Mirror::new(&shared.words).unwrap();
    let epfds = [epoll_create(), epoll_create()];
    let events = (libc::EPOLLIN | libc::EPOLLEXCLUSIVE) as u32;
    for epfd in &epfds {
        epoll_ctl(
            epfd.as_fd(),
            libc::EPOLL_CTL_ADD,
            mirror.as_fd().as_raw_fd(),
            events,
        );
    }
    std::thread::scope(|scope| {
        let waiters: Vec<_> = epfds
            .iter()
            .map(|epfd| {
                scope.spawn(move || {
                    let start = Instant::now();
                    let woke = !epoll_wait(epfd.as_fd(), 1_500).is_empty();
                    (woke, start.elapsed())
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(100));
        push(&shared, k.as_fd());
        let results: Vec<_> = waiters.into_iter().map(|w| w.join().unwrap()).collect();
        let woken = results
            .iter()
            .filter(|(woke, waited)| *woke && *waited < Duration::from_secs(1))
            .count();
        assert!(
            woken >= 1,
            "EPOLLEXCLUSIVE wakes one or more waiters: {results:?}"
        );
    });
}

#[test]
fn writability_is_lowered_and_raised_by_the_peer() {
    let shared = SharedMap::new();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    assert!(writable(mirror.as_fd()));
    assert_eq!(
        mirror.lower_writable(|| false).unwrap(),
        WriteLowering::Lowered
    );
    assert!(!writable(mirror.as_fd()), "filled: not writable");
    let (small, large) = mirror.send_buffer_sizes();
    let filled = mirror.last_fill_bytes();
    println!(
        "SO_SNDBUF lowered {small} B / raised {large} B; {filled} filler bytes made M unwritable"
    );
    assert!(
        filled > 0 && filled <= 2 * small as usize,
        "filler within one send buffer: {filled}"
    );
    assert!(shared.words.is_write_lowered());

    // A waiter blocked for OUT wakes when the peer returns space.
    let epfd = epoll_create();
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        libc::EPOLLOUT as u32,
    );
    assert!(epoll_wait(epfd.as_fd(), 0).is_empty());
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| epoll_wait(epfd.as_fd(), 2_000));
        std::thread::sleep(Duration::from_millis(50));
        shared.space.fetch_add(1, Ordering::Release);
        assert_eq!(raise_writable(&shared.words, k.as_fd()), Raise::Raised);
        assert_eq!(waiter.join().unwrap().len(), 1, "the OUT waiter woke");
    });
    assert!(writable(mirror.as_fd()));
    assert_eq!(
        raise_writable(&shared.words, k.as_fd()),
        Raise::AlreadyRaised
    );
}

fn queued_in(fd: BorrowedFd<'_>) -> usize {
    let mut queued: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut queued) };
    assert_eq!(rc, 0);
    queued as usize
}

#[test]
fn writability_is_raised_locally_when_space_returns_during_lowering() {
    let shared = SharedMap::new();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    let (small, _) = mirror.send_buffer_sizes();
    let epfd = epoll_create();
    let events = (libc::EPOLLOUT | libc::EPOLLET) as u32;
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        events,
    );
    assert_eq!(epoll_wait(epfd.as_fd(), 0).len(), 1, "initially writable");

    for round in 0..50 {
        // Space "returned" between the caller's check and the flag: raised locally at once.
        assert_eq!(
            mirror.lower_writable(|| true).unwrap(),
            WriteLowering::StillWritable
        );
        assert!(writable(mirror.as_fd()), "round {round}");
        assert!(!shared.words.is_write_lowered());
        // A real lowering after a local raise needs no new filler: the parked filler suffices.
        assert_eq!(
            mirror.lower_writable(|| false).unwrap(),
            WriteLowering::Lowered
        );
        assert!(!writable(mirror.as_fd()), "round {round}");
        assert!(
            queued_in(k.as_fd()) <= 2 * small as usize,
            "parked filler stays bounded"
        );
        // An ET waiter gets the local raise as an edge.
        let _ = epoll_wait(epfd.as_fd(), 0);
        assert_eq!(
            mirror.lower_writable(|| true).unwrap(),
            WriteLowering::StillWritable
        );
        assert_eq!(
            epoll_wait(epfd.as_fd(), 0).len(),
            1,
            "round {round}: local raise is an edge"
        );
        assert_eq!(
            mirror.lower_writable(|| false).unwrap(),
            WriteLowering::Lowered
        );
        assert_eq!(raise_writable(&shared.words, k.as_fd()), Raise::Raised);
        assert!(writable(mirror.as_fd()));
        assert_eq!(
            queued_in(k.as_fd()),
            0,
            "the peer's raise drains everything"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Half-close, hang-up, errors
// ---------------------------------------------------------------------------------------------

const SHOWN: i16 = libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR;

/// A connected TCP pair on loopback: (ours, peer's).
fn tcp_pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (theirs, _) = listener.accept().unwrap();
    (ours, theirs)
}

/// Waits for TCP state changes (FIN processing) to settle before sampling readiness.
fn settled_mask(fd: BorrowedFd<'_>) -> i16 {
    std::thread::sleep(Duration::from_millis(20));
    poll_fd(fd) & SHOWN
}

#[test]
fn half_close_and_close_readiness_match_tcp() {
    // Peer's FIN, then ours.
    let words = MirrorWords::new();
    let (mut mirror, k) = Mirror::new(&words).unwrap();
    let (ours, theirs) = tcp_pair();
    theirs.shutdown(std::net::Shutdown::Write).unwrap();
    mirror_peer_fin(k.as_fd()).unwrap();
    let tcp = settled_mask(ours.as_fd());
    assert_eq!(tcp, libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP);
    assert_eq!(poll_fd(mirror.as_fd()) & SHOWN, tcp, "peer FIN");
    ours.shutdown(std::net::Shutdown::Write).unwrap();
    mirror.shutdown_write().unwrap();
    let tcp = settled_mask(ours.as_fd());
    assert_eq!(
        tcp,
        libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP | libc::POLLHUP
    );
    assert_eq!(poll_fd(mirror.as_fd()) & SHOWN, tcp, "both directions shut");

    // Our FIN only, while lowered-writable: TCP reports OUT after SHUT_WR, so must M.
    let words = MirrorWords::new();
    let (mut mirror, _k) = Mirror::new(&words).unwrap();
    let (ours, _theirs) = tcp_pair();
    assert_eq!(
        mirror.lower_writable(|| false).unwrap(),
        WriteLowering::Lowered
    );
    ours.shutdown(std::net::Shutdown::Write).unwrap();
    mirror.shutdown_write().unwrap();
    let tcp = settled_mask(ours.as_fd());
    assert_eq!(tcp, libc::POLLOUT);
    assert_eq!(poll_fd(mirror.as_fd()) & SHOWN, tcp, "our FIN");
    assert_eq!(
        mirror.lower_writable(|| false).unwrap(),
        WriteLowering::Shutdown
    );
    assert!(writable(mirror.as_fd()));

    // A peer FIN learnt from the session, mirrored locally.
    let words = MirrorWords::new();
    let (mut mirror, _k) = Mirror::new(&words).unwrap();
    mirror.set_read_hup().unwrap();
    assert_eq!(
        poll_fd(mirror.as_fd()) & SHOWN,
        libc::POLLIN | libc::POLLOUT | libc::POLLRDHUP
    );
}

#[test]
fn lowering_a_hung_up_mirror_keeps_it_readable() {
    let words = MirrorWords::new();
    let (mut mirror, k) = Mirror::new(&words).unwrap();
    raise_readable(&words, k.as_fd());
    mirror_peer_fin(k.as_fd()).unwrap();
    // The token is still there: it is consumed; end of file keeps M readable.
    assert_eq!(
        mirror.lower_readable(|| false).unwrap(),
        ReadLowering::Lowered
    );
    assert!(readable(mirror.as_fd()));
    // A raise after the peer's FIN cannot reach M (SHUT_WR on K): reported, not hidden.
    assert_eq!(raise_readable(&words, k.as_fd()), Raise::MirrorClosed);
    assert_eq!(
        mirror.lower_readable(|| false).unwrap(),
        ReadLowering::Hangup
    );
    assert!(readable(mirror.as_fd()));
}

#[test]
fn closing_k_with_filler_parked_shows_an_error() {
    let _no_fork = no_fork_now();
    let words = MirrorWords::new();

    let (mirror, k) = Mirror::new(&words).unwrap();
    drop(k);
    let mask = poll_fd(mirror.as_fd()) & SHOWN;
    assert_eq!(
        mask & (libc::POLLIN | libc::POLLRDHUP | libc::POLLHUP),
        libc::POLLIN | libc::POLLRDHUP | libc::POLLHUP
    );
    assert_eq!(mask & libc::POLLERR, 0, "nothing unread in K: no error");

    let words = MirrorWords::new();
    let (mut mirror, k) = Mirror::new(&words).unwrap();
    assert_eq!(
        mirror.lower_writable(|| false).unwrap(),
        WriteLowering::Lowered
    );
    drop(k);
    let mask = poll_fd(mirror.as_fd()) & SHOWN;
    assert_ne!(
        mask & libc::POLLERR,
        0,
        "K closed with unread filler: ECONNRESET on M"
    );
    assert_ne!(mask & libc::POLLHUP, 0);
    assert_eq!(
        mirror.lower_writable(|| false).unwrap(),
        WriteLowering::Hangup
    );
}

#[test]
fn peer_death_hangs_the_mirror_up_within_a_second() {
    let shared = SharedMap::new();
    let _forking = forking();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    let child = fork_child(|| loop {
        // The child holds K (inherited) and pushes nothing.
        std::thread::sleep(Duration::from_secs(1));
    });
    drop(k);
    let epfd = epoll_create();
    let interest = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        interest,
    );
    assert!(
        epoll_wait(epfd.as_fd(), 100).is_empty(),
        "the live peer holds K"
    );

    let killed = Instant::now();
    // SAFETY: killing our own child.
    unsafe { libc::kill(child, libc::SIGKILL) };
    let events = epoll_wait(epfd.as_fd(), 1_000);
    let latency = killed.elapsed();
    wait_child(child);
    assert_eq!(events.len(), 1, "woken by the peer's death");
    let mask = events[0].0;
    let expected = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLHUP) as u32;
    assert_eq!(mask & expected, expected, "mask {mask:#x}");
    assert!(latency < Duration::from_secs(1));
    println!("peer SIGKILL -> mirror HUP in {latency:?}");
    assert_eq!(
        mirror.lower_readable(|| false).unwrap(),
        ReadLowering::NotRaised
    );
}

// ---------------------------------------------------------------------------------------------
// Descriptor passing
// ---------------------------------------------------------------------------------------------

#[test]
fn k_travels_to_the_peer_process_with_scm_rights() {
    let shared = SharedMap::new();
    let _forking = forking();
    let (ours, theirs) = UnixStream::pair().unwrap();
    let child = fork_child(|| {
        let mut buf = [0u8; 8];
        let (n, k) = recv_fd(theirs.as_fd(), &mut buf).unwrap();
        assert_eq!(&buf[..n], b"K");
        let k = k.expect("K arrived");
        // SAFETY: F_GETFD on a descriptor we own.
        let flags = unsafe { libc::fcntl(k.as_raw_fd(), libc::F_GETFD) };
        assert_ne!(flags & libc::FD_CLOEXEC, 0, "received close-on-exec");
        assert_eq!(push(&shared, k.as_fd()), Raise::Raised);
        // Wait for the parent to see it, then exit (closing K).
        let mut ack = [0u8; 1];
        let _ = (&theirs).read(&mut ack);
    });
    drop(theirs);
    // The mirror is created after the fork, so only the passed copy of K exists.
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    assert_eq!(send_fd(ours.as_fd(), k.as_fd(), b"K").unwrap(), 1);
    drop(k);
    let epfd = epoll_create();
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        libc::EPOLLIN as u32,
    );
    assert_eq!(
        epoll_wait(epfd.as_fd(), 2_000).len(),
        1,
        "the peer process raised M"
    );
    assert_eq!(shared.data.load(Ordering::Acquire), 1);
    assert_eq!(pop(&shared, &mut mirror, 1), Some(ReadLowering::Lowered));
    (&ours).write_all(b"!").unwrap();
    assert_eq!(wait_child(child), 0, "child assertions");
    let events = epoll_wait(epfd.as_fd(), 1_000);
    assert_eq!(events.len(), 1);
    assert_ne!(
        events[0].0 & libc::EPOLLHUP as u32,
        0,
        "the peer's exit closed K"
    );
}

#[test]
fn descriptor_passing_edge_cases() {
    let (a, b) = UnixStream::pair().unwrap();
    let words = MirrorWords::new();
    let (_mirror, k) = Mirror::new(&words).unwrap();
    assert_eq!(
        send_fd(a.as_fd(), k.as_fd(), b""),
        Err(MirrorError::EmptyPayload)
    );

    // Plain bytes: no descriptor.
    (&a).write_all(b"xy").unwrap();
    let mut buf = [0u8; 8];
    let (n, fd) = recv_fd(b.as_fd(), &mut buf).unwrap();
    assert_eq!((n, fd.is_none()), (2, true));

    // End of file.
    drop(a);
    let (n, fd) = recv_fd(b.as_fd(), &mut buf).unwrap();
    assert_eq!((n, fd.is_none()), (0, true));
}

/// `sendmsg` with several descriptors in one `SCM_RIGHTS` message (what a hostile or buggy
/// sender could do).
fn send_many_fds(socket: BorrowedFd<'_>, fds: &[RawFd]) {
    #[repr(C, align(8))]
    struct Control([u8; 256]);
    let mut control = Control([0; 256]);
    let data_len = std::mem::size_of_val(fds) as u32;
    // SAFETY: pure size arithmetic.
    let space = unsafe { libc::CMSG_SPACE(data_len) } as usize;
    assert!(space <= control.0.len());
    let payload = [7u8];
    let mut iov = libc::iovec {
        iov_base: payload.as_ptr().cast_mut().cast(),
        iov_len: 1,
    };
    // SAFETY: msghdr is plain data.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one header with room for `fds`.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast(), fds.len());
    }
    // SAFETY: valid message.
    assert_eq!(unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, 0) }, 1);
}

fn hung_up(fd: BorrowedFd<'_>) -> bool {
    poll_fd(fd) & libc::POLLHUP != 0
}

#[test]
fn surplus_and_truncated_descriptors_are_closed() {
    let _no_fork = no_fork_now();
    let (a, b) = UnixStream::pair().unwrap();
    let mut buf = [0u8; 4];

    // Three copies of `x` arrive: one is returned, the other two must be closed, or `y` would
    // never see `x` hang up.
    let (x, y) = UnixStream::pair().unwrap();
    send_many_fds(a.as_fd(), &[x.as_raw_fd(); 3]);
    drop(x);
    let (n, received) = recv_fd(b.as_fd(), &mut buf).unwrap();
    assert_eq!(n, 1);
    let received = received.expect("first descriptor returned");
    assert!(!hung_up(y.as_fd()), "the returned copy keeps x open");
    drop(received);
    assert!(hung_up(y.as_fd()), "surplus copies were closed");

    // More than fit the control buffer: an error, and nothing leaks.
    let (x, y) = UnixStream::pair().unwrap();
    send_many_fds(a.as_fd(), &[x.as_raw_fd(); 12]);
    drop(x);
    assert_eq!(
        recv_fd(b.as_fd(), &mut buf).unwrap_err(),
        MirrorError::AncillaryTruncated
    );
    assert!(hung_up(y.as_fd()), "every received copy was closed");
}

// ---------------------------------------------------------------------------------------------
// Two-process stress
// ---------------------------------------------------------------------------------------------

#[test]
fn stress_readable_never_loses_a_wakeup() {
    stress_readable(false);
}

#[test]
fn stress_readable_with_an_edge_per_arrival_never_loses_a_wakeup_or_leaks_a_token() {
    stress_readable(true);
}

/// Two processes: a producer pushing and raising at random pace, a consumer waiting in epoll
/// (level-triggered) and popping at random; `edge_per_arrival` makes the producer write a
/// token on every push.
fn stress_readable(edge_per_arrival: bool) {
    const PUSHES: u64 = 200_000;
    let shared = SharedMap::new();
    let _forking = forking();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    mirror.set_edge_per_arrival(edge_per_arrival);
    let child = fork_child(|| {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..PUSHES {
            push(&shared, k.as_fd());
            // Slower than the consumer on average, so the queue empties and the mirror is
            // lowered and raised again all the time.
            rng.pause_long();
        }
        shared.done.store(1, Ordering::SeqCst);
    });
    drop(k);
    let epfd = epoll_create();
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        libc::EPOLLIN as u32,
    );
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    let (mut wakeups, mut checks) = (0u64, 0u64);
    let mut lowerings = std::collections::HashMap::<String, u64>::new();
    let started = Instant::now();
    loop {
        if shared.done.load(Ordering::SeqCst) == 1 && shared.data.load(Ordering::Acquire) == 0 {
            break;
        }
        let events = epoll_wait(epfd.as_fd(), 2_000);
        if events.is_empty() {
            let data = shared.data.load(Ordering::Acquire);
            assert_eq!(
                data, 0,
                "lost wake-up: {data} items available, epoll_wait timed out"
            );
            continue;
        }
        wakeups += 1;
        if let Some(lowering) = pop(&shared, &mut mirror, 1 + rng.next() % 8) {
            *lowerings.entry(format!("{lowering:?}")).or_default() += 1;
        }
        // Once the producer is quiet (its epoch unchanged and even around our sample), data
        // available must mean M readable.
        let before = shared.peer_epoch.load(Ordering::SeqCst);
        let available = shared.data.load(Ordering::SeqCst) > 0;
        let is_readable = readable(mirror.as_fd());
        let after = shared.peer_epoch.load(Ordering::SeqCst);
        if before == after && before.is_multiple_of(2) {
            checks += 1;
            assert!(
                !available || is_readable,
                "data available but M not readable"
            );
        }
        rng.pause();
    }
    assert_eq!(wait_child(child), 0);
    // Every token written was claimed and consumed: with the queue empty, M holds nothing
    // (it is readable only because the producer's exit closed K).
    let last = mirror.lower_readable(|| false).unwrap();
    assert!(
        matches!(last, ReadLowering::NotRaised | ReadLowering::Lowered),
        "{last:?}"
    );
    assert_eq!(queued_in(mirror.as_fd()), 0, "a token leaked into M");
    assert!(!shared.words.is_readable_raised());
    println!(
        "IN stress (edge per arrival: {edge_per_arrival}): {PUSHES} pushes in {:?}, \
         {wakeups} wake-ups, {checks} quiet checks, lowerings {lowerings:?}",
        started.elapsed()
    );
    assert!(checks > 0);
}

#[test]
fn stress_writable_never_loses_a_wakeup() {
    const SENDS: u64 = 50_000;
    const WINDOW: u64 = 4;
    let shared = SharedMap::new();
    shared.space.store(WINDOW, Ordering::SeqCst);
    let _forking = forking();
    let (mut mirror, k) = Mirror::new(&shared.words).unwrap();
    // The peer consumes what we send and returns one credit per item.
    let child = fork_child(|| {
        let mut rng = Rng(0x0123_4567_89ab_cdef);
        let mut received = 0;
        while received < SENDS {
            if shared.sent.load(Ordering::Acquire) > received {
                received += 1;
                shared.peer_epoch.fetch_add(1, Ordering::SeqCst);
                shared.space.fetch_add(1, Ordering::Release);
                raise_writable(&shared.words, k.as_fd());
                shared.peer_epoch.fetch_add(1, Ordering::SeqCst);
            } else {
                std::thread::yield_now();
            }
            rng.pause_long();
        }
    });
    drop(k);
    let epfd = epoll_create();
    epoll_ctl(
        epfd.as_fd(),
        libc::EPOLL_CTL_ADD,
        mirror.as_fd().as_raw_fd(),
        libc::EPOLLOUT as u32,
    );
    let mut rng = Rng(0xfeed_face_0bad_f00d);
    let (mut sent, mut waits, mut checks, mut spurious) = (0u64, 0u64, 0u64, 0u64);
    let mut lowerings = std::collections::HashMap::<String, u64>::new();
    let started = Instant::now();
    while sent < SENDS {
        let took = shared
            .space
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| s.checked_sub(1))
            .is_ok();
        if took {
            sent += 1;
            shared.sent.store(sent, Ordering::Release);
        } else {
            let lowering = mirror
                .lower_writable(|| shared.space.load(Ordering::Acquire) > 0)
                .unwrap();
            *lowerings.entry(format!("{lowering:?}")).or_default() += 1;
            if lowering == WriteLowering::Lowered {
                waits += 1;
                let events = epoll_wait(epfd.as_fd(), 2_000);
                let space = shared.space.load(Ordering::Acquire);
                assert!(
                    !events.is_empty() || space == 0,
                    "lost wake-up: space {space}, no OUT"
                );
                if space == 0 {
                    spurious += 1;
                }
            }
        }
        let before = shared.peer_epoch.load(Ordering::SeqCst);
        let space = shared.space.load(Ordering::SeqCst) > 0;
        let is_writable = writable(mirror.as_fd());
        let after = shared.peer_epoch.load(Ordering::SeqCst);
        if before == after && before.is_multiple_of(2) && space {
            checks += 1;
            assert!(is_writable, "space available but M not writable");
        }
        rng.pause();
    }
    assert_eq!(wait_child(child), 0);
    println!(
        "OUT stress: {SENDS} sends, window {WINDOW}, in {:?}: {waits} waits ({spurious} without space), {checks} quiet \
         checks, lowerings {lowerings:?}",
        started.elapsed()
    );
}

// ---------------------------------------------------------------------------------------------
// Cost
// ---------------------------------------------------------------------------------------------

#[test]
fn cost_of_raise_and_lower() {
    const ROUNDS: u32 = 20_000;
    let words = MirrorWords::new();
    let (mut mirror, k) = Mirror::new(&words).unwrap();

    let start = Instant::now();
    for _ in 0..ROUNDS {
        assert_eq!(raise_readable(&words, k.as_fd()), Raise::Raised);
        assert_eq!(
            mirror.lower_readable(|| false).unwrap(),
            ReadLowering::Lowered
        );
    }
    let readable_pair = start.elapsed() / ROUNDS;

    raise_readable(&words, k.as_fd());
    let start = Instant::now();
    for _ in 0..ROUNDS {
        assert_eq!(raise_readable(&words, k.as_fd()), Raise::AlreadyRaised);
    }
    let raised_noop = start.elapsed() / ROUNDS;

    let start = Instant::now();
    for _ in 0..ROUNDS {
        assert_eq!(
            mirror.lower_writable(|| false).unwrap(),
            WriteLowering::Lowered
        );
        assert_eq!(raise_writable(&words, k.as_fd()), Raise::Raised);
    }
    let writable_pair = start.elapsed() / ROUNDS;
    println!(
        "mirror cost ({} build, single process): raise+lower readable {readable_pair:?}, \
         raise when already up {raised_noop:?}, lower+raise writable {writable_pair:?}",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
}
