//! Acceptance 13: nginx (a master that listens and forks 2 workers) under `sandirect run`,
//! loaded with wrk (bounded) and serving a 64 MiB file to curl that arrives with the right
//! sha256 — through `write` and through `sendfile` — every connection on the expected path.

use std::io::Write as _;
use std::path::Path;
use std::time::Duration;

use integration::apps::{
    assert_paths, exclusive, free_port, require_program, wait_for_port, PathRecorder, Preloaded,
    Sandbox,
};
use integration::pattern::XorShift64;

const LARGE_FILE_BYTES: usize = 64 << 20;

fn nginx_config(root: &Path, port: u16) -> String {
    // SAFETY: geteuid has no preconditions.
    let user = if unsafe { libc::geteuid() } == 0 {
        // Workers of a root master switch to `nobody`, who could not read the private
        // sandbox: keep them root (a test-only choice).
        "user root root;"
    } else {
        ""
    };
    integration::apps::nginx_config(root, port, user)
}

/// A deterministic, incompressible-looking file of `bytes` bytes.
fn write_document(path: &Path, bytes: usize) {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).expect("create document"));
    let mut generator = XorShift64::new(0x1234_5678_9abc_def1);
    let mut block = [0u8; 8192];
    for _ in 0..bytes / block.len() {
        for chunk in block.chunks_exact_mut(8) {
            chunk.copy_from_slice(&generator.next_u64().to_le_bytes());
        }
        file.write_all(&block).expect("write document");
    }
    file.flush().expect("flush document");
}

fn nginx_under_sandirect(preloaded: Preloaded) {
    let _serial = exclusive();
    let nginx = require_program("nginx", "nginx-light");
    let wrk = require_program("wrk", "wrk");
    let curl = require_program("curl", "curl");
    let sandbox = Sandbox::new(&format!("nginx-{preloaded:?}"));
    let root = sandbox.path();
    std::fs::create_dir_all(root.join("www")).expect("create www");
    std::fs::create_dir_all(root.join("tmp")).expect("create tmp");
    std::fs::write(root.join("www/index.html"), "<p>sandirect</p>\n".repeat(64))
        .expect("write index");
    let large = root.join("www/large.bin");
    write_document(&large, LARGE_FILE_BYTES);
    let port = free_port();
    std::fs::write(root.join("nginx.conf"), nginx_config(root, port)).expect("write config");

    let mut command = sandbox.command(&nginx, preloaded.server());
    command
        .arg("-p")
        .arg(root)
        .arg("-c")
        .arg(root.join("nginx.conf"))
        .arg("-e")
        .arg(root.join("error.log"));
    let mut server = sandbox.spawn("nginx", command);
    wait_for_port(port, &mut server, Duration::from_secs(20));

    let recorder = PathRecorder::start(&sandbox, Duration::from_millis(5));
    let mut command = sandbox.command(&wrk, preloaded.client());
    command
        .args(["-t", "2", "-c", "16", "-d", "2s", "--timeout", "5s"])
        .arg(format!("http://127.0.0.1:{port}/index.html"));
    let report = sandbox.run("wrk", command, Duration::from_secs(60));
    let observed = recorder.finish();
    let requests = report
        .lines()
        .find(|line| line.contains("requests in"))
        .and_then(|line| line.split_whitespace().next())
        .and_then(|count| count.parse::<u64>().ok());
    assert!(
        requests.is_some_and(|count| count > 0),
        "wrk made no requests:\n{report}"
    );
    assert!(
        !report.contains("Socket errors") && !report.contains("Non-2xx"),
        "wrk saw errors:\n{report}"
    );
    assert_paths(&observed, port, preloaded.expected_path(), 16);

    // Responses larger than the receive slots a connection starts with, through `write` and
    // through `sendfile`, under load: every request answered, none timing out (CI runs this
    // once more with the safety-net slices off, where a lost wake-up would stall it).
    write_document(&root.join("www/medium.bin"), 64 << 10);
    for location in ["medium.bin", "sendfile/medium.bin"] {
        let mut command = sandbox.command(&wrk, preloaded.client());
        command
            .args(["-t", "2", "-c", "10", "-d", "1s", "--timeout", "2s"])
            .arg(format!("http://127.0.0.1:{port}/{location}"));
        let report = sandbox.run("wrk", command, Duration::from_secs(60));
        assert!(
            report.contains("requests in")
                && !report.contains("Socket errors")
                && !report.contains("Non-2xx"),
            "wrk on {location}: errors or no requests:\n{report}"
        );
    }

    let expected = integration::apps::sha256_of(&large);
    for location in ["large.bin", "sendfile/large.bin"] {
        let downloaded = root.join("downloaded.bin");
        let recorder = PathRecorder::start(&sandbox, Duration::from_millis(5));
        let mut command = sandbox.command(&curl, preloaded.client());
        // The rate limit keeps the transfer open long enough (~0.25 s) to be sampled.
        command
            .args([
                "--silent",
                "--show-error",
                "--fail",
                "--limit-rate",
                "256M",
                "-o",
            ])
            .arg(&downloaded)
            .arg(format!("http://127.0.0.1:{port}/{location}"));
        sandbox.run("curl", command, Duration::from_secs(60));
        let observed = recorder.finish();
        assert_eq!(
            integration::apps::sha256_of(&downloaded),
            expected,
            "{location}: sha256 differs"
        );
        assert_paths(&observed, port, preloaded.expected_path(), 1);
        std::fs::remove_file(&downloaded).expect("remove download");
    }

    // SIGQUIT: graceful shutdown; the master waits for its workers.
    let status = server.stop(libc::SIGQUIT, Duration::from_secs(20));
    assert!(status.success(), "nginx exit: {status}");
    sandbox.assert_nothing_left_behind();
}

#[test]
fn nginx_with_client_and_server_preloaded() {
    nginx_under_sandirect(Preloaded::Both);
}

#[test]
fn nginx_with_only_the_client_preloaded() {
    nginx_under_sandirect(Preloaded::ClientOnly);
}
