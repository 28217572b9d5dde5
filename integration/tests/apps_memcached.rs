//! Acceptance 14: memcached with 4 worker threads under `sandirect run`, driven by a verifying
//! text-protocol client (`app_kv`): every value (1 B to 256 KiB) written on one connection is
//! read back intact on another, and every connection takes the expected path.

use std::time::Duration;

use integration::apps::{exclusive, free_port, require_program, wait_for_port, Preloaded, Sandbox};

const APP_KV: &str = env!("CARGO_BIN_EXE_app_kv");

fn memcached_under_sandirect(preloaded: Preloaded) {
    let _serial = exclusive();
    let server = require_program("memcached", "memcached");
    let sandbox = Sandbox::new(&format!("memcached-{preloaded:?}"));
    let port = free_port();
    let port_text = port.to_string();
    let mut command = sandbox.command(&server, preloaded.server());
    command
        .args(["-l", "127.0.0.1", "-p", &port_text, "-U", "0", "-t", "4"])
        .args(["-m", "64", "-c", "256"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        // memcached refuses to run as root without naming the user to run as.
        command.args(["-u", "root"]);
    }
    let mut memcached = sandbox.spawn("memcached", command);
    wait_for_port(port, &mut memcached, Duration::from_secs(20));

    let connections = 8;
    let sides = usize::from(preloaded.client()) + usize::from(preloaded.server());
    let mut command = sandbox.command(APP_KV, preloaded.client());
    command.args(["memcached", &port_text, &connections.to_string(), "48", "5"]);
    let output = sandbox.run_holding("app_kv", command, Duration::from_secs(60), |_| {
        sandbox.assert_live_paths(port, preloaded.expected_path(), connections * sides);
    });
    assert!(
        output.contains("holding: 8 connections, wrote and verified 384 values"),
        "{output}"
    );
    assert!(output.contains("closed"), "{output}");

    let status = memcached.stop(libc::SIGTERM, Duration::from_secs(20));
    assert!(status.success(), "memcached exit: {status}");
    sandbox.assert_nothing_left_behind();
}

#[test]
fn memcached_with_client_and_server_preloaded() {
    memcached_under_sandirect(Preloaded::Both);
}

#[test]
fn memcached_with_only_the_client_preloaded() {
    memcached_under_sandirect(Preloaded::ClientOnly);
}
