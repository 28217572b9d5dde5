//! Thin helpers over the C library that every layer of the provider uses.

use std::os::fd::RawFd;

use crate::VerbsSetupError;

/// The current thread's errno.
pub(crate) fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Puts `fd` in non-blocking mode.
pub(crate) fn set_nonblocking(fd: RawFd) -> Result<(), VerbsSetupError> {
    // SAFETY: fcntl on an fd we own; F_GETFL/F_SETFL have no memory arguments.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(VerbsSetupError::Os(errno()));
    }
    Ok(())
}
