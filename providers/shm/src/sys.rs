//! Every `unsafe` operation of the crate lives here: the shared mapping, futexes, cross-memory
//! attach (CMA, `process_vm_readv`/`process_vm_writev`), pidfds, the file calls relative to a
//! directory descriptor (`openat` and kin) and a few libc queries.
//!
//! The rest of the crate is safe code built on these small wrappers. Two kinds of memory are
//! touched:
//!
//! * **The shared segment** ([`Mapping`]). Every word that can change after set-up is an
//!   atomic ([`ShmSafe`] types only), so concurrent access by the peer process is never a data
//!   race on a Rust object. Bulk bytes (message slots, the write window) are moved with
//!   explicit copies whose bounds are checked against the mapping length.
//! * **Application memory named by a registration** ([`GrantedRange`]). As with a NIC's DMA,
//!   registering a range is the application's grant that the provider may read or write it
//!   while the registration lives. All such copies go through the kernel (CMA on our own pid)
//!   so that a range unmapped behind the registration's back yields `EFAULT`, never a crash;
//!   only when the kernel refuses CMA altogether (seccomp) does a plain copy stand in.

use core::ffi::CStr;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, AtomicU64, AtomicU8};
use san_api::{AppSource, BadAddress};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

/// Marker for types that may live in memory shared with another process.
///
/// # Safety
/// An implementor must be `#[repr(C)]` (or a primitive atomic), contain no pointers or
/// references (the two processes map the segment at different addresses), accept every bit
/// pattern as a valid value (the peer may write anything), and have interior mutability only
/// through atomics, so a `&T` into the mapping stays sound while the peer writes it
/// concurrently. This is the `vasi` idea from the shadow simulator.
pub unsafe trait ShmSafe: Sync {}

// SAFETY: a primitive atomic: no pointers, every bit pattern valid, mutation only atomically.
unsafe impl ShmSafe for AtomicU32 {}
// SAFETY: as for `AtomicU32`.
unsafe impl ShmSafe for AtomicU64 {}
// SAFETY: as for `AtomicU32`.
unsafe impl ShmSafe for AtomicU8 {}
// SAFETY: an array of `ShmSafe` values is laid out contiguously and inherits their properties.
unsafe impl<T: ShmSafe, const N: usize> ShmSafe for [T; N] {}

// SAFETY: `Line<T>` is `#[repr(C, align(64))]` around one `ShmSafe` value plus padding that
// is never read.
unsafe impl<T: ShmSafe> ShmSafe for crate::layout::Line<T> {}

/// Implements [`ShmSafe`] for the crate's shared layout structs (see `layout.rs`).
macro_rules! shm_safe {
    ($($ty:ty),* $(,)?) => {$(
        // SAFETY: `layout.rs` declares this type `#[repr(C)]` with atomic fields only (checked
        // by the const size/alignment assertions there): no pointers, every bit pattern valid.
        unsafe impl ShmSafe for $ty {}
    )*};
}
shm_safe!(
    crate::layout::SegmentHeader,
    crate::layout::SideControl,
    crate::layout::RingEntry,
    crate::layout::ExposureEntry,
    crate::layout::SetupWords,
);

/// Most areas [`Mapping::copy_in_each`] fills with one copy (a 64 KiB file send in 16 KiB
/// slots takes four).
pub(crate) const COPY_AREAS: usize = 8;

/// A `MAP_SHARED` read-write mapping of a whole segment file.
pub(crate) struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; all typed access is to `ShmSafe`
// (atomic, `Sync`) values and all bulk access is by explicit copies, so sharing the handle
// between threads adds nothing that sharing it with the peer process does not already cover.
unsafe impl Send for Mapping {}
// SAFETY: see `Send` above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `file` shared and read-write. `len` must equal the file size,
    /// which the caller has checked with `fstat`.
    pub(crate) fn map_shared(file: &File, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: a fresh mapping chosen by the kernel (null hint) aliases no Rust object; the
        // fd is valid for the duration of the call.
        let addr = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(addr.cast::<u8>())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
        Ok(Mapping { base, len })
    }

    /// The mapping's address in this process (published so the peer can probe CMA).
    pub(crate) fn base_addr(&self) -> u64 {
        self.base.as_ptr() as u64
    }

    fn check(&self, offset: usize, len: usize, align: usize) {
        // NOTE(panic): every offset reaching here is derived from a `Geometry` validated against
        // the mapping length, and every peer-supplied index was range-checked first, so this
        // only fires on a bug inside this crate.
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.len)
                && offset.is_multiple_of(align),
            "san-shm internal error: access [{offset}, +{len}) outside a {}-byte segment",
            self.len
        );
    }

    /// A shared reference to the `T` at `offset`.
    pub(crate) fn get<T: ShmSafe>(&self, offset: usize) -> &T {
        self.check(offset, size_of::<T>(), align_of::<T>());
        // SAFETY: in bounds and aligned (checked above; the base is page aligned); `T: ShmSafe`
        // makes any bit pattern valid and concurrent mutation by the peer atomic-only; the
        // reference cannot outlive `self`, which keeps the mapping alive.
        unsafe { &*self.base.as_ptr().add(offset).cast::<T>() }
    }

    /// Copies `src` into the segment at `offset`.
    pub(crate) fn copy_in(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len(), 1);
        // SAFETY: destination in bounds (checked); `src` is a Rust slice and cannot overlap
        // the mapping's bulk areas, which are never handed out as `&mut`.
        unsafe {
            core::ptr::copy_nonoverlapping(src.as_ptr(), self.base.as_ptr().add(offset), src.len())
        }
    }

    /// Copies `len` bytes of `source` from `start` on into the segment at `offset`, for a
    /// part of the segment only this process accesses until it publishes it: its outbound
    /// journal (which the peer reads only after we closed or died), or a receive slot the
    /// peer posted and we have not yet named in a message entry (an honest peer neither
    /// reads nor writes a posted slot before that). The source may be the application's
    /// memory, whose copy can fail: what landed is then unspecified.
    pub(crate) fn copy_in_from<S: AppSource + ?Sized>(
        &self,
        offset: usize,
        source: &S,
        start: usize,
        len: usize,
    ) -> Result<(), BadAddress> {
        self.check(offset, len, 1);
        // SAFETY: in bounds (checked); `u8` accepts every bit pattern. No other view of this
        // part of the segment exists in this process while the slice lives (the caller
        // writes its own journal, or a posted slot of the peer not yet published, through
        // `&mut` of its connection, and the peer reads either only after we published it or
        // are gone), so the exclusive view holds for the copy. A hostile same-user peer could
        // write there meanwhile (it could equally ptrace us): it only spoils its own bytes.
        let target =
            unsafe { core::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) };
        source.copy_to(start, target)
    }

    /// Copies consecutive bytes of `source`, from `start` on, into the segment's `areas`
    /// (offset, length) in turn, as [`Mapping::copy_in_from`] of each would, under the same
    /// rule (parts only this process accesses until it publishes them), with one
    /// [`AppSource::copy_to_each`] per [`COPY_AREAS`] areas: a file source reads them all
    /// with one system call. Areas that overlap (only a peer that posted one slot twice makes
    /// them) are copied one at a time. What landed when the copy fails is unspecified.
    pub(crate) fn copy_in_each<S: AppSource + ?Sized>(
        &self,
        areas: &[(usize, usize)],
        source: &S,
        start: usize,
    ) -> Result<(), BadAddress> {
        for &(offset, len) in areas {
            self.check(offset, len, 1);
        }
        let disjoint = areas.iter().enumerate().all(|(i, &(offset, len))| {
            areas[..i]
                .iter()
                .all(|&(other, other_len)| offset + len <= other || other + other_len <= offset)
        });
        let mut at = start;
        if !disjoint {
            for &(offset, len) in areas {
                self.copy_in_from(offset, source, at, len)?;
                at += len;
            }
            return Ok(());
        }
        for chunk in areas.chunks(COPY_AREAS) {
            let mut targets: [&mut [u8]; COPY_AREAS] = Default::default();
            for (target, &(offset, len)) in targets.iter_mut().zip(chunk) {
                // SAFETY: in bounds (checked above) and pairwise disjoint (checked above), so
                // these exclusive views alias neither each other nor, as in `copy_in_from`,
                // any other view of this process (parts of the segment nobody else reads or
                // writes until we publish them); `u8` accepts every bit pattern.
                *target =
                    unsafe { core::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), len) };
            }
            source.copy_to_each(at, &mut targets[..chunk.len()])?;
            at += chunk.iter().map(|&(_, len)| len).sum::<usize>();
        }
        Ok(())
    }

    /// A read-only view of `len` bytes at `offset`.
    ///
    /// The bytes live in shared memory: an honest peer never writes a receive slot that is
    /// not posted, which is the only state in which the connection hands such a view out. A
    /// hostile same-user peer could still change them under the reader (it could equally
    /// ptrace us); consumers treat the bytes as untrusted input either way.
    pub(crate) fn bytes(&self, offset: usize, len: usize) -> &[u8] {
        self.check(offset, len, 1);
        // SAFETY: in bounds (checked); `u8` accepts every bit pattern; lifetime tied to `self`.
        unsafe { core::slice::from_raw_parts(self.base.as_ptr().add(offset), len) }
    }

    /// Allocates the file pages under `[offset, offset + len)` through the mapping
    /// (`MADV_POPULATE_WRITE`), so that later writes there cannot raise `SIGBUS`: a full file
    /// system is an error here instead (`ENOMEM`, `EFAULT`). `EINVAL` on kernels before 5.14.
    pub(crate) fn populate(&self, offset: usize, len: usize) -> io::Result<()> {
        self.check(offset, len, PAGE);
        loop {
            // SAFETY: advice on a page-aligned range inside our own mapping (checked); it
            // changes no contents.
            let rc = unsafe {
                libc::madvise(
                    self.base.as_ptr().add(offset).cast(),
                    len,
                    MADV_POPULATE_WRITE,
                )
            };
            if rc == 0 {
                return Ok(());
            }
            let error = io::Error::last_os_error();
            if error.raw_os_error() != Some(libc::EINTR) {
                return Err(error);
            }
        }
    }

    /// The address of byte `offset` in this process, for I/O vectors.
    pub(crate) fn addr_of(&self, offset: usize, len: usize) -> u64 {
        self.check(offset, len, 1);
        self.base_addr() + offset as u64
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this value created; every reference handed out
        // borrows `self`, so none outlives this call.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// Result of a futex wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FutexWait {
    /// Woken by `FUTEX_WAKE` (or spuriously).
    Woken,
    /// The word no longer held the expected value.
    ValueChanged,
    /// The timeout passed.
    TimedOut,
}

/// Blocks while `word == expected`, at most `timeout`. Shared (not `FUTEX_PRIVATE_FLAG`): the
/// word lives in a `MAP_SHARED` file mapping, so the kernel keys it by inode and offset and a
/// wake from the peer process finds us.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) -> FutexWait {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a live, aligned 32-bit atomic; `ts` outlives the call; FUTEX_WAIT only
    // reads the word.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
        )
    };
    if rc == 0 {
        return FutexWait::Woken;
    }
    match io::Error::last_os_error().raw_os_error() {
        Some(libc::ETIMEDOUT) => FutexWait::TimedOut,
        Some(libc::EAGAIN) => FutexWait::ValueChanged,
        // EINTR and anything unexpected: report a wake-up; callers re-check their condition.
        _ => FutexWait::Woken,
    }
}

/// Wakes every waiter on `word` (in any process mapping it). Returns how many were woken.
pub fn futex_wake(word: &AtomicU32) -> usize {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE does not access memory
    // beyond using its address as a key.
    let rc = unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX) };
    usize::try_from(rc).unwrap_or(0)
}

/// Application memory the provider may copy to or from: a live registration's range, checked
/// by the domain (see the module docs for why that makes the copies sound).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GrantedRange {
    pub(crate) addr: u64,
    pub(crate) len: u64,
}

/// Direction of a cross-memory copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CmaDirection {
    /// `process_vm_readv`: remote → local.
    Read,
    /// `process_vm_writev`: local → remote.
    Write,
}

/// Copies `len` bytes between `local` (an address in this process) and `remote` (an address in
/// process `pid`) with one CMA syscall per partial transfer. Returns the bytes moved; a
/// short count means a fault part-way.
///
/// The kernel validates both sides: an unmapped or read-only page gives `EFAULT`, a process we
/// may not ptrace gives `EPERM`, a dead one `ESRCH`. `local` must be either a [`GrantedRange`]
/// or bytes inside a [`Mapping`] (callers obtain it from one of the two).
pub(crate) fn cma_copy(
    direction: CmaDirection,
    pid: u32,
    local: u64,
    remote: u64,
    len: u64,
) -> io::Result<u64> {
    let mut done = 0u64;
    while done < len {
        let chunk = usize::try_from(len - done)
            .unwrap_or(usize::MAX)
            .min(isize::MAX as usize);
        let local_iov = libc::iovec {
            iov_base: (local + done) as *mut libc::c_void,
            iov_len: chunk,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote + done) as *mut libc::c_void,
            iov_len: chunk,
        };
        let pid =
            libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
        // SAFETY: the kernel performs the copy and checks both address ranges, returning EFAULT
        // instead of touching unmapped memory. Locally it writes only into a granted range or
        // the shared mapping (read direction), never into memory a Rust reference owns.
        let rc = unsafe {
            match direction {
                CmaDirection::Read => libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0),
                CmaDirection::Write => {
                    libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0)
                }
            }
        };
        if rc < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            if done > 0 && err.raw_os_error() == Some(libc::EFAULT) {
                return Ok(done);
            }
            return Err(err);
        }
        if rc == 0 {
            return Ok(done);
        }
        done += rc as u64;
    }
    Ok(done)
}

/// Reads the 8-byte word at `remote` in process `pid` (the CMA permission probe).
pub(crate) fn cma_probe(pid: u32, remote: u64) -> io::Result<u64> {
    let mut word = 0u64;
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    let local_iov = libc::iovec {
        iov_base: (&mut word as *mut u64).cast(),
        iov_len: 8,
    };
    let remote_iov = libc::iovec {
        iov_base: remote as *mut libc::c_void,
        iov_len: 8,
    };
    // SAFETY: the kernel writes at most 8 bytes into `word`, a live local we own exclusively
    // here; the remote address is checked by the kernel in the other process.
    let rc = unsafe { libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0) };
    match rc {
        8 => Ok(word),
        rc if rc < 0 => Err(io::Error::last_os_error()),
        _ => Err(io::Error::from_raw_os_error(libc::EFAULT)),
    }
}

/// Whether this process may run on more than one CPU (then a short spin for the peer can pay
/// off). Asked once: the standard library's answer reads the cgroup's CPU quota files, a
/// dozen system calls that once made a tenth of a connection's set-up.
pub fn multi_cpu() -> bool {
    static ANSWER: AtomicU8 = AtomicU8::new(UNKNOWN);
    remembered(&ANSWER, || {
        std::thread::available_parallelism().is_ok_and(|n| n.get() > 1)
    })
}

const UNKNOWN: u8 = 0;

/// A process-wide yes/no found out once, without a lock: threads that ask at the same time
/// may each find out (the answers agree). A `OnceLock` would make a thread wait for another
/// that is finding out, and a child forked meanwhile wait for ever.
pub fn remembered(answer: &AtomicU8, find_out: impl FnOnce() -> bool) -> bool {
    use core::sync::atomic::Ordering;
    match answer.load(Ordering::Acquire) {
        UNKNOWN => {
            let yes = find_out();
            answer.store(if yes { 2 } else { 1 }, Ordering::Release);
            yes
        }
        known => known == 2,
    }
}

/// Whether CMA between this process and a same-user peer is likely to be allowed: the kernel
/// lets this process read its own memory that way (seccomp filters such as Docker's default
/// refuse it) and Yama does not restrict ptrace to descendants. Where it is not, peers write
/// through the segments' write windows, which are then allocated at set-up (a full file
/// system keeps the connection on TCP); where it is, a window is allocated only if it is used.
pub(crate) fn cma_likely() -> bool {
    static ANSWER: AtomicU8 = AtomicU8::new(UNKNOWN);
    remembered(&ANSWER, || {
        let marker = 0x5a5a_5a5a_5a5a_5a5au64;
        let own = cma_probe(std::process::id(), core::ptr::from_ref(&marker) as u64);
        let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope");
        own.is_ok_and(|word| word == marker) && yama.map_or(true, |scope| scope.trim() == "0")
    })
}

/// Copies between a granted range of this process and the shared mapping without the kernel,
/// for when CMA on our own pid is refused (seccomp). Faults on an unmapped granted range would
/// crash here, which is why [`cma_copy`] on our own pid is always tried first.
pub(crate) fn plain_copy_granted(
    direction: CmaDirection,
    granted: GrantedRange,
    map: &Mapping,
    offset: usize,
) {
    let Ok(len) = usize::try_from(granted.len) else {
        return;
    };
    map.check(offset, len, 1);
    let shared = map.base_addr() as usize + offset;
    // SAFETY: the shared side is in bounds (checked above). The granted side is a live
    // registration: the application promised the range is mapped and ours to read or write
    // while registered (the same promise a NIC's DMA relies on). `ptr::copy` (memmove) is
    // used because nothing stops an application from registering a receive slot it was handed,
    // so the two ranges may overlap.
    unsafe {
        match direction {
            CmaDirection::Read => {
                core::ptr::copy(granted.addr as *const u8, shared as *mut u8, len)
            }
            CmaDirection::Write => {
                core::ptr::copy(shared as *const u8, granted.addr as *mut u8, len)
            }
        }
    }
}

/// Sizes the file behind `fd` to `len` bytes with every block allocated now (`fallocate`),
/// for files that are then written through a shared mapping.
///
/// A sparse file (`ftruncate`) gets its pages at the first write through the mapping, and
/// when the file system is full that write raises `SIGBUS`, which kills the process. With
/// the space reserved here, a full file system is an error (`ENOSPC`, `EDQUOT`, `EFBIG`,
/// `ENOMEM`) the caller can act on. On a file system without `fallocate` (`EOPNOTSUPP`) the
/// file is only sized, as before it had to be.
pub fn allocate_file(fd: BorrowedFd<'_>, len: usize) -> io::Result<()> {
    allocate_file_ranges(fd, &[(0, len)], len)
}

/// As [`allocate_file`], allocating only the byte ranges `allocated` (`[start, end)` each) of
/// the file's `len` bytes; the rest stays a hole, to be allocated before it is written.
pub(crate) fn allocate_file_ranges(
    fd: BorrowedFd<'_>,
    allocated: &[(usize, usize)],
    len: usize,
) -> io::Result<()> {
    let off = |value: usize| {
        libc::off_t::try_from(value).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))
    };
    let len = off(len)?;
    'ranges: for &(start, end) in allocated.iter().filter(|(start, end)| end > start) {
        let (start, count) = (off(start)?, off(end - start)?);
        loop {
            // SAFETY: plain fallocate(2) (mode 0: allocate and extend) on a descriptor we hold.
            if unsafe { libc::fallocate(fd.as_raw_fd(), 0, start, count) } == 0 {
                continue 'ranges;
            }
            let error = io::Error::last_os_error();
            match error.raw_os_error() {
                // tmpfs gives up an allocation for a pending signal.
                Some(libc::EINTR) => continue,
                Some(libc::EOPNOTSUPP) => break 'ranges,
                _ => return Err(error),
            }
        }
    }
    // SAFETY: plain ftruncate(2) on a descriptor we hold.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The seals of a private segment: its size is fixed for good.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A fresh anonymous memory file that accepts seals (`memfd_create` with `MFD_CLOEXEC |
/// MFD_ALLOW_SEALING`).
pub fn memfd_sealable(name: &CStr) -> io::Result<OwnedFd> {
    // SAFETY: NUL-terminated name; plain memfd_create(2).
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just returned by the kernel, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Seals the size of memory file `fd` for good (`F_SEAL_SHRINK`, `F_SEAL_GROW`, `F_SEAL_SEAL`).
pub fn seal_size(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: plain fcntl(2) on a descriptor we hold.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Whether file `fd` carries every seal of [`seal_size`] (false for a file that takes no
/// seals: only a memfd does).
pub fn size_sealed(fd: BorrowedFd<'_>) -> bool {
    // SAFETY: plain fcntl(2) on a descriptor we hold.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & SIZE_SEALS == SIZE_SEALS
}

/// `madvise` advice: fault the range in writable, allocating file pages (Linux 5.14+).
const MADV_POPULATE_WRITE: libc::c_int = 23;
const PAGE: usize = 4096;

/// Whether this kernel lets a mapping's pages be allocated up front (`MADV_POPULATE_WRITE`):
/// the journals are then allocated when first used; without it, at creation.
pub(crate) fn can_populate() -> bool {
    static ANSWER: AtomicU8 = AtomicU8::new(UNKNOWN);
    remembered(&ANSWER, || {
        // SAFETY: a private anonymous page of our own, advised, then unmapped.
        unsafe {
            let page = libc::mmap(
                core::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if page == libc::MAP_FAILED {
                return false;
            }
            let ok = libc::madvise(page, PAGE, MADV_POPULATE_WRITE) == 0;
            libc::munmap(page, PAGE);
            ok
        }
    })
}

/// The identity of this process's pid namespace (the inode of `/proc/self/ns/pid`, unique on
/// the host while the namespace lives), or 0 when it cannot be read (no `/proc`). A pid
/// means the same process to two processes only when both report the same nonzero value.
/// A process's own pid namespace never changes (`unshare`/`setns` affect its children), so
/// the value is read once.
pub fn pid_namespace() -> u64 {
    use core::sync::atomic::Ordering;
    use std::os::unix::fs::MetadataExt;
    // 0 until read (and when it cannot be): see `remembered` for why no `OnceLock`.
    static NAMESPACE: AtomicU64 = AtomicU64::new(0);
    match NAMESPACE.load(Ordering::Acquire) {
        0 => {
            let namespace = std::fs::metadata("/proc/self/ns/pid").map_or(0, |meta| meta.ino());
            NAMESPACE.store(namespace, Ordering::Release);
            namespace
        }
        known => known,
    }
}

/// Takes a shared `flock` on `file` (nonblocking): the creator of a segment holds one for as
/// long as the segment may still be attached, and the kernel drops it when the creator's last
/// descriptor of the file closes, death included, in whatever pid namespace it runs.
pub(crate) fn lock_shared(file: &File) -> io::Result<()> {
    // SAFETY: plain flock(2) on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// True when nobody holds a lock on `file` (an exclusive `flock` could be taken, nonblocking;
/// it is released when `file` closes).
pub(crate) fn unlocked(file: &File) -> bool {
    // SAFETY: plain flock(2) on a descriptor we own.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Opens a pidfd for `pid` (Linux 5.3+), a pid of *this* process's pid namespace. `None` when
/// unsupported or the process is gone. The descriptor sits above the application's numbers.
pub fn pidfd_open(pid: u32) -> Option<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
    // Without a free number above the application's, no pidfd: liveness is then checked
    // with `kill(pid, 0)`, as on kernels without pidfds.
    move_internal_fd(pidfd).ok()
}

/// Highest floor for [`relocate_internal_fd`]: high enough to stay clear of the numbers
/// applications use for their own descriptors, low enough that the kernel's descriptor table
/// (sized by the highest open number) stays small.
const INTERNAL_FD_FLOOR_MAX: u64 = 1024;

/// The lowest number internal descriptors move to: half the soft `RLIMIT_NOFILE`, at most
/// 1024 (read on each call: programs raise their limit at run time).
pub fn internal_fd_floor() -> libc::c_int {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `struct rlimit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 0;
    }
    let floor = (limit.rlim_cur / 2).min(INTERNAL_FD_FLOOR_MAX);
    libc::c_int::try_from(floor).unwrap_or(0)
}

/// Moves a descriptor kept for a connection's lifetime (this provider's pidfds, and the
/// interposer's mirror ends, words pages, exchange sockets, doorbells, stashes) above the
/// numbers the application uses, close-on-exec.
///
/// The kernel hands out the lowest free number, so a descriptor of ours left low would shift
/// every descriptor the host program opens afterwards: programs that size tables by their own
/// descriptor count (wrk's event loop holds `10 + 3 × connections` entries and fails a
/// connection whose fd does not fit) would break. When no higher number is free (or the
/// limit is tiny) the descriptor stays where it is.
pub fn relocate_internal_fd(fd: OwnedFd) -> OwnedFd {
    let raw = fd.as_raw_fd();
    match move_up(raw, internal_fd_floor()) {
        Some(moved) => {
            drop(fd);
            moved
        }
        None => fd,
    }
}

/// As [`relocate_internal_fd`] for the descriptors a SAN connection is set up with: when no
/// number at or above the floor is free, the descriptor is closed and the set-up fails
/// (`EMFILE`), so that a connection never takes a number from the application's half (the
/// connection then stays on TCP).
pub fn move_internal_fd(fd: OwnedFd) -> io::Result<OwnedFd> {
    let floor = internal_fd_floor();
    if fd.as_raw_fd() >= floor {
        return Ok(fd);
    }
    move_up(fd.as_raw_fd(), floor).ok_or_else(|| io::Error::from_raw_os_error(libc::EMFILE))
}

/// A copy of `fd` at or above `floor` (close-on-exec), when one is needed and can be had.
fn move_up(fd: libc::c_int, floor: libc::c_int) -> Option<OwnedFd> {
    if fd >= floor {
        return None;
    }
    // SAFETY: plain fcntl(2) on a descriptor we own; the result is a new descriptor.
    let moved = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, floor) };
    // SAFETY: `moved` was just returned by the kernel and is owned by nobody else.
    (moved >= 0).then(|| unsafe { OwnedFd::from_raw_fd(moved) })
}

/// True when the process behind `pidfd` has exited (a pidfd polls readable from then on,
/// zombies included — which `kill(pid, 0)` would still report alive), waiting up to
/// `timeout_ms` for it (a dying process closes its descriptors before it becomes a zombie:
/// a hang-up on a descriptor it held can come a moment before its pidfd turns readable).
pub(crate) fn pidfd_exited_within(pidfd: &OwnedFd, timeout_ms: libc::c_int) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd; a bounded timeout.
    let rc = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    rc > 0 && pfd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

/// One pidfd per peer process, however many connections it has with us: each connection
/// holding its own made a server with a thousand connections from one client hold a
/// thousand pidfds. Keyed by the pid in our namespace; an entry whose process is still
/// alive names the process that has that pid now (a pid is not reused while its process
/// lives), so `fresh` is closed in favour of it. Peers with no pid here keep their own.
///
/// The cache's lock is only tried: a child forked while another thread held it shares
/// nothing, and never waits.
pub(crate) fn shared_pidfd(pid: Option<u32>, fresh: Option<OwnedFd>) -> Option<Arc<OwnedFd>> {
    type Cache = std::sync::Mutex<Vec<(u32, std::sync::Weak<OwnedFd>)>>;
    static CACHE: Cache = std::sync::Mutex::new(Vec::new());
    let fresh = fresh?;
    let (Some(pid), Ok(mut cache)) = (pid, CACHE.try_lock()) else {
        return Some(Arc::new(fresh));
    };
    cache.retain(|(_, entry)| entry.strong_count() > 0);
    let known = cache
        .iter()
        .find(|(entry_pid, _)| *entry_pid == pid)
        .and_then(|(_, entry)| entry.upgrade());
    if let Some(known) = known {
        if !pidfd_exited_within(&known, 0) {
            return Some(known);
        }
        cache.retain(|(entry_pid, _)| *entry_pid != pid);
    }
    let shared = Arc::new(fresh);
    cache.push((pid, Arc::downgrade(&shared)));
    Some(shared)
}

/// True unless `kill(pid, 0)` says no such process (`EPERM` means it exists).
pub(crate) fn process_exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission; nothing is delivered.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The effective uid and gid of this process.
pub(crate) fn effective_ids() -> (u32, u32) {
    // SAFETY: geteuid/getegid cannot fail and touch no memory.
    unsafe { (libc::geteuid(), libc::getegid()) }
}

/// True when the calling process has `gid` as its effective or a supplementary group.
pub(crate) fn in_group(gid: u32) -> bool {
    if effective_ids().1 == gid {
        return true;
    }
    let mut groups = vec![0 as libc::gid_t; 256];
    // SAFETY: the buffer holds `groups.len()` entries, as passed.
    let n = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    usize::try_from(n).is_ok_and(|n| groups[..n.min(groups.len())].contains(&gid))
}

/// True when every page of `[addr, addr + len)` is mapped in this process (`mincore` fails
/// with `ENOMEM` on a hole).
pub(crate) fn range_is_mapped(addr: u64, len: u64) -> bool {
    const PAGE: u64 = 4096;
    let start = addr & !(PAGE - 1);
    let Some(end) = addr
        .checked_add(len)
        .and_then(|e| e.checked_add(PAGE - 1))
        .map(|e| e & !(PAGE - 1))
    else {
        return false;
    };
    let Ok(pages) = usize::try_from((end - start) / PAGE) else {
        return false;
    };
    // Query in bounded batches so a huge registration does not allocate a huge vector.
    let mut vec = vec![0u8; pages.min(4096)];
    let mut at = start;
    while at < end {
        let batch = (((end - at) / PAGE) as usize).min(vec.len());
        // SAFETY: `vec` has room for `batch` entries, one per page queried; mincore reads no
        // memory of the range itself.
        let rc = unsafe {
            libc::mincore(
                at as *mut libc::c_void,
                batch * PAGE as usize,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return false;
        }
        at += batch as u64 * PAGE;
    }
    true
}

/// The CPU the calling thread runs on (`u32::MAX` if unknown).
pub(crate) fn current_cpu() -> u32 {
    // SAFETY: sched_getcpu takes no arguments and touches no memory of ours.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).unwrap_or(u32::MAX)
}

/// Gives up the CPU once.
pub(crate) fn yield_now() {
    std::thread::yield_now();
}

/// The monotonic clock at the kernel tick's resolution (a few milliseconds): read from the
/// vDSO page without a time-stamp counter read, so cheap enough for every poll, and fine for
/// intervals of tens of milliseconds and more (on a VM the precise clock showed as several
/// percent of a busy server's time, read once per poll).
pub fn coarse_now() -> Duration {
    clock_now(libc::CLOCK_MONOTONIC_COARSE)
}

/// CPU time (user + system) consumed by this process so far. For benchmarks and counters.
pub fn process_cpu_time() -> Duration {
    clock_now(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// `clock_gettime(clock)`, zero if the kernel refuses.
fn clock_now(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter for the call.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// `openat(2)`: `name` (one component, validated by the caller) in the directory `dir`, as a
/// [`File`]. Callers pass `O_NOFOLLOW` and `O_CLOEXEC`.
pub(crate) fn open_at(
    dir: BorrowedFd<'_>,
    name: &CStr,
    flags: libc::c_int,
    mode: libc::mode_t,
) -> io::Result<File> {
    // SAFETY: a NUL-terminated name and a descriptor we hold for the duration of the call;
    // the mode argument is read only with O_CREAT, as openat's variadic contract allows.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The device and inode of the entry `name` in `dir`, not following a symbolic link
/// (`fstatat(2)` with `AT_SYMLINK_NOFOLLOW`).
pub(crate) fn identity_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<(u64, u64)> {
    let mut stat = core::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: a NUL-terminated name, a descriptor we hold; fstatat writes a whole `struct
    // stat` on success.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            name.as_ptr(),
            stat.as_mut_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fstatat succeeded.
    let stat = unsafe { stat.assume_init() };
    Ok((stat.st_dev, stat.st_ino))
}

/// `unlinkat(2)` of the file `name` in `dir` (a symbolic link is removed, not followed).
pub(crate) fn unlink_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    // SAFETY: a NUL-terminated name, a descriptor we hold.
    if unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `linkat(2)`: gives the file `from` of `dir` the further name `to` in the same directory,
/// failing with `EEXIST` rather than replacing (flags 0: a symbolic link `from` is not
/// followed).
pub(crate) fn link_at(dir: BorrowedFd<'_>, from: &CStr, to: &CStr) -> io::Result<()> {
    // SAFETY: NUL-terminated names, a descriptor we hold.
    let rc = unsafe {
        libc::linkat(
            dir.as_raw_fd(),
            from.as_ptr(),
            dir.as_raw_fd(),
            to.as_ptr(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}
