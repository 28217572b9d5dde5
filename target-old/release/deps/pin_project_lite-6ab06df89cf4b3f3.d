/work/main/target-old/release/deps/pin_project_lite-6ab06df89cf4b3f3.d: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/pin-project-lite-0.2.17/src/lib.rs

/work/main/target-old/release/deps/libpin_project_lite-6ab06df89cf4b3f3.rlib: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/pin-project-lite-0.2.17/src/lib.rs

/work/main/target-old/release/deps/libpin_project_lite-6ab06df89cf4b3f3.rmeta: /root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/pin-project-lite-0.2.17/src/lib.rs

/root/.cargo/registry/src/index.crates.io-1949cf8c6b5b557f/pin-project-lite-0.2.17/src/lib.rs:
