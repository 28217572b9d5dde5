//! Pools of registered control buffers, owned by a connection.

use std::ptr::NonNull;

use rdma_sys::ibv_sge;
use san_api::{Access, RegisterError};

use crate::mr::MemoryRegion;
use crate::pd::ProtectionDomain;

/// `count` buffers of `size` bytes in one anonymous mapping, registered once.
///
/// The pool never hands out references to a buffer while the device may write it: the
/// connection tracks which slots are posted and only reads completed ones.
pub(crate) struct SlotPool {
    // Field order is drop order: the region is deregistered before the mapping goes.
    region: Option<MemoryRegion>,
    base: NonNull<u8>,
    mapped: usize,
    size: u32,
    count: u16,
}

// SAFETY: the pool owns its mapping; access is serialised by the owning connection (`&mut`
// to write, `&` to read completed slots only).
unsafe impl Send for SlotPool {}

impl SlotPool {
    pub(crate) fn new(
        pd: &ProtectionDomain,
        count: u16,
        size: u32,
        access: Access,
    ) -> Result<Self, RegisterError> {
        let total = usize::from(count.max(1))
            .checked_mul(size.max(1) as usize)
            .ok_or(RegisterError::OutOfResources)?;
        // SAFETY: anonymous private mapping, no fd, kernel chooses the address.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(RegisterError::OutOfResources);
        }
        let Some(base) = NonNull::new(base.cast::<u8>()) else {
            return Err(RegisterError::OutOfResources);
        };
        let mut pool = Self {
            region: None,
            base,
            mapped: total,
            size,
            count,
        };
        pool.region = Some(MemoryRegion::register(
            pd,
            base.as_ptr() as u64,
            total as u64,
            access,
        )?);
        Ok(pool)
    }

    pub(crate) fn size(&self) -> u32 {
        self.size
    }

    fn offset(&self, slot: u16) -> Option<usize> {
        (slot < self.count).then(|| usize::from(slot) * self.size as usize)
    }

    /// The scatter/gather entry for `len` bytes of `slot`.
    pub(crate) fn sge(&self, slot: u16, len: u32) -> Option<ibv_sge> {
        let offset = self.offset(slot)?;
        let region = self.region.as_ref()?;
        (len <= self.size).then(|| ibv_sge {
            addr: self.base.as_ptr() as u64 + offset as u64,
            length: len,
            lkey: region.lkey(),
        })
    }

    /// Copies `message` into `slot` (which must not be posted).
    pub(crate) fn fill(&mut self, slot: u16, message: &[u8]) -> bool {
        let Some(offset) = self.offset(slot) else {
            return false;
        };
        if message.len() > self.size as usize {
            return false;
        }
        // SAFETY: `offset + len <= mapped` (slot < count, len <= size); the slot is not
        // posted (caller), so the device does not access it; `&mut self` excludes readers.
        unsafe {
            std::ptr::copy_nonoverlapping(
                message.as_ptr(),
                self.base.as_ptr().add(offset),
                message.len(),
            )
        };
        true
    }

    /// The first `len` bytes of `slot` (which must not be posted).
    pub(crate) fn bytes(&self, slot: u16, len: u32) -> &[u8] {
        match self.offset(slot) {
            // SAFETY: in bounds (slot < count, len <= size); the slot is not posted (the
            // caller checks), so nothing writes it while the borrow of `self` lasts.
            Some(offset) if len <= self.size => unsafe {
                std::slice::from_raw_parts(self.base.as_ptr().add(offset), len as usize)
            },
            _ => &[],
        }
    }
}

impl Drop for SlotPool {
    fn drop(&mut self) {
        // Deregister first: the owner destroyed the QP already, so no DMA is in flight.
        self.region = None;
        // SAFETY: our own mapping of `mapped` bytes, unmapped once, no references remain
        // (`bytes` borrows end with `&self`).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.mapped) };
    }
}
