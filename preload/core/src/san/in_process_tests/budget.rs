//! The memory budget's charge goes back on every way a SAN socket ends: closed, fallen back
//! to TCP (plain server), downgraded, dropped with its record.

use super::*;
use crate::san::budget::Budget;

/// Gives the SAN socket of `end` a charge of `bytes` from `budget`.
fn charge(end: &End, budget: &'static Budget, bytes: u64) {
    match lock(end.index).as_mut() {
        Some(SanObject::Socket(socket)) => {
            socket.hold(budget.charge(bytes).expect("within the test budget"));
        }
        _ => panic!("not a SAN socket"),
    }
}

fn test_budget() -> &'static Budget {
    Box::leak(Box::new(Budget::with_limit(u64::MAX)))
}

#[test]
fn closing_both_ends_gives_their_charges_back() {
    for_seeds("budget close", |seed| {
        let budget = test_budget();
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        charge(c, budget, 3);
        charge(a, budget, 4);
        assert_eq!(budget.held(), 7);
        let data = pattern(40_000, 1);
        pair.send_all(c, a, &data);
        pair.close(c);
        assert_eq!(
            budget.held(),
            4,
            "the client's charge is back once it closed"
        );
        assert_same(&pair.read_to_end(a, c), &data, "bytes before the close");
        pair.close(a);
        assert_eq!(budget.held(), 0);
    });
}

#[test]
fn a_pending_client_of_a_plain_server_gives_its_charge_back() {
    for_seeds("budget plain server", |seed| {
        let budget = test_budget();
        let pair = Pair::pending(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        charge(c, budget, 5);
        let answer = pattern(3_000, 2);
        assert_eq!(pair.send(a, &answer, 0), Ok(answer.len()));
        assert_same(
            &pair.read_blocking(c, answer.len(), 1_000),
            &answer,
            "a plain server's bytes",
        );
        assert!(lock(c.index).is_none(), "the client stays on TCP");
        assert_eq!(budget.held(), 0);
    });
}

#[test]
fn a_downgrade_gives_both_charges_back() {
    for_seeds("budget downgrade", |seed| {
        let budget = test_budget();
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        charge(c, budget, 3);
        charge(a, budget, 4);
        let data = pattern(20_000, 3);
        assert_eq!(pair.send(a, &data, 0), Ok(data.len()));
        for _ in 0..20 {
            pair.service(a);
            pair.service(c);
        }
        let client_fd = c.fd;
        downgrade_all(Some(&move |fd| fd == client_fd));
        assert!(!matches!(
            lock(c.index).as_ref(),
            Some(SanObject::Socket(_))
        ));
        assert_eq!(
            budget.held(),
            4,
            "the client's charge is back, its stash is not charged"
        );
        let more = pattern(5_000, 4);
        assert_eq!(pair.send(c, &more, 0), Ok(more.len()));
        assert_same(
            &pair.read_blocking(a, more.len(), 2_000),
            &more,
            "after the downgrade",
        );
        assert!(!matches!(
            lock(a.index).as_ref(),
            Some(SanObject::Socket(_))
        ));
        assert_eq!(budget.held(), 0);
    });
}

#[test]
fn a_socket_dropped_with_its_pair_gives_its_charge_back() {
    for_seeds("budget drop", |seed| {
        let budget = test_budget();
        {
            let pair = Pair::switched(seed, benign_faults());
            charge(&pair.client, budget, 3);
            charge(&pair.acceptor, budget, 4);
        }
        assert_eq!(budget.held(), 0);
    });
}
