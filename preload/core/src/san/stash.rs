//! The stash of a downgraded SAN socket: stream bytes the session had received when the
//! connection moved back to kernel TCP (see `docs/ARCHITECTURE.md`, "fork and exec"), which
//! the application has not read yet and which come before anything still on TCP.
//!
//! A stash is a sealed-size `memfd` mapped `MAP_SHARED`, so a forked child reads the same
//! bytes and the same read position as its parent (one socket, one receive queue, as the
//! kernel has it), and an exec'd image can map it again from the descriptor handed over in
//! the environment. Reads take bytes with a compare-and-swap on the shared position: two
//! processes (or threads) reading at once each get distinct bytes, in order.
//!
//! Readiness: an eventfd whose counter is 1 while bytes remain stands in for the socket in
//! `poll`/`select` and sits beside it in epoll sets; the reader that takes the last byte
//! clears it.

use core::sync::atomic::{AtomicU64, Ordering};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};

use san_api::BadAddress;

/// `Header::magic`: "SDSTASH1".
const MAGIC: u64 = u64::from_le_bytes(*b"SDSTASH1");
/// Bytes before the data (one cache line).
const HEADER_BYTES: usize = 64;
/// Largest stash accepted from the environment (a socket's receive queue is far smaller).
const MAX_BYTES: u64 = 1 << 30;

#[repr(C)]
struct Header {
    magic: u64,
    total: u64,
    consumed: AtomicU64,
}

/// Received bytes of a downgraded socket, shared by every process holding the socket.
pub(crate) struct Stash {
    memfd: OwnedFd,
    ready: OwnedFd,
    base: core::ptr::NonNull<u8>,
    mapped: usize,
}

// SAFETY: the mapping is shared memory accessed only through atomics (the header) and reads of
// bytes that never change after `create`; the pointer is owned by this value.
unsafe impl Send for Stash {}
// SAFETY: as above: no interior mutation except through the atomic position.
unsafe impl Sync for Stash {}

impl core::fmt::Debug for Stash {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Stash")
            .field("total", &self.total())
            .field("remaining", &self.remaining())
            .finish()
    }
}

fn owned(raw: RawFd) -> Option<OwnedFd> {
    // SAFETY: `raw` was just returned by the kernel and is owned by nobody else.
    (raw >= 0).then(|| unsafe { OwnedFd::from_raw_fd(raw) })
}

impl Stash {
    /// A stash holding `bytes` (close-on-exec until handed to an exec'd image).
    pub(crate) fn create(bytes: &[u8]) -> Option<Stash> {
        // SAFETY: plain memfd_create(2) with a NUL-terminated name.
        let memfd =
            owned(unsafe { libc::memfd_create(c"sandirect-stash".as_ptr(), libc::MFD_CLOEXEC) })
                .map(crate::mirror::relocate_internal_fd)?;
        let mapped = HEADER_BYTES + bytes.len();
        // Allocated, not only sized: the bytes are copied in through a shared mapping, where
        // memory the kernel cannot supply would be SIGBUS instead of a missing stash.
        san_shm::allocate_file(memfd.as_fd(), mapped).ok()?;
        let stash = Stash::map(memfd, mapped)?;
        // SAFETY: the mapping is `mapped` bytes, fresh and private to us until returned; the
        // header is written before anyone can read it.
        unsafe {
            core::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                stash.base.as_ptr().add(HEADER_BYTES),
                bytes.len(),
            );
            let header = stash.base.as_ptr().cast::<Header>();
            (*header).total = bytes.len() as u64;
            (*header).magic = MAGIC;
        }
        stash.sync_ready();
        Some(stash)
    }

    /// Maps a stash handed over by the image that exec'd us; `None` if `memfd` is not one.
    pub(crate) fn adopt(memfd: OwnedFd) -> Option<Stash> {
        // SAFETY: plain fstat(2) into a zeroed struct.
        let mut st: libc::stat = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(memfd.as_raw_fd(), &mut st) } != 0 {
            return None;
        }
        let size = u64::try_from(st.st_size).ok()?;
        if size < HEADER_BYTES as u64 || size > MAX_BYTES + HEADER_BYTES as u64 {
            return None;
        }
        // SAFETY: back to close-on-exec: it is ours again.
        unsafe { libc::fcntl(memfd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        let stash = Stash::map(memfd, size as usize)?;
        let header = stash.header();
        if header.magic != MAGIC || header.total != size - HEADER_BYTES as u64 {
            return None;
        }
        if header.consumed.load(Ordering::Acquire) > header.total {
            return None;
        }
        stash.sync_ready();
        Some(stash)
    }

    fn map(memfd: OwnedFd, mapped: usize) -> Option<Stash> {
        // SAFETY: a new shared mapping of our memfd; checked below.
        let base = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = core::ptr::NonNull::new(base.cast::<u8>())?;
        // Internal descriptors live above the application's numbers (see `mirror`).
        // SAFETY: plain eventfd(2).
        let ready = owned(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) })
            .map(crate::mirror::relocate_internal_fd);
        let Some(ready) = ready else {
            // SAFETY: unmapping the mapping made just above.
            unsafe { libc::munmap(base.as_ptr().cast(), mapped) };
            return None;
        };
        Some(Stash {
            memfd,
            ready,
            base,
            mapped,
        })
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a header, alive as long as `self`.
        unsafe { &*self.base.as_ptr().cast::<Header>() }
    }

    /// Bytes the stash was created with.
    pub(crate) fn total(&self) -> u64 {
        self.header().total
    }

    /// Bytes not read yet (by any process holding the socket).
    pub(crate) fn remaining(&self) -> usize {
        let header = self.header();
        (header.total - header.consumed.load(Ordering::Acquire).min(header.total)) as usize
    }

    /// Hands up to `room` unread bytes to `sink` (in one piece; again, with the bytes then
    /// unread, if another reader took them meanwhile) and consumes them unless `peek`.
    /// Returns the number of bytes; a sink that fails (the application's buffer could not be
    /// written) consumes nothing.
    pub(crate) fn read(
        &self,
        room: usize,
        peek: bool,
        mut sink: impl FnMut(&[u8]) -> Result<(), BadAddress>,
    ) -> Result<usize, BadAddress> {
        let header = self.header();
        // Bounded: each failed exchange means another reader consumed bytes, and there are
        // at most `total` of them.
        loop {
            let consumed = header.consumed.load(Ordering::Acquire).min(header.total);
            let n = room.min((header.total - consumed) as usize);
            if n == 0 {
                return Ok(0);
            }
            // SAFETY: `consumed + n <= total`, inside the mapping; the bytes never change.
            let bytes = unsafe {
                core::slice::from_raw_parts(
                    self.base.as_ptr().add(HEADER_BYTES + consumed as usize),
                    n,
                )
            };
            sink(bytes)?;
            if peek {
                return Ok(n);
            }
            if header
                .consumed
                .compare_exchange(
                    consumed,
                    consumed + n as u64,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                if consumed + n as u64 == header.total {
                    self.sync_ready();
                }
                return Ok(n);
            }
        }
    }

    /// Makes the readiness eventfd say whether bytes remain.
    fn sync_ready(&self) {
        let mut count = 0u64;
        // SAFETY: an 8-byte read from our nonblocking eventfd (clears it).
        unsafe { libc::read(self.ready.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        if self.remaining() > 0 {
            let one = 1u64;
            // SAFETY: an 8-byte write to our eventfd.
            unsafe { libc::write(self.ready.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// The eventfd that is readable while bytes remain.
    pub(crate) fn ready_fd(&self) -> RawFd {
        self.ready.as_raw_fd()
    }

    /// The memfd (handed to an exec'd image).
    pub(crate) fn memfd(&self) -> RawFd {
        self.memfd.as_raw_fd()
    }
}

impl Drop for Stash {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping; no reference into it outlives `self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.mapped) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_all(stash: &Stash, room: usize, peek: bool) -> Vec<u8> {
        let mut out = Vec::new();
        let n = stash
            .read(room, peek, |bytes| {
                out = bytes.to_vec();
                Ok(())
            })
            .unwrap();
        assert_eq!(n, out.len());
        out
    }

    fn ready(stash: &Stash) -> bool {
        let mut entry = libc::pollfd {
            fd: stash.ready_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd, zero timeout.
        unsafe { libc::poll(&mut entry, 1, 0) == 1 }
    }

    #[test]
    fn bytes_come_out_once_in_order_and_readiness_follows() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        let stash = Stash::create(&data).expect("stash");
        assert!(ready(&stash));
        assert_eq!(read_all(&stash, 100, true), data[..100]);
        assert_eq!(
            read_all(&stash, 100, false),
            data[..100],
            "peek consumed nothing"
        );
        assert_eq!(stash.remaining(), 9_900);
        assert_eq!(read_all(&stash, usize::MAX, false), data[100..]);
        assert_eq!(stash.remaining(), 0);
        assert!(!ready(&stash), "empty stash is not readable");
        assert!(read_all(&stash, 10, false).is_empty());
    }

    #[test]
    fn a_forked_child_shares_the_read_position() {
        let data = b"0123456789".repeat(100);
        let stash = Stash::create(&data).expect("stash");
        assert_eq!(read_all(&stash, 10, false), b"0123456789");
        // SAFETY: the child only reads shared memory and exits with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let got = read_all(&stash, 500, false);
            // SAFETY: leave the child without running the test harness's destructors.
            unsafe { libc::_exit(if got == data[10..510] { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(status, 0, "child read the bytes after the parent's");
        assert_eq!(read_all(&stash, usize::MAX, false), data[510..]);
    }

    #[test]
    fn adopt_checks_the_header() {
        let stash = Stash::create(b"hello").expect("stash");
        // SAFETY: duplicating our own memfd.
        let copy = owned(unsafe { libc::dup(stash.memfd()) }).unwrap();
        let adopted = Stash::adopt(copy).expect("adopt");
        assert_eq!(read_all(&adopted, 2, false), b"he");
        assert_eq!(read_all(&stash, 10, false), b"llo", "same position");
        // A memfd that is not a stash.
        // SAFETY: plain memfd_create + ftruncate on a fresh descriptor.
        let other = owned(unsafe { libc::memfd_create(c"x".as_ptr(), 0) }).unwrap();
        // SAFETY: as above.
        unsafe { libc::ftruncate(other.as_raw_fd(), 4096) };
        assert!(Stash::adopt(other).is_none());
    }
}
