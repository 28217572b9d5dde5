//! The fabric's state and its event loop. Everything here runs under one `RefCell` borrow
//! taken by the public handles in `lib.rs`; nothing in here calls back into user code.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use san_api::{
    Access, Capabilities, Completion, CompletionError, CompletionKind, LocalKey, LocalSegment,
    MemRange, PostError, RecvSlot, RegisterError, Registration, RemoteDescriptor, RemoteKey,
    SlotConfig, WrId,
};

use crate::memory::{AddressSpace, MapError, Unmapped};
use crate::setup::SetupTable;
use crate::types::{
    ConnId, EndpointCounters, EndpointId, FaultConfig, SimError, SimTiming, Violation,
    ViolationKind,
};

/// Capabilities of a fresh endpoint: an InfiniBand-like device.
pub(crate) const DEFAULT_CAPABILITIES: Capabilities = Capabilities {
    rdma_read: true,
    write_with_imm: false,
    read_sink_needs_remote_write: false,
    active_side_sends_first: false,
    max_slot_size: 64 * 1024,
    max_slots: 1024,
    max_inline: 256,
    max_rdma_len: 1 << 30,
};

/// Where each endpoint's allocations start: distinct per endpoint so that an address of the
/// wrong process never happens to be valid.
const ADDRESS_SPACE_STRIDE: u64 = 1 << 40;

/// A registration in an endpoint's protection domain.
#[derive(Clone, Debug)]
struct Reg {
    range: MemRange,
    access: Access,
    rkey: Option<u32>,
    /// Part of the memory was unmapped after registering (the pinned pages are "gone" from
    /// the process). Local use is a violation; remote use fails with `RemoteAccess`.
    memory_gone: bool,
}

struct Endpoint {
    alive: bool,
    caps: Capabilities,
    memory: AddressSpace,
    regs: BTreeMap<u32, Reg>,
    /// Live rkey → lkey.
    rkeys: BTreeMap<u32, u32>,
    /// Keys this endpoint issued that are dead now (never reused: keys are fabric-unique).
    retired_lkeys: BTreeSet<u32>,
    retired_rkeys: BTreeSet<u32>,
    fail_next_registrations: u32,
    counters: EndpointCounters,
    /// Every `memory_invalidated` callback the domain got, oldest first.
    invalidations: Vec<MemRange>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum QpState {
    Ready,
    /// Broken: every outstanding request was flushed; posts fail with `Disconnected`.
    Error,
    /// The owner dropped the connection or crashed: nothing is reported any more.
    Closed,
}

#[derive(Debug)]
enum WrOp {
    Send {
        message: Vec<u8>,
    },
    Write {
        local: LocalSegment,
        remote: RemoteDescriptor,
    },
    Read {
        local: LocalSegment,
        remote: RemoteDescriptor,
    },
    Recv {
        slot: RecvSlot,
    },
}

impl WrOp {
    fn flushed_kind(&self) -> CompletionKind {
        match self {
            WrOp::Send { .. } => CompletionKind::Send,
            WrOp::Write { .. } => CompletionKind::Write,
            WrOp::Read { .. } => CompletionKind::Read,
            WrOp::Recv { slot } => CompletionKind::Recv {
                slot: *slot,
                len: 0,
            },
        }
    }
}

#[derive(Debug)]
struct Wr {
    wr_id: WrId,
    op: WrOp,
    /// When the request may first execute (send queue) or become usable (receive).
    due: u64,
    rnr_retries: u32,
    /// Leaves its queue's completion order (reorder fault).
    reordered: bool,
}

/// A completion waiting in a completion queue, with the message bytes of a receive.
pub(crate) struct CqEntry {
    pub completion: Completion,
    pub payload: Option<Vec<u8>>,
}

struct Qp {
    ep: EndpointId,
    slots: SlotConfig,
    caps: Capabilities,
    state: QpState,
    /// Every outstanding work request (posted, no completion queued yet), by sequence
    /// number = posting order.
    wrs: BTreeMap<u64, Wr>,
    /// Send-queue requests not yet executed, in posting order; only the head executes.
    send_queue: VecDeque<u64>,
    /// Receives usable by arriving sends, in posting order.
    recv_queue: VecDeque<u64>,
    /// Receives posted but not yet usable (delayed re-post fault).
    pending_recvs: u32,
    /// Per slot: posted, and its completion not yet handed out.
    recv_posted: Vec<bool>,
    /// Sends posted whose completion has not been handed out yet (send-slot accounting).
    sends_unpolled: u16,
    cq: VecDeque<CqEntry>,
    /// Execution time of the last send-queue request (keeps placement in order).
    last_exec: u64,
    /// Time of the last in-order send-queue completion.
    last_completion: u64,
    /// Time of the last scheduled receive activation.
    last_recv_activation: u64,
    peer_loss_scheduled: bool,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    /// Try to execute send-queue request `seq` (only if it is the head).
    Execute { qp: usize, seq: u64 },
    /// Fetch the data of a reordered RDMA read.
    ReadResponse { qp: usize, seq: u64 },
    /// Queue the successful completion of an executed request.
    Complete { qp: usize, seq: u64 },
    /// A delayed receive becomes usable.
    RecvActivate { qp: usize, seq: u64 },
    /// The peer of `qp` is known to be gone.
    PeerLost { qp: usize },
}

/// Outcome of checking a local segment.
type LocalCheck = Result<(), ViolationKind>;

pub(crate) struct Fabric {
    seed: u64,
    rng: ChaCha8Rng,
    pub faults: FaultConfig,
    timing: SimTiming,
    now: u64,
    /// Sequence numbers: work requests and event tie-breaks (same tick ⇒ scheduling order).
    next_seq: u64,
    /// Keys are unique across the whole fabric (lkeys and rkeys share the counter, so an
    /// lkey presented as an rkey is always rejected).
    next_key: u32,
    events: BTreeMap<(u64, u64), Event>,
    endpoints: Vec<Endpoint>,
    qps: Vec<Qp>,
    violations: Vec<Violation>,
    steps: u64,
    /// The most recent notable happenings, for debugging a failing seed (off when the
    /// capacity is 0; nothing is formatted then).
    trace: VecDeque<String>,
    trace_capacity: usize,
    /// Listeners and connection requests (`crate::setup`).
    pub(crate) setup: SetupTable,
}

/// Hands out the next fabric-unique key. Four billion keys is far beyond any simulated run;
/// saturating keeps the arithmetic total (past it, the last key would repeat).
fn take_key(next_key: &mut u32) -> u32 {
    let key = *next_key;
    *next_key = next_key.saturating_add(1);
    key
}

fn chance(rng: &mut ChaCha8Rng, probability: f64) -> bool {
    // `probability > 0.0` is false for NaN, so NaN never fires (and draws nothing).
    probability > 0.0 && rng.gen::<f64>() < probability.min(1.0)
}

impl Fabric {
    pub fn new(seed: u64, faults: FaultConfig, timing: SimTiming) -> Self {
        let timing = SimTiming {
            max_latency_ticks: timing.max_latency_ticks.max(timing.min_latency_ticks),
            bytes_per_tick: timing.bytes_per_tick.max(1),
            rnr_retry_interval_ticks: timing.rnr_retry_interval_ticks.max(1),
            ..timing
        };
        Self {
            seed,
            rng: ChaCha8Rng::seed_from_u64(seed),
            faults,
            timing,
            now: 0,
            next_seq: 0,
            next_key: 1,
            events: BTreeMap::new(),
            endpoints: Vec::new(),
            qps: Vec::new(),
            violations: Vec::new(),
            steps: 0,
            trace: VecDeque::new(),
            trace_capacity: 0,
            setup: SetupTable::default(),
        }
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn now(&self) -> u64 {
        self.now
    }

    pub fn set_trace_capacity(&mut self, capacity: usize) {
        self.trace_capacity = capacity;
        while self.trace.len() > capacity {
            self.trace.pop_front();
        }
    }

    pub fn trace(&self) -> Vec<String> {
        self.trace.iter().cloned().collect()
    }

    /// Records a trace line; `describe` runs only when tracing is on.
    fn note(&mut self, describe: impl FnOnce(&Self) -> String) {
        if self.trace_capacity == 0 {
            return;
        }
        let line = format!("t={} {}", self.now, describe(self));
        if self.trace.len() == self.trace_capacity {
            self.trace.pop_front();
        }
        self.trace.push_back(line);
    }

    fn describe_wr(&self, qp: usize, seq: u64) -> String {
        match self.qps[qp].wrs.get(&seq) {
            None => format!("qp{qp} (wr gone)"),
            Some(wr) => {
                let what = match &wr.op {
                    WrOp::Send { message } => format!("send {} B", message.len()),
                    WrOp::Write { local, remote } => format!(
                        "write {} B lkey {} -> {:#x} rkey {}",
                        local.range.len, local.lkey.0, remote.addr, remote.rkey.0
                    ),
                    WrOp::Read { local, remote } => format!(
                        "read {} B {:#x} rkey {} -> lkey {}",
                        local.range.len, remote.addr, remote.rkey.0, local.lkey.0
                    ),
                    WrOp::Recv { slot } => format!("recv slot {}", slot.0),
                };
                format!("qp{qp} wr {} {what}", wr.wr_id.0)
            }
        }
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    pub fn pending_events(&self) -> usize {
        self.events.len()
    }

    pub fn next_event_time(&self) -> Option<u64> {
        self.events.keys().next().map(|&(at, _)| at)
    }

    fn alloc_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    fn schedule(&mut self, at: u64, event: Event) {
        let seq = self.alloc_seq();
        self.events.insert((at, seq), event);
    }

    fn gen_range_inclusive(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            low
        } else {
            self.rng.gen_range(low..=high)
        }
    }

    /// A heavy-tailed delay in `1..=max`: log-uniform (the power of two is uniform, then the
    /// value within it), so most delays are short and a few approach `max`.
    fn long_tail(&mut self, max: u64) -> u64 {
        let max = max.max(1);
        let octaves = u64::from(u64::BITS - max.leading_zeros());
        let octave = self.rng.gen_range(0..=octaves);
        let top = (1u64 << octave).min(max);
        self.gen_range_inclusive(top / 2 + 1, top)
    }

    fn placement_delay(&mut self, bytes: u64) -> u64 {
        let latency =
            self.gen_range_inclusive(self.timing.min_latency_ticks, self.timing.max_latency_ticks);
        latency.saturating_add(bytes / self.timing.bytes_per_tick)
    }

    // ----- endpoints and memory -------------------------------------------------------

    pub fn add_endpoint(&mut self) -> EndpointId {
        let index = self.endpoints.len() as u64;
        let id = EndpointId(index as u32);
        self.endpoints.push(Endpoint {
            alive: true,
            caps: DEFAULT_CAPABILITIES,
            memory: AddressSpace::new((index + 1).saturating_mul(ADDRESS_SPACE_STRIDE)),
            regs: BTreeMap::new(),
            rkeys: BTreeMap::new(),
            retired_lkeys: BTreeSet::new(),
            retired_rkeys: BTreeSet::new(),
            fail_next_registrations: 0,
            counters: EndpointCounters::default(),
            invalidations: Vec::new(),
        });
        id
    }

    fn endpoint(&self, ep: EndpointId) -> Result<&Endpoint, SimError> {
        let endpoint = self
            .endpoints
            .get(ep.index())
            .ok_or(SimError::UnknownEndpoint(ep))?;
        if endpoint.alive {
            Ok(endpoint)
        } else {
            Err(SimError::EndpointCrashed(ep))
        }
    }

    fn endpoint_mut(&mut self, ep: EndpointId) -> Result<&mut Endpoint, SimError> {
        let endpoint = self
            .endpoints
            .get_mut(ep.index())
            .ok_or(SimError::UnknownEndpoint(ep))?;
        if endpoint.alive {
            Ok(endpoint)
        } else {
            Err(SimError::EndpointCrashed(ep))
        }
    }

    pub fn is_alive(&self, ep: EndpointId) -> bool {
        self.endpoints.get(ep.index()).is_some_and(|e| e.alive)
    }

    pub fn set_capabilities(&mut self, ep: EndpointId, caps: Capabilities) -> Result<(), SimError> {
        self.endpoint_mut(ep)?.caps = caps;
        Ok(())
    }

    pub fn capabilities(&self, ep: EndpointId) -> Capabilities {
        self.endpoints
            .get(ep.index())
            .map_or(DEFAULT_CAPABILITIES, |e| e.caps)
    }

    pub fn counters(&self, ep: EndpointId) -> EndpointCounters {
        self.endpoints
            .get(ep.index())
            .map(|e| e.counters)
            .unwrap_or_default()
    }

    /// The domain of `ep` was told that `range` was invalidated (a crashed or unknown
    /// endpoint records nothing: its domain is gone).
    pub fn memory_invalidated(&mut self, ep: EndpointId, range: MemRange) {
        if let Ok(endpoint) = self.endpoint_mut(ep) {
            endpoint.invalidations.push(range);
        }
    }

    pub fn invalidations(&self, ep: EndpointId) -> &[MemRange] {
        self.endpoints
            .get(ep.index())
            .map_or(&[][..], |e| &e.invalidations[..])
    }

    pub fn live_registrations(&self, ep: EndpointId) -> usize {
        self.endpoints.get(ep.index()).map_or(0, |e| e.regs.len())
    }

    pub fn violations(&self) -> &[Violation] {
        &self.violations
    }

    pub fn alloc(&mut self, ep: EndpointId, len: u64) -> Result<MemRange, SimError> {
        self.endpoint_mut(ep)?
            .memory
            .alloc(len)
            .ok_or(SimError::InvalidLength)
    }

    pub fn write(&mut self, ep: EndpointId, range: MemRange, bytes: &[u8]) -> Result<(), SimError> {
        if range.len != bytes.len() as u64 {
            return Err(SimError::LengthMismatch {
                range_len: range.len,
                bytes_len: bytes.len() as u64,
            });
        }
        self.endpoint_mut(ep)?
            .memory
            .write(range.addr, bytes)
            .map_err(|Unmapped { addr }| SimError::Unmapped { addr })
    }

    pub fn read(&self, ep: EndpointId, range: MemRange) -> Result<Vec<u8>, SimError> {
        self.endpoint(ep)?
            .memory
            .read(range)
            .map_err(|Unmapped { addr }| SimError::Unmapped { addr })
    }

    /// Unmaps `range` (page-rounded) and marks every registration over it as stale.
    pub fn unmap(&mut self, ep: EndpointId, range: MemRange) -> Result<MemRange, SimError> {
        if range.len == 0 || range.addr.checked_add(range.len).is_none() {
            return Err(SimError::InvalidLength);
        }
        let endpoint = self.endpoint_mut(ep)?;
        let unmapped = endpoint
            .memory
            .unmap(range)
            .ok_or(SimError::Misaligned { addr: range.addr })?;
        for reg in endpoint.regs.values_mut() {
            if reg.range.overlaps(&unmapped) {
                reg.memory_gone = true;
            }
        }
        Ok(unmapped)
    }

    pub fn map_at(&mut self, ep: EndpointId, addr: u64, len: u64) -> Result<MemRange, SimError> {
        self.endpoint_mut(ep)?
            .memory
            .map_at(addr, len)
            .map_err(|e| match e {
                MapError::Misaligned => SimError::Misaligned { addr },
                MapError::Empty | MapError::Overflow => SimError::InvalidLength,
                MapError::AlreadyMapped { addr } => SimError::AlreadyMapped { addr },
            })
    }

    pub fn fail_next_registrations(&mut self, ep: EndpointId, count: u32) -> Result<(), SimError> {
        self.endpoint_mut(ep)?.fail_next_registrations = count;
        Ok(())
    }

    /// The memory behind registration `lkey` vanishes (unmapped): the next remote access
    /// fails with `RemoteAccess`. Returns the unmapped (page-rounded) range.
    pub fn invalidate_remote(
        &mut self,
        ep: EndpointId,
        lkey: LocalKey,
    ) -> Result<MemRange, SimError> {
        let range = self
            .endpoint(ep)?
            .regs
            .get(&lkey.0)
            .map(|reg| reg.range)
            .ok_or(SimError::UnknownKey(lkey))?;
        let aligned_start = range.addr - range.addr % crate::memory::PAGE_SIZE;
        let len = range.end() - aligned_start;
        self.unmap(ep, MemRange::new(aligned_start, len))
    }

    // ----- protection domain -----------------------------------------------------------

    pub fn register(
        &mut self,
        ep: EndpointId,
        range: MemRange,
        access: Access,
    ) -> Result<Registration, RegisterError> {
        let inject = chance(&mut self.rng, self.faults.registration_failure);
        // Borrow the endpoint and the key counter as disjoint fields.
        let Some(endpoint) = self.endpoints.get_mut(ep.index()).filter(|e| e.alive) else {
            return Err(RegisterError::BadAddress);
        };
        let outcome = if endpoint.fail_next_registrations > 0 {
            endpoint.fail_next_registrations -= 1;
            Err(RegisterError::OutOfResources)
        } else if inject {
            Err(RegisterError::OutOfResources)
        } else if range.len == 0
            || range.addr.checked_add(range.len).is_none()
            || endpoint.memory.first_unmapped(range).is_some()
        {
            Err(RegisterError::BadAddress)
        } else {
            Ok(())
        };
        if let Err(error) = outcome {
            endpoint.counters.registration_failures += 1;
            return Err(error);
        }
        let lkey = take_key(&mut self.next_key);
        let rkey = access.is_remote().then(|| take_key(&mut self.next_key));
        endpoint.regs.insert(
            lkey,
            Reg {
                range,
                access,
                rkey,
                memory_gone: false,
            },
        );
        if let Some(rkey) = rkey {
            endpoint.rkeys.insert(rkey, lkey);
        }
        endpoint.counters.registrations += 1;
        endpoint.counters.registrations_live = endpoint.regs.len() as u64;
        Ok(Registration {
            range,
            access,
            lkey: LocalKey(lkey),
            rkey: rkey.map(RemoteKey),
        })
    }

    pub fn deregister(&mut self, ep: EndpointId, lkey: LocalKey) -> Result<(), RegisterError> {
        let endpoint = self
            .endpoint_mut(ep)
            .map_err(|_| RegisterError::UnknownKey)?;
        let reg = endpoint
            .regs
            .remove(&lkey.0)
            .ok_or(RegisterError::UnknownKey)?;
        endpoint.retired_lkeys.insert(lkey.0);
        if let Some(rkey) = reg.rkey {
            endpoint.rkeys.remove(&rkey);
            endpoint.retired_rkeys.insert(rkey);
        }
        endpoint.counters.deregistrations += 1;
        endpoint.counters.registrations_live = endpoint.regs.len() as u64;
        Ok(())
    }

    pub fn revoke_remote(&mut self, ep: EndpointId, lkey: LocalKey) -> Result<(), RegisterError> {
        let endpoint = self
            .endpoint_mut(ep)
            .map_err(|_| RegisterError::UnknownKey)?;
        let reg = endpoint
            .regs
            .get_mut(&lkey.0)
            .ok_or(RegisterError::UnknownKey)?;
        if let Some(rkey) = reg.rkey.take() {
            endpoint.rkeys.remove(&rkey);
            endpoint.retired_rkeys.insert(rkey);
            endpoint.counters.revocations += 1;
        }
        Ok(())
    }

    pub fn expose_remote(
        &mut self,
        ep: EndpointId,
        lkey: LocalKey,
        access: Access,
    ) -> Result<RemoteKey, RegisterError> {
        if !access.is_remote() {
            return Err(RegisterError::Unsupported);
        }
        let now = self.now;
        let endpoint = self
            .endpoints
            .get_mut(ep.index())
            .filter(|e| e.alive)
            .ok_or(RegisterError::UnknownKey)?;
        let reg = endpoint
            .regs
            .get_mut(&lkey.0)
            .ok_or(RegisterError::UnknownKey)?;
        let new_rkey = take_key(&mut self.next_key);
        let stale = reg.memory_gone;
        let remote_rights = Access::REMOTE_READ | Access::REMOTE_WRITE;
        let local_rights = Access::from_bits_truncate(reg.access.bits() & !remote_rights.bits());
        reg.access =
            local_rights | Access::from_bits_truncate(access.bits() & remote_rights.bits());
        let old = reg.rkey.replace(new_rkey);
        if let Some(old) = old {
            endpoint.rkeys.remove(&old);
            endpoint.retired_rkeys.insert(old);
        }
        endpoint.rkeys.insert(new_rkey, lkey.0);
        endpoint.counters.exposures += 1;
        if stale {
            self.record_violation(Violation {
                tick: now,
                endpoint: ep,
                conn: None,
                wr_id: None,
                kind: ViolationKind::ExposedUnmappedMemory { lkey },
            });
        }
        Ok(RemoteKey(new_rkey))
    }

    fn record_violation(&mut self, violation: Violation) {
        self.note(|_| format!("VIOLATION {violation}"));
        if let Some(endpoint) = self.endpoints.get_mut(violation.endpoint.index()) {
            endpoint.counters.violations += 1;
        }
        self.violations.push(violation);
    }

    // ----- connections -------------------------------------------------------------------

    pub fn connect(
        &mut self,
        a: EndpointId,
        b: EndpointId,
        slots_a: SlotConfig,
        slots_b: SlotConfig,
    ) -> Result<(ConnId, ConnId), SimError> {
        let caps_a = self.endpoint(a)?.caps;
        let caps_b = self.endpoint(b)?.caps;
        for (slots, caps) in [(slots_a, caps_a), (slots_b, caps_b)] {
            let fits = slots.send_slots > 0
                && slots.recv_slots > 0
                && slots.send_slots <= caps.max_slots
                && slots.recv_slots <= caps.max_slots
                && slots.slot_size <= caps.max_slot_size;
            if !fits {
                return Err(SimError::InvalidSlotConfig);
            }
        }
        let first = self.qps.len() as u32;
        for (ep, slots, caps) in [(a, slots_a, caps_a), (b, slots_b, caps_b)] {
            self.qps.push(Qp {
                ep,
                slots,
                caps,
                state: QpState::Ready,
                wrs: BTreeMap::new(),
                send_queue: VecDeque::new(),
                recv_queue: VecDeque::new(),
                pending_recvs: 0,
                recv_posted: vec![false; usize::from(slots.recv_slots)],
                sends_unpolled: 0,
                cq: VecDeque::new(),
                last_exec: 0,
                last_completion: 0,
                last_recv_activation: 0,
                peer_loss_scheduled: false,
            });
        }
        Ok((ConnId(first), ConnId(first + 1)))
    }

    pub fn slot_config(&self, conn: ConnId) -> Option<SlotConfig> {
        self.qps.get(conn.index()).map(|qp| qp.slots)
    }

    pub fn conn_capabilities(&self, conn: ConnId) -> Option<Capabilities> {
        self.qps.get(conn.index()).map(|qp| qp.caps)
    }

    pub fn conn_endpoint(&self, conn: ConnId) -> Option<EndpointId> {
        self.qps.get(conn.index()).map(|qp| qp.ep)
    }

    pub fn is_broken(&self, conn: ConnId) -> bool {
        self.qps
            .get(conn.index())
            .is_none_or(|qp| qp.state != QpState::Ready)
    }

    /// Whether `extra` more sends may be posted on `conn` now (ready, send queue not full).
    pub fn can_post_sends(&self, conn: ConnId, extra: usize) -> bool {
        self.qps.get(conn.index()).is_some_and(|qp| {
            qp.state == QpState::Ready
                && usize::from(qp.sends_unpolled) + extra < usize::from(qp.slots.send_slots)
        })
    }

    /// (requests posted without a queued completion, completions not yet handed out)
    pub fn queue_depths(&self, conn: ConnId) -> (usize, usize) {
        self.qps
            .get(conn.index())
            .map_or((0, 0), |qp| (qp.wrs.len(), qp.cq.len()))
    }

    fn usable_qp(&mut self, conn: ConnId) -> Result<&mut Qp, PostError> {
        let qp = self
            .qps
            .get_mut(conn.index())
            .ok_or(PostError::Disconnected)?;
        if qp.state == QpState::Ready {
            Ok(qp)
        } else {
            Err(PostError::Disconnected)
        }
    }

    /// Puts a send-queue request on the wire schedule, behind everything posted before it.
    fn enqueue_send_queue(&mut self, conn: ConnId, wr_id: WrId, op: WrOp, bytes: u64) {
        let delay = self.placement_delay(bytes);
        let reordered = chance(&mut self.rng, self.faults.reorder);
        let seq = self.alloc_seq();
        let now = self.now;
        let qp = &mut self.qps[conn.index()];
        let due = now.saturating_add(delay).max(qp.last_exec);
        qp.last_exec = due;
        qp.wrs.insert(
            seq,
            Wr {
                wr_id,
                op,
                due,
                rnr_retries: 0,
                reordered,
            },
        );
        qp.send_queue.push_back(seq);
        self.schedule(
            due,
            Event::Execute {
                qp: conn.index(),
                seq,
            },
        );
    }

    pub fn post_send(
        &mut self,
        conn: ConnId,
        wr_id: WrId,
        message: &[u8],
    ) -> Result<(), PostError> {
        let qp = self.usable_qp(conn)?;
        if message.len() as u64 > u64::from(qp.slots.slot_size) {
            return Err(PostError::TooLong);
        }
        if qp.sends_unpolled >= qp.slots.send_slots {
            return Err(PostError::QueueFull);
        }
        qp.sends_unpolled += 1;
        self.enqueue_send_queue(
            conn,
            wr_id,
            WrOp::Send {
                message: message.to_vec(),
            },
            message.len() as u64,
        );
        Ok(())
    }

    pub fn post_recv(
        &mut self,
        conn: ConnId,
        wr_id: WrId,
        slot: RecvSlot,
    ) -> Result<(), PostError> {
        let delayed = chance(&mut self.rng, self.faults.delayed_repost);
        let delay = if delayed {
            self.gen_range_inclusive(1, self.faults.repost_delay_max_ticks.max(1))
        } else {
            0
        };
        let seq = self.alloc_seq();
        let now = self.now;
        let qp = self.usable_qp(conn)?;
        let posted = qp
            .recv_posted
            .get_mut(usize::from(slot.0))
            .ok_or(PostError::InvalidArgument)?;
        if *posted {
            return Err(PostError::QueueFull);
        }
        *posted = true;
        let wr = Wr {
            wr_id,
            op: WrOp::Recv { slot },
            due: now,
            rnr_retries: 0,
            reordered: false,
        };
        if delay == 0 && qp.pending_recvs == 0 {
            qp.wrs.insert(seq, wr);
            qp.recv_queue.push_back(seq);
            return Ok(());
        }
        // Activations stay in posting order: a receive never becomes usable before one
        // posted earlier.
        let due = now.saturating_add(delay).max(qp.last_recv_activation);
        qp.last_recv_activation = due;
        qp.pending_recvs += 1;
        qp.wrs.insert(seq, Wr { due, ..wr });
        self.schedule(
            due,
            Event::RecvActivate {
                qp: conn.index(),
                seq,
            },
        );
        Ok(())
    }

    fn check_rdma_post(
        &mut self,
        conn: ConnId,
        local: &LocalSegment,
        remote: &RemoteDescriptor,
        is_read: bool,
    ) -> Result<(), PostError> {
        let qp = self.usable_qp(conn)?;
        let len = local.range.len;
        let malformed = len == 0
            || local.range.addr.checked_add(len).is_none()
            || remote.addr.checked_add(remote.len).is_none()
            || remote.len < len
            || len > qp.caps.max_rdma_len
            || (is_read && !qp.caps.rdma_read);
        if malformed {
            Err(PostError::InvalidArgument)
        } else {
            Ok(())
        }
    }

    pub fn post_write(
        &mut self,
        conn: ConnId,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.check_rdma_post(conn, &local, &remote, false)?;
        self.enqueue_send_queue(conn, wr_id, WrOp::Write { local, remote }, local.range.len);
        Ok(())
    }

    pub fn post_read(
        &mut self,
        conn: ConnId,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.check_rdma_post(conn, &local, &remote, true)?;
        self.enqueue_send_queue(conn, wr_id, WrOp::Read { local, remote }, local.range.len);
        Ok(())
    }

    /// Hands out up to `max` completions of `conn`, releasing the send and receive slots
    /// they account for.
    pub fn take_completions(&mut self, conn: ConnId, max: usize) -> Vec<CqEntry> {
        let Some(qp) = self.qps.get_mut(conn.index()) else {
            return Vec::new();
        };
        let count = max.min(qp.cq.len());
        let taken: Vec<CqEntry> = qp.cq.drain(..count).collect();
        for entry in &taken {
            match entry.completion.kind {
                CompletionKind::Send => qp.sends_unpolled = qp.sends_unpolled.saturating_sub(1),
                CompletionKind::Recv { slot, .. } => {
                    if let Some(posted) = qp.recv_posted.get_mut(usize::from(slot.0)) {
                        *posted = false;
                    }
                }
                CompletionKind::Write | CompletionKind::Read => {}
            }
        }
        let ep = qp.ep;
        if let Some(endpoint) = self.endpoints.get_mut(ep.index()) {
            endpoint.counters.completions += taken.len() as u64;
        }
        taken
    }

    /// The owner dropped its connection handle: nothing more is reported on this side;
    /// requests not yet executed vanish. The peer notices when it next needs this side.
    pub fn close(&mut self, conn: ConnId) {
        if let Some(qp) = self.qps.get_mut(conn.index()) {
            qp.state = QpState::Closed;
            qp.wrs.clear();
            qp.send_queue.clear();
            qp.recv_queue.clear();
            qp.cq.clear();
        }
    }

    // ----- faults ------------------------------------------------------------------------

    pub fn inject_qp_error(
        &mut self,
        conn: ConnId,
        cause: CompletionError,
    ) -> Result<(), SimError> {
        if conn.index() >= self.qps.len() {
            return Err(SimError::UnknownConnection(conn));
        }
        let first = self.qps[conn.index()].wrs.keys().next().copied();
        self.fail_connection(conn.index(), first.map(|seq| (seq, cause)), None);
        Ok(())
    }

    pub fn crash(&mut self, ep: EndpointId) -> Result<(), SimError> {
        self.note(|_| format!("{ep} crashes"));
        let endpoint = self.endpoint_mut(ep)?;
        endpoint.alive = false;
        endpoint.memory.clear();
        // The process's keys die with it; they stay retired so nothing ever reuses them.
        let lkeys: Vec<u32> = endpoint.regs.keys().copied().collect();
        endpoint.retired_lkeys.extend(lkeys);
        let rkeys: Vec<u32> = endpoint.rkeys.keys().copied().collect();
        endpoint.retired_rkeys.extend(rkeys);
        endpoint.regs.clear();
        endpoint.rkeys.clear();
        endpoint.counters.registrations_live = 0;
        let detect_at = self
            .now
            .saturating_add(self.timing.peer_loss_detection_ticks);
        for index in 0..self.qps.len() {
            if self.qps[index].ep != ep {
                continue;
            }
            self.close(ConnId(index as u32));
            let peer = index ^ 1;
            if self.qps[peer].state == QpState::Ready && !self.qps[peer].peer_loss_scheduled {
                self.qps[peer].peer_loss_scheduled = true;
                self.schedule(detect_at, Event::PeerLost { qp: peer });
            }
        }
        Ok(())
    }

    /// Breaks the connection of side `qp`: on that side the request `cause.0` completes with
    /// `cause.1` (or, without a cause, nothing special), on the peer the first outstanding
    /// request completes with `peer_cause`; everything else outstanding is flushed.
    fn fail_connection(
        &mut self,
        qp: usize,
        cause: Option<(u64, CompletionError)>,
        peer_cause: Option<CompletionError>,
    ) {
        self.flush_side(qp, cause);
        let peer = qp ^ 1;
        let peer_first = self.qps[peer].wrs.keys().next().copied();
        self.flush_side(peer, peer_cause.zip(peer_first).map(|(e, s)| (s, e)));
    }

    fn flush_side(&mut self, qp_index: usize, cause: Option<(u64, CompletionError)>) {
        if self.qps[qp_index].state == QpState::Ready {
            self.note(|f| {
                let first = cause.map_or(String::from("nothing"), |(seq, error)| {
                    format!("{} with {error:?}", f.describe_wr(qp_index, seq))
                });
                format!(
                    "qp{qp_index} enters error: {} outstanding, first {first}",
                    f.qps[qp_index].wrs.len()
                )
            });
        }
        let qp = &mut self.qps[qp_index];
        if qp.state != QpState::Ready {
            return;
        }
        qp.state = QpState::Error;
        let ep = qp.ep;
        let mut wrs = std::mem::take(&mut qp.wrs);
        qp.send_queue.clear();
        qp.recv_queue.clear();
        qp.pending_recvs = 0;
        if let Some((seq, error)) = cause {
            if let Some(wr) = wrs.remove(&seq) {
                qp.cq.push_back(CqEntry {
                    completion: Completion {
                        wr_id: wr.wr_id,
                        kind: wr.op.flushed_kind(),
                        status: Err(error),
                    },
                    payload: None,
                });
            }
        }
        for wr in wrs.into_values() {
            qp.cq.push_back(CqEntry {
                completion: Completion {
                    wr_id: wr.wr_id,
                    kind: wr.op.flushed_kind(),
                    status: Err(CompletionError::Flushed),
                },
                payload: None,
            });
        }
        if let Some(endpoint) = self.endpoints.get_mut(ep.index()) {
            endpoint.counters.qp_errors += 1;
        }
    }

    // ----- the event loop -----------------------------------------------------------------

    /// Runs the next event. Returns false when nothing is scheduled.
    pub fn step(&mut self) -> bool {
        let Some(((at, _), event)) = self.events.pop_first() else {
            return false;
        };
        self.now = self.now.max(at);
        self.steps += 1;
        self.note(|f| match event {
            Event::Execute { qp, seq } => format!("execute {}", f.describe_wr(qp, seq)),
            Event::ReadResponse { qp, seq } => format!("read response {}", f.describe_wr(qp, seq)),
            Event::Complete { qp, seq } => format!("complete {}", f.describe_wr(qp, seq)),
            Event::RecvActivate { qp, seq } => format!("activate {}", f.describe_wr(qp, seq)),
            Event::PeerLost { qp } => format!("qp{qp} peer lost"),
        });
        match event {
            Event::Execute { qp, seq } => self.execute(qp, seq),
            Event::ReadResponse { qp, seq } => self.read_response(qp, seq),
            Event::Complete { qp, seq } => self.complete(qp, seq),
            Event::RecvActivate { qp, seq } => self.activate_recv(qp, seq),
            Event::PeerLost { qp } => {
                let first = self.qps[qp].wrs.keys().next().copied();
                self.flush_side(qp, first.map(|seq| (seq, CompletionError::RetryExceeded)));
            }
        }
        true
    }

    fn peer_gone(&self, qp: usize) -> bool {
        let peer = &self.qps[qp ^ 1];
        peer.state == QpState::Closed || !self.is_alive(peer.ep)
    }

    fn schedule_peer_loss(&mut self, qp: usize) {
        if !self.qps[qp].peer_loss_scheduled {
            self.qps[qp].peer_loss_scheduled = true;
            let at = self
                .now
                .saturating_add(self.timing.peer_loss_detection_ticks);
            self.schedule(at, Event::PeerLost { qp });
        }
    }

    fn execute(&mut self, qp: usize, seq: u64) {
        if self.qps[qp].state != QpState::Ready || self.qps[qp].send_queue.front() != Some(&seq) {
            // Flushed, or waiting behind an earlier request (it is re-kicked when that one
            // leaves the head of the queue).
            return;
        }
        let Some(wr) = self.qps[qp].wrs.get(&seq) else {
            return;
        };
        if wr.due > self.now {
            // A stale duplicate wake-up while the request waits for its retry time.
            return;
        }
        if self.peer_gone(qp) {
            // Requests stall until the transport gives up on the vanished peer.
            self.schedule_peer_loss(qp);
            return;
        }
        if chance(&mut self.rng, self.faults.qp_error) {
            self.fail_connection(qp, Some((seq, CompletionError::RetryExceeded)), None);
            return;
        }
        let Some(wr) = self.qps[qp].wrs.get(&seq) else {
            return;
        };
        let reordered = wr.reordered;
        let outcome = match &wr.op {
            WrOp::Send { .. } => match self.deliver_send(qp, seq) {
                SendOutcome::Delivered => Ok(()),
                SendOutcome::Retrying => return,
                SendOutcome::Failed(error) => Err(error),
            },
            WrOp::Write { local, remote } => {
                let (local, remote) = (*local, *remote);
                self.rdma_write(qp, seq, local, remote)
            }
            WrOp::Read { .. } if reordered => {
                // No fence: the read's data is fetched late, after requests queued behind it
                // may already have arrived at the peer.
                let extra = self.gen_range_inclusive(1, self.faults.reorder_max_ticks.max(1));
                self.schedule(
                    self.now.saturating_add(extra),
                    Event::ReadResponse { qp, seq },
                );
                self.advance_send_queue(qp);
                return;
            }
            WrOp::Read { local, remote } => {
                let (local, remote) = (*local, *remote);
                self.rdma_read(qp, seq, local, remote)
            }
            WrOp::Recv { .. } => return,
        };
        match outcome {
            Ok(()) => {
                self.schedule_completion(qp, seq);
                self.advance_send_queue(qp);
            }
            Err(error) => self.fail_connection(qp, Some((seq, error)), None),
        }
    }

    /// The head of `qp`'s send queue left it: kick the next one if it is already due.
    fn advance_send_queue(&mut self, qp: usize) {
        let queue = &mut self.qps[qp];
        queue.send_queue.pop_front();
        let Some(&next) = queue.send_queue.front() else {
            return;
        };
        let due = queue.wrs.get(&next).map_or(self.now, |wr| wr.due);
        if due <= self.now {
            let now = self.now;
            self.schedule(now, Event::Execute { qp, seq: next });
        }
    }

    fn schedule_completion(&mut self, qp: usize, seq: u64) {
        let long_tail = if chance(&mut self.rng, self.faults.completion_delay) {
            self.long_tail(self.faults.completion_delay_max_ticks)
        } else {
            0
        };
        let reordered = self.qps[qp].wrs.get(&seq).is_some_and(|wr| wr.reordered);
        let at = if reordered {
            let extra = self.gen_range_inclusive(0, self.faults.reorder_max_ticks);
            self.now.saturating_add(long_tail).saturating_add(extra)
        } else {
            let queue = &mut self.qps[qp];
            let at = self
                .now
                .saturating_add(long_tail)
                .max(queue.last_completion);
            queue.last_completion = at;
            at
        };
        self.schedule(at, Event::Complete { qp, seq });
    }

    fn complete(&mut self, qp: usize, seq: u64) {
        let queue = &mut self.qps[qp];
        if queue.state != QpState::Ready {
            return;
        }
        let Some(wr) = queue.wrs.remove(&seq) else {
            return;
        };
        queue.cq.push_back(CqEntry {
            completion: Completion {
                wr_id: wr.wr_id,
                kind: wr.op.flushed_kind(),
                status: Ok(()),
            },
            payload: None,
        });
    }

    fn activate_recv(&mut self, qp: usize, seq: u64) {
        let queue = &mut self.qps[qp];
        if queue.state != QpState::Ready || !queue.wrs.contains_key(&seq) {
            return;
        }
        queue.pending_recvs = queue.pending_recvs.saturating_sub(1);
        queue.recv_queue.push_back(seq);
    }

    fn read_response(&mut self, qp: usize, seq: u64) {
        if self.qps[qp].state != QpState::Ready {
            return;
        }
        let Some(WrOp::Read { local, remote }) = self.qps[qp].wrs.get(&seq).map(|wr| &wr.op) else {
            return;
        };
        let (local, remote) = (*local, *remote);
        if self.peer_gone(qp) {
            self.schedule_peer_loss(qp);
            return;
        }
        match self.rdma_read(qp, seq, local, remote) {
            Ok(()) => self.schedule_completion(qp, seq),
            Err(error) => self.fail_connection(qp, Some((seq, error)), None),
        }
    }

    // ----- data movement ---------------------------------------------------------------------

    fn deliver_send(&mut self, qp: usize, seq: u64) -> SendOutcome {
        let peer = qp ^ 1;
        let Some(&recv_seq) = self.qps[peer].recv_queue.front() else {
            return self.receiver_not_ready(qp, seq);
        };
        let sender_ep = self.qps[qp].ep;
        let receiver_ep = self.qps[peer].ep;
        let message = match self.qps[qp].wrs.get_mut(&seq).map(|wr| &mut wr.op) {
            Some(WrOp::Send { message }) => std::mem::take(message),
            _ => return SendOutcome::Failed(CompletionError::Fatal),
        };
        let receiver = &mut self.qps[peer];
        if message.len() as u64 > u64::from(receiver.slots.slot_size) {
            // The receiver's slots are smaller than the message (mismatched SlotConfig): a
            // fatal error for the connection, as a local length error is on a real device.
            return SendOutcome::Failed(CompletionError::Fatal);
        }
        receiver.recv_queue.pop_front();
        let Some(recv) = receiver.wrs.remove(&recv_seq) else {
            return SendOutcome::Failed(CompletionError::Fatal);
        };
        let WrOp::Recv { slot } = recv.op else {
            return SendOutcome::Failed(CompletionError::Fatal);
        };
        let len = message.len() as u64;
        receiver.cq.push_back(CqEntry {
            completion: Completion {
                wr_id: recv.wr_id,
                kind: CompletionKind::Recv {
                    slot,
                    // Bounded by `slot_size: u32` (checked just above).
                    len: message.len() as u32,
                },
                status: Ok(()),
            },
            payload: Some(message),
        });
        let sender = &mut self.endpoints[sender_ep.index()].counters;
        sender.messages_sent += 1;
        sender.bytes_sent += len;
        let receiver = &mut self.endpoints[receiver_ep.index()].counters;
        receiver.messages_received += 1;
        receiver.bytes_received += len;
        SendOutcome::Delivered
    }

    fn receiver_not_ready(&mut self, qp: usize, seq: u64) -> SendOutcome {
        let limit = self.timing.rnr_retry_limit;
        let interval = self.timing.rnr_retry_interval_ticks;
        let ep = self.qps[qp].ep;
        let Some(wr) = self.qps[qp].wrs.get_mut(&seq) else {
            return SendOutcome::Failed(CompletionError::Fatal);
        };
        if wr.rnr_retries >= limit {
            self.endpoints[ep.index()].counters.rnr_failures += 1;
            return SendOutcome::Failed(CompletionError::ReceiverNotReady);
        }
        wr.rnr_retries += 1;
        let retry = wr.rnr_retries;
        let at = self.now.saturating_add(interval);
        wr.due = at;
        self.endpoints[ep.index()].counters.rnr_retries += 1;
        self.note(|_| format!("qp{qp} receiver not ready, retry {retry}"));
        self.schedule(at, Event::Execute { qp, seq });
        SendOutcome::Retrying
    }

    /// Checks that `segment` may be used locally by a request of endpoint `ep` with
    /// `needed` rights.
    fn check_local(&self, ep: EndpointId, segment: &LocalSegment, needed: Access) -> LocalCheck {
        let endpoint = &self.endpoints[ep.index()];
        let lkey = segment.lkey;
        let Some(reg) = endpoint.regs.get(&lkey.0) else {
            return Err(if endpoint.retired_lkeys.contains(&lkey.0) {
                ViolationKind::DeregisteredLocalKey { lkey }
            } else {
                ViolationKind::UnknownLocalKey { lkey }
            });
        };
        if !reg.range.contains(&segment.range) {
            return Err(ViolationKind::OutsideRegistration {
                lkey,
                registered: reg.range,
                used: segment.range,
            });
        }
        if !reg.access.contains(needed) {
            return Err(ViolationKind::MissingLocalRights {
                lkey,
                granted: reg.access,
                needed,
            });
        }
        if reg.memory_gone || endpoint.memory.first_unmapped(segment.range).is_some() {
            return Err(ViolationKind::RegisteredMemoryUnmapped {
                lkey,
                registered: reg.range,
            });
        }
        Ok(())
    }

    /// Checks the peer-side access of a request of `qp`: `Ok` when allowed, else counts the
    /// rejection and returns `RemoteAccess`.
    fn check_remote(
        &mut self,
        qp: usize,
        seq: u64,
        remote: &RemoteDescriptor,
        len: u64,
        needed: Access,
    ) -> Result<(), CompletionError> {
        let initiator = self.qps[qp].ep;
        let target = self.qps[qp ^ 1].ep;
        let endpoint = &self.endpoints[target.index()];
        let access = MemRange::new(remote.addr, len);
        let reg = endpoint
            .rkeys
            .get(&remote.rkey.0)
            .and_then(|lkey| endpoint.regs.get(lkey));
        let mut vanished = None;
        let (allowed, stale_key) = match reg {
            None => (false, endpoint.retired_rkeys.contains(&remote.rkey.0)),
            Some(reg) => {
                let in_bounds = reg.range.contains(&access);
                let rights = reg.access.contains(needed);
                let mapped = !reg.memory_gone && endpoint.memory.first_unmapped(access).is_none();
                if in_bounds && rights && !mapped {
                    vanished = Some(reg.range);
                }
                (in_bounds && rights && mapped, false)
            }
        };
        if allowed {
            return Ok(());
        }
        self.endpoints[target.index()].counters.accesses_rejected += 1;
        let counters = &mut self.endpoints[initiator.index()].counters;
        counters.remote_access_failures += 1;
        counters.stale_rkey_accesses += u64::from(stale_key);
        counters.vanished_memory_accesses += u64::from(vanished.is_some());
        if let Some(registered) = vanished {
            // The rkey is still live although its memory is gone: the target's cache was not
            // told (or did not deregister). Charged to the target, which owns the key.
            let lkey = self.endpoints[target.index()]
                .rkeys
                .get(&remote.rkey.0)
                .map_or(LocalKey(0), |&lkey| LocalKey(lkey));
            let wr_id = self.qps[qp].wrs.get(&seq).map(|wr| wr.wr_id);
            self.record_violation(Violation {
                tick: self.now,
                endpoint: target,
                conn: Some(ConnId((qp ^ 1) as u32)),
                wr_id,
                kind: ViolationKind::RemoteAccessToUnmappedMemory { lkey, registered },
            });
        }
        Err(CompletionError::RemoteAccess)
    }

    fn local_failure(&mut self, qp: usize, seq: u64, kind: ViolationKind) -> CompletionError {
        let wr_id = self.qps[qp].wrs.get(&seq).map(|wr| wr.wr_id);
        self.record_violation(Violation {
            tick: self.now,
            endpoint: self.qps[qp].ep,
            conn: Some(ConnId(qp as u32)),
            wr_id,
            kind,
        });
        CompletionError::LocalProtection
    }

    fn rdma_write(
        &mut self,
        qp: usize,
        seq: u64,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), CompletionError> {
        let initiator = self.qps[qp].ep;
        let target = self.qps[qp ^ 1].ep;
        if let Err(kind) = self.check_local(initiator, &local, Access::NONE) {
            return Err(self.local_failure(qp, seq, kind));
        }
        self.check_remote(qp, seq, &remote, local.range.len, Access::REMOTE_WRITE)?;
        let bytes = self.endpoints[initiator.index()]
            .memory
            .read(local.range)
            .map_err(|_| CompletionError::Fatal)?;
        self.endpoints[target.index()]
            .memory
            .write(remote.addr, &bytes)
            .map_err(|_| CompletionError::Fatal)?;
        let counters = &mut self.endpoints[initiator.index()].counters;
        counters.rdma_writes += 1;
        counters.bytes_rdma_written += local.range.len;
        Ok(())
    }

    fn rdma_read(
        &mut self,
        qp: usize,
        seq: u64,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), CompletionError> {
        let initiator = self.qps[qp].ep;
        let target = self.qps[qp ^ 1].ep;
        let mut needed = Access::LOCAL_WRITE;
        if self.qps[qp].caps.read_sink_needs_remote_write {
            needed |= Access::REMOTE_WRITE;
        }
        if let Err(kind) = self.check_local(initiator, &local, needed) {
            return Err(self.local_failure(qp, seq, kind));
        }
        self.check_remote(qp, seq, &remote, local.range.len, Access::REMOTE_READ)?;
        let bytes = self.endpoints[target.index()]
            .memory
            .read(MemRange::new(remote.addr, local.range.len))
            .map_err(|_| CompletionError::Fatal)?;
        self.endpoints[initiator.index()]
            .memory
            .write(local.range.addr, &bytes)
            .map_err(|_| CompletionError::Fatal)?;
        let counters = &mut self.endpoints[initiator.index()].counters;
        counters.rdma_reads += 1;
        counters.bytes_rdma_read += local.range.len;
        Ok(())
    }
}

enum SendOutcome {
    Delivered,
    Retrying,
    Failed(CompletionError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_tail_delays_stay_in_bounds_and_are_mostly_short() {
        let mut fabric = Fabric::new(1, FaultConfig::NONE, SimTiming::default());
        for max in [1, 2, 3, 1000, 1024] {
            let samples: Vec<u64> = (0..5_000).map(|_| fabric.long_tail(max)).collect();
            assert!(samples.iter().all(|&d| (1..=max).contains(&d)), "max {max}");
            assert!(
                samples.iter().any(|&d| d > max / 2),
                "the top octave of {max} never drawn"
            );
            let mut sorted = samples.clone();
            sorted.sort_unstable();
            let median = sorted[sorted.len() / 2];
            if max >= 1000 {
                assert!(
                    median <= max / 8,
                    "median {median} is not short for max {max}"
                );
            }
        }
    }

    #[test]
    fn timing_is_normalised_so_ranges_are_never_empty() {
        let timing = SimTiming {
            min_latency_ticks: 9,
            max_latency_ticks: 3,
            bytes_per_tick: 0,
            rnr_retry_interval_ticks: 0,
            ..SimTiming::default()
        };
        let mut fabric = Fabric::new(2, FaultConfig::NONE, timing);
        for _ in 0..100 {
            assert_eq!(fabric.placement_delay(1 << 20), 9 + (1 << 20));
        }
    }

    #[test]
    fn probabilities_outside_zero_one_are_clamped_and_nan_never_fires() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        assert!((0..100).all(|_| chance(&mut rng, 7.0)));
        assert!((0..100).all(|_| !chance(&mut rng, -1.0)));
        assert!((0..100).all(|_| !chance(&mut rng, f64::NAN)));
    }
}
