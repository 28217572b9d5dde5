//! The constructor's and destructor's work, and the fork child handler.
//!
//! * **Constructor** ([`init`]): resolve every real function, read the settings and the
//!   rules ([`crate::settings`]), install logging, register the `pthread_atfork` child
//!   handler, adopt the stashes an exec'ing image handed over. All of it inside the
//!   reentrancy guard; a panic leaves the library a passthrough.
//! * **fork**: the child handler (`ops::after_fork_in_child`) gives the child its own stats file
//!   and marks inherited sockets; SAN sessions are downgraded to TCP before the fork (a
//!   session cannot be shared by two processes while the kernel socket can). The handler is
//!   async-signal-safe: system calls and atomics only.
//! * **exec**: nothing survives but descriptors and the environment; the new image adopts the
//!   sockets whose received bytes were stashed for it (`SANDIRECT_STASHES`).

use std::ffi::CStr;

use crate::guard::ReentrancyGuard;
use crate::{logging, process, real, registry, settings};

/// The constructor's work. `argv0` comes from the `.init_array` arguments when available.
pub fn init(argv0: Option<&CStr>) {
    real::resolve_all();
    let _guard = ReentrancyGuard::enter();
    let result = std::panic::catch_unwind(|| init_guarded(argv0));
    if result.is_err() {
        // Never take the host down: stay a passthrough library.
        settings::disable_tracking();
    }
}

fn init_guarded(argv0: Option<&CStr>) {
    logging::install(
        settings::var_os(settings::LOG)
            .and_then(|v| v.into_string().ok())
            .as_deref(),
    );
    settings::load(argv0);
    process::note_process_id();
    // SAFETY: registering a plain extern "C" handler.
    unsafe { libc::pthread_atfork(None, None, Some(crate::ops::after_fork_in_child)) };
    // Bytes a downgraded socket had received before the image that exec'd us: they come
    // before anything on TCP, whatever our own settings (the variable is ours alone). A
    // privileged process does not take descriptors on its environment's word; the variable
    // goes in any case, so that it reaches no further image.
    let stashes = settings::var_os(settings::STASHES);
    std::env::remove_var(settings::STASHES);
    if let Some(stashes) = stashes {
        crate::san::adopt_stashes(
            &stashes.to_string_lossy(),
            crate::track::adopt_inherited_socket,
        );
    }
}

/// Destructor's work: stop publishing.
pub fn at_exit() {
    registry::registry().unpublish_at_exit();
    crate::san::at_exit();
}
