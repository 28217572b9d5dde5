//! The pending-ports table: which local ports have a client waiting for an acceptor to attach.
//!
//! An acceptor learns whether its client is preloaded by probing the client's exchange
//! listener (an abstract Unix `connect()`): three system calls for every accepted connection,
//! most of them from plain clients that never listen. The table lets the acceptor skip the
//! probe for those. It is one small file in the segment directory (so only our user can
//! reach it), one counter per TCP port: a client raises its local port's counter before its
//! SYN leaves and lowers it when its pending socket goes; an acceptor whose client's port
//! counts zero knows no preloaded client of ours waits on that port, and treats the client as
//! plain without a probe.
//!
//! Nothing depends on the table being right. A count left high (a client killed while
//! pending; two clients on one port at different addresses) only costs the acceptor the
//! probe it would have made anyway. A count brought to zero too early (a forked child
//! dropping its copy of a pending socket) keeps that one connection on TCP by the exact rule
//! of the switch-over: the client sees no attach, and the first byte on TCP is data. Hence
//! counts saturate rather than wrap, and a table that cannot be made or does not look like
//! ours (size, type, owner, mode) is simply not used: every acceptor probes, as without it.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU8, Ordering};

use crate::dir::ShmDir;
use crate::sys::{self, Mapping};

/// The table's name in the segment directory (segment names hold no leading dot and the
/// temporary files end in `.creating`, so neither can take it). It stays there, as the
/// directory does: it is no connection's, and all of them share it.
pub const PENDING_PORTS_FILE: &str = ".pending-ports";
const TABLE_NAME: &CStr = c".pending-ports";

/// One counter per port.
const TABLE_LEN: usize = 1 << 16;

/// A mapped pending-ports table (see the module docs). Kept for the process's lifetime.
pub struct PendingPorts {
    map: Mapping,
}

impl core::fmt::Debug for PendingPorts {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("PendingPorts").finish_non_exhaustive()
    }
}

impl PendingPorts {
    /// Opens the table in `dir`, creating it (0600, allocated in full, so that a full
    /// `/dev/shm` is an error here rather than a `SIGBUS` later). `None` where it cannot be
    /// made or is not a regular file of our user, private, of the table's size.
    pub fn open(dir: &ShmDir) -> Option<PendingPorts> {
        let dir_fd = dir.fd().ok()?;
        let file = sys::open_at(
            dir_fd,
            TABLE_NAME,
            libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600,
        )
        .ok()?;
        let meta = file.metadata().ok()?;
        let ours = meta.file_type().is_file()
            && meta.uid() == sys::effective_ids().0
            && meta.mode() & 0o077 == 0;
        if !ours {
            return None;
        }
        match usize::try_from(meta.len()).ok()? {
            TABLE_LEN => {}
            // Just created (by us, or by another process a moment ago: both make it the same).
            0 => sys::allocate_file(file.as_fd(), TABLE_LEN).ok()?,
            _ => return None,
        }
        Self::map(&file)
    }

    fn map(file: &File) -> Option<PendingPorts> {
        // The size may have changed since it was checked (another process allocating it):
        // check again right before mapping, so every mapped page is allocated.
        let len = usize::try_from(file.metadata().ok()?.len()).ok()?;
        if len != TABLE_LEN {
            return None;
        }
        let map = Mapping::map_shared(file, TABLE_LEN).ok()?;
        // (The descriptor closes here: the mapping keeps the file.)
        Some(PendingPorts { map })
    }

    fn counter(&self, port: u16) -> &AtomicU8 {
        self.map.get::<AtomicU8>(usize::from(port))
    }

    /// A client on local `port` is about to connect and will wait for an attach: until the
    /// returned mark is dropped, acceptors of that port probe.
    pub fn mark(&'static self, port: u16) -> PendingMark {
        let _ = self
            .counter(port)
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_add(1));
        PendingMark { table: self, port }
    }

    /// Whether a client of ours may be waiting on `port` (false only when none is).
    pub fn may_be_pending(&self, port: u16) -> bool {
        self.counter(port).load(Ordering::SeqCst) != 0
    }
}

/// A client's entry in the pending-ports table, lowered when dropped.
#[derive(Debug)]
pub struct PendingMark {
    table: &'static PendingPorts,
    port: u16,
}

impl Drop for PendingMark {
    fn drop(&mut self) {
        let _ =
            self.table
                .counter(self.port)
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn private_dir() -> (tempdir::Dir, ShmDir) {
        let dir = tempdir::Dir::new();
        let shm = ShmDir::open(&dir.path().join("segments")).expect("segment directory");
        (dir, shm)
    }

    mod tempdir {
        /// A directory under the system's temporary directory, removed on drop.
        pub(super) struct Dir(std::path::PathBuf);
        impl Dir {
            pub(super) fn new() -> Dir {
                let path = std::env::temp_dir().join(format!(
                    "sandirect-pending-{}-{:?}",
                    std::process::id(),
                    std::thread::current().id()
                ));
                let _ = std::fs::remove_dir_all(&path);
                std::fs::create_dir_all(&path).expect("temporary directory");
                Dir(path)
            }
            pub(super) fn path(&self) -> &std::path::Path {
                &self.0
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn a_mark_is_seen_by_another_mapping_of_the_table_until_it_is_dropped() {
        let (_tmp, dir) = private_dir();
        let client: &'static PendingPorts = Box::leak(Box::new(PendingPorts::open(&dir).unwrap()));
        let acceptor = PendingPorts::open(&dir).unwrap();
        assert!(!acceptor.may_be_pending(40_000));
        let first = client.mark(40_000);
        let second = client.mark(40_000);
        assert!(acceptor.may_be_pending(40_000));
        assert!(!acceptor.may_be_pending(40_001), "another port stays clear");
        drop(first);
        assert!(acceptor.may_be_pending(40_000), "one client still waits");
        drop(second);
        assert!(!acceptor.may_be_pending(40_000));
    }

    #[test]
    fn counts_saturate_instead_of_wrapping() {
        let (_tmp, dir) = private_dir();
        let table: &'static PendingPorts = Box::leak(Box::new(PendingPorts::open(&dir).unwrap()));
        let marks: Vec<_> = (0..300).map(|_| table.mark(7)).collect();
        assert!(table.may_be_pending(7));
        drop(marks);
        // 255 counted, 300 dropped: at zero, not wrapped round to 211.
        assert!(!table.may_be_pending(7));
        // A drop below zero (a forked child's copy) stays at zero.
        let extra = PendingMark { table, port: 9 };
        drop(extra);
        assert!(!table.may_be_pending(9));
    }

    #[test]
    fn a_table_of_the_wrong_size_or_mode_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let (tmp, dir) = private_dir();
        assert_eq!(TABLE_NAME.to_str(), Ok(PENDING_PORTS_FILE));
        let path = tmp.path().join("segments").join(PENDING_PORTS_FILE);
        std::fs::write(&path, b"short").unwrap();
        assert!(PendingPorts::open(&dir).is_none(), "wrong size");
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, vec![0u8; TABLE_LEN]).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(PendingPorts::open(&dir).is_none(), "readable by others");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/null", &path).unwrap();
        assert!(PendingPorts::open(&dir).is_none(), "a symbolic link");
    }
}
