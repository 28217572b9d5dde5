//! Helpers shared by the conformance program and the integration tests: thin, checked wrappers
//! over `libc` socket calls (the conformance suite exercises exactly the calls C programs make),
//! locating the build products, and the test data both ends of a connection regenerate
//! ([`pattern`]).

pub mod apps;
pub mod c_programs;
pub mod hang;
pub mod pattern;

use std::ffi::c_int;
use std::path::PathBuf;

/// Reads the first line a test server prints, `port N`, and returns N as it was written
/// (the clients take it on their command lines); panics with what the server printed instead.
pub fn read_port(server_output: &mut impl std::io::BufRead) -> String {
    let mut first = String::new();
    server_output
        .read_line(&mut first)
        .expect("read the server's output");
    first
        .trim()
        .strip_prefix("port ")
        .unwrap_or_else(|| panic!("the server prints its port first, not {first:?}"))
        .to_owned()
}

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
        libc::ENOBUFS => "ENOBUFS",
        other => return format!("errno{other}"),
    };
    name.to_owned()
}

/// The names of the bits of `value` that are set, in `names` order, joined by `separator`;
/// `none` when no named bit is set (flag words in reports: poll events, record flags).
pub fn bit_names(value: u64, names: &[(u64, &str)], separator: &str, none: &str) -> String {
    let set: Vec<&str> = names
        .iter()
        .filter(|(bit, _)| value & bit != 0)
        .map(|(_, name)| *name)
        .collect();
    if set.is_empty() {
        none.to_owned()
    } else {
        set.join(separator)
    }
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
    child: std::process::Child,
    what: &str,
    timeout: std::time::Duration,
) -> String {
    wait_child(child, what, timeout).unwrap_or_else(|failure| panic!("{failure}"))
}

/// [`finish_child`] without the panic: the child's stdout, or what a failure message shows
/// (everything it printed; for a hang, what it and its peers were doing). For tests that
/// must see both ends of a pair before they fail: the side that gives up first is often not
/// the one that went wrong.
pub fn wait_child(
    mut child: std::process::Child,
    what: &str,
    timeout: std::time::Duration,
) -> Result<String, String> {
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
            if !status.success() {
                return Err(format!("{what} failed ({status}):\n{out}\n{err}"));
            }
            return Ok(out);
        }
        if std::time::Instant::now() > deadline {
            let report = hang::report_for(child.id());
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "{what} hung; what it and its peers were doing:\n{report}"
            ));
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

/// The connections this process published (`None` natively, or when nothing is published
/// or the record cannot be read): what the test programs report their own paths from.
pub fn own_published_connections() -> Option<Vec<preload_core::stats::ConnectionInfo>> {
    own_published_file()?.ok()?.ok()
}

/// This process's record file as read (`None` without a stats directory).
type PublishedFile =
    std::io::Result<Result<Vec<preload_core::stats::ConnectionInfo>, preload_core::stats::Skipped>>;

fn own_published_file() -> Option<PublishedFile> {
    let dir = preload_core::stats::default_dir()?;
    Some(preload_core::stats::read_file(
        &dir.join(std::process::id().to_string()),
    ))
}

/// The data path this process published for its connected socket `fd` (`tcp` natively or
/// when nothing is published; `san-shm` for the intra-host SAN), for the test programs that
/// report their own paths.
pub fn published_path_of_fd(fd: c_int) -> String {
    published_path_where(|c| c.fd == fd)
}

/// As [`published_path_of_fd`], for the first connected socket `matches` picks. When the
/// process published records but none matches, or its record file cannot be read, the
/// answer says so after `tcp?` (a report that cannot be trusted must not pass as `tcp`).
pub fn published_path_where(
    matches: impl Fn(&preload_core::stats::ConnectionInfo) -> bool,
) -> String {
    use preload_core::record::{DataPath, SocketState};
    let Some(file) = own_published_file() else {
        return "tcp".into();
    };
    let connections = match file {
        // Natively nothing is published.
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return "tcp".into(),
        Err(error) => return format!("tcp?unreadable:{error}"),
        Ok(Err(skipped)) => return format!("tcp?skipped:{skipped:?}"),
        Ok(Ok(connections)) => connections,
    };
    let connected = |c: &&preload_core::stats::ConnectionInfo| {
        c.state == SocketState::San || c.state == SocketState::ConnectedTcp
    };
    match connections.iter().filter(connected).find(|c| matches(c)) {
        Some(c) => match c.path {
            DataPath::SanShm => "san-shm".into(),
            other => other.label().to_owned(),
        },
        None if connections.is_empty() => "tcp".into(),
        None => {
            let records: Vec<String> = connections
                .iter()
                .map(|c| format!("{:?}/{:?}/{:?}->{:?}", c.state, c.path, c.local, c.peer))
                .collect();
            format!("tcp?unmatched:{}", records.join(","))
        }
    }
}

/// The byte counters (indexed by [`preload_core::record::Counter`]) this process published
/// for its connected socket `fd`; `None` natively or when nothing is published.
pub fn published_counters_of_fd(fd: c_int) -> Option<[u64; 6]> {
    use preload_core::record::SocketState;
    own_published_connections()?
        .iter()
        .filter(|c| c.state == SocketState::San || c.state == SocketState::ConnectedTcp)
        .find(|c| c.fd == fd)
        .map(|c| c.counters)
}

/// Prints one line per connection of a many-connection test program, `SIDE I ok REPORT` or
/// `SIDE I failed: ERROR` (the tests parse them), then exits with status 1 if any failed.
pub fn print_connection_reports<E: std::fmt::Display>(side: &str, results: Vec<Result<String, E>>) {
    let mut failed = false;
    for (i, result) in results.into_iter().enumerate() {
        match result {
            Ok(report) => println!("{side} {i} ok {report}"),
            Err(error) => {
                failed = true;
                println!("{side} {i} failed: {error}");
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}

/// A TCP socket bound to `local`:0 and connected to `server` (what a client with a source
/// address does; the kernel picks the port at bind): the cross-host programs of the VM tests
/// pick which of the guest's two addresses they send from.
pub fn connect_from(
    local: std::net::IpAddr,
    server: std::net::SocketAddr,
) -> std::io::Result<std::net::TcpStream> {
    use std::os::fd::FromRawFd;
    if local.is_ipv4() != server.is_ipv4() {
        return Err(std::io::Error::other(
            "local and server addresses of different families",
        ));
    }
    let family = if local.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2); the descriptor is owned by the stream below.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor owned by nobody else.
    let stream = unsafe { std::net::TcpStream::from_raw_fd(fd) };
    let (bind, len) =
        preload_core::discovery::socket_addr_to_raw(std::net::SocketAddr::new(local, 0));
    // SAFETY: a valid socket address of `len` bytes.
    if unsafe { libc::bind(fd, (&bind as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (peer, len) = preload_core::discovery::socket_addr_to_raw(server);
    // SAFETY: as above.
    if unsafe { libc::connect(fd, (&peer as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stream)
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

    #[test]
    fn bit_names_list_the_named_bits_set_in_order() {
        let names = [(1, "IN"), (4, "OUT"), (8, "ERR")];
        assert_eq!(bit_names(8 | 1 | 2, &names, "|", "none"), "IN|ERR");
        assert_eq!(bit_names(2, &names, "|", "none"), "none");
        assert_eq!(bit_names(4, &names, ",", "-"), "OUT");
    }
}
