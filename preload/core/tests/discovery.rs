//! Discovery: listener markers and probes (including fork and process death), the negative
//! cache, connection keys seen from both ends of real connections, and the segment directory
//! policy.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use preload_core::discovery::{
    probe_listener, probe_listener_in_dir, ConnectionKey, DirectoryProblem, DiscoveryError,
    ListenerMarker, Role, SegmentDir,
};
use preload_core::negative_cache::{NegativeCache, NegativeCacheConfig, PeerKind};

/// A port number no other test of this binary (nor, likely, of a concurrent run) uses: markers
/// live in a host-wide namespace, so tests must not share names.
fn unique_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    // Below the ephemeral range, where real listeners of concurrent test runs (which may
    // publish markers when preloaded) get their ports.
    let base = 20_000 + (std::process::id() % 350) as u16 * 32;
    base + NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A forked child inherits every descriptor of this multi-threaded test process, including the
/// markers of tests running concurrently, and would keep them alive after their owners drop
/// them. Tests that assert a marker vanished hold this for reading; tests that fork hold it for
/// writing until their child is gone.
static FORK_LOCK: RwLock<()> = RwLock::new(());

fn no_fork_now() -> RwLockReadGuard<'static, ()> {
    FORK_LOCK
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn forking() -> RwLockWriteGuard<'static, ()> {
    FORK_LOCK
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn v4(a: u8, b: u8, c: u8, d: u8, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(a, b, c, d)), port)
}

fn v6(ip: Ipv6Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V6(ip), port)
}

fn ipv6_available() -> bool {
    TcpListener::bind("[::1]:0").is_ok()
}

// ---------------------------------------------------------------------------------------------
// Markers and probes
// ---------------------------------------------------------------------------------------------

#[test]
fn exact_marker_is_found_until_dropped() {
    let _no_fork = no_fork_now();
    let port = unique_port();
    let server = v4(127, 0, 0, 1, port);
    assert!(!probe_listener(server), "no marker published yet");
    let marker = ListenerMarker::publish(server, false).unwrap();
    assert!(marker.is_published());
    assert!(probe_listener(server));
    assert!(
        !probe_listener(v4(127, 0, 0, 1, unique_port())),
        "another port has no marker"
    );
    assert!(
        !probe_listener(v4(127, 0, 0, 2, port)),
        "an exact marker covers one address"
    );
    drop(marker);
    assert!(
        !probe_listener(server),
        "closing the listener withdraws the marker"
    );
}

/// Markers published in a segment directory are found there (what a client in another network
/// namespace that shares the directory asks), exact and wildcard names alike; a marker whose
/// holder is gone is not, and the next publisher replaces its file.
#[test]
fn markers_in_the_segment_directory_are_found_until_their_holder_is_gone() {
    let _no_fork = no_fork_now();
    let path = std::env::temp_dir().join(format!("sandirect-markers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&path);
    let dir = SegmentDir::open(Some(&path)).unwrap();
    let (exact, wildcard) = (unique_port(), unique_port());
    let server = v4(10, 203, 9, 1, exact);
    let mut marker = ListenerMarker::publish(server, false).unwrap();
    assert!(
        !probe_listener_in_dir(dir.as_fd(), server),
        "not published there yet"
    );
    marker.publish_in_dir(&dir, server, false);
    assert!(probe_listener_in_dir(dir.as_fd(), server));
    assert!(!probe_listener_in_dir(
        dir.as_fd(),
        v4(10, 203, 9, 1, wildcard)
    ));
    // A wildcard listener publishes a file per non-loopback address of its namespace, and
    // none for an address that is not its own or for loopback (no other namespace reaches it).
    let mut any = ListenerMarker::publish(v4(0, 0, 0, 0, wildcard), false).unwrap();
    any.publish_in_dir(&dir, v4(0, 0, 0, 0, wildcard), false);
    assert!(!probe_listener_in_dir(
        dir.as_fd(),
        v4(10, 203, 9, 7, wildcard)
    ));
    assert!(!probe_listener_in_dir(
        dir.as_fd(),
        v4(127, 0, 0, 1, wildcard)
    ));
    for ip in own_non_loopback_v4() {
        assert!(probe_listener_in_dir(
            dir.as_fd(),
            SocketAddr::new(IpAddr::V4(ip), wildcard)
        ));
    }
    drop(marker);
    assert!(
        !probe_listener_in_dir(dir.as_fd(), server),
        "a marker's file goes with it"
    );
    // A file left by a process that died holding the marker refuses connections: no marker,
    // and the next publisher replaces it.
    let stale = std::os::unix::net::UnixDatagram::bind(path.join(format!(".L-{server}"))).unwrap();
    drop(stale);
    assert!(!probe_listener_in_dir(dir.as_fd(), server));
    let mut again = ListenerMarker::publish(server, false).unwrap();
    again.publish_in_dir(&dir, server, false);
    assert!(
        probe_listener_in_dir(dir.as_fd(), server),
        "the stale file was replaced"
    );
    drop((again, any));
    let _ = std::fs::remove_dir_all(&path);
}

/// This host's non-loopback IPv4 addresses (from `ip -4 -o addr`; empty without the tool).
fn own_non_loopback_v4() -> Vec<Ipv4Addr> {
    let Ok(out) = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
    else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            words.find(|w| *w == "inet")?;
            words.next()?.split('/').next()?.parse().ok()
        })
        .filter(|ip: &Ipv4Addr| !ip.is_loopback())
        .collect()
}

#[test]
fn v4_wildcard_marker_covers_every_local_address_only() {
    let port = unique_port();
    let _marker = ListenerMarker::publish(v4(0, 0, 0, 0, port), false).unwrap();
    assert!(probe_listener(v4(127, 0, 0, 1, port)));
    assert!(
        probe_listener(v4(127, 3, 2, 1, port)),
        "all of 127/8 is local"
    );
    // TEST-NET-1 is never assigned to this host: a wildcard listener here says nothing about it.
    assert!(!probe_listener(v4(192, 0, 2, 1, port)));
    assert!(
        !probe_listener(v6(Ipv6Addr::LOCALHOST, port)),
        "a v4 listener accepts no v6 peer"
    );
}

#[test]
fn dual_stack_wildcard_listener_is_found_by_v4_v6_and_mapped_clients() {
    let port = unique_port();
    let _marker = ListenerMarker::publish(v6(Ipv6Addr::UNSPECIFIED, port), false).unwrap();
    assert!(probe_listener(v4(127, 0, 0, 1, port)));
    assert!(probe_listener(v6(Ipv6Addr::LOCALHOST, port)));
    assert!(probe_listener(v6(
        Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
        port
    )));
}

#[test]
fn v6_only_wildcard_listener_is_not_found_by_v4_clients() {
    let port = unique_port();
    let _marker = ListenerMarker::publish(v6(Ipv6Addr::UNSPECIFIED, port), true).unwrap();
    assert!(probe_listener(v6(Ipv6Addr::LOCALHOST, port)));
    assert!(!probe_listener(v4(127, 0, 0, 1, port)));
}

#[test]
fn v4_mapped_listener_address_is_folded() {
    let port = unique_port();
    let mapped = v6(Ipv4Addr::new(127, 0, 0, 1).to_ipv6_mapped(), port);
    let _marker = ListenerMarker::publish(mapped, true).unwrap();
    assert!(probe_listener(v4(127, 0, 0, 1, port)));
}

#[test]
fn marker_names_follow_the_documented_scheme() {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let port = unique_port();
    let _v4 = ListenerMarker::publish(v4(127, 0, 0, 1, port), false).unwrap();
    let _v6 = ListenerMarker::publish(v6(Ipv6Addr::LOCALHOST, port), false).unwrap();
    let dual_port = unique_port();
    let _dual = ListenerMarker::publish(v6(Ipv6Addr::UNSPECIFIED, dual_port), false).unwrap();
    // /proc/net/unix lists abstract names with a leading '@'.
    let table = std::fs::read_to_string("/proc/net/unix").unwrap();
    for expected in [
        format!("@sandirect/{uid}/L/127.0.0.1:{port}"),
        format!("@sandirect/{uid}/L/[::1]:{port}"),
        format!("@sandirect/{uid}/L/[::]:{dual_port}"),
        format!("@sandirect/{uid}/L/0.0.0.0:{dual_port}"),
    ] {
        assert!(
            table.lines().any(|line| line.ends_with(&expected)),
            "{expected} not published"
        );
    }
}

#[test]
fn marker_of_a_real_listener() {
    let _no_fork = no_fork_now();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let marker = ListenerMarker::publish_for_listener(listener.as_fd(), None).unwrap();
    assert!(probe_listener(addr));
    drop(marker);
    assert!(!probe_listener(addr));

    if ipv6_available() {
        // std does not set IPV6_V6ONLY: a dual-stack listener (Linux default).
        let listener = TcpListener::bind("[::]:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let _marker = ListenerMarker::publish_for_listener(listener.as_fd(), None).unwrap();
        assert!(probe_listener(v4(127, 0, 0, 1, port)));
        assert!(probe_listener(v6(Ipv6Addr::LOCALHOST, port)));
    } else {
        eprintln!("IPv6 unavailable: dual-stack listener part skipped");
    }
}

#[test]
fn a_taken_name_is_reported_not_stolen() {
    let _no_fork = no_fork_now();
    let server = v4(127, 0, 0, 1, unique_port());
    let first = ListenerMarker::publish(server, false).unwrap();
    let second = ListenerMarker::publish(server, false).unwrap();
    assert!(first.is_published());
    assert!(
        !second.is_published(),
        "the name belongs to the first marker"
    );
    drop(second);
    assert!(
        probe_listener(server),
        "dropping the non-holder leaves the marker alone"
    );
}

#[test]
fn marker_is_not_a_non_ip_listener() {
    let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
    assert!(matches!(
        ListenerMarker::publish_for_listener(a.as_fd(), None),
        Err(DiscoveryError::UnsupportedFamily(libc::AF_UNIX))
    ));
}

fn fork_or_die() -> libc::pid_t {
    // SAFETY: the children of these tests only call async-signal-safe functions (pause, _exit,
    // close via drop of an fd) before exiting.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    pid
}

fn wait_until(deadline: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    condition()
}

fn kill_and_reap(pid: libc::pid_t) {
    // SAFETY: signalling and reaping our own child.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        libc::waitpid(pid, std::ptr::null_mut(), 0);
    }
}

#[test]
fn forked_worker_keeps_the_marker_alive_and_its_death_withdraws_it() {
    let _forking = forking();
    let server = v4(127, 0, 0, 1, unique_port());
    let marker = ListenerMarker::publish(server, false).unwrap();
    let child = fork_or_die();
    if child == 0 {
        // The worker holds the inherited marker (with the listener) until killed.
        loop {
            // SAFETY: pause has no preconditions.
            unsafe { libc::pause() };
        }
    }
    drop(marker);
    assert!(
        probe_listener(server),
        "the forked worker still holds the marker"
    );
    kill_and_reap(child);
    assert!(
        wait_until(Duration::from_secs(1), || !probe_listener(server)),
        "the marker dies with its last holder"
    );
}

#[test]
fn marker_vanishes_when_its_process_is_killed() {
    let _forking = forking();
    let server = v4(127, 0, 0, 1, unique_port());
    let child = fork_or_die();
    if child == 0 {
        let marker = ListenerMarker::publish(server, false);
        if marker.is_err() {
            // SAFETY: exiting the child.
            unsafe { libc::_exit(1) };
        }
        loop {
            // SAFETY: pause has no preconditions.
            unsafe { libc::pause() };
        }
    }
    assert!(
        wait_until(Duration::from_secs(2), || probe_listener(server)),
        "child published"
    );
    kill_and_reap(child);
    assert!(wait_until(Duration::from_secs(1), || !probe_listener(
        server
    )));
}

#[test]
fn exec_drops_the_marker_fork_alone_does_not() {
    let _forking = forking();
    let server = v4(127, 0, 0, 1, unique_port());
    let marker = ListenerMarker::publish(server, false).unwrap();
    let sleep = c"/bin/sleep";
    let argv = [sleep.as_ptr(), c"5".as_ptr(), std::ptr::null()];
    let child = fork_or_die();
    if child == 0 {
        // SAFETY: execv with NUL-terminated strings and a NULL-terminated argv; _exit if it fails.
        unsafe {
            libc::execv(sleep.as_ptr(), argv.as_ptr());
            libc::_exit(127);
        }
    }
    drop(marker);
    // Once the child has exec'd, its close-on-exec copy is gone too.
    let withdrawn = wait_until(Duration::from_secs(2), || !probe_listener(server));
    kill_and_reap(child);
    assert!(
        withdrawn,
        "an exec'd program does not keep the marker alive"
    );
}

#[test]
fn probe_cost() {
    const ROUNDS: u32 = 2_000;
    let _no_fork = no_fork_now();
    let hit = v4(127, 0, 0, 1, unique_port());
    let _marker = ListenerMarker::publish(hit, false).unwrap();
    let miss = v4(127, 0, 0, 1, unique_port());
    let cache = NegativeCache::new(NegativeCacheConfig::default());
    cache.mark_plain(miss);
    let time = |f: &dyn Fn() -> bool, expected: bool| {
        let start = Instant::now();
        for _ in 0..ROUNDS {
            assert_eq!(f(), expected);
        }
        start.elapsed() / ROUNDS
    };
    let hit_cost = time(&|| probe_listener(hit), true);
    let miss_cost = time(&|| probe_listener(miss), false);
    let cached_cost = time(&|| cache.is_plain(miss), true);
    println!(
        "probe ({} build): marker found {hit_cost:?}, no marker {miss_cost:?}, negative cache \
         hit {cached_cost:?}",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
}

// ---------------------------------------------------------------------------------------------
// Negative cache
// ---------------------------------------------------------------------------------------------

#[test]
fn negative_entries_expire() {
    let cache = NegativeCache::new(NegativeCacheConfig {
        ttl: Duration::from_secs(10),
        capacity: 64,
    });
    let t0 = Instant::now();
    let server = v4(10, 1, 2, 3, 80);
    assert!(!cache.is_plain_at(server, t0));
    cache.mark_plain_at(server, t0);
    assert!(cache.is_plain_at(server, t0));
    assert!(cache.is_plain_at(server, t0 + Duration::from_millis(9_900)));
    assert!(
        !cache.is_plain_at(server, t0 + Duration::from_millis(10_100)),
        "expired"
    );
    assert!(
        !cache.is_plain_at(v4(10, 1, 2, 3, 81), t0),
        "keyed by port too"
    );
    assert!(
        !cache.is_plain_at(v4(10, 1, 2, 4, 80), t0),
        "keyed by address"
    );
    // Refreshing extends the entry rather than adding a second one.
    cache.mark_plain_at(server, t0 + Duration::from_secs(8));
    assert!(cache.is_plain_at(server, t0 + Duration::from_secs(17)));
}

#[test]
fn negative_cache_folds_v4_mapped_addresses_and_forgets() {
    let cache = NegativeCache::new(NegativeCacheConfig::default());
    cache.mark_plain(v6(Ipv4Addr::new(10, 0, 0, 9).to_ipv6_mapped(), 443));
    assert!(cache.is_plain(v4(10, 0, 0, 9, 443)));
    cache.forget(v4(10, 0, 0, 9, 443));
    assert!(!cache.is_plain(v4(10, 0, 0, 9, 443)));
}

#[test]
fn negative_cache_is_bounded_and_keeps_recent_entries() {
    let cache = NegativeCache::new(NegativeCacheConfig {
        ttl: Duration::from_secs(60),
        capacity: 64,
    });
    assert_eq!(cache.capacity(), 64);
    let t0 = Instant::now();
    let servers: Vec<SocketAddr> = (0..1_000u32)
        .map(|i| SocketAddr::new(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)), 8080))
        .collect();
    for (i, server) in servers.iter().enumerate() {
        cache.mark_plain_at(*server, t0 + Duration::from_millis(i as u64));
    }
    let now = t0 + Duration::from_secs(1);
    let remembered = servers
        .iter()
        .filter(|s| cache.is_plain_at(**s, now))
        .count();
    assert!(
        remembered <= cache.capacity(),
        "{remembered} entries in a cache of 64"
    );
    assert!(
        remembered >= 48,
        "eviction keeps the table mostly full: {remembered}"
    );
    // The most recent insert always survives (it replaced the oldest entry of its set).
    assert!(cache.is_plain_at(servers[999], now));
}

#[test]
fn probe_caches_only_negative_answers() {
    let _no_fork = no_fork_now();
    let cache = NegativeCache::new(NegativeCacheConfig::default());
    let plain = v4(127, 0, 0, 1, unique_port());
    assert_eq!(cache.probe(plain, None), PeerKind::Plain);
    assert_eq!(cache.probe(plain, None), PeerKind::PlainCached);

    let preloaded = v4(127, 0, 0, 1, unique_port());
    let _marker = ListenerMarker::publish(preloaded, false).unwrap();
    assert_eq!(cache.probe(preloaded, None), PeerKind::Preloaded);
    assert!(!cache.is_plain(preloaded));
    assert_eq!(cache.probe(preloaded, None), PeerKind::Preloaded);
}

#[test]
fn negative_cache_is_consistent_under_concurrent_use() {
    let cache = NegativeCache::new(NegativeCacheConfig {
        ttl: Duration::from_secs(60),
        capacity: 4096,
    });
    let marked: Vec<SocketAddr> = (0..256).map(|i| v4(10, 9, 0, i as u8, 1000)).collect();
    std::thread::scope(|scope| {
        for thread in 0..4 {
            let cache = &cache;
            let marked = &marked;
            scope.spawn(move || {
                for round in 0..200 {
                    for (i, server) in marked.iter().enumerate() {
                        if (i + round + thread) % 4 == 0 {
                            cache.mark_plain(*server);
                        }
                        // Never-marked addresses must never read as plain, torn entries or not.
                        assert!(!cache.is_plain(v4(10, 8, round as u8, i as u8, 1000)));
                    }
                }
            });
        }
    });
    // Racing inserts into one set may overwrite each other, but in a table 16 times larger
    // than the working set almost all survive.
    let remembered = marked.iter().filter(|s| cache.is_plain(**s)).count();
    assert!(remembered >= 250, "{remembered} of 256");
}

// ---------------------------------------------------------------------------------------------
// Connection keys
// ---------------------------------------------------------------------------------------------

fn keys_of_a_real_connection(
    listen: &str,
    connect_to: SocketAddr,
) -> (ConnectionKey, ConnectionKey) {
    let listener = TcpListener::bind(listen).unwrap();
    let target = SocketAddr::new(connect_to.ip(), listener.local_addr().unwrap().port());
    let client = TcpStream::connect(target).unwrap();
    let (accepted, _) = listener.accept().unwrap();
    let connecting = ConnectionKey::of_socket(client.as_fd(), Role::Connecting).unwrap();
    let accepting = ConnectionKey::of_socket(accepted.as_fd(), Role::Accepting).unwrap();
    (connecting, accepting)
}

#[test]
fn both_ends_of_a_v4_connection_compute_the_same_key() {
    let (connecting, accepting) = keys_of_a_real_connection("127.0.0.1:0", v4(127, 0, 0, 1, 0));
    assert_eq!(connecting, accepting);
    assert_eq!(connecting.segment_name(), accepting.segment_name());
    assert!(connecting.client().is_ipv4() && connecting.server().is_ipv4());
    assert_ne!(connecting.client().port(), connecting.server().port());
}

#[test]
fn both_ends_of_a_v6_connection_compute_the_same_key() {
    if !ipv6_available() {
        eprintln!("IPv6 unavailable: skipped");
        return;
    }
    let (connecting, accepting) = keys_of_a_real_connection("[::1]:0", v6(Ipv6Addr::LOCALHOST, 0));
    assert_eq!(connecting, accepting);
    assert_eq!(connecting.segment_name(), accepting.segment_name());
    assert_eq!(connecting.server().ip(), IpAddr::V6(Ipv6Addr::LOCALHOST));
}

#[test]
fn dual_stack_listener_accepting_a_v4_client_computes_the_v4_key() {
    if !ipv6_available() {
        eprintln!("IPv6 unavailable: skipped");
        return;
    }
    // The accepted socket of a `::` listener sees ::ffff:127.0.0.1 on both ends; the v4 client
    // sees plain IPv4. Both must name the same segment.
    let (connecting, accepting) = keys_of_a_real_connection("[::]:0", v4(127, 0, 0, 1, 0));
    assert_eq!(connecting, accepting);
    assert_eq!(connecting.segment_name(), accepting.segment_name());
    assert!(accepting.server().is_ipv4());
}

#[test]
fn v4_mapped_client_to_a_v4_listener_computes_the_v4_key() {
    if !ipv6_available() {
        eprintln!("IPv6 unavailable: skipped");
        return;
    }
    // A v6 socket connecting to ::ffff:127.0.0.1 sees mapped addresses; the v4 server does not.
    let mapped = v6(Ipv4Addr::LOCALHOST.to_ipv6_mapped(), 0);
    let (connecting, accepting) = keys_of_a_real_connection("127.0.0.1:0", mapped);
    assert_eq!(connecting, accepting);
    assert_eq!(connecting.segment_name(), accepting.segment_name());
}

#[test]
fn views_of_one_tuple_agree_in_every_family() {
    let cases = [
        (v4(10, 0, 0, 1, 40000), v4(10, 0, 0, 2, 8080)),
        (
            v6(Ipv6Addr::LOCALHOST, 1),
            v6("fe80::1".parse().unwrap(), 65535),
        ),
        (
            v6(Ipv4Addr::new(192, 168, 1, 5).to_ipv6_mapped(), 5555),
            v6(Ipv4Addr::new(192, 168, 1, 6).to_ipv6_mapped(), 80),
        ),
    ];
    for (client, server) in cases {
        let from_client = ConnectionKey::from_connecting_side(client, server);
        let from_server = ConnectionKey::from_accepting_side(server, client);
        assert_eq!(from_client, from_server);
        let name = from_client.segment_name();
        assert_eq!(
            ConnectionKey::parse_segment_name(name.as_str()),
            Some(from_client)
        );
    }
    // Mapped and plain IPv4 views name the same segment.
    let mapped = ConnectionKey::new(
        v6(Ipv4Addr::new(192, 168, 1, 5).to_ipv6_mapped(), 5555),
        v6(Ipv4Addr::new(192, 168, 1, 6).to_ipv6_mapped(), 80),
    );
    let plain = ConnectionKey::new(v4(192, 168, 1, 5, 5555), v4(192, 168, 1, 6, 80));
    assert_eq!(mapped.segment_name(), plain.segment_name());
}

#[test]
fn segment_names_are_filename_safe_and_direction_sensitive() {
    let key = ConnectionKey::new(v4(127, 0, 0, 1, 40000), v4(127, 0, 0, 1, 8080));
    assert_eq!(
        key.segment_name().as_str(),
        "127.0.0.1-40000_127.0.0.1-8080"
    );
    let reversed = ConnectionKey::new(v4(127, 0, 0, 1, 8080), v4(127, 0, 0, 1, 40000));
    assert_ne!(key.segment_name(), reversed.segment_name());

    let widest = ConnectionKey::new(
        v6(
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:fffe".parse().unwrap(),
            65535,
        ),
        v6(Ipv6Addr::LOCALHOST, 65535),
    );
    let name = widest.segment_name();
    assert_eq!(
        name.as_str(),
        "fffffffffffffffffffffffffffffffe-65535_00000000000000000000000000000001-65535"
    );
    for key in [key, widest] {
        let name = key.segment_name();
        assert!(name
            .as_str()
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b) || b"._-".contains(&b)));
        assert!(
            name.as_str().len() < 200,
            "fits the segment layer's name limit"
        );
    }
}

#[test]
fn parsing_rejects_anything_but_canonical_names() {
    for bad in [
        "",
        "_",
        "..",
        "../x",
        "127.0.0.1-1",
        "127.0.0.1-1_127.0.0.1",
        "127.0.0.1-65536_127.0.0.1-1",
        "127.0.0.01-1_127.0.0.1-1",
        "127.0.0.1-01_127.0.0.1-1",
        "127.0.0.1-+1_127.0.0.1-1",
        "00000000000000000000ffff7f000001-1_127.0.0.1-1", // mapped: canonical form is IPv4
        "0000000000000000000000000000000G-1_127.0.0.1-1",
        "ÿÿ0000000000000000000000000000-1_127.0.0.1-1",
        "127.0.0.1-1_127.0.0.1-1_127.0.0.1-1",
    ] {
        assert_eq!(ConnectionKey::parse_segment_name(bad), None, "{bad:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Segment directory
// ---------------------------------------------------------------------------------------------

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let path =
            std::env::temp_dir().join(format!("sandirect-dtest-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir(&path).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn problem_of(result: Result<SegmentDir, DiscoveryError>) -> DirectoryProblem {
    match result {
        Err(DiscoveryError::UnsafeDirectory { problem, .. }) => problem,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn segment_dir_is_created_private_and_reused() {
    let temp = TempDir::new("create");
    let path = temp.0.join("segments");
    let dir = SegmentDir::open(Some(&path)).unwrap();
    assert_eq!(dir.path(), path);
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.mode() & 0o777, 0o700);
    // SAFETY: geteuid has no preconditions.
    assert_eq!(meta.uid(), unsafe { libc::geteuid() });
    drop(dir);
    SegmentDir::open(Some(&path)).expect("an existing private directory is reused");
}

#[test]
fn segment_dir_refuses_open_modes_symlinks_and_files() {
    let temp = TempDir::new("refuse");
    let open = temp.0.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o750)).unwrap();
    assert_eq!(
        problem_of(SegmentDir::open(Some(&open))),
        DirectoryProblem::ModeTooOpen { mode: 0o750 }
    );

    let target = temp.0.join("target");
    std::fs::create_dir(&target).unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o700)).unwrap();
    let link = temp.0.join("link");
    symlink(&target, &link).unwrap();
    assert_eq!(
        problem_of(SegmentDir::open(Some(&link))),
        DirectoryProblem::Symlink
    );

    let file = temp.0.join("file");
    std::fs::write(&file, b"x").unwrap();
    assert_eq!(
        problem_of(SegmentDir::open(Some(&file))),
        DirectoryProblem::NotADirectory
    );

    assert_eq!(
        SegmentDir::open(Some(std::path::Path::new(""))).unwrap_err(),
        DiscoveryError::InvalidPath
    );
    assert!(matches!(
        SegmentDir::open(Some(&temp.0.join("missing-parent/segments"))),
        Err(DiscoveryError::Os {
            errno: libc::ENOENT,
            ..
        })
    ));
}

#[test]
fn segment_dir_refuses_another_users_directory() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("not root: cannot create a directory owned by someone else; skipped");
        return;
    }
    let temp = TempDir::new("owner");
    let foreign = temp.0.join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&foreign, Some(4242), Some(4242)).unwrap();
    assert_eq!(
        problem_of(SegmentDir::open(Some(&foreign))),
        DirectoryProblem::WrongOwner { uid: 4242 }
    );
}

#[test]
fn default_segment_dir_is_per_user_in_dev_shm() {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    assert_eq!(
        SegmentDir::default_path(),
        PathBuf::from(format!("/dev/shm/sandirect-{uid}"))
    );
}

#[test]
fn segment_dir_swapped_at_its_path_keeps_its_segments() {
    use std::os::fd::AsRawFd;
    let temp = TempDir::new("swap");
    let path = temp.0.join("segments");
    let dir = SegmentDir::open(Some(&path)).unwrap();
    assert!(
        dir.as_fd().as_raw_fd() >= san_shm::internal_fd_floor(),
        "kept above the application's numbers"
    );
    let config = san_shm::SegmentConfig::new(san_api::SlotConfig {
        send_slots: 4,
        recv_slots: 4,
        slot_size: 256,
    });
    // Renamed away and a symbolic link put at the path, to a directory holding a file under
    // the name the next segment takes.
    let original = temp.0.join("original");
    std::fs::rename(&path, &original).unwrap();
    let decoy = temp.0.join("decoy");
    std::fs::create_dir(&decoy).unwrap();
    std::fs::write(decoy.join("seg"), b"planted").unwrap();
    symlink(&decoy, &path).unwrap();

    let segment = san_shm::ShmSegment::create(dir.handle(), "seg", &config).unwrap();
    assert!(original.join("seg").is_file());
    assert!(dir.handle().contains("seg"));
    dir.handle().remove("seg").unwrap();
    assert!(!original.join("seg").exists());
    assert_eq!(std::fs::read(decoy.join("seg")).unwrap(), b"planted");
    drop(segment);
}
