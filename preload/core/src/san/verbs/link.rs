//! The connection under a verbs SAN socket's session: the loaded connection (or, for a
//! pending client, its attach point), the receive slots posted at set-up, the completion
//! channel's arming, and the direct and polled waits of blocked threads on its events.

use core::sync::atomic::{AtomicUsize, Ordering};
use std::os::fd::{AsFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use san_api::{
    Capabilities, Completion, CompletionKind, PostError, RecvSlot, SanConnection, SlotConfig, WrId,
};
use san_verbs_loader::LoadedConnection;

use super::watcher::{
    set_service_watch, started_watcher, watcher, StartService, TAG_KERNEL, TAG_SOCKET,
};
use super::{
    guard, match_token, Arrival, Attach, CandidateState, Domain, Token, TokenMatch, TOKEN_LEN,
};
use crate::mirror;
use crate::real;
use crate::san::exchange::SideWords;
use crate::san::registrations::SharedRegistrations;
use crate::san::tunables::{setup_timeout, SpinPolicy, VERBS_SLOTS};

/// Links whose polled wait's end is owed ([`VerbsLink::owe_direct_wait_end`]): while there
/// are any, the service thread ticks (see `super::service`).
static OWED_LINKS: AtomicUsize = AtomicUsize::new(0);

/// Whether any link's polled wait's end is owed (one atomic load).
pub(crate) fn links_owed() -> bool {
    OWED_LINKS.load(Ordering::Acquire) > 0
}

/// How long the end of a polled wait waits for the channel event of the completion it found
/// (the kernel queues the event just after the completion becomes visible; see
/// [`VerbsLink::take_owed_event`]). A bound, not a pace: the event is there long before.
const OWED_EVENT_WAIT: Duration = Duration::from_millis(1);

/// The verbs side of a SAN socket's [`crate::san::link::Link`].
pub(crate) struct VerbsLink {
    conn: Option<LoadedConnection>,
    attach: Option<Arc<Attach>>,
    domain: &'static Domain,
    /// Acceptor: the token of the client's reply, written on TCP in place of the switch
    /// marker (see `super`).
    token: Option<Token>,
    /// Our mirror's raising end and its words: the service thread raises the watched end through them.
    own: Option<(OwnedFd, SideWords)>,
    closed: bool,
    /// Receive slots the provider posted at set-up (work-request id = slot number, so a
    /// peer that sends first never meets an empty receive queue): the session's own first
    /// post of such a slot is recorded here instead of posted, and the slot's completion is
    /// reported under the session's id.
    preposted: Vec<Prepost>,
    /// Completions of pre-posted slots the session has just posted, to report next.
    held: Vec<Completion>,
    /// The service thread's epoll tag for this connection, once it watches it.
    watch_tag: Option<u64>,
    /// Threads blocked on this socket that watch the connection's events themselves; while
    /// there are any, the service thread's watch is paused (see [`VerbsLink::begin_direct_wait`]).
    direct_waiters: u32,
    /// The last [`VerbsLink::arm`] armed the completion channel (no event consumed since).
    armed: bool,
    /// Whether a blocked reader polls before it sleeps.
    pub(crate) spin: SpinPolicy,
    /// The application sent data since it last received some: a read now waits for an
    /// answer, which the peer may send at once (polled for); a reader of a one-way stream
    /// waits for data the peer sends at its own pace, and sleeps (see [`SpinPolicy`]).
    pub(crate) answer_expected: bool,
    /// A reader's poll found news while the queue was armed: the end of its direct wait
    /// (the service thread's watch resuming) and the channel event the armed queue raised
    /// are owed until the link is settled ([`VerbsLink::take_owed_event`], called by
    /// `SanSocket::settle_direct_wait`); meanwhile the queue counts as armed and the
    /// application's calls poll it themselves. Resumed before that event is consumed, the
    /// watch would wake the service thread for it, to contend for the socket's lock; and the
    /// event can lag the completion the poll found (queued after it becomes visible).
    owed: bool,
    /// The application's calls on this socket (wrapping), and their number at the service
    /// thread's last tick: an owed link is settled by the service thread only after a tick
    /// without a call.
    calls: u32,
    calls_at_tick: u32,
}

/// A receive slot's pre-posting state.
#[derive(Clone, Copy, Debug)]
pub(super) enum Prepost {
    /// Posted by the session (or not posted).
    No,
    /// Posted at set-up; the session has not posted it yet.
    Waiting,
    /// Posted at set-up; the session's post of it carried this id.
    Claimed(WrId),
    /// Posted at set-up and completed before the session posted it: held until it does.
    Arrived(Completion),
}

pub(super) fn all_preposted() -> Vec<Prepost> {
    vec![Prepost::Waiting; usize::from(VERBS_SLOTS.recv_slots)]
}

impl VerbsLink {
    /// A link on `conn` (the acceptor's, established, with the client's `token`) or, for a
    /// pending client, on `attach`, in `domain`; `preposted`: the receive slots posted at
    /// set-up.
    pub(super) fn new(
        conn: Option<LoadedConnection>,
        attach: Option<Arc<Attach>>,
        domain: &'static Domain,
        preposted: Vec<Prepost>,
        token: Option<Token>,
    ) -> VerbsLink {
        VerbsLink {
            conn,
            attach,
            domain,
            token,
            own: None,
            closed: false,
            preposted,
            held: Vec::new(),
            watch_tag: None,
            direct_waiters: 0,
            armed: false,
            spin: SpinPolicy::default(),
            answer_expected: false,
            owed: false,
            calls: 0,
            calls_at_tick: 0,
        }
    }

    pub(crate) fn capabilities(&self) -> Capabilities {
        self.domain.caps
    }

    pub(crate) fn is_up(&self) -> bool {
        !self.closed
    }

    /// This connection's domain's registrations (the rendezvous registers through them).
    pub(crate) fn registrations(&self) -> &'static SharedRegistrations {
        &self.domain.registrations
    }

    pub(crate) fn slot_config(&self) -> SlotConfig {
        VERBS_SLOTS
    }

    pub(crate) fn conn(&self) -> Option<&LoadedConnection> {
        self.conn.as_ref()
    }

    pub(crate) fn conn_mut(&mut self) -> Result<&mut LoadedConnection, PostError> {
        self.conn.as_mut().ok_or(PostError::Disconnected)
    }

    /// [`SanConnection::post_recv`], minding the slots posted at set-up.
    pub(crate) fn post_recv(&mut self, wr_id: WrId, slot: RecvSlot) -> Result<(), PostError> {
        if let Some(state) = self.preposted.get_mut(usize::from(slot.0)) {
            match core::mem::replace(state, Prepost::No) {
                Prepost::Waiting => {
                    *state = Prepost::Claimed(wr_id);
                    return Ok(());
                }
                Prepost::Arrived(mut completion) => {
                    // The message came before the session posted the slot: report it now,
                    // under the session's id.
                    completion.wr_id = wr_id;
                    self.held.push(completion);
                    return Ok(());
                }
                claimed @ Prepost::Claimed(_) => {
                    *state = claimed;
                    return Err(PostError::QueueFull);
                }
                Prepost::No => {}
            }
        }
        self.conn_mut()?.post_recv(wr_id, slot)
    }

    /// [`SanConnection::poll_completions`], reporting pre-posted slots under the session's
    /// ids (and only once the session has posted them).
    pub(crate) fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let first = out.len();
        let held = self.held.len().min(max);
        out.extend(self.held.drain(..held));
        let Some(conn) = self.conn.as_mut() else {
            return held;
        };
        conn.poll_completions(out, max - held);
        let preposted = &mut self.preposted;
        let mut index = first + held;
        while index < out.len() {
            let completion = out[index];
            let state = match completion.kind {
                CompletionKind::Recv { slot, .. }
                    if completion.wr_id == WrId(u64::from(slot.0)) =>
                {
                    preposted.get_mut(usize::from(slot.0))
                }
                _ => None,
            };
            match state.map(|state| (core::mem::replace(state, Prepost::No), state)) {
                Some((Prepost::Claimed(wr_id), _)) => out[index].wr_id = wr_id,
                Some((Prepost::Waiting, state)) => {
                    *state = Prepost::Arrived(completion);
                    out.remove(index);
                    continue;
                }
                Some((other, state)) => *state = other,
                None => {}
            }
            index += 1;
        }
        out.len() - first
    }

    pub(crate) fn close(&mut self) {
        self.closed = true;
        // Destroying the id disconnects: the peer's QP flushes and its session resets.
        self.conn = None;
        if let Some(attach) = self.attach.take() {
            attach.abandon();
        }
    }

    /// Acceptor: what it writes on TCP in place of the switch marker (the client's token).
    pub(crate) fn switch_token(&self) -> Option<Token> {
        self.token
    }

    /// Client, pending: what the first bytes on TCP (`tcp`, looked at without consuming
    /// them) say. Without candidates nothing can be a token, and nothing is looked at unless
    /// `settle`. With `settle` (the caller found bytes there and must know what they are),
    /// bytes that may still become a token are waited for, up to the set-up timeout, after
    /// which they are the stream's.
    pub(crate) fn arrival(&self, tcp: RawFd, settle: bool) -> Arrival {
        let Some(attach) = self.attach.as_ref() else {
            return Arrival::Nothing;
        };
        if !settle && guard(&attach.state).list.is_empty() {
            return Arrival::Nothing;
        }
        let deadline = settle.then(|| Instant::now() + setup_timeout());
        let mut head = [0u8; TOKEN_LEN];
        loop {
            match peek_head(tcp, &mut head) {
                // End of stream or an error first: no acceptor wrote a token.
                Some(0) => return Arrival::Plain,
                Some(n) => {
                    let state = guard(&attach.state);
                    match match_token(&head[..n], state.list.iter().map(|c| &c.token)) {
                        TokenMatch::Token(_) => return Arrival::Token,
                        TokenMatch::Plain => return Arrival::Plain,
                        TokenMatch::Prefix => {}
                    }
                }
                None if !settle => return Arrival::Nothing,
                None => {}
            }
            match deadline {
                Some(deadline) if Instant::now() < deadline => {
                    // Rare: the start of a candidate's token is there, and an acceptor's
                    // token comes whole in one segment in practice. Bounded by the deadline.
                    std::thread::sleep(Duration::from_millis(1));
                }
                Some(_) => return Arrival::Plain,
                None => return Arrival::Nothing,
            }
        }
    }

    /// Client, pending: we declined an acceptor's CM connect before replying (it keeps the
    /// connection on TCP): this side lacked the resources, the peer is capable.
    pub(crate) fn declined(&self) -> bool {
        self.attach
            .as_ref()
            .is_some_and(|attach| guard(&attach.state).declined)
    }

    /// Client, switching ([`VerbsLink::arrival`] found a token): takes the connection of the
    /// candidate whose token is first on TCP, consumes the token and waits (bounded) for the
    /// connection to be established; the other candidates and the listener go. `Err`: that
    /// candidate failed after our reply (its acceptor is committed: the connection cannot
    /// continue).
    pub(crate) fn take_confirmed(&mut self, tcp: RawFd) -> Result<(), ()> {
        let attach = self.attach.take().ok_or(())?;
        let taken = confirmed_candidate(&attach, tcp);
        // Whatever happened, nothing more is accepted and the others go.
        attach.abandon();
        let mut conn = taken?;
        let mut token = [0u8; TOKEN_LEN];
        // SAFETY: `token` is writable for its length; `tcp` is the application's socket.
        let n = unsafe {
            real::recv(
                tcp,
                token.as_mut_ptr().cast(),
                TOKEN_LEN,
                libc::MSG_DONTWAIT,
            )
        };
        if n != TOKEN_LEN as isize {
            return Err(());
        }
        // The acceptor wrote the token after its side was established; ours follows at once.
        conn.wait_established(setup_timeout()).map_err(|error| {
            tracing::debug!(?error, "the confirmed CM connection was not established");
        })?;
        self.conn = Some(conn);
        self.preposted = all_preposted();
        Ok(())
    }

    /// Keeps our mirror's raising end: the service thread raises the watched end through it.
    pub(crate) fn set_own_mirror(&mut self, k: OwnedFd, words: SideWords) {
        self.own = Some((k, words));
    }

    /// Raises our own mirror: readable when the session has something to read (data, FIN,
    /// reset), writable when it can take more. Lowering stays with the application's calls.
    pub(crate) fn raise(&self, readable: bool, writable: bool) {
        let Some((k, words)) = self.own.as_ref() else {
            return;
        };
        if readable {
            mirror::raise_readable(words, k.as_fd());
        }
        if writable {
            mirror::raise_writable(words, k.as_fd());
        }
    }

    /// A blocked reader's poll round: moves what the completion queue holds into `held` (for
    /// the next drive, which reports `held` first). True when a completion waits there.
    pub(crate) fn gather(&mut self) -> bool {
        if !self.held.is_empty() {
            return true;
        }
        let mut found = core::mem::take(&mut self.held);
        // (`held` is empty: this polls the connection and maps pre-posted slots' ids.)
        self.poll_completions(&mut found, 32);
        self.held = found;
        !self.held.is_empty()
    }

    /// The service thread, on an event of this connection: consumes the channel events and
    /// connection events (completions stay queued for the session's drive). Never blocks:
    /// the socket's lock is held, and an event whose completions the application's thread
    /// already took must not keep that thread waiting (a 1 ms wait here did, on every such
    /// event).
    pub(crate) fn collect_events(&mut self) {
        if let Some(conn) = self.conn.as_mut() {
            // It may consume the channel's event and return before arming again.
            self.armed = false;
            conn.wait(Some(Duration::ZERO));
        }
    }

    /// Arms the completion channel (`solicited_only`: for the peer's messages alone, see
    /// `LoadedConnection::arm_solicited`); false when completions are pending (drive first).
    /// While a polled wait's end is owed, the queue counts as armed (its event is owed).
    pub(crate) fn arm(&mut self, solicited_only: bool) -> bool {
        if self.owed && self.armed {
            return true;
        }
        let armed = self.conn.as_mut().is_none_or(|conn| {
            if solicited_only {
                conn.arm_solicited()
            } else {
                conn.arm()
            }
        });
        self.armed = armed;
        armed
    }

    /// A reader's poll found news: its direct wait ends when the link is settled
    /// ([`VerbsLink::take_owed_event`]).
    pub(crate) fn owe_direct_wait_end(&mut self) {
        if self.owed {
            // (Owed already: this wait's own end now; the watch stays paused for the owed one.)
            self.end_direct_wait();
            return;
        }
        self.owed = true;
        if OWED_LINKS.fetch_add(1, Ordering::AcqRel) == 0 {
            // The service thread ticks while any link is owed (see `service::settle_idle_owed`).
            if let Some(watcher) = watcher() {
                watcher.wake();
            }
        }
    }

    /// Whether a polled wait's end is owed (the queue may hold an unconsumed event and not
    /// be armed; the service thread does not watch the connection).
    pub(crate) fn owed(&self) -> bool {
        self.owed
    }

    /// Counts a call of the application on this socket (the service thread settles an owed
    /// link only after a tick without one).
    pub(crate) fn note_call(&mut self) {
        self.calls = self.calls.wrapping_add(1);
    }

    /// The service thread's tick: true when no call came since the last tick (the
    /// application left the socket: time to settle).
    pub(crate) fn idle_since_last_tick(&mut self) -> bool {
        let idle = self.calls == self.calls_at_tick;
        self.calls_at_tick = self.calls;
        idle
    }

    /// Settles what a polled wait owes, first half (true when something was owed): consumes
    /// the channel event its armed queue raised, waiting a little for one still being queued
    /// (none is waited for when the queue's notification did not fire). The caller then
    /// re-arms and ends the direct wait ([`VerbsLink::end_direct_wait`]).
    pub(crate) fn take_owed_event(&mut self) -> bool {
        if !self.owed {
            return false;
        }
        self.owed = false;
        OWED_LINKS.fetch_sub(1, Ordering::AcqRel);
        if let Some(conn) = self.conn.as_mut() {
            if conn.take_event(OWED_EVENT_WAIT) {
                self.armed = false;
            }
        }
        true
    }

    /// A thread is about to block on this socket (its lock held, right after a drive that
    /// armed the channel): it watches the connection's pollable fd itself, so an arrival
    /// wakes it directly instead of waking the service thread, which would then drive the
    /// session and wake it through the mirror: two thread wake-ups and a lock hand-over per
    /// message (under emulation each wake-up costs about a millisecond). The service
    /// thread's watch is paused meanwhile ([`VerbsLink::end_direct_wait`] resumes it, and
    /// the kernel then reports an event that arrived unhandled). `None`: the channel is not
    /// armed (completions came in after the drive): drive again rather than block.
    pub(crate) fn begin_direct_wait(&mut self) -> Option<RawFd> {
        let fd = self.fd()?;
        if !self.armed {
            return None;
        }
        if self.direct_waiters == 0 {
            if let Some(tag) = self.watch_tag {
                set_service_watch(fd, tag, false);
            }
        }
        self.direct_waiters += 1;
        Some(fd)
    }

    /// The end of a wait begun with [`VerbsLink::begin_direct_wait`].
    pub(crate) fn end_direct_wait(&mut self) {
        self.direct_waiters = self.direct_waiters.saturating_sub(1);
        if self.direct_waiters == 0 {
            if let (Some(fd), Some(tag)) = (self.fd(), self.watch_tag) {
                set_service_watch(fd, tag, true);
            }
        }
    }

    pub(super) fn fd(&self) -> Option<RawFd> {
        self.conn.as_ref().map(LoadedConnection::fd)
    }

    /// The socket (record index `index`, kernel socket `tcp`) switched: the service thread
    /// (`start`) watches this connection's events, and the kernel socket's end, from now on.
    /// False when there is no connection or no service thread.
    pub(crate) fn watch(&mut self, index: u32, tcp: Option<RawFd>, start: StartService) -> bool {
        let Some(fd) = self.fd() else {
            return false;
        };
        let Some(watcher) = started_watcher(start) else {
            return false;
        };
        let tag = TAG_SOCKET | u64::from(index);
        watcher.watch(fd, tag);
        self.watch_tag = Some(tag);
        if let Some(tcp) = tcp {
            watcher.watch_kernel_socket(tcp, TAG_KERNEL | u64::from(index));
        }
        true
    }
}

/// Looks at up to [`TOKEN_LEN`] first bytes on TCP without consuming them: how many there
/// are (`None`: none yet; `Some(0)`: end of stream, or an error).
fn peek_head(tcp: RawFd, head: &mut Token) -> Option<usize> {
    // SAFETY: `head` is writable for its length; `tcp` is the application's socket.
    let n = unsafe {
        real::recv(
            tcp,
            head.as_mut_ptr().cast(),
            TOKEN_LEN,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match usize::try_from(n) {
        Ok(n) => Some(n),
        Err(_) if matches!(crate::errno::get(), libc::EAGAIN | libc::EINTR) => None,
        Err(_) => Some(0),
    }
}

/// [`VerbsLink::take_confirmed`]: takes the connection of the candidate whose token is first
/// on TCP out of `attach`, once its reply went out (waited for, bounded).
fn confirmed_candidate(attach: &Attach, tcp: RawFd) -> Result<LoadedConnection, ()> {
    let mut head = [0u8; TOKEN_LEN];
    if peek_head(tcp, &mut head) != Some(TOKEN_LEN) {
        return Err(());
    }
    let deadline = Instant::now() + setup_timeout();
    let mut state = guard(&attach.state);
    loop {
        let TokenMatch::Token(n) = match_token(&head, state.list.iter().map(|c| &c.token)) else {
            return Err(());
        };
        match core::mem::replace(&mut state.list[n].state, CandidateState::Failed) {
            CandidateState::Replied(conn) => {
                state.list.swap_remove(n);
                return Ok(conn);
            }
            CandidateState::Failed => return Err(()),
            CandidateState::Accepting => {
                state.list[n].state = CandidateState::Accepting;
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(());
                }
                state = attach
                    .changed
                    .wait_timeout(state, left)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
        }
    }
}

impl Drop for VerbsLink {
    fn drop(&mut self) {
        if self.owed {
            OWED_LINKS.fetch_sub(1, Ordering::AcqRel);
        }
        if let Some(attach) = self.attach.take() {
            attach.abandon();
        }
    }
}
