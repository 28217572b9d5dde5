//! # san-api: the SAN provider contract
//!
//! This crate is the Linux analogue of the Windows Sockets Direct *SAN service provider
//! interface*: the small set of operations the switch (`switch` crate) needs from a
//! system-area network, expressed as plain Rust types and a few traits: [`SanConnection`] (per
//! connection), [`SanDomain`] (per process: memory registration) and [`SanConnector`] (setting
//! connections up, with its [`SanConnectRequest`]).
//!
//! It holds types only. No I/O, no `unsafe`, no OS dependency: the sans-IO switch depends on
//! it, and so does every provider (`shm`, `verbs`, `sim`).
//!
//! ## Required behaviour (every provider must give it; the simulation checks it)
//!
//! * **Reliable, ordered delivery within a connection** for sends (RC queue-pair semantics).
//!   Ordering across *different* connections is not promised, and completions of different
//!   kinds (send vs. RDMA read) on one connection may be reported in any order.
//! * **Exactly one completion per posted work request**, success or error. When a connection
//!   enters the error state every outstanding work request completes with
//!   [`CompletionError::Flushed`] (or the error that caused it, for the first one).
//! * **Receive slots.** A connection owns `recv_slots` receive buffers of `slot_size` bytes and
//!   `send_slots` send buffers, allocated and registered by the provider when the connection
//!   is set up ([`SlotConfig`]). The switch posts a receive by slot number; a message that
//!   arrives when no receive is posted is a *receiver-not-ready* condition, which a provider
//!   reports as [`CompletionError::ReceiverNotReady`] on the sender's completion (the switch's
//!   credit scheme exists so that this never happens in a correct session).
//! * **Memory registration** gives a [`Registration`] naming a virtual-address range of the
//!   local process, with [`Access`] rights. Remote access is granted only through a
//!   [`RemoteDescriptor`] whose `rkey` the provider checks on every RDMA read or write;
//!   after [`SanDomain::revoke_remote`] or [`SanDomain::deregister`] that `rkey` must fail
//!   with [`CompletionError::RemoteAccess`], even if the memory stays pinned.
//! * **RDMA read** is optional ([`Capabilities::rdma_read`]); RDMA write is mandatory.
//! * A provider never touches memory outside a registered range, and never after the
//!   registration was removed.
//!
//! * **Connection set-up** ([`SanConnector`]): the active side connects to an address with a
//!   *setup blob* (private data: the switch's Hello and the TCP 4-tuple travel in it); the
//!   passive side listens, sees each incoming request with the peer's blob, and accepts it
//!   (answering with its own blob, which the active side receives) or rejects it. Both sides
//!   allocate their slot pools ([`SlotConfig`]) before the connection counts as established,
//!   so a peer's first message never meets a missing receive buffer. Set-up failures are
//!   [`SetupError`]s, whose [`allows_tcp_fallback`](SetupError::allows_tcp_fallback) carries
//!   the WSD rule: fall back to kernel TCP, except after *refused*, *reset* or *unreachable*,
//!   where TCP would fail as well.
//!
//! ## Cache invalidation
//! The registration cache lives in the switch (`switch::mr_cache`), keyed by virtual address.
//! Whatever learns that a mapping changes (the preload's munmap/mremap/madvise hooks, a
//! userfaultfd monitor, the simulation) calls the cache's invalidation entry point with the
//! changed range. The cache drops every registration overlapping it and deregisters each
//! ([`SanDomain::deregister`]), hands back the references that were still held, and then
//! calls [`SanDomain::memory_invalidated`] once with the range — the analogue of
//! `WSPMemoryRegistrationCacheCallback`. Providers keep no registration cache of their own;
//! those that keep other state keyed by virtual address (on-demand-paging devices, the shm
//! provider's exposure tables) drop it in that callback, before the mapping changes.
#![no_std]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

extern crate alloc;

use alloc::vec::Vec;
use core::fmt;

/// A range of virtual addresses in the local process (or, in the simulation, in the
/// simulated address space of one endpoint).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemRange {
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

impl MemRange {
    /// A range starting at `addr` of `len` bytes.
    pub const fn new(addr: u64, len: u64) -> Self {
        Self { addr, len }
    }

    /// One past the last byte (saturating, so a malformed range can never wrap).
    pub const fn end(&self) -> u64 {
        self.addr.saturating_add(self.len)
    }

    /// True when the two ranges share at least one byte.
    pub const fn overlaps(&self, other: &MemRange) -> bool {
        self.addr < other.end() && other.addr < self.end() && self.len > 0 && other.len > 0
    }

    /// True when `other` lies entirely inside `self`.
    pub const fn contains(&self, other: &MemRange) -> bool {
        other.addr >= self.addr && other.end() <= self.end()
    }

    /// The sub-range `[offset, offset + len)` of this range, or `None` if it would leave it.
    pub fn slice(&self, offset: u64, len: u64) -> Option<MemRange> {
        let start = self.addr.checked_add(offset)?;
        let end = start.checked_add(len)?;
        (end <= self.end()).then_some(MemRange::new(start, len))
    }
}

/// Part of the application's memory could not be read or written: the address is bad, as
/// the kernel's `EFAULT` says of a buffer the process may not access. Whatever the copy
/// wrote before it stopped is unspecified.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BadAddress;

/// Bytes an application call handed over (the buffers of a `send`): the switch and the
/// providers copy them out through [`AppSource::copy_to`] only, so that a buffer the process
/// may not read is an error (`EFAULT`) instead of a crash. A plain slice is a source that
/// never fails.
pub trait AppSource {
    /// How many bytes the source holds.
    fn len(&self) -> usize;

    /// True when the source holds no byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies the `dst.len()` bytes at `offset` (`offset + dst.len() <= len()`) into `dst`.
    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress>;

    /// Where the byte at `offset` lies, as far as a copy's speed depends on it: its address
    /// in memory, or for a file its offset (the page-cache page it is read from lies at that
    /// offset's page boundary). A destination that keeps its low bits copies at full speed;
    /// one a few bytes past it (within the same 64 of a 4 KiB page) can run tens of times
    /// slower, its stores aliasing the loads that follow. 0 when unknown.
    fn placement(&self, offset: usize) -> usize {
        let _ = offset;
        0
    }

    /// Copies the bytes from `offset` on into each of `dsts` in turn, filling each before
    /// the next: as [`AppSource::copy_to`] of every destination at the offset where the one
    /// before it ended. A source whose every copy costs a system call of its own (a file)
    /// fills them all with one; the default copies them one by one.
    fn copy_to_each(&self, offset: usize, dsts: &mut [&mut [u8]]) -> Result<(), BadAddress> {
        let mut at = offset;
        for dst in dsts.iter_mut() {
            self.copy_to(at, dst)?;
            at += dst.len();
        }
        Ok(())
    }
}

/// Memory an application call handed over to be filled (the buffers of a `recv`), written
/// through [`AppSink::copy_from`] only: a buffer the process may not write is an error
/// (`EFAULT`) instead of a crash. A plain slice is a sink that never fails.
pub trait AppSink {
    /// How many bytes the sink takes.
    fn len(&self) -> usize;

    /// True when the sink takes no byte.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `src` into the sink at `offset` (`offset + src.len() <= len()`).
    fn copy_from(&mut self, offset: usize, src: &[u8]) -> Result<(), BadAddress>;
}

/// The bytes `[start, start + len)` of a source, as a source of their own.
#[derive(Clone, Copy, Debug)]
pub struct SourcePart<'a, S: ?Sized> {
    source: &'a S,
    start: usize,
    len: usize,
}

impl<'a, S: AppSource + ?Sized> SourcePart<'a, S> {
    /// The part of `source` from `start`, `len` bytes (cut to what `source` holds).
    pub fn new(source: &'a S, start: usize, len: usize) -> Self {
        let start = start.min(source.len());
        let len = len.min(source.len() - start);
        SourcePart { source, start, len }
    }
}

impl<S: AppSource + ?Sized> AppSource for SourcePart<'_, S> {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
        self.source.copy_to(self.start + offset, dst)
    }

    fn copy_to_each(&self, offset: usize, dsts: &mut [&mut [u8]]) -> Result<(), BadAddress> {
        self.source.copy_to_each(self.start + offset, dsts)
    }

    fn placement(&self, offset: usize) -> usize {
        self.source.placement(self.start + offset)
    }
}

impl AppSource for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
        dst.copy_from_slice(&self[offset..offset + dst.len()]);
        Ok(())
    }

    fn placement(&self, offset: usize) -> usize {
        self.as_ptr().wrapping_add(offset) as usize
    }
}

impl AppSink for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn copy_from(&mut self, offset: usize, src: &[u8]) -> Result<(), BadAddress> {
        self[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }
}

/// [`SanConnection::stage_sends_from`] as one [`SanConnection::stage_send_from`] per message,
/// each with its own copy: for providers (and wrappers of several) that stage messages
/// singly.
pub fn stage_each<C: SanConnection + ?Sized>(
    conn: &mut C,
    messages: &[StagedSend<'_>],
    payload: &dyn AppSource,
) -> Result<usize, BadAddress> {
    let mut at = 0usize;
    for (staged, message) in messages.iter().enumerate() {
        let part = SourcePart::new(payload, at, message.payload_len);
        if !conn.stage_send_from(message.wr_id, message.head, &part)? {
            return Ok(staged);
        }
        at += message.payload_len;
    }
    Ok(messages.len())
}

/// One message of [`SanConnection::stage_sends_from`]: its header, and how many bytes of
/// the payload source follow it.
#[derive(Clone, Copy, Debug)]
pub struct StagedSend<'a> {
    /// The work request the message completes as.
    pub wr_id: WrId,
    /// The bytes that go before the payload (the switch's message header).
    pub head: &'a [u8],
    /// How many payload bytes the message carries.
    pub payload_len: usize,
}

/// Access rights of a registration. A small bit set; combine with `|`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Access(u8);

impl Access {
    /// The provider may write the range locally (sink of an RDMA read, receive buffer).
    /// Reading locally (source of a send or an RDMA write) needs no flag.
    pub const LOCAL_WRITE: Access = Access(1);
    /// The peer may RDMA-read the range (READ-mode rendezvous source).
    pub const REMOTE_READ: Access = Access(2);
    /// The peer may RDMA-write the range (WRITE-mode rendezvous sink).
    pub const REMOTE_WRITE: Access = Access(4);
    /// No rights beyond local read.
    pub const NONE: Access = Access(0);

    /// True when every right in `other` is also in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// True when any remote right is present.
    pub const fn is_remote(self) -> bool {
        self.0 & (Self::REMOTE_READ.0 | Self::REMOTE_WRITE.0) != 0
    }

    /// The raw bits (for wire encodings and debugging).
    pub const fn bits(self) -> u8 {
        self.0
    }

    /// Builds a set from raw bits, dropping unknown bits.
    pub const fn from_bits_truncate(bits: u8) -> Access {
        Access(bits & 7)
    }
}

impl core::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl core::ops::BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        self.0 |= rhs.0;
    }
}

/// The key the local provider uses to name a registration in work requests (an lkey).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LocalKey(pub u32);

/// The key the peer must present to access exposed memory (an rkey).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RemoteKey(pub u32);

/// What the peer needs to RDMA-read or RDMA-write exposed memory. Travels in control messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteDescriptor {
    /// Virtual address in the exposing process.
    pub addr: u64,
    /// Length in bytes the peer may access.
    pub len: u64,
    /// Access key.
    pub rkey: RemoteKey,
}

/// A memory registration handed out by [`SanDomain::register`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Registration {
    /// The registered range.
    pub range: MemRange,
    /// Rights granted.
    pub access: Access,
    /// Local key.
    pub lkey: LocalKey,
    /// Remote key, present while remote access is exposed.
    pub rkey: Option<RemoteKey>,
}

impl Registration {
    /// The descriptor for the peer covering `range` (which must lie inside this registration),
    /// or `None` if remote access is not currently exposed or the range is outside.
    pub fn remote_descriptor(&self, range: MemRange) -> Option<RemoteDescriptor> {
        let rkey = self.rkey?;
        self.range.contains(&range).then_some(RemoteDescriptor {
            addr: range.addr,
            len: range.len,
            rkey,
        })
    }
}

/// A local memory segment named in a work request: a range inside a registration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LocalSegment {
    /// The bytes to read (source) or write (sink).
    pub range: MemRange,
    /// The registration covering `range`.
    pub lkey: LocalKey,
}

/// Identifies a work request; echoed in its completion. Chosen by the switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WrId(pub u64);

/// A receive buffer slot of a connection, `0..SlotConfig::recv_slots`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecvSlot(pub u16);

/// Sizes of the per-connection pools of registered control-message buffers. The switch
/// chooses them (within [`Capabilities`]) and the provider allocates and registers them
/// when the connection is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SlotConfig {
    /// Number of send buffers (bounds the number of sends in flight).
    pub send_slots: u16,
    /// Number of receive buffers.
    pub recv_slots: u16,
    /// Size in bytes of each buffer: the largest control message, header included.
    pub slot_size: u32,
}

/// What a provider (and the device behind it) can do. Read once when a session starts:
/// the switch turns these into data (its negotiated parameters), never into scattered
/// branches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// RDMA read is supported (READ-mode rendezvous possible with this provider as reader).
    pub rdma_read: bool,
    /// RDMA write with immediate data is supported.
    pub write_with_imm: bool,
    /// iWARP rule: the sink of an RDMA read must be registered with remote-write access.
    pub read_sink_needs_remote_write: bool,
    /// iWARP rule: the active (connecting) side must send the first message.
    pub active_side_sends_first: bool,
    /// Largest control-buffer size the provider supports.
    pub max_slot_size: u32,
    /// Largest number of receive (or send) slots per connection.
    pub max_slots: u16,
    /// Largest payload the provider can send inline in a work request (informational; the
    /// switch's inline threshold is a slot, which the provider copies as needed).
    pub max_inline: u32,
    /// Largest single RDMA read or write.
    pub max_rdma_len: u64,
}

/// The kind of work a completion reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompletionKind {
    /// A posted send finished (its slot may be reused).
    Send,
    /// A message arrived in `slot`, `len` bytes long. The bytes are read with
    /// [`SanConnection::recv_slot`] until the slot is posted again.
    Recv {
        /// The slot holding the message.
        slot: RecvSlot,
        /// Message length in bytes.
        len: u32,
    },
    /// A posted RDMA write finished.
    Write,
    /// A posted RDMA read finished: the local sink holds the data.
    Read,
}

/// Why a work request failed. Verb-named after the ibverbs completion statuses they stand for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CompletionError {
    /// The connection went to the error state; this request was flushed without executing.
    Flushed,
    /// The peer rejected the access (bad or revoked rkey, range outside the registration).
    RemoteAccess,
    /// A local key or range was invalid (deregistered, out of range, wrong rights).
    LocalProtection,
    /// The peer had no receive posted and retries ran out.
    ReceiverNotReady,
    /// Transport retries ran out: the peer is unreachable or dead.
    RetryExceeded,
    /// Anything else fatal to the connection.
    Fatal,
}

impl fmt::Display for CompletionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            CompletionError::Flushed => "work request flushed: connection in error state",
            CompletionError::RemoteAccess => "remote access error",
            CompletionError::LocalProtection => "local protection error",
            CompletionError::ReceiverNotReady => "receiver not ready",
            CompletionError::RetryExceeded => "transport retry counter exceeded",
            CompletionError::Fatal => "fatal provider error",
        };
        f.write_str(text)
    }
}

/// One completed work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Completion {
    /// The id given when the request was posted.
    pub wr_id: WrId,
    /// What finished.
    pub kind: CompletionKind,
    /// Success, or why it failed.
    pub status: Result<(), CompletionError>,
}

/// Errors from posting work. Posting fails synchronously only for caller errors or a
/// connection already known to be broken; transfer failures arrive as completions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PostError {
    /// More sends in flight than send slots, or a receive posted on a slot already posted.
    QueueFull,
    /// The message is larger than a slot.
    TooLong,
    /// A slot number out of range, or an empty/overflowing segment.
    InvalidArgument,
    /// The connection is in the error state or closed.
    Disconnected,
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            PostError::QueueFull => "queue full",
            PostError::TooLong => "message longer than a slot",
            PostError::InvalidArgument => "invalid work request",
            PostError::Disconnected => "connection disconnected",
        };
        f.write_str(text)
    }
}

/// Errors from memory registration (mapped to ENOBUFS by the switch's callers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RegisterError {
    /// Pinning or registering the memory failed for lack of resources (ENOMEM, RLIMIT_MEMLOCK).
    OutOfResources,
    /// The range is not mapped, or not accessible as asked.
    BadAddress,
    /// The key given to a deregister/revoke/expose call is unknown.
    UnknownKey,
    /// The access rights asked for are not supported by the device.
    Unsupported,
}

impl fmt::Display for RegisterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            RegisterError::OutOfResources => "memory registration failed: out of resources",
            RegisterError::BadAddress => "memory registration failed: bad address",
            RegisterError::UnknownKey => "unknown registration key",
            RegisterError::Unsupported => "access rights not supported by the device",
        };
        f.write_str(text)
    }
}

/// Per-process memory registration (a protection domain). Shared by all connections of
/// a provider; the switch's registration cache drives it.
pub trait SanDomain {
    /// What this provider can do.
    fn capabilities(&self) -> Capabilities;

    /// Registers `range` with `access` rights (pins the memory). Remote rights are exposed
    /// at once (the registration carries an `rkey`).
    fn register(&mut self, range: MemRange, access: Access) -> Result<Registration, RegisterError>;

    /// Removes a registration entirely: the `lkey` and any `rkey` stop working at once.
    fn deregister(&mut self, lkey: LocalKey) -> Result<(), RegisterError>;

    /// Makes the registration unreachable for peers (its current `rkey` fails from now on)
    /// while keeping it pinned and usable locally. Used when the cache keeps a remotely
    /// exposed buffer after the switch released it.
    fn revoke_remote(&mut self, lkey: LocalKey) -> Result<(), RegisterError>;

    /// Exposes a registration to peers again with `access` (remote rights), returning the
    /// new `rkey`. A provider must never hand back an `rkey` that was revoked.
    fn expose_remote(&mut self, lkey: LocalKey, access: Access)
        -> Result<RemoteKey, RegisterError>;

    /// The cache-invalidation callback (analogue of `WSPMemoryRegistrationCacheCallback`).
    ///
    /// Called by the switch's registration cache after it dropped and deregistered every
    /// registration overlapping `range`, before the mapping changes; providers that keep
    /// VA-keyed state of their own (e.g. on-demand-paging devices, the shm exposure tables)
    /// drop it here. Called exactly once per invalidation, also when no registration
    /// overlapped. Must not fail and must not call back into the cache. The default does
    /// nothing: most providers keep all VA-keyed state in their registrations.
    fn memory_invalidated(&mut self, range: MemRange) {
        let _ = range;
    }
}

/// A message given in parts (see [`SanConnection::post_send_parts`]), joined.
pub fn joined(head: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(head.len() + payload.len());
    message.extend_from_slice(head);
    message.extend_from_slice(payload);
    message
}

/// One SAN connection (a reliable-connected queue pair and its slot pools).
pub trait SanConnection {
    /// The slot pools this connection was set up with.
    fn slot_config(&self) -> SlotConfig;

    /// Copies `message` into a free send slot and posts it.
    fn post_send(&mut self, wr_id: WrId, message: &[u8]) -> Result<(), PostError>;

    /// Whether [`SanConnection::post_send_parts`] copies each part straight to its place
    /// (the caller then hands a message over in parts instead of joining them first).
    fn sends_in_parts(&self) -> bool {
        false
    }

    /// Posts the message `head` followed by `payload`, as [`SanConnection::post_send`] of
    /// the two joined. The default joins them; a provider that copies into the peer's memory
    /// anyway copies each part once (and says so with [`SanConnection::sends_in_parts`]).
    fn post_send_parts(
        &mut self,
        wr_id: WrId,
        head: &[u8],
        payload: &[u8],
    ) -> Result<(), PostError> {
        if payload.is_empty() {
            return self.post_send(wr_id, head);
        }
        self.post_send(wr_id, &joined(head, payload))
    }

    /// Prepares a send of the message `head` followed by the bytes of `payload` (the
    /// application's memory, whose copy may fail) without posting it: the message is
    /// copied to where the next send after those already staged goes (for a provider that
    /// copies into the peer's memory: straight into the peer's next free receive slot),
    /// where nobody sees it until [`SanConnection::commit_staged`] posts it, with `wr_id`.
    ///
    /// `Ok(false)`: no room for another message now (no send slot, no posted receive of
    /// the peer, sends queued that it must follow), or the provider does not stage (the
    /// default): nothing was copied, post the message the ordinary way. `Err(BadAddress)`:
    /// `payload` could not be read; the messages staged before stay staged (the caller
    /// commits or discards them). Staged messages are committed or discarded before any
    /// other call on the connection.
    fn stage_send_from(
        &mut self,
        wr_id: WrId,
        head: &[u8],
        payload: &dyn AppSource,
    ) -> Result<bool, BadAddress> {
        let _ = (wr_id, head, payload);
        Ok(false)
    }

    /// Stages several messages as [`SanConnection::stage_send_from`] stages each, in order:
    /// message `i` is `messages[i].head` followed by the next `messages[i].payload_len` bytes
    /// of `payload` (the first message's from its start). A provider that stages into the
    /// peer's memory fills the payloads with one [`AppSource::copy_to_each`], so a source read
    /// by system call (a file) costs one call for all of them.
    ///
    /// `Ok(n)`: the first `n` messages were staged (`n < messages.len()`: no room for the
    /// next; 0 as `Ok(false)` of [`SanConnection::stage_send_from`]). `Err(BadAddress)`:
    /// `payload` could not be read, and which of these messages stayed staged is not said:
    /// the caller discards every staged message ([`SanConnection::discard_staged`]) before
    /// any other call. The default stages them one by one ([`stage_each`]).
    fn stage_sends_from(
        &mut self,
        messages: &[StagedSend<'_>],
        payload: &dyn AppSource,
    ) -> Result<usize, BadAddress> {
        stage_each(self, messages, payload)
    }

    /// Posts every staged message, in the order staged, as [`SanConnection::post_send`]
    /// would have posted each (each completes as a send).
    fn commit_staged(&mut self) {}

    /// Forgets every staged message: none was posted, none reaches the peer, and their
    /// slots stay free for the next sends.
    fn discard_staged(&mut self) {}

    /// Posts receive slot `slot`.
    fn post_recv(&mut self, wr_id: WrId, slot: RecvSlot) -> Result<(), PostError>;

    /// The bytes of a received message in `slot` (valid from its `Recv` completion until
    /// the slot is posted again). Empty if the slot holds nothing.
    fn recv_slot(&self, slot: RecvSlot, len: u32) -> &[u8];

    /// RDMA-writes `local` to `remote` (which must be at least as long).
    fn post_write(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError>;

    /// RDMA-reads `remote` into `local` (only if [`Capabilities::rdma_read`]).
    fn post_read(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError>;

    /// Moves up to `max` completions into `out`; returns how many were added.
    fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize;
}

// ----- connection set-up --------------------------------------------------------------------

/// Why a connection could not be set up. rustls-style: each variant is a distinct cause the
/// switch acts on differently, chiefly through [`SetupError::allows_tcp_fallback`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SetupError {
    /// Nothing listens at the address: the peer's host answered that no such endpoint exists
    /// (the analogue of a TCP RST to a SYN, `ECONNREFUSED`). TCP would be refused too.
    Refused,
    /// The peer tore the connection down while it was being set up (`ECONNRESET`): it was
    /// there and went away. TCP would meet the same peer.
    Reset,
    /// The peer cannot be reached: no route, or address resolution failed
    /// (`EHOSTUNREACH`/`ENETUNREACH`). TCP would not get through either.
    Unreachable,
    /// Set-up did not finish within the provider's bound. The SAN path may be slow or
    /// broken while TCP works.
    TimedOut,
    /// A listener saw the request and declined it (a peer without sandirect, a policy, an
    /// overloaded listener). The peer may still accept TCP.
    Rejected,
    /// Local resources ran out: memory, queue pairs, registrations, segment files, or the
    /// device is missing (a host without RDMA).
    NoResources,
    /// Anything else: an invalid argument, an unexpected OS error, a provider bug.
    Other,
}

impl SetupError {
    /// The Windows Sockets Direct rule: after a failed SAN connect the switch may fall back
    /// to kernel TCP, **except** when the SAN said *refused*, *reset* or *unreachable* —
    /// there TCP would fail the same way, and retrying it only delays the application's
    /// error (and could reach a different listener than the one that refused).
    pub const fn allows_tcp_fallback(self) -> bool {
        !matches!(
            self,
            SetupError::Refused | SetupError::Reset | SetupError::Unreachable
        )
    }
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            SetupError::Refused => "connection refused: nothing listens at that address",
            SetupError::Reset => "connection reset by the peer during set-up",
            SetupError::Unreachable => "peer unreachable",
            SetupError::TimedOut => "connection set-up timed out",
            SetupError::Rejected => "connection request rejected by the listener",
            SetupError::NoResources => "connection set-up failed: out of local resources",
            SetupError::Other => "connection set-up failed",
        };
        f.write_str(text)
    }
}

/// A connection whose set-up finished, with the peer's setup blob.
#[derive(Debug)]
pub struct Established<C> {
    /// The connection, ready for posting.
    pub connection: C,
    /// The blob the passive side gave when accepting (empty on the passive side).
    pub peer_private_data: Vec<u8>,
}

/// Where an active connect stands after [`SanConnector::poll_connect`].
#[derive(Debug)]
pub enum ConnectProgress<P, C> {
    /// The passive side has not answered yet; poll the handle again later.
    Pending(P),
    /// The passive side accepted.
    Established(Established<C>),
}

/// An incoming connection request seen by a listener, not answered yet. It is answered
/// by handing it to [`SanConnector::accept`] or [`SanConnector::reject`]; dropping it
/// unanswered rejects it.
pub trait SanConnectRequest {
    /// The active side's setup blob.
    fn private_data(&self) -> &[u8];
}

/// Connection set-up of one provider, active and passive side (the analogue of the WSD
/// SPI's `WSPConnect`/`WSPListen`/`WSPAccept` with their connect data).
///
/// All calls are non-blocking in shape: a provider whose native set-up blocks (rdma_cm)
/// finishes it inside [`connect`](Self::connect)/[`accept`](Self::accept) under its own
/// timeout, and its pending connect is then established at the first poll. Each provider
/// keeps its own addressing ([`Address`](Self::Address): a segment name, an IP address and
/// port, a simulated endpoint).
///
/// Contract:
/// * A blob given to `connect` reaches the passive side byte for byte (as
///   [`SanConnectRequest::private_data`]), and the blob given to `accept` reaches the active
///   side ([`Established::peer_private_data`]). A provider refuses a blob longer than
///   [`max_private_data`](Self::max_private_data) with [`SetupError::Other`] before
///   anything is sent.
/// * A rejected request fails the active side with [`SetupError::Rejected`]; a connect to
///   an address nobody listens on fails with [`SetupError::Refused`] (or `Rejected` where
///   the transport cannot tell the two apart — documented per provider).
/// * Once established, both connections follow the [`SanConnection`] contract with the
///   slot pools their side asked for.
pub trait SanConnector {
    /// How the provider names a listening endpoint (unsized allowed: a segment name is a
    /// `str`).
    type Address: ?Sized;
    /// The connection type set up.
    type Connection: SanConnection;
    /// An active connect waiting for the passive side's answer.
    type Connecting;
    /// A passive endpoint receiving connection requests.
    type Listener;
    /// A received request, not answered yet.
    type Request: SanConnectRequest;

    /// The largest setup blob the transport carries (rdma_cm: 55 bytes).
    fn max_private_data(&self) -> usize;

    /// Starts connecting to `remote` with this side's slot pools and setup blob.
    fn connect(
        &mut self,
        remote: &Self::Address,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<Self::Connecting, SetupError>;

    /// Advances a pending connect without blocking.
    fn poll_connect(
        &mut self,
        pending: Self::Connecting,
    ) -> Result<ConnectProgress<Self::Connecting, Self::Connection>, SetupError>;

    /// Starts listening at `local`.
    fn listen(&mut self, local: &Self::Address) -> Result<Self::Listener, SetupError>;

    /// The next connection request that arrived at `listener`, if any, without blocking.
    fn poll_request(
        &mut self,
        listener: &mut Self::Listener,
    ) -> Result<Option<Self::Request>, SetupError>;

    /// Accepts `request`: sets up this side's slot pools and answers with `private_data`.
    fn accept(
        &mut self,
        request: Self::Request,
        slots: SlotConfig,
        private_data: &[u8],
    ) -> Result<Self::Connection, SetupError>;

    /// Declines `request`; the active side fails with [`SetupError::Rejected`].
    fn reject(&mut self, request: Self::Request);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_overlap_only_when_they_share_a_byte() {
        let a = MemRange::new(100, 10);
        assert!(a.overlaps(&MemRange::new(109, 1)));
        assert!(!a.overlaps(&MemRange::new(110, 5)));
        assert!(!a.overlaps(&MemRange::new(90, 10)));
        assert!(a.overlaps(&MemRange::new(90, 11)));
        assert!(
            !a.overlaps(&MemRange::new(105, 0)),
            "empty ranges overlap nothing"
        );
    }

    #[test]
    fn slice_never_leaves_the_range_nor_wraps() {
        let a = MemRange::new(u64::MAX - 4, 4);
        assert_eq!(a.slice(1, 3), Some(MemRange::new(u64::MAX - 3, 3)));
        assert_eq!(a.slice(1, 4), None);
        assert_eq!(a.slice(u64::MAX, 1), None);
    }

    #[test]
    fn descriptors_need_exposed_remote_access() {
        let mut reg = Registration {
            range: MemRange::new(0x1000, 0x1000),
            access: Access::REMOTE_READ,
            lkey: LocalKey(1),
            rkey: Some(RemoteKey(7)),
        };
        let inner = MemRange::new(0x1800, 0x10);
        assert_eq!(
            reg.remote_descriptor(inner).map(|d| d.rkey),
            Some(RemoteKey(7))
        );
        assert_eq!(reg.remote_descriptor(MemRange::new(0x1ff0, 0x20)), None);
        reg.rkey = None;
        assert_eq!(reg.remote_descriptor(inner), None);
    }

    #[test]
    fn slices_are_sources_and_sinks_at_any_offset() {
        let source: &[u8] = b"abcdef";
        let mut part = [0u8; 3];
        assert_eq!(source.copy_to(2, &mut part), Ok(()));
        assert_eq!(&part, b"cde");
        let mut sink = [0u8; 6];
        assert_eq!(AppSink::copy_from(&mut sink[..], 4, b"xy"), Ok(()));
        assert_eq!(&sink, b"\0\0\0\0xy");
        assert_eq!(AppSource::len(source), 6);
        let part = SourcePart::new(source, 1, 3);
        let mut three = [0u8; 2];
        assert_eq!(part.copy_to(1, &mut three), Ok(()));
        assert_eq!(&three, b"cd");
        assert_eq!(SourcePart::new(source, 4, 10).len(), 2, "cut to the source");
        assert!(<[u8] as AppSink>::is_empty(&[]));
    }

    #[test]
    fn copying_into_each_fills_the_destinations_in_turn() {
        let source: &[u8] = b"abcdefghij";
        let part = SourcePart::new(source, 2, 7);
        let (mut one, mut two, mut three) = ([0u8; 2], [0u8; 0], [0u8; 3]);
        let mut dsts: [&mut [u8]; 3] = [&mut one, &mut two, &mut three];
        assert_eq!(part.copy_to_each(1, &mut dsts), Ok(()));
        assert_eq!((&one, &three), (b"de", b"fgh"));
    }

    #[test]
    fn tcp_fallback_is_forbidden_only_where_tcp_would_fail_too() {
        let forbidden = [
            SetupError::Refused,
            SetupError::Reset,
            SetupError::Unreachable,
        ];
        let allowed = [
            SetupError::TimedOut,
            SetupError::Rejected,
            SetupError::NoResources,
            SetupError::Other,
        ];
        for error in forbidden {
            assert!(!error.allows_tcp_fallback(), "{error:?}");
        }
        for error in allowed {
            assert!(error.allows_tcp_fallback(), "{error:?}");
        }
    }
}
