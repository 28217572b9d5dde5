//! The C ABI between the loader and `libsandirect_verbs.so`.
//!
//! The library exports one symbol, [`VTABLE_SYMBOL`], an `extern "C"` function returning a
//! pointer to a static [`VerbsVtable`]. Everything crossing the boundary is `#[repr(C)]`:
//! opaque handles, plain structs, integer status codes. No Rust trait objects, no Rust
//! allocations freed on the other side, no panics (the library catches them and returns
//! [`status::INTERNAL`]).
//!
//! Versioning: [`VerbsVtable::abi_version`] must equal [`ABI_VERSION`] and
//! [`VerbsVtable::struct_size`] must be at least `size_of::<VerbsVtable>()`; a change that
//! alters an existing entry bumps the version, a new entry is appended (and older loaders,
//! checking the size, ignore it).

use core::ffi::{c_char, c_int};

/// The version of this ABI. Bump on any incompatible change.
pub const ABI_VERSION: u32 = 1;

/// The exported symbol (NUL-terminated): `extern "C" fn() -> *const VerbsVtable`.
pub const VTABLE_SYMBOL: &[u8] = b"sandirect_verbs_vtable_v1\0";

/// The file name the loader opens (through the dynamic linker's search path unless an
/// explicit path is given).
pub const LIBRARY_NAME: &str = "libsandirect_verbs.so";

/// The signature of [`VTABLE_SYMBOL`].
pub type VtableEntry = unsafe extern "C" fn() -> *const VerbsVtable;

/// Status codes returned by every fallible entry. `OK` is zero; named failures are
/// positive; a negative value is `-errno` of a failed verbs or rdma_cm call.
pub mod status {
    /// Success.
    pub const OK: i32 = 0;
    /// No RDMA device, or the address is not served by one.
    pub const NO_DEVICE: i32 = 1;
    /// An argument was rejected before any verbs call (null pointer, bad length, …).
    pub const INVALID_ARGUMENT: i32 = 2;
    /// The operation did not finish within its timeout.
    pub const TIMED_OUT: i32 = 3;
    /// The peer rejected the connection (no listener, or the listener refused it).
    pub const REJECTED: i32 = 4;
    /// The peer address or route could not be resolved, or the peer is unreachable.
    pub const UNREACHABLE: i32 = 5;
    /// The connection resolved to a device other than the domain's.
    pub const WRONG_DEVICE: i32 = 6;
    /// Connection establishment failed after the request was sent.
    pub const CONNECT_FAILED: i32 = 7;
    /// A bug or a caught panic inside the library.
    pub const INTERNAL: i32 = 8;
    /// A completion-channel wait or poll gave nothing before its timeout (not an error).
    pub const WOULD_BLOCK: i32 = 9;
    /// The memory-change monitor is not running (no userfaultfd in this process).
    pub const NO_MONITOR: i32 = 10;
    /// A connect request was refused before any reply went out: this side could not set
    /// the connection up (memory it may not pin, queue pairs). The peer sees a rejection.
    /// (A loader that predates this code reads it as `INTERNAL`: a failure after the reply,
    /// the cautious reading.)
    pub const DECLINED: i32 = 11;

    /// [`san_api::RegisterError::OutOfResources`].
    pub const REGISTER_OUT_OF_RESOURCES: i32 = 20;
    /// [`san_api::RegisterError::BadAddress`].
    pub const REGISTER_BAD_ADDRESS: i32 = 21;
    /// [`san_api::RegisterError::UnknownKey`].
    pub const REGISTER_UNKNOWN_KEY: i32 = 22;
    /// [`san_api::RegisterError::Unsupported`].
    pub const REGISTER_UNSUPPORTED: i32 = 23;

    /// [`san_api::PostError::QueueFull`].
    pub const POST_QUEUE_FULL: i32 = 30;
    /// [`san_api::PostError::TooLong`].
    pub const POST_TOO_LONG: i32 = 31;
    /// [`san_api::PostError::InvalidArgument`].
    pub const POST_INVALID_ARGUMENT: i32 = 32;
    /// [`san_api::PostError::Disconnected`].
    pub const POST_DISCONNECTED: i32 = 33;
}

/// Opaque protection-domain handle (a `VerbsDomain` inside the library).
#[repr(C)]
pub struct AbiDomain {
    _opaque: [u8; 0],
}

/// Opaque listener handle.
#[repr(C)]
pub struct AbiListener {
    _opaque: [u8; 0],
}

/// Opaque pending connection request (received by a listener, not yet accepted).
#[repr(C)]
pub struct AbiRequest {
    _opaque: [u8; 0],
}

/// Opaque connection handle.
#[repr(C)]
pub struct AbiConnection {
    _opaque: [u8; 0],
}

/// An IPv4 or IPv6 socket address. `family` is `AF_INET` or `AF_INET6`; for IPv4 only the
/// first four bytes of `addr` are used. `port` is in host byte order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AbiSockAddr {
    /// `AF_INET` or `AF_INET6`.
    pub family: u16,
    /// Port, host byte order.
    pub port: u16,
    /// IPv6 flow information (0 for IPv4).
    pub flowinfo: u32,
    /// Address bytes in network order.
    pub addr: [u8; 16],
    /// IPv6 scope id (0 for IPv4).
    pub scope_id: u32,
}

impl AbiSockAddr {
    /// Converts from a std socket address.
    pub fn from_std(addr: std::net::SocketAddr) -> Self {
        match addr {
            std::net::SocketAddr::V4(v4) => {
                let mut bytes = [0u8; 16];
                bytes[..4].copy_from_slice(&v4.ip().octets());
                Self {
                    family: libc::AF_INET as u16,
                    port: v4.port(),
                    flowinfo: 0,
                    addr: bytes,
                    scope_id: 0,
                }
            }
            std::net::SocketAddr::V6(v6) => Self {
                family: libc::AF_INET6 as u16,
                port: v6.port(),
                flowinfo: v6.flowinfo(),
                addr: v6.ip().octets(),
                scope_id: v6.scope_id(),
            },
        }
    }

    /// Converts to a std socket address, or `None` for an unknown family.
    pub fn to_std(&self) -> Option<std::net::SocketAddr> {
        match i32::from(self.family) {
            libc::AF_INET => {
                let ip =
                    std::net::Ipv4Addr::new(self.addr[0], self.addr[1], self.addr[2], self.addr[3]);
                Some(std::net::SocketAddr::from((ip, self.port)))
            }
            libc::AF_INET6 => Some(std::net::SocketAddr::V6(std::net::SocketAddrV6::new(
                std::net::Ipv6Addr::from(self.addr),
                self.port,
                self.flowinfo,
                self.scope_id,
            ))),
            _ => None,
        }
    }
}

/// [`san_api::SlotConfig`] across the boundary.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AbiSlotConfig {
    /// Send buffers.
    pub send_slots: u16,
    /// Receive buffers.
    pub recv_slots: u16,
    /// Bytes per buffer.
    pub slot_size: u32,
}

/// Bits of [`AbiCapabilities::flags`].
pub mod capability {
    /// [`san_api::Capabilities::rdma_read`].
    pub const RDMA_READ: u32 = 1;
    /// [`san_api::Capabilities::write_with_imm`].
    pub const WRITE_WITH_IMM: u32 = 2;
    /// [`san_api::Capabilities::read_sink_needs_remote_write`].
    pub const READ_SINK_NEEDS_REMOTE_WRITE: u32 = 4;
    /// [`san_api::Capabilities::active_side_sends_first`].
    pub const ACTIVE_SIDE_SENDS_FIRST: u32 = 8;
}

/// [`san_api::Capabilities`] across the boundary.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AbiCapabilities {
    /// [`capability`] bits.
    pub flags: u32,
    /// Largest slot size.
    pub max_slot_size: u32,
    /// Largest slot count.
    pub max_slots: u32,
    /// Largest inline payload.
    pub max_inline: u32,
    /// Largest single RDMA transfer.
    pub max_rdma_len: u64,
}

/// [`san_api::Registration`] across the boundary.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AbiRegistration {
    /// First byte.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Local key (a provider handle).
    pub lkey: u32,
    /// Remote key, meaningful only when `has_rkey` is 1.
    pub rkey: u32,
    /// [`san_api::Access`] bits.
    pub access: u8,
    /// 1 when remote access is exposed.
    pub has_rkey: u8,
}

/// A local segment ([`san_api::LocalSegment`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AbiLocalSegment {
    /// First byte.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Local key.
    pub lkey: u32,
}

/// A remote descriptor ([`san_api::RemoteDescriptor`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AbiRemote {
    /// Address in the peer.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

/// Values of [`AbiCompletion::kind`].
pub mod completion_kind {
    /// A send finished.
    pub const SEND: u32 = 0;
    /// A message arrived (`slot`, `len` valid).
    pub const RECV: u32 = 1;
    /// An RDMA write finished.
    pub const WRITE: u32 = 2;
    /// An RDMA read finished.
    pub const READ: u32 = 3;
}

/// Values of [`AbiCompletion::status`].
pub mod completion_status {
    /// Success.
    pub const OK: u32 = 0;
    /// [`san_api::CompletionError::Flushed`].
    pub const FLUSHED: u32 = 1;
    /// [`san_api::CompletionError::RemoteAccess`].
    pub const REMOTE_ACCESS: u32 = 2;
    /// [`san_api::CompletionError::LocalProtection`].
    pub const LOCAL_PROTECTION: u32 = 3;
    /// [`san_api::CompletionError::ReceiverNotReady`].
    pub const RECEIVER_NOT_READY: u32 = 4;
    /// [`san_api::CompletionError::RetryExceeded`].
    pub const RETRY_EXCEEDED: u32 = 5;
    /// [`san_api::CompletionError::Fatal`].
    pub const FATAL: u32 = 6;
}

/// One completion ([`san_api::Completion`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct AbiCompletion {
    /// The caller's work-request id.
    pub wr_id: u64,
    /// [`completion_kind`].
    pub kind: u32,
    /// [`completion_status`].
    pub status: u32,
    /// Receive slot (kind `RECV`).
    pub slot: u32,
    /// Received length (kind `RECV`).
    pub len: u32,
}

/// Parameters of an active connect or a passive accept.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AbiConnectParams {
    /// Slot pools to allocate and register.
    pub slots: AbiSlotConfig,
    /// RDMA reads/writes that may be in flight at once (beyond the send slots).
    pub rdma_depth: u16,
    /// 1: post every receive slot before the connection is established, with work-request
    /// id = slot number, so a peer that sends first never meets an empty receive queue.
    pub pre_post_receives: u8,
    /// Connection-setup blob for the peer (connect: request private data; accept: reply).
    pub private_data: *const u8,
    /// Its length (at most [`MAX_PRIVATE_DATA`]).
    pub private_data_len: usize,
    /// Bound on address/route resolution and establishment, milliseconds.
    pub timeout_ms: u32,
    /// Local address to bind before connecting (family 0: none).
    pub local: AbiSockAddr,
}

/// The largest connection-setup blob that fits every transport (an InfiniBand/RoCE REQ has
/// 56 bytes of private data after the rdma_cm header; one byte carries the length).
pub const MAX_PRIVATE_DATA: usize = 55;

/// Returned by `connection_arm` when completions are already queued.
pub const ARM_PENDING: i32 = 1;

/// The table of entries. Every pointer argument documented as a handle must come from the
/// matching constructor of the same library instance; each `*_close`/`*_reject`/accept
/// consumes its handle.
#[repr(C)]
pub struct VerbsVtable {
    /// [`ABI_VERSION`].
    pub abi_version: u32,
    /// `size_of::<VerbsVtable>()` of the library.
    pub struct_size: u32,
    /// Opens a protection domain on the device serving `local_ip` (if not null; port
    /// ignored) or named `device_name` (a NUL-terminated string, if not null) or the first
    /// device.
    pub domain_open: unsafe extern "C" fn(
        local_ip: *const AbiSockAddr,
        device_name: *const c_char,
        out: *mut *mut AbiDomain,
    ) -> i32,
    /// Closes a domain (connections opened from it keep it alive internally).
    pub domain_close: unsafe extern "C" fn(domain: *mut AbiDomain),
    /// Writes the device's capabilities.
    pub domain_capabilities:
        unsafe extern "C" fn(domain: *const AbiDomain, out: *mut AbiCapabilities) -> i32,
    /// Registers memory.
    pub domain_register: unsafe extern "C" fn(
        domain: *mut AbiDomain,
        addr: u64,
        len: u64,
        access: u8,
        out: *mut AbiRegistration,
    ) -> i32,
    /// Deregisters.
    pub domain_deregister: unsafe extern "C" fn(domain: *mut AbiDomain, lkey: u32) -> i32,
    /// Revokes remote access, keeping the memory registered locally.
    pub domain_revoke_remote: unsafe extern "C" fn(domain: *mut AbiDomain, lkey: u32) -> i32,
    /// Exposes again with a fresh rkey.
    pub domain_expose_remote:
        unsafe extern "C" fn(domain: *mut AbiDomain, lkey: u32, access: u8, rkey: *mut u32) -> i32,
    /// Binds and listens.
    pub listener_bind: unsafe extern "C" fn(
        domain: *mut AbiDomain,
        addr: *const AbiSockAddr,
        backlog: c_int,
        out: *mut *mut AbiListener,
    ) -> i32,
    /// The listener's pollable fd (readable when a request may be waiting).
    pub listener_fd: unsafe extern "C" fn(listener: *const AbiListener) -> c_int,
    /// The port the listener is bound to (host order).
    pub listener_port: unsafe extern "C" fn(listener: *const AbiListener) -> u16,
    /// Waits up to `timeout_ms` (-1: forever) for a connection request; copies its
    /// setup blob into `blob` (capacity `blob_cap`, length to `blob_len`).
    pub listener_next_request: unsafe extern "C" fn(
        listener: *mut AbiListener,
        timeout_ms: c_int,
        out: *mut *mut AbiRequest,
        blob: *mut u8,
        blob_cap: usize,
        blob_len: *mut usize,
    ) -> i32,
    /// Closes a listener.
    pub listener_close: unsafe extern "C" fn(listener: *mut AbiListener),
    /// Accepts a request (consumes it, success or not).
    pub request_accept: unsafe extern "C" fn(
        request: *mut AbiRequest,
        domain: *mut AbiDomain,
        params: *const AbiConnectParams,
        out: *mut *mut AbiConnection,
    ) -> i32,
    /// Rejects a request (consumes it).
    pub request_reject: unsafe extern "C" fn(request: *mut AbiRequest),
    /// Connects actively; the peer's reply blob is copied into `reply`.
    pub connect: unsafe extern "C" fn(
        domain: *mut AbiDomain,
        remote: *const AbiSockAddr,
        params: *const AbiConnectParams,
        reply: *mut u8,
        reply_cap: usize,
        reply_len: *mut usize,
        out: *mut *mut AbiConnection,
    ) -> i32,
    /// Disconnects and frees a connection (after flushing its queue pair).
    pub connection_close: unsafe extern "C" fn(conn: *mut AbiConnection),
    /// The slot pools.
    pub connection_slot_config: unsafe extern "C" fn(conn: *const AbiConnection) -> AbiSlotConfig,
    /// Copies a message into a send slot and posts it.
    pub connection_post_send: unsafe extern "C" fn(
        conn: *mut AbiConnection,
        wr_id: u64,
        msg: *const u8,
        len: usize,
    ) -> i32,
    /// Posts a receive slot.
    pub connection_post_recv:
        unsafe extern "C" fn(conn: *mut AbiConnection, wr_id: u64, slot: u16) -> i32,
    /// Points `data` at the bytes of a received slot (valid until the slot is reposted or
    /// the connection closed); writes 0 to `data_len` if the slot holds nothing.
    pub connection_recv_slot: unsafe extern "C" fn(
        conn: *const AbiConnection,
        slot: u16,
        len: u32,
        data: *mut *const u8,
        data_len: *mut usize,
    ) -> i32,
    /// Posts an RDMA write.
    pub connection_post_write: unsafe extern "C" fn(
        conn: *mut AbiConnection,
        wr_id: u64,
        local: *const AbiLocalSegment,
        remote: *const AbiRemote,
    ) -> i32,
    /// Posts an RDMA read.
    pub connection_post_read: unsafe extern "C" fn(
        conn: *mut AbiConnection,
        wr_id: u64,
        local: *const AbiLocalSegment,
        remote: *const AbiRemote,
    ) -> i32,
    /// Moves up to `max` completions into `out`; returns how many.
    pub connection_poll: unsafe extern "C" fn(
        conn: *mut AbiConnection,
        out: *mut AbiCompletion,
        max: usize,
    ) -> usize,
    /// Waits (spin a bounded time, then block on the completion channel) until a
    /// completion or a connection event is available, or `timeout_ms` passed (-1: forever).
    /// Returns `OK` when something is ready, `WOULD_BLOCK` on timeout.
    pub connection_wait: unsafe extern "C" fn(conn: *mut AbiConnection, timeout_ms: c_int) -> i32,
    /// Arms the completion channel for a caller that blocks on [`Self::connection_fd`]
    /// itself: returns [`status::OK`] when armed with nothing pending (block now), or
    /// [`ARM_PENDING`] when completions are already queued (poll instead of blocking).
    pub connection_arm: unsafe extern "C" fn(conn: *mut AbiConnection) -> i32,
    /// A pollable fd, readable when the armed completion channel fired or a connection
    /// event (disconnect) arrived.
    pub connection_fd: unsafe extern "C" fn(conn: *const AbiConnection) -> c_int,
    // ---- Appended (registration-cache invalidation); older loaders ignore them. ----
    /// Collects the mapping changes under the domain's registrations since the last call
    /// (`VerbsDomain::take_memory_changes`): writes up to `cap` ranges to `out` and their
    /// number to `count`. More changes than `cap` are written as one range covering the
    /// whole address space (`addr` 0, `len` `u64::MAX`). Returns [`status::NO_MONITOR`] (and
    /// no ranges) when the memory-change monitor is not running in this process.
    pub domain_take_memory_changes: unsafe extern "C" fn(
        domain: *mut AbiDomain,
        out: *mut AbiRange,
        cap: usize,
        count: *mut usize,
    ) -> i32,
    /// 1 if changes to the mapping under the registration `lkey` are reported, 0 if not (the
    /// caller must then not keep it cached past its transfer), a negative value for an
    /// unknown key.
    pub domain_is_watched: unsafe extern "C" fn(domain: *const AbiDomain, lkey: u32) -> i32,
    // ---- Appended (solicited-only arming). ----
    /// As [`Self::connection_arm`], but only the peer's next message (or a failed
    /// completion) raises the event, not the completion of our own sends.
    pub connection_arm_solicited: unsafe extern "C" fn(conn: *mut AbiConnection) -> i32,
    // ---- Appended (polling readers). ----
    /// Consumes the completion channel's pending (or arriving) event, waiting up to
    /// `timeout_ms` for it, and disarms: [`status::OK`], or [`status::WOULD_BLOCK`] when none
    /// came.
    pub connection_take_event:
        unsafe extern "C" fn(conn: *mut AbiConnection, timeout_ms: c_int) -> i32,
    // ---- Appended (authenticated set-up: several requests held at once). ----
    /// Writes the address a request came from (`rdma_get_peer_addr`) to `out`:
    /// [`status::OK`], or [`status::NO_DEVICE`] when rdma_cm names none.
    pub request_peer:
        unsafe extern "C" fn(request: *const AbiRequest, out: *mut AbiSockAddr) -> i32,
    /// As [`Self::request_accept`], but returns once the reply went out, without waiting for
    /// the peer to complete the handshake (see [`Self::connection_wait_established`]).
    pub request_accept_started: unsafe extern "C" fn(
        request: *mut AbiRequest,
        domain: *mut AbiDomain,
        params: *const AbiConnectParams,
        out: *mut *mut AbiConnection,
    ) -> i32,
    /// Waits up to `timeout_ms` for a connection of [`Self::request_accept_started`] to be
    /// established ([`status::OK`] at once for any other): [`status::TIMED_OUT`], or the
    /// status of the failed handshake (the connection is then down).
    pub connection_wait_established:
        unsafe extern "C" fn(conn: *mut AbiConnection, timeout_ms: c_int) -> i32,
}

/// A byte range (`san_api::MemRange`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AbiRange {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}
