//! Every setting of the library: the `SANDIRECT_*` environment variables (one entry each in
//! [`KNOBS`], with its values, default and effect; README's settings table is checked against
//! it), the settings fixed at init, and the path decision the rules make for a connection.
//!
//! Each variable is read in one place, here: the process-wide ones by [`load`] in the
//! constructor, the SAN path's tunables once on first use (a process that never opens a SAN
//! socket never reads them). A value that does not parse is reported once on stderr and the
//! default is used; nothing here can fail the host program.

use core::ffi::c_int;
use core::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};
use std::ffi::CStr;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use crate::config::{self, Config, Role, UseMode};
use crate::record::Bypass;

/// One environment variable of the library.
#[derive(Clone, Copy, Debug)]
pub struct Knob {
    /// The variable's name.
    pub name: &'static str,
    /// The values it takes.
    pub values: &'static str,
    /// Its default (what an unset or unparsable value means).
    pub default: &'static str,
    /// What it does.
    pub effect: &'static str,
    /// Read by the library in a privileged process too (set-uid, set-gid or gaining
    /// capabilities at exec: `AT_SECURE`). Only variables that can only narrow what the
    /// library does are; one that names a path, chooses or tunes a provider, or adds output is
    /// not, whoever set the environment (the library keeps its default).
    pub privileged: bool,
}

/// `SANDIRECT_MODE`.
pub const MODE: &str = "SANDIRECT_MODE";
/// `SANDIRECT_CONFIG`.
pub const CONFIG: &str = "SANDIRECT_CONFIG";
/// `SANDIRECT_LOG`.
pub const LOG: &str = "SANDIRECT_LOG";
/// `SANDIRECT_STAT_DIR`.
pub const STAT_DIR: &str = "SANDIRECT_STAT_DIR";
/// `SANDIRECT_STAT_DIR` for the constructor-time reader, which may not allocate.
pub const STAT_DIR_C: &CStr = c"SANDIRECT_STAT_DIR";
/// `SANDIRECT_SAN`.
pub const SAN: &str = "SANDIRECT_SAN";
/// `SANDIRECT_WAIT_SLICE_MS`.
pub const WAIT_SLICE_MS: &str = "SANDIRECT_WAIT_SLICE_MS";
/// `SANDIRECT_POLL_US`.
pub const POLL_US: &str = "SANDIRECT_POLL_US";
/// `SANDIRECT_SHORT_CONNECTION_BYTES`.
pub const SHORT_CONNECTION_BYTES: &str = "SANDIRECT_SHORT_CONNECTION_BYTES";
/// `SANDIRECT_SHM_DIR`.
pub const SHM_DIR: &str = "SANDIRECT_SHM_DIR";
/// `SANDIRECT_SAN_RENDEZVOUS`.
pub const SAN_RENDEZVOUS: &str = "SANDIRECT_SAN_RENDEZVOUS";
/// `SANDIRECT_SAN_RDMA_READ`.
pub const SAN_RDMA_READ: &str = "SANDIRECT_SAN_RDMA_READ";
/// `SANDIRECT_OTHER_USERS`.
pub const OTHER_USERS: &str = "SANDIRECT_OTHER_USERS";
/// `SANDIRECT_SAN_PROVIDER`.
pub const SAN_PROVIDER: &str = "SANDIRECT_SAN_PROVIDER";
/// `SANDIRECT_SAN_MEMORY_MB`.
pub const SAN_MEMORY_MB: &str = "SANDIRECT_SAN_MEMORY_MB";
/// `SANDIRECT_VERBS_TIMEOUT_MS`.
pub const VERBS_TIMEOUT_MS: &str = "SANDIRECT_VERBS_TIMEOUT_MS";
/// `SANDIRECT_VERBS_POLLS`.
pub const VERBS_POLLS: &str = "SANDIRECT_VERBS_POLLS";
/// `SANDIRECT_VERBS_LIBRARY`.
pub const VERBS_LIBRARY: &str = "SANDIRECT_VERBS_LIBRARY";
/// `SANDIRECT_LIB` (read by the `sandirect` command, not by the library).
pub const LIB: &str = "SANDIRECT_LIB";
/// `SANDIRECT_STASHES` (set by the library itself across exec).
pub const STASHES: &str = "SANDIRECT_STASHES";
/// `SANDIRECT_SAN_REFUSE_REGISTRATIONS` (a test knob).
pub const SAN_REFUSE_REGISTRATIONS: &str = "SANDIRECT_SAN_REFUSE_REGISTRATIONS";

/// Every `SANDIRECT_*` variable, in README's order.
pub const KNOBS: &[Knob] = &[
    Knob {
        name: MODE,
        values: "auto, tcp, off",
        default: "auto",
        effect: "off: track nothing, pure passthrough; tcp: track, never use the SAN; auto: the rules decide",
        privileged: true,
    },
    Knob {
        name: CONFIG,
        values: "path",
        default: "none (every connection may use the SAN)",
        effect: "the rules file; an invalid file keeps every connection on TCP; not read when privileged",
        privileged: false,
    },
    Knob {
        name: LOG,
        values: "error, warn, info, debug, trace",
        default: "off",
        effect: "tracing output on stderr (free when off); not read when privileged",
        privileged: false,
    },
    Knob {
        name: STAT_DIR,
        values: "path, off",
        default: "/dev/shm/sandirect-$UID",
        effect: "where live connections are published for `sandirect stat` (opened and checked once per process, then used through that descriptor); not read when privileged",
        privileged: false,
    },
    Knob {
        name: SAN,
        values: "0, 1",
        default: "1",
        effect: "0 keeps every connection on kernel TCP (still tracked and counted)",
        privileged: true,
    },
    Knob {
        name: SAN_PROVIDER,
        values: "auto, shm, verbs",
        default: "auto",
        effect: "which SAN providers may be used: auto shared memory for same-host peers and RDMA verbs for peers reached through an RDMA device; shm intra-host only; verbs only; not read when privileged",
        privileged: false,
    },
    Knob {
        name: SHM_DIR,
        values: "path",
        default: "/dev/shm/sandirect-$UID",
        effect: "directory of the shared-memory segments (opened and checked once per process, then used through that descriptor); not read when privileged",
        privileged: false,
    },
    Knob {
        name: OTHER_USERS,
        values: "comma-separated uids",
        default: "none",
        effect: "users whose processes this process's connections may use the SAN with (each over a segment private to the connection); both ends must name each other; not read when privileged",
        privileged: false,
    },
    Knob {
        name: SAN_RENDEZVOUS,
        values: "0, 1",
        default: "1",
        effect: "0 keeps large sends inline instead of the zero-copy rendezvous",
        privileged: true,
    },
    Knob {
        name: SAN_RDMA_READ,
        values: "0, 1",
        default: "READ on RoCE/InfiniBand, WRITE on iWARP",
        effect: "verbs rendezvous: 1 the receiver RDMA-READs the sender's buffer; 0 the sender RDMA-WRITEs into a sink the receiver advertises; not read when privileged",
        privileged: false,
    },
    Knob {
        name: SAN_MEMORY_MB,
        values: "MiB",
        default: "the larger of 1024 and a quarter of RAM",
        effect: "bound on the memory this process holds for SAN connections (each is charged its segment, its journal and send buffer, about 15 MiB over shm); past it new connections stay on TCP (san-resources); not read when privileged",
        privileged: false,
    },
    Knob {
        name: VERBS_POLLS,
        values: "0..=1048576",
        default: "1024",
        effect: "how many times a blocked reader of a verbs socket polls for the answer before it sleeps (adaptively; 0 sleeps at once); not read when privileged",
        privileged: false,
    },
    Knob {
        name: VERBS_TIMEOUT_MS,
        values: "milliseconds",
        default: "3000",
        effect: "bound on one RDMA connection set-up; past it the connection stays on TCP; not read when privileged",
        privileged: false,
    },
    Knob {
        name: VERBS_LIBRARY,
        values: "path",
        default: "libsandirect_verbs.so beside libsandirect.so, else on the library search path",
        effect: "the verbs provider library, loaded only on hosts with RDMA devices; not read when privileged",
        privileged: false,
    },
    Knob {
        name: WAIT_SLICE_MS,
        values: "1..=600000",
        default: "239",
        effect: "longest kernel wait between two safety-net services of every SAN socket; not read when privileged",
        privileged: false,
    },
    Knob {
        name: POLL_US,
        values: "0..=1000",
        default: "50",
        effect: "longest time an epoll, poll or select wait looks for the next message of a SAN socket a read just emptied, before it sleeps (adaptive below it; 0: never); not read when privileged",
        privileged: false,
    },
    Knob {
        name: SHORT_CONNECTION_BYTES,
        values: "0..=1073741824",
        default: "1024",
        effect: "a client's connection that carried fewer bytes (both ways) is short; while two more of its recent connections to a server were short than long, new ones to that server stay on TCP, sparing the SAN set-up they could not pay back (0: always set up); not read when privileged",
        privileged: false,
    },
    Knob {
        name: LIB,
        values: "path",
        default: "next to the `sandirect` binary",
        effect: "the preload library `sandirect run` injects",
        privileged: false,
    },
    Knob {
        name: STASHES,
        values: "internal",
        default: "unset",
        effect: "set by the library across exec: received bytes a downgraded socket still holds; not read when privileged",
        privileged: false,
    },
    Knob {
        name: SAN_REFUSE_REGISTRATIONS,
        values: "count",
        default: "0",
        effect: "testing: refuse this many memory registrations, as an exhausted RLIMIT_MEMLOCK would; not read when privileged",
        privileged: false,
    },
];

/// True in a privileged process: set-uid, set-gid or gaining capabilities at exec
/// (`AT_SECURE`, what `secure_getenv` asks). Its environment was set by a less privileged
/// user, so only the variables [`Knob::privileged`] marks are read. (Allocation-free: the
/// constructor's stats-directory lookup asks too.)
pub fn privileged() -> bool {
    // SAFETY: getauxval has no preconditions.
    unsafe { libc::getauxval(libc::AT_SECURE) != 0 }
}

/// Whether the library reads variable `name` in a process that is `privileged` (see
/// [`Knob::privileged`]); an unknown name never is then. Allocation-free.
pub fn honoured(name: &str, privileged: bool) -> bool {
    !privileged
        || KNOBS
            .iter()
            .any(|knob| knob.name == name && knob.privileged)
}

/// The library's read of variable `name`: its value, unless unset or not [`honoured`] here.
pub fn var_os(name: &str) -> Option<std::ffi::OsString> {
    if honoured(name, privileged()) {
        std::env::var_os(name)
    } else {
        None
    }
}

/// [`var_os`] as text (`None` also when not valid UTF-8).
fn var(name: &str) -> Option<String> {
    var_os(name)?.into_string().ok()
}

/// `SANDIRECT_MODE`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Mode {
    /// Track sockets; rules decide.
    Auto,
    /// Track sockets; everything stays on TCP.
    Tcp,
    /// Track nothing.
    Off,
}

impl Mode {
    /// Parses the variable's value.
    pub fn parse(value: &str) -> Option<Mode> {
        match value {
            "auto" | "" => Some(Self::Auto),
            "tcp" => Some(Self::Tcp),
            "off" => Some(Self::Off),
            _ => None,
        }
    }
}

/// Settings fixed at init.
#[derive(Debug)]
pub struct Settings {
    /// The mode.
    pub mode: Mode,
    /// Program name (basename of `argv[0]`).
    pub program: String,
    /// Rules already filtered for this program; `None` when the file was invalid.
    pub rules: Option<Config>,
    /// Connections between preloaded processes switch to the intra-host SAN (the default;
    /// `SANDIRECT_SAN=0` turns it off).
    pub san: bool,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();
static TRACKING: AtomicBool = AtomicBool::new(true);

/// The settings, once the constructor ran.
pub fn settings() -> Option<&'static Settings> {
    SETTINGS.get()
}

/// False when `SANDIRECT_MODE=off` (or init failed): no socket is tracked.
#[inline(always)]
pub fn tracking_enabled() -> bool {
    TRACKING.load(Ordering::Relaxed)
}

/// Turns tracking off for good (init failed: the library stays a passthrough).
pub fn disable_tracking() {
    TRACKING.store(false, Ordering::Relaxed);
}

/// Whether the SAN path is enabled (not turned off with `SANDIRECT_SAN=0`).
pub fn san_enabled() -> bool {
    settings().is_some_and(|s| s.san)
}

/// Reads the process-wide variables (mode, rules, SAN on/off, wait slice) once, at init.
pub fn load(argv0: Option<&CStr>) {
    let mode = match var(MODE) {
        None => Mode::Auto,
        Some(value) => Mode::parse(&value).unwrap_or_else(|| {
            eprintln!("sandirect: {MODE}={value:?} is not auto, tcp or off; using auto");
            Mode::Auto
        }),
    };
    if mode == Mode::Off {
        disable_tracking();
    }
    let program = program_name(argv0);
    let rules = match var_os(CONFIG) {
        None => Some(Config::default()),
        Some(path) => match load_config(std::path::Path::new(&path)) {
            Ok(config) => Some(config.for_program(&program)),
            Err(message) => {
                eprintln!("sandirect: {message}; every connection stays on TCP");
                None
            }
        },
    };
    tracing::debug!(?mode, program, rules = ?rules.as_ref().map(|r| r.rules.len()), "sandirect initialised");
    // On unless turned off: `SANDIRECT_SAN=0` keeps every connection on kernel TCP (the
    // interposer still tracks and counts them).
    let san = var(SAN).is_none_or(|value| value != "0");
    if let Some(value) = var(WAIT_SLICE_MS) {
        match value.parse::<c_int>() {
            Ok(ms) if (1..=600_000).contains(&ms) => WAIT_SLICE.store(ms, Ordering::Relaxed),
            _ => eprintln!(
                "sandirect: {WAIT_SLICE_MS}={value:?} is not 1..=600000; using {DEFAULT_WAIT_SLICE_MS}"
            ),
        }
    }
    if let Some(value) = var(POLL_US) {
        match value.parse::<u32>() {
            Ok(us) if us <= 1000 => POLL.store(us, Ordering::Relaxed),
            _ => {
                eprintln!("sandirect: {POLL_US}={value:?} is not 0..=1000; using {DEFAULT_POLL_US}")
            }
        }
    }
    if let Some(value) = var(SHORT_CONNECTION_BYTES) {
        match value.parse::<u32>() {
            Ok(bytes) if bytes <= 1 << 30 => SHORT_BYTES.store(bytes, Ordering::Relaxed),
            _ => eprintln!(
                "sandirect: {SHORT_CONNECTION_BYTES}={value:?} is not 0..=1073741824; using {DEFAULT_SHORT_BYTES}"
            ),
        }
    }
    // Read now, not at first use: a program may replace its environment before its workers
    // accept (nginx keeps only the variables its configuration names).
    let _ = other_users();
    let _ = SETTINGS.set(Settings {
        mode,
        program,
        rules,
        san,
    });
}

/// The path decision for a new connection: `Bypass::None` means "upgrade when the peer is
/// capable" and is only returned with the SAN path enabled (not `SANDIRECT_SAN=0`); otherwise
/// every outcome is a TCP reason (`NoProvider` when the rules would allow the SAN).
pub fn decide(role: Role, endpoint: Option<SocketAddr>) -> Bypass {
    let Some(settings) = settings() else {
        return Bypass::NoProvider;
    };
    let Some(rules) = &settings.rules else {
        return Bypass::ConfigInvalid;
    };
    if settings.mode == Mode::Tcp {
        return Bypass::ConfigSaysTcp;
    }
    let mode = endpoint.map_or(UseMode::Both, |endpoint| {
        rules.decide(&settings.program, role, endpoint.ip(), endpoint.port())
    });
    match mode {
        UseMode::Tcp => Bypass::ConfigSaysTcp,
        _ if settings.san => Bypass::None,
        UseMode::San => {
            tracing::warn!(
                ?endpoint,
                "rule requires SAN, but no SAN provider is available; using TCP"
            );
            Bypass::NoProvider
        }
        _ => Bypass::NoProvider,
    }
}

/// The default of [`wait_slice_ms`]: odd, so that the servicing between slices does not line
/// up with round-numbered timers.
const DEFAULT_WAIT_SLICE_MS: c_int = 239;

static WAIT_SLICE: AtomicI32 = AtomicI32::new(DEFAULT_WAIT_SLICE_MS);

/// Longest single kernel wait (epoll, poll, a blocking SAN call) while SAN sockets are alive:
/// after it every SAN socket of the process is serviced once, so that a wake-up that never
/// came would cost this much latency instead of a hang. Every wake-up the tests know of is
/// delivered without it (they run with `SANDIRECT_WAIT_SLICE_MS=600000` in CI); it stays as
/// a safety net. A signal that lands between two slices (a few µs of servicing) does not
/// interrupt the wait.
pub fn wait_slice_ms() -> c_int {
    WAIT_SLICE.load(Ordering::Relaxed)
}

/// The default of [`poll_us`].
const DEFAULT_POLL_US: u32 = 50;

static POLL: AtomicU32 = AtomicU32::new(DEFAULT_POLL_US);

/// Longest time, in microseconds, an epoll, poll or select wait looks at the SAN sockets a
/// read just emptied for their next message before it sleeps (0: never). Waking a sleeping thread
/// costs tens of microseconds on virtual machines, more than a request/response round trip
/// over shared memory; the wait adapts below this bound to how often looking pays off.
pub fn poll_us() -> u32 {
    POLL.load(Ordering::Relaxed)
}

/// The default of [`short_connection_bytes`].
const DEFAULT_SHORT_BYTES: u32 = 1024;

static SHORT_BYTES: AtomicU32 = AtomicU32::new(DEFAULT_SHORT_BYTES);

/// A client connection that carried fewer bytes than this (sent and received, over either
/// path) counts as short; 0 turns the prediction off (see `san::history`).
pub fn short_connection_bytes() -> u32 {
    SHORT_BYTES.load(Ordering::Relaxed)
}

/// [`wait_slice_ms`] as a duration.
pub fn wait_slice() -> Duration {
    Duration::from_millis(wait_slice_ms() as u64)
}

/// The next kernel wait of a sliced wait that ends at `deadline` (`None`: no end), in
/// milliseconds: at most one slice, and rounded *up* as the kernel rounds a timeout, so the
/// last sub-millisecond of a wait sleeps instead of returning at once (a 0 ms wait there made
/// every timed `epoll_wait` spin for up to a millisecond before its timeout).
pub fn next_slice_ms(deadline: Option<std::time::Instant>) -> c_int {
    let slice = wait_slice_ms();
    deadline.map_or(slice, |deadline| {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let ms = left.as_micros().div_ceil(1000);
        ms.min(slice as u128) as c_int
    })
}

/// Reads and parses a rules file; the message names file and line.
pub fn load_config(path: &std::path::Path) -> Result<Config, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| format!("cannot read config {}: {error}", path.display()))?;
    config::parse(&text, &path.display().to_string())
        .map_err(|error| format!("config error: {error}"))
}

fn program_name(argv0: Option<&CStr>) -> String {
    let from_argv = argv0.map(|arg| arg.to_string_lossy().into_owned());
    let full = from_argv
        .filter(|name| !name.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/self/comm")
                .ok()
                .map(|s| s.trim_end().to_owned())
        })
        .unwrap_or_default();
    full.rsplit('/').next().unwrap_or_default().to_owned()
}

/// Which SAN providers `SANDIRECT_SAN_PROVIDER` allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderChoice {
    /// Shared memory for same-host peers, verbs for peers reached through an RDMA device (the
    /// default: on a host without RDMA devices it costs what `Shm` does, see `san::verbs`).
    Auto,
    /// Shared memory only.
    Shm,
    /// Verbs only (the VM tests: their two "hosts" are one guest).
    Verbs,
}

/// `SANDIRECT_SAN_PROVIDER` (read once).
pub fn provider_choice() -> ProviderChoice {
    static CHOICE: OnceLock<ProviderChoice> = OnceLock::new();
    *CHOICE.get_or_init(|| provider_choice_setting(var(SAN_PROVIDER).as_deref()))
}

fn provider_choice_setting(value: Option<&str>) -> ProviderChoice {
    match value {
        Some("auto") | None => ProviderChoice::Auto,
        Some("verbs") => ProviderChoice::Verbs,
        Some("shm") => ProviderChoice::Shm,
        Some(other) => {
            eprintln!("sandirect: {SAN_PROVIDER}={other:?} is not auto, shm or verbs; using auto");
            ProviderChoice::Auto
        }
    }
}

/// `SANDIRECT_SHM_DIR`: the segment directory, `None` for the default.
pub fn shm_dir() -> Option<PathBuf> {
    var_os(SHM_DIR).map(PathBuf::from)
}

/// `SANDIRECT_OTHER_USERS` (read once): the other users whose processes this process's
/// connections may use the SAN with; empty (the default) for none.
pub fn other_users() -> &'static [u32] {
    static USERS: OnceLock<Vec<u32>> = OnceLock::new();
    USERS.get_or_init(|| {
        let value = var(OTHER_USERS).unwrap_or_default();
        other_users_setting(&value).unwrap_or_else(|| {
            eprintln!("sandirect: {OTHER_USERS}={value:?} is not a list of uids; ignored");
            Vec::new()
        })
    })
}

/// Parses a `SANDIRECT_OTHER_USERS` value: uids separated by commas (blanks around them
/// ignored); `None` when one is not a uid.
fn other_users_setting(value: &str) -> Option<Vec<u32>> {
    value
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| part.parse::<u32>().ok().filter(|&uid| uid != u32::MAX))
        .collect()
}

/// `SANDIRECT_SAN_RENDEZVOUS`: false when set to `0`.
pub fn rendezvous_allowed() -> bool {
    var_os(SAN_RENDEZVOUS).is_none_or(|v| v != "0")
}

/// `SANDIRECT_SAN_RDMA_READ`: `Some(false)` for `0`, `Some(true)` for `1`, `None` (the
/// device's default) when unset or anything else.
pub fn rdma_read() -> Option<bool> {
    rdma_read_setting(var_os(SAN_RDMA_READ).as_deref())
}

fn rdma_read_setting(value: Option<&std::ffi::OsStr>) -> Option<bool> {
    match value.and_then(|v| v.to_str()).map(str::trim) {
        Some("0") => Some(false),
        Some("1") => Some(true),
        _ => None,
    }
}

/// `SANDIRECT_SAN_MEMORY_MB` (read once), in bytes: the most memory this process holds for
/// SAN connections at once (see `san::budget`). By default the larger of 1 GiB and a quarter
/// of the host's RAM: with ≈15 MiB charged per shm connection, at least ≈70 connections,
/// and on a host of 16 GiB ≈270; the connections past it stay on TCP.
pub fn san_memory_budget() -> u64 {
    static BUDGET: OnceLock<u64> = OnceLock::new();
    *BUDGET.get_or_init(|| {
        let set = var(SAN_MEMORY_MB).and_then(|v| match v.trim().parse::<u64>() {
            Ok(mb) => Some(mb),
            Err(_) => {
                eprintln!(
                    "sandirect: {SAN_MEMORY_MB}={v:?} is not a number of MiB; using the default"
                );
                None
            }
        });
        memory_budget(set, physical_memory())
    })
}

/// The budget in bytes for a setting of `set` MiB (`None`: the default) on a host of
/// `ram` bytes (`None`: unknown).
fn memory_budget(set: Option<u64>, ram: Option<u64>) -> u64 {
    set.map_or_else(
        || (1 << 30).max(ram.unwrap_or(0) / 4),
        |mb| mb.saturating_mul(1 << 20),
    )
}

/// The host's RAM in bytes, when the system says.
fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf(3) only reads system values.
    let (pages, page_size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    (pages > 0 && page_size > 0).then(|| (pages as u64).saturating_mul(page_size as u64))
}

/// The default poll budget of a blocked verbs reader. One poll round (the socket's lock, the
/// provider's completion-queue poll, the session's readability) is ~500 instructions: 1024
/// rounds are ~150 µs on current hardware, a few times the cost of waking an idle vCPU there
/// (~35 µs), which is about what an answer over RDMA takes at most when the peer answers at
/// once. Counted in polls rather than time, the budget needs no clock read per round (in the
/// soft-RDMA guest a clock read is a system call) and scales with the machine's speed; under
/// that guest's emulation 1024 rounds are ~1-2 ms, and 256 proved too few there (half the polls
/// of a ping-pong ran out, and the round trip swung between the polled and the sleeping
/// figure).
const DEFAULT_VERBS_POLLS: u32 = 1024;

/// `SANDIRECT_VERBS_POLLS` (read once): how many rounds a blocked verbs reader polls.
pub fn verbs_polls() -> u32 {
    static POLLS: OnceLock<u32> = OnceLock::new();
    *POLLS.get_or_init(|| {
        var(VERBS_POLLS)
            .and_then(|v| v.trim().parse::<u32>().ok())
            .map_or(DEFAULT_VERBS_POLLS, |polls| polls.min(1 << 20))
    })
}

/// `SANDIRECT_VERBS_TIMEOUT_MS` (read once): the bound on one verbs connection set-up.
pub fn verbs_setup_timeout() -> Duration {
    static TIMEOUT: OnceLock<Duration> = OnceLock::new();
    *TIMEOUT.get_or_init(|| {
        var(VERBS_TIMEOUT_MS)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(Duration::from_millis(3000), Duration::from_millis)
    })
}

/// `SANDIRECT_VERBS_LIBRARY`: the verbs provider library, `None` for the default name.
pub fn verbs_library() -> Option<PathBuf> {
    var_os(VERBS_LIBRARY).map(PathBuf::from)
}

/// `SANDIRECT_SAN_REFUSE_REGISTRATIONS`: how many registrations to refuse (testing).
pub fn refused_registrations() -> u64 {
    var(SAN_REFUSE_REGISTRATIONS)
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::path::Path;

    #[test]
    fn modes_parse() {
        assert_eq!(Mode::parse("off"), Some(Mode::Off));
        assert_eq!(Mode::parse("tcp"), Some(Mode::Tcp));
        assert_eq!(Mode::parse("auto"), Some(Mode::Auto));
        assert_eq!(Mode::parse("fast"), None);
    }

    #[test]
    fn rdma_read_parses_only_0_and_1() {
        use std::ffi::OsStr;
        assert_eq!(rdma_read_setting(Some(OsStr::new("0"))), Some(false));
        assert_eq!(rdma_read_setting(Some(OsStr::new(" 1 "))), Some(true));
        assert_eq!(rdma_read_setting(Some(OsStr::new("yes"))), None);
        assert_eq!(rdma_read_setting(None), None);
    }

    #[test]
    fn memory_budget_is_the_setting_or_the_larger_of_1_gib_and_a_quarter_of_ram() {
        assert_eq!(memory_budget(Some(12), Some(64 << 30)), 12 << 20);
        assert_eq!(memory_budget(Some(0), None), 0);
        assert_eq!(memory_budget(Some(u64::MAX), None), u64::MAX);
        assert_eq!(memory_budget(None, Some(2 << 30)), 1 << 30);
        assert_eq!(memory_budget(None, Some(64 << 30)), 16 << 30);
        assert_eq!(memory_budget(None, None), 1 << 30);
        assert!(physical_memory().is_some_and(|ram| ram > 0));
    }

    #[test]
    fn program_name_is_the_basename() {
        assert_eq!(program_name(Some(c"/usr/bin/redis-server")), "redis-server");
        assert_eq!(program_name(Some(c"curl")), "curl");
        assert!(
            !program_name(None).is_empty(),
            "falls back to /proc/self/comm"
        );
    }

    #[test]
    fn load_config_reports_file_and_line() {
        let dir = std::env::temp_dir().join(format!("sandirect-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.conf");
        std::fs::write(&path, "use tcp any * *:*\nuse sun any * *:*\n").unwrap();
        let message = load_config(&path).unwrap_err();
        assert!(
            message.contains(&format!("{}:2:", path.display())),
            "{message}"
        );
        assert!(load_config(&dir.join("missing.conf"))
            .unwrap_err()
            .contains("cannot read config"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// In a privileged process (`AT_SECURE`) only the variables that narrow what the library
    /// does are read: none naming a path, choosing a provider or tuning it.
    #[test]
    fn privileged_processes_read_only_narrowing_variables() {
        for knob in KNOBS {
            assert!(honoured(knob.name, false), "{} unprivileged", knob.name);
        }
        let read: BTreeSet<&str> = KNOBS
            .iter()
            .map(|knob| knob.name)
            .filter(|name| honoured(name, true))
            .collect();
        assert_eq!(read, BTreeSet::from([MODE, SAN, SAN_RENDEZVOUS]));
        for name in [
            CONFIG,
            LOG,
            STAT_DIR,
            SHM_DIR,
            VERBS_LIBRARY,
            STASHES,
            SAN_PROVIDER,
        ] {
            assert!(
                !honoured(name, true),
                "{name} must not be read when privileged"
            );
        }
        assert!(
            !honoured(concat!("SANDIRECT_", "X"), true),
            "an unknown name"
        );
    }

    fn workspace() -> &'static Path {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
    }

    /// Every `SANDIRECT_[A-Z_]+` name in `text`.
    fn names_in(text: &str, out: &mut BTreeSet<String>) {
        let mut rest = text;
        while let Some(at) = rest.find("SANDIRECT_") {
            let tail = &rest[at..];
            let len = tail
                .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
                .unwrap_or(tail.len());
            let name = tail[..len].trim_end_matches('_');
            if name.len() > "SANDIRECT_".len() {
                out.insert(name.to_owned());
            }
            rest = &tail[len..];
        }
    }

    fn knob_names() -> BTreeSet<String> {
        KNOBS.iter().map(|k| k.name.to_owned()).collect()
    }

    #[test]
    fn knobs_are_unique_and_documented() {
        assert_eq!(
            knob_names().len(),
            KNOBS.len(),
            "a variable is listed twice"
        );
        for knob in KNOBS {
            assert!(knob.name.starts_with("SANDIRECT_"), "{}", knob.name);
            assert!(
                !knob.values.is_empty() && !knob.default.is_empty() && !knob.effect.is_empty(),
                "{} lacks values, default or effect",
                knob.name
            );
        }
    }

    #[test]
    fn other_users_are_a_list_of_uids() {
        assert_eq!(other_users_setting(""), Some(vec![]));
        assert_eq!(
            other_users_setting(" 65534, 1001 ,"),
            Some(vec![65534, 1001])
        );
        assert_eq!(other_users_setting("0"), Some(vec![0]));
        assert_eq!(other_users_setting("nobody"), None);
        assert_eq!(other_users_setting("4294967295"), None);
        assert_eq!(other_users_setting("-1"), None);
    }

    /// Unset, the providers are chosen per peer (`auto`); `shm` and `verbs` stay choices.
    #[test]
    fn the_provider_is_chosen_per_peer_unless_set() {
        assert_eq!(provider_choice_setting(None), ProviderChoice::Auto);
        assert_eq!(provider_choice_setting(Some("auto")), ProviderChoice::Auto);
        assert_eq!(provider_choice_setting(Some("shm")), ProviderChoice::Shm);
        assert_eq!(
            provider_choice_setting(Some("verbs")),
            ProviderChoice::Verbs
        );
        assert_eq!(provider_choice_setting(Some("rdma")), ProviderChoice::Auto);
        let knob = KNOBS.iter().find(|k| k.name == SAN_PROVIDER).unwrap();
        assert_eq!(knob.default, "auto");
    }

    /// README's settings table lists exactly the variables of [`KNOBS`].
    #[test]
    fn readme_table_lists_every_knob() {
        let readme = std::fs::read_to_string(workspace().join("README.md")).unwrap();
        let mut in_table = BTreeSet::new();
        for line in readme.lines().filter(|l| l.starts_with("| `SANDIRECT_")) {
            names_in(line.split('|').nth(1).unwrap_or_default(), &mut in_table);
        }
        assert_eq!(
            in_table,
            knob_names(),
            "README.md's settings table (rows `| `SANDIRECT_…` | …`) differs from settings::KNOBS"
        );
    }

    /// No library or command code names a variable that [`KNOBS`] does not list.
    #[test]
    fn code_reads_no_unlisted_variable() {
        fn walk(dir: &Path, out: &mut BTreeSet<String>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let name = entry.file_name();
                // Test harnesses under `tests/` have variables of their own.
                if name == "target" || name == "tests" || name.to_string_lossy().starts_with('.') {
                    continue;
                }
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    names_in(&std::fs::read_to_string(&path).unwrap_or_default(), out);
                }
            }
        }
        let mut used = BTreeSet::new();
        for crate_dir in ["preload", "providers", "cli"] {
            walk(&workspace().join(crate_dir), &mut used);
        }
        let listed = knob_names();
        let unlisted: Vec<_> = used.difference(&listed).collect();
        assert!(
            unlisted.is_empty(),
            "named in code but not in settings::KNOBS: {unlisted:?}"
        );
    }
}
