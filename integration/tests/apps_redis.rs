//! Acceptance 11: redis-server and redis-benchmark under `sandirect run` — no errors, values
//! written and read back intact, every connection on the expected path — with both programs
//! preloaded, only the client, and only the server.

use std::time::Duration;

use integration::apps::{
    exclusive, free_port, require_program, wait_for_port, PathRecorder, Preloaded, Sandbox,
};

const APP_KV: &str = env!("CARGO_BIN_EXE_app_kv");
/// Every redis-benchmark phase the acceptance names, each bounded by the request count.
const BENCHMARK_TESTS: [&str; 4] = ["SET", "GET", "LPUSH", "LRANGE_100"];

fn redis_under_sandirect(preloaded: Preloaded) {
    let _serial = exclusive();
    let server = require_program("redis-server", "redis-server");
    let benchmark = require_program("redis-benchmark", "redis-tools");
    let sandbox = Sandbox::new(&format!("redis-{preloaded:?}"));
    let port = free_port();
    let port_text = port.to_string();
    let mut command = sandbox.command(&server, preloaded.server());
    command
        .args(["--bind", "127.0.0.1", "--port", &port_text])
        .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
        .args(["--protected-mode", "yes", "--io-threads", "2"])
        .arg("--dir")
        .arg(sandbox.path());
    let mut redis = sandbox.spawn("redis-server", command);
    wait_for_port(port, &mut redis, Duration::from_secs(20));

    let recorder = PathRecorder::start(&sandbox, Duration::from_millis(5));
    let mut command = sandbox.command(&benchmark, preloaded.client());
    command
        .args(["-h", "127.0.0.1", "-p", &port_text])
        .args(["-c", "50", "-P", "16", "--threads", "2", "-n", "20000"])
        .args(["-t", "set,get,lpush,lrange_100", "-q", "--csv"]);
    let report = sandbox.run("redis-benchmark", command, Duration::from_secs(120));
    let observed = recorder.finish();
    for test in BENCHMARK_TESTS {
        let rps = report
            .lines()
            .find(|line| line.starts_with(&format!("\"{test}")))
            .and_then(|line| line.split(',').nth(1))
            .and_then(|field| field.trim_matches('"').parse::<f64>().ok());
        assert!(
            rps.is_some_and(|rps| rps > 0.0),
            "redis-benchmark reported no throughput for {test}:\n{report}"
        );
    }
    assert!(
        !report.to_ascii_lowercase().contains("error"),
        "redis-benchmark reported errors:\n{report}"
    );
    // 50 clients on one side at least; the recorder may also see the other side's sockets.
    let summary = integration::apps::assert_paths(&observed, port, preloaded.expected_path(), 50);
    eprintln!("redis-benchmark: {} connections observed", summary.len());

    let connections = 4;
    let sides = usize::from(preloaded.client()) + usize::from(preloaded.server());
    let mut command = sandbox.command(APP_KV, preloaded.client());
    command.args(["redis", &port_text, &connections.to_string(), "64", "11"]);
    let output = sandbox.run_holding("app_kv", command, Duration::from_secs(60), |_| {
        sandbox.assert_live_paths(port, preloaded.expected_path(), connections * sides);
    });
    assert!(
        output.contains("holding: 4 connections, wrote and verified 256 values"),
        "{output}"
    );
    assert!(output.contains("closed"), "{output}");

    bgsave_under_load(&sandbox, &benchmark, port, preloaded);

    let status = redis.stop(libc::SIGTERM, Duration::from_secs(20));
    assert!(status.success(), "redis-server exit: {status}");
    sandbox.assert_nothing_left_behind();
}

/// redis BGSAVE forks a child that inherits every client connection while the parent keeps
/// serving: with SAN connections they are first moved back to kernel TCP (a counted
/// downgrade). A benchmark runs while BGSAVE is asked for again and again: no error, and the
/// values written before are still read back intact afterwards.
fn bgsave_under_load(
    sandbox: &Sandbox,
    benchmark: &std::path::Path,
    port: u16,
    preloaded: Preloaded,
) {
    let cli = require_program("redis-cli", "redis-tools");
    let port_text = port.to_string();
    let done = std::sync::atomic::AtomicBool::new(false);
    let (report, saves) = std::thread::scope(|scope| {
        let saver = scope.spawn(|| {
            let mut saves = 0;
            // Bounded: at most 50 rounds of 100 ms.
            for _ in 0..50 {
                if done.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let mut command = sandbox.command(&cli, preloaded.client());
                command.args(["-h", "127.0.0.1", "-p", &port_text, "BGSAVE"]);
                let output = sandbox.run("redis-cli", command, Duration::from_secs(20));
                if output.contains("Background saving started") {
                    saves += 1;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            saves
        });
        let mut command = sandbox.command(benchmark, preloaded.client());
        command
            .args(["-h", "127.0.0.1", "-p", &port_text])
            .args(["-c", "50", "-P", "16", "-n", "40000"])
            .args(["-t", "set,get", "-q", "--csv"]);
        let report = sandbox.run("redis-benchmark", command, Duration::from_secs(120));
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (report, saver.join().expect("saver thread"))
    });
    assert!(saves >= 1, "no BGSAVE started");
    assert!(
        !report.to_ascii_lowercase().contains("error") && report.contains("\"GET"),
        "redis-benchmark during BGSAVE:\n{report}"
    );
    let mut command = sandbox.command(APP_KV, preloaded.client());
    command.args(["redis", &port_text, "2", "32", "12"]);
    let output = sandbox.run_holding("app_kv", command, Duration::from_secs(60), |_| {});
    assert!(
        output.contains("holding: 2 connections, wrote and verified 64 values"),
        "{output}"
    );
    eprintln!("redis: {saves} BGSAVEs during the benchmark");
}

#[test]
fn redis_with_client_and_server_preloaded() {
    redis_under_sandirect(Preloaded::Both);
}

#[test]
fn redis_with_only_the_client_preloaded() {
    redis_under_sandirect(Preloaded::ClientOnly);
}

#[test]
fn redis_with_only_the_server_preloaded() {
    redis_under_sandirect(Preloaded::ServerOnly);
}
