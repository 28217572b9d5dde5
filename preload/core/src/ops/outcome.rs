//! The outcome of a hook's SAN side, and its conversion to the C return value.
//!
//! A hook on one of our SAN sockets either answers the call itself ([`Outcome::Done`]), fails
//! it ([`Outcome::Failed`]), or leaves it to the real function ([`Outcome::Bypass`], with the
//! reason). The errno travels as data until the C return value is produced: a hook sets the
//! thread's `errno` for an outcome in exactly one place, [`Outcome::returned`].
//!
//! The SAN path answers in its own terms ([`SanCall`]: `None` meaning "kernel TCP after all",
//! otherwise the value or the errno as data); [`Outcome::from_san`] is the one place that
//! converts them.

use core::ffi::c_int;

use libc::ssize_t;

use crate::errno::{self, Errno};
use crate::san::SanCall;

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
    /// The SAN path's answer (`san::send_iov`, `san::recv_iov`, `san::select_results`):
    /// `None` means the real call, for the reason `none` (what that SAN function's `None`
    /// says); the value or the errno carries over as it is.
    #[inline]
    pub fn from_san(result: SanCall<T>, none: Why) -> Self {
        match result {
            Some(Ok(value)) => Outcome::Done(value),
            Some(Err(errno)) => Outcome::Failed(errno),
            None => Outcome::Bypass(none),
        }
    }

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
        // The thread's errno plays no part in the conversion, nor is it touched by it.
        errno::set(UNTOUCHED);
        assert_eq!(
            Outcome::<ssize_t>::from_san(None, Why::Downgraded),
            Outcome::Bypass(Why::Downgraded)
        );
        assert_eq!(
            Outcome::<ssize_t>::from_san(Some(Ok(0)), Why::Downgraded),
            Outcome::Done(0)
        );
        assert_eq!(
            Outcome::<ssize_t>::from_san(Some(Ok(1500)), Why::Downgraded),
            Outcome::Done(1500)
        );
        // The SAN path answers the errno as data; the outcome carries it back to the caller,
        // whatever ran in between.
        let failed = Outcome::<ssize_t>::from_san(Some(Err(Errno(libc::EPIPE))), Why::Downgraded);
        assert_eq!(failed, Outcome::Failed(Errno(libc::EPIPE)));
        assert_eq!(errno::get(), UNTOUCHED);
        assert_eq!(failed.returned(), Ok(-1));
        assert_eq!(errno::get(), libc::EPIPE);
        // A status (select through poll) converts the same way.
        errno::set(UNTOUCHED);
        assert_eq!(
            Outcome::<c_int>::from_san(Some(Ok(2)), Why::Downgraded),
            Outcome::Done(2)
        );
        assert_eq!(
            Outcome::<c_int>::from_san(None, Why::NotOnSan),
            Outcome::Bypass(Why::NotOnSan)
        );
        assert_eq!(
            Outcome::<c_int>::from_san(Some(Err(Errno(libc::EINTR))), Why::Downgraded),
            Outcome::Failed(Errno(libc::EINTR))
        );
        assert_eq!(errno::get(), UNTOUCHED);
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
