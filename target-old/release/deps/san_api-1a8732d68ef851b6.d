/work/main/target-old/release/deps/san_api-1a8732d68ef851b6.d: providers/api/src/lib.rs

/work/main/target-old/release/deps/libsan_api-1a8732d68ef851b6.rlib: providers/api/src/lib.rs

/work/main/target-old/release/deps/libsan_api-1a8732d68ef851b6.rmeta: providers/api/src/lib.rs

providers/api/src/lib.rs:
