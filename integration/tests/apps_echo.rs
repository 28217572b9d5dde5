//! A Python asyncio echo server and client, Python forking servers (a `ForkingMixIn` server
//! that forks per connection, and a pre-forked one whose workers accept), and a Rust
//! `std::net` server and client, under `sandirect run`: every echoed byte verified (sha256 in
//! Python, the regenerated stream in Rust), every connection on the expected path (for the
//! forking servers, the process that serves a connection holds it on the SAN), nothing left
//! behind.

use std::time::Duration;

use integration::apps::{exclusive, require_program, Preloaded, Sandbox};

const APP_STDNET: &str = env!("CARGO_BIN_EXE_app_stdnet");
const STDNET: &str = env!("CARGO_BIN_EXE_stdnet");
/// Bytes each Python connection echoes.
const PYTHON_BYTES: u64 = 3 << 20;
/// Bytes each Rust connection echoes.
const RUST_BYTES: u64 = 8 << 20;

/// Server: `echo.py server N` echoes N connections, then exits. Client: `echo.py client PORT N
/// BYTES` streams BYTES random bytes per connection in chunks of varying size while reading the
/// echo, compares sha256 digests, holds the connections open until stdin closes.
const ECHO_PY: &str = r#"
import asyncio, hashlib, random, sys

async def serve(count):
    remaining, done = [count], asyncio.Event()
    async def echo(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
            remaining[0] -= 1
            if remaining[0] == 0:
                done.set()
    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    print("listening", server.sockets[0].getsockname()[1], flush=True)
    await done.wait()
    server.close()
    await server.wait_closed()
    print("served", count, flush=True)

async def exchange(port, index, size):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = random.Random(index).randbytes(size)
    async def send():
        position, chunks = 0, [1, 100, 1460, 8191, 65536, 200003]
        while position < size:
            chunk = chunks[position % len(chunks)]
            writer.write(payload[position:position + chunk])
            position += chunk
            await writer.drain()
    sender = asyncio.create_task(send())
    digest, received = hashlib.sha256(), 0
    while received < size:
        data = await reader.read(65536)
        if not data:
            raise RuntimeError(f"connection {index}: echo ended after {received} bytes")
        digest.update(data)
        received += len(data)
    await sender
    if digest.digest() != hashlib.sha256(payload).digest():
        raise RuntimeError(f"connection {index}: sha256 of the echo differs")
    return reader, writer

async def client(port, count, size):
    connections = await asyncio.gather(*(exchange(port, i, size) for i in range(count)))
    print(f"holding: {count} connections, {size} bytes each, sha256 verified", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for reader, writer in connections:
        writer.write_eof()
        if await reader.read() != b"":
            raise RuntimeError("bytes after the echo")
        writer.close()
        await writer.wait_closed()
    print("closed", flush=True)

if sys.argv[1] == "server":
    asyncio.run(serve(int(sys.argv[2])))
else:
    asyncio.run(client(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"#;

/// Forking echo servers: `forking.py per-connection N` accepts N connections in the parent
/// (`socketserver.ForkingMixIn`: fork per connection, the parent closes its copy);
/// `forking.py pre-forked N` forks N workers that each accept one connection from the
/// inherited listener. Each prints `listening PORT`, then `served N` once every child exited
/// successfully.
const FORKING_PY: &str = r#"
import os, socket, socketserver, sys

class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(65536):
            self.request.sendall(data)

class ForkingServer(socketserver.ForkingMixIn, socketserver.TCPServer):
    block_on_close = True

def per_connection(count):
    with ForkingServer(("127.0.0.1", 0), Echo) as server:
        print("listening", server.server_address[1], flush=True)
        for _ in range(count):
            server.handle_request()
    # (server_close waited for every child)
    print("served", count, flush=True)

def pre_forked(count):
    listener = socket.create_server(("127.0.0.1", 0), backlog=count)
    workers = []
    for _ in range(count):
        pid = os.fork()
        if pid == 0:
            connection, _ = listener.accept()
            listener.close()
            while data := connection.recv(65536):
                connection.sendall(data)
            connection.close()
            os._exit(0)
        workers.append(pid)
    print("listening", listener.getsockname()[1], flush=True)
    failed = [pid for pid in workers if os.waitpid(pid, 0)[1] != 0]
    if failed:
        raise SystemExit(f"workers failed: {failed}")
    print("served", count, flush=True)

{"per-connection": per_connection, "pre-forked": pre_forked}[sys.argv[1]](int(sys.argv[2]))
"#;

/// Starts `server` (which prints `listening PORT`), runs `client` against it (each of its
/// `connections` echoing `bytes_per_connection` bytes), checks paths and byte counts while the
/// client holds its connections, and waits for the server to exit by itself.
fn echo_pair(
    sandbox: &Sandbox,
    preloaded: Preloaded,
    server: std::process::Command,
    client: impl FnOnce(u16) -> std::process::Command,
    connections: usize,
    bytes_per_connection: u64,
) -> String {
    let mut server = sandbox.spawn_piped("echo-server", server);
    let stdout = server.take_stdout();
    let (lines, rest) =
        integration::apps::read_until_line(stdout, "listening", Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("echo server: {e}\n{}", server.stderr()));
    let port: u16 = lines
        .last()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|port| port.parse().ok())
        .unwrap_or_else(|| panic!("no port in {lines:?}"));
    let server_output = integration::apps::drain(rest);
    let sides = usize::from(preloaded.client()) + usize::from(preloaded.server());
    let output = sandbox.run_holding("echo-client", client(port), Duration::from_secs(90), |_| {
        let live = sandbox.assert_live_paths(port, preloaded.expected_path(), connections * sides);
        // The interposer counted exactly what each end wrote and read (the echo is complete
        // when the client holds), whatever path the bytes took.
        for connection in &live {
            assert_eq!(
                integration::apps::application_bytes(connection),
                (bytes_per_connection, bytes_per_connection),
                "published byte counts of {connection:?}"
            );
        }
    });
    assert!(output.contains("closed"), "{output}");
    let status = server.wait_timeout(Duration::from_secs(30));
    assert!(
        status.success(),
        "echo server: {status}\n{}",
        server.stderr()
    );
    let server_output = server_output
        .join()
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();
    sandbox.assert_nothing_left_behind();
    format!("{output}\n{server_output}")
}

fn python_echo(preloaded: Preloaded) {
    python_echo_against(None, 6, preloaded);
}

/// A forking server (`mode` of `FORKING_PY`) against the asyncio client: the children that
/// serve the connections hold them on the expected path.
fn python_forking_echo(mode: &str, preloaded: Preloaded) {
    python_echo_against(Some(mode), 4, preloaded);
}

/// The asyncio client's `connections` against the asyncio server (`forking`: `None`) or the
/// forking server in that mode, every echo verified and every connection on the expected path.
fn python_echo_against(forking: Option<&str>, connections: usize, preloaded: Preloaded) {
    let _serial = exclusive();
    let python = require_program("python3", "python3");
    let sandbox = Sandbox::new(&format!(
        "python-{}-{preloaded:?}",
        forking.unwrap_or("asyncio")
    ));
    let echo = sandbox.path().join("echo.py");
    std::fs::write(&echo, ECHO_PY).expect("write echo.py");
    let count = connections.to_string();
    let mut server = sandbox.command(&python, preloaded.server());
    match forking {
        Some(mode) => {
            let script = sandbox.path().join("forking.py");
            std::fs::write(&script, FORKING_PY).expect("write forking.py");
            server.arg(&script).args([mode, &count]);
        }
        None => {
            server.arg(&echo).args(["server", &count]);
        }
    }
    let output = echo_pair(
        &sandbox,
        preloaded,
        server,
        |port| {
            let mut client = sandbox.command(&python, preloaded.client());
            client.arg(&echo).args([
                "client",
                &port.to_string(),
                &count,
                &PYTHON_BYTES.to_string(),
            ]);
            client
        },
        connections,
        PYTHON_BYTES,
    );
    assert!(
        output.contains(&format!(
            "holding: {connections} connections, 3145728 bytes each, sha256 verified"
        )),
        "{output}"
    );
    assert!(
        output.contains(&format!("served {connections}")),
        "{output}"
    );
}

fn rust_std_net_echo(preloaded: Preloaded) {
    let _serial = exclusive();
    let sandbox = Sandbox::new(&format!("stdnet-{preloaded:?}"));
    let connections = 4;
    let mut server = sandbox.command(APP_STDNET, preloaded.server());
    server.args(["server", &connections.to_string()]);
    let output = echo_pair(
        &sandbox,
        preloaded,
        server,
        |port| {
            let mut client = sandbox.command(APP_STDNET, preloaded.client());
            client.args([
                "client",
                &port.to_string(),
                &connections.to_string(),
                &RUST_BYTES.to_string(),
            ]);
            client
        },
        connections,
        RUST_BYTES,
    );
    assert!(
        output.contains("holding: 4 connections, 8388608 bytes each echoed and verified"),
        "{output}"
    );
    assert!(
        output.contains("served 4 connections, echoed 33554432 bytes"),
        "{output}"
    );
}

#[test]
fn python_asyncio_echo_with_both_preloaded() {
    python_echo(Preloaded::Both);
}

#[test]
fn python_asyncio_echo_with_only_the_server_preloaded() {
    python_echo(Preloaded::ServerOnly);
}

#[test]
fn python_server_forking_per_connection_keeps_the_san() {
    python_forking_echo("per-connection", Preloaded::Both);
}

#[test]
fn python_pre_forked_server_keeps_the_san() {
    python_forking_echo("pre-forked", Preloaded::Both);
}

#[test]
fn python_server_forking_per_connection_with_only_the_server_preloaded() {
    python_forking_echo("per-connection", Preloaded::ServerOnly);
}

#[test]
fn rust_std_net_echo_with_both_preloaded() {
    rust_std_net_echo(Preloaded::Both);
}

#[test]
fn rust_std_net_echo_with_only_the_client_preloaded() {
    rust_std_net_echo(Preloaded::ClientOnly);
}

/// The one-process `stdnet` program (client and server threads, then a fork) under
/// `sandirect run`: the exchange works and both ends are published while it runs.
#[test]
fn rust_std_net_in_one_process_under_sandirect_run() {
    let _serial = exclusive();
    let sandbox = Sandbox::new("stdnet-one-process");
    let output = sandbox.run(
        "stdnet",
        sandbox.command(STDNET, true),
        Duration::from_secs(30),
    );
    assert!(output.contains("exchange: hello / world!"), "{output}");
    assert!(output.contains("server got: hello"), "{output}");
    assert!(
        output.contains("published: 2 connected"),
        "both ends must be published:\n{output}"
    );
    sandbox.assert_nothing_left_behind();
}
