//! fork and exec with connections on the SAN (run under the preload with `SANDIRECT_SAN=1`):
//! the switch is exact, and so must be the way back to kernel TCP when a process forks or
//! execs with SAN sockets open.
//!
//! ```text
//! san_fork server MODE       prints "port N", serves one client, prints "server ok ..."
//! san_fork client PORT MODE  prints "client ok ... bypass=B san_bytes=S"
//! ```
//! MODE:
//! * `handoff` — the server forks after the client's request arrived (unread), closes its
//!   copy; the child reads the request and serves the rest of the conversation.
//! * `keep` — the server forks a child that only holds the socket for a while (redis
//!   BGSAVE); the parent goes on serving.
//! * `exec` — like `handoff`, but the child execs this program (`exec-child FD`) with the
//!   socket inherited, and the new image serves.
//! * `spawn` — the server runs /bin/true by posix_spawn (the socket not passed on: the
//!   connection stays on the SAN), then by vfork + execve (every SAN connection is
//!   downgraded first: a vfork child may pass any socket on).
//! * `vfork-exec` — like `exec`, but by `vfork`: the child (libc calls only) `dup2`s the
//!   socket onto fd 50 (the original keeps close-on-exec, as CPython's subprocess does with
//!   `stdin=sock`) and execs `exec-child 50`.
//! * `spawn-exec` — like `exec`, but by `posix_spawn` with a `dup2` file action onto fd 0
//!   (what Rust's `Command::stdin(socket)` does): the new image serves from its stdin.
//! * `idle-peer` — like `handoff`, but the client makes no socket call for 1.5 s while the
//!   server forks: its nudge responder answers the downgrade, so the fork is quick and the
//!   child serves.
//! * `stopped-peer` — the server stops the client (SIGSTOP; its pid found in the published
//!   records), forks a child that leaves at once, and continues the client: nobody can
//!   answer, so fork waits its bounded budget and the parent keeps serving.
//!
//! Conversation: client sends R0 (1 KiB), server answers A0 (1 KiB) — by then both ends are on
//! the SAN — client sends R1 (200 KiB in 20 KiB writes, inline), server (after the fork, in the child for handoff/exec)
//! checks R1, sends A1 (1 MiB), client checks A1 and sends R2 (1 MiB), server checks R2 and sends
//! "done". Every message is a seeded pattern: a lost, duplicated or reordered byte fails.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::time::Duration;

use integration::pattern::XorShift64;
use preload_core::record::{Counter, DataPath};

const R0: usize = 1 << 10;
const A0: usize = 1 << 10;
const R1: usize = 200 << 10;
const A1: usize = 1 << 20;
const R2: usize = 1 << 20;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    XorShift64::new(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1).low_bytes(len)
}

fn expect(stream: &mut TcpStream, seed: u64, len: usize, what: &str) {
    let mut got = vec![0u8; len];
    stream
        .read_exact(&mut got)
        .unwrap_or_else(|e| fail(&format!("{what}: read: {e}")));
    if got != pattern(seed, len) {
        let at = got
            .iter()
            .zip(pattern(seed, len))
            .position(|(a, b)| *a != b)
            .unwrap_or(0);
        fail(&format!("{what}: bytes differ from offset {at}"));
    }
}

fn fail(message: &str) -> ! {
    eprintln!("san_fork {}: {message}", std::process::id());
    std::process::exit(1);
}

/// The published record of this process's connection with `port` at either end.
fn published(port: u16) -> String {
    let Some(connections) = integration::own_published_connections() else {
        return "bypass=unpublished san_bytes=0".into();
    };
    connections
        .iter()
        .find(|c| {
            c.peer.is_some()
                && (c.local.is_some_and(|a| a.port() == port)
                    || c.peer.is_some_and(|a| a.port() == port))
        })
        .map_or_else(
            || "bypass=none san_bytes=0".into(),
            |c| {
                let san = c.counter(Counter::SanInlineSent)
                    + c.counter(Counter::SanInlineReceived)
                    + c.counter(Counter::SanRendezvousSent)
                    + c.counter(Counter::SanRendezvousReceived);
                let path = if c.path == DataPath::Tcp {
                    "tcp"
                } else {
                    "san"
                };
                format!("path={path} bypass={} san_bytes={san}", c.bypass.label())
            },
        )
}

/// The pid of another process that published a connection whose local port is `port`.
fn published_pid_with_local_port(port: u16) -> Option<libc::pid_t> {
    let dir = preload_core::stats::default_dir()?;
    std::fs::read_dir(&dir).ok()?.flatten().find_map(|entry| {
        let pid: libc::pid_t = entry.file_name().to_str()?.parse().ok()?;
        let connections = preload_core::stats::read_file(&entry.path()).ok()?.ok()?;
        (pid as u32 != std::process::id()
            && connections
                .iter()
                .any(|c| c.local.is_some_and(|a| a.port() == port)))
        .then_some(pid)
    })
}

/// Waits (bounded) until every thread of process `pid` is in the stopped state.
fn all_threads_stopped(pid: libc::pid_t, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let stopped = || {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return false;
        };
        tasks.flatten().all(|task| {
            std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
                // The state follows the parenthesised command name.
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('T'))
            })
        })
    };
    while std::time::Instant::now() < deadline {
        if stopped() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// The part of the conversation after the fork (or exec).
fn serve_rest(mut stream: TcpStream) {
    expect(&mut stream, 1, R1, "R1");
    stream.write_all(&pattern(2, A1)).unwrap();
    expect(&mut stream, 3, R2, "R2");
    stream.write_all(b"done").unwrap();
    // Wait for the client's close so our last bytes are surely delivered.
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    if !rest.is_empty() {
        fail("bytes after the end of the conversation");
    }
}

fn wait_child(pid: libc::pid_t) -> i32 {
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if libc::WIFEXITED(status) {
        libc::WEXITSTATUS(status)
    } else {
        128 + libc::WTERMSIG(status)
    }
}

fn server(mode: &str) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    println!("port {port}");
    std::io::stdout().flush().unwrap();
    let (mut stream, _) = listener.accept().unwrap();
    expect(&mut stream, 0, R0, "R0");
    stream.write_all(&pattern(10, A0)).unwrap();
    // Let R1 arrive (in the session, unread) before forking.
    let mut byte = [0u8; 1];
    stream.peek(&mut byte).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let before = published(port);
    match mode {
        "handoff" | "exec" => {
            // SAFETY: fork; the child only uses the socket and exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                if mode == "exec" {
                    let fd = stream.into_raw_fd();
                    // SAFETY: clearing close-on-exec on our socket so the new image gets it.
                    unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
                    let program = std::env::current_exe().unwrap();
                    let error = std::os::unix::process::CommandExt::exec(
                        std::process::Command::new(program).args(["exec-child", &fd.to_string()]),
                    );
                    fail(&format!("exec: {error}"));
                }
                serve_rest(stream);
                std::process::exit(0);
            }
            drop(stream);
            let status = wait_child(pid);
            if status != 0 {
                fail(&format!("child exited with {status}"));
            }
            println!("server ok mode={mode} before_fork=[{before}]");
        }
        "vfork-exec" | "spawn-exec" => {
            let program = std::ffi::CString::new(
                std::env::current_exe()
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes(),
            )
            .unwrap();
            let target = if mode == "vfork-exec" { 50 } else { 0 };
            let target_arg = std::ffi::CString::new(target.to_string()).unwrap();
            let argv = [
                program.as_ptr(),
                c"exec-child".as_ptr(),
                target_arg.as_ptr(),
                core::ptr::null(),
            ];
            extern "C" {
                static environ: *const *const libc::c_char;
            }
            let fd = stream.as_raw_fd();
            let pid = if mode == "vfork-exec" {
                // SAFETY: the vfork child only calls dup2, execve and _exit, on memory prepared
                // before the vfork.
                unsafe {
                    #[allow(deprecated)]
                    let pid = libc::vfork();
                    if pid == 0 {
                        libc::dup2(fd, target);
                        libc::execve(program.as_ptr(), argv.as_ptr(), environ);
                        libc::_exit(127);
                    }
                    pid
                }
            } else {
                let mut pid = 0;
                // SAFETY: file actions initialised, used and destroyed here; argv and environ
                // are NULL-terminated arrays of C strings.
                unsafe {
                    let mut actions: libc::posix_spawn_file_actions_t = core::mem::zeroed();
                    libc::posix_spawn_file_actions_init(&mut actions);
                    libc::posix_spawn_file_actions_adddup2(&mut actions, fd, target);
                    let rc = libc::posix_spawn(
                        &mut pid,
                        program.as_ptr(),
                        &actions,
                        core::ptr::null(),
                        argv.as_ptr().cast(),
                        environ.cast(),
                    );
                    libc::posix_spawn_file_actions_destroy(&mut actions);
                    if rc != 0 {
                        fail(&format!("posix_spawn: {rc}"));
                    }
                }
                pid
            };
            if pid < 0 {
                fail("vfork failed");
            }
            drop(stream);
            let status = wait_child(pid);
            if status != 0 {
                fail(&format!("child exited with {status}"));
            }
            println!("server ok mode={mode} before_fork=[{before}]");
        }
        "keep" => {
            // SAFETY: fork; the child only sleeps holding the socket, then leaves.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                std::thread::sleep(Duration::from_millis(300));
                // SAFETY: leave without touching anything of the parent's.
                unsafe { libc::_exit(0) };
            }
            serve_rest(stream);
            let status = wait_child(pid);
            if status != 0 {
                fail(&format!("child exited with {status}"));
            }
            println!(
                "server ok mode={mode} before_fork=[{before}] after=[{}]",
                published(port)
            );
        }
        "idle-peer" => {
            // The client makes no socket call for 1.5 s; its responder thread answers.
            let started = std::time::Instant::now();
            // SAFETY: fork; the child only uses the socket and exits.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                serve_rest(stream);
                std::process::exit(0);
            }
            let fork_ms = started.elapsed().as_millis();
            drop(stream);
            let status = wait_child(pid);
            if status != 0 {
                fail(&format!("child exited with {status}"));
            }
            println!("server ok mode={mode} before_fork=[{before}] fork_ms={fork_ms}");
        }
        "stopped-peer" => {
            let peer_port = stream.peer_addr().unwrap().port();
            let client = published_pid_with_local_port(peer_port)
                .unwrap_or_else(|| fail("the client's published record was not found"));
            // SAFETY: kill(2) of the client process of this test.
            unsafe { libc::kill(client, libc::SIGSTOP) };
            // kill() returns before every thread of the target has stopped.
            if !all_threads_stopped(client, Duration::from_secs(5)) {
                fail("the client did not stop");
            }
            let started = std::time::Instant::now();
            // SAFETY: fork; the child leaves at once.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                // SAFETY: leave without touching anything of the parent's.
                unsafe { libc::_exit(0) };
            }
            let fork_ms = started.elapsed().as_millis();
            // SAFETY: as above.
            unsafe { libc::kill(client, libc::SIGCONT) };
            serve_rest(stream);
            let status = wait_child(pid);
            if status != 0 {
                fail(&format!("child exited with {status}"));
            }
            println!("server ok mode={mode} before_fork=[{before}] fork_ms={fork_ms}");
        }
        "spawn" => {
            // posix_spawn (Rust's Command) of a program that does not receive the socket
            // (close-on-exec, no file action names it): the connection stays on the SAN.
            let status = std::process::Command::new("/bin/true")
                .status()
                .unwrap_or_else(|e| fail(&format!("spawn: {e}")));
            if !status.success() {
                fail("spawned /bin/true failed");
            }
            let after_spawn = published(port);
            // vfork + execve: the child could pass any socket on, so every SAN connection is
            // downgraded first (exactly), and the child's hook calls leave our state alone.
            let path = c"/bin/true";
            let argv = [path.as_ptr(), core::ptr::null()];
            let envp = [core::ptr::null::<libc::c_char>()];
            // SAFETY: the vfork child only calls execve and _exit.
            let pid = unsafe {
                #[allow(deprecated)]
                let pid = libc::vfork();
                if pid == 0 {
                    libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr());
                    libc::_exit(127);
                }
                pid
            };
            if wait_child(pid) != 0 {
                fail("vfork + execve of /bin/true failed");
            }
            serve_rest(stream);
            println!(
                "server ok mode={mode} before_fork=[{before}] after_spawn=[{after_spawn}] after=[{}]",
                published(port)
            );
        }
        other => fail(&format!("unknown mode {other}")),
    }
}

fn client(port: u16, mode: &str) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.write_all(&pattern(0, R0)).unwrap();
    expect(&mut stream, 10, A0, "A0");
    // In pieces below the rendezvous threshold: they go inline and wait, unread, in the
    // server's session when it forks (the stash must carry them).
    for piece in pattern(1, R1).chunks(20 << 10) {
        stream.write_all(piece).unwrap();
    }
    if mode == "idle-peer" {
        std::thread::sleep(Duration::from_millis(1500));
    }
    expect(&mut stream, 2, A1, "A1");
    stream.write_all(&pattern(3, R2)).unwrap();
    let mut done = [0u8; 4];
    stream.read_exact(&mut done).unwrap();
    if &done != b"done" {
        fail("no done");
    }
    let report = published(port);
    drop(stream);
    println!("client ok mode={mode} {report}");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("server") => server(args.get(2).map_or("handoff", String::as_str)),
        Some("client") => {
            let port = args.get(2).and_then(|p| p.parse().ok()).unwrap_or(0);
            client(port, args.get(3).map_or("handoff", String::as_str));
        }
        Some("exec-child") => {
            let fd: i32 = args.get(2).and_then(|f| f.parse().ok()).unwrap_or(-1);
            // SAFETY: the exec'ing image handed us this connected socket.
            let stream = unsafe { TcpStream::from_raw_fd(fd) };
            let _ = stream.as_raw_fd();
            serve_rest(stream);
        }
        _ => fail("usage: san_fork server MODE | client PORT MODE"),
    }
}
