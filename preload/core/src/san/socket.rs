//! One SAN socket: the segment, the session, the readiness mirror and the switch-over state.
//!
//! Everything here runs with the socket's lock held (see [`super::slot`]) and never blocks in
//! the kernel: the blocking loops in [`super::io`] release the lock around `poll()`.

use core::ffi::c_int;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use san_api::Access;
use san_shm::{ConnectionConfig, Doorbell, SegmentConfig, ShmConnection, ShmSegment};
use switch::error::{RecvError, SendError};
use switch::mr_cache::OwnerId;
use switch::session::{
    drive, Event, MrHandleId, RecvFlags, RecvTicket, Role, SendFlags, SendTicket, Session,
    SessionConfig, SessionState, Shutdown,
};

use super::exchange::{self, SideWords, WordsPage, MIRROR_END, WORDS_PAGE};
use crate::discovery::SegmentName;
use crate::mirror::{self, Mirror, ReadLowering, WriteLowering};
use crate::real;
use crate::record::{Counter, DataPath, SocketRecord, SocketState};

/// Not an errno (those are positive): [`SanSocket::recv`] found a rendezvous segment at the
/// head of the stream; the caller receives it with [`SanSocket::start_recv_rendezvous`].
pub(crate) const REMOTE_SEGMENT_AHEAD: c_int = -1;

/// The one byte the acceptor writes on TCP after attaching: "switch now".
pub(crate) const SWITCH_MARKER: u8 = 0x5a;

/// Index of the connecting side's words in the shared page (the acceptor's is 1).
const CLIENT_WORDS: usize = 0;
const ACCEPTOR_WORDS: usize = 1;

/// Most bytes [`SanSocket::send`] buffers before the handshake finished (a kernel socket
/// buffer's worth).
const EARLY_LIMIT: usize = 256 << 10;

/// Slot pools of every SAN connection: 32 × 16 KiB per direction.
pub(crate) const SLOTS: san_api::SlotConfig = san_api::SlotConfig {
    send_slots: 32,
    recv_slots: 32,
    slot_size: 16 << 10,
};

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
        rendezvous_threshold: if super::rendezvous_enabled() {
            defaults.rendezvous_threshold
        } else {
            u32::MAX
        },
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
    /// The mirror end to poll for POLLIN (peer activity), if switched.
    pub mirror: Option<RawFd>,
    /// Also poll the TCP socket for these events (0: not at all).
    pub tcp_events: i16,
    /// `finish_blocking` is owed after the poll.
    pub asleep: bool,
    /// The socket's local bell: rung when one thread makes progress others may wait for.
    pub bell: Option<RawFd>,
}

/// A SAN socket.
pub(crate) struct SanSocket {
    pub side: Side,
    pub phase: Phase,
    record: &'static SocketRecord,
    conn: Option<ShmConnection>,
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
    released: Vec<MrHandleId>,
    /// This socket's owner id in the registration cache.
    owner: OwnerId,
    /// The outcome of the last rendezvous send, until its caller collects it.
    send_completed: Option<(SendTicket, Result<u64, switch::error::SendError>)>,
    /// The outcome of the last zero-copy receive, until its caller collects it.
    recv_completed: Option<(RecvTicket, Result<u64, RecvError>)>,
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
        let peer = Arc::new(PeerMirror::default());
        let conn = ShmConnection::with_doorbell(
            segment,
            registrations.lock().domain(),
            connection_config(),
            Box::new(MirrorDoorbell(peer.clone())),
        )
        .map_err(|_| SetupError::Resource)?;
        Ok(SanSocket {
            side: Side::Client,
            phase: Phase::Pending,
            record,
            conn: Some(conn),
            session: None,
            mirror: None,
            peer,
            page: None,
            exchange: Some(listener),
            tcp_sent: 0,
            tcp_received: 0,
            tcp_eof: false,
            marker_unread: true,
            peer_fin: false,
            early: Vec::new(),
            name: *name,
            write_shut: false,
            deferred_shutdown: None,
            fin_mirrored: false,
            data_to_announce: false,
            reset_reported: false,
            marker_owed: false,
            waiters: 0,
            watched: false,
            local_bell: None,
            released: Vec::new(),
            owner: next_owner(),
            send_completed: None,
            recv_completed: None,
        })
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
        let peer = Arc::new(PeerMirror::default());
        let conn = ShmConnection::with_doorbell(
            segment,
            registrations.lock().domain(),
            connection_config(),
            Box::new(MirrorDoorbell(peer.clone())),
        )
        .map_err(|_| SetupError::Resource)?;
        let session = Session::new(
            Role::Passive,
            session_config(),
            conn.capabilities(),
            SLOTS,
            0,
        );
        let mut socket = SanSocket {
            side: Side::Acceptor,
            phase: Phase::Switched,
            record,
            conn: Some(conn),
            session: Some(session),
            mirror: Some(our_mirror),
            peer,
            page: Some(page),
            exchange: Some(link),
            tcp_sent: 0,
            tcp_received: 0,
            tcp_eof: false,
            marker_unread: false,
            peer_fin: false,
            early: Vec::new(),
            name: *name,
            write_shut: false,
            deferred_shutdown: None,
            fin_mirrored: false,
            // Our Hello: the peer must call in to complete the handshake.
            data_to_announce: true,
            reset_reported: false,
            marker_owed: true,
            waiters: 0,
            watched: false,
            local_bell: None,
            released: Vec::new(),
            owner: next_owner(),
            send_completed: None,
            recv_completed: None,
        };
        socket.service();
        socket.mark_switched();
        Ok(socket)
    }

    fn mark_switched(&self) {
        self.record.path.store(
            DataPath::SanShm as u32,
            core::sync::atomic::Ordering::Release,
        );
        self.record.set_state(SocketState::San);
    }

    /// Client: true once the acceptor attached (the switch may happen now).
    pub(crate) fn peer_attached(&self) -> bool {
        self.conn
            .as_ref()
            .is_some_and(|conn| conn.segment().is_attached())
    }

    /// Client, pending: counts stream bytes the kernel accepted on TCP.
    pub(crate) fn count_tcp_sent(&mut self, bytes: u64) {
        self.tcp_sent += bytes;
    }

    /// Client, pending, segment attached: takes the mirror end and words from the exchange,
    /// answers with ours, and starts the session with the TCP byte count. `Err` means the
    /// exchange was not usable: the connection cannot continue (the acceptor talks SAN only).
    pub(crate) fn switch(&mut self, tcp: c_int) -> Result<(), ()> {
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

    /// Acceptor: writes the switch marker on TCP (once, unless the client already switched):
    /// a client waiting on its TCP socket wakes, switches and completes the handshake.
    pub(crate) fn wake_pending_client(&mut self, tcp: c_int) {
        if !self.marker_owed {
            return;
        }
        let client_switched = self
            .session
            .as_ref()
            .is_some_and(|s| s.peer_tcp_bytes_sent().is_some());
        self.marker_owed = false;
        if client_switched {
            return;
        }
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

    /// Pumps the session over the connection, handles its events, raises the peer's mirror
    /// after transmitting, and (acceptor) picks up the client's mirror end once it is queued.
    pub(crate) fn service(&mut self) {
        let (Some(session), Some(conn)) = (self.session.as_mut(), self.conn.as_mut()) else {
            return;
        };
        let progress = drive(session, conn, &mut self.released);
        if !self.released.is_empty() {
            if let Some(mut registrations) = super::registrations() {
                registrations.release(&self.released);
            }
            self.released.clear();
        }
        if let Err(error) = &progress {
            tracing::debug!(name = %self.name, ?error, "SAN drive error");
        }
        if self.waiters > 0 && progress.is_ok_and(|p| p.completions > 0) {
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
        let mut sent = progress.is_ok_and(|p| p.messages_sent > 0);
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
        if sent {
            // Credit returns only make the peer writable; data and FIN make it readable
            // (raising readable for a bare credit update would be a spurious wake-up).
            if self.data_to_announce {
                self.peer.raise_readable();
                let drained = self
                    .session
                    .as_ref()
                    .is_none_or(|s| s.send_queue_len() == 0);
                if drained && self.early.is_empty() {
                    self.data_to_announce = false;
                }
            }
            self.peer.raise_writable();
        }
        self.mirror_fin();
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
            _ => false,
        }
    }

    fn drive_again(&mut self) -> bool {
        let (Some(session), Some(conn)) = (self.session.as_mut(), self.conn.as_mut()) else {
            return false;
        };
        let progress = drive(session, conn, &mut self.released);
        if !self.released.is_empty() {
            if let Some(mut registrations) = super::registrations() {
                registrations.release(&self.released);
            }
            self.released.clear();
        }
        progress.is_ok_and(|p| p.messages_sent > 0)
    }

    /// True when the peer is this very process (both ends of an in-process connection).
    pub(crate) fn peer_in_process(&self) -> bool {
        self.conn
            .as_ref()
            .and_then(|conn| conn.segment().peer_pid())
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
                Err(libc::ECONNRESET)
            }
            Err(RecvError::InvalidArgument) => Err(libc::EINVAL),
            Err(RecvError::NotConnected) => Err(libc::ENOTCONN),
            Err(RecvError::Interrupted) => Err(libc::EINTR),
            Err(RecvError::RemoteSegment { .. }) => Err(REMOTE_SEGMENT_AHEAD),
            Err(_) => Err(libc::ECONNRESET),
        }
    }

    /// Queues stream bytes for sending: a short count when the send buffer fills.
    pub(crate) fn send(&mut self, data: &[u8], urgent: bool) -> Result<usize, c_int> {
        if self.write_shut {
            return Err(libc::EPIPE);
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
            Err(SendError::Reset) => Err(libc::ECONNRESET),
            Err(SendError::NoBuffers) => Err(libc::ENOBUFS),
            Err(SendError::NotConnected) => Err(libc::ENOTCONN),
            Err(SendError::TooLong) => Err(libc::EMSGSIZE),
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
            && session
                .rendezvous_threshold()
                .is_some_and(|t| t != u32::MAX && len as u64 >= u64::from(t))
    }

    /// Starts a zero-copy send of `data` (which must stay valid and unchanged until the
    /// send completes: the caller is a blocking send that waits for it). `ENOBUFS` when the
    /// registration is refused, `EAGAIN` while another rendezvous is in progress.
    pub(crate) fn start_send_rendezvous(&mut self, data: &[u8]) -> Result<SendTicket, c_int> {
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
        let Some(mut registrations) = super::registrations() else {
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
                    SendError::Reset => libc::ECONNRESET,
                    SendError::NotConnected => libc::ENOTCONN,
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
            Err(SendError::Reset) => Err(libc::ECONNRESET),
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
        let Some(session) = self.session.as_mut() else {
            return Err(SinkRefused::Errno(libc::ENOTCONN));
        };
        // The segment's mode (we read it, or the peer writes into an advertised sink) is the
        // session's knowledge, not ours, and the capabilities the session was started with
        // may differ from the connection's current ones (CMA is confirmed once the peer is
        // known): register for both. The remote exposure ends when the session releases
        // the sink (the cache revokes the rkey).
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        let registered =
            super::registrations()
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
                if let Some(mut registrations) = super::registrations() {
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
        match self.tcp_backlog() {
            Some(0) => self.session.as_ref().map_or(0, Session::recv_queue_len),
            Some(left) => tcp_queued.min(usize::try_from(left).unwrap_or(usize::MAX)),
            None => tcp_queued,
        }
    }

    /// The session's readiness (all false before the switch).
    pub(crate) fn readiness(&self) -> switch::session::Readiness {
        self.session
            .as_ref()
            .map(Session::readiness)
            .unwrap_or_default()
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
        let early_room = self.early.len() < EARLY_LIMIT;
        let lowered = mirror.lower_writable(|| {
            session.is_some_and(|s| {
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

    /// Prepares a blocking wait: spins briefly while the peer runs, then announces "asleep"
    /// and lowers the mirror. `None`: news arrived, do not block.
    pub(crate) fn prepare_wait(&mut self, tcp_events: i16) -> Option<WaitFds> {
        if self.phase == Phase::Pending {
            return Some(WaitFds {
                mirror: None,
                tcp_events,
                asleep: false,
                bell: None,
            });
        }
        if self.local_bell.is_none() {
            // SAFETY: plain eventfd(2); the result is owned below.
            let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            if raw >= 0 {
                // SAFETY: a fresh descriptor owned by nobody else.
                self.local_bell =
                    Some(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) });
            }
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
        self.waiters += 1;
        Some(WaitFds {
            mirror: Some(mirror.as_fd().as_raw_fd()),
            tcp_events,
            asleep: true,
            bell: self.local_bell.as_ref().map(AsRawFd::as_raw_fd),
        })
    }

    /// After the poll of a prepared wait. The connection stays "asleep" for the peer while
    /// any other thread still sleeps on it, so the peer keeps ringing.
    pub(crate) fn finish_wait(&mut self, fds: &WaitFds) {
        if !fds.asleep {
            return;
        }
        self.waiters = self.waiters.saturating_sub(1);
        if let Some(bell) = self.local_bell.as_ref() {
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
                && self.conn.as_ref().is_some_and(ShmConnection::is_up)
            {
                self.service();
                if let Some(conn) = self.conn.as_ref() {
                    conn.wait(Duration::from_millis(10));
                }
            }
        }
        if let Some(session) = self.session.as_mut() {
            session.close(abortive);
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
        if let Some(mut registrations) = super::registrations() {
            registrations.release_owner(self.owner);
        }
    }
}
