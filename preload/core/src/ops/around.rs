//! Paths that would reach a socket's kernel side around the other hooks: libc's `syscall()`
//! (raw socket I/O by number, and `io_uring_setup`, whose ring would carry I/O and `epoll_ctl`
//! past every hook) and `fdopen` (stdio calls glibc's internal `read`/`write`, which no
//! preload sees). After the switch a SAN socket's kernel side carries no data, so each of
//! these either goes through the hooks or is refused in a way programs handle.

use core::ffi::{c_char, c_int, c_long, c_void};

use libc::{size_t, ssize_t};

use crate::fdtable::table;
use crate::guard;
use crate::settings::{self, Mode};
use crate::{errno, real};

/// `syscall(3)`. Socket I/O and epoll calls by number run as their hooks (so a SAN socket
/// keeps its stream order and its readiness, and a tracked one its counters); `io_uring_setup` is refused with `ENOSYS` while
/// connections may switch to the SAN; every other number is the real `syscall` with the six
/// argument registers as the caller left them (no lock, allocation or logging).
///
/// # Safety
/// As the C function for `number`.
#[inline(always)]
pub unsafe fn syscall(
    number: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    let fd = a1 as c_int;
    // SAFETY: every arm passes the caller's arguments on as the system call takes them.
    unsafe {
        match number {
            libc::SYS_read => super::data::read(fd, a2 as *mut c_void, a3 as size_t) as c_long,
            libc::SYS_write => super::data::write(fd, a2 as *const c_void, a3 as size_t) as c_long,
            libc::SYS_readv => {
                super::data::readv(fd, a2 as *const libc::iovec, a3 as c_int) as c_long
            }
            libc::SYS_writev => {
                super::data::writev(fd, a2 as *const libc::iovec, a3 as c_int) as c_long
            }
            libc::SYS_recvfrom => super::data::recvfrom(
                fd,
                a2 as *mut c_void,
                a3 as size_t,
                a4 as c_int,
                a5 as *mut libc::sockaddr,
                a6 as *mut libc::socklen_t,
            ) as c_long,
            libc::SYS_sendto => super::data::sendto(
                fd,
                a2 as *const c_void,
                a3 as size_t,
                a4 as c_int,
                a5 as *const libc::sockaddr,
                a6 as libc::socklen_t,
            ) as c_long,
            libc::SYS_recvmsg => {
                super::data::recvmsg(fd, a2 as *mut libc::msghdr, a3 as c_int) as c_long
            }
            libc::SYS_sendmsg => {
                super::data::sendmsg(fd, a2 as *const libc::msghdr, a3 as c_int) as c_long
            }
            libc::SYS_recvmmsg => super::data::recvmmsg(
                fd,
                a2 as *mut libc::mmsghdr,
                a3 as libc::c_uint,
                a4 as c_int,
                a5 as *mut libc::timespec,
            ) as c_long,
            libc::SYS_sendmmsg => super::data::sendmmsg(
                fd,
                a2 as *mut libc::mmsghdr,
                a3 as libc::c_uint,
                a4 as c_int,
            ) as c_long,
            libc::SYS_close => super::fd::close(fd) as c_long,
            libc::SYS_shutdown => super::socket::shutdown(fd, a2 as c_int) as c_long,
            libc::SYS_epoll_ctl => super::readiness::epoll_ctl(
                fd,
                a2 as c_int,
                a3 as c_int,
                a4 as *mut libc::epoll_event,
            ) as c_long,
            // (Waits too: they report what the kernel's registration of a SAN socket leaves
            // to them, see `san::epoll_output`.)
            #[cfg(target_arch = "x86_64")]
            libc::SYS_epoll_wait => super::readiness::epoll_wait(
                fd,
                a2 as *mut libc::epoll_event,
                a3 as c_int,
                a4 as c_int,
            ) as c_long,
            // The kernel's signal set is 8 bytes; another size with a mask is the kernel's
            // `EINVAL`, left to it.
            libc::SYS_epoll_pwait if a5 == 0 || a6 == 8 => super::readiness::epoll_pwait(
                fd,
                a2 as *mut libc::epoll_event,
                a3 as c_int,
                a4 as c_int,
                a5 as *const libc::sigset_t,
            ) as c_long,
            libc::SYS_io_uring_setup if io_uring_refused() => {
                errno::set(libc::ENOSYS);
                -1
            }
            _ => real::syscall(number, a1, a2, a3, a4, a5, a6),
        }
    }
}

/// True while connections of this process may switch to the SAN: then an io_uring is
/// refused, as a kernel without io_uring refuses it (`ENOSYS`), and the program uses its
/// epoll or thread-pool path (libuv, Envoy, Dragonfly, monoio). Its ring would submit reads,
/// writes and `epoll_ctl` straight to the kernel, past every hook.
fn io_uring_refused() -> bool {
    settings::tracking_enabled()
        && settings::settings().is_some_and(|s| s.san && s.mode == Mode::Auto)
}

/// glibc's `cookie_io_functions_t`.
#[repr(C)]
struct CookieFunctions {
    read: Option<unsafe extern "C" fn(*mut c_void, *mut c_char, size_t) -> ssize_t>,
    write: Option<unsafe extern "C" fn(*mut c_void, *const c_char, size_t) -> ssize_t>,
    seek: Option<unsafe extern "C" fn(*mut c_void, *mut i64, c_int) -> c_int>,
    close: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
}

extern "C" {
    /// glibc's `fopencookie(3)` (not declared by the `libc` crate).
    fn fopencookie(
        cookie: *mut c_void,
        mode: *const c_char,
        functions: CookieFunctions,
    ) -> *mut libc::FILE;
}

/// The head of glibc's `struct _IO_FILE` (bits/types/struct_FILE.h, a public and stable
/// layout): `_flags`, eleven buffer pointers, `_markers`, `_chain`, then `_fileno`.
#[repr(C)]
struct GlibcFileHead {
    flags: c_int,
    pointers: [*mut c_void; 13],
    fileno: c_int,
}

/// The descriptor a stream cookie stands for.
fn cookie_fd(cookie: *mut c_void) -> c_int {
    cookie as usize as c_int
}

/// A stream's read: the `read` hook.
unsafe extern "C" fn stream_read(cookie: *mut c_void, buf: *mut c_char, size: size_t) -> ssize_t {
    // SAFETY: glibc hands a buffer of `size` bytes.
    unsafe { super::data::read(cookie_fd(cookie), buf.cast(), size) }
}

/// A stream's write: the `write` hook until everything went, as glibc's own file streams
/// write (a failure after a partial write reports the part).
unsafe extern "C" fn stream_write(
    cookie: *mut c_void,
    buf: *const c_char,
    size: size_t,
) -> ssize_t {
    let mut done = 0usize;
    // Bounded: every turn writes at least one byte or ends.
    while done < size {
        // SAFETY: glibc hands `size` bytes; `done` stays below it.
        let n = unsafe { super::data::write(cookie_fd(cookie), buf.add(done).cast(), size - done) };
        if n <= 0 {
            return if done > 0 { done as ssize_t } else { n };
        }
        done += n as usize;
    }
    done as ssize_t
}

/// A socket cannot seek: `ESPIPE`, as `lseek` answers on one.
unsafe extern "C" fn stream_seek(_cookie: *mut c_void, _offset: *mut i64, _whence: c_int) -> c_int {
    errno::set(libc::ESPIPE);
    -1
}

/// `fclose`: the `close` hook on the stream's descriptor, as for a stream of `fdopen`.
unsafe extern "C" fn stream_close(cookie: *mut c_void) -> c_int {
    // SAFETY: the stream owns its descriptor (fdopen's contract).
    unsafe { super::fd::close(cookie_fd(cookie)) }
}

/// `fdopen(3)`. On a SAN socket (pending, switched or holding a stash) glibc's stream would
/// read and write the kernel socket directly: the stream is built with `fopencookie` over
/// the `read`/`write`/`close` hooks instead, with the socket as its `fileno`, so stdio keeps
/// the stream's order and the speed-up. Every other descriptor gets glibc's `fdopen`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn fdopen(fd: c_int, mode: *const c_char) -> *mut libc::FILE {
    if crate::san::san_index(table().lookup(fd)).is_none() || guard::is_inside() || mode.is_null() {
        // SAFETY: forwarded.
        return unsafe { real::fdopen(fd, mode) };
    }
    // SAFETY: a NUL-terminated mode string (the caller's contract).
    let mode_text = unsafe { core::ffi::CStr::from_ptr(mode) }.to_bytes();
    let (reads, writes, appends) = match mode_text.first() {
        Some(b'r') => (true, false, false),
        Some(b'w') => (false, true, false),
        Some(b'a') => (false, true, true),
        _ => {
            errno::set(libc::EINVAL);
            return core::ptr::null_mut();
        }
    };
    // glibc reads up to six mode characters after the first for '+'.
    let plus = mode_text.iter().skip(1).take(6).any(|&c| c == b'+');
    let (reads, writes) = (reads || plus, writes || plus);
    // SAFETY: F_GETFL only reads the descriptor's status flags.
    let status = unsafe { real::fcntl(fd, libc::F_GETFL, 0) };
    if status < 0 {
        return core::ptr::null_mut();
    }
    let access = status & libc::O_ACCMODE;
    if (reads && access == libc::O_WRONLY) || (writes && access == libc::O_RDONLY) {
        errno::set(libc::EINVAL);
        return core::ptr::null_mut();
    }
    if appends && status & libc::O_APPEND == 0 {
        // As glibc's fdopen: the descriptor takes O_APPEND.
        // SAFETY: F_SETFL with the flags just read.
        if unsafe { real::fcntl(fd, libc::F_SETFL, (status | libc::O_APPEND) as usize) } < 0 {
            return core::ptr::null_mut();
        }
    }
    let cookie_mode: &core::ffi::CStr = match (mode_text[0], plus) {
        (b'r', false) => c"r",
        (b'r', true) => c"r+",
        (b'w', false) => c"w",
        (b'w', true) => c"w+",
        (_, false) => c"a",
        (_, true) => c"a+",
    };
    let functions = CookieFunctions {
        read: Some(stream_read),
        write: Some(stream_write),
        seek: Some(stream_seek),
        close: Some(stream_close),
    };
    // SAFETY: a valid mode and functions; the cookie is the descriptor number.
    let stream =
        unsafe { fopencookie(fd as usize as *mut c_void, cookie_mode.as_ptr(), functions) };
    if !stream.is_null() {
        // `fileno` of the stream is the socket, as for glibc's fdopen (a cookie stream has
        // none); glibc does no I/O on it by number: every transfer goes through the cookie.
        // SAFETY: glibc's FILE begins with this public layout; the stream is ours until
        // returned.
        unsafe { (*stream.cast::<GlibcFileHead>()).fileno = fd };
    }
    stream
}
