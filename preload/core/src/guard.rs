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

use core::cell::Cell;

thread_local! {
    static INSIDE: Cell<bool> = const { Cell::new(false) };
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

/// True when the current thread is inside the library's own code.
#[inline(always)]
pub fn is_inside() -> bool {
    INSIDE.with(Cell::get)
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
    fn guard_is_per_thread() {
        let _held = ReentrancyGuard::enter();
        let other = std::thread::spawn(is_inside).join();
        assert!(!other.unwrap());
    }
}
