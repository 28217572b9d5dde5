//! Acceptance 12: iperf3 server and client under `sandirect run` — default, `-R`, `-P 4` and
//! `--bidir` — with byte counts that agree between sender and receiver, and every connection
//! (control and data streams) on the expected path.
//!
//! iperf3 3.12's receiver stops counting when the client's TEST_END arrives on the control
//! connection, so bytes still queued in the sockets at that moment are sent but not counted as
//! received. The check is therefore: the sender sent the `-n` byte count (iperf3 writes whole
//! 128 KiB blocks, so up to one block more per stream; with `--bidir` the test ends when either
//! direction reached it), no receiver counted more than its sender sent (duplication), and the
//! shortfall is at most what the kernel can hold in flight per stream (its maximal receive plus
//! send buffer).

use std::time::Duration;

use integration::apps::{
    assert_paths, exclusive, free_port, require_program, wait_for_port, PathRecorder, Preloaded,
    Sandbox,
};
use serde_json::Value;

/// Bytes per test (`-n`): a few hundred milliseconds of loopback traffic.
const BYTES: u64 = 256 << 20;
/// iperf3's default TCP write size (`-l`).
const BLOCK: u64 = 128 << 10;

/// The most bytes one stream can have in flight: the largest receive and send buffers the
/// kernel allows (`tcp_rmem`/`tcp_wmem` maxima).
fn in_flight_bound_per_stream() -> u64 {
    let maximum = |path: &str| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|text| text.split_whitespace().nth(2)?.parse::<u64>().ok())
            .unwrap_or(64 << 20)
    };
    maximum("/proc/sys/net/ipv4/tcp_rmem") + maximum("/proc/sys/net/ipv4/tcp_wmem")
}

fn bytes_of(end: &Value, key: &str) -> u64 {
    end[key]["bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("iperf3 -J output lacks end.{key}.bytes: {end}"))
}

/// Checks one direction's sender/receiver pair (`sum_sent`/`sum_received`, with `suffix` for
/// the reverse direction of `--bidir`) and returns the bytes sent.
fn check_direction(end: &Value, suffix: &str, streams: u64, what: &str) -> u64 {
    let sent = bytes_of(end, &format!("sum_sent{suffix}"));
    let received = bytes_of(end, &format!("sum_received{suffix}"));
    assert!(
        sent <= BYTES + streams * BLOCK,
        "{what}: sent {sent} bytes, more than -n {BYTES} plus one block per stream"
    );
    assert!(
        received <= sent,
        "{what}: receiver counted {received} bytes, more than the {sent} sent (duplication)"
    );
    let bound = streams * in_flight_bound_per_stream();
    assert!(
        sent - received <= bound,
        "{what}: receiver counted {received} of {sent} bytes; more than {bound} missing"
    );
    sent
}

fn iperf3_under_sandirect(preloaded: Preloaded) {
    let _serial = exclusive();
    let iperf3 = require_program("iperf3", "iperf3");
    let sandbox = Sandbox::new(&format!("iperf3-{preloaded:?}"));
    let port = free_port();
    let port_text = port.to_string();
    let mut command = sandbox.command(&iperf3, preloaded.server());
    command.args(["-s", "-B", "127.0.0.1", "-p", &port_text]);
    let mut server = sandbox.spawn("iperf3-server", command);
    wait_for_port(port, &mut server, Duration::from_secs(20));
    // The readiness probe above was a connection iperf3 saw as a failed test: let it settle.
    std::thread::sleep(Duration::from_millis(200));

    let variants: [(&str, &[&str], u64); 4] = [
        ("default", &[], 1),
        ("-R", &["-R"], 1),
        ("-P 4", &["-P", "4"], 4),
        ("--bidir", &["--bidir"], 1),
    ];
    for (name, extra, streams) in variants {
        let recorder = PathRecorder::start(&sandbox, Duration::from_millis(5));
        let mut command = sandbox.command(&iperf3, preloaded.client());
        command
            .args(["-c", "127.0.0.1", "-p", &port_text, "-J"])
            .args(["-n", &BYTES.to_string()])
            .args(extra);
        let report = sandbox.run(&format!("iperf3 {name}"), command, Duration::from_secs(120));
        let observed = recorder.finish();
        let json: Value = serde_json::from_str(&report)
            .unwrap_or_else(|e| panic!("iperf3 {name}: -J output is not JSON ({e}):\n{report}"));
        assert!(
            json.get("error").is_none(),
            "iperf3 {name}: {}",
            json["error"]
        );
        let end = &json["end"];
        let mut sent = check_direction(end, "", streams, name);
        if name == "--bidir" {
            sent = sent.max(check_direction(
                end,
                "_bidir_reverse",
                streams,
                "--bidir reverse",
            ));
        }
        assert!(
            sent >= BYTES,
            "iperf3 {name}: ended after {sent} of -n {BYTES} bytes"
        );
        // The control connection and every data stream, seen from at least one side.
        let data_streams = if name == "--bidir" {
            2
        } else {
            streams as usize
        };
        assert_paths(&observed, port, preloaded.expected_path(), 1 + data_streams);
    }

    server.stop(libc::SIGTERM, Duration::from_secs(20));
    sandbox.assert_nothing_left_behind();
}

#[test]
fn iperf3_with_client_and_server_preloaded() {
    iperf3_under_sandirect(Preloaded::Both);
}

#[test]
fn iperf3_with_only_the_server_preloaded() {
    iperf3_under_sandirect(Preloaded::ServerOnly);
}
