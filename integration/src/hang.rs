//! What hung processes were doing, for the failure message of a test that gave up waiting:
//! CI keeps only the output, and a hang that shows up once in a hundred runs must explain
//! itself the first time.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

/// The longest report (CI shows a part of a failing test's output).
const REPORT_LIMIT: usize = 48 << 10;
/// Frames shown per thread: where it waits, and the program's call that got it there.
const FRAMES: usize = 14;

/// The SAN connections the preloaded processes published in `stat_dir` (when given); then
/// for each of `pids`: every thread's name, scheduler state and kernel wait channel and,
/// where `gdb` is installed and may attach, its innermost stack frames. Call before killing
/// them.
pub fn report(pids: &[u32], stat_dir: Option<&Path>) -> String {
    let mut text = String::new();
    // The published sockets first: one line per connection of every process says where a
    // stuck connection's bytes are, and a cut report must not lose them to stack frames.
    if let Some(dir) = stat_dir {
        text.push_str(&published(dir));
    }
    for &pid in pids {
        let _ = writeln!(text, "== pid {pid}: {}", command_line(pid));
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            let _ = writeln!(text, "   (gone)");
            continue;
        };
        for task in tasks.flatten() {
            let dir = task.path();
            let read = |name: &str| {
                std::fs::read_to_string(dir.join(name))
                    .map(|s| s.trim().to_owned())
                    .unwrap_or_default()
            };
            // `stat`: "tid (comm) STATE …"; the name may hold spaces, the state follows ')'.
            let stat = read("stat");
            let state = stat.rsplit_once(") ").map_or("?", |(_, rest)| &rest[..1]);
            let _ = writeln!(
                text,
                "   task {} {:?} state {state} wchan {}",
                task.file_name().to_string_lossy(),
                read("comm"),
                read("wchan")
            );
        }
        text.push_str(&stacks(pid));
    }
    if text.len() > REPORT_LIMIT {
        let mut cut = REPORT_LIMIT;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push_str("\n   (report cut)\n");
    }
    text
}

/// [`report`] on a process that did not finish, with every preloaded process that publishes
/// where it does (its `SANDIRECT_STAT_DIR`): the peer a hang waits on is usually one of them.
pub fn report_for(pid: u32) -> String {
    let stat_dir = std::fs::read(format!("/proc/{pid}/environ"))
        .ok()
        .and_then(|raw| {
            raw.split(|&b| b == 0).find_map(|entry| {
                let value = entry.strip_prefix(b"SANDIRECT_STAT_DIR=")?;
                Some(std::path::PathBuf::from(
                    String::from_utf8_lossy(value).into_owned(),
                ))
            })
        });
    let mut pids = vec![pid];
    if let Some(dir) = stat_dir.as_deref() {
        pids.extend(
            publishing_pids(dir)
                .into_iter()
                .filter(|&other| other != pid),
        );
    }
    report(&pids, stat_dir.as_deref())
}

/// The pids of the preloaded processes that publish into `stat_dir` (one file per pid).
pub fn publishing_pids(stat_dir: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_dir(stat_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

fn command_line(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            raw.split(|&b| b == 0)
                .filter(|arg| !arg.is_empty())
                .map(|arg| String::from_utf8_lossy(arg).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Every thread's innermost frames, by gdb in batch mode (bounded by `timeout`), reduced to
/// function names and source lines.
fn stacks(pid: u32) -> String {
    let output = Command::new("timeout")
        .args(["30", "gdb", "-nx", "-batch", "-p", &pid.to_string()])
        .args(["-ex", "set pagination off"])
        .args(["-ex", &format!("thread apply all bt {FRAMES}")])
        .output();
    let Ok(output) = output else {
        return "   (no stacks: gdb or timeout not installed)\n".into();
    };
    let mut text = String::new();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        if line.starts_with("Thread ") {
            let _ = writeln!(text, "   {line}");
        } else if let Some(frame) = line.strip_prefix('#') {
            let _ = writeln!(text, "     #{}", frame_summary(frame));
        }
    }
    if text.is_empty() {
        let error = String::from_utf8_lossy(&output.stderr);
        let last = error.lines().last().unwrap_or("no output");
        let _ = writeln!(text, "   (no stacks: {last})");
    }
    text
}

/// "3  0x… in std::io::Write::write_all<…> (self=…, buf=…) at library/std/src/io/mod.rs:1877"
/// → "3 std::io::Write::write_all<…> at library/std/src/io/mod.rs:1877".
fn frame_summary(frame: &str) -> String {
    let (number, rest) = frame.split_once(' ').unwrap_or((frame, ""));
    let rest = rest.trim_start();
    let rest = rest.split_once(" in ").map_or(rest, |(_, after)| after);
    let function = rest.split(" (").next().unwrap_or(rest);
    match rest
        .rsplit_once(" at ")
        .or_else(|| rest.rsplit_once(" from "))
    {
        Some((_, place)) => format!("{number} {function} at {place}"),
        None => format!("{number} {function}"),
    }
}

/// The record flags a hang report shows (where a stuck connection's bytes are), by name.
fn flag_names(flags: u32) -> String {
    use preload_core::record::flags;
    let names = [
        (flags::SAN_HANDSHAKING, "handshaking"),
        (flags::SAN_HOLDING, "holding-sent-bytes"),
        (flags::SAN_PROVIDER_QUEUED, "provider-queued"),
        (flags::NONBLOCK, "nonblock"),
        (flags::SHUT_WR, "shut-wr"),
        (flags::SHUT_RD, "shut-rd"),
    ]
    .map(|(bit, name)| (u64::from(bit), name));
    crate::bit_names(u64::from(flags), &names, ",", "-")
}

fn published(stat_dir: &Path) -> String {
    let mut text = String::from(
        "== published sockets (pid fd state path bypass local->peer counters flags)\n",
    );
    for pid in publishing_pids(stat_dir) {
        let path = stat_dir.join(pid.to_string());
        match preload_core::stats::read_file(&path) {
            Ok(Ok(connections)) => {
                for c in connections {
                    let _ = writeln!(
                        text,
                        "   {pid} {} {:?} {:?} {:?} {:?}->{:?} {:?} {}",
                        c.fd,
                        c.state,
                        c.path,
                        c.bypass,
                        c.local,
                        c.peer,
                        c.counters,
                        flag_names(c.flags)
                    );
                }
            }
            Ok(Err(skipped)) => {
                let _ = writeln!(text, "   {pid}: skipped ({skipped:?})");
            }
            Err(error) => {
                let _ = writeln!(text, "   {pid}: {error}");
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_reduced_to_function_and_place() {
        assert_eq!(
            frame_summary(
                "3  0x00005632842e2202 in std::io::Write::write_all<std::net::tcp::TcpStream> \
                 (self=0x7ffd, buf=...) at /rustc/x/library/std/src/io/mod.rs:1877"
            ),
            "3 std::io::Write::write_all<std::net::tcp::TcpStream> at \
             /rustc/x/library/std/src/io/mod.rs:1877"
        );
        assert_eq!(
            frame_summary("0  0x00007fc6 in __libc_send (fd=3, len=8) at ../send.c:28"),
            "0 __libc_send at ../send.c:28"
        );
        assert_eq!(
            frame_summary("1  0x00007f in epoll_wait () from /lib/x86_64-linux-gnu/libc.so.6"),
            "1 epoll_wait at /lib/x86_64-linux-gnu/libc.so.6"
        );
    }

    #[test]
    fn a_sleeping_process_is_reported_with_its_threads() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let stat = format!("/proc/{}/stat", child.id());
        let asleep = (0..500).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            std::fs::read_to_string(&stat).is_ok_and(|s| s.contains(") S "))
        });
        let text = report(&[child.id()], None);
        let _ = child.kill();
        let _ = child.wait();
        assert!(asleep, "sleep never slept");
        assert!(
            text.contains(&format!("== pid {}: sleep 30", child.id())),
            "{text}"
        );
        assert!(text.contains("\"sleep\" state S"), "{text}");
        let gdb = Command::new("gdb").arg("--version").output();
        if gdb.is_ok_and(|out| out.status.success()) {
            assert!(text.contains("nanosleep at "), "{text}");
        }
    }
}
