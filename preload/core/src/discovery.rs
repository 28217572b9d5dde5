//! SAN discovery for the intra-host (`shm`) provider: who is preloaded, how a connection is
//! named, and where its segment lives.
//!
//! The protocol is in `docs/ARCHITECTURE.md` ("Discovery and the exact switch-over point"). This
//! module provides its building blocks, each a plain API over the C library:
//!
//! * [`ListenerMarker`] — published by a preloaded `listen()`: an abstract Unix datagram socket
//!   named `\0sandirect/<euid>/L/<addr>:<port>`. The abstract namespace ties the name's lifetime
//!   to the open socket, so a dead server leaves nothing behind.
//! * [`probe_listener`] — the client's question "is the server preloaded?": `connect()` a
//!   datagram socket to the marker names. No byte is sent; it costs a few µs.
//! * Markers, exchange listeners and nudge sockets also exist as socket files in the segment
//!   directory (`address_in_dir`): abstract names are per network namespace, the directory
//!   can be shared (a volume mounted in two containers, `ip netns` on one file system).
//! * `negative_cache::NegativeCache` — remembers "plain server" answers per (address, port) for a while, so
//!   repeated connections to a plain server skip even the probe. Lock-free.
//! * [`ConnectionKey`] — the canonical 4-tuple and its file-name encoding ([`SegmentName`]),
//!   identical on both ends of the connection.
//! * [`SegmentDir`] — the per-user 0700 directory segment files live in, checked once through
//!   its open descriptor and used only through it.
//!
//! **Identity.** Names and directories use the *effective* uid: segment files are created with
//! it, and "only the same user may attach" is a statement about it.
//!
//! **Trust.** Anyone on the host can bind an abstract name, including one under our uid. A
//! squatter can therefore make a probe say "preloaded" (the client then creates a segment in
//! its own private directory that nobody attaches: the connection stays TCP, see the exact
//! switch-over rule) or make [`ListenerMarker::publish`] find its name taken (the server then
//! looks plain). Both are denial of the *optimisation* only; no byte of any connection is
//! exposed, because the segment's access control (owner, mode, private directory) is what
//! guards the data, not the marker.

use core::fmt::{self, Write as _};
use core::hash::Hash;
use core::mem::size_of;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use san_shm::PermissionProblem;

use crate::errno;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Why a segment directory was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DirectoryProblem {
    /// The path is a symbolic link (refused even if it points somewhere safe: the link can be
    /// changed under us).
    Symlink,
    /// The path exists and is not a directory.
    NotADirectory,
    /// The directory belongs to another user (who could read or replace our segments).
    WrongOwner {
        /// The owner's uid.
        uid: u32,
    },
    /// Group or other permission bits are set.
    ModeTooOpen {
        /// The directory's permission bits.
        mode: u32,
    },
}

/// Errors of discovery (rustls-style: each variant a cause a caller may act on).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The socket's address family is neither IPv4 nor IPv6.
    UnsupportedFamily(i32),
    /// The configured segment directory path is empty or contains a NUL byte.
    InvalidPath,
    /// The segment directory exists but must not be used.
    UnsafeDirectory {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        problem: DirectoryProblem,
    },
    /// An unexpected system-call failure.
    Os {
        /// What was being done.
        op: &'static str,
        /// The `errno`.
        errno: i32,
    },
}

impl DiscoveryError {
    fn last_os(op: &'static str) -> DiscoveryError {
        DiscoveryError::Os {
            op,
            errno: errno::get(),
        }
    }
}

impl fmt::Display for DiscoveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiscoveryError::UnsupportedFamily(family) => {
                write!(f, "address family {family} is neither IPv4 nor IPv6")
            }
            DiscoveryError::InvalidPath => {
                f.write_str("segment directory path is empty or has NUL")
            }
            DiscoveryError::UnsafeDirectory { path, problem } => {
                write!(f, "refusing segment directory {}: ", path.display())?;
                match problem {
                    DirectoryProblem::Symlink => f.write_str("it is a symbolic link"),
                    DirectoryProblem::NotADirectory => f.write_str("it is not a directory"),
                    DirectoryProblem::WrongOwner { uid } => write!(f, "it is owned by uid {uid}"),
                    DirectoryProblem::ModeTooOpen { mode } => {
                        write!(f, "mode {mode:04o} grants group/other access")
                    }
                }
            }
            DiscoveryError::Os { op, errno } => {
                write!(f, "{op}: {}", std::io::Error::from_raw_os_error(*errno))
            }
        }
    }
}

impl std::error::Error for DiscoveryError {}

// ---------------------------------------------------------------------------------------------
// Addresses
// ---------------------------------------------------------------------------------------------

/// The canonical form of an IP address for naming: v4-mapped IPv6 (`::ffff:a.b.c.d`) folded
/// to IPv4, so a dual-stack socket and an IPv4 socket name the same endpoint identically.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// [`canonical_ip`] applied to a socket address; IPv6 flow info and scope id are dropped (two
/// live connections on one host cannot differ only by them).
pub fn canonical_addr(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(canonical_ip(addr.ip()), addr.port())
}

/// Converts a kernel socket address to a [`SocketAddr`].
///
/// # Errors
/// [`DiscoveryError::UnsupportedFamily`] for anything but a complete `AF_INET`/`AF_INET6`
/// address.
pub fn socket_addr_from_raw(
    storage: &libc::sockaddr_storage,
    len: libc::socklen_t,
) -> Result<SocketAddr, DiscoveryError> {
    let family = i32::from(storage.ss_family);
    let len = len as usize;
    match family {
        libc::AF_INET if len >= size_of::<libc::sockaddr_in>() => {
            // SAFETY: the family and length say the storage holds a sockaddr_in; storage is
            // aligned for every sockaddr type.
            let sin =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            Ok(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 if len >= size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => Err(DiscoveryError::UnsupportedFamily(family)),
    }
}

/// Converts a [`SocketAddr`] to a kernel socket address and its length.
pub fn socket_addr_to_raw(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid (AF_UNSPEC) value.
    let mut storage: libc::sockaddr_storage = unsafe { core::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            let sin = unsafe {
                &mut *(&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v4.port().to_be();
            sin.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe {
                &mut *(&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v6.port().to_be();
            sin6.sin6_flowinfo = v6.flowinfo();
            sin6.sin6_addr.s6_addr = v6.ip().octets();
            sin6.sin6_scope_id = v6.scope_id();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// `getsockname` (local) or `getpeername` (peer) of a socket.
fn socket_name(fd: BorrowedFd<'_>, peer: bool) -> Result<SocketAddr, DiscoveryError> {
    // SAFETY: plain data, zero is valid.
    let mut storage: libc::sockaddr_storage = unsafe { core::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let storage_ptr = (&mut storage as *mut libc::sockaddr_storage).cast::<libc::sockaddr>();
    let rc = if peer {
        // SAFETY: the kernel writes at most `len` bytes into `storage`.
        unsafe { libc::getpeername(fd.as_raw_fd(), storage_ptr, &mut len) }
    } else {
        // SAFETY: as above.
        unsafe { libc::getsockname(fd.as_raw_fd(), storage_ptr, &mut len) }
    };
    if rc != 0 {
        return Err(DiscoveryError::last_os(if peer {
            "getpeername"
        } else {
            "getsockname"
        }));
    }
    socket_addr_from_raw(&storage, len)
}

pub(crate) fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A small string on the stack: names are built on hook paths that must not allocate.
#[derive(Clone, Copy)]
struct StackStr<const N: usize> {
    bytes: [u8; N],
    len: usize,
}

impl<const N: usize> StackStr<N> {
    const fn new() -> Self {
        Self {
            bytes: [0; N],
            len: 0,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }

    fn as_str(&self) -> &str {
        // Only `write_str` appends, and it appends whole `str`s.
        core::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

impl<const N: usize> fmt::Write for StackStr<N> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self
            .len
            .checked_add(s.len())
            .filter(|&end| end <= N)
            .ok_or(fmt::Error)?;
        self.bytes[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// A `socket()` result as an [`OwnedFd`].
fn new_socket(domain: i32, kind: i32, op: &'static str) -> Result<OwnedFd, DiscoveryError> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(DiscoveryError::last_os(op));
    }
    // SAFETY: `fd` was just returned by socket() and is owned by nobody else.
    Ok(crate::mirror::relocate_internal_fd(unsafe {
        OwnedFd::from_raw_fd(fd)
    }))
}

// ---------------------------------------------------------------------------------------------
// Listener markers
// ---------------------------------------------------------------------------------------------

/// Longest marker name: `sandirect/` + uid (10) + `/L/` + `[` v6 (39) `]` + `:` + port (5).
const MARKER_NAME_CAPACITY: usize = 80;

/// The abstract socket address of the marker for `addr` (already canonical) under `uid`.
fn marker_address(uid: u32, addr: SocketAddr) -> (libc::sockaddr_un, libc::socklen_t) {
    let mut name = StackStr::<MARKER_NAME_CAPACITY>::new();
    // Cannot fail: the capacity covers the longest uid, IPv6 text and port (SocketAddr's
    // Display prints `[v6]:port` without scope for a canonical address).
    let _ = write!(name, "sandirect/{uid}/L/{addr}");
    abstract_address(name.as_bytes())
}

/// The abstract-namespace Unix socket address named `name` (at most 107 bytes: longer names
/// are cut, which the fixed-capacity callers never reach).
pub(crate) fn abstract_address(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: plain data, zero is valid.
    let mut sun: libc::sockaddr_un = unsafe { core::mem::zeroed() };
    sun.sun_family = libc::AF_UNIX as libc::sa_family_t;
    // sun_path[0] stays NUL: the abstract namespace. The name is not NUL-terminated; its length
    // is carried by the address length.
    let mut written = 0;
    for (dst, &src) in sun.sun_path[1..].iter_mut().zip(name) {
        *dst = src as libc::c_char;
        written += 1;
    }
    let len = size_of::<libc::sa_family_t>() + 1 + written;
    (sun, len as libc::socklen_t)
}

/// Longest `sun_path` of a socket file in the segment directory: `/proc/self/fd/` + fd (10) +
/// `/` + name, NUL-terminated.
const DIR_ADDRESS_CAPACITY: usize = 107;

/// The address of the Unix socket file `name` in directory `dir`, reached through the open
/// descriptor (`/proc/self/fd/N/name`: no path can be swapped under us, and a long directory
/// path still fits). These files are how processes that share the segment directory but not a
/// network namespace (containers with a shared volume, `ip netns`) find each other, since
/// abstract names are per network namespace. `None` if the name does not fit.
pub(crate) fn address_in_dir(
    dir: BorrowedFd<'_>,
    name: &str,
) -> Option<(libc::sockaddr_un, libc::socklen_t)> {
    let mut path = StackStr::<DIR_ADDRESS_CAPACITY>::new();
    write!(path, "/proc/self/fd/{}/{name}", dir.as_raw_fd()).ok()?;
    // SAFETY: plain data, zero is valid.
    let mut sun: libc::sockaddr_un = unsafe { core::mem::zeroed() };
    sun.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in sun.sun_path.iter_mut().zip(path.as_bytes()) {
        *dst = src as libc::c_char;
    }
    // The path and its terminating NUL (the capacity leaves room for it).
    let len = size_of::<libc::sa_family_t>() + path.as_bytes().len() + 1;
    Some((sun, len as libc::socklen_t))
}

/// The file name of the marker for `addr` (already canonical) in the segment directory.
fn marker_file_name(addr: SocketAddr) -> StackStr<MARKER_NAME_CAPACITY> {
    let mut name = StackStr::<MARKER_NAME_CAPACITY>::new();
    // Cannot fail: as for `marker_address`.
    let _ = write!(name, ".L-{addr}");
    name
}

/// Binds datagram socket `socket` to the marker file `name` in `dir`. A file left by a marker
/// whose holders are gone (a connect is refused) is replaced; one a live marker holds (a
/// `SO_REUSEPORT` sibling in another process) is left to it: false.
fn bind_marker_file(socket: &OwnedFd, dir: BorrowedFd<'_>, name: &str) -> bool {
    let Some((sun, len)) = address_in_dir(dir, name) else {
        return false;
    };
    let bind = || {
        // SAFETY: `sun` is a valid sockaddr_un of length `len`.
        unsafe {
            libc::bind(
                socket.as_raw_fd(),
                (&sun as *const libc::sockaddr_un).cast(),
                len,
            )
        }
    };
    if bind() == 0 {
        return true;
    }
    if errno::get() != libc::EADDRINUSE {
        return false;
    }
    if file_socket_is_held(dir, name) {
        return false;
    }
    let Ok(file) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: a NUL-terminated name relative to the directory we hold open.
    unsafe { libc::unlinkat(dir.as_raw_fd(), file.as_ptr(), 0) };
    bind() == 0
}

/// The abstract address where process `process` takes nudges when its policy names other
/// users (see `SANDIRECT_OTHER_USERS`): a name of no user's, `sandirect/x/N/…`, so that a peer
/// of another user, whose own user's name it would try, finds it too (the responder still
/// drops datagrams of users its policy does not name).
pub(crate) fn shared_nudge_address(
    process: san_shm::NamespacedPid,
) -> (libc::sockaddr_un, libc::socklen_t) {
    let mut name = StackStr::<NUDGE_NAME_CAPACITY>::new();
    // Cannot fail: the capacity covers the longest namespace and pid.
    let _ = write!(
        name,
        "sandirect/x/N/{}/{}/{:016x}",
        process.namespace, process.pid, process.contact
    );
    abstract_address(name.as_bytes())
}

/// Capacity of a [`nudge_address`] name: `sandirect/` + uid (10) + `/N/` + pid namespace
/// (20) + `/` + pid (10) + `/` + contact (16).
const NUDGE_NAME_CAPACITY: usize = 96;

/// The abstract address where process `process` of user `uid` takes nudges (see
/// `san::nudge`). The pid namespace is part of the name: abstract names are shared by every
/// process of the network namespace, whatever its pid namespace, where pids repeat.
pub(crate) fn nudge_address(
    uid: u32,
    process: san_shm::NamespacedPid,
) -> (libc::sockaddr_un, libc::socklen_t) {
    let mut name = StackStr::<NUDGE_NAME_CAPACITY>::new();
    // Cannot fail: the capacity covers the longest uid, namespace and pid.
    let _ = write!(
        name,
        "sandirect/{uid}/N/{}/{}/{:016x}",
        process.namespace, process.pid, process.contact
    );
    abstract_address(name.as_bytes())
}

/// The marker's addresses for a listener bound to `bound`, exact first.
fn marker_names_for_listener(bound: SocketAddr, v6_only: bool) -> [Option<SocketAddr>; 2] {
    let bound = canonical_addr(bound);
    let also_v4_wildcard = match bound.ip() {
        // A dual-stack `::` listener also accepts IPv4 clients, who probe `0.0.0.0`.
        IpAddr::V6(v6) if v6.is_unspecified() && !v6_only => Some(SocketAddr::new(
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            bound.port(),
        )),
        _ => None,
    };
    [Some(bound), also_v4_wildcard]
}

/// The published proof that a preloaded process listens on an address.
///
/// **Lifetime.** Dropping the marker (when the listener closes) closes its sockets and the
/// names vanish; so does the death of every process holding them, with no file left behind.
///
/// **Fork and exec.** The sockets are `SOCK_CLOEXEC`. A forked worker inherits them together
/// with the listening fd, so a pre-fork server stays discoverable as long as any process
/// holding the listener lives (each process's hook layer closes its copy when it closes its
/// copy of the listener). Across `exec` the marker is dropped on purpose: the new program may
/// not be preloaded, and a marker outliving sandirect in a process would make clients create
/// segments nobody attaches (harmless, but a wasted attempt per connection). A preloaded
/// program that inherits a listening fd across exec (socket activation, binary upgrade)
/// re-publishes it at init; that is the hook layer's job.
///
/// **Shared names.** If a name is already bound (a `SO_REUSEPORT` sibling listener in another
/// process, or a squatter), this marker does not hold it and [`is_published`] tells; clients
/// still find the sibling's marker while the sibling lives.
///
/// [`is_published`]: ListenerMarker::is_published
#[derive(Debug)]
pub struct ListenerMarker {
    sockets: [Option<OwnedFd>; 2],
    /// Socket files in the segment directory (see [`address_in_dir`]), for clients in other
    /// network namespaces that share the directory: one per address a client there can reach
    /// the listener at (a wildcard listener's: every non-loopback address of this network
    /// namespace, read once at `listen`), with the directory. When the marker goes, a file
    /// whose socket no process holds any more (a connect is refused) is removed; one a
    /// pre-forked sibling still holds stays. A file left by a process that died holding it
    /// also refuses connections, which probes take for "no marker", and the next publisher
    /// replaces it.
    in_dir: Vec<(OwnedFd, SocketAddr)>,
    dir: Option<san_shm::ShmDir>,
}

impl Drop for ListenerMarker {
    fn drop(&mut self) {
        let Some(dir) = self.dir.take() else {
            return;
        };
        for (socket, name) in self.in_dir.drain(..) {
            drop(socket);
            let file = marker_file_name(name);
            if !file_socket_is_held(dir.as_fd(), file.as_str()) {
                let _ = dir.remove(file.as_str());
            }
        }
    }
}

/// The addresses a client of another network namespace can reach a listener bound to `bound`
/// at: `bound` itself, or for a wildcard, every non-loopback address of this network namespace
/// of its family (IPv4 ones too for a dual-stack `::`). Loopback addresses are left out: no
/// other namespace reaches them.
fn addresses_reachable_from_elsewhere(bound: SocketAddr, v6_only: bool) -> Vec<SocketAddr> {
    let bound = canonical_addr(bound);
    if !bound.ip().is_unspecified() {
        return if bound.ip().is_loopback() {
            Vec::new()
        } else {
            vec![bound]
        };
    }
    let (want_v4, want_v6) = match bound.ip() {
        IpAddr::V4(_) => (true, false),
        IpAddr::V6(_) => (!v6_only, true),
    };
    let mut found = Vec::new();
    let mut list: *mut libc::ifaddrs = core::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a list we free below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return found;
    }
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: a node of the list getifaddrs returned, valid until freeifaddrs.
        let node = unsafe { &*entry };
        entry = node.ifa_next;
        if node.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` points to a socket address whose family says its size.
        let family = i32::from(unsafe { (*node.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET if want_v4 => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*node.ifa_addr.cast::<libc::sockaddr_in>() };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 if want_v6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*node.ifa_addr.cast::<libc::sockaddr_in6>() };
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        let addr = canonical_addr(SocketAddr::new(ip, bound.port()));
        if !addr.ip().is_loopback() && !found.contains(&addr) {
            found.push(addr);
        }
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

/// Whether some process holds the datagram socket bound to file `name` in `dir` (a connect
/// succeeds; a file whose socket is closed refuses it). When it cannot be asked: held.
fn file_socket_is_held(dir: BorrowedFd<'_>, name: &str) -> bool {
    file_socket_answer(dir, name) != Some(false)
}

/// A datagram `connect()` to the socket file `name` in `dir`: `Some(true)` when it succeeds,
/// `Some(false)` when refused (the file's socket is closed, or it is not a socket), `None` when
/// it could not be asked or failed otherwise (no such file counts as refused too, as nothing
/// holds it).
pub(crate) fn file_socket_answer(dir: BorrowedFd<'_>, name: &str) -> Option<bool> {
    let (sun, len) = address_in_dir(dir, name)?;
    let probe = new_socket(libc::AF_UNIX, libc::SOCK_DGRAM, "marker probe").ok()?;
    // SAFETY: `sun` is a valid sockaddr_un of length `len`.
    let rc = unsafe {
        libc::connect(
            probe.as_raw_fd(),
            (&sun as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    if rc == 0 {
        return Some(true);
    }
    matches!(errno::get(), libc::ECONNREFUSED | libc::ENOENT).then_some(false)
}

impl ListenerMarker {
    /// Publishes the marker of a listener bound to `bound` (as `getsockname` reports it after
    /// `listen()`). `v6_only` is the listener's `IPV6_V6ONLY`; a dual-stack wildcard listener
    /// publishes the IPv4 wildcard name too.
    ///
    /// # Errors
    /// [`DiscoveryError::Os`] if a socket cannot be created or a name cannot be bound for a
    /// reason other than "already taken".
    pub fn publish(bound: SocketAddr, v6_only: bool) -> Result<ListenerMarker, DiscoveryError> {
        let uid = effective_uid();
        let mut sockets = [None, None];
        for (slot, name) in sockets
            .iter_mut()
            .zip(marker_names_for_listener(bound, v6_only))
        {
            let Some(name) = name else { continue };
            let socket = new_socket(libc::AF_UNIX, libc::SOCK_DGRAM, "marker socket")?;
            let (sun, len) = marker_address(uid, name);
            // SAFETY: `sun` is a valid sockaddr_un of length `len`.
            let rc = unsafe {
                libc::bind(
                    socket.as_raw_fd(),
                    (&sun as *const libc::sockaddr_un).cast(),
                    len,
                )
            };
            if rc == 0 {
                *slot = Some(socket);
            } else if errno::get() != libc::EADDRINUSE {
                return Err(DiscoveryError::last_os("bind listener marker"));
            }
        }
        Ok(ListenerMarker {
            sockets,
            in_dir: Vec::new(),
            dir: None,
        })
    }

    /// Publishes the marker in the segment directory `dir` too, under every address a client
    /// of another network namespace can reach the listener at (best effort: an address whose
    /// file cannot be bound only keeps such clients on TCP).
    pub fn publish_in_dir(&mut self, dir: &SegmentDir, bound: SocketAddr, v6_only: bool) {
        self.dir = Some(dir.handle().clone());
        for name in addresses_reachable_from_elsewhere(bound, v6_only) {
            let Ok(socket) = new_socket(libc::AF_UNIX, libc::SOCK_DGRAM, "marker socket") else {
                continue;
            };
            if bind_marker_file(&socket, dir.as_fd(), marker_file_name(name).as_str()) {
                self.in_dir.push((socket, name));
            }
        }
    }

    /// [`publish`](Self::publish) for a listening socket: reads its bound address and
    /// `IPV6_V6ONLY`.
    ///
    /// # Errors
    /// As `publish`, plus `getsockname`/`getsockopt` failures and
    /// [`DiscoveryError::UnsupportedFamily`] for a non-IP socket.
    pub fn publish_for_listener(
        listener: BorrowedFd<'_>,
        dir: Option<&SegmentDir>,
    ) -> Result<ListenerMarker, DiscoveryError> {
        let bound = socket_name(listener, false)?;
        let v6_only = match bound {
            SocketAddr::V4(_) => false,
            SocketAddr::V6(_) => {
                let mut value: libc::c_int = 0;
                let mut len = size_of::<libc::c_int>() as libc::socklen_t;
                // SAFETY: the kernel writes at most `len` bytes into `value`.
                let rc = unsafe {
                    libc::getsockopt(
                        listener.as_raw_fd(),
                        libc::IPPROTO_IPV6,
                        libc::IPV6_V6ONLY,
                        (&mut value as *mut libc::c_int).cast(),
                        &mut len,
                    )
                };
                if rc != 0 {
                    return Err(DiscoveryError::last_os("getsockopt IPV6_V6ONLY"));
                }
                value != 0
            }
        };
        let mut marker = ListenerMarker::publish(bound, v6_only)?;
        if let Some(dir) = dir {
            marker.publish_in_dir(dir, bound, v6_only);
        }
        Ok(marker)
    }

    /// Whether this marker holds at least one of its names (false: every name was already
    /// taken by someone else).
    pub fn is_published(&self) -> bool {
        self.sockets.iter().any(Option::is_some)
    }
}

/// Whether `ip` is assigned to this host (in this network namespace): binding to it succeeds.
/// Loopback addresses are local without a system call.
fn is_local_address(ip: IpAddr) -> bool {
    if ip.is_loopback() {
        return true;
    }
    let domain = if ip.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let Ok(socket) = new_socket(domain, libc::SOCK_DGRAM, "locality probe") else {
        return false;
    };
    let (storage, len) = socket_addr_to_raw(SocketAddr::new(ip, 0));
    // SAFETY: `storage` holds a valid address of length `len`.
    let rc = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&storage as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    rc == 0
}

/// Whether a preloaded process listens on `peer` (the server address of a connection this
/// process just established): `connect()`s a datagram socket to the exact marker name, then to
/// the wildcard name of the address family. No byte is sent.
///
/// A wildcard marker only counts when `peer` is an address of this host: a `0.0.0.0:80`
/// listener here says nothing about another host's port 80. (An exact marker implies a local
/// address already, since a listener can only bind one, barring `IP_FREEBIND`.)
///
/// Any failure (no marker, out of fds, …) answers `false`: the connection stays plain TCP,
/// which is always correct.
pub fn probe_listener(peer: SocketAddr) -> bool {
    probe_listener_checked(peer) == Some(true)
}

/// [`probe_listener`], `None` when the question could not be asked (no descriptor for the
/// probe): that says nothing about the server.
pub fn probe_listener_checked(peer: SocketAddr) -> Option<bool> {
    probe_listener_of(effective_uid(), peer)
}

/// [`probe_listener`] for the markers of user `uid`.
fn probe_listener_of(uid: u32, peer: SocketAddr) -> Option<bool> {
    let peer = canonical_addr(peer);
    let socket = new_socket(libc::AF_UNIX, libc::SOCK_DGRAM, "marker probe").ok()?;
    let connects = |name: SocketAddr| {
        let (sun, len) = marker_address(uid, name);
        // SAFETY: `sun` is a valid sockaddr_un of length `len`.
        let rc = unsafe {
            libc::connect(
                socket.as_raw_fd(),
                (&sun as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        rc == 0
    };
    if connects(peer) {
        return Some(true);
    }
    let wildcard = match peer.ip() {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    Some(
        peer.ip() != wildcard
            && connects(SocketAddr::new(wildcard, peer.port()))
            && is_local_address(peer.ip()),
    )
}

/// When [`probe_listener`] said no: whether a preloaded process that shares the segment
/// directory `dir` listens on `peer` from another network namespace (its marker file for that
/// exact address, see [`ListenerMarker::publish_in_dir`]).
pub fn probe_listener_in_dir(dir: BorrowedFd<'_>, peer: SocketAddr) -> bool {
    let peer = canonical_addr(peer);
    file_socket_answer(dir, marker_file_name(peer).as_str()) == Some(true)
}

/// When [`probe_listener`] said no: the user of the listener on `peer` if it is a preloaded
/// listener of this host run by another user (the SAN never joins two users). The owner comes
/// from the kernel's socket table (`sock_diag`, one exact lookup), then that user's marker is
/// probed. `None` for anything else, and on any failure.
pub fn preloaded_listener_of_another_user(peer: SocketAddr) -> Option<u32> {
    let peer = canonical_addr(peer);
    if !is_local_address(peer.ip()) {
        return None;
    }
    let uid = crate::listener_owner::listener_owner(peer)?;
    (uid != effective_uid() && probe_listener_of(uid, peer) == Some(true)).then_some(uid)
}

// ---------------------------------------------------------------------------------------------
// Connection keys
// ---------------------------------------------------------------------------------------------

/// Which end of a TCP connection a socket is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Returned by a successful `connect()`.
    Connecting,
    /// Returned by `accept()`.
    Accepting,
}

/// The canonical 4-tuple of a TCP connection: client (connecting) endpoint → server
/// (accepting) endpoint, v4-mapped addresses folded to IPv4. Both ends compute the same key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnectionKey {
    client: SocketAddr,
    server: SocketAddr,
}

/// Longest segment name: two endpoints of 32 hex digits + `-` + 5-digit port, and a `_`.
const SEGMENT_NAME_CAPACITY: usize = 2 * (32 + 1 + 5) + 1;

/// A segment file name: `<client>_<server>`, each endpoint `<ip>-<port>` with IPv4 in dotted
/// decimal and IPv6 as 32 lowercase hex digits. Only `[0-9a-f._-]`: safe as a file name.
/// Built on the stack (no allocation).
#[derive(Clone, Copy)]
pub struct SegmentName(StackStr<SEGMENT_NAME_CAPACITY>);

impl SegmentName {
    /// The name.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl AsRef<str> for SegmentName {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for SegmentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl PartialEq for SegmentName {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for SegmentName {}

fn write_endpoint(out: &mut impl fmt::Write, addr: SocketAddr) -> fmt::Result {
    match addr.ip() {
        IpAddr::V4(v4) => write!(out, "{v4}")?,
        IpAddr::V6(v6) => {
            for byte in v6.octets() {
                write!(out, "{byte:02x}")?;
            }
        }
    }
    write!(out, "-{}", addr.port())
}

fn parse_endpoint(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.rsplit_once('-')?;
    let port = port.parse::<u16>().ok()?;
    let ip = if ip.len() == 32 {
        let mut octets = [0u8; 16];
        for (octet, pair) in octets.iter_mut().zip(ip.as_bytes().chunks_exact(2)) {
            *octet = u8::from_str_radix(core::str::from_utf8(pair).ok()?, 16).ok()?;
        }
        IpAddr::V6(Ipv6Addr::from(octets))
    } else {
        IpAddr::V4(ip.parse::<Ipv4Addr>().ok()?)
    };
    Some(SocketAddr::new(ip, port))
}

impl ConnectionKey {
    /// The key of a connection from `client` to `server` (any form; canonicalised here).
    pub fn new(client: SocketAddr, server: SocketAddr) -> ConnectionKey {
        ConnectionKey {
            client: canonical_addr(client),
            server: canonical_addr(server),
        }
    }

    /// The key as the connecting side sees it: `local` is `getsockname`, `peer` `getpeername`.
    pub fn from_connecting_side(local: SocketAddr, peer: SocketAddr) -> ConnectionKey {
        ConnectionKey::new(local, peer)
    }

    /// The key as the accepting side sees it: the reverse view of the same connection.
    pub fn from_accepting_side(local: SocketAddr, peer: SocketAddr) -> ConnectionKey {
        ConnectionKey::new(peer, local)
    }

    /// The key of a connected TCP socket, from `getsockname`/`getpeername`.
    ///
    /// # Errors
    /// The system call's failure (e.g. `ENOTCONN`), or [`DiscoveryError::UnsupportedFamily`].
    pub fn of_socket(socket: BorrowedFd<'_>, role: Role) -> Result<ConnectionKey, DiscoveryError> {
        let local = socket_name(socket, false)?;
        let peer = socket_name(socket, true)?;
        Ok(match role {
            Role::Connecting => ConnectionKey::from_connecting_side(local, peer),
            Role::Accepting => ConnectionKey::from_accepting_side(local, peer),
        })
    }

    /// The connecting endpoint (canonical).
    pub fn client(&self) -> SocketAddr {
        self.client
    }

    /// The accepting endpoint (canonical).
    pub fn server(&self) -> SocketAddr {
        self.server
    }

    /// The segment file name of this connection.
    pub fn segment_name(&self) -> SegmentName {
        let mut name = StackStr::new();
        // Cannot fail: the capacity covers two IPv6 endpoints.
        let _ = write_endpoint(&mut name, self.client)
            .and_then(|()| name.write_str("_"))
            .and_then(|()| write_endpoint(&mut name, self.server));
        SegmentName(name)
    }

    /// Parses a segment file name (as found in a segment directory, e.g. by `sandirect stat`).
    /// Only the canonical encoding [`segment_name`](Self::segment_name) produces is accepted.
    pub fn parse_segment_name(name: &str) -> Option<ConnectionKey> {
        let (client, server) = name.split_once('_')?;
        let key = ConnectionKey::new(parse_endpoint(client)?, parse_endpoint(server)?);
        (key.segment_name().as_str() == name).then_some(key)
    }
}

// ---------------------------------------------------------------------------------------------
// Segment directory
// ---------------------------------------------------------------------------------------------

/// The per-user directory segment files live in, verified private, held open.
///
/// Opened once with `O_NOFOLLOW|O_DIRECTORY` and checked with `fstat` on the open descriptor
/// ([`san_shm::ShmDir`]), so the check is about the directory itself, not whatever the path
/// names later; the shm provider then reaches every segment relative to that descriptor
/// (`openat`, `linkat`, `unlinkat`, `fstatat`). Whoever may rename the directory away and put
/// another directory or a symbolic link at its path (an override in a place others can
/// write) changes nothing for this process: its segments stay in the directory it checked.
/// A peer process opens and checks the path itself: if the path named another directory
/// when it did, the two do not find each other's segments and the connection stays on TCP.
#[derive(Debug)]
pub struct SegmentDir {
    dir: san_shm::ShmDir,
}

impl SegmentDir {
    /// `/dev/shm/sandirect-<euid>`.
    pub fn default_path() -> PathBuf {
        PathBuf::from(format!("/dev/shm/sandirect-{}", effective_uid()))
    }

    /// Opens (creating it 0700 if missing; parents are not created) the segment directory:
    /// `override_path` (the `SANDIRECT_SHM_DIR` setting, read by the caller) or the default.
    ///
    /// # Errors
    /// [`DiscoveryError::UnsafeDirectory`] for a symlink, a non-directory, a directory of
    /// another user or one with group/other permission bits; [`DiscoveryError::InvalidPath`];
    /// system-call failures.
    pub fn open(override_path: Option<&Path>) -> Result<SegmentDir, DiscoveryError> {
        let path = override_path.map_or_else(SegmentDir::default_path, Path::to_path_buf);
        if path.as_os_str().is_empty() || path.as_os_str().as_bytes().contains(&0) {
            return Err(DiscoveryError::InvalidPath);
        }
        let refuse = |problem| DiscoveryError::UnsafeDirectory {
            path: path.clone(),
            problem,
        };
        match san_shm::ShmDir::open(&path) {
            Ok(dir) => Ok(SegmentDir { dir }),
            Err(san_shm::ShmError::PermissionDenied(problem)) => Err(match problem {
                PermissionProblem::Symlink => refuse(DirectoryProblem::Symlink),
                PermissionProblem::WrongOwner { uid } => {
                    refuse(DirectoryProblem::WrongOwner { uid })
                }
                PermissionProblem::ModeTooOpen { mode } => {
                    refuse(DirectoryProblem::ModeTooOpen { mode })
                }
                PermissionProblem::NotADirectory | PermissionProblem::NotRegularFile => {
                    refuse(DirectoryProblem::NotADirectory)
                }
                // The kernel refused (EACCES or EPERM; which one is not kept).
                _ => DiscoveryError::Os {
                    op: "open segment directory",
                    errno: libc::EACCES,
                },
            }),
            Err(san_shm::ShmError::NotFound) => Err(DiscoveryError::Os {
                op: "create segment directory",
                errno: libc::ENOENT,
            }),
            Err(san_shm::ShmError::Io { op, errno }) => Err(DiscoveryError::Os { op, errno }),
            Err(_) => Err(DiscoveryError::Os {
                op: "open segment directory",
                errno: libc::EINVAL,
            }),
        }
    }

    /// The path the directory was opened by (for messages: segments are reached through the
    /// open directory, see [`SegmentDir::handle`]).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The open directory, as the shm provider's `create`/`attach` take it.
    pub fn handle(&self) -> &san_shm::ShmDir {
        &self.dir
    }
}

impl AsFd for SegmentDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }
}
