//! Peers in different pid namespaces (a container sharing the host's network namespace and
//! segment directory): the intra-host SAN names each peer as the kernel names it to the other
//! side (`SO_PEERCRED`'s translated pid, a pidfd passed over the exchange), never by the pid the
//! peer recorded in the segment, which means nothing (or another process) across namespaces.
//! A preloaded `san_echo` pair, one end run under `unshare --pid --fork --mount-proc`, streams
//! both ways for about two seconds (many periodic liveness checks) over the SAN: every byte
//! intact, no reset; meanwhile `sandirect stat` shows both ends with the pids this namespace
//! knows them by. Skipped where pid namespaces cannot be made.

use std::io::BufReader;
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
/// Held by each pair while it runs. The two tests' programs in child namespaces call
/// themselves by the same small pid; started in the same clock tick (the tests run at once),
/// the stats reader cannot tell which host pid is which (a known limit of statistics records
/// across pid namespaces, docs/ARCHITECTURE.md), and each test's reading may name the other's
/// process.
static ONE_PAIR_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn paced_echo(name: &str, server_in_namespace: bool) -> Option<(String, String)> {
    if let Some(why) = pid_namespaces_unavailable() {
        eprintln!("SKIPPED: no pid namespace here ({why})");
        return None;
    }
    let _one_at_a_time = ONE_PAIR_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dirs = Dirs::new(name);
    let mut server = san_echo(&["server", "paced"], server_in_namespace, &dirs)
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(server.stdout.take().unwrap());
    let port = integration::read_port(&mut reader);
    let client = san_echo(
        &["client", &port, "paced", &BYTES.to_string()],
        !server_in_namespace,
        &dirs,
    )
    .spawn()
    .unwrap();
    let (inside, outside) = if server_in_namespace {
        (server.id(), client.id())
    } else {
        (client.id(), server.id())
    };
    let stat = watch_stat(&dirs, &port, inside, outside);
    let client_result = integration::wait_child(client, "client", Duration::from_secs(60));
    server.stdout = Some(reader.into_inner());
    let server_wait = Duration::from_secs(if client_result.is_ok() { 60 } else { 10 });
    let server_result = integration::wait_child(server, "server", server_wait);
    match (server_result, client_result) {
        (Ok(server), Ok(client)) => {
            if let Err(failure) = stat {
                panic!("sandirect stat while the pair streamed: {failure}");
            }
            Some((server, client))
        }
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

/// While the pair streams: `sandirect stat`, reading the stats directory both ends publish
/// into, shows both ends' connections on SAN-shm, each with the pid this (the parent) namespace
/// knows it by: `outside`'s own, and that of the program `unshare` (pid `inside`) started in the
/// child namespace, which calls itself by another pid there and names its stats file by it.
/// Twice in a row: the first reading must not have taken that file for a dead process's and
/// removed it. Samples every 0.1 s for at most 10 s.
fn watch_stat(dirs: &Dirs, port: &str, inside: u32, outside: u32) -> Result<(), String> {
    let suffix = format!(":{port}");
    let mut last = String::new();
    let mut in_a_row = 0;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(100));
        let children = format!("/proc/{inside}/task/{inside}/children");
        let Some(program) = std::fs::read_to_string(children)
            .ok()
            .and_then(|pids| pids.split_whitespace().next()?.parse::<u32>().ok())
        else {
            continue;
        };
        let output = Command::new(&integration::apps::products().cli)
            .arg("stat")
            .env("SANDIRECT_STAT_DIR", dirs.base.join("stat"))
            .output()
            .map_err(|e| format!("sandirect stat: {e}"))?;
        last = String::from_utf8_lossy(&output.stdout).into_owned();
        // PID FD STATE ROLE LOCAL PEER PATH …
        let on_the_san = |pid: u32| {
            last.lines().skip(1).any(|line| {
                let columns: Vec<&str> = line.split_whitespace().collect();
                columns.len() > 6
                    && columns[0] == pid.to_string()
                    && (columns[4].ends_with(&suffix) || columns[5].ends_with(&suffix))
                    && columns[6] == "SAN-shm"
            })
        };
        if on_the_san(program) && on_the_san(outside) {
            in_a_row += 1;
            if in_a_row == 2 {
                return Ok(());
            }
        } else {
            in_a_row = 0;
        }
    }
    Err(format!(
        "never both ends on SAN-shm with this namespace's pids (outside {outside}, inside a \
         child of {inside}) twice in a row; last:\n{last}"
    ))
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
