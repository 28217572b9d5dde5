//! Connection set-up through the provider contract only (`SanConnector`), both ends in one
//! process: create carries the blob into the segment, attach reads it, the answer travels
//! back through the segment.

mod common;

use std::time::Duration;

use common::TestDir;
use san_api::{
    Completion, CompletionKind, ConnectProgress, Established, RecvSlot, SanConnectRequest,
    SanConnection, SanConnector, SetupError, SlotConfig, WrId,
};
use san_shm::{ShmConnector, ShmConnectorConfig, ShmDomain, ShmSegment, MAX_SETUP_DATA};

const SLOTS: SlotConfig = SlotConfig {
    send_slots: 4,
    recv_slots: 4,
    slot_size: 128,
};

fn connector(dir: &TestDir, domain: &ShmDomain, setup_timeout: Duration) -> ShmConnector {
    let config = ShmConnectorConfig {
        setup_timeout,
        ..ShmConnectorConfig::default()
    };
    ShmConnector::new(dir.handle(), domain, config)
}

/// Connects `active` to `passive` at `address` through the trait alone (the same helper
/// as the simulation's, with the order shm needs: the creator goes first).
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
    conn.poll_completions(&mut out, usize::MAX);
    out
}

fn poll_failure<C: SanConnector>(connector: &mut C, pending: C::Connecting) -> SetupError {
    match connector.poll_connect(pending) {
        Err(error) => error,
        Ok(ConnectProgress::Pending(_)) => panic!("still pending"),
        Ok(ConnectProgress::Established(_)) => panic!("established"),
    }
}

#[test]
fn connect_and_accept_carry_both_blobs_through_the_segment() {
    let dir = TestDir::new("setup");
    let (domain_a, domain_b) = (ShmDomain::default(), ShmDomain::default());
    let mut client = connector(&dir, &domain_a, Duration::from_secs(5));
    let mut server = connector(&dir, &domain_b, Duration::from_secs(5));
    let hello = vec![0xA5; MAX_SETUP_DATA];
    let (established, mut accepted) =
        handshake(&mut client, &mut server, "tuple-1", &hello, b"welcome");
    assert_eq!(established.peer_private_data, b"welcome");
    let mut connected = established.connection;
    assert_eq!(connected.slot_config(), SLOTS);
    assert!(connected.is_peer_attached());

    accepted.post_recv(WrId(1), RecvSlot(0)).unwrap();
    connected.post_send(WrId(2), b"first message").unwrap();
    assert_eq!(completions(&mut connected)[0].status, Ok(()));
    let got = completions(&mut accepted);
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].kind,
        CompletionKind::Recv {
            slot: RecvSlot(0),
            len: 13
        }
    );
    assert_eq!(accepted.recv_slot(RecvSlot(0), 13), b"first message");
}

#[test]
fn a_listener_waits_for_its_segment_and_gives_one_request() {
    let dir = TestDir::new("setup-wait");
    let domain = ShmDomain::default();
    let mut client = connector(&dir, &domain, Duration::from_secs(5));
    let mut server = connector(&dir, &domain, Duration::from_secs(5));
    let mut listener = server.listen("later").unwrap();
    assert!(
        server.poll_request(&mut listener).unwrap().is_none(),
        "no segment yet: keep listening"
    );
    let _pending = client.connect("later", SLOTS, b"x").unwrap();
    let request = server.poll_request(&mut listener).unwrap().unwrap();
    assert_eq!(request.slot_config(), Some(SLOTS));
    assert!(server.poll_request(&mut listener).unwrap().is_none());
}

#[test]
fn rejection_timeout_and_limits_report_the_right_cause() {
    let dir = TestDir::new("setup-fail");
    let domain = ShmDomain::default();
    let mut client = connector(&dir, &domain, Duration::from_millis(50));
    let mut server = connector(&dir, &domain, Duration::from_secs(5));

    // Explicit reject, and a request dropped unanswered.
    for (name, explicit) in [("rejected", true), ("dropped", false)] {
        let mut listener = server.listen(name).unwrap();
        let pending = client.connect(name, SLOTS, b"please").unwrap();
        let request = server.poll_request(&mut listener).unwrap().unwrap();
        if explicit {
            server.reject(request);
        } else {
            drop(request);
        }
        assert_eq!(poll_failure(&mut client, pending), SetupError::Rejected);
    }

    // Slot pools other than the creator's: refused locally, and the creator is told no.
    let mut listener = server.listen("mismatch").unwrap();
    let pending = client.connect("mismatch", SLOTS, b"").unwrap();
    let request = server.poll_request(&mut listener).unwrap().unwrap();
    let other = SlotConfig {
        recv_slots: 8,
        ..SLOTS
    };
    assert_eq!(
        server.accept(request, other, b"").err(),
        Some(SetupError::Other)
    );
    assert_eq!(poll_failure(&mut client, pending), SetupError::Rejected);

    // Nobody attaches: the pending connect times out, and fallback is allowed.
    let pending = client.connect("nobody", SLOTS, b"").unwrap();
    std::thread::sleep(Duration::from_millis(60));
    let timed_out = poll_failure(&mut client, pending);
    assert_eq!(timed_out, SetupError::TimedOut);
    assert!(timed_out.allows_tcp_fallback());
    assert!(
        !dir.path().join("nobody").exists(),
        "an abandoned connect removes its segment"
    );

    // Limits: an oversized blob, a live creator holding the name.
    let oversized = vec![0; MAX_SETUP_DATA + 1];
    assert_eq!(client.max_private_data(), MAX_SETUP_DATA);
    assert_eq!(
        client.connect("big", SLOTS, &oversized).err(),
        Some(SetupError::Other)
    );
    let _held = client.connect("taken", SLOTS, b"").unwrap();
    assert_eq!(
        client.connect("taken", SLOTS, b"").err(),
        Some(SetupError::Other)
    );
}

#[test]
fn the_plain_constructors_still_work_and_read_as_an_empty_blob() {
    let dir = TestDir::new("setup-plain");
    let domain = ShmDomain::default();
    let mut server = connector(&dir, &domain, Duration::from_secs(5));
    let config = san_shm::SegmentConfig::new(SLOTS);
    let _created = ShmSegment::create(dir.handle(), "plain", &config).unwrap();
    let mut listener = server.listen("plain").unwrap();
    let request = server.poll_request(&mut listener).unwrap().unwrap();
    assert!(request.private_data().is_empty());
    assert!(server.accept(request, SLOTS, b"").is_ok());
}
