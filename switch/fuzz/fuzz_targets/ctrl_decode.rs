//! Arbitrary bytes as a received control message (see `switch::fuzzing::ctrl_decode`).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    switch::fuzzing::ctrl_decode(data);
});
