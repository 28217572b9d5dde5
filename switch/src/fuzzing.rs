//! Bodies of the fuzz targets in `switch/fuzz/`, kept in the crate as plain functions so that
//! stable `cargo test` replays every committed corpus input (`switch/tests/fuzz_corpus.rs`).
//! Each body accepts any input and panics only when the code under test breaks a rule.
//!
//! The third target, `session_ops`, drives whole sessions over the simulated fabric; it needs
//! `san-sim` (a dev-dependency), so its body lives with the simulation in
//! `switch/tests/common/world.rs`.

use alloc::vec;

use crate::wire::ctrl::Repr;

/// `ctrl_decode`: arbitrary bytes as a received control message. Parsing never panics, and a
/// message that parses is exactly as long as its encoding and re-emits to bytes that parse to
/// the same message (so no field is silently dropped or invented).
pub fn ctrl_decode(data: &[u8]) {
    let Ok(repr) = Repr::parse_bytes(data) else {
        return;
    };
    assert_eq!(
        repr.buffer_len(),
        data.len(),
        "a parsed message must span the whole input"
    );
    let mut encoded = vec![0u8; repr.buffer_len()];
    let Ok(written) = repr.emit(&mut encoded) else {
        panic!("a message that parsed must emit: {repr:?}");
    };
    assert_eq!(written, data.len());
    assert_eq!(Repr::parse_bytes(&encoded[..written]), Ok(repr));
}

/// `mr_cache_ops`: see [`crate::mr_cache::fuzzing::run_ops`].
pub use crate::mr_cache::fuzzing::run_ops as mr_cache_ops;
