//! Readiness of SAN sockets to `poll`, `select` and `epoll`: a switched socket is watched
//! through its mirror's watched end in place of its TCP socket, a stash holder through its stash's
//! eventfd, and what the kernel reports is corrected to agree with the session (no
//! readability without data; errors and RDHUP, which a mirror cannot show); `FIONREAD`.

use core::ffi::c_int;
use core::sync::atomic::Ordering;

use super::downgrade;
use super::outcome::SanCall;
use super::socket::Phase;
use super::switchover::{
    assist_all_in_process, assist_in_process_peer, switch_if_attached, switch_pending,
};
use super::table::{lock, orphaned, san_index, SanObject, LIVE};
use crate::errno::Errno;
use crate::real;
use crate::record::flags;
use crate::registry::registry;

/// `poll()`/`ppoll()` on a set containing SAN sockets: each switched SAN socket's entry is
/// watched through its mirror's watched end (the caller polls `fds` as rewritten, then calls
/// [`poll_fds`] again with `restore` to put the application's fds back).
///
/// Returns the original fds of the rewritten entries (to restore), or an empty vector when
/// nothing was rewritten.
pub fn poll_fds(
    fds: &mut [libc::pollfd],
    restore: Option<&[(usize, c_int)]>,
) -> Vec<(usize, c_int)> {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("poll_fds");
    if let Some(saved) = restore {
        for &(position, fd) in saved {
            if let Some(entry) = fds.get_mut(position) {
                entry.fd = fd;
                correct_revents(entry);
            }
        }
        return Vec::new();
    }
    let mut saved = Vec::new();
    if LIVE.load(Ordering::Relaxed) == 0 {
        return saved;
    }
    // A set without SAN sockets is not ours to drive: no allocation, no lock (the in-process
    // assist matters only to a wait that depends on a SAN socket).
    let mut assisted = false;
    for (position, entry) in fds.iter_mut().enumerate() {
        let Some(index) = san_index(crate::fdtable::table().lookup(entry.fd)) else {
            continue;
        };
        if !assisted {
            assisted = true;
            assist_all_in_process();
        }
        if orphaned(index) {
            continue;
        }
        switch_pending(entry.fd, index);
        let mut slot = lock(index);
        downgrade::settle(entry.fd, index, &mut slot);
        let mirror = match slot.as_mut() {
            Some(SanObject::Socket(socket))
                if socket.phase == Phase::Switched && !socket.epoll_on_tcp =>
            {
                socket.set_watched();
                // (The service thread must hear of arrivals while this thread sleeps.)
                socket.settle_direct_wait();
                socket.mirror_fd()
            }
            // Bytes in the stash: its eventfd (readable) stands in; the socket's own state
            // is added back afterwards.
            Some(SanObject::Stashed(stashed))
                if stashed.stash.remaining() > 0 && entry.events & libc::POLLIN != 0 =>
            {
                Some(stashed.stash.ready_fd())
            }
            _ => None,
        };
        drop(slot);
        if let Some(mirror) = mirror {
            saved.push((position, entry.fd));
            entry.fd = mirror;
        }
    }
    saved
}

/// Makes a SAN entry's `revents` (as the mirror reported them) agree with the session: a
/// spurious IN (a token for a handshake or a credit, no data) is lowered and dropped; ERR and
/// RDHUP, which the mirror cannot show, are added from the session's state.
fn correct_revents(entry: &mut libc::pollfd) {
    let Some(index) = san_index(crate::fdtable::table().lookup(entry.fd)) else {
        return;
    };
    let mut slot = lock(index);
    if let Some(SanObject::Stashed(_)) = slot.as_ref() {
        // The eventfd said "stash readable"; the rest is the socket's own state now.
        let mut own = libc::pollfd {
            fd: entry.fd,
            events: entry.events,
            revents: 0,
        };
        // SAFETY: one pollfd, zero timeout.
        unsafe { real::poll(&mut own, 1, 0) };
        entry.revents = own.revents | (entry.revents & libc::POLLIN);
        return;
    }
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return;
    };
    if socket.epoll_on_tcp {
        return;
    }
    if entry.revents & libc::POLLHUP != 0 {
        socket.mirror_hung_up();
    }
    socket.service();
    let readiness = socket.readiness();
    if entry.revents & libc::POLLIN != 0
        && !readiness.readable
        && !socket.tcp_bytes_pending()
        && socket.lower_readable()
    {
        entry.revents &= !libc::POLLIN;
    }
    if readiness.error {
        entry.revents |= libc::POLLERR;
    }
    if readiness.read_hup && entry.events & libc::POLLRDHUP != 0 {
        entry.revents |= libc::POLLRDHUP;
    }
    entry.revents = socket.correct_close_bits(entry.revents as u16 as u32) as u16 as i16;
}

/// After `epoll_wait` returned `events` for `epfd`: a SAN socket reported readable only
/// because of a handshake or credit token (no data, no FIN) has its mirror lowered and the
/// IN bit dropped, as `correct_revents` does for `poll`; events left empty are removed.
/// Returns the new count. A level-triggered reader then never sees readiness without data
/// (strict clients such as wrk treat that `EAGAIN` as an error).
///
/// With `deferred`, a socket under lazy lowering (see `SanSocket::lazy_lowering`) is not
/// lowered here: its event is dropped and its index noted, for the wait to look for its next
/// message first ([`look_for_messages`]) and lower it only before it sleeps
/// ([`lower_deferred`]).
pub fn correct_epoll_events(
    epfd: c_int,
    events: &mut [libc::epoll_event],
    mut deferred: Option<&mut Deferred>,
) -> usize {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("correct_epoll_events");
    if LIVE.load(Ordering::Relaxed) == 0 {
        return events.len();
    }
    let mut kept = 0;
    for position in 0..events.len() {
        let mut event = events[position];
        if event.events & libc::EPOLLIN as u32 != 0 {
            let data = event.u64;
            let found = super::epoll_index::lookup(epfd, data).filter(|&index| {
                registry().get(index).is_some_and(|record| {
                    record.flags() & flags::SAN != 0
                        && record
                            .epoll_registrations()
                            .any(|(e, _, d)| e == epfd && d == data)
                })
            });
            if let Some(index) = found.filter(|&index| !orphaned(index)) {
                let mut slot = lock(index);
                // A pending client is watched on its TCP socket. IN there with the segment
                // attached is the acceptor's switch marker, not data: switch now (the
                // registration moves to the mirror, which rises when the acceptor's first
                // bytes arrive) and judge the event like a switched socket's below. Without
                // the segment (a plain server's data) the kernel's report stands.
                if let Some(fd) = registry().get(index).map(|r| r.fd.load(Ordering::Acquire)) {
                    let _ = switch_if_attached(fd, index, &mut slot);
                }
                if let Some(SanObject::Socket(socket)) = slot
                    .as_mut()
                    .filter(|o| matches!(o, SanObject::Socket(s) if s.phase == Phase::Switched))
                {
                    if event.events & libc::EPOLLHUP as u32 != 0 {
                        socket.mirror_hung_up();
                    }
                    socket.service();
                    let readiness = socket.readiness();
                    if !readiness.readable && !socket.tcp_bytes_pending() {
                        let defer = socket.lazy_lowering
                            && deferred
                                .as_mut()
                                .is_some_and(|list| list.push(index, event));
                        if defer || socket.lower_readable() {
                            event.events &= !(libc::EPOLLIN as u32);
                        }
                    }
                    if readiness.error {
                        event.events |= libc::EPOLLERR as u32;
                    }
                    event.events = socket.correct_close_bits(event.events);
                }
            }
        }
        if event.events != 0 {
            events[kept] = event;
            kept += 1;
        }
    }
    kept
}

/// Most sockets one epoll wait looks at before it sleeps; any beyond are lowered at once.
const DEFERRED: usize = 16;

/// The SAN sockets an epoll wait found raised without data (lazy lowering): looked at for
/// their next message before the wait sleeps, then lowered.
pub struct Deferred {
    indices: [u32; DEFERRED],
    /// The kernel's event for each (the IN bit included), to hand out when its data comes.
    events: [libc::epoll_event; DEFERRED],
    len: usize,
}

impl Default for Deferred {
    fn default() -> Deferred {
        Deferred {
            indices: [0; DEFERRED],
            events: [libc::epoll_event { events: 0, u64: 0 }; DEFERRED],
            len: 0,
        }
    }
}

impl Deferred {
    fn push(&mut self, index: u32, event: libc::epoll_event) -> bool {
        if self.len == DEFERRED || self.indices[..self.len].contains(&index) {
            return false;
        }
        self.indices[self.len] = index;
        self.events[self.len] = event;
        self.len += 1;
        true
    }

    /// No socket was deferred.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the sockets (after they were looked at and lowered).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    fn indices(&self) -> &[u32] {
        &self.indices[..self.len]
    }
}

/// # Looking before sleeping
///
/// An event loop that just served a request over the SAN usually gets the next one (or the
/// answer it waits for) within microseconds: the peer is running on another CPU. Sleeping in
/// the kernel in between costs a wake-up (tens of microseconds on a virtual machine) and two
/// token system calls (our lowering read, the peer's raising write). So an epoll wait that
/// finds only sockets raised without data looks at their sessions for up to `budget` (the
/// caller adapts it) and returns true as soon as one has data, a FIN or an error: the
/// mirror is still raised, so the kernel would report it again; the sockets found are handed
/// out directly instead, with the kernel's own event for them (only plain level-triggered
/// registrations are ever deferred, so reporting such an event again is what the kernel
/// would do; another descriptor that became ready meanwhile is reported by the next wait).
/// Returns how many events it wrote to `out` (0: nothing came within `budget`). Now and then
/// it yields the CPU, so a peer sharing it can run.
pub fn look_for_messages(
    deferred: &Deferred,
    budget: std::time::Duration,
    out: &mut [libc::epoll_event],
) -> usize {
    let start = std::time::Instant::now();
    let mut looks = 0u32;
    loop {
        let mut found = 0;
        for (&index, event) in deferred.indices().iter().zip(&deferred.events) {
            if found == out.len() {
                break;
            }
            if orphaned(index) {
                continue;
            }
            let mut slot = lock(index);
            let Some(SanObject::Socket(socket)) = slot.as_mut() else {
                continue;
            };
            socket.service();
            let readiness = socket.readiness();
            if readiness.readable
                || readiness.read_hup
                || readiness.error
                || socket.tcp_bytes_pending()
            {
                let mut event = *event;
                if readiness.error {
                    event.events |= libc::EPOLLERR as u32;
                }
                event.events = socket.correct_close_bits(event.events);
                out[found] = event;
                found += 1;
            }
        }
        if found > 0 {
            return found;
        }
        if start.elapsed() >= budget {
            return 0;
        }
        looks += 1;
        if looks.is_multiple_of(32) {
            // SAFETY: sched_yield(2) takes no arguments.
            unsafe { libc::sched_yield() };
        } else {
            core::hint::spin_loop();
        }
    }
}

/// Lowers the deferred sockets that still have nothing to read, before the wait sleeps.
pub fn lower_deferred(deferred: &Deferred) {
    for &index in deferred.indices() {
        if orphaned(index) {
            continue;
        }
        if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
            if !socket.readiness().readable && !socket.tcp_bytes_pending() {
                let _ = socket.lower_readable();
            }
        }
    }
}

/// FIONREAD on a SAN socket; `None` when the kernel's answer is the right one (pending).
pub fn readable_bytes(fd: c_int, index: u32) -> Option<c_int> {
    if orphaned(index) {
        return None;
    }
    switch_pending(fd, index);
    // Both ends in this thread: let the other end deliver what it has queued.
    assist_in_process_peer(index);
    let mut slot = lock(index);
    downgrade::settle(fd, index, &mut slot);
    if let Some(SanObject::Stashed(stashed)) = slot.as_ref() {
        let mut tcp_queued: c_int = 0;
        // SAFETY: FIONREAD writes one int.
        unsafe {
            real::ioctl(
                fd,
                libc::FIONREAD as _,
                (&mut tcp_queued as *mut c_int) as usize,
            )
        };
        let bytes = stashed.stash.remaining() + usize::try_from(tcp_queued).unwrap_or(0);
        return Some(c_int::try_from(bytes).unwrap_or(c_int::MAX));
    }
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return None;
    };
    if socket.phase != Phase::Switched {
        return None;
    }
    socket.service();
    let mut tcp_queued: c_int = 0;
    // SAFETY: FIONREAD writes one int.
    unsafe {
        real::ioctl(
            fd,
            libc::FIONREAD as _,
            (&mut tcp_queued as *mut c_int) as usize,
        )
    };
    let bytes = socket.readable_bytes(usize::try_from(tcp_queued).unwrap_or(0));
    Some(c_int::try_from(bytes).unwrap_or(c_int::MAX))
}

/// `select()`/`pselect()` over a set containing SAN sockets, carried out as `ppoll()` so the
/// mirrors can stand in for them: the number of ready descriptors, or the errno. `None`: no
/// SAN socket in the sets, make the real call.
///
/// # Safety
/// The sets must be null or valid `fd_set`s; `timeout` and `sigmask` null or valid.
pub unsafe fn select_via_poll(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> SanCall<c_int> {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("select_via_poll");
    if LIVE.load(Ordering::Relaxed) == 0 || !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        return None;
    }
    // SAFETY: per the contract, each set is null or valid.
    let is_set =
        |set: *mut libc::fd_set, fd: c_int| !set.is_null() && unsafe { libc::FD_ISSET(fd, set) };
    // A set without SAN sockets goes to the kernel untouched: no allocation, no lock.
    let any_san = (0..nfds).any(|fd| {
        (is_set(readfds, fd) || is_set(writefds, fd) || is_set(exceptfds, fd))
            && san_index(crate::fdtable::table().lookup(fd)).is_some()
    });
    if !any_san {
        return None;
    }
    let mut pollfds = Vec::new();
    for fd in 0..nfds {
        let mut events = 0;
        if is_set(readfds, fd) {
            events |= libc::POLLIN;
        }
        if is_set(writefds, fd) {
            events |= libc::POLLOUT;
        }
        if is_set(exceptfds, fd) {
            events |= libc::POLLPRI;
        }
        if events != 0 {
            pollfds.push(libc::pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    let deadline = (!timeout.is_null()).then(|| {
        // SAFETY: a valid timespec per the contract.
        let t = unsafe { timeout.read_unaligned() };
        let wait = std::time::Duration::new(
            u64::try_from(t.tv_sec).unwrap_or(0),
            u32::try_from(t.tv_nsec).unwrap_or(0).min(999_999_999),
        );
        std::time::Instant::now() + wait
    });
    loop {
        let left = deadline.map(|d| {
            let left = d.saturating_duration_since(std::time::Instant::now());
            libc::timespec {
                tv_sec: left.as_secs() as libc::time_t,
                tv_nsec: left.subsec_nanos() as libc::c_long,
            }
        });
        let left_ptr = left
            .as_ref()
            .map_or(core::ptr::null(), |t| t as *const libc::timespec);
        let saved = poll_fds(&mut pollfds, None);
        // SAFETY: valid pollfds; our timespec; sigmask per the contract.
        let rc = unsafe {
            real::ppoll(
                pollfds.as_mut_ptr(),
                pollfds.len() as libc::nfds_t,
                left_ptr,
                sigmask,
            )
        };
        let error = Errno::last();
        poll_fds(&mut pollfds, Some(&saved));
        if rc < 0 {
            return Some(Err(error));
        }
        // Reports that were only a mirror's handshake or credit token were dropped: with
        // nothing else ready the wait goes on until the caller's timeout, as the kernel's
        // select would not have returned.
        let expired = deadline.is_some_and(|d| std::time::Instant::now() >= d);
        if rc == 0 || expired || pollfds.iter().any(|p| p.revents != 0) {
            break;
        }
    }
    if pollfds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
        return Some(Err(Errno(libc::EBADF)));
    }
    let mut count = 0;
    for set in [readfds, writefds, exceptfds] {
        if !set.is_null() {
            // SAFETY: a valid set per the contract.
            unsafe { libc::FD_ZERO(set) };
        }
    }
    for p in &pollfds {
        let mark = |set: *mut libc::fd_set, wanted: bool, count: &mut c_int| {
            if wanted && !set.is_null() {
                // SAFETY: a valid set; `p.fd < nfds ≤ FD_SETSIZE`.
                unsafe { libc::FD_SET(p.fd, set) };
                *count += 1;
            }
        };
        let readable = p.events & libc::POLLIN != 0
            && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0;
        let writable =
            p.events & libc::POLLOUT != 0 && p.revents & (libc::POLLOUT | libc::POLLERR) != 0;
        let exceptional = p.events & libc::POLLPRI != 0 && p.revents & libc::POLLPRI != 0;
        mark(readfds, readable, &mut count);
        mark(writefds, writable, &mut count);
        mark(exceptfds, exceptional, &mut count);
    }
    Some(Ok(count))
}
