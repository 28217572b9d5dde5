//! The call machinery of the data hooks: one fd-table lookup, the SAN path for a socket on it,
//! otherwise the real call.

use core::ffi::{c_int, c_void};

use libc::{size_t, ssize_t};

use super::outcome::{Outcome, Why};
use crate::errno::Errno;
use crate::fault;
use crate::fdtable::{table, FdEntry};
use crate::guard::{self, ReentrancyGuard};
use crate::record::Counter;
use crate::san::RawBuf;
use crate::track::count_bytes;

/// A data call: one lookup, the real call, and a counter bump for our sockets. A socket on
/// the SAN path goes through `san` instead, whose [`Outcome`] may still be a bypass (TCP after
/// all): then the real call is made and counted as for any tracked socket.
#[inline(always)]
pub(super) fn data_call(
    fd: c_int,
    counter: Counter,
    san: impl FnOnce(u32) -> Outcome<ssize_t>,
    call: impl FnOnce() -> ssize_t,
) -> ssize_t {
    let entry = table().lookup(fd);
    if entry.is_none() {
        // The passthrough path: not ours, the real call alone.
        return call();
    }
    san_data_call(entry, san).or_real(|_| {
        let result = call();
        if result > 0 {
            count_bytes(entry, counter, result as u64);
        }
        result
    })
}

/// The SAN branch of [`data_call`]: a bypass unless `entry` is a SAN socket; guard held (our
/// own libc calls pass through), a panic counted and reported as a reset connection rather
/// than unwinding into C.
#[inline]
pub(super) fn san_data_call<T>(entry: FdEntry, san: impl FnOnce(u32) -> Outcome<T>) -> Outcome<T> {
    let Some(index) = crate::san::san_index(entry) else {
        return Outcome::Bypass(Why::NotOnSan);
    };
    if guard::is_inside() {
        // Only a signal handler that interrupted one of our own hooks on this thread outside
        // its blocking sleep gets here (our code never does data calls through the hooks, and
        // the sleep releases the guard). The SAN state may be
        // mid-update under a lock this thread holds, and the kernel socket would put the bytes
        // out of order: the call is interrupted instead, which the handler can retry later.
        return Outcome::Failed(Errno(libc::EINTR));
    }
    let _guard = ReentrancyGuard::enter();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| san(index))) {
        Ok(outcome) => outcome,
        Err(_) => {
            guard::note_internal_fault();
            Outcome::Failed(Errno(libc::ECONNRESET))
        }
    }
}

/// `san::send_iov` as an [`Outcome`].
#[inline]
pub(super) fn san_send(
    fd: c_int,
    index: u32,
    bufs: &[RawBuf],
    send_flags: c_int,
) -> Outcome<ssize_t> {
    Outcome::from_san(
        crate::san::send_iov(fd, index, bufs, send_flags),
        Why::Downgraded,
    )
}

/// `san::recv_iov` as an [`Outcome`].
#[inline]
pub(super) fn san_recv(
    fd: c_int,
    index: u32,
    bufs: &[RawBuf],
    recv_flags: c_int,
) -> Outcome<ssize_t> {
    Outcome::from_san(
        crate::san::recv_iov(fd, index, bufs, recv_flags),
        Why::Downgraded,
    )
}

pub(super) fn one_buf(ptr: *const c_void, len: size_t) -> [RawBuf; 1] {
    [RawBuf {
        ptr: ptr.cast_mut().cast(),
        len,
    }]
}

/// The caller's iovec array as buffers, checked in the kernel's order: a count out of range
/// is `EINVAL`, an array the process may not read (null included) `EFAULT`.
///
/// # Safety
/// `iov` is the caller's, as for the C function (it may be a bad address).
pub(super) unsafe fn iov_bufs(iov: *const libc::iovec, count: c_int) -> Result<Vec<RawBuf>, Errno> {
    if !(0..=libc::UIO_MAXIOV).contains(&count) {
        return Err(Errno(libc::EINVAL));
    }
    let count = count as usize;
    let mut bufs: Vec<RawBuf> = Vec::with_capacity(count);
    // SAFETY: `RawBuf` has the layout of `iovec` (checked where it is defined) and `bufs` has
    // room for `count` of them; the source is the caller's array, which the guarded copy may
    // find unreadable.
    unsafe {
        fault::copy(
            bufs.as_mut_ptr().cast(),
            iov.cast(),
            count * core::mem::size_of::<libc::iovec>(),
        )
    }
    .map_err(|_| Errno(libc::EFAULT))?;
    // SAFETY: all `count` entries were just written, and any bits are a valid `RawBuf`.
    unsafe { bufs.set_len(count) };
    Ok(bufs)
}
