//! In-process tests of the SAN socket path.
//!
//! Two SAN sockets of this process, a client and an acceptor, whose kernel sockets are a real
//! loopback TCP pair (the application's descriptor is always a kernel socket) and whose
//! connection is a seeded `san-sim` pair ([`SimLink`], `Link::Sim`). The tests call what the
//! hooks call — `send_iov`, `recv_iov`, `on_shutdown`, `on_released`, `downgrade_all` — with
//! both sockets installed in the slot table, so the switch-over, the send and receive loops,
//! the downgrade and the close run as they do under the preload, while the simulation
//! delays, reorders and postpones what it carries.
//!
//! A pair may offer rendezvous (`Pair::switched_with`): it then has a registration cache of
//! its own in front of a test domain, and its links move the application's buffers by
//! simulated RDMA (see [`rdma`]); the others never offer it, whatever the process settings.
//!
//! Every seeded test runs a handful of seeds; `SIM_SEED=N` runs seed `N` alone. A failure
//! names its seed. Each run is bounded: a hang fails the test instead of stalling it.

use core::ffi::c_int;
use std::collections::{HashMap, VecDeque};
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use san_api::{
    AppSource, BadAddress, Capabilities, Completion, CompletionKind, LocalSegment, PostError,
    RecvSlot, RemoteDescriptor, SanConnection, SlotConfig, WrId,
};
use san_shm::WaitResult;
use san_sim::{FaultConfig, SimConnection, SimFabric};

use super::accept::install;
use super::kernel::RawBuf;
use super::link::Link;
use super::registrations::SharedRegistrations;
use super::socket::{Phase, SanSocket, Side};
use super::switchover::switch_pending;
use super::table::{lock, SanObject};
use super::tunables::SLOTS;
use super::{downgrade_all, on_released, on_shutdown, recv_iov, send_iov};
use crate::discovery::{ConnectionKey, SegmentName};
use crate::errno::{self, Errno};
use crate::record::{flags, Counter, SocketRecord, SocketState};
use crate::registry::registry;

// ----- the simulated link ------------------------------------------------------------------

/// The fabric and both ends of one simulated connection.
struct SimWorld {
    fabric: SimFabric,
    /// How many fabric events each drive runs (seeded: drives see partial progress).
    rng: ChaCha8Rng,
    conns: [Option<SimConnection>; 2],
    /// Side `i` posted a receive: messages to it may leave.
    receiving: [bool; 2],
    /// Polls of each side's completions that find none yet (a fabric slower than TCP, see
    /// [`Pair::lag_completions`]).
    lagging_polls: [u32; 2],
    /// Messages side `i` posted before its peer could receive (the acceptor's `Hello`, sent
    /// before the client's session exists): the shm provider keeps them the same way.
    outbox: [VecDeque<(WrId, Vec<u8>)>; 2],
    /// RDMA requests on the application's memory that could not be performed (see
    /// [`rdma::perform`]): none, in a correct rendezvous.
    rdma_violations: Vec<String>,
}

// SAFETY: every `Rc` behind this fabric (the fabric handle and both connection handles) is a
// field of this one value and none leaves it (the methods below hand out plain data), so
// moving the value moves the whole reference graph; the `Mutex` of `SharedWorld` serialises
// every access to it.
unsafe impl Send for SimWorld {}

type SharedWorld = Arc<Mutex<SimWorld>>;

fn world(shared: &SharedWorld) -> MutexGuard<'_, SimWorld> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl SimWorld {
    /// Lets a little simulated time pass (a seeded number of ticks, or up to the next event
    /// when none is due sooner), running every event due by then, then posts what waited for
    /// a receiver. Time, not a count of events: a fabric's progress per unit of time does not
    /// shrink when more receives are posted (each is an event of its own).
    fn run(&mut self) {
        self.flush();
        let ticks = self.rng.gen_range(1..=8);
        if let Some(next) = self.fabric.next_event_time() {
            let until = next.max(self.fabric.now()).max(self.fabric.now() + ticks);
            while self.fabric.next_event_time().is_some_and(|at| at <= until) {
                self.fabric.step();
            }
        }
        self.flush();
    }

    fn flush(&mut self) {
        for side in 0..2 {
            let Some(conn) = self.conns[side].as_mut() else {
                self.outbox[side].clear();
                continue;
            };
            if conn.is_broken() {
                self.outbox[side].clear();
                continue;
            }
            if !self.receiving[1 - side] {
                continue;
            }
            while let Some((wr_id, message)) = self.outbox[side].front() {
                if conn.post_send(*wr_id, message).is_err() {
                    break;
                }
                self.outbox[side].pop_front();
            }
        }
    }

    /// A completion waits for side `side`, or the fabric still has events to run.
    fn has_news(&self, side: usize) -> bool {
        self.conns[side]
            .as_ref()
            .is_some_and(|c| c.queued_completions() > 0)
            || !self.fabric.is_idle()
    }
}

/// One end of a simulated connection, as the socket code sees it (`Link::Sim`).
pub(crate) struct SimLink {
    world: SharedWorld,
    side: usize,
    caps: Capabilities,
    slots: SlotConfig,
    /// Received messages, copied out of the connection when their completion is polled
    /// (`recv_slot` lends them while the world's lock is not held).
    slot_bytes: Vec<Vec<u8>>,
    /// The acceptor "attached" (set by the harness once the acceptor is set up).
    attached: Arc<AtomicBool>,
    /// Rendezvous pairs: the pair's registrations and this end's stand-in ranges.
    rendezvous: Option<(&'static SharedRegistrations, Scratch)>,
    /// RDMA requests on the application's memory, by the id of their stand-ins.
    rdma: HashMap<WrId, RealOp>,
    /// Messages staged (copied out of the application's memory), posted at the commit.
    staged: Vec<(WrId, Vec<u8>)>,
}

impl SimLink {
    fn world(&self) -> MutexGuard<'_, SimWorld> {
        world(&self.world)
    }

    pub(crate) fn capabilities(&self) -> Capabilities {
        self.caps
    }

    pub(crate) fn is_up(&self) -> bool {
        self.world().conns[self.side]
            .as_ref()
            .is_some_and(|c| !c.is_broken())
    }

    /// Runs the fabric a little: true when a completion waits or events are still to run.
    pub(crate) fn has_input(&self) -> bool {
        let mut world = self.world();
        world.run();
        world.has_news(self.side)
    }

    pub(crate) fn prepare_to_block(&self) -> bool {
        !self.has_input()
    }

    pub(crate) fn has_queued_sends(&self) -> bool {
        !self.world().outbox[self.side].is_empty()
    }

    pub(crate) fn wait(&self, timeout: Duration) -> WaitResult {
        if self.has_input() {
            return WaitResult::Notified;
        }
        if !self.is_up() {
            return WaitResult::Disconnected;
        }
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
        WaitResult::TimedOut
    }

    pub(crate) fn close(&mut self) {
        self.rdma.clear();
        let mut world = self.world();
        world.conns[self.side] = None;
        world.outbox[self.side].clear();
    }

    pub(crate) fn peer_attached(&self) -> bool {
        self.attached.load(Ordering::Acquire)
    }

    pub(crate) fn slot_config(&self) -> SlotConfig {
        self.slots
    }

    pub(crate) fn offers_rendezvous(&self) -> bool {
        self.rendezvous.is_some()
    }

    pub(crate) fn registrations(&self) -> Option<&'static SharedRegistrations> {
        self.rendezvous.map(|(registrations, _)| registrations)
    }

    /// Posts an RDMA request: its stand-in to the fabric, the real one kept until then.
    fn post_rdma(&mut self, wr_id: WrId, op: RealOp) -> Result<(), PostError> {
        let (_, scratch) = self.rendezvous.ok_or(PostError::InvalidArgument)?;
        let (local, remote) = scratch.stand_in(op.local.range.len);
        let side = self.side;
        let mut world = self.world();
        let conn = world.conns[side].as_mut().ok_or(PostError::Disconnected)?;
        if op.read {
            conn.post_read(wr_id, local, remote)?;
        } else {
            conn.post_write(wr_id, local, remote)?;
        }
        drop(world);
        self.rdma.insert(wr_id, op);
        Ok(())
    }

    /// Performs the real RDMA requests whose stand-ins completed among `completions`.
    fn complete_rdma(&mut self, completions: &mut [Completion]) {
        for completion in completions {
            if !matches!(
                completion.kind,
                CompletionKind::Read | CompletionKind::Write
            ) {
                continue;
            }
            let Some(op) = self.rdma.remove(&completion.wr_id) else {
                continue;
            };
            let Some((registrations, _)) = self.rendezvous else {
                continue;
            };
            if completion.status.is_ok() {
                if let Err((status, what)) = rdma::perform(registrations, &op) {
                    completion.status = Err(status);
                    self.world().rdma_violations.push(what);
                }
            }
        }
    }

    pub(crate) fn post_send(&mut self, wr_id: WrId, message: &[u8]) -> Result<(), PostError> {
        if message.len() > self.slots.slot_size as usize {
            return Err(PostError::TooLong);
        }
        let side = self.side;
        let mut world = self.world();
        if world.conns[side].as_ref().is_none_or(|c| c.is_broken()) {
            return Err(PostError::Disconnected);
        }
        world.outbox[side].push_back((wr_id, message.to_vec()));
        world.flush();
        Ok(())
    }

    /// As the shm connection stages: the copy out of the application's memory comes first,
    /// and a fault there takes nothing.
    pub(crate) fn stage_send_from(
        &mut self,
        wr_id: WrId,
        head: &[u8],
        payload: &dyn AppSource,
    ) -> Result<bool, BadAddress> {
        let len = head.len().saturating_add(payload.len());
        if len > self.slots.slot_size as usize || !self.is_up() {
            return Ok(false);
        }
        let mut message = vec![0u8; len];
        message[..head.len()].copy_from_slice(head);
        payload.copy_to(0, &mut message[head.len()..])?;
        self.staged.push((wr_id, message));
        Ok(true)
    }

    pub(crate) fn commit_staged(&mut self) {
        for (wr_id, message) in core::mem::take(&mut self.staged) {
            // (Length and state were checked when it was staged.)
            let posted = self.post_send(wr_id, &message);
            debug_assert!(posted.is_ok(), "a staged message could not be posted");
        }
    }

    pub(crate) fn discard_staged(&mut self) {
        self.staged.clear();
    }

    pub(crate) fn post_recv(&mut self, wr_id: WrId, slot: RecvSlot) -> Result<(), PostError> {
        let side = self.side;
        {
            let mut world = self.world();
            world.conns[side]
                .as_mut()
                .ok_or(PostError::Disconnected)?
                .post_recv(wr_id, slot)?;
            world.receiving[side] = true;
            world.flush();
        }
        if let Some(bytes) = self.slot_bytes.get_mut(usize::from(slot.0)) {
            bytes.clear();
        }
        Ok(())
    }

    pub(crate) fn recv_slot(&self, slot: RecvSlot, len: u32) -> &[u8] {
        self.slot_bytes
            .get(usize::from(slot.0))
            .map_or(&[][..], |bytes| &bytes[..bytes.len().min(len as usize)])
    }

    pub(crate) fn post_write(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.post_rdma(
            wr_id,
            RealOp {
                read: false,
                local,
                remote,
            },
        )
    }

    pub(crate) fn post_read(
        &mut self,
        wr_id: WrId,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), PostError> {
        self.post_rdma(
            wr_id,
            RealOp {
                read: true,
                local,
                remote,
            },
        )
    }

    pub(crate) fn poll_completions(&mut self, out: &mut Vec<Completion>, max: usize) -> usize {
        let side = self.side;
        let shared = self.world.clone();
        let first = out.len();
        let count = {
            let mut world = world(&shared);
            world.run();
            if world.lagging_polls[side] > 0 {
                world.lagging_polls[side] -= 1;
                return 0;
            }
            let Some(conn) = world.conns[side].as_mut() else {
                return 0;
            };
            let count = conn.poll_completions(out, max);
            for completion in &out[first..] {
                if let (CompletionKind::Recv { slot, len }, Ok(())) =
                    (completion.kind, completion.status)
                {
                    if let Some(bytes) = self.slot_bytes.get_mut(usize::from(slot.0)) {
                        *bytes = conn.recv_slot(slot, len).to_vec();
                    }
                }
            }
            count
        };
        self.complete_rdma(&mut out[first..]);
        count
    }
}

// ----- the harness -------------------------------------------------------------------------

/// One end: the kernel socket and its record (slot index).
struct End {
    fd: c_int,
    index: u32,
    record: &'static SocketRecord,
    released: AtomicBool,
}

/// A client and an acceptor over one simulated connection.
struct Pair {
    world: SharedWorld,
    attached: Arc<AtomicBool>,
    name: SegmentName,
    client: End,
    acceptor: End,
    /// The acceptor's link until [`Pair::attach`] sets the acceptor up.
    acceptor_link: Mutex<Option<SimLink>>,
    /// Rendezvous pairs: the registrations both ends register with.
    registrations: Option<&'static SharedRegistrations>,
}

/// Faults the simulation injects in the seeded tests: nothing that breaks the connection.
fn benign_faults() -> FaultConfig {
    FaultConfig {
        completion_delay: 0.05,
        reorder: 0.05,
        delayed_repost: 0.05,
        ..FaultConfig::NONE
    }
}

impl Pair {
    /// A connected TCP pair whose client is a pending SAN socket (nothing attached yet).
    fn pending(seed: u64, faults: FaultConfig) -> Pair {
        Pair::pending_with(seed, faults, None)
    }

    /// As [`Pair::pending`]; with `rendezvous`, both ends offer it.
    fn pending_with(seed: u64, faults: FaultConfig, rendezvous: Option<Rendezvous>) -> Pair {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let client =
            std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        let (local, peer) = (
            client.local_addr().expect("local"),
            client.peer_addr().expect("peer"),
        );
        let name = ConnectionKey::from_connecting_side(local, peer).segment_name();

        let fabric = SimFabric::new(seed, faults);
        let (a, b) = (fabric.add_endpoint(), fabric.add_endpoint());
        let rendezvous = rendezvous.map(|mode| rdma::set_up(&fabric, [a, b], mode));
        let (conn_a, conn_b) = fabric.connect(a, b, SLOTS, SLOTS).expect("sim connect");
        let caps = [conn_a.capabilities(), conn_b.capabilities()];
        let shared = Arc::new(Mutex::new(SimWorld {
            fabric,
            rng: ChaCha8Rng::seed_from_u64(seed),
            conns: [Some(conn_a), Some(conn_b)],
            receiving: [false; 2],
            lagging_polls: [0; 2],
            outbox: [VecDeque::new(), VecDeque::new()],
            rdma_violations: Vec::new(),
        }));
        let attached = Arc::new(AtomicBool::new(false));
        let link = |side: usize| SimLink {
            world: shared.clone(),
            side,
            caps: caps[side],
            slots: SLOTS,
            slot_bytes: vec![Vec::new(); usize::from(SLOTS.recv_slots)],
            attached: attached.clone(),
            rendezvous: rendezvous.map(|(scratch, registrations)| (registrations, scratch[side])),
            rdma: HashMap::new(),
            staged: Vec::new(),
        };

        let client = end(client.into_raw_fd(), local, peer);
        client.record.set_flag(flags::CLIENT, true);
        let socket = SanSocket::over_link(client.record, Side::Client, &name, Link::Sim(link(0)))
            .expect("pending client");
        install(client.index, client.record, socket);
        let acceptor = end(server.into_raw_fd(), peer, local);
        acceptor.record.set_flag(flags::SERVER, true);
        Pair {
            world: shared.clone(),
            attached: attached.clone(),
            name,
            client,
            acceptor_link: Mutex::new(Some(link(1))),
            acceptor,
            registrations: rendezvous.map(|(_, registrations)| registrations),
        }
    }

    /// A pair whose acceptor attached and whose client switched.
    fn switched(seed: u64, faults: FaultConfig) -> Pair {
        Pair::switched_with(seed, faults, None)
    }

    /// As [`Pair::switched`]; with `rendezvous`, both ends offer it.
    fn switched_with(seed: u64, faults: FaultConfig, rendezvous: Option<Rendezvous>) -> Pair {
        let pair = Pair::pending_with(seed, faults, rendezvous);
        pair.attach();
        switch_pending(pair.client.fd, pair.client.index);
        assert!(pair.is_switched(&pair.client), "the client switches");
        pair
    }

    /// The acceptor's side of `accept()` (`on_accepted`): set up over the link, attach, write
    /// the switch marker, install.
    fn attach(&self) {
        let link = self
            .acceptor_link
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .expect("attached once");
        let acceptor = &self.acceptor;
        let mut socket =
            SanSocket::over_link(acceptor.record, Side::Acceptor, &self.name, Link::Sim(link))
                .expect("acceptor");
        self.attached.store(true, Ordering::Release);
        socket.wake_pending_client(acceptor.fd);
        install(acceptor.index, acceptor.record, socket);
    }

    fn is_switched(&self, end: &End) -> bool {
        matches!(lock(end.index).as_ref(),
            Some(SanObject::Socket(s)) if s.phase == Phase::Switched)
    }

    /// Pumps an end's session once (what its own next call or a waiting thread would do).
    fn service(&self, end: &End) {
        if let Some(SanObject::Socket(socket)) = lock(end.index).as_mut() {
            socket.service();
        }
    }

    /// `send(2)` as the hook makes it: the SAN path, or the kernel when it declines.
    fn send(&self, end: &End, data: &[u8], send_flags: c_int) -> Result<usize, c_int> {
        let send_flags = send_flags | libc::MSG_NOSIGNAL;
        let bufs = [RawBuf {
            ptr: data.as_ptr().cast_mut(),
            len: data.len(),
        }];
        match send_iov(end.fd, end.index, &bufs, send_flags) {
            Some(result) => result.map(|n| n as usize).map_err(|Errno(code)| code),
            None => {
                // SAFETY: our buffer, our socket.
                let n = unsafe { libc::send(end.fd, data.as_ptr().cast(), data.len(), send_flags) };
                if n < 0 {
                    Err(errno::get())
                } else {
                    Ok(n as usize)
                }
            }
        }
    }

    /// `recv(2)` as the hook makes it.
    fn recv(&self, end: &End, buf: &mut [u8], recv_flags: c_int) -> Result<usize, c_int> {
        let bufs = [RawBuf {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        }];
        match recv_iov(end.fd, end.index, &bufs, recv_flags) {
            Some(result) => result.map(|n| n as usize).map_err(|Errno(code)| code),
            None => {
                // SAFETY: our buffer, our socket.
                let n =
                    unsafe { libc::recv(end.fd, buf.as_mut_ptr().cast(), buf.len(), recv_flags) };
                if n < 0 {
                    Err(errno::get())
                } else {
                    Ok(n as usize)
                }
            }
        }
    }

    /// `shutdown(2)` as the hook makes it (the real call, then the SAN's).
    fn shutdown(&self, end: &End, how: c_int) {
        // SAFETY: our socket.
        assert_eq!(unsafe { libc::shutdown(end.fd, how) }, 0);
        if how != libc::SHUT_WR {
            end.record.set_flag(flags::SHUT_RD, true);
        }
        if how != libc::SHUT_RD {
            end.record.set_flag(flags::SHUT_WR, true);
        }
        on_shutdown(end.fd, end.index, how);
    }

    /// `close(2)` of the last descriptor, as the hook makes it.
    fn close(&self, end: &End) {
        if end.released.swap(true, Ordering::AcqRel) {
            return;
        }
        on_released(end.index, Some(end.fd));
        // SAFETY: the descriptor is ours and closed once.
        drop(unsafe { OwnedFd::from_raw_fd(end.fd) });
        registry().release(end.index);
    }

    /// Sends all of `data` from `from` while `to` reads it, both nonblocking, in seeded chunk
    /// sizes (short writes and partial reads included); returns what `to` read.
    fn transfer(&self, from: &End, to: &End, data: &[u8], rng: &mut ChaCha8Rng) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut sent = 0;
        let mut received = Vec::with_capacity(data.len());
        let mut buf = vec![0u8; 256 << 10];
        while received.len() < data.len() {
            assert!(
                Instant::now() < deadline,
                "transfer stalled: {sent} sent, {} received of {}",
                received.len(),
                data.len()
            );
            if sent < data.len() {
                let chunk = rng.gen_range(1..=(data.len() - sent).min(200_000));
                match self.send(from, &data[sent..sent + chunk], libc::MSG_DONTWAIT) {
                    Ok(n) => sent += n,
                    Err(libc::EAGAIN) => {}
                    Err(e) => panic!("send: errno {e}"),
                }
            }
            let want = rng.gen_range(1..=buf.len());
            match self.recv(to, &mut buf[..want], libc::MSG_DONTWAIT) {
                Ok(0) => panic!("unexpected end of stream after {}", received.len()),
                Ok(n) => received.extend_from_slice(&buf[..n]),
                Err(libc::EAGAIN) => self.service(from),
                Err(e) => panic!("recv: errno {e}"),
            }
        }
        received
    }

    /// Sends all of `data` from `from`, nonblocking, driving `to` while the window is full.
    fn send_all(&self, from: &End, to: &End, data: &[u8]) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut sent = 0;
        while sent < data.len() {
            assert!(Instant::now() < deadline, "send stalled at {sent}");
            match self.send(from, &data[sent..], libc::MSG_DONTWAIT) {
                Ok(n) => sent += n,
                Err(libc::EAGAIN) => self.service(to),
                Err(e) => panic!("send: errno {e}"),
            }
        }
    }

    /// Reads exactly `len` bytes into `end`, nonblocking, in seeded read sizes.
    fn read_exact(&self, end: &End, other: &End, len: usize, rng: &mut ChaCha8Rng) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut received = Vec::with_capacity(len);
        let mut buf = vec![0u8; len.max(1)];
        while received.len() < len {
            assert!(
                Instant::now() < deadline,
                "read stalled at {} of {len}",
                received.len()
            );
            let want = rng.gen_range(1..=len - received.len());
            match self.recv(end, &mut buf[..want], libc::MSG_DONTWAIT) {
                Ok(0) => panic!("end of stream after {}", received.len()),
                Ok(n) => received.extend_from_slice(&buf[..n]),
                Err(libc::EAGAIN) => self.service(other),
                Err(e) => panic!("recv: errno {e}"),
            }
        }
        received
    }

    /// Reads exactly `len` bytes into `end` with blocking reads of at most `chunk` bytes.
    fn read_blocking(&self, end: &End, len: usize, chunk: usize) -> Vec<u8> {
        let mut received = Vec::with_capacity(len);
        let mut buf = vec![0u8; chunk];
        while received.len() < len {
            let want = chunk.min(len - received.len());
            match self.recv(end, &mut buf[..want], 0) {
                Ok(0) => panic!("end of stream after {}", received.len()),
                Ok(n) => received.extend_from_slice(&buf[..n]),
                Err(e) => panic!("recv: errno {e} after {}", received.len()),
            }
        }
        received
    }

    /// Reads until end of stream (nonblocking, bounded).
    fn read_to_end(&self, end: &End, other: &End) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut received = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            assert!(Instant::now() < deadline, "no end of stream");
            match self.recv(end, &mut buf, libc::MSG_DONTWAIT) {
                Ok(0) => return received,
                Ok(n) => received.extend_from_slice(&buf[..n]),
                Err(libc::EAGAIN) => {
                    self.service(other);
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(e) => panic!("recv: errno {e} after {} bytes", received.len()),
            }
        }
    }

    /// The next `polls` polls of `end`'s completions find none (the fabric delivers its
    /// messages later than TCP does its bytes).
    fn lag_completions(&self, end: &End, polls: u32) {
        let side = if std::ptr::eq(end, &self.client) {
            0
        } else {
            1
        };
        world(&self.world).lagging_polls[side] = polls;
    }

    /// A byte counter of the end's record.
    fn counter(&self, end: &End, counter: Counter) -> u64 {
        end.record.counter(counter)
    }

    /// The registrations of a rendezvous pair.
    fn registrations(&self) -> &'static SharedRegistrations {
        self.registrations.expect("a rendezvous pair")
    }

    /// RDMA requests on the application's memory that could not be performed.
    fn rdma_violations(&self) -> Vec<String> {
        world(&self.world).rdma_violations.clone()
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // (Not `close`: a failed test must not hide its message behind a second panic.)
        for end in [&self.client, &self.acceptor] {
            if !end.released.swap(true, Ordering::AcqRel) {
                on_released(end.index, None);
                // SAFETY: the descriptor is ours and closed once.
                drop(unsafe { OwnedFd::from_raw_fd(end.fd) });
                registry().release(end.index);
            }
        }
    }
}

fn end(fd: c_int, local: std::net::SocketAddr, peer: std::net::SocketAddr) -> End {
    let (index, record) = registry()
        .claim(fd, SocketState::ConnectedTcp)
        .expect("a record");
    record.set_addresses(Some(local), Some(peer));
    End {
        fd,
        index,
        record,
        released: AtomicBool::new(false),
    }
}

/// A stream pattern that shows where a byte came from (offset and stream).
fn pattern(len: usize, stream: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ stream)
        .collect()
}

/// Asserts two byte strings are equal, naming the first difference (not dumping megabytes).
#[track_caller]
fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if got == want {
        return;
    }
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    panic!(
        "{what}: {} bytes received, {} expected; first difference at offset {at}",
        got.len(),
        want.len()
    );
}

/// Runs `body` on its own thread, failing if it takes longer than `limit` (a hang).
fn bounded(limit: Duration, what: String, body: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(catch_unwind(AssertUnwindSafe(body)));
    });
    match rx.recv_timeout(limit) {
        Ok(Ok(())) => {}
        Ok(Err(panic)) => {
            eprintln!("{what} failed");
            resume_unwind(panic)
        }
        Err(_) => panic!("{what}: still running after {limit:?} (hang)"),
    }
}

/// Runs `body` for each seed (`SIM_SEED=N`: seed `N` alone), bounded, naming a failing seed.
fn for_seeds(test: &str, body: impl Fn(u64) + Send + Sync + 'static) {
    let seeds: Vec<u64> = match std::env::var("SIM_SEED") {
        Ok(value) => vec![value.parse().expect("SIM_SEED is a number")],
        Err(_) => (1..=6).collect(),
    };
    let body = Arc::new(body);
    for seed in seeds {
        let body = body.clone();
        bounded(
            Duration::from_secs(30),
            format!("{test} with SIM_SEED={seed}"),
            move || body(seed),
        );
    }
}

/// Memory the process may not access: `readable` bytes (whole pages) readable and writable,
/// then an inaccessible page (`PROT_NONE`); and an address no process maps (below the
/// kernel's lowest mappable address).
struct BadMemory {
    base: *mut u8,
    readable: usize,
}

impl BadMemory {
    const PAGE: usize = 4096;
    const UNMAPPED: usize = 0x1000;

    fn new(readable: usize) -> BadMemory {
        assert_eq!(readable % Self::PAGE, 0);
        // SAFETY: a fresh anonymous mapping of our own, then its last page made
        // inaccessible.
        unsafe {
            let base = libc::mmap(
                core::ptr::null_mut(),
                readable + Self::PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(base, libc::MAP_FAILED);
            let base = base.cast::<u8>();
            assert_eq!(
                libc::mprotect(base.add(readable).cast(), Self::PAGE, libc::PROT_NONE),
                0
            );
            BadMemory { base, readable }
        }
    }

    /// `len` bytes starting `lead` bytes before the inaccessible page.
    fn up_to_wall(&self, lead: usize, len: usize) -> RawBuf {
        RawBuf {
            ptr: self.base.wrapping_add(self.readable - lead),
            len,
        }
    }

    fn unmapped(len: usize) -> RawBuf {
        RawBuf {
            ptr: Self::UNMAPPED as *mut u8,
            len,
        }
    }

    fn good(&self, len: usize) -> RawBuf {
        RawBuf {
            ptr: self.base,
            len: len.min(self.readable),
        }
    }
}

impl Drop for BadMemory {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), self.readable + Self::PAGE) };
    }
}

/// A fresh loopback pair of plain kernel sockets, `(client, server)`: the oracle the SAN's
/// answers are compared with.
fn kernel_pair() -> (OwnedFd, OwnedFd) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let client =
        std::net::TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
    let (server, _) = listener.accept().expect("accept");
    (client.into(), server.into())
}

fn kernel_send(fd: &OwnedFd, data: &[u8]) -> Result<usize, c_int> {
    use std::os::fd::AsRawFd;
    // SAFETY: our buffer, our socket.
    let n = unsafe {
        libc::send(
            fd.as_raw_fd(),
            data.as_ptr().cast(),
            data.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(errno::get())
    } else {
        Ok(n as usize)
    }
}

fn kernel_recv(fd: &OwnedFd, buf: &mut [u8]) -> Result<usize, c_int> {
    use std::os::fd::AsRawFd;
    // SAFETY: our buffer, our socket.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        Err(errno::get())
    } else {
        Ok(n as usize)
    }
}

fn set_linger_zero(fd: c_int) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid `linger` for our socket.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            core::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0);
}

mod budget;
mod cases;
mod rdma;
mod rendezvous;

pub(crate) use rdma::TestDomain;
use rdma::{RealOp, Rendezvous, Scratch};
