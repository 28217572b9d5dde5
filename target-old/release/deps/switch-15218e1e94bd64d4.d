/work/main/target-old/release/deps/switch-15218e1e94bd64d4.d: switch/src/lib.rs switch/src/error.rs switch/src/fuzzing.rs switch/src/mr_cache.rs switch/src/mr_cache/fuzzing.rs switch/src/session/mod.rs switch/src/session/credits.rs switch/src/session/driver.rs switch/src/wire.rs

/work/main/target-old/release/deps/libswitch-15218e1e94bd64d4.rlib: switch/src/lib.rs switch/src/error.rs switch/src/fuzzing.rs switch/src/mr_cache.rs switch/src/mr_cache/fuzzing.rs switch/src/session/mod.rs switch/src/session/credits.rs switch/src/session/driver.rs switch/src/wire.rs

/work/main/target-old/release/deps/libswitch-15218e1e94bd64d4.rmeta: switch/src/lib.rs switch/src/error.rs switch/src/fuzzing.rs switch/src/mr_cache.rs switch/src/mr_cache/fuzzing.rs switch/src/session/mod.rs switch/src/session/credits.rs switch/src/session/driver.rs switch/src/wire.rs

switch/src/lib.rs:
switch/src/error.rs:
switch/src/fuzzing.rs:
switch/src/mr_cache.rs:
switch/src/mr_cache/fuzzing.rs:
switch/src/session/mod.rs:
switch/src/session/credits.rs:
switch/src/session/driver.rs:
switch/src/wire.rs:
