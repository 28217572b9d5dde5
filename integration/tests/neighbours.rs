//! Hostile neighbours on the same host: other processes (of another user, or of ours) that
//! take the names the library uses can deny the speed-up, never break a connection.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// `libsandirect.so`, built once per test run (same profile as this test).
fn library() -> &'static Path {
    &integration::apps::products().library
}

fn private_dir(name: &str) -> PathBuf {
    integration::c_programs::private_dir("nb", name)
}

fn build(dir: &Path, name: &str, source: &str) -> Option<PathBuf> {
    integration::c_programs::build(dir, name, source, &[])
}

fn run(exe: &Path, args: &[&str], preload: bool, dir: &Path) -> String {
    integration::c_programs::run(exe, args, preload, dir, Duration::from_secs(30))
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A client connects; before the server accepts, a squatter (`foreign`: a process of another
/// user; `same`: one of ours that sends nothing) connects to the client's exchange name, which
/// it derives from the connection's 4-tuple as anyone can. Then the server accepts and echoes
/// 256 KiB. Prints whether the squatter got in and what the echo carried.
const SQUAT_THE_EXCHANGE: &str = r#"
#define _GNU_SOURCE /* setresuid, setresgid */
#include <arpa/inet.h>
#include <errno.h>
#include <grp.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define TOTAL (256 * 1024)
#define CHUNK 4096

static int squat(const char *name, int foreign) {
    if (foreign && (setgroups(0, NULL) || setresgid(65534, 65534, 65534)
                    || setresuid(65534, 65534, 65534))) return -2;
    struct sockaddr_un sun;
    memset(&sun, 0, sizeof sun);
    sun.sun_family = AF_UNIX;
    size_t n = strlen(name);
    memcpy(sun.sun_path + 1, name, n);
    int s = socket(AF_UNIX, SOCK_STREAM, 0);
    if (s < 0) return -1;
    if (connect(s, (struct sockaddr *)&sun, sizeof(sa_family_t) + 1 + n)) return -1;
    return s;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    int foreign = argc > 1 && strcmp(argv[1], "foreign") == 0;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof a;
    int go[2], to_squatter[2], from_squatter[2];
    if (l < 0 || bind(l, (struct sockaddr *)&a, len) || listen(l, 4)
        || getsockname(l, (struct sockaddr *)&a, &len) || pipe(go) || pipe(to_squatter)
        || pipe(from_squatter)) { perror("setup"); return 1; }
    /* Both helpers are forked before the connection exists. */
    pid_t server = fork();
    if (server == 0) {
        alarm(20);
        char b[CHUNK];
        if (read(go[0], b, 1) != 1) _exit(2);
        int s = accept(l, NULL, NULL);
        if (s < 0) _exit(3);
        ssize_t n;
        while ((n = recv(s, b, sizeof b, 0)) > 0) {
            ssize_t off = 0;
            while (off < n) {
                ssize_t w = send(s, b + off, n - off, MSG_NOSIGNAL);
                if (w <= 0) _exit(4);
                off += w;
            }
        }
        close(s);
        _exit(n == 0 ? 0 : 5);
    }
    pid_t squatter = fork();
    if (squatter == 0) {
        alarm(20);
        close(l);
        char name[256];
        ssize_t n = read(to_squatter[0], name, sizeof name - 1);
        if (n <= 0) _exit(2);
        name[n] = 0;
        int s = squat(name, foreign);
        char verdict = s >= 0 ? 'c' : s == -2 ? 'p' : 'r';
        if (write(from_squatter[1], &verdict, 1) != 1) _exit(3);
        /* Holds the connection until the client is done. */
        char b;
        close(to_squatter[1]);
        while (read(to_squatter[0], &b, 1) > 0) {}
        _exit(0);
    }
    close(l);
    close(to_squatter[0]);
    close(from_squatter[1]);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in local;
    socklen_t local_len = sizeof local;
    if (c < 0 || connect(c, (struct sockaddr *)&a, len)
        || getsockname(c, (struct sockaddr *)&local, &local_len)) { perror("connect"); return 1; }
    char name[256];
    int n = snprintf(name, sizeof name, "sandirect/%u/X/127.0.0.1-%u_127.0.0.1-%u",
                     (unsigned)geteuid(), ntohs(local.sin_port), ntohs(a.sin_port));
    char verdict = 0;
    if (write(to_squatter[1], name, n) != n || read(from_squatter[0], &verdict, 1) != 1) {
        perror("squatter");
        return 1;
    }
    if (verdict == 'p') { printf("squatter could not drop privileges\n"); return 1; }
    printf("squatter: %s\n", verdict == 'c' ? "connected to the exchange" : "no exchange");
    if (write(go[1], "g", 1) != 1) return 1;
    static char out[TOTAL], in[TOTAL];
    for (int i = 0; i < TOTAL; i++) out[i] = (char)(i * 7 + i / 251);
    size_t sent = 0, got = 0;
    int error = 0;
    while (got < TOTAL && !error) {
        if (sent < TOTAL) {
            ssize_t w = send(c, out + sent, CHUNK, MSG_NOSIGNAL);
            if (w < 0) { error = errno; break; }
            sent += w;
        }
        while (got < sent) {
            ssize_t r = recv(c, in + got, sent - got, 0);
            if (r < 0) { error = errno; break; }
            if (r == 0) { error = -1; break; }
            got += r;
        }
    }
    if (error > 0) printf("echo: %s after %zu bytes\n", strerror(error), got);
    else if (error < 0) printf("echo: EOF after %zu bytes\n", got);
    else printf("echo: %zu bytes, %s\n", got, memcmp(in, out, TOTAL) ? "corrupted" : "intact");
    shutdown(c, SHUT_WR);
    char b;
    ssize_t end = recv(c, &b, 1, 0);
    if (end == 0) printf("end: EOF\n");
    else printf("end: %zd %s\n", end, end < 0 ? strerror(errno) : "");
    close(c);
    close(to_squatter[1]);
    int status;
    waitpid(server, &status, 0);
    printf("server exit %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    waitpid(squatter, &status, 0);
    return 0;
}
"#;

fn squat_the_exchange(who: &str) {
    let dir = private_dir(&format!("squat-{who}"));
    let Some(exe) = build(&dir, "squat", SQUAT_THE_EXCHANGE) else {
        eprintln!("skipped: no C compiler");
        return;
    };
    let native = run(&exe, &[who], false, &dir);
    assert!(native.contains("echo: 262144 bytes, intact"), "{native}");
    let preloaded = run(&exe, &[who], true, &dir);
    // The squatter did get in: the test is about what happens next.
    assert!(
        preloaded.contains("squatter: connected to the exchange"),
        "{preloaded}"
    );
    let expected = "echo: 262144 bytes, intact\nend: EOF\nserver exit 0\n";
    assert!(preloaded.ends_with(expected), "preloaded:\n{preloaded}");
    assert!(native.ends_with(expected), "native:\n{native}");
}

/// Another user's process connected to the exchange first: the client discards it and
/// switches with the real acceptor.
#[test]
fn another_users_squatter_on_the_exchange_breaks_nothing() {
    if !is_root() {
        eprintln!("skipped: needs root to run a squatter as another user");
        return;
    }
    squat_the_exchange("foreign");
}

/// One of our own processes connected to the exchange first and sent nothing: not the
/// acceptor (which queues its descriptors before it attaches), so it is discarded too.
#[test]
fn a_silent_squatter_of_our_own_user_breaks_nothing() {
    squat_the_exchange("same");
}

/// `server`: listens on loopback, prints `port N`, reads one connection to its end.
/// `client PORT`: connects, prints `connected`, holds the connection until its stdin ends.
const HOLD_A_CONNECTION: &str = r#"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof a;
    char b[256];
    if (argc > 1 && strcmp(argv[1], "server") == 0) {
        int l = socket(AF_INET, SOCK_STREAM, 0);
        if (l < 0 || bind(l, (struct sockaddr *)&a, len) || listen(l, 4)
            || getsockname(l, (struct sockaddr *)&a, &len)) { perror("listen"); return 1; }
        printf("port %u\n", ntohs(a.sin_port));
        alarm(30);
        int s = accept(l, NULL, NULL);
        if (s < 0) { perror("accept"); return 1; }
        while (read(s, b, sizeof b) > 0) {}
        return 0;
    }
    if (argc < 3) return 2;
    a.sin_port = htons(atoi(argv[2]));
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)&a, len)) { perror("connect"); return 1; }
    printf("connected\n");
    while (read(0, b, sizeof b) > 0) {}
    close(c);
    return 0;
}
"#;

/// A private directory tree owned by `uid` (stats and segments of a process of that user).
fn private_dir_of(name: &str, uid: u32) -> PathBuf {
    let dir = private_dir(name);
    for sub in ["", "stat", "shm"] {
        std::os::unix::fs::chown(dir.join(sub), Some(uid), Some(uid)).unwrap();
    }
    dir
}

/// Starts the program of [`HOLD_A_CONNECTION`] as a preloaded server (as `uid` through
/// `setpriv` when given) and returns it with its port.
fn start_server(exe: &Path, dir: &Path, uid: Option<u32>) -> (std::process::Child, u16) {
    let mut command = match uid {
        Some(uid) => {
            let mut command = Command::new("setpriv");
            command
                .arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .arg("--clear-groups")
                .arg(exe);
            command
        }
        None => Command::new(exe),
    };
    let mut child = command
        .arg("server")
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env_remove("SANDIRECT_SAN_PROVIDER")
        .env("SANDIRECT_STAT_DIR", dir.join("stat"))
        .env("SANDIRECT_SHM_DIR", dir.join("shm"))
        .env("LD_PRELOAD", library())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let port = integration::read_port(&mut std::io::BufReader::new(child.stdout.as_mut().unwrap()))
        .parse()
        .expect("a port number");
    (child, port)
}

/// Connects a preloaded client (`env`: extra settings) to `port`, and returns what
/// `sandirect stat` says of the client's connection while it is held.
fn client_reason(exe: &Path, dir: &Path, port: u16, env: &[(&str, &str)]) -> String {
    use std::io::BufRead;
    let mut child = Command::new(exe)
        .args(["client", &port.to_string()])
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env_remove("SANDIRECT_SAN_PROVIDER")
        .envs(env.iter().copied())
        .env("SANDIRECT_STAT_DIR", dir.join("stat"))
        .env("SANDIRECT_SHM_DIR", dir.join("shm"))
        .env("LD_PRELOAD", library())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "connected\n");
    let stat = Command::new(&integration::apps::products().cli)
        .arg("stat")
        .env("SANDIRECT_STAT_DIR", dir.join("stat"))
        .output()
        .unwrap();
    drop(child.stdin.take());
    integration::finish_child(child, "client", Duration::from_secs(10));
    let stat = String::from_utf8_lossy(&stat.stdout).into_owned();
    let row = stat
        .lines()
        .find(|row| row.contains(" client ") && row.contains(&format!(":{port} ")))
        .unwrap_or_else(|| panic!("no client row in:\n{stat}"));
    row.split_whitespace().last().unwrap().to_owned()
}

/// A preloaded server of another user: the SAN never joins two users, and the client's
/// reason says so rather than calling the server incapable.
#[test]
fn a_preloaded_server_of_another_user_is_named_as_such() {
    if !is_root() {
        eprintln!("skipped: needs root to run a server as another user");
        return;
    }
    let dir = private_dir("other-user");
    let Some(exe) = build(&dir, "hold", HOLD_A_CONNECTION) else {
        eprintln!("skipped: no C compiler");
        return;
    };
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let theirs = private_dir_of("other-user-server", 65534);
    std::fs::set_permissions(&theirs, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let (server, port) = start_server(&exe, &theirs, Some(65534));
    let reason = client_reason(&exe, &dir, port, &[]);
    integration::finish_child(server, "server", Duration::from_secs(10));
    assert_eq!(reason, "peer-other-user");
}

/// A client that may only use verbs, whose verbs provider library cannot be loaded: the
/// reason is the missing library, not the peer.
#[test]
fn a_missing_verbs_library_is_named_as_such() {
    let dir = private_dir("no-verbs");
    let Some(exe) = build(&dir, "hold", HOLD_A_CONNECTION) else {
        eprintln!("skipped: no C compiler");
        return;
    };
    let (server, port) = start_server(&exe, &dir, None);
    let missing = dir.join("no-such-libibverbs.so");
    let reason = client_reason(
        &exe,
        &dir,
        port,
        &[
            ("SANDIRECT_SAN_PROVIDER", "verbs"),
            ("SANDIRECT_VERBS_LIBRARY", missing.to_str().unwrap()),
        ],
    );
    integration::finish_child(server, "server", Duration::from_secs(10));
    assert_eq!(reason, "no-verbs-library");
}
