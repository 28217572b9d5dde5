//! # preload-core: everything the sandirect interposer does, as a testable rlib
//!
//! The `sandirect-preload` cdylib (`libsandirect.so`) contains only the exported hook
//! functions; each is one call into [`ops`]. Everything else lives here so unit tests link it
//! without exporting `read`, `close`, … into the test binary.
//!
//! * [`hooks`] — the declarative hook table every generated piece comes from;
//! * [`real`] — the real functions, resolved once in the constructor;
//! * [`fdtable`] — fd → socket object, one atomic load per lookup;
//! * [`record`], [`registry`] — socket objects (all atomics) in published shared memory;
//! * [`ops`] — the hooks' behaviour, one module per hook family; [`track`] — the bookkeeping
//!   of our fds and socket records the families share; [`runtime`] — init and exit;
//! * [`settings`] — every `SANDIRECT_*` variable; [`logging`]; [`process`] — pid across
//!   fork, the library's own threads;
//! * [`san`] — the SAN path: switch-over, session-driven I/O, readiness substitution;
//! * [`config`] — the rules file; [`inventory`] — the symbol inventory; [`stats`] — reading
//!   other processes' published connections (for `sandirect stat`);
//! * [`guard`] — the reentrancy guard and the guarded bookkeeping region; [`errno`] — errno
//!   access;
//! * [`fault`] — copies of the application's buffers that answer `EFAULT` instead of crashing,
//!   and the SIGSEGV/SIGBUS handler behind them.

pub mod config;
pub mod discovery;
pub mod errno;
pub mod fault;
pub mod fdtable;
pub mod guard;
#[macro_use]
pub mod hooks;
pub mod inventory;
pub mod listener_owner;
pub mod logging;
pub mod mirror;
pub mod negative_cache;
pub mod ops;
pub mod process;
pub mod real;
pub mod record;
pub mod registry;
pub mod runtime;
pub mod san;
pub mod settings;
pub mod stats;
pub mod track;
