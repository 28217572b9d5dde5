//! Bookkeeping of our descriptors and socket records, shared by every hook family in
//! [`crate::ops`]: which fds are tracked, starting and stopping tracking (socket, dup, close,
//! inherited sockets, epoll instances), the addresses and role of a connection, byte counters.
//!
//! Everything here runs after (or around) the real call, inside `guard::bookkeeping` or on a
//! tracked fd only; nothing here makes the hooked call itself.

use core::ffi::c_int;
use core::sync::atomic::Ordering;
use std::net::SocketAddr;

use libc::{sockaddr, socklen_t};

use crate::config::Role;
use crate::fdtable::{table, FdEntry};
use crate::guard::{self, bookkeeping};
use crate::record::{flags, Bypass, Counter, SocketRecord, SocketState};
use crate::registry::registry;
use crate::{real, settings};

/// The record behind a tracked entry.
#[inline]
pub(crate) fn record_of(entry: FdEntry) -> Option<(u32, &'static SocketRecord)> {
    let index = entry.socket_index()?;
    registry().get(index).map(|record| (index, record))
}

/// The tracked socket on `fd`, unless we are inside our own code.
#[inline(always)]
pub(crate) fn tracked(fd: c_int) -> Option<FdEntry> {
    let entry = table().lookup(fd);
    if entry.is_none() || guard::is_inside() {
        return None;
    }
    Some(entry)
}

/// Counts `bytes` moved through the kernel on a tracked socket.
#[cold]
pub(crate) fn count_bytes(entry: FdEntry, counter: Counter, bytes: u64) {
    if let Some((_, record)) = record_of(entry) {
        record.count(counter, bytes);
        // Bytes moved, so a non-blocking connect has completed.
        if record.flags() & flags::CONNECTING != 0 {
            record.set_flag(flags::CONNECTING, false);
        }
    }
}

/// Drops whatever `entry` held for `fd` (the fd is gone or re-pointed).
fn release_entry(fd: c_int, entry: FdEntry) {
    if let Some(index) = entry.socket_index() {
        if registry().release(index) {
            crate::san::on_released(index, None);
        } else {
            repoint_record_fd(index, fd);
        }
    } else if entry.is_epoll() {
        // The epoll instance died with its last fd; registrations naming it are stale.
        registry().for_each_live(|_, record| record.unregister_epoll(fd));
        crate::san::epoll_instance_gone(fd);
    }
}

/// As [`release_entry`] for an fd that is still open and about to be closed: a SAN socket's
/// graceful close may still use it (linger option, the unread switch marker).
pub(crate) fn release_closing(fd: c_int, entry: FdEntry) {
    match entry.socket_index() {
        Some(index) => {
            if registry().release(index) {
                crate::san::on_released(index, Some(fd));
            } else {
                repoint_record_fd(index, fd);
            }
        }
        None => release_entry(fd, entry),
    }
}

/// After `closed` was closed while copies of its socket stay open: if the record named
/// `closed` (published to `sandirect stat`, used by the SAN path to act on the socket), it
/// names a remaining copy from now on. Scans the table, so only on this rare close.
fn repoint_record_fd(index: u32, closed: c_int) {
    let Some(record) = registry().get(index) else {
        return;
    };
    if record.fd.load(Ordering::Acquire) != closed {
        return;
    }
    let mut remaining = None;
    table().for_each_in(0, c_int::MAX, |fd, entry| {
        if remaining.is_none() && entry.socket_index() == Some(index) {
            remaining = Some(fd);
        }
    });
    if let Some(fd) = remaining {
        let _ = record
            .fd
            .compare_exchange(closed, fd, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// Starts tracking a new socket on `fd`.
pub(crate) fn track_new(
    fd: c_int,
    state: SocketState,
    socket_flags: u32,
    cloexec: bool,
) -> Option<&'static SocketRecord> {
    let (index, record) = registry().claim(fd, state)?;
    record.set_flag(socket_flags, true);
    match table().replace(fd, FdEntry::socket(index, cloexec)) {
        Ok(stale) => {
            // An fd closed behind our back (e.g. glibc-internal close) left a stale entry.
            release_entry(fd, stale);
            Some(record)
        }
        Err(_) => {
            registry().release(index);
            None
        }
    }
}

/// Points `new_fd` at the socket of `entry` (a dup).
pub(crate) fn track_dup(new_fd: c_int, entry: FdEntry) {
    if let Some(index) = entry.socket_index() {
        registry().add_ref(index);
        match table().replace(new_fd, entry) {
            Ok(previous) => release_entry(new_fd, previous),
            Err(_) => {
                registry().release(index);
            }
        }
    } else if entry.is_epoll() {
        // The instance now has two numbers, and the records name it by one of them.
        crate::san::epoll_instances_shared();
        if let Ok(previous) = table().replace(new_fd, entry) {
            release_entry(new_fd, previous);
        }
    }
}

/// Stops tracking `fd` (the kernel closed it, or it now names something else).
pub(crate) fn untrack(fd: c_int) {
    let previous = table().take(fd);
    release_entry(fd, previous);
}

/// An AF_INET/AF_INET6 stream socket of protocol TCP: a candidate for the SAN path.
pub(crate) fn is_tcp(domain: c_int, ty: c_int, protocol: c_int) -> bool {
    let base_type = ty & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC);
    (domain == libc::AF_INET || domain == libc::AF_INET6)
        && base_type == libc::SOCK_STREAM
        && (protocol == 0 || protocol == libc::IPPROTO_TCP)
}

/// The record flag of an address family.
pub(crate) fn family_flag(domain: c_int) -> u32 {
    if domain == libc::AF_INET6 {
        flags::INET6
    } else {
        0
    }
}

/// Decodes an AF_INET/AF_INET6 socket address given by the application or the kernel.
///
/// # Safety
/// `addr` must be null or point to `len` readable bytes.
pub unsafe fn decode_sockaddr(addr: *const sockaddr, len: socklen_t) -> Option<SocketAddr> {
    if addr.is_null() || (len as usize) < core::mem::size_of::<libc::sa_family_t>() {
        return None;
    }
    // SAFETY: at least the family field is readable (checked above).
    let family = c_int::from(unsafe { (*addr).sa_family });
    match family {
        libc::AF_INET if len as usize >= core::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: enough bytes for a sockaddr_in; read unaligned (caller's buffer).
            let sin = unsafe { addr.cast::<libc::sockaddr_in>().read_unaligned() };
            Some(SocketAddr::from((
                u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 if len as usize >= core::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: enough bytes for a sockaddr_in6.
            let sin6 = unsafe { addr.cast::<libc::sockaddr_in6>().read_unaligned() };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                sin6.sin6_addr.s6_addr.into(),
                u16::from_be(sin6.sin6_port),
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// An address the kernel reports for `fd` (`getsockname` or `getpeername`).
fn kernel_address(
    fd: c_int,
    query: unsafe fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int,
) -> Option<SocketAddr> {
    let mut storage = core::mem::MaybeUninit::<libc::sockaddr_storage>::zeroed();
    let mut len = core::mem::size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: storage is large enough for any address; len says so.
    if unsafe { query(fd, storage.as_mut_ptr().cast(), &mut len) } != 0 {
        return None;
    }
    // SAFETY: the kernel wrote `len` bytes (bounded by the storage size).
    unsafe {
        decode_sockaddr(
            storage.as_ptr().cast(),
            len.min(core::mem::size_of::<libc::sockaddr_storage>() as socklen_t),
        )
    }
}

/// `fd`'s own address, as the kernel has it.
pub(crate) fn local_address(fd: c_int) -> Option<SocketAddr> {
    kernel_address(fd, real::getsockname)
}

/// `fd`'s peer address, as the kernel has it.
pub(crate) fn peer_address(fd: c_int) -> Option<SocketAddr> {
    kernel_address(fd, real::getpeername)
}

/// A tracked socket is connected (client or server role): its addresses are published and
/// the rules decide whether it may leave TCP.
pub(crate) fn mark_connected(
    record: &SocketRecord,
    role: Role,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
) {
    record.set_addresses(local, peer);
    // A client's rules match the peer; a server's match its own (listening) address.
    let endpoint = if role == Role::Client { peer } else { local };
    let bypass = settings::decide(role, endpoint);
    record.bypass.store(bypass as u32, Ordering::Release);
    // (A pending client can be switched by another thread — an in-process acceptor, a
    // sweep — before its `connect()` returns here: `San` then stands.)
    record.transition(SocketState::TcpCandidate, SocketState::ConnectedTcp);
    tracing::debug!(
        fd = record.fd.load(Ordering::Relaxed),
        ?role,
        ?local,
        ?peer,
        reason = bypass.label(),
        "connection on TCP"
    );
}

/// A tracked candidate started (or finished) connecting to `peer`.
pub(crate) fn on_connect_started(
    fd: c_int,
    entry: FdEntry,
    peer: Option<SocketAddr>,
    in_progress: bool,
) {
    let Some((_, record)) = record_of(entry) else {
        return;
    };
    // Not an AF_UNSPEC disconnect, nor a second connect on a connected socket. A pending
    // SAN client may already have been switched by another thread (an in-process acceptor,
    // a sweep) while its connect() ran: it still needs its addresses and role published.
    let first = match record.state() {
        SocketState::TcpCandidate => true,
        SocketState::San => record.addresses().1.is_none(),
        _ => false,
    };
    if peer.is_none() || !first {
        return;
    }
    record.set_flag(flags::CLIENT, true);
    record.set_flag(flags::CONNECTING, in_progress);
    mark_connected(record, Role::Client, local_address(fd), peer);
}

/// Starts tracking a connected TCP socket inherited across exec (a stash was handed over for
/// it). `None` if `fd` is not a connected stream socket or tracking is impossible.
pub fn adopt_inherited_socket(fd: c_int) -> Option<u32> {
    let mut kind: c_int = 0;
    let mut len = core::mem::size_of::<c_int>() as libc::socklen_t;
    // SAFETY: SO_TYPE writes one int.
    let rc = unsafe {
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&mut kind as *mut c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 || kind != libc::SOCK_STREAM {
        return None;
    }
    // SAFETY: F_GETFD only reads the descriptor's flags.
    let cloexec = unsafe { libc::fcntl(fd, libc::F_GETFD) } & libc::FD_CLOEXEC != 0;
    // Its timeouts were set before we knew it: ask the kernel for them.
    let timeouts = flags::RCVTIMEO | flags::SNDTIMEO;
    let record = track_new(
        fd,
        SocketState::ConnectedTcp,
        flags::INHERITED | timeouts,
        cloexec,
    )?;
    let (index, _) = record_of(table().lookup(fd))?;
    let _ = record;
    Some(index)
}

/// Starts tracking an epoll instance (so registrations naming it can be forgotten with it).
pub(crate) fn track_epoll_instance(epfd: c_int, cloexec: bool) {
    if epfd >= 0 && settings::tracking_enabled() && !guard::is_inside() {
        bookkeeping(|| {
            if let Ok(previous) = table().replace(epfd, FdEntry::epoll(cloexec)) {
                release_entry(epfd, previous);
            }
            crate::san::epoll_instance_created(epfd);
        });
    }
}

/// Epoll instance `inner` was registered in another: marked, so SAN sockets it watches keep
/// their mirrors exact (see `san::registration_kinds`). Returns true when it was not yet.
pub(crate) fn note_nested_epoll(inner: c_int) -> bool {
    let entry = table().lookup(inner);
    if !entry.is_epoll() || entry.is_nested_epoll() {
        return false;
    }
    table().replace(inner, entry.with_nested_epoll()).is_ok()
}

/// Records an epoll registration of a tracked socket.
pub(crate) fn note_registration(record: &SocketRecord, epfd: c_int, event: libc::epoll_event) {
    if !record.register_epoll(epfd, event.events, event.u64) {
        // The record mirrors a few sets only; such a socket must stay on TCP.
        let _ = record.bypass.compare_exchange(
            Bypass::None as u32,
            Bypass::TooManyEpollSets as u32,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_classification() {
        assert!(is_tcp(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0
        ));
        assert!(is_tcp(libc::AF_INET6, libc::SOCK_STREAM, libc::IPPROTO_TCP));
        assert!(!is_tcp(libc::AF_INET, libc::SOCK_DGRAM, 0));
        assert!(!is_tcp(libc::AF_UNIX, libc::SOCK_STREAM, 0));
        assert!(!is_tcp(
            libc::AF_INET,
            libc::SOCK_STREAM,
            libc::IPPROTO_SCTP
        ));
    }

    #[test]
    fn sockaddr_decoding_rejects_short_and_foreign_addresses() {
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 8080u16.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
            },
            sin_zero: [0; 8],
        };
        let ptr = (&sin as *const libc::sockaddr_in).cast::<sockaddr>();
        let full = core::mem::size_of_val(&sin) as socklen_t;
        // SAFETY: pointers to a live local of the stated length.
        unsafe {
            assert_eq!(
                decode_sockaddr(ptr, full),
                Some("127.0.0.1:8080".parse().unwrap())
            );
            assert_eq!(decode_sockaddr(ptr, 4), None);
            assert_eq!(decode_sockaddr(core::ptr::null(), full), None);
        }
        let unix = libc::sockaddr {
            sa_family: libc::AF_UNIX as libc::sa_family_t,
            sa_data: [0; 14],
        };
        // SAFETY: as above.
        assert_eq!(unsafe { decode_sockaddr(&unix, 16) }, None);
    }
}
