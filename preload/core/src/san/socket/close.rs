//! The end of a SAN socket: `shutdown(2)` on the session and the mirrors, and `close(2)`,
//! graceful (queued data, then FIN, bounded by the linger time) or abortive.

use core::ffi::c_int;
use std::time::Duration;

use switch::session::{SessionState, Shutdown};

use super::{SanSocket, Side};
use crate::san::link::Link;

impl SanSocket {
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
        // (and its own session then reports RDHUP locally). Shutting down its raising end here
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
        if abortive {
            self.journal_aborted();
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
        // Over shm what has not left is in the journal, which the peer reads once it sees
        // the close: return at once, as a TCP close does (the kernel sends the rest).
        let waits = abortive || !self.journal_holds_the_rest();
        while waits && !self.quiescent() && start.elapsed() < linger {
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
