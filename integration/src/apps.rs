//! Harness for the application acceptance tests (`integration/tests/apps_*.rs`): real programs
//! (redis, iperf3, nginx, memcached, Python, Rust `std::net`) started under `sandirect run`,
//! each in a private sandbox, with the data path of every connection read from the published
//! socket records and compared with what the test expects.
//!
//! Rules this module enforces for every test:
//! * servers listen on loopback ports chosen free at run time, never on the system services;
//! * every process runs in its own process group and is killed with it when its guard drops, so
//!   a failing test leaves no server behind (forked workers included);
//! * the stats and segment directories are private to the test, so "nothing left behind" is a
//!   precise check rather than a guess about other users of `/dev/shm`;
//! * a missing program is installed with apt when possible and otherwise fails the test with a
//!   clear message: an application test never passes by skipping.
//!
//! This is test support: its functions report a failed expectation by panicking with a message
//! that says what was expected and what was seen, which is how a Rust test fails.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::io::{self, BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use preload_core::discovery::ConnectionKey;
use preload_core::record::{DataPath, SocketState};
use preload_core::stats::{self, ConnectionInfo};

/// The interposer's switch for the SAN path, passed through to the programs under test:
/// `SANDIRECT_SAN=0` runs the whole application suite over the interposer's TCP path.
pub const SAN_VARIABLE: &str = "SANDIRECT_SAN";

/// The path a connection between two preloaded processes must take: `SAN-shm` (the
/// default), kernel TCP when the suite runs with `SANDIRECT_SAN=0`.
pub fn expected_path_when_both_preloaded() -> DataPath {
    match std::env::var(SAN_VARIABLE).as_deref() {
        Ok("0") => DataPath::Tcp,
        _ => DataPath::SanShm,
    }
}

/// Which of the two programs of a test run under the interposer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preloaded {
    /// Client and server.
    Both,
    /// Only the client (the server is plain: the connection must fall back to TCP).
    ClientOnly,
    /// Only the server (a plain client never sees anything but TCP).
    ServerOnly,
}

impl Preloaded {
    /// Whether the client runs under the interposer.
    pub fn client(self) -> bool {
        matches!(self, Preloaded::Both | Preloaded::ClientOnly)
    }

    /// Whether the server runs under the interposer.
    pub fn server(self) -> bool {
        matches!(self, Preloaded::Both | Preloaded::ServerOnly)
    }

    /// The data path every connection of the test must take.
    pub fn expected_path(self) -> DataPath {
        match self {
            Preloaded::Both => expected_path_when_both_preloaded(),
            Preloaded::ClientOnly | Preloaded::ServerOnly => DataPath::Tcp,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Build products and programs
// ---------------------------------------------------------------------------------------------

/// The `sandirect` command and `libsandirect.so`, built once per test process in the profile
/// the tests run in.
#[derive(Debug)]
pub struct Products {
    /// The `sandirect` binary.
    pub cli: PathBuf,
    /// `libsandirect.so`.
    pub library: PathBuf,
}

/// Builds (once) and returns the `sandirect` command and the library. Panics with cargo's
/// message when the build fails: no application test can run without them.
pub fn products() -> &'static Products {
    static PRODUCTS: OnceLock<Products> = OnceLock::new();
    PRODUCTS.get_or_init(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut build = Command::new(cargo);
        build
            .args([
                "build",
                "--quiet",
                "-p",
                "sandirect-preload",
                "-p",
                "sandirect-cli",
            ])
            .arg("--manifest-path")
            .arg(&manifest);
        if !cfg!(debug_assertions) {
            build.arg("--release");
        }
        let status = build.status();
        assert!(
            matches!(status, Ok(status) if status.success()),
            "building sandirect and libsandirect.so failed: {status:?}"
        );
        let dir = crate::profile_dir();
        let products = Products {
            cli: dir.join("sandirect"),
            library: dir.join("libsandirect.so"),
        };
        for path in [&products.cli, &products.library] {
            assert!(path.is_file(), "{} missing after the build", path.display());
        }
        products
    })
}

/// Finds `program` on `PATH`; when it is missing, installs the Debian package `package` with
/// apt (as root, or through `sudo -n`), and fails the test with a clear message if that is not
/// possible. An application test must never pass because its application was absent.
pub fn require_program(program: &str, package: &str) -> PathBuf {
    if let Some(path) = find_on_path(program) {
        return path;
    }
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let apt = |args: &[&str]| {
        let mut command = if root {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.args(["-n", "apt-get"]);
            sudo
        };
        command
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    };
    let installed = apt(&["install", "-y", "-qq", "--no-install-recommends", package])
        || (apt(&["update", "-qq"])
            && apt(&["install", "-y", "-qq", "--no-install-recommends", package]));
    match find_on_path(program).filter(|_| installed) {
        Some(path) => path,
        None => panic!(
            "`{program}` is required by this application test and could not be installed \
             (apt package `{package}`; run `scripts/bootstrap.sh --apps` as root)"
        ),
    }
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

/// A loopback port that was free a moment ago (the kernel's choice for an ephemeral bind).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// Waits until something accepts TCP connections on `127.0.0.1:port`, failing the test with
/// `what` when `server` exits first or `timeout` passes.
pub fn wait_for_port(port: u16, server: &mut ProcessGuard, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        if TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return;
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            panic!(
                "{} exited ({status}) before listening on {port}",
                server.name
            );
        }
        assert!(
            Instant::now() < deadline,
            "{} did not listen on port {port} within {timeout:?}",
            server.name
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------------
// Sandbox: private directories and the commands run in them
// ---------------------------------------------------------------------------------------------

/// A test's private world: a temporary directory (removed on drop) holding the stats directory
/// the preloaded processes publish into and any files the test makes, and a segment directory
/// on `/dev/shm` where the machine has it (where users' segments live: a tmpfs, whose
/// mappings cost what they cost users; a disk-backed file's dirty pages make every unmap slow).
#[derive(Debug)]
pub struct Sandbox {
    root: PathBuf,
    stat_dir: PathBuf,
    segment_dir: PathBuf,
}

impl Sandbox {
    /// A fresh sandbox named after the test.
    pub fn new(test: &str) -> Sandbox {
        static SANDBOXES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let root = std::env::temp_dir().join(format!(
            "sandirect-app-{}-{}-{test}",
            std::process::id(),
            SANDBOXES.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        let stat_dir = root.join("stat");
        let shm = Path::new("/dev/shm");
        let segment_dir = if shm.is_dir() {
            shm.join(root.file_name().unwrap_or_default())
        } else {
            root.join("segments")
        };
        let _ = std::fs::remove_dir_all(&segment_dir);
        for dir in [&root, &stat_dir, &segment_dir] {
            std::fs::create_dir_all(dir)
                .unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
            std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .unwrap_or_else(|e| panic!("chmod {}: {e}", dir.display()));
        }
        Sandbox {
            root,
            stat_dir,
            segment_dir,
        }
    }

    /// The sandbox directory (for configuration files, documents, scripts).
    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Where the preloaded processes publish their socket records.
    pub fn stat_dir(&self) -> &Path {
        &self.stat_dir
    }

    /// Where the preloaded processes keep their segment files.
    pub fn segment_dir(&self) -> &Path {
        &self.segment_dir
    }

    /// A command for `program` with a clean sandirect environment, run through
    /// `sandirect run` when `preloaded`, in a process group of its own.
    pub fn command(&self, program: impl AsRef<OsStr>, preloaded: bool) -> Command {
        let products = products();
        let mut command = if preloaded {
            let mut run = Command::new(&products.cli);
            run.arg("run").arg(program.as_ref());
            run.env("SANDIRECT_LIB", &products.library);
            run
        } else {
            Command::new(program.as_ref())
        };
        command
            .env_remove("LD_PRELOAD")
            .env_remove("SANDIRECT_CONFIG")
            .env_remove("SANDIRECT_MODE")
            .env("SANDIRECT_STAT_DIR", &self.stat_dir)
            .env("SANDIRECT_SHM_DIR", &self.segment_dir)
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .process_group(0);
        command
    }

    /// Spawns `command` (made by [`command`](Self::command)) as a guarded process, its stdout
    /// and stderr kept in files of the sandbox (`NAME.stdout`, `NAME.stderr`): a server's logs
    /// never fill a pipe nobody reads.
    pub fn spawn(&self, name: &str, mut command: Command) -> ProcessGuard {
        let stdout_path = self.root.join(format!("{name}.stdout"));
        let stdout = std::fs::File::create(&stdout_path)
            .unwrap_or_else(|e| panic!("create {}: {e}", stdout_path.display()));
        command.stdout(stdout);
        self.spawn_with_stdout(name, command)
    }

    /// Like [`spawn`](Self::spawn), with stdout piped for [`ProcessGuard::take_stdout`]: for
    /// programs that report on stdout (the caller must keep reading it).
    pub fn spawn_piped(&self, name: &str, mut command: Command) -> ProcessGuard {
        command.stdout(Stdio::piped());
        self.spawn_with_stdout(name, command)
    }

    fn spawn_with_stdout(&self, name: &str, mut command: Command) -> ProcessGuard {
        let stderr_path = self.root.join(format!("{name}.stderr"));
        let stderr = std::fs::File::create(&stderr_path)
            .unwrap_or_else(|e| panic!("create {}: {e}", stderr_path.display()));
        let child = command
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("start {name}: {e}"));
        ProcessGuard {
            name: name.to_owned(),
            child,
            stderr_path,
        }
    }

    /// Runs `command` to completion within `timeout` (killed with its group after it) and
    /// returns its output, failing the test when it does not succeed.
    pub fn run(&self, name: &str, command: Command, timeout: Duration) -> String {
        let mut guard = self.spawn_piped(name, command);
        let stdout = guard.take_stdout();
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = BufReader::new(stdout).read_to_string(&mut text);
            text
        });
        let status = guard.wait_timeout(timeout);
        let text = reader.join().unwrap_or_default();
        assert!(
            status.success(),
            "{name} failed ({status}):\nstdout:\n{text}\nstderr:\n{}",
            guard.stderr()
        );
        text
    }

    /// The live connections the sandbox's preloaded processes publish right now.
    pub fn connections(&self) -> Vec<ConnectionInfo> {
        stats::read_dir(&self.stat_dir, false).unwrap_or_default()
    }

    /// The rows `sandirect stat` prints for this sandbox's connections to or from `port`, as
    /// `(role, path)` pairs: the operator's view, checked alongside the records themselves.
    pub fn stat_rows(&self, port: u16) -> Vec<(String, String)> {
        let output = Command::new(&products().cli)
            .arg("stat")
            .env("SANDIRECT_STAT_DIR", &self.stat_dir)
            .output()
            .expect("run sandirect stat");
        assert!(output.status.success(), "sandirect stat failed: {output:?}");
        let suffix = format!(":{port}");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .skip(1)
            .filter_map(|line| {
                // PID FD STATE ROLE LOCAL PEER PATH TCP-TX TCP-RX INLINE RENDEZVOUS REASON
                let columns: Vec<&str> = line.split_whitespace().collect();
                let (role, local, peer, path) = (
                    columns.get(3)?,
                    columns.get(4)?,
                    columns.get(5)?,
                    columns.get(6)?,
                );
                (local.ends_with(&suffix) || peer.ends_with(&suffix))
                    .then(|| (role.to_string(), path.to_string()))
            })
            .collect()
    }

    /// While a client holds its connections open: exactly `count` connections to or from
    /// `port` are published, each on `expected`, both in the records and in `sandirect stat`.
    /// Returns their records for further checks.
    pub fn assert_live_paths(
        &self,
        port: u16,
        expected: DataPath,
        count: usize,
    ) -> Vec<ConnectionInfo> {
        let mut seen = BTreeMap::new();
        record_snapshot(&mut seen, self.connections());
        let observed: Vec<_> = seen.into_values().collect();
        let summary = assert_paths(&observed, port, expected, count);
        assert_eq!(
            summary.len(),
            count,
            "exactly {count} live connection(s) expected:\n{}",
            summary.join("\n")
        );
        let rows = self.stat_rows(port);
        assert_eq!(rows.len(), count, "sandirect stat rows: {rows:?}");
        assert!(
            rows.iter().all(|(_, path)| path == expected.label()),
            "sandirect stat must show {} for every connection: {rows:?}",
            expected.label()
        );
        observed
            .into_iter()
            .map(|c| c.info)
            .filter(|c| {
                c.local.is_some_and(|a| a.port() == port)
                    || c.peer.is_some_and(|a| a.port() == port)
            })
            .collect()
    }

    /// Checks that nothing is left behind once every process of the test is gone: no stats
    /// file of a live process, no stale stats file the reader would not remove, and no segment
    /// file anywhere in the sandbox's segment directory.
    pub fn assert_nothing_left_behind(&self) {
        let live = stats::read_dir(&self.stat_dir, true).expect("read the stats directory");
        assert!(live.is_empty(), "processes still publish sockets: {live:?}");
        let stats_files: Vec<_> = list_dir(&self.stat_dir);
        assert!(
            stats_files.is_empty(),
            "stats files left behind: {stats_files:?}"
        );
        let segments: Vec<_> = list_dir(&self.segment_dir)
            .into_iter()
            .chain(list_dir(&self.stat_dir))
            .filter(|name| ConnectionKey::parse_segment_name(name).is_some())
            .collect();
        assert!(
            segments.is_empty(),
            "segment files left behind: {segments:?}"
        );
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.root);
            let _ = std::fs::remove_dir_all(&self.segment_dir);
        } else {
            eprintln!("sandbox kept for inspection: {}", self.root.display());
        }
    }
}

fn list_dir(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|entry| entry.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Serialises the load-generating tests of one test binary: on a 2-core machine two
/// benchmarks at once would only measure each other (and time out).
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

// ---------------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------------

/// How long the processes a program forked may take to exit after it did.
const LINGER: Duration = Duration::from_secs(2);

/// A spawned program in its own process group. Dropping it kills the whole group (forked
/// workers included) and reaps the leader.
#[derive(Debug)]
pub struct ProcessGuard {
    name: String,
    child: Child,
    stderr_path: PathBuf,
}

impl ProcessGuard {
    /// The process id (also the process group id).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The program's stdout (once; only for [`Sandbox::spawn_piped`]).
    pub fn take_stdout(&mut self) -> ChildStdout {
        match self.child.stdout.take() {
            Some(stdout) => stdout,
            None => panic!("{}: stdout is not piped or was taken already", self.name),
        }
    }

    /// What the program wrote on stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Waits for the program to exit by itself within `timeout` (kills its group after it),
    /// then checks that no process it started outlived it.
    pub fn wait_timeout(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    self.assert_group_gone(deadline.max(Instant::now() + LINGER));
                    return status;
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    let report = crate::hang::report_for(self.pid());
                    self.kill_group(libc::SIGKILL);
                    panic!(
                        "{} did not finish within {timeout:?}; stderr:\n{}\n\
                         what it and its peers were doing:\n{report}",
                        self.name,
                        self.stderr()
                    );
                }
            }
        }
    }

    /// Stops the program the way its operator would (`signal`, e.g. SIGTERM or SIGQUIT to the
    /// group), waits for the whole group to exit, and checks that no process of the group is
    /// left (workers included). SIGKILL after `grace`, which fails the test.
    pub fn stop(mut self, signal: libc::c_int, grace: Duration) -> ExitStatus {
        self.kill_group(signal);
        let deadline = Instant::now() + grace;
        let status = loop {
            match self.child.try_wait() {
                Ok(Some(status)) => break status,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                _ => {
                    self.kill_group(libc::SIGKILL);
                    panic!("{} ignored signal {signal} for {grace:?}", self.name);
                }
            }
        };
        // Forked workers exit after their master; give them the rest of the grace period.
        self.assert_group_gone(deadline.max(Instant::now() + LINGER));
        status
    }

    /// Fails the test if a process of the group is still alive at `deadline` (the leader
    /// itself has exited and been reaped; whatever remains was leaked by it).
    fn assert_group_gone(&self, deadline: Instant) {
        while self.group_alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            !self.group_alive(),
            "{}: processes of its group outlived it",
            self.name
        );
    }

    fn group_alive(&self) -> bool {
        let group = self.child.id() as libc::pid_t;
        // SAFETY: signal 0 only checks for existence; the group id is our child's.
        unsafe { libc::kill(-group, 0) == 0 }
    }

    fn kill_group(&self, signal: libc::c_int) {
        let group = self.child.id() as libc::pid_t;
        // SAFETY: the child leads a process group of its own (process_group(0)); signalling it
        // reaches only processes this test started.
        unsafe { libc::kill(-group, signal) };
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) || self.group_alive() {
            self.kill_group(libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// Reads `reader` line by line until a line containing `marker`, returning the lines read and
/// the reader (the rest of the stream stays readable); `Err` with the lines read at EOF or
/// after `timeout`.
pub fn read_until_line<R: Read + Send + 'static>(
    reader: R,
    marker: &'static str,
    timeout: Duration,
) -> Result<(Vec<String>, BufReader<R>), String> {
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(reader);
        let mut lines = Vec::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => {
                    let _ = sender.send(Err(format!("output ended before {marker:?}: {lines:#?}")));
                    return;
                }
                Ok(_) => {
                    let found = line.contains(marker);
                    lines.push(line.trim_end().to_owned());
                    if found {
                        let _ = sender.send(Ok((lines, reader)));
                        return;
                    }
                }
            }
        }
    });
    receiver
        .recv_timeout(timeout)
        .unwrap_or_else(|_| Err(format!("no {marker:?} within {timeout:?}")))
}

impl Sandbox {
    /// Runs a client that prints a line containing `holding` once its work is verified and
    /// then keeps its connections open until stdin closes (`app_kv`, `app_stdnet`, the Python
    /// echo client): calls `while_holding` with that line, closes stdin, and returns all the
    /// client printed. Fails the test if the client fails or exceeds `timeout` in either phase.
    pub fn run_holding(
        &self,
        name: &str,
        mut command: Command,
        timeout: Duration,
        while_holding: impl FnOnce(&str),
    ) -> String {
        command.stdin(Stdio::piped());
        let mut guard = self.spawn_piped(name, command);
        let stdin = guard.child.stdin.take();
        let stdout = guard.take_stdout();
        let (lines, rest) = match read_until_line(stdout, "holding", timeout) {
            Ok(found) => found,
            Err(message) => panic!("{name}: {message}\nstderr:\n{}", guard.stderr()),
        };
        while_holding(lines.last().map_or("", String::as_str));
        drop(stdin);
        let tail = drain(rest);
        let status = guard.wait_timeout(timeout);
        let tail = tail.join().ok().and_then(Result::ok).unwrap_or_default();
        let output = format!("{}\n{tail}", lines.join("\n"));
        assert!(
            status.success(),
            "{name} failed ({status}):\n{output}\nstderr:\n{}",
            guard.stderr()
        );
        output
    }
}

// ---------------------------------------------------------------------------------------------
// Connection paths
// ---------------------------------------------------------------------------------------------

/// One connection as last seen in the published records.
#[derive(Clone, Debug)]
pub struct ObservedConnection {
    /// The last snapshot of its record.
    pub info: ConnectionInfo,
    /// In how many snapshots it appeared.
    pub sightings: u32,
}

/// Samples the sandbox's published records in the background while a workload runs, keeping
/// the latest sighting of each connected socket: connections of a benchmark come and go, and
/// their records vanish with them, so a single snapshot after the fact would see nothing.
pub struct PathRecorder {
    stop: Arc<AtomicBool>,
    worker: Option<JoinHandle<BTreeMap<ConnectionId, ObservedConnection>>>,
}

/// What identifies a connection across snapshots: owner, fd, and both addresses.
type ConnectionId = (u32, i32, Option<SocketAddr>, Option<SocketAddr>);

impl PathRecorder {
    /// Starts sampling `sandbox`'s stats directory every `interval`.
    pub fn start(sandbox: &Sandbox, interval: Duration) -> PathRecorder {
        let dir = sandbox.stat_dir.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let worker = std::thread::spawn(move || {
            let mut seen = BTreeMap::new();
            loop {
                // One last sample after the stop request, so the final state is included.
                let last = stop_flag.load(Ordering::Acquire);
                record_snapshot(&mut seen, stats::read_dir(&dir, false).unwrap_or_default());
                if last {
                    return seen;
                }
                std::thread::sleep(interval);
            }
        });
        PathRecorder {
            stop,
            worker: Some(worker),
        }
    }

    /// Stops sampling and returns every connected socket seen, in a stable order.
    pub fn finish(mut self) -> Vec<ObservedConnection> {
        self.stop.store(true, Ordering::Release);
        self.worker
            .take()
            .and_then(|worker| worker.join().ok())
            .map(|seen| seen.into_values().collect())
            .unwrap_or_default()
    }
}

impl Drop for PathRecorder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

/// Adds one snapshot's connected sockets to `seen`.
pub fn record_snapshot(
    seen: &mut BTreeMap<ConnectionId, ObservedConnection>,
    snapshot: Vec<ConnectionInfo>,
) {
    for info in snapshot
        .into_iter()
        .filter(|c| matches!(c.state, SocketState::ConnectedTcp | SocketState::San))
    {
        let id = (info.pid, info.fd, info.local, info.peer);
        seen.entry(id)
            .and_modify(|observed| {
                observed.sightings += 1;
                observed.info = info.clone();
            })
            .or_insert(ObservedConnection { info, sightings: 1 });
    }
}

/// Application bytes a connection sent and received over every path (TCP, SAN inline, SAN
/// rendezvous): what the program wrote and read, however it travelled.
pub fn application_bytes(connection: &ConnectionInfo) -> (u64, u64) {
    use preload_core::record::Counter;
    let sent = connection.counter(Counter::TcpSent)
        + connection.counter(Counter::SanInlineSent)
        + connection.counter(Counter::SanRendezvousSent);
    let received = connection.counter(Counter::TcpReceived)
        + connection.counter(Counter::SanInlineReceived)
        + connection.counter(Counter::SanRendezvousReceived);
    (sent, received)
}

/// Checks the paths of the connections to or from `server_port` among `observed`: at least
/// `min_connections` of them were seen, every one that moved bytes took `expected`, and
/// a summary line per connection is returned for the test's log.
pub fn assert_paths(
    observed: &[ObservedConnection],
    server_port: u16,
    expected: DataPath,
    min_connections: usize,
) -> Vec<String> {
    let relevant: Vec<_> = observed
        .iter()
        .filter(|c| {
            c.info.local.is_some_and(|a| a.port() == server_port)
                || c.info.peer.is_some_and(|a| a.port() == server_port)
        })
        .collect();
    let summary: Vec<String> = relevant
        .iter()
        .map(|c| {
            format!(
                "pid {} fd {} {} -> {}: {} ({}) bytes {:?}, seen {}x",
                c.info.pid,
                c.info.fd,
                c.info.local.map_or("-".into(), |a| a.to_string()),
                c.info.peer.map_or("-".into(), |a| a.to_string()),
                c.info.path.label(),
                c.info.bypass.label(),
                c.info.counters,
                c.sightings
            )
        })
        .collect();
    assert!(
        relevant.len() >= min_connections,
        "expected at least {min_connections} published connection(s) on port {server_port}, \
         saw {}:\n{}",
        relevant.len(),
        summary.join("\n")
    );
    // A connection that moved no byte in either direction took no data path: e.g. one that
    // redis-benchmark abandoned while its connect was still queued, which the server accepts
    // only after the client (and the exchange it had set up) is gone.
    let wrong: Vec<_> = relevant
        .iter()
        .zip(&summary)
        .filter(|(c, _)| c.info.path != expected && application_bytes(&c.info) != (0, 0))
        .map(|(_, line)| line.as_str())
        .collect();
    const SHOWN: usize = 12;
    assert!(
        wrong.is_empty(),
        "every connection must take {} ({SAN_VARIABLE}={:?}); {} of {} did not, e.g.:\n{}",
        expected.label(),
        std::env::var(SAN_VARIABLE).unwrap_or_default(),
        wrong.len(),
        relevant.len(),
        wrong[..wrong.len().min(SHOWN)].join("\n")
    );
    summary
}

/// Reads the whole of a child's stream into a string on a thread (so a chatty program never
/// blocks on a full pipe), returning the handle to join.
pub fn drain<R: Read + Send + 'static>(reader: R) -> JoinHandle<io::Result<String>> {
    std::thread::spawn(move || {
        let mut text = String::new();
        BufReader::new(reader).read_to_string(&mut text)?;
        Ok(text)
    })
}

/// The nginx configuration the application tests run: a master that forks two workers (as
/// `user_line` says: `user nobody nogroup;`, `user root root;` or nothing), serving `root`/www
/// on 127.0.0.1:`port` through `write`, and under `/sendfile/` through `sendfile`.
pub fn nginx_config(root: &Path, port: u16, user_line: &str) -> String {
    let root = root.display();
    format!(
        r#"daemon off;
master_process on;
worker_processes 2;
{user_line}
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {root}/tmp/body;
    proxy_temp_path {root}/tmp/proxy;
    fastcgi_temp_path {root}/tmp/fastcgi;
    uwsgi_temp_path {root}/tmp/uwsgi;
    scgi_temp_path {root}/tmp/scgi;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {root}/www;
        sendfile off;
        location /sendfile/ {{ alias {root}/www/; sendfile on; }}
    }}
}}
"#
    )
}

/// The SHA-256 of the file at `path`, in hex (`sha256sum`).
pub fn sha256_of(path: &Path) -> String {
    let output = Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("run sha256sum");
    assert!(output.status.success(), "sha256sum {}", path.display());
    String::from_utf8_lossy(&output.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preloaded_sides_decide_the_expected_path() {
        assert!(Preloaded::Both.client() && Preloaded::Both.server());
        assert!(Preloaded::ClientOnly.client() && !Preloaded::ClientOnly.server());
        assert!(!Preloaded::ServerOnly.client() && Preloaded::ServerOnly.server());
        // A plain peer can never be reached over the SAN, whatever the expectation says.
        assert_eq!(Preloaded::ClientOnly.expected_path(), DataPath::Tcp);
        assert_eq!(Preloaded::ServerOnly.expected_path(), DataPath::Tcp);
    }

    #[test]
    fn snapshots_keep_the_latest_sighting_of_connected_sockets_only() {
        let connection = |state, path, sent| ConnectionInfo {
            pid: 7,
            fd: 3,
            fd_refs: 1,
            state,
            flags: 0,
            local: Some("127.0.0.1:5000".parse().unwrap()),
            peer: Some("127.0.0.1:6000".parse().unwrap()),
            path,
            bypass: preload_core::record::Bypass::None,
            counters: [sent, 0, 0, 0, 0, 0],
        };
        let mut seen = BTreeMap::new();
        record_snapshot(
            &mut seen,
            vec![connection(SocketState::ConnectedTcp, DataPath::Tcp, 1)],
        );
        record_snapshot(
            &mut seen,
            vec![
                connection(SocketState::San, DataPath::SanShm, 9),
                ConnectionInfo {
                    fd: 4,
                    ..connection(SocketState::Listener, DataPath::Tcp, 0)
                },
            ],
        );
        let observed: Vec<_> = seen.into_values().collect();
        assert_eq!(observed.len(), 1, "listeners are not connections");
        assert_eq!(observed[0].sightings, 2);
        assert_eq!(observed[0].info.path, DataPath::SanShm);
        assert_paths(&observed, 6000, DataPath::SanShm, 1);
        let wrong = std::panic::catch_unwind(|| assert_paths(&observed, 6000, DataPath::Tcp, 1));
        assert!(
            wrong.is_err(),
            "a SAN connection must fail a TCP expectation"
        );
        let missing = std::panic::catch_unwind(|| assert_paths(&observed, 1, DataPath::Tcp, 1));
        assert!(missing.is_err(), "no connection on the port must fail");
    }
}
