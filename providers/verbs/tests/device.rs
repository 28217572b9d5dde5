//! Tests against a real RDMA device (soft-RoCE or soft-iWARP in the project's VM:
//! `integration/softroce/test-verbs.sh`). Ignored by default: they need a device with the
//! server address (`SANDIRECT_TEST_SERVER_IP`, default 192.0.2.1) and the client address
//! (`SANDIRECT_TEST_CLIENT_IP`, default 192.0.2.2). Run them one at a time
//! (`--test-threads=1`): the soft drivers are not built for many concurrent QPs.

mod common;
#[path = "device/invalidation.rs"]
mod invalidation;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use san_api::{
    Access, Completion, CompletionError, CompletionKind, ConnectProgress, Established,
    LocalSegment, MemRange, PostError, RecvSlot, RegisterError, SanConnectRequest, SanConnection,
    SanConnector, SanDomain, SetupError, WrId,
};
use san_verbs_loader::{LoadedConnection, VerbsLibrary, SYSFS_DEVICES};
use sandirect_verbs::{
    ConnectParams, ConnectorConfig, VerbsConnection, VerbsConnector, VerbsDomain, VerbsListener,
    WaitOutcome,
};

/// A connection plus the successful receives that arrived while a test waited for one of
/// its own completions: a peer's message may complete before our send's completion.
struct Peer {
    conn: VerbsConnection,
    arrived: VecDeque<Completion>,
}

impl Peer {
    fn new(conn: VerbsConnection) -> Self {
        Self {
            conn,
            arrived: VecDeque::new(),
        }
    }
}

impl std::ops::Deref for Peer {
    type Target = VerbsConnection;
    fn deref(&self) -> &VerbsConnection {
        &self.conn
    }
}

impl std::ops::DerefMut for Peer {
    fn deref_mut(&mut self) -> &mut VerbsConnection {
        &mut self.conn
    }
}

fn is_good_receive(completion: &Completion) -> bool {
    matches!(completion.kind, CompletionKind::Recv { .. }) && completion.status.is_ok()
}

/// The next completion that is not a successful receive (those are kept for `receive`).
fn next_completion(peer: &mut Peer) -> Completion {
    loop {
        let completion = next_raw_completion(&mut peer.conn);
        if !is_good_receive(&completion) {
            return completion;
        }
        peer.arrived.push_back(completion);
    }
}

/// Connects a client on `client` to a listener on `server` (in a helper thread) and
/// returns (server side, client side, blob the server got, blob the client got).
fn connected_pair(
    server: &VerbsDomain,
    client: &VerbsDomain,
    client_blob: &[u8],
    server_blob: &[u8],
) -> (Peer, Peer, Vec<u8>, Vec<u8>) {
    let mut listener =
        VerbsListener::bind(server, SocketAddr::new(server_ip(), 0), 4).expect("listen");
    let port = listener.port();
    assert_ne!(port, 0, "listener is bound to a real port");
    thread::scope(|scope| {
        let accepting = scope.spawn(move || {
            let request = listener
                .next_request(Some(STEP_TIMEOUT))
                .expect("connection request");
            let got = request.blob().to_vec();
            let mut params = ConnectParams::new(slots());
            params.private_data = server_blob;
            params.timeout = STEP_TIMEOUT;
            (request.accept(server, &params).expect("accept"), got)
        });
        let (client_conn, reply) = VerbsConnection::connect(
            client,
            SocketAddr::new(server_ip(), port),
            &params(client_blob),
        )
        .expect("connect");
        let (server_conn, got) = accepting.join().expect("accept thread");
        (Peer::new(server_conn), Peer::new(client_conn), got, reply)
    })
}

/// Receives one message on a pre-posted slot (wr id = slot), returns it and reposts.
fn receive(conn: &mut Peer) -> Vec<u8> {
    let completion = match conn.arrived.pop_front() {
        Some(completion) => completion,
        None => next_raw_completion(&mut conn.conn),
    };
    let CompletionKind::Recv { slot, len } = completion.kind else {
        panic!("expected a receive, got {completion:?}");
    };
    assert_eq!(completion.status, Ok(()), "receive failed");
    assert_eq!(
        completion.wr_id,
        WrId(u64::from(slot.0)),
        "pre-posted receives carry their slot as id"
    );
    let message = conn.recv_slot(slot, len).to_vec();
    assert_eq!(message.len(), len as usize);
    conn.post_recv(WrId(u64::from(slot.0)), slot)
        .expect("repost");
    message
}

fn send(conn: &mut Peer, wr_id: u64, message: &[u8]) {
    conn.post_send(WrId(wr_id), message).expect("post send");
    let completion = next_completion(conn);
    assert_eq!(
        (completion.wr_id, completion.kind, completion.status),
        (WrId(wr_id), CompletionKind::Send, Ok(()))
    );
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn connect_carries_setup_blobs_and_exchanges_control_messages() {
    let (server, client) = (server_domain(), client_domain());
    let hello = b"hello 198.51.100.7:40000 -> 198.51.100.9:80";
    let started = Instant::now();
    let (mut srv, mut cli, got, reply) = connected_pair(&server, &client, hello, b"welcome");
    assert_eq!(got, hello, "the listener sees the connect blob exactly");
    assert_eq!(
        reply, b"welcome",
        "the connector sees the accept blob exactly"
    );

    let connect_time = started.elapsed();
    let started = Instant::now();
    for round in 0..50u64 {
        let len = 1 + (round as usize * 37) % 256;
        let message = pattern(len, round as u8);
        send(&mut cli, round, &message);
        assert_eq!(receive(&mut srv), message, "round {round}: request intact");
        let answer: Vec<u8> = message.iter().rev().copied().collect();
        send(&mut srv, 1000 + round, &answer);
        assert_eq!(receive(&mut cli), answer, "round {round}: reply intact");
    }

    eprintln!(
        "connected in {connect_time:?}; 50 round trips in {:?}",
        started.elapsed()
    );
    assert_eq!(cli.post_send(WrId(1), &[0; 257]), Err(PostError::TooLong));
    assert_eq!(
        cli.post_recv(WrId(1), RecvSlot(8)),
        Err(PostError::InvalidArgument)
    );
    assert_eq!(
        cli.post_recv(WrId(1), RecvSlot(0)),
        Err(PostError::QueueFull),
        "slot 0 is still posted"
    );
    // Eight sends fill the eight send slots (slots return only when completions are polled).
    for i in 0..8 {
        cli.post_send(WrId(2000 + i), b"burst")
            .expect("send slot free");
    }
    assert_eq!(
        cli.post_send(WrId(9999), b"one too many"),
        Err(PostError::QueueFull)
    );
    let mut sent = Vec::new();
    for _ in 0..8 {
        let completion = next_completion(&mut cli);
        assert_eq!(completion.status, Ok(()));
        sent.push(completion.wr_id.0);
    }
    sent.sort_unstable();
    assert_eq!(
        sent,
        (2000..2008).collect::<Vec<_>>(),
        "exactly one completion per send"
    );
    for _ in 0..8 {
        assert_eq!(receive(&mut srv), b"burst");
    }
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn rdma_write_and_read_move_4_mib_intact() {
    const LEN: usize = 4 << 20;
    let (mut server, mut client) = (server_domain(), client_domain());
    let iwarp = client.is_iwarp();
    let (mut srv, mut cli, _, _) = connected_pair(&server, &client, b"", b"");

    let sink = Buffer::new(LEN);
    let mut source = Buffer::new(LEN);
    source.as_mut_slice().copy_from_slice(&pattern(LEN, 0xa5));
    let sink_reg = server
        .register(sink.range(), Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("register sink");
    let source_reg = server
        .register(source.range(), Access::REMOTE_READ)
        .expect("register source");
    let mut descriptors = encode_descriptor(
        &sink_reg
            .remote_descriptor(sink.range())
            .expect("sink exposed"),
    );
    descriptors.extend(encode_descriptor(
        &source_reg
            .remote_descriptor(source.range())
            .expect("source exposed"),
    ));
    send(&mut srv, 1, &descriptors);
    let message = receive(&mut cli);
    let (remote_sink, remote_source) = (
        decode_descriptor(&message[..20]),
        decode_descriptor(&message[20..]),
    );

    // RDMA write: client memory -> server sink.
    let mut local = Buffer::new(LEN);
    local.as_mut_slice().copy_from_slice(&pattern(LEN, 0x3c));
    let local_reg = client
        .register(local.range(), Access::NONE)
        .expect("register write source");
    let started = Instant::now();
    cli.post_write(
        WrId(7),
        LocalSegment {
            range: local.range(),
            lkey: local_reg.lkey,
        },
        remote_sink,
    )
    .expect("post write");
    let completion = next_completion(&mut cli);
    assert_eq!(
        (completion.wr_id, completion.kind, completion.status),
        (WrId(7), CompletionKind::Write, Ok(()))
    );
    let write_time = started.elapsed();
    // RC ordering: the send after the write arrives after the written data.
    send(&mut cli, 8, b"written");
    assert_eq!(receive(&mut srv), b"written");
    assert!(
        sink.snapshot() == local.as_slice(),
        "server sink holds exactly what the client wrote"
    );

    // RDMA read: server source -> client sink (iWARP: the sink needs remote write).
    let read_sink = Buffer::new(LEN);
    let sink_access = if iwarp {
        Access::LOCAL_WRITE | Access::REMOTE_WRITE
    } else {
        Access::LOCAL_WRITE
    };
    let read_reg = client
        .register(read_sink.range(), sink_access)
        .expect("register read sink");
    let started = Instant::now();
    cli.post_read(
        WrId(9),
        LocalSegment {
            range: read_sink.range(),
            lkey: read_reg.lkey,
        },
        remote_source,
    )
    .expect("post read");
    let completion = next_completion(&mut cli);
    assert_eq!(
        (completion.wr_id, completion.kind, completion.status),
        (WrId(9), CompletionKind::Read, Ok(()))
    );
    let read_time = started.elapsed();
    assert!(
        read_sink.snapshot() == source.as_slice(),
        "client sink holds exactly the server's source"
    );
    eprintln!(
        "4 MiB: write {write_time:?}, read {read_time:?} (emulated; only ratios mean anything)"
    );

    // Local-key validation happens before the device: a range outside the registration
    // completes with a local protection error and leaves the connection usable.
    let outside = MemRange::new(local.range().addr + 4096, LEN as u64);
    cli.post_write(
        WrId(10),
        LocalSegment {
            range: outside,
            lkey: local_reg.lkey,
        },
        remote_sink,
    )
    .expect("post");
    let completion = next_completion(&mut cli);
    assert_eq!(completion.status, Err(CompletionError::LocalProtection));
    send(&mut cli, 11, b"still up");
    assert_eq!(receive(&mut srv), b"still up");

    server.deregister(sink_reg.lkey).expect("deregister");
    server.deregister(source_reg.lkey).expect("deregister");
    client.deregister(local_reg.lkey).expect("deregister");
    client.deregister(read_reg.lkey).expect("deregister");
    assert_eq!(
        client.deregister(read_reg.lkey),
        Err(RegisterError::UnknownKey)
    );
    assert_eq!(server.registration_count(), 0);
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn revoked_rkey_fails_for_the_peer_while_the_memory_stays_usable_locally() {
    const LEN: usize = 64 << 10;
    let (mut server, mut client) = (server_domain(), client_domain());
    let (mut srv, mut cli, _, _) = connected_pair(&server, &client, b"", b"");

    let mut exposed = Buffer::new(LEN);
    exposed.as_mut_slice().copy_from_slice(&pattern(LEN, 0x11));
    let reg = server
        .register(exposed.range(), Access::REMOTE_READ)
        .expect("register");
    let stale = reg.remote_descriptor(exposed.range()).expect("exposed");
    send(&mut srv, 1, &encode_descriptor(&stale));
    let descriptor = decode_descriptor(&receive(&mut cli));

    // While exposed, the peer can read it.
    let mut sink = Buffer::new(LEN);
    let sink_access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let sink_reg = client
        .register(sink.range(), sink_access)
        .expect("register sink");
    let segment = LocalSegment {
        range: sink.range(),
        lkey: sink_reg.lkey,
    };
    cli.post_read(WrId(2), segment, descriptor)
        .expect("post read");
    assert_eq!(
        next_completion(&mut cli).status,
        Ok(()),
        "exposed memory is readable"
    );
    assert!(sink.snapshot() == exposed.as_slice());
    sink.as_mut_slice().fill(0);
    send(
        &mut cli,
        3,
        &encode_descriptor(
            &sink_reg
                .remote_descriptor(sink.range())
                .expect("sink exposed"),
        ),
    );
    let client_sink = decode_descriptor(&receive(&mut srv));

    // Revoke; the registration stays usable locally (same LocalKey, memory pinned).
    server.revoke_remote(reg.lkey).expect("revoke");
    exposed.as_mut_slice().copy_from_slice(&pattern(LEN, 0x22));
    srv.post_write(
        WrId(4),
        LocalSegment {
            range: exposed.range(),
            lkey: reg.lkey,
        },
        client_sink,
    )
    .expect("post write");
    let completion = next_completion(&mut srv);
    assert_eq!(
        (completion.kind, completion.status),
        (CompletionKind::Write, Ok(())),
        "local use after revoke"
    );
    send(&mut srv, 5, b"revoked");
    assert_eq!(receive(&mut cli), b"revoked");
    assert!(
        sink.snapshot() == exposed.as_slice(),
        "the revoked buffer was still the write source"
    );

    // The stale rkey now fails for the peer, and nothing is read through it.
    sink.as_mut_slice().fill(0);
    cli.post_read(WrId(6), segment, descriptor)
        .expect("post read with the stale rkey");
    // The posted receives are flushed too when the QP breaks, in any order relative to
    // the read (siw flushes the receive queue first).
    let completion = loop {
        let completion = next_completion(&mut cli);
        if completion.kind == CompletionKind::Read {
            break completion;
        }
        assert!(
            matches!(completion.kind, CompletionKind::Recv { .. })
                && completion.status == Err(CompletionError::Flushed),
            "only flushed receives may precede the read: {completion:?}"
        );
    };
    assert_eq!(completion.wr_id, WrId(6));
    if client.is_iwarp() {
        // siw answers with a TERMINATE and flushes the requester's queue: the failing
        // read is reported as flushed, not with a distinct access status.
        assert!(
            matches!(
                completion.status,
                Err(CompletionError::RemoteAccess | CompletionError::Flushed)
            ),
            "stale rkey must fail, got {:?}",
            completion.status
        );
    } else {
        assert_eq!(
            completion.status,
            Err(CompletionError::RemoteAccess),
            "stale rkey must fail"
        );
    }
    assert!(
        sink.snapshot().iter().all(|&b| b == 0),
        "no byte was read through the revoked rkey"
    );
    assert!(cli.is_down(), "an access error breaks the RC connection");
    assert_eq!(cli.post_send(WrId(7), b"x"), Err(PostError::Disconnected));

    // Re-exposing yields a different key.
    let fresh = server
        .expose_remote(reg.lkey, Access::REMOTE_READ)
        .expect("expose again");
    assert_ne!(
        fresh, stale.rkey,
        "a revoked rkey is never handed out again"
    );
    assert_eq!(
        server.revoke_remote(san_api::LocalKey(0xdead_beef)),
        Err(RegisterError::UnknownKey)
    );
}

/// Drops CAP_IPC_LOCK from this thread's effective set (root in the VM bypasses
/// RLIMIT_MEMLOCK otherwise), or restores it.
fn set_ipc_lock_effective(enabled: bool) {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget with a v3 header and two data structs, as the ABI requires.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    assert_eq!(rc, 0, "capget");
    if enabled {
        data[0].effective |= 1 << CAP_IPC_LOCK;
    } else {
        data[0].effective &= !(1 << CAP_IPC_LOCK);
    }
    // SAFETY: as above; pid 0 = this thread.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset");
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn memlock_limit_makes_registration_fail_with_out_of_resources_and_nothing_else() {
    const LIMIT: u64 = 256 << 10;
    let mut domain = client_domain();
    let big = Buffer::new(4 << 20);
    let small = Buffer::new(16 << 10);
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: valid out struct.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old) };
    assert_eq!(rc, 0);
    set_ipc_lock_effective(false);
    let low = libc::rlimit {
        rlim_cur: LIMIT,
        rlim_max: old.rlim_max,
    };
    // SAFETY: valid struct; lowers only the soft limit (restored below).
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &low) }, 0);

    let too_big = domain.register(big.range(), Access::LOCAL_WRITE | Access::REMOTE_WRITE);
    let fits = domain.register(small.range(), Access::REMOTE_READ);

    // SAFETY: restores the saved limit.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &old) };
    set_ipc_lock_effective(true);

    assert_eq!(
        too_big,
        Err(RegisterError::OutOfResources),
        "over RLIMIT_MEMLOCK is ENOBUFS territory"
    );
    let fits = fits.expect("a registration within the limit still works");
    assert_eq!(
        domain.registration_count(),
        1,
        "the failure left no half registration behind"
    );
    domain.deregister(fits.lkey).expect("deregister");
    let again = domain
        .register(big.range(), Access::LOCAL_WRITE)
        .expect("works again once the limit is lifted");
    domain.deregister(again.lkey).expect("deregister");
}

const PEER_ENV: &str = "SANDIRECT_TEST_PEER_CONNECT";

/// Not a test of its own: the body of the peer process that
/// `killed_peer_fails_outstanding_work_promptly` starts (and kills). Without the
/// environment variable it returns at once.
#[test]
#[ignore = "helper process for killed_peer_fails_outstanding_work_promptly"]
fn helper_peer_process() {
    let Ok(target) = std::env::var(PEER_ENV) else {
        return;
    };
    let target: SocketAddr = target.parse().expect("peer target");
    let mut domain = client_domain();
    let (conn, _) =
        VerbsConnection::connect(&domain, target, &params(b"peer")).expect("peer connect");
    let mut conn = Peer::new(conn);
    let source = Buffer::new(4 << 20);
    let reg = domain
        .register(
            source.range(),
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        )
        .expect("register");
    send(
        &mut conn,
        1,
        &encode_descriptor(&reg.remote_descriptor(source.range()).expect("exposed")),
    );
    // Serve reads until killed.
    loop {
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn killed_peer_fails_outstanding_work_promptly() {
    const BOUND: Duration = Duration::from_secs(45);
    let mut domain = server_domain();
    let mut listener =
        VerbsListener::bind(&domain, SocketAddr::new(server_ip(), 0), 1).expect("listen");
    let target = SocketAddr::new(server_ip(), listener.port());
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "helper_peer_process", "--ignored", "--nocapture"])
        .env(PEER_ENV, target.to_string())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn peer process");
    let request = listener
        .next_request(Some(STEP_TIMEOUT))
        .expect("peer connects");
    assert_eq!(request.blob(), b"peer");
    let mut params = ConnectParams::new(slots());
    params.timeout = STEP_TIMEOUT;
    let mut conn = Peer::new(request.accept(&domain, &params).expect("accept"));
    let remote = decode_descriptor(&receive(&mut conn));

    let sinks: Vec<Buffer> = (0..4).map(|_| Buffer::new(4 << 20)).collect();
    let regs: Vec<_> = sinks
        .iter()
        .map(|b| {
            domain
                .register(b.range(), Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .expect("register")
        })
        .collect();
    // One read completes while the peer lives; then keep several in flight and kill it.
    let segment = |i: usize| LocalSegment {
        range: sinks[i].range(),
        lkey: regs[i].lkey,
    };
    conn.post_read(WrId(100), segment(0), remote)
        .expect("post read");
    assert_eq!(next_completion(&mut conn).status, Ok(()));
    for i in 0..4 {
        conn.post_read(WrId(200 + i as u64), segment(i), remote)
            .expect("post read");
    }
    conn.post_send(WrId(300), b"are you there")
        .expect("post send");
    child.kill().expect("kill peer");
    let killed = Instant::now();
    child.wait().expect("reap peer");

    // Outstanding: four reads, one send, and the eight posted receives (wr id = slot).
    let mut outstanding: Vec<u64> = (200..204).chain([300]).chain(0..8).collect();
    let mut failures = 0;
    let mut out = Vec::new();
    while !outstanding.is_empty() {
        assert!(
            killed.elapsed() < BOUND,
            "outstanding work still pending {BOUND:?} after the peer died: {outstanding:?}"
        );
        if conn.poll_completions(&mut out, 8) == 0 {
            let outcome = conn.wait(Some(BOUND.saturating_sub(killed.elapsed())));
            assert_ne!(
                outcome,
                WaitOutcome::TimedOut,
                "wait timed out with work outstanding: {outstanding:?}"
            );
            continue;
        }
        for completion in out.drain(..) {
            let position = outstanding.iter().position(|&id| id == completion.wr_id.0);
            let position = position
                .unwrap_or_else(|| panic!("unexpected or duplicate completion {completion:?}"));
            outstanding.remove(position);
            failures += usize::from(completion.status.is_err());
        }
    }
    // Reads that were already answered before the kill may succeed; the rest must fail.
    assert!(failures >= 1, "the dead peer must surface as errors");
    eprintln!(
        "peer killed: all work completed {:?} later ({failures} failed)",
        killed.elapsed()
    );
    assert!(conn.is_down());
    assert_eq!(
        conn.post_send(WrId(400), b"x"),
        Err(PostError::Disconnected)
    );
    for reg in regs {
        domain.deregister(reg.lkey).expect("deregister");
    }
}

/// CPU time consumed by the calling thread.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out struct.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn completion_wait_sleeps_in_the_kernel_and_wakes_on_arrival() {
    const DELAY: Duration = Duration::from_secs(2);
    let (server, client) = (server_domain(), client_domain());
    let (mut srv, mut cli, _, _) = connected_pair(&server, &client, b"", b"");

    // Nothing arrives: a bounded wait times out and burns (almost) no CPU.
    let cpu = thread_cpu_time();
    let started = Instant::now();
    assert_eq!(
        srv.wait(Some(Duration::from_millis(500))),
        WaitOutcome::TimedOut
    );
    assert!(started.elapsed() >= Duration::from_millis(500));
    let idle_cpu = thread_cpu_time() - cpu;

    // A message sent later wakes the waiter.
    thread::scope(|scope| {
        scope.spawn(|| {
            thread::sleep(DELAY);
            send(&mut cli, 1, b"wake up");
        });
        let cpu = thread_cpu_time();
        let started = Instant::now();
        let outcome = srv.wait(Some(STEP_TIMEOUT));
        let waited = started.elapsed();
        let busy = thread_cpu_time() - cpu;
        assert_eq!(outcome, WaitOutcome::Ready);
        assert_eq!(receive(&mut srv), b"wake up");
        assert!(
            waited >= DELAY / 2,
            "woke after {waited:?}, before anything was sent"
        );
        assert!(
            busy < waited / 4,
            "waiting {waited:?} cost {busy:?} of CPU: the waiter must sleep, not spin"
        );
        eprintln!("idle wait 500 ms: {idle_cpu:?} CPU; woken after {waited:?} with {busy:?} CPU");
    });
    assert!(
        idle_cpu < Duration::from_millis(125),
        "a 500 ms idle wait cost {idle_cpu:?} of CPU"
    );
}

/// Whether `fd` is readable within `timeout`.
fn readable_within(fd: std::os::fd::RawFd, timeout: Duration) -> bool {
    let mut entry = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid pollfd entry.
    let n = unsafe { libc::poll(&mut entry, 1, ms) };
    assert!(n >= 0, "poll failed");
    n == 1
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn an_event_loop_that_drains_without_waiting_is_woken_by_every_arrival() {
    // The preload's service thread: it sleeps on `fd()` (edge-triggered), drains with
    // `poll_completions` (never `wait`), then re-arms. Every successful `arm()` must leave
    // `fd()` quiet until the next arrival, and that arrival must make it readable; a
    // stale channel event left over from the previous round would hide the next one.
    const ROUNDS: u64 = 8;
    let (server, client) = (server_domain(), client_domain());
    let (mut srv, mut cli, _, _) = connected_pair(&server, &client, b"", b"");
    assert!(srv.arm(), "nothing is pending on a fresh connection");
    for round in 0..ROUNDS {
        assert!(
            !readable_within(srv.fd(), Duration::ZERO),
            "round {round}: fd readable right after a successful arm"
        );
        send(&mut cli, round, format!("message {round}").as_bytes());
        assert!(
            readable_within(srv.fd(), STEP_TIMEOUT),
            "round {round}: the arrival did not make the armed fd readable"
        );
        let arrived = poll_one(&mut srv, &format!("round {round}"));
        let CompletionKind::Recv { slot, len } = arrived.kind else {
            panic!("round {round}: expected a receive, got {arrived:?}");
        };
        assert_eq!(
            srv.recv_slot(slot, len),
            format!("message {round}").as_bytes()
        );
        srv.post_recv(WrId(u64::from(slot.0)), slot)
            .expect("repost");
        assert!(srv.arm(), "round {round}: nothing else is pending");
    }
}

/// Polls `conn` (bounded, without waiting on its channel: the arming under test must stay
/// as it is) until a completion arrives.
fn poll_one(conn: &mut Peer, what: &str) -> Completion {
    let mut out = Vec::new();
    let deadline = Instant::now() + STEP_TIMEOUT;
    while conn.poll_completions(&mut out, 1) == 0 {
        assert!(Instant::now() < deadline, "{what}: no completion");
        thread::sleep(Duration::from_millis(1));
    }
    out[0]
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn a_solicited_arm_sleeps_through_its_own_sends_and_wakes_for_every_message() {
    // A thread waiting for its peer's answer arms for solicited events only: the
    // acknowledgement of what it just sent must not wake it (an extra wake-up per message;
    // not on iWARP, where the provider arms for everything, see `spares_own_sends`), and
    // every message of the peer must (all our messages are sent solicited).
    const ROUNDS: u64 = 6;
    let (server, client) = (server_domain(), client_domain());
    let (mut srv, mut cli, _, _) = connected_pair(&server, &client, b"", b"");
    for round in 0..ROUNDS {
        assert!(srv.arm_solicited(), "round {round}: nothing is pending");
        let request = format!("request {round}");
        srv.post_send(WrId(1000 + round), request.as_bytes())
            .expect("post send");
        assert_eq!(receive(&mut cli), request.as_bytes(), "round {round}");
        let sent = poll_one(&mut srv, "our send");
        assert_eq!(
            (sent.wr_id, sent.kind, sent.status),
            (WrId(1000 + round), CompletionKind::Send, Ok(()))
        );
        if srv.spares_own_sends() {
            assert!(
                !readable_within(srv.fd(), Duration::from_millis(100)),
                "round {round}: our own send's completion woke a solicited-only sleeper"
            );
        }
        // (On iWARP the completion raised the event: this arm consumes it.)
        assert!(
            srv.arm_solicited(),
            "round {round}: still armed, nothing pending"
        );
        let answer = format!("answer {round}");
        send(&mut cli, round, answer.as_bytes());
        assert!(
            readable_within(srv.fd(), STEP_TIMEOUT),
            "round {round}: the peer's message did not wake a solicited-only sleeper"
        );
        let arrived = poll_one(&mut srv, "the answer");
        let CompletionKind::Recv { slot, len } = arrived.kind else {
            panic!("round {round}: expected a receive, got {arrived:?}");
        };
        assert_eq!(srv.recv_slot(slot, len), answer.as_bytes());
        srv.post_recv(WrId(u64::from(slot.0)), slot)
            .expect("repost");
    }
    // Armed for every completion again, our own send's completion does raise the event.
    assert!(srv.arm(), "nothing is pending");
    srv.post_send(WrId(7), b"last").expect("post send");
    assert_eq!(receive(&mut cli), b"last");
    assert!(
        readable_within(srv.fd(), STEP_TIMEOUT),
        "armed for all completions, our send's completion raised no event"
    );
}

/// Waits (bounded) for the next completion of a connection behind the C ABI.
fn next_loaded_completion(conn: &mut LoadedConnection) -> san_api::Completion {
    let deadline = Instant::now() + STEP_TIMEOUT;
    let mut out = Vec::new();
    while conn.poll_completions(&mut out, 1) == 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero() && conn.wait(Some(left)),
            "no completion within {STEP_TIMEOUT:?}"
        );
    }
    out[0]
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn the_dlopened_library_carries_connections_and_rdma_through_the_c_abi() {
    const LEN: usize = 1 << 20;
    let library = VerbsLibrary::load_from(&built_library(), std::path::Path::new(SYSFS_DEVICES))
        .expect("load library");
    let mut server = library.open_domain_for(server_ip()).expect("server domain");
    let mut client = library.open_domain_for(client_ip()).expect("client domain");
    assert_eq!(
        server.capabilities(),
        server_domain().capabilities(),
        "capabilities survive the ABI"
    );
    let mut listener = server
        .listen(SocketAddr::new(server_ip(), 0), 4)
        .expect("listen");
    assert!(listener.fd() >= 0);
    let target = SocketAddr::new(server_ip(), listener.port());

    let (mut srv, mut cli, got, reply) = thread::scope(|scope| {
        let server = &mut server;
        let accepting = scope.spawn(move || {
            let (request, blob) = listener.next_request(Some(STEP_TIMEOUT)).expect("request");
            let mut params = ConnectParams::new(slots());
            params.private_data = b"abi-welcome";
            params.timeout = STEP_TIMEOUT;
            (request.accept(server, &params).expect("accept"), blob)
        });
        let (cli, reply) = client
            .connect(target, &params(b"abi-hello"))
            .expect("connect");
        let (srv, got) = accepting.join().expect("accept thread");
        (srv, cli, got, reply)
    });
    assert_eq!(
        (got.as_slice(), reply.as_slice()),
        (&b"abi-hello"[..], &b"abi-welcome"[..])
    );
    assert_eq!(srv.slot_config(), slots());
    assert!(srv.fd() >= 0 && cli.fd() >= 0);

    // A control message through the ABI, read back from the receive slot.
    let sink = Buffer::new(LEN);
    let sink_reg = server
        .register(sink.range(), Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("register");
    srv.post_send(
        WrId(1),
        &encode_descriptor(&sink_reg.remote_descriptor(sink.range()).expect("exposed")),
    )
    .expect("send");
    assert_eq!(next_loaded_completion(&mut srv).status, Ok(()));
    let completion = next_loaded_completion(&mut cli);
    let CompletionKind::Recv { slot, len } = completion.kind else {
        panic!("expected a receive: {completion:?}")
    };
    let remote = decode_descriptor(cli.recv_slot(slot, len));
    assert_eq!(remote.rkey, sink_reg.rkey.expect("rkey"));

    // An RDMA write through the ABI, verified byte for byte.
    let mut source = Buffer::new(LEN);
    source.as_mut_slice().copy_from_slice(&pattern(LEN, 0x5a));
    let source_reg = client
        .register(source.range(), Access::NONE)
        .expect("register");
    cli.post_write(
        WrId(2),
        LocalSegment {
            range: source.range(),
            lkey: source_reg.lkey,
        },
        remote,
    )
    .expect("write");
    let completion = next_loaded_completion(&mut cli);
    assert_eq!(
        (completion.wr_id, completion.kind, completion.status),
        (WrId(2), CompletionKind::Write, Ok(()))
    );
    cli.post_send(WrId(3), b"done").expect("send");
    assert_eq!(next_loaded_completion(&mut cli).status, Ok(()));
    let completion = next_loaded_completion(&mut srv);
    let CompletionKind::Recv { slot, len } = completion.kind else {
        panic!("expected a receive: {completion:?}")
    };
    assert_eq!(srv.recv_slot(slot, len), b"done");
    assert!(
        sink.snapshot() == source.as_slice(),
        "the write arrived intact"
    );
    assert_eq!(server.deregister(sink_reg.lkey), Ok(()));
    assert_eq!(
        server.deregister(sink_reg.lkey),
        Err(RegisterError::UnknownKey),
        "errors cross the ABI"
    );
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn a_request_names_its_source_and_its_accept_can_be_finished_later() {
    let (server, client) = (server_domain(), client_domain());
    let mut listener =
        VerbsListener::bind(&server, SocketAddr::new(server_ip(), 0), 4).expect("listen");
    let target = SocketAddr::new(server_ip(), listener.port());
    let (mut srv, mut cli, reply) = thread::scope(|scope| {
        let connecting = scope.spawn(|| {
            VerbsConnection::connect(&client, target, &params(b"first")).expect("connect")
        });
        let request = listener
            .next_request(Some(STEP_TIMEOUT))
            .expect("connection request");
        assert_eq!(
            request.peer().map(|peer| peer.ip()),
            Some(client_ip()),
            "the request names the address it came from"
        );
        let mut accept = ConnectParams::new(slots());
        accept.private_data = b"token-of-this-request";
        accept.timeout = STEP_TIMEOUT;
        // The reply goes out; establishment is not waited for here.
        let mut srv = request
            .accept_started(&server, &accept)
            .expect("reply sent");
        let (cli, reply) = connecting.join().expect("connect thread");
        srv.wait_established(STEP_TIMEOUT)
            .expect("established once the connector finished");
        (Peer::new(srv), Peer::new(cli), reply)
    });
    assert_eq!(reply, b"token-of-this-request");
    send(&mut cli, 1, b"over the connection accepted late");
    assert_eq!(receive(&mut srv), b"over the connection accepted late");
    send(&mut srv, 2, b"and back");
    assert_eq!(receive(&mut cli), b"and back");
    assert_eq!(
        srv.wait_established(Duration::ZERO),
        Ok(()),
        "an established connection answers at once"
    );
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn an_accept_finished_later_fails_when_the_connector_is_gone() {
    let (server, client) = (server_domain(), client_domain());
    let mut listener =
        VerbsListener::bind(&server, SocketAddr::new(server_ip(), 0), 4).expect("listen");
    let target = SocketAddr::new(server_ip(), listener.port());
    let mut srv = thread::scope(|scope| {
        let connecting = scope
            .spawn(|| VerbsConnection::connect(&client, target, &params(b"")).expect("connect"));
        let request = listener
            .next_request(Some(STEP_TIMEOUT))
            .expect("connection request");
        let mut accept = ConnectParams::new(slots());
        accept.timeout = STEP_TIMEOUT;
        let srv = request
            .accept_started(&server, &accept)
            .expect("reply sent");
        // The connector completes its side and leaves before ours is looked at.
        drop(connecting.join().expect("connect thread"));
        srv
    });
    let started = Instant::now();
    // Established and then disconnected, or never established: either way it is down, and
    // the wait ends well before its bound.
    let outcome = srv.wait_established(STEP_TIMEOUT);
    if outcome.is_ok() {
        let mut out = Vec::new();
        while !srv.is_down() {
            assert!(
                started.elapsed() < STEP_TIMEOUT,
                "the disconnect is reported"
            );
            srv.poll_completions(&mut out, 8);
            srv.wait(Some(Duration::from_millis(100)));
        }
    } else {
        assert!(
            srv.is_down(),
            "a failed establishment leaves it down: {outcome:?}"
        );
    }
    assert!(started.elapsed() < STEP_TIMEOUT);
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn request_sources_and_late_accepts_cross_the_c_abi() {
    let library = VerbsLibrary::load_from(&built_library(), std::path::Path::new(SYSFS_DEVICES))
        .expect("load library");
    let mut server = library.open_domain_for(server_ip()).expect("server domain");
    let mut client = library.open_domain_for(client_ip()).expect("client domain");
    let mut listener = server
        .listen(SocketAddr::new(server_ip(), 0), 4)
        .expect("listen");
    let target = SocketAddr::new(server_ip(), listener.port());
    let (mut srv, mut cli, reply) = thread::scope(|scope| {
        let client = &mut client;
        let connecting =
            scope.spawn(move || client.connect(target, &params(b"abi")).expect("connect"));
        let (request, blob) = listener.next_request(Some(STEP_TIMEOUT)).expect("request");
        assert_eq!(blob, b"abi");
        assert_eq!(request.peer().map(|peer| peer.ip()), Some(client_ip()));
        let mut accept = ConnectParams::new(slots());
        accept.private_data = b"abi-token";
        accept.timeout = STEP_TIMEOUT;
        let mut srv = request
            .accept_started(&mut server, &accept)
            .expect("reply sent");
        let (cli, reply) = connecting.join().expect("connect thread");
        srv.wait_established(STEP_TIMEOUT).expect("established");
        (srv, cli, reply)
    });
    assert_eq!(reply, b"abi-token");
    cli.post_send(WrId(1), b"late").expect("send");
    assert_eq!(next_loaded_completion(&mut cli).status, Ok(()));
    let completion = next_loaded_completion(&mut srv);
    let CompletionKind::Recv { slot, len } = completion.kind else {
        panic!("expected a receive: {completion:?}")
    };
    assert_eq!(srv.recv_slot(slot, len), b"late");
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn peer_close_is_reported_and_flushes_every_posted_receive() {
    let (server, client) = (server_domain(), client_domain());
    let (srv, mut cli, _, _) = connected_pair(&server, &client, b"", b"");
    drop(srv);
    let closed = Instant::now();
    let mut flushed = Vec::new();
    let mut out = Vec::new();
    while flushed.len() < 8 {
        assert!(
            closed.elapsed() < STEP_TIMEOUT,
            "receives not flushed: {flushed:?}"
        );
        if cli.poll_completions(&mut out, 8) == 0 {
            assert_ne!(cli.wait(Some(STEP_TIMEOUT)), WaitOutcome::TimedOut);
            continue;
        }
        for completion in out.drain(..) {
            assert_eq!(
                completion.status,
                Err(CompletionError::Flushed),
                "{completion:?}"
            );
            flushed.push(completion.wr_id.0);
        }
    }
    flushed.sort_unstable();
    assert_eq!(
        flushed,
        (0..8).collect::<Vec<_>>(),
        "each posted receive completes once"
    );
    assert!(cli.is_down());
    assert_eq!(cli.post_send(WrId(1), b"x"), Err(PostError::Disconnected));
    let started = Instant::now();
    assert_eq!(cli.wait(Some(STEP_TIMEOUT)), WaitOutcome::Disconnected);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "nothing outstanding: no reason to block"
    );
}

/// Waits (bounded) for the next request at `listener`, through the provider contract only.
fn next_request_via_contract<C: SanConnector>(
    connector: &mut C,
    listener: &mut C::Listener,
) -> C::Request {
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        if let Some(request) = connector.poll_request(listener).expect("poll_request") {
            return request;
        }
        assert!(
            Instant::now() < deadline,
            "no request within {STEP_TIMEOUT:?}"
        );
        thread::sleep(Duration::from_millis(5));
    }
}

/// Connects through the contract, waiting for the answer.
fn connect_via_contract<C: SanConnector>(
    connector: &mut C,
    remote: &C::Address,
    blob: &[u8],
) -> Result<Established<C::Connection>, SetupError> {
    let mut pending = connector.connect(remote, slots(), blob)?;
    let deadline = Instant::now() + STEP_TIMEOUT;
    loop {
        match connector.poll_connect(pending)? {
            ConnectProgress::Established(established) => return Ok(established),
            ConnectProgress::Pending(still) => pending = still,
        }
        assert!(
            Instant::now() < deadline,
            "no answer within {STEP_TIMEOUT:?}"
        );
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn the_provider_contract_connects_rejects_and_carries_both_blobs() {
    let (server, client) = (server_domain(), client_domain());
    let config = ConnectorConfig {
        timeout: STEP_TIMEOUT,
        local: Some(client_ip()),
        ..ConnectorConfig::default()
    };
    let mut passive = VerbsConnector::new(&server, config);
    let mut active = VerbsConnector::new(&client, config);
    assert_eq!(active.max_private_data(), 55);
    assert_eq!(
        active
            .connect(&SocketAddr::new(server_ip(), 1), slots(), &[0; 56])
            .err(),
        Some(SetupError::Other),
        "a blob over the rdma_cm limit is refused before anything is sent"
    );
    let mut listener = passive
        .listen(&SocketAddr::new(server_ip(), 0))
        .expect("listen");
    let remote = SocketAddr::new(server_ip(), listener.port());
    assert!(
        passive.poll_request(&mut listener).expect("poll").is_none(),
        "polling an idle listener returns at once with nothing"
    );

    let (mut accepted, mut connected) = thread::scope(|scope| {
        let answering = scope.spawn(|| {
            let declined = next_request_via_contract(&mut passive, &mut listener);
            assert_eq!(declined.private_data(), b"first: decline me");
            passive.reject(declined);
            let request = next_request_via_contract(&mut passive, &mut listener);
            assert_eq!(request.private_data(), b"second: 4-tuple");
            passive
                .accept(request, slots(), b"accepted")
                .expect("accept")
        });
        let refused = connect_via_contract(&mut active, &remote, b"first: decline me")
            .err()
            .expect("the first request is declined");
        assert_eq!(refused, SetupError::Rejected);
        assert!(refused.allows_tcp_fallback());
        let established =
            connect_via_contract(&mut active, &remote, b"second: 4-tuple").expect("connect");
        assert_eq!(established.peer_private_data, b"accepted");
        (
            answering.join().expect("answering thread"),
            established.connection,
        )
    });

    // Pre-posted receives (wr id = slot) make the first message land at once.
    connected
        .post_send(WrId(1), b"over the contract")
        .expect("send");
    let got = next_raw_completion(&mut accepted);
    assert_eq!(got.status, Ok(()));
    let CompletionKind::Recv { slot, len } = got.kind else {
        panic!("expected a receive, got {got:?}");
    };
    assert_eq!(accepted.recv_slot(slot, len), b"over the contract");
    assert_eq!(
        next_raw_completion(&mut connected).kind,
        CompletionKind::Send
    );
}
