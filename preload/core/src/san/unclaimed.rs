//! An accepted connection from a SAN client that no call has used yet, and the page its
//! holders share once a `fork` gave it more than one.
//!
//! Servers that fork per connection (PostgreSQL's postmaster, Python's `ForkingMixIn`) accept
//! in the parent, fork, and close the parent's copy: the child is the process that uses the
//! connection. A session lives in one process's memory, so the acceptor attaches only at the
//! first call that uses the connection, in whichever process makes it, and only once no other
//! process holds the descriptor (see `super::accept`). Until then the socket is plain TCP
//! that has carried nothing from this side; the client waits pending, as it does for any
//! acceptor that has not attached yet.

use core::ptr::NonNull;
use core::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::budget::Charge;
use crate::discovery::SegmentName;

/// An accepted connection whose client made a segment, not attached yet.
#[derive(Debug)]
pub(crate) struct Unclaimed {
    /// The client's segment.
    pub(super) name: SegmentName,
    /// Shared with the other processes that hold the descriptor; made by the first `fork`
    /// that copies it (before it, this process is the only holder).
    pub(super) holders: Option<Holders>,
    /// The process's SAN memory budget, charged at `accept` (so connections are admitted in
    /// the order they were accepted, not the order their first calls happen to run in);
    /// taken by the session when it attaches, given back if it never does.
    pub(super) charge: Charge,
    /// A client of another user: our connection to its exchange (its user checked), on
    /// which its private segment arrives (see `super::other_users`). `None`: the client's
    /// segment is in our segment directory.
    pub(super) link: Option<std::os::fd::OwnedFd>,
}

impl Unclaimed {
    pub(super) fn new(name: SegmentName, charge: Charge) -> Self {
        Self {
            name,
            holders: None,
            charge,
            link: None,
        }
    }

    /// A client of another user, reached over exchange connection `link`.
    pub(super) fn of_other_user(
        name: SegmentName,
        charge: Charge,
        link: std::os::fd::OwnedFd,
    ) -> Self {
        Self {
            link: Some(link),
            ..Self::new(name, charge)
        }
    }
}

/// What the holders of one unclaimed connection share: how many processes hold it, and
/// whether one of them used it on TCP (then nobody may attach: that process's bytes went on
/// TCP after the point where the client would switch). One anonymous `MAP_SHARED` page, so
/// a fork child shares it with its parent.
#[derive(Debug)]
pub(crate) struct Holders {
    page: NonNull<HoldersWords>,
}

#[repr(C)]
struct HoldersWords {
    /// Processes holding the connection (raised before each `fork`, lowered at each close).
    count: AtomicU32,
    /// Non-zero once a holder used the connection on TCP or passed it on.
    given_up: AtomicU32,
}

const PAGE: usize = 4096;

// SAFETY: the page is shared memory accessed only through atomics; the pointer is owned by
// this value (unmapped in `Drop`), so moving it to another thread is sound.
unsafe impl Send for Holders {}
// SAFETY: as above: `&Holders` only reads and writes the page's atomics.
unsafe impl Sync for Holders {}

/// The outcome of [`Holders::wait_until_sole`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sole {
    /// This process is the only holder and nobody gave up: it may attach.
    Yes,
    /// Another process still holds the connection after the wait, or one gave up.
    No,
}

impl Holders {
    /// A fresh page counting `count` holders, or `None` when no page can be mapped.
    pub(super) fn new(count: u32) -> Option<Self> {
        // SAFETY: a fresh anonymous shared mapping of one page; no existing memory is touched.
        let raw = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        let page = NonNull::new(raw.cast::<HoldersWords>())?;
        let holders = Self { page };
        holders.words().count.store(count, Ordering::SeqCst);
        Some(holders)
    }

    fn words(&self) -> &HoldersWords {
        // SAFETY: the page is mapped, page-aligned and zero-initialised by the kernel (a valid
        // `HoldersWords`: atomics of zero) for as long as `self` lives.
        unsafe { self.page.as_ref() }
    }

    /// One more process holds the connection (called before a `fork`).
    pub(super) fn add_holder(&self) {
        self.words().count.fetch_add(1, Ordering::SeqCst);
    }

    /// This process let go of the connection: a holder waiting to become the only one is woken.
    pub(super) fn release(&self) -> u32 {
        let words = self.words();
        let left = words.count.fetch_sub(1, Ordering::SeqCst).saturating_sub(1);
        san_shm::futex_wake(&words.count);
        left
    }

    /// No holder may attach any more (this one used the connection on TCP, or passed it on).
    pub(super) fn give_up(&self) {
        self.words().given_up.store(1, Ordering::SeqCst);
    }

    /// Whether a holder gave up.
    pub(super) fn given_up(&self) -> bool {
        self.words().given_up.load(Ordering::SeqCst) != 0
    }

    /// Waits, at most `budget`, until this process is the only holder (sleeping on the count:
    /// the others' closes wake it).
    pub(super) fn wait_until_sole(&self, budget: Duration) -> Sole {
        let words = self.words();
        let deadline = Instant::now() + budget;
        loop {
            if self.given_up() {
                return Sole::No;
            }
            let count = words.count.load(Ordering::SeqCst);
            if count <= 1 {
                return Sole::Yes;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Sole::No;
            }
            let _ = san_shm::futex_wait(&words.count, count, left);
        }
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        // SAFETY: the page was mapped by `Holders::new` and nothing borrows it any more.
        unsafe { libc::munmap(self.page.as_ptr().cast(), PAGE) };
    }
}
