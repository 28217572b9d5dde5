//! Connection set-up through the provider contract ([`SanConnector`]).
//!
//! The shared-memory rendezvous is the segment file itself, named (in the preload) after the
//! TCP 4-tuple, so the *address* is the segment name inside the connector's directory:
//!
//! * **connect** = create the segment ([`ShmSegment::create`]) with the setup blob written
//!   into it; the pending connect then waits for the attacher's answer in the segment.
//! * **listen** on a name = wait for that segment to appear; **poll_request** attaches to it
//!   ([`ShmSegment::attach_with`]) and reads the creator's blob.
//! * **accept** writes the reply blob and the answer into the segment and starts the
//!   connection ([`ShmConnection::new`]); **reject** writes a refusal.
//!
//! A segment carries one slot configuration for both sides, chosen by the creator: `accept`
//! with other slot pools than the request's ([`ShmRequest::slot_config`]) fails with
//! [`SetupError::Other`] and rejects the request.
//!
//! Failures: a name held by a live creator, a bad name or configuration, and a blob over
//! [`MAX_SETUP_DATA`] are `Other`; running out of files or memory is `NoResources`; an
//! attacher that dies before answering is `Reset`; no answer within
//! [`ShmConnectorConfig::setup_timeout`] is `TimedOut`. Nothing here is `Refused` or
//! `Unreachable`: the peer is on this host, and a missing one is simply never attached.

use std::time::{Duration, Instant};

use san_api::{
    ConnectProgress, Established, SanConnectRequest, SanConnector, SetupError, SlotConfig,
};

use crate::connection::{ConnectionConfig, ShmConnection};
use crate::dir::ShmDir;
use crate::domain::ShmDomain;
use crate::error::ShmError;
use crate::layout::MAX_SETUP_DATA;
use crate::segment::{AccessPolicy, SegmentConfig, SetupAnswer, ShmSegment};
use crate::sys;

/// How a [`ShmConnector`] sets connections up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ShmConnectorConfig {
    /// Segment sizes beyond the slot pools (window, ring) and who may attach; the slot pools
    /// come from each `connect`.
    pub segment: SegmentConfig,
    /// Tunables of the connections set up.
    pub connection: ConnectionConfig,
    /// How long a pending connect waits for the attacher's answer.
    pub setup_timeout: Duration,
}

impl Default for ShmConnectorConfig {
    /// [`SegmentConfig::new`]'s window and ring, default connection tunables, 5 s to answer.
    fn default() -> Self {
        let placeholder = SlotConfig {
            send_slots: 1,
            recv_slots: 1,
            slot_size: 1,
        };
        Self {
            segment: SegmentConfig::new(placeholder),
            connection: ConnectionConfig::default(),
            setup_timeout: Duration::from_secs(5),
        }
    }
}

/// [`SanConnector`] for segments in one private directory, on one domain. Addresses are
/// segment names.
#[derive(Debug)]
pub struct ShmConnector {
    dir: ShmDir,
    domain: ShmDomain,
    config: ShmConnectorConfig,
}

/// A created segment waiting for the attacher's answer. Dropping it removes the segment.
#[derive(Debug)]
pub struct ShmConnecting {
    segment: ShmSegment,
    deadline: Instant,
}

/// A segment name listened on. Each name carries one connection: after one request the
/// listener has nothing more to give.
#[derive(Debug)]
pub struct ShmListener {
    name: String,
    consumed: bool,
}

/// An attached segment whose request is not answered yet. Dropping it rejects it.
#[derive(Debug)]
pub struct ShmRequest {
    segment: Option<ShmSegment>,
    private_data: Vec<u8>,
}

impl ShmConnector {
    /// A connector for segments in `dir` whose connections register memory through `domain`.
    pub fn new(dir: &ShmDir, domain: &ShmDomain, config: ShmConnectorConfig) -> Self {
        Self {
            dir: dir.clone(),
            domain: domain.handle(),
            config,
        }
    }

    /// The settings in force.
    pub fn config(&self) -> ShmConnectorConfig {
        self.config
    }

    fn policy(&self) -> AccessPolicy {
        self.config.segment.access
    }
}

impl ShmListener {
    /// The segment name listened on.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl ShmRequest {
    /// The slot pools the creator chose for both sides: what `accept` must ask for.
    pub fn slot_config(&self) -> Option<SlotConfig> {
        self.segment.as_ref().map(ShmSegment::slot_config)
    }

    /// The creator's pid.
    pub fn peer_pid(&self) -> Option<u32> {
        self.segment.as_ref().and_then(ShmSegment::peer_pid)
    }
}

impl SanConnectRequest for ShmRequest {
    fn private_data(&self) -> &[u8] {
        &self.private_data
    }
}

impl Drop for ShmRequest {
    fn drop(&mut self) {
        if let Some(segment) = self.segment.take() {
            // Best effort: a segment that cannot take the answer is broken for the creator
            // anyway, which then times out.
            let _ = segment.answer_setup(false, &[]);
        }
    }
}

/// The contract's view of a segment error.
fn setup_error(error: ShmError) -> SetupError {
    match error {
        ShmError::Io {
            errno:
                libc::ENOMEM | libc::ENOSPC | libc::EMFILE | libc::ENFILE | libc::EDQUOT | libc::EFBIG,
            ..
        } => SetupError::NoResources,
        _ => SetupError::Other,
    }
}

impl SanConnector for ShmConnector {
    type Address = str;
    type Connection = ShmConnection;
    type Connecting = ShmConnecting;
    type Listener = ShmListener;
    type Request = ShmRequest;

    fn max_private_data(&self) -> usize {
        MAX_SETUP_DATA
    }

    fn connect(
        &mut self,
        remote: &str,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<ShmConnecting, SetupError> {
        let config = SegmentConfig {
            slots,
            ..self.config.segment
        };
        let segment = ShmSegment::create_with_setup(&self.dir, remote, &config, private_data)
            .map_err(setup_error)?;
        let now = Instant::now();
        Ok(ShmConnecting {
            segment,
            deadline: now
                .checked_add(self.config.setup_timeout)
                .unwrap_or(now + Duration::from_secs(86_400)),
        })
    }

    fn poll_connect(
        &mut self,
        pending: ShmConnecting,
    ) -> Result<ConnectProgress<ShmConnecting, ShmConnection>, SetupError> {
        match pending.segment.setup_answer().map_err(setup_error)? {
            Some(SetupAnswer::Accepted(reply)) => {
                let connection =
                    ShmConnection::new(pending.segment, &self.domain, self.config.connection)
                        .map_err(setup_error)?;
                Ok(ConnectProgress::Established(Established {
                    connection,
                    peer_private_data: reply,
                }))
            }
            Some(SetupAnswer::Rejected) => Err(SetupError::Rejected),
            None => {
                let attacher_died = pending
                    .segment
                    .peer_pid()
                    .is_some_and(|pid| !sys::process_exists(pid));
                if attacher_died {
                    Err(SetupError::Reset)
                } else if Instant::now() >= pending.deadline {
                    Err(SetupError::TimedOut)
                } else {
                    Ok(ConnectProgress::Pending(pending))
                }
            }
        }
    }

    fn listen(&mut self, local: &str) -> Result<ShmListener, SetupError> {
        Ok(ShmListener {
            name: local.to_owned(),
            consumed: false,
        })
    }

    fn poll_request(
        &mut self,
        listener: &mut ShmListener,
    ) -> Result<Option<ShmRequest>, SetupError> {
        if listener.consumed {
            return Ok(None);
        }
        let segment = match ShmSegment::attach_with(&self.dir, &listener.name, &self.policy()) {
            Ok(segment) => segment,
            // Not created yet: keep listening.
            Err(ShmError::NotFound) => return Ok(None),
            Err(other) => return Err(setup_error(other)),
        };
        listener.consumed = true;
        let private_data = segment.setup_request().map_err(setup_error)?;
        Ok(Some(ShmRequest {
            segment: Some(segment),
            private_data,
        }))
    }

    fn accept(
        &mut self,
        mut request: ShmRequest,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<ShmConnection, SetupError> {
        let fits = request.slot_config() == Some(slots) && private_data.len() <= MAX_SETUP_DATA;
        if !fits {
            return Err(SetupError::Other);
        }
        let Some(segment) = request.segment.take() else {
            return Err(SetupError::Other);
        };
        segment
            .answer_setup(true, private_data)
            .map_err(setup_error)?;
        ShmConnection::new(segment, &self.domain, self.config.connection).map_err(setup_error)
    }

    fn reject(&mut self, request: ShmRequest) {
        // Dropping an unanswered request rejects it.
        drop(request);
    }
}
