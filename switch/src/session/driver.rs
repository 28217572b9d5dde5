//! The generic pump between a [`Session`] and a [`SanConnection`]: shared by the
//! simulation, the benches and the preload so none of them re-implements the poll order.
//! Still sans-IO: it only calls trait methods.

use super::{MrHandleId, Op, Session};
use crate::error::Error;
use alloc::vec::Vec;
use san_api::{Completion, CompletionKind, SanConnection};

/// What one [`drive`] call did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Progress {
    /// Completions handled.
    pub completions: usize,
    /// Ops posted to the provider (receive re-posts, reads, writes).
    pub ops_posted: usize,
    /// Control messages posted.
    pub messages_sent: usize,
    /// Registration handles released (pushed to the caller's list).
    pub releases: usize,
}

impl Progress {
    /// True when the call did nothing at all.
    pub fn is_idle(&self) -> bool {
        *self == Progress::default()
    }

    fn any(&self) -> bool {
        !self.is_idle()
    }
}

/// How many completions one poll asks for.
const COMPLETION_BATCH: usize = 32;

/// Pumps `session` over `conn` until neither has anything more to do right now (see
/// [`Pump::drive`]). Allocates its scratch buffers per call; hot loops keep a [`Pump`].
pub fn drive<C: SanConnection + ?Sized>(
    session: &mut Session,
    conn: &mut C,
    released: &mut Vec<MrHandleId>,
) -> Result<Progress, Error> {
    Pump::new().drive(session, conn, released)
}

/// The pump with its scratch buffers (completion batch, message buffer), reused across
/// calls so the steady state allocates nothing.
#[derive(Debug, Default)]
pub struct Pump {
    completions: Vec<Completion>,
    message: Vec<u8>,
}

impl Pump {
    /// A pump with empty scratch buffers (sized on first use).
    pub fn new() -> Pump {
        Pump::default()
    }

    /// Polls completions into the session, then posts its ops and transmits, in the
    /// documented poll order, until a round does nothing. Handles the session releases are
    /// appended to `released` for the caller's registration cache. Application events stay
    /// queued in the session (`poll_event`).
    ///
    /// Every completion polled is handed to the session even after an error, so no work
    /// request is lost; the first error is returned at the end (the session is then in a
    /// terminal state and the caller keeps driving it until [`Session::is_quiescent`]).
    pub fn drive<C: SanConnection + ?Sized>(
        &mut self,
        session: &mut Session,
        conn: &mut C,
        released: &mut Vec<MrHandleId>,
    ) -> Result<Progress, Error> {
        let mut total = Progress::default();
        let mut first_error = None;
        let slot_size = conn.slot_config().slot_size as usize;
        if self.message.len() < slot_size {
            self.message.resize(slot_size, 0);
        }
        loop {
            let mut round = Progress::default();

            self.completions.clear();
            conn.poll_completions(&mut self.completions, COMPLETION_BATCH);
            for completion in &self.completions {
                round.completions += 1;
                if let Err(e) = deliver(session, conn, completion) {
                    first_error.get_or_insert(e);
                }
            }

            while let Some(op) = session.poll_op() {
                let posted = match op {
                    Op::PostRecv { wr_id, slot } => {
                        conn.post_recv(wr_id, slot).map_err(|e| (wr_id, e))
                    }
                    Op::Read {
                        wr_id,
                        local,
                        remote,
                    } => conn.post_read(wr_id, local, remote).map_err(|e| (wr_id, e)),
                    Op::Write {
                        wr_id,
                        local,
                        remote,
                    } => conn
                        .post_write(wr_id, local, remote)
                        .map_err(|e| (wr_id, e)),
                    Op::Release(handle) => {
                        released.push(handle);
                        round.releases += 1;
                        continue;
                    }
                };
                round.ops_posted += 1;
                if let Err((wr_id, e)) = posted {
                    first_error.get_or_insert(session.handle_post_error(wr_id, e));
                }
            }

            let message = &mut self.message[..slot_size];
            if conn.sends_in_parts() {
                // Data goes from the send buffer straight into the provider's slot.
                while let Some(transmit) = session.poll_transmit_parts(message) {
                    round.messages_sent += 1;
                    let posted = conn.post_send_parts(
                        transmit.wr_id,
                        &message[..transmit.len],
                        session.transmitted_payload(),
                    );
                    session.release_transmitted();
                    if let Err(e) = posted {
                        first_error.get_or_insert(session.handle_post_error(transmit.wr_id, e));
                    }
                }
            } else {
                while let Some(transmit) = session.poll_transmit(message) {
                    round.messages_sent += 1;
                    if let Err(e) = conn.post_send(transmit.wr_id, &message[..transmit.len]) {
                        first_error.get_or_insert(session.handle_post_error(transmit.wr_id, e));
                    }
                }
            }

            if !round.any() {
                break;
            }
            total.completions += round.completions;
            total.ops_posted += round.ops_posted;
            total.messages_sent += round.messages_sent;
            total.releases += round.releases;
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }
}

fn deliver<C: SanConnection + ?Sized>(
    session: &mut Session,
    conn: &C,
    completion: &Completion,
) -> Result<(), Error> {
    match (completion.kind, completion.status) {
        (CompletionKind::Recv { slot, len }, Ok(())) => {
            session.handle_message(slot, conn.recv_slot(slot, len))
        }
        _ => session.handle_completion(completion),
    }
}
