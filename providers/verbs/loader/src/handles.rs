//! Safe owners of the library's opaque handles, implementing the provider traits.
//!
//! Each wrapper owns exactly one handle and hands it back to the library once (on drop, or
//! when consumed by accept/reject). The library is never unloaded, so the vtable outlives
//! every handle.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use san_api::{
    Access, Capabilities, Completion, LocalKey, LocalSegment, MemRange, PostError, RecvSlot,
    RegisterError, Registration, RemoteDescriptor, RemoteKey, SanConnection, SanDomain, SlotConfig,
    WrId,
};

use crate::abi::{
    self, AbiCapabilities, AbiCompletion, AbiConnection, AbiDomain, AbiListener, AbiLocalSegment,
    AbiRange, AbiRegistration, AbiRemote, AbiRequest, AbiSockAddr,
};
use crate::{convert, ConnectParams, Library, VerbsSetupError};

/// Completions fetched per call across the boundary.
const POLL_BATCH: usize = 32;

/// A protection domain of the loaded provider ([`SanDomain`]).
pub struct LoadedDomain {
    library: Arc<Library>,
    raw: *mut AbiDomain,
    capabilities: Capabilities,
}

// SAFETY: the library's domain is a `Send` Rust object (`san_verbs::VerbsDomain`) behind an
// opaque pointer; the wrapper gives `&mut` access only, so it is never used concurrently.
unsafe impl Send for LoadedDomain {}

impl LoadedDomain {
    pub(crate) fn new(library: Arc<Library>, raw: *mut AbiDomain) -> Result<Self, VerbsSetupError> {
        if raw.is_null() {
            return Err(VerbsSetupError::Internal);
        }
        let mut caps = AbiCapabilities::default();
        // SAFETY: `raw` is a live domain handle from this library; `caps` is a valid out slot.
        let status = unsafe { (library.vtable.domain_capabilities)(raw, &mut caps) };
        let domain = Self {
            library,
            raw,
            capabilities: convert::capabilities_from_abi(&caps),
        };
        VerbsSetupError::check(status)?;
        Ok(domain)
    }

    /// Collects the mapping changes under this domain's registrations since the last call;
    /// pass each to `MrCache::invalidate` before the next `MrCache::get`. A single range
    /// covering the whole address space means "more changed than was queued".
    ///
    /// # Errors
    /// [`VerbsSetupError::Internal`] if the memory-change monitor is not running (then nothing
    /// may be cached past its transfer) or the library failed.
    pub fn take_memory_changes(&mut self) -> Result<Vec<MemRange>, VerbsSetupError> {
        const BATCH: usize = 64;
        let mut ranges = [AbiRange::default(); BATCH];
        let mut count = 0usize;
        // SAFETY: live domain handle; `ranges` holds `BATCH` writable slots, `count` is a
        // valid out slot.
        let status = unsafe {
            (self.library.vtable.domain_take_memory_changes)(
                self.raw,
                ranges.as_mut_ptr(),
                BATCH,
                &mut count,
            )
        };
        if status != crate::abi::status::OK {
            return Err(VerbsSetupError::Internal);
        }
        Ok(ranges[..count.min(BATCH)]
            .iter()
            .map(|r| MemRange::new(r.addr, r.len))
            .collect())
    }

    /// Whether changes to the mapping under the registration `lkey` are reported (`None`
    /// for an unknown key).
    pub fn is_watched(&self, lkey: LocalKey) -> Option<bool> {
        // SAFETY: live domain handle.
        match unsafe { (self.library.vtable.domain_is_watched)(self.raw, lkey.0) } {
            1 => Some(true),
            0 => Some(false),
            _ => None,
        }
    }

    /// Binds a listener on `addr` (port 0: any free port).
    ///
    /// # Errors
    /// [`VerbsSetupError::NoDevice`] when the address is not served by this domain's device;
    /// [`VerbsSetupError::Os`] for a failed bind/listen (e.g. `EADDRINUSE`).
    pub fn listen(
        &mut self,
        addr: SocketAddr,
        backlog: i32,
    ) -> Result<LoadedListener, VerbsSetupError> {
        let abi_addr = AbiSockAddr::from_std(addr);
        let mut raw: *mut AbiListener = std::ptr::null_mut();
        // SAFETY: live domain handle; `abi_addr` and `raw` are valid for the call.
        let status =
            unsafe { (self.library.vtable.listener_bind)(self.raw, &abi_addr, backlog, &mut raw) };
        VerbsSetupError::check(status)?;
        if raw.is_null() {
            return Err(VerbsSetupError::Internal);
        }
        Ok(LoadedListener {
            library: self.library.clone(),
            raw,
        })
    }

    /// Connects to a listener at `remote`; returns the connection and the peer's reply blob.
    ///
    /// # Errors
    /// See [`VerbsSetupError`]: `Rejected` when no sandirect listener is there, `TimedOut`,
    /// `Unreachable`, `WrongDevice`.
    pub fn connect(
        &mut self,
        remote: SocketAddr,
        params: &ConnectParams<'_>,
    ) -> Result<(LoadedConnection, Vec<u8>), VerbsSetupError> {
        let abi_remote = AbiSockAddr::from_std(remote);
        let abi_params = params.to_abi();
        let mut reply = [0u8; abi::MAX_PRIVATE_DATA];
        let mut reply_len = 0usize;
        let mut raw: *mut AbiConnection = std::ptr::null_mut();
        // SAFETY: live domain handle; every pointer is valid for the call; `abi_params`
        // borrows `params.private_data`, which outlives the call.
        let status = unsafe {
            (self.library.vtable.connect)(
                self.raw,
                &abi_remote,
                &abi_params,
                reply.as_mut_ptr(),
                reply.len(),
                &mut reply_len,
                &mut raw,
            )
        };
        VerbsSetupError::check(status)?;
        let connection = LoadedConnection::new(self.library.clone(), raw)?;
        Ok((connection, reply[..reply_len.min(reply.len())].to_vec()))
    }
}

impl Drop for LoadedDomain {
    fn drop(&mut self) {
        // SAFETY: live domain handle, given back exactly once.
        unsafe { (self.library.vtable.domain_close)(self.raw) }
    }
}

impl SanDomain for LoadedDomain {
    fn capabilities(&self) -> Capabilities {
        self.capabilities
    }

    fn register(&mut self, range: MemRange, access: Access) -> Result<Registration, RegisterError> {
        let mut out = AbiRegistration::default();
        // SAFETY: live domain handle; `out` is a valid out slot. The library validates the
        // range itself (the kernel pins it or fails; it never dereferences it in user space).
        let status = unsafe {
            (self.library.vtable.domain_register)(
                self.raw,
                range.addr,
                range.len,
                access.bits(),
                &mut out,
            )
        };
        convert::register_status(status)?;
        Ok(convert::registration_from_abi(&out))
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        // SAFETY: live domain handle.
        convert::register_status(unsafe {
            (self.library.vtable.domain_deregister)(self.raw, lkey.0)
        })
    }

    fn revoke_remote(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        // SAFETY: live domain handle.
        convert::register_status(unsafe {
            (self.library.vtable.domain_revoke_remote)(self.raw, lkey.0)
        })
    }

    fn expose_remote(
        &mut self,
        lkey: LocalKey,
        access: Access,
    ) -> Result<RemoteKey, RegisterError> {
        let mut rkey = 0u32;
        // SAFETY: live domain handle; `rkey` is a valid out slot.
        let status = unsafe {
            (self.library.vtable.domain_expose_remote)(self.raw, lkey.0, access.bits(), &mut rkey)
        };
        convert::register_status(status)?;
        Ok(RemoteKey(rkey))
    }
}

/// A listening rdma_cm endpoint of the loaded provider.
pub struct LoadedListener {
    library: Arc<Library>,
    raw: *mut AbiListener,
}

// SAFETY: as for `LoadedDomain`: an owned, `Send` Rust object behind the pointer, `&mut` only.
unsafe impl Send for LoadedListener {}

impl LoadedListener {
    /// A pollable fd, readable when a connection request may be waiting.
    pub fn fd(&self) -> RawFd {
        // SAFETY: live listener handle.
        unsafe { (self.library.vtable.listener_fd)(self.raw) }
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        // SAFETY: live listener handle.
        unsafe { (self.library.vtable.listener_port)(self.raw) }
    }

    /// Waits up to `timeout` (`None`: forever) for a connection request and returns it
    /// with the peer's setup blob.
    ///
    /// # Errors
    /// [`VerbsSetupError::TimedOut`] when none arrived in time.
    pub fn next_request(
        &mut self,
        timeout: Option<Duration>,
    ) -> Result<(LoadedRequest, Vec<u8>), VerbsSetupError> {
        let mut blob = [0u8; abi::MAX_PRIVATE_DATA];
        let mut blob_len = 0usize;
        let mut raw: *mut AbiRequest = std::ptr::null_mut();
        // SAFETY: live listener handle; all out pointers valid for the call.
        let status = unsafe {
            (self.library.vtable.listener_next_request)(
                self.raw,
                timeout_ms(timeout),
                &mut raw,
                blob.as_mut_ptr(),
                blob.len(),
                &mut blob_len,
            )
        };
        VerbsSetupError::check(status)?;
        if raw.is_null() {
            return Err(VerbsSetupError::Internal);
        }
        Ok((
            LoadedRequest {
                library: self.library.clone(),
                raw,
            },
            blob[..blob_len.min(blob.len())].to_vec(),
        ))
    }
}

impl Drop for LoadedListener {
    fn drop(&mut self) {
        // SAFETY: live listener handle, given back exactly once.
        unsafe { (self.library.vtable.listener_close)(self.raw) }
    }
}

/// A connection request not yet accepted. Dropping it rejects it.
pub struct LoadedRequest {
    library: Arc<Library>,
    raw: *mut AbiRequest,
}

// SAFETY: as for `LoadedDomain`.
unsafe impl Send for LoadedRequest {}

impl LoadedRequest {
    /// The address the request came from (`rdma_get_peer_addr`), when rdma_cm names one.
    pub fn peer(&self) -> Option<SocketAddr> {
        let mut out = AbiSockAddr::from_std(SocketAddr::from(([0, 0, 0, 0], 0)));
        // SAFETY: live request handle; `out` is a valid out slot.
        let status = unsafe { (self.library.vtable.request_peer)(self.raw, &mut out) };
        (status == abi::status::OK).then(|| out.to_std()).flatten()
    }

    /// Accepts, setting up the slot pools of `params` on `domain`'s device.
    ///
    /// # Errors
    /// [`VerbsSetupError::WrongDevice`] if the request arrived on another device than the
    /// domain's; [`VerbsSetupError::ConnectFailed`]/[`VerbsSetupError::TimedOut`] if establishment
    /// did not complete.
    pub fn accept(
        self,
        domain: &mut LoadedDomain,
        params: &ConnectParams<'_>,
    ) -> Result<LoadedConnection, VerbsSetupError> {
        let entry = self.library.vtable.request_accept;
        self.accept_with(domain, params, entry)
    }

    /// As [`Self::accept`], but returns once our reply went out: the peer completes the
    /// handshake later ([`LoadedConnection::wait_established`]).
    ///
    /// # Errors
    /// As [`Self::accept`], except the errors of establishment.
    pub fn accept_started(
        self,
        domain: &mut LoadedDomain,
        params: &ConnectParams<'_>,
    ) -> Result<LoadedConnection, VerbsSetupError> {
        let entry = self.library.vtable.request_accept_started;
        self.accept_with(domain, params, entry)
    }

    fn accept_with(
        mut self,
        domain: &mut LoadedDomain,
        params: &ConnectParams<'_>,
        entry: unsafe extern "C" fn(
            *mut AbiRequest,
            *mut AbiDomain,
            *const abi::AbiConnectParams,
            *mut *mut AbiConnection,
        ) -> i32,
    ) -> Result<LoadedConnection, VerbsSetupError> {
        let abi_params = params.to_abi();
        let mut raw: *mut AbiConnection = std::ptr::null_mut();
        // The call consumes the request whatever happens: forget it so Drop does not
        // reject it a second time.
        let request = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        // SAFETY: live request and domain handles; all pointers valid for the call.
        let status = unsafe { entry(request, domain.raw, &abi_params, &mut raw) };
        VerbsSetupError::check(status)?;
        LoadedConnection::new(self.library.clone(), raw)
    }
}

impl Drop for LoadedRequest {
    fn drop(&mut self) {
        if !self.raw.is_null() {
            // SAFETY: live request handle (not consumed by `accept`), given back once.
            unsafe { (self.library.vtable.request_reject)(self.raw) }
        }
    }
}

/// A connection of the loaded provider ([`SanConnection`]).
pub struct LoadedConnection {
    library: Arc<Library>,
    raw: *mut AbiConnection,
    slots: SlotConfig,
    batch: Vec<AbiCompletion>,
}

// SAFETY: as for `LoadedDomain`.
unsafe impl Send for LoadedConnection {}

impl LoadedConnection {
    fn new(library: Arc<Library>, raw: *mut AbiConnection) -> Result<Self, VerbsSetupError> {
        if raw.is_null() {
            return Err(VerbsSetupError::Internal);
        }
        // SAFETY: live connection handle.
        let slots =
            convert::slots_from_abi(unsafe { (library.vtable.connection_slot_config)(raw) });
        Ok(Self {
            library,
            raw,
            slots,
            batch: vec![AbiCompletion::default(); POLL_BATCH],
        })
    }

    /// Waits up to `timeout` for a connection accepted with [`LoadedRequest::accept_started`]
    /// to be established (at once for any other).
    ///
    /// # Errors
    /// [`VerbsSetupError::TimedOut`]; the error of a failed handshake (the connection is
    /// then down).
    pub fn wait_established(&mut self, timeout: Duration) -> Result<(), VerbsSetupError> {
        // SAFETY: live connection handle.
        let status = unsafe {
            (self.library.vtable.connection_wait_established)(self.raw, timeout_ms(Some(timeout)))
        };
        VerbsSetupError::check(status)
    }

    /// Waits until a completion or a connection event is ready, or `timeout` passed
    /// (`None`: forever). Spins a bounded time, then blocks in the kernel.
    /// Returns `true` when something is ready.
    pub fn wait(&mut self, timeout: Option<Duration>) -> bool {
        // SAFETY: live connection handle.
        let status =
            unsafe { (self.library.vtable.connection_wait)(self.raw, timeout_ms(timeout)) };
        status == abi::status::OK
    }

    /// Arms the completion channel; `false` means completions are already pending (poll
    /// instead of blocking on [`Self::fd`]).
    pub fn arm(&mut self) -> bool {
        // SAFETY: live connection handle.
        unsafe { (self.library.vtable.connection_arm)(self.raw) == abi::status::OK }
    }

    /// As [`Self::arm`], for events on the peer's messages only (see the provider's
    /// `arm_solicited`).
    pub fn arm_solicited(&mut self) -> bool {
        // SAFETY: live connection handle.
        unsafe { (self.library.vtable.connection_arm_solicited)(self.raw) == abi::status::OK }
    }

    /// Consumes the channel event an armed notification raised (or is raising), waiting up
    /// to `timeout` for it; the CQ is disarmed then. False: none came.
    pub fn take_event(&mut self, timeout: Duration) -> bool {
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: live connection handle.
        unsafe { (self.library.vtable.connection_take_event)(self.raw, ms) == abi::status::OK }
    }

    /// A pollable fd for event loops (see [`Self::arm`]).
    pub fn fd(&self) -> RawFd {
        // SAFETY: live connection handle.
        unsafe { (self.library.vtable.connection_fd)(self.raw) }
    }
}

impl Drop for LoadedConnection {
    fn drop(&mut self) {
        // SAFETY: live connection handle, given back exactly once.
        unsafe { (self.library.vtable.connection_close)(self.raw) }
    }
}

impl SanConnection for LoadedConnection {
    fn slot_config(&self) -> SlotConfig {
        self.slots
    }

    fn post_send(&mut self, wr_id: WrId, message: &[u8]) -> Result<(), PostError> {
        // SAFETY: live connection handle; `message` is valid for reads of its length during
        // the call (the library copies it into a slot before returning).
        convert::post_status(unsafe {
            (self.library.vtable.connection_post_send)(
                self.raw,
                wr_id.0,
                message.as_ptr(),
                message.len(),
            )
        })
    }

    fn post_recv(&mut self, wr_id: WrId, slot: RecvSlot) -> Result<(), PostError> {
        // SAFETY: live connection handle.
        convert::post_status(unsafe {
            (self.library.vtable.connection_post_recv)(self.raw, wr_id.0, slot.0)
        })
    }

    fn recv_slot(&self, slot: RecvSlot, len: u32) -> &[u8] {
        let mut data: *const u8 = std::ptr::null();
        let mut data_len = 0usize;
        // SAFETY: live connection handle; out pointers valid for the call.
        let status = unsafe {
            (self.library.vtable.connection_recv_slot)(
                self.raw,
                slot.0,
                len,
                &mut data,
                &mut data_len,
            )
        };
        if status != abi::status::OK || data.is_null() || data_len == 0 {
            return &[];
        }
        // SAFETY: the library points `data` at `data_len` bytes of the slot's buffer, owned
        // by the connection and left untouched until the slot is posted again, which needs
        // `&mut self`; the returned slice borrows `self`, so it cannot outlive that.
        unsafe { std::slice::from_raw_parts(data, data_len) }
    }

    fn post_write(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        let (local, remote) = segments_to_abi(local, remote);
        // SAFETY: live connection handle; both descriptors valid for the call. The library
        // checks `local` against its registration table before posting.
        convert::post_status(unsafe {
            (self.library.vtable.connection_post_write)(self.raw, wr_id.0, &local, &remote)
        })
    }

    fn post_read(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        let (local, remote) = segments_to_abi(local, remote);
        // SAFETY: as for `post_write`.
        convert::post_status(unsafe {
            (self.library.vtable.connection_post_read)(self.raw, wr_id.0, &local, &remote)
        })
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let mut total = 0;
        while total < max {
            let want = (max - total).min(self.batch.len());
            // SAFETY: live connection handle; `batch` has room for `want` entries.
            let got = unsafe {
                (self.library.vtable.connection_poll)(self.raw, self.batch.as_mut_ptr(), want)
            };
            let got = got.min(want);
            out.extend(self.batch[..got].iter().map(convert::completion_from_abi));
            total += got;
            if got < want {
                break;
            }
        }
        total
    }
}

fn segments_to_abi(local: LocalSegment, remote: RemoteDescriptor) -> (AbiLocalSegment, AbiRemote) {
    (
        AbiLocalSegment {
            addr: local.range.addr,
            len: local.range.len,
            lkey: local.lkey.0,
        },
        AbiRemote {
            addr: remote.addr,
            len: remote.len,
            rkey: remote.rkey.0,
        },
    )
}

fn timeout_ms(timeout: Option<Duration>) -> i32 {
    timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX))
}
