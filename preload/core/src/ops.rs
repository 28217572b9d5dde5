//! What every hook does. The exported functions in the cdylib are one-line calls into here.
//!
//! # The passthrough path
//!
//! For an fd that is not ours a hook does exactly: one atomic load from the fd table, then the
//! real call through its resolved pointer. No lock, no allocation, no logging, no `std::env`,
//! no errno change: async-signal-safe. Calls that never need per-fd state today (`poll`,
//! `select`, `epoll_wait`, `getsockname`, …) go straight to the real function.
//!
//! # The tracked path
//!
//! For our fds the real call still happens first and its result (and `errno`) is what the
//! caller gets. The bookkeeping after it runs inside `bookkeeping`: `errno` is saved and
//! restored, the reentrancy guard is held, and a panic (which would be a bug) is caught and
//! counted — the real call's result is returned regardless, because turning a completed
//! `accept` or `close` into a failure would leak or double-close an fd. Nothing runs the real
//! call twice.

use core::ffi::{c_int, c_uint, c_ulong, c_void};
use core::sync::atomic::Ordering;

use libc::{size_t, sockaddr, socklen_t, ssize_t};

use crate::config::Role;
use crate::fdtable::{table, FdEntry};
use crate::guard::{self, bookkeeping, ReentrancyGuard};
use crate::record::{flags, Bypass, Counter, SocketRecord, SocketState};
use crate::registry::registry;
use crate::san::RawBuf;
use crate::track::{
    count_bytes, decode_sockaddr, family_flag, is_tcp, local_address, mark_connected,
    note_registration, on_connect_started, peer_address, record_of, release_closing, track_dup,
    track_epoll_instance, track_new, tracked, untrack,
};
use crate::{errno, real, settings};

/// A data call: one lookup, the real call, and a counter bump for our sockets. A socket on
/// the SAN path goes through `san` instead (which may answer `None`: it is TCP after all).
#[inline(always)]
fn data_call(
    fd: c_int,
    counter: Counter,
    san: impl FnOnce(u32) -> Option<ssize_t>,
    call: impl FnOnce() -> ssize_t,
) -> ssize_t {
    let entry = table().lookup(fd);
    if !entry.is_none() {
        if let Some(result) = san_data_call(entry, san) {
            return result;
        }
    }
    let result = call();
    if !entry.is_none() && result > 0 {
        count_bytes(entry, counter, result as u64);
    }
    result
}

/// The SAN branch of [`data_call`]: guard held (our own libc calls pass through), a panic
/// counted and reported as a reset connection rather than unwinding into C.
#[inline]
fn san_data_call(entry: FdEntry, san: impl FnOnce(u32) -> Option<ssize_t>) -> Option<ssize_t> {
    let index = crate::san::san_index(entry)?;
    if guard::is_inside() {
        // Only a signal handler that interrupted one of our own hooks on this thread gets
        // here (our code never does data calls through the hooks). The SAN state may be
        // mid-update under a lock this thread holds, and the kernel socket would put the bytes
        // out of order: the call is interrupted instead, which the handler can retry later.
        errno::set(libc::EINTR);
        return Some(-1);
    }
    let _guard = ReentrancyGuard::enter();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| san(index))) {
        Ok(result) => result,
        Err(_) => {
            guard::note_internal_fault();
            errno::set(libc::ECONNRESET);
            Some(-1)
        }
    }
}

fn one_buf(ptr: *const c_void, len: size_t) -> [RawBuf; 1] {
    [RawBuf {
        ptr: ptr.cast_mut().cast(),
        len,
    }]
}

/// The caller's iovec array as buffers (an invalid count gives `EINVAL` from the SAN path
/// exactly where the kernel would).
///
/// # Safety
/// `iov` must point to `count` iovecs when `count` is positive.
unsafe fn iov_bufs(iov: *const libc::iovec, count: c_int) -> Option<Vec<RawBuf>> {
    if !(0..=libc::UIO_MAXIOV).contains(&count) || (count > 0 && iov.is_null()) {
        return None;
    }
    if count == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the caller's vector of `count` entries.
    let vector = unsafe { core::slice::from_raw_parts(iov, count as usize) };
    Some(
        vector
            .iter()
            .map(|v| RawBuf {
                ptr: v.iov_base.cast(),
                len: v.iov_len,
            })
            .collect(),
    )
}

fn san_send_iov(
    fd: c_int,
    index: u32,
    bufs: Option<Vec<RawBuf>>,
    send_flags: c_int,
) -> Option<ssize_t> {
    match bufs {
        Some(bufs) => crate::san::send_iov(fd, index, &bufs, send_flags),
        None => {
            errno::set(libc::EINVAL);
            Some(-1)
        }
    }
}

fn san_recv_iov(
    fd: c_int,
    index: u32,
    bufs: Option<Vec<RawBuf>>,
    recv_flags: c_int,
) -> Option<ssize_t> {
    match bufs {
        Some(bufs) => crate::san::recv_iov(fd, index, &bufs, recv_flags),
        None => {
            errno::set(libc::EINVAL);
            Some(-1)
        }
    }
}

/// A connected TCP socket reports no source address: `*addrlen = 0`, as the kernel does.
///
/// # Safety
/// `addrlen` must be null or writable.
unsafe fn clear_addrlen(addrlen: *mut socklen_t) {
    if !addrlen.is_null() {
        // SAFETY: writable per the contract.
        unsafe { addrlen.write_unaligned(0) };
    }
}

/// As [`data_call`] for the `*mmsg` calls, which return a message count.
#[inline(always)]
fn mmsg_call(
    fd: c_int,
    counter: Counter,
    msgvec: *const libc::mmsghdr,
    call: impl FnOnce() -> c_int,
) -> c_int {
    let entry = table().lookup(fd);
    let result = call();
    if !entry.is_none() && result > 0 && !msgvec.is_null() {
        // SAFETY: the kernel just filled `result` entries of the caller's vector.
        let messages = unsafe { core::slice::from_raw_parts(msgvec, result as usize) };
        let bytes = messages.iter().map(|m| u64::from(m.msg_len)).sum();
        count_bytes(entry, counter, bytes);
    }
    result
}

// ---- sockets ------------------------------------------------------------------------------

/// `socket(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn socket(domain: c_int, ty: c_int, protocol: c_int) -> c_int {
    // SAFETY: forwarded.
    let fd = unsafe { real::socket(domain, ty, protocol) };
    if fd >= 0
        && is_tcp(domain, ty, protocol)
        && settings::tracking_enabled()
        && !guard::is_inside()
    {
        bookkeeping(|| {
            let nonblock = if ty & libc::SOCK_NONBLOCK != 0 {
                flags::NONBLOCK
            } else {
                0
            };
            track_new(
                fd,
                SocketState::TcpCandidate,
                family_flag(domain) | nonblock,
                ty & libc::SOCK_CLOEXEC != 0,
            );
        });
    }
    fd
}

/// `socketpair(2)`: never a SAN candidate.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn socketpair(domain: c_int, ty: c_int, protocol: c_int, fds: *mut c_int) -> c_int {
    // SAFETY: forwarded.
    unsafe { real::socketpair(domain, ty, protocol, fds) }
}

/// `bind(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    // SAFETY: forwarded.
    unsafe { real::bind(fd, addr, len) }
}

/// `listen(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn listen(fd: c_int, backlog: c_int) -> c_int {
    let entry = tracked(fd);
    // SAFETY: forwarded.
    let rc = unsafe { real::listen(fd, backlog) };
    if let (0, Some(entry)) = (rc, entry) {
        bookkeeping(|| {
            if let Some((index, record)) = record_of(entry) {
                record.set_addresses(local_address(fd), None);
                record.set_state(SocketState::Listener);
                crate::san::on_listen(fd, index);
            }
        });
    }
    rc
}

fn on_accepted(listener: Option<FdEntry>, fd: c_int, accept_flags: c_int) {
    let Some(listener) = listener else { return };
    bookkeeping(|| {
        let Some((listener_index, listening)) = record_of(listener) else {
            return;
        };
        if listening.state() != SocketState::Listener {
            return;
        }
        let inet6 = listening.flags() & flags::INET6;
        // An accepted socket inherits the listener's timeouts.
        let timeouts = listening.flags() & (flags::RCVTIMEO | flags::SNDTIMEO);
        let nonblock = if accept_flags & libc::SOCK_NONBLOCK != 0 {
            flags::NONBLOCK
        } else {
            0
        };
        let cloexec = accept_flags & libc::SOCK_CLOEXEC != 0;
        if let Some(record) = track_new(
            fd,
            SocketState::TcpCandidate,
            inet6 | nonblock | timeouts | flags::SERVER,
            cloexec,
        ) {
            mark_connected(record, Role::Server, local_address(fd), peer_address(fd));
            if let Some(index) = table().lookup(fd).socket_index() {
                crate::san::on_accepted(listener_index, fd, index, record);
            }
        }
    });
}

/// `accept(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let listener = tracked(fd);
    // SAFETY: forwarded.
    let new_fd = unsafe { real::accept(fd, addr, len) };
    if new_fd >= 0 {
        on_accepted(listener, new_fd, 0);
    }
    new_fd
}

/// `accept4(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    accept_flags: c_int,
) -> c_int {
    let listener = tracked(fd);
    // SAFETY: forwarded.
    let new_fd = unsafe { real::accept4(fd, addr, len, accept_flags) };
    if new_fd >= 0 {
        on_accepted(listener, new_fd, accept_flags);
    }
    new_fd
}

/// `connect(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let entry = tracked(fd);
    let plan = match entry {
        // SAFETY: the caller's address, as for the C function.
        Some(entry) => unsafe { plan_san_client(fd, entry, addr, len) },
        None => None,
    };
    // SAFETY: forwarded.
    let rc = unsafe { real::connect(fd, addr, len) };
    let Some(entry) = entry else { return rc };
    let in_progress = rc != 0 && errno::get() == libc::EINPROGRESS;
    if rc == 0 || in_progress {
        // SAFETY: the kernel accepted (addr, len) as a valid address just now.
        let peer = unsafe { decode_sockaddr(addr, len) };
        bookkeeping(|| on_connect_started(fd, entry, peer, in_progress));
    }
    if let Some((index, record, plan)) = plan {
        bookkeeping(|| crate::san::after_connect(index, record, plan, rc == 0 || in_progress));
    }
    rc
}

/// The SAN preparation of a client's first `connect()` (see `san::before_connect`).
///
/// # Safety
/// `addr` must be null or point to `len` readable bytes.
#[cold]
unsafe fn plan_san_client(
    fd: c_int,
    entry: FdEntry,
    addr: *const sockaddr,
    len: socklen_t,
) -> Option<(u32, &'static SocketRecord, crate::san::ClientPlan)> {
    let (index, record) = record_of(entry)?;
    if record.state() != SocketState::TcpCandidate || !crate::san::enabled() {
        return None;
    }
    // SAFETY: per the contract.
    let peer = unsafe { decode_sockaddr(addr, len) }?;
    let mut plan = None;
    bookkeeping(|| plan = Some(crate::san::before_connect(fd, index, record, peer)));
    plan.map(|plan| (index, record, plan))
}

/// `getsockname(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn getsockname(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarded.
    unsafe { real::getsockname(fd, addr, len) }
}

/// `getpeername(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn getpeername(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    // SAFETY: forwarded.
    unsafe { real::getpeername(fd, addr, len) }
}

/// `setsockopt(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    value: *const c_void,
    len: socklen_t,
) -> c_int {
    // SAFETY: forwarded.
    let rc = unsafe { real::setsockopt(fd, level, name, value, len) };
    if rc == 0 && level == libc::SOL_SOCKET {
        if let Some(flag) = crate::record::timeout_flag(name) {
            if let Some(entry) = tracked(fd) {
                bookkeeping(|| {
                    if let Some((_, record)) = record_of(entry) {
                        record.set_flag(flag, true);
                    }
                });
            }
        }
    }
    rc
}

/// `getsockopt(2)`. `SO_ERROR` is how a non-blocking connect reports its outcome, so it
/// settles a connecting socket: 0 means connected, an error means back to unconnected.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    value: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    let entry = table().lookup(fd);
    // SAFETY: forwarded.
    let rc = unsafe { real::getsockopt(fd, level, name, value, len) };
    let is_so_error = level == libc::SOL_SOCKET && name == libc::SO_ERROR;
    if rc == 0 && is_so_error && !entry.is_none() && !value.is_null() && !guard::is_inside() {
        // SAFETY: the kernel just wrote an int there.
        let error = unsafe { value.cast::<c_int>().read_unaligned() };
        bookkeeping(|| settle_connect(entry, error));
    }
    rc
}

fn settle_connect(entry: FdEntry, error: c_int) {
    let Some((_, record)) = record_of(entry) else {
        return;
    };
    if record.flags() & flags::CONNECTING == 0 {
        return;
    }
    record.set_flag(flags::CONNECTING, false);
    if error != 0 {
        record.set_addresses(None, None);
        record.set_flag(flags::CLIENT, false);
        record.bypass.store(Bypass::None as u32, Ordering::Release);
        record.set_state(SocketState::TcpCandidate);
    }
}

/// `shutdown(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn shutdown(fd: c_int, how: c_int) -> c_int {
    let entry = tracked(fd);
    // SAFETY: forwarded.
    let rc = unsafe { real::shutdown(fd, how) };
    if let (0, Some(entry)) = (rc, entry) {
        bookkeeping(|| {
            if let Some((index, record)) = record_of(entry) {
                let bits = match how {
                    libc::SHUT_RD => flags::SHUT_RD,
                    libc::SHUT_WR => flags::SHUT_WR,
                    _ => flags::SHUT_RD | flags::SHUT_WR,
                };
                record.set_flag(bits, true);
                if record.flags() & flags::SAN != 0 {
                    crate::san::on_shutdown(fd, index, how);
                }
            }
        });
    }
    rc
}

// ---- descriptor lifetime --------------------------------------------------------------------

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
    if let Some(index) = crate::san::san_index(entry) {
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
                // SAFETY: FIONREAD takes an int pointer (the caller's, as for the C function).
                unsafe { (arg as *mut c_int).write_unaligned(bytes) };
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

// ---- data transfer --------------------------------------------------------------------------

macro_rules! data_ops {
    ($( $name:ident($fd:ident $(, $arg:ident: $ty:ty)*) => $counter:ident, |$index:ident| $san:expr; )*) => {$(
        #[doc = concat!("`", stringify!($name), "`: counted per path for our sockets; SAN sockets go through the session.")]
        ///
        /// # Safety
        /// As the C function.
        #[inline(always)]
        #[allow(unused_unsafe)]
        pub unsafe fn $name($fd: c_int $(, $arg: $ty)*) -> ssize_t {
            data_call(
                $fd,
                Counter::$counter,
                // SAFETY: the arguments are the caller's, valid as for the C function.
                |$index| unsafe { $san },
                // SAFETY: forwarded.
                || unsafe { real::$name($fd $(, $arg)*) },
            )
        }
    )*};
}

data_ops! {
    read(fd, buf: *mut c_void, count: size_t) => TcpReceived,
        |index| crate::san::recv_iov(fd, index, &one_buf(buf, count), 0);
    readv(fd, iov: *const libc::iovec, iovcnt: c_int) => TcpReceived,
        |index| san_recv_iov(fd, index, iov_bufs(iov, iovcnt), 0);
    write(fd, buf: *const c_void, count: size_t) => TcpSent,
        |index| crate::san::send_iov(fd, index, &one_buf(buf, count), 0);
    writev(fd, iov: *const libc::iovec, iovcnt: c_int) => TcpSent,
        |index| san_send_iov(fd, index, iov_bufs(iov, iovcnt), 0);
    send(fd, buf: *const c_void, len: size_t, send_flags: c_int) => TcpSent,
        |index| crate::san::send_iov(fd, index, &one_buf(buf, len), send_flags);
    sendmsg(fd, msg: *const libc::msghdr, send_flags: c_int) => TcpSent,
        |index| if msg.is_null() {
            errno::set(libc::EFAULT);
            Some(-1)
        } else {
            san_send_iov(fd, index, iov_bufs((*msg).msg_iov, (*msg).msg_iovlen as c_int), send_flags)
        };
    recv(fd, buf: *mut c_void, len: size_t, recv_flags: c_int) => TcpReceived,
        |index| crate::san::recv_iov(fd, index, &one_buf(buf, len), recv_flags);
    recvfrom(fd, buf: *mut c_void, len: size_t, recv_flags: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) => TcpReceived,
        |index| {
            let _ = addr;
            let result = crate::san::recv_iov(fd, index, &one_buf(buf, len), recv_flags);
            if result.is_some_and(|n| n >= 0) {
                clear_addrlen(addrlen);
            }
            result
        };
    recvmsg(fd, msg: *mut libc::msghdr, recv_flags: c_int) => TcpReceived,
        |index| if msg.is_null() {
            errno::set(libc::EFAULT);
            Some(-1)
        } else {
            let result = san_recv_iov(fd, index, iov_bufs((*msg).msg_iov, (*msg).msg_iovlen as c_int), recv_flags);
            if result.is_some_and(|n| n >= 0) {
                (*msg).msg_namelen = 0;
                (*msg).msg_controllen = 0;
                (*msg).msg_flags = 0;
            }
            result
        };
    __read_chk(fd, buf: *mut c_void, nbytes: size_t, buflen: size_t) => TcpReceived,
        // An overflowing request goes to the real function, which aborts as it must.
        |index| if nbytes > buflen { None } else { crate::san::recv_iov(fd, index, &one_buf(buf, nbytes), 0) };
    __recv_chk(fd, buf: *mut c_void, len: size_t, buflen: size_t, recv_flags: c_int) => TcpReceived,
        |index| if len > buflen { None } else { crate::san::recv_iov(fd, index, &one_buf(buf, len), recv_flags) };
    __recvfrom_chk(fd, buf: *mut c_void, len: size_t, buflen: size_t, recv_flags: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) => TcpReceived,
        |index| if len > buflen { None } else {
            let _ = addr;
            let result = crate::san::recv_iov(fd, index, &one_buf(buf, len), recv_flags);
            if result.is_some_and(|n| n >= 0) {
                clear_addrlen(addrlen);
            }
            result
        };
}

/// `sendto(2)`: counted; with `MSG_FASTOPEN` it is also a connect (TCP Fast Open). On a SAN
/// socket the address is ignored, as the kernel ignores it on a connected TCP socket.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendto(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    send_flags: c_int,
    addr: *const sockaddr,
    addrlen: socklen_t,
) -> ssize_t {
    let sent = data_call(
        fd,
        Counter::TcpSent,
        |index| crate::san::send_iov(fd, index, &one_buf(buf, len), send_flags),
        // SAFETY: forwarded.
        || unsafe { real::sendto(fd, buf, len, send_flags, addr, addrlen) },
    );
    if send_flags & libc::MSG_FASTOPEN != 0 && !addr.is_null() {
        let in_progress = sent < 0 && errno::get() == libc::EINPROGRESS;
        if let (true, Some(entry)) = (sent >= 0 || in_progress, tracked(fd)) {
            // SAFETY: the kernel accepted (addr, addrlen) as the destination just now.
            let peer = unsafe { decode_sockaddr(addr, addrlen) };
            bookkeeping(|| on_connect_started(fd, entry, peer, in_progress));
        }
    }
    sent
}

/// `sendmmsg(2)`: on a SAN socket, each message is one `sendmsg`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: c_uint,
    send_flags: c_int,
) -> c_int {
    let entry = table().lookup(fd);
    if !entry.is_none() && !msgvec.is_null() {
        // SAFETY: the caller's vector of `vlen` messages.
        let san = |index| unsafe { san_mmsg(fd, index, msgvec, vlen, send_flags, true) };
        if let Some(result) = san_data_call(entry, san) {
            return result as c_int;
        }
    }
    // SAFETY: forwarded.
    mmsg_call(fd, Counter::TcpSent, msgvec, || unsafe {
        real::sendmmsg(fd, msgvec, vlen, send_flags)
    })
}

/// `recvmmsg(2)`: on a SAN socket, each message is one `recvmsg` (the timeout is ignored, as
/// for a stream socket whose first receive returns).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn recvmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: c_uint,
    recv_flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    let entry = table().lookup(fd);
    if !entry.is_none() && !msgvec.is_null() {
        // SAFETY: the caller's vector of `vlen` messages.
        let san = |index| unsafe { san_mmsg(fd, index, msgvec, vlen, recv_flags, false) };
        if let Some(result) = san_data_call(entry, san) {
            return result as c_int;
        }
    }
    // SAFETY: forwarded.
    mmsg_call(fd, Counter::TcpReceived, msgvec, || unsafe {
        real::recvmmsg(fd, msgvec, vlen, recv_flags, timeout)
    })
}

/// The `*mmsg` calls on a SAN socket: messages in turn; after the first, only what is
/// available without blocking (as the kernel does for a stream socket).
///
/// # Safety
/// `msgvec` must point to `vlen` messages.
unsafe fn san_mmsg(
    fd: c_int,
    index: u32,
    msgvec: *mut libc::mmsghdr,
    vlen: c_uint,
    flags: c_int,
    sending: bool,
) -> Option<ssize_t> {
    let mut done = 0;
    for position in 0..vlen.min(libc::UIO_MAXIOV as c_uint) as usize {
        // SAFETY: inside the caller's vector.
        let message = unsafe { &mut *msgvec.add(position) };
        // SAFETY: the message's own iovec array.
        let bufs =
            unsafe { iov_bufs(message.msg_hdr.msg_iov, message.msg_hdr.msg_iovlen as c_int) };
        let flags = if done > 0 {
            flags | libc::MSG_DONTWAIT
        } else {
            flags
        };
        let result = if sending {
            san_send_iov(fd, index, bufs, flags)?
        } else {
            san_recv_iov(fd, index, bufs, flags)?
        };
        if result < 0 {
            return Some(if done > 0 { done } else { -1 });
        }
        message.msg_len = result as c_uint;
        done += 1;
        if !sending && result == 0 {
            break;
        }
    }
    Some(done)
}

/// `sendfile(2)`: kernel only; the bytes count as TCP bytes of the target socket.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendfile(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: forwarded.
    data_call(
        out_fd,
        Counter::TcpSent,
        // SAFETY: the caller's offset pointer, valid as for the C function.
        |index| unsafe { san_sendfile(out_fd, index, in_fd, offset, count) },
        // SAFETY: forwarded.
        || unsafe { real::sendfile(out_fd, in_fd, offset, count) },
    )
}

/// `sendfile64`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendfile64(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: forwarded.
    data_call(
        out_fd,
        Counter::TcpSent,
        // SAFETY: the caller's offset pointer, valid as for the C function.
        |index| unsafe { san_sendfile(out_fd, index, in_fd, offset, count) },
        // SAFETY: forwarded.
        || unsafe { real::sendfile64(out_fd, in_fd, offset, count) },
    )
}

/// `splice(2)`: kernel only; counted on both ends when they are ours.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    splice_flags: c_uint,
) -> ssize_t {
    let in_entry = table().lookup(fd_in);
    // SAFETY: forwarded.
    // The kernel cannot splice a SAN stream: it is copied through a buffer instead.
    if !in_entry.is_none() {
        // SAFETY: the caller's offset pointer, as for the C function.
        let from_san =
            |index| unsafe { san_splice_out(fd_in, index, fd_out, off_out, len, splice_flags) };
        if let Some(result) = san_data_call(in_entry, from_san) {
            return result;
        }
    }
    let moved = data_call(
        fd_out,
        Counter::TcpSent,
        // SAFETY: the caller's offset pointer, as for the C function.
        |index| unsafe { san_splice_in(fd_in, off_in, fd_out, index, len, splice_flags) },
        // SAFETY: forwarded.
        || unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, splice_flags) },
    );
    if moved > 0 && !in_entry.is_none() {
        count_bytes(in_entry, Counter::TcpReceived, moved as u64);
    }
    moved
}

/// `splice` out of a SAN socket into a pipe (or file): peeks up to `len` bytes, writes them
/// to `fd_out`, and consumes exactly what the target took, so nothing is lost on a short
/// write.
///
/// # Safety
/// `off_out` must be null or valid.
unsafe fn san_splice_out(
    fd_in: c_int,
    index: u32,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    splice_flags: c_uint,
) -> Option<ssize_t> {
    const CHUNK: usize = 64 << 10;
    let mut chunk = vec![0u8; len.min(CHUNK)];
    let flags = if splice_flags & libc::SPLICE_F_NONBLOCK != 0 {
        libc::MSG_PEEK | libc::MSG_DONTWAIT
    } else {
        libc::MSG_PEEK
    };
    let peeked = crate::san::recv_iov(
        fd_in,
        index,
        &one_buf(chunk.as_ptr().cast(), chunk.len()),
        flags,
    )?;
    if peeked <= 0 {
        return Some(peeked);
    }
    let written = if off_out.is_null() {
        // SAFETY: `chunk` holds `peeked` bytes.
        unsafe { libc::write(fd_out, chunk.as_ptr().cast(), peeked as usize) }
    } else {
        // SAFETY: as above; `off_out` valid per the contract.
        let n = unsafe {
            libc::pwrite64(
                fd_out,
                chunk.as_ptr().cast(),
                peeked as usize,
                off_out.read_unaligned(),
            )
        };
        if n > 0 {
            // SAFETY: valid per the contract.
            unsafe { off_out.write_unaligned(off_out.read_unaligned() + n as i64) };
        }
        n
    };
    if written <= 0 {
        return Some(written);
    }
    chunk.truncate(written as usize);
    crate::san::recv_iov(
        fd_in,
        index,
        &one_buf(chunk.as_mut_ptr().cast(), chunk.len()),
        0,
    )
}

/// `splice` from a pipe (or file) into a SAN socket: one chunk read, then sent in full.
///
/// # Safety
/// `off_in` must be null or valid.
unsafe fn san_splice_in(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    index: u32,
    len: size_t,
    _splice_flags: c_uint,
) -> Option<ssize_t> {
    // SAFETY: `off_in` is the same kind of pointer sendfile takes, valid per the contract.
    unsafe { san_sendfile(fd_out, index, fd_in, off_in, len) }
}

/// `sendfile` into a SAN socket: one chunk read from `in_fd` (at `*offset` when given, which
/// then advances by what was sent) and sent through the session. Short counts are allowed.
///
/// # Safety
/// `offset` must be null or point to a valid offset.
unsafe fn san_sendfile(
    out_fd: c_int,
    index: u32,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> Option<ssize_t> {
    const CHUNK: usize = 64 << 10;
    let mut chunk = vec![0u8; count.min(CHUNK)];
    // As the kernel's: as much as the socket takes, up to `count`. A short count must mean
    // "no room now" (an edge-triggered caller then waits for EPOLLOUT, as nginx does), so
    // one chunk is not where it stops.
    let mut total: usize = 0;
    while total < count {
        let want = (count - total).min(chunk.len());
        let read = if offset.is_null() {
            // SAFETY: `chunk` is writable for `want <= len` bytes.
            unsafe { libc::read(in_fd, chunk.as_mut_ptr().cast(), want) }
        } else {
            // SAFETY: as above; `offset` is valid per the contract.
            unsafe {
                libc::pread64(
                    in_fd,
                    chunk.as_mut_ptr().cast(),
                    want,
                    offset.read_unaligned(),
                )
            }
        };
        if read <= 0 {
            return Some(if total > 0 { total as ssize_t } else { read });
        }
        let bufs = one_buf(chunk.as_ptr().cast(), read as usize);
        let Some(sent) = crate::san::send_iov(out_fd, index, &bufs, 0) else {
            // No longer a SAN socket (downgraded meanwhile): the caller's kernel path sends
            // the rest; give back what was read and not sent.
            if offset.is_null() {
                // SAFETY: plain lseek on the caller's fd.
                unsafe { libc::lseek64(in_fd, -(read as i64), libc::SEEK_CUR) };
            }
            return if total > 0 {
                Some(total as ssize_t)
            } else {
                None
            };
        };
        if sent < 0 {
            return Some(if total > 0 { total as ssize_t } else { sent });
        }
        if offset.is_null() {
            // Give back what was read but not sent, so the file position matches.
            if sent < read {
                // SAFETY: plain lseek on the caller's fd.
                unsafe { libc::lseek64(in_fd, sent as i64 - read as i64, libc::SEEK_CUR) };
            }
        } else {
            // SAFETY: valid per the contract.
            unsafe { offset.write_unaligned(offset.read_unaligned() + sent as i64) };
        }
        total += sent as usize;
        if sent < read {
            break;
        }
    }
    Some(total as ssize_t)
}

// ---- readiness ------------------------------------------------------------------------------

macro_rules! passthrough_ops {
    ($( $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty; )*) => {$(
        #[doc = concat!("`", stringify!($name), "`: kernel readiness (no SAN socket exists yet).")]
        ///
        /// # Safety
        /// As the C function.
        #[inline(always)]
        pub unsafe fn $name($($arg: $ty),*) -> $ret {
            // SAFETY: forwarded.
            unsafe { real::$name($($arg),*) }
        }
    )*};
}

/// Runs a poll-style call with every switched SAN socket in `fds` replaced by its mirror `M`
/// for the duration of the call (the application's array is restored before returning).
///
/// # Safety
/// `fds` must point to `nfds` pollfds (or be null with `nfds == 0`).
#[inline(always)]
unsafe fn with_mirrors(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    mut call: impl FnMut() -> c_int,
) -> c_int {
    if crate::san::live_sockets() == 0 || fds.is_null() || nfds == 0 || guard::is_inside() {
        return call();
    }
    // SAFETY: the caller's array of `nfds` entries.
    let entries = unsafe { core::slice::from_raw_parts_mut(fds, nfds as usize) };
    loop {
        let saved = {
            let _guard = ReentrancyGuard::enter();
            crate::san::poll_fds(entries, None)
        };
        let rc = call();
        if saved.is_empty() {
            return rc;
        }
        let _errno = errno::Preserved::save();
        let _guard = ReentrancyGuard::enter();
        crate::san::poll_fds(entries, Some(&saved));
        if rc <= 0 {
            return rc;
        }
        let ready = entries.iter().filter(|e| e.revents != 0).count() as c_int;
        if ready > 0 {
            return ready;
        }
        // Every report was a spurious mirror token (now lowered): wait again. The timeout
        // restarts, so such a wait can last longer than asked (documented).
    }
}

/// `poll(2)`: SAN sockets are watched through their mirrors.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn poll(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        // SAFETY: forwarded.
        return unsafe { real::poll(fds, nfds, timeout) };
    }
    // Sliced like the epoll waits (see `settings::wait_slice_ms`).
    let deadline = (timeout >= 0)
        .then(|| std::time::Instant::now() + std::time::Duration::from_millis(timeout as u64));
    loop {
        let slice = crate::settings::next_slice_ms(deadline);
        // SAFETY: forwarded; `fds` is the caller's array.
        let rc = unsafe { with_mirrors(fds, nfds, || real::poll(fds, nfds, slice)) };
        if rc != 0 || deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return rc;
        }
        let _errno = errno::Preserved::save();
        let _guard = ReentrancyGuard::enter();
        crate::san::service_all();
    }
}

/// `ppoll(2)`: SAN sockets are watched through their mirrors.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn ppoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: forwarded; `fds` is the caller's array.
    unsafe { with_mirrors(fds, nfds, || real::ppoll(fds, nfds, timeout, sigmask)) }
}

/// An epoll wait with SAN sockets alive: connections with both ends in this process are
/// driven first (see `san::assist_all_in_process`), the kernel wait is cut into slices
/// (see [`crate::settings::wait_slice_ms`]), and events that only reflect a handshake or credit token of
/// a SAN mirror are dropped (`san::correct_epoll_events`); a wait left with no event goes on
/// until the caller's timeout (`timeout_ms < 0`: none).
///
/// # Safety
/// `events` must be writable for `maxevents` entries.
#[inline(always)]
unsafe fn epoll_wait_with_san(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout_ms: c_int,
    mut call: impl FnMut(c_int) -> c_int,
) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() || events.is_null() {
        return call(timeout_ms);
    }
    let start = std::time::Instant::now();
    let deadline =
        (timeout_ms >= 0).then(|| start + std::time::Duration::from_millis(timeout_ms as u64));
    // The safety net runs once per slice of waiting, also when the slices were cut short by
    // events that were all dropped (a socket whose wake-up was lost must not wait behind a
    // busy neighbour).
    let slice = std::time::Duration::from_millis(crate::settings::wait_slice_ms() as u64);
    let mut serviced = start;
    loop {
        {
            let _errno = errno::Preserved::save();
            let _guard = ReentrancyGuard::enter();
            crate::san::assist_all_in_process();
            crate::san::settle_all_owed();
        }
        let left = crate::settings::next_slice_ms(deadline);
        let n = call(left);
        if n < 0 || n > maxevents {
            return n;
        }
        let _errno = errno::Preserved::save();
        let _guard = ReentrancyGuard::enter();
        if n > 0 {
            // SAFETY: the kernel just wrote `n` events there.
            let returned = unsafe { core::slice::from_raw_parts_mut(events, n as usize) };
            let kept = crate::san::correct_epoll_events(epfd, returned);
            if kept > 0 {
                return kept as c_int;
            }
            if serviced.elapsed() >= slice {
                crate::san::service_all();
                serviced = std::time::Instant::now();
            }
        } else {
            crate::san::service_all();
            serviced = std::time::Instant::now();
        }
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return 0;
        }
    }
}

/// `epoll_wait(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: forwarded.
    unsafe {
        epoll_wait_with_san(epfd, events, maxevents, timeout, |slice| {
            real::epoll_wait(epfd, events, maxevents, slice)
        })
    }
}

/// `epoll_pwait(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: forwarded.
    unsafe {
        epoll_wait_with_san(epfd, events, maxevents, timeout, |slice| {
            real::epoll_pwait(epfd, events, maxevents, slice, sigmask)
        })
    }
}

/// `epoll_pwait2(2)`: with SAN sockets alive, waits in `epoll_pwait` slices (millisecond
/// resolution).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        // SAFETY: forwarded.
        return unsafe { real::epoll_pwait2(epfd, events, maxevents, timeout, sigmask) };
    }
    let timeout_ms = if timeout.is_null() {
        -1
    } else {
        // SAFETY: a valid timespec per the C contract.
        let t = unsafe { timeout.read_unaligned() };
        (t.tv_sec.max(0).saturating_mul(1000) + (t.tv_nsec.max(0) + 999_999) / 1_000_000)
            .min(c_int::MAX as i64) as c_int
    };
    // SAFETY: forwarded.
    unsafe {
        epoll_wait_with_san(epfd, events, maxevents, timeout_ms, |slice| {
            real::epoll_pwait(epfd, events, maxevents, slice, sigmask)
        })
    }
}

/// `select(2)`: with SAN sockets in the sets it runs as `ppoll` over their mirrors.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn select(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    if crate::san::live_sockets() != 0 && !guard::is_inside() {
        let _guard = ReentrancyGuard::enter();
        let spec = (!timeout.is_null()).then(|| {
            // SAFETY: a valid timeval per the C contract.
            let tv = unsafe { timeout.read_unaligned() };
            libc::timespec {
                tv_sec: tv.tv_sec,
                tv_nsec: tv.tv_usec * 1000,
            }
        });
        let spec_ptr = spec
            .as_ref()
            .map_or(core::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: the caller's sets; our timespec.
        if let Some(rc) = unsafe {
            crate::san::select_via_poll(
                nfds,
                readfds,
                writefds,
                exceptfds,
                spec_ptr,
                core::ptr::null(),
            )
        } {
            return rc;
        }
    }
    // SAFETY: forwarded.
    unsafe { real::select(nfds, readfds, writefds, exceptfds, timeout) }
}

/// `pselect(2)`: as [`select`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn pselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if crate::san::live_sockets() != 0 && !guard::is_inside() {
        let _guard = ReentrancyGuard::enter();
        // SAFETY: the caller's arguments.
        if let Some(rc) = unsafe {
            crate::san::select_via_poll(nfds, readfds, writefds, exceptfds, timeout, sigmask)
        } {
            return rc;
        }
    }
    // SAFETY: forwarded.
    unsafe { real::pselect(nfds, readfds, writefds, exceptfds, timeout, sigmask) }
}

passthrough_ops! {
    __poll_chk(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int, fdslen: size_t) -> c_int;
    __ppoll_chk(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: *const libc::timespec, sigmask: *const libc::sigset_t, fdslen: size_t) -> c_int;
}

/// `fork(2)`: a SAN session cannot be shared by two processes, so every SAN connection is
/// first moved back to kernel TCP, live and exactly (`san::before_fork`); both processes then
/// hold plain TCP sockets (with a shared stash of bytes received but not read yet).
///
/// While the socket records are published (shared with `sandirect stat`), the child copies
/// them into a file of its own in its atfork handler; the parent waits (bounded) until it has,
/// so a socket the parent closes right after the fork is still the child's.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn fork() -> libc::pid_t {
    let published = crate::registry::registry().is_published();
    if (crate::san::live_sockets() == 0 && !published) || guard::is_inside() {
        // SAFETY: forwarded.
        return unsafe { real::fork() };
    }
    let held = (crate::san::live_sockets() != 0).then(|| {
        let _guard = ReentrancyGuard::enter();
        crate::san::before_fork()
    });
    let signal = published.then(ForkSignal::new).flatten();
    // SAFETY: forwarded.
    let pid = unsafe { real::fork() };
    let _errno = errno::Preserved::save();
    if let Some(signal) = signal {
        if pid > 0 {
            signal.wait_for_child();
        }
    }
    // Both processes release the slot locks held across the fork (no thread of the parent
    // can have been inside one in the child).
    drop(held);
    pid
}

/// Before a `vfork` (the exported trampoline calls it in the parent, then jumps to the real
/// `vfork`): every SAN connection is downgraded to kernel TCP first, then the thread is marked
/// so that the child's hook calls act like the kernel calls alone
/// ([`guard::in_vfork_child`]). All of them, not only those without close-on-exec: between
/// `vfork` and exec the child may make any socket inheritable (CPython's subprocess `dup2`s
/// onto 0-2 and clears close-on-exec there) for a program that will use it, and a SAN session
/// cannot go with it; the child cannot downgrade for its parent.
pub fn before_vfork() {
    if crate::san::live_sockets() != 0 && !guard::is_inside() {
        bookkeeping(|| crate::san::downgrade_all(None));
    }
    // Last: our own calls above would clear the mark (they run in the parent).
    guard::note_vfork();
}

/// The socket indices with a descriptor that survives an exec here: open and without
/// close-on-exec, as the kernel says (the flag may have changed behind our table's back:
/// a raw system call, an interposed call we do not see).
fn inherited_indices() -> Vec<u32> {
    let mut indices = Vec::new();
    table().for_each_in(0, c_int::MAX, |fd, entry| {
        if let Some(index) = entry.socket_index() {
            // SAFETY: F_GETFD only reads the descriptor's flags.
            let fd_flags = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
            if fd_flags >= 0 && fd_flags & libc::FD_CLOEXEC == 0 && !indices.contains(&index) {
                indices.push(index);
            }
        }
    });
    indices
}

/// Before an exec: surviving SAN sockets are downgraded to kernel TCP and their stashes
/// prepared for the new image. Returns the `SANDIRECT_STASHES=...` entry when there is one.
fn prepare_exec() -> Option<std::ffi::CString> {
    tracing::debug!(
        live = crate::san::live_sockets(),
        inside = guard::is_inside(),
        vfork_child = guard::in_vfork_child(),
        "exec: preparing"
    );
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        return None;
    }
    let stashes = if guard::in_vfork_child() || crate::process::in_vfork_child() {
        // The parent downgraded every SAN connection before the vfork; only the copies this
        // child passes on are to be found (by identity: the table is the parent's). No
        // reentrancy guard: this thread's TLS is the parent's, and a successful exec would
        // never restore it.
        crate::san::stash_env()
    } else {
        let _guard = ReentrancyGuard::enter();
        let inherited = inherited_indices();
        let survives = |fd: c_int| {
            table()
                .lookup(fd)
                .socket_index()
                .is_some_and(|index| inherited.contains(&index))
        };
        crate::san::downgrade_all(Some(&survives));
        crate::san::stash_env()
    }?;
    std::ffi::CString::new(format!("{}={stashes}", crate::settings::STASHES)).ok()
}

/// What a `posix_spawn` child receives of our sockets, read from glibc's file actions.
enum SpawnInherits {
    /// The file actions could not be read (an unknown action): assume every socket.
    Everything,
    /// `(source fd, fd in the child)` of every `dup2` action, besides the descriptors
    /// without close-on-exec, which the child inherits as they are.
    Dup2s(Vec<(c_int, c_int)>),
}

/// glibc's `struct __spawn_action` (posix/spawn_int.h, stable since glibc 2.x; newer tags
/// are appended): a tag and a pointer-aligned union (at offset 8) whose `dup2_action` is
/// `{ int fd; int newfd; }`.
#[repr(C)]
struct SpawnAction {
    tag: c_int,
    _union_alignment: c_int,
    first: c_int,
    second: c_int,
    rest: [u8; 16],
}

/// glibc's `posix_spawn_file_actions_t`.
#[repr(C)]
struct SpawnFileActions {
    allocated: c_int,
    used: c_int,
    actions: *const SpawnAction,
}

const SPAWN_DO_DUP2: c_int = 1;
/// Highest action tag glibc 2.36 knows (`spawn_do_tcsetpgrp`).
const SPAWN_LAST_KNOWN_TAG: c_int = 6;

/// Reads the `dup2` actions of `file_actions`.
///
/// # Safety
/// `file_actions` is null or points to an initialised `posix_spawn_file_actions_t` (the
/// caller's contract with `posix_spawn`).
unsafe fn spawn_inherits(file_actions: *const libc::posix_spawn_file_actions_t) -> SpawnInherits {
    if file_actions.is_null() {
        return SpawnInherits::Dup2s(Vec::new());
    }
    const _: () = assert!(
        core::mem::size_of::<SpawnAction>() == 32
            && core::mem::size_of::<SpawnFileActions>()
                <= core::mem::size_of::<libc::posix_spawn_file_actions_t>()
    );
    // SAFETY: the public type is at least as large as glibc's internal layout (checked
    // above) and initialised by posix_spawn_file_actions_init.
    let actions = unsafe { &*file_actions.cast::<SpawnFileActions>() };
    if actions.used < 0 || actions.used > actions.allocated || actions.used > 65_536 {
        return SpawnInherits::Everything;
    }
    if actions.used > 0 && actions.actions.is_null() {
        return SpawnInherits::Everything;
    }
    let mut dup2s = Vec::new();
    for position in 0..actions.used as usize {
        // SAFETY: glibc keeps `used` initialised actions in the array.
        let action = unsafe { &*actions.actions.add(position) };
        match action.tag {
            SPAWN_DO_DUP2 => dup2s.push((action.first, action.second)),
            tag if (0..=SPAWN_LAST_KNOWN_TAG).contains(&tag) => {}
            _ => return SpawnInherits::Everything,
        }
    }
    SpawnInherits::Dup2s(dup2s)
}

/// Around a `posix_spawn`: the SAN sockets the child may receive (without close-on-exec,
/// or the source of a `dup2` file action) are downgraded first, and the stashes of those
/// among them holding bytes are handed to the child's image (`SANDIRECT_STASHES`, their
/// memfds inheritable for the duration of the call: glibc returns after the child's exec).
///
/// # Safety
/// As `posix_spawn`'s contract for `file_actions` and `envp`.
unsafe fn spawn_with(
    file_actions: *const libc::posix_spawn_file_actions_t,
    envp: *const *mut libc::c_char,
    call: impl FnOnce(*const *mut libc::c_char) -> c_int,
) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        return call(envp);
    }
    let prepared = {
        let _errno = errno::Preserved::save();
        let _guard = ReentrancyGuard::enter();
        // SAFETY: the caller's file actions.
        let inherits = unsafe { spawn_inherits(file_actions) };
        let mut passed = inherited_indices();
        let dup2s = match &inherits {
            SpawnInherits::Everything => None,
            SpawnInherits::Dup2s(dup2s) => Some(dup2s.as_slice()),
        };
        for &(source, _) in dup2s.unwrap_or_default() {
            if let Some(index) = table().lookup(source).socket_index() {
                passed.push(index);
            }
        }
        let survives = |fd: c_int| {
            dup2s.is_none()
                || table()
                    .lookup(fd)
                    .socket_index()
                    .is_some_and(|index| passed.contains(&index))
        };
        crate::san::downgrade_all(Some(&survives));
        stash_environment(dup2s.unwrap_or_default())
    };
    let Some(stashes) = prepared else {
        return call(envp);
    };
    // SAFETY: the caller's environment array.
    let env = unsafe { environment_with(envp.cast(), &stashes.variable) };
    stashes.inheritable_during(|| call(env.as_ptr().cast()))
}

/// Stashes to hand to a child's image: the `SANDIRECT_STASHES=…` entry and the memfds it
/// names (made inheritable only while the child is spawned, see
/// [`ChildStashes::inheritable_during`]).
struct ChildStashes {
    variable: std::ffi::CString,
    memfds: Vec<c_int>,
}

impl ChildStashes {
    fn inheritable_during<T>(&self, call: impl FnOnce() -> T) -> T {
        for &memfd in &self.memfds {
            // SAFETY: our own memfd, inheritable only for this call.
            unsafe { libc::fcntl(memfd, libc::F_SETFD, 0) };
        }
        let result = call();
        let _errno = errno::Preserved::save();
        for &memfd in &self.memfds {
            // SAFETY: as above.
            unsafe { libc::fcntl(memfd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        result
    }
}

/// The stashes a child receives (after the downgrade): those of its inherited descriptors
/// (no close-on-exec) and of the sources of `dup2s` (source, target) file actions. `None`
/// when no stash holds bytes for it. Inside the guard.
fn stash_environment(dup2s: &[(c_int, c_int)]) -> Option<ChildStashes> {
    // The child's descriptors holding a stashed socket: inherited as they are, or dup2
    // targets of a stashed source.
    let mut entries = Vec::new();
    table().for_each_in(0, c_int::MAX, |fd, entry| {
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let fd_flags = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
        if entry.socket_index().is_some() && fd_flags >= 0 && fd_flags & libc::FD_CLOEXEC == 0 {
            if let Some((memfd, inode)) = crate::san::stash_of(fd) {
                entries.push((fd, memfd, inode));
            }
        }
    });
    for &(source, target) in dup2s {
        if let Some((memfd, inode)) = crate::san::stash_of(source) {
            entries.retain(|&(fd, _, _)| fd != target);
            entries.push((target, memfd, inode));
        }
    }
    let value = crate::san::pass_on(&entries, false)?;
    let variable = std::ffi::CString::new(format!("{}={value}", crate::settings::STASHES)).ok()?;
    let mut memfds: Vec<c_int> = entries.iter().map(|&(_, memfd, _)| memfd).collect();
    memfds.sort_unstable();
    memfds.dedup();
    Some(ChildStashes { variable, memfds })
}

/// Around `system`/`popen`, which spawn the shell through glibc's internal `posix_spawn` (no
/// preload sees it): the SAN sockets the shell inherits (without close-on-exec) are
/// downgraded to kernel TCP first, and stashes holding bytes for them reach the shell (a
/// preloaded image, which hands them on to its own children) through the environment glibc
/// passes: `environ` itself, swapped for a copy with our entry for the duration of the call.
///
/// The swap is a pointer store; a thread reading the environment meanwhile sees either array,
/// both valid (ours is leaked, not freed: other threads may still hold it, and this happens
/// only when stashes hold bytes). A `setenv` racing with the call may be lost (POSIX already
/// forbids `setenv` concurrently with other threads).
fn around_shell<T>(call: impl FnOnce() -> T) -> T {
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        return call();
    }
    let prepared = {
        let _errno = errno::Preserved::save();
        let _guard = ReentrancyGuard::enter();
        let inherited = inherited_indices();
        let survives = |fd: c_int| {
            table()
                .lookup(fd)
                .socket_index()
                .is_some_and(|index| inherited.contains(&index))
        };
        if inherited.is_empty() {
            None
        } else {
            crate::san::downgrade_all(Some(&survives));
            stash_environment(&[])
        }
    };
    let Some(stashes) = prepared else {
        return call();
    };
    let original = process_environment();
    let variable: &'static std::ffi::CStr = Box::leak(stashes.variable.clone().into_boxed_c_str());
    // SAFETY: the process environment array (NULL-terminated by contract).
    let ours: &'static [*const libc::c_char] =
        Vec::leak(unsafe { environment_with(original, variable) });
    // SAFETY: a pointer store to libc's `environ`; the array and its strings outlive the call.
    unsafe { core::ptr::addr_of_mut!(environ).write(ours.as_ptr()) };
    let result = stashes.inheritable_during(call);
    // Restore only if nobody replaced it meanwhile (a racing setenv keeps its own array).
    // SAFETY: as above.
    unsafe {
        if core::ptr::addr_of!(environ).read() == ours.as_ptr() {
            core::ptr::addr_of_mut!(environ).write(original);
        }
    }
    result
}

/// `system(3)`: see `around_shell`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn system(command: *const libc::c_char) -> c_int {
    // SAFETY: forwarded.
    around_shell(|| unsafe { real::system(command) })
}

/// `popen(3)`: see `around_shell`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn popen(command: *const libc::c_char, mode: *const libc::c_char) -> *mut libc::FILE {
    // SAFETY: forwarded.
    around_shell(|| unsafe { real::popen(command, mode) })
}

/// `posix_spawn(3)`: the SAN sockets the child receives are downgraded first, their stashes
/// handed on (`spawn_with`).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const libc::c_char,
    file_actions: *const libc::posix_spawn_file_actions_t,
    attrp: *const libc::posix_spawnattr_t,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
) -> c_int {
    // SAFETY: forwarded contract of the caller.
    unsafe {
        spawn_with(file_actions, envp, |env| {
            real::posix_spawn(pid, path, file_actions, attrp, argv, env)
        })
    }
}

/// `posix_spawnp(3)`: as `posix_spawn`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const libc::c_char,
    file_actions: *const libc::posix_spawn_file_actions_t,
    attrp: *const libc::posix_spawnattr_t,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
) -> c_int {
    // SAFETY: forwarded contract of the caller.
    unsafe {
        spawn_with(file_actions, envp, |env| {
            real::posix_spawnp(pid, file, file_actions, attrp, argv, env)
        })
    }
}

/// `envp` without an older `SANDIRECT_STASHES`, plus `ours`; NULL-terminated.
///
/// # Safety
/// `envp` is null or a NULL-terminated array of C strings.
unsafe fn environment_with(
    envp: *const *const libc::c_char,
    ours: &std::ffi::CStr,
) -> Vec<*const libc::c_char> {
    let prefix = format!("{}=", crate::settings::STASHES);
    let mut entries: Vec<*const libc::c_char> = Vec::new();
    if !envp.is_null() {
        // Bounded by the caller's NULL-terminated array.
        for position in 0.. {
            // SAFETY: `envp` is a NULL-terminated array of C strings (the caller's contract).
            let entry = unsafe { *envp.add(position) };
            if entry.is_null() {
                break;
            }
            // SAFETY: as above.
            let bytes = unsafe { std::ffi::CStr::from_ptr(entry) }.to_bytes();
            if !bytes.starts_with(prefix.as_bytes()) {
                entries.push(entry);
            }
        }
    }
    entries.push(ours.as_ptr());
    entries.push(core::ptr::null());
    entries
}

extern "C" {
    /// libc's process environment.
    static mut environ: *const *const libc::c_char;
}

/// The process environment (for the exec calls without an `envp`).
fn process_environment() -> *const *const libc::c_char {
    // SAFETY: reading the pointer value of libc's `environ`.
    unsafe { core::ptr::addr_of!(environ).read() }
}

/// `execve(2)`: surviving SAN sockets are downgraded to kernel TCP first, and the stashes of
/// bytes received but not read yet are handed to the new image (`SANDIRECT_STASHES`).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn execve(
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    let Some(ours) = prepare_exec() else {
        // SAFETY: forwarded.
        return unsafe { real::execve(path, argv, envp) };
    };
    // SAFETY: the caller's environment array.
    let env = unsafe { environment_with(envp, &ours) };
    // SAFETY: forwarded with a valid NULL-terminated environment that outlives the call.
    unsafe { real::execve(path, argv, env.as_ptr()) }
}

/// `execvpe(3)`: as [`execve`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn execvpe(
    file: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    let Some(ours) = prepare_exec() else {
        // SAFETY: forwarded.
        return unsafe { real::execvpe(file, argv, envp) };
    };
    // SAFETY: the caller's environment array.
    let env = unsafe { environment_with(envp, &ours) };
    // SAFETY: forwarded with a valid environment that outlives the call.
    unsafe { real::execvpe(file, argv, env.as_ptr()) }
}

/// `fexecve(3)`: as [`execve`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn fexecve(
    fd: c_int,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    let Some(ours) = prepare_exec() else {
        // SAFETY: forwarded.
        return unsafe { real::fexecve(fd, argv, envp) };
    };
    // SAFETY: the caller's environment array.
    let env = unsafe { environment_with(envp, &ours) };
    // SAFETY: forwarded with a valid environment that outlives the call.
    unsafe { real::fexecve(fd, argv, env.as_ptr()) }
}

/// `execv(3)`: as [`execve`] with the process environment (glibc's `execv` calls its internal
/// `execve`, which an interposer does not see).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn execv(path: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    let Some(ours) = prepare_exec() else {
        // SAFETY: forwarded.
        return unsafe { real::execv(path, argv) };
    };
    // SAFETY: the process environment is a NULL-terminated array.
    let env = unsafe { environment_with(process_environment(), &ours) };
    // SAFETY: forwarded with a valid environment that outlives the call.
    unsafe { real::execve(path, argv, env.as_ptr()) }
}

/// `execvp(3)`: as [`execvpe`] with the process environment.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn execvp(file: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    let Some(ours) = prepare_exec() else {
        // SAFETY: forwarded.
        return unsafe { real::execvp(file, argv) };
    };
    // SAFETY: the process environment is a NULL-terminated array.
    let env = unsafe { environment_with(process_environment(), &ours) };
    // SAFETY: forwarded with a valid environment that outlives the call.
    unsafe { real::execvpe(file, argv, env.as_ptr()) }
}

/// `epoll_create(2)`: the instance is tracked.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwarded.
    let epfd = unsafe { real::epoll_create(size) };
    track_epoll_instance(epfd, false);
    epfd
}

/// `epoll_create1(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_create1(create_flags: c_int) -> c_int {
    // SAFETY: forwarded.
    let epfd = unsafe { real::epoll_create1(create_flags) };
    track_epoll_instance(epfd, create_flags & libc::EPOLL_CLOEXEC != 0);
    epfd
}

/// `epoll_ctl(2)`: registrations of our sockets are recorded.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, event: *mut libc::epoll_event) -> c_int {
    let entry = tracked(fd);
    // A switched SAN socket is watched through its mirror (same events, same data).
    let target = match entry.and_then(crate::san::san_index) {
        Some(index) => {
            let _guard = ReentrancyGuard::enter();
            crate::san::mirror_of(fd, index).unwrap_or(fd)
        }
        None => fd,
    };
    // SAFETY: forwarded.
    let rc = unsafe { real::epoll_ctl(epfd, op, target, event) };
    if let (0, Some(entry)) = (rc, entry) {
        // SAFETY: the kernel accepted `event` (required for ADD/MOD) just now.
        let registered = (!event.is_null()).then(|| unsafe { event.read_unaligned() });
        bookkeeping(|| {
            let Some((_, record)) = record_of(entry) else {
                return;
            };
            match (op, registered) {
                (libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD, Some(event)) => {
                    note_registration(record, epfd, event)
                }
                (libc::EPOLL_CTL_DEL, _) => record.unregister_epoll(epfd),
                _ => {}
            }
            if let Some(index) = crate::san::san_index(entry) {
                crate::san::epoll_registrations_changed(index);
            }
            if record.flags() & flags::STASHED != 0 {
                if let Some((index, _)) = record_of(entry) {
                    let (events, data) = registered.map_or((0, 0), |e| (e.events, e.u64));
                    crate::san::stashed_epoll_ctl(index, epfd, op, events, data);
                }
            }
        });
    }
    rc
}

/// `pthread_atfork` child handler. Async-signal-safe: syscalls and atomics only.
pub extern "C" fn after_fork_in_child() {
    crate::process::note_process_id();
    registry().after_fork_in_child();
    crate::san::after_fork_in_child();
    if let Some((read, write)) = unpack_pipe(FORK_SIGNAL.swap(NO_PIPE, Ordering::AcqRel)) {
        // SAFETY: one byte to the pipe our fork hook made; then our copies of it are closed.
        unsafe {
            libc::write(write, [1u8].as_ptr().cast(), 1);
            libc::close(write);
            libc::close(read);
        }
    }
}

/// The pipe of a fork in progress, both ends in one word (read end low, write end high), so
/// the child handler takes it with one atomic swap; [`NO_PIPE`] when none.
static FORK_SIGNAL: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(NO_PIPE);
const NO_PIPE: u64 = u64::MAX;

fn pack_pipe(read: c_int, write: c_int) -> u64 {
    u64::from(read as u32) | u64::from(write as u32) << 32
}

fn unpack_pipe(word: u64) -> Option<(c_int, c_int)> {
    (word != NO_PIPE).then_some((word as u32 as c_int, (word >> 32) as u32 as c_int))
}

/// The child's "my records are copied" signal to the parent of a fork (see `ops::fork`).
pub struct ForkSignal {
    read: c_int,
    write: c_int,
}

impl ForkSignal {
    /// A pipe whose ends the child's atfork handler takes; `None` if no pipe (or another fork
    /// of this process is in progress: that one keeps the signal).
    pub fn new() -> Option<ForkSignal> {
        let mut ends = [-1; 2];
        // SAFETY: plain pipe2(2) into our array.
        if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        // Owns the ends from here on: closed on drop, whatever happens next.
        let signal = ForkSignal {
            read: ends[0],
            write: ends[1],
        };
        FORK_SIGNAL
            .compare_exchange(
                NO_PIPE,
                signal.packed(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()
            .map(|_| signal)
    }

    fn packed(&self) -> u64 {
        pack_pipe(self.read, self.write)
    }

    /// No later fork may signal through this pipe (the parent's copy of the slot).
    fn disarm(&self) {
        let _ = FORK_SIGNAL.compare_exchange(
            self.packed(),
            NO_PIPE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Parent: waits (up to a second) until the child copied its records.
    pub fn wait_for_child(&self) {
        self.disarm();
        let mut entry = libc::pollfd {
            fd: self.read,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        unsafe { real::poll(&mut entry, 1, 1000) };
    }
}

impl Drop for ForkSignal {
    fn drop(&mut self) {
        self.disarm();
        // SAFETY: closing our own pipe ends.
        unsafe {
            real::close(self.read);
            real::close(self.write);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(fd: c_int) -> Option<(u32, u32)> {
        let (index, record) = record_of(table().lookup(fd))?;
        Some((index, record.fd_refs.load(Ordering::Acquire)))
    }

    fn tcp_socket(extra: c_int) -> c_int {
        // SAFETY: plain socket creation through the op.
        let fd = unsafe { socket(libc::AF_INET, libc::SOCK_STREAM | extra, 0) };
        assert!(fd >= 0);
        fd
    }

    #[test]
    fn dup_family_keeps_one_socket_object_until_the_last_close() {
        let fd = tcp_socket(libc::SOCK_CLOEXEC);
        let entry = table().lookup(fd);
        assert!(entry.cloexec());
        let (index, refs_after_socket) = refs(fd).expect("TCP socket must be tracked");
        assert_eq!(refs_after_socket, 1);
        // SAFETY: dup/fcntl/dup3 on our own fd.
        let (copy, copy2) = unsafe { (dup(fd), fcntl(fd, libc::F_DUPFD_CLOEXEC, 200)) };
        assert!(copy >= 0 && copy2 >= 200);
        assert_eq!(refs(copy), Some((index, 3)));
        assert!(!table().lookup(copy).cloexec(), "dup clears close-on-exec");
        assert!(table().lookup(copy2).cloexec(), "F_DUPFD_CLOEXEC sets it");
        // SAFETY: closing our fds.
        assert_eq!(unsafe { close(fd) }, 0);
        assert!(table().lookup(fd).is_none());
        assert_eq!(
            refs(copy),
            Some((index, 2)),
            "the copies keep the object alive"
        );
        // SAFETY: as above.
        unsafe { close(copy) };
        let record = registry().get(index).unwrap();
        assert_eq!(record.state(), SocketState::TcpCandidate);
        // SAFETY: as above.
        unsafe { close(copy2) };
        assert_eq!(
            record.state(),
            SocketState::Free,
            "last close frees the object"
        );
    }

    #[test]
    fn dup2_onto_a_tracked_fd_releases_the_old_socket() {
        let (a, b) = (tcp_socket(0), tcp_socket(0));
        let (index_a, _) = refs(a).unwrap();
        let (index_b, _) = refs(b).unwrap();
        // SAFETY: our fds.
        assert_eq!(unsafe { dup2(a, b) }, b);
        assert_eq!(refs(b), Some((index_a, 2)));
        assert_eq!(registry().get(index_b).unwrap().state(), SocketState::Free);
        // A foreign fd dup2'ed over a tracked one untracks it.
        let mut pipe = [0; 2];
        // SAFETY: pipe creation.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: our fds.
        assert_eq!(unsafe { dup3(pipe[0], b, libc::O_CLOEXEC) }, b);
        assert!(table().lookup(b).is_none());
        assert_eq!(refs(a), Some((index_a, 1)));
        // SAFETY: our fds.
        unsafe {
            close(a);
            close(b);
            close(pipe[0]);
            close(pipe[1]);
        }
    }

    #[test]
    fn flags_and_epoll_registrations_are_tracked() {
        let fd = tcp_socket(0);
        let (_, record) = record_of(table().lookup(fd)).unwrap();
        // SAFETY: fcntl/ioctl on our fd with valid arguments.
        unsafe {
            fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK as usize);
            assert_ne!(record.flags() & flags::NONBLOCK, 0);
            let off: c_int = 0;
            ioctl(fd, libc::FIONBIO, &off as *const c_int as usize);
            assert_eq!(record.flags() & flags::NONBLOCK, 0);
            fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC as usize);
        }
        assert!(table().lookup(fd).cloexec());
        // SAFETY: epoll calls with live event structs.
        let epfd = unsafe { epoll_create1(libc::EPOLL_CLOEXEC) };
        assert!(table().lookup(epfd).is_epoll());
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: 99,
        };
        // SAFETY: as above.
        let added = unsafe { epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut event) };
        assert_eq!(added, 0);
        assert_eq!(
            record.epoll_registrations().collect::<Vec<_>>(),
            vec![(epfd, libc::EPOLLIN as u32, 99)]
        );
        // Closing the epoll instance forgets its registrations.
        // SAFETY: our fd.
        unsafe { close(epfd) };
        assert_eq!(record.epoll_registrations().count(), 0);
        // SAFETY: our fd.
        unsafe { close(fd) };
    }

    #[test]
    fn close_range_untracks_and_cloexec_marks() {
        let fds: Vec<c_int> = (0..3).map(|_| tcp_socket(0)).collect();
        let (low, high) = (*fds.iter().min().unwrap(), *fds.iter().max().unwrap());
        let cloexec_flag = libc::CLOSE_RANGE_CLOEXEC as c_int;
        // SAFETY: marking our own fds close-on-exec.
        let marked = unsafe { close_range(low as c_uint, high as c_uint, cloexec_flag) };
        assert_eq!(marked, 0);
        assert!(fds.iter().all(|&fd| table().lookup(fd).cloexec()));
        for &fd in &fds {
            // SAFETY: closing exactly our own fd (one at a time: other tests own fds between).
            let closed = unsafe { close_range(fd as c_uint, fd as c_uint, 0) };
            assert_eq!(closed, 0);
            assert!(table().lookup(fd).is_none());
        }
        // SAFETY: invalid range: EINVAL, nothing untracked.
        assert_eq!(unsafe { close_range(10, 5, 0) }, -1);
        assert_eq!(errno::get(), libc::EINVAL);
    }

    #[test]
    fn connect_listen_accept_record_roles_addresses_and_bytes() {
        let listener = tcp_socket(0);
        let any = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
            },
            sin_zero: [0; 8],
        };
        let len = core::mem::size_of_val(&any) as socklen_t;
        // SAFETY: valid sockaddr for our socket.
        unsafe {
            assert_eq!(
                bind(listener, (&any as *const libc::sockaddr_in).cast(), len),
                0
            );
            assert_eq!(listen(listener, 4), 0);
        }
        let (_, listening) = record_of(table().lookup(listener)).unwrap();
        assert_eq!(listening.state(), SocketState::Listener);
        let bound = listening.addresses().0.unwrap();
        let client = tcp_socket(0);
        let mut target = any;
        target.sin_port = bound.port().to_be();
        // SAFETY: valid sockaddr; blocking loopback connect.
        let connected =
            unsafe { connect(client, (&target as *const libc::sockaddr_in).cast(), len) };
        assert_eq!(connected, 0);
        // SAFETY: accept with null address pointers.
        let server = unsafe {
            accept4(
                listener,
                core::ptr::null_mut(),
                core::ptr::null_mut(),
                libc::SOCK_NONBLOCK,
            )
        };
        assert!(server >= 0);
        let (_, client_record) = record_of(table().lookup(client)).unwrap();
        let (_, server_record) = record_of(table().lookup(server)).unwrap();
        assert_eq!(client_record.state(), SocketState::ConnectedTcp);
        assert_ne!(client_record.flags() & flags::CLIENT, 0);
        assert_ne!(server_record.flags() & flags::SERVER, 0);
        assert_ne!(server_record.flags() & flags::NONBLOCK, 0);
        assert_eq!(client_record.addresses().1, Some(bound));
        assert_eq!(server_record.addresses().0, Some(bound));
        assert_eq!(server_record.addresses().1, client_record.addresses().0);
        // SAFETY: valid buffers.
        unsafe {
            assert_eq!(write(client, b"12345".as_ptr().cast(), 5), 5);
            let mut buf = [0u8; 8];
            let mut pfd = libc::pollfd {
                fd: server,
                events: libc::POLLIN,
                revents: 0,
            };
            poll(&mut pfd, 1, 2000);
            assert_eq!(recv(server, buf.as_mut_ptr().cast(), 8, 0), 5);
            assert_eq!(shutdown(client, libc::SHUT_WR), 0);
        }
        assert_eq!(client_record.counter(Counter::TcpSent), 5);
        assert_eq!(server_record.counter(Counter::TcpReceived), 5);
        assert_ne!(client_record.flags() & flags::SHUT_WR, 0);
        // SAFETY: our fds.
        unsafe {
            close(client);
            close(server);
            close(listener);
        }
    }

    #[test]
    fn so_error_settles_a_nonblocking_connect() {
        let loopback = |port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
            },
            sin_zero: [0; 8],
        };
        let so_error = |fd: c_int| {
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLOUT,
                revents: 0,
            };
            let mut value: c_int = -1;
            let mut len = core::mem::size_of::<c_int>() as socklen_t;
            // SAFETY: live pollfd and int.
            unsafe {
                poll(&mut pfd, 1, 2000);
                getsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_ERROR,
                    (&mut value as *mut c_int).cast(),
                    &mut len,
                );
            }
            value
        };
        // Port 1 on loopback refuses: the socket goes back to being a candidate.
        let refused = tcp_socket(libc::SOCK_NONBLOCK);
        let target = loopback(1);
        // SAFETY: valid sockaddr.
        let rc = unsafe { connect(refused, (&target as *const libc::sockaddr_in).cast(), 16) };
        assert_eq!((rc, errno::get()), (-1, libc::EINPROGRESS));
        let (_, record) = record_of(table().lookup(refused)).unwrap();
        assert_eq!(record.state(), SocketState::ConnectedTcp);
        assert_ne!(record.flags() & flags::CONNECTING, 0);
        assert_eq!(so_error(refused), libc::ECONNREFUSED);
        assert_eq!(record.state(), SocketState::TcpCandidate);
        assert_eq!(record.flags() & (flags::CONNECTING | flags::CLIENT), 0);
        // SAFETY: our fd.
        unsafe { close(refused) };
    }

    #[test]
    fn errno_of_the_real_call_survives_bookkeeping() {
        let fd = tcp_socket(0);
        let unreachable = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 1u16.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: valid sockaddr; nothing listens on port 1.
        let rc = unsafe { connect(fd, (&unreachable as *const libc::sockaddr_in).cast(), 16) };
        assert_eq!((rc, errno::get()), (-1, libc::ECONNREFUSED));
        // SAFETY: closing a never-opened fd.
        assert_eq!((unsafe { close(-7) }, errno::get()), (-1, libc::EBADF));
        // SAFETY: our fd.
        unsafe { close(fd) };
    }
}
