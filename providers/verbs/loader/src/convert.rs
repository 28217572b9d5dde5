//! Conversions between [`san_api`] types and their [`crate::abi`] forms, used on both sides
//! of the boundary so that each mapping is written once.

use san_api::{
    Access, Capabilities, Completion, CompletionError, CompletionKind, LocalKey, MemRange,
    PostError, RecvSlot, RegisterError, Registration, RemoteKey, SlotConfig, WrId,
};

use crate::abi::{
    capability, completion_kind, completion_status, status, AbiCapabilities, AbiCompletion,
    AbiRegistration, AbiSlotConfig,
};

/// Capabilities to their ABI form.
pub fn capabilities_to_abi(caps: &Capabilities) -> AbiCapabilities {
    let mut flags = 0;
    for (set, bit) in [
        (caps.rdma_read, capability::RDMA_READ),
        (caps.write_with_imm, capability::WRITE_WITH_IMM),
        (
            caps.read_sink_needs_remote_write,
            capability::READ_SINK_NEEDS_REMOTE_WRITE,
        ),
        (
            caps.active_side_sends_first,
            capability::ACTIVE_SIDE_SENDS_FIRST,
        ),
    ] {
        if set {
            flags |= bit;
        }
    }
    AbiCapabilities {
        flags,
        max_slot_size: caps.max_slot_size,
        max_slots: u32::from(caps.max_slots),
        max_inline: caps.max_inline,
        max_rdma_len: caps.max_rdma_len,
    }
}

/// Capabilities from their ABI form.
pub fn capabilities_from_abi(abi: &AbiCapabilities) -> Capabilities {
    Capabilities {
        rdma_read: abi.flags & capability::RDMA_READ != 0,
        write_with_imm: abi.flags & capability::WRITE_WITH_IMM != 0,
        read_sink_needs_remote_write: abi.flags & capability::READ_SINK_NEEDS_REMOTE_WRITE != 0,
        active_side_sends_first: abi.flags & capability::ACTIVE_SIDE_SENDS_FIRST != 0,
        max_slot_size: abi.max_slot_size,
        max_slots: u16::try_from(abi.max_slots).unwrap_or(u16::MAX),
        max_inline: abi.max_inline,
        max_rdma_len: abi.max_rdma_len,
    }
}

/// Slot configuration to its ABI form.
pub fn slots_to_abi(slots: SlotConfig) -> AbiSlotConfig {
    AbiSlotConfig {
        send_slots: slots.send_slots,
        recv_slots: slots.recv_slots,
        slot_size: slots.slot_size,
    }
}

/// Slot configuration from its ABI form.
pub fn slots_from_abi(abi: AbiSlotConfig) -> SlotConfig {
    SlotConfig {
        send_slots: abi.send_slots,
        recv_slots: abi.recv_slots,
        slot_size: abi.slot_size,
    }
}

/// A registration to its ABI form.
pub fn registration_to_abi(reg: &Registration) -> AbiRegistration {
    AbiRegistration {
        addr: reg.range.addr,
        len: reg.range.len,
        lkey: reg.lkey.0,
        rkey: reg.rkey.map_or(0, |key| key.0),
        access: reg.access.bits(),
        has_rkey: u8::from(reg.rkey.is_some()),
    }
}

/// A registration from its ABI form.
pub fn registration_from_abi(abi: &AbiRegistration) -> Registration {
    Registration {
        range: MemRange::new(abi.addr, abi.len),
        access: Access::from_bits_truncate(abi.access),
        lkey: LocalKey(abi.lkey),
        rkey: (abi.has_rkey != 0).then_some(RemoteKey(abi.rkey)),
    }
}

/// A completion to its ABI form.
pub fn completion_to_abi(completion: &Completion) -> AbiCompletion {
    let (kind, slot, len) = match completion.kind {
        CompletionKind::Send => (completion_kind::SEND, 0, 0),
        CompletionKind::Recv { slot, len } => (completion_kind::RECV, u32::from(slot.0), len),
        CompletionKind::Write => (completion_kind::WRITE, 0, 0),
        CompletionKind::Read => (completion_kind::READ, 0, 0),
    };
    let status = match completion.status {
        Ok(()) => completion_status::OK,
        Err(CompletionError::Flushed) => completion_status::FLUSHED,
        Err(CompletionError::RemoteAccess) => completion_status::REMOTE_ACCESS,
        Err(CompletionError::LocalProtection) => completion_status::LOCAL_PROTECTION,
        Err(CompletionError::ReceiverNotReady) => completion_status::RECEIVER_NOT_READY,
        Err(CompletionError::RetryExceeded) => completion_status::RETRY_EXCEEDED,
        Err(_) => completion_status::FATAL,
    };
    AbiCompletion {
        wr_id: completion.wr_id.0,
        kind,
        status,
        slot,
        len,
    }
}

/// A completion from its ABI form (unknown kinds or statuses read as fatal errors).
pub fn completion_from_abi(abi: &AbiCompletion) -> Completion {
    let status = match abi.status {
        completion_status::OK => Ok(()),
        completion_status::FLUSHED => Err(CompletionError::Flushed),
        completion_status::REMOTE_ACCESS => Err(CompletionError::RemoteAccess),
        completion_status::LOCAL_PROTECTION => Err(CompletionError::LocalProtection),
        completion_status::RECEIVER_NOT_READY => Err(CompletionError::ReceiverNotReady),
        completion_status::RETRY_EXCEEDED => Err(CompletionError::RetryExceeded),
        _ => Err(CompletionError::Fatal),
    };
    let (kind, status) = match abi.kind {
        completion_kind::SEND => (CompletionKind::Send, status),
        completion_kind::RECV => (
            CompletionKind::Recv {
                slot: RecvSlot(u16::try_from(abi.slot).unwrap_or(u16::MAX)),
                len: abi.len,
            },
            status,
        ),
        completion_kind::WRITE => (CompletionKind::Write, status),
        completion_kind::READ => (CompletionKind::Read, status),
        _ => (CompletionKind::Send, Err(CompletionError::Fatal)),
    };
    Completion {
        wr_id: WrId(abi.wr_id),
        kind,
        status,
    }
}

/// A registration error to its ABI status.
pub fn register_error_to_status(error: RegisterError) -> i32 {
    match error {
        RegisterError::OutOfResources => status::REGISTER_OUT_OF_RESOURCES,
        RegisterError::BadAddress => status::REGISTER_BAD_ADDRESS,
        RegisterError::UnknownKey => status::REGISTER_UNKNOWN_KEY,
        _ => status::REGISTER_UNSUPPORTED,
    }
}

/// A registration status to its error (`Ok` for [`status::OK`]).
///
/// # Errors
/// The decoded error; codes outside the registration range read as `Unsupported`.
pub fn register_status(code: i32) -> Result<(), RegisterError> {
    Err(match code {
        status::OK => return Ok(()),
        status::REGISTER_OUT_OF_RESOURCES => RegisterError::OutOfResources,
        status::REGISTER_BAD_ADDRESS => RegisterError::BadAddress,
        status::REGISTER_UNKNOWN_KEY => RegisterError::UnknownKey,
        _ => RegisterError::Unsupported,
    })
}

/// A posting error to its ABI status.
pub fn post_error_to_status(error: PostError) -> i32 {
    match error {
        PostError::QueueFull => status::POST_QUEUE_FULL,
        PostError::TooLong => status::POST_TOO_LONG,
        PostError::InvalidArgument => status::POST_INVALID_ARGUMENT,
        _ => status::POST_DISCONNECTED,
    }
}

/// A posting status to its error (`Ok` for [`status::OK`]).
///
/// # Errors
/// The decoded error; unknown codes read as `Disconnected` (the connection is unusable).
pub fn post_status(code: i32) -> Result<(), PostError> {
    Err(match code {
        status::OK => return Ok(()),
        status::POST_QUEUE_FULL => PostError::QueueFull,
        status::POST_TOO_LONG => PostError::TooLong,
        status::POST_INVALID_ARGUMENT => PostError::InvalidArgument,
        _ => PostError::Disconnected,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_round_trip_through_the_abi() {
        let samples = [
            Completion {
                wr_id: WrId(7),
                kind: CompletionKind::Send,
                status: Ok(()),
            },
            Completion {
                wr_id: WrId(u64::MAX),
                kind: CompletionKind::Recv {
                    slot: RecvSlot(65535),
                    len: 4096,
                },
                status: Ok(()),
            },
            Completion {
                wr_id: WrId(1),
                kind: CompletionKind::Write,
                status: Err(CompletionError::RemoteAccess),
            },
            Completion {
                wr_id: WrId(2),
                kind: CompletionKind::Read,
                status: Err(CompletionError::Flushed),
            },
            Completion {
                wr_id: WrId(3),
                kind: CompletionKind::Send,
                status: Err(CompletionError::RetryExceeded),
            },
            Completion {
                wr_id: WrId(4),
                kind: CompletionKind::Send,
                status: Err(CompletionError::ReceiverNotReady),
            },
            Completion {
                wr_id: WrId(5),
                kind: CompletionKind::Write,
                status: Err(CompletionError::LocalProtection),
            },
        ];
        for completion in samples {
            assert_eq!(
                completion_from_abi(&completion_to_abi(&completion)),
                completion
            );
        }
    }

    #[test]
    fn garbage_from_the_other_side_becomes_a_fatal_completion_not_a_panic() {
        let abi = AbiCompletion {
            wr_id: 9,
            kind: 77,
            status: 0,
            slot: u32::MAX,
            len: 0,
        };
        assert_eq!(
            completion_from_abi(&abi).status,
            Err(CompletionError::Fatal)
        );
        let abi = AbiCompletion {
            wr_id: 9,
            kind: completion_kind::RECV,
            status: 99,
            slot: u32::MAX,
            len: 1,
        };
        let completion = completion_from_abi(&abi);
        assert_eq!(completion.status, Err(CompletionError::Fatal));
    }

    #[test]
    fn registrations_capabilities_and_errors_round_trip() {
        let reg = Registration {
            range: MemRange::new(0x1000, 0x2000),
            access: Access::LOCAL_WRITE | Access::REMOTE_READ,
            lkey: LocalKey(5),
            rkey: Some(RemoteKey(0xdead)),
        };
        assert_eq!(registration_from_abi(&registration_to_abi(&reg)), reg);
        let local_only = Registration { rkey: None, ..reg };
        assert_eq!(
            registration_from_abi(&registration_to_abi(&local_only)),
            local_only
        );
        let caps = Capabilities {
            rdma_read: true,
            write_with_imm: false,
            read_sink_needs_remote_write: true,
            active_side_sends_first: true,
            max_slot_size: 65536,
            max_slots: 1024,
            max_inline: 0,
            max_rdma_len: 1 << 31,
        };
        assert_eq!(capabilities_from_abi(&capabilities_to_abi(&caps)), caps);
        for error in [
            RegisterError::OutOfResources,
            RegisterError::BadAddress,
            RegisterError::UnknownKey,
            RegisterError::Unsupported,
        ] {
            assert_eq!(register_status(register_error_to_status(error)), Err(error));
        }
        for error in [
            PostError::QueueFull,
            PostError::TooLong,
            PostError::InvalidArgument,
            PostError::Disconnected,
        ] {
            assert_eq!(post_status(post_error_to_status(error)), Err(error));
        }
    }
}
