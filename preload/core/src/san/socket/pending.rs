//! A pending client: its switch-over (the acceptor switches inside `accept()`, see the
//! set-up), and the switch marker the acceptor writes on TCP to make it happen, which the
//! client consumes before it reads TCP again.

use core::ffi::c_int;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::time::Duration;

use switch::session::{Role, Session};

use super::{
    session_config, SanSocket, Side, ACCEPTOR_WORDS, CLIENT_WORDS, PRIVATE_MARKER_LEN,
    SWITCH_MARKER,
};
use crate::mirror::Mirror;
use crate::real;
use crate::record::{flags, DataPath, SocketState};
use crate::san::exchange::{self, SideWords, WordsPage, MIRROR_END};
use crate::san::kernel::send_all_on_tcp;
use crate::san::link::Link;
use crate::san::tunables::SLOTS;
use crate::san::verbs::link::VerbsLink;

impl SanSocket {
    /// Client, pending, peer attached: starts the session with the TCP byte count (shm: after
    /// taking the acceptor's mirror end and words from the exchange and answering with ours;
    /// verbs: on the CM connection the acceptor established). `Err` means the exchange or
    /// the attach was not usable: the connection cannot continue (the acceptor talks SAN
    /// only).
    pub(crate) fn switch(&mut self, tcp: c_int) -> Result<(), ()> {
        if self.is_verbs() {
            self.switch_verbs(tcp)?;
        } else {
            self.switch_shm()?;
        }
        self.finish_switch(tcp);
        Ok(())
    }

    /// The shm part of [`SanSocket::switch`].
    fn switch_shm(&mut self) -> Result<(), ()> {
        // A client of another user's server: the offer thread took the acceptor's
        // connection (and gave it our segment).
        let private_link = self.take_private_link();
        let listener = match private_link {
            Some(_) => None,
            None => Some(self.exchange.take().ok_or(())?),
        };
        // No longer pending: acceptors of our port need not probe for us (nor find our
        // exchange listener's file).
        self.pending_mark = None;
        self.exchange_file = None;
        let reserve = self.reserve.take().ok_or(())?;
        // The numbers held for what arrives now become free for it.
        drop(reserve.spare);
        let offer = match (private_link, listener) {
            (Some(link), _) => exchange::take_offer(link.ok_or(())?),
            (None, Some(listener)) => exchange::accept_offer(listener.as_fd()),
            (None, None) => None,
        };
        let exchange::Offer {
            link,
            their_end,
            page,
            their_pidfd,
        } = offer.ok_or(())?;
        // The acceptor as the kernel names it to us, not by the pid it recorded (see
        // `exchange`, "Who the peer is"). One we cannot name (another pid namespace on a
        // kernel without pidfds) could die unnoticed: the connection cannot go on.
        let acceptor = exchange::peer_process(link.as_fd(), their_pidfd);
        if !self.conn.as_mut().ok_or(())?.identify_peer(acceptor) {
            return Err(());
        }
        let words = WordsPage::map(page.as_fd()).map(Arc::new).ok_or(())?;
        drop(page); // The mapping keeps the page.
        let page = words;
        let (our_mirror, our_end) =
            Mirror::with_ends(SideWords::new(page.clone(), CLIENT_WORDS), reserve.ends)
                .map_err(|_| ())?;
        // If the acceptor is already gone the send fails; the session reports the reset.
        let _ = exchange::send(link.as_fd(), our_end.as_fd(), MIRROR_END);
        drop(our_end);
        let _ = self
            .peer
            .end
            .set((their_end, SideWords::new(page.clone(), ACCEPTOR_WORDS)));
        let conn = self.conn.as_ref().ok_or(())?;
        let session = Session::new(
            Role::Active,
            session_config(conn.offers_rendezvous()),
            conn.capabilities(),
            SLOTS,
            self.tcp_sent,
        );
        self.start_session(session, our_mirror, page);
        Ok(())
    }

    /// The verbs part of [`SanSocket::switch`]: takes the connection whose token is first on
    /// TCP, consuming the token. `Err`: setting that connection up failed after our reply.
    fn switch_verbs(&mut self, tcp: c_int) -> Result<(), ()> {
        self.conn
            .as_mut()
            .and_then(Link::verbs_mut)
            .ok_or(())?
            .take_confirmed(tcp)?;
        self.start_verbs_session(Role::Active).map_err(|_| ())
    }

    /// The end of every client switch, whatever the provider: a shutdown the application
    /// made while pending (a TCP FIN the acceptor may never read) becomes the session's FIN
    /// after the counted bytes; our `Hello` goes out; the marker is read if it is there.
    fn finish_switch(&mut self, tcp: c_int) {
        let shut = self.record.flags() & (flags::SHUT_WR | flags::SHUT_RD);
        if shut & flags::SHUT_WR != 0 {
            self.shutdown(libc::SHUT_WR);
        }
        if shut & flags::SHUT_RD != 0 {
            self.shutdown(libc::SHUT_RD);
        }
        self.service();
        self.consume_marker(tcp);
        self.mark_switched();
    }

    pub(super) fn mark_switched(&self) {
        // The application may have closed its last fd already (its release is on the way).
        if self.record.set_state_if_live(SocketState::San) {
            let path = self.conn.as_ref().map_or(DataPath::SanShm, Link::data_path);
            self.record
                .path
                .store(path as u32, core::sync::atomic::Ordering::Release);
            // The switch follows the TCP handshake: a non-blocking connect has completed even
            // when the program learned it by polling alone (redis-cli never asks SO_ERROR), and
            // no kernel byte may ever move to say so.
            self.record.set_flag(flags::CONNECTING, false);
        }
    }

    /// Wakes the threads that wait on this socket as a pending client (see `pending_bell`).
    pub(super) fn ring_pending_bell(&self) {
        if let Some(bell) = self.pending_bell.as_ref() {
            let one = 1u64;
            // SAFETY: an 8-byte write to our eventfd.
            unsafe { libc::write(bell.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    /// Acceptor: writes the switch marker on TCP (once): a client waiting on its TCP socket
    /// wakes, switches and completes the handshake.
    pub(crate) fn wake_pending_client(&mut self, tcp: c_int) {
        if !self.marker_owed {
            return;
        }
        self.marker_owed = false;
        // Over verbs the client's token is the marker: the client switches when it finds it
        // first on TCP, and consumes it whole.
        if let Some(token) = self
            .conn
            .as_ref()
            .and_then(Link::verbs)
            .and_then(VerbsLink::switch_token)
        {
            // Written first, on a fresh connection: it fits the socket buffer at once.
            if send_all_on_tcp(tcp, &token) != token.len() {
                // A client that finds part of it cannot tell it from data: end the connection
                // (it is going already when the write fails).
                tracing::debug!(tcp, "switch token not sent");
                // SAFETY: plain shutdown(2) of the application's socket.
                unsafe { real::shutdown(tcp, libc::SHUT_RDWR) };
            }
            return;
        }
        // Between two users: the marker and the token, whole, or the connection ends (as
        // the verbs token above).
        if let Some(marker) = self.private_marker() {
            if send_all_on_tcp(tcp, &marker) != marker.len() {
                tracing::debug!(tcp, "switch marker not sent");
                // SAFETY: plain shutdown(2) of the application's socket.
                unsafe { real::shutdown(tcp, libc::SHUT_RDWR) };
            }
            return;
        }
        // Written even when the client already switched: the client consumes exactly one
        // marker byte before it ever reads TCP again (a downgrade), so it must always be there.
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
        // (A connection between two users switched only once its whole marker was there.)
        let len = self.private_marker().map_or(1, |marker| marker.len());
        let mut marker = [0u8; PRIVATE_MARKER_LEN];
        // SAFETY: `len` writable bytes.
        let n = unsafe { real::recv(tcp, marker.as_mut_ptr().cast(), len, libc::MSG_DONTWAIT) };
        if n == len as isize || n == 0 {
            self.marker_unread = false;
        }
    }

    /// Client, pending: a byte arrived on TCP while the segment was attached, so it is the
    /// marker and it was consumed by the caller.
    pub(crate) fn marker_consumed(&mut self) {
        self.marker_unread = false;
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
}
