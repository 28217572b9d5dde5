//! fork and exec with SAN connections (fork, exec, dup): two
//! preloaded processes switch to the intra-host SAN, then the server forks (or forks and
//! execs) while bytes the client sent over the SAN are still unread. Every connection is moved
//! back to kernel TCP exactly before the fork (a counted downgrade): the child that serves
//! the rest of the conversation (or the exec'd image) reads every byte once and in order,
//! and a parent that keeps serving while a child holds the socket stays correct.

use std::io::BufReader;
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
    conversation_with(mode, false)
}

/// Makes `command`'s process bind, before it runs, the abstract name a nudge responder would
/// take if its name were predictable from the uid, the pid namespace and the pid alone (as
/// another user watching pids could do before the process binds it).
fn squat_predictable_nudge_name(command: &mut Command) {
    use std::os::unix::fs::MetadataExt;
    use std::os::unix::process::CommandExt;
    // SAFETY: plain geteuid.
    let uid = unsafe { libc::geteuid() };
    let namespace = std::fs::metadata("/proc/self/ns/pid").map_or(0, |m| m.ino());
    let prefix = format!("sandirect/{uid}/N/{namespace}/");
    // SAFETY: between fork and exec the closure only formats into a stack buffer and makes
    // two system calls (no allocation, no lock).
    unsafe {
        command.pre_exec(move || {
            let mut addr: libc::sockaddr_un = core::mem::zeroed();
            addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
            let mut len = 1; // sun_path[0] = 0: an abstract name
            for &b in prefix.as_bytes() {
                addr.sun_path[len] = b as libc::c_char;
                len += 1;
            }
            let mut digits = [0u8; 10];
            let (mut pid, mut n) = (libc::getpid() as u32, 0);
            loop {
                digits[n] = b'0' + (pid % 10) as u8;
                n += 1;
                pid /= 10;
                if pid == 0 {
                    break;
                }
            }
            for &b in digits[..n].iter().rev() {
                addr.sun_path[len] = b as libc::c_char;
                len += 1;
            }
            let fd = libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM, 0);
            let size = (core::mem::size_of::<libc::sa_family_t>() + len) as libc::socklen_t;
            libc::bind(fd, (&addr as *const libc::sockaddr_un).cast(), size);
            Ok(())
        });
    }
}

fn conversation_with(mode: &str, squat_client_nudges: bool) -> (String, String) {
    let (stat, shm) = if squat_client_nudges {
        sandbox(&format!("{mode}-squatted"))
    } else {
        sandbox(mode)
    };
    let mut server = command(&stat, &shm).args(["server", mode]).spawn().unwrap();
    let mut reader = BufReader::new(server.stdout.take().unwrap());
    let port = integration::read_port(&mut reader);
    let mut client = command(&stat, &shm);
    client.args(["client", &port, mode]);
    if squat_client_nudges {
        squat_predictable_nudge_name(&mut client);
    }
    let client = client.spawn().unwrap();
    let client_report = finish(client, "client");
    server.stdout = Some(reader.into_inner());
    let server_report = finish(server, "server");
    // (The pending-ports table, shared by every connection, stays by design.)
    let leftovers: Vec<_> = std::fs::read_dir(&shm)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .filter(|name| name.to_str() != Some(san_shm::PENDING_PORTS_FILE))
        .collect();
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

/// As above, with the name a nudge responder would take, were it predictable from the pid,
/// taken first: the peer still answers at once (its responder's name holds a random value
/// only the processes that share its segments learn).
#[test]
fn a_squatter_on_the_predictable_nudge_name_takes_no_nudge_away() {
    let (server, client) = conversation_with("idle-peer", true);
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
