//! The C ABI of `libsandirect_verbs.so` (see `san_verbs_loader::abi`).
//!
//! Handles are `Box`es of this crate's types turned into opaque pointers; each is freed by
//! exactly one `*_close` (or accept/reject for requests). Every entry validates its
//! pointers, catches panics (a panic must never unwind into C), and returns a status code.

use std::ffi::{c_char, c_int, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use san_api::{
    Access, LocalKey, LocalSegment, MemRange, RecvSlot, RemoteDescriptor, RemoteKey, SanConnection,
    SanDomain, WrId,
};
use san_verbs_loader::abi::{
    self, status, AbiCapabilities, AbiCompletion, AbiConnectParams, AbiConnection, AbiDomain,
    AbiListener, AbiLocalSegment, AbiRange, AbiRegistration, AbiRemote, AbiRequest, AbiSlotConfig,
    AbiSockAddr, VerbsVtable,
};
use san_verbs_loader::{convert, ConnectParams, VerbsSetupError};

use crate::{IncomingRequest, VerbsConnection, VerbsDomain, VerbsListener, WaitOutcome};

static VTABLE: VerbsVtable = VerbsVtable {
    abi_version: abi::ABI_VERSION,
    struct_size: std::mem::size_of::<VerbsVtable>() as u32,
    domain_open,
    domain_close,
    domain_capabilities,
    domain_register,
    domain_deregister,
    domain_revoke_remote,
    domain_expose_remote,
    listener_bind,
    listener_fd,
    listener_port,
    listener_next_request,
    listener_close,
    request_accept,
    request_reject,
    connect,
    connection_close,
    connection_slot_config,
    connection_post_send,
    connection_post_recv,
    connection_recv_slot,
    connection_post_write,
    connection_post_read,
    connection_poll,
    connection_wait,
    connection_arm,
    connection_fd,
    domain_take_memory_changes,
    domain_is_watched,
    connection_arm_solicited,
    connection_take_event,
    request_peer,
    request_accept_started,
    connection_wait_established,
};

/// The library's only exported symbol: the vtable of ABI version 1.
#[unsafe(no_mangle)]
pub extern "C" fn sandirect_verbs_vtable_v1() -> *const VerbsVtable {
    &VTABLE
}

fn guard(body: impl FnOnce() -> i32) -> i32 {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(status::INTERNAL)
}

fn setup_status(result: Result<(), VerbsSetupError>) -> i32 {
    result.err().map_or(status::OK, VerbsSetupError::to_status)
}

/// Reborrows a handle, or `None` for null.
///
/// # Safety
/// `ptr` must be null or a handle of type `T` created by this module and not yet freed.
unsafe fn handle<'a, T, A>(ptr: *mut A) -> Option<&'a mut T> {
    // SAFETY: per the contract, a non-null `ptr` is a live `Box<T>` cast to `*mut A`.
    unsafe { ptr.cast::<T>().as_mut() }
}

/// Reads the caller's parameters into a Rust form borrowing their blob.
///
/// # Safety
/// `params` must be null or valid, and its blob pointer valid for `private_data_len` bytes.
unsafe fn read_params<'a>(params: *const AbiConnectParams) -> Option<ConnectParams<'a>> {
    // SAFETY: caller contract.
    let params = unsafe { params.as_ref() }?;
    if params.private_data_len > abi::MAX_PRIVATE_DATA {
        return None;
    }
    let blob = if params.private_data_len == 0 {
        &[][..]
    } else if params.private_data.is_null() {
        return None;
    } else {
        // SAFETY: caller contract: valid for `private_data_len` bytes during the call.
        unsafe { std::slice::from_raw_parts(params.private_data, params.private_data_len) }
    };
    Some(ConnectParams {
        slots: convert::slots_from_abi(params.slots),
        rdma_depth: params.rdma_depth,
        pre_post_receives: params.pre_post_receives != 0,
        private_data: blob,
        timeout: Duration::from_millis(u64::from(params.timeout_ms)),
        local: (params.local.family != 0)
            .then(|| params.local.to_std())
            .flatten(),
    })
}

/// Copies `blob` to the caller's buffer.
///
/// # Safety
/// `out` valid for `cap` bytes (or null with `cap` 0); `len` null or valid.
unsafe fn copy_blob(blob: &[u8], out: *mut u8, cap: usize, len: *mut usize) {
    let n = if out.is_null() {
        0
    } else {
        blob.len().min(cap)
    };
    if n > 0 {
        // SAFETY: caller contract; `n <= cap`.
        unsafe { std::ptr::copy_nonoverlapping(blob.as_ptr(), out, n) };
    }
    // SAFETY: caller contract.
    if let Some(len) = unsafe { len.as_mut() } {
        *len = n;
    }
}

unsafe extern "C" fn domain_open(
    local_ip: *const AbiSockAddr,
    device_name: *const c_char,
    out: *mut *mut AbiDomain,
) -> i32 {
    guard(|| {
        if out.is_null() {
            return status::INVALID_ARGUMENT;
        }
        // SAFETY: caller contract: null or a valid address.
        let ip = unsafe { local_ip.as_ref() }.map(AbiSockAddr::to_std);
        let opened = match ip {
            Some(Some(addr)) => VerbsDomain::open_for_address(addr.ip()),
            Some(None) => Err(VerbsSetupError::InvalidArgument),
            None if device_name.is_null() => VerbsDomain::open(None),
            None => {
                // SAFETY: caller contract: a NUL-terminated string.
                match unsafe { CStr::from_ptr(device_name) }.to_str() {
                    Ok(name) => VerbsDomain::open(Some(name)),
                    Err(_) => Err(VerbsSetupError::InvalidArgument),
                }
            }
        };
        match opened {
            Ok(domain) => {
                // SAFETY: `out` checked non-null above.
                unsafe { *out = Box::into_raw(Box::new(domain)).cast() };
                status::OK
            }
            Err(error) => error.to_status(),
        }
    })
}

unsafe extern "C" fn domain_close(domain: *mut AbiDomain) {
    if !domain.is_null() {
        // SAFETY: a live domain handle, freed once (caller contract).
        drop(unsafe { Box::from_raw(domain.cast::<VerbsDomain>()) });
    }
}

unsafe extern "C" fn domain_capabilities(
    domain: *const AbiDomain,
    out: *mut AbiCapabilities,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract (handle or null).
        let domain = unsafe { handle::<VerbsDomain, _>(domain.cast_mut()) };
        // SAFETY: caller contract (valid or null).
        match (domain, unsafe { out.as_mut() }) {
            (Some(domain), Some(out)) => {
                *out = convert::capabilities_to_abi(&domain.capabilities());
                status::OK
            }
            _ => status::INVALID_ARGUMENT,
        }
    })
}

unsafe extern "C" fn domain_register(
    domain: *mut AbiDomain,
    addr: u64,
    len: u64,
    access: u8,
    out: *mut AbiRegistration,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let (Some(domain), Some(out)) = (unsafe { handle::<VerbsDomain, _>(domain) }, unsafe {
            out.as_mut()
        }) else {
            return status::INVALID_ARGUMENT;
        };
        match domain.register(MemRange::new(addr, len), Access::from_bits_truncate(access)) {
            Ok(reg) => {
                *out = convert::registration_to_abi(&reg);
                status::OK
            }
            Err(error) => convert::register_error_to_status(error),
        }
    })
}

unsafe extern "C" fn domain_deregister(domain: *mut AbiDomain, lkey: u32) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(domain) = (unsafe { handle::<VerbsDomain, _>(domain) }) else {
            return status::INVALID_ARGUMENT;
        };
        domain
            .deregister(LocalKey(lkey))
            .err()
            .map_or(status::OK, convert::register_error_to_status)
    })
}

unsafe extern "C" fn domain_take_memory_changes(
    domain: *mut AbiDomain,
    out: *mut AbiRange,
    cap: usize,
    count: *mut usize,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(domain) = (unsafe { handle::<VerbsDomain, _>(domain) }) else {
            return status::INVALID_ARGUMENT;
        };
        if count.is_null() || (out.is_null() && cap > 0) {
            return status::INVALID_ARGUMENT;
        }
        if domain.memory_monitor().is_err() {
            // SAFETY: checked non-null; the caller provides a writable slot.
            unsafe { count.write(0) };
            return status::NO_MONITOR;
        }
        let changes = domain.take_memory_changes();
        let everything = [crate::MemoryChanges::EVERYTHING];
        let ranges = match changes.ranges() {
            ranges if ranges.len() <= cap => ranges,
            _ if cap > 0 => &everything[..],
            // Nowhere to report a change: the caller asked for nothing, but losing a
            // change would be wrong, so refuse.
            _ => return status::INVALID_ARGUMENT,
        };
        for (i, range) in ranges.iter().enumerate() {
            // SAFETY: `i < ranges.len() <= cap`, and `out` holds `cap` writable slots.
            unsafe {
                out.add(i).write(AbiRange {
                    addr: range.addr,
                    len: range.len,
                })
            };
        }
        // SAFETY: checked non-null; the caller provides a writable slot.
        unsafe { count.write(ranges.len()) };
        status::OK
    })
}

unsafe extern "C" fn domain_is_watched(domain: *const AbiDomain, lkey: u32) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(domain) = (unsafe { handle::<VerbsDomain, _>(domain.cast_mut()) }) else {
            return -1;
        };
        match domain.is_watched(LocalKey(lkey)) {
            Some(watched) => i32::from(watched),
            None => -1,
        }
    })
}

unsafe extern "C" fn domain_revoke_remote(domain: *mut AbiDomain, lkey: u32) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(domain) = (unsafe { handle::<VerbsDomain, _>(domain) }) else {
            return status::INVALID_ARGUMENT;
        };
        domain
            .revoke_remote(LocalKey(lkey))
            .err()
            .map_or(status::OK, convert::register_error_to_status)
    })
}

unsafe extern "C" fn domain_expose_remote(
    domain: *mut AbiDomain,
    lkey: u32,
    access: u8,
    rkey: *mut u32,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let (Some(domain), Some(rkey)) = (unsafe { handle::<VerbsDomain, _>(domain) }, unsafe {
            rkey.as_mut()
        }) else {
            return status::INVALID_ARGUMENT;
        };
        match domain.expose_remote(LocalKey(lkey), Access::from_bits_truncate(access)) {
            Ok(RemoteKey(key)) => {
                *rkey = key;
                status::OK
            }
            Err(error) => convert::register_error_to_status(error),
        }
    })
}

unsafe extern "C" fn listener_bind(
    domain: *mut AbiDomain,
    addr: *const AbiSockAddr,
    backlog: c_int,
    out: *mut *mut AbiListener,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let domain = unsafe { handle::<VerbsDomain, _>(domain) };
        // SAFETY: caller contract.
        let addr = unsafe { addr.as_ref() }.and_then(AbiSockAddr::to_std);
        let (Some(domain), Some(addr), false) = (domain, addr, out.is_null()) else {
            return status::INVALID_ARGUMENT;
        };
        match VerbsListener::bind(domain, addr, backlog) {
            Ok(listener) => {
                // SAFETY: `out` checked non-null.
                unsafe { *out = Box::into_raw(Box::new(listener)).cast() };
                status::OK
            }
            Err(error) => error.to_status(),
        }
    })
}

unsafe extern "C" fn listener_fd(listener: *const AbiListener) -> c_int {
    // SAFETY: caller contract.
    unsafe { handle::<VerbsListener, _>(listener.cast_mut()) }.map_or(-1, |l| l.fd())
}

unsafe extern "C" fn listener_port(listener: *const AbiListener) -> u16 {
    // SAFETY: caller contract.
    unsafe { handle::<VerbsListener, _>(listener.cast_mut()) }.map_or(0, |l| l.port())
}

unsafe extern "C" fn listener_next_request(
    listener: *mut AbiListener,
    timeout_ms: c_int,
    out: *mut *mut AbiRequest,
    blob: *mut u8,
    blob_cap: usize,
    blob_len: *mut usize,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(listener) = (unsafe { handle::<VerbsListener, _>(listener) }) else {
            return status::INVALID_ARGUMENT;
        };
        if out.is_null() {
            return status::INVALID_ARGUMENT;
        }
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        match listener.next_request(timeout) {
            Ok(request) => {
                // SAFETY: caller contract for the blob buffer; `out` checked non-null.
                unsafe {
                    copy_blob(request.blob(), blob, blob_cap, blob_len);
                    *out = Box::into_raw(Box::new(request)).cast();
                }
                status::OK
            }
            Err(error) => error.to_status(),
        }
    })
}

unsafe extern "C" fn listener_close(listener: *mut AbiListener) {
    if !listener.is_null() {
        // SAFETY: live listener handle, freed once.
        drop(unsafe { Box::from_raw(listener.cast::<VerbsListener>()) });
    }
}

unsafe extern "C" fn request_accept(
    request: *mut AbiRequest,
    domain: *mut AbiDomain,
    params: *const AbiConnectParams,
    out: *mut *mut AbiConnection,
) -> i32 {
    // SAFETY: caller contract, passed on.
    unsafe { accept_request(request, domain, params, out, IncomingRequest::accept) }
}

unsafe extern "C" fn request_accept_started(
    request: *mut AbiRequest,
    domain: *mut AbiDomain,
    params: *const AbiConnectParams,
    out: *mut *mut AbiConnection,
) -> i32 {
    // SAFETY: caller contract, passed on.
    unsafe {
        accept_request(
            request,
            domain,
            params,
            out,
            IncomingRequest::accept_started,
        )
    }
}

/// Accepts `request` (consumed whatever happens) with `how`.
///
/// # Safety
/// `request` null or a live request handle; `domain` null or a live domain handle; `params`
/// as for [`read_params`]; `out` null or valid for a write.
unsafe fn accept_request(
    request: *mut AbiRequest,
    domain: *mut AbiDomain,
    params: *const AbiConnectParams,
    out: *mut *mut AbiConnection,
    how: fn(
        IncomingRequest,
        &VerbsDomain,
        &ConnectParams<'_>,
    ) -> Result<VerbsConnection, VerbsSetupError>,
) -> i32 {
    guard(|| {
        if request.is_null() {
            return status::INVALID_ARGUMENT;
        }
        // SAFETY: a live request handle, consumed here whatever happens.
        let request = unsafe { Box::from_raw(request.cast::<IncomingRequest>()) };
        // SAFETY: caller contract.
        let domain = unsafe { handle::<VerbsDomain, _>(domain) };
        // SAFETY: caller contract.
        let params = unsafe { read_params(params) };
        let (Some(domain), Some(params), false) = (domain, params, out.is_null()) else {
            return status::INVALID_ARGUMENT;
        };
        match how(*request, domain, &params) {
            Ok(connection) => {
                // SAFETY: `out` checked non-null.
                unsafe { *out = Box::into_raw(Box::new(connection)).cast() };
                status::OK
            }
            Err(error) => error.to_status(),
        }
    })
}

unsafe extern "C" fn request_peer(request: *const AbiRequest, out: *mut AbiSockAddr) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(request) = (unsafe { handle::<IncomingRequest, _>(request.cast_mut()) }) else {
            return status::INVALID_ARGUMENT;
        };
        if out.is_null() {
            return status::INVALID_ARGUMENT;
        }
        match request.peer() {
            Some(peer) => {
                // SAFETY: `out` checked non-null; caller contract: valid for a write.
                unsafe { *out = AbiSockAddr::from_std(peer) };
                status::OK
            }
            None => status::NO_DEVICE,
        }
    })
}

unsafe extern "C" fn request_reject(request: *mut AbiRequest) {
    if !request.is_null() {
        // SAFETY: live request handle, consumed once; dropping it rejects.
        drop(unsafe { Box::from_raw(request.cast::<IncomingRequest>()) });
    }
}

unsafe extern "C" fn connect(
    domain: *mut AbiDomain,
    remote: *const AbiSockAddr,
    params: *const AbiConnectParams,
    reply: *mut u8,
    reply_cap: usize,
    reply_len: *mut usize,
    out: *mut *mut AbiConnection,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let domain = unsafe { handle::<VerbsDomain, _>(domain) };
        // SAFETY: caller contract.
        let remote = unsafe { remote.as_ref() }.and_then(AbiSockAddr::to_std);
        // SAFETY: caller contract.
        let params = unsafe { read_params(params) };
        let (Some(domain), Some(remote), Some(params), false) =
            (domain, remote, params, out.is_null())
        else {
            return status::INVALID_ARGUMENT;
        };
        match VerbsConnection::connect(domain, remote, &params) {
            Ok((connection, blob)) => {
                // SAFETY: caller contract for the reply buffer; `out` checked non-null.
                unsafe {
                    copy_blob(&blob, reply, reply_cap, reply_len);
                    *out = Box::into_raw(Box::new(connection)).cast();
                }
                status::OK
            }
            Err(error) => setup_status(Err(error)),
        }
    })
}

unsafe extern "C" fn connection_close(conn: *mut AbiConnection) {
    if !conn.is_null() {
        // SAFETY: live connection handle, freed once.
        drop(unsafe { Box::from_raw(conn.cast::<VerbsConnection>()) });
    }
}

unsafe extern "C" fn connection_slot_config(conn: *const AbiConnection) -> AbiSlotConfig {
    // SAFETY: caller contract.
    unsafe { handle::<VerbsConnection, _>(conn.cast_mut()) }.map_or(
        AbiSlotConfig {
            send_slots: 0,
            recv_slots: 0,
            slot_size: 0,
        },
        |c| convert::slots_to_abi(c.slot_config()),
    )
}

unsafe extern "C" fn connection_post_send(
    conn: *mut AbiConnection,
    wr_id: u64,
    msg: *const u8,
    len: usize,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(conn) = (unsafe { handle::<VerbsConnection, _>(conn) }) else {
            return status::INVALID_ARGUMENT;
        };
        let message = if len == 0 {
            &[][..]
        } else if msg.is_null() {
            return status::POST_INVALID_ARGUMENT;
        } else {
            // SAFETY: caller contract: `msg` valid for `len` bytes during the call.
            unsafe { std::slice::from_raw_parts(msg, len) }
        };
        conn.post_send(WrId(wr_id), message)
            .err()
            .map_or(status::OK, convert::post_error_to_status)
    })
}

unsafe extern "C" fn connection_post_recv(conn: *mut AbiConnection, wr_id: u64, slot: u16) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(conn) = (unsafe { handle::<VerbsConnection, _>(conn) }) else {
            return status::INVALID_ARGUMENT;
        };
        conn.post_recv(WrId(wr_id), RecvSlot(slot))
            .err()
            .map_or(status::OK, convert::post_error_to_status)
    })
}

unsafe extern "C" fn connection_recv_slot(
    conn: *const AbiConnection,
    slot: u16,
    len: u32,
    data: *mut *const u8,
    data_len: *mut usize,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let conn = unsafe { handle::<VerbsConnection, _>(conn.cast_mut()) };
        // SAFETY: caller contract.
        let (Some(conn), Some(data), Some(data_len)) =
            (conn, unsafe { data.as_mut() }, unsafe { data_len.as_mut() })
        else {
            return status::INVALID_ARGUMENT;
        };
        let bytes = conn.recv_slot(RecvSlot(slot), len);
        *data = bytes.as_ptr();
        *data_len = bytes.len();
        status::OK
    })
}

fn segments(local: &AbiLocalSegment, remote: &AbiRemote) -> (LocalSegment, RemoteDescriptor) {
    (
        LocalSegment {
            range: MemRange::new(local.addr, local.len),
            lkey: LocalKey(local.lkey),
        },
        RemoteDescriptor {
            addr: remote.addr,
            len: remote.len,
            rkey: RemoteKey(remote.rkey),
        },
    )
}

/// The shared body of the two RDMA posts: validate the handles, then call `post`.
///
/// # Safety
/// `conn`, `local` and `remote` as for the vtable entries (valid or null).
unsafe fn post_rdma(
    conn: *mut AbiConnection,
    wr_id: u64,
    local: *const AbiLocalSegment,
    remote: *const AbiRemote,
    post: fn(
        &mut VerbsConnection,
        WrId,
        san_api::LocalSegment,
        san_api::RemoteDescriptor,
    ) -> Result<(), san_api::PostError>,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let conn = unsafe { handle::<VerbsConnection, _>(conn) };
        // SAFETY: caller contract.
        let (Some(conn), Some(local), Some(remote)) =
            (conn, unsafe { local.as_ref() }, unsafe { remote.as_ref() })
        else {
            return status::INVALID_ARGUMENT;
        };
        let (local, remote) = segments(local, remote);
        post(conn, WrId(wr_id), local, remote)
            .err()
            .map_or(status::OK, convert::post_error_to_status)
    })
}

unsafe extern "C" fn connection_post_write(
    conn: *mut AbiConnection,
    wr_id: u64,
    local: *const AbiLocalSegment,
    remote: *const AbiRemote,
) -> i32 {
    // SAFETY: forwarded caller contract.
    unsafe {
        post_rdma(conn, wr_id, local, remote, |c, id, l, r| {
            c.post_write(id, l, r)
        })
    }
}

unsafe extern "C" fn connection_post_read(
    conn: *mut AbiConnection,
    wr_id: u64,
    local: *const AbiLocalSegment,
    remote: *const AbiRemote,
) -> i32 {
    // SAFETY: forwarded caller contract.
    unsafe {
        post_rdma(conn, wr_id, local, remote, |c, id, l, r| {
            c.post_read(id, l, r)
        })
    }
}

unsafe extern "C" fn connection_poll(
    conn: *mut AbiConnection,
    out: *mut AbiCompletion,
    max: usize,
) -> usize {
    let polled = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: caller contract.
        let Some(conn) = (unsafe { handle::<VerbsConnection, _>(conn) }) else {
            return 0;
        };
        if out.is_null() || max == 0 {
            return 0;
        }
        let mut index = 0;
        conn.poll_each(max, |completion| {
            // SAFETY: caller contract: `out` has room for `max` entries, and `poll_each`
            // hands over at most `max`, so index < max.
            unsafe {
                out.add(index)
                    .write(convert::completion_to_abi(&completion))
            };
            index += 1;
        })
    }));
    polled.unwrap_or(0)
}

unsafe extern "C" fn connection_wait(conn: *mut AbiConnection, timeout_ms: c_int) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(conn) = (unsafe { handle::<VerbsConnection, _>(conn) }) else {
            return status::INVALID_ARGUMENT;
        };
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        match conn.wait(timeout) {
            WaitOutcome::TimedOut => status::WOULD_BLOCK,
            _ => status::OK,
        }
    })
}

unsafe extern "C" fn connection_arm(conn: *mut AbiConnection) -> i32 {
    // SAFETY: caller contract (passed on).
    unsafe { arm_with(conn, VerbsConnection::arm) }
}

unsafe extern "C" fn connection_arm_solicited(conn: *mut AbiConnection) -> i32 {
    // SAFETY: caller contract (passed on).
    unsafe { arm_with(conn, VerbsConnection::arm_solicited) }
}

unsafe extern "C" fn connection_wait_established(
    conn: *mut AbiConnection,
    timeout_ms: c_int,
) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(conn) = (unsafe { handle::<VerbsConnection, _>(conn) }) else {
            return status::INVALID_ARGUMENT;
        };
        let timeout = Duration::from_millis(u64::try_from(timeout_ms).unwrap_or(0));
        setup_status(conn.wait_established(timeout))
    })
}

unsafe extern "C" fn connection_take_event(conn: *mut AbiConnection, timeout_ms: c_int) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(conn) = (unsafe { handle::<VerbsConnection, _>(conn) }) else {
            return status::INVALID_ARGUMENT;
        };
        let timeout = Duration::from_millis(u64::try_from(timeout_ms).unwrap_or(0));
        if conn.take_event(timeout) {
            status::OK
        } else {
            status::WOULD_BLOCK
        }
    })
}

/// The arming entries: `arm` on the connection, its answer as a status.
///
/// # Safety
/// `conn` must be null or a connection handle created by this module and not yet freed.
unsafe fn arm_with(conn: *mut AbiConnection, arm: fn(&mut VerbsConnection) -> bool) -> i32 {
    guard(|| {
        // SAFETY: caller contract.
        let Some(conn) = (unsafe { handle::<VerbsConnection, _>(conn) }) else {
            return status::INVALID_ARGUMENT;
        };
        if arm(conn) {
            status::OK
        } else {
            abi::ARM_PENDING
        }
    })
}

unsafe extern "C" fn connection_fd(conn: *const AbiConnection) -> c_int {
    // SAFETY: caller contract.
    unsafe { handle::<VerbsConnection, _>(conn.cast_mut()) }.map_or(-1, |c| c.fd())
}
