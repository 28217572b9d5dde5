//! The socket object: one fixed-size record of atomics per tracked socket.
//!
//! A record is the whole per-socket state (not only its statistics), and records live in a
//! shared-memory file (see [`crate::registry`]), so `sandirect stat` reads live connections
//! straight from the owning process without any message exchange. Every field is an atomic:
//! records are updated from hooks in any thread (and in signal handlers) without locks, and
//! read concurrently by other processes.

use core::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// Lifecycle of a socket object.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u32)]
#[non_exhaustive]
pub enum SocketState {
    /// The record is unused.
    Free = 0,
    /// Being initialised by the thread that claimed it.
    Claiming = 1,
    /// AF_INET/AF_INET6 SOCK_STREAM socket, neither connected nor listening yet.
    TcpCandidate = 2,
    /// Listening.
    Listener = 3,
    /// Connected, data on kernel TCP; [`Bypass`] says why.
    ConnectedTcp = 4,
    /// Connected, data on a SAN session (the kernel connection stays as the anchor).
    San = 5,
}

impl SocketState {
    /// Decodes a stored value (unknown values read as `Free`, i.e. skipped).
    pub fn from_raw(raw: u32) -> SocketState {
        match raw {
            1 => Self::Claiming,
            2 => Self::TcpCandidate,
            3 => Self::Listener,
            4 => Self::ConnectedTcp,
            5 => Self::San,
            _ => Self::Free,
        }
    }
}

/// Why a connected socket carries its data over kernel TCP.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u32)]
#[non_exhaustive]
pub enum Bypass {
    /// Not bypassed (SAN) or not decided yet.
    None = 0,
    /// Not a TCP socket.
    NotTcp = 1,
    /// The peer does not speak the SAN upgrade protocol.
    PeerNotCapable = 2,
    /// A config rule (or `SANDIRECT_MODE=tcp`) says TCP.
    ConfigSaysTcp = 3,
    /// No SAN provider carried the connection: the SAN path is off (`SANDIRECT_SAN=0`, also
    /// when a rule asks for `san`), the process could not make its provider (a segment
    /// directory it refuses: not private, not its own, a symbolic link), its setup failed for
    /// a reason other than the peer or our own resources, or the switch failed after the
    /// acceptor had committed to it.
    NoProvider = 4,
    /// Inherited across fork: SAN sessions are not shared between processes.
    AfterFork = 5,
    /// The config file is invalid; everything stays on TCP.
    ConfigInvalid = 6,
    /// Registered in more epoll sets than the record can mirror.
    TooManyEpollSets = 7,
    /// Not set: `sendfile`/`splice` on a SAN socket are served through a buffer. The value
    /// stays reserved so that published records keep their meaning for `sandirect stat`.
    KernelOnlyCall = 8,
    /// Was on the SAN, moved back to kernel TCP live (before fork, exec or spawn, or because
    /// the peer did).
    Downgraded = 9,
    /// This side could not set the SAN connection up (memory `RLIMIT_MEMLOCK` does not let
    /// it pin, queue pairs, descriptors, the process's SAN memory budget); the peer may well
    /// be capable (a client that
    /// declines the acceptor's connect for this reason knows it is).
    SanResources = 10,
    /// The peer is a preloaded server of this host run by another user: the SAN never joins
    /// two users (segments and descriptors are passed between processes of one user only).
    PeerOtherUser = 11,
    /// Only verbs could carry the connection (`SANDIRECT_SAN_PROVIDER=verbs`, or `auto` to
    /// a peer that is not a preloaded server of this host), and no RDMA provider library
    /// could be loaded: under `verbs` for any reason, under `auto` only on a host that has
    /// RDMA devices (without any, nothing is missing: the peer is `PeerNotCapable`).
    NoVerbsLibrary = 12,
    /// The peer is a preloaded process of this host that could not set its side of the SAN
    /// connection up (its descriptors, or its SAN memory budget): it declined before it
    /// committed, and both ends stay on TCP. The peer is not remembered as plain.
    PeerResources = 13,
    /// The peer is a preloaded process of this host whose pid namespace leaves it without a
    /// name here (no pid of ours, and no pidfd on this kernel): its death could not be
    /// noticed, so the acceptor declined and both ends stay on TCP (its client shows
    /// `peer-resources`).
    PeerPidNamespace = 14,
    /// The server is preloaded, but this client's recent connections to it were short (see
    /// `SANDIRECT_SHORT_CONNECTION_BYTES`): setting up the SAN would cost more than it saves.
    ShortConnections = 15,
    /// Accepted from a SAN client, but when the connection was first used another process
    /// still held it (a `fork` copied it and neither copy was closed in time), or it was
    /// passed to another program first: a session cannot be shared, so it stays on TCP.
    SharedByProcesses = 16,
}

impl Bypass {
    /// Decodes a stored value.
    pub fn from_raw(raw: u32) -> Bypass {
        match raw {
            1 => Self::NotTcp,
            2 => Self::PeerNotCapable,
            3 => Self::ConfigSaysTcp,
            4 => Self::NoProvider,
            5 => Self::AfterFork,
            6 => Self::ConfigInvalid,
            7 => Self::TooManyEpollSets,
            8 => Self::KernelOnlyCall,
            9 => Self::Downgraded,
            10 => Self::SanResources,
            11 => Self::PeerOtherUser,
            12 => Self::NoVerbsLibrary,
            13 => Self::PeerResources,
            14 => Self::PeerPidNamespace,
            15 => Self::ShortConnections,
            16 => Self::SharedByProcesses,
            _ => Self::None,
        }
    }

    /// Short name for `sandirect stat`.
    pub fn label(self) -> &'static str {
        match self {
            Self::None => "-",
            Self::NotTcp => "not-tcp",
            Self::PeerNotCapable => "peer-not-capable",
            Self::ConfigSaysTcp => "config-says-tcp",
            Self::NoProvider => "no-provider",
            Self::AfterFork => "after-fork",
            Self::ConfigInvalid => "config-invalid",
            Self::TooManyEpollSets => "too-many-epoll-sets",
            Self::KernelOnlyCall => "kernel-only-call",
            Self::Downgraded => "downgraded",
            Self::SanResources => "san-resources",
            Self::PeerOtherUser => "peer-other-user",
            Self::NoVerbsLibrary => "no-verbs-library",
            Self::PeerResources => "peer-resources",
            Self::PeerPidNamespace => "peer-pid-namespace",
            Self::ShortConnections => "short-connections",
            Self::SharedByProcesses => "shared-by-processes",
        }
    }
}

/// Which transport carries a connection's data.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u32)]
#[non_exhaustive]
pub enum DataPath {
    /// Kernel TCP.
    Tcp = 0,
    /// Shared-memory SAN (same host).
    SanShm = 1,
    /// RDMA verbs SAN.
    SanVerbs = 2,
}

impl DataPath {
    /// Decodes a stored value.
    pub fn from_raw(raw: u32) -> DataPath {
        match raw {
            1 => Self::SanShm,
            2 => Self::SanVerbs,
            _ => Self::Tcp,
        }
    }

    /// Short name for `sandirect stat`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::SanShm => "SAN-shm",
            Self::SanVerbs => "SAN-verbs",
        }
    }
}

/// Bits of [`SocketRecord::flags`].
pub mod flags {
    /// The socket is AF_INET6.
    pub const INET6: u32 = 1 << 0;
    /// O_NONBLOCK is set on the open file description.
    pub const NONBLOCK: u32 = 1 << 1;
    /// We connected (client role).
    pub const CLIENT: u32 = 1 << 2;
    /// Accepted from a listener (server role).
    pub const SERVER: u32 = 1 << 3;
    /// shutdown(SHUT_RD) was called.
    pub const SHUT_RD: u32 = 1 << 4;
    /// shutdown(SHUT_WR) was called.
    pub const SHUT_WR: u32 = 1 << 5;
    /// Inherited from a parent across fork.
    pub const INHERITED: u32 = 1 << 6;
    /// connect() returned EINPROGRESS (completion not observed yet).
    pub const CONNECTING: u32 = 1 << 7;
    /// The socket has a SAN object (a pending client or a switched connection): its data
    /// calls go through `crate::san`.
    pub const SAN: u32 = 1 << 8;
    /// A downgraded socket whose stash (bytes received over the SAN, not read yet) is not
    /// empty: reads take those first. Set together with `SAN`.
    pub const STASHED: u32 = 1 << 9;
    /// `SO_RCVTIMEO` may be non-zero: set through our `setsockopt`, inherited from the
    /// listener it was accepted from, or unknown (an adopted socket). A blocking SAN read asks
    /// the kernel for it only then (a system call per call otherwise).
    pub const RCVTIMEO: u32 = 1 << 10;
    /// As [`RCVTIMEO`], for `SO_SNDTIMEO` and blocking SAN sends.
    pub const SNDTIMEO: u32 = 1 << 11;
    /// Published for diagnosis (hang reports, `sandirect stat`), as of the socket's last
    /// drive: its SAN session has not completed the handshake.
    pub const SAN_HANDSHAKING: u32 = 1 << 12;
    /// As [`SAN_HANDSHAKING`]: stream bytes the application sent wait in the socket (before
    /// the handshake, or in the session's send queue for credits or send slots).
    pub const SAN_HOLDING: u32 = 1 << 13;
    /// As [`SAN_HANDSHAKING`]: messages the session posted wait in the provider (shm: the
    /// peer had no receive posted or its ring was full); they move at the next poll.
    pub const SAN_PROVIDER_QUEUED: u32 = 1 << 14;
    /// Accepted from a SAN client, not attached yet: the first call that uses the connection
    /// attaches it (or leaves it on TCP for good). Never set together with `SAN`.
    pub const UNCLAIMED: u32 = 1 << 15;
}

/// Index into [`SocketRecord::counters`].
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(usize)]
#[non_exhaustive]
pub enum Counter {
    /// Bytes sent over kernel TCP.
    TcpSent = 0,
    /// Bytes received over kernel TCP.
    TcpReceived = 1,
    /// Bytes sent inline (copied through SAN receive slots).
    SanInlineSent = 2,
    /// Bytes received inline.
    SanInlineReceived = 3,
    /// Bytes sent by rendezvous (RDMA).
    SanRendezvousSent = 4,
    /// Bytes received by rendezvous.
    SanRendezvousReceived = 5,
}

/// Number of epoll registrations a record mirrors.
pub const EPOLL_SLOTS: usize = 4;

/// Set in a registration's stored events (a bit no epoll flag uses) when the application
/// removed the registration but the kernel still holds it: a SAN socket's removal is carried
/// out lazily (see `san::epoll_removal`).
pub const REMOVED_BY_APPLICATION: u32 = 1 << 26;

/// Set in a registration's stored events (a bit no epoll flag uses) when the application asked
/// for `EPOLLOUT` as well but the kernel's registration lacks it: the waits report a SAN
/// socket's writability from its session instead (see `san::epoll_output`). The stored
/// events are the kernel's; the application's are those and `EPOLLOUT`.
pub const OUTPUT_KEPT_BY_US: u32 = 1 << 25;

/// With [`OUTPUT_KEPT_BY_US`]: the kernel's registration has `EPOLLIN` but the application's
/// lacks it (it asked for output alone); the waits drop the kernel's `EPOLLIN` for it.
pub const INPUT_DROPPED_BY_US: u32 = 1 << 24;

/// The bits of a registration's stored events that are ours, not the kernel's.
pub const KEPT_BY_US: u32 = OUTPUT_KEPT_BY_US | INPUT_DROPPED_BY_US;

/// The events the application registered, from a registration's stored ones (see
/// [`OUTPUT_KEPT_BY_US`]).
pub const fn application_events(stored: u32) -> u32 {
    let mut events = stored & !KEPT_BY_US;
    if stored & OUTPUT_KEPT_BY_US != 0 {
        events |= libc::EPOLLOUT as u32;
    }
    if stored & INPUT_DROPPED_BY_US != 0 {
        events &= !(libc::EPOLLIN as u32);
    }
    events
}

/// One `epoll_ctl(epfd, ADD, fd, {events, data})` of a tracked socket. `epfd == -1`: unused.
#[repr(C)]
pub struct EpollRegistration {
    /// The epoll instance.
    pub epfd: AtomicI32,
    /// The event mask registered.
    pub events: AtomicU32,
    /// The user data registered.
    pub data: AtomicU64,
}

/// An address stored as four atomic words (a `sockaddr_in6`-sized image, 28 bytes used).
#[repr(C)]
pub struct AtomicSockAddr([AtomicU64; 4]);

impl AtomicSockAddr {
    /// Stores `addr` (or clears with `None`).
    pub fn store(&self, addr: Option<SocketAddr>) {
        for (word, value) in self.0.iter().zip(encode_addr(addr)) {
            word.store(value, Ordering::Relaxed);
        }
    }

    /// Loads the address.
    pub fn load(&self) -> Option<SocketAddr> {
        let mut words = [0u64; 4];
        for (value, word) in words.iter_mut().zip(&self.0) {
            *value = word.load(Ordering::Relaxed);
        }
        decode_addr(words)
    }
}

/// Encoding: word0 = family (4 or 6) | port << 16; v4: word1 = address; v6: word1..3 = bytes
/// 0..8, 8..16 and scope id.
fn encode_addr(addr: Option<SocketAddr>) -> [u64; 4] {
    match addr {
        None => [0; 4],
        Some(SocketAddr::V4(v4)) => [
            4 | (u64::from(v4.port()) << 16),
            u64::from(u32::from(*v4.ip())),
            0,
            0,
        ],
        Some(SocketAddr::V6(v6)) => {
            let bits = u128::from(*v6.ip());
            [
                6 | (u64::from(v6.port()) << 16),
                (bits >> 64) as u64,
                bits as u64,
                u64::from(v6.scope_id()),
            ]
        }
    }
}

fn decode_addr(words: [u64; 4]) -> Option<SocketAddr> {
    let port = (words[0] >> 16) as u16;
    match words[0] & 0xffff {
        4 => Some(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(words[1] as u32),
            port,
        ))),
        6 => {
            let bits = (u128::from(words[1]) << 64) | u128::from(words[2]);
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(bits),
                port,
                0,
                words[3] as u32,
            )))
        }
        _ => None,
    }
}

/// The socket object. 256 bytes, cache-line aligned, all atomics.
#[repr(C, align(64))]
pub struct SocketRecord {
    /// [`SocketState`] as `u32`.
    pub state: AtomicU32,
    /// Bumped (odd while writing) around multi-word updates, for readers in other processes.
    pub seq: AtomicU32,
    /// The fd that created the socket (dups are counted in `fd_refs`).
    pub fd: AtomicI32,
    /// Number of fds in this process mapping to the socket.
    pub fd_refs: AtomicU32,
    /// [`flags`] bits.
    pub flags: AtomicU32,
    /// [`Bypass`] as `u32`.
    pub bypass: AtomicU32,
    /// [`DataPath`] as `u32`.
    pub path: AtomicU32,
    /// Generation: bumped on every claim, so a reader can tell reuse apart.
    pub generation: AtomicU32,
    /// Local address.
    pub local: AtomicSockAddr,
    /// Peer address.
    pub peer: AtomicSockAddr,
    /// Byte counters, indexed by [`Counter`].
    pub counters: [AtomicU64; 6],
    /// epoll registrations of this socket (for the SAN readiness mirror).
    pub epoll: [EpollRegistration; EPOLL_SLOTS],
}

const _: () = assert!(core::mem::size_of::<SocketRecord>() == 256);

impl SocketRecord {
    /// Current state.
    pub fn state(&self) -> SocketState {
        SocketState::from_raw(self.state.load(Ordering::Acquire))
    }

    /// Moves the state from `from` to `to`; false, and nothing changed, when it is another
    /// (a transition another thread made first stands).
    pub fn transition(&self, from: SocketState, to: SocketState) -> bool {
        self.state
            .compare_exchange(from as u32, to as u32, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Sets the state unless the record was released (`Free`) or is being claimed: a
    /// transition another thread decides late (the switch of an in-process peer's pending
    /// client) must not bring a released record back to life. False when refused.
    pub fn set_state_if_live(&self, state: SocketState) -> bool {
        self.state
            .fetch_update(
                Ordering::AcqRel,
                Ordering::Acquire,
                |current| match SocketState::from_raw(current) {
                    SocketState::Free | SocketState::Claiming => None,
                    _ => Some(state as u32),
                },
            )
            .is_ok()
    }

    /// Sets the state.
    pub fn set_state(&self, state: SocketState) {
        self.state.store(state as u32, Ordering::Release);
    }

    /// Current flags.
    pub fn flags(&self) -> u32 {
        self.flags.load(Ordering::Acquire)
    }

    /// Sets or clears flag bits.
    pub fn set_flag(&self, bits: u32, on: bool) {
        if on {
            self.flags.fetch_or(bits, Ordering::AcqRel);
        } else {
            self.flags.fetch_and(!bits, Ordering::AcqRel);
        }
    }

    /// Current fallback reason.
    pub fn bypass(&self) -> Bypass {
        Bypass::from_raw(self.bypass.load(Ordering::Acquire))
    }

    /// Current data path.
    pub fn path(&self) -> DataPath {
        DataPath::from_raw(self.path.load(Ordering::Acquire))
    }

    /// Adds `bytes` to a counter.
    #[inline]
    pub fn count(&self, counter: Counter, bytes: u64) {
        self.counters[counter as usize].fetch_add(bytes, Ordering::Relaxed);
    }

    /// Reads a counter.
    pub fn counter(&self, counter: Counter) -> u64 {
        self.counters[counter as usize].load(Ordering::Relaxed)
    }

    /// Stores both addresses under the sequence lock.
    pub fn set_addresses(&self, local: Option<SocketAddr>, peer: Option<SocketAddr>) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        self.local.store(local);
        self.peer.store(peer);
        self.seq.fetch_add(1, Ordering::AcqRel);
    }

    /// Reads both addresses consistently (retries while a writer is active, bounded).
    pub fn addresses(&self) -> (Option<SocketAddr>, Option<SocketAddr>) {
        for _ in 0..64 {
            let before = self.seq.load(Ordering::Acquire);
            let pair = (self.local.load(), self.peer.load());
            if before.is_multiple_of(2) && self.seq.load(Ordering::Acquire) == before {
                return pair;
            }
            core::hint::spin_loop();
        }
        (self.local.load(), self.peer.load())
    }

    /// Resets everything but `state`, `generation` and `fd` for a fresh claim.
    pub fn reset(&self) {
        self.fd_refs.store(0, Ordering::Relaxed);
        self.flags.store(0, Ordering::Relaxed);
        self.bypass.store(Bypass::None as u32, Ordering::Relaxed);
        self.path.store(DataPath::Tcp as u32, Ordering::Relaxed);
        self.set_addresses(None, None);
        for counter in &self.counters {
            counter.store(0, Ordering::Relaxed);
        }
        self.clear_epoll_registrations();
    }

    /// Records `epoll_ctl(epfd, EPOLL_CTL_ADD|MOD, …)`. False when every slot is taken.
    pub fn register_epoll(&self, epfd: i32, events: u32, data: u64) -> bool {
        let slot = self
            .epoll
            .iter()
            .find(|slot| slot.epfd.load(Ordering::Acquire) == epfd)
            .or_else(|| {
                self.epoll.iter().find(|slot| {
                    slot.epfd
                        .compare_exchange(-1, epfd, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                })
            });
        match slot {
            Some(slot) => {
                slot.events.store(events, Ordering::Release);
                slot.data.store(data, Ordering::Release);
                true
            }
            None => false,
        }
    }

    /// Records `epoll_ctl(epfd, EPOLL_CTL_DEL, …)` or the end of epoll instance `epfd`.
    pub fn unregister_epoll(&self, epfd: i32) {
        for slot in &self.epoll {
            if slot.epfd.load(Ordering::Acquire) == epfd {
                slot.events.store(0, Ordering::Relaxed);
                slot.data.store(0, Ordering::Relaxed);
                slot.epfd.store(-1, Ordering::Release);
            }
        }
    }

    /// The live registrations, as the application sees them: `(epfd, events, data)`.
    pub fn epoll_registrations(&self) -> impl Iterator<Item = (i32, u32, u64)> + '_ {
        self.kernel_registrations()
            .filter(|&(_, events, _)| events & REMOVED_BY_APPLICATION == 0)
            .map(|(epfd, events, data)| (epfd, application_events(events), data))
    }

    /// The registrations the kernel holds: the application's and those it removed whose
    /// removal is still due (`events` has [`REMOVED_BY_APPLICATION`]), with the kernel's
    /// events ([`KEPT_BY_US`] bits set where the application's differ, see
    /// [`application_events`]).
    pub fn kernel_registrations(&self) -> impl Iterator<Item = (i32, u32, u64)> + '_ {
        self.epoll.iter().filter_map(|slot| {
            let epfd = slot.epfd.load(Ordering::Acquire);
            (epfd >= 0).then(|| {
                (
                    epfd,
                    slot.events.load(Ordering::Acquire),
                    slot.data.load(Ordering::Acquire),
                )
            })
        })
    }

    /// The application removed its registration in `epfd`; the kernel keeps it for now.
    pub fn mark_removed_by_application(&self, epfd: i32) {
        for slot in &self.epoll {
            if slot.epfd.load(Ordering::Acquire) == epfd {
                slot.events
                    .fetch_or(REMOVED_BY_APPLICATION, Ordering::AcqRel);
            }
        }
    }

    fn clear_epoll_registrations(&self) {
        for slot in &self.epoll {
            slot.epfd.store(-1, Ordering::Relaxed);
            slot.events.store(0, Ordering::Relaxed);
            slot.data.store(0, Ordering::Relaxed);
        }
    }
}

/// Normalises an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`) to IPv4, as rules match it.
pub fn unmap_v4(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The record flag that says a socket may have the timeout `name` (`SO_RCVTIMEO`,
/// `SO_SNDTIMEO`, in their old and new (64-bit time) forms). Never cleared: a later zero
/// only costs the query.
pub fn timeout_flag(name: core::ffi::c_int) -> Option<u32> {
    // The 64-bit-time option numbers (asm-generic/socket.h); libc may not name them.
    const SO_RCVTIMEO_NEW: core::ffi::c_int = 66;
    const SO_SNDTIMEO_NEW: core::ffi::c_int = 67;
    match name {
        libc::SO_RCVTIMEO | SO_RCVTIMEO_NEW => Some(flags::RCVTIMEO),
        libc::SO_SNDTIMEO | SO_SNDTIMEO_NEW => Some(flags::SNDTIMEO),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zeroed() -> Box<SocketRecord> {
        // SAFETY: all-zero bytes are a valid record (atomics of zero).
        unsafe { Box::new(core::mem::zeroed()) }
    }

    #[test]
    fn a_switch_made_first_is_not_undone_by_the_connect_bookkeeping() {
        let record = zeroed();
        record.set_state(SocketState::TcpCandidate);
        // Another thread switched the pending client before connect() returned.
        assert!(record.set_state_if_live(SocketState::San));
        assert!(!record.transition(SocketState::TcpCandidate, SocketState::ConnectedTcp));
        assert_eq!(record.state(), SocketState::San);
        let fresh = zeroed();
        fresh.set_state(SocketState::TcpCandidate);
        assert!(fresh.transition(SocketState::TcpCandidate, SocketState::ConnectedTcp));
        assert_eq!(fresh.state(), SocketState::ConnectedTcp);
    }

    #[test]
    fn addresses_round_trip_v4_v6_and_scope() {
        let record = zeroed();
        let v4: SocketAddr = "127.0.0.1:5000".parse().unwrap();
        let v6: SocketAddr = "[fe80::1%3]:443".parse().unwrap();
        record.set_addresses(Some(v4), Some(v6));
        assert_eq!(record.addresses(), (Some(v4), Some(v6)));
        record.set_addresses(None, None);
        assert_eq!(record.addresses(), (None, None));
        assert_eq!(record.seq.load(Ordering::Relaxed) % 2, 0);
    }

    #[test]
    fn epoll_registrations_fill_update_and_overflow() {
        let record = zeroed();
        record.reset();
        assert_eq!(record.epoll_registrations().count(), 0);
        for epfd in 10..10 + EPOLL_SLOTS as i32 {
            assert!(record.register_epoll(epfd, 1, epfd as u64));
        }
        assert!(
            !record.register_epoll(99, 1, 0),
            "fifth epoll set must overflow"
        );
        assert!(record.register_epoll(11, 4, 77), "modify reuses the slot");
        assert!(record.epoll_registrations().any(|r| r == (11, 4, 77)));
        record.unregister_epoll(11);
        assert_eq!(record.epoll_registrations().count(), EPOLL_SLOTS - 1);
        assert!(record.register_epoll(99, 1, 0));
    }

    #[test]
    fn a_released_record_is_not_brought_back_by_a_late_transition() {
        let record = zeroed();
        record.set_state(SocketState::ConnectedTcp);
        assert!(record.set_state_if_live(SocketState::San));
        assert_eq!(record.state(), SocketState::San);
        record.set_state(SocketState::Free);
        assert!(!record.set_state_if_live(SocketState::San));
        assert_eq!(record.state(), SocketState::Free);
        record.set_state(SocketState::Claiming);
        assert!(!record.set_state_if_live(SocketState::ConnectedTcp));
        assert_eq!(record.state(), SocketState::Claiming);
    }

    #[test]
    fn decoding_unknown_values_is_harmless() {
        assert_eq!(SocketState::from_raw(999), SocketState::Free);
        assert_eq!(Bypass::from_raw(999), Bypass::None);
        assert_eq!(DataPath::from_raw(999), DataPath::Tcp);
        assert_eq!(decode_addr([9, 1, 2, 3]), None);
    }

    #[test]
    fn v4_mapped_addresses_normalise() {
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert_eq!(unmap_v4(mapped), "10.1.2.3".parse::<IpAddr>().unwrap());
        let plain: IpAddr = "::1".parse().unwrap();
        assert_eq!(unmap_v4(plain), plain);
    }
}
