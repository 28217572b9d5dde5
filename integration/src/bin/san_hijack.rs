//! A hostile neighbour for the verbs SAN tests in the soft-RDMA VM: it tries to take over a
//! pending client's switch-over by connecting to the client's rdma_cm listener before the real
//! acceptor does, with the set-up request the acceptor would send (it is predictable: the TCP
//! 4-tuple, which anyone on the path sees). It is not preloaded and knows nothing of the
//! preload but that request's layout (`docs/ARCHITECTURE.md`, "Cross-host discovery (verbs)").
//!
//! ```text
//! san_hijack SERVER_ADDR:PORT CLIENT_ADDR FROM COUNT [MAGIC]
//! ```
//!
//! Waits (up to 60 s) for a TCP connection from CLIENT_ADDR to SERVER_ADDR:PORT (the client's
//! row in `/proc/net/tcp` or `tcp6`, established, on the client's ephemeral port P: where the
//! pending client listens), then sends COUNT rdma_cm connect requests, one after the other,
//! from address FROM to CLIENT_ADDR:P, each with the request of that connection (magic MAGIC,
//! by default `SDV2`, the current set-up's; `SDV1` for clients of the first version). For each
//! it prints `hijack N accepted reply=LEN` (the client accepted it and replied with LEN bytes)
//! or `hijack N refused: ERROR`, then `hijack done accepted=K` (K requests accepted). It keeps
//! the accepted connections until its standard input closes (or 120 s pass), then prints
//! `hijack dropped=D of K`: D of them the client had disconnected meanwhile.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use san_api::SlotConfig;
use sandirect_verbs::{ConnectParams, VerbsConnection, VerbsDomain, VerbsSetupError};

/// How long the client's connection is looked for.
const FIND_TIMEOUT: Duration = Duration::from_secs(60);
/// How often one request is tried when its ephemeral port was taken.
const PORT_ATTEMPTS: usize = 4;
/// How long the accepted connections are held at most (the test closes stdin before).
const HOLD_LIMIT: Duration = Duration::from_secs(120);

/// The client's port of an established TCP connection from `client` to `server`, from the
/// kernel's table (`/proc/net/tcp` or `tcp6`): the address the pending client listens on.
fn client_port(server: SocketAddr, client: IpAddr) -> Option<u16> {
    let table = if server.is_ipv4() {
        "/proc/net/tcp"
    } else {
        "/proc/net/tcp6"
    };
    let text = std::fs::read_to_string(table).ok()?;
    text.lines().skip(1).find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (local, remote, state) = (fields.get(1)?, fields.get(2)?, fields.get(3)?);
        // 01: ESTABLISHED.
        if *state != "01" {
            return None;
        }
        let local = parse_proc_addr(local)?;
        let remote = parse_proc_addr(remote)?;
        (local.ip() == client && remote == server).then_some(local.port())
    })
}

/// An address as `/proc/net/tcp{,6}` prints it: the address as 32-bit words in the host's
/// byte order, in hex, a colon, the port in hex.
fn parse_proc_addr(text: &str) -> Option<SocketAddr> {
    let (addr, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut octets = Vec::with_capacity(16);
    for word in 0..addr.len() / 8 {
        let value = u32::from_str_radix(&addr[word * 8..word * 8 + 8], 16).ok()?;
        octets.extend_from_slice(&value.to_ne_bytes());
    }
    let ip = match octets.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(octets).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(octets).ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The set-up request a preloaded acceptor sends for the connection `server`–`client`:
/// magic, then family, address and port of the server and of the client.
fn setup_request(magic: &[u8], server: SocketAddr, client: SocketAddr) -> Vec<u8> {
    let mut blob = magic.to_vec();
    for addr in [server, client] {
        match addr.ip() {
            IpAddr::V4(v4) => {
                blob.push(4);
                blob.extend_from_slice(&v4.octets());
            }
            IpAddr::V6(v6) => {
                blob.push(6);
                blob.extend_from_slice(&v6.octets());
            }
        }
        blob.extend_from_slice(&addr.port().to_be_bytes());
    }
    blob
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let parsed = (
        args.get(1).and_then(|a| a.parse::<SocketAddr>().ok()),
        args.get(2).and_then(|a| a.parse::<IpAddr>().ok()),
        args.get(3).and_then(|a| a.parse::<IpAddr>().ok()),
        args.get(4).and_then(|a| a.parse::<usize>().ok()),
    );
    let (Some(server), Some(client), Some(from), Some(count)) = parsed else {
        eprintln!("usage: san_hijack SERVER_ADDR:PORT CLIENT_ADDR FROM COUNT [MAGIC]");
        std::process::exit(2);
    };
    let magic = args.get(5).map_or(&b"SDV2"[..], |m| m.as_bytes());

    let started = Instant::now();
    let port = loop {
        if let Some(port) = client_port(server, client) {
            break port;
        }
        if started.elapsed() > FIND_TIMEOUT {
            println!("hijack failed: no connection from {client} to {server}");
            std::process::exit(1);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let target = SocketAddr::new(client, port);
    let request = setup_request(magic, server, target);
    let domain = match VerbsDomain::open_for_address(from) {
        Ok(domain) => domain,
        Err(error) => {
            println!("hijack failed: no RDMA device serves {from}: {error:?}");
            std::process::exit(1);
        }
    };
    let slots = SlotConfig {
        send_slots: 4,
        recv_slots: 4,
        slot_size: 256,
    };
    let mut held: Vec<VerbsConnection> = Vec::new();
    for n in 1..=count {
        let mut params = ConnectParams::new(slots);
        params.private_data = &request;
        params.timeout = Duration::from_secs(30);
        params.local = Some(SocketAddr::new(from, 0));
        // iWARP (siw): the ephemeral port rdma_cm picks may be taken among the kernel's TCP
        // ports (EADDRINUSE); a determined hijacker simply tries another.
        let mut attempt = VerbsConnection::connect(&domain, target, &params);
        for _ in 1..PORT_ATTEMPTS {
            if !matches!(attempt, Err(VerbsSetupError::Os(libc::EADDRINUSE))) {
                break;
            }
            attempt = VerbsConnection::connect(&domain, target, &params);
        }
        match attempt {
            Ok((conn, reply)) => {
                println!("hijack {n} accepted reply={}", reply.len());
                held.push(conn);
            }
            Err(error) => println!("hijack {n} refused: {error:?}"),
        }
        let _ = std::io::stdout().flush();
    }
    println!("hijack done accepted={}", held.len());
    let _ = std::io::stdout().flush();

    // Hold the connections until told to stop (stdin closes), bounded.
    let (done, closed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = done.send(());
    });
    let _ = closed.recv_timeout(HOLD_LIMIT);
    let mut dropped = 0;
    for conn in &mut held {
        conn.process_events();
        dropped += usize::from(conn.is_down());
    }
    println!("hijack dropped={dropped} of {}", held.len());
}
