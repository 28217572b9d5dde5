//! The SAN path's tunables: slot pools, buffer sizes and rendezvous thresholds, the waits
//! and stalls that bound the switch-over, the downgrade and blocked calls, and the adaptive
//! polling of blocked verbs readers. Values only: those an environment variable sets are
//! read through `crate::settings`.

use std::time::Duration;

/// Most bytes `SanSocket::send` buffers before the handshake finished (a kernel socket
/// buffer's worth).
pub(super) const EARLY_LIMIT: usize = 256 << 10;

/// Slot pools of every SAN connection: 128 × 16 KiB per direction. A receiver allocates
/// them only as its sender fills what it has (see the shm provider's slot growth), so
/// request/response connections stay on the first four; a stream gets 2 MiB in flight.
/// Measured side by side (`bench_sockets` streams, two sittings of five interleaved
/// rounds): against 32 slots, 16 KiB-1 MiB writes ran 8-20% faster, 4 MiB the same within
/// noise; 64 slots fell between. The price is the worst-case charge against the SAN memory
/// budget (about 15 MiB per connection instead of 10, see `budget`).
pub(super) const SLOTS: san_api::SlotConfig = san_api::SlotConfig {
    send_slots: 128,
    recv_slots: 128,
    slot_size: 16 << 10,
};

/// Most receive slots a reader that still holds unread bytes leaves un-re-posted before it
/// drives (eight: 128 KiB the peer cannot use meanwhile). Not a share of [`SLOTS`]: slots
/// left un-re-posted make the sender use up what is published, and the receiver then grows
/// the pool; a quarter of 128 grew request/response connections (nginx's 64 KiB answers) to
/// slots enough to leave the caches, 5% fewer requests per second than with eight.
pub(super) const REPOST_BATCH: usize = 8;

/// Most arrival tokens a read leaves in a mirror watched only by edge-triggered
/// registrations (see `SanSocket::leaves_edge_tokens`): one lowering then drains them all.
/// Well below the peer's bound on unclaimed tokens (64), past which arrivals write none.
pub(crate) const EDGE_TOKENS_LEFT: u32 = 16;

/// Inline slots of verbs connections: fewer and larger than shm's. Every message costs a
/// work request, a doorbell system call and, at the receiver, a completion (and often a
/// wake-up); a 64 KiB write then goes as one message, not four (rsocket buffers 128 KiB each
/// way). Registered per connection: 16 × 64 KiB each way, 2 MiB.
pub(super) const VERBS_SLOTS: san_api::SlotConfig = san_api::SlotConfig {
    send_slots: 16,
    recv_slots: 16,
    slot_size: 64 << 10,
};

/// Most bytes a SAN socket takes out of its session ahead of the application while the
/// application is blocked sending (see `SanSocket::absorb_if_stalled`): the kernel's
/// largest autotuned receive buffer (`tcp_rmem` max, 6 MiB).
pub(super) const ABSORB_LIMIT: usize = 6 << 20;
/// How long a blocked sender waits with the peer's data unread before absorbing it.
pub(super) const STALL_BEFORE_ABSORB: Duration = Duration::from_millis(10);
/// How long before a rendezvous at the head is turned down to absorb what follows.
pub(super) const STALL_BEFORE_REJECT: Duration = Duration::from_millis(50);
/// The longest a blocking send waits for the reader's credits, its send buffer empty, before
/// it buffers its bytes (see `SanSocket::waits_for_credits`): waiting, they go straight into
/// the reader's slots, one copy less.
pub(super) const CREDIT_WAIT_BOUND: Duration = Duration::from_millis(2);
/// The smallest send that waits for credits that way: half a slot's payload (smaller sends
/// share messages in the send buffer; 64-byte sends ran at half the rate waiting).
pub(super) const CREDIT_WAIT_MIN_SEND: usize = (SLOTS.slot_size / 2) as usize;
/// The longest sleep of a blocked sender while the peer's data waits unread.
pub(super) const STALL_POLL: Duration = Duration::from_millis(5);

/// Inline bytes a shm socket buffers on the sending side: the kernel's largest autotuned send
/// buffer (`tcp_wmem` max, 4 MiB). Programs count on TCP absorbing megabytes before the peer
/// reads: two ends that each write 3 MB before reading pass on loopback TCP, also when they
/// wait in `poll()` (Python's socket timeouts), where no blocked send can take the peer's
/// bytes in (`SanSocket::absorb_if_stalled`); with a 1 MiB buffer they deadlocked. The bytes
/// held here are also kept in the segment's journal (see `socket::journal`), whose pages are
/// allocated only as far as a connection holds bytes back. The ring grows only as far as it
/// is filled.
pub(super) const SHM_SEND_BUFFER: usize = 4 << 20;

/// Each side's outbound journal: the send buffer plus the messages the provider may hold
/// (its send slots), every byte of a stream that may not have reached the peer's slots.
pub(super) const SHM_JOURNAL: u32 =
    (SHM_SEND_BUFFER + SLOTS.send_slots as usize * SLOTS.slot_size as usize) as u32;

/// Smallest blocking send that goes by rendezvous over shm. A rendezvous returns only when
/// the receiver took the bytes, so below it a send is buffered as TCP would buffer it (two
/// peers that each write a few megabytes before reading must not wait for each other).
/// Measured side by side (`scripts/bench.sh`): inline copies through the rings stream at
/// 2.4-6x kernel TCP for every size; a rendezvous per 64-256 KiB send fell to 0.6-1.1x (a
/// round trip per send); from 1 MiB on it is about 3x.
pub(super) const SHM_RENDEZVOUS_THRESHOLD: u32 = SHM_SEND_BUFFER as u32;

/// The segment of every shm connection.
pub(super) fn shm_segment_config() -> san_shm::SegmentConfig {
    san_shm::SegmentConfig {
        journal_size: SHM_JOURNAL,
        ..san_shm::SegmentConfig::new(SLOTS)
    }
}

/// Smallest blocking send that goes by rendezvous over verbs (as over shm: below it a round
/// trip per send costs more than copying through the 16 KiB slots).
pub(super) const VERBS_RENDEZVOUS_THRESHOLD: u32 = 1 << 20;

/// How long `fork()`/`exec()` wait for all peers to answer the downgrade. A peer answers in
/// its next socket call (a blocked or polling peer at once) or, when its application makes
/// none, through its nudge responder (`nudge`); one that still does not answer within this
/// time (stopped, or without a responder) leaves that connection to the parent only (see
/// `Known limits` in `san`).
pub const FORK_BUDGET: Duration = Duration::from_millis(1000);

/// How long a client waits for the acceptor's switch marker before reading TCP again.
pub(super) const MARKER_WAIT: Duration = Duration::from_millis(1000);

/// Longest single sleep: bounds how long a missed wake-up (or a peer death the mirror did not
/// show) could go unnoticed (see `settings::wait_slice_ms`).
pub(super) fn wait_slice() -> Duration {
    crate::settings::wait_slice()
}

/// Longest wait of a nonblocking read that consumed the switch marker (see `recv_iov`).
pub(super) const HANDSHAKE_WAIT: Duration = Duration::from_millis(50);
/// How long an acceptor whose TCP said end of file before the client's `Hello`
/// arrived waits for it over a fabric that may deliver after TCP (verbs). A client sends its
/// `Hello` when it switches, before any byte of the session and before its FIN, so it is
/// normally a few microseconds behind; only a client that shut down while still pending
/// never sends one, and its stream (all on TCP) ends this much later.
pub(super) const HELLO_AFTER_FIN_WAIT: Duration = Duration::from_millis(20);

/// The configured poll budget of a blocked reader (see [`SpinPolicy`]).
pub(super) fn poll_budget() -> u32 {
    crate::settings::verbs_polls()
}

/// When a blocked reader of a verbs socket polls before it sleeps: adaptive, per connection,
/// and only for an answer (the application sent data since it last received some).
///
/// Only answers: a reader of a one-way stream waits for data the peer sends at its own pace,
/// where the slots in flight hide a sleep's latency and polling only burns the CPU the two
/// ends (and, on a small machine, the sender) need: polled, a 64 KiB stream over soft-RoCE ran
/// at ~0.75x its sleeping rate.
///
/// Sleeping costs a completion-channel arm, a sleep and a wake-up of the thread (and of an idle
/// vCPU: the wake-up dominates a round trip); an answer that comes within about that much work
/// is cheaper to poll for. Polling pays only while the answers come quickly, so each poll that
/// ran out of budget doubles the number of waits that sleep at once (up to 64) before polling
/// is tried again, and one that found news resets that: a connection whose peer answers at
/// once polls every time, an idle one polls once in 64 waits, bounded by the budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SpinPolicy {
    /// Polls in a row that ran out of budget (capped).
    misses: u8,
    /// Waits left that sleep without polling.
    skip: u8,
}

impl SpinPolicy {
    /// The longest stretch of waits that sleep at once after polls kept missing.
    const MOST_SKIPPED: u8 = 64;

    /// Whether this wait polls first (counts a skipped wait).
    pub(crate) fn should_poll(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        true
    }

    /// The poll found news before its budget ran out.
    pub(crate) fn found(&mut self) {
        self.misses = 0;
    }

    /// The poll ran out of budget: the next waits sleep at once, twice as many as last time.
    pub(crate) fn missed(&mut self) {
        self.misses = self.misses.saturating_add(1).min(6);
        self.skip = (1u8 << self.misses).min(Self::MOST_SKIPPED);
    }
}

/// The bound on one connection set-up.
pub(super) fn setup_timeout() -> Duration {
    crate::settings::verbs_setup_timeout()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `waits` waits whose polls all find news (`hit`) or all run out (`!hit`); returns
    /// which of them polled.
    fn polls_of(policy: &mut SpinPolicy, waits: usize, hit: bool) -> Vec<bool> {
        (0..waits)
            .map(|_| {
                let polled = policy.should_poll();
                if polled {
                    if hit {
                        policy.found();
                    } else {
                        policy.missed();
                    }
                }
                polled
            })
            .collect()
    }

    #[test]
    fn a_peer_that_answers_at_once_is_polled_for_every_time() {
        let mut policy = SpinPolicy::default();
        assert!(polls_of(&mut policy, 100, true).iter().all(|&p| p));
    }

    #[test]
    fn polls_that_run_out_back_off_exponentially_to_one_in_65_waits() {
        let mut policy = SpinPolicy::default();
        let polled = polls_of(&mut policy, 2000, false);
        let at: Vec<usize> = (0..polled.len()).filter(|&i| polled[i]).collect();
        // After each miss, 2, 4, ..., 64 waits sleep at once, then 64 each time.
        let gaps: Vec<usize> = at.windows(2).map(|w| w[1] - w[0] - 1).collect();
        assert_eq!(&gaps[..7], &[2, 4, 8, 16, 32, 64, 64]);
        assert!(gaps.iter().all(|&g| g <= 64));
        // An idle connection polls in under 2 % of its waits.
        assert!(
            at.len() * 50 < polled.len(),
            "{} polls in {} waits",
            at.len(),
            polled.len()
        );
    }

    #[test]
    fn one_poll_that_finds_news_ends_the_back_off() {
        let mut policy = SpinPolicy::default();
        polls_of(&mut policy, 200, false);
        // The next poll comes within 64 waits; once it finds news, every wait polls again.
        let until_poll = (0..=64).position(|_| policy.should_poll()).unwrap();
        assert!(until_poll <= 64);
        policy.found();
        assert!(polls_of(&mut policy, 10, true).iter().all(|&p| p));
    }
}
