//! The SAN path of the interposer: connected TCP sockets carried over the intra-host `shm`
//! provider by the switch's session, with an exact switch-over (see `docs/ARCHITECTURE.md`,
//! "Discovery and the exact switch-over point").
//!
//! # Enabling
//! On by default; `SANDIRECT_SAN=0` (read at init) keeps every socket on kernel TCP and
//! nothing here runs. `SANDIRECT_SHM_DIR` overrides the segment directory.
//!
//! # Life of a SAN socket
//! * `listen()` publishes the listener marker ([`on_listen`]).
//! * Before a client's `connect()` (blocking or not) to a preloaded local listener (marker
//!   probe, negative cache), the socket's local address is fixed (an unbound socket is bound to
//!   the route's source address and an ephemeral port) so the connection key is known, and the
//!   exchange listener and the segment are created *before the SYN leaves* ([`before_connect`]):
//!   the acceptor may run `accept()` before our `connect()` returns and must find them. The
//!   socket is *pending* and counts the bytes it writes on TCP.
//! * `accept()` on a marked listener connects to the client's exchange, passes its mirror end
//!   and the words page, attaches, starts its session with `tcp_bytes_sent = 0` and writes the
//!   switch marker ([`on_accepted`]). The marker makes the client readable without data; a
//!   nonblocking read that consumes it waits (bounded, 50 ms) for the handshake round trip and
//!   the acceptor's first bytes instead of reporting an `EAGAIN` a strict level-triggered
//!   client (wrk) would take for an error.
//! * The pending client switches at its next call that finds the segment attached (data calls,
//!   `poll`/`select`/`epoll_ctl`, `shutdown`, `FIONREAD`, `dup2` over it), or when a byte
//!   arrives on TCP and the segment is attached (that byte is the marker). A byte that finds the
//!   segment *not* attached is a plain server's data: the socket drops its SAN object for good.
//! * The acceptor reads exactly the client's pending byte count from TCP, then the session.
//! * Bytes sent before the handshake completed (the peer has not run since) are buffered
//!   locally up to a socket buffer's worth, as the kernel would, and enter the session first.
//!
//! # Locking
//! Per-socket state lives in a heap object reached through the socket record's index
//! (`slot`): one mutex per socket, never a global lock on the data path, and never held
//! while blocking in the kernel (the blocking loops release it around `poll()`). Threads
//! blocked on one socket share an eventfd that a thread making progress rings.
//!
//! # Known limits (documented policy)
//! * Blocking waits sleep in `poll()`, which the kernel never restarts; after an `EINTR` the
//!   wait is restarted when *every* installed handler (fault signals aside) has `SA_RESTART`
//!   and the socket has no `SO_RCVTIMEO`/`SO_SNDTIMEO` — the kernel's rule, except that it
//!   looks only at the handler of the signal that arrived, which a poll cannot know: with one
//!   handler without `SA_RESTART` installed, a `SA_RESTART` signal also interrupts.
//! * Hooks on a SAN socket are not async-signal-safe (per-socket mutex, allocation): a signal
//!   handler that interrupts one of our own hooks and does I/O on a SAN socket gets `EINTR`
//!   (the session may be mid-update under this thread's lock, and the kernel socket would put
//!   the bytes out of order). Interrupting the application anywhere else is fine.
//! * `EPOLLET`: while an edge-triggered registration watches a SAN socket, the peer writes a
//!   mirror token for every send that reaches it, so every arrival is a new event even while
//!   earlier data is unread, as for TCP ([`epoll_registrations_changed`]). Arrivals beyond 64
//!   unread ones make no further event until the application reads.
//! * The preload's own descriptors (mirror ends, the words page, exchange sockets, pidfds,
//!   doorbells) live at or above half the soft `RLIMIT_NOFILE` (at most from 1024 on), so the
//!   application's descriptor numbers are those it would get without the preload; a program
//!   that `dup2`s onto those high numbers closes one of ours (that connection then fails).
//! * fork and exec downgrade every SAN connection to kernel TCP first (`downgrade`,
//!   `docs/ARCHITECTURE.md` "fork and exec"): exact, counted, one round trip. An idle peer
//!   answers through its nudge responder (`nudge`); one that cannot answer for a second
//!   (stopped, or a verbs peer on another host that makes no call) leaves that connection
//!   with the parent (it downgrades when the peer calls) and the child's copy fails with
//!   `ECONNRESET`.
//!   `vfork` downgrades every SAN connection first (the child may pass any socket on) and
//!   its child's hook calls are the kernel calls alone; `posix_spawn` downgrades those the
//!   child receives, `system`/`popen` those without `FD_CLOEXEC` (their stashes stay
//!   here). `execl*` exec through glibc's internal `execve`: a SAN socket they pass on
//!   without `FD_CLOEXEC` is not downgraded (the new program sees a TCP socket that carries
//!   nothing after the switch point).
//! * `sendfile`/`splice`/`*mmsg` on SAN sockets are emulated through a buffer.
//!
//! # Rendezvous (large zero-copy sends)
//! A *blocking* send of at least the negotiated threshold (4 MiB, the send buffer: smaller
//! sends are buffered as TCP would buffer them; `SANDIRECT_SAN_RENDEZVOUS=0`
//! turns it off) registers the application's buffer through the process-wide registration
//! cache (`registrations`) and moves it by the session's rendezvous: in READ mode the peer
//! copies it out with CMA (`process_vm_readv`), in WRITE mode (CMA not permitted) we copy it
//! through the segment's window into the sink the peer advertised. Over verbs the threshold
//! is 1 MiB and the peer RDMA-READs the buffer, or, when it does not offer reads
//! (iWARP by default, or `SANDIRECT_SAN_RDMA_READ=0`), we RDMA-WRITE it into its sink. The call returns when the
//! session reports the send complete (a short count is legal). A refused registration (over
//! verbs: `RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`) is `ENOBUFS` with nothing sent; the bytes
//! before and after it keep their order. Nonblocking sends always go inline.
//!
//! The receiver registers the application's buffer when the next bytes are a rendezvous
//! segment and receives min(buffer, remaining) bytes into it; `MSG_PEEK` reads them without
//! consuming them; a refused registration ends the rendezvous at what was consumed (the
//! sender gets a short count and sends the rest again, nothing is lost).
//!
//! While a rendezvous uses the application's buffer the call cannot return: a signal or an
//! `SO_SNDTIMEO`/`SO_RCVTIMEO` deadline during one is acted on only once it completed, and a
//! nonblocking read that meets a rendezvous segment waits for that one transfer (in READ mode
//! a local copy).
//! * Two ends in one process: a thread about to sleep (blocking call, poll, epoll, select)
//!   first drives the other end, since it may be the only thread that ever would.

mod downgrade;
mod exchange;
mod io;
mod link;
mod nudge;
mod registrations;
mod socket;
mod stash;
mod verbs;

use core::ffi::c_int;
use core::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

pub use downgrade::{adopt_stashes, downgrade_all, stash_env, FORK_BUDGET};
pub(crate) use downgrade::{pass_on, stash_of};
pub use io::{
    assist_all_in_process, correct_epoll_events, poll_fds, readable_bytes, recv_iov,
    select_via_poll, send_iov, service_all, RawBuf,
};
pub(crate) use verbs::settle_all_owed;

use crate::discovery::{
    ConnectionKey, ListenerMarker, NegativeCache, NegativeCacheConfig, PeerKind, SegmentDir,
};
use crate::fdtable::FdEntry;
use crate::record::{flags, Bypass, DataPath, SocketRecord};
use crate::registry::registry;
use crate::settings::ProviderChoice;
use socket::{SanSocket, SetupError};

/// What the slot of a socket record holds.
#[derive(Debug)]
enum SanObject {
    /// A listening socket's published marker.
    Marker(ListenerMarker),
    /// A connected socket on (or about to switch to) the SAN.
    Socket(Box<SanSocket>),
    /// A downgraded socket whose stash still holds bytes received over the SAN.
    Stashed(Box<downgrade::Stashed>),
}

type Slot = Mutex<Option<SanObject>>;

const SLOTS_PER_CHUNK: usize = 1024;
const CHUNKS: usize = crate::registry::MAX_CHUNKS;

/// Slot chunks, allocated on first use and never freed (record indices are reused, so the
/// number of slots is bounded by the most sockets ever open at once).
static SLOT_CHUNKS: [AtomicPtr<Slot>; CHUNKS] =
    [const { AtomicPtr::new(core::ptr::null_mut()) }; CHUNKS];

/// Sockets with a SAN object (pending or switched): while zero, poll/select pay nothing.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Counters of the SAN path (process-wide, for diagnostics and tests).
#[derive(Debug, Default)]
pub struct SanCounters {
    /// Connections that switched to the SAN (both sides count).
    pub switched: AtomicU64,
    /// Client connections that stayed on TCP because the server is plain (probe or cache).
    pub peer_plain: AtomicU64,
    /// Of those, answered by the negative cache without a probe.
    pub plain_cached: AtomicU64,
    /// Set-ups or switches that failed on a resource and fell back to TCP.
    pub fallbacks: AtomicU64,
    /// Connections moved back to kernel TCP live (fork, exec, or the peer's).
    pub downgraded: AtomicU64,
}

static COUNTERS: SanCounters = SanCounters {
    switched: AtomicU64::new(0),
    peer_plain: AtomicU64::new(0),
    plain_cached: AtomicU64::new(0),
    fallbacks: AtomicU64::new(0),
    downgraded: AtomicU64::new(0),
};

/// The process-wide counters.
pub fn counters() -> &'static SanCounters {
    &COUNTERS
}

fn slot(index: u32) -> &'static Slot {
    let chunk_index = (index as usize / SLOTS_PER_CHUNK).min(CHUNKS - 1);
    let chunk = &SLOT_CHUNKS[chunk_index];
    let mut base = chunk.load(Ordering::Acquire);
    if base.is_null() {
        let fresh: Box<[Slot]> = (0..SLOTS_PER_CHUNK).map(|_| Mutex::new(None)).collect();
        let fresh = Box::into_raw(fresh).cast::<Slot>();
        match chunk.compare_exchange(
            core::ptr::null_mut(),
            fresh,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => base = fresh,
            Err(winner) => {
                // SAFETY: `fresh` came from Box::into_raw of a slice of this length just
                // above and was never published.
                drop(unsafe {
                    Box::from_raw(core::ptr::slice_from_raw_parts_mut(fresh, SLOTS_PER_CHUNK))
                });
                base = winner;
            }
        }
    }
    // SAFETY: `base` points to SLOTS_PER_CHUNK slots that are never freed; the offset is
    // reduced modulo the chunk size.
    unsafe { &*base.add(index as usize % SLOTS_PER_CHUNK) }
}

fn lock(index: u32) -> MutexGuard<'static, Option<SanObject>> {
    slot(index)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Process-wide SAN resources, created on first use.
struct Provider {
    /// The process-wide domain and registration cache.
    registrations: registrations::SharedRegistrations,
    negative: NegativeCache,
    dir: PathBuf,
    /// Whether large blocking sends use the rendezvous (`SANDIRECT_SAN_RENDEZVOUS`).
    rendezvous: bool,
    /// Whether verbs connections offer to RDMA-READ their peers' rendezvous sends
    /// (`SANDIRECT_SAN_RDMA_READ`; `None`: the device's default, see [`rdma_read_offered`]).
    rdma_read: Option<bool>,
}

/// Whether this process offers rendezvous to its peers (the negotiated threshold is the
/// larger of both sides', so one side turning it off turns it off for the connection).
fn rendezvous_enabled() -> bool {
    provider().is_some_and(|p| p.rendezvous)
}

/// Whether this process's verbs connections offer READ-mode rendezvous on a device that can
/// read: `SANDIRECT_SAN_RDMA_READ` when set, else READ on RoCE and InfiniBand and WRITE on
/// iWARP, where the sink of a READ needs remote-write rights (a wider exposure than WRITE
/// mode's) and soft-iWARP moves READs far slower than WRITEs (1 MiB blocking sends over siw ran
/// at ~0.6x the WRITE mode's rate); over soft-RoCE both modes run at the inline path's rate
/// with a third of its CPU time. `iwarp`: the device follows iWARP's rules.
fn rdma_read_offered(iwarp: bool) -> bool {
    provider().and_then(|p| p.rdma_read).unwrap_or(!iwarp)
}

static PROVIDER: OnceLock<Option<Provider>> = OnceLock::new();

fn provider() -> Option<&'static Provider> {
    if !enabled() {
        return None;
    }
    PROVIDER
        .get_or_init(|| {
            let override_dir = crate::settings::shm_dir();
            match SegmentDir::open(override_dir.as_deref()) {
                Ok(dir) => Some(Provider {
                    registrations: registrations::SharedRegistrations::new(
                        san_shm::ShmDomain::new(san_shm::DomainConfig::default()),
                    ),
                    negative: NegativeCache::new(NegativeCacheConfig::default()),
                    dir: dir.path().to_path_buf(),
                    rendezvous: crate::settings::rendezvous_allowed(),
                    rdma_read: crate::settings::rdma_read(),
                }),
                Err(error) => {
                    tracing::warn!(%error, "SAN segment directory unusable; staying on TCP");
                    None
                }
            }
        })
        .as_ref()
}

/// Whether the SAN path is enabled (not turned off with `SANDIRECT_SAN=0`).
pub fn enabled() -> bool {
    crate::settings::san_enabled()
}

/// The SAN slot index of `entry` when its socket has a SAN object (the data-path check:
/// one flag load for tracked sockets).
#[inline]
pub fn san_index(entry: FdEntry) -> Option<u32> {
    let index = entry.socket_index()?;
    let record = registry().get(index)?;
    (record.flags() & flags::SAN != 0).then_some(index)
}

/// `listen()` succeeded on a tracked socket: publish the marker.
pub fn on_listen(fd: c_int, index: u32) {
    if provider().is_none() {
        return;
    }
    let mut slot = lock(index);
    if matches!(*slot, Some(SanObject::Marker(_))) {
        return;
    }
    // SAFETY: `fd` is the listening socket the application just passed to listen().
    let listener = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    match ListenerMarker::publish_for_listener(listener) {
        Ok(marker) => *slot = Some(SanObject::Marker(marker)),
        Err(error) => tracing::debug!(fd, %error, "listener marker not published"),
    }
}

/// Sockets by segment name, for connections whose two ends are both in this process.
static BY_NAME: Mutex<Vec<(String, u32)>> = Mutex::new(Vec::new());

fn by_name() -> MutexGuard<'static, Vec<(String, u32)>> {
    BY_NAME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The other socket of an in-process connection named `name`.
fn in_process_peer(name: &crate::discovery::SegmentName, index: u32) -> Option<u32> {
    by_name()
        .iter()
        .find(|(n, i)| *i != index && n == name.as_str())
        .map(|&(_, i)| i)
}

/// How many entries of [`BY_NAME`] share their name with another (sockets whose peer is in
/// this process). Kept exact under the `BY_NAME` lock so that waits in processes without
/// in-process connections (every real application) skip the name list entirely.
static PAIRED: AtomicUsize = AtomicUsize::new(0);

/// Sockets whose peer is in this process (both ends listed by name), or `None` when there
/// are none (the common case: one atomic load, no lock, no allocation).
fn in_process_indices() -> Option<Vec<u32>> {
    if PAIRED.load(Ordering::Acquire) == 0 {
        return None;
    }
    let names = by_name();
    let paired: Vec<u32> = names
        .iter()
        .filter(|(name, index)| names.iter().any(|(n, i)| i != index && n == name))
        .map(|&(_, index)| index)
        .collect();
    (!paired.is_empty()).then_some(paired)
}

/// How many entries become paired when one joins the entries named `name` (or
/// unpaired when one leaves them): a first partner pairs both.
fn pairing_change(names: &[(String, u32)], name: &str) -> usize {
    match names.iter().filter(|(n, _)| n == name).count() {
        0 => 0,
        1 => 2,
        _ => 1,
    }
}

/// Removes socket `index` from the name list, keeping [`PAIRED`] exact.
fn remove_name(names: &mut Vec<(String, u32)>, index: u32) {
    let Some(position) = names.iter().position(|&(_, i)| i == index) else {
        return;
    };
    let (name, _) = names.swap_remove(position);
    PAIRED.fetch_sub(pairing_change(names, &name), Ordering::AcqRel);
}

/// Forgets the name of socket `index` (its SAN object is gone).
fn forget_name(index: u32) {
    remove_name(&mut by_name(), index);
}

fn install(index: u32, record: &'static SocketRecord, socket: SanSocket) {
    if socket.is_intra_host() {
        // A fork in the peer process needs our answer even while the application is idle.
        nudge::ensure_responder();
    }
    {
        let mut names = by_name();
        remove_name(&mut names, index);
        let name = socket.name.as_str();
        let paired = pairing_change(&names, name);
        names.push((name.to_owned(), index));
        PAIRED.fetch_add(paired, Ordering::AcqRel);
    }
    *lock(index) = Some(SanObject::Socket(Box::new(socket)));
    record.set_flag(flags::SAN, true);
    LIVE.fetch_add(1, Ordering::Relaxed);
}

/// What [`before_connect`] decided for a client socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClientPlan {
    /// Not a SAN candidate (disabled, rules, not a fresh TCP client).
    Skip,
    /// The server is not preloaded (probe or negative cache): plain TCP.
    PeerPlain,
    /// A pending SAN socket was set up; it stays if the connect goes ahead.
    Pending,
    /// Setting up failed on a resource: plain TCP.
    Failed,
}

/// The source address the kernel will pick for a connection to `peer` (the routing decision
/// of a connected UDP socket, which sends nothing).
fn route_source(peer: SocketAddr) -> Option<std::net::IpAddr> {
    let domain = if peer.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2).
    let raw = unsafe { libc::socket(domain, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return None;
    }
    // SAFETY: `raw` was just returned by socket() and is owned by nobody else.
    let socket = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    let (storage, len) = crate::discovery::socket_addr_to_raw(peer);
    // SAFETY: `storage` holds a valid address of length `len`.
    let rc = unsafe { libc::connect(raw, (&storage as *const libc::sockaddr_storage).cast(), len) };
    if rc != 0 {
        return None;
    }
    let local = socket_name(std::os::fd::AsRawFd::as_raw_fd(&socket))?;
    Some(local.ip())
}

fn socket_name(fd: c_int) -> Option<SocketAddr> {
    // SAFETY: zeroed storage is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { core::mem::zeroed() };
    let mut len = core::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `storage`.
    if unsafe {
        crate::real::getsockname(
            fd,
            (&mut storage as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    } != 0
    {
        return None;
    }
    crate::discovery::socket_addr_from_raw(&storage, len).ok()
}

/// Before a TCP client's `connect()` to `peer`: if the server is a preloaded local listener,
/// fix the local address now (binding an unbound socket to the route's source address and an
/// ephemeral port), so the connection key is known, and set up the exchange listener and the
/// segment *before* the SYN leaves. The acceptor attaches inside `accept()`, which may run
/// before our `connect()` returns, and must find them there.
pub fn before_connect(
    fd: c_int,
    index: u32,
    record: &'static SocketRecord,
    peer: SocketAddr,
) -> ClientPlan {
    let Some(provider) = provider() else {
        return ClientPlan::Skip;
    };
    if crate::settings::decide(crate::config::Role::Client, Some(peer)) != Bypass::None
        || record.flags() & flags::SAN != 0
    {
        return ClientPlan::Skip;
    }
    // Same host (a listener marker answers): shared memory. Otherwise, when a device serves
    // the route's source address: verbs (`verbs::client`).
    let mode = crate::settings::provider_choice();
    let kind = if mode == ProviderChoice::Verbs {
        PeerKind::Plain
    } else {
        provider.negative.probe(peer)
    };
    let via_verbs = kind != PeerKind::Preloaded
        && mode != ProviderChoice::Shm
        && route_source(peer).and_then(verbs::domain_for).is_some();
    if kind != PeerKind::Preloaded && !via_verbs {
        COUNTERS.peer_plain.fetch_add(1, Ordering::Relaxed);
        if kind == PeerKind::PlainCached {
            COUNTERS.plain_cached.fetch_add(1, Ordering::Relaxed);
        }
        return ClientPlan::PeerPlain;
    }
    let Some(mut local) = socket_name(fd) else {
        return ClientPlan::Failed;
    };
    if local.ip().is_unspecified() {
        let Some(source) = route_source(peer) else {
            return ClientPlan::Failed;
        };
        if local.port() == 0 {
            let (storage, len) = crate::discovery::socket_addr_to_raw(SocketAddr::new(source, 0));
            // SAFETY: `storage` holds a valid address of length `len`.
            let rc = unsafe {
                crate::real::bind(fd, (&storage as *const libc::sockaddr_storage).cast(), len)
            };
            if rc != 0 {
                return ClientPlan::Failed;
            }
            match socket_name(fd) {
                Some(bound) => local = bound,
                None => return ClientPlan::Failed,
            }
        } else {
            local = SocketAddr::new(source, local.port());
        }
    }
    let name = ConnectionKey::from_connecting_side(local, peer).segment_name();
    if via_verbs {
        return match verbs::client(fd, local, peer) {
            Some(link) => {
                tracing::debug!(fd, %local, %peer, "pending verbs SAN client");
                install(index, record, SanSocket::verbs_client(record, &name, link));
                record
                    .path
                    .store(DataPath::SanVerbs as u32, Ordering::Release);
                ClientPlan::Pending
            }
            None => {
                COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
                ClientPlan::Failed
            }
        };
    }
    match SanSocket::client(record, &provider.dir, &name, &provider.registrations) {
        Ok(socket) => {
            tracing::debug!(fd, %name, "pending SAN client");
            install(index, record, socket);
            // The connection is on the SAN path from here (its first bytes cross on TCP by
            // design, as the acceptor's first reads do); the fallbacks set TCP again.
            record
                .path
                .store(DataPath::SanShm as u32, Ordering::Release);
            ClientPlan::Pending
        }
        Err(_) => {
            COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
            ClientPlan::Failed
        }
    }
}

/// After the `connect()` that [`before_connect`] prepared for: keeps the pending socket if the
/// connection is established or in progress, else removes it; records why TCP was chosen.
pub fn after_connect(
    index: u32,
    record: &'static SocketRecord,
    plan: ClientPlan,
    connecting: bool,
) {
    match plan {
        ClientPlan::Pending if !connecting => {
            if let Some(SanObject::Socket(socket)) = lock(index).take() {
                drop(socket);
                LIVE.fetch_sub(1, Ordering::Relaxed);
                forget_name(index);
            }
            record.set_flag(flags::SAN, false);
            record.path.store(DataPath::Tcp as u32, Ordering::Release);
        }
        ClientPlan::PeerPlain if connecting => {
            record
                .bypass
                .store(Bypass::PeerNotCapable as u32, Ordering::Release);
        }
        ClientPlan::Failed if connecting => {
            record
                .bypass
                .store(Bypass::NoProvider as u32, Ordering::Release);
        }
        _ => {}
    }
}

/// `accept()` returned `fd` from a listener with a published marker: attach if the client
/// created a segment.
pub fn on_accepted(listener_index: u32, fd: c_int, index: u32, record: &'static SocketRecord) {
    let Some(provider) = provider() else { return };
    if record.bypass() != Bypass::None
        || !matches!(*lock(listener_index), Some(SanObject::Marker(_)))
    {
        return;
    }
    let (Some(local), Some(peer)) = record.addresses() else {
        return;
    };
    let name = ConnectionKey::from_accepting_side(local, peer).segment_name();
    let mode = crate::settings::provider_choice();
    let shm = if mode == ProviderChoice::Verbs {
        Err(SetupError::PeerPlain)
    } else {
        SanSocket::acceptor(record, &provider.dir, &name, &provider.registrations)
    };
    let accepted = match shm {
        // Not a same-host client: a cross-host one, if a device serves this address.
        Err(SetupError::PeerPlain) if mode != ProviderChoice::Shm => {
            match verbs::acceptor(local, peer) {
                Ok(link) => SanSocket::verbs_acceptor(record, &name, link),
                Err(verbs::AcceptorError::PeerPlain) => Err(SetupError::PeerPlain),
                Err(verbs::AcceptorError::Resource) => Err(SetupError::Resource),
            }
        }
        other => other,
    };
    match accepted {
        Ok(mut socket) => {
            // The marker goes out now, before accept() returns: the application watches the
            // mirror from now on, and a pending client's TCP bytes only become visible there
            // once the client switched, which the marker makes it do at its next call.
            socket.wake_pending_client(fd);
            tracing::debug!(fd, %name, "accepted over the SAN");
            COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
            install(index, record, socket);
            if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
                verbs::watch_socket(index, socket);
            }
        }
        Err(SetupError::PeerPlain) => {
            record
                .bypass
                .store(Bypass::PeerNotCapable as u32, Ordering::Release);
        }
        Err(SetupError::Resource) => {
            COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
            record
                .bypass
                .store(Bypass::SanResources as u32, Ordering::Release);
        }
    }
}

/// The last fd of socket `index` is gone: tear down its SAN object (graceful close bounded by
/// the linger time, or reset under `SO_LINGER` 0). `fd` is given when it is still open (a
/// `close()` in progress); after `dup2` over it the number already names another file.
pub fn on_released(index: u32, fd: Option<c_int>) {
    if orphaned(index) {
        return;
    }
    let taken = lock(index).take();
    match taken {
        Some(SanObject::Socket(mut socket)) => {
            LIVE.fetch_sub(1, Ordering::Relaxed);
            if socket.peer_in_process() {
                // The other end may only ever be driven by this thread: let it answer our
                // handshake so our FIN can follow (a close before it would be a reset).
                for _ in 0..3 {
                    socket.service();
                    io::assist_all_in_process();
                }
            }
            forget_name(index);
            let (abortive, linger) = fd.map_or((false, io::DEFAULT_LINGER), io::linger_of);
            socket.close(fd, abortive, linger);
        }
        Some(SanObject::Marker(marker)) => drop(marker),
        Some(SanObject::Stashed(stashed)) => {
            drop(stashed);
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
        None => {}
    }
}

/// The held slot locks of [`before_fork`], released in both processes after the fork.
pub struct ForkLocks(#[allow(dead_code)] Vec<MutexGuard<'static, Option<SanObject>>>);

/// Before `fork()`: downgrades every SAN connection to kernel TCP (exactly; see
/// `downgrade`), then locks every slot with a SAN object so no other thread is inside one
/// while the child's copy of memory is taken (the child could never unlock it).
pub fn before_fork() -> ForkLocks {
    downgrade::downgrade_all(None);
    let mut indices = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::SAN != 0 {
            indices.push(index);
        }
    });
    indices.sort_unstable();
    indices.dedup();
    // Ascending index order: the only place that holds several slot locks at once.
    ForkLocks(indices.into_iter().map(lock).collect())
}

/// A stash holder in an epoll set (see `downgrade::stashed_epoll_ctl`).
pub fn stashed_epoll_ctl(index: u32, epfd: c_int, op: c_int, events: u32, data: u64) {
    downgrade::stashed_epoll_ctl(index, epfd, op, events, data);
}

/// `shutdown()` on a SAN socket (after the real shutdown succeeded).
pub fn on_shutdown(fd: c_int, index: u32, how: c_int) {
    io::shutdown(fd, index, how);
}

/// fork child: the parent keeps the sessions (a session cannot be shared by two processes).
/// The child's inherited SAN sockets are marked `after-fork`; their I/O fails with
/// `ECONNRESET` and their close only closes the fd: the child never touches the shared
/// segment, the mutex (another thread may have held it at fork) or the peer's mirror.
/// Lock-free, and no syscall but closing the inherited nudge socket: runs in the atfork child
/// handler.
pub fn after_fork_in_child() {
    nudge::after_fork_in_child();
    registry().for_each_live(|_, record| {
        // A stash holder is plain TCP plus shared memory: it works in both processes.
        if record.flags() & flags::SAN != 0 && record.flags() & flags::STASHED == 0 {
            record
                .bypass
                .store(Bypass::AfterFork as u32, Ordering::Release);
        }
    });
}

fn orphaned(index: u32) -> bool {
    registry()
        .get(index)
        .is_none_or(|record| record.bypass() == Bypass::AfterFork)
}

/// The mirror end `M` of a switched SAN socket (what epoll watches in its place); a pending
/// client whose acceptor attached switches first.
pub fn mirror_of(fd: c_int, index: u32) -> Option<c_int> {
    if orphaned(index) {
        return None;
    }
    io::switch_pending(fd, index);
    match lock(index).as_mut() {
        Some(SanObject::Socket(socket))
            if socket.phase == socket::Phase::Switched && !socket.epoll_on_tcp =>
        {
            socket.set_watched();
            socket.mirror_fd()
        }
        _ => None,
    }
}

/// The application added, changed or removed an epoll registration of SAN socket `index`:
/// while one of them is edge-triggered, the peer raises the mirror on every arrival (the
/// kernel reports a new `EPOLLET` event for every segment that reaches a TCP socket, read or
/// not), otherwise only on the rising edge (no system call while data stays unread).
pub fn epoll_registrations_changed(index: u32) {
    let Some(record) = registry().get(index) else {
        return;
    };
    let edge_triggered = record
        .epoll_registrations()
        .any(|(_, events, _)| events & libc::EPOLLET as u32 != 0);
    if let Some(SanObject::Socket(socket)) = lock(index).as_ref() {
        socket.set_edge_per_arrival(edge_triggered);
    }
}

/// Number of sockets currently with a SAN object.
pub fn live_sockets() -> usize {
    LIVE.load(Ordering::Relaxed)
}
