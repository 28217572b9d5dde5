//! The outcome of a hook's SAN side, and its conversion to the C return value.
//!
//! A hook on one of our SAN sockets either answers the call itself ([`Outcome::Done`]), fails
//! it ([`Outcome::Failed`]), or leaves it to the real function ([`Outcome::Bypass`], with the
//! reason). The errno travels as data until the C return value is produced: a hook sets the
//! thread's `errno` for an outcome in exactly one place, [`Outcome::returned`].
//!
//! The SAN path still answers in its own terms (`Option<isize>`, errno set by it, `None`
//! meaning "kernel TCP after all"); [`Outcome::from_san`] is the one place that reads them.

use core::ffi::c_int;

use libc::ssize_t;

use crate::errno::{self, Errno};

/// What the SAN side of a hook decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Outcome<T> {
    /// The call is answered: its C return value.
    Done(T),
    /// The real function is to be called (for this reason).
    Bypass(Why),
    /// The call fails with this errno (the C return value is the type's failure value).
    Failed(Errno),
}

/// Why a hook on one of our sockets makes the real call after all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// A tracked socket that is not on the SAN path (kernel TCP).
    NotOnSan,
    /// The SAN path handed the socket back to kernel TCP (downgraded, or a stash of it is
    /// read while sending is plain TCP).
    Downgraded,
    /// A FORTIFY_SOURCE check failed: the real function aborts the program, as it must.
    Fortify,
}

/// A C return type (a count or a status) and the value it has on failure.
pub trait CReturn: Copy {
    /// What the C function returns on failure (with `errno` set).
    const FAILURE: Self;
    /// A failure (negative) rather than a count or status.
    fn is_failure(self) -> bool;
}

impl CReturn for ssize_t {
    const FAILURE: Self = -1;
    #[inline(always)]
    fn is_failure(self) -> bool {
        self < 0
    }
}

impl CReturn for c_int {
    const FAILURE: Self = -1;
    #[inline(always)]
    fn is_failure(self) -> bool {
        self < 0
    }
}

impl<T> Outcome<T> {
    /// The answer's value converted (the errno and the bypass reason kept).
    #[inline(always)]
    pub fn map<U>(self, convert: impl FnOnce(T) -> U) -> Outcome<U> {
        match self {
            Outcome::Done(value) => Outcome::Done(convert(value)),
            Outcome::Bypass(why) => Outcome::Bypass(why),
            Outcome::Failed(errno) => Outcome::Failed(errno),
        }
    }
}

impl<T: CReturn> Outcome<T> {
    /// A kernel call's result (made on the SAN side, e.g. reading a file for `sendfile`): a
    /// count or status, or a failure with the errno the call just left.
    #[inline]
    pub fn from_kernel(result: T) -> Self {
        if result.is_failure() {
            Outcome::Failed(Errno::last())
        } else {
            Outcome::Done(result)
        }
    }

    /// The SAN path's answer (`san::send_iov`, `san::recv_iov`, `san::select_via_poll`):
    /// `None` means the real call, for the reason `none` (what that SAN function's `None`
    /// says); a negative value is a failure whose errno the SAN path has just left.
    #[inline]
    pub fn from_san(result: Option<T>, none: Why) -> Self {
        match result {
            Some(value) => Self::from_kernel(value),
            None => Outcome::Bypass(none),
        }
    }

    /// The C return value of a decided call: `Done`'s value, or for `Failed` the failure value
    /// with `errno` set (the one place a hook sets it for an outcome). `Err` with the reason
    /// when the real function is to be called.
    #[inline(always)]
    pub fn returned(self) -> Result<T, Why> {
        match self {
            Outcome::Done(value) => Ok(value),
            Outcome::Failed(Errno(code)) => {
                errno::set(code);
                Ok(T::FAILURE)
            }
            Outcome::Bypass(why) => Err(why),
        }
    }

    /// The C return value, calling `real` for a bypass.
    #[inline(always)]
    pub fn or_real(self, real: impl FnOnce(Why) -> T) -> T {
        self.returned().unwrap_or_else(real)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An errno no outcome here carries: whether a conversion touched `errno` shows.
    const UNTOUCHED: i32 = 12_345;

    #[test]
    fn done_returns_its_value_and_leaves_errno_alone() {
        errno::set(UNTOUCHED);
        assert_eq!(Outcome::<ssize_t>::Done(42).returned(), Ok(42));
        assert_eq!(Outcome::<c_int>::Done(0).or_real(|_| unreachable!()), 0);
        assert_eq!(errno::get(), UNTOUCHED);
    }

    #[test]
    fn failed_sets_errno_and_returns_the_failure_value() {
        errno::set(UNTOUCHED);
        let failed = Outcome::<ssize_t>::Failed(Errno(libc::EAGAIN));
        assert_eq!(failed.returned(), Ok(-1));
        assert_eq!(errno::get(), libc::EAGAIN);
        errno::set(UNTOUCHED);
        let failed = Outcome::<c_int>::Failed(Errno(libc::ECONNRESET));
        assert_eq!(failed.or_real(|_| unreachable!()), -1);
        assert_eq!(errno::get(), libc::ECONNRESET);
    }

    #[test]
    fn bypass_makes_the_real_call_and_leaves_errno_to_it() {
        errno::set(UNTOUCHED);
        let bypass = Outcome::<ssize_t>::Bypass(Why::Fortify);
        assert_eq!(bypass.returned(), Err(Why::Fortify));
        assert_eq!(errno::get(), UNTOUCHED);
        let mut reason = None;
        let result = Outcome::<ssize_t>::Bypass(Why::Downgraded).or_real(|why| {
            reason = Some(why);
            7
        });
        assert_eq!((result, reason), (7, Some(Why::Downgraded)));
        assert_eq!(errno::get(), UNTOUCHED);
    }

    #[test]
    fn san_answers_convert_without_losing_the_errno() {
        assert_eq!(
            Outcome::<ssize_t>::from_san(None, Why::Downgraded),
            Outcome::Bypass(Why::Downgraded)
        );
        assert_eq!(
            Outcome::<ssize_t>::from_san(Some(0), Why::Downgraded),
            Outcome::Done(0)
        );
        assert_eq!(
            Outcome::<ssize_t>::from_san(Some(1500), Why::Downgraded),
            Outcome::Done(1500)
        );
        // The SAN path sets errno and answers -1; the outcome carries that errno back to the
        // caller, whatever ran in between.
        errno::set(libc::EPIPE);
        let failed = Outcome::<ssize_t>::from_san(Some(-1), Why::Downgraded);
        assert_eq!(failed, Outcome::Failed(Errno(libc::EPIPE)));
        errno::set(UNTOUCHED);
        assert_eq!(failed.returned(), Ok(-1));
        assert_eq!(errno::get(), libc::EPIPE);
        // A status (select through poll) converts the same way.
        assert_eq!(
            Outcome::<c_int>::from_san(Some(2), Why::Downgraded),
            Outcome::Done(2)
        );
        assert_eq!(
            Outcome::<c_int>::from_san(None, Why::NotOnSan),
            Outcome::Bypass(Why::NotOnSan)
        );
        errno::set(libc::EINTR);
        assert_eq!(
            Outcome::<c_int>::from_san(Some(-1), Why::Downgraded),
            Outcome::Failed(Errno(libc::EINTR))
        );
    }

    #[test]
    fn kernel_results_and_map_keep_count_errno_and_reason() {
        assert_eq!(Outcome::from_kernel(5), Outcome::Done(5));
        errno::set(libc::EBADF);
        assert_eq!(
            Outcome::from_kernel(-1),
            Outcome::Failed(Errno(libc::EBADF))
        );
        assert_eq!(
            Outcome::<ssize_t>::Done(3).map(|n| n as c_int),
            Outcome::Done(3)
        );
        assert_eq!(
            Outcome::<ssize_t>::Failed(Errno(libc::EINVAL)).map(|n| n as c_int),
            Outcome::Failed(Errno(libc::EINVAL))
        );
        assert_eq!(
            Outcome::<ssize_t>::Bypass(Why::NotOnSan).map(|n| n as c_int),
            Outcome::Bypass(Why::NotOnSan)
        );
    }
}
