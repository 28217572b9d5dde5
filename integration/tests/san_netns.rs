//! Peers in two network namespaces (made with `ip netns`, joined by a veth pair), as containers
//! on a bridge network are: abstract Unix names are per network namespace, so they find each
//! other only through socket files in a segment directory both use. With one directory the
//! connection is SAN-shm on both ends, every echoed byte verified; with separate directories it
//! stays on TCP (`peer-not-capable`), also verified.
//!
//! Needs root (network namespaces) and `ip` (iproute2); skipped with a message otherwise.

use std::process::Command;
use std::time::Duration;

use integration::apps::{exclusive, require_program, Sandbox};
use preload_core::record::DataPath;

/// `netns.py server PORT`: echoes one connection (listening on every address), then exits.
/// `netns.py client HOST PORT BYTES`: streams BYTES random bytes in chunks while reading the
/// echo, compares sha256 digests, holds the connection until stdin closes.
const NETNS_PY: &str = r#"
import hashlib, random, socket, sys, threading

if sys.argv[1] == "server":
    listener = socket.create_server(("0.0.0.0", int(sys.argv[2])))
    print("listening", flush=True)
    connection, _ = listener.accept()
    while data := connection.recv(65536):
        connection.sendall(data)
    connection.close()
    print("served", flush=True)
else:
    host, port, size = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    connection = socket.create_connection((host, port))
    payload = random.Random(7).randbytes(size)
    def send():
        position, chunks = 0, [1, 64, 1460, 65536, 200003]
        while position < size:
            chunk = chunks[position % len(chunks)]
            connection.sendall(payload[position:position + chunk])
            position += chunk
    sender = threading.Thread(target=send)
    sender.start()
    digest, received = hashlib.sha256(), 0
    while received < size:
        data = connection.recv(65536)
        if not data:
            raise SystemExit(f"echo ended after {received} bytes")
        digest.update(data)
        received += len(data)
    sender.join()
    if digest.digest() != hashlib.sha256(payload).digest():
        raise SystemExit("sha256 of the echo differs")
    print(f"holding: {size} bytes echoed, sha256 verified", flush=True)
    sys.stdin.readline()
    connection.close()
    print("closed", flush=True)
"#;

const SERVER_ADDRESS: &str = "10.203.7.1";
const CLIENT_ADDRESS: &str = "10.203.7.2";
const PORT: u16 = 6391;
const BYTES: u64 = 3 << 20;

/// Two network namespaces joined by a veth pair; removed on drop.
struct Namespaces {
    server: String,
    client: String,
}

impl Namespaces {
    /// `None` (with the reason) where they cannot be made.
    fn new() -> Result<Namespaces, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: network namespaces need CAP_SYS_ADMIN".into());
        }
        let ip = require_program("ip", "iproute2");
        let tag = std::process::id() % 100_000;
        let namespaces = Namespaces {
            server: format!("sdn{tag}s"),
            client: format!("sdn{tag}c"),
        };
        let (veth_server, veth_client) = (format!("sdv{tag}s"), format!("sdv{tag}c"));
        let run = |args: &[&str]| {
            let status = Command::new(&ip).args(args).status();
            match status {
                Ok(status) if status.success() => Ok(()),
                other => Err(format!("ip {}: {other:?}", args.join(" "))),
            }
        };
        run(&["netns", "add", &namespaces.server])?;
        run(&["netns", "add", &namespaces.client])?;
        run(&[
            "link",
            "add",
            &veth_server,
            "type",
            "veth",
            "peer",
            "name",
            &veth_client,
        ])?;
        for (namespace, veth, address) in [
            (&namespaces.server, &veth_server, SERVER_ADDRESS),
            (&namespaces.client, &veth_client, CLIENT_ADDRESS),
        ] {
            run(&["link", "set", veth, "netns", namespace])?;
            run(&[
                "-n",
                namespace,
                "addr",
                "add",
                &format!("{address}/24"),
                "dev",
                veth,
            ])?;
            run(&["-n", namespace, "link", "set", veth, "up"])?;
            run(&["-n", namespace, "link", "set", "lo", "up"])?;
        }
        Ok(namespaces)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and with it the other.
        for namespace in [&self.server, &self.client] {
            let _ = Command::new("ip")
                .args(["netns", "del", namespace])
                .status();
        }
    }
}

/// Runs the echo between the namespaces: the server with `sandbox`'s segment directory, the
/// client with `client_segments` (the same directory, or another). Asserts both ends took
/// `expected` with `reason` (as `sandirect stat` shows it) and every byte came back.
fn echo_across(shared: bool, expected: DataPath, reason: &str) {
    let _serial = exclusive();
    let namespaces = match Namespaces::new() {
        Ok(namespaces) => namespaces,
        Err(why) => {
            eprintln!("skipped: {why}");
            return;
        }
    };
    let python = require_program("python3", "python3");
    let sandbox = Sandbox::new(if shared {
        "netns-shared"
    } else {
        "netns-apart"
    });
    let elsewhere = Sandbox::new("netns-elsewhere");
    let script = sandbox.path().join("netns.py");
    std::fs::write(&script, NETNS_PY).expect("write netns.py");
    let in_namespace = |namespace: &str, args: &[&str]| {
        let mut command = sandbox.command("ip", true);
        command
            .args(["netns", "exec", namespace])
            .arg(&python)
            .arg(&script)
            .args(args);
        command
    };
    let mut server = sandbox.spawn_piped(
        "netns-server",
        in_namespace(&namespaces.server, &["server", &PORT.to_string()]),
    );
    let stdout = server.take_stdout();
    let (_, rest) =
        integration::apps::read_until_line(stdout, "listening", Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("server: {e}\n{}", server.stderr()));
    let server_output = integration::apps::drain(rest);
    let mut client = in_namespace(
        &namespaces.client,
        &[
            "client",
            SERVER_ADDRESS,
            &PORT.to_string(),
            &BYTES.to_string(),
        ],
    );
    if !shared {
        client.env("SANDIRECT_SHM_DIR", elsewhere.segment_dir());
    }
    let output = sandbox.run_holding("netns-client", client, Duration::from_secs(60), |_| {
        // The server's last write may still be returning when the client has read it all:
        // its count is published a moment later.
        let mut live = sandbox.assert_live_paths(PORT, expected, 2);
        for _ in 0..100 {
            if live
                .iter()
                .all(|c| integration::apps::application_bytes(c) == (BYTES, BYTES))
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            live = sandbox.assert_live_paths(PORT, expected, 2);
        }
        for connection in &live {
            assert_eq!(
                integration::apps::application_bytes(connection),
                (BYTES, BYTES),
                "published byte counts of {connection:?}"
            );
        }
        let reasons = stat_reasons(&sandbox);
        assert!(
            reasons.len() == 2 && reasons.iter().all(|r| r == reason),
            "reasons shown by sandirect stat: {reasons:?}, expected {reason}"
        );
    });
    assert!(
        output.contains("holding: 3145728 bytes echoed, sha256 verified"),
        "{output}"
    );
    let status = server.wait_timeout(Duration::from_secs(30));
    assert!(status.success(), "server: {status}\n{}", server.stderr());
    let served = server_output.join().ok().and_then(Result::ok);
    assert!(
        served.is_some_and(|text| text.contains("served")),
        "server did not finish"
    );
    sandbox.assert_nothing_left_behind();
    let exchange_files: Vec<_> = std::fs::read_dir(sandbox.segment_dir())
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with(".X-") || name.starts_with(".N-"))
                .collect()
        })
        .unwrap_or_default();
    assert!(
        exchange_files.is_empty(),
        "exchange or nudge socket files left behind: {exchange_files:?}"
    );
    drop(namespaces);
}

/// The REASON column of `sandirect stat` for the sandbox's connections.
fn stat_reasons(sandbox: &Sandbox) -> Vec<String> {
    let output = Command::new(&integration::apps::products().cli)
        .arg("stat")
        .env("SANDIRECT_STAT_DIR", sandbox.stat_dir())
        .output()
        .expect("run sandirect stat");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .skip(1)
        .filter(|line| line.contains(&format!(":{PORT}")))
        .filter_map(|line| line.split_whitespace().last().map(str::to_owned))
        .collect()
}

#[test]
fn peers_in_two_network_namespaces_sharing_the_segment_directory_use_the_san() {
    echo_across(true, DataPath::SanShm, "-");
}

#[test]
fn peers_in_two_network_namespaces_with_separate_directories_stay_on_tcp() {
    echo_across(false, DataPath::Tcp, "peer-not-capable");
}
