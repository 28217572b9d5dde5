//! A Rust `std::net` client and server in one process (what Rust programs do: SOCK_CLOEXEC
//! sockets, accept4, poll-free blocking I/O), exchanging a request and a reply. While the
//! connection is open it reads its own published stats file and reports what the interposer
//! recorded about it; natively there is nothing published.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};

use preload_core::record::{flags, Counter, SocketState};

fn main() -> std::io::Result<()> {
    let listener = TcpListener::bind("[::1]:0").or_else(|_| TcpListener::bind("127.0.0.1:0"))?;
    let address = listener.local_addr()?;
    // The server reports when its reply's write returned: the hook counts bytes after the real
    // call, so the client may read the reply before the server's counter moved.
    let (replied, reply_sent) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || -> std::io::Result<Vec<u8>> {
        let (mut stream, _) = listener.accept()?;
        let mut request = [0u8; 5];
        stream.read_exact(&mut request)?;
        stream.write_all(b"world!")?;
        let _ = replied.send(());
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest)?;
        Ok(request.to_vec())
    });
    let mut client = TcpStream::connect(address)?;
    client.write_all(b"hello")?;
    let mut reply = [0u8; 6];
    client.read_exact(&mut reply)?;
    println!("exchange: hello / {}", String::from_utf8_lossy(&reply));
    reply_sent
        .recv()
        .map_err(|_| std::io::Error::other("server thread ended before replying"))?;

    match integration::own_published_connections() {
        None => println!("published: none"),
        Some(connections) => {
            let connected: Vec<_> = connections
                .iter()
                // Connections that switched to the SAN are published as `San`; they are
                // connected sockets all the same (their pre-switch TCP bytes are counted).
                .filter(|c| matches!(c.state, SocketState::ConnectedTcp | SocketState::San))
                .collect();
            let sent: u64 = connected.iter().map(|c| c.counter(Counter::TcpSent)).sum();
            let received: u64 = connected
                .iter()
                .map(|c| c.counter(Counter::TcpReceived))
                .sum();
            let listeners = connections
                .iter()
                .filter(|c| c.state == SocketState::Listener)
                .count();
            let reasons: Vec<_> = connected.iter().map(|c| c.bypass.label()).collect();
            println!(
                "published: {} connected ({reasons:?}), {listeners} listener, tcp bytes sent {sent} received {received}",
                connected.len()
            );
        }
    }
    report_fork_child();
    drop(client);
    let request = server
        .join()
        .map_err(|_| std::io::Error::other("server thread panicked"))??;
    println!("server got: {}", String::from_utf8_lossy(&request));
    Ok(())
}

/// Forks while the connection is open; the child reports what *its own* stats file says (it
/// must have one, listing the inherited sockets as inherited) and exits normally.
fn report_fork_child() {
    // SAFETY: the child only reads a file, prints and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        match integration::own_published_connections() {
            None => println!("fork child: published none"),
            Some(connections) => {
                let inherited = connections
                    .iter()
                    .filter(|c| {
                        c.state == SocketState::ConnectedTcp && c.flags & flags::INHERITED != 0
                    })
                    .count();
                println!("fork child: own stats file, {inherited} inherited connected");
            }
        }
        std::process::exit(0);
    }
    let mut status = 0;
    // SAFETY: waiting for our child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
}
