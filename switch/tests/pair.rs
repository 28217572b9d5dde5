//! Pair-harness tests: two sessions over one simulated connection without faults, driven
//! by the generic driver, with the registration cache in between.

mod common;

use common::{caps, pattern, Pair, PairConfig, Which, SLOTS};
use san_api::{Access, CompletionError, RecvSlot, SlotConfig};
use switch::error::{Error, PeerIncompatible, PeerMisbehaved, RecvError, SendError};
use switch::session::{
    Event, RecvFlags, ResetCause, Role, SendFlags, Session, SessionConfig, SessionState, Shutdown,
    CREDIT_RESERVE,
};
use switch::wire::ctrl;

/// Payload bytes of one inline message with the default slots.
const INLINE_PAYLOAD: usize = SLOTS.slot_size as usize - ctrl::HEADER_LEN;

fn sent_ticket_result(events: &[Event]) -> Vec<Result<u64, SendError>> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::SendComplete { result, .. } => Some(*result),
            _ => None,
        })
        .collect()
}

fn hello_bytes(version: u16, recv_slots: u16, slot_size: u32) -> Vec<u8> {
    let repr = ctrl::Repr {
        credits: 0,
        message: ctrl::Message::Hello(ctrl::Hello {
            version,
            caps: ctrl::caps::RDMA_READ,
            recv_slots,
            slot_size,
            rndv_threshold: 65536,
            tcp_bytes_sent: 0,
        }),
        payload: &[],
    };
    let mut buf = vec![0u8; repr.buffer_len()];
    repr.emit(&mut buf).unwrap();
    buf
}

// ------------------------------------------------------------------ negotiation

#[test]
fn negotiation_reports_the_peers_tcp_byte_count_and_threshold() {
    let mut config = PairConfig::default();
    config.session.rendezvous_threshold = 1000;
    let mut pair = Pair::new(config);
    assert_eq!(pair.a.session.state(), SessionState::Handshaking);
    assert_eq!(
        pair.a.session.send(b"x", SendFlags::default()),
        Err(SendError::WouldBlock)
    );
    pair.run();
    assert!(pair.a.events.contains(&Event::Established {
        peer_tcp_bytes_sent: 22
    }));
    assert!(pair.b.events.contains(&Event::Established {
        peer_tcp_bytes_sent: 11
    }));
    assert_eq!(pair.a.session.state(), SessionState::Established);
    assert_eq!(pair.a.session.rendezvous_threshold(), Some(1000));
    // Each side ends with every credit of the peer's slots (the hello's slot came back).
    pair.a.session.send(b"x", SendFlags::default()).unwrap();
    pair.run();
    assert_eq!(pair.recv_up_to(Which::B, 1, 1 << 20).unwrap(), b"x");
    pair.run();
    assert_eq!(pair.a.session.send_credits().get(), SLOTS.recv_slots);
    assert!(pair.a.session.readiness().writable);
}

#[test]
fn version_mismatch_falls_back_before_any_data() {
    let mut session = Session::new(Role::Active, SessionConfig::default(), caps(true), SLOTS, 0);
    while session.poll_op().is_some() {}
    let err = session
        .handle_message(RecvSlot(0), &hello_bytes(2, 8, 256))
        .unwrap_err();
    assert_eq!(
        err,
        Error::PeerIncompatible(PeerIncompatible::Version { peer: 2 })
    );
    assert!(err.is_fallback());
    assert_eq!(session.state(), SessionState::FellBack);
    assert_eq!(
        session.send(b"x", SendFlags::default()),
        Err(SendError::NotConnected)
    );
    assert!(
        session.poll_transmit(&mut [0u8; 256]).is_none(),
        "nothing moves on the SAN"
    );
}

#[test]
fn a_hello_with_too_few_slots_is_incompatible() {
    let mut session = Session::new(Role::Active, SessionConfig::default(), caps(true), SLOTS, 0);
    while session.poll_op().is_some() {}
    let err = session
        .handle_message(RecvSlot(0), &hello_bytes(1, CREDIT_RESERVE + 1, 256))
        .unwrap_err();
    assert!(matches!(
        err,
        Error::PeerIncompatible(PeerIncompatible::TooFewSlots { .. })
    ));
}

#[test]
fn passive_side_waits_for_the_active_hello_under_the_iwarp_rule() {
    let mut iwarp = caps(true);
    iwarp.active_side_sends_first = true;
    let mut passive = Session::new(Role::Passive, SessionConfig::default(), iwarp, SLOTS, 0);
    while passive.poll_op().is_some() {}
    let mut buf = [0u8; 256];
    assert!(
        passive.poll_transmit(&mut buf).is_none(),
        "passive must not speak first"
    );

    let mut active = Session::new(Role::Active, SessionConfig::default(), iwarp, SLOTS, 0);
    while active.poll_op().is_some() {}
    let hello = active.poll_transmit(&mut buf).expect("active sends first");
    passive
        .handle_message(RecvSlot(0), &buf[..hello.len])
        .unwrap();
    let reply = passive
        .poll_transmit(&mut buf)
        .expect("now the passive hello");
    let repr = ctrl::Repr::parse_bytes(&buf[..reply.len]).unwrap();
    assert!(matches!(repr.message, ctrl::Message::Hello(_)));
    assert!(matches!(
        passive.poll_event(),
        Some(Event::Established { .. })
    ));

    // Without the rule the passive side sends at once.
    let mut eager = Session::new(
        Role::Passive,
        SessionConfig::default(),
        caps(true),
        SLOTS,
        0,
    );
    while eager.poll_op().is_some() {}
    assert!(eager.poll_transmit(&mut buf).is_some());
}

#[test]
fn the_iwarp_pair_connects_over_the_fabric() {
    let mut iwarp = caps(true);
    iwarp.active_side_sends_first = true;
    iwarp.read_sink_needs_remote_write = true;
    let config = PairConfig {
        caps_a: iwarp,
        caps_b: iwarp,
        ..PairConfig::default()
    };
    let mut pair = Pair::established(config);
    pair.send_inline(Which::B, b"ping");
    assert_eq!(pair.recv_up_to(Which::A, 4, 1 << 20).unwrap(), b"ping");
}

#[test]
fn data_before_hello_and_a_second_hello_are_protocol_violations() {
    let mut session = Session::new(Role::Active, SessionConfig::default(), caps(true), SLOTS, 0);
    while session.poll_op().is_some() {}
    let fin = [ctrl::MessageType::Fin as u8, 0, 0, 0, 0, 0, 0, 0];
    assert_eq!(
        session.handle_message(RecvSlot(0), &fin),
        Err(Error::PeerMisbehaved(PeerMisbehaved::MessageBeforeHello))
    );
    assert_eq!(session.state(), SessionState::Reset);

    let mut session = Session::new(Role::Active, SessionConfig::default(), caps(true), SLOTS, 0);
    while session.poll_op().is_some() {}
    session
        .handle_message(RecvSlot(0), &hello_bytes(1, 8, 256))
        .unwrap();
    assert_eq!(
        session.handle_message(RecvSlot(1), &hello_bytes(1, 8, 256)),
        Err(Error::PeerMisbehaved(PeerMisbehaved::UnexpectedHello))
    );
}

#[test]
fn credit_overrun_and_garbage_reset_the_session() {
    let mut session = Session::new(Role::Active, SessionConfig::default(), caps(true), SLOTS, 0);
    while session.poll_op().is_some() {}
    session
        .handle_message(RecvSlot(0), &hello_bytes(1, 8, 256))
        .unwrap();
    let data = ctrl::Repr {
        credits: 0,
        message: ctrl::Message::Data { urgent: false },
        payload: b"z",
    };
    let mut buf = [0u8; 64];
    let len = data.emit(&mut buf).unwrap();
    // The peer starts with recv_slots - 1 credits and must keep the reserve for control.
    let allowed = usize::from(SLOTS.recv_slots - 1 - CREDIT_RESERVE);
    for i in 0..allowed {
        session
            .handle_message(RecvSlot(i as u16), &buf[..len])
            .unwrap();
    }
    assert_eq!(
        session.handle_message(RecvSlot(7), &buf[..len]),
        Err(Error::PeerMisbehaved(PeerMisbehaved::ReservedCreditMisuse))
    );
    assert!(session.poll_event().is_some());

    let mut session = Session::new(Role::Active, SessionConfig::default(), caps(true), SLOTS, 0);
    session
        .handle_message(RecvSlot(0), &hello_bytes(1, 8, 256))
        .unwrap();
    assert_eq!(
        session.handle_message(RecvSlot(1), &[0xff; 12]),
        Err(Error::PeerMisbehaved(PeerMisbehaved::MalformedMessage))
    );
    assert_eq!(session.state(), SessionState::Reset);
}

// ------------------------------------------------------------------ inline data

#[test]
fn inline_transfers_of_zero_to_three_slots_arrive_intact() {
    let sizes = [
        0,
        1,
        INLINE_PAYLOAD - 1,
        INLINE_PAYLOAD,
        INLINE_PAYLOAD + 1,
        2 * INLINE_PAYLOAD,
        3 * INLINE_PAYLOAD - 1,
        3 * INLINE_PAYLOAD + 7,
    ];
    let mut pair = Pair::established(PairConfig::default());
    let mut offset = 0u64;
    for size in sizes {
        let data = pattern(1, offset, size);
        offset += size as u64;
        let before = pair.a.session.stats().messages_sent;
        pair.send_inline(Which::A, &data);
        let got = pair.recv_up_to(Which::B, size, 1 << 20).unwrap();
        assert_eq!(got, data, "size {size}");
        if size == 0 {
            assert_eq!(
                pair.a.session.stats().messages_sent,
                before,
                "a zero-length send sends no message"
            );
        } else {
            let messages = pair.a.session.stats().messages_sent - before;
            assert!(
                messages >= size.div_ceil(INLINE_PAYLOAD) as u64,
                "size {size}"
            );
        }
    }
    assert_eq!(pair.a.session.send(&[], SendFlags::default()), Ok(0));
}

#[test]
fn credits_run_out_and_recover_without_receiver_not_ready() {
    let mut pair = Pair::established(PairConfig::default());
    // Fill: the receiver does not read.
    let total = 40 * INLINE_PAYLOAD;
    let data = pattern(2, 0, total);
    let mut accepted = 0;
    loop {
        match pair.a.session.send(&data[accepted..], SendFlags::default()) {
            Ok(n) => accepted += n,
            Err(SendError::WouldBlock) => break,
            Err(e) => panic!("{e}"),
        }
        pair.run();
    }
    pair.run();
    assert!(
        accepted < total,
        "a receiver that does not read must stop the sender"
    );
    assert_eq!(
        pair.a.session.send_credits().get(),
        CREDIT_RESERVE,
        "stalled at the reserve"
    );
    assert!(pair.a.session.stats().credit_stalls > 0);
    assert!(!pair.a.session.readiness().writable);
    // Bounded memory on both sides.
    let rx_bound = usize::from(SLOTS.recv_slots) * INLINE_PAYLOAD;
    assert!(pair.b.session.recv_queue_len() <= rx_bound);
    assert!(pair.a.session.send_queue_len() <= 4096);
    assert_eq!(
        pair.b.session.recv_queue_len() + pair.a.session.send_queue_len(),
        accepted
    );

    // Recovery: reading returns credits, the rest flows.
    let mut got = pair.recv_up_to(Which::B, accepted, 1 << 20).unwrap();
    while accepted < total {
        match pair.a.session.send(&data[accepted..], SendFlags::default()) {
            Ok(n) => accepted += n,
            Err(SendError::WouldBlock) => {}
            Err(e) => panic!("{e}"),
        }
        pair.run();
        got.extend(pair.recv_up_to(Which::B, total, 1 << 20).unwrap());
    }
    got.extend(
        pair.recv_up_to(Which::B, total - got.len(), 1 << 20)
            .unwrap(),
    );
    assert_eq!(got, data);
    assert!(pair.a.errors.is_empty() && pair.b.errors.is_empty());
    pair.run();
    assert!(pair.a.session.send_credits().get() > CREDIT_RESERVE);
}

#[test]
fn a_receiver_that_stops_reading_bounds_memory_in_both_directions() {
    let mut pair = Pair::established(PairConfig::default());
    let chunk = pattern(3, 0, 1000);
    let mut accepted = 0usize;
    for _ in 0..200 {
        if let Ok(n) = pair.a.session.send(&chunk, SendFlags::default()) {
            accepted += n;
        }
        pair.run();
    }
    let rx_bound = usize::from(SLOTS.recv_slots) * INLINE_PAYLOAD;
    assert!(accepted <= rx_bound + 4096, "accepted {accepted}");
    assert_eq!(
        pair.a.session.send(&chunk, SendFlags::default()),
        Err(SendError::WouldBlock)
    );
    // Meanwhile the other direction still works (the reserve keeps control flowing).
    pair.send_inline(Which::B, b"reply");
    assert_eq!(pair.recv_up_to(Which::A, 5, 1 << 20).unwrap(), b"reply");
}

#[test]
fn peek_reads_without_consuming_and_waitall_is_a_driver_loop() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"hello world");
    let mut buf = [0u8; 5];
    let peek = RecvFlags {
        peek: true,
        ..RecvFlags::default()
    };
    assert_eq!(pair.b.session.recv(&mut buf, peek), Ok(5));
    assert_eq!(&buf, b"hello");
    let mut all = [0u8; 11];
    assert_eq!(pair.b.session.recv(&mut all, peek), Ok(11));
    assert_eq!(&all, b"hello world");
    assert_eq!(pair.b.session.recv(&mut all, RecvFlags::default()), Ok(11));
    assert_eq!(
        pair.b.session.recv(&mut all, RecvFlags::default()),
        Err(RecvError::WouldBlock)
    );
    let oob = RecvFlags {
        oob: true,
        ..RecvFlags::default()
    };
    assert_eq!(
        pair.b.session.recv(&mut all, oob),
        Err(RecvError::InvalidArgument)
    );
}

#[test]
fn urgent_data_is_inline_with_a_mark() {
    let mut pair = Pair::established(PairConfig::default());
    pair.a.session.send(b"abc", SendFlags::default()).unwrap();
    pair.a
        .session
        .send(b"X", SendFlags { urgent: true })
        .unwrap();
    pair.a.session.send(b"def", SendFlags::default()).unwrap();
    pair.run();
    assert!(pair.b.session.readiness().urgent);
    assert!(!pair.b.session.at_mark());
    let mut buf = [0u8; 16];
    assert_eq!(
        pair.b.session.recv(&mut buf, RecvFlags::default()),
        Ok(3),
        "stops at the mark"
    );
    assert_eq!(&buf[..3], b"abc");
    assert!(pair.b.session.at_mark());
    assert_eq!(pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(4));
    assert_eq!(&buf[..4], b"Xdef");
    assert!(!pair.b.session.readiness().urgent);
    assert!(!pair.b.session.at_mark());
}

// ------------------------------------------------------------------ rendezvous

fn rendezvous_round_trip(receiver_reads: bool) {
    let config = PairConfig {
        caps_b: caps(receiver_reads),
        ..PairConfig::default()
    };
    let mut pair = Pair::established(config);
    assert_eq!(pair.a.session.sends_use_read_mode(), Some(receiver_reads));
    let total = 100_000;
    let data = pattern(4, 0, total);
    let ticket = pair.send_rendezvous(Which::A, &data, 100);
    assert_eq!(
        pair.a.session.send(b"z", SendFlags::default()),
        Err(SendError::WouldBlock)
    );
    assert!(
        !pair.a.session.readiness().writable,
        "one rendezvous at a time"
    );
    pair.run();

    // The prefix comes inline, then the remote segment.
    let mut buf = [0u8; 200];
    assert_eq!(pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(100));
    assert_eq!(&buf[..100], &data[..100]);
    assert_eq!(
        pair.b.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::RemoteSegment {
            len: (total - 100) as u64
        })
    );
    // post_recv refuses when the head is not remote... but here it is; peek first.
    let peek = RecvFlags {
        peek: true,
        ..RecvFlags::default()
    };
    let peeked = pair.zero_copy_recv(Which::B, 1000, peek).unwrap().unwrap();
    assert_eq!(peeked, &data[100..1100]);
    // Partial receives with a buffer smaller than the segment.
    let mut got = data[..100].to_vec();
    while got.len() < total {
        let part = pair
            .zero_copy_recv(Which::B, 30_000, RecvFlags::default())
            .unwrap()
            .unwrap();
        assert!(!part.is_empty() && part.len() <= 30_000);
        got.extend(part);
    }
    assert_eq!(got, data);
    pair.run();
    let results = sent_ticket_result(&pair.a.events);
    assert_eq!(results, vec![Ok(total as u64)]);
    assert!(pair.a.events.contains(&Event::SendComplete {
        ticket,
        result: Ok(total as u64)
    }));
    assert!(pair.a.session.readiness().writable);
    // Stream order: inline data after the rendezvous arrives after it.
    pair.send_inline(Which::A, b"after");
    assert_eq!(pair.recv_up_to(Which::B, 5, 1 << 20).unwrap(), b"after");
    pair.assert_all_released();
    let stats = pair.a.session.stats();
    assert_eq!(stats.bytes_rendezvous, (total - 100) as u64);
    assert!(pair.a.errors.is_empty() && pair.b.errors.is_empty());
}

#[test]
fn read_mode_rendezvous_with_peek_and_partial_receives() {
    rendezvous_round_trip(true);
}

#[test]
fn write_mode_rendezvous_with_peek_and_partial_receives() {
    rendezvous_round_trip(false);
}

#[test]
fn inline_data_queued_before_a_rendezvous_stays_in_order() {
    let mut pair = Pair::established(PairConfig::default());
    let first = pattern(5, 0, 3000);
    pair.a.session.send(&first, SendFlags::default()).unwrap();
    let big = pattern(5, 3000, 70_000);
    pair.send_rendezvous(Which::A, &big, 0);
    pair.run();
    let got = pair.recv_up_to(Which::B, 73_000, 1 << 20).unwrap();
    assert_eq!(&got[..3000], &first[..]);
    assert_eq!(&got[3000..], &big[..]);
    pair.run();
    pair.assert_all_released();
}

#[test]
fn post_recv_refuses_inline_heads() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"inline");
    let range = pair.fabric.alloc(pair.b.ep, 100).unwrap();
    let sink = pair.b.register(range, Access::LOCAL_WRITE).unwrap();
    assert_eq!(
        pair.b.session.post_recv(sink, RecvFlags::default()),
        Err(RecvError::NotRemote)
    );
}

fn abort_with_short_count(receiver_reads: bool) {
    let config = PairConfig {
        caps_b: caps(receiver_reads),
        ..PairConfig::default()
    };
    let mut pair = Pair::established(config);
    let total = 50_000;
    let data = pattern(6, 0, total);
    pair.send_rendezvous(Which::A, &data, 10);
    pair.run();
    let mut got = pair.recv_up_to(Which::B, 10, 1 << 20).unwrap();
    let part = pair
        .zero_copy_recv(Which::B, 20_000, RecvFlags::default())
        .unwrap()
        .unwrap();
    got.extend(part);
    // The receiver cannot register its next sink (ENOMEM): it rejects the segment.
    pair.b.session.reject_remote_segment().unwrap();
    pair.run();
    let results = sent_ticket_result(&pair.a.events);
    assert_eq!(
        results,
        vec![Ok(10 + 20_000)],
        "short count: prefix + consumed"
    );
    assert_eq!(pair.a.session.stats().rendezvous_aborted, 1);
    // The application retries the rest; nothing lost, nothing duplicated.
    got.extend(pair.transfer_inline(Which::A, Which::B, &data[20_010..]));
    assert_eq!(got, data);
    pair.assert_all_released();
}

#[test]
fn read_mode_abort_completes_the_send_with_a_short_count() {
    abort_with_short_count(true);
}

#[test]
fn write_mode_abort_completes_the_send_with_a_short_count() {
    abort_with_short_count(false);
}

#[test]
fn sender_side_invalidation_withdraws_the_rest_in_write_mode() {
    let config = PairConfig {
        caps_b: caps(false),
        ..PairConfig::default()
    };
    let mut pair = Pair::established(config);
    let data = pattern(7, 0, 60_000);
    pair.send_rendezvous(Which::A, &data, 0);
    pair.run();
    let mut got = pair
        .zero_copy_recv(Which::B, 25_000, RecvFlags::default())
        .unwrap()
        .unwrap();
    // The sender's buffer is unmapped: the cache invalidates it and tells the session.
    let (&id, _) = pair.a.held.iter().next().expect("the rest is held");
    pair.a.session.handle_invalidated(id);
    // The next sink makes the sender withdraw instead of writing with the dead key.
    assert_eq!(
        pair.zero_copy_recv(Which::B, 25_000, RecvFlags::default()),
        Ok(None)
    );
    pair.run();
    assert_eq!(sent_ticket_result(&pair.a.events), vec![Ok(25_000)]);
    got.extend(pair.transfer_inline(Which::A, Which::B, &data[25_000..]));
    assert_eq!(got, data);
    assert_eq!(pair.fabric.violation_count(), 0);
    pair.assert_all_released();
}

#[test]
fn invalidation_before_the_start_fails_the_send_with_enobufs() {
    let mut pair = Pair::established(PairConfig::default());
    // Fill the credits so the rendezvous start cannot go out yet.
    pair.a
        .session
        .send(&pattern(8, 0, 4000), SendFlags::default())
        .unwrap();
    let ticket = pair.send_rendezvous(Which::A, &pattern(8, 4000, 70_000), 0);
    let (&id, _) = pair.a.held.iter().next().unwrap();
    pair.a.session.handle_invalidated(id);
    pair.run();
    assert!(pair.a.events.contains(&Event::SendComplete {
        ticket,
        result: Err(SendError::NoBuffers)
    }));
    assert_eq!(
        pair.recv_up_to(Which::B, 10_000, 1 << 20).unwrap(),
        pattern(8, 0, 4000)
    );
    pair.assert_all_released();
}

// ------------------------------------------------------------------ shutdown and close

#[test]
fn half_close_works_in_both_directions() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"last words");
    pair.a.session.shutdown(Shutdown::Write);
    pair.run();
    assert!(pair.b.events.contains(&Event::PeerClosed));
    assert!(pair.b.session.readiness().read_hup);
    assert_eq!(
        pair.recv_up_to(Which::B, 100, 1 << 20).unwrap(),
        b"last words"
    );
    let mut buf = [0u8; 4];
    assert_eq!(
        pair.b.session.recv(&mut buf, RecvFlags::default()),
        Ok(0),
        "EOF"
    );
    assert_eq!(
        pair.a.session.send(b"x", SendFlags::default()),
        Err(SendError::Closed)
    );
    assert_eq!(SendError::Closed.errno(), 32);
    // The other direction is still open.
    pair.send_inline(Which::B, b"still here");
    assert_eq!(
        pair.recv_up_to(Which::A, 100, 1 << 20).unwrap(),
        b"still here"
    );
    pair.b.session.shutdown(Shutdown::Write);
    pair.run();
    assert_eq!(pair.a.session.recv(&mut buf, RecvFlags::default()), Ok(0));
    assert!(pair.a.session.readiness().hup && pair.b.session.readiness().hup);
}

#[test]
fn shutdown_read_drops_new_data_but_keeps_the_sender_going() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"queued");
    pair.b.session.shutdown(Shutdown::Read);
    let mut buf = [0u8; 16];
    assert_eq!(pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(6));
    assert_eq!(pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(0));
    // Plenty more than the receive queue holds: credits keep coming back.
    let big = pattern(9, 0, 20 * INLINE_PAYLOAD);
    pair.send_inline(Which::A, &big);
    assert_eq!(pair.b.session.recv_queue_len(), 0);
    assert!(pair.a.session.readiness().writable);
}

#[test]
fn graceful_close_delivers_data_in_flight_then_eof() {
    let mut pair = Pair::established(PairConfig::default());
    let data = pattern(10, 0, 3000);
    pair.a.session.send(&data, SendFlags::default()).unwrap();
    pair.a.session.close(false);
    assert_eq!(pair.a.session.state(), SessionState::Closed);
    pair.run();
    assert_eq!(pair.recv_up_to(Which::B, 5000, 1 << 20).unwrap(), data);
    let mut buf = [0u8; 4];
    assert_eq!(pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(0));
    pair.b.session.close(false);
    pair.run();
    assert!(pair.a.session.is_quiescent() && pair.b.session.is_quiescent());
    assert!(!pair.b.events.iter().any(|e| matches!(e, Event::Reset(_))));
}

#[test]
fn abortive_close_resets_the_peer() {
    let mut pair = Pair::established(PairConfig::default());
    pair.a
        .session
        .send(b"dropped", SendFlags::default())
        .unwrap();
    pair.a.session.close(true);
    pair.run();
    assert!(pair.b.events.contains(&Event::Reset(ResetCause::Peer)));
    let mut buf = [0u8; 16];
    assert_eq!(
        pair.b.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::Reset)
    );
    assert_eq!(RecvError::Reset.errno(), 104);
    assert_eq!(
        pair.b.session.send(b"x", SendFlags::default()),
        Err(SendError::Reset)
    );
    let readiness = pair.b.session.readiness();
    assert!(readiness.error && readiness.hup && readiness.readable);
    assert!(pair.a.session.is_quiescent());
}

#[test]
fn close_with_unread_data_resets_like_linux() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"unread");
    pair.b.session.close(false);
    pair.run();
    assert!(pair
        .b
        .events
        .contains(&Event::Reset(ResetCause::UnreadDataOnClose)));
    assert!(pair.a.events.contains(&Event::Reset(ResetCause::Peer)));
}

#[test]
fn data_already_received_stays_readable_after_a_reset() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"before");
    pair.a.session.close(true);
    pair.run();
    let mut buf = [0u8; 16];
    assert_eq!(pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(6));
    assert_eq!(
        pair.b.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::Reset)
    );
}

// ------------------------------------------------------------------ provider faults

#[test]
fn provider_error_resets_and_releases_every_handle() {
    let config = PairConfig {
        caps_b: caps(false), // WRITE mode so both sides hold handles
        ..PairConfig::default()
    };
    let mut pair = Pair::established(config);
    // B -> A in READ mode (A can read): A will hold a sink, B its rest.
    let data = pattern(11, 0, 80_000);
    pair.send_rendezvous(Which::A, &data, 0);
    let back = pattern(12, 0, 80_000);
    pair.send_rendezvous(Which::B, &back, 0);
    pair.run();
    // B advertises a WRITE-mode sink for A's data and holds it.
    let range = pair.fabric.alloc(pair.b.ep, 1000).unwrap();
    let sink = pair
        .b
        .register(range, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    pair.b
        .session
        .post_recv(sink, RecvFlags::default())
        .unwrap();
    assert!(pair.a.held.len() == 1 && pair.b.held.len() == 2);

    pair.fabric.inject_qp_error(pair.a.conn.id()).unwrap();
    pair.run();
    for side in [&pair.a, &pair.b] {
        assert_eq!(side.session.state(), SessionState::Reset);
        assert!(side
            .events
            .iter()
            .any(|e| matches!(e, Event::Reset(ResetCause::Provider(_)))));
        assert!(side.session.is_quiescent());
    }
    assert!(sent_ticket_result(&pair.a.events)
        .iter()
        .all(|r| r.is_err() || r.is_ok_and(|n| n < data.len() as u64)));
    pair.assert_all_released();
    let mut buf = [0u8; 4];
    assert_eq!(
        pair.a.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::Reset)
    );
    assert!(pair
        .a
        .errors
        .iter()
        .chain(&pair.b.errors)
        .all(|e| matches!(e, Error::Provider(_))));
    let _ = CompletionError::Flushed;
}

#[test]
fn small_slots_still_carry_everything() {
    let config = PairConfig {
        slots: SlotConfig {
            send_slots: 2,
            recv_slots: 4,
            slot_size: 64,
        },
        ..PairConfig::default()
    };
    let mut pair = Pair::established(config);
    let data = pattern(13, 0, 5000);
    pair.send_inline(Which::A, &data[..2000]);
    let mut got = pair.recv_up_to(Which::B, 5000, 1 << 20).unwrap();
    pair.send_inline(Which::A, &data[2000..]);
    while got.len() < data.len() {
        got.extend(pair.recv_up_to(Which::B, 5000, 1 << 20).unwrap());
    }
    assert_eq!(got, data);
}

// ------------------------------------------------------------------ hostile peer bytes

mod hostile {
    use super::*;
    use proptest::prelude::*;

    fn arb_message() -> impl Strategy<Value = Vec<u8>> {
        // Mostly well-formed headers with random bodies (to get past the parser), plus raw
        // garbage.
        prop_oneof![
            (
                1u8..=11,
                0u8..8,
                any::<u16>(),
                proptest::collection::vec(any::<u8>(), 0..48)
            )
                .prop_map(|(kind, flags, credits, rest)| {
                    let body = ctrl::MessageType::from_byte(kind).unwrap().body_len();
                    let payload = rest.len().saturating_sub(body) as u32;
                    let mut bytes = vec![kind, flags];
                    bytes.extend_from_slice(&credits.to_be_bytes());
                    bytes.extend_from_slice(&payload.to_be_bytes());
                    bytes.extend_from_slice(&rest);
                    bytes
                }),
            proptest::collection::vec(any::<u8>(), 0..64),
        ]
    }

    proptest! {
        /// Whatever the peer sends after a valid hello, the session never panics, and any
        /// error leaves it in a terminal state that posts nothing new but releases.
        #[test]
        fn the_session_survives_arbitrary_peer_messages(
            messages in proptest::collection::vec(arb_message(), 1..20),
            rdma_read in any::<bool>(),
        ) {
            let mut session =
                Session::new(Role::Active, SessionConfig::default(), caps(rdma_read), SLOTS, 0);
            while session.poll_op().is_some() {}
            session.handle_message(RecvSlot(0), &hello_bytes(1, 8, 256)).unwrap();
            let mut buf = [0u8; 256];
            for (i, message) in messages.iter().enumerate() {
                let result = session.handle_message(RecvSlot(i as u16 % 8), message);
                if result.is_err() {
                    prop_assert!(matches!(
                        session.state(),
                        SessionState::Reset | SessionState::FellBack
                    ));
                }
                while let Some(op) = session.poll_op() {
                    if session.state() == SessionState::Reset {
                        prop_assert!(matches!(op, switch::session::Op::Release(_)));
                    }
                }
                while session.poll_transmit(&mut buf).is_some() {}
                while session.poll_event().is_some() {}
                let mut app = [0u8; 64];
                let _ = session.recv(&mut app, RecvFlags::default());
                let _ = session.readiness();
            }
        }
    }
}

#[test]
fn peek_spans_messages_and_matches_the_following_read() {
    let config = PairConfig {
        slots: SlotConfig {
            send_slots: 4,
            recv_slots: 8,
            slot_size: 64,
        },
        ..PairConfig::default()
    };
    let mut pair = Pair::established(config);
    let data = pattern(14, 0, 600);
    let peek = RecvFlags {
        peek: true,
        ..RecvFlags::default()
    };
    let mut offset = 0;
    // Interleave sends and partial reads so the receive ring wraps around.
    for round in 0..6 {
        let chunk = &data[round * 100..(round + 1) * 100];
        pair.send_inline(Which::A, chunk);
        let mut peeked = [0u8; 150];
        let n = pair.b.session.recv(&mut peeked, peek).unwrap();
        assert!(n > 56, "a peek spans several 56-byte messages");
        // Read less than was peeked, leaving part of a message behind.
        let want = n - 30;
        let mut read = [0u8; 150];
        let m = pair
            .b
            .session
            .recv(&mut read[..want], RecvFlags::default())
            .unwrap();
        assert_eq!(m, want);
        assert_eq!(peeked[..m], read[..m], "round {round}");
        assert_eq!(&read[..m], &data[offset..offset + m]);
        offset += m;
    }
    let rest = pair.recv_up_to(Which::B, 600, 1 << 20).unwrap();
    assert_eq!(rest, &data[offset..]);
    offset += rest.len();
    assert_eq!(offset, 600);
}
