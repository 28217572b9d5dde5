//! The fd table: which fds are ours, as one atomic load.
//!
//! Every hook asks "is this fd ours?" before anything else, so the answer for a foreign fd must
//! cost one atomic load and nothing else: no lock, no allocation, no syscall, safe in a signal
//! handler and in a forked child. The table is indexed by fd:
//!
//! * fds below [`PAGE_LEN`] (65536) live in a static page inside the table (`.bss`, untouched
//!   pages cost nothing): **one load**;
//! * larger fds go through a directory of lazily mapped pages: a load of the page pointer
//!   (null ⇒ not ours) and a load of the entry. Pages are `mmap`ed (never `malloc`ed, so
//!   allocation works inside a malloc interposer and in a forked child) only when an fd there
//!   is first *tracked*, never on a lookup, and are never unmapped. fds at or above
//!   [`MAX_TRACKED_FD`] (2^30, far above Linux's default `nr_open`) are never tracked.
//!
//! An entry is a [`FdEntry`]: 0 for "not ours", otherwise a tagged index into the socket
//! registry (or the epoll-instance tag) plus the per-fd close-on-exec bit.

use core::ffi::c_int;
use core::sync::atomic::{AtomicI32, AtomicPtr, AtomicU32, Ordering};

/// Log2 of the number of entries per page.
pub const PAGE_BITS: u32 = 16;
/// Entries per page.
pub const PAGE_LEN: usize = 1 << PAGE_BITS;
const DIRECTORY_LEN: usize = 1 << 14;
/// First fd that is never tracked.
pub const MAX_TRACKED_FD: c_int = (DIRECTORY_LEN * PAGE_LEN) as c_int;

type Page = [AtomicU32; PAGE_LEN];

/// The table entry of one fd. `Copy`, 32 bits, 0 = not ours.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct FdEntry(u32);

impl FdEntry {
    const SOCKET_TAG: u32 = 1 << 31;
    const EPOLL_TAG: u32 = 1 << 30;
    const CLOEXEC: u32 = 1 << 29;
    const INDEX_MASK: u32 = Self::CLOEXEC - 1;
    /// Epoll entries only (they have no index): registered in another epoll instance.
    const NESTED_EPOLL: u32 = 1;
    /// Largest socket index an entry can name.
    pub const MAX_SOCKET_INDEX: u32 = Self::INDEX_MASK - 1;

    /// Not ours.
    pub const NONE: FdEntry = FdEntry(0);

    /// An fd referring to socket object `index` of the registry.
    pub const fn socket(index: u32, cloexec: bool) -> FdEntry {
        let cloexec_bit = if cloexec { Self::CLOEXEC } else { 0 };
        FdEntry(Self::SOCKET_TAG | cloexec_bit | ((index + 1) & Self::INDEX_MASK))
    }

    /// An epoll instance created while preloaded.
    pub const fn epoll(cloexec: bool) -> FdEntry {
        FdEntry(Self::EPOLL_TAG | if cloexec { Self::CLOEXEC } else { 0 })
    }

    /// True for "not ours".
    #[inline(always)]
    pub const fn is_none(self) -> bool {
        self.0 == 0
    }

    /// The registry index, when this fd is one of our sockets.
    #[inline]
    pub const fn socket_index(self) -> Option<u32> {
        if self.0 & Self::SOCKET_TAG != 0 {
            Some((self.0 & Self::INDEX_MASK) - 1)
        } else {
            None
        }
    }

    /// True for a tracked epoll instance.
    pub const fn is_epoll(self) -> bool {
        self.0 & Self::EPOLL_TAG != 0
    }

    /// An epoll instance registered in another epoll instance (its readiness is watched).
    pub const fn is_nested_epoll(self) -> bool {
        self.is_epoll() && self.0 & Self::NESTED_EPOLL != 0
    }

    /// The same epoll entry, marked as registered in another epoll instance.
    pub const fn with_nested_epoll(self) -> FdEntry {
        if self.is_epoll() {
            FdEntry(self.0 | Self::NESTED_EPOLL)
        } else {
            self
        }
    }

    /// The per-fd close-on-exec flag.
    pub const fn cloexec(self) -> bool {
        self.0 & Self::CLOEXEC != 0
    }

    /// The same entry with the close-on-exec flag set to `cloexec`.
    pub const fn with_cloexec(self, cloexec: bool) -> FdEntry {
        if self.is_none() {
            return self;
        }
        if cloexec {
            FdEntry(self.0 | Self::CLOEXEC)
        } else {
            FdEntry(self.0 & !Self::CLOEXEC)
        }
    }
}

/// Why an fd could not be tracked.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum TrackError {
    /// Negative fd or at/above [`MAX_TRACKED_FD`].
    FdOutOfRange,
    /// Mapping a page for a large fd failed (`ENOMEM`).
    NoMemory,
}

/// A lock-free fd → [`FdEntry`] map. The process has one ([`table`]); tests make their own.
pub struct FdTable {
    low: Page,
    directory: [AtomicPtr<Page>; DIRECTORY_LEN],
    /// Highest fd ever tracked (bounds `close_range` and scans).
    high_water: AtomicI32,
}

impl FdTable {
    /// An empty table (usable in a `static`).
    #[allow(clippy::new_without_default)] // a 320 KiB value must not be built by accident
    pub const fn new() -> Self {
        Self {
            low: [const { AtomicU32::new(0) }; PAGE_LEN],
            directory: [const { AtomicPtr::new(core::ptr::null_mut()) }; DIRECTORY_LEN],
            high_water: AtomicI32::new(-1),
        }
    }

    /// The entry of `fd`. The passthrough path: no lock, no allocation, no syscall.
    #[inline(always)]
    pub fn lookup(&self, fd: c_int) -> FdEntry {
        let index = fd as u32 as usize;
        if index < PAGE_LEN {
            return FdEntry(self.low[index].load(Ordering::Acquire));
        }
        self.lookup_high(fd)
    }

    #[inline(never)]
    fn lookup_high(&self, fd: c_int) -> FdEntry {
        match self.existing_cell(fd) {
            Some(cell) => FdEntry(cell.load(Ordering::Acquire)),
            None => FdEntry::NONE,
        }
    }

    fn existing_cell(&self, fd: c_int) -> Option<&AtomicU32> {
        if !(0..MAX_TRACKED_FD).contains(&fd) {
            return None;
        }
        let fd = fd as usize;
        if fd < PAGE_LEN {
            return Some(&self.low[fd]);
        }
        let page = self.directory[fd >> PAGE_BITS].load(Ordering::Acquire);
        // SAFETY: a non-null directory pointer is a fully initialised page that is never unmapped.
        (!page.is_null()).then(|| unsafe { &(*page)[fd & (PAGE_LEN - 1)] })
    }

    fn cell_for_insert(&self, fd: c_int) -> Result<&AtomicU32, TrackError> {
        if let Some(cell) = self.existing_cell(fd) {
            return Ok(cell);
        }
        if !(0..MAX_TRACKED_FD).contains(&fd) {
            return Err(TrackError::FdOutOfRange);
        }
        let slot = &self.directory[fd as usize >> PAGE_BITS];
        let fresh = map_zeroed_page().ok_or(TrackError::NoMemory)?;
        let page = match slot.compare_exchange(
            core::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => fresh,
            Err(winner) => {
                unmap_page(fresh);
                winner
            }
        };
        // SAFETY: `page` is a mapped, zero-initialised (all entries NONE) page, never unmapped.
        Ok(unsafe { &(*page)[fd as usize & (PAGE_LEN - 1)] })
    }

    /// Sets the entry of `fd`, returning the previous one (which the caller must release).
    pub fn replace(&self, fd: c_int, entry: FdEntry) -> Result<FdEntry, TrackError> {
        let cell = self.cell_for_insert(fd)?;
        let previous = FdEntry(cell.swap(entry.0, Ordering::AcqRel));
        self.high_water.fetch_max(fd, Ordering::AcqRel);
        Ok(previous)
    }

    /// Clears the entry of `fd`, returning what it was. Never allocates.
    pub fn take(&self, fd: c_int) -> FdEntry {
        match self.existing_cell(fd) {
            Some(cell) if cell.load(Ordering::Relaxed) != 0 => {
                FdEntry(cell.swap(0, Ordering::AcqRel))
            }
            _ => FdEntry::NONE,
        }
    }

    /// Replaces the entry of `fd` only if it still is `expected` (flag updates racing a close).
    pub fn update(&self, fd: c_int, expected: FdEntry, new: FdEntry) -> bool {
        self.existing_cell(fd).is_some_and(|cell| {
            cell.compare_exchange(expected.0, new.0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        })
    }

    /// Highest fd ever tracked, or -1.
    pub fn high_water(&self) -> c_int {
        self.high_water.load(Ordering::Acquire)
    }

    /// Calls `each(fd, entry)` for every tracked fd in `first..=last`.
    pub fn for_each_in(&self, first: c_int, last: c_int, mut each: impl FnMut(c_int, FdEntry)) {
        let last = last.min(self.high_water());
        let mut fd = first.max(0);
        while fd <= last {
            if fd as usize >= PAGE_LEN
                && self.directory[fd as usize >> PAGE_BITS]
                    .load(Ordering::Acquire)
                    .is_null()
            {
                // Skip a whole unmapped page.
                fd = ((fd as usize >> PAGE_BITS) + 1).saturating_mul(PAGE_LEN) as c_int;
                continue;
            }
            let entry = self.lookup(fd);
            if !entry.is_none() {
                each(fd, entry);
            }
            fd += 1;
        }
    }
}

fn map_zeroed_page() -> Option<*mut Page> {
    // SAFETY: anonymous private mapping; the kernel zero-fills it, and all-zero bytes are a
    // valid `[AtomicU32; PAGE_LEN]` of NONE entries.
    let ptr = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            core::mem::size_of::<Page>(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (ptr != libc::MAP_FAILED).then_some(ptr.cast())
}

fn unmap_page(page: *mut Page) {
    // SAFETY: `page` came from `map_zeroed_page` and was never published.
    unsafe { libc::munmap(page.cast(), core::mem::size_of::<Page>()) };
}

static TABLE: FdTable = FdTable::new();

/// The process's fd table.
#[inline(always)]
pub fn table() -> &'static FdTable {
    &TABLE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_encode_index_tag_and_cloexec() {
        let entry = FdEntry::socket(41, false);
        assert_eq!(entry.socket_index(), Some(41));
        assert!(!entry.cloexec() && !entry.is_epoll() && !entry.is_none());
        let with = entry.with_cloexec(true);
        assert!(with.cloexec());
        assert_eq!(with.socket_index(), Some(41));
        assert_eq!(with.with_cloexec(false), entry);
        assert_eq!(
            FdEntry::socket(FdEntry::MAX_SOCKET_INDEX, true).socket_index(),
            Some(FdEntry::MAX_SOCKET_INDEX)
        );
        assert!(FdEntry::epoll(true).is_epoll());
        assert_eq!(FdEntry::epoll(false).socket_index(), None);
        assert_eq!(FdEntry::NONE.with_cloexec(true), FdEntry::NONE);
    }

    #[test]
    fn low_and_high_fds_round_trip() {
        static T: FdTable = FdTable::new();
        for fd in [0, 3, 65535, 65536, 70000, 1 << 20, MAX_TRACKED_FD - 1] {
            assert!(T.lookup(fd).is_none());
            let entry = FdEntry::socket(fd as u32 % 1000, fd % 2 == 0);
            assert_eq!(T.replace(fd, entry), Ok(FdEntry::NONE));
            assert_eq!(T.lookup(fd), entry, "fd {fd}");
            assert!(T.lookup(fd + 1).is_none() || fd + 1 == 65536);
        }
        assert_eq!(T.high_water(), MAX_TRACKED_FD - 1);
        assert_eq!(T.take(70000), FdEntry::socket(70000 % 1000, true));
        assert!(T.lookup(70000).is_none());
        assert!(T.take(70000).is_none());
    }

    #[test]
    fn out_of_range_fds_are_never_ours() {
        static T: FdTable = FdTable::new();
        assert!(T.lookup(-1).is_none());
        assert!(T.lookup(c_int::MIN).is_none());
        assert!(T.lookup(MAX_TRACKED_FD).is_none());
        assert_eq!(
            T.replace(-5, FdEntry::socket(1, false)),
            Err(TrackError::FdOutOfRange)
        );
        assert_eq!(
            T.replace(MAX_TRACKED_FD, FdEntry::socket(1, false)),
            Err(TrackError::FdOutOfRange)
        );
    }

    #[test]
    fn update_only_when_unchanged() {
        static T: FdTable = FdTable::new();
        let a = FdEntry::socket(1, false);
        T.replace(9, a).unwrap();
        assert!(T.update(9, a, a.with_cloexec(true)));
        assert!(
            !T.update(9, a, FdEntry::NONE),
            "stale expectation must not win"
        );
        assert_eq!(T.lookup(9), a.with_cloexec(true));
    }

    #[test]
    fn for_each_in_visits_only_tracked_fds_in_range() {
        static T: FdTable = FdTable::new();
        for fd in [5, 6, 100, 70_000, 200_000] {
            T.replace(fd, FdEntry::socket(fd as u32, false)).unwrap();
        }
        let mut seen = Vec::new();
        T.for_each_in(6, c_int::MAX, |fd, entry| {
            seen.push((fd, entry.socket_index()))
        });
        assert_eq!(
            seen,
            vec![
                (6, Some(6)),
                (100, Some(100)),
                (70_000, Some(70_000)),
                (200_000, Some(200_000))
            ]
        );
    }

    #[test]
    fn concurrent_inserts_on_a_fresh_page_lose_nothing() {
        static T: FdTable = FdTable::new();
        let base = 5 * PAGE_LEN as c_int;
        std::thread::scope(|scope| {
            for thread in 0..4 {
                scope.spawn(move || {
                    for i in 0..256 {
                        let fd = base + i * 4 + thread;
                        T.replace(fd, FdEntry::socket(fd as u32, false)).unwrap();
                    }
                });
            }
        });
        for fd in base..base + 1024 {
            assert_eq!(T.lookup(fd).socket_index(), Some(fd as u32));
        }
    }
}
