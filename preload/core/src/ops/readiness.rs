//! The readiness hooks: `poll`, `select`, the epoll calls (SAN sockets are watched through
//! their mirrors) and the FORTIFY forms of `poll`.

use core::ffi::c_int;
use std::time::{Duration, Instant};

use libc::size_t;

use super::outcome::{Outcome, Why};
use crate::guard::{self, bookkeeping};
use crate::record::flags;
use crate::track::{note_registration, record_of, track_epoll_instance, tracked};
use crate::{errno, real};

/// A poll-style wait (`poll`, `ppoll`, and `select`/`pselect` carried out as a poll) with
/// SAN sockets alive. Every kernel wait (`call`, given how long it may last, `None`: without
/// end) watches the switched SAN sockets of the set through their mirrors (`san::poll_fds`;
/// the application's entries are restored and corrected before the call returns). Unless the
/// caller gives a signal mask for the kernel waits (`sliced` false: between two slices the
/// thread's own mask would let in what the caller's keeps out), a kernel wait lasts at most one
/// slice (see [`crate::settings::wait_slice_ms`]), after which every SAN socket is serviced.
/// Reports that were only a mirror's handshake or credit token are dropped, and a wait left
/// with no report goes on until `timeout` (`None`: none).
///
/// A wait that begins with a SAN socket's mirror left raised by lazy lowering returns from the
/// kernel at once; as an epoll wait does, it then looks for that socket's next message before
/// it sleeps (`san::look_for_news`, same budget and [`LookPolicy`]). Found, the wait reports
/// `POLLIN` for the sockets found when that is exactly what the kernel would report
/// (`san::hand_out_input`), else polls the set once more with a zero timeout, so every entry
/// reports what the kernel reports after the arrival; not found, the mirror is lowered and the
/// wait sleeps. Only that first kernel wait
/// may be followed by a look: until it returned the call had not slept, so a signal whose
/// handler runs during the look is one that came before the call (the wait then goes on, as
/// the kernel's would), and one held back (blocked, or kept out by `ppoll`'s mask) reaches
/// the kernel wait that follows. A zero timeout never looks, and no look outlasts `timeout`.
///
/// # Safety
/// `fds` must point to `nfds` pollfds (or be null with `nfds == 0`).
#[inline(always)]
unsafe fn poll_with_san(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    timeout: Option<Duration>,
    sliced: bool,
    mut call: impl FnMut(Option<Duration>) -> c_int,
) -> c_int {
    let entries: &mut [libc::pollfd] = if fds.is_null() || nfds == 0 {
        &mut []
    } else {
        // SAFETY: the caller's array of `nfds` entries.
        unsafe { core::slice::from_raw_parts_mut(fds, nfds as usize) }
    };
    let start = Instant::now();
    // (A timeout past what an `Instant` can hold waits for ever.)
    let deadline = timeout.and_then(|t| start.checked_add(t));
    let slice = sliced.then(crate::settings::wait_slice);
    let mut serviced = start;
    let mut deferred = crate::san::Deferred::default();
    // This wait's look, if it gets to one (never with a zero timeout).
    let mut budget = if timeout == Some(Duration::ZERO) {
        Duration::ZERO
    } else {
        look_budget(deadline)
    };
    let mut rescan = false;
    loop {
        let rescanning = core::mem::take(&mut rescan);
        let wait = if rescanning {
            Some(Duration::ZERO)
        } else {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            match (left, slice) {
                (Some(left), Some(slice)) => Some(left.min(slice)),
                (left, slice) => left.or(slice),
            }
        };
        // (A panic of ours: the call goes on with the array as it stands.)
        // Only the first kernel wait may be followed by a look (see above).
        let budget = core::mem::take(&mut budget);
        let swapped = guard::contained(|| crate::san::poll_fds(entries, !budget.is_zero()))
            .unwrap_or_default();
        let rc = call(wait);
        let _errno = errno::Preserved::save();
        let look = !budget.is_zero() && swapped.raised && rc > 0;
        if !swapped.saved.is_empty() {
            let restored = guard::contained(|| {
                crate::san::unpoll_fds(entries, &swapped, look.then_some(&mut deferred))
            });
            if restored.is_none() {
                return rc;
            }
        }
        if rc < 0 {
            return rc;
        }
        if rc > 0 {
            let ready = if swapped.saved.is_empty() {
                rc
            } else {
                entries.iter().filter(|e| e.revents != 0).count() as c_int
            };
            if ready > 0 {
                // Real reports to hand out: the sockets raised without data are lowered now.
                if !deferred.is_empty() {
                    let _ = guard::contained(|| crate::san::lower_deferred(&deferred, false));
                    deferred.clear();
                }
                return ready;
            }
            if !deferred.is_empty() {
                // Only sockets raised without data: look for their next message before
                // sleeping (within the caller's timeout).
                let budget = look_budget_within(budget, deadline);
                let looked = guard::contained(|| crate::san::look_for_news(&deferred, budget))
                    .unwrap_or_default();
                // (Only a find in time pays: a poll waiter whose peer needs its CPU gains
                // nothing by looking, and its looks must stop.)
                note_look(true, looked.in_time, false);
                if looked.found == 0 {
                    let _ = guard::contained(|| crate::san::lower_deferred(&deferred, false));
                } else if let Some(ready) =
                    guard::contained(|| crate::san::hand_out_input(&deferred, entries)).flatten()
                {
                    return ready as c_int;
                }
                deferred.clear();
                if looked.found > 0 {
                    rescan = true;
                    continue;
                }
            }
        }
        // Nothing to report (the slice ended, or every report was dropped): wait on until
        // the deadline, servicing every SAN socket once per slice of waiting.
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return 0;
        }
        if (rc == 0 && !rescanning) || slice.is_some_and(|slice| serviced.elapsed() >= slice) {
            let _ = guard::contained(crate::san::service_all);
            serviced = Instant::now();
        }
    }
}

/// The longest wait a `timespec` timeout asks for: `Some(None)` for none (null), `None` for
/// one the kernel refuses (a negative field, or nanoseconds past a second), which the real
/// call then answers with `EINVAL`.
///
/// # Safety
/// `timeout` must be null or valid.
unsafe fn requested_wait(timeout: *const libc::timespec) -> Option<Option<Duration>> {
    if timeout.is_null() {
        return Some(None);
    }
    // SAFETY: a valid timespec per the contract.
    let t = unsafe { timeout.read_unaligned() };
    let valid = t.tv_sec >= 0 && (0..1_000_000_000).contains(&t.tv_nsec);
    valid.then(|| Some(Duration::new(t.tv_sec as u64, t.tv_nsec as u32)))
}

/// `ppoll` for `wait` (`None`: without end).
///
/// # Safety
/// `fds` must point to `nfds` pollfds (or be null with `nfds == 0`), `sigmask` null or valid.
unsafe fn ppoll_for(
    fds: *mut libc::pollfd,
    nfds: libc::nfds_t,
    wait: Option<Duration>,
    sigmask: *const libc::sigset_t,
) -> c_int {
    let spec = wait.map(|wait| libc::timespec {
        tv_sec: wait.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: wait.subsec_nanos() as libc::c_long,
    });
    let spec = spec
        .as_ref()
        .map_or(core::ptr::null(), |spec| spec as *const libc::timespec);
    // SAFETY: per the contract; `spec` null or our timespec.
    unsafe { real::ppoll(fds, nfds, spec, sigmask) }
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
    let timeout = (timeout >= 0).then(|| Duration::from_millis(timeout as u64));
    // SAFETY: forwarded; `fds` is the caller's array.
    unsafe {
        poll_with_san(fds, nfds, timeout, true, |wait| {
            // Rounded up, as the kernel rounds a timeout: the last sub-millisecond of a wait
            // sleeps instead of returning at once.
            let ms = wait.map_or(-1, |wait| {
                wait.as_nanos().div_ceil(1_000_000).min(c_int::MAX as u128) as c_int
            });
            real::poll(fds, nfds, ms)
        })
    }
}

/// `ppoll(2)`: SAN sockets are watched through their mirrors; every kernel wait takes the
/// caller's signal mask.
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
    if crate::san::live_sockets() != 0 && !guard::is_inside() {
        // SAFETY: a valid timespec or null per the C contract.
        if let Some(timeout) = unsafe { requested_wait(timeout) } {
            // SAFETY: forwarded; `fds` is the caller's array.
            return unsafe {
                poll_with_san(fds, nfds, timeout, sigmask.is_null(), |wait| {
                    ppoll_for(fds, nfds, wait, sigmask)
                })
            };
        }
    }
    // SAFETY: forwarded.
    unsafe { real::ppoll(fds, nfds, timeout, sigmask) }
}

/// `select()`/`pselect()` with SAN sockets in the sets: carried out as a poll over a set made
/// from them (`san::select_pollfds`) with `ppoll` waits ([`poll_with_san`]), the sets then
/// rewritten from its results. `None`: no SAN socket in the sets (or our own failure), make
/// the real call.
///
/// # Safety
/// The sets must be null or valid `fd_set`s; `sigmask` null or valid.
unsafe fn select_with_san(
    nfds: c_int,
    readfds: *mut libc::fd_set,
    writefds: *mut libc::fd_set,
    exceptfds: *mut libc::fd_set,
    timeout: Option<Duration>,
    sigmask: *const libc::sigset_t,
) -> Option<c_int> {
    // SAFETY: the caller's sets.
    let mut pollfds = guard::contained(|| unsafe {
        crate::san::select_pollfds(nfds, readfds, writefds, exceptfds)
    })
    .flatten()?;
    let (set, len) = (pollfds.as_mut_ptr(), pollfds.len() as libc::nfds_t);
    // SAFETY: our own set of `len` entries.
    let rc = unsafe {
        poll_with_san(set, len, timeout, sigmask.is_null(), |wait| {
            ppoll_for(set, len, wait, sigmask)
        })
    };
    if rc < 0 {
        return Some(rc);
    }
    // SAFETY: the caller's sets, which `pollfds` was made from.
    let results = guard::contained(|| unsafe {
        crate::san::select_results(&pollfds, readfds, writefds, exceptfds)
    })?;
    Outcome::from_san(Some(results), Why::NotOnSan)
        .returned()
        .ok()
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
    mut call: impl FnMut(c_int, c_int) -> c_int,
) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() || events.is_null() {
        return call(maxevents, timeout_ms);
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
    // Outputs kept in user space (see `san::ready_outputs`) are counted from here on.
    let _waiting = crate::san::begin_epoll_wait(epfd);
    loop {
        {
            let _errno = errno::Preserved::save();
            let _ = guard::contained(|| {
                crate::san::assist_all_in_process();
                crate::san::settle_all_owed();
            });
        }
        // Registrations whose output is kept here and writable now: reported with what a
        // zero-timeout kernel wait reports, in room left for them (at least one event of
        // the kernel's, so that its events are never kept out).
        let mut ready = [crate::san::ReadyOutput::default(); crate::san::REPORTED_PER_WAIT];
        let room = (maxevents.max(1) as usize - 1).min(ready.len());
        let ready = match guard::contained(|| crate::san::ready_outputs(epfd, &mut ready[..room])) {
            Some(found) => &ready[..found],
            None => &ready[..0],
        };
        let n = if ready.is_empty() {
            call(maxevents, crate::settings::next_slice_ms(deadline))
        } else {
            call(maxevents - ready.len() as c_int, 0)
        };
        if n < 0 || n > maxevents {
            return n;
        }
        let _errno = errno::Preserved::save();
        if !ready.is_empty() {
            // SAFETY: the caller's array holds `maxevents` events; the kernel wrote `n`.
            let all = unsafe { core::slice::from_raw_parts_mut(events, maxevents as usize) };
            let kept = guard::contained(|| {
                crate::san::correct_epoll_events(epfd, &mut all[..n as usize], Some(&mut deferred))
            })
            .unwrap_or(n as usize);
            // Events to hand out: sockets raised without data stay so for a few waits, as
            // below.
            if !deferred.is_empty() {
                let _ = guard::contained(|| crate::san::lower_deferred(&deferred, true));
                deferred.clear();
            }
            return crate::san::merge_ready_outputs(all, kept, ready) as c_int;
        }
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
                // Real events to hand out: the sockets raised without data are lowered now
                // unless they were so for only a few waits in a row (their answer is likely
                // near, and a raised mirror spares the peer its token); left raised for
                // good, every later wait would report them again (a busy server with many
                // idle connections spent its time re-correcting them).
                if !deferred.is_empty() {
                    let _ = guard::contained(|| crate::san::lower_deferred(&deferred, true));
                    deferred.clear();
                }
                return kept as c_int;
            }
            if !deferred.is_empty() {
                // Only sockets raised without data: look for their next message before
                // sleeping (see `san::look_for_messages`); found, the next kernel wait
                // reports it at once.
                let budget = look_budget(deadline);
                let looked = if budget.is_zero() {
                    crate::san::Looked::default()
                } else {
                    guard::contained(|| crate::san::look_for_messages(&deferred, budget, returned))
                        .unwrap_or_default()
                };
                // (Any find pays here, late ones included: measured on an epoll server
                // with more busy threads than CPUs, counting only finds in time made it
                // sleep and its clients write tokens for most requests. But not a find by
                // a look that lost its CPU meanwhile: there the look took the CPU its peer,
                // or another program, needed; with a CPU hog beside a request/response
                // pair, or both ends pinned to one CPU, counting those ran at 0.6x of
                // kernel TCP.)
                note_look(!budget.is_zero(), looked.found > 0, looked.preempted);
                if looked.found > 0 {
                    deferred.clear();
                    return looked.found as c_int;
                }
                let _ = guard::contained(|| crate::san::lower_deferred(&deferred, false));
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

/// The next look's budget, within the time left until `deadline` (see
/// [`look_budget_within`]).
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
    look_budget_within(
        std::time::Duration::from_micros(u64::from(budget_us)),
        deadline,
    )
}

/// `budget`, cut to the time left until `deadline`: no look outlasts the caller's timeout.
fn look_budget_within(
    budget: std::time::Duration,
    deadline: Option<std::time::Instant>,
) -> std::time::Duration {
    deadline.map_or(budget, |d| {
        budget.min(d.saturating_duration_since(std::time::Instant::now()))
    })
}

/// Records how a look went (`looked`: it had a budget; `found`: it paid off; `preempted`:
/// it lost its CPU to another thread, which halves the thread's budget whatever it found,
/// and stops its looks, down to the occasional probe, when it happens again before a look
/// paid off: another thread wants this CPU, and looking takes it from that thread).
fn note_look(looked: bool, found: bool, preempted: bool) {
    if !looked {
        return;
    }
    LOOK.with(|look| {
        let mut policy = look.get();
        policy.budget_us = if preempted {
            // Halved at the first switch, stopped at the second in a row: one switch (a
            // kernel thread's turn) says little, while a CPU shared for good preempts every
            // look (and the probes after that find it shared again).
            let most = crate::settings::poll_us();
            match policy.budget_us {
                u32::MAX => most / 2,
                budget if budget >= most => budget / 2,
                _ => 0,
            }
        } else if found {
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
        epoll_wait_with_san(epfd, events, maxevents, timeout, |room, slice| {
            real::epoll_wait(epfd, events, room, slice)
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
        epoll_wait_with_san(epfd, events, maxevents, timeout, |room, slice| {
            real::epoll_pwait(epfd, events, room, slice, sigmask)
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
        epoll_wait_with_san(epfd, events, maxevents, timeout_ms, |room, slice| {
            real::epoll_pwait(epfd, events, room, slice, sigmask)
        })
    }
}

/// `select(2)`: with SAN sockets in the sets, carried out as a poll (`select_with_san`). As
/// glibc's `select` does, a negative field of `timeout` is `EINVAL` (the real call answers
/// it), microseconds past a second carry into the seconds, and the time not waited is
/// written back.
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
        let requested = if timeout.is_null() {
            Some(None)
        } else {
            // SAFETY: a valid timeval per the C contract.
            let tv = unsafe { timeout.read_unaligned() };
            (tv.tv_sec >= 0 && tv.tv_usec >= 0).then(|| {
                Some(
                    Duration::from_secs(tv.tv_sec as u64)
                        .saturating_add(Duration::from_micros(tv.tv_usec as u64)),
                )
            })
        };
        if let Some(wait) = requested {
            let start = Instant::now();
            // SAFETY: the caller's sets.
            let selected = unsafe {
                select_with_san(nfds, readfds, writefds, exceptfds, wait, core::ptr::null())
            };
            if let Some(rc) = selected {
                if let Some(wait) = wait.filter(|w| !w.is_zero()) {
                    let left = wait.saturating_sub(start.elapsed());
                    // SAFETY: a valid, writable timeval per the C contract.
                    unsafe {
                        timeout.write_unaligned(libc::timeval {
                            tv_sec: left.as_secs() as libc::time_t,
                            tv_usec: left.subsec_micros() as libc::suseconds_t,
                        })
                    };
                }
                return rc;
            }
        }
    }
    // SAFETY: forwarded.
    unsafe { real::select(nfds, readfds, writefds, exceptfds, timeout) }
}

/// `pselect(2)`: as [`select`], every kernel wait taking the caller's signal mask (and
/// `timeout` left as it is).
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
        // SAFETY: a valid timespec or null per the C contract.
        if let Some(wait) = unsafe { requested_wait(timeout) } {
            // SAFETY: the caller's arguments.
            let selected =
                unsafe { select_with_san(nfds, readfds, writefds, exceptfds, wait, sigmask) };
            if let Some(rc) = selected {
                return rc;
            }
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
    let index = entry.and_then(crate::san::san_index);
    let target = match index {
        Some(index) => guard::contained(|| crate::san::mirror_of(fd, index))
            .flatten()
            .unwrap_or(fd),
        None => fd,
    };
    // The application's event, read once where the SAN path needs it: a SAN socket watched
    // through its mirror (a removal may be left to later, see `san::epoll_ctl_on_mirror`), or
    // any registration while such removals are due (one may hold the data this call gives,
    // see `san::before_registering`). A pointer we may not read is skipped: the kernel call
    // answers EFAULT.
    let on_mirror = target != fd && index.is_some();
    let wanted = (matches!(op, libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD)
        && !event.is_null()
        && (on_mirror || crate::san::any_removed()))
    // SAFETY: `epoll_event` is plain C data.
    .then(|| unsafe { crate::fault::read_app(event) })
    .flatten();
    if let Some(wanted) = wanted.filter(|_| crate::san::any_removed()) {
        let _ = guard::contained(|| crate::san::before_registering(epfd, wanted.u64, index));
    }
    if let Some(index) = index.filter(|_| on_mirror) {
        let handled =
            guard::contained(|| crate::san::epoll_ctl_on_mirror(epfd, op, index, target, wanted))
                .flatten();
        match handled {
            Some(crate::san::Handled::Done) => {
                bookkeeping(|| crate::san::epoll_registrations_changed(index));
                return 0;
            }
            Some(crate::san::Handled::Failed(code)) => {
                errno::set(code);
                return -1;
            }
            None => {}
        }
    }
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
            if let Some(index) = index {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn budget_us() -> u32 {
        LOOK.with(|look| look.get().budget_us)
    }

    fn start_fresh() {
        LOOK.with(|look| {
            look.set(LookPolicy {
                budget_us: u32::MAX,
                skipped: 0,
            })
        });
    }

    /// One switch to another thread halves the look; a look that pays off restores it; a
    /// second switch before that stops the looks (a CPU shared for good).
    #[test]
    fn a_single_preemption_halves_the_look_and_a_second_in_a_row_stops_it() {
        let most = crate::settings::poll_us();
        start_fresh();
        note_look(true, true, true);
        assert_eq!(budget_us(), most / 2, "the first switch halves");
        note_look(true, true, false);
        assert_eq!(
            budget_us(),
            most,
            "a look that paid off restores the budget"
        );
        note_look(true, false, true);
        assert_eq!(budget_us(), most / 2);
        note_look(true, false, true);
        assert_eq!(budget_us(), 0, "a second switch in a row stops the looks");
        note_look(true, true, false);
        assert_eq!(budget_us(), most, "a probe that pays off starts them again");
        note_look(false, false, true);
        assert_eq!(
            budget_us(),
            most,
            "a wait that did not look changes nothing"
        );
    }
}
