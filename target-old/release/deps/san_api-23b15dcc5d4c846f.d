/work/main/target-old/release/deps/san_api-23b15dcc5d4c846f.d: providers/api/src/lib.rs

/work/main/target-old/release/deps/libsan_api-23b15dcc5d4c846f.rlib: providers/api/src/lib.rs

/work/main/target-old/release/deps/libsan_api-23b15dcc5d4c846f.rmeta: providers/api/src/lib.rs

providers/api/src/lib.rs:
