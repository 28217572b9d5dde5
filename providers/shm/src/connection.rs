//! [`ShmConnection`]: a [`SanConnection`] over one segment.
//!
//! **Sends (one copy).** The receiver publishes the slots it posts in its post FIFO. `post_send`
//! takes the oldest posted slot, copies the message straight into it, and appends a message
//! entry (slot, length) to the receiver's inbound ring; the send completes at once. With no
//! posted slot (or a full ring) the send waits in a local outbound queue — keeping order with
//! everything posted after it — and is retried on every call into the connection; after
//! [`ConnectionConfig::rnr_timeout`] without a posted receive it completes with
//! [`CompletionError::ReceiverNotReady`] and the connection goes to the error state, as an
//! RC queue pair does when its RNR retries run out.
//!
//! **RDMA.** Both directions check the `RemoteDescriptor` against the owner's exposure table in
//! the segment (see `domain.rs`). With CMA permitted (probed at attach by reading the peer's
//! magic word with `process_vm_readv`), reads and writes are one `process_vm_readv`/`writev`
//! on the peer's pid — a pid of *our* namespace (see **Peer identity**). Without it, RDMA read is not offered and writes go through the receiver's
//! *write window*: the writer copies chunks into the window and appends window-write entries to
//! the same inbound ring as messages; the receiver applies each chunk (after re-checking the
//! rkey against its own domain) when its `poll_completions` reaches the entry, i.e. strictly
//! before any message sent later in that direction — a "write done" control message can never
//! overtake its data. The write completes for the writer once all chunks are in the window.
//!
//! **Errors.** The peer's orderly close (its `closed` word) or death (pidfd, checked at most every
//! [`ConnectionConfig::liveness_interval`] and whenever a bounded futex wait times out) puts the
//! connection in the error state after draining what the peer published before: the first
//! outstanding request completes with `RetryExceeded` (death) or `Flushed` (close), the rest
//! with `Flushed`, and posting fails with `Disconnected`. Anything malformed from the peer
//! (slot ids, ring positions, lengths) is likewise an error state (`Fatal`), never a panic.
//!
//! **Peer identity.** Liveness and CMA need the peer as the kernel names it to *us*. The pid
//! the peer recorded in the segment is used only when the peer runs in our pid namespace
//! ([`ShmSegment::peer_pid`]); a peer in another one (a container sharing `/dev/shm` and the
//! network namespace) recorded a number that means nothing here, or another process. The
//! caller that learnt the peer from the kernel (a pidfd it was passed or obtained, the pid
//! `SO_PEERCRED` translated into our namespace) hands it over with
//! [`ShmConnection::with_peer`] or [`ShmConnection::identify_peer`], and that identity is used
//! in place of the segment's: the pidfd for liveness (namespace-independent), the translated
//! pid for CMA (without one, CMA is off and writes use the window). A peer in another
//! namespace that nobody identified has no liveness check: its death goes unnoticed until
//! its closed word or the caller's own signs ([`ShmConnection::peer_identified`] tells).

use core::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use san_api::{
    Access, AppSource, BadAddress, Capabilities, Completion, CompletionError, CompletionKind,
    LocalSegment, MemRange, PostError, RecvSlot, RemoteDescriptor, SanConnection, SlotConfig,
    StagedSend, WrId,
};

use crate::domain::{self, DomainShared, ShmDomain};
use crate::error::ShmError;
use crate::layout::{
    ExposureEntry, Geometry, RingEntry, SideControl, ASLEEP, ENTRY_MESSAGE, ENTRY_WINDOW_WRITE,
    MAGIC, PAYLOAD_ALIGN, RUNNING, WAKING,
};
use crate::segment::{ShmSegment, Side, READY_SLOTS};
use crate::sys::{self, CmaDirection, FutexWait, GrantedRange};

/// Index of the ring counters in `SideControl::inbound_head`/`inbound_tail`.
const RING: usize = 0;
/// Index of the window counters.
const WINDOW: usize = 1;
/// `want_space`: our queue's head waits for room in the peer's ring or window.
const WANT_ROOM: u32 = 1;
/// `want_space`: our queue's head waits for the peer to publish a receive.
const WANT_RECEIVES: u32 = 2;
/// Bytes of the peer's write window allocated at a time, on its first pass.
const WINDOW_CHUNK: u64 = 64 << 10;
/// Bound on RDMA operations waiting in the outbound queue.
const MAX_QUEUED_RDMA: usize = 1024;
/// Bytes of one cross-memory copy between two checks of the peer's key.
const CMA_CHUNK: u64 = 1 << 20;
/// The journal's pages are allocated in this many chunks, each at its first use.
const JOURNAL_CHUNKS: usize = 32;

/// How long the liveness check after a hang-up waits for the peer's exit to show (see
/// [`ShmConnection::check_liveness_soon`]). Paid once per hang-up, and only while the peer
/// still looks alive.
const HANGUP_EXIT_GRACE_MS: libc::c_int = 50;

/// Tunables of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnectionConfig {
    /// How long a send may wait for the peer to post a receive before it fails with
    /// `ReceiverNotReady` (the switch's credits make this a bug indicator, not flow control).
    pub rnr_timeout: Duration,
    /// Longest spin in [`ShmConnection::wait`] before blocking, used only while the peer is
    /// running on another CPU. Near one futex wake-up (~35 µs one way on the 2-vCPU target).
    pub spin_limit: Duration,
    /// How often peer liveness is checked (bounds how long a dead peer goes unnoticed).
    pub liveness_interval: Duration,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        ConnectionConfig {
            rnr_timeout: Duration::from_millis(100),
            spin_limit: Duration::from_micros(35),
            liveness_interval: Duration::from_millis(100),
        }
    }
}

/// How a connection wakes a peer that announced it is asleep.
///
/// The default ([`FutexDoorbell`]) wakes the peer's futex. The preload adds its readiness
/// mirror (e.g. a write to the peer's socket or eventfd) and should still call
/// [`sys::futex_wake`](crate::futex_wake) for a peer blocked in [`ShmConnection::wait`].
pub trait Doorbell: Send {
    /// Called after `bell` (the peer's futex word in the segment) was advanced: when the
    /// peer had published "asleep", and when its sends wait for receives we held back (it
    /// may then sleep elsewhere, e.g. in epoll).
    fn ring(&self, bell: &AtomicU32);

    /// As [`Doorbell::ring`], for room we freed that the peer's queued sends wait for (a
    /// posted receive, ring or window space): a peer that waits to send may watch its
    /// writability alone. The default rings as for news.
    fn ring_for_room(&self, bell: &AtomicU32) {
        self.ring(bell);
    }
}

/// The default doorbell: `FUTEX_WAKE` on the peer's bell word.
#[derive(Clone, Copy, Debug, Default)]
pub struct FutexDoorbell;

impl Doorbell for FutexDoorbell {
    fn ring(&self, bell: &AtomicU32) {
        sys::futex_wake(bell);
    }
}

/// Why [`ShmConnection::wait`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WaitResult {
    /// The peer published something (or there is local work): call `poll_completions`.
    Notified,
    /// Nothing happened within the timeout.
    TimedOut,
    /// The peer is gone; `poll_completions` will report the errors.
    Disconnected,
}

/// Counters of a connection's waiting and waking.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct WaitStats {
    /// Waits satisfied while spinning (no sleep, no wake-up needed).
    pub spins_paid_off: u64,
    /// Spins that ran out and fell through to sleeping.
    pub spins_wasted: u64,
    /// Futex waits entered.
    pub sleeps: u64,
    /// Doorbells rung for a sleeping peer.
    pub wakeups_sent: u64,
    /// Window-write chunks from the peer refused by the rkey check (and dropped).
    pub window_writes_rejected: u64,
}

#[derive(Default)]
struct Counters {
    spins_paid_off: AtomicU64,
    spins_wasted: AtomicU64,
    sleeps: AtomicU64,
    wakeups_sent: AtomicU64,
    window_writes_rejected: AtomicU64,
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Idle,
    Posted,
    /// A message of `len` bytes, `offset` bytes into the slot.
    Holding {
        len: u32,
        offset: u32,
    },
}

/// A message staged in a posted slot of the peer, waiting for its publication.
#[derive(Clone, Copy, Debug)]
struct Staged {
    wr_id: WrId,
    slot: u32,
    len: u32,
    /// How far into the slot the message starts.
    offset: u32,
}

/// How far into its slot a message of a `head_len`-byte header and a `payload_len`-byte
/// payload copied from `placement` (see `AppSource::placement`) goes: its payload then lies
/// at the same place within a [`PAYLOAD_ALIGN`] block as its source, so the copy into the
/// slot never writes a few bytes past where it reads (the slots' page offsets step through
/// every multiple of 64 of a page; where a slot's came to lie a few bytes past the source's,
/// a 16 KiB copy ran at a twentieth of its speed). A message without payload starts at the
/// slot's start.
fn message_offset(head_len: usize, payload_len: usize, placement: usize) -> usize {
    if payload_len == 0 {
        0
    } else {
        (placement % PAYLOAD_ALIGN + PAYLOAD_ALIGN - head_len % PAYLOAD_ALIGN) % PAYLOAD_ALIGN
    }
}

#[derive(Debug)]
enum Outbound {
    Send {
        wr_id: WrId,
        /// The message: its header's `head_len` bytes, then the payload.
        bytes: Vec<u8>,
        head_len: usize,
    },
    Rdma {
        wr_id: WrId,
        direction: CmaDirection,
        local: LocalSegment,
        remote: RemoteDescriptor,
        done: u64,
    },
}

impl Outbound {
    fn completion(&self, status: Result<(), CompletionError>) -> Completion {
        match self {
            Outbound::Send { wr_id, .. } => Completion {
                wr_id: *wr_id,
                kind: CompletionKind::Send,
                status,
            },
            Outbound::Rdma {
                wr_id, direction, ..
            } => Completion {
                wr_id: *wr_id,
                kind: match direction {
                    CmaDirection::Read => CompletionKind::Read,
                    CmaDirection::Write => CompletionKind::Write,
                },
                status,
            },
        }
    }
}

/// Why an outbound operation cannot proceed now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Blocked {
    /// The creator has no peer yet.
    NotAttached,
    /// The peer has no receive posted.
    NoReceive,
    /// The peer's ring or window is full.
    NoSpace,
}

enum Step {
    /// Finished (successfully or not) with this completion (`pump_outbound` fills in the
    /// request's `wr_id`).
    Done(Completion),
    /// Made progress but is not finished.
    Partial,
    /// Cannot proceed now.
    Blocked(Blocked),
    /// The peer broke the protocol or vanished: take the connection down.
    Down(CompletionError),
}

struct Peer {
    /// A pid of our namespace (`None`: the peer has none here, or it is unknown).
    pid: Option<u32>,
    /// Shared by every connection to the same process ([`sys::shared_pidfd`]).
    pidfd: Option<Arc<OwnedFd>>,
}

/// The peer process as the kernel named it to the caller (see **Peer identity** above).
#[derive(Debug, Default)]
pub struct PeerProcess {
    /// The peer's pid in our pid namespace (e.g. from `SO_PEERCRED`, which the kernel
    /// translates), `None` when the peer has none here (its namespace is not below ours).
    pub pid: Option<u32>,
    /// A pidfd of the peer (from `pidfd_open` on `pid`, `SO_PEERPIDFD`, or passed by the
    /// peer with `SCM_RIGHTS`): names it in any namespace.
    pub pidfd: Option<OwnedFd>,
}

impl PeerProcess {
    /// Whether this says anything about the peer at all.
    pub fn is_known(&self) -> bool {
        self.pid.is_some() || self.pidfd.is_some()
    }
}

/// How the peer's side of the connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerEnd {
    /// It closed its connection (`closed` word).
    Closed,
    /// Its process ended without closing (exit, kill, crash).
    Died,
}

/// What a peer that ended left behind for us (see [`ShmConnection::peer_leftovers`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Leftovers {
    /// The stream bytes its application had handed over past those we received.
    pub bytes: Vec<u8>,
    /// Stream bytes its application had read of ours.
    pub consumed: u64,
    /// It closed abortively (a reset).
    pub aborted: bool,
}

/// The peer's journal words do not describe bytes its journal can hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CorruptJournal;

/// Our journal's pages could not be allocated (the file system is full).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JournalUnavailable;

/// A reliable, ordered connection to the peer process over a shared segment.
pub struct ShmConnection {
    segment: ShmSegment,
    geometry: Geometry,
    me: Side,
    domain: Arc<DomainShared>,
    config: ConnectionConfig,
    doorbell: Box<dyn Doorbell>,
    multi_cpu: bool,
    // Receive side (our area).
    posted: VecDeque<(u16, WrId)>,
    /// Receives the session posted into slots whose pages are not allocated yet, in the
    /// order posted: published once their slots are (see [`ShmConnection::grow_slots`]).
    held_back: VecDeque<(u16, WrId)>,
    /// Our receive slots `[0, slots_ready)` have their pages allocated.
    slots_ready: usize,
    /// Allocating more receive slots failed (full file system): we use those we have.
    slots_capped: bool,
    /// Receives held back were published since [`ShmConnection::take_slots_grown`] last
    /// looked: sends the peer had to queue for want of them can move now.
    slots_grown: bool,
    /// Bytes `[0, peer_window_ready)` of the peer's write window have their pages allocated.
    peer_window_ready: u64,
    slot_state: Vec<SlotState>,
    my_post_head: u64,
    my_ring_tail: u64,
    my_window_tail: u64,
    // Send side (counters we own in the peer's area).
    peer_post_tail: u64,
    peer_ring_head: u64,
    peer_window_head: u64,
    outbound: VecDeque<Outbound>,
    /// Messages copied into the peer's next posted slots and not yet published (see
    /// [`SanConnection::stage_send_from`]), in the order they go.
    staged: Vec<Staged>,
    queued_rdma: usize,
    sends_in_flight: usize,
    rnr_since: Option<Instant>,
    completions: VecDeque<Completion>,
    up: bool,
    peer: Option<Peer>,
    /// The caller's identity of the peer, used at the attach in place of the segment's.
    given_peer: Option<PeerProcess>,
    cma_permitted: bool,
    self_cma: bool,
    /// When liveness was last checked, on the coarse clock ([`sys::coarse_now`]).
    last_liveness_check: Duration,
    /// Set by [`ShmConnection::check_liveness_soon`].
    liveness_due: bool,
    /// Set with `liveness_due`: the next liveness check waits up to
    /// [`HANGUP_EXIT_GRACE_MS`] for the peer's exit.
    hangup_seen: bool,
    peer_gone: AtomicBool,
    /// How the peer ended, once the connection went down for it.
    peer_end: Option<PeerEnd>,
    /// Which of our journal's [`JOURNAL_CHUNKS`] chunks have their pages allocated (all at
    /// creation on kernels that cannot allocate them through the mapping; else each at its
    /// first use, so a connection that holds back a few bytes allocates a few pages).
    journal_ready: u32,
    /// Our bell as of the start of the last `poll_completions`: `wait` reports anything the
    /// peer published since then, even if it landed before `wait` was called.
    bell_seen: AtomicU32,
    counters: Counters,
}

impl core::fmt::Debug for ShmConnection {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ShmConnection")
            .field("segment", &self.segment)
            .field("up", &self.up)
            .field("cma_permitted", &self.cma_permitted)
            .field("posted", &self.posted.len())
            .field("outbound", &self.outbound.len())
            .finish_non_exhaustive()
    }
}

impl ShmConnection {
    /// Drives `segment` as a connection whose memory registrations come from `domain`.
    pub fn new(
        segment: ShmSegment,
        domain: &ShmDomain,
        config: ConnectionConfig,
    ) -> Result<ShmConnection, ShmError> {
        Self::with_doorbell(segment, domain, config, Box::new(FutexDoorbell))
    }

    /// As [`ShmConnection::new`], with a custom doorbell (the preload's readiness mirror).
    pub fn with_doorbell(
        segment: ShmSegment,
        domain: &ShmDomain,
        config: ConnectionConfig,
        doorbell: Box<dyn Doorbell>,
    ) -> Result<ShmConnection, ShmError> {
        Self::with_peer(segment, domain, config, doorbell, None)
    }

    /// As [`ShmConnection::with_doorbell`], with the peer as the kernel named it to the caller
    /// (used in place of the pid in the segment; see **Peer identity**).
    pub fn with_peer(
        segment: ShmSegment,
        domain: &ShmDomain,
        config: ConnectionConfig,
        doorbell: Box<dyn Doorbell>,
        peer: Option<PeerProcess>,
    ) -> Result<ShmConnection, ShmError> {
        if config.liveness_interval.is_zero() {
            return Err(ShmError::InvalidConfig(
                "liveness_interval must be positive",
            ));
        }
        let geometry = *segment.geometry();
        let me = segment.side();
        domain
            .shared()
            .publish_to(segment.map(), geometry, me.index());
        let mut connection = ShmConnection {
            geometry,
            me,
            domain: domain.shared().clone(),
            config,
            doorbell,
            multi_cpu: sys::multi_cpu(),
            posted: VecDeque::with_capacity(usize::from(geometry.slots.recv_slots)),
            held_back: VecDeque::new(),
            slots_ready: if sys::can_populate() {
                READY_SLOTS.min(usize::from(geometry.slots.recv_slots))
            } else {
                usize::from(geometry.slots.recv_slots)
            },
            slots_capped: false,
            slots_grown: false,
            peer_window_ready: if sys::can_populate() {
                0
            } else {
                u64::from(geometry.window_size)
            },
            slot_state: vec![SlotState::Idle; usize::from(geometry.slots.recv_slots)],
            my_post_head: 0,
            my_ring_tail: 0,
            my_window_tail: 0,
            peer_post_tail: 0,
            peer_ring_head: 0,
            peer_window_head: 0,
            outbound: VecDeque::new(),
            staged: Vec::with_capacity(usize::from(geometry.slots.send_slots)),
            queued_rdma: 0,
            sends_in_flight: 0,
            rnr_since: None,
            completions: VecDeque::new(),
            up: true,
            peer: None,
            given_peer: peer.filter(PeerProcess::is_known),
            cma_permitted: false,
            self_cma: true,
            last_liveness_check: sys::coarse_now(),
            liveness_due: false,
            hangup_seen: false,
            peer_gone: AtomicBool::new(false),
            peer_end: None,
            journal_ready: if sys::can_populate() { 0 } else { u32::MAX },
            bell_seen: AtomicU32::new(0),
            counters: Counters::default(),
            segment,
        };
        connection.learn_peer();
        Ok(connection)
    }

    /// The segment this connection drives.
    pub fn segment(&self) -> &ShmSegment {
        &self.segment
    }

    /// What this connection can do with its peer: `rdma_read` is true only when CMA to the
    /// peer is permitted (known once the peer attached) and not disabled by the domain.
    pub fn capabilities(&self) -> Capabilities {
        domain::capabilities(&self.domain.config, self.cma_permitted)
    }

    /// True while the connection is usable (not closed, peer alive and well-behaved).
    pub fn is_up(&self) -> bool {
        self.up
    }

    /// True once the peer is known (always on the attacher; on the creator after attach).
    pub fn is_peer_attached(&self) -> bool {
        self.peer.is_some() || self.segment.is_attached()
    }

    /// The waiting and waking counters.
    pub fn stats(&self) -> WaitStats {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        WaitStats {
            spins_paid_off: load(&self.counters.spins_paid_off),
            spins_wasted: load(&self.counters.spins_wasted),
            sleeps: load(&self.counters.sleeps),
            wakeups_sent: load(&self.counters.wakeups_sent),
            window_writes_rejected: load(&self.counters.window_writes_rejected),
        }
    }

    /// Bytes of our outbound journal: the most stream bytes the caller may keep there.
    ///
    /// The journal holds the stream bytes our application handed over that have not
    /// reached the peer's receive slots yet; the peer reads it if we close or die before
    /// they could, so that a byte `send()` accepted is not lost with the process. Byte `o`
    /// of the stream (counted from the first byte sent on this connection) lives at
    /// `o % journal_size()`: the caller writes every byte not yet in the peer's slots (see
    /// [`ShmConnection::queued_send_bytes`]) with [`ShmConnection::journal_write`] and then
    /// publishes the stream's end with [`ShmConnection::journal_publish`]. It must never
    /// have more than `journal_size()` such bytes.
    pub fn journal_size(&self) -> usize {
        self.geometry.journal_size as usize
    }

    /// Bytes of messages posted here that wait for room in the peer's slots or ring (their
    /// whole length, headers included: an upper bound on the stream bytes they carry).
    pub fn queued_send_bytes(&self) -> usize {
        self.outbound
            .iter()
            .map(|op| match op {
                Outbound::Send { bytes, .. } => bytes.len(),
                Outbound::Rdma { .. } => 0,
            })
            .sum()
    }

    /// Writes `bytes`, stream bytes from `offset` on, into our journal (at most
    /// [`ShmConnection::journal_size`] bytes). The first write allocates the journal's pages;
    /// a full file system fails it with [`JournalUnavailable`] (and nothing is written), and
    /// so does a source that cannot be read (what was written then is not to be trusted).
    pub fn journal_write<S: AppSource + ?Sized>(
        &mut self,
        offset: u64,
        bytes: &S,
    ) -> Result<(), JournalUnavailable> {
        let size = self.journal_size();
        let len = bytes.len();
        if len > size {
            return Err(JournalUnavailable);
        }
        let me = self.me.index();
        // NOTE(cast): the remainder is below `size`, a u32.
        let pos = (offset % size as u64) as usize;
        let first = len.min(size - pos);
        self.journal_allocate(pos, first)?;
        self.journal_allocate(0, len - first)?;
        let map = self.segment.map();
        // Bytes the application's buffer no longer gives (changed under a call in flight)
        // leave a journal that cannot be trusted: as unavailable as a full file system.
        map.copy_in_from(self.geometry.journal(me, pos), bytes, 0, first)
            .map_err(|BadAddress| JournalUnavailable)?;
        map.copy_in_from(self.geometry.journal(me, 0), bytes, first, len - first)
            .map_err(|BadAddress| JournalUnavailable)?;
        Ok(())
    }

    /// Allocates the pages of the journal chunks under `[pos, pos + len)` not allocated yet.
    fn journal_allocate(&mut self, pos: usize, len: usize) -> Result<(), JournalUnavailable> {
        if len == 0 {
            return Ok(());
        }
        let chunk = self.journal_chunk();
        let me = self.me.index();
        for index in pos / chunk..=(pos + len - 1) / chunk {
            if self.journal_ready & (1 << index) != 0 {
                continue;
            }
            let start = index * chunk;
            let end = (start + chunk).min(self.journal_size());
            self.segment
                .map()
                .populate(self.geometry.journal(me, start), end - start)
                .map_err(|_| JournalUnavailable)?;
            self.journal_ready |= 1 << index;
        }
        Ok(())
    }

    /// Bytes of one journal chunk: a 32nd of the journal, whole pages.
    fn journal_chunk(&self) -> usize {
        self.journal_size()
            .div_ceil(JOURNAL_CHUNKS)
            .next_multiple_of(4096)
    }

    /// Publishes that our stream ends at `head` (every byte up to it that the peer's slots
    /// do not hold is in the journal).
    pub fn journal_publish(&self, head: u64) {
        self.my_control()
            .journal
            .0
            .head
            .store(head, Ordering::Release);
    }

    /// Publishes how many of the peer's stream bytes our application has read.
    pub fn publish_consumed(&self, consumed: u64) {
        self.my_control()
            .journal
            .0
            .consumed
            .store(consumed, Ordering::Relaxed);
    }

    /// Publishes that we close abortively: the peer resets whatever it read.
    pub fn publish_aborted(&self) {
        self.my_control()
            .journal
            .0
            .aborted
            .store(1, Ordering::Relaxed);
    }

    /// How the peer ended, once the connection went down because it closed or died.
    pub fn peer_end(&self) -> Option<PeerEnd> {
        self.peer_end
    }

    /// After the peer ended: the stream bytes it handed over from `received` (the stream
    /// bytes we received from it, all of its messages drained) to the end it published, and
    /// how much of ours it read. [`CorruptJournal`] when its words describe more than its
    /// journal can hold.
    pub fn peer_leftovers(&self, received: u64) -> Result<Leftovers, CorruptJournal> {
        let words = &self.peer_control().journal.0;
        let head = words.head.load(Ordering::Acquire);
        let consumed = words.consumed.load(Ordering::Relaxed);
        let aborted = words.aborted.load(Ordering::Relaxed) != 0;
        // A head behind what we received: it died between transmitting and publishing, so
        // the send that carried those bytes never returned. Nothing more is owed.
        let len = head.saturating_sub(received);
        let size = self.journal_size();
        if len > size as u64 {
            return Err(CorruptJournal);
        }
        // NOTE(cast): `len <= size` and the remainder is below `size`, both usize.
        let (len, pos) = (len as usize, (received % size as u64) as usize);
        let mut bytes = Vec::with_capacity(len);
        if len > 0 {
            let peer = self.me.peer().index();
            let map = self.segment.map();
            let first = len.min(size - pos);
            bytes.extend_from_slice(map.bytes(self.geometry.journal(peer, pos), first));
            bytes.extend_from_slice(map.bytes(self.geometry.journal(peer, 0), len - first));
        }
        Ok(Leftovers {
            bytes,
            consumed,
            aborted,
        })
    }

    fn my_control(&self) -> &SideControl {
        self.segment.control(self.me)
    }

    fn peer_control(&self) -> &SideControl {
        self.segment.control(self.me.peer())
    }

    /// The peer as the kernel named it to the caller (see **Peer identity**), used from now
    /// on in place of what the segment says; CMA is probed again. For before the session
    /// starts: the capabilities may change.
    /// An unknown `peer` changes nothing (the segment's pid is used when the peer shares our
    /// namespace).
    pub fn identify_peer(&mut self, peer: PeerProcess) {
        if peer.is_known() {
            self.given_peer = Some(peer);
            self.peer = None;
        }
        self.learn_peer();
    }

    /// Whether the peer's liveness can be checked: it has a pidfd or a pid of our namespace
    /// (false before the attach).
    pub fn peer_identified(&self) -> bool {
        self.peer
            .as_ref()
            .is_some_and(|peer| peer.pid.is_some() || peer.pidfd.is_some())
    }

    /// Learns the peer's identity once attached, and probes whether CMA reaches it.
    fn learn_peer(&mut self) {
        if self.peer.is_some() || !self.segment.is_attached() {
            return;
        }
        self.segment.release_creator_lock();
        let (pid, pidfd) = match self.given_peer.take() {
            Some(given) => (given.pid, given.pidfd),
            // Only a pid of our namespace is ever opened, signalled or read from.
            None => {
                let pid = self.segment.peer_pid();
                (pid, pid.and_then(sys::pidfd_open))
            }
        };
        let base = self
            .peer_control()
            .identity
            .0
            .base_addr
            .load(Ordering::Relaxed);
        // Never into the process of a private segment's peer (possibly another user's: see
        // `ShmSegment::create_private`), whatever the kernel would allow (root may).
        self.cma_permitted = !self.domain.config.force_window
            && !self.segment.is_private()
            && base.checked_add(8).is_some()
            && pid.is_some_and(|pid| sys::cma_probe(pid, base).is_ok_and(|word| word == MAGIC));
        let pidfd = sys::shared_pidfd(pid, pidfd);
        self.peer = Some(Peer { pid, pidfd });
        self.last_liveness_check = sys::coarse_now();
    }

    /// Wakes the peer after publishing something for it (the sender half of the Dekker pair
    /// described in [`ShmConnection::wait`]).
    fn notify_peer(&self) {
        if self.peer_control().notify(|bell| self.doorbell.ring(bell)) {
            bump(&self.counters.wakeups_sent);
        }
    }

    /// After freeing room the peer may be waiting for (posted receive, ring or window space).
    fn notify_peer_if_waiting_for_space(&self) {
        if self.peer.is_none() {
            return;
        }
        let control = self.peer_control();
        match control.identity.0.want_space.load(Ordering::SeqCst) {
            0 => {}
            // Its sends wait for receives its session counted as posted long ago (ours held
            // back until their slots were allocated): nothing at the session level will wake
            // it, so ring even a peer that is not asleep here (it may sleep in epoll, or wait
            // for a rendezvous completion watching its writability alone).
            WANT_RECEIVES => {
                control.ring(|bell| self.doorbell.ring_for_room(bell));
            }
            _ => {
                if control.notify(|bell| self.doorbell.ring_for_room(bell)) {
                    bump(&self.counters.wakeups_sent);
                }
            }
        }
    }

    fn recv_slots(&self) -> u64 {
        u64::from(self.geometry.slots.recv_slots)
    }

    /// Whether the peer's inbound ring has room; `Err(())` when the peer corrupted its tail.
    fn ring_room(&self) -> Result<bool, ()> {
        let tail = self.peer_control().inbound_tail.0[RING].load(Ordering::SeqCst);
        let used = self.peer_ring_head.wrapping_sub(tail);
        if used > u64::from(self.geometry.ring_entries) {
            return Err(());
        }
        Ok(used < u64::from(self.geometry.ring_entries))
    }

    fn push_entry(
        &mut self,
        kind: u32,
        slot: u32,
        len: u32,
        rkey: u32,
        dest: u64,
        window_pos: u64,
    ) {
        let peer = self.me.peer().index();
        let index = (self.peer_ring_head % u64::from(self.geometry.ring_entries)) as usize;
        let entry: &RingEntry = self
            .segment
            .map()
            .get(self.geometry.ring_entry(peer, index));
        entry.kind.store(kind, Ordering::Relaxed);
        entry.slot.store(slot, Ordering::Relaxed);
        entry.len.store(len, Ordering::Relaxed);
        entry.rkey.store(rkey, Ordering::Relaxed);
        entry.dest.store(dest, Ordering::Relaxed);
        entry.window_pos.store(window_pos, Ordering::Relaxed);
        self.peer_ring_head += 1;
        self.peer_control().inbound_head.0[RING].store(self.peer_ring_head, Ordering::Release);
    }

    /// Copies the message `header` then `payload` into the peer's oldest posted slot and
    /// publishes it.
    fn try_send(&mut self, header: &[u8], payload: &[u8]) -> Result<(), Step> {
        if self.peer.is_none() {
            return Err(Step::Blocked(Blocked::NotAttached));
        }
        let peer = self.me.peer().index();
        let head = self.peer_control().post_head.0.load(Ordering::SeqCst);
        let posted = head.wrapping_sub(self.peer_post_tail);
        if posted == 0 {
            return Err(Step::Blocked(Blocked::NoReceive));
        }
        if posted > self.recv_slots() {
            return Err(Step::Down(CompletionError::Fatal));
        }
        match self.ring_room() {
            Ok(true) => {}
            Ok(false) => return Err(Step::Blocked(Blocked::NoSpace)),
            Err(()) => return Err(Step::Down(CompletionError::Fatal)),
        }
        let fifo_index = (self.peer_post_tail % self.recv_slots()) as usize;
        let slot = self
            .segment
            .map()
            .get::<AtomicU32>(self.geometry.fifo_entry(peer, fifo_index))
            .load(Ordering::Relaxed);
        if slot >= u32::from(self.geometry.slots.recv_slots) {
            return Err(Step::Down(CompletionError::Fatal));
        }
        let offset = message_offset(header.len(), payload.len(), payload.as_ptr() as usize);
        let at = self.geometry.slot(peer, slot as usize) + offset;
        self.segment.map().copy_in(at, header);
        if !payload.is_empty() {
            self.segment.map().copy_in(at + header.len(), payload);
        }
        let len = header.len() + payload.len();
        self.peer_post_tail += 1;
        self.peer_control()
            .post_tail
            .0
            .store(self.peer_post_tail, Ordering::Release);
        // NOTE(cast): `len <= slot_size` (a u32) was checked when the send was posted, and
        // `offset < PAYLOAD_ALIGN`.
        self.push_entry(ENTRY_MESSAGE, slot, len as u32, offset as u32, 0, 0);
        Ok(())
    }

    /// The peer's posted receive slot `ahead` places after the one the next message takes,
    /// when the peer posted that many and its inbound ring has room for as many more entries
    /// (`None` otherwise, also when the peer's counters make no sense: the ordinary send path
    /// finds that out and fails the connection).
    fn peer_slot_ahead(&self, ahead: u64) -> Option<u32> {
        let peer = self.me.peer().index();
        let head = self.peer_control().post_head.0.load(Ordering::SeqCst);
        let posted = head.wrapping_sub(self.peer_post_tail);
        if posted <= ahead || posted > self.recv_slots() {
            return None;
        }
        let tail = self.peer_control().inbound_tail.0[RING].load(Ordering::SeqCst);
        let used = self.peer_ring_head.wrapping_sub(tail);
        let entries = u64::from(self.geometry.ring_entries);
        if used > entries || used.saturating_add(ahead) >= entries {
            return None;
        }
        let fifo_index = ((self.peer_post_tail + ahead) % self.recv_slots()) as usize;
        let slot = self
            .segment
            .map()
            .get::<AtomicU32>(self.geometry.fifo_entry(peer, fifo_index))
            .load(Ordering::Relaxed);
        (slot < u32::from(self.geometry.slots.recv_slots)).then_some(slot)
    }

    /// Checks a remote descriptor against the peer's published exposure table.
    fn check_remote(
        &self,
        remote: &RemoteDescriptor,
        len: u64,
        needs: Access,
    ) -> Result<(), CompletionError> {
        let peer = self.me.peer().index();
        let (access, range) =
            domain::read_exposure(self.segment.map(), &self.geometry, peer, remote.rkey)
                .ok_or(CompletionError::RemoteAccess)?;
        let wanted = MemRange::new(remote.addr, len);
        (access.contains(needs) && range.contains(&wanted) && wanted.end() > wanted.addr)
            .then_some(())
            .ok_or(CompletionError::RemoteAccess)
    }

    /// One step of an RDMA operation at the head of the outbound queue.
    fn step_rdma(
        &mut self,
        direction: CmaDirection,
        local: LocalSegment,
        remote: RemoteDescriptor,
        done: &mut u64,
    ) -> Step {
        let Some(peer) = self.peer.as_ref() else {
            return Step::Blocked(Blocked::NotAttached);
        };
        // Without a pid of ours CMA was never permitted (the window path below).
        let peer_pid = peer.pid.unwrap_or(0);
        let kind = match direction {
            CmaDirection::Read => CompletionKind::Read,
            CmaDirection::Write => CompletionKind::Write,
        };
        let finish = |status| {
            Step::Done(Completion {
                wr_id: WrId(0),
                kind,
                status,
            })
        };
        // Re-checked at every step: a deregistration must stop a transfer in progress.
        let granted = match self
            .domain
            .local_segment(&local, direction == CmaDirection::Read)
        {
            Ok(granted) => granted,
            Err(e) => return finish(Err(e)),
        };
        let needs = match direction {
            CmaDirection::Read => Access::REMOTE_READ,
            CmaDirection::Write => Access::REMOTE_WRITE,
        };
        if *done == 0 {
            if let Err(e) = self.check_remote(&remote, granted.len, needs) {
                return finish(Err(e));
            }
        }
        if !self.cma_permitted {
            return match direction {
                CmaDirection::Read => finish(Err(CompletionError::Fatal)),
                CmaDirection::Write => self.step_window_write(granted, remote, done),
            };
        }
        // In chunks, the peer's key checked again before each: a copy cannot be stopped once
        // the kernel runs it, so revoking a registration (the peer reset and reuses its sink)
        // lets at most the chunk under way land, not the rest of a transfer of up to 1 GiB.
        // Each chunk is announced in the peer's exposure entry before its key is checked
        // (`ExposureEntry::copies_in_flight`): the peer's revocation either is seen here or
        // waits for the copy to end, so no chunk lands after revocation returned.
        let map = self.segment.map().clone();
        let announced: &AtomicU32 = &map
            .get::<ExposureEntry>(self.geometry.exposure_entry(
                self.me.peer().index(),
                (remote.rkey.0 & domain::INDEX_MASK) as usize,
            ))
            .copies_in_flight;
        let mut copied = 0u64;
        while copied < granted.len {
            let len = (granted.len - copied).min(CMA_CHUNK);
            announced.fetch_add(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            if let Err(e) = self.check_remote(&remote, granted.len, needs) {
                announced.fetch_sub(1, Ordering::SeqCst);
                return finish(Err(e));
            }
            let (local_addr, remote_addr) = (granted.addr + copied, remote.addr + copied);
            let result = sys::cma_copy(direction, peer_pid, local_addr, remote_addr, len);
            announced.fetch_sub(1, Ordering::SeqCst);
            match result {
                Ok(moved) if moved == len => copied += len,
                Ok(_) => return finish(Err(CompletionError::RemoteAccess)),
                Err(e) => {
                    return match e.raw_os_error() {
                        Some(libc::ESRCH) => Step::Down(CompletionError::RetryExceeded),
                        Some(libc::EFAULT) if !sys::range_is_mapped(local_addr, len) => {
                            finish(Err(CompletionError::LocalProtection))
                        }
                        Some(libc::EFAULT) => finish(Err(CompletionError::RemoteAccess)),
                        Some(libc::EPERM | libc::ENOSYS)
                            if direction == CmaDirection::Write && copied == 0 =>
                        {
                            // CMA became unavailable (e.g. the peer changed credentials):
                            // fall back.
                            self.cma_permitted = false;
                            self.step_window_write(granted, remote, done)
                        }
                        _ => finish(Err(CompletionError::Fatal)),
                    };
                }
            }
        }
        finish(Ok(()))
    }

    /// Copies as much of a window write as fits into the peer's window.
    fn step_window_write(
        &mut self,
        granted: GrantedRange,
        remote: RemoteDescriptor,
        done: &mut u64,
    ) -> Step {
        let peer = self.me.peer().index();
        let window_size = u64::from(self.geometry.window_size);
        let mut progressed = false;
        while *done < granted.len {
            let tail = self.peer_control().inbound_tail.0[WINDOW].load(Ordering::SeqCst);
            let used = self.peer_window_head.wrapping_sub(tail);
            if used > window_size {
                return Step::Down(CompletionError::Fatal);
            }
            match self.ring_room() {
                Ok(true) => {}
                Ok(false) => {
                    return if progressed {
                        Step::Partial
                    } else {
                        Step::Blocked(Blocked::NoSpace)
                    }
                }
                Err(()) => return Step::Down(CompletionError::Fatal),
            }
            let pos = self.peer_window_head % window_size;
            let chunk = (granted.len - *done)
                .min(window_size - used)
                .min(window_size - pos);
            if chunk == 0 {
                return if progressed {
                    Step::Partial
                } else {
                    Step::Blocked(Blocked::NoSpace)
                };
            }
            let source = GrantedRange {
                addr: granted.addr + *done,
                len: chunk,
            };
            if let Err(error) = self.window_allocate(pos, chunk) {
                return Step::Down(error);
            }
            // NOTE(cast): `pos < window_size <= u32::MAX`.
            let offset = self.geometry.window(peer, pos as usize);
            if let Err(status) = self.copy_granted(CmaDirection::Read, source, offset) {
                return Step::Done(Completion {
                    wr_id: WrId(0),
                    kind: CompletionKind::Write,
                    status: Err(status),
                });
            }
            self.peer_window_head += chunk;
            self.peer_control().inbound_head.0[WINDOW]
                .store(self.peer_window_head, Ordering::Release);
            // NOTE(cast): `chunk <= window_size <= u32::MAX`.
            self.push_entry(
                ENTRY_WINDOW_WRITE,
                0,
                chunk as u32,
                remote.rkey.0,
                remote.addr + *done,
                self.peer_window_head - chunk,
            );
            *done += chunk;
            progressed = true;
        }
        Step::Done(Completion {
            wr_id: WrId(0),
            kind: CompletionKind::Write,
            status: Ok(()),
        })
    }

    /// Copies between a granted range of our own memory and the mapping at `offset`: through
    /// the kernel (CMA on our own pid) so an unmapped range is an error, not a crash; plainly
    /// only where the kernel refuses CMA altogether.
    fn copy_granted(
        &mut self,
        direction: CmaDirection,
        granted: GrantedRange,
        offset: usize,
    ) -> Result<(), CompletionError> {
        let len = usize::try_from(granted.len).map_err(|_| CompletionError::LocalProtection)?;
        let shared = self.segment.map().addr_of(offset, len);
        if self.self_cma {
            // Read: from our app memory ("remote" = ourselves) into the mapping; write: back.
            match sys::cma_copy(
                direction,
                std::process::id(),
                shared,
                granted.addr,
                granted.len,
            ) {
                Ok(moved) if moved == granted.len => return Ok(()),
                Ok(_) => return Err(CompletionError::LocalProtection),
                Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::ENOSYS)) => {
                    self.self_cma = false
                }
                Err(_) => return Err(CompletionError::LocalProtection),
            }
        }
        sys::plain_copy_granted(direction, granted, self.segment.map(), offset);
        Ok(())
    }

    /// Advances the outbound queue as far as the peer's resources allow.
    fn pump_outbound(&mut self) {
        let mut published = false;
        while self.up {
            let Some(mut op) = self.outbound.pop_front() else {
                break;
            };
            let step = match &mut op {
                Outbound::Send {
                    bytes, head_len, ..
                } => match self.try_send(&bytes[..*head_len], &bytes[*head_len..]) {
                    Ok(()) => Step::Done(op.completion(Ok(()))),
                    Err(step) => step,
                },
                Outbound::Rdma {
                    direction,
                    local,
                    remote,
                    done,
                    ..
                } => {
                    let (direction, local, remote) = (*direction, *local, *remote);
                    let mut progress = *done;
                    let step = self.step_rdma(direction, local, remote, &mut progress);
                    let window_moved = progress != *done;
                    *done = progress;
                    published |= window_moved;
                    step
                }
            };
            match step {
                Step::Done(completion) => {
                    published |= matches!(op, Outbound::Send { .. });
                    if matches!(op, Outbound::Rdma { .. }) {
                        self.queued_rdma -= 1;
                    }
                    self.rnr_since = None;
                    self.completions.push_back(Completion {
                        wr_id: op.completion(Ok(())).wr_id,
                        ..completion
                    });
                }
                Step::Partial => {
                    self.outbound.push_front(op);
                    self.rnr_since = None;
                    if self.note_blocked(Blocked::NoSpace) {
                        continue;
                    }
                    break;
                }
                Step::Blocked(why) => {
                    self.outbound.push_front(op);
                    if self.note_blocked(why) {
                        continue; // room appeared between the check and the flag: retry now
                    }
                    break;
                }
                Step::Down(error) => {
                    self.outbound.push_front(op);
                    self.go_down(error);
                }
            }
        }
        if self.outbound.is_empty() {
            self.my_control()
                .identity
                .0
                .want_space
                .store(0, Ordering::Relaxed);
        }
        if published {
            self.notify_peer();
        }
    }

    /// Records that the head of the queue is blocked: raises `want_space` (Dekker: flag, then
    /// re-check) and runs the RNR timer. Returns true when the re-check found room after all.
    fn note_blocked(&mut self, why: Blocked) -> bool {
        if why == Blocked::NotAttached {
            return false;
        }
        if why == Blocked::NoReceive {
            let now = Instant::now();
            let since = *self.rnr_since.get_or_insert(now);
            if now.duration_since(since) >= self.config.rnr_timeout {
                self.go_down(CompletionError::ReceiverNotReady);
                return false;
            }
        }
        // First time raised: the peer may have freed room just before it could see the flag,
        // so look once more. While the flag stays raised the peer notifies on every release.
        let want = if why == Blocked::NoReceive {
            WANT_RECEIVES
        } else {
            WANT_ROOM
        };
        self.my_control()
            .identity
            .0
            .want_space
            .swap(want, Ordering::SeqCst)
            == 0
    }

    /// Delivers everything the peer published into our area: messages become `Recv`
    /// completions, window writes are applied — strictly in ring order.
    fn process_inbound(&mut self) {
        let me = self.me.index();
        let head = self.my_control().inbound_head.0[RING].load(Ordering::Acquire);
        let available = head.wrapping_sub(self.my_ring_tail);
        if available == 0 {
            return;
        }
        if available > u64::from(self.geometry.ring_entries) {
            self.go_down(CompletionError::Fatal);
            return;
        }
        let mut window_freed = false;
        while self.my_ring_tail != head && self.up {
            let index = (self.my_ring_tail % u64::from(self.geometry.ring_entries)) as usize;
            let entry: &RingEntry = self.segment.map().get(self.geometry.ring_entry(me, index));
            let kind = entry.kind.load(Ordering::Relaxed);
            let slot = entry.slot.load(Ordering::Relaxed);
            let len = entry.len.load(Ordering::Relaxed);
            let rkey = entry.rkey.load(Ordering::Relaxed);
            let dest = entry.dest.load(Ordering::Relaxed);
            let window_pos = entry.window_pos.load(Ordering::Relaxed);
            let ok = match kind {
                ENTRY_MESSAGE => self.deliver_message(slot, len, rkey),
                ENTRY_WINDOW_WRITE => {
                    window_freed = true;
                    self.apply_window_write(len, rkey, dest, window_pos)
                }
                _ => false,
            };
            if !ok {
                self.go_down(CompletionError::Fatal);
                return;
            }
            self.my_ring_tail += 1;
        }
        self.my_control().inbound_tail.0[RING].store(self.my_ring_tail, Ordering::SeqCst);
        if window_freed {
            self.my_control().inbound_tail.0[WINDOW].store(self.my_window_tail, Ordering::SeqCst);
        }
        self.notify_peer_if_waiting_for_space();
    }

    /// A message of `len` bytes in slot `slot`, `offset` bytes into it.
    fn deliver_message(&mut self, slot: u32, len: u32, offset: u32) -> bool {
        // The peer must use our posted slots in the order we posted them.
        let Some(&(expected, wr_id)) = self.posted.front() else {
            return false;
        };
        if slot != u32::from(expected)
            || len > self.geometry.slots.slot_size
            || offset as usize >= PAYLOAD_ALIGN
        {
            return false;
        }
        self.posted.pop_front();
        self.grow_slots();
        self.slot_state[usize::from(expected)] = SlotState::Holding { len, offset };
        self.completions.push_back(Completion {
            wr_id,
            kind: CompletionKind::Recv {
                slot: RecvSlot(expected),
                len,
            },
            status: Ok(()),
        });
        true
    }

    fn apply_window_write(&mut self, len: u32, rkey: u32, dest: u64, window_pos: u64) -> bool {
        let window_size = u64::from(self.geometry.window_size);
        let head = self.my_control().inbound_head.0[WINDOW].load(Ordering::Acquire);
        let len = u64::from(len);
        let pos = window_pos % window_size;
        let valid = window_pos == self.my_window_tail
            && len > 0
            && len <= head.wrapping_sub(self.my_window_tail)
            && head.wrapping_sub(self.my_window_tail) <= window_size
            && pos + len <= window_size;
        if !valid {
            return false;
        }
        let applied = dest.checked_add(len).is_some()
            && match self
                .domain
                .exposed(rkey, MemRange::new(dest, len), Access::REMOTE_WRITE)
            {
                Ok(granted) => {
                    // NOTE(cast): `pos < window_size <= u32::MAX`.
                    let offset = self.geometry.window(self.me.index(), pos as usize);
                    self.copy_granted(CmaDirection::Write, granted, offset)
                        .is_ok()
                }
                Err(_) => false,
            };
        if !applied {
            bump(&self.counters.window_writes_rejected);
        }
        self.my_window_tail += len;
        true
    }

    /// Makes the next `poll_completions` check the peer's liveness whatever the interval: the
    /// caller saw a sign of its death (the kernel reported hang-up on a descriptor the peer
    /// held). Without it, a nonblocking caller that polls right after the death learns of it
    /// only once the interval passed, and an edge-triggered waiter gets no second event.
    pub fn check_liveness_soon(&mut self) {
        self.liveness_due = true;
        self.hangup_seen = true;
    }

    /// Checks the peer's closed word and (at most every `liveness_interval`, or when asked
    /// by [`ShmConnection::check_liveness_soon`]) its liveness.
    fn check_peer(&mut self) {
        if self.peer.is_none() {
            return;
        }
        if self
            .peer_control()
            .identity
            .0
            .closed
            .load(Ordering::Acquire)
            != 0
        {
            self.process_inbound();
            if self.up {
                self.peer_end = Some(PeerEnd::Closed);
            }
            self.go_down(CompletionError::Flushed);
            return;
        }
        let now = sys::coarse_now();
        let due = now.saturating_sub(self.last_liveness_check) >= self.config.liveness_interval;
        if !(due || self.liveness_due || self.peer_gone.load(Ordering::Relaxed)) {
            return;
        }
        self.liveness_due = false;
        self.last_liveness_check = now;
        // Once per hang-up: a dying peer's descriptors close a moment before its exit shows,
        // and an edge-triggered waiter that saw the hang-up gets no second event.
        let grace_ms = if core::mem::take(&mut self.hangup_seen) {
            HANGUP_EXIT_GRACE_MS
        } else {
            0
        };
        if self.peer_dead(grace_ms) {
            self.process_inbound();
            if self.up {
                self.peer_end = Some(PeerEnd::Died);
            }
            self.go_down(CompletionError::RetryExceeded);
        }
    }

    /// Hands a posted receive to the peer: its slot id goes into our post FIFO.
    fn publish_recv(&mut self, slot: u16, wr_id: WrId) {
        let me = self.me.index();
        let fifo_index = (self.my_post_head % self.recv_slots()) as usize;
        self.segment
            .map()
            .get::<AtomicU32>(self.geometry.fifo_entry(me, fifo_index))
            .store(u32::from(slot), Ordering::Relaxed);
        self.my_post_head += 1;
        self.my_control()
            .post_head
            .0
            .store(self.my_post_head, Ordering::SeqCst);
        self.posted.push_back((slot, wr_id));
    }

    /// Allocates more of our receive slots (twice as many as are ready) when the peer has
    /// used up every slot we published, and publishes the receives held back for them.
    /// Request/response traffic never gets here and keeps the few slots allocated at
    /// creation; a stream grows to the whole pool in a few steps. When the file system is
    /// full, the connection carries on with the slots it has.
    fn grow_slots(&mut self) {
        if self.held_back.is_empty() || self.slots_capped {
            return;
        }
        let taken = self.my_control().post_tail.0.load(Ordering::Acquire);
        if taken != self.my_post_head {
            return;
        }
        let all = usize::from(self.geometry.slots.recv_slots);
        let target = (self.slots_ready * 2).clamp(1, all);
        let (start, end) = self
            .geometry
            .slot_pages(self.me.index(), self.slots_ready, target);
        if self.segment.map().populate(start, end - start).is_err() {
            self.slots_capped = true;
            return;
        }
        self.slots_ready = target;
        let ready = self.slots_ready;
        let (publish, keep): (VecDeque<_>, VecDeque<_>) = core::mem::take(&mut self.held_back)
            .into_iter()
            .partition(|&(slot, _)| usize::from(slot) < ready);
        self.held_back = keep;
        for (slot, wr_id) in publish {
            self.publish_recv(slot, wr_id);
        }
        self.slots_grown = true;
        self.notify_peer_if_waiting_for_space();
    }

    /// Whether more of our receive slots were published since the last call: the peer's
    /// sends queued for want of posted receives (more than the few published at creation)
    /// can move, but only once its process drives them, which an idle application does not.
    pub fn take_slots_grown(&mut self) -> bool {
        core::mem::take(&mut self.slots_grown)
    }

    /// Allocates the pages of the peer's write window under `[pos, pos + len)` before we
    /// write there for the first time (the window is a ring: its first pass allocates it).
    fn window_allocate(&mut self, pos: u64, len: u64) -> Result<(), CompletionError> {
        let end = pos + len;
        if end <= self.peer_window_ready {
            return Ok(());
        }
        let window = u64::from(self.geometry.window_size);
        let upto = end.next_multiple_of(WINDOW_CHUNK).min(window);
        let peer = self.me.peer().index();
        // NOTE(cast): both below `window_size`, a u32.
        let start = self.geometry.window(peer, self.peer_window_ready as usize) / 4096 * 4096;
        let stop = self
            .geometry
            .window(peer, upto as usize)
            .next_multiple_of(4096)
            .min(self.geometry.window_pages(peer).1);
        self.segment
            .map()
            .populate(start, stop - start)
            .map_err(|_| CompletionError::Fatal)?;
        self.peer_window_ready = upto;
        Ok(())
    }

    /// Enters the error state: every outstanding request completes, the first with `first`.
    fn go_down(&mut self, first: CompletionError) {
        if !self.up {
            return;
        }
        self.up = false;
        let mut first = Some(first);
        let mut status = || Err(first.take().unwrap_or(CompletionError::Flushed));
        for op in core::mem::take(&mut self.outbound) {
            self.completions.push_back(op.completion(status()));
        }
        self.queued_rdma = 0;
        let posted = core::mem::take(&mut self.posted);
        let held_back = core::mem::take(&mut self.held_back);
        for (slot, wr_id) in posted.into_iter().chain(held_back) {
            self.slot_state[usize::from(slot)] = SlotState::Idle;
            self.completions.push_back(Completion {
                wr_id,
                kind: CompletionKind::Recv {
                    slot: RecvSlot(slot),
                    len: 0,
                },
                status: status(),
            });
        }
    }

    /// Closes the connection in order: the peer sees `closed` after everything sent so far,
    /// and every request still outstanding here completes with `Flushed`.
    pub fn close(&mut self) {
        if !self.up {
            return;
        }
        self.pump_outbound();
        self.my_control()
            .identity
            .0
            .closed
            .store(1, Ordering::Release);
        if self.peer.is_some() || self.segment.is_attached() {
            self.notify_peer();
        }
        self.go_down(CompletionError::Flushed);
    }

    /// Messages or RDMA steps posted but not yet moved (the peer had no receive posted, or
    /// its ring was full): they move at a later `poll_completions`.
    pub fn has_queued_sends(&self) -> bool {
        !self.outbound.is_empty()
    }

    /// Whether something the peer published is waiting for our next drive: a message in our
    /// inbound ring (data, credits) or a finished copy. No state changes (unlike
    /// [`ShmConnection::prepare_to_block`]): a sender about to report "no room" re-checks this
    /// after announcing that it waits, since credits already in the ring raise nothing.
    pub fn has_input(&self) -> bool {
        !self.completions.is_empty()
            || self.my_control().inbound_head.0[RING].load(Ordering::Acquire) != self.my_ring_tail
    }

    /// Shared state that calls for a poll: an undelivered ring entry, a fresh attach, a close.
    fn has_news(&self) -> bool {
        self.my_control().inbound_head.0[RING].load(Ordering::Acquire) != self.my_ring_tail
            || (self.peer.is_none() && self.segment.is_attached())
            || (self.peer.is_some()
                && self
                    .peer_control()
                    .identity
                    .0
                    .closed
                    .load(Ordering::Acquire)
                    != 0)
    }

    fn peer_dead(&self, grace_ms: libc::c_int) -> bool {
        match &self.peer {
            Some(Peer {
                pidfd: Some(pidfd), ..
            }) => sys::pidfd_exited_within(pidfd, grace_ms),
            Some(Peer {
                pid: Some(pid),
                pidfd: None,
            }) => !sys::process_exists(*pid),
            // Not identified (see **Peer identity**), or not attached.
            Some(Peer {
                pid: None,
                pidfd: None,
            })
            | None => false,
        }
    }

    /// Whether our bell rang since the last poll saw it, or completions or news wait to be taken:
    /// [`ShmConnection::wait`]'s first look, without its spinning or sleeping.
    pub fn rung(&self) -> bool {
        self.my_control().bell.0.load(Ordering::SeqCst) != self.bell_seen.load(Ordering::Relaxed)
            || !self.completions.is_empty()
            || (self.up && self.has_news())
    }

    /// Waits until the peer publishes something for us (a message, a window write, room we
    /// were waiting for, attach or close) since the last `poll_completions`, or `timeout` passes.
    ///
    /// Adaptive: while the peer is running (or being woken) and this machine has more than one
    /// CPU, spin up to [`ConnectionConfig::spin_limit`] (about one wake-up's cost), stopping early
    /// if the peer goes to sleep; on one CPU yield once instead. Then sleep on our futex word
    /// `bell` in slices of at most [`ConnectionConfig::liveness_interval`], checking the peer's
    /// liveness between slices.
    ///
    /// No lost wake-up (Dekker): the waiter stores `running = ASLEEP` then loads `bell`; the
    /// publisher increments `bell` then CASes `running` from `ASLEEP` to `WAKING`; all four
    /// are SeqCst, so in their single total order at least one side sees the other's write. If
    /// the waiter sees the new `bell` it does not sleep. Otherwise the publisher's CAS finds
    /// `ASLEEP` and it rings the doorbell; and since `FUTEX_WAIT` re-checks `bell == seen`
    /// atomically in the kernel, a bump landing between our re-check and the syscall makes the
    /// wait return at once. `WAKING` is only ever set from `ASLEEP` by the one peer, right
    /// before it rings, and the waiter overwrites it with `RUNNING`/`ASLEEP` itself, so a
    /// sleeping side is never mistaken for a woken one.
    pub fn wait(&self, timeout: Duration) -> WaitResult {
        let me = self.my_control();
        let seen = self.bell_seen.load(Ordering::Relaxed);
        if me.bell.0.load(Ordering::SeqCst) != seen || !self.completions.is_empty() {
            return WaitResult::Notified;
        }
        if !self.up || self.peer_gone.load(Ordering::Relaxed) {
            return WaitResult::Disconnected;
        }
        if self.has_news() {
            return WaitResult::Notified;
        }
        me.identity
            .0
            .cpu
            .store(sys::current_cpu(), Ordering::Relaxed);
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let peer_state = if self.peer.is_some() {
            self.peer_control().running()
        } else {
            ASLEEP
        };
        if self.multi_cpu && peer_state != ASLEEP && !self.config.spin_limit.is_zero() {
            // Spinning on the CPU the peer needs would starve it (a whole time slice), so when
            // the peer shares our CPU — or is just being woken, and the scheduler likes to put a
            // wakee next to its waker — give the CPU away between checks instead.
            let peer_cpu = self.peer_control().identity.0.cpu.load(Ordering::Relaxed);
            let share_cpu = peer_state == WAKING || peer_cpu == sys::current_cpu();
            let mut spins = 0u32;
            loop {
                if me.bell.0.load(Ordering::Acquire) != seen {
                    bump(&self.counters.spins_paid_off);
                    return WaitResult::Notified;
                }
                if share_cpu {
                    sys::yield_now();
                } else {
                    core::hint::spin_loop();
                }
                spins = spins.wrapping_add(1);
                // A peer that went to sleep meanwhile will publish nothing for us: stop early.
                if (share_cpu || spins.is_multiple_of(64))
                    && (start.elapsed() >= self.config.spin_limit
                        || self.peer_control().running() == ASLEEP)
                {
                    break;
                }
            }
            bump(&self.counters.spins_wasted);
        } else if !self.multi_cpu {
            sys::yield_now();
        }
        loop {
            if !self.prepare_to_block() {
                return WaitResult::Notified;
            }
            let now = Instant::now();
            let left = deadline.map_or(Duration::MAX, |deadline| {
                deadline.saturating_duration_since(now)
            });
            if left.is_zero() {
                self.finish_blocking();
                return WaitResult::TimedOut;
            }
            // A send blocked on the RNR timer needs a poll when the timer runs out.
            let rnr_left = self
                .rnr_since
                .map(|since| (since + self.config.rnr_timeout).saturating_duration_since(now));
            let slice = left
                .min(self.config.liveness_interval)
                .min(rnr_left.unwrap_or(Duration::MAX));
            bump(&self.counters.sleeps);
            let woke = sys::futex_wait(&me.bell.0, seen, slice);
            self.finish_blocking();
            if me.bell.0.load(Ordering::Acquire) != seen {
                return WaitResult::Notified;
            }
            if woke == FutexWait::TimedOut {
                if self.peer_dead(0) {
                    self.peer_gone.store(true, Ordering::Relaxed);
                    return WaitResult::Disconnected;
                }
                if rnr_left.is_some_and(|rnr| rnr <= slice) {
                    return WaitResult::Notified;
                }
            }
        }
    }

    /// For a caller that blocks elsewhere (the preload in `epoll_wait`, with the doorbell
    /// writing to a descriptor in that set): announces "asleep" so the peer rings the doorbell
    /// for its next publication, then re-checks. Returns `false` — and stays awake — if there
    /// is already news (poll instead of blocking). After blocking, call
    /// [`ShmConnection::finish_blocking`].
    pub fn prepare_to_block(&self) -> bool {
        let me = &self.my_control().identity.0;
        me.running.store(ASLEEP, Ordering::SeqCst);
        let news = self.my_control().bell.0.load(Ordering::SeqCst)
            != self.bell_seen.load(Ordering::Relaxed)
            || !self.completions.is_empty()
            || self.has_news();
        if news {
            me.running.store(RUNNING, Ordering::SeqCst);
        }
        !news
    }

    /// Announces "running" again after [`ShmConnection::prepare_to_block`] returned `true`.
    pub fn finish_blocking(&self) {
        self.my_control()
            .identity
            .0
            .running
            .store(RUNNING, Ordering::SeqCst);
    }

    fn queue_rdma(
        &mut self,
        wr_id: WrId,
        direction: CmaDirection,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        if !self.up {
            return Err(PostError::Disconnected);
        }
        if local.range.len == 0
            || local.range.len > domain::MAX_RDMA_LEN
            || remote.len < local.range.len
            || remote.addr.checked_add(local.range.len).is_none()
        {
            return Err(PostError::InvalidArgument);
        }
        if self.queued_rdma >= MAX_QUEUED_RDMA {
            return Err(PostError::QueueFull);
        }
        self.learn_peer();
        self.queued_rdma += 1;
        self.outbound.push_back(Outbound::Rdma {
            wr_id,
            direction,
            local,
            remote,
            done: 0,
        });
        self.pump_outbound();
        Ok(())
    }
}

impl SanConnection for ShmConnection {
    fn slot_config(&self) -> SlotConfig {
        self.geometry.slots
    }

    fn post_send(&mut self, wr_id: WrId, message: &[u8]) -> Result<(), PostError> {
        self.post_send_parts(wr_id, message, &[])
    }

    fn sends_in_parts(&self) -> bool {
        true
    }

    fn post_send_parts(
        &mut self,
        wr_id: WrId,
        head: &[u8],
        payload: &[u8],
    ) -> Result<(), PostError> {
        if !self.up {
            return Err(PostError::Disconnected);
        }
        if head.len().saturating_add(payload.len()) > self.geometry.slots.slot_size as usize {
            return Err(PostError::TooLong);
        }
        if self.sends_in_flight >= usize::from(self.geometry.slots.send_slots) {
            return Err(PostError::QueueFull);
        }
        self.learn_peer();
        self.sends_in_flight += 1;
        if self.outbound.is_empty() {
            // Fast path: straight into the peer's slot, no intermediate copy.
            match self.try_send(head, payload) {
                Ok(()) => {
                    self.completions.push_back(Completion {
                        wr_id,
                        kind: CompletionKind::Send,
                        status: Ok(()),
                    });
                    self.notify_peer();
                    return Ok(());
                }
                Err(Step::Down(error)) => {
                    self.outbound.push_back(Outbound::Send {
                        wr_id,
                        bytes: Vec::new(),
                        head_len: 0,
                    });
                    self.go_down(error);
                    return Ok(());
                }
                Err(_) => {}
            }
        }
        self.outbound.push_back(Outbound::Send {
            wr_id,
            bytes: san_api::joined(head, payload),
            head_len: head.len(),
        });
        self.pump_outbound();
        Ok(())
    }

    /// Straight into the peer's next posted slot (after those staged before), published at
    /// the commit: the payload is copied once, from the application to the peer (one
    /// message of `stage_sends_from`).
    fn stage_send_from(
        &mut self,
        wr_id: WrId,
        head: &[u8],
        payload: &dyn AppSource,
    ) -> Result<bool, BadAddress> {
        let message = StagedSend {
            wr_id,
            head,
            payload_len: payload.len(),
        };
        Ok(self.stage_sends_from(&[message], payload)? == 1)
    }

    /// Each message into the peer's next posted slot, every payload filled with one copy per
    /// `sys::COPY_AREAS` messages (a file read straight into the peer's slots with one
    /// system call).
    fn stage_sends_from(
        &mut self,
        messages: &[StagedSend<'_>],
        payload: &dyn AppSource,
    ) -> Result<usize, BadAddress> {
        if !self.up || !self.outbound.is_empty() {
            return Ok(0);
        }
        self.learn_peer();
        if self.peer.is_none() {
            return Ok(0);
        }
        let first = self.staged.len();
        let mut areas = [(0usize, 0usize); sys::COPY_AREAS];
        let mut staged = 0usize;
        let mut payload_at = 0usize;
        'chunks: for chunk in messages.chunks(sys::COPY_AREAS) {
            let mut filled = 0usize;
            let mut bytes = 0usize;
            for message in chunk {
                let len = message.head.len().saturating_add(message.payload_len);
                if len > self.geometry.slots.slot_size as usize
                    || self.sends_in_flight + self.staged.len()
                        >= usize::from(self.geometry.slots.send_slots)
                {
                    break;
                }
                let Some(slot) = self.peer_slot_ahead(self.staged.len() as u64) else {
                    break;
                };
                let offset = message_offset(
                    message.head.len(),
                    message.payload_len,
                    payload.placement(payload_at + bytes),
                );
                let at = self.geometry.slot(self.me.peer().index(), slot as usize) + offset;
                self.segment.map().copy_in(at, message.head);
                areas[filled] = (at + message.head.len(), message.payload_len);
                // NOTE(cast): `len <= slot_size`, a u32 (checked above); `offset <
                // PAYLOAD_ALIGN`.
                self.staged.push(Staged {
                    wr_id: message.wr_id,
                    slot,
                    len: len as u32,
                    offset: offset as u32,
                });
                filled += 1;
                bytes += message.payload_len;
            }
            if filled > 0 {
                if let Err(BadAddress) =
                    self.segment
                        .map()
                        .copy_in_each(&areas[..filled], payload, payload_at)
                {
                    self.staged.truncate(first);
                    return Err(BadAddress);
                }
            }
            staged += filled;
            payload_at += bytes;
            if filled < chunk.len() {
                break 'chunks;
            }
        }
        Ok(staged)
    }

    fn commit_staged(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let mut staged = core::mem::take(&mut self.staged);
        for message in staged.drain(..) {
            self.peer_post_tail += 1;
            self.peer_control()
                .post_tail
                .0
                .store(self.peer_post_tail, Ordering::Release);
            self.push_entry(
                ENTRY_MESSAGE,
                message.slot,
                message.len,
                message.offset,
                0,
                0,
            );
            self.sends_in_flight += 1;
            self.completions.push_back(Completion {
                wr_id: message.wr_id,
                kind: CompletionKind::Send,
                status: Ok(()),
            });
        }
        self.staged = staged;
        self.notify_peer();
    }

    fn discard_staged(&mut self) {
        self.staged.clear();
    }

    fn post_recv(&mut self, wr_id: WrId, slot: RecvSlot) -> Result<(), PostError> {
        if !self.up {
            return Err(PostError::Disconnected);
        }
        let index = usize::from(slot.0);
        match self.slot_state.get(index) {
            None => return Err(PostError::InvalidArgument),
            Some(SlotState::Posted) => return Err(PostError::QueueFull),
            Some(_) => {}
        }
        self.slot_state[index] = SlotState::Posted;
        if index >= self.slots_ready {
            self.held_back.push_back((slot.0, wr_id));
            return Ok(());
        }
        self.publish_recv(slot.0, wr_id);
        self.notify_peer_if_waiting_for_space();
        Ok(())
    }

    fn recv_slot(&self, slot: RecvSlot, len: u32) -> &[u8] {
        match self.slot_state.get(usize::from(slot.0)) {
            Some(SlotState::Holding { len: held, offset }) if len <= *held => {
                self.segment.map().bytes(
                    self.geometry.slot(self.me.index(), usize::from(slot.0)) + *offset as usize,
                    len as usize,
                )
            }
            _ => &[],
        }
    }

    fn post_write(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.queue_rdma(wr_id, CmaDirection::Write, local, remote)
    }

    fn post_read(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        if self.domain.config.force_window
            || self.segment.is_private()
            || (self.peer.is_some() && !self.cma_permitted)
        {
            return Err(PostError::InvalidArgument);
        }
        self.queue_rdma(wr_id, CmaDirection::Read, local, remote)
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        self.bell_seen.store(
            self.my_control().bell.0.load(Ordering::SeqCst),
            Ordering::Relaxed,
        );
        if self.up {
            self.learn_peer();
            self.process_inbound();
            self.pump_outbound();
            self.check_peer();
        }
        let mut moved = 0;
        while moved < max {
            let Some(completion) = self.completions.pop_front() else {
                break;
            };
            if completion.kind == CompletionKind::Send {
                self.sends_in_flight = self.sends_in_flight.saturating_sub(1);
            }
            out.push(completion);
            moved += 1;
        }
        moved
    }
}

impl Drop for ShmConnection {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    //! A hostile or buggy peer, simulated by writing the shared words directly.
    use super::*;
    use crate::segment::SegmentConfig;
    use san_api::SanDomain;

    struct Pair {
        dir: std::path::PathBuf,
        domain: ShmDomain,
        creator: ShmConnection,
        attacher: ShmConnection,
    }

    impl Drop for Pair {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn pair(tag: &str) -> Pair {
        let slots = SlotConfig {
            send_slots: 4,
            recv_slots: 4,
            slot_size: 128,
        };
        pair_with(tag, slots)
    }

    /// Counts its rings (and rings nobody).
    struct CountingDoorbell(Arc<AtomicU32>);

    impl Doorbell for CountingDoorbell {
        fn ring(&self, _bell: &AtomicU32) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn pair_with(tag: &str, slots: SlotConfig) -> Pair {
        let path = std::path::PathBuf::from(format!(
            "/dev/shm/san-shm-unit-{tag}-{}",
            std::process::id()
        ));
        let dir = crate::dir::ShmDir::open(&path).unwrap();
        let domain = ShmDomain::default();
        let segment = ShmSegment::create(&dir, "s", &SegmentConfig::new(slots)).unwrap();
        let mut creator =
            ShmConnection::new(segment, &domain, ConnectionConfig::default()).unwrap();
        let attached = ShmSegment::attach(&dir, "s").unwrap();
        let attacher = ShmConnection::new(attached, &domain, ConnectionConfig::default()).unwrap();
        creator.poll_completions(&mut Vec::new(), 0);
        Pair {
            dir: path,
            domain,
            creator,
            attacher,
        }
    }

    fn poll(conn: &mut ShmConnection) -> Vec<Completion> {
        let mut out = Vec::new();
        conn.poll_completions(&mut out, usize::MAX);
        out
    }

    /// Delivers what reached the attacher and posts each slot again, as the session does
    /// once it took the bytes; returns the payloads in order.
    fn receive_and_repost(conn: &mut ShmConnection) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        for completion in poll(conn) {
            let CompletionKind::Recv { slot, len } = completion.kind else {
                continue;
            };
            assert_eq!(completion.status, Ok(()));
            got.push(conn.recv_slot(slot, len).to_vec());
            conn.post_recv(completion.wr_id, slot).unwrap();
        }
        got
    }

    /// An application buffer readable only before `bad_from`.
    struct Unreadable {
        bytes: Vec<u8>,
        bad_from: usize,
    }

    impl AppSource for Unreadable {
        fn len(&self) -> usize {
            self.bytes.len()
        }

        fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
            if offset + dst.len() > self.bad_from {
                return Err(BadAddress);
            }
            dst.copy_from_slice(&self.bytes[offset..offset + dst.len()]);
            Ok(())
        }
    }

    /// Staged messages land in the peer's posted slots but reach it only when committed, in
    /// order; discarded ones (a source that faulted) are never seen and leave their slots to
    /// the next sends; staging stops at the receives the peer posted.
    #[test]
    fn staged_sends_are_seen_only_once_committed() {
        let mut p = pair("stage");
        for slot in 0..4u16 {
            p.attacher
                .post_recv(WrId(u64::from(slot)), RecvSlot(slot))
                .unwrap();
        }
        poll(&mut p.creator);
        let good = |text: &[u8]| Unreadable {
            bytes: text.to_vec(),
            bad_from: usize::MAX,
        };
        assert_eq!(
            p.creator.stage_send_from(WrId(10), b"h1", &good(b"one")),
            Ok(true)
        );
        let faulty = Unreadable {
            bytes: b"never".to_vec(),
            bad_from: 3,
        };
        assert_eq!(
            p.creator.stage_send_from(WrId(11), b"h2", &faulty),
            Err(BadAddress)
        );
        p.creator.discard_staged();
        assert!(
            receive_and_repost(&mut p.attacher).is_empty(),
            "nothing seen"
        );
        assert!(poll(&mut p.creator).is_empty(), "nothing completed");

        for (wr, text) in [
            (12, &b"two"[..]),
            (13, b"three"),
            (14, b"four"),
            (15, b"five"),
        ] {
            assert_eq!(
                p.creator.stage_send_from(WrId(wr), b"h", &good(text)),
                Ok(true)
            );
        }
        assert_eq!(
            p.creator.stage_send_from(WrId(16), b"h", &good(b"six")),
            Ok(false),
            "the peer posted four receives"
        );
        assert!(receive_and_repost(&mut p.attacher).is_empty(), "not yet");
        p.creator.commit_staged();
        let sent: Vec<WrId> = poll(&mut p.creator).iter().map(|c| c.wr_id).collect();
        assert_eq!(sent, [WrId(12), WrId(13), WrId(14), WrId(15)]);
        assert_eq!(
            receive_and_repost(&mut p.attacher),
            [&b"htwo"[..], b"hthree", b"hfour", b"hfive"]
        );
        // The ordinary path goes on after them.
        poll(&mut p.creator);
        p.creator.post_send(WrId(17), b"seven").unwrap();
        assert_eq!(receive_and_repost(&mut p.attacher), [&b"seven"[..]]);
    }

    /// A source that counts its copies (one `copy_to_each` is one read of a file).
    struct CountingSource {
        bytes: Vec<u8>,
        copies: core::cell::Cell<usize>,
        bad_from: usize,
    }

    impl AppSource for CountingSource {
        fn len(&self) -> usize {
            self.bytes.len()
        }

        fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
            self.copies.set(self.copies.get() + 1);
            if offset + dst.len() > self.bad_from {
                return Err(BadAddress);
            }
            dst.copy_from_slice(&self.bytes[offset..offset + dst.len()]);
            Ok(())
        }

        fn copy_to_each(&self, offset: usize, dsts: &mut [&mut [u8]]) -> Result<(), BadAddress> {
            self.copies.set(self.copies.get() + 1);
            let mut at = offset;
            for dst in dsts.iter_mut() {
                if at + dst.len() > self.bad_from {
                    return Err(BadAddress);
                }
                dst.copy_from_slice(&self.bytes[at..at + dst.len()]);
                at += dst.len();
            }
            Ok(())
        }
    }

    /// Messages staged together take their payloads from one copy of the source, in order,
    /// as many as the peer posted receives for; a source that faults stages none of them.
    #[test]
    fn several_messages_are_staged_with_one_copy_of_their_payloads() {
        let mut p = pair("stage-many");
        for slot in 0..3u16 {
            p.attacher
                .post_recv(WrId(u64::from(slot)), RecvSlot(slot))
                .unwrap();
        }
        poll(&mut p.creator);
        let bytes: Vec<u8> = (0..400u32).map(|i| (i * 7 % 251) as u8).collect();
        let faulty = CountingSource {
            bytes: bytes.clone(),
            copies: core::cell::Cell::new(0),
            bad_from: 150,
        };
        let messages: Vec<StagedSend<'_>> = (0..4u64)
            .map(|i| StagedSend {
                wr_id: WrId(20 + i),
                head: b"headhead",
                payload_len: 100,
            })
            .collect();
        assert_eq!(
            p.creator.stage_sends_from(&messages, &faulty),
            Err(BadAddress)
        );
        p.creator.discard_staged();
        assert!(receive_and_repost(&mut p.attacher).is_empty(), "none seen");
        assert!(poll(&mut p.creator).is_empty(), "none completed");

        let source = CountingSource {
            bytes: bytes.clone(),
            copies: core::cell::Cell::new(0),
            bad_from: usize::MAX,
        };
        assert_eq!(
            p.creator.stage_sends_from(&messages, &source),
            Ok(3),
            "the peer posted three receives"
        );
        assert_eq!(source.copies.get(), 1, "one copy for the three payloads");
        p.creator.commit_staged();
        let sent: Vec<WrId> = poll(&mut p.creator).iter().map(|c| c.wr_id).collect();
        assert_eq!(sent, [WrId(20), WrId(21), WrId(22)]);
        let got = receive_and_repost(&mut p.attacher);
        let expected: Vec<Vec<u8>> = (0..3)
            .map(|i| [&b"headhead"[..], &bytes[i * 100..(i + 1) * 100]].concat())
            .collect();
        assert_eq!(got, expected, "every payload intact, in order");
    }

    /// A message's payload lies at the same place within a `PAYLOAD_ALIGN` block as the
    /// bytes it was copied from (on a boundary where the source does not say where it lies),
    /// whichever way it was sent, and a message of the whole slot size still fits.
    #[test]
    fn payloads_lie_at_their_sources_place_within_the_alignment_block() {
        let mut p = pair("align");
        for slot in 0..4u16 {
            p.attacher
                .post_recv(WrId(u64::from(slot)), RecvSlot(slot))
                .unwrap();
        }
        poll(&mut p.creator);
        let full: Vec<u8> = (0..128 - 8).map(|i| i as u8).collect();
        p.creator
            .post_send_parts(WrId(1), b"12345678", &full)
            .unwrap();
        assert_eq!(
            p.creator.stage_send_from(
                WrId(2),
                b"abc",
                &Unreadable {
                    bytes: full[..50].to_vec(),
                    bad_from: usize::MAX,
                }
            ),
            Ok(true)
        );
        let part = san_api::SourcePart::new(&full[..], 5, 65);
        assert_eq!(p.creator.stage_send_from(WrId(3), b"de", &part), Ok(true));
        p.creator.commit_staged();
        p.creator.post_send(WrId(4), b"control").unwrap();
        let mut seen = Vec::new();
        for completion in poll(&mut p.attacher) {
            let CompletionKind::Recv { slot, len } = completion.kind else {
                continue;
            };
            let bytes = p.attacher.recv_slot(slot, len);
            seen.push((bytes.as_ptr() as usize, bytes.to_vec()));
        }
        let place = |address: usize| address % PAYLOAD_ALIGN;
        assert_eq!(seen.len(), 4);
        assert_eq!(seen[0].1, [&b"12345678"[..], &full].concat());
        assert_eq!(place(seen[0].0 + 8), place(full.as_ptr() as usize));
        assert_eq!(seen[1].1, [&b"abc"[..], &full[..50]].concat());
        assert_eq!(
            place(seen[1].0 + 3),
            0,
            "a source that does not say: a boundary"
        );
        assert_eq!(seen[2].1, [&b"de"[..], &full[5..70]].concat());
        assert_eq!(place(seen[2].0 + 2), place(full.as_ptr() as usize + 5));
        assert_eq!(seen[3].1, b"control");
    }

    #[test]
    fn receive_slots_are_allocated_as_the_sender_needs_them() {
        let slots = SlotConfig {
            send_slots: 32,
            recv_slots: 32,
            slot_size: 4096,
        };
        let mut p = pair_with("grow", slots);
        if !sys::can_populate() {
            return; // Every page was allocated at creation.
        }
        for slot in 0..32u16 {
            p.attacher
                .post_recv(WrId(u64::from(slot)), RecvSlot(slot))
                .unwrap();
        }
        assert_eq!(p.attacher.posted.len(), READY_SLOTS, "published at first");
        // Request/response: one message in flight circulates through the first slots.
        for i in 0..100u64 {
            let message = i.to_le_bytes();
            p.creator.post_send(WrId(1000 + i), &message).unwrap();
            poll(&mut p.creator);
            assert_eq!(receive_and_repost(&mut p.attacher), vec![message.to_vec()]);
        }
        assert_eq!(
            p.attacher.slots_ready, READY_SLOTS,
            "no slot allocated for it"
        );
        // A stream: the sender keeps every published slot busy, the pool grows.
        let mut sent = 0u64;
        let mut received = Vec::new();
        for _ in 0..50 {
            while sent < 400 && p.creator.post_send(WrId(sent), &sent.to_le_bytes()).is_ok() {
                sent += 1;
            }
            poll(&mut p.creator);
            received.extend(receive_and_repost(&mut p.attacher));
        }
        poll(&mut p.creator);
        received.extend(receive_and_repost(&mut p.attacher));
        assert_eq!(p.attacher.slots_ready, 32, "the whole pool in use");
        assert!(p.attacher.held_back.is_empty());
        let expected: Vec<Vec<u8>> = (0..sent).map(|i| i.to_le_bytes().to_vec()).collect();
        assert_eq!(received.len(), expected.len(), "every message once");
        assert!(received == expected, "every message intact, in order");
    }

    #[test]
    fn a_sender_waiting_for_held_back_receives_is_woken_though_not_asleep_here() {
        // The sender's session counts 32 receives; the receiver publishes four, then more
        // as it grows. A sender that waits in epoll (never "asleep" in a wait of ours) must
        // still be woken when they come: nothing at the session level will.
        let slots = SlotConfig {
            send_slots: 32,
            recv_slots: 32,
            slot_size: 4096,
        };
        let path =
            std::path::PathBuf::from(format!("/dev/shm/san-shm-unit-wake-{}", std::process::id()));
        let dir = crate::dir::ShmDir::open(&path).unwrap();
        let domain = ShmDomain::default();
        let segment = ShmSegment::create(&dir, "s", &SegmentConfig::new(slots)).unwrap();
        let mut sender = ShmConnection::new(segment, &domain, ConnectionConfig::default()).unwrap();
        let rings = Arc::new(AtomicU32::new(0));
        let attached = ShmSegment::attach(&dir, "s").unwrap();
        let mut receiver = ShmConnection::with_peer(
            attached,
            &domain,
            ConnectionConfig::default(),
            Box::new(CountingDoorbell(rings.clone())),
            None,
        )
        .unwrap();
        sender.poll_completions(&mut Vec::new(), 0);
        if !sys::can_populate() {
            let _ = std::fs::remove_dir_all(&path);
            return; // Every slot is published at once.
        }
        for slot in 0..32u16 {
            receiver
                .post_recv(WrId(u64::from(slot)), RecvSlot(slot))
                .unwrap();
        }
        for i in 0..8u64 {
            sender.post_send(WrId(i), &i.to_le_bytes()).unwrap();
        }
        poll(&mut sender);
        assert_eq!(sender.queued_send_bytes(), 4 * 8, "four wait for receives");
        rings.store(0, Ordering::SeqCst);
        assert_eq!(receive_and_repost(&mut receiver).len(), 4);
        assert!(
            rings.load(Ordering::SeqCst) >= 1,
            "publishing the held-back receives rang the sender"
        );
        poll(&mut sender);
        assert_eq!(receive_and_repost(&mut receiver).len(), 4, "the rest came");
        let _ = std::fs::remove_dir_all(&path);
    }

    #[test]
    fn revoking_a_registration_waits_for_a_peer_copy_under_way_into_it() {
        // A CMA copy cannot be stopped once the kernel runs it: the owner's revocation must
        // not return (letting the memory be reused) while a peer's copy that passed its key
        // check is still under way. Here the peer has announced one; it ends 50 ms later.
        let mut p = pair("revoke");
        let domain = &mut p.domain;
        let sink = vec![0u8; 4096];
        let registration = domain
            .register(
                MemRange::new(sink.as_ptr() as u64, sink.len() as u64),
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
            .unwrap();
        let rkey = domain
            .expose_remote(registration.lkey, Access::REMOTE_WRITE)
            .unwrap();
        let map = p.attacher.segment.map().clone();
        let entry_offset = p.attacher.geometry.exposure_entry(
            p.attacher.me.index(),
            (rkey.0 & domain::INDEX_MASK) as usize,
        );
        map.get::<ExposureEntry>(entry_offset)
            .copies_in_flight
            .fetch_add(1, Ordering::SeqCst);
        let ended = Arc::new(AtomicBool::new(false));
        let copier = {
            let (map, ended) = (map.clone(), ended.clone());
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                ended.store(true, Ordering::SeqCst);
                map.get::<ExposureEntry>(entry_offset)
                    .copies_in_flight
                    .fetch_sub(1, Ordering::SeqCst);
            })
        };
        domain.revoke_remote(registration.lkey).unwrap();
        assert!(
            ended.load(Ordering::SeqCst),
            "revocation returned while the peer's copy was under way"
        );
        copier.join().unwrap();
        domain.deregister(registration.lkey).unwrap();
    }

    /// Two connections over a private segment (a memfd, see `ShmSegment::create_private`),
    /// both in this process.
    fn private_pair() -> (ShmConnection, ShmConnection) {
        let slots = SlotConfig {
            send_slots: 4,
            recv_slots: 4,
            slot_size: 128,
        };
        let domain = ShmDomain::default();
        use std::os::fd::AsFd as _;
        let (segment, fd) = ShmSegment::create_private(&SegmentConfig::new(slots), 7).unwrap();
        let mut creator =
            ShmConnection::new(segment, &domain, ConnectionConfig::default()).unwrap();
        let attached = ShmSegment::attach_private(fd.as_fd()).unwrap();
        drop(fd);
        let attacher = ShmConnection::new(attached, &domain, ConnectionConfig::default()).unwrap();
        creator.poll_completions(&mut Vec::new(), 0);
        (creator, attacher)
    }

    /// xorshift64*: deterministic values for the scribbling below.
    struct Scribbles(u64);

    impl Scribbles {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        /// A value a forger would try: random, small, near a limit, or all ones.
        fn value(&mut self) -> u64 {
            match self.next() % 6 {
                0 => self.next(),
                1 => self.next() % 8,
                2 => self.next() % 256,
                3 => u64::from(u32::MAX) - self.next() % 4,
                4 => u64::MAX - self.next() % 4,
                _ => 1 << (self.next() % 64),
            }
        }
    }

    /// A hostile peer may write anything anywhere in the segment, its own words, ours, slots,
    /// rings and journals alike, at any time: the victim's operations then fail or carry on,
    /// but never panic, read or write outside the mapping, or loop (every call returns).
    /// Many seeds, each scribbling a live connection between exchanges.
    #[test]
    fn a_peer_scribbling_anywhere_breaks_only_its_own_connection() {
        let mut broken = 0;
        for seed in 1..=300u64 {
            let (mut victim, mut hostile) = private_pair();
            let mut rng = Scribbles(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            for slot in 0..4u16 {
                victim
                    .post_recv(WrId(u64::from(slot)), RecvSlot(slot))
                    .unwrap();
                hostile
                    .post_recv(WrId(u64::from(slot)), RecvSlot(slot))
                    .unwrap();
            }
            poll(&mut victim);
            poll(&mut hostile);
            let geometry = *victim.segment().geometry();
            let total = geometry.total_size;
            let mut received = 0u64;
            for round in 0..12u64 {
                // The hostile peer's honest traffic, then its scribbles.
                let _ = hostile.post_send(WrId(100 + round), b"hostile bytes");
                let _ = poll(&mut hostile);
                for _ in 0..(1 + rng.next() % 16) {
                    // Mostly the words: the header and each side's control, FIFO and ring.
                    let offset = match rng.next() % 3 {
                        0 => rng.next() as usize % total,
                        side => {
                            let base = geometry.side_base(side as usize - 1);
                            (base + rng.next() as usize % 16384).min(total - 1)
                        }
                    } & !7;
                    let len = 8.min(total - offset);
                    let bytes = rng.value().to_le_bytes();
                    hostile.segment().map().copy_in(offset, &bytes[..len]);
                }
                // The victim goes on using its connection.
                let mut out = Vec::new();
                victim.poll_completions(&mut out, usize::MAX);
                for completion in out {
                    if let (CompletionKind::Recv { slot, len }, Ok(())) =
                        (completion.kind, completion.status)
                    {
                        received += victim.recv_slot(slot, len).len() as u64;
                        let _ = victim.post_recv(completion.wr_id, slot);
                    }
                }
                let _ = victim.post_send(WrId(200 + round), b"victim bytes");
                let _ = victim.has_input();
                let _ = victim.rung();
                let _ = victim.take_slots_grown();
                let _ = victim.peer_leftovers(received);
                let _ = victim.journal_write(received, &b"journaled"[..]);
                victim.journal_publish(received + 9);
                let _ = victim.peer_end();
            }
            if !victim.is_up() {
                broken += 1;
            }
            // Whatever happened, the victim can still be closed.
            victim.close();
        }
        // (The scribbles reach what the victim checks: some connections broke; the others
        // carried on with what they read, which is all a hostile peer can do to them.)
        assert!(broken >= 10, "{broken} of 300 connections broke");
    }

    #[test]
    fn a_message_in_a_slot_that_was_not_posted_next_is_fatal() {
        let mut p = pair("slot");
        p.attacher.post_recv(WrId(1), RecvSlot(0)).unwrap();
        p.creator.push_entry(ENTRY_MESSAGE, 3, 10, 0, 0, 0);
        let got = poll(&mut p.attacher);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].status, Err(CompletionError::Fatal));
        assert!(!p.attacher.is_up());
    }

    #[test]
    fn oversized_messages_unknown_kinds_and_bad_window_positions_are_fatal() {
        let forgeries: [(u32, u32, u32, u32, u64); 5] = [
            (ENTRY_MESSAGE, 0, 129, 0, 0), // longer than a slot
            // starting past the room a slot keeps for aligning its payload
            (ENTRY_MESSAGE, 0, 10, PAYLOAD_ALIGN as u32, 0),
            (99, 0, 1, 0, 0),                     // unknown kind
            (ENTRY_WINDOW_WRITE, 0, 64, 0, 4096), // not at the window tail
            (ENTRY_WINDOW_WRITE, 0, 64, 0, 0),    // window head never advanced
        ];
        for (i, (kind, slot, len, offset, pos)) in forgeries.into_iter().enumerate() {
            let mut p = pair(&format!("forge{i}"));
            p.attacher.post_recv(WrId(1), RecvSlot(0)).unwrap();
            p.creator.push_entry(kind, slot, len, offset, 0, pos);
            let got = poll(&mut p.attacher);
            assert_eq!(
                got.first().map(|c| c.status),
                Some(Err(CompletionError::Fatal)),
                "forgery {i}"
            );
        }
    }

    #[test]
    fn a_closed_peer_leaves_the_rest_of_its_stream_in_its_journal() {
        let mut p = pair("journal");
        let size = p.creator.journal_size() as u64;
        // Stream bytes [size - 100, size + 400): the journal wraps around.
        let rest: Vec<u8> = (0..500u32).map(|i| (i * 7) as u8).collect();
        p.creator.journal_write(size - 100, &rest[..]).unwrap();
        p.creator.journal_publish(size + 400);
        p.creator.publish_consumed(42);
        p.creator.close();
        assert_eq!(p.attacher.peer_end(), None);
        poll(&mut p.attacher);
        assert_eq!(p.attacher.peer_end(), Some(PeerEnd::Closed));
        let left = p.attacher.peer_leftovers(size - 100).unwrap();
        assert_eq!(
            (left.bytes, left.consumed, left.aborted),
            (rest.clone(), 42, false)
        );
        // From further on: only what follows.
        let left = p.attacher.peer_leftovers(size + 300).unwrap();
        assert_eq!(left.bytes, &rest[400..]);
        // A head behind what we received: nothing more is owed.
        assert!(p
            .attacher
            .peer_leftovers(size + 999)
            .unwrap()
            .bytes
            .is_empty());
        // More than the journal holds: corrupt.
        assert_eq!(p.attacher.peer_leftovers(0), Err(CorruptJournal));
    }

    #[test]
    fn a_ring_head_beyond_capacity_is_fatal() {
        let mut p = pair("head");
        p.attacher.post_recv(WrId(1), RecvSlot(0)).unwrap();
        p.attacher.my_control().inbound_head.0[RING].store(1 << 40, Ordering::Release);
        assert_eq!(poll(&mut p.attacher)[0].status, Err(CompletionError::Fatal));
    }

    #[test]
    fn a_forged_post_fifo_fails_the_senders_connection() {
        let mut p = pair("fifo");
        // More posted receives than slots exist:
        p.attacher
            .my_control()
            .post_head
            .0
            .store(1000, Ordering::SeqCst);
        p.creator.post_send(WrId(5), b"hello").unwrap();
        let got = poll(&mut p.creator);
        assert_eq!(
            (got[0].wr_id, got[0].status),
            (WrId(5), Err(CompletionError::Fatal))
        );
        // A posted slot id out of range:
        let mut p = pair("fifo-slot");
        p.attacher.post_recv(WrId(1), RecvSlot(0)).unwrap();
        let fifo = p.attacher.geometry.fifo_entry(1, 0);
        p.attacher
            .segment
            .map()
            .get::<AtomicU32>(fifo)
            .store(4, Ordering::Relaxed);
        p.creator.post_send(WrId(6), b"hello").unwrap();
        assert_eq!(poll(&mut p.creator)[0].status, Err(CompletionError::Fatal));
    }

    #[test]
    fn the_window_path_works_without_any_cma_at_all() {
        // As under a seccomp filter that forbids process_vm_*: plain copies on both ends.
        let mut p = pair("nocma");
        let (mut creator_domain, mut attacher_domain) =
            (ShmDomain::default(), ShmDomain::default());
        p.creator.domain = creator_domain.shared().clone();
        p.attacher.domain = attacher_domain.shared().clone();
        attacher_domain
            .shared()
            .publish_to(p.attacher.segment.map(), p.attacher.geometry, 1);
        p.creator.cma_permitted = false;
        p.creator.self_cma = false;
        p.attacher.self_cma = false;
        let mut source = vec![0u8; 600 << 10];
        for (i, byte) in source.iter_mut().enumerate() {
            *byte = (i * 7 % 251) as u8;
        }
        let mut sink = vec![0u8; source.len()];
        let src_range = MemRange::new(source.as_mut_ptr() as u64, source.len() as u64);
        let sink_range = MemRange::new(sink.as_mut_ptr() as u64, sink.len() as u64);
        let src = creator_domain.register(src_range, Access::NONE).unwrap();
        let dst = attacher_domain
            .register(sink_range, Access::REMOTE_WRITE)
            .unwrap();
        let local = LocalSegment {
            range: src_range,
            lkey: src.lkey,
        };
        let remote = dst.remote_descriptor(sink_range).unwrap();
        p.creator.post_write(WrId(9), local, remote).unwrap();
        let mut done = Vec::new();
        for _ in 0..1000 {
            poll(&mut p.attacher);
            done.extend(poll(&mut p.creator));
            if !done.is_empty() {
                break;
            }
        }
        poll(&mut p.attacher);
        assert_eq!(
            done.first().map(|c| (c.wr_id, c.status)),
            Some((WrId(9), Ok(())))
        );
        assert!(
            sink == source,
            "600 KiB through a 256 KiB window with plain copies"
        );
    }

    #[test]
    fn a_window_write_with_a_forged_rkey_is_dropped_not_applied() {
        let mut p = pair("rkey");
        let mut target = vec![7u8; 64];
        let dest = target.as_mut_ptr() as u64;
        p.creator.peer_window_head = 64;
        p.creator.peer_control().inbound_head.0[WINDOW].store(64, Ordering::Release);
        p.creator
            .push_entry(ENTRY_WINDOW_WRITE, 0, 64, 0x1234, dest, 0);
        assert!(poll(&mut p.attacher).is_empty());
        assert!(
            p.attacher.is_up(),
            "well-formed but unauthorised: refused, connection kept"
        );
        assert_eq!(p.attacher.stats().window_writes_rejected, 1);
        assert!(target.iter().all(|b| *b == 7), "the target was not touched");
    }
}
