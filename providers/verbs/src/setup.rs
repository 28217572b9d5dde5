//! Connection set-up through the provider contract ([`SanConnector`]): a thin layer over
//! [`VerbsConnection::connect`], [`VerbsListener::bind`], [`VerbsListener::next_request`] and
//! [`IncomingRequest::accept`]. Failures convert into [`san_api::SetupError`] (see the
//! `From` impl in `san-verbs-loader` for the mapping and its reasons).

use std::net::SocketAddr;
use std::time::Duration;

use san_api::{ConnectProgress, Established, SanConnectRequest, SanConnector, SlotConfig};
use san_verbs_loader::abi::MAX_PRIVATE_DATA;
use san_verbs_loader::ConnectorConfig;

use crate::connection::VerbsConnection;
use crate::domain::VerbsDomain;
use crate::listener::{IncomingRequest, VerbsListener};
use crate::VerbsSetupError;

/// [`SanConnector`] on a [`VerbsDomain`]'s device. rdma_cm set-up blocks: `connect` and
/// `accept` return once the connection is established (or failed) within
/// [`ConnectorConfig::timeout`], so a pending connect is established at its first poll.
/// `poll_request` never blocks.
pub struct VerbsConnector<'d> {
    domain: &'d VerbsDomain,
    config: ConnectorConfig,
}

/// An active connect of a [`VerbsConnector`] (already established: see there).
pub struct VerbsConnecting(Established<VerbsConnection>);

impl<'d> VerbsConnector<'d> {
    /// A connector setting connections up on `domain`'s device.
    pub fn new(domain: &'d VerbsDomain, config: ConnectorConfig) -> Self {
        Self { domain, config }
    }

    /// The settings in force.
    pub fn config(&self) -> ConnectorConfig {
        self.config
    }
}

impl SanConnectRequest for IncomingRequest {
    fn private_data(&self) -> &[u8] {
        self.blob()
    }
}

impl SanConnector for VerbsConnector<'_> {
    type Address = SocketAddr;
    type Connection = VerbsConnection;
    type Connecting = VerbsConnecting;
    type Listener = VerbsListener;
    type Request = IncomingRequest;

    fn max_private_data(&self) -> usize {
        MAX_PRIVATE_DATA
    }

    fn connect(
        &mut self,
        remote: &SocketAddr,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<VerbsConnecting, san_api::SetupError> {
        let params = self.config.params(slots, private_data);
        let (connection, peer_private_data) =
            VerbsConnection::connect(self.domain, *remote, &params)?;
        Ok(VerbsConnecting(Established {
            connection,
            peer_private_data,
        }))
    }

    fn poll_connect(
        &mut self,
        pending: VerbsConnecting,
    ) -> Result<ConnectProgress<VerbsConnecting, VerbsConnection>, san_api::SetupError> {
        Ok(ConnectProgress::Established(pending.0))
    }

    fn listen(&mut self, local: &SocketAddr) -> Result<VerbsListener, san_api::SetupError> {
        Ok(VerbsListener::bind(
            self.domain,
            *local,
            self.config.backlog,
        )?)
    }

    fn poll_request(
        &mut self,
        listener: &mut VerbsListener,
    ) -> Result<Option<IncomingRequest>, san_api::SetupError> {
        match listener.next_request(Some(Duration::ZERO)) {
            Ok(request) => Ok(Some(request)),
            Err(VerbsSetupError::TimedOut) => Ok(None),
            Err(other) => Err(other.into()),
        }
    }

    fn accept(
        &mut self,
        request: IncomingRequest,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<VerbsConnection, san_api::SetupError> {
        let params = self.config.params(slots, private_data);
        Ok(request.accept(self.domain, &params)?)
    }

    fn reject(&mut self, request: IncomingRequest) {
        request.reject();
    }
}
