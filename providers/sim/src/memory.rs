//! The simulated address space of one endpoint: a sparse set of mapped pages.
//!
//! Pages are the unit of mapping (like `mmap`/`munmap`), so a test can unmap part of a buffer
//! and map fresh memory at the same address. Untouched pages cost nothing (they read as
//! zeros until first written), which keeps multi-MiB rendezvous buffers cheap.

use std::collections::BTreeMap;

use san_api::MemRange;

/// Size of a simulated page: the granularity of `alloc`, `unmap` and `map_at`.
pub const PAGE_SIZE: u64 = 4096;

/// One mapped page. Zero pages are materialised on first write.
#[derive(Clone, Debug)]
enum Page {
    Zero,
    Data(Box<[u8]>),
}

/// Why a memory access failed: the first address that is not mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Unmapped {
    pub addr: u64,
}

/// Why `map_at` failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MapError {
    Misaligned,
    Empty,
    Overflow,
    AlreadyMapped { addr: u64 },
}

/// A sparse page table of one simulated process.
#[derive(Clone, Debug)]
pub(crate) struct AddressSpace {
    /// Mapped pages by page number (`addr / PAGE_SIZE`).
    pages: BTreeMap<u64, Page>,
    /// Where the next `alloc` starts. Only grows: `alloc` never hands out an address twice,
    /// so stale keys and descriptors point at unmapped memory unless a test deliberately
    /// re-maps it with `map_at`.
    next_alloc: u64,
}

/// Number of pages covering `[addr, addr + len)`, or `None` if the range wraps.
fn page_span(addr: u64, len: u64) -> Option<(u64, u64)> {
    let end = addr.checked_add(len)?;
    let first = addr / PAGE_SIZE;
    let last_exclusive = end.div_ceil(PAGE_SIZE);
    Some((first, last_exclusive))
}

impl AddressSpace {
    /// An empty address space whose allocations start at `base` (page-aligned).
    pub fn new(base: u64) -> Self {
        Self {
            pages: BTreeMap::new(),
            next_alloc: base - base % PAGE_SIZE,
        }
    }

    /// Maps fresh zeroed pages for `len` bytes at a new page-aligned address, leaving one
    /// unmapped guard page after them so overruns hit unmapped memory.
    pub fn alloc(&mut self, len: u64) -> Option<MemRange> {
        if len == 0 {
            return None;
        }
        let addr = self.next_alloc;
        let (first, last) = page_span(addr, len)?;
        let next = last.checked_add(1)?.checked_mul(PAGE_SIZE)?;
        for page in first..last {
            self.pages.insert(page, Page::Zero);
        }
        self.next_alloc = next;
        Some(MemRange::new(addr, len))
    }

    /// Maps zeroed pages at exactly `addr` (page-aligned), failing if any is already mapped
    /// (the `MAP_FIXED_NOREPLACE` rule). Returns the range asked for.
    pub fn map_at(&mut self, addr: u64, len: u64) -> Result<MemRange, MapError> {
        if !addr.is_multiple_of(PAGE_SIZE) {
            return Err(MapError::Misaligned);
        }
        if len == 0 {
            return Err(MapError::Empty);
        }
        let (first, last) = page_span(addr, len).ok_or(MapError::Overflow)?;
        if let Some((&page, _)) = self.pages.range(first..last).next() {
            return Err(MapError::AlreadyMapped {
                addr: page * PAGE_SIZE,
            });
        }
        for page in first..last {
            self.pages.insert(page, Page::Zero);
        }
        // Keep later `alloc`s clear of memory mapped by hand (plus a guard page).
        let past = last.saturating_add(1).saturating_mul(PAGE_SIZE);
        self.next_alloc = self.next_alloc.max(past);
        Ok(MemRange::new(addr, len))
    }

    /// Unmaps every page overlapping `range` (page-aligned start; length rounded up to
    /// pages, like `munmap`). Unmapping pages that are not mapped is not an error.
    /// Returns the page-rounded range, or `None` if `range` is misaligned or wraps.
    pub fn unmap(&mut self, range: MemRange) -> Option<MemRange> {
        if !range.addr.is_multiple_of(PAGE_SIZE) {
            return None;
        }
        let (first, last) = page_span(range.addr, range.len)?;
        let doomed: Vec<u64> = self.pages.range(first..last).map(|(&p, _)| p).collect();
        for page in doomed {
            self.pages.remove(&page);
        }
        Some(MemRange::new(first * PAGE_SIZE, (last - first) * PAGE_SIZE))
    }

    /// Drops every page (the process died).
    pub fn clear(&mut self) {
        self.pages.clear();
    }

    /// The first unmapped address in `range`, if any. Empty ranges are mapped.
    pub fn first_unmapped(&self, range: MemRange) -> Option<u64> {
        if range.len == 0 {
            return None;
        }
        let Some((first, last)) = page_span(range.addr, range.len) else {
            return Some(range.addr);
        };
        let mut expected = first;
        for (&page, _) in self.pages.range(first..last) {
            if page != expected {
                return Some((expected * PAGE_SIZE).max(range.addr));
            }
            expected = page + 1;
        }
        (expected < last).then(|| (expected * PAGE_SIZE).max(range.addr))
    }

    /// Copies `range` out. Fails without reading anything if part of it is unmapped.
    pub fn read(&self, range: MemRange) -> Result<Vec<u8>, Unmapped> {
        if let Some(addr) = self.first_unmapped(range) {
            return Err(Unmapped { addr });
        }
        let mut out = Vec::with_capacity(usize::try_from(range.len).unwrap_or(0));
        let mut addr = range.addr;
        let end = range.end();
        while addr < end {
            let page_no = addr / PAGE_SIZE;
            let offset = addr % PAGE_SIZE;
            let chunk = (PAGE_SIZE - offset).min(end - addr);
            match self.pages.get(&page_no) {
                Some(Page::Data(bytes)) => {
                    let start = offset as usize;
                    out.extend_from_slice(&bytes[start..start + chunk as usize]);
                }
                Some(Page::Zero) => out.resize(out.len() + chunk as usize, 0),
                // Checked above: every page of the range is mapped.
                None => return Err(Unmapped { addr }),
            }
            addr += chunk;
        }
        Ok(out)
    }

    /// Copies `bytes` in at `addr`. All-or-nothing: fails without writing anything if part
    /// of the destination is unmapped (the simulation never shows a partial write).
    pub fn write(&mut self, addr: u64, bytes: &[u8]) -> Result<(), Unmapped> {
        let range = MemRange::new(addr, bytes.len() as u64);
        if addr.checked_add(bytes.len() as u64).is_none() {
            return Err(Unmapped { addr });
        }
        if let Some(addr) = self.first_unmapped(range) {
            return Err(Unmapped { addr });
        }
        let mut cursor = addr;
        let mut rest = bytes;
        while !rest.is_empty() {
            let page_no = cursor / PAGE_SIZE;
            let offset = (cursor % PAGE_SIZE) as usize;
            let chunk = (PAGE_SIZE as usize - offset).min(rest.len());
            let Some(page) = self.pages.get_mut(&page_no) else {
                return Err(Unmapped { addr: cursor });
            };
            if let Page::Zero = page {
                *page = Page::Data(vec![0u8; PAGE_SIZE as usize].into_boxed_slice());
            }
            if let Page::Data(data) = page {
                data[offset..offset + chunk].copy_from_slice(&rest[..chunk]);
            }
            cursor += chunk as u64;
            rest = &rest[chunk..];
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_page_aligned_disjoint_and_guarded() {
        let mut space = AddressSpace::new(0x10_0000);
        let a = space.alloc(10).unwrap();
        let b = space.alloc(PAGE_SIZE + 1).unwrap();
        assert_eq!(a.addr % PAGE_SIZE, 0);
        assert_eq!(b.addr % PAGE_SIZE, 0);
        assert!(!a.overlaps(&b));
        // The guard page right after `a`'s page is not mapped.
        assert_eq!(
            space.first_unmapped(MemRange::new(a.addr, PAGE_SIZE + 1)),
            Some(a.addr + PAGE_SIZE)
        );
    }

    #[test]
    fn reads_see_writes_across_page_boundaries_and_untouched_pages_read_zero() {
        let mut space = AddressSpace::new(0x10_0000);
        let r = space.alloc(3 * PAGE_SIZE).unwrap();
        let pattern: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        space.write(r.addr + 100, &pattern).unwrap();
        assert_eq!(
            space.read(MemRange::new(r.addr + 100, 5000)).unwrap(),
            pattern
        );
        assert_eq!(
            space
                .read(MemRange::new(r.addr + 2 * PAGE_SIZE, 16))
                .unwrap(),
            vec![0; 16]
        );
    }

    #[test]
    fn partially_unmapped_destinations_are_left_untouched() {
        let mut space = AddressSpace::new(0x10_0000);
        let r = space.alloc(PAGE_SIZE).unwrap();
        let err = space
            .write(r.addr + PAGE_SIZE - 2, &[1, 2, 3, 4])
            .unwrap_err();
        assert_eq!(err.addr, r.addr + PAGE_SIZE);
        assert_eq!(
            space
                .read(MemRange::new(r.addr + PAGE_SIZE - 2, 2))
                .unwrap(),
            vec![0, 0]
        );
    }

    #[test]
    fn map_at_refuses_mapped_pages_and_unmap_rounds_to_pages() {
        let mut space = AddressSpace::new(0x10_0000);
        let r = space.alloc(2 * PAGE_SIZE).unwrap();
        assert_eq!(
            space.map_at(r.addr, 1),
            Err(MapError::AlreadyMapped { addr: r.addr })
        );
        assert_eq!(
            space.unmap(MemRange::new(r.addr, 1)),
            Some(MemRange::new(r.addr, PAGE_SIZE))
        );
        assert_eq!(space.first_unmapped(r), Some(r.addr));
        assert_eq!(
            space.first_unmapped(MemRange::new(r.addr + PAGE_SIZE, PAGE_SIZE)),
            None
        );
        assert_eq!(
            space.map_at(r.addr, PAGE_SIZE),
            Ok(MemRange::new(r.addr, PAGE_SIZE))
        );
        assert_eq!(space.first_unmapped(r), None);
        assert_eq!(space.map_at(r.addr + 1, 1), Err(MapError::Misaligned));
    }
}
