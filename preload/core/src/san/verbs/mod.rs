//! Cross-host SAN connections over RDMA verbs (`docs/ARCHITECTURE.md`, "Cross-host discovery
//! (verbs)").
//!
//! * The provider library is loaded lazily (`san-verbs-loader`: only when the host lists RDMA
//!   devices); a protection domain is opened per local IP address and cached (a failure too).
//! * A pending client listens with rdma_cm on its own address and TCP port before its SYN
//!   leaves ([`connect::client`]); the acceptor connects to it from inside `accept()` with the TCP
//!   4-tuple in the private data ([`connect::acceptor`]). A request naming another 4-tuple, or
//!   coming from another address than the TCP peer's, is rejected; a failed connect puts the
//!   client's address in a negative cache for 30 s.
//! * Anyone who reaches the client's CM port can send such a request, so a request wins
//!   nothing by coming first: the client accepts each (a few at most) with a random token of
//!   its own in its reply, and switches to the one whose token then arrives as the first
//!   bytes on TCP, which only the process that accepted the TCP connection can write there
//!   (the acceptor writes the token it got in place of the switch marker). Anything else
//!   first on TCP keeps the connection on TCP, every byte of it the application's.
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

use core::sync::atomic::{AtomicBool, Ordering};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use san_api::{Capabilities, SanDomain};
use san_verbs_loader::{
    ConnectParams, LoadError, LoadedConnection, LoadedDomain, LoadedListener, NoProviderReason,
    VerbsLibrary, VerbsSetupError,
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
/// Set-up request: magic (its last character the set-up's version), then family, address
/// and port of the server and of the client ([`setup_request`]).
const MAGIC: &[u8; 4] = b"SDV2";
/// A client's reply to a request is a token of this many random bytes: whoever writes it
/// back as the first bytes on TCP is the acceptor of this connection.
pub(super) const TOKEN_LEN: usize = 16;
pub(super) type Token = [u8; TOKEN_LEN];
/// The most requests a pending client holds at once (each a queue pair with its slots,
/// until the switch): more are rejected.
const MAX_CANDIDATES: usize = 4;

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

/// Set when the library was not loaded because the host lists no RDMA device (rather than
/// the library being missing or unusable).
static NO_DEVICES: AtomicBool = AtomicBool::new(false);

/// Held while [`VERBS`] is being made (the provider library loads), and across `fork()`: a
/// child must not inherit a load in progress. The load takes no other lock of ours.
static VERBS_INIT: Mutex<()> = Mutex::new(());

/// The load lock (see [`VERBS_INIT`]).
pub(super) fn hold_init() -> MutexGuard<'static, ()> {
    guard(&VERBS_INIT)
}

/// The verbs provider library to load: `SANDIRECT_VERBS_LIBRARY` when set, else the one
/// installed beside this library (the package puts both in one directory, and so does a
/// build), else `None`: the default name through the dynamic linker's search path.
fn provider_library() -> Option<std::path::PathBuf> {
    crate::settings::verbs_library().or_else(|| {
        let beside = crate::real::own_path()?
            .parent()?
            .join(san_verbs_loader::abi::LIBRARY_NAME);
        beside.is_file().then_some(beside)
    })
}

fn verbs() -> Option<&'static Verbs> {
    if crate::settings::provider_choice() == crate::settings::ProviderChoice::Shm
        || !crate::settings::san_enabled()
    {
        return None;
    }
    let _init = VERBS.get().is_none().then(hold_init);
    let verbs = VERBS
        .get_or_init(|| match VerbsLibrary::load(provider_library().as_deref()) {
            Ok(library) => Some(Verbs {
                library,
                pid: std::process::id(),
                domains: Mutex::new(Vec::new()),
                negative: Mutex::new(Vec::new()),
            }),
            Err(LoadError::NoProvider(reason)) => {
                tracing::debug!(?reason, "no RDMA provider: cross-host SAN off");
                if reason == NoProviderReason::NoDevices {
                    NO_DEVICES.store(true, Ordering::Relaxed);
                }
                None
            }
            Err(error) => {
                tracing::warn!(%error, "RDMA provider unusable: cross-host SAN off");
                None
            }
        })
        .as_ref()?;
    (verbs.pid == std::process::id()).then_some(verbs)
}

/// Whether an RDMA provider library is loaded (loads it on first use). Once the load was
/// tried this is an atomic load: on a host without RDMA devices (or with verbs off) the
/// verbs paths cost nothing more per connection.
pub(crate) fn library_loaded() -> bool {
    verbs().is_some()
}

/// Whether the library was not loaded only because the host has no RDMA device (so no
/// connection could have used it: nothing is missing).
pub(crate) fn host_has_no_devices() -> bool {
    !library_loaded() && NO_DEVICES.load(Ordering::Relaxed)
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

/// The set-up request: which TCP connection this CM connection is for (the acceptor's
/// private data; the client takes only a request that carries exactly its own).
pub(super) fn setup_request(server: SocketAddr, client: SocketAddr) -> Vec<u8> {
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

/// A fresh token from the kernel's random source (`None`: it has none to give yet).
fn fresh_token() -> Option<Token> {
    let mut token = [0u8; TOKEN_LEN];
    // SAFETY: getrandom(2) writes at most `TOKEN_LEN` bytes into `token`.
    let n = unsafe { libc::getrandom(token.as_mut_ptr().cast(), TOKEN_LEN, libc::GRND_NONBLOCK) };
    (n == TOKEN_LEN as isize).then_some(token)
}

/// The token in a client's reply (exactly [`TOKEN_LEN`] bytes, nothing else).
pub(super) fn token_of_reply(reply: &[u8]) -> Option<Token> {
    reply.try_into().ok()
}

/// What the first bytes on a pending client's TCP connection are, given the tokens of its
/// candidates (`head`: the bytes there, at most [`TOKEN_LEN`] looked at).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TokenMatch {
    /// Candidate `n`'s token: its acceptor committed to the SAN.
    Token(usize),
    /// The start of a candidate's token, but not all of it yet.
    Prefix,
    /// No candidate's token: what a plain server (or an acceptor that stayed on TCP) sent.
    Plain,
}

pub(super) fn match_token<'a>(
    head: &[u8],
    tokens: impl IntoIterator<Item = &'a Token>,
) -> TokenMatch {
    let mut prefix = false;
    for (n, token) in tokens.into_iter().enumerate() {
        if head.len() >= TOKEN_LEN && head[..TOKEN_LEN] == token[..] {
            return TokenMatch::Token(n);
        }
        prefix |= head.len() < TOKEN_LEN && token.starts_with(head);
    }
    if prefix {
        TokenMatch::Prefix
    } else {
        TokenMatch::Plain
    }
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

/// A CM request a pending client accepted: whose acceptor it is shows when its token
/// arrives on TCP.
pub(super) struct Candidate {
    /// What we sent in our reply.
    pub(super) token: Token,
    pub(super) state: CandidateState,
}

pub(super) enum CandidateState {
    /// Our reply is going out (the service thread is accepting it).
    Accepting,
    /// Our reply went out; the peer completes the handshake (or has).
    Replied(LoadedConnection),
    /// Accepting failed after our reply may have gone out: should this candidate's token
    /// arrive, its acceptor is committed and the connection must be reset.
    Failed,
}

/// The candidates of a pending client, and how its attach ended.
#[derive(Default)]
pub(super) struct Candidates {
    pub(super) list: Vec<Candidate>,
    /// We refused a request for our connection before replying (no resources to set it up,
    /// e.g. memory `RLIMIT_MEMLOCK` does not let us pin): its acceptor saw a rejection and
    /// keeps the connection on TCP, and so do we.
    pub(super) declined: bool,
    /// The switch took a candidate, or the socket went away: nothing more is accepted.
    pub(super) done: bool,
}

/// What the first bytes on a pending client's TCP connection say (see [`TokenMatch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// Nothing has arrived (or not enough to tell yet).
    Nothing,
    /// A candidate's token: switch.
    Token,
    /// Anything else, or the end of the stream: the connection stays on TCP.
    Plain,
}

/// A pending client's attach point, shared with the service thread.
pub(crate) struct Attach {
    pub(super) state: Mutex<Candidates>,
    pub(super) changed: Condvar,
    pub(super) listener: Mutex<Option<LoadedListener>>,
    /// The set-up request of our connection ([`setup_request`]).
    pub(super) expected: Vec<u8>,
    /// The TCP peer's address: a request from any other is not our acceptor's.
    pub(super) server: IpAddr,
    pub(super) domain: &'static Domain,
}

impl Attach {
    /// The service thread: requests may be waiting on the listener. Each that names our
    /// connection and comes from the TCP peer's address is accepted as a candidate, with a
    /// token of its own in our reply; the listener stays up for more (see [`Candidate`]).
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
            // Requests we do not take are rejected by their drop.
            if blob != self.expected {
                // Another connection's (ports are reused), or another version's.
                tracing::debug!("CM request for another connection rejected");
                continue;
            }
            let from = request.peer().map(|peer| canonical_addr(peer).ip());
            if from != Some(self.server) {
                tracing::debug!(?from, server = %self.server, "CM request from another address than the TCP peer rejected");
                continue;
            }
            let Some(token) = fresh_token() else {
                tracing::debug!("no random token for a CM request: rejected");
                continue;
            };
            {
                let mut state = guard(&self.state);
                if state.done {
                    return;
                }
                if state.list.len() >= MAX_CANDIDATES {
                    tracing::debug!("CM request beyond the candidates held rejected");
                    continue;
                }
                state.list.push(Candidate {
                    token,
                    state: CandidateState::Accepting,
                });
            }
            let accepted = self
                .domain
                .with(|domain| request.accept_started(domain, &params(&token, None)));
            let mut state = guard(&self.state);
            let Some(candidate) = state.list.iter_mut().find(|c| c.token == token) else {
                // The socket switched or went away meanwhile: the connection goes.
                drop(state);
                drop(accepted);
                continue;
            };
            match accepted {
                Ok(conn) => candidate.state = CandidateState::Replied(conn),
                Err(error @ (VerbsSetupError::Declined | VerbsSetupError::WrongDevice)) => {
                    tracing::debug!(?error, "declined a CM connect: its acceptor stays on TCP");
                    state.list.retain(|c| c.token != token);
                    state.declined = true;
                }
                Err(error) => {
                    tracing::debug!(?error, "accepting a CM connect failed after our reply");
                    candidate.state = CandidateState::Failed;
                }
            }
            self.changed.notify_all();
        }
    }

    /// Nothing more is accepted; the listener and every candidate go (their peers see a
    /// disconnect).
    pub(super) fn abandon(&self) {
        let candidates = {
            let mut state = guard(&self.state);
            state.done = true;
            core::mem::take(&mut state.list)
        };
        self.changed.notify_all();
        *guard(&self.listener) = None;
        drop(candidates);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_names_the_whole_tuple_and_fits_the_cm_limit() {
        let server: SocketAddr = "192.0.2.1:7000".parse().unwrap();
        let client: SocketAddr = "192.0.2.2:40000".parse().unwrap();
        let blob = setup_request(server, client);
        assert_eq!(&blob[..4], b"SDV2", "the set-up's version is in the magic");
        assert_eq!(
            &blob[4..],
            &[4, 192, 0, 2, 1, 0x1b, 0x58, 4, 192, 0, 2, 2, 0x9c, 0x40][..],
            "family, address and port (big-endian) of the server, then of the client"
        );
        assert_ne!(blob, setup_request(client, server));
        let mapped: SocketAddr = "[::ffff:192.0.2.1]:7000".parse().unwrap();
        assert_eq!(
            blob,
            setup_request(mapped, client),
            "v4-mapped folds to IPv4"
        );
        let v6: SocketAddr = "[2001:db8::1]:7000".parse().unwrap();
        let v6c: SocketAddr = "[2001:db8::2]:40000".parse().unwrap();
        let v6_blob = setup_request(v6, v6c);
        assert_eq!(v6_blob.len(), 4 + 2 * (1 + 16 + 2));
        assert!(v6_blob.len() <= san_verbs_loader::abi::MAX_PRIVATE_DATA);
    }

    #[test]
    fn a_reply_is_a_token_only_when_it_is_exactly_one() {
        let token: Token = core::array::from_fn(|i| i as u8);
        assert_eq!(token_of_reply(&token), Some(token));
        assert_eq!(token_of_reply(&token[..TOKEN_LEN - 1]), None);
        assert_eq!(token_of_reply(&[token.as_slice(), &[0]].concat()), None);
        assert_eq!(
            token_of_reply(&[]),
            None,
            "a client of the first version replies with nothing"
        );
        assert_ne!(fresh_token(), fresh_token(), "every candidate gets its own");
    }

    #[test]
    fn the_first_bytes_on_tcp_confirm_only_a_candidate_s_whole_token() {
        let hijacker: Token = [0xa5; TOKEN_LEN];
        let acceptor: Token = core::array::from_fn(|i| 0x10 + i as u8);
        let tokens = [hijacker, acceptor];
        // The acceptor's token, alone or followed by the first bytes of the stream.
        assert_eq!(match_token(&acceptor, &tokens), TokenMatch::Token(1));
        let mut longer = acceptor.to_vec();
        longer.extend_from_slice(b"HTTP/1.1 200 OK");
        assert_eq!(
            match_token(&longer[..TOKEN_LEN], &tokens),
            TokenMatch::Token(1)
        );
        // Part of a token: undecided until the rest arrives.
        assert_eq!(match_token(&acceptor[..5], &tokens), TokenMatch::Prefix);
        assert_eq!(match_token(&hijacker[..1], &tokens), TokenMatch::Prefix);
        // A plain server's greeting, or a token with one byte changed: not ours.
        assert_eq!(
            match_token(b"220 mail ESMTP\r\n", &tokens),
            TokenMatch::Plain
        );
        let mut altered = acceptor;
        altered[TOKEN_LEN - 1] ^= 1;
        assert_eq!(match_token(&altered, &tokens), TokenMatch::Plain);
        assert_eq!(match_token(&altered[..3], &tokens), TokenMatch::Prefix);
        // Without candidates every byte is the stream's.
        assert_eq!(match_token(&acceptor, &[]), TokenMatch::Plain);
        assert_eq!(match_token(&acceptor[..1], &[]), TokenMatch::Plain);
    }
}
