//! Random operation sequences against the registration cache; every invariant is checked after
//! every operation inside `run_ops` (it panics only when the cache breaks a rule).
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    switch::mr_cache::fuzzing::run_ops(data);
});
