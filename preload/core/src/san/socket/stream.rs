//! The byte stream of a switched socket: inline sends and receives through the session, the
//! rendezvous (zero-copy) sends and receives, and the acceptor's count of the client's
//! pre-switch bytes still to read on TCP.

use core::ffi::c_int;

use san_api::{Access, AppSink, AppSource};
use switch::error::{RecvError, SendError};
use switch::session::{RecvFlags, RecvTicket, ResetCause, SendFlags, SendTicket, SessionState};

use super::{Phase, SanSocket, Side};
use crate::record::Counter;
use crate::san::link::Link;
use crate::san::outcome::SanError;
use crate::san::registrations::SharedRegistrations;
use crate::san::tunables::REPOST_BATCH;

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

impl SanSocket {
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
    fn tcp_bytes_pending(&self) -> bool {
        self.side == Side::Acceptor && self.tcp_backlog() != Some(0) && !self.tcp_eof
    }

    /// Acceptor: a read of `tcp` (this socket's kernel socket) now returns pre-switch bytes
    /// of the client (or TCP's end of stream). Once the client's count is known, the bytes
    /// are due, and there: it wrote them before its `Hello`. While it is not, only the kernel knows whether more
    /// came: a mirror raised before the client's `Hello` arrived reported the socket readable
    /// with nothing to read (`EAGAIN` to a level-triggered reader right after a read had
    /// emptied it).
    pub(crate) fn tcp_bytes_readable(&self, tcp: c_int) -> bool {
        self.tcp_bytes_pending()
            && (self.tcp_backlog().is_some() || crate::san::kernel::tcp_readable_now(tcp))
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

    /// Acceptor, TCP at its end and the client's `Hello` not here: whether it may still
    /// come. The client sends it before its FIN, but a fabric that delivers after TCP
    /// (verbs) may bring it later; over shm it would be here already (a client that shut
    /// down while pending sends none: its stream, all on TCP, ends there).
    pub(crate) fn hello_may_trail_tcp(&self) -> bool {
        !self.is_broken()
            && self
                .conn
                .as_ref()
                .is_some_and(|conn| !conn.delivers_before_tcp())
    }

    /// Copies queued stream bytes out into `buf` (the application's memory): `Ok(0)` at end
    /// of stream; `EFAULT`, and the bytes left unread, when `buf` cannot be written.
    pub(crate) fn recv<D: AppSink + ?Sized>(
        &mut self,
        buf: &mut D,
        peek: bool,
    ) -> Result<usize, SanError> {
        if !self.restored.is_empty() {
            let n = buf.len().min(self.restored.len());
            if buf.copy_from(0, &self.restored[..n]).is_err() {
                return Err(SanError::Errno(libc::EFAULT));
            }
            if !peek {
                self.restored.drain(..n);
                self.note_consumed(n);
            }
            return Ok(n);
        }
        let Some(session) = self.session.as_mut() else {
            return Err(SanError::Errno(libc::ENOTCONN));
        };
        let flags = RecvFlags {
            peek,
            ..RecvFlags::default()
        };
        let received = match self.conn.as_ref() {
            Some(conn) => session.recv_from_slots(buf, flags, conn),
            None => session.recv_into(buf, flags),
        };
        match received {
            Ok(n) => {
                if !peek && n > 0 {
                    self.record.count(Counter::SanInlineReceived, n as u64);
                    self.note_consumed(n);
                }
                Ok(n)
            }
            Err(RecvError::Reset) if self.peer_fin || self.reset_reported => Ok(0),
            Err(RecvError::Reset) => {
                self.reset_reported = true;
                Err(SanError::Errno(
                    self.kernel_error.unwrap_or(libc::ECONNRESET),
                ))
            }
            // Not an answer of `Session::recv`: a broken stream here (`errno()` says `EAGAIN`).
            Err(RecvError::NotRemote) => Err(SanError::Errno(libc::ECONNRESET)),
            Err(error) => Err(error.into()),
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

    /// Whether a read of `want` (> 0) bytes may be answered without driving the session
    /// first: shm, switched, nothing of ours waiting to go out or to be announced, every
    /// byte of the stream so far came over the SAN, and the session holds the next `want`
    /// bytes inline already (whatever arrived meanwhile comes after them). A drive before
    /// every read cost a completion poll per call: wrk reads each 64 KiB response 8 KiB at a
    /// time and asks FIONREAD after each read.
    pub(crate) fn reads_without_drive(&self, want: usize) -> bool {
        want > 0
            && self.quiet_for_reads()
            && self.session.as_ref().is_some_and(|s| s.holds_inline(want))
    }

    /// After a read that returned bytes: whether a drive is due now. It is while the socket
    /// has other business, once the read emptied the session (the application reads on
    /// until it gets `EAGAIN` or goes to wait: the slots it freed go back to the peer before
    /// either), and once [`REPOST_BATCH`] slots wait to be re-posted (the peer's credits run
    /// low no further than that while the application works through what it received, as a
    /// receive window opens in steps). A drive after every read re-posted one slot per two
    /// of wrk's 8 KiB reads, a completion poll each time.
    pub(crate) fn drives_after_read(&self) -> bool {
        !self.quiet_for_reads()
            || self.session.as_ref().is_none_or(|s| {
                !s.holds_inline(1)
                    || s.ops_waiting() >= REPOST_BATCH
                    || s.credits_owed() >= REPOST_BATCH as u64
            })
    }

    /// Nothing but the peer's data is moving: see [`Self::reads_without_drive`].
    fn quiet_for_reads(&self) -> bool {
        self.phase == Phase::Switched
            && self.is_intra_host()
            && self.restored.is_empty()
            && self.early.is_empty()
            && self.deferred_shutdown.is_none()
            && !self.downgrade_wanted
            && !self.sent_outside_drive
            && !self.data_to_announce
            && !self.has_untransmitted()
            && self.tcp_backlog() == Some(0)
    }

    /// Queues stream bytes for sending: a short count when the send buffer fills; `EFAULT`,
    /// with nothing taken, when `data` (the application's memory) cannot be read.
    pub(crate) fn send<S: AppSource + ?Sized>(
        &mut self,
        data: &S,
        urgent: bool,
    ) -> Result<usize, SanError> {
        if self.write_shut {
            return Err(SanError::Errno(libc::EPIPE));
        }
        if self.downgrade_wanted {
            // Bytes still waiting for the handshake are older than these: they go first.
            self.early_to_tcp();
            if !self.early.is_empty() {
                return Err(SanError::Errno(libc::EAGAIN));
            }
            return Err(SanError::Downgraded);
        }
        let Some(session) = self.session.as_ref() else {
            return Err(SanError::Errno(libc::ENOTCONN));
        };
        let handshaking = session.state() == SessionState::Handshaking;
        if !data.is_empty() {
            self.data_to_announce = true;
        }
        if let Some(buffered) = self.send_early(data, handshaking) {
            return buffered;
        }
        self.send_inline(data, urgent)
    }

    /// Queues stream bytes in the session (after the early bytes).
    fn send_inline<S: AppSource + ?Sized>(
        &mut self,
        data: &S,
        urgent: bool,
    ) -> Result<usize, SanError> {
        let Some(session) = self.session.as_mut() else {
            return Err(SanError::Errno(libc::ENOTCONN));
        };
        let flags = SendFlags { urgent };
        let messages = session.stats().messages_sent;
        let sent = match self.conn.as_mut() {
            Some(conn) => session.send_into_slots(data, flags, conn),
            None => session.send_from(data, flags),
        };
        self.sent_outside_drive |= session.stats().messages_sent != messages;
        match sent {
            Ok(n) => {
                self.sent_after_fin |= self.peer_fin;
                self.record.count(Counter::SanInlineSent, n as u64);
                self.just_accepted = n;
                Ok(n)
            }
            Err(SendError::Reset) if self.peer_fin => self.send_after_peer_close(data),
            Err(SendError::Reset) => Err(SanError::Errno(self.send_reset_errno())),
            Err(error) => Err(error.into()),
        }
    }

    /// Whether a blocking send (of `len` bytes in all: its tail waits as its head did) should
    /// wait for the reader's credits instead of buffering its bytes (see `Session::waits_for_credits_to_send_straight`), for at most
    /// `CREDIT_WAIT_BOUND` from the first time it asked (`since`; a reader that does not read
    /// leaves the send to buffer after that, as before). Small sends buffer at once: there
    /// they share messages, straight into the slots each would take a slot of its own.
    pub(crate) fn waits_for_credits(
        &self,
        len: usize,
        since: &mut Option<std::time::Instant>,
    ) -> bool {
        let waits = len >= crate::san::tunables::CREDIT_WAIT_MIN_SEND
            && self.phase == Phase::Switched
            && matches!(self.conn, Some(Link::Shm(_)))
            && self.early.is_empty()
            && !self.downgrade_wanted
            && !self.write_shut
            && self
                .session
                .as_ref()
                .is_some_and(|s| s.waits_for_credits_to_send_straight());
        if !waits {
            return false;
        }
        let started = *since.get_or_insert_with(std::time::Instant::now);
        started.elapsed() < crate::san::tunables::CREDIT_WAIT_BOUND
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
    pub(crate) fn start_send_rendezvous(&mut self, data: &[u8]) -> Result<SendTicket, SanError> {
        let regs = self.shared_registrations();
        if self.write_shut {
            return Err(SanError::Errno(libc::EPIPE));
        }
        let Some(session) = self.session.as_mut() else {
            return Err(SanError::Errno(libc::ENOTCONN));
        };
        // READ mode: the peer copies the buffer out (CMA). WRITE mode: we copy it out
        // through the window, which needs only local access.
        let access = if session.sends_use_read_mode() == Some(true) {
            Access::REMOTE_READ
        } else {
            Access::NONE
        };
        let Some(mut registrations) = regs.map(SharedRegistrations::lock) else {
            return Err(SanError::Errno(libc::ENOBUFS));
        };
        let rest = registrations
            .register(self.owner, data.as_ptr() as u64, data.len() as u64, access)
            .map_err(|error| {
                tracing::debug!(
                    ?error,
                    len = data.len(),
                    "rendezvous send: registration refused"
                );
                SanError::Errno(libc::ENOBUFS)
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
                    SendError::Reset if self.peer_fin => SanError::Errno(libc::EPIPE),
                    SendError::Reset => SanError::Errno(self.send_reset_errno()),
                    // A rendezvous the session cannot start is a refused one, as a refused
                    // registration is (`errno()` would say `EMSGSIZE` and `EINVAL`).
                    SendError::TooLong | SendError::InvalidArgument => {
                        SanError::Errno(libc::ENOBUFS)
                    }
                    other => other.into(),
                })
            }
        }
    }

    /// Our blocking rendezvous send was interrupted by a signal: asks the receiver to end it
    /// with what it took (see `Session::cancel_send_rendezvous`), and nudges its process so
    /// that it answers even while its application makes no call. False when the send cannot
    /// be cut short (the peer lacks the capability): it then runs to its end.
    pub(crate) fn cancel_send_rendezvous(&mut self) -> bool {
        let Some(session) = self.session.as_mut() else {
            return false;
        };
        if !session.cancel_send_rendezvous() {
            return false;
        }
        self.data_to_announce = true;
        self.service();
        if let Some(peer) = self.peer_process() {
            crate::san::nudge::nudge(peer, crate::san::provider::segment_dir());
        }
        true
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
                self.journal_delivered(bytes);
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
                    self.note_consumed(usize::try_from(bytes).unwrap_or(usize::MAX));
                }
                Ok(usize::try_from(bytes).unwrap_or(usize::MAX))
            }
            Err(RecvError::Reset) if self.peer_fin => Ok(0),
            Err(_) => Err(libc::ECONNRESET),
        })
    }

    /// Bytes a read would return now (FIONREAD): queued SAN bytes, or (acceptor) the client's
    /// TCP bytes not yet read.
    pub(crate) fn readable_bytes(&self, tcp_queued: impl FnOnce() -> usize) -> usize {
        if !self.restored.is_empty() {
            // Absorbed bytes come first; what the session still holds follows them.
            let session = self.session.as_ref().map_or(0, |s| {
                usize::try_from(s.recv_pending_bytes()).unwrap_or(usize::MAX)
            });
            return self.restored.len().saturating_add(session);
        }
        if self.reads_on_tcp() {
            return tcp_queued();
        }
        match self.tcp_backlog() {
            Some(0) => self.session.as_ref().map_or(0, |s| {
                usize::try_from(s.recv_pending_bytes()).unwrap_or(usize::MAX)
            }),
            Some(left) => tcp_queued().min(usize::try_from(left).unwrap_or(usize::MAX)),
            None => tcp_queued(),
        }
    }

    /// A send after the peer's FIN that the session refused because it reset since. A peer
    /// that closed gracefully (its FIN, then its connection ended: not a `Rst`) is what TCP
    /// calls `CLOSE_WAIT`: the first send is accepted (the peer's kernel answers it with a
    /// reset, the bytes are lost) and later ones fail with `EPIPE`; reads see end of stream.
    /// The bytes are lost, but they are read as the kernel reads them into its buffer: a
    /// buffer the process may not read is `EFAULT`.
    fn send_after_peer_close<S: AppSource + ?Sized>(
        &mut self,
        data: &S,
    ) -> Result<usize, SanError> {
        let len = data.len();
        let closed_gracefully = matches!(self.reset_cause, Some(ResetCause::Provider(_)));
        if closed_gracefully && !self.sent_after_fin {
            if !readable(data) {
                return Err(SanError::Errno(libc::EFAULT));
            }
            self.sent_after_fin = true;
            self.reset_reported = true;
            self.record.count(Counter::SanInlineSent, len as u64);
            return Ok(len);
        }
        Err(SanError::Errno(libc::EPIPE))
    }

    /// The errno of a send refused because the session was reset: the reset's error
    /// (`ECONNRESET`, or the kernel connection's own error when it failed beside the
    /// session) once, by a read or a send, then `EPIPE`: the kernel reports `sk_err` once
    /// and the closed socket then refuses sends.
    fn send_reset_errno(&mut self) -> c_int {
        if self.reset_reported {
            return libc::EPIPE;
        }
        self.reset_reported = true;
        self.kernel_error.unwrap_or(libc::ECONNRESET)
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
}

/// Whether every byte of `data` can be read (copied through a small buffer, then dropped).
fn readable<S: AppSource + ?Sized>(data: &S) -> bool {
    let mut chunk = [0u8; 4096];
    let mut offset = 0;
    while offset < data.len() {
        let n = (data.len() - offset).min(chunk.len());
        if data.copy_to(offset, &mut chunk[..n]).is_err() {
            return false;
        }
        offset += n;
    }
    true
}
