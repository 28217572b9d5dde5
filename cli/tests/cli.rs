//! End-to-end tests of the `sandirect` command.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const SANDIRECT: &str = env!("CARGO_BIN_EXE_sandirect");

/// `sandirect run` finds the library next to its binary: build it there once.
fn ensure_library() {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
        let mut build = Command::new(env!("CARGO"));
        build
            .args([
                "build",
                "--quiet",
                "-p",
                "sandirect-preload",
                "--manifest-path",
            ])
            .arg(manifest);
        if !cfg!(debug_assertions) {
            build.arg("--release");
        }
        assert!(build.status().expect("cargo build").success());
        let next_to_binary = Path::new(SANDIRECT).with_file_name("libsandirect.so");
        assert!(
            next_to_binary.is_file(),
            "{} missing",
            next_to_binary.display()
        );
    });
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sandirect-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    dir
}

fn sandirect(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(SANDIRECT)
        .args(args)
        .env_remove("LD_PRELOAD")
        .env_remove("SANDIRECT_LIB")
        .envs(env.iter().copied())
        .output()
        .expect("run sandirect")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn symbols_lists_the_whole_table() {
    let names = sandirect(&["symbols", "--names"], &[]);
    assert!(names.status.success());
    let names = text(&names.stdout);
    assert_eq!(names.lines().count(), 73);
    for required in [
        "socket",
        "close_range",
        "vfork",
        "execvp",
        "__recvfrom_chk",
        "epoll_pwait2",
        "fcntl64",
        "syscall",
        "fdopen",
        "sigaction",
        "signal",
    ] {
        assert!(
            names.lines().any(|line| line == required),
            "{required} missing"
        );
    }
    let table = text(&sandirect(&["symbols"], &[]).stdout);
    assert!(table.starts_with("| symbol | disposition |"));
    assert!(table
        .contains("| `c_int socket(domain: c_int, ty: c_int, protocol: c_int)` | accelerate |"));
    assert!(
        table.contains("| `sighandler_t signal(signum: c_int, handler: sighandler_t)` | chain |")
    );
}

#[test]
fn check_config_accepts_good_files_and_names_file_and_line_of_bad_ones() {
    let dir = temp_dir("check");
    let good = dir.join("good.conf");
    std::fs::write(
        &good,
        "# rules\nuse san server redis* *:6379\nuse tcp any * [::1]/128:*\n",
    )
    .unwrap();
    let ok = sandirect(&["check-config", good.to_str().unwrap()], &[]);
    assert!(ok.status.success());
    assert!(text(&ok.stdout).contains("2 rule(s), valid"));
    let bad = dir.join("bad.conf");
    std::fs::write(
        &bad,
        "use san server redis* *:6379\n\nuse tcp sideways * *:*\n",
    )
    .unwrap();
    let failed = sandirect(&["check-config", bad.to_str().unwrap()], &[]);
    assert!(!failed.status.success());
    assert!(
        text(&failed.stderr).contains(&format!(
            "{}:3: role must be client, server or any",
            bad.display()
        )),
        "{}",
        text(&failed.stderr)
    );
}

#[test]
fn run_refuses_a_bad_config_before_starting_the_command() {
    ensure_library();
    let dir = temp_dir("run-bad");
    let bad = dir.join("bad.conf");
    std::fs::write(&bad, "use tcp any * 1.2.3.4/40:80\n").unwrap();
    let marker = dir.join("ran");
    let output = sandirect(
        &[
            "run",
            "--config",
            bad.to_str().unwrap(),
            "--",
            "touch",
            marker.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(output.status.code(), Some(2));
    assert!(
        text(&output.stderr).contains(&format!("{}:1: bad prefix length `40`", bad.display())),
        "{}",
        text(&output.stderr)
    );
    assert!(
        !marker.exists(),
        "the command must not run with a bad config"
    );
}

#[test]
fn run_preloads_the_library_and_passes_settings() {
    ensure_library();
    let dir = temp_dir("run-good");
    let good = dir.join("good.conf");
    std::fs::write(&good, "use both any * *:*\n").unwrap();
    let output = sandirect(
        &[
            "run",
            "--config",
            good.to_str().unwrap(),
            "--log",
            "warn",
            "--",
            "sh",
            "-c",
            "echo $LD_PRELOAD; echo $SANDIRECT_CONFIG; echo $SANDIRECT_LOG",
        ],
        &[("LD_PRELOAD", "")],
    );
    assert!(output.status.success(), "{output:?}");
    let lines: Vec<_> = text(&output.stdout).lines().map(str::to_owned).collect();
    assert!(lines[0].ends_with("/libsandirect.so"), "{lines:?}");
    assert_eq!(
        PathBuf::from(&lines[1]),
        std::fs::canonicalize(&good).unwrap()
    );
    assert_eq!(lines[2], "warn");
    let missing = sandirect(
        &["run", "--", "true"],
        &[("SANDIRECT_LIB", "/nonexistent/libsandirect.so")],
    );
    assert_eq!(missing.status.code(), Some(2));
    assert!(
        text(&missing.stderr).contains("SANDIRECT_LIB=/nonexistent/libsandirect.so does not exist")
    );
    let bad_mode = sandirect(&["run", "--mode", "fast", "--", "true"], &[]);
    assert_eq!(bad_mode.status.code(), Some(2));
}

#[test]
fn stat_lists_a_live_connection_of_a_preloaded_process() {
    ensure_library();
    let dir = temp_dir("stat");
    let dir_text = dir.to_str().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // bash's /dev/tcp makes a plain socket()+connect(); its `read` builtin uses read(2) on a
    // dup2'ed copy of the socket (stdin), so the bytes are counted on the same socket object.
    // (bash's printf writes through stdio, i.e. glibc-internal write calls no preload sees.)
    let mut child = Command::new(SANDIRECT)
        .args([
            "run",
            "--",
            "bash",
            "-c",
            &format!("exec 3<>/dev/tcp/127.0.0.1/{port}; read -r -n 4 reply <&3; sleep 5"),
        ])
        .env("SANDIRECT_STAT_DIR", dir_text)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let (mut accepted, _) = listener.accept().unwrap();
    std::io::Write::write_all(&mut accepted, b"pong").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let row = loop {
        let output = sandirect(&["stat"], &[("SANDIRECT_STAT_DIR", dir_text)]);
        assert!(output.status.success());
        let listing = text(&output.stdout);
        let row = listing
            .lines()
            .find(|line| line.contains(&format!("127.0.0.1:{port}")));
        if let Some(row) = row.filter(|row| row.split_whitespace().nth(8) == Some("4")) {
            break row.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "connection never listed:\n{listing}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let _ = child.wait();
    let columns: Vec<_> = row.split_whitespace().collect();
    assert_eq!(columns[0], child.id().to_string(), "{row}");
    assert_eq!(columns[2], "connected");
    assert_eq!(columns[3], "client");
    assert_eq!(columns[6], "TCP");
    assert_eq!(
        (columns[7], columns[8]),
        ("0", "4"),
        "four bytes received: {row}"
    );
    // The server (this test) is not preloaded: the client found no listener marker.
    assert_eq!(columns[11], "peer-not-capable");
    // The killed process's file is stale: stat removes it and lists nothing.
    let after = text(&sandirect(&["stat"], &[("SANDIRECT_STAT_DIR", dir_text)]).stdout);
    assert_eq!(
        after.lines().count(),
        1,
        "only the header remains:\n{after}"
    );
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

/// A pid no process can have (above any `pid_max`): its files are a dead process's.
const DEAD_PID: &str = "2147483646";

/// What a process killed before it wrote its stats file's header leaves: the header's bytes,
/// all zero.
fn unfinished_stats_file() -> Vec<u8> {
    vec![0u8; 4096]
}

#[test]
fn stat_reads_no_directory_through_a_symbolic_link() {
    let dir = temp_dir("stat-link");
    let target = dir.join("target");
    std::fs::create_dir(&target).unwrap();
    std::fs::write(target.join(DEAD_PID), unfinished_stats_file()).unwrap();
    let link = dir.join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let output = sandirect(&["stat"], &[("SANDIRECT_STAT_DIR", link.to_str().unwrap())]);
    assert!(!output.status.success(), "{output:?}");
    assert!(
        text(&output.stderr).contains("symbolic link"),
        "{}",
        text(&output.stderr)
    );
    assert!(
        target.join(DEAD_PID).exists(),
        "nothing is removed through the link"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stat_removes_what_dead_publishers_left_and_nothing_else() {
    let dir = temp_dir("stat-stale");
    let other_dead_pid = "2147483645";
    std::fs::write(dir.join(DEAD_PID), unfinished_stats_file()).unwrap();
    std::fs::write(dir.join(other_dead_pid), b"a file of the user's own\n").unwrap();
    std::fs::write(dir.join("notes"), b"another\n").unwrap();
    let output = sandirect(&["stat"], &[("SANDIRECT_STAT_DIR", dir.to_str().unwrap())]);
    assert!(output.status.success(), "{output:?}");
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, [other_dead_pid, "notes"]);
    let _ = std::fs::remove_dir_all(&dir);
}
