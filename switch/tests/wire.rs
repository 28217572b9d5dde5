//! Wire format: golden bytes for every message, no-panic and round-trip properties, and the
//! check that `docs/PROTOCOL.md`'s tables match the `field` constants.

use proptest::prelude::*;
use san_api::{RemoteDescriptor, RemoteKey};
use switch::wire::ctrl::{self, field, Hello, Message, MessageType, Packet, Repr, HEADER_LEN};

fn emit(repr: &Repr<'_>) -> Vec<u8> {
    let mut buf = vec![0xAA; repr.buffer_len()];
    let len = repr.emit(&mut buf).expect("emit");
    assert_eq!(len, buf.len());
    buf
}

/// Emits `repr`, compares with `golden`, and parses `golden` back to `repr`.
fn golden(repr: Repr<'_>, golden: &[u8]) {
    assert_eq!(emit(&repr), golden, "emit {repr:?}");
    assert_eq!(Repr::parse_bytes(golden), Ok(repr), "parse {golden:02x?}");
}

const DESC: RemoteDescriptor = RemoteDescriptor {
    addr: 0x0102_0304_0506_0708,
    len: 0x1000,
    rkey: RemoteKey(0xCAFE_F00D),
};

#[test]
fn golden_hello() {
    golden(
        Repr {
            credits: 0,
            message: Message::Hello(Hello {
                version: 1,
                caps: ctrl::caps::RDMA_READ,
                recv_slots: 16,
                slot_size: 4096,
                rndv_threshold: 65536,
                tcp_bytes_sent: 0x1122,
            }),
            payload: &[],
        },
        &[
            1, 0, 0, 0, 0, 0, 0, 0, // header
            0, 1, 0, 1, 0, 16, 0, 0, // version, caps, recv_slots, reserved
            0, 0, 0x10, 0, 0, 1, 0, 0, // slot_size, rndv_threshold
            0, 0, 0, 0, 0, 0, 0x11, 0x22, // tcp_bytes_sent
        ],
    );
}

#[test]
fn golden_data_and_urgent_data() {
    golden(
        Repr {
            credits: 3,
            message: Message::Data { urgent: false },
            payload: b"hi",
        },
        &[2, 0, 0, 3, 0, 0, 0, 2, b'h', b'i'],
    );
    golden(
        Repr {
            credits: 0x0102,
            message: Message::Data { urgent: true },
            payload: b"!",
        },
        &[2, 1, 1, 2, 0, 0, 0, 1, b'!'],
    );
}

#[test]
fn golden_rendezvous_starts() {
    golden(
        Repr {
            credits: 1,
            message: Message::RndvRead { rest: DESC },
            payload: b"p",
        },
        &[
            3, 0, 0, 1, 0, 0, 0, 1, // header
            0, 0, 0, 0, 0, 0, 0x10, 0, // rest_len
            1, 2, 3, 4, 5, 6, 7, 8, // addr
            0xCA, 0xFE, 0xF0, 0x0D, 0, 0, 0, 0, // rkey, reserved
            b'p',
        ],
    );
    golden(
        Repr {
            credits: 0,
            message: Message::RndvWrite { rest_len: 70_000 },
            payload: &[],
        },
        &[4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0x11, 0x70],
    );
}

#[test]
fn golden_sink_avail_with_and_without_peek() {
    let body = [
        1, 2, 3, 4, 5, 6, 7, 8, // addr
        0, 0, 0, 0, 0, 0, 0x10, 0, // len
        0xCA, 0xFE, 0xF0, 0x0D, 0, 0, 0, 0, // rkey, reserved
    ];
    for (peek, flags) in [(false, 0u8), (true, 2u8)] {
        let mut bytes = vec![5, flags, 0, 9, 0, 0, 0, 0];
        bytes.extend_from_slice(&body);
        golden(
            Repr {
                credits: 9,
                message: Message::SinkAvail { sink: DESC, peek },
                payload: &[],
            },
            &bytes,
        );
    }
}

#[test]
fn golden_length_messages() {
    let len = [0, 0, 0, 0, 0, 0, 0x30, 0x39]; // 12345
    let cases = [
        (Message::WriteDone { len: 12345 }, 6u8, 0u8),
        (Message::RdmaDone { len: 12345 }, 7, 0),
        (
            Message::RndvAbort {
                consumed: 12345,
                withdraw: false,
            },
            8,
            0,
        ),
        (
            Message::RndvAbort {
                consumed: 12345,
                withdraw: true,
            },
            8,
            4,
        ),
    ];
    for (message, kind, flags) in cases {
        let mut bytes = vec![kind, flags, 0, 0, 0, 0, 0, 0];
        bytes.extend_from_slice(&len);
        golden(
            Repr {
                credits: 0,
                message,
                payload: &[],
            },
            &bytes,
        );
    }
}

#[test]
fn golden_bodiless_messages() {
    for (message, kind) in [
        (Message::CreditUpdate, 9u8),
        (Message::Fin, 10),
        (Message::Rst, 11),
        (Message::Downgrade, 12),
        (Message::RndvCancel, 13),
    ] {
        golden(
            Repr {
                credits: 7,
                message,
                payload: &[],
            },
            &[kind, 0, 0, 7, 0, 0, 0, 0],
        );
    }
}

#[test]
fn parse_rejects_what_the_protocol_forbids() {
    let reject = |bytes: &[u8], why: &str| {
        assert!(Repr::parse_bytes(bytes).is_err(), "{why}: {bytes:02x?}");
    };
    reject(&[0, 0, 0, 0, 0, 0, 0, 0], "unknown type 0");
    reject(&[14, 0, 0, 0, 0, 0, 0, 0], "unknown type 14");
    reject(&[13, 4, 0, 0, 0, 0, 0, 0], "WITHDRAW on RndvCancel");
    reject(&[12, 1, 0, 0, 0, 0, 0, 0], "URG on Downgrade");
    reject(&[12, 0, 0, 0, 0, 0, 0, 1, 0], "payload on Downgrade");
    reject(
        &[12, 0, 0, 0, 0, 0, 0, 0, 0],
        "trailing byte after Downgrade",
    );
    reject(&[10, 1, 0, 0, 0, 0, 0, 0], "URG on Fin");
    reject(&[2, 0x80, 0, 0, 0, 0, 0, 1, 0], "unknown flag");
    reject(&[2, 0, 0, 0, 0, 0, 0, 0], "empty Data");
    reject(&[10, 0, 0, 0, 0, 0, 0, 1, 0], "payload on Fin");
    reject(&[2, 0, 0, 0, 0, 0, 0, 2, 0], "payload shorter than stated");
    reject(
        &[4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        "rest_len 0",
    );
    let mut hello = emit(&Repr {
        credits: 0,
        message: Message::Hello(Hello {
            version: 1,
            caps: 0,
            recv_slots: 8,
            slot_size: 256,
            rndv_threshold: 0,
            tcp_bytes_sent: 0,
        }),
        payload: &[],
    });
    hello[field::hello::RESERVED.start] = 1;
    reject(&hello, "reserved field set");
    hello[field::hello::RESERVED.start] = 0;
    hello[field::CREDITS.end - 1] = 1;
    reject(&hello, "credits in a hello");
}

#[test]
fn golden_hello_announcing_downgrade() {
    golden(
        Repr {
            credits: 0,
            message: Message::Hello(Hello {
                version: 1,
                caps: ctrl::caps::RDMA_READ | ctrl::caps::DOWNGRADE,
                recv_slots: 8,
                slot_size: 256,
                rndv_threshold: 0,
                tcp_bytes_sent: 0,
            }),
            payload: &[],
        },
        &[
            1, 0, 0, 0, 0, 0, 0, 0, // header
            0, 1, 0, 5, 0, 8, 0, 0, // version, caps (RDMA_READ | DOWNGRADE), slots, reserved
            0, 0, 1, 0, 0, 0, 0, 0, // slot_size, rndv_threshold
            0, 0, 0, 0, 0, 0, 0, 0, // tcp_bytes_sent
        ],
    );
    assert_eq!(ctrl::caps::DOWNGRADE, 0x0004);
}

#[test]
fn unknown_capability_bits_are_ignored() {
    let mut bytes = emit(&Repr {
        credits: 0,
        message: Message::Hello(Hello {
            version: 1,
            caps: 0,
            recv_slots: 8,
            slot_size: 256,
            rndv_threshold: 0,
            tcp_bytes_sent: 0,
        }),
        payload: &[],
    });
    bytes[field::hello::CAPS.start] = 0x80;
    let Message::Hello(hello) = Repr::parse_bytes(&bytes).unwrap().message else {
        panic!("not a hello");
    };
    assert_eq!(hello.caps, 0x8000);
}

// ------------------------------------------------------------------ properties

fn arb_descriptor() -> impl Strategy<Value = RemoteDescriptor> {
    (any::<u64>(), 1..u64::MAX, any::<u32>()).prop_map(|(addr, len, rkey)| RemoteDescriptor {
        addr,
        len,
        rkey: RemoteKey(rkey),
    })
}

fn arb_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (
            any::<u16>(),
            any::<u16>(),
            any::<u16>(),
            any::<u32>(),
            any::<u32>(),
            any::<u64>()
        )
            .prop_map(
                |(version, caps, recv_slots, slot_size, rndv_threshold, tcp)| {
                    Message::Hello(Hello {
                        version,
                        caps,
                        recv_slots,
                        slot_size,
                        rndv_threshold,
                        tcp_bytes_sent: tcp,
                    })
                }
            ),
        any::<bool>().prop_map(|urgent| Message::Data { urgent }),
        arb_descriptor().prop_map(|rest| Message::RndvRead { rest }),
        (1..u64::MAX).prop_map(|rest_len| Message::RndvWrite { rest_len }),
        (arb_descriptor(), any::<bool>())
            .prop_map(|(sink, peek)| Message::SinkAvail { sink, peek }),
        any::<u64>().prop_map(|len| Message::WriteDone { len }),
        any::<u64>().prop_map(|len| Message::RdmaDone { len }),
        (any::<u64>(), any::<bool>())
            .prop_map(|(consumed, withdraw)| Message::RndvAbort { consumed, withdraw }),
        Just(Message::CreditUpdate),
        Just(Message::Fin),
        Just(Message::Rst),
        Just(Message::Downgrade),
        Just(Message::RndvCancel),
    ]
}

proptest! {
    #[test]
    fn new_checked_and_parse_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
        if let Ok(packet) = Packet::new_checked(&bytes[..]) {
            // Every accessor is safe after new_checked.
            let _ = (packet.kind(), packet.flags(), packet.credits(), packet.payload_len());
            prop_assert_eq!(
                packet.payload().len(),
                packet.payload_len() as usize
            );
        }
        let _ = Repr::parse_bytes(&bytes);
    }

    #[test]
    fn parse_of_emit_is_identity(
        message in arb_message(),
        credits in any::<u16>(),
        payload in proptest::collection::vec(any::<u8>(), 0..64),
    ) {
        let kind = message.kind();
        let payload: &[u8] = if kind.carries_payload() { &payload } else { &[] };
        let payload = if matches!(message, Message::Data { .. }) && payload.is_empty() {
            &b"x"[..]
        } else {
            payload
        };
        let credits = if kind == MessageType::Hello { 0 } else { credits };
        let repr = Repr { credits, message, payload };
        let bytes = emit(&repr);
        prop_assert_eq!(bytes.len(), HEADER_LEN + kind.body_len() + payload.len());
        prop_assert_eq!(Repr::parse_bytes(&bytes), Ok(repr));
    }

    #[test]
    fn emit_never_panics_on_short_buffers(message in arb_message(), len in 0usize..40) {
        let repr = Repr { credits: 0, message, payload: &[] };
        let mut buf = vec![0u8; len];
        let _ = repr.emit(&mut buf);
    }
}

// ------------------------------------------------------------------ doc table

/// Parses the `| Offset | Size | Field | … |` tables of PROTOCOL.md, keyed by the heading
/// above each table.
fn doc_tables() -> Vec<(String, String, usize, usize)> {
    let doc = include_str!("../../docs/PROTOCOL.md");
    let mut heading = String::new();
    let mut rows = Vec::new();
    for line in doc.lines() {
        if let Some(h) = line.strip_prefix("### ") {
            heading = h.trim().to_string();
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 5 || !line.starts_with('|') {
            continue;
        }
        let (Ok(offset), Ok(size)) = (cells[1].parse::<usize>(), cells[2].parse::<usize>()) else {
            continue;
        };
        rows.push((heading.clone(), cells[3].to_string(), offset, size));
    }
    rows
}

#[test]
fn protocol_md_tables_match_the_code() {
    use field::*;
    let expected: Vec<(&str, &str, Field)> = vec![
        ("Header", "kind", KIND..KIND + 1),
        ("Header", "flags", FLAGS..FLAGS + 1),
        ("Header", "credits", CREDITS),
        ("Header", "payload_len", PAYLOAD_LEN),
        ("Body of Hello", "version", hello::VERSION),
        ("Body of Hello", "caps", hello::CAPS),
        ("Body of Hello", "recv_slots", hello::RECV_SLOTS),
        ("Body of Hello", "reserved", hello::RESERVED),
        ("Body of Hello", "slot_size", hello::SLOT_SIZE),
        ("Body of Hello", "rndv_threshold", hello::RNDV_THRESHOLD),
        ("Body of Hello", "tcp_bytes_sent", hello::TCP_BYTES_SENT),
        ("Body of RndvRead", "rest_len", rndv_read::REST_LEN),
        ("Body of RndvRead", "addr", rndv_read::ADDR),
        ("Body of RndvRead", "rkey", rndv_read::RKEY),
        ("Body of RndvRead", "reserved", rndv_read::RESERVED),
        ("Body of RndvWrite", "rest_len", rndv_write::REST_LEN),
        ("Body of SinkAvail", "addr", sink_avail::ADDR),
        ("Body of SinkAvail", "len", sink_avail::LEN),
        ("Body of SinkAvail", "rkey", sink_avail::RKEY),
        ("Body of SinkAvail", "reserved", sink_avail::RESERVED),
        (
            "Body of WriteDone, RdmaDone and RndvAbort",
            "len",
            length::LEN,
        ),
    ];
    let rows = doc_tables();
    assert_eq!(rows.len(), expected.len(), "doc rows: {rows:#?}");
    for (heading, name, range) in &expected {
        let row = rows
            .iter()
            .find(|(h, n, _, _)| h == heading && n == name)
            .unwrap_or_else(|| panic!("PROTOCOL.md lacks {heading} / {name}"));
        assert_eq!(
            (row.2, row.3),
            (range.start, range.len()),
            "{heading} / {name}"
        );
    }
    // Header length and per-type body lengths (the type table).
    assert_eq!(HEADER_LEN, 8);
    let doc = include_str!("../../docs/PROTOCOL.md");
    let mut types_seen = 0;
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 5 {
            continue;
        }
        let (Ok(value), Ok(body)) = (cells[2].parse::<u8>(), cells[3].parse::<usize>()) else {
            continue;
        };
        let kind = MessageType::from_byte(value).expect("documented type exists");
        assert_eq!(format!("{kind:?}"), cells[1], "type {value}");
        assert_eq!(kind.body_len(), body, "body of {}", cells[1]);
        types_seen += 1;
    }
    assert_eq!(types_seen, 13, "every type is documented");
    // Body fields end within their type's body.
    for (heading, _, range) in &expected {
        if let Some(name) = heading.strip_prefix("Body of ") {
            let first = name.split([',', ' ']).next().unwrap();
            let kind = (1..=13)
                .filter_map(MessageType::from_byte)
                .find(|k| format!("{k:?}") == first)
                .unwrap();
            assert!(range.end <= HEADER_LEN + kind.body_len(), "{heading}");
        }
    }
}
