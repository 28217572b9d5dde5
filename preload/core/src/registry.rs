//! The socket registry: where socket records live, and how they are published.
//!
//! Records are allocated in chunks of [`CHUNK_RECORDS`]. When publication is possible the
//! chunks are `MAP_SHARED` windows of one per-process file, `/dev/shm/sandirect-$UID/$PID`
//! (directory overridable with `SANDIRECT_STAT_DIR`, `off` disables publication): the records
//! *are* the published statistics, so `sandirect stat` sees live state without any extra
//! copy. Otherwise chunks are anonymous memory and nothing is published.
//!
//! File layout ([`FileHeader`] in the first 4 KiB, then chunk `k` at
//! `HEADER_BYTES + k * CHUNK_BYTES`). Readers skip files whose pid is dead or whose recorded
//! start time differs from the live process's (pid reuse).
//!
//! **The directory is held open** ([`StatsDir`]): opened once per program image (not
//! following a symbolic link), checked through the descriptor, and every later file operation
//! (create, reopen to grow, the fork child's own file, the removal at exit) is relative to it.
//! Whoever may rename the directory away and put another one, or a symbolic link, at its path
//! (an override in a place others can write) cannot make this process create, replace or
//! remove a file anywhere else.
//!
//! Everything here is lock-free and allocation-free (syscalls only), because records are
//! claimed from hooks, possibly before our constructor ran or in a forked child. Chunk memory
//! is never unmapped, so a record reference stays valid forever (a reused record is told apart
//! by its `generation`).

use core::ffi::c_int;
use core::sync::atomic::{AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};

use crate::record::{flags, Bypass, SocketRecord, SocketState};
use crate::{errno, real};

/// Records per chunk.
pub const CHUNK_RECORDS: usize = 1024;
/// Bytes per chunk.
pub const CHUNK_BYTES: usize = CHUNK_RECORDS * core::mem::size_of::<SocketRecord>();
/// Most chunks a process may have (1 Mi sockets).
pub const MAX_CHUNKS: usize = 1024;
/// Bytes reserved for the header at the start of the file.
pub const HEADER_BYTES: usize = 4096;
/// `FileHeader::magic`.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SANDIR01");
/// `FileHeader::version`.
pub const VERSION: u32 = 1;
/// How long a thread waits for another one to finish [`Registry`] initialisation before its
/// socket goes untracked.
const INIT_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
/// Yields before that wait turns to short sleeps.
const INIT_YIELDS: u32 = 1000;

/// The start of a stats file.
#[repr(C)]
pub struct FileHeader {
    /// [`MAGIC`].
    pub magic: u64,
    /// [`VERSION`].
    pub version: u32,
    /// `size_of::<SocketRecord>()`.
    pub record_size: u32,
    /// The owning process.
    pub pid: AtomicU32,
    /// [`CHUNK_RECORDS`].
    pub chunk_records: u32,
    /// The owner's start time in clock ticks since boot (`/proc/PID/stat` field 22).
    pub start_time: AtomicU64,
    /// Number of chunks whose file range is allocated.
    pub chunks: AtomicU32,
}

const INIT_NONE: u32 = 0;
const INIT_BUSY: u32 = 1;
const INIT_FILE: u32 = 2;
const INIT_ANON: u32 = 3;

/// The process's records.
pub struct Registry {
    init: AtomicU32,
    header: AtomicPtr<FileHeader>,
    chunks: [AtomicPtr<SocketRecord>; MAX_CHUNKS],
    claim_hint: AtomicU32,
    /// One past the highest index ever claimed: scans stop there.
    claimed_end: AtomicU32,
    untracked: AtomicU64,
}

static REGISTRY: Registry = Registry::new();

/// The process's registry.
pub fn registry() -> &'static Registry {
    &REGISTRY
}

/// A record index plus the record.
pub type Claimed = (u32, &'static SocketRecord);

impl Registry {
    const fn new() -> Self {
        Self {
            init: AtomicU32::new(INIT_NONE),
            header: AtomicPtr::new(core::ptr::null_mut()),
            chunks: [const { AtomicPtr::new(core::ptr::null_mut()) }; MAX_CHUNKS],
            claim_hint: AtomicU32::new(0),
            claimed_end: AtomicU32::new(0),
            untracked: AtomicU64::new(0),
        }
    }

    /// The record at `index`, if its chunk is mapped.
    #[inline]
    pub fn get(&'static self, index: u32) -> Option<&'static SocketRecord> {
        let index = index as usize;
        let chunk = self
            .chunks
            .get(index / CHUNK_RECORDS)?
            .load(Ordering::Acquire);
        // SAFETY: a published chunk is CHUNK_RECORDS initialised records, never unmapped.
        (!chunk.is_null()).then(|| unsafe { &*chunk.add(index % CHUNK_RECORDS) })
    }

    /// Sockets that could not be tracked (registry full or out of memory).
    pub fn untracked(&self) -> u64 {
        self.untracked.load(Ordering::Relaxed)
    }

    /// True when records are published in a stats file.
    pub fn is_published(&self) -> bool {
        self.init.load(Ordering::Acquire) == INIT_FILE
    }

    /// Claims a free record for a socket first seen on `fd`, in state `state`.
    pub fn claim(&'static self, fd: c_int, state: SocketState) -> Option<Claimed> {
        let _errno = errno::Preserved::save();
        if !self.ensure_init() {
            self.untracked.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let start = self.claim_hint.load(Ordering::Relaxed) as usize;
        for _round in 0..=MAX_CHUNKS {
            let capacity = self.mapped_chunks() * CHUNK_RECORDS;
            for offset in 0..capacity {
                let index = ((start + offset) % capacity) as u32;
                let Some(record) = self.get(index) else {
                    continue;
                };
                if record
                    .state
                    .compare_exchange(
                        SocketState::Free as u32,
                        SocketState::Claiming as u32,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
                {
                    record.reset();
                    record.generation.fetch_add(1, Ordering::Relaxed);
                    record.fd.store(fd, Ordering::Relaxed);
                    record.fd_refs.store(1, Ordering::Relaxed);
                    record.set_state(state);
                    self.claim_hint.store(index + 1, Ordering::Relaxed);
                    self.claimed_end.fetch_max(index + 1, Ordering::AcqRel);
                    return Some((index, record));
                }
            }
            if !self.grow() {
                break;
            }
        }
        self.untracked.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Adds one fd reference (a dup).
    pub fn add_ref(&'static self, index: u32) {
        if let Some(record) = self.get(index) {
            record.fd_refs.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Drops one fd reference; the last one frees the record. Returns true when freed.
    pub fn release(&'static self, index: u32) -> bool {
        let Some(record) = self.get(index) else {
            return false;
        };
        let previous = record
            .fd_refs
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |refs| {
                refs.checked_sub(1)
            });
        if previous == Ok(1) {
            record.set_state(SocketState::Free);
            return true;
        }
        false
    }

    /// Calls `each(index, record)` for every live record.
    pub fn for_each_live(&'static self, mut each: impl FnMut(u32, &'static SocketRecord)) {
        for index in 0..self.claimed_end.load(Ordering::Acquire) {
            if let Some(record) = self.get(index) {
                if !matches!(record.state(), SocketState::Free | SocketState::Claiming) {
                    each(index, record);
                }
            }
        }
    }

    fn mapped_chunks(&self) -> usize {
        self.chunks
            .iter()
            .take_while(|chunk| !chunk.load(Ordering::Acquire).is_null())
            .count()
    }

    /// Sets up the backing on first use. Bounded wait if another thread is doing it.
    fn ensure_init(&'static self) -> bool {
        // Another thread may be creating the stats file (the first sockets of a program
        // that connects from several threads at once). That is a few file-system calls,
        // which a fixed number of yields did not outlast under emulation: a thread gave up
        // and its connection went untracked, plain TCP. Wait by time instead, yielding
        // first, then sleeping briefly; bounded, so a stuck creator costs one socket.
        let mut since: Option<std::time::Instant> = None;
        for round in 0u32.. {
            match self.init.compare_exchange(
                INIT_NONE,
                INIT_BUSY,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    let backing = if self.init_file() {
                        INIT_FILE
                    } else {
                        INIT_ANON
                    };
                    self.init.store(backing, Ordering::Release);
                    return true;
                }
                Err(INIT_BUSY) => {
                    let started = *since.get_or_insert_with(std::time::Instant::now);
                    if started.elapsed() >= INIT_WAIT {
                        return false;
                    }
                    if round < INIT_YIELDS {
                        // SAFETY: sched_yield has no preconditions.
                        unsafe { libc::sched_yield() };
                    } else {
                        std::thread::sleep(std::time::Duration::from_micros(200));
                    }
                }
                Err(_) => return true,
            }
        }
        false
    }

    fn init_file(&self) -> bool {
        let Some(dir) = StatsDir::open_configured() else {
            return false;
        };
        let Some(fd) = dir.create_file(own_pid()) else {
            dir.close();
            return false;
        };
        // SAFETY: fd is our fresh file; the header range must exist before it is touched.
        let allocated = unsafe { libc::fallocate(fd, 0, 0, HEADER_BYTES as libc::off_t) } == 0;
        let header = if allocated {
            map_file(fd, 0, HEADER_BYTES)
        } else {
            None
        };
        let ok = header.is_some_and(|header| {
            let header = header.cast::<FileHeader>();
            // SAFETY: freshly mapped, zero-filled, page-aligned and large enough.
            unsafe {
                (*header).magic = MAGIC;
                (*header).version = VERSION;
                (*header).record_size = core::mem::size_of::<SocketRecord>() as u32;
                (*header).chunk_records = CHUNK_RECORDS as u32;
                (*header).pid.store(own_pid() as u32, Ordering::Relaxed);
                (*header)
                    .start_time
                    .store(own_start_time(), Ordering::Relaxed);
            }
            self.header.store(header, Ordering::Release);
            true
        });
        if ok {
            self.map_chunk_from(fd, 0);
        }
        // SAFETY: closing the fd we opened; the mappings stay.
        unsafe { real::close(fd) };
        if ok {
            dir.keep();
        } else {
            dir.remove_file(own_pid());
            dir.close();
        }
        ok
    }

    /// Maps the next chunk (file-backed if publishing, else anonymous). False when full.
    fn grow(&'static self) -> bool {
        let next = self.mapped_chunks();
        if next >= MAX_CHUNKS {
            return false;
        }
        if self.is_published() {
            if let Some(fd) = StatsDir::kept().and_then(|dir| dir.open_file(own_pid())) {
                self.map_chunk_from(fd, next);
                // SAFETY: our own fd.
                unsafe { real::close(fd) };
            }
        }
        if self.chunks[next].load(Ordering::Acquire).is_null() {
            if let Some(chunk) = map_anonymous(CHUNK_BYTES) {
                self.publish_chunk(next, chunk.cast());
            }
        }
        !self.chunks[next].load(Ordering::Acquire).is_null()
    }

    fn map_chunk_from(&self, fd: c_int, index: usize) {
        let offset = HEADER_BYTES + index * CHUNK_BYTES;
        // fallocate only ever extends, so concurrent growers cannot shrink each other's range.
        // SAFETY: fd is an open regular file.
        if unsafe { libc::fallocate(fd, 0, offset as libc::off_t, CHUNK_BYTES as libc::off_t) } != 0
        {
            return;
        }
        if let Some(chunk) = map_file(fd, offset, CHUNK_BYTES) {
            if self.publish_chunk(index, chunk.cast()) {
                let header = self.header.load(Ordering::Acquire);
                if !header.is_null() {
                    // SAFETY: the header mapping is never unmapped.
                    unsafe {
                        (*header)
                            .chunks
                            .fetch_max(index as u32 + 1, Ordering::AcqRel)
                    };
                }
            }
        }
    }

    /// Installs a zero-filled chunk; a losing racer unmaps its own. True if ours won.
    fn publish_chunk(&self, index: usize, chunk: *mut SocketRecord) -> bool {
        let won = self.chunks[index]
            .compare_exchange(
                core::ptr::null_mut(),
                chunk,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if !won {
            // SAFETY: `chunk` was mapped by the caller and never published.
            unsafe { libc::munmap(chunk.cast(), CHUNK_BYTES) };
        }
        won
    }

    /// Fork child: move the published mappings to a file of the child's own, mark every live
    /// record inherited, and downgrade SAN sockets (a SAN session cannot be shared between two
    /// processes; the kernel anchor can). Async-signal-safe (syscalls and atomics only).
    pub fn after_fork_in_child(&'static self) {
        // A thread that was setting up the backing does not exist in the child: whatever it
        // left half-done is abandoned and the child continues unpublished.
        let _ =
            self.init
                .compare_exchange(INIT_BUSY, INIT_ANON, Ordering::AcqRel, Ordering::Acquire);
        if self.is_published() && !self.republish_for_child() {
            self.init.store(INIT_ANON, Ordering::Release);
        }
        self.for_each_live(|_, record| {
            record.set_flag(flags::INHERITED, true);
            if record.state() == SocketState::San {
                record
                    .bypass
                    .store(Bypass::AfterFork as u32, Ordering::Release);
                record.set_state(SocketState::ConnectedTcp);
            }
        });
    }

    fn republish_for_child(&'static self) -> bool {
        // The parent's directory, through the descriptor the child inherited.
        let Some(dir) = StatsDir::kept() else {
            return self.privatize_all();
        };
        let Some(fd) = dir.create_file(own_pid()) else {
            return self.privatize_all();
        };
        let chunks = self.mapped_chunks();
        let total = HEADER_BYTES + chunks * CHUNK_BYTES;
        // SAFETY: fd is our fresh file.
        let mut ok = unsafe { libc::fallocate(fd, 0, 0, total as libc::off_t) } == 0;
        let header = self.header.load(Ordering::Acquire);
        if ok && !header.is_null() {
            ok = move_mapping(header.cast(), HEADER_BYTES, Some((fd, 0)));
        }
        for index in 0..chunks {
            let chunk = self.chunks[index].load(Ordering::Acquire);
            ok = ok
                && move_mapping(
                    chunk.cast(),
                    CHUNK_BYTES,
                    Some((fd, HEADER_BYTES + index * CHUNK_BYTES)),
                );
        }
        // SAFETY: our own fd.
        unsafe { real::close(fd) };
        if !ok {
            dir.remove_file(own_pid());
            return self.privatize_all();
        }
        if !header.is_null() {
            // SAFETY: the header is mapped (now from the child's file).
            unsafe {
                (*header).pid.store(own_pid() as u32, Ordering::Relaxed);
                (*header)
                    .start_time
                    .store(own_start_time(), Ordering::Relaxed);
            }
        }
        true
    }

    /// Replaces every shared mapping by a private copy (publication stops). False if any failed.
    fn privatize_all(&'static self) -> bool {
        let header = self.header.load(Ordering::Acquire);
        if !header.is_null() {
            move_mapping(header.cast(), HEADER_BYTES, None);
        }
        for index in 0..self.mapped_chunks() {
            move_mapping(
                self.chunks[index].load(Ordering::Acquire).cast(),
                CHUNK_BYTES,
                None,
            );
        }
        false
    }

    /// At exit: remove our stats file (only the process that owns it).
    pub fn unpublish_at_exit(&self) {
        let header = self.header.load(Ordering::Acquire);
        if !self.is_published() || header.is_null() {
            return;
        }
        // SAFETY: the header mapping is never unmapped.
        let owner = unsafe { (*header).pid.load(Ordering::Relaxed) };
        if owner != own_pid() as u32 {
            return;
        }
        if let Some(dir) = StatsDir::kept() {
            dir.remove_file(own_pid());
        }
    }
}

/// Copies `len` bytes at `addr` into a new mapping (of `file` at an offset, or anonymous) and
/// moves that mapping over `addr` atomically with `mremap`, so every pointer stays valid.
fn move_mapping(addr: *mut u8, len: usize, file: Option<(c_int, usize)>) -> bool {
    let fresh = match file {
        Some((fd, offset)) => map_file(fd, offset, len),
        None => map_anonymous(len),
    };
    let Some(fresh) = fresh else { return false };
    // SAFETY: both ranges are `len` bytes of distinct live mappings.
    unsafe { core::ptr::copy_nonoverlapping(addr, fresh, len) };
    // SAFETY: MREMAP_FIXED replaces the old range at `addr` with the fresh pages.
    let moved = unsafe {
        libc::mremap(
            fresh.cast(),
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            addr,
        )
    };
    if moved == libc::MAP_FAILED {
        // SAFETY: the fresh mapping is still ours.
        unsafe { libc::munmap(fresh.cast(), len) };
        return false;
    }
    true
}

fn map_file(fd: c_int, offset: usize, len: usize) -> Option<*mut u8> {
    // SAFETY: shared mapping of a file range we allocated.
    let ptr = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            offset as libc::off_t,
        )
    };
    (ptr != libc::MAP_FAILED).then_some(ptr.cast())
}

fn map_anonymous(len: usize) -> Option<*mut u8> {
    // SAFETY: anonymous private zero-filled mapping.
    let ptr = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    (ptr != libc::MAP_FAILED).then_some(ptr.cast())
}

fn own_pid() -> c_int {
    // SAFETY: getpid has no preconditions (and, since glibc 2.25, no cache to go stale).
    unsafe { libc::getpid() }
}

/// A fixed-capacity, NUL-terminated path built without allocating.
pub struct PathBuf {
    bytes: [u8; 256],
    len: usize,
}

impl PathBuf {
    /// Empty.
    pub fn new() -> Self {
        Self {
            bytes: [0; 256],
            len: 0,
        }
    }

    /// Appends bytes; false if they do not fit (with the NUL).
    pub fn push(&mut self, part: &[u8]) -> bool {
        if self.len + part.len() >= self.bytes.len() || part.contains(&0) {
            return false;
        }
        self.bytes[self.len..self.len + part.len()].copy_from_slice(part);
        self.len += part.len();
        self.bytes[self.len] = 0;
        true
    }

    /// Appends a decimal number.
    pub fn push_decimal(&mut self, mut value: u64) -> bool {
        let mut digits = [0u8; 20];
        let mut start = digits.len();
        loop {
            start -= 1;
            digits[start] = b'0' + (value % 10) as u8;
            value /= 10;
            if value == 0 {
                break;
            }
        }
        self.push(&digits[start..])
    }

    /// The C string.
    pub fn as_ptr(&self) -> *const libc::c_char {
        self.bytes.as_ptr().cast()
    }

    /// The bytes without the NUL.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

impl Default for PathBuf {
    fn default() -> Self {
        Self::new()
    }
}

/// Builds the configured stats directory's path into `path` (`SANDIRECT_STAT_DIR`, or
/// `/dev/shm/sandirect-$UID`). False when publication is off or the path does not fit.
fn stats_dir_path(path: &mut PathBuf) -> bool {
    let custom =
        if crate::settings::honoured(crate::settings::STAT_DIR, crate::settings::privileged()) {
            // SAFETY: getenv with a NUL-terminated name; the result is only read, right away.
            unsafe { libc::getenv(crate::settings::STAT_DIR_C.as_ptr()) }
        } else {
            core::ptr::null_mut()
        };
    if custom.is_null() {
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        path.push(b"/dev/shm/sandirect-") && path.push_decimal(u64::from(uid))
    } else {
        // SAFETY: getenv returned a NUL-terminated string.
        let bytes = unsafe { core::ffi::CStr::from_ptr(custom) }.to_bytes();
        bytes != b"off" && !bytes.is_empty() && path.push(bytes)
    }
}

/// The stats directory's descriptor (-1: not open), kept for the process's lifetime (a
/// forked child uses the one it inherited), and the directory's device and inode.
static KEPT_DIR: AtomicI32 = AtomicI32::new(-1);
static KEPT_DEV: AtomicU64 = AtomicU64::new(0);
static KEPT_INO: AtomicU64 = AtomicU64::new(0);

/// The stats directory, held open: checked once through its descriptor, then every stats
/// file is created, reopened and removed relative to it (see the module's "The directory is
/// held open"). Syscalls only: usable from hooks and in a fork child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatsDir {
    fd: c_int,
    identity: (u64, u64),
}

impl StatsDir {
    /// Opens the configured directory ([`StatsDir::open`]); `None` when publication is off.
    fn open_configured() -> Option<StatsDir> {
        let mut path = PathBuf::new();
        if !stats_dir_path(&mut path) {
            return None;
        }
        StatsDir::open(&path)
    }

    /// Opens the directory at `path`, creating it (0700) if missing, and checks the open
    /// directory (`fstat`): not a symbolic link (`O_NOFOLLOW`), a directory, owned by our real
    /// uid (another user could have created it first: never publish into it), writable by
    /// nobody else. The descriptor goes above the application's numbers (close-on-exec). The
    /// caller owns it.
    pub fn open(path: &PathBuf) -> Option<StatsDir> {
        // SAFETY: NUL-terminated path; mkdir fails harmlessly if it exists.
        unsafe { libc::mkdir(path.as_ptr(), 0o700) };
        // SAFETY: NUL-terminated path.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return None;
        }
        let fd = relocate_high(fd);
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        match identity_of(fd) {
            Some((st_mode, st_uid, identity))
                if st_mode & libc::S_IFMT == libc::S_IFDIR
                    && st_uid == uid
                    && st_mode & 0o022 == 0 =>
            {
                Some(StatsDir { fd, identity })
            }
            _ => {
                // SAFETY: the descriptor opened above, ours.
                unsafe { real::close(fd) };
                None
            }
        }
    }

    /// Closes the descriptor (a directory not kept).
    pub fn close(self) {
        // SAFETY: the descriptor this value owns; not used after.
        unsafe { real::close(self.fd) };
    }

    /// Keeps this directory as the process's stats directory (for [`StatsDir::kept`]).
    fn keep(self) {
        KEPT_DEV.store(self.identity.0, Ordering::Relaxed);
        KEPT_INO.store(self.identity.1, Ordering::Relaxed);
        KEPT_DIR.store(self.fd, Ordering::Release);
    }

    /// The process's stats directory, if one was kept and its descriptor still is that
    /// directory (a program that closed it and reused the number is not written through).
    fn kept() -> Option<StatsDir> {
        let fd = KEPT_DIR.load(Ordering::Acquire);
        if fd < 0 {
            return None;
        }
        let kept = StatsDir {
            fd,
            identity: (
                KEPT_DEV.load(Ordering::Relaxed),
                KEPT_INO.load(Ordering::Relaxed),
            ),
        };
        kept.is_intact().then_some(kept)
    }

    /// Whether the descriptor still is the directory that was checked.
    pub fn is_intact(&self) -> bool {
        identity_of(self.fd).is_some_and(|(_, _, identity)| identity == self.identity)
    }

    /// The descriptor.
    pub fn fd(&self) -> c_int {
        self.fd
    }

    /// Creates the stats file of process `pid`, fresh (a stale file of a dead process with
    /// that pid, or of our pre-exec image, is removed first). The caller owns the descriptor.
    pub fn create_file(&self, pid: c_int) -> Option<c_int> {
        let name = file_name(pid)?;
        if !self.is_intact() {
            return None;
        }
        // SAFETY: NUL-terminated name relative to our directory descriptor.
        unsafe { libc::unlinkat(self.fd, name.as_ptr(), 0) };
        // SAFETY: as above; the flags create a fresh private file, never through a link.
        let fd = unsafe {
            libc::openat(
                self.fd,
                name.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0o600 as libc::c_uint,
            )
        };
        (fd >= 0).then_some(fd)
    }

    /// Opens the existing stats file of process `pid`. The caller owns the descriptor.
    pub fn open_file(&self, pid: c_int) -> Option<c_int> {
        let name = file_name(pid)?;
        // SAFETY: NUL-terminated name relative to our directory descriptor; existing file only.
        let fd = unsafe {
            libc::openat(
                self.fd,
                name.as_ptr(),
                libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW,
            )
        };
        (fd >= 0).then_some(fd)
    }

    /// Removes the stats file of process `pid`.
    pub fn remove_file(&self, pid: c_int) {
        if let Some(name) = file_name(pid).filter(|_| self.is_intact()) {
            // SAFETY: NUL-terminated name relative to our directory descriptor.
            unsafe { libc::unlinkat(self.fd, name.as_ptr(), 0) };
        }
    }
}

/// The stats file name of process `pid`: its number.
fn file_name(pid: c_int) -> Option<PathBuf> {
    let mut name = PathBuf::new();
    name.push_decimal(u64::try_from(pid).ok()?).then_some(name)
}

/// The mode, owner, and device and inode of what `fd` is open on (`fstat`).
fn identity_of(fd: c_int) -> Option<(libc::mode_t, libc::uid_t, (u64, u64))> {
    let mut st = core::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat writes into `st`.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: fstat succeeded.
    let st = unsafe { st.assume_init() };
    Some((st.st_mode, st.st_uid, (st.st_dev, st.st_ino)))
}

/// Moves `fd` above the numbers the application uses, as the SAN's long-lived descriptors are
/// (the floor of `san_shm::relocate_internal_fd`), close-on-exec; where no number there is
/// free it stays. With the real `fcntl` and `close`: this runs from hooks.
fn relocate_high(fd: c_int) -> c_int {
    let floor = san_shm::internal_fd_floor();
    if fd >= floor {
        return fd;
    }
    // SAFETY: plain fcntl on our own descriptor; the result is a new descriptor.
    let moved = unsafe { real::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor as usize) };
    if moved < 0 {
        return fd;
    }
    // SAFETY: the original, ours, replaced by `moved`.
    unsafe { real::close(fd) };
    moved
}

/// This process's start time in clock ticks since boot, or 0 if unreadable.
fn own_start_time() -> u64 {
    let mut buf = [0u8; 1024];
    // SAFETY: NUL-terminated literal path.
    let fd = unsafe {
        libc::open(
            c"/proc/self/stat".as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return 0;
    }
    // SAFETY: reading into our buffer.
    let n = unsafe { real::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    // SAFETY: our own fd.
    unsafe { real::close(fd) };
    if n <= 0 {
        return 0;
    }
    parse_start_time(&buf[..n as usize]).unwrap_or(0)
}

/// Field 22 (`starttime`) of a `/proc/PID/stat` line. The command name (field 2) may contain
/// spaces and parentheses, so fields are counted after the *last* `)`.
pub fn parse_start_time(stat: &[u8]) -> Option<u64> {
    let after_comm = stat.iter().rposition(|&b| b == b')')? + 1;
    let rest = core::str::from_utf8(&stat[after_comm..]).ok()?;
    // rest starts at field 3 (state); starttime is field 22 → index 19.
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_buf_builds_c_strings_and_refuses_overflow() {
        let mut path = PathBuf::new();
        assert!(
            path.push(b"/dev/shm/x-") && path.push_decimal(0) && path.push_decimal(4_294_967_295)
        );
        assert_eq!(path.as_bytes(), b"/dev/shm/x-04294967295");
        // SAFETY: as_ptr is NUL-terminated.
        let c_string = unsafe { core::ffi::CStr::from_ptr(path.as_ptr()) };
        assert_eq!(c_string.to_bytes(), path.as_bytes());
        assert!(!path.push(&[b'a'; 300]));
        assert!(!path.push(b"a\0b"), "embedded NUL must be refused");
    }

    #[test]
    fn start_time_parses_past_a_hostile_command_name() {
        let line =
            b"1234 (evil) name (x) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21\n";
        assert_eq!(parse_start_time(line), Some(987654));
        assert_eq!(parse_start_time(b"garbage"), None);
        assert!(own_start_time() > 0);
    }

    /// A fresh private directory for a stats-directory test, and its C path.
    fn stats_test_dir(tag: &str) -> (std::path::PathBuf, PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("sandirect-registry-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(dir.with_extension("original"));
        let mut c_path = PathBuf::new();
        assert!(c_path.push(std::os::unix::ffi::OsStrExt::as_bytes(dir.as_os_str())));
        (dir, c_path)
    }

    fn names_in(dir: &std::path::Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_stats_directory_swapped_at_its_path_keeps_its_files() {
        let (path, c_path) = stats_test_dir("swap");
        let dir = StatsDir::open(&c_path).expect("a fresh private directory");
        assert!(
            dir.fd() >= san_shm::internal_fd_floor(),
            "kept above the application's numbers"
        );
        // Renamed away, another directory at the path, then a symbolic link to it.
        let original = path.with_extension("original");
        std::fs::rename(&path, &original).unwrap();
        let decoy = path.with_extension("decoy");
        std::fs::create_dir_all(&decoy).unwrap();
        std::os::unix::fs::symlink(&decoy, &path).unwrap();
        std::fs::write(decoy.join("41"), b"planted").unwrap();

        let fd = dir
            .create_file(41)
            .expect("created in the checked directory");
        // SAFETY: our own descriptor.
        unsafe { real::close(fd) };
        assert_eq!(names_in(&original), ["41"]);
        assert_eq!(std::fs::read(decoy.join("41")).unwrap(), b"planted");
        let fd = dir
            .open_file(41)
            .expect("reopened in the checked directory");
        // SAFETY: as above.
        unsafe { real::close(fd) };
        dir.remove_file(41);
        assert_eq!(names_in(&original), Vec::<String>::new());
        assert_eq!(names_in(&decoy), ["41"], "the planted file stays");
        dir.close();
        for dir in [&original, &decoy] {
            let _ = std::fs::remove_dir_all(dir);
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_stats_directory_that_is_a_link_or_not_private_is_refused() {
        let (path, c_path) = stats_test_dir("refuse");
        let target = path.with_extension("target");
        std::fs::create_dir_all(&target).unwrap();
        std::os::unix::fs::symlink(&target, &path).unwrap();
        assert_eq!(StatsDir::open(&c_path), None, "a symbolic link");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        assert_eq!(StatsDir::open(&c_path), None, "writable by others");
        let _ = std::fs::remove_dir_all(&path);
        let _ = std::fs::remove_dir_all(&target);
    }

    #[test]
    fn a_stats_directory_descriptor_reused_for_something_else_is_not_written_through() {
        let (path, c_path) = stats_test_dir("reused");
        let dir = StatsDir::open(&c_path).unwrap();
        let elsewhere = path.with_extension("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let other = std::fs::File::open(&elsewhere).unwrap();
        // SAFETY: dup2 onto the directory's own number: the test plays a program that
        // closed a descriptor it did not know and reused the number for a directory of its
        // own.
        assert!(unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&other), dir.fd()) } >= 0);
        assert!(!dir.is_intact());
        assert_eq!(dir.create_file(42), None);
        dir.remove_file(42);
        assert_eq!(names_in(&elsewhere), Vec::<String>::new());
        dir.close();
        let _ = std::fs::remove_dir_all(&path);
        let _ = std::fs::remove_dir_all(&elsewhere);
    }

    #[test]
    fn a_forked_child_publishes_in_the_directory_its_parent_checked() {
        let (path, c_path) = stats_test_dir("fork");
        let dir = StatsDir::open(&c_path).unwrap();
        let original = path.with_extension("original");
        std::fs::rename(&path, &original).unwrap();
        std::fs::create_dir(&path).unwrap();
        // SAFETY: the child makes system calls only (through the inherited descriptor), then
        // _exit: nothing of the test harness's threads is touched.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: getpid and _exit have no preconditions.
            unsafe {
                let created = dir.create_file(libc::getpid());
                libc::_exit(i32::from(created.is_none()));
            }
        }
        assert!(child > 0, "fork");
        let mut status = 0;
        // SAFETY: waits for the child forked above.
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert_eq!(names_in(&original), [child.to_string()]);
        assert_eq!(names_in(&path), Vec::<String>::new());
        dir.close();
        let _ = std::fs::remove_dir_all(&path);
        let _ = std::fs::remove_dir_all(&original);
    }

    #[test]
    fn claims_release_and_reuse_records() {
        let registry = registry();
        let (index, record) = registry.claim(7, SocketState::TcpCandidate).expect("claim");
        assert_eq!(record.state(), SocketState::TcpCandidate);
        assert_eq!(record.fd_refs.load(Ordering::Relaxed), 1);
        registry.add_ref(index);
        assert!(!registry.release(index), "one dup still refers to it");
        assert!(registry.release(index));
        assert_eq!(record.state(), SocketState::Free);
        assert!(
            !registry.release(index),
            "double release must not underflow"
        );
    }

    #[test]
    fn registry_grows_past_one_chunk() {
        let registry = registry();
        let claimed: Vec<u32> = (0..CHUNK_RECORDS as c_int + 10)
            .map(|fd| registry.claim(fd, SocketState::Listener).expect("claim").0)
            .collect();
        let mut unique = claimed.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), claimed.len(), "no record handed out twice");
        assert!(registry.mapped_chunks() >= 2);
        for index in claimed {
            assert!(registry.release(index));
        }
    }
}
