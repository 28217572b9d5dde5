//! Reading the connections other processes publish (the `sandirect stat` side).
//!
//! Each preloaded process publishes its socket records in `DIR/PID` (see [`crate::registry`]).
//! A reader takes a snapshot of the file, checks the header, and skips (or, with `remove_stale`,
//! deletes) files whose process is gone or whose pid now belongs to a different process
//! (start time mismatch).
//!
//! [`read_dir`] opens the directory once, not through a symbolic link (the publishers never
//! publish through one), and lists, reads and removes its files relative to that descriptor:
//! a directory swapped at the path while it reads (renamed away, another one or a link put
//! there) cannot turn its removals onto files elsewhere. It removes only what a publisher
//! leaves behind: a stats file of a process that is gone, or the start of one (zero bytes, no
//! longer than a header) whose process was killed before it wrote its header; any other file
//! is left alone.

use std::ffi::{CStr, CString, OsStr, OsString};
use std::fs::File;
use std::io::{self, Read as _};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::record::{Bypass, Counter, DataPath, SocketRecord, SocketState};
use crate::registry::{
    parse_start_time, FileHeader, CHUNK_BYTES, CHUNK_RECORDS, HEADER_BYTES, MAGIC, VERSION,
};

/// One published socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectionInfo {
    /// Owning process.
    pub pid: u32,
    /// The fd that created it.
    pub fd: i32,
    /// Number of fds referring to it in the owner.
    pub fd_refs: u32,
    /// Lifecycle state.
    pub state: SocketState,
    /// `record::flags` bits.
    pub flags: u32,
    /// Local address.
    pub local: Option<SocketAddr>,
    /// Peer address.
    pub peer: Option<SocketAddr>,
    /// Data path.
    pub path: DataPath,
    /// Why TCP, for TCP connections.
    pub bypass: Bypass,
    /// Byte counters, indexed by [`Counter`].
    pub counters: [u64; 6],
}

impl ConnectionInfo {
    /// A counter's value.
    pub fn counter(&self, counter: Counter) -> u64 {
        self.counters[counter as usize]
    }
}

/// Why a stats file was skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Skipped {
    /// Not a stats file (bad magic, version, record size or truncated).
    NotAStatsFile,
    /// The owner is gone, or its pid was reused.
    Stale,
}

/// Reads one stats file by its path (a process reading its own records; [`read_dir`] reads a
/// whole directory through its descriptor). `Err(Skipped)` explains files that hold no live
/// process.
pub fn read_file(path: &Path) -> io::Result<Result<Vec<ConnectionInfo>, Skipped>> {
    let bytes = std::fs::read(path)?;
    Ok(parse_file(&bytes, process_start_time))
}

/// Parses a stats file snapshot; `start_time_of(pid)` gives a live process's start time.
pub fn parse_file(
    bytes: &[u8],
    start_time_of: impl Fn(u32) -> Option<u64>,
) -> Result<Vec<ConnectionInfo>, Skipped> {
    parse_file_resolving(bytes, |pid, start_time| match start_time_of(pid) {
        Some(live) if start_time == 0 || live == start_time => Some(pid),
        _ => None,
    })
}

/// Parses a stats file snapshot whose publisher may live in another pid namespace:
/// `resolve(pid, start_time)` maps the pid and start time the header records (as the publisher
/// saw them) to the live process's pid as the reader sees it, or `None` when no live process
/// matches. The connections carry the reader's pid.
fn parse_file_resolving(
    bytes: &[u8],
    resolve: impl Fn(u32, u64) -> Option<u32>,
) -> Result<Vec<ConnectionInfo>, Skipped> {
    if bytes.len() < HEADER_BYTES {
        return Err(Skipped::NotAStatsFile);
    }
    let word32 = |offset: usize| {
        u32::from_ne_bytes([
            bytes[offset],
            bytes[offset + 1],
            bytes[offset + 2],
            bytes[offset + 3],
        ])
    };
    let word64 = |offset: usize| {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&bytes[offset..offset + 8]);
        u64::from_ne_bytes(raw)
    };
    // Offsets of FileHeader's repr(C) fields.
    let (magic, version, record_size) = (word64(0), word32(8), word32(12));
    let (pid, chunk_records, start_time) = (word32(16), word32(20), word64(24));
    if magic != MAGIC
        || version != VERSION
        || record_size as usize != core::mem::size_of::<SocketRecord>()
        || chunk_records as usize != CHUNK_RECORDS
    {
        return Err(Skipped::NotAStatsFile);
    }
    let Some(pid) = resolve(pid, start_time) else {
        return Err(Skipped::Stale);
    };
    let mut connections = Vec::new();
    let records = &bytes[HEADER_BYTES..];
    let whole_chunks = records.len() / CHUNK_BYTES;
    for raw in
        records[..whole_chunks * CHUNK_BYTES].chunks_exact(core::mem::size_of::<SocketRecord>())
    {
        let record = record_from_bytes(raw);
        let state = record.state();
        if matches!(state, SocketState::Free | SocketState::Claiming) {
            continue;
        }
        let (local, peer) = record.addresses();
        connections.push(ConnectionInfo {
            pid,
            fd: record.fd.load(core::sync::atomic::Ordering::Relaxed),
            fd_refs: record.fd_refs.load(core::sync::atomic::Ordering::Relaxed),
            state,
            flags: record.flags(),
            local,
            peer,
            path: record.path(),
            bypass: record.bypass(),
            counters: core::array::from_fn(|i| {
                record.counters[i].load(core::sync::atomic::Ordering::Relaxed)
            }),
        });
    }
    Ok(connections)
}

fn record_from_bytes(raw: &[u8]) -> Box<SocketRecord> {
    // SAFETY: all-zero bytes are a valid record (atomics of zero).
    let mut record: Box<SocketRecord> = Box::new(unsafe { core::mem::zeroed() });
    let len = raw.len().min(core::mem::size_of::<SocketRecord>());
    // SAFETY: copying at most size_of::<SocketRecord>() plain bytes into it; every bit pattern
    // of its integer atomics is valid.
    unsafe {
        core::ptr::copy_nonoverlapping(
            raw.as_ptr(),
            (&mut *record as *mut SocketRecord).cast::<u8>(),
            len,
        )
    };
    record
}

const _: () = assert!(core::mem::offset_of!(FileHeader, start_time) == 24);
const _: () = assert!(core::mem::offset_of!(FileHeader, pid) == 16);

/// Start time of live process `pid` (clock ticks since boot), or `None` if it does not exist.
pub fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read(format!("/proc/{pid}/stat")).ok()?;
    parse_start_time(&stat)
}

/// The directory this user's processes publish into (`SANDIRECT_STAT_DIR` or
/// `/dev/shm/sandirect-$UID`); `None` when publication is off.
pub fn default_dir() -> Option<PathBuf> {
    match crate::settings::var_os(crate::settings::STAT_DIR) {
        Some(dir) if dir == "off" || dir.is_empty() => None,
        Some(dir) => Some(PathBuf::from(dir)),
        // SAFETY: getuid has no preconditions.
        None => Some(PathBuf::from(format!("/dev/shm/sandirect-{}", unsafe {
            libc::getuid()
        }))),
    }
}

/// Run as root with the default directory: every user's default stats directory
/// (`/dev/shm/sandirect-<uid>` owned by that uid, as `ss -p` shows every user's sockets), this
/// user's first; otherwise just [`default_dir`]. Each with whether it is the caller's own (whose
/// stale files the caller may remove).
pub fn directories_to_list() -> Vec<(PathBuf, bool)> {
    let Some(own) = default_dir() else {
        return Vec::new();
    };
    let mut dirs = vec![(own.clone(), true)];
    if !lists_every_user() {
        return dirs;
    }
    let Ok(entries) = std::fs::read_dir("/dev/shm") else {
        return dirs;
    };
    let mut others: Vec<(u32, PathBuf)> = entries
        .flatten()
        .filter_map(|entry| {
            let uid: u32 = entry
                .file_name()
                .to_str()?
                .strip_prefix("sandirect-")?
                .parse()
                .ok()?;
            let path = entry.path();
            // Only a real directory its uid owns (a name another user made proves nothing).
            let meta = std::fs::symlink_metadata(&path).ok()?;
            (meta.is_dir() && std::os::unix::fs::MetadataExt::uid(&meta) == uid && path != own)
                .then_some((uid, path))
        })
        .collect();
    others.sort();
    dirs.extend(others.into_iter().map(|(_, path)| (path, false)));
    dirs
}

/// Whether `sandirect stat` lists every user's connections and those of processes in other
/// mount namespaces: run as root, with the default directory.
pub fn lists_every_user() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    root && crate::settings::var_os(crate::settings::STAT_DIR).is_none()
}

/// Every live connection published in `dir`, sorted by pid then fd. Stale files are removed
/// when `remove_stale` (they belong to this user's dead processes; see the module's doc for
/// what counts). A missing directory publishes nothing; a symbolic link is refused.
///
/// A file published by a process of another pid namespace that shares the directory (a
/// container given it as a volume, `unshare --pid`) is named by, and records, the pid that
/// process has in its own namespace: it is matched to the live process by that pid and its
/// start time, shown with the pid the reader knows it by, and never taken for stale.
pub fn read_dir(dir: &Path, remove_stale: bool) -> io::Result<Vec<ConnectionInfo>> {
    let directory = match open_directory(dir) {
        Ok(directory) => directory,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(error) => return Err(error),
    };
    read_open_dir(&directory, remove_stale, &Processes::default(), None).map(|(all, _)| all)
}

/// Removes the stale files of `dir` (as [`read_dir`] with `remove_stale` does) without
/// keeping what the live ones hold; returns how many went.
pub fn remove_stale_files(dir: &Path) -> io::Result<usize> {
    let directory = open_directory(dir)?;
    read_open_dir(&directory, true, &Processes::default(), None).map(|(_, removed)| removed)
}

/// [`read_dir`] of an open directory, whose publishers are looked up in `processes`, first in
/// the pid namespace `pid_namespace` when given (see [`Processes::resolve`]); also how many
/// stale files it removed.
fn read_open_dir(
    directory: &File,
    remove_stale: bool,
    processes: &Processes,
    pid_namespace: Option<u64>,
) -> io::Result<(Vec<ConnectionInfo>, usize)> {
    let resolve = |pid, start_time| processes.resolve(pid, start_time, pid_namespace);
    let mut all = Vec::new();
    let mut removed = 0;
    for name in entry_names(directory)? {
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        // Vanished between listing and reading (its process exited), or not a regular file:
        // nothing to show.
        let Ok(Some(bytes)) = read_entry(directory, &name) else {
            continue;
        };
        let stale = match parse_file_resolving(&bytes, resolve) {
            Ok(connections) => {
                all.extend(connections);
                false
            }
            Err(Skipped::Stale) => true,
            // The start of a stats file whose process was killed before it wrote the header.
            Err(Skipped::NotAStatsFile) => {
                bytes.len() <= HEADER_BYTES
                    && bytes.iter().all(|&b| b == 0)
                    && process_start_time(pid).is_none()
                    && !processes.any_calls_itself(pid)
            }
        };
        if stale && remove_stale && remove_entry(directory, &name) {
            removed += 1;
        }
    }
    all.sort_by_key(|c| (c.pid, c.fd));
    Ok((all, removed))
}

/// A live process as the reader's `/proc` shows it.
#[derive(Clone, Debug)]
struct Process {
    /// Its pid as the reader knows it.
    pid: u32,
    /// Its pid in its own pid namespace (the last of `NSpid`): what it calls itself, names
    /// its stats file by and records in its header.
    own_pid: u32,
    /// Clock ticks since boot.
    start_time: u64,
    /// Its pid and mount namespaces (inode numbers), where the reader may look (its own
    /// processes, or every process as root).
    pid_namespace: Option<u64>,
    mount_namespace: Option<u64>,
}

/// The live processes, listed from `/proc` once, on first need (a directory whose files all
/// name the reader's own processes never needs it).
#[derive(Default)]
struct Processes {
    list: std::sync::OnceLock<Vec<Process>>,
}

impl Processes {
    fn list(&self) -> &[Process] {
        self.list.get_or_init(|| {
            let Ok(entries) = std::fs::read_dir("/proc") else {
                return Vec::new();
            };
            let mut list: Vec<Process> = entries
                .flatten()
                .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|pid| {
                    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
                    let own_pid = status
                        .lines()
                        .find_map(|line| line.strip_prefix("NSpid:"))
                        .and_then(|pids| pids.split_whitespace().last()?.parse().ok())
                        .unwrap_or(pid);
                    Some(Process {
                        pid,
                        own_pid,
                        start_time: process_start_time(pid)?,
                        pid_namespace: namespace_of(pid, "pid"),
                        mount_namespace: namespace_of(pid, "mnt"),
                    })
                })
                .collect();
            list.sort_by_key(|p| p.pid);
            list
        })
    }

    /// The pid the reader knows the live process by that calls itself `pid` and started at
    /// `start_time` (0: unknown to its publisher, which then matches any start): first one of
    /// the pid namespace `preferred`, then the reader's process of that pid, then one of any
    /// other pid namespace. `None` when no live process matches (a stale file).
    fn resolve(&self, pid: u32, start_time: u64, preferred: Option<u64>) -> Option<u32> {
        let starts = |live: u64| start_time == 0 || live == start_time;
        if let Some(namespace) = preferred {
            let found = self.list().iter().find(|p| {
                p.pid_namespace == Some(namespace) && p.own_pid == pid && starts(p.start_time)
            });
            if let Some(process) = found {
                return Some(process.pid);
            }
        }
        if process_start_time(pid).is_some_and(starts) {
            return Some(pid);
        }
        // Only by an exact start time across namespaces: small pids repeat in every one.
        self.list()
            .iter()
            .find(|p| p.own_pid != p.pid && p.own_pid == pid && p.start_time == start_time)
            .map(|p| p.pid)
    }

    /// Whether a live process of another pid namespace calls itself `pid` (its stats file
    /// may be one it has just created).
    fn any_calls_itself(&self, pid: u32) -> bool {
        self.list()
            .iter()
            .any(|p| p.own_pid != p.pid && p.own_pid == pid)
    }
}

/// The inode of process `pid`'s namespace of `kind` (`pid`, `mnt`), where the reader may look.
fn namespace_of(pid: impl std::fmt::Display, kind: &str) -> Option<u64> {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).ok()?;
    // "mnt:[4026531841]"
    link.to_str()?
        .strip_prefix(kind)?
        .strip_prefix(":[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// Run as root with the default directory ([`lists_every_user`]): the live connections of
/// processes in other mount namespaces (containers), which publish into their own `/dev/shm`
/// or into a `SANDIRECT_STAT_DIR` of their file system, out of the reader's sight. Each mount
/// namespace is read through one of its processes' root (`/proc/PID/root`), paths resolved
/// inside that root: every user's default directory in its `/dev/shm`, and the
/// `SANDIRECT_STAT_DIR` each of its processes was started with. Pids are the reader's (the
/// host's, from the host), as `ss -p` shows them. Nothing is removed there: those files are
/// their own processes' to clean up. Sorted by pid then fd.
pub fn other_mount_namespaces() -> Vec<ConnectionInfo> {
    let mut all = Vec::new();
    if !lists_every_user() {
        return all;
    }
    let Some(own) = namespace_of("self", "mnt") else {
        return all;
    };
    let processes = Processes::default();
    let mut namespaces_read = std::collections::HashSet::new();
    let mut directories_read = std::collections::HashSet::new();
    let foreign = processes
        .list()
        .iter()
        .filter(|p| p.mount_namespace.is_some_and(|namespace| namespace != own));
    for process in foreign {
        let Ok(root) = open_root(process.pid) else {
            continue;
        };
        let mut directories = Vec::new();
        if namespaces_read.insert(process.mount_namespace) {
            directories.extend(default_directories_in(&root, process.pid));
        }
        if let Some(dir) = stat_dir_setting(process.pid) {
            directories.extend(open_in_root(&root, &dir).ok());
        }
        for directory in directories {
            let Ok(meta) = directory.metadata() else {
                continue;
            };
            use std::os::unix::fs::MetadataExt as _;
            if !directories_read.insert((meta.dev(), meta.ino())) {
                continue;
            }
            if let Ok((found, _)) =
                read_open_dir(&directory, false, &processes, process.pid_namespace)
            {
                all.extend(found);
            }
        }
    }
    all.sort_by_key(|c| (c.pid, c.fd));
    all
}

/// Process `pid`'s root directory, as a handle to resolve paths under.
fn open_root(pid: u32) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(format!("/proc/{pid}/root"))
}

/// The `SANDIRECT_STAT_DIR` process `pid` was started with, unless it turns publication off.
fn stat_dir_setting(pid: u32) -> Option<PathBuf> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{}=", crate::settings::STAT_DIR);
    let value = environ
        .split(|&b| b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))?;
    (!value.is_empty() && value != b"off").then(|| PathBuf::from(OsStr::from_bytes(value)))
}

/// Every user's default stats directory in the `/dev/shm` under `root` (process `pid`'s):
/// `sandirect-<uid>`, owned by that uid as `pid`'s user namespace maps it (a name another user
/// made proves nothing).
fn default_directories_in(root: &File, pid: u32) -> Vec<File> {
    let Ok(shm) = open_in_root(root, Path::new("/dev/shm")) else {
        return Vec::new();
    };
    let uid_map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap_or_default();
    let Ok(names) = entry_names(&shm) else {
        return Vec::new();
    };
    names
        .iter()
        .filter_map(|name| {
            let uid: u32 = name.to_str()?.strip_prefix("sandirect-")?.parse().ok()?;
            let directory = open_entry(&shm, name, libc::O_DIRECTORY).ok()?;
            let owner = std::os::unix::fs::MetadataExt::uid(&directory.metadata().ok()?);
            (Some(owner) == map_uid(&uid_map, uid)).then_some(directory)
        })
        .collect()
}

/// `uid` of a user namespace whose `uid_map` is `map`, as the reader's namespace knows it (an
/// empty map: the reader's own namespace).
fn map_uid(map: &str, uid: u32) -> Option<u32> {
    if map.trim().is_empty() {
        return Some(uid);
    }
    map.lines().find_map(|line| {
        let mut fields = line.split_whitespace().map(|f| f.parse::<u32>().ok());
        let (inside, outside, count) = (fields.next()??, fields.next()??, fields.next()??);
        let offset = uid.checked_sub(inside).filter(|&o| o < count)?;
        outside.checked_add(offset)
    })
}

/// openat2's number, the same on every architecture with the unified syscall table (x86-64,
/// arm64, …); glibc wraps it only since 2.39.
const SYS_OPENAT2: libc::c_long = 437;

/// `struct open_how` (linux/openat2.h): the libc crate's cannot be built outside it.
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// The directory `path` (absolute, as the process sees it) under `root`, resolved inside that
/// root (`RESOLVE_IN_ROOT`: a container's symbolic links cannot lead the reader out to the
/// host's files), not through a symbolic link at its end (publishers never publish through
/// one).
fn open_in_root(root: &File, path: &Path) -> io::Result<File> {
    let relative = path.strip_prefix("/").unwrap_or(path);
    let name = c_name(relative.as_os_str())?;
    let how = OpenHow {
        flags: (libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: a NUL-terminated path relative to a directory descriptor we hold, and an
    // open_how of the size passed, both alive for the call.
    let fd = unsafe {
        libc::syscall(
            SYS_OPENAT2,
            root.as_raw_fd(),
            name.as_ptr(),
            &how as *const OpenHow,
            core::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(File::from(unsafe {
        OwnedFd::from_raw_fd(fd as libc::c_int)
    }))
}

/// `dir`, opened as a directory and not through a symbolic link.
fn open_directory(dir: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir)
        .map_err(|error| {
            let link = error.raw_os_error() == Some(libc::ELOOP)
                || std::fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink());
            if link {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a symbolic link (processes never publish through one)",
                )
            } else {
                error
            }
        })
}

/// The names in the open directory `directory` (`.` and `..` left out).
fn entry_names(directory: &File) -> io::Result<Vec<OsString>> {
    // fdopendir takes the descriptor it is given: a copy of ours.
    let copy = directory.try_clone()?;
    // SAFETY: `copy` is an open directory descriptor we own; fdopendir takes it over (closedir
    // below closes it), so it is released from `copy` first.
    let stream = unsafe { libc::fdopendir(std::os::fd::IntoRawFd::into_raw_fd(copy)) };
    if stream.is_null() {
        return Err(io::Error::last_os_error());
    }
    let mut names = Vec::new();
    let result = loop {
        crate::errno::set(0);
        // SAFETY: `stream` is the open directory stream from fdopendir, used by this thread
        // only; the entry is read before the next readdir on it.
        let entry = unsafe { libc::readdir(stream) };
        if entry.is_null() {
            let errno = crate::errno::get();
            break if errno == 0 {
                Ok(names)
            } else {
                Err(io::Error::from_raw_os_error(errno))
            };
        }
        // SAFETY: readdir returned an entry whose d_name is NUL-terminated.
        let name = unsafe { CStr::from_ptr((*entry).d_name.as_ptr()) }.to_bytes();
        if name != b"." && name != b".." {
            names.push(OsString::from_vec(name.to_vec()));
        }
    };
    // SAFETY: the stream opened above, closed once (with the descriptor it took).
    unsafe { libc::closedir(stream) };
    result
}

/// Opens `name` in `directory` for reading, never through a symbolic link, with `flags` added.
fn open_entry(directory: &File, name: &OsStr, flags: libc::c_int) -> io::Result<File> {
    let name = c_name(name)?;
    // SAFETY: a NUL-terminated name relative to a directory descriptor we hold.
    let fd = unsafe {
        libc::openat(
            directory.as_raw_fd(),
            name.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC | flags,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor; nothing else owns it.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The whole content of the regular file `name` in `directory`, not through a symbolic
/// link; `None` for anything but a regular file.
fn read_entry(directory: &File, name: &OsStr) -> io::Result<Option<Vec<u8>>> {
    // O_NONBLOCK: a FIFO or device in its place must not block us (it is skipped below).
    let mut file = open_entry(directory, name, libc::O_NONBLOCK)?;
    if !file.metadata()?.file_type().is_file() {
        return Ok(None);
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(Some(bytes))
}

/// Removes the entry `name` from `directory` (a failure leaves it, as a stale file stays
/// until the next reader).
/// Removes `name` from `directory`; true when it went.
fn remove_entry(directory: &File, name: &OsStr) -> bool {
    c_name(name).is_ok_and(|name| {
        // SAFETY: a NUL-terminated name relative to a directory descriptor we hold.
        unsafe { libc::unlinkat(directory.as_raw_fd(), name.as_ptr(), 0) == 0 }
    })
}

fn c_name(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(pid: u32, start: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; HEADER_BYTES + CHUNK_BYTES];
        bytes[0..8].copy_from_slice(&MAGIC.to_ne_bytes());
        bytes[8..12].copy_from_slice(&VERSION.to_ne_bytes());
        bytes[12..16].copy_from_slice(&(core::mem::size_of::<SocketRecord>() as u32).to_ne_bytes());
        bytes[16..20].copy_from_slice(&pid.to_ne_bytes());
        bytes[20..24].copy_from_slice(&(CHUNK_RECORDS as u32).to_ne_bytes());
        bytes[24..32].copy_from_slice(&start.to_ne_bytes());
        bytes
    }

    #[test]
    fn parses_live_records_and_skips_free_ones() {
        let mut bytes = header(42, 1000);
        // SAFETY: zeroed record is valid.
        let record: Box<SocketRecord> = Box::new(unsafe { core::mem::zeroed() });
        record.reset();
        record.set_state(SocketState::ConnectedTcp);
        record.fd.store(9, core::sync::atomic::Ordering::Relaxed);
        record.bypass.store(
            Bypass::NoProvider as u32,
            core::sync::atomic::Ordering::Relaxed,
        );
        record.set_addresses(
            Some("127.0.0.1:1".parse().unwrap()),
            Some("127.0.0.1:2".parse().unwrap()),
        );
        record.count(Counter::TcpSent, 77);
        let size = core::mem::size_of::<SocketRecord>();
        let slot = HEADER_BYTES + 3 * size;
        // SAFETY: reading the record's bytes.
        let raw = unsafe {
            core::slice::from_raw_parts((&*record as *const SocketRecord).cast::<u8>(), size)
        };
        bytes[slot..slot + size].copy_from_slice(raw);
        let live = parse_file(&bytes, |pid| (pid == 42).then_some(1000)).unwrap();
        assert_eq!(live.len(), 1);
        assert_eq!(live[0].fd, 9);
        assert_eq!(live[0].state, SocketState::ConnectedTcp);
        assert_eq!(live[0].bypass, Bypass::NoProvider);
        assert_eq!(live[0].counter(Counter::TcpSent), 77);
        assert_eq!(live[0].peer, Some("127.0.0.1:2".parse().unwrap()));
    }

    #[test]
    fn stale_and_foreign_files_are_skipped() {
        let bytes = header(42, 1000);
        assert_eq!(
            parse_file(&bytes, |_| None),
            Err(Skipped::Stale),
            "dead pid"
        );
        assert_eq!(
            parse_file(&bytes, |_| Some(999)),
            Err(Skipped::Stale),
            "reused pid"
        );
        assert_eq!(
            parse_file(&bytes[..100], |_| Some(1000)),
            Err(Skipped::NotAStatsFile)
        );
        let mut wrong = bytes.clone();
        wrong[0] ^= 1;
        assert_eq!(
            parse_file(&wrong, |_| Some(1000)),
            Err(Skipped::NotAStatsFile)
        );
        assert_eq!(parse_file(&bytes, |_| Some(1000)), Ok(vec![]));
    }

    #[test]
    fn user_namespace_maps_translate_uids() {
        assert_eq!(map_uid("", 1000), Some(1000), "the reader's own namespace");
        let map = "         0     100000      65536\n";
        assert_eq!(map_uid(map, 0), Some(100_000));
        assert_eq!(map_uid(map, 1000), Some(101_000));
        assert_eq!(map_uid(map, 65_536), None, "outside the map");
        let identity = "         0          0 4294967295\n";
        assert_eq!(map_uid(identity, 1000), Some(1000));
    }

    #[test]
    fn the_reader_resolves_its_own_processes() {
        let processes = Processes::default();
        let me = std::process::id();
        let start = process_start_time(me).unwrap();
        assert_eq!(processes.resolve(me, start, None), Some(me));
        assert_eq!(
            processes.resolve(me, 0, None),
            Some(me),
            "start time unknown"
        );
        assert_eq!(processes.resolve(me, start + 1, None), None, "pid reused");
        assert!(processes
            .list()
            .iter()
            .any(|p| p.pid == me && p.own_pid == me));
    }

    #[test]
    fn own_start_time_is_readable() {
        assert!(process_start_time(std::process::id()).is_some());
        assert!(process_start_time(u32::MAX).is_none());
    }
}
