//! Bytes the application sends before the handshake finished: buffered locally as a kernel
//! socket buffer would hold them, moved into the session first once it is established, or
//! written on TCP first when the connection downgrades meanwhile.

use super::SanSocket;
use crate::record::Counter;
use crate::san::kernel::send_all_on_tcp;
use crate::san::outcome::SanError;
use crate::san::tunables::EARLY_LIMIT;
use san_api::AppSource;
use switch::error::SendError;
use switch::session::{SendFlags, SessionState};

impl SanSocket {
    /// Moves early bytes into an established session: true when some did. The journal has
    /// them since they were accepted, except the unjournaled tail (see `journal_early`), which
    /// is journaled now.
    pub(super) fn flush_early(&mut self) -> bool {
        let Some(session) = self.session.as_mut() else {
            return false;
        };
        if session.state() != SessionState::Established {
            return false;
        }
        match session.send(&self.early, SendFlags::default()) {
            Ok(n) if n > 0 => {
                let journaled = self.early.len() - self.early_unjournaled;
                let unjournaled = n.saturating_sub(journaled);
                let moved: Vec<u8> = self.early.drain(..n).skip(n - unjournaled).collect();
                self.early_unjournaled -= unjournaled;
                self.journal_flushed_early(&moved);
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
    pub(super) fn early_to_tcp(&mut self) {
        if self.early.is_empty() {
            return;
        }
        let fd = self.record.fd.load(core::sync::atomic::Ordering::Acquire);
        let sent = send_all_on_tcp(fd, &self.early);
        self.early.drain(..sent);
        self.journal_early_left_for_tcp(sent);
    }

    /// Before the peer's `Hello` (or behind bytes still waiting for it), a send is buffered
    /// here as the kernel would buffer it, up to a socket buffer's worth; order is kept
    /// because the session takes these first. `None`: the session takes `data` itself.
    /// `data` is the application's memory: a buffer it may not read is `EFAULT`, nothing
    /// taken.
    pub(super) fn send_early<S: AppSource + ?Sized>(
        &mut self,
        data: &S,
        handshaking: bool,
    ) -> Option<Result<usize, SanError>> {
        if !handshaking && self.early.is_empty() {
            return None;
        }
        let room = EARLY_LIMIT.saturating_sub(self.early.len());
        if data.is_empty() {
            return Some(Ok(0));
        }
        if room == 0 {
            return Some(Err(SanError::Errno(libc::EAGAIN)));
        }
        let n = data.len().min(room);
        let before = self.early.len();
        self.early.resize(before + n, 0);
        if data.copy_to(0, &mut self.early[before..]).is_err() {
            self.early.truncate(before);
            return Some(Err(SanError::Errno(libc::EFAULT)));
        }
        self.record.count(Counter::SanInlineSent, n as u64);
        self.journal_early(n);
        Some(Ok(n))
    }
}
