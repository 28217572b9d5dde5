/work/main/target-old/release/deps/sandirect.d: preload/src/lib.rs

/work/main/target-old/release/deps/libsandirect.so: preload/src/lib.rs

preload/src/lib.rs:
