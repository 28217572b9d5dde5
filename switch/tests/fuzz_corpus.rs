//! Replays the committed fuzz corpora (`switch/fuzz/corpus/<target>/`) through the same plain
//! functions the cargo-fuzz targets call, so every input the fuzzer ever found interesting stays a
//! regression test on stable Rust. Each target body panics only when an invariant breaks.

mod common;

use std::fs;
use std::path::PathBuf;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs: Vec<(PathBuf, Vec<u8>)> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus directory {} unreadable: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("corpus entry").path();
            let bytes = fs::read(&path).expect("corpus file");
            (path, bytes)
        })
        .collect();
    inputs.sort();
    assert!(
        inputs.len() >= 10,
        "corpus {target} has only {} inputs: was it committed?",
        inputs.len()
    );
    inputs
}

fn replay(target: &str, body: impl Fn(&[u8])) {
    for (path, bytes) in corpus(target) {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&bytes)));
        if outcome.is_err() {
            panic!(
                "fuzz corpus input {} of target {target} failed",
                path.display()
            );
        }
    }
}

#[test]
fn mr_cache_ops_corpus_holds_every_invariant() {
    replay("mr_cache_ops", |bytes| {
        switch::mr_cache::fuzzing::run_ops(bytes);
    });
}

#[test]
fn ctrl_decode_corpus_never_panics_and_round_trips() {
    replay("ctrl_decode", switch::fuzzing::ctrl_decode);
}

#[test]
fn session_ops_corpus_holds_every_simulation_invariant() {
    replay("session_ops", common::world::run_fuzz_input);
}
