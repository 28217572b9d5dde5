//! The SAN path of the interposer: connected TCP sockets carried by the switch's session
//! over the intra-host `shm` provider or, across hosts, RDMA verbs, with an exact
//! switch-over (see `docs/ARCHITECTURE.md`, "Discovery and the exact switch-over point").
//!
//! This file holds the lifecycle entry points (listen, connect, accept, release, shutdown,
//! fork) and re-exports the calls; the files below it are listed bottom-up at their `mod`
//! declarations.
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
//! * `accept()` on a marked listener notes whether the client made a segment ([`on_accepted`]);
//!   the connection's first use (in whichever process makes it: see `accept`) connects to the
//!   client's exchange, passes its mirror end and the words page, attaches, starts its session
//!   with `tcp_bytes_sent = 0` and writes the switch marker. The marker makes the client readable without data; a
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
//!   How many there are is bounded too: eight for each SAN connection must fit in half the
//!   soft limit (`budget`), so the application keeps at least the other half.
//! * An accepted connection that no call has used yet attaches in the process that uses it
//!   first, once no other process holds it (fork-per-connection servers keep the SAN); used
//!   while another copy is still open 20 ms later, or passed to another program first, it
//!   stays on TCP (`accept`).
//! * fork and exec downgrade every switched SAN connection to kernel TCP first (`downgrade`,
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
//! * `sendfile` into a SAN socket with an offset reads the file straight into the peer's
//!   receive slots (or the session's send buffer); without one, and `splice` and the
//!   `*mmsg` calls, are emulated through a buffer.
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
//! before and after it keep their order. Nonblocking sends always go inline, and so does a
//! buffer whose pages are not all readable (each is touched first, through the guarded copy of
//! `crate::fault`): the inline copy then answers `EFAULT` as the kernel does.
//!
//! The receiver registers the application's buffer when the next bytes are a rendezvous
//! segment and receives min(buffer, remaining) bytes into it; `MSG_PEEK` reads them without
//! consuming them; a refused registration ends the rendezvous at what was consumed (the
//! sender gets a short count and sends the rest again, nothing is lost). A buffer the segment
//! would land in that the process may not write is `EFAULT` before anything starts, the
//! segment left unread.
//!
//! While a rendezvous uses the application's buffer the call cannot return: a signal or an
//! `SO_SNDTIMEO`/`SO_RCVTIMEO` deadline during one is acted on only once it completed, and a
//! nonblocking read that meets a rendezvous segment waits for that one transfer (in READ mode
//! a local copy).
//! * Two ends in one process: a thread about to sleep (blocking call, poll, epoll, select)
//!   first drives the other end, since it may be the only thread that ever would.

// The files, bottom-up: each imports only from the groups above its own.
// The ground: kernel calls, tunables, the memory budget, ephemeral ports, the epoll index,
// the exchange, the servers' connection history, registrations, stashes, nudges, the stream
// operations' typed result.
mod budget;
mod ephemeral;
mod epoll_index;
mod exchange;
mod history;
mod kernel;
mod nudge;
mod other_users;
mod outcome;
mod registrations;
mod stash;
mod tunables;
mod unclaimed;

// Process-wide shm resources, the stash holder, the verbs adapter.
mod provider;
mod stashed;
mod verbs;

// The connection under a session, then the socket (one `impl` file per concern).
mod link;

mod socket;

// The slot table of SAN objects, the lazy removal of epoll registrations, then the
// background threads that walk the table.
mod table;

/// Output interest kept in user space (`EPOLLOUT` asked for around every write).
mod epoll_output;
mod epoll_removal;

mod service;

// The switch-over and epoll moves, then blocking.
mod switchover;

mod wait;

// Accepted connections: attached at their first use, in the process that uses them.
mod accept;

// Moving connections back to kernel TCP (fork, exec).
mod downgrade;

// The calls: reading, sending, readiness.
mod readiness;
mod recv;
mod send;

// Unit tests of the socket path over a simulated link, in-process.
#[cfg(test)]
mod in_process_tests;

use core::ffi::c_int;
use core::sync::atomic::Ordering;
use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::MutexGuard;

pub use downgrade::{adopt_stashes, stash_env};
pub(crate) use downgrade::{pass_on, stash_of};
pub use epoll_output::{
    begin_wait as begin_epoll_wait, instance_created as epoll_instance_created,
    instance_gone as epoll_instance_gone, instances_shared as epoll_instances_shared,
    merge as merge_ready_outputs, ready_outputs, ReadyOutput, Waiting as EpollWaiting,
    REPORTED_PER_WAIT,
};
pub use epoll_removal::{any_removed, before_registering, epoll_ctl_on_mirror, Handled};
pub use kernel::RawBuf;
pub use outcome::SanCall;
pub use provider::enabled;
pub use readiness::{
    correct_epoll_events, hand_out_input, look_for_messages, look_for_news, lower_deferred,
    poll_fds, readable_bytes, select_pollfds, select_results, unpoll_fds, Deferred, Looked,
    Swapped,
};
pub use recv::recv_iov;
pub use send::{send_file_in_place, send_iov};
pub use service::service_all;
pub(crate) use service::settle_all_owed;
pub use switchover::assist_all_in_process;
pub use table::{counters, live_sockets, SanCounters};
pub use tunables::FORK_BUDGET;

use crate::discovery::{ConnectionKey, ListenerMarker};
use crate::negative_cache::PeerKind;
use crate::record::{flags, Bypass, DataPath, SocketRecord};
use crate::registry::registry;
use crate::settings::ProviderChoice;
use kernel::{route_source, socket_name};
use provider::provider;
use socket::{SanSocket, SocketSetupError};
use table::{forget_name, lock, orphaned, SanObject, COUNTERS, LIVE};

/// The SAN slot index of `entry` when its socket has a SAN object (the data-path check: one
/// flag load for tracked sockets). An accepted connection no call has used yet is claimed
/// first (`accept::claim`): this call is its first use.
#[inline]
pub fn san_index(entry: crate::fdtable::FdEntry) -> Option<u32> {
    let index = entry.socket_index()?;
    let record = registry().get(index)?;
    let record_flags = record.flags();
    if record_flags & flags::SAN != 0 {
        return Some(index);
    }
    if record_flags & flags::UNCLAIMED == 0 {
        return None;
    }
    accept::claim(index, record).then_some(index)
}

/// The SAN slot index of `entry` when its socket has a SAN object, without claiming an
/// unclaimed accepted connection (for a descriptor about to be closed).
pub fn attached_index(entry: crate::fdtable::FdEntry) -> Option<u32> {
    table::san_index(entry)
}

/// The SAN slot index of `entry` when its socket has a SAN object or is an unclaimed accepted
/// connection, without claiming it (for a descriptor about to leave the process).
pub fn san_or_unclaimed_index(entry: crate::fdtable::FdEntry) -> Option<u32> {
    let index = entry.socket_index()?;
    let record = registry().get(index)?;
    (record.flags() & (flags::SAN | flags::UNCLAIMED) != 0).then_some(index)
}

/// Before an exec: lets go of the unclaimed accepted connections that do not survive it (see
/// `accept::release_unclaimed_at_exec`).
pub fn release_unclaimed_at_exec(survives: &dyn Fn(c_int) -> bool) {
    accept::release_unclaimed_at_exec(survives);
}

/// Moves the SAN connections whose descriptor `only` accepts (`None`: all) back to kernel TCP
/// (exec, spawn, vfork, a descriptor sent to another process), and leaves such unclaimed
/// accepted connections on TCP: another program will use them as they are.
pub fn downgrade_all(only: Option<&dyn Fn(c_int) -> bool>) {
    accept::give_up_unclaimed(only);
    downgrade::downgrade_connections(only);
}

/// At exit: removes this process's nudge socket file from the segment directory.
pub fn at_exit() {
    if ever_used() {
        service::at_exit();
    }
}

/// `listen()` succeeded on a tracked socket: publish the marker.
pub fn on_listen(fd: c_int, index: u32) {
    let Some(provider) = provider() else {
        return;
    };
    let mut slot = lock(index);
    if matches!(*slot, Some(SanObject::Marker(_))) {
        return;
    }
    // SAFETY: `fd` is the listening socket the application just passed to listen().
    let listener = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    match ListenerMarker::publish_for_listener(listener, Some(&provider.dir)) {
        Ok(marker) => {
            *slot = Some(SanObject::Marker(marker));
            // Accepting reads the peer's address out of the application's buffer (one
            // `getpeername` less per connection): guarded, as every read of its memory.
            crate::fault::arm();
        }
        Err(error) => tracing::debug!(fd, %error, "listener marker not published"),
    }
}

/// What [`before_connect`] decided for a client socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClientPlan {
    /// Not a SAN candidate (disabled, rules, not a fresh TCP client).
    Skip,
    /// The server is not preloaded (probe or negative cache): plain TCP.
    PeerPlain,
    /// The server is preloaded by another user: plain TCP.
    PeerOtherUser,
    /// Only verbs could carry the connection and its library is missing: plain TCP.
    NoVerbsLibrary,
    /// A pending SAN socket was set up; it stays if the connect goes ahead.
    Pending,
    /// The server is preloaded, but this process's recent connections to it were too short
    /// to pay for the SAN set-up (see `history`): plain TCP.
    ShortConnections,
    /// Setting up failed: plain TCP.
    Failed,
    /// This process had not the descriptors (or the SAN memory) the set-up needs: plain TCP.
    Resources,
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
    if !provider::enabled()
        || crate::settings::decide(crate::config::Role::Client, Some(peer)) != Bypass::None
        || record.flags() & flags::SAN != 0
    {
        return ClientPlan::Skip;
    }
    let Some(provider) = provider() else {
        // The SAN is on, but this process could not make its resources (an unusable segment
        // directory, logged once): the connection says so (`no-provider`), not nothing.
        return ClientPlan::Failed;
    };
    if history::predicts_short(peer) {
        return ClientPlan::ShortConnections;
    }
    // Same host (a listener marker answers): shared memory. Otherwise, when a device serves
    // the route's source address: verbs (`verbs::connect::client`).
    let mode = crate::settings::provider_choice();
    let kind = if mode == ProviderChoice::Verbs {
        PeerKind::Plain
    } else {
        provider.negative.probe(peer, Some(provider.dir.as_fd()))
    };
    let through_dir = kind == PeerKind::PreloadedThroughDirectory;
    // A server of another user's, and this process's policy names other users: a segment
    // private to the connection (see `other_users`).
    let private = kind == PeerKind::OtherUser && other_users::enabled();
    let kind = if through_dir || private {
        PeerKind::Preloaded
    } else {
        kind
    };
    // The library's state first: on a host without RDMA devices it is known after the first
    // connection, and the route lookup (four system calls) is not made.
    let via_verbs = kind != PeerKind::Preloaded
        && mode != ProviderChoice::Shm
        && verbs::library_loaded()
        && route_source(peer).and_then(verbs::domain_for).is_some();
    if kind == PeerKind::Unknown {
        COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
        return ClientPlan::Resources;
    }
    if kind != PeerKind::Preloaded && !via_verbs {
        COUNTERS.peer_plain.fetch_add(1, Ordering::Relaxed);
        if kind == PeerKind::PlainCached {
            COUNTERS.plain_cached.fetch_add(1, Ordering::Relaxed);
        }
        if kind == PeerKind::OtherUser {
            return ClientPlan::PeerOtherUser;
        }
        // Verbs could have carried it and its library is missing; on a host without RDMA
        // devices under `auto` nothing is missing: the peer is plain.
        if mode != ProviderChoice::Shm
            && !verbs::library_loaded()
            && (mode == ProviderChoice::Verbs || !verbs::host_has_no_devices())
        {
            return ClientPlan::NoVerbsLibrary;
        }
        return ClientPlan::PeerPlain;
    }
    // The process's SAN memory budget: past it the connection stays on TCP.
    let charge = if via_verbs {
        budget::charge_verbs()
    } else {
        budget::charge_shm()
    };
    let Some(charge) = charge else {
        COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
        return ClientPlan::Resources;
    };
    let Some(mut local) = socket_name(fd) else {
        return ClientPlan::Failed;
    };
    if local.ip().is_unspecified() {
        let Some(source) = route_source(peer) else {
            return ClientPlan::Failed;
        };
        if local.port() == 0 {
            if !ephemeral::bind_ephemeral(fd, source) {
                // The port range is (nearly) full: TCP's own choice may reuse a port.
                COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
                return ClientPlan::Resources;
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
        return match verbs::connect::client(fd, local, peer, service::start) {
            Some(link) => {
                tracing::debug!(fd, %local, %peer, "pending verbs SAN client");
                accept::install(
                    index,
                    record,
                    SanSocket::verbs_client(record, &name, link, charge),
                );
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
    let made = if private {
        // (An acceptor of another user cannot read our pending-ports table.)
        SanSocket::client_private(record, &name, &provider.registrations, charge)
    } else {
        // Before the SYN leaves: the acceptor looks here before it probes our exchange.
        let pending = provider
            .pending
            .as_ref()
            .map(|table| table.mark(local.port()));
        SanSocket::client(
            record,
            provider.dir.handle(),
            &name,
            &provider.registrations,
            charge,
            pending,
            through_dir,
        )
    };
    match made {
        Ok(socket) => {
            tracing::debug!(fd, %name, "pending SAN client");
            accept::install(index, record, socket);
            // The connection is on the SAN path from here (its first bytes cross on TCP by
            // design, as the acceptor's first reads do); the fallbacks set TCP again.
            record
                .path
                .store(DataPath::SanShm as u32, Ordering::Release);
            ClientPlan::Pending
        }
        Err(error) => {
            COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
            if error == SocketSetupError::Resource {
                ClientPlan::Resources
            } else {
                ClientPlan::Failed
            }
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
        ClientPlan::PeerOtherUser if connecting => {
            record
                .bypass
                .store(Bypass::PeerOtherUser as u32, Ordering::Release);
        }
        ClientPlan::ShortConnections if connecting => {
            record
                .bypass
                .store(Bypass::ShortConnections as u32, Ordering::Release);
        }
        ClientPlan::NoVerbsLibrary if connecting => {
            record
                .bypass
                .store(Bypass::NoVerbsLibrary as u32, Ordering::Release);
        }
        ClientPlan::Failed if connecting => {
            record
                .bypass
                .store(Bypass::NoProvider as u32, Ordering::Release);
        }
        ClientPlan::Resources if connecting => {
            record
                .bypass
                .store(Bypass::SanResources as u32, Ordering::Release);
        }
        _ => {}
    }
}

/// `accept()` returned `fd` from a listener with a published marker: a SAN client's
/// connection attaches at its first use (shm) or now (verbs), see `accept`.
pub fn on_accepted(listener_index: u32, fd: c_int, index: u32, record: &'static SocketRecord) {
    accept::on_accepted(listener_index, fd, index, record);
}

/// The last fd of socket `index` is gone: tear down its SAN object (graceful close bounded by
/// the linger time, or reset under `SO_LINGER` 0). `fd` is given when it is still open (a
/// `close()` in progress); after `dup2` over it the number already names another file.
pub fn on_released(index: u32, fd: Option<c_int>) {
    if let Some(record) = registry().get(index) {
        history::note_released(record);
    }
    if orphaned(index) {
        return;
    }
    let taken = lock(index).take();
    epoll_index::forget(index);
    match taken {
        Some(SanObject::Socket(mut socket)) => {
            LIVE.fetch_sub(1, Ordering::Relaxed);
            if socket.peer_in_process() {
                // The other end may only ever be driven by this thread: let it answer our
                // handshake so our FIN can follow (a close before it would be a reset).
                for _ in 0..3 {
                    socket.service();
                    switchover::assist_all_in_process();
                }
            }
            forget_name(index);
            // The mirror may outlive the socket (a child forked before its exec holds a
            // copy): registrations the application removed must not outlive it in the kernel.
            if let (Some(record), Some(mirror)) = (registry().get(index), socket.mirror_fd()) {
                epoll_removal::remove_all_from_kernel(record, mirror);
            }
            let (abortive, linger) = fd.map_or((false, kernel::DEFAULT_LINGER), kernel::linger_of);
            socket.close(fd, abortive, linger);
        }
        Some(SanObject::Marker(marker)) => drop(marker),
        Some(SanObject::Unclaimed(unclaimed)) => {
            if let Some(record) = registry().get(index) {
                record.set_flag(flags::UNCLAIMED, false);
            }
            accept::release(&unclaimed);
        }
        Some(SanObject::Stashed(stashed)) => {
            drop(stashed);
            LIVE.fetch_sub(1, Ordering::Relaxed);
        }
        None => {}
    }
}

/// The held slot locks of [`before_fork`], released in both processes after the fork.
pub struct ForkLocks(
    #[allow(dead_code)] MutexGuard<'static, ()>,
    #[allow(dead_code)] Vec<MutexGuard<'static, Option<SanObject>>>,
);

/// Before `fork()`: downgrades every SAN connection to kernel TCP (exactly; see
/// `downgrade`), then locks every slot with a SAN object so no other thread is inside one
/// while the child's copy of memory is taken (the child could never unlock it).
pub fn before_fork() -> ForkLocks {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("before_fork");
    downgrade::downgrade_connections(None);
    // No connection becomes unclaimed between the count below and the fork (it would be
    // copied uncounted, and both processes could claim it).
    let accepting = accept::hold_accepting();
    let mut indices = accept::before_fork();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::SAN != 0 {
            indices.push(index);
        }
    });
    indices.sort_unstable();
    indices.dedup();
    // Ascending index order: the only place that holds several slot locks at once.
    ForkLocks(accepting, indices.into_iter().map(lock).collect())
}

/// Whether this process ever started setting up the SAN path (another thread may then
/// hold one of the locks [`with_library_locks`] takes).
pub fn ever_used() -> bool {
    provider::touched()
}

/// Runs `fork` (the real `fork()` and what the parent does before it lets go) with every
/// process-wide lock of the library held, so that no other thread is inside one when the
/// child's copy of memory is taken; both processes release them afterwards. Order: the slot
/// locks ([`before_fork`], taken first by the caller), the provider's initialisation, the
/// offer thread's list (`other_users`), the in-process name list, the shm registration cache,
/// the shm domain, the verbs provider's load — the order every other path takes them in (a
/// socket's lock before the offer list's and the cache's, the cache's before the domain's;
/// nobody waits for another lock while making a provider).
/// The verbs service's own locks are not taken: a fork child never uses verbs objects (they
/// belong to the process that loaded the library).
pub fn with_library_locks<R>(fork: impl FnOnce() -> R) -> R {
    let _init = provider::hold_init();
    let _offers = other_users::hold();
    let _names = table::by_name();
    let _epoll_index = epoll_index::hold();
    let registrations = provider::made().map(|provider| provider.registrations.lock());
    let last = || {
        let _verbs = verbs::hold_init();
        fork()
    };
    match registrations.as_ref().and_then(|r| r.domain()) {
        Some(domain) => domain.while_locked(last),
        None => last(),
    }
}

/// A stash holder in an epoll set (see `downgrade::stashed_epoll_ctl`).
pub fn stashed_epoll_ctl(index: u32, epfd: c_int, op: c_int, events: u32, data: u64) {
    downgrade::stashed_epoll_ctl(index, epfd, op, events, data);
}

/// `shutdown()` on a SAN socket (after the real shutdown succeeded).
/// The pending client's record flags carry it into the session at the switch.
pub fn on_shutdown(fd: c_int, index: u32, how: c_int) {
    if orphaned(index) {
        return;
    }
    switchover::switch_pending(fd, index);
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        if socket.phase == socket::Phase::Switched {
            if how != libc::SHUT_RD {
                socket.wake_pending_client(fd);
            }
            socket.shutdown(how);
        }
    }
}

/// fork child: the parent keeps the sessions (a session cannot be shared by two processes).
/// The child's inherited SAN sockets are marked `after-fork`; their I/O fails with
/// `ECONNRESET` and their close only closes the fd: the child never touches the shared
/// segment, the mutex (another thread may have held it at fork) or the peer's mirror.
/// Lock-free, and no syscall but closing the inherited nudge socket: runs in the atfork child
/// handler.
pub fn after_fork_in_child() {
    service::after_fork_in_child();
    registry().for_each_live(|_, record| {
        // A stash holder is plain TCP plus shared memory: it works in both processes.
        if record.flags() & flags::SAN != 0 && record.flags() & flags::STASHED == 0 {
            record
                .bypass
                .store(Bypass::AfterFork as u32, Ordering::Release);
        }
    });
}

/// The watched end of a switched SAN socket (what epoll watches in its place); a pending
/// client whose acceptor attached switches first.
pub fn mirror_of(fd: c_int, index: u32) -> Option<c_int> {
    #[cfg(test)]
    crate::guard::seam::panic_if_armed("mirror_of");
    if orphaned(index) {
        return None;
    }
    switchover::switch_pending(fd, index);
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
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        socket.registrations_changed(record);
    }
    epoll_index::update(index, record);
}

/// Epoll instance `epfd` was registered in another: the SAN sockets it watches give up lazy
/// lowering, and the registrations in it that the application removed leave the kernel now
/// (the outer instance would see `epfd` ready for their events).
pub fn epoll_instance_nested(epfd: c_int) {
    epoll_output::instance_nested(epfd);
    let mut watched = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::SAN != 0
            && record.kernel_registrations().any(|(e, _, _)| e == epfd)
        {
            watched.push(index);
        }
    });
    for index in watched {
        if !orphaned(index) {
            if let (Some(record), Some(SanObject::Socket(socket))) =
                (registry().get(index), lock(index).as_ref())
            {
                if let Some(mirror) = socket.mirror_fd() {
                    epoll_removal::remove_removed_in(record, epfd, mirror);
                }
            }
        }
        epoll_registrations_changed(index);
    }
}
