//! Segment files: creation (active side), attachment (passive side), access control and
//! stale-file replacement.
//!
//! **The directory.** Every file is reached relative to a [`ShmDir`], the segment directory
//! opened and checked once (see `dir.rs`): `openat`, `linkat`, `unlinkat` and `fstatat`, never
//! a path, so a directory swapped at the path after the check changes nothing here.
//!
//! **Publication.** The creator builds the whole file under a temporary name and then gives it
//! its real name with `linkat(2)`, which fails with `EEXIST` instead of replacing: that is the
//! `O_CREAT|O_EXCL` semantics for the *initialised* file, so an attacher never sees a
//! half-written header. If the name is taken by a segment whose creator is dead (or by a
//! corrupt file of ours), the old file is unlinked (only if the name still refers to the inode
//! that was examined) and the link retried.
//!
//! **Staleness is a lock, not a pid.** The creator takes a shared `flock` on its file before
//! the file gets its name and holds it until the attach is seen (or the segment is dropped); the
//! kernel releases it when the creator's last descriptor of the file closes, death included.
//! A named segment is stale when an exclusive lock can be had. The pid the creator recorded
//! names a process only in the creator's pid namespace; a creator in another namespace (a
//! container sharing `/dev/shm`) is alive or dead regardless of what that number means here.
//!
//! **Pids.** Each side records its pid together with its pid namespace
//! ([`crate::pid_namespace`]). [`ShmSegment::peer_pid`] gives the peer's pid only when the
//! peer runs in our pid namespace; otherwise the number means nothing here (or another
//! process), and the caller must learn the peer from the kernel (see
//! `ShmConnection::with_peer`).
//!
//! **Access control.** The attacher opens with `O_NOFOLLOW`, then `fstat`s the open file: it
//! must be a regular file owned by the caller's effective uid with no group/world bits, or —
//! with an [`AccessPolicy::group`] — owned by a member of that group with no world bits. Both
//! pids and uids are recorded in the segment ([`ShmSegment::peer_pid`], [`ShmSegment::peer_uid`]).
//!
//! **Trust.** Every size and offset read from the file is validated (see `layout.rs`), and a
//! corrupt or hostile file yields [`ShmError::Corrupt`], never undefined behaviour. One thing
//! no check can prevent: a peer with write access could truncate the file under our mapping and
//! make us fault (SIGBUS). Only the same user (or the configured group) has that access, and the
//! same user could ptrace us anyway; the segment is a boundary against *other* users and
//! against stale or corrupt files, not against one's own processes. A **private** segment
//! ([`ShmSegment::create_private`]), whose peer may be another user's process, is a memfd
//! sealed against shrinking and growing, checked by the attacher before it maps it
//! ([`ShmSegment::attach_private`]): there no truncation is possible.

use core::sync::atomic::Ordering;
use std::ffi::{CStr, CString};
use std::fs::{self, File, Permissions};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use san_api::SlotConfig;

use crate::dir::{entry_name, ShmDir};
use crate::error::{PermissionProblem, ShmError};
use crate::layout::{
    CorruptSegment, Geometry, RawHeader, SegmentHeader, SetupWords, SideControl, ANSWER_ACCEPTED,
    ANSWER_NONE, ANSWER_REJECTED, ASLEEP, EXPOSURE_ENTRIES, HEADER_SIZE, LAYOUT_VERSION, MAGIC,
    MAX_SETUP_DATA, RUNNING, SETUP_AREA, SETUP_REPLY, SETUP_REQUEST, STATE_ATTACHED,
    STATE_ATTACHING, STATE_CREATED, STATE_WITHDRAWN,
};
use crate::sys::{self, Mapping};

/// Which end of the connection a process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The active (connecting) side: creates the segment.
    Creator,
    /// The passive (accepting) side: attaches to it.
    Attacher,
}

impl Side {
    pub(crate) fn index(self) -> usize {
        match self {
            Side::Creator => 0,
            Side::Attacher => 1,
        }
    }

    pub(crate) fn peer(self) -> Side {
        match self {
            Side::Creator => Side::Attacher,
            Side::Attacher => Side::Creator,
        }
    }
}

/// Who besides the owner may attach.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AccessPolicy {
    /// A group whose members may attach (the file gets mode 0660 and this group). `None`:
    /// the same effective uid only (mode 0600).
    pub group: Option<u32>,
}

/// Sizes of a segment, chosen by the creator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentConfig {
    /// Slot pools of both sides.
    pub slots: SlotConfig,
    /// Bytes of the write window each side receives window writes through.
    pub window_size: u32,
    /// Inbound-ring entries beyond one per receive slot (window-write chunks in flight).
    pub ring_extra: u32,
    /// Bytes of each side's outbound journal (a multiple of 4096): the most stream bytes a
    /// side may hold that have not reached the peer's slots (see `ShmConnection::journal`).
    pub journal_size: u32,
    /// Who may attach.
    pub access: AccessPolicy,
}

impl SegmentConfig {
    /// Defaults around the given slot pools: a 256 KiB window, 64 extra ring entries and a
    /// 64 KiB journal.
    pub fn new(slots: SlotConfig) -> SegmentConfig {
        SegmentConfig {
            slots,
            window_size: 256 << 10,
            ring_extra: 64,
            journal_size: 64 << 10,
            access: AccessPolicy::default(),
        }
    }

    /// The segment's layout, or `None` when a size is outside the provider's limits.
    fn geometry(&self) -> Option<Geometry> {
        let ring_entries = u32::from(self.slots.recv_slots).saturating_add(self.ring_extra.max(1));
        Geometry::compute(
            self.slots,
            ring_entries,
            self.window_size,
            self.journal_size,
        )
        .ok()
    }

    /// Bytes of a segment file of this configuration (the journals included, though they
    /// are allocated only when first used where the kernel allows it), or `None` when a size
    /// is outside the provider's limits.
    pub fn file_size(&self) -> Option<usize> {
        self.geometry().map(|geometry| geometry.total_size)
    }
}

/// The attacher's answer to a setup request, as the creator reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SetupAnswer {
    /// Accepted, with the attacher's reply blob.
    Accepted(Vec<u8>),
    /// Declined.
    Rejected,
}

/// One mapped segment file, seen from one side.
pub struct ShmSegment {
    map: Arc<Mapping>,
    geometry: Geometry,
    side: Side,
    /// The directory its name is in (`None`: a private segment, which no directory names),
    /// and the name.
    dir: Option<ShmDir>,
    name: CString,
    /// The directory's path and the name (for messages).
    path: PathBuf,
    dev_ino: (u64, u64),
    /// Creator, until the attach is seen: the open file carrying the shared lock that tells
    /// other creators the name is not stale (see "Staleness is a lock").
    creator_lock: Option<File>,
}

/// A pid as the namespace that issued it numbers it (see [`ShmSegment::peer_own_pid`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NamespacedPid {
    /// The pid namespace ([`crate::pid_namespace`] of the process; 0 when it could not
    /// tell, which matches only another 0).
    pub namespace: u64,
    /// The process's pid in `namespace`.
    pub pid: u32,
    /// The value the process publishes for its peers to find it by ([`set_contact`]).
    pub contact: u64,
}

/// What this process publishes in every segment side it owns from now on for its peers to
/// find it by (the preload names its nudge responder after it: a random value, so that no
/// other user can take the name first). 0 until set.
static CONTACT: AtomicU64 = AtomicU64::new(0);

/// Sets the value [`NamespacedPid::contact`] carries for this process.
pub fn set_contact(contact: u64) {
    CONTACT.store(contact, Ordering::Relaxed);
}

/// This process's [`NamespacedPid::contact`].
pub fn contact() -> u64 {
    CONTACT.load(Ordering::Relaxed)
}

impl core::fmt::Debug for ShmSegment {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ShmSegment")
            .field("path", &self.path)
            .field("side", &self.side)
            .field("slots", &self.geometry.slots)
            .field("attached", &self.is_attached())
            .finish()
    }
}

/// What [`ShmSegment::path`] says of a private segment (no directory names it).
const PRIVATE_PATH: &str = "(private segment)";

/// Receive slots of each side allocated at creation; the others are allocated by their
/// receiver before it first posts them (`ShmConnection::post_recv`), when its sender has
/// used up all it could post: request/response traffic never needs more than these.
pub(crate) const READY_SLOTS: usize = 4;

/// The ranges of a new segment every connection uses: the header, each side's control words,
/// rings, exposure table and first [`READY_SLOTS`] receive slots, and the write windows
/// where CMA is unlikely to be allowed (see [`sys::cma_likely`]). Allocating the rest of the
/// ~1.6 MiB up front made the file system's page allocation most of a connection's set-up
/// time, and kept pages no short or request/response connection ever touches.
/// `windows`: the windows are allocated whatever CMA would do (a private segment never uses
/// CMA).
fn first_use_ranges(geometry: &Geometry, windows: bool) -> Vec<(usize, usize)> {
    let mut ranges = vec![(0, HEADER_SIZE)];
    for side in 0..2 {
        ranges.push(geometry.eager_range(side, READY_SLOTS));
        if windows || !sys::cma_likely() {
            ranges.push(geometry.window_pages(side));
        }
    }
    ranges
}

fn read_header(file: &File, file_len: u64) -> Result<(RawHeader, Geometry), ShmError> {
    if file_len < HEADER_SIZE as u64 {
        return Err(ShmError::Corrupt(CorruptSegment::Truncated));
    }
    let mut bytes = [0u8; HEADER_SIZE];
    file.read_exact_at(&mut bytes, 0)
        .map_err(|e| ShmError::io("read segment header", &e))?;
    let raw = RawHeader::parse(&bytes);
    let geometry = Geometry::from_header(&raw, file_len)?;
    Ok((raw, geometry))
}

fn check_access(meta: &fs::Metadata, policy: &AccessPolicy) -> Result<(), ShmError> {
    if !meta.file_type().is_file() {
        return Err(ShmError::PermissionDenied(
            PermissionProblem::NotRegularFile,
        ));
    }
    let (euid, _) = sys::effective_ids();
    let mode = meta.mode() & 0o7777;
    let group_allowed = policy.group == Some(meta.gid());
    let allowed_bits = if group_allowed { 0o7770 } else { 0o7700 };
    if meta.uid() != euid && !(group_allowed && sys::in_group(meta.gid())) {
        return Err(ShmError::PermissionDenied(PermissionProblem::WrongOwner {
            uid: meta.uid(),
        }));
    }
    if mode & !allowed_bits != 0 {
        return Err(ShmError::PermissionDenied(PermissionProblem::ModeTooOpen {
            mode,
        }));
    }
    Ok(())
}

/// Unlinks `name` from `dir` if it holds a stale segment: one of ours whose creator no longer
/// holds its lock (it died, or dropped the segment), or a corrupt file of ours. Returns whether
/// the name is now free to take. The creator's recorded pid is not consulted (see "Staleness
/// is a lock").
fn remove_if_stale(dir: &ShmDir, name: &CStr) -> Result<bool, ShmError> {
    let file = match sys::open_at(
        dir.fd()?,
        name,
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        0,
    ) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(ShmError::io("open existing segment", &e)),
    };
    let meta = file
        .metadata()
        .map_err(|e| ShmError::io("fstat existing segment", &e))?;
    if !meta.file_type().is_file() || meta.uid() != sys::effective_ids().0 {
        return Ok(false);
    }
    // Our exclusive lock (if we get it) lasts until `file` closes, past the unlink below: a
    // concurrent examiner of the same inode then finds it locked and leaves it alone.
    let stale = read_header(&file, meta.len()).is_err() || sys::unlocked(&file);
    if !stale {
        return Ok(false);
    }
    // Unlink only the inode examined: another creator may have replaced it meanwhile.
    let dir = dir.fd()?;
    match sys::identity_at(dir, name) {
        Ok(now) if now == (meta.dev(), meta.ino()) => match sys::unlink_at(dir, name) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
            Err(e) => Err(ShmError::io("unlink stale segment", &e)),
        },
        Ok(_) => Ok(false),
        Err(_) => Ok(true),
    }
}

impl ShmSegment {
    /// Creates the segment `name` in `dir` for a connection with the given sizes, as the
    /// active side. Fails with [`ShmError::AlreadyExists`] if a live creator holds the name; a
    /// stale segment (dead creator) is replaced.
    pub fn create(
        dir: &ShmDir,
        name: &str,
        config: &SegmentConfig,
    ) -> Result<ShmSegment, ShmError> {
        Self::create_with_setup(dir, name, config, &[])
    }

    /// As [`ShmSegment::create`], leaving `request` (at most [`MAX_SETUP_DATA`] bytes) in the
    /// segment for the attacher: the setup blob of the `SanConnector` path.
    pub(crate) fn create_with_setup(
        dir: &ShmDir,
        name: &str,
        config: &SegmentConfig,
        request: &[u8],
    ) -> Result<ShmSegment, ShmError> {
        let name = entry_name(name)?;
        if request.len() > MAX_SETUP_DATA {
            return Err(ShmError::InvalidConfig(
                "setup blob longer than MAX_SETUP_DATA",
            ));
        }
        let geometry = config.geometry().ok_or(ShmError::InvalidConfig(
            "slot pools, ring or window outside the provider's limits",
        ))?;
        static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);
        let pid = std::process::id();
        // One component too: `name` was validated, the rest adds no `/` or NUL.
        let temp = CString::new(format!(
            ".{}.{pid}.{}.creating",
            name.to_string_lossy(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ))
        .map_err(|_| ShmError::InvalidName)?;
        let mode = if config.access.group.is_some() {
            0o660
        } else {
            0o600
        };
        let fd = dir.fd()?;
        let file = sys::open_at(
            fd,
            &temp,
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            mode,
        )
        .map_err(|e| ShmError::io("create segment file", &e))?;
        // Kept open while the segment is pending (it carries the creator's lock): above the
        // application's numbers, or no segment.
        let file = sys::move_internal_fd(file.into())
            .map(File::from)
            .map_err(|e| {
                let _ = sys::unlink_at(fd, &temp);
                ShmError::io("create segment file", &e)
            })?;
        let built = sys::lock_shared(&file)
            .map_err(|e| ShmError::io("lock segment", &e))
            .and_then(|()| Self::build(&file, geometry, config, mode, request, false));
        let result = built.and_then(|map| Self::publish(&file, dir, &temp, name, map, geometry));
        let _ = sys::unlink_at(fd, &temp);
        result.map(|mut segment| {
            segment.creator_lock = Some(file);
            segment
        })
    }

    fn build(
        file: &File,
        geometry: Geometry,
        config: &SegmentConfig,
        mode: u32,
        request: &[u8],
        windows: bool,
    ) -> Result<Mapping, ShmError> {
        // The umask may have stripped group bits the policy asked for.
        file.set_permissions(Permissions::from_mode(mode))
            .map_err(|e| ShmError::io("chmod segment", &e))?;
        if let Some(gid) = config.access.group {
            std::os::unix::fs::fchown(file, None, Some(gid))
                .map_err(|e| ShmError::io("chown segment", &e))?;
        }
        // Every page is allocated before the first write through the mapping: a full
        // directory must fail the set-up (the connection stays on TCP), not raise SIGBUS.
        // Where the kernel can allocate pages through the mapping, only what every
        // connection uses is allocated here (see `first_use_ranges`).
        let allocated = if sys::can_populate() {
            first_use_ranges(&geometry, windows)
        } else {
            vec![(0, geometry.total_size)]
        };
        sys::allocate_file_ranges(file.as_fd(), &allocated, geometry.total_size)
            .map_err(|e| ShmError::io("allocate segment", &e))?;
        let map = Mapping::map_shared(file, geometry.total_size)
            .map_err(|e| ShmError::io("map segment", &e))?;
        let header: &SegmentHeader = map.get(0);
        header
            .layout_version
            .store(LAYOUT_VERSION, Ordering::Relaxed);
        header
            .header_size
            .store(HEADER_SIZE as u32, Ordering::Relaxed);
        header
            .total_size
            .store(geometry.total_size as u64, Ordering::Relaxed);
        header
            .slot_size
            .store(geometry.slots.slot_size, Ordering::Relaxed);
        header
            .recv_slots
            .store(u32::from(geometry.slots.recv_slots), Ordering::Relaxed);
        header
            .send_slots
            .store(u32::from(geometry.slots.send_slots), Ordering::Relaxed);
        header
            .ring_entries
            .store(geometry.ring_entries, Ordering::Relaxed);
        header
            .window_size
            .store(geometry.window_size, Ordering::Relaxed);
        header
            .exposure_entries
            .store(EXPOSURE_ENTRIES, Ordering::Relaxed);
        header
            .journal_size
            .store(geometry.journal_size, Ordering::Relaxed);
        for side in 0..2 {
            header.side_offset[side].store(geometry.side_base(side) as u64, Ordering::Relaxed);
        }
        header
            .side_size
            .store(geometry.side_size as u64, Ordering::Relaxed);
        header.state.store(STATE_CREATED, Ordering::Relaxed);
        let (uid, gid) = sys::effective_ids();
        let me = &map.get::<SideControl>(geometry.control(0)).identity.0;
        me.pid.store(std::process::id(), Ordering::Relaxed);
        me.pid_ns.store(sys::pid_namespace(), Ordering::Relaxed);
        me.contact
            .store(CONTACT.load(Ordering::Relaxed), Ordering::Relaxed);
        me.uid.store(uid, Ordering::Relaxed);
        me.gid.store(gid, Ordering::Relaxed);
        me.base_addr.store(map.base_addr(), Ordering::Relaxed);
        me.running.store(RUNNING, Ordering::Relaxed);
        // Until someone attaches, the peer counts as asleep: nothing to spin for.
        map.get::<SideControl>(geometry.control(1))
            .identity
            .0
            .running
            .store(ASLEEP, Ordering::Relaxed);
        // The setup blob is part of the initialised file, published like the header. Its
        // length was checked by the caller, so it fits a u32.
        map.copy_in(SETUP_REQUEST, request);
        map.get::<SetupWords>(SETUP_AREA)
            .request_len
            .store(request.len() as u32, Ordering::Relaxed);
        // Publication to the attacher is the link() below (it reads with pread after open);
        // the Release store orders the magic last for anyone already mapping the temp file.
        header.magic.store(MAGIC, Ordering::Release);
        Ok(map)
    }

    fn publish(
        file: &File,
        dir: &ShmDir,
        temp: &CStr,
        name: CString,
        map: Mapping,
        geometry: Geometry,
    ) -> Result<ShmSegment, ShmError> {
        const ATTEMPTS: usize = 3;
        for _ in 0..ATTEMPTS {
            match sys::link_at(dir.fd()?, temp, &name) {
                Ok(()) => {
                    let meta = file
                        .metadata()
                        .map_err(|e| ShmError::io("fstat segment", &e))?;
                    return Ok(ShmSegment {
                        map: Arc::new(map),
                        geometry,
                        side: Side::Creator,
                        path: dir.path().join(name.to_string_lossy().as_ref()),
                        dir: Some(dir.clone()),
                        name,
                        dev_ino: (meta.dev(), meta.ino()),
                        creator_lock: None,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if !remove_if_stale(dir, &name)? {
                        return Err(ShmError::AlreadyExists);
                    }
                }
                Err(e) => return Err(ShmError::io("link segment", &e)),
            }
        }
        Err(ShmError::AlreadyExists)
    }

    /// Attaches to the segment `name` in `dir` as the passive side, same user only.
    pub fn attach(dir: &ShmDir, name: &str) -> Result<ShmSegment, ShmError> {
        Self::attach_with(dir, name, &AccessPolicy::default())
    }

    /// Attaches to the segment `name` in `dir` as the passive side under `policy`.
    pub fn attach_with(
        dir: &ShmDir,
        name: &str,
        policy: &AccessPolicy,
    ) -> Result<ShmSegment, ShmError> {
        let name = entry_name(name)?;
        let file = sys::open_at(
            dir.fd()?,
            &name,
            libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0,
        )
        .map_err(|e| ShmError::io("open segment", &e))?;
        let meta = file
            .metadata()
            .map_err(|e| ShmError::io("fstat segment", &e))?;
        check_access(&meta, policy)?;
        let path = dir.path().join(name.to_string_lossy().as_ref());
        Self::attach_file(&file, &meta, Some(dir.clone()), name, path, false)
    }

    /// The attach of an opened, checked segment file `file` (its `fstat`: `meta`): header read
    /// and validated from the file (copied, then checked), windows allocated where they will
    /// be written (`windows`: always, as a private segment's are), then mapped and marked
    /// attached.
    fn attach_file(
        file: &File,
        meta: &fs::Metadata,
        dir: Option<ShmDir>,
        name: CString,
        path: PathBuf,
        windows: bool,
    ) -> Result<ShmSegment, ShmError> {
        let (raw, geometry) = read_header(file, meta.len())?;
        match raw.state {
            STATE_CREATED => {}
            STATE_ATTACHING | STATE_ATTACHED => return Err(ShmError::AlreadyAttached),
            STATE_WITHDRAWN => return Err(ShmError::Withdrawn),
            _ => return Err(ShmError::Corrupt(CorruptSegment::BadState)),
        }
        // Writing through a window the creator left unallocated (it expected CMA) cannot
        // raise SIGBUS later: where we expect no CMA, we allocate both windows now.
        if sys::can_populate() && (windows || !sys::cma_likely()) {
            let windows = [geometry.window_pages(0), geometry.window_pages(1)];
            sys::allocate_file_ranges(file.as_fd(), &windows, geometry.total_size)
                .map_err(|e| ShmError::io("allocate segment windows", &e))?;
        }
        let map = Mapping::map_shared(file, geometry.total_size)
            .map_err(|e| ShmError::io("map segment", &e))?;
        let header: &SegmentHeader = map.get(0);
        let creator = &map.get::<SideControl>(geometry.control(0)).identity.0;
        if creator.pid.load(Ordering::Relaxed) == 0 {
            return Err(ShmError::Corrupt(CorruptSegment::BadState));
        }
        if let Err(state) = header.state.compare_exchange(
            STATE_CREATED,
            STATE_ATTACHING,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            return Err(match state {
                STATE_ATTACHING | STATE_ATTACHED => ShmError::AlreadyAttached,
                STATE_WITHDRAWN => ShmError::Withdrawn,
                _ => ShmError::Corrupt(CorruptSegment::BadState),
            });
        }
        let (uid, gid) = sys::effective_ids();
        let control = map.get::<SideControl>(geometry.control(1));
        let me = &control.identity.0;
        me.pid.store(std::process::id(), Ordering::Relaxed);
        me.pid_ns.store(sys::pid_namespace(), Ordering::Relaxed);
        me.contact
            .store(CONTACT.load(Ordering::Relaxed), Ordering::Relaxed);
        me.uid.store(uid, Ordering::Relaxed);
        me.gid.store(gid, Ordering::Relaxed);
        me.base_addr.store(map.base_addr(), Ordering::Relaxed);
        me.running.store(RUNNING, Ordering::SeqCst);
        header.state.store(STATE_ATTACHED, Ordering::Release);
        // Tell a creator blocked in `wait` (same protocol as every publication).
        map.get::<SideControl>(geometry.control(0)).notify(|bell| {
            sys::futex_wake(bell);
        });
        Ok(ShmSegment {
            map: Arc::new(map),
            geometry,
            side: Side::Attacher,
            path,
            dir,
            name,
            dev_ino: (meta.dev(), meta.ino()),
            creator_lock: None,
        })
    }

    /// Creates a **private** segment of `config`, as the active side: an anonymous memory file
    /// (`memfd`) that no directory names, to be handed to the one peer of the connection
    /// (`SCM_RIGHTS`) and to nobody else; returned with its descriptor (above the
    /// application's numbers, close-on-exec), which the caller passes on and then closes.
    /// Sealed against shrinking and growing once sized (`F_SEAL_SHRINK`, `F_SEAL_GROW`,
    /// `F_SEAL_SEAL`), so the peer cannot truncate it under our mapping (`SIGBUS`); its write
    /// windows are allocated at once, since a private segment is never written through CMA
    /// (see [`ShmSegment::is_private`]).
    ///
    /// `token` is left in the segment for the attacher ([`ShmSegment::private_token`]): the
    /// preload's acceptor proves with it, on the TCP connection only the process that
    /// accepted it can write to, that it is the process that attached.
    pub fn create_private(
        config: &SegmentConfig,
        token: u64,
    ) -> Result<(ShmSegment, OwnedFd), ShmError> {
        let geometry = config.geometry().ok_or(ShmError::InvalidConfig(
            "slot pools, ring or window outside the provider's limits",
        ))?;
        let fd = sys::memfd_sealable(c"sandirect-segment")
            .map_err(|e| ShmError::io("create private segment", &e))?;
        let fd =
            sys::move_internal_fd(fd).map_err(|e| ShmError::io("create private segment", &e))?;
        let file = File::from(fd);
        let map = Self::build(&file, geometry, config, 0o600, &token.to_le_bytes(), true)?;
        sys::seal_size(file.as_fd()).map_err(|e| ShmError::io("seal private segment", &e))?;
        let meta = file
            .metadata()
            .map_err(|e| ShmError::io("fstat segment", &e))?;
        let segment = ShmSegment {
            map: Arc::new(map),
            geometry,
            side: Side::Creator,
            path: PathBuf::from(PRIVATE_PATH),
            dir: None,
            name: CString::from(c"private"),
            dev_ino: (meta.dev(), meta.ino()),
            creator_lock: None,
        };
        Ok((segment, file.into()))
    }

    /// Attaches, as the passive side, to a private segment whose descriptor `fd` the peer
    /// passed (see [`ShmSegment::create_private`]). Everything about it is the peer's word,
    /// so it is checked before anything is mapped: a regular file sealed against shrinking,
    /// growing and further seals (only a `memfd` can be), of the exact size its header
    /// (read with `pread`, then validated) describes, not yet attached. Anything else is
    /// refused ([`ShmError::PermissionDenied`] or [`ShmError::Corrupt`]); the caller closes
    /// `fd` afterwards (the mapping keeps the memory).
    pub fn attach_private(fd: std::os::fd::BorrowedFd<'_>) -> Result<ShmSegment, ShmError> {
        let file = File::from(
            fd.try_clone_to_owned()
                .map_err(|e| ShmError::io("attach private segment", &e))?,
        );
        // The seals first, the size after: once sealed the size can no longer change, so the
        // size read next is the one the file keeps while we map it.
        let sealed = sys::size_sealed(file.as_fd());
        let meta = file
            .metadata()
            .map_err(|e| ShmError::io("fstat segment", &e))?;
        if !meta.file_type().is_file() {
            return Err(ShmError::PermissionDenied(
                PermissionProblem::NotRegularFile,
            ));
        }
        if !sealed {
            return Err(ShmError::PermissionDenied(PermissionProblem::NotSealed));
        }
        let path = PathBuf::from(PRIVATE_PATH);
        Self::attach_file(&file, &meta, None, CString::from(c"private"), path, true)
    }

    /// The creator's token of a private segment (see [`ShmSegment::create_private`]), copied
    /// out of the segment; `None` when its setup area does not hold exactly one.
    pub fn private_token(&self) -> Option<u64> {
        let bytes: [u8; 8] = self.setup_request().ok()?.try_into().ok()?;
        Some(u64::from_le_bytes(bytes))
    }

    /// Whether this is a private segment (see [`ShmSegment::create_private`]): made for one
    /// connection, shared with its peer alone, possibly a process of another user. Its
    /// connection never uses CMA (writes go through the window), whatever the kernel allows.
    pub fn is_private(&self) -> bool {
        self.dir.is_none()
    }

    /// Creator: withdraws the segment if nobody has attached (or begun to): afterwards no
    /// process can attach. False when the attacher got there first (it is attaching or
    /// attached, and the connection goes on). Always false on the attacher.
    pub fn withdraw(&self) -> bool {
        self.side == Side::Creator
            && self
                .header()
                .state
                .compare_exchange(
                    STATE_CREATED,
                    STATE_WITHDRAWN,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// True once the passive side has attached (always true on the attacher).
    pub fn is_attached(&self) -> bool {
        self.header().state.load(Ordering::Acquire) == STATE_ATTACHED
    }

    /// Removes the segment's name if it still refers to this segment (mappings stay valid).
    /// Either side may call it once attached; the creator also does on drop.
    pub fn unlink(&self) -> Result<(), ShmError> {
        let Some(dir) = self.dir.as_ref() else {
            // A private segment has no name.
            return Ok(());
        };
        let dir = dir.fd()?;
        match sys::identity_at(dir, &self.name) {
            Ok(now) if now == self.dev_ino => match sys::unlink_at(dir, &self.name) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(ShmError::io("unlink segment", &e)),
            },
            _ => Ok(()),
        }
    }

    /// The peer's pid (the creator's on the attacher; the attacher's once attached) when the
    /// peer runs in our pid namespace, so that the number names it here. `None` for a peer
    /// in another pid namespace (or one that could not tell its namespace): its number is
    /// not a pid of ours.
    pub fn peer_pid(&self) -> Option<u32> {
        self.peer_own_pid()
            .filter(|peer| peer.namespace != 0 && peer.namespace == sys::pid_namespace())
            .map(|peer| peer.pid)
    }

    /// The peer's pid as its own pid namespace numbers it, with that namespace (`None` before
    /// the attach). Not a pid to signal or open here unless the namespace is ours (and
    /// known); it names the peer across namespaces, e.g. in an address the peer derived from
    /// its own pid.
    pub fn peer_own_pid(&self) -> Option<NamespacedPid> {
        if !self.is_attached() {
            return None;
        }
        let peer = &self.control(self.side.peer()).identity.0;
        Some(NamespacedPid {
            namespace: peer.pid_ns.load(Ordering::Relaxed),
            pid: peer.pid.load(Ordering::Relaxed),
            contact: peer.contact.load(Ordering::Relaxed),
        })
    }

    /// Creator: the attach was seen, the name need no longer look live (the attacher unlinks
    /// it; if it could not, replacing it harms nobody): the lock's descriptor is closed.
    pub(crate) fn release_creator_lock(&mut self) {
        self.creator_lock = None;
    }

    /// The peer's effective uid, as recorded by the peer.
    pub fn peer_uid(&self) -> Option<u32> {
        self.is_attached().then(|| {
            self.control(self.side.peer())
                .identity
                .0
                .uid
                .load(Ordering::Relaxed)
        })
    }

    /// Which side this process is.
    pub fn side(&self) -> Side {
        self.side
    }

    /// The slot pools of the segment.
    pub fn slot_config(&self) -> SlotConfig {
        self.geometry.slots
    }

    /// The segment's path: its directory's path as opened and its name. For messages (and
    /// tests): the segment's own operations never go through it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The creator's setup blob (empty for a segment made by plain [`ShmSegment::create`]).
    /// Immutable once published, so any side may read it at any time.
    pub(crate) fn setup_request(&self) -> Result<Vec<u8>, ShmError> {
        let len = self.setup_words().request_len.load(Ordering::Relaxed) as usize;
        if len > MAX_SETUP_DATA {
            return Err(ShmError::Corrupt(CorruptSegment::SizeOutOfRange));
        }
        Ok(self.map.bytes(SETUP_REQUEST, len).to_vec())
    }

    /// The attacher's answer to the setup request: accept with `reply` (at most
    /// [`MAX_SETUP_DATA`] bytes) or decline. Once only; wakes a creator blocked in `wait`.
    pub(crate) fn answer_setup(&self, accepted: bool, reply: &[u8]) -> Result<(), ShmError> {
        if self.side != Side::Attacher {
            return Err(ShmError::InUse);
        }
        if reply.len() > MAX_SETUP_DATA {
            return Err(ShmError::InvalidConfig(
                "setup blob longer than MAX_SETUP_DATA",
            ));
        }
        let words = self.setup_words();
        if words.answer.load(Ordering::Relaxed) != ANSWER_NONE {
            return Err(ShmError::InUse);
        }
        self.map.copy_in(SETUP_REPLY, reply);
        words.reply_len.store(reply.len() as u32, Ordering::Relaxed);
        let answer = if accepted {
            ANSWER_ACCEPTED
        } else {
            ANSWER_REJECTED
        };
        words.answer.store(answer, Ordering::Release);
        self.control(Side::Creator).notify(|bell| {
            sys::futex_wake(bell);
        });
        Ok(())
    }

    /// On the creator: the attacher's answer, once given.
    pub(crate) fn setup_answer(&self) -> Result<Option<SetupAnswer>, ShmError> {
        let words = self.setup_words();
        match words.answer.load(Ordering::Acquire) {
            ANSWER_NONE => Ok(None),
            ANSWER_REJECTED => Ok(Some(SetupAnswer::Rejected)),
            ANSWER_ACCEPTED => {
                let len = words.reply_len.load(Ordering::Relaxed) as usize;
                if len > MAX_SETUP_DATA {
                    return Err(ShmError::Corrupt(CorruptSegment::SizeOutOfRange));
                }
                Ok(Some(SetupAnswer::Accepted(
                    self.map.bytes(SETUP_REPLY, len).to_vec(),
                )))
            }
            _ => Err(ShmError::Corrupt(CorruptSegment::BadState)),
        }
    }

    fn setup_words(&self) -> &SetupWords {
        self.map.get(SETUP_AREA)
    }

    pub(crate) fn map(&self) -> &Arc<Mapping> {
        &self.map
    }

    pub(crate) fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    pub(crate) fn header(&self) -> &SegmentHeader {
        self.map.get(0)
    }

    pub(crate) fn control(&self, side: Side) -> &SideControl {
        self.map.get(self.geometry.control(side.index()))
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        if self.side == Side::Creator {
            let _ = self.unlink();
        }
    }
}
