//! What a client's recent connections to each server carried: whether a new one is likely to
//! pay back its SAN set-up.
//!
//! Setting a connection up on the SAN costs both processes a segment, an exchange and a
//! switch-over, several times what the kernel spends on a TCP connect; each request/response
//! then costs a fraction of TCP's. A connection that carries a request or two (a health
//! check, a per-request HTTP/1.0 client, `redis-benchmark -k 0`) pays the set-up and never
//! gets it back: over the SAN it takes several times as long as over TCP. Clients that open
//! such connections do so over and over, to the same server. So each client process keeps,
//! per server address, a score of how its recent connections ended: one that carried fewer
//! than `SANDIRECT_SHORT_CONNECTION_BYTES` (both ways, over either path) lowers it, a longer
//! one raises it. While the score is at -2 or below, new connections to that server stay on TCP
//! (`short-connections`); those are still measured when they close, so when the server's
//! connections grow long again the score climbs back and the SAN returns. A server's first
//! connection always takes the SAN. The score moves by one per connection, between -4 and 4,
//! so an occasional connection of the other kind does not turn a settled choice.
//!
//! A prediction is all this is: a long connection to a server whose connections were short
//! stays on TCP for its lifetime (it runs at TCP's speed, never slower), and a short one to a
//! server whose connections were long pays the set-up, as every connection did without the
//! history. The table is small (64 servers, by address hash; a collision forgets the older
//! server) and only ever try-locked, so a contended (or, after `fork`, orphaned) lock costs a
//! prediction, never a wait.

use core::sync::atomic::Ordering;
use std::net::SocketAddr;
use std::sync::Mutex;

use crate::record::{flags, Bypass, Counter, SocketRecord};

/// Servers remembered.
const SERVERS: usize = 64;

/// The score's bounds: how many connections of one kind it takes to turn the prediction.
const MOST: i8 = 4;

/// At or below this score new connections stay on TCP: two short connections more than long
/// ones. One is not enough: programs open one short connection before their long ones
/// (`redis-benchmark` asks the server's configuration first), and those must not lose the SAN.
const SHORT: i8 = -2;

#[derive(Clone, Copy)]
struct Server {
    address: Option<SocketAddr>,
    score: i8,
}

/// The scores of the servers remembered, by address hash.
struct History {
    servers: [Server; SERVERS],
}

impl History {
    const fn new() -> History {
        History {
            servers: [Server {
                address: None,
                score: 0,
            }; SERVERS],
        }
    }

    fn predicts_short(&self, server: SocketAddr) -> bool {
        let entry = self.servers[slot_of(&server)];
        entry.address == Some(server) && entry.score <= SHORT
    }

    /// Counts a finished connection to `server` that carried `carried` bytes. One that
    /// carried none is no request at all but a check that the server answers (wrk opens and
    /// closes one before its load): it says nothing of the server's connections.
    fn note_carried(&mut self, server: SocketAddr, carried: u64, threshold: u64) {
        if carried == 0 {
            return;
        }
        let entry = &mut self.servers[slot_of(&server)];
        if entry.address != Some(server) {
            *entry = Server {
                address: Some(server),
                score: 0,
            };
        }
        entry.score = if carried >= threshold {
            (entry.score + 1).min(MOST)
        } else {
            (entry.score - 1).max(-MOST)
        };
    }
}

static HISTORY: Mutex<History> = Mutex::new(History::new());

fn slot_of(address: &SocketAddr) -> usize {
    use core::hash::{Hash, Hasher};
    let mut hasher = rustc_hash::FxHasher::default();
    address.hash(&mut hasher);
    (hasher.finish() % SERVERS as u64) as usize
}

/// Whether this process's recent connections to `server` were mostly short: a new one
/// stays on TCP.
pub(super) fn predicts_short(server: SocketAddr) -> bool {
    if crate::settings::short_connection_bytes() == 0 {
        return false;
    }
    HISTORY
        .try_lock()
        .is_ok_and(|history| history.predicts_short(server))
}

/// A client connection's record is being released: counts what it carried towards its
/// server's score, when it is one the prediction is about (set up on the SAN, or kept on TCP
/// by the prediction). The record was just freed: a thread claiming it at this moment could
/// make the figures wrong, which costs one prediction.
pub(super) fn note_released(record: &SocketRecord) {
    let threshold = u64::from(crate::settings::short_connection_bytes());
    if threshold == 0 || record.flags() & flags::CLIENT == 0 {
        return;
    }
    let on_san = record.flags() & flags::SAN != 0 && record.bypass() == Bypass::None;
    if !on_san && record.bypass() != Bypass::ShortConnections {
        return;
    }
    let Some(server) = record.addresses().1 else {
        return;
    };
    let carried: u64 = [
        Counter::TcpSent,
        Counter::TcpReceived,
        Counter::SanInlineSent,
        Counter::SanInlineReceived,
        Counter::SanRendezvousSent,
        Counter::SanRendezvousReceived,
    ]
    .iter()
    .map(|&counter| record.counters[counter as usize].load(Ordering::Relaxed))
    .fold(0u64, u64::saturating_add);
    if let Ok(mut history) = HISTORY.try_lock() {
        history.note_carried(server, carried, threshold);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const THRESHOLD: u64 = 1024;

    fn server(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn note(history: &mut History, s: SocketAddr, long: bool) {
        history.note_carried(s, if long { THRESHOLD } else { 100 }, THRESHOLD);
    }

    #[test]
    fn short_connections_turn_a_server_to_tcp_and_long_ones_turn_it_back() {
        let mut history = History::new();
        let s = server(41_001);
        assert!(
            !history.predicts_short(s),
            "a server's first connection takes the SAN"
        );
        note(&mut history, s, false);
        assert!(
            !history.predicts_short(s),
            "one short connection is not enough"
        );
        note(&mut history, s, false);
        assert!(history.predicts_short(s), "two are: the next stays on TCP");
        for _ in 0..10 {
            note(&mut history, s, false);
        }
        // Bounded: three long connections outweigh any run of short ones.
        for _ in 0..3 {
            assert!(history.predicts_short(s));
            note(&mut history, s, true);
        }
        assert!(!history.predicts_short(s));
    }

    #[test]
    fn short_connections_among_long_ones_keep_the_san() {
        let mut history = History::new();
        let s = server(41_002);
        for _ in 0..3 {
            note(&mut history, s, true);
        }
        note(&mut history, s, false);
        note(&mut history, s, false);
        assert!(!history.predicts_short(s));
    }

    #[test]
    fn connections_that_carried_nothing_are_not_counted() {
        let mut history = History::new();
        let s = server(41_005);
        for _ in 0..5 {
            history.note_carried(s, 0, THRESHOLD);
        }
        assert!(!history.predicts_short(s));
        history.note_carried(s, 1, THRESHOLD);
        history.note_carried(s, THRESHOLD - 1, THRESHOLD);
        assert!(history.predicts_short(s));
        history.note_carried(s, THRESHOLD, THRESHOLD);
        assert!(!history.predicts_short(s));
    }

    #[test]
    fn servers_are_told_apart() {
        let mut history = History::new();
        let (a, b) = (server(41_003), server(41_004));
        note(&mut history, a, false);
        note(&mut history, a, false);
        assert!(history.predicts_short(a));
        if slot_of(&a) != slot_of(&b) {
            assert!(!history.predicts_short(b));
        }
        // A server that takes another's slot starts afresh.
        let c = (1..)
            .map(server)
            .find(|c| *c != a && slot_of(c) == slot_of(&a))
            .unwrap();
        note(&mut history, c, false);
        assert!(!history.predicts_short(c));
        assert!(!history.predicts_short(a), "forgotten");
    }
}
