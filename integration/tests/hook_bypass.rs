//! Paths that would reach a SAN socket's kernel socket around the hooks, with real programs:
//! io_uring (node's libuv with its io_uring enabled), and a master that hands accepted
//! connections to a worker process with SCM_RIGHTS. Raw `syscall()` socket I/O and stdio on a
//! socket are conformance cases.

use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

const HANDOFF: &str = env!("CARGO_BIN_EXE_handoff");

/// `libsandirect.so`, built once per test run (same profile as this test).
fn library() -> &'static Path {
    &integration::apps::products().library
}

/// Private stats and segment directories for one test.
fn dirs(name: &str) -> (PathBuf, PathBuf) {
    let base = std::env::temp_dir().join(format!("sandirect-bypass-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let make = |sub: &str| {
        let dir = base.join(sub);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
        dir
    };
    (make("stat"), make("shm"))
}

fn command(program: &str, preload: bool, (stat, shm): &(PathBuf, PathBuf)) -> Command {
    let mut command = Command::new(program);
    command
        .env_remove("LD_PRELOAD")
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env("SANDIRECT_STAT_DIR", stat)
        .env("SANDIRECT_SHM_DIR", shm)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if preload {
        command.env("LD_PRELOAD", library());
    }
    command
}

fn finish(child: std::process::Child, what: &str) -> String {
    integration::finish_child(child, what, Duration::from_secs(30))
}

#[test]
fn io_uring_setup_is_refused_with_enosys_while_the_san_path_is_on() {
    let native = finish(
        command(HANDOFF, false, &dirs("uring-native"))
            .arg("io-uring-setup")
            .spawn()
            .unwrap(),
        "native io_uring_setup",
    );
    assert!(
        native.contains("io_uring_setup: ring") || native.contains("io_uring_setup: ENOSYS"),
        "{native}"
    );
    let preloaded = finish(
        command(HANDOFF, true, &dirs("uring-preloaded"))
            .arg("io-uring-setup")
            .spawn()
            .unwrap(),
        "preloaded io_uring_setup",
    );
    assert!(preloaded.contains("io_uring_setup: ENOSYS"), "{preloaded}");
    // With the SAN path off no socket can switch: io_uring is left alone.
    let off = finish(
        command(HANDOFF, true, &dirs("uring-off"))
            .env("SANDIRECT_SAN", "0")
            .arg("io-uring-setup")
            .spawn()
            .unwrap(),
        "io_uring_setup with the SAN path off",
    );
    assert_eq!(off, native, "the SAN path off must not change io_uring");
}

/// A node TCP echo (server and client in one process, 1 MiB through), libuv's io_uring on.
const NODE_ECHO: &str = r#"
const net = require('net');
const size = 1 << 20;
const server = net.createServer((socket) => socket.pipe(socket));
server.listen(0, '127.0.0.1', () => {
  const data = Buffer.alloc(size);
  for (let i = 0; i < size; i++) data[i] = i % 251;
  const chunks = [];
  let got = 0;
  const client = net.connect(server.address().port, '127.0.0.1', () => client.end(data));
  client.on('data', (chunk) => { chunks.push(chunk); got += chunk.length; });
  client.on('end', () => {
    const echoed = Buffer.concat(chunks);
    console.log(`echoed ${got} intact ${echoed.equals(data)}`);
    server.close();
  });
});
"#;

#[test]
fn node_with_io_uring_enabled_echoes_over_the_preload() {
    if Command::new("node").arg("--version").output().is_err() {
        eprintln!("node is not installed: skipped");
        return;
    }
    for preload in [false, true] {
        let output = finish(
            command("node", preload, &dirs(&format!("node-{preload}")))
                .env("UV_USE_IO_URING", "1")
                .args(["-e", NODE_ECHO])
                .spawn()
                .unwrap(),
            &format!("node echo (preload={preload})"),
        );
        assert!(
            output.contains(&format!("echoed {} intact true", 1 << 20)),
            "preload={preload}: {output}"
        );
    }
}

/// Runs `handoff master` and `handoff client` (with `greet`: the worker speaks first) and
/// checks that the client got its bytes back intact and the worker ended cleanly.
fn hand_off(preload: bool, bytes: usize, greet: bool) {
    let dirs = dirs(&format!("handoff-{preload}-{bytes}-{greet}"));
    let mode = if greet { "greet" } else { "request" };
    let mut master = command(HANDOFF, preload, &dirs)
        .args(["master", mode])
        .spawn()
        .unwrap();
    let port = integration::read_port(&mut BufReader::new(master.stdout.as_mut().unwrap()));
    let client = command(HANDOFF, preload, &dirs)
        .args(["client", &port, &bytes.to_string(), mode])
        .spawn()
        .unwrap();
    let client = finish(client, &format!("handoff client (preload={preload})"));
    let master = finish(master, &format!("handoff master (preload={preload})"));
    assert!(
        client.contains(&format!("echoed {bytes} intact true")),
        "preload={preload} greet={greet}: {client}"
    );
    assert!(
        master.contains("worker exit 0"),
        "preload={preload}: {master}"
    );
}

/// A pre-forked worker receives an accepted connection with SCM_RIGHTS and speaks first: the
/// master's SAN connection is downgraded to kernel TCP before the message leaves, so the
/// worker's kernel socket carries the whole stream.
#[test]
fn master_hands_an_accepted_connection_to_a_worker_with_scm_rights() {
    for preload in [false, true] {
        hand_off(preload, 1 << 20, true);
    }
}

/// As above, but the client's request reached the master over the SAN before the hand-off:
/// those bytes sit in the master's stash, which the worker's kernel socket does not see.
#[test]
#[ignore = "known limit: bytes received over the SAN before an SCM_RIGHTS hand-off stay with the sending process"]
fn master_hands_over_a_connection_whose_request_already_arrived() {
    for (preload, bytes) in [(false, 1 << 20), (true, 1 << 20), (true, 100)] {
        hand_off(preload, bytes, false);
    }
}
