//! # san-verbs: the cross-host SAN provider (RDMA verbs over rdma_cm)
//!
//! Implements [`san_api::SanDomain`] ([`VerbsDomain`]: a protection domain and its memory
//! registrations), [`san_api::SanConnection`] ([`VerbsConnection`]: one reliable-connected
//! queue pair set up through rdma_cm, with provider-owned pools of registered control
//! buffers) and [`san_api::SanConnector`] ([`VerbsConnector`]: rdma_cm connect/listen/accept
//! with the setup blob as private data), on libibverbs/librdmacm through `rdma-sys`.
//!
//! The crate is built twice: as an rlib (tests, tools) and as `libsandirect_verbs.so`, which
//! the preload loads with `dlopen` through the C ABI of `san-verbs-loader` (module [`ffi`])
//! only on hosts that have RDMA devices, so that the preload itself never links rdma-core.
//!
//! ## Where `unsafe` lives
//! Mostly in the small per-object modules (`device`, `pd`, `mr`, `cq`, `cm`, `qp`, `slots`),
//! the C helpers (`sys`) and [`ffi`]. Three modules above them make C calls of their own: `connection`
//! (rdma_cm address and route resolution, connect and disconnect, posts through its queue
//! pair, the epoll set over its channels), `listener` (rdma_cm bind, listen, accept and
//! reject) and [`monitor`] (the userfaultfd system calls). `domain` and `setup` have none.
//! Every block carries a `// SAFETY:` line, and arguments are validated in Rust before any
//! C call.
//!
//! ## Why posted buffers outlive their completions
//! The connection owns its slot memory (anonymous mappings, registered once). A slot is
//! handed to the device only by posting it and is marked in flight until its completion is
//! polled; it is not reused, exposed to the caller (`recv_slot`) or freed meanwhile. The
//! connection's destructor disconnects (moving the QP to the error state), destroys the QP
//! (after which the device can no longer touch any buffer), and only then deregisters and
//! unmaps the pools. RDMA reads and writes name caller memory through a registration of the
//! domain; the registration pins the pages for as long as it exists, and the domain outlives
//! every connection (each holds a reference), so the device never touches unpinned pages.
//! Deregistering while an RDMA operation is in flight makes that operation fail (a local
//! protection error), never touch freed memory.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod cm;
mod connection;
mod cq;
mod device;
mod domain;
pub mod ffi;
mod listener;
pub mod monitor;
mod mr;
mod pd;
mod qp;
mod setup;
mod slots;
mod sys;

pub use connection::{VerbsConnection, WaitOutcome};
pub use domain::VerbsDomain;
pub use listener::{IncomingRequest, VerbsListener};
pub use monitor::{EventCounts, MemoryChanges, MonitorUnavailable};
pub use san_verbs_loader::{ConnectParams, ConnectorConfig, VerbsSetupError};
pub use setup::{VerbsConnecting, VerbsConnector};
