//! Pair-harness tests: two sessions over one simulated connection without faults, driven
//! by the generic driver, with the registration cache in between.

mod common;

use common::{caps, pattern, Pair, PairConfig, Which, SLOTS};
use san_api::{Access, AppSink, AppSource, BadAddress, CompletionError, RecvSlot, SlotConfig};
use switch::error::{Error, PeerIncompatible, PeerMisbehaved, RecvError, SendError};
use switch::session::{
    data_payload_room, Event, RecvFlags, ResetCause, Role, SendFlags, Session, SessionConfig,
    SessionState, Shutdown, CREDIT_RESERVE,
};
use switch::wire::ctrl;

/// Payload bytes of one inline message with the default slots.
const INLINE_PAYLOAD: usize = data_payload_room(SLOTS.slot_size as usize);

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
    // Where the stream's bytes B has not received begin (a journal's reader starts there).
    assert_eq!(pair.b.session.stats().bytes_received, offset);
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

/// With `receive_in_slots`, inline data stays in the receive slot it arrived in until the
/// application reads it: peeks and reads of any size across slots give the stream intact, a
/// receiver that does not read stops the sender at its credits (no slot is re-posted under
/// it), and reading re-posts the slots so the rest flows.
/// A pair whose receivers read straight out of their slots, with a 4 KiB send buffer.
fn reading_in_slots() -> Pair {
    Pair::established(PairConfig {
        session: SessionConfig {
            send_buffer: 4096,
            receive_in_slots: true,
            ..SessionConfig::default()
        },
        ..PairConfig::default()
    })
}

#[test]
fn data_left_in_its_receive_slots_reads_intact_and_frees_the_slots_as_it_is_read() {
    let mut pair = reading_in_slots();
    let total = 40 * INLINE_PAYLOAD + 13;
    let data = pattern(7, 0, total);
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
    assert_eq!(pair.a.session.send_credits().get(), CREDIT_RESERVE);
    let in_slots = pair.b.session.recv_queue_len();
    assert!(in_slots > 0 && in_slots <= usize::from(SLOTS.recv_slots) * INLINE_PAYLOAD);
    assert_eq!(in_slots + pair.a.session.send_queue_len(), accepted);
    assert_eq!(pair.b.session.recv_pending_bytes(), in_slots as u64);

    // A peek across several slots shows the stream without consuming it.
    let mut peeked = vec![0u8; 2 * INLINE_PAYLOAD + 5];
    let peek = RecvFlags {
        peek: true,
        ..RecvFlags::default()
    };
    let n = pair
        .b
        .session
        .recv_from_slots(&mut peeked[..], peek, &pair.b.conn)
        .unwrap();
    assert_eq!(peeked[..n], data[..n]);
    assert_eq!(
        pair.b.session.recv_queue_len(),
        in_slots,
        "a peek consumes nothing"
    );

    // Small reads that end inside slots and cross their ends.
    let mut got = Vec::new();
    let mut small = [0u8; 7];
    for _ in 0..(INLINE_PAYLOAD / 7 + 3) {
        let n = pair
            .b
            .session
            .recv_from_slots(&mut small[..], RecvFlags::default(), &pair.b.conn)
            .unwrap();
        got.extend_from_slice(&small[..n]);
    }
    assert_eq!(got[..], data[..got.len()]);

    // The rest, while the sender goes on: slots come back as they are read.
    while got.len() < total {
        let before = got.len();
        match pair.a.session.send(&data[accepted..], SendFlags::default()) {
            Ok(n) => accepted += n,
            Err(SendError::WouldBlock) => {}
            Err(e) => panic!("{e}"),
        }
        pair.run();
        got.extend(
            pair.recv_up_to(Which::B, total - got.len(), 1 << 20)
                .unwrap(),
        );
        assert!(got.len() > before || accepted < total, "the stream stalled");
    }
    assert_eq!(got, data);
    assert!(pair.a.errors.is_empty() && pair.b.errors.is_empty());
    pair.run();
    assert!(pair.a.session.send_credits().get() > CREDIT_RESERVE);
    assert_eq!(pair.b.session.recv_queue_len(), 0);
}

#[test]
fn a_reader_that_defers_its_drives_reads_intact_and_returns_the_slots_when_it_drives() {
    // The preload's receive path reads what the session holds inline without driving it,
    // and leaves freed slots un-re-posted until a batch gathers or the session runs dry.
    let mut pair = reading_in_slots();
    let total = 12 * INLINE_PAYLOAD + 101;
    let data = pattern(11, 0, total);
    let mut accepted = 0;
    let mut got = Vec::new();
    let chunk = INLINE_PAYLOAD / 2 + 3;
    let mut buf = vec![0u8; chunk];
    let mut drives = 0;
    let mut most_deferred = 0;
    while got.len() < total {
        if accepted < total {
            match pair.a.session.send(&data[accepted..], SendFlags::default()) {
                Ok(n) => accepted += n,
                Err(SendError::WouldBlock) => {}
                Err(e) => panic!("{e}"),
            }
        }
        pair.run();
        drives += 1;
        assert!(drives < 10_000, "the stream stalled");
        let held = pair.b.session.recv_queue_len();
        assert!(pair.b.session.holds_inline(held));
        assert!(!pair.b.session.holds_inline(held + 1));
        // Read on without a drive while the session holds a whole chunk; stop once four
        // slots wait to be re-posted.
        while pair.b.session.holds_inline(chunk) && pair.b.session.ops_waiting() < 4 {
            let n = pair
                .b
                .session
                .recv_from_slots(&mut buf[..], RecvFlags::default(), &pair.b.conn)
                .unwrap();
            assert_eq!(n, chunk, "a read the session held inline is whole");
            got.extend_from_slice(&buf[..n]);
            most_deferred = most_deferred.max(pair.b.session.ops_waiting());
        }
        if !pair.b.session.holds_inline(chunk) {
            got.extend(pair.recv_up_to(Which::B, chunk, 1 << 20).unwrap());
        }
    }
    assert_eq!(got, data);
    assert!(most_deferred >= 2, "reads freed slots without a drive");
    pair.run();
    assert_eq!(
        pair.b.session.ops_waiting(),
        0,
        "a drive re-posts every freed slot"
    );
    assert!(pair.a.session.send_credits().get() > CREDIT_RESERVE);
    assert!(pair.a.errors.is_empty() && pair.b.errors.is_empty());
}

/// A pair whose sessions send into the slots and read out of them (with a send buffer
/// smaller than what the slots take at once).
fn slots_both_ways() -> Pair {
    Pair::established(PairConfig {
        session: SessionConfig {
            send_buffer: 1024,
            receive_in_slots: true,
            send_in_slots: true,
            ..SessionConfig::default()
        },
        ..PairConfig::default()
    })
}

/// With `send_in_slots`, a send finding nothing queued ahead of it goes straight into the
/// slots as far as the credits go (more than the send buffer holds, nothing of it in the
/// buffer, a short count); the next send, without credits, is buffered, and sends go on
/// through the buffer until it is empty again. The stream arrives intact and the credits
/// all come back.
#[test]
fn sends_go_straight_into_the_slots_while_nothing_is_queued_ahead_and_credits_allow() {
    let mut pair = slots_both_ways();
    let total = 40 * INLINE_PAYLOAD + 13;
    let data = pattern(8, 0, total);
    let credits = pair.a.session.send_credits().get();
    let messages = pair.a.session.stats().messages_sent;
    let straight = usize::from(credits - CREDIT_RESERVE);

    let n = pair
        .a
        .session
        .send_into_slots(&data[..], SendFlags::default(), &mut pair.a.conn)
        .unwrap();
    assert_eq!(n, straight * INLINE_PAYLOAD, "as far as the credits go");
    assert!(n > 1024, "more than the send buffer would have taken");
    assert_eq!(
        pair.a.session.send_queue_len(),
        0,
        "nothing in the send buffer"
    );
    assert_eq!(pair.a.session.send_credits().get(), CREDIT_RESERVE);
    assert_eq!(
        pair.a.session.stats().messages_sent,
        messages + straight as u64
    );
    assert!(
        pair.a.session.waits_for_credits_to_send_straight(),
        "only credits are missing"
    );

    // No credits left: the next send is buffered, and the one after it follows it there
    // even once credits are back.
    let mut accepted = n;
    accepted += pair
        .a
        .session
        .send_into_slots(&data[accepted..], SendFlags::default(), &mut pair.a.conn)
        .unwrap();
    assert_eq!(pair.a.session.send_queue_len(), accepted - n);
    assert!(
        !pair.a.session.waits_for_credits_to_send_straight(),
        "bytes in the send buffer go first"
    );
    pair.run();
    let mut got = pair
        .recv_up_to(Which::B, 3 * INLINE_PAYLOAD, 1 << 20)
        .unwrap();
    pair.run();
    let queued = pair.a.session.send_queue_len();
    if queued > 0 {
        let more = pair
            .a
            .session
            .send_into_slots(&data[accepted..], SendFlags::default(), &mut pair.a.conn)
            .unwrap();
        assert_eq!(
            pair.a.session.send_queue_len(),
            queued + more,
            "behind bytes in the send buffer"
        );
        accepted += more;
    }

    while got.len() < total {
        let before = got.len();
        if accepted < total {
            match pair.a.session.send_into_slots(
                &data[accepted..],
                SendFlags::default(),
                &mut pair.a.conn,
            ) {
                Ok(n) => accepted += n,
                Err(SendError::WouldBlock) => {}
                Err(e) => panic!("{e}"),
            }
        }
        pair.run();
        got.extend(
            pair.recv_up_to(Which::B, total - got.len(), 1 << 20)
                .unwrap(),
        );
        assert!(got.len() > before || accepted < total, "the stream stalled");
    }
    assert_eq!(got, data);
    assert!(pair.a.errors.is_empty() && pair.b.errors.is_empty());
    assert_eq!(pair.a.session.stats().bytes_inline, total as u64);
    pair.run();
    assert!(pair.a.session.send_credits().get() > CREDIT_RESERVE);
}

/// A send into the slots whose source faults after some of its messages were staged takes
/// nothing: no credit or send slot is spent, the peer sees none of it, and the stream goes
/// on intact. A connection that stages fewer messages than the credits allow (side B's
/// simulated connection stages two at most) gives a short count at that point.
#[test]
fn a_send_into_the_slots_that_faults_takes_nothing_and_spends_no_credit() {
    let mut pair = slots_both_ways();
    pair.a
        .session
        .send_into_slots(&b"before "[..], SendFlags::default(), &mut pair.a.conn)
        .unwrap();
    pair.run();
    let credits = pair.a.session.send_credits();
    let messages = pair.a.session.stats().messages_sent;
    let faulty = Faulty {
        bytes: pattern(9, 0, 3 * INLINE_PAYLOAD),
        bad_from: 2 * INLINE_PAYLOAD + 10,
    };
    assert_eq!(
        pair.a
            .session
            .send_into_slots(&faulty, SendFlags::default(), &mut pair.a.conn),
        Err(SendError::BadAddress)
    );
    assert_eq!(pair.a.session.send_credits(), credits, "no credit spent");
    assert_eq!(pair.a.session.stats().messages_sent, messages);
    assert_eq!(pair.a.session.send_queue_len(), 0, "nothing buffered");
    pair.run();
    assert_eq!(
        pair.a
            .session
            .send_into_slots(&b"after"[..], SendFlags::default(), &mut pair.a.conn),
        Ok(5)
    );
    pair.run();
    assert_eq!(
        pair.recv_up_to(Which::B, 1 << 20, 1 << 20).unwrap(),
        b"before after",
        "nothing of the faulting send"
    );

    let data = pattern(10, 0, 5 * INLINE_PAYLOAD);
    assert_eq!(
        pair.b
            .session
            .send_into_slots(&data[..], SendFlags::default(), &mut pair.b.conn),
        Ok(2 * INLINE_PAYLOAD),
        "as far as the connection staged"
    );
    assert_eq!(pair.b.session.send_queue_len(), 0);
    pair.run();
    assert_eq!(
        pair.recv_up_to(Which::A, 1 << 20, 1 << 20).unwrap(),
        data[..2 * INLINE_PAYLOAD]
    );
    assert!(pair.a.errors.is_empty() && pair.b.errors.is_empty());
}

/// Urgent bytes never go straight into the slots: they are buffered (their message ends at
/// the urgent byte), and the receiver finds the mark where it belongs.
#[test]
fn urgent_sends_into_the_slots_are_buffered_and_keep_their_mark() {
    let mut pair = slots_both_ways();
    let urgent = SendFlags { urgent: true };
    assert_eq!(
        pair.a
            .session
            .send_into_slots(&b"abc!"[..], urgent, &mut pair.a.conn),
        Ok(4)
    );
    assert_eq!(pair.a.session.send_queue_len(), 4, "buffered");
    pair.run();
    let mut buf = [0u8; 16];
    let n = pair
        .b
        .session
        .recv_from_slots(&mut buf[..], RecvFlags::default(), &pair.b.conn)
        .unwrap();
    assert_eq!(&buf[..n], b"abc", "a read stops at the mark");
    assert!(pair.b.session.at_mark());
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

/// Application memory whose bytes from `bad_from` on the process may not touch.
struct Faulty {
    bytes: Vec<u8>,
    bad_from: usize,
}

impl AppSource for Faulty {
    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
        let end = offset + dst.len();
        let good = end.min(self.bad_from).saturating_sub(offset);
        dst[..good].copy_from_slice(&self.bytes[offset..offset + good]);
        if end > self.bad_from {
            return Err(BadAddress);
        }
        Ok(())
    }
}

impl AppSink for Faulty {
    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn copy_from(&mut self, offset: usize, src: &[u8]) -> Result<(), BadAddress> {
        let end = offset + src.len();
        let good = end.min(self.bad_from).saturating_sub(offset);
        self.bytes[offset..offset + good].copy_from_slice(&src[..good]);
        if end > self.bad_from {
            return Err(BadAddress);
        }
        Ok(())
    }
}

#[test]
fn a_send_from_a_bad_buffer_takes_nothing_and_the_stream_goes_on_intact() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"before ");
    let faulty = Faulty {
        bytes: b"never sent".to_vec(),
        bad_from: 5,
    };
    assert_eq!(
        pair.a.session.send_from(&faulty, SendFlags::default()),
        Err(SendError::BadAddress)
    );
    assert_eq!(pair.a.session.send_queue_len(), 0, "nothing of it queued");
    pair.send_inline(Which::A, b"after");
    assert_eq!(
        pair.recv_up_to(Which::B, 12, 1 << 20).unwrap(),
        b"before after"
    );
}

#[test]
fn a_recv_into_a_bad_buffer_leaves_the_segment_unread() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"first");
    // Bad from its first byte: nothing can be taken.
    let mut bad = Faulty {
        bytes: vec![0; 16],
        bad_from: 0,
    };
    assert_eq!(
        pair.b.session.recv_into(&mut bad, RecvFlags::default()),
        Err(RecvError::BadAddress)
    );
    // Good for a part of the segment only: the segment stays whole, as the kernel leaves a
    // segment it could not copy.
    let mut partly = Faulty {
        bytes: vec![0; 16],
        bad_from: 3,
    };
    assert_eq!(
        pair.b.session.recv_into(&mut partly, RecvFlags::default()),
        Err(RecvError::BadAddress)
    );
    let peek = RecvFlags {
        peek: true,
        ..RecvFlags::default()
    };
    assert_eq!(
        pair.b.session.recv_into(&mut bad, peek),
        Err(RecvError::BadAddress)
    );
    assert_eq!(pair.b.session.recv_queue_len(), 5, "nothing consumed");
    // A second segment behind the first: a buffer good for the first only takes the first.
    pair.send_inline(Which::A, b"second");
    let mut first_only = Faulty {
        bytes: vec![0; 16],
        bad_from: 8,
    };
    assert_eq!(
        pair.b
            .session
            .recv_into(&mut first_only, RecvFlags::default()),
        Ok(5)
    );
    assert_eq!(&first_only.bytes[..5], b"first");
    assert_eq!(pair.recv_up_to(Which::B, 6, 1 << 20).unwrap(), b"second");
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

    // The prefix comes inline, then the remote segment; FIONREAD counts both.
    assert_eq!(pair.b.session.recv_pending_bytes(), total as u64);
    let mut buf = [0u8; 200];
    assert_eq!(pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(100));
    assert_eq!(&buf[..100], &data[..100]);
    assert_eq!(pair.b.session.recv_pending_bytes(), (total - 100) as u64);
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
    assert_eq!(pair.b.session.recv_pending_bytes(), 0);
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
    // Peeked bytes count once, when they are received for good.
    assert_eq!(pair.b.session.stats().bytes_received, total as u64 + 5);
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

/// The sender's application was interrupted mid-rendezvous: it asks the receiver to end
/// the rendezvous, which answers with what it consumed; the send completes with that short
/// count and the rest can be sent again, nothing lost or duplicated.
fn cancel_with_short_count(receiver_reads: bool) {
    let config = PairConfig {
        caps_b: caps(receiver_reads),
        ..PairConfig::default()
    };
    let mut pair = Pair::established(config);
    let total = 50_000;
    let data = pattern(8, 0, total);
    pair.send_rendezvous(Which::A, &data, 10);
    pair.run();
    let mut got = pair.recv_up_to(Which::B, 10, 1 << 20).unwrap();
    let part = pair
        .zero_copy_recv(Which::B, 20_000, RecvFlags::default())
        .unwrap()
        .unwrap();
    got.extend(part);
    // B's application reads no more: A's cancel is answered all the same.
    assert!(pair.a.session.cancel_send_rendezvous());
    assert!(pair.a.session.cancel_send_rendezvous(), "idempotent");
    pair.run();
    assert_eq!(sent_ticket_result(&pair.a.events), vec![Ok(10 + 20_000)]);
    assert_eq!(
        pair.b.session.recv_pending_bytes(),
        0,
        "the segment is gone"
    );
    assert!(
        !pair.a.session.cancel_send_rendezvous(),
        "nothing left to cancel"
    );
    got.extend(pair.transfer_inline(Which::A, Which::B, &data[20_010..]));
    assert_eq!(got, data);
    pair.assert_all_released();
    assert!(pair.a.errors.is_empty() && pair.b.errors.is_empty());
}

#[test]
fn read_mode_cancel_completes_the_send_with_a_short_count() {
    cancel_with_short_count(true);
}

#[test]
fn write_mode_cancel_completes_the_send_with_a_short_count() {
    cancel_with_short_count(false);
}

#[test]
fn a_cancel_before_the_rendezvous_is_announced_sends_nothing() {
    let mut pair = Pair::established(PairConfig::default());
    let data = pattern(9, 0, 50_000);
    pair.send_rendezvous(Which::A, &data, 10);
    // Not transmitted yet.
    assert!(pair.a.session.cancel_send_rendezvous());
    pair.run();
    assert_eq!(sent_ticket_result(&pair.a.events), vec![Ok(0)]);
    assert_eq!(pair.b.session.recv_pending_bytes(), 0);
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
    // Dropped bytes were received all the same.
    assert_eq!(pair.b.session.stats().bytes_received, 6 + big.len() as u64);
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
fn a_failed_kernel_connection_resets_the_session_without_a_word_to_the_peer() {
    let mut pair = Pair::established(PairConfig::default());
    pair.send_inline(Which::A, b"kept");
    pair.b
        .session
        .send(b"never sent", SendFlags::default())
        .unwrap();
    pair.b.session.handle_kernel_connection_failed();
    pair.run();
    assert!(pair
        .b
        .events
        .contains(&Event::Reset(ResetCause::KernelConnectionFailed)));
    // The peer is unreachable: it hears nothing (no Rst, no data), and learns of the end
    // only from its own transport.
    assert!(!pair.a.events.iter().any(|e| matches!(e, Event::Reset(_))));
    let mut buf = [0u8; 16];
    assert_eq!(
        pair.a.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::WouldBlock)
    );
    // What had arrived stays readable; then the reset; every wait wakes.
    let readiness = pair.b.session.readiness();
    assert!(readiness.error && readiness.hup && readiness.readable);
    assert_eq!(pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(4));
    assert_eq!(&buf[..4], b"kept");
    assert_eq!(
        pair.b.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::Reset)
    );
    assert_eq!(
        pair.b.session.send(b"x", SendFlags::default()),
        Err(SendError::Reset)
    );
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
                1u8..=12,
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

// ------------------------------------------------------------------ downgrade to kernel TCP

/// One direction of a connection as the preload carries it during a downgrade: the
/// application's byte pattern, what the session accepted, the kernel TCP continuation (bytes
/// written after `SendError::Downgraded`), and what the receiver read (SAN, then TCP).
struct Direction {
    data: Vec<u8>,
    sent: usize,
    tcp: Vec<u8>,
    /// Bytes ever written to `tcp` (the reader drains it).
    tcp_written: usize,
    rendezvous: Option<(switch::session::SendTicket, usize)>,
    got: Vec<u8>,
    reading_tcp: bool,
    eof: bool,
}

impl Direction {
    fn new(stream: u64, len: usize) -> Direction {
        Direction {
            data: pattern(stream, 0, len),
            sent: 0,
            tcp: Vec::new(),
            tcp_written: 0,
            rendezvous: None,
            got: Vec::new(),
            reading_tcp: false,
            eof: false,
        }
    }
}

/// A pair plus both directions' application state: the byte-exactness model.
struct Downgrading {
    pair: Pair,
    a_to_b: Direction,
    b_to_a: Direction,
}

impl Downgrading {
    fn new(config: PairConfig, len_ab: usize, len_ba: usize) -> Downgrading {
        Downgrading {
            pair: Pair::established(config),
            a_to_b: Direction::new(1, len_ab),
            b_to_a: Direction::new(2, len_ba),
        }
    }

    fn dir(&mut self, from: Which) -> &mut Direction {
        match from {
            Which::A => &mut self.a_to_b,
            Which::B => &mut self.b_to_a,
        }
    }

    /// The sending application: writes its data up to `until` into the session while it
    /// accepts, then into kernel TCP once the session says `Downgraded`.
    fn send(&mut self, from: Which, until: usize) {
        self.collect_send_completions(from);
        for _ in 0..10_000 {
            let dir = self.dir(from);
            let until = until.min(dir.data.len());
            if dir.sent >= until || dir.rendezvous.is_some() {
                return;
            }
            let chunk = dir.data[dir.sent..until].to_vec();
            match self
                .pair
                .side(from)
                .session
                .send(&chunk, SendFlags::default())
            {
                Ok(n) => self.dir(from).sent += n,
                Err(SendError::WouldBlock) => return,
                Err(SendError::Downgraded) => {
                    let dir = self.dir(from);
                    dir.tcp.extend_from_slice(&chunk);
                    dir.tcp_written += chunk.len();
                    dir.sent = until;
                }
                Err(e) => panic!("send: {e}"),
            }
        }
        panic!("send loop did not end");
    }

    /// Starts a rendezvous of the next `len` bytes (prefix 100) from `from`.
    fn send_rendezvous(&mut self, from: Which, len: usize) {
        let dir = self.dir(from);
        let start = dir.sent;
        let bytes = dir.data[start..start + len].to_vec();
        let ticket = self.pair.send_rendezvous(from, &bytes, 100);
        self.dir(from).rendezvous = Some((ticket, start));
    }

    /// A rendezvous send that completed moves `sent` to its (possibly short) count.
    fn collect_send_completions(&mut self, from: Which) {
        let Some((ticket, start)) = self.dir(from).rendezvous else {
            return;
        };
        let events = &mut self.pair.side(from).events;
        let Some(position) = events
            .iter()
            .position(|e| matches!(e, Event::SendComplete { ticket: t, .. } if *t == ticket))
        else {
            return;
        };
        let Event::SendComplete { result, .. } = events.remove(position) else {
            unreachable!()
        };
        let n = result.expect("rendezvous send") as usize;
        let dir = self.dir(from);
        dir.sent = start + n;
        dir.rendezvous = None;
    }

    /// The receiving application (the preload's read path): the session until
    /// `RecvError::Downgraded`, then the peer's kernel TCP continuation.
    fn read(&mut self, to: Which) {
        let from = match to {
            Which::A => Which::B,
            Which::B => Which::A,
        };
        let mut buf = vec![0u8; 64 * 1024];
        for _ in 0..10_000 {
            let dir = self.dir(from);
            if dir.eof {
                return;
            }
            if dir.reading_tcp {
                let tcp = std::mem::take(&mut dir.tcp);
                dir.got.extend(tcp);
                return;
            }
            match self
                .pair
                .side(to)
                .session
                .recv(&mut buf, RecvFlags::default())
            {
                Ok(0) => {
                    self.dir(from).eof = true;
                    return;
                }
                Ok(n) => self.dir(from).got.extend_from_slice(&buf[..n]),
                Err(RecvError::RemoteSegment { len }) => {
                    match self
                        .pair
                        .zero_copy_recv(to, len.min(1 << 20), RecvFlags::default())
                    {
                        Ok(Some(bytes)) => self.dir(from).got.extend(bytes),
                        Ok(None) => {}
                        Err(e) => panic!("zero-copy receive: {e}"),
                    }
                }
                Err(RecvError::Downgraded) => {
                    assert!(self.pair.side(to).session.peer_downgraded());
                    self.dir(from).reading_tcp = true;
                }
                Err(RecvError::WouldBlock) => {
                    self.pair.run();
                    let session = &self.pair.side(to).session;
                    // Nothing more arrives now (the session says Downgraded once it does).
                    if !session.readiness().readable && !session.peer_downgraded() {
                        return;
                    }
                }
                Err(e) => panic!("recv: {e}"),
            }
        }
        panic!("read loop did not end");
    }

    /// Both applications send the rest of their data and read everything until both
    /// sessions are `Downgraded`; then every stream must be exactly its pattern.
    fn finish(&mut self) {
        for _ in 0..1000 {
            self.pair.run();
            for side in [Which::A, Which::B] {
                self.send(side, usize::MAX);
                self.read(side);
            }
            self.pair.run();
            let done = |d: &Direction| d.rendezvous.is_none() && d.got.len() == d.data.len();
            if self.pair.a.session.state() == SessionState::Downgraded
                && self.pair.b.session.state() == SessionState::Downgraded
                && done(&self.a_to_b)
                && done(&self.b_to_a)
            {
                break;
            }
        }
        assert_eq!(self.pair.a.session.state(), SessionState::Downgraded);
        assert_eq!(self.pair.b.session.state(), SessionState::Downgraded);
        assert!(self.a_to_b.got == self.a_to_b.data, "A->B stream not exact");
        assert!(self.b_to_a.got == self.b_to_a.data, "B->A stream not exact");
        for side in [&self.pair.a, &self.pair.b] {
            assert!(side.session.is_quiescent());
            assert!(side.errors.is_empty(), "{:?}", side.errors);
            assert!(!side.events.iter().any(|e| matches!(e, Event::Reset(_))));
            assert_eq!(side.session.stats().downgrades, 1);
        }
        self.pair.assert_all_released();
        assert_eq!(self.pair.fabric.violation_count(), 0);
    }
}

fn peer_downgraded_events(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, Event::PeerDowngraded))
        .count()
}

#[test]
fn downgrade_moves_both_streams_to_tcp_without_losing_a_byte() {
    let mut t = Downgrading::new(PairConfig::default(), 20_000, 15_000);
    assert!(t.pair.a.session.can_downgrade() && t.pair.b.session.can_downgrade());
    // Data in flight both ways, partly read, when A starts the downgrade.
    t.send(Which::A, 3000);
    t.send(Which::B, 2000);
    t.pair.run();
    t.read(Which::B);
    t.send(Which::A, 5000);
    assert_eq!(t.pair.a.session.downgrade(), Ok(()));
    assert_eq!(t.pair.a.session.downgrade(), Ok(()), "idempotent");
    assert!(t.pair.a.session.is_downgrading());
    assert_eq!(
        t.pair.a.session.send(b"x", SendFlags::default()),
        Err(SendError::Downgraded)
    );
    assert_eq!(SendError::Downgraded.errno(), 107);
    assert!(t.pair.a.session.readiness().writable, "sends fail at once");
    // What the session already accepted (up to its send buffer) goes on the SAN; the rest
    // of the application's writes go to TCP.
    let on_san = t.a_to_b.sent;
    t.send(Which::A, 9000);
    assert_eq!(
        t.a_to_b.tcp_written,
        9000 - on_san,
        "sends after downgrade() go to TCP"
    );
    t.pair.run();
    t.read(Which::B);
    t.pair.run();
    // B learned it and began its own downgrade: its sends now fail too.
    assert_eq!(peer_downgraded_events(&t.pair.b.events), 1);
    assert!(t.pair.b.session.peer_downgraded() && t.pair.b.session.is_downgrading());
    assert_eq!(
        t.pair.b.session.send(b"y", SendFlags::default()),
        Err(SendError::Downgraded)
    );
    t.finish();
    assert_eq!(peer_downgraded_events(&t.pair.a.events), 1, "B answered");
    let readiness = t.pair.b.session.readiness();
    assert!(!readiness.readable && !readiness.read_hup && !readiness.hup && !readiness.error);
    let mut buf = [0u8; 8];
    assert_eq!(
        t.pair.b.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::Downgraded),
        "not EOF: the stream continues on TCP"
    );
    assert_eq!(RecvError::Downgraded.errno(), 107);
}

#[test]
fn inline_data_queued_before_the_peers_downgrade_stays_readable_in_downgraded() {
    let mut t = Downgrading::new(PairConfig::default(), 600, 0);
    t.send(Which::A, 600);
    t.pair.a.session.downgrade().unwrap();
    t.pair.run();
    // B has not read: its queue still holds A's bytes, yet both sides finished the
    // downgrade (inline data needs nothing of the SAN any more).
    assert_eq!(t.pair.a.session.state(), SessionState::Downgraded);
    assert_eq!(t.pair.b.session.state(), SessionState::Downgraded);
    assert!(t.pair.b.session.readiness().readable);
    let mut buf = [0u8; 1000];
    let n = t
        .pair
        .b
        .session
        .recv(&mut buf, RecvFlags::default())
        .unwrap();
    assert_eq!(&buf[..n], &t.a_to_b.data[..n]);
    t.a_to_b.got.extend_from_slice(&buf[..n]);
    t.finish();
    // close() in Downgraded sends nothing and changes nothing.
    let sent = t.pair.a.session.stats().messages_sent;
    t.pair.a.session.close(false);
    t.pair.b.session.close(true);
    t.pair.run();
    assert_eq!(t.pair.a.session.stats().messages_sent, sent);
    assert_eq!(t.pair.a.session.state(), SessionState::Downgraded);
    assert_eq!(t.pair.b.session.state(), SessionState::Downgraded);
    assert!(t.pair.a.session.is_quiescent() && t.pair.b.session.is_quiescent());
}

#[test]
fn downgrade_after_our_fin_still_tells_the_peer() {
    let mut t = Downgrading::new(PairConfig::default(), 2000, 3000);
    t.send(Which::A, 2000);
    t.pair.a.session.shutdown(Shutdown::Write);
    t.pair.a.session.downgrade().unwrap();
    t.pair.run();
    t.read(Which::B);
    t.pair.run();
    assert!(t.pair.b.events.contains(&Event::PeerClosed));
    assert_eq!(peer_downgraded_events(&t.pair.b.events), 1);
    // Sends after shutdown stay EPIPE (the write side was closed before the downgrade).
    assert_eq!(
        t.pair.a.session.send(b"x", SendFlags::default()),
        Err(SendError::Closed)
    );
    t.finish();
    // The Fin before the Downgrade ends A's stream: B sees EOF, not a continuation.
    let mut buf = [0u8; 8];
    assert_eq!(t.pair.b.session.recv(&mut buf, RecvFlags::default()), Ok(0));
    assert!(t.a_to_b.eof && t.a_to_b.tcp_written == 0);
    assert!(t.pair.b.session.readiness().read_hup);
}

#[test]
fn the_peer_answers_a_downgrade_after_its_own_fin() {
    let mut t = Downgrading::new(PairConfig::default(), 2500, 1000);
    t.send(Which::B, 1000);
    t.pair.b.session.shutdown(Shutdown::Write);
    t.pair.run();
    assert!(t.pair.a.events.contains(&Event::PeerClosed));
    t.send(Which::A, 1000);
    t.pair.a.session.downgrade().unwrap();
    t.finish();
    assert_eq!(t.a_to_b.tcp_written, 1500);
    assert!(t.b_to_a.eof, "B's stream ended with its Fin");
}

#[test]
fn a_lingering_graceful_close_answers_a_downgrade() {
    let mut t = Downgrading::new(PairConfig::default(), 0, 3000);
    // B's application wrote and closed; its session lingers until A read everything.
    t.send(Which::B, 3000);
    t.pair.b.session.close(false);
    assert_eq!(t.pair.b.session.state(), SessionState::Closed);
    t.pair.a.session.downgrade().unwrap();
    t.pair.run();
    t.read(Which::A);
    t.pair.run();
    assert_eq!(
        peer_downgraded_events(&t.pair.b.events),
        1,
        "B got A's Downgrade"
    );
    assert_eq!(
        peer_downgraded_events(&t.pair.a.events),
        1,
        "and answered it"
    );
    assert_eq!(t.pair.b.session.state(), SessionState::Downgraded);
    assert_eq!(t.pair.a.session.state(), SessionState::Downgraded);
    assert!(t.pair.a.session.is_quiescent() && t.pair.b.session.is_quiescent());
    assert_eq!(t.b_to_a.got, t.b_to_a.data);
    assert!(t.b_to_a.eof, "B's close sent Fin before its Downgrade");
    t.pair.assert_all_released();
}

#[test]
fn simultaneous_downgrades_meet() {
    let mut t = Downgrading::new(PairConfig::default(), 5000, 5000);
    t.send(Which::A, 2500);
    t.send(Which::B, 2500);
    t.pair.a.session.downgrade().unwrap();
    t.pair.b.session.downgrade().unwrap();
    t.finish();
    assert_eq!(t.a_to_b.tcp_written, 2500);
    assert_eq!(t.b_to_a.tcp_written, 2500);
}

#[test]
fn downgrade_requested_during_the_handshake_goes_out_once_established() {
    let mut pair = Pair::new(PairConfig::default());
    assert!(!pair.a.session.can_downgrade());
    assert_eq!(pair.a.session.downgrade(), Ok(()));
    assert!(pair.a.session.readiness().writable);
    assert_eq!(
        pair.a.session.send(b"x", SendFlags::default()),
        Err(SendError::Downgraded)
    );
    pair.run();
    assert_eq!(pair.a.session.state(), SessionState::Downgraded);
    assert_eq!(pair.b.session.state(), SessionState::Downgraded);
    let mut buf = [0u8; 4];
    assert_eq!(
        pair.b.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::Downgraded)
    );
}

/// A 1 MiB rendezvous is in flight from `sender` when `initiator` starts the downgrade: it
/// completes first (the receiver consumes its remote segment), then the streams move.
fn downgrade_with_rendezvous_in_flight(receiver_reads: bool, initiator: Which, sender: Which) {
    let config = PairConfig {
        caps_a: caps(receiver_reads),
        caps_b: caps(receiver_reads),
        ..PairConfig::default()
    };
    let mut t = Downgrading::new(config, (1 << 20) + 5000, (1 << 20) + 5000);
    t.send(sender, 1000);
    t.send_rendezvous(sender, 1 << 20);
    t.pair.run();
    let mode = t.pair.side(sender).session.sends_use_read_mode();
    assert_eq!(mode, Some(receiver_reads));
    t.pair.side(initiator).session.downgrade().unwrap();
    t.pair.run();
    // The sender's rendezvous is still in flight: it neither accepts sends (a short count
    // must be re-sent first) nor has sent its Downgrade yet.
    assert_eq!(
        t.pair.side(sender).session.send(b"x", SendFlags::default()),
        Err(SendError::WouldBlock)
    );
    assert!(!t.pair.side(sender).session.readiness().writable);
    assert_ne!(
        t.pair.side(sender).session.state(),
        SessionState::Downgraded
    );
    t.finish();
    let tcp_written = t.dir(sender).tcp_written;
    assert_eq!(
        tcp_written, 4000,
        "only the bytes after the rendezvous use TCP"
    );
    let stats = t.pair.side(sender).session.stats();
    assert_eq!(stats.bytes_rendezvous, (1 << 20) - 100);
}

#[test]
fn read_mode_rendezvous_in_flight_completes_before_the_senders_downgrade() {
    downgrade_with_rendezvous_in_flight(true, Which::A, Which::A);
}

#[test]
fn write_mode_rendezvous_in_flight_completes_before_the_senders_downgrade() {
    downgrade_with_rendezvous_in_flight(false, Which::A, Which::A);
}

#[test]
fn read_mode_remote_segment_before_the_peers_downgrade_is_still_received() {
    downgrade_with_rendezvous_in_flight(true, Which::B, Which::A);
}

#[test]
fn write_mode_remote_segment_before_the_peers_downgrade_is_still_received() {
    downgrade_with_rendezvous_in_flight(false, Which::B, Which::A);
}

#[test]
fn a_reset_during_a_downgrade_is_a_reset() {
    let mut t = Downgrading::new(PairConfig::default(), 1 << 20, 0);
    t.send_rendezvous(Which::A, 1 << 20);
    t.pair.run();
    t.pair.b.session.downgrade().unwrap();
    t.pair.run();
    assert!(t.pair.a.session.is_downgrading());
    t.pair.a.session.close(true);
    t.pair.run();
    assert!(t.pair.b.events.contains(&Event::Reset(ResetCause::Peer)));
    assert_eq!(t.pair.a.session.state(), SessionState::Reset);
    assert_eq!(t.pair.b.session.state(), SessionState::Reset);
    // The inline prefix already received stays readable, then ECONNRESET (not TCP).
    let mut buf = [0u8; 4096];
    assert_eq!(
        t.pair.b.session.recv(&mut buf, RecvFlags::default()),
        Ok(100)
    );
    assert_eq!(
        t.pair.b.session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::Reset)
    );
    assert_eq!(
        t.pair.b.session.downgrade(),
        Err(switch::error::DowngradeError::Reset)
    );
    t.pair.run();
    t.pair.assert_all_released();
    assert!(t.pair.a.session.is_quiescent() && t.pair.b.session.is_quiescent());
}

/// A session whose peer is driven by hand, established with `peer_caps` in the hello.
fn hand_driven(peer_caps: u16) -> Session {
    let mut session = Session::new(Role::Active, SessionConfig::default(), caps(true), SLOTS, 0);
    while session.poll_op().is_some() {}
    let mut hello = hello_bytes(1, 8, 256);
    hello[ctrl::field::hello::CAPS].copy_from_slice(&peer_caps.to_be_bytes());
    session.handle_message(RecvSlot(0), &hello).unwrap();
    let mut buf = [0u8; 256];
    while session.poll_transmit(&mut buf).is_some() {}
    while session.poll_op().is_some() {}
    while session.poll_event().is_some() {}
    session
}

fn message_bytes(message: ctrl::Message, payload: &[u8]) -> Vec<u8> {
    let repr = ctrl::Repr {
        credits: 0,
        message,
        payload,
    };
    let mut buf = vec![0u8; repr.buffer_len()];
    repr.emit(&mut buf).unwrap();
    buf
}

/// Once both `Downgrade`s are through, the peer closes its SAN connection (it converts to
/// plain TCP): the flushes that follow end our downgrade too, never a reset, even while a
/// repost or a credit return is still pending.
#[test]
fn flushes_after_both_downgrades_complete_the_downgrade() {
    let mut session = hand_driven(ctrl::caps::RDMA_READ | ctrl::caps::DOWNGRADE);
    session.downgrade().unwrap();
    let mut buf = [0u8; 256];
    let sent = session.poll_transmit(&mut buf).expect("our Downgrade");
    let packet = ctrl::Packet::new_checked(&buf[..sent.len]).unwrap();
    assert_eq!(
        ctrl::Repr::parse(&packet).unwrap().message,
        ctrl::Message::Downgrade
    );
    session
        .handle_message(RecvSlot(1), &message_bytes(ctrl::Message::Downgrade, &[]))
        .unwrap();
    assert!(session.peer_downgraded());
    // The peer's connection goes away before our send completion and the slot's repost.
    let flushed = san_api::Completion {
        wr_id: san_api::WrId(u64::MAX - 1),
        kind: san_api::CompletionKind::Recv {
            slot: RecvSlot(2),
            len: 0,
        },
        status: Err(san_api::CompletionError::Flushed),
    };
    assert_eq!(session.handle_completion(&flushed), Ok(()));
    assert_eq!(session.state(), SessionState::Downgraded);
    assert_eq!(
        session.recv(&mut buf, RecvFlags::default()),
        Err(RecvError::Downgraded)
    );
    // Before both are through, the same flush is a reset.
    let mut early = hand_driven(ctrl::caps::RDMA_READ | ctrl::caps::DOWNGRADE);
    early.downgrade().unwrap();
    assert!(early.handle_completion(&flushed).is_err());
    assert_eq!(early.state(), SessionState::Reset);
}

/// A peer whose data we have not read and whose last credit update we consumed is down to one
/// credit: it could not send the control message our rendezvous waits for (`RdmaDone`), and
/// the credit it needs is "lazy" (owed for an update). It gets it back anyway while we are
/// above the reserve (found as a two-process hang: the receiver spent its control reserve on
/// a credit update while the sender's application was blocked in a rendezvous send).
#[test]
fn a_peer_at_its_last_credit_gets_a_lazy_credit_back() {
    let mut session = hand_driven(ctrl::caps::RDMA_READ);
    let mut buf = [0u8; 256];
    // What we owe so far (the hello's slot) goes back with a message of ours: the peer now
    // holds one credit per slot.
    session.send(b"x", SendFlags::default()).unwrap();
    while session.poll_transmit(&mut buf).is_some() {}
    while session.poll_op().is_some() {}
    assert_eq!(session.credits_owed(), 0);
    let peer_credits = u64::from(SLOTS.recv_slots);
    assert_eq!(session.peer_credit_view(), peer_credits);
    // The peer sends data down to its reserve; our application does not read it (it is
    // blocked in a rendezvous send)...
    let data = message_bytes(ctrl::Message::Data { urgent: false }, &[7u8; 100]);
    for slot in 0..peer_credits - 2 {
        session
            .handle_message(RecvSlot(slot as u16), &data)
            .unwrap();
    }
    // ...then spends one of its two reserved credits on a credit update (allowed).
    session
        .handle_message(
            RecvSlot((peer_credits - 2) as u16),
            &message_bytes(ctrl::Message::CreditUpdate, &[]),
        )
        .unwrap();
    while session.poll_op().is_some() {}
    assert_eq!(session.peer_credit_view(), 1);
    assert_eq!(
        session.credits_owed(),
        1,
        "only the update's lazy credit is owed"
    );
    let sent = session
        .poll_transmit(&mut buf)
        .expect("a credit update for the muted peer");
    let packet = ctrl::Packet::new_checked(&buf[..sent.len]).unwrap();
    let repr = ctrl::Repr::parse(&packet).unwrap();
    assert_eq!(repr.message, ctrl::Message::CreditUpdate);
    assert_eq!(repr.credits, 1);
}

#[test]
fn a_peer_without_the_capability_cannot_be_downgraded() {
    let mut session = hand_driven(ctrl::caps::RDMA_READ);
    assert_eq!(session.state(), SessionState::Established);
    assert!(!session.can_downgrade());
    assert_eq!(
        session.downgrade(),
        Err(switch::error::DowngradeError::Unsupported)
    );
    assert!(!session.is_downgrading());
    assert_eq!(session.send(b"still san", SendFlags::default()), Ok(9));
    let mut buf = [0u8; 256];
    let sent = session.poll_transmit(&mut buf).expect("data still flows");
    let repr = ctrl::Repr::parse_bytes(&buf[..sent.len]).unwrap();
    assert_eq!(repr.message, ctrl::Message::Data { urgent: false });
    assert_eq!(session.stats().downgrades, 0);

    // Requested during the handshake, then the hello lacks the bit: reset, never misorder.
    let mut early = Session::new(Role::Active, SessionConfig::default(), caps(true), SLOTS, 0);
    while early.poll_op().is_some() {}
    early.downgrade().unwrap();
    early
        .handle_message(RecvSlot(0), &hello_bytes(1, 8, 256))
        .unwrap();
    assert_eq!(early.state(), SessionState::Reset);
    let mut events = Vec::new();
    while let Some(e) = early.poll_event() {
        events.push(e);
    }
    assert!(events.contains(&Event::Reset(ResetCause::DowngradeUnsupported)));
}

#[test]
fn data_rendezvous_fin_or_a_second_downgrade_after_the_peers_downgrade_are_violations() {
    let downgrade = message_bytes(ctrl::Message::Downgrade, &[]);
    let after: [(Vec<u8>, PeerMisbehaved); 4] = [
        (
            message_bytes(ctrl::Message::Data { urgent: false }, b"late"),
            PeerMisbehaved::DataAfterDowngrade,
        ),
        (
            message_bytes(
                ctrl::Message::RndvRead {
                    rest: san_api::RemoteDescriptor {
                        addr: 0x1000,
                        len: 10,
                        rkey: san_api::RemoteKey(1),
                    },
                },
                &[],
            ),
            PeerMisbehaved::DataAfterDowngrade,
        ),
        (
            message_bytes(ctrl::Message::Fin, &[]),
            PeerMisbehaved::DataAfterDowngrade,
        ),
        (downgrade.clone(), PeerMisbehaved::UnexpectedDowngrade),
    ];
    for (late, why) in after {
        let mut session = hand_driven(ctrl::caps::DOWNGRADE);
        session
            .handle_message(
                RecvSlot(1),
                &message_bytes(ctrl::Message::Data { urgent: false }, b"early"),
            )
            .unwrap();
        session.handle_message(RecvSlot(2), &downgrade).unwrap();
        assert!(session.peer_downgraded());
        assert_eq!(
            session.send(b"x", SendFlags::default()),
            Err(SendError::Downgraded),
            "the peer's Downgrade begins ours"
        );
        assert_eq!(
            session.handle_message(RecvSlot(3), &late),
            Err(Error::PeerMisbehaved(why))
        );
        assert_eq!(session.state(), SessionState::Reset);
        let mut events = Vec::new();
        while let Some(e) = session.poll_event() {
            events.push(e);
        }
        assert_eq!(
            events[..2],
            [
                Event::PeerDowngraded,
                Event::Reset(ResetCause::PeerMisbehaved(why))
            ]
        );
        // Inline data from before the downgrade stays readable after the reset, as always.
        let mut buf = [0u8; 16];
        assert_eq!(session.recv(&mut buf, RecvFlags::default()), Ok(5));
    }
}

#[test]
fn downgrade_goes_out_with_a_control_credit_and_waits_behind_data() {
    let mut session = hand_driven(ctrl::caps::DOWNGRADE);
    session.send(&[7u8; 100], SendFlags::default()).unwrap();
    session.downgrade().unwrap();
    let mut buf = [0u8; 256];
    let mut kinds = Vec::new();
    while let Some(t) = session.poll_transmit(&mut buf) {
        kinds.push(
            ctrl::Repr::parse_bytes(&buf[..t.len])
                .unwrap()
                .message
                .kind(),
        );
    }
    assert_eq!(
        kinds,
        [ctrl::MessageType::Data, ctrl::MessageType::Downgrade],
        "queued data first, then Downgrade, then nothing"
    );
    // Not Downgraded until its send completed and the peer's Downgrade arrived.
    assert_ne!(session.state(), SessionState::Downgraded);
    assert!(!session.is_quiescent());
}

/// A full data message in a slot large enough for copy speed to matter carries a multiple of
/// 64 bytes, so a stream cut from an aligned source (a file from offset 0, a page-aligned
/// buffer) starts every message's payload at that alignment; small slots keep every byte.
#[test]
fn full_messages_of_large_slots_carry_whole_64_byte_granules() {
    for slot in [4096 + 8, 16 << 10, (16 << 10) + 63, 1 << 20] {
        let room = data_payload_room(slot);
        assert_eq!(room % 64, 0, "slot of {slot} bytes");
        assert!(room + ctrl::HEADER_LEN <= slot && slot - room - ctrl::HEADER_LEN < 64);
    }
    assert_eq!(data_payload_room(256), 256 - ctrl::HEADER_LEN);
}
