//! One SAN socket: the segment, the session, the readiness mirror and the switch-over state.
//!
//! Everything here runs with the socket's lock held (see [`super::table::slot`]) and never
//! blocks in the kernel: the blocking loops of the calls release the lock around `poll()`.
//!
//! This file holds the type and its set-up (shm and verbs, client and acceptor); each
//! concern of the socket's life is an `impl SanSocket` in a file of its own: [`pending`]
//! (a pending client's switch-over and the switch marker), [`drive`] (driving the
//! session), [`early`] (bytes sent before the handshake finished), [`stream`] (sending and
//! receiving, inline and rendezvous), [`downgrade`] (back to kernel TCP, and absorbing a
//! stalled peer's data), [`mirror`] (readiness), [`wait`] (blocking) and [`close`].

mod close;
mod downgrade;
mod drive;
mod early;
mod journal;
mod mirror;
mod pending;
pub(crate) mod stream;
pub(crate) mod wait;

use core::ffi::c_int;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use san_shm::{ConnectionConfig, Doorbell, NamespacedPid, PeerProcess, ShmConnection, ShmSegment};
use switch::error::{RecvError, SendError};
use switch::mr_cache::OwnerId;
use switch::session::{
    MrHandleId, Pump, RecvTicket, ResetCause, Role, SendTicket, Session, SessionConfig,
};

use super::budget::Charge;
use super::exchange::{self, SideWords, WordsPage, MIRROR_END, PIDFD, WORDS_PAGE};
use super::link::{own_pid, Link};
use super::provider::{rdma_read_offered, rendezvous_enabled};
use super::registrations::SharedRegistrations;
use super::tunables::{
    shm_segment_config, SHM_RENDEZVOUS_THRESHOLD, SHM_SEND_BUFFER, SLOTS,
    VERBS_RENDEZVOUS_THRESHOLD, VERBS_SLOTS,
};
use super::verbs::link::VerbsLink;
use crate::discovery::SegmentName;
use crate::mirror::{Mirror, MirrorEnds};
use crate::record::SocketRecord;

/// The one byte the acceptor writes on TCP after attaching: "switch now".
pub(crate) const SWITCH_MARKER: u8 = 0x5a;
/// Bytes of the switch marker of a connection between two users (the marker byte and the
/// private segment's token, see [`SanSocket::private_marker`]).
const PRIVATE_MARKER_LEN: usize = 9;
/// How long a client that found part of such a marker on TCP waits for the rest.
const PRIVATE_MARKER_WAIT: Duration = Duration::from_millis(50);

/// Index of the connecting side's words in the shared page (the acceptor's is 1).
const CLIENT_WORDS: usize = 0;
const ACCEPTOR_WORDS: usize = 1;

fn connection_config() -> ConnectionConfig {
    ConnectionConfig {
        // The acceptor's Hello waits in the provider until the client switches, which happens
        // at the client's next socket call: possibly much later. Credits make a real
        // receiver-not-ready impossible after that, so the timer is only a bug catcher.
        rnr_timeout: Duration::from_secs(3600),
        ..ConnectionConfig::default()
    }
}

/// The session configuration of an intra-host connection; `rendezvous`: whether this side
/// offers rendezvous (see [`Link::offers_rendezvous`]).
fn session_config(rendezvous: bool) -> SessionConfig {
    let defaults = SessionConfig::default();
    SessionConfig {
        // `u32::MAX` announces "never": the negotiated threshold is the larger of both sides'.
        rendezvous_threshold: if rendezvous {
            SHM_RENDEZVOUS_THRESHOLD
        } else {
            u32::MAX
        },
        send_buffer: SHM_SEND_BUFFER,
        // A shm slot keeps its bytes until re-posted, for as long as the connection (and
        // its mapping) lives, which is until the application closes the socket: reads copy
        // straight out of the peer-written slot.
        receive_in_slots: true,
        // Sends staged in the peer's posted slots are published only once their copy
        // succeeded: an inline send then copies each byte once, from the application to
        // the peer's slot.
        send_in_slots: true,
        ..defaults
    }
}

/// Owner ids of the registration cache: one per SAN socket, never reused (record indices
/// are, and a late release must not hit a newer socket's references).
static NEXT_OWNER: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(1);

fn next_owner() -> OwnerId {
    OwnerId(NEXT_OWNER.fetch_add(1, core::sync::atomic::Ordering::Relaxed))
}

/// Which end of the TCP connection this socket is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    /// `connect()`ed: creates the segment, switches when it sees the attach.
    Client,
    /// `accept()`ed: attached inside `accept()`.
    Acceptor,
}

/// Where the socket is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Client only: the segment exists, the acceptor has not attached; bytes go over TCP and
    /// are counted.
    Pending,
    /// Data flows through the session.
    Switched,
}

/// The peer's raising end and its words, learnt at the switch (client) or lazily after it
/// (acceptor). Read by the doorbell from inside the provider.
#[derive(Debug, Default)]
pub(crate) struct PeerMirror {
    end: OnceLock<(OwnedFd, SideWords)>,
}

impl PeerMirror {
    fn get(&self) -> Option<(BorrowedFd<'_>, &SideWords)> {
        self.end.get().map(|(fd, words)| (fd.as_fd(), words))
    }

    fn raise_readable(&self) {
        if let Some((k, words)) = self.get() {
            crate::mirror::raise_readable(words, k);
        }
    }

    fn raise_writable(&self) {
        if let Some((k, words)) = self.get() {
            crate::mirror::raise_writable(words, k);
        }
    }
}

/// The provider's doorbell: the futex (for a peer in `ShmConnection::wait`) and the peer's
/// readiness mirror (for a peer blocked in `poll`/`epoll_wait`).
struct MirrorDoorbell(Arc<PeerMirror>);

impl Doorbell for MirrorDoorbell {
    fn ring(&self, bell: &AtomicU32) {
        san_shm::futex_wake(bell);
        self.0.raise_readable();
    }

    /// Room for the peer's held-back sends: its writability too (a sender waiting for a
    /// rendezvous completion watches that alone, and would sleep through a raise of its
    /// readability).
    fn ring_for_room(&self, bell: &AtomicU32) {
        self.ring(bell);
        self.0.raise_writable();
    }
}

/// Why a socket could not be set up; the connection stays on TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SocketSetupError {
    /// The peer is not preloaded (no exchange listener / no segment).
    PeerPlain,
    /// A resource or system call failed.
    Resource,
    /// Acceptor: the client runs in a pid namespace where we cannot name it (no pid of ours,
    /// no pidfd; see `exchange`, "Who the peer is"), so its death could not be noticed.
    PeerPidNamespace,
    /// Acceptor: the client withdrew its segment (it was shared with another process first)
    /// and stays on TCP.
    ClientWithdrew,
}

/// A SAN socket.
pub(crate) struct SanSocket {
    pub side: Side,
    pub phase: Phase,
    record: &'static SocketRecord,
    conn: Option<Link>,
    session: Option<Session>,
    mirror: Option<Mirror<SideWords>>,
    peer: Arc<PeerMirror>,
    page: Option<Arc<WordsPage>>,
    /// Client, pending, found through the segment directory: its exchange listener's socket
    /// file there (removed with this value).
    exchange_file: Option<exchange::ExchangeFile>,
    /// Client: the exchange listener while pending. Acceptor: the exchange connection until
    /// the client's raising end arrived.
    exchange: Option<OwnedFd>,
    /// Client, while pending: its port's entry in the pending-ports table (acceptors of the
    /// port probe while it is up).
    pending_mark: Option<san_shm::PendingMark>,
    /// Client of another user's server, while pending: its exchange listener and private
    /// segment, watched by the offer thread (see `super::other_users`).
    private_offer: Option<super::other_users::PendingOffer>,
    /// A connection between two users: the token of its private segment, which follows the
    /// switch marker on TCP (see [`SanSocket::private_marker`]). The client's own copy, never
    /// read back from the segment.
    private_token: Option<u64>,
    /// Client, shm, pending: what the switch needs, made before the client announced itself.
    reserve: Option<SwitchReserve>,
    /// Client: stream bytes written on TCP while pending.
    tcp_sent: u64,
    /// Acceptor: stream bytes read from TCP since the switch (exactly the client's count).
    tcp_received: u64,
    /// Acceptor: TCP said end-of-file before the client's count was known.
    tcp_eof: bool,
    /// Client: the switch marker is still unread on TCP.
    marker_unread: bool,
    /// The peer's FIN was delivered (a later provider error is then end-of-file, not reset).
    peer_fin: bool,
    /// Bytes the application sent before the handshake finished (the kernel would have
    /// buffered them): moved into the session, in order, once it is established.
    early: Vec<u8>,
    /// The segment's name (finds an in-process peer).
    pub name: SegmentName,
    /// The application shut down writing (refuse sends; our FIN follows the early bytes).
    write_shut: bool,
    /// A shutdown waiting for the early bytes to enter the session first.
    deferred_shutdown: Option<c_int>,
    /// Our FIN was mirrored to the peer's watched end (RDHUP there).
    fin_mirrored: bool,
    /// Stream bytes were queued since the peer's mirror was last raised readable.
    data_to_announce: bool,
    /// A reset was reported once (then reads see end-of-file, as after a kernel RST).
    reset_reported: bool,
    /// The session reset with this cause.
    reset_cause: Option<ResetCause>,
    /// A send was accepted after the peer's FIN (TCP answers the first one after the peer's
    /// close with a reset, so a later one fails).
    sent_after_fin: bool,
    /// The error that ended the kernel TCP connection beside the session (a keepalive
    /// timeout; see [`SanSocket::kernel_connection_failed`]): reported once in place
    /// of `ECONNRESET`, as the kernel reports its `sk_err`.
    kernel_error: Option<c_int>,
    /// Acceptor: the switch marker has not been written yet (it is, right after the attach,
    /// by `on_accepted`; the later calls are no-ops).
    marker_owed: bool,
    /// Threads blocked on this socket right now.
    waiters: u32,
    /// `poll`/`select`/`epoll` watch this socket's mirror: its readability must then be kept
    /// exact after every read (costs two system calls per emptied queue, so only then).
    pub watched: bool,
    /// Only plain level-triggered epoll registrations, or `poll`/`select` waiting for input,
    /// watch this socket (no `EPOLLET`, no `EPOLLONESHOT`, no nested epoll instance): a read
    /// that empties the queue then leaves the mirror raised, and the wait that next finds it
    /// raised without data looks for the next message before it lowers it and sleeps
    /// (`san::readiness`, "Looking before sleeping"). A raised mirror also spares the peer its
    /// token write for that message.
    pub lazy_lowering: bool,
    /// Only edge-triggered epoll registrations watch this socket (no `EPOLLONESHOT`, no
    /// nested instance): a read that empties the queue leaves the arrival tokens in the
    /// mirror until a few have gathered (see `SanSocket::leaves_edge_tokens`). Such a
    /// registration reports only new arrivals, each of which writes its own token, so tokens
    /// already read change nothing it reports; lowering at every read cost a system call
    /// per request (nginx).
    pub edge_only: bool,
    /// Under lazy lowering: how many epoll waits in a row that had other events to hand out
    /// found this mirror raised without data and left it so (see
    /// `san::readiness::lower_deferred`); reset when a wait finds data.
    pub raised_idle_waits: u8,
    /// An eventfd the blocked threads also poll: a thread whose call made progress (consumed
    /// the mirror token, took in credits or data) rings it so the others re-check.
    local_bell: Option<OwnedFd>,
    /// Polled by threads waiting while the client is pending (their wait is on the TCP
    /// socket); rung once when the socket switches, since the switch marker another thread
    /// consumed will not wake them. Never polled after the switch, so it is not reset.
    pending_bell: Option<OwnedFd>,
    released: Vec<MrHandleId>,
    /// The driver's scratch buffers, kept so that a data call allocates nothing for them.
    pump: Pump,
    /// This socket's owner id in the registration cache.
    owner: OwnerId,
    /// The outcome of the last rendezvous send, until its caller collects it.
    send_completed: Option<(SendTicket, Result<u64, SendError>)>,
    /// The outcome of the last zero-copy receive, until its caller collects it.
    recv_completed: Option<(RecvTicket, Result<u64, RecvError>)>,
    /// This side asked for a downgrade to kernel TCP (fork, exec): our sends go to TCP from
    /// then on, and the session's `Downgrade` follows whatever it still has queued.
    downgrade_wanted: bool,
    /// The session accepted our downgrade (its `Downgrade` follows what it has queued).
    downgrade_sent: bool,
    /// Bytes taken out of the session ahead of the application, read before anything the
    /// session still holds: what a downgrade drained but could not hand over (the peer did
    /// not answer in time), and what a sender blocked on a stalled peer absorbed
    /// ([`SanSocket::absorb_if_stalled`]), as a kernel receive buffer holds it.
    restored: Vec<u8>,
    /// Stream bytes the session accepted from the application (inline and by rendezvous):
    /// where our journal's stream ends (see `journal`).
    stream_accepted: u64,
    /// Of those, the bytes the last inline send put in the session (journaled after the
    /// drive that follows it).
    just_accepted: usize,
    /// An inline send posted messages itself (straight into the peer's slots, outside any
    /// drive): the next drive announces them as it announces what it transmits.
    sent_outside_drive: bool,
    /// Stream bytes of the peer's the application has read.
    stream_consumed: u64,
    /// The journal could not be allocated: the connection is moving to TCP.
    journal_lost: bool,
    /// The last this many bytes of `early` are not in the journal yet (it could not take them
    /// when they were accepted): they are journaled as they enter the session.
    early_unjournaled: usize,
    /// The leftovers of a peer that ended were looked for.
    leftovers_taken: bool,
    /// After a downgrade the application's epoll sets watch the TCP socket again.
    pub epoll_on_tcp: bool,
    /// This socket's share of the process's SAN memory budget (see `budget`): given back
    /// when the socket is dropped, however it ends (held for its `Drop` alone).
    _charge: Option<Charge>,
}

impl core::fmt::Debug for SanSocket {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SanSocket")
            .field("side", &self.side)
            .field("phase", &self.phase)
            .field("tcp_sent", &self.tcp_sent)
            .field("tcp_received", &self.tcp_received)
            .finish_non_exhaustive()
    }
}

impl SanSocket {
    /// A socket on `conn` in its initial state: pending, no session, mirror, page or
    /// exchange yet. The one list of every field's starting value (the constructors set
    /// what differs).
    fn fresh(
        record: &'static SocketRecord,
        side: Side,
        name: &SegmentName,
        conn: Link,
        peer: Arc<PeerMirror>,
        charge: Option<Charge>,
    ) -> SanSocket {
        SanSocket {
            side,
            phase: Phase::Pending,
            record,
            conn: Some(conn),
            session: None,
            mirror: None,
            peer,
            page: None,
            exchange: None,
            reserve: None,
            tcp_sent: 0,
            tcp_received: 0,
            tcp_eof: false,
            marker_unread: side == Side::Client,
            peer_fin: false,
            early: Vec::new(),
            name: *name,
            write_shut: false,
            deferred_shutdown: None,
            fin_mirrored: false,
            data_to_announce: false,
            reset_reported: false,
            reset_cause: None,
            sent_after_fin: false,
            kernel_error: None,
            marker_owed: false,
            waiters: 0,
            watched: false,
            lazy_lowering: false,
            edge_only: false,
            raised_idle_waits: 0,
            local_bell: None,
            pending_bell: None,
            exchange_file: None,
            released: Vec::new(),
            pump: Pump::new(),
            owner: next_owner(),
            send_completed: None,
            recv_completed: None,
            downgrade_wanted: false,
            downgrade_sent: false,
            restored: Vec::new(),
            stream_accepted: 0,
            just_accepted: 0,
            sent_outside_drive: false,
            stream_consumed: 0,
            journal_lost: false,
            early_unjournaled: 0,
            leftovers_taken: false,
            epoll_on_tcp: false,
            pending_mark: None,
            private_offer: None,
            private_token: None,
            _charge: charge,
        }
    }

    /// The connecting side after its TCP connect succeeded and the listener probe said
    /// "preloaded": creates the exchange listener and the segment; the socket is pending and
    /// holds `charge`.
    pub(crate) fn client(
        record: &'static SocketRecord,
        dir: &san_shm::ShmDir,
        name: &SegmentName,
        registrations: &super::registrations::SharedRegistrations,
        charge: Charge,
        pending: Option<san_shm::PendingMark>,
        through_dir: bool,
    ) -> Result<SanSocket, SocketSetupError> {
        let (listener, exchange_file) =
            exchange::listen(name, through_dir.then_some(dir)).ok_or(SocketSetupError::Resource)?;
        let reserve = SwitchReserve::new(listener.as_fd())?;
        let create = || ShmSegment::create(dir, name.as_str(), &shm_segment_config());
        let segment = match create() {
            Err(san_shm::ShmError::Io {
                errno: libc::ENOSPC,
                ..
            }) if remove_dead_stats_files() => create(),
            created => created,
        }
        .map_err(|_| SocketSetupError::Resource)?;
        let (conn, peer) = shm_connection(segment, registrations, None)?;
        let mut socket = Self::fresh(record, Side::Client, name, conn.into(), peer, Some(charge));
        socket.exchange = Some(listener);
        socket.exchange_file = exchange_file;
        socket.reserve = Some(reserve);
        socket.pending_mark = pending;
        Ok(socket)
    }

    /// The connecting side of a connection to another user's server (see
    /// `super::other_users`): as [`SanSocket::client`], with a private segment that no
    /// directory names, and its exchange listener at the name acceptors of other users probe,
    /// handed to the offer thread with the segment's descriptor.
    pub(crate) fn client_private(
        record: &'static SocketRecord,
        name: &SegmentName,
        registrations: &super::registrations::SharedRegistrations,
        charge: Charge,
    ) -> Result<SanSocket, SocketSetupError> {
        let listener = exchange::listen_for_other_user(name).ok_or(SocketSetupError::Resource)?;
        let reserve = SwitchReserve::new(listener.as_fd())?;
        let token = super::provider::random_u64();
        let (segment, memfd) = ShmSegment::create_private(&shm_segment_config(), token)
            .map_err(|_| SocketSetupError::Resource)?;
        let (conn, peer) = shm_connection(segment, registrations, None)?;
        let offer = super::other_users::PendingOffer::new(listener, memfd)
            .ok_or(SocketSetupError::Resource)?;
        let mut socket = Self::fresh(record, Side::Client, name, conn.into(), peer, Some(charge));
        socket.private_offer = Some(offer);
        socket.private_token = Some(token);
        socket.reserve = Some(reserve);
        Ok(socket)
    }

    /// The accepting side of a connection from a client of another user, at the
    /// connection's first use: `link` is our connection to the client's exchange (its user
    /// checked). Queues our mirror end and words page, waits (bounded) for the private
    /// segment, checks and attaches it, and starts the session, as [`SanSocket::acceptor`].
    pub(crate) fn acceptor_private(
        record: &'static SocketRecord,
        link: OwnedFd,
        name: &SegmentName,
        registrations: &super::registrations::SharedRegistrations,
        charge: Charge,
    ) -> Result<SanSocket, SocketSetupError> {
        let client = exchange::peer_process(link.as_fd(), None);
        if !client.is_known() {
            return Err(SocketSetupError::PeerPidNamespace);
        }
        let (our_mirror, page) = offer_on(link.as_fd())?;
        let memfd =
            super::other_users::receive_segment(link.as_fd(), super::other_users::SEGMENT_WAIT)
                .ok_or(SocketSetupError::PeerPlain)?;
        // Checked before it is mapped: a sealed memfd, its header valid (see
        // `ShmSegment::attach_private`); attaching last, as for any acceptor.
        let segment = ShmSegment::attach_private(memfd.as_fd()).map_err(attach_failure)?;
        drop(memfd);
        let token = segment.private_token().ok_or(SocketSetupError::PeerPlain)?;
        let accepted = AcceptedSegment {
            segment,
            client,
            link,
            our_mirror,
            page,
        };
        let mut socket = Self::accepting_over(record, name, registrations, charge, accepted)?;
        socket.private_token = Some(token);
        Ok(socket.accepted())
    }

    /// The switch marker of a connection between two users: the marker byte, then the
    /// private segment's token. The client switches only once it found exactly these bytes
    /// first on TCP with its segment attached: only the process that accepted the
    /// connection can write on it, and only the process it gave the segment to knows the
    /// token, so a process of a named user that took the segment in the acceptor's place
    /// never talks SAN with the client (the connection stays on TCP, exactly).
    pub(super) fn private_marker(&self) -> Option<[u8; PRIVATE_MARKER_LEN]> {
        let token = self.private_token?;
        let mut marker = [SWITCH_MARKER; PRIVATE_MARKER_LEN];
        marker[1..].copy_from_slice(&token.to_le_bytes());
        Some(marker)
    }

    /// Client, pending, segment attached: whether the acceptor's marker is first on TCP
    /// (always, but for a connection between two users, where it carries the token: see
    /// [`SanSocket::private_marker`]). `settle`: bytes were seen on TCP; a marker that
    /// arrived in part is waited for (bounded).
    fn private_marker_arrived(&self, tcp: c_int, settle: bool) -> bool {
        let Some(expected) = self.private_marker() else {
            return true;
        };
        let deadline = std::time::Instant::now() + PRIVATE_MARKER_WAIT;
        loop {
            let mut seen = [0u8; PRIVATE_MARKER_LEN];
            // SAFETY: `seen` is writable for its length.
            let n = unsafe {
                crate::real::recv(
                    tcp,
                    seen.as_mut_ptr().cast(),
                    seen.len(),
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            let Ok(n) = usize::try_from(n) else {
                return false;
            };
            if n == PRIVATE_MARKER_LEN || n == 0 || seen[..n] != expected[..n] {
                return seen == expected;
            }
            // Part of it: the rest was written with it.
            let now = std::time::Instant::now();
            if !settle || now >= deadline {
                return false;
            }
            let mut entry = libc::pollfd {
                fd: tcp,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd; a short bounded wait.
            unsafe { crate::real::poll(&mut entry, 1, 1) };
        }
    }

    /// Client of another user's server, pending, its segment attached (a fork or exec about
    /// to downgrade it): waits up to [`PRIVATE_MARKER_WAIT`] for the acceptor's marker and
    /// token to reach TCP, so that the switch (then the downgrade) can happen. Anything else
    /// returns at once.
    pub(crate) fn await_private_marker(&self, tcp: c_int) {
        let attached = self
            .conn
            .as_ref()
            .is_some_and(|conn| conn.peer_attached(tcp));
        if self.private_token.is_none() || !attached || self.private_marker_arrived(tcp, false) {
            return;
        }
        let mut entry = libc::pollfd {
            fd: tcp,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd; a bounded wait.
        unsafe { crate::real::poll(&mut entry, 1, PRIVATE_MARKER_WAIT.as_millis() as c_int) };
        // A marker that arrived in part is completed by the switch's own look.
        let _ = self.private_marker_arrived(tcp, true);
    }

    /// Client of another user's server, pending: the acceptor's exchange connection, once
    /// the offer thread gave it our segment (`None` for any other socket).
    pub(super) fn take_private_link(&mut self) -> Option<Option<OwnedFd>> {
        let offer = self.private_offer.take()?;
        Some(offer.take_link())
    }

    /// The accepting side, inside `accept()`: connects to the client's exchange, passes its
    /// mirror end and the words page, attaches the segment and starts the session (it has
    /// sent nothing on TCP). The caller then writes the switch marker
    /// ([`SanSocket::wake_pending_client`]). The socket holds `charge`.
    pub(crate) fn acceptor(
        record: &'static SocketRecord,
        dir: &san_shm::ShmDir,
        name: &SegmentName,
        registrations: &super::registrations::SharedRegistrations,
        charge: Charge,
    ) -> Result<SanSocket, SocketSetupError> {
        let (link, our_mirror, page) = offer_mirror(name, Some(dir))?;
        let client = exchange::peer_process(link.as_fd(), None);
        if !client.is_known() {
            return Err(SocketSetupError::PeerPidNamespace);
        }
        // Attach last: the client switches when it sees the attach, and by then everything
        // it needs is queued on the exchange.
        let segment = ShmSegment::attach(dir, name.as_str()).map_err(attach_failure)?;
        let _ = segment.unlink();
        let accepted = AcceptedSegment {
            segment,
            client,
            link,
            our_mirror,
            page,
        };
        Ok(Self::accepting_over(record, name, registrations, charge, accepted)?.accepted())
    }

    /// What both acceptors share once the segment is attached: the connection over it, the
    /// passive session started with our mirror end and words page, the exchange kept.
    fn accepting_over(
        record: &'static SocketRecord,
        name: &SegmentName,
        registrations: &super::registrations::SharedRegistrations,
        charge: Charge,
        accepted: AcceptedSegment,
    ) -> Result<SanSocket, SocketSetupError> {
        let AcceptedSegment {
            segment,
            client,
            link,
            our_mirror,
            page,
        } = accepted;
        let (conn, peer) = shm_connection(segment, registrations, Some(client))?;
        let session = Session::new(
            Role::Passive,
            session_config(rendezvous_enabled()),
            conn.capabilities(),
            SLOTS,
            0,
        );
        let mut socket = Self::fresh(
            record,
            Side::Acceptor,
            name,
            conn.into(),
            peer,
            Some(charge),
        );
        socket.exchange = Some(link);
        socket.start_session(session, our_mirror, page);
        Ok(socket)
    }

    /// Unit tests: a socket over `conn` (an in-process simulated connection) in place of a
    /// shm segment, set up as [`SanSocket::client`] (pending, exchange listener up) or
    /// [`SanSocket::acceptor`] (mirror end and words page queued on the exchange, session
    /// started, our `Hello` out) would set it up. The caller marks the link attached
    /// afterwards, as the segment attach comes last.
    #[cfg(test)]
    pub(crate) fn over_link(
        record: &'static SocketRecord,
        side: Side,
        name: &SegmentName,
        conn: Link,
    ) -> Result<SanSocket, SocketSetupError> {
        let peer = Arc::new(PeerMirror::default());
        if side == Side::Client {
            let (listener, _) = exchange::listen(name, None).ok_or(SocketSetupError::Resource)?;
            let reserve = SwitchReserve::new(listener.as_fd())?;
            let mut socket = Self::fresh(record, Side::Client, name, conn, peer, None);
            socket.exchange = Some(listener);
            socket.reserve = Some(reserve);
            return Ok(socket);
        }
        let (link, our_mirror, page) = offer_mirror(name, None)?;
        let session = Session::new(
            Role::Passive,
            session_config(conn.offers_rendezvous()),
            conn.capabilities(),
            SLOTS,
            0,
        );
        let mut socket = Self::fresh(record, Side::Acceptor, name, conn, peer, None);
        socket.exchange = Some(link);
        socket.start_session(session, our_mirror, page);
        Ok(socket.accepted())
    }

    fn with_link(
        record: &'static SocketRecord,
        side: Side,
        name: &SegmentName,
        link: VerbsLink,
        charge: Charge,
    ) -> SanSocket {
        Self::fresh(
            record,
            side,
            name,
            Link::Verbs(link),
            Arc::new(PeerMirror::default()),
            Some(charge),
        )
    }

    /// A pending verbs client (its CM listener is up; see `super::verbs::connect::client`),
    /// holding `charge`. Its acceptor's token takes the marker's place and is consumed by the
    /// switch itself: no marker is left to read after it.
    pub(crate) fn verbs_client(
        record: &'static SocketRecord,
        name: &SegmentName,
        link: VerbsLink,
        charge: Charge,
    ) -> SanSocket {
        let mut socket = Self::with_link(record, Side::Client, name, link, charge);
        socket.marker_unread = false;
        socket
    }

    /// The accepting side after its CM connect to the client was established: the session
    /// starts with `tcp_bytes_sent = 0`; the caller writes the switch marker. The socket
    /// holds `charge`.
    pub(crate) fn verbs_acceptor(
        record: &'static SocketRecord,
        name: &SegmentName,
        link: VerbsLink,
        charge: Charge,
    ) -> Result<SanSocket, SocketSetupError> {
        let mut socket = Self::with_link(record, Side::Acceptor, name, link, charge);
        socket.start_verbs_session(Role::Passive)?;
        Ok(socket.accepted())
    }

    /// Creates the mirror (both ends local: the raising end stays with the link, for the service thread)
    /// and the session.
    pub(super) fn start_verbs_session(&mut self, role: Role) -> Result<(), SocketSetupError> {
        // Both words are ours: the memfd is not passed on.
        let (page, _memfd) = WordsPage::create().ok_or(SocketSetupError::Resource)?;
        let page = Arc::new(page);
        let (mirror, k) =
            Mirror::new(SideWords::new(page.clone(), 0)).map_err(|_| SocketSetupError::Resource)?;
        let link = self
            .conn
            .as_mut()
            .and_then(Link::verbs_mut)
            .ok_or(SocketSetupError::Resource)?;
        link.set_own_mirror(k, SideWords::new(page.clone(), 0));
        let mut capabilities = link.capabilities();
        // Not offering to read makes the peer's rendezvous sends WRITE mode.
        capabilities.rdma_read &= rdma_read_offered(capabilities.read_sink_needs_remote_write);
        let config = SessionConfig {
            rendezvous_threshold: if rendezvous_enabled() {
                VERBS_RENDEZVOUS_THRESHOLD
            } else {
                u32::MAX
            },
            ..SessionConfig::default()
        };
        let sent = if role == Role::Active {
            self.tcp_sent
        } else {
            0
        };
        let session = Session::new(role, config, capabilities, VERBS_SLOTS, sent);
        self.start_session(session, mirror, page);
        Ok(())
    }

    /// The session starts on this socket, with its mirror and words page: the socket is
    /// switched. Our `Hello` (and the receives it needs) goes out at the next service and
    /// must wake the peer. From now on the application's buffers are copied in user space:
    /// the fault handler that makes a bad one `EFAULT` is installed first (once per process).
    pub(super) fn start_session(
        &mut self,
        session: Session,
        mirror: Mirror<SideWords>,
        page: Arc<WordsPage>,
    ) {
        crate::fault::arm();
        self.session = Some(session);
        self.mirror = Some(mirror);
        self.page = Some(page);
        self.phase = Phase::Switched;
        self.ring_pending_bell();
        self.data_to_announce = true;
    }

    /// The accepting side's session started: the switch marker is owed (the caller writes
    /// it, see [`SanSocket::wake_pending_client`]) and our `Hello` goes out now.
    fn accepted(mut self) -> SanSocket {
        self.marker_owed = true;
        self.service();
        self.mark_switched();
        self
    }

    /// Client, TCP socket `tcp`: true once the acceptor attached (the switch may happen now).
    pub(crate) fn peer_attached(&self, tcp: c_int) -> bool {
        self.conn
            .as_ref()
            .is_some_and(|conn| conn.peer_attached(tcp))
            && self.private_marker_arrived(tcp, false)
    }

    /// As [`SanSocket::peer_attached`], after bytes were found on TCP: whether they are the
    /// switch marker (verbs: the start of a token is waited for, bounded).
    pub(crate) fn peer_attached_settled(&self, tcp: c_int) -> bool {
        self.conn
            .as_ref()
            .is_some_and(|conn| conn.peer_attached_settled(tcp))
            && self.private_marker_arrived(tcp, true)
    }

    /// Client, pending: withdraws the segment if no acceptor attached (see
    /// [`Link::withdraw`]).
    pub(crate) fn withdraw(&self) -> bool {
        self.conn.as_ref().is_some_and(Link::withdraw)
    }

    /// Client, pending: counts stream bytes the kernel accepted on TCP.
    pub(crate) fn count_tcp_sent(&mut self, bytes: u64) {
        self.tcp_sent += bytes;
    }

    /// Whether this socket's segment is private to the connection (a peer of another user).
    pub(crate) fn is_private(&self) -> bool {
        matches!(&self.conn, Some(Link::Shm(conn)) if conn.segment().is_private())
    }

    /// Whether this socket runs over verbs.
    pub(crate) fn is_verbs(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.verbs().is_some())
    }

    /// True for a connection to a process on this host (the `shm` provider).
    pub(crate) fn is_intra_host(&self) -> bool {
        self.conn.as_ref().is_some_and(Link::is_intra_host)
    }

    /// The peer when it is another process on this host (the one to nudge), named as its own
    /// pid namespace numbers it.
    pub(crate) fn peer_process(&self) -> Option<NamespacedPid> {
        self.conn
            .as_ref()
            .and_then(Link::peer_own_pid)
            .filter(|&peer| peer != own_pid())
    }

    /// True when the peer is this very process (both ends of an in-process connection): same
    /// pid in the same pid namespace.
    pub(crate) fn peer_in_process(&self) -> bool {
        self.conn
            .as_ref()
            .and_then(Link::peer_own_pid)
            .is_some_and(|peer| peer == own_pid())
    }

    /// Verbs, pending client: we declined the acceptor's connect for want of resources
    /// (see `VerbsLink::declined`).
    pub(crate) fn declined_locally(&self) -> bool {
        self.conn.as_ref().is_some_and(Link::declined)
    }

    /// The verbs link (to register with the service thread; the spin policy of waits).
    pub(crate) fn verbs_link_mut(&mut self) -> Option<&mut VerbsLink> {
        self.conn.as_mut().and_then(Link::verbs_mut)
    }

    /// Unit tests: this socket holds `charge` (of a budget of the test's own) from now on.
    #[cfg(test)]
    pub(crate) fn hold(&mut self, charge: Charge) {
        self._charge = Some(charge);
    }

    /// The registrations (domain and cache) this socket's memory is registered with: its
    /// verbs domain's, or the process-wide shm one.
    pub(super) fn shared_registrations(&self) -> Option<&'static SharedRegistrations> {
        self.conn.as_ref().and_then(Link::registrations)
    }
}

impl Drop for SanSocket {
    /// Drops the references this socket still holds in the registration cache (a close that
    /// gave up on a rendezvous, a broken connection): remote exposure through them ends now.
    fn drop(&mut self) {
        if let Some(mut registrations) = self.shared_registrations().map(SharedRegistrations::lock)
        {
            registrations.release_owner(self.owner);
        }
    }
}

/// What a pending shm client's switch needs, made before it announces itself (the exchange
/// listener and the segment): once the acceptor has attached, the switch must not fail for
/// want of a descriptor, since the acceptor talks SAN only from then on.
#[derive(Debug)]
pub(super) struct SwitchReserve {
    /// The client's mirror socketpair.
    pub(super) ends: MirrorEnds,
    /// Numbers held above the application's for the descriptors the switch receives:
    /// closed right before they are received.
    pub(super) spare: [OwnedFd; SWITCH_RECEIVES],
}

/// Descriptors a pending shm client receives at its switch (see [`SwitchReserve`]): the
/// exchange connection, the acceptor's raising end, the words page and the acceptor's pidfd.
const SWITCH_RECEIVES: usize = 4;

impl SwitchReserve {
    fn new(like: BorrowedFd<'_>) -> Result<SwitchReserve, SocketSetupError> {
        let ends = MirrorEnds::new().map_err(|_| SocketSetupError::Resource)?;
        let spare = |_| {
            let floor = san_shm::internal_fd_floor();
            // SAFETY: plain fcntl(2) on a descriptor we hold; the result is a new descriptor.
            let fd = unsafe { libc::fcntl(like.as_raw_fd(), libc::F_DUPFD_CLOEXEC, floor) };
            // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
            (fd >= 0)
                .then(|| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
                .ok_or(SocketSetupError::Resource)
        };
        Ok(SwitchReserve {
            ends,
            spare: [spare(0)?, spare(1)?, spare(2)?, spare(3)?],
        })
    }
}

/// An acceptor's attached segment and what it set up on the exchange before attaching.
struct AcceptedSegment {
    segment: ShmSegment,
    /// The client as the exchange names it.
    client: PeerProcess,
    link: OwnedFd,
    our_mirror: Mirror<SideWords>,
    page: Arc<WordsPage>,
}

/// Why an acceptor's attach failed, as a set-up error: out of descriptors or memory, the
/// client withdrew its segment, or anything else (the client is treated as plain).
fn attach_failure(error: san_shm::ShmError) -> SocketSetupError {
    match error {
        san_shm::ShmError::Io {
            errno: libc::EMFILE | libc::ENFILE | libc::ENOMEM,
            ..
        } => SocketSetupError::Resource,
        san_shm::ShmError::Withdrawn => SocketSetupError::ClientWithdrew,
        _ => SocketSetupError::PeerPlain,
    }
}

/// The accepting side's half of the exchange: connects to the client's exchange listener
/// and passes the client its end of our mirror, the words page and a pidfd of this process
/// (when the kernel has pidfds). Returns the exchange connection, our mirror end and the page.
fn offer_mirror(
    name: &SegmentName,
    dir: Option<&san_shm::ShmDir>,
) -> Result<(OwnedFd, Mirror<SideWords>, Arc<WordsPage>), SocketSetupError> {
    let link = exchange::connect(name, dir).map_err(|error| match error {
        exchange::ConnectError::NoListener => SocketSetupError::PeerPlain,
        exchange::ConnectError::Resource => SocketSetupError::Resource,
    })?;
    let (our_mirror, page) = offer_on(link.as_fd())?;
    Ok((link, our_mirror, page))
}

/// Queues our mirror's raising end, the words page and our pidfd on exchange connection
/// `link`; returns our mirror and the page.
fn offer_on(link: BorrowedFd<'_>) -> Result<(Mirror<SideWords>, Arc<WordsPage>), SocketSetupError> {
    let (page, memfd) = WordsPage::create().ok_or(SocketSetupError::Resource)?;
    let page = Arc::new(page);
    let (our_mirror, their_end) = Mirror::new(SideWords::new(page.clone(), ACCEPTOR_WORDS))
        .map_err(|_| SocketSetupError::Resource)?;
    if !exchange::send(link, their_end.as_fd(), MIRROR_END)
        || !exchange::send(link, memfd.as_fd(), WORDS_PAGE)
    {
        return Err(SocketSetupError::Resource);
    }
    // Without one (no pidfds in this kernel) the client names us by its translated pid.
    if let Some(pidfd) = exchange::own_pidfd() {
        if !exchange::send(link, pidfd.as_fd(), PIDFD) {
            return Err(SocketSetupError::Resource);
        }
    }
    Ok((our_mirror, page))
}

/// The shm connection over `segment`, whose doorbell also raises the peer's mirror (known
/// once the exchange delivered its end: the returned [`PeerMirror`]); `process`: the peer as
/// the exchange named it (the client learns it at its switch).
fn shm_connection(
    segment: ShmSegment,
    registrations: &super::registrations::SharedRegistrations,
    process: Option<PeerProcess>,
) -> Result<(ShmConnection, Arc<PeerMirror>), SocketSetupError> {
    let peer = Arc::new(PeerMirror::default());
    let conn = ShmConnection::with_peer(
        segment,
        registrations
            .lock()
            .domain()
            .ok_or(SocketSetupError::Resource)?,
        connection_config(),
        Box::new(MirrorDoorbell(peer.clone())),
        process,
    )
    .map_err(|_| SocketSetupError::Resource)?;
    Ok((conn, peer))
}

/// A full file system under the segments: removes the statistics files that processes of
/// ours left when they were killed (a process removes its own as it exits; only a reader
/// removes a dead one's), which share `/dev/shm` with the segments by default. True when
/// one went (the caller tries again once).
fn remove_dead_stats_files() -> bool {
    let removed = crate::stats::default_dir()
        .and_then(|dir| crate::stats::remove_stale_files(&dir).ok())
        .unwrap_or(0);
    if removed > 0 {
        tracing::debug!(
            removed,
            "/dev/shm full: dead processes' statistics files removed"
        );
    }
    removed > 0
}
