//! The passthrough path (a hook on an fd that is not ours) must never allocate: it runs inside
//! malloc interposers, signal handlers and forked children. A counting global allocator
//! proves it for the fd-table lookup and for whole hook bodies on foreign fds.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    /// Allocations made by this thread. Per thread: the test harness's own thread may
    /// allocate while the test runs (it does when it first blocks waiting for the test's
    /// result, which under load can come after the test took its first count), and that is
    /// not the hooks' doing. (A const-initialized `Cell` needs no allocation to access.)
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn count_one() {
    let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
}

fn allocations() -> usize {
    ALLOCATIONS.with(Cell::get)
}

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count_one();
        // SAFETY: forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count_one();
        // SAFETY: forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn passthrough_hooks_do_not_allocate() {
    use preload_core::{fdtable, ops, real};
    real::resolve_all();
    let mut pipe = [0; 2];
    // SAFETY: pipe creation.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let (read_end, write_end) = (pipe[0], pipe[1]);
    let mut buf = [0u8; 16];
    let before = allocations();
    for round in 0..10_000 {
        assert!(fdtable::table().lookup(read_end).is_none());
        assert!(fdtable::table().lookup(70_000 + round).is_none());
        // SAFETY: valid pipe fds and buffers.
        unsafe {
            assert_eq!(ops::write(write_end, b"x".as_ptr().cast(), 1), 1);
            assert_eq!(ops::read(read_end, buf.as_mut_ptr().cast(), buf.len()), 1);
            assert_eq!(
                ops::fcntl(read_end, libc::F_GETFD, 0) & !libc::FD_CLOEXEC,
                0
            );
            let mut pfd = libc::pollfd {
                fd: read_end,
                events: libc::POLLIN,
                revents: 0,
            };
            assert_eq!(ops::poll(&mut pfd, 1, 0), 0);
            // libc's syscall(): a socket I/O number on a descriptor not ours, and any other.
            let (fd, data) = (libc::c_long::from(write_end), b"y".as_ptr() as libc::c_long);
            assert_eq!(ops::syscall(libc::SYS_write, fd, data, 1, 0, 0, 0), 1);
            let (fd, into) = (
                libc::c_long::from(read_end),
                buf.as_mut_ptr() as libc::c_long,
            );
            assert_eq!(ops::syscall(libc::SYS_read, fd, into, 16, 0, 0, 0), 1);
            assert!(ops::syscall(libc::SYS_getppid, 0, 0, 0, 0, 0, 0) > 0);
        }
    }
    // SAFETY: our fds.
    unsafe {
        assert_eq!(ops::close(read_end), 0);
        assert_eq!(ops::close(write_end), 0);
    }
    assert_eq!(allocations() - before, 0, "the passthrough path allocated");
}
