//! The shared segment layout (layout version 5): `#[repr(C)]`, offsets only, no pointers.
//!
//! ```text
//! 0        SegmentHeader (one 4 KiB page: magic, version, sizes, side offsets, state;
//!          at SETUP_AREA: SetupWords + request blob + reply blob of the connector path)
//! side[0]  SideArea of the creator (active side)  ─┐ each side_size bytes, page aligned
//! side[1]  SideArea of the attacher (passive side) ─┘
//!
//! SideArea of side S (S *receives* into it; the peer *sends* into it):
//!   SideControl     6 cache lines of control words (below)
//!   post FIFO       recv_slots × u32   slot ids S posted, oldest first (S produces, peer consumes)
//!   inbound ring    ring_entries × RingEntry  messages and window writes for S (peer produces)
//!   exposure table  EXPOSURE_ENTRIES × ExposureEntry  S's exposed registrations (S writes only)
//!   receive slots   recv_slots × slot_stride bytes  (peer copies messages straight in, each
//!                   at the offset its ring entry names, so that its payload starts on a
//!                   PAYLOAD_ALIGN boundary: a stride holds slot_size + PAYLOAD_ALIGN - 1)
//!   write window    window_size bytes  bounded byte ring for writes when CMA is not permitted
//! journal[0]  outbound journal of the creator  ─┐ each journal_size bytes, page aligned, at the
//! journal[1]  outbound journal of the attacher ─┘ end of the file and allocated only when used
//! ```
//!
//! The outbound journal of side S holds the stream bytes S's application handed over that
//! have not reached the peer's receive slots yet (S writes it; the peer reads it only once S
//! closed or died). Byte `o` of the stream lives at `o % journal_size`; `JournalWords::head`
//! says where the stream ends. It is what makes a byte that `send()` accepted reach the peer
//! even when the sender exits or is killed before it could transmit it, as kernel TCP does.
//!
//! Counters (`post_head`, `ring_head`, …) are free-running `u64`s; an index is `counter % capacity`.
//! Each counter has exactly one writing process, noted on the field. The attacher never trusts
//! an offset it reads: it recomputes the whole geometry from the sizes in the header, requires the
//! header's offsets and the file size to match, and from then on uses only its own copy.

use core::sync::atomic::{AtomicU32, AtomicU64};

use san_api::SlotConfig;

/// `b"SANSHM01"` little-endian: identifies a segment file.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SANSHM01");
/// The layout described in this module.
pub const LAYOUT_VERSION: u32 = 5;
/// A message's payload (what follows the header its sender names) starts on this boundary of
/// its receive slot: the message goes that far into the slot (its ring entry says where).
/// Copies into and out of the slot then keep the alignment of their other end: a file read
/// straight into a slot comes from the page cache at a page boundary (a 64 KiB body at
/// offset 0), and a copy whose destination lies 8 bytes past its source's alignment (a
/// payload right after an 8-byte header) ran several times slower (`rep movsb` and `memcpy`
/// alike: the stores alias the loads that follow them).
pub const PAYLOAD_ALIGN: usize = 64;
/// Bytes reserved for the header (one page, so the side areas are page aligned).
pub const HEADER_SIZE: usize = 4096;
/// Entries in each side's exposure table; an rkey's low [`RKEY_INDEX_BITS`] bits index it.
pub const EXPOSURE_ENTRIES: u32 = 1 << RKEY_INDEX_BITS;
/// Bits of an rkey that select the exposure-table entry; the rest is a generation.
pub const RKEY_INDEX_BITS: u32 = 10;
/// Largest segment accepted (bounds what a hostile header can make us map).
pub const MAX_SEGMENT_SIZE: u64 = 1 << 30;
/// Largest slot.
pub const MAX_SLOT_SIZE: u32 = 1 << 20;
/// Largest number of slots per pool.
pub const MAX_SLOTS: u16 = 4096;
/// Largest write window.
pub const MAX_WINDOW_SIZE: u32 = 64 << 20;
/// Smallest write window (the window path must always be able to make progress).
pub const MIN_WINDOW_SIZE: u32 = 4096;
/// Largest outbound journal.
pub const MAX_JOURNAL_SIZE: u32 = 64 << 20;
/// Ring entries beyond `recv_slots` (room for window-write chunks in flight).
pub const MAX_RING_EXTRA: u32 = 4096;
const CACHE_LINE: usize = 64;
const PAGE: usize = 4096;

/// Segment state word values ([`SegmentHeader::state`]).
pub const STATE_CREATED: u32 = 1;
/// The attacher has claimed the segment and is filling in its identity.
pub const STATE_ATTACHING: u32 = 2;
/// The attacher's identity is published.
pub const STATE_ATTACHED: u32 = 3;
/// The creator withdrew the segment before anyone attached (CAS from [`STATE_CREATED`]): no
/// process may attach any more, and the connection stays on TCP.
pub const STATE_WITHDRAWN: u32 = 4;

/// `SideControl::running` values.
pub const RUNNING: u32 = 0;
/// The side is (about to be) blocked in `FUTEX_WAIT` on its `bell` (or in the preload's own
/// blocking call, see `ShmConnection::prepare_to_block`).
pub const ASLEEP: u32 = 1;
/// The peer claimed the wake-up of a sleeping side (CAS from [`ASLEEP`]) and is ringing it: the
/// side will run shortly, so the peer may spin for its answer and need not ring again.
pub const WAKING: u32 = 2;

/// Ring entry kinds.
pub const ENTRY_MESSAGE: u32 = 1;
/// A chunk of a window write.
pub const ENTRY_WINDOW_WRITE: u32 = 2;

/// The first page of a segment. Written by the creator before the file gets its name (the
/// name appears by `link(2)` of a fully initialised file), so the attacher reads it with
/// `pread` and needs no ordering; only `state` changes afterwards.
#[repr(C)]
pub struct SegmentHeader {
    /// [`MAGIC`].
    pub magic: AtomicU64,
    /// [`LAYOUT_VERSION`].
    pub layout_version: AtomicU32,
    /// [`HEADER_SIZE`].
    pub header_size: AtomicU32,
    /// Size of the file and of the mapping.
    pub total_size: AtomicU64,
    /// Receive slot size in bytes (both sides).
    pub slot_size: AtomicU32,
    /// Receive slots per side.
    pub recv_slots: AtomicU32,
    /// Send slots per side (bounds sends in flight; no shared storage).
    pub send_slots: AtomicU32,
    /// Inbound ring capacity per side.
    pub ring_entries: AtomicU32,
    /// Write-window bytes per side.
    pub window_size: AtomicU32,
    /// Exposure-table entries per side ([`EXPOSURE_ENTRIES`]).
    pub exposure_entries: AtomicU32,
    /// Offsets of the two side areas.
    pub side_offset: [AtomicU64; 2],
    /// Size of one side area.
    pub side_size: AtomicU64,
    /// Lifecycle: [`STATE_CREATED`] → (CAS by the attacher) [`STATE_ATTACHING`] → (Release
    /// store by the attacher after writing its identity) [`STATE_ATTACHED`]. The creator loads
    /// it with Acquire before reading the attacher's identity. Or [`STATE_CREATED`] → (CAS by
    /// the creator) [`STATE_WITHDRAWN`]: exactly one of the two CASes wins.
    pub state: AtomicU32,
    /// Reserved, zero.
    pub flags: AtomicU32,
    /// Outbound-journal bytes per side (a multiple of the page size).
    pub journal_size: AtomicU32,
    /// Reserved, zero.
    pub reserved: AtomicU32,
}

/// Offset, inside the header page, of the connection-setup area ([`SetupWords`] followed by
/// the request blob and the reply blob, [`MAX_SETUP_DATA`] bytes each). Segments created
/// without a blob leave it zero, which reads as "empty blob, no answer".
pub const SETUP_AREA: usize = 1024;
/// Largest setup blob each side can leave in the segment.
pub const MAX_SETUP_DATA: usize = 1024;
/// Offset of the creator's request blob.
pub const SETUP_REQUEST: usize = SETUP_AREA + CACHE_LINE;
/// Offset of the attacher's reply blob.
pub const SETUP_REPLY: usize = SETUP_REQUEST + MAX_SETUP_DATA;

/// [`SetupWords::answer`]: the attacher has not answered.
pub const ANSWER_NONE: u32 = 0;
/// The attacher accepted; its reply blob is published.
pub const ANSWER_ACCEPTED: u32 = 1;
/// The attacher declined.
pub const ANSWER_REJECTED: u32 = 2;

/// The control words of connection set-up (the `SanConnector` path; the plain
/// `create`/`attach` path leaves them zero and never reads them).
#[repr(C)]
pub struct SetupWords {
    /// Length of the creator's request blob. Written with the blob before the segment is
    /// published (like the header), never changed afterwards.
    pub request_len: AtomicU32,
    /// [`ANSWER_NONE`] → (Release store by the attacher, after writing `reply_len` and the
    /// reply blob) [`ANSWER_ACCEPTED`] or [`ANSWER_REJECTED`]. The creator loads it with
    /// Acquire before reading the reply.
    pub answer: AtomicU32,
    /// Length of the attacher's reply blob (published by `answer`).
    pub reply_len: AtomicU32,
    /// Reserved, zero.
    pub reserved: AtomicU32,
}

/// A 64-byte aligned wrapper so words written by different processes never share a line.
#[repr(C, align(64))]
pub struct Line<T>(pub T);

/// Identity and lifecycle of the owning side. Written by the owner only.
#[repr(C)]
pub struct Identity {
    /// Owner's pid. Written before the segment is published (creator) or before the Release
    /// store of `STATE_ATTACHED` (attacher); read by the peer after the matching Acquire.
    pub pid: AtomicU32,
    /// Owner's effective uid (same publication as `pid`).
    pub uid: AtomicU32,
    /// Owner's effective gid (same publication as `pid`).
    pub gid: AtomicU32,
    /// 1 after an orderly close. Release store after the owner's last publication, Acquire
    /// load by the peer, which then drains its ring before failing outstanding work.
    pub closed: AtomicU32,
    /// The segment's address in the owner's process (for the peer's CMA probe).
    pub base_addr: AtomicU64,
    /// [`RUNNING`], [`ASLEEP`] or [`WAKING`]. The owner stores `ASLEEP` (SeqCst) before its
    /// final re-check of `bell` and its futex wait, and `RUNNING` when it resumes. The peer,
    /// after bumping `bell`, CASes `ASLEEP` → `WAKING` (SeqCst) and rings only if that
    /// succeeded: exactly one wake-up per sleep, none for a running owner (Dekker pair).
    pub running: AtomicU32,
    /// Non-zero while the owner, as a sender, waits for room the peer frees: 1 for ring or
    /// window space, 2 for a published receive. SeqCst store then re-check by the owner;
    /// SeqCst load by the peer after freeing room, which then rings `bell` (for 2 even when
    /// the owner is not asleep in a wait of ours: its session counted those receives as
    /// posted, so only this ring tells it they came).
    pub want_space: AtomicU32,
    /// The CPU the owner last ran on (Relaxed; a hint for the peer's spin-or-yield choice).
    pub cpu: AtomicU32,
    /// The owner's pid namespace (`sys::pid_namespace`, 0 when unknown; same publication as
    /// `pid`). `pid` is the owner's number *in that namespace*: the peer uses it as a pid
    /// only when its own namespace is the same nonzero value (see `ShmSegment::peer_pid`).
    pub pid_ns: AtomicU64,
    /// A value the owner's process chose for its peers to find it by, secret to the processes
    /// that may open this segment (same publication as `pid`; see `crate::set_contact`).
    pub contact: AtomicU64,
}

/// The control words of one side area (see the module docs for who writes what).
#[repr(C)]
pub struct SideControl {
    /// Owner identity and lifecycle.
    pub identity: Line<Identity>,
    /// The owner's futex word: bumped (SeqCst `fetch_add`) by the peer after every publication
    /// meant for the owner; the owner waits on it.
    pub bell: Line<AtomicU32>,
    /// Post-FIFO producer counter: owner stores with Release after writing the FIFO entry.
    pub post_head: Line<AtomicU64>,
    /// Post-FIFO consumer counter: peer stores with Release after copying into the slot
    /// (frees the FIFO entry); the owner loads it only for diagnostics.
    pub post_tail: Line<AtomicU64>,
    /// Inbound producers, written by the peer: `window_head` (Release, after the window bytes)
    /// then `ring_head` (Release, after the ring entry). The owner loads both with Acquire.
    pub inbound_head: Line<[AtomicU64; 2]>,
    /// Inbound consumers, written by the owner with Release after consuming (`ring_tail`,
    /// `window_tail`); the peer loads them with Acquire before reusing the space.
    pub inbound_tail: Line<[AtomicU64; 2]>,
    /// The owner's outbound journal and what its application consumed.
    pub journal: Line<JournalWords>,
}

/// The words of one side's outbound journal (written by the owner only; the peer reads them
/// once the owner closed or died, when they no longer change).
#[repr(C)]
pub struct JournalWords {
    /// Stream offset just past the last byte the owner's application handed over (Release,
    /// after the journal bytes it covers). Every byte from the first the peer has not
    /// received in its slots up to here is in the journal.
    pub head: AtomicU64,
    /// Stream bytes the owner's application has read (Relaxed): a peer that ends with less
    /// than it was sent left data unread, which TCP answers with a reset.
    pub consumed: AtomicU64,
    /// 1 when the owner closed abortively (`SO_LINGER` 0): a reset, whatever was read.
    pub aborted: AtomicU64,
}

impl SideControl {
    /// Tells this side's owner that something was published for it: bumps `bell`, and if the
    /// owner announced it is asleep, claims the wake-up (`ASLEEP` → `WAKING`) and calls `ring`.
    /// Returns whether it rang.
    pub(crate) fn notify(&self, ring: impl FnOnce(&AtomicU32)) -> bool {
        use core::sync::atomic::Ordering::{Relaxed, SeqCst};
        self.bell.0.fetch_add(1, SeqCst);
        let claimed = self
            .identity
            .0
            .running
            .compare_exchange(ASLEEP, WAKING, SeqCst, Relaxed)
            .is_ok();
        if claimed {
            ring(&self.bell.0);
        }
        claimed
    }

    /// As [`SideControl::notify`], but rings whether or not the owner sleeps in a wait of
    /// ours (it may be blocked elsewhere, e.g. in epoll, where only the ring's mirror raise
    /// reaches it).
    pub(crate) fn ring(&self, ring: impl FnOnce(&AtomicU32)) {
        use core::sync::atomic::Ordering::{Relaxed, SeqCst};
        self.bell.0.fetch_add(1, SeqCst);
        let _ = self
            .identity
            .0
            .running
            .compare_exchange(ASLEEP, WAKING, SeqCst, Relaxed);
        ring(&self.bell.0);
    }

    /// The owner's `running` word (Relaxed: a scheduling hint, not a synchronisation).
    pub(crate) fn running(&self) -> u32 {
        self.identity
            .0
            .running
            .load(core::sync::atomic::Ordering::Relaxed)
    }
}

/// One entry of an inbound ring. Written by the sender before its Release store of `ring_head`.
#[repr(C)]
pub struct RingEntry {
    /// [`ENTRY_MESSAGE`] or [`ENTRY_WINDOW_WRITE`].
    pub kind: AtomicU32,
    /// Message: the receive slot used.
    pub slot: AtomicU32,
    /// Message length, or window chunk length.
    pub len: AtomicU32,
    /// Window write: the rkey the writer presented. Message: how far into the slot it starts
    /// (below [`PAYLOAD_ALIGN`]).
    pub rkey: AtomicU32,
    /// Window write: destination address in the receiver's process.
    pub dest: AtomicU64,
    /// Window write: free-running window position of the chunk's first byte.
    pub window_pos: AtomicU64,
}

/// One exposed registration, published by its owner for the peer's checks. A seqlock: the
/// owner (single writer, under the domain lock) makes `seq` odd, fences, writes the fields,
/// and makes `seq` even with Release; the peer reads `seq` (Acquire), the fields, fences
/// (Acquire) and re-reads `seq`, accepting only an unchanged even value.
#[repr(C)]
pub struct ExposureEntry {
    /// Seqlock sequence.
    pub seq: AtomicU32,
    /// The full rkey (generation and index); 0 when unused.
    pub rkey: AtomicU32,
    /// Remote rights (`Access` bits); 0 when revoked.
    pub access: AtomicU32,
    /// CMA copies the *peer* has under way into or out of this range (the one word of the
    /// table the peer writes): it adds one, then checks the entry (SeqCst fence between), and
    /// subtracts one when its copy ended. The owner, after revoking the entry, fences and
    /// waits for zero before the memory may be reused: a copy that passed its check cannot
    /// be stopped once the kernel runs it, so it must end before revocation returns.
    pub copies_in_flight: AtomicU32,
    /// Start of the exposed range in the owner's process.
    pub addr: AtomicU64,
    /// Length of the exposed range.
    pub len: AtomicU64,
}

const _: () = {
    assert!(size_of::<SegmentHeader>() <= SETUP_AREA);
    assert!(size_of::<SetupWords>() <= CACHE_LINE);
    assert!(SETUP_REPLY + MAX_SETUP_DATA <= HEADER_SIZE);
    assert!(size_of::<SideControl>() == 7 * CACHE_LINE);
    assert!(size_of::<RingEntry>() == 32);
    assert!(size_of::<ExposureEntry>() == 32);
};

/// Header fields as read from the file (before mapping it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawHeader {
    /// Magic word.
    pub magic: u64,
    /// Layout version.
    pub layout_version: u32,
    /// Header size.
    pub header_size: u32,
    /// File size claimed.
    pub total_size: u64,
    /// Slot size.
    pub slot_size: u32,
    /// Receive slots.
    pub recv_slots: u32,
    /// Send slots.
    pub send_slots: u32,
    /// Ring entries.
    pub ring_entries: u32,
    /// Window size.
    pub window_size: u32,
    /// Exposure entries.
    pub exposure_entries: u32,
    /// Journal size.
    pub journal_size: u32,
    /// Side offsets.
    pub side_offset: [u64; 2],
    /// Side size.
    pub side_size: u64,
    /// State word.
    pub state: u32,
}

fn le_u32(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn le_u64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

impl RawHeader {
    /// Parses the first [`HEADER_SIZE`] bytes of a file (x86-64/aarch64 Linux: little endian).
    pub fn parse(bytes: &[u8; HEADER_SIZE]) -> RawHeader {
        use core::mem::offset_of;
        let side = offset_of!(SegmentHeader, side_offset);
        RawHeader {
            magic: le_u64(bytes, offset_of!(SegmentHeader, magic)),
            layout_version: le_u32(bytes, offset_of!(SegmentHeader, layout_version)),
            header_size: le_u32(bytes, offset_of!(SegmentHeader, header_size)),
            total_size: le_u64(bytes, offset_of!(SegmentHeader, total_size)),
            slot_size: le_u32(bytes, offset_of!(SegmentHeader, slot_size)),
            recv_slots: le_u32(bytes, offset_of!(SegmentHeader, recv_slots)),
            send_slots: le_u32(bytes, offset_of!(SegmentHeader, send_slots)),
            ring_entries: le_u32(bytes, offset_of!(SegmentHeader, ring_entries)),
            window_size: le_u32(bytes, offset_of!(SegmentHeader, window_size)),
            exposure_entries: le_u32(bytes, offset_of!(SegmentHeader, exposure_entries)),
            journal_size: le_u32(bytes, offset_of!(SegmentHeader, journal_size)),
            side_offset: [le_u64(bytes, side), le_u64(bytes, side + 8)],
            side_size: le_u64(bytes, offset_of!(SegmentHeader, side_size)),
            state: le_u32(bytes, offset_of!(SegmentHeader, state)),
        }
    }
}

/// Why a segment's header was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CorruptSegment {
    /// The file is shorter than a header, or than the size the header claims.
    Truncated,
    /// Not a segment file (magic mismatch).
    BadMagic,
    /// A layout version this build does not speak.
    UnsupportedVersion(u32),
    /// A size field is zero or beyond the provider's limits.
    SizeOutOfRange,
    /// An offset or the total size disagrees with the geometry the sizes imply.
    GeometryMismatch,
    /// The segment is in no state an attacher can join.
    BadState,
}

/// The validated geometry of a segment: all offsets, computed locally from the sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// Slot pools.
    pub slots: SlotConfig,
    /// Inbound ring capacity per side.
    pub ring_entries: u32,
    /// Write-window bytes per side.
    pub window_size: u32,
    /// Outbound-journal bytes per side.
    pub journal_size: u32,
    /// Distance between two receive slots, and the bytes one holds: a message of up to
    /// `slots.slot_size` bytes at any offset below [`PAYLOAD_ALIGN`].
    pub slot_stride: usize,
    /// Size of one side area.
    pub side_size: usize,
    /// Whole segment.
    pub total_size: usize,
    fifo_off: usize,
    ring_off: usize,
    exposure_off: usize,
    slots_off: usize,
    window_off: usize,
    /// Where the journals start (the end of the side areas): what is allocated at creation.
    pub journals_off: usize,
}

fn round_up(value: usize, to: usize) -> Option<usize> {
    value.checked_add(to - 1).map(|v| v / to * to)
}

impl Geometry {
    /// Computes the layout for the given sizes, refusing anything outside the limits.
    pub fn compute(
        slots: SlotConfig,
        ring_entries: u32,
        window_size: u32,
        journal_size: u32,
    ) -> Result<Geometry, CorruptSegment> {
        let sizes_ok = (1..=MAX_SLOT_SIZE).contains(&slots.slot_size)
            && (1..=MAX_SLOTS).contains(&slots.recv_slots)
            && (1..=MAX_SLOTS).contains(&slots.send_slots)
            && ring_entries > u32::from(slots.recv_slots)
            && ring_entries <= u32::from(slots.recv_slots) + MAX_RING_EXTRA
            && (MIN_WINDOW_SIZE..=MAX_WINDOW_SIZE).contains(&window_size)
            && (PAGE as u32..=MAX_JOURNAL_SIZE).contains(&journal_size)
            && (journal_size as usize).is_multiple_of(PAGE);
        if !sizes_ok {
            return Err(CorruptSegment::SizeOutOfRange);
        }
        let recv = usize::from(slots.recv_slots);
        let slot_stride = round_up(slots.slot_size as usize + PAYLOAD_ALIGN - 1, CACHE_LINE)
            .ok_or(CorruptSegment::SizeOutOfRange)?;
        let fifo_off = size_of::<SideControl>();
        let ring_off =
            round_up(fifo_off + recv * 4, CACHE_LINE).ok_or(CorruptSegment::SizeOutOfRange)?;
        let exposure_off = ring_off + ring_entries as usize * size_of::<RingEntry>();
        let slots_off = round_up(
            exposure_off + EXPOSURE_ENTRIES as usize * size_of::<ExposureEntry>(),
            PAGE,
        )
        .ok_or(CorruptSegment::SizeOutOfRange)?;
        let window_off = slots_off.checked_add(
            recv.checked_mul(slot_stride)
                .ok_or(CorruptSegment::SizeOutOfRange)?,
        );
        let window_off = window_off.ok_or(CorruptSegment::SizeOutOfRange)?;
        let side_size = window_off
            .checked_add(window_size as usize)
            .and_then(|end| round_up(end, PAGE))
            .ok_or(CorruptSegment::SizeOutOfRange)?;
        let journals_off = side_size
            .checked_mul(2)
            .and_then(|sides| sides.checked_add(HEADER_SIZE))
            .ok_or(CorruptSegment::SizeOutOfRange)?;
        let total_size = journals_off
            .checked_add(2 * journal_size as usize)
            .filter(|total| *total as u64 <= MAX_SEGMENT_SIZE)
            .ok_or(CorruptSegment::SizeOutOfRange)?;
        Ok(Geometry {
            slots,
            ring_entries,
            window_size,
            journal_size,
            slot_stride,
            side_size,
            total_size,
            fifo_off,
            ring_off,
            exposure_off,
            slots_off,
            window_off,
            journals_off,
        })
    }

    /// Validates a header read from a file of `file_size` bytes and returns its geometry.
    pub fn from_header(raw: &RawHeader, file_size: u64) -> Result<Geometry, CorruptSegment> {
        if raw.magic != MAGIC {
            return Err(CorruptSegment::BadMagic);
        }
        if raw.layout_version != LAYOUT_VERSION {
            return Err(CorruptSegment::UnsupportedVersion(raw.layout_version));
        }
        if raw.header_size as usize != HEADER_SIZE || raw.exposure_entries != EXPOSURE_ENTRIES {
            return Err(CorruptSegment::GeometryMismatch);
        }
        let (Ok(recv_slots), Ok(send_slots)) =
            (u16::try_from(raw.recv_slots), u16::try_from(raw.send_slots))
        else {
            return Err(CorruptSegment::SizeOutOfRange);
        };
        let slots = SlotConfig {
            send_slots,
            recv_slots,
            slot_size: raw.slot_size,
        };
        let geometry =
            Geometry::compute(slots, raw.ring_entries, raw.window_size, raw.journal_size)?;
        let matches = raw.total_size == geometry.total_size as u64
            && raw.side_size == geometry.side_size as u64
            && raw.side_offset == [geometry.side_base(0) as u64, geometry.side_base(1) as u64];
        if !matches {
            return Err(CorruptSegment::GeometryMismatch);
        }
        if file_size != raw.total_size {
            return Err(CorruptSegment::Truncated);
        }
        Ok(geometry)
    }

    /// Offset of side `side`'s area (0 = creator, 1 = attacher).
    pub fn side_base(&self, side: usize) -> usize {
        HEADER_SIZE + side * self.side_size
    }

    /// Offset of side `side`'s control block.
    pub fn control(&self, side: usize) -> usize {
        self.side_base(side)
    }

    /// Offset of post-FIFO entry `index` (< recv_slots) of side `side`.
    pub fn fifo_entry(&self, side: usize, index: usize) -> usize {
        self.side_base(side) + self.fifo_off + index * 4
    }

    /// Offset of inbound-ring entry `index` (< ring_entries) of side `side`.
    pub fn ring_entry(&self, side: usize, index: usize) -> usize {
        self.side_base(side) + self.ring_off + index * size_of::<RingEntry>()
    }

    /// Offset of exposure-table entry `index` (< EXPOSURE_ENTRIES) of side `side`.
    pub fn exposure_entry(&self, side: usize, index: usize) -> usize {
        self.side_base(side) + self.exposure_off + index * size_of::<ExposureEntry>()
    }

    /// Offset of receive slot `slot` (< recv_slots) of side `side`.
    pub fn slot(&self, side: usize, slot: usize) -> usize {
        self.side_base(side) + self.slots_off + slot * self.slot_stride
    }

    /// Offset of byte `pos` (< window_size) of side `side`'s write window.
    pub fn window(&self, side: usize, pos: usize) -> usize {
        self.side_base(side) + self.window_off + pos
    }

    /// The page-aligned range `[start, end)` holding receive slots `[first, end_slot)` of side
    /// `side` (whole pages: the ends are widened to page bounds, within the side's slots).
    pub fn slot_pages(&self, side: usize, first: usize, end_slot: usize) -> (usize, usize) {
        let start = self.slot(side, first) / PAGE * PAGE;
        let end = self
            .slot(side, end_slot)
            .next_multiple_of(PAGE)
            .min(self.side_base(side) + self.window_off.next_multiple_of(PAGE));
        (start, end.max(start))
    }

    /// What a side needs allocated before its first use, page-aligned: its control words,
    /// post FIFO, inbound ring, exposure table and its first `ready_slots` receive slots
    /// (the other slots and the write window are allocated when first used).
    pub fn eager_range(&self, side: usize, ready_slots: usize) -> (usize, usize) {
        let ready = ready_slots.min(usize::from(self.slots.recv_slots));
        (self.side_base(side), self.slot_pages(side, ready, ready).1)
    }

    /// The page-aligned range of side `side`'s write window.
    pub fn window_pages(&self, side: usize) -> (usize, usize) {
        let start = self.window(side, 0) / PAGE * PAGE;
        (start, self.side_base(side) + self.side_size)
    }

    /// Offset of byte `pos` (< journal_size) of side `side`'s outbound journal.
    pub fn journal(&self, side: usize, pos: usize) -> usize {
        self.journals_off + side * self.journal_size as usize + pos
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(slot_size: u32, recv_slots: u16) -> SlotConfig {
        SlotConfig {
            send_slots: recv_slots,
            recv_slots,
            slot_size,
        }
    }

    #[test]
    fn regions_are_disjoint_and_inside_the_side_area() {
        let g = Geometry::compute(slots(1000, 7), 7 + 64, 8192, 8192).unwrap();
        assert!(g.fifo_entry(0, 6) + 4 <= g.ring_entry(0, 0));
        assert!(g.ring_entry(0, 70) + 32 <= g.exposure_entry(0, 0));
        assert!(g.exposure_entry(0, 1023) + 32 <= g.slot(0, 0));
        assert!(g.slot(0, 6) + 1000 <= g.window(0, 0));
        assert!(g.window(0, 8191) < g.side_base(1));
        assert_eq!(g.side_base(1) + g.side_size, g.journals_off);
        assert_eq!(g.journal(0, 0), g.journals_off);
        assert!(g.journal(0, 8191) < g.journal(1, 0));
        assert_eq!(g.journal(1, 8192), g.total_size);
        assert_eq!(g.slot_stride % 64, 0);
        assert!(g.slot_stride >= 1000 + PAYLOAD_ALIGN - 1);
    }

    #[test]
    fn limits_refuse_hostile_sizes() {
        assert_eq!(
            Geometry::compute(slots(0, 4), 8, 8192, 4096),
            Err(CorruptSegment::SizeOutOfRange)
        );
        assert_eq!(
            Geometry::compute(slots(MAX_SLOT_SIZE + 1, 4), 8, 8192, 4096),
            Err(CorruptSegment::SizeOutOfRange)
        );
        assert_eq!(
            Geometry::compute(slots(64, 4), 4, 8192, 4096),
            Err(CorruptSegment::SizeOutOfRange),
            "ring must exceed slots"
        );
        assert_eq!(
            Geometry::compute(slots(MAX_SLOT_SIZE, MAX_SLOTS), 5000, MAX_WINDOW_SIZE, 4096),
            Err(CorruptSegment::SizeOutOfRange),
            "8 GiB of slots exceeds the segment limit"
        );
    }
}
