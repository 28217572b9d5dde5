//! Connection set-up through the provider contract only (`SanConnector`), and the
//! cache-invalidation callback.

use san_api::{
    Completion, ConnectProgress, Established, MemRange, RecvSlot, SanConnectRequest, SanConnection,
    SanConnector, SanDomain, SetupError, SlotConfig, WrId,
};
use san_sim::{FaultConfig, SimAddress, SimFabric, MAX_PRIVATE_DATA};

const SLOTS: SlotConfig = SlotConfig {
    send_slots: 4,
    recv_slots: 4,
    slot_size: 128,
};

/// Connects `active` to `passive` listening at `address`, through the trait alone: the
/// passive side checks the request's blob and answers with its own.
fn handshake<C: SanConnector>(
    active: &mut C,
    passive: &mut C,
    address: &C::Address,
    hello: &[u8],
    answer: &[u8],
) -> (Established<C::Connection>, C::Connection) {
    let mut listener = passive.listen(address).expect("listen");
    let mut pending = active.connect(address, SLOTS, hello).expect("connect");
    pending = match active
        .poll_connect(pending)
        .expect("poll before the answer")
    {
        ConnectProgress::Pending(pending) => pending,
        ConnectProgress::Established(_) => panic!("established before the listener answered"),
    };
    let request = passive
        .poll_request(&mut listener)
        .expect("poll_request")
        .expect("the request arrived");
    assert_eq!(request.private_data(), hello, "the active side's blob");
    let accepted = passive.accept(request, SLOTS, answer).expect("accept");
    match active.poll_connect(pending).expect("poll after the answer") {
        ConnectProgress::Established(established) => (established, accepted),
        ConnectProgress::Pending(_) => panic!("still pending after the accept"),
    }
}

fn completions(conn: &mut impl SanConnection) -> Vec<Completion> {
    let mut out = Vec::new();
    while conn.poll_completions(&mut out, 8) > 0 {}
    out
}

/// The outcome of a connect that must fail, whether at `connect` or at the first poll.
fn failure<C: SanConnector>(
    connector: &mut C,
    pending: Result<C::Connecting, SetupError>,
) -> SetupError {
    match pending.and_then(|pending| connector.poll_connect(pending)) {
        Err(error) => error,
        Ok(ConnectProgress::Pending(_)) => panic!("still pending"),
        Ok(ConnectProgress::Established(_)) => panic!("established"),
    }
}

#[test]
fn connect_and_accept_carry_both_blobs_and_give_a_working_connection() {
    let fabric = SimFabric::new(1, FaultConfig::default());
    let (a, b) = (fabric.add_endpoint(), fabric.add_endpoint());
    let (mut client, mut server) = (fabric.connector(a), fabric.connector(b));
    let address = SimAddress {
        endpoint: b,
        port: 80,
    };
    let (established, mut accepted) = handshake(
        &mut client,
        &mut server,
        &address,
        b"hello 4-tuple",
        b"welcome",
    );
    assert_eq!(established.peer_private_data, b"welcome");
    let mut connected = established.connection;
    assert_eq!(connected.slot_config(), SLOTS);
    assert_eq!(accepted.slot_config(), SLOTS);

    accepted.post_recv(WrId(1), RecvSlot(0)).unwrap();
    connected.post_send(WrId(2), b"first message").unwrap();
    fabric.run_until_idle(1_000);
    let got = completions(&mut accepted);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].status, Ok(()));
    assert_eq!(accepted.recv_slot(RecvSlot(0), 13), b"first message");
    assert_eq!(completions(&mut connected)[0].status, Ok(()));
}

#[test]
fn requests_queue_in_arrival_order_and_each_gets_its_own_connection() {
    let fabric = SimFabric::new(2, FaultConfig::default());
    let server_ep = fabric.add_endpoint();
    let mut server = fabric.connector(server_ep);
    let address = SimAddress {
        endpoint: server_ep,
        port: 7,
    };
    let mut listener = server.listen(&address).unwrap();
    let mut clients: Vec<_> = (0..3)
        .map(|_| fabric.connector(fabric.add_endpoint()))
        .collect();
    let pendings: Vec<_> = clients
        .iter_mut()
        .enumerate()
        .map(|(n, client)| client.connect(&address, SLOTS, &[n as u8]).unwrap())
        .collect();
    let mut accepted = Vec::new();
    while let Some(request) = server.poll_request(&mut listener).unwrap() {
        let blob = request.private_data().to_vec();
        accepted.push(server.accept(request, SLOTS, &blob).unwrap());
    }
    assert_eq!(accepted.len(), 3);
    for (n, (client, pending)) in clients.iter_mut().zip(pendings).enumerate() {
        let ConnectProgress::Established(established) = client.poll_connect(pending).unwrap()
        else {
            panic!("client {n} not established");
        };
        assert_eq!(
            established.peer_private_data,
            [n as u8],
            "answers not crossed"
        );
    }
}

#[test]
fn failures_are_reported_with_the_cause_the_fallback_rule_needs() {
    let fabric = SimFabric::new(3, FaultConfig::default());
    let (a, b, c) = (
        fabric.add_endpoint(),
        fabric.add_endpoint(),
        fabric.add_endpoint(),
    );
    let (mut client, mut server) = (fabric.connector(a), fabric.connector(b));
    let address = SimAddress {
        endpoint: b,
        port: 1,
    };

    // Nobody listens: refused, and TCP must not be tried.
    let attempt = client.connect(&address, SLOTS, b"");
    let refused = failure(&mut client, attempt);
    assert_eq!(refused, SetupError::Refused);
    assert!(!refused.allows_tcp_fallback());

    let mut listener = server.listen(&address).unwrap();
    // An explicit reject and an unanswered (dropped) request are both rejections.
    let explicit = client.connect(&address, SLOTS, b"one").unwrap();
    let dropped = client.connect(&address, SLOTS, b"two").unwrap();
    let request = server.poll_request(&mut listener).unwrap().unwrap();
    server.reject(request);
    drop(server.poll_request(&mut listener).unwrap().unwrap());
    assert_eq!(failure(&mut client, Ok(explicit)), SetupError::Rejected);
    assert_eq!(failure(&mut client, Ok(dropped)), SetupError::Rejected);
    assert!(SetupError::Rejected.allows_tcp_fallback());

    // A blob over the limit is refused before anything is sent.
    let oversized = vec![0u8; MAX_PRIVATE_DATA + 1];
    assert_eq!(
        client.connect(&address, SLOTS, &oversized).err(),
        Some(SetupError::Other)
    );
    assert_eq!(client.max_private_data(), MAX_PRIVATE_DATA);
    assert!(server.poll_request(&mut listener).unwrap().is_none());

    // The active side gave up before the accept: the accept sees a reset.
    let abandoned = client.connect(&address, SLOTS, b"bye").unwrap();
    let request = server.poll_request(&mut listener).unwrap().unwrap();
    drop(abandoned);
    assert_eq!(
        server.accept(request, SLOTS, b"").err(),
        Some(SetupError::Reset)
    );

    // The listener closes with a request still queued: refused.
    let queued = client.connect(&address, SLOTS, b"late").unwrap();
    drop(listener);
    assert_eq!(failure(&mut client, Ok(queued)), SetupError::Refused);

    // A crashed host is unreachable, before and after the request was sent.
    let mut third = fabric.connector(c);
    let far = SimAddress {
        endpoint: c,
        port: 9,
    };
    let _far_listener = third.listen(&far).unwrap();
    let in_flight = client.connect(&far, SLOTS, b"").unwrap();
    fabric.crash(c).unwrap();
    assert_eq!(failure(&mut client, Ok(in_flight)), SetupError::Unreachable);
    let attempt = client.connect(&far, SLOTS, b"");
    assert_eq!(failure(&mut client, attempt), SetupError::Unreachable);
}

#[test]
fn listening_twice_on_an_address_or_on_another_endpoint_is_refused() {
    let fabric = SimFabric::new(4, FaultConfig::default());
    let (a, b) = (fabric.add_endpoint(), fabric.add_endpoint());
    let mut connector = fabric.connector(a);
    let mine = SimAddress {
        endpoint: a,
        port: 5,
    };
    let first = connector.listen(&mine).unwrap();
    assert_eq!(connector.listen(&mine).err(), Some(SetupError::Other));
    let theirs = SimAddress {
        endpoint: b,
        port: 5,
    };
    assert_eq!(connector.listen(&theirs).err(), Some(SetupError::Other));
    drop(first);
    assert!(connector.listen(&mine).is_ok(), "free again once closed");
}

#[test]
fn the_domain_records_every_invalidation_callback() {
    let fabric = SimFabric::new(5, FaultConfig::default());
    let (a, b) = (fabric.add_endpoint(), fabric.add_endpoint());
    let mut domain = fabric.domain(a);
    let first = MemRange::new(0x1000, 0x2000);
    let second = MemRange::new(0x9000, 1);
    domain.memory_invalidated(first);
    domain.memory_invalidated(second);
    assert_eq!(fabric.invalidations(a), [first, second]);
    assert!(fabric.invalidations(b).is_empty(), "per endpoint");
}
