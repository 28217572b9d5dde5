//! Peers in different pid namespaces (a container sharing the host's network namespace and
//! segment directory): the intra-host SAN names each peer as the kernel names it to the other
//! side (`SO_PEERCRED`'s translated pid, a pidfd passed over the exchange), never by the pid the
//! peer recorded in the segment, which means nothing (or another process) across namespaces.
//! A preloaded `san_echo` pair, one end run under `unshare --pid --fork --mount-proc`, streams
//! both ways for about two seconds (many periodic liveness checks) over the SAN: every byte
//! intact, no reset. Skipped where pid namespaces cannot be made.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const SAN_ECHO: &str = env!("CARGO_BIN_EXE_san_echo");

/// What the client streams (and gets back).
const BYTES: usize = 4 << 20;

/// `libsandirect.so`, built once per test run (same profile as this test).
fn library() -> &'static Path {
    &integration::apps::products().library
}

/// Private stats and segment directories for one test (both ends see them: the mount
/// namespace `--mount-proc` needs starts as a copy of ours).
struct Dirs {
    base: PathBuf,
}

impl Dirs {
    fn new(name: &str) -> Dirs {
        let base =
            std::env::temp_dir().join(format!("sandirect-pidns-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        for sub in ["", "stat", "shm"] {
            let dir = base.join(sub);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .unwrap();
        }
        Dirs { base }
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

/// Why no pid namespace can be had here, if none can.
fn pid_namespaces_unavailable() -> Option<String> {
    match Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
    {
        Ok(out) if out.status.success() => None,
        Ok(out) => Some(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
        Err(error) => Some(format!("unshare: {error}")),
    }
}

/// `san_echo ARGS` under the preload, in a new pid namespace when `own_namespace`.
fn san_echo(args: &[&str], own_namespace: bool, dirs: &Dirs) -> Command {
    let mut command = if own_namespace {
        let mut command = Command::new("unshare");
        // `env` sets the preload for the program only, not for `unshare`.
        command
            .args(["--pid", "--fork", "--mount-proc", "env"])
            .arg(format!("LD_PRELOAD={}", library().display()))
            .arg(SAN_ECHO);
        command.env_remove("LD_PRELOAD");
        command
    } else {
        let mut command = Command::new(SAN_ECHO);
        command.env("LD_PRELOAD", library());
        command
    };
    command
        .args(args)
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env("SANDIRECT_STAT_DIR", dirs.base.join("stat"))
        .env("SANDIRECT_SHM_DIR", dirs.base.join("shm"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// A preloaded `paced` echo between a server and a client, the one named by
/// `server_in_namespace` in a pid namespace of its own; returns (server, client) reports.
fn paced_echo(name: &str, server_in_namespace: bool) -> Option<(String, String)> {
    if let Some(why) = pid_namespaces_unavailable() {
        eprintln!("SKIPPED: no pid namespace here ({why})");
        return None;
    }
    let dirs = Dirs::new(name);
    let mut server = san_echo(&["server", "paced"], server_in_namespace, &dirs)
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(server.stdout.take().unwrap());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    let port = first
        .trim()
        .strip_prefix("port ")
        .unwrap_or_else(|| panic!("server prints its port, got {first:?}"))
        .to_owned();
    let client = san_echo(
        &["client", &port, "paced", &BYTES.to_string()],
        !server_in_namespace,
        &dirs,
    )
    .spawn()
    .unwrap();
    let client_result = integration::wait_child(client, "client", Duration::from_secs(60));
    server.stdout = Some(reader.into_inner());
    let server_wait = Duration::from_secs(if client_result.is_ok() { 60 } else { 10 });
    let server_result = integration::wait_child(server, "server", server_wait);
    match (server_result, client_result) {
        (Ok(server), Ok(client)) => Some((server, client)),
        (server, client) => {
            let shown = |result: Result<String, String>| result.unwrap_or_else(|failure| failure);
            panic!(
                "paced echo across pid namespaces:\n--- server: {}\n--- client: {}",
                shown(server),
                shown(client)
            );
        }
    }
}

/// The report line of `side` says every byte came through intact over the SAN.
fn expect_intact_over_the_san(report: &str, side: &str) {
    let line = report
        .lines()
        .find(|l| l.starts_with(side))
        .unwrap_or_else(|| panic!("no {side} line in {report}"));
    assert!(line.contains(&format!("ok bytes={BYTES} ")), "{line}");
    assert!(line.ends_with("path=san-shm"), "{line}");
}

#[test]
fn a_client_in_a_child_pid_namespace_streams_over_the_san() {
    let Some((server, client)) = paced_echo("client-inside", false) else {
        return;
    };
    expect_intact_over_the_san(&server, "server");
    expect_intact_over_the_san(&client, "client");
}

#[test]
fn a_server_in_a_child_pid_namespace_streams_over_the_san() {
    let Some((server, client)) = paced_echo("server-inside", true) else {
        return;
    };
    expect_intact_over_the_san(&server, "server");
    expect_intact_over_the_san(&client, "client");
}
