//! The deterministic simulation world: sessions over the `san-sim` fabric with the real
//! registration cache, random application behaviour and injected faults, with invariants
//! checked after every step. Used by `tests/sim.rs` (seeded) and by the `session_ops` fuzz
//! target and its corpus replay (choices taken from the fuzzer's bytes).
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use super::pattern;
use rand::{Rng, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use san_api::{Access, AppSource, BadAddress, Capabilities, CompletionError, MemRange, SlotConfig};
use san_sim::{EndpointId, FaultConfig, SimConnection, SimDomain, SimFabric};
use switch::error::{Error, ProviderError, RecvError, SendError};
use switch::mr_cache::{CacheConfig, MrCache, MrHandle, OwnerId};
use switch::session::{
    Event, MrHandleId, Pump, RecvFlags, RecvTicket, RegisteredRange, ResetCause, Role, SendFlags,
    SendTicket, Session, SessionConfig, SessionState, Shutdown,
};

const MAX_RENDEZVOUS: u64 = 4 << 20;

struct Endpoint {
    ep: EndpointId,
    domain: SimDomain,
    cache: MrCache,
    crashed: bool,
}

struct TxPending {
    ticket: SendTicket,
    handle: MrHandleId,
    start: u64,
    len: u64,
    range: MemRange,
}

struct RxPending {
    ticket: RecvTicket,
    handle: MrHandleId,
    range: MemRange,
    peek: bool,
}

/// One end of a connection plus the application using it.
struct Side {
    endpoint: usize,
    peer: usize,
    conn: SimConnection,
    session: Session,
    pump: Pump,
    slots: SlotConfig,
    send_buffer: usize,
    held: HashMap<MrHandleId, MrHandle>,
    /// Buffers the application freed while the session still held their registration (a
    /// posted work request may still use it): unmapped when the session releases them, as
    /// the preload defers deregistering memory under a posted op.
    deferred_frees: HashMap<MrHandleId, MemRange>,
    /// Stream offset of the next byte the application will send.
    sent: u64,
    tx: Option<TxPending>,
    /// Stream offset of the next byte the application expects to receive.
    received: u64,
    rx: Option<RxPending>,
    paused: bool,
    shut_write: bool,
    eof: bool,
    closed: bool,
    reset: Option<ResetCause>,
    state: SessionState,
    /// Kernel TCP from this side to its peer: the bytes the application wrote after the
    /// session said `SendError::Downgraded` (the peer reads them after our `Downgrade`).
    tcp_out: Vec<u8>,
    /// The session said `RecvError::Downgraded`: the application now reads the peer's
    /// `tcp_out`.
    reading_tcp: bool,
    /// Bytes were written to TCP toward an application that had closed: the kernel answers
    /// with a RST, so the connection is not clean.
    tcp_reset: bool,
}

impl Side {
    fn sent_upper(&self) -> u64 {
        self.sent + self.tx.as_ref().map_or(0, |t| t.len)
    }
}

pub struct World<R: RngCore = ChaCha8Rng> {
    step: usize,
    rng: R,
    fabric: SimFabric,
    endpoints: Vec<Endpoint>,
    sides: Vec<Side>,
    next_handle: u64,
    /// Faults that legitimately break connections happened (disables the delivery check for
    /// the connections concerned, via `reset`).
    fatal_faults: bool,
    delayed_reposts: bool,
    coverage: Coverage,
    /// The application's receive buffer (reused: allocation would dominate the run time).
    recv_buf: Vec<u8>,
}

type Check = Result<(), String>;

/// What the seeds exercised (printed, and checked for coverage on long runs so the
/// simulation cannot silently test nothing).
#[derive(Default, Debug)]
pub struct Coverage {
    pub bytes_delivered: u64,
    pub rendezvous_read_mode: u64,
    pub rendezvous_write_mode: u64,
    pub short_counts: u64,
    pub zero_copy_receives: u64,
    pub interrupted_receives: u64,
    pub resets: u64,
    pub clean_connections: u64,
    /// Sessions that ended in `SessionState::Downgraded`.
    pub downgrades: u64,
    /// Of those, on connections that were not reset (their byte streams were checked).
    pub clean_downgrades: u64,
    /// Application bytes carried over the kernel TCP continuation after a downgrade.
    pub tcp_bytes: u64,
    /// Sends that went straight into the slots (nothing of them in the send buffer).
    pub sends_into_slots: u64,
    /// Sends from a buffer that could not all be read.
    pub unreadable_sends: u64,
}

/// An application buffer readable only before `bad_from`.
struct Unreadable<'a> {
    bytes: &'a [u8],
    bad_from: usize,
}

impl AppSource for Unreadable<'_> {
    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
        if offset + dst.len() > self.bad_from {
            return Err(BadAddress);
        }
        dst.copy_from_slice(&self.bytes[offset..offset + dst.len()]);
        Ok(())
    }
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

fn caps(rng: &mut impl Rng) -> Capabilities {
    Capabilities {
        rdma_read: rng.gen_bool(0.5),
        write_with_imm: rng.gen_bool(0.5),
        read_sink_needs_remote_write: rng.gen_bool(0.2),
        active_side_sends_first: rng.gen_bool(0.2),
        max_slot_size: 64 * 1024,
        max_slots: 1024,
        max_inline: 256,
        max_rdma_len: if rng.gen_bool(0.2) {
            64 * 1024
        } else {
            1 << 30
        },
    }
}

impl World<ChaCha8Rng> {
    /// A world whose every random choice comes from `seed`.
    pub fn new(seed: u64) -> Self {
        World::with_rng(seed, ChaCha8Rng::seed_from_u64(seed ^ 0x5EED_5EED))
    }
}

impl<R: RngCore> World<R> {
    /// A world whose fabric schedule comes from `seed` and whose application and fault
    /// choices come from `rng` (the fuzz target passes the fuzzer's bytes here).
    pub fn with_rng(seed: u64, mut rng: R) -> Self {
        let faulty = rng.gen_bool(0.7);
        let faults = if faulty {
            FaultConfig {
                completion_delay: rng.gen_range(0.0..0.05),
                reorder: rng.gen_range(0.0..0.05),
                delayed_repost: if rng.gen_bool(0.5) {
                    rng.gen_range(0.0..0.05)
                } else {
                    0.0
                },
                registration_failure: rng.gen_range(0.0..0.03),
                qp_error: if rng.gen_bool(0.2) { 0.0005 } else { 0.0 },
                ..FaultConfig::NONE
            }
        } else {
            FaultConfig::NONE
        };
        let fabric = SimFabric::new(seed, faults);
        let mut endpoints = Vec::new();
        for _ in 0..3 {
            let ep = fabric.add_endpoint();
            fabric.set_capabilities(ep, caps(&mut rng)).unwrap();
            endpoints.push(Endpoint {
                ep,
                domain: fabric.domain(ep),
                cache: MrCache::new(CacheConfig {
                    max_entries: 64,
                    max_bytes: 32 << 20,
                }),
                crashed: false,
            });
        }
        let mut world = World {
            step: 0,
            rng,
            fabric,
            endpoints,
            sides: Vec::new(),
            next_handle: 0,
            fatal_faults: faults.qp_error > 0.0,
            delayed_reposts: faults.delayed_repost > 0.0,
            coverage: Coverage::default(),
            recv_buf: vec![0; 256 * 1024],
        };
        let connections = world.rng.gen_range(1..=3);
        for _ in 0..connections {
            let a = world.rng.gen_range(0..3);
            let b = (a + world.rng.gen_range(1..3)) % 3;
            world.connect(a, b);
        }
        world
    }

    fn slot_config(&mut self) -> SlotConfig {
        SlotConfig {
            send_slots: self.rng.gen_range(1..=8),
            recv_slots: self.rng.gen_range(4..=16),
            slot_size: *[64u32, 100, 256, 1024, 4096]
                .get(self.rng.gen_range(0..5))
                .unwrap(),
        }
    }

    fn connect(&mut self, a: usize, b: usize) {
        let (slots_a, slots_b) = (self.slot_config(), self.slot_config());
        let (conn_a, conn_b) = self
            .fabric
            .connect(self.endpoints[a].ep, self.endpoints[b].ep, slots_a, slots_b)
            .unwrap();
        let base = self.sides.len();
        for (endpoint, conn, slots, role, peer) in [
            (a, conn_a, slots_a, Role::Active, base + 1),
            (b, conn_b, slots_b, Role::Passive, base),
        ] {
            let send_buffer = self.rng.gen_range(1024..64 * 1024);
            let config = SessionConfig {
                send_buffer,
                rendezvous_threshold: 64 * 1024,
                credit_update_threshold: if self.rng.gen_bool(0.5) { 0 } else { 1 },
                receive_in_slots: self.rng.gen_bool(0.5),
                send_in_slots: self.rng.gen_bool(0.5),
            };
            let local = self.fabric.capabilities(self.endpoints[endpoint].ep);
            self.sides.push(Side {
                endpoint,
                peer,
                conn,
                session: Session::new(role, config, local, slots, 0),
                pump: Pump::new(),
                slots,
                send_buffer,
                held: HashMap::new(),
                deferred_frees: HashMap::new(),
                sent: 0,
                tx: None,
                received: 0,
                rx: None,
                paused: false,
                shut_write: false,
                eof: false,
                closed: false,
                reset: None,
                state: SessionState::Handshaking,
                tcp_out: Vec::new(),
                reading_tcp: false,
                tcp_reset: false,
            });
        }
    }

    fn live(&self, side: usize) -> bool {
        !self.endpoints[self.sides[side].endpoint].crashed
    }

    fn register(
        &mut self,
        side: usize,
        range: MemRange,
        access: Access,
    ) -> Option<RegisteredRange> {
        let owner = OwnerId(side as u64);
        let endpoint = &mut self.endpoints[self.sides[side].endpoint];
        let (handle, registration) = endpoint
            .cache
            .get(&mut endpoint.domain, owner, range, access)
            .ok()?;
        self.next_handle += 1;
        let id = MrHandleId(self.next_handle);
        self.sides[side].held.insert(id, handle);
        Some(RegisteredRange {
            range,
            registration,
            handle: id,
        })
    }

    /// The application frees `range` of `endpoint`: unmap, and the cache's invalidation
    /// (as the preload's munmap hook would), telling sessions about handles still held.
    fn free(&mut self, endpoint: usize, range: MemRange) {
        let Ok(unmapped) = self.fabric.unmap(self.endpoints[endpoint].ep, range) else {
            return;
        };
        self.invalidate(endpoint, unmapped);
    }

    /// The application frees the buffer of a completed send or receive.
    fn app_free(&mut self, side: usize, handle: MrHandleId, range: MemRange) {
        if self.sides[side].held.contains_key(&handle) {
            self.sides[side].deferred_frees.insert(handle, range);
        } else {
            self.free(self.sides[side].endpoint, range);
        }
    }

    fn invalidate(&mut self, endpoint: usize, range: MemRange) {
        let ep = &mut self.endpoints[endpoint];
        let affected = ep.cache.invalidate(&mut ep.domain, range);
        for (handle, owner) in affected {
            let side = &mut self.sides[owner.0 as usize];
            let id = side
                .held
                .iter()
                .find(|(_, h)| **h == handle)
                .map(|(id, _)| *id);
            if let Some(id) = id {
                side.held.remove(&id);
                side.session.handle_invalidated(id);
            }
        }
    }

    // ------------------------------------------------------------ application actions

    fn act(&mut self) -> Check {
        let side = self.rng.gen_range(0..self.sides.len());
        if !self.live(side) {
            return Ok(());
        }
        let roll: f64 = self.rng.gen();
        match roll {
            r if r < 0.35 => self.send_inline(side),
            r if r < 0.42 => self.send_rendezvous(side),
            r if r < 0.85 => {
                if !self.sides[side].paused {
                    self.receive(side, false)?;
                }
                Ok(())
            }
            r if r < 0.90 => {
                self.sides[side].paused = !self.sides[side].paused;
                Ok(())
            }
            r if r < 0.905 => {
                if self.sides[side].tx.is_none() {
                    self.sides[side].session.shutdown(Shutdown::Write);
                    self.sides[side].shut_write = true;
                }
                Ok(())
            }
            r if r < 0.908 => {
                let abortive = self.rng.gen_bool(0.5);
                let peer = self.sides[side].peer;
                let downgraded = self.sides[side].session.state() == SessionState::Downgraded;
                let unread = !self.sides[peer].tcp_out.is_empty()
                    || (downgraded && (abortive || self.sides[side].session.recv_queue_len() > 0));
                if unread {
                    // Closing kernel TCP with unread bytes (or after a downgrade, with SAN
                    // bytes unread, which the session no longer resets): the kernel sends a
                    // RST, so the connection is not clean.
                    self.sides[side].tcp_reset = true;
                    self.sides[peer].tcp_reset = true;
                }
                self.sides[side].session.close(abortive);
                self.sides[side].closed = true;
                self.sides[side].shut_write = true;
                Ok(())
            }
            r if r < 0.95 => self.fault(side),
            r if r < 0.955 => {
                // fork()/exec(): the preload moves the connection back to kernel TCP.
                match self.sides[side].session.downgrade() {
                    Ok(()) => {}
                    Err(switch::error::DowngradeError::Reset) => {}
                    Err(e) => return Err(format!("side {side}: downgrade refused: {e:?}")),
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn send_inline(&mut self, side: usize) -> Check {
        let s = &mut self.sides[side];
        if s.tx.is_some() || s.shut_write {
            return Ok(());
        }
        let max = 3 * s.slots.slot_size as usize + 10;
        let len = self.rng.gen_range(0..=max.max(8192));
        let data = pattern(side as u64, s.sent, len);
        let urgent = self.rng.gen_bool(0.02);
        // Now and then the application's buffer cannot all be read: the send takes nothing.
        let bad_from = (len > 0 && self.rng.gen_bool(0.03)).then(|| self.rng.gen_range(0..len));
        let flags = SendFlags { urgent };
        let sent = match bad_from {
            Some(bad_from) => {
                let source = Unreadable {
                    bytes: &data,
                    bad_from,
                };
                s.session.send_into_slots(&source, flags, &mut s.conn)
            }
            None => s.session.send_into_slots(&data[..], flags, &mut s.conn),
        };
        if bad_from.is_some() {
            self.coverage.unreadable_sends += 1;
        }
        match sent {
            Ok(n) => {
                ensure!(n <= len, "send accepted more than given");
                ensure!(len > 0 || n == 0, "zero-length send");
                if s.session.send_queue_len() == 0 && n > 0 {
                    self.coverage.sends_into_slots += 1;
                }
                s.sent += n as u64;
            }
            Err(SendError::BadAddress) => {
                ensure!(bad_from.is_some(), "a readable send answered BadAddress");
            }
            Err(SendError::Downgraded) => {
                self.write_tcp(side, &data);
            }
            Err(SendError::WouldBlock | SendError::Reset) => {}
            Err(e) => return Err(format!("unexpected send error {e:?}")),
        }
        Ok(())
    }

    /// The application's write goes to kernel TCP (the session downgraded).
    fn write_tcp(&mut self, side: usize, data: &[u8]) {
        let peer = self.sides[side].peer;
        if self.sides[peer].closed && !data.is_empty() {
            self.sides[side].tcp_reset = true;
            self.sides[peer].tcp_reset = true;
        }
        let s = &mut self.sides[side];
        s.tcp_out.extend_from_slice(data);
        s.sent += data.len() as u64;
        self.coverage.tcp_bytes += data.len() as u64;
    }

    fn send_rendezvous(&mut self, side: usize) -> Check {
        let s = &self.sides[side];
        if s.tx.is_some() || s.shut_write || s.session.state() != SessionState::Established {
            return Ok(());
        }
        let Some(read_mode) = s.session.sends_use_read_mode() else {
            return Ok(());
        };
        let roll: f64 = self.rng.gen();
        let len = if roll < 0.7 {
            self.rng.gen_range(1024..128 * 1024)
        } else if roll < 0.97 {
            self.rng.gen_range(128 * 1024..1 << 20)
        } else {
            self.rng.gen_range(1 << 20..=MAX_RENDEZVOUS)
        };
        let prefix = self
            .rng
            .gen_range(0..=s.session.max_rendezvous_prefix().min(len as usize));
        let start = s.sent;
        let data = pattern(side as u64, start, len as usize);
        let ep = self.endpoints[s.endpoint].ep;
        let rest = (len as usize - prefix) as u64;
        if rest == 0 {
            return Ok(());
        }
        let range = self.fabric.alloc(ep, rest).unwrap();
        self.fabric.write(ep, range, &data[prefix..]).unwrap();
        let access = if read_mode {
            Access::REMOTE_READ
        } else {
            Access::NONE
        };
        let Some(registered) = self.register(side, range, access) else {
            // ENOBUFS before anything was sent: the driver would copy instead; the app here
            // just frees its buffer.
            self.free(self.sides[side].endpoint, range);
            return Ok(());
        };
        let s = &mut self.sides[side];
        match s.session.send_rendezvous(&data[..prefix], registered) {
            Ok(ticket) => {
                s.tx = Some(TxPending {
                    ticket,
                    handle: registered.handle,
                    start,
                    len,
                    range,
                });
            }
            Err(e) => {
                let handle = s.held.remove(&registered.handle).unwrap();
                let endpoint = &mut self.endpoints[s.endpoint];
                endpoint.cache.release(&mut endpoint.domain, handle);
                self.free(self.sides[side].endpoint, range);
                if e == SendError::Downgraded {
                    // The driver's large write goes to kernel TCP instead.
                    self.write_tcp(side, &data);
                    return Ok(());
                }
                if !matches!(e, SendError::WouldBlock | SendError::Reset) {
                    return Err(format!("unexpected send_rendezvous error {e:?}"));
                }
            }
        }
        Ok(())
    }

    /// One receive call of the application (`drain`: read with large buffers, no peeks).
    fn receive(&mut self, side: usize, drain: bool) -> Check {
        if self.sides[side].rx.is_some() || self.sides[side].closed {
            return Ok(());
        }
        let len = if drain {
            256 * 1024
        } else {
            self.rng.gen_range(1..16 * 1024)
        };
        let peek = !drain && self.rng.gen_bool(0.15);
        let mut buf = std::mem::take(&mut self.recv_buf);
        let outcome = self.receive_into(side, &mut buf[..len], peek, drain);
        self.recv_buf = buf;
        outcome
    }

    fn receive_into(&mut self, side: usize, buf: &mut [u8], peek: bool, drain: bool) -> Check {
        let peer = self.sides[side].peer;
        if self.sides[side].reading_tcp {
            return self.receive_tcp(side, buf.len());
        }
        let s = &mut self.sides[side];
        let flags = RecvFlags {
            peek,
            ..RecvFlags::default()
        };
        match s.session.recv_from_slots(buf, flags, &s.conn) {
            Ok(0) => s.eof = true,
            Ok(n) => {
                let expected = pattern(peer as u64, s.received, n);
                ensure!(
                    buf[..n] == expected[..],
                    "side {side}: inline bytes at offset {} differ from the stream",
                    s.received
                );
                if !peek {
                    s.received += n as u64;
                }
            }
            Err(RecvError::RemoteSegment { len }) => {
                ensure!(len > 0, "empty remote segment");
                let sink_len = if drain || self.rng.gen_bool(0.5) {
                    len.min(1 << 20)
                } else {
                    self.rng.gen_range(1..=len.min(1 << 20))
                };
                let endpoint = self.sides[side].endpoint;
                let ep = self.endpoints[endpoint].ep;
                let local = self.fabric.capabilities(ep);
                let mut access = Access::LOCAL_WRITE;
                if !local.rdma_read || local.read_sink_needs_remote_write {
                    access |= Access::REMOTE_WRITE;
                }
                let range = self.fabric.alloc(ep, sink_len).unwrap();
                let Some(sink) = self.register(side, range, access) else {
                    // ENOMEM: the receiver cannot take the segment zero-copy.
                    self.free(endpoint, range);
                    self.sides[side]
                        .session
                        .reject_remote_segment()
                        .map_err(|e| format!("reject_remote_segment: {e:?}"))?;
                    return Ok(());
                };
                let peek = !drain && self.rng.gen_bool(0.1);
                let s = &mut self.sides[side];
                let flags = RecvFlags {
                    peek,
                    ..RecvFlags::default()
                };
                match s.session.post_recv(sink, flags) {
                    Ok(ticket) => {
                        s.rx = Some(RxPending {
                            ticket,
                            handle: sink.handle,
                            range,
                            peek,
                        })
                    }
                    Err(e) => return Err(format!("post_recv refused: {e:?}")),
                }
            }
            Err(RecvError::Downgraded) => {
                ensure!(
                    s.session.peer_downgraded(),
                    "side {side}: Downgraded before the peer's Downgrade"
                );
                s.reading_tcp = true;
                return self.receive_tcp(side, buf.len());
            }
            Err(RecvError::WouldBlock | RecvError::Reset) => {}
            Err(e) => return Err(format!("unexpected recv error {e:?}")),
        }
        Ok(())
    }

    /// After the session's `RecvError::Downgraded`, the application reads kernel TCP: the
    /// peer's continuation must be exactly the next bytes of its stream.
    fn receive_tcp(&mut self, side: usize, max: usize) -> Check {
        let peer = self.sides[side].peer;
        let n = max.min(self.sides[peer].tcp_out.len());
        let bytes: Vec<u8> = self.sides[peer].tcp_out.drain(..n).collect();
        let s = &mut self.sides[side];
        ensure!(
            bytes == pattern(peer as u64, s.received, n),
            "side {side}: TCP continuation at offset {} differs from the stream",
            s.received
        );
        s.received += n as u64;
        if self.sides[peer].tcp_out.is_empty() && self.sides[peer].shut_write {
            self.sides[side].eof = true;
        }
        Ok(())
    }

    fn fault(&mut self, side: usize) -> Check {
        let roll: f64 = self.rng.gen();
        let endpoint = self.sides[side].endpoint;
        if roll < 0.4 {
            // The application frees the buffer of its rendezvous in progress (munmap): the
            // peer's reads fail, the session must never post with it again.
            let Some(tx) = self.sides[side].tx.as_ref() else {
                return Ok(());
            };
            let range = tx.range;
            let in_use = self.sides[side]
                .held
                .keys()
                .any(|id| self.sides[side].session.handle_in_posted_op(*id));
            if in_use {
                // The preload defers the deregistration of memory under a posted op.
                return Ok(());
            }
            self.fatal_faults = true;
            self.free(endpoint, range);
        } else if roll < 0.8 {
            self.fabric
                .fail_next_registrations(self.endpoints[endpoint].ep, 1)
                .unwrap();
        } else if roll < 0.95 {
            self.fatal_faults = true;
            self.fabric
                .inject_qp_error(self.sides[side].conn.id())
                .unwrap();
        } else {
            self.fatal_faults = true;
            self.fabric.crash(self.endpoints[endpoint].ep).unwrap();
            self.endpoints[endpoint].crashed = true;
        }
        Ok(())
    }

    // ------------------------------------------------------------ pump and events

    fn pump(&mut self) -> Check {
        for side in 0..self.sides.len() {
            if !self.live(side) {
                continue;
            }
            let mut released = Vec::new();
            let s = &mut self.sides[side];
            let result = s.pump.drive(&mut s.session, &mut s.conn, &mut released);
            if std::env::var_os("SIM_TRACE").is_some() && (!released.is_empty() || result.is_err())
            {
                eprintln!(
                    "step {} side {side}: released {released:?} {result:?}",
                    self.step
                );
            }
            if let Err(e) = result {
                match e {
                    Error::Provider(ProviderError::Completion(
                        CompletionError::ReceiverNotReady,
                    )) if !self.delayed_reposts => {
                        return Err("receiver not ready without delayed re-posts".into());
                    }
                    // Also legitimate: after one side reset (abortive close, unread data on
                    // close), the other's RDMA in flight hits the revoked key of a released
                    // buffer and breaks the connection: a provider error instead of the Rst.
                    Error::Provider(_)
                        if self.fatal_faults
                            || self.delayed_reposts
                            || self.sides[self.sides[side].peer].session.state()
                                == SessionState::Reset => {}
                    other => return Err(format!("side {side}: drive failed: {other:?}")),
                }
            }
            for id in released {
                let s = &mut self.sides[side];
                let deferred = s.deferred_frees.remove(&id);
                if let Some(handle) = s.held.remove(&id) {
                    let endpoint = &mut self.endpoints[s.endpoint];
                    endpoint.cache.release(&mut endpoint.domain, handle);
                } // else: invalidated earlier, the cache already dropped it.
                if let Some(range) = deferred {
                    let endpoint = self.sides[side].endpoint;
                    self.free(endpoint, range);
                }
            }
            while let Some(event) = self.sides[side].session.poll_event() {
                self.on_event(side, event)?;
            }
        }
        Ok(())
    }

    fn on_event(&mut self, side: usize, event: Event) -> Check {
        if std::env::var_os("SIM_TRACE").is_some() {
            eprintln!("step {} side {side}: {event:?}", self.step);
        }
        let peer = self.sides[side].peer;
        let endpoint = self.sides[side].endpoint;
        match event {
            Event::SendComplete { ticket, result } => {
                let s = &mut self.sides[side];
                let Some(tx) = s.tx.take() else {
                    return Err(format!("side {side}: completion of an unknown send"));
                };
                ensure!(tx.ticket == ticket, "side {side}: wrong send ticket");
                match result {
                    Ok(n) => {
                        ensure!(
                            n <= tx.len,
                            "side {side}: send completed with {n} > {}",
                            tx.len
                        );
                        s.sent = tx.start + n;
                        if s.session.sends_use_read_mode() == Some(true) {
                            self.coverage.rendezvous_read_mode += 1;
                        } else {
                            self.coverage.rendezvous_write_mode += 1;
                        }
                        if n < tx.len {
                            self.coverage.short_counts += 1;
                        }
                    }
                    Err(SendError::NoBuffers) => s.sent = tx.start,
                    Err(_) => {
                        // Reset: the stream is dead; keep the upper bound for the checks.
                        s.sent = tx.start + tx.len;
                    }
                }
                self.app_free(side, tx.handle, tx.range);
            }
            Event::RecvComplete { ticket, result } => {
                let Some(rx) = self.sides[side].rx.take() else {
                    return Err(format!("side {side}: completion of an unknown receive"));
                };
                ensure!(rx.ticket == ticket, "side {side}: wrong receive ticket");
                if let Ok(n) = result {
                    ensure!(
                        n > 0 && n <= rx.range.len,
                        "side {side}: bad receive length {n}"
                    );
                    let ep = self.endpoints[endpoint].ep;
                    let bytes = self
                        .fabric
                        .read(ep, MemRange::new(rx.range.addr, n))
                        .unwrap();
                    let s = &mut self.sides[side];
                    ensure!(
                        bytes == pattern(peer as u64, s.received, n as usize),
                        "side {side}: zero-copy bytes at offset {} differ from the stream",
                        s.received
                    );
                    if !rx.peek {
                        s.received += n;
                    }
                    self.coverage.zero_copy_receives += 1;
                } else if result == Err(RecvError::Interrupted) {
                    self.coverage.interrupted_receives += 1;
                }
                self.app_free(side, rx.handle, rx.range);
            }
            Event::Reset(cause) => {
                if let ResetCause::PeerMisbehaved(why) = cause {
                    return Err(format!("side {side}: peer misbehaved: {why:?}"));
                }
                self.sides[side].reset = Some(cause);
                self.coverage.resets += 1;
            }
            Event::PeerDowngraded => {
                ensure!(
                    self.sides[side].session.peer_downgraded(),
                    "side {side}: PeerDowngraded without peer_downgraded()"
                );
            }
            Event::Established { .. } | Event::PeerClosed => {}
            _ => {}
        }
        Ok(())
    }

    // ------------------------------------------------------------ invariants

    fn check(&mut self) -> Check {
        ensure!(
            self.fabric.violation_count() == 0,
            "fabric violations: {:?}",
            self.fabric.violations()
        );
        for side in 0..self.sides.len() {
            if !self.live(side) {
                continue;
            }
            let s = &self.sides[side];
            let peer = &self.sides[s.peer];
            let session = &s.session;
            ensure!(
                session.send_credits().get() <= peer.slots.recv_slots,
                "side {side}: {} credits but the peer posts {}",
                session.send_credits(),
                peer.slots.recv_slots
            );
            ensure!(
                session.peer_credit_view() <= u64::from(s.slots.recv_slots),
                "side {side}: the peer was granted more than our slots"
            );
            ensure!(
                s.received <= peer.sent_upper(),
                "side {side}: received {} beyond what was sent ({})",
                s.received,
                peer.sent_upper()
            );
            let rx_bound = usize::from(s.slots.recv_slots) * s.slots.slot_size as usize;
            ensure!(
                session.recv_queue_len() <= rx_bound,
                "side {side}: receive queue unbounded"
            );
            ensure!(
                session.send_queue_len() <= s.send_buffer,
                "side {side}: send queue unbounded"
            );
            let state = session.state();
            let allowed = matches!(
                (s.state, state),
                (a, b) if a == b
            ) || matches!(
                (s.state, state),
                (SessionState::Handshaking, _)
                    | (
                        SessionState::Established,
                        SessionState::Closed | SessionState::Reset | SessionState::Downgraded
                    )
                    | (
                        SessionState::Closed,
                        SessionState::Reset | SessionState::Downgraded
                    )
            );
            ensure!(
                allowed,
                "side {side}: transition {:?} -> {state:?}",
                s.state
            );
            ensure!(
                state != SessionState::FellBack,
                "side {side}: fell back between v1 peers"
            );
            self.sides[side].state = state;
        }
        Ok(())
    }

    fn run_random_phase(&mut self, steps: usize) -> Check {
        self.pump()?;
        for step in 0..steps {
            self.step = step;
            self.act()?;
            let fabric_steps = self.rng.gen_range(0..8);
            for _ in 0..fabric_steps {
                self.fabric.step();
            }
            self.pump()?;
            self.check()?;
        }
        Ok(())
    }

    /// No more faults: everyone reads everything, shuts down, closes. Must finish within a
    /// bound, deliver every byte on connections that were not reset, and drain every
    /// registration reference.
    fn run_drain_phase(&mut self) -> Check {
        self.fabric.set_faults(FaultConfig::NONE);
        for s in &mut self.sides {
            s.paused = false;
        }
        let bound = 200_000;
        for round in 0..bound {
            self.step = round;
            let mut done = true;
            for side in 0..self.sides.len() {
                if !self.live(side) {
                    continue;
                }
                let state = self.sides[side].session.state();
                if matches!(state, SessionState::Reset) {
                    if !self.sides[side].session.is_quiescent() {
                        done = false;
                    }
                    continue;
                }
                self.receive(side, true)?;
                // A peer that crashed or reset without being able to send its Rst leaves an
                // idle connection that nothing would ever break (TCP without keepalive): the
                // application gives up and closes abortively, which sends and so detects.
                let peer = self.sides[side].peer;
                let peer_gone = !self.live(peer)
                    || (self.sides[peer].session.state() == SessionState::Reset
                        && self.sides[peer].session.is_quiescent());
                if peer_gone && round > 1000 {
                    self.sides[side].session.close(true);
                    self.sides[side].closed = true;
                }
                let s = &mut self.sides[side];
                if s.tx.is_none() && !s.shut_write {
                    s.session.shutdown(Shutdown::Write);
                    s.shut_write = true;
                }
                if s.eof && s.rx.is_none() && !s.closed && s.session.recv_queue_len() == 0 {
                    s.session.close(false);
                    s.closed = true;
                }
                if !s.session.is_quiescent() {
                    done = false;
                }
                // Downgraded is quiescent at once, but the application still reads the rest
                // of the stream from TCP before it closes.
                if s.session.state() == SessionState::Downgraded && !s.closed {
                    done = false;
                }
            }
            let stepped = self.fabric.step();
            self.pump()?;
            self.check()?;
            if done && !stepped {
                return self.final_checks();
            }
        }
        let stuck: Vec<String> = self
            .sides
            .iter()
            .enumerate()
            .filter(|(i, s)| self.live(*i) && !s.session.is_quiescent())
            .map(|(i, s)| {
                format!(
                    "side {i}: {:?} credits {} owed {} view {} sent {} received {} eof {} stats {:?}",
                    s.session.state(),
                    s.session.send_credits(),
                    s.session.credits_owed(),
                    s.session.peer_credit_view(),
                    s.sent,
                    s.received,
                    s.eof,
                    s.session.stats()
                )
            })
            .collect();
        Err(format!(
            "no progress within {bound} drain rounds: {stuck:#?}"
        ))
    }

    fn final_checks(&mut self) -> Check {
        for side in 0..self.sides.len() {
            if !self.live(side) {
                continue;
            }
            let s = &self.sides[side];
            let peer = &self.sides[s.peer];
            if s.session.state() == SessionState::Downgraded {
                self.coverage.downgrades += 1;
            }
            let clean =
                s.reset.is_none() && peer.reset.is_none() && !s.tcp_reset && self.live(s.peer);
            if clean {
                if s.session.state() == SessionState::Downgraded {
                    self.coverage.clean_downgrades += 1;
                }
                self.coverage.clean_connections += 1;
                self.coverage.bytes_delivered += s.received;
                ensure!(
                    s.received == peer.sent,
                    "side {side}: received {} of {} bytes on a connection that was not reset",
                    s.received,
                    peer.sent
                );
            }
            ensure!(
                s.held.is_empty(),
                "side {side}: handles never released: {:?}",
                s.held
            );
        }
        for (i, endpoint) in self.endpoints.iter().enumerate() {
            if endpoint.crashed {
                continue;
            }
            ensure!(
                endpoint.cache.entries().all(|e| e.refs == 0),
                "endpoint {i}: cache references did not drain to zero"
            );
            endpoint
                .cache
                .check_invariants()
                .map_err(|e| format!("endpoint {i}: cache invariant: {e}"))?;
        }
        ensure!(
            self.fabric.violation_count() == 0,
            "violations: {:?}",
            self.fabric.violations()
        );
        Ok(())
    }
}

pub fn run_seed(seed: u64, steps: usize, total: &mut Coverage) -> Result<(), String> {
    run_world(World::new(seed), seed, steps, total)
}

/// Runs the random phase for `steps` steps, then the drain phase, checking every invariant
/// after every step; the error names the seed, the phase and the step.
pub fn run_world<R: RngCore>(
    mut world: World<R>,
    seed: u64,
    steps: usize,
    total: &mut Coverage,
) -> Result<(), String> {
    let phase = |world: &mut World<R>, random: bool| {
        if random {
            world.run_random_phase(steps)
        } else {
            world.run_drain_phase()
        }
    };
    for random in [true, false] {
        let outcome = catch_unwind(AssertUnwindSafe(|| phase(&mut world, random)));
        let which = if random { "random" } else { "drain" };
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(why)) => {
                return Err(format!(
                    "seed {seed}, {which} phase, step {}: {why}",
                    world.step
                ))
            }
            Err(_) => {
                return Err(format!(
                    "seed {seed}, {which} phase, step {}: panicked",
                    world.step
                ))
            }
        }
    }
    let c = &world.coverage;
    total.bytes_delivered += c.bytes_delivered;
    total.rendezvous_read_mode += c.rendezvous_read_mode;
    total.rendezvous_write_mode += c.rendezvous_write_mode;
    total.short_counts += c.short_counts;
    total.zero_copy_receives += c.zero_copy_receives;
    total.interrupted_receives += c.interrupted_receives;
    total.resets += c.resets;
    total.clean_connections += c.clean_connections;
    total.downgrades += c.downgrades;
    total.clean_downgrades += c.clean_downgrades;
    total.tcp_bytes += c.tcp_bytes;
    total.sends_into_slots += c.sends_into_slots;
    total.unreadable_sends += c.unreadable_sends;
    Ok(())
}

/// An RNG that hands out the fuzzer's bytes, then zeros: every application and fault choice of
/// a fuzzed world is steered by the input, and an input always means the same run.
pub struct ByteRng<'a> {
    bytes: &'a [u8],
}

impl<'a> ByteRng<'a> {
    /// Choices taken from `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        ByteRng { bytes }
    }
}

impl RngCore for ByteRng<'_> {
    fn next_u32(&mut self) -> u32 {
        let mut word = [0u8; 4];
        self.fill_bytes(&mut word);
        u32::from_le_bytes(word)
    }

    fn next_u64(&mut self) -> u64 {
        let mut word = [0u8; 8];
        self.fill_bytes(&mut word);
        u64::from_le_bytes(word)
    }

    fn fill_bytes(&mut self, dest: &mut [u8]) {
        let taken = dest.len().min(self.bytes.len());
        dest[..taken].copy_from_slice(&self.bytes[..taken]);
        dest[taken..].fill(0);
        self.bytes = &self.bytes[taken..];
    }

    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

/// The `session_ops` fuzz body: the first 8 bytes seed the fabric's schedule, the rest steer
/// the application and the faults for up to 64 random steps, then everything must drain.
/// Panics (with the reproduction text) when any invariant breaks.
pub fn run_fuzz_input(data: &[u8]) {
    let (seed_bytes, choices) = data.split_at(data.len().min(8));
    let mut seed = [0u8; 8];
    seed[..seed_bytes.len()].copy_from_slice(seed_bytes);
    let seed = u64::from_le_bytes(seed);
    let steps = (choices.len() / 4).min(64);
    let world = World::with_rng(seed, ByteRng::new(choices));
    if let Err(why) = run_world(world, seed, steps, &mut Coverage::default()) {
        panic!("session_ops fuzz input broke an invariant: {why}");
    }
}
