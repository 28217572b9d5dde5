//! Small C programs that tests build with the system's `cc` and run natively and under the
//! preload, each in a private directory (stats and segments) so tests do not see each other.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// A fresh private directory for one test (`prefix` names the test file), with `stat/` and
/// `shm/` below it, all mode 0700.
pub fn private_dir(prefix: &str, name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("sandirect-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for sub in ["", "stat", "shm"] {
        let path = dir.join(sub);
        std::fs::create_dir_all(&path).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .unwrap();
    }
    dir
}

fn which_cc() -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("cc"))
        .find(|path| path.is_file())
}

/// Builds the C program `source` in `dir` with `flags` (e.g. `-pthread`); `None` without a C
/// compiler.
pub fn build(dir: &Path, name: &str, source: &str, flags: &[&str]) -> Option<PathBuf> {
    let cc = which_cc()?;
    let c = dir.join(format!("{name}.c"));
    std::fs::write(&c, source).unwrap();
    let exe = dir.join(name);
    let built = Command::new(cc)
        .arg("-O1")
        .args(flags)
        .arg("-o")
        .arg(&exe)
        .arg(&c)
        .status()
        .unwrap();
    assert!(built.success(), "cc {name}.c");
    Some(exe)
}

/// Runs `exe args` natively or preloaded (the SAN path on, the private directories of `dir`),
/// bounded by `limit`; its stdout.
pub fn run(exe: &Path, args: &[&str], preload: bool, dir: &Path, limit: Duration) -> String {
    let mut command = Command::new(exe);
    command
        .args(args)
        .env_remove("LD_PRELOAD")
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env("SANDIRECT_STAT_DIR", dir.join("stat"))
        .env("SANDIRECT_SHM_DIR", dir.join("shm"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if preload {
        command.env("LD_PRELOAD", &crate::apps::products().library);
    }
    let child = command.spawn().unwrap();
    crate::finish_child(child, "C program", limit)
}
