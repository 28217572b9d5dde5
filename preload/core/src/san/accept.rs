//! Accepted connections. A verbs client's connection attaches inside `accept()`. A shm
//! client's is left **unclaimed** (see `unclaimed`): it attaches at the first call that uses
//! it ([`claim`]), in the process that makes that call, once that process is the only one
//! holding the descriptor. So a server that accepts, forks and closes its copy hands the
//! connection to the child with nothing to move: the session is made where it is used.
//!
//! The rule that keeps the switch-over exact: an unclaimed connection has carried nothing
//! from this side (no byte read or written on TCP). A holder that must use it while another
//! process still holds it after a short wait, or that passes it on (exec, spawn, a descriptor
//! sent over a Unix socket), *gives up* for every holder: the connection stays on TCP for good
//! and the client, finding its segment declined, stays on TCP too.

use core::ffi::c_int;
use core::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use super::budget;
use super::epoll_index;
use super::other_users;
use super::provider::provider;
use super::service;
use super::socket::{SanSocket, SocketSetupError};
use super::table::{insert, insert_claimed, lock, SanObject, COUNTERS, LIVE};
use super::unclaimed::{Holders, Sole, Unclaimed};
use super::verbs;
use crate::discovery::{ConnectionKey, SegmentName};
use crate::record::{flags, Bypass, SocketRecord};
use crate::registry::registry;
use crate::settings::ProviderChoice;

/// How long the first call on an unclaimed connection that a `fork` copied waits for the
/// other holders to close their copies: a forking server's parent closes its copy right after
/// `fork` returns, usually before the child's first call, but not always (the child may run
/// first on another CPU).
const CLAIM_WAIT: Duration = Duration::from_millis(20);

/// Held while a connection becomes unclaimed and from a fork's count of the unclaimed
/// connections to the fork itself (see [`before_fork`]).
static ACCEPTING: Mutex<()> = Mutex::new(());

/// [`ACCEPTING`]'s guard (a poisoned lock is taken over: it guards no data).
pub(super) fn hold_accepting() -> MutexGuard<'static, ()> {
    ACCEPTING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Installs `socket` in the slot of record index `index`.
pub(super) fn install(index: u32, record: &'static SocketRecord, socket: SanSocket) {
    if socket.is_intra_host() {
        // A fork in the peer process needs our answer even while the application is idle.
        service::ensure_responder();
    }
    insert(index, record, socket);
    // Registrations made while it was a plain TCP socket (e.g. before `connect`).
    epoll_index::update(index, record);
}

/// `accept()` returned `fd` from a listener with a published marker: a shm client's
/// connection is left unclaimed (attached by [`claim`]); a verbs client's attaches now.
pub(super) fn on_accepted(
    listener_index: u32,
    fd: c_int,
    index: u32,
    record: &'static SocketRecord,
) {
    let Some(provider) = provider() else { return };
    if record.bypass() != Bypass::None
        || !matches!(*lock(listener_index), Some(SanObject::Marker(_)))
    {
        return;
    }
    let (Some(local), Some(peer)) = record.addresses() else {
        return;
    };
    // Formatted only where it is looked for: a plain client's connection (no client of ours
    // pending on its port, no other users served) costs no name.
    let segment_name = || ConnectionKey::from_accepting_side(local, peer).segment_name();
    let mode = crate::settings::provider_choice();
    // No client of ours waits on the client's port: it is plain (or not on this host), no
    // need to probe its exchange (see `san_shm::PendingPorts`).
    let no_pending_client = provider
        .pending
        .as_ref()
        .is_some_and(|table| !table.may_be_pending(peer.port()));
    let pending_name = (mode != ProviderChoice::Verbs && !no_pending_client)
        .then(segment_name)
        .filter(|name| provider.dir.handle().contains(name.as_str()));
    if let Some(name) = pending_name {
        let Some(charge) = budget::charge_shm() else {
            // Past the process's SAN memory budget: decline (the client stays on TCP,
            // `peer-resources`).
            stay_on_tcp(record, Bypass::SanResources);
            decline(&name);
            return;
        };
        let _accepting = hold_accepting();
        *lock(index) = Some(SanObject::Unclaimed(Box::new(Unclaimed::new(name, charge))));
        record.set_flag(flags::UNCLAIMED, true);
        LIVE.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(fd, %name, "accepted from a SAN client: attaches at first use");
        return;
    }
    // A client of another user, when this process's policy names other users: its exchange
    // answers at a name of no user's (see `other_users`). A plain client costs this probe.
    if mode != ProviderChoice::Verbs && other_users::enabled() {
        let name = segment_name();
        if let Some(link) = other_users::client_exchange(&name, local, peer) {
            let Some(charge) = budget::charge_shm() else {
                stay_on_tcp(record, Bypass::SanResources);
                return;
            };
            let _accepting = hold_accepting();
            *lock(index) = Some(SanObject::Unclaimed(Box::new(Unclaimed::of_other_user(
                name, charge, link,
            ))));
            record.set_flag(flags::UNCLAIMED, true);
            LIVE.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(fd, %name, "accepted from a SAN client of another user");
            return;
        }
    }
    if mode == ProviderChoice::Shm {
        record
            .bypass
            .store(Bypass::PeerNotCapable as u32, Ordering::Release);
        return;
    }
    // Not a same-host client: a cross-host one, if a device serves this address. Asked
    // before the budget is charged: on a host without RDMA devices (or an address no device
    // serves) this is a cached answer, and the client is plain whatever the budget says.
    if verbs::domain_for(local.ip()).is_none() {
        stay_on_tcp(record, Bypass::PeerNotCapable);
        return;
    }
    let name = segment_name();
    let accepted = match budget::charge_verbs() {
        Some(charge) => match verbs::connect::acceptor(local, peer, service::start) {
            Ok(link) => SanSocket::verbs_acceptor(record, &name, link, charge),
            Err(verbs::connect::AcceptorError::PeerPlain) => Err(SocketSetupError::PeerPlain),
            Err(verbs::connect::AcceptorError::Resource) => Err(SocketSetupError::Resource),
        },
        // Not tried: whether the client is capable is not known.
        None => Err(SocketSetupError::Resource),
    };
    match accepted {
        Ok(mut socket) => {
            // The client's token goes out now, before accept() returns: the application
            // watches the mirror from now on.
            socket.wake_pending_client(fd);
            tracing::debug!(fd, %name, "accepted over the SAN (verbs)");
            COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
            install(index, record, socket);
            if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
                service::watch_socket(index, socket);
            }
        }
        Err(error) => stay_on_tcp(record, bypass_of(error)),
    }
}

/// The first call that uses unclaimed connection `index` (its record `record`): attaches it
/// when this process is the only holder (waiting up to [`CLAIM_WAIT`] for the others to close
/// their copies), else leaves it on TCP for every holder. True when it is a SAN socket now.
pub(super) fn claim(index: u32, record: &'static SocketRecord) -> bool {
    let _errno = crate::errno::Preserved::save();
    crate::guard::contained(|| claim_inner(index, record)).unwrap_or(false)
}

fn claim_inner(index: u32, record: &'static SocketRecord) -> bool {
    let mut slot = lock(index);
    let unclaimed = match slot.take() {
        Some(SanObject::Unclaimed(unclaimed)) => unclaimed,
        // Another thread claimed it (or left it on TCP) while we waited for the lock.
        other => {
            let attached = matches!(other, Some(SanObject::Socket(_)));
            *slot = other;
            return attached;
        }
    };
    let Some(provider) = provider() else {
        return leave_on_tcp(record, &unclaimed, Bypass::NoProvider);
    };
    if let Some(holders) = &unclaimed.holders {
        if holders.wait_until_sole(CLAIM_WAIT) == Sole::No {
            tracing::debug!(index, "unclaimed connection still held by another process");
            return leave_on_tcp(record, &unclaimed, Bypass::SharedByProcesses);
        }
    }
    let fd = record.fd.load(Ordering::Acquire);
    // Charged at accept (a fork copies the charge with the process's total).
    let Unclaimed {
        name, charge, link, ..
    } = *unclaimed;
    let attached = match link {
        Some(link) => {
            SanSocket::acceptor_private(record, link, &name, &provider.registrations, charge)
        }
        None => SanSocket::acceptor(
            record,
            provider.dir.handle(),
            &name,
            &provider.registrations,
            charge,
        ),
    };
    match attached {
        Ok(mut socket) => {
            // The marker goes out now, before the call goes on: the application watches the
            // mirror from now on, and a pending client's TCP bytes only become visible there
            // once the client switched, which the marker makes it do at its next call.
            socket.wake_pending_client(fd);
            tracing::debug!(fd, %name, "accepted over the SAN");
            COUNTERS.switched.fetch_add(1, Ordering::Relaxed);
            let intra_host = socket.is_intra_host();
            insert_claimed(&mut slot, index, record, socket);
            drop(slot);
            if intra_host {
                service::ensure_responder();
            }
            epoll_index::update(index, record);
            true
        }
        Err(error) => {
            let bypass = bypass_of(error);
            LIVE.fetch_sub(1, Ordering::Relaxed);
            record.set_flag(flags::UNCLAIMED, false);
            stay_on_tcp(record, bypass);
            if bypass != Bypass::PeerNotCapable {
                decline(&name);
            }
            false
        }
    }
}

/// Leaves unclaimed connection `unclaimed` (taken out of its slot) on TCP for every holder,
/// for reason `bypass`. False: not a SAN socket.
fn leave_on_tcp(record: &'static SocketRecord, unclaimed: &Unclaimed, bypass: Bypass) -> bool {
    if let Some(holders) = &unclaimed.holders {
        holders.give_up();
    }
    decline(&unclaimed.name);
    LIVE.fetch_sub(1, Ordering::Relaxed);
    record.set_flag(flags::UNCLAIMED, false);
    stay_on_tcp(record, bypass);
    false
}

/// The last descriptor of unclaimed connection `unclaimed` in this process is gone. The last
/// holder to let go declines the client's segment (the kernel connection closes with it).
pub(super) fn release(unclaimed: &Unclaimed) {
    LIVE.fetch_sub(1, Ordering::Relaxed);
    let last = unclaimed
        .holders
        .as_ref()
        .is_none_or(|holders| holders.release() == 0);
    if last {
        decline(&unclaimed.name);
    }
}

/// Before `fork()` (every slot lock about to be held across it): each unclaimed connection
/// gets one more holder, on the page it shares with its other holders (made now if this
/// process was its only holder). Without a page (no memory) it can never be claimed: given
/// up instead. Returns the indices, whose slots the caller locks too.
pub(super) fn before_fork() -> Vec<u32> {
    let mut indices = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::UNCLAIMED != 0 {
            indices.push(index);
        }
    });
    for &index in &indices {
        let mut slot = lock(index);
        let Some(SanObject::Unclaimed(unclaimed)) = slot.as_mut() else {
            continue;
        };
        match &unclaimed.holders {
            Some(holders) => holders.add_holder(),
            None => unclaimed.holders = Holders::new(2),
        }
        if unclaimed.holders.is_none() {
            if let (Some(SanObject::Unclaimed(unclaimed)), Some(record)) =
                (slot.take(), registry().get(index))
            {
                leave_on_tcp(record, &unclaimed, Bypass::SharedByProcesses);
            }
        }
    }
    indices
}

/// Unclaimed connections whose descriptor `only` says leaves this program (exec, spawn, a
/// descriptor sent over a Unix socket; `None`: all of them) stay on TCP, for every holder:
/// the other program will use the kernel socket as it is.
pub(super) fn give_up_unclaimed(only: Option<&dyn Fn(c_int) -> bool>) {
    let mut leaving = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::UNCLAIMED != 0
            && only.is_none_or(|keep| keep(record.fd.load(Ordering::Acquire)))
        {
            leaving.push((index, record));
        }
    });
    for (index, record) in leaving {
        let mut slot = lock(index);
        match slot.take() {
            Some(SanObject::Unclaimed(unclaimed)) => {
                leave_on_tcp(record, &unclaimed, Bypass::SharedByProcesses);
            }
            other => *slot = other,
        }
    }
}

/// Before an exec: unclaimed connections whose descriptor does not survive it
/// (`survives` says no: close-on-exec) are let go by this process, as a close would, so that
/// a process that forked them to us and still holds them can claim them (a forked child that
/// execs a helper program otherwise holds the count up for ever). Those that survive are
/// given up by `give_up_unclaimed`.
pub(super) fn release_unclaimed_at_exec(survives: &dyn Fn(c_int) -> bool) {
    let mut leaving = Vec::new();
    registry().for_each_live(|index, record| {
        if record.flags() & flags::UNCLAIMED != 0 && !survives(record.fd.load(Ordering::Acquire)) {
            leaving.push(index);
        }
    });
    for index in leaving {
        let mut slot = lock(index);
        if let Some(SanObject::Unclaimed(unclaimed)) = slot.as_mut() {
            if let Some(holders) = unclaimed.holders.take() {
                holders.release();
            }
        }
    }
}

/// The record keeps to TCP for reason `bypass` (counted as a fallback unless the peer is plain).
fn stay_on_tcp(record: &SocketRecord, bypass: Bypass) {
    if bypass != Bypass::PeerNotCapable {
        COUNTERS.fallbacks.fetch_add(1, Ordering::Relaxed);
    }
    record.bypass.store(bypass as u32, Ordering::Release);
}

fn bypass_of(error: SocketSetupError) -> Bypass {
    match error {
        SocketSetupError::PeerPlain => Bypass::PeerNotCapable,
        SocketSetupError::Resource => Bypass::SanResources,
        SocketSetupError::PeerPidNamespace => Bypass::PeerPidNamespace,
        SocketSetupError::ClientWithdrew => Bypass::Downgraded,
    }
}

/// The acceptor gives up before it attached: it removes the client's segment name (in the
/// segment directory it holds open), so that the pending client, when TCP data finds the
/// segment unattached, knows a capable peer declined (`peer-resources`) rather than a plain
/// one answered; the client stays on TCP either way (the exact rule).
pub(super) fn decline(name: &SegmentName) {
    if let Some(provider) = provider() {
        let _ = provider.dir.handle().remove(name.as_str());
    }
}
