//! # The session protocol (sans-IO)
//!
//! One [`Session`] per connected socket carried over a SAN connection. The session never
//! performs I/O, never reads a clock and never touches memory by address: the caller feeds
//! inputs (`handle_*`) and application calls (`send`, `recv`, …), and drains outputs
//! (`poll_*`), in the style of quinn-proto. The wire format is in [`crate::wire`] and
//! `docs/PROTOCOL.md`; [`drive`] is the generic pump that connects a session to a
//! [`san_api::SanConnection`].
//!
//! ## Poll order
//! After every input or application call, the caller drains, in this order:
//! 1. [`Session::poll_op`] until `None`, posting each op (receive re-posts, RDMA reads and
//!    writes) and forwarding [`Op::Release`] to the registration cache. Ops come first
//!    because a credit is only returned for a receive slot whose re-post op was polled;
//! 2. [`Session::poll_transmit`] until `None`, posting each message with `post_send`;
//! 3. [`Session::poll_event`] until `None`, delivering events to the application.
//!
//! [`drive`] does exactly this, plus completion polling.
//!
//! ## Driver obligations
//! * Run the pump once before the peer can send: the first ops post every receive slot.
//! * Keep a registration alive until the session emits [`Op::Release`] for it, even after
//!   the send or receive using it completed with an error: a posted RDMA operation may still
//!   touch it until its completion (flush) arrives. When the cache invalidates a range,
//!   call [`Session::handle_invalidated`] for every affected handle, and defer the
//!   deregistration of those for which [`Session::handle_in_posted_op`] holds.
//! * The session never times out (it reads no clock): a driver that gives up on a peer
//!   calls `close(true)`, also after a graceful `close(false)`.
//!
//! ## Streams
//! The application sees a byte stream with Linux TCP semantics: inline data is copied in by
//! [`Session::send`] (bounded by [`SessionConfig::send_buffer`]) and out by [`Session::recv`];
//! large sends use [`Session::send_rendezvous`] (zero-copy from a registered buffer) and the
//! receiver gets them with [`Session::post_recv`] (zero-copy into a registered buffer) when
//! `recv` reports [`RecvError::RemoteSegment`]. Order is always preserved: while a
//! rendezvous is in progress the session accepts no further send (it reports not writable),
//! which is what makes a short count after an abort exact.
//!
//! ## Downgrade to kernel TCP
//! [`Session::downgrade`] (before a `fork`/`exec`) moves the stream back to kernel TCP live:
//! sends fail with [`SendError::Downgraded`] (the caller writes to TCP), `Downgrade` goes out
//! after everything queued, the peer answers with its own, and `recv` returns what came
//! before the peer's `Downgrade`, then [`RecvError::Downgraded`] (read TCP from there). The
//! session ends in [`SessionState::Downgraded`]. `docs/PROTOCOL.md` section 7 has the rules.
//!
//! ## Flow control
//! Receive slots are re-posted as soon as a message is consumed, but the credit of a data
//! message is returned only when the application has read all of its bytes: the receive
//! queue is bounded by `recv_slots × slot_size` and a receiver that stops reading stops the
//! sender, whose memory is bounded by its send buffer. See [`credits`] for the reserve.

pub mod credits;
mod driver;
mod tx_ring;

pub use credits::{Credits, MessageClass, CREDIT_RESERVE};
pub use driver::{drive, Progress, Pump};

use crate::error::{
    DowngradeError, Error, PeerIncompatible, PeerMisbehaved, ProviderError, RecvError, SendError,
};
use crate::wire::{ctrl, PROTOCOL_VERSION};
use alloc::collections::VecDeque;
use alloc::vec::Vec;
use san_api::{
    Access, AppSink, AppSource, BadAddress, Capabilities, Completion, CompletionError,
    CompletionKind, LocalSegment, MemRange, PostError, RecvSlot, Registration, RemoteDescriptor,
    SanConnection, SlotConfig, SourcePart, StagedSend, WrId,
};
use tx_ring::TxRing;

/// Most messages [`Session::send_into_slots`] hands the connection to stage at once (a
/// 64 KiB file send in 16 KiB slots is four).
const STAGE_BATCH: usize = 8;

/// Smallest slot the protocol works with: a header, the largest body and some payload.
pub const MIN_SLOT_SIZE: u32 = 64;

/// Fewest receive slots: the reserve plus one data message.
pub const MIN_RECV_SLOTS: u16 = CREDIT_RESERVE + 2;

/// A full data message carries a multiple of this many bytes. A stream from an aligned
/// source (a file read from offset 0, a page-aligned buffer) is cut into messages whose
/// payloads then all start at the source's own alignment, as the provider places them in
/// its slots: with a full payload of a slot less its 8-byte header, every message after the
/// first started 8 bytes further off, and a copy whose destination lies a few bytes past its
/// source's alignment runs several times slower (`rep movsb` and `memcpy` alike).
const PAYLOAD_GRANULE: usize = 64;

/// The most payload one data message carries in a message of at most `max_message` bytes
/// (slots too small for copies whose speed matters keep every byte: the granule would cost
/// them up to a quarter).
pub const fn data_payload_room(max_message: usize) -> usize {
    let room = max_message.saturating_sub(ctrl::HEADER_LEN);
    if room >= 64 * PAYLOAD_GRANULE {
        room - room % PAYLOAD_GRANULE
    } else {
        room
    }
}

/// Names a registration the driver got from its cache; handed back in [`Op::Release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MrHandleId(pub u64);

/// A registered application buffer: the range, the registration covering it, and the
/// cache handle to release when the session no longer needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RegisteredRange {
    /// The bytes.
    pub range: MemRange,
    /// The registration covering `range`.
    pub registration: Registration,
    /// The cache handle.
    pub handle: MrHandleId,
}

impl RegisteredRange {
    fn segment(&self, offset: u64, len: u64) -> Option<LocalSegment> {
        Some(LocalSegment {
            range: self.range.slice(offset, len)?,
            lkey: self.registration.lkey,
        })
    }

    fn covered(&self) -> bool {
        self.range.len > 0 && self.registration.range.contains(&self.range)
    }
}

/// Which side opened the connection (matters for the iWARP first-message rule).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The connecting side.
    Active,
    /// The accepting side.
    Passive,
}

/// Tunables of a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionConfig {
    /// Inline bytes `send` accepts before reporting would-block (SO_SNDBUF analogue).
    pub send_buffer: usize,
    /// Preferred rendezvous threshold, announced in `Hello`; the negotiated value is the
    /// larger of both sides' ([`Session::rendezvous_threshold`]). The driver uses it.
    pub rendezvous_threshold: u32,
    /// Explicit credit updates are sent when at least this many credits are owed (or the
    /// peer is starved); 0 selects a quarter of the receive slots.
    pub credit_update_threshold: u16,
    /// Inline data is read by the application straight out of the receive slot it arrived
    /// in: the slot is re-posted only once its bytes were read (its credit returns then
    /// anyway), and the session copies nothing. Only for a provider whose slots keep their
    /// bytes until re-posted for as long as the connection object lives, and a caller that
    /// reads through [`Session::recv_from_slots`].
    pub receive_in_slots: bool,
    /// Inline data is copied by [`Session::send_into_slots`] straight from the application
    /// into the connection's send slots (over shm: the peer's receive slots) whenever
    /// nothing is queued ahead of it and credits allow, so each byte is copied once on its
    /// way out; the rest goes through the send buffer as without it. Useful with a provider
    /// that stages sends ([`san_api::SanConnection::stage_send_from`]); with one that does
    /// not, every send goes through the send buffer.
    pub send_in_slots: bool,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            send_buffer: 256 * 1024,
            rendezvous_threshold: 64 * 1024,
            credit_update_threshold: 0,
            receive_in_slots: false,
            send_in_slots: false,
        }
    }
}

/// Flags of [`Session::send`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SendFlags {
    /// MSG_OOB: the last byte accepted is urgent.
    pub urgent: bool,
}

/// Flags of [`Session::recv`] and [`Session::post_recv`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RecvFlags {
    /// MSG_PEEK: read without consuming.
    pub peek: bool,
    /// MSG_OOB: refused with `EINVAL` (urgent data is always inline, as with SO_OOBINLINE).
    pub oob: bool,
}

/// `shutdown(2)`'s `how`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shutdown {
    /// SHUT_RD.
    Read,
    /// SHUT_WR.
    Write,
    /// SHUT_RDWR.
    Both,
}

/// Identifies a rendezvous send until its [`Event::SendComplete`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SendTicket(pub u64);

/// Identifies a zero-copy receive until its [`Event::RecvComplete`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecvTicket(pub u64);

/// A control message written by [`Session::poll_transmit`]: post `len` bytes with `wr_id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Transmit {
    /// The work-request id for `post_send`.
    pub wr_id: WrId,
    /// Length of the message at the start of the caller's buffer.
    pub len: usize,
}

/// Work for the provider (or the cache), from [`Session::poll_op`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// Post receive slot `slot` again.
    PostRecv {
        /// The work-request id.
        wr_id: WrId,
        /// The slot.
        slot: RecvSlot,
    },
    /// RDMA-read `remote` into `local`.
    Read {
        /// The work-request id.
        wr_id: WrId,
        /// The sink.
        local: LocalSegment,
        /// The source.
        remote: RemoteDescriptor,
    },
    /// RDMA-write `local` to `remote`.
    Write {
        /// The work-request id.
        wr_id: WrId,
        /// The source.
        local: LocalSegment,
        /// The sink.
        remote: RemoteDescriptor,
    },
    /// The session no longer uses this registration: release it to the cache.
    Release(MrHandleId),
}

/// Why a session was reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResetCause {
    /// The peer sent `Rst`.
    Peer,
    /// The application closed abortively (SO_LINGER 0).
    LocalAbort,
    /// The application closed with unread received data (Linux sends a RST then).
    UnreadDataOnClose,
    /// Data arrived after the application closed the socket (Linux answers with a RST).
    DataAfterClose,
    /// A provider failure.
    Provider(ProviderError),
    /// The peer broke the protocol.
    PeerMisbehaved(PeerMisbehaved),
    /// The kernel TCP connection the session runs beside failed (a keepalive timeout or a
    /// reset the driver learnt from the kernel): the peer is gone or unreachable, so nothing
    /// is sent to it.
    KernelConnectionFailed,
    /// [`Session::downgrade`] was called during the handshake and the peer's hello then
    /// lacked `caps::DOWNGRADE`: the stream can move to kernel TCP neither live nor by
    /// falling back (the peer is established), so the connection is reset rather than risk
    /// a misordered byte.
    DowngradeUnsupported,
}

/// Something the application (or the preload) must learn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Event {
    /// Negotiation finished; data may flow. The preload drains exactly
    /// `peer_tcp_bytes_sent` bytes from kernel TCP before reading the SAN.
    Established {
        /// Bytes the peer sent over kernel TCP before switching.
        peer_tcp_bytes_sent: u64,
    },
    /// A rendezvous send finished: `Ok(n)` with `n` bytes delivered (a short count after an
    /// abort: prefix plus the part of the rest the receiver consumed), or the error.
    SendComplete {
        /// The send.
        ticket: SendTicket,
        /// Bytes delivered, or why none were.
        result: Result<u64, SendError>,
    },
    /// A zero-copy receive finished: `Ok(n)` bytes are in the buffer.
    RecvComplete {
        /// The receive.
        ticket: RecvTicket,
        /// Bytes received, or why none were.
        result: Result<u64, RecvError>,
    },
    /// The peer shut down its sending side (EOF after the queued data).
    PeerClosed,
    /// The peer sent `Downgrade`: the rest of its stream comes over kernel TCP, after the
    /// data already queued here (`recv` returns [`RecvError::Downgraded`] once that is read).
    /// The session downgrades its own direction too (sends fail with
    /// [`SendError::Downgraded`] from now on).
    PeerDowngraded,
    /// The session was reset.
    Reset(ResetCause),
}

/// Epoll-shaped readiness, derived from the session's state on every call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Readiness {
    /// A receive would not block (data, EOF, or an error to report): EPOLLIN.
    pub readable: bool,
    /// A send of at least one byte would not block: EPOLLOUT.
    pub writable: bool,
    /// The peer shut down its sending side: EPOLLRDHUP.
    pub read_hup: bool,
    /// Both directions are finished, or the connection was reset: EPOLLHUP.
    pub hup: bool,
    /// The connection failed (peer reset or provider error): EPOLLERR.
    pub error: bool,
    /// Urgent data is queued: EPOLLPRI.
    pub urgent: bool,
}

/// The session's coarse state (for the preload and for transition checks in tests).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SessionState {
    /// Hellos not yet exchanged.
    Handshaking,
    /// Data may flow (possibly half-closed).
    Established,
    /// The application closed the socket gracefully; queued data and `Fin` still go out.
    Closed,
    /// Reset (by either side or a failure). Terminal.
    Reset,
    /// Negotiation failed: the caller carries the connection over kernel TCP. Terminal.
    FellBack,
    /// Both sides exchanged `Downgrade` and nothing of the SAN is in use any more (no RDMA
    /// operation or rendezvous in flight, every registration released): the stream is on
    /// kernel TCP. Inline data received before the peer's `Downgrade` may still be queued
    /// (`recv` returns it, then [`RecvError::Downgraded`]). Terminal.
    Downgraded,
}

/// Counters for benchmarks and diagnostics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SessionStats {
    /// Application bytes sent inline (in `Data` and rendezvous prefixes).
    pub bytes_inline: u64,
    /// Application bytes moved by RDMA (rendezvous rests consumed by the peer).
    pub bytes_rendezvous: u64,
    /// Stream bytes received from the peer: inline payloads and rendezvous bytes moved
    /// here (read or not; dropped after `SHUT_RD` included). The offset where what the peer
    /// sent and we have not received begins.
    pub bytes_received: u64,
    /// Control messages transmitted.
    pub messages_sent: u64,
    /// Control messages received.
    pub messages_received: u64,
    /// Of those sent, explicit credit updates.
    pub credit_updates_sent: u64,
    /// Times `poll_transmit` had data to send but not enough credits.
    pub credit_stalls: u64,
    /// Rendezvous sends started.
    pub rendezvous_started: u64,
    /// Rendezvous sends that ended with a short count.
    pub rendezvous_aborted: u64,
    /// Downgrades to kernel TCP begun (by [`Session::downgrade`] or the peer's `Downgrade`):
    /// 0 or 1 per session, so sums count connections moved back to TCP.
    pub downgrades: u64,
}

/// Work-request id tags (top byte), so completions can be routed without a lookup table.
mod tag {
    pub const SEND: u64 = 1 << 56;
    pub const RECV: u64 = 2 << 56;
    pub const READ: u64 = 3 << 56;
    pub const WRITE: u64 = 4 << 56;
    pub const MASK: u64 = 0xff << 56;
}

/// Parameters learned from the peer's `Hello`.
#[derive(Clone, Copy, Debug)]
struct Peer {
    hello: ctrl::Hello,
    /// Largest message we may send (fits the peer's slots and ours).
    max_message: usize,
    /// Data we send uses READ mode (the peer can read).
    we_send_read_mode: bool,
}

impl Peer {
    fn supports_downgrade(&self) -> bool {
        self.hello.caps & ctrl::caps::DOWNGRADE != 0
    }

    fn supports_cancel(&self) -> bool {
        self.hello.caps & ctrl::caps::CANCEL != 0
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Terminal {
    Reset { rst_pending: bool, error: bool },
    FellBack,
    Downgraded,
}

/// One inline piece of the receive stream.
#[derive(Debug)]
struct InlineSegment {
    /// Bytes of the segment (in `Session::rx_bytes`, in stream order, unless `in_slot`).
    len: usize,
    /// Where the bytes are when they were left in their receive slot (see
    /// [`SessionConfig::receive_in_slots`]).
    in_slot: Option<SlotPlace>,
    read: usize,
    /// Index in the segment of the urgent byte, if any.
    urgent_at: Option<usize>,
    /// Consuming the whole segment returns one credit (false for rendezvous prefixes, whose
    /// credit belongs to the remote segment that follows).
    returns_credit: bool,
}

/// The receive slot an inline segment's bytes were left in: they are its bytes from
/// `start`, and the slot's message is `start + len` bytes long.
#[derive(Clone, Copy, Debug)]
struct SlotPlace {
    slot: RecvSlot,
    start: u32,
}

/// Where the bytes of segments left in their receive slots are read (the provider's slots).
pub trait SlotBytes {
    /// The first `len` bytes of the message in `slot` (fewer, or none, when the slot does
    /// not hold them).
    fn slot_bytes(&self, slot: RecvSlot, len: u32) -> &[u8];
}

impl<C: SanConnection + ?Sized> SlotBytes for C {
    fn slot_bytes(&self, slot: RecvSlot, len: u32) -> &[u8] {
        self.recv_slot(slot, len)
    }
}

/// No slots: for sessions that copy every inline segment (the default).
struct NoSlots;

impl SlotBytes for NoSlots {
    fn slot_bytes(&self, _: RecvSlot, _: u32) -> &[u8] {
        &[]
    }
}

/// A rendezvous rest in the receive stream.
#[derive(Debug)]
struct RemoteSegment {
    total: u64,
    consumed: u64,
    /// READ mode: where to read. WRITE mode: `None`.
    source: Option<RemoteDescriptor>,
}

#[derive(Debug)]
enum Segment {
    Inline(InlineSegment),
    Remote(RemoteSegment),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SinkPhase {
    /// READ mode: the read op is queued or posted.
    Reading(WrId),
    /// WRITE mode: `SinkAvail` is queued or sent; waiting for `WriteDone`/`RndvAbort`.
    Advertised,
}

/// The application buffer of a zero-copy receive.
#[derive(Debug)]
struct Sink {
    ticket: RecvTicket,
    buf: RegisteredRange,
    peek: bool,
    len: u64,
    phase: SinkPhase,
}

/// The rendezvous send in progress.
#[derive(Debug)]
struct TxRendezvous {
    ticket: SendTicket,
    prefix: Vec<u8>,
    rest: RegisteredRange,
    started: bool,
    consumed: u64,
    invalidated: bool,
    /// WRITE mode: the write in progress (wr, len, peek) and whether its op was polled.
    write: Option<(WrId, u64, bool)>,
    /// The application asked to end it early (`RndvCancel` is queued or sent).
    cancelled: bool,
}

/// Control messages waiting for transmission (everything but data, hello and updates).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Control {
    SinkAvail { sink: RemoteDescriptor, peek: bool },
    WriteDone { len: u64 },
    RdmaDone { len: u64 },
    RndvAbort { consumed: u64, withdraw: bool },
    RndvCancel,
}

/// The session of one connected socket. See the module docs for the poll order.
#[derive(Debug)]
pub struct Session {
    role: Role,
    config: SessionConfig,
    local: Capabilities,
    slots: SlotConfig,
    tcp_bytes_sent: u64,

    hello_sent: bool,
    peer: Option<Peer>,
    established_reported: bool,
    terminal: Option<Terminal>,
    closed_by_app: bool,

    // Credits toward the peer.
    send_credits: Credits,
    // Credits of the peer toward us (counters; see `peer_credit_view`).
    granted_to_peer: u64,
    received_from_peer: u64,
    slots_released: u64,
    slots_reposted: u64,
    credits_returned: u64,
    lazy_unreturned: u64,
    update_threshold: u64,

    /// Initial receive posts not yet polled (they return no credit: the peer's initial
    /// credits already count them).
    initial_posts_pending: u16,
    sends_in_flight: u16,
    next_wr: u64,
    next_ticket: u64,
    ops: VecDeque<Op>,
    events: VecDeque<Event>,
    controls: VecDeque<Control>,
    /// Handles to release when the work request using them completes (after a reset).
    release_on_completion: Vec<(WrId, MrHandleId)>,
    /// Read/write work requests posted (polled) and not yet completed.
    rdma_in_flight: Vec<WrId>,

    // Send side.
    tx_buffer: TxRing,
    /// Payload bytes at the front of `tx_buffer` that the last [`Session::poll_transmit_parts`]
    /// message carries and that stay queued until [`Session::release_transmitted`].
    tx_held: usize,
    /// Set for the duration of a `poll_transmit_parts` call: a data message's payload is
    /// held in place instead of being copied behind its header.
    tx_in_parts: bool,
    /// Stream offsets (absolute, counted from the first byte ever queued) one past each
    /// urgent byte still in `tx_buffer`.
    tx_urgent_ends: VecDeque<u64>,
    tx_queued_total: u64,
    tx_sent_total: u64,
    tx_rndv: Option<TxRendezvous>,
    shut_write: bool,
    fin_sent: bool,
    /// `downgrade()` was called or the peer's `Downgrade` arrived: sends fail with
    /// `SendError::Downgraded`, and `Downgrade` goes out after everything queued.
    downgrade_requested: bool,
    downgrade_sent: bool,

    // Receive side.
    rx_queue: VecDeque<Segment>,
    /// The unread bytes of every inline segment of `rx_queue`, in order: one ring, so a
    /// message costs a copy into it and no allocation (its capacity is bounded by the
    /// receive slots, as is its length).
    rx_bytes: VecDeque<u8>,
    rx_urgent_pending: usize,
    rx_sink: Option<Sink>,
    /// The peer asked to end the rendezvous we receive: done as soon as no sink of ours is
    /// in use (`RndvAbort` with what was consumed).
    rx_cancel: bool,
    peer_fin: bool,
    peer_downgraded: bool,
    shut_read: bool,

    stats: SessionStats,
}

impl Session {
    /// A session for a connection just set up with `slots`; its first ops post every
    /// receive slot (the driver must run before the peer can send, i.e. before the
    /// connection is reported up to it). `local` are the provider's capabilities;
    /// `tcp_bytes_sent` is the byte count this side sent over kernel TCP before switching.
    pub fn new(
        role: Role,
        config: SessionConfig,
        local: Capabilities,
        slots: SlotConfig,
        tcp_bytes_sent: u64,
    ) -> Self {
        let update_threshold = match config.credit_update_threshold {
            0 => u64::from(slots.recv_slots / 4).max(1),
            n => u64::from(n),
        };
        let mut session = Session {
            role,
            config,
            local,
            slots,
            tcp_bytes_sent,
            hello_sent: false,
            peer: None,
            established_reported: false,
            terminal: None,
            closed_by_app: false,
            send_credits: Credits::ZERO,
            // The peer's hello occupies one of our slots before it knows anything, so it
            // starts with one credit less; that slot's credit comes back once re-posted.
            granted_to_peer: u64::from(slots.recv_slots.saturating_sub(1)),
            received_from_peer: 0,
            slots_released: 0,
            slots_reposted: 0,
            credits_returned: 0,
            lazy_unreturned: 0,
            update_threshold,
            initial_posts_pending: slots.recv_slots,
            sends_in_flight: 0,
            next_wr: 0,
            next_ticket: 0,
            ops: VecDeque::new(),
            events: VecDeque::new(),
            controls: VecDeque::new(),
            release_on_completion: Vec::new(),
            rdma_in_flight: Vec::new(),
            tx_buffer: TxRing::new(),
            tx_held: 0,
            tx_in_parts: false,
            tx_urgent_ends: VecDeque::new(),
            tx_queued_total: 0,
            tx_sent_total: 0,
            tx_rndv: None,
            shut_write: false,
            fin_sent: false,
            downgrade_requested: false,
            downgrade_sent: false,
            rx_queue: VecDeque::new(),
            rx_bytes: VecDeque::new(),
            rx_urgent_pending: 0,
            rx_sink: None,
            rx_cancel: false,
            peer_fin: false,
            peer_downgraded: false,
            shut_read: false,
            stats: SessionStats::default(),
        };
        // The first ops post every receive slot; `poll_transmit` sends nothing (not even the
        // hello) until they were polled, so the peer can never hit a receiver-not-ready.
        for slot in 0..slots.recv_slots {
            session.repost(RecvSlot(slot));
        }
        session
    }

    // ---------------------------------------------------------------- queries

    /// The coarse state.
    pub fn state(&self) -> SessionState {
        match self.terminal {
            Some(Terminal::FellBack) => SessionState::FellBack,
            Some(Terminal::Reset { .. }) => SessionState::Reset,
            Some(Terminal::Downgraded) => SessionState::Downgraded,
            None if self.downgrade_finished() => SessionState::Downgraded,
            None if self.closed_by_app => SessionState::Closed,
            None if self.peer.is_some() && self.hello_sent => SessionState::Established,
            None => SessionState::Handshaking,
        }
    }

    /// Derived readiness (never stored).
    pub fn readiness(&self) -> Readiness {
        match self.terminal {
            Some(Terminal::FellBack) => return Readiness::default(),
            Some(Terminal::Reset { error, .. }) => {
                return Readiness {
                    readable: true,
                    writable: true,
                    read_hup: true,
                    hup: true,
                    error,
                    urgent: self.rx_urgent_pending > 0,
                }
            }
            Some(Terminal::Downgraded) | None => {}
        }
        if self.state() == SessionState::Handshaking {
            // A send fails at once after `downgrade()` (the caller writes to TCP instead).
            return Readiness {
                writable: self.downgrade_requested,
                ..Readiness::default()
            };
        }
        // After the peer's `Downgrade` an empty queue is not readable: the rest of the
        // stream is on kernel TCP, whose readiness the caller merges in.
        let rx_has_data = !self.rx_queue.is_empty();
        Readiness {
            readable: rx_has_data || self.peer_fin || self.shut_read,
            writable: self.shut_write
                || (self.downgrade_requested && self.tx_rndv.is_none())
                || self.send_space() > 0,
            read_hup: self.peer_fin,
            hup: self.peer_fin && self.shut_write,
            error: false,
            urgent: self.rx_urgent_pending > 0,
        }
    }

    /// Counters.
    pub fn stats(&self) -> SessionStats {
        self.stats
    }

    /// Our credits toward the peer.
    pub fn send_credits(&self) -> Credits {
        self.send_credits
    }

    /// The negotiated rendezvous threshold (larger of both sides'), once established.
    pub fn rendezvous_threshold(&self) -> Option<u32> {
        let peer = self.peer?;
        Some(
            self.config
                .rendezvous_threshold
                .max(peer.hello.rndv_threshold),
        )
    }

    /// The peer's `tcp_bytes_sent`, once its hello arrived.
    pub fn peer_tcp_bytes_sent(&self) -> Option<u64> {
        self.peer.map(|p| p.hello.tcp_bytes_sent)
    }

    /// Largest inline prefix [`Session::send_rendezvous`] accepts (0 before negotiation).
    pub fn max_rendezvous_prefix(&self) -> usize {
        self.peer.map_or(0, |p| {
            p.max_message
                .saturating_sub(ctrl::HEADER_LEN + ctrl::MessageType::RndvRead.body_len())
        })
    }

    /// True when rendezvous sends use READ mode (the peer can RDMA-read).
    pub fn sends_use_read_mode(&self) -> Option<bool> {
        self.peer.map(|p| p.we_send_read_mode)
    }

    /// Inline bytes queued and not yet transmitted.
    pub fn send_queue_len(&self) -> usize {
        self.tx_buffer.len()
    }

    /// True when the next `want` bytes of the stream were received inline already: a read of
    /// that many is answered from them whatever the peer sends next, so it needs no input.
    pub fn holds_inline(&self, want: usize) -> bool {
        let mut held = 0;
        for segment in &self.rx_queue {
            let Segment::Inline(seg) = segment else {
                return false;
            };
            held += seg.len - seg.read;
            if held >= want {
                return true;
            }
        }
        false
    }

    /// Work requests (receives to re-post, sends, RDMA operations) waiting for the driver: a
    /// read that freed a slot leaves one, which returns the peer's credit.
    pub fn ops_waiting(&self) -> usize {
        self.ops.len()
    }

    /// Inline bytes received and not yet read by the application.
    pub fn recv_queue_len(&self) -> usize {
        self.rx_bytes.len() + self.rx_in_slots()
    }

    /// Unread bytes of the segments left in their receive slots.
    fn rx_in_slots(&self) -> usize {
        self.rx_queue
            .iter()
            .map(|segment| match segment {
                Segment::Inline(seg) if seg.in_slot.is_some() => seg.len - seg.read,
                _ => 0,
            })
            .sum()
    }

    /// Stream bytes a read could return without waiting for the peer (FIONREAD): the inline
    /// bytes plus what is left of every rendezvous segment the peer announced (their bytes
    /// are in the peer's registered memory, ready to be moved).
    pub fn recv_pending_bytes(&self) -> u64 {
        let remote: u64 = self
            .rx_queue
            .iter()
            .map(|segment| match segment {
                Segment::Remote(remote) => remote.total.saturating_sub(remote.consumed),
                Segment::Inline(_) => 0,
            })
            .sum();
        (self.rx_bytes.len() + self.rx_in_slots()) as u64 + remote
    }

    /// True when [`Session::downgrade`] may be called with success: the session is
    /// established (or closed but lingering), not reset, and the peer announced
    /// `caps::DOWNGRADE`.
    pub fn can_downgrade(&self) -> bool {
        self.terminal.is_none()
            && self.hello_sent
            && self.peer.is_some_and(|p| p.supports_downgrade())
    }

    /// True from [`Session::downgrade`] (or the peer's `Downgrade`) on: sends fail with
    /// [`SendError::Downgraded`] and the caller writes to kernel TCP instead.
    pub fn is_downgrading(&self) -> bool {
        self.downgrade_requested
    }

    /// True once the peer's `Downgrade` arrived: after the queued data, the peer's stream
    /// continues on kernel TCP.
    pub fn peer_downgraded(&self) -> bool {
        self.peer_downgraded
    }

    /// True when the next byte to read is urgent (SIOCATMARK).
    pub fn at_mark(&self) -> bool {
        match self.rx_queue.front() {
            Some(Segment::Inline(seg)) => seg.urgent_at == Some(seg.read),
            _ => false,
        }
    }

    /// The peer's credits as far as we know (granted minus received; an upper bound of the
    /// real value while credits are in flight, exact when quiet).
    pub fn peer_credit_view(&self) -> u64 {
        self.granted_to_peer.saturating_sub(self.received_from_peer)
    }

    /// Credits we owe the peer and may return now: released by the application (or
    /// consumed control messages) *and* re-posted. Returning no more than re-posted is what
    /// keeps the peer's credits within the receives actually posted.
    pub fn credits_owed(&self) -> u64 {
        self.slots_released
            .min(self.slots_reposted)
            .saturating_sub(self.credits_returned)
    }

    /// True while progress depends on completions of our own work requests (sends, RDMA
    /// reads and writes), not only on the peer's messages: an RDMA operation or a rendezvous
    /// is in flight, most send slots are taken, or the session is closing, downgrading or
    /// over (its end waits for every send to complete). A driver that sleeps on
    /// completion events may ask for events on the peer's messages alone (solicited ones)
    /// while this is false, and must ask for every completion while it is true.
    pub fn awaits_local_completions(&self) -> bool {
        !self.rdma_in_flight.is_empty()
            || self.tx_rndv.is_some()
            || self.rx_sink.is_some()
            || !self.release_on_completion.is_empty()
            || self.sends_in_flight > self.slots.send_slots / 2
            || self.closed_by_app
            || self.downgrade_requested
            || self.terminal.is_some()
            || self.state() == SessionState::Handshaking
    }

    /// True when nothing is left to do: nothing to post, transmit or wait for. After a
    /// close or reset the driver may tear the connection down once this holds.
    pub fn is_quiescent(&self) -> bool {
        let pending_output = !self.ops.is_empty()
            || self.sends_in_flight > 0
            || !self.rdma_in_flight.is_empty()
            || !self.release_on_completion.is_empty();
        match self.terminal {
            Some(Terminal::Reset { rst_pending, .. }) => {
                !pending_output && (!rst_pending || !self.can_send_anything())
            }
            Some(Terminal::FellBack) | Some(Terminal::Downgraded) => !pending_output,
            // A downgrade ends only in `Downgraded`, also after a graceful close.
            None if self.downgrade_requested => self.downgrade_finished(),
            None => {
                self.closed_by_app
                    && !pending_output
                    && self.fin_sent
                    && self.tx_rndv.is_none()
                    && self.controls.is_empty()
            }
        }
    }

    /// True while a work request the provider may still execute uses `handle` locally
    /// (the source of a posted RDMA write, the sink of a posted RDMA read). A driver whose
    /// cache learns that such memory goes away defers the deregistration until the
    /// completion, since the provider could otherwise touch a dead registration.
    pub fn handle_in_posted_op(&self, handle: MrHandleId) -> bool {
        let posted = |wr: WrId| self.rdma_in_flight.contains(&wr);
        let tx = self.tx_rndv.as_ref().is_some_and(|r| {
            r.rest.handle == handle && r.write.is_some_and(|(wr, _, _)| posted(wr))
        });
        let rx = self.rx_sink.as_ref().is_some_and(|s| {
            s.buf.handle == handle && matches!(s.phase, SinkPhase::Reading(wr) if posted(wr))
        });
        let after_reset = self
            .release_on_completion
            .iter()
            .any(|(wr, h)| *h == handle && posted(*wr));
        tx || rx || after_reset
    }

    /// Every condition of the `Downgraded` state holds: both `Downgrade`s exchanged (ours
    /// completed), nothing posted or queued for the provider, no rendezvous in either
    /// direction, every registration released. Once true, nothing but a new input can make
    /// it false, and every input first latches it ([`Session::settle_downgrade`]).
    fn downgrade_finished(&self) -> bool {
        self.downgrade_through()
            && self.sends_in_flight == 0
            && self.ops.is_empty()
            && self.controls.is_empty()
            && self.release_on_completion.is_empty()
    }

    /// Makes a finished downgrade terminal before any input, application call or output
    /// poll, so nothing later (a credit update either way, flushes at teardown) changes it.
    fn settle_downgrade(&mut self) {
        if self.downgrade_finished() {
            self.terminal = Some(Terminal::Downgraded);
        }
    }

    /// Starts our downgrade (once): sends fail from now on; `Downgrade` goes out after
    /// everything queued.
    fn begin_downgrade(&mut self) {
        if !self.downgrade_requested {
            self.downgrade_requested = true;
            self.stats.downgrades += 1;
        }
    }

    fn can_send_anything(&self) -> bool {
        self.peer.is_some() && self.send_credits.allows(MessageClass::Last)
    }

    /// True when a send now would be buffered only for want of credits or send slots: the
    /// session sends into the slots ([`SessionConfig::send_in_slots`]), nothing is queued
    /// ahead, but no data message may go. A blocking caller may wait for the peer's credits
    /// instead, and copy its bytes once.
    pub fn waits_for_credits_to_send_straight(&self) -> bool {
        self.config.send_in_slots
            && self.peer.is_some()
            && self.sends_straight()
            && (!self.send_credits.allows(MessageClass::Data)
                || self.sends_in_flight >= self.slots.send_slots)
    }

    /// Bytes [`Session::send`] accepts now (0 during our rendezvous).
    pub fn send_space(&self) -> usize {
        if self.tx_rndv.is_some() {
            return 0;
        }
        self.config.send_buffer.saturating_sub(self.tx_buffer.len())
    }

    // ---------------------------------------------------------------- helpers

    fn wr(&mut self, tag: u64) -> WrId {
        self.next_wr = self.next_wr.wrapping_add(1) & !tag::MASK;
        WrId(tag | self.next_wr)
    }

    fn ticket(&mut self) -> u64 {
        self.next_ticket += 1;
        self.next_ticket
    }

    fn release(&mut self, handle: MrHandleId) {
        self.ops.push_back(Op::Release(handle));
    }

    /// Releases `handle` now, or when `wr` completes if it is posted.
    fn release_after(&mut self, wr: Option<WrId>, handle: MrHandleId) {
        match wr {
            Some(wr) if self.rdma_in_flight.contains(&wr) => {
                self.release_on_completion.push((wr, handle));
            }
            Some(wr) => {
                // Not posted yet: drop the op so it never reaches the provider.
                self.ops.retain(|op| !op_has_wr(op, wr));
                self.release(handle);
            }
            None => self.release(handle),
        }
    }

    /// Moves the session to the reset state: fails everything pending and releases every
    /// handle (now, or when the posted work request using it completes).
    fn enter_reset(&mut self, cause: ResetCause) {
        if self.terminal.is_some() {
            return;
        }
        let send_rst = matches!(
            cause,
            ResetCause::LocalAbort
                | ResetCause::UnreadDataOnClose
                | ResetCause::DataAfterClose
                | ResetCause::PeerMisbehaved(_)
                | ResetCause::DowngradeUnsupported
        );
        let error = matches!(
            cause,
            ResetCause::Peer
                | ResetCause::Provider(_)
                | ResetCause::PeerMisbehaved(_)
                | ResetCause::KernelConnectionFailed
        );
        self.terminal = Some(Terminal::Reset {
            rst_pending: send_rst && self.peer.is_some(),
            error,
        });
        // Nothing new goes to the provider except releases.
        self.ops.retain(|op| matches!(op, Op::Release(_)));
        self.controls.clear();
        self.tx_buffer.clear();
        self.tx_held = 0;
        self.tx_urgent_ends.clear();
        if let Some(rndv) = self.tx_rndv.take() {
            let wr = rndv.write.map(|(wr, _, _)| wr);
            self.release_after(wr, rndv.rest.handle);
            self.events.push_back(Event::SendComplete {
                ticket: rndv.ticket,
                result: Err(SendError::Reset),
            });
        }
        if let Some(sink) = self.rx_sink.take() {
            let wr = match sink.phase {
                SinkPhase::Reading(wr) => Some(wr),
                SinkPhase::Advertised => None,
            };
            self.release_after(wr, sink.buf.handle);
            self.events.push_back(Event::RecvComplete {
                ticket: sink.ticket,
                result: Err(RecvError::Reset),
            });
        }
        // Inline data already delivered stays readable; remote rests are gone with the peer.
        self.rx_queue.retain(|s| matches!(s, Segment::Inline(_)));
        self.events.push_back(Event::Reset(cause));
    }

    /// The kernel TCP connection beside the session failed (see
    /// [`ResetCause::KernelConnectionFailed`]): the session resets without a word to the peer.
    /// A peer host that vanished leaves an idle session nothing to notice it by; TCP's
    /// keepalive does, and the driver relays it here.
    pub fn handle_kernel_connection_failed(&mut self) {
        self.enter_reset(ResetCause::KernelConnectionFailed);
    }

    fn fail(&mut self, why: PeerMisbehaved) -> Error {
        self.enter_reset(ResetCause::PeerMisbehaved(why));
        Error::PeerMisbehaved(why)
    }

    // ---------------------------------------------------------------- inputs

    /// A message arrived in `slot` (a successful `Recv` completion; `bytes` are the slot's
    /// contents). Consumes the message and queues the slot's re-post.
    pub fn handle_message(&mut self, slot: RecvSlot, bytes: &[u8]) -> Result<(), Error> {
        self.settle_downgrade();
        if self.terminal.is_some() {
            // The connection is finished; nothing the peer says matters any more.
            return Ok(());
        }
        self.stats.messages_received += 1;
        if bytes.len() > self.slots.slot_size as usize {
            return Err(self.fail(PeerMisbehaved::MessageTooLong));
        }
        let Ok(repr) = ctrl::Repr::parse_bytes(bytes) else {
            return Err(self.fail(PeerMisbehaved::MalformedMessage));
        };
        let kind = repr.message.kind();
        if let ctrl::Message::Hello(hello) = repr.message {
            if self.peer.is_some() {
                return Err(self.fail(PeerMisbehaved::UnexpectedHello));
            }
            self.accept_hello(hello)?;
            self.repost(slot);
            self.slots_released += 1;
            return Ok(());
        }
        let Some(peer) = self.peer else {
            return Err(self.fail(PeerMisbehaved::MessageBeforeHello));
        };

        // Credit check: the peer may only send what we granted, and data must leave the
        // reserve (see `credits`).
        let view = self.peer_credit_view();
        let class = message_class(kind);
        if view == 0 {
            return Err(self.fail(PeerMisbehaved::CreditOverrun));
        }
        if view <= u64::from(class.keeps_back()) {
            return Err(self.fail(PeerMisbehaved::ReservedCreditMisuse));
        }
        self.received_from_peer += 1;
        let Some(credits) = self.send_credits.checked_add(repr.credits) else {
            return Err(self.fail(PeerMisbehaved::ExcessCredits));
        };
        if credits.get() > peer.hello.recv_slots {
            return Err(self.fail(PeerMisbehaved::ExcessCredits));
        }
        self.send_credits = credits;
        // Data may stay in its slot until it is read (the slot is re-posted then).
        let data_slot = (self.config.receive_in_slots
            && matches!(repr.message, ctrl::Message::Data { .. }))
        .then(|| SlotPlace {
            slot,
            start: (repr.payload.as_ptr() as usize).wrapping_sub(bytes.as_ptr() as usize) as u32,
        })
        .filter(|place| {
            (place.start as usize).checked_add(repr.payload.len()) == Some(bytes.len())
        });
        if data_slot.is_none() {
            self.repost(slot);
        }

        match repr.message {
            ctrl::Message::Hello(_) => {} // handled above
            ctrl::Message::Data { urgent } => {
                if !self.on_data(repr.payload, urgent, data_slot)? {
                    if let Some(place) = data_slot {
                        self.repost(place.slot);
                    }
                }
            }
            ctrl::Message::RndvRead { rest } => {
                if !self.local.rdma_read {
                    return Err(self.fail(PeerMisbehaved::UnexpectedRendezvousMode));
                }
                self.on_rendezvous_start(repr.payload, rest.len, Some(rest))?;
            }
            ctrl::Message::RndvWrite { rest_len } => {
                if self.local.rdma_read {
                    return Err(self.fail(PeerMisbehaved::UnexpectedRendezvousMode));
                }
                self.on_rendezvous_start(repr.payload, rest_len, None)?;
            }
            ctrl::Message::SinkAvail { sink, peek } => {
                self.slots_released += 1;
                self.on_sink_avail(sink, peek)?;
            }
            ctrl::Message::WriteDone { len } => {
                self.slots_released += 1;
                self.on_write_done(len)?;
            }
            ctrl::Message::RdmaDone { len } => {
                self.slots_released += 1;
                self.on_rdma_done(len)?;
            }
            ctrl::Message::RndvAbort { consumed, withdraw } => {
                self.slots_released += 1;
                self.on_rendezvous_abort(consumed, withdraw)?;
            }
            ctrl::Message::RndvCancel => {
                self.slots_released += 1;
                // (A cancel that crossed the rendezvous's end finds nothing: not an error.)
                if self
                    .rx_queue
                    .iter()
                    .any(|s| matches!(s, Segment::Remote(_)))
                {
                    self.rx_cancel = true;
                    self.settle_cancel();
                }
            }
            ctrl::Message::CreditUpdate => {
                self.slots_released += 1;
                self.lazy_unreturned += 1;
            }
            ctrl::Message::Fin => {
                self.slots_released += 1;
                if self.peer_downgraded {
                    return Err(self.fail(PeerMisbehaved::DataAfterDowngrade));
                }
                if !self.peer_fin {
                    self.peer_fin = true;
                    self.events.push_back(Event::PeerClosed);
                }
            }
            ctrl::Message::Rst => {
                self.slots_released += 1;
                self.enter_reset(ResetCause::Peer);
            }
            ctrl::Message::Downgrade => {
                self.slots_released += 1;
                if self.peer_downgraded {
                    return Err(self.fail(PeerMisbehaved::UnexpectedDowngrade));
                }
                // The peer's SAN stream ends here; ours follows it to TCP (also after our
                // `Fin` or a graceful close, so the peer learns where our stream ends).
                self.peer_downgraded = true;
                self.events.push_back(Event::PeerDowngraded);
                self.begin_downgrade();
            }
        }
        Ok(())
    }

    fn repost(&mut self, slot: RecvSlot) {
        let wr_id = WrId(tag::RECV | u64::from(slot.0));
        self.ops.push_back(Op::PostRecv { wr_id, slot });
    }

    fn accept_hello(&mut self, hello: ctrl::Hello) -> Result<(), Error> {
        let incompatible = if hello.version != PROTOCOL_VERSION {
            Some(PeerIncompatible::Version {
                peer: hello.version,
            })
        } else if hello.recv_slots < MIN_RECV_SLOTS {
            Some(PeerIncompatible::TooFewSlots {
                peer: hello.recv_slots,
            })
        } else if hello.slot_size < MIN_SLOT_SIZE {
            Some(PeerIncompatible::SlotTooSmall {
                peer: hello.slot_size,
            })
        } else {
            None
        };
        if let Some(why) = incompatible {
            // Before any data moved: the caller falls back to kernel TCP. No Rst: the
            // peer may not speak our version; tearing the SAN connection down tells it.
            self.terminal = Some(Terminal::FellBack);
            self.ops.clear();
            return Err(Error::PeerIncompatible(why));
        }
        let max_message = (self.slots.slot_size.min(hello.slot_size)) as usize;
        self.peer = Some(Peer {
            hello,
            max_message,
            we_send_read_mode: hello.caps & ctrl::caps::RDMA_READ != 0,
        });
        self.send_credits = Credits::new(hello.recv_slots - 1);
        if self.downgrade_requested && hello.caps & ctrl::caps::DOWNGRADE == 0 {
            // `downgrade()` during the handshake accepted sends for kernel TCP, which this
            // peer would never read in order: reset (never a misordered byte).
            self.enter_reset(ResetCause::DowngradeUnsupported);
            return Ok(());
        }
        self.report_established();
        Ok(())
    }

    fn report_established(&mut self) {
        if self.established_reported || !self.hello_sent {
            return;
        }
        if let Some(peer) = self.peer {
            self.established_reported = true;
            self.events.push_back(Event::Established {
                peer_tcp_bytes_sent: peer.hello.tcp_bytes_sent,
            });
        }
    }

    /// Inline data arrived (`slot`: where it may be left instead of copied). Whether the
    /// segment was left in that slot (the caller re-posts the slot otherwise).
    fn on_data(
        &mut self,
        payload: &[u8],
        urgent: bool,
        slot: Option<SlotPlace>,
    ) -> Result<bool, Error> {
        if self.peer_downgraded {
            return Err(self.fail(PeerMisbehaved::DataAfterDowngrade));
        }
        if self.peer_fin {
            return Err(self.fail(PeerMisbehaved::DataAfterFin));
        }
        self.stats.bytes_received += payload.len() as u64;
        if self.closed_by_app {
            self.slots_released += 1;
            self.enter_reset(ResetCause::DataAfterClose);
            return Ok(false);
        }
        if self.shut_read {
            // SHUT_RD: new data is dropped; its credit comes back at once so the peer
            // never stalls on a reader that will not read.
            self.slots_released += 1;
            return Ok(false);
        }
        if urgent {
            self.rx_urgent_pending += 1;
        }
        let in_slot = slot.filter(|_| !payload.is_empty());
        if in_slot.is_none() {
            self.rx_bytes.extend(payload);
        }
        self.rx_queue.push_back(Segment::Inline(InlineSegment {
            len: payload.len(),
            in_slot,
            read: 0,
            urgent_at: urgent.then(|| payload.len() - 1),
            returns_credit: true,
        }));
        Ok(in_slot.is_some())
    }

    fn on_rendezvous_start(
        &mut self,
        prefix: &[u8],
        rest_len: u64,
        source: Option<RemoteDescriptor>,
    ) -> Result<(), Error> {
        if self.peer_downgraded {
            return Err(self.fail(PeerMisbehaved::DataAfterDowngrade));
        }
        if self.peer_fin {
            return Err(self.fail(PeerMisbehaved::DataAfterFin));
        }
        if self
            .rx_queue
            .iter()
            .any(|s| matches!(s, Segment::Remote(_)))
        {
            return Err(self.fail(PeerMisbehaved::RendezvousOverlap));
        }
        self.stats.bytes_received += prefix.len() as u64;
        if self.closed_by_app {
            self.slots_released += 1;
            self.enter_reset(ResetCause::DataAfterClose);
            return Ok(());
        }
        if self.shut_read {
            // Dropped like inline data: report the whole rest consumed.
            self.stats.bytes_received += rest_len;
            self.slots_released += 1;
            self.controls.push_back(Control::RndvAbort {
                consumed: rest_len,
                withdraw: false,
            });
            return Ok(());
        }
        if !prefix.is_empty() {
            self.rx_bytes.extend(prefix);
            self.rx_queue.push_back(Segment::Inline(InlineSegment {
                len: prefix.len(),
                in_slot: None,
                read: 0,
                urgent_at: None,
                returns_credit: false,
            }));
        }
        self.rx_queue.push_back(Segment::Remote(RemoteSegment {
            total: rest_len,
            consumed: 0,
            source,
        }));
        Ok(())
    }

    fn on_sink_avail(&mut self, sink: RemoteDescriptor, peek: bool) -> Result<(), Error> {
        let max_rdma = self.local.max_rdma_len.max(1);
        let write_wr = self.wr(tag::WRITE);
        let Some(rndv) = self.tx_rndv.as_mut() else {
            return Err(self.fail(PeerMisbehaved::UnknownRendezvous));
        };
        if !rndv.started || rndv.write.is_some() {
            return Err(self.fail(PeerMisbehaved::UnknownRendezvous));
        }
        let remaining = rndv.rest.range.len - rndv.consumed;
        if rndv.invalidated {
            // Never post an op with an invalidated registration: end with a short count.
            let consumed = rndv.consumed;
            self.controls.push_back(Control::RndvAbort {
                consumed,
                withdraw: true,
            });
            self.finish_tx_rendezvous(true);
            return Ok(());
        }
        let len = sink.len.min(remaining).min(max_rdma);
        let Some(local) = rndv.rest.segment(rndv.consumed, len) else {
            return Err(self.fail(PeerMisbehaved::RendezvousLengthMismatch));
        };
        rndv.write = Some((write_wr, len, peek));
        self.ops.push_back(Op::Write {
            wr_id: write_wr,
            local,
            remote: RemoteDescriptor {
                addr: sink.addr,
                len,
                rkey: sink.rkey,
            },
        });
        Ok(())
    }

    fn on_write_done(&mut self, len: u64) -> Result<(), Error> {
        let Some(sink) = self.rx_sink.take_if(|s| s.phase == SinkPhase::Advertised) else {
            return Err(self.fail(PeerMisbehaved::UnknownRendezvous));
        };
        let remaining = match self.rx_queue.front() {
            Some(Segment::Remote(seg)) => seg.total - seg.consumed,
            _ => 0,
        };
        if len == 0 || len > sink.len || len > remaining {
            self.rx_sink = Some(sink);
            return Err(self.fail(PeerMisbehaved::RendezvousLengthMismatch));
        }
        self.release(sink.buf.handle);
        if !sink.peek {
            self.consume_remote(len);
        }
        self.events.push_back(Event::RecvComplete {
            ticket: sink.ticket,
            result: Ok(len),
        });
        self.settle_cancel();
        Ok(())
    }

    /// A cancel the peer asked for ends the rendezvous we receive once no sink of ours is in
    /// use: the sender learns what was consumed and sends the rest again (or not).
    fn settle_cancel(&mut self) {
        if !self.rx_cancel || self.rx_sink.is_some() {
            return;
        }
        self.rx_cancel = false;
        let Some(at) = self
            .rx_queue
            .iter()
            .position(|s| matches!(s, Segment::Remote(_)))
        else {
            return;
        };
        if let Some(Segment::Remote(seg)) = self.rx_queue.remove(at) {
            self.slots_released += 1;
            self.controls.push_back(Control::RndvAbort {
                consumed: seg.consumed,
                withdraw: false,
            });
        }
    }

    /// Advances the head remote segment by `len` bytes; at its end pops it, returns its
    /// credit and (READ mode) tells the sender.
    fn consume_remote(&mut self, len: u64) {
        let Some(Segment::Remote(seg)) = self.rx_queue.front_mut() else {
            return;
        };
        self.stats.bytes_received += len;
        seg.consumed += len;
        if seg.consumed < seg.total {
            return;
        }
        let total = seg.total;
        let read_mode = seg.source.is_some();
        self.rx_queue.pop_front();
        self.slots_released += 1;
        if read_mode {
            self.controls.push_back(Control::RdmaDone { len: total });
        }
    }

    fn on_rdma_done(&mut self, len: u64) -> Result<(), Error> {
        let Some(rndv) = self.tx_rndv.as_mut() else {
            return Err(self.fail(PeerMisbehaved::UnknownRendezvous));
        };
        let read_mode = self.peer.is_some_and(|p| p.we_send_read_mode);
        if !rndv.started || !read_mode {
            return Err(self.fail(PeerMisbehaved::UnknownRendezvous));
        }
        if len != rndv.rest.range.len {
            return Err(self.fail(PeerMisbehaved::RendezvousLengthMismatch));
        }
        rndv.consumed = len;
        self.finish_tx_rendezvous(false);
        Ok(())
    }

    fn on_rendezvous_abort(&mut self, consumed: u64, withdraw: bool) -> Result<(), Error> {
        if !withdraw {
            // From the receiver of our rendezvous (READ mode, or a sink it could not
            // register): it consumed `consumed` bytes of our rest and reads no more.
            let Some(rndv) = self.tx_rndv.as_ref().filter(|r| r.started) else {
                return Err(self.fail(PeerMisbehaved::UnknownRendezvous));
            };
            if consumed > rndv.rest.range.len || consumed < rndv.consumed || rndv.write.is_some() {
                return Err(self.fail(PeerMisbehaved::RendezvousLengthMismatch));
            }
            let short = consumed < rndv.rest.range.len;
            if let Some(rndv) = self.tx_rndv.as_mut() {
                rndv.consumed = consumed;
            }
            self.finish_tx_rendezvous(short);
            return Ok(());
        }
        // From the sender of the rendezvous we receive (WRITE mode): it withdraws the rest
        // after what we consumed.
        let Some(Segment::Remote(seg)) = self.rx_queue.front() else {
            return Err(self.fail(PeerMisbehaved::UnknownRendezvous));
        };
        if seg.consumed != consumed || seg.source.is_some() {
            return Err(self.fail(PeerMisbehaved::RendezvousLengthMismatch));
        }
        if let Some(sink) = self.rx_sink.take() {
            self.release(sink.buf.handle);
            self.events.push_back(Event::RecvComplete {
                ticket: sink.ticket,
                result: Err(RecvError::Interrupted),
            });
        }
        self.rx_queue.pop_front();
        self.slots_released += 1;
        Ok(())
    }

    /// Ends the send-side rendezvous (after `RdmaDone`, the last `WriteDone`, or an abort)
    /// with prefix plus consumed bytes, and releases the rest's registration.
    fn finish_tx_rendezvous(&mut self, short: bool) {
        let Some(rndv) = self.tx_rndv.take() else {
            return;
        };
        self.stats.bytes_rendezvous += rndv.consumed;
        if short {
            self.stats.rendezvous_aborted += 1;
        }
        self.release(rndv.rest.handle);
        self.events.push_back(Event::SendComplete {
            ticket: rndv.ticket,
            result: Ok(rndv.prefix.len() as u64 + rndv.consumed),
        });
    }

    /// A non-receive completion (or a failed receive). Successful receives go to
    /// [`Session::handle_message`].
    pub fn handle_completion(&mut self, completion: &Completion) -> Result<(), Error> {
        self.settle_downgrade();
        let wr = completion.wr_id;
        if let Some(pos) = self.rdma_in_flight.iter().position(|w| *w == wr) {
            self.rdma_in_flight.swap_remove(pos);
        }
        let mut released = false;
        while let Some(pos) = self
            .release_on_completion
            .iter()
            .position(|(w, _)| *w == wr)
        {
            let (_, handle) = self.release_on_completion.swap_remove(pos);
            self.release(handle);
            released = true;
        }
        if completion.kind == CompletionKind::Send {
            self.sends_in_flight = self.sends_in_flight.saturating_sub(1);
        }
        if self.terminal.is_some() || released {
            // Flushes after a reset are expected; nothing else to do.
            return Ok(());
        }
        match (completion.kind, completion.status) {
            (CompletionKind::Send, Ok(())) => Ok(()),
            (CompletionKind::Recv { .. }, Ok(())) => Err(Error::InvalidState),
            (CompletionKind::Read, status) => self.on_read_completion(wr, status),
            (CompletionKind::Write, status) => self.on_write_completion(wr, status),
            (_, Err(_)) if self.downgrade_through() => {
                // Both `Downgrade`s are through and nothing is moving: the peer, done with the
                // SAN, closed the connection. What is left to post (receive slots, credit
                // returns) has no reader; nothing of the stream is lost.
                self.ops.retain(|op| matches!(op, Op::Release(_)));
                self.controls.clear();
                self.terminal = Some(Terminal::Downgraded);
                Ok(())
            }
            (_, Err(e)) => {
                let why = ProviderError::Completion(e);
                self.enter_reset(ResetCause::Provider(why));
                Err(Error::Provider(why))
            }
        }
    }

    /// Our `Downgrade` is transmitted, the peer's received, and no transfer is in progress in
    /// either direction: only bookkeeping (reposts, credit returns) may still be pending.
    fn downgrade_through(&self) -> bool {
        self.terminal.is_none()
            && self.downgrade_sent
            && self.peer_downgraded
            && self.rdma_in_flight.is_empty()
            && self.tx_rndv.is_none()
            && self.rx_sink.is_none()
            && !self
                .rx_queue
                .iter()
                .any(|s| matches!(s, Segment::Remote(_)))
    }

    /// Posting the work request `wr_id` (from `poll_op` or `poll_transmit`) failed: the
    /// connection is unusable. The driver reports it here.
    pub fn handle_post_error(&mut self, wr_id: WrId, error: PostError) -> Error {
        self.settle_downgrade();
        self.rdma_in_flight.retain(|w| *w != wr_id);
        while let Some(pos) = self
            .release_on_completion
            .iter()
            .position(|(w, _)| *w == wr_id)
        {
            let (_, handle) = self.release_on_completion.swap_remove(pos);
            self.release(handle);
        }
        if wr_id.0 & tag::MASK == tag::SEND {
            self.sends_in_flight = self.sends_in_flight.saturating_sub(1);
        }
        let why = ProviderError::Post(error);
        self.enter_reset(ResetCause::Provider(why));
        Error::Provider(why)
    }

    fn on_read_completion(
        &mut self,
        wr: WrId,
        status: Result<(), CompletionError>,
    ) -> Result<(), Error> {
        let Some(sink) = self.rx_sink.take_if(|s| s.phase == SinkPhase::Reading(wr)) else {
            return Err(Error::InvalidState);
        };
        self.release(sink.buf.handle);
        let result = self.on_sink_read(sink, status);
        self.settle_cancel();
        result
    }

    fn on_sink_read(
        &mut self,
        sink: Sink,
        status: Result<(), CompletionError>,
    ) -> Result<(), Error> {
        match status {
            Ok(()) => {
                if !sink.peek {
                    self.consume_remote(sink.len);
                }
                self.events.push_back(Event::RecvComplete {
                    ticket: sink.ticket,
                    result: Ok(sink.len),
                });
                Ok(())
            }
            Err(CompletionError::RemoteAccess) => {
                // The sender's buffer is gone (invalidated mid-rendezvous): end the
                // rendezvous at what was consumed; the sender completes with a short count.
                self.abort_head_remote();
                self.events.push_back(Event::RecvComplete {
                    ticket: sink.ticket,
                    result: Err(RecvError::Interrupted),
                });
                Ok(())
            }
            Err(CompletionError::LocalProtection) => {
                // Our sink was invalidated: this receive fails, the segment stays.
                self.events.push_back(Event::RecvComplete {
                    ticket: sink.ticket,
                    result: Err(RecvError::Interrupted),
                });
                Ok(())
            }
            Err(e) => {
                let why = ProviderError::Completion(e);
                self.enter_reset(ResetCause::Provider(why));
                Err(Error::Provider(why))
            }
        }
    }

    fn abort_head_remote(&mut self) {
        if let Some(Segment::Remote(seg)) = self.rx_queue.front() {
            let consumed = seg.consumed;
            self.rx_queue.pop_front();
            self.slots_released += 1;
            self.controls.push_back(Control::RndvAbort {
                consumed,
                withdraw: false,
            });
        }
    }

    fn on_write_completion(
        &mut self,
        wr: WrId,
        status: Result<(), CompletionError>,
    ) -> Result<(), Error> {
        let Some(rndv) = self.tx_rndv.as_mut() else {
            return Err(Error::InvalidState);
        };
        let Some((_, len, peek)) = rndv.write.take_if(|(w, _, _)| *w == wr) else {
            return Err(Error::InvalidState);
        };
        match status {
            Ok(()) => {
                self.controls.push_back(Control::WriteDone { len });
                if !peek {
                    rndv.consumed += len;
                    if rndv.consumed == rndv.rest.range.len {
                        self.finish_tx_rendezvous(false);
                    }
                }
                Ok(())
            }
            Err(CompletionError::RemoteAccess | CompletionError::LocalProtection) => {
                // Our buffer or the receiver's sink is gone: withdraw the rest.
                let consumed = rndv.consumed;
                self.controls.push_back(Control::RndvAbort {
                    consumed,
                    withdraw: true,
                });
                self.finish_tx_rendezvous(true);
                Ok(())
            }
            Err(e) => {
                let why = ProviderError::Completion(e);
                self.enter_reset(ResetCause::Provider(why));
                Err(Error::Provider(why))
            }
        }
    }

    /// The registration cache invalidated `handle` (its memory was unmapped or remapped).
    /// The session never posts a new op with it; a rendezvous using it ends early.
    pub fn handle_invalidated(&mut self, handle: MrHandleId) {
        self.settle_downgrade();
        if let Some(rndv) = self.tx_rndv.as_mut() {
            if rndv.rest.handle == handle {
                rndv.invalidated = true;
                if !rndv.started {
                    // Nothing went out yet: the whole send fails with ENOBUFS, nothing lost.
                    if let Some(rndv) = self.tx_rndv.take() {
                        self.release(rndv.rest.handle);
                        self.events.push_back(Event::SendComplete {
                            ticket: rndv.ticket,
                            result: Err(SendError::NoBuffers),
                        });
                    }
                } else if let Some((wr, _, _)) = rndv.write {
                    if !self.rdma_in_flight.contains(&wr) {
                        // The write op was not polled yet: drop it and withdraw the rest.
                        self.ops.retain(|op| !op_has_wr(op, wr));
                        let consumed = rndv.consumed;
                        rndv.write = None;
                        self.controls.push_back(Control::RndvAbort {
                            consumed,
                            withdraw: true,
                        });
                        self.finish_tx_rendezvous(true);
                    }
                }
            }
        }
        let sink_hit = self
            .rx_sink
            .as_ref()
            .is_some_and(|s| s.buf.handle == handle);
        if sink_hit {
            let posted = match self.rx_sink.as_ref().map(|s| s.phase) {
                Some(SinkPhase::Reading(wr)) => self.rdma_in_flight.contains(&wr),
                _ => true,
            };
            let advertising = self
                .controls
                .iter()
                .any(|c| matches!(c, Control::SinkAvail { .. }));
            if !posted || advertising {
                // Not yet handed to the provider or the peer: cancel this receive.
                if let Some(sink) = self.rx_sink.take() {
                    if let SinkPhase::Reading(wr) = sink.phase {
                        self.ops.retain(|op| !op_has_wr(op, wr));
                    }
                    self.controls
                        .retain(|c| !matches!(c, Control::SinkAvail { .. }));
                    self.release(sink.buf.handle);
                    self.events.push_back(Event::RecvComplete {
                        ticket: sink.ticket,
                        result: Err(RecvError::Interrupted),
                    });
                }
            }
            // Otherwise the provider fails the posted read, or the peer's write fails on
            // the revoked key and the peer aborts: both end this receive.
        }
    }

    // ---------------------------------------------------------------- application

    fn check_send(&self) -> Result<(), SendError> {
        match self.terminal {
            Some(Terminal::Reset { .. }) => return Err(SendError::Reset),
            Some(Terminal::FellBack) => return Err(SendError::NotConnected),
            Some(Terminal::Downgraded) | None => {}
        }
        if self.shut_write || self.closed_by_app {
            return Err(SendError::Closed);
        }
        if self.downgrade_requested {
            // Our rendezvous in progress may still end with a short count whose rest the
            // application re-sends: it must not have written later bytes to TCP yet.
            if self.tx_rndv.is_some() {
                return Err(SendError::WouldBlock);
            }
            return Err(SendError::Downgraded);
        }
        if self.peer.is_none() {
            return Err(SendError::WouldBlock);
        }
        Ok(())
    }

    /// Copies up to the free send space of `data` into the send buffer (inline mode).
    /// Returns the count accepted (short counts happen, like a non-blocking TCP send);
    /// `Ok(0)` only for an empty `data` (no message is sent, as on Linux).
    pub fn send(&mut self, data: &[u8], flags: SendFlags) -> Result<usize, SendError> {
        self.send_from(data, flags)
    }

    /// [`Session::send`] of the application's bytes in `source`, copied straight into the
    /// send buffer: a copy that fails (a buffer the process may not read) queues nothing and
    /// answers [`SendError::BadAddress`].
    pub fn send_from<S: AppSource + ?Sized>(
        &mut self,
        source: &S,
        flags: SendFlags,
    ) -> Result<usize, SendError> {
        self.settle_downgrade();
        self.check_send()?;
        if source.is_empty() {
            return Ok(0);
        }
        let space = self.send_space();
        if space == 0 {
            return Err(SendError::WouldBlock);
        }
        let n = source.len().min(space);
        self.tx_buffer
            .push_from(source, n)
            .map_err(|BadAddress| SendError::BadAddress)?;
        self.tx_queued_total += n as u64;
        if flags.urgent {
            self.tx_urgent_ends.push_back(self.tx_queued_total);
        }
        Ok(n)
    }

    /// [`Session::send_from`] for a session with [`SessionConfig::send_in_slots`]: when
    /// nothing waits to go before them (no byte in the send buffer, no rendezvous, no
    /// control message queued) and credits allow, the bytes go straight into `conn`'s send
    /// slots as data messages, staged first and posted only once every copy succeeded: a
    /// source that cannot be read takes nothing and costs no credit
    /// ([`SendError::BadAddress`]). The count is short when credits or slots ran out first
    /// (the caller's next send queues the rest). Urgent bytes, sends with something ahead of
    /// them and sends the connection cannot stage go into the send buffer, as
    /// [`Session::send_from`] does.
    pub fn send_into_slots<S: AppSource + ?Sized, C: SanConnection + ?Sized>(
        &mut self,
        source: &S,
        flags: SendFlags,
        conn: &mut C,
    ) -> Result<usize, SendError> {
        self.settle_downgrade();
        self.check_send()?;
        if source.is_empty() {
            return Ok(0);
        }
        let max_payload = match self.peer {
            Some(peer) if self.config.send_in_slots && !flags.urgent && self.sends_straight() => {
                data_payload_room(peer.max_message)
            }
            _ => 0,
        };
        if max_payload == 0 {
            return self.send_from(source, flags);
        }
        // Every credit owed rides on the first message, as `next_data` would send it.
        let owed = self.credits_to_return();
        let mut credits = self.send_credits;
        let mut staged = 0u16;
        let mut taken = 0usize;
        // Messages are staged a batch at a time, so that a source read by system call (a
        // file) fills a batch's slots with one.
        let mut heads = [[0u8; ctrl::HEADER_LEN]; STAGE_BATCH];
        'batches: while taken < source.len() {
            let mut planned = [(WrId(0), 0usize, 0usize); STAGE_BATCH];
            let mut count = 0usize;
            let mut batch_bytes = 0usize;
            let mut batch_credits = credits;
            while count < STAGE_BATCH
                && taken + batch_bytes < source.len()
                && batch_credits.allows(MessageClass::Data)
                && usize::from(self.sends_in_flight) + usize::from(staged) + count
                    < usize::from(self.slots.send_slots)
            {
                let n = (source.len() - taken - batch_bytes).min(max_payload);
                let repr = ctrl::Repr {
                    credits: if staged == 0 && count == 0 { owed } else { 0 },
                    message: ctrl::Message::Data { urgent: false },
                    payload: &[],
                };
                let Ok(head_len) = repr.emit_header_for(&mut heads[count], n) else {
                    break;
                };
                planned[count] = (self.wr(tag::SEND), head_len, n);
                count += 1;
                batch_bytes += n;
                batch_credits = batch_credits.checked_sub(1).unwrap_or(Credits::ZERO);
            }
            if count == 0 {
                break;
            }
            let messages: [StagedSend<'_>; STAGE_BATCH] = core::array::from_fn(|i| StagedSend {
                wr_id: planned[i].0,
                head: &heads[i][..planned[i].1],
                payload_len: planned[i].2,
            });
            let payload = SourcePart::new(source, taken, batch_bytes);
            let done = match conn.stage_sends_from(&messages[..count], &payload) {
                Ok(done) => done.min(count),
                Err(BadAddress) => {
                    conn.discard_staged();
                    return Err(SendError::BadAddress);
                }
            };
            for &(_, _, n) in &planned[..done] {
                taken += n;
                credits = credits.checked_sub(1).unwrap_or(Credits::ZERO);
            }
            // NOTE(cast): `done <= STAGE_BATCH`.
            staged += done as u16;
            if done < count {
                break 'batches;
            }
        }
        if staged == 0 {
            return self.send_from(source, flags);
        }
        conn.commit_staged();
        self.note_returned(owed);
        self.send_credits = credits;
        self.sends_in_flight += staged;
        self.stats.messages_sent += u64::from(staged);
        self.stats.bytes_inline += taken as u64;
        self.tx_queued_total += taken as u64;
        self.tx_sent_total += taken as u64;
        Ok(taken)
    }

    /// Nothing is queued to go before new data (see [`Session::send_into_slots`]), and the
    /// session may send data (handshake done, first receives posted, not over).
    fn sends_straight(&self) -> bool {
        self.tx_buffer.is_empty()
            && self.tx_held == 0
            && self.tx_rndv.is_none()
            && self.controls.is_empty()
            && self.hello_sent
            && self.initial_posts_pending == 0
            && self.terminal.is_none()
    }

    /// Starts a zero-copy send: `prefix` goes inline in the first message, `rest` (already
    /// registered by the driver, with REMOTE_READ in READ mode) moves by RDMA. Completes
    /// with [`Event::SendComplete`]. No other send is accepted until then.
    pub fn send_rendezvous(
        &mut self,
        prefix: &[u8],
        rest: RegisteredRange,
    ) -> Result<SendTicket, SendError> {
        self.settle_downgrade();
        self.check_send()?;
        if self.tx_rndv.is_some() {
            return Err(SendError::WouldBlock);
        }
        if prefix.len() > self.max_rendezvous_prefix() {
            return Err(SendError::TooLong);
        }
        if !rest.covered() {
            return Err(SendError::InvalidArgument);
        }
        let read_mode = self.peer.is_some_and(|p| p.we_send_read_mode);
        if read_mode
            && (!rest.registration.access.contains(Access::REMOTE_READ)
                || rest.registration.remote_descriptor(rest.range).is_none())
        {
            return Err(SendError::InvalidArgument);
        }
        let ticket = SendTicket(self.ticket());
        self.tx_rndv = Some(TxRendezvous {
            ticket,
            prefix: prefix.to_vec(),
            rest,
            started: false,
            consumed: 0,
            invalidated: false,
            write: None,
            cancelled: false,
        });
        self.stats.rendezvous_started += 1;
        Ok(ticket)
    }

    /// Asks to end our rendezvous send early (the application's blocking send was
    /// interrupted by a signal, and must return with what the peer took, as a kernel send
    /// returns a short count): one not announced yet ends at once with nothing sent; one in
    /// progress ends with [`Event::SendComplete`] and a short count once the receiver
    /// answers (it finishes any read of ours first), or in full if it got there first.
    /// False when there is nothing to cancel or the peer cannot be asked (it lacks
    /// `caps::CANCEL`): the send then runs to its end.
    pub fn cancel_send_rendezvous(&mut self) -> bool {
        self.settle_downgrade();
        let supported = self.peer.is_some_and(|p| p.supports_cancel());
        let Some(rndv) = self.tx_rndv.as_mut() else {
            return false;
        };
        if !rndv.started {
            if let Some(rndv) = self.tx_rndv.take() {
                self.release(rndv.rest.handle);
                self.stats.rendezvous_aborted += 1;
                self.events.push_back(Event::SendComplete {
                    ticket: rndv.ticket,
                    result: Ok(0),
                });
            }
            return true;
        }
        if rndv.cancelled {
            return true;
        }
        if !supported {
            return false;
        }
        rndv.cancelled = true;
        self.controls.push_back(Control::RndvCancel);
        true
    }

    fn check_recv(&self, flags: RecvFlags) -> Result<(), RecvError> {
        if flags.oob {
            return Err(RecvError::InvalidArgument);
        }
        match self.terminal {
            Some(Terminal::FellBack) => Err(RecvError::NotConnected),
            Some(Terminal::Reset { .. } | Terminal::Downgraded) => Ok(()),
            None if self.peer.is_none() => Err(RecvError::WouldBlock),
            None => Ok(()),
        }
    }

    /// Copies inline bytes into `buf`: `Ok(n)` with what is available (never waits for
    /// more: MSG_WAITALL is the driver's loop), `Ok(0)` at end of stream, stops before an
    /// urgent byte unless it is the first byte. When the next bytes are a rendezvous
    /// segment, returns [`RecvError::RemoteSegment`] (use [`Session::post_recv`]).
    pub fn recv(&mut self, buf: &mut [u8], flags: RecvFlags) -> Result<usize, RecvError> {
        self.recv_into(buf, flags)
    }

    /// [`Session::recv`] into the application's memory `buf`. A segment whose bytes cannot
    /// all be written there (a buffer the process may not write) stays unread, as the kernel
    /// leaves a segment it could not copy: the call returns what the segments before it
    /// gave, or [`RecvError::BadAddress`] when there were none.
    pub fn recv_into<D: AppSink + ?Sized>(
        &mut self,
        buf: &mut D,
        flags: RecvFlags,
    ) -> Result<usize, RecvError> {
        self.recv_from_slots(buf, flags, &NoSlots)
    }

    /// [`Session::recv_into`] for a session with [`SessionConfig::receive_in_slots`]: the
    /// bytes left in receive slots are read from `slots` (the connection), and a slot whose
    /// bytes were all read is re-posted.
    pub fn recv_from_slots<S: SlotBytes + ?Sized, D: AppSink + ?Sized>(
        &mut self,
        buf: &mut D,
        flags: RecvFlags,
        slots: &S,
    ) -> Result<usize, RecvError> {
        self.settle_downgrade();
        self.check_recv(flags)?;
        if buf.is_empty() {
            return Ok(0);
        }
        let mut copied = 0;
        let mut index = 0;
        // Where segment `index`'s unread bytes start in `rx_bytes` (moves only when peeking).
        let mut offset = 0;
        while copied < buf.len() {
            let Some(segment) = self.rx_queue.get_mut(index) else {
                break;
            };
            let Segment::Inline(seg) = segment else {
                if copied == 0 {
                    if let Segment::Remote(r) = segment {
                        return Err(RecvError::RemoteSegment {
                            len: r.total - r.consumed,
                        });
                    }
                }
                break;
            };
            // Linux stops a read at the urgent mark unless the mark is the first byte.
            let mut end = seg.len;
            if let Some(mark) = seg.urgent_at {
                if seg.read == mark && copied > 0 {
                    break;
                }
                if seg.read < mark {
                    end = mark;
                }
            }
            let n = (end - seg.read).min(buf.len() - copied);
            let copy = match seg.in_slot {
                None => copy_from_ring(&self.rx_bytes, offset, buf, copied, n),
                Some(place) => {
                    let from = place.start as usize + seg.read;
                    let message = (place.start as usize + seg.len) as u32;
                    match slots.slot_bytes(place.slot, message).get(from..from + n) {
                        Some(bytes) => buf.copy_from(copied, bytes),
                        // (Never: the connection keeps a slot's bytes until it is
                        // re-posted.) Nothing to give: the stream cannot go on.
                        None => {
                            debug_assert!(false, "a receive slot lost its bytes");
                            return if copied > 0 {
                                Ok(copied)
                            } else {
                                Err(RecvError::Reset)
                            };
                        }
                    }
                }
            };
            if copy.is_err() {
                if copied > 0 {
                    return Ok(copied);
                }
                return Err(RecvError::BadAddress);
            }
            copied += n;
            if flags.peek {
                // Peek walks the queue without changing it.
                if seg.read + n < seg.len {
                    // Stopped inside this segment (buffer full or at the mark).
                    if copied < buf.len() {
                        break;
                    }
                    continue;
                }
                if seg.in_slot.is_none() {
                    offset += seg.len - seg.read;
                }
                index += 1;
                continue;
            }
            let crossed_mark = seg
                .urgent_at
                .is_some_and(|m| seg.read <= m && m < seg.read + n);
            seg.read += n;
            if seg.in_slot.is_none() {
                self.rx_bytes.drain(..n);
            }
            if crossed_mark {
                self.rx_urgent_pending -= 1;
            }
            if seg.read == seg.len {
                let returns_credit = seg.returns_credit;
                let in_slot = seg.in_slot;
                self.rx_queue.pop_front();
                if let Some(place) = in_slot {
                    self.repost(place.slot);
                }
                if returns_credit {
                    self.slots_released += 1;
                }
            } else if seg.urgent_at == Some(seg.read) {
                // Stopped before the urgent byte.
                break;
            }
        }
        if copied > 0 {
            return Ok(copied);
        }
        if matches!(self.terminal, Some(Terminal::Reset { .. })) {
            return Err(RecvError::Reset);
        }
        if self.peer_fin || self.shut_read {
            // A `Fin` before the peer's `Downgrade` ended the stream: EOF, not a continuation.
            return Ok(0);
        }
        if self.peer_downgraded {
            return Err(RecvError::Downgraded);
        }
        Err(RecvError::WouldBlock)
    }

    /// Posts a zero-copy receive of the rendezvous segment at the head of the stream into
    /// `buf` (registered by the driver with LOCAL_WRITE in READ mode, plus REMOTE_WRITE when
    /// the provider needs it for read sinks; with REMOTE_WRITE in WRITE mode). Receives
    /// min(buffer, remaining) bytes; completes with [`Event::RecvComplete`]. With
    /// `flags.peek` the bytes are delivered but not consumed.
    pub fn post_recv(
        &mut self,
        buf: RegisteredRange,
        flags: RecvFlags,
    ) -> Result<RecvTicket, RecvError> {
        self.settle_downgrade();
        self.check_recv(flags)?;
        if matches!(self.terminal, Some(Terminal::Reset { .. })) {
            return Err(RecvError::Reset);
        }
        if self.rx_sink.is_some() {
            return Err(RecvError::WouldBlock);
        }
        let Some(Segment::Remote(seg)) = self.rx_queue.front() else {
            return Err(RecvError::NotRemote);
        };
        if !buf.covered() {
            return Err(RecvError::InvalidArgument);
        }
        let remaining = seg.total - seg.consumed;
        let (offset, source) = (seg.consumed, seg.source);
        let access = buf.registration.access;
        let ticket = RecvTicket(self.ticket());
        match source {
            Some(source) => {
                let mut needed = Access::LOCAL_WRITE;
                if self.local.read_sink_needs_remote_write {
                    needed |= Access::REMOTE_WRITE;
                }
                if !access.contains(needed) {
                    return Err(RecvError::InvalidArgument);
                }
                let len = buf
                    .range
                    .len
                    .min(remaining)
                    .min(self.local.max_rdma_len.max(1));
                let local = buf.segment(0, len).ok_or(RecvError::InvalidArgument)?;
                let wr_id = self.wr(tag::READ);
                self.ops.push_back(Op::Read {
                    wr_id,
                    local,
                    remote: RemoteDescriptor {
                        addr: source.addr.saturating_add(offset),
                        len,
                        rkey: source.rkey,
                    },
                });
                self.rx_sink = Some(Sink {
                    ticket,
                    buf,
                    peek: flags.peek,
                    len,
                    phase: SinkPhase::Reading(wr_id),
                });
            }
            None => {
                let len = buf.range.len.min(remaining);
                let range = buf.range.slice(0, len).ok_or(RecvError::InvalidArgument)?;
                let sink = if access.contains(Access::REMOTE_WRITE) {
                    buf.registration.remote_descriptor(range)
                } else {
                    None
                };
                let sink = sink.ok_or(RecvError::InvalidArgument)?;
                self.controls.push_back(Control::SinkAvail {
                    sink,
                    peek: flags.peek,
                });
                self.rx_sink = Some(Sink {
                    ticket,
                    buf,
                    peek: flags.peek,
                    len,
                    phase: SinkPhase::Advertised,
                });
            }
        }
        Ok(ticket)
    }

    /// The driver could not register a sink for the rendezvous segment at the head of the
    /// stream (ENOMEM): ends that rendezvous at what was consumed so far. The sender sees a
    /// short count and retries the rest; no byte is lost or duplicated.
    pub fn reject_remote_segment(&mut self) -> Result<(), RecvError> {
        self.settle_downgrade();
        match self.terminal {
            Some(Terminal::Reset { .. }) => return Err(RecvError::Reset),
            Some(Terminal::FellBack) => return Err(RecvError::NotConnected),
            Some(Terminal::Downgraded) | None => {}
        }
        if self.rx_sink.is_some() || !matches!(self.rx_queue.front(), Some(Segment::Remote(_))) {
            return Err(RecvError::NotRemote);
        }
        self.abort_head_remote();
        Ok(())
    }

    /// Begins the live move of this connection back to kernel TCP (before a `fork`/`exec`,
    /// which cannot share the SAN session). From this call on, [`Session::send`] and
    /// [`Session::send_rendezvous`] fail with [`SendError::Downgraded`] (with
    /// [`SendError::WouldBlock`] while our rendezvous is still in progress, since it may end
    /// with a short count whose rest must be re-sent first): the caller writes
    /// those bytes to the kernel TCP socket, which the peer reads only after our
    /// `Downgrade`. Everything queued before (inline data, a rendezvous in progress, a `Fin`
    /// owed) still goes out first, then `Downgrade`. The peer answers with its own
    /// `Downgrade`; `recv` returns the data queued before it, then
    /// [`RecvError::Downgraded`] (read the rest from kernel TCP). The session ends in
    /// [`SessionState::Downgraded`].
    ///
    /// During the handshake the request is kept and `Downgrade` goes out once established
    /// (a peer without the capability then resets the session:
    /// [`ResetCause::DowngradeUnsupported`]). Idempotent.
    ///
    /// # Errors
    /// [`DowngradeError::Unsupported`] when the peer did not announce the capability,
    /// [`DowngradeError::Reset`] / [`DowngradeError::FellBack`] in those states; nothing
    /// changes then.
    pub fn downgrade(&mut self) -> Result<(), DowngradeError> {
        self.settle_downgrade();
        match self.terminal {
            Some(Terminal::Reset { .. }) => return Err(DowngradeError::Reset),
            Some(Terminal::FellBack) => return Err(DowngradeError::FellBack),
            Some(Terminal::Downgraded) => return Ok(()),
            None => {}
        }
        if self.downgrade_requested {
            return Ok(());
        }
        if self.peer.is_some_and(|p| !p.supports_downgrade()) {
            return Err(DowngradeError::Unsupported);
        }
        self.begin_downgrade();
        Ok(())
    }

    /// `shutdown(2)`. Write: `Fin` goes out after everything queued. Read: queued data stays
    /// readable, then `recv` returns 0; data arriving later is dropped (its credit returned).
    ///
    /// After [`Session::downgrade`] the write side is kernel TCP's: shutting it down is the
    /// caller's business there, and no `Fin` follows our `Downgrade`.
    pub fn shutdown(&mut self, how: Shutdown) {
        self.settle_downgrade();
        if matches!(how, Shutdown::Write | Shutdown::Both) && !self.downgrade_requested {
            self.shut_write = true;
        }
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            self.shut_read = true;
        }
    }

    /// `close(2)`. Graceful: queued data and a rendezvous in progress still complete, then
    /// `Fin`; but unread received data makes it a reset, as on Linux. Abortive (SO_LINGER
    /// 0): `Rst` at once, queued data dropped, the peer sees ECONNRESET.
    ///
    /// An abortive close after a graceful one is how a driver gives up on a lingering close
    /// (the peer never answers): the session resets at once.
    ///
    /// In [`SessionState::Downgraded`] it does nothing (no `Fin`, no `Rst`): the stream is on
    /// kernel TCP and the caller just drops the SAN connection. A graceful close while a
    /// downgrade is in progress lets the downgrade finish (no `Fin`).
    pub fn close(&mut self, abortive: bool) {
        self.settle_downgrade();
        if self.terminal.is_some() {
            return;
        }
        if abortive {
            self.enter_reset(ResetCause::LocalAbort);
            return;
        }
        if self.closed_by_app {
            return;
        }
        if !self.rx_queue.is_empty() {
            self.enter_reset(ResetCause::UnreadDataOnClose);
            return;
        }
        self.shutdown(Shutdown::Both);
        self.closed_by_app = true;
    }

    // ---------------------------------------------------------------- outputs

    /// The next provider op, if any.
    pub fn poll_op(&mut self) -> Option<Op> {
        self.settle_downgrade();
        let op = self.ops.pop_front()?;
        match op {
            Op::PostRecv { .. } if self.initial_posts_pending > 0 => {
                self.initial_posts_pending -= 1;
            }
            Op::PostRecv { .. } => self.slots_reposted += 1,
            Op::Read { wr_id, .. } | Op::Write { wr_id, .. } => self.rdma_in_flight.push(wr_id),
            Op::Release(_) => {}
        }
        Some(op)
    }

    /// The next application event, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// As [`Session::poll_transmit`], but a data message's payload is not copied behind its
    /// header in `buf`: it stays at the front of the send buffer, where
    /// [`Session::transmitted_payload`] shows it, until [`Session::release_transmitted`]
    /// (call it after posting the message, whatever the post's result). The message is the
    /// `len` bytes of `buf` followed by that payload. For providers that copy into the peer's
    /// memory anyway: each byte is then copied once on its way out.
    pub fn poll_transmit_parts(&mut self, buf: &mut [u8]) -> Option<Transmit> {
        self.release_transmitted();
        self.tx_in_parts = true;
        let transmit = self.poll_transmit(buf);
        self.tx_in_parts = false;
        transmit
    }

    /// The payload of the last [`Session::poll_transmit_parts`] message (empty when it had
    /// none, or after [`Session::release_transmitted`]).
    pub fn transmitted_payload(&self) -> &[u8] {
        &self.tx_buffer.front()[..self.tx_held]
    }

    /// Drops the payload of the last [`Session::poll_transmit_parts`] message from the send
    /// buffer (it was counted as sent when the message was made).
    pub fn release_transmitted(&mut self) {
        self.tx_buffer.consume(core::mem::take(&mut self.tx_held));
    }

    /// Writes the next control message into `buf` (a provider send slot; at least the
    /// negotiated message size) and returns its work-request id and length, or `None` when
    /// nothing may be sent now (nothing queued, no credits, no free send slot).
    pub fn poll_transmit(&mut self, buf: &mut [u8]) -> Option<Transmit> {
        self.settle_downgrade();
        if self.sends_in_flight >= self.slots.send_slots || self.initial_posts_pending > 0 {
            return None;
        }
        let (len, class) = self.next_message(buf)?;
        let wr_id = self.wr(tag::SEND);
        self.sends_in_flight += 1;
        self.stats.messages_sent += 1;
        if class.is_some() {
            // NOTE: `next_message` only produces a classed message when `allows` held.
            self.send_credits = self.send_credits.checked_sub(1).unwrap_or(Credits::ZERO);
        }
        Some(Transmit { wr_id, len })
    }

    /// Builds the next message; `None` class means the hello (needs no credit).
    fn next_message(&mut self, buf: &mut [u8]) -> Option<(usize, Option<MessageClass>)> {
        if !self.hello_sent {
            if self.terminal.is_some() {
                return None;
            }
            let waits = self.local.active_side_sends_first
                && self.role == Role::Passive
                && self.peer.is_none();
            if waits {
                return None;
            }
            let hello = ctrl::Hello {
                version: PROTOCOL_VERSION,
                caps: if self.local.rdma_read {
                    ctrl::caps::RDMA_READ
                } else {
                    0
                } | if self.local.write_with_imm {
                    ctrl::caps::WRITE_WITH_IMM
                } else {
                    0
                } | ctrl::caps::DOWNGRADE
                    | ctrl::caps::CANCEL,
                recv_slots: self.slots.recv_slots,
                slot_size: self.slots.slot_size,
                rndv_threshold: self.config.rendezvous_threshold,
                tcp_bytes_sent: self.tcp_bytes_sent,
            };
            let repr = ctrl::Repr {
                credits: 0,
                message: ctrl::Message::Hello(hello),
                payload: &[],
            };
            let len = repr.emit(buf).ok()?;
            self.hello_sent = true;
            self.report_established();
            return Some((len, None));
        }
        let peer = self.peer?;
        let max = peer.max_message.min(buf.len());
        match self.terminal {
            Some(Terminal::FellBack | Terminal::Downgraded) => return None,
            Some(Terminal::Reset { rst_pending, error }) => {
                if !rst_pending || !self.send_credits.allows(MessageClass::Last) {
                    return None;
                }
                self.terminal = Some(Terminal::Reset {
                    rst_pending: false,
                    error,
                });
                let len = self.emit(buf, ctrl::Message::Rst, &[])?;
                return Some((len, Some(MessageClass::Last)));
            }
            None => {}
        }

        // Rendezvous control first: it unblocks the peer's RDMA.
        if let Some(control) = self.controls.front().copied() {
            if self.send_credits.allows(MessageClass::Control) {
                let message = match control {
                    Control::SinkAvail { sink, peek } => ctrl::Message::SinkAvail { sink, peek },
                    Control::WriteDone { len } => ctrl::Message::WriteDone { len },
                    Control::RdmaDone { len } => ctrl::Message::RdmaDone { len },
                    Control::RndvAbort { consumed, withdraw } => {
                        ctrl::Message::RndvAbort { consumed, withdraw }
                    }
                    Control::RndvCancel => ctrl::Message::RndvCancel,
                };
                let len = self.emit(buf, message, &[])?;
                self.controls.pop_front();
                return Some((len, Some(MessageClass::Control)));
            }
            self.stats.credit_stalls += 1;
        }

        if let Some(len) = self.next_data(buf, max) {
            return Some((len, Some(MessageClass::Data)));
        }

        let stream_done = self.tx_buffer.is_empty() && self.tx_rndv.is_none();
        if self.shut_write && !self.fin_sent && stream_done && self.controls.is_empty() {
            if self.send_credits.allows(MessageClass::Control) {
                let len = self.emit(buf, ctrl::Message::Fin, &[])?;
                self.fin_sent = true;
                return Some((len, Some(MessageClass::Control)));
            }
            self.stats.credit_stalls += 1;
        }

        // `Downgrade` ends our SAN stream like `Fin`: after all data, a rendezvous in
        // progress and a `Fin` already owed (so the peer sees EOF, then the downgrade).
        let fin_owed = self.shut_write && !self.fin_sent;
        if self.downgrade_requested && !self.downgrade_sent && stream_done && !fin_owed {
            if self.send_credits.allows(MessageClass::Control) {
                let len = self.emit(buf, ctrl::Message::Downgrade, &[])?;
                self.downgrade_sent = true;
                return Some((len, Some(MessageClass::Control)));
            }
            self.stats.credit_stalls += 1;
        }

        if self.wants_credit_update() && self.send_credits.allows(MessageClass::Last) {
            let len = self.emit(buf, ctrl::Message::CreditUpdate, &[])?;
            self.stats.credit_updates_sent += 1;
            return Some((len, Some(MessageClass::Last)));
        }
        None
    }

    /// The next data message (inline bytes or a rendezvous start), if credits allow.
    fn next_data(&mut self, buf: &mut [u8], max: usize) -> Option<usize> {
        let has_data =
            !self.tx_buffer.is_empty() || self.tx_rndv.as_ref().is_some_and(|r| !r.started);
        if !has_data {
            return None;
        }
        if !self.send_credits.allows(MessageClass::Data) {
            self.stats.credit_stalls += 1;
            return None;
        }
        if !self.tx_buffer.is_empty() {
            // The first contiguous run only: when the ring wraps, one message is shorter
            // instead of rotating the whole buffer (megabytes) for every message.
            let mut n = self.tx_buffer.front().len().min(data_payload_room(max));
            // A message ends at an urgent byte, so the URG flag marks its last byte.
            let mut urgent = false;
            if let Some(&end) = self.tx_urgent_ends.front() {
                let until = (end - self.tx_sent_total) as usize;
                if until <= n {
                    n = until;
                    urgent = true;
                }
            }
            if n == 0 {
                return None;
            }
            let credits = self.credits_to_return();
            let data = self.tx_buffer.front();
            let repr = ctrl::Repr {
                credits,
                message: ctrl::Message::Data { urgent },
                payload: &data[..n],
            };
            let message_len = if self.tx_in_parts {
                repr.emit_header(buf).ok()?
            } else {
                repr.emit(buf).ok()?
            };
            self.note_returned(credits);
            let payload_len = n;
            if self.tx_in_parts {
                self.tx_held = payload_len;
            } else {
                self.tx_buffer.consume(payload_len);
            }
            self.tx_sent_total += payload_len as u64;
            if urgent {
                self.tx_urgent_ends.pop_front();
            }
            self.stats.bytes_inline += payload_len as u64;
            return Some(message_len);
        }
        let read_mode = self.peer.is_some_and(|p| p.we_send_read_mode);
        let rndv = self.tx_rndv.as_ref()?;
        let message = if read_mode {
            let rest = rndv.rest.registration.remote_descriptor(rndv.rest.range)?;
            ctrl::Message::RndvRead { rest }
        } else {
            ctrl::Message::RndvWrite {
                rest_len: rndv.rest.range.len,
            }
        };
        let prefix = core::mem::take(&mut self.tx_rndv.as_mut()?.prefix);
        let len = self.emit(buf, message, &prefix);
        let rndv = self.tx_rndv.as_mut()?;
        rndv.prefix = prefix;
        let len = len?;
        rndv.started = true;
        self.stats.bytes_inline += rndv.prefix.len() as u64;
        Some(len)
    }

    /// Explicit updates only when worth it, and never as an endless exchange:
    /// * at least the threshold of "eager" credits (of consumed data or control messages)
    ///   is owed; or
    /// * the peer is down to its reserve (it cannot send data) and we owe it eager credits,
    ///   or at least two credits of any kind. Credits owed for consumed updates ("lazy")
    ///   alone need two: each update then returns more lazy credits than it creates (one),
    ///   so updates answering updates die out, while a peer starved at its reserve always
    ///   gets the slots back (with at least `MIN_RECV_SLOTS` slots, a starved peer whose
    ///   data we all read is owed at least two).
    ///
    /// And one more: a peer down to its last credit cannot send a control message at all (a
    /// `RdmaDone` or `SinkAvail` that our own rendezvous may be waiting for): it gets even a
    /// single lazy credit back, as long as we stay above the reserve ourselves. That
    /// condition breaks the symmetry an exchange of single-credit updates would need (each
    /// side would have to be at its last credit and above the reserve at once).
    fn wants_credit_update(&self) -> bool {
        let owed = self.credits_owed();
        if owed == 0 {
            return false;
        }
        let eager = owed.saturating_sub(self.lazy_unreturned);
        let peer_view = self.peer_credit_view();
        let peer_starved = peer_view <= u64::from(CREDIT_RESERVE);
        let peer_mute = peer_view <= 1 && self.send_credits.get() > CREDIT_RESERVE;
        eager >= self.update_threshold || (peer_starved && (eager > 0 || owed >= 2)) || peer_mute
    }

    /// Emits `message`, piggy-backing every credit owed.
    fn emit(&mut self, buf: &mut [u8], message: ctrl::Message, payload: &[u8]) -> Option<usize> {
        let credits = self.credits_to_return();
        let repr = ctrl::Repr {
            credits,
            message,
            payload,
        };
        let len = repr.emit(buf).ok()?;
        self.note_returned(credits);
        Some(len)
    }

    fn credits_to_return(&self) -> u16 {
        u16::try_from(self.credits_owed()).unwrap_or(u16::MAX)
    }

    /// Accounts for `credits` returned in a message just emitted.
    fn note_returned(&mut self, credits: u16) {
        self.credits_returned += u64::from(credits);
        self.granted_to_peer += u64::from(credits);
        self.lazy_unreturned = 0;
    }
}

fn message_class(kind: ctrl::MessageType) -> MessageClass {
    match kind {
        ctrl::MessageType::Data | ctrl::MessageType::RndvRead | ctrl::MessageType::RndvWrite => {
            MessageClass::Data
        }
        ctrl::MessageType::CreditUpdate | ctrl::MessageType::Rst => MessageClass::Last,
        _ => MessageClass::Control,
    }
}

/// Copies `len` bytes of `ring` starting at `start` into `dst` at offset `at`. The caller's
/// invariant (segment lengths sum to the ring's length) keeps the range inside the ring; a
/// range outside copies what exists rather than panicking.
fn copy_from_ring<D: AppSink + ?Sized>(
    ring: &VecDeque<u8>,
    mut start: usize,
    dst: &mut D,
    mut at: usize,
    mut len: usize,
) -> Result<(), BadAddress> {
    let (front, back) = ring.as_slices();
    for part in [front, back] {
        if len == 0 {
            break;
        }
        if start >= part.len() {
            start -= part.len();
            continue;
        }
        let n = (part.len() - start).min(len);
        dst.copy_from(at, &part[start..start + n])?;
        at += n;
        len -= n;
        start = 0;
    }
    Ok(())
}

fn op_has_wr(op: &Op, wr: WrId) -> bool {
    matches!(op, Op::Read { wr_id, .. } | Op::Write { wr_id, .. } if *wr_id == wr)
}
