//! Paths around the hooks, as real programs take them. It knows nothing of sandirect: run it
//! natively and under the preload.
//!
//! ```text
//! handoff io-uring-setup        set up an io_uring through libc's syscall(); print the answer
//! handoff master [greet]        master/worker server: print "port N", fork a worker, accept
//!                               one connection, pass it to the worker with SCM_RIGHTS, close
//!                               it here; the worker echoes until EOF. With `greet` the master
//!                               passes the connection at once and the worker speaks first
//!                               (`hello\n`); without, it waits 200 ms (the request is there).
//! handoff client PORT BYTES [greet]  (read the greeting,) send BYTES (a pattern) and check
//!                               the echo; print the count
//! ```

use std::ffi::c_int;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};

fn fail(what: &str) -> ! {
    eprintln!("handoff: {what}: {}", std::io::Error::last_os_error());
    std::process::exit(1)
}

fn io_uring_setup() {
    // The kernel fills the parameters (struct io_uring_params is 120 bytes).
    let mut params = [0u8; 120];
    // SAFETY: io_uring_setup(2) with a zeroed parameter block of the kernel's size.
    let rc = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4 as c_int, params.as_mut_ptr()) };
    if rc >= 0 {
        println!("io_uring_setup: ring");
        // SAFETY: the ring descriptor just returned.
        unsafe { libc::close(rc as c_int) };
    } else {
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        println!("io_uring_setup: {}", integration::errno_name(errno));
    }
}

/// Sends `fd` over the unix socket `channel` (one byte of data, the descriptor as SCM_RIGHTS).
fn send_fd(channel: c_int, fd: c_int) {
    let mut space = [0u64; 4];
    let byte = [b'f'];
    let mut iov = libc::iovec {
        iov_base: byte.as_ptr().cast_mut().cast(),
        iov_len: 1,
    };
    // SAFETY: a zeroed msghdr filled with valid buffers below.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE is a size computation.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as usize;
    // SAFETY: the control buffer is large enough for one descriptor.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(4) as usize;
        libc::CMSG_DATA(cmsg).cast::<c_int>().write_unaligned(fd);
    }
    // SAFETY: a valid message.
    if unsafe { libc::sendmsg(channel, &msg, 0) } != 1 {
        fail("sendmsg");
    }
}

/// Receives one descriptor from `channel`.
fn receive_fd(channel: c_int) -> c_int {
    let mut space = [0u64; 4];
    let mut byte = [0u8];
    let mut iov = libc::iovec {
        iov_base: byte.as_mut_ptr().cast(),
        iov_len: 1,
    };
    // SAFETY: a zeroed msghdr filled with valid buffers below.
    let mut msg: libc::msghdr = unsafe { core::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = space.as_mut_ptr().cast();
    msg.msg_controllen = core::mem::size_of_val(&space);
    // SAFETY: a valid message.
    if unsafe { libc::recvmsg(channel, &mut msg, libc::MSG_CMSG_CLOEXEC) } != 1 {
        fail("recvmsg");
    }
    // SAFETY: the kernel wrote one SCM_RIGHTS message into our buffer.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
            fail("no descriptor received");
        }
        libc::CMSG_DATA(cmsg).cast::<c_int>().read_unaligned()
    }
}

fn master(greet: bool) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap_or_else(|_| fail("bind"));
    let mut ends = [0; 2];
    // SAFETY: an array of two ints.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            ends.as_mut_ptr(),
        )
    } != 0
    {
        fail("socketpair");
    }
    // The worker is forked before any connection exists, as pre-forking servers do.
    // SAFETY: the child only makes system calls and exits.
    let worker = unsafe { libc::fork() };
    if worker < 0 {
        fail("fork");
    }
    if worker == 0 {
        drop(listener);
        let fd = receive_fd(ends[1]);
        // SAFETY: the descriptor just received is ours alone.
        let mut stream = unsafe { TcpStream::from_raw_fd(fd) };
        if greet {
            stream
                .write_all(b"hello\n")
                .unwrap_or_else(|_| fail("greeting"));
        }
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => stream
                    .write_all(&buf[..n])
                    .unwrap_or_else(|_| fail("worker write")),
                Err(_) => fail("worker read"),
            }
        }
        // SAFETY: ending the worker.
        unsafe { libc::_exit(0) };
    }
    println!("port {}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    let (connection, _) = listener.accept().unwrap_or_else(|_| fail("accept"));
    if !greet {
        // The client's first bytes are in flight (or here) while the master decides.
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let fd = connection.into_raw_fd();
    send_fd(ends[0], fd);
    // SAFETY: our copy of the passed connection.
    unsafe { libc::close(fd) };
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(worker, &mut status, 0) };
    println!("worker exit {}", libc::WEXITSTATUS(status));
}

fn client(port: u16, bytes: usize, greet: bool) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap_or_else(|_| fail("connect"));
    if greet {
        let mut greeting = [0u8; 6];
        stream
            .read_exact(&mut greeting)
            .unwrap_or_else(|_| fail("greeting"));
        if &greeting != b"hello\n" {
            fail("wrong greeting");
        }
    }
    let pattern: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    let mut writer = stream.try_clone().unwrap_or_else(|_| fail("clone"));
    let sent = pattern.clone();
    let sender = std::thread::spawn(move || {
        writer
            .write_all(&sent)
            .unwrap_or_else(|_| fail("client write"));
        writer
            .shutdown(std::net::Shutdown::Write)
            .unwrap_or_else(|_| fail("shutdown"));
    });
    let mut echoed = Vec::with_capacity(bytes);
    stream
        .read_to_end(&mut echoed)
        .unwrap_or_else(|_| fail("client read"));
    sender.join().unwrap();
    let intact = echoed == pattern;
    println!("echoed {} intact {intact}", echoed.len());
    let _ = stream.as_raw_fd();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("io-uring-setup") => io_uring_setup(),
        Some("master") => master(args.get(2).is_some_and(|a| a == "greet")),
        Some("client") => {
            let port = args
                .get(2)
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| fail("port"));
            let bytes = args
                .get(3)
                .and_then(|b| b.parse().ok())
                .unwrap_or_else(|| fail("bytes"));
            client(port, bytes, args.get(4).is_some_and(|a| a == "greet"));
        }
        _ => {
            eprintln!("usage: handoff io-uring-setup | master [greet] | client PORT BYTES [greet]");
            std::process::exit(2);
        }
    }
}
