//! Descriptor numbers next to SAN connections. It knows nothing of sandirect: run it natively
//! and under the preload.
//!
//! ```text
//! san_fds CONNECTIONS
//! ```
//!
//! Opens a listener, connects CONNECTIONS clients to it and accepts them (both ends in this
//! process), moves one byte each way on every connection (which switches it to the SAN under
//! the preload), opens one more socket, and prints
//!
//! ```text
//! fds: <every socket's number minus the listener's, in the order opened>
//! paths: <the data path published for each connected socket, in the same order>
//! open: <how many descriptors the process holds, the preload's own included>
//! ```
//!
//! Natively the numbers are consecutive. Programs rely on that (wrk sizes its event loop by
//! its connection count and fails a connection whose number does not fit), so the preload's
//! own descriptors must not take numbers among the application's.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;

fn main() -> std::io::Result<()> {
    let connections: usize = std::env::args()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .filter(|n| (1..=64).contains(n))
        .ok_or_else(|| std::io::Error::other("usage: san_fds CONNECTIONS (1..=64)"))?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let address = listener.local_addr()?;
    let mut clients = Vec::with_capacity(connections);
    let mut servers = Vec::with_capacity(connections);
    for _ in 0..connections {
        clients.push(TcpStream::connect(address)?);
        servers.push(listener.accept()?.0);
    }
    for (client, server) in clients.iter_mut().zip(&mut servers) {
        let mut byte = [0u8; 1];
        client.write_all(b"c")?;
        server.read_exact(&mut byte)?;
        server.write_all(b"s")?;
        client.read_exact(&mut byte)?;
        if byte != *b"s" {
            return Err(std::io::Error::other("wrong byte echoed"));
        }
    }
    let last = TcpStream::connect(address)?;
    let base = listener.as_raw_fd();
    let connected: Vec<i32> = clients
        .iter()
        .zip(&servers)
        .flat_map(|(c, s)| [c.as_raw_fd(), s.as_raw_fd()])
        .collect();
    let numbers: Vec<String> = connected
        .iter()
        .chain(std::iter::once(&last.as_raw_fd()))
        .map(|fd| (fd - base).to_string())
        .collect();
    println!("fds: {}", numbers.join(" "));
    let paths: Vec<String> = connected
        .iter()
        .map(|&fd| integration::published_path_of_fd(fd))
        .collect();
    println!("paths: {}", paths.join(" "));
    println!("open: {}", std::fs::read_dir("/proc/self/fd")?.count());
    Ok(())
}
