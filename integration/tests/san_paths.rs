//! The SAN path end to end: unmodified programs (`san_echo`, blocking `std::net`) under the
//! preload (the SAN path is the default) switch to the intra-host SAN exactly, and stay on TCP
//! when either side is not preloaded.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SAN_ECHO: &str = env!("CARGO_BIN_EXE_san_echo");
const SAN_EPOLL: &str = env!("CARGO_BIN_EXE_san_epoll");
const SAN_FDS: &str = env!("CARGO_BIN_EXE_san_fds");
const SAN_MANY: &str = env!("CARGO_BIN_EXE_san_many");
const HIGH_FDS: &str = env!("CARGO_BIN_EXE_high_fds");

/// `libsandirect.so`, built once per test run (same profile as this test).
fn library() -> &'static Path {
    &integration::apps::products().library
}

/// Private stats and segment directories for one test.
struct Dirs {
    stat: PathBuf,
    shm: PathBuf,
}

impl Dirs {
    fn new(name: &str) -> Dirs {
        let base =
            std::env::temp_dir().join(format!("sandirect-san-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let make = |sub: &str| {
            let dir = base.join(sub);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .unwrap();
            dir
        };
        std::fs::create_dir_all(&base).unwrap();
        std::fs::set_permissions(&base, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
        Dirs {
            stat: make("stat"),
            shm: make("shm"),
        }
    }

    /// Segment files (and half-created ones) left behind (the pending-ports table, shared by
    /// every connection, stays by design).
    fn leftover_segments(&self) -> Vec<String> {
        std::fs::read_dir(&self.shm)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name != san_shm::PENDING_PORTS_FILE)
            .collect()
    }
}

fn command(program: &str, preload: bool, dirs: &Dirs) -> Command {
    let mut command = Command::new(program);
    command
        .env_remove("LD_PRELOAD")
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env("SANDIRECT_STAT_DIR", &dirs.stat)
        .env("SANDIRECT_SHM_DIR", &dirs.shm);
    if preload {
        // The SAN path is the default: nothing but the preload is set.
        command.env("LD_PRELOAD", library());
    }
    command
}

/// Waits for `child` with a deadline (a hang is a failure, not a stuck test run).
fn finish(child: Child, what: &str) -> String {
    integration::finish_child(child, what, Duration::from_secs(60))
}

/// Spawns a server that prints `port P` first, its output piped: the child, its stdout (for
/// later lines and for `finish`), and the port.
fn spawn_announcing(
    command: &mut Command,
) -> (Child, BufReader<std::process::ChildStdout>, String) {
    let mut server = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(server.stdout.take().unwrap());
    let port = integration::read_port(&mut reader);
    (server, reader, port)
}

/// Runs a `san_echo` server and client in two processes; returns (server, client) reports.
fn two_processes(
    protocol: &str,
    bytes: usize,
    server_preloaded: bool,
    client_preloaded: bool,
    dirs: &Dirs,
) -> (String, String) {
    let (mut server, reader, port) =
        spawn_announcing(command(SAN_ECHO, server_preloaded, dirs).args(["server", protocol]));
    let client = command(SAN_ECHO, client_preloaded, dirs)
        .args(["client", &port, protocol, &bytes.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Both ends' outcomes before any verdict: the side that gives up first (a client timing
    // out on its reads) is often not the one that went wrong.
    let client_result = integration::wait_child(client, "client", Duration::from_secs(60));
    server.stdout = Some(reader.into_inner());
    let how = match (server_preloaded, client_preloaded) {
        (false, false) => "natively",
        (true, true) => "both preloaded",
        (true, false) => "server preloaded",
        (false, true) => "client preloaded",
    };
    both_ends(server, client_result, &format!("`{protocol}` {how}"))
}

/// Waits for `server` (its stdout back in place) after its client's outcome: both reports,
/// or a failure that shows both ends (a server whose client failed gets 10 s, not 60).
fn both_ends(server: Child, client: Result<String, String>, what: &str) -> (String, String) {
    let server_wait = Duration::from_secs(if client.is_ok() { 60 } else { 10 });
    match (
        integration::wait_child(server, "server", server_wait),
        client,
    ) {
        (Ok(server_report), Ok(client_report)) => (server_report, client_report),
        (server, client) => {
            let shown = |result: Result<String, String>| match result {
                Ok(out) => format!("ok:\n{out}"),
                Err(failure) => failure,
            };
            panic!(
                "{what}:\n--- server: {}\n--- client: {}",
                shown(server),
                shown(client)
            );
        }
    }
}

fn expect(report: &str, side: &str, bytes: usize, path: &str) {
    let line = report
        .lines()
        .find(|l| l.starts_with(side))
        .unwrap_or_else(|| panic!("no {side} line in {report}"));
    assert!(line.contains(&format!("ok bytes={bytes} ")), "{line}");
    assert!(
        line.ends_with(&format!("path={path}")),
        "expected path {path}: {line}"
    );
}

/// Put before every `python_pair` script: the server's listener, its port announced.
const PYTHON_PRELUDE: &str = r#"
import socket as _socket
def listen_announced():
    listener = _socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    print(listener.getsockname()[1], flush=True)
    return listener
"#;

/// Runs `script` (written into the test's directory as `name`, after [`PYTHON_PRELUDE`]) as
/// a preloaded server (`server SERVER_ARGS…`, printing its port first) and a preloaded client
/// (`client PORT CLIENT_ARGS…`); returns (server report, client report). With
/// `client_output` false the client's output is not kept (a client that kills itself).
fn python_pair(
    dirs: &Dirs,
    name: &str,
    script: &str,
    server_args: &[&str],
    client_args: &[&str],
    client_output: bool,
) -> (String, String) {
    let path = dirs.stat.parent().unwrap().join(name);
    std::fs::write(&path, format!("{PYTHON_PRELUDE}{script}")).unwrap();
    let mut server = command("python3", true, dirs)
        .arg(&path)
        .arg("server")
        .args(server_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(server.stdout.take().unwrap());
    let mut port = String::new();
    reader.read_line(&mut port).unwrap();
    let output = || {
        if client_output {
            Stdio::piped()
        } else {
            Stdio::null()
        }
    };
    let client = command("python3", true, dirs)
        .arg(&path)
        .args(["client", port.trim()])
        .args(client_args)
        .stdout(output())
        .stderr(output())
        .spawn()
        .unwrap();
    // Both ends' outcomes before any verdict, as in `two_processes`.
    let client_result = if client_output {
        integration::wait_child(client, "client", Duration::from_secs(60))
    } else {
        let _ = client.wait_with_output();
        Ok(String::new())
    };
    server.stdout = Some(reader.into_inner());
    both_ends(server, client_result, name)
}

/// Runs `protocol` natively and with both ends preloaded; both must move `bytes` intact.
fn natively_and_over_the_san(protocol: &str, bytes: usize) {
    let dirs = Dirs::new(protocol);
    for preload in [false, true] {
        let (server, client) = two_processes(protocol, bytes, preload, preload, &dirs);
        let path = if preload { "san-shm" } else { "tcp" };
        expect(&server, "server", bytes, path);
        expect(&client, "client", bytes, path);
    }
}

#[test]
fn two_preloaded_processes_move_mibs_over_the_san_with_checksums() {
    let dirs = Dirs::new("client-first");
    let bytes = 4 << 20;
    let (server, client) = two_processes("client-first", bytes, true, true, &dirs);
    expect(&server, "server", bytes, "san-shm");
    expect(&client, "client", bytes, "san-shm");
    assert_eq!(
        dirs.leftover_segments(),
        Vec::<String>::new(),
        "segments must be unlinked"
    );
}

#[test]
fn a_client_that_writes_megabytes_before_reading_the_echo_does_not_deadlock() {
    // Loopback TCP buffers up to ~10 MB of this (send plus receive buffers, both ways), but
    // how much depends on buffer autotuning: at 8 MB it deadlocked natively about once in 30
    // runs on a loaded 2-vCPU machine (both processes blocked in send(2) in the kernel). So
    // TCP shows the protocol at 4 MB; the SAN must carry 8 MB, where a 256 KiB SAN send buffer
    // deadlocked at 2 MB and a 4 MiB one at 6 MB (the blocked client now absorbs the echo
    // into its receive buffer).
    let dirs = Dirs::new("write-then-read");
    for (preload, bytes, path) in [(false, 4_000_000, "tcp"), (true, 8_000_000, "san-shm")] {
        let (server, client) = two_processes("write-then-read", bytes, preload, preload, &dirs);
        expect(&server, "server", bytes, path);
        expect(&client, "client", bytes, path);
    }
}

#[test]
fn receive_and_send_timeouts_end_blocking_calls_with_eagain() {
    // SO_RCVTIMEO inherited from the listener and set on the client, SO_SNDTIMEO on a
    // flooding client (san_echo's `timeouts` protocol checks each call's errno and time).
    natively_and_over_the_san("timeouts", 100_000);
}

#[test]
fn both_ends_writing_megabytes_before_reading_do_not_deadlock() {
    // 3 MB each way, each side in one blocking write before it reads: loopback TCP lets it
    // through (at 5 MB it deadlocks too); a 256 KiB SAN send buffer did not.
    natively_and_over_the_san("exchange", 3_000_000);
}

#[test]
fn sockets_with_high_numbers_and_a_dup2_copy_work_over_the_san() {
    // Numbers from 15000 on (CI's hard RLIMIT_NOFILE is 20000; numbers above 65536 run in the
    // nested VM: integration/softroce/test-high-fds.sh). The dup2 copy replaces its closed
    // original in the published record.
    let dirs = Dirs::new("high-fds");
    let mut outputs = Vec::new();
    for preload in [false, true] {
        let child = command(HIGH_FDS, preload, &dirs)
            .args(["15000", "4"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        outputs.push(finish(child, "high_fds"));
    }
    let without_paths = |output: &str| -> Vec<String> {
        output
            .lines()
            .filter(|l| !l.starts_with("paths:"))
            .map(str::to_owned)
            .collect()
    };
    assert!(outputs[0].contains("dup2: ok"), "{}", outputs[0]);
    assert_eq!(without_paths(&outputs[0]), without_paths(&outputs[1]));
    let san_paths = ["san-shm"; 8].join(" ");
    assert!(
        outputs[1].contains(&format!("paths: {san_paths}\n")),
        "{}",
        outputs[1]
    );
}

/// A Python server that runs subprocesses while it holds a SAN connection (CPython spawns
/// with vfork): one that does not get the socket, one that gets it as stdin and must read the
/// request bytes that had already arrived over the SAN, and one that writes its answer
/// through it as stdout. Before the vfork child's hook calls were made inert, its
/// `close_range` released the parent's sockets and the connection was reset.
const SUBPROCESS_PY: &str = r#"
import os, socket, subprocess, sys, time
if sys.argv[1] == "server":
    listener = listen_announced()
    conn, _ = listener.accept()
    conn.sendall(conn.recv(10).upper())
    time.sleep(0.2)  # the request arrives over the SAN and waits, unread
    subprocess.run(["/bin/true"], check=True)  # downgrades: the request goes to a stash
    request = subprocess.run(["head", "-c", "8"], stdin=conn.fileno(), check=True,
                             capture_output=True).stdout
    subprocess.run(["/bin/sh", "-c", "printf from-child"], stdout=conn.fileno(), check=True)
    conn.sendall(b"|" + request)
    conn.close()
    # A second connection, still on the SAN, written to by a shell that system() runs; the
    # shell also reads the request that arrived over the SAN (in the stash after the
    # downgrade: system() hands it to the shell, which hands it to head).
    second, _ = listener.accept()
    second.sendall(second.recv(10).upper())
    time.sleep(0.2)  # REQUEST2 arrives over the SAN and waits, unread
    os.set_inheritable(second.fileno(), True)
    fd = second.fileno()
    os.system("printf from-system: >&%d; head -c 8 <&%d >&%d" % (fd, fd, fd))
    second.sendall(b"|end")
    second.close()
else:
    conn = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    conn.sendall(b"hi")
    assert conn.recv(10) == b"HI"
    conn.sendall(b"REQUEST1")
    reply = b""
    while True:
        data = conn.recv(100)
        if not data:
            break
        reply += data
    print("client got", reply.decode())
    second = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    second.sendall(b"again")
    assert second.recv(10) == b"AGAIN"
    second.sendall(b"REQUEST2")
    reply = b""
    while True:
        data = second.recv(100)
        if not data:
            break
        reply += data
    print("second got", reply.decode())
"#;

#[test]
fn python_subprocesses_of_a_server_holding_a_san_connection() {
    let dirs = Dirs::new("python-subprocess");
    let (_, client_report) =
        python_pair(&dirs, "spawning_server.py", SUBPROCESS_PY, &[], &[], true);
    assert!(
        client_report.contains("client got from-child|REQUEST1"),
        "{client_report}"
    );
    assert!(
        client_report.contains("second got from-system:REQUEST2|end"),
        "{client_report}"
    );
}

/// A server that answers at once and then makes no call for a while (it sleeps): the answer
/// must reach the client now, not at the server's next call. The answer could not leave at
/// once (the client's `Hello`, which brings the credits, was not there yet); the client's
/// `Hello` now nudges the server's process to transmit it. Before, the client waited for the
/// server's next call (here 0.8 s; most rounds stalled).
const ANSWER_THEN_IDLE_PY: &str = r#"
import socket, sys, time
ROUNDS = 8
if sys.argv[1] == "server":
    listener = listen_announced()
    for _ in range(ROUNDS):
        conn, _ = listener.accept()
        conn.sendall(conn.recv(10).upper())
        time.sleep(0.8)
        conn.close()
else:
    worst = 0.0
    for _ in range(ROUNDS):
        conn = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
        started = time.monotonic()
        conn.sendall(b"hi")
        assert conn.recv(10) == b"HI"
        worst = max(worst, time.monotonic() - started)
        assert conn.recv(10) == b""
        conn.close()
    print("worst answer after %.3f s" % worst, flush=True)
"#;

#[test]
fn an_answer_written_just_before_the_server_goes_idle_arrives_at_once() {
    let dirs = Dirs::new("answer-then-idle");
    let (_, client_report) = python_pair(
        &dirs,
        "answer_then_idle.py",
        ANSWER_THEN_IDLE_PY,
        &[],
        &[],
        true,
    );
    let worst: f64 = client_report
        .rsplit("worst answer after ")
        .next()
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no timing: {client_report}"));
    // The server's next call comes 0.8 s later; a delivery that waited for it fails.
    assert!(worst < 0.5, "{client_report}");
}

/// A sender that writes more than the receiver's slots hold (most of it stays in its send
/// buffer, waiting for credits) and then goes idle outside any socket call: its bytes must
/// still flow while it sleeps, moved by its responder thread when the reader, having read
/// what it had, waits for more (the reader nudges it then).
const WRITE_THEN_IDLE_PY: &str = r#"
import socket, sys, time
SIZE = 3 << 20
PAYLOAD = bytes((i * 131) % 251 for i in range(SIZE))
if sys.argv[1] == "server":
    listener = listen_announced()
    conn, _ = listener.accept()
    conn.sendall(PAYLOAD)
    time.sleep(3)
    conn.close()
else:
    conn = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    started = time.monotonic()
    got = bytearray()
    while len(got) < SIZE:
        chunk = conn.recv(65536)
        if not chunk:
            break
        got += chunk
    print("read %d bytes intact=%s after %.3f s" % (len(got), bytes(got) == PAYLOAD, time.monotonic() - started), flush=True)
"#;

#[test]
fn bytes_left_in_the_send_buffer_of_an_idle_sender_reach_a_waiting_reader() {
    let dirs = Dirs::new("write-then-idle");
    let (_, client_report) = python_pair(
        &dirs,
        "write_then_idle.py",
        WRITE_THEN_IDLE_PY,
        &[],
        &[],
        true,
    );
    assert!(
        client_report.contains(&format!("read {} bytes intact=True", 3 << 20)),
        "{client_report}"
    );
    let seconds: f64 = client_report
        .rsplit("after ")
        .next()
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no timing: {client_report}"));
    // The sender sleeps 3 s: bytes that waited for its next call fail this.
    assert!(seconds < 1.5, "{client_report}");
}

/// A program that blocks a signal in its (only) thread after connecting, and takes it with
/// `sigwait` (as programs using `signalfd` do), must get the signal: the library's own
/// threads (the nudge responder that every SAN connection starts) block every signal.
/// Before, a process-directed SIGUSR1 was delivered to our thread, whose default action
/// killed the process.
const SIGNALS_PY: &str = r#"
import os, signal, socket, sys, time
if sys.argv[1] == "server":
    listener = listen_announced()
    conn, _ = listener.accept()
    data = conn.recv(100)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    os.kill(os.getpid(), signal.SIGUSR1)
    got = signal.sigwait({signal.SIGUSR1})
    conn.sendall(b"server took " + signal.Signals(got).name.encode() + b" after " + data)
    conn.close()
else:
    conn = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    conn.sendall(b"hello")
    reply = conn.recv(100)
    os.kill(os.getpid(), signal.SIGUSR1)
    got = signal.sigwait({signal.SIGUSR1})
    # The thread names itself once it runs: look for a while.
    for _ in range(200):
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        if "sandirect-nudge" in names:
            break
        time.sleep(0.01)
    print(reply.decode(), "| client took", signal.Signals(got).name, "| threads", names, flush=True)
"#;

#[test]
fn signals_blocked_by_the_application_stay_its_own_with_san_connections() {
    let dirs = Dirs::new("signals");
    let (_, client_report) = python_pair(&dirs, "signals.py", SIGNALS_PY, &[], &[], true);
    assert!(
        client_report.contains("server took SIGUSR1 after hello | client took SIGUSR1"),
        "{client_report}"
    );
    // The SAN connection started our responder thread: the signal had a thread of ours to
    // land on.
    assert!(
        client_report.contains("'sandirect-nudge'"),
        "{client_report}"
    );
}

/// An edge-triggered nonblocking server (nginx's way) whose client dies mid-conversation:
/// the one hang-up event must lead to EOF or ECONNRESET at once. The provider checks its
/// peer's liveness only every 100 ms, so the event came in while the session still believed
/// the peer alive, the read said EAGAIN, and no second edge ever came (nginx workers hung
/// in graceful shutdown).
const EDGE_DEATH_PY: &str = r#"
import errno, os, select, signal, socket, sys, time
if sys.argv[1] == "server":
    listener = listen_announced()
    conn, _ = listener.accept()
    conn.setblocking(False)
    ep = select.epoll()
    ep.register(conn.fileno(), select.EPOLLIN | select.EPOLLET | select.EPOLLRDHUP)
    received = 0
    while True:
        if not ep.poll(3.0):
            print("hung after", received, "bytes", flush=True)
            sys.exit(1)
        while True:
            try:
                data = conn.recv(4096)
            except BlockingIOError:
                break
            except ConnectionResetError:
                data = b""
            if not data:
                print("peer gone after", received, "bytes", flush=True)
                sys.exit(0)
            received += len(data)
else:
    conn = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    for _ in range(30):
        conn.sendall(b"x" * 100)
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
"#;

#[test]
fn an_edge_triggered_server_sees_its_killed_client_go() {
    let dirs = Dirs::new("edge-death");
    for round in 0..3 {
        let (report, _) = python_pair(&dirs, "edge_death.py", EDGE_DEATH_PY, &[], &[], false);
        assert!(
            report.contains("peer gone after 3000 bytes"),
            "round {round}: {report}"
        );
    }
}

/// Timed waits with a SAN connection alive sleep through their timeout: a server with an
/// idle connection makes 150 epoll waits and 150 polls of 5 ms each (an event loop's timer
/// ticks). The hooks wait in slices; a slice whose remaining time was under a millisecond used
/// to be a 0 ms wait, so every timed wait spun for up to a millisecond before its timeout
/// (about a fifth of a CPU for a loop ticking every 5 ms).
const TIMED_WAITS_PY: &str = r#"
import select, socket, sys, time
if sys.argv[1] == "server":
    listener = listen_announced()
    conn, _ = listener.accept()
    assert conn.recv(5) == b"hello"
    ep = select.epoll()
    ep.register(conn.fileno(), select.EPOLLIN)
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    wall, cpu = time.monotonic(), time.process_time()
    for _ in range(150):
        assert ep.poll(0.005) == []
        assert poller.poll(5) == []
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    conn.sendall(b"done")
    print("waited", round(wall, 3), "cpu", round(cpu, 3), flush=True)
else:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
    s.sendall(b"hello")
    assert s.recv(4) == b"done"
    print("client done", flush=True)
"#;

#[test]
fn timed_waits_beside_a_san_connection_sleep_instead_of_spinning() {
    let dirs = Dirs::new("timed-waits");
    // The waits must run beside a connection that is on the SAN (on TCP the hooks step
    // aside): the published records are sampled while the pair runs.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (report, client, on_san) = std::thread::scope(|scope| {
        let sampler = scope.spawn(|| {
            // Bounded: the pair ends within its 60 s limit, the sampler with it.
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                let records = preload_core::stats::read_dir(&dirs.stat, false).unwrap_or_default();
                if records
                    .iter()
                    .any(|r| r.path == preload_core::record::DataPath::SanShm)
                {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            false
        });
        // The sampler stops however the pair ends: a failing pair panics, and the scope
        // would wait for a sampler that never saw the SAN for ever.
        struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Release);
            }
        }
        let stopper = StopOnDrop(&stop);
        let (report, client) = python_pair(&dirs, "timed_waits.py", TIMED_WAITS_PY, &[], &[], true);
        drop(stopper);
        (report, client, sampler.join().expect("sampler"))
    });
    assert!(client.contains("client done"), "{client}");
    assert!(on_san, "the connection never showed on the SAN: {report}");
    let figure = |name: &str| -> f64 {
        report
            .split_whitespace()
            .skip_while(|word| *word != name)
            .nth(1)
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {report:?}"))
    };
    let (wall, cpu) = (figure("waited"), figure("cpu"));
    // 300 waits of 5 ms: at least 1.5 s asleep. Spinning through each wait's last
    // millisecond cost 0.2-0.3 s of CPU; sleeping costs the calls' own few milliseconds.
    assert!(wall >= 1.5, "the waits ended early: {report}");
    assert!(cpu < 0.1, "timed waits burnt CPU: {report}");
}

/// An edge-triggered nonblocking server (nginx's way) whose client leaves before it ever
/// switched: it connects and then closes (wrk's connect-and-close probe) or dies, while its
/// TCP end stays open a little longer (here: held by a forked child; in nginx's test: the
/// client preempted between ending its SAN side and closing its TCP socket). The acceptor's
/// session ends before the client's `Hello`, so the client's bytes and end come on TCP alone;
/// the read after the mirror's hang-up said EAGAIN, and the mirror never rose again for the
/// TCP end (nginx workers hung in graceful shutdown until `client_header_timeout`).
const EDGE_PENDING_GONE_PY: &str = r#"
import os, select, signal, socket, sys, time
if sys.argv[1] == "server":
    listener = listen_announced()
    conn, _ = listener.accept()
    if sys.argv[2] == "blocking":
        # A blocking reader must sleep until the TCP end comes, not spin.
        cpu = time.process_time()
        try:
            while conn.recv(4096):
                pass
        except ConnectionResetError:
            pass
        cpu = time.process_time() - cpu
        print("peer gone" if cpu < 0.5 else "spun", "cpu", round(cpu, 3), flush=True)
        sys.exit(0)
    conn.setblocking(False)
    ep = select.epoll()
    ep.register(conn.fileno(), select.EPOLLIN | select.EPOLLET | select.EPOLLRDHUP)
    eagain = 0
    while True:
        if not ep.poll(4.0):
            print("hung after", eagain, "EAGAIN", flush=True)
            sys.exit(1)
        while True:
            try:
                data = conn.recv(4096)
            except BlockingIOError:
                eagain += 1
                break
            except ConnectionResetError:
                data = b""
            if not data:
                print("peer gone", flush=True)
                sys.exit(0)
else:
    s = socket.socket()
    if os.fork() == 0:
        # Holds the TCP socket open past the server's EAGAIN, then ends it.
        time.sleep(2.0)
        os._exit(0)
    s.connect(("127.0.0.1", int(sys.argv[2])))
    # No socket call: the client stays pending while the acceptor attaches.
    time.sleep(0.5)
    if sys.argv[3] == "close":
        s.close()
        sys.exit(0)
    os.kill(os.getpid(), signal.SIGKILL)
"#;

#[test]
fn an_edge_triggered_server_sees_a_client_that_never_switched_go() {
    let dirs = Dirs::new("edge-pending-gone");
    for (waits, how) in [("epoll", "close"), ("epoll", "kill"), ("blocking", "close")] {
        let (report, _) = python_pair(
            &dirs,
            "edge_pending_gone.py",
            EDGE_PENDING_GONE_PY,
            &[waits],
            &[how],
            false,
        );
        assert!(report.contains("peer gone"), "{waits}, {how}: {report}");
    }
}

#[test]
fn server_speaks_first_over_the_san() {
    let dirs = Dirs::new("server-first");
    let bytes = 1 << 20;
    let (server, client) = two_processes("server-first", bytes, true, true, &dirs);
    expect(&server, "server", bytes, "san-shm");
    expect(&client, "client", bytes, "san-shm");
}

/// The client writes right after connect, 200 ms before the server accepts: those bytes travel
/// over TCP while pending and must arrive first and exactly once (the checksum covers order).
#[test]
fn bytes_written_before_the_acceptor_attached_arrive_first_and_once() {
    let dirs = Dirs::new("early");
    let bytes = 3 << 20;
    let (server, client) = two_processes("early", bytes, true, true, &dirs);
    expect(&server, "server", bytes, "san-shm");
    expect(&client, "client", bytes, "san-shm");
    assert_eq!(dirs.leftover_segments(), Vec::<String>::new());
}

#[test]
fn preloaded_client_and_plain_server_stay_on_tcp_without_leftovers() {
    let dirs = Dirs::new("plain-server");
    for protocol in ["client-first", "server-first"] {
        let (server, client) = two_processes(protocol, 200_000, false, true, &dirs);
        expect(&server, "server", 200_000, "tcp");
        expect(&client, "client", 200_000, "TCP");
    }
    assert_eq!(dirs.leftover_segments(), Vec::<String>::new());
}

#[test]
fn plain_client_and_preloaded_server_stay_on_tcp() {
    let dirs = Dirs::new("plain-client");
    for protocol in ["client-first", "server-first", "early"] {
        let (server, client) = two_processes(protocol, 200_000, true, false, &dirs);
        expect(&server, "server", 200_000, "TCP");
        expect(&client, "client", 200_000, "tcp");
    }
    assert_eq!(dirs.leftover_segments(), Vec::<String>::new());
}

/// A preloaded `san_many` server and a preloaded client making one connection after another,
/// streaming `sizes[i]` bytes both ways on the i-th (`env` set on the client); returns the
/// client's (path, reason) per connection, after checking every echo on both sides.
fn connection_sequence(dirs: &Dirs, sizes: &[usize], env: &[(&str, &str)]) -> Vec<String> {
    let (mut server, reader, port) =
        spawn_announcing(command(SAN_MANY, true, dirs).args(["server", &sizes.len().to_string()]));
    let client = command(SAN_MANY, true, dirs)
        .arg("sequence")
        .arg(&port)
        .args(sizes.iter().map(usize::to_string))
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let client = finish(client, "client");
    server.stdout = Some(reader.into_inner());
    let server = finish(server, "server");
    let lines: Vec<&str> = client
        .lines()
        .filter(|l| l.starts_with("client "))
        .collect();
    assert_eq!(lines.len(), sizes.len(), "{client}");
    for (i, (line, size)) in lines.iter().zip(sizes).enumerate() {
        assert!(
            line.starts_with(&format!("client {i} ok bytes={size} ")),
            "{client}"
        );
    }
    assert_eq!(
        server.lines().filter(|l| l.contains(" ok bytes=")).count(),
        sizes.len(),
        "{server}"
    );
    lines
        .iter()
        .map(|line| {
            let path = line.split("path=").nth(1).unwrap_or_default();
            path.split(' ').next().unwrap_or_default().to_owned()
                + " "
                + line.split("reason=").nth(1).unwrap_or_default()
        })
        .collect()
}

#[test]
fn a_client_whose_connections_are_short_keeps_new_ones_on_tcp_until_they_grow() {
    let dirs = Dirs::new("short-connections");
    // 100 bytes each way is short (below 1 KiB), 5000 long.
    let sizes = [100, 100, 100, 5000, 5000, 100];
    let paths = connection_sequence(&dirs, &sizes, &[]);
    let (san, short) = ("san-shm -", "TCP short-connections");
    assert_eq!(
        paths,
        [
            san,   // the server's first connection takes the SAN
            san,   // one short connection is not enough to turn it
            short, // two are: the next stays on TCP, spared the set-up
            short, // long connections on TCP are measured too
            short, san, // two long ones bring the score back above the line: the SAN returns
        ],
        "{paths:?}"
    );
    // Turned off, every connection takes the SAN.
    let paths = connection_sequence(
        &dirs,
        &[100, 100, 100],
        &[("SANDIRECT_SHORT_CONNECTION_BYTES", "0")],
    );
    assert_eq!(paths, ["san-shm -"; 3], "{paths:?}");
    assert_eq!(dirs.leftover_segments(), Vec::<String>::new());
}

#[test]
fn a_segment_directory_others_may_read_keeps_connections_on_tcp_and_says_why() {
    let dirs = Dirs::new("open-directory");
    // Group and others may look in: refused (segments would be open to them), the SAN stays
    // off for these processes, and each connection tells `sandirect stat` why.
    std::fs::set_permissions(
        &dirs.shm,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let paths = connection_sequence(&dirs, &[5000, 5000], &[]);
    assert_eq!(paths, ["TCP no-provider"; 2], "{paths:?}");
    assert_eq!(dirs.leftover_segments(), Vec::<String>::new());
}

#[test]
fn peers_in_one_process_switch_too() {
    let dirs = Dirs::new("inprocess");
    for protocol in ["client-first", "server-first", "early"] {
        let child = command(SAN_ECHO, true, &dirs)
            .args(["inprocess", protocol, "1000000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let report = finish(child, "inprocess");
        expect(&report, "server", 1_000_000, "san-shm");
        expect(&report, "client", 1_000_000, "san-shm");
    }
    assert_eq!(dirs.leftover_segments(), Vec::<String>::new());
}

/// The preload's own descriptors (mirror ends, words pages, pidfds, exchange sockets) stay out
/// of the application's way: with 8 SAN connections open, the application's sockets get the
/// numbers they get natively (wrk fails connections whose numbers exceed its table).
#[test]
fn san_connections_leave_the_application_its_descriptor_numbers() {
    let dirs = Dirs::new("fds");
    let run = |preload: bool| {
        let output = command(SAN_FDS, preload, &dirs).arg("8").output().unwrap();
        assert!(output.status.success(), "{output:?}");
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    let native = run(false);
    let preloaded = run(true);
    let line = |report: &str, prefix: &str| {
        report
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line in {report}"))
            .to_owned()
    };
    // (Natively the numbers rise one by one, except past descriptors this test inherited.)
    assert_eq!(
        line(&native, "fds:").split_whitespace().count(),
        1 + 17,
        "{native}"
    );
    assert_eq!(line(&preloaded, "fds:"), line(&native, "fds:"));
    assert_eq!(
        line(&preloaded, "paths:"),
        format!("paths:{}", " san-shm".repeat(16)),
        "every connection must have switched"
    );
    assert_eq!(dirs.leftover_segments(), Vec::<String>::new());
}

/// What a SAN socket costs in descriptors of the preload's own (the limit the application
/// sets counts them): the mirror's watched end and the peer's raising end, plus what the
/// connections share (one pidfd per peer process, the words page closed once mapped).
#[test]
fn a_san_socket_holds_at_most_three_descriptors_of_its_own() {
    let dirs = Dirs::new("fd-count");
    let open = |preload: bool, connections: usize| -> usize {
        let output = command(SAN_FDS, preload, &dirs)
            .arg(connections.to_string())
            .output()
            .unwrap();
        assert!(output.status.success(), "{output:?}");
        let report = String::from_utf8_lossy(&output.stdout).into_owned();
        if preload {
            assert!(
                !report.to_lowercase().contains("tcp"),
                "every connection switched: {report}"
            );
        }
        report
            .lines()
            .find_map(|l| l.strip_prefix("open: "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no open line in {report}"))
    };
    // Four more connections (both ends in the process: eight more SAN sockets); the
    // difference leaves out what the process holds once (listener marker, nudge responder).
    let native = open(false, 8) - open(false, 4);
    let preloaded = open(true, 8) - open(true, 4);
    let own_per_socket = (preloaded - native) as f64 / 8.0;
    assert!(
        own_per_socket <= 3.0,
        "{own_per_socket} descriptors of the preload's own per SAN socket"
    );
}

#[test]
fn san_off_keeps_everything_on_tcp() {
    let dirs = Dirs::new("san-off");
    let mut server = command(SAN_ECHO, true, &dirs);
    server.env("SANDIRECT_SAN", "0");
    let child = server
        .args(["inprocess", "client-first", "100000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let report = finish(child, "inprocess");
    expect(&report, "server", 100_000, "TCP");
    expect(&report, "client", 100_000, "TCP");
}

/// Nonblocking sockets, epoll (level- and edge-triggered) and poll: an echo server with
/// several concurrent clients, all over the SAN.
#[test]
fn nonblocking_epoll_echo_server_with_several_clients() {
    let dirs = Dirs::new("epoll");
    for mode in ["level", "edge", "poll"] {
        let child = command(SAN_EPOLL, true, &dirs)
            .args([mode, "4", "300000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let report = finish(child, mode);
        assert!(report.contains("clients ok 4"), "{mode}: {report}");
        assert!(
            report.contains("server paths san-shm=4 tcp=0"),
            "{mode}: {report}"
        );
    }
    let native = Command::new(SAN_EPOLL)
        .env_remove("LD_PRELOAD")
        .args(["edge", "4", "300000"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&native.stdout).contains("clients ok 4"));
}

/// Starts a `sink` server and a `flood` client over the SAN and waits until both run.
fn flood_pair(
    dirs: &Dirs,
) -> (
    Child,
    BufReader<std::process::ChildStdout>,
    Child,
    BufReader<std::process::ChildStdout>,
) {
    let (server, mut server_out, port) =
        spawn_announcing(command(SAN_ECHO, true, dirs).args(["server", "sink"]));
    let mut line = String::new();
    let mut client = command(SAN_ECHO, true, dirs)
        .args(["client", &port, "flood", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut client_out = BufReader::new(client.stdout.take().unwrap());
    client_out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "connected");
    line.clear();
    server_out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "accepted");
    // Let data flow (and the sender block on credits) before the kill.
    std::thread::sleep(Duration::from_millis(300));
    (server, server_out, client, client_out)
}

/// Waits at most `limit` for `child` to exit and returns the rest of its output.
fn exits_within(
    mut child: Child,
    mut out: BufReader<std::process::ChildStdout>,
    limit: Duration,
) -> String {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the survivor did not notice its peer's death within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    rest
}

#[test]
fn a_killed_receiver_makes_the_blocked_sender_fail_within_a_second() {
    let dirs = Dirs::new("kill-receiver");
    let (mut server, _server_out, client, client_out) = flood_pair(&dirs);
    server.kill().unwrap();
    server.wait().unwrap();
    let report = exits_within(client, client_out, Duration::from_secs(1));
    assert!(
        report.contains("client stopped: BrokenPipe")
            || report.contains("client stopped: ConnectionReset"),
        "{report}"
    );
}

#[test]
fn a_killed_sender_gives_the_blocked_receiver_eof_or_reset_within_a_second() {
    let dirs = Dirs::new("kill-sender");
    let (server, server_out, mut client, _client_out) = flood_pair(&dirs);
    client.kill().unwrap();
    client.wait().unwrap();
    let report = exits_within(server, server_out, Duration::from_secs(1));
    assert!(
        report.contains("server stopped: eof")
            || report.contains("server stopped: ConnectionReset"),
        "{report}"
    );
}

const CONFORMANCE: &str = env!("CARGO_BIN_EXE_conformance");

/// How many cases the conformance program has (each prints one line).
const CONFORMANCE_CASES: usize = 52;

/// Cases whose SAN behaviour differs from kernel TCP by documented policy (see
/// `preload_core::san`, "Known limits"), with the SAN output expected instead.
/// (None at present: `EPOLLET` reports every arrival since the peer writes a mirror token per
/// arrival while an edge-triggered registration watches the socket.)
const DOCUMENTED_DIFFERENCES: &[(&str, &str)] = &[];

/// Every conformance case runs with both ends on the SAN (all its connections are loopback
/// pairs in one process) and prints what it prints natively, except the documented policy
/// differences, which must stay exactly as documented.
#[test]
fn conformance_over_the_san_matches_native_except_documented_policy() {
    let dirs = Dirs::new("conformance");
    let native = Command::new(CONFORMANCE)
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    let native = String::from_utf8_lossy(&native.stdout).into_owned();
    let san = command(CONFORMANCE, true, &dirs).output().unwrap();
    let san = String::from_utf8_lossy(&san.stdout).into_owned();
    assert_eq!(native.lines().count(), CONFORMANCE_CASES, "{native}");
    assert_eq!(
        san.lines().count(),
        CONFORMANCE_CASES,
        "every case must print a line:\n{san}"
    );
    for (native_line, san_line) in native.lines().zip(san.lines()) {
        let case = native_line.split(':').next().unwrap_or_default();
        match DOCUMENTED_DIFFERENCES
            .iter()
            .find(|(name, _)| *name == case)
        {
            Some((_, expected)) => assert_eq!(san_line, *expected, "documented difference changed"),
            None => assert_eq!(
                san_line, native_line,
                "the SAN path changed observable behaviour"
            ),
        }
    }
}

/// Run as root with the default directories, `sandirect stat` lists the connections of every
/// user's preloaded processes (as `ss -p` does): here an echo pair of `nobody`. Needs root
/// (skipped otherwise).
#[test]
fn root_sees_every_users_connections_in_sandirect_stat() {
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: not root (the test runs a process as nobody)");
        return;
    }
    let (nobody, nogroup) = (65534, 65534);
    // The binaries where nobody may run them (the build tree may not be reachable).
    let dir = std::env::temp_dir().join(format!("sandirect-nobody-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (echo, library) = (dir.join("san_echo"), dir.join("libsandirect.so"));
    std::fs::copy(SAN_ECHO, &echo).unwrap();
    std::fs::copy(&integration::apps::products().library, &library).unwrap();
    for path in [&dir, &echo, &library] {
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
    }
    // Its own default directories (/dev/shm/sandirect-65534), as a service user's would be.
    let child = Command::new(&echo)
        .args(["inprocess", "paced", "2000000"])
        .env_clear()
        .env("LD_PRELOAD", &library)
        .uid(nobody)
        .gid(nogroup)
        .current_dir(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id().to_string();
    // The paced stream takes about two seconds: look while it runs.
    let mut rows = Vec::new();
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(50));
        let out = Command::new(&integration::apps::products().cli)
            .arg("stat")
            .env_remove("SANDIRECT_STAT_DIR")
            .output()
            .unwrap();
        rows = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|line| line.split_whitespace().next() == Some(pid.as_str()))
            .map(str::to_owned)
            .collect();
        if rows.len() == 2 {
            break;
        }
    }
    let report = finish(child, "inprocess as nobody");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        report.contains("client ok bytes=2000000") && report.contains("server ok bytes=2000000"),
        "{report}"
    );
    assert_eq!(
        rows.len(),
        2,
        "both ends of nobody's pair listed for root: {rows:?}"
    );
    assert!(
        rows.iter().all(|row| row.contains("SAN-shm")),
        "nobody's pair on the SAN: {rows:?}"
    );
}
