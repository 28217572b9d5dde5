//! `sandirect`: run programs under the interposer, list their connections, check configs.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use preload_core::record::{flags, Counter, SocketState};
use preload_core::{inventory, settings, stats};

#[derive(Parser)]
#[command(
    name = "sandirect",
    version,
    about = "Sockets Direct for Linux: carry TCP over a SAN, transparently"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a command with libsandirect.so preloaded.
    Run {
        /// Rules file (validated before the command starts).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Log level for the library: error, warn, info, debug, trace.
        #[arg(long, value_name = "LEVEL")]
        log: Option<String>,
        /// auto (rules decide), tcp (track, never upgrade) or off (pure passthrough).
        #[arg(long, value_name = "MODE")]
        mode: Option<String>,
        /// The command and its arguments.
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CMD"
        )]
        command: Vec<OsString>,
    },
    /// List live connections of this user's preloaded processes (run as root with the default
    /// directory: every user's, containers' included, with the pids this host knows them by,
    /// as `ss -p` does).
    Stat {
        /// Also list listeners and not-yet-connected sockets.
        #[arg(short, long)]
        all: bool,
        /// Keep stale files of dead processes instead of removing them.
        #[arg(long)]
        keep_stale: bool,
    },
    /// Validate a rules file.
    CheckConfig {
        /// The file.
        file: PathBuf,
    },
    /// Print the interposed-symbol inventory.
    Symbols {
        /// Only the sorted names (what `nm -D --defined-only` must show).
        #[arg(long)]
        names: bool,
    },
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Run {
            config,
            log,
            mode,
            command,
        } => run(config, log, mode, command),
        Command::Stat { all, keep_stale } => stat(all, !keep_stale),
        Command::CheckConfig { file } => check_config(&file),
        Command::Symbols { names } => {
            if names {
                for name in inventory::exported_names() {
                    println!("{name}");
                }
            } else {
                print!("{}", inventory::markdown_table());
            }
            ExitCode::SUCCESS
        }
    }
}

/// Where the library is: `SANDIRECT_LIB`, next to this binary, `../lib` beside it, or the
/// cargo target directory this binary was built from.
fn find_library() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(settings::LIB) {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!("SANDIRECT_LIB={} does not exist", path.display()))
        };
    }
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot locate the sandirect binary: {e}"))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    let build_dir = option_env!("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join(profile);
    let candidates = [
        dir.join("libsandirect.so"),
        dir.join("../lib/libsandirect.so"),
        dir.join("../lib/sandirect/libsandirect.so"),
        build_dir.join("libsandirect.so"),
    ];
    candidates.iter().find(|path| path.is_file()).cloned().ok_or_else(|| {
        format!(
            "libsandirect.so not found next to {} (build it with `cargo build -p sandirect-preload`, or set SANDIRECT_LIB)",
            exe.display()
        )
    })
}

fn run(
    config: Option<PathBuf>,
    log: Option<String>,
    mode: Option<String>,
    command: Vec<OsString>,
) -> ExitCode {
    let library = match find_library() {
        Ok(library) => library,
        Err(message) => {
            eprintln!("sandirect: {message}");
            return ExitCode::from(2);
        }
    };
    if let Some(mode) = &mode {
        if settings::Mode::parse(mode).is_none() {
            eprintln!("sandirect: --mode must be auto, tcp or off, not {mode:?}");
            return ExitCode::from(2);
        }
    }
    if let Some(level) = &log {
        if level.parse::<tracing_level::Level>().is_err() {
            eprintln!("sandirect: --log must be error, warn, info, debug or trace, not {level:?}");
            return ExitCode::from(2);
        }
    }
    let Some((program, args)) = command.split_first() else {
        eprintln!("sandirect: no command given");
        return ExitCode::from(2);
    };
    let mut child = std::process::Command::new(program);
    child.args(args);
    if let Some(config) = config {
        if let Err(message) = settings::load_config(&config) {
            eprintln!("sandirect: {message}");
            return ExitCode::from(2);
        }
        let absolute = std::fs::canonicalize(&config).unwrap_or(config);
        child.env(settings::CONFIG, absolute);
    }
    if let Some(level) = log {
        child.env(settings::LOG, level);
    }
    if let Some(mode) = mode {
        child.env(settings::MODE, mode);
    }
    let mut preload = library.into_os_string();
    if let Some(existing) = std::env::var_os("LD_PRELOAD").filter(|value| !value.is_empty()) {
        preload.push(":");
        preload.push(existing);
    }
    child.env("LD_PRELOAD", preload);
    let error = child.exec();
    eprintln!(
        "sandirect: cannot run {}: {error}",
        program.to_string_lossy()
    );
    ExitCode::from(127)
}

fn check_config(file: &Path) -> ExitCode {
    match settings::load_config(file) {
        Ok(config) => {
            println!("{}: {} rule(s), valid", file.display(), config.rules.len());
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("sandirect: {message}");
            ExitCode::FAILURE
        }
    }
}

fn address(addr: Option<std::net::SocketAddr>) -> String {
    addr.map_or_else(|| "-".into(), |a| a.to_string())
}

fn stat(all: bool, remove_stale: bool) -> ExitCode {
    let dirs = stats::directories_to_list();
    if dirs.is_empty() {
        eprintln!("sandirect: publication is off (SANDIRECT_STAT_DIR=off)");
        return ExitCode::FAILURE;
    }
    let mut connections = Vec::new();
    for (dir, own) in dirs {
        match stats::read_dir(&dir, remove_stale && own) {
            Ok(found) => connections.extend(found),
            // Another user's directory that cannot be read says nothing about ours.
            Err(_) if !own => {}
            Err(error) => {
                eprintln!("sandirect: cannot read {}: {error}", dir.display());
                return ExitCode::FAILURE;
            }
        }
    }
    // Processes of other mount namespaces (containers), read through their roots. One that
    // also publishes where the reader looked already (a directory shared with the host) is
    // listed once.
    connections.extend(stats::other_mount_namespaces());
    connections.sort_by_key(|c| (c.pid, c.fd));
    connections.dedup_by_key(|c| (c.pid, c.fd));
    println!(
        "{:>7} {:>5} {:<9} {:<6} {:<24} {:<24} {:<9} {:>10} {:>10} {:>10} {:>10} REASON",
        "PID",
        "FD",
        "STATE",
        "ROLE",
        "LOCAL",
        "PEER",
        "PATH",
        "TCP-TX",
        "TCP-RX",
        "INLINE",
        "RENDEZVOUS"
    );
    for c in connections
        .iter()
        .filter(|c| all || matches!(c.state, SocketState::ConnectedTcp | SocketState::San))
    {
        let state = match c.state {
            SocketState::TcpCandidate => "candidate",
            SocketState::Listener => "listen",
            SocketState::ConnectedTcp | SocketState::San if c.flags & flags::CONNECTING != 0 => {
                "connecting"
            }
            SocketState::ConnectedTcp | SocketState::San => "connected",
            _ => "?",
        };
        let role = if c.flags & flags::CLIENT != 0 {
            "client"
        } else if c.flags & flags::SERVER != 0 {
            "server"
        } else {
            "-"
        };
        let inline = c.counter(Counter::SanInlineSent) + c.counter(Counter::SanInlineReceived);
        let rendezvous =
            c.counter(Counter::SanRendezvousSent) + c.counter(Counter::SanRendezvousReceived);
        let reason = if c.state == SocketState::ConnectedTcp {
            c.bypass.label()
        } else {
            "-"
        };
        println!(
            "{:>7} {:>5} {:<9} {:<6} {:<24} {:<24} {:<9} {:>10} {:>10} {:>10} {:>10} {}",
            c.pid,
            c.fd,
            state,
            role,
            address(c.local),
            address(c.peer),
            c.path.label(),
            c.counter(Counter::TcpSent),
            c.counter(Counter::TcpReceived),
            inline,
            rendezvous,
            reason
        );
    }
    ExitCode::SUCCESS
}

/// Log-level validation without pulling tracing into the CLI.
mod tracing_level {
    /// A valid `SANDIRECT_LOG` level.
    pub struct Level;

    impl std::str::FromStr for Level {
        type Err = ();
        fn from_str(text: &str) -> Result<Self, ()> {
            matches!(
                text.to_ascii_lowercase().as_str(),
                "error" | "warn" | "info" | "debug" | "trace"
            )
            .then_some(Level)
            .ok_or(())
        }
    }
}
