//! Memory regions: pinning and keys.

use std::ptr::NonNull;

use rdma_sys::{ibv_access_flags, ibv_dereg_mr, ibv_mr, ibv_reg_mr};
use san_api::{Access, RegisterError};

use crate::pd::ProtectionDomain;
use crate::sys::errno;

/// A registered memory region. It pins `[addr, addr + len)` until dropped; it must be
/// dropped before its protection domain (its owner guarantees the order).
pub(crate) struct MemoryRegion {
    mr: NonNull<ibv_mr>,
}

// SAFETY: an ibv_mr is immutable after registration (only its keys are read) and may be
// deregistered from any thread.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers `len` bytes at `addr` with `access`.
    ///
    /// Registration only pins the pages and creates keys: nothing is read or written by
    /// this call. The device touches the memory only for work requests that the owner
    /// posts, naming the region's keys; the kernel checks that the range is mapped.
    ///
    /// # Errors
    /// `OutOfResources` for ENOMEM/EAGAIN/ENOBUFS (notably RLIMIT_MEMLOCK), `BadAddress`
    /// for EFAULT (unmapped range), `Unsupported` for rights the device refuses.
    pub(crate) fn register(
        pd: &ProtectionDomain,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<Self, RegisterError> {
        let len = usize::try_from(len).map_err(|_| RegisterError::BadAddress)?;
        let flags = verbs_access(access);
        // SAFETY: the PD is live; the kernel validates and pins the range (or fails);
        // `flags` only holds defined IBV_ACCESS bits.
        let mr = unsafe { ibv_reg_mr(pd.as_ptr(), addr as *mut libc::c_void, len, flags.0 as i32) };
        match NonNull::new(mr) {
            Some(mr) => Ok(Self { mr }),
            None => Err(match errno() {
                libc::ENOMEM | libc::EAGAIN | libc::ENOBUFS => RegisterError::OutOfResources,
                libc::EFAULT => RegisterError::BadAddress,
                _ => RegisterError::Unsupported,
            }),
        }
    }

    pub(crate) fn lkey(&self) -> u32 {
        // SAFETY: the MR is live; `lkey` is set at registration and never changes.
        unsafe { (*self.mr.as_ptr()).lkey }
    }

    pub(crate) fn rkey(&self) -> u32 {
        // SAFETY: as for `lkey`.
        unsafe { (*self.mr.as_ptr()).rkey }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr and deregistered once. Work requests still
        // naming its keys fail with a protection error; none can touch the memory after.
        unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// The verbs access flags for `access`. Remote write needs local write (a verbs rule).
pub(crate) fn verbs_access(access: Access) -> ibv_access_flags {
    let mut flags = ibv_access_flags(0);
    if access.contains(Access::LOCAL_WRITE) || access.contains(Access::REMOTE_WRITE) {
        flags |= ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
    }
    if access.contains(Access::REMOTE_READ) {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_READ;
    }
    if access.contains(Access::REMOTE_WRITE) {
        flags |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
    }
    flags
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remote_write_implies_local_write_and_nothing_else_is_added() {
        assert_eq!(verbs_access(Access::NONE).0, 0);
        let rw = verbs_access(Access::REMOTE_WRITE);
        assert_ne!(rw.0 & ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0, 0);
        assert_eq!(rw.0 & ibv_access_flags::IBV_ACCESS_REMOTE_READ.0, 0);
        let rr = verbs_access(Access::REMOTE_READ);
        assert_eq!(rr.0, ibv_access_flags::IBV_ACCESS_REMOTE_READ.0);
    }
}
