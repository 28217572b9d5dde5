//! The data transfer hooks: `read`/`write` and their vector, message and FORTIFY forms
//! (`data_ops!`), the `*mmsg` calls, `sendfile` and `splice`.

use core::ffi::{c_int, c_uint, c_void};

use libc::{size_t, sockaddr, socklen_t, ssize_t};

use super::call::{data_call, iov_bufs, one_buf, san_data_call, san_recv, san_send};
use super::outcome::{Outcome, Why};
use crate::errno::Errno;
use crate::fdtable::table;
use crate::guard::{self, bookkeeping};
use crate::record::Counter;
use crate::san::RawBuf;
use crate::track::{count_bytes, decode_sockaddr, on_connect_started, tracked};
use crate::{errno, fault, real};

/// [`san_send`] of a caller's iovec array (or the errno reading it gave).
fn san_send_iov(
    fd: c_int,
    index: u32,
    bufs: Result<Vec<RawBuf>, Errno>,
    send_flags: c_int,
) -> Outcome<ssize_t> {
    match bufs {
        Ok(bufs) => san_send(fd, index, &bufs, send_flags),
        Err(errno) => Outcome::Failed(errno),
    }
}

/// [`san_recv`] into a caller's iovec array (or the errno reading it gave).
fn san_recv_iov(
    fd: c_int,
    index: u32,
    bufs: Result<Vec<RawBuf>, Errno>,
    recv_flags: c_int,
) -> Outcome<ssize_t> {
    match bufs {
        Ok(bufs) => san_recv(fd, index, &bufs, recv_flags),
        Err(errno) => Outcome::Failed(errno),
    }
}

/// The caller's message header, or `EFAULT` when the process may not read it.
///
/// # Safety
/// `msg` is the caller's pointer (it may be a bad address).
unsafe fn message_header(msg: *const libc::msghdr) -> Result<libc::msghdr, Errno> {
    // SAFETY: `msghdr` is plain C data; the read is guarded.
    unsafe { fault::read_app(msg) }.ok_or(Errno(libc::EFAULT))
}

/// A field of the caller's struct at `base` (which may be a bad address: nothing is read).
fn field<T, F>(base: *mut T, offset: usize) -> *mut F {
    base.cast::<u8>().wrapping_add(offset).cast()
}

/// After a receive on a connected TCP socket with `addr` given, the kernel reports no
/// source address: `*addrlen = 0` (untouched without `addr`). An `addrlen` the process may
/// not write turns the receive into `EFAULT`, its bytes consumed, as the kernel does.
///
/// # Safety
/// `addr` and `addrlen` are the caller's pointers (they may be bad addresses).
unsafe fn report_no_address(
    result: Outcome<ssize_t>,
    addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> Outcome<ssize_t> {
    if !matches!(result, Outcome::Done(_)) || addr.is_null() {
        return result;
    }
    // SAFETY: the caller's length, handed over to be written.
    match unsafe { fault::write_app(addrlen, 0) } {
        Ok(()) => result,
        Err(_) => Outcome::Failed(Errno(libc::EFAULT)),
    }
}

/// As [`data_call`] for the `*mmsg` calls, which return a message count.
#[inline(always)]
fn mmsg_call(
    fd: c_int,
    counter: Counter,
    msgvec: *const libc::mmsghdr,
    call: impl FnOnce() -> c_int,
) -> c_int {
    let entry = table().lookup(fd);
    let result = call();
    if !entry.is_none() && result > 0 && !msgvec.is_null() {
        // SAFETY: the kernel just filled `result` entries of the caller's vector.
        let messages = unsafe { core::slice::from_raw_parts(msgvec, result as usize) };
        let bytes = messages.iter().map(|m| u64::from(m.msg_len)).sum();
        count_bytes(entry, counter, bytes);
    }
    result
}

macro_rules! data_ops {
    ($( $name:ident($fd:ident $(, $arg:ident: $ty:ty)*) => $counter:ident, |$index:ident| $san:expr; )*) => {$(
        #[doc = concat!("`", stringify!($name), "`: counted per path for our sockets; SAN sockets go through the session.")]
        ///
        /// # Safety
        /// As the C function.
        #[inline(always)]
        #[allow(unused_unsafe)]
        pub unsafe fn $name($fd: c_int $(, $arg: $ty)*) -> ssize_t {
            data_call(
                $fd,
                Counter::$counter,
                // SAFETY: the arguments are the caller's, valid as for the C function.
                |$index| unsafe { $san },
                // SAFETY: forwarded.
                || unsafe { real::$name($fd $(, $arg)*) },
            )
        }
    )*};
}

data_ops! {
    // (`read` and `readv` of nothing answer 0 before they reach the socket, as the kernel's.)
    read(fd, buf: *mut c_void, count: size_t) => TcpReceived,
        |index| if count == 0 { Outcome::Done(0) } else { san_recv(fd, index, &one_buf(buf, count), 0) };
    readv(fd, iov: *const libc::iovec, iovcnt: c_int) => TcpReceived,
        |index| match iov_bufs(iov, iovcnt) {
            Ok(bufs) if bufs.iter().all(|b| b.len == 0) => Outcome::Done(0),
            bufs => san_recv_iov(fd, index, bufs, 0),
        };
    write(fd, buf: *const c_void, count: size_t) => TcpSent,
        |index| san_send(fd, index, &one_buf(buf, count), 0);
    writev(fd, iov: *const libc::iovec, iovcnt: c_int) => TcpSent,
        |index| san_send_iov(fd, index, iov_bufs(iov, iovcnt), 0);
    send(fd, buf: *const c_void, len: size_t, send_flags: c_int) => TcpSent,
        |index| san_send(fd, index, &one_buf(buf, len), send_flags);
    recv(fd, buf: *mut c_void, len: size_t, recv_flags: c_int) => TcpReceived,
        |index| san_recv(fd, index, &one_buf(buf, len), recv_flags);
    recvfrom(fd, buf: *mut c_void, len: size_t, recv_flags: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) => TcpReceived,
        |index| report_no_address(san_recv(fd, index, &one_buf(buf, len), recv_flags), addr, addrlen);
    recvmsg(fd, msg: *mut libc::msghdr, recv_flags: c_int) => TcpReceived,
        |index| match message_header(msg) {
            Err(errno) => Outcome::Failed(errno),
            Ok(header) => {
                let result = san_recv_iov(fd, index, iov_bufs(header.msg_iov, header.msg_iovlen as c_int), recv_flags);
                if let Outcome::Done(_) = result {
                    // No address, no control data, no flags; the header was readable, and a
                    // write that fails now (it changed under the call) is the kernel's EFAULT.
                    let written = fault::write_app(field::<_, socklen_t>(msg, core::mem::offset_of!(libc::msghdr, msg_namelen)), 0)
                        .and_then(|()| fault::write_app(field::<_, usize>(msg, core::mem::offset_of!(libc::msghdr, msg_controllen)), 0))
                        .and_then(|()| fault::write_app(field::<_, c_int>(msg, core::mem::offset_of!(libc::msghdr, msg_flags)), 0));
                    if written.is_err() {
                        return Outcome::Failed(Errno(libc::EFAULT));
                    }
                }
                result
            }
        };
    __read_chk(fd, buf: *mut c_void, nbytes: size_t, buflen: size_t) => TcpReceived,
        // An overflowing request goes to the real function, which aborts as it must.
        |index| if nbytes > buflen { Outcome::Bypass(Why::Fortify) } else if nbytes == 0 { Outcome::Done(0) } else { san_recv(fd, index, &one_buf(buf, nbytes), 0) };
    __recv_chk(fd, buf: *mut c_void, len: size_t, buflen: size_t, recv_flags: c_int) => TcpReceived,
        |index| if len > buflen { Outcome::Bypass(Why::Fortify) } else { san_recv(fd, index, &one_buf(buf, len), recv_flags) };
    __recvfrom_chk(fd, buf: *mut c_void, len: size_t, buflen: size_t, recv_flags: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) => TcpReceived,
        |index| if len > buflen { Outcome::Bypass(Why::Fortify) } else {
            report_no_address(san_recv(fd, index, &one_buf(buf, len), recv_flags), addr, addrlen)
        };
}

/// `sendmsg(2)`: counted; SAN sockets go through the session. Descriptors passed with
/// `SCM_RIGHTS` that are SAN sockets are downgraded to kernel TCP first (`downgrade_passed`).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendmsg(fd: c_int, msg: *const libc::msghdr, send_flags: c_int) -> ssize_t {
    // SAFETY: the caller's message.
    unsafe { downgrade_passed(msg) };
    data_call(
        fd,
        Counter::TcpSent,
        // SAFETY: the caller's message, valid as for the C function.
        |index| unsafe {
            match message_header(msg) {
                Err(errno) => Outcome::Failed(errno),
                Ok(header) => san_send_iov(
                    fd,
                    index,
                    iov_bufs(header.msg_iov, header.msg_iovlen as c_int),
                    send_flags,
                ),
            }
        },
        // SAFETY: forwarded.
        || unsafe { real::sendmsg(fd, msg, send_flags) },
    )
}

/// Before a message leaves with `SCM_RIGHTS`: a SAN socket among the passed descriptors is
/// downgraded to kernel TCP, live and exactly as before a fork, since the receiving process
/// (a worker handed accepted connections) reads and writes the kernel socket. With no SAN
/// socket alive, or no control data, this is two loads.
///
/// # Safety
/// `msg` is null or a valid message (the caller's contract with `sendmsg`).
unsafe fn downgrade_passed(msg: *const libc::msghdr) {
    if crate::san::live_sockets() == 0 || msg.is_null() || guard::is_inside() {
        return;
    }
    // A message or control buffer the process may not read is the kernel's to refuse
    // (`EFAULT`): they are read here through guarded copies, and walked in our copy.
    // SAFETY: the caller's pointer, read guardedly.
    let Ok(mut header) = (unsafe { message_header(msg) }) else {
        return;
    };
    // More than the kernel ever takes (its limit, `optmem_max`, is far below).
    const MOST_CONTROL: usize = 1 << 20;
    if header.msg_control.is_null()
        || header.msg_controllen == 0
        || header.msg_controllen > MOST_CONTROL
    {
        return;
    }
    let mut control = vec![0u8; header.msg_controllen];
    // SAFETY: `control` is ours, `msg_controllen` bytes; the source is the caller's.
    let copied = unsafe {
        fault::copy(
            control.as_mut_ptr(),
            header.msg_control.cast(),
            control.len(),
        )
    };
    if copied.is_err() {
        return;
    }
    header.msg_control = control.as_mut_ptr().cast();
    let msg = &header as *const libc::msghdr;
    let mut passed: Vec<u32> = Vec::new();
    // SAFETY: walking our copy of the control buffer with the libc macros, which stay inside
    // `msg_controllen`.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                let data = libc::CMSG_DATA(cmsg).cast::<c_int>();
                for position in 0..bytes / core::mem::size_of::<c_int>() {
                    let passed_fd = data.add(position).read_unaligned();
                    if let Some(index) =
                        crate::san::san_or_unclaimed_index(table().lookup(passed_fd))
                    {
                        passed.push(index);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(msg, cmsg);
        }
    }
    if passed.is_empty() {
        return;
    }
    bookkeeping(|| {
        let handed = |candidate: c_int| {
            crate::san::san_or_unclaimed_index(table().lookup(candidate))
                .is_some_and(|index| passed.contains(&index))
        };
        crate::san::downgrade_all(Some(&handed));
    });
}

/// `sendto(2)`: counted; with `MSG_FASTOPEN` it is also a connect (TCP Fast Open). On a SAN
/// socket the address is ignored, as the kernel ignores it on a connected TCP socket.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendto(
    fd: c_int,
    buf: *const c_void,
    len: size_t,
    send_flags: c_int,
    addr: *const sockaddr,
    addrlen: socklen_t,
) -> ssize_t {
    let sent = data_call(
        fd,
        Counter::TcpSent,
        |index| san_send(fd, index, &one_buf(buf, len), send_flags),
        // SAFETY: forwarded.
        || unsafe { real::sendto(fd, buf, len, send_flags, addr, addrlen) },
    );
    if send_flags & libc::MSG_FASTOPEN != 0 && !addr.is_null() {
        let in_progress = sent < 0 && errno::get() == libc::EINPROGRESS;
        if let (true, Some(entry)) = (sent >= 0 || in_progress, tracked(fd)) {
            // SAFETY: the kernel accepted (addr, addrlen) as the destination just now.
            let peer = unsafe { decode_sockaddr(addr, addrlen) };
            bookkeeping(|| on_connect_started(fd, entry, peer, in_progress));
        }
    }
    sent
}

/// `sendmmsg(2)`: on a SAN socket, each message is one `sendmsg`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: c_uint,
    send_flags: c_int,
) -> c_int {
    if crate::san::live_sockets() != 0 && !msgvec.is_null() {
        // Descriptors passed with SCM_RIGHTS in any of the messages.
        for position in 0..vlen.min(libc::UIO_MAXIOV as c_uint) as usize {
            // SAFETY: the caller's vector of `vlen` messages.
            unsafe { downgrade_passed(&raw const (*msgvec.add(position)).msg_hdr) };
        }
    }
    let entry = table().lookup(fd);
    if !entry.is_none() && !msgvec.is_null() {
        // SAFETY: the caller's vector of `vlen` messages.
        let san = |index| unsafe { san_mmsg(fd, index, msgvec, vlen, send_flags, true) };
        if let Ok(result) = san_data_call(entry, san).map(|n| n as c_int).returned() {
            return result;
        }
    }
    // SAFETY: forwarded.
    mmsg_call(fd, Counter::TcpSent, msgvec, || unsafe {
        real::sendmmsg(fd, msgvec, vlen, send_flags)
    })
}

/// `recvmmsg(2)`: on a SAN socket, each message is one `recvmsg` (the timeout is ignored, as
/// for a stream socket whose first receive returns).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn recvmmsg(
    fd: c_int,
    msgvec: *mut libc::mmsghdr,
    vlen: c_uint,
    recv_flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    let entry = table().lookup(fd);
    if !entry.is_none() && !msgvec.is_null() {
        // SAFETY: the caller's vector of `vlen` messages.
        let san = |index| unsafe { san_mmsg(fd, index, msgvec, vlen, recv_flags, false) };
        if let Ok(result) = san_data_call(entry, san).map(|n| n as c_int).returned() {
            return result;
        }
    }
    // SAFETY: forwarded.
    mmsg_call(fd, Counter::TcpReceived, msgvec, || unsafe {
        real::recvmmsg(fd, msgvec, vlen, recv_flags, timeout)
    })
}

/// The `*mmsg` calls on a SAN socket: messages in turn; after the first, only what is
/// available without blocking (as the kernel does for a stream socket).
///
/// # Safety
/// `msgvec` must point to `vlen` messages.
unsafe fn san_mmsg(
    fd: c_int,
    index: u32,
    msgvec: *mut libc::mmsghdr,
    vlen: c_uint,
    flags: c_int,
    sending: bool,
) -> Outcome<ssize_t> {
    let mut done = 0;
    for position in 0..vlen.min(libc::UIO_MAXIOV as c_uint) as usize {
        let entry = msgvec.wrapping_add(position);
        // SAFETY: the caller's vector, read guardedly (`mmsghdr` is plain C data).
        let Some(message) = (unsafe { fault::read_app(entry) }) else {
            return if done > 0 {
                Outcome::Done(done)
            } else {
                Outcome::Failed(Errno(libc::EFAULT))
            };
        };
        // SAFETY: the message's own iovec array (read guardedly).
        let bufs =
            unsafe { iov_bufs(message.msg_hdr.msg_iov, message.msg_hdr.msg_iovlen as c_int) };
        let flags = if done > 0 {
            flags | libc::MSG_DONTWAIT
        } else {
            flags
        };
        let outcome = if sending {
            san_send_iov(fd, index, bufs, flags)
        } else {
            san_recv_iov(fd, index, bufs, flags)
        };
        let result = match outcome {
            Outcome::Done(result) => result,
            Outcome::Failed(_) if done > 0 => return Outcome::Done(done),
            other => return other,
        };
        let length = field::<_, c_uint>(entry, core::mem::offset_of!(libc::mmsghdr, msg_len));
        // SAFETY: the caller's vector, whose entry was just readable, written guardedly.
        if unsafe { fault::write_app(length, result as c_uint) }.is_err() {
            // As the kernel: the messages before this one, or EFAULT.
            return if done > 0 {
                Outcome::Done(done)
            } else {
                Outcome::Failed(Errno(libc::EFAULT))
            };
        }
        done += 1;
        if !sending && result == 0 {
            break;
        }
    }
    Outcome::Done(done)
}

/// `sendfile(2)`: into a SAN socket, read from `in_fd` and sent through the session; otherwise
/// the kernel's, the bytes counted as TCP bytes of a target socket of ours.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendfile(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: forwarded.
    data_call(
        out_fd,
        Counter::TcpSent,
        // SAFETY: the caller's offset pointer, valid as for the C function.
        |index| unsafe { san_sendfile(out_fd, index, in_fd, offset, count) },
        // SAFETY: forwarded.
        || unsafe { real::sendfile(out_fd, in_fd, offset, count) },
    )
}

/// `sendfile64`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn sendfile64(
    out_fd: c_int,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> ssize_t {
    // SAFETY: forwarded.
    data_call(
        out_fd,
        Counter::TcpSent,
        // SAFETY: the caller's offset pointer, valid as for the C function.
        |index| unsafe { san_sendfile(out_fd, index, in_fd, offset, count) },
        // SAFETY: forwarded.
        || unsafe { real::sendfile64(out_fd, in_fd, offset, count) },
    )
}

/// `splice(2)`: with a SAN socket on either end, copied through a buffer, consuming exactly what
/// the target took; otherwise the kernel's, counted on both ends when they are ours.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn splice(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    splice_flags: c_uint,
) -> ssize_t {
    let in_entry = table().lookup(fd_in);
    // SAFETY: forwarded.
    // The kernel cannot splice a SAN stream: it is copied through a buffer instead.
    if !in_entry.is_none() {
        // SAFETY: the caller's offset pointer, as for the C function.
        let from_san =
            |index| unsafe { san_splice_out(fd_in, index, fd_out, off_out, len, splice_flags) };
        if let Ok(result) = san_data_call(in_entry, from_san).returned() {
            return result;
        }
    }
    let moved = data_call(
        fd_out,
        Counter::TcpSent,
        // SAFETY: the caller's offset pointer, as for the C function.
        |index| unsafe { san_splice_in(fd_in, off_in, fd_out, index, len, splice_flags) },
        // SAFETY: forwarded.
        || unsafe { real::splice(fd_in, off_in, fd_out, off_out, len, splice_flags) },
    );
    if moved > 0 && !in_entry.is_none() {
        count_bytes(in_entry, Counter::TcpReceived, moved as u64);
    }
    moved
}

/// `splice` out of a SAN socket into a pipe (or file): peeks up to `len` bytes, writes them
/// to `fd_out`, and consumes exactly what the target took, so nothing is lost on a short
/// write.
///
/// # Safety
/// `off_out` is the caller's (null, or a pointer that may be a bad address: `EFAULT`).
unsafe fn san_splice_out(
    fd_in: c_int,
    index: u32,
    fd_out: c_int,
    off_out: *mut libc::loff_t,
    len: size_t,
    splice_flags: c_uint,
) -> Outcome<ssize_t> {
    const CHUNK: usize = 64 << 10;
    // The kernel reads the offset first.
    let position = if off_out.is_null() {
        None
    } else {
        // SAFETY: the caller's offset, read guardedly.
        match unsafe { fault::read_app(off_out) } {
            Some(position) => Some(position),
            None => return Outcome::Failed(Errno(libc::EFAULT)),
        }
    };
    let mut chunk = vec![0u8; len.min(CHUNK)];
    let flags = if splice_flags & libc::SPLICE_F_NONBLOCK != 0 {
        libc::MSG_PEEK | libc::MSG_DONTWAIT
    } else {
        libc::MSG_PEEK
    };
    let peeked = match san_recv(
        fd_in,
        index,
        &one_buf(chunk.as_ptr().cast(), chunk.len()),
        flags,
    ) {
        Outcome::Done(0) => return Outcome::Done(0),
        Outcome::Done(peeked) => peeked,
        other => return other,
    };
    let mut offset_written = Ok(());
    let written = match position {
        // SAFETY: `chunk` holds `peeked` bytes.
        None => unsafe { libc::write(fd_out, chunk.as_ptr().cast(), peeked as usize) },
        Some(position) => {
            // SAFETY: as above.
            let n =
                unsafe { libc::pwrite64(fd_out, chunk.as_ptr().cast(), peeked as usize, position) };
            if n > 0 {
                // SAFETY: the caller's offset, written guardedly.
                offset_written = unsafe { fault::write_app(off_out, position + n as i64) };
            }
            n
        }
    };
    if written <= 0 {
        return Outcome::from_kernel(written);
    }
    chunk.truncate(written as usize);
    let moved = san_recv(
        fd_in,
        index,
        &one_buf(chunk.as_mut_ptr().cast(), chunk.len()),
        0,
    );
    // As the kernel: the bytes moved, then the offset could not be written back.
    match offset_written {
        Ok(()) => moved,
        Err(_) => Outcome::Failed(Errno(libc::EFAULT)),
    }
}

/// `splice` from a pipe (or file) into a SAN socket: one chunk read, then sent in full.
///
/// # Safety
/// `off_in` is the caller's (null, or a pointer that may be a bad address: `EFAULT`).
unsafe fn san_splice_in(
    fd_in: c_int,
    off_in: *mut libc::loff_t,
    fd_out: c_int,
    index: u32,
    len: size_t,
    _splice_flags: c_uint,
) -> Outcome<ssize_t> {
    // SAFETY: `off_in` is the same kind of pointer sendfile takes, valid per the contract.
    unsafe { san_sendfile(fd_out, index, fd_in, off_in, len) }
}

/// `sendfile` into a SAN socket: one chunk read from `in_fd` (at `*offset` when given, which
/// then advances by what was sent) and sent through the session. Short counts are allowed.
///
/// # Safety
/// `offset` is the caller's (null, or a pointer that may be a bad address: `EFAULT`, as the
/// kernel reads it first and writes it back last).
unsafe fn san_sendfile(
    out_fd: c_int,
    index: u32,
    in_fd: c_int,
    offset: *mut libc::off64_t,
    count: size_t,
) -> Outcome<ssize_t> {
    const CHUNK: usize = 64 << 10;
    let mut position = if offset.is_null() {
        None
    } else {
        // SAFETY: the caller's offset, read guardedly.
        match unsafe { fault::read_app(offset) } {
            Some(position) => Some(position),
            None => return Outcome::Failed(Errno(libc::EFAULT)),
        }
    };
    // Never zeroed: the reads fill what is sent. (Sending from a read-only mapping of the
    // file instead, one copy fewer, measured slower: nginx's 64 KiB responses took half as
    // much CPU again, the mapping's set-up, faults and TLB shootdown outweighing the copy.)
    // (Allocated when first needed: the in-place path reads into the session.)
    let mut chunk: Vec<u8> = Vec::new();
    // As the kernel's: as much as the socket takes, up to `count`. A short count must mean
    // "no room now" (an edge-triggered caller then waits for EPOLLOUT, as nginx does), so
    // one chunk is not where it stops.
    let mut total: usize = 0;
    while total < count {
        let want = (count - total).min(CHUNK);
        if let Some(at) = position {
            // The common case (nginx passes an offset): straight from the file into the
            // peer's slots (or the send buffer), with no buffer of ours in between.
            if let Some(sent) = crate::san::send_file_in_place(index, in_fd, at, want) {
                let at = at + sent as i64;
                position = Some(at);
                // SAFETY: the caller's offset (readable at the start), written guardedly.
                if unsafe { fault::write_app(offset, at) }.is_err() {
                    return Outcome::Failed(Errno(libc::EFAULT));
                }
                // (Fewer than asked: the rest was not taken in place, and the next round
                // sends it or finds that there is no room.)
                total += sent;
                continue;
            }
        }
        if chunk.capacity() < want {
            chunk.reserve_exact(want);
        }
        let read = match position {
            // SAFETY: `chunk` has room for `want <= capacity` bytes; the kernel writes them
            // and only the `read` it reports are used.
            None => unsafe { libc::read(in_fd, chunk.as_mut_ptr().cast(), want) },
            // SAFETY: as above.
            Some(at) => unsafe { libc::pread64(in_fd, chunk.as_mut_ptr().cast(), want, at) },
        };
        if read <= 0 {
            return if total > 0 {
                Outcome::Done(total as ssize_t)
            } else {
                Outcome::from_kernel(read)
            };
        }
        let bufs = one_buf(chunk.as_ptr().cast(), read as usize);
        let sent = match san_send(out_fd, index, &bufs, 0) {
            Outcome::Done(sent) => sent,
            Outcome::Bypass(why) => {
                // No longer a SAN socket (downgraded meanwhile): the caller's kernel path
                // sends the rest; give back what was read and not sent.
                if offset.is_null() {
                    // SAFETY: plain lseek on the caller's fd.
                    unsafe { libc::lseek64(in_fd, -(read as i64), libc::SEEK_CUR) };
                }
                return if total > 0 {
                    Outcome::Done(total as ssize_t)
                } else {
                    Outcome::Bypass(why)
                };
            }
            Outcome::Failed(errno) => {
                // Nothing of this read was sent: the file position stays where it was.
                if offset.is_null() {
                    // SAFETY: plain lseek on the caller's fd.
                    unsafe { libc::lseek64(in_fd, -(read as i64), libc::SEEK_CUR) };
                }
                return if total > 0 {
                    Outcome::Done(total as ssize_t)
                } else {
                    Outcome::Failed(errno)
                };
            }
        };
        match position.as_mut() {
            None => {
                // Give back what was read but not sent, so the file position matches.
                if sent < read {
                    // SAFETY: plain lseek on the caller's fd.
                    unsafe { libc::lseek64(in_fd, sent as i64 - read as i64, libc::SEEK_CUR) };
                }
            }
            Some(at) => {
                *at += sent as i64;
                // SAFETY: the caller's offset (readable at the start), written guardedly.
                if unsafe { fault::write_app(offset, *at) }.is_err() {
                    return Outcome::Failed(Errno(libc::EFAULT));
                }
            }
        }
        total += sent as usize;
        if sent < read {
            break;
        }
    }
    Outcome::Done(total as ssize_t)
}
