/work/main/target-old/release/deps/san_shm-91706f4f771c403f.d: providers/shm/src/lib.rs providers/shm/src/connection.rs providers/shm/src/domain.rs providers/shm/src/error.rs providers/shm/src/layout.rs providers/shm/src/segment.rs providers/shm/src/setup.rs providers/shm/src/sys.rs

/work/main/target-old/release/deps/libsan_shm-91706f4f771c403f.rlib: providers/shm/src/lib.rs providers/shm/src/connection.rs providers/shm/src/domain.rs providers/shm/src/error.rs providers/shm/src/layout.rs providers/shm/src/segment.rs providers/shm/src/setup.rs providers/shm/src/sys.rs

/work/main/target-old/release/deps/libsan_shm-91706f4f771c403f.rmeta: providers/shm/src/lib.rs providers/shm/src/connection.rs providers/shm/src/domain.rs providers/shm/src/error.rs providers/shm/src/layout.rs providers/shm/src/segment.rs providers/shm/src/setup.rs providers/shm/src/sys.rs

providers/shm/src/lib.rs:
providers/shm/src/connection.rs:
providers/shm/src/domain.rs:
providers/shm/src/error.rs:
providers/shm/src/layout.rs:
providers/shm/src/segment.rs:
providers/shm/src/setup.rs:
providers/shm/src/sys.rs:
