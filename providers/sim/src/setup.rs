//! Connection set-up through the provider contract ([`SanConnector`]): listeners, requests
//! and their answers, on top of [`SimFabric::connect`].
//!
//! Set-up is instantaneous in virtual time and fully deterministic: requests queue at their
//! listener in arrival order, and an answer is visible to the active side at its next
//! [`poll_connect`](SanConnector::poll_connect). The outcomes model what a real transport
//! reports:
//!
//! | situation                                              | active side gets          |
//! |--------------------------------------------------------|---------------------------|
//! | nothing listens at (endpoint, port)                    | [`SetupError::Refused`]   |
//! | the endpoint is unknown or crashed                     | [`SetupError::Unreachable`] |
//! | the listener rejects, or drops the request unanswered  | [`SetupError::Rejected`]  |
//! | the listener closes with the request still queued      | [`SetupError::Refused`]   |
//! | the listening endpoint crashes before answering        | [`SetupError::Unreachable`] |
//! | blob over [`MAX_PRIVATE_DATA`], slots beyond caps      | [`SetupError::Other`]     |
//!
//! An accept whose active side gave up (dropped its pending connect) or crashed fails with
//! [`SetupError::Reset`].

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use san_api::{
    ConnectProgress, Established, SanConnectRequest, SanConnector, SetupError, SlotConfig,
};

use crate::{ConnId, EndpointId, SimConnection, SimError, SimFabric};

/// The largest setup blob the simulation carries: rdma_cm's limit (55 bytes), the smallest
/// of the real providers, so a switch whose blob outgrows it fails in simulation first.
pub const MAX_PRIVATE_DATA: usize = 55;

/// Where a simulated listener listens: an endpoint and a port of its choosing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SimAddress {
    /// The listening endpoint.
    pub endpoint: EndpointId,
    /// Any number; one listener per (endpoint, port).
    pub port: u16,
}

impl fmt::Display for SimAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.endpoint, self.port)
    }
}

/// Identifies a connection request (fabric-unique, never reused).
type RequestId = u64;

#[derive(Debug)]
enum Answer {
    /// Queued at the listener or handed to it, not answered yet.
    Waiting,
    /// Accepted: the active side's queue pair, and the passive side's blob.
    Accepted {
        conn: ConnId,
        blob: Vec<u8>,
    },
    Failed(SetupError),
}

#[derive(Debug)]
struct Request {
    from: EndpointId,
    to: SimAddress,
    slots: SlotConfig,
    blob: Vec<u8>,
    answer: Answer,
}

/// The fabric's set-up state; lives inside the fabric's `RefCell` with everything else.
#[derive(Debug, Default)]
pub(crate) struct SetupTable {
    /// Requests not yet handed to the listener, per listening address.
    listeners: BTreeMap<SimAddress, VecDeque<RequestId>>,
    /// Every request whose active side still holds its pending handle.
    requests: BTreeMap<RequestId, Request>,
    next_request: RequestId,
}

/// The set-up service of one endpoint ([`SanConnector`]), from [`SimFabric::connector`].
#[derive(Clone, Debug)]
pub struct SimConnector {
    fabric: SimFabric,
    endpoint: EndpointId,
}

/// An active connect waiting for its answer. Dropping it abandons the connect: an accept
/// that comes later fails with `Reset`, and a connection accepted but never collected is
/// closed.
#[derive(Debug)]
pub struct SimConnecting {
    fabric: SimFabric,
    id: RequestId,
}

/// A listening address. Dropping it refuses the requests still queued.
#[derive(Debug)]
pub struct SimListener {
    fabric: SimFabric,
    address: SimAddress,
}

/// A request handed to a listener. Dropping it unanswered rejects it.
#[derive(Debug)]
pub struct SimRequest {
    fabric: SimFabric,
    id: RequestId,
    from: EndpointId,
    private_data: Vec<u8>,
    answered: bool,
}

impl SimFabric {
    /// The set-up service of endpoint `ep`: connects from it, listens on it.
    pub fn connector(&self, ep: EndpointId) -> SimConnector {
        SimConnector {
            fabric: self.clone(),
            endpoint: ep,
        }
    }
}

impl SimConnector {
    /// The endpoint this connector sets connections up for.
    pub fn endpoint(&self) -> EndpointId {
        self.endpoint
    }
}

impl SimListener {
    /// The address listened on.
    pub fn address(&self) -> SimAddress {
        self.address
    }
}

impl SimRequest {
    /// The endpoint that asked to connect.
    pub fn peer(&self) -> EndpointId {
        self.from
    }
}

impl SanConnectRequest for SimRequest {
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }
}

fn slots_fit(fabric: &SimFabric, ep: EndpointId, slots: SlotConfig) -> bool {
    let caps = fabric.capabilities(ep);
    slots.send_slots > 0
        && slots.recv_slots > 0
        && slots.send_slots <= caps.max_slots
        && slots.recv_slots <= caps.max_slots
        && slots.slot_size <= caps.max_slot_size
}

impl SanConnector for SimConnector {
    type Address = SimAddress;
    type Connection = SimConnection;
    type Connecting = SimConnecting;
    type Listener = SimListener;
    type Request = SimRequest;

    fn max_private_data(&self) -> usize {
        MAX_PRIVATE_DATA
    }

    fn connect(
        &mut self,
        remote: &SimAddress,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<SimConnecting, SetupError> {
        let valid = private_data.len() <= MAX_PRIVATE_DATA
            && self.fabric.is_alive(self.endpoint)
            && slots_fit(&self.fabric, self.endpoint, slots);
        if !valid {
            return Err(SetupError::Other);
        }
        if !self.fabric.is_alive(remote.endpoint) {
            return Err(SetupError::Unreachable);
        }
        let mut fabric = self.fabric.state_mut();
        let table = &mut fabric.setup;
        let Some(queue) = table.listeners.get_mut(remote) else {
            return Err(SetupError::Refused);
        };
        let id = table.next_request;
        table.next_request += 1;
        queue.push_back(id);
        table.requests.insert(
            id,
            Request {
                from: self.endpoint,
                to: *remote,
                slots,
                blob: private_data.to_vec(),
                answer: Answer::Waiting,
            },
        );
        drop(fabric);
        Ok(SimConnecting {
            fabric: self.fabric.clone(),
            id,
        })
    }

    fn poll_connect(
        &mut self,
        pending: SimConnecting,
    ) -> Result<ConnectProgress<SimConnecting, SimConnection>, SetupError> {
        let mut fabric = pending.fabric.state_mut();
        let target_alive = fabric.is_alive(
            fabric
                .setup
                .requests
                .get(&pending.id)
                .map_or(self.endpoint, |request| request.to.endpoint),
        );
        let Some(request) = fabric.setup.requests.get_mut(&pending.id) else {
            return Err(SetupError::Other);
        };
        match std::mem::replace(&mut request.answer, Answer::Waiting) {
            Answer::Waiting if target_alive => {
                drop(fabric);
                Ok(ConnectProgress::Pending(pending))
            }
            Answer::Waiting => Err(SetupError::Unreachable),
            Answer::Failed(error) => Err(error),
            Answer::Accepted { conn, blob } => {
                // Collected: the pending handle's drop must not close the connection.
                fabric.setup.requests.remove(&pending.id);
                drop(fabric);
                Ok(ConnectProgress::Established(Established {
                    connection: pending.fabric.connection(conn),
                    peer_private_data: blob,
                }))
            }
        }
    }

    fn listen(&mut self, local: &SimAddress) -> Result<SimListener, SetupError> {
        if local.endpoint != self.endpoint || !self.fabric.is_alive(self.endpoint) {
            return Err(SetupError::Other);
        }
        let mut fabric = self.fabric.state_mut();
        if fabric.setup.listeners.contains_key(local) {
            return Err(SetupError::Other);
        }
        fabric.setup.listeners.insert(*local, VecDeque::new());
        drop(fabric);
        Ok(SimListener {
            fabric: self.fabric.clone(),
            address: *local,
        })
    }

    fn poll_request(
        &mut self,
        listener: &mut SimListener,
    ) -> Result<Option<SimRequest>, SetupError> {
        let mut fabric = listener.fabric.state_mut();
        let table = &mut fabric.setup;
        let Some(queue) = table.listeners.get_mut(&listener.address) else {
            return Err(SetupError::Other);
        };
        // Requests whose active side gave up meanwhile are skipped.
        while let Some(id) = queue.pop_front() {
            if let Some(request) = table.requests.get(&id) {
                let handed = SimRequest {
                    fabric: listener.fabric.clone(),
                    id,
                    from: request.from,
                    private_data: request.blob.clone(),
                    answered: false,
                };
                return Ok(Some(handed));
            }
        }
        Ok(None)
    }

    fn accept(
        &mut self,
        mut request: SimRequest,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<SimConnection, SetupError> {
        if private_data.len() > MAX_PRIVATE_DATA || !slots_fit(&self.fabric, self.endpoint, slots) {
            // The request stays unanswered: dropping it now rejects it.
            return Err(SetupError::Other);
        }
        request.answered = true;
        let fabric = &request.fabric;
        let (from, to, active_slots) = {
            let state = fabric.state();
            let Some(pending) = state.setup.requests.get(&request.id) else {
                // The active side dropped its pending connect.
                return Err(SetupError::Reset);
            };
            (pending.from, pending.to, pending.slots)
        };
        let connected = fabric
            .state_mut()
            .connect(from, to.endpoint, active_slots, slots);
        let (active, passive) = match connected {
            Ok(pair) => pair,
            Err(error) => {
                let cause = match error {
                    SimError::EndpointCrashed(ep) if ep == from => SetupError::Reset,
                    _ => SetupError::Other,
                };
                fabric.answer(request.id, Answer::Failed(cause));
                return Err(cause);
            }
        };
        fabric.answer(
            request.id,
            Answer::Accepted {
                conn: active,
                blob: private_data.to_vec(),
            },
        );
        Ok(fabric.connection(passive))
    }

    fn reject(&mut self, request: SimRequest) {
        // Dropping an unanswered request rejects it.
        drop(request);
    }
}

impl SimFabric {
    /// Records the answer to request `id`, if its active side still waits for one.
    fn answer(&self, id: RequestId, answer: Answer) {
        if let Ok(mut fabric) = self.shared.try_borrow_mut() {
            if let Some(request) = fabric.setup.requests.get_mut(&id) {
                request.answer = answer;
            }
        }
    }
}

impl Drop for SimRequest {
    fn drop(&mut self) {
        if !self.answered {
            self.fabric
                .answer(self.id, Answer::Failed(SetupError::Rejected));
        }
    }
}

impl Drop for SimListener {
    fn drop(&mut self) {
        // `try_borrow_mut`: never panic in drop (see `SimConnection`'s drop).
        let Ok(mut fabric) = self.fabric.shared.try_borrow_mut() else {
            return;
        };
        let table = &mut fabric.setup;
        for id in table.listeners.remove(&self.address).unwrap_or_default() {
            if let Some(request) = table.requests.get_mut(&id) {
                request.answer = Answer::Failed(SetupError::Refused);
            }
        }
    }
}

impl Drop for SimConnecting {
    fn drop(&mut self) {
        let Ok(mut fabric) = self.fabric.shared.try_borrow_mut() else {
            return;
        };
        if let Some(request) = fabric.setup.requests.remove(&self.id) {
            if let Answer::Accepted { conn, .. } = request.answer {
                fabric.close(conn);
            }
        }
    }
}
