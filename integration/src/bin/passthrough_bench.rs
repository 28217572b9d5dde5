//! Measures the cost of the passthrough path: a 1-byte `write` + `read` round on a pipe (fds
//! that are never ours), `fcntl(F_GETFL)` (the cheapest hooked syscall), and `poll` with a
//! zero timeout. Run it natively and under `LD_PRELOAD` and compare the ns/op figures.
//!
//! Usage: `passthrough_bench [ITERATIONS]` (default 1,000,000).

use std::time::Instant;

fn main() {
    let iterations: u32 = std::env::args()
        .nth(1)
        .and_then(|arg| arg.parse().ok())
        .unwrap_or(1_000_000);
    let mut fds = [0; 2];
    // SAFETY: array of two ints.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let (read_end, write_end) = (fds[0], fds[1]);
    let mut byte = [0u8; 1];

    let start = Instant::now();
    for _ in 0..iterations {
        // SAFETY: valid pipe fds and a one-byte buffer.
        unsafe {
            libc::write(write_end, byte.as_ptr().cast(), 1);
            libc::read(read_end, byte.as_mut_ptr().cast(), 1);
        }
    }
    let pipe_ns = start.elapsed().as_nanos() as f64 / f64::from(iterations);

    let start = Instant::now();
    for _ in 0..iterations {
        // SAFETY: F_GETFL on a valid fd.
        unsafe { libc::fcntl(read_end, libc::F_GETFL) };
    }
    let fcntl_ns = start.elapsed().as_nanos() as f64 / f64::from(iterations);

    let start = Instant::now();
    for _ in 0..iterations {
        let mut pfd = libc::pollfd {
            fd: read_end,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut pfd, 1, 0) };
    }
    let poll_ns = start.elapsed().as_nanos() as f64 / f64::from(iterations);
    println!("write+read(pipe): {pipe_ns:.1} ns/round  fcntl(F_GETFL): {fcntl_ns:.1} ns/op  poll(0): {poll_ns:.1} ns/op");
}
