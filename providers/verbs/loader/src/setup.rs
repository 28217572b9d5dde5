//! Connection set-up through the provider contract ([`SanConnector`]) for the loaded
//! provider: a thin layer over [`LoadedDomain::connect`], [`LoadedDomain::listen`],
//! [`LoadedListener::next_request`] and [`LoadedRequest::accept`].

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use san_api::{ConnectProgress, Established, SanConnectRequest, SanConnector, SlotConfig};

use crate::handles::{LoadedConnection, LoadedDomain, LoadedListener, LoadedRequest};
use crate::{abi, ConnectParams};

/// How a connector sets connections up: everything but the slot pools and the setup blob,
/// which each call gives. Shared with `san-verbs`' connector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectorConfig {
    /// RDMA reads and writes that may be in flight at once (beyond the send slots).
    pub rdma_depth: u16,
    /// Post every receive slot before the connection is established (see [`ConnectParams`]).
    pub pre_post_receives: bool,
    /// Bound on resolution and establishment; `connect` and `accept` block at most this long.
    pub timeout: Duration,
    /// Local address the active side binds before connecting (`None`: the route decides).
    pub local: Option<IpAddr>,
    /// Listen backlog.
    pub backlog: i32,
}

impl Default for ConnectorConfig {
    /// The defaults of [`ConnectParams::new`], no local bind, a backlog of 64.
    fn default() -> Self {
        let params = ConnectParams::new(SlotConfig {
            send_slots: 1,
            recv_slots: 1,
            slot_size: 1,
        });
        Self {
            rdma_depth: params.rdma_depth,
            pre_post_receives: params.pre_post_receives,
            timeout: params.timeout,
            local: None,
            backlog: 64,
        }
    }
}

impl ConnectorConfig {
    /// The parameters of one set-up call.
    pub fn params<'a>(&self, slots: SlotConfig, private_data: &'a [u8]) -> ConnectParams<'a> {
        ConnectParams {
            slots,
            rdma_depth: self.rdma_depth,
            pre_post_receives: self.pre_post_receives,
            private_data,
            timeout: self.timeout,
            local: self.local.map(|ip| SocketAddr::new(ip, 0)),
        }
    }
}

/// [`SanConnector`] over a [`LoadedDomain`]. rdma_cm set-up blocks: `connect` and `accept`
/// return once the connection is established (or failed) within
/// [`ConnectorConfig::timeout`], and a pending connect is established at its first poll.
/// `poll_request` never blocks.
pub struct LoadedConnector<'d> {
    domain: &'d mut LoadedDomain,
    config: ConnectorConfig,
}

/// An active connect of a [`LoadedConnector`] (already established: see there).
pub struct LoadedConnecting(Established<LoadedConnection>);

/// A request received by a [`LoadedConnector`]'s listener, with the peer's setup blob.
/// Dropping it rejects it.
pub struct LoadedIncoming {
    request: LoadedRequest,
    private_data: Vec<u8>,
}

impl<'d> LoadedConnector<'d> {
    /// A connector setting connections up on `domain`'s device.
    pub fn new(domain: &'d mut LoadedDomain, config: ConnectorConfig) -> Self {
        Self { domain, config }
    }

    /// The settings in force.
    pub fn config(&self) -> ConnectorConfig {
        self.config
    }
}

impl SanConnectRequest for LoadedIncoming {
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }
}

impl SanConnector for LoadedConnector<'_> {
    type Address = SocketAddr;
    type Connection = LoadedConnection;
    type Connecting = LoadedConnecting;
    type Listener = LoadedListener;
    type Request = LoadedIncoming;

    fn max_private_data(&self) -> usize {
        abi::MAX_PRIVATE_DATA
    }

    fn connect(
        &mut self,
        remote: &SocketAddr,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<LoadedConnecting, san_api::SetupError> {
        let (connection, peer_private_data) = self
            .domain
            .connect(*remote, &self.config.params(slots, private_data))?;
        Ok(LoadedConnecting(Established {
            connection,
            peer_private_data,
        }))
    }

    fn poll_connect(
        &mut self,
        pending: LoadedConnecting,
    ) -> Result<ConnectProgress<LoadedConnecting, LoadedConnection>, san_api::SetupError> {
        Ok(ConnectProgress::Established(pending.0))
    }

    fn listen(&mut self, local: &SocketAddr) -> Result<LoadedListener, san_api::SetupError> {
        Ok(self.domain.listen(*local, self.config.backlog)?)
    }

    fn poll_request(
        &mut self,
        listener: &mut LoadedListener,
    ) -> Result<Option<LoadedIncoming>, san_api::SetupError> {
        match listener.next_request(Some(Duration::ZERO)) {
            Ok((request, private_data)) => Ok(Some(LoadedIncoming {
                request,
                private_data,
            })),
            Err(crate::VerbsSetupError::TimedOut) => Ok(None),
            Err(other) => Err(other.into()),
        }
    }

    fn accept(
        &mut self,
        request: LoadedIncoming,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<LoadedConnection, san_api::SetupError> {
        Ok(request
            .request
            .accept(self.domain, &self.config.params(slots, private_data))?)
    }

    fn reject(&mut self, request: LoadedIncoming) {
        // Dropping an unanswered request rejects it (see `LoadedRequest`).
        drop(request);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_fills_every_parameter_but_slots_and_blob() {
        let slots = SlotConfig {
            send_slots: 3,
            recv_slots: 5,
            slot_size: 64,
        };
        let config = ConnectorConfig {
            rdma_depth: 7,
            pre_post_receives: false,
            timeout: Duration::from_millis(1500),
            local: Some("192.0.2.2".parse().unwrap()),
            backlog: 4,
        };
        let params = config.params(slots, b"hi");
        assert_eq!(params.slots, slots);
        assert_eq!(params.private_data, b"hi");
        assert_eq!((params.rdma_depth, params.pre_post_receives), (7, false));
        assert_eq!(params.timeout, Duration::from_millis(1500));
        assert_eq!(params.local, Some("192.0.2.2:0".parse().unwrap()));
        let defaults = ConnectorConfig::default();
        let reference = ConnectParams::new(slots);
        assert_eq!(defaults.timeout, reference.timeout);
        assert_eq!(defaults.rdma_depth, reference.rdma_depth);
        assert_eq!(defaults.local, None);
    }
}
