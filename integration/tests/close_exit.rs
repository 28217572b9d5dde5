//! Close and exit: what a peer sees when a process ends without closing its connection, run
//! natively and with both ends preloaded (the SAN path). Kernel TCP's rule: once `send()`
//! returned, the bytes belong to the connection — they reach the peer even if the sender
//! exits, is killed or crashes, followed by end of stream; unless the dying process left
//! received data unread, in which case the peer gets a reset.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// Private stats and segment directories for one test.
struct Dirs {
    base: PathBuf,
    stat: PathBuf,
    shm: PathBuf,
}

impl Dirs {
    fn new(name: &str) -> Dirs {
        use std::os::unix::fs::PermissionsExt;
        let base =
            std::env::temp_dir().join(format!("sandirect-exit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let make = |dir: &PathBuf| {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        };
        make(&base);
        let (stat, shm) = (base.join("stat"), base.join("shm"));
        make(&stat);
        make(&shm);
        Dirs { base, stat, shm }
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.base);
    }
}

fn python(preload: bool, dirs: &Dirs) -> Command {
    let mut command = Command::new("python3");
    command
        .env_remove("LD_PRELOAD")
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env("SANDIRECT_STAT_DIR", &dirs.stat)
        .env("SANDIRECT_SHM_DIR", &dirs.shm);
    if preload {
        // The SAN path is the default: nothing but the preload is set.
        command.env("LD_PRELOAD", &integration::apps::products().library);
    }
    command
}

/// Both ends of every scenario: `server MODE` prints its port, then its report; `client PORT
/// MODE` ends the way MODE says, never with `close()`.
const SCRIPT: &str = r#"
import ctypes, errno, hashlib, os, signal, socket, sys, time

PAYLOAD = bytes(range(256)) * 15625  # 4,000,000 bytes
UNREAD = b"u" * 1000

def read_to_end(conn):
    data = bytearray()
    while True:
        try:
            chunk = conn.recv(65536)
        except OSError as e:
            return bytes(data), errno.errorcode.get(e.errno, str(e.errno))
        if not chunk:
            return bytes(data), "eof"
        data += chunk

def read_exactly(conn, n):
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk, "early end of stream"
        data += chunk
    return data

role, mode = sys.argv[1], sys.argv[-1]
if role == "server":
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    if mode == "drain":
        time.sleep(1.0)
        data, end = read_to_end(conn)
        intact = hashlib.sha256(data).digest() == hashlib.sha256(PAYLOAD).digest()
        print("received", len(data), "intact" if intact else "corrupt", "then", end, flush=True)
    elif mode == "pingpong":
        assert read_exactly(conn, 4) == b"ping"
        conn.sendall(b"pong")
        data, end = read_to_end(conn)
        print("after the answer", len(data), "bytes then", end, flush=True)
    elif mode == "unread":
        conn.sendall(UNREAD)
        # The client dies without reading; give its kernel (or the SAN) time to see it.
        time.sleep(1.0)
        data, end = read_to_end(conn)
        print("after the unread bytes", len(data), "bytes then", end, flush=True)
    sys.exit(0)

conn = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
if mode.startswith("sendall-"):
    # Let the server's accept() take the connection first (a process that ends within
    # moments of connect(), before that, is a known limit of the switch-over).
    time.sleep(0.2)
if mode == "sendall-exit":
    conn.sendall(PAYLOAD)
    os._exit(0)
elif mode == "sendall-kill":
    conn.sendall(PAYLOAD)
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "pingpong-exit":
    conn.sendall(b"ping")
    assert read_exactly(conn, 4) == b"pong"
    # exit(3): atexit handlers and library destructors run, the socket is never closed.
    ctypes.CDLL(None).exit(0)
elif mode == "unread-exit":
    # Wait until the server's bytes are here, leave them unread and exit.
    import select
    select.select([conn], [], [], 5.0)
    time.sleep(0.2)
    os._exit(0)
"#;

/// Runs the server in `server_mode` and the client in `client_mode`, natively or both
/// preloaded; returns the server's report.
fn scenario(name: &str, server_mode: &str, client_mode: &str, preload: bool) -> String {
    let dirs = Dirs::new(&format!("{name}-{preload}"));
    let script = dirs.base.join("close_exit.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let mut server = python(preload, &dirs)
        .arg(&script)
        .args(["server", server_mode])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut reader = BufReader::new(server.stdout.take().unwrap());
    let mut port = String::new();
    reader.read_line(&mut port).unwrap();
    let client = python(preload, &dirs)
        .arg(&script)
        .args(["client", port.trim(), client_mode])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let client_out = client.wait_with_output().unwrap();
    let client_err = String::from_utf8_lossy(&client_out.stderr).into_owned();
    assert!(
        client_err.is_empty(),
        "client ({client_mode}, preloaded {preload}): {client_err}"
    );
    server.stdout = Some(reader.into_inner());
    integration::finish_child(server, "server", Duration::from_secs(60))
        .trim()
        .to_owned()
}

/// The scenario natively, then preloaded: both must give `expected`.
fn as_natively(name: &str, server_mode: &str, client_mode: &str, expected: &str) {
    let native = scenario(name, server_mode, client_mode, false);
    assert_eq!(native, expected, "natively");
    let preloaded = scenario(name, server_mode, client_mode, true);
    assert_eq!(preloaded, expected, "both preloaded (the SAN path)");
}

#[test]
fn bytes_sent_before_exit_without_close_all_arrive_then_eof() {
    as_natively(
        "sendall-exit",
        "drain",
        "sendall-exit",
        "received 4000000 intact then eof",
    );
}

#[test]
fn bytes_sent_before_a_sigkill_all_arrive_then_eof() {
    as_natively(
        "sendall-kill",
        "drain",
        "sendall-kill",
        "received 4000000 intact then eof",
    );
}

#[test]
fn a_client_that_exits_without_closing_gives_its_server_eof() {
    as_natively(
        "pingpong-exit",
        "pingpong",
        "pingpong-exit",
        "after the answer 0 bytes then eof",
    );
}

#[test]
fn a_client_that_dies_with_unread_data_resets_its_server() {
    as_natively(
        "unread-exit",
        "unread",
        "unread-exit",
        "after the unread bytes 0 bytes then ECONNRESET",
    );
}
