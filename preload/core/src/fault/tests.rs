use super::*;
use core::ffi::{c_int, c_void};

const PAGE: usize = 4096;

/// Two pages: the first readable and writable, the second inaccessible (`PROT_NONE`).
struct Fence {
    base: *mut u8,
}

impl Fence {
    fn new() -> Fence {
        // SAFETY: a fresh anonymous mapping of our own; then its second page made
        // inaccessible.
        unsafe {
            let base = libc::mmap(
                core::ptr::null_mut(),
                2 * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(base, libc::MAP_FAILED);
            assert_eq!(
                libc::mprotect(base.cast::<u8>().add(PAGE).cast(), PAGE, libc::PROT_NONE),
                0
            );
            Fence { base: base.cast() }
        }
    }

    /// The first inaccessible byte.
    fn wall(&self) -> *mut u8 {
        // SAFETY: inside the mapping.
        unsafe { self.base.add(PAGE) }
    }
}

impl Drop for Fence {
    fn drop(&mut self) {
        // SAFETY: our own mapping.
        unsafe { libc::munmap(self.base.cast(), 2 * PAGE) };
    }
}

#[test]
fn copies_of_every_size_and_alignment_are_exact() {
    let source: Vec<u8> = (0..9000u32).map(|i| (i * 7 + 3) as u8).collect();
    let sizes = (0..300).chain([511, 512, 1000, 4095, 4096, 4097, 8191]);
    for len in sizes {
        for (from, to) in [(0, 0), (1, 0), (3, 5), (7, 13)] {
            let mut target = vec![0u8; len + 32];
            // SAFETY: both ranges are inside our own vectors and do not overlap.
            let result =
                unsafe { copy(target.as_mut_ptr().add(to), source.as_ptr().add(from), len) };
            assert_eq!(result, Ok(()));
            assert_eq!(
                &target[to..to + len],
                &source[from..from + len],
                "len {len}"
            );
            assert!(
                target[..to].iter().all(|&b| b == 0),
                "wrote before, len {len}"
            );
            assert!(
                target[to + len..].iter().all(|&b| b == 0),
                "wrote after, len {len}"
            );
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn a_copy_touching_memory_the_process_may_not_access_reports_the_fault() {
    arm();
    assert!(installed());
    let fence = Fence::new();
    let wall = fence.wall() as usize;
    let mut buffer = vec![0u8; 3 * PAGE];
    // Every branch of the routine, from and into the inaccessible page, starting at it or
    // running into it.
    for len in [
        1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 63, 64, 65, 200, 4095, 4096, 8000,
    ] {
        for lead in [0, 1, 50] {
            if lead >= len {
                continue;
            }
            // SAFETY: `wall - lead` is inside our mapping; the copy runs into its second page.
            let start = unsafe { fence.wall().sub(lead) };
            // SAFETY: `buffer` is ours and long enough; the source runs into the wall.
            let from = unsafe { copy(buffer.as_mut_ptr(), start, len) };
            // SAFETY: as above, the other way round.
            let into = unsafe { copy(start, buffer.as_ptr(), len) };
            for result in [from, into] {
                let address = result.expect_err("the copy must report the fault").address;
                assert!(
                    (wall..wall + PAGE).contains(&address),
                    "len {len} lead {lead}: {address:#x} is not in the inaccessible page"
                );
            }
        }
    }
    // The accessible part is still copied whole.
    // SAFETY: inside our mapping's first page.
    let accessible = unsafe { copy(buffer.as_mut_ptr(), fence.base, PAGE) };
    assert_eq!(accessible, Ok(()));
}

#[cfg(target_arch = "x86_64")]
#[test]
fn an_unmapped_address_is_a_fault_too() {
    arm();
    let mut buffer = [0u8; 100];
    // Another test thread may map the freed range again before the copy (the copy then
    // succeeds): a few tries, each with its own range, must see the fault.
    let mut results = Vec::new();
    for _ in 0..10 {
        let fence = Fence::new();
        let gone = fence.base as usize;
        drop(fence);
        // SAFETY: the address was just unmapped; the routine reports the fault (or copies
        // from whatever another thread mapped there since, our buffer being the target).
        let result = unsafe { copy(buffer.as_mut_ptr(), gone as *const u8, 100) };
        if result == Err(Fault { address: gone }) {
            return;
        }
        results.push(result);
    }
    panic!("no try faulted at the unmapped address: {results:?}");
}

extern "C" fn never_runs(_: c_int, _: *mut libc::siginfo_t, _: *mut c_void) {}

fn first_word(set: &libc::sigset_t) -> u64 {
    // SAFETY: a sigset_t is at least 8 bytes of plain data.
    unsafe {
        (set as *const libc::sigset_t)
            .cast::<u64>()
            .read_unaligned()
    }
}

fn query(signal: c_int) -> libc::sigaction {
    // SAFETY: plain data, zero is valid; a query into our own struct (the test binary calls
    // glibc's own sigaction: no hook is exported here).
    unsafe {
        let mut action: libc::sigaction = core::mem::zeroed();
        assert_eq!(libc::sigaction(signal, core::ptr::null(), &mut action), 0);
        action
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn a_setting_made_after_arm_is_reported_as_the_kernel_reports_it() {
    arm();
    // SAFETY: plain data, zero is valid.
    let mut act: libc::sigaction = unsafe { core::mem::zeroed() };
    act.sa_sigaction = never_runs as *const () as usize;
    // With a flag the kernel does not know, and SIGKILL in the mask (the kernel drops both).
    act.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESETHAND | 0x0000_0400;
    // SAFETY: our own set.
    unsafe {
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaddset(&mut act.sa_mask, libc::SIGUSR1);
        libc::sigaddset(&mut act.sa_mask, libc::SIGKILL);
        libc::sigaddset(&mut act.sa_mask, libc::SIGRTMIN() + 2);
    }
    // The kernel's answer, from the same setting on a signal no test uses.
    let spare = libc::SIGRTMAX() - 1;
    // SAFETY: our own struct; the handler never runs (nothing sends `spare`).
    let made = unsafe { libc::sigaction(spare, &act, core::ptr::null_mut()) };
    assert_eq!(made, 0);
    let kernel = query(spare);
    // SAFETY: plain data, zero is valid.
    let mut before: libc::sigaction = unsafe { core::mem::zeroed() };
    // SAFETY: as above.
    let mut reported: libc::sigaction = unsafe { core::mem::zeroed() };
    // SAFETY: our own structs.
    let set = unsafe { sigaction(libc::SIGBUS, &act, &mut before) };
    assert_eq!(set, Some(0));
    // SAFETY: as above.
    let queried = unsafe { sigaction(libc::SIGBUS, core::ptr::null(), &mut reported) };
    assert_eq!(queried, Some(0));
    assert_eq!(reported.sa_sigaction, kernel.sa_sigaction);
    assert_eq!(reported.sa_flags, kernel.sa_flags);
    assert_eq!(
        reported.sa_restorer.map(|f| f as usize),
        kernel.sa_restorer.map(|f| f as usize)
    );
    assert_eq!(first_word(&reported.sa_mask), first_word(&kernel.sa_mask));
    // Our handler stays in the kernel, with the application's mask and its SA_ONSTACK.
    let in_kernel = query(libc::SIGBUS);
    assert_ne!(in_kernel.sa_sigaction, never_runs as *const () as usize);
    assert_ne!(in_kernel.sa_flags & libc::SA_ONSTACK, 0);
    assert_eq!(first_word(&in_kernel.sa_mask), first_word(&kernel.sa_mask));
    // Back as it was.
    // SAFETY: our own structs.
    let back = unsafe { sigaction(libc::SIGBUS, &before, core::ptr::null_mut()) };
    assert_eq!(back, Some(0));
    // SAFETY: plain data, zero is valid (SIG_DFL).
    let default: libc::sigaction = unsafe { core::mem::zeroed() };
    // SAFETY: our own struct.
    unsafe { libc::sigaction(spare, &default, core::ptr::null_mut()) };
}

#[test]
fn other_signals_are_never_ours() {
    // SAFETY: null pointers, valid for sigaction.
    let usr1 = unsafe { sigaction(libc::SIGUSR1, core::ptr::null(), core::ptr::null_mut()) };
    assert_eq!(usr1, None);
    assert_eq!(bsd_signal(libc::SIGPIPE, libc::SIG_IGN), None);
    assert_eq!(sigignore(libc::SIGCHLD), None);
}
