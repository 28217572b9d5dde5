//! Operation sequences against sessions over the simulated fabric: the fuzzer's bytes steer
//! every application and fault choice of the deterministic simulation, whose invariants are
//! checked after every step (see `switch/tests/common/world.rs`).
#![no_main]
use libfuzzer_sys::fuzz_target;

#[allow(dead_code, unused_imports)]
#[path = "../../tests/common/mod.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    common::world::run_fuzz_input(data);
});
