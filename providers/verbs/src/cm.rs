//! rdma_cm: event channels, ids, events, addresses and the setup blob framing.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::{
    ibv_context, ibv_qp_init_attr, ibv_qp_type, rdma_ack_cm_event, rdma_cm_event,
    rdma_cm_event_type, rdma_cm_id, rdma_conn_param, rdma_create_event_channel, rdma_create_id,
    rdma_create_qp, rdma_destroy_event_channel, rdma_destroy_id, rdma_destroy_qp,
    rdma_event_channel, rdma_get_cm_event, rdma_migrate_id, rdma_port_space,
};
use san_verbs_loader::abi::MAX_PRIVATE_DATA;

use crate::device::Device;
use crate::pd::ProtectionDomain;
use crate::qp::QueuePair;
use crate::sys::{errno, set_nonblocking};
use crate::VerbsSetupError;

/// An rdma_cm event channel with a non-blocking fd. Shared (`Arc`) by the ids reporting
/// on it, so that it is destroyed only after all of them.
pub(crate) struct EventChannel {
    channel: NonNull<rdma_event_channel>,
}

// SAFETY: librdmacm channels may be used from any thread; owners serialise reads.
unsafe impl Send for EventChannel {}
// SAFETY: the only operation through `&EventChannel` is reading an event, which librdmacm
// serialises in the kernel (one read per event).
unsafe impl Sync for EventChannel {}

/// A copied, already acknowledged rdma_cm event.
#[derive(Debug)]
pub(crate) struct CmEvent {
    pub(crate) kind: rdma_cm_event_type::Type,
    pub(crate) status: i32,
    /// The id the event is about (for a connect request: the new id, owned by us now).
    pub(crate) id: *mut rdma_cm_id,
    /// The setup blob, decoded (empty when absent or malformed).
    pub(crate) blob: Vec<u8>,
    /// The peer's RDMA read depths (connect requests only).
    pub(crate) responder_resources: u8,
    pub(crate) initiator_depth: u8,
}

impl EventChannel {
    pub(crate) fn new() -> Result<Arc<Self>, VerbsSetupError> {
        // SAFETY: no arguments; returns null with errno on failure.
        let channel = unsafe { rdma_create_event_channel() };
        let channel = NonNull::new(channel).ok_or_else(|| match errno() {
            libc::ENODEV | libc::ENOSYS | libc::ENOENT => VerbsSetupError::NoDevice,
            other => VerbsSetupError::Os(other),
        })?;
        let channel = Self { channel };
        set_nonblocking(channel.fd())?;
        Ok(Arc::new(channel))
    }

    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: live channel; `fd` never changes.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    /// The next event if one is queued, copied and acknowledged.
    pub(crate) fn try_next(&self) -> Result<Option<CmEvent>, VerbsSetupError> {
        let mut event: *mut rdma_cm_event = std::ptr::null_mut();
        // SAFETY: live channel (non-blocking fd); valid out pointer.
        if unsafe { rdma_get_cm_event(self.channel.as_ptr(), &mut event) } != 0 {
            return match errno() {
                libc::EAGAIN | libc::EINTR => Ok(None),
                other => Err(VerbsSetupError::Os(other)),
            };
        }
        // SAFETY: rdma_get_cm_event succeeded: `event` is valid until acknowledged. The
        // connection parameters are the union member rdma_cm fills for connection events
        // on a TCP port space id (we never create UD ids); the private data pointer, when
        // not null, holds `private_data_len` bytes.
        let copied = unsafe {
            let e = &*event;
            let conn = &e.param.conn;
            let raw = if conn.private_data.is_null() {
                &[][..]
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    usize::from(conn.private_data_len),
                )
            };
            CmEvent {
                kind: e.event,
                status: e.status,
                id: e.id,
                blob: decode_blob(raw),
                responder_resources: conn.responder_resources,
                initiator_depth: conn.initiator_depth,
            }
        };
        // SAFETY: acknowledged exactly once, after copying everything we need.
        unsafe { rdma_ack_cm_event(event) };
        Ok(Some(copied))
    }

    /// Waits up to `deadline` for the next event.
    pub(crate) fn next_until(&self, deadline: Option<Instant>) -> Result<CmEvent, VerbsSetupError> {
        loop {
            if let Some(event) = self.try_next()? {
                return Ok(event);
            }
            let timeout = match deadline {
                None => -1,
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(VerbsSetupError::TimedOut);
                    }
                    i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX)
                }
            };
            wait_readable(self.fd(), timeout)?;
        }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on the channel holds an `Arc` of it, so none is left; freed once.
        unsafe { rdma_destroy_event_channel(self.channel.as_ptr()) };
    }
}

/// Blocks until `fd` is readable or `timeout_ms` passed (-1: forever). EINTR retries.
pub(crate) fn wait_readable(fd: RawFd, timeout_ms: i32) -> Result<bool, VerbsSetupError> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    match unsafe { libc::poll(&mut pfd, 1, timeout_ms) } {
        n if n > 0 => Ok(true),
        0 => Ok(false),
        _ if errno() == libc::EINTR => Ok(false),
        _ => Err(VerbsSetupError::Os(errno())),
    }
}

/// An rdma_cm id with the QP it may own. Destroys the QP, then the id, then releases its
/// channel reference.
pub(crate) struct CmId {
    id: NonNull<rdma_cm_id>,
    channel: Arc<EventChannel>,
    has_qp: bool,
}

// SAFETY: librdmacm ids may be used from any thread; the owner serialises use (`&mut`).
unsafe impl Send for CmId {}

impl CmId {
    /// A new id on `channel` in the TCP port space (reliable connected).
    pub(crate) fn new(channel: &Arc<EventChannel>) -> Result<Self, VerbsSetupError> {
        let mut id: *mut rdma_cm_id = std::ptr::null_mut();
        // SAFETY: live channel, valid out pointer, no user context.
        let rc = unsafe {
            rdma_create_id(
                channel.channel.as_ptr(),
                &mut id,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        let id = NonNull::new(id)
            .filter(|_| rc == 0)
            .ok_or_else(|| VerbsSetupError::Os(errno()))?;
        Ok(Self {
            id,
            channel: channel.clone(),
            has_qp: false,
        })
    }

    /// Takes ownership of the id of a connect request that arrived on `channel`.
    pub(crate) fn adopt(
        id: *mut rdma_cm_id,
        channel: &Arc<EventChannel>,
    ) -> Result<Self, VerbsSetupError> {
        let id = NonNull::new(id).ok_or(VerbsSetupError::Internal)?;
        Ok(Self {
            id,
            channel: channel.clone(),
            has_qp: false,
        })
    }

    pub(crate) fn as_ptr(&self) -> *mut rdma_cm_id {
        self.id.as_ptr()
    }

    /// The device context the id is bound to, once an address is bound or resolved.
    pub(crate) fn context(&self) -> Option<NonNull<ibv_context>> {
        // SAFETY: live id; `verbs` is written by rdma_cm during bind/resolve, which
        // happened-before on this thread.
        NonNull::new(unsafe { (*self.id.as_ptr()).verbs })
    }

    /// The channel this id reports on.
    pub(crate) fn channel(&self) -> &Arc<EventChannel> {
        &self.channel
    }

    /// Moves the id's event reporting to `channel`.
    pub(crate) fn migrate(&mut self, channel: &Arc<EventChannel>) -> Result<(), VerbsSetupError> {
        // SAFETY: live id and channel; every event of the id was acknowledged already
        // (we ack at once), as rdma_migrate_id requires.
        if unsafe { rdma_migrate_id(self.id.as_ptr(), channel.channel.as_ptr()) } != 0 {
            return Err(VerbsSetupError::Os(errno()));
        }
        self.channel = channel.clone();
        Ok(())
    }

    /// Creates the id's RC QP on `pd` with one CQ for both queues; every send signalled.
    pub(crate) fn create_qp(
        &mut self,
        pd: &ProtectionDomain,
        cq: *mut rdma_sys::ibv_cq,
        send_depth: u32,
        recv_depth: u32,
    ) -> Result<QueuePair, VerbsSetupError> {
        if self.has_qp {
            return Err(VerbsSetupError::Internal);
        }
        // SAFETY: plain data; all-zero is a valid starting point.
        let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq;
        attr.recv_cq = cq;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.sq_sig_all = 1;
        attr.cap.max_send_wr = send_depth;
        attr.cap.max_recv_wr = recv_depth;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        // SAFETY: live id bound to the PD's device (checked by callers), live PD and CQ
        // on that device; the attribute struct lives across the call.
        if unsafe { rdma_create_qp(self.id.as_ptr(), pd.as_ptr(), &mut attr) } != 0 {
            return Err(VerbsSetupError::Os(errno()));
        }
        self.has_qp = true;
        // SAFETY: rdma_create_qp succeeded, so `qp` is set and lives until rdma_destroy_qp.
        let qp =
            NonNull::new(unsafe { (*self.id.as_ptr()).qp }).ok_or(VerbsSetupError::Internal)?;
        Ok(QueuePair::new(qp))
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        if self.has_qp {
            // SAFETY: the QP was created on this id and is destroyed once, before the id.
            unsafe { rdma_destroy_qp(self.id.as_ptr()) };
        }
        // SAFETY: live id, destroyed once; all its events were acknowledged.
        unsafe { rdma_destroy_id(self.id.as_ptr()) };
    }
}

/// `RDMA_OPTION_ID` and `RDMA_OPTION_ID_ACK_TIMEOUT` of `<rdma/rdma_cma.h>` (anonymous enums
/// that the bindings do not carry).
const RDMA_OPTION_ID: i32 = 0;
const RDMA_OPTION_ID_ACK_TIMEOUT: i32 = 3;
/// Local ACK timeout exponent: 4.096 µs × 2^16 ≈ 270 ms per transport retry. rdma_cm's
/// default for RoCE (2^17–2^19) makes every lost RDMA-read response cost ~0.5–2 s,
/// because reads are only recovered by this timer; a dead peer still surfaces as
/// `RetryExceeded` after about 2 s (7 retries).
const ACK_TIMEOUT_EXPONENT: u8 = 16;

impl CmId {
    /// Sets the transport ACK timeout for the QP this id will connect (InfiniBand and
    /// RoCE only; iWARP runs over TCP, so a refusal is ignored).
    pub(crate) fn set_ack_timeout(&self) {
        let mut exponent = ACK_TIMEOUT_EXPONENT;
        // SAFETY: live id; the option value is one u8, as librdmacm documents for
        // RDMA_OPTION_ID_ACK_TIMEOUT.
        unsafe {
            rdma_sys::rdma_set_option(
                self.id.as_ptr(),
                RDMA_OPTION_ID,
                RDMA_OPTION_ID_ACK_TIMEOUT,
                (&mut exponent as *mut u8).cast(),
                1,
            )
        };
    }
}

/// rdma_cm connection parameters carrying `blob` (framed) and the read depths.
/// `frame` must outlive the use of the returned struct.
pub(crate) fn conn_param(
    frame: &[u8],
    responder_resources: u8,
    initiator_depth: u8,
) -> rdma_conn_param {
    rdma_conn_param {
        private_data: frame.as_ptr().cast(),
        private_data_len: u8::try_from(frame.len()).unwrap_or(0),
        responder_resources,
        initiator_depth,
        flow_control: 0,
        // Transport retries: bounded, so that a dead peer surfaces as RetryExceeded.
        retry_count: 7,
        // Receiver-not-ready retries: bounded (7 would mean forever).
        rnr_retry_count: 6,
        srq: 0,
        qp_num: 0,
    }
}

/// Frames a setup blob: one length byte, then the bytes. InfiniBand/RoCE deliver private
/// data padded to its maximum size, so the length must travel inside.
pub(crate) fn encode_blob(blob: &[u8]) -> Result<Vec<u8>, VerbsSetupError> {
    if blob.len() > MAX_PRIVATE_DATA {
        return Err(VerbsSetupError::InvalidArgument);
    }
    let mut frame = Vec::with_capacity(blob.len() + 1);
    frame.push(u8::try_from(blob.len()).map_err(|_| VerbsSetupError::InvalidArgument)?);
    frame.extend_from_slice(blob);
    Ok(frame)
}

/// Decodes a framed blob from peer bytes: empty when absent or malformed (never panics).
pub(crate) fn decode_blob(raw: &[u8]) -> Vec<u8> {
    match raw.split_first() {
        Some((&len, rest)) if usize::from(len) <= rest.len() => rest[..usize::from(len)].to_vec(),
        _ => Vec::new(),
    }
}

/// A `sockaddr_storage` for `addr`, and its length.
pub(crate) fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and suitably aligned for sockaddr_in6.
            unsafe { std::ptr::write((&mut storage as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, libc::socklen_t::try_from(len).unwrap_or(0))
}

/// The socket address in `storage` (IPv4 or IPv6; `None` for another family).
pub(crate) fn socket_addr(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match i32::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in, which it is larger
            // than and suitably aligned for.
            let sin =
                unsafe { *(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::from((
                sin.sin_addr.s_addr.to_ne_bytes(),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 =
                unsafe { *(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                sin6.sin6_addr.s6_addr.into(),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// The address of the other side of `id` (for the id of a connect request: the address
/// the request came from, `rdma_get_peer_addr`).
pub(crate) fn peer_address(id: &CmId) -> Option<SocketAddr> {
    // SAFETY: live id; rdma_cm fills the route's destination address of a connect request's
    // id before reporting the request (the union's storage member spans every family).
    let storage = unsafe { (*id.as_ptr()).route.addr.dst_addr_union.dst_storage };
    socket_addr(&storage)
}

/// The port an id is bound to (host order), from its source address.
pub(crate) fn bound_port(id: &CmId) -> u16 {
    // SAFETY: live id; the route's source address is a sockaddr written by bind/resolve;
    // reading the port field of sockaddr_in and sockaddr_in6 (same offset) is in bounds
    // of the sockaddr_storage union member.
    unsafe {
        let storage = &(*id.as_ptr()).route.addr.src_addr_union.src_storage;
        let sin = (storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>();
        u16::from_be((*sin).sin_port)
    }
}

/// The device rdma_cm binds the local address `ip` to.
pub(crate) fn device_for_local_ip(ip: IpAddr) -> Result<Device, VerbsSetupError> {
    let context = device_of_local_address(ip)?;
    Device::query(context)
}

/// The device context rdma_cm binds the local address `ip` to.
fn device_of_local_address(ip: IpAddr) -> Result<NonNull<ibv_context>, VerbsSetupError> {
    let channel = EventChannel::new()?;
    let id = CmId::new(&channel)?;
    let (mut storage, _) = sockaddr(SocketAddr::new(ip, 0));
    // SAFETY: live id; `storage` holds a valid sockaddr of the right family.
    if unsafe {
        rdma_sys::rdma_bind_addr(
            id.as_ptr(),
            (&mut storage as *mut libc::sockaddr_storage).cast(),
        )
    } != 0
    {
        return Err(match errno() {
            libc::EADDRNOTAVAIL | libc::ENODEV => VerbsSetupError::NoDevice,
            other => VerbsSetupError::Os(other),
        });
    }
    id.context().ok_or(VerbsSetupError::NoDevice)
}

/// Maps a failure event during connection setup to an error.
pub(crate) fn setup_failure(event: &CmEvent) -> VerbsSetupError {
    match event.kind {
        rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => VerbsSetupError::Rejected,
        rdma_cm_event_type::RDMA_CM_EVENT_ADDR_ERROR
        | rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_ERROR
        | rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE => VerbsSetupError::Unreachable,
        _ => VerbsSetupError::ConnectFailed,
    }
}

/// Waits on `id`'s channel for `expected`, failing on any other event.
pub(crate) fn expect_event(
    id: &CmId,
    expected: rdma_cm_event_type::Type,
    deadline: Instant,
) -> Result<CmEvent, VerbsSetupError> {
    let event = id.channel().next_until(Some(deadline))?;
    if event.kind == expected && event.status == 0 {
        Ok(event)
    } else {
        Err(setup_failure(&event))
    }
}

/// `Instant::now() + timeout`, saturating.
pub(crate) fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or(now + Duration::from_secs(86_400))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_round_trip_and_hostile_frames_decode_to_nothing() {
        for blob in [&b""[..], b"hello", &[7u8; MAX_PRIVATE_DATA]] {
            let mut frame = encode_blob(blob).unwrap();
            assert_eq!(decode_blob(&frame), blob);
            // IB pads private data with zeros up to its maximum size.
            frame.resize(56, 0);
            assert_eq!(decode_blob(&frame), blob);
        }
        assert!(encode_blob(&[0; MAX_PRIVATE_DATA + 1]).is_err());
        assert_eq!(
            decode_blob(&[200, 1, 2]),
            Vec::<u8>::new(),
            "length beyond the frame"
        );
        assert_eq!(decode_blob(&[]), Vec::<u8>::new());
    }

    #[test]
    fn socket_addresses_read_back_as_written() {
        for addr in ["192.0.2.1:4791", "[2001:db8::2]:40000"] {
            let addr: SocketAddr = addr.parse().unwrap();
            assert_eq!(socket_addr(&sockaddr(addr).0), Some(addr));
        }
        // SAFETY: all-zero is a valid sockaddr_storage (family AF_UNSPEC).
        let unspecified: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        assert_eq!(socket_addr(&unspecified), None);
    }

    #[test]
    fn socket_addresses_keep_port_and_address_in_network_order() {
        let (storage, len) = sockaddr("192.0.2.1:4791".parse().unwrap());
        assert_eq!(len as usize, std::mem::size_of::<libc::sockaddr_in>());
        // SAFETY: written as a sockaddr_in above.
        let sin =
            unsafe { *(&storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
        assert_eq!(u16::from_be(sin.sin_port), 4791);
        assert_eq!(sin.sin_addr.s_addr.to_ne_bytes(), [192, 0, 2, 1]);
    }
}
