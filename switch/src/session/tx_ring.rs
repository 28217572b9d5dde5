//! The send buffer: a ring of bytes whose free space is written in place. The application's
//! bytes are copied into it once, by a copy that may fail (a buffer the process may not
//! read), and they count as queued only when the whole copy succeeded.

use alloc::vec;
use alloc::vec::Vec;
use san_api::{AppSource, BadAddress};

/// The smallest storage the ring allocates (one message of a request/response exchange
/// needs no growth after the first).
const MIN_CAPACITY: usize = 4096;

/// A FIFO of bytes over storage that is always initialised, so its free space can be handed
/// to a copy as a plain slice.
#[derive(Debug, Default)]
pub(super) struct TxRing {
    /// The storage; its whole length is the capacity. Bytes outside the queued run are stale.
    storage: Vec<u8>,
    /// Index of the first queued byte (0 while the ring is empty).
    head: usize,
    /// How many bytes are queued.
    len: usize,
}

impl TxRing {
    pub(super) const fn new() -> Self {
        Self {
            storage: Vec::new(),
            head: 0,
            len: 0,
        }
    }

    /// Queued bytes.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Drops every queued byte (the storage stays).
    pub(super) fn clear(&mut self) {
        self.head = 0;
        self.len = 0;
    }

    /// The first contiguous run of queued bytes (all of them unless the ring wraps).
    pub(super) fn front(&self) -> &[u8] {
        let end = (self.head + self.len).min(self.storage.len());
        &self.storage[self.head..end]
    }

    /// Drops the first `n` queued bytes (at most all of them).
    pub(super) fn consume(&mut self, n: usize) {
        let n = n.min(self.len);
        self.len -= n;
        // An empty ring starts over at the front, so the next messages are contiguous.
        self.head = if self.len == 0 {
            0
        } else {
            (self.head + n) % self.storage.len()
        };
    }

    /// Queues the first `n` bytes of `source` (`n <= source.len()`): all of them, or none when
    /// the copy fails.
    pub(super) fn push_from<S: AppSource + ?Sized>(
        &mut self,
        source: &S,
        n: usize,
    ) -> Result<(), BadAddress> {
        if n == 0 {
            return Ok(());
        }
        self.reserve(n);
        let capacity = self.storage.len();
        let tail = (self.head + self.len) % capacity;
        let first = n.min(capacity - tail);
        source.copy_to(0, &mut self.storage[tail..tail + first])?;
        source.copy_to(first, &mut self.storage[..n - first])?;
        self.len += n;
        Ok(())
    }

    /// Makes room for `n` more bytes: a larger storage (at least double) holding the queued
    /// bytes from its start.
    fn reserve(&mut self, n: usize) {
        let needed = self.len + n;
        if needed <= self.storage.len() {
            return;
        }
        let capacity = needed.max(self.storage.len() * 2).max(MIN_CAPACITY);
        let mut grown = vec![0u8; capacity];
        let front = self.front();
        let wrapped = self.len - front.len();
        grown[..front.len()].copy_from_slice(front);
        grown[front.len()..self.len].copy_from_slice(&self.storage[..wrapped]);
        self.storage = grown;
        self.head = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source whose bytes from `bad_from` on cannot be read.
    struct Faulty<'a> {
        bytes: &'a [u8],
        bad_from: usize,
    }

    impl AppSource for Faulty<'_> {
        fn len(&self) -> usize {
            self.bytes.len()
        }

        fn copy_to(&self, offset: usize, dst: &mut [u8]) -> Result<(), BadAddress> {
            if offset + dst.len() > self.bad_from {
                return Err(BadAddress);
            }
            dst.copy_from_slice(&self.bytes[offset..offset + dst.len()]);
            Ok(())
        }
    }

    fn drain(ring: &mut TxRing) -> Vec<u8> {
        let mut out = Vec::new();
        while !ring.is_empty() {
            let front = ring.front().to_vec();
            out.extend_from_slice(&front);
            ring.consume(front.len());
        }
        out
    }

    #[test]
    fn bytes_come_out_in_order_across_wraps_and_growth() {
        let mut ring = TxRing::new();
        let mut expected = Vec::new();
        let mut got = Vec::new();
        let mut next = 0u8;
        for round in 0..200usize {
            let n = (round * 37) % 3000 + 1;
            let chunk: Vec<u8> = (0..n)
                .map(|_| {
                    next = next.wrapping_add(1);
                    next
                })
                .collect();
            ring.push_from(&chunk[..], n).unwrap();
            expected.extend_from_slice(&chunk);
            // Take part of it, so the queued run wraps around the storage.
            let take = ring.front().len().min(n / 2 + 1);
            got.extend_from_slice(&ring.front()[..take]);
            ring.consume(take);
        }
        got.extend(drain(&mut ring));
        assert_eq!(got, expected);
    }

    #[test]
    fn a_failed_copy_queues_nothing() {
        let mut ring = TxRing::new();
        ring.push_from(&b"kept"[..], 4).unwrap();
        let bytes = [7u8; 100];
        let faulty = Faulty {
            bytes: &bytes,
            bad_from: 60,
        };
        assert_eq!(ring.push_from(&faulty, 100), Err(BadAddress));
        assert_eq!(ring.len(), 4, "the failed copy must not count");
        ring.push_from(&faulty, 60).unwrap();
        let mut expected = b"kept".to_vec();
        expected.extend_from_slice(&[7u8; 60]);
        assert_eq!(drain(&mut ring), expected);
    }

    #[test]
    fn a_copy_that_fails_in_its_wrapped_part_queues_nothing() {
        let mut ring = TxRing::new();
        ring.push_from(&[1u8; MIN_CAPACITY][..], MIN_CAPACITY - 10)
            .unwrap();
        ring.consume(MIN_CAPACITY - 20);
        // 10 queued, 10 free at the end of the storage, the rest at its start.
        let bytes = [9u8; 30];
        let faulty = Faulty {
            bytes: &bytes,
            bad_from: 25,
        };
        assert_eq!(ring.push_from(&faulty, 30), Err(BadAddress));
        assert_eq!(drain(&mut ring), vec![1u8; 10]);
    }
}
