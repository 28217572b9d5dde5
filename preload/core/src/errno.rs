//! `errno` of the calling thread.

/// The calling thread's `errno`.
#[inline(always)]
pub fn get() -> i32 {
    // SAFETY: __errno_location always returns the calling thread's valid errno slot.
    unsafe { *libc::__errno_location() }
}

/// Sets the calling thread's `errno`.
#[inline(always)]
pub fn set(value: i32) {
    // SAFETY: as in `get`.
    unsafe { *libc::__errno_location() = value }
}

/// An errno value as data, carried to where a C return value is produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Errno(pub i32);

impl Errno {
    /// The calling thread's current `errno`.
    #[inline]
    pub fn last() -> Self {
        Self(get())
    }
}

/// Saves `errno` on creation and restores it on drop: bookkeeping after a real call must leave
/// the caller exactly the `errno` the real call left.
#[must_use]
pub struct Preserved(i32);

impl Preserved {
    /// Captures the current `errno`.
    #[inline(always)]
    pub fn save() -> Self {
        Self(get())
    }
}

impl Drop for Preserved {
    #[inline(always)]
    fn drop(&mut self) {
        set(self.0)
    }
}
