//! Driving a SAN socket's session: one pump over the connection, the session's events
//! handled, the early bytes, a deferred shutdown and our `Downgrade` let out in order, the
//! peer's mirror raised (and its process nudged when it waits for us), progress published
//! in the record; over verbs the completion channel re-armed for whoever watches it next.

use std::os::fd::{AsFd, AsRawFd};

use super::{Phase, SanSocket, Side, CLIENT_WORDS};
use crate::san::exchange::{self, SideWords, MIRROR_END};
use crate::san::link::Link;
use crate::san::nudge::nudge;
use crate::san::registrations::SharedRegistrations;
use switch::session::{Event, MrHandleId, ResetCause, SessionState, Shutdown};

impl SanSocket {
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
        self.arm_link();
    }

    /// Verbs: arms the completion channel for whoever watches it next, driving what arrived
    /// meanwhile first.
    pub(super) fn arm_link(&mut self) {
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
                .is_none_or(|conn| conn.arm(solicited_only));
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
        // Receives published by this drive count as a transmission for the nudge below: the
        // peer's sends may have waited for them rather than for credits.
        let slots_grown = conn.take_slots_grown();
        let mut answer_downgrade = false;
        release(regs, &mut self.released);
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
                    self.reset_cause = Some(cause);
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
        if matches!(self.reset_cause, Some(ResetCause::Provider(_))) {
            self.take_leftovers_of_ended_peer();
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
        let mut sent = progress.is_ok_and(|p| p.messages_sent > 0)
            || queued_before
            || core::mem::take(&mut self.sent_outside_drive);
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
        if sent || slots_grown {
            self.nudge_stalled_peer();
        }
        if !self.has_untransmitted() {
            self.set_progress_wanted(false);
        }
        self.mirror_fin();
        self.raise_own_mirror();
        self.publish_progress();
    }

    pub(super) fn drive_again(&mut self) -> bool {
        let regs = self.shared_registrations();
        let (Some(session), Some(conn)) = (self.session.as_mut(), self.conn.as_mut()) else {
            return false;
        };
        let progress = self.pump.drive(session, conn, &mut self.released);
        release(regs, &mut self.released);
        progress.is_ok_and(|p| p.messages_sent > 0)
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
    pub(super) fn has_untransmitted(&self) -> bool {
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

    /// A send or receive call of the application begins: counted in our mirror's words, so
    /// that the peer does not nudge our process while the call is under way (it drives).
    /// Whether it was counted (the `entered` of [`SanSocket::leaving_call`]).
    pub(crate) fn entering_call(&self) -> bool {
        let Some(mirror) = self.mirror.as_ref().filter(|_| self.is_intra_host()) else {
            return false;
        };
        mirror.words().enter_call();
        true
    }

    /// Called as control returns to the application (and after a responder's servicing;
    /// `entered`: the call was counted by [`SanSocket::entering_call`]): bytes we could not
    /// transmit would wait for its next call, which may never come (a server that answered
    /// and went idle); the peer nudges us when it transmits what unblocks them (see
    /// `MirrorWords`).
    pub(crate) fn leaving_call(&mut self, entered: bool) {
        if entered {
            if let Some(mirror) = self.mirror.as_ref() {
                mirror.words().leave_call();
            }
        }
        if !self.has_untransmitted() || !self.is_intra_host() {
            return;
        }
        self.set_progress_wanted(true);
        // What the peer published before it could see the word (credits, its `Hello`, receive
        // slots it rang us for) nudges nobody: drive it now (which clears the word if
        // everything leaves).
        if self
            .conn
            .as_ref()
            .is_some_and(|conn| conn.has_input() || conn.rung())
        {
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
                nudge(pid, crate::san::provider::segment_dir());
            }
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
        if let Some(conn) = self.conn.as_mut() {
            conn.collect_events();
        }
        self.service();
    }
}

/// Hands the registrations the session released back to the cache they came from.
fn release(registrations: Option<&'static SharedRegistrations>, released: &mut Vec<MrHandleId>) {
    if !released.is_empty() {
        if let Some(mut registrations) = registrations.map(SharedRegistrations::lock) {
            registrations.release(released);
        }
        released.clear();
    }
}
