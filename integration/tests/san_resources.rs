//! Exhausted resources: a connection that cannot get what the SAN path needs stays on kernel
//! TCP, with every byte intact; the program never crashes and the connection is never reset.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const SAN_MANY: &str = env!("CARGO_BIN_EXE_san_many");

fn library() -> &'static Path {
    &integration::apps::products().library
}

/// A private directory for one test (stats files, the mount point).
fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sandirect-res-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("stat")).unwrap();
    std::fs::create_dir_all(dir.join("shm")).unwrap();
    for sub in ["", "stat", "shm"] {
        std::fs::set_permissions(
            dir.join(sub),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
    }
    dir
}

/// The `unshare` arguments that give a private namespace of `kind` (`--mount`, `--net`):
/// unprivileged through a user namespace where those are allowed, else as root, whichever
/// first runs the shell command `probe` (with `probe_arg` as its `$0`) inside it; or why none
/// can be had.
fn private_namespace(
    kind: &'static str,
    probe: &str,
    probe_arg: &Path,
) -> Result<Vec<&'static str>, String> {
    let mut tried = Vec::new();
    for args in [vec!["--user", "--map-root-user", kind], vec![kind]] {
        let probe = Command::new("unshare")
            .args(&args)
            .args(["sh", "-c", probe])
            .arg(probe_arg)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output();
        match probe {
            Ok(out) if out.status.success() => return Ok(args),
            Ok(out) => tried.push(format!(
                "unshare {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(error) => tried.push(format!("unshare: {error}")),
        }
    }
    Err(tried.join("; "))
}

/// Mounting a small tmpfs needs a private mount namespace (the probe mounts one on
/// `mount_point` inside it).
fn mount_namespace(mount_point: &Path) -> Result<Vec<&'static str>, String> {
    private_namespace(
        "--mount",
        "mount -t tmpfs -o size=64k tmpfs \"$0\"",
        mount_point,
    )
}

/// Runs `script` under bash in the namespace `namespace` (`unshare` arguments), with the
/// preload library and `san_many` as `$1` and `$2` and `extra` after them, the preload's
/// settings cleared but for the stats directory under `dir` and the segment directory
/// `shm`; returns everything it printed once it ended (bounded by `limit`).
fn san_many_script(
    namespace: &[&str],
    script: &str,
    extra: &[String],
    dir: &Path,
    shm: &Path,
    limit: Duration,
) -> String {
    let child = Command::new("unshare")
        .args(namespace)
        .args(["bash", "-c", script, "bash"])
        .arg(library())
        .arg(SAN_MANY)
        .args(extra)
        .env_remove("LD_PRELOAD")
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env("SANDIRECT_STAT_DIR", dir.join("stat"))
        .env("SANDIRECT_SHM_DIR", shm)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    integration::finish_child(child, "san_many script", limit)
}

/// Runs a preloaded `san_many` server and client inside a mount namespace where the segment
/// directory is a tmpfs of `size`; returns everything printed (the reports of both, then
/// their exit statuses), or `None` when no mount namespace can be had here.
fn pairs_on_a_small_tmpfs(name: &str, size: &str, count: usize, bytes: usize) -> Option<String> {
    let dir = test_dir(name);
    let shm = dir.join("shm");
    let namespace = match mount_namespace(&shm) {
        Ok(args) => args,
        Err(why) => {
            eprintln!("SKIPPED: cannot mount a private tmpfs here ({why})");
            return None;
        }
    };
    // The server's output comes through a descriptor of the shell; the client runs once the
    // server announced its port. Exit statuses are printed, not acted on: a signal (SIGBUS)
    // shows as 128 + its number.
    let script = r#"
        set -u
        mount -t tmpfs -o "size=$5,mode=0700" sandirect-test "$SANDIRECT_SHM_DIR" || exit 90
        exec 3< <(LD_PRELOAD="$1" "$2" server "$3"; echo "server exit $?")
        read -r first <&3
        LD_PRELOAD="$1" "$2" client "${first#port }" "$3" "$4"
        echo "client exit $?"
        cat <&3
    "#;
    let extra = [count.to_string(), bytes.to_string(), size.to_owned()];
    let out = san_many_script(
        &namespace,
        script,
        &extra,
        &dir,
        &shm,
        Duration::from_secs(120),
    );
    let _ = std::fs::remove_dir_all(&dir);
    Some(out)
}

/// Both ends of every connection of [`pairs_on_a_small_tmpfs`] exited normally (135 would be
/// SIGBUS) and agree on the bytes: the client's and the server's reports.
fn exact_ends(out: &str, count: usize, bytes: usize) -> (Vec<Report<'_>>, Vec<Report<'_>>) {
    assert!(
        out.contains("client exit 0") && out.contains("server exit 0"),
        "both ends must exit normally (135 is SIGBUS):\n{out}"
    );
    let client = reports(out, "client", count, bytes);
    let server = reports(out, "server", count, bytes);
    for (i, (c, s)) in client.iter().zip(&server).enumerate() {
        assert_eq!(
            c.0, s.0,
            "connection {i}: both ends agree on the bytes:\n{out}"
        );
    }
    (client, server)
}

#[test]
fn a_full_segment_directory_leaves_the_later_connections_on_tcp() {
    // A new segment takes about 200 KiB (700 KiB where CMA is not allowed), and more as a
    // stream grows its slots and fills its journals; a 1 MiB tmpfs holds one to five new
    // segments. Every further connection, while the first are still open, finds the
    // directory full: it must stay on TCP (no SIGBUS when a segment page cannot be
    // allocated, no reset), all bytes exact.
    let (count, bytes) = (8, 1 << 20);
    let Some(out) = pairs_on_a_small_tmpfs("full-shm", "1m", count, bytes) else {
        return;
    };
    let (client, server) = exact_ends(&out, count, bytes);
    for (i, (c, s)) in client.iter().zip(&server).enumerate() {
        // (An end that finished its stream before the other's downgrade reached it still
        // shows the SAN.)
        if c.2 != "downgraded" && s.2 != "downgraded" {
            assert_eq!(
                c.1, s.1,
                "connection {i}: both ends agree on the path:\n{out}"
            );
        }
    }
    // The connections are all set up before they stream: the first segments fill the
    // directory, the later connections stay on TCP (`san-resources`), and a connection whose
    // journal no longer fits when its stream first needs it moves to TCP (`downgraded`).
    let paths: Vec<(&str, &str)> = client.iter().map(|(_, path, why)| (*path, *why)).collect();
    let switched = paths
        .iter()
        .filter(|(path, why)| *path == "san-shm" || *why == "downgraded")
        .count();
    assert!(
        switched >= 1 && switched < count,
        "some connections fit the tmpfs and use it, not all: {paths:?}\n{out}"
    );
    for (i, (_, path, reason)) in client.iter().enumerate() {
        assert!(
            *path == "san-shm"
                || (path.eq_ignore_ascii_case("tcp")
                    && matches!(*reason, "san-resources" | "downgraded")),
            "connection {i}: on the SAN, or on TCP for want of space: {path} {reason}\n{out}"
        );
    }
    assert!(
        client
            .iter()
            .any(|(_, _, reason)| *reason == "san-resources"),
        "a connection set up with the directory full stays on TCP:\n{out}"
    );
}

#[test]
fn statistics_files_of_killed_processes_make_room_for_new_segments() {
    // Three preloaded processes killed (no exit handler runs) leave their statistics files,
    // about 260 KiB each, in the tmpfs the segments share with them (as both share /dev/shm by
    // default). With the statistics files of the live server and client, the 100 KiB left
    // (less the pending-ports table) hold no segment: the client removes the dead processes'
    // files and gets its segment, and the connection uses the SAN.
    let dir = test_dir("dead-stats");
    let shm = dir.join("shm");
    let namespace = match mount_namespace(&shm) {
        Ok(args) => args,
        Err(why) => {
            eprintln!("SKIPPED: cannot mount a private tmpfs here ({why})");
            return;
        }
    };
    let script = r#"
        set -u
        mount -t tmpfs -o "size=$3,mode=0700" sandirect-test "$SANDIRECT_SHM_DIR" || exit 90
        export SANDIRECT_STAT_DIR="$SANDIRECT_SHM_DIR/stat"
        for i in 1 2 3; do
            exec 4< <(LD_PRELOAD="$1" exec "$2" server 1)
            read -r first <&4
            pkill -KILL -f "^$2 server 1$"
            exec 4<&-
        done
        sleep 0.2
        echo "stale files $(ls "$SANDIRECT_STAT_DIR" | wc -l)"
        exec 3< <(LD_PRELOAD="$1" "$2" server 1; echo "server exit $?")
        read -r first <&3
        LD_PRELOAD="$1" "$2" client "${first#port }" 1 65536
        echo "client exit $?"
        cat <&3
        echo "files left $(ls "$SANDIRECT_STAT_DIR" | wc -l)"
    "#;
    let size = (5 * 260 + 100).to_string() + "k";
    let out = san_many_script(
        &namespace,
        script,
        &[size],
        &dir,
        &shm,
        Duration::from_secs(60),
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.contains("stale files 3"),
        "three killed processes left their files:\n{out}"
    );
    let (client, _) = exact_ends(&out, 1, 65536);
    assert_eq!(
        client[0].1, "san-shm",
        "the connection found room for its segment:\n{out}"
    );
    assert!(
        out.contains("files left 0"),
        "the dead processes' files are gone (the live ones removed theirs at exit):\n{out}"
    );
}

#[test]
fn bytes_the_journal_cannot_take_before_the_handshake_still_arrive() {
    // A 512 KiB tmpfs holds a few segments but often not the journal chunk of bytes the
    // acceptor echoes before the client's hello arrived: they are journaled once they enter
    // the session (where a failure can downgrade), not sent on TCP before the switch, where the
    // switched client would never read them (it read end of stream instead, about one run in
    // seven). Several runs, every byte exact.
    let (count, bytes) = (3, 1 << 20);
    for run in 0..6 {
        let Some(out) = pairs_on_a_small_tmpfs(&format!("tight-{run}"), "512k", count, bytes)
        else {
            return;
        };
        exact_ends(&out, count, bytes);
    }
}

#[test]
fn a_journal_the_full_directory_cannot_hold_moves_the_connection_to_tcp() {
    // A 2 MiB tmpfs holds the segments (200–700 KiB each) but not the slots and journal
    // chunks a 1 MiB stream needs: the connection moves to kernel TCP when the journal is
    // first needed,
    // with every byte exact and no SIGBUS.
    let (count, bytes) = (2, 1 << 20);
    let Some(out) = pairs_on_a_small_tmpfs("full-journal", "2m", count, bytes) else {
        return;
    };
    let (client, server) = exact_ends(&out, count, bytes);
    // Whichever stream finds the directory full when its journal grows moves to TCP; the
    // other may find room (the space a moved connection freed) and stay on the SAN.
    for (i, (c, s)) in client.iter().zip(&server).enumerate() {
        for (path, why) in [(c.1, c.2), (s.1, s.2)] {
            assert!(
                path == "san-shm" || (path.eq_ignore_ascii_case("tcp") && why == "downgraded"),
                "connection {i}: on the SAN, or moved to TCP: {path} {why}\n{out}"
            );
        }
    }
    assert!(
        client
            .iter()
            .chain(&server)
            .any(|(_, _, why)| *why == "downgraded"),
        "a connection switched, then moved to TCP:\n{out}"
    );
}

const SAN_FDLIMIT: &str = env!("CARGO_BIN_EXE_san_fdlimit");

/// Runs `server` (which prints `port P` first) and the client `client` makes for that port to
/// completion, reading both outputs as they come (a line per connection can be more than a
/// pipe holds); removes `dir` and panics with both outputs if either failed. Returns the
/// client's output, then the server's.
fn run_pair(dir: &Path, mut server: Command, client: impl FnOnce(&str) -> Command) -> String {
    use std::io::{BufRead, Read};
    let mut server = server.spawn().unwrap();
    let mut output = std::io::BufReader::new(server.stdout.take().unwrap());
    let port = integration::read_port(&mut output);
    let server_out =
        std::thread::spawn(move || output.lines().map_while(Result::ok).collect::<Vec<_>>());
    let mut client = client(&port).spawn().unwrap();
    let mut client_stdout = client.stdout.take().unwrap();
    let client_out = std::thread::spawn(move || {
        let mut out = String::new();
        let _ = client_stdout.read_to_string(&mut out);
        out
    });
    let client = integration::wait_child(client, "client", Duration::from_secs(120));
    let client_out = client_out.join().unwrap();
    let server_status = integration::wait_child(server, "server", Duration::from_secs(30));
    let server_lines = server_out.join().unwrap().join("\n");
    let _ = std::fs::remove_dir_all(dir);
    if let Err(failure) = client {
        panic!("{failure}\n{client_out}\nserver:\n{server_lines}");
    }
    if let Err(failure) = server_status {
        panic!("{failure}\nserver:\n{server_lines}\nclient:\n{client_out}");
    }
    format!("{client_out}\n{server_lines}")
}

/// Runs a preloaded `san_fdlimit` server and client for `count` connections in turn (1 MiB
/// each way on each), the side `limited` lowering its descriptor limit before each one;
/// returns (server output, client output).
fn connections_under_a_descriptor_limit(name: &str, limited: &str, count: usize) -> String {
    let dir = test_dir(name);
    let flag = |side: &str| if side == limited { "1" } else { "0" };
    let preloaded = |command: &mut Command| {
        command
            .env("LD_PRELOAD", library())
            .env_remove("SANDIRECT_CONFIG")
            .env_remove("SANDIRECT_MODE")
            .env_remove("SANDIRECT_SAN")
            .env("SANDIRECT_STAT_DIR", dir.join("stat"))
            .env("SANDIRECT_SHM_DIR", dir.join("shm"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
    };
    let mut server = Command::new(SAN_FDLIMIT);
    server.args(["server", &count.to_string(), flag("server")]);
    preloaded(&mut server);
    run_pair(&dir, server, |port| {
        let mut client = Command::new(SAN_FDLIMIT);
        client.args([
            "client",
            port,
            &count.to_string(),
            "1048576",
            flag("client"),
        ]);
        preloaded(&mut client);
        client
    })
}

/// Checks the reports of [`connections_under_a_descriptor_limit`]: every connection moved
/// its bytes exactly on both ends, both ends agree on the path, a connection on TCP names a
/// reason on the limited side, and the SAN was used once the limit left room for it.
fn check_descriptor_limit_reports(out: &str, limited: &str, count: usize) {
    let mut paths = Vec::new();
    for (i, (c, s)) in intact_connections(out, count, 1 << 20, 0x9e37_79b9_7f4a_7c15)
        .iter()
        .enumerate()
    {
        if c.1.eq_ignore_ascii_case("tcp") {
            // The limited side says why; a client whose acceptor declined says that, and is
            // not made to take the server for a plain one.
            let (limited_reason, other_reason) = if limited == "client" {
                (c.2, None)
            } else {
                (s.2, Some(c.2))
            };
            assert_eq!(
                limited_reason, "san-resources",
                "connection {i}: the limited side's reason:\n{out}"
            );
            if let Some(reason) = other_reason {
                assert_eq!(
                    reason, "peer-resources",
                    "connection {i}: the client's reason:\n{out}"
                );
            }
        }
        paths.push(c.1);
    }
    assert!(
        paths.iter().any(|p| p.eq_ignore_ascii_case("tcp")) && paths.last() == Some(&"san-shm"),
        "the first connections cannot get their descriptors, the last has room: {paths:?}\n{out}"
    );
}

/// Both sides' reports of `count` connections that each moved `bytes` of the test programs'
/// pattern (seeded `seed`) each way: every connection exact on both ends, and both ends
/// agreeing on its path. Returns them as (client, server) pairs, in connection order.
fn intact_connections<'a>(
    out: &'a str,
    count: usize,
    bytes: usize,
    seed: u64,
) -> Vec<(Report<'a>, Report<'a>)> {
    let expected = format!(
        "{:016x}",
        integration::pattern::fnv1a(&integration::pattern::XorShift64::new(seed).low_bytes(bytes))
    );
    let client = reports(out, "client", count, bytes);
    let server = reports(out, "server", count, bytes);
    for (i, (c, s)) in client.iter().zip(&server).enumerate() {
        assert_eq!(c.0, expected, "connection {i}: client checksum:\n{out}");
        assert_eq!(s.0, expected, "connection {i}: server checksum:\n{out}");
        assert_eq!(
            c.1, s.1,
            "connection {i}: both ends agree on the path:\n{out}"
        );
    }
    client.into_iter().zip(server).collect()
}

/// (checksum, path, reason) of each connection `side` reported, in order; every one must have
/// moved `bytes` exactly (the checksums of both sides are compared by the caller).
/// One connection's report: checksum, path and fallback reason.
type Report<'a> = (&'a str, &'a str, &'a str);

fn reports<'a>(out: &'a str, side: &str, count: usize, bytes: usize) -> Vec<Report<'a>> {
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with(&format!("{side} ")) && !l.contains(" exit "))
        .collect();
    assert_eq!(
        lines.len(),
        count,
        "{side}: one report per connection:\n{out}"
    );
    lines
        .iter()
        .enumerate()
        .map(|(i, line)| {
            let rest = line
                .strip_prefix(&format!("{side} {i} ok bytes={bytes} checksum="))
                .unwrap_or_else(|| panic!("{side} connection {i} not intact:\n{out}"));
            let mut fields = rest.split(' ');
            let checksum = fields.next().unwrap_or("");
            let path = fields
                .next()
                .and_then(|f| f.strip_prefix("path="))
                .unwrap_or("");
            let reason = fields
                .next()
                .and_then(|f| f.strip_prefix("reason="))
                .unwrap_or("");
            (checksum, path, reason)
        })
        .collect()
}

#[test]
fn a_client_out_of_descriptors_stays_on_tcp_at_every_step() {
    // Connection i leaves the client room for its socket and i more descriptors: the set-up
    // runs out at each of its steps in turn (before and after the client announced itself),
    // and each time the connection must go on over TCP, exact, never reset.
    let count = 16;
    let out = connections_under_a_descriptor_limit("nofile-client", "client", count);
    check_descriptor_limit_reports(&out, "client", count);
}

#[test]
fn an_acceptor_out_of_descriptors_stays_on_tcp_at_every_step() {
    let count = 16;
    let out = connections_under_a_descriptor_limit("nofile-acceptor", "server", count);
    check_descriptor_limit_reports(&out, "server", count);
}

/// Runs a preloaded `san_many` server and client: `count` connections open at once, 1 MiB
/// each way on each in turn, then the first closed and one more made; the side `limited`
/// runs with a SAN memory budget of `budget_mb` MiB. Returns both sides' reports.
fn connections_under_a_memory_budget(
    name: &str,
    limited: &str,
    budget_mb: u64,
    count: usize,
) -> String {
    let dir = test_dir(name);
    let preloaded = |command: &mut Command, side: &str| {
        command
            .env("LD_PRELOAD", library())
            .env_remove("SANDIRECT_CONFIG")
            .env_remove("SANDIRECT_MODE")
            .env_remove("SANDIRECT_SAN")
            .env_remove("SANDIRECT_SAN_MEMORY_MB")
            .env("SANDIRECT_STAT_DIR", dir.join("stat"))
            .env("SANDIRECT_SHM_DIR", dir.join("shm"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if side == limited {
            command.env("SANDIRECT_SAN_MEMORY_MB", budget_mb.to_string());
        }
    };
    let mut server = Command::new(SAN_MANY);
    server.args(["server", &(count + 1).to_string()]);
    preloaded(&mut server, "server");
    run_pair(&dir, server, |port| {
        let mut client = Command::new(SAN_MANY);
        client.args(["client", port, &count.to_string(), "1048576", "reopen"]);
        preloaded(&mut client, "client");
        client
    })
}

/// Checks the reports of [`connections_under_a_memory_budget`] for a budget that fits two
/// connections: every connection exact on both ends; the first two on the SAN; the rest of
/// those open at once on TCP, the limited side saying `san-resources` and the other the
/// reason it can know (`other_reason`); the one made after the first closed on the SAN.
fn check_memory_budget_reports(out: &str, limited: &str, count: usize, other_reason: &str) {
    for (i, (c, s)) in intact_connections(out, count + 1, 1 << 20, 0x2545_f491_4f6c_dd1d)
        .iter()
        .enumerate()
    {
        let (limited_reason, other) = if limited == "client" {
            (c.2, s.2)
        } else {
            (s.2, c.2)
        };
        if i < 2 || i == count {
            assert_eq!(c.1, "san-shm", "connection {i} fits the budget:\n{out}");
        } else {
            assert!(
                c.1.eq_ignore_ascii_case("tcp"),
                "connection {i} is past the budget:\n{out}"
            );
            assert_eq!(
                limited_reason, "san-resources",
                "connection {i}: the limited side's reason:\n{out}"
            );
            assert_eq!(
                other, other_reason,
                "connection {i}: the other side's reason:\n{out}"
            );
        }
    }
}

/// A SAN connection is charged about 15 MiB (its 4.6 MiB segment, the 6 MiB journal it
/// writes and its 4 MiB send buffer): 30 MiB fits two.
const TWO_CONNECTIONS_MB: u64 = 30;

#[test]
fn a_client_past_its_san_memory_budget_keeps_new_connections_on_tcp() {
    // Five connections at once: two fit the client's budget, the other three stay on TCP
    // (the server, finding no segment, takes the client for a plain one); once the first
    // is closed, a new connection fits again.
    let count = 5;
    let out = connections_under_a_memory_budget("mem-client", "client", TWO_CONNECTIONS_MB, count);
    check_memory_budget_reports(&out, "client", count, "peer-not-capable");
}

#[test]
fn an_acceptor_past_its_san_memory_budget_declines_and_both_ends_stay_on_tcp() {
    // The server's budget fits two: it declines the others before attaching, and their
    // clients learn that a capable peer declined (`peer-resources`).
    let count = 5;
    let out =
        connections_under_a_memory_budget("mem-acceptor", "server", TWO_CONNECTIONS_MB, count);
    check_memory_budget_reports(&out, "server", count, "peer-resources");
}

/// The descriptor limit of [`thousands_of_connections_never_take_the_applications_descriptors`]:
/// above 2048, where the preload's descriptors are placed from 1024 up whatever the limit, so
/// that only their count keeps them from the application's share.
const HIGH_LIMIT: usize = 4096;

#[test]
fn thousands_of_connections_never_take_the_applications_descriptors() {
    // 1,500 connections open at once on each end, under a soft and hard limit of 4,096 and a
    // memory budget that would admit them all: the SAN takes connections while eight
    // descriptors each fit in half the limit, the rest stay on TCP, and neither program ever
    // meets EMFILE (it did from about 500 connections, each SAN connection holding up to
    // eight descriptors while it waits for its first use).
    let count = 1500;
    let dir = test_dir("many-fds");
    let limited = |side: &[&str]| {
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(format!("ulimit -n {HIGH_LIMIT} && exec \"$0\" \"$@\""))
            .arg(SAN_MANY)
            .args(side)
            .env("LD_PRELOAD", library())
            .env_remove("SANDIRECT_CONFIG")
            .env_remove("SANDIRECT_MODE")
            .env_remove("SANDIRECT_SAN")
            .env("SANDIRECT_SAN_MEMORY_MB", "1000000")
            .env("SANDIRECT_STAT_DIR", dir.join("stat"))
            .env("SANDIRECT_SHM_DIR", dir.join("shm"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    };
    let server = limited(&["server", &count.to_string()]);
    let out = run_pair(&dir, server, |port| {
        limited(&["client", port, &count.to_string(), "256"])
    });
    let mut on_san = 0;
    for (i, (c, s)) in intact_connections(&out, count, 256, 0x2545_f491_4f6c_dd1d)
        .iter()
        .enumerate()
    {
        if c.1 == "san-shm" {
            on_san += 1;
        } else {
            assert!(
                [c.2, s.2].contains(&"san-resources"),
                "connection {i} on {}: one side ran out of descriptors to spare:\n{out}",
                c.1
            );
        }
    }
    // Eight per connection in half of 4,096: 256 at most.
    assert!(
        (200..=HIGH_LIMIT / 2 / 8).contains(&on_san),
        "{on_san} of {count} connections on the SAN"
    );
}

/// A private network namespace in which the loopback can be brought up and the local port
/// range set (see [`private_namespace`]).
fn network_namespace() -> Result<Vec<&'static str>, String> {
    private_namespace(
        "--net",
        "ip link set lo up && echo '40000 40001' > /proc/sys/net/ipv4/ip_local_port_range",
        Path::new("probe"),
    )
}

#[test]
fn a_client_whose_port_range_is_taken_stays_on_tcp_and_connects() {
    // Where connections churn, the local port range fills with TIME_WAIT ports: `connect` may
    // still reuse one towards another peer, a `bind` (which the SAN client needs before its
    // SYN) may not. In a network namespace with an eight-port range, the preloaded server's
    // listener takes one port and seven connections to another listener, closed by their
    // client, leave the other seven in TIME_WAIT: the preloaded client's first connection
    // finds no port to bind, and both its connections stay on TCP (`san-resources`) and work,
    // every byte exact (the kernel's `connect` shares a TIME_WAIT port with a connection to
    // another peer).
    let namespace = match network_namespace() {
        Ok(args) => args,
        Err(why) => {
            eprintln!("SKIPPED: no private network namespace here ({why})");
            return;
        }
    };
    let dir = test_dir("port-range");
    let script = r#"
        set -u
        ip link set lo up || exit 90
        echo '40000 40007' > /proc/sys/net/ipv4/ip_local_port_range || exit 91
        exec 3< <(LD_PRELOAD="$1" "$2" server 2; echo "server exit $?")
        read -r first <&3
        # Seven connections to a listener outside the range, each closed by its client
        # first: their client ports stay in TIME_WAIT.
        python3 -c '
import socket
listener = socket.socket()
listener.bind(("127.0.0.1", 5000))
listener.listen(16)
pairs = []
for _ in range(7):
    client = socket.create_connection(("127.0.0.1", 5000))
    pairs.append((client, listener.accept()[0]))
for client, server in pairs:
    client.close()
for client, server in pairs:
    server.close()
' || exit 92
        echo "time-wait $(awk '$4 == "06"' /proc/net/tcp | wc -l)"
        LD_PRELOAD="$1" "$2" client "${first#port }" 2 65536
        echo "client exit $?"
        cat <&3
    "#;
    let out = san_many_script(
        &namespace,
        script,
        &[],
        &dir,
        &dir.join("shm"),
        Duration::from_secs(60),
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.contains("time-wait 7"),
        "seven ports of the range in TIME_WAIT:\n{out}"
    );
    // (The second connection finds the range still counted full and does not try.)
    let (client, _server) = exact_ends(&out, 2, 65536);
    for report in &client {
        assert_eq!(
            (report.1, report.2),
            ("TCP", "san-resources"),
            "no port to bind: the client stays on TCP and says why:\n{out}"
        );
    }
}
