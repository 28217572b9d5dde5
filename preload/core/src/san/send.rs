//! `send`/`write`/`writev`/`sendmsg` on a SAN socket, with Linux semantics (blocking,
//! `O_NONBLOCK`, `MSG_DONTWAIT`, `MSG_OOB`, `SO_SNDTIMEO`): the pending client's counted TCP
//! sends, inline sends through the session, rendezvous sends of large blocking writes, and
//! a downgrading stream's continuation on TCP.
//!
//! The loop takes the socket's lock, works without blocking, and releases the lock around
//! the one place it blocks.
//!
//! A buffer the process may not read answers `EFAULT` as the kernel's send does: nothing of
//! it is taken (the session commits a copy only when all of it succeeded), except whole
//! 64 KiB units of the call before the fault, which make a short count.

use core::ffi::c_int;

use super::downgrade;
use super::kernel::{
    accessible_prefix, fail, next_piece, partial, remaining_pieces, send_on_tcp, AppBufs,
    FileRange, RawBuf,
};
use super::outcome::{SanCall, SanError};
use super::socket::Phase;
use super::switchover::switch_if_attached;
use super::table::{claim_of, lock, orphaned, record_flag, still_claimed, SanObject};
use super::wait::{block, timeout_of};
use crate::errno::Errno;
use crate::record::flags;
use san_api::SourcePart;
use switch::session::SendTicket;

/// The unit in which a send whose buffer faults is taken (see `send_iov`): the kernel's
/// segments are up to 64 KiB.
const FAULT_UNIT: usize = 64 << 10;

/// `send`/`write`/`writev`/`sendmsg` on a SAN socket: the count sent (a partial count
/// included) or the errno. `None`: not (or no longer) a SAN socket — the caller makes the
/// real call.
pub fn send_iov(fd: c_int, index: u32, bufs: &[RawBuf], send_flags: c_int) -> SanCall<isize> {
    let entered = matches!(lock(index).as_ref(), Some(SanObject::Socket(s)) if s.entering_call());
    let sent = send_iov_inner(fd, index, bufs, send_flags);
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        socket.leaving_call(entered);
        socket.note_call(matches!(sent, Some(Ok(n)) if n > 0), false);
    }
    sent
}

/// `sendfile` of `len` bytes of `file` from offset `at` into a SAN socket whose session takes
/// them all at once (switched, established, with room, nothing else to do first): the bytes
/// are read from the file straight into the peer's receive slots as far as credits go, one
/// `preadv` per batch of slots (`FileRange::copy_to_each`), and the rest into the session's
/// send buffer. The count sent (fewer than `len` only when a read failed after some were
/// sent), or `None` when the general path must serve the call (no room, a downgrade, a
/// rendezvous, a file that gave fewer bytes than asked: it then reads what there is and
/// sends it).
pub fn send_file_in_place(index: u32, file: c_int, at: i64, len: usize) -> Option<usize> {
    if len == 0 || orphaned(index) || record_flag(index, flags::STASHED) {
        return None;
    }
    let mut slot = lock(index);
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return None;
    };
    if !socket.queues_without_drive(len) {
        return None;
    }
    // Straight into the peer's slots as far as credits and slots go, the rest into the send
    // buffer, which has room for all of it (checked above). Read straight into the slots, a
    // 64 KiB body is one system call and one copy (page cache to slot), where the buffer
    // cost a read into it and a copy out of it.
    let mut sent = 0usize;
    while sent < len {
        let source = FileRange {
            fd: file,
            at: at + sent as i64,
            len: len - sent,
        };
        match socket.send(&source, false) {
            Ok(n) if n > 0 => {
                socket.service();
                socket.journal_sent(&source);
                sent += n;
            }
            _ => break,
        }
    }
    if sent == 0 {
        return None;
    }
    socket.leaving_call(false);
    socket.note_call(true, false);
    Some(sent)
}

fn send_iov_inner(fd: c_int, index: u32, bufs: &[RawBuf], send_flags: c_int) -> SanCall<isize> {
    if orphaned(index) {
        return Some(Err(fail(libc::ECONNRESET)));
    }
    if record_flag(index, flags::STASHED) {
        // Sending is plain TCP; only reads see the stash.
        return None;
    }
    let total: usize = bufs.iter().map(|b| b.len).fold(0, usize::saturating_add);
    let nonblocking = send_flags & libc::MSG_DONTWAIT != 0 || record_flag(index, flags::NONBLOCK);
    let deadline = (!nonblocking)
        .then(|| timeout_of(index, fd, libc::SO_SNDTIMEO))
        .flatten();
    let urgent = send_flags & libc::MSG_OOB != 0;
    let mut done = 0usize;
    // Set when the receiver turned a rendezvous of this call down: the rest goes inline.
    let mut inline_only = false;
    // Since when this call waits with the peer's data unread (`absorb_if_stalled`).
    let mut stalled_since = None;
    // Since when this call waits for credits rather than buffer (`waits_for_credits`).
    let mut credit_wait_since = None;
    let claim = claim_of(index);
    loop {
        if !still_claimed(index, claim) {
            return Some(partial(done, libc::EBADF));
        }
        let mut slot = lock(index);
        if let Err(code) = switch_if_attached(fd, index, &mut slot) {
            return Some(partial(done, code));
        }
        downgrade::settle(fd, index, &mut slot);
        let Some(SanObject::Socket(socket)) = slot.as_mut() else {
            return if done > 0 {
                Some(Ok(done as isize))
            } else {
                None
            };
        };
        let wait = if socket.phase == Phase::Pending {
            // Counted TCP send (nonblocking under the lock, so the count is exact).
            match send_on_tcp(fd, index, bufs, done, send_flags) {
                Ok(n) if n > 0 => {
                    socket.count_tcp_sent(n as u64);
                    done += n;
                    if done >= total || nonblocking {
                        return Some(Ok(done as isize));
                    }
                    continue;
                }
                // Nothing asked for, nothing sent.
                Ok(_) => return Some(Ok(0)),
                Err(Errno(code)) => {
                    if code != libc::EAGAIN || nonblocking {
                        return Some(partial(done, code));
                    }
                }
            }
            socket.prepare_wait(libc::POLLOUT)
        } else {
            let piece = next_piece(bufs, done);
            let rendezvous_possible = !nonblocking && !urgent && !inline_only;
            // Inline, the rest of the call goes into the session as one run (so a vector
            // faults as a whole, as the kernel copies it), up to a later buffer that goes by
            // rendezvous.
            let span = inline_span(bufs, done, |len| {
                rendezvous_possible && socket.wants_rendezvous(len)
            });
            let source = AppBufs::new(bufs, done, span);
            if !socket.queues_without_drive(span) {
                socket.service();
            }
            if total == 0 {
                return Some(Ok(0));
            }
            socket.wake_pending_client(fd);
            if rendezvous_possible && socket.wants_rendezvous(piece.len()) {
                if accessible_prefix(piece.as_ptr().cast_mut(), piece.len(), false) < piece.len() {
                    // Not all of it can be read: inline, where a fault is taken as the kernel
                    // takes it (the provider or the peer would meet it mid-transfer).
                    inline_only = true;
                    continue;
                }
                match socket.start_send_rendezvous(piece) {
                    Ok(ticket) => {
                        drop(slot);
                        match wait_send_rendezvous(index, fd, ticket) {
                            Ok(0) => {
                                // The receiver could not take it zero-copy and nothing was
                                // consumed: this call sends the rest inline.
                                inline_only = true;
                                continue;
                            }
                            Ok(n) => {
                                done += n;
                                if n < piece.len() || done >= total {
                                    return Some(Ok(done as isize));
                                }
                                continue;
                            }
                            Err(code) => return Some(send_failed(done, code, send_flags)),
                        }
                    }
                    // The connection is downgrading: the rest goes on TCP.
                    Err(SanError::Downgraded) => continue,
                    // Another thread's rendezvous is in progress: wait for it to end.
                    Err(SanError::Errno(libc::EAGAIN)) => {
                        let wait = socket.prepare_send_wait();
                        drop(slot);
                        if let Err(code) = block(index, fd, wait, deadline) {
                            return Some(partial(done, code));
                        }
                        continue;
                    }
                    Err(error) => return Some(send_failed(done, error.errno(), send_flags)),
                }
            }
            if !nonblocking && !urgent && socket.waits_for_credits(total, &mut credit_wait_since) {
                // Buffering now would cost a copy more per byte than waiting briefly for the
                // reader's credits (the bytes then go straight into its slots).
                match socket.prepare_wait(0) {
                    Some(mut wait) => {
                        wait.cap = Some(super::tunables::CREDIT_WAIT_BOUND);
                        drop(slot);
                        if let Err(code) = block(index, fd, Some(wait), deadline) {
                            return Some(partial(done, code));
                        }
                        continue;
                    }
                    // News came: drive it, then send (into the slots if it brought credits).
                    None => socket.service(),
                }
            }
            match socket.send(&source, urgent) {
                Ok(n) => {
                    socket.service();
                    socket.journal_sent(&source);
                    done += n;
                    if done >= total {
                        return Some(Ok(done as isize));
                    }
                    continue;
                }
                Err(SanError::Errno(libc::EFAULT)) => {
                    // The kernel copies a send into its buffer in segments of up to 64 KiB
                    // and keeps the whole ones it copied before the fault: so do we, by the
                    // call's 64 KiB units; nothing of the unit that faulted is taken.
                    let faulted_at = done + source.readable();
                    let keep = (faulted_at - faulted_at % FAULT_UNIT).saturating_sub(done);
                    if keep > 0 {
                        let before = SourcePart::new(&source, 0, keep);
                        if let Ok(n) = socket.send(&before, urgent) {
                            socket.service();
                            socket.journal_sent(&before);
                            done += n;
                        }
                    }
                    return Some(partial(done, libc::EFAULT));
                }
                Err(SanError::Downgraded) => {
                    // Our stream goes on on TCP (after the session's queued bytes and its
                    // `Downgrade`): nonblocking under the lock, waiting like a pending client.
                    let code = match send_on_tcp(fd, index, bufs, done, send_flags) {
                        Ok(n) if n > 0 => {
                            done += n;
                            if done >= total || nonblocking {
                                return Some(Ok(done as isize));
                            }
                            continue;
                        }
                        // Nothing left to ask for (`send_on_tcp` reports a nonempty send
                        // that sent nothing as its errno).
                        Ok(_) => return Some(Ok(done as isize)),
                        Err(Errno(code)) => code,
                    };
                    if code != libc::EAGAIN || nonblocking {
                        return Some(partial(done, code));
                    }
                    socket.prepare_wait(libc::POLLOUT)
                }
                Err(SanError::Errno(libc::EAGAIN)) => {
                    if nonblocking {
                        // A short count, like EAGAIN, tells an edge-triggered caller to wait
                        // for EPOLLOUT: the watched end must be lowered so that the peer's returned room
                        // makes that edge (room that appeared meanwhile: send on).
                        if socket.lower_writable() {
                            return Some(partial(done, libc::EAGAIN));
                        }
                        continue;
                    }
                    match socket.blocked_send_wait(&mut stalled_since) {
                        Some(wait) => Some(wait),
                        None => continue,
                    }
                }
                Err(error) => return Some(send_failed(done, error.errno(), send_flags)),
            }
        };
        drop(slot);
        if let Err(code) = block(index, fd, wait, deadline) {
            return Some(partial(done, code));
        }
    }
}

/// How many bytes after `done` go into the session as one inline run: the rest of the
/// current buffer and the whole buffers after it, up to the first of those that
/// `by_rendezvous` (by its length) would send by rendezvous.
fn inline_span(bufs: &[RawBuf], done: usize, by_rendezvous: impl Fn(usize) -> bool) -> usize {
    let mut span = 0usize;
    for (position, piece) in remaining_pieces(bufs, done).enumerate() {
        if position > 0 && by_rendezvous(piece.iov_len) {
            break;
        }
        span = span.saturating_add(piece.iov_len);
    }
    span
}

/// A send failed with `code` after `done` bytes: the count if any, else the error (and
/// SIGPIPE for a broken stream unless `MSG_NOSIGNAL`, as the kernel does).
fn send_failed(done: usize, code: c_int, send_flags: c_int) -> Result<isize, Errno> {
    if done > 0 {
        return Ok(done as isize);
    }
    if code == libc::EPIPE && send_flags & libc::MSG_NOSIGNAL == 0 {
        // SAFETY: raising SIGPIPE, as the kernel does for a broken stream.
        unsafe { libc::raise(libc::SIGPIPE) };
    }
    Err(fail(code))
}

/// Waits (lock released while sleeping) until rendezvous send `ticket` completes: the bytes
/// it delivered, or the errno. `SO_SNDTIMEO` does not end the wait, and a signal only asks
/// the receiver to end the rendezvous with what it took: until the session reports
/// completion the peer may still be reading the application's buffer. An interrupted send
/// that delivered nothing fails with `EINTR`; otherwise it returns the short count, as a
/// kernel send interrupted after some progress does.
fn wait_send_rendezvous(index: u32, fd: c_int, ticket: SendTicket) -> Result<usize, c_int> {
    let mut stalled_since = None;
    let mut interrupted = false;
    let claim = claim_of(index);
    loop {
        if !still_claimed(index, claim) {
            return Err(libc::EBADF);
        }
        let wait = {
            let mut slot = lock(index);
            let Some(SanObject::Socket(socket)) = slot.as_mut() else {
                // Closed by another thread (its close drove the transfer to an end).
                return Err(libc::EBADF);
            };
            socket.service();
            if let Some(result) = socket.take_send_completion(ticket) {
                return match result {
                    Ok(0) if interrupted => Err(libc::EINTR),
                    other => other,
                };
            }
            // The completion message raises our writability (every message from the peer
            // does); unread data, which only the application can consume once this send
            // returns, must not keep the wait awake (but a stalled peer's is absorbed).
            match socket.blocked_send_wait(&mut stalled_since) {
                Some(wait) => Some(wait),
                None => continue,
            }
        };
        if block(index, fd, wait, None) == Err(libc::EINTR) && !interrupted {
            if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
                interrupted = socket.cancel_send_rendezvous();
            }
        }
    }
}
