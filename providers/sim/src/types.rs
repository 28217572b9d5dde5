//! Public value types of the simulation: identifiers, configuration, errors, violations and
//! counters.

use std::fmt;

use san_api::{Access, LocalKey, MemRange, WrId};

/// A simulated process attached to the fabric (its own address space and protection domain).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EndpointId(pub(crate) u32);

impl EndpointId {
    /// Position in creation order (0 for the first endpoint of a fabric).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ep{}", self.0)
    }
}

/// One side of a simulated connection (one queue pair). The two sides of a connection are
/// `peer()` of each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub(crate) u32);

impl ConnId {
    /// The other side of the same connection.
    pub fn peer(self) -> ConnId {
        ConnId(self.0 ^ 1)
    }

    /// Position in creation order: sides `2k` and `2k + 1` form the `k`-th connection.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ConnId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "qp{}", self.0)
    }
}

/// Probabilities of the random faults (each in `0.0..=1.0`; values outside are clamped, NaN
/// counts as 0) and their magnitudes. Everything is off by default.
///
/// Faults that need the test's cooperation to stay meaningful (a crash, memory vanishing
/// under a registration) are only injected on demand, through the methods of
/// [`SimFabric`](crate::SimFabric).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultConfig {
    /// Chance that a sender-side completion (send, RDMA write, RDMA read) is reported after
    /// an extra long-tail delay of `1..=completion_delay_max_ticks`.
    pub completion_delay: f64,
    /// Upper bound of the long-tail completion delay, in ticks.
    pub completion_delay_max_ticks: u64,
    /// Chance that a work request leaves the per-queue completion order: its completion may
    /// overtake or be overtaken by the others of its queue, and an RDMA read's data is
    /// fetched late, after sends posted behind it have arrived (no fence).
    pub reorder: f64,
    /// Upper bound of the extra delay of a reordered work request, in ticks.
    pub reorder_max_ticks: u64,
    /// Chance that a posted receive becomes usable only after `1..=repost_delay_max_ticks`
    /// (provokes receiver-not-ready retries at the sender). Receives still become usable in
    /// posting order, so each is usable at most `repost_delay_max_ticks` after it was posted.
    pub delayed_repost: f64,
    /// Upper bound of a delayed re-post, in ticks. While it stays below the RNR budget
    /// (`rnr_retry_limit × rnr_retry_interval_ticks` of [`SimTiming`], 70 ticks by
    /// default) a sender that only sends against posted receives (a correct credit scheme)
    /// never exhausts its retries; above it, even a correct sender can see
    /// `ReceiverNotReady`.
    pub repost_delay_max_ticks: u64,
    /// Chance that a `register` fails with `OutOfResources`.
    pub registration_failure: f64,
    /// Chance, per execution attempt of a send/write/read, that the connection breaks right
    /// then (the request completes with `RetryExceeded`, everything else outstanding of both
    /// sides is flushed).
    pub qp_error: f64,
}

impl FaultConfig {
    /// No faults at all (the default).
    pub const NONE: FaultConfig = FaultConfig {
        completion_delay: 0.0,
        completion_delay_max_ticks: 1_000,
        reorder: 0.0,
        reorder_max_ticks: 50,
        delayed_repost: 0.0,
        repost_delay_max_ticks: 40,
        registration_failure: 0.0,
        qp_error: 0.0,
    };
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self::NONE
    }
}

/// Timing model of the fabric, in abstract ticks (think of one tick as a microsecond).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimTiming {
    /// Smallest delay between posting a work request and its execution at the peer.
    pub min_latency_ticks: u64,
    /// Largest such delay (uniformly distributed between the two).
    pub max_latency_ticks: u64,
    /// Transfer rate: a work request moving `n` bytes takes `n / bytes_per_tick` ticks more.
    pub bytes_per_tick: u64,
    /// Delay between receiver-not-ready retries of a send.
    pub rnr_retry_interval_ticks: u64,
    /// Retries after which a send fails with `ReceiverNotReady` (the connection breaks).
    pub rnr_retry_limit: u32,
    /// How long the survivors take to notice a crashed or vanished peer.
    pub peer_loss_detection_ticks: u64,
}

impl Default for SimTiming {
    fn default() -> Self {
        Self {
            min_latency_ticks: 1,
            max_latency_ticks: 8,
            bytes_per_tick: 16 * 1024,
            rnr_retry_interval_ticks: 10,
            rnr_retry_limit: 7,
            peer_loss_detection_ticks: 200,
        }
    }
}

/// Errors of the fabric's own (test-facing) methods. Provider-contract errors use the
/// `san-api` types instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SimError {
    /// The endpoint does not belong to this fabric.
    UnknownEndpoint(EndpointId),
    /// The endpoint crashed; its memory and keys are gone.
    EndpointCrashed(EndpointId),
    /// Part of the range is not mapped; `addr` is the first unmapped byte.
    Unmapped {
        /// First unmapped address.
        addr: u64,
    },
    /// `map_at`/`unmap` need a page-aligned address.
    Misaligned {
        /// The address given.
        addr: u64,
    },
    /// `map_at` found a page already mapped at `addr`.
    AlreadyMapped {
        /// First mapped address in the way.
        addr: u64,
    },
    /// Zero or overflowing length.
    InvalidLength,
    /// `write` got a byte slice whose length differs from the range.
    LengthMismatch {
        /// The range's length.
        range_len: u64,
        /// The slice's length.
        bytes_len: u64,
    },
    /// The key names no live registration of the endpoint.
    UnknownKey(LocalKey),
    /// The slot configuration exceeds the endpoint's capabilities, or has no slots.
    InvalidSlotConfig,
    /// The connection does not belong to this fabric.
    UnknownConnection(ConnId),
}

impl fmt::Display for SimError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SimError::UnknownEndpoint(ep) => write!(f, "unknown endpoint {ep}"),
            SimError::EndpointCrashed(ep) => write!(f, "endpoint {ep} crashed"),
            SimError::Unmapped { addr } => write!(f, "address {addr:#x} is not mapped"),
            SimError::Misaligned { addr } => write!(f, "address {addr:#x} is not page-aligned"),
            SimError::AlreadyMapped { addr } => write!(f, "address {addr:#x} is already mapped"),
            SimError::InvalidLength => f.write_str("zero or overflowing length"),
            SimError::LengthMismatch {
                range_len,
                bytes_len,
            } => write!(
                f,
                "range of {range_len} bytes written with {bytes_len} bytes"
            ),
            SimError::UnknownKey(lkey) => write!(f, "no live registration with lkey {}", lkey.0),
            SimError::InvalidSlotConfig => {
                f.write_str("slot configuration empty or beyond the endpoint's capabilities")
            }
            SimError::UnknownConnection(conn) => write!(f, "unknown connection {conn}"),
        }
    }
}

impl std::error::Error for SimError {}

/// A broken rule of the provider contract by the *user* of the fabric (the switch): an
/// operation that used memory through a registration it must no longer use. A correct
/// switch produces none, under every fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Violation {
    /// Virtual time at which the operation executed.
    pub tick: u64,
    /// The endpoint whose registration was misused.
    pub endpoint: EndpointId,
    /// The connection the work request was posted on, if any.
    pub conn: Option<ConnId>,
    /// The offending work request, if any.
    pub wr_id: Option<WrId>,
    /// What was wrong.
    pub kind: ViolationKind,
}

/// What a [`Violation`] consisted of. Local misuse completed the work request with
/// `LocalProtection`, remote access to vanished memory with `RemoteAccess`; either broke the
/// connection, as on a real device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ViolationKind {
    /// The lkey was deregistered (invalidated or evicted by the cache) before the work
    /// request executed.
    DeregisteredLocalKey {
        /// The dead key.
        lkey: LocalKey,
    },
    /// The lkey was never issued by this endpoint's domain.
    UnknownLocalKey {
        /// The unknown key.
        lkey: LocalKey,
    },
    /// The segment leaves the registration.
    OutsideRegistration {
        /// The registration's key.
        lkey: LocalKey,
        /// What the registration covers.
        registered: MemRange,
        /// What the work request named.
        used: MemRange,
    },
    /// The registration lacks a right the operation needs (e.g. `LOCAL_WRITE` for the sink
    /// of an RDMA read).
    MissingLocalRights {
        /// The registration's key.
        lkey: LocalKey,
        /// Rights the registration has.
        granted: Access,
        /// Rights the operation needs.
        needed: Access,
    },
    /// The registration is still live but (part of) its memory was unmapped since it was
    /// registered — the cache should have been told to invalidate it.
    RegisteredMemoryUnmapped {
        /// The stale registration's key.
        lkey: LocalKey,
        /// What the registration covers.
        registered: MemRange,
    },
    /// `expose_remote` re-exposed a registration whose memory was unmapped.
    ExposedUnmappedMemory {
        /// The stale registration's key.
        lkey: LocalKey,
    },
    /// A peer's RDMA access reached a registration that is still live although its memory
    /// was unmapped: the endpoint's cache was not told of the unmap, or did not deregister.
    /// (The access failed with `RemoteAccess`.) Charged to the endpoint owning the
    /// registration; `wr_id` is the peer's request.
    RemoteAccessToUnmappedMemory {
        /// The stale registration's key.
        lkey: LocalKey,
        /// What the registration covers.
        registered: MemRange,
    },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t={} {}", self.tick, self.endpoint)?;
        if let Some(conn) = self.conn {
            write!(f, " {conn}")?;
        }
        if let Some(wr_id) = self.wr_id {
            write!(f, " wr {}", wr_id.0)?;
        }
        f.write_str(": ")?;
        match self.kind {
            ViolationKind::DeregisteredLocalKey { lkey } => {
                write!(f, "used lkey {} after it was deregistered", lkey.0)
            }
            ViolationKind::UnknownLocalKey { lkey } => {
                write!(f, "used lkey {} that was never registered", lkey.0)
            }
            ViolationKind::OutsideRegistration {
                lkey,
                registered,
                used,
            } => write!(
                f,
                "segment {:#x}+{} outside registration {} ({:#x}+{})",
                used.addr, used.len, lkey.0, registered.addr, registered.len
            ),
            ViolationKind::MissingLocalRights {
                lkey,
                granted,
                needed,
            } => write!(
                f,
                "registration {} has rights {:#b}, operation needs {:#b}",
                lkey.0,
                granted.bits(),
                needed.bits()
            ),
            ViolationKind::RegisteredMemoryUnmapped { lkey, registered } => write!(
                f,
                "used registration {} ({:#x}+{}) whose memory was unmapped (not invalidated)",
                lkey.0, registered.addr, registered.len
            ),
            ViolationKind::ExposedUnmappedMemory { lkey } => write!(
                f,
                "re-exposed registration {} whose memory was unmapped",
                lkey.0
            ),
            ViolationKind::RemoteAccessToUnmappedMemory { lkey, registered } => write!(
                f,
                "peer accessed registration {} ({:#x}+{}) whose memory was unmapped (not invalidated)",
                lkey.0, registered.addr, registered.len
            ),
        }
    }
}

/// Per-endpoint counters. Bytes and messages are counted where the work request was posted
/// (the initiator) unless the name says otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EndpointCounters {
    /// Registrations alive now.
    pub registrations_live: u64,
    /// Successful `register` calls.
    pub registrations: u64,
    /// `register` calls that failed (any reason, injected failures included).
    pub registration_failures: u64,
    /// Successful `deregister` calls.
    pub deregistrations: u64,
    /// Successful `revoke_remote` calls that revoked a key.
    pub revocations: u64,
    /// Successful `expose_remote` calls.
    pub exposures: u64,
    /// Sends delivered to the peer.
    pub messages_sent: u64,
    /// Bytes of those sends.
    pub bytes_sent: u64,
    /// Messages received into this endpoint's slots.
    pub messages_received: u64,
    /// Bytes of those messages.
    pub bytes_received: u64,
    /// RDMA writes executed.
    pub rdma_writes: u64,
    /// Bytes moved by them.
    pub bytes_rdma_written: u64,
    /// RDMA reads executed.
    pub rdma_reads: u64,
    /// Bytes moved by them.
    pub bytes_rdma_read: u64,
    /// RDMA operations of this endpoint rejected by the peer (`RemoteAccess`).
    pub remote_access_failures: u64,
    /// The subset of those that presented an rkey that had been valid once (revoked or
    /// deregistered): the expected result of a revocation.
    pub stale_rkey_accesses: u64,
    /// The subset of those that hit memory unmapped under a still-live registration (each
    /// is also a violation of the target; see
    /// [`SimFabric::invalidate_remote`](crate::SimFabric::invalidate_remote)).
    pub vanished_memory_accesses: u64,
    /// Incoming RDMA operations this endpoint rejected.
    pub accesses_rejected: u64,
    /// Receiver-not-ready retries suffered by this endpoint's sends.
    pub rnr_retries: u64,
    /// Sends that failed after exhausting their receiver-not-ready retries.
    pub rnr_failures: u64,
    /// Times one of this endpoint's connections entered the error state.
    pub qp_errors: u64,
    /// Completions handed out by `poll_completions`.
    pub completions: u64,
    /// Violations recorded against this endpoint.
    pub violations: u64,
}
