//! Generates the linker version script from the hook table (the same inventory
//! `sandirect symbols` prints), so the shared object exports exactly the table and nothing
//! else, whatever a dependency marks `#[no_mangle]`.

use std::fmt::Write as _;

fn main() {
    let mut script = String::from("{\n  global:\n");
    for name in preload_core::inventory::exported_names() {
        let _ = writeln!(script, "    {name};");
    }
    script.push_str("  local:\n    *;\n};\n");
    let out_dir = std::env::var_os("OUT_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_default();
    let path = out_dir.join("sandirect.map");
    if let Err(error) = std::fs::write(&path, script) {
        panic!("cannot write {}: {error}", path.display());
    }
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        path.display()
    );
    println!("cargo:rerun-if-changed=build.rs");
}
