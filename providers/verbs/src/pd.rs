//! Protection domains.

use std::ptr::NonNull;

use rdma_sys::{ibv_alloc_pd, ibv_dealloc_pd, ibv_pd};

use crate::device::Device;
use crate::sys::errno;
use crate::VerbsSetupError;

/// An allocated protection domain on one device. Everything registered or created on it
/// (memory regions, queue pairs) must be destroyed before it; the owners guarantee that by
/// holding an `Arc` of the domain state that contains it.
pub(crate) struct ProtectionDomain {
    pd: NonNull<ibv_pd>,
    pub(crate) device: Device,
}

// SAFETY: libibverbs objects may be used from any thread; the PD is only read (its pointer
// passed to verbs) after allocation, and freed once in Drop.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above, no interior mutation through `&ProtectionDomain`.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub(crate) fn allocate(device: Device) -> Result<Self, VerbsSetupError> {
        // SAFETY: the context is live for the process lifetime (see `Device`).
        let pd = unsafe { ibv_alloc_pd(device.context.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| VerbsSetupError::Os(errno()))?;
        Ok(Self { pd, device })
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv_pd {
        self.pd.as_ptr()
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd, freed once; every MR and QP on it is gone
        // (their owners hold the Arc that owns this PD). A failure (EBUSY) would mean a
        // leaked child object: leaking the PD is then the only safe choice.
        unsafe { ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}
