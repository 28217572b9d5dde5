//! Nudges: making a peer process answer a downgrade while its application makes no socket
//! call. This module is the nudge itself (its address, sending one, and receiving one with
//! the sender's credentials checked); the responder thread that answers is in `service`.
//!
//! Before `fork()` every SAN connection is moved back to kernel TCP, and that takes the peer's
//! part: its session must send its own `Downgrade` (see `downgrade`). A peer answers in its
//! next socket call, and a peer blocked on the socket is woken through its mirror at once; but
//! one that is busy or asleep elsewhere (computing, `sleep()`, waiting on a pipe) makes no call,
//! and the fork used to wait its whole budget and leave the connection to the parent.
//!
//! So every process with an intra-host SAN connection keeps one **responder** thread, blocked
//! in `recvmsg` on a Unix datagram socket: the file `.N-<pid ns>-<pid>-<contact>` in the
//! segment directory (so that peers in another network namespace that share the directory
//! reach it too; removed at exit), or where that cannot be bound, the abstract name
//! `\0sandirect/<euid>/N/<pid ns>/<pid>/<contact>` (a process whose policy names other
//! users, `SANDIRECT_OTHER_USERS`, binds `\0sandirect/x/N/…` instead, which its peers of
//! other users try after their own user's name): it
//! costs nothing until a nudge arrives (no timer, no spinning), and then services every SAN
//! socket of the process once (`service::service_all`: the same work an application call or a wait
//! slice does), which answers a pending `Downgrade`. A forking process nudges every peer it
//! waits for, again every [`NUDGE_INTERVAL`] while the answer is missing (an answer may need
//! several rounds when credits are short).
//!
//! **The contact.** The last part is a random value each process draws once and records in
//! every segment side it owns (`san_shm::set_contact`): only processes that share a segment
//! with it learn it, so nobody can take the name before its owner binds it (a name made of
//! the uid and the pid alone could be, by anyone watching pids).
//!
//! **Pid namespaces.** A peer is addressed by what it recorded in the segment: its pid as its
//! own pid namespace numbers it, and that namespace. The name holds both, so a peer in
//! another pid namespace (sharing the network namespace, hence the abstract names) is reached
//! as well, and two processes with the same pid in different namespaces never share a name.
//! No pid is translated, signalled or opened: the name is all a nudge needs.
//!
//! **Trust.** The socket has `SO_PASSCRED`: a datagram whose sender is not our effective uid,
//! nor a user our policy names, is dropped unread. Anyone may bind a free abstract name, so a squatter can take nudges
//! away; the fork then waits its budget as before (the connection stays exact, with the
//! parent). The worst a nudge can do is make us service our sockets once more.
//!
//! **Lifetime.** Started on the first intra-host SAN connection of a process (not in the
//! constructor: most programs never need it). A fork child inherits the descriptor but not the
//! thread; the child handler closes its copy and the child starts its own on its first SAN
//! connection. The descriptor is close-on-exec and sits above the application's numbers.

use core::mem::{size_of, zeroed};
use core::sync::atomic::{AtomicI32, Ordering};
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::time::Duration;

use san_shm::NamespacedPid;

use crate::discovery::{
    address_in_dir, effective_uid, file_socket_answer, nudge_address, shared_nudge_address,
};
use crate::real;

/// How often a forking process repeats its nudge while a peer has not answered.
pub(crate) const NUDGE_INTERVAL: Duration = Duration::from_millis(20);

/// The nudge socket file of process `process` in the segment directory (see
/// [`crate::discovery::address_in_dir`]): how a peer in another network namespace that shares
/// the directory reaches it. It is tried first, the abstract name (this namespace only) second.
fn nudge_file_name(process: NamespacedPid) -> String {
    format!(
        ".N-{}-{}-{:016x}",
        process.namespace, process.pid, process.contact
    )
}

/// The addresses process `process` may take nudges at, in the order a nudge tries them: its
/// socket file in `dir` when there is one, its abstract name under our user's, and when this
/// process's policy names other users, the name of no user's such a process binds instead
/// (see [`bind_nudge_socket`]): a peer of another user is found there.
fn nudge_addresses(
    process: NamespacedPid,
    dir: Option<BorrowedFd<'_>>,
) -> [Option<(libc::sockaddr_un, libc::socklen_t)>; 3] {
    let file = dir.and_then(|dir| address_in_dir(dir, &nudge_file_name(process)));
    let shared =
        (!crate::settings::other_users().is_empty()).then(|| shared_nudge_address(process));
    [file, Some(nudge_address(effective_uid(), process)), shared]
}

/// The bound, credential-passing socket of process `process` (this one), or the call that
/// failed: bound to its socket file in the segment directory `dir`, or where that cannot be
/// made, to its abstract name. True with it when it is the file (removed at exit).
pub(super) fn bind_nudge_socket(
    process: NamespacedPid,
    dir: Option<BorrowedFd<'_>>,
) -> Result<(OwnedFd, bool), &'static str> {
    // SAFETY: plain socket(2) through the real symbol.
    let raw = unsafe { real::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err("socket");
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let socket = crate::mirror::relocate_internal_fd(unsafe { OwnedFd::from_raw_fd(raw) });
    let fd = std::os::fd::AsRawFd::as_raw_fd(&socket);
    let on: libc::c_int = 1;
    // SAFETY: setsockopt(2) reads one int.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PASSCRED,
            (&on as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err("setsockopt(SO_PASSCRED)");
    }
    // A process whose policy names other users takes nudges at the name of no user's only:
    // its peers of other users try that name, those of its own user reach it there after
    // their own user's name (one refused send more).
    let addresses = nudge_addresses(process, dir);
    let shared_only = addresses[2].is_some();
    for (position, address) in addresses.into_iter().enumerate() {
        let Some((address, len)) = address.filter(|_| !shared_only || position == 2) else {
            continue;
        };

        // SAFETY: bind(2) reads `len` bytes of `address`.
        let rc = unsafe { real::bind(fd, (&address as *const libc::sockaddr_un).cast(), len) };
        if rc == 0 {
            return Ok((socket, position == 0));
        }
    }
    Err("bind")
}

/// Removes the socket files of processes that are gone from the segment directory `dir`:
/// nudge sockets and listener markers (`.N-…`, `.L-…`) whose socket refuses a connection. A
/// process removes its own nudge file at exit, but one killed or ended by `_exit` leaves it;
/// a marker is left on purpose (see `crate::discovery::ListenerMarker`). Run once per process
/// as its responder starts, so that the directory does not fill with them.
pub(super) fn sweep_stale_files(dir: &san_shm::ShmDir) {
    let fd = std::os::fd::AsRawFd::as_raw_fd(&std::os::fd::AsFd::as_fd(dir));
    let Ok(entries) = std::fs::read_dir(format!("/proc/self/fd/{fd}")) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if (name.starts_with(".N-") || name.starts_with(".L-"))
            && file_socket_answer(std::os::fd::AsFd::as_fd(dir), name) == Some(false)
        {
            let _ = dir.remove(name);
        }
    }
}

/// At exit: removes the nudge socket file of process `process` from `dir`.
pub(super) fn remove_nudge_file(process: NamespacedPid, dir: &san_shm::ShmDir) {
    let _ = dir.remove(&nudge_file_name(process));
}

/// What [`receive`] got.
pub(super) enum Received {
    /// A nudge from a process of our user.
    Nudge,
    /// A datagram without our user's credentials: dropped.
    Ignored,
    /// EINTR, or nothing queued (`MSG_DONTWAIT`).
    Interrupted,
    /// The socket is gone (closed behind our back): the thread ends.
    Closed,
}

/// Receives one datagram on the responder's socket `fd` (`flags`: `MSG_DONTWAIT` or 0):
/// a nudge when its sender's credentials say user `uid`, or a user this process's policy names
/// (`SANDIRECT_OTHER_USERS`).
pub(super) fn receive(fd: libc::c_int, uid: u32, flags: libc::c_int) -> Received {
    let mut byte = 0u8;
    let mut iov = libc::iovec {
        iov_base: (&mut byte as *mut u8).cast(),
        iov_len: 1,
    };
    // Room for one SCM_CREDENTIALS message, 8-byte aligned.
    let mut control = [0u64; 8];
    // SAFETY: plain data, zero is valid.
    let mut message: libc::msghdr = unsafe { zeroed() };
    message.msg_iov = &mut iov;
    message.msg_iovlen = 1;
    message.msg_control = control.as_mut_ptr().cast();
    message.msg_controllen = size_of::<[u64; 8]>();
    // SAFETY: recvmsg(2) writes at most one byte and `msg_controllen` bytes of control data
    // into the buffers above, which outlive the call.
    let n = unsafe { real::recvmsg(fd, &mut message, flags) };
    if n < 0 {
        return match crate::errno::get() {
            libc::EINTR | libc::EAGAIN => Received::Interrupted,
            libc::EBADF | libc::ENOTSOCK => Received::Closed,
            _ => {
                // Unexpected: back off rather than spin on a failing call.
                std::thread::sleep(Duration::from_millis(10));
                Received::Interrupted
            }
        };
    }
    match sender_uid(&message) {
        Some(sender) if sender == uid || crate::settings::other_users().contains(&sender) => {
            Received::Nudge
        }
        _ => Received::Ignored,
    }
}

/// The uid of the SCM_CREDENTIALS message in `message`'s control data.
fn sender_uid(message: &libc::msghdr) -> Option<u32> {
    // SAFETY: the CMSG macros walk the control buffer recvmsg filled, within its length.
    let mut header = unsafe { libc::CMSG_FIRSTHDR(message) };
    while !header.is_null() {
        // SAFETY: a non-null header returned by CMSG_FIRSTHDR/NXTHDR lies within the buffer.
        let cmsg = unsafe { &*header };
        if cmsg.cmsg_level == libc::SOL_SOCKET
            && cmsg.cmsg_type == libc::SCM_CREDENTIALS
            && cmsg.cmsg_len as usize >= libc_cmsg_len(size_of::<libc::ucred>())
        {
            // SAFETY: the message carries a whole `ucred` (length checked); it may be
            // unaligned in the byte buffer, hence read_unaligned.
            let cred: libc::ucred =
                unsafe { core::ptr::read_unaligned(libc::CMSG_DATA(header).cast::<libc::ucred>()) };
            return Some(cred.uid);
        }
        // SAFETY: as above.
        header = unsafe { libc::CMSG_NXTHDR(message, header) };
    }
    None
}

fn libc_cmsg_len(payload: usize) -> usize {
    // SAFETY: CMSG_LEN is arithmetic only.
    unsafe { libc::CMSG_LEN(payload as u32) as usize }
}

/// Asks process `peer` (of our user, on this host) to service its SAN sockets now. Best
/// effort: a process without a responder just does not answer sooner.
/// `dir`: the segment directory, where a peer of another network namespace has its socket file.
pub(crate) fn nudge(peer: NamespacedPid, dir: Option<BorrowedFd<'_>>) {
    let Some(fd) = sender() else {
        return;
    };
    for (address, len) in nudge_addresses(peer, dir).into_iter().flatten() {
        // SAFETY: sendto(2) reads one byte and `len` bytes of `address`.
        let sent = unsafe {
            real::sendto(
                fd,
                [0u8].as_ptr().cast(),
                1,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                (&address as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        // Delivered, or queued for a responder that is busy: done. Nobody at this name (a peer
        // with only the other kind): try the next.
        if sent >= 0 || !matches!(crate::errno::get(), libc::ENOENT | libc::ECONNREFUSED) {
            return;
        }
    }
}

/// The unbound datagram socket nudges are sent from (made on first use, kept: forks are rare
/// but may come in bursts, e.g. a pre-forking server).
fn sender() -> Option<libc::c_int> {
    static SENDER: AtomicI32 = AtomicI32::new(-1);
    let fd = SENDER.load(Ordering::Acquire);
    if fd >= 0 {
        return Some(fd);
    }
    // SAFETY: plain socket(2) through the real symbol.
    let raw = unsafe { real::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let socket = crate::mirror::relocate_internal_fd(unsafe { OwnedFd::from_raw_fd(raw) });
    let raw = socket.into_raw_fd();
    match SENDER.compare_exchange(-1, raw, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => Some(raw),
        Err(theirs) => {
            // SAFETY: ours, lost the race: close it.
            unsafe { libc::close(raw) };
            Some(theirs)
        }
    }
}
