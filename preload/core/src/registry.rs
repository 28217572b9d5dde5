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
//! Everything here is lock-free and allocation-free (syscalls only), because records are
//! claimed from hooks, possibly before our constructor ran or in a forked child. Chunk memory
//! is never unmapped, so a record reference stays valid forever (a reused record is told apart
//! by its `generation`).

use core::ffi::c_int;
use core::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};

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
        let mut path = PathBuf::new();
        if !stats_path(&mut path, own_pid()) {
            return false;
        }
        // A stale file of a dead process with our pid (or of our pre-exec image) goes away.
        // SAFETY: path is NUL-terminated.
        unsafe { libc::unlink(path.as_ptr()) };
        // SAFETY: path is NUL-terminated; the flags create a fresh private file.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0o600,
            )
        };
        if fd < 0 {
            return false;
        }
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
        if !ok {
            // SAFETY: as above.
            unsafe { libc::unlink(path.as_ptr()) };
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
            let mut path = PathBuf::new();
            if stats_path(&mut path, own_pid()) {
                // SAFETY: NUL-terminated path; existing file only.
                let fd = unsafe {
                    libc::open(
                        path.as_ptr(),
                        libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                    )
                };
                if fd >= 0 {
                    self.map_chunk_from(fd, next);
                    // SAFETY: our own fd.
                    unsafe { real::close(fd) };
                }
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
        let mut path = PathBuf::new();
        if !stats_path(&mut path, own_pid()) {
            return self.privatize_all();
        }
        // SAFETY: NUL-terminated path.
        unsafe { libc::unlink(path.as_ptr()) };
        // SAFETY: as in init_file.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC | libc::O_NOFOLLOW,
                0o600,
            )
        };
        if fd < 0 {
            return self.privatize_all();
        }
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
            // SAFETY: NUL-terminated path.
            unsafe { libc::unlink(path.as_ptr()) };
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
        let mut path = PathBuf::new();
        if stats_path(&mut path, own_pid()) {
            // SAFETY: NUL-terminated path.
            unsafe { libc::unlink(path.as_ptr()) };
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

/// Builds the directory path into `path` and makes sure it is a directory owned by us (0700).
/// False when publication is off or the directory is unusable.
pub fn stats_dir(path: &mut PathBuf) -> bool {
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
        if !(path.push(b"/dev/shm/sandirect-") && path.push_decimal(u64::from(uid))) {
            return false;
        }
    } else {
        // SAFETY: getenv returned a NUL-terminated string.
        let bytes = unsafe { core::ffi::CStr::from_ptr(custom) }.to_bytes();
        if bytes == b"off" || bytes.is_empty() || !path.push(bytes) {
            return false;
        }
    }
    // SAFETY: NUL-terminated path; mkdir fails harmlessly if it exists.
    unsafe { libc::mkdir(path.as_ptr(), 0o700) };
    let mut st = core::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: lstat writes into `st`.
    if unsafe { libc::lstat(path.as_ptr(), st.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: lstat succeeded.
    let st = unsafe { st.assume_init() };
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    // Another user could have created the directory first: never publish into it.
    st.st_mode & libc::S_IFMT == libc::S_IFDIR && st.st_uid == uid && st.st_mode & 0o022 == 0
}

/// Builds `DIR/PID` into `path`.
pub fn stats_path(path: &mut PathBuf, pid: c_int) -> bool {
    stats_dir(path) && path.push(b"/") && path.push_decimal(pid as u64)
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
