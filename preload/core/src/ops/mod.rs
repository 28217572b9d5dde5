//! What every hook does. The exported functions in the cdylib are one-line calls into here.
//!
//! # The passthrough path
//!
//! For an fd that is not ours a hook does exactly: one atomic load from the fd table, then the
//! real call through its resolved pointer. No lock, no allocation, no logging, no `std::env`,
//! no errno change: async-signal-safe. Calls that need no per-fd state (`bind`,
//! `getsockname`, …) go straight to the real function, and so do the readiness calls while no
//! SAN socket is alive.
//!
//! # The tracked path
//!
//! For our fds the real call still happens first and its result (and `errno`) is what the
//! caller gets. The bookkeeping after it runs inside `bookkeeping`: `errno` is saved and
//! restored, the reentrancy guard is held, and a panic (which would be a bug) is caught and
//! counted — the real call's result is returned regardless, because turning a completed
//! `accept` or `close` into a failure would leak or double-close an fd. Nothing runs the real
//! call twice.
//!
//! # Layout
//!
//! One module per family of the hook table ([`crate::hooks`]): [`socket`](mod@socket)
//! (creation, addressing, options), [`fd`] (descriptor lifetime), [`data`] (data transfer),
//! [`readiness`] (poll, select, epoll), [`process`] (fork, exec, spawn), [`around`] (`syscall`,
//! `fdopen`: paths that would otherwise reach a socket around the other hooks). The data hooks' call
//! machinery is in `call`; `outcome` is what a hook's SAN side decides (done, failed with an
//! errno, or the real call after all) and its one conversion to the C return value. The
//! bookkeeping of fds and records every family shares is in [`crate::track`]. Every hook is
//! re-exported here as `ops::NAME`, the path the cdylib's generated exports call.

pub mod around;
mod call;
pub mod data;
pub mod fd;
mod outcome;
pub mod process;
pub mod readiness;
pub mod signals;
pub mod socket;
#[cfg(test)]
mod tests;

pub use around::*;
pub use data::*;
pub use fd::*;
pub use process::*;
pub use readiness::*;
pub use signals::*;
pub use socket::*;
