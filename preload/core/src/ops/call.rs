//! The call machinery of the data hooks: one fd-table lookup, the SAN path for a socket on it,
//! otherwise the real call.

use core::ffi::{c_int, c_void};

use libc::{size_t, ssize_t};

use crate::errno;
use crate::fdtable::{table, FdEntry};
use crate::guard::{self, ReentrancyGuard};
use crate::record::Counter;
use crate::san::RawBuf;
use crate::track::count_bytes;

/// A data call: one lookup, the real call, and a counter bump for our sockets. A socket on
/// the SAN path goes through `san` instead (which may answer `None`: it is TCP after all).
#[inline(always)]
pub(super) fn data_call(
    fd: c_int,
    counter: Counter,
    san: impl FnOnce(u32) -> Option<ssize_t>,
    call: impl FnOnce() -> ssize_t,
) -> ssize_t {
    let entry = table().lookup(fd);
    if !entry.is_none() {
        if let Some(result) = san_data_call(entry, san) {
            return result;
        }
    }
    let result = call();
    if !entry.is_none() && result > 0 {
        count_bytes(entry, counter, result as u64);
    }
    result
}

/// The SAN branch of [`data_call`]: guard held (our own libc calls pass through), a panic
/// counted and reported as a reset connection rather than unwinding into C.
#[inline]
pub(super) fn san_data_call(
    entry: FdEntry,
    san: impl FnOnce(u32) -> Option<ssize_t>,
) -> Option<ssize_t> {
    let index = crate::san::san_index(entry)?;
    if guard::is_inside() {
        // Only a signal handler that interrupted one of our own hooks on this thread gets
        // here (our code never does data calls through the hooks). The SAN state may be
        // mid-update under a lock this thread holds, and the kernel socket would put the bytes
        // out of order: the call is interrupted instead, which the handler can retry later.
        errno::set(libc::EINTR);
        return Some(-1);
    }
    let _guard = ReentrancyGuard::enter();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| san(index))) {
        Ok(result) => result,
        Err(_) => {
            guard::note_internal_fault();
            errno::set(libc::ECONNRESET);
            Some(-1)
        }
    }
}

pub(super) fn one_buf(ptr: *const c_void, len: size_t) -> [RawBuf; 1] {
    [RawBuf {
        ptr: ptr.cast_mut().cast(),
        len,
    }]
}

/// The caller's iovec array as buffers (an invalid count gives `EINVAL` from the SAN path
/// exactly where the kernel would).
///
/// # Safety
/// `iov` must point to `count` iovecs when `count` is positive.
pub(super) unsafe fn iov_bufs(iov: *const libc::iovec, count: c_int) -> Option<Vec<RawBuf>> {
    if !(0..=libc::UIO_MAXIOV).contains(&count) || (count > 0 && iov.is_null()) {
        return None;
    }
    if count == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the caller's vector of `count` entries.
    let vector = unsafe { core::slice::from_raw_parts(iov, count as usize) };
    Some(
        vector
            .iter()
            .map(|v| RawBuf {
                ptr: v.iov_base.cast(),
                len: v.iov_len,
            })
            .collect(),
    )
}
