//! CI smoke test of the socket benchmark: `bench_sockets --quick` completes and
//! prints every row of both tables with a figure for every variant that runs the row's test
//! (`-` marks a variant that does not run it, `n/a` one whose pairs failed), and the ratios
//! against the yardsticks. It checks no figure against a target — the benchmark reports
//! those; it never fails a build.

use std::process::Command;

use integration::apps::{exclusive, products};

const BENCH: &str = env!("CARGO_BIN_EXE_bench_sockets");

const ROWS: [&str; 12] = [
    "rtt 64 B",
    "rtt 64 B epoll",
    // Printed with "-" in every cell, and a skip reason, where one CPU only is usable.
    "rtt 64 B same-core",
    "stream 64 B",
    "stream 256 B",
    "stream 1 KiB",
    "stream 4 KiB",
    "stream 16 KiB",
    "stream 64 KiB",
    "stream 256 KiB",
    "stream 1 MiB",
    "stream 4 MiB",
];

#[test]
fn quick_socket_benchmark_completes_and_prints_every_row() {
    let _serial = exclusive();
    let output = Command::new(BENCH)
        .arg("--quick")
        .arg("--preload")
        .arg(&products().library)
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run bench_sockets");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "bench_sockets --quick failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    let lines: Vec<&str> = stdout.lines().collect();
    for row in ROWS {
        let printed: Vec<&&str> = lines
            .iter()
            .filter(|line| line.starts_with(&format!("{row:<18}")))
            .collect();
        assert_eq!(
            printed.len(),
            2,
            "{row:?} must appear once in each table:\n{stdout}"
        );
        assert!(
            !printed[0].contains("n/a"),
            "{row:?}: every variant must have a figure (a pair failed):\n{stdout}\n{stderr}"
        );
    }
    assert!(
        stdout.contains("data path seen by the client: TCP = none, sandirect = "),
        "{stdout}"
    );
    assert!(stdout.contains("raw ring = raw-ring"), "{stdout}");
    assert!(
        stdout.contains("process_vm_readv = process_vm_readv"),
        "{stdout}"
    );
    for ratio in [
        "sandirect/raw ring",
        "sandirect/vm_readv",
        "sandirect/yield",
    ] {
        assert!(stdout.contains(ratio), "{ratio:?} missing:\n{stdout}");
    }
}
