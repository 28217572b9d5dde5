//! Shared helpers of the san-sim integration tests.
#![allow(dead_code)]

use san_api::{
    Access, Completion, CompletionKind, LocalSegment, MemRange, RecvSlot, Registration,
    SanConnection, SanDomain, SlotConfig, WrId,
};
use san_sim::{EndpointId, FaultConfig, SimConnection, SimDomain, SimFabric};

pub const SLOTS: SlotConfig = SlotConfig {
    send_slots: 8,
    recv_slots: 8,
    slot_size: 512,
};

/// Two endpoints joined by one connection.
pub struct Pair {
    pub fabric: SimFabric,
    pub a: EndpointId,
    pub b: EndpointId,
    pub conn_a: SimConnection,
    pub conn_b: SimConnection,
    pub dom_a: SimDomain,
    pub dom_b: SimDomain,
}

impl Pair {
    pub fn new(seed: u64, faults: FaultConfig) -> Pair {
        let fabric = SimFabric::new(seed, faults);
        Pair::on(fabric)
    }

    pub fn on(fabric: SimFabric) -> Pair {
        let a = fabric.add_endpoint();
        let b = fabric.add_endpoint();
        let (conn_a, conn_b) = fabric.connect(a, b, SLOTS, SLOTS).unwrap();
        Pair {
            dom_a: fabric.domain(a),
            dom_b: fabric.domain(b),
            fabric,
            a,
            b,
            conn_a,
            conn_b,
        }
    }

    pub fn run(&self) {
        let steps = self.fabric.run_until_idle(1_000_000);
        assert!(
            self.fabric.is_idle(),
            "fabric still busy after {steps} steps"
        );
    }
}

/// Every completion `conn` has queued now.
pub fn drain(conn: &mut SimConnection) -> Vec<Completion> {
    let mut out = Vec::new();
    while conn.poll_completions(&mut out, 3) > 0 {}
    out
}

/// A deterministic, position-dependent byte pattern.
pub fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
        .collect()
}

/// Allocates `len` bytes at `ep`, fills them with `bytes` (or leaves zeroes) and registers
/// them with `access`.
pub fn registered(
    fabric: &SimFabric,
    domain: &mut SimDomain,
    ep: EndpointId,
    len: u64,
    fill: Option<&[u8]>,
    access: Access,
) -> Registration {
    let range = fabric.alloc(ep, len).unwrap();
    if let Some(bytes) = fill {
        fabric.write(ep, range, bytes).unwrap();
    }
    domain.register(range, access).unwrap()
}

pub fn segment(reg: &Registration, offset: u64, len: u64) -> LocalSegment {
    LocalSegment {
        range: reg.range.slice(offset, len).unwrap(),
        lkey: reg.lkey,
    }
}

pub fn recv_bytes(conn: &SimConnection, completion: &Completion) -> Vec<u8> {
    match completion.kind {
        CompletionKind::Recv { slot, len } => conn.recv_slot(slot, len).to_vec(),
        other => panic!("not a receive: {other:?}"),
    }
}

pub fn post_all_recvs(conn: &mut SimConnection, base_wr: u64) {
    for slot in 0..conn.slot_config().recv_slots {
        conn.post_recv(WrId(base_wr + u64::from(slot)), RecvSlot(slot))
            .unwrap();
    }
}

pub fn range_of(reg: &Registration) -> MemRange {
    reg.range
}
