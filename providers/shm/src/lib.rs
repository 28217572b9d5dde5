//! # san-shm: the intra-host SAN provider of sandirect
//!
//! Two processes on one host that both run under the sandirect preload carry a TCP connection
//! over a shared-memory **segment** instead of the kernel's loopback path. The connecting
//! process creates the segment file ([`ShmSegment::create`]) in a private per-user directory
//! under a name derived from the TCP 4-tuple; the accepting process attaches to it
//! ([`ShmSegment::attach`]). Each process opens that directory once as a [`ShmDir`], checked
//! through the open descriptor, and reaches every file relative to it. The preload chooses the
//! names and the moment; this crate provides the segment, everything inside it, and the
//! [`san_api`] provider traits over it:
//!
//! * [`ShmConnection`] implements [`san_api::SanConnection`]: sends copy straight into the
//!   peer's posted receive slot (one copy); RDMA read/write use CMA (`process_vm_readv` /
//!   `process_vm_writev`) on the peer's pid after checking the rkey against the peer's
//!   exposure table, or — where the kernel forbids CMA, or [`DomainConfig::force_window`] —
//!   writes travel through a bounded window in the segment, ordered with the messages.
//! * [`ShmDomain`] implements [`san_api::SanDomain`]: registration is bookkeeping (CMA works
//!   on unpinned memory, so no `mlock`), rkeys are generation-numbered and never reused, and
//!   exposures are mirrored into every connection's segment.
//! * [`ShmConnector`] implements [`san_api::SanConnector`]: the address is the segment name;
//!   connect creates the segment with the setup blob in its header page, listen/poll_request
//!   attach and read it, accept/reject answer in the segment (see `setup.rs`).
//!   [`san_api::SanDomain::memory_invalidated`] withdraws exposures over the range.
//! * [`ShmConnection::wait`] waits adaptively: a bounded spin (about one wake-up's cost) only
//!   while the peer is running or being woken — yielding between checks instead of spinning
//!   when the peer shares our CPU — then a cross-process futex sleep. The peer is rung only
//!   when it announced it is asleep, exactly once per sleep. A [`Doorbell`] hook plus
//!   [`ShmConnection::prepare_to_block`]/[`ShmConnection::finish_blocking`] let the preload block
//!   in its own `epoll_wait` and still be woken (its readiness mirror). [`WaitStats`] counts
//!   spins that paid off, sleeps and wake-ups sent.
//!
//! ## Safety boundary
//! All `unsafe` code is in the private `sys` module (mapping, futex, CMA, pidfd, libc calls).
//! Shared words are atomics ([`ShmSafe`] types), shared bytes are moved by bounds-checked copies,
//! and everything read from the segment is validated before use: a corrupt or hostile file
//! gives an error, never undefined behaviour or a panic. See `segment.rs` for what a same-user
//! peer can still do (it can always ptrace us; the boundary is against other users), and for
//! private segments, shared with a peer of another user (sealed, never CMA).
//!
//! ## Memory-ordering protocol (summary; each field's doc in `layout.rs` has the detail)
//! * Every shared counter has one writing process. Producers write the data (slot bytes, ring
//!   entry, window bytes) with plain atomic stores or copies, then publish the counter with
//!   Release; consumers load it with Acquire before reading the data.
//! * Sleep/wake and "waiting for room" are Dekker pairs on SeqCst operations (see
//!   [`ShmConnection::wait`]).
//! * Exposure entries are seqlocks written only by their owner.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod connection;
mod dir;
mod domain;
mod error;
mod layout;
mod pending;
mod segment;
mod setup;
mod sys;

pub use connection::{
    ConnectionConfig, CorruptJournal, Doorbell, FutexDoorbell, JournalUnavailable, Leftovers,
    PeerEnd, PeerProcess, ShmConnection, WaitResult, WaitStats,
};
pub use dir::ShmDir;
pub use domain::{DomainConfig, ShmDomain, MAX_RDMA_LEN};
pub use error::{CorruptSegment, PermissionProblem, ShmError};
pub use layout::{HEADER_SIZE, LAYOUT_VERSION, MAGIC, MAX_SETUP_DATA};
pub use pending::{PendingMark, PendingPorts, PENDING_PORTS_FILE};
pub use segment::{
    contact, set_contact, AccessPolicy, NamespacedPid, SegmentConfig, ShmSegment, Side,
};
pub use setup::{ShmConnecting, ShmConnector, ShmConnectorConfig, ShmListener, ShmRequest};
pub use sys::{
    allocate_file, coarse_now, futex_wait, futex_wake, internal_fd_floor, memfd_sealable,
    move_internal_fd, multi_cpu, pid_namespace, pidfd_open, process_cpu_time, relocate_internal_fd,
    remembered, seal_size, size_sealed, FutexWait, ShmSafe,
};
