//! This process: its identity across `fork`/`vfork`, and the library's own threads.

use core::sync::atomic::{AtomicI32, Ordering};

/// The pid of this process as of init or its last `fork` (a `vfork` child, which shares our
/// memory, sees its parent's).
static PROCESS_ID: AtomicI32 = AtomicI32::new(0);

/// Records the process id (init and fork child).
pub fn note_process_id() {
    // SAFETY: getpid has no preconditions.
    PROCESS_ID.store(unsafe { libc::getpid() }, Ordering::Relaxed);
}

/// This process's id, as noted at init and after each `fork` (no system call; before init,
/// `getpid`). A `vfork` child, whose hooks leave the SAN state alone, reads its parent's.
pub fn id() -> u32 {
    match PROCESS_ID.load(Ordering::Relaxed) {
        // SAFETY: getpid has no preconditions.
        0 => unsafe { libc::getpid() as u32 },
        pid => pid as u32,
    }
}

/// True in a `vfork` child: it runs on its parent's memory, whose SAN state it must not touch.
pub fn in_vfork_child() -> bool {
    let noted = PROCESS_ID.load(Ordering::Relaxed);
    // SAFETY: getpid has no preconditions (no cache since glibc 2.25).
    noted != 0 && noted != unsafe { libc::getpid() }
}

/// Starts one of the library's own threads (the verbs service, the nudge responder) with
/// every signal blocked, so that a signal sent to the process is never delivered on it: the
/// application's handlers expect its own threads, and a program that blocks a signal in all
/// of its threads to take it with `sigwait`/`signalfd` would otherwise lose it to ours (the
/// new thread inherits the mask of its creator, which is restored right after). False when
/// the thread could not be created.
pub fn spawn_internal_thread(name: &str, body: impl FnOnce() + Send + 'static) -> bool {
    // SAFETY: sigset_t is plain data; sigfillset initialises it.
    let mut all: libc::sigset_t = unsafe { core::mem::zeroed() };
    // SAFETY: as above.
    let mut previous: libc::sigset_t = unsafe { core::mem::zeroed() };
    // SAFETY: sigfillset writes the set; pthread_sigmask reads `all` and writes `previous`.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut previous);
    }
    let started = std::thread::Builder::new()
        .name(name.into())
        .spawn(body)
        .is_ok();
    // SAFETY: restores this thread's mask as it was.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &previous, core::ptr::null_mut()) };
    started
}
