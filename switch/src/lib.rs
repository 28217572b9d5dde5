//! # switch: the sans-IO core of sandirect
//!
//! (Architecture essay: see the module docs of [`session`], [`wire`] and [`mr_cache`].)
//!
//! * [`wire`]: the control-message format of the session protocol (smoltcp-style
//!   `Packet`/`Repr`), byte for byte as in `docs/PROTOCOL.md`.
//! * [`session`]: one [`session::Session`] per connected socket: negotiation, credits,
//!   inline and rendezvous (zero-copy) transfers, Linux TCP stream semantics, all sans-IO
//!   (inputs `handle_*`, outputs `poll_*`), plus [`session::drive`], the one pump between a
//!   session and a `san_api::SanConnection` that the preload, the simulation and the
//!   benches share.
//! * [`error`]: the error taxonomy and the single errno mapping.
//! * [`mr_cache`]: the registration cache.
#![no_std]
#![forbid(unsafe_code)]

extern crate alloc;
#[cfg(test)]
extern crate std;

pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod mr_cache;
pub mod session;
pub mod wire;
