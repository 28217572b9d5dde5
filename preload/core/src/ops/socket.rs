//! The socket hooks: creation, addressing, options (`socket` … `shutdown`).

use core::ffi::{c_int, c_void};
use core::sync::atomic::Ordering;
use std::net::SocketAddr;

use libc::{sockaddr, socklen_t};

use crate::config::Role;
use crate::fdtable::{table, FdEntry};
use crate::guard::{self, bookkeeping};
use crate::record::{flags, Bypass, SocketRecord, SocketState};
use crate::track::{
    decode_sockaddr, family_flag, is_tcp, local_address, mark_connected, on_connect_started,
    peer_address, record_of, track_new, tracked,
};
use crate::{errno, real, settings};

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

/// `peer`: the address `accept` wrote into the application's buffer, when it had room.
fn on_accepted(
    listener: Option<FdEntry>,
    fd: c_int,
    accept_flags: c_int,
    peer: Option<SocketAddr>,
) {
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
            // A listener bound to one address accepts on that address: only a wildcard
            // listener's connections need `getsockname` (and only an application that gave
            // `accept` no buffer needs `getpeername`): two system calls less per connection
            // for a plain client, whose acceptor must cost next to nothing.
            let local = listening
                .addresses()
                .0
                .filter(|address| !address.ip().is_unspecified())
                .or_else(|| local_address(fd));
            let peer = peer.or_else(|| peer_address(fd));
            mark_connected(record, Role::Server, local, peer);
            if let Some(index) = table().lookup(fd).socket_index() {
                crate::san::on_accepted(listener_index, fd, index, record);
            }
        }
    });
}

/// The room the application gives `accept` for the peer's address (0: none, not known, or
/// `len` not readable: the call then fails with `EFAULT` and the answer is not used). Read before the
/// call, which overwrites `*len` with the address's full length.
fn address_room(addr: *mut sockaddr, len: *mut socklen_t) -> socklen_t {
    // Unguarded reads could crash where the kernel answers EFAULT: only once the fault
    // handler is armed (a listener with a SAN marker arms it).
    if addr.is_null() || len.is_null() || !crate::fault::installed() {
        return 0;
    }
    // SAFETY: `socklen_t` is plain data; a guarded read of the application's memory.
    unsafe { crate::fault::read_app(len.cast_const()) }.unwrap_or(0)
}

/// The peer address a successful `accept` wrote, when it fit in the application's `room`
/// (a truncated one is not used). Both reads are guarded: another thread of the
/// application may have unmapped the buffers meanwhile.
fn accepted_address(
    addr: *mut sockaddr,
    len: *mut socklen_t,
    room: socklen_t,
) -> Option<SocketAddr> {
    if room == 0 {
        return None;
    }
    // SAFETY: `socklen_t` is plain data; a guarded read of the application's memory.
    let written = unsafe { crate::fault::read_app(len.cast_const()) }?;
    let size = core::mem::size_of::<libc::sockaddr_storage>();
    if written > room || written as usize > size {
        return None;
    }
    let mut storage = core::mem::MaybeUninit::<libc::sockaddr_storage>::zeroed();
    // SAFETY: `written` ≤ the storage's size; the source is the application's buffer, read
    // guarded; the two do not overlap (the storage is ours).
    unsafe {
        crate::fault::copy(
            storage.as_mut_ptr().cast(),
            addr.cast_const().cast(),
            written as usize,
        )
    }
    .ok()?;
    // SAFETY: `written` bytes of the storage hold the address.
    unsafe { decode_sockaddr(storage.as_ptr().cast(), written) }
}

/// `accept(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let listener = tracked(fd);
    let room = listener.map_or(0, |_| address_room(addr, len));
    // SAFETY: forwarded.
    let new_fd = unsafe { real::accept(fd, addr, len) };
    if new_fd >= 0 {
        let peer = accepted_address(addr, len, room);
        on_accepted(listener, new_fd, 0, peer);
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
    let room = listener.map_or(0, |_| address_room(addr, len));
    // SAFETY: forwarded.
    let new_fd = unsafe { real::accept4(fd, addr, len, accept_flags) };
    if new_fd >= 0 {
        let peer = accepted_address(addr, len, room);
        on_accepted(listener, new_fd, accept_flags, peer);
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
    // An accepted connection no call has used yet is used now: it attaches before the FIN
    // goes out on TCP (see `san::san_index`).
    if let Some(entry) = entry {
        let _ = crate::san::san_index(entry);
    }
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
