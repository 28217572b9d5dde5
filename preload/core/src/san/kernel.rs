//! The kernel side of the SAN path's calls: the application's I/O vectors (copied only
//! through [`AppBufs`], which answers `EFAULT` for a bad buffer), nonblocking TCP reads and
//! writes on its socket (the pending client's counted bytes, the acceptor's pre-switch
//! bytes, a downgraded stream's continuation), socket options and names, and file
//! identities. Plain system calls through the real symbols; no SAN state.

use core::cell::Cell;
use core::ffi::c_int;
use std::net::SocketAddr;
use std::time::Duration;

use crate::errno::Errno;
use crate::fault::{self, Fault};
use crate::real;
use crate::record::Counter;
use crate::registry::registry;
use san_api::{AppSink, AppSource, BadAddress};

/// How long a graceful close may wait for queued data to leave when `SO_LINGER` is off.
pub(super) const DEFAULT_LINGER: Duration = Duration::from_secs(2);

/// One buffer of an I/O vector, as raw parts (the hooks' callers own the memory). It has the
/// layout of a `struct iovec`, so the application's vector is copied into `RawBuf`s as it is.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct RawBuf {
    /// Start.
    pub ptr: *mut u8,
    /// Length.
    pub len: usize,
}

/// The application's buffers `bufs` from byte `start` of the vector on, `len` bytes: the
/// source of a send or the sink of a receive. Every copy goes through [`fault::copy`], so a
/// buffer the process may not access is `EFAULT` instead of a crash (a null pointer too, as
/// the kernel has it); where the first fault was is kept ([`AppBufs::readable`]).
pub(super) struct AppBufs<'a> {
    bufs: &'a [RawBuf],
    start: usize,
    len: usize,
    /// Bytes of this view before the first fault seen.
    fault: Cell<Option<usize>>,
}

impl<'a> AppBufs<'a> {
    /// `len` bytes of `bufs` from byte `start` on (cut to what they hold).
    pub(super) fn new(bufs: &'a [RawBuf], start: usize, len: usize) -> AppBufs<'a> {
        let total: usize = bufs.iter().map(|b| b.len).fold(0, usize::saturating_add);
        let start = start.min(total);
        AppBufs {
            bufs,
            start,
            len: len.min(total - start),
            fault: Cell::new(None),
        }
    }

    /// Every byte of `bufs` after the first `done`.
    pub(super) fn rest(bufs: &'a [RawBuf], done: usize) -> AppBufs<'a> {
        AppBufs::new(bufs, done, usize::MAX)
    }

    /// After a copy failed: how many bytes of this view, from its start, the process could
    /// access before the first fault.
    pub(super) fn readable(&self) -> usize {
        self.fault.get().unwrap_or(0)
    }

    /// Runs `copy(address, at, n)` for each buffer piece under `[offset, offset + n)` of this
    /// view (`at`: the piece's place in that range); the first fault stops it.
    fn walk(
        &self,
        offset: usize,
        n: usize,
        mut copy: impl FnMut(*mut u8, usize, usize) -> Result<(), Fault>,
    ) -> Result<(), BadAddress> {
        let mut skip = self.start + offset;
        let mut at = 0;
        for buf in self.bufs {
            if at == n {
                break;
            }
            if skip >= buf.len {
                skip -= buf.len;
                continue;
            }
            let take = (buf.len - skip).min(n - at);
            let piece = buf.ptr.wrapping_add(skip);
            let outcome = if buf.ptr.is_null() {
                Err(Fault {
                    address: piece as usize,
                })
            } else {
                copy(piece, at, take)
            };
            if let Err(fault) = outcome {
                // The bytes of this piece before the faulting address were accessible.
                let before = fault
                    .address
                    .checked_sub(piece as usize)
                    .filter(|&before| before < take)
                    .unwrap_or(0);
                let readable = offset + at + before;
                self.fault.set(Some(
                    self.fault.get().map_or(readable, |seen| seen.min(readable)),
                ));
                return Err(BadAddress);
            }
            at += take;
            skip = 0;
        }
        Ok(())
    }
}

impl AppSource for AppBufs<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
        let target = dst.as_mut_ptr();
        self.walk(offset, dst.len(), |piece, at, n| {
            // SAFETY: `dst` is our slice with `at + n` bytes; the piece is the application's
            // buffer, handed to this send (a fault is reported, not taken).
            unsafe { fault::copy(target.add(at), piece, n) }
        })
    }

    fn placement(&self, offset: usize) -> usize {
        let mut skip = self.start + offset;
        for buf in self.bufs {
            if skip < buf.len {
                return buf.ptr.wrapping_add(skip) as usize;
            }
            skip -= buf.len;
        }
        0
    }
}

/// `len` bytes of a file from offset `at`, as a source a send copies out of with `pread`
/// (`preadv` for several destinations): `sendfile` fills the peer's receive slots, or the
/// session's send buffer, straight from the page cache, with no buffer of ours in between. A
/// read that comes up short (the file shrank meanwhile) or fails is a failed copy, and a
/// failed copy queues nothing.
pub(crate) struct FileRange {
    pub fd: c_int,
    pub at: i64,
    pub len: usize,
}

impl AppSource for FileRange {
    fn len(&self) -> usize {
        self.len
    }

    fn placement(&self, offset: usize) -> usize {
        (self.at as usize).wrapping_add(offset)
    }

    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
        let mut done = 0;
        while done < dst.len() {
            let Some(at) = i64::try_from(offset + done)
                .ok()
                .and_then(|o| self.at.checked_add(o))
            else {
                return Err(BadAddress);
            };
            let rest = &mut dst[done..];
            // SAFETY: `rest` is our own writable slice of `rest.len()` bytes.
            let read = unsafe { libc::pread64(self.fd, rest.as_mut_ptr().cast(), rest.len(), at) };
            if read > 0 {
                done += read as usize;
            } else if read < 0 && Errno::last().0 == libc::EINTR {
                continue;
            } else {
                return Err(BadAddress);
            }
        }
        Ok(())
    }

    /// One `preadv` for all of `dsts` (the peer's slots of a file sent straight into them):
    /// one system call and one copy, page cache to slot (a read per slot cost more system
    /// calls than the copy it saved).
    fn copy_to_each(&self, offset: usize, dsts: &mut [&mut [u8]]) -> Result<(), BadAddress> {
        const MOST_AT_ONCE: usize = 16;
        let mut at = offset;
        for group in dsts.chunks_mut(MOST_AT_ONCE) {
            let mut iovecs = [libc::iovec {
                iov_base: core::ptr::null_mut(),
                iov_len: 0,
            }; MOST_AT_ONCE];
            for (iovec, dst) in iovecs.iter_mut().zip(group.iter_mut()) {
                iovec.iov_base = dst.as_mut_ptr().cast();
                iovec.iov_len = dst.len();
            }
            let iovecs = &mut iovecs[..group.len()];
            let wanted: usize = iovecs.iter().map(|v| v.iov_len).sum();
            // The vector's unread rest: a short read (a signal, a file that grew less than
            // fast) goes on from where it stopped.
            let mut first = 0usize;
            let mut done = 0usize;
            while done < wanted {
                let Some(position) = i64::try_from(at + done)
                    .ok()
                    .and_then(|o| self.at.checked_add(o))
                else {
                    return Err(BadAddress);
                };
                let rest = &iovecs[first..];
                // SAFETY: every iovec names our own writable slice (`dsts`), borrowed
                // exclusively for this call; the kernel writes at most their lengths.
                let read = unsafe {
                    libc::preadv64(self.fd, rest.as_ptr(), rest.len() as c_int, position)
                };
                if read > 0 {
                    let mut read = read as usize;
                    done += read;
                    while read > 0 {
                        let iovec = &mut iovecs[first];
                        if read < iovec.iov_len {
                            iovec.iov_base = iovec.iov_base.cast::<u8>().wrapping_add(read).cast();
                            iovec.iov_len -= read;
                            read = 0;
                        } else {
                            read -= iovec.iov_len;
                            first += 1;
                        }
                    }
                } else if read < 0 && Errno::last().0 == libc::EINTR {
                    continue;
                } else {
                    return Err(BadAddress);
                }
            }
            at += wanted;
        }
        Ok(())
    }
}

impl AppSink for AppBufs<'_> {
    fn len(&self) -> usize {
        self.len
    }

    fn copy_from(&mut self, offset: usize, src: &[u8]) -> Result<(), BadAddress> {
        self.walk(offset, src.len(), |piece, at, n| {
            // SAFETY: the piece is the application's buffer, handed to this receive to be
            // written (a fault is reported, not taken); `src` is ours with `at + n` bytes.
            unsafe { fault::copy(piece, src.as_ptr().add(at), n) }
        })
    }
}

const _: () = assert!(
    core::mem::size_of::<RawBuf>() == core::mem::size_of::<libc::iovec>()
        && core::mem::align_of::<RawBuf>() == core::mem::align_of::<libc::iovec>()
        && core::mem::offset_of!(RawBuf, len) == core::mem::offset_of!(libc::iovec, iov_len)
);

/// Plain C data a socket option is read into: every bit pattern (all zeroes included) is a
/// valid value, so [`socket_option`] may start from zeroes and keep what the kernel wrote.
pub(super) trait OptionValue: Copy {}
impl OptionValue for c_int {}
impl OptionValue for libc::linger {}
impl OptionValue for libc::tcp_info {}

/// `getsockopt(fd, level, name)` through the real symbol, into a zeroed `T` (a kernel that
/// writes less, an older `tcp_info`, leaves the rest zero); `None` when the call failed.
pub(super) fn socket_option<T: OptionValue>(fd: c_int, level: c_int, name: c_int) -> Option<T> {
    let mut value = core::mem::MaybeUninit::<T>::zeroed();
    let mut len = core::mem::size_of::<T>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `value`.
    let rc = unsafe { real::getsockopt(fd, level, name, value.as_mut_ptr().cast(), &mut len) };
    // SAFETY: zero-initialised, and zeroes (or the kernel's bytes over them) are a valid `T`
    // (`OptionValue`).
    (rc == 0).then(|| unsafe { value.assume_init() })
}

/// `SO_LINGER` of `fd`: (abortive close, how long a graceful close may wait).
pub(super) fn linger_of(fd: c_int) -> (bool, Duration) {
    match socket_option::<libc::linger>(fd, libc::SOL_SOCKET, libc::SO_LINGER) {
        Some(value) if value.l_onoff != 0 && value.l_linger == 0 => (true, Duration::ZERO),
        Some(value) if value.l_onoff != 0 => {
            (false, Duration::from_secs(value.l_linger.max(0) as u64))
        }
        _ => (false, DEFAULT_LINGER),
    }
}

/// One nonblocking `sendmsg` of the caller's buffers from offset `done` on TCP, counted in
/// socket `index`'s record: the bytes sent, or the errno of the call. Nothing sent counts as
/// a result only when nothing was asked for; otherwise it is the call's errno.
pub(super) fn send_on_tcp(
    fd: c_int,
    index: u32,
    bufs: &[RawBuf],
    done: usize,
    send_flags: c_int,
) -> Result<usize, Errno> {
    let mut iov = remaining_iov(bufs, done);
    let asked: usize = iov.iter().map(|v| v.iov_len).fold(0, usize::saturating_add);
    // SAFETY: plain data, zero is valid.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: `msg` describes the caller's buffers (valid for the call).
    let n = unsafe { real::sendmsg(fd, &msg, send_flags | libc::MSG_DONTWAIT) };
    if n < 0 || (n == 0 && asked > 0) {
        return Err(Errno::last());
    }
    if n > 0 {
        if let Some(record) = registry().get(index) {
            record.count(Counter::TcpSent, n as u64);
        }
    }
    Ok(n as usize)
}

/// The part of `bufs` after the first `done` bytes, as iovecs (for system calls).
fn remaining_iov(bufs: &[RawBuf], done: usize) -> Vec<libc::iovec> {
    remaining_pieces(bufs, done).collect()
}

/// The part of `bufs` after the first `done` bytes, one iovec per buffer, without
/// allocating (the data calls' copies walk it).
pub(super) fn remaining_pieces(
    bufs: &[RawBuf],
    mut done: usize,
) -> impl Iterator<Item = libc::iovec> + '_ {
    bufs.iter().filter_map(move |buf| {
        if done >= buf.len {
            done -= buf.len;
            return None;
        }
        let skip = core::mem::take(&mut done);
        Some(libc::iovec {
            // SAFETY: `skip < len`, so the offset stays inside the caller's buffer.
            iov_base: unsafe { buf.ptr.add(skip) }.cast(),
            iov_len: buf.len - skip,
        })
    })
}

/// The next contiguous piece of `bufs` after `done` bytes.
pub(super) fn next_piece<'a>(bufs: &[RawBuf], mut done: usize) -> &'a [u8] {
    for buf in bufs {
        if done >= buf.len {
            done -= buf.len;
            continue;
        }
        if buf.ptr.is_null() {
            return &[];
        }
        // SAFETY: the caller's buffer is readable for its length for the duration of the
        // hook call; `done < len`.
        return unsafe { core::slice::from_raw_parts(buf.ptr.add(done), buf.len - done) };
    }
    &[]
}

/// How many of the application's `len` bytes at `start` the process may read (`write`: and
/// write), before the first that it may not: each page is touched once (read, and with
/// `write` the byte written back as it was), before a zero-copy transfer hands the range to
/// the provider, which would meet a bad page mid-transfer. A page that changes under the
/// call meanwhile is the application's race, as with the kernel.
pub(super) fn accessible_prefix(start: *mut u8, len: usize, write: bool) -> usize {
    const PAGE: usize = 4096;
    let mut offset = 0;
    while offset < len {
        let at = start.wrapping_add(offset);
        let mut byte = 0u8;
        // SAFETY: one byte of the application's buffer into ours, and back to where it was
        // (the receive is about to overwrite it anyway); both copies are guarded.
        let touched = unsafe {
            fault::copy(&mut byte, at, 1).and_then(|()| {
                if write {
                    fault::copy(at, &byte, 1)
                } else {
                    Ok(())
                }
            })
        };
        if touched.is_err() {
            return offset;
        }
        // The next page's first byte.
        offset += PAGE - (at as usize % PAGE);
    }
    len
}

/// Copies `data` into `bufs` after the first `done` bytes (as far as they reach); `Err` when
/// the application's buffers could not all be written.
pub(super) fn scatter(bufs: &[RawBuf], done: usize, data: &[u8]) -> Result<(), BadAddress> {
    let mut sink = AppBufs::rest(bufs, done);
    let n = data.len().min(AppSink::len(&sink));
    sink.copy_from(0, &data[..n])
}

/// Reads TCP bytes (at most `limit`) into `bufs` after `done`, nonblocking: the bytes read
/// (0: end of stream), or the errno of the call.
pub(super) fn recv_tcp(
    fd: c_int,
    bufs: &[RawBuf],
    done: usize,
    limit: u64,
    recv_flags: c_int,
) -> Result<usize, Errno> {
    let mut iov = remaining_iov(bufs, done);
    let mut left = usize::try_from(limit).unwrap_or(usize::MAX);
    iov.retain_mut(|v| {
        let keep = left > 0;
        v.iov_len = v.iov_len.min(left);
        left -= v.iov_len;
        keep
    });
    // SAFETY: plain data, zero is valid.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: `msg` describes the caller's buffers.
    let n = unsafe {
        real::recvmsg(
            fd,
            &mut msg,
            (recv_flags & !libc::MSG_WAITALL) | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).map_err(|_| Errno::last())
}

/// The rest of a `MSG_WAITALL` read after `done` bytes, from TCP with the caller's flags
/// (so it blocks, times out or answers `EAGAIN` as the kernel socket does): the bytes read
/// now, 0 when none could be (end of stream, error or signal: the caller returns `done`).
/// Whether a read of TCP socket `fd` would return at once now (bytes, end of stream or an
/// error): one zero-timeout `poll`.
pub(super) fn tcp_readable_now(fd: c_int) -> bool {
    let mut entry = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd, zero timeout.
    let rc = unsafe { real::poll(&mut entry, 1, 0) };
    rc > 0 && entry.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

pub(super) fn recv_tcp_rest(fd: c_int, bufs: &[RawBuf], done: usize, recv_flags: c_int) -> usize {
    let mut iov = remaining_iov(bufs, done);
    if iov.is_empty() {
        return 0;
    }
    // SAFETY: plain data, zero is valid.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    // SAFETY: `msg` describes the caller's buffers.
    let n = unsafe { real::recvmsg(fd, &mut msg, recv_flags) };
    usize::try_from(n).unwrap_or(0)
}

/// Writes `bytes` on TCP (nonblocking, waiting for room up to a second at a time, at most ten
/// times); returns how many went out.
pub(super) fn send_all_on_tcp(fd: c_int, bytes: &[u8]) -> usize {
    let mut sent = 0;
    for _ in 0..10 {
        while sent < bytes.len() {
            // SAFETY: the rest of our buffer.
            let n = unsafe {
                real::send(
                    fd,
                    bytes[sent..].as_ptr().cast(),
                    bytes.len() - sent,
                    libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
                )
            };
            if n <= 0 {
                break;
            }
            sent += n as usize;
        }
        if sent == bytes.len() {
            break;
        }
        let mut entry = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        // SAFETY: one pollfd.
        unsafe { real::poll(&mut entry, 1, 1000) };
    }
    sent
}

/// The source address the kernel will pick for a connection to `peer` (the routing decision
/// of a connected UDP socket, which sends nothing).
pub(super) fn route_source(peer: SocketAddr) -> Option<std::net::IpAddr> {
    let domain = if peer.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2).
    let raw = unsafe { libc::socket(domain, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return None;
    }
    // SAFETY: `raw` was just returned by socket() and is owned by nobody else.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    let (storage, len) = crate::discovery::socket_addr_to_raw(peer);
    // SAFETY: `storage` holds a valid address of length `len`.
    let rc = unsafe { libc::connect(raw, (&storage as *const libc::sockaddr_storage).cast(), len) };
    if rc != 0 {
        return None;
    }
    let local = socket_name(std::os::fd::AsRawFd::as_raw_fd(&socket))?;
    Some(local.ip())
}

pub(super) fn socket_name(fd: c_int) -> Option<SocketAddr> {
    // SAFETY: zeroed storage is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { core::mem::zeroed() };
    let mut len = core::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `storage`.
    if unsafe {
        crate::real::getsockname(
            fd,
            (&mut storage as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    } != 0
    {
        return None;
    }
    crate::discovery::socket_addr_from_raw(&storage, len).ok()
}

/// (file type bits, inode) of what is open on `fd`.
pub(super) fn file_inode(fd: c_int) -> Option<(libc::mode_t, u64)> {
    // SAFETY: an all-zero `struct stat` is valid; fstat writes one.
    let mut st: libc::stat = unsafe { core::mem::zeroed() };
    // SAFETY: fstat(2) writes one `struct stat`.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some((st.st_mode & libc::S_IFMT, st.st_ino))
}

/// The inode of the socket open on `fd` (`None`: not open, or not a socket).
pub(super) fn socket_inode(fd: c_int) -> Option<u64> {
    file_inode(fd)
        .filter(|&(kind, _)| kind == libc::S_IFSOCK)
        .map(|(_, inode)| inode)
}

/// A SAN call fails with `code`: the errno its caller reports (the thread's `errno` is left
/// alone; the hook sets it when it returns).
pub(super) fn fail(code: c_int) -> Errno {
    if code != libc::EAGAIN {
        tracing::debug!(errno = code, "SAN call fails");
    }
    Errno(code)
}

/// A SAN call that moved `done` bytes before `code` stopped it: the count if any, else the
/// failure.
pub(super) fn partial(done: usize, code: c_int) -> Result<isize, Errno> {
    if done > 0 {
        Ok(done as isize)
    } else {
        Err(fail(code))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    fn file_of(bytes: &[u8], name: &str) -> std::fs::File {
        let path = std::env::temp_dir().join(format!(
            "sandirect-file-range-{name}-{}",
            std::process::id()
        ));
        let mut file = std::fs::File::create(&path).unwrap();
        file.write_all(bytes).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        file
    }

    /// Several destinations are filled in order from the file's bytes at the range's offset
    /// plus the copy's, across page boundaries and however the destinations are cut.
    #[test]
    fn a_file_range_fills_several_destinations_in_order() {
        let bytes: Vec<u8> = (0..70_000u32).map(|i| (i * 131 % 251) as u8).collect();
        let file = file_of(&bytes, "fill");
        let range = FileRange {
            fd: file.as_raw_fd(),
            at: 1000,
            len: 60_000,
        };
        let mut first = vec![0u8; 16_384];
        let mut second = vec![0u8; 1];
        let mut third = vec![0u8; 20_000];
        let mut dsts: [&mut [u8]; 3] = [&mut first, &mut second, &mut third];
        assert_eq!(range.copy_to_each(500, &mut dsts), Ok(()));
        let start = 1000 + 500;
        assert_eq!(first, bytes[start..start + 16_384]);
        assert_eq!(second, bytes[start + 16_384..start + 16_385]);
        assert_eq!(third, bytes[start + 16_385..start + 36_385]);
        // A single destination reads the same bytes as the vectored read.
        let mut one = vec![0u8; 36_385];
        assert_eq!(range.copy_to(500, &mut one), Ok(()));
        assert_eq!(one, bytes[start..start + 36_385]);
    }

    /// A file that ends before the destinations do (it shrank meanwhile) is a failed copy.
    #[test]
    fn a_file_range_past_the_end_of_its_file_fails() {
        let file = file_of(&[7u8; 5000], "short");
        let range = FileRange {
            fd: file.as_raw_fd(),
            at: 0,
            len: 8192,
        };
        let mut first = vec![0u8; 4096];
        let mut second = vec![0u8; 4096];
        let mut dsts: [&mut [u8]; 2] = [&mut first, &mut second];
        assert_eq!(range.copy_to_each(0, &mut dsts), Err(BadAddress));
    }
}
