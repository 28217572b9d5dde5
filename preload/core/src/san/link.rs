//! The connection under a SAN socket's session: the intra-host shared-memory connection or
//! a cross-host verbs connection (`docs/ARCHITECTURE.md`, "Cross-host discovery (verbs)").
//!
//! Both implement [`SanConnection`] (what the session's `drive` needs); the few operations
//! the socket code makes beyond it (waiting, liveness, the attach check) are answered here
//! per provider.

use std::os::fd::RawFd;
use std::time::Duration;

use san_api::{
    AppSource, BadAddress, Capabilities, Completion, LocalSegment, PostError, RecvSlot,
    RemoteDescriptor, SanConnection, SlotConfig, StagedSend, WrId,
};
use san_shm::{NamespacedPid, ShmConnection, WaitResult};

use super::provider::{provider, rendezvous_enabled};
use super::registrations::SharedRegistrations;
use super::verbs::link::VerbsLink;
use super::verbs::Arrival;
use crate::record::DataPath;

/// This process, as [`Link::peer_own_pid`] names a peer.
pub(crate) fn own_pid() -> NamespacedPid {
    NamespacedPid {
        namespace: san_shm::pid_namespace(),
        // (Asked for by every nonblocking read that finds nothing: no system call.)
        pid: crate::process::id(),
        contact: san_shm::contact(),
    }
}

/// A verbs completion channel that is not armed: drive the session again rather than block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NotArmed;

/// A SAN socket's connection.
// The socket holding it is boxed already; boxing the shm connection would add a pointer
// chase to every shm operation for no saving.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Link {
    /// Intra-host shared memory.
    Shm(ShmConnection),
    /// Cross-host RDMA verbs (the loaded provider).
    Verbs(VerbsLink),
    /// Unit tests: a seeded `san-sim` connection, so the socket code runs in-process.
    #[cfg(test)]
    Sim(super::in_process_tests::SimLink),
}

impl From<ShmConnection> for Link {
    fn from(conn: ShmConnection) -> Link {
        Link::Shm(conn)
    }
}

impl Link {
    /// The provider's capabilities (for the session's rendezvous mode).
    pub(crate) fn capabilities(&self) -> Capabilities {
        match self {
            Link::Shm(conn) => conn.capabilities(),
            Link::Verbs(link) => link.capabilities(),
            #[cfg(test)]
            Link::Sim(link) => link.capabilities(),
        }
    }

    /// False once the connection is known to be down.
    pub(crate) fn is_up(&self) -> bool {
        match self {
            Link::Shm(conn) => conn.is_up(),
            Link::Verbs(link) => link.is_up(),
            #[cfg(test)]
            Link::Sim(link) => link.is_up(),
        }
    }

    /// Shm: announce "asleep" (false: news arrived). Verbs: the service thread watches the
    /// completion channel for us, so a thread may always block on the mirror.
    pub(crate) fn prepare_to_block(&self) -> bool {
        match self {
            Link::Shm(conn) => conn.prepare_to_block(),
            Link::Verbs(_) => true,
            #[cfg(test)]
            Link::Sim(link) => link.prepare_to_block(),
        }
    }

    /// Shm: a message or completion waits for our next drive. Verbs: false (completions are
    /// watched by the service thread, which raises the mirror).
    pub(crate) fn has_input(&self) -> bool {
        match self {
            Link::Shm(conn) => conn.has_input(),
            Link::Verbs(_) => false,
            #[cfg(test)]
            Link::Sim(link) => link.has_input(),
        }
    }

    /// Shm: whether more of our receive slots were published since the last call (see
    /// `ShmConnection::take_slots_grown`). Verbs: false (every receive is posted at once).
    pub(crate) fn take_slots_grown(&mut self) -> bool {
        match self {
            Link::Shm(conn) => conn.take_slots_grown(),
            Link::Verbs(_) => false,
            #[cfg(test)]
            Link::Sim(_) => false,
        }
    }

    /// Shm: the peer rang since our last look (news, or room for sends we queued). Verbs:
    /// false (completions are the service thread's to see).
    pub(crate) fn rung(&self) -> bool {
        match self {
            Link::Shm(conn) => conn.rung(),
            Link::Verbs(_) => false,
            #[cfg(test)]
            Link::Sim(_) => false,
        }
    }

    /// Whether a message posted by the peer is in our memory before its post returned (shm:
    /// the copy into our ring is the post), so that nothing the peer does next on TCP (its
    /// FIN) can arrive first. Verbs: no (the device moves it later, on a path of its own).
    pub(crate) fn delivers_before_tcp(&self) -> bool {
        match self {
            Link::Shm(_) => true,
            Link::Verbs(_) => false,
            #[cfg(test)]
            Link::Sim(_) => false,
        }
    }

    /// Shm: messages posted that the provider has not moved yet (they move at its next
    /// poll). Verbs: false (the device moves what was posted).
    pub(crate) fn has_queued_sends(&self) -> bool {
        match self {
            Link::Shm(conn) => conn.has_queued_sends(),
            Link::Verbs(_) => false,
            #[cfg(test)]
            Link::Sim(link) => link.has_queued_sends(),
        }
    }

    /// Shm: check the peer's liveness at the next drive (the kernel reported hang-up on a
    /// descriptor the peer held). Verbs: the CM disconnect or a QP error reports a dead peer.
    pub(crate) fn check_liveness_soon(&mut self) {
        if let Link::Shm(conn) = self {
            conn.check_liveness_soon();
        }
    }

    /// The end of a wait prepared with [`Link::prepare_to_block`].
    pub(crate) fn finish_blocking(&self) {
        if let Link::Shm(conn) = self {
            conn.finish_blocking();
        }
    }

    /// Waits up to `timeout` for news. Verbs: completions are collected by the caller's next
    /// drive (they need no wake-up of ours), so this only paces the caller's loop.
    pub(crate) fn wait(&self, timeout: Duration) -> WaitResult {
        match self {
            Link::Shm(conn) => conn.wait(timeout),
            Link::Verbs(link) => {
                if !link.is_up() {
                    return WaitResult::Disconnected;
                }
                if !timeout.is_zero() {
                    std::thread::sleep(timeout.min(Duration::from_millis(10)));
                }
                WaitResult::TimedOut
            }
            #[cfg(test)]
            Link::Sim(link) => link.wait(timeout),
        }
    }

    /// Closes the connection (the peer sees it go).
    pub(crate) fn close(&mut self) {
        match self {
            Link::Shm(conn) => conn.close(),
            Link::Verbs(link) => link.close(),
            #[cfg(test)]
            Link::Sim(link) => link.close(),
        }
    }

    /// Client, pending, TCP socket `tcp`: the acceptor attached (shm: the segment; verbs: the
    /// token of a CM connection we accepted is first on TCP, whose connection the switch
    /// takes, or turns into a reset when setting it up failed after our reply).
    pub(crate) fn peer_attached(&self, tcp: RawFd) -> bool {
        match self {
            Link::Shm(conn) => conn.segment().is_attached(),
            Link::Verbs(link) => link.arrival(tcp, false) == Arrival::Token,
            #[cfg(test)]
            Link::Sim(link) => link.peer_attached(),
        }
    }

    /// Client, pending (shm): withdraws the segment so that no acceptor can attach any more.
    /// False when the acceptor got there first, and over verbs (no withdrawal: its acceptor
    /// commits inside `accept()`).
    pub(crate) fn withdraw(&self) -> bool {
        match self {
            Link::Shm(conn) => conn.segment().withdraw(),
            Link::Verbs(_) => false,
            #[cfg(test)]
            Link::Sim(_) => false,
        }
    }

    /// As [`Link::peer_attached`] when the caller found bytes on TCP and must know whether
    /// they are the switch marker (verbs: the start of a token is waited for, bounded).
    pub(crate) fn peer_attached_settled(&self, tcp: RawFd) -> bool {
        match self {
            Link::Shm(conn) => conn.segment().is_attached(),
            Link::Verbs(link) => link.arrival(tcp, true) == Arrival::Token,
            #[cfg(test)]
            Link::Sim(link) => link.peer_attached(),
        }
    }

    /// The peer's pid as its own pid namespace numbers it, with that namespace, when it is on
    /// this host (shm only): what names its nudge address and tells an in-process peer. Not a
    /// pid of ours unless the namespace is (liveness and CMA are the provider's business).
    pub(crate) fn peer_own_pid(&self) -> Option<NamespacedPid> {
        match self {
            Link::Shm(conn) => conn.segment().peer_own_pid(),
            Link::Verbs(_) => None,
            // Both ends are in this process: the in-process assist drives the other one.
            #[cfg(test)]
            Link::Sim(_) => Some(own_pid()),
        }
    }

    /// Client, at its switch: the acceptor as the exchange named it (shm only; see
    /// `ShmConnection::identify_peer`). False when its death could not be noticed.
    pub(crate) fn identify_peer(&mut self, peer: san_shm::PeerProcess) -> bool {
        match self {
            Link::Shm(conn) => {
                conn.identify_peer(peer);
                conn.peer_identified()
            }
            Link::Verbs(_) => true,
            #[cfg(test)]
            Link::Sim(_) => true,
        }
    }

    /// True for a connection to a process on this host (the `shm` provider): its peer
    /// raises our mirror and can be nudged.
    pub(crate) fn is_intra_host(&self) -> bool {
        // (The unit tests' simulated link counts as one: both its ends are in this process.)
        !matches!(self, Link::Verbs(_))
    }

    /// The data path a switched socket on this connection takes.
    pub(crate) fn data_path(&self) -> DataPath {
        match self {
            Link::Shm(_) => DataPath::SanShm,
            Link::Verbs(_) => DataPath::SanVerbs,
            #[cfg(test)]
            Link::Sim(_) => DataPath::SanShm,
        }
    }

    /// The registrations (domain and cache) the socket's memory is registered with: the
    /// verbs domain's, or the process-wide shm one.
    pub(crate) fn registrations(&self) -> Option<&'static SharedRegistrations> {
        match self {
            Link::Verbs(link) => Some(link.registrations()),
            Link::Shm(_) => provider().map(|p| &p.registrations),
            #[cfg(test)]
            Link::Sim(link) => link.registrations(),
        }
    }

    /// Whether this side offers rendezvous to its peer: the process's setting (the unit
    /// tests' simulated link says per connection, without touching process-wide settings).
    pub(crate) fn offers_rendezvous(&self) -> bool {
        match self {
            Link::Shm(_) | Link::Verbs(_) => rendezvous_enabled(),
            #[cfg(test)]
            Link::Sim(link) => link.offers_rendezvous(),
        }
    }

    /// Verbs, pending client: we declined the acceptor's connect for want of resources
    /// (see `VerbsLink::declined`). Shm: false.
    pub(crate) fn declined(&self) -> bool {
        matches!(self, Link::Verbs(link) if link.declined())
    }

    /// Verbs: arms the completion channel (`solicited_only`: for the peer's messages alone);
    /// false when completions are pending (drive first). Shm: nothing to arm.
    pub(crate) fn arm(&mut self, solicited_only: bool) -> bool {
        match self {
            Link::Verbs(link) => link.arm(solicited_only),
            Link::Shm(_) => true,
            #[cfg(test)]
            Link::Sim(_) => true,
        }
    }

    /// Verbs: collects the channel and connection events after a wake-up on the
    /// connection's fd (the next drive handles the completions). Shm: nothing to collect.
    pub(crate) fn collect_events(&mut self) {
        if let Link::Verbs(link) = self {
            link.collect_events();
        }
    }

    /// Verbs: raises our own mirror (the peer is remote and cannot). Shm: the peer does.
    pub(crate) fn raise_own_mirror(&self, readable: bool, writable: bool) {
        if let Link::Verbs(link) = self {
            link.raise(readable, writable);
        }
    }

    /// The application made a call on the socket that moved data: `sent` bytes out,
    /// `received` bytes in (verbs: whether a later read waits for an answer, see
    /// `VerbsLink::answer_expected`). Shm: nothing to note.
    pub(crate) fn note_call(&mut self, sent: bool, received: bool) {
        if let Link::Verbs(link) = self {
            link.note_call();
            if received {
                link.answer_expected = false;
            }
            if sent {
                link.answer_expected = true;
            }
        }
    }

    /// Verbs: whether a blocked reader polls the completion queue before it sleeps (an
    /// answer is expected and the connection's `SpinPolicy` says polling pays). Shm: never.
    pub(crate) fn polls_before_sleeping(&mut self) -> bool {
        match self {
            Link::Verbs(link) => link.answer_expected && link.spin.should_poll(),
            Link::Shm(_) => false,
            #[cfg(test)]
            Link::Sim(_) => false,
        }
    }

    /// One poll round of a blocked reader: verbs, true when a completion waits for the
    /// drive (a thread polling is in a call: the service thread's tick leaves the link be);
    /// shm, true (there is nothing to poll: look at the session).
    pub(crate) fn poll_round(&mut self) -> bool {
        match self {
            Link::Verbs(link) => {
                link.note_call();
                link.gather()
            }
            Link::Shm(_) => true,
            #[cfg(test)]
            Link::Sim(_) => true,
        }
    }

    /// Verbs: whether a polled wait's end is owed (see `VerbsLink::owed`). Shm: false.
    pub(crate) fn owed(&self) -> bool {
        matches!(self, Link::Verbs(link) if link.owed())
    }

    /// A blocking wait watches the connection's events itself: verbs, its pollable fd
    /// (see `VerbsLink::begin_direct_wait`); shm, nothing (`None`). `Err`: the channel is
    /// not armed.
    pub(crate) fn begin_direct_wait(&mut self) -> Result<Option<RawFd>, NotArmed> {
        match self {
            Link::Verbs(link) => link.begin_direct_wait().map(Some).ok_or(NotArmed),
            Link::Shm(_) => Ok(None),
            #[cfg(test)]
            Link::Sim(_) => Ok(None),
        }
    }

    /// The end of a direct wait (verbs; shm has none).
    pub(crate) fn end_direct_wait(&mut self) {
        if let Link::Verbs(link) = self {
            link.end_direct_wait();
        }
    }

    /// A reader's poll found news: the end of its direct wait is owed (verbs, see
    /// `VerbsLink::owe_direct_wait_end`; shm has none).
    pub(crate) fn owe_direct_wait_end(&mut self) {
        if let Link::Verbs(link) = self {
            link.owe_direct_wait_end();
        }
    }

    /// Settles what a polled wait owes, first half (verbs, see
    /// `VerbsLink::take_owed_event`): true when something was owed. Shm: false.
    pub(crate) fn take_owed_event(&mut self) -> bool {
        match self {
            Link::Verbs(link) => link.take_owed_event(),
            Link::Shm(_) => false,
            #[cfg(test)]
            Link::Sim(_) => false,
        }
    }

    /// The verbs link, if this is one.
    pub(crate) fn verbs(&self) -> Option<&VerbsLink> {
        match self {
            Link::Verbs(link) => Some(link),
            Link::Shm(_) => None,
            #[cfg(test)]
            Link::Sim(_) => None,
        }
    }

    /// The verbs link, if this is one.
    pub(crate) fn verbs_mut(&mut self) -> Option<&mut VerbsLink> {
        match self {
            Link::Verbs(link) => Some(link),
            Link::Shm(_) => None,
            #[cfg(test)]
            Link::Sim(_) => None,
        }
    }
}

impl SanConnection for Link {
    fn slot_config(&self) -> SlotConfig {
        match self {
            Link::Shm(conn) => conn.slot_config(),
            Link::Verbs(link) => link.slot_config(),
            #[cfg(test)]
            Link::Sim(link) => link.slot_config(),
        }
    }

    fn post_send(&mut self, wr_id: WrId, message: &[u8]) -> Result<(), PostError> {
        match self {
            Link::Shm(conn) => conn.post_send(wr_id, message),
            Link::Verbs(link) => link.conn_mut()?.post_send(wr_id, message),
            #[cfg(test)]
            Link::Sim(link) => link.post_send(wr_id, message),
        }
    }

    fn sends_in_parts(&self) -> bool {
        match self {
            Link::Shm(conn) => conn.sends_in_parts(),
            Link::Verbs(_) => false,
            #[cfg(test)]
            Link::Sim(_) => false,
        }
    }

    fn post_send_parts(
        &mut self,
        wr_id: WrId,
        head: &[u8],
        payload: &[u8],
    ) -> Result<(), PostError> {
        match self {
            Link::Shm(conn) => conn.post_send_parts(wr_id, head, payload),
            Link::Verbs(link) => link.conn_mut()?.post_send_parts(wr_id, head, payload),
            #[cfg(test)]
            Link::Sim(link) => link.post_send(wr_id, &san_api::joined(head, payload)),
        }
    }

    fn stage_send_from(
        &mut self,
        wr_id: WrId,
        head: &[u8],
        payload: &dyn AppSource,
    ) -> Result<bool, BadAddress> {
        match self {
            Link::Shm(conn) => conn.stage_send_from(wr_id, head, payload),
            // Verbs sends leave from registered send slots of our own: nothing to save.
            Link::Verbs(_) => Ok(false),
            #[cfg(test)]
            Link::Sim(link) => link.stage_send_from(wr_id, head, payload),
        }
    }

    fn stage_sends_from(
        &mut self,
        messages: &[StagedSend<'_>],
        payload: &dyn AppSource,
    ) -> Result<usize, BadAddress> {
        match self {
            Link::Shm(conn) => conn.stage_sends_from(messages, payload),
            Link::Verbs(_) => Ok(0),
            #[cfg(test)]
            Link::Sim(_) => san_api::stage_each(self, messages, payload),
        }
    }

    fn commit_staged(&mut self) {
        match self {
            Link::Shm(conn) => conn.commit_staged(),
            Link::Verbs(_) => {}
            #[cfg(test)]
            Link::Sim(link) => link.commit_staged(),
        }
    }

    fn discard_staged(&mut self) {
        match self {
            Link::Shm(conn) => conn.discard_staged(),
            Link::Verbs(_) => {}
            #[cfg(test)]
            Link::Sim(link) => link.discard_staged(),
        }
    }

    fn post_recv(&mut self, wr_id: WrId, slot: RecvSlot) -> Result<(), PostError> {
        match self {
            Link::Shm(conn) => conn.post_recv(wr_id, slot),
            Link::Verbs(link) => link.post_recv(wr_id, slot),
            #[cfg(test)]
            Link::Sim(link) => link.post_recv(wr_id, slot),
        }
    }

    fn recv_slot(&self, slot: RecvSlot, len: u32) -> &[u8] {
        match self {
            Link::Shm(conn) => conn.recv_slot(slot, len),
            Link::Verbs(link) => link.conn().map_or(&[], |c| c.recv_slot(slot, len)),
            #[cfg(test)]
            Link::Sim(link) => link.recv_slot(slot, len),
        }
    }

    fn post_write(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        match self {
            Link::Shm(conn) => conn.post_write(wr_id, local, remote),
            Link::Verbs(link) => link.conn_mut()?.post_write(wr_id, local, remote),
            #[cfg(test)]
            Link::Sim(link) => link.post_write(wr_id, local, remote),
        }
    }

    fn post_read(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        match self {
            Link::Shm(conn) => conn.post_read(wr_id, local, remote),
            Link::Verbs(link) => link.conn_mut()?.post_read(wr_id, local, remote),
            #[cfg(test)]
            Link::Sim(link) => link.post_read(wr_id, local, remote),
        }
    }

    fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        match self {
            Link::Shm(conn) => conn.poll_completions(out, max),
            Link::Verbs(link) => link.poll_completions(out, max),
            #[cfg(test)]
            Link::Sim(link) => link.poll_completions(out, max),
        }
    }
}
