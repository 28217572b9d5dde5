//! The descriptor lifetime hooks: `close`, `close_range`, the `dup` family, `fcntl`, `ioctl`.

use core::ffi::{c_int, c_uint, c_ulong};

use crate::fdtable::{table, FdEntry};
use crate::guard::{self, bookkeeping, ReentrancyGuard};
use crate::record::flags;
use crate::track::{record_of, release_closing, track_dup, tracked, untrack};
use crate::{errno, real};

/// `close(2)`. The entry is cleared *before* the real close: once the kernel frees the number,
/// another thread's `socket()` may reuse it, and its fresh entry must not be wiped by us.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn close(fd: c_int) -> c_int {
    let entry = table().take(fd);
    if !entry.is_none() {
        bookkeeping(|| release_closing(fd, entry));
    }
    // SAFETY: forwarded.
    unsafe { real::close(fd) }
}

/// `close_range(2)`.
///
/// # Safety
/// As the C function.
pub unsafe fn close_range(first: c_uint, last: c_uint, range_flags: c_int) -> c_int {
    let known = (libc::CLOSE_RANGE_CLOEXEC | libc::CLOSE_RANGE_UNSHARE) as c_int;
    let valid = first <= last && range_flags & !known == 0;
    let first_fd = first.min(c_int::MAX as c_uint) as c_int;
    let last_fd = last.min(c_int::MAX as c_uint) as c_int;
    let only_cloexec = range_flags & libc::CLOSE_RANGE_CLOEXEC as c_int != 0;
    if valid && !only_cloexec && table().high_water() >= first_fd {
        bookkeeping(|| table().for_each_in(first_fd, last_fd, |fd, _| untrack(fd)));
    }
    // SAFETY: forwarded.
    let rc = unsafe { real::close_range(first, last, range_flags) };
    if rc == 0 && only_cloexec {
        bookkeeping(|| {
            table().for_each_in(first_fd, last_fd, |fd, entry| {
                table().update(fd, entry, entry.with_cloexec(true));
            })
        });
    }
    rc
}

/// `dup(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn dup(fd: c_int) -> c_int {
    let entry = tracked(fd);
    // SAFETY: forwarded.
    let new_fd = unsafe { real::dup(fd) };
    if let (true, Some(entry)) = (new_fd >= 0, entry) {
        bookkeeping(|| track_dup(new_fd, entry.with_cloexec(false)));
    }
    new_fd
}

fn after_dup2(old: c_int, new: c_int, old_entry: FdEntry, cloexec: bool) {
    if old == new {
        return;
    }
    bookkeeping(|| {
        if old_entry.is_none() {
            untrack(new); // the kernel closed whatever `new` was
        } else {
            track_dup(new, old_entry.with_cloexec(cloexec));
        }
    });
}

/// `fd` is about to be closed implicitly (the target of `dup2`/`dup3`): a pending SAN client
/// switches first, which reads the acceptor's switch marker while the number still names the
/// socket (an unread byte would make the kernel reset the connection instead of closing it).
#[inline(always)]
fn before_replaced(fd: c_int, entry: FdEntry) {
    if entry.is_none() || guard::is_inside() || crate::san::live_sockets() == 0 {
        return;
    }
    if let Some(index) = crate::san::attached_index(entry) {
        let _errno = errno::Preserved::save();
        let _guard = ReentrancyGuard::enter();
        let _ = crate::san::mirror_of(fd, index);
    }
}

/// `dup2(2)`: a tracked target is released (the kernel closed it), atomically with the swap.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn dup2(old: c_int, new: c_int) -> c_int {
    let old_entry = table().lookup(old);
    let new_entry = table().lookup(new);
    before_replaced(new, new_entry);
    // SAFETY: forwarded.
    let rc = unsafe { real::dup2(old, new) };
    if rc >= 0 && !(old_entry.is_none() && new_entry.is_none()) && !guard::is_inside() {
        after_dup2(old, new, old_entry, false);
    }
    rc
}

/// `dup3(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn dup3(old: c_int, new: c_int, dup_flags: c_int) -> c_int {
    let old_entry = table().lookup(old);
    let new_entry = table().lookup(new);
    if old != new {
        before_replaced(new, new_entry);
    }
    // SAFETY: forwarded.
    let rc = unsafe { real::dup3(old, new, dup_flags) };
    if rc >= 0 && !(old_entry.is_none() && new_entry.is_none()) && !guard::is_inside() {
        after_dup2(old, new, old_entry, dup_flags & libc::O_CLOEXEC != 0);
    }
    rc
}

fn after_fcntl(fd: c_int, entry: FdEntry, cmd: c_int, arg: usize, rc: c_int) {
    bookkeeping(|| match cmd {
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
            track_dup(rc, entry.with_cloexec(cmd == libc::F_DUPFD_CLOEXEC))
        }
        libc::F_SETFD => {
            table().update(
                fd,
                entry,
                entry.with_cloexec(arg as c_int & libc::FD_CLOEXEC != 0),
            );
        }
        libc::F_SETFL => {
            if let Some((_, record)) = record_of(entry) {
                record.set_flag(flags::NONBLOCK, arg as c_int & libc::O_NONBLOCK != 0);
            }
        }
        _ => {}
    });
}

fn fcntl_changes_state(cmd: c_int) -> bool {
    matches!(
        cmd,
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC | libc::F_SETFD | libc::F_SETFL
    )
}

/// `fcntl(2)`; the variadic argument arrives pointer-sized, as glibc reads it.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let entry = table().lookup(fd);
    // SAFETY: forwarded.
    let rc = unsafe { real::fcntl(fd, cmd, arg) };
    if rc >= 0 && !entry.is_none() && fcntl_changes_state(cmd) && !guard::is_inside() {
        after_fcntl(fd, entry, cmd, arg, rc);
    }
    rc
}

/// `fcntl64` (glibc ≥ 2.28).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let entry = table().lookup(fd);
    // SAFETY: forwarded.
    let rc = unsafe { real::fcntl64(fd, cmd, arg) };
    if rc >= 0 && !entry.is_none() && fcntl_changes_state(cmd) && !guard::is_inside() {
        after_fcntl(fd, entry, cmd, arg, rc);
    }
    rc
}

/// `ioctl(2)`; FIONBIO is tracked.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn ioctl(fd: c_int, request: c_ulong, arg: usize) -> c_int {
    let entry = table().lookup(fd);
    if request == libc::FIONREAD as c_ulong && arg != 0 && !entry.is_none() && !guard::is_inside() {
        if let Some(index) = crate::san::san_index(entry) {
            let _guard = ReentrancyGuard::enter();
            if let Some(bytes) = crate::san::readable_bytes(fd, index) {
                // SAFETY: FIONREAD takes an int pointer (the caller's, written guardedly: one
                // the process may not write is the kernel's EFAULT).
                if unsafe { crate::fault::write_app(arg as *mut c_int, bytes) }.is_err() {
                    crate::errno::set(libc::EFAULT);
                    return -1;
                }
                return 0;
            }
        }
    }
    // SAFETY: forwarded.
    let rc = unsafe { real::ioctl(fd, request, arg) };
    if rc == 0
        && (request == libc::FIOCLEX as c_ulong || request == libc::FIONCLEX as c_ulong)
        && !entry.is_none()
        && !guard::is_inside()
    {
        // CPython's os.set_inheritable and others flip close-on-exec this way.
        let cloexec = request == libc::FIOCLEX as c_ulong;
        bookkeeping(|| {
            table().update(fd, entry, entry.with_cloexec(cloexec));
        });
    }
    if rc == 0 && request == libc::FIONBIO && !entry.is_none() && arg != 0 && !guard::is_inside() {
        // SAFETY: FIONBIO takes an int pointer, and the kernel just read it successfully.
        let on = unsafe { (arg as *const c_int).read_unaligned() } != 0;
        bookkeeping(|| {
            if let Some((_, record)) = record_of(entry) {
                record.set_flag(flags::NONBLOCK, on);
            }
        });
    }
    rc
}
