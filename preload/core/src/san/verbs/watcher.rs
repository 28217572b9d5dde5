//! What the per-process service thread (`crate::san::service`) watches: one epoll set with
//! the pending clients' CM listeners, the switched connections and their kernel sockets,
//! and a ticker; and what an event of it asks for.

use core::sync::atomic::{AtomicU32, Ordering};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};

use super::{guard, Attach};
use crate::mirror;
use crate::real;

/// See [`Watcher::set_watch`].
pub(super) fn set_service_watch(fd: RawFd, tag: u64, on: bool) {
    if let Some(watcher) = watcher() {
        watcher.set_watch(fd, tag, on);
    }
}

pub(super) const TAG_SOCKET: u64 = 1 << 32;
const TAG_ATTACH: u64 = 2 << 32;
/// The kernel TCP socket of a switched verbs socket (its end, e.g. a keepalive timeout).
pub(super) const TAG_KERNEL: u64 = 3 << 32;
/// The service thread's own ticker (an eventfd).
const TAG_TICK: u64 = 4 << 32;

/// Starts the per-process service thread (once; `super::service`): true when it runs.
pub(crate) type StartService = fn() -> bool;

/// What the per-process service thread watches (see the module docs): its epoll set, with
/// the pending clients' CM listeners, the switched connections and their kernel sockets.
pub(crate) struct Watcher {
    epoll: OwnedFd,
    attaches: Mutex<Vec<(u32, Arc<Attach>)>>,
    next: AtomicU32,
    /// Rung when the first link becomes owed: the thread then ticks (see `service`).
    ticker: Option<OwnedFd>,
}

/// What an event of the service thread's epoll set asks of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Watched {
    /// The connection of switched verbs socket `index` has events.
    Socket(u32),
    /// The kernel TCP socket of verbs socket `index` reported its end.
    KernelSocket(u32),
    /// Nothing more: the event was handled here (a pending client's CM listener, the tick).
    Handled,
}

static WATCHER: OnceLock<Option<Watcher>> = OnceLock::new();

/// The service thread's watch set, once made (never makes it: see [`started_watcher`]).
pub(crate) fn watcher() -> Option<&'static Watcher> {
    WATCHER.get().and_then(Option::as_ref)
}

/// The service thread's watch set, made on first use, with the thread running (`start`).
pub(crate) fn started_watcher(start: StartService) -> Option<&'static Watcher> {
    WATCHER
        .get_or_init(|| {
            // SAFETY: plain epoll_create1(2) through the real symbol (not our hook).
            let raw = unsafe { real::epoll_create1(libc::EPOLL_CLOEXEC) };
            if raw < 0 {
                return None;
            }
            // SAFETY: a fresh descriptor owned by nobody else.
            let epoll = mirror::relocate_internal_fd(unsafe { OwnedFd::from_raw_fd(raw) });
            // SAFETY: plain eventfd(2); the result is owned below.
            let ticker = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
            let ticker = (ticker >= 0).then(|| {
                // SAFETY: a fresh descriptor owned by nobody else.
                mirror::relocate_internal_fd(unsafe { OwnedFd::from_raw_fd(ticker) })
            });
            let watcher = Watcher {
                epoll,
                attaches: Mutex::new(Vec::new()),
                next: AtomicU32::new(0),
                ticker,
            };
            if let Some(ticker) = watcher.ticker.as_ref() {
                watcher.watch(ticker.as_raw_fd(), TAG_TICK);
            }
            Some(watcher)
        })
        .as_ref()
        .filter(|_| start())
}

impl Watcher {
    /// Wakes the thread (it then ticks while links are owed).
    pub(super) fn wake(&self) {
        if let Some(ticker) = self.ticker.as_ref() {
            let one = 1u64;
            // SAFETY: an 8-byte write to our eventfd.
            unsafe { libc::write(ticker.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }

    pub(super) fn watch(&self, fd: RawFd, data: u64) {
        let mut event = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: data,
        };
        // SAFETY: plain epoll_ctl(2) on our own epoll instance.
        unsafe { real::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
    }

    /// Watches the application's kernel TCP socket `fd` for its end only: no readiness
    /// events, so just the error and hang-up the kernel always reports, edge-triggered (each
    /// once). Never removed by us: the kernel drops the registration with the socket's last
    /// descriptor, and an event for a socket that is no longer a switched verbs socket, or
    /// whose number now names another one, is checked and ignored (removing by number could
    /// remove a newer socket's registration).
    pub(super) fn watch_kernel_socket(&self, fd: RawFd, data: u64) {
        let mut event = libc::epoll_event {
            events: libc::EPOLLET as u32,
            u64: data,
        };
        // SAFETY: plain epoll_ctl(2) on our own epoll instance; `fd` is a live socket of the
        // application (a stale registration of the same number is replaced by EEXIST's MOD).
        let rc =
            unsafe { real::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
        if rc != 0 && crate::errno::get() == libc::EEXIST {
            // SAFETY: as above.
            unsafe { real::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, &mut event) };
        }
    }

    /// Pauses (`on` false) or resumes the watch of `fd`. Resuming re-evaluates readiness:
    /// an event that arrived while paused and was not consumed is reported then.
    pub(super) fn set_watch(&self, fd: RawFd, data: u64, on: bool) {
        let mut event = libc::epoll_event {
            events: if on {
                (libc::EPOLLIN | libc::EPOLLET) as u32
            } else {
                0
            },
            u64: data,
        };
        // SAFETY: plain epoll_ctl(2) on our own epoll instance.
        unsafe { real::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_MOD, fd, &mut event) };
    }

    pub(super) fn watch_attach(&self, fd: RawFd, attach: Arc<Attach>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut attaches = guard(&self.attaches);
            // Attaches that are over (switched, failed, socket gone) are dropped here.
            attaches.retain(|(_, a)| guard(&a.listener).is_some());
            attaches.push((id, attach));
        }
        self.watch(fd, TAG_ATTACH | u64::from(id));
    }

    /// The service thread: waits up to `timeout_ms` for events (`epoll_wait`: their count,
    /// or -1 with errno).
    pub(crate) fn wait(&self, events: &mut [libc::epoll_event], timeout_ms: libc::c_int) -> i32 {
        // SAFETY: `events` has room for its length; our own epoll instance.
        unsafe {
            real::epoll_wait(
                self.epoll.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as libc::c_int,
                timeout_ms,
            )
        }
    }

    /// The service thread, for an event tagged `data`: handles the tick and a pending
    /// client's CM listener here, and says which socket anything else is about.
    pub(crate) fn dispatch(&self, data: u64) -> Watched {
        let low = (data & 0xffff_ffff) as u32;
        match data & !0xffff_ffff {
            TAG_SOCKET => return Watched::Socket(low),
            TAG_KERNEL => return Watched::KernelSocket(low),
            TAG_TICK => {
                if let Some(ticker) = self.ticker.as_ref() {
                    let mut count = 0u64;
                    // SAFETY: an 8-byte read from our nonblocking eventfd.
                    unsafe { libc::read(ticker.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
                }
            }
            TAG_ATTACH => {
                let attach = guard(&self.attaches)
                    .iter()
                    .find(|(id, _)| *id == low)
                    .map(|(_, a)| a.clone());
                if let Some(attach) = attach {
                    attach.on_listener_event();
                }
            }
            _ => {}
        }
        Watched::Handled
    }
}
