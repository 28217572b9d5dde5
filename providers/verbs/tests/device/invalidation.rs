//! The registration cache stays correct for pinned memory regions when mappings change.
//!
//! Each scenario keeps one buffer address, and 20 times: changes the mapping under it (munmap,
//! mremap, madvise, brk, free), gets new memory at the *same* address, fills it with new
//! bytes, collects the monitor's changes into `MrCache::invalidate`, and moves the buffer
//! through the cache both ways (an RDMA WRITE from us, an RDMA READ by the peer). The peer
//! must see the new bytes every time. Then the same memory is rewritten in place and sent
//! again: that must be a cache *hit* (so the path under test really is the cached one) and
//! deliver the rewritten bytes too.

use super::*;
use sandirect_verbs::MemoryChanges;
use switch::mr_cache::{CacheConfig, MrCache, OwnerId};

const ROUNDS: u8 = 20;
const OWNER: OwnerId = OwnerId(1);
/// Not in the libc crate for every target; the UAPI value.
const MAP_FIXED_NOREPLACE: libc::c_int = 0x10_0000;

/// Everything a round needs: a connection, the cache over the client domain, and two
/// registered server buffers (the WRITE target and the peer's READ target).
struct Rig {
    client: VerbsDomain,
    _server: VerbsDomain,
    srv: Peer,
    cli: Peer,
    cache: MrCache,
    write_sink: Buffer,
    read_sink: Buffer,
    remote_write_sink: san_api::RemoteDescriptor,
    read_sink_lkey: san_api::LocalKey,
    next_wr: u64,
}

impl Rig {
    fn new(len: usize) -> Self {
        let (mut server, client) = (server_domain(), client_domain());
        assert!(
            client.memory_monitor().is_ok(),
            "the memory-change monitor runs in the guest: {:?}",
            client.memory_monitor()
        );
        let (srv, cli, _, _) = connected_pair(&server, &client, b"", b"");
        let write_sink = Buffer::new(len);
        let read_sink = Buffer::new(len);
        let remote_write = server
            .register(
                write_sink.range(),
                Access::LOCAL_WRITE | Access::REMOTE_WRITE,
            )
            .expect("register the write sink");
        // iWARP: the sink of an RDMA READ needs remote write rights.
        let read_access = if server.is_iwarp() {
            Access::LOCAL_WRITE | Access::REMOTE_WRITE
        } else {
            Access::LOCAL_WRITE
        };
        let read_reg = server
            .register(read_sink.range(), read_access)
            .expect("register the read sink");
        Self {
            remote_write_sink: remote_write
                .remote_descriptor(write_sink.range())
                .expect("exposed"),
            read_sink_lkey: read_reg.lkey,
            client,
            _server: server,
            srv,
            cli,
            cache: MrCache::new(CacheConfig::default()),
            write_sink,
            read_sink,
            next_wr: 100,
        }
    }

    /// What the driver does before every `get`: collect the mapping changes and invalidate
    /// them in the cache. Returns the changes.
    fn invalidate_changed_memory(&mut self) -> MemoryChanges {
        let changes = self.client.take_memory_changes();
        for range in changes.ranges() {
            self.cache.invalidate(&mut self.client, *range);
        }
        changes
    }

    fn wr(&mut self) -> WrId {
        self.next_wr += 1;
        WrId(self.next_wr)
    }

    /// Moves `range` through the cache (a WRITE from us, a READ by the peer) and asserts the
    /// peer got exactly `expected` both ways. Returns whether the `get` was a hit.
    fn transfer(&mut self, range: MemRange, expected: &[u8], what: &str) -> bool {
        assert_eq!(range.len as usize, expected.len());
        let hits = self.cache.stats().hits;
        let (handle, registration) = self
            .cache
            .get(&mut self.client, OWNER, range, Access::REMOTE_READ)
            .expect("cache get");
        let hit = self.cache.stats().hits > hits;

        let wr = self.wr();
        let segment = LocalSegment {
            range,
            lkey: registration.lkey,
        };
        self.cli
            .post_write(wr, segment, self.remote_write_sink)
            .expect("post write");
        let completion = next_completion(&mut self.cli);
        assert_eq!(
            (completion.wr_id, completion.status),
            (wr, Ok(())),
            "{what}: write"
        );
        let wr = self.wr();
        send(&mut self.cli, wr.0, b"written");
        assert_eq!(receive(&mut self.srv), b"written");
        let written = self.write_sink.snapshot();
        assert!(
            &written[..expected.len()] == expected,
            "{what}: the peer received the new bytes by our WRITE"
        );

        let descriptor = registration
            .remote_descriptor(range)
            .expect("a remote get is exposed");
        let wr = self.wr();
        send(&mut self.cli, wr.0, &encode_descriptor(&descriptor));
        let remote = decode_descriptor(&receive(&mut self.srv));
        let wr = self.wr();
        self.srv
            .post_read(
                wr,
                LocalSegment {
                    range: MemRange::new(self.read_sink.range().addr, range.len),
                    lkey: self.read_sink_lkey,
                },
                remote,
            )
            .expect("post read");
        let completion = next_completion(&mut self.srv);
        assert_eq!(
            (completion.wr_id, completion.status),
            (wr, Ok(())),
            "{what}: read"
        );
        let read = self.read_sink.snapshot();
        assert!(
            &read[..expected.len()] == expected,
            "{what}: the peer READ the new bytes"
        );
        self.cache.release(&mut self.client, handle);
        hit
    }

    /// The common loop: `remap` changes the mapping under `range` and returns the address of
    /// the new memory, which must be the same.
    fn run(&mut self, name: &str, range: MemRange, mut remap: impl FnMut(MemRange) -> u64) {
        let len = range.len as usize;
        fill(range, &pattern(len, 0xee));
        self.invalidate_changed_memory();
        self.transfer(range, &pattern(len, 0xee), &format!("{name}: first"));
        for round in 0..ROUNDS {
            let invalidated = self.cache.stats().invalidated_entries;
            let addr = remap(range);
            assert_eq!(
                addr, range.addr,
                "{name} {round}: new memory at the same address"
            );
            let fresh = pattern(len, round);
            fill(range, &fresh);

            let changes = self.invalidate_changed_memory();
            assert!(
                changes.ranges().iter().any(|r| r.overlaps(&range)),
                "{name} {round}: the monitor saw the change ({changes:?})"
            );
            assert!(
                self.cache.stats().invalidated_entries > invalidated,
                "{name} {round}: the cached registration was dropped"
            );
            let what = format!("{name} {round}");
            assert!(
                !self.transfer(range, &fresh, &what),
                "{what}: a fresh registration"
            );

            // Same mapping, new bytes: the cached registration is valid and must be used.
            let rewritten = pattern(len, round.wrapping_add(100));
            fill(range, &rewritten);
            assert!(
                self.invalidate_changed_memory().is_empty(),
                "{what}: no change"
            );
            assert!(
                self.transfer(range, &rewritten, &what),
                "{what}: a cache hit"
            );
        }
        let stats = self.cache.stats();
        eprintln!(
            "{name}: {ROUNDS} rounds, {} hits, {} registrations, {} invalidated; monitor {:?}",
            stats.hits,
            stats.registrations,
            stats.invalidated_entries,
            self.client.memory_monitor()
        );
    }
}

fn fill(range: MemRange, bytes: &[u8]) {
    // SAFETY: every scenario's range is mapped, writable memory owned by the test.
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), range.addr as *mut u8, bytes.len());
    }
}

/// An anonymous private mapping of `len` bytes, at exactly `at` if given.
fn map_anonymous(at: Option<u64>, len: usize) -> u64 {
    let (hint, fixed) = match at {
        Some(addr) => (addr as *mut libc::c_void, MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: a new anonymous mapping; MAP_FIXED_NOREPLACE never replaces an existing one.
    let ptr = unsafe {
        libc::mmap(
            hint,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed,
            -1,
            0,
        )
    };
    assert_ne!(
        ptr,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    ptr as u64
}

fn unmap(addr: u64, len: usize) {
    // SAFETY: the test's own mapping, not referenced after this.
    assert_eq!(unsafe { libc::munmap(addr as *mut libc::c_void, len) }, 0);
}

const MAPPED_LEN: usize = 128 << 10;

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn munmap_then_mmap_at_the_same_address_sends_the_new_bytes() {
    let mut rig = Rig::new(MAPPED_LEN);
    let range = MemRange::new(map_anonymous(None, MAPPED_LEN), MAPPED_LEN as u64);
    rig.run("munmap", range, |range| {
        unmap(range.addr, MAPPED_LEN);
        map_anonymous(Some(range.addr), MAPPED_LEN)
    });
    unmap(range.addr, MAPPED_LEN);
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn mremap_away_then_mmap_at_the_old_address_sends_the_new_bytes() {
    let mut rig = Rig::new(MAPPED_LEN);
    let range = MemRange::new(map_anonymous(None, MAPPED_LEN), MAPPED_LEN as u64);
    rig.run("mremap", range, |range| {
        let spare = map_anonymous(None, MAPPED_LEN);
        // SAFETY: moves our mapping onto our spare mapping (replacing it).
        let moved = unsafe {
            libc::mremap(
                range.addr as *mut libc::c_void,
                MAPPED_LEN,
                MAPPED_LEN,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                spare as *mut libc::c_void,
            )
        };
        assert_eq!(moved as u64, spare, "moved onto the spare mapping");
        let addr = map_anonymous(Some(range.addr), MAPPED_LEN);
        unmap(spare, MAPPED_LEN); // the old pages, moved away
        addr
    });
    unmap(range.addr, MAPPED_LEN);
}

fn madvise_scenario(name: &str, advice: libc::c_int) {
    let mut rig = Rig::new(MAPPED_LEN);
    let range = MemRange::new(map_anonymous(None, MAPPED_LEN), MAPPED_LEN as u64);
    rig.run(name, range, |range| {
        // SAFETY: our mapping; the advice only drops (or lazily frees) its pages.
        let status = unsafe { libc::madvise(range.addr as *mut libc::c_void, MAPPED_LEN, advice) };
        assert_eq!(status, 0, "madvise: {}", std::io::Error::last_os_error());
        range.addr
    });
    unmap(range.addr, MAPPED_LEN);
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn madv_dontneed_then_retouch_sends_the_new_bytes() {
    madvise_scenario("MADV_DONTNEED", libc::MADV_DONTNEED);
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn madv_free_then_rewrite_sends_the_new_bytes() {
    madvise_scenario("MADV_FREE", libc::MADV_FREE);
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn brk_shrink_and_regrow_sends_the_new_bytes() {
    let page = 4096usize;
    // SAFETY: sbrk moves the program break; glibc's allocator tolerates foreign sbrk calls
    // (it treats the heap as non-contiguous). This thread's allocations come from its own
    // arena, so nothing else moves the break meanwhile.
    let start = unsafe {
        let current = libc::sbrk(0) as usize;
        let pad = current.next_multiple_of(page) - current;
        libc::sbrk(pad as libc::intptr_t);
        libc::sbrk(MAPPED_LEN as libc::intptr_t) as u64
    };
    assert_eq!(start % page as u64, 0);
    let mut rig = Rig::new(MAPPED_LEN);
    let range = MemRange::new(start, MAPPED_LEN as u64);
    rig.run("brk", range, |range| {
        // SAFETY: shrinks the break over the range this test grew, then grows it back.
        unsafe {
            libc::sbrk(-(MAPPED_LEN as libc::intptr_t));
            assert_eq!(
                libc::sbrk(0) as u64,
                range.addr,
                "nothing else moved the break"
            );
            libc::sbrk(MAPPED_LEN as libc::intptr_t) as u64
        }
    });
    drop(rig); // deregister before giving the memory back
               // SAFETY: gives back what this test took.
    unsafe { libc::sbrk(-(MAPPED_LEN as libc::intptr_t)) };
}

/// glibc's chunk header flag for a chunk of its own mapping (`IS_MMAPPED` in malloc.c; the
/// header layout has not changed since glibc 2.0).
fn is_mmapped_chunk(block: u64) -> bool {
    // SAFETY: `block` came from malloc; the size word precedes it.
    unsafe { (block as *const usize).sub(1).read() & 2 != 0 }
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn free_then_malloc_at_the_same_address_sends_the_new_bytes() {
    // Large enough that no arena has a free chunk for it, so glibc maps it; with a fixed
    // threshold (glibc's dynamic one would rise after the first free and serve the next
    // malloc from a heap) every round maps it again, and free() unmaps it internally, with
    // no PLT call an interposer could see.
    const LEN: usize = 2 << 20;
    // SAFETY: mallopt only tunes the allocator.
    assert_eq!(unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) }, 1);
    let mut rig = Rig::new(LEN);
    // SAFETY: a plain allocation, freed in the loop and at the end.
    let block = unsafe { libc::malloc(LEN) } as u64;
    assert_ne!(block, 0);
    assert!(is_mmapped_chunk(block), "glibc mapped the block");
    let range = MemRange::new(block, LEN as u64);
    rig.run("free/malloc", range, |range| {
        // SAFETY: the block is ours; its registration is invalidated before the next use.
        let block = unsafe {
            libc::free(range.addr as *mut libc::c_void);
            libc::malloc(LEN) as u64
        };
        assert!(
            block == 0 || is_mmapped_chunk(block),
            "glibc mapped the block"
        );
        block
    });
    drop(rig);
    // SAFETY: the last block handed out at `block`.
    unsafe { libc::free(block as *mut libc::c_void) };
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn a_registration_whose_mapping_changed_is_refused_until_invalidated() {
    let mut rig = Rig::new(MAPPED_LEN);
    let range = MemRange::new(map_anonymous(None, MAPPED_LEN), MAPPED_LEN as u64);
    fill(range, &pattern(MAPPED_LEN, 1));
    let (handle, registration) = rig
        .cache
        .get(&mut rig.client, OWNER, range, Access::NONE)
        .expect("get");
    rig.cache.release(&mut rig.client, handle);
    unmap(range.addr, MAPPED_LEN);
    assert_eq!(map_anonymous(Some(range.addr), MAPPED_LEN), range.addr);
    fill(range, &pattern(MAPPED_LEN, 2));

    // A driver that forgot to collect the changes still cannot send the old pages.
    assert!(rig.client.is_watched(registration.lkey) == Some(true));
    let wr = rig.wr();
    let segment = LocalSegment {
        range,
        lkey: registration.lkey,
    };
    rig.cli
        .post_write(wr, segment, rig.remote_write_sink)
        .expect("post");
    let completion = next_completion(&mut rig.cli);
    assert_eq!(completion.status, Err(CompletionError::LocalProtection));
    // Collected but not yet invalidated in the cache: still refused.
    let changes = rig.client.take_memory_changes();
    assert!(!changes.is_empty());
    let wr = rig.wr();
    rig.cli
        .post_write(wr, segment, rig.remote_write_sink)
        .expect("post");
    let completion = next_completion(&mut rig.cli);
    assert_eq!(completion.status, Err(CompletionError::LocalProtection));
    for range in changes.ranges() {
        rig.cache.invalidate(&mut rig.client, *range);
    }
    assert_eq!(
        rig.client.is_watched(registration.lkey),
        None,
        "deregistered"
    );
    let fresh = pattern(MAPPED_LEN, 2);
    assert!(!rig.transfer(range, &fresh, "after invalidation"));
    unmap(range.addr, MAPPED_LEN);
}

#[test]
#[ignore = "needs an RDMA device (integration/softroce/test-verbs.sh)"]
fn the_c_abi_reports_mapping_changes_to_the_loaded_domain() {
    let library = VerbsLibrary::load_from(&built_library(), std::path::Path::new(SYSFS_DEVICES))
        .expect("load library");
    let mut domain = library.open_domain_for(client_ip()).expect("domain");
    assert_eq!(
        domain.take_memory_changes(),
        Ok(vec![]),
        "nothing changed yet"
    );
    let addr = map_anonymous(None, MAPPED_LEN);
    let range = MemRange::new(addr, MAPPED_LEN as u64);
    let registration = domain.register(range, Access::NONE).expect("register");
    assert_eq!(domain.is_watched(registration.lkey), Some(true));
    unmap(addr, MAPPED_LEN);
    let changes = domain.take_memory_changes().expect("monitor runs");
    assert!(
        changes.iter().any(|r| r.contains(&range)),
        "the unmap crossed the ABI: {changes:?}"
    );
    assert_eq!(domain.take_memory_changes(), Ok(vec![]), "collected once");
    domain.deregister(registration.lkey).expect("deregister");
    assert_eq!(domain.is_watched(registration.lkey), None);
}
