//! Large sends from memory whose mapping changes between sends, and large sends whose memory
//! cannot be registered, over one TCP connection that the preload may carry over the SAN (the
//! registration cache as an application sees it). Plain blocking `std::net`/libc calls; it
//! knows nothing of sandirect beyond reading its own published counters.
//!
//! ```text
//! san_memory server ADDR BUFFER                     # listens on ADDR:0, prints "port N", checks one client's stream
//! san_memory client ADDR:PORT LOCAL SIZE ROUNDS VARIANT…  # binds LOCAL:0, sends rounds (below)
//! san_memory enobufs ADDR:PORT LOCAL SIZE [ATTEMPTS] # large sends that may fail with ENOBUFS (below)
//! ```
//!
//! The stream is one fixed byte sequence (byte `i` is a function of `i` alone), so the server
//! checks every byte where it lands, and bytes from an earlier round or zeroed pages cannot
//! pass for the right ones (a mismatch names which of the two it looks like).
//!
//! **server**: receives into a fresh `BUFFER`-byte `malloc` per round (glibc maps it and
//! `free()` unmaps it, so the receiver's registrations are invalidated every round too), and
//! prints `server ok bytes=N buffers=B same_address=S path=P rdv_received=R`.
//!
//! **client**: first sends `SIZE`-byte pieces until one goes by rendezvous (the connection is
//! switched and the session established; at most 50 tries), then, per `VARIANT`, `ROUNDS`
//! times: gets new memory at the address of the previous round, fills it with the stream's
//! next bytes and sends it in one blocking `send`. Variants:
//! - `free`: `malloc(SIZE)` with glibc's mmap threshold fixed at 1 MiB, `free()` after the
//!   send (glibc unmaps it internally; the next `malloc` maps it again);
//! - `munmap`: `munmap`, then `mmap` at the same address;
//! - `mremap`: `mremap` the mapping away (to a fresh address, `MREMAP_FIXED`), unmap it there,
//!   and `mmap` new memory at the old address;
//! - `dontneed` / `madv-free`: `madvise(MADV_DONTNEED / MADV_FREE)` the same mapping, then
//!   rewrite it (DONTNEED: new zero pages under the old address);
//! - `brk`: `malloc` from the main heap (mmap threshold raised, trim threshold lowered; the
//!   buffer is the 64 KiB-aligned `SIZE` bytes inside the block) and `free()`, which trims the
//!   heap with `brk` (or, when a small block allocated above keeps it from trimming, glibc's
//!   `malloc_trim` gives the free pages back with `MADV_DONTNEED`); the next `malloc` grows
//!   the heap again under the same buffer address.
//!
//! After each send it reads its own published counters: the round must have moved bytes by
//! rendezvous (else the registration cache was never involved). One line per variant:
//! `client variant=V rounds=N same_address=S changed=C rdv_rounds=R`, where `changed` counts
//! the rounds whose mapping change really happened (`free`: glibc mapped the block; `brk`: the
//! break went down or `malloc_trim` gave pages back, with `brk_shrinks=K` the former), then
//! `client ok bytes=N path=P rdv_sent=R`. Natively (no rendezvous) the client fails.
//!
//! **enobufs**: sends `SIZE`-byte buffers in one `send` each, in this order, and tracks which
//! bytes were accepted: a small piece; large sends until one fails with `ENOBUFS` (a large
//! send that went inline, because the session was not yet established or the receiver
//! turned the rendezvous down, is accepted and counted; one that went by rendezvous ends the
//! attempts; at most `ATTEMPTS`, default 4); on `ENOBUFS` the same bytes again in 256 KiB
//! sends (below the rendezvous threshold) and one more large send; a small piece.
//! Prints `client ok bytes=N enobufs=E rendezvous_sends=R inline_large_sends=I path=P
//! rdv_sent=S`: the server must have received exactly the `N` accepted bytes, in order.

use std::ffi::c_void;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use preload_core::record::Counter;

/// glibc's `mallopt` parameters (malloc.h; not all are in the libc crate for every target).
const M_TRIM_THRESHOLD: libc::c_int = -1;
const M_TOP_PAD: libc::c_int = -2;
const M_MMAP_THRESHOLD: libc::c_int = -3;
/// The UAPI value (not in the libc crate for every target).
const MAP_FIXED_NOREPLACE: libc::c_int = 0x10_0000;
/// Below the rendezvous threshold of both fabrics (1 MiB over verbs, 4 MiB over shm).
const INLINE_PIECE: usize = 256 << 10;
/// Alignment of the heap variant's buffer inside its block (see `Malloc::next`).
const HEAP_ALIGN: usize = 64 << 10;
/// Small sends before and after the large ones in `enobufs`.
const SMALL_PIECE: usize = 100_000;

/// The stream's bytes `8 × word` to `8 × word + 7`: SplitMix64's mix of the word index.
fn stream_word(word: u64) -> [u8; 8] {
    let mut z = word.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (z ^ (z >> 31)).to_le_bytes()
}

/// The stream's byte at `offset`.
fn stream_byte(offset: u64) -> u8 {
    stream_word(offset / 8)[(offset % 8) as usize]
}

/// Fills `buf` with the stream's bytes from `offset` on.
fn fill(buf: &mut [u8], offset: u64) {
    if offset.is_multiple_of(8) {
        let mut word = offset / 8;
        let mut chunks = buf.chunks_exact_mut(8);
        for chunk in &mut chunks {
            chunk.copy_from_slice(&stream_word(word));
            word += 1;
        }
        let tail = chunks.into_remainder();
        let bytes = stream_word(word);
        tail.copy_from_slice(&bytes[..tail.len()]);
    } else {
        for (i, byte) in buf.iter_mut().enumerate() {
            *byte = stream_byte(offset + i as u64);
        }
    }
}

/// The first offset in `buf` that is not the stream's byte at `offset + i`, if any.
fn first_difference(buf: &[u8], offset: u64) -> Option<usize> {
    let mut expected = vec![0u8; buf.len()];
    fill(&mut expected, offset);
    // (Slice equality is one memcmp, even unoptimised: this runs under emulation.)
    if buf == expected.as_slice() {
        return None;
    }
    buf.iter().zip(&expected).position(|(a, b)| a != b)
}

/// What wrong bytes at `offset` look like: an earlier round's bytes at the same buffer
/// position (a stale registration), zeroes (fresh pages the transfer never reached), or other.
fn diagnose(buf: &[u8], at: usize, offset: u64, round_len: u64) -> &'static str {
    let window = &buf[at..buf.len().min(at + 4096)];
    if window.iter().all(|&b| b == 0) {
        return "zeroes (new pages the transfer did not reach)";
    }
    for back in 1..=8u64 {
        let Some(earlier) = (offset + at as u64).checked_sub(back * round_len) else {
            break;
        };
        if first_difference(window, earlier).is_none() {
            return "the bytes of an earlier round (stale pages)";
        }
    }
    "unrelated bytes"
}

/// This process's published counter for its socket `fd` (0 natively).
fn counter(fd: i32, which: Counter) -> u64 {
    integration::published_counters_of_fd(fd).map_or(0, |c| c[which as usize])
}

fn path_of(fd: i32) -> String {
    integration::published_path_of_fd(fd).to_lowercase()
}

/// One `send(2)` of all of `buf` (blocking): the count or the errno.
fn send_once(fd: i32, buf: &[u8]) -> Result<usize, i32> {
    // SAFETY: `buf` is valid for reads of its length for the call.
    let n = unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(integration::errno())
    } else {
        Ok(n as usize)
    }
}

/// Sends `len` bytes at `addr` as the application would: `send` until all is taken.
fn send_from(stream: &mut TcpStream, addr: *mut u8, len: usize) -> std::io::Result<()> {
    // SAFETY: the caller's mapping of `len` bytes at `addr`, initialised by `fill`.
    let buf = unsafe { std::slice::from_raw_parts(addr, len) };
    stream.write_all(buf)
}

fn server(listener: TcpListener, buffer: usize) -> std::io::Result<String> {
    // Receive buffers are mapped by glibc and unmapped by free(): a fixed threshold (glibc's
    // dynamic one would rise after the first free and serve them from a heap).
    // SAFETY: mallopt only tunes the allocator.
    unsafe { libc::mallopt(M_MMAP_THRESHOLD, 1 << 20) };
    let (mut stream, _) = listener.accept()?;
    let fd = stream.as_raw_fd();
    let mut offset = 0u64;
    let (mut buffers, mut same_address) = (0u64, 0u64);
    let mut previous = 0usize;
    loop {
        // SAFETY: a plain allocation (zeroed: read into as a slice), freed below.
        let block = unsafe { libc::calloc(1, buffer) }.cast::<u8>();
        if block.is_null() {
            return Err(std::io::Error::other("calloc failed"));
        }
        buffers += 1;
        if block as usize == previous {
            same_address += 1;
        }
        previous = block as usize;
        // SAFETY: `buffer` initialised bytes, ours until the free below.
        let buf = unsafe { std::slice::from_raw_parts_mut(block, buffer) };
        let mut got = 0;
        let result = loop {
            match stream.read(&mut buf[got..]) {
                Ok(0) => break Ok(true),
                Ok(n) => {
                    got += n;
                    if got == buffer {
                        break Ok(false);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => break Err(e),
            }
        };
        let checked = first_difference(&buf[..got], offset).map(|at| {
            format!(
                "bytes {} of the stream (receive buffer {buffers}, at {at}) are wrong: {}",
                offset + at as u64,
                diagnose(&buf[..got], at, offset, buffer as u64)
            )
        });
        offset += got as u64;
        // SAFETY: from the calloc above; `buf` is not used after this.
        unsafe { libc::free(block.cast()) };
        if let Some(problem) = checked {
            return Err(std::io::Error::other(problem));
        }
        if result? {
            break;
        }
    }
    let report = format!(
        "server ok bytes={offset} buffers={buffers} same_address={same_address} path={} rdv_received={}",
        path_of(fd),
        counter(fd, Counter::SanRendezvousReceived)
    );
    stream.shutdown(Shutdown::Write)?;
    Ok(report)
}

/// One variant's memory: where the next round's buffer is, and how to change it.
trait Memory {
    /// The buffer for the next round (new memory at the previous round's address, where the
    /// variant manages that). Returns the address and whether the mapping really changed.
    fn next(&mut self) -> std::io::Result<(*mut u8, bool)>;
    /// After the round's send.
    fn done(&mut self) {}
    /// Extra fields for the variant's report line.
    fn note(&self) -> String {
        String::new()
    }
}

fn os_error(what: &str) -> std::io::Error {
    let error = std::io::Error::last_os_error();
    std::io::Error::new(error.kind(), format!("{what}: {error}"))
}

fn map(at: Option<*mut u8>, len: usize) -> std::io::Result<*mut u8> {
    let fixed = if at.is_some() { MAP_FIXED_NOREPLACE } else { 0 };
    // SAFETY: an anonymous private mapping; FIXED_NOREPLACE never replaces another mapping.
    let addr = unsafe {
        libc::mmap(
            at.unwrap_or(core::ptr::null_mut()).cast(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(os_error("mmap"));
    }
    Ok(addr.cast())
}

fn unmap(addr: *mut u8, len: usize) -> std::io::Result<()> {
    // SAFETY: a mapping this program made and no longer uses.
    if unsafe { libc::munmap(addr.cast(), len) } != 0 {
        return Err(os_error("munmap"));
    }
    Ok(())
}

/// `malloc`/`free` per round (glibc maps and unmaps, or grows and trims the heap).
struct Malloc {
    len: usize,
    block: *mut u8,
    /// The heap variant: whether the memory under the block changed at the last `free`.
    trimmed: bool,
    heap: bool,
    /// The heap variant: rounds whose `free` lowered the break.
    brk_shrinks: u32,
}

impl Malloc {
    fn new(len: usize, heap: bool) -> Malloc {
        // SAFETY: mallopt only tunes the allocator. Heap: blocks come from the main arena
        // (this is the main thread) and every free that leaves more than 128 KiB on top gives
        // it back with brk. Mapped: a fixed 1 MiB threshold (see `server`).
        unsafe {
            if heap {
                libc::mallopt(M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(M_TRIM_THRESHOLD, 128 << 10);
                libc::mallopt(M_TOP_PAD, 0);
            } else {
                libc::mallopt(M_MMAP_THRESHOLD, 1 << 20);
            }
        }
        Malloc {
            len,
            block: core::ptr::null_mut(),
            trimmed: false,
            heap,
            brk_shrinks: 0,
        }
    }
}

impl Memory for Malloc {
    fn next(&mut self) -> std::io::Result<(*mut u8, bool)> {
        // Heap: the round's buffer is the 64 KiB-aligned `len` bytes inside a larger block. The
        // small blocks the process allocates between rounds (reading the counters, the
        // preload's bookkeeping) may take the start of the trimmed heap and move the block by
        // a few bytes; the aligned buffer stays where it was.
        let slack = if self.heap { HEAP_ALIGN } else { 0 };
        // SAFETY: a plain allocation, freed in `done`.
        let block = unsafe { libc::malloc(self.len + slack) }.cast::<u8>();
        if block.is_null() {
            return Err(std::io::Error::other("malloc failed"));
        }
        self.block = block;
        if self.heap {
            let aligned = (block as usize).next_multiple_of(HEAP_ALIGN);
            return Ok((
                block.wrapping_add(aligned - block as usize),
                core::mem::take(&mut self.trimmed),
            ));
        }
        let changed = {
            // glibc's IS_MMAPPED bit in the chunk's size word (malloc.c; unchanged since 2.0).
            // SAFETY: the size word precedes every block malloc returns.
            unsafe { block.cast::<usize>().sub(1).read() & 2 != 0 }
        };
        Ok((block, changed))
    }

    fn done(&mut self) {
        // SAFETY: sbrk(0) only reads the break; `block` came from malloc.
        unsafe {
            let before = libc::sbrk(0) as usize;
            libc::free(self.block.cast());
            let shrank = (libc::sbrk(0) as usize) < before;
            self.brk_shrinks += u32::from(shrank);
            // A small block allocated above ours since (by the preload, say) keeps free() from
            // trimming; glibc's malloc_trim then gives the free pages inside the heap back with
            // MADV_DONTNEED: new pages at the same address all the same.
            self.trimmed = shrank || (self.heap && libc::malloc_trim(0) == 1);
        }
        self.block = core::ptr::null_mut();
    }

    fn note(&self) -> String {
        if self.heap {
            format!(" brk_shrinks={}", self.brk_shrinks)
        } else {
            String::new()
        }
    }
}

impl Drop for Malloc {
    fn drop(&mut self) {
        // Back to glibc's defaults for the next variant (dynamic mmap threshold aside).
        // SAFETY: as in `new`.
        unsafe {
            libc::mallopt(M_TRIM_THRESHOLD, 128 << 10);
            libc::mallopt(M_MMAP_THRESHOLD, 128 << 10);
        }
    }
}

/// `munmap` + `mmap` at the same address, or `mremap` away + `mmap` at the old address.
struct Remap {
    len: usize,
    addr: Option<*mut u8>,
    move_away: bool,
}

impl Memory for Remap {
    fn next(&mut self) -> std::io::Result<(*mut u8, bool)> {
        let Some(old) = self.addr else {
            let addr = map(None, self.len)?;
            self.addr = Some(addr);
            return Ok((addr, false));
        };
        if self.move_away {
            let target = map(None, self.len)?;
            // SAFETY: moves our mapping over our own fresh mapping (MREMAP_FIXED replaces it).
            let moved = unsafe {
                libc::mremap(
                    old.cast(),
                    self.len,
                    self.len,
                    libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                    target.cast::<c_void>(),
                )
            };
            if moved == libc::MAP_FAILED {
                return Err(os_error("mremap"));
            }
            unmap(moved.cast(), self.len)?;
        } else {
            unmap(old, self.len)?;
        }
        let addr = map(Some(old), self.len)?;
        Ok((addr, true))
    }
}

impl Drop for Remap {
    fn drop(&mut self) {
        if let Some(addr) = self.addr {
            let _ = unmap(addr, self.len);
        }
    }
}

/// One mapping, `madvise`d before every round but the first.
struct Advise {
    len: usize,
    addr: Option<*mut u8>,
    advice: libc::c_int,
}

impl Memory for Advise {
    fn next(&mut self) -> std::io::Result<(*mut u8, bool)> {
        let Some(addr) = self.addr else {
            let addr = map(None, self.len)?;
            self.addr = Some(addr);
            return Ok((addr, false));
        };
        // SAFETY: advice on our own mapping; its contents are rewritten before use.
        if unsafe { libc::madvise(addr.cast(), self.len, self.advice) } != 0 {
            return Err(os_error("madvise"));
        }
        Ok((addr, true))
    }
}

impl Drop for Advise {
    fn drop(&mut self) {
        if let Some(addr) = self.addr {
            let _ = unmap(addr, self.len);
        }
    }
}

fn memory_of(variant: &str, len: usize) -> std::io::Result<Box<dyn Memory>> {
    Ok(match variant {
        "free" => Box::new(Malloc::new(len, false)),
        "brk" => Box::new(Malloc::new(len, true)),
        "munmap" | "mremap" => Box::new(Remap {
            len,
            addr: None,
            move_away: variant == "mremap",
        }),
        "dontneed" | "madv-free" => Box::new(Advise {
            len,
            addr: None,
            advice: if variant == "dontneed" {
                libc::MADV_DONTNEED
            } else {
                libc::MADV_FREE
            },
        }),
        other => return Err(std::io::Error::other(format!("unknown variant {other}"))),
    })
}

/// Sends `size`-byte pieces of the stream until one went by rendezvous: the connection is
/// switched and its session established. Returns the bytes sent.
fn until_rendezvous(stream: &mut TcpStream, size: usize) -> std::io::Result<u64> {
    let fd = stream.as_raw_fd();
    let mut piece = vec![0u8; size];
    let mut offset = 0u64;
    for _ in 0..50 {
        fill(&mut piece, offset);
        let before = counter(fd, Counter::SanRendezvousSent);
        send_from(stream, piece.as_mut_ptr(), size)?;
        offset += size as u64;
        if counter(fd, Counter::SanRendezvousSent) > before {
            return Ok(offset);
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Err(std::io::Error::other(format!(
        "no send went by rendezvous (path {})",
        path_of(fd)
    )))
}

fn client(
    mut stream: TcpStream,
    size: usize,
    rounds: u32,
    variants: &[String],
) -> std::io::Result<String> {
    let fd = stream.as_raw_fd();
    let mut offset = until_rendezvous(&mut stream, size)?;
    let mut rendezvous_before = counter(fd, Counter::SanRendezvousSent);
    for variant in variants {
        let mut memory = memory_of(variant, size)?;
        let (mut same_address, mut changed, mut rdv_rounds) = (0u32, 0u32, 0u32);
        let mut previous = None;
        for _ in 0..rounds {
            let (addr, really_changed) = memory.next()?;
            if previous == Some(addr) {
                same_address += 1;
            }
            if previous.is_some() && really_changed {
                changed += 1;
            }
            previous = Some(addr);
            // SAFETY: `size` bytes of this variant's memory at `addr`, ours for the round.
            fill(
                unsafe { std::slice::from_raw_parts_mut(addr, size) },
                offset,
            );
            send_from(&mut stream, addr, size)?;
            offset += size as u64;
            memory.done();
            // Read only now: the reading allocates, and in the main heap a block allocated
            // above the round's buffer would keep free() from trimming it.
            let rendezvous = counter(fd, Counter::SanRendezvousSent);
            if rendezvous > rendezvous_before {
                rdv_rounds += 1;
            }
            rendezvous_before = rendezvous;
        }
        println!(
            "client variant={variant} rounds={rounds} same_address={same_address} changed={changed} rdv_rounds={rdv_rounds}{}",
            memory.note()
        );
    }
    stream.shutdown(Shutdown::Write)?;
    // The server's end-of-file: everything was checked.
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest)?;
    Ok(format!(
        "client ok bytes={offset} path={} rdv_sent={}",
        path_of(fd),
        counter(fd, Counter::SanRendezvousSent)
    ))
}

/// What the large sends of `enobufs` met.
#[derive(Default)]
struct LargeSends {
    refused: u32,
    rendezvous: u32,
    inline: u32,
}

impl LargeSends {
    /// One `send` of `buf.len()` stream bytes from `offset`: true when refused with ENOBUFS
    /// (nothing sent). A short count is legal: the rest goes as an application would send it.
    fn send(
        &mut self,
        stream: &mut TcpStream,
        buf: &mut [u8],
        offset: &mut u64,
    ) -> std::io::Result<bool> {
        let fd = stream.as_raw_fd();
        fill(buf, *offset);
        let before = counter(fd, Counter::SanRendezvousSent);
        match send_once(fd, buf) {
            Ok(n) => {
                *offset += n as u64;
                if counter(fd, Counter::SanRendezvousSent) > before {
                    self.rendezvous += 1;
                } else {
                    self.inline += 1;
                }
                send_pieces(stream, offset, buf.len() - n)?;
                Ok(false)
            }
            Err(libc::ENOBUFS) => {
                self.refused += 1;
                Ok(true)
            }
            Err(code) => Err(std::io::Error::from_raw_os_error(code)),
        }
    }
}

fn enobufs(mut stream: TcpStream, size: usize, attempts: usize) -> std::io::Result<String> {
    let fd = stream.as_raw_fd();
    let mut offset = 0u64;
    let mut buf = vec![0u8; size];
    let mut large = LargeSends::default();
    send_pieces(&mut stream, &mut offset, SMALL_PIECE)?;
    // Until the first large send that is not inline (the session was still being set up, or
    // the receiver turned the rendezvous down), at most `attempts`.
    for _ in 0..attempts {
        if large.send(&mut stream, &mut buf, &mut offset)? {
            // Nothing was sent: the same bytes again, in sends below the threshold.
            send_pieces(&mut stream, &mut offset, size)?;
            break;
        }
        if large.rendezvous > 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    if large.refused > 0 {
        // Refused again, or sent: either way nothing may be lost.
        if large.send(&mut stream, &mut buf, &mut offset)? {
            send_pieces(&mut stream, &mut offset, size)?;
        }
    }
    send_pieces(&mut stream, &mut offset, SMALL_PIECE)?;
    stream.shutdown(Shutdown::Write)?;
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest)?;
    Ok(format!(
        "client ok bytes={offset} enobufs={} rendezvous_sends={} inline_large_sends={} path={} rdv_sent={}",
        large.refused,
        large.rendezvous,
        large.inline,
        path_of(fd),
        counter(fd, Counter::SanRendezvousSent)
    ))
}

/// `len` stream bytes from `offset` in sends below the rendezvous threshold.
fn send_pieces(stream: &mut TcpStream, offset: &mut u64, len: usize) -> std::io::Result<()> {
    let mut piece = vec![0u8; INLINE_PIECE];
    let mut left = len;
    while left > 0 {
        let n = left.min(INLINE_PIECE);
        fill(&mut piece[..n], *offset);
        stream.write_all(&piece[..n])?;
        *offset += n as u64;
        left -= n;
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).map(String::as_str).unwrap_or_default();
    let number = |i: usize| -> std::io::Result<usize> {
        arg(i)
            .parse()
            .map_err(|_| std::io::Error::other(format!("argument {i}: a number, got {:?}", arg(i))))
    };
    let connect = || -> std::io::Result<TcpStream> {
        let server: SocketAddr = arg(2).parse().map_err(std::io::Error::other)?;
        let local = arg(3).parse().map_err(std::io::Error::other)?;
        integration::connect_from(local, server)
    };
    let report = match arg(1) {
        "server" => {
            let ip: std::net::IpAddr = arg(2).parse().map_err(std::io::Error::other)?;
            let listener = TcpListener::bind((ip, 0))?;
            println!("port {}", listener.local_addr()?.port());
            std::io::stdout().flush()?;
            server(listener, number(3)?)?
        }
        "client" => {
            let rounds = u32::try_from(number(5)?).map_err(std::io::Error::other)?;
            client(connect()?, number(4)?, rounds, &args[6.min(args.len())..])?
        }
        "enobufs" => enobufs(connect()?, number(4)?, number(5).unwrap_or(4))?,
        other => {
            eprintln!(
                "usage: san_memory server ADDR BUFFER | client ADDR:PORT LOCAL SIZE ROUNDS VARIANT… | enobufs ADDR:PORT LOCAL SIZE [ATTEMPTS] (got {other:?})"
            );
            std::process::exit(2);
        }
    };
    println!("{report}");
    Ok(())
}
