//! The in-process cases: each asserts what a user of the socket sees (bytes intact and in
//! order, errnos as on kernel TCP, no hang) over seeded simulated links.

use super::*;
use std::os::fd::AsRawFd;

/// Bytes written on TCP while the client is pending, then over the SAN after the switch,
/// arrive once each and in order; the acceptor's early bytes (sent before the handshake
/// completed) reach the client.
#[test]
fn switch_over_keeps_tcp_bytes_then_san_bytes_in_order() {
    for_seeds("switch-over", |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let pair = Pair::pending(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let before = pattern(rng.gen_range(1..=50_000), 1);
        let after = pattern(rng.gen_range(1..=300_000), 2);
        let early = pattern(rng.gen_range(1..=20_000), 3);

        assert_eq!(pair.send(c, &before, 0), Ok(before.len()), "pending send");
        assert_eq!(pair.counter(c, Counter::TcpSent), before.len() as u64);
        pair.attach();
        // The server greets first: its session still handshakes, the bytes wait in it.
        assert_eq!(pair.send(a, &early, libc::MSG_DONTWAIT), Ok(early.len()));
        // The client's read finds the switch marker on TCP, switches, and gets the greeting.
        let got = pair.read_exact(c, a, early.len(), &mut rng);
        assert!(
            pair.is_switched(c),
            "reading the marker switched the client"
        );
        assert_same(&got, &early, "acceptor → client (early bytes)");

        pair.send_all(c, a, &after);
        let got = pair.read_exact(a, c, before.len() + after.len(), &mut rng);
        let mut whole = before.clone();
        whole.extend_from_slice(&after);
        assert_same(&got, &whole, "client → acceptor (TCP, then SAN)");
        assert_eq!(
            pair.counter(a, Counter::TcpReceived),
            before.len() as u64,
            "the acceptor read exactly the pending bytes from TCP"
        );
        assert_eq!(
            pair.counter(c, Counter::SanInlineSent),
            after.len() as u64,
            "everything after the switch went over the SAN"
        );
        assert_eq!(pair.counter(c, Counter::TcpSent), before.len() as u64);
    });
}

/// A pending client whose server never attaches (a plain server): the server's first byte
/// finds the segment unattached, the client drops its SAN object and stays on TCP, and every
/// byte of both directions arrives.
#[test]
fn pending_client_of_a_plain_server_stays_on_tcp() {
    for_seeds("plain server", |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let pair = Pair::pending(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let request = pattern(rng.gen_range(1..=60_000), 17);
        assert_eq!(pair.send(c, &request, 0), Ok(request.len()));
        let got = pair.read_blocking(a, request.len(), 4_096);
        assert_same(&got, &request, "request over TCP");
        let answer = pattern(rng.gen_range(1..=60_000), 18);
        assert_eq!(pair.send(a, &answer, 0), Ok(answer.len()));
        let got = pair.read_blocking(c, answer.len(), 5_000);
        assert_same(&got, &answer, "answer over TCP");
        assert!(lock(c.index).is_none(), "the client dropped its SAN object");
        assert_eq!(c.record.flags() & flags::SAN, 0);
        assert_eq!(pair.counter(c, Counter::TcpSent), request.len() as u64);
    });
}

/// Inline sends of many sizes, both ways, nonblocking with short writes and partial reads
/// of seeded sizes, under delays, reordering and late receives: the bytes arrive intact.
#[test]
fn inline_sends_of_many_sizes_arrive_intact() {
    for_seeds("inline sizes", |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x51);
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        for (round, len) in [
            1usize,
            7,
            4096,
            16_383,
            16_384,
            16_385,
            65_536,
            100_001,
            1 << 20,
        ]
        .into_iter()
        .enumerate()
        {
            let out = pattern(len, round as u8);
            let got = pair.transfer(c, a, &out, &mut rng);
            assert_same(&got, &out, &format!("client → acceptor, {len} bytes"));
            let back = pattern(len, 0x80 | round as u8);
            let got = pair.transfer(a, c, &back, &mut rng);
            assert_same(&got, &back, &format!("acceptor → client, {len} bytes"));
        }
        assert_eq!(pair.counter(c, Counter::TcpSent), 0, "nothing went on TCP");
    });
}

/// `MSG_PEEK` shows the head of the stream without consuming it, across message
/// boundaries; the reads that follow see the same bytes.
#[test]
fn peek_shows_bytes_without_consuming_them() {
    for_seeds("peek", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let data = pattern(40_000, 9);
        assert_eq!(pair.send(c, &data, 0), Ok(data.len()));
        let mut buf = vec![0u8; 50_000];
        // Wait until all of it is readable (peeks of the whole).
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            assert!(Instant::now() < deadline, "data stalled");
            match pair.recv(a, &mut buf, libc::MSG_PEEK | libc::MSG_DONTWAIT) {
                Ok(n) if n == data.len() => break,
                Ok(n) => {
                    assert_same(&buf[..n], &data[..n], "a partial peek");
                    pair.service(c);
                }
                Err(libc::EAGAIN) => pair.service(c),
                Err(e) => panic!("peek: errno {e}"),
            }
        }
        assert_same(&buf[..data.len()], &data, "peek of everything");
        let mut small = [0u8; 5];
        assert_eq!(pair.recv(a, &mut small, libc::MSG_PEEK), Ok(5));
        assert_eq!(small, data[..5]);
        assert_eq!(pair.recv(a, &mut small[..3], 0), Ok(3));
        assert_eq!(small[..3], data[..3]);
        assert_eq!(pair.recv(a, &mut small, libc::MSG_PEEK), Ok(5));
        assert_eq!(small, data[3..8], "the peek after a read starts after it");
        let mut rest = vec![0u8; data.len() - 3];
        assert_eq!(pair.recv(a, &mut rest, libc::MSG_WAITALL), Ok(rest.len()));
        assert_same(&rest, &data[3..], "the reads after peeks");
    });
}

/// A blocking `MSG_WAITALL` read returns the whole request once it is all there (the peer's
/// session is driven by the waiting thread, both ends being in this process).
#[test]
fn blocking_waitall_read_returns_everything() {
    for_seeds("waitall", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let data = pattern(300_000, 4);
        assert_eq!(pair.send(c, &data, 0), Ok(data.len()));
        let mut buf = vec![0u8; data.len()];
        assert_eq!(pair.recv(a, &mut buf, libc::MSG_WAITALL), Ok(data.len()));
        assert_same(&buf, &data, "MSG_WAITALL");
    });
}

/// Empty: a nonblocking read fails with `EAGAIN`, and a blocking read with `SO_RCVTIMEO`
/// fails with `EAGAIN` once the timeout passed, as on kernel TCP.
#[test]
fn empty_reads_fail_with_eagain() {
    for_seeds("eagain", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let a = &pair.acceptor;
        let mut buf = [0u8; 16];
        assert_eq!(
            pair.recv(a, &mut buf, libc::MSG_DONTWAIT),
            Err(libc::EAGAIN)
        );
        let timeout = libc::timeval {
            tv_sec: 0,
            tv_usec: 100_000,
        };
        // SAFETY: a valid timeval for our socket.
        let rc = unsafe {
            libc::setsockopt(
                a.fd,
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&timeout as *const libc::timeval).cast(),
                core::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        a.record.set_flag(flags::RCVTIMEO, true);
        let start = Instant::now();
        assert_eq!(pair.recv(a, &mut buf, 0), Err(libc::EAGAIN));
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(90) && waited < Duration::from_secs(5),
            "waited {waited:?} for a 100 ms timeout"
        );
    });
}

/// A blocking send larger than the send buffer (rendezvous off: inline, in many messages)
/// while another thread reads with blocking calls: exact bytes, no hang.
#[test]
fn large_blocking_send_with_a_blocking_reader() {
    for_seeds("large send", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let data = pattern(9 << 20, 5);
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| {
                let mut sent = 0;
                while sent < data.len() {
                    match pair.send(&pair.client, &data[sent..], 0) {
                        Ok(n) => sent += n,
                        Err(e) => panic!("send: errno {e}"),
                    }
                }
            });
            let mut got = Vec::with_capacity(data.len());
            let mut buf = vec![0u8; 1 << 20];
            while got.len() < data.len() {
                match pair.recv(&pair.acceptor, &mut buf, 0) {
                    Ok(0) => panic!("end of stream after {}", got.len()),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => panic!("recv: errno {e}"),
                }
            }
            sender.join().expect("sender");
            assert_same(&got, &data, "9 MiB blocking send");
        });
    });
}

/// Downgrade mid-stream (what `fork` does): bytes queued in the session both ways before,
/// bytes sent on TCP after, arrive exactly once and in order; the unread ones reach the
/// application through the stash.
#[test]
fn downgrade_mid_stream_keeps_bytes_exact() {
    for_seeds("downgrade", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let to_acceptor = pattern(30_000, 6);
        let to_client = pattern(20_000, 7);
        assert_eq!(pair.send(c, &to_acceptor, 0), Ok(to_acceptor.len()));
        assert_eq!(pair.send(a, &to_client, 0), Ok(to_client.len()));
        for _ in 0..20 {
            pair.service(a);
            pair.service(c);
        }
        let client_fd = c.fd;
        downgrade_all(Some(&move |fd| fd == client_fd));
        assert!(
            !matches!(lock(c.index).as_ref(), Some(SanObject::Socket(_))),
            "the client is no longer a SAN socket"
        );
        assert_ne!(
            c.record.flags() & flags::STASHED,
            0,
            "the bytes the client had not read went to its stash"
        );

        let tcp_to_acceptor = pattern(10_000, 8);
        let tcp_to_client = pattern(12_000, 10);
        assert_eq!(pair.send(c, &tcp_to_acceptor, 0), Ok(tcp_to_acceptor.len()));
        assert_eq!(pair.send(a, &tcp_to_client, 0), Ok(tcp_to_client.len()));

        let mut want = to_acceptor.clone();
        want.extend_from_slice(&tcp_to_acceptor);
        let got = pair.read_blocking(a, want.len(), 9_000);
        assert_same(&got, &want, "client → acceptor across the downgrade");
        assert!(
            !matches!(lock(a.index).as_ref(), Some(SanObject::Socket(_))),
            "the acceptor is no longer a SAN socket"
        );

        let mut want = to_client.clone();
        want.extend_from_slice(&tcp_to_client);
        let got = pair.read_blocking(c, want.len(), 7_000);
        assert_same(
            &got,
            &want,
            "acceptor → client across the downgrade (stash, TCP)",
        );
        let mut buf = [0u8; 8];
        assert_eq!(
            pair.recv(c, &mut buf, libc::MSG_DONTWAIT),
            Err(libc::EAGAIN)
        );
        assert_eq!(
            pair.recv(a, &mut buf, libc::MSG_DONTWAIT),
            Err(libc::EAGAIN)
        );
    });
}

/// A close after sending: the peer reads every byte, then end of stream (0), as over TCP.
#[test]
fn close_after_data_reads_data_then_eof() {
    for_seeds("close", |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let data = pattern(rng.gen_range(1..=500_000), 11);
        let mut sent = 0;
        while sent < data.len() {
            match pair.send(c, &data[sent..], libc::MSG_DONTWAIT) {
                Ok(n) => sent += n,
                Err(libc::EAGAIN) => pair.service(a),
                Err(e) => panic!("send: errno {e}"),
            }
        }
        pair.close(c);
        let got = pair.read_to_end(a, a);
        assert_same(&got, &data, "bytes before the close");
        let mut buf = [0u8; 8];
        assert_eq!(
            pair.recv(a, &mut buf, libc::MSG_DONTWAIT),
            Ok(0),
            "EOF stays"
        );
    });
}

/// `shutdown(SHUT_WR)`: the peer reads the data then end of stream, can still answer, and
/// the shut side's next send fails with `EPIPE` (as on kernel TCP).
#[test]
fn shutdown_write_gives_eof_and_the_peer_still_answers() {
    for_seeds("shutdown", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let request = pattern(25_000, 12);
        assert_eq!(pair.send(c, &request, 0), Ok(request.len()));
        pair.shutdown(c, libc::SHUT_WR);
        let got = pair.read_to_end(a, c);
        assert_same(&got, &request, "request before the FIN");
        let answer = pattern(33_000, 13);
        assert_eq!(pair.send(a, &answer, 0), Ok(answer.len()));
        let mut got = vec![0u8; answer.len()];
        assert_eq!(pair.recv(c, &mut got, libc::MSG_WAITALL), Ok(answer.len()));
        assert_same(&got, &answer, "answer after our FIN");
        // Kernel TCP: a send after SHUT_WR fails with EPIPE.
        let (kernel_client, _kernel_server) = kernel_pair();
        let kernel_fd = std::os::fd::AsRawFd::as_raw_fd(&kernel_client);
        // SAFETY: our socket.
        let rc = unsafe { libc::shutdown(kernel_fd, libc::SHUT_WR) };
        assert_eq!(rc, 0);
        let kernel = kernel_send(&kernel_client, b"x");
        assert_eq!(pair.send(c, b"x", libc::MSG_DONTWAIT), kernel);
    });
}

/// A fabric slower than TCP: the client's FIN (on TCP) reaches the acceptor before the
/// client's `Hello` and the data behind it (over the session). The acceptor reads every byte,
/// then the end of the stream; not an end of the stream in place of the data.
#[test]
fn a_fin_that_overtakes_the_clients_session_ends_the_stream_after_its_data() {
    for_seeds("fin before hello", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let request = pattern(40_000, 21);
        assert_eq!(pair.send(c, &request, 0), Ok(request.len()));
        pair.shutdown(c, libc::SHUT_WR);
        pair.lag_completions(a, 5);
        let got = pair.read_to_end(a, c);
        assert_same(&got, &request, "request before the FIN");
    });
}

/// A client that shut down its sending side while pending (its acceptor not attached yet)
/// sent every byte on TCP and sends no `Hello` until its next call: the acceptor reads them,
/// then the end of the stream, for good (as kernel TCP answers: 0 again).
#[test]
fn a_client_that_shut_down_while_pending_ends_its_stream_on_tcp() {
    for_seeds("shutdown while pending", |seed| {
        let pair = Pair::pending(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let request = pattern(30_000, 22);
        assert_eq!(pair.send(c, &request, 0), Ok(request.len()));
        pair.shutdown(c, libc::SHUT_WR);
        pair.attach();
        let started = Instant::now();
        let got = pair.read_to_end(a, a);
        assert_same(&got, &request, "request before the FIN");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the end of the stream came late: {:?}",
            started.elapsed()
        );
        let mut buf = [0u8; 8];
        assert_eq!(
            pair.recv(a, &mut buf, libc::MSG_DONTWAIT),
            Ok(0),
            "EOF stays"
        );
        assert_eq!(pair.recv(a, &mut buf, 0), Ok(0), "EOF stays (blocking)");
    });
}

/// The peer closes (gracefully) with nothing unread: reads see end of stream; sends fail
/// with the errno kernel TCP gives after the same calls (first send accepted, `EPIPE` once
/// the peer's reset came back).
#[test]
fn sends_after_the_peer_closed_fail_like_tcp() {
    // The kernel's answers to: peer closes; we read (EOF); we send; we send again.
    let kernel = {
        let (client, server) = kernel_pair();
        drop(client);
        std::thread::sleep(Duration::from_millis(20));
        let mut buf = [0u8; 8];
        let eof = kernel_recv(&server, &mut buf);
        let first = kernel_send(&server, b"late");
        std::thread::sleep(Duration::from_millis(20));
        let second = kernel_send(&server, b"late");
        (eof, first, second)
    };
    assert_eq!(
        kernel,
        (Ok(0), Ok(4), Err(libc::EPIPE)),
        "the kernel's answers"
    );
    for_seeds("peer close", move |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        pair.close(c);
        let got = pair.read_to_end(a, a);
        assert!(got.is_empty());
        let first = pair.send(a, b"late", libc::MSG_DONTWAIT);
        // The reset comes back as soon as the peer's absence is noticed (bounded).
        let deadline = Instant::now() + Duration::from_secs(5);
        let second = loop {
            pair.service(a);
            let result = pair.send(a, b"late", libc::MSG_DONTWAIT);
            if result.is_err() || Instant::now() >= deadline {
                break result;
            }
        };
        assert_eq!((first, second), (kernel.1, kernel.2));
    });
}

/// The kernel's answers after the peer's abortive close (`SO_LINGER` 0) to: read, read,
/// send.
fn kernel_after_abortive_close() -> (
    Result<usize, c_int>,
    Result<usize, c_int>,
    Result<usize, c_int>,
) {
    let (client, server) = kernel_pair();
    set_linger_zero(std::os::fd::AsRawFd::as_raw_fd(&client));
    drop(client);
    std::thread::sleep(Duration::from_millis(20));
    let mut buf = [0u8; 8];
    let first = kernel_recv(&server, &mut buf);
    let second = kernel_recv(&server, &mut buf);
    let send = kernel_send(&server, b"x");
    (first, second, send)
}

/// The same calls on an acceptor whose client closed abortively.
fn san_after_abortive_close(
    seed: u64,
) -> (
    Result<usize, c_int>,
    Result<usize, c_int>,
    Result<usize, c_int>,
) {
    let pair = Pair::switched(seed, benign_faults());
    let (c, a) = (&pair.client, &pair.acceptor);
    set_linger_zero(c.fd);
    pair.close(c);
    let mut buf = [0u8; 8];
    let deadline = Instant::now() + Duration::from_secs(5);
    let first = loop {
        match pair.recv(a, &mut buf, libc::MSG_DONTWAIT) {
            Err(libc::EAGAIN) if Instant::now() < deadline => pair.service(a),
            other => break other,
        }
    };
    let second = pair.recv(a, &mut buf, libc::MSG_DONTWAIT);
    let send = pair.send(a, b"x", libc::MSG_DONTWAIT);
    (first, second, send)
}

/// An abortive close (`SO_LINGER` 0) of the peer: as over kernel TCP, the next read fails
/// with `ECONNRESET` and later reads see end of stream.
#[test]
fn abortive_peer_close_resets_reads_like_tcp() {
    let kernel = kernel_after_abortive_close();
    assert_eq!(
        (kernel.0, kernel.1),
        (Err(libc::ECONNRESET), Ok(0)),
        "the kernel's answers"
    );
    for_seeds("abortive close", move |seed| {
        let san = san_after_abortive_close(seed);
        assert_eq!((san.0, san.1), (kernel.0, kernel.1));
    });
}

/// After the reset was reported (by a read), kernel TCP refuses sends with `EPIPE` (the
/// socket is closed; `ECONNRESET` is reported once).
#[test]
fn send_after_a_reported_reset_fails_with_epipe() {
    let kernel = kernel_after_abortive_close();
    assert_eq!(kernel.2, Err(libc::EPIPE), "the kernel's answer");
    for_seeds("send after reset", move |seed| {
        assert_eq!(san_after_abortive_close(seed).2, kernel.2);
    });
}

/// A blocking `MSG_WAITALL` read whose request spans the peer's downgrade (its session's
/// last bytes, then its first TCP bytes) returns all of it, as kernel TCP would.
#[test]
fn waitall_read_across_a_downgrade_returns_everything() {
    for_seeds("waitall across downgrade", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let over_san = pattern(30_000, 15);
        assert_eq!(pair.send(c, &over_san, 0), Ok(over_san.len()));
        let client_fd = c.fd;
        downgrade_all(Some(&move |fd| fd == client_fd));
        let over_tcp = pattern(10_000, 16);
        assert_eq!(pair.send(c, &over_tcp, 0), Ok(over_tcp.len()));
        let mut want = over_san.clone();
        want.extend_from_slice(&over_tcp);
        let mut got = vec![0u8; want.len()];
        assert_eq!(pair.recv(a, &mut got, libc::MSG_WAITALL), Ok(want.len()));
        assert_same(&got, &want, "MSG_WAITALL across the downgrade");
    });
}

/// The connection breaks under the session (a fatal transport error): the application
/// sees `ECONNRESET` once, then end of stream; nothing hangs.
#[test]
fn transport_error_is_a_reset() {
    for_seeds("transport error", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let data = pattern(10_000, 14);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let got = pair.transfer(c, a, &data, &mut rng);
        assert_same(&got, &data, "before the error");
        {
            let world = world(&pair.world);
            let id = world.conns[0].as_ref().expect("client connection").id();
            world.fabric.inject_qp_error(id).expect("inject");
        }
        let mut buf = [0u8; 8];
        let deadline = Instant::now() + Duration::from_secs(5);
        let first = loop {
            match pair.recv(a, &mut buf, libc::MSG_DONTWAIT) {
                Err(libc::EAGAIN) if Instant::now() < deadline => pair.service(c),
                other => break other,
            }
        };
        assert_eq!(first, Err(libc::ECONNRESET));
        assert_eq!(pair.recv(a, &mut buf, libc::MSG_DONTWAIT), Ok(0));
    });
}

/// `writev`/`readv` on a kernel socket: the count or the errno.
fn kernel_vector(fd: c_int, bufs: &[RawBuf], sending: bool) -> Result<usize, c_int> {
    // SAFETY: `RawBuf` has the layout of `iovec`; the kernel checks every address.
    let n = unsafe {
        let iov = bufs.as_ptr().cast::<libc::iovec>();
        if sending {
            libc::writev(fd, iov, bufs.len() as c_int)
        } else {
            libc::readv(fd, iov, bufs.len() as c_int)
        }
    };
    if n < 0 {
        Err(errno::get())
    } else {
        Ok(n as usize)
    }
}

/// A buffer the process may not access answers as kernel TCP answers (the oracle: the same
/// calls on a loopback pair): `EFAULT`, with nothing of a send taken and the bytes of a
/// receive left unread, a vector faulting as a whole (a bad second buffer behind a good
/// first one takes nothing of either); the stream then goes on with every byte intact.
#[test]
fn bad_buffers_answer_efault_as_the_kernel_does_and_the_stream_stays_intact() {
    for_seeds("bad buffers", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let (kernel_client, kernel_server) = kernel_pair();
        let memory = BadMemory::new(BadMemory::PAGE);
        let san = |end: &End, bufs: &[RawBuf], sending: bool| {
            let flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
            let result = if sending {
                send_iov(end.fd, end.index, bufs, flags)
            } else {
                recv_iov(end.fd, end.index, bufs, flags)
            };
            result
                .expect("a SAN socket")
                .map(|n| n as usize)
                .map_err(|Errno(code)| code)
        };
        let vectors = [
            vec![memory.up_to_wall(0, 100)],
            vec![memory.up_to_wall(50, 100)],
            vec![BadMemory::unmapped(100)],
            vec![RawBuf {
                ptr: core::ptr::null_mut(),
                len: 10,
            }],
            vec![memory.good(100), memory.up_to_wall(0, 100)],
            vec![memory.good(100), BadMemory::unmapped(10)],
        ];
        for bufs in &vectors {
            let kernel = kernel_vector(kernel_client.as_raw_fd(), bufs, true);
            assert_eq!(kernel, Err(libc::EFAULT), "the kernel's send of {bufs:?}");
            assert_eq!(san(c, bufs, true), kernel, "send of {bufs:?}");
        }
        // Nothing of those sends was taken.
        let after = pattern(3000, 41);
        pair.send_all(c, a, &after);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        assert_same(
            &pair.read_exact(a, c, after.len(), &mut rng),
            &after,
            "client → acceptor after the bad sends",
        );

        // One message queued on each side, then the same bad receives.
        let message = pattern(100, 42);
        assert_eq!(kernel_send(&kernel_client, &message), Ok(100));
        assert_eq!(pair.send(a, &message, 0), Ok(100));
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut peeked = [0u8; 200];
        while pair.recv(c, &mut peeked, libc::MSG_PEEK | libc::MSG_DONTWAIT) != Ok(100) {
            assert!(Instant::now() < deadline, "the message did not arrive");
            pair.service(a);
        }
        let mut kernel_arrival = libc::pollfd {
            fd: kernel_server.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        assert_eq!(unsafe { libc::poll(&mut kernel_arrival, 1, 5000) }, 1);
        let mut first = [0u8; 10];
        let good_then_bad = [
            RawBuf {
                ptr: first.as_mut_ptr(),
                len: first.len(),
            },
            memory.up_to_wall(0, 100),
        ];
        let receives = [
            vec![memory.up_to_wall(0, 100)],
            vec![memory.up_to_wall(10, 100)],
            vec![BadMemory::unmapped(100)],
            good_then_bad.to_vec(),
        ];
        for bufs in &receives {
            let kernel = kernel_vector(kernel_server.as_raw_fd(), bufs, false);
            assert_eq!(
                kernel,
                Err(libc::EFAULT),
                "the kernel's receive into {bufs:?}"
            );
            assert_eq!(san(c, bufs, false), kernel, "receive into {bufs:?}");
        }
        // The bytes stayed, whole, on both.
        let mut got = vec![0u8; 200];
        assert_eq!(kernel_recv(&kernel_server, &mut got), Ok(100));
        assert_same(&got[..100], &message, "kernel bytes after the bad receives");
        assert_same(
            &pair.read_exact(c, a, 100, &mut rng),
            &message,
            "acceptor → client after the bad receives",
        );
    });
}

/// A send whose buffers fault after more than 64 KiB keeps the whole 64 KiB units before the
/// fault, as the kernel keeps the whole segments it copied (a short count), and nothing
/// after them.
#[test]
fn a_send_faulting_past_64_kib_takes_the_whole_units_before_the_fault() {
    for_seeds("send faulting past 64 KiB", |seed| {
        let pair = Pair::switched(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let memory = BadMemory::new(BadMemory::PAGE);
        let data = pattern(100_000, 43);
        let bufs = [
            RawBuf {
                ptr: data.as_ptr().cast_mut(),
                len: data.len(),
            },
            memory.up_to_wall(0, 100),
        ];
        let sent = send_iov(
            c.fd,
            c.index,
            &bufs,
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        );
        assert_eq!(sent, Some(Ok(64 << 10)));
        let tail = pattern(500, 44);
        pair.send_all(c, a, &tail);
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut want = data[..64 << 10].to_vec();
        want.extend_from_slice(&tail);
        assert_same(
            &pair.read_exact(a, c, want.len(), &mut rng),
            &want,
            "the units before the fault, then what followed",
        );
    });
}

/// An acceptor that read the client's pre-switch bytes before the client's `Hello` came (its
/// count unknown) has nothing more to read: readiness must not say otherwise, whatever raised
/// its mirror meanwhile (a level-triggered epoll reader was handed `EPOLLIN` and then `EAGAIN`).
/// Once the count comes, the bytes still due, and only those, are readable.
#[test]
fn an_acceptor_that_read_the_pre_switch_bytes_has_nothing_more_to_read() {
    for_seeds("pre-switch bytes read", |seed| {
        let pair = Pair::pending(seed, benign_faults());
        let (c, a) = (&pair.client, &pair.acceptor);
        let request = pattern(5, 21);
        assert_eq!(pair.send(c, &request, 0), Ok(request.len()), "pending send");
        pair.attach();
        let readable = |end: &End| match lock(end.index).as_mut() {
            Some(SanObject::Socket(socket)) => {
                socket.service();
                (
                    socket.tcp_backlog(),
                    socket.readiness().readable || socket.tcp_bytes_readable(end.fd),
                )
            }
            _ => panic!("the acceptor is a SAN socket"),
        };
        assert_eq!(readable(a), (None, true), "the bytes wait on TCP");
        let mut got = vec![0; request.len()];
        assert_eq!(pair.recv(a, &mut got, 0), Ok(request.len()));
        assert_same(&got, &request, "client → acceptor before the switch");
        assert_eq!(readable(a), (None, false), "read, before the count came");
        assert_eq!(
            pair.recv(a, &mut got, libc::MSG_DONTWAIT),
            Err(libc::EAGAIN),
            "and a read says so"
        );
        // The client switches at its next call; its Hello brings the count (all read).
        switch_pending(c.fd, c.index);
        assert!(pair.is_switched(c), "the client switched");
        for _ in 0..1_000 {
            pair.service(c);
            if readable(a).0.is_some() {
                break;
            }
            world(&pair.world).run();
        }
        assert_eq!(readable(a), (Some(0), false), "the count came: nothing due");
    });
}
