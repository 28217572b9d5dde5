//! How much a connection absorbs before the peer reads, run natively and preloaded: two ends
//! that each write 3 MB before reading pass on loopback TCP, also when they wait in `poll()`
//! (Python's socket timeouts put the socket in nonblocking mode and poll), where no blocked
//! send can take the peer's bytes in. Over the SAN the send buffer must hold it.

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::Duration;

use integration::apps::Sandbox;

const SCRIPT: &str = r#"
import os, socket, sys
n = 3_000_000
data = os.urandom(n)
role = sys.argv[1]
if role == "server":
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
else:
    conn = socket.create_connection(("127.0.0.1", int(sys.argv[2])))
conn.settimeout(15)
try:
    conn.sendall(data)
    got = 0
    while got < n:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    print(role, "read", got, "of", n)
except OSError as error:
    print(role, "failed:", type(error).__name__)
"#;

fn run(preload: bool) -> String {
    let sandbox = Sandbox::new(&format!("buffering-{preload}"));
    let script = sandbox.path().join("both_write_first.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let python = |role: &[&str]| {
        let mut command = sandbox.command("python3", preload);
        command
            .arg(&script)
            .args(role)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    };
    let mut server = python(&["server"]).spawn().unwrap();
    let mut reader = BufReader::new(server.stdout.take().unwrap());
    let mut port = String::new();
    reader.read_line(&mut port).unwrap();
    let client = python(&["client", port.trim()]).spawn().unwrap();
    let client_out = integration::finish_child(client, "client", Duration::from_secs(60));
    server.stdout = Some(reader.into_inner());
    let server_out = integration::finish_child(server, "server", Duration::from_secs(60));
    format!("{} / {}", client_out.trim(), server_out.trim())
}

#[test]
fn two_ends_that_write_3_mb_before_reading_pass_also_waiting_in_poll() {
    let expected = "client read 3000000 of 3000000 / server read 3000000 of 3000000";
    assert_eq!(run(false), expected, "natively");
    assert_eq!(run(true), expected, "preloaded (the SAN path)");
}
