//! The signal-disposition hooks: `sigaction` and glibc's other ways of setting one. Every
//! signal but SIGSEGV and SIGBUS is the C library's call and nothing else (no lock, no
//! allocation). Those two go through [`crate::fault`], which keeps the library's fault
//! handler installed once a connection switched and answers for the application's setting.

use core::ffi::c_int;

use crate::{fault, real};

/// `sigaction(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sigaction(
    signum: c_int,
    act: *const libc::sigaction,
    oldact: *mut libc::sigaction,
) -> c_int {
    // SAFETY: the caller's pointers, as for the C function.
    match unsafe { fault::sigaction(signum, act, oldact) } {
        Some(rc) => rc,
        // SAFETY: forwarded.
        None => unsafe { real::sigaction(signum, act, oldact) },
    }
}

/// glibc's `__sigaction`: as [`sigaction`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn __sigaction(
    signum: c_int,
    act: *const libc::sigaction,
    oldact: *mut libc::sigaction,
) -> c_int {
    // SAFETY: the caller's pointers, as for the C function.
    match unsafe { fault::sigaction(signum, act, oldact) } {
        Some(rc) => rc,
        // SAFETY: forwarded.
        None => unsafe { real::__sigaction(signum, act, oldact) },
    }
}

/// `signal(3)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn signal(signum: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: forwarded.
    fault::bsd_signal(signum, handler).unwrap_or_else(|| unsafe { real::signal(signum, handler) })
}

/// `bsd_signal(3)`: as [`signal`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn bsd_signal(signum: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: forwarded.
    fault::bsd_signal(signum, handler)
        .unwrap_or_else(|| unsafe { real::bsd_signal(signum, handler) })
}

/// `ssignal(3)`: as [`signal`] (glibc makes it the same function).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn ssignal(signum: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: forwarded.
    fault::bsd_signal(signum, handler).unwrap_or_else(|| unsafe { real::ssignal(signum, handler) })
}

/// `sysv_signal(3)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sysv_signal(signum: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: forwarded.
    fault::sysv_signal(signum, handler)
        .unwrap_or_else(|| unsafe { real::sysv_signal(signum, handler) })
}

/// glibc's `__sysv_signal`: as [`sysv_signal`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn __sysv_signal(signum: c_int, handler: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: forwarded.
    fault::sysv_signal(signum, handler)
        .unwrap_or_else(|| unsafe { real::__sysv_signal(signum, handler) })
}

/// `sigset(3)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sigset(signum: c_int, disposition: libc::sighandler_t) -> libc::sighandler_t {
    // SAFETY: forwarded.
    fault::sigset(signum, disposition)
        .unwrap_or_else(|| unsafe { real::sigset(signum, disposition) })
}

/// `sigignore(3)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sigignore(signum: c_int) -> c_int {
    // SAFETY: forwarded.
    fault::sigignore(signum).unwrap_or_else(|| unsafe { real::sigignore(signum) })
}

/// `siginterrupt(3)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn siginterrupt(signum: c_int, interrupt: c_int) -> c_int {
    // SAFETY: forwarded.
    fault::siginterrupt(signum, interrupt != 0)
        .unwrap_or_else(|| unsafe { real::siginterrupt(signum, interrupt) })
}
