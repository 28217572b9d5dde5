//! # san-sim: a seeded in-memory SAN fabric with fault injection
//!
//! A deterministic, single-threaded simulation of a system-area network that implements the
//! provider contract of `san-api` ([`SanDomain`], [`SanConnection`]). The switch's tests and
//! benchmarks run over it: thousands of seeds per CI run, on two cores, with no sleeping and
//! no threads — time is virtual, in *ticks*, and advances only when [`SimFabric::step`] runs
//! the next scheduled event.
//!
//! ```
//! use san_api::{Access, LocalSegment, RecvSlot, SanConnection, SanDomain, SlotConfig, WrId};
//! use san_sim::{FaultConfig, SimFabric};
//!
//! let fabric = SimFabric::new(7, FaultConfig::default());
//! let (a, b) = (fabric.add_endpoint(), fabric.add_endpoint());
//! let slots = SlotConfig { send_slots: 4, recv_slots: 4, slot_size: 256 };
//! let (mut conn_a, mut conn_b) = fabric.connect(a, b, slots, slots).unwrap();
//!
//! conn_b.post_recv(WrId(1), RecvSlot(0)).unwrap();
//! conn_a.post_send(WrId(2), b"hello").unwrap();
//! fabric.run_until_idle(1_000);
//!
//! let mut completions = Vec::new();
//! conn_b.poll_completions(&mut completions, 16);
//! assert_eq!(conn_b.recv_slot(RecvSlot(0), 5), b"hello");
//! ```
//!
//! ## What is simulated
//! * **Endpoints** ([`SimFabric::add_endpoint`]): simulated processes, each with its own
//!   sparse, page-granular address space ([`SimMemory`]; allocations of different endpoints
//!   never share addresses) and protection domain ([`SimDomain`]) with real key checking.
//!   Keys are unique across the fabric and never reused; a deregistered or revoked key fails
//!   every later access.
//! * **Connection set-up** through the provider contract ([`SimFabric::connector`] gives a
//!   [`SimConnector`], a `san_api::SanConnector` addressed by [`SimAddress`]): listeners,
//!   requests carrying a setup blob, accept/reject, and the failures a real transport
//!   reports (refused, unreachable, rejected, reset); see the `setup` module for the table.
//! * **Cache-invalidation callbacks** (`SanDomain::memory_invalidated`) are recorded per
//!   endpoint ([`SimFabric::invalidations`]) so tests can check the switch makes them.
//! * **RC connections** ([`SimFabric::connect`]): per direction, sends and RDMA writes are
//!   *placed* at the peer in posting order (an RDMA write followed by a send is visible
//!   before the send's receive completes, as on a real RC queue pair); sends consume the
//!   receives posted at the peer in posting order; RDMA reads fetch the peer's memory after
//!   every earlier request of the queue was placed. Every work request gets exactly one
//!   completion. Send slots are accounted: a send's slot is free again once its completion
//!   has been handed out by `poll_completions`.
//! * **Errors are fatal to a connection**, as on real hardware: the failing request
//!   completes with its error, every other outstanding request of both sides with
//!   `Flushed`, and later posts return `Disconnected`. Note that `Flushed` does not mean "not
//!   executed": a request whose data already moved but whose completion was not yet queued
//!   is flushed too.
//! * **Faults** ([`FaultConfig`] for random ones, methods of [`SimFabric`] for targeted
//!   ones): long-tail completion delays; reordering (a request's completion leaves its
//!   queue's order, an RDMA read fetches its data late — after sends posted behind it
//!   arrived, as without a fence); connection errors; receiver-not-ready (bounded RNR
//!   retries, provoked by delayed re-posting of receives); registration failure
//!   ([`SimFabric::fail_next_registrations`]); memory vanishing under an exposed
//!   registration ([`SimFabric::invalidate_remote`]); endpoint crash ([`SimFabric::crash`]).
//! * **Violations** ([`SimFabric::violations`]): every use of a registration the switch
//!   must no longer use — locally, a deregistered (invalidated, evicted) or never-issued
//!   lkey, a segment outside its registration or lacking rights, a registration whose memory
//!   was unmapped but not invalidated; remotely, a peer reaching a registration whose memory
//!   was unmapped while its rkey stayed live (the cache did not invalidate it). A correct
//!   switch produces none, under every fault. Remote-access failures caused by a revoked or
//!   deregistered rkey are *not* violations (they are what revocation and invalidation are
//!   for); they are counted ([`EndpointCounters`]).
//! * **Determinism**: all randomness comes from one `ChaCha8Rng` seeded by
//!   [`SimFabric::new`]; the same seed and the same sequence of calls give the same run, tick
//!   for tick. Ties between events of the same tick are broken by scheduling order.
//!
//! ## Driving it
//! Posting never executes anything: a request is scheduled `latency` ticks ahead (≥ 1 by default,
//! [`SimTiming`]) and runs in [`SimFabric::step`] (or [`run_until_idle`](SimFabric::run_until_idle),
//! [`run_until`](SimFabric::run_until)). A test loop posts work, steps the fabric, polls every
//! connection and reacts. Completions are handed out by `poll_completions`; a received
//! message's bytes are copied into the connection handle at that moment. Determinism holds
//! as long as the test itself is deterministic: same calls, same order (iterate connections
//! in a fixed order, never over a `HashMap`). When a seed fails,
//! [`SimFabric::set_trace_capacity`] + [`SimFabric::trace`] show what the fabric did last.
//!
//! ## Memory model
//! [`SimFabric::alloc`] maps fresh zeroed pages at a new page-aligned address, followed by an
//! unmapped guard page. **Addresses are never reused by `alloc`**: once unmapped
//! ([`SimFabric::unmap`], the simulated `free`/`munmap`), an address comes back only through
//! an explicit [`SimFabric::map_at`] — the registration-cache invalidation scenario (free a
//! buffer, get new memory with different bytes at the same address). Unmapping registered
//! memory does not deregister it: that is the cache's job. The test must hand the unmapped
//! range to the cache's invalidation *before the fabric runs again* — as the preload's
//! munmap hook does, synchronously. Until the registration is deregistered it is *stale*:
//! any use of it, local or remote, is a violation (remote uses fail with `RemoteAccess`).
//!
//! ## What is not simulated, and how it differs from real verbs
//! * No partial transfers: an RDMA write or read moves all its bytes at one instant (its
//!   execution event) or none; a real device may expose a partially written buffer.
//! * Access checks happen when a request *executes*, not when it is posted, like a device.
//!   Post-time checks are limited to what `san-api` documents as caller errors.
//! * Receive activation is instantaneous unless the delayed-re-post fault fires; there is
//!   no receive-queue or completion-queue overflow, and the number of outstanding RDMA
//!   operations is unbounded.
//! * A message longer than the receiver's slots breaks the connection with `Fatal` on the
//!   sender's request (a device reports a local length error at the receiver instead).
//! * Connection management is minimal: [`SimFabric::connect`] builds both sides at once, and
//!   the [`SanConnector`](san_api::SanConnector) set-up ([`SimFabric::connector`]: listen,
//!   request with a setup blob, accept/reject) is built on it and takes no virtual time.
//!   Dropping a [`SimConnection`] destroys its side silently (requests not executed yet
//!   vanish), and the peer learns of it only when it next needs the dropped side
//!   (`RetryExceeded` after [`SimTiming::peer_loss_detection_ticks`]).
//! * Remote-access errors break the connection on both sides at once; real devices signal
//!   the responder side asynchronously.
//! * Bandwidth is a fixed per-request delay (`bytes / bytes_per_tick`); there is no
//!   congestion or sharing between connections.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod fabric;
mod memory;
mod setup;
mod types;

use std::cell::{Ref, RefCell, RefMut};
use std::fmt;
use std::rc::Rc;

use san_api::{
    Access, AppSource, BadAddress, Capabilities, Completion, CompletionError, CompletionKind,
    LocalKey, LocalSegment, MemRange, PostError, RecvSlot, RegisterError, Registration,
    RemoteDescriptor, RemoteKey, SanConnection, SanDomain, SlotConfig, WrId,
};

use fabric::Fabric;
pub use memory::PAGE_SIZE;
pub use setup::{
    SimAddress, SimConnecting, SimConnector, SimListener, SimRequest, MAX_PRIVATE_DATA,
};
pub use types::{
    ConnId, EndpointCounters, EndpointId, FaultConfig, SimError, SimTiming, Violation,
    ViolationKind,
};

/// Shared fabric state. The simulation is single-threaded by design; the `RefCell` is only
/// ever borrowed for the duration of one method of this crate, which never calls back into
/// user code, so a borrow can never be outstanding when another is taken.
type Shared = Rc<RefCell<Fabric>>;

/// A handle on the simulated fabric. Cheap to clone; every clone names the same fabric.
#[derive(Clone)]
pub struct SimFabric {
    shared: Shared,
}

impl fmt::Debug for SimFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let fabric = self.shared.borrow();
        f.debug_struct("SimFabric")
            .field("seed", &fabric.seed())
            .field("now", &fabric.now())
            .field("pending_events", &fabric.pending_events())
            .finish()
    }
}

impl SimFabric {
    /// A fabric whose every random choice derives from `seed`, with the default timing.
    pub fn new(seed: u64, faults: FaultConfig) -> Self {
        Self::with_timing(seed, faults, SimTiming::default())
    }

    /// A fabric with an explicit timing model.
    pub fn with_timing(seed: u64, faults: FaultConfig, timing: SimTiming) -> Self {
        Self {
            shared: Rc::new(RefCell::new(Fabric::new(seed, faults, timing))),
        }
    }

    fn state(&self) -> Ref<'_, Fabric> {
        self.shared.borrow()
    }

    fn state_mut(&self) -> RefMut<'_, Fabric> {
        self.shared.borrow_mut()
    }

    /// The seed this fabric was built with.
    pub fn seed(&self) -> u64 {
        self.state().seed()
    }

    /// The random-fault configuration in force.
    pub fn faults(&self) -> FaultConfig {
        self.state().faults
    }

    /// Replaces the random-fault configuration (e.g. to check progress once faults stop).
    pub fn set_faults(&self, faults: FaultConfig) {
        self.state_mut().faults = faults;
    }

    // ----- endpoints -----------------------------------------------------------------------

    /// Adds a simulated process: a fresh address space and protection domain, with the
    /// capabilities of an InfiniBand-like device (RDMA read supported).
    pub fn add_endpoint(&self) -> EndpointId {
        self.state_mut().add_endpoint()
    }

    /// Sets the capabilities of `ep` (e.g. `rdma_read: false` for an iWARP-like peer that
    /// cannot read). Applies to connections made afterwards.
    pub fn set_capabilities(&self, ep: EndpointId, caps: Capabilities) -> Result<(), SimError> {
        self.state_mut().set_capabilities(ep, caps)
    }

    /// The capabilities of `ep`.
    pub fn capabilities(&self, ep: EndpointId) -> Capabilities {
        self.state().capabilities(ep)
    }

    /// The protection domain of `ep`.
    pub fn domain(&self, ep: EndpointId) -> SimDomain {
        SimDomain {
            shared: Rc::clone(&self.shared),
            ep,
        }
    }

    /// The address space of `ep`, as a handle.
    pub fn memory(&self, ep: EndpointId) -> SimMemory {
        SimMemory {
            fabric: self.clone(),
            ep,
        }
    }

    /// False once `ep` crashed (or if it is not of this fabric).
    pub fn is_alive(&self, ep: EndpointId) -> bool {
        self.state().is_alive(ep)
    }

    /// Counters of `ep` (zeroes for an unknown endpoint).
    pub fn counters(&self, ep: EndpointId) -> EndpointCounters {
        self.state().counters(ep)
    }

    /// Every range the domain of `ep` was told about through
    /// `SanDomain::memory_invalidated`, oldest first (the switch's registration cache makes
    /// one call per invalidation).
    pub fn invalidations(&self, ep: EndpointId) -> Vec<MemRange> {
        self.state().invalidations(ep).to_vec()
    }

    /// Registrations of `ep` alive now (0 after a crash): the simulation checks it drains to
    /// zero once sessions end and the cache let go of its entries.
    pub fn live_registrations(&self, ep: EndpointId) -> usize {
        self.state().live_registrations(ep)
    }

    // ----- memory --------------------------------------------------------------------------

    /// Maps `len` fresh zeroed bytes in `ep`'s address space at a new page-aligned address
    /// (never one handed out before; see the crate docs for the reuse policy).
    pub fn alloc(&self, ep: EndpointId, len: u64) -> Result<MemRange, SimError> {
        self.state_mut().alloc(ep, len)
    }

    /// Writes `bytes` (exactly `range.len` of them) into `ep`'s memory, as the application.
    /// All or nothing: fails without writing if part of `range` is unmapped.
    pub fn write(&self, ep: EndpointId, range: MemRange, bytes: &[u8]) -> Result<(), SimError> {
        self.state_mut().write(ep, range, bytes)
    }

    /// Reads `range` of `ep`'s memory, as the application.
    pub fn read(&self, ep: EndpointId, range: MemRange) -> Result<Vec<u8>, SimError> {
        self.state().read(ep, range)
    }

    /// Unmaps (frees) the pages overlapping `range` (page-aligned start; the length is
    /// rounded up to whole pages) and returns the page-rounded range. Registrations over it
    /// stay alive but stale: the caller must now invalidate the range in its cache.
    pub fn unmap(&self, ep: EndpointId, range: MemRange) -> Result<MemRange, SimError> {
        self.state_mut().unmap(ep, range)
    }

    /// Maps fresh zeroed memory at exactly `addr` (page-aligned), which must be unmapped.
    pub fn map_at(&self, ep: EndpointId, addr: u64, len: u64) -> Result<MemRange, SimError> {
        self.state_mut().map_at(ep, addr, len)
    }

    // ----- connections -----------------------------------------------------------------------

    /// Connects `a` and `b` with a reliable connection; `slots_a` are the slot pools of
    /// `a`'s side. Each side gets the capabilities of its own endpoint.
    pub fn connect(
        &self,
        a: EndpointId,
        b: EndpointId,
        slots_a: SlotConfig,
        slots_b: SlotConfig,
    ) -> Result<(SimConnection, SimConnection), SimError> {
        let (id_a, id_b) = self.state_mut().connect(a, b, slots_a, slots_b)?;
        Ok((self.connection(id_a), self.connection(id_b)))
    }

    fn connection(&self, id: ConnId) -> SimConnection {
        let fabric = self.state();
        let slots = fabric.slot_config(id).unwrap_or(SlotConfig {
            send_slots: 0,
            recv_slots: 0,
            slot_size: 0,
        });
        let caps = fabric
            .conn_capabilities(id)
            .unwrap_or(fabric::DEFAULT_CAPABILITIES);
        let endpoint = fabric.conn_endpoint(id).unwrap_or(EndpointId(u32::MAX));
        SimConnection {
            shared: Rc::clone(&self.shared),
            id,
            endpoint,
            slots,
            caps,
            slot_bytes: vec![Vec::new(); usize::from(slots.recv_slots)],
            staged: Vec::new(),
        }
    }

    // ----- virtual time ------------------------------------------------------------------------

    /// The current virtual time, in ticks.
    pub fn now(&self) -> u64 {
        self.state().now()
    }

    /// Advances to the next scheduled event and runs it. Returns false if nothing is
    /// scheduled (the fabric is idle).
    pub fn step(&self) -> bool {
        self.state_mut().step()
    }

    /// Runs events until none is left or `max_steps` ran; returns how many ran.
    pub fn run_until_idle(&self, max_steps: usize) -> usize {
        let mut fabric = self.state_mut();
        let mut steps = 0;
        while steps < max_steps && fabric.step() {
            steps += 1;
        }
        steps
    }

    /// Runs every event scheduled at or before tick `until`; returns how many ran.
    pub fn run_until(&self, until: u64) -> usize {
        let mut fabric = self.state_mut();
        let mut steps = 0;
        while fabric.next_event_time().is_some_and(|at| at <= until) && fabric.step() {
            steps += 1;
        }
        steps
    }

    /// True when no event is scheduled.
    pub fn is_idle(&self) -> bool {
        self.state().pending_events() == 0
    }

    /// Number of scheduled events.
    pub fn pending_events(&self) -> usize {
        self.state().pending_events()
    }

    /// When the next event is due, if any.
    pub fn next_event_time(&self) -> Option<u64> {
        self.state().next_event_time()
    }

    /// Keeps the last `capacity` notable happenings (events run, connection errors, RNR
    /// retries, crashes, violations) as text for [`trace`](Self::trace); 0 (the default)
    /// turns tracing off at no cost.
    pub fn set_trace_capacity(&self, capacity: usize) {
        self.state_mut().set_trace_capacity(capacity);
    }

    /// The recorded trace, oldest first: print it when a seed fails.
    pub fn trace(&self) -> Vec<String> {
        self.state().trace()
    }

    /// Events run since the fabric was built.
    pub fn steps(&self) -> u64 {
        self.state().steps()
    }

    // ----- targeted faults ---------------------------------------------------------------------

    /// Breaks the connection `conn` belongs to, now: the oldest outstanding request of side
    /// `conn` completes with `RetryExceeded`, everything else outstanding on both sides with
    /// `Flushed`; later posts on either side fail with `Disconnected`.
    pub fn inject_qp_error(&self, conn: ConnId) -> Result<(), SimError> {
        self.inject_qp_error_with(conn, CompletionError::RetryExceeded)
    }

    /// Like [`inject_qp_error`](Self::inject_qp_error) with an explicit causing error.
    pub fn inject_qp_error_with(
        &self,
        conn: ConnId,
        cause: CompletionError,
    ) -> Result<(), SimError> {
        self.state_mut().inject_qp_error(conn, cause)
    }

    /// The next `count` registrations of `ep` fail with `OutOfResources`.
    pub fn fail_next_registrations(&self, ep: EndpointId, count: u32) -> Result<(), SimError> {
        self.state_mut().fail_next_registrations(ep, count)
    }

    /// The memory behind `ep`'s registration `lkey` vanishes mid-rendezvous (its pages are
    /// unmapped) while the registration stays. Returns the unmapped, page-rounded range: the
    /// test must hand it to the registration cache's invalidation before the fabric runs
    /// again, as the preload's munmap hook would. Then the peer's next access fails with
    /// `RemoteAccess` (its rkey died) — expected, counted, not a violation. If the
    /// registration is still live when the access arrives, the access fails all the same
    /// but is recorded as a violation of `ep` (the invalidation did not happen).
    pub fn invalidate_remote(&self, ep: EndpointId, lkey: LocalKey) -> Result<MemRange, SimError> {
        self.state_mut().invalidate_remote(ep, lkey)
    }

    /// The process `ep` dies now: its memory and registrations are gone, its connection
    /// handles report nothing more, and each peer connection breaks after
    /// [`SimTiming::peer_loss_detection_ticks`] (oldest outstanding request `RetryExceeded`,
    /// the rest `Flushed`).
    pub fn crash(&self, ep: EndpointId) -> Result<(), SimError> {
        self.state_mut().crash(ep)
    }

    /// Every violation recorded so far, oldest first.
    pub fn violations(&self) -> Vec<Violation> {
        self.state().violations().to_vec()
    }

    /// Number of violations recorded so far.
    pub fn violation_count(&self) -> usize {
        self.state().violations().len()
    }
}

/// The address space of one endpoint; a convenience handle over the memory methods of
/// [`SimFabric`].
#[derive(Clone, Debug)]
pub struct SimMemory {
    fabric: SimFabric,
    ep: EndpointId,
}

impl SimMemory {
    /// The endpoint this memory belongs to.
    pub fn endpoint(&self) -> EndpointId {
        self.ep
    }

    /// See [`SimFabric::alloc`].
    pub fn alloc(&self, len: u64) -> Result<MemRange, SimError> {
        self.fabric.alloc(self.ep, len)
    }

    /// See [`SimFabric::write`].
    pub fn write(&self, range: MemRange, bytes: &[u8]) -> Result<(), SimError> {
        self.fabric.write(self.ep, range, bytes)
    }

    /// See [`SimFabric::read`].
    pub fn read(&self, range: MemRange) -> Result<Vec<u8>, SimError> {
        self.fabric.read(self.ep, range)
    }

    /// See [`SimFabric::unmap`].
    pub fn unmap(&self, range: MemRange) -> Result<MemRange, SimError> {
        self.fabric.unmap(self.ep, range)
    }

    /// See [`SimFabric::map_at`].
    pub fn map_at(&self, addr: u64, len: u64) -> Result<MemRange, SimError> {
        self.fabric.map_at(self.ep, addr, len)
    }
}

/// The protection domain of one endpoint: implements [`SanDomain`] with real key checking.
/// Cheap to clone; clones name the same domain.
#[derive(Clone)]
pub struct SimDomain {
    shared: Shared,
    ep: EndpointId,
}

impl fmt::Debug for SimDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDomain")
            .field("endpoint", &self.ep)
            .finish()
    }
}

impl SimDomain {
    /// The endpoint this domain belongs to.
    pub fn endpoint(&self) -> EndpointId {
        self.ep
    }

    /// Registrations alive now in this domain.
    pub fn live_registrations(&self) -> usize {
        self.shared.borrow().live_registrations(self.ep)
    }
}

impl SanDomain for SimDomain {
    fn capabilities(&self) -> Capabilities {
        self.shared.borrow().capabilities(self.ep)
    }

    /// Fails with `BadAddress` for an empty, wrapping or (partly) unmapped range, or a
    /// crashed endpoint; with `OutOfResources` when a registration failure is injected.
    fn register(&mut self, range: MemRange, access: Access) -> Result<Registration, RegisterError> {
        self.shared.borrow_mut().register(self.ep, range, access)
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        self.shared.borrow_mut().deregister(self.ep, lkey)
    }

    /// Idempotent: revoking a registration with no rkey exposed succeeds and does nothing.
    fn revoke_remote(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        self.shared.borrow_mut().revoke_remote(self.ep, lkey)
    }

    /// Replaces the registration's remote rights by those in `access` (local rights are
    /// kept) under a fresh rkey; any previous rkey dies. `Unsupported` if `access` holds no
    /// remote right.
    fn expose_remote(
        &mut self,
        lkey: LocalKey,
        access: Access,
    ) -> Result<RemoteKey, RegisterError> {
        self.shared
            .borrow_mut()
            .expose_remote(self.ep, lkey, access)
    }

    /// Recorded (see [`SimFabric::invalidations`]); the simulation keeps no VA-keyed state
    /// outside its registrations.
    fn memory_invalidated(&mut self, range: MemRange) {
        self.shared.borrow_mut().memory_invalidated(self.ep, range);
    }
}

/// One side of a simulated reliable connection: implements [`SanConnection`].
///
/// Received message bytes are copied into this handle's slot storage when their `Recv`
/// completion is handed out by [`poll_completions`](SanConnection::poll_completions), and
/// cleared when the slot is posted again. Dropping the handle destroys this side of the
/// connection (see the crate docs).
pub struct SimConnection {
    shared: Shared,
    id: ConnId,
    endpoint: EndpointId,
    slots: SlotConfig,
    caps: Capabilities,
    slot_bytes: Vec<Vec<u8>>,
    /// Messages staged by [`SanConnection::stage_send_from`], posted at the commit.
    staged: Vec<(WrId, Vec<u8>)>,
}

impl fmt::Debug for SimConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimConnection")
            .field("id", &self.id)
            .field("endpoint", &self.endpoint)
            .field("slots", &self.slots)
            .finish()
    }
}

impl SimConnection {
    /// This side's identity (for [`SimFabric::inject_qp_error`]).
    pub fn id(&self) -> ConnId {
        self.id
    }

    /// The other side's identity.
    pub fn peer(&self) -> ConnId {
        self.id.peer()
    }

    /// The endpoint this side belongs to.
    pub fn endpoint(&self) -> EndpointId {
        self.endpoint
    }

    /// The capabilities of this side (those of its endpoint when connected).
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// True once this side is in the error state (or closed).
    pub fn is_broken(&self) -> bool {
        self.shared.borrow().is_broken(self.id)
    }

    /// Work requests posted on this side whose completion is not queued yet.
    pub fn outstanding_requests(&self) -> usize {
        self.shared.borrow().queue_depths(self.id).0
    }

    /// Completions queued on this side and not yet handed out by `poll_completions`.
    pub fn queued_completions(&self) -> usize {
        self.shared.borrow().queue_depths(self.id).1
    }
}

impl SanConnection for SimConnection {
    fn slot_config(&self) -> SlotConfig {
        self.slots
    }

    fn post_send(&mut self, wr_id: WrId, message: &[u8]) -> Result<(), PostError> {
        self.shared.borrow_mut().post_send(self.id, wr_id, message)
    }

    /// One end of each connection takes its messages in parts (joined by the trait's
    /// default), the other whole: every simulation then runs both of the pump's send paths.
    fn sends_in_parts(&self) -> bool {
        self.id.0.is_multiple_of(2)
    }

    /// Staged messages are copied out of the source and posted at the commit (the simulated
    /// wire copies them anyway). One end of each connection stages at most two messages
    /// per commit, so that every simulation also meets a stage refused for want of room.
    fn stage_send_from(
        &mut self,
        wr_id: WrId,
        head: &[u8],
        payload: &dyn AppSource,
    ) -> Result<bool, BadAddress> {
        let len = head.len().saturating_add(payload.len());
        let room = self
            .shared
            .borrow()
            .can_post_sends(self.id, self.staged.len());
        let capped = !self.id.0.is_multiple_of(2) && self.staged.len() >= 2;
        if !room || capped || len > self.slots.slot_size as usize {
            return Ok(false);
        }
        let mut message = vec![0u8; len];
        message[..head.len()].copy_from_slice(head);
        payload.copy_to(0, &mut message[head.len()..])?;
        self.staged.push((wr_id, message));
        Ok(true)
    }

    fn commit_staged(&mut self) {
        for (wr_id, message) in core::mem::take(&mut self.staged) {
            // (Room for every staged message was checked when it was staged.)
            let posted = self.post_send(wr_id, &message);
            debug_assert!(posted.is_ok(), "a staged message could not be posted");
        }
    }

    fn discard_staged(&mut self) {
        self.staged.clear();
    }

    fn post_recv(&mut self, wr_id: WrId, slot: RecvSlot) -> Result<(), PostError> {
        self.shared.borrow_mut().post_recv(self.id, wr_id, slot)?;
        // The slot's previous message is no longer valid once it is posted again.
        if let Some(bytes) = self.slot_bytes.get_mut(usize::from(slot.0)) {
            bytes.clear();
        }
        Ok(())
    }

    fn recv_slot(&self, slot: RecvSlot, len: u32) -> &[u8] {
        self.slot_bytes
            .get(usize::from(slot.0))
            .map_or(&[][..], |bytes| &bytes[..bytes.len().min(len as usize)])
    }

    fn post_write(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.shared
            .borrow_mut()
            .post_write(self.id, wr_id, local, remote)
    }

    fn post_read(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.shared
            .borrow_mut()
            .post_read(self.id, wr_id, local, remote)
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let entries = self.shared.borrow_mut().take_completions(self.id, max);
        let count = entries.len();
        for entry in entries {
            if let (CompletionKind::Recv { slot, .. }, Some(payload)) =
                (entry.completion.kind, entry.payload)
            {
                if let Some(bytes) = self.slot_bytes.get_mut(usize::from(slot.0)) {
                    *bytes = payload;
                }
            }
            out.push(entry.completion);
        }
        count
    }
}

impl Drop for SimConnection {
    fn drop(&mut self) {
        // `try_borrow_mut`: never panic in drop, even if a caller somehow drops a handle
        // while the fabric is borrowed (it cannot be through this crate's API).
        if let Ok(mut fabric) = self.shared.try_borrow_mut() {
            fabric.close(self.id);
        }
    }
}
