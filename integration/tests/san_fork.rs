//! fork and exec with SAN connections (fork, exec, dup): two
//! preloaded processes switch to the intra-host SAN, then the server forks (or forks and
//! execs) while bytes the client sent over the SAN are still unread. Every connection is moved
//! back to kernel TCP exactly before the fork (a counted downgrade): the child that serves
//! the rest of the conversation (or the exec'd image) reads every byte once and in order,
//! and a parent that keeps serving while a child holds the socket stays correct.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const SAN_FORK: &str = env!("CARGO_BIN_EXE_san_fork");

fn sandbox(name: &str) -> (PathBuf, PathBuf) {
    let base = std::env::temp_dir().join(format!("sandirect-fork-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let (stat, shm) = (base.join("stat"), base.join("shm"));
    for dir in [&base, &stat, &shm] {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    }
    (stat, shm)
}

fn command(stat: &PathBuf, shm: &PathBuf) -> Command {
    let mut command = Command::new(SAN_FORK);
    command
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env("LD_PRELOAD", &integration::apps::products().library)
        .env("SANDIRECT_SAN", "1")
        .env("SANDIRECT_STAT_DIR", stat)
        .env("SANDIRECT_SHM_DIR", shm)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Waits for `child` with a deadline (a hang is a failure, not a stuck test run).
fn finish(child: Child, what: &str) -> String {
    integration::finish_child(child, what, Duration::from_secs(60))
}

fn conversation(mode: &str) -> (String, String) {
    let (stat, shm) = sandbox(mode);
    let mut server = command(&stat, &shm).args(["server", mode]).spawn().unwrap();
    let mut reader = BufReader::new(server.stdout.take().unwrap());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    let port = first
        .trim()
        .strip_prefix("port ")
        .expect("port line")
        .to_owned();
    let client = command(&stat, &shm)
        .args(["client", &port, mode])
        .spawn()
        .unwrap();
    let client_report = finish(client, "client");
    server.stdout = Some(reader.into_inner());
    let server_report = finish(server, "server");
    let leftovers: Vec<_> = std::fs::read_dir(&shm).unwrap().collect();
    assert!(leftovers.is_empty(), "segments left behind: {leftovers:?}");
    (server_report, client_report)
}

/// The client's connection was on the SAN (SAN bytes counted) and then downgraded.
fn assert_downgraded_after_san(client: &str) {
    let line = client
        .lines()
        .find(|l| l.starts_with("client ok"))
        .expect("client ok");
    assert!(line.contains("path=tcp bypass=downgraded"), "{line}");
    let san_bytes: u64 = line
        .rsplit("san_bytes=")
        .next()
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(
        san_bytes >= 200 << 10,
        "the request went over the SAN first: {line}"
    );
}

/// The server was on the SAN when it forked.
fn assert_server_was_on_san(server: &str) {
    let line = server
        .lines()
        .find(|l| l.starts_with("server ok"))
        .expect("server ok");
    assert!(line.contains("before_fork=[path=san "), "{line}");
}

#[test]
fn forked_child_takes_over_a_san_connection_with_unread_bytes() {
    let (server, client) = conversation("handoff");
    assert_server_was_on_san(&server);
    assert_downgraded_after_san(&client);
}

#[test]
fn parent_keeps_serving_while_a_forked_child_holds_the_socket() {
    let (server, client) = conversation("keep");
    assert_server_was_on_san(&server);
    assert_downgraded_after_san(&client);
}

#[test]
fn an_execd_image_reads_the_unread_san_bytes_then_tcp() {
    let (server, client) = conversation("exec");
    assert_server_was_on_san(&server);
    assert_downgraded_after_san(&client);
}

/// As `exec`, by `vfork` whose child `dup2`s the socket (close-on-exec) onto fd 50 and execs:
/// the vfork child leaves the parent's state alone, the parent downgraded first, and the
/// stash is found by the socket's identity and handed to the new image.
#[test]
fn a_vfork_child_passes_a_dup2_copy_with_the_unread_san_bytes_to_its_image() {
    let (server, client) = conversation("vfork-exec");
    assert_server_was_on_san(&server);
    assert_downgraded_after_san(&client);
}

/// As `exec`, by `posix_spawn` with a `dup2` file action onto the child's stdin.
#[test]
fn a_posix_spawn_child_gets_the_socket_with_the_unread_san_bytes_on_stdin() {
    let (server, client) = conversation("spawn-exec");
    assert_server_was_on_san(&server);
    assert_downgraded_after_san(&client);
}

fn fork_ms(server: &str) -> u64 {
    server
        .rsplit("fork_ms=")
        .next()
        .and_then(|n| n.trim().parse().ok())
        .expect("fork_ms")
}

/// A peer busy elsewhere (no socket call for 1.5 s) still answers the downgrade at once,
/// through its nudge responder: the fork does not wait out its budget, and the child that
/// takes the connection over reads every byte (before, the child's copy was reset).
#[test]
fn a_forked_child_takes_over_a_connection_whose_peer_is_idle() {
    let (server, client) = conversation("idle-peer");
    assert_server_was_on_san(&server);
    let fork_ms = fork_ms(&server);
    assert!(fork_ms < 500, "fork took {fork_ms} ms: {server}");
    assert_downgraded_after_san(&client);
}

/// A peer that cannot answer at all (stopped) costs the fork its bounded budget (1 s); the
/// connection stays with the parent and the conversation stays exact.
#[test]
fn fork_with_a_stopped_peer_is_bounded_and_the_parent_stays_exact() {
    let (server, client) = conversation("stopped-peer");
    assert_server_was_on_san(&server);
    let fork_ms = fork_ms(&server);
    assert!(
        (900..1500).contains(&fork_ms),
        "fork took {fork_ms} ms: {server}"
    );
    assert!(client.contains("client ok"), "{client}");
}

/// Spawning a program that does not receive the socket (posix_spawn, close-on-exec) leaves
/// the connection on the SAN; a vfork downgrades it first (the child could pass it on), and
/// the conversation stays exact.
#[test]
fn spawning_keeps_the_san_unless_the_child_may_receive_the_socket() {
    let (server, client) = conversation("spawn");
    assert!(server.contains("after_spawn=[path=san "), "{server}");
    assert_downgraded_after_san(&client);
}
