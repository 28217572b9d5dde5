//! Moving SAN connections back to kernel TCP, live (see `docs/ARCHITECTURE.md`, "fork and
//! exec"): a session lives in one process's memory and cannot be shared, so before `fork()`
//! and `exec()` every SAN socket of the process is downgraded — the session's `Downgrade`
//! marks where each direction of the stream continues on TCP — and what the session had
//! received but the application not yet read goes into a [`Stash`] shared by every process
//! that holds the socket afterwards. The peer downgrades when it reads our `Downgrade`
//! (passively, in its own calls); nothing is lost, duplicated or reordered.

use core::ffi::c_int;
use core::sync::atomic::Ordering;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use super::kernel::{file_inode, recv_tcp_rest, scatter, socket_inode, RawBuf};
use super::outcome::{SanCall, SanError};
use super::socket::Phase;
use super::stash::Stash;
use super::stashed::Stashed;
use super::switchover::{
    assist_all_in_process, epoll_back_to_tcp, switch_if_attached, withdraw_pending,
};
use super::table::{forget_name, lock, san_index, SanObject, COUNTERS, LIVE};
use super::tunables::{FORK_BUDGET, MARKER_WAIT};
use crate::errno::Errno;
use crate::real;
use crate::record::{flags, Bypass, DataPath, SocketState};
use crate::registry::registry;
use san_api::BadAddress;

/// A descriptor of the stash memfd `memfd` (inode `inode`) for the image about to be
/// exec'd: the number itself while it still names that memfd, else a fresh one opened
/// through the parent's `/proc/PID/fd` entry (a `vfork` or fork child that closed its copy:
/// the parent, suspended or alive, still holds it). `None`: not reachable.
fn usable_memfd(memfd: RawFd, inode: u64) -> Option<RawFd> {
    if file_inode(memfd).is_some_and(|(_, found)| found == inode) {
        return Some(memfd);
    }
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let path = std::ffi::CString::new(format!("/proc/{parent}/fd/{memfd}")).ok()?;
    // SAFETY: open(2) of a NUL-terminated path; the descriptor is checked, then handed on.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    if file_inode(fd).is_some_and(|(_, found)| found == inode) {
        return Some(fd);
    }
    // SAFETY: closing the descriptor we just opened.
    unsafe { libc::close(fd) };
    None
}

/// The socket record says "plain TCP from now on, downgraded".
fn mark_tcp(index: u32) {
    if let Some(record) = registry().get(index) {
        record.set_flag(flags::SAN | flags::STASHED, false);
        record
            .bypass
            .store(Bypass::Downgraded as u32, Ordering::Release);
        record.path.store(DataPath::Tcp as u32, Ordering::Release);
        record.set_state_if_live(SocketState::ConnectedTcp);
    }
}

/// A downgrading socket: once the peer's SAN stream is read, epoll watches TCP again; once
/// the downgrade is complete both ways, the socket becomes plain TCP. True when it did.
pub(super) fn settle(fd: c_int, index: u32, slot: &mut Option<SanObject>) -> bool {
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return false;
    };
    if !socket.downgrading() {
        return false;
    }
    socket.service();
    if socket.reads_on_tcp() {
        socket.consume_marker_blocking(fd, MARKER_WAIT);
        epoll_back_to_tcp(index, fd, socket);
    }
    if !socket.downgrade_complete() {
        return false;
    }
    let Some(SanObject::Socket(socket)) = slot.take() else {
        return false;
    };
    tracing::debug!(fd, name = %socket.name, "SAN connection downgraded to TCP");
    socket.close(Some(fd), false, Duration::ZERO);
    LIVE.fetch_sub(1, Ordering::Relaxed);
    forget_name(index);
    mark_tcp(index);
    COUNTERS.downgraded.fetch_add(1, Ordering::Relaxed);
    true
}

/// Turns a socket whose downgrade completed into a stash holder (or plain TCP when nothing
/// is left to read); `received` are the bytes the session had delivered, in order.
fn into_stash(fd: c_int, index: u32, slot: &mut Option<SanObject>, received: &[u8]) {
    let Some(SanObject::Socket(mut socket)) = slot.take() else {
        return;
    };
    tracing::debug!(
        fd,
        bytes = received.len(),
        "downgrade complete: unread bytes stashed"
    );
    epoll_back_to_tcp(index, fd, &mut socket);
    socket.close(Some(fd), false, Duration::ZERO);
    forget_name(index);
    COUNTERS.downgraded.fetch_add(1, Ordering::Relaxed);
    let stash = (!received.is_empty())
        .then(|| Stash::create(received))
        .flatten();
    match stash {
        Some(stash) => {
            let mut stashed = Stashed::new(stash, socket_inode(fd));
            if let Some(record) = registry().get(index) {
                for (epfd, events, data) in record.epoll_registrations() {
                    stashed.add_to_set(epfd, events, data);
                }
            }
            *slot = Some(SanObject::Stashed(Box::new(stashed)));
            mark_tcp(index);
            if let Some(record) = registry().get(index) {
                record.set_flag(flags::SAN | flags::STASHED, true);
            }
        }
        None => {
            if !received.is_empty() {
                // Could not create the stash: these bytes cannot be delivered exactly.
                tracing::warn!(fd, bytes = received.len(), "downgrade: stash refused");
                COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
                // SAFETY: plain shutdown(2): the stream is broken, say so.
                unsafe { real::shutdown(fd, libc::SHUT_RDWR) };
            }
            LIVE.fetch_sub(1, Ordering::Relaxed);
            mark_tcp(index);
        }
    }
}

/// One connection being downgraded by `fork`/`exec`.
struct Draining {
    index: u32,
    fd: c_int,
    /// What the session (and, first, an acceptor's pending TCP bytes) delivered so far.
    received: Vec<u8>,
    /// Finished: stashed, plain TCP, or not downgradable.
    done: bool,
}

/// Downgrades every SAN connection of this process before `fork()` or `exec()`, waiting up to
/// [`FORK_BUDGET`] for the peers' answers. Connections whose peer did not answer stay SAN in
/// this process (the caller decides what the other process gets). `only` limits the work to
/// these fds (exec: sockets that survive it).
pub fn downgrade_connections(only: Option<&dyn Fn(c_int) -> bool>) {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("downgrade_all");
    if LIVE.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut draining = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::SAN != 0
            && record.flags() & flags::STASHED == 0
            && record.bypass() != Bypass::AfterFork
        {
            let fd = record.fd.load(Ordering::Acquire);
            if only.is_none_or(|keep| keep(fd)) {
                draining.push(Draining {
                    index,
                    fd,
                    received: Vec::new(),
                    done: false,
                });
            }
        }
    });
    tracing::debug!(
        connections = draining.len(),
        "downgrading SAN connections (fork/exec)"
    );
    if draining.is_empty() {
        return;
    }
    for item in &mut draining {
        let mut slot = lock(item.index);
        // A client whose acceptor has not attached withdraws (it is plain TCP from now on);
        // one whose acceptor attached switches first, then downgrades.
        if withdraw_pending(item.index, &mut slot) {
            item.done = true;
            continue;
        }
        // Between two users the switch also needs the acceptor's marker and token, written
        // right after its attach: give them their moment.
        if let Some(SanObject::Socket(socket)) = slot.as_ref() {
            if socket.phase == Phase::Pending {
                socket.await_private_marker(item.fd);
            }
        }
        let _ = switch_if_attached(item.fd, item.index, &mut slot);
        match slot.as_mut() {
            Some(SanObject::Socket(socket)) if socket.phase == Phase::Switched => {
                if !socket.begin_downgrade() {
                    tracing::debug!(fd = item.fd, "downgrade impossible: stays in this process");
                    item.done = true;
                }
            }
            _ => item.done = true,
        }
    }
    let deadline = Instant::now() + FORK_BUDGET;
    let mut next_nudge = Instant::now();
    loop {
        let mut mirrors: Vec<libc::pollfd> = Vec::new();
        let mut waiting_for: Vec<san_shm::NamespacedPid> = Vec::new();
        for item in draining.iter_mut().filter(|item| !item.done) {
            let mut slot = lock(item.index);
            if drain_step(item, &mut slot) {
                into_stash(item.fd, item.index, &mut slot, &item.received);
                item.done = true;
            } else if let Some(SanObject::Socket(socket)) = slot.as_ref() {
                if let Some(mirror) = socket.mirror_fd() {
                    mirrors.push(libc::pollfd {
                        fd: mirror,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
                waiting_for.extend(socket.peer_process());
            } else {
                item.done = true;
            }
        }
        if draining.iter().all(|item| item.done) || Instant::now() >= deadline {
            break;
        }
        if Instant::now() >= next_nudge {
            // A peer that makes no socket call answers through its responder thread.
            waiting_for.sort_unstable();
            waiting_for.dedup();
            for &peer in &waiting_for {
                super::nudge::nudge(peer, super::provider::segment_dir());
            }
            next_nudge = Instant::now() + super::nudge::NUDGE_INTERVAL;
        }
        assist_all_in_process();
        // SAFETY: `mirrors` is a valid array; short sleeps keep the loop cheap and bounded.
        unsafe { real::poll(mirrors.as_mut_ptr(), mirrors.len() as libc::nfds_t, 5) };
    }
    for item in draining.iter().filter(|item| !item.done) {
        tracing::debug!(fd = item.fd, "downgrade: peer did not answer in time");
        // The connection stays SAN in this process and finishes its downgrade later. The
        // session hands bytes out only once: those drained so far are read first.
        let mut slot = lock(item.index);
        if let Some(SanObject::Socket(socket)) = slot.as_mut() {
            socket.restore_received(&item.received);
        }
    }
}

/// One round of draining: reads what the session delivered (and an acceptor's pre-switch TCP
/// bytes, which come first) into `received`. True when the downgrade is complete.
fn drain_step(item: &mut Draining, slot: &mut Option<SanObject>) -> bool {
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return true;
    };
    socket.service();
    // An acceptor still owes the client's pre-switch TCP bytes: they precede the session's.
    match socket.tcp_backlog() {
        None => return false,
        Some(0) => {}
        Some(left) => {
            let mut buf = vec![0u8; usize::try_from(left).unwrap_or(usize::MAX).min(1 << 20)];
            // SAFETY: our own buffer.
            let n = unsafe {
                real::recv(
                    item.fd,
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                socket.count_tcp_received(n as u64);
                item.received.extend_from_slice(&buf[..n as usize]);
            }
            return false;
        }
    }
    let mut buf = [0u8; 16 << 10];
    // Bounded: each turn takes bytes out of the session's finite queue.
    for _ in 0..4096 {
        match socket.recv(&mut buf[..], false) {
            Ok(0) => break,
            Ok(n) => item.received.extend_from_slice(&buf[..n]),
            Err(SanError::SegmentAhead { .. }) => {
                // The sender gets a short count and sends the rest on TCP, after its
                // `Downgrade`.
                if socket.reject_remote_head().is_err() {
                    break;
                }
            }
            Err(SanError::Downgraded | SanError::Errno(_)) => break,
        }
    }
    if socket.reads_on_tcp() {
        socket.consume_marker_blocking(item.fd, MARKER_WAIT);
    }
    socket.downgrade_complete() || socket.is_broken()
}

/// The stashes holding bytes: (socket inode, memfd, memfd inode).
fn stashes_with_bytes() -> Vec<(u64, RawFd, u64)> {
    let mut candidates = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::STASHED != 0 {
            candidates.push(index);
        }
    });
    let mut stashes = Vec::new();
    for index in candidates {
        if let Some(SanObject::Stashed(stashed)) = lock(index).as_ref() {
            if let (Some(inode), Some(memfd_inode), true) = (
                stashed.socket_inode,
                stashed.memfd_inode,
                stashed.stash.remaining() > 0,
            ) {
                stashes.push((inode, stashed.stash.memfd(), memfd_inode));
            }
        }
    }
    stashes
}

/// `SANDIRECT_STASHES` (`fd:memfd:inode` entries, comma separated; the socket's inode lets
/// the new image check that `fd` is that very socket) for the image about to be exec'd by this process: every descriptor it passes
/// on (open, without close-on-exec) that is a socket whose stash still holds bytes, found by
/// the socket's identity, so copies count (a `vfork` child's `dup2` onto 0-2 is not in our
/// table: the table is its parent's). Their memfds are made inheritable. `None`: none.
///
/// Safe in a `vfork` child: it reads the parent's state, takes and releases slot locks, and
/// changes only the child's descriptor flags.
pub fn stash_env() -> Option<String> {
    let stashes = stashes_with_bytes();
    if stashes.is_empty() {
        return None;
    }
    // Descriptors the application may hand on: up to the highest we ever tracked, and at
    // least the first 1024 (a child's dup2 targets).
    let last = crate::fdtable::table().high_water().clamp(1023, 1 << 20);
    let mut entries = Vec::new();
    for fd in 0..=last {
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let fd_flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if fd_flags < 0 || fd_flags & libc::FD_CLOEXEC != 0 {
            continue;
        }
        let Some(inode) = socket_inode(fd) else {
            continue;
        };
        for &(stashed_inode, memfd, memfd_inode) in &stashes {
            if stashed_inode == inode && fd != memfd {
                entries.push((fd, memfd, memfd_inode));
            }
        }
    }
    // The memfd numbers are the parent's in a child: reach each one (once) from here.
    let mut reached: Vec<(RawFd, Option<RawFd>)> = Vec::new();
    let mut handed = Vec::new();
    for (fd, memfd, memfd_inode) in entries {
        let usable = match reached.iter().find(|(number, _)| *number == memfd) {
            Some(&(_, usable)) => usable,
            None => {
                let usable = usable_memfd(memfd, memfd_inode);
                reached.push((memfd, usable));
                usable
            }
        };
        match (usable, socket_inode(fd)) {
            (Some(usable), Some(inode)) => handed.push((fd, usable, inode)),
            _ => tracing::warn!(fd, "exec: a stash could not be handed over"),
        }
    }
    pass_on(&handed, true)
}

/// `SANDIRECT_STASHES` for `entries` (fd in the new image, memfd, socket inode); with `inheritable`
/// the memfds lose close-on-exec here (an exec); otherwise the caller arranges it.
pub(crate) fn pass_on(entries: &[(c_int, RawFd, u64)], inheritable: bool) -> Option<String> {
    let mut out = String::new();
    for &(fd, memfd, inode) in entries {
        if inheritable {
            // SAFETY: clearing close-on-exec on our own memfd so the new image gets it.
            unsafe { libc::fcntl(memfd, libc::F_SETFD, 0) };
        }
        if !out.is_empty() {
            out.push(',');
        }
        out.push_str(&format!("{fd}:{memfd}:{inode}"));
    }
    tracing::debug!(stashes = out, "exec: handing over stashes");
    (!out.is_empty()).then_some(out)
}

/// The stash memfd and socket inode of the stashed socket on `fd`, if it holds bytes.
pub(crate) fn stash_of(fd: c_int) -> Option<(RawFd, u64)> {
    let index = san_index(crate::fdtable::table().lookup(fd))?;
    match lock(index).as_ref() {
        Some(SanObject::Stashed(stashed)) if stashed.stash.remaining() > 0 => {
            Some((stashed.stash.memfd(), stashed.socket_inode?))
        }
        _ => None,
    }
}

/// In a new image: adopts the stashes an exec'ing image handed over. Bad entries are
/// ignored (the socket is then plain TCP, as it would be without us): malformed text, a
/// descriptor that is not open, or not the socket the inode names. Several entries may
/// share a memfd (copies of one socket): each adopts its own duplicate of it. `track` starts
/// tracking an inherited socket and gives its record index (`None`: not a connected stream
/// socket, or not trackable).
pub fn adopt_stashes(value: &str, track: impl Fn(c_int) -> Option<u32>) {
    tracing::debug!(value, "stashes handed over by exec");
    // Every check comes before any descriptor is touched: a stale or crafted entry may name
    // any open descriptor of ours. A stash is read through a private copy of the memfd; the
    // number handed over is closed only once its copy proved it a stash.
    let mut sockets: Vec<c_int> = Vec::new();
    let mut handed: Vec<c_int> = Vec::new();
    for entry in value.split(',').take(4096) {
        let mut fields = entry.split(':');
        let (Some(Ok(fd)), Some(Ok(memfd)), Some(Ok(inode)), None) = (
            fields.next().map(str::parse::<c_int>),
            fields.next().map(str::parse::<c_int>),
            fields.next().map(str::parse::<u64>),
            fields.next(),
        ) else {
            continue;
        };
        if fd < 0
            || memfd < 0
            || fd == memfd
            || sockets.contains(&fd)
            || socket_inode(fd) != Some(inode)
        {
            continue;
        }
        // SAFETY: F_GET_SEALS only reads; it fails unless `memfd` is an open shared-memory
        // file (a memfd), so pipes, sockets and regular files are refused here.
        if unsafe { libc::fcntl(memfd, libc::F_GET_SEALS) } < 0 {
            continue;
        }
        // SAFETY: duplicating an open descriptor; the copy is ours alone.
        let copy = unsafe { libc::fcntl(memfd, libc::F_DUPFD_CLOEXEC, 0) };
        if copy < 0 {
            continue;
        }
        // SAFETY: `copy` was just returned by the kernel and is owned by nobody else.
        let copy = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(copy) };
        let Some(stash) = Stash::adopt(crate::mirror::relocate_internal_fd(copy)) else {
            continue;
        };
        sockets.push(fd);
        if !handed.contains(&memfd) {
            handed.push(memfd);
        }
        let Some(index) = track(fd) else {
            continue;
        };
        *lock(index) = Some(SanObject::Stashed(Box::new(Stashed::new(
            stash,
            Some(inode),
        ))));
        LIVE.fetch_add(1, Ordering::Relaxed);
        mark_tcp(index);
        if let Some(record) = registry().get(index) {
            record.set_flag(flags::SAN | flags::STASHED, true);
        }
    }
    for memfd in handed {
        // SAFETY: a stash memfd the exec'ing image handed to us for its stashes (proved one
        // above); our copies hold the stashes now.
        unsafe { libc::close(memfd) };
    }
}

/// `recv` family on a stash holder: the stash first, then (`MSG_WAITALL`) TCP. `None`: the
/// stash is empty, make the real call.
pub(super) fn recv_stashed(
    fd: c_int,
    index: u32,
    bufs: &[RawBuf],
    recv_flags: c_int,
) -> SanCall<isize> {
    let total: usize = bufs.iter().map(|b| b.len).fold(0, usize::saturating_add);
    let done = match recv_stashed_after(fd, index, bufs, 0, recv_flags) {
        Ok(done) => done,
        Err(BadAddress) => return Some(Err(Errno(libc::EFAULT))),
    };
    if done == 0 {
        return if total == 0 { Some(Ok(0)) } else { None };
    }
    Some(Ok(done as isize))
}

/// A read into `bufs` after `done` bytes the call already has: the stash (if the socket
/// holds one), then, for `MSG_WAITALL`, TCP until the request is complete (blocking as the
/// kernel socket does). Returns the new `done`; `Err` when the buffers could not be written
/// and the call has no byte (the stash's bytes stay unread).
pub(super) fn recv_stashed_after(
    fd: c_int,
    index: u32,
    bufs: &[RawBuf],
    mut done: usize,
    recv_flags: c_int,
) -> Result<usize, BadAddress> {
    let total: usize = bufs.iter().map(|b| b.len).fold(0, usize::saturating_add);
    let peek = recv_flags & libc::MSG_PEEK != 0;
    let mut slot = lock(index);
    if let Some(SanObject::Stashed(stashed)) = slot.as_mut() {
        match stashed
            .stash
            .read(total - done, peek, |bytes| scatter(bufs, done, bytes))
        {
            Ok(n) => done += n,
            Err(BadAddress) if done == 0 => return Err(BadAddress),
            Err(BadAddress) => return Ok(done),
        }
        if !peek && stashed.stash.remaining() == 0 {
            release_stash(index, &mut slot);
        }
    }
    drop(slot);
    if done == 0 {
        return Ok(0);
    }
    if recv_flags & libc::MSG_WAITALL != 0 && !peek {
        // Each kernel call is one MSG_WAITALL read; it returns short only at end of stream,
        // an error, a timeout or a signal, which end this call as they end the kernel's.
        while done < total {
            let n = recv_tcp_rest(fd, bufs, done, recv_flags);
            if n == 0 {
                break;
            }
            done += n;
            if recv_flags & libc::MSG_DONTWAIT != 0 {
                break;
            }
        }
    }
    Ok(done)
}

/// The stash is empty (or its socket is gone): the socket is plain TCP.
pub(super) fn release_stash(index: u32, slot: &mut Option<SanObject>) {
    if let Some(SanObject::Stashed(stashed)) = slot.take() {
        drop(stashed);
        LIVE.fetch_sub(1, Ordering::Relaxed);
        mark_tcp(index);
    }
}

/// A stash holder added to (or changed in) an epoll set: the stash's eventfd goes beside it.
pub(super) fn stashed_epoll_ctl(index: u32, epfd: c_int, op: c_int, events: u32, data: u64) {
    if let Some(SanObject::Stashed(stashed)) = lock(index).as_mut() {
        stashed.epoll_ctl(epfd, op, events, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    fn owned(fd: c_int) -> OwnedFd {
        assert!(fd >= 0, "{}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor of ours.
        unsafe { OwnedFd::from_raw_fd(fd) }
    }

    /// What the process sees of descriptor `fd`: its flags and the file it names.
    fn state(fd: c_int) -> Option<(c_int, u64, u64)> {
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        // SAFETY: plain fstat(2) into a zeroed struct.
        let mut st: libc::stat = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fstat(fd, &mut st) } != 0 {
            return None;
        }
        Some((flags, st.st_dev, st.st_ino))
    }

    /// Hostile or stale `SANDIRECT_STASHES` values: nothing of the process is closed or
    /// changed, and nothing is adopted.
    #[test]
    fn hostile_stash_entries_touch_no_descriptor() {
        let mut ends = [0; 2];
        // SAFETY: socketpair writes two descriptors into `ends`.
        let rc =
            unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, ends.as_mut_ptr()) };
        assert_eq!(rc, 0);
        let (socket, _peer) = (owned(ends[0]), owned(ends[1]));
        let mut pipe = [0; 2];
        // SAFETY: pipe writes two descriptors into `pipe` (no close-on-exec: inherited).
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        let (pipe_r, pipe_w) = (owned(pipe[0]), owned(pipe[1]));
        // A memfd, but not a stash.
        // SAFETY: plain memfd_create + ftruncate on a fresh descriptor.
        let memfd = owned(unsafe { libc::memfd_create(c"not-a-stash".as_ptr(), 0) });
        // SAFETY: as above.
        unsafe { libc::ftruncate(memfd.as_raw_fd(), 4096) };
        let inode = socket_inode(socket.as_raw_fd()).unwrap();
        let (s, p, w, m) = (
            socket.as_raw_fd(),
            pipe_r.as_raw_fd(),
            pipe_w.as_raw_fd(),
            memfd.as_raw_fd(),
        );
        let watched = [s, p, w, m];
        let before: Vec<_> = watched.iter().map(|&fd| state(fd)).collect();
        let hostile = [
            format!("{s}:{p}:{inode}"),
            format!("{s}:{w}:{inode}"),
            format!("{s}:{m}:{inode}"),
            format!("{s}:{m}:{inode},{s}:{m}:{inode},{s}:{p}:{inode}"),
            format!("{p}:{m}:{inode}"),
            format!("{s}:{s}:{inode}"),
            format!("{s}:{p}:{}", inode + 1),
            format!("-1:{p}:{inode},{s}:-{p}:{inode},{s}:{p}:-1"),
            format!("99999999999:{p}:{inode},{s}:4294967296:{inode},{s}:1048575:{inode}"),
            format!("{s}:{p}:{inode}:7,{s}:{p},{s},,:::,{s}:{p}:x,garbage"),
        ];
        for value in &hostile {
            adopt_stashes(value, |fd| panic!("adopted {fd} from {value:?}"));
            let after: Vec<_> = watched.iter().map(|&fd| state(fd)).collect();
            assert_eq!(after, before, "descriptors changed by {value:?}");
        }
    }
}
