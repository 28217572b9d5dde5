//! One RC connection ([`SanConnection`]): queue pair, completion queue, slot pools, and the
//! adaptive spin-then-block wait.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::{ibv_wc, ibv_wc_status, rdma_cm_event_type};
use san_api::{
    Access, Completion, CompletionError, CompletionKind, LocalSegment, PostError, RecvSlot,
    RemoteDescriptor, SanConnection, SlotConfig, WrId,
};

use crate::cm::{self, CmId, EventChannel};
use crate::cq::CompletionQueue;
use crate::domain::{DomainShared, VerbsDomain};
use crate::qp::{QueuePair, SendOp};
use crate::slots::SlotPool;
use crate::sys::errno;
use crate::{ConnectParams, VerbsSetupError};

/// How long [`VerbsConnection::wait`] polls the CQ before arming the channel and blocking:
/// about one cross-core wake-up on the 2-vCPU machines this runs on, so a reply that is
/// already on its way is caught without a sleep, and an idle connection costs no CPU.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Empty polls between two (non-blocking) checks of the CM channel when not armed.
const CM_CHECK_INTERVAL: u32 = 64;
/// Completions fetched per `ibv_poll_cq` call.
const WC_BATCH: usize = 32;

// Work-request ids: the tag in the top 16 bits says which table the low bits index.
const TAG_SHIFT: u32 = 48;
const TAG_SEND: u64 = 1;
const TAG_RECV: u64 = 2;
const TAG_RDMA: u64 = 3;
/// A leading part of a split RDMA READ (unsignaled; its low bits index `rdma_ops`).
const TAG_RDMA_PART: u64 = 4;
/// Large RDMA READs are posted as parts of at least this size (at most [`MAX_READ_PARTS`]),
/// so that with the initiator depth we ask for, the peer's READ responses come in bounded
/// bursts (see `device::READS_IN_FLIGHT`).
const READ_PART: u64 = 256 * 1024;
/// Parts one RDMA READ is split into at most (the send queue is sized for them).
const MAX_READ_PARTS: u64 = 16;

fn encode_wr(tag: u64, index: u16) -> u64 {
    (tag << TAG_SHIFT) | u64::from(index)
}

/// What [`VerbsConnection::wait`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitOutcome {
    /// Completions are ready to poll.
    Ready,
    /// The connection went down (its outstanding work completes with errors; poll them).
    Disconnected,
    /// Nothing happened before the timeout.
    TimedOut,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RecvState {
    Idle,
    Posted(WrId),
    Holding(u32),
}

#[derive(Clone, Copy, Debug)]
struct RdmaOp {
    wr_id: WrId,
    read: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinkState {
    Connecting,
    Established,
    /// The QP is (being) moved to the error state; posts fail, work completes flushed.
    Down,
}

/// An RC queue pair with its pools ([`SanConnection`]).
pub struct VerbsConnection {
    // Field order is drop order, and it matters: the id destroys the QP (no DMA after
    // that), then the CQ goes (no QP uses it), then the pools are deregistered and
    // unmapped, then the channel and finally the domain (PD) reference.
    id: CmId,
    cq: CompletionQueue,
    send_pool: SlotPool,
    recv_pool: SlotPool,
    channel: Arc<EventChannel>,
    domain: Arc<DomainShared>,
    epoll: OwnedFd,
    qp: QueuePair,
    slots: SlotConfig,
    free_send: Vec<u16>,
    send_owner: Vec<Option<WrId>>,
    recv_state: Vec<RecvState>,
    rdma_ops: Vec<Option<RdmaOp>>,
    free_rdma: Vec<u16>,
    ready: VecDeque<Completion>,
    state: LinkState,
    armed: bool,
    /// A completion was polled while the CQ was armed: its notification fired, so the
    /// channel holds (or is about to hold) an event, and the CQ must be armed again.
    /// While armed and not fired, arming costs no system call (see [`Self::arm`]).
    fired: bool,
    /// The CQ is armed for solicited events only (see [`Self::arm_solicited`]).
    armed_solicited: bool,
    /// The send queue has room to post large RDMA READs in parts.
    split_reads: bool,
    empty_polls: u32,
    wc: Vec<ibv_wc>,
    spin: Duration,
    peer: Option<SocketAddr>,
}

// SAFETY: all verbs/rdma_cm objects inside may be used from any thread (libibverbs and
// librdmacm are thread-safe); the connection is used through `&mut self` only, and the
// shared domain state is behind a mutex.
unsafe impl Send for VerbsConnection {}

impl VerbsConnection {
    /// Connects to a listener at `remote` (rdma_cm active side). Returns the connection
    /// and the listener's reply blob.
    ///
    /// # Errors
    /// `InvalidArgument` for bad slot sizes or a blob over 55 bytes; `Unreachable` when
    /// address or route resolution fails; `WrongDevice` when the route leaves through
    /// another device than `domain`'s; `Rejected` when the peer has no listener or
    /// declines; `TimedOut`; `Os` for failed verbs calls.
    pub fn connect(
        domain: &VerbsDomain,
        remote: SocketAddr,
        params: &ConnectParams<'_>,
    ) -> Result<(Self, Vec<u8>), VerbsSetupError> {
        let frame = cm::encode_blob(params.private_data)?;
        validate_slots(domain, params)?;
        let deadline = cm::deadline_after(params.timeout);
        let timeout_ms = i32::try_from(params.timeout.as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        let (channel, id) = resolve_address(remote, params.local, deadline)?;
        // SAFETY: live id with a resolved address.
        if unsafe { rdma_sys::rdma_resolve_route(id.as_ptr(), timeout_ms) } != 0 {
            return Err(map_resolve_errno(errno()));
        }
        cm::expect_event(
            &id,
            rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
            deadline,
        )?;
        id.set_ack_timeout();
        let mut connection = Self::build(domain, id, channel, params)?;
        connection.peer = Some(remote);
        let device = &domain.shared.pd.device;
        let mut param = cm::conn_param(
            &frame,
            device.max_responder_resources,
            device.max_initiator_depth,
        );
        // SAFETY: live id with a QP; `param` points at `frame`, which outlives the call.
        if unsafe { rdma_sys::rdma_connect(connection.id.as_ptr(), &mut param) } != 0 {
            return Err(VerbsSetupError::Os(errno()));
        }
        let established = cm::expect_event(
            &connection.id,
            rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            deadline,
        )?;
        connection.state = LinkState::Established;
        Ok((connection, established.blob))
    }

    /// Sets up CQ, QP and pools on `id` (bound to a device), and pre-posts receives.
    pub(crate) fn build(
        domain: &VerbsDomain,
        id: CmId,
        channel: Arc<EventChannel>,
        params: &ConnectParams<'_>,
    ) -> Result<Self, VerbsSetupError> {
        validate_slots(domain, params)?;
        let shared = domain.shared.clone();
        let device = &shared.pd.device;
        if id.context() != Some(device.context) {
            return Err(VerbsSetupError::WrongDevice);
        }
        let slots = params.slots;
        let plain_depth = u32::from(slots.send_slots) + u32::from(params.rdma_depth);
        // Room for every RDMA op to be a READ split into parts, if the device has it.
        let parts_depth = u32::from(params.rdma_depth) * (MAX_READ_PARTS as u32 - 1);
        let split_reads = plain_depth + parts_depth <= device.max_qp_wr;
        let send_depth = plain_depth + if split_reads { parts_depth } else { 0 };
        let recv_depth = u32::from(slots.recv_slots);
        let cq = CompletionQueue::create(device, send_depth + recv_depth)?;
        // Rebound after the CQ so that, should a later step fail, the id (and its QP)
        // is dropped before the CQ the QP uses (locals drop in reverse order).
        let mut id = id;
        let qp = id.create_qp(&shared.pd, cq.as_ptr(), send_depth, recv_depth)?;
        let pool_error = |_| VerbsSetupError::Os(libc::ENOMEM);
        let send_pool = SlotPool::new(&shared.pd, slots.send_slots, slots.slot_size, Access::NONE)
            .map_err(pool_error)?;
        let recv_pool = SlotPool::new(
            &shared.pd,
            slots.recv_slots,
            slots.slot_size,
            Access::LOCAL_WRITE,
        )
        .map_err(pool_error)?;
        let epoll = new_epoll(&[cq.fd(), channel.fd()])?;
        let mut connection = Self {
            id,
            cq,
            send_pool,
            recv_pool,
            channel,
            domain: shared,
            epoll,
            qp,
            slots,
            free_send: (0..slots.send_slots).rev().collect(),
            send_owner: vec![None; usize::from(slots.send_slots)],
            recv_state: vec![RecvState::Idle; usize::from(slots.recv_slots)],
            rdma_ops: vec![None; usize::from(params.rdma_depth)],
            free_rdma: (0..params.rdma_depth).rev().collect(),
            ready: VecDeque::new(),
            state: LinkState::Connecting,
            armed: false,
            fired: false,
            armed_solicited: false,
            split_reads,
            empty_polls: 0,
            wc: (0..WC_BATCH).map(|_| zeroed_wc()).collect(),
            spin: DEFAULT_SPIN,
            peer: None,
        };
        if params.pre_post_receives {
            for slot in 0..slots.recv_slots {
                connection
                    .post_recv_slot(WrId(u64::from(slot)), slot)
                    .map_err(|_| VerbsSetupError::Internal)?;
            }
        }
        Ok(connection)
    }

    /// Waits up to `timeout` for the connection to be established (a connection accepted
    /// with [`crate::IncomingRequest::accept_started`]; at once for any other).
    ///
    /// # Errors
    /// `TimedOut`; `Rejected`, `Unreachable` or `ConnectFailed` when the handshake failed or
    /// the peer went away first (the connection is then down).
    pub fn wait_established(&mut self, timeout: Duration) -> Result<(), VerbsSetupError> {
        self.establish_until(cm::deadline_after(timeout))
    }

    /// [`Self::wait_established`] until `deadline`.
    pub(crate) fn establish_until(&mut self, deadline: Instant) -> Result<(), VerbsSetupError> {
        loop {
            match self.state {
                LinkState::Established => return Ok(()),
                LinkState::Down => return Err(VerbsSetupError::ConnectFailed),
                LinkState::Connecting => {}
            }
            let event = self.channel.next_until(Some(deadline))?;
            match event.kind {
                rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED if event.status == 0 => {
                    self.state = LinkState::Established;
                }
                rdma_cm_event_type::RDMA_CM_EVENT_ADDR_CHANGE
                | rdma_cm_event_type::RDMA_CM_EVENT_TIMEWAIT_EXIT => {}
                _ => {
                    self.go_down();
                    return Err(cm::setup_failure(&event));
                }
            }
        }
    }

    pub(crate) fn id(&self) -> &CmId {
        &self.id
    }

    /// The peer's address, when known (active side).
    pub fn peer(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// True once the connection went down (peer disconnected, QP error).
    pub fn is_down(&self) -> bool {
        self.state == LinkState::Down
    }

    /// Sets how long [`Self::wait`] polls before blocking (zero: block at once).
    pub fn set_spin(&mut self, spin: Duration) {
        self.spin = spin;
    }

    /// A pollable fd: readable when the armed CQ got a completion or a connection event
    /// (disconnect) arrived. Arm with [`Self::arm`] before blocking on it.
    pub fn fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }

    /// Arms the completion channel. Returns `false` when completions are already pending
    /// (poll them instead of blocking).
    pub fn arm(&mut self) -> bool {
        self.arm_for(false)
    }

    /// As [`Self::arm`], but the event is raised only by the peer's next message (every
    /// message we send is solicited) or a failed completion, not by the completion of our
    /// own sends: a caller waiting for the peer sleeps through the acknowledgements of what
    /// it just sent (each an extra wake-up per message otherwise). Only for callers whose
    /// progress does not depend on their own completions (no RDMA operation in flight, send
    /// slots to spare). A later [`Self::arm`] asks for every completion again.
    ///
    /// On iWARP this is [`Self::arm`]: siw raises the solicited event for the sender's own
    /// completion of a solicited send too, so the mode would spare nothing there.
    pub fn arm_solicited(&mut self) -> bool {
        let solicited_only = self.spares_own_sends();
        self.arm_for(solicited_only)
    }

    /// Whether [`Self::arm_solicited`] sleeps through our own send completions on this
    /// device (not on iWARP, see there).
    pub fn spares_own_sends(&self) -> bool {
        !self.domain.pd.device.iwarp
    }

    fn arm_for(&mut self, solicited_only: bool) -> bool {
        // Armed for every completion serves a solicited-only caller too (extra events at
        // worst); armed for solicited ones only, a caller that wants all must re-arm.
        let armed_enough = self.armed && (solicited_only || !self.armed_solicited);
        if armed_enough && !self.fired {
            // Armed, and nothing polled since: the notification has not fired for anything
            // we saw, so it is still requested. A completion that came meanwhile is found
            // here (and marks it fired). No system call: arming runs after every drive, and
            // under emulation each call costs tens of microseconds. Connection events are
            // not looked at here: one makes `fd` readable, and whoever wakes on it collects
            // them (`wait`).
            return self.ready.is_empty() && self.drain_cq() == 0 && !self.fired;
        }
        // The CQ's notification is one-shot: once it fired it must be requested again, and
        // its event consumed (and acknowledged). Without that, a caller that drained the
        // completions without blocking (`poll_completions` found some) would keep `armed`
        // set over a disarmed CQ, and the next completion would raise no event: an
        // edge-triggered watcher of `fd` then never wakes. (An event not delivered yet is
        // consumed by a later call; until then it makes `fd` spuriously readable once.)
        // Only a fired notification left an event to consume (a caller that woke on `fd`
        // consumed its event in `wait` already); a stray one (a late event, a second
        // arm's) makes `fd` readable once and is consumed by whoever wakes on it.
        if self.fired {
            self.cq.consume_one_event();
            self.armed = false;
            self.fired = false;
        }
        // Connection events are collected by whoever wakes on `fd` (`wait`), and every 64
        // empty polls: not here, after every drive (a failing system call each time).
        if !self.ready.is_empty() || self.drain_cq() > 0 {
            return false;
        }
        if !self.armed || (self.armed_solicited && !solicited_only) {
            if self.cq.arm(solicited_only).is_err() {
                // Cannot arm: make the caller poll rather than sleep forever.
                return false;
            }
            self.armed = true;
            self.armed_solicited = solicited_only;
        }
        // A completion that arrived between the drain and the arm raises no event: look
        // once more now that the CQ is armed.
        self.drain_cq() == 0
    }

    /// Consumes the channel event that an armed notification raised (or is raising: the
    /// completion can be polled before the kernel has queued its event), waiting up to
    /// `timeout` for it; the CQ is then disarmed. Returns at once when no notification fired
    /// (nothing polled since the arm raised one). For a caller that polled a completion which
    /// fired the notification and wants its event gone before anyone else watches [`Self::fd`]
    /// (a watcher resumed on a readable fd would be woken for it). False: no event came.
    pub fn take_event(&mut self, timeout: Duration) -> bool {
        if !(self.armed && self.fired) {
            // No notification fired since the last arm: no event is owed, none is waited for.
            return false;
        }
        let mut taken = self.cq.consume_one_event();
        if !taken && !timeout.is_zero() {
            let ms = i32::try_from(timeout.as_millis().max(1)).unwrap_or(i32::MAX);
            taken =
                cm::wait_readable(self.cq.fd(), ms).unwrap_or(false) && self.cq.consume_one_event();
        }
        if taken {
            self.armed = false;
            self.fired = false;
        }
        taken
    }

    /// Handles queued connection events (non-blocking); a disconnect moves the QP to the
    /// error state so every outstanding work request completes (flushed).
    pub fn process_events(&mut self) {
        loop {
            match self.channel.try_next() {
                Ok(Some(event)) => match event.kind {
                    rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
                    | rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL
                    | rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR
                    | rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE
                    | rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => self.go_down(),
                    rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED
                        if self.state == LinkState::Connecting =>
                    {
                        self.state = LinkState::Established;
                    }
                    // TIMEWAIT_EXIT and address changes need no action.
                    _ => {}
                },
                Ok(None) => return,
                Err(_) => {
                    self.go_down();
                    return;
                }
            }
        }
    }

    /// Waits until completions are ready, the connection went down, or `timeout` passed
    /// (`None`: no limit). Polls the CQ for the spin budget first, then arms the channel
    /// and sleeps in the kernel, so an idle connection uses no CPU.
    pub fn wait(&mut self, timeout: Option<Duration>) -> WaitOutcome {
        // A caller that woke on our fd may find its completions already ready and return
        // below without blocking: consume the channel's event first, or the fd stays
        // readable (a level-triggered waiter spins; a watch resumed on it reports the same
        // event again). The next `arm` requests the next one.
        if self.cq.consume_one_event() {
            self.armed = false;
            self.fired = false;
        }
        if timeout == Some(Duration::ZERO) {
            // A non-blocking look (the service thread's collection): no clock reads.
            if !self.ready.is_empty() || self.drain_cq() > 0 {
                return WaitOutcome::Ready;
            }
            let was_down = self.is_down();
            self.process_events();
            if self.is_down() && (!was_down || !self.has_outstanding_work()) {
                return WaitOutcome::Disconnected;
            }
            return if self.arm() {
                WaitOutcome::TimedOut
            } else {
                WaitOutcome::Ready
            };
        }
        let start = Instant::now();
        let deadline = timeout.map(|t| {
            start
                .checked_add(t)
                .unwrap_or(start + Duration::from_secs(86_400))
        });
        let was_down = self.is_down();
        let spin_until = start + timeout.map_or(self.spin, |t| t.min(self.spin));
        loop {
            if !self.ready.is_empty() || self.drain_cq() > 0 {
                return WaitOutcome::Ready;
            }
            if Instant::now() >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        loop {
            self.process_events();
            // Report the transition once; afterwards keep waiting only while flushed
            // completions are still due (with nothing outstanding, nothing will come).
            if self.is_down() && (!was_down || !self.has_outstanding_work()) {
                return WaitOutcome::Disconnected;
            }
            if !self.arm() {
                return WaitOutcome::Ready;
            }
            let timeout_ms = match deadline {
                None => -1,
                Some(deadline) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return WaitOutcome::TimedOut;
                    }
                    i32::try_from(left.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
                }
            };
            // Blocks in the kernel on the epoll set (completion channel + CM channel).
            if cm::wait_readable(self.epoll.as_raw_fd(), timeout_ms).is_err() {
                return WaitOutcome::Ready;
            }
            if self.cq.consume_events() > 0 {
                self.armed = false;
                self.fired = false;
            }
        }
    }

    /// True while some posted work request has not completed yet.
    fn has_outstanding_work(&self) -> bool {
        self.send_owner.iter().any(Option::is_some)
            || self.rdma_ops.iter().any(Option::is_some)
            || self
                .recv_state
                .iter()
                .any(|state| matches!(state, RecvState::Posted(_)))
    }

    fn go_down(&mut self) {
        if self.state == LinkState::Down {
            return;
        }
        self.state = LinkState::Down;
        // rdma_disconnect moves the QP to the error state (flushing every outstanding work
        // request) and tells the peer; if it fails, force the error state ourselves.
        // SAFETY: live id.
        if unsafe { rdma_sys::rdma_disconnect(self.id.as_ptr()) } != 0 {
            // SAFETY: the QP lives as long as `self.id`.
            let _ = unsafe { self.qp.set_error() };
        }
    }

    /// Polls the CQ into `ready`; returns how many completions were added.
    fn drain_cq(&mut self) -> usize {
        let mut added = 0;
        loop {
            let Ok(got) = self.cq.poll(&mut self.wc) else {
                self.go_down();
                return added;
            };
            if got > 0 && self.armed && !self.armed_solicited {
                self.fired = true;
            }
            for index in 0..got {
                let wc = &self.wc[index];
                let (wr_id, status, byte_len) = (wc.wr_id, wc.status, wc.byte_len);
                // Armed for solicited events only: a message received (all are solicited)
                // or a failure fired the notification; our own sends did not.
                if self.armed
                    && self.armed_solicited
                    && (wr_id >> TAG_SHIFT == TAG_RECV || status != ibv_wc_status::IBV_WC_SUCCESS)
                {
                    self.fired = true;
                }
                if let Some(completion) = self.complete(wr_id, status, byte_len) {
                    self.ready.push_back(completion);
                    added += 1;
                }
            }
            if got < self.wc.len() {
                return added;
            }
        }
    }

    /// Turns a work completion into the caller's completion, releasing its slot.
    fn complete(
        &mut self,
        wr_id: u64,
        status: ibv_wc_status::Type,
        byte_len: u32,
    ) -> Option<Completion> {
        let status = completion_status(status);
        if status.is_err() {
            // An RC QP is in the error state after any failed completion.
            self.go_down();
        }
        let index = u16::try_from(wr_id & 0xffff).ok()?;
        match wr_id >> TAG_SHIFT {
            TAG_SEND => {
                let wr_id = self.send_owner.get_mut(usize::from(index))?.take()?;
                self.free_send.push(index);
                Some(Completion {
                    wr_id,
                    kind: CompletionKind::Send,
                    status,
                })
            }
            TAG_RECV => {
                let state = self.recv_state.get_mut(usize::from(index))?;
                let RecvState::Posted(wr_id) = *state else {
                    return None;
                };
                let len = if status.is_ok() {
                    byte_len.min(self.recv_pool.size())
                } else {
                    0
                };
                *state = if status.is_ok() {
                    RecvState::Holding(len)
                } else {
                    RecvState::Idle
                };
                Some(Completion {
                    wr_id,
                    kind: CompletionKind::Recv {
                        slot: RecvSlot(index),
                        len,
                    },
                    status,
                })
            }
            // A leading part completes only when it failed: the READ failed (the QP is
            // in error, so the op's own completion, flushed later, finds it taken).
            TAG_RDMA_PART if status.is_ok() => None,
            TAG_RDMA | TAG_RDMA_PART => {
                let op = self.rdma_ops.get_mut(usize::from(index))?.take()?;
                self.free_rdma.push(index);
                let kind = if op.read {
                    CompletionKind::Read
                } else {
                    CompletionKind::Write
                };
                Some(Completion {
                    wr_id: op.wr_id,
                    kind,
                    status,
                })
            }
            _ => None,
        }
    }

    fn check_up(&self) -> Result<(), PostError> {
        match self.state {
            LinkState::Down => Err(PostError::Disconnected),
            LinkState::Connecting | LinkState::Established => Ok(()),
        }
    }

    fn post_recv_slot(&mut self, wr_id: WrId, slot: u16) -> Result<(), PostError> {
        self.check_up()?;
        let state = self
            .recv_state
            .get(usize::from(slot))
            .ok_or(PostError::InvalidArgument)?;
        if matches!(state, RecvState::Posted(_)) {
            return Err(PostError::QueueFull);
        }
        let sge = self
            .recv_pool
            .sge(slot, self.recv_pool.size())
            .ok_or(PostError::InvalidArgument)?;
        // SAFETY: the QP lives as long as `self.id`; the slot's buffer belongs to the recv
        // pool, which outlives the QP (drop order), and is marked posted below, so nothing
        // reads it (`recv_slot` returns empty) until its completion is polled.
        unsafe { self.qp.post_recv(encode_wr(TAG_RECV, slot), sge) }
            .map_err(|_| PostError::Disconnected)?;
        self.recv_state[usize::from(slot)] = RecvState::Posted(wr_id);
        Ok(())
    }

    fn post_rdma(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
        read: bool,
    ) -> Result<(), PostError> {
        self.check_up()?;
        let caps = self.domain.pd.device.capabilities;
        let len = local.range.len;
        let malformed = len == 0
            || local.range.addr.checked_add(len).is_none()
            || remote.addr.checked_add(remote.len).is_none()
            || remote.len < len
            || len > caps.max_rdma_len
            || (read && !caps.rdma_read);
        if malformed {
            return Err(PostError::InvalidArgument);
        }
        let length = u32::try_from(len).map_err(|_| PostError::InvalidArgument)?;
        // Validate the local key in Rust: an unknown key, a range outside it, or a read
        // into memory without local write completes with a local protection error
        // without reaching the device.
        let resolved = self.domain.resolve(local.lkey).filter(|key| {
            key.range.contains(&local.range) && (!read || key.access.contains(Access::LOCAL_WRITE))
        });
        let Some(resolved) = resolved else {
            let kind = if read {
                CompletionKind::Read
            } else {
                CompletionKind::Write
            };
            self.ready.push_back(Completion {
                wr_id,
                kind,
                status: Err(CompletionError::LocalProtection),
            });
            return Ok(());
        };
        let index = self.free_rdma.pop().ok_or(PostError::QueueFull)?;
        let sge = rdma_sys::ibv_sge {
            addr: local.range.addr,
            length,
            lkey: resolved.hardware_lkey,
        };
        let op = if read {
            SendOp::Read {
                remote_addr: remote.addr,
                rkey: remote.rkey.0,
            }
        } else {
            SendOp::Write {
                remote_addr: remote.addr,
                rkey: remote.rkey.0,
            }
        };
        // A large READ goes in parts; only the last is signaled (the queue executes them in
        // order, so its completion is the whole READ's).
        let part = if read && self.split_reads {
            READ_PART.max(len.div_ceil(MAX_READ_PARTS))
        } else {
            len
        };
        let mut offset = 0u64;
        while len - offset > part {
            let piece = SendOp::Read {
                remote_addr: remote.addr + offset,
                rkey: remote.rkey.0,
            };
            let piece_sge = rdma_sys::ibv_sge {
                addr: local.range.addr + offset,
                // `part` < `len`, which fits in u32.
                length: part as u32,
                lkey: resolved.hardware_lkey,
            };
            // SAFETY: as for the whole request below (a sub-range of the same ranges).
            let posted = unsafe {
                self.qp
                    .post_send(encode_wr(TAG_RDMA_PART, index), piece, piece_sge, false)
            };
            if posted.is_err() && offset == 0 {
                self.free_rdma.push(index);
                return Err(PostError::Disconnected);
            }
            if posted.is_err() {
                // Parts already posted cannot be taken back: the connection cannot go on.
                // Its flushed parts complete with errors, the first reporting the op.
                self.go_down();
                self.rdma_ops[usize::from(index)] = Some(RdmaOp { wr_id, read });
                return Ok(());
            }
            offset += part;
        }
        let (op, sge) = match op {
            SendOp::Read { remote_addr, rkey } if offset > 0 => (
                SendOp::Read {
                    remote_addr: remote_addr + offset,
                    rkey,
                },
                rdma_sys::ibv_sge {
                    addr: sge.addr + offset,
                    length: (len - offset) as u32,
                    lkey: sge.lkey,
                },
            ),
            other => (other, sge),
        };
        // SAFETY: the QP lives as long as `self.id`. The local range lies inside a live
        // registration (checked above), which pins it; if the caller deregisters it before
        // the completion, the device fails the request instead of touching the pages.
        match unsafe { self.qp.post_send(encode_wr(TAG_RDMA, index), op, sge, true) } {
            Ok(()) => {
                self.rdma_ops[usize::from(index)] = Some(RdmaOp { wr_id, read });
                Ok(())
            }
            Err(_) => {
                self.free_rdma.push(index);
                Err(PostError::Disconnected)
            }
        }
    }
}

impl SanConnection for VerbsConnection {
    fn slot_config(&self) -> SlotConfig {
        self.slots
    }

    fn post_send(&mut self, wr_id: WrId, message: &[u8]) -> Result<(), PostError> {
        self.check_up()?;
        let len = u32::try_from(message.len()).map_err(|_| PostError::TooLong)?;
        if len > self.send_pool.size() {
            return Err(PostError::TooLong);
        }
        let slot = self.free_send.pop().ok_or(PostError::QueueFull)?;
        let sge = match self.send_pool.sge(slot, len) {
            Some(sge) if self.send_pool.fill(slot, message) => sge,
            _ => {
                self.free_send.push(slot);
                return Err(PostError::InvalidArgument);
            }
        };
        // SAFETY: the QP lives as long as `self.id`; the slot is ours (taken from the free
        // list, returned only by its completion) and the pool outlives the QP.
        match unsafe {
            self.qp
                .post_send(encode_wr(TAG_SEND, slot), SendOp::Send, sge, true)
        } {
            Ok(()) => {
                self.send_owner[usize::from(slot)] = Some(wr_id);
                Ok(())
            }
            Err(_) => {
                self.free_send.push(slot);
                Err(PostError::Disconnected)
            }
        }
    }

    fn post_recv(&mut self, wr_id: WrId, slot: RecvSlot) -> Result<(), PostError> {
        self.post_recv_slot(wr_id, slot.0)
    }

    fn recv_slot(&self, slot: RecvSlot, len: u32) -> &[u8] {
        match self.recv_state.get(usize::from(slot.0)) {
            Some(RecvState::Holding(held)) => self.recv_pool.bytes(slot.0, len.min(*held)),
            _ => &[],
        }
    }

    fn post_write(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.post_rdma(wr_id, local, remote, false)
    }

    fn post_read(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.post_rdma(wr_id, local, remote, true)
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.poll_each(max, |completion| out.push(completion))
    }
}

impl VerbsConnection {
    /// [`SanConnection::poll_completions`], handing each completion to `each` (the C ABI
    /// writes them straight into the caller's array: no allocation per poll).
    pub fn poll_each(&mut self, max: usize, mut each: impl FnMut(Completion)) -> usize {
        if self.ready.len() < max {
            self.drain_cq();
        }
        if self.ready.is_empty() {
            self.empty_polls += 1;
            if self.empty_polls >= CM_CHECK_INTERVAL {
                // A caller that only polls learns of a disconnect this way. (An event-driven
                // caller that woke on our fd consumes its events in `wait` or `arm`: that
                // costs no system call on every empty poll.)
                self.empty_polls = 0;
                self.process_events();
                self.drain_cq();
            }
        } else {
            self.empty_polls = 0;
        }
        let take = max.min(self.ready.len());
        for completion in self.ready.drain(..take) {
            each(completion);
        }
        take
    }
}

impl Drop for VerbsConnection {
    fn drop(&mut self) {
        // Disconnect (QP to error, peer told); then the fields drop in the order
        // documented on the struct: QP and id, CQ, pools, channel, domain.
        if self.state != LinkState::Down {
            // SAFETY: live id.
            unsafe { rdma_sys::rdma_disconnect(self.id.as_ptr()) };
        }
        self.cq.consume_events();
    }
}

/// Per-attempt bound on address resolution. The kernel re-checks an unresolved neighbour
/// only when the attempt's timeout expires (or on a neighbour-update event that policy
/// routing can hide), so one long attempt can sit idle for most of its timeout; short
/// attempts, retried until the caller's deadline, resolve as soon as ARP has answered.
const RESOLVE_ATTEMPT: Duration = Duration::from_millis(500);

/// Resolves `remote` (from `local`, if given) on a fresh id, retrying short attempts until
/// `deadline`. Returns the channel and the id with a resolved address.
fn resolve_address(
    remote: SocketAddr,
    local: Option<SocketAddr>,
    deadline: Instant,
) -> Result<(Arc<EventChannel>, CmId), VerbsSetupError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(VerbsSetupError::TimedOut);
        }
        let attempt_ms = i32::try_from(left.min(RESOLVE_ATTEMPT).as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        let channel = EventChannel::new()?;
        let id = CmId::new(&channel)?;
        let (mut dst, _) = cm::sockaddr(remote);
        let mut src = local.map(|local| cm::sockaddr(local).0);
        let src_ptr = src.as_mut().map_or(std::ptr::null_mut(), |s| {
            (s as *mut libc::sockaddr_storage).cast()
        });
        // SAFETY: live id; `dst` (and `src` when given) are valid sockaddrs that outlive
        // the call (rdma_cm copies them).
        if unsafe {
            rdma_sys::rdma_resolve_addr(
                id.as_ptr(),
                src_ptr,
                (&mut dst as *mut libc::sockaddr_storage).cast(),
                attempt_ms,
            )
        } != 0
        {
            return Err(map_resolve_errno(errno()));
        }
        match cm::expect_event(
            &id,
            rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            deadline,
        ) {
            Ok(_) => return Ok((channel, id)),
            // A timed-out attempt is retried with a fresh id while time is left.
            Err(VerbsSetupError::Unreachable) => continue,
            Err(other) => return Err(other),
        }
    }
}

fn validate_slots(domain: &VerbsDomain, params: &ConnectParams<'_>) -> Result<(), VerbsSetupError> {
    let caps = domain.shared.pd.device.capabilities;
    let slots = params.slots;
    let ok = slots.send_slots > 0
        && slots.recv_slots > 0
        && slots.slot_size > 0
        && slots.slot_size <= caps.max_slot_size
        && slots.send_slots <= caps.max_slots
        && slots.recv_slots <= caps.max_slots
        && params.rdma_depth <= caps.max_slots
        && params.private_data.len() <= san_verbs_loader::abi::MAX_PRIVATE_DATA;
    if ok {
        Ok(())
    } else {
        Err(VerbsSetupError::InvalidArgument)
    }
}

fn zeroed_wc() -> ibv_wc {
    // SAFETY: ibv_wc is plain data (integers and a union of integers); all-zero is valid.
    unsafe { std::mem::zeroed() }
}

fn map_resolve_errno(errno: i32) -> VerbsSetupError {
    match errno {
        libc::EADDRNOTAVAIL | libc::ENODEV | libc::ENETUNREACH | libc::EHOSTUNREACH => {
            VerbsSetupError::Unreachable
        }
        other => VerbsSetupError::Os(other),
    }
}

fn completion_status(status: ibv_wc_status::Type) -> Result<(), CompletionError> {
    match status {
        ibv_wc_status::IBV_WC_SUCCESS => Ok(()),
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => Err(CompletionError::Flushed),
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR | ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => {
            Err(CompletionError::RemoteAccess)
        }
        ibv_wc_status::IBV_WC_LOC_PROT_ERR | ibv_wc_status::IBV_WC_LOC_ACCESS_ERR => {
            Err(CompletionError::LocalProtection)
        }
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => Err(CompletionError::ReceiverNotReady),
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => Err(CompletionError::RetryExceeded),
        _ => Err(CompletionError::Fatal),
    }
}

/// An epoll set watching `fds` for input.
fn new_epoll(fds: &[RawFd]) -> Result<OwnedFd, VerbsSetupError> {
    // SAFETY: no pointer arguments.
    let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if raw < 0 {
        return Err(VerbsSetupError::Os(errno()));
    }
    // SAFETY: `raw` is a fresh fd we own.
    let epoll = unsafe { OwnedFd::from_raw_fd(raw) };
    for &fd in fds {
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: valid epoll fd, valid fd, valid event struct.
        if unsafe { libc::epoll_ctl(raw, libc::EPOLL_CTL_ADD, fd, &mut event) } < 0 {
            return Err(VerbsSetupError::Os(errno()));
        }
    }
    Ok(epoll)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_statuses_map_to_the_contract_errors() {
        assert_eq!(completion_status(ibv_wc_status::IBV_WC_SUCCESS), Ok(()));
        assert_eq!(
            completion_status(ibv_wc_status::IBV_WC_WR_FLUSH_ERR),
            Err(CompletionError::Flushed)
        );
        assert_eq!(
            completion_status(ibv_wc_status::IBV_WC_REM_ACCESS_ERR),
            Err(CompletionError::RemoteAccess)
        );
        assert_eq!(
            completion_status(ibv_wc_status::IBV_WC_LOC_PROT_ERR),
            Err(CompletionError::LocalProtection)
        );
        assert_eq!(
            completion_status(ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR),
            Err(CompletionError::ReceiverNotReady)
        );
        assert_eq!(
            completion_status(ibv_wc_status::IBV_WC_RETRY_EXC_ERR),
            Err(CompletionError::RetryExceeded)
        );
        assert_eq!(
            completion_status(ibv_wc_status::IBV_WC_FATAL_ERR),
            Err(CompletionError::Fatal)
        );
    }

    #[test]
    fn work_request_ids_keep_tag_and_index_apart() {
        let id = encode_wr(TAG_RECV, u16::MAX);
        assert_eq!(id >> TAG_SHIFT, TAG_RECV);
        assert_eq!(id & 0xffff, u64::from(u16::MAX));
    }
}
