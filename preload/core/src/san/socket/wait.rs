//! Blocking on a SAN socket: what a blocked call watches ([`WaitFds`], prepared under the
//! lock, polled without it by the blocking calls), the waiters' bell, and over verbs the
//! direct wait on the connection's events and the polling of a blocked reader.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::time::Duration;

use super::{Phase, SanSocket};
use crate::mirror::ReadLowering;
use crate::san::link::{Link, NotArmed};
use crate::san::tunables::poll_budget;

/// What blocking on this socket should watch (computed under the lock, used after it).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WaitFds {
    /// The mirror end to poll, if switched.
    pub mirror: Option<RawFd>,
    /// What to poll `mirror` for: POLLIN (peer activity) or, for a sender waiting for room,
    /// POLLOUT (the peer raises it when it returns credits).
    pub mirror_events: i16,
    /// Also poll the TCP socket for these events (0: not at all).
    pub tcp_events: i16,
    /// `finish_blocking` is owed after the poll.
    pub asleep: bool,
    /// The socket's local bell: rung when one thread makes progress others may wait for.
    pub bell: Option<RawFd>,
    /// Sleep at most this long (a sender absorbing a stalled peer's data, see
    /// [`SanSocket::absorb_if_stalled`]).
    pub cap: Option<Duration>,
    /// Verbs: the connection's pollable fd, watched by the blocked thread itself.
    pub link: Option<RawFd>,
    /// Verbs, a reader: poll the completion queue for a while before sleeping (see
    /// [`crate::san::tunables::SpinPolicy`]; set by [`SanSocket::prepare_read_wait`]).
    pub spin: bool,
}

/// What a blocked reader does after polling (see [`SanSocket::polled`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterPolling {
    /// News came: the wait ends (its direct wait's end is owed, see
    /// [`SanSocket::finish_polled_wait`]).
    Found,
    /// Nothing came and the queue was settled for sleeping: the wait ends without sleeping
    /// and the call looks again (what settling drove is news nobody announced).
    LookAgain,
    /// Nothing came: sleep.
    Sleep,
}

impl SanSocket {
    /// Wakes the threads blocked on this socket (see `local_bell`), if any.
    pub(super) fn ring_local_bell(&self) {
        if self.waiters > 0 {
            if let Some(bell) = self.local_bell.as_ref() {
                let one = 1u64;
                // SAFETY: an 8-byte write to our eventfd.
                unsafe { libc::write(bell.as_raw_fd(), (&one as *const u64).cast(), 8) };
            }
        }
    }

    /// This thread ends a wait it prepared, or found news instead of sleeping: the connection
    /// announces "running" again, unless another thread of ours still sleeps on it. That one
    /// needs the peer to keep ringing: "asleep" stays announced, and news that came meanwhile
    /// (which a "running" announcement let the peer leave unrung) wakes it through the bell.
    pub(crate) fn done_blocking(&self) {
        let Some(conn) = self.conn.as_ref() else {
            return;
        };
        if self.waiters == 0 {
            conn.finish_blocking();
        } else if !conn.prepare_to_block() {
            self.ring_local_bell();
        }
    }

    /// Prepares a blocking wait: spins briefly while the peer runs, then announces "asleep"
    /// and lowers the mirror. `None`: news arrived, do not block.
    pub(crate) fn prepare_wait(&mut self, tcp_events: i16) -> Option<WaitFds> {
        self.prepare_wait_polling(tcp_events, false)
    }

    /// [`SanSocket::prepare_wait`]; `polls`: the wait polls the completion queue before it
    /// sleeps (verbs, see [`SanSocket::prepare_read_wait`]).
    fn prepare_wait_polling(&mut self, tcp_events: i16, polls: bool) -> Option<WaitFds> {
        if self.phase == Phase::Pending {
            if self.pending_bell.is_none() {
                self.pending_bell = new_eventfd();
            }
            return Some(WaitFds {
                bell: self.pending_bell.as_ref().map(AsRawFd::as_raw_fd),
                ..Self::tcp_wait(tcp_events)
            });
        }
        if self.local_bell.is_none() {
            self.local_bell = new_eventfd();
        }
        let conn = self.conn.as_ref()?;
        if conn.wait(Duration::ZERO) == san_shm::WaitResult::Notified {
            return None;
        }
        if !conn.prepare_to_block() {
            self.done_blocking();
            return None;
        }
        let session = self.session.as_ref();
        let mirror = self.mirror.as_mut()?;
        let lowered = mirror.lower_readable(|| {
            session.is_some_and(|s| s.readiness().readable) || !conn.prepare_to_block()
        });
        if matches!(lowered, Ok(ReadLowering::StillReadable) | Err(_)) {
            self.done_blocking();
            return None;
        }
        let mut wait = WaitFds {
            mirror: Some(mirror.as_fd().as_raw_fd()),
            mirror_events: libc::POLLIN,
            tcp_events,
            asleep: true,
            bell: self.local_bell.as_ref().map(AsRawFd::as_raw_fd),
            cap: None,
            link: None,
            spin: polls,
        };
        if !self.watch_link_directly(&mut wait) {
            self.done_blocking();
            return None;
        }
        self.waiters += 1;
        Some(wait)
    }

    /// [`SanSocket::prepare_wait`] for a reader of a switched socket: over verbs the wait may
    /// poll the completion queue before it sleeps, when the connection's [`SpinPolicy`]
    /// (adaptive) says polling pays. `None`: news arrived, do not block.
    ///
    /// [`SpinPolicy`]: crate::san::tunables::SpinPolicy
    pub(crate) fn prepare_read_wait(&mut self) -> Option<WaitFds> {
        let polls = self.phase == Phase::Switched
            && poll_budget() > 0
            && self.conn.as_mut().is_some_and(Link::polls_before_sleeping);
        self.prepare_wait_polling(0, polls)
    }

    /// One poll round of a blocked reader (its lock held): true when there is news, a
    /// completion waiting for the drive or a session another thread made readable.
    pub(crate) fn poll_round(&mut self) -> bool {
        if self.session.as_ref().is_none_or(|s| s.readiness().readable) {
            return true;
        }
        self.conn.as_mut().is_none_or(Link::poll_round)
    }

    /// The outcome of a blocked reader's polling (see [`crate::san::tunables::SpinPolicy`]), and
    /// what the wait does next.
    pub(crate) fn polled(&mut self, found: bool) -> AfterPolling {
        let Some(link) = self.verbs_link_mut() else {
            return AfterPolling::Sleep;
        };
        if found {
            link.spin.found();
            return AfterPolling::Found;
        }
        link.spin.missed();
        if !link.owed() {
            return AfterPolling::Sleep;
        }
        // The sleep needs an armed queue. Settling may drive what arrived meanwhile, with no
        // wake-up for this wait (it is not counted among the waiters yet): look again first.
        self.settle_direct_wait();
        AfterPolling::LookAgain
    }

    /// The application made a call on this socket (see `VerbsLink::note_call`) that moved
    /// data: `sent` bytes out, `received` bytes in (whether a later read waits for an answer:
    /// `VerbsLink::answer_expected`).
    pub(crate) fn note_call(&mut self, sent: bool, received: bool) {
        if let Some(conn) = self.conn.as_mut() {
            conn.note_call(sent, received);
        }
    }

    /// Prepares a blocking wait for the completion of a rendezvous receive in flight. Not on
    /// readability: the segment being received keeps the session readable, so such a wait
    /// would return at once and the receiver would spin for as long as the RDMA READ takes
    /// (over emulated RDMA: 1 MiB, ~330 ms of CPU, stealing it from the transfer). Over
    /// verbs the service thread rings the local bell after every drive that completed work
    /// while a thread waits, and a reset or the peer's death hangs the mirror up (`RDHUP`).
    /// Shm transfers complete within our own next drive: the ordinary wait serves them.
    pub(crate) fn prepare_completion_wait(&mut self) -> Option<WaitFds> {
        if !self.is_verbs() {
            return self.prepare_wait(0);
        }
        if self.local_bell.is_none() {
            self.local_bell = new_eventfd();
        }
        let mut wait = self.mirror_wait(libc::POLLRDHUP, true);
        if !self.watch_link_directly(&mut wait) {
            return None;
        }
        self.waiters += 1;
        Some(wait)
    }

    /// A blocking wait on the TCP socket alone (a pending client; an acceptor whose session
    /// ended while the client's TCP bytes were still due: the mirror is hung up for good).
    pub(crate) fn tcp_wait(tcp_events: i16) -> WaitFds {
        WaitFds {
            mirror: None,
            mirror_events: 0,
            tcp_events,
            asleep: false,
            bell: None,
            cap: None,
            link: None,
            spin: false,
        }
    }

    /// Prepares a blocking wait for room to send (no credits): lowers the watched end's writability,
    /// which the peer raises whenever it transmits (credits travel with every message).
    /// `None`: room appeared meanwhile, retry at once.
    ///
    /// Unlike [`SanSocket::prepare_wait`] this does not watch the watched end's readability: data that
    /// another thread has yet to read keeps the watched end readable, and a sender that woke on it would
    /// spin, keeping the socket's lock from that very reader (which it needs to make room).
    pub(crate) fn prepare_send_wait(&mut self) -> Option<WaitFds> {
        if self.phase == Phase::Pending {
            return self.prepare_wait(libc::POLLOUT);
        }
        if !self.lower_writable() {
            return None;
        }
        let mut wait = self.mirror_wait(libc::POLLOUT, false);
        self.watch_link_directly(&mut wait).then_some(wait)
    }

    /// A wait on the watched end for `events` and on the socket's bell (`asleep`: `finish_wait` owes
    /// the waiter count and the connection's blocking state).
    fn mirror_wait(&self, events: i16, asleep: bool) -> WaitFds {
        WaitFds {
            mirror: self.mirror_fd(),
            mirror_events: events,
            tcp_events: 0,
            asleep,
            bell: self.local_bell.as_ref().map(AsRawFd::as_raw_fd),
            cap: None,
            link: None,
            spin: false,
        }
    }

    /// After the poll of a prepared wait. The connection stays "asleep" for the peer while
    /// any other thread still sleeps on it, so the peer keeps ringing.
    pub(crate) fn finish_wait(&mut self, fds: &WaitFds, bell_rung: bool) {
        if fds.link.is_some() {
            if let Some(conn) = self.conn.as_mut() {
                conn.end_direct_wait();
            }
        }
        self.finish_wait_common(fds, bell_rung);
    }

    /// After a reader's poll found news (see [`SanSocket::poll_round`]): as
    /// [`SanSocket::finish_wait`], but the end of the direct wait is owed
    /// (`VerbsLink::owe_direct_wait_end`): the service thread's watch stays paused and the
    /// channel event the armed queue raised stays unconsumed until the link is settled
    /// ([`SanSocket::settle_direct_wait`]: before a sleep, before an epoll/poll/select
    /// sleeps, or by the service thread's tick once the application stopped calling).
    pub(crate) fn finish_polled_wait(&mut self, fds: &WaitFds) {
        if fds.link.is_some() {
            if let Some(conn) = self.conn.as_mut() {
                conn.owe_direct_wait_end();
            }
        }
        self.finish_wait_common(fds, false);
    }

    /// Settles what a polled wait owes (its channel event consumed, the queue armed, the
    /// service thread's watch resumed), so that a sleep on the connection's events, or the
    /// service thread, learns of the next arrival. While owed, the application's calls poll
    /// the queue themselves and a polled wait needs nothing of it: settling after every call
    /// cost a consumed event, an arm and two `epoll_ctl` per message.
    pub(crate) fn settle_direct_wait(&mut self) {
        if !self.conn.as_mut().is_some_and(Link::take_owed_event) {
            return;
        }
        if self.phase == Phase::Switched {
            self.arm_link();
        }
        if let Some(conn) = self.conn.as_mut() {
            conn.end_direct_wait();
        }
    }

    fn finish_wait_common(&mut self, fds: &WaitFds, bell_rung: bool) {
        if !fds.asleep {
            return;
        }
        self.waiters = self.waiters.saturating_sub(1);
        // (A ring this wait did not see stays for the next wait: one spurious wake-up.)
        if let Some(bell) = self.local_bell.as_ref().filter(|_| bell_rung) {
            let mut count = 0u64;
            // SAFETY: an 8-byte read from our nonblocking eventfd.
            unsafe { libc::read(bell.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        }
        self.done_blocking();
    }

    /// Verbs: a thread that waited on the connection's fd itself woke on it: the channel and
    /// connection events are collected (the next drive handles the completions).
    pub(crate) fn collect_link_events(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            conn.collect_events();
        }
    }

    /// Verbs: the blocking wait `fds` watches the connection's events itself (see
    /// [`crate::san::verbs::link::VerbsLink::begin_direct_wait`]). False: the channel is not armed,
    /// drive again instead of blocking.
    pub(super) fn watch_link_directly(&mut self, fds: &mut WaitFds) -> bool {
        if !fds.spin && self.conn.as_ref().is_some_and(Link::owed) {
            // A wait that sleeps at once needs an armed queue: settle the owed one, then look
            // again rather than sleep (what settling drove is news nobody announced: this
            // wait is not counted among the waiters yet).
            self.settle_direct_wait();
            return false;
        }
        let Some(conn) = self.conn.as_mut() else {
            return true;
        };
        match conn.begin_direct_wait() {
            Ok(link) => {
                fds.link = link;
                true
            }
            Err(NotArmed) => false,
        }
    }
}

/// A nonblocking, close-on-exec eventfd above the application's descriptor numbers.
fn new_eventfd() -> Option<OwnedFd> {
    // SAFETY: plain eventfd(2); the result is owned below.
    let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if raw < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let bell = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    Some(crate::mirror::relocate_internal_fd(bell))
}
