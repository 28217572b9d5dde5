//! The library's own robustness in real C programs under the preload: the idioms programs
//! use around blocking socket calls keep working as they do natively.

use std::path::{Path, PathBuf};
use std::time::Duration;

fn private_dir(name: &str) -> PathBuf {
    integration::c_programs::private_dir("rb", name)
}

fn build(dir: &Path, name: &str, source: &str) -> Option<PathBuf> {
    integration::c_programs::build(dir, name, source, &[])
}

fn run(exe: &Path, preload: bool, dir: &Path) -> String {
    integration::c_programs::run(exe, &[], preload, dir, Duration::from_secs(60))
}

/// The classic alarm timeout: a `SIGALRM` handler `siglongjmp`s out of a blocking `recv`.
/// The thread then does ordinary I/O on the same connection, which must work as natively.
const LONGJMP_OUT_OF_RECV: &str = r#"
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static sigjmp_buf timeout_jump;
static void on_alarm(int signal) { (void)signal; siglongjmp(timeout_jump, 1); }

static void show(const char *step, ssize_t n, const char *bytes) {
    if (n < 0) printf("%s: -1 %s\n", step, strerror(errno));
    else printf("%s: %zd \"%.*s\"\n", step, n, (int)n, bytes);
}

int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    socklen_t len = sizeof a;
    int go[2];
    if (l < 0 || bind(l, (struct sockaddr *)&a, len) || listen(l, 1)
        || getsockname(l, (struct sockaddr *)&a, &len) || pipe(go)) { perror("setup"); return 1; }
    pid_t server = fork();
    if (server == 0) {
        /* The peer: silent until told, then "x", then an echo until EOF. */
        alarm(20);
        int s = accept(l, NULL, NULL);
        char b[64];
        if (s < 0 || read(go[0], b, 1) != 1 || send(s, "x", 1, 0) != 1) _exit(2);
        ssize_t n;
        while ((n = recv(s, b, sizeof b, 0)) > 0) if (send(s, b, n, 0) != n) _exit(3);
        _exit(n == 0 ? 0 : 4);
    }
    close(l);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (c < 0 || connect(c, (struct sockaddr *)&a, len)) { perror("connect"); return 1; }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigaction(SIGALRM, &sa, NULL);
    char b[64];
    if (sigsetjmp(timeout_jump, 1) == 0) {
        alarm(1);
        ssize_t n = recv(c, b, sizeof b, 0);
        show("recv returned instead of timing out", n, b);
        return 1;
    }
    printf("recv timed out\n");
    signal(SIGALRM, SIG_DFL);
    alarm(20);
    if (write(go[1], "g", 1) != 1) return 1;
    ssize_t n = recv(c, b, sizeof b, 0);
    show("recv", n, b);
    n = send(c, "hello", 5, 0);
    show("send", n, "hello");
    size_t got = 0;
    while (got < 5 && (n = read(c, b + got, 5 - got)) > 0) got += n;
    show("echo", n < 0 ? n : (ssize_t)got, b);
    close(c);
    int status;
    waitpid(server, &status, 0);
    printf("peer exit %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    return 0;
}
"#;

#[test]
fn a_longjmp_out_of_a_blocking_recv_leaves_the_connection_usable() {
    let dir = private_dir("longjmp");
    let Some(exe) = build(&dir, "longjmp_recv", LONGJMP_OUT_OF_RECV) else {
        eprintln!("skipped: no C compiler (cc)");
        return;
    };
    let expected =
        "recv timed out\nrecv: 1 \"x\"\nsend: 5 \"hello\"\necho: 5 \"hello\"\npeer exit 0\n";
    assert_eq!(run(&exe, false, &dir), expected, "natively");
    assert_eq!(run(&exe, true, &dir), expected, "preloaded, over the SAN");
    let _ = std::fs::remove_dir_all(&dir);
}
