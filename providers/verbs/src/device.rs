//! RDMA devices as librdmacm sees them, and their capabilities (read once).

use std::ffi::CStr;
use std::ptr::NonNull;

use rdma_sys::{
    ___ibv_query_port, ibv_context, ibv_device_attr, ibv_port_attr, ibv_query_device,
    ibv_transport_type, rdma_free_devices, rdma_get_devices,
};
use san_api::Capabilities;

use crate::sys::errno;
use crate::VerbsSetupError;

/// Largest control buffer we allocate per slot (control messages are small; this only
/// bounds a caller's mistake).
const MAX_SLOT_SIZE: u32 = 1 << 20;
/// Largest slot count per pool.
const MAX_SLOTS: u16 = 4096;
/// RDMA READs we keep in flight at once (the initiator depth we ask for). With large READs
/// split into parts (`connection::READ_PART`), this bounds the READ responses the peer sends
/// back to back: a responder does not pace them as a requester paces writes (soft-RoCE on
/// a veth pair dropped the tail of a 1 MiB burst, and each loss cost a retransmission
/// timeout: 330 ms per MiB against 30 ms for RDMA WRITE). Two parts in flight keep the
/// pipe full on hardware (2 × 256 KiB covers a 100 Gb/s link's bandwidth-delay product).
const READS_IN_FLIGHT: i32 = 2;

/// One device context opened by librdmacm. librdmacm opens every device once per process
/// and keeps the contexts for the life of the process, so the pointer never dangles and
/// the context is never closed here; rdma_cm ids report the same pointers in `verbs`.
#[derive(Clone, Debug)]
pub(crate) struct Device {
    pub(crate) context: NonNull<ibv_context>,
    pub(crate) name: String,
    pub(crate) iwarp: bool,
    pub(crate) capabilities: Capabilities,
    /// RDMA read/atomic depth as responder and as initiator (for connection parameters).
    pub(crate) max_responder_resources: u8,
    pub(crate) max_initiator_depth: u8,
    pub(crate) max_mr_size: u64,
    /// Work requests a queue pair's send or receive queue may hold.
    pub(crate) max_qp_wr: u32,
}

// SAFETY: an ibv_context is thread-safe per libibverbs (all verbs may be called from any
// thread), and the pointer stays valid for the process lifetime (see `Device`).
unsafe impl Send for Device {}
// SAFETY: as above; `Device` gives no interior mutability of its own.
unsafe impl Sync for Device {}

impl Device {
    /// Every device librdmacm knows.
    pub(crate) fn all() -> Result<Vec<Device>, VerbsSetupError> {
        let mut count = 0;
        // SAFETY: `count` is a valid out slot; the returned array is freed below.
        let list = unsafe { rdma_get_devices(&mut count) };
        if list.is_null() {
            // ENODEV/ENOSYS: no rdma_cm device file, no kernel support.
            return Err(VerbsSetupError::NoDevice);
        }
        let mut devices = Vec::new();
        for index in 0..usize::try_from(count).unwrap_or(0) {
            // SAFETY: `list` holds `count` context pointers.
            let context = unsafe { *list.add(index) };
            if let Some(context) = NonNull::new(context) {
                devices.push(Device::query(context)?);
            }
        }
        // SAFETY: `list` came from rdma_get_devices and is freed once; the contexts it
        // points to stay open (owned by librdmacm).
        unsafe { rdma_free_devices(list) };
        Ok(devices)
    }

    /// The device called `name`, or the first one for `None`.
    pub(crate) fn by_name(name: Option<&str>) -> Result<Device, VerbsSetupError> {
        Device::all()?
            .into_iter()
            .find(|device| name.is_none_or(|name| device.name == name))
            .ok_or(VerbsSetupError::NoDevice)
    }

    /// Reads the name, transport and limits of an open context.
    pub(crate) fn query(context: NonNull<ibv_context>) -> Result<Device, VerbsSetupError> {
        // SAFETY: a live context has a valid `device` pointer whose `name` is a
        // NUL-terminated array inside the struct.
        let (name, transport) = unsafe {
            let device = (*context.as_ptr()).device;
            (
                CStr::from_ptr((*device).name.as_ptr())
                    .to_string_lossy()
                    .into_owned(),
                (*device).transport_type,
            )
        };
        // SAFETY: all-zero is a valid ibv_device_attr (plain integers and arrays).
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out struct.
        if unsafe { ibv_query_device(context.as_ptr(), &mut attr) } != 0 {
            return Err(VerbsSetupError::Os(errno()));
        }
        // SAFETY: all-zero is a valid ibv_port_attr.
        let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, port 1 exists on every soft and hard RDMA NIC we support,
        // valid out struct.
        let rc = unsafe { ___ibv_query_port(context.as_ptr(), 1, &mut port) };
        if rc != 0 {
            return Err(VerbsSetupError::Os(rc.abs()));
        }
        let iwarp = transport == ibv_transport_type::IBV_TRANSPORT_IWARP;
        let max_wr = u16::try_from(attr.max_qp_wr.max(0)).unwrap_or(u16::MAX);
        let capabilities = Capabilities {
            rdma_read: attr.max_qp_init_rd_atom > 0,
            // iWARP has no RDMA write with immediate data.
            write_with_imm: !iwarp,
            read_sink_needs_remote_write: iwarp,
            active_side_sends_first: iwarp,
            max_slot_size: MAX_SLOT_SIZE,
            // A send queue holds the send slots plus the RDMA operations in flight.
            max_slots: MAX_SLOTS.min(max_wr / 2),
            // Sends are always copied into registered slots; inline data is not used.
            max_inline: 0,
            max_rdma_len: u64::from(port.max_msg_sz).min(attr.max_mr_size),
        };
        Ok(Device {
            context,
            name,
            iwarp,
            capabilities,
            max_responder_resources: u8::try_from(attr.max_qp_rd_atom.clamp(0, 16)).unwrap_or(16),
            // Our RDMA READs in flight at once (see `READS_IN_FLIGHT`).
            max_initiator_depth: u8::try_from(attr.max_qp_init_rd_atom.clamp(0, READS_IN_FLIGHT))
                .unwrap_or(1),
            max_mr_size: attr.max_mr_size,
            max_qp_wr: u32::try_from(attr.max_qp_wr.max(0)).unwrap_or(0),
        })
    }
}
