//! Internal descriptors leave the low numbers to the application; the nudge request waits out
//! a call under way.

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

/// A nudge request is taken only while none of the owner's threads is inside a call (such a
/// call drives the connection itself); it stays for a transmission after the last call ended,
/// is taken once, and a stray end of a call never makes the count read as a call under way.
#[test]
fn a_nudge_request_waits_until_no_call_of_the_owner_is_under_way() {
    let words = MirrorWords::new();
    words.set_progress_wanted(true);
    words.enter_call();
    words.enter_call();
    assert!(!words.take_progress_wanted(), "two calls under way");
    words.leave_call();
    assert!(!words.take_progress_wanted(), "one call under way");
    words.leave_call();
    assert!(words.take_progress_wanted(), "the request stayed");
    assert!(!words.take_progress_wanted(), "taken once");

    words.leave_call();
    words.set_progress_wanted(true);
    assert!(words.take_progress_wanted(), "an extra end counts nothing");
}
