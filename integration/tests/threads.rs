//! Threads of one program against each other: a fork or a close in one thread while others use
//! the library must leave every process working as without it.

use std::path::{Path, PathBuf};
use std::time::Duration;

fn private_dir(name: &str) -> PathBuf {
    integration::c_programs::private_dir("th", name)
}

fn build(dir: &Path, name: &str, source: &str) -> Option<PathBuf> {
    integration::c_programs::build(dir, name, source, &["-pthread"])
}

fn run(exe: &Path, args: &[&str], preload: bool, dir: &Path) -> String {
    integration::c_programs::run(exe, args, preload, dir, Duration::from_secs(60))
}

/// Three threads connect, accept, send and close SAN connections (both ends in this process)
/// in a loop while the main thread forks 200 times; each child makes one call on a fresh
/// socket (a connect to a preloaded listener, which sets up a SAN client) and exits. A child
/// that does not exit within 5 s is stuck on a lock a parent thread held at the fork.
const FORK_WHILE_THREADS_CONNECT: &str = r#"
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define FORKS 200
#define HAMMERS 3

static struct sockaddr_in busy, idle;
static int busy_listener;
static atomic_int stop;
static atomic_long rounds;

static void *hammer(void *arg) {
    (void)arg;
    char b[256];
    memset(b, 'h', sizeof b);
    while (!atomic_load(&stop)) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (c < 0) continue;
        if (connect(c, (struct sockaddr *)&busy, sizeof busy) == 0) {
            int s = accept(busy_listener, NULL, NULL);
            if (s >= 0) {
                send(c, b, sizeof b, MSG_NOSIGNAL | MSG_DONTWAIT);
                recv(s, b, sizeof b, MSG_DONTWAIT);
                close(s);
            }
        }
        close(c);
        atomic_fetch_add(&rounds, 1);
    }
    return NULL;
}

static int listener(struct sockaddr_in *a) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    socklen_t len = sizeof *a;
    memset(a, 0, sizeof *a);
    a->sin_family = AF_INET;
    a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (l < 0 || bind(l, (struct sockaddr *)a, len) || listen(l, 1024)
        || getsockname(l, (struct sockaddr *)a, &len)) { perror("listener"); exit(1); }
    return l;
}

int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    busy_listener = listener(&busy);
    int idle_listener = listener(&idle);
    pthread_t threads[HAMMERS];
    for (int i = 0; i < HAMMERS; i++) pthread_create(&threads[i], NULL, hammer, NULL);
    int stuck = 0, failed = 0;
    for (int i = 0; i < FORKS && !stuck; i++) {
        pid_t pid = fork();
        if (pid < 0) { perror("fork"); return 1; }
        if (pid == 0) {
            int c = socket(AF_INET, SOCK_STREAM, 0);
            int rc = c < 0 ? -1 : connect(c, (struct sockaddr *)&idle, sizeof idle);
            _exit(rc == 0 ? 0 : 1);
        }
        struct timespec start, now;
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (;;) {
            int status;
            pid_t done = waitpid(pid, &status, WNOHANG);
            if (done == pid) {
                if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed++;
                break;
            }
            clock_gettime(CLOCK_MONOTONIC, &now);
            if (now.tv_sec - start.tv_sec >= 5) {
                printf("fork %d: child stuck for 5 s\n", i);
                kill(pid, SIGKILL);
                waitpid(pid, &status, 0);
                stuck = 1;
                break;
            }
            usleep(1000);
        }
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < HAMMERS; i++) pthread_join(threads[i], NULL);
    close(idle_listener);
    printf("children: %s, %d failed\n", stuck ? "one stuck" : "all exited", failed);
    fprintf(stderr, "hammer rounds: %ld\n", atomic_load(&rounds));
    return 0;
}
"#;

#[test]
fn a_fork_while_other_threads_use_the_library_leaves_a_working_child() {
    let dir = private_dir("fork-locks");
    let Some(exe) = build(&dir, "forks", FORK_WHILE_THREADS_CONNECT) else {
        eprintln!("skipped: no C compiler");
        return;
    };
    let expected = "children: all exited, 0 failed\n";
    assert_eq!(run(&exe, &[], false, &dir), expected, "native");
    assert_eq!(run(&exe, &[], true, &dir), expected, "preloaded");
}
