//! A pending client's local port, chosen before its SYN leaves (the acceptor finds the
//! client's exchange by the connection's addresses, so the port must be known first).
//!
//! `bind` to port 0 makes the kernel search the local port range for a port no socket uses,
//! TIME_WAIT ones included, walking from a random start. Where connections churn, most of
//! the range is in TIME_WAIT (`connect` may reuse such ports towards other peers; `bind`
//! may not), and that walk cost a connection's set-up some 200 µs; with the whole range in
//! TIME_WAIT (tens of thousands of connections a minute) it took tens of milliseconds per
//! bind, the client's CPU spent in the kernel. A few binds to random ports of the range find a
//! free one in a few microseconds. When every one finds its port taken, the range is nearly
//! full: the connection stays on TCP (`san-resources`), whose `connect` may reuse a TIME_WAIT
//! port towards another peer. The kernel's search serves only where the range cannot be read.
//! Ports the administrator reserved (`ip_local_reserved_ports`) are never chosen.

use core::cell::Cell;
use core::ffi::c_int;
use core::sync::atomic::{AtomicU64, Ordering};
use std::net::{IpAddr, SocketAddr};

/// Random ports tried before the connection gives up the SAN (at 90% of the range taken,
/// one connection in thirty).
const TRIES: usize = 32;

/// The automatic port range and the reserved ports, read once.
struct Ports {
    low: u16,
    high: u16,
    reserved: Vec<(u16, u16)>,
}

fn ports() -> Option<&'static Ports> {
    use core::sync::atomic::{AtomicPtr, Ordering};
    // Read without a lock (a `OnceLock` would make a child forked while another thread reads
    // the files wait for ever); threads that read at the same time keep the first answer.
    static PORTS: AtomicPtr<Ports> = AtomicPtr::new(core::ptr::null_mut());
    let known = PORTS.load(Ordering::Acquire);
    if !known.is_null() {
        // SAFETY: set once below from a leaked box, never freed.
        return Some(unsafe { &*known });
    }
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let reserved = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_reserved_ports").ok()?;
    let fresh = Box::into_raw(Box::new(parse(&range, &reserved)?));
    match PORTS.compare_exchange(
        core::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: just leaked, never freed.
        Ok(_) => Some(unsafe { &*fresh }),
        Err(first) => {
            // SAFETY: ours, never published.
            drop(unsafe { Box::from_raw(fresh) });
            // SAFETY: set once from a leaked box, never freed.
            Some(unsafe { &*first })
        }
    }
}

/// `ip_local_port_range` ("32768\t60999") and `ip_local_reserved_ports` ("", or
/// "8080,9000-9010"); `None` for anything unexpected (the kernel then chooses).
fn parse(range: &str, reserved: &str) -> Option<Ports> {
    let mut bounds = range.split_whitespace().map(str::parse::<u16>);
    let (Some(Ok(low)), Some(Ok(high)), None) = (bounds.next(), bounds.next(), bounds.next())
    else {
        return None;
    };
    if low == 0 || low > high {
        return None;
    }
    let mut spans = Vec::new();
    for item in reserved.trim().split(',').filter(|item| !item.is_empty()) {
        let (first, last) = item.split_once('-').unwrap_or((item, item));
        let (first, last) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
        spans.push((first, last));
    }
    Some(Ports {
        low,
        high,
        reserved: spans,
    })
}

impl Ports {
    fn is_reserved(&self, port: u16) -> bool {
        self.reserved
            .iter()
            .any(|&(first, last)| (first..=last).contains(&port))
    }

    /// A port of the range from a random value.
    fn pick(&self, random: u64) -> u16 {
        let span = u64::from(self.high - self.low) + 1;
        // NOTE(cast): below `span`, which fits the range's u16 width.
        self.low + (random % span) as u16
    }
}

thread_local! {
    static STATE: Cell<u64> = const { Cell::new(0) };
}

/// A per-thread xorshift stream, seeded from the kernel once (the ports need no secrecy,
/// only spread: two threads must not keep trying the same ones).
fn next_random() -> u64 {
    STATE.with(|state| {
        let mut x = state.get();
        if x == 0 {
            let mut seed = 0u64;
            // SAFETY: getrandom(2) writes at most 8 bytes into `seed`.
            unsafe { libc::getrandom((&mut seed as *mut u64).cast(), 8, libc::GRND_NONBLOCK) };
            x = seed | 1;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x
    })
}

fn bind_to(fd: c_int, address: SocketAddr) -> Result<(), i32> {
    let (storage, len) = crate::discovery::socket_addr_to_raw(address);
    // SAFETY: `storage` holds a valid address of length `len`.
    let rc =
        unsafe { crate::real::bind(fd, (&storage as *const libc::sockaddr_storage).cast(), len) };
    if rc == 0 {
        Ok(())
    } else {
        Err(crate::errno::get())
    }
}

/// Binds the unbound socket `fd` to `source` and a free ephemeral port; false when no port
/// could be had (the connection then stays on TCP and `connect` picks its own).
///
/// Once every try found its port taken, the process's connections stay on TCP without
/// trying for [`FULL_RANGE_PAUSE_MS`]: where the range is full of TIME_WAIT entries (they
/// last a minute), each new connection paid its 32 failed binds, which made a reconnecting
/// client half as fast as over TCP.
pub(super) fn bind_ephemeral(fd: c_int, source: IpAddr) -> bool {
    let Some(ports) = ports() else {
        return bind_to(fd, SocketAddr::new(source, 0)).is_ok();
    };
    let now_ms = u64::try_from(san_shm::coarse_now().as_millis()).unwrap_or(u64::MAX);
    if now_ms < FULL_UNTIL_MS.load(Ordering::Relaxed) {
        return false;
    }
    for _ in 0..TRIES {
        let port = ports.pick(next_random());
        if ports.is_reserved(port) {
            continue;
        }
        match bind_to(fd, SocketAddr::new(source, port)) {
            Ok(()) => return true,
            Err(libc::EADDRINUSE) => continue,
            Err(_) => return false,
        }
    }
    FULL_UNTIL_MS.store(
        now_ms.saturating_add(FULL_RANGE_PAUSE_MS),
        Ordering::Relaxed,
    );
    false
}

/// How long a process stops trying for a port after it found the range full.
const FULL_RANGE_PAUSE_MS: u64 = 1000;

/// Until when (on the coarse monotonic clock, in ms) the range counts as full.
static FULL_UNTIL_MS: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_port_range_and_reserved_ports_parse_as_the_kernel_prints_them() {
        let ports = parse("32768\t60999\n", "8080,9000-9010\n").unwrap();
        assert_eq!((ports.low, ports.high), (32768, 60999));
        assert!(ports.is_reserved(8080) && ports.is_reserved(9005) && !ports.is_reserved(9011));
        assert!(parse("32768\t60999\n", "\n").unwrap().reserved.is_empty());
        assert!(parse("60999 32768", "").is_none());
        assert!(parse("0 10", "").is_none());
        assert!(parse("1 2", "x").is_none());
    }

    #[test]
    fn picked_ports_stay_in_the_range() {
        let ports = parse("40000 40009", "").unwrap();
        for _ in 0..1000 {
            assert!((40000..=40009).contains(&ports.pick(next_random())));
        }
    }

    #[test]
    fn a_port_is_bound_and_the_reserved_ones_are_left_alone() {
        // SAFETY: plain socket creation; closed below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0);
        assert!(bind_ephemeral(fd, IpAddr::from([127, 0, 0, 1])));
        let bound = super::super::kernel::socket_name(fd).unwrap();
        let ports = ports().unwrap();
        assert!((ports.low..=ports.high).contains(&bound.port()));
        assert!(!ports.is_reserved(bound.port()));
        // SAFETY: closing the socket made above.
        unsafe { libc::close(fd) };
    }
}
