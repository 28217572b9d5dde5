//! Errors of segment set-up (rustls-style: one enum per concern, each variant a distinct cause
//! a caller may act on, `#[non_exhaustive]` so causes can be added).

use core::fmt;
use std::io;

pub use crate::layout::CorruptSegment;

/// Why an attach (or a stale-file check) refused a file on access-control grounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PermissionProblem {
    /// The kernel refused to open the file or its directory (`EACCES`/`EPERM`).
    Kernel,
    /// The name is a symbolic link (`O_NOFOLLOW`).
    Symlink,
    /// Not a regular file.
    NotRegularFile,
    /// A segment directory that is not a directory.
    NotADirectory,
    /// Owned by another user (not ours, and not an allowed group's).
    WrongOwner {
        /// The file owner's uid.
        uid: u32,
    },
    /// Group or world permission bits beyond what the policy allows.
    ModeTooOpen {
        /// The file's permission bits.
        mode: u32,
    },
    /// A private segment its peer could shrink, grow or seal further (not a `memfd` sealed
    /// with `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`).
    NotSealed,
}

/// Errors from creating, attaching or unlinking a segment, or setting up a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShmError {
    /// The segment name is empty, too long, or contains `/` or NUL, or is `.`/`..`.
    InvalidName,
    /// A configuration value is outside the provider's limits.
    InvalidConfig(&'static str),
    /// A segment of that name exists and its creator is alive.
    AlreadyExists,
    /// No segment of that name.
    NotFound,
    /// Access control refused the file.
    PermissionDenied(PermissionProblem),
    /// The file is not a valid segment.
    Corrupt(CorruptSegment),
    /// Another process attached first.
    AlreadyAttached,
    /// The creator withdrew the segment before anyone attached (see
    /// [`crate::ShmSegment::withdraw`]).
    Withdrawn,
    /// The segment is already driven by a connection or owned by another domain.
    InUse,
    /// An unexpected system-call failure.
    Io {
        /// What was being done.
        op: &'static str,
        /// The `errno`.
        errno: i32,
    },
}

impl ShmError {
    pub(crate) fn io(op: &'static str, err: &io::Error) -> ShmError {
        match err.raw_os_error() {
            Some(libc::ENOENT) => ShmError::NotFound,
            Some(libc::EEXIST) => ShmError::AlreadyExists,
            Some(libc::EACCES | libc::EPERM) => {
                ShmError::PermissionDenied(PermissionProblem::Kernel)
            }
            Some(libc::ELOOP) => ShmError::PermissionDenied(PermissionProblem::Symlink),
            Some(errno) => ShmError::Io { op, errno },
            None => ShmError::Io { op, errno: 0 },
        }
    }
}

impl fmt::Display for ShmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShmError::InvalidName => f.write_str("invalid segment name"),
            ShmError::InvalidConfig(what) => write!(f, "invalid configuration: {what}"),
            ShmError::AlreadyExists => f.write_str("segment exists and its creator is alive"),
            ShmError::NotFound => f.write_str("no such segment"),
            ShmError::PermissionDenied(problem) => write!(f, "segment access refused: {problem:?}"),
            ShmError::Corrupt(why) => write!(f, "not a valid segment: {why:?}"),
            ShmError::AlreadyAttached => f.write_str("segment already attached by another process"),
            ShmError::Withdrawn => f.write_str("segment withdrawn by its creator"),
            ShmError::InUse => f.write_str("segment already in use"),
            ShmError::Io { op, errno } => {
                write!(f, "{op} failed: {}", io::Error::from_raw_os_error(*errno))
            }
        }
    }
}

impl std::error::Error for ShmError {}

impl From<CorruptSegment> for ShmError {
    fn from(why: CorruptSegment) -> Self {
        ShmError::Corrupt(why)
    }
}
