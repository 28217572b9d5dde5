//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use san_api::{Completion, CompletionKind, RecvSlot, SanConnection, SlotConfig, WrId};
use san_shm::{ConnectionConfig, SegmentConfig, ShmConnection, ShmDir, WaitResult};

/// A private directory under /dev/shm, open as a segment directory, removed on drop.
pub struct TestDir {
    path: PathBuf,
    handle: ShmDir,
}

impl TestDir {
    pub fn new(tag: &str) -> TestDir {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let path = PathBuf::from(format!(
            "/dev/shm/san-shm-test-{tag}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let handle = ShmDir::open(&path).expect("private test directory");
        TestDir { path, handle }
    }

    /// The path the directory was made at (files the test makes or inspects itself).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The directory as the segment calls take it.
    pub fn handle(&self) -> &ShmDir {
        &self.handle
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

pub fn slots(slot_size: u32, recv_slots: u16, send_slots: u16) -> SlotConfig {
    SlotConfig {
        send_slots,
        recv_slots,
        slot_size,
    }
}

pub fn segment_config(slot_size: u32, recv_slots: u16) -> SegmentConfig {
    SegmentConfig::new(slots(slot_size, recv_slots, recv_slots))
}

pub fn test_connection_config() -> ConnectionConfig {
    ConnectionConfig {
        rnr_timeout: Duration::from_secs(2),
        ..ConnectionConfig::default()
    }
}

/// Deterministic test bytes: a function of (seed, index).
pub fn pattern_byte(seed: u64, index: u64) -> u8 {
    let mut x =
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (x.wrapping_mul(0x94D0_49BB_1331_11EB) >> 56) as u8
}

pub fn fill_pattern(buffer: &mut [u8], seed: u64) {
    for (i, byte) in buffer.iter_mut().enumerate() {
        *byte = pattern_byte(seed, i as u64);
    }
}

pub fn matches_pattern(buffer: &[u8], seed: u64) -> bool {
    buffer
        .iter()
        .enumerate()
        .all(|(i, byte)| *byte == pattern_byte(seed, i as u64))
}

/// A connection plus the bookkeeping every test peer needs: all receive slots kept posted,
/// received messages copied out in order, other completions collected.
pub struct Endpoint {
    pub conn: ShmConnection,
    pub messages: VecDeque<Vec<u8>>,
    pub others: VecDeque<Completion>,
    scratch: Vec<Completion>,
    next_wr: u64,
}

impl Endpoint {
    pub fn new(conn: ShmConnection) -> Endpoint {
        let mut endpoint = Endpoint {
            conn,
            messages: VecDeque::new(),
            others: VecDeque::new(),
            scratch: Vec::new(),
            next_wr: 1,
        };
        for slot in 0..endpoint.conn.slot_config().recv_slots {
            let wr = endpoint.wr();
            endpoint
                .conn
                .post_recv(wr, RecvSlot(slot))
                .expect("post initial receive");
        }
        endpoint
    }

    pub fn wr(&mut self) -> WrId {
        self.next_wr += 1;
        WrId(self.next_wr)
    }

    /// Polls once; copies out messages (reposting their slots) and keeps other completions.
    /// Returns how many completions were seen.
    pub fn poll(&mut self) -> usize {
        self.scratch.clear();
        let n = self.conn.poll_completions(&mut self.scratch, 64);
        let completions: Vec<Completion> = self.scratch.drain(..).collect();
        for completion in completions {
            match (completion.kind, completion.status) {
                (CompletionKind::Recv { slot, len }, Ok(())) => {
                    self.messages
                        .push_back(self.conn.recv_slot(slot, len).to_vec());
                    let wr = self.wr();
                    self.conn.post_recv(wr, slot).expect("repost receive");
                }
                (CompletionKind::Send, Ok(())) => {}
                _ => self.others.push_back(completion),
            }
        }
        n
    }

    /// Polls and waits until `done(self)` holds or `timeout` passes.
    pub fn drive_until(
        &mut self,
        timeout: Duration,
        mut done: impl FnMut(&mut Endpoint) -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll();
            if done(self) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            if self
                .conn
                .wait((deadline - now).min(Duration::from_millis(50)))
                == WaitResult::Disconnected
            {
                self.poll();
                return done(self);
            }
        }
    }

    pub fn next_message(&mut self, timeout: Duration) -> Option<Vec<u8>> {
        if self.drive_until(timeout, |e| !e.messages.is_empty()) {
            self.messages.pop_front()
        } else {
            None
        }
    }

    pub fn next_other(&mut self, timeout: Duration) -> Option<Completion> {
        if self.drive_until(timeout, |e| !e.others.is_empty()) {
            self.others.pop_front()
        } else {
            None
        }
    }

    /// Sends, retrying while the send queue is full.
    pub fn send(&mut self, bytes: &[u8]) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let wr = self.wr();
            match self.conn.post_send(wr, bytes) {
                Ok(()) => return,
                Err(san_api::PostError::QueueFull) if Instant::now() < deadline => {
                    self.poll();
                }
                Err(e) => panic!("post_send failed: {e}"),
            }
        }
    }

    pub fn request(&mut self, bytes: &[u8]) -> Vec<u8> {
        self.send(bytes);
        self.next_message(Duration::from_secs(20))
            .expect("reply from peer")
    }
}
