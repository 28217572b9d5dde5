//! Setting a verbs connection up: a pending client listens with rdma_cm on its own address
//! and port before its SYN leaves, the acceptor connects to it from inside `accept()` and
//! takes the token of the client's reply, to write it on TCP (see `super`).

use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use san_verbs_loader::VerbsSetupError;

use super::link::{all_preposted, VerbsLink};
use super::watcher::{started_watcher, StartService};
use super::{
    clear_negative, domain_for, mark_negative, negative_hit, params, setup_request, token_of_reply,
    Attach, Candidates,
};
use crate::discovery::canonical_addr;
use crate::real;

/// A set-up failure that is this side's want of resources (memory it may not pin,
/// descriptors, queue pairs), not the peer's doing.
fn local_shortage(error: VerbsSetupError) -> bool {
    // The provider's own classification of set-up errors; a missing device is the peer's
    // address not being served, not a shortage.
    error != VerbsSetupError::NoDevice
        && san_api::SetupError::from(error) == san_api::SetupError::NoResources
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
        Err(VerbsSetupError::Os(libc::EADDRINUSE)) => {
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
        state: Mutex::new(Candidates::default()),
        changed: Condvar::new(),
        listener: Mutex::new(Some(listener)),
        expected: setup_request(server, local),
        server: canonical_addr(server).ip(),
        domain,
    });
    watcher.watch_attach(listener_fd, attach.clone());
    Some(VerbsLink::new(None, Some(attach), domain, Vec::new(), None))
}

/// Why the acceptor's attach did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AcceptorError {
    /// No verbs path to this client (not preloaded, no device, cached).
    PeerPlain,
    /// Verbs set-up failed otherwise.
    Resource,
}

/// How often the acceptor's CM connect is tried when its ephemeral port was taken.
const EPHEMERAL_PORT_ATTEMPTS: usize = 3;

/// Inside `accept()`: connects to the client's CM listener at its TCP address and port (the
/// service thread, `start`, must run: it will watch the connection). The link holds the
/// token of the client's reply, which the caller writes on TCP before anything else.
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
    let blob = setup_request(local, peer);
    let started = Instant::now();
    // iWARP: rdma_cm picks the connection's ephemeral port in its own port space, and the
    // provider's kernel TCP socket may find that port taken (EADDRINUSE). That says nothing
    // about the peer: another attempt gets another port.
    let mut connected = Err(VerbsSetupError::Os(libc::EADDRINUSE));
    for _ in 0..EPHEMERAL_PORT_ATTEMPTS {
        connected = domain.with(|d| d.connect(peer, &params(&blob, Some(local.ip()))));
        if connected.as_ref().err() != Some(&VerbsSetupError::Os(libc::EADDRINUSE)) {
            break;
        }
    }
    match connected {
        Ok((conn, reply)) => {
            let Some(token) = token_of_reply(&reply) else {
                // Not a client of this set-up (it would have rejected our request): the
                // connection goes, nothing is written, TCP stays as it is.
                tracing::debug!(%peer, len = reply.len(), "CM reply without a token: staying on TCP");
                drop(conn);
                return Err(AcceptorError::PeerPlain);
            };
            tracing::debug!(%peer, took = ?started.elapsed(), "CM connect to the client established");
            clear_negative(peer.ip());
            Ok(VerbsLink::new(
                Some(conn),
                None,
                domain,
                all_preposted(),
                Some(token),
            ))
        }
        Err(error) => {
            tracing::debug!(%peer, ?error, took = ?started.elapsed(), "CM connect to the client failed");
            // Our own want of resources (the QP and slots are set up before the request goes
            // out) says nothing about the peer.
            if !local_shortage(error) && error != VerbsSetupError::Os(libc::EADDRINUSE) {
                mark_negative(
                    peer.ip(),
                    matches!(
                        error,
                        VerbsSetupError::Unreachable
                            | VerbsSetupError::NoDevice
                            | VerbsSetupError::WrongDevice
                    ),
                );
            }
            Err(match error {
                VerbsSetupError::Rejected
                | VerbsSetupError::Unreachable
                | VerbsSetupError::NoDevice
                | VerbsSetupError::WrongDevice => AcceptorError::PeerPlain,
                _ => AcceptorError::Resource,
            })
        }
    }
}
