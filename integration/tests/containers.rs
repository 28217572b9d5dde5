//! sandirect in containers, with the machine's Docker Engine (no registry: the base image is a
//! local debootstrap, see scripts/container/base-image.sh):
//!
//! * the Debian package, built by the image's builder stage (scripts/package.sh), installs
//!   into a clean container of the base image and `sandirect run` finds the installed
//!   library there;
//! * the image (scripts/container/Dockerfile) lists the interposed symbols, and a preloaded
//!   echo server and client in one container use the intra-host SAN;
//! * servers and clients in separate containers on one bridge network: an echo pair, redis
//!   with redis-cli and redis-benchmark, iperf3, on SAN-shm with a shared segment volume
//!   (every byte or value checked) and on TCP without it (`peer-not-capable`), as `sandirect
//!   stat` run on the host shows them (the host's pids; as root, else `docker exec`);
//! * the compose example (docs/compose), run as users run it.
//!
//! All are ignored by a plain `cargo test`: the first run builds the base image, installs the
//! builder's toolchain and cargo-deb and builds the workspace in release (about 6 minutes on 2
//! cores in all); a changed source rebuilds from the workspace build on (a few minutes),
//! unchanged sources reuse every cached layer (under a minute in all). `scripts/test-all.sh`
//! runs them as a stage of its own wherever a Docker engine answers and says in one line that
//! it skips them where none does (`--containers` makes them required, `--no-containers` skips
//! them); alone, run `cargo test -p integration --test containers -- --ignored`. Run so without
//! an engine, each skips, saying why.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use preload_core::inventory;

const SAN_ECHO: &str = env!("CARGO_BIN_EXE_san_echo");
/// Tags private to this test, so a user's own `sandirect:latest` is never replaced.
const IMAGE: &str = "sandirect:containers-test";
const BUILDER: &str = "sandirect-builder:containers-test";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

/// Whether a Docker engine answers; prints why the test is skipped when not.
fn docker_available(test: &str) -> bool {
    let answer = Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .output();
    match answer {
        Ok(output) if output.status.success() => true,
        Ok(output) => {
            eprintln!(
                "skipping {test}: no Docker engine answers (`docker version`: {})",
                String::from_utf8_lossy(&output.stderr).trim()
            );
            false
        }
        Err(error) => {
            eprintln!("skipping {test}: no Docker engine (`docker` cannot run: {error})");
            false
        }
    }
}

/// Runs `command` to completion; panics with its output when it fails.
fn checked(mut command: Command, what: &str) -> Output {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The project's image build script for `target` (a stage, or the whole image); prints the
/// build's output only when it fails.
fn build_image(tag: &str, target: Option<&str>) {
    let mut command = Command::new("bash");
    command
        .arg(workspace().join("scripts/container/build-image.sh"))
        .args(["-t", tag]);
    if let Some(target) = target {
        command.args(["--target", target]);
    }
    checked(command, &format!("building {tag}"));
}

/// The base image's tag (built by the project's script when missing).
fn base_image() -> String {
    let mut command = Command::new("bash");
    command.arg(workspace().join("scripts/container/base-image.sh"));
    stdout(&checked(command, "making the base image"))
        .trim()
        .to_owned()
}

/// Builds the builder stage and then the image once for both tests (they run in parallel;
/// the second waits for the first's build): the builder stage's layers are reused by the
/// image's build.
fn images() -> &'static (String, PathBuf) {
    static IMAGES: OnceLock<(String, PathBuf)> = OnceLock::new();
    IMAGES.get_or_init(|| {
        let base = base_image();
        build_image(BUILDER, Some("builder"));
        build_image(IMAGE, None);
        // The package, out of the builder stage's /out.
        let dir = std::env::temp_dir().join(format!("sandirect-deb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut create = Command::new("docker");
        create.args(["create", BUILDER]);
        let container = stdout(&checked(create, "docker create")).trim().to_owned();
        let mut copy = Command::new("docker");
        copy.args(["cp", &format!("{container}:/out/."), dir.to_str().unwrap()]);
        let copied = copy.output();
        let _ = Command::new("docker")
            .args(["rm", "-f", &container])
            .output();
        let copied = copied.expect("docker cp");
        assert!(copied.status.success(), "docker cp: {copied:?}");
        (base, dir)
    })
}

/// `docker run --rm` of `image` with `args`; panics unless it succeeds.
fn docker_run(args: &[&str], what: &str) -> String {
    let mut command = Command::new("docker");
    command.args(["run", "--rm"]).args(args);
    stdout(&checked(command, what))
}

#[test]
#[ignore = "builds a Docker image (minutes); scripts/test-all.sh runs it where a Docker engine answers"]
fn the_package_installs_and_runs_in_a_clean_container() {
    if !docker_available("the_package_installs_and_runs_in_a_clean_container") {
        return;
    }
    let (base, deb_dir) = images();
    let debs: Vec<_> = std::fs::read_dir(deb_dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".deb"))
        .collect();
    assert_eq!(debs.len(), 1, "one package in the builder's /out: {debs:?}");
    let mount = format!("{}:/pkg:ro", deb_dir.display());
    // A clean container of the base image: dpkg alone installs it (its dependencies are in
    // every Debian system; rdma-core is only recommended). Then what a user would try first.
    let script = r#"set -e
dpkg -i /pkg/*.deb >/dev/null
echo "files:"; dpkg -L sandirect | grep -E '^/(usr/bin|usr/lib/sandirect|etc/sandirect|usr/share/man)/.'
echo "conffiles:"; cat /var/lib/dpkg/info/sandirect.conffiles
echo "help:"; sandirect --help
echo "man:"; zcat /usr/share/man/man1/sandirect.1.gz | grep -c '^\.SH'
echo "config:"; sandirect check-config /etc/sandirect/rules.conf
echo "preload:"; sandirect run -- sh -c 'realpath "$LD_PRELOAD"'
echo "maps:"; sandirect run -- grep -o '/usr/lib/sandirect/libsandirect.so' /proc/self/maps | sort -u
echo "stat:"; sandirect stat
"#;
    let out = docker_run(
        &["-v", &mount, base, "timeout", "120", "bash", "-c", script],
        "installing the package in a clean container",
    );
    for file in [
        "/usr/bin/sandirect",
        "/usr/lib/sandirect/libsandirect.so",
        "/usr/lib/sandirect/libsandirect_verbs.so",
        "/etc/sandirect/rules.conf",
        "/usr/share/man/man1/sandirect.1.gz",
    ] {
        assert!(
            out.lines().any(|line| line == file),
            "{file} not installed:\n{out}"
        );
    }
    let section = |name: &str| -> Vec<&str> {
        out.split(&format!("{name}:\n"))
            .nth(1)
            .unwrap_or_else(|| panic!("no {name} section:\n{out}"))
            .lines()
            .take_while(|line| !line.ends_with(':'))
            .collect()
    };
    assert_eq!(section("conffiles"), ["/etc/sandirect/rules.conf"], "{out}");
    assert!(
        out.contains("Usage: sandirect <COMMAND>"),
        "sandirect --help:\n{out}"
    );
    let man_sections: u32 = section("man")[0].trim().parse().unwrap();
    assert!(
        man_sections >= 5,
        "the man page has {man_sections} sections"
    );
    // The shipped rules are all comments: valid, and they change nothing.
    assert_eq!(
        section("config"),
        ["/etc/sandirect/rules.conf: 0 rule(s), valid"],
        "{out}"
    );
    // Found at the installed path (as ../lib/sandirect beside /usr/bin/sandirect), without
    // SANDIRECT_LIB, and loaded into the program.
    assert_eq!(
        section("preload"),
        ["/usr/lib/sandirect/libsandirect.so"],
        "{out}"
    );
    assert_eq!(
        section("maps"),
        ["/usr/lib/sandirect/libsandirect.so"],
        "{out}"
    );
}

#[test]
#[ignore = "builds a Docker image (minutes); scripts/test-all.sh runs it where a Docker engine answers"]
fn the_image_runs_a_preloaded_pair_over_the_san() {
    if !docker_available("the_image_runs_a_preloaded_pair_over_the_san") {
        return;
    }
    images();
    // The image's entrypoint is `sandirect run --`: the command runs preloaded.
    let names = docker_run(
        &[IMAGE, "sandirect", "symbols", "--names"],
        "sandirect symbols",
    );
    assert_eq!(
        names.lines().collect::<Vec<_>>(),
        inventory::exported_names(),
        "the image's inventory"
    );

    // Both ends of an echo in one container, each started by the entrypoint's preload, with
    // every setting at its default: the intra-host SAN (segments in the container's own
    // /dev/shm) carries the bytes. Once streamed in small writes (inline), once in one
    // blocking 8 MB write (a rendezvous). The last line says whether this engine's seccomp
    // profile lets the container use process_vm_readv (CMA): where it does not, the
    // rendezvous went through the segment's window.
    const PAIRS: [(&str, usize); 2] = [("client-first", 4 << 20), ("write-then-read", 8_000_000)];
    let mut script = String::from(
        r#"set -e
test -n "$LD_PRELOAD"
pair() {
  san_echo server "$1" >/tmp/server.out &
  server=$!
  for _ in $(seq 100); do grep -q '^port ' /tmp/server.out 2>/dev/null && break; sleep 0.1; done
  port=$(sed -n 's/^port //p' /tmp/server.out)
  san_echo client "$port" "$1" "$2"
  wait "$server"
  grep -v '^port ' /tmp/server.out
}
"#,
    );
    for (protocol, bytes) in PAIRS {
        script.push_str(&format!("echo {protocol}:; pair {protocol} {bytes}\n"));
    }
    script.push_str(
        r#"echo segments:; stat -c '%n %U %a' "/dev/shm/sandirect-$(id -u)"
echo cma:
probe='my $d = "\0" x 8; my $s = "sandirect";
exit(syscall(310, $$ + 0, pack("pQ", $d, 8), 1, pack("pQ", $s, 8), 1, 0) == 8 ? 0 : 1)'
if perl -e "$probe"; then echo allowed; else echo refused; fi
"#,
    );
    let mount = format!("{SAN_ECHO}:/usr/local/bin/san_echo:ro");
    // Docker's default capabilities and seccomp profile, then no capability at all
    // (the defaults include CAP_NET_RAW, among others).
    for caps in [&[][..], &["--cap-drop", "ALL"]] {
        let mut args = vec!["-v", &mount];
        args.extend_from_slice(caps);
        args.extend_from_slice(&[IMAGE, "timeout", "120", "bash", "-c", &script]);
        let out = docker_run(
            &args,
            &format!("a preloaded echo pair in the image {caps:?}"),
        );
        let section = |name: &str| -> Vec<&str> {
            out.split(&format!("{name}:\n"))
                .nth(1)
                .unwrap_or_else(|| panic!("no {name} section:\n{out}"))
                .lines()
                .take_while(|line| !line.ends_with(':'))
                .collect()
        };
        for (protocol, bytes) in PAIRS {
            let lines = section(protocol);
            for side in ["server", "client"] {
                let line = lines
                    .iter()
                    .find(|line| line.starts_with(side))
                    .unwrap_or_else(|| panic!("no {side} report for {protocol} {caps:?}:\n{out}"));
                assert!(
                    line.contains(&format!("ok bytes={bytes} ")),
                    "{protocol} {caps:?}: {line}"
                );
                assert!(
                    line.ends_with("path=san-shm"),
                    "{protocol} {caps:?}: {side} not on the SAN: {line}"
                );
            }
        }
        assert_eq!(
            section("segments"),
            ["/dev/shm/sandirect-0 root 700"],
            "{caps:?}"
        );
        eprintln!(
            "the pair in one container {caps:?}: on the SAN; process_vm_readv {}",
            section("cma")[0]
        );
    }
}

/// Removes the named Docker objects when dropped (containers, then the network and volume).
struct DockerObjects {
    containers: Vec<String>,
    network: String,
    volume: String,
}

impl Drop for DockerObjects {
    fn drop(&mut self) {
        for container in &self.containers {
            let _ = Command::new("docker")
                .args(["rm", "-f", container])
                .output();
        }
        let _ = Command::new("docker")
            .args(["network", "rm", &self.network])
            .output();
        let _ = Command::new("docker")
            .args(["volume", "rm", "-f", &self.volume])
            .output();
    }
}

/// A server and a client in two containers on one bridge network (separate network, pid and
/// mount namespaces, Docker's default seccomp profile and capabilities): with a volume both
/// mount as the segment directory they use the intra-host SAN (small writes inline, one 8 MB
/// write through the segment's window: CMA cannot cross pid namespaces), every byte checked;
/// without it they stay on TCP.
#[test]
#[ignore = "builds a Docker image (minutes); scripts/test-all.sh runs it where a Docker engine answers"]
fn two_containers_sharing_a_segment_volume_use_the_san() {
    if !docker_available("two_containers_sharing_a_segment_volume_use_the_san") {
        return;
    }
    images();
    let tag = format!("sandirect-test-{}", std::process::id());
    let mut objects = DockerObjects {
        containers: Vec::new(),
        network: tag.clone(),
        volume: tag.clone(),
    };
    let mut network = Command::new("docker");
    network.args(["network", "create", &tag]);
    checked(network, "docker network create");
    let mut volume = Command::new("docker");
    volume.args(["volume", "create", &tag]);
    checked(volume, "docker volume create");
    let echo = format!("{SAN_ECHO}:/usr/local/bin/san_echo:ro");
    let segments = format!("{tag}:/san");
    let cases = [
        (true, "client-first", 4 << 20, "path=san-shm"),
        (true, "write-then-read", 8_000_000, "path=san-shm"),
        (false, "client-first", 1 << 20, "path=TCP"),
    ];
    for (round, (shared, protocol, bytes, path)) in cases.into_iter().enumerate() {
        let server_name = format!("{tag}-server-{round}");
        objects.containers.push(server_name.clone());
        let mut args: Vec<String> = vec!["run".into(), "-d".into(), "--name".into()];
        args.push(server_name.clone());
        args.extend(["--network".into(), tag.clone(), "-v".into(), echo.clone()]);
        args.extend(["-e".into(), "SAN_ECHO_HOST=0.0.0.0".into()]);
        let mut client_args: Vec<String> = vec!["--network".into(), tag.clone()];
        client_args.extend(["-v".into(), echo.clone()]);
        if shared {
            for list in [&mut args, &mut client_args] {
                list.extend(["-v".into(), segments.clone()]);
                list.extend(["-e".into(), "SANDIRECT_SHM_DIR=/san".into()]);
            }
        }
        // The volume is the segment directory: private to the user the programs run as.
        args.extend([IMAGE.into(), "sh".into(), "-c".into()]);
        args.push(format!(
            "mkdir -p /san && chmod 700 /san && exec san_echo server {protocol}"
        ));
        let mut server = Command::new("docker");
        server.args(&args);
        checked(server, "docker run (server)");
        let mut port = None;
        for _ in 0..100 {
            let mut logs = Command::new("docker");
            logs.args(["logs", &server_name]);
            let text = stdout(&checked(logs, "docker logs"));
            port = text
                .lines()
                .find_map(|line| line.strip_prefix("port "))
                .map(str::to_owned);
            if port.is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let port = port.expect("the server container printed no port");
        let mut inspect = Command::new("docker");
        inspect.args([
            "inspect",
            "-f",
            "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
            &server_name,
        ]);
        let address = stdout(&checked(inspect, "docker inspect"))
            .trim()
            .to_owned();
        client_args.extend(["-e".into(), format!("SAN_ECHO_HOST={address}")]);
        client_args.extend([IMAGE.into(), "timeout".into(), "120".into()]);
        client_args.extend(["san_echo".into(), "client".into(), port, protocol.into()]);
        client_args.push(bytes.to_string());
        let args: Vec<&str> = client_args.iter().map(String::as_str).collect();
        let client = docker_run(&args, &format!("the client container ({protocol})"));
        let mut wait = Command::new("docker");
        wait.args(["wait", &server_name]);
        let status = stdout(&checked(wait, "docker wait")).trim().to_owned();
        let mut logs = Command::new("docker");
        logs.args(["logs", &server_name]);
        let server = stdout(&checked(logs, "docker logs"));
        assert_eq!(status, "0", "the server container failed:\n{server}");
        for (side, out) in [("client", client.as_str()), ("server", server.as_str())] {
            let line = out
                .lines()
                .find(|line| line.starts_with(side))
                .unwrap_or_else(|| {
                    panic!("no {side} report ({protocol}, shared {shared}):\n{out}")
                });
            assert!(
                line.contains(&format!("ok bytes={bytes} ")) && line.ends_with(path),
                "{protocol}, shared directory {shared}: {line}"
            );
        }
        eprintln!("two containers, shared directory {shared}, {protocol}: {path}");
    }
}

/// The image with the applications the tests run between containers (Debian's redis and
/// iperf3), built once on the test image.
const APPS_IMAGE: &str = "sandirect-apps:containers-test";

fn apps_image() -> &'static str {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        images();
        let dockerfile = format!(
            "FROM {IMAGE}\n\
             RUN apt-get update -qq \\\n \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
             redis-server redis-tools iperf3 >/dev/null \\\n \
             && rm -rf /var/lib/apt/lists/*\n"
        );
        let mut build = Command::new("docker")
            .args(["build", "-t", APPS_IMAGE, "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("docker build");
        build
            .stdin
            .take()
            .unwrap()
            .write_all(dockerfile.as_bytes())
            .unwrap();
        let output = build.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "building {APPS_IMAGE}:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    });
    APPS_IMAGE
}

/// A row of `sandirect stat`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct StatRow {
    pid: u32,
    fd: i32,
    state: String,
    role: String,
    local: String,
    peer: String,
    path: String,
    /// TCP-TX, TCP-RX, INLINE, RENDEZVOUS.
    bytes: [u64; 4],
    reason: String,
}

impl StatRow {
    /// Whether the connection is to or from `port`.
    fn port_is(&self, port: u16) -> bool {
        let suffix = format!(":{port}");
        self.local.ends_with(&suffix) || self.peer.ends_with(&suffix)
    }
}

fn stat_rows(text: &str) -> Vec<StatRow> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            // PID FD STATE ROLE LOCAL PEER PATH TCP-TX TCP-RX INLINE RENDEZVOUS REASON
            let columns: Vec<&str> = line.split_whitespace().collect();
            let number = |i: usize| columns.get(i)?.parse::<u64>().ok();
            Some(StatRow {
                pid: columns.first()?.parse().ok()?,
                fd: columns.get(1)?.parse().ok()?,
                state: columns.get(2)?.to_string(),
                role: columns.get(3)?.to_string(),
                local: columns.get(4)?.to_string(),
                peer: columns.get(5)?.to_string(),
                path: columns.get(6)?.to_string(),
                bytes: [number(7)?, number(8)?, number(9)?, number(10)?],
                reason: columns.get(11)?.to_string(),
            })
        })
        .collect()
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The host's pids of `container`'s processes.
fn host_pids(container: &str) -> Vec<u32> {
    let mut top = Command::new("docker");
    top.args(["top", container, "-eo", "pid"]);
    stdout(&checked(top, "docker top"))
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// What `sandirect stat` shows of `container`'s connections. As root: the workspace's
/// `sandirect stat`, run on the host with its defaults (what an operator runs), keeping the
/// rows of the container's processes by their host pids. Otherwise, where the host's command
/// cannot look into containers: `sandirect stat` inside the container.
fn stat_of(container: &str) -> Vec<StatRow> {
    if is_root() {
        let output = Command::new(&integration::apps::products().cli)
            .arg("stat")
            .env_remove("SANDIRECT_STAT_DIR")
            .output()
            .expect("sandirect stat on the host");
        assert!(output.status.success(), "sandirect stat: {output:?}");
        let pids = host_pids(container);
        stat_rows(&stdout(&output))
            .into_iter()
            .filter(|row| pids.contains(&row.pid))
            .collect()
    } else {
        let mut exec = Command::new("docker");
        exec.args(["exec", container, "sandirect", "stat"]);
        stat_rows(&stdout(&checked(exec, "sandirect stat in the container")))
    }
}

/// The connections `sandirect stat` showed, each by its container, pid, fd and addresses,
/// with the last row seen of it.
type Seen = std::collections::BTreeMap<(String, u32, i32, String, String), StatRow>;

/// Samples `sandirect stat` (every 0.2 s, for at most 30 s) until every container of
/// `containers` has shown `least` connections to or from `port`; adds the connections of that
/// port to `seen`.
fn watch_connections(seen: &mut Seen, containers: &[&str], port: u16, least: usize) {
    for _ in 0..150 {
        for container in containers {
            for row in stat_of(container).into_iter().filter(|r| r.port_is(port)) {
                let id = (
                    container.to_string(),
                    row.pid,
                    row.fd,
                    row.local.clone(),
                    row.peer.clone(),
                );
                seen.insert(id, row);
            }
        }
        let count = |c: &&str| seen.keys().filter(|id| id.0 == *c).count();
        if containers.iter().all(|c| count(c) >= least) {
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Checks the connections `watch_connections` saw: every container of `containers` had one,
/// and each that moved bytes was, as last seen, connected on `path` (with `reason` for TCP). A
/// connection that moved no byte took no path yet (seen while it was being set up).
fn assert_paths(seen: &Seen, containers: &[&str], path: &str, reason: &str) {
    for container in containers {
        assert!(
            seen.keys().any(|id| id.0 == *container),
            "sandirect stat never showed a connection of {container}: {seen:#?}"
        );
    }
    for ((container, ..), row) in seen {
        if row.bytes == [0; 4] {
            continue;
        }
        assert!(
            row.path == path && row.reason == reason && row.state == "connected",
            "{container}: expected connected on {path} ({reason}): {row:?}"
        );
    }
}

/// A network, a segment volume and the containers the test starts on them, removed when
/// dropped.
fn topology(name: &str) -> (String, DockerObjects) {
    let tag = format!("sandirect-test-{}-{name}", std::process::id());
    let objects = DockerObjects {
        containers: Vec::new(),
        network: tag.clone(),
        volume: tag.clone(),
    };
    let mut network = Command::new("docker");
    network.args(["network", "create", &tag]);
    checked(network, "docker network create");
    let mut volume = Command::new("docker");
    volume.args(["volume", "create", &tag]);
    checked(volume, "docker volume create");
    (tag, objects)
}

/// Starts a detached container `name` of the apps image on the topology's network running
/// `command` (preloaded by the entrypoint); with `shared`, the segment volume is its segment
/// directory.
fn start(objects: &mut DockerObjects, name: &str, shared: bool, command: &[&str]) -> String {
    let name = format!("{}-{name}", objects.network);
    objects.containers.push(name.clone());
    let segments = format!("{}:/san", objects.volume);
    let mut run = Command::new("docker");
    run.args(["run", "-d", "--name", &name, "--network", &objects.network]);
    run.args(["--network-alias", name.rsplit('-').next().unwrap()]);
    if shared {
        run.args(["-v", &segments, "-e", "SANDIRECT_SHM_DIR=/san/segments"]);
    }
    run.arg(apps_image()).args(command);
    checked(run, &format!("docker run {name}"));
    name
}

/// Waits (at most two minutes) for `container` to exit; its exit status and output.
fn finish(container: &str) -> (String, String) {
    let mut wait = Command::new("timeout");
    wait.args(["120", "docker", "wait", container]);
    let status = stdout(&checked(wait, "docker wait")).trim().to_owned();
    let mut logs = Command::new("docker");
    logs.args(["logs", container]);
    let logs = checked(logs, "docker logs");
    let text = format!("{}{}", stdout(&logs), String::from_utf8_lossy(&logs.stderr));
    (status, text)
}

/// The host's pid of `container`'s first process (its entrypoint's command).
fn main_pid(container: &str) -> u32 {
    let mut inspect = Command::new("docker");
    inspect.args(["inspect", "-f", "{{.State.Pid}}", container]);
    stdout(&checked(inspect, "docker inspect"))
        .trim()
        .parse()
        .expect("a pid")
}

/// redis-server and its clients in two containers on one bridge network: with a shared
/// segment volume, redis-cli's connection is on SAN-shm at both ends as `sandirect stat` on
/// the host shows it (redis-server's row carrying its host pid), values of known contents
/// (up to 1 MB) come back intact and redis-benchmark completes; without the volume, the same
/// on TCP (`peer-not-capable`).
#[test]
#[ignore = "builds a Docker image (minutes); scripts/test-all.sh runs it where a Docker engine answers"]
fn redis_between_two_containers() {
    if !docker_available("redis_between_two_containers") {
        return;
    }
    for shared in [true, false] {
        let (_, mut objects) = topology(if shared {
            "redis-shared"
        } else {
            "redis-apart"
        });
        let server = start(
            &mut objects,
            "redis",
            shared,
            &["redis-server", "--protected-mode", "no", "--save", ""],
        );
        // Values of known sizes (inline and rendezvous sizes), each read back and compared;
        // then a connection held open for a few seconds (INCR ten times a second) while the
        // host watches it, then redis-benchmark.
        let script = r#"set -e
for i in $(seq 100); do redis-cli -h redis ping >/dev/null 2>&1 && break; sleep 0.2; done
for size in 100 65536 1000000; do
  head -c "$size" /dev/urandom | base64 -w0 | head -c "$size" >/tmp/value
  redis-cli -h redis -x SET "key$size" </tmp/value >/dev/null
  redis-cli -h redis --raw GET "key$size" | head -c "$size" >/tmp/back
  cmp /tmp/value /tmp/back && echo "value $size intact"
done
redis-cli -h redis -r 50 -i 0.1 INCR counter >/dev/null
echo "counter $(redis-cli -h redis GET counter)"
redis-benchmark -h redis -q -c 2 -n 2000 -t set,get -d 100
"#;
        let client = start(&mut objects, "client", shared, &["sh", "-c", script]);
        let mut seen = Seen::new();
        watch_connections(&mut seen, &[&server, &client], 6379, 1);
        let (status, out) = finish(&client);
        assert_eq!(status, "0", "the client failed (shared {shared}):\n{out}");
        for size in [100, 65536, 1000000] {
            assert!(
                out.contains(&format!("value {size} intact")),
                "value of {size} bytes (shared {shared}):\n{out}"
            );
        }
        assert!(
            out.contains("counter 50\n"),
            "INCR (shared {shared}):\n{out}"
        );
        // Quiet mode still draws progress, each update after a carriage return.
        for test in ["SET: ", "GET: "] {
            assert!(
                out.lines()
                    .filter_map(|line| line.rsplit('\r').next())
                    .any(|line| {
                        let line = line.trim_start();
                        line.starts_with(test) && line.contains("requests per second")
                    }),
                "redis-benchmark's {test}(shared {shared}):\n{out}"
            );
        }
        let (path, reason) = if shared {
            ("SAN-shm", "-")
        } else {
            ("TCP", "peer-not-capable")
        };
        assert_paths(&seen, &[&server, &client], path, reason);
        if is_root() {
            // The server's connections carry redis-server's pid as the host knows it.
            let redis = main_pid(&server);
            assert!(
                seen.iter()
                    .any(|(id, row)| id.0 == server && row.pid == redis && row.role == "server"),
                "no row of redis-server (host pid {redis}): {seen:#?}"
            );
        }
        eprintln!(
            "redis between two containers, shared directory {shared}: {path}, {} connection rows",
            seen.len()
        );
    }
}

/// iperf3 between two containers on one bridge network: with a shared segment volume its
/// control and data connections are on SAN-shm at both ends (`sandirect stat` on the host), the
/// client sent a fixed byte count and the server received it (iperf3 -J, both ends' reports);
/// without the volume, TCP (`peer-not-capable`).
#[test]
#[ignore = "builds a Docker image (minutes); scripts/test-all.sh runs it where a Docker engine answers"]
fn iperf3_between_two_containers() {
    if !docker_available("iperf3_between_two_containers") {
        return;
    }
    const BYTES: u64 = 48 << 20;
    for shared in [true, false] {
        let (_, mut objects) = topology(if shared {
            "iperf-shared"
        } else {
            "iperf-apart"
        });
        let server = start(&mut objects, "iperf", shared, &["iperf3", "-s", "-1", "-J"]);
        // Paced (96 Mbit/s: about four seconds) so the host sees the connections and the
        // machine's cores stay free.
        let script = format!(
            "for i in $(seq 100); do iperf3 -c iperf -n {BYTES} -b 96M -J >/tmp/out.json && \
             exec cat /tmp/out.json; sleep 0.2; done; exit 1"
        );
        let client = start(&mut objects, "client", shared, &["sh", "-c", &script]);
        let mut seen = Seen::new();
        watch_connections(&mut seen, &[&server, &client], 5201, 2);
        let (status, client_out) = finish(&client);
        assert_eq!(
            status, "0",
            "iperf3 client (shared {shared}):\n{client_out}"
        );
        let (status, server_out) = finish(&server);
        assert_eq!(
            status, "0",
            "iperf3 server (shared {shared}):\n{server_out}"
        );
        let report = |json: &str, sum: &str| -> u64 {
            let report: serde_json::Value = serde_json::from_str(json)
                .unwrap_or_else(|e| panic!("iperf3 -J output ({e}):\n{json}"));
            report["end"][sum]["bytes"]
                .as_u64()
                .unwrap_or_else(|| panic!("no end.{sum}.bytes:\n{json}"))
        };
        assert_eq!(
            report(&client_out, "sum_sent"),
            BYTES,
            "the client sent (shared {shared})"
        );
        // The server stops counting when the client says the test is over: a write of
        // iperf3's default length (128 KiB) may still be on its way then, over TCP as well.
        let received = report(&server_out, "sum_received");
        assert!(
            (BYTES - (128 << 10)..=BYTES).contains(&received),
            "the server received {received} of {BYTES} bytes (shared {shared})"
        );
        assert_eq!(
            report(&client_out, "sum_received"),
            received,
            "the server's count as the client got it (shared {shared})"
        );
        let (path, reason) = if shared {
            ("SAN-shm", "-")
        } else {
            ("TCP", "peer-not-capable")
        };
        assert_paths(&seen, &[&server, &client], path, reason);
        let data = seen
            .iter()
            .filter(|(id, row)| id.0 == client && row.role == "client")
            .count();
        assert!(
            data >= 2,
            "the client's control and data connections: {seen:#?}"
        );
        eprintln!(
            "iperf3 between two containers, shared directory {shared}: {received} of {BYTES} bytes on {path}"
        );
    }
}

/// The command that runs compose files here: the compose plugin, else docker-compose.
fn compose_command() -> Option<Vec<&'static str>> {
    let works = |args: &[&str]| {
        Command::new(args[0])
            .args(&args[1..])
            .arg("version")
            .output()
            .is_ok_and(|output| output.status.success())
    };
    [&["docker", "compose"][..], &["docker-compose"][..]]
        .into_iter()
        .find(|args| works(args))
        .map(<[&str]>::to_vec)
}

/// Takes a compose project down (containers, volume, the images it built) when dropped.
struct ComposeProject {
    command: Vec<&'static str>,
    file: PathBuf,
    name: String,
}

impl ComposeProject {
    fn run(&self, args: &[&str]) -> Command {
        let mut command = Command::new(self.command[0]);
        command.args(&self.command[1..]);
        command.arg("-f").arg(&self.file).args(["-p", &self.name]);
        command.args(args);
        command
    }

    /// The container of `service`.
    fn container(&self, service: &str) -> String {
        let id = stdout(&checked(self.run(&["ps", "-q", service]), "compose ps"));
        id.trim().to_owned()
    }
}

impl Drop for ComposeProject {
    fn drop(&mut self) {
        let _ = self
            .run(&["down", "-v", "--rmi", "local", "--timeout", "5"])
            .output();
    }
}

/// The compose example users copy (docs/compose/compose.yml), run with the compose command
/// this machine has, on the test image: redis with redis-cli and nginx with curl, four
/// containers sharing the segment volume. `sandirect stat` on the host lists both servers' and
/// both clients' connections on SAN-shm, with the host's pids; the clients get every value and
/// every page back.
#[test]
#[ignore = "builds a Docker image (minutes); scripts/test-all.sh runs it where a Docker engine answers"]
fn the_compose_example_runs_over_the_san() {
    if !docker_available("the_compose_example_runs_over_the_san") {
        return;
    }
    let Some(command) = compose_command() else {
        eprintln!(
            "skipping the_compose_example_runs_over_the_san: neither `docker compose` nor \
             `docker-compose` runs here"
        );
        return;
    };
    images();
    let project = ComposeProject {
        command,
        file: workspace().join("docs/compose/compose.yml"),
        name: format!("sandirect-compose-{}", std::process::id()),
    };
    // 150 requests per client: about 15 seconds each.
    let mut up = project.run(&["up", "-d", "--build"]);
    up.env("SANDIRECT_IMAGE", IMAGE).env("REQUESTS", "150");
    checked(up, "compose up");
    let services = ["redis", "redis-client", "nginx", "web-client"];
    let containers: Vec<String> = services.iter().map(|s| project.container(s)).collect();
    let names: Vec<&str> = containers.iter().map(String::as_str).collect();
    let mut seen = Seen::new();
    watch_connections(&mut seen, &names[..2], 6379, 1);
    watch_connections(&mut seen, &names[2..], 80, 1);
    assert_paths(&seen, &names, "SAN-shm", "-");
    let roles = |container: &str| -> Vec<&str> {
        seen.iter()
            .filter(|(id, _)| id.0 == container)
            .map(|(_, row)| row.role.as_str())
            .collect()
    };
    for (server, client) in [(names[0], names[1]), (names[2], names[3])] {
        assert!(roles(server).contains(&"server"), "{server}: {seen:#?}");
        assert!(roles(client).contains(&"client"), "{client}: {seen:#?}");
    }
    let (status, out) = finish(names[1]);
    assert_eq!(status, "0", "redis-client:\n{out}");
    assert!(out.contains("visits: 150\n"), "redis-client:\n{out}");
    let (status, out) = finish(names[3]);
    assert_eq!(status, "0", "web-client:\n{out}");
    let line = out
        .lines()
        .find(|line| line.starts_with("150 pages, "))
        .unwrap_or_else(|| panic!("web-client:\n{out}"));
    // "150 pages, N bytes (expected N)"
    let numbers: Vec<&str> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|n| !n.is_empty())
        .collect();
    assert!(
        numbers.len() == 3 && numbers[1] == numbers[2] && numbers[1] != "0",
        "web-client: {line}"
    );
    eprintln!(
        "the compose example: {} connection rows on SAN-shm; {line}",
        seen.len()
    );
}
