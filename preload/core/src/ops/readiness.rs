//! The readiness hooks: `poll`, `select`, the epoll calls (SAN sockets are watched through
//! their mirrors) and the FORTIFY forms of `poll`.

use core::ffi::c_int;

use libc::size_t;

use super::outcome::{Outcome, Why};
use crate::guard::{self, bookkeeping};
use crate::record::flags;
use crate::track::{note_registration, record_of, track_epoll_instance, tracked};
use crate::{errno, real};

/// Runs a poll-style call with every switched SAN socket in `fds` replaced by its mirror's watched end
/// for the duration of the call (the application's array is restored before returning).
///
/// # Safety
/// `fds` must point to `nfds` pollfds (or be null with `nfds == 0`).
#[inline(always)]
unsafe fn with_mirrors(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    mut call: impl FnMut() -> c_int,
) -> c_int {
    if crate::san::live_sockets() == 0 || fds.is_null() || nfds == 0 || guard::is_inside() {
        return call();
    }
    // SAFETY: the caller's array of `nfds` entries.
    let entries = unsafe { core::slice::from_raw_parts_mut(fds, nfds as usize) };
    loop {
        // (A panic of ours: the call goes on with the array as it stands.)
        let saved = guard::contained(|| crate::san::poll_fds(entries, None)).unwrap_or_default();
        let rc = call();
        if saved.is_empty() {
            return rc;
        }
        let _errno = errno::Preserved::save();
        if guard::contained(|| crate::san::poll_fds(entries, Some(&saved))).is_none() {
            return rc;
        }
        if rc <= 0 {
            return rc;
        }
        let ready = entries.iter().filter(|e| e.revents != 0).count() as c_int;
        if ready > 0 {
            return ready;
        }
        // Every report was a spurious mirror token (now lowered): wait again. The timeout
        // restarts, so such a wait can last longer than asked (documented).
    }
}

/// `poll(2)`: SAN sockets are watched through their mirrors.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn poll(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        // SAFETY: forwarded.
        return unsafe { real::poll(fds, nfds, timeout) };
    }
    // Sliced like the epoll waits (see `settings::wait_slice_ms`).
    let deadline = (timeout >= 0)
        .then(|| std::time::Instant::now() + std::time::Duration::from_millis(timeout as u64));
    loop {
        let slice = crate::settings::next_slice_ms(deadline);
        // SAFETY: forwarded; `fds` is the caller's array.
        let rc = unsafe { with_mirrors(fds, nfds, || real::poll(fds, nfds, slice)) };
        if rc != 0 || deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return rc;
        }
        let _errno = errno::Preserved::save();
        let _ = guard::contained(crate::san::service_all);
    }
}

/// `ppoll(2)`: SAN sockets are watched through their mirrors.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn ppoll(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: forwarded; `fds` is the caller's array.
    unsafe { with_mirrors(fds, nfds, || real::ppoll(fds, nfds, timeout, sigmask)) }
}

/// An epoll wait with SAN sockets alive: connections with both ends in this process are
/// driven first (see `san::assist_all_in_process`), the kernel wait is cut into slices
/// (see [`crate::settings::wait_slice_ms`]), and events that only reflect a handshake or credit token of
/// a SAN mirror are dropped (`san::correct_epoll_events`); a wait left with no event goes on
/// until the caller's timeout (`timeout_ms < 0`: none).
///
/// # Safety
/// `events` must be writable for `maxevents` entries.
#[inline(always)]
unsafe fn epoll_wait_with_san(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout_ms: c_int,
    mut call: impl FnMut(c_int) -> c_int,
) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() || events.is_null() {
        return call(timeout_ms);
    }
    let start = std::time::Instant::now();
    let deadline =
        (timeout_ms >= 0).then(|| start + std::time::Duration::from_millis(timeout_ms as u64));
    // The safety net runs once per slice of waiting, also when the slices were cut short by
    // events that were all dropped (a socket whose wake-up was lost must not wait behind a
    // busy neighbour).
    let slice = std::time::Duration::from_millis(crate::settings::wait_slice_ms() as u64);
    let mut serviced = start;
    let mut deferred = crate::san::Deferred::default();
    loop {
        {
            let _errno = errno::Preserved::save();
            let _ = guard::contained(|| {
                crate::san::assist_all_in_process();
                crate::san::settle_all_owed();
            });
        }
        let left = crate::settings::next_slice_ms(deadline);
        let n = call(left);
        if n < 0 || n > maxevents {
            return n;
        }
        let _errno = errno::Preserved::save();
        if n > 0 {
            // SAFETY: the kernel just wrote `n` events there.
            let returned = unsafe { core::slice::from_raw_parts_mut(events, n as usize) };
            // (A panic of ours: the kernel's events as they are.)
            let may_look = timeout_ms != 0;
            let kept = guard::contained(|| {
                crate::san::correct_epoll_events(epfd, returned, may_look.then_some(&mut deferred))
            })
            .unwrap_or(n as usize);
            if kept > 0 {
                // Real events to hand out: the sockets raised without data are lowered now,
                // or every later wait would report them again (a busy server with many
                // connections spent its time re-correcting them).
                if !deferred.is_empty() {
                    let _ = guard::contained(|| crate::san::lower_deferred(&deferred));
                    deferred.clear();
                }
                return kept as c_int;
            }
            if !deferred.is_empty() {
                // Only sockets raised without data: look for their next message before
                // sleeping (see `san::look_for_messages`); found, the next kernel wait
                // reports it at once.
                let budget = look_budget(deadline);
                let found = if budget.is_zero() {
                    0
                } else {
                    guard::contained(|| crate::san::look_for_messages(&deferred, budget, returned))
                        .unwrap_or(0)
                };
                note_look(!budget.is_zero(), found > 0);
                if found > 0 {
                    deferred.clear();
                    return found as c_int;
                }
                let _ = guard::contained(|| crate::san::lower_deferred(&deferred));
                deferred.clear();
                continue;
            }
            if serviced.elapsed() >= slice {
                let _ = guard::contained(crate::san::service_all);
                serviced = std::time::Instant::now();
            }
        } else {
            let _ = guard::contained(crate::san::service_all);
            serviced = std::time::Instant::now();
        }
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return 0;
        }
    }
}

/// How a thread's recent looks for the next message went: the budget of the next look, in
/// microseconds, halved by every look that found nothing (down to none, then a short look
/// once every [`PROBE_EVERY`] waits), back to the whole [`crate::settings::poll_us`] once one
/// pays off. A thread whose peers answer slowly, or share its CPU, soon stops looking.
#[derive(Clone, Copy)]
struct LookPolicy {
    budget_us: u32,
    skipped: u32,
}

const PROBE_EVERY: u32 = 16;

thread_local! {
    static LOOK: core::cell::Cell<LookPolicy> = const {
        core::cell::Cell::new(LookPolicy { budget_us: u32::MAX, skipped: 0 })
    };
}

/// The next look's budget, within the time left until `deadline`.
fn look_budget(deadline: Option<std::time::Instant>) -> std::time::Duration {
    let most = crate::settings::poll_us();
    if most == 0 || !san_shm::multi_cpu() {
        return std::time::Duration::ZERO;
    }
    let budget_us = LOOK.with(|look| {
        let mut policy = look.get();
        let budget = if policy.budget_us == u32::MAX {
            most
        } else if policy.budget_us == 0 {
            policy.skipped += 1;
            if policy.skipped.is_multiple_of(PROBE_EVERY) {
                most / 8
            } else {
                0
            }
        } else {
            policy.budget_us.min(most)
        };
        look.set(policy);
        budget
    });
    let budget = std::time::Duration::from_micros(u64::from(budget_us));
    deadline.map_or(budget, |d| {
        budget.min(d.saturating_duration_since(std::time::Instant::now()))
    })
}

/// Records how a look went (`looked`: it had a budget).
fn note_look(looked: bool, found: bool) {
    if !looked {
        return;
    }
    LOOK.with(|look| {
        let mut policy = look.get();
        policy.budget_us = if found {
            crate::settings::poll_us()
        } else if policy.budget_us == u32::MAX {
            crate::settings::poll_us() / 2
        } else {
            policy.budget_us / 2
        };
        if found {
            policy.skipped = 0;
        }
        look.set(policy);
    });
}

/// `epoll_wait(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
) -> c_int {
    // SAFETY: forwarded.
    unsafe {
        epoll_wait_with_san(epfd, events, maxevents, timeout, |slice| {
            real::epoll_wait(epfd, events, maxevents, slice)
        })
    }
}

/// `epoll_pwait(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
    sigmask: *const libc::sigset_t,
) -> c_int {
    // SAFETY: forwarded.
    unsafe {
        epoll_wait_with_san(epfd, events, maxevents, timeout, |slice| {
            real::epoll_pwait(epfd, events, maxevents, slice, sigmask)
        })
    }
}

/// `epoll_pwait2(2)`: with SAN sockets alive, waits in `epoll_pwait` slices (millisecond
/// resolution).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        // SAFETY: forwarded.
        return unsafe { real::epoll_pwait2(epfd, events, maxevents, timeout, sigmask) };
    }
    let timeout_ms = if timeout.is_null() {
        -1
    } else {
        // SAFETY: a valid timespec per the C contract.
        let t = unsafe { timeout.read_unaligned() };
        (t.tv_sec.max(0).saturating_mul(1000) + (t.tv_nsec.max(0) + 999_999) / 1_000_000)
            .min(c_int::MAX as i64) as c_int
    };
    // SAFETY: forwarded.
    unsafe {
        epoll_wait_with_san(epfd, events, maxevents, timeout_ms, |slice| {
            real::epoll_pwait(epfd, events, maxevents, slice, sigmask)
        })
    }
}

/// `select(2)`: with SAN sockets in the sets it runs as `ppoll` over their mirrors.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn select(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *mut libc::timeval,
) -> c_int {
    if crate::san::live_sockets() != 0 && !guard::is_inside() {
        let spec = (!timeout.is_null()).then(|| {
            // SAFETY: a valid timeval per the C contract.
            let tv = unsafe { timeout.read_unaligned() };
            libc::timespec {
                tv_sec: tv.tv_sec,
                tv_nsec: tv.tv_usec * 1000,
            }
        });
        let spec_ptr = spec
            .as_ref()
            .map_or(core::ptr::null(), |t| t as *const libc::timespec);
        // (A panic of ours: the real call.)
        let selected = guard::contained(|| {
            // SAFETY: the caller's sets; our timespec.
            unsafe {
                crate::san::select_via_poll(
                    nfds,
                    readfds,
                    writefds,
                    exceptfds,
                    spec_ptr,
                    core::ptr::null(),
                )
            }
        })
        .flatten();
        if let Ok(rc) = Outcome::from_san(selected, Why::NotOnSan).returned() {
            return rc;
        }
    }
    // SAFETY: forwarded.
    unsafe { real::select(nfds, readfds, writefds, exceptfds, timeout) }
}

/// `pselect(2)`: as [`select`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn pselect(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
) -> c_int {
    if crate::san::live_sockets() != 0 && !guard::is_inside() {
        let selected = guard::contained(|| {
            // SAFETY: the caller's arguments.
            unsafe {
                crate::san::select_via_poll(nfds, readfds, writefds, exceptfds, timeout, sigmask)
            }
        })
        .flatten();
        if let Ok(rc) = Outcome::from_san(selected, Why::NotOnSan).returned() {
            return rc;
        }
    }
    // SAFETY: forwarded.
    unsafe { real::pselect(nfds, readfds, writefds, exceptfds, timeout, sigmask) }
}

/// `__poll_chk`: the `poll` of a program built with `-D_FORTIFY_SOURCE` (glibc
/// debug/poll_chk.c). glibc checks the array's size and then calls its own `poll`
/// internally, past the [`poll`] hook: passed through, a SAN socket would be watched on its
/// kernel TCP descriptor, which stays silent. So the check is made here and the call is then
/// exactly [`poll`] (SAN sockets watched through their mirrors).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn __poll_chk(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: c_int,
    fdslen: size_t,
) -> c_int {
    if nfds > (fdslen / core::mem::size_of::<libc::pollfd>()) as libc::nfds_t {
        // An overflowing request goes to the real function, which aborts (`__chk_fail`).
        // SAFETY: forwarded.
        return unsafe { real::__poll_chk(fds, nfds, timeout, fdslen) };
    }
    // SAFETY: the caller's arguments, valid as for `poll`.
    unsafe { poll(fds, nfds, timeout) }
}

/// `__ppoll_chk`: the `ppoll` of a program built with `-D_FORTIFY_SOURCE` (glibc
/// debug/ppoll_chk.c): the size check as in [`__poll_chk`], then exactly [`ppoll`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn __ppoll_chk(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: *const libc::timespec,
    sigmask: *const libc::sigset_t,
    fdslen: size_t,
) -> c_int {
    if nfds > (fdslen / core::mem::size_of::<libc::pollfd>()) as libc::nfds_t {
        // An overflowing request goes to the real function, which aborts (`__chk_fail`).
        // SAFETY: forwarded.
        return unsafe { real::__ppoll_chk(fds, nfds, timeout, sigmask, fdslen) };
    }
    // SAFETY: the caller's arguments, valid as for `ppoll`.
    unsafe { ppoll(fds, nfds, timeout, sigmask) }
}

/// `epoll_create(2)`: the instance is tracked.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_create(size: c_int) -> c_int {
    // SAFETY: forwarded.
    let epfd = unsafe { real::epoll_create(size) };
    track_epoll_instance(epfd, false);
    epfd
}

/// `epoll_create1(2)`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_create1(create_flags: c_int) -> c_int {
    // SAFETY: forwarded.
    let epfd = unsafe { real::epoll_create1(create_flags) };
    track_epoll_instance(epfd, create_flags & libc::EPOLL_CLOEXEC != 0);
    epfd
}

/// `epoll_ctl(2)`: registrations of our sockets are recorded.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn epoll_ctl(epfd: c_int, op: c_int, fd: c_int, event: *mut libc::epoll_event) -> c_int {
    let entry = tracked(fd);
    // A switched SAN socket is watched through its mirror (same events, same data).
    let target = match entry.and_then(crate::san::san_index) {
        Some(index) => guard::contained(|| crate::san::mirror_of(fd, index))
            .flatten()
            .unwrap_or(fd),
        None => fd,
    };
    // SAFETY: forwarded.
    let rc = unsafe { real::epoll_ctl(epfd, op, target, event) };
    if let (0, libc::EPOLL_CTL_ADD, Some(entry)) = (rc, op, entry) {
        if entry.is_epoll() {
            bookkeeping(|| {
                if crate::track::note_nested_epoll(fd) {
                    crate::san::epoll_instance_nested(fd);
                }
            });
            return rc;
        }
    }
    if let (0, Some(entry)) = (rc, entry) {
        // SAFETY: the kernel accepted `event` (required for ADD/MOD) just now.
        let registered = (!event.is_null()).then(|| unsafe { event.read_unaligned() });
        bookkeeping(|| {
            let Some((_, record)) = record_of(entry) else {
                return;
            };
            match (op, registered) {
                (libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD, Some(event)) => {
                    note_registration(record, epfd, event)
                }
                (libc::EPOLL_CTL_DEL, _) => record.unregister_epoll(epfd),
                _ => {}
            }
            if let Some(index) = crate::san::san_index(entry) {
                crate::san::epoll_registrations_changed(index);
            }
            if record.flags() & flags::STASHED != 0 {
                if let Some((index, _)) = record_of(entry) {
                    let (events, data) = registered.map_or((0, 0), |e| (e.events, e.u64));
                    crate::san::stashed_epoll_ctl(index, epfd, op, events, data);
                }
            }
        });
    }
    rc
}
