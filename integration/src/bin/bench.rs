//! The benchmark anyone can rerun (`scripts/bench.sh`): real, unmodified programs — redis with
//! redis-benchmark, nginx with wrk, memcached with memcslap, iperf3, a node (libuv) echo server,
//! a Java NIO selector echo server, connection churn — plus the socket micro-benchmarks
//! (`bench_sockets`), each measured as
//!
//! * `TCP`              — nothing preloaded: the kernel's loopback TCP;
//! * `sandirect`        — server and client preloaded (the SAN path);
//! * `fallback`         — only the client preloaded, the server plain (TCP through the hooks);
//! * `plain->preloaded` — only the server preloaded (connection set-up workloads: what a plain
//!   client pays for talking to a preloaded server);
//! * `sandirect, set-up forced` — both preloaded, the client told to take the SAN for every
//!   connection however short (`SANDIRECT_SHORT_CONNECTION_BYTES=0`; connection set-up
//!   workloads: what the SAN set-up itself costs, which the default spares short connections).
//!
//! The socket micro-benchmarks also carry `bench_sockets`' socket-free yardsticks (`raw ring`,
//! `process_vm_readv`, `sched_yield hand-off`) in the tests that have them: printed and stored,
//! but neither charted nor compared with a baseline, as they are bounds, not ways programs run.
//!
//! For each workload both servers (plain and preloaded) run side by side, and every round runs
//! each variant's client once, in an order that rotates from round to round, so drift, warm-up
//! and the machine's other load hit every variant alike. Per workload it prints the median of
//! the per-round ratios against TCP with their spread (min–max), p50/p99 latency where the
//! load generator reports it (or measures it, for the clients of this binary), CPU time per
//! operation of each end (server: `/proc/PID/stat` utime+stime of its whole process group;
//! client: the `wait4` resource usage of the load generator), and the data path the published
//! socket records showed. It writes a JSON report with every round's raw figures, draws an SVG
//! chart of the ratios, and compares the ratios with a baseline report: a ratio whose every
//! round is more than 20% below the baseline's median is printed as a `warning: regression`
//! line (a `note:` when only the median is), never as a failure (the exit status is non-zero
//! only when the benchmark cannot run at all).
//!
//! Two workloads rerun redis `-c 1` under CPU contention, kernel TCP against the SAN path: both
//! ends pinned to one CPU (`taskset`), and both ends beside a CPU hog pinned to the other CPU.
//! Looking for the next message before sleeping pays only while the peer runs on another CPU;
//! these show what is left when it cannot (the looks must back off, not take the CPU the peer
//! needs).
//!
//! Every load generator is bounded by a request count or a duration and by a timeout; all
//! servers listen on loopback ports chosen free at run time and are killed with their process
//! group at the end.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use integration::apps::{application_bytes, PathRecorder, Sandbox};
use serde_json::{json, Value};

/// A ratio this far below the baseline's median is flagged.
const REGRESSION: f64 = 0.8;

const USAGE: &str = "usage: bench [--quick] [--rounds N] [--only NAME,...] [--out DIR]
             [--baseline FILE] [--save-baseline] [--preload libsandirect.so]
   or: bench --redraw REPORT.json
   or: bench --role churn|rtt --port N --seconds S   (the clients this binary provides)
   or: bench --role scale --port N --seconds S --connections C [--server-pid P]
                                                     (C redis connections at once)
   or: bench --role fork-echo --port N               (its fork-per-connection echo server)

  --quick          ~2 minutes: 3 rounds of short runs (what CI records)
  --rounds N       rounds per workload (default 5, quick 3)
  --only A,B       only the workloads whose name contains one of these words
  --out DIR        where the report goes (default target/bench): bench-MODE.json, bench-MODE.svg
  --baseline FILE  the report to compare with (default docs/bench/baseline-MODE.json)
  --save-baseline  also write this run's report as the baseline and its chart beside it
  --redraw FILE    only draw the chart of a stored report (FILE with .svg)";

// ---------------------------------------------------------------------------------------------
// Variants
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    Tcp,
    Sandirect,
    Fallback,
    ServerOnly,
    /// Both ends preloaded, the client told to set every connection up on the SAN however
    /// short its connections are (`SANDIRECT_SHORT_CONNECTION_BYTES=0`): what the set-up
    /// itself costs.
    SetUpForced,
    RawRing,
    /// The socket micro-benchmark's single-copy yardstick (`process_vm_readv` out of the
    /// sender's buffer).
    ProcessVmReadv,
    /// The socket micro-benchmark's same-core yardstick (a shared page, `sched_yield` until
    /// one's turn).
    YieldHandOff,
}

impl Variant {
    fn label(self) -> &'static str {
        match self {
            Variant::Tcp => "TCP",
            Variant::Sandirect => "sandirect",
            Variant::Fallback => "fallback",
            Variant::ServerOnly => "plain->preloaded",
            Variant::SetUpForced => "sandirect, set-up forced",
            Variant::RawRing => "raw ring",
            Variant::ProcessVmReadv => "process_vm_readv",
            Variant::YieldHandOff => "sched_yield hand-off",
        }
    }

    /// A yardstick of the socket micro-benchmark: a bound to compare with, not a way programs
    /// run, so neither charted nor compared with a baseline.
    fn is_yardstick(self) -> bool {
        YARDSTICKS.contains(&self)
    }

    fn client_preloaded(self) -> bool {
        matches!(
            self,
            Variant::Sandirect | Variant::Fallback | Variant::SetUpForced
        )
    }

    fn server_preloaded(self) -> bool {
        matches!(
            self,
            Variant::Sandirect | Variant::ServerOnly | Variant::SetUpForced
        )
    }

    /// Settings of the client's beyond the preload.
    fn client_env(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Variant::SetUpForced => &[("SANDIRECT_SHORT_CONNECTION_BYTES", "0")],
            _ => &[],
        }
    }
}

/// The socket micro-benchmark's yardsticks.
const YARDSTICKS: [Variant; 3] = [
    Variant::RawRing,
    Variant::ProcessVmReadv,
    Variant::YieldHandOff,
];

/// The variants of the application workloads, and of the connection set-up ones.
const APP_VARIANTS: &[Variant] = &[Variant::Tcp, Variant::Sandirect, Variant::Fallback];
/// Kernel TCP and the SAN path only (the fallback path does not change under CPU contention).
const PAIR_VARIANTS: &[Variant] = &[Variant::Tcp, Variant::Sandirect];
const SETUP_VARIANTS: &[Variant] = &[
    Variant::Tcp,
    Variant::Sandirect,
    Variant::Fallback,
    Variant::ServerOnly,
    Variant::SetUpForced,
];

// ---------------------------------------------------------------------------------------------
// Figures
// ---------------------------------------------------------------------------------------------

/// What a load generator reported for one run.
#[derive(Clone, Debug, Default)]
struct Reported {
    /// The workload's figure (higher is better), in its unit.
    value: f64,
    /// Operations done (requests, connections, round trips, GB), for CPU per operation.
    ops: f64,
    p50_us: Option<f64>,
    p99_us: Option<f64>,
}

/// One variant's run in one round.
#[derive(Clone, Debug)]
struct Sample {
    reported: Reported,
    elapsed_s: f64,
    client_cpu_ns: u64,
    server_cpu_ns: u64,
    /// Connections to the server's port seen in the published records, by data path.
    paths: BTreeMap<String, u32>,
}

impl Sample {
    fn to_json(&self) -> Value {
        json!({
            "value": self.reported.value,
            "ops": self.reported.ops,
            "p50_us": self.reported.p50_us,
            "p99_us": self.reported.p99_us,
            "elapsed_s": self.elapsed_s,
            "client_cpu_ns": self.client_cpu_ns,
            "server_cpu_ns": self.server_cpu_ns,
            "paths": self.paths,
        })
    }
}

/// A workload's outcome: every round's samples per variant (`None` for a failed run).
struct Outcome {
    name: String,
    unit: &'static str,
    op: &'static str,
    variants: Vec<Variant>,
    rounds: Vec<BTreeMap<Variant, Option<Sample>>>,
    skipped: Option<String>,
    /// Data path per variant when only a summary is known (the socket micro-benchmarks).
    path_labels: BTreeMap<Variant, String>,
}

#[derive(Clone, Copy, Debug)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
}

fn median(mut values: Vec<f64>) -> Option<f64> {
    values.retain(|v| v.is_finite());
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    Some(if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    })
}

fn spread(values: Vec<f64>) -> Option<Spread> {
    let finite: Vec<f64> = values.into_iter().filter(|v| v.is_finite()).collect();
    Some(Spread {
        median: median(finite.clone())?,
        min: finite.iter().copied().fold(f64::INFINITY, f64::min),
        max: finite.iter().copied().fold(f64::NEG_INFINITY, f64::max),
    })
}

impl Outcome {
    fn skipped(name: &str, unit: &'static str, reason: String) -> Outcome {
        Outcome {
            name: name.to_owned(),
            unit,
            op: "op",
            variants: Vec::new(),
            rounds: Vec::new(),
            skipped: Some(reason),
            path_labels: BTreeMap::new(),
        }
    }

    fn samples(&self, variant: Variant) -> Vec<&Sample> {
        self.rounds
            .iter()
            .filter_map(|round| round.get(&variant).and_then(Option::as_ref))
            .collect()
    }

    /// Per-round ratios of `variant`'s figure to TCP's (rounds where both ran).
    fn ratios(&self, variant: Variant) -> Vec<f64> {
        self.rounds
            .iter()
            .filter_map(|round| {
                let tcp = round.get(&Variant::Tcp)?.as_ref()?;
                let other = round.get(&variant)?.as_ref()?;
                (tcp.reported.value > 0.0).then(|| other.reported.value / tcp.reported.value)
            })
            .collect()
    }

    fn ratio_spread(&self, variant: Variant) -> Option<Spread> {
        spread(self.ratios(variant))
    }

    fn paths_seen(&self, variant: Variant) -> String {
        if let Some(label) = self.path_labels.get(&variant) {
            return label.clone();
        }
        let mut total: BTreeMap<String, u32> = BTreeMap::new();
        for sample in self.samples(variant) {
            for (path, count) in &sample.paths {
                *total.entry(path.clone()).or_default() += count;
            }
        }
        if total.is_empty() {
            "none published".to_owned()
        } else {
            total
                .iter()
                .map(|(path, count)| format!("{path} x{count}"))
                .collect::<Vec<_>>()
                .join(" ")
        }
    }

    fn to_json(&self) -> Value {
        let variants: serde_json::Map<String, Value> = self
            .variants
            .iter()
            .map(|&variant| {
                let rounds: Vec<Value> = self
                    .rounds
                    .iter()
                    .map(|round| {
                        round
                            .get(&variant)
                            .and_then(Option::as_ref)
                            .map_or(Value::Null, Sample::to_json)
                    })
                    .collect();
                let samples = self.samples(variant);
                let per_op = |cpu: fn(&Sample) -> u64| {
                    median(
                        samples
                            .iter()
                            .map(|s| cpu(s) as f64 / s.reported.ops.max(f64::MIN_POSITIVE))
                            .collect(),
                    )
                };
                let summary = json!({
                    "value_median": median(samples.iter().map(|s| s.reported.value).collect()),
                    "p50_us_median": median(samples.iter().filter_map(|s| s.reported.p50_us).collect()),
                    "p99_us_median": median(samples.iter().filter_map(|s| s.reported.p99_us).collect()),
                    "client_cpu_ns_per_op": per_op(|s| s.client_cpu_ns),
                    "server_cpu_ns_per_op": per_op(|s| s.server_cpu_ns),
                    "path": self.paths_seen(variant),
                    "rounds": rounds,
                });
                (variant.label().to_owned(), summary)
            })
            .collect();
        let ratios: serde_json::Map<String, Value> = self
            .variants
            .iter()
            .filter(|&&v| v != Variant::Tcp)
            .filter_map(|&variant| {
                let all = self.ratios(variant);
                let s = spread(all.clone())?;
                Some((
                    variant.label().to_owned(),
                    json!({ "median": s.median, "min": s.min, "max": s.max, "per_round": all }),
                ))
            })
            .collect();
        json!({
            "name": self.name,
            "unit": self.unit,
            "op": self.op,
            "skipped": self.skipped,
            "ratios_vs_tcp": ratios,
            "variants": variants,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Processes: servers in process groups, clients measured with wait4
// ---------------------------------------------------------------------------------------------

struct Context {
    exe: PathBuf,
    library: PathBuf,
    sandbox: Sandbox,
    quick: bool,
    rounds: usize,
}

impl Context {
    fn segment_dir(&self) -> PathBuf {
        self.sandbox.segment_dir().to_path_buf()
    }

    /// `program` with the benchmark's private sandirect environment, preloaded or not, in a
    /// process group of its own.
    fn command(&self, program: impl AsRef<std::ffi::OsStr>, preloaded: bool) -> Command {
        let mut command = Command::new(program);
        command
            .env_remove("LD_PRELOAD")
            .env_remove("SANDIRECT_CONFIG")
            .env_remove("SANDIRECT_MODE")
            .env("SANDIRECT_STAT_DIR", self.sandbox.stat_dir())
            .env("SANDIRECT_SHM_DIR", self.segment_dir())
            .current_dir(self.sandbox.path())
            .stdin(Stdio::null())
            .process_group(0);
        if preloaded {
            command.env("LD_PRELOAD", &self.library);
        }
        command
    }

    /// A duration-based run's length (wrk, iperf3, this binary's clients).
    fn run_seconds(&self) -> u64 {
        if self.quick {
            1
        } else {
            3
        }
    }

    /// A count-based run's size: `quick` in the quick mode, four times that otherwise.
    fn count(&self, quick: u64) -> u64 {
        if self.quick {
            quick
        } else {
            quick * 4
        }
    }
}

/// Process groups this benchmark started and has not reaped yet (servers and the running load
/// generator): they are not in the terminal's foreground group, so an interrupted benchmark
/// kills them itself.
static GROUPS: [std::sync::atomic::AtomicI32; 4] =
    [const { std::sync::atomic::AtomicI32::new(0) }; 4];

fn register_group(group: i32) {
    use std::sync::atomic::Ordering;
    for slot in &GROUPS {
        if slot
            .compare_exchange(0, group, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return;
        }
    }
}

fn unregister_group(group: i32) {
    use std::sync::atomic::Ordering;
    for slot in &GROUPS {
        let _ = slot.compare_exchange(group, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

extern "C" fn on_interrupt(signal: libc::c_int) {
    use std::sync::atomic::Ordering;
    for slot in &GROUPS {
        let group = slot.load(Ordering::Acquire);
        if group > 0 {
            // SAFETY: kill is async-signal-safe; the group is one this benchmark started.
            unsafe { libc::kill(-group, libc::SIGKILL) };
        }
    }
    // SAFETY: async-signal-safe calls: back to the default action, then die of the signal.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

fn kill_groups_on_interrupt() {
    for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only makes async-signal-safe calls.
        unsafe {
            libc::signal(
                signal,
                on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t,
            )
        };
    }
}

/// A server in its own process group, killed with the group when dropped.
struct Server {
    child: Child,
    log: PathBuf,
}

impl Server {
    fn start(context: &Context, name: &str, mut command: Command, port: u16) -> io::Result<Server> {
        let log = context.sandbox.path().join(format!("{name}.log"));
        let file = std::fs::File::create(&log)?;
        command.stdout(file.try_clone()?).stderr(file);
        let child = command.spawn()?;
        register_group(child.id() as i32);
        let mut server = Server { child, log };
        // Wait for the listening socket to appear, without connecting to it (a probe
        // connection would be a bogus client to iperf3).
        let deadline = Instant::now() + Duration::from_secs(20);
        while !listening(port) {
            if let Ok(Some(status)) = server.child.try_wait() {
                return Err(io::Error::other(format!(
                    "{name} exited ({status}) before listening: {}",
                    server.log_tail()
                )));
            }
            if Instant::now() > deadline {
                return Err(io::Error::other(format!(
                    "{name} did not listen on {port} within 20 s: {}",
                    server.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }

    /// CPU time (user + system) of every live process of the server's group, in ns.
    fn cpu_ns(&self) -> u64 {
        group_cpu_ns(self.child.id() as i32)
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        kill_group_of(&mut self.child);
    }
}

/// Kills `child`'s process group (it leads one of its own: `process_group(0)`, so the signal
/// reaches only processes this benchmark started) and reaps it.
fn kill_group_of(child: &mut Child) {
    let group = child.id() as libc::pid_t;
    // SAFETY: plain kill(2) of a group this benchmark started.
    unsafe { libc::kill(-group, libc::SIGKILL) };
    let _ = child.wait();
    unregister_group(group);
}

/// Whether a socket listens on `port` (any local address, IPv4 or IPv6), per /proc/net.
fn listening(port: u16) -> bool {
    let suffix = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table).is_ok_and(|table| {
            table.lines().skip(1).any(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                fields.len() > 3 && fields[3] == "0A" && fields[1].ends_with(&suffix)
            })
        })
    })
}

fn clock_ticks_per_second() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as u64
    } else {
        100
    }
}

/// utime + stime (ns) of the processes whose process group is `group`.
fn group_cpu_ns(group: i32) -> u64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut total = 0;
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        if let Some((pgrp, cpu_ns)) = stat_group_and_cpu(&stat) {
            if pgrp == group {
                total += cpu_ns;
            }
        }
    }
    total
}

/// The process group and the utime + stime (ns) of a `/proc/PID/stat` line.
fn stat_group_and_cpu(stat: &str) -> Option<(i32, u64)> {
    let tick_ns = 1_000_000_000 / clock_ticks_per_second();
    // Fields after the parenthesised command name (which may hold spaces): state(3) ppid(4)
    // pgrp(5) ... utime(14) stime(15).
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if fields.len() <= 12 {
        return None;
    }
    let ticks = |i: usize| fields[i].parse::<u64>().unwrap_or(0);
    Some((fields[2].parse().ok()?, (ticks(11) + ticks(12)) * tick_ns))
}

/// What a finished client printed and cost.
struct ClientRun {
    stdout: String,
    elapsed: Duration,
    cpu_ns: u64,
}

/// Runs a load generator to completion within `timeout` (its group killed after it), with its
/// resource usage from `wait4` (which includes the children it waited for).
fn run_client(mut command: Command, timeout: Duration) -> Result<ClientRun, String> {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = command.spawn().map_err(|e| format!("start: {e}"))?;
    let pid = child.id() as libc::pid_t;
    register_group(pid);
    let result = wait_client(&mut child, pid, started, timeout);
    unregister_group(pid);
    result
}

fn wait_client(
    child: &mut Child,
    pid: libc::pid_t,
    started: Instant,
    timeout: Duration,
) -> Result<ClientRun, String> {
    let mut stdout = child.stdout.take().ok_or("no stdout")?;
    let mut stderr = child.stderr.take().ok_or("no stderr")?;
    let out = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        text
    });
    let err = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let deadline = started + timeout;
    let (status, usage, elapsed) = loop {
        let mut status = 0;
        // SAFETY: an all-zero rusage is valid; wait4 fills it.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: our own child, valid pointers; WNOHANG never blocks.
        let reaped = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if reaped == pid {
            break (status, usage, started.elapsed());
        }
        if reaped < 0 {
            return Err(format!("wait4: {}", io::Error::last_os_error()));
        }
        if Instant::now() > deadline {
            // SAFETY: the client leads its own process group; this kills only it.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            // SAFETY: reaping our own killed child.
            unsafe { libc::waitpid(pid, &mut status, 0) };
            return Err(format!("did not finish within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    // Whatever the client left in its group goes with it.
    // SAFETY: as above, only the client's own group.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    if !(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0) {
        let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
        return Err(format!("exit status {status:#x}: {}", tail.join(" | ")));
    }
    let ns = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1_000;
    Ok(ClientRun {
        stdout,
        elapsed,
        cpu_ns: ns(usage.ru_utime) + ns(usage.ru_stime),
    })
}

/// A port for a server, below the ephemeral range: the churn workloads leave tens of
/// thousands of connections in TIME_WAIT there, and a port-0 bind can then find none free.
fn free_port() -> io::Result<u16> {
    let mut candidate = (std::process::id() as u16).wrapping_mul(7919) % 12_000;
    for _ in 0..200 {
        candidate = (candidate + 61) % 12_000;
        if let Ok(listener) = TcpListener::bind((Ipv4Addr::LOCALHOST, 20_000 + candidate)) {
            return Ok(listener.local_addr()?.port());
        }
    }
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

fn find_program(program: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .map(|dir| dir.join(program))
        .find(|path| path.is_file())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

// ---------------------------------------------------------------------------------------------
// Workloads
// ---------------------------------------------------------------------------------------------

type ServerFn = dyn Fn(&Context, u16, bool) -> io::Result<Command>;
type ClientFn = dyn Fn(&Context, u16, bool) -> Command;
type ParseFn = dyn Fn(&str) -> Option<Reported>;

struct Workload {
    name: String,
    unit: &'static str,
    op: &'static str,
    /// Programs that must be installed (the first missing one skips the workload).
    programs: Vec<&'static str>,
    variants: &'static [Variant],
    server: Box<ServerFn>,
    client: Box<ClientFn>,
    parse: Box<ParseFn>,
    /// How long a client run may take before it counts as failed.
    timeout: Duration,
    /// One unmeasured client run against each server first (a JIT warms up, a runtime loads).
    warm_up: bool,
    /// A program that runs beside the servers for all the workload's rounds (a CPU hog).
    beside: Option<Box<BesideFn>>,
}

type BesideFn = dyn Fn(&Context) -> Command;

/// `workload` with both ends (every process of the server, and the client) on CPU `cpu`
/// alone: a request/response pair that cannot run on two CPUs at once.
fn on_one_cpu(workload: Workload, cpu: &'static str) -> Workload {
    let Workload { server, client, .. } = workload;
    Workload {
        name: format!("{}, both ends on one CPU", workload.name),
        programs: [workload.programs.as_slice(), &["taskset"]].concat(),
        server: Box::new(move |context: &Context, port, preloaded| {
            server(context, port, preloaded).map(|command| on_cpu(cpu, command))
        }),
        client: Box::new(move |context: &Context, port, preloaded| {
            on_cpu(cpu, client(context, port, preloaded))
        }),
        ..workload
    }
}

/// `workload` with a CPU hog (a busy shell loop) pinned to CPU `cpu` for all its rounds: the
/// ends share the other CPU with whatever else runs, as on a loaded host.
fn beside_a_hog(workload: Workload, cpu: &'static str) -> Workload {
    Workload {
        name: format!("{}, beside a CPU hog", workload.name),
        programs: [workload.programs.as_slice(), &["taskset"]].concat(),
        beside: Some(Box::new(move |context: &Context| {
            let mut command = context.command("taskset", false);
            command.args(["-c", cpu, "sh", "-c", "while :; do :; done"]);
            command
        })),
        ..workload
    }
}

/// `command` run by `taskset -c cpu`, with its environment and directory (standard input
/// closed, in a process group of its own, as `Context::command` makes them).
fn on_cpu(cpu: &str, command: Command) -> Command {
    let mut pinned = Command::new("taskset");
    pinned
        .args(["-c", cpu])
        .arg(command.get_program())
        .args(command.get_args())
        .stdin(Stdio::null())
        .process_group(0);
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => pinned.env(key, value),
            None => pinned.env_remove(key),
        };
    }
    if let Some(dir) = command.get_current_dir() {
        pinned.current_dir(dir);
    }
    pinned
}

/// A program running beside a workload, in a process group of its own, killed with the group
/// when dropped.
struct Beside {
    child: Child,
}

impl Beside {
    fn start(mut command: Command) -> io::Result<Beside> {
        use std::os::unix::process::CommandExt;
        // SAFETY: between fork and exec the closure makes one async-signal-safe system call.
        // A benchmark killed outright (no destructor runs) must not leave a CPU hog behind: it
        // dies with the thread that started it.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        register_group(child.id() as i32);
        Ok(Beside { child })
    }
}

impl Drop for Beside {
    fn drop(&mut self) {
        kill_group_of(&mut self.child);
    }
}

fn redis_server(context: &Context, port: u16, preloaded: bool) -> io::Result<Command> {
    let mut command = context.command("redis-server", preloaded);
    command
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--daemonize", "no", "--protected-mode", "no"])
        .arg("--port")
        .arg(port.to_string());
    Ok(command)
}

/// redis-benchmark `--csv` rows: `"TEST","RPS","avg","min","p50","p95","p99","max"` (ms).
/// The figure is the combined throughput of the tests (requests over the sum of their
/// times); latencies are the last test's (GET).
fn parse_redis(requests_per_test: u64) -> Box<ParseFn> {
    Box::new(move |stdout: &str| {
        let mut seconds = 0.0;
        let mut tests = 0;
        let mut latency = (None, None);
        for line in stdout.lines() {
            let fields: Vec<&str> = line.split(',').map(|f| f.trim_matches('"')).collect();
            if fields.len() < 7 || fields[0] == "test" {
                continue;
            }
            let rps: f64 = fields[1].parse().ok()?;
            if rps <= 0.0 {
                return None;
            }
            seconds += requests_per_test as f64 / rps;
            tests += 1;
            let ms = |i: usize| fields[i].parse::<f64>().ok().map(|v| v * 1e3);
            latency = (ms(4), ms(6));
        }
        let ops = (tests * requests_per_test) as f64;
        (tests > 0).then(|| Reported {
            value: ops / seconds,
            ops,
            p50_us: latency.0,
            p99_us: latency.1,
        })
    })
}

fn redis_workload(
    name: &str,
    tests: &'static str,
    args: &'static [&'static str],
    requests: u64,
    variants: &'static [Variant],
) -> Workload {
    let per_test = requests;
    Workload {
        name: name.to_owned(),
        unit: "req/s",
        op: "request",
        programs: vec!["redis-server", "redis-benchmark"],
        variants,
        server: Box::new(redis_server),
        client: Box::new(move |context: &Context, port, preloaded| {
            let mut command = context.command("redis-benchmark", preloaded);
            command
                .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", tests])
                .args(["-n", &per_test.to_string(), "--csv", "-q"])
                .args(args);
            command
        }),
        parse: parse_redis(per_test),
        timeout: Duration::from_secs(120),
        warm_up: false,
        beside: None,
    }
}

fn nginx_config(root: &Path, port: u16, workers: u32) -> String {
    let user = if is_root() {
        // Workers of a root master switch to `nobody`, who could not read the private
        // sandbox: keep them root.
        "user root root;"
    } else {
        ""
    };
    let root = root.display();
    format!(
        r#"daemon off;
master_process on;
worker_processes {workers};
{user}
pid {root}/nginx-{port}.pid;
error_log {root}/nginx-{port}.error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/tmp/body;
    proxy_temp_path {root}/tmp/proxy;
    fastcgi_temp_path {root}/tmp/fastcgi;
    uwsgi_temp_path {root}/tmp/uwsgi;
    scgi_temp_path {root}/tmp/scgi;
    default_type application/octet-stream;
    sendfile on;
    server {{
        listen 127.0.0.1:{port};
        root {root}/www;
    }}
}}
"#
    )
}

fn nginx_server(
    context: &Context,
    port: u16,
    preloaded: bool,
    workers: u32,
) -> io::Result<Command> {
    let root = context.sandbox.path();
    std::fs::create_dir_all(root.join("tmp"))?;
    std::fs::create_dir_all(root.join("www"))?;
    for (name, bytes) in [("1k.bin", 1usize << 10), ("64k.bin", 64 << 10)] {
        let body: Vec<u8> = (0..bytes).map(|i| (i * 131 % 251) as u8).collect();
        std::fs::write(root.join("www").join(name), body)?;
    }
    let config = root.join(format!("nginx-{port}.conf"));
    std::fs::write(&config, nginx_config(root, port, workers))?;
    let mut command = context.command("nginx", preloaded);
    command
        .arg("-p")
        .arg(root)
        .arg("-e")
        .arg(root.join(format!("nginx-{port}.error.log")))
        .arg("-c")
        .arg(config);
    Ok(command)
}

/// A wrk latency figure: "123.45us", "1.20ms", "2.00s".
fn wrk_duration_us(text: &str) -> Option<f64> {
    let split = text.find(|c: char| c.is_ascii_alphabetic())?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number.parse().ok()?;
    Some(match unit {
        "us" => number,
        "ms" => number * 1e3,
        "s" => number * 1e6,
        "m" => number * 60e6,
        _ => return None,
    })
}

/// wrk --latency: "Requests/sec: X", "N requests in T", "50%  L", "99%  L".
fn parse_wrk(stdout: &str) -> Option<Reported> {
    let mut reported = Reported::default();
    for line in stdout.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields.as_slice() {
            ["Requests/sec:", rate] => reported.value = rate.parse().ok()?,
            [count, "requests", "in", ..] => reported.ops = count.parse().ok()?,
            ["50%", latency] => reported.p50_us = wrk_duration_us(latency),
            ["99%", latency] => reported.p99_us = wrk_duration_us(latency),
            _ => {}
        }
    }
    (reported.value > 0.0 && reported.ops > 0.0).then_some(reported)
}

fn nginx_workload(name: &str, document: &'static str, connections: u32, workers: u32) -> Workload {
    Workload {
        name: name.to_owned(),
        unit: "req/s",
        op: "request",
        programs: vec!["nginx", "wrk"],
        variants: APP_VARIANTS,
        server: Box::new(move |context: &Context, port, preloaded| {
            nginx_server(context, port, preloaded, workers)
        }),
        client: Box::new(move |context: &Context, port, preloaded| {
            let mut command = context.command("wrk", preloaded);
            command
                .args(["-t", "1", "-c", &connections.to_string()])
                .args(["-d", &format!("{}s", context.run_seconds()), "--latency"])
                .arg(format!("http://127.0.0.1:{port}/{document}"));
            command
        }),
        parse: Box::new(parse_wrk),
        timeout: Duration::from_secs(60),
        warm_up: false,
        beside: None,
    }
}

fn memcached_workload(context: &Context) -> Workload {
    let per_thread = context.count(5_000);
    Workload {
        name: "memcached -t 4, memcslap get -c 4".to_owned(),
        unit: "get/s",
        op: "get",
        programs: vec!["memcached", "memcslap"],
        variants: APP_VARIANTS,
        server: Box::new(|context: &Context, port, preloaded| {
            let mut command = context.command("memcached", preloaded);
            command.args([
                "-l",
                "127.0.0.1",
                "-t",
                "4",
                "-U",
                "0",
                "-p",
                &port.to_string(),
            ]);
            if is_root() {
                command.args(["-u", "root"]);
            }
            Ok(command)
        }),
        client: Box::new(move |context: &Context, port, preloaded| {
            let mut command = context.command("memcslap", preloaded);
            command
                .arg(format!("--servers=127.0.0.1:{port}"))
                .args(["--test=get", "--concurrency=4"])
                .arg(format!("--execute-number={per_thread}"));
            command
        }),
        // "Time to get   N keys by   T threads:   X seconds."
        parse: Box::new(|stdout: &str| {
            let line = stdout.lines().find(|l| l.starts_with("Time to get"))?;
            let fields: Vec<&str> = line.split_whitespace().collect();
            let keys: f64 = fields.get(3)?.parse().ok()?;
            let seconds: f64 = fields.iter().rev().nth(1)?.parse().ok()?;
            (keys > 0.0 && seconds > 0.0).then_some(Reported {
                value: keys / seconds,
                ops: keys,
                p50_us: None,
                p99_us: None,
            })
        }),
        timeout: Duration::from_secs(120),
        warm_up: false,
        beside: None,
    }
}

/// iperf3 with `extra` client arguments (its default: one stream of 128 KiB writes); the
/// figure is every byte received, both ways with `--bidir`.
fn iperf3_workload(
    name: &str,
    extra: &'static [&'static str],
    variants: &'static [Variant],
) -> Workload {
    Workload {
        name: name.to_owned(),
        unit: "Gbit/s",
        op: "GB",
        programs: vec!["iperf3"],
        variants,
        server: Box::new(|context: &Context, port, preloaded| {
            let mut command = context.command("iperf3", preloaded);
            command.args(["-s", "-B", "127.0.0.1", "-p", &port.to_string()]);
            Ok(command)
        }),
        client: Box::new(move |context: &Context, port, preloaded| {
            let mut command = context.command("iperf3", preloaded);
            command
                .args(["-c", "127.0.0.1", "-p", &port.to_string(), "-J"])
                .args(["-t", &context.run_seconds().to_string()])
                .args(extra);
            command
        }),
        parse: Box::new(|stdout: &str| {
            let report: Value = serde_json::from_str(stdout).ok()?;
            let end = &report["end"];
            let mut bits = end["sum_received"]["bits_per_second"].as_f64()?;
            let mut bytes = end["sum_received"]["bytes"].as_f64()?;
            let reverse = &end["sum_received_bidir_reverse"];
            if let (Some(reverse_bits), Some(reverse_bytes)) = (
                reverse["bits_per_second"].as_f64(),
                reverse["bytes"].as_f64(),
            ) {
                bits += reverse_bits;
                bytes += reverse_bytes;
            }
            Some(Reported {
                value: bits / 1e9,
                ops: bytes / 1e9,
                p50_us: None,
                p99_us: None,
            })
        }),
        timeout: Duration::from_secs(60),
        warm_up: false,
        beside: None,
    }
}

/// `connections` connections to one redis server at once, each asking for its own value and
/// checking every byte of the reply (this binary's `scale` client). The SAN memory budget is
/// raised so that every connection takes the SAN: whether a request costs the same with
/// thousands of SAN connections in one event loop as with a few.
fn scale_workload(connections: usize) -> Workload {
    const BUDGET: (&str, &str) = ("SANDIRECT_SAN_MEMORY_MB", "1000000");
    Workload {
        name: format!("redis GET, {connections} connections, every reply checked"),
        unit: "req/s",
        op: "request",
        programs: vec!["redis-server"],
        variants: APP_VARIANTS,
        server: Box::new(|context: &Context, port, preloaded| {
            let mut command = redis_server(context, port, preloaded)?;
            // Room for its clients and, for each SAN connection, eight descriptors of ours in
            // half its limit (redis sets its limit from `maxclients`).
            command
                .args(["--maxclients", "19000"])
                .env(BUDGET.0, BUDGET.1);
            Ok(command)
        }),
        client: Box::new(move |context: &Context, port, preloaded| {
            let mut command = context.command(&context.exe, preloaded);
            let seconds = if context.quick { "0.5" } else { "2" };
            command
                .args(["--role", "scale", "--port", &port.to_string()])
                .args(["--seconds", seconds, "--connections"])
                .arg(connections.to_string())
                .env(BUDGET.0, BUDGET.1);
            command
        }),
        parse: Box::new(parse_own),
        timeout: Duration::from_secs(120),
        warm_up: false,
        beside: None,
    }
}

/// A client of this binary: `bench --role ROLE --port P --seconds S`.
fn own_client(role: &'static str) -> Box<ClientFn> {
    Box::new(move |context: &Context, port, preloaded| {
        let mut command = context.command(&context.exe, preloaded);
        let seconds = if context.quick { "0.5" } else { "2" };
        command.args([
            "--role",
            role,
            "--port",
            &port.to_string(),
            "--seconds",
            seconds,
        ]);
        command
    })
}

/// This binary's clients print `result OPS ELAPSED_NS P50_NS P99_NS`.
fn parse_own(stdout: &str) -> Option<Reported> {
    let line = stdout.lines().find(|l| l.starts_with("result "))?;
    let fields: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let [ops, elapsed_ns, p50_ns, p99_ns] = fields[..] else {
        return None;
    };
    (ops > 0.0).then_some(Reported {
        value: ops * 1e9 / elapsed_ns,
        ops,
        p50_us: Some(p50_ns / 1e3),
        p99_us: Some(p99_ns / 1e3),
    })
}

const NODE_ECHO: &str = r#"
const net = require('net');
const server = net.createServer((socket) => {
  socket.setNoDelay(true);
  socket.on('data', (data) => socket.write(data));
  socket.on('error', () => {});
});
server.listen(Number(process.argv[2]), '127.0.0.1');
"#;

const JAVA_ECHO: &str = r#"
import java.io.IOException;
import java.net.InetSocketAddress;
import java.net.StandardSocketOptions;
import java.nio.ByteBuffer;
import java.nio.channels.*;
import java.util.Iterator;

/** A single-threaded NIO selector echo server. */
public class Echo {
    public static void main(String[] args) throws IOException {
        Selector selector = Selector.open();
        ServerSocketChannel server = ServerSocketChannel.open();
        server.bind(new InetSocketAddress("127.0.0.1", Integer.parseInt(args[0])));
        server.configureBlocking(false);
        server.register(selector, SelectionKey.OP_ACCEPT);
        while (true) {
            selector.select();
            Iterator<SelectionKey> keys = selector.selectedKeys().iterator();
            while (keys.hasNext()) {
                SelectionKey key = keys.next();
                keys.remove();
                try {
                    if (key.isAcceptable()) {
                        SocketChannel client = server.accept();
                        if (client == null) continue;
                        client.configureBlocking(false);
                        client.setOption(StandardSocketOptions.TCP_NODELAY, true);
                        client.register(selector, SelectionKey.OP_READ, ByteBuffer.allocateDirect(65536));
                        continue;
                    }
                    SocketChannel client = (SocketChannel) key.channel();
                    ByteBuffer buffer = (ByteBuffer) key.attachment();
                    if (key.isReadable() && client.read(buffer) < 0) {
                        key.cancel();
                        client.close();
                        continue;
                    }
                    buffer.flip();
                    client.write(buffer);
                    buffer.compact();
                    // Wait for room only while unsent bytes remain.
                    key.interestOps(buffer.position() > 0 ? SelectionKey.OP_WRITE : SelectionKey.OP_READ);
                } catch (IOException e) {
                    key.cancel();
                    key.channel().close();
                }
            }
        }
    }
}
"#;

fn echo_workload(name: &str, programs: Vec<&'static str>, server: Box<ServerFn>) -> Workload {
    Workload {
        name: name.to_owned(),
        unit: "round trips/s",
        op: "round trip",
        programs,
        variants: APP_VARIANTS,
        server,
        client: own_client("rtt"),
        parse: Box::new(parse_own),
        timeout: Duration::from_secs(60),
        warm_up: true,
        beside: None,
    }
}

fn workloads(context: &Context) -> Vec<Workload> {
    let redis = |quick: u64| context.count(quick);
    vec![
        redis_workload(
            "redis GET+SET -c 1 -P 1",
            "set,get",
            &["-c", "1", "-P", "1"],
            redis(8_000),
            APP_VARIANTS,
        ),
        on_one_cpu(
            redis_workload(
                "redis GET+SET -c 1 -P 1",
                "set,get",
                &["-c", "1", "-P", "1"],
                redis(8_000),
                PAIR_VARIANTS,
            ),
            "0",
        ),
        beside_a_hog(
            redis_workload(
                "redis GET+SET -c 1 -P 1",
                "set,get",
                &["-c", "1", "-P", "1"],
                redis(8_000),
                PAIR_VARIANTS,
            ),
            "1",
        ),
        redis_workload(
            "redis GET+SET -c 50 -P 1",
            "set,get",
            &["-c", "50", "-P", "1"],
            redis(40_000),
            APP_VARIANTS,
        ),
        redis_workload(
            "redis GET+SET -c 50 -P 16",
            "set,get",
            &["-c", "50", "-P", "16", "--threads", "2"],
            redis(200_000),
            APP_VARIANTS,
        ),
        // Many connections at once: whether a request costs the same with 1000 connections
        // in the server's event loop as with 50 (and which of them the SAN takes).
        redis_workload(
            "redis GET+SET -c 1000 -P 1",
            "set,get",
            &["-c", "1000", "-P", "1"],
            redis(40_000),
            APP_VARIANTS,
        ),
        scale_workload(1_000),
        nginx_workload("nginx + wrk 1 KiB -c 10", "1k.bin", 10, 1),
        nginx_workload("nginx (2 workers) + wrk 1 KiB -c 10", "1k.bin", 10, 2),
        nginx_workload("nginx + wrk 64 KiB -c 10", "64k.bin", 10, 1),
        memcached_workload(context),
        iperf3_workload("iperf3 (128 KiB writes)", &[], APP_VARIANTS),
        iperf3_workload("iperf3 -l 16K", &["-l", "16K"], PAIR_VARIANTS),
        iperf3_workload("iperf3 -P 4", &["-P", "4"], PAIR_VARIANTS),
        iperf3_workload("iperf3 --bidir", &["--bidir"], PAIR_VARIANTS),
        echo_workload(
            "node echo 64 B",
            vec!["node"],
            Box::new(|context: &Context, port, preloaded| {
                let script = context.sandbox.path().join("echo.js");
                std::fs::write(&script, NODE_ECHO)?;
                let mut command = context.command("node", preloaded);
                command.arg(script).arg(port.to_string());
                Ok(command)
            }),
        ),
        echo_workload(
            "Java NIO echo 64 B",
            vec!["java", "javac"],
            Box::new(|context: &Context, port, preloaded| {
                let classes = context.sandbox.path().join("java");
                if !classes.join("Echo.class").is_file() {
                    std::fs::create_dir_all(&classes)?;
                    std::fs::write(classes.join("Echo.java"), JAVA_ECHO)?;
                    let status = Command::new("javac")
                        .arg("-d")
                        .arg(&classes)
                        .arg(classes.join("Echo.java"))
                        .status()?;
                    if !status.success() {
                        return Err(io::Error::other("javac failed"));
                    }
                }
                let mut command = context.command("java", preloaded);
                command
                    .args(["-Djava.net.preferIPv4Stack=true", "-XX:+UseSerialGC", "-cp"])
                    .arg(classes)
                    .arg("Echo")
                    .arg(port.to_string());
                Ok(command)
            }),
        ),
        echo_workload(
            "fork-per-connection echo 64 B",
            vec![],
            Box::new(|context: &Context, port, preloaded| {
                let mut command = context.command(&context.exe, preloaded);
                command.args(["--role", "fork-echo", "--port", &port.to_string()]);
                Ok(command)
            }),
        ),
        Workload {
            name: "connect + 1 request + close (redis)".to_owned(),
            unit: "conn/s",
            op: "connection",
            programs: vec!["redis-server"],
            variants: SETUP_VARIANTS,
            server: Box::new(redis_server),
            client: own_client("churn"),
            parse: Box::new(parse_own),
            timeout: Duration::from_secs(60),
            warm_up: false,
            beside: None,
        },
        redis_workload(
            "redis-benchmark -k 0 -c 10 GET",
            "get",
            &["-c", "10", "-k", "0"],
            redis(1_000),
            SETUP_VARIANTS,
        ),
    ]
}

/// Runs one workload: both servers up, then `rounds` rounds of every variant's client in a
/// rotating order.
fn run_workload(context: &Context, workload: &Workload) -> Outcome {
    if let Some(missing) = workload.programs.iter().find(|p| find_program(p).is_none()) {
        return Outcome::skipped(
            &workload.name,
            workload.unit,
            format!("skipped: not installed ({missing})"),
        );
    }
    let mut outcome = Outcome {
        name: workload.name.clone(),
        unit: workload.unit,
        op: workload.op,
        variants: workload.variants.to_vec(),
        rounds: Vec::new(),
        skipped: None,
        path_labels: BTreeMap::new(),
    };
    let _beside = match workload
        .beside
        .as_ref()
        .map(|beside| Beside::start(beside(context)))
    {
        Some(Err(error)) => {
            outcome.skipped = Some(format!("could not start what runs beside it: {error}"));
            return outcome;
        }
        Some(Ok(beside)) => Some(beside),
        None => None,
    };
    let start = |preloaded: bool| -> Result<(Server, u16), String> {
        let port = free_port().map_err(|e| e.to_string())?;
        let command = (workload.server)(context, port, preloaded).map_err(|e| e.to_string())?;
        let name = if preloaded { "preloaded" } else { "plain" };
        Server::start(context, &format!("server-{port}-{name}"), command, port)
            .map(|server| (server, port))
            .map_err(|e| e.to_string())
    };
    let (mut plain, mut preloaded) = match (start(false), start(true)) {
        (Ok(plain), Ok(preloaded)) => (plain, preloaded),
        (Err(error), _) | (_, Err(error)) => {
            outcome.skipped = Some(format!("could not start the server: {error}"));
            return outcome;
        }
    };
    let variants = workload.variants;
    if workload.warm_up {
        for (variant, port) in [(Variant::Tcp, plain.1), (Variant::Sandirect, preloaded.1)] {
            let command = (workload.client)(context, port, variant.client_preloaded());
            if let Err(error) = run_client(command, workload.timeout) {
                eprintln!("  {}: warm-up {}: {error}", workload.name, variant.label());
            }
        }
    }
    for round in 0..context.rounds {
        let mut row = BTreeMap::new();
        for offset in 0..variants.len() {
            let variant = variants[(round + offset) % variants.len()];
            let (server, port) = if variant.server_preloaded() {
                (&mut preloaded.0, preloaded.1)
            } else {
                (&mut plain.0, plain.1)
            };
            if !server.alive() {
                eprintln!(
                    "  {}: {} server died: {}",
                    workload.name,
                    variant.label(),
                    server.log_tail()
                );
                row.insert(variant, None);
                continue;
            }
            let mut command = (workload.client)(context, port, variant.client_preloaded());
            command.envs(variant.client_env().iter().copied());
            let recorder = PathRecorder::start(&context.sandbox, Duration::from_millis(100));
            let server_cpu = server.cpu_ns();
            let result = run_client(command, workload.timeout);
            let server_cpu = server.cpu_ns().saturating_sub(server_cpu);
            let observed = recorder.finish();
            let sample = result.and_then(|run| {
                let reported = (workload.parse)(&run.stdout).ok_or_else(|| {
                    let tail: Vec<&str> = run.stdout.lines().rev().take(4).collect();
                    format!("unreadable output: {}", tail.join(" | "))
                })?;
                let mut paths = BTreeMap::new();
                for connection in observed.iter().map(|c| &c.info).filter(|c| {
                    (c.local.is_some_and(|a| a.port() == port)
                        || c.peer.is_some_and(|a| a.port() == port))
                        && application_bytes(c) != (0, 0)
                }) {
                    *paths
                        .entry(connection.path.label().to_owned())
                        .or_insert(0u32) += 1;
                }
                Ok(Sample {
                    reported,
                    elapsed_s: run.elapsed.as_secs_f64(),
                    client_cpu_ns: run.cpu_ns,
                    server_cpu_ns: server_cpu,
                    paths,
                })
            });
            match sample {
                Ok(sample) => {
                    row.insert(variant, Some(sample));
                }
                Err(error) => {
                    eprintln!(
                        "  {} round {round}: {}: {error}",
                        workload.name,
                        variant.label()
                    );
                    row.insert(variant, None);
                }
            }
        }
        outcome.rounds.push(row);
    }
    outcome
}

/// Runs `bench_sockets` and folds its raw figures into one outcome per test.
fn run_socket_benchmarks(context: &Context) -> Vec<Outcome> {
    let Some(binary) = context.exe.parent().map(|d| d.join("bench_sockets")) else {
        return Vec::new();
    };
    if !binary.is_file() {
        return vec![Outcome::skipped(
            "sockets",
            "",
            format!("skipped: {} is not built", binary.display()),
        )];
    }
    let json_path = context.sandbox.path().join("sockets.json");
    let mut command = Command::new(&binary);
    command
        .arg("--preload")
        .arg(&context.library)
        .arg("--json")
        .arg(&json_path)
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    if context.quick {
        command.arg("--quick");
    } else {
        command.args(["--seconds", "40"]);
    }
    match command.status() {
        Ok(status) if status.success() => {}
        other => {
            return vec![Outcome::skipped(
                "sockets",
                "",
                format!("bench_sockets failed: {other:?}"),
            )]
        }
    }
    let Some(report) = std::fs::read_to_string(&json_path)
        .ok()
        .and_then(|text| serde_json::from_str::<Value>(&text).ok())
    else {
        return vec![Outcome::skipped(
            "sockets",
            "",
            "bench_sockets wrote no report".to_owned(),
        )];
    };
    let all_variants = [
        Variant::Tcp,
        Variant::Sandirect,
        Variant::Fallback,
        Variant::RawRing,
        Variant::ProcessVmReadv,
        Variant::YieldHandOff,
    ];
    let path_labels: BTreeMap<Variant, String> = all_variants
        .iter()
        .filter_map(|&v| {
            let label = report["paths"][v.label()].as_str()?;
            Some((v, label.to_owned()))
        })
        .collect();
    let tests = report["tests"].as_array().cloned().unwrap_or_default();
    tests
        .iter()
        .map(|test| {
            let rtt = test["kind"] == "rtt";
            let size = test["size"].as_f64().unwrap_or(0.0);
            // The variants this test has (each yardstick runs only the tests its target names).
            let variants: Vec<Variant> = all_variants
                .iter()
                .copied()
                .filter(|v| {
                    test["variants"]
                        .as_array()
                        .is_some_and(|labels| labels.iter().any(|l| l == v.label()))
                })
                .collect();
            let rounds = test["rounds"]
                .as_array()
                .map(|rounds| {
                    rounds
                        .iter()
                        .map(|round| {
                            variants
                                .iter()
                                .map(|&v| {
                                    let run = &round[v.label()];
                                    let number = |key: &str| run[key].as_u64();
                                    let sample = (|| {
                                        let count = number("count")? as f64;
                                        let elapsed_ns = number("elapsed_ns")? as f64;
                                        let per_message_ns = elapsed_ns / count.max(1.0);
                                        Some(Sample {
                                            reported: Reported {
                                                value: if rtt {
                                                    1e9 / per_message_ns
                                                } else {
                                                    size * 1e3 / per_message_ns
                                                },
                                                ops: count,
                                                p50_us: None,
                                                p99_us: None,
                                            },
                                            elapsed_s: elapsed_ns / 1e9,
                                            client_cpu_ns: number("client_cpu_ns")?,
                                            server_cpu_ns: number("server_cpu_ns")?,
                                            paths: BTreeMap::new(),
                                        })
                                    })();
                                    (v, sample)
                                })
                                .collect()
                        })
                        .collect()
                })
                .unwrap_or_default();
            Outcome {
                name: format!("sockets {}", test["name"].as_str().unwrap_or("?")),
                unit: if rtt { "round trips/s" } else { "MB/s" },
                op: "message",
                variants: variants.to_vec(),
                rounds,
                skipped: None,
                path_labels: path_labels.clone(),
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Clients of this binary
// ---------------------------------------------------------------------------------------------

fn percentile(sorted: &[u64], fraction: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let index = ((sorted.len() as f64 - 1.0) * fraction).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// `churn`: connect, one redis PING, close, until `seconds` pass; `rtt`: one connection,
/// 64-byte messages echoed back, until `seconds` pass; `scale`: `connections` redis
/// connections, each reading back its own value (see [`scale_client`]). Prints
/// `result OPS ELAPSED_NS P50 P99`.
fn role_main(
    role: &str,
    port: u16,
    seconds: f64,
    connections: usize,
    server_pid: Option<u32>,
) -> io::Result<()> {
    let budget = Duration::from_secs_f64(seconds);
    let mut latencies: Vec<u64> = Vec::with_capacity(1 << 16);
    let started = Instant::now();
    match role {
        "churn" => {
            let mut reply = [0u8; 7];
            while started.elapsed() < budget {
                let begin = Instant::now();
                let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port))?;
                stream.set_nodelay(true)?;
                stream.write_all(b"PING\r\n")?;
                stream.read_exact(&mut reply)?;
                if &reply != b"+PONG\r\n" {
                    return Err(io::Error::other("unexpected reply to PING"));
                }
                drop(stream);
                latencies.push(begin.elapsed().as_nanos() as u64);
            }
        }
        "rtt" => {
            let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port))?;
            stream.set_nodelay(true)?;
            let message = [0x5au8; 64];
            let mut echo = [0u8; 64];
            while started.elapsed() < budget {
                let begin = Instant::now();
                stream.write_all(&message)?;
                stream.read_exact(&mut echo)?;
                if echo != message {
                    return Err(io::Error::other("the echo differs from the message"));
                }
                latencies.push(begin.elapsed().as_nanos() as u64);
            }
        }
        "fork-echo" => return fork_echo_server(port),
        "scale" => return scale_client(port, connections, budget, server_pid),
        other => return Err(io::Error::other(format!("unknown role {other:?}"))),
    }
    let elapsed = started.elapsed().as_nanos();
    print_result(latencies, elapsed);
    Ok(())
}

/// `scale`: opens `connections` connections to a redis server, stores one value per
/// connection (its own key, a value derived from its index), then until `budget` passes asks
/// every connection for its value at once (one `GET` written on each) and reads every reply,
/// checking each byte. Prints `result OPS ELAPSED_NS P50 P99` of that loop alone (a request's
/// latency runs from its write to its reply read), and to stderr what the connections hold once
/// set up, idle (the bytes the segment directory, `SANDIRECT_SHM_DIR` else `/dev/shm`, and this
/// process's and the server's resident memory grew by, per connection) and the CPU time per
/// request of the loop, this process's and (with `server_pid`) the server's.
fn scale_client(
    port: u16,
    connections: usize,
    budget: Duration,
    server_pid: Option<u32>,
) -> io::Result<()> {
    let server_status = server_pid.map(|pid| PathBuf::from(format!("/proc/{pid}/status")));
    let server_rss_before = server_status.as_deref().map_or(0, resident_bytes);
    let segment_dir = std::env::var_os("SANDIRECT_SHM_DIR").unwrap_or_else(|| "/dev/shm".into());
    let shm_before = used_bytes(Path::new(&segment_dir));
    let rss_before = resident_bytes(Path::new("/proc/self/status"));
    let value = |index: usize| {
        format!(
            "{index:08x}:{:016x}",
            (index as u64 ^ 0x5eed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        )
    };
    let mut streams = Vec::with_capacity(connections);
    for index in 0..connections {
        let context =
            |error: io::Error| io::Error::new(error.kind(), format!("connection {index}: {error}"));
        let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).map_err(context)?;
        stream.set_nodelay(true).map_err(context)?;
        let (key, value) = (format!("scale:{index}"), value(index));
        write!(
            stream,
            "*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n{value}\r\n",
            key.len(),
            value.len()
        )
        .map_err(context)?;
        streams.push(stream);
    }
    let mut ok = [0u8; 5];
    for (index, stream) in streams.iter_mut().enumerate() {
        stream
            .read_exact(&mut ok)
            .map_err(|error| io::Error::new(error.kind(), format!("reply {index}: {error}")))?;
        if &ok != b"+OK\r\n" {
            return Err(io::Error::other("unexpected reply to SET"));
        }
    }
    let per_connection =
        |after: u64, before: u64| after.saturating_sub(before) / connections as u64;
    eprintln!(
        "idle memory per connection: segment directory {} bytes, client resident {} bytes, \
         server resident {} bytes",
        per_connection(used_bytes(Path::new(&segment_dir)), shm_before),
        per_connection(resident_bytes(Path::new("/proc/self/status")), rss_before),
        server_status.as_deref().map_or(0, |status| per_connection(
            resident_bytes(status),
            server_rss_before
        ))
    );
    let requests: Vec<Vec<u8>> = (0..connections)
        .map(|index| {
            let key = format!("scale:{index}");
            format!("*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n", key.len()).into_bytes()
        })
        .collect();
    let replies: Vec<Vec<u8>> = (0..connections)
        .map(|index| {
            let value = value(index);
            format!("${}\r\n{value}\r\n", value.len()).into_bytes()
        })
        .collect();
    let mut latencies = Vec::with_capacity(1 << 16);
    let mut written = vec![Instant::now(); connections];
    let mut reply = Vec::new();
    let server_stat = server_pid.map(|pid| PathBuf::from(format!("/proc/{pid}/stat")));
    let server_cpu_before = server_stat.as_deref().map(process_cpu_ns);
    let cpu_before = process_cpu_ns(Path::new("/proc/self/stat"));
    let started = Instant::now();
    while started.elapsed() < budget {
        for ((stream, request), at) in streams.iter_mut().zip(&requests).zip(&mut written) {
            *at = Instant::now();
            stream.write_all(request)?;
        }
        for ((stream, expected), at) in streams.iter_mut().zip(&replies).zip(&written) {
            reply.resize(expected.len(), 0);
            stream.read_exact(&mut reply)?;
            if &reply != expected {
                return Err(io::Error::other("a reply differs from the value stored"));
            }
            latencies.push(at.elapsed().as_nanos() as u64);
        }
    }
    let elapsed = started.elapsed().as_nanos();
    let requests = latencies.len().max(1) as u64;
    eprintln!(
        "cpu per request: client {} ns, server {} ns",
        process_cpu_ns(Path::new("/proc/self/stat")).saturating_sub(cpu_before) / requests,
        match (server_stat.as_deref(), server_cpu_before) {
            (Some(stat), Some(before)) =>
                (process_cpu_ns(stat).saturating_sub(before) / requests).to_string(),
            _ => "-".to_owned(),
        }
    );
    print_result(latencies, elapsed);
    Ok(())
}

/// Prints `result OPS ELAPSED_NS P50 P99` of the operations whose latencies are given.
fn print_result(mut latencies: Vec<u64>, elapsed_ns: u128) {
    latencies.sort_unstable();
    println!(
        "result {} {elapsed_ns} {} {}",
        latencies.len(),
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99)
    );
}

/// A process's user and system CPU time from its `/proc/PID/stat`, in nanoseconds.
fn process_cpu_ns(stat: &Path) -> u64 {
    std::fs::read_to_string(stat)
        .ok()
        .and_then(|text| stat_group_and_cpu(&text))
        .map_or(0, |(_, cpu_ns)| cpu_ns)
}

/// Bytes in use on the file system that holds `dir` (segments are unlinked once both ends
/// mapped them, so the files left in the directory do not tell).
fn used_bytes(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return 0;
    };
    // SAFETY: an all-zero `statvfs` is valid; statvfs(3) fills the one we own from a
    // NUL-terminated path we own.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(path.as_ptr(), &mut stat) } != 0 {
        return 0;
    }
    (stat.f_blocks - stat.f_bfree) * stat.f_frsize
}

/// A process's resident memory (`VmRSS` in its `/proc/PID/status`), in bytes.
fn resident_bytes(status: &Path) -> u64 {
    std::fs::read_to_string(status)
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}

/// `fork-echo`: a server that forks per connection, as PostgreSQL's postmaster and Python's
/// `ForkingMixIn` do: the parent accepts, forks and closes its copy; the child echoes until end
/// of stream and exits. Runs until it is killed (with its process group).
fn fork_echo_server(port: u16) -> io::Result<()> {
    let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port))?;
    loop {
        let (mut stream, _) = listener.accept()?;
        // SAFETY: this role is single-threaded; the child only echoes and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            drop(listener);
            let _ = stream.set_nodelay(true);
            let mut buffer = [0u8; 65536];
            let status = loop {
                match stream.read(&mut buffer) {
                    Ok(0) => break 0,
                    Ok(n) => {
                        if stream.write_all(&buffer[..n]).is_err() {
                            break 1;
                        }
                    }
                    Err(_) => break 1,
                }
            };
            // SAFETY: ends the child without running the parent's exit handlers.
            unsafe { libc::_exit(status) };
        }
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        drop(stream);
        // Children that ended (no zombies pile up).
        // SAFETY: reaping our own children without blocking.
        while unsafe { libc::waitpid(-1, core::ptr::null_mut(), libc::WNOHANG) } > 0 {}
    }
}

// ---------------------------------------------------------------------------------------------
// Report: table, JSON, chart, baseline
// ---------------------------------------------------------------------------------------------

fn format_value(value: Option<f64>) -> String {
    match value {
        None => "n/a".into(),
        Some(v) if v >= 100.0 => format!("{v:.0}"),
        Some(v) if v >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn format_ns(value: Option<f64>) -> String {
    match value {
        None => "n/a".into(),
        Some(ns) if ns >= 1e6 => format!("{:.1} ms", ns / 1e6),
        Some(ns) if ns >= 10e3 => format!("{:.0} us", ns / 1e3),
        Some(ns) if ns >= 1e3 => format!("{:.1} us", ns / 1e3),
        Some(ns) => format!("{ns:.0} ns"),
    }
}

fn print_outcome(outcome: &Outcome) {
    println!();
    if let Some(reason) = &outcome.skipped {
        println!("{}: {reason}", outcome.name);
        return;
    }
    println!(
        "{}  ({}; CPU per {}; {} rounds)",
        outcome.name,
        outcome.unit,
        outcome.op,
        outcome.rounds.len()
    );
    println!(
        "  {:<17} {:>12} {:>22} {:>9} {:>9} {:>10} {:>10}  path",
        "variant", "median", "ratio vs TCP (min-max)", "p50", "p99", "cpu client", "cpu server"
    );
    for &variant in &outcome.variants {
        let samples = outcome.samples(variant);
        let value = median(samples.iter().map(|s| s.reported.value).collect());
        let latency = |get: fn(&Sample) -> Option<f64>| {
            median(samples.iter().filter_map(|s| get(s)).collect()).map(|us| us * 1e3)
        };
        let per_op = |cpu: fn(&Sample) -> u64| {
            median(
                samples
                    .iter()
                    .map(|s| cpu(s) as f64 / s.reported.ops.max(f64::MIN_POSITIVE))
                    .collect(),
            )
        };
        let ratio = match (variant, outcome.ratio_spread(variant)) {
            (Variant::Tcp, _) => "1".to_owned(),
            (_, None) => "n/a".to_owned(),
            (_, Some(s)) => format!("{:.2} ({:.2}-{:.2})", s.median, s.min, s.max),
        };
        println!(
            "  {:<17} {:>12} {:>22} {:>9} {:>9} {:>10} {:>10}  {}",
            variant.label(),
            format_value(value),
            ratio,
            format_ns(latency(|s| s.reported.p50_us)),
            format_ns(latency(|s| s.reported.p99_us)),
            format_ns(per_op(|s| s.client_cpu_ns)),
            format_ns(per_op(|s| s.server_cpu_ns)),
            outcome.paths_seen(variant)
        );
    }
}

/// The ratios a chart and a baseline compare: every non-TCP variant but the raw ring (a
/// yardstick, not a way programs run).
fn charted(outcome: &Outcome) -> Vec<(Variant, Spread)> {
    outcome
        .variants
        .iter()
        .filter(|&&v| v != Variant::Tcp && !v.is_yardstick())
        .filter_map(|&v| Some((v, outcome.ratio_spread(v)?)))
        .collect()
}

/// Horizontal bars of the median ratio against TCP (from 1 = parity, log scale) with whiskers
/// over the rounds' min–max, one group per workload.
fn draw_chart(path: &Path, report: &Value, title: &str) -> Result<(), String> {
    use plotters::prelude::*;
    use plotters::style::text_anchor::{HPos, Pos, VPos};
    // (workload, variant, ratio spread) from the report, so a stored report redraws alike.
    let mut rows: Vec<(String, String, Spread)> = Vec::new();
    for workload in report["workloads"].as_array().into_iter().flatten() {
        let name = workload["name"].as_str().unwrap_or("?");
        let Some(ratios) = workload["ratios_vs_tcp"].as_object() else {
            continue;
        };
        for (variant, ratio) in ratios {
            if YARDSTICKS.iter().any(|v| v.label() == variant) {
                continue;
            }
            let get = |key: &str| ratio[key].as_f64();
            if let (Some(median), Some(min), Some(max)) = (get("median"), get("min"), get("max")) {
                rows.push((
                    name.to_owned(),
                    variant.clone(),
                    Spread { median, min, max },
                ));
            }
        }
    }
    // Variants in their table order within a workload (the JSON map is sorted by name).
    let order = |label: &str| {
        [
            Variant::Sandirect,
            Variant::Fallback,
            Variant::ServerOnly,
            Variant::SetUpForced,
        ]
        .iter()
        .position(|v| v.label() == label)
    };
    let first: BTreeMap<String, usize> = rows
        .iter()
        .enumerate()
        .rev()
        .map(|(i, row)| (row.0.clone(), i))
        .collect();
    rows.sort_by_key(|row| (first.get(&row.0).copied(), order(&row.1)));
    if rows.is_empty() {
        return Err("no ratio to draw".into());
    }
    // The axis spans every median and parity, and the whiskers as far as 3x beyond the
    // extreme medians: a single wild round of a 10 ms micro-benchmark slice must not squeeze
    // every bar into a few pixels (a clipped whisker ends in a shorter tick).
    let median_low = rows.iter().map(|r| r.2.median).fold(1.0f64, f64::min);
    let median_high = rows.iter().map(|r| r.2.median).fold(1.0f64, f64::max);
    let low = rows
        .iter()
        .map(|r| r.2.min)
        .fold(median_low, f64::min)
        .max(median_low / 3.0)
        .max(1e-3)
        * 0.8;
    let high = rows
        .iter()
        .map(|r| r.2.max)
        .fold(median_high, f64::max)
        .min(median_high * 3.0)
        * 1.25;
    let row_height = 16u32;
    let height = 110 + row_height * rows.len() as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    let error = |e: DrawingAreaErrorKind<_>| e.to_string();
    root.fill(&WHITE).map_err(error)?;
    let n = rows.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(330)
        .build_cartesian_2d(
            (low..high).log_scale().with_key_points(
                [
                    0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0,
                ]
                .into_iter()
                .filter(|x| (low..=high).contains(x))
                .collect::<Vec<f64>>(),
            ),
            0f64..n as f64,
        )
        .map_err(error)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_label_formatter(&|x| format!("{x}"))
        .x_desc(
            "throughput ratio against kernel TCP in the same round (median bar, min-max whiskers)",
        )
        .label_style(("sans-serif", 11))
        .draw()
        .map_err(error)?;
    // Row labels, right-aligned against the plot (the mesh's labels go on "nice" values, not
    // on rows).
    let label_style =
        TextStyle::from(("sans-serif", 11).into_font()).pos(Pos::new(HPos::Right, VPos::Center));
    for (i, (name, variant, _)) in rows.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(low, n as f64 - i as f64 - 0.5));
        root.draw(&Text::new(
            format!("{name} [{variant}]"),
            (x - 6, y),
            label_style.clone(),
        ))
        .map_err(error)?;
    }
    for (i, (_, variant, s)) in rows.iter().enumerate() {
        // Row i from the top.
        let y = n as f64 - i as f64 - 0.5;
        let colour = match variant.as_str() {
            "sandirect" if s.median >= 1.0 => RGBColor(46, 139, 87),
            "sandirect" => RGBColor(200, 70, 60),
            "fallback" => RGBColor(110, 130, 180),
            "sandirect, set-up forced" => RGBColor(150, 110, 170),
            _ => RGBColor(180, 150, 80),
        };
        chart
            .draw_series(std::iter::once(Rectangle::new(
                [(1.0, y - 0.35), (s.median, y + 0.35)],
                colour.filled(),
            )))
            .map_err(error)?;
        let (min, max) = (s.min.max(low), s.max.min(high));
        let cap = |x: f64, clipped: bool| {
            let half = if clipped { 0.1 } else { 0.2 };
            PathElement::new(vec![(x, y - half), (x, y + half)], BLACK)
        };
        chart
            .draw_series([
                PathElement::new(vec![(min, y), (max, y)], BLACK),
                cap(min, min > s.min),
                cap(max, max < s.max),
            ])
            .map_err(error)?;
    }
    chart
        .draw_series(std::iter::once(PathElement::new(
            vec![(1.0, 0.0), (1.0, n as f64)],
            BLACK.stroke_width(2),
        )))
        .map_err(error)?;
    root.present().map_err(error)?;
    Ok(())
}

fn chart_title(report: &Value) -> String {
    format!(
        "sandirect vs kernel TCP, loopback, {} vCPUs, {} run, {} rounds, load average {}",
        report["cpus"],
        report["mode"].as_str().unwrap_or("?"),
        report["rounds"],
        report["load_average_before"].as_str().unwrap_or("?")
    )
}

/// `--redraw REPORT`: the chart of a stored report, beside it (`.svg`).
fn redraw(report_path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(report_path).map_err(|e| e.to_string())?;
    let report: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let chart = report_path.with_extension("svg");
    draw_chart(&chart, &report, &chart_title(&report))?;
    println!("chart: {}", chart.display());
    Ok(())
}

/// Compares every ratio with the baseline's median: a `warning: regression` line when the
/// median is more than 20% below it and so is every round of this run, a `note:` line when the
/// median is that far below but this run's own spread still reaches the line (on a loaded
/// machine, most often noise). Returns the number of warnings.
fn compare_with_baseline(baseline: &Value, outcomes: &[Outcome]) -> usize {
    let mut warnings = 0;
    let Some(workloads) = baseline["workloads"].as_array() else {
        println!("baseline has no workloads; nothing compared");
        return 0;
    };
    for outcome in outcomes {
        let Some(old) = workloads
            .iter()
            .find(|w| w["name"] == outcome.name.as_str())
        else {
            continue;
        };
        for (variant, now) in charted(outcome) {
            let Some(before) = old["ratios_vs_tcp"][variant.label()]["median"].as_f64() else {
                continue;
            };
            if now.median >= before * REGRESSION {
                continue;
            }
            let every_round = now.max < before * REGRESSION;
            if every_round {
                warnings += 1;
            }
            println!(
                "{}: {} [{}/TCP] {:.2} ({:.2}-{:.2}) against the baseline's {:.2} ({:+.0}%{})",
                if every_round {
                    "warning: regression"
                } else {
                    "note: below the baseline within this run's spread"
                },
                outcome.name,
                variant.label(),
                now.median,
                now.min,
                now.max,
                before,
                (now.median / before - 1.0) * 100.0,
                if every_round { ", every round" } else { "" }
            );
        }
    }
    warnings
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// Main
// ---------------------------------------------------------------------------------------------

struct Options {
    quick: bool,
    rounds: Option<usize>,
    only: Vec<String>,
    out: PathBuf,
    baseline: Option<PathBuf>,
    save_baseline: bool,
    preload: Option<PathBuf>,
    redraw: Option<PathBuf>,
}

fn parse_options(words: &[String]) -> Result<Options, String> {
    let mut options = Options {
        quick: false,
        rounds: None,
        only: Vec::new(),
        out: PathBuf::from("target/bench"),
        baseline: None,
        save_baseline: false,
        preload: None,
        redraw: None,
    };
    let mut words = words.iter();
    while let Some(word) = words.next() {
        let mut value = |name: &str| words.next().cloned().ok_or(format!("{name} needs a value"));
        match word.as_str() {
            "--quick" => options.quick = true,
            "--rounds" => {
                let rounds: usize = value("--rounds")?.parse().map_err(|_| "bad --rounds")?;
                options.rounds = Some(rounds.max(1));
            }
            "--only" => {
                options.only = value("--only")?
                    .split(',')
                    .map(|w| w.trim().to_lowercase())
                    .filter(|w| !w.is_empty())
                    .collect()
            }
            "--out" => options.out = value("--out")?.into(),
            "--baseline" => options.baseline = Some(value("--baseline")?.into()),
            "--save-baseline" => options.save_baseline = true,
            "--preload" => options.preload = Some(value("--preload")?.into()),
            "--redraw" => options.redraw = Some(value("--redraw")?.into()),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(options)
}

/// Raises the soft limit on open descriptors to the hard one, for every program the
/// benchmark starts: a workload with 1000 connections needs a few thousand descriptors in
/// each end (a SAN connection holds two of the interposer's beside the socket), more than
/// the usual soft limit of 1024. Left as it is when it cannot be read.
fn raise_descriptor_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes one `rlimit` we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    limit.rlim_cur = limit.rlim_max.min(1 << 20);
    // SAFETY: setrlimit(2) reads one `rlimit` we own; raising the soft limit up to the hard
    // one is always permitted.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
}

fn main() -> ExitCode {
    let words: Vec<String> = std::env::args().skip(1).collect();
    if words.first().map(String::as_str) == Some("--role") {
        let value = |name: &str| {
            words
                .iter()
                .position(|w| w == name)
                .and_then(|i| words.get(i + 1))
                .cloned()
                .unwrap_or_default()
        };
        let role = value("--role");
        let port: u16 = value("--port").parse().unwrap_or(0);
        let seconds: f64 = value("--seconds").parse().unwrap_or(1.0);
        let connections: usize = value("--connections").parse().unwrap_or(1000);
        raise_descriptor_limit();
        let server_pid: Option<u32> = value("--server-pid").parse().ok();
        return match role_main(&role, port, seconds, connections, server_pid) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("bench --role {role}: {error}");
                ExitCode::FAILURE
            }
        };
    }
    raise_descriptor_limit();
    let options = match parse_options(&words) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("bench: {message}");
            return ExitCode::from(2);
        }
    };
    let result = match &options.redraw {
        Some(report) => redraw(report),
        None => orchestrate(&options),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("bench: {error}");
            ExitCode::FAILURE
        }
    }
}

fn orchestrate(options: &Options) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let library = options
        .preload
        .clone()
        .or_else(|| exe.parent().map(|d| d.join("libsandirect.so")))
        .filter(|path| path.is_file())
        .ok_or("libsandirect.so not found (build it, or pass --preload)")?;
    let library = std::fs::canonicalize(&library).map_err(|e| e.to_string())?;
    let mode = if options.quick { "quick" } else { "full" };
    let context = Context {
        exe,
        library,
        sandbox: Sandbox::new("bench"),
        quick: options.quick,
        rounds: options.rounds.unwrap_or(if options.quick { 3 } else { 5 }),
    };
    let wanted = |name: &str| {
        options.only.is_empty()
            || options
                .only
                .iter()
                .any(|word| name.to_lowercase().contains(word))
    };
    kill_groups_on_interrupt();
    let started = Instant::now();
    let load_before = load_average();
    println!(
        "bench ({mode}): {} rounds per workload, variants interleaved; load average {load_before}; \
         preload {}",
        context.rounds,
        context.library.display()
    );
    let mut outcomes = Vec::new();
    for workload in workloads(&context) {
        if !wanted(&workload.name) {
            continue;
        }
        let outcome = run_workload(&context, &workload);
        print_outcome(&outcome);
        outcomes.push(outcome);
    }
    if wanted("sockets") {
        println!();
        println!("sockets: bench_sockets (its own interleaved rounds) ...");
        for outcome in run_socket_benchmarks(&context) {
            print_outcome(&outcome);
            outcomes.push(outcome);
        }
    }
    let measured = outcomes.iter().filter(|o| o.skipped.is_none()).count();
    let elapsed = started.elapsed().as_secs_f64();
    let load_after = load_average();
    println!();
    println!(
        "{measured} workloads measured in {elapsed:.0} s (load average before {load_before}, after \
         {load_after})"
    );
    if measured == 0 && !outcomes.is_empty() {
        return Err("no workload could run".into());
    }
    let unix_time = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let report = json!({
        "format": 1,
        "mode": mode,
        "rounds": context.rounds,
        "unix_time": unix_time,
        "seconds": elapsed,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "ratio": "figure of the variant / figure of kernel TCP in the same round (higher is better)",
        "workloads": outcomes.iter().map(Outcome::to_json).collect::<Vec<_>>(),
    });
    std::fs::create_dir_all(&options.out).map_err(|e| e.to_string())?;
    let json_path = options.out.join(format!("bench-{mode}.json"));
    let chart_path = options.out.join(format!("bench-{mode}.svg"));
    // Compact: the report holds every round's raw figures (`python3 -m json.tool` shows it).
    let text = serde_json::to_string(&report).map_err(|e| e.to_string())?;
    std::fs::write(&json_path, &text).map_err(|e| e.to_string())?;
    let title = chart_title(&report);
    match draw_chart(&chart_path, &report, &title) {
        Ok(()) => println!(
            "report: {}  chart: {}",
            json_path.display(),
            chart_path.display()
        ),
        Err(error) => println!("report: {}  (no chart: {error})", json_path.display()),
    }
    let baseline_path = options
        .baseline
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("docs/bench/baseline-{mode}.json")));
    if options.save_baseline {
        if let Some(dir) = baseline_path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        }
        std::fs::write(&baseline_path, &text).map_err(|e| e.to_string())?;
        let chart_copy = baseline_path.with_extension("svg");
        let _ = std::fs::copy(&chart_path, &chart_copy);
        println!(
            "baseline saved: {} and {}",
            baseline_path.display(),
            chart_copy.display()
        );
    } else {
        match std::fs::read_to_string(&baseline_path)
            .ok()
            .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        {
            Some(baseline) => {
                let warnings = compare_with_baseline(&baseline, &outcomes);
                println!(
                    "compared with {}: {warnings} regression warning(s) (every round more than \
                     {:.0}% below the baseline's median)",
                    baseline_path.display(),
                    (1.0 - REGRESSION) * 100.0
                );
            }
            None => println!(
                "no baseline at {}: nothing compared",
                baseline_path.display()
            ),
        }
    }
    let _ = io::stdout().flush();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsers_read_the_tools_output() {
        let redis = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\
                     \"SET\",\"40000.00\",\"0.023\",\"0.016\",\"0.023\",\"0.031\",\"0.047\",\"0.143\"\n\
                     \"GET\",\"40000.00\",\"0.022\",\"0.016\",\"0.020\",\"0.031\",\"0.039\",\"0.119\"\n";
        let r = parse_redis(2000)(redis).unwrap();
        assert!((r.value - 40000.0).abs() < 1e-6 && r.ops == 4000.0);
        assert_eq!((r.p50_us, r.p99_us), (Some(20.0), Some(39.0)));
        let wrk =
            "  Latency Distribution\n     50%   95.00us\n     75%  1.00ms\n     99%    1.50ms\n  \
                   120000 requests in 1.00s, 10 MB read\nRequests/sec: 119000.50\n";
        let w = parse_wrk(wrk).unwrap();
        assert_eq!((w.value, w.ops), (119000.5, 120000.0));
        assert_eq!((w.p50_us, w.p99_us), (Some(95.0), Some(1500.0)));
        let own = parse_own("result 1000 500000000 40000 90000\n").unwrap();
        assert_eq!(
            (own.value, own.p50_us, own.p99_us),
            (2000.0, Some(40.0), Some(90.0))
        );
    }

    #[test]
    fn ratios_are_per_round_and_skip_failed_runs() {
        let sample = |value| {
            Some(Sample {
                reported: Reported {
                    value,
                    ops: 1.0,
                    p50_us: None,
                    p99_us: None,
                },
                elapsed_s: 1.0,
                client_cpu_ns: 0,
                server_cpu_ns: 0,
                paths: BTreeMap::new(),
            })
        };
        let outcome = Outcome {
            name: "w".into(),
            unit: "req/s",
            op: "request",
            variants: vec![Variant::Tcp, Variant::Sandirect],
            rounds: vec![
                BTreeMap::from([
                    (Variant::Tcp, sample(10.0)),
                    (Variant::Sandirect, sample(20.0)),
                ]),
                BTreeMap::from([(Variant::Tcp, sample(10.0)), (Variant::Sandirect, None)]),
                BTreeMap::from([
                    (Variant::Tcp, sample(20.0)),
                    (Variant::Sandirect, sample(10.0)),
                ]),
                BTreeMap::from([
                    (Variant::Tcp, sample(10.0)),
                    (Variant::Sandirect, sample(15.0)),
                ]),
            ],
            skipped: None,
            path_labels: BTreeMap::new(),
        };
        let s = outcome.ratio_spread(Variant::Sandirect).unwrap();
        assert_eq!((s.median, s.min, s.max), (1.5, 0.5, 2.0));
        // Median 1.5 is 25% below 2.0, but one round (2.0) reaches the line: a note only.
        let baseline = json!({ "workloads": [{ "name": "w", "ratios_vs_tcp": { "sandirect": { "median": 2.0 } } }] });
        assert_eq!(
            compare_with_baseline(&baseline, std::slice::from_ref(&outcome)),
            0
        );
        // Every round below 0.8 x 3.0: a regression warning.
        let baseline = json!({ "workloads": [{ "name": "w", "ratios_vs_tcp": { "sandirect": { "median": 3.0 } } }] });
        assert_eq!(compare_with_baseline(&baseline, &[outcome]), 1);
    }
}
