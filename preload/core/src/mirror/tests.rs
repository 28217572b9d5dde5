//! Internal descriptors leave the low numbers to the application.

use super::*;

fn eventfd() -> OwnedFd {
    // SAFETY: plain eventfd(2).
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(raw >= 0, "eventfd");
    // SAFETY: fresh descriptor owned by nobody else.
    unsafe { OwnedFd::from_raw_fd(raw) }
}

#[test]
fn internal_descriptors_leave_the_low_numbers_to_the_application() {
    let floor = san_shm::internal_fd_floor();
    assert!(
        floor > 64,
        "test runs with a soft RLIMIT_NOFILE of at least 130"
    );
    let low = eventfd();
    assert!(low.as_raw_fd() < floor);
    let moved = relocate_internal_fd(low);
    assert!(moved.as_raw_fd() >= floor, "moved to {}", moved.as_raw_fd());
    // SAFETY: F_GETFD on our own descriptor.
    let flags = unsafe { libc::fcntl(moved.as_raw_fd(), libc::F_GETFD) };
    assert_eq!(
        flags & libc::FD_CLOEXEC,
        libc::FD_CLOEXEC,
        "stays close-on-exec"
    );
    // A descriptor already above the floor stays.
    let number = moved.as_raw_fd();
    assert_eq!(relocate_internal_fd(moved).as_raw_fd(), number);
}
