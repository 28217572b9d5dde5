//! Helpers shared by the device tests: addresses, domains, buffers, completion waiting.
#![allow(dead_code)] // each test binary uses a different subset

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use san_api::{Completion, SanConnection, SlotConfig};
use sandirect_verbs::{ConnectParams, VerbsConnection, VerbsDomain, WaitOutcome};

/// Everything under TCG is slow: bounds are generous, but every wait is bounded.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);

pub fn server_ip() -> IpAddr {
    env_ip("SANDIRECT_TEST_SERVER_IP", "192.0.2.1")
}

pub fn client_ip() -> IpAddr {
    env_ip("SANDIRECT_TEST_CLIENT_IP", "192.0.2.2")
}

fn env_ip(name: &str, default: &str) -> IpAddr {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .parse()
        .expect("an IP address")
}

pub fn slots() -> SlotConfig {
    SlotConfig {
        send_slots: 8,
        recv_slots: 8,
        slot_size: 256,
    }
}

pub fn params(blob: &[u8]) -> ConnectParams<'_> {
    let mut params = ConnectParams::new(slots());
    params.private_data = blob;
    params.timeout = STEP_TIMEOUT;
    params.local = Some(SocketAddr::new(client_ip(), 0));
    params
}

pub fn server_domain() -> VerbsDomain {
    let domain = VerbsDomain::open_for_address(server_ip())
        .expect("an RDMA device serves the server address");
    if let Ok(name) = std::env::var("SANDIRECT_TEST_DEVICE") {
        assert_eq!(
            domain.device_name(),
            name,
            "server address is on the expected device"
        );
    }
    domain
}

pub fn client_domain() -> VerbsDomain {
    VerbsDomain::open_for_address(client_ip()).expect("an RDMA device serves the client address")
}

/// Waits (bounded) for the next completion.
pub fn next_raw_completion(conn: &mut VerbsConnection) -> Completion {
    let deadline = Instant::now() + STEP_TIMEOUT;
    let mut out = Vec::new();
    loop {
        if conn.poll_completions(&mut out, 1) == 1 {
            return out[0];
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no completion within {STEP_TIMEOUT:?}");
        if conn.wait(Some(left)) == WaitOutcome::TimedOut {
            panic!("no completion within {STEP_TIMEOUT:?}");
        }
    }
}

/// A page-aligned heap buffer (registration pins whole pages; alignment keeps two
/// buffers from sharing one).
pub struct Buffer {
    bytes: Vec<u8>,
    offset: usize,
    len: usize,
}

impl Buffer {
    pub fn new(len: usize) -> Self {
        let bytes = vec![0u8; len + 4096];
        let offset = bytes.as_ptr().align_offset(4096);
        Self { bytes, offset, len }
    }

    pub fn range(&self) -> san_api::MemRange {
        san_api::MemRange::new(self.as_slice().as_ptr() as u64, self.len as u64)
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.bytes[self.offset..self.offset + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.bytes[self.offset..self.offset + self.len]
    }

    /// Reads the bytes the device wrote (a volatile copy: the compiler must not assume
    /// the buffer still holds what Rust last wrote).
    pub fn snapshot(&self) -> Vec<u8> {
        let base = self.as_slice().as_ptr();
        // SAFETY: in bounds of our own live buffer; the transfer that wrote it completed.
        (0..self.len)
            .map(|i| unsafe { base.add(i).read_volatile() })
            .collect()
    }
}

/// A deterministic pattern that differs per `seed` and per position.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[1] ^ seed)
        .collect()
}

/// Descriptor encoding for control messages: addr, len, rkey (little endian).
pub fn encode_descriptor(d: &san_api::RemoteDescriptor) -> Vec<u8> {
    let mut out = Vec::with_capacity(20);
    out.extend_from_slice(&d.addr.to_le_bytes());
    out.extend_from_slice(&d.len.to_le_bytes());
    out.extend_from_slice(&d.rkey.0.to_le_bytes());
    out
}

pub fn decode_descriptor(bytes: &[u8]) -> san_api::RemoteDescriptor {
    assert!(
        bytes.len() >= 20,
        "descriptor message too short: {}",
        bytes.len()
    );
    san_api::RemoteDescriptor {
        addr: u64::from_le_bytes(bytes[0..8].try_into().unwrap()),
        len: u64::from_le_bytes(bytes[8..16].try_into().unwrap()),
        rkey: san_api::RemoteKey(u32::from_le_bytes(bytes[16..20].try_into().unwrap())),
    }
}

/// `libsandirect_verbs.so` as cargo built it with this test binary: `deps/` holds the copy
/// built together with the tests (the profile directory's copy is refreshed only by a
/// `cargo build` of the package and may be older).
pub fn built_library() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe.parent().expect("deps dir");
    let profile = deps.parent().expect("target profile dir");
    let lib = [deps, profile]
        .iter()
        .map(|dir| dir.join("libsandirect_verbs.so"))
        .find(|lib| lib.exists())
        .expect("cargo builds the cdylib with the tests");
    lib
}
