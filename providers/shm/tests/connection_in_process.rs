//! Connection semantics with both ends in one process (fast, deterministic). The two-process
//! behaviour is in `two_process.rs`.

mod common;

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    fill_pattern, matches_pattern, segment_config, test_connection_config, Endpoint, TestDir,
};
use san_api::{
    Access, Completion, CompletionError, CompletionKind, LocalSegment, MemRange, PostError,
    RecvSlot, SanConnection, SanDomain, WrId,
};
use san_shm::{
    ConnectionConfig, DomainConfig, Doorbell, ShmConnection, ShmDomain, ShmSegment, WaitResult,
};

struct Pair {
    _dir: TestDir,
    creator: ShmConnection,
    attacher: ShmConnection,
}

fn pair(
    slot_size: u32,
    recv_slots: u16,
    creator_domain: &ShmDomain,
    attacher_domain: &ShmDomain,
    config: ConnectionConfig,
) -> Pair {
    let dir = TestDir::new("conn");
    let segment =
        ShmSegment::create(dir.handle(), "c", &segment_config(slot_size, recv_slots)).unwrap();
    let creator = ShmConnection::new(segment, creator_domain, config).unwrap();
    assert!(!creator.is_peer_attached());
    let attached = ShmSegment::attach(dir.handle(), "c").unwrap();
    let attacher = ShmConnection::new(attached, attacher_domain, config).unwrap();
    Pair {
        _dir: dir,
        creator,
        attacher,
    }
}

fn poll_all(conn: &mut ShmConnection) -> Vec<Completion> {
    let mut out = Vec::new();
    conn.poll_completions(&mut out, usize::MAX);
    out
}

#[test]
fn messages_land_in_posted_slots_in_posting_order() {
    let (a, b) = (ShmDomain::default(), ShmDomain::default());
    let mut p = pair(64, 4, &a, &b, test_connection_config());
    // Post slots out of numeric order: the sender must follow the posting order.
    for slot in [2u16, 0, 3] {
        p.attacher
            .post_recv(WrId(100 + u64::from(slot)), RecvSlot(slot))
            .unwrap();
    }
    for (i, text) in [b"one".as_slice(), b"two", b"three"].iter().enumerate() {
        p.creator.post_send(WrId(i as u64), text).unwrap();
    }
    let sends = poll_all(&mut p.creator);
    assert_eq!(sends.len(), 3);
    assert!(sends
        .iter()
        .all(|c| c.kind == CompletionKind::Send && c.status.is_ok()));
    let recvs = poll_all(&mut p.attacher);
    let got: Vec<(u64, u16, Vec<u8>)> = recvs
        .iter()
        .map(|c| match c.kind {
            CompletionKind::Recv { slot, len } => {
                (c.wr_id.0, slot.0, p.attacher.recv_slot(slot, len).to_vec())
            }
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (102, 2, b"one".to_vec()),
            (100, 0, b"two".to_vec()),
            (103, 3, b"three".to_vec())
        ]
    );
    // A re-posted slot holds nothing until a message arrives in it again.
    p.attacher.post_recv(WrId(7), RecvSlot(2)).unwrap();
    assert!(p.attacher.recv_slot(RecvSlot(2), 3).is_empty());
    assert!(
        p.attacher.recv_slot(RecvSlot(0), 4).is_empty(),
        "longer than the message held"
    );
}

#[test]
fn posting_errors_follow_the_contract() {
    let (a, b) = (ShmDomain::default(), ShmDomain::default());
    let mut p = pair(64, 2, &a, &b, test_connection_config());
    assert_eq!(
        p.creator.post_send(WrId(1), &[0; 65]),
        Err(PostError::TooLong)
    );
    assert_eq!(
        p.attacher.post_recv(WrId(1), RecvSlot(2)),
        Err(PostError::InvalidArgument)
    );
    p.attacher.post_recv(WrId(1), RecvSlot(1)).unwrap();
    assert_eq!(
        p.attacher.post_recv(WrId(2), RecvSlot(1)),
        Err(PostError::QueueFull)
    );
    // send_slots = 2: a third send before polling completions is refused.
    p.attacher.post_recv(WrId(3), RecvSlot(0)).unwrap();
    p.creator.post_send(WrId(10), b"a").unwrap();
    p.creator.post_send(WrId(11), b"b").unwrap();
    assert_eq!(
        p.creator.post_send(WrId(12), b"c"),
        Err(PostError::QueueFull)
    );
    assert_eq!(poll_all(&mut p.creator).len(), 2);
}

#[test]
fn a_send_without_a_posted_receive_fails_with_rnr_after_the_timeout() {
    let (a, b) = (ShmDomain::default(), ShmDomain::default());
    let config = ConnectionConfig {
        rnr_timeout: Duration::from_millis(30),
        ..ConnectionConfig::default()
    };
    let mut p = pair(64, 2, &a, &b, config);
    p.attacher.post_recv(WrId(50), RecvSlot(0)).unwrap();
    p.creator.post_send(WrId(1), b"fits").unwrap();
    p.creator.post_send(WrId(2), b"no receive posted").unwrap();
    let start = Instant::now();
    let mut seen = Vec::new();
    while seen.len() < 2 && start.elapsed() < Duration::from_secs(2) {
        seen.extend(poll_all(&mut p.creator));
        let _ = p.creator.wait(Duration::from_millis(10));
    }
    assert_eq!(seen[0].status, Ok(()));
    assert_eq!(seen[1].wr_id, WrId(2));
    assert_eq!(seen[1].status, Err(CompletionError::ReceiverNotReady));
    assert!(
        start.elapsed() >= Duration::from_millis(30),
        "bounded retry, not an immediate failure"
    );
    assert!(!p.creator.is_up());
    assert_eq!(
        p.creator.post_send(WrId(3), b"x"),
        Err(PostError::Disconnected)
    );
    // The first message still arrived intact.
    let recvs = poll_all(&mut p.attacher);
    assert!(matches!(recvs[0].kind, CompletionKind::Recv { len: 4, .. }));
}

#[test]
fn a_queued_send_goes_out_once_the_peer_posts_a_receive() {
    let (a, b) = (ShmDomain::default(), ShmDomain::default());
    let mut p = pair(64, 2, &a, &b, test_connection_config());
    p.creator.post_send(WrId(1), b"early").unwrap();
    assert!(
        poll_all(&mut p.creator).is_empty(),
        "no receive posted yet: the send waits"
    );
    p.attacher.post_recv(WrId(9), RecvSlot(1)).unwrap();
    assert_eq!(
        p.creator.wait(Duration::from_secs(1)),
        WaitResult::Notified,
        "posting a receive rings the blocked sender"
    );
    let sends = poll_all(&mut p.creator);
    assert_eq!(sends.len(), 1);
    assert_eq!(sends[0].status, Ok(()));
    let recvs = poll_all(&mut p.attacher);
    assert_eq!(p.attacher.recv_slot(RecvSlot(1), 5), b"early");
    assert_eq!(recvs[0].wr_id, WrId(9));
}

#[test]
fn orderly_close_delivers_earlier_messages_then_flushes() {
    let (a, b) = (ShmDomain::default(), ShmDomain::default());
    let mut p = pair(64, 3, &a, &b, test_connection_config());
    for slot in 0..3 {
        p.attacher
            .post_recv(WrId(u64::from(slot)), RecvSlot(slot))
            .unwrap();
    }
    p.creator.post_send(WrId(10), b"last words").unwrap();
    p.creator.close();
    let completions = poll_all(&mut p.attacher);
    assert_eq!(completions.len(), 3);
    assert_eq!(
        completions[0].status,
        Ok(()),
        "sent before the close: delivered"
    );
    assert!(completions[1..]
        .iter()
        .all(|c| c.status == Err(CompletionError::Flushed)));
    assert_eq!(
        p.attacher.post_recv(WrId(5), RecvSlot(0)),
        Err(PostError::Disconnected)
    );
}

struct Buffer {
    bytes: Vec<u8>,
}

impl Buffer {
    fn new(len: usize, seed: u64) -> Buffer {
        let mut bytes = vec![0u8; len];
        fill_pattern(&mut bytes, seed);
        Buffer { bytes }
    }
    fn range(&mut self) -> MemRange {
        MemRange::new(self.bytes.as_mut_ptr() as u64, self.bytes.len() as u64)
    }
}

fn run_to_completion(
    writer: &mut ShmConnection,
    reader: &mut ShmConnection,
    want: usize,
) -> Vec<Completion> {
    let mut got = Vec::new();
    let start = Instant::now();
    while got.len() < want && start.elapsed() < Duration::from_secs(10) {
        writer.poll_completions(&mut got, usize::MAX);
        let mut sink = Vec::new();
        reader.poll_completions(&mut sink, usize::MAX);
    }
    got
}

#[test]
fn window_writes_apply_before_later_messages_and_respect_revocation() {
    let writer_domain = ShmDomain::new(DomainConfig { force_window: true });
    let mut reader_domain = ShmDomain::default();
    let mut p = pair(
        64,
        2,
        &writer_domain,
        &reader_domain,
        test_connection_config(),
    );
    assert!(!p.creator.capabilities().rdma_read);
    let mut writer_domain = writer_domain;
    let mut source = Buffer::new(1 << 20, 7); // 4× the window: needs the reader to drain it
    let mut sink = Buffer::new(1 << 20, 0);
    let src_reg = writer_domain
        .register(source.range(), Access::NONE)
        .unwrap();
    let sink_reg = reader_domain
        .register(sink.range(), Access::REMOTE_WRITE)
        .unwrap();
    let remote = sink_reg.remote_descriptor(sink.range()).unwrap();
    let local = LocalSegment {
        range: source.range(),
        lkey: src_reg.lkey,
    };
    assert_eq!(
        p.creator.post_read(WrId(1), local, remote),
        Err(PostError::InvalidArgument),
        "no RDMA read on the window path"
    );
    p.attacher.post_recv(WrId(77), RecvSlot(0)).unwrap();
    p.creator.post_write(WrId(2), local, remote).unwrap();
    p.creator.post_send(WrId(3), b"write done").unwrap();
    // Drive the reader until the message arrives; the data must be complete by then.
    let start = Instant::now();
    let mut arrived = false;
    while !arrived && start.elapsed() < Duration::from_secs(10) {
        let mut sink_completions = Vec::new();
        p.attacher
            .poll_completions(&mut sink_completions, usize::MAX);
        arrived = sink_completions.iter().any(|c| c.wr_id == WrId(77));
        let mut out = Vec::new();
        p.creator.poll_completions(&mut out, usize::MAX);
    }
    assert!(arrived);
    assert!(
        matches_pattern(&sink.bytes, 7),
        "the window write was applied before the later message"
    );
    // Revoked: the writer's check refuses it.
    reader_domain.revoke_remote(sink_reg.lkey).unwrap();
    p.creator.post_write(WrId(4), local, remote).unwrap();
    let got = run_to_completion(&mut p.creator, &mut p.attacher, 1);
    let write = got.iter().find(|c| c.wr_id == WrId(4)).unwrap();
    assert_eq!(write.status, Err(CompletionError::RemoteAccess));
    assert_eq!(p.attacher.stats().window_writes_rejected, 0);
    drop(source);
}

#[test]
fn cma_reads_and_writes_check_keys_ranges_and_rights() {
    let mut domain = ShmDomain::default();
    let peer_domain = ShmDomain::default();
    let mut p = pair(64, 2, &domain, &peer_domain, test_connection_config());
    assert!(
        !p.creator.capabilities().rdma_read,
        "peer not seen yet: no CMA promised"
    );
    poll_all(&mut p.creator);
    assert!(
        p.creator.capabilities().rdma_read,
        "CMA on our own pid is permitted here"
    );
    let mut peer_domain = peer_domain;
    let mut exposed = Buffer::new(64 << 10, 3);
    let mut mine = Buffer::new(64 << 10, 0);
    let exposed_reg = peer_domain
        .register(exposed.range(), Access::REMOTE_READ)
        .unwrap();
    let mine_reg = domain.register(mine.range(), Access::LOCAL_WRITE).unwrap();
    let local = LocalSegment {
        range: mine.range(),
        lkey: mine_reg.lkey,
    };
    let remote = exposed_reg.remote_descriptor(exposed.range()).unwrap();
    p.creator.post_read(WrId(1), local, remote).unwrap();
    let mut shifted = remote;
    shifted.addr += 1;
    p.creator.post_read(WrId(2), local, shifted).unwrap();
    p.creator.post_write(WrId(3), local, remote).unwrap();
    let wrong_lkey = LocalSegment {
        range: mine.range(),
        lkey: san_api::LocalKey(9999),
    };
    p.creator.post_read(WrId(4), wrong_lkey, remote).unwrap();
    let got = run_to_completion(&mut p.creator, &mut p.attacher, 4);
    let status = |id| got.iter().find(|c| c.wr_id == WrId(id)).unwrap().status;
    assert_eq!(status(1), Ok(()));
    assert!(matches_pattern(&mine.bytes, 3));
    assert_eq!(
        status(2),
        Err(CompletionError::RemoteAccess),
        "one byte past the exposed range"
    );
    assert_eq!(
        status(3),
        Err(CompletionError::RemoteAccess),
        "exposed for read only"
    );
    assert_eq!(status(4), Err(CompletionError::LocalProtection));
}

struct CountingDoorbell(Arc<AtomicUsize>);

impl Doorbell for CountingDoorbell {
    fn ring(&self, bell: &AtomicU32) {
        self.0.fetch_add(1, Ordering::SeqCst);
        san_shm::futex_wake(bell);
    }
}

#[test]
fn a_sleeping_peer_is_woken_through_the_doorbell() {
    let dir = TestDir::new("bell");
    let (a, b) = (ShmDomain::default(), ShmDomain::default());
    let rings = Arc::new(AtomicUsize::new(0));
    let segment = ShmSegment::create(dir.handle(), "c", &segment_config(64, 2)).unwrap();
    let creator = ShmConnection::with_doorbell(
        segment,
        &a,
        test_connection_config(),
        Box::new(CountingDoorbell(rings.clone())),
    )
    .unwrap();
    let attacher = ShmConnection::new(
        ShmSegment::attach(dir.handle(), "c").unwrap(),
        &b,
        test_connection_config(),
    )
    .unwrap();
    let mut creator = Endpoint::new(creator);
    let mut attacher = Endpoint::new(attacher);
    let sleeper = std::thread::spawn(move || {
        let start = Instant::now();
        let message = attacher.next_message(Duration::from_secs(5));
        (message, start.elapsed(), attacher.conn.stats())
    });
    std::thread::sleep(Duration::from_millis(100));
    creator.send(b"wake up");
    let (message, waited, stats) = sleeper.join().unwrap();
    assert_eq!(message.as_deref(), Some(b"wake up".as_slice()));
    assert!(
        waited >= Duration::from_millis(90) && waited < Duration::from_secs(2),
        "waited {waited:?}"
    );
    assert!(stats.sleeps >= 1, "the idle receiver slept: {stats:?}");
    assert!(
        rings.load(Ordering::SeqCst) >= 1,
        "the sender rang the custom doorbell"
    );
    assert_eq!(
        creator.conn.stats().wakeups_sent as usize,
        rings.load(Ordering::SeqCst)
    );
}

#[test]
fn wait_times_out_when_nothing_happens() {
    let (a, b) = (ShmDomain::default(), ShmDomain::default());
    let p = pair(64, 2, &a, &b, test_connection_config());
    let start = Instant::now();
    assert_eq!(
        p.attacher.wait(Duration::from_millis(50)),
        WaitResult::TimedOut
    );
    assert!(start.elapsed() >= Duration::from_millis(50));
    drop(p.creator);
}

#[test]
fn a_peer_blocking_outside_wait_gets_exactly_one_doorbell_per_sleep() {
    let dir = TestDir::new("block");
    let (a, b) = (ShmDomain::default(), ShmDomain::default());
    let rings = Arc::new(AtomicUsize::new(0));
    let segment = ShmSegment::create(dir.handle(), "c", &segment_config(64, 4)).unwrap();
    let creator = ShmConnection::with_doorbell(
        segment,
        &a,
        test_connection_config(),
        Box::new(CountingDoorbell(rings.clone())),
    )
    .unwrap();
    let attacher = ShmConnection::new(
        ShmSegment::attach(dir.handle(), "c").unwrap(),
        &b,
        test_connection_config(),
    )
    .unwrap();
    let mut creator = Endpoint::new(creator);
    let mut attacher = Endpoint::new(attacher);
    creator.poll();
    attacher.poll();
    // The preload is about to block in epoll: it announces that instead of calling wait().
    assert!(
        attacher.conn.prepare_to_block(),
        "nothing pending: safe to block"
    );
    creator.send(b"first");
    creator.send(b"second");
    assert_eq!(
        rings.load(Ordering::SeqCst),
        1,
        "one doorbell for the sleeper, not one per message"
    );
    assert!(
        !attacher.conn.prepare_to_block(),
        "news arrived: do not block"
    );
    attacher.conn.finish_blocking();
    creator.send(b"third");
    assert_eq!(
        rings.load(Ordering::SeqCst),
        1,
        "a running peer is not rung"
    );
    assert!(attacher.drive_until(Duration::from_secs(1), |e| e.messages.len() == 3));
    assert_eq!(
        attacher.messages,
        [b"first".to_vec(), b"second".to_vec(), b"third".to_vec()]
    );
}
