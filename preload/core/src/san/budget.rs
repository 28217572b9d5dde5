//! The process-wide bound on memory held for SAN connections (what `tcp_mem` is to kernel
//! TCP): every SAN socket is charged, at set-up, the most its buffers can hold
//! ([`shm_connection_bytes`], [`verbs_connection_bytes`]); a set-up that would take the total
//! past the budget (`SANDIRECT_SAN_MEMORY_MB`, see `crate::settings::san_memory_budget`) is
//! not made and the connection stays on TCP (`san-resources`). The charge is a [`Charge`]
//! the socket owns: it goes back when the socket's SAN object is dropped, whichever way it
//! ends (closed, downgraded, fallen back, broken, replaced).
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
    /// The limit, or `None` for the process's (read on first use).
    limit: Option<u64>,
}

/// The process's budget.
static PROCESS: Budget = Budget {
    held: AtomicU64::new(0),
    limit: None,
};

impl Budget {
    /// A budget of its own with limit `limit` (tests).
    #[cfg(test)]
    pub(crate) const fn with_limit(limit: u64) -> Budget {
        Budget {
            held: AtomicU64::new(0),
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
            .map(|_| Charge {
                budget: self,
                bytes,
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

/// Charges the process's budget for a new shm connection of socket `fd`; `None`: past the
/// budget, or too few descriptors to spare ([`descriptors_to_spare`]).
pub(super) fn charge_shm(fd: libc::c_int) -> Option<Charge> {
    descriptors_to_spare(fd)
        .then(|| PROCESS.charge(shm_connection_bytes()))
        .flatten()
}

/// Charges the process's budget for a new verbs connection of socket `fd`; `None`: past the
/// budget, or too few descriptors to spare ([`descriptors_to_spare`]).
pub(super) fn charge_verbs(fd: libc::c_int) -> Option<Charge> {
    descriptors_to_spare(fd)
        .then(|| PROCESS.charge(verbs_connection_bytes()))
        .flatten()
}

/// Whether the process's descriptors leave room for a SAN set-up. A SAN connection holds
/// descriptors of ours beside the application's socket (mirror ends, exchange sockets, a
/// pidfd, a doorbell: three to four once set up, up to eight while it is), and they count
/// against the same `RLIMIT_NOFILE`: without a bound, a program that opens thousands of
/// connections would meet `EMFILE` in its own `socket` or `accept` long before it would
/// without the preload. So set-ups stop while half the soft limit is in use, and the
/// connections opened from then on stay on TCP (`san-resources`), leaving the application at
/// least the other half.
///
/// In use is counted from the two places the kernel hands numbers out from, the lowest free
/// one (the application's, from 0) and the lowest free one at or above the floor ours are
/// moved to (`san_shm::internal_fd_floor`): every number under each is open. Found by
/// duplicating `fd`, the socket being set up, and closing the copies at once.
fn descriptors_to_spare(fd: libc::c_int) -> bool {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) writes one `rlimit` we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return true;
    }
    let lowest_free_from = |from: libc::c_int| {
        // SAFETY: plain fcntl(2) on the caller's open socket; the result is a new descriptor
        // of ours, closed at once.
        let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, from) };
        if copy >= 0 {
            // SAFETY: `copy` was just returned by the kernel and is owned by nobody else.
            unsafe { libc::close(copy) };
        }
        u64::try_from(copy).ok()
    };
    let floor = san_shm::internal_fd_floor().max(0);
    // No free number at all (or `fd` not open): no set-up.
    let (Some(application), Some(ours)) = (lowest_free_from(0), lowest_free_from(floor)) else {
        return false;
    };
    let floor = floor as u64;
    let in_use = application.min(floor) + (ours - floor);
    in_use < limit.rlim_cur / 2
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
