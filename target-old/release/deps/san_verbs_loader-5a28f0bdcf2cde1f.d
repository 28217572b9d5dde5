/work/main/target-old/release/deps/san_verbs_loader-5a28f0bdcf2cde1f.d: providers/verbs/loader/src/lib.rs providers/verbs/loader/src/abi.rs providers/verbs/loader/src/convert.rs providers/verbs/loader/src/error.rs providers/verbs/loader/src/handles.rs providers/verbs/loader/src/setup.rs

/work/main/target-old/release/deps/libsan_verbs_loader-5a28f0bdcf2cde1f.rlib: providers/verbs/loader/src/lib.rs providers/verbs/loader/src/abi.rs providers/verbs/loader/src/convert.rs providers/verbs/loader/src/error.rs providers/verbs/loader/src/handles.rs providers/verbs/loader/src/setup.rs

/work/main/target-old/release/deps/libsan_verbs_loader-5a28f0bdcf2cde1f.rmeta: providers/verbs/loader/src/lib.rs providers/verbs/loader/src/abi.rs providers/verbs/loader/src/convert.rs providers/verbs/loader/src/error.rs providers/verbs/loader/src/handles.rs providers/verbs/loader/src/setup.rs

providers/verbs/loader/src/lib.rs:
providers/verbs/loader/src/abi.rs:
providers/verbs/loader/src/convert.rs:
providers/verbs/loader/src/error.rs:
providers/verbs/loader/src/handles.rs:
providers/verbs/loader/src/setup.rs:
