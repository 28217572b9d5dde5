//! Process-wide settings, the constructor's work, fork handling and logging.
//!
//! # Environment
//!
//! | variable | values | effect |
//! |---|---|---|
//! | `SANDIRECT_MODE` | `auto` (default), `tcp`, `off` | `off`: track nothing, pure passthrough; `tcp`: track, never upgrade; `auto`: the rules decide |
//! | `SANDIRECT_CONFIG` | path | the rules file ([`crate::config`]) |
//! | `SANDIRECT_LOG` | `error`, `warn`, `info`, `debug`, `trace` | `tracing` output on stderr (off by default, and then free) |
//! | `SANDIRECT_STAT_DIR` | path or `off` | where live connections are published (default `/dev/shm/sandirect-$UID`) |
//! | `SANDIRECT_WAIT_SLICE_MS` | 1..=600000 (default 239) | longest single kernel wait while SAN sockets are alive ([`wait_slice_ms`]); tests set it high to prove that no wake-up depends on the slices |
//!
//! # Lifetime
//!
//! * **Constructor** ([`init`]): resolve every real function, read the environment and the
//!   rules, install logging, register the `pthread_atfork` child handler. All of it inside the
//!   reentrancy guard.
//! * **fork**: the child handler ([`after_fork_in_child`]) gives the child its own stats file
//!   and marks inherited sockets; SAN sessions are downgraded to TCP in the child (counted,
//!   reason `after-fork`) because a session cannot be shared by two processes while the kernel
//!   anchor can. The library holds no locks of its own, so no lock can be left held by a thread
//!   that does not exist in the child; the log writer is a raw `write(2)` for the same reason.
//! * **exec**: nothing survives but fds. The new image initialises from scratch and sees
//!   inherited sockets as not ours (plain passthrough).

use core::ffi::c_int;
use std::ffi::CStr;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::config::{self, Config, Role, UseMode};
use crate::guard::ReentrancyGuard;
use crate::record::Bypass;
use crate::{real, registry};

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

/// False when `SANDIRECT_MODE=off`: no socket is tracked.
#[inline(always)]
pub fn tracking_enabled() -> bool {
    TRACKING.load(Ordering::Relaxed)
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

/// The constructor's work. `argv0` comes from the `.init_array` arguments when available.
pub fn init(argv0: Option<&CStr>) {
    real::resolve_all();
    let _guard = ReentrancyGuard::enter();
    let result = std::panic::catch_unwind(|| init_guarded(argv0));
    if result.is_err() {
        // Never take the host down: stay a passthrough library.
        TRACKING.store(false, Ordering::Relaxed);
    }
}

fn init_guarded(argv0: Option<&CStr>) {
    install_logging(std::env::var("SANDIRECT_LOG").ok().as_deref());
    let mode = match std::env::var("SANDIRECT_MODE") {
        Err(_) => Mode::Auto,
        Ok(value) => Mode::parse(&value).unwrap_or_else(|| {
            eprintln!("sandirect: SANDIRECT_MODE={value:?} is not auto, tcp or off; using auto");
            Mode::Auto
        }),
    };
    if mode == Mode::Off {
        TRACKING.store(false, Ordering::Relaxed);
    }
    let program = program_name(argv0);
    let rules = match std::env::var_os("SANDIRECT_CONFIG") {
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
    let san = std::env::var("SANDIRECT_SAN").map_or(true, |value| value != "0");
    if let Ok(value) = std::env::var("SANDIRECT_WAIT_SLICE_MS") {
        match value.parse::<c_int>() {
            Ok(ms) if (1..=600_000).contains(&ms) => WAIT_SLICE_MS.store(ms, Ordering::Relaxed),
            _ => eprintln!(
                "sandirect: SANDIRECT_WAIT_SLICE_MS={value:?} is not 1..=600000; using {DEFAULT_WAIT_SLICE_MS}"
            ),
        }
    }
    let _ = SETTINGS.set(Settings {
        mode,
        program,
        rules,
        san,
    });
    note_process_id();
    // SAFETY: registering a plain extern "C" handler.
    unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    // Bytes a downgraded socket had received before the image that exec'd us: they come
    // before anything on TCP, whatever our own settings (the variable is ours alone).
    if let Some(stashes) = std::env::var_os(crate::san::STASH_ENV) {
        std::env::remove_var(crate::san::STASH_ENV);
        crate::san::adopt_stashes(&stashes.to_string_lossy());
    }
}

/// The default of [`wait_slice_ms`]: odd, so that the servicing between slices does not line
/// up with round-numbered timers.
const DEFAULT_WAIT_SLICE_MS: c_int = 239;

static WAIT_SLICE_MS: core::sync::atomic::AtomicI32 =
    core::sync::atomic::AtomicI32::new(DEFAULT_WAIT_SLICE_MS);

/// Longest single kernel wait (epoll, poll, a blocking SAN call) while SAN sockets are alive:
/// after it every SAN socket of the process is serviced once, so that a wake-up that never
/// came would cost this much latency instead of a hang. Every wake-up the tests know of is
/// delivered without it (they run with `SANDIRECT_WAIT_SLICE_MS=600000` in CI); it stays as
/// a safety net. A signal that lands between two slices (a few µs of servicing) does not
/// interrupt the wait.
pub fn wait_slice_ms() -> c_int {
    WAIT_SLICE_MS.load(Ordering::Relaxed)
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

/// The pid of this process as of init or its last `fork` (a `vfork` child, which shares our
/// memory, sees its parent's).
static PROCESS_ID: core::sync::atomic::AtomicI32 = core::sync::atomic::AtomicI32::new(0);

/// Records the process id (init and fork child).
fn note_process_id() {
    // SAFETY: getpid has no preconditions.
    PROCESS_ID.store(unsafe { libc::getpid() }, Ordering::Relaxed);
}

/// True in a `vfork` child: it runs on its parent's memory, whose SAN state it must not touch.
pub fn in_vfork_child() -> bool {
    let noted = PROCESS_ID.load(Ordering::Relaxed);
    // SAFETY: getpid has no preconditions (no cache since glibc 2.25).
    noted != 0 && noted != unsafe { libc::getpid() }
}

/// Starts one of the library's own threads (the verbs service, the nudge responder) with
/// every signal blocked, so that a signal sent to the process is never delivered on it: the
/// application's handlers expect its own threads, and a program that blocks a signal in all
/// of its threads to take it with `sigwait`/`signalfd` would otherwise lose it to ours (the
/// new thread inherits the mask of its creator, which is restored right after). False when
/// the thread could not be created.
pub fn spawn_internal_thread(name: &str, body: impl FnOnce() + Send + 'static) -> bool {
    // SAFETY: sigset_t is plain data; sigfillset initialises it.
    let mut all: libc::sigset_t = unsafe { core::mem::zeroed() };
    // SAFETY: as above.
    let mut previous: libc::sigset_t = unsafe { core::mem::zeroed() };
    // SAFETY: sigfillset writes the set; pthread_sigmask reads `all` and writes `previous`.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut previous);
    }
    let started = std::thread::Builder::new()
        .name(name.into())
        .spawn(body)
        .is_ok();
    // SAFETY: restores this thread's mask as it was.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &previous, core::ptr::null_mut()) };
    started
}

/// `pthread_atfork` child handler. Async-signal-safe: syscalls and atomics only.
pub extern "C" fn after_fork_in_child() {
    note_process_id();
    registry::registry().after_fork_in_child();
    crate::san::after_fork_in_child();
    if let Some((read, write)) = unpack_pipe(FORK_SIGNAL.swap(NO_PIPE, Ordering::AcqRel)) {
        // SAFETY: one byte to the pipe our fork hook made; then our copies of it are closed.
        unsafe {
            libc::write(write, [1u8].as_ptr().cast(), 1);
            libc::close(write);
            libc::close(read);
        }
    }
}

/// The pipe of a fork in progress, both ends in one word (read end low, write end high), so
/// the child handler takes it with one atomic swap; [`NO_PIPE`] when none.
static FORK_SIGNAL: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(NO_PIPE);
const NO_PIPE: u64 = u64::MAX;

fn pack_pipe(read: c_int, write: c_int) -> u64 {
    u64::from(read as u32) | u64::from(write as u32) << 32
}

fn unpack_pipe(word: u64) -> Option<(c_int, c_int)> {
    (word != NO_PIPE).then_some((word as u32 as c_int, (word >> 32) as u32 as c_int))
}

/// The child's "my records are copied" signal to the parent of a fork (see `ops::fork`).
pub struct ForkSignal {
    read: c_int,
    write: c_int,
}

impl ForkSignal {
    /// A pipe whose ends the child's atfork handler takes; `None` if no pipe (or another fork
    /// of this process is in progress: that one keeps the signal).
    pub fn new() -> Option<ForkSignal> {
        let mut ends = [-1; 2];
        // SAFETY: plain pipe2(2) into our array.
        if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        // Owns the ends from here on: closed on drop, whatever happens next.
        let signal = ForkSignal {
            read: ends[0],
            write: ends[1],
        };
        FORK_SIGNAL
            .compare_exchange(
                NO_PIPE,
                signal.packed(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()
            .map(|_| signal)
    }

    fn packed(&self) -> u64 {
        pack_pipe(self.read, self.write)
    }

    /// No later fork may signal through this pipe (the parent's copy of the slot).
    fn disarm(&self) {
        let _ = FORK_SIGNAL.compare_exchange(
            self.packed(),
            NO_PIPE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Parent: waits (up to a second) until the child copied its records.
    pub fn wait_for_child(&self) {
        self.disarm();
        let mut entry = libc::pollfd {
            fd: self.read,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        unsafe { real::poll(&mut entry, 1, 1000) };
    }
}

impl Drop for ForkSignal {
    fn drop(&mut self) {
        self.disarm();
        // SAFETY: closing our own pipe ends.
        unsafe {
            real::close(self.read);
            real::close(self.write);
        }
    }
}

/// Destructor's work: stop publishing.
pub fn at_exit() {
    registry::registry().unpublish_at_exit();
}

fn install_logging(level: Option<&str>) {
    let Some(level) = level else { return };
    let Ok(parsed) = level.parse::<tracing::Level>() else {
        eprintln!("sandirect: SANDIRECT_LOG={level:?} is not a level (error..trace); logging off");
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(parsed)
        .with_ansi(false)
        .with_writer(|| RawStderr)
        .with_timer(WallClockAndPid)
        .try_init();
}

/// Log time stamps: wall-clock seconds (comparable across processes) and the pid, read at each
/// event (forked workers share a log: nginx's workers all write into one error log).
struct WallClockAndPid;

impl tracing_subscriber::fmt::time::FormatTime for WallClockAndPid {
    fn format_time(
        &self,
        w: &mut tracing_subscriber::fmt::format::Writer<'_>,
    ) -> core::fmt::Result {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        write!(w, "{:.6} pid={}", now.as_secs_f64(), std::process::id())
    }
}

/// stderr through a single `write(2)` per chunk: no lock (std's stderr lock could be left held
/// across fork), no buffering (one formatted event is one write).
struct RawStderr;

impl std::io::Write for RawStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // SAFETY: writing our own buffer to fd 2.
        let written = unsafe { real::write(2, buf.as_ptr().cast(), buf.len()) };
        if written < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(written as usize)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse() {
        assert_eq!(Mode::parse("off"), Some(Mode::Off));
        assert_eq!(Mode::parse("tcp"), Some(Mode::Tcp));
        assert_eq!(Mode::parse("auto"), Some(Mode::Auto));
        assert_eq!(Mode::parse("fast"), None);
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
}
