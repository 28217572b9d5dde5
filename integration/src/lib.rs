//! Helpers shared by the conformance program and the integration tests: thin, checked wrappers
//! over `libc` socket calls (the conformance suite exercises exactly the calls C programs make),
//! and locating the build products.

pub mod apps;

use std::ffi::c_int;
use std::path::PathBuf;

/// The symbolic name of an errno value (stable across runs, unlike messages).
pub fn errno_name(errno: c_int) -> String {
    let name = match errno {
        0 => "0",
        libc::EBADF => "EBADF",
        libc::ENOTSOCK => "ENOTSOCK",
        libc::EINPROGRESS => "EINPROGRESS",
        libc::ECONNREFUSED => "ECONNREFUSED",
        libc::ECONNRESET => "ECONNRESET",
        libc::EAGAIN => "EAGAIN",
        libc::EINTR => "EINTR",
        libc::EINVAL => "EINVAL",
        libc::EPIPE => "EPIPE",
        libc::ENOTCONN => "ENOTCONN",
        libc::EISCONN => "EISCONN",
        libc::EALREADY => "EALREADY",
        libc::ENOSYS => "ENOSYS",
        libc::ELOOP => "ELOOP",
        libc::EEXIST => "EEXIST",
        libc::ENOENT => "ENOENT",
        libc::EMFILE => "EMFILE",
        libc::EFAULT => "EFAULT",
        libc::ESPIPE => "ESPIPE",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        other => return format!("errno{other}"),
    };
    name.to_owned()
}

/// The calling thread's errno.
pub fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// `rc` as text: the value when non-negative, else the errno name.
pub fn outcome(rc: isize) -> String {
    if rc < 0 {
        errno_name(errno())
    } else {
        rc.to_string()
    }
}

/// Waits for `child` (stdout and stderr piped) up to `timeout` and returns its stdout. A
/// failed exit or a hang is a test failure that shows everything the child printed (a hang
/// kills it first).
pub fn finish_child(
    mut child: std::process::Child,
    what: &str,
    timeout: std::time::Duration,
) -> String {
    use std::io::Read;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let mut out = String::new();
            if let Some(mut stdout) = child.stdout.take() {
                stdout.read_to_string(&mut out).expect("read stdout");
            }
            let mut err = String::new();
            if let Some(mut stderr) = child.stderr.take() {
                stderr.read_to_string(&mut err).expect("read stderr");
            }
            assert!(status.success(), "{what} failed ({status}):\n{out}\n{err}");
            return out;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{what} hung");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The workspace's target directory (honours `CARGO_TARGET_DIR`).
pub fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
}

/// The profile directory the tests were built in (`debug` or `release`).
pub fn profile_dir() -> PathBuf {
    let profile = if cfg!(debug_assertions) {
        "debug"
    } else {
        "release"
    };
    target_dir().join(profile)
}

/// The data path this process published for its connected socket `fd` (`tcp` natively or
/// when nothing is published; `san-shm` for the intra-host SAN), for the test programs that
/// report their own paths.
pub fn published_path_of_fd(fd: c_int) -> String {
    published_path_where(|c| c.fd == fd)
}

/// As [`published_path_of_fd`], for the first connected socket `matches` picks.
pub fn published_path_where(
    matches: impl Fn(&preload_core::stats::ConnectionInfo) -> bool,
) -> String {
    use preload_core::record::{DataPath, SocketState};
    let Some(dir) = preload_core::stats::default_dir() else {
        return "tcp".into();
    };
    let path = dir.join(std::process::id().to_string());
    let Ok(Ok(connections)) = preload_core::stats::read_file(&path) else {
        return "tcp".into();
    };
    connections
        .iter()
        .filter(|c| c.state == SocketState::San || c.state == SocketState::ConnectedTcp)
        .find(|c| matches(c))
        .map_or_else(
            || "tcp".into(),
            |c| match c.path {
                DataPath::SanShm => "san-shm".into(),
                other => other.label().to_owned(),
            },
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_names_are_symbolic() {
        assert_eq!(errno_name(libc::EBADF), "EBADF");
        assert_eq!(errno_name(4242), "errno4242");
        assert_eq!(outcome(7), "7");
    }
}
