//! Runs the conformance program and the application programs natively and under
//! `LD_PRELOAD=libsandirect.so`, and checks that the preload is invisible to them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `libsandirect.so`, built once per test run (same profile as this test).
fn library() -> &'static Path {
    &integration::apps::products().library
}

/// A private stats directory per test, so tests do not see each other's processes.
fn stat_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sandirect-it-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    dir
}

fn run(program: &str, preload: bool, env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(program);
    command
        .env_remove("LD_PRELOAD")
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE");
    if preload {
        command.env("LD_PRELOAD", library());
    }
    command.envs(env.iter().copied());
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} (preload={preload}) failed: {output:?}"
    );
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

const CONFORMANCE: &str = env!("CARGO_BIN_EXE_conformance");
const STDNET: &str = env!("CARGO_BIN_EXE_stdnet");
const CHURN: &str = env!("CARGO_BIN_EXE_churn");

#[test]
fn concurrent_churn_and_hooks_in_signal_handlers_leave_exact_state() {
    let dir = stat_dir("churn");
    let native = stdout(&run(CHURN, false, &[]));
    assert!(
        native.contains("handler failures 0, signals handled: true"),
        "{native}"
    );
    let preloaded = stdout(&run(
        CHURN,
        true,
        &[("SANDIRECT_STAT_DIR", dir.to_str().unwrap())],
    ));
    assert!(
        preloaded.contains("handler failures 0, signals handled: true"),
        "{preloaded}"
    );
    assert!(
        preloaded.contains("published after churn: 1 live, 1 listener"),
        "every closed socket must be released, the open listener kept:\n{preloaded}"
    );
}

#[test]
fn conformance_is_identical_natively_and_preloaded() {
    let dir = stat_dir("conformance");
    let dir = dir.to_str().unwrap();
    let native = stdout(&run(CONFORMANCE, false, &[]));
    let preloaded = stdout(&run(CONFORMANCE, true, &[("SANDIRECT_STAT_DIR", dir)]));
    let lines: Vec<_> = native.lines().collect();
    assert_eq!(lines.len(), 52, "every case prints one line:\n{native}");
    assert!(
        !native.contains("FAILED"),
        "native run failed a case:\n{native}"
    );
    for (native_line, preloaded_line) in lines.iter().zip(preloaded.lines()) {
        assert_eq!(
            native_line, &preloaded_line,
            "the preload changed observable behaviour"
        );
    }
    assert_eq!(
        preloaded.lines().count(),
        lines.len(),
        "preloaded run lost cases:\n{preloaded}"
    );
    // The main process removes its stats file at exit. Each forked child got a file of its own
    // (atfork handler) and left it behind, because it ended with _exit, SIGABRT, SIGSEGV or
    // SIGBUS, which skip destructors: fork-and-close-range's child, fork-per-connection's and
    // fork-and-both-use's two each (a client process and a server child), fortify-poll-overflow's
    // two and fault-handlers' four. The reader recognises them as stale and removes them.
    let leftovers = std::fs::read_dir(dir).unwrap().count();
    assert_eq!(
        leftovers, 11,
        "expected exactly the files of the eleven fork children that skipped their destructors"
    );
    let live = preload_core::stats::read_dir(Path::new(dir), true).unwrap();
    assert!(
        live.is_empty(),
        "dead processes must not be listed: {live:?}"
    );
    assert_eq!(
        std::fs::read_dir(dir).unwrap().count(),
        0,
        "stale file must be removed"
    );
}

#[test]
fn conformance_is_identical_with_tracking_off_and_with_tcp_rules() {
    let native = stdout(&run(CONFORMANCE, false, &[]));
    let off = stdout(&run(
        CONFORMANCE,
        true,
        &[("SANDIRECT_MODE", "off"), ("SANDIRECT_STAT_DIR", "off")],
    ));
    assert_eq!(native, off);
    let rules = stat_dir("rules").join("tcp.conf");
    std::fs::write(&rules, "use tcp any * *:*\n").unwrap();
    let with_rules = stdout(&run(
        CONFORMANCE,
        true,
        &[
            ("SANDIRECT_CONFIG", rules.to_str().unwrap()),
            ("SANDIRECT_STAT_DIR", "off"),
        ],
    ));
    assert_eq!(native, with_rules);
}

#[test]
fn rust_std_net_works_under_the_preload_and_is_tracked() {
    let dir = stat_dir("stdnet");
    let native = stdout(&run(STDNET, false, &[]));
    assert!(native.contains("published: none"), "{native}");
    assert!(native.contains("fork child: published none"), "{native}");
    // Over the interposer's TCP path: the byte counts below are TCP's.
    let preloaded = stdout(&run(
        STDNET,
        true,
        &[
            ("SANDIRECT_STAT_DIR", dir.to_str().unwrap()),
            ("SANDIRECT_SAN", "0"),
        ],
    ));
    assert!(
        preloaded.contains("exchange: hello / world!"),
        "{preloaded}"
    );
    assert!(preloaded.contains("server got: hello"), "{preloaded}");
    assert!(
        preloaded.contains(
            r#"published: 2 connected (["no-provider", "no-provider"]), 1 listener, tcp bytes sent 11 received 11"#
        ),
        "client and accepted socket must be tracked with exact byte counts:\n{preloaded}"
    );
    assert!(
        preloaded.contains("fork child: own stats file, 2 inherited connected"),
        "a fork child publishes its own view, sockets marked inherited:\n{preloaded}"
    );
    // The child exited normally and removed its file; so did the parent.
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

#[test]
fn config_rules_and_bad_configs_steer_every_connection_to_tcp() {
    let dir = stat_dir("config");
    let dir_text = dir.to_str().unwrap();
    let tcp_rules = dir.join("tcp.conf");
    std::fs::write(&tcp_rules, "# everything on TCP\nuse tcp any stdnet *:*\n").unwrap();
    let ruled = run(
        STDNET,
        true,
        &[
            ("SANDIRECT_STAT_DIR", dir_text),
            ("SANDIRECT_CONFIG", tcp_rules.to_str().unwrap()),
        ],
    );
    assert!(
        stdout(&ruled).contains(r#"(["config-says-tcp", "config-says-tcp"])"#),
        "{}",
        stdout(&ruled)
    );

    let bad = dir.join("bad.conf");
    std::fs::write(&bad, "use tcp any * *:*\nuse tcp any * 300.1.1.1:80\n").unwrap();
    let output = run(
        STDNET,
        true,
        &[
            ("SANDIRECT_STAT_DIR", dir_text),
            ("SANDIRECT_CONFIG", bad.to_str().unwrap()),
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    let location = format!("{}:2:", bad.display());
    assert_eq!(
        stderr.matches(&location).count(),
        1,
        "one clear message naming file:line:\n{stderr}"
    );
    assert!(stdout(&output).contains("exchange: hello / world!"));
    assert!(
        stdout(&output).contains(r#"(["config-invalid", "config-invalid"])"#),
        "{}",
        stdout(&output)
    );
}

/// A library whose constructor calls socket()/connect() runs before ours (DT_NEEDED
/// libraries are initialised before LD_PRELOADed ones): the pre-init path must work.
#[test]
fn socket_calls_from_an_earlier_constructor_work() {
    let Ok(cc) = which_cc() else {
        eprintln!("skipped: no C compiler (cc) to build the helper library");
        return;
    };
    let dir = stat_dir("ctor");
    let helper_c = dir.join("helper.c");
    std::fs::write(
        &helper_c,
        r#"
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>
#include <stdio.h>
#include <errno.h>
int helper_result = -100;
__attribute__((constructor)) static void early(void) {
    fprintf(stderr, "helper constructor runs\n");
    int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof a;
    if (l < 0 || bind(l, (struct sockaddr *)&a, len) || listen(l, 1) || getsockname(l, (struct sockaddr *)&a, &len)) { helper_result = -errno; return; }
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&a, len)) { helper_result = -errno; return; }
    int s = accept(l, 0, 0);
    char buf[3] = {0};
    if (write(c, "hi", 2) != 2 || read(s, buf, 2) != 2) { helper_result = -errno; return; }
    close(s); close(c); close(l);
    helper_result = buf[0] == 'h' && buf[1] == 'i';
}
"#,
    )
    .unwrap();
    let main_c = dir.join("main.c");
    std::fs::write(&main_c, "#include <stdio.h>\nextern int helper_result;\nint main(void) { printf(\"helper constructor result %d\\n\", helper_result); return 0; }\n").unwrap();
    let lib = dir.join("libhelper.so");
    let exe = dir.join("main");
    let built = Command::new(&cc)
        .arg("-shared")
        .arg("-fPIC")
        .arg("-o")
        .arg(&lib)
        .arg(&helper_c)
        .status()
        .unwrap();
    assert!(built.success());
    let built = Command::new(&cc)
        .arg("-o")
        .arg(&exe)
        .arg(&main_c)
        .arg(format!("-L{}", dir.display()))
        .arg("-lhelper")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .status()
        .unwrap();
    assert!(built.success());
    let output = run(
        exe.to_str().unwrap(),
        true,
        &[
            ("SANDIRECT_STAT_DIR", dir.to_str().unwrap()),
            ("SANDIRECT_LOG", "debug"),
        ],
    );
    assert_eq!(stdout(&output), "helper constructor result 1\n");
    // The helper's constructor really ran before ours (the pre-init path was exercised).
    let stderr = String::from_utf8_lossy(&output.stderr);
    let helper = stderr.find("helper constructor runs").expect("helper ran");
    let ours = stderr
        .find("sandirect initialised")
        .expect("our constructor logged");
    assert!(helper < ours, "constructor order:\n{stderr}");
}

/// End to end: with a counting malloc shim in the process, the hooks on foreign fds (a pipe)
/// and the data path of tracked sockets (a loopback TCP pair, over kernel TCP and over the
/// SAN) allocate nothing.
#[test]
fn hooks_do_not_allocate_in_a_real_process() {
    let Ok(cc) = which_cc() else {
        eprintln!("skipped: no C compiler (cc) to build the malloc shim");
        return;
    };
    let dir = stat_dir("malloc");
    let shim = dir.join("count.c");
    std::fs::write(
        &shim,
        r#"
#include <stddef.h>
#include <errno.h>
extern void *__libc_malloc(size_t); extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t); extern void *__libc_memalign(size_t, size_t);
extern void __libc_free(void *);
unsigned long counted_allocations;
static void count(void) { __atomic_add_fetch(&counted_allocations, 1, __ATOMIC_RELAXED); }
void *malloc(size_t n) { count(); return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { count(); return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { count(); return __libc_realloc(p, n); }
void *memalign(size_t a, size_t n) { count(); return __libc_memalign(a, n); }
void *aligned_alloc(size_t a, size_t n) { count(); return __libc_memalign(a, n); }
int posix_memalign(void **out, size_t a, size_t n) { count(); *out = __libc_memalign(a, n); return *out ? 0 : ENOMEM; }
void free(void *p) { __libc_free(p); }
"#,
    )
    .unwrap();
    let main_c = dir.join("main.c");
    std::fs::write(
        &main_c,
        r#"
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <netinet/in.h>
extern unsigned long counted_allocations;
int main(void) {
    int p[2]; char b = 'x';
    if (pipe(p)) return 1;
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof a;
    if (bind(l, (struct sockaddr *)&a, len) || listen(l, 1) || getsockname(l, (struct sockaddr *)&a, &len)) return 2;
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&a, len)) return 3;
    int s = accept(l, 0, 0);
    if (s < 0) return 4;
    /* rounds on the pair outside the count: the SAN switch-over happens here (the acceptor
       attaches at its first call, the client switches at its next one), and each end's first
       send over the SAN makes its send buffer */
    if (send(c, &b, 1, 0) != 1 || recv(s, &b, 1, 0) != 1) return 7;
    if (send(s, &b, 1, 0) != 1 || recv(c, &b, 1, 0) != 1) return 7;
    if (send(c, &b, 1, 0) != 1 || recv(s, &b, 1, 0) != 1) return 7;
    unsigned long before = __atomic_load_n(&counted_allocations, __ATOMIC_RELAXED);
    for (int i = 0; i < 10000; i++) {
        struct pollfd f = { .fd = p[0], .events = POLLIN };
        if (write(p[1], &b, 1) != 1 || read(p[0], &b, 1) != 1 || fcntl(p[0], F_GETFL) < 0) return 5;
        if (poll(&f, 1, 0) != 0 || close(-1) != -1) return 6;
    }
    unsigned long middle = __atomic_load_n(&counted_allocations, __ATOMIC_RELAXED);
    for (int i = 0; i < 10000; i++) {
        if (send(c, &b, 1, 0) != 1 || recv(s, &b, 1, 0) != 1) return 7;
    }
    unsigned long after = __atomic_load_n(&counted_allocations, __ATOMIC_RELAXED);
    free(malloc(64)); /* proves the shim sees allocations */
    unsigned long deliberate = counted_allocations - after;
    printf("allocations during 10000 rounds on fds not ours: %lu\n", middle - before);
    printf("allocations during 10000 rounds on the socket pair: %lu\n", after - middle);
    printf("shim counted a deliberate malloc: %lu\n", deliberate);
    return 0;
}
"#,
    )
    .unwrap();
    let lib = dir.join("libcount.so");
    let exe = dir.join("main");
    let built = Command::new(&cc)
        .args(["-O1", "-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&shim)
        .status()
        .unwrap();
    assert!(built.success());
    let built = Command::new(&cc)
        .arg("-o")
        .arg(&exe)
        .arg(&main_c)
        .arg("-Wl,--no-as-needed")
        .arg(format!("-L{}", dir.display()))
        .arg("-lcount")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .status()
        .unwrap();
    assert!(built.success());
    let exe = exe.to_str().unwrap();
    let expected = "allocations during 10000 rounds on fds not ours: 0\n\
                    allocations during 10000 rounds on the socket pair: 0\n\
                    shim counted a deliberate malloc: 1\n";
    assert_eq!(stdout(&run(exe, false, &[])), expected);
    let stat_dir = ("SANDIRECT_STAT_DIR", dir.to_str().unwrap());
    // The TCP path of tracked sockets allocates nothing either.
    let over_tcp = run(exe, true, &[stat_dir, ("SANDIRECT_SAN", "0")]);
    assert_eq!(stdout(&over_tcp), expected);
    // Over the SAN (the default) neither do the SAN data calls in their steady state.
    let over_san = run(exe, true, &[stat_dir]);
    assert_eq!(stdout(&over_san), expected);
}

fn which_cc() -> Result<PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|dir| dir.join("cc"))
                .find(|path| path.is_file())
        })
        .ok_or(())
}
