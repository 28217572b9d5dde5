//! Large blocking sends over the SAN go by rendezvous (zero-copy through the registration
//! cache): two preloaded processes move 4 MiB (the threshold: the send buffer) and 16 MiB
//! in single `send()` calls, with checksums, and the published counters must show the bytes
//! went by rendezvous (and 3 MiB went inline, buffered as TCP would). Also: receive buffers smaller than the segment, `MSG_PEEK` and `MSG_WAITALL`
//! on a segment, and refused registrations (`SANDIRECT_SAN_REFUSE_REGISTRATIONS`, the san
//! module's test knob): `ENOBUFS` on the sender with nothing sent, the receiver turning the
//! segment down without losing a byte.
//!
//! The two processes are this test binary itself, re-run under the preload with
//! `--ignored --exact rendezvous_child_role` and the role in `RNDV_ROLE`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use integration::pattern::{fnv1a, XorShift64};
use preload_core::record::{Counter, SocketState};

/// `libsandirect.so`, built once per test run (same profile as this test).
fn library() -> &'static Path {
    &integration::apps::products().library
}

/// Private stats and segment directories for one test.
struct Dirs {
    stat: PathBuf,
    shm: PathBuf,
}

impl Dirs {
    fn new(name: &str) -> Dirs {
        let base =
            std::env::temp_dir().join(format!("sandirect-rndv-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let make = |dir: &Path| {
            std::fs::create_dir_all(dir).unwrap();
            std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .unwrap();
        };
        make(&base);
        let dirs = Dirs {
            stat: base.join("stat"),
            shm: base.join("shm"),
        };
        make(&dirs.stat);
        make(&dirs.shm);
        dirs
    }
}

/// The options of one transfer.
#[derive(Clone, Debug)]
struct Transfer {
    /// Bytes the client sends.
    bytes: usize,
    /// Bytes per `send()` call.
    send_chunk: usize,
    /// Bytes per `recv()` call on the server.
    recv_buffer: usize,
    /// The server peeks 4 KiB before its first read and checks the read returns the same.
    peek: bool,
    /// The server reads with `MSG_WAITALL`.
    wait_all: bool,
    /// Registrations the client (sender) refuses.
    client_refusals: u32,
    /// Registrations the server (receiver) refuses.
    server_refusals: u32,
}

impl Transfer {
    fn new(bytes: usize) -> Transfer {
        Transfer {
            bytes,
            send_chunk: bytes,
            recv_buffer: bytes,
            peek: false,
            wait_all: false,
            client_refusals: 0,
            server_refusals: 0,
        }
    }
}

/// One side's report: `key=value` pairs after `<side> ok`.
#[derive(Debug)]
struct Report(Vec<(String, String)>);

impl Report {
    fn parse(output: &str, side: &str) -> Report {
        // The harness may print "test … " before it on the same line.
        let marker = format!("{side} ok ");
        let line = output
            .lines()
            .find_map(|l| l.split_once(&marker).map(|(_, report)| report))
            .unwrap_or_else(|| panic!("no {side} report in:\n{output}"));
        Report(
            line.split_whitespace()
                .filter_map(|pair| pair.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        )
    }

    fn get(&self, key: &str) -> &str {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no {key} in {self:?}"))
    }

    fn number(&self, key: &str) -> u64 {
        self.get(key).parse().unwrap()
    }
}

fn child(role: &str, transfer: &Transfer, refusals: u32, dirs: &Dirs) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .args([
            "--ignored",
            "--exact",
            "rendezvous_child_role",
            "--nocapture",
            "--test-threads=1",
        ])
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN_RENDEZVOUS")
        .env("LD_PRELOAD", library())
        .env("SANDIRECT_SAN", "1")
        .env("SANDIRECT_STAT_DIR", &dirs.stat)
        .env("SANDIRECT_SHM_DIR", &dirs.shm)
        .env("SANDIRECT_SAN_REFUSE_REGISTRATIONS", refusals.to_string())
        .env("RNDV_ROLE", role)
        .env("RNDV_BYTES", transfer.bytes.to_string())
        .env("RNDV_SEND_CHUNK", transfer.send_chunk.to_string())
        .env("RNDV_RECV_BUFFER", transfer.recv_buffer.to_string())
        .env("RNDV_PEEK", u8::from(transfer.peek).to_string())
        .env("RNDV_WAIT_ALL", u8::from(transfer.wait_all).to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Waits for `child` with a deadline (a hang is a failure, not a stuck test run).
fn finish(mut child: Child, mut stdout: impl Read, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut out = String::new();
            stdout.read_to_string(&mut out).unwrap();
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            assert!(status.success(), "{what} failed ({status}):\n{out}\n{err}");
            return out;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} hung");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs the transfer between two preloaded processes: (server report, client report).
fn run(name: &str, transfer: &Transfer) -> (Report, Report) {
    let dirs = Dirs::new(name);
    let mut server = child("server", transfer, transfer.server_refusals, &dirs)
        .spawn()
        .unwrap();
    let mut server_out = BufReader::new(server.stdout.take().unwrap());
    let port = loop {
        let mut line = String::new();
        assert!(
            server_out.read_line(&mut line).unwrap() > 0,
            "server ended before printing its port"
        );
        // The harness may print "test … " before it on the same line.
        if let Some((_, port)) = line.trim().split_once("port ") {
            break port.to_owned();
        }
    };
    let mut client = child("client", transfer, transfer.client_refusals, &dirs);
    let mut client = client.env("RNDV_PORT", &port).spawn().unwrap();
    let client_out = client.stdout.take().unwrap();
    let client_output = finish(client, client_out, "client");
    let server_output = finish(server, server_out, "server");
    (
        Report::parse(&server_output, "server"),
        Report::parse(&client_output, "client"),
    )
}

fn pattern(len: usize) -> Vec<u8> {
    XorShift64::new(0x9e37_79b9_7f4a_7c15).low_bytes(len)
}

/// Checks the data arrived whole and in order.
fn assert_delivered(server: &Report, transfer: &Transfer) {
    assert_eq!(server.number("bytes"), transfer.bytes as u64, "{server:?}");
    assert_eq!(
        server.get("checksum"),
        format!("{:016x}", fnv1a(&pattern(transfer.bytes))),
        "{server:?}"
    );
}

#[test]
fn a_send_of_the_threshold_goes_by_rendezvous() {
    let transfer = Transfer::new(4 << 20);
    let (server, client) = run("4m", &transfer);
    assert_delivered(&server, &transfer);
    assert_eq!(client.number("rendezvous_sent"), 4 << 20, "{client:?}");
    assert_eq!(client.number("inline_sent"), 0, "{client:?}");
    assert_eq!(server.number("rendezvous_received"), 4 << 20, "{server:?}");
}

#[test]
fn a_send_below_the_threshold_is_buffered_inline_as_tcp_would() {
    // A blocking send the kernel would buffer (its send buffer grows to 4 MiB) must not wait
    // for the receiver: it goes inline through the send buffer.
    let transfer = Transfer::new(3 << 20);
    let (server, client) = run("3m", &transfer);
    assert_delivered(&server, &transfer);
    assert_eq!(client.number("rendezvous_sent"), 0, "{client:?}");
    assert_eq!(client.number("inline_sent"), 3 << 20, "{client:?}");
}

#[test]
fn sixteen_mib_send_goes_by_rendezvous_into_smaller_receive_buffers() {
    let mut transfer = Transfer::new(16 << 20);
    // Not a divisor of the segment: the last receive of it is short.
    transfer.recv_buffer = 300_000;
    let (server, client) = run("16m", &transfer);
    assert_delivered(&server, &transfer);
    assert_eq!(client.number("rendezvous_sent"), 16 << 20, "{client:?}");
    assert_eq!(server.number("rendezvous_received"), 16 << 20, "{server:?}");
    assert!(
        server.number("reads") >= (16 << 20) / 300_000,
        "each read fills at most its buffer: {server:?}"
    );
}

#[test]
fn peek_and_wait_all_on_a_rendezvous_segment() {
    let mut transfer = Transfer::new(16 << 20);
    transfer.send_chunk = 4 << 20;
    transfer.recv_buffer = 6_000_000;
    transfer.peek = true;
    transfer.wait_all = true;
    let (server, client) = run("peek", &transfer);
    assert_delivered(&server, &transfer);
    assert_eq!(server.get("peek"), "same", "{server:?}");
    // FIONREAD counts the announced rendezvous segment, not only the inline prefix: the
    // whole first 4 MiB send is readable without waiting for the peer.
    assert!(server.number("fionread") >= 4 << 20, "{server:?}");
    assert_eq!(client.number("rendezvous_sent"), 16 << 20, "{client:?}");
    // MSG_WAITALL fills each buffer across segment boundaries: 3 reads for 16 MiB.
    assert_eq!(server.number("reads"), 3, "{server:?}");
}

#[test]
fn refused_sender_registration_is_enobufs_and_nothing_is_lost() {
    let mut transfer = Transfer::new(8 << 20);
    transfer.send_chunk = 4 << 20;
    transfer.client_refusals = 2;
    let (server, client) = run("enobufs", &transfer);
    assert_delivered(&server, &transfer);
    assert_eq!(client.number("enobufs"), 2, "{client:?}");
    // The retries went by rendezvous once registrations were granted again.
    assert_eq!(client.number("rendezvous_sent"), 8 << 20, "{client:?}");
}

#[test]
fn refused_receiver_registration_turns_the_segment_down_without_loss() {
    let mut transfer = Transfer::new(8 << 20);
    transfer.send_chunk = 4 << 20;
    transfer.server_refusals = 1;
    let (server, client) = run("reject", &transfer);
    assert_delivered(&server, &transfer);
    assert_eq!(client.number("enobufs"), 0, "{client:?}");
    let rendezvous = server.number("rendezvous_received");
    assert!(
        rendezvous < 8 << 20,
        "the turned-down segment must not count as rendezvous: {server:?}"
    );
    assert_eq!(
        client.number("rendezvous_sent") + client.number("inline_sent"),
        8 << 20,
        "{client:?}"
    );
}

// ------------------------------------------------------------------------ the child roles

fn env_number(name: &str) -> usize {
    std::env::var(name).unwrap().parse().unwrap()
}

/// This process's published SAN connection counters: (rendezvous sent, inline sent,
/// rendezvous received).
fn own_counters() -> (u64, u64, u64) {
    let path = preload_core::stats::default_dir()
        .unwrap()
        .join(std::process::id().to_string());
    let connections = preload_core::stats::read_file(&path).unwrap().unwrap();
    let san: Vec<_> = connections
        .iter()
        .filter(|c| c.state == SocketState::San)
        .collect();
    assert_eq!(san.len(), 1, "one SAN connection expected: {connections:?}");
    (
        san[0].counter(Counter::SanRendezvousSent),
        san[0].counter(Counter::SanInlineSent),
        san[0].counter(Counter::SanRendezvousReceived),
    )
}

fn recv(fd: i32, buf: &mut [u8], flags: i32) -> usize {
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
        if n >= 0 {
            return n as usize;
        }
        let error = std::io::Error::last_os_error();
        assert_eq!(
            error.kind(),
            std::io::ErrorKind::Interrupted,
            "recv: {error}"
        );
    }
}

fn serve() {
    let bytes = env_number("RNDV_BYTES");
    let recv_buffer = env_number("RNDV_RECV_BUFFER");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    println!("port {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (mut stream, _) = listener.accept().unwrap();
    // "Ready": the client switches on reading it, so its sends start on the SAN.
    stream.write_all(b"r").unwrap();
    let fd = stream.as_raw_fd();
    let mut received = Vec::with_capacity(bytes);
    let mut peek = "off";
    let mut fionread = 0;
    if std::env::var("RNDV_PEEK").as_deref() == Ok("1") {
        let mut peeked = vec![0u8; 4096];
        let n = recv(fd, &mut peeked, libc::MSG_PEEK);
        let mut pending: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int.
        unsafe { libc::ioctl(fd, libc::FIONREAD, &mut pending) };
        fionread = pending;
        let mut read = vec![0u8; n];
        stream.read_exact(&mut read).unwrap();
        peek = if n > 0 && peeked[..n] == read[..] {
            "same"
        } else {
            "differs"
        };
        received.extend_from_slice(&read);
    }
    let flags = if std::env::var("RNDV_WAIT_ALL").as_deref() == Ok("1") {
        libc::MSG_WAITALL
    } else {
        0
    };
    let mut buf = vec![0u8; recv_buffer];
    let mut reads = 0;
    while received.len() < bytes {
        let want = buf.len().min(bytes - received.len());
        let n = recv(fd, &mut buf[..want], flags);
        assert!(n > 0, "end of stream after {} bytes", received.len());
        reads += 1;
        received.extend_from_slice(&buf[..n]);
    }
    let (_, _, rendezvous_received) = own_counters();
    println!(
        "server ok bytes={} checksum={:016x} rendezvous_received={rendezvous_received} reads={reads} peek={peek} fionread={fionread}",
        received.len(),
        fnv1a(&received)
    );
    std::io::stdout().flush().unwrap();
    // "Done": the client reads its counters while the connection is still open.
    stream.write_all(b"d").unwrap();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).unwrap();
}

fn connect_and_send() {
    let bytes = env_number("RNDV_BYTES");
    let chunk = env_number("RNDV_SEND_CHUNK");
    let port: u16 = env_number("RNDV_PORT").try_into().unwrap();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut ready = [0u8; 1];
    stream.read_exact(&mut ready).unwrap();
    let data = pattern(bytes);
    let fd = stream.as_raw_fd();
    let (mut sent, mut enobufs) = (0usize, 0u32);
    while sent < bytes {
        let piece = &data[sent..(sent + chunk).min(bytes)];
        // SAFETY: `piece` is readable for its length.
        let n = unsafe { libc::send(fd, piece.as_ptr().cast(), piece.len(), 0) };
        if n >= 0 {
            sent += n as usize;
            continue;
        }
        let error = std::io::Error::last_os_error();
        match error.raw_os_error() {
            // What an application does on ENOBUFS: try again (nothing was sent).
            Some(libc::ENOBUFS) => enobufs += 1,
            Some(libc::EINTR) => {}
            _ => panic!("send: {error}"),
        }
    }
    let mut done = [0u8; 1];
    stream.read_exact(&mut done).unwrap();
    let (rendezvous_sent, inline_sent, _) = own_counters();
    println!(
        "client ok bytes={sent} enobufs={enobufs} rendezvous_sent={rendezvous_sent} inline_sent={inline_sent}"
    );
    std::io::stdout().flush().unwrap();
}

/// Not a test: the entry point of the child processes the tests above start (`RNDV_ROLE`).
#[test]
#[ignore = "run by the tests above as a child process"]
fn rendezvous_child_role() {
    match std::env::var("RNDV_ROLE").as_deref() {
        Ok("server") => serve(),
        Ok("client") => connect_and_send(),
        other => panic!("RNDV_ROLE must be server or client, not {other:?}"),
    }
}
