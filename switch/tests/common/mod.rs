//! Shared test harness: two sessions over a `san-sim` connection (quinn's `Pair` idea),
//! with the registration cache and the generic driver in between, plus app-side helpers
//! that do what the preload does (register buffers, post zero-copy receives).
#![allow(dead_code)] // each test binary uses a different part of the harness

pub mod world;

use std::collections::HashMap;

use san_api::{Access, Capabilities, SlotConfig};
use san_sim::{EndpointId, FaultConfig, SimConnection, SimDomain, SimFabric, SimTiming};
use switch::error::{Error, RecvError, SendError};
use switch::mr_cache::{CacheConfig, MrCache, MrHandle, OwnerId};
use switch::session::{
    Event, MrHandleId, Pump, RecvFlags, RegisteredRange, Role, SendFlags, SendTicket, Session,
    SessionConfig,
};

/// The default capabilities of a side: RDMA read on, no iWARP rules.
pub fn caps(rdma_read: bool) -> Capabilities {
    Capabilities {
        rdma_read,
        write_with_imm: false,
        read_sink_needs_remote_write: false,
        active_side_sends_first: false,
        max_slot_size: 64 * 1024,
        max_slots: 1024,
        max_inline: 256,
        max_rdma_len: 1 << 30,
    }
}

pub const SLOTS: SlotConfig = SlotConfig {
    send_slots: 8,
    recv_slots: 8,
    slot_size: 256,
};

/// One side: endpoint, connection, session, cache and what the app observed.
pub struct Side {
    pub ep: EndpointId,
    pub conn: SimConnection,
    pub domain: SimDomain,
    pub session: Session,
    pub pump: Pump,
    pub cache: MrCache,
    pub owner: OwnerId,
    /// Handles the session holds (given to it, not yet released).
    pub held: HashMap<MrHandleId, MrHandle>,
    next_handle: u64,
    pub events: Vec<Event>,
    pub errors: Vec<Error>,
    pub releases: usize,
}

impl Side {
    /// Registers `range` with `access` through the cache and hands out a session handle.
    pub fn register(
        &mut self,
        range: san_api::MemRange,
        access: Access,
    ) -> Result<RegisteredRange, san_api::RegisterError> {
        let (handle, registration) = self
            .cache
            .get(&mut self.domain, self.owner, range, access)?;
        self.next_handle += 1;
        let id = MrHandleId(self.next_handle);
        self.held.insert(id, handle);
        Ok(RegisteredRange {
            range,
            registration,
            handle: id,
        })
    }

    /// Takes the events observed so far.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    pub fn established(&self) -> bool {
        self.events
            .iter()
            .any(|e| matches!(e, Event::Established { .. }))
    }
}

/// Two sessions connected over one simulated connection.
pub struct Pair {
    pub fabric: SimFabric,
    pub a: Side,
    pub b: Side,
}

/// How a pair is built.
#[derive(Clone, Copy)]
pub struct PairConfig {
    pub seed: u64,
    pub faults: FaultConfig,
    pub caps_a: Capabilities,
    pub caps_b: Capabilities,
    pub slots: SlotConfig,
    pub session: SessionConfig,
}

impl Default for PairConfig {
    fn default() -> Self {
        PairConfig {
            seed: 1,
            faults: FaultConfig::NONE,
            caps_a: caps(true),
            caps_b: caps(true),
            slots: SLOTS,
            session: SessionConfig {
                send_buffer: 4096,
                ..SessionConfig::default()
            },
        }
    }
}

impl Pair {
    /// A pair, not yet driven (the handshake happens on the first `run`).
    pub fn new(config: PairConfig) -> Pair {
        let fabric = SimFabric::with_timing(config.seed, config.faults, SimTiming::default());
        let (ep_a, ep_b) = (fabric.add_endpoint(), fabric.add_endpoint());
        fabric.set_capabilities(ep_a, config.caps_a).unwrap();
        fabric.set_capabilities(ep_b, config.caps_b).unwrap();
        let (conn_a, conn_b) = fabric
            .connect(ep_a, ep_b, config.slots, config.slots)
            .unwrap();
        let side = |ep, conn, role, caps, owner, tcp_bytes| Side {
            ep,
            conn,
            domain: fabric.domain(ep),
            session: Session::new(role, config.session, caps, config.slots, tcp_bytes),
            pump: Pump::new(),
            cache: MrCache::new(CacheConfig::default()),
            owner: OwnerId(owner),
            held: HashMap::new(),
            next_handle: 0,
            events: Vec::new(),
            errors: Vec::new(),
            releases: 0,
        };
        let a = side(ep_a, conn_a, Role::Active, config.caps_a, 1, 11);
        let b = side(ep_b, conn_b, Role::Passive, config.caps_b, 2, 22);
        Pair { fabric, a, b }
    }

    /// A pair run until the handshake is done.
    pub fn established(config: PairConfig) -> Pair {
        let mut pair = Pair::new(config);
        pair.run();
        assert!(pair.a.established() && pair.b.established(), "handshake");
        pair.a.events.clear();
        pair.b.events.clear();
        pair
    }

    /// Drives both sessions once; true if anything happened.
    pub fn drive_once(&mut self) -> bool {
        let mut any = false;
        for side in [&mut self.a, &mut self.b] {
            let mut released = Vec::new();
            match side
                .pump
                .drive(&mut side.session, &mut side.conn, &mut released)
            {
                Ok(progress) => any |= !progress.is_idle(),
                Err(e) => {
                    side.errors.push(e);
                    any = true;
                }
            }
            for id in released {
                let handle = side
                    .held
                    .remove(&id)
                    .unwrap_or_else(|| panic!("session released {id:?}, which it never held"));
                side.cache.release(&mut side.domain, handle);
                side.releases += 1;
            }
            while let Some(event) = side.session.poll_event() {
                side.events.push(event);
                any = true;
            }
        }
        any
    }

    /// Drives and steps the fabric until nothing is left to do.
    pub fn run(&mut self) {
        for _ in 0..1_000_000 {
            let progressed = self.drive_once();
            if !self.fabric.step() && !progressed {
                return;
            }
        }
        panic!("pair did not go idle");
    }

    pub fn side(&mut self, which: Which) -> &mut Side {
        match which {
            Which::A => &mut self.a,
            Which::B => &mut self.b,
        }
    }

    /// Sends all of `data` inline from `from`, running the pair whenever it would block.
    pub fn send_inline(&mut self, from: Which, data: &[u8]) {
        let mut sent = 0;
        while sent < data.len() {
            match self
                .side(from)
                .session
                .send(&data[sent..], SendFlags::default())
            {
                Ok(n) => sent += n,
                Err(SendError::WouldBlock) => self.run(),
                Err(e) => panic!("send: {e}"),
            }
        }
        self.run();
    }

    /// Sends `data` inline from `from` while `to` reads, as two applications would;
    /// returns what `to` received (until `data.len()` bytes or the stream stalls).
    pub fn transfer_inline(&mut self, from: Which, to: Which, data: &[u8]) -> Vec<u8> {
        let mut sent = 0;
        let mut got = Vec::new();
        let mut stalled_rounds = 0;
        while got.len() < data.len() && stalled_rounds < 100 {
            let before = (sent, got.len());
            if sent < data.len() {
                match self
                    .side(from)
                    .session
                    .send(&data[sent..], SendFlags::default())
                {
                    Ok(n) => sent += n,
                    Err(SendError::WouldBlock) => {}
                    Err(e) => panic!("send: {e}"),
                }
            }
            self.run();
            got.extend(
                self.recv_up_to(to, data.len() - got.len(), 1 << 20)
                    .expect("recv"),
            );
            stalled_rounds = if before == (sent, got.len()) {
                stalled_rounds + 1
            } else {
                0
            };
        }
        got
    }

    /// Starts a rendezvous send of `data` (first `prefix` bytes inline) from `from`.
    pub fn send_rendezvous(&mut self, from: Which, data: &[u8], prefix: usize) -> SendTicket {
        let side = self.side(from);
        let read_mode = side.session.sends_use_read_mode().expect("established");
        let ep = side.ep;
        let rest = &data[prefix..];
        let range = self.fabric.alloc(ep, rest.len() as u64).unwrap();
        self.fabric.write(ep, range, rest).unwrap();
        let side = self.side(from);
        let access = if read_mode {
            Access::REMOTE_READ
        } else {
            Access::NONE
        };
        let registered = side.register(range, access).expect("register");
        side.session
            .send_rendezvous(&data[..prefix], registered)
            .expect("send_rendezvous")
    }

    /// The receive loop of a driver: reads up to `max` bytes from `to`, inline or zero-copy
    /// with sinks of `sink_len` bytes, until `max` bytes, EOF, or nothing more arrives.
    pub fn recv_up_to(
        &mut self,
        to: Which,
        max: usize,
        sink_len: u64,
    ) -> Result<Vec<u8>, RecvError> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        while out.len() < max {
            let want = (max - out.len()).min(buf.len());
            let side = self.side(to);
            match side
                .session
                .recv_from_slots(&mut buf[..want], RecvFlags::default(), &side.conn)
            {
                Ok(0) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(RecvError::RemoteSegment { .. }) => {
                    let cap = sink_len.min((max - out.len()) as u64);
                    match self.zero_copy_recv(to, cap, RecvFlags::default())? {
                        Some(bytes) => out.extend_from_slice(&bytes),
                        None => continue,
                    }
                }
                Err(RecvError::WouldBlock) => {
                    let before = self.fabric.steps();
                    self.run();
                    let readable = self.side(to).session.readiness().readable;
                    if !readable && self.fabric.steps() == before {
                        break;
                    }
                    if !readable {
                        break;
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Posts one zero-copy receive of at most `len` bytes and runs until it completes.
    /// `Ok(None)` when it was interrupted (the caller receives again).
    pub fn zero_copy_recv(
        &mut self,
        to: Which,
        len: u64,
        flags: RecvFlags,
    ) -> Result<Option<Vec<u8>>, RecvError> {
        let caps = self.side(to).conn.capabilities();
        let ep = self.side(to).ep;
        let range = self.fabric.alloc(ep, len).unwrap();
        let access = if caps.rdma_read {
            Access::LOCAL_WRITE
        } else {
            Access::LOCAL_WRITE | Access::REMOTE_WRITE
        };
        let side = self.side(to);
        let sink = side.register(range, access).expect("register sink");
        let ticket = side.session.post_recv(sink, flags)?;
        self.run();
        let side = self.side(to);
        let position = side
            .events
            .iter()
            .position(|e| matches!(e, Event::RecvComplete { ticket: t, .. } if *t == ticket))
            .expect("zero-copy receive completed");
        let Event::RecvComplete { result, .. } = side.events.remove(position) else {
            unreachable!()
        };
        match result {
            Ok(n) => {
                let got = san_api::MemRange::new(range.addr, n);
                Ok(Some(self.fabric.read(ep, got).unwrap()))
            }
            Err(RecvError::Interrupted) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Asserts that every handle given to either session was released.
    pub fn assert_all_released(&self) {
        assert!(
            self.a.held.is_empty(),
            "A still holds {:?}",
            self.a.held.keys()
        );
        assert!(
            self.b.held.is_empty(),
            "B still holds {:?}",
            self.b.held.keys()
        );
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    A,
    B,
}

/// A deterministic byte pattern: byte `i` of stream `stream`.
pub fn pattern(stream: u64, start: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| pattern_byte(stream, start + i))
        .collect()
}

pub fn pattern_byte(stream: u64, offset: u64) -> u8 {
    let x = offset
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(stream.wrapping_mul(0xD1B5_4A32_D192_ED03));
    (x >> 56) as u8 ^ (offset as u8)
}
