//! The segment and stats directories under running processes: each process opens them once,
//! checks them through the open descriptor and works relative to it from then on. Whoever may
//! write the parent of an overridden directory (`SANDIRECT_SHM_DIR`, `SANDIRECT_STAT_DIR` set
//! to a path outside the sticky `/dev/shm`) can rename the directory away and put another
//! directory, or a symbolic link, at its path; the processes must go on working in the
//! directory they checked, never create, remove or replace anything in what was put there,
//! and carry every byte intact.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

use preload_core::discovery::ConnectionKey;

const SAN_ECHO: &str = env!("CARGO_BIN_EXE_san_echo");

/// Bytes each round's client streams and reads back.
const BYTES: usize = 1 << 20;

/// A test's private directories: the stats and segment directories the processes are told
/// of, and room beside them for what the test swaps in.
struct Dirs {
    base: PathBuf,
    stat: PathBuf,
    shm: PathBuf,
}

impl Dirs {
    fn new(name: &str) -> Dirs {
        let base =
            std::env::temp_dir().join(format!("sandirect-dirs-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        private_dir(&base);
        let dirs = Dirs {
            stat: base.join("stat"),
            shm: base.join("shm"),
            base,
        };
        private_dir(&dirs.stat);
        private_dir(&dirs.shm);
        dirs
    }

    /// A path beside the directories, for what the test moves or puts there.
    fn beside(&self, name: &str) -> PathBuf {
        self.base.join(name)
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }
}

/// Creates `path` as a directory only its owner may use (what the preload accepts).
fn private_dir(path: &Path) {
    std::fs::create_dir(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).unwrap();
}

/// Renames the directory at `path` to `away` and puts a fresh private directory at `path`.
fn swap_in_directory(path: &Path, away: &Path) {
    std::fs::rename(path, away).unwrap();
    private_dir(path);
}

fn preloaded(dirs: &Dirs) -> Command {
    let mut command = Command::new(SAN_ECHO);
    command
        .env_remove("SANDIRECT_CONFIG")
        .env_remove("SANDIRECT_MODE")
        .env_remove("SANDIRECT_SAN")
        .env("SANDIRECT_STAT_DIR", &dirs.stat)
        .env("SANDIRECT_SHM_DIR", &dirs.shm)
        .env("LD_PRELOAD", &integration::apps::products().library)
        .stderr(Stdio::piped());
    command
}

/// A preloaded `san_echo` server for `connections` connections and a preloaded client that
/// makes them one after another, each round after the first when the test says so: the test
/// changes the directories between rounds, under processes that are running.
struct EchoRounds {
    server: Child,
    client: Child,
    client_in: Option<ChildStdin>,
    client_out: BufReader<ChildStdout>,
    reports: Vec<String>,
}

impl EchoRounds {
    /// Starts both and runs the first round.
    fn start(dirs: &Dirs, rounds: usize) -> EchoRounds {
        let mut server = preloaded(dirs)
            .args(["server", "client-first", &rounds.to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut server_out = BufReader::new(server.stdout.take().unwrap());
        let port = integration::read_port(&mut server_out);
        server.stdout = Some(server_out.into_inner());
        let mut client = preloaded(dirs)
            .args([
                "client",
                &port,
                "client-first",
                &BYTES.to_string(),
                &rounds.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let client_in = client.stdin.take();
        let client_out = BufReader::new(client.stdout.take().unwrap());
        let mut echo = EchoRounds {
            server,
            client,
            client_in,
            client_out,
            reports: Vec::new(),
        };
        echo.read_report();
        echo
    }

    fn read_report(&mut self) {
        let mut line = String::new();
        // The client ends the line, or exits (end of file): bounded by its own run.
        self.client_out.read_line(&mut line).unwrap();
        assert!(
            line.starts_with("client ok"),
            "round {} of the client: {line:?}",
            self.reports.len() + 1
        );
        self.reports.push(line.trim().to_owned());
    }

    /// The next round.
    fn next_round(&mut self) {
        let input = self.client_in.as_mut().expect("client still running");
        input.write_all(b"next\n").unwrap();
        input.flush().unwrap();
        self.read_report();
    }

    /// Waits for both to exit; returns (server reports, client reports).
    fn finish(mut self) -> (Vec<String>, Vec<String>) {
        drop(self.client_in.take());
        self.client.stdout = Some(self.client_out.into_inner());
        let client_rest = integration::finish_child(self.client, "client", Duration::from_secs(60));
        assert!(
            client_rest.trim().is_empty(),
            "client said more: {client_rest}"
        );
        let server = integration::finish_child(self.server, "server", Duration::from_secs(60));
        let server_reports = server.lines().map(str::to_owned).collect();
        (server_reports, self.reports)
    }
}

/// Every report: `ok`, all the bytes, the same checksum on both ends of each round, and the
/// SAN path on both ends when `path` says so.
fn check_reports(server: &[String], client: &[String], rounds: usize, path: Option<&str>) {
    assert_eq!(server.len(), rounds, "server reports: {server:#?}");
    assert_eq!(client.len(), rounds, "client reports: {client:#?}");
    for (round, (server, client)) in server.iter().zip(client).enumerate() {
        for line in [server, client] {
            assert!(
                line.contains(&format!(" ok bytes={BYTES} ")),
                "round {}: {line}",
                round + 1
            );
            if let Some(path) = path {
                assert!(
                    line.ends_with(&format!("path={path}")),
                    "round {}: expected path {path}: {line}",
                    round + 1
                );
            }
        }
        let checksum = |line: &str| {
            line.split_whitespace()
                .find(|word| word.starts_with("checksum="))
                .map(str::to_owned)
        };
        assert_eq!(checksum(server), checksum(client), "round {}", round + 1);
    }
}

/// Names created in (or moved into) watched directories, as the kernel reports them
/// (`inotify`): segments live for a moment only, so a later listing would not see them.
struct CreationWatch {
    inotify: OwnedFd,
    watched: BTreeMap<i32, PathBuf>,
}

impl CreationWatch {
    fn new() -> CreationWatch {
        // SAFETY: plain inotify_init1(2); the descriptor is owned below.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        assert!(
            fd >= 0,
            "inotify_init1: {}",
            std::io::Error::last_os_error()
        );
        CreationWatch {
            // SAFETY: the kernel just returned this descriptor; nothing else owns it.
            inotify: unsafe { OwnedFd::from_raw_fd(fd) },
            watched: BTreeMap::new(),
        }
    }

    /// Watches the directory at `path` (the one there now: a watch follows the directory, not
    /// the name).
    fn watch(&mut self, path: &Path) {
        let name = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path; plain inotify_add_watch(2).
        let wd = unsafe {
            libc::inotify_add_watch(
                self.inotify.as_raw_fd(),
                name.as_ptr(),
                libc::IN_CREATE | libc::IN_MOVED_TO,
            )
        };
        assert!(
            wd >= 0,
            "watch {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
        self.watched.insert(wd, path.to_owned());
    }

    /// Every name created in each watched directory so far, by the directory's path.
    fn created(&self) -> BTreeMap<PathBuf, Vec<String>> {
        let mut created: BTreeMap<PathBuf, Vec<String>> = self
            .watched
            .values()
            .map(|path| (path.clone(), Vec::new()))
            .collect();
        let mut buffer = vec![0u8; 64 << 10];
        // Each read returns at least one event until the queue is empty (EAGAIN); the queue
        // holds at most the kernel's bound of events.
        for _ in 0..100_000 {
            // SAFETY: the kernel writes at most `buffer.len()` bytes into `buffer`.
            let n = unsafe {
                libc::read(
                    self.inotify.as_raw_fd(),
                    buffer.as_mut_ptr().cast(),
                    buffer.len(),
                )
            };
            if n <= 0 {
                break;
            }
            let mut at = 0;
            let header = std::mem::size_of::<libc::inotify_event>();
            while at + header <= n as usize {
                // SAFETY: the kernel wrote a whole event header at `at` (events are packed
                // and each fits the read); read unaligned, as the buffer is bytes.
                let event: libc::inotify_event =
                    unsafe { std::ptr::read_unaligned(buffer.as_ptr().add(at).cast()) };
                let name_bytes = &buffer[at + header..at + header + event.len as usize];
                let name = CStr::from_bytes_until_nul(name_bytes)
                    .map(|name| name.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let creation = event.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0;
                if let Some(dir) = self.watched.get(&event.wd).filter(|_| creation) {
                    created.entry(dir.clone()).or_default().push(name);
                }
                at += header + event.len as usize;
            }
        }
        created
    }
}

#[test]
fn a_segment_directory_swapped_under_running_processes_is_not_followed() {
    let dirs = Dirs::new("shm");
    let rounds = 3;
    // Round 1: both processes open (and check) the segment directory.
    let mut echo = EchoRounds::start(&dirs, rounds);
    // Another directory at the path, the checked one renamed away.
    let original = dirs.beside("shm-original");
    swap_in_directory(&dirs.shm, &original);
    let mut watch = CreationWatch::new();
    watch.watch(&original);
    watch.watch(&dirs.shm);
    echo.next_round();
    // A symbolic link at the path, to a directory of the same user.
    let decoy = dirs.beside("decoy");
    private_dir(&decoy);
    watch.watch(&decoy);
    std::fs::remove_dir(&dirs.shm).unwrap();
    std::os::unix::fs::symlink(&decoy, &dirs.shm).unwrap();
    echo.next_round();
    let (server, client) = echo.finish();

    let created = watch.created();
    for swapped_in in [&dirs.shm, &decoy] {
        assert_eq!(
            created[swapped_in],
            Vec::<String>::new(),
            "nothing may be created in what was put at the path ({}); all creations: {created:#?}",
            swapped_in.display()
        );
    }
    // Both connections made after the swaps were set up in the directory the processes checked.
    let segments = created[&original]
        .iter()
        .filter(|name| ConnectionKey::parse_segment_name(name).is_some())
        .count();
    assert_eq!(
        segments, 2,
        "one segment per round after the swap in the original directory: {created:#?}"
    );
    check_reports(&server, &client, rounds, Some("san-shm"));
    // (The pending-ports table, shared by every connection, stays by design.)
    let left: Vec<_> = std::fs::read_dir(&original)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .filter(|name| name.to_str() != Some(san_shm::PENDING_PORTS_FILE))
        .collect();
    assert!(left.is_empty(), "segment files left behind: {left:?}");
}

#[test]
fn a_stats_directory_swapped_under_running_processes_is_not_followed() {
    let dirs = Dirs::new("stat");
    let rounds = 2;
    // Round 1: both processes publish their records (their stats files exist).
    let mut echo = EchoRounds::start(&dirs, rounds);
    let pids = [echo.server.id(), echo.client.id()];
    let original = dirs.beside("stat-original");
    swap_in_directory(&dirs.stat, &original);
    // Files under the names the processes' own files have, in what was put at the path.
    let planted = b"not a stats file: the processes must leave it alone\n";
    for pid in pids {
        std::fs::write(dirs.stat.join(pid.to_string()), planted).unwrap();
    }
    echo.next_round();
    let (server, client) = echo.finish();
    // Each report's path is read back from the stats file by its path, which now names the
    // planted file: only bytes and checksums count here.
    check_reports(&server, &client, rounds, None);
    for pid in pids {
        assert_eq!(
            std::fs::read(dirs.stat.join(pid.to_string())).unwrap(),
            planted,
            "the file planted under process {pid}'s name was changed or removed"
        );
    }
    let left: Vec<_> = std::fs::read_dir(&original)
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert!(
        left.is_empty(),
        "each process removes its own stats file, from the directory it published in: {left:?} left"
    );
}
