//! Blocking a SAN call: the deadline its socket's timeout sets, the sleep (lock released)
//! on what the socket's prepared wait watches, cut into slices, the signal rules of a
//! restarted call, and over verbs the polling of a blocked reader before it sleeps.

use core::ffi::c_int;
use std::time::{Duration, Instant};

use super::socket::wait::{AfterPolling, WaitFds};
use super::switchover::assist_in_process_peer;
use super::table::{lock, record_flag, SanObject};
use super::tunables::{poll_budget, wait_slice};
use crate::{errno, guard, real};

/// The deadline `SO_RCVTIMEO`/`SO_SNDTIMEO` (`option`) sets for a blocking call that starts
/// now; `None` without one. Asked of the kernel only when the record's flag for the option
/// says it may be set (see `record::flags::RCVTIMEO`).
pub(super) fn timeout_of(index: u32, fd: c_int, option: c_int) -> Option<Instant> {
    if !crate::record::timeout_flag(option).is_some_and(|flag| record_flag(index, flag)) {
        return None;
    }
    let mut value = libc::timeval {
        tv_sec: 0,
        tv_usec: 0,
    };
    let mut len = core::mem::size_of::<libc::timeval>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `value`.
    let rc = unsafe {
        real::getsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&mut value as *mut libc::timeval).cast(),
            &mut len,
        )
    };
    if rc != 0 || (value.tv_sec == 0 && value.tv_usec == 0) {
        return None;
    }
    let timeout = Duration::from_secs(value.tv_sec.max(0) as u64)
        + Duration::from_micros(value.tv_usec.max(0) as u64);
    Instant::now().checked_add(timeout)
}

/// Blocks (lock released) until the socket may make progress, the deadline passes
/// (`EAGAIN`), or a signal arrives (`EINTR`).
pub(super) fn block(
    index: u32,
    fd: c_int,
    fds: Option<WaitFds>,
    deadline: Option<Instant>,
) -> Result<(), c_int> {
    let Some(fds) = fds else { return Ok(()) };
    if assist_in_process_peer(index) {
        // The peer made progress on our behalf: re-check before sleeping.
        if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
            socket.finish_wait(&fds, true);
        }
        return Ok(());
    }
    // Verbs, a reader: poll before sleeping when that pays; signals held back meanwhile are
    // let in atomically by the sleep below.
    let held_signals = match fds.spin.then(|| poll_with_signals_held(index, &fds)) {
        Some(Polled::Done { signal_came: false }) => return Ok(()),
        // A signal came while we polled and was let in as the mask was restored: the call was
        // blocked when it came, so it ends as an interrupted call does. (Returning to look
        // again would spend the signal before the next sleep, which then sleeps on.)
        Some(Polled::Done { signal_came: true }) => return interrupted_outcome(deadline),
        Some(Polled::Sleep(outer)) => Some(outer),
        Some(Polled::NotHeld) | None => None,
    };
    let mut pollfds = [libc::pollfd {
        fd: -1,
        events: 0,
        revents: 0,
    }; 4];
    let mut count = 0;
    let mut bell_at = None;
    if let Some(link) = fds.link {
        pollfds[count] = libc::pollfd {
            fd: link,
            events: libc::POLLIN,
            revents: 0,
        };
        count += 1;
    }
    if let Some(bell) = fds.bell {
        bell_at = Some(count);
        pollfds[count] = libc::pollfd {
            fd: bell,
            events: libc::POLLIN,
            revents: 0,
        };
        count += 1;
    }
    if let Some(mirror) = fds.mirror {
        pollfds[count] = libc::pollfd {
            fd: mirror,
            events: fds.mirror_events,
            revents: 0,
        };
        count += 1;
    }
    if fds.tcp_events != 0 {
        pollfds[count] = libc::pollfd {
            fd,
            events: fds.tcp_events,
            revents: 0,
        };
        count += 1;
    }
    // (No clock read without a deadline: under emulation it is a system call.)
    let slice = deadline
        .map_or(wait_slice(), |d| {
            d.saturating_duration_since(Instant::now())
                .min(wait_slice())
        })
        .min(fds.cap.unwrap_or(wait_slice()));
    // The sleep is where signals come in: a handler may `siglongjmp` out of it, past our
    // frames, so the reentrancy guard is not held across it (see `guard::released_while`).
    let (rc, signal_came) = guard::released_while(|| match held_signals.as_ref() {
        // SAFETY: `count` valid pollfds.
        None => unsafe {
            let rc = real::poll(
                pollfds.as_mut_ptr(),
                count as libc::nfds_t,
                slice.as_millis().max(1) as c_int,
            );
            (rc, false)
        },
        Some(outer) => {
            let millis = slice.as_millis().max(1) as u64;
            let timeout = libc::timespec {
                tv_sec: (millis / 1000) as libc::time_t,
                tv_nsec: ((millis % 1000) * 1_000_000) as libc::c_long,
            };
            // SAFETY: `count` valid pollfds; the caller's own mask while asleep, so a signal
            // that came while we polled interrupts this sleep as it would have the call.
            let rc = unsafe {
                real::ppoll(pollfds.as_mut_ptr(), count as libc::nfds_t, &timeout, outer)
            };
            let saved = errno::get();
            // A ppoll that returns events (or times out) puts the held mask back before it
            // returns, leaving a signal that came meanwhile pending: restoring the caller's
            // mask below runs its handler, and the call must end as interrupted (looking
            // again would sleep on with the signal spent).
            let signal_came = rc >= 0 && signal_pending_for(outer);
            // SAFETY: restores the caller's own mask.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, outer, core::ptr::null_mut()) };
            errno::set(saved);
            (rc, signal_came)
        }
    });
    let interrupted = signal_came || (rc < 0 && errno::get() == libc::EINTR);
    // Verbs: the connection's own fd woke us (it is first in the set): collect its channel
    // and connection events, as the service thread does when it wakes on them.
    let link_ready = fds.link.is_some() && rc > 0 && pollfds[0].revents != 0;
    let bell_rung = bell_at.is_some_and(|at| rc > 0 && pollfds[at].revents != 0);
    if let Some(SanObject::Socket(socket)) = lock(index).as_mut() {
        // (First: the service thread's watch, resumed by `finish_wait`, would otherwise
        // report the same event again and wake it to contend for this lock.)
        if link_ready {
            socket.collect_link_events();
        }
        socket.finish_wait(&fds, bell_rung);
    }
    if interrupted {
        return interrupted_outcome(deadline);
    }
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return Err(libc::EAGAIN);
    }
    Ok(())
}

/// How a blocking call a signal interrupted ends. The kernel restarts a socket call
/// interrupted by a handler installed with SA_RESTART unless the socket has a timeout
/// (signal(7)); poll() never restarts, so decide here. Which signal arrived is unknown:
/// restart (`Ok`: the caller looks again) only when every installed handler asked for it.
fn interrupted_outcome(deadline: Option<Instant>) -> Result<(), c_int> {
    if deadline.is_none() && every_handler_restarts() {
        return Ok(());
    }
    Err(libc::EINTR)
}

/// What [`poll_with_signals_held`] leaves the wait to do.
enum Polled {
    /// News came (or the queue was settled for sleeping and the call looks again): the
    /// wait is over, the caller's signal mask restored. `signal_came`: a signal the caller's
    /// mask lets in arrived while it was held back (its handler ran as the mask was restored).
    Done { signal_came: bool },
    /// Nothing came: sleep, letting in the signals held back with this mask (the caller's).
    Sleep(libc::sigset_t),
    /// Signals could not be held back: sleep at once, without polling.
    NotHeld,
}

/// [`poll_before_sleeping`] with every signal held back, then the outcome applied to the
/// socket's wait (see [`crate::san::socket::SanSocket::polled`]).
fn poll_with_signals_held(index: u32, fds: &WaitFds) -> Polled {
    let mut outer = core::mem::MaybeUninit::<libc::sigset_t>::uninit();
    let mut all = core::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigfillset initialises `all`; pthread_sigmask writes the previous mask into
    // `outer` (only read when the call succeeded).
    let blocked = unsafe {
        libc::sigfillset(all.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_BLOCK, all.as_ptr(), outer.as_mut_ptr()) == 0
    };
    if !blocked {
        return Polled::NotHeld;
    }
    // SAFETY: written by the successful pthread_sigmask above.
    let outer = unsafe { outer.assume_init() };
    let found = poll_before_sleeping(index);
    let after = match lock(index).as_mut() {
        Some(SanObject::Socket(socket)) => {
            let after = socket.polled(found);
            match after {
                AfterPolling::Found => socket.finish_polled_wait(fds),
                AfterPolling::LookAgain => socket.finish_wait(fds, false),
                AfterPolling::Sleep => {}
            }
            after
        }
        _ => AfterPolling::Found,
    };
    if after == AfterPolling::Sleep {
        return Polled::Sleep(outer);
    }
    let signal_came = signal_pending_for(&outer);
    // SAFETY: restores the caller's own mask.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &outer, core::ptr::null_mut()) };
    Polled::Done { signal_came }
}

/// Whether a signal is pending for this thread (or its process) that `mask` does not block:
/// one that restoring `mask` delivers at once.
fn signal_pending_for(mask: &libc::sigset_t) -> bool {
    let mut pending = core::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigpending writes the pending set into `pending` (only read when it succeeded).
    if unsafe { libc::sigpending(pending.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: written by the successful sigpending above.
    let pending = unsafe { pending.assume_init() };
    (1..=libc::SIGRTMAX()).any(|signal| {
        // SAFETY: both sets are initialised; `signal` is a valid signal number.
        unsafe { libc::sigismember(&pending, signal) == 1 && libc::sigismember(mask, signal) == 0 }
    })
}

/// A blocked verbs reader polls the completion queue, its lock taken per round so other
/// threads keep using the socket, until there is news or the budget
/// ([`poll_budget`]) is spent. Signals are held back meanwhile (the caller's
/// mask is restored by the sleep that follows, or at once when news came): a signal that
/// arrives while we poll must still interrupt the sleep, as it would have interrupted the
/// call (`EINTR` for a handler without `SA_RESTART`); delivered at once, it would be gone
/// before the sleep and a program that breaks a blocking read with `alarm()` would hang.
fn poll_before_sleeping(index: u32) -> bool {
    for _ in 0..poll_budget() {
        match lock(index).as_mut() {
            Some(SanObject::Socket(socket)) => {
                if socket.poll_round() {
                    return true;
                }
            }
            _ => return true,
        }
        std::hint::spin_loop();
    }
    false
}

/// Whether every signal with a handler has `SA_RESTART` (then an interrupted blocking call is
/// restarted, whichever signal it was). Only asked after an `EINTR`.
fn every_handler_restarts() -> bool {
    // Faults are delivered to the faulting instruction, never to a sleeping poll (and the
    // Rust runtime installs SIGSEGV/SIGBUS handlers without SA_RESTART).
    const SYNCHRONOUS: [c_int; 6] = [
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGILL,
        libc::SIGFPE,
        libc::SIGTRAP,
        libc::SIGSYS,
    ];
    (1..=libc::SIGRTMAX()).all(|signal| {
        if SYNCHRONOUS.contains(&signal) {
            return true;
        }
        // SAFETY: plain data, zero is valid.
        let mut action: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: querying (not changing) the disposition into our struct.
        let rc = unsafe { libc::sigaction(signal, core::ptr::null(), &mut action) };
        rc != 0
            || action.sa_sigaction == libc::SIG_DFL
            || action.sa_sigaction == libc::SIG_IGN
            || action.sa_flags & libc::SA_RESTART != 0
    })
}
