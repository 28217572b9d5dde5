//! The reentrancy guard.
//!
//! The library's own I/O (logging, config reading, stats files) runs inside a
//! [`ReentrancyGuard`]. A hook that finds the guard held on its thread treats the call as not
//! ours and goes straight to the real function, so Rust std's own `read`/`write`/`close` never
//! re-enter the bookkeeping.
//!
//! The flag is a `const`-initialised `thread_local!` of a type without a destructor: reading it
//! never allocates, never registers a TLS destructor and works during thread teardown and in
//! signal handlers.
//!
//! `bookkeeping` is the guarded region the hooks run their work after a real call in:
//! `errno` preserved, the guard held, a panic caught and counted ([`internal_faults`]).

use core::cell::Cell;
use core::sync::atomic::{AtomicU64, Ordering};

use crate::errno;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
    /// The process id of a thread that is calling `vfork` (set by the `vfork` trampoline
    /// just before the real call), else 0.
    static VFORK_PARENT: Cell<libc::pid_t> = const { Cell::new(0) };
}

/// Called on the thread about to `vfork` (from the trampoline, in the parent).
///
/// A `vfork` child runs on its parent's memory *and on the calling thread's TLS* until it
/// execs or exits, while its descriptor table is its own copy. Every hook it calls must act
/// like the kernel call alone: our fd table, socket records and SAN state are the parent's,
/// and a child's `close_range` (CPython closes every inherited descriptor this way before
/// its exec) would otherwise release the parent's sockets.
pub fn note_vfork() {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    VFORK_PARENT.with(|parent| parent.set(pid));
}

/// True in a `vfork` child (between `vfork` and its exec or exit). Costs one TLS load
/// unless this thread called `vfork`; then a `getpid` until the parent's next hook call
/// sees its own pid and clears the mark (the child never writes it: the parent would see it).
#[inline(always)]
pub fn in_vfork_child() -> bool {
    let parent = VFORK_PARENT.with(Cell::get);
    parent != 0 && vfork_child_slow(parent)
}

#[cold]
fn vfork_child_slow(parent: libc::pid_t) -> bool {
    // SAFETY: getpid has no preconditions (glibc caches no pid since 2.25).
    if unsafe { libc::getpid() } != parent {
        return true;
    }
    VFORK_PARENT.with(|mark| mark.set(0));
    false
}

/// Marks the current thread as running the library's own code until dropped. Nestable.
#[must_use = "the guard protects only while it is alive"]
pub struct ReentrancyGuard {
    previous: bool,
}

impl ReentrancyGuard {
    /// Enters the guarded region.
    #[inline]
    pub fn enter() -> Self {
        Self {
            previous: INSIDE.with(|inside| inside.replace(true)),
        }
    }
}

impl Drop for ReentrancyGuard {
    #[inline]
    fn drop(&mut self) {
        INSIDE.with(|inside| inside.set(self.previous));
    }
}

/// Runs `sleep` (a blocking wait of a SAN call, no lock of ours held) with the guard released.
///
/// Signals arrive while a blocking call sleeps. A handler that leaves with `siglongjmp` (the
/// classic alarm timeout) skips the frames below it, our guard's `Drop` among them: released
/// here, the flag is clear after such a jump, and the thread's next SAN call works. A
/// handler that returns finds the flag as the sleep left it, and may itself use the SAN
/// path meanwhile (nothing of ours is locked while we sleep).
#[inline]
pub(crate) fn released_while<T>(sleep: impl FnOnce() -> T) -> T {
    let held = INSIDE.with(|inside| inside.replace(false));
    let result = sleep();
    INSIDE.with(|inside| inside.set(held));
    result
}

/// True when the current thread is inside the library's own code.
#[inline(always)]
pub fn is_inside() -> bool {
    INSIDE.with(Cell::get)
}

static INTERNAL_FAULTS: AtomicU64 = AtomicU64::new(0);

/// Bookkeeping steps that panicked (always a bug; the real call's result was still returned).
pub fn internal_faults() -> u64 {
    INTERNAL_FAULTS.load(Ordering::Relaxed)
}

/// Counts a panic caught in the library's own code.
#[cold]
pub(crate) fn note_internal_fault() {
    INTERNAL_FAULTS.fetch_add(1, Ordering::Relaxed);
}

/// Runs post-call bookkeeping: errno preserved, guard held, panics caught and counted.
#[inline]
pub(crate) fn bookkeeping(work: impl FnOnce()) {
    let _errno = errno::Preserved::save();
    let _guard = ReentrancyGuard::enter();
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
        note_internal_fault();
    }
}

/// Runs the library's own work inside a hook (readiness, process and epoll hooks), guard
/// held: a panic is caught and counted and gives `None`, so the hook goes on with the real
/// call's result instead of unwinding into C (which would abort the host program). errno is
/// left to the caller (some of this work sets it on purpose).
#[inline]
pub(crate) fn contained<T>(work: impl FnOnce() -> T) -> Option<T> {
    let _guard = ReentrancyGuard::enter();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)) {
        Ok(value) => Some(value),
        Err(_) => {
            note_internal_fault();
            None
        }
    }
}

/// Test-only: makes the library's work at a given site panic once on this thread (a bug
/// stand-in), and lets this thread's hooks act as if SAN sockets were alive.
#[cfg(test)]
pub(crate) mod seam {
    use core::cell::Cell;

    thread_local! {
        static ARMED: Cell<Option<&'static str>> = const { Cell::new(None) };
        static PRETEND_LIVE: Cell<bool> = const { Cell::new(false) };
    }

    /// The next [`panic_if_armed`] at `site` on this thread panics.
    pub(crate) fn arm(site: &'static str) {
        ARMED.with(|armed| armed.set(Some(site)));
    }

    /// Whether the armed panic has not fired yet.
    pub(crate) fn armed() -> bool {
        ARMED.with(|armed| armed.get().is_some())
    }

    /// Called first by the work of each site (test builds only).
    pub(crate) fn panic_if_armed(site: &'static str) {
        if ARMED.with(|armed| armed.get() == Some(site)) {
            ARMED.with(|armed| armed.set(None));
            panic!("injected panic at {site}");
        }
    }

    /// This thread's hooks see at least one live SAN socket while `live` is set.
    pub(crate) fn pretend_live(live: bool) {
        PRETEND_LIVE.with(|pretend| pretend.set(live));
    }

    pub(crate) fn pretending_live() -> bool {
        PRETEND_LIVE.with(Cell::get)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_nests_and_restores() {
        assert!(!is_inside());
        {
            let _outer = ReentrancyGuard::enter();
            assert!(is_inside());
            {
                let _inner = ReentrancyGuard::enter();
                assert!(is_inside());
            }
            assert!(is_inside(), "inner guard must not clear the outer one");
        }
        assert!(!is_inside());
    }

    #[test]
    fn sleeping_releases_the_guard_and_takes_it_back() {
        let _held = ReentrancyGuard::enter();
        assert!(!released_while(is_inside));
        assert!(is_inside(), "held again after the sleep");
    }

    #[test]
    fn guard_is_per_thread() {
        let _held = ReentrancyGuard::enter();
        let other = std::thread::spawn(is_inside).join();
        assert!(!other.unwrap());
    }
}
