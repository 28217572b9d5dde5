//! The segment directory, held open: checked once through its descriptor, used only through it.
//!
//! A path is looked up again by every call that takes it. Between a check of the directory a
//! path names and a later use of that path, whoever may write one of the path's ancestors can
//! rename the checked directory away and put another directory, or a symbolic link, in its
//! place: a segment would then be created, attached, replaced or removed in a directory nobody
//! checked (another user's, where that user can delete our segments, plant files or rename one
//! of our segments over another's name and cross two of our connections). The default location
//! (`/dev/shm`, sticky) does not allow this; an override elsewhere may.
//!
//! So a [`ShmDir`] opens the directory once (`O_DIRECTORY|O_NOFOLLOW`: never through a symbolic
//! link), checks the open directory with `fstat` (a directory of our effective uid with no
//! group or other permission bits), and from then on names files only relative to that
//! descriptor (`openat`, `linkat`, `unlinkat`, `fstatat` with `AT_SYMLINK_NOFOLLOW`): whatever
//! happens to the path later, every operation lands in the directory that was checked, which
//! only we can change. The descriptor is kept for the process's lifetime above the
//! application's numbers ([`crate::relocate_internal_fd`]), close-on-exec; a forked child keeps
//! using the inherited one (the same directory), a new program image opens and checks the
//! path anew.
//!
//! A descriptor can still be closed behind our back (a program closing every descriptor it
//! does not know, then reusing the number): each operation first checks that the descriptor
//! still is the directory that was checked (same device and inode), and fails otherwise, so a
//! number reused for something else is never written through.

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{PermissionProblem, ShmError};
use crate::sys;

/// A private segment directory, open and checked; cheap to clone (one descriptor, shared).
///
/// Opened once, never through a symbolic link, and checked through the open descriptor (a
/// directory of our effective uid, no group or other permission bits); every segment file is
/// then reached relative to it, so a directory swapped at the path later changes nothing for
/// its holders. The descriptor sits above the application's numbers, close-on-exec; a forked
/// child uses the inherited one. Each operation first checks that the descriptor still is the
/// directory that was checked (a program may close a descriptor it does not know and reuse the
/// number) and fails otherwise.
#[derive(Clone)]
pub struct ShmDir {
    inner: Arc<Inner>,
}

struct Inner {
    /// The open directory.
    dir: File,
    /// Its device and inode when it was checked.
    identity: (u64, u64),
    /// The path it was opened by: for messages only, never to reach a file.
    path: PathBuf,
}

impl core::fmt::Debug for ShmDir {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ShmDir")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl ShmDir {
    /// Opens the segment directory at `path`, creating it (mode 0700; not its parents) if
    /// missing: a real directory, not a symbolic link, of our effective uid, with no group or
    /// other permission bits.
    ///
    /// # Errors
    /// [`ShmError::PermissionDenied`] with [`PermissionProblem::Symlink`],
    /// [`PermissionProblem::NotADirectory`], [`PermissionProblem::WrongOwner`] or
    /// [`PermissionProblem::ModeTooOpen`] for a directory that must not be used; otherwise
    /// the system call's failure ([`ShmError::NotFound`] for a missing parent).
    pub fn open(path: &Path) -> Result<ShmDir, ShmError> {
        match fs::DirBuilder::new().mode(0o700).create(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(ShmError::io("create segment directory", &e)),
        }
        let dir = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) => ShmError::PermissionDenied(PermissionProblem::Symlink),
                // O_DIRECTORY|O_NOFOLLOW on a symbolic link reports ENOTDIR on some kernels.
                Some(libc::ENOTDIR) => ShmError::PermissionDenied(
                    if fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
                        PermissionProblem::Symlink
                    } else {
                        PermissionProblem::NotADirectory
                    },
                ),
                _ => ShmError::io("open segment directory", &e),
            })?;
        let meta = dir
            .metadata()
            .map_err(|e| ShmError::io("fstat segment directory", &e))?;
        check_private(&meta)?;
        // Kept for the process's lifetime: above the application's numbers where one is free.
        let dir = File::from(sys::relocate_internal_fd(OwnedFd::from(dir)));
        Ok(ShmDir {
            inner: Arc::new(Inner {
                dir,
                identity: (meta.dev(), meta.ino()),
                path: path.to_path_buf(),
            }),
        })
    }

    /// The path the directory was opened by (for messages: files are reached through the
    /// open directory only).
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Whether an entry `name` exists in the directory (not following a symbolic link).
    /// False also when the descriptor no longer is the directory that was checked.
    pub fn contains(&self, name: &str) -> bool {
        let Ok(name) = entry_name(name) else {
            return false;
        };
        self.fd()
            .is_ok_and(|dir| sys::identity_at(dir, &name).is_ok())
    }

    /// Removes the entry `name` from the directory (a symbolic link itself, never its target).
    ///
    /// # Errors
    /// [`ShmError::InvalidName`], [`ShmError::NotFound`], or the failure of `unlinkat`.
    pub fn remove(&self, name: &str) -> Result<(), ShmError> {
        let name = entry_name(name)?;
        sys::unlink_at(self.fd()?, &name).map_err(|e| ShmError::io("unlink segment", &e))
    }

    /// The open directory, once checked to still be the one opened: a descriptor the program
    /// closed and whose number now names something else is not used.
    pub(crate) fn fd(&self) -> Result<BorrowedFd<'_>, ShmError> {
        let same = self
            .inner
            .dir
            .metadata()
            .is_ok_and(|meta| (meta.dev(), meta.ino()) == self.inner.identity);
        if same {
            Ok(self.inner.dir.as_fd())
        } else {
            Err(ShmError::Io {
                op: "segment directory descriptor",
                errno: libc::EBADF,
            })
        }
    }
}

impl AsFd for ShmDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.dir.as_fd()
    }
}

/// `name` as a C string for the directory-relative calls: one component (see
/// [`validate_name`], which every caller applied or applies here).
pub(crate) fn entry_name(name: &str) -> Result<CString, ShmError> {
    validate_name(name)?;
    CString::new(name.as_bytes()).map_err(|_| ShmError::InvalidName)
}

/// The segment directory policy, applied to the open directory's metadata.
fn check_private(meta: &fs::Metadata) -> Result<(), ShmError> {
    if !meta.file_type().is_dir() {
        return Err(ShmError::PermissionDenied(PermissionProblem::NotADirectory));
    }
    if meta.uid() != sys::effective_ids().0 {
        return Err(ShmError::PermissionDenied(PermissionProblem::WrongOwner {
            uid: meta.uid(),
        }));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(ShmError::PermissionDenied(PermissionProblem::ModeTooOpen {
            mode: meta.mode() & 0o7777,
        }));
    }
    Ok(())
}

/// A name of one directory entry: not empty, at most 200 bytes, not `.` or `..`, no `/` or NUL.
pub(crate) fn validate_name(name: &str) -> Result<(), ShmError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name != "."
        && name != ".."
        && !name.contains(['/', '\0']);
    ok.then_some(()).ok_or(ShmError::InvalidName)
}
