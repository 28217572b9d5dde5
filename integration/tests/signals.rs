//! Signals during a large blocking send, run natively and preloaded (the SAN path, where a
//! send that large goes by rendezvous: the receiver copies straight out of the sender's
//! buffer). The kernel returns a short count when a signal interrupts a send that made
//! progress, so the program's handler runs and its write loop goes on; a language runtime
//! that runs handlers only between calls (Python) depends on it.

use std::process::Stdio;
use std::time::Duration;

use integration::apps::Sandbox;

/// One process: the main thread sends 16 MiB in one `sendall`; a second thread reads 100
/// bytes, then signals the main thread until its (Python-level) handler has run, up to 10 s,
/// then reads the rest and checks it.
const SCRIPT: &str = r#"
import signal, socket, threading, time
handled = []
signal.signal(signal.SIGUSR1, lambda signum, frame: handled.append(time.monotonic()))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
client = socket.create_connection(listener.getsockname())
server, _ = listener.accept()
payload = bytes(range(256)) * (1 << 16)
main = threading.get_ident()
report = []
def reader():
    data = bytearray(server.recv(100))
    deadline = time.monotonic() + 10
    while not handled and time.monotonic() < deadline:
        signal.pthread_kill(main, signal.SIGUSR1)
        time.sleep(0.01)
    in_time = bool(handled)
    while len(data) < len(payload):
        chunk = server.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    report.append((in_time, bytes(data) == payload))
thread = threading.Thread(target=reader, daemon=True)
thread.start()
client.sendall(payload)
thread.join(30)
in_time, intact = report[0] if report else (False, False)
print("handler ran during the send:", in_time, "; every byte arrived:", intact)
"#;

fn run(preload: bool) -> String {
    let sandbox = Sandbox::new(&format!("signals-{preload}"));
    let script = sandbox.path().join("interrupted_send.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let mut command = sandbox.command("python3", preload);
    command
        .arg(&script)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = integration::finish_child(
        command.spawn().unwrap(),
        "interrupted send",
        Duration::from_secs(60),
    );
    out.trim().to_owned()
}

#[test]
fn a_signal_interrupts_a_large_send_and_the_write_loop_goes_on() {
    let expected = "handler ran during the send: True ; every byte arrived: True";
    assert_eq!(run(false), expected, "natively");
    assert_eq!(run(true), expected, "preloaded (the SAN path)");
}
