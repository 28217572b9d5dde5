//! Taking bytes out of the session ahead of the application: a downgrade to kernel TCP
//! (fork, exec, or the peer's), which drains the session and then reads TCP again, and the
//! absorption of a stalled peer's data while the application is blocked sending (a kernel
//! receive buffer's part).

use core::ffi::c_int;
use std::time::Instant;

use switch::error::RecvError;
use switch::session::{RecvFlags, SessionState};

use super::wait::WaitFds;
use super::{Phase, SanSocket};
use crate::record::Counter;
use crate::san::link::Link;
use crate::san::tunables::{ABSORB_LIMIT, STALL_BEFORE_ABSORB, STALL_BEFORE_REJECT, STALL_POLL};

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

impl SanSocket {
    /// Begins moving the connection back to kernel TCP (before fork or exec): our sends go
    /// to TCP from now on, after what the session still has queued and its `Downgrade`; the
    /// peer answers with its own `Downgrade` and sends on TCP after it. False when this
    /// connection cannot downgrade (not switched, or a peer without the capability).
    pub(crate) fn begin_downgrade(&mut self) -> bool {
        if !self.want_downgrade() {
            return false;
        }
        self.service();
        true
    }

    /// [`SanSocket::begin_downgrade`] without the drive that lets our `Downgrade` out (for a
    /// caller inside a drive, which lets it out itself).
    pub(super) fn want_downgrade(&mut self) -> bool {
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
            let received = match self.conn.as_ref() {
                Some(conn) => session.recv_from_slots(&mut buf[..room], RecvFlags::default(), conn),
                None => session.recv(&mut buf[..room], RecvFlags::default()),
            };
            match received {
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
}
