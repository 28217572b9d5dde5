//! One SAN socket: the segment, the session, the readiness mirror and the switch-over state.
//!
//! Everything here runs with the socket's lock held (see [`super::table::slot`]) and never blocks in
//! the kernel: the blocking loops in [`super::io`] release the lock around `poll()`.

use core::ffi::c_int;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use san_api::Access;
use san_shm::{ConnectionConfig, Doorbell, SegmentConfig, ShmConnection, ShmSegment};

use super::link::Link;
use super::registrations::SharedRegistrations;
use switch::error::{RecvError, SendError};
use switch::mr_cache::OwnerId;
use switch::session::{
    Event, MrHandleId, Pump, RecvFlags, RecvTicket, Role, SendFlags, SendTicket, Session,
    SessionConfig, SessionState, Shutdown,
};

use super::exchange::{self, SideWords, WordsPage, MIRROR_END, WORDS_PAGE};
use super::kernel::send_all_on_tcp;
use super::provider::{provider, rdma_read_offered, rendezvous_enabled};
use super::tunables::{
    poll_budget, ABSORB_LIMIT, EARLY_LIMIT, SAN_SEND_BUFFER, SHM_RENDEZVOUS_THRESHOLD, SLOTS,
    STALL_BEFORE_ABSORB, STALL_BEFORE_REJECT, STALL_POLL, VERBS_RENDEZVOUS_THRESHOLD, VERBS_SLOTS,
};
use super::verbs::VerbsLink;
use crate::discovery::SegmentName;
use crate::mirror::{self, Mirror, ReadLowering, WriteLowering};
use crate::real;
use crate::record::{Counter, DataPath, SocketRecord, SocketState};

/// Not an errno (those are positive): [`SanSocket::recv`] found a rendezvous segment at the
/// head of the stream; the caller receives it with [`SanSocket::start_recv_rendezvous`].
pub(crate) const REMOTE_SEGMENT_AHEAD: c_int = -1;

/// Not an errno: the SAN part of the stream is over in this direction (a downgrade, see
/// [`SanSocket::begin_downgrade`]); the rest of it is on kernel TCP.
pub(crate) const DOWNGRADED: c_int = -2;

/// The one byte the acceptor writes on TCP after attaching: "switch now".
pub(crate) const SWITCH_MARKER: u8 = 0x5a;

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

fn session_config() -> SessionConfig {
    let defaults = SessionConfig::default();
    SessionConfig {
        // `u32::MAX` announces "never": the negotiated threshold is the larger of both sides'.
        rendezvous_threshold: if rendezvous_enabled() {
            SHM_RENDEZVOUS_THRESHOLD
        } else {
            u32::MAX
        },
        send_buffer: SAN_SEND_BUFFER,
        ..defaults
    }
}

/// Owner ids of the registration cache: one per SAN socket, never reused (record indices
/// are, and a late release must not hit a newer socket's references).
static NEXT_OWNER: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(1);

fn next_owner() -> OwnerId {
    OwnerId(NEXT_OWNER.fetch_add(1, core::sync::atomic::Ordering::Relaxed))
}

/// A registration was refused (the reason is logged where it happens).
struct RegisterRefused;

/// Why a zero-copy receive could not be started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SinkRefused {
    /// Registration failed: the rendezvous was rejected (the sender resends the rest); read
    /// on, the stream continues.
    Rejected,
    /// The call fails with this errno.
    Errno(c_int),
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

/// The peer's mirror end `K` and its words, learnt at the switch (client) or lazily after it
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
            mirror::raise_readable(words, k);
        }
    }

    fn raise_writable(&self) {
        if let Some((k, words)) = self.get() {
            mirror::raise_writable(words, k);
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
}

/// Why a socket could not be set up; the connection stays on TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SetupError {
    /// The peer is not preloaded (no exchange listener / no segment).
    PeerPlain,
    /// A resource or system call failed.
    Resource,
}

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
    /// [`super::tunables::SpinPolicy`]; set by [`SanSocket::prepare_read_wait`]).
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

/// What [`SanSocket::absorb_if_stalled`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stall {
    /// None of the peer's data waits unread (or we hold as much as we absorb).
    None,
    /// The peer's data waits unread, not long enough to absorb it (or nothing moved).
    PeerDataWaits,
    /// Some of it moved into our receive buffer: the peer can go on.
    Absorbed,
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
    /// Client: the exchange listener while pending. Acceptor: the exchange connection until
    /// the client's `K` arrived.
    exchange: Option<OwnedFd>,
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
    /// Our FIN was mirrored to the peer's `M` (RDHUP there).
    fin_mirrored: bool,
    /// Stream bytes were queued since the peer's mirror was last raised readable.
    data_to_announce: bool,
    /// A reset was reported once (then reads see end-of-file, as after a kernel RST).
    reset_reported: bool,
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
    send_completed: Option<(SendTicket, Result<u64, switch::error::SendError>)>,
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
    /// After a downgrade the application's epoll sets watch the TCP socket again.
    pub epoll_on_tcp: bool,
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
            kernel_error: None,
            marker_owed: false,
            waiters: 0,
            watched: false,
            local_bell: None,
            pending_bell: None,
            released: Vec::new(),
            pump: Pump::new(),
            owner: next_owner(),
            send_completed: None,
            recv_completed: None,
            downgrade_wanted: false,
            downgrade_sent: false,
            restored: Vec::new(),
            epoll_on_tcp: false,
        }
    }

    /// The connecting side after its TCP connect succeeded and the listener probe said
    /// "preloaded": creates the exchange listener and the segment; the socket is pending.
    pub(crate) fn client(
        record: &'static SocketRecord,
        dir: &std::path::Path,
        name: &SegmentName,
        registrations: &super::registrations::SharedRegistrations,
    ) -> Result<SanSocket, SetupError> {
        let listener = exchange::listen(name).ok_or(SetupError::Resource)?;
        let segment = ShmSegment::create(dir, name.as_str(), &SegmentConfig::new(SLOTS))
            .map_err(|_| SetupError::Resource)?;
        let (conn, peer) = shm_connection(segment, registrations)?;
        let mut socket = Self::fresh(record, Side::Client, name, conn.into(), peer);
        socket.exchange = Some(listener);
        Ok(socket)
    }

    /// The accepting side, inside `accept()`: connects to the client's exchange, passes its
    /// mirror end and the words page, attaches the segment and starts the session (it has
    /// sent nothing on TCP). The caller then writes the switch marker
    /// ([`SanSocket::wake_pending_client`]).
    pub(crate) fn acceptor(
        record: &'static SocketRecord,
        dir: &std::path::Path,
        name: &SegmentName,
        registrations: &super::registrations::SharedRegistrations,
    ) -> Result<SanSocket, SetupError> {
        let link = exchange::connect(name).ok_or(SetupError::PeerPlain)?;
        let page = Arc::new(WordsPage::create().ok_or(SetupError::Resource)?);
        let (our_mirror, their_end) = Mirror::new(SideWords::new(page.clone(), ACCEPTOR_WORDS))
            .map_err(|_| SetupError::Resource)?;
        if !exchange::send(link.as_fd(), their_end.as_fd(), MIRROR_END)
            || !exchange::send(link.as_fd(), page.memfd(), WORDS_PAGE)
        {
            return Err(SetupError::Resource);
        }
        drop(their_end);
        // Attach last: the client switches when it sees the attach, and by then everything
        // it needs is queued on the exchange.
        let segment = ShmSegment::attach(dir, name.as_str()).map_err(|_| SetupError::PeerPlain)?;
        let _ = segment.unlink();
        let (conn, peer) = shm_connection(segment, registrations)?;
        let session = Session::new(
            Role::Passive,
            session_config(),
            conn.capabilities(),
            SLOTS,
            0,
        );
        let mut socket = Self::fresh(record, Side::Acceptor, name, conn.into(), peer);
        socket.phase = Phase::Switched;
        socket.session = Some(session);
        socket.mirror = Some(our_mirror);
        socket.page = Some(page);
        socket.exchange = Some(link);
        // Our Hello: the peer must call in to complete the handshake.
        socket.data_to_announce = true;
        socket.marker_owed = true;
        socket.service();
        socket.mark_switched();
        Ok(socket)
    }

    fn mark_switched(&self) {
        // The application may have closed its last fd already (its release is on the way).
        if self.record.set_state_if_live(SocketState::San) {
            let path = if self.is_verbs() {
                DataPath::SanVerbs
            } else {
                DataPath::SanShm
            };
            self.record
                .path
                .store(path as u32, core::sync::atomic::Ordering::Release);
        }
    }

    /// Wakes the threads that wait on this socket as a pending client (see `pending_bell`).
    fn ring_pending_bell(&self) {
        if let Some(bell) = self.pending_bell.as_ref() {
            let one = 1u64;
            // SAFETY: an 8-byte write to our eventfd.
            unsafe { libc::write(bell.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Client: true once the acceptor attached (the switch may happen now).
    pub(crate) fn peer_attached(&self) -> bool {
        self.conn.as_ref().is_some_and(Link::peer_attached)
    }

    /// As [`SanSocket::peer_attached`], after a byte was found on TCP: a verbs attach in
    /// progress is waited for (bounded), since that byte may be its switch marker.
    pub(crate) fn peer_attached_settled(&self) -> bool {
        self.conn.as_ref().is_some_and(Link::peer_attached_settled)
    }

    /// Client, pending: counts stream bytes the kernel accepted on TCP.
    pub(crate) fn count_tcp_sent(&mut self, bytes: u64) {
        self.tcp_sent += bytes;
    }

    /// Client, pending, segment attached: takes the mirror end and words from the exchange,
    /// answers with ours, and starts the session with the TCP byte count. `Err` means the
    /// exchange was not usable: the connection cannot continue (the acceptor talks SAN only).
    pub(crate) fn switch(&mut self, tcp: c_int) -> Result<(), ()> {
        if self.is_verbs() {
            return self.switch_verbs(tcp);
        }
        let listener = self.exchange.take().ok_or(())?;
        let link = exchange::accept(listener.as_fd()).ok_or(())?;
        drop(listener);
        let their_end = exchange::receive(link.as_fd(), MIRROR_END).ok_or(())?;
        let page = exchange::receive(link.as_fd(), WORDS_PAGE)
            .and_then(WordsPage::map)
            .map(Arc::new)
            .ok_or(())?;
        let (our_mirror, our_end) =
            Mirror::new(SideWords::new(page.clone(), CLIENT_WORDS)).map_err(|_| ())?;
        // If the acceptor is already gone the send fails; the session reports the reset.
        let _ = exchange::send(link.as_fd(), our_end.as_fd(), MIRROR_END);
        drop(our_end);
        let _ = self
            .peer
            .end
            .set((their_end, SideWords::new(page.clone(), ACCEPTOR_WORDS)));
        let conn = self.conn.as_ref().ok_or(())?;
        self.session = Some(Session::new(
            Role::Active,
            session_config(),
            conn.capabilities(),
            SLOTS,
            self.tcp_sent,
        ));
        self.mirror = Some(our_mirror);
        self.page = Some(page);
        self.phase = Phase::Switched;
        self.ring_pending_bell();
        // Our Hello (and the receives it needs) must wake the acceptor.
        self.data_to_announce = true;
        // A shutdown the application made while pending (a TCP FIN the acceptor may never
        // read) becomes the session's FIN after the counted bytes.
        let shut =
            self.record.flags() & (crate::record::flags::SHUT_WR | crate::record::flags::SHUT_RD);
        if shut & crate::record::flags::SHUT_WR != 0 {
            self.shutdown(libc::SHUT_WR);
        }
        if shut & crate::record::flags::SHUT_RD != 0 {
            self.shutdown(libc::SHUT_RD);
        }
        self.service();
        self.consume_marker(tcp);
        self.mark_switched();
        Ok(())
    }

    /// Acceptor: writes the switch marker on TCP (once): a client waiting on its TCP socket
    /// wakes, switches and completes the handshake.
    pub(crate) fn wake_pending_client(&mut self, tcp: c_int) {
        if !self.marker_owed {
            return;
        }
        // Written even when the client already switched: the client consumes exactly one
        // marker byte before it ever reads TCP again (a downgrade), so it must always be there.
        self.marker_owed = false;
        let marker = [SWITCH_MARKER];
        // SAFETY: one readable byte; `tcp` is the application's socket for this call.
        let sent = unsafe {
            real::send(
                tcp,
                marker.as_ptr().cast(),
                1,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if sent != 1 {
            // The client still switches at its next call (it checks the attach itself).
            tracing::debug!(tcp, "switch marker not sent");
        }
    }

    /// Client: reads the switch marker if it has arrived (nonblocking).
    pub(crate) fn consume_marker(&mut self, tcp: c_int) {
        if !self.marker_unread {
            return;
        }
        let mut byte = 0u8;
        // SAFETY: one writable byte.
        let n = unsafe { real::recv(tcp, (&mut byte as *mut u8).cast(), 1, libc::MSG_DONTWAIT) };
        if n == 1 || n == 0 {
            self.marker_unread = false;
        }
    }

    /// Client, pending: a byte arrived on TCP while the segment was attached, so it is the
    /// marker and it was consumed by the caller.
    pub(crate) fn marker_consumed(&mut self) {
        self.marker_unread = false;
    }

    /// The kernel reported hang-up on our mirror end: the peer's end was closed (its process
    /// died, or it closed the socket). The next [`SanSocket::service`] checks its liveness
    /// instead of waiting for the provider's interval.
    pub(crate) fn mirror_hung_up(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            conn.check_liveness_soon();
        }
    }

    /// Pumps the session over the connection, handles its events, raises the peer's mirror
    /// after transmitting, and (acceptor) picks up the client's mirror end once it is queued.
    ///
    /// Verbs: ends with the completion channel re-armed. Whoever drives may consume the
    /// channel's event (the provider acknowledges it when it finds the queue empty), and
    /// the CQ's notification is one-shot: a drive by the application's thread that left
    /// the CQ disarmed would leave the service thread asleep through every later arrival,
    /// until a wait slice drove the socket again (redis over verbs: ~250 ms per request).
    pub(crate) fn service(&mut self) {
        self.drive_and_handle();
        if self.phase != Phase::Switched || !self.is_verbs() {
            return;
        }
        self.arm_verbs();
    }

    /// Verbs: arms the completion channel for whoever watches it next, driving what arrived
    /// meanwhile first.
    fn arm_verbs(&mut self) {
        // Completions that arrived meanwhile make `arm` refuse: drive them first (bounded;
        // a connection that keeps it busy longer re-arms at the next call or the sweep).
        for _ in 0..16 {
            // While only the peer's messages can move the session on, our own send
            // completions need not wake anyone (one wake-up per message saved on each side).
            let solicited_only = self.early.is_empty()
                && self.deferred_shutdown.is_none()
                && !self.downgrade_wanted
                && self
                    .session
                    .as_ref()
                    .is_some_and(|s| !s.awaits_local_completions());
            let armed = self
                .conn
                .as_mut()
                .and_then(Link::verbs_mut)
                .is_none_or(|link| link.arm(solicited_only));
            if armed {
                break;
            }
            self.drive_and_handle();
        }
    }

    /// One drive of [`Self::service`] (without the verbs re-arm).
    fn drive_and_handle(&mut self) {
        let regs = self.shared_registrations();
        let (Some(session), Some(conn)) = (self.session.as_mut(), self.conn.as_mut()) else {
            return;
        };
        // Shm: messages the provider had to queue (the peer had posted no receive yet, as for
        // the acceptor's Hello, sent inside accept() before the client's session exists) move
        // at a later drive, maybe this one. Whoever posted them may have announced them then,
        // when they were not there yet: the drive that moves them must announce them again.
        let queued_before = conn.has_queued_sends();
        let progress = self.pump.drive(session, conn, &mut self.released);
        let mut answer_downgrade = false;
        if !self.released.is_empty() {
            if let Some(mut registrations) = regs.map(SharedRegistrations::lock) {
                registrations.release(&self.released);
            }
            self.released.clear();
        }
        if let Err(error) = &progress {
            tracing::debug!(name = %self.name, ?error, "SAN drive error");
        }
        if self.waiters > 0 && progress.is_ok_and(|p| p.completions > 0) {
            // (Inline: `session` is still borrowed here; elsewhere `ring_local_bell`.)
            if let Some(bell) = self.local_bell.as_ref() {
                let one = 1u64;
                // SAFETY: an 8-byte write to our eventfd.
                unsafe { libc::write(bell.as_raw_fd(), (&one as *const u64).cast(), 8) };
            }
        }
        while let Some(event) = session.poll_event() {
            match event {
                Event::PeerClosed => {
                    tracing::debug!(name = %self.name, "SAN peer FIN");
                    self.peer_fin = true;
                    if let Some(mirror) = self.mirror.as_mut() {
                        let _ = mirror.set_read_hup();
                    }
                }
                Event::Reset(cause) => {
                    tracing::debug!(name = %self.name, ?cause, "SAN session reset");
                    if let Some(mirror) = self.mirror.as_mut() {
                        let _ = mirror.set_read_hup();
                    }
                }
                Event::SendComplete { ticket, result } => {
                    self.send_completed = Some((ticket, result));
                }
                Event::RecvComplete { ticket, result } => {
                    self.recv_completed = Some((ticket, result));
                }
                Event::PeerDowngraded => {
                    // The session answers with its own `Downgrade`: it must wake the peer.
                    tracing::debug!(name = %self.name, "SAN peer downgraded to TCP");
                    self.data_to_announce = true;
                    self.downgrade_wanted = true;
                    self.downgrade_sent = true;
                    answer_downgrade = true;
                }
                _ => {}
            }
        }
        if self.side == Side::Acceptor && self.peer.get().is_none() {
            let their_end = self
                .exchange
                .as_ref()
                .and_then(|link| exchange::receive(link.as_fd(), MIRROR_END));
            if let (Some(their_end), Some(page)) = (their_end, self.page.as_ref()) {
                let _ = self
                    .peer
                    .end
                    .set((their_end, SideWords::new(page.clone(), CLIENT_WORDS)));
                self.exchange = None;
                // Whatever we published before we could ring may have gone unnoticed.
                self.peer.raise_readable();
                self.peer.raise_writable();
            }
        }
        let mut sent = progress.is_ok_and(|p| p.messages_sent > 0) || queued_before;
        if !self.early.is_empty() && self.flush_early() {
            sent |= self.drive_again();
        }
        if self.early.is_empty() {
            if let Some(how) = self.deferred_shutdown.take() {
                if let Some(session) = self.session.as_mut() {
                    session.shutdown(match how {
                        libc::SHUT_RD => Shutdown::Read,
                        libc::SHUT_WR => Shutdown::Write,
                        _ => Shutdown::Both,
                    });
                }
                sent |= self.drive_again();
            }
        }
        if self.downgrade_wanted {
            self.early_to_tcp();
        }
        if self.downgrade_wanted && self.early.is_empty() && self.deferred_shutdown.is_none() {
            // Our `Downgrade` goes after the early bytes (they precede every TCP byte we
            // send from now on); a session still handshaking sends it once established.
            if let Some(session) = self.session.as_mut() {
                if !self.downgrade_sent
                    && session.state() != SessionState::Handshaking
                    && session.downgrade().is_ok()
                {
                    self.downgrade_sent = true;
                    answer_downgrade = true;
                }
            }
        }
        if answer_downgrade {
            sent |= self.drive_again();
        }
        if sent {
            // Credit returns only make the peer writable; data and FIN make it readable
            // (raising readable for a bare credit update would be a spurious wake-up).
            if self.data_to_announce {
                self.peer.raise_readable();
                // Drained: nothing left in the session or queued in the provider (what is
                // still queued is announced when it moves).
                let drained = self
                    .session
                    .as_ref()
                    .is_none_or(|s| s.send_queue_len() == 0)
                    && !self.conn.as_ref().is_some_and(Link::has_queued_sends);
                if drained && self.early.is_empty() {
                    self.data_to_announce = false;
                }
            }
            self.peer.raise_writable();
        }
        if sent {
            self.nudge_stalled_peer();
        }
        if !self.has_untransmitted() {
            self.set_progress_wanted(false);
        }
        self.mirror_fin();
        self.raise_own_mirror();
        self.publish_progress();
    }

    /// Publishes whether the handshake is done and whether sent bytes wait here (record
    /// flags, for hang reports: which end of a stuck connection holds the bytes). One
    /// atomic load per drive; a store only on a change.
    fn publish_progress(&self) {
        use crate::record::flags::{SAN_HANDSHAKING, SAN_HOLDING, SAN_PROVIDER_QUEUED};
        let handshaking = self
            .session
            .as_ref()
            .is_some_and(|s| s.state() == SessionState::Handshaking);
        let queued = self.conn.as_ref().is_some_and(Link::has_queued_sends);
        let bit = |on: bool, flag: u32| if on { flag } else { 0 };
        let wanted = bit(handshaking, SAN_HANDSHAKING)
            | bit(self.has_untransmitted(), SAN_HOLDING)
            | bit(queued, SAN_PROVIDER_QUEUED);
        let all = SAN_HANDSHAKING | SAN_HOLDING | SAN_PROVIDER_QUEUED;
        if self.record.flags() & all != wanted {
            for flag in [SAN_HANDSHAKING, SAN_HOLDING, SAN_PROVIDER_QUEUED] {
                self.record.set_flag(flag, wanted & flag != 0);
            }
        }
    }

    /// Stream bytes we hold that have not left yet (no credits, or still handshaking).
    fn has_untransmitted(&self) -> bool {
        !self.early.is_empty()
            || self
                .session
                .as_ref()
                .is_some_and(|s| s.send_queue_len() > 0)
    }

    fn set_progress_wanted(&self, wanted: bool) {
        if let Some(mirror) = self.mirror.as_ref() {
            mirror.words().set_progress_wanted(wanted);
        }
    }

    /// Called as control returns to the application (and after a responder's servicing):
    /// bytes we could not transmit would wait for its next call, which may never come
    /// (a server that answered and went idle); the peer nudges us when it transmits
    /// what unblocks them (see `MirrorWords`).
    pub(crate) fn leaving_call(&mut self) {
        if !self.has_untransmitted() || !self.is_intra_host() {
            return;
        }
        self.set_progress_wanted(true);
        // What the peer published before it could see the word (credits, its `Hello`) nudges
        // nobody: drive it now (which clears the word if everything leaves).
        if self.conn.as_ref().is_some_and(Link::has_input) {
            self.service();
        }
    }

    /// We just transmitted (our `Hello`, credits, data): if the peer is waiting for that to
    /// move bytes its application left queued, nudge its process.
    fn nudge_stalled_peer(&self) {
        let Some((_, words)) = self.peer.get() else {
            return;
        };
        if words.take_progress_wanted() {
            if let Some(pid) = self.peer_process() {
                super::nudge::nudge(pid);
            }
        }
    }

    /// Once our FIN has left (nothing queued before it), shuts the peer's `K` for writing
    /// so its `M` reports RDHUP like a TCP socket that received a FIN.
    fn mirror_fin(&mut self) {
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

    /// Moves early bytes into an established session; true when any moved.
    fn flush_early(&mut self) -> bool {
        let Some(session) = self.session.as_mut() else {
            return false;
        };
        if session.state() != SessionState::Established {
            return false;
        }
        match session.send(&self.early, SendFlags::default()) {
            Ok(n) if n > 0 => {
                self.early.drain(..n);
                true
            }
            Err(SendError::Downgraded) => {
                self.early_to_tcp();
                false
            }
            _ => false,
        }
    }

    /// Downgrading: bytes the application sent before the handshake finished and that have
    /// not entered the session are the first bytes of our TCP continuation (the peer reads
    /// TCP only after our `Downgrade`, which follows everything the session holds).
    fn early_to_tcp(&mut self) {
        if self.early.is_empty() {
            return;
        }
        let fd = self.record.fd.load(core::sync::atomic::Ordering::Acquire);
        let sent = send_all_on_tcp(fd, &self.early);
        self.early.drain(..sent);
    }

    /// Begins moving the connection back to kernel TCP (before fork or exec): our sends go
    /// to TCP from now on, after what the session still has queued and its `Downgrade`; the
    /// peer answers with its own `Downgrade` and sends on TCP after it. False when this
    /// connection cannot downgrade (not switched, or a peer without the capability).
    pub(crate) fn begin_downgrade(&mut self) -> bool {
        if self.phase != Phase::Switched {
            return false;
        }
        let Some(session) = self.session.as_ref() else {
            return false;
        };
        let state = session.state();
        let possible = match state {
            SessionState::Handshaking => true,
            SessionState::Established | SessionState::Closed => session.can_downgrade(),
            SessionState::Downgraded => true,
            _ => false,
        };
        if !possible {
            return false;
        }
        self.downgrade_wanted = true;
        self.data_to_announce = true;
        self.service();
        true
    }

    /// Whether a downgrade was asked for or answered.
    pub(crate) fn downgrading(&self) -> bool {
        self.downgrade_wanted
    }

    /// The SAN part of the peer's stream is over and fully read: reads continue on TCP.
    pub(crate) fn reads_on_tcp(&self) -> bool {
        // After the peer's `Downgrade` the session is readable exactly while something it sent
        // before (inline bytes, a rendezvous segment, a FIN) is still to be read.
        self.restored.is_empty()
            && self
                .session
                .as_ref()
                .is_some_and(|s| s.peer_downgraded() && !s.readiness().readable)
    }

    /// While the application is blocked sending and the peer's data waits unread: after
    /// [`STALL_BEFORE_ABSORB`] of this, takes the peer's bytes out of the session into
    /// `restored` (up to [`ABSORB_LIMIT`]), so that the credits go back and a peer blocked
    /// sending to us moves on. This is the kernel's receive buffer, which lets two programs
    /// that each write megabytes before reading (an echo client writing a whole request)
    /// through, as loopback TCP does; after [`STALL_BEFORE_REJECT`] a rendezvous at the head
    /// is turned down (its sender sends the rest inline, which is absorbed). `stalled_since`
    /// belongs to the caller's blocking call. While a stall lasts the caller's waits are cut
    /// short ([`SanSocket::blocked_send_wait`]), so the absorption keeps pace with the peer.
    fn absorb_if_stalled(&mut self, stalled_since: &mut Option<Instant>) -> Stall {
        let pending = self.session.as_ref().map_or(0, |s| s.recv_pending_bytes());
        if pending == 0 || self.restored.len() >= ABSORB_LIMIT {
            return Stall::None;
        }
        let since = *stalled_since.get_or_insert_with(Instant::now);
        let stalled = since.elapsed();
        if stalled < STALL_BEFORE_ABSORB {
            return Stall::PeerDataWaits;
        }
        let reject_rendezvous = stalled >= STALL_BEFORE_REJECT;
        let mut moved = false;
        let mut buf = [0u8; 16 << 10];
        while self.restored.len() < ABSORB_LIMIT {
            let room = (ABSORB_LIMIT - self.restored.len()).min(buf.len());
            let Some(session) = self.session.as_mut() else {
                break;
            };
            match session.recv(&mut buf[..room], RecvFlags::default()) {
                Ok(0) => break,
                Ok(n) => {
                    self.restored.extend_from_slice(&buf[..n]);
                    self.record.count(Counter::SanInlineReceived, n as u64);
                    moved = true;
                }
                Err(RecvError::RemoteSegment { .. }) if reject_rendezvous => {
                    if self.reject_remote_head().is_err() {
                        break;
                    }
                    moved = true;
                }
                Err(_) => break,
            }
        }
        if moved {
            self.data_to_announce = true;
            self.service();
            return Stall::Absorbed;
        }
        Stall::PeerDataWaits
    }

    /// A blocking sender that found no room: absorbs a stalled peer's unread data (see
    /// `absorb_if_stalled`) or prepares the wait for room, cut into short polls while the
    /// peer's data waits unread (the stall is timed from the first). `None`: retry at once.
    pub(crate) fn blocked_send_wait(
        &mut self,
        stalled_since: &mut Option<Instant>,
    ) -> Option<WaitFds> {
        let stall = self.absorb_if_stalled(stalled_since);
        if stall == Stall::Absorbed {
            return None;
        }
        let mut wait = self.prepare_send_wait()?;
        if stall == Stall::PeerDataWaits {
            wait.cap = Some(STALL_POLL);
        }
        Some(wait)
    }

    /// A downgrade drained `bytes` but the peer did not finish it in time: they are read
    /// first, before what the session still delivers.
    pub(crate) fn restore_received(&mut self, bytes: &[u8]) {
        let mut restored = bytes.to_vec();
        restored.append(&mut self.restored);
        self.restored = restored;
    }

    /// The connection is gone (reset, fallen back, or the provider is down).
    pub(crate) fn is_broken(&self) -> bool {
        self.session
            .as_ref()
            .is_none_or(|s| matches!(s.state(), SessionState::Reset | SessionState::FellBack))
            || !self.conn.as_ref().is_some_and(Link::is_up)
    }

    /// The downgrade is finished both ways and nothing is left to read from the session:
    /// the socket can become plain TCP (after [`SanSocket::consume_marker_blocking`]).
    pub(crate) fn downgrade_complete(&self) -> bool {
        self.early.is_empty()
            && self.restored.is_empty()
            && self
                .session
                .as_ref()
                .is_some_and(|s| s.state() == SessionState::Downgraded && s.recv_queue_len() == 0)
    }

    /// Rejects the rendezvous segment at the head of the stream (a downgrade drains the
    /// session into a stash: the sender gets a short count and sends the rest on TCP).
    pub(crate) fn reject_remote_head(&mut self) -> Result<(), c_int> {
        let Some(session) = self.session.as_mut() else {
            return Err(libc::ENOTCONN);
        };
        match session.reject_remote_segment() {
            Ok(()) => {
                self.data_to_announce = true;
                self.service();
                Ok(())
            }
            Err(RecvError::Reset) => Err(libc::ECONNRESET),
            Err(_) => Err(libc::EAGAIN),
        }
    }

    /// Client: the switch marker precedes everything the acceptor sends on TCP; before the
    /// socket reads TCP again it must be consumed. Waits for it up to `timeout` (it was
    /// written at the acceptor's `accept()`, long before any downgrade).
    pub(crate) fn consume_marker_blocking(&mut self, tcp: c_int, timeout: Duration) {
        if !self.marker_unread || self.side != Side::Client {
            self.marker_unread = false;
            return;
        }
        let mut entry = libc::pollfd {
            fd: tcp,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        unsafe {
            real::poll(
                &mut entry,
                1,
                timeout.as_millis().min(i32::MAX as u128) as c_int,
            )
        };
        self.consume_marker(tcp);
    }

    fn drive_again(&mut self) -> bool {
        let regs = self.shared_registrations();
        let (Some(session), Some(conn)) = (self.session.as_mut(), self.conn.as_mut()) else {
            return false;
        };
        let progress = self.pump.drive(session, conn, &mut self.released);
        if !self.released.is_empty() {
            if let Some(mut registrations) = regs.map(SharedRegistrations::lock) {
                registrations.release(&self.released);
            }
            self.released.clear();
        }
        progress.is_ok_and(|p| p.messages_sent > 0)
    }

    /// True for a connection to a process on this host (the `shm` provider).
    pub(crate) fn is_intra_host(&self) -> bool {
        self.conn
            .as_ref()
            .is_some_and(|link| link.verbs().is_none())
    }

    /// The peer's pid when it is another process on this host (the one to nudge).
    pub(crate) fn peer_process(&self) -> Option<u32> {
        self.conn
            .as_ref()
            .and_then(Link::peer_pid)
            .filter(|&pid| pid != std::process::id())
    }

    /// True when the peer is this very process (both ends of an in-process connection).
    pub(crate) fn peer_in_process(&self) -> bool {
        self.conn
            .as_ref()
            .and_then(Link::peer_pid)
            .is_some_and(|pid| pid == std::process::id())
    }

    /// Acceptor: how many TCP bytes the client sent before switching and we have not read
    /// yet; `None` while its count is unknown (its `Hello` has not arrived).
    pub(crate) fn tcp_backlog(&self) -> Option<u64> {
        if self.side != Side::Acceptor {
            return Some(0);
        }
        let sent = self.session.as_ref()?.peer_tcp_bytes_sent()?;
        Some(sent.saturating_sub(self.tcp_received))
    }

    /// Acceptor: the client's pre-switch bytes may still be readable on TCP.
    pub(crate) fn tcp_bytes_pending(&self) -> bool {
        self.side == Side::Acceptor && self.tcp_backlog() != Some(0) && !self.tcp_eof
    }

    /// Acceptor: TCP bytes were read (and consumed) by the application.
    pub(crate) fn count_tcp_received(&mut self, bytes: u64) {
        self.tcp_received += bytes;
    }

    /// Acceptor: TCP reported end-of-file before the client's count was known.
    pub(crate) fn set_tcp_eof(&mut self) {
        self.tcp_eof = true;
    }

    /// Acceptor: whether TCP already said end-of-file.
    pub(crate) fn tcp_eof(&self) -> bool {
        self.tcp_eof
    }

    /// Copies queued stream bytes out: `Ok(0)` at end of stream.
    pub(crate) fn recv(&mut self, buf: &mut [u8], peek: bool) -> Result<usize, c_int> {
        if !self.restored.is_empty() {
            let n = buf.len().min(self.restored.len());
            buf[..n].copy_from_slice(&self.restored[..n]);
            if !peek {
                self.restored.drain(..n);
            }
            return Ok(n);
        }
        let Some(session) = self.session.as_mut() else {
            return Err(libc::ENOTCONN);
        };
        let flags = RecvFlags {
            peek,
            ..RecvFlags::default()
        };
        match session.recv(buf, flags) {
            Ok(n) => {
                if !peek && n > 0 {
                    self.record.count(Counter::SanInlineReceived, n as u64);
                }
                Ok(n)
            }
            Err(RecvError::WouldBlock) => Err(libc::EAGAIN),
            Err(RecvError::Reset) if self.peer_fin || self.reset_reported => Ok(0),
            Err(RecvError::Reset) => {
                self.reset_reported = true;
                Err(self.kernel_error.unwrap_or(libc::ECONNRESET))
            }
            Err(RecvError::InvalidArgument) => Err(libc::EINVAL),
            Err(RecvError::NotConnected) => Err(libc::ENOTCONN),
            Err(RecvError::Interrupted) => Err(libc::EINTR),
            Err(RecvError::RemoteSegment { .. }) => Err(REMOTE_SEGMENT_AHEAD),
            Err(RecvError::Downgraded) => Err(DOWNGRADED),
            Err(_) => Err(libc::ECONNRESET),
        }
    }

    /// Whether a send of `len` bytes may be queued without driving the session first: it is
    /// established, takes the whole of it inline, and the provider signals no input (shm:
    /// nothing in our ring; verbs: its completions are the service thread's while the
    /// application is not in a call, and the drive after the send polls them anyway). The
    /// drive before the send cost a whole drive (a completion poll included) per message.
    pub(crate) fn queues_without_drive(&self, len: usize) -> bool {
        self.phase == Phase::Switched
            && self.early.is_empty()
            && !self.downgrade_wanted
            && !self.write_shut
            && !self.conn.as_ref().is_some_and(Link::has_input)
            && !self.wants_rendezvous(len)
            && self.session.as_ref().is_some_and(|session| {
                session.state() == SessionState::Established && session.send_space() >= len
            })
    }

    /// Queues stream bytes for sending: a short count when the send buffer fills.
    pub(crate) fn send(&mut self, data: &[u8], urgent: bool) -> Result<usize, c_int> {
        if self.write_shut {
            return Err(libc::EPIPE);
        }
        if self.downgrade_wanted {
            // Bytes still waiting for the handshake are older than these: they go first.
            self.early_to_tcp();
            if !self.early.is_empty() {
                return Err(libc::EAGAIN);
            }
            return Err(DOWNGRADED);
        }
        let Some(session) = self.session.as_mut() else {
            return Err(libc::ENOTCONN);
        };
        if !data.is_empty() {
            self.data_to_announce = true;
        }
        if session.state() == SessionState::Handshaking || !self.early.is_empty() {
            // Before the peer's Hello (or behind bytes still waiting for it), buffer locally
            // as the kernel would; order is kept because the session takes these first.
            let room = EARLY_LIMIT.saturating_sub(self.early.len());
            if data.is_empty() {
                return Ok(0);
            }
            if room == 0 {
                return Err(libc::EAGAIN);
            }
            let n = data.len().min(room);
            self.early.extend_from_slice(&data[..n]);
            self.record.count(Counter::SanInlineSent, n as u64);
            return Ok(n);
        }
        match session.send(data, SendFlags { urgent }) {
            Ok(n) => {
                self.record.count(Counter::SanInlineSent, n as u64);
                Ok(n)
            }
            Err(SendError::WouldBlock) => Err(libc::EAGAIN),
            Err(SendError::Closed) => Err(libc::EPIPE),
            Err(SendError::Reset) if self.peer_fin => Err(libc::EPIPE),
            Err(SendError::Reset) => Err(self.send_reset_errno()),
            Err(SendError::NoBuffers) => Err(libc::ENOBUFS),
            Err(SendError::NotConnected) => Err(libc::ENOTCONN),
            Err(SendError::TooLong) => Err(libc::EMSGSIZE),
            Err(SendError::Downgraded) => Err(DOWNGRADED),
            Err(_) => Err(libc::EINVAL),
        }
    }

    /// Whether a blocking send of `len` bytes should go by rendezvous: the session is
    /// established with a negotiated threshold `len` reaches, and nothing is buffered ahead
    /// of it locally.
    pub(crate) fn wants_rendezvous(&self, len: usize) -> bool {
        let Some(session) = self.session.as_ref() else {
            return false;
        };
        session.state() == SessionState::Established
            && self.early.is_empty()
            && !self.write_shut
            && !self.downgrade_wanted
            && !session.peer_downgraded()
            && session
                .rendezvous_threshold()
                .is_some_and(|t| t != u32::MAX && len as u64 >= u64::from(t))
    }

    /// Starts a zero-copy send of `data` (which must stay valid and unchanged until the
    /// send completes: the caller is a blocking send that waits for it). `ENOBUFS` when the
    /// registration is refused, `EAGAIN` while another rendezvous is in progress.
    pub(crate) fn start_send_rendezvous(&mut self, data: &[u8]) -> Result<SendTicket, c_int> {
        let regs = self.shared_registrations();
        if self.write_shut {
            return Err(libc::EPIPE);
        }
        let Some(session) = self.session.as_mut() else {
            return Err(libc::ENOTCONN);
        };
        // READ mode: the peer copies the buffer out (CMA). WRITE mode: we copy it out
        // through the window, which needs only local access.
        let access = if session.sends_use_read_mode() == Some(true) {
            Access::REMOTE_READ
        } else {
            Access::NONE
        };
        let Some(mut registrations) = regs.map(SharedRegistrations::lock) else {
            return Err(libc::ENOBUFS);
        };
        let rest = registrations
            .register(self.owner, data.as_ptr() as u64, data.len() as u64, access)
            .map_err(|error| {
                tracing::debug!(
                    ?error,
                    len = data.len(),
                    "rendezvous send: registration refused"
                );
                libc::ENOBUFS
            })?;
        match session.send_rendezvous(&[], rest) {
            Ok(ticket) => {
                drop(registrations);
                self.data_to_announce = true;
                self.service();
                Ok(ticket)
            }
            Err(error) => {
                tracing::debug!(?error, "rendezvous send refused by the session");
                registrations.release(&[rest.handle]);
                Err(match error {
                    SendError::WouldBlock => libc::EAGAIN,
                    SendError::Closed => libc::EPIPE,
                    SendError::Reset if self.peer_fin => libc::EPIPE,
                    SendError::Reset => self.send_reset_errno(),
                    SendError::NotConnected => libc::ENOTCONN,
                    SendError::Downgraded => DOWNGRADED,
                    _ => libc::ENOBUFS,
                })
            }
        }
    }

    /// The outcome of rendezvous send `ticket`, once the session reported it: `Ok(bytes)`
    /// delivered (counted as rendezvous bytes), or the errno.
    pub(crate) fn take_send_completion(
        &mut self,
        ticket: SendTicket,
    ) -> Option<Result<usize, c_int>> {
        match self.send_completed {
            Some((done, _)) if done == ticket => {}
            _ => return None,
        }
        let (_, result) = self.send_completed.take()?;
        Some(match result {
            Ok(bytes) => {
                self.record.count(Counter::SanRendezvousSent, bytes);
                Ok(usize::try_from(bytes).unwrap_or(usize::MAX))
            }
            Err(SendError::Closed) => Err(libc::EPIPE),
            Err(SendError::Reset) if self.peer_fin => Err(libc::EPIPE),
            Err(SendError::Reset) => Err(self.send_reset_errno()),
            Err(SendError::NoBuffers) => Err(libc::ENOBUFS),
            Err(_) => Err(libc::ECONNRESET),
        })
    }

    /// The rendezvous segment at the head of the stream goes zero-copy into `buf` (which must
    /// stay valid until the receive completes: the caller waits for it). A refused
    /// registration rejects the segment: the sender gets a short count and resends the rest.
    pub(crate) fn start_recv_rendezvous(
        &mut self,
        buf: &mut [u8],
        peek: bool,
    ) -> Result<RecvTicket, SinkRefused> {
        let regs = self.shared_registrations();
        let Some(session) = self.session.as_mut() else {
            return Err(SinkRefused::Errno(libc::ENOTCONN));
        };
        // The segment's mode (we read it, or the peer writes into an advertised sink) is the
        // session's knowledge, not ours, and the capabilities the session was started with
        // may differ from the connection's current ones (CMA is confirmed once the peer is
        // known): register for both. The remote exposure ends when the session releases
        // the sink (the cache revokes the rkey).
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let registered = regs
            .map(SharedRegistrations::lock)
            .ok_or(RegisterRefused)
            .and_then(|mut registrations| {
                registrations
                    .register(
                        self.owner,
                        buf.as_mut_ptr() as u64,
                        buf.len() as u64,
                        access,
                    )
                    .map_err(|_| RegisterRefused)
            });
        let Ok(sink) = registered else {
            tracing::debug!(len = buf.len(), "rendezvous receive: registration refused");
            return match session.reject_remote_segment() {
                Ok(()) => {
                    self.service();
                    Err(SinkRefused::Rejected)
                }
                Err(RecvError::Reset) => Err(SinkRefused::Errno(libc::ECONNRESET)),
                Err(_) => Err(SinkRefused::Errno(libc::EAGAIN)),
            };
        };
        let flags = RecvFlags {
            peek,
            ..RecvFlags::default()
        };
        match session.post_recv(sink, flags) {
            Ok(ticket) => {
                // The sender sleeps until our completion message (or sink advertisement)
                // reaches it: announce it as readable, not only as a credit return.
                self.data_to_announce = true;
                self.service();
                Ok(ticket)
            }
            Err(error) => {
                tracing::debug!(?error, ?sink, "zero-copy receive refused by the session");
                if let Some(mut registrations) = regs.map(SharedRegistrations::lock) {
                    registrations.release(&[sink.handle]);
                }
                Err(SinkRefused::Errno(match error {
                    RecvError::WouldBlock | RecvError::NotRemote => libc::EAGAIN,
                    RecvError::Reset => libc::ECONNRESET,
                    RecvError::NotConnected => libc::ENOTCONN,
                    _ => libc::EINVAL,
                }))
            }
        }
    }

    /// The outcome of zero-copy receive `ticket`, once the session reported it.
    pub(crate) fn take_recv_completion(
        &mut self,
        ticket: RecvTicket,
        peek: bool,
    ) -> Option<Result<usize, c_int>> {
        match self.recv_completed {
            Some((done, _)) if done == ticket => {}
            _ => return None,
        }
        let (_, result) = self.recv_completed.take()?;
        Some(match result {
            Ok(bytes) => {
                if !peek {
                    self.record.count(Counter::SanRendezvousReceived, bytes);
                }
                Ok(usize::try_from(bytes).unwrap_or(usize::MAX))
            }
            Err(RecvError::Reset) if self.peer_fin => Ok(0),
            Err(_) => Err(libc::ECONNRESET),
        })
    }

    /// Bytes a read would return now (FIONREAD): queued SAN bytes, or (acceptor) the client's
    /// TCP bytes not yet read.
    pub(crate) fn readable_bytes(&self, tcp_queued: usize) -> usize {
        if !self.restored.is_empty() {
            // Absorbed bytes come first; what the session still holds follows them.
            let session = self.session.as_ref().map_or(0, |s| {
                usize::try_from(s.recv_pending_bytes()).unwrap_or(usize::MAX)
            });
            return self.restored.len().saturating_add(session);
        }
        if self.reads_on_tcp() {
            return tcp_queued;
        }
        match self.tcp_backlog() {
            Some(0) => self.session.as_ref().map_or(0, |s| {
                usize::try_from(s.recv_pending_bytes()).unwrap_or(usize::MAX)
            }),
            Some(left) => tcp_queued.min(usize::try_from(left).unwrap_or(usize::MAX)),
            None => tcp_queued,
        }
    }

    /// The errno of a send refused because the session was reset: `ECONNRESET`; after the
    /// kernel connection beside it failed, that error once, then `EPIPE` (as the kernel
    /// reports `sk_err` once and the closed socket then refuses sends).
    fn send_reset_errno(&mut self) -> c_int {
        match self.kernel_error {
            None => libc::ECONNRESET,
            Some(_) if self.reset_reported => libc::EPIPE,
            Some(errno) => {
                self.reset_reported = true;
                errno
            }
        }
    }

    /// The kernel TCP connection beside the session is over with `errno` (the service thread
    /// saw it close because the peer's host could not be reached: a keepalive timeout). A
    /// peer host that vanished is noticed by nothing else while the session is idle; the
    /// application learns it as it would over TCP: the error once, every wait woken.
    pub(crate) fn kernel_connection_failed(&mut self, errno: c_int) {
        if self.phase != Phase::Switched || self.kernel_error.is_some() {
            return;
        }
        let Some(session) = self.session.as_mut() else {
            return;
        };
        tracing::debug!(name = %self.name, errno, "kernel connection beside the SAN session failed");
        self.kernel_error = Some(errno);
        session.handle_kernel_connection_failed();
        self.service();
        self.ring_local_bell();
    }

    /// Wakes the threads blocked on this socket (see `local_bell`), if any.
    fn ring_local_bell(&self) {
        if self.waiters > 0 {
            if let Some(bell) = self.local_bell.as_ref() {
                let one = 1u64;
                // SAFETY: an 8-byte write to our eventfd.
                unsafe { libc::write(bell.as_raw_fd(), (&one as *const u64).cast(), 8) };
            }
        }
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

    /// After a read: if nothing more is readable, lowers `M` so level-triggered waiters and
    /// `poll()` stop reporting it (no system call when it is already low).
    pub(crate) fn settle_readable(&mut self) {
        if self.watched && !self.readiness().readable {
            let _ = self.lower_readable();
        }
    }

    /// After a receive found nothing: lowers `M`'s readability (so a level-triggered waiter
    /// sleeps) unless data arrived meanwhile. Returns true when the caller may report EAGAIN.
    pub(crate) fn lower_readable(&mut self) -> bool {
        let (Some(mirror), Some(conn)) = (self.mirror.as_mut(), self.conn.as_ref()) else {
            return true;
        };
        let session = self.session.as_ref();
        let has_data =
            || session.is_some_and(|s| s.readiness().readable) || !conn.prepare_to_block();
        let lowered = mirror.lower_readable(has_data);
        conn.finish_blocking();
        !matches!(lowered, Ok(ReadLowering::StillReadable))
    }

    /// After a send found no room: lowers `M`'s writability until the peer returns space.
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
            // yet): they count as room, found by the caller's next drive.
            conn.is_some_and(Link::has_input)
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

    /// The mirror end `M` (what epoll/poll watch in place of the TCP socket).
    pub(crate) fn mirror_fd(&self) -> Option<RawFd> {
        self.mirror.as_ref().map(|m| m.as_fd().as_raw_fd())
    }

    /// Whether an edge-triggered epoll registration watches `M`: the peer then raises it for
    /// every arrival, as a TCP socket signals every arriving segment (see
    /// [`Mirror::set_edge_per_arrival`]).
    pub(crate) fn set_edge_per_arrival(&self, on: bool) {
        if let Some(mirror) = self.mirror.as_ref() {
            mirror.set_edge_per_arrival(on);
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
            return None;
        }
        let session = self.session.as_ref();
        let mirror = self.mirror.as_mut()?;
        let lowered = mirror.lower_readable(|| {
            session.is_some_and(|s| s.readiness().readable) || !conn.prepare_to_block()
        });
        if matches!(lowered, Ok(ReadLowering::StillReadable) | Err(_)) {
            conn.finish_blocking();
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
            if let Some(conn) = self.conn.as_ref() {
                conn.finish_blocking();
            }
            return None;
        }
        self.waiters += 1;
        Some(wait)
    }

    /// [`SanSocket::prepare_wait`] for a reader of a switched socket: over verbs the wait may
    /// poll the completion queue before it sleeps, when the connection's [`SpinPolicy`]
    /// (adaptive) says polling pays. `None`: news arrived, do not block.
    ///
    /// [`SpinPolicy`]: super::tunables::SpinPolicy
    pub(crate) fn prepare_read_wait(&mut self) -> Option<WaitFds> {
        let polls = self.phase == Phase::Switched
            && poll_budget() > 0
            && self
                .verbs_link_mut()
                .is_some_and(|link| link.answer_expected && link.spin.should_poll());
        self.prepare_wait_polling(0, polls)
    }

    /// One poll round of a blocked reader (its lock held): true when there is news, a
    /// completion waiting for the drive or a session another thread made readable.
    pub(crate) fn poll_round(&mut self) -> bool {
        if self.session.as_ref().is_none_or(|s| s.readiness().readable) {
            return true;
        }
        self.verbs_link_mut().is_none_or(|link| {
            // (A thread polling is in a call: the service thread's tick leaves the link be.)
            link.note_call();
            link.gather()
        })
    }

    /// The outcome of a blocked reader's polling (see [`super::tunables::SpinPolicy`]), and
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
        if let Some(link) = self.verbs_link_mut() {
            link.note_call();
            if received {
                link.answer_expected = false;
            }
            if sent {
                link.answer_expected = true;
            }
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

    /// Prepares a blocking wait for room to send (no credits): lowers `M`'s writability,
    /// which the peer raises whenever it transmits (credits travel with every message).
    /// `None`: room appeared meanwhile, retry at once.
    ///
    /// Unlike [`SanSocket::prepare_wait`] this does not watch `M`'s readability: data that
    /// another thread has yet to read keeps `M` readable, and a sender that woke on it would
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

    /// A wait on `M` for `events` and on the socket's bell (`asleep`: `finish_wait` owes
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
            if let Some(link) = self.verbs_link_mut() {
                link.end_direct_wait();
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
            if let Some(link) = self.verbs_link_mut() {
                link.owe_direct_wait_end();
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
        if !self
            .verbs_link_mut()
            .is_some_and(|link| link.take_owed_event())
        {
            return;
        }
        if self.phase == Phase::Switched {
            self.arm_verbs();
        }
        if let Some(link) = self.verbs_link_mut() {
            link.end_direct_wait();
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
        if self.waiters == 0 {
            if let Some(conn) = self.conn.as_ref() {
                conn.finish_blocking();
            }
        }
    }

    /// `shutdown(2)` on the session and the mirrors.
    pub(crate) fn shutdown(&mut self, how: c_int) {
        let Some(session) = self.session.as_mut() else {
            return;
        };
        let raw_how = how;
        let how = match how {
            libc::SHUT_RD => Shutdown::Read,
            libc::SHUT_WR => Shutdown::Write,
            _ => Shutdown::Both,
        };
        if how != Shutdown::Read {
            self.write_shut = true;
            self.data_to_announce = true;
        }
        if self.early.is_empty() {
            session.shutdown(how);
        } else {
            // The FIN must follow the bytes still waiting for the handshake.
            self.deferred_shutdown = Some(raw_how);
        }
        if how != Shutdown::Read {
            if let Some(mirror) = self.mirror.as_mut() {
                let _ = mirror.shutdown_write();
            }
        }
        // The peer learns of our FIN from the session's `Fin` message, which may wait behind
        // queued data for credits; its mirror is raised when that message is transmitted
        // (and its own session then reports RDHUP locally). Shutting down its `K` here
        // instead could show RDHUP before the data and the `Fin` arrive: an edge-triggered
        // peer would see its only edge too early.
        self.service();
    }

    /// Whether the session has reached a terminal or quiescent state after `close`.
    fn quiescent(&self) -> bool {
        self.session.as_ref().is_none_or(|s| {
            s.is_quiescent() || matches!(s.state(), SessionState::Reset | SessionState::FellBack)
        })
    }

    /// `close(2)`: graceful (queued data then FIN, bounded by `linger`) or abortive (RST).
    pub(crate) fn close(mut self, tcp: Option<c_int>, abortive: bool, linger: Duration) {
        match (self.side, tcp) {
            // An unread byte would make the kernel answer our close with a reset.
            (Side::Client, Some(tcp)) => self.consume_marker(tcp),
            // A client that never switched must learn of our FIN.
            (Side::Acceptor, Some(tcp)) => self.wake_pending_client(tcp),
            _ => {}
        }
        let start = std::time::Instant::now();
        if !abortive {
            // Early bytes go first; they need the handshake to finish.
            while !self.early.is_empty()
                && start.elapsed() < linger
                && self.conn.as_ref().is_some_and(Link::is_up)
            {
                self.service();
                if let Some(conn) = self.conn.as_ref() {
                    conn.wait(Duration::from_millis(10));
                }
            }
        }
        if abortive || !self.downgrade_wanted {
            if let Some(session) = self.session.as_mut() {
                session.close(abortive);
            }
        } else {
            // Downgrading: bytes we sent on TCP follow our `Downgrade`, and the kernel's FIN
            // ends the stream after them; the session only has to get its `Downgrade` out.
            while !self.downgrade_sent
                && start.elapsed() < linger
                && self.conn.as_ref().is_some_and(Link::is_up)
            {
                self.service();
                if let Some(conn) = self.conn.as_ref() {
                    conn.wait(Duration::from_millis(10));
                }
            }
        }
        self.data_to_announce = true;
        self.service();
        while !self.quiescent() && start.elapsed() < linger {
            if let Some(conn) = self.conn.as_ref() {
                if conn.wait(Duration::from_millis(10)) == san_shm::WaitResult::Disconnected {
                    break;
                }
            }
            self.service();
        }
        if let Some(mut conn) = self.conn.take() {
            conn.close();
        }
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

/// The verbs provider's part (`super::verbs`; `docs/ARCHITECTURE.md`, "Cross-host discovery
/// (verbs)"): the same session, mirror and switch-over, over a cross-host connection whose
/// readiness this process's service thread mirrors.
impl SanSocket {
    fn with_link(
        record: &'static SocketRecord,
        side: Side,
        name: &SegmentName,
        link: VerbsLink,
    ) -> SanSocket {
        Self::fresh(
            record,
            side,
            name,
            Link::Verbs(link),
            Arc::new(PeerMirror::default()),
        )
    }

    /// Whether this socket runs over verbs.
    pub(crate) fn is_verbs(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.verbs().is_some())
    }

    /// A pending verbs client (its CM listener is up; see `super::verbs::client`).
    pub(crate) fn verbs_client(
        record: &'static SocketRecord,
        name: &SegmentName,
        link: VerbsLink,
    ) -> SanSocket {
        Self::with_link(record, Side::Client, name, link)
    }

    /// The accepting side after its CM connect to the client was established: the session
    /// starts with `tcp_bytes_sent = 0`; the caller writes the switch marker.
    pub(crate) fn verbs_acceptor(
        record: &'static SocketRecord,
        name: &SegmentName,
        link: VerbsLink,
    ) -> Result<SanSocket, SetupError> {
        let mut socket = Self::with_link(record, Side::Acceptor, name, link);
        socket.start_verbs_session(Role::Passive)?;
        socket.marker_owed = true;
        socket.service();
        socket.mark_switched();
        Ok(socket)
    }

    /// Creates the mirror (both ends local: `K` stays with the link, for the service thread)
    /// and the session.
    fn start_verbs_session(&mut self, role: Role) -> Result<(), SetupError> {
        let page = Arc::new(WordsPage::create().ok_or(SetupError::Resource)?);
        let (mirror, k) =
            Mirror::new(SideWords::new(page.clone(), 0)).map_err(|_| SetupError::Resource)?;
        let link = self
            .conn
            .as_mut()
            .and_then(Link::verbs_mut)
            .ok_or(SetupError::Resource)?;
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
        self.session = Some(Session::new(role, config, capabilities, VERBS_SLOTS, sent));
        self.mirror = Some(mirror);
        self.page = Some(page);
        self.phase = Phase::Switched;
        self.ring_pending_bell();
        // Our Hello goes out at the next service.
        self.data_to_announce = true;
        Ok(())
    }

    /// Client, pending, attached over verbs: takes the connection and starts the session
    /// with the TCP byte count. `Err`: the attach failed after our reply; the connection
    /// cannot continue.
    fn switch_verbs(&mut self, tcp: c_int) -> Result<(), ()> {
        self.conn
            .as_mut()
            .and_then(Link::verbs_mut)
            .ok_or(())?
            .take_attached()?;
        self.start_verbs_session(Role::Active).map_err(|_| ())?;
        let shut =
            self.record.flags() & (crate::record::flags::SHUT_WR | crate::record::flags::SHUT_RD);
        if shut & crate::record::flags::SHUT_WR != 0 {
            self.shutdown(libc::SHUT_WR);
        }
        if shut & crate::record::flags::SHUT_RD != 0 {
            self.shutdown(libc::SHUT_RD);
        }
        self.service();
        self.consume_marker(tcp);
        self.mark_switched();
        Ok(())
    }

    /// Verbs: the peer cannot raise our mirror, so whoever drives the session does.
    fn raise_own_mirror(&self) {
        let Some(link) = self.conn.as_ref().and_then(Link::verbs) else {
            return;
        };
        if self.phase != Phase::Switched {
            return;
        }
        let readiness = self.readiness();
        // Acceptor: the client's pre-switch bytes wait on TCP, read before the session's;
        // the application watches the mirror, not TCP, so they make the mirror readable.
        // Readable only while poll/select/epoll watch `M`: a thread blocked in a call waits
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
        link.raise(readable, writable);
    }

    /// poll/select/epoll watch `M` from now on: over verbs, where `M`'s readability is kept
    /// only while watched, it is raised now if data waits.
    pub(crate) fn set_watched(&mut self) {
        if !self.watched {
            self.watched = true;
            self.raise_own_mirror();
        }
    }

    /// The service thread, after an event of this socket's connection (or its periodic
    /// sweep): collects the events, drives the session, raises the mirror, re-arms the
    /// completion channel (driving again while completions keep arriving, boundedly: the
    /// sweep catches up).
    pub(crate) fn service_verbs_event(&mut self) {
        if self.phase != Phase::Switched || !self.is_verbs() {
            return;
        }
        if let Some(link) = self.conn.as_mut().and_then(Link::verbs_mut) {
            link.collect_events();
        }
        self.service();
    }

    /// The registrations (domain and cache) this socket's memory is registered with: its
    /// verbs domain's, or the process-wide shm one.
    fn shared_registrations(&self) -> Option<&'static SharedRegistrations> {
        match self.conn.as_ref().and_then(Link::verbs) {
            Some(link) => Some(link.registrations()),
            None => provider().map(|p| &p.registrations),
        }
    }

    /// The verbs link (to register with the service thread, to wait on directly).
    /// Verbs, pending client: we declined the acceptor's connect for want of resources
    /// (see `VerbsLink::declined`).
    pub(crate) fn declined_locally(&self) -> bool {
        matches!(&self.conn, Some(Link::Verbs(link)) if link.declined())
    }

    pub(crate) fn verbs_link_mut(&mut self) -> Option<&mut VerbsLink> {
        self.conn.as_mut().and_then(Link::verbs_mut)
    }

    /// Verbs: a thread that waited on the connection's fd itself woke on it: the channel and
    /// connection events are collected (the next drive handles the completions).
    pub(crate) fn collect_link_events(&mut self) {
        if let Some(link) = self.verbs_link_mut() {
            link.collect_events();
        }
    }

    /// Verbs: the blocking wait `fds` watches the connection's events itself (see
    /// [`VerbsLink::begin_direct_wait`]). False: the channel is not armed,
    /// drive again instead of blocking.
    fn watch_link_directly(&mut self, fds: &mut WaitFds) -> bool {
        if !fds.spin && self.verbs_link_mut().is_some_and(|link| link.owed()) {
            // A wait that sleeps at once needs an armed queue: settle the owed one, then look
            // again rather than sleep (what settling drove is news nobody announced: this
            // wait is not counted among the waiters yet).
            self.settle_direct_wait();
            return false;
        }
        let Some(link) = self.verbs_link_mut() else {
            return true;
        };
        fds.link = link.begin_direct_wait();
        fds.link.is_some()
    }
}

/// The shm connection over `segment`, whose doorbell also raises the peer's mirror (known
/// once the exchange delivered its end: the returned [`PeerMirror`]).
fn shm_connection(
    segment: ShmSegment,
    registrations: &super::registrations::SharedRegistrations,
) -> Result<(ShmConnection, Arc<PeerMirror>), SetupError> {
    let peer = Arc::new(PeerMirror::default());
    let conn = ShmConnection::with_doorbell(
        segment,
        registrations.lock().domain().ok_or(SetupError::Resource)?,
        connection_config(),
        Box::new(MirrorDoorbell(peer.clone())),
    )
    .map_err(|_| SetupError::Resource)?;
    Ok((conn, peer))
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
