//! Bytes `send()` accepted outlive the sender, as over kernel TCP: over shm the stream bytes
//! that have not reached the peer's receive slots are kept in the segment's outbound journal,
//! and a peer that finds us closed or dead reads them from there, then end of stream.
//!
//! The sender keeps the journal exact: after every send it writes there the accepted bytes
//! still queued here (in the session or the provider) and publishes where its stream ends;
//! the receiver, once the provider reports that the peer closed or died (every message the
//! peer left in our slots drained), takes the rest of the stream from the peer's journal,
//! from the first byte its session did not receive. A peer that ended with some of our
//! bytes unread is a reset, as TCP answers such a close with `RST`.
//!
//! Over verbs the bytes live in the dead process's memory on another host: a sender that
//! dies with bytes queued resets the connection (the known limit in `docs/ARCHITECTURE.md`).

use super::SanSocket;
use crate::record::Counter;
use crate::san::link::Link;
use san_api::{AppSource, SourcePart};

impl SanSocket {
    /// After the drive that followed an inline send from `source`: journals what that send
    /// put in the session (its first bytes) and has not left.
    pub(crate) fn journal_sent<S: AppSource + ?Sized>(&mut self, source: &S) {
        let n = core::mem::take(&mut self.just_accepted).min(source.len());
        if n > 0 {
            self.journal_accepted(&SourcePart::new(source, 0, n));
            if self.downgrade_wanted {
                self.service();
            }
        }
    }

    /// `accepted` just entered the session, and the drive that followed transmitted what it
    /// could: writes the part still queued here into the journal and publishes the stream's
    /// new end.
    pub(super) fn journal_accepted<S: AppSource + ?Sized>(&mut self, accepted: &S) {
        let (Some(session), Some(Link::Shm(conn))) = (self.session.as_ref(), self.conn.as_mut())
        else {
            return;
        };
        self.stream_accepted += accepted.len() as u64;
        if self.journal_lost {
            return;
        }
        let queued = session.send_queue_len() + conn.queued_send_bytes();
        let keep = queued.min(accepted.len());
        if keep > 0 {
            let from = self.stream_accepted - keep as u64;
            let unsent = SourcePart::new(accepted, accepted.len() - keep, keep);
            if conn.journal_write(from, &unsent).is_err() {
                // The file system is full (or the application's buffer changed under the
                // call): the journal's end stays where it was (what it covers is still
                // whole) and the connection moves to kernel TCP, which keeps everything
                // sent from now on.
                // (A drive may be under way: it lets our `Downgrade` out itself.)
                tracing::debug!(name = %self.name, "journal unavailable: downgrading to TCP");
                self.journal_lost = true;
                self.want_downgrade();
                return;
            }
        }
        conn.journal_publish(self.stream_accepted);
    }

    /// The last `n` bytes of `early` were just accepted before the handshake finished: they
    /// are stream bytes like any other and go into the journal now, so that they outlive us
    /// even if we end before the session takes them (a forked server's child that answers
    /// and `_exit`s at once). While `early` holds bytes every send lands there, so they are
    /// the stream's last bytes.
    ///
    /// Where the journal cannot take them (a full file system) they wait, as every later early
    /// byte does, and are journaled as they enter the session ([`Self::journal_flushed_early`]),
    /// where a failure moves the connection to TCP: a downgrade needs the established session,
    /// and bytes sent on TCP before it would never be read.
    pub(super) fn journal_early(&mut self, n: usize) {
        let Some(Link::Shm(conn)) = self.conn.as_mut() else {
            return;
        };
        if n == 0 || self.journal_lost {
            self.stream_accepted += n as u64;
            return;
        }
        let bytes = &self.early[self.early.len() - n..];
        if self.early_unjournaled > 0 || conn.journal_write(self.stream_accepted, bytes).is_err() {
            self.early_unjournaled += n;
            return;
        }
        self.stream_accepted += n as u64;
        conn.journal_publish(self.stream_accepted);
    }

    /// `moved` bytes of `early` just entered the session, of which the last `unjournaled`
    /// were not journaled when accepted: journals them as any accepted bytes.
    pub(super) fn journal_flushed_early(&mut self, unjournaled: &[u8]) {
        if !unjournaled.is_empty() {
            self.journal_accepted(unjournaled);
        }
    }

    /// `n` early bytes went on TCP (a downgrade came first): they leave the stream the
    /// journal covers, whose end moves back.
    pub(super) fn journal_early_left_for_tcp(&mut self, n: usize) {
        let Some(Link::Shm(conn)) = self.conn.as_ref() else {
            return;
        };
        // The unjournaled ones are the last: they never counted.
        let unjournaled = core::mem::take(&mut self.early_unjournaled).min(n);
        let counted = n - unjournaled;
        self.stream_accepted = self.stream_accepted.saturating_sub(counted as u64);
        if !self.journal_lost {
            conn.journal_publish(self.stream_accepted);
        }
    }

    /// A rendezvous send delivered `bytes`: the peer received them before the send returned,
    /// so only the stream's end moves.
    pub(super) fn journal_delivered(&mut self, bytes: u64) {
        let Some(Link::Shm(conn)) = self.conn.as_ref() else {
            return;
        };
        self.stream_accepted += bytes;
        if !self.journal_lost {
            conn.journal_publish(self.stream_accepted);
        }
    }

    /// The application read `bytes` of the peer's stream.
    pub(super) fn note_consumed(&mut self, bytes: usize) {
        self.stream_consumed += bytes as u64;
        if let Some(Link::Shm(conn)) = self.conn.as_ref() {
            conn.publish_consumed(self.stream_consumed);
        }
    }

    /// Whether everything we accepted and have not transmitted is in the journal, so that a
    /// close need not wait for it to leave: the peer reads the rest from the journal.
    pub(super) fn journal_holds_the_rest(&self) -> bool {
        matches!(self.conn, Some(Link::Shm(_)))
            && !self.journal_lost
            && self.early.is_empty()
            && !self.downgrade_wanted
    }

    /// We close abortively: a peer that finds us closed resets, whatever it read.
    pub(super) fn journal_aborted(&self) {
        if let Some(Link::Shm(conn)) = self.conn.as_ref() {
            conn.publish_aborted();
        }
    }

    /// After the session reset because the provider found the peer closed or dead without
    /// its FIN: unless it left our bytes unread, what it had sent and we had not received
    /// comes from its journal, after everything the session still holds, and then end of
    /// stream.
    pub(super) fn take_leftovers_of_ended_peer(&mut self) {
        if self.peer_fin || self.leftovers_taken {
            return;
        }
        let (Some(session), Some(Link::Shm(conn))) = (self.session.as_mut(), self.conn.as_ref())
        else {
            return;
        };
        let Some(end) = conn.peer_end() else {
            return;
        };
        self.leftovers_taken = true;
        let leftovers = match conn.peer_leftovers(session.stats().bytes_received) {
            Ok(leftovers) => leftovers,
            Err(error) => {
                tracing::debug!(name = %self.name, ?error, "ended peer left a corrupt journal");
                return;
            }
        };
        if leftovers.aborted || leftovers.consumed < self.stream_accepted {
            tracing::debug!(
                name = %self.name,
                ?end,
                aborted = leftovers.aborted,
                unread = self.stream_accepted.saturating_sub(leftovers.consumed),
                "peer ended abortively or with our bytes unread: reset"
            );
            return;
        }
        tracing::debug!(
            name = %self.name,
            ?end,
            bytes = leftovers.bytes.len(),
            "peer ended: the rest of its stream from its journal, then end of stream"
        );
        // What the session still holds comes first; after a reset it holds inline bytes only.
        let before = self.restored.len();
        let mut buf = [0u8; 16 << 10];
        loop {
            match session.recv_from_slots(&mut buf[..], switch::session::RecvFlags::default(), conn)
            {
                Ok(n) if n > 0 => self.restored.extend_from_slice(&buf[..n]),
                _ => break,
            }
        }
        self.restored.extend_from_slice(&leftovers.bytes);
        let moved = self.restored.len() - before;
        self.record.count(Counter::SanInlineReceived, moved as u64);
        self.peer_fin = true;
    }
}
