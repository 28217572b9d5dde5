//! Readiness of SAN sockets to `poll`, `select` and `epoll`: a switched socket is watched
//! through its mirror's watched end in place of its TCP socket, a stash holder through its stash's
//! eventfd, and what the kernel reports is corrected to agree with the session (no
//! readability without data; errors and RDHUP, which a mirror cannot show); `FIONREAD`.

use core::ffi::c_int;
use core::sync::atomic::Ordering;

use super::downgrade;
use super::socket::{Phase, SanSocket};
use super::switchover::{
    assist_all_in_process, assist_in_process_peer, switch_if_attached, switch_pending,
};
use super::table::{lock, orphaned, san_index, SanObject, LIVE};
use crate::errno::Errno;
use crate::real;
use crate::record::flags;
use crate::registry::registry;
use switch::session::Readiness;

/// What [`poll_fds`] did to a poll set.
#[derive(Default)]
pub struct Swapped {
    /// The positions and the application's fds of the entries it rewrote (to put back with
    /// [`unpoll_fds`]); empty when it rewrote none.
    pub saved: Vec<(usize, c_int)>,
    /// One of those mirrors was raised without data as the wait began (left so by a read
    /// under lazy lowering): the kernel wait returns at once, before it could sleep, so the
    /// wait may look for the next message (see [`look_for_news`]).
    pub raised: bool,
    /// The positions of the entries watched for output whose sockets count this wait as a
    /// call under way (`SanSocket::entering_call`): the peer raises their writability when
    /// it transmits, and [`unpoll_fds`] drives them, so it need not nudge our process.
    pub counted: Vec<usize>,
}

/// `poll()`/`ppoll()`/`select()` on a set containing SAN sockets: each switched SAN socket's
/// entry is watched through its mirror's watched end (the caller polls `fds` as rewritten,
/// then calls [`unpoll_fds`] to put the application's fds back). A socket watched for input
/// goes under lazy lowering (see `SanSocket::polled_for_input`); one whose mirror was left
/// raised without data is lowered now unless the wait may look for its next message
/// (`may_look`), so a wait that will not look sleeps at once.
pub fn poll_fds(fds: &mut [libc::pollfd], may_look: bool) -> Swapped {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("poll_fds");
    let mut swapped = Swapped::default();
    if LIVE.load(Ordering::Relaxed) == 0 {
        return swapped;
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
                if entry.events & libc::POLLOUT != 0 && socket.entering_call() {
                    swapped.counted.push(position);
                }
                if entry.events & libc::POLLIN != 0 {
                    if let Some(record) = registry().get(index) {
                        socket.polled_for_input(record);
                    }
                    if socket.lazy_lowering && socket.raised_without_data(entry.fd) {
                        // (Data that arrived meanwhile keeps it raised: the wait reports it.)
                        swapped.raised |= may_look || !socket.lower_readable();
                    }
                }
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
            swapped.saved.push((position, entry.fd));
            entry.fd = mirror;
        }
    }
    swapped
}

/// Puts the application's fds back into the entries [`poll_fds`] rewrote (`saved`) and
/// makes their `revents` agree with the sessions (`correct_revents`). With `deferred`, a
/// socket under lazy lowering that the kernel reported raised without data is noted there
/// (its IN dropped) instead of lowered: the wait looks for its next message first
/// ([`look_for_news`]) and lowers it only before it sleeps ([`lower_deferred`]).
pub fn unpoll_fds(
    fds: &mut [libc::pollfd],
    swapped: &Swapped,
    mut deferred: Option<&mut Deferred>,
) {
    for &(position, fd) in &swapped.saved {
        if let Some(entry) = fds.get_mut(position) {
            entry.fd = fd;
            let counted = swapped.counted.contains(&position);
            correct_revents(entry, position, deferred.as_deref_mut(), counted);
        }
    }
}

/// Makes a SAN entry's `revents` (as the mirror reported them) agree with the session: a
/// spurious IN (a token for a handshake or a credit, no data, or a mirror left raised by lazy
/// lowering) is dropped and the mirror lowered, or noted in `deferred`; ERR and RDHUP, which
/// the mirror cannot show, are added from the session's state. `counted`: the wait counted as
/// a call on the socket, which ends here.
fn correct_revents(
    entry: &mut libc::pollfd,
    position: usize,
    deferred: Option<&mut Deferred>,
    counted: bool,
) {
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
        if counted {
            socket.leaving_call(true);
        }
        return;
    }
    if entry.revents & libc::POLLHUP != 0 {
        socket.mirror_hung_up();
    }
    socket.service();
    if counted {
        socket.leaving_call(true);
    }
    let readiness = socket.readiness();
    if entry.revents & libc::POLLIN != 0
        && !readiness.readable
        && !socket.tcp_bytes_readable(entry.fd)
    {
        let defer = socket.lazy_lowering
            && deferred.is_some_and(|list| {
                let reported = libc::epoll_event {
                    events: entry.revents as u16 as u32,
                    u64: position as u64,
                };
                list.push(index, reported)
            });
        if defer || socket.lower_readable() {
            entry.revents &= !libc::POLLIN;
        }
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
        if super::epoll_removal::drop_removed_event(epfd, event.u64) {
            continue;
        }
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
                let fd = tcp_fd(index);
                if fd >= 0 {
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
                    if readiness.readable {
                        socket.raised_idle_waits = 0;
                    } else if !socket.tcp_bytes_readable(fd) {
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

/// The kernel socket of SAN socket `index` (-1 when it has none: a poll of -1 reports
/// nothing).
fn tcp_fd(index: u32) -> c_int {
    registry()
        .get(index)
        .map_or(-1, |record| record.fd.load(Ordering::Acquire))
}

/// Most sockets one wait looks at before it sleeps; any beyond are lowered at once.
const DEFERRED: usize = 64;

/// The SAN sockets a wait (epoll, poll, select) found raised without data (lazy lowering):
/// looked at for their next message before the wait sleeps, then lowered.
pub struct Deferred {
    indices: [u32; DEFERRED],
    /// The kernel's report of each, the IN bit included: an epoll wait hands it out when the
    /// socket's data comes; a poll notes the entry's `revents` and its position in the set.
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

/// What a look for the next message found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Looked {
    /// How many sockets it found with news (and took).
    pub found: usize,
    /// It found them within its budget: looking paid off. A look whose thread lost its CPU
    /// for longer than the budget (the CPU is contended: sleeping costs little more there)
    /// may still find news afterwards, but did not pay.
    pub in_time: bool,
    /// The looking thread lost its CPU during the look (another thread ran there: a peer
    /// sharing the CPU, or anyone else's work): looking took CPU time someone else wanted.
    pub preempted: bool,
}

/// A gap between two rounds of a look longer than this means the thread did not run in
/// between (a round takes well under a microsecond; an interrupt a few). Whether another
/// thread ran in its place is then asked of the kernel ([`switched_out_since_last_asked`]):
/// a virtual machine's vCPU that the host paused, or a long interrupt, leaves the same gap
/// with nobody waiting for this CPU. (At 200 µs the gaps a CPU hog leaves went unseen.)
const PREEMPTED_GAP: std::time::Duration = std::time::Duration::from_micros(20);

/// Whether this thread lost its CPU to another thread since it last asked: its count of
/// involuntary context switches grew (a `sched_yield` that let another thread run counts
/// too). Asked only after a gap in a look, one system call then. A switch that happened
/// outside any look since the last question counts as well, which errs toward stopping the
/// looks, as before this was asked. On a machine whose vCPUs the host pauses now and then,
/// every such pause had counted as contention: the looks stopped, and redis `-c 1` ran at
/// 2-3x kernel TCP instead of 10x.
fn switched_out_since_last_asked() -> bool {
    thread_local! {
        static LAST: core::cell::Cell<Option<libc::c_long>> = const { core::cell::Cell::new(None) };
    }
    let mut usage = core::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage(2) writes one rusage into our buffer.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) } != 0 {
        return true;
    }
    // SAFETY: zero-initialised and filled by the kernel; plain data.
    let now = unsafe { usage.assume_init() }.ru_nivcsw;
    LAST.with(|last| last.replace(Some(now)).is_none_or(|before| now > before))
}

/// # Looking before sleeping
///
/// An event loop that just served a request over the SAN usually gets the next one (or the
/// answer it waits for) within microseconds: the peer is running on another CPU. Sleeping in
/// the kernel in between costs a wake-up (tens of microseconds on a virtual machine) and two
/// token system calls (our lowering read, the peer's raising write). So a wait that finds
/// only sockets raised without data looks at their sessions for up to `budget` (the caller
/// adapts it) for data, a FIN or an error, and calls `take` for each socket that has some
/// (with its deferred report), until `take` says it wants no more. Now and then it yields the CPU, so a
/// peer sharing it can run; once the budget is spent it looks one last time.
fn look(
    deferred: &Deferred,
    budget: std::time::Duration,
    mut take: impl FnMut(&libc::epoll_event, &SanSocket, Readiness) -> bool,
) -> Looked {
    let start = std::time::Instant::now();
    let mut looks = 0u32;
    let mut last_round = std::time::Duration::ZERO;
    let mut preempted = false;
    loop {
        let elapsed = start.elapsed();
        preempted |= !preempted
            && elapsed.saturating_sub(last_round) > PREEMPTED_GAP
            && switched_out_since_last_asked();
        last_round = elapsed;
        let late = elapsed >= budget;
        let mut found = 0;
        for (&index, event) in deferred.indices().iter().zip(&deferred.events) {
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
                || socket.tcp_bytes_readable(tcp_fd(index))
            {
                found += 1;
                if !take(event, socket, readiness) {
                    break;
                }
            }
        }
        if found > 0 || late {
            return Looked {
                found,
                in_time: found > 0 && !late,
                preempted,
            };
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

/// An epoll wait's `look`: the sockets found are handed out directly, with the kernel's
/// own event for them, into `out` (the mirror is still raised, so the kernel would report
/// them again; only plain level-triggered registrations are ever deferred, so reporting such
/// an event again is what the kernel would do; another descriptor that became ready
/// meanwhile is reported by the next wait). `found` counts the events it wrote (0: nothing
/// came within `budget`).
pub fn look_for_messages(
    deferred: &Deferred,
    budget: std::time::Duration,
    out: &mut [libc::epoll_event],
) -> Looked {
    let mut written = 0;
    let looked = look(deferred, budget, |event, socket, readiness| {
        let Some(slot) = out.get_mut(written) else {
            return false;
        };
        let mut event = *event;
        if readiness.error {
            event.events |= libc::EPOLLERR as u32;
        }
        event.events = socket.correct_close_bits(event.events);
        *slot = event;
        written += 1;
        written < out.len()
    });
    Looked {
        found: written,
        ..looked
    }
}

/// A poll's or select's `look`, ended by the first deferred socket with news. The wait
/// then reports it directly where that is exact ([`hand_out_input`]), else polls its whole set
/// again with a zero timeout, so that every entry, the socket's and those of the other
/// descriptors, reports what the kernel reports after the arrival (a readiness another
/// descriptor gained before it included).
pub fn look_for_news(deferred: &Deferred, budget: std::time::Duration) -> Looked {
    look(deferred, budget, |_, _, _| false)
}

/// After a poll's look found news: when every descriptor of the set (`fds`) is a deferred
/// socket polled for input alone, and what each has now is plain input (see
/// `SanSocket::plain_input`: bytes, no FIN, error or shutdown), the kernel would report
/// exactly `POLLIN` for those with input and nothing for the others. Their entries are then
/// set so and the count returned, without another kernel call; `None`: poll the set again.
pub fn hand_out_input(deferred: &Deferred, fds: &mut [libc::pollfd]) -> Option<usize> {
    let positions = || {
        deferred.events[..deferred.len]
            .iter()
            .map(|e| e.u64 as usize)
    };
    let watched = fds.iter().filter(|entry| entry.fd >= 0).count();
    if watched != deferred.len
        || positions().any(|p| {
            fds.get(p)
                .is_none_or(|e| e.fd < 0 || e.events & !libc::POLLIN != 0)
        })
    {
        return None;
    }
    let mut ready = [false; DEFERRED];
    for (slot, &index) in deferred.indices().iter().enumerate() {
        if orphaned(index) {
            return None;
        }
        let guard = lock(index);
        let Some(SanObject::Socket(socket)) = guard.as_ref() else {
            return None;
        };
        let readiness = socket.readiness();
        ready[slot] = socket.plain_input(tcp_fd(index));
        if !ready[slot] && (readiness.readable || readiness.read_hup || readiness.error) {
            return None;
        }
    }
    let mut count = 0;
    for (slot, position) in positions().enumerate() {
        fds[position].revents = if ready[slot] { libc::POLLIN } else { 0 };
        count += usize::from(ready[slot]);
    }
    (count > 0).then_some(count)
}

/// Lowers the deferred sockets that still have nothing to read: before the wait sleeps, or
/// (`linger`) as an epoll wait hands out other events, where each may stay raised for up to
/// `LINGERING_WAITS` such waits in a row (its level-triggered registrations are the only
/// watchers, and the waits drop its report).
pub fn lower_deferred(deferred: &Deferred, linger: bool) {
    for &index in deferred.indices() {
        if orphaned(index) {
            continue;
        }
        if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
            if socket.readiness().readable || socket.tcp_bytes_readable(tcp_fd(index)) {
                continue;
            }
            if linger && socket.raised_idle_waits < LINGERING_WAITS {
                socket.raised_idle_waits += 1;
                continue;
            }
            socket.raised_idle_waits = 0;
            let _ = socket.lower_readable();
        }
    }
}

/// How many epoll waits in a row that hand out other events may find a socket's mirror
/// raised without data and leave it raised. An event loop with many connections has events
/// at almost every wait, and the answer on a connection it just wrote to comes a few waits
/// later: lowering at once made the peer write a token for nearly every message (and us
/// read it); leaving the mirror raised costs each of those waits one more kernel report,
/// which is dropped.
const LINGERING_WAITS: u8 = 8;

/// The kernel's FIONREAD of the TCP socket `fd` (0 when it fails).
fn tcp_queued(fd: c_int) -> usize {
    let mut queued: c_int = 0;
    // SAFETY: FIONREAD writes one int.
    unsafe {
        real::ioctl(
            fd,
            libc::FIONREAD as _,
            (&mut queued as *mut c_int) as usize,
        )
    };
    usize::try_from(queued).unwrap_or(0)
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
        let bytes = stashed.stash.remaining() + tcp_queued(fd);
        return Some(c_int::try_from(bytes).unwrap_or(c_int::MAX));
    }
    let Some(SanObject::Socket(socket)) = slot.as_mut() else {
        return None;
    };
    if socket.phase != Phase::Switched {
        return None;
    }
    // Bytes the session holds already are an answer (FIONREAD counts what is queued now;
    // what is still arriving may follow): no drive for a program that asks after every read.
    if !socket.reads_without_drive(1) {
        socket.service();
    }
    // The kernel is asked only while the stream's bytes may still be on TCP: once they were
    // all read, the answer is the session's alone (a program that asks after every read,
    // as wrk does, would otherwise pay a system call per read).
    let bytes = socket.readable_bytes(|| tcp_queued(fd));
    Some(c_int::try_from(bytes).unwrap_or(c_int::MAX))
}

/// `select()`/`pselect()` over sets containing SAN sockets are carried out as a poll, so the
/// mirrors can stand in for them: the poll set for the sets (`POLLIN` for the read set,
/// `POLLOUT` for the write set, `POLLPRI` for the exception set, one entry per descriptor),
/// to wait on as `poll()` does and read back with [`select_results`]. `None`: no SAN socket
/// in the sets (or `nfds` out of range), make the real call.
///
/// # Safety
/// The sets must be null or valid `fd_set`s.
pub unsafe fn select_pollfds(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
) -> Option<Vec<libc::pollfd>> {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("select_pollfds");
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
    Some(pollfds)
}

/// The sets of a `select()` whose poll over [`select_pollfds`]'s set returned (with a count,
/// 0 included): each set cleared and refilled with its ready descriptors, as the kernel
/// does. Returns the number of bits set, or `EBADF` for a descriptor that is not open (the
/// sets then untouched, as the kernel leaves them).
///
/// # Safety
/// The sets must be null or valid `fd_set`s, the ones `pollfds` was made from.
pub unsafe fn select_results(
    pollfds: &[libc::pollfd],
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
) -> Result<c_int, Errno> {
    if pollfds.iter().any(|p| p.revents & libc::POLLNVAL != 0) {
        return Err(Errno(libc::EBADF));
    }
    let mut count = 0;
    for set in [readfds, writefds, exceptfds] {
        if !set.is_null() {
            // SAFETY: a valid set per the contract.
            unsafe { libc::FD_ZERO(set) };
        }
    }
    for p in pollfds {
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
    Ok(count)
}
