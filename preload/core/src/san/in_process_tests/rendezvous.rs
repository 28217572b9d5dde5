//! The rendezvous cases: large blocking sends that move the application's buffer zero-copy
//! (READ and WRITE mode), receivers with small buffers and `MSG_PEEK`, refused
//! registrations, under seeded delays and reordering (see [`super::rdma`]).

use super::*;
use crate::san::tunables::SHM_RENDEZVOUS_THRESHOLD;

/// The smallest blocking send that goes by rendezvous.
const THRESHOLD: usize = SHM_RENDEZVOUS_THRESHOLD as usize;

/// Heavier than [`benign_faults`]: a completion in five late, one in five reordered.
fn rough_faults() -> FaultConfig {
    FaultConfig {
        completion_delay: 0.2,
        reorder: 0.2,
        delayed_repost: 0.1,
        ..FaultConfig::NONE
    }
}

/// A switched rendezvous pair whose sessions are established (a few inline bytes went each
/// way; returns how many each end sent).
fn established(seed: u64, faults: FaultConfig, mode: Rendezvous) -> (Pair, usize) {
    let pair = Pair::switched_with(seed, faults, Some(mode));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xe5);
    let hello = pattern(100, 0x40);
    let got = pair.transfer(&pair.client, &pair.acceptor, &hello, &mut rng);
    assert_same(&got, &hello, "client → acceptor (warm-up)");
    let got = pair.transfer(&pair.acceptor, &pair.client, &hello, &mut rng);
    assert_same(&got, &hello, "acceptor → client (warm-up)");
    (pair, hello.len())
}

/// Sends all of `data` from `from` with blocking calls (one call per remaining piece).
fn send_blocking(pair: &Pair, from: &End, data: &[u8]) {
    let mut sent = 0;
    while sent < data.len() {
        match pair.send(from, &data[sent..], 0) {
            Ok(n) => sent += n,
            Err(e) => panic!("send: errno {e} after {sent}"),
        }
    }
}

/// Asserts the bytes went by rendezvous both ends (the records' counters) and the simulated
/// RDMA never touched memory its keys did not cover.
#[track_caller]
fn assert_rendezvous(pair: &Pair, from: &End, to: &End, bytes: usize, inline: usize) {
    assert_eq!(
        pair.counter(from, Counter::SanRendezvousSent),
        bytes as u64,
        "rendezvous bytes sent"
    );
    assert_eq!(
        pair.counter(to, Counter::SanRendezvousReceived),
        bytes as u64,
        "rendezvous bytes received"
    );
    assert_eq!(
        pair.counter(from, Counter::SanInlineSent),
        inline as u64,
        "inline bytes sent"
    );
    assert_eq!(pair.rdma_violations(), Vec::<String>::new());
}

/// A blocking send of at least the threshold, a blocking reader on another thread: the bytes
/// arrive exact, moved by the rendezvous (not inline).
fn blocking_send_moves_by_rendezvous(mode: Rendezvous) {
    for_seeds(&format!("rendezvous {mode:?}"), move |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let (pair, warm_up) = established(seed, benign_faults(), mode);
        let (c, a) = (&pair.client, &pair.acceptor);
        let data = pattern(THRESHOLD + rng.gen_range(0..=1 << 20), 21);
        std::thread::scope(|scope| {
            scope.spawn(|| assert_eq!(pair.send(c, &data, 0), Ok(data.len()), "one call"));
            let got = pair.read_blocking(a, data.len(), data.len());
            assert_same(&got, &data, "rendezvous send");
        });
        assert_rendezvous(&pair, c, a, data.len(), warm_up);
    });
}

#[test]
fn blocking_send_moves_by_rendezvous_in_read_mode() {
    blocking_send_moves_by_rendezvous(Rendezvous::READ);
}

#[test]
fn blocking_send_moves_by_rendezvous_in_write_mode() {
    blocking_send_moves_by_rendezvous(Rendezvous::WRITE);
}

/// A reader whose buffer is smaller than the segment gets `min(buffer, remaining)` bytes per
/// call, and the segment continues at the next call (one RDMA request may move a whole
/// buffer here: no request limit below it).
fn small_reads_of_a_segment(read_mode: bool) {
    let mode = Rendezvous {
        read_mode,
        max_rdma_len: 1 << 30,
    };
    for_seeds(&format!("small reads {mode:?}"), move |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5e);
        let (pair, warm_up) = established(seed, benign_faults(), mode);
        let (c, a) = (&pair.client, &pair.acceptor);
        let data = pattern(THRESHOLD + rng.gen_range(0..=300_000), 22);
        std::thread::scope(|scope| {
            scope.spawn(|| assert_eq!(pair.send(c, &data, 0), Ok(data.len()), "one call"));
            let mut got = Vec::with_capacity(data.len());
            let mut buf = vec![0u8; 1_500_000];
            while got.len() < data.len() {
                let want = rng.gen_range(1..=buf.len());
                let n = pair.recv(a, &mut buf[..want], 0).expect("recv");
                let remaining = data.len() - got.len();
                assert_eq!(
                    n,
                    want.min(remaining),
                    "one read of {want} at {}",
                    got.len()
                );
                got.extend_from_slice(&buf[..n]);
            }
            assert_same(&got, &data, "small reads");
        });
        assert_rendezvous(&pair, c, a, data.len(), warm_up);
    });
}

#[test]
fn small_reads_of_a_segment_in_read_mode() {
    small_reads_of_a_segment(true);
}

#[test]
fn small_reads_of_a_segment_in_write_mode() {
    small_reads_of_a_segment(false);
}

/// `MSG_PEEK` of a rendezvous segment shows its head without consuming it; the reads that
/// follow return the whole segment.
fn peek_of_a_segment(mode: Rendezvous) {
    for_seeds(&format!("peek segment {mode:?}"), move |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x9e);
        let (pair, warm_up) = established(seed, benign_faults(), mode);
        let (c, a) = (&pair.client, &pair.acceptor);
        let data = pattern(THRESHOLD + rng.gen_range(0..=100_000), 23);
        std::thread::scope(|scope| {
            scope.spawn(|| assert_eq!(pair.send(c, &data, 0), Ok(data.len()), "one call"));
            for _ in 0..2 {
                let want = rng.gen_range(1..=2 << 20);
                let mut buf = vec![0u8; want];
                let n = pair.recv(a, &mut buf, libc::MSG_PEEK).expect("peek");
                assert!(n > 0 && n <= want, "peek of {want}: {n}");
                assert_same(&buf[..n], &data[..n], "peeked bytes");
            }
            assert_eq!(
                pair.counter(a, Counter::SanRendezvousReceived),
                0,
                "a peek consumes nothing"
            );
            let got = pair.read_blocking(a, data.len(), 3 << 20);
            assert_same(&got, &data, "reads after the peeks");
        });
        assert_rendezvous(&pair, c, a, data.len(), warm_up);
    });
}

#[test]
fn peek_of_a_segment_in_read_mode() {
    peek_of_a_segment(Rendezvous::READ);
}

#[test]
fn peek_of_a_segment_in_write_mode() {
    peek_of_a_segment(Rendezvous::WRITE);
}

/// A refused sender registration: the send fails with `ENOBUFS` and nothing of it was sent;
/// the stream goes on in order (a smaller send of the same bytes goes inline, a large one
/// by rendezvous again).
fn refused_registration_is_enobufs(mode: Rendezvous) {
    for_seeds(&format!("refused registration {mode:?}"), move |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xb0);
        let (pair, warm_up) = established(seed, benign_faults(), mode);
        let (c, a) = (&pair.client, &pair.acceptor);
        let big = pattern(THRESHOLD + rng.gen_range(0..=100_000), 24);
        pair.registrations().lock().refuse_next(1);
        assert_eq!(pair.send(c, &big, 0), Err(libc::ENOBUFS));
        assert_eq!(pair.registrations().lock().held(), 0, "nothing registered");
        // Nothing of it went out.
        let mut probe = [0u8; 16];
        for _ in 0..20 {
            pair.service(c);
            assert_eq!(
                pair.recv(a, &mut probe, libc::MSG_DONTWAIT),
                Err(libc::EAGAIN),
                "a refused send sends nothing"
            );
        }
        let small = &big[..rng.gen_range(1..=200_000)];
        let again = pattern(THRESHOLD, 25);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                assert_eq!(pair.send(c, small, 0), Ok(small.len()), "smaller: inline");
                assert_eq!(pair.send(c, &again, 0), Ok(again.len()), "large again");
            });
            let got = pair.read_blocking(a, small.len() + again.len(), 1 << 20);
            let mut want = small.to_vec();
            want.extend_from_slice(&again);
            assert_same(&got, &want, "the stream after the refusal");
        });
        assert_rendezvous(&pair, c, a, again.len(), warm_up + small.len());
    });
}

#[test]
fn refused_registration_is_enobufs_in_read_mode() {
    refused_registration_is_enobufs(Rendezvous::READ);
}

#[test]
fn refused_registration_is_enobufs_in_write_mode() {
    refused_registration_is_enobufs(Rendezvous::WRITE);
}

/// A refused sink registration turns the rendezvous down: the sender sends the bytes
/// inline instead, and they arrive exact and in order.
fn refused_sink_goes_inline(mode: Rendezvous) {
    for_seeds(&format!("refused sink {mode:?}"), move |seed| {
        let (pair, warm_up) = established(seed, benign_faults(), mode);
        let (c, a) = (&pair.client, &pair.acceptor);
        let data = pattern(THRESHOLD + 12_345, 26);
        std::thread::scope(|scope| {
            scope.spawn(|| send_blocking(&pair, c, &data));
            // The sender's buffer is registered: refuse the receiver's sink.
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let mut registrations = pair.registrations().lock();
                if registrations.held() > 0 {
                    registrations.refuse_next(1);
                    break;
                }
                drop(registrations);
                assert!(Instant::now() < deadline, "the rendezvous never started");
                std::thread::sleep(Duration::from_millis(1));
            }
            let got = pair.read_blocking(a, data.len(), 1 << 20);
            assert_same(&got, &data, "after a refused sink");
        });
        assert_eq!(pair.counter(c, Counter::SanRendezvousSent), 0);
        assert_eq!(pair.counter(a, Counter::SanRendezvousReceived), 0);
        assert_eq!(
            pair.counter(c, Counter::SanInlineSent),
            (warm_up + data.len()) as u64,
            "everything went inline"
        );
        assert_eq!(pair.rdma_violations(), Vec::<String>::new());
    });
}

#[test]
fn refused_sink_goes_inline_in_read_mode() {
    refused_sink_goes_inline(Rendezvous::READ);
}

#[test]
fn refused_sink_goes_inline_in_write_mode() {
    refused_sink_goes_inline(Rendezvous::WRITE);
}

/// Rendezvous sends back to back both ways at once, interleaved with inline ones, under
/// heavier delays and reordering, with seeded reader buffer sizes: every byte exact and in
/// order.
fn rendezvous_under_rough_faults(mode: Rendezvous) {
    for_seeds(&format!("rough rendezvous {mode:?}"), move |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x7f);
        let (pair, warm_up) = established(seed, rough_faults(), mode);
        let (c, a) = (&pair.client, &pair.acceptor);
        let mut sends = Vec::new();
        for round in 0..3u8 {
            sends.push(pattern(THRESHOLD + rng.gen_range(0..=600_000), round));
            sends.push(pattern(rng.gen_range(1..=50_000), 0x10 | round));
        }
        let want: Vec<u8> = sends.concat();
        let back = pattern(THRESHOLD + rng.gen_range(0..=600_000), 0x30);
        let chunks = [
            rng.gen_range(4_096..=3 << 20),
            rng.gen_range(4_096..=3 << 20),
        ];
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for data in &sends {
                    send_blocking(&pair, c, data);
                }
            });
            scope.spawn(|| send_blocking(&pair, a, &back));
            scope.spawn(|| {
                let got = pair.read_blocking(c, back.len(), chunks[1]);
                assert_same(&got, &back, "acceptor → client");
            });
            let got = pair.read_blocking(a, want.len(), chunks[0]);
            assert_same(&got, &want, "client → acceptor");
        });
        // Both ends block in sends while the other's data waits: a blocked sender may turn
        // the peer's rendezvous down to take in what follows it (the rest then goes
        // inline), so only the sums are exact.
        for (from, to, total) in [(c, a, want.len()), (a, c, back.len())] {
            let rendezvous = pair.counter(from, Counter::SanRendezvousSent);
            assert_eq!(pair.counter(to, Counter::SanRendezvousReceived), rendezvous);
            assert_eq!(
                rendezvous + pair.counter(from, Counter::SanInlineSent),
                (warm_up + total) as u64,
                "every byte counted once"
            );
        }
        assert!(
            pair.counter(c, Counter::SanRendezvousSent)
                + pair.counter(a, Counter::SanRendezvousSent)
                > 0,
            "large sends went by rendezvous"
        );
        assert_eq!(pair.rdma_violations(), Vec::<String>::new());
    });
}

#[test]
fn rendezvous_under_rough_faults_in_read_mode() {
    rendezvous_under_rough_faults(Rendezvous::READ);
}

#[test]
fn rendezvous_under_rough_faults_in_write_mode() {
    rendezvous_under_rough_faults(Rendezvous::WRITE);
}

/// A blocking send big enough for a rendezvous from a buffer with a page the process may not
/// read goes inline instead, where the fault is taken as the kernel takes it: the whole
/// 64 KiB units before the fault (a short count), nothing after them; the stream stays
/// intact. (By rendezvous the peer or the provider would meet the page mid-transfer.)
fn a_bad_page_in_a_big_send_is_a_short_count(mode: Rendezvous) {
    for_seeds(&format!("bad page in a big send {mode:?}"), move |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xfa);
        let (pair, _) = established(seed, benign_faults(), mode);
        let (c, a) = (&pair.client, &pair.acceptor);
        let memory = BadMemory::new(THRESHOLD + 4 * BadMemory::PAGE);
        let data = pattern(THRESHOLD + 4 * BadMemory::PAGE, 25);
        let good = memory.good(data.len());
        // SAFETY: our own mapping's readable part, `data.len()` bytes.
        unsafe { core::ptr::copy_nonoverlapping(data.as_ptr(), good.ptr, data.len()) };
        let start = memory.up_to_wall(data.len(), 0).ptr as usize;
        let len = data.len() + 100;
        let units = data.len() - data.len() % (64 << 10);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let bufs = [RawBuf {
                    ptr: start as *mut u8,
                    len,
                }];
                let sent = send_iov(c.fd, c.index, &bufs, libc::MSG_NOSIGNAL);
                assert_eq!(sent, Some(Ok(units as isize)), "the units before the fault");
            });
            let got = pair.read_blocking(a, units, 1 << 20);
            assert_same(&got, &data[..units], "the units before the fault");
        });
        let after = pattern(1000, 26);
        assert_eq!(pair.send(c, &after, 0), Ok(after.len()));
        assert_same(
            &pair.read_exact(a, c, after.len(), &mut rng),
            &after,
            "what follows, and nothing of the rest",
        );
        assert_eq!(
            pair.counter(c, Counter::SanRendezvousSent),
            0,
            "nothing by rendezvous"
        );
    });
}

#[test]
fn a_bad_page_in_a_big_send_is_a_short_count_in_read_mode() {
    a_bad_page_in_a_big_send_is_a_short_count(Rendezvous::READ);
}

#[test]
fn a_bad_page_in_a_big_send_is_a_short_count_in_write_mode() {
    a_bad_page_in_a_big_send_is_a_short_count(Rendezvous::WRITE);
}

/// A receive of a rendezvous segment into a buffer the process may not write is `EFAULT`
/// before anything moves, the segment unread; a good buffer then gets all of it, zero-copy.
fn a_segment_into_a_bad_buffer_is_efault(mode: Rendezvous) {
    for_seeds(
        &format!("segment into a bad buffer {mode:?}"),
        move |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0xfb);
            let (pair, warm_up) = established(seed, benign_faults(), mode);
            let (c, a) = (&pair.client, &pair.acceptor);
            let data = pattern(THRESHOLD + rng.gen_range(0..=100_000), 27);
            let memory = BadMemory::new(BadMemory::PAGE);
            std::thread::scope(|scope| {
                scope.spawn(|| assert_eq!(pair.send(c, &data, 0), Ok(data.len()), "one call"));
                let bad = [
                    vec![memory.up_to_wall(0, data.len())],
                    vec![memory.up_to_wall(100, data.len())],
                    vec![BadMemory::unmapped(data.len())],
                ];
                for bufs in &bad {
                    assert_eq!(
                        recv_iov(a.fd, a.index, bufs, 0),
                        Some(Err(Errno(libc::EFAULT))),
                        "a receive into {bufs:?}"
                    );
                }
                let got = pair.read_blocking(a, data.len(), data.len());
                assert_same(&got, &data, "the segment after the bad receives");
            });
            assert_rendezvous(&pair, c, a, data.len(), warm_up);
        },
    );
}

#[test]
fn a_segment_into_a_bad_buffer_is_efault_in_read_mode() {
    a_segment_into_a_bad_buffer_is_efault(Rendezvous::READ);
}

#[test]
fn a_segment_into_a_bad_buffer_is_efault_in_write_mode() {
    a_segment_into_a_bad_buffer_is_efault(Rendezvous::WRITE);
}
