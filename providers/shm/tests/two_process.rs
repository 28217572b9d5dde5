//! Two real processes: this test binary re-executes itself as the peer (`peer_main`, selected
//! with `--ignored --exact peer_main` and the `SAN_SHM_PEER` environment variable).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use common::{
    fill_pattern, matches_pattern, segment_config, test_connection_config, Endpoint, TestDir,
};
use san_api::{
    Access, CompletionError, CompletionKind, LocalKey, LocalSegment, MemRange, PostError,
    RemoteDescriptor, RemoteKey, SanConnection, SanDomain,
};
use san_shm::{
    DomainConfig, PermissionProblem, SegmentConfig, ShmConnection, ShmDir, ShmDomain, ShmError,
    ShmSegment, WaitResult,
};

const ROLE: &str = "SAN_SHM_PEER";
const DIR: &str = "SAN_SHM_DIR";
const NAME: &str = "SAN_SHM_NAME";

// Commands of the service peer (first byte of a message).
const ECHO: u8 = 1;
const EXPOSE: u8 = 2;
const REVOKE: u8 = 3;
const REEXPOSE: u8 = 4;
const VERIFY: u8 = 5;
const SLEEP_THEN_REPLY: u8 = 6;
const SINK: u8 = 7;
const EXIT: u8 = 9;

fn spawn_peer(role: &str, dir: &Path, name: &str) -> Command {
    peer_command(&std::env::current_exe().unwrap(), role, dir, name)
}

fn peer_command(exe: &Path, role: &str, dir: &Path, name: &str) -> Command {
    let mut command = Command::new(exe);
    command
        .args([
            "--ignored",
            "--exact",
            "peer_main",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env(DIR, dir)
        .env(NAME, name)
        .stdout(Stdio::null());
    command
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// The peer process. Not a test of its own: run only when re-executed by a test.
#[test]
#[ignore = "peer process entry point, run by the two-process tests"]
fn peer_main() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let dir = std::path::PathBuf::from(std::env::var(DIR).unwrap());
    let name = std::env::var(NAME).unwrap();
    match role.as_str() {
        "service" => service(&ShmDir::open(&dir).unwrap(), &name),
        "create-and-vanish" => {
            let handle = ShmDir::open(&dir).unwrap();
            let segment = ShmSegment::create(&handle, &name, &segment_config(256, 4)).unwrap();
            // Exit without running destructors: the file stays behind, as after a crash.
            std::mem::forget(segment);
            std::process::exit(0);
        }
        "create-and-hold" => {
            // Holds a pending segment until the test creates `<dir>/done` (bounded), telling
            // it is ready by creating `<dir>/ready`.
            let handle = ShmDir::open(&dir).unwrap();
            let segment = ShmSegment::create(&handle, &name, &segment_config(256, 4)).unwrap();
            std::fs::write(dir.join("ready"), std::process::id().to_string()).unwrap();
            let deadline = Instant::now() + Duration::from_secs(30);
            while !dir.join("done").exists() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            std::mem::forget(segment);
            std::process::exit(0);
        }
        "attach-as-other-user" => {
            // Another user may not even open the directory (Kernel), or finds it is not its
            // own (WrongOwner).
            let attached =
                ShmDir::open(&dir).and_then(|dir| ShmSegment::attach(&dir, &name).map(|_| ()));
            let code = match attached {
                Ok(()) => 10,
                Err(ShmError::PermissionDenied(PermissionProblem::Kernel)) => 1,
                Err(ShmError::PermissionDenied(PermissionProblem::WrongOwner { .. })) => 2,
                Err(_) => 20,
            };
            std::process::exit(code);
        }
        other => panic!("unknown peer role {other}"),
    }
}

/// Obeys commands from the creator until told to exit or the connection goes down.
fn service(dir: &ShmDir, name: &str) {
    let mut domain = ShmDomain::default();
    let segment = ShmSegment::attach(dir, name).unwrap();
    let conn = ShmConnection::new(segment, &domain, test_connection_config()).unwrap();
    let mut peer = Endpoint::new(conn);
    let mut buffers: Vec<(LocalKey, Vec<u8>)> = Vec::new();
    let mut sink_expected: Option<(u64, u64, u64)> = None; // (remaining, next seq, checksum)
    while peer.conn.is_up() {
        let Some(message) = peer.next_message(Duration::from_secs(30)) else {
            return;
        };
        if let Some((remaining, next, checksum)) = sink_expected.as_mut() {
            // SINK mode: [seq u64][pattern bytes]; verify order and contents, return credits.
            let seq = u64_at(&message, 0);
            let intact = seq == *next && matches_pattern(&message[8..], seq);
            *checksum = checksum
                .wrapping_mul(31)
                .wrapping_add(seq ^ message.len() as u64);
            *next += 1;
            *remaining -= 1;
            if !intact {
                peer.send(&[0xEE]);
                return;
            }
            if *remaining == 0 {
                let mut reply = vec![SINK];
                reply.extend_from_slice(&checksum.to_le_bytes());
                peer.send(&reply);
                sink_expected = None;
            } else if *next % 8 == 0 {
                peer.send(&[0xC0, 8]); // eight credits back
            }
            continue;
        }
        match message[0] {
            ECHO => peer.send(&message),
            EXPOSE => {
                let (len, seed, access) = (u64_at(&message, 1), u64_at(&message, 9), message[17]);
                let mut buffer = vec![0u8; len as usize];
                fill_pattern(&mut buffer, seed);
                let range = MemRange::new(buffer.as_mut_ptr() as u64, len);
                let reg = domain
                    .register(range, Access::from_bits_truncate(access))
                    .unwrap();
                let mut reply = reg.lkey.0.to_le_bytes().to_vec();
                reply.extend_from_slice(&reg.rkey.map_or(0, |k| k.0).to_le_bytes());
                reply.extend_from_slice(&range.addr.to_le_bytes());
                buffers.push((reg.lkey, buffer));
                peer.send(&reply);
            }
            REVOKE => {
                domain.revoke_remote(LocalKey(u32_at(&message, 1))).unwrap();
                peer.send(&[REVOKE]);
            }
            REEXPOSE => {
                let rkey = domain
                    .expose_remote(
                        LocalKey(u32_at(&message, 1)),
                        Access::from_bits_truncate(message[5]),
                    )
                    .unwrap();
                peer.send(&rkey.0.to_le_bytes());
            }
            VERIFY => {
                let (lkey, seed) = (LocalKey(u32_at(&message, 1)), u64_at(&message, 5));
                let ok = buffers
                    .iter()
                    .any(|(key, buffer)| *key == lkey && matches_pattern(buffer, seed));
                peer.send(&[VERIFY, u8::from(ok)]);
            }
            SLEEP_THEN_REPLY => {
                std::thread::sleep(Duration::from_millis(u64_at(&message, 1)));
                peer.send(&[SLEEP_THEN_REPLY]);
                // Flush and report how many wake-ups that send needed.
                peer.poll();
                peer.send(&peer.conn.stats().wakeups_sent.to_le_bytes());
            }
            SINK => sink_expected = Some((u64_at(&message, 1), 0, 0)),
            EXIT => return,
            other => panic!("unknown command {other}"),
        }
    }
}

struct Session {
    dir: TestDir,
    me: Endpoint,
    domain: ShmDomain,
    child: Child,
}

impl Session {
    fn start(tag: &str, config: SegmentConfig, domain: DomainConfig) -> Session {
        let dir = TestDir::new(tag);
        let domain = ShmDomain::new(domain);
        let segment = ShmSegment::create(dir.handle(), "s", &config).unwrap();
        let conn = ShmConnection::new(segment, &domain, test_connection_config()).unwrap();
        let child = spawn_peer("service", dir.path(), "s").spawn().unwrap();
        let mut me = Endpoint::new(conn);
        assert!(
            me.drive_until(Duration::from_secs(20), |e| e.conn.is_peer_attached()),
            "peer attached"
        );
        me.poll();
        Session {
            dir,
            me,
            domain,
            child,
        }
    }

    fn finish(mut self) -> ExitStatus {
        self.me.send(&[EXIT]);
        self.me.poll();
        let status = self.child.wait().unwrap();
        drop(self.dir);
        status
    }

    /// Asks the peer to expose `len` bytes of pattern `seed`; returns (lkey, descriptor).
    fn expose(&mut self, len: u64, seed: u64, access: Access) -> (u32, RemoteDescriptor) {
        let mut request = vec![EXPOSE];
        request.extend_from_slice(&len.to_le_bytes());
        request.extend_from_slice(&seed.to_le_bytes());
        request.push(access.bits());
        let reply = self.me.request(&request);
        let descriptor = RemoteDescriptor {
            addr: u64_at(&reply, 8),
            len,
            rkey: RemoteKey(u32_at(&reply, 4)),
        };
        (u32_at(&reply, 0), descriptor)
    }

    fn verify(&mut self, lkey: u32, seed: u64) -> bool {
        let mut request = vec![VERIFY];
        request.extend_from_slice(&lkey.to_le_bytes());
        request.extend_from_slice(&seed.to_le_bytes());
        self.me.request(&request) == [VERIFY, 1]
    }

    fn rdma(
        &mut self,
        read: bool,
        local: LocalSegment,
        remote: RemoteDescriptor,
    ) -> Result<(), CompletionError> {
        let wr = self.me.wr();
        if read {
            self.me.conn.post_read(wr, local, remote).unwrap();
        } else {
            self.me.conn.post_write(wr, local, remote).unwrap();
        }
        let completion = self
            .me
            .next_other(Duration::from_secs(20))
            .expect("RDMA completion");
        assert_eq!(completion.wr_id, wr);
        assert_eq!(
            completion.kind,
            if read {
                CompletionKind::Read
            } else {
                CompletionKind::Write
            }
        );
        completion.status
    }
}

#[test]
fn messages_of_every_size_cross_between_processes_in_order_and_intact() {
    let slot_size = 2048;
    let mut session = Session::start(
        "sizes",
        segment_config(slot_size, 8),
        DomainConfig::default(),
    );
    for size in 1..=slot_size as usize {
        let mut message = vec![0u8; size];
        fill_pattern(&mut message, size as u64);
        message[0] = ECHO;
        let echo = session.me.request(&message);
        assert_eq!(echo.len(), size);
        assert!(echo == message, "echo of {size} bytes differs");
    }
    assert!(session.finish().success());
}

#[test]
fn a_hundred_thousand_messages_flow_under_credits() {
    const COUNT: u64 = 100_000;
    let recv_slots = 16u16;
    let mut session = Session::start(
        "credits",
        segment_config(256, recv_slots),
        DomainConfig::default(),
    );
    let mut request = vec![SINK];
    request.extend_from_slice(&COUNT.to_le_bytes());
    session.me.send(&request);
    // The service re-posts its slot for the SINK command itself before the stream starts, so
    // all its slots are available.
    let mut credits = u64::from(recv_slots);
    let mut checksum = 0u64;
    let started = Instant::now();
    for seq in 0..COUNT {
        while credits == 0 {
            let message = session
                .me
                .next_message(Duration::from_secs(20))
                .expect("credits");
            assert_eq!(message[0], 0xC0, "credit message, not an error report");
            credits += u64::from(message[1]);
        }
        let len = 8 + (seq % 240) as usize;
        let mut message = vec![0u8; len];
        fill_pattern(&mut message[8..], seq);
        message[..8].copy_from_slice(&seq.to_le_bytes());
        checksum = checksum.wrapping_mul(31).wrapping_add(seq ^ len as u64);
        session.me.send(&message);
        credits -= 1;
    }
    let summary = loop {
        let message = session
            .me
            .next_message(Duration::from_secs(20))
            .expect("summary");
        if message[0] != 0xC0 {
            break message;
        }
    };
    assert_eq!(
        summary[0], SINK,
        "peer saw every message in order and intact"
    );
    assert_eq!(u64_at(&summary, 1), checksum);
    eprintln!("100k messages with credits in {:?}", started.elapsed());
    assert!(session.finish().success());
}

fn rdma_4mib(domain: DomainConfig) {
    const LEN: u64 = 4 << 20;
    let mut session = Session::start("rdma", segment_config(256, 4), domain);
    assert_eq!(
        session.me.conn.capabilities().rdma_read,
        !domain.force_window
    );
    let (lkey, remote) = session.expose(LEN, 11, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let mut mine = vec![0u8; LEN as usize];
    let range = MemRange::new(mine.as_mut_ptr() as u64, LEN);
    let reg = session.domain.register(range, Access::LOCAL_WRITE).unwrap();
    let local = LocalSegment {
        range,
        lkey: reg.lkey,
    };
    if domain.force_window {
        let wr = session.me.wr();
        assert_eq!(
            session.me.conn.post_read(wr, local, remote),
            Err(PostError::InvalidArgument)
        );
    } else {
        assert_eq!(session.rdma(true, local, remote), Ok(()));
        assert!(
            matches_pattern(&mine, 11),
            "RDMA read delivered the peer's 4 MiB"
        );
    }
    fill_pattern(&mut mine, 12);
    // Post the write and the "done" message back to back: the message must not overtake the
    // data (4 MiB is 16 windows on the window path).
    let wr = session.me.wr();
    session.me.conn.post_write(wr, local, remote).unwrap();
    assert!(
        session.verify(lkey, 12),
        "the peer sees the written pattern when the next message arrives"
    );
    let write = session
        .me
        .next_other(Duration::from_secs(10))
        .expect("write completion");
    assert_eq!((write.wr_id, write.status), (wr, Ok(())));
    assert!(session.finish().success());
}

#[test]
fn rdma_read_and_write_of_4_mib_over_cma() {
    rdma_4mib(DomainConfig::default());
}

#[test]
fn rdma_write_of_4_mib_through_the_window() {
    rdma_4mib(DomainConfig { force_window: true });
}

fn access_checks(domain: DomainConfig) {
    let mut session = Session::start("keys", segment_config(256, 4), domain);
    let (lkey, remote) = session.expose(64 << 10, 5, Access::REMOTE_READ | Access::REMOTE_WRITE);
    let mut mine = [0u8; 100];
    let range = MemRange::new(mine.as_mut_ptr() as u64, 100);
    let reg = session.domain.register(range, Access::LOCAL_WRITE).unwrap();
    let local = LocalSegment {
        range,
        lkey: reg.lkey,
    };
    let tail = RemoteDescriptor {
        addr: remote.addr + remote.len - 50,
        len: 100,
        rkey: remote.rkey,
    };
    assert_eq!(
        session.rdma(false, local, tail),
        Err(CompletionError::RemoteAccess),
        "write past the end"
    );
    let forged = RemoteDescriptor {
        rkey: RemoteKey(remote.rkey.0 ^ (1 << 12)),
        ..remote
    };
    assert_eq!(
        session.rdma(false, local, forged),
        Err(CompletionError::RemoteAccess),
        "guessed generation"
    );
    assert_eq!(
        session
            .me
            .request(&[&[REVOKE][..], &lkey.to_le_bytes()].concat()),
        [REVOKE]
    );
    assert_eq!(
        session.rdma(false, local, remote),
        Err(CompletionError::RemoteAccess),
        "revoked"
    );
    let reply = session.me.request(
        &[
            &[REEXPOSE][..],
            &lkey.to_le_bytes(),
            &[Access::REMOTE_WRITE.bits()],
        ]
        .concat(),
    );
    let fresh = RemoteKey(u32_at(&reply, 0));
    assert_ne!(fresh, remote.rkey, "a fresh rkey, never the revoked one");
    assert_eq!(
        session.rdma(
            false,
            local,
            RemoteDescriptor {
                rkey: fresh,
                ..remote
            }
        ),
        Ok(())
    );
    if !domain.force_window {
        assert_eq!(
            session.rdma(true, local, tail),
            Err(CompletionError::RemoteAccess),
            "read past the end"
        );
        assert_eq!(
            session.rdma(
                true,
                local,
                RemoteDescriptor {
                    rkey: fresh,
                    ..remote
                }
            ),
            Err(CompletionError::RemoteAccess),
            "re-exposed for write only"
        );
    }
    assert!(session.finish().success());
}

#[test]
fn revoked_and_out_of_range_rdma_fails_over_cma() {
    access_checks(DomainConfig::default());
}

#[test]
fn revoked_and_out_of_range_rdma_fails_through_the_window() {
    access_checks(DomainConfig { force_window: true });
}

#[test]
fn wait_sleeps_and_is_woken_by_the_peers_message() {
    let mut session = Session::start("wake", segment_config(256, 4), DomainConfig::default());
    let mut request = vec![SLEEP_THEN_REPLY];
    request.extend_from_slice(&300u64.to_le_bytes());
    session.me.send(&request);
    session.me.poll();
    let sleeps_before = session.me.conn.stats().sleeps;
    let start = Instant::now();
    let mut result = WaitResult::TimedOut;
    while session.me.messages.is_empty() && start.elapsed() < Duration::from_secs(5) {
        result = session.me.conn.wait(Duration::from_secs(5));
        session.me.poll();
    }
    let waited = start.elapsed();
    assert_eq!(result, WaitResult::Notified);
    assert_eq!(
        session.me.messages.pop_front().as_deref(),
        Some([SLEEP_THEN_REPLY].as_slice())
    );
    assert!(
        waited >= Duration::from_millis(250) && waited < Duration::from_secs(2),
        "woke after {waited:?}"
    );
    assert!(
        session.me.conn.stats().sleeps > sleeps_before,
        "we slept rather than spun"
    );
    let wakeups = u64_at(&session.me.next_message(Duration::from_secs(5)).unwrap(), 0);
    assert!(wakeups >= 1, "the peer counted the wake-up it sent");
    assert!(session.finish().success());
}

#[test]
fn a_sigkilled_peer_is_detected_within_a_second() {
    let mut session = Session::start("kill", segment_config(256, 4), DomainConfig::default());
    for round in 0..100u64 {
        let message = [&[ECHO][..], &round.to_le_bytes()].concat();
        assert_eq!(session.me.request(&message), message);
    }
    // Mid-transfer: an echo in flight when the peer dies.
    session.me.send(&[ECHO, 1, 2, 3]);
    session.child.kill().unwrap(); // SIGKILL; the child stays a zombie until reaped below
    let killed = Instant::now();
    let detected = session
        .me
        .drive_until(Duration::from_secs(3), |e| !e.conn.is_up());
    let took = killed.elapsed();
    assert!(
        detected && took < Duration::from_secs(1),
        "detected={detected} after {took:?}"
    );
    let errors: Vec<_> = session.me.others.drain(..).map(|c| c.status).collect();
    assert!(
        !errors.is_empty(),
        "outstanding receives complete with errors"
    );
    assert!(errors.iter().all(|s| matches!(
        s,
        Err(CompletionError::RetryExceeded | CompletionError::Flushed)
    )));
    assert_eq!(
        errors
            .iter()
            .filter(|s| **s == Err(CompletionError::RetryExceeded))
            .count(),
        1
    );
    let wr = session.me.wr();
    assert_eq!(
        session.me.conn.post_send(wr, b"anyone?"),
        Err(PostError::Disconnected)
    );
    let status = session.child.wait().unwrap();
    assert!(!status.success());
}

#[test]
fn a_stale_segment_of_a_dead_creator_is_replaced() {
    let dir = TestDir::new("stale");
    let status = spawn_peer("create-and-vanish", dir.path(), "s")
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        dir.path().join("s").exists(),
        "the dead creator left its file"
    );
    let segment = ShmSegment::create(dir.handle(), "s", &segment_config(256, 4))
        .expect("stale file replaced");
    let attached = ShmSegment::attach(dir.handle(), "s").unwrap();
    assert_eq!(
        attached.peer_pid(),
        Some(std::process::id()),
        "the new file is ours"
    );
    drop(segment);
}

/// A pid no process of this namespace has (near `pid_max`), for a child pid namespace to
/// hand its next process: the number the creator records then names nobody here.
fn pid_unused_here() -> Option<u32> {
    let max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (max.checked_sub(1000)?..max.checked_sub(10)?)
        .step_by(97)
        .find(|pid| (*pid..pid + 10).all(|p| !Path::new(&format!("/proc/{p}")).exists()))
}

#[test]
fn a_live_creator_in_another_pid_namespace_keeps_its_name() {
    let dir = TestDir::new("pidns");
    let Some(last_pid) = pid_unused_here() else {
        eprintln!("SKIPPED: no pid_max to pick an unused pid from");
        return;
    };
    // The creator runs in a fresh pid namespace, as the next process after `last_pid`
    // there: the pid it records is no process of ours.
    let exe = std::env::current_exe().unwrap();
    let script = r#"echo "$0" > /proc/sys/kernel/ns_last_pid || exit 97; "$@"; exit $?"#;
    let mut command = Command::new("unshare");
    command
        .args(["--pid", "--fork", "--mount-proc", "sh", "-c", script])
        .arg(last_pid.to_string())
        .arg(&exe)
        .args([
            "--ignored",
            "--exact",
            "peer_main",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, "create-and-hold")
        .env(DIR, dir.path())
        .env(NAME, "s")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            eprintln!("SKIPPED: cannot run unshare ({error})");
            return;
        }
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while !dir.path().join("ready").exists() {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            use std::io::Read as _;
            let _ = child.stderr.take().unwrap().read_to_string(&mut stderr);
            eprintln!(
                "SKIPPED: no pid namespace here ({status}: {})",
                stderr.trim()
            );
            return;
        }
        assert!(Instant::now() < deadline, "the creator never got ready");
        std::thread::sleep(Duration::from_millis(10));
    }
    let recorded = std::fs::read_to_string(dir.path().join("ready")).unwrap();
    assert_eq!(
        recorded,
        (last_pid + 1).to_string(),
        "the creator runs as the pid picked for it in its namespace"
    );
    assert!(
        !Path::new(&format!("/proc/{recorded}")).exists(),
        "its pid names no process here"
    );
    let taken = ShmSegment::create(dir.handle(), "s", &segment_config(256, 4)).map(|_| ());
    let still_there = dir.path().join("s").exists();
    std::fs::write(dir.path().join("done"), b"").unwrap();
    let status = child.wait().unwrap();
    assert_eq!(
        taken,
        Err(ShmError::AlreadyExists),
        "a live creator's segment is not stale"
    );
    assert!(still_there, "a live creator's segment keeps its name");
    assert!(status.success());
    // Once the creator is gone, its segment is stale, whatever namespace it ran in.
    let segment = ShmSegment::create(dir.handle(), "s", &segment_config(256, 4))
        .expect("the dead creator's file is replaced");
    drop(segment);
}

#[test]
fn another_user_cannot_attach() {
    if std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .any(|l| l.starts_with("Uid:") && !l.contains("\t0\t"))
    {
        eprintln!("SKIPPED another_user_cannot_attach: needs root to run a peer as uid 65534");
        return;
    }
    let dir = TestDir::new("uid");
    let segment = ShmSegment::create(dir.handle(), "s", &segment_config(256, 4)).unwrap();
    // The build directory may not be reachable for uid 65534: run a world-readable copy.
    let exe_dir = std::env::temp_dir().join(format!("san-shm-uid-test-{}", std::process::id()));
    std::fs::create_dir_all(&exe_dir).unwrap();
    std::fs::set_permissions(&exe_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let exe = exe_dir.join("peer");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let run_as_nobody = || {
        peer_command(&exe, "attach-as-other-user", dir.path(), "s")
            .uid(65534)
            .gid(65534)
            .status()
            .expect("run the peer as uid 65534")
    };
    // Default modes (0700 directory, 0600 file): the kernel refuses.
    assert_eq!(run_as_nobody().code(), Some(1));
    // Even with the directory and the file opened up to the world, the owner checks refuse
    // (the directory's, before the file's).
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(segment.path(), std::fs::Permissions::from_mode(0o666)).unwrap();
    assert_eq!(run_as_nobody().code(), Some(2));
    assert!(
        !segment.is_attached(),
        "the refused attacher claimed nothing"
    );
    std::fs::set_permissions(segment.path(), std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(
        ShmSegment::attach(dir.handle(), "s").is_ok(),
        "the owner still can"
    );
    let _ = std::fs::remove_dir_all(&exe_dir);
}
