//! `recv`/`read`/`readv`/`recvmsg` on a SAN socket, with Linux semantics (blocking,
//! `O_NONBLOCK`, `MSG_DONTWAIT`, `MSG_PEEK`, `MSG_WAITALL`, `SO_RCVTIMEO`): the pending
//! client's look for the switch marker, the acceptor's count of the client's pre-switch TCP
//! bytes, inline and rendezvous receives through the session, a downgraded stream's
//! continuation on TCP, and a stash holder's stash.
//!
//! The loop takes the socket's lock, works without blocking, and releases the lock around
//! the one place it blocks.
//!
//! A buffer the process may not write answers `EFAULT` as the kernel's receive does, and the
//! bytes stay unread: the session consumes a message's bytes only once they were all copied
//! (the messages before it stay taken, as the kernel's segments do).

use core::ffi::c_int;
use std::time::Instant;

use super::downgrade;
use super::kernel::{
    accessible_prefix, fail, partial, recv_tcp, remaining_pieces, scatter, AppBufs, RawBuf,
};
use super::outcome::{SanCall, SanError};
use super::socket::stream::SinkRefused;
use super::socket::{Phase, SanSocket};
use super::switchover::{
    assist_in_process_peer, downgrade_pending, epoll_back_to_tcp, switch_if_attached,
};
use super::table::{claim_of, lock, orphaned, record_flag, still_claimed, SanObject};
use super::tunables::{HANDSHAKE_WAIT, HELLO_AFTER_FIN_WAIT, MARKER_WAIT};
use super::wait::{block, timeout_of};
use crate::errno::Errno;
use crate::real;
use crate::record::{flags, Counter};
use crate::registry::registry;

/// `recv`/`read`/`readv`/`recvmsg` on a SAN socket: the count received (a partial count
/// included, 0 at end of stream) or the errno. `None`: not (or no longer) a SAN socket.
pub fn recv_iov(fd: c_int, index: u32, bufs: &[RawBuf], recv_flags: c_int) -> SanCall<isize> {
    let entered = matches!(lock(index).as_ref(), Some(SanObject::Socket(s)) if s.entering_call());
    let result = recv_iov_inner(fd, index, bufs, recv_flags);
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        // (A receive leaves untransmitted what earlier sends queued as it found it, but a
        // nudge the peer skipped while this call was under way is owed from here.)
        socket.leaving_call(entered);
        socket.note_call(false, matches!(result, Some(Ok(n)) if n > 0));
    }
    if tracing::enabled!(tracing::Level::TRACE) {
        let first = bufs.first().filter(|b| !b.ptr.is_null());
        let shown = match (result, first) {
            (Some(Ok(n)), Some(buf)) if n > 0 => {
                // SAFETY: the first `n.min(len)` bytes of the caller's buffer were just written.
                let bytes = unsafe {
                    core::slice::from_raw_parts(buf.ptr, (n as usize).min(buf.len).min(24))
                };
                String::from_utf8_lossy(bytes).into_owned()
            }
            _ => String::new(),
        };
        tracing::trace!(fd, ?result, recv_flags, shown, "SAN recv");
    }
    result
}

fn recv_iov_inner(fd: c_int, index: u32, bufs: &[RawBuf], recv_flags: c_int) -> SanCall<isize> {
    if orphaned(index) {
        return Some(Err(fail(libc::ECONNRESET)));
    }
    if record_flag(index, flags::STASHED) {
        return downgrade::recv_stashed(fd, index, bufs, recv_flags);
    }
    let total: usize = bufs.iter().map(|b| b.len).fold(0, usize::saturating_add);
    let peek = recv_flags & libc::MSG_PEEK != 0;
    let wait_all = recv_flags & libc::MSG_WAITALL != 0 && !peek;
    let nonblocking = recv_flags & libc::MSG_DONTWAIT != 0 || record_flag(index, flags::NONBLOCK);
    let deadline = (!nonblocking)
        .then(|| timeout_of(index, fd, libc::SO_RCVTIMEO))
        .flatten();
    if total == 0 && nonblocking {
        // As the kernel's nonblocking `recv` of nothing: `EAGAIN` while nothing is queued
        // (nor an end of stream), else 0; found out as a one-byte peek would (a blocking one
        // answers 0 at once; `read` and `readv` of nothing never reach here).
        let mut probe = [0u8; 1];
        let probe_buf = [RawBuf {
            ptr: probe.as_mut_ptr().cast(),
            len: 1,
        }];
        return match recv_iov_inner(
            fd,
            index,
            &probe_buf,
            recv_flags | libc::MSG_PEEK | libc::MSG_DONTWAIT,
        ) {
            Some(Ok(_)) => Some(Ok(0)),
            other => other,
        };
    }
    let mut done = 0usize;
    // Set when this call consumed the switch marker: the acceptor wrote it because it has
    // data (or a FIN) for us, queued until our Hello reaches it. A nonblocking reader woken by
    // the marker waits that one round trip (bounded) rather than seeing a spurious EAGAIN.
    let mut handshake_deadline: Option<Instant> = None;
    // Set when TCP said end of file before the client's `Hello` arrived over a fabric that
    // may deliver after TCP: until then the `Hello` and the session's bytes may
    // still be on their way.
    let mut hello_deadline: Option<Instant> = None;
    let mut assisted = false;
    let claim = claim_of(index);
    loop {
        if !still_claimed(index, claim) {
            return Some(partial(done, libc::EBADF));
        }
        let mut slot = lock(index);
        if let Err(code) = switch_if_attached(fd, index, &mut slot) {
            return Some(partial(done, code));
        }
        if downgrade::settle(fd, index, &mut slot) {
            if done > 0 && wait_all && done < total {
                // The rest of the request comes from the stash and TCP, where the stream
                // goes on after the downgrade.
                drop(slot);
                let flags = if nonblocking {
                    recv_flags | libc::MSG_DONTWAIT
                } else {
                    recv_flags
                };
                done = downgrade::recv_stashed_after(fd, index, bufs, done, flags).unwrap_or(done);
            }
            return if done > 0 {
                Some(Ok(done as isize))
            } else {
                None
            };
        }
        let Some(SanObject::Socket(socket)) = slot.as_mut() else {
            return if done > 0 {
                Some(Ok(done as isize))
            } else {
                None
            };
        };
        let wait = if socket.phase == Phase::Pending {
            // Is there a byte on TCP, and is the segment attached? (The exact rule.)
            let mut byte = 0u8;
            // SAFETY: one writable byte.
            let n = unsafe {
                real::recv(
                    fd,
                    (&mut byte as *mut u8).cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            let peeked_error = (n < 0).then(Errno::last);
            if peeked_error == Some(Errno(libc::EAGAIN)) {
                if nonblocking {
                    return Some(Err(fail(libc::EAGAIN)));
                }
                socket.prepare_wait(libc::POLLIN)
            } else if let Some(Errno(code)) = peeked_error.filter(|_| !socket.peer_attached(fd)) {
                // A reset (or another error) from a server that never attached: the peek took
                // the socket's pending error, so this call is the one that reports it.
                downgrade_pending(index, &mut slot);
                return Some(partial(done, code));
            } else if socket.peer_attached_settled(fd) {
                if n == 1 {
                    // The marker: consume it; the switch happens at the top of the loop.
                    socket.consume_marker(fd);
                    socket.marker_consumed();
                    handshake_deadline = Instant::now().checked_add(HANDSHAKE_WAIT);
                }
                continue;
            } else {
                // A plain server's data, EOF or an error: this connection is plain TCP.
                downgrade_pending(index, &mut slot);
                return None;
            }
        } else {
            if !socket.reads_without_drive(total) {
                socket.service();
            }
            if total == 0 {
                return Some(Ok(0));
            }
            let backlog = socket.tcp_backlog();
            // After the peer's `Downgrade` (and the bytes before it) its stream goes on on TCP.
            let downgraded_read = backlog == Some(0) && socket.reads_on_tcp();
            if downgraded_read {
                socket.consume_marker_blocking(fd, MARKER_WAIT);
            }
            let from_tcp = match backlog {
                Some(0) if downgraded_read => Some(u64::MAX),
                Some(0) => None,
                Some(left) => Some(left),
                None if socket.tcp_eof() => None,
                None => Some(u64::MAX),
            };
            if let Some(limit) = from_tcp {
                match recv_tcp(fd, bufs, done, limit, recv_flags) {
                    Ok(n) if n > 0 => {
                        if !peek {
                            socket.count_tcp_received(n as u64);
                            if let Some(record) = registry().get(index) {
                                record.count(Counter::TcpReceived, n as u64);
                            }
                            if socket.tcp_backlog() == Some(0) {
                                // The client's TCP bytes are done: the mirror must now say
                                // exactly whether the session has more (an edge-triggered
                                // reader that got a short read waits for the next edge).
                                socket.settle_readable();
                            }
                        }
                        done += n;
                        if wait_all && done < total {
                            continue;
                        }
                        return Some(Ok(done as isize));
                    }
                    Ok(_) if downgraded_read => return Some(Ok(done as isize)),
                    Ok(_) => {
                        // TCP end-of-file: before the client's count is known it may still be
                        // racing its Hello (sent before its FIN): look once more.
                        socket.service();
                        if socket.tcp_backlog().is_none() {
                            if awaits_hello_after_tcp_end(socket, &mut hello_deadline) {
                                let wait = socket.prepare_wait(0);
                                drop(slot);
                                let _ = block(index, fd, wait, hello_deadline);
                                continue;
                            }
                            socket.set_tcp_eof();
                            return Some(Ok(done as isize));
                        }
                        if socket.tcp_backlog() != Some(0) {
                            // The client died or broke the protocol before its bytes arrived.
                            return Some(partial(done, libc::ECONNRESET));
                        }
                        continue;
                    }
                    Err(Errno(code)) if code != libc::EAGAIN => {
                        return Some(partial(done, code));
                    }
                    Err(_) => {}
                }
                let tcp_only = backlog != Some(0) && socket.is_broken();
                if tcp_only {
                    // The session ended while the client's TCP bytes were still due (it
                    // closed or died while pending, before its Hello): the rest of them, and
                    // the end of its stream, come on TCP alone, and the mirror, which fired
                    // its last edge (hang-up) already, cannot report them. Waiters watch TCP
                    // from now on (an edge-triggered one saw EAGAIN and waits for an edge).
                    if !socket.epoll_on_tcp {
                        tracing::debug!(fd, name = %socket.name, "session gone before the client's TCP bytes: waiting on TCP");
                    }
                    epoll_back_to_tcp(index, fd, socket);
                }
                if done > 0 && !wait_all {
                    return Some(Ok(done as isize));
                }
                if nonblocking {
                    return Some(partial(done, libc::EAGAIN));
                }
                if tcp_only {
                    Some(SanSocket::tcp_wait(libc::POLLIN))
                } else {
                    // The client's Hello (SAN) or its pending bytes (TCP) will wake us.
                    socket.prepare_wait(libc::POLLIN)
                }
            } else {
                match recv_into(socket, bufs, done, peek) {
                    Ok(n) => {
                        if n == 0 && total > 0 {
                            tracing::debug!(fd, done, "SAN end of stream");
                        }
                        if n > 0 {
                            if socket.drives_after_read() {
                                socket.service();
                            }
                            if !peek {
                                socket.settle_readable();
                            }
                        }
                        done += n;
                        if n > 0 && wait_all && done < total {
                            continue;
                        }
                        return Some(Ok(done as isize));
                    }
                    Err(SanError::Errno(libc::EAGAIN)) => {
                        if done > 0 && !wait_all {
                            return Some(Ok(done as isize));
                        }
                        let in_handshake = handshake_deadline.is_some_and(|d| Instant::now() < d);
                        if nonblocking && !in_handshake && !assisted && socket.peer_in_process() {
                            // The other end lives in this process and may have bytes queued
                            // that only a call of its own would move (its handshake's last
                            // step): no other thread may ever drive it before this read
                            // answers EAGAIN. Drive it (bounded: once per call), read again.
                            assisted = true;
                            drop(slot);
                            for _ in 0..2 {
                                assist_in_process_peer(index);
                            }
                            continue;
                        }
                        if nonblocking && !in_handshake {
                            // Under lazy lowering the mirror stays raised: the epoll wait
                            // lowers it before it sleeps, after looking for the next message.
                            // Watched only by edge-triggered registrations, its arrival
                            // tokens may stay until a few have gathered.
                            if socket.lazy_lowering
                                || socket.leaves_edge_tokens()
                                || socket.lower_readable()
                            {
                                return Some(partial(done, libc::EAGAIN));
                            }
                            continue;
                        }
                        if in_handshake {
                            // Bounded: give up with EAGAIN at the deadline.
                            let wait = socket.prepare_wait(0);
                            drop(slot);
                            if block(index, fd, wait, handshake_deadline).is_err() {
                                handshake_deadline = None;
                            }
                            continue;
                        }
                        socket.prepare_read_wait()
                    }
                    // The peer's `Downgrade` was just taken in: the next turn reads TCP.
                    Err(SanError::Downgraded) => continue,
                    Err(SanError::SegmentAhead { len }) => {
                        drop(slot);
                        match recv_rendezvous(index, fd, bufs, done, peek, len) {
                            Ok(None) => continue,
                            Ok(Some(n)) => {
                                done += n;
                                if n > 0 && wait_all && done < total {
                                    continue;
                                }
                                return Some(Ok(done as isize));
                            }
                            Err(code) => return Some(partial(done, code)),
                        }
                    }
                    Err(SanError::Errno(code)) => return Some(partial(done, code)),
                }
            }
        };
        drop(slot);
        if let Err(code) = block(index, fd, wait, deadline) {
            return Some(partial(done, code));
        }
    }
}

/// Acceptor, TCP at its end before the client's `Hello` arrived (looked for once more):
/// true while the `Hello` may still come (see `SanSocket::hello_may_trail_tcp`), for at most
/// [`HELLO_AFTER_FIN_WAIT`] from the first call (which sets `deadline`).
fn awaits_hello_after_tcp_end(socket: &SanSocket, deadline: &mut Option<Instant>) -> bool {
    if !socket.hello_may_trail_tcp() {
        return false;
    }
    let now = Instant::now();
    let until = *deadline.get_or_insert_with(|| now + HELLO_AFTER_FIN_WAIT);
    now < until
}

/// The rendezvous segment at the head of the stream (`segment` bytes unread), zero-copy into
/// the caller's buffers after `done` bytes (the first remaining buffer; with `peek`, a
/// staging buffer of the whole remaining length, scattered). `Ok(Some(n))`: `n` bytes
/// received; `Ok(None)`: nothing yet, read on (the segment was turned down, or another thread
/// is receiving it). Like a rendezvous send, the wait ignores signals and deadlines (the
/// buffer is in use). A buffer the process may not write where the segment would land is
/// `EFAULT` before anything starts, the segment left unread, as the kernel answers.
fn recv_rendezvous(
    index: u32,
    fd: c_int,
    bufs: &[RawBuf],
    done: usize,
    peek: bool,
    segment: u64,
) -> Result<Option<usize>, c_int> {
    let mut staging = Vec::new();
    let target: &mut [u8] = if peek {
        let want: usize = bufs.iter().map(|b| b.len).sum::<usize>() - done;
        staging.resize(want, 0u8);
        &mut staging
    } else {
        let Some(first) = remaining_pieces(bufs, done).next() else {
            return Ok(Some(0));
        };
        let landing = usize::try_from(segment).map_or(first.iov_len, |n| n.min(first.iov_len));
        if accessible_prefix(first.iov_base.cast(), landing, true) < landing {
            return Err(libc::EFAULT);
        }
        // SAFETY: the caller's buffer is writable for its length during the hook call, which
        // does not return before the receive into it completed.
        unsafe { core::slice::from_raw_parts_mut(first.iov_base.cast::<u8>(), first.iov_len) }
    };
    let claim = claim_of(index);
    let ticket = {
        let mut slot = lock(index);
        let Some(SanObject::Socket(socket)) = slot.as_mut() else {
            return Err(libc::EBADF);
        };
        match socket.start_recv_rendezvous(target, peek) {
            Ok(ticket) => ticket,
            Err(SinkRefused::Rejected) => return Ok(None),
            Err(SinkRefused::Errno(libc::EAGAIN)) => {
                let wait = socket.prepare_wait(0);
                drop(slot);
                block(index, fd, wait, None)?;
                return Ok(None);
            }
            Err(SinkRefused::Errno(code)) => return Err(code),
        }
    };
    let received = loop {
        if !still_claimed(index, claim) {
            return Err(libc::EBADF);
        }
        let wait = {
            let mut slot = lock(index);
            let Some(SanObject::Socket(socket)) = slot.as_mut() else {
                return Err(libc::EBADF);
            };
            socket.service();
            if let Some(result) = socket.take_recv_completion(ticket, peek) {
                if !peek {
                    socket.settle_readable();
                }
                break result?;
            }
            socket.prepare_completion_wait()
        };
        let _ = block(index, fd, wait, None);
    };
    if peek && scatter(bufs, done, &staging[..received.min(staging.len())]).is_err() {
        return Err(libc::EFAULT);
    }
    Ok(Some(received))
}

/// Copies SAN stream bytes into `bufs` after `done` bytes, in one pass over the vector (a
/// peek sees the stream from its start in every buffer): `Ok(n)` (0 at end of stream), or
/// `EFAULT` with the bytes left unread when the buffers cannot be written.
fn recv_into(
    socket: &mut SanSocket,
    bufs: &[RawBuf],
    done: usize,
    peek: bool,
) -> Result<usize, SanError> {
    socket.recv(&mut AppBufs::rest(bufs, done), peek)
}
