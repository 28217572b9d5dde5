//! sandirect in containers, with the machine's Docker Engine (no registry: the base image is a
//! local debootstrap, see scripts/container/base-image.sh):
//!
//! * the Debian package, built by the image's builder stage (scripts/package.sh), installs
//!   into a clean container of the base image and `sandirect run` finds the installed
//!   library there;
//! * the image (scripts/container/Dockerfile) lists the interposed symbols, and a preloaded
//!   echo server and client in one container use the intra-host SAN.
//!
//! Both are ignored by default: the first run builds the base image, installs the builder's
//! toolchain and cargo-deb and builds the workspace in release (about 10 minutes on 2 cores);
//! a changed source rebuilds from the workspace build on (a few minutes), unchanged sources
//! reuse every cached layer (seconds). Run them with
//! `cargo test -p integration --test containers -- --ignored` or `scripts/test-all.sh
//! --containers`. They skip, saying so, where no Docker engine answers.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

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
#[ignore = "builds a Docker image (minutes); run with --ignored or scripts/test-all.sh --containers"]
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
#[ignore = "builds a Docker image (minutes); run with --ignored or scripts/test-all.sh --containers"]
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
#[ignore = "builds a Docker image (minutes); run with --ignored or scripts/test-all.sh --containers"]
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
