//! Connections between processes of different users (docs/ARCHITECTURE.md, "Other users"):
//! with `SANDIRECT_OTHER_USERS` naming each other, a client and a server of two users carry
//! their connection over a segment private to it (a sealed memfd handed to the peer alone).
//!
//! * an echo pair of two users streams both ways over the SAN, every byte intact;
//! * nginx with a root master and `nobody` workers serves a client of another user over the
//!   SAN (every client connection on SAN-shm in the published records, bodies checksummed);
//! * a process of a third user finds the pending client's exchange, connects to it and gets
//!   nothing (no descriptor, the connection closed unread), finds no segment file anywhere,
//!   cannot open the client's descriptors or read its memory, and the pair's connection goes
//!   on over the SAN, bytes intact;
//! * a process of a user the client names that takes the segment first only keeps the
//!   connection on TCP;
//! * a peer scribbling over a live private segment breaks that connection at most;
//! * without both ends naming the other, the connection stays on TCP;
//! * a large write between two users takes the rendezvous through the window;
//! * a server that forks (or execs) with a connection to a client of another user moves it
//!   back to kernel TCP exactly, as between two processes of one user.
//!
//! Needs root (to run programs as other users, and to add the test users, removed afterwards):
//! skipped with a message otherwise.

use std::io::{BufReader, Write as _};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use integration::apps::{
    assert_paths, exclusive, free_port, record_snapshot, require_program, wait_for_port,
    ObservedConnection, Sandbox,
};
use integration::pattern::XorShift64;
use preload_core::record::DataPath;

const SAN_ECHO: &str = env!("CARGO_BIN_EXE_san_echo");
const SAN_FORK: &str = env!("CARGO_BIN_EXE_san_fork");
const NOBODY: u32 = 65534;

/// Whether this test can run here (root), else why not.
fn not_root() -> Option<&'static str> {
    // SAFETY: geteuid has no preconditions.
    (unsafe { libc::geteuid() } != 0).then_some("needs root to run programs as other users")
}

/// The start of every test here: `None` (saying why) when not root, else the lock that runs
/// these tests one at a time (they share the test users and their directories).
fn as_root_alone() -> Option<std::sync::MutexGuard<'static, ()>> {
    if let Some(why) = not_root() {
        eprintln!("SKIPPED: {why}");
        return None;
    }
    Some(exclusive())
}

/// Spawns `command` with its output captured.
fn spawned(command: &mut Command) -> Child {
    command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a test program")
}

/// A server that printed its port (`port N`, its first line); the rest of its output is read
/// when it ends ([`finish_pair`]).
struct Server {
    child: Child,
    reader: BufReader<std::process::ChildStdout>,
    port: String,
}

/// Starts `command` (a server that prints `port N` first) and reads its port.
fn start_server(command: &mut Command) -> Server {
    let mut child = spawned(command);
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let port = integration::read_port(&mut reader);
    Server {
        child,
        reader,
        port,
    }
}

/// Waits for `client` (60 s), then `server` (30 s); their outputs, or the failures.
fn wait_pair(server: Server, client: Child) -> (Result<String, String>, Result<String, String>) {
    let client = integration::wait_child(client, "client", Duration::from_secs(60));
    let mut child = server.child;
    child.stdout = Some(server.reader.into_inner());
    let server = integration::wait_child(child, "server", Duration::from_secs(30));
    (server, client)
}

/// [`wait_pair`], both required to succeed (`what` names the exchange when one did not):
/// the server's output and the client's.
fn finish_pair(server: Server, client: Child, what: &str) -> (String, String) {
    match wait_pair(server, client) {
        (Ok(server), Ok(client)) => (server, client),
        (server, client) => panic!("{what}:\n{server:?}\n{client:?}"),
    }
}

/// The system's Python (the intruder and the scribbler are Python scripts, run as the test
/// users, who cannot reach a Python installed under root's home).
fn system_python() -> &'static str {
    const PYTHON: &str = "/usr/bin/python3";
    assert!(
        Path::new(PYTHON).exists(),
        "{PYTHON} is needed (apt-get install python3)"
    );
    PYTHON
}

/// A user of this machine, made for the test when missing (and then removed at drop).
struct User {
    name: String,
    uid: u32,
    gid: u32,
    made: bool,
}

impl User {
    fn get(name: &str) -> User {
        let lookup = || -> Option<(u32, u32)> {
            let out = Command::new("getent")
                .args(["passwd", name])
                .output()
                .ok()?;
            let line = String::from_utf8_lossy(&out.stdout).into_owned();
            let fields: Vec<&str> = line.trim().split(':').collect();
            Some((fields.get(2)?.parse().ok()?, fields.get(3)?.parse().ok()?))
        };
        let mut made = false;
        if lookup().is_none() {
            let status = Command::new("useradd")
                .args([
                    "--no-create-home",
                    "--shell",
                    "/usr/sbin/nologin",
                    "--user-group",
                ])
                .arg(name)
                .status()
                .expect("run useradd");
            assert!(status.success(), "useradd {name}: {status}");
            made = true;
        }
        let (uid, gid) = lookup().unwrap_or_else(|| panic!("user {name} after useradd"));
        User {
            name: name.to_owned(),
            uid,
            gid,
            made,
        }
    }

    fn nobody() -> User {
        let user = User {
            name: "nobody".to_owned(),
            uid: NOBODY,
            gid: NOBODY,
            made: false,
        };
        let out = Command::new("getent")
            .args(["passwd", "nobody"])
            .output()
            .expect("getent");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(":65534:65534:"),
            "user nobody is not 65534:65534 here"
        );
        user
    }
}

impl Drop for User {
    fn drop(&mut self) {
        if self.made {
            let _ = Command::new("userdel").arg(&self.name).status();
        }
    }
}

/// The test's world: a sandbox traversable by the test users, with copies of the programs
/// they run (the build directory may not be theirs to read) and per-user directories.
struct World {
    sandbox: Sandbox,
    library: PathBuf,
    san_echo: PathBuf,
    san_fork: PathBuf,
}

impl World {
    fn new(test: &str) -> World {
        let sandbox = Sandbox::new(test);
        let root = sandbox.path();
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711)).unwrap();
        let bin = root.join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let copy = |from: &Path, name: &str| {
            let to = bin.join(name);
            std::fs::copy(from, &to).unwrap();
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o755)).unwrap();
            to
        };
        let library = copy(&integration::apps::products().library, "libsandirect.so");
        let san_echo = copy(Path::new(SAN_ECHO), "san_echo");
        let san_fork = copy(Path::new(SAN_FORK), "san_fork");
        World {
            sandbox,
            library,
            san_echo,
            san_fork,
        }
    }

    /// `user`'s stats and segment directories (made on first use, theirs, 0700).
    /// Writes `text` as `bin/NAME` in the sandbox, readable by every user; its path.
    fn script(&self, name: &str, text: &str) -> PathBuf {
        let path = self.sandbox.path().join("bin").join(name);
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        path
    }

    fn dirs(&self, user: &User) -> (PathBuf, PathBuf) {
        let base = self.sandbox.path().join(format!("u{}", user.uid));
        let (stat, shm) = (base.join("stat"), base.join("shm"));
        for dir in [&base, &stat, &shm] {
            if !dir.exists() {
                std::fs::create_dir(dir).unwrap();
                std::os::unix::fs::chown(dir, Some(user.uid), Some(user.gid)).unwrap();
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
            }
        }
        (stat, shm)
    }

    /// `program` run as `user`, preloaded, its policy naming `others`.
    fn command(
        &self,
        program: impl AsRef<std::ffi::OsStr>,
        user: &User,
        others: &[&User],
    ) -> Command {
        let (stat, shm) = self.dirs(user);
        let mut command = Command::new(program);
        let others: Vec<String> = others.iter().map(|u| u.uid.to_string()).collect();
        command
            .env_remove("SANDIRECT_CONFIG")
            .env_remove("SANDIRECT_MODE")
            .env_remove("SANDIRECT_SAN")
            .env("LD_PRELOAD", &self.library)
            .env("SANDIRECT_OTHER_USERS", others.join(","))
            .env("SANDIRECT_STAT_DIR", stat)
            .env("SANDIRECT_SHM_DIR", shm)
            .current_dir(self.sandbox.path())
            .uid(user.uid)
            .gid(user.gid)
            .stdin(Stdio::null())
            .process_group(0);
        command
    }
}

/// Starts a `san_echo` server (protocol `protocol`) as `user`, naming `others`.
fn echo_server(world: &World, user: &User, others: &[&User], protocol: &str) -> Server {
    start_server(
        world
            .command(&world.san_echo, user, others)
            .args(["server", protocol]),
    )
}

/// The report line of `side` says `bytes` came through intact over the SAN; its checksum.
fn intact_over_the_san(report: &str, side: &str, bytes: usize) -> String {
    let line = report
        .lines()
        .find(|l| l.starts_with(side))
        .unwrap_or_else(|| panic!("no {side} line in {report}"));
    assert!(line.contains(&format!("ok bytes={bytes} ")), "{line}");
    assert!(line.ends_with("path=san-shm"), "{line}");
    line.split_whitespace()
        .find(|field| field.starts_with("checksum="))
        .unwrap_or_default()
        .to_owned()
}

#[test]
fn an_echo_pair_of_two_users_streams_over_the_san() {
    let Some(_serial) = as_root_alone() else {
        return;
    };
    let client_user = User::get("sdtest-client");
    let nobody = User::nobody();
    let world = World::new("users-echo");
    const BYTES: usize = 8 << 20;
    let server = echo_server(&world, &nobody, &[&client_user], "client-first");
    let client = spawned(
        world
            .command(&world.san_echo, &client_user, &[&nobody])
            .args(["client", &server.port, "client-first", &BYTES.to_string()]),
    );
    let (server, client) = finish_pair(server, client, "echo between two users");
    let sent = intact_over_the_san(&client, "client", BYTES);
    let echoed = intact_over_the_san(&server, "server", BYTES);
    assert_eq!(sent, echoed, "the server saw the client's bytes");
}

/// What the third user's program does while a client waits for its acceptor: looks for
/// pending exchanges of connections between users (`/proc/net/unix`), connects to each and
/// tries to receive a descriptor; lists the client's descriptors and tries to read its
/// memory (`process_vm_readv`). Prints one line of counts.
const INTRUDER: &str = r#"
import ctypes, mmap, os, socket, struct, sys, time
client_pid = int(sys.argv[1])
attach = len(sys.argv) > 3 and sys.argv[3] == "attach"
attached = 0
names, connected, fds, closed_unread = set(), 0, 0, 0
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    with open("/proc/net/unix") as table:
        found = [l.split()[-1] for l in table if "@sandirect/x/X/" in l]
    for name in found:
        if name in names:
            continue
        names.add(name)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect("\0" + name[1:])
            connected += 1
            s.settimeout(0.3)
            try:
                data, got, _, _ = socket.recv_fds(s, 16, 4)
                fds += len(got)
                if data == b"":
                    closed_unread += 1
                for fd in got:
                    if attach and data == b"S":
                        # Play the acceptor: mark the segment attached (state word at 72).
                        with mmap.mmap(fd, os.fstat(fd).st_size) as seg:
                            if struct.unpack_from("<I", seg, 72)[0] == 1:
                                struct.pack_into("<I", seg, 72, 3)
                                attached += 1
                    os.close(fd)
            except (socket.timeout, ConnectionResetError):
                closed_unread += 1
        except OSError:
            pass
        s.close()
    time.sleep(0.002)
try:
    opened = len(os.listdir("/proc/%d/fd" % client_pid))
except OSError:
    opened = 0
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(8)
local = iovec(ctypes.cast(buf, ctypes.c_void_p), 8)
remote = iovec(0x400000, 8)
n = libc.process_vm_readv(client_pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
cma = "read" if n >= 0 else "denied"
print("names=%d connected=%d fds=%d closed_unread=%d listed_fds=%d cma=%s attached=%d"
      % (len(names), connected, fds, closed_unread, opened, cma, attached))
"#;

#[test]
fn a_third_user_cannot_take_read_or_disturb_a_connection_between_two_users() {
    let Some(_serial) = as_root_alone() else {
        return;
    };
    let client_user = User::get("sdtest-client");
    let third = User::get("sdtest-third");
    let nobody = User::nobody();
    let world = World::new("users-third");
    let script = world.script("intruder.py", INTRUDER);
    const BYTES: usize = 4 << 20;
    // `early`: the server accepts 200 ms late, so the client waits pending (its exchange up)
    // while the intruder looks; `paced` would not give it time before the switch.
    let server = echo_server(&world, &nobody, &[&client_user], "early");
    let client = spawned(
        world
            .command(&world.san_echo, &client_user, &[&nobody])
            .args(["client", &server.port, "early", &BYTES.to_string()]),
    );
    // The third user is preloaded too and names both others: the policy is theirs to set,
    // not the intruder's.
    let intruder = spawned(
        world
            .command(system_python(), &third, &[&client_user, &nobody])
            .env_remove("LD_PRELOAD")
            .arg(&script)
            .arg(client.id().to_string())
            .arg("0.6"),
    );
    // Meanwhile: no segment of theirs is a file in any directory.
    std::thread::sleep(Duration::from_millis(100));
    for user in [&client_user, &nobody] {
        let (_, shm) = world.dirs(user);
        let segments: Vec<String> = std::fs::read_dir(&shm)
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| {
                preload_core::discovery::ConnectionKey::parse_segment_name(name).is_some()
            })
            .collect();
        assert!(
            segments.is_empty(),
            "segment files of a private connection: {segments:?}"
        );
    }
    let intruder = integration::wait_child(intruder, "intruder", Duration::from_secs(30))
        .unwrap_or_else(|failure| panic!("intruder: {failure}"));
    let (server, client) = finish_pair(server, client, "echo beside a third user");
    let counts = intruder
        .lines()
        .find(|l| l.starts_with("names="))
        .unwrap_or_default();
    let count = |key: &str| -> String {
        counts
            .split_whitespace()
            .find_map(|field| field.strip_prefix(&format!("{key}=")))
            .unwrap_or_default()
            .to_owned()
    };
    assert!(
        count("names").parse::<u32>().unwrap_or(0) >= 1 && count("connected") == count("names"),
        "the intruder found and reached the pending exchange: {intruder}"
    );
    assert_eq!(
        count("fds"),
        "0",
        "no descriptor for the intruder: {intruder}"
    );
    assert_eq!(
        count("closed_unread"),
        count("connected"),
        "every intruding connection closed unread: {intruder}"
    );
    assert_eq!(count("listed_fds"), "0", "{intruder}");
    assert_eq!(count("cma"), "denied", "{intruder}");
    let sent = intact_over_the_san(&client, "client", BYTES);
    let echoed = intact_over_the_san(&server, "server", BYTES);
    assert_eq!(sent, echoed);
}

/// A deterministic document of `bytes` bytes, readable by everyone.
fn write_document(path: &Path, bytes: usize) {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut generator = XorShift64::new(0x5eed_0f01_13e5);
    let mut block = [0u8; 8192];
    for _ in 0..bytes / block.len() {
        for chunk in block.chunks_exact_mut(8) {
            chunk.copy_from_slice(&generator.next_u64().to_le_bytes());
        }
        file.write_all(&block).unwrap();
    }
    file.flush().unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
}

/// The group name of gid 65534 (`nogroup` on Debian, `nobody` elsewhere).
fn nobody_group() -> String {
    let out = Command::new("getent")
        .args(["group", "65534"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split(':')
        .next()
        .unwrap_or("nogroup")
        .to_owned()
}

/// Samples `stat_dir`'s records every few milliseconds until `stop`.
fn record_paths(
    stat_dir: PathBuf,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<ObservedConnection>> {
    std::thread::spawn(move || {
        let mut seen = std::collections::BTreeMap::new();
        loop {
            let last = stop.load(std::sync::atomic::Ordering::Acquire);
            record_snapshot(
                &mut seen,
                preload_core::stats::read_dir(&stat_dir, false).unwrap_or_default(),
            );
            if last {
                return seen.into_values().collect();
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    })
}

#[test]
fn nginx_with_nobody_workers_serves_a_client_of_another_user_over_the_san() {
    let Some(_serial) = as_root_alone() else {
        return;
    };
    let nginx = require_program("nginx", "nginx-light");
    let wrk = require_program("wrk", "wrk");
    let curl = require_program("curl", "curl");
    let client_user = User::get("sdtest-client");
    let root_user = User {
        name: "root".to_owned(),
        uid: 0,
        gid: 0,
        made: false,
    };
    let world = World::new("users-nginx");
    let root = world.sandbox.path().join("nginx");
    for dir in ["", "www", "tmp"] {
        std::fs::create_dir_all(root.join(dir)).unwrap();
        std::fs::set_permissions(root.join(dir), std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::write(root.join("www/index.html"), "<p>sandirect</p>\n".repeat(64)).unwrap();
    std::fs::set_permissions(
        root.join("www/index.html"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    let large = root.join("www/large.bin");
    write_document(&large, 8 << 20);
    let port = free_port();
    let config =
        integration::apps::nginx_config(&root, port, &format!("user nobody {};", nobody_group()));
    std::fs::write(root.join("nginx.conf"), config).unwrap();
    // The master runs as root (it listens: the marker is root's) and its workers as nobody
    // (they accept): the workers' policy names the client's user.
    let mut command = world.command(&nginx, &root_user, &[&client_user]);
    command
        .arg("-p")
        .arg(&root)
        .arg("-c")
        .arg(root.join("nginx.conf"))
        .arg("-e")
        .arg(root.join("error.log"));
    let mut server = world.sandbox.spawn("nginx", command);
    wait_for_port(port, &mut server, Duration::from_secs(20));
    let nobody = User::nobody();
    let (client_stat, _) = world.dirs(&client_user);

    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let recorder = record_paths(client_stat.clone(), stop.clone());
    let mut command = world.command(&wrk, &client_user, &[&nobody]);
    command
        .args(["-t", "2", "-c", "8", "-d", "2s", "--timeout", "5s"])
        .arg(format!("http://127.0.0.1:{port}/index.html"));
    let report = world.sandbox.run("wrk", command, Duration::from_secs(60));
    stop.store(true, std::sync::atomic::Ordering::Release);
    let observed = recorder.join().unwrap();
    assert!(
        report.contains("requests in")
            && !report.contains("Socket errors")
            && !report.contains("Non-2xx"),
        "wrk: errors or no requests:\n{report}"
    );
    assert_paths(&observed, port, DataPath::SanShm, 8);

    // Bodies through `write` and through `sendfile`, checksummed, every connection on the SAN.
    let expected = integration::apps::sha256_of(&large);
    let downloads = world.sandbox.path().join(format!("u{}", client_user.uid));
    for location in ["large.bin", "sendfile/large.bin"] {
        let downloaded = downloads.join("downloaded.bin");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let recorder = record_paths(client_stat.clone(), stop.clone());
        let mut command = world.command(&curl, &client_user, &[&nobody]);
        command
            .args([
                "--silent",
                "--show-error",
                "--fail",
                "--limit-rate",
                "64M",
                "-o",
            ])
            .arg(&downloaded)
            .arg(format!("http://127.0.0.1:{port}/{location}"));
        world.sandbox.run("curl", command, Duration::from_secs(60));
        stop.store(true, std::sync::atomic::Ordering::Release);
        let observed = recorder.join().unwrap();
        assert_eq!(
            integration::apps::sha256_of(&downloaded),
            expected,
            "{location}: sha256 differs"
        );
        assert_paths(&observed, port, DataPath::SanShm, 1);
        std::fs::remove_file(&downloaded).unwrap();
    }
    let status = server.stop(libc::SIGQUIT, Duration::from_secs(20));
    assert!(status.success(), "nginx exit: {status}");
}

/// A process of a user the client's policy names (trusted with its connections to that user,
/// not with this one) connects to the pending client's exchange before the acceptor, gets the
/// private segment and marks it attached: the acceptor gets no segment and stays on TCP, and
/// the client, whose segment is attached but whose first bytes on TCP are not the acceptor's
/// marker and token, stays on TCP too; every byte intact.
#[test]
fn a_named_user_that_takes_the_segment_first_only_keeps_the_connection_on_tcp() {
    let Some(_serial) = as_root_alone() else {
        return;
    };
    let client_user = User::get("sdtest-client");
    let third = User::get("sdtest-third");
    let nobody = User::nobody();
    let world = World::new("users-squat");
    let script = world.script("intruder.py", INTRUDER);
    const BYTES: usize = 1 << 20;
    let server = echo_server(&world, &nobody, &[&client_user], "early");
    // The intruder starts first and watches for the exchange.
    let intruder = spawned(
        world
            .command(system_python(), &third, &[])
            .env_remove("LD_PRELOAD")
            .arg(&script)
            .args(["1", "0.8", "attach"]),
    );
    std::thread::sleep(Duration::from_millis(100));
    let client = spawned(
        world
            .command(&world.san_echo, &client_user, &[&nobody, &third])
            .args(["client", &server.port, "early", &BYTES.to_string()]),
    );
    let intruder = integration::wait_child(intruder, "intruder", Duration::from_secs(30))
        .unwrap_or_else(|failure| panic!("intruder: {failure}"));
    let (server, client) = finish_pair(
        server,
        client,
        &format!("echo beside a squatter ({intruder})"),
    );
    assert!(
        intruder.contains(" fds=1 ") && intruder.contains("attached=1"),
        "the named user's process took and attached the segment first: {intruder}"
    );
    for (report, side) in [(&client, "client"), (&server, "server")] {
        let line = report
            .lines()
            .find(|l| l.starts_with(side))
            .unwrap_or_default();
        assert!(line.contains(&format!("ok bytes={BYTES} ")), "{line}");
        assert!(
            line.to_ascii_lowercase().ends_with("path=tcp"),
            "{side} stayed on TCP: {line}"
        );
    }
}

/// Scribbles random values over the private segment a process maps (found by its name in
/// `/proc/PID/maps`, opened through `/proc/PID/map_files`: what its peer could write), mostly
/// over the header and both sides' control words, for a while. Run as root.
const SCRIBBLER: &str = r#"
import mmap, os, random, struct, sys, time
pid, delay, duration, seed = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
time.sleep(delay)
path, deadline = None, time.monotonic() + 5
while path is None and time.monotonic() < deadline:
    try:
        with open("/proc/%d/maps" % pid) as maps:
            for line in maps:
                if "sandirect-segment" in line:
                    path = "/proc/%d/map_files/%s" % (pid, line.split()[0])
                    break
    except OSError:
        break
    time.sleep(0.005)
if path is None:
    print("found=0 scribbles=0")
    sys.exit(0)
fd = os.open(path, os.O_RDWR)
size = os.fstat(fd).st_size
seg = mmap.mmap(fd, size)
side1 = struct.unpack_from("<Q", seg, 56)[0]
rng, count, end = random.Random(seed), 0, time.monotonic() + duration
while time.monotonic() < end:
    for _ in range(8):
        area = rng.random()
        if area < 0.35:
            offset = rng.randrange(0, 16384)
        elif area < 0.7 and side1 < size:
            offset = side1 + rng.randrange(0, min(16384, size - side1))
        else:
            offset = rng.randrange(0, size)
        offset = min(offset & ~7, size - 8)
        value = rng.choice([rng.getrandbits(64), rng.randrange(8), rng.randrange(256),
                            2**32 - 1, 2**64 - 1, 1 << rng.randrange(64)])
        struct.pack_into("<Q", seg, offset, value)
        count += 1
    time.sleep(0.002)
print("found=1 scribbles=%d" % count)
"#;

/// How a process under attack ended: an exit status (its connection failed or survived), or
/// still running at the deadline (its connection stalled, as a TCP peer can stall it; killed
/// now). Never a signal (a crash), never a panic message.
fn ended_without_crash(mut child: std::process::Child, what: &str, within: Duration) -> String {
    use std::io::Read as _;
    use std::os::unix::process::ExitStatusExt as _;
    let deadline = std::time::Instant::now() + within;
    let ended = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break format!("{status}");
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break "stalled (killed by the test)".to_owned();
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = stdout.read_to_string(&mut out);
    }
    let mut err = String::new();
    if let Some(mut stderr) = child.stderr.take() {
        let _ = stderr.read_to_string(&mut err);
    }
    if let Ok(Some(status)) = child.try_wait() {
        assert!(
            status.signal().is_none() || ended.starts_with("stalled"),
            "{what} crashed ({status}):\n{out}\n{err}"
        );
    }
    assert!(!err.contains("panicked"), "{what} panicked:\n{err}");
    format!(
        "{what}: {ended}; {} {}",
        out.trim(),
        err.lines().last().unwrap_or_default()
    )
}

/// A peer that scribbles over a live private segment (rings, credits, journals, the header:
/// anything) breaks that connection at most: neither process crashes or panics, whatever it
/// reads there. Several seeds, each a fresh connection between two users.
#[test]
fn a_peer_scribbling_on_a_live_private_segment_breaks_only_that_connection() {
    let Some(_serial) = as_root_alone() else {
        return;
    };
    let client_user = User::get("sdtest-client");
    let nobody = User::nobody();
    let world = World::new("users-scribble");
    let script = world.script("scribbler.py", SCRIBBLER);
    let mut found = 0;
    for seed in 1..=4u32 {
        let server = echo_server(&world, &nobody, &[&client_user], "paced");
        let client = spawned(
            world
                .command(&world.san_echo, &client_user, &[&nobody])
                .args(["client", &server.port, "paced", &(4u32 << 20).to_string()]),
        );
        let scribbler = Command::new(system_python())
            .arg(&script)
            .arg(client.id().to_string())
            .args(["0.3", "1.0", &seed.to_string()])
            .output()
            .unwrap();
        let scribbled = String::from_utf8_lossy(&scribbler.stdout).into_owned();
        assert!(scribbler.status.success(), "scribbler: {scribbler:?}");
        if scribbled.contains("found=1") {
            found += 1;
        }
        let client = ended_without_crash(client, "client", Duration::from_secs(20));
        let mut child = server.child;
        child.stdout = Some(server.reader.into_inner());
        let server = ended_without_crash(child, "server", Duration::from_secs(20));
        eprintln!("seed {seed}: {scribbled}{client}\n{server}");
    }
    assert!(
        found >= 3,
        "the scribbler found the live segment in most runs ({found} of 4)"
    );
}

/// An echo between two users, `protocol` with `bytes`, each end's policy naming the other as
/// `server_names` and `client_names` say; returns the two report lines.
fn echo_between_users(
    test: &str,
    protocol: &str,
    bytes: usize,
    server_names: bool,
    client_names: bool,
) -> (String, String, Vec<ObservedConnection>) {
    let client_user = User::get("sdtest-client");
    let nobody = User::nobody();
    let world = World::new(test);
    let (client_stat, _) = world.dirs(&client_user);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let recorder = record_paths(client_stat, stop.clone());
    let (named_by_server, named_by_client) = ([&client_user], [&nobody]);
    let server = echo_server(
        &world,
        &nobody,
        if server_names { &named_by_server } else { &[] },
        protocol,
    );
    let client = spawned(
        world
            .command(
                &world.san_echo,
                &client_user,
                if client_names { &named_by_client } else { &[] },
            )
            .args(["client", &server.port, protocol, &bytes.to_string()]),
    );
    let (server, client) = wait_pair(server, client);
    stop.store(true, std::sync::atomic::Ordering::Release);
    let observed = recorder.join().unwrap();
    match (server, client) {
        (Ok(server), Ok(client)) => (server, client, observed),
        (server, client) => panic!("{test}:\n{server:?}\n{client:?}"),
    }
}

/// Without both ends naming the other, a connection between two users stays on TCP, every
/// byte intact (and a client whose policy names nobody says why: `peer-other-user`, as before).
#[test]
fn two_users_stay_on_tcp_unless_both_name_the_other() {
    let Some(_serial) = as_root_alone() else {
        return;
    };
    const BYTES: usize = 1 << 20;
    for (server_names, client_names) in [(false, false), (true, false), (false, true)] {
        let (server, client, _) = echo_between_users(
            "users-policy",
            "client-first",
            BYTES,
            server_names,
            client_names,
        );
        for (report, side) in [(&client, "client"), (&server, "server")] {
            let line = report
                .lines()
                .find(|l| l.starts_with(side))
                .unwrap_or_default();
            assert!(line.contains(&format!("ok bytes={BYTES} ")), "{line}");
            assert!(
                line.to_ascii_lowercase().ends_with("path=tcp"),
                "server names: {server_names}, client names: {client_names}: {line}"
            );
        }
    }
}

/// A large blocking write between two users takes the rendezvous, through the segment's
/// window (never CMA between users): the client writes 8 MiB in one call before it reads the
/// echo, every byte intact, the client's record counting rendezvous bytes.
#[test]
fn a_large_write_between_two_users_takes_the_rendezvous_through_the_window() {
    let Some(_serial) = as_root_alone() else {
        return;
    };
    const BYTES: usize = 8 << 20;
    let (server, client, observed) =
        echo_between_users("users-window", "write-then-read", BYTES, true, true);
    let sent = intact_over_the_san(&client, "client", BYTES);
    assert_eq!(sent, intact_over_the_san(&server, "server", BYTES));
    let rendezvous: u64 = observed
        .iter()
        .map(|c| {
            c.info
                .counter(preload_core::record::Counter::SanRendezvousSent)
        })
        .sum();
    assert!(
        rendezvous > 0,
        "the 8 MiB write went by rendezvous: {:?}",
        observed
            .iter()
            .map(|c| &c.info.counters)
            .collect::<Vec<_>>()
    );
}

/// fork and exec between two users: the server forks (the child serves) or execs with the
/// connection on the SAN; the connection moves back to kernel TCP exactly (the client's
/// session answers the downgrade), every message checked.
#[test]
fn a_server_forking_or_execing_with_a_client_of_another_user_downgrades_exactly() {
    let Some(_serial) = as_root_alone() else {
        return;
    };
    let client_user = User::get("sdtest-client");
    let nobody = User::nobody();
    let world = World::new("users-fork");
    for mode in ["handoff", "exec"] {
        let server = start_server(
            world
                .command(&world.san_fork, &nobody, &[&client_user])
                .args(["server", mode]),
        );
        let client = spawned(
            world
                .command(&world.san_fork, &client_user, &[&nobody])
                .args(["client", &server.port, mode]),
        );
        let (server, client) = finish_pair(server, client, &format!("{mode} between two users"));
        let server_line = server
            .lines()
            .find(|l| l.starts_with("server ok"))
            .unwrap_or_default();
        assert!(
            server_line.contains("before_fork=[path=san "),
            "{mode}: {server_line}"
        );
        let client_line = client
            .lines()
            .find(|l| l.starts_with("client ok"))
            .unwrap_or_default();
        assert!(
            client_line.contains("path=tcp bypass=downgraded"),
            "{mode}: {client_line}"
        );
    }
}
