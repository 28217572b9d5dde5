//! The socket's readiness mirror's watched end (what poll/select/epoll watch in place of the TCP
//! socket): kept exact after reads and sends, raised by whoever drives a verbs session, and
//! the peer's end told of our FIN.

use std::os::fd::{AsFd, AsRawFd, RawFd};

use super::{Phase, SanSocket};
use crate::fdtable::table;
use crate::mirror::{self, ReadLowering, WriteLowering};
use crate::record::SocketRecord;
use crate::san::tunables::{EARLY_LIMIT, EDGE_TOKENS_LEFT};
use switch::session::{ResetCause, Session, SessionState};

impl SanSocket {
    /// The kernel reported hang-up on our mirror end: the peer's end was closed (its process
    /// died, or it closed the socket). The next [`SanSocket::service`] checks its liveness
    /// instead of waiting for the provider's interval.
    pub(crate) fn mirror_hung_up(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            conn.check_liveness_soon();
        }
    }

    /// Once our FIN has left (nothing queued before it), shuts the peer's raising end for writing
    /// so its watched end reports RDHUP like a TCP socket that received a FIN.
    pub(super) fn mirror_fin(&mut self) {
        if self.fin_mirrored || !self.write_shut || self.deferred_shutdown.is_some() {
            return;
        }
        let Some(session) = self.session.as_ref() else {
            return;
        };
        if session.send_queue_len() != 0
            || !self.early.is_empty()
            || session.state() == SessionState::Handshaking
        {
            return;
        }
        if let Some((k, _)) = self.peer.get() {
            let _ = mirror::mirror_peer_fin(k);
            self.fin_mirrored = true;
        }
    }

    /// The peer closed gracefully (its FIN came, and nothing since was a reset for us: the
    /// end of its connection afterwards is how a close looks on the link). TCP calls this
    /// `CLOSE_WAIT` and reports IN, OUT and RDHUP: no error, and a hang-up only once we shut
    /// down writing too. The watched end hangs up as soon as the peer's raising end closes,
    /// and the session counts the link's end as an error; the readiness hooks correct both.
    /// Our first send afterwards is answered by a reset, as over TCP.
    pub(crate) fn peer_closed_gracefully(&self) -> bool {
        self.peer_fin
            && !self.sent_after_fin
            && matches!(self.reset_cause, None | Some(ResetCause::Provider(_)))
    }

    /// Corrects what the kernel reported on the watched end (`POLLERR` and `POLLHUP` bits,
    /// which have the same values for epoll) to what TCP reports after the peer's
    /// graceful close (see [`SanSocket::peer_closed_gracefully`]).
    pub(crate) fn correct_close_bits(&self, revents: u32) -> u32 {
        if !self.peer_closed_gracefully() {
            return revents;
        }
        let mut cleared = libc::POLLERR as u32;
        if !self.write_shut {
            cleared |= libc::POLLHUP as u32;
        }
        revents & !cleared
    }

    /// The session's readiness (all false before the switch).
    pub(crate) fn readiness(&self) -> switch::session::Readiness {
        let mut readiness = self
            .session
            .as_ref()
            .map(Session::readiness)
            .unwrap_or_default();
        readiness.readable |= !self.restored.is_empty();
        readiness
    }

    /// After a read: if nothing more is readable, lowers the watched end so level-triggered waiters and
    /// `poll()` stop reporting it (no system call when it is already low). Left raised under
    /// [`SanSocket::lazy_lowering`]: the next epoll wait lowers it if nothing came by then.
    pub(crate) fn settle_readable(&mut self) {
        if self.watched
            && !self.lazy_lowering
            && !self.leaves_edge_tokens()
            && !self.readiness().readable
        {
            let _ = self.lower_readable();
        }
    }

    /// Whether a read that emptied the queue may leave the mirror's arrival tokens unread
    /// (see [`SanSocket::edge_only`]): only edge-triggered registrations watch it, and fewer
    /// than [`EDGE_TOKENS_LEFT`] tokens are unclaimed, so the peer, which writes one per
    /// arrival up to a bound far above that, still makes an edge for every arrival.
    pub(crate) fn leaves_edge_tokens(&self) -> bool {
        self.edge_only
            && self
                .mirror
                .as_ref()
                .is_some_and(|mirror| mirror.words().unclaimed_tokens() < EDGE_TOKENS_LEFT)
    }

    /// Lowers a mirror whose tokens reads left behind ([`SanSocket::leaves_edge_tokens`])
    /// before something that sees its level: a registration added or changed (the kernel
    /// reports a readable file at once), other kinds of watchers.
    pub(crate) fn settle_edge_tokens(&mut self) {
        if self.edge_only && !self.readiness().readable {
            let _ = self.lower_readable();
        }
    }

    /// After a receive found nothing: lowers the watched end's readability (so a level-triggered waiter
    /// sleeps) unless data arrived meanwhile. Returns true when the caller may report EAGAIN.
    pub(crate) fn lower_readable(&mut self) -> bool {
        let (Some(mirror), Some(conn)) = (self.mirror.as_mut(), self.conn.as_ref()) else {
            return true;
        };
        let session = self.session.as_ref();
        let has_data =
            || session.is_some_and(|s| s.readiness().readable) || !conn.prepare_to_block();
        let lowered = mirror.lower_readable(has_data);
        self.done_blocking();
        !matches!(lowered, Ok(ReadLowering::StillReadable))
    }

    /// After a send found no room: lowers the watched end's writability until the peer returns space.
    /// Returns true when the caller may report EAGAIN.
    pub(crate) fn lower_writable(&mut self) -> bool {
        let Some(mirror) = self.mirror.as_mut() else {
            return true;
        };
        let session = self.session.as_ref();
        let conn = self.conn.as_ref();
        let early_room = self.early.len() < EARLY_LIMIT;
        let lowered = mirror.lower_writable(|| {
            // Credits the peer already put in our ring raised nothing (we were not lowered
            // yet): they count as room, found by the caller's next drive. So does a ring for
            // room it made for sends the provider holds back (its raise found us not lowered).
            conn.is_some_and(|conn| conn.has_input() || conn.rung())
                || session.is_some_and(|s| {
                    if s.state() == SessionState::Handshaking {
                        early_room
                    } else {
                        s.readiness().writable
                    }
                })
        });
        !matches!(lowered, Ok(WriteLowering::StillWritable))
    }

    /// The watched end (what epoll/poll watch in place of the TCP socket).
    pub(crate) fn mirror_fd(&self) -> Option<RawFd> {
        self.mirror.as_ref().map(|m| m.as_fd().as_raw_fd())
    }

    /// Whether an edge-triggered epoll registration watches the watched end: the peer then raises it for
    /// every arrival, as a TCP socket signals every arriving segment (see
    /// [`crate::mirror::Mirror::set_edge_per_arrival`]).
    pub(crate) fn set_edge_per_arrival(&self, on: bool) {
        if let Some(mirror) = self.mirror.as_ref() {
            mirror.set_edge_per_arrival(on);
        }
    }

    /// The epoll registrations watching this socket (`record`'s) changed: while one has
    /// `EPOLLET` the peer raises on every arrival; lazy lowering (see
    /// [`SanSocket::lazy_lowering`]) while all are plain level-triggered ones, unchanged when
    /// none is left (an event loop that removes its registration adds one back soon).
    /// Leaving lazy lowering lowers a mirror left raised.
    pub(crate) fn registrations_changed(&mut self, record: &SocketRecord) {
        let kinds = registration_kinds(record);
        self.set_edge_per_arrival(kinds.edge_triggered);
        let was_edge_only = core::mem::replace(&mut self.edge_only, kinds.edge_only);
        let lazy = kinds.lazy.unwrap_or(self.lazy_lowering);
        let was_lazy = core::mem::replace(&mut self.lazy_lowering, lazy);
        if (was_lazy && !lazy) || (was_edge_only && !self.edge_only) {
            self.settle_readable();
        }
    }

    /// `poll`/`select` watch this socket for input: they too look for the next message
    /// before they sleep, so lazy lowering (see [`SanSocket::lazy_lowering`]) goes on, unless
    /// an epoll registration needs the mirror exact (edge-triggered, one-shot, nested).
    pub(crate) fn polled_for_input(&mut self, record: &SocketRecord) {
        if !self.lazy_lowering {
            let lazy = registration_kinds(record).lazy;
            self.lazy_lowering = lazy.unwrap_or(crate::settings::poll_us() > 0);
        }
    }

    /// The mirror is raised with nothing to read (left so by a read under lazy lowering):
    /// a wait that begins now returns at once, before it could sleep. (`tcp`: this socket's
    /// kernel socket.)
    pub(crate) fn raised_without_data(&self, tcp: RawFd) -> bool {
        self.mirror
            .as_ref()
            .is_some_and(|mirror| mirror.words().is_readable_raised())
            && !self.readiness().readable
            && !self.tcp_bytes_readable(tcp)
    }

    /// What a TCP socket polled for input alone reports now is exactly `POLLIN`: bytes to read,
    /// and no FIN, error or shutdown of ours (which add or change other bits). (`tcp`: this
    /// socket's kernel socket.)
    pub(crate) fn plain_input(&self, tcp: RawFd) -> bool {
        let readiness = self.readiness();
        (readiness.readable || self.tcp_bytes_readable(tcp))
            && !readiness.read_hup
            && !readiness.error
            && !self.write_shut
            && !self.peer_closed_gracefully()
    }

    /// What a TCP socket polled for output alone reports now is exactly `POLLOUT`: switched,
    /// room for a send, and no error, shutdown or end of the peer's stream (which add or
    /// change other bits).
    pub(crate) fn plainly_writable(&self) -> bool {
        let readiness = self.readiness();
        self.phase == Phase::Switched
            && readiness.writable
            && !readiness.error
            && !readiness.read_hup
            && !self.write_shut
            && !self.peer_closed_gracefully()
    }

    /// Verbs: the peer cannot raise our mirror, so whoever drives the session does.
    pub(super) fn raise_own_mirror(&self) {
        let Some(conn) = self.conn.as_ref().filter(|conn| !conn.is_intra_host()) else {
            return;
        };
        if self.phase != Phase::Switched {
            return;
        }
        let readiness = self.readiness();
        // Acceptor: the client's pre-switch bytes wait on TCP, read before the session's;
        // the application watches the mirror, not TCP, so they make the mirror readable.
        // Readable only while poll/select/epoll watch the watched end: a thread blocked in a call waits
        // on the connection's fd and the bell instead (a token written and read back per
        // message otherwise). `set_watched` raises what is due when watching starts.
        let readable =
            self.watched && (readiness.readable || self.tcp_backlog().is_some_and(|left| left > 0));
        let writable = readiness.writable
            || self
                .session
                .as_ref()
                .is_some_and(|s| s.state() == SessionState::Handshaking)
                && self.early.len() < EARLY_LIMIT;
        conn.raise_own_mirror(readable, writable);
    }

    /// poll/select/epoll watch the watched end from now on: over verbs, where the watched end's readability is kept
    /// only while watched, it is raised now if data waits.
    pub(crate) fn set_watched(&mut self) {
        if !self.watched {
            self.watched = true;
            self.raise_own_mirror();
        }
    }
}

/// What kinds of epoll registrations watch a socket (see [`registration_kinds`]).
struct RegistrationKinds {
    /// One is edge-triggered: the peer raises on every arrival.
    edge_triggered: bool,
    /// Some, all plain level-triggered ones ([`SanSocket::lazy_lowering`] may go on); `None`:
    /// there are none.
    lazy: Option<bool>,
    /// Some, all edge-triggered, none one-shot, none in a nested instance
    /// ([`SanSocket::edge_only`]).
    edge_only: bool,
}

/// `record`'s epoll registrations: whether one is edge-triggered, whether there are
/// some and all are plain level-triggered ones (what [`SanSocket::lazy_lowering`]
/// needs: a one-shot registration must not be handed a raised mirror without data), or
/// there are none (`None`: lazy lowering may go on, as event loops remove and add their
/// registrations between requests), and whether all are edge-triggered ones that report
/// only arrivals ([`SanSocket::edge_only`]: a one-shot one is re-armed by a change, which
/// reports a raised mirror; an outer instance sees a nested one's level).
fn registration_kinds(record: &SocketRecord) -> RegistrationKinds {
    let special = (libc::EPOLLET | libc::EPOLLONESHOT) as u32;
    let mut any = false;
    let mut edge_triggered = false;
    let mut all_plain = true;
    let mut all_edge_only = true;
    for (epfd, events, _) in record.epoll_registrations() {
        any = true;
        let edge = events & libc::EPOLLET as u32 != 0;
        edge_triggered |= edge;
        // A nested instance's readiness is watched by the outer one: a mirror raised
        // without data would make it readable without an event.
        let nested = table().lookup(epfd).is_nested_epoll();
        all_plain &= events & special == 0 && !nested;
        all_edge_only &= edge && events & libc::EPOLLONESHOT as u32 == 0 && !nested;
    }
    let lazy = all_plain && crate::settings::poll_us() > 0;
    RegistrationKinds {
        edge_triggered,
        lazy: any.then_some(lazy),
        edge_only: any && all_edge_only,
    }
}
