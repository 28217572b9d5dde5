//! # Wire format of the sandirect session protocol, version 1
//!
//! `docs/PROTOCOL.md` describes every byte; this module is the single source of truth for the
//! layout (the offsets live only in [`ctrl::field`], and a test parses the table in
//! `PROTOCOL.md` and compares it with these constants, so the two cannot drift).
//!
//! The shape follows smoltcp: [`ctrl::Packet`] is a typed view over a byte buffer
//! (`Packet<T: AsRef<[u8]>>`) with field accessors, and [`ctrl::Repr`] is the parsed,
//! validated, high-level form with [`ctrl::Repr::parse`], [`ctrl::Repr::emit`] and
//! [`ctrl::Repr::buffer_len`].
//!
//! ## No-panic contract
//! * [`ctrl::Packet::new_checked`] never panics, whatever the bytes; after it returned `Ok`,
//!   no accessor of that packet panics.
//! * Accessors of a packet made with [`ctrl::Packet::new_unchecked`] may panic when the buffer
//!   is shorter than the fields they read (smoltcp's contract); the session never uses them
//!   on peer bytes.
//! * [`ctrl::Repr::parse`] never panics and rejects everything the protocol does not allow
//!   (unknown type, unknown flag, reserved field not zero, length mismatch, payload on a
//!   message that carries none, …) with [`Error`].
//! * [`ctrl::Repr::emit`] never panics: a buffer that is too short is an error.
//!
//! All multi-byte integers are big-endian (network order).

use core::fmt;

/// The only error of the wire layer: the bytes are not a valid control message. The session
/// turns it into [`crate::error::PeerMisbehaved::MalformedMessage`]; which field was wrong
/// is of no use to a peer that sends garbage, so it is not kept (smoltcp's choice).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Error;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("malformed control message")
    }
}

/// Result of wire-layer operations.
pub type Result<T> = core::result::Result<T, Error>;

/// The protocol version carried in `Hello` ("sandirect session protocol, version 1").
pub const PROTOCOL_VERSION: u16 = 1;

/// Control messages: header, type-specific body, optional inline payload.
pub mod ctrl {
    use super::{Error, Result};
    use san_api::{RemoteDescriptor, RemoteKey};

    /// Byte offsets of every field. Absolute offsets from the start of the message; body
    /// fields start at [`field::BODY`]. `PROTOCOL.md` has the same table (checked by a test).
    pub mod field {
        /// A byte range inside the message.
        pub type Field = core::ops::Range<usize>;

        /// Message type, one byte ([`super::MessageType`]).
        pub const KIND: usize = 0;
        /// Flags, one byte ([`super::flags`]).
        pub const FLAGS: usize = 1;
        /// Credits returned to the receiver of this message, u16.
        pub const CREDITS: Field = 2..4;
        /// Length of the inline payload that follows the body, u32.
        pub const PAYLOAD_LEN: Field = 4..8;
        /// First byte of the type-specific body.
        pub const BODY: usize = 8;

        /// Body of `Hello`.
        pub mod hello {
            use super::Field;
            /// Protocol version, u16.
            pub const VERSION: Field = 8..10;
            /// Capability bits, u16 ([`super::super::caps`]).
            pub const CAPS: Field = 10..12;
            /// Receive slots the sender of the hello has posted, u16.
            pub const RECV_SLOTS: Field = 12..14;
            /// Must be zero.
            pub const RESERVED: Field = 14..16;
            /// Size of each receive slot in bytes, u32.
            pub const SLOT_SIZE: Field = 16..20;
            /// Rendezvous threshold the sender prefers, u32.
            pub const RNDV_THRESHOLD: Field = 20..24;
            /// Bytes of the stream the sender already sent over kernel TCP, u64.
            pub const TCP_BYTES_SENT: Field = 24..32;
        }

        /// Body of `RndvRead` (READ-mode rendezvous start).
        pub mod rndv_read {
            use super::Field;
            /// Length of the part of the send that is not inline, u64.
            pub const REST_LEN: Field = 8..16;
            /// Address of the rest in the sender's address space, u64.
            pub const ADDR: Field = 16..24;
            /// Remote key the receiver presents to read it, u32.
            pub const RKEY: Field = 24..28;
            /// Must be zero.
            pub const RESERVED: Field = 28..32;
        }

        /// Body of `RndvWrite` (WRITE-mode rendezvous start).
        pub mod rndv_write {
            use super::Field;
            /// Length of the part of the send that is not inline, u64.
            pub const REST_LEN: Field = 8..16;
        }

        /// Body of `SinkAvail` (WRITE mode: the receiver's buffer).
        pub mod sink_avail {
            use super::Field;
            /// Address of the sink in the receiver's address space, u64.
            pub const ADDR: Field = 8..16;
            /// Length of the sink, u64.
            pub const LEN: Field = 16..24;
            /// Remote key the sender presents to write it, u32.
            pub const RKEY: Field = 24..28;
            /// Must be zero.
            pub const RESERVED: Field = 28..32;
        }

        /// Body of `WriteDone`, `RdmaDone` and `RndvAbort`: one length.
        pub mod length {
            use super::Field;
            /// Bytes written (`WriteDone`), read in total (`RdmaDone`) or consumed before the
            /// abort (`RndvAbort`), u64.
            pub const LEN: Field = 8..16;
        }
    }

    /// Length of the fixed header common to all messages.
    pub const HEADER_LEN: usize = field::BODY;

    /// Flag bits of the header's `flags` byte.
    pub mod flags {
        /// `Data` only: the last payload byte is urgent (the urgent mark).
        pub const URG: u8 = 0x01;
        /// `SinkAvail` only: the receiver peeks; the sender writes without advancing.
        pub const PEEK: u8 = 0x02;
        /// `RndvAbort` only: sent by the data's sender (it withdraws the rest); without it
        /// the receiver sent it (it stops reading the rest).
        pub const WITHDRAW: u8 = 0x04;
    }

    /// Capability bits of `Hello`. Unknown bits are ignored (a later version may add some).
    pub mod caps {
        /// The sender of the hello can RDMA-read (so data flowing to it uses READ mode).
        pub const RDMA_READ: u16 = 0x0001;
        /// The sender's provider supports RDMA write with immediate data.
        pub const WRITE_WITH_IMM: u16 = 0x0002;
        /// The sender of the hello understands `Downgrade` (live move of the stream back to
        /// kernel TCP). Older peers ignore the bit, so announcing it is always compatible.
        pub const DOWNGRADE: u16 = 0x0004;
        /// The sender of the hello understands `RndvCancel` (a rendezvous sender asking to
        /// end its rendezvous early). Sent only to peers that announce it.
        pub const CANCEL: u16 = 0x0008;
    }

    /// The message types of version 1.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    #[non_exhaustive]
    pub enum MessageType {
        /// Negotiation, first message of each side.
        Hello = 1,
        /// Inline application data.
        Data = 2,
        /// Rendezvous start, READ mode (carries the descriptor of the rest).
        RndvRead = 3,
        /// Rendezvous start, WRITE mode (announces the length of the rest).
        RndvWrite = 4,
        /// WRITE mode: the receiver's sink is ready.
        SinkAvail = 5,
        /// WRITE mode: the sender wrote the sink.
        WriteDone = 6,
        /// READ mode: the receiver read all of the rest.
        RdmaDone = 7,
        /// Either mode: the rendezvous ends early.
        RndvAbort = 8,
        /// Explicit credit return.
        CreditUpdate = 9,
        /// No more data from the sender (after all data before it).
        Fin = 10,
        /// Abortive close.
        Rst = 11,
        /// The rest of the sender's stream goes over kernel TCP (after all data before it).
        Downgrade = 12,
        /// Either mode: the rendezvous sender asks the receiver to end the rendezvous with
        /// what it consumed (its application's send was interrupted by a signal).
        RndvCancel = 13,
    }

    impl MessageType {
        /// The type for a wire byte, if known.
        pub const fn from_byte(byte: u8) -> Option<MessageType> {
            Some(match byte {
                1 => MessageType::Hello,
                2 => MessageType::Data,
                3 => MessageType::RndvRead,
                4 => MessageType::RndvWrite,
                5 => MessageType::SinkAvail,
                6 => MessageType::WriteDone,
                7 => MessageType::RdmaDone,
                8 => MessageType::RndvAbort,
                9 => MessageType::CreditUpdate,
                10 => MessageType::Fin,
                11 => MessageType::Rst,
                12 => MessageType::Downgrade,
                13 => MessageType::RndvCancel,
                _ => return None,
            })
        }

        /// Length of this type's body.
        pub const fn body_len(self) -> usize {
            match self {
                MessageType::Hello => 24,
                MessageType::RndvRead => 24,
                MessageType::SinkAvail => 24,
                MessageType::RndvWrite
                | MessageType::WriteDone
                | MessageType::RdmaDone
                | MessageType::RndvAbort => 8,
                MessageType::Data
                | MessageType::CreditUpdate
                | MessageType::Fin
                | MessageType::Rst
                | MessageType::Downgrade
                | MessageType::RndvCancel => 0,
            }
        }

        /// Flags this type may carry.
        pub const fn allowed_flags(self) -> u8 {
            match self {
                MessageType::Data => flags::URG,
                MessageType::SinkAvail => flags::PEEK,
                MessageType::RndvAbort => flags::WITHDRAW,
                _ => 0,
            }
        }

        /// True for the types that may carry an inline payload (application data).
        pub const fn carries_payload(self) -> bool {
            matches!(
                self,
                MessageType::Data | MessageType::RndvRead | MessageType::RndvWrite
            )
        }
    }

    /// Length of the largest body of any type (sizing rule for slots).
    pub const MAX_BODY_LEN: usize = 24;

    /// A read/write view of a control message in a byte buffer.
    #[derive(Debug, Clone)]
    pub struct Packet<T: AsRef<[u8]>> {
        buffer: T,
    }

    fn get_u16(bytes: &[u8], field: field::Field) -> u16 {
        let mut raw = [0u8; 2];
        raw.copy_from_slice(&bytes[field]);
        u16::from_be_bytes(raw)
    }

    fn get_u32(bytes: &[u8], field: field::Field) -> u32 {
        let mut raw = [0u8; 4];
        raw.copy_from_slice(&bytes[field]);
        u32::from_be_bytes(raw)
    }

    fn get_u64(bytes: &[u8], field: field::Field) -> u64 {
        let mut raw = [0u8; 8];
        raw.copy_from_slice(&bytes[field]);
        u64::from_be_bytes(raw)
    }

    impl<T: AsRef<[u8]>> Packet<T> {
        /// Wraps a buffer without checking it (accessors may panic on short buffers).
        pub const fn new_unchecked(buffer: T) -> Packet<T> {
            Packet { buffer }
        }

        /// Wraps a buffer after [`Packet::check_len`]. Never panics.
        pub fn new_checked(buffer: T) -> Result<Packet<T>> {
            let packet = Self::new_unchecked(buffer);
            packet.check_len()?;
            Ok(packet)
        }

        /// Checks that the buffer holds exactly one message of a known type: header, the
        /// type's body and `payload_len` bytes. Once this returned `Ok`, no accessor panics.
        pub fn check_len(&self) -> Result<()> {
            let bytes = self.buffer.as_ref();
            if bytes.len() < HEADER_LEN {
                return Err(Error);
            }
            let kind = MessageType::from_byte(bytes[field::KIND]).ok_or(Error)?;
            let expected = (HEADER_LEN + kind.body_len())
                .checked_add(get_u32(bytes, field::PAYLOAD_LEN) as usize)
                .ok_or(Error)?;
            if bytes.len() != expected {
                return Err(Error);
            }
            Ok(())
        }

        /// Gives the buffer back.
        pub fn into_inner(self) -> T {
            self.buffer
        }

        /// The raw type byte.
        pub fn kind_byte(&self) -> u8 {
            self.buffer.as_ref()[field::KIND]
        }

        /// The message type (`None` only for unchecked packets with an unknown type).
        pub fn kind(&self) -> Option<MessageType> {
            MessageType::from_byte(self.kind_byte())
        }

        /// The flags byte.
        pub fn flags(&self) -> u8 {
            self.buffer.as_ref()[field::FLAGS]
        }

        /// Credits returned by this message.
        pub fn credits(&self) -> u16 {
            get_u16(self.buffer.as_ref(), field::CREDITS)
        }

        /// Inline payload length as stated in the header.
        pub fn payload_len(&self) -> u32 {
            get_u32(self.buffer.as_ref(), field::PAYLOAD_LEN)
        }

        /// A u16 body field (use the constants of [`field`]).
        pub fn body_u16(&self, f: field::Field) -> u16 {
            get_u16(self.buffer.as_ref(), f)
        }

        /// A u32 body field.
        pub fn body_u32(&self, f: field::Field) -> u32 {
            get_u32(self.buffer.as_ref(), f)
        }

        /// A u64 body field.
        pub fn body_u64(&self, f: field::Field) -> u64 {
            get_u64(self.buffer.as_ref(), f)
        }

        /// The inline payload (after the body).
        pub fn payload(&self) -> &[u8] {
            let bytes = self.buffer.as_ref();
            let start = HEADER_LEN + self.kind().map_or(0, MessageType::body_len);
            bytes.get(start..).unwrap_or(&[])
        }
    }

    impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
        fn bytes_mut(&mut self) -> &mut [u8] {
            self.buffer.as_mut()
        }

        /// Sets the type byte.
        pub fn set_kind(&mut self, kind: MessageType) {
            self.bytes_mut()[field::KIND] = kind as u8;
        }

        /// Sets the flags byte.
        pub fn set_flags(&mut self, value: u8) {
            self.bytes_mut()[field::FLAGS] = value;
        }

        /// Sets the credits returned.
        pub fn set_credits(&mut self, value: u16) {
            self.bytes_mut()[field::CREDITS].copy_from_slice(&value.to_be_bytes());
        }

        /// Sets the payload length.
        pub fn set_payload_len(&mut self, value: u32) {
            self.bytes_mut()[field::PAYLOAD_LEN].copy_from_slice(&value.to_be_bytes());
        }

        /// Sets a u16 body field.
        pub fn set_body_u16(&mut self, f: field::Field, value: u16) {
            self.bytes_mut()[f].copy_from_slice(&value.to_be_bytes());
        }

        /// Sets a u32 body field.
        pub fn set_body_u32(&mut self, f: field::Field, value: u32) {
            self.bytes_mut()[f].copy_from_slice(&value.to_be_bytes());
        }

        /// Sets a u64 body field.
        pub fn set_body_u64(&mut self, f: field::Field, value: u64) {
            self.bytes_mut()[f].copy_from_slice(&value.to_be_bytes());
        }
    }

    /// The parsed `Hello` body.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Hello {
        /// Protocol version of the sender.
        pub version: u16,
        /// Capability bits ([`caps`]).
        pub caps: u16,
        /// Receive slots the sender has posted.
        pub recv_slots: u16,
        /// Size of each of those slots.
        pub slot_size: u32,
        /// Rendezvous threshold the sender prefers.
        pub rndv_threshold: u32,
        /// Bytes the sender already sent over kernel TCP.
        pub tcp_bytes_sent: u64,
    }

    /// What a message says, by type.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    #[non_exhaustive]
    pub enum Message {
        /// Negotiation.
        Hello(Hello),
        /// Inline data; `urgent`: the last payload byte is the urgent byte.
        Data {
            /// The URG flag.
            urgent: bool,
        },
        /// READ-mode rendezvous start; the payload is the inline prefix.
        RndvRead {
            /// Where the receiver reads the rest (its `len` is the rest's length).
            rest: RemoteDescriptor,
        },
        /// WRITE-mode rendezvous start; the payload is the inline prefix.
        RndvWrite {
            /// Length of the rest.
            rest_len: u64,
        },
        /// WRITE mode: the receiver's sink.
        SinkAvail {
            /// Where the sender writes.
            sink: RemoteDescriptor,
            /// The receiver peeks: write, but do not advance the rendezvous.
            peek: bool,
        },
        /// WRITE mode: `len` bytes were written into the last sink.
        WriteDone {
            /// Bytes written.
            len: u64,
        },
        /// READ mode: all `len` bytes of the rest were read.
        RdmaDone {
            /// Bytes read in total (the rest's length).
            len: u64,
        },
        /// The rendezvous ends after `consumed` bytes of the rest.
        RndvAbort {
            /// Bytes of the rest delivered to the receiving application.
            consumed: u64,
            /// Sent by the data's sender (the `WITHDRAW` flag).
            withdraw: bool,
        },
        /// Credits only.
        CreditUpdate,
        /// End of the sender's stream.
        Fin,
        /// Abortive close.
        Rst,
        /// The sender's stream continues on kernel TCP.
        Downgrade,
        /// The rendezvous sender asks the receiver to end the rendezvous.
        RndvCancel,
    }

    impl Message {
        /// The wire type of this message.
        pub const fn kind(&self) -> MessageType {
            match self {
                Message::Hello(_) => MessageType::Hello,
                Message::Data { .. } => MessageType::Data,
                Message::RndvRead { .. } => MessageType::RndvRead,
                Message::RndvWrite { .. } => MessageType::RndvWrite,
                Message::SinkAvail { .. } => MessageType::SinkAvail,
                Message::WriteDone { .. } => MessageType::WriteDone,
                Message::RdmaDone { .. } => MessageType::RdmaDone,
                Message::RndvAbort { .. } => MessageType::RndvAbort,
                Message::CreditUpdate => MessageType::CreditUpdate,
                Message::Fin => MessageType::Fin,
                Message::Rst => MessageType::Rst,
                Message::Downgrade => MessageType::Downgrade,
                Message::RndvCancel => MessageType::RndvCancel,
            }
        }
    }

    /// A validated control message.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Repr<'a> {
        /// Credits returned to the receiver of this message (0 in `Hello`).
        pub credits: u16,
        /// Type and body.
        pub message: Message,
        /// Inline application data (only `Data`, `RndvRead`, `RndvWrite`).
        pub payload: &'a [u8],
    }

    impl<'a> Repr<'a> {
        /// Parses and validates a checked packet. Never panics.
        pub fn parse(packet: &Packet<&'a [u8]>) -> Result<Repr<'a>> {
            packet.check_len()?;
            let kind = packet.kind().ok_or(Error)?;
            let flag_bits = packet.flags();
            if flag_bits & !kind.allowed_flags() != 0 {
                return Err(Error);
            }
            let bytes: &'a [u8] = packet.buffer;
            let payload = bytes.get(HEADER_LEN + kind.body_len()..).ok_or(Error)?;
            if !kind.carries_payload() && !payload.is_empty() {
                return Err(Error);
            }
            let credits = packet.credits();
            let message = match kind {
                MessageType::Hello => {
                    if credits != 0 || packet.body_u16(field::hello::RESERVED) != 0 {
                        return Err(Error);
                    }
                    Message::Hello(Hello {
                        version: packet.body_u16(field::hello::VERSION),
                        caps: packet.body_u16(field::hello::CAPS),
                        recv_slots: packet.body_u16(field::hello::RECV_SLOTS),
                        slot_size: packet.body_u32(field::hello::SLOT_SIZE),
                        rndv_threshold: packet.body_u32(field::hello::RNDV_THRESHOLD),
                        tcp_bytes_sent: packet.body_u64(field::hello::TCP_BYTES_SENT),
                    })
                }
                MessageType::Data => {
                    // Zero-length sends produce no message, so an empty Data is a bug.
                    if payload.is_empty() {
                        return Err(Error);
                    }
                    Message::Data {
                        urgent: flag_bits & flags::URG != 0,
                    }
                }
                MessageType::RndvRead => {
                    let len = packet.body_u64(field::rndv_read::REST_LEN);
                    if len == 0 || packet.body_u32(field::rndv_read::RESERVED) != 0 {
                        return Err(Error);
                    }
                    Message::RndvRead {
                        rest: RemoteDescriptor {
                            addr: packet.body_u64(field::rndv_read::ADDR),
                            len,
                            rkey: RemoteKey(packet.body_u32(field::rndv_read::RKEY)),
                        },
                    }
                }
                MessageType::RndvWrite => {
                    let rest_len = packet.body_u64(field::rndv_write::REST_LEN);
                    if rest_len == 0 {
                        return Err(Error);
                    }
                    Message::RndvWrite { rest_len }
                }
                MessageType::SinkAvail => {
                    let len = packet.body_u64(field::sink_avail::LEN);
                    if len == 0 || packet.body_u32(field::sink_avail::RESERVED) != 0 {
                        return Err(Error);
                    }
                    Message::SinkAvail {
                        sink: RemoteDescriptor {
                            addr: packet.body_u64(field::sink_avail::ADDR),
                            len,
                            rkey: RemoteKey(packet.body_u32(field::sink_avail::RKEY)),
                        },
                        peek: flag_bits & flags::PEEK != 0,
                    }
                }
                MessageType::WriteDone => Message::WriteDone {
                    len: packet.body_u64(field::length::LEN),
                },
                MessageType::RdmaDone => Message::RdmaDone {
                    len: packet.body_u64(field::length::LEN),
                },
                MessageType::RndvAbort => Message::RndvAbort {
                    consumed: packet.body_u64(field::length::LEN),
                    withdraw: flag_bits & flags::WITHDRAW != 0,
                },
                MessageType::CreditUpdate => Message::CreditUpdate,
                MessageType::Fin => Message::Fin,
                MessageType::Rst => Message::Rst,
                MessageType::Downgrade => Message::Downgrade,
                MessageType::RndvCancel => Message::RndvCancel,
            };
            Ok(Repr {
                credits,
                message,
                payload,
            })
        }

        /// Parses raw bytes (convenience for [`Packet::new_checked`] + [`Repr::parse`]).
        pub fn parse_bytes(bytes: &'a [u8]) -> Result<Repr<'a>> {
            Repr::parse(&Packet::new_checked(bytes)?)
        }

        /// Bytes needed to emit this message.
        pub fn buffer_len(&self) -> usize {
            HEADER_LEN + self.message.kind().body_len() + self.payload.len()
        }

        /// Writes the message into the front of `buf`; returns its length. Fails (never
        /// panics) when `buf` is too short, the payload does not fit a u32, or the message is
        /// one [`Repr::parse`] would reject.
        pub fn emit(&self, buf: &mut [u8]) -> Result<usize> {
            let len = self.buffer_len();
            if buf.len() < len {
                return Err(Error);
            }
            let body_end = self.emit_header(buf)?;
            buf[body_end..len].copy_from_slice(self.payload);
            Ok(len)
        }

        /// Writes everything of the message but its payload (header and body) into the front
        /// of `buf`; returns their length. The payload belongs right after them: a sender that
        /// copies it straight from where it lies uses this instead of [`Repr::emit`]. Fails
        /// as `emit` does (but needs room for the header and body only).
        pub fn emit_header(&self, buf: &mut [u8]) -> Result<usize> {
            self.emit_header_for(buf, self.payload.len())
        }

        /// [`Repr::emit_header`] of the message carrying a payload of `payload_len` bytes
        /// (this `Repr`'s own payload is not looked at): for a sender that copies the payload
        /// from where it lies only after the header is written.
        pub fn emit_header_for(&self, buf: &mut [u8], payload_len: usize) -> Result<usize> {
            let kind = self.message.kind();
            let len = HEADER_LEN + kind.body_len();
            let payload_len32 = u32::try_from(payload_len).map_err(|_| Error)?;
            if buf.len() < len || (!kind.carries_payload() && payload_len != 0) {
                return Err(Error);
            }
            let out = &mut buf[..len];
            out.fill(0);
            let mut packet = Packet::new_unchecked(&mut *out);
            packet.set_kind(kind);
            packet.set_credits(self.credits);
            packet.set_payload_len(payload_len32);
            let mut flag_bits = 0;
            match self.message {
                Message::Hello(hello) => {
                    if self.credits != 0 {
                        return Err(Error);
                    }
                    packet.set_body_u16(field::hello::VERSION, hello.version);
                    packet.set_body_u16(field::hello::CAPS, hello.caps);
                    packet.set_body_u16(field::hello::RECV_SLOTS, hello.recv_slots);
                    packet.set_body_u32(field::hello::SLOT_SIZE, hello.slot_size);
                    packet.set_body_u32(field::hello::RNDV_THRESHOLD, hello.rndv_threshold);
                    packet.set_body_u64(field::hello::TCP_BYTES_SENT, hello.tcp_bytes_sent);
                }
                Message::Data { urgent } => {
                    if payload_len == 0 {
                        return Err(Error);
                    }
                    if urgent {
                        flag_bits |= flags::URG;
                    }
                }
                Message::RndvRead { rest } => {
                    if rest.len == 0 {
                        return Err(Error);
                    }
                    packet.set_body_u64(field::rndv_read::REST_LEN, rest.len);
                    packet.set_body_u64(field::rndv_read::ADDR, rest.addr);
                    packet.set_body_u32(field::rndv_read::RKEY, rest.rkey.0);
                }
                Message::RndvWrite { rest_len } => {
                    if rest_len == 0 {
                        return Err(Error);
                    }
                    packet.set_body_u64(field::rndv_write::REST_LEN, rest_len);
                }
                Message::SinkAvail { sink, peek } => {
                    if sink.len == 0 {
                        return Err(Error);
                    }
                    packet.set_body_u64(field::sink_avail::ADDR, sink.addr);
                    packet.set_body_u64(field::sink_avail::LEN, sink.len);
                    packet.set_body_u32(field::sink_avail::RKEY, sink.rkey.0);
                    if peek {
                        flag_bits |= flags::PEEK;
                    }
                }
                Message::WriteDone { len: value } | Message::RdmaDone { len: value } => {
                    packet.set_body_u64(field::length::LEN, value);
                }
                Message::RndvAbort { consumed, withdraw } => {
                    packet.set_body_u64(field::length::LEN, consumed);
                    if withdraw {
                        flag_bits |= flags::WITHDRAW;
                    }
                }
                Message::CreditUpdate
                | Message::Fin
                | Message::Rst
                | Message::Downgrade
                | Message::RndvCancel => {}
            }
            packet.set_flags(flag_bits);
            Ok(len)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ctrl::*;
    use san_api::{RemoteDescriptor, RemoteKey};

    #[test]
    fn truncated_and_overlong_buffers_are_rejected() {
        let repr = Repr {
            credits: 3,
            message: Message::Data { urgent: false },
            payload: b"abc",
        };
        let mut buf = [0u8; 64];
        let len = repr.emit(&mut buf).unwrap();
        assert_eq!(Repr::parse_bytes(&buf[..len]).unwrap(), repr);
        for short in 0..len {
            assert!(Repr::parse_bytes(&buf[..short]).is_err(), "{short} bytes");
        }
        assert!(Repr::parse_bytes(&buf[..len + 1]).is_err());
    }

    #[test]
    fn emit_refuses_short_buffers_and_invalid_messages() {
        let repr = Repr {
            credits: 0,
            message: Message::SinkAvail {
                sink: RemoteDescriptor {
                    addr: 1,
                    len: 2,
                    rkey: RemoteKey(3),
                },
                peek: true,
            },
            payload: &[],
        };
        let mut buf = [0u8; 31];
        assert!(repr.emit(&mut buf).is_err());
        let fin_with_payload = Repr {
            credits: 0,
            message: Message::Fin,
            payload: b"x",
        };
        assert!(fin_with_payload.emit(&mut [0u8; 64]).is_err());
        let empty_data = Repr {
            credits: 0,
            message: Message::Data { urgent: false },
            payload: &[],
        };
        assert!(empty_data.emit(&mut [0u8; 64]).is_err());
    }
}
