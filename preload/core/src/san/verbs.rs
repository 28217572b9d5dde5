//! Cross-host SAN connections over RDMA verbs (`docs/ARCHITECTURE.md`, "Cross-host discovery
//! (verbs)").
//!
//! * The provider library is loaded lazily (`san-verbs-loader`: only when the host lists RDMA
//!   devices); a protection domain is opened per local IP address and cached (a failure too).
//! * A pending client listens with rdma_cm on its own address and TCP port before its SYN
//!   leaves ([`client`]); the acceptor connects to it from inside `accept()` with the TCP
//!   4-tuple in the private data ([`acceptor`]). A request naming another 4-tuple is
//!   rejected; a failed connect puts the client's address in a negative cache for 30 s.
//! * One service thread per process (`super::service`) sleeps in `epoll_wait` on what its
//!   [`Watcher`] holds: the pending clients' CM listeners (it accepts their requests here)
//!   and every switched connection's pollable fd (completion channel + CM channel). On an
//!   event it drives that socket's session under the socket's lock and raises the socket's
//!   own readiness mirror: the peer is remote and cannot write our `K`, so that thread does.
//!   This module is the adapter alone: it knows no SAN socket and runs no thread.
//! * Verbs objects are not used across `fork`: a child process does not use verbs at all
//!   (its inherited SAN sockets were downgraded to TCP before the fork).

use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use san_api::{
    Capabilities, Completion, CompletionKind, PostError, RecvSlot, SanConnection, SanDomain,
    SlotConfig, WrId,
};
use san_verbs_loader::{
    ConnectParams, LoadError, LoadedConnection, LoadedDomain, LoadedListener, SetupError,
    VerbsLibrary,
};

use super::exchange::SideWords;
use super::registrations::SharedRegistrations;
use super::tunables::{setup_timeout, SpinPolicy, VERBS_SLOTS};
use crate::discovery::canonical_addr;
use crate::mirror;
use crate::real;

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
/// How long a peer address whose CM connects failed is not asked again.
const NEGATIVE_TTL: Duration = Duration::from_secs(30);
/// Rejections in a row after which a peer address counts as plain. One is not enough: a
/// preloaded client that closed before our connect arrived rejects it too.
const REJECTIONS_FOR_PLAIN: u32 = 3;
const NEGATIVE_ENTRIES: usize = 64;
/// Private data: magic, version, family, then server and client address and port.
const MAGIC: &[u8; 4] = b"SDV1";

/// A protection domain shared by the connections of one local address, with its
/// registration cache (opened once, never closed: it lives as long as the process).
pub(crate) struct Domain {
    registrations: SharedRegistrations,
    caps: Capabilities,
}

impl Domain {
    /// Runs `f` on the loaded domain (under the registrations' lock: rdma_cm set-up and
    /// registrations of one device are serialized).
    fn with<T>(
        &self,
        f: impl FnOnce(&mut LoadedDomain) -> Result<T, SetupError>,
    ) -> Result<T, SetupError> {
        let mut registrations = self.registrations.lock();
        let domain = registrations.verbs_domain().ok_or(SetupError::Internal)?;
        f(domain)
    }
}

struct Verbs {
    library: VerbsLibrary,
    /// The process that loaded the library: verbs objects are not used in a fork child.
    pid: u32,
    domains: Mutex<Vec<(IpAddr, Option<&'static Domain>)>>,
    /// Per peer address: failed connects in a row, and when the count expires.
    negative: Mutex<Vec<(IpAddr, u32, Instant)>>,
}

static VERBS: OnceLock<Option<Verbs>> = OnceLock::new();

fn verbs() -> Option<&'static Verbs> {
    if crate::settings::provider_choice() == crate::settings::ProviderChoice::Shm
        || !crate::settings::san_enabled()
    {
        return None;
    }
    let verbs = VERBS
        .get_or_init(
            || match VerbsLibrary::load(crate::settings::verbs_library().as_deref()) {
                Ok(library) => Some(Verbs {
                    library,
                    pid: std::process::id(),
                    domains: Mutex::new(Vec::new()),
                    negative: Mutex::new(Vec::new()),
                }),
                Err(LoadError::NoProvider(reason)) => {
                    tracing::debug!(?reason, "no RDMA provider: cross-host SAN off");
                    None
                }
                Err(error) => {
                    tracing::warn!(%error, "RDMA provider unusable: cross-host SAN off");
                    None
                }
            },
        )
        .as_ref()?;
    (verbs.pid == std::process::id()).then_some(verbs)
}

fn guard<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The domain of the device that serves local address `ip` (`None`: no device, or verbs off).
pub(crate) fn domain_for(ip: IpAddr) -> Option<&'static Domain> {
    let verbs = verbs()?;
    let ip = canonical_addr(SocketAddr::new(ip, 0)).ip();
    if ip.is_unspecified() || ip.is_loopback() {
        return None;
    }
    let mut domains = guard(&verbs.domains);
    if let Some((_, domain)) = domains.iter().find(|(addr, _)| *addr == ip) {
        return *domain;
    }
    let domain = match verbs.library.open_domain_for(ip) {
        Ok(domain) => {
            let caps = domain.capabilities();
            let domain: &'static Domain = Box::leak(Box::new(Domain {
                registrations: SharedRegistrations::verbs(domain),
                caps,
            }));
            Some(domain)
        }
        Err(error) => {
            tracing::debug!(%ip, ?error, "no RDMA device serves this address");
            None
        }
    };
    domains.push((ip, domain));
    domain
}

fn negative_hit(peer: IpAddr) -> bool {
    let Some(verbs) = verbs() else { return true };
    let now = Instant::now();
    let mut cache = guard(&verbs.negative);
    cache.retain(|(_, _, until)| *until > now);
    cache
        .iter()
        .any(|(addr, failures, _)| *addr == peer && *failures >= REJECTIONS_FOR_PLAIN)
}

/// A connect to `peer` failed: `host_level` failures (no route, no device) count as plain at
/// once, a rejection counts one.
fn mark_negative(peer: IpAddr, host_level: bool) {
    let Some(verbs) = verbs() else { return };
    let mut cache = guard(&verbs.negative);
    let previous = cache
        .iter()
        .position(|(addr, _, _)| *addr == peer)
        .map_or(0, |i| cache.remove(i).1);
    if cache.len() >= NEGATIVE_ENTRIES {
        cache.remove(0);
    }
    let failures = if host_level {
        REJECTIONS_FOR_PLAIN
    } else {
        previous + 1
    };
    cache.push((peer, failures, Instant::now() + NEGATIVE_TTL));
}

/// A set-up failure that is this side's want of resources (memory it may not pin,
/// descriptors, queue pairs), not the peer's doing.
fn local_shortage(error: SetupError) -> bool {
    // The provider's own classification of set-up errors; a missing device is the peer's
    // address not being served, not a shortage.
    error != SetupError::NoDevice
        && san_api::SetupError::from(error) == san_api::SetupError::NoResources
}

/// A connect to `peer` succeeded: its failures are forgotten.
fn clear_negative(peer: IpAddr) {
    if let Some(verbs) = verbs() {
        guard(&verbs.negative).retain(|(addr, _, _)| *addr != peer);
    }
}

/// The set-up blob: which TCP connection this CM connection belongs to.
fn tuple_blob(server: SocketAddr, client: SocketAddr) -> Vec<u8> {
    let mut blob = Vec::with_capacity(40);
    blob.extend_from_slice(MAGIC);
    for addr in [server, client] {
        match canonical_addr(addr) {
            SocketAddr::V4(v4) => {
                blob.push(4);
                blob.extend_from_slice(&v4.ip().octets());
            }
            SocketAddr::V6(v6) => {
                blob.push(6);
                blob.extend_from_slice(&v6.ip().octets());
            }
        }
        blob.extend_from_slice(&addr.port().to_be_bytes());
    }
    blob
}

/// Connection parameters of both sides.
fn params(private_data: &[u8], local: Option<IpAddr>) -> ConnectParams<'_> {
    ConnectParams {
        private_data,
        timeout: setup_timeout(),
        local: local.map(|ip| SocketAddr::new(ip, 0)),
        ..ConnectParams::new(VERBS_SLOTS)
    }
}

/// Where a pending client's CM listener is.
enum AttachState {
    /// Listening; no acceptable request yet.
    Listening,
    /// A request naming our 4-tuple is being accepted: our reply may be out, so the
    /// acceptor may be about to write its switch marker.
    Attaching,
    /// Established; the switch takes the connection.
    Attached(LoadedConnection),
    /// Accepting failed after our reply may have gone out: the connection must be reset.
    Failed,
    /// We refused the request before replying (no resources to set the connection up,
    /// e.g. memory `RLIMIT_MEMLOCK` does not let us pin): the acceptor saw a rejection and
    /// keeps the connection on TCP, and so do we.
    Declined,
    /// The switch took the connection, or the socket went away.
    Done,
}

/// A pending client's attach point, shared with the service thread.
pub(crate) struct Attach {
    state: Mutex<AttachState>,
    changed: Condvar,
    listener: Mutex<Option<LoadedListener>>,
    expected: Vec<u8>,
    domain: &'static Domain,
}

impl Attach {
    /// The service thread: a request may be waiting on the listener.
    fn on_listener_event(&self) {
        loop {
            let (request, blob) = {
                let mut listener = guard(&self.listener);
                let Some(listening) = listener.as_mut() else {
                    return;
                };
                match listening.next_request(Some(Duration::ZERO)) {
                    Ok(found) => found,
                    Err(SetupError::TimedOut) => return,
                    Err(error) => {
                        tracing::debug!(?error, "client CM listener failed");
                        *listener = None;
                        return;
                    }
                }
            };
            if blob != self.expected {
                // Another connection's request (ports are reused): rejected by the drop.
                tracing::debug!("CM request for another 4-tuple rejected");
                continue;
            }
            {
                let mut state = guard(&self.state);
                if !matches!(*state, AttachState::Listening) {
                    return;
                }
                *state = AttachState::Attaching;
            }
            let accepted = self
                .domain
                .with(|domain| request.accept(domain, &params(&[], None)));
            let mut state = guard(&self.state);
            *state = match accepted {
                Ok(conn) if matches!(*state, AttachState::Attaching) => AttachState::Attached(conn),
                Ok(_) => AttachState::Done,
                Err(error @ (SetupError::Declined | SetupError::WrongDevice)) => {
                    tracing::debug!(?error, "declined the acceptor's CM connect: staying on TCP");
                    AttachState::Declined
                }
                Err(error) => {
                    tracing::debug!(?error, "accepting the acceptor's CM connect failed");
                    AttachState::Failed
                }
            };
            self.changed.notify_all();
            drop(state);
            *guard(&self.listener) = None;
            return;
        }
    }

    fn abandon(&self) {
        *guard(&self.state) = AttachState::Done;
        self.changed.notify_all();
        *guard(&self.listener) = None;
    }
}

/// The verbs side of a SAN socket's [`super::link::Link`].
pub(crate) struct VerbsLink {
    conn: Option<LoadedConnection>,
    attach: Option<Arc<Attach>>,
    domain: &'static Domain,
    /// Our mirror's other end `K` and its words: the service thread raises `M` through them.
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
enum Prepost {
    /// Posted by the session (or not posted).
    No,
    /// Posted at set-up; the session has not posted it yet.
    Waiting,
    /// Posted at set-up; the session's post of it carried this id.
    Claimed(WrId),
    /// Posted at set-up and completed before the session posted it: held until it does.
    Arrived(Completion),
}

fn all_preposted() -> Vec<Prepost> {
    vec![Prepost::Waiting; usize::from(VERBS_SLOTS.recv_slots)]
}

impl VerbsLink {
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

    /// Client, pending: whether the acceptor attached (or failed after our reply). With
    /// `wait`, an attach in progress is waited for up to that long.
    pub(crate) fn attached(&self, wait: Option<Duration>) -> bool {
        let Some(attach) = self.attach.as_ref() else {
            return self.conn.is_some();
        };
        let deadline = wait.map(|w| Instant::now() + w);
        let mut state = guard(&attach.state);
        loop {
            match &*state {
                AttachState::Attached(_) | AttachState::Failed => return true,
                AttachState::Attaching => {
                    let Some(deadline) = deadline else {
                        return false;
                    };
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        // Still undecided: the byte may be the marker; a reset is the only
                        // answer that cannot corrupt the stream.
                        return true;
                    }
                    state = attach
                        .changed
                        .wait_timeout(state, left)
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0;
                }
                AttachState::Listening | AttachState::Declined | AttachState::Done => return false,
            }
        }
    }

    /// Client, pending: we declined the acceptor's CM connect before replying (it keeps the
    /// connection on TCP): this side lacked the resources, the peer is capable.
    pub(crate) fn declined(&self) -> bool {
        self.attach
            .as_ref()
            .is_some_and(|attach| matches!(*guard(&attach.state), AttachState::Declined))
    }

    /// Client, switching: takes the established connection. `Err`: the attach failed after
    /// our reply (the connection cannot continue).
    pub(crate) fn take_attached(&mut self) -> Result<(), ()> {
        let attach = self.attach.take().ok_or(())?;
        let taken = core::mem::replace(&mut *guard(&attach.state), AttachState::Done);
        *guard(&attach.listener) = None;
        match taken {
            AttachState::Attached(conn) => {
                self.conn = Some(conn);
                self.preposted = all_preposted();
                Ok(())
            }
            _ => Err(()),
        }
    }

    /// Keeps our mirror's `K` end: the service thread raises `M` through it.
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
            // The service thread ticks while any link is owed (see `settle_idle_owed`).
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

    fn fd(&self) -> Option<RawFd> {
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

/// Before a client's `connect()` from `local` (fixed) to `server`: listens with rdma_cm on
/// `local` so a preloaded acceptor can attach; the service thread (`start`) watches the
/// listener. `None`: no device, no service thread, or listening failed.
pub(crate) fn client(
    fd: libc::c_int,
    local: SocketAddr,
    server: SocketAddr,
    start: StartService,
) -> Option<VerbsLink> {
    let domain = domain_for(local.ip())?;
    let watcher = started_watcher(start)?;
    let listen = || domain.with(|d| d.listen(canonical_addr(local), 4));
    let listener = match listen() {
        Ok(listener) => listener,
        Err(SetupError::Os(libc::EADDRINUSE)) => {
            // iWARP: rdma_cm ports are kernel TCP ports, shared with our bound socket only
            // when both allow it.
            let one: libc::c_int = 1;
            // SAFETY: a c_int option value of the right size on the application's socket.
            unsafe {
                real::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_REUSEADDR,
                    (&one as *const libc::c_int).cast(),
                    core::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            listen()
                .map_err(|error| tracing::debug!(?error, %local, "client CM listener refused"))
                .ok()?
        }
        Err(error) => {
            tracing::debug!(?error, %local, "client CM listener refused");
            return None;
        }
    };
    let listener_fd = listener.fd();
    let attach = Arc::new(Attach {
        state: Mutex::new(AttachState::Listening),
        changed: Condvar::new(),
        listener: Mutex::new(Some(listener)),
        expected: tuple_blob(server, local),
        domain,
    });
    watcher.watch_attach(listener_fd, attach.clone());
    Some(VerbsLink {
        conn: None,
        attach: Some(attach),
        domain,
        own: None,
        closed: false,
        preposted: Vec::new(),
        held: Vec::new(),
        watch_tag: None,
        direct_waiters: 0,
        armed: false,
        spin: SpinPolicy::default(),
        answer_expected: false,
        owed: false,
        calls: 0,
        calls_at_tick: 0,
    })
}

/// Why the acceptor's attach did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AcceptorError {
    /// No verbs path to this client (not preloaded, no device, cached).
    PeerPlain,
    /// Verbs set-up failed otherwise.
    Resource,
}

/// Inside `accept()`: connects to the client's CM listener at its TCP address and port (the
/// service thread, `start`, must run: it will watch the connection).
pub(crate) fn acceptor(
    local: SocketAddr,
    peer: SocketAddr,
    start: StartService,
) -> Result<VerbsLink, AcceptorError> {
    let peer = canonical_addr(peer);
    let domain = domain_for(local.ip()).ok_or(AcceptorError::PeerPlain)?;
    if negative_hit(peer.ip()) {
        return Err(AcceptorError::PeerPlain);
    }
    started_watcher(start).ok_or(AcceptorError::Resource)?;
    let blob = tuple_blob(local, peer);
    let started = Instant::now();
    let connected = domain.with(|d| d.connect(peer, &params(&blob, Some(local.ip()))));
    match connected {
        Ok((conn, _)) => {
            tracing::debug!(%peer, took = ?started.elapsed(), "CM connect to the client established");
            clear_negative(peer.ip());
            Ok(VerbsLink {
                conn: Some(conn),
                attach: None,
                domain,
                own: None,
                closed: false,
                preposted: all_preposted(),
                held: Vec::new(),
                watch_tag: None,
                direct_waiters: 0,
                armed: false,
                spin: SpinPolicy::default(),
                answer_expected: false,
                owed: false,
                calls: 0,
                calls_at_tick: 0,
            })
        }
        Err(error) => {
            tracing::debug!(%peer, ?error, took = ?started.elapsed(), "CM connect to the client failed");
            // Our own want of resources (the QP and slots are set up before the request goes
            // out) says nothing about the peer.
            if !local_shortage(error) {
                mark_negative(
                    peer.ip(),
                    matches!(
                        error,
                        SetupError::Unreachable | SetupError::NoDevice | SetupError::WrongDevice
                    ),
                );
            }
            Err(match error {
                SetupError::Rejected
                | SetupError::Unreachable
                | SetupError::NoDevice
                | SetupError::WrongDevice => AcceptorError::PeerPlain,
                _ => AcceptorError::Resource,
            })
        }
    }
}

/// See [`Watcher::set_watch`].
fn set_service_watch(fd: RawFd, tag: u64, on: bool) {
    if let Some(watcher) = watcher() {
        watcher.set_watch(fd, tag, on);
    }
}

const TAG_SOCKET: u64 = 1 << 32;
const TAG_ATTACH: u64 = 2 << 32;
/// The kernel TCP socket of a switched verbs socket (its end, e.g. a keepalive timeout).
const TAG_KERNEL: u64 = 3 << 32;
/// The service thread's own ticker (an eventfd).
const TAG_TICK: u64 = 4 << 32;

/// Starts the per-process service thread (once; `super::service`): true when it runs.
pub(crate) type StartService = fn() -> bool;

/// What the per-process service thread watches (see the module docs): its epoll set, with
/// the pending clients' CM listeners, the switched connections and their kernel sockets.
pub(crate) struct Watcher {
    epoll: OwnedFd,
    attaches: Mutex<Vec<(u32, Arc<Attach>)>>,
    next: AtomicU32,
    /// Rung when the first link becomes owed: the thread then ticks (see `service`).
    ticker: Option<OwnedFd>,
}

/// What an event of the service thread's epoll set asks of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Watched {
    /// The connection of switched verbs socket `index` has events.
    Socket(u32),
    /// The kernel TCP socket of verbs socket `index` reported its end.
    KernelSocket(u32),
    /// Nothing more: the event was handled here (a pending client's CM listener, the tick).
    Handled,
}

static WATCHER: OnceLock<Option<Watcher>> = OnceLock::new();

/// The service thread's watch set, once made (never makes it: see [`started_watcher`]).
pub(crate) fn watcher() -> Option<&'static Watcher> {
    WATCHER.get().and_then(Option::as_ref)
}

/// The service thread's watch set, made on first use, with the thread running (`start`).
pub(crate) fn started_watcher(start: StartService) -> Option<&'static Watcher> {
    WATCHER
        .get_or_init(|| {
            // SAFETY: plain epoll_create1(2) through the real symbol (not our hook).
            let raw = unsafe { real::epoll_create1(libc::EPOLL_CLOEXEC) };
            if raw < 0 {
                return None;
            }
            // SAFETY: a fresh descriptor owned by nobody else.
            let epoll = mirror::relocate_internal_fd(unsafe { OwnedFd::from_raw_fd(raw) });
            // SAFETY: plain eventfd(2); the result is owned below.
            let ticker = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            let ticker = (ticker >= 0).then(|| {
                // SAFETY: a fresh descriptor owned by nobody else.
                mirror::relocate_internal_fd(unsafe { OwnedFd::from_raw_fd(ticker) })
            });
            let watcher = Watcher {
                epoll,
                attaches: Mutex::new(Vec::new()),
                next: AtomicU32::new(0),
                ticker,
            };
            if let Some(ticker) = watcher.ticker.as_ref() {
                watcher.watch(ticker.as_raw_fd(), TAG_TICK);
            }
            Some(watcher)
        })
        .as_ref()
        .filter(|_| start())
}

impl Watcher {
    /// Wakes the thread (it then ticks while links are owed).
    fn wake(&self) {
        if let Some(ticker) = self.ticker.as_ref() {
            let one = 1u64;
            // SAFETY: an 8-byte write to our eventfd.
            unsafe { libc::write(ticker.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    fn watch(&self, fd: RawFd, data: u64) {
        let mut event = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: data,
        };
        // SAFETY: plain epoll_ctl(2) on our own epoll instance.
        unsafe { real::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
    }

    /// Watches the application's kernel TCP socket `fd` for its end only: no readiness
    /// events, so just the error and hang-up the kernel always reports, edge-triggered (each
    /// once). Never removed by us: the kernel drops the registration with the socket's last
    /// descriptor, and an event for a socket that is no longer a switched verbs socket, or
    /// whose number now names another one, is checked and ignored (removing by number could
    /// remove a newer socket's registration).
    fn watch_kernel_socket(&self, fd: RawFd, data: u64) {
        let mut event = libc::epoll_event {
            events: libc::EPOLLET as u32,
            u64: data,
        };
        // SAFETY: plain epoll_ctl(2) on our own epoll instance; `fd` is a live socket of the
        // application (a stale registration of the same number is replaced by EEXIST's MOD).
        let rc =
            unsafe { real::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
        if rc != 0 && crate::errno::get() == libc::EEXIST {
            // SAFETY: as above.
            unsafe { real::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, &mut event) };
        }
    }

    /// Pauses (`on` false) or resumes the watch of `fd`. Resuming re-evaluates readiness:
    /// an event that arrived while paused and was not consumed is reported then.
    fn set_watch(&self, fd: RawFd, data: u64, on: bool) {
        let mut event = libc::epoll_event {
            events: if on {
                (libc::EPOLLIN | libc::EPOLLET) as u32
            } else {
                0
            },
            u64: data,
        };
        // SAFETY: plain epoll_ctl(2) on our own epoll instance.
        unsafe { real::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, &mut event) };
    }

    fn watch_attach(&self, fd: RawFd, attach: Arc<Attach>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut attaches = guard(&self.attaches);
            // Attaches that are over (switched, failed, socket gone) are dropped here.
            attaches.retain(|(_, a)| guard(&a.listener).is_some());
            attaches.push((id, attach));
        }
        self.watch(fd, TAG_ATTACH | u64::from(id));
    }

    /// The service thread: waits up to `timeout_ms` for events (`epoll_wait`: their count,
    /// or -1 with errno).
    pub(crate) fn wait(&self, events: &mut [libc::epoll_event], timeout_ms: libc::c_int) -> i32 {
        // SAFETY: `events` has room for its length; our own epoll instance.
        unsafe {
            real::epoll_wait(
                self.epoll.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                timeout_ms,
            )
        }
    }

    /// The service thread, for an event tagged `data`: handles the tick and a pending
    /// client's CM listener here, and says which socket anything else is about.
    pub(crate) fn dispatch(&self, data: u64) -> Watched {
        let low = (data & 0xffff_ffff) as u32;
        match data & !0xffff_ffff {
            TAG_SOCKET => return Watched::Socket(low),
            TAG_KERNEL => return Watched::KernelSocket(low),
            TAG_TICK => {
                if let Some(ticker) = self.ticker.as_ref() {
                    let mut count = 0u64;
                    // SAFETY: an 8-byte read from our nonblocking eventfd.
                    unsafe { libc::read(ticker.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
                }
            }
            TAG_ATTACH => {
                let attach = guard(&self.attaches)
                    .iter()
                    .find(|(id, _)| *id == low)
                    .map(|(_, a)| a.clone());
                if let Some(attach) = attach {
                    attach.on_listener_event();
                }
            }
            _ => {}
        }
        Watched::Handled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_blob_names_the_whole_tuple_and_fits_the_cm_limit() {
        let server: SocketAddr = "192.0.2.1:7000".parse().unwrap();
        let client: SocketAddr = "192.0.2.2:40000".parse().unwrap();
        let blob = tuple_blob(server, client);
        assert_eq!(&blob[..4], MAGIC);
        assert_eq!(blob.len(), 4 + 2 * (1 + 4 + 2));
        assert_ne!(blob, tuple_blob(client, server));
        let mapped: SocketAddr = "[::ffff:192.0.2.1]:7000".parse().unwrap();
        assert_eq!(blob, tuple_blob(mapped, client), "v4-mapped folds to IPv4");
        let v6: SocketAddr = "[2001:db8::1]:7000".parse().unwrap();
        let v6c: SocketAddr = "[2001:db8::2]:40000".parse().unwrap();
        assert!(tuple_blob(v6, v6c).len() <= san_verbs_loader::abi::MAX_PRIVATE_DATA);
    }
}
