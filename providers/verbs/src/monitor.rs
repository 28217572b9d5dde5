//! The memory-change monitor: learns, before the changing call returns, that the mapping
//! under a registered range changed, so that a cached memory region (which pins the *old*
//! pages) is never used for the new memory at the same virtual address.
//!
//! ## Mechanism: userfaultfd non-cooperative events
//! One userfaultfd per process (a VMA can belong to one userfaultfd context only), created
//! with `UFFD_USER_MODE_ONLY` (so `vm.unprivileged_userfaultfd = 0` does not stop a
//! non-root process; we never resolve faults, so the restriction costs nothing) and the
//! features `EVENT_UNMAP | EVENT_REMAP | EVENT_REMOVE`. Every range is registered with the
//! userfaultfd (`UFFDIO_REGISTER`, write-protect mode) *before* it is pinned. From then on the
//! kernel reports, for that VMA:
//!
//! * `UNMAP`: munmap, `mmap(MAP_FIXED)` over it, brk shrinking (`sbrk(-n)`, glibc's heap
//!   trim), and glibc's internal `munmap` of a large chunk in `free()`;
//! * `REMAP`: mremap moving or shrinking it (the old range is reported);
//! * `REMOVE`: `madvise(MADV_DONTNEED | MADV_FREE | MADV_REMOVE)`, including glibc's
//!   `shrink_heap` of non-main arenas.
//!
//! These are in-kernel hooks, so they see every caller: the PLT, raw `syscall`, and glibc's
//! internal calls alike. The kernel makes the changing thread **wait until the event is
//! read** (`userfaultfd_event_wait_completion`), and the service thread here reads events
//! only while holding the state lock and queues every changed range before releasing it.
//! Hence: once munmap/mremap/madvise/brk has returned, any thread that takes the lock (every
//! `Monitor::take` and `Monitor::overlaps_pending`) sees the change. No window.
//!
//! Write-protect mode is chosen because the monitor never write-protects a page: no fault is
//! ever delivered, so application threads never block on us for a fault (MISSING mode would
//! deliver the first touch after `MADV_DONTNEED` to us, and with `UFFD_USER_MODE_ONLY` a
//! kernel-mode touch, e.g. `read(2)` into the buffer, would fail with EFAULT).
//!
//! ## Why the service thread never allocates
//! glibc trims heaps while holding an arena lock, and the trimming thread waits for our read.
//! If the service thread then called `malloc` it could need that very arena lock: deadlock.
//! So between `poll` and the end of the read loop it touches only the stack and fixed-size
//! per-subscriber queues; a full queue degrades to "everything changed" (still correct).
//! Subscribing (a domain opening) allocates, but on the application's thread.
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use san_api::MemRange;

/// Ranges queued per subscriber before it degrades to "everything changed".
const QUEUE_CAPACITY: usize = 128;
/// Events read per `read(2)`.
const READ_BATCH: usize = 32;

// <linux/userfaultfd.h> (stable UAPI; not in the libc crate).
const UFFD_API: u64 = 0xaa;
const UFFD_USER_MODE_ONLY: libc::c_int = 1;
const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
const UFFD_EVENT_REMAP: u8 = 0x14;
const UFFD_EVENT_REMOVE: u8 = 0x15;
const UFFD_EVENT_UNMAP: u8 = 0x16;
/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)`.
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
/// `_IOWR(0xAA, 0x06, struct uffdio_writeprotect)`.
const UFFDIO_WRITEPROTECT: libc::c_ulong = 0xc018_aa06;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct uffd_msg`: 32 bytes, the event code first, then a 24-byte union that for every
/// event we read starts with three `u64` (unmap/remove: start, end; remap: from, to, len;
/// pagefault: flags, address, feat).
#[repr(C)]
#[derive(Clone, Copy)]
struct UffdMsg {
    event: u8,
    reserved1: u8,
    reserved2: u16,
    reserved3: u32,
    arg: [u64; 3],
}

const _: () = assert!(std::mem::size_of::<UffdMsg>() == 32);

/// Why the monitor is not running: every registration is then unmonitored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MonitorUnavailable {
    /// `userfaultfd(2)` failed with this errno (ENOSYS: kernel built without it; EPERM:
    /// neither `UFFD_USER_MODE_ONLY` nor privilege).
    NoUserfaultfd(i32),
    /// The kernel lacks the unmap/remap/remove events (older than 4.11).
    EventsUnsupported(i32),
    /// The service thread could not be started.
    NoThread,
}

impl std::fmt::Display for MonitorUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoUserfaultfd(errno) => write!(f, "userfaultfd unavailable (errno {errno})"),
            Self::EventsUnsupported(errno) => {
                write!(
                    f,
                    "userfaultfd lacks unmap/remap/remove events (errno {errno})"
                )
            }
            Self::NoThread => f.write_str("cannot start the memory-monitor thread"),
        }
    }
}

impl std::error::Error for MonitorUnavailable {}

/// The mapping changes one subscriber has not collected yet.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryChanges {
    ranges: Vec<MemRange>,
    everything: bool,
}

impl MemoryChanges {
    /// The whole address space.
    pub const EVERYTHING: MemRange = MemRange::new(0, u64::MAX);

    /// True if no mapping under a watched range changed.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty() && !self.everything
    }

    /// The changed ranges (page-granular); a single [`Self::EVERYTHING`] when more changes
    /// arrived than the queue holds. Invalidate each one.
    pub fn ranges(&self) -> &[MemRange] {
        if self.everything {
            std::slice::from_ref(&Self::EVERYTHING)
        } else {
            &self.ranges
        }
    }
}

/// A fixed-capacity queue of changed ranges (filled by the service thread: no allocation).
struct PendingQueue {
    ranges: [MemRange; QUEUE_CAPACITY],
    len: usize,
    overflowed: bool,
}

impl PendingQueue {
    fn new() -> Self {
        Self {
            ranges: [MemRange::new(0, 0); QUEUE_CAPACITY],
            len: 0,
            overflowed: false,
        }
    }

    fn push(&mut self, range: MemRange) {
        if self.overflowed {
            return;
        }
        // Extending the last range keeps page-by-page trims from filling the queue.
        if let Some(last) = self.len.checked_sub(1).map(|i| &mut self.ranges[i]) {
            if last.end() == range.addr {
                last.len += range.len;
                return;
            }
        }
        match self.ranges.get_mut(self.len) {
            Some(slot) => {
                *slot = range;
                self.len += 1;
            }
            None => self.overflowed = true,
        }
    }

    fn overlaps(&self, range: &MemRange) -> bool {
        self.overflowed || self.ranges[..self.len].iter().any(|r| r.overlaps(range))
    }

    fn take(&mut self) -> MemoryChanges {
        let changes = MemoryChanges {
            ranges: self.ranges[..self.len].to_vec(),
            everything: self.overflowed,
        };
        self.len = 0;
        self.overflowed = false;
        changes
    }
}

/// Identifies one subscriber (a domain) of the process-wide monitor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SubscriberId(u64);

#[derive(Default)]
struct State {
    subscribers: Vec<(SubscriberId, Box<PendingQueue>)>,
    next_id: u64,
    /// Events seen, by kind (diagnostics; the tests use them to prove the path is taken).
    events: EventCounts,
}

/// How many events of each kind the monitor has read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EventCounts {
    /// munmap, mmap(MAP_FIXED) over a watched range, brk shrinking.
    pub unmaps: u64,
    /// mremap of a watched range.
    pub remaps: u64,
    /// madvise(MADV_DONTNEED / MADV_FREE / MADV_REMOVE).
    pub removes: u64,
    /// Write-protect faults (never expected: the monitor protects nothing; each is
    /// resolved at once by un-protecting and waking).
    pub faults: u64,
}

impl State {
    /// Queues `range` for every subscriber. Never allocates (see the module docs).
    fn changed(&mut self, range: MemRange) {
        for (_, queue) in &mut self.subscribers {
            queue.push(range);
        }
    }
}

struct Shared {
    state: Mutex<State>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every mutation is a plain store into the queues: a panic cannot leave them torn.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The process-wide monitor (one userfaultfd, one service thread, started on first use and
/// kept for the life of the process).
pub(crate) struct Monitor {
    uffd: OwnedFd,
    shared: Arc<Shared>,
}

/// How a range is covered after [`Monitor::watch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Coverage {
    /// Every change to its mapping is reported.
    Watched,
    /// The kernel refused to register it (file-backed or shared memory, a hole, or a VMA
    /// already registered with another userfaultfd): changes are not reported.
    Unwatched(i32),
}

impl Monitor {
    /// The process-wide monitor, started on first call.
    pub(crate) fn get() -> Result<&'static Monitor, MonitorUnavailable> {
        static MONITOR: OnceLock<Result<Monitor, MonitorUnavailable>> = OnceLock::new();
        MONITOR.get_or_init(Monitor::start).as_ref().map_err(|e| *e)
    }

    fn start() -> Result<Self, MonitorUnavailable> {
        let uffd = open_userfaultfd()?;
        let mut api = UffdioApi {
            api: UFFD_API,
            features: UFFD_FEATURE_EVENT_UNMAP
                | UFFD_FEATURE_EVENT_REMAP
                | UFFD_FEATURE_EVENT_REMOVE,
            ioctls: 0,
        };
        // SAFETY: a live userfaultfd and a properly laid-out `uffdio_api` the kernel fills.
        if unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, &mut api) } != 0 {
            return Err(MonitorUnavailable::EventsUnsupported(crate::sys::errno()));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
        });
        let thread_fd = uffd.as_raw_fd();
        let thread_shared = Arc::clone(&shared);
        // The thread and the fd live as long as the process (the monitor is a static).
        std::thread::Builder::new()
            .name("sandirect-memmon".into())
            .spawn(move || serve(thread_fd, &thread_shared))
            .map_err(|_| MonitorUnavailable::NoThread)?;
        Ok(Self { uffd, shared })
    }

    /// A new subscriber with an empty queue.
    pub(crate) fn subscribe(&self) -> SubscriberId {
        let queue = Box::new(PendingQueue::new());
        let mut state = self.shared.lock();
        state.next_id += 1;
        let id = SubscriberId(state.next_id);
        state.subscribers.push((id, queue));
        id
    }

    pub(crate) fn unsubscribe(&self, id: SubscriberId) {
        let removed = {
            let mut state = self.shared.lock();
            let index = state.subscribers.iter().position(|(s, _)| *s == id);
            index.map(|i| state.subscribers.swap_remove(i))
        };
        drop(removed); // freed outside the lock
    }

    /// Registers `range` (rounded out to pages) with the userfaultfd. Call before pinning.
    pub(crate) fn watch(&self, range: MemRange) -> Coverage {
        let Some(pages) = page_span(range) else {
            return Coverage::Unwatched(libc::EINVAL);
        };
        let mut register = UffdioRegister {
            range: pages,
            mode: UFFDIO_REGISTER_MODE_WP,
            ioctls: 0,
        };
        // SAFETY: a live userfaultfd and a properly laid-out `uffdio_register`; registering
        // only attaches the context to the VMAs (no page is protected, nothing is touched).
        if unsafe { libc::ioctl(self.uffd.as_raw_fd(), UFFDIO_REGISTER, &mut register) } == 0 {
            Coverage::Watched
        } else {
            Coverage::Unwatched(crate::sys::errno())
        }
    }

    /// Collects (and clears) the changes queued for `id`.
    pub(crate) fn take(&self, id: SubscriberId) -> MemoryChanges {
        let mut state = self.shared.lock();
        state
            .subscribers
            .iter_mut()
            .find(|(s, _)| *s == id)
            .map(|(_, queue)| queue.take())
            .unwrap_or_default()
    }

    /// True if a change not yet collected by `id` overlaps `range`.
    pub(crate) fn overlaps_pending(&self, id: SubscriberId, range: &MemRange) -> bool {
        let state = self.shared.lock();
        state
            .subscribers
            .iter()
            .any(|(s, queue)| *s == id && queue.overlaps(range))
    }

    pub(crate) fn event_counts(&self) -> EventCounts {
        self.shared.lock().events
    }
}

fn open_userfaultfd() -> Result<OwnedFd, MonitorUnavailable> {
    let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
    // SAFETY: userfaultfd(2) takes flags and returns a new fd or -1.
    let mut fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags | UFFD_USER_MODE_ONLY) };
    if fd < 0 && crate::sys::errno() == libc::EINVAL {
        // Kernels before 5.11 do not know UFFD_USER_MODE_ONLY.
        // SAFETY: as above.
        fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
    }
    let fd = i32::try_from(fd).map_err(|_| MonitorUnavailable::NoUserfaultfd(libc::EBADF))?;
    if fd < 0 {
        return Err(MonitorUnavailable::NoUserfaultfd(crate::sys::errno()));
    }
    // SAFETY: a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `range` rounded out to whole pages, or `None` if it is empty or wraps.
fn page_span(range: MemRange) -> Option<UffdioRange> {
    let page = page_size();
    let end = range.addr.checked_add(range.len)?.checked_add(page - 1)? & !(page - 1);
    let start = range.addr & !(page - 1);
    (range.len > 0).then_some(UffdioRange {
        start,
        len: end - start,
    })
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .unwrap_or(4096)
}

/// The range a message says changed, if any.
fn changed_range(msg: &UffdMsg) -> Option<MemRange> {
    let [a, b, c] = msg.arg;
    match msg.event {
        UFFD_EVENT_UNMAP | UFFD_EVENT_REMOVE => (b > a).then(|| MemRange::new(a, b - a)),
        // The old range: the pages moved away from it (to `b`, where no registration
        // names them). A shrinking mremap reports the cut-off tail the same way.
        UFFD_EVENT_REMAP => (c > 0).then(|| MemRange::new(a, c)),
        _ => None,
    }
}

/// The service thread: waits for events and queues them. Runs for the life of the process
/// (the fd is never closed). Never allocates (see the module docs).
fn serve(uffd: i32, shared: &Shared) {
    let mut batch = [UffdMsg {
        event: 0,
        reserved1: 0,
        reserved2: 0,
        reserved3: 0,
        arg: [0; 3],
    }; READ_BATCH];
    loop {
        let mut pollfd = libc::pollfd {
            fd: uffd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; infinite timeout.
        if unsafe { libc::poll(&mut pollfd, 1, -1) } < 0 {
            continue; // EINTR
        }
        let mut state = shared.lock();
        loop {
            // SAFETY: `batch` is writable for its whole size; the kernel writes whole
            // messages only.
            let got = unsafe {
                libc::read(
                    uffd,
                    batch.as_mut_ptr().cast(),
                    std::mem::size_of_val(&batch),
                )
            };
            let Ok(bytes) = usize::try_from(got) else {
                let err = io::Error::last_os_error().raw_os_error();
                if err == Some(libc::EINTR) {
                    continue;
                }
                break; // EAGAIN: drained
            };
            let count = bytes / std::mem::size_of::<UffdMsg>();
            for msg in &batch[..count] {
                match msg.event {
                    UFFD_EVENT_UNMAP => state.events.unmaps += 1,
                    UFFD_EVENT_REMAP => state.events.remaps += 1,
                    UFFD_EVENT_REMOVE => state.events.removes += 1,
                    UFFD_EVENT_PAGEFAULT => {
                        state.events.faults += 1;
                        unprotect(uffd, msg.arg[1]);
                    }
                    _ => {}
                }
                if let Some(range) = changed_range(msg) {
                    state.changed(range);
                }
            }
            if count < READ_BATCH {
                break;
            }
        }
    }
}

/// Clears write protection on the page at `address` and wakes its waiters (a safety net:
/// nothing here protects pages, so this should never run).
fn unprotect(uffd: i32, address: u64) {
    let page = page_size();
    let mut wp = UffdioWriteprotect {
        range: UffdioRange {
            start: address & !(page - 1),
            len: page,
        },
        mode: 0,
    };
    // SAFETY: a live userfaultfd and a properly laid-out `uffdio_writeprotect`.
    unsafe { libc::ioctl(uffd, UFFDIO_WRITEPROTECT, &mut wp) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_degrades_to_everything_and_take_resets_it() {
        let mut queue = PendingQueue::new();
        for i in 0..QUEUE_CAPACITY as u64 {
            queue.push(MemRange::new(i * 0x10000, 0x1000)); // gaps: no merging
        }
        assert!(!queue.overflowed);
        assert!(!queue.overlaps(&MemRange::new(0x2000, 0x1000)), "in a gap");
        queue.push(MemRange::new(1 << 40, 0x1000));
        assert!(
            queue.overlaps(&MemRange::new(0x2000, 0x1000)),
            "overflow covers all"
        );
        let changes = queue.take();
        assert_eq!(changes.ranges(), &[MemoryChanges::EVERYTHING]);
        assert!(queue.take().is_empty());
    }

    #[test]
    fn adjacent_changes_merge_and_others_stay_apart() {
        let mut queue = PendingQueue::new();
        queue.push(MemRange::new(0x1000, 0x1000));
        queue.push(MemRange::new(0x2000, 0x3000));
        queue.push(MemRange::new(0x9000, 0x1000));
        assert_eq!(
            queue.take().ranges(),
            &[MemRange::new(0x1000, 0x4000), MemRange::new(0x9000, 0x1000)]
        );
    }

    #[test]
    fn messages_map_to_the_old_range() {
        let msg = |event, arg| UffdMsg {
            event,
            reserved1: 0,
            reserved2: 0,
            reserved3: 0,
            arg,
        };
        assert_eq!(
            changed_range(&msg(UFFD_EVENT_UNMAP, [0x1000, 0x3000, 0])),
            Some(MemRange::new(0x1000, 0x2000))
        );
        assert_eq!(
            changed_range(&msg(UFFD_EVENT_REMAP, [0x1000, 0x8000, 0x2000])),
            Some(MemRange::new(0x1000, 0x2000))
        );
        assert_eq!(
            changed_range(&msg(UFFD_EVENT_REMOVE, [0x3000, 0x1000, 0])),
            None
        );
        assert_eq!(
            changed_range(&msg(UFFD_EVENT_PAGEFAULT, [0, 0x1000, 0])),
            None
        );
    }

    #[test]
    fn page_span_rounds_out_and_refuses_empty_or_wrapping_ranges() {
        let page = page_size();
        let span = page_span(MemRange::new(page + 1, 2)).expect("span");
        assert_eq!((span.start, span.len), (page, page));
        let span = page_span(MemRange::new(page - 1, 2)).expect("span");
        assert_eq!((span.start, span.len), (0, 2 * page));
        assert!(page_span(MemRange::new(page, 0)).is_none());
        assert!(page_span(MemRange::new(u64::MAX - 1, 2)).is_none());
    }

    /// An anonymous private mapping of `len` bytes, touched.
    fn map(len: usize) -> u64 {
        // SAFETY: a fresh anonymous mapping; nothing else refers to it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        // SAFETY: just mapped, writable, `len` bytes.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0x5a, len) };
        ptr as u64
    }

    fn covers(changes: &MemoryChanges, range: MemRange) -> bool {
        changes.ranges().iter().any(|r| r.contains(&range))
    }

    /// Real userfaultfd on the host kernel: every cause is reported by the time the call
    /// returns, to every subscriber, and unwatched memory is not reported.
    #[test]
    fn every_mapping_change_is_reported_before_the_call_returns() {
        let monitor = match Monitor::get() {
            Ok(monitor) => monitor,
            Err(why) => {
                eprintln!("skipped: {why}");
                return;
            }
        };
        let (first, second) = (monitor.subscribe(), monitor.subscribe());
        let len = 64 << 10;
        let page = page_size();

        // munmap
        let addr = map(len);
        let range = MemRange::new(addr + 100, 1000);
        assert_eq!(monitor.watch(range), Coverage::Watched);
        assert!(monitor.take(first).is_empty(), "watching changes nothing");
        // SAFETY: our mapping.
        assert_eq!(unsafe { libc::munmap(addr as *mut _, len) }, 0);
        assert!(
            monitor.overlaps_pending(first, &range),
            "seen as soon as munmap returned"
        );
        assert!(covers(&monitor.take(first), range));
        assert!(
            covers(&monitor.take(second), range),
            "every subscriber hears it"
        );
        assert!(!monitor.overlaps_pending(first, &range), "collected once");

        // madvise DONTNEED and FREE: the mapping stays, the pages go
        for advice in [libc::MADV_DONTNEED, libc::MADV_FREE] {
            let addr = map(len);
            let range = MemRange::new(addr, len as u64);
            assert_eq!(monitor.watch(range), Coverage::Watched);
            // SAFETY: our mapping.
            let status = unsafe { libc::madvise(addr as *mut _, page as usize, advice) };
            assert_eq!(status, 0);
            let changes = monitor.take(first);
            assert!(
                covers(&changes, MemRange::new(addr, page)),
                "advice {advice}"
            );
            // SAFETY: our mapping; the next page is still watched and mapped.
            unsafe { *((addr + page) as *mut u8) = 1 };
            assert!(
                monitor.take(first).is_empty(),
                "touching memory is no change"
            );
            // SAFETY: our mapping.
            assert_eq!(unsafe { libc::munmap(addr as *mut _, len) }, 0);
        }

        // mremap moving the buffer: the old range is reported
        let addr = map(len);
        let range = MemRange::new(addr, len as u64);
        assert_eq!(monitor.watch(range), Coverage::Watched);
        // SAFETY: our mapping; MAYMOVE to a place the kernel chooses (growing forces a move
        // unless the next pages happen to be free, which the assertion below tolerates).
        let moved = unsafe { libc::mremap(addr as *mut _, len, 4 * len, libc::MREMAP_MAYMOVE) };
        assert_ne!(moved, libc::MAP_FAILED);
        let changes = monitor.take(first);
        if moved as u64 != addr {
            assert!(covers(&changes, range), "moved away: old range reported");
        }
        // SAFETY: the (possibly moved) mapping is ours.
        assert_eq!(unsafe { libc::munmap(moved, 4 * len) }, 0);
        monitor.take(first);

        // glibc free() of a large (mmapped) chunk unmaps it internally
        let big = 8 << 20; // above any dynamic mmap threshold reached by this test
                           // SAFETY: malloc/free pair; the block is touched through its own pointer only.
        unsafe {
            let block = libc::malloc(big);
            assert!(!block.is_null());
            std::ptr::write_bytes(block.cast::<u8>(), 1, big);
            let range = MemRange::new(block as u64, big as u64);
            assert_eq!(monitor.watch(range), Coverage::Watched);
            libc::free(block);
            assert!(covers(
                &monitor.take(first),
                MemRange::new(block as u64 + page, page)
            ));
        }

        // unwatched memory is not reported; a file-backed mapping cannot be watched
        let addr = map(len);
        // SAFETY: our mapping.
        assert_eq!(unsafe { libc::munmap(addr as *mut _, len) }, 0);
        assert!(!monitor.overlaps_pending(first, &MemRange::new(addr, len as u64)));
        let file = std::fs::File::open("/proc/self/exe").expect("own executable");
        // SAFETY: a fresh read-only private file mapping.
        let mapped = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(mapped, libc::MAP_FAILED);
        assert!(matches!(
            monitor.watch(MemRange::new(mapped as u64, 4096)),
            Coverage::Unwatched(_)
        ));
        // SAFETY: our mapping.
        unsafe { libc::munmap(mapped, 4096) };

        assert_eq!(
            monitor.event_counts().faults,
            0,
            "nothing is ever protected"
        );
        monitor.unsubscribe(first);
        monitor.unsubscribe(second);
    }
}
