//! The passive side: a listening rdma_cm id and the requests it receives.

use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::rdma_cm_event_type;

use crate::cm::{self, CmId, EventChannel};
use crate::connection::VerbsConnection;
use crate::domain::VerbsDomain;
use crate::sys::errno;
use crate::{ConnectParams, VerbsSetupError};

/// A listening endpoint on one address (which must be served by the domain's device).
pub struct VerbsListener {
    // Drop order: the id before the channel it reports on (the id also holds an Arc).
    id: CmId,
    channel: Arc<EventChannel>,
}

/// A connection request received by a [`VerbsListener`], not yet accepted. Dropping it
/// rejects it.
pub struct IncomingRequest {
    id: Option<CmId>,
    blob: Vec<u8>,
    /// The address the request came from.
    peer: Option<SocketAddr>,
    peer_responder_resources: u8,
    peer_initiator_depth: u8,
}

impl VerbsListener {
    /// Binds to `addr` (port 0: a free port) and listens.
    ///
    /// # Errors
    /// `NoDevice` when the address is not served by `domain`'s device (a wildcard address
    /// is refused for the same reason: the domain is per device); `Os` for bind/listen
    /// failures such as `EADDRINUSE`.
    pub fn bind(
        domain: &VerbsDomain,
        addr: SocketAddr,
        backlog: i32,
    ) -> Result<Self, VerbsSetupError> {
        if addr.ip().is_unspecified() {
            return Err(VerbsSetupError::NoDevice);
        }
        let channel = EventChannel::new()?;
        let id = CmId::new(&channel)?;
        let (mut storage, _) = cm::sockaddr(addr);
        // SAFETY: live id; valid sockaddr.
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
        if id.context() != Some(domain.shared.pd.device.context) {
            return Err(VerbsSetupError::NoDevice);
        }
        // SAFETY: live, bound id.
        if unsafe { rdma_sys::rdma_listen(id.as_ptr(), backlog.max(1)) } != 0 {
            return Err(VerbsSetupError::Os(errno()));
        }
        Ok(Self { id, channel })
    }

    /// The bound port.
    pub fn port(&self) -> u16 {
        cm::bound_port(&self.id)
    }

    /// A pollable fd, readable when a request (or another listener event) is queued.
    pub fn fd(&self) -> RawFd {
        self.channel.fd()
    }

    /// Waits up to `timeout` (`None`: forever) for the next connection request.
    ///
    /// # Errors
    /// `TimedOut` when none arrived in time.
    pub fn next_request(
        &mut self,
        timeout: Option<Duration>,
    ) -> Result<IncomingRequest, VerbsSetupError> {
        let deadline = timeout.map(cm::deadline_after);
        loop {
            let event = self.channel.next_until(deadline)?;
            if event.kind == rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
                let id = CmId::adopt(event.id, &self.channel)?;
                return Ok(IncomingRequest {
                    peer: cm::peer_address(&id),
                    id: Some(id),
                    blob: event.blob,
                    peer_responder_resources: event.responder_resources,
                    peer_initiator_depth: event.initiator_depth,
                });
            }
            // Other events on the listener's channel concern requests we already handed
            // out and that failed before being migrated; they need no action here.
        }
    }
}

impl IncomingRequest {
    /// The connecting side's setup blob.
    pub fn blob(&self) -> &[u8] {
        &self.blob
    }

    /// The address the request came from (`rdma_get_peer_addr`), when rdma_cm names one.
    pub fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// Accepts: sets up the QP and pools on `domain`, replies with `params.private_data`,
    /// and waits for the connection to be established.
    ///
    /// # Errors
    /// `WrongDevice` when the request arrived on another device than the domain's (the
    /// request is then rejected); `Declined` when the connection could not be set up here
    /// (its channel, QP or slot pools: e.g. memory `RLIMIT_MEMLOCK` does not let us pin),
    /// before any reply went out, so the peer sees a rejection; `TimedOut`/`ConnectFailed`
    /// or another error once our reply may be out.
    pub fn accept(
        self,
        domain: &VerbsDomain,
        params: &ConnectParams<'_>,
    ) -> Result<VerbsConnection, VerbsSetupError> {
        let deadline = cm::deadline_after(params.timeout);
        let mut connection = self.accept_started(domain, params)?;
        connection.establish_until(deadline)?;
        Ok(connection)
    }

    /// As [`IncomingRequest::accept`], but returns once the reply went out, without waiting
    /// for the peer to complete the handshake: the connection is established later, by
    /// [`VerbsConnection::wait_established`]. A caller that holds several requests (not
    /// knowing yet which one it will keep) is never blocked by a peer that does not finish.
    ///
    /// # Errors
    /// As [`IncomingRequest::accept`], except the errors of establishment.
    pub fn accept_started(
        mut self,
        domain: &VerbsDomain,
        params: &ConnectParams<'_>,
    ) -> Result<VerbsConnection, VerbsSetupError> {
        let frame = cm::encode_blob(params.private_data)?;
        // Give the connection its own channel so its events (established, disconnected)
        // never mix with the listener's. Until `rdma_accept` no reply has gone out: a
        // failure here rejects the request (dropping an id with an unanswered request
        // rejects it) and says so, so that the peer's TCP connection can stay as it is.
        let Some(mut id) = self.id.take() else {
            return Err(VerbsSetupError::Internal);
        };
        let declined = |_| VerbsSetupError::Declined;
        let channel = EventChannel::new().map_err(declined)?;
        id.migrate(&channel).map_err(declined)?;
        id.set_ack_timeout();
        let connection = VerbsConnection::build(domain, id, channel, params).map_err(declined)?;
        let device = &domain.shared.pd.device;
        // Never promise more read depth than the peer can use, nor than we have.
        let responder = device
            .max_responder_resources
            .min(self.peer_initiator_depth);
        let initiator = device
            .max_initiator_depth
            .min(self.peer_responder_resources);
        let mut param = cm::conn_param(&frame, responder, initiator);
        // SAFETY: live id with a QP; `param` points at `frame`, which outlives the call.
        if unsafe { rdma_sys::rdma_accept(connection.id().as_ptr(), &mut param) } != 0 {
            return Err(VerbsSetupError::Os(errno()));
        }
        Ok(connection)
    }

    /// Rejects the request (also what dropping it does).
    pub fn reject(self) {}
}

impl Drop for IncomingRequest {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            // SAFETY: live id of an unanswered connect request; no private data.
            unsafe { rdma_sys::rdma_reject(id.as_ptr(), std::ptr::null(), 0) };
        }
    }
}
