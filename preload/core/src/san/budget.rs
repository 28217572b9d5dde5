//! The process-wide bound on memory held for SAN connections (what `tcp_mem` is to kernel
//! TCP): every SAN socket is charged, at set-up, the most its buffers can hold
//! ([`shm_connection_bytes`], [`verbs_connection_bytes`]); a set-up that would take the total
//! past the budget (`SANDIRECT_SAN_MEMORY_MB`, see `crate::settings::san_memory_budget`) is
//! not made and the connection stays on TCP (`san-resources`). The charge is a [`Charge`]
//! the socket owns: it goes back when the socket's SAN object is dropped, whichever way it
//! ends (closed, downgraded, fallen back, broken, replaced).
//!
//! The same charges count the process's SAN connections, and a connection is set up only while
//! the descriptors they may hold fit in half the soft `RLIMIT_NOFILE`
//! ([`Budget::descriptors_to_spare`]; asked before the charge, so set-ups racing each other
//! may pass it by a few).
//!
//! The charge is the worst case, not what the connection uses now: the send ring grows only
//! as far as it is filled, so idle connections hold less. What a sender blocked on a stalled
//! peer absorbs (up to `ABSORB_LIMIT`) and a downgraded socket's stash are not charged.

use core::sync::atomic::{AtomicU64, Ordering};

use super::tunables::{shm_segment_config, SHM_SEND_BUFFER, VERBS_SLOTS};

/// A total of charges and its limit.
#[derive(Debug)]
pub(crate) struct Budget {
    /// Bytes charged now.
    held: AtomicU64,
    /// Charges held now: the SAN connections of the process.
    connections: AtomicU64,
    /// The limit, or `None` for the process's (read on first use).
    limit: Option<u64>,
}

/// The process's budget.
static PROCESS: Budget = Budget {
    held: AtomicU64::new(0),
    connections: AtomicU64::new(0),
    limit: None,
};

impl Budget {
    /// A budget of its own with limit `limit` (tests).
    #[cfg(test)]
    pub(crate) const fn with_limit(limit: u64) -> Budget {
        Budget {
            held: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            limit: Some(limit),
        }
    }

    fn limit(&self) -> u64 {
        self.limit
            .unwrap_or_else(crate::settings::san_memory_budget)
    }

    /// Bytes charged now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Charges `bytes` if the total stays within the limit (lock-free: concurrent set-ups
    /// never take the total past it together).
    pub(crate) fn charge(&'static self, bytes: u64) -> Option<Charge> {
        let limit = self.limit();
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&total| total <= limit)
            })
            .ok()
            .map(|_| {
                self.connections.fetch_add(1, Ordering::AcqRel);
                Charge {
                    budget: self,
                    bytes,
                }
            })
    }
}

/// Bytes charged to a SAN socket; given back when dropped.
#[derive(Debug)]
pub(crate) struct Charge {
    budget: &'static Budget,
    bytes: u64,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
        self.budget.connections.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What a shm connection can hold: its segment (mapped by both ends: each process counts
/// it) with the journal this side writes (allocated only as far as it is used; the peer's
/// is the peer's charge), and its send buffer.
pub(super) fn shm_connection_bytes() -> u64 {
    let config = shm_segment_config();
    let segment = config.file_size().unwrap_or(0) - config.journal_size as usize;
    (segment + SHM_SEND_BUFFER) as u64
}

/// What a verbs connection can hold: its registered slots, both ways, and its send buffer.
pub(super) fn verbs_connection_bytes() -> u64 {
    let slots = VERBS_SLOTS.slot_size as u64
        * (u64::from(VERBS_SLOTS.send_slots) + u64::from(VERBS_SLOTS.recv_slots));
    slots + switch::session::SessionConfig::default().send_buffer as u64
}

/// Charges the process's budget for a new shm connection; `None`: past the budget, or too
/// few descriptors to spare ([`Budget::descriptors_to_spare`]).
pub(super) fn charge_shm() -> Option<Charge> {
    PROCESS
        .descriptors_to_spare(soft_descriptor_limit())
        .then(|| PROCESS.charge(shm_connection_bytes()))
        .flatten()
}

/// Charges the process's budget for a new verbs connection; `None`: past the budget, or too
/// few descriptors to spare ([`Budget::descriptors_to_spare`]).
pub(super) fn charge_verbs() -> Option<Charge> {
    PROCESS
        .descriptors_to_spare(soft_descriptor_limit())
        .then(|| PROCESS.charge(verbs_connection_bytes()))
        .flatten()
}

/// Descriptors of ours a SAN connection may hold beside the application's socket: mirror
/// ends, exchange sockets, a pidfd, a doorbell (three or four once both ends are attached;
/// up to eight while an accepted connection waits for its first use, which can last).
const DESCRIPTORS_PER_CONNECTION: u64 = 8;

impl Budget {
    /// Whether one more SAN connection keeps the descriptors of ours within half of the soft
    /// `RLIMIT_NOFILE` (`limit`), counting [`DESCRIPTORS_PER_CONNECTION`] for every connection
    /// charged. Ours count against the application's limit: without a bound, a program that
    /// opens thousands of connections would meet `EMFILE` in its own `socket` or `accept`
    /// long before it would without the preload. Past it, connections stay on TCP
    /// (`san-resources`), and the application keeps at least the other half.
    fn descriptors_to_spare(&self, limit: u64) -> bool {
        let connections = self.connections.load(Ordering::Acquire);
        (connections + 1).saturating_mul(DESCRIPTORS_PER_CONNECTION) <= limit / 2
    }
}

/// The soft `RLIMIT_NOFILE` (read on each call: programs raise it at run time); unbounded
/// when it cannot be read.
fn soft_descriptor_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes one `rlimit` we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return u64::MAX;
    }
    limit.rlim_cur
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: u64) -> &'static Budget {
        Box::leak(Box::new(Budget::with_limit(limit)))
    }

    #[test]
    fn a_shm_connection_is_charged_its_segment_and_send_buffer() {
        let bytes = shm_connection_bytes();
        // The segment is about 4.6 MiB and this side's journal 6 MiB; with the 4 MiB send
        // buffer, about 15 MiB.
        assert!(
            (14 << 20..15 << 20).contains(&bytes),
            "{bytes} bytes per connection"
        );
        assert_eq!(verbs_connection_bytes(), (2 << 20) + (256 << 10));
    }

    #[test]
    fn connections_keep_their_descriptors_within_half_the_limit() {
        let budget = budget(u64::MAX);
        // A limit of 64 leaves 32 for ours: four connections of eight.
        let held: Vec<Charge> = (0..4)
            .map(|_| {
                assert!(budget.descriptors_to_spare(64));
                budget.charge(1).expect("no memory limit")
            })
            .collect();
        assert!(!budget.descriptors_to_spare(64), "a fifth would pass half");
        assert!(
            budget.descriptors_to_spare(80),
            "a higher limit leaves room"
        );
        drop(held);
        assert!(budget.descriptors_to_spare(16), "every charge gone");
        assert!(!budget.descriptors_to_spare(15), "not even one fits in 7");
    }

    #[test]
    fn charges_fit_the_limit_and_go_back_when_dropped() {
        let budget = budget(10);
        let a = budget.charge(4).expect("4 of 10");
        let b = budget.charge(6).expect("10 of 10");
        assert_eq!(budget.held(), 10);
        assert!(budget.charge(1).is_none(), "past the limit");
        assert_eq!(budget.held(), 10, "a refused charge takes nothing");
        drop(a);
        assert_eq!(budget.held(), 6);
        assert!(budget.charge(5).is_none());
        let c = budget.charge(4).expect("fits again");
        drop((b, c));
        assert_eq!(budget.held(), 0);
        assert!(budget.charge(u64::MAX).is_none(), "no overflow");
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn concurrent_charges_never_pass_the_limit() {
        let budget = budget(100);
        let taken: Vec<Vec<Charge>> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| (0..50).filter_map(|_| budget.charge(3)).collect()))
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let count: usize = taken.iter().map(Vec::len).sum();
        assert_eq!(count, 33, "exactly as many as fit");
        assert_eq!(budget.held(), 99);
        drop(taken);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn a_zero_budget_refuses_every_connection() {
        let budget = budget(0);
        assert!(budget.charge(shm_connection_bytes()).is_none());
        assert_eq!(budget.held(), 0);
    }
}
