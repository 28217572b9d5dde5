//! The rendezvous over the simulated link: a registration domain for this process's own
//! memory and the RDMA of the application's buffers.
//!
//! A `san-sim` fabric moves simulated memory, while a rendezvous moves the application's
//! buffers. Both ends of a simulated pair live in this process, so a pair that offers
//! rendezvous gets a registration cache of its own in front of a [`TestDomain`] (keys for
//! real memory ranges, nothing pinned), and its links post every RDMA read or write twice:
//! to the fabric as a stand-in of the same kind between two scratch ranges of simulated
//! memory (so the fabric's seeded delays, reordering and failures decide when, and whether,
//! it completes), and as a [`RealOp`] kept by the initiating link. When the initiator polls
//! the stand-in's successful completion the real bytes move ([`perform`]): the latest moment a
//! device could have moved them, so a session that used them before its completion would
//! read stale bytes. A real op whose keys no longer hold is not performed: it completes
//! with the device's error and is recorded as a violation (the cases assert none).

use std::collections::HashMap;

use san_api::{
    Access, Capabilities, CompletionError, LocalKey, LocalSegment, MemRange, RegisterError,
    Registration, RemoteDescriptor, RemoteKey, SanDomain,
};
use san_sim::{EndpointId, SimFabric};

use crate::san::registrations::SharedRegistrations;

/// Bytes of simulated memory each end's stand-in RDMA requests use (a stand-in moves at
/// most this much, whatever the real op's length).
const SCRATCH: u64 = 64 << 10;

/// How a pair offers rendezvous.
#[derive(Clone, Copy, Debug)]
pub(super) struct Rendezvous {
    /// READ mode (the receiver reads the sender's buffer); else WRITE mode (the sender
    /// writes into the sink the receiver advertises).
    pub read_mode: bool,
    /// The largest single RDMA request (a segment larger than this moves in several).
    pub max_rdma_len: u64,
}

impl Rendezvous {
    pub(super) const READ: Rendezvous = Rendezvous {
        read_mode: true,
        max_rdma_len: 1 << 20,
    };
    pub(super) const WRITE: Rendezvous = Rendezvous {
        read_mode: false,
        max_rdma_len: 1 << 20,
    };
}

/// A registration of the test domain.
struct TestReg {
    range: MemRange,
    access: Access,
    rkey: Option<u32>,
}

/// Keys for memory ranges of this process: what a pair's registration cache registers the
/// application's buffers with. Keys are never reused, so a revoked or deregistered key never
/// works again.
#[derive(Default)]
pub(crate) struct TestDomain {
    next_key: u32,
    regs: HashMap<u32, TestReg>,
    /// Live rkey → its lkey.
    rkeys: HashMap<u32, u32>,
}

impl TestDomain {
    fn take_key(&mut self) -> u32 {
        self.next_key += 1;
        self.next_key
    }

    /// Whether `segment` lies in a live registration with `needed` rights.
    fn covers_local(&self, segment: &LocalSegment, needed: Access) -> bool {
        self.regs
            .get(&segment.lkey.0)
            .is_some_and(|reg| reg.range.contains(&segment.range) && reg.access.contains(needed))
    }

    /// Whether `len` bytes at `remote` lie in a registration exposed through its live rkey
    /// with `needed` rights.
    fn covers_remote(&self, remote: &RemoteDescriptor, len: u64, needed: Access) -> bool {
        let range = MemRange::new(remote.addr, len);
        len <= remote.len
            && self
                .rkeys
                .get(&remote.rkey.0)
                .and_then(|lkey| self.regs.get(lkey))
                .is_some_and(|reg| reg.range.contains(&range) && reg.access.contains(needed))
    }
}

impl SanDomain for TestDomain {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rdma_read: true,
            write_with_imm: false,
            read_sink_needs_remote_write: false,
            active_side_sends_first: false,
            max_slot_size: 64 << 10,
            max_slots: 1024,
            max_inline: 256,
            max_rdma_len: 1 << 30,
        }
    }

    fn register(&mut self, range: MemRange, access: Access) -> Result<Registration, RegisterError> {
        if range.len == 0 || range.addr.checked_add(range.len).is_none() {
            return Err(RegisterError::BadAddress);
        }
        let lkey = self.take_key();
        let rkey = access.is_remote().then(|| self.take_key());
        self.regs.insert(
            lkey,
            TestReg {
                range,
                access,
                rkey,
            },
        );
        if let Some(rkey) = rkey {
            self.rkeys.insert(rkey, lkey);
        }
        Ok(Registration {
            range,
            access,
            lkey: LocalKey(lkey),
            rkey: rkey.map(RemoteKey),
        })
    }

    fn deregister(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        let reg = self.regs.remove(&lkey.0).ok_or(RegisterError::UnknownKey)?;
        if let Some(rkey) = reg.rkey {
            self.rkeys.remove(&rkey);
        }
        Ok(())
    }

    fn revoke_remote(&mut self, lkey: LocalKey) -> Result<(), RegisterError> {
        let reg = self
            .regs
            .get_mut(&lkey.0)
            .ok_or(RegisterError::UnknownKey)?;
        if let Some(rkey) = reg.rkey.take() {
            self.rkeys.remove(&rkey);
        }
        Ok(())
    }

    fn expose_remote(
        &mut self,
        lkey: LocalKey,
        access: Access,
    ) -> Result<RemoteKey, RegisterError> {
        if !access.is_remote() {
            return Err(RegisterError::Unsupported);
        }
        let rkey = self.take_key();
        let reg = self
            .regs
            .get_mut(&lkey.0)
            .ok_or(RegisterError::UnknownKey)?;
        let remote = Access::REMOTE_READ.bits() | Access::REMOTE_WRITE.bits();
        reg.access =
            Access::from_bits_truncate((reg.access.bits() & !remote) | (access.bits() & remote));
        if let Some(old) = reg.rkey.replace(rkey) {
            self.rkeys.remove(&old);
        }
        self.rkeys.insert(rkey, lkey.0);
        Ok(RemoteKey(rkey))
    }
}

/// One RDMA request on the application's memory, kept by the link that posted it until its
/// stand-in completes.
#[derive(Clone, Copy, Debug)]
pub(super) struct RealOp {
    /// An RDMA read (else a write).
    pub read: bool,
    pub local: LocalSegment,
    pub remote: RemoteDescriptor,
}

/// The stand-in ranges of one end: its own scratch and the peer's, exposed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Scratch {
    local: LocalSegment,
    remote: RemoteDescriptor,
}

impl Scratch {
    /// The stand-in of a request of `len` bytes.
    pub(super) fn stand_in(&self, len: u64) -> (LocalSegment, RemoteDescriptor) {
        let len = len.clamp(1, SCRATCH);
        (
            LocalSegment {
                range: MemRange::new(self.local.range.addr, len),
                lkey: self.local.lkey,
            },
            RemoteDescriptor { len, ..self.remote },
        )
    }
}

/// Sets a pair of endpoints up for rendezvous before they connect: their capabilities (the
/// mode, the largest request), a scratch range of simulated memory each for the stand-ins,
/// and the registration cache both ends register with (one per pair: refusals asked of it
/// are this pair's alone; leaked, as the sockets need it for the rest of the process).
pub(super) fn set_up(
    fabric: &SimFabric,
    ends: [EndpointId; 2],
    rendezvous: Rendezvous,
) -> ([Scratch; 2], &'static SharedRegistrations) {
    let mut exposed = Vec::new();
    for ep in ends {
        let caps = Capabilities {
            rdma_read: rendezvous.read_mode,
            max_rdma_len: rendezvous.max_rdma_len,
            ..fabric.capabilities(ep)
        };
        fabric.set_capabilities(ep, caps).expect("capabilities");
        let range = fabric.alloc(ep, SCRATCH).expect("scratch memory");
        let registration = fabric
            .domain(ep)
            .register(
                range,
                Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE,
            )
            .expect("scratch registration");
        exposed.push((
            LocalSegment {
                range,
                lkey: registration.lkey,
            },
            registration
                .remote_descriptor(range)
                .expect("scratch exposed"),
        ));
    }
    let scratch = |side: usize| Scratch {
        local: exposed[side].0,
        remote: exposed[1 - side].1,
    };
    let registrations = Box::leak(Box::new(SharedRegistrations::test(TestDomain::default())));
    ([scratch(0), scratch(1)], registrations)
}

/// Moves the bytes of `op` in this process's memory: `Ok`, or the error a device would
/// report when a key does not cover its range (nothing moved), with what was wrong.
pub(super) fn perform(
    registrations: &SharedRegistrations,
    op: &RealOp,
) -> Result<(), (CompletionError, String)> {
    let held = registrations.lock();
    let domain = held
        .test_domain()
        .ok_or((CompletionError::Fatal, "no test domain".to_string()))?;
    let len = op.local.range.len;
    let (local_rights, remote_rights) = if op.read {
        (Access::LOCAL_WRITE, Access::REMOTE_READ)
    } else {
        (Access::NONE, Access::REMOTE_WRITE)
    };
    if !domain.covers_local(&op.local, local_rights) {
        return Err((
            CompletionError::LocalProtection,
            format!("{op:?}: the local key does not cover the segment"),
        ));
    }
    if !domain.covers_remote(&op.remote, len, remote_rights) {
        return Err((
            CompletionError::RemoteAccess,
            format!("{op:?}: the remote key does not cover the range"),
        ));
    }
    let (from, to) = if op.read {
        (op.remote.addr, op.local.range.addr)
    } else {
        (op.local.range.addr, op.remote.addr)
    };
    let len = usize::try_from(len).map_err(|_| (CompletionError::Fatal, format!("{op:?}")))?;
    // SAFETY: both ranges are memory of this process, checked just now (under the lock that
    // every release and revocation takes) to lie in registrations of this pair's domain: the
    // remote one exposed through a live rkey, which the cache revokes as soon as the owning
    // session releases it (it releases it only once the rendezvous holding the caller's
    // buffer ended); the local one in the request of the initiator's session, whose
    // rendezvous holds its buffer until it handled this completion (being delivered now).
    // Each is the buffer of a blocking send or receive (or a receive's staging buffer) that
    // does not return before that. `copy`: overlap is impossible, but harmless.
    unsafe { core::ptr::copy(from as *const u8, to as *mut u8, len) };
    Ok(())
}
