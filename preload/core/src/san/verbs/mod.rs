//! Cross-host SAN connections over RDMA verbs (`docs/ARCHITECTURE.md`, "Cross-host discovery
//! (verbs)").
//!
//! * The provider library is loaded lazily (`san-verbs-loader`: only when the host lists RDMA
//!   devices); a protection domain is opened per local IP address and cached (a failure too).
//! * A pending client listens with rdma_cm on its own address and TCP port before its SYN
//!   leaves ([`connect::client`]); the acceptor connects to it from inside `accept()` with the TCP
//!   4-tuple in the private data ([`connect::acceptor`]). A request naming another 4-tuple is
//!   rejected; a failed connect puts the client's address in a negative cache for 30 s.
//! * One service thread per process (`super::service`) sleeps in `epoll_wait` on what its
//!   [`watcher::Watcher`] holds: the pending clients' CM listeners (it accepts their requests here)
//!   and every switched connection's pollable fd (completion channel + CM channel). On an
//!   event it drives that socket's session under the socket's lock and raises the socket's
//!   own readiness mirror: the peer is remote and cannot write our raising end, so that thread does.
//!   This module is the adapter alone: it knows no SAN socket and runs no thread.
//!
//! This file holds the library, the domains and the negative cache, and a pending client's
//! attach point; [`link`] the connection under a socket's session ([`link::VerbsLink`]),
//! [`connect`] the set-up of one ([`connect::client`], [`connect::acceptor`]), [`watcher`]
//! what the service thread watches.
//! * Verbs objects are not used across `fork`: a child process does not use verbs at all
//!   (its inherited SAN sockets were downgraded to TCP before the fork).

pub(crate) mod connect;
pub(crate) mod link;
pub(crate) mod watcher;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use san_api::{Capabilities, SanDomain};
use san_verbs_loader::{
    ConnectParams, LoadError, LoadedConnection, LoadedDomain, LoadedListener, VerbsLibrary,
    VerbsSetupError,
};

use super::registrations::SharedRegistrations;
use super::tunables::{setup_timeout, VERBS_SLOTS};
use crate::discovery::canonical_addr;

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
    pub(super) registrations: SharedRegistrations,
    pub(super) caps: Capabilities,
}

impl Domain {
    /// Runs `f` on the loaded domain (under the registrations' lock: rdma_cm set-up and
    /// registrations of one device are serialized).
    pub(super) fn with<T>(
        &self,
        f: impl FnOnce(&mut LoadedDomain) -> Result<T, VerbsSetupError>,
    ) -> Result<T, VerbsSetupError> {
        let mut registrations = self.registrations.lock();
        let domain = registrations
            .verbs_domain()
            .ok_or(VerbsSetupError::Internal)?;
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

/// Held while [`VERBS`] is being made (the provider library loads), and across `fork()`: a
/// child must not inherit a load in progress. The load takes no other lock of ours.
static VERBS_INIT: Mutex<()> = Mutex::new(());

/// The load lock (see [`VERBS_INIT`]).
pub(super) fn hold_init() -> MutexGuard<'static, ()> {
    guard(&VERBS_INIT)
}

fn verbs() -> Option<&'static Verbs> {
    if crate::settings::provider_choice() == crate::settings::ProviderChoice::Shm
        || !crate::settings::san_enabled()
    {
        return None;
    }
    let _init = VERBS.get().is_none().then(hold_init);
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

/// Whether an RDMA provider library is loaded (loads it on first use).
pub(crate) fn library_loaded() -> bool {
    verbs().is_some()
}

/// Locks `mutex` (a poisoned lock is taken over).
pub(super) fn guard<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
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

pub(super) fn negative_hit(peer: IpAddr) -> bool {
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
pub(super) fn mark_negative(peer: IpAddr, host_level: bool) {
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

/// A connect to `peer` succeeded: its failures are forgotten.
pub(super) fn clear_negative(peer: IpAddr) {
    if let Some(verbs) = verbs() {
        guard(&verbs.negative).retain(|(addr, _, _)| *addr != peer);
    }
}

/// The set-up blob: which TCP connection this CM connection belongs to.
pub(super) fn tuple_blob(server: SocketAddr, client: SocketAddr) -> Vec<u8> {
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
pub(super) fn params(private_data: &[u8], local: Option<IpAddr>) -> ConnectParams<'_> {
    ConnectParams {
        private_data,
        timeout: setup_timeout(),
        local: local.map(|ip| SocketAddr::new(ip, 0)),
        ..ConnectParams::new(VERBS_SLOTS)
    }
}

/// Where a pending client's CM listener is.
pub(super) enum AttachState {
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
    pub(super) state: Mutex<AttachState>,
    pub(super) changed: Condvar,
    pub(super) listener: Mutex<Option<LoadedListener>>,
    /// The set-up blob a request for our connection carries ([`tuple_blob`]).
    pub(super) expected: Vec<u8>,
    pub(super) domain: &'static Domain,
}

impl Attach {
    /// The service thread: a request may be waiting on the listener.
    pub(super) fn on_listener_event(&self) {
        loop {
            let (request, blob) = {
                let mut listener = guard(&self.listener);
                let Some(listening) = listener.as_mut() else {
                    return;
                };
                match listening.next_request(Some(Duration::ZERO)) {
                    Ok(found) => found,
                    Err(VerbsSetupError::TimedOut) => return,
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
                Err(error @ (VerbsSetupError::Declined | VerbsSetupError::WrongDevice)) => {
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

    pub(super) fn abandon(&self) {
        *guard(&self.state) = AttachState::Done;
        self.changed.notify_all();
        *guard(&self.listener) = None;
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
