//! The fault handler, and the application's dispositions of SIGSEGV and SIGBUS behind it.
//!
//! Everything a signal handler runs here is small on the stack: the application's handler
//! may run on its alternate stack (a few KiB), above our frames, and may call `sigaction`
//! there (the Rust runtime's handler resets the default so the fault kills). So the kernel is
//! spoken to by its own `rt_sigaction` and `rt_sigprocmask` (32-byte actions, 8-byte masks),
//! and glibc's 152-byte `struct sigaction` appears only where the application hands one over.

use core::ffi::{c_int, c_void};
use core::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use crate::real;

/// `SA_RESTORER` (x86-64): glibc's `sigaction` adds it, with its restorer, to every setting.
const SA_RESTORER: c_int = 0x0400_0000;
/// The flags the kernel keeps of a setting (`UAPI_SA_FLAGS`, since Linux 5.11): it clears
/// the others, and reports only these.
const KERNEL_FLAGS: c_int = libc::SA_NOCLDSTOP
    | libc::SA_NOCLDWAIT
    | libc::SA_SIGINFO
    | libc::SA_ONSTACK
    | libc::SA_RESTART
    | libc::SA_NODEFER
    | libc::SA_RESETHAND
    | 0x0800 // SA_EXPOSE_TAGBITS
    | SA_RESTORER;
/// The flags of the application's setting our own handler takes over, so that the
/// application's handler runs as the kernel would have run it.
const MIRRORED_FLAGS: c_int = libc::SA_ONSTACK | libc::SA_RESTART | libc::SA_NODEFER;
/// glibc's `SA_INTERRUPT` (its `sysv_signal` sets it; the kernel drops it).
const SA_INTERRUPT: c_int = 0x2000_0000;

/// One disposition as the kernel holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Disposition {
    /// `sa_handler` / `sa_sigaction`.
    pub handler: usize,
    /// `sa_flags`, as the kernel keeps them.
    pub flags: c_int,
    /// `sa_restorer`.
    pub restorer: usize,
    /// The first 64 signals of `sa_mask` (all the kernel has).
    pub mask: u64,
}

impl Disposition {
    const DEFAULT: Disposition = Disposition {
        handler: libc::SIG_DFL,
        flags: 0,
        restorer: 0,
        mask: 0,
    };

    /// What the kernel holds after glibc's `sigaction` of `handler`, `flags` and `mask`:
    /// glibc adds its restorer, the kernel drops flags it does not know and never blocks
    /// `SIGKILL` or `SIGSTOP`.
    fn as_set(handler: usize, flags: c_int, mask: u64) -> Disposition {
        Disposition {
            handler,
            flags: (flags | SA_RESTORER) & KERNEL_FLAGS,
            restorer: GLIBC_RESTORER.load(Ordering::Relaxed),
            mask: mask & !(bit(libc::SIGKILL) | bit(libc::SIGSTOP)),
        }
    }

    fn from_kernel(action: &KernelAction) -> Disposition {
        Disposition {
            handler: action.handler,
            // NOTE(cast): the kernel's flags are the 32 bits glibc reports.
            flags: action.flags as u32 as c_int,
            restorer: action.restorer,
            mask: action.mask,
        }
    }
}

fn bit(signal: c_int) -> u64 {
    1u64 << (signal - 1)
}

/// The first word of a glibc `sigset_t` (the kernel's set).
fn first_word(set: *const libc::sigset_t) -> u64 {
    // SAFETY: a sigset_t is at least 8 bytes of plain data (glibc: 128), `set` points to one.
    unsafe { set.cast::<u64>().read_unaligned() }
}

// ---- the kernel's own calls ---------------------------------------------------------------

/// The kernel's `struct sigaction` for `rt_sigaction` (x86-64: handler, flags, restorer,
/// then the mask, 8 bytes of it).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
struct KernelAction {
    handler: usize,
    flags: u64,
    restorer: usize,
    mask: u64,
}

/// A raw system call with three arguments and the kernel's sigset size (8) as the fourth:
/// 0 or `-errno`. Raw, not through `libc::syscall`, which the preload itself hooks.
///
/// # Safety
/// The arguments must be what system call `number` expects.
unsafe fn syscall_with_sigset(number: isize, first: isize, second: usize, third: usize) -> isize {
    #[cfg(target_arch = "x86_64")]
    {
        let ret: isize;
        // SAFETY: a system call with the caller's arguments; it clobbers rcx and r11 only.
        unsafe {
            core::arch::asm!(
                "syscall",
                inlateout("rax") number => ret,
                in("rdi") first,
                in("rsi") second,
                in("rdx") third,
                in("r10") 8usize,
                lateout("rcx") _,
                lateout("r11") _,
                options(nostack),
            );
        }
        ret
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (number, first, second, third);
        -(libc::ENOSYS as isize)
    }
}

/// `rt_sigaction(signal, act, old, 8)`: 0 or `-errno`.
///
/// # Safety
/// `act` and `old` are null or valid.
unsafe fn rt_sigaction(signal: c_int, act: *const KernelAction, old: *mut KernelAction) -> isize {
    // SAFETY: rt_sigaction (13) reads `act` and writes `old`, each null or valid.
    unsafe { syscall_with_sigset(13, signal as isize, act as usize, old as usize) }
}

/// `rt_sigprocmask(how, set, old, 8)` of the calling thread.
///
/// # Safety
/// `set` and `old` are null or valid.
unsafe fn rt_sigprocmask(how: c_int, set: *const u64, old: *mut u64) -> isize {
    // SAFETY: rt_sigprocmask (14) reads `set` and writes `old`, each null or valid.
    unsafe { syscall_with_sigset(14, how as isize, set as usize, old as usize) }
}

// ---- the record ---------------------------------------------------------------------------

/// One recorded disposition: two slots, the published one (`generation & 1`) never written.
struct Record {
    generation: AtomicUsize,
    slots: [Slot; 2],
}

struct Slot {
    handler: AtomicUsize,
    flags: AtomicU64,
    restorer: AtomicUsize,
    mask: AtomicU64,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            handler: AtomicUsize::new(libc::SIG_DFL),
            flags: AtomicU64::new(0),
            restorer: AtomicUsize::new(0),
            mask: AtomicU64::new(0),
        }
    }
}

impl Record {
    const fn new() -> Record {
        Record {
            generation: AtomicUsize::new(0),
            slots: [Slot::new(), Slot::new()],
        }
    }

    /// The published disposition. Lock-free (a signal handler reads it): a slot is written
    /// only while the other one is published, so a read is torn only if two writes completed
    /// meanwhile, which the generation shows; bounded, the last read stands.
    fn read(&self) -> Disposition {
        let mut read = Disposition::DEFAULT;
        for _ in 0..8 {
            let generation = self.generation.load(Ordering::Acquire);
            let slot = &self.slots[generation & 1];
            read = Disposition {
                handler: slot.handler.load(Ordering::Relaxed),
                // NOTE(cast): stored from a c_int.
                flags: slot.flags.load(Ordering::Relaxed) as u32 as c_int,
                restorer: slot.restorer.load(Ordering::Relaxed),
                mask: slot.mask.load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            if self.generation.load(Ordering::Relaxed) == generation {
                break;
            }
        }
        read
    }

    /// Publishes `value` (the writer lock held).
    fn write(&self, value: Disposition) {
        let generation = self.generation.load(Ordering::Relaxed);
        let slot = &self.slots[(generation + 1) & 1];
        slot.handler.store(value.handler, Ordering::Relaxed);
        slot.flags
            .store(u64::from(value.flags as u32), Ordering::Relaxed);
        slot.restorer.store(value.restorer, Ordering::Relaxed);
        slot.mask.store(value.mask, Ordering::Relaxed);
        self.generation.store(generation + 1, Ordering::Release);
    }
}

/// The application's dispositions of SIGSEGV and SIGBUS while our handler is installed.
static RECORDS: [Record; 2] = [Record::new(), Record::new()];
/// Per signal: `siginterrupt(sig, 1)` is in force (glibc's `signal` then omits `SA_RESTART`).
static INTERRUPTS: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
/// glibc's restorer (learnt when our handler went in through glibc's `sigaction`).
static GLIBC_RESTORER: AtomicUsize = AtomicUsize::new(0);

const NOT_INSTALLED: u8 = 0;
/// [`arm`] is installing (it holds the writer lock).
const ARMING: u8 = 1;
const INSTALLED: u8 = 2;
/// Whether our handler is installed.
static STATE: AtomicU8 = AtomicU8::new(NOT_INSTALLED);
/// The writer lock (see the module docs).
static WRITER: AtomicBool = AtomicBool::new(false);

fn record_index(signal: c_int) -> Option<usize> {
    match signal {
        libc::SIGSEGV => Some(0),
        libc::SIGBUS => Some(1),
        _ => None,
    }
}

const SIGNALS: [c_int; 2] = [libc::SIGSEGV, libc::SIGBUS];

/// Whether our fault handler is installed.
pub fn installed() -> bool {
    STATE.load(Ordering::Acquire) == INSTALLED
}

/// The writer lock, with every signal blocked while it is held (so no handler on this thread
/// can wait for it).
struct WriterLock {
    mask: u64,
}

impl WriterLock {
    fn take() -> WriterLock {
        let all = !0u64;
        let mut mask = 0u64;
        // SAFETY: our own masks.
        unsafe { rt_sigprocmask(libc::SIG_BLOCK, &all, &mut mask) };
        // Held only for a few system calls by a thread no signal can interrupt.
        while WRITER
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            // SAFETY: plain sched_yield(2).
            unsafe { libc::sched_yield() };
        }
        WriterLock { mask }
    }
}

impl Drop for WriterLock {
    fn drop(&mut self) {
        WRITER.store(false, Ordering::Release);
        // SAFETY: restores the thread's own mask.
        unsafe { rt_sigprocmask(libc::SIG_SETMASK, &self.mask, core::ptr::null_mut()) };
    }
}

// ---- installing ---------------------------------------------------------------------------

/// Installs the fault handler for SIGSEGV and SIGBUS, once per process (the first SAN
/// session calls it; later calls are one load). Each goes in by one exchange with what the
/// kernel held, which becomes the application's record: a setting the application makes
/// meanwhile lands before it (and is what the exchange returns) or after it (and the hook
/// that made it puts ours back, see `repair`).
pub fn arm() {
    if !cfg!(target_arch = "x86_64") || installed() {
        return;
    }
    let lock = WriterLock::take();
    if STATE.load(Ordering::Acquire) != NOT_INSTALLED {
        return;
    }
    STATE.store(ARMING, Ordering::Release);
    for (index, signal) in SIGNALS.into_iter().enumerate() {
        // Through glibc, which supplies its restorer: learnt here for our later settings.
        // SAFETY: plain data, zero is valid.
        let mut ours: libc::sigaction = unsafe { core::mem::zeroed() };
        ours.sa_sigaction = on_fault as *const () as usize;
        ours.sa_flags = libc::SA_SIGINFO;
        // SAFETY: as above.
        let mut previous: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: our own structs.
        if unsafe { real::sigaction(signal, &ours, &mut previous) } != 0 {
            continue;
        }
        let application = Disposition {
            handler: previous.sa_sigaction,
            flags: previous.sa_flags,
            restorer: previous.sa_restorer.map_or(0, |f| f as usize),
            mask: first_word(&previous.sa_mask),
        };
        RECORDS[index].write(application);
        let mut installed = KernelAction::default();
        // SAFETY: a query into our own struct.
        if unsafe { rt_sigaction(signal, core::ptr::null(), &mut installed) } == 0 {
            GLIBC_RESTORER.store(installed.restorer, Ordering::Relaxed);
        }
        install_ours(signal, application);
    }
    STATE.store(INSTALLED, Ordering::Release);
    drop(lock);
    tracing::debug!("fault handler installed for SIGSEGV and SIGBUS");
}

/// Puts our handler in for `signal` with `application`'s mask and mirrored flags.
fn install_ours(signal: c_int, application: Disposition) {
    let ours = KernelAction {
        handler: on_fault as *const () as usize,
        flags: u64::from(
            (libc::SA_SIGINFO | SA_RESTORER | (application.flags & MIRRORED_FLAGS)) as u32,
        ),
        restorer: GLIBC_RESTORER.load(Ordering::Relaxed),
        mask: application.mask,
    };
    // SAFETY: our own struct.
    unsafe { rt_sigaction(signal, &ours, core::ptr::null_mut()) };
}

/// After a setting the C library made for `signal` because our handler was not installed
/// yet: if [`arm`] ran meanwhile, that setting may have replaced ours; then it becomes the
/// record and ours goes back in.
fn repair(signal: c_int, index: usize) {
    if STATE.load(Ordering::Acquire) == NOT_INSTALLED {
        return;
    }
    // Waits for `arm` to finish.
    let _lock = WriterLock::take();
    let mut current = KernelAction::default();
    // SAFETY: a query into our own struct.
    if unsafe { rt_sigaction(signal, core::ptr::null(), &mut current) } != 0 {
        return;
    }
    if current.handler != on_fault as *const () as usize {
        let application = Disposition::from_kernel(&current);
        RECORDS[index].write(application);
        install_ours(signal, application);
    }
}

/// The fork child's copy of the writer lock is free: only the forking thread lives on, and it
/// held none (a writer blocks every signal and calls no fork). Async-signal-safe.
pub fn after_fork_in_child() {
    WRITER.store(false, Ordering::Release);
}

// ---- the handler --------------------------------------------------------------------------

/// The signal handler.
extern "C" fn on_fault(signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    // SAFETY: the kernel passes a valid siginfo_t and ucontext_t for an SA_SIGINFO handler.
    unsafe {
        if redirect_copy_fault(info, context) {
            return;
        }
        chain(signal, info, context);
    }
}

/// A fault of the copy routine: the context returns to its fixup with the faulting address.
///
/// # Safety
/// `info` and `context` are what the kernel passed to the handler.
#[inline(always)]
unsafe fn redirect_copy_fault(info: *mut libc::siginfo_t, context: *mut c_void) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if info.is_null() || context.is_null() {
            return false;
        }
        // SAFETY: the kernel's siginfo_t.
        let (code, address) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
        // A signal sent by a process (`kill`, `sigqueue`, `tgkill`) has `si_code <= 0`: it
        // is the application's, wherever it found the thread.
        if code <= 0 {
            return false;
        }
        // SAFETY: the kernel's ucontext_t, ours to change before returning.
        let registers = unsafe { &mut (*context.cast::<libc::ucontext_t>()).uc_mcontext.gregs };
        let (start, end, fixup) = super::guarded::routine::addresses();
        let ip = registers[libc::REG_RIP as usize] as usize;
        if !(start..end).contains(&ip) {
            return false;
        }
        registers[libc::REG_RDX as usize] = address as i64;
        registers[libc::REG_RIP as usize] = fixup as i64;
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (info, context);
        false
    }
}

/// A fault (or signal) that is not ours goes to the application's disposition.
///
/// # Safety
/// The arguments are what the kernel passed to the handler.
#[inline(always)]
unsafe fn chain(signal: c_int, info: *mut libc::siginfo_t, context: *mut c_void) {
    let Some(index) = record_index(signal) else {
        return;
    };
    let application = RECORDS[index].read();
    // SAFETY: the kernel's siginfo_t (or null).
    let sent = info.is_null() || unsafe { (*info).si_code } <= 0;
    match application.handler {
        libc::SIG_IGN if sent => {}
        libc::SIG_DFL | libc::SIG_IGN => {
            // The default action: the kernel's disposition goes back to it, and the faulting
            // instruction runs again on return (the kernel does not let a process ignore a
            // fault), or a sent signal is sent again; either kills the process as it would
            // have died without us.
            let default = KernelAction::default();
            // SAFETY: setting the default disposition; our struct.
            unsafe { rt_sigaction(signal, &default, core::ptr::null_mut()) };
            if sent {
                // SAFETY: plain raise(3); delivered once this handler returns.
                unsafe { libc::raise(signal) };
            }
        }
        handler => {
            if application.flags & libc::SA_RESETHAND != 0 {
                // As the kernel does on delivery: later faults take the default.
                let _lock = WriterLock::take();
                RECORDS[index].write(Disposition {
                    handler: libc::SIG_DFL,
                    ..application
                });
            }
            if application.flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the application installed this address as an SA_SIGINFO handler.
                let run = unsafe {
                    core::mem::transmute::<
                        usize,
                        extern "C" fn(c_int, *mut libc::siginfo_t, *mut c_void),
                    >(handler)
                };
                run(signal, info, context);
            } else {
                // SAFETY: the application installed this address as a plain handler.
                let run = unsafe { core::mem::transmute::<usize, extern "C" fn(c_int)>(handler) };
                run(signal);
            }
        }
    }
}

// ---- the hooks' side: sigaction and glibc's other ways of setting a disposition -----------

/// A setting as glibc's callers make it: handler, flags, the kernel's part of the mask.
#[derive(Clone, Copy)]
struct Setting {
    handler: usize,
    flags: c_int,
    mask: u64,
}

/// Sets (when given) the disposition of `signal` and returns the previous one, as glibc's
/// `sigaction` would: the C library's call before our handler is installed, the record once
/// it is. `Err(errno)` when the C library refused.
fn apply(signal: c_int, index: usize, setting: Option<Setting>) -> Result<Disposition, c_int> {
    if !installed() {
        // SAFETY: plain data, zero is valid.
        let mut act: libc::sigaction = unsafe { core::mem::zeroed() };
        // SAFETY: as above.
        let mut previous: libc::sigaction = unsafe { core::mem::zeroed() };
        if let Some(setting) = setting {
            act.sa_sigaction = setting.handler;
            act.sa_flags = setting.flags;
            // SAFETY: the first word of our own set.
            unsafe {
                (&mut act.sa_mask as *mut libc::sigset_t)
                    .cast::<u64>()
                    .write_unaligned(setting.mask)
            };
        }
        let act_ptr = setting.map_or(core::ptr::null(), |_| &act as *const libc::sigaction);
        // SAFETY: our own structs.
        if unsafe { real::sigaction(signal, act_ptr, &mut previous) } != 0 {
            return Err(crate::errno::get());
        }
        if setting.is_some() {
            repair(signal, index);
        }
        return Ok(Disposition {
            handler: previous.sa_sigaction,
            flags: previous.sa_flags,
            restorer: previous.sa_restorer.map_or(0, |f| f as usize),
            mask: first_word(&previous.sa_mask),
        });
    }
    Ok(exchange(signal, index, setting))
}

/// Our handler installed: the record of `signal` becomes `setting` (when given; our handler
/// takes its mask and flags); the previous record.
fn exchange(signal: c_int, index: usize, setting: Option<Setting>) -> Disposition {
    let _lock = WriterLock::take();
    let old = RECORDS[index].read();
    if let Some(setting) = setting {
        let new = Disposition::as_set(setting.handler, setting.flags, setting.mask);
        RECORDS[index].write(new);
        if (new.flags & MIRRORED_FLAGS, new.mask) != (old.flags & MIRRORED_FLAGS, old.mask) {
            install_ours(signal, new);
        }
    }
    old
}

/// `sigaction(signal, act, oldact)` for SIGSEGV and SIGBUS: `None` for every other signal
/// (the caller makes the real call, nothing else happens here). Before our handler is
/// installed it is the C library's call (and a check, see `repair`); once installed, `act`
/// becomes the application's record (our handler takes its mask and flags) and `oldact`
/// gets the previous record, both as glibc and the kernel would have them.
///
/// # Safety
/// As the C function: `act` and `oldact` are null or valid. glibc reads and writes them in
/// user space, so a bad pointer faults, as it faults there (and before any lock is taken).
pub unsafe fn sigaction(
    signal: c_int,
    act: *const libc::sigaction,
    oldact: *mut libc::sigaction,
) -> Option<c_int> {
    let index = record_index(signal)?;
    if !installed() {
        // SAFETY: forwarded.
        let rc = unsafe { real::sigaction(signal, act, oldact) };
        if rc == 0 && !act.is_null() {
            repair(signal, index);
        }
        return Some(rc);
    }
    // SAFETY: the caller's struct, read field by field as glibc reads it.
    let setting = (!act.is_null()).then(|| unsafe {
        Setting {
            handler: (*act).sa_sigaction,
            flags: (*act).sa_flags,
            mask: first_word(core::ptr::addr_of!((*act).sa_mask)),
        }
    });
    let old = exchange(signal, index, setting);
    if !oldact.is_null() {
        // SAFETY: the caller's struct, written field by field as glibc writes it (the rest
        // of the mask, which the kernel does not have, empty).
        unsafe {
            (*oldact).sa_sigaction = old.handler;
            let mask = core::ptr::addr_of_mut!((*oldact).sa_mask).cast::<u8>();
            core::ptr::write_bytes(mask, 0, core::mem::size_of::<libc::sigset_t>());
            mask.cast::<u64>().write_unaligned(old.mask);
            (*oldact).sa_flags = old.flags;
            (*oldact).sa_restorer =
                core::mem::transmute::<usize, Option<extern "C" fn()>>(old.restorer);
        }
    }
    Some(0)
}

/// The record of `signal` (SIGSEGV or SIGBUS) while our handler is installed.
pub fn recorded(signal: c_int) -> Option<Disposition> {
    let index = record_index(signal)?;
    installed().then(|| RECORDS[index].read())
}

/// A handler set the way glibc's wrappers set it: the previous handler, or `SIG_ERR` (errno
/// set).
fn set_handler(signal: c_int, index: usize, setting: Setting) -> libc::sighandler_t {
    match apply(signal, index, Some(setting)) {
        Ok(previous) => previous.handler,
        Err(errno) => {
            crate::errno::set(errno);
            libc::SIG_ERR
        }
    }
}

/// glibc's `signal` (also `bsd_signal`, `ssignal`) for SIGSEGV and SIGBUS: the handler with
/// its own signal masked, restarting system calls unless [`siginterrupt`] said otherwise.
/// `None`: another signal.
pub fn bsd_signal(signal: c_int, handler: libc::sighandler_t) -> Option<libc::sighandler_t> {
    let index = record_index(signal)?;
    if handler == libc::SIG_ERR {
        crate::errno::set(libc::EINVAL);
        return Some(libc::SIG_ERR);
    }
    let flags = if INTERRUPTS[index].load(Ordering::Relaxed) {
        0
    } else {
        libc::SA_RESTART
    };
    Some(set_handler(
        signal,
        index,
        Setting {
            handler,
            flags,
            mask: bit(signal),
        },
    ))
}

/// glibc's `sysv_signal` for SIGSEGV and SIGBUS: a one-shot handler that does not mask its
/// signal and interrupts system calls. `None`: another signal.
pub fn sysv_signal(signal: c_int, handler: libc::sighandler_t) -> Option<libc::sighandler_t> {
    let index = record_index(signal)?;
    if handler == libc::SIG_ERR {
        crate::errno::set(libc::EINVAL);
        return Some(libc::SIG_ERR);
    }
    // glibc's SA_ONESHOT | SA_NOMASK | SA_INTERRUPT.
    let flags = libc::SA_RESETHAND | libc::SA_NODEFER | SA_INTERRUPT;
    Some(set_handler(
        signal,
        index,
        Setting {
            handler,
            flags,
            mask: 0,
        },
    ))
}

/// glibc's `sigset` (System V) for SIGSEGV and SIGBUS: `SIG_HOLD` blocks the signal and
/// reports its handler; any other disposition is set (no mask, no flags) and the signal
/// unblocked. The previous handler, or `SIG_HOLD` when the signal was blocked. `None`:
/// another signal.
pub fn sigset(signal: c_int, disposition: libc::sighandler_t) -> Option<libc::sighandler_t> {
    /// `SIG_HOLD` (Linux).
    const SIG_HOLD: usize = 2;
    let index = record_index(signal)?;
    let one = bit(signal);
    let mut before = 0u64;
    if disposition == SIG_HOLD {
        // SAFETY: our own masks.
        unsafe { rt_sigprocmask(libc::SIG_BLOCK, &one, &mut before) };
        if before & one != 0 {
            return Some(SIG_HOLD);
        }
        return Some(match apply(signal, index, None) {
            Ok(previous) => previous.handler,
            Err(errno) => {
                crate::errno::set(errno);
                libc::SIG_ERR
            }
        });
    }
    let previous = set_handler(
        signal,
        index,
        Setting {
            handler: disposition,
            flags: 0,
            mask: 0,
        },
    );
    if previous == libc::SIG_ERR {
        return Some(libc::SIG_ERR);
    }
    // SAFETY: our own masks.
    unsafe { rt_sigprocmask(libc::SIG_UNBLOCK, &one, &mut before) };
    Some(if before & one != 0 {
        SIG_HOLD
    } else {
        previous
    })
}

/// glibc's `sigignore` for SIGSEGV and SIGBUS. `None`: another signal.
pub fn sigignore(signal: c_int) -> Option<c_int> {
    let index = record_index(signal)?;
    let setting = Setting {
        handler: libc::SIG_IGN,
        flags: 0,
        mask: 0,
    };
    Some(if set_handler(signal, index, setting) == libc::SIG_ERR {
        -1
    } else {
        0
    })
}

/// glibc's `siginterrupt` for SIGSEGV and SIGBUS: the disposition's `SA_RESTART` changes,
/// and so does what our `signal` sets later. `None`: another signal.
pub fn siginterrupt(signal: c_int, interrupt: bool) -> Option<c_int> {
    let index = record_index(signal)?;
    let mut current = match apply(signal, index, None) {
        Ok(current) => current,
        Err(errno) => {
            crate::errno::set(errno);
            return Some(-1);
        }
    };
    if interrupt {
        current.flags &= !libc::SA_RESTART;
    } else {
        current.flags |= libc::SA_RESTART;
    }
    INTERRUPTS[index].store(interrupt, Ordering::Relaxed);
    let setting = Setting {
        handler: current.handler,
        flags: current.flags,
        mask: current.mask,
    };
    Some(match apply(signal, index, Some(setting)) {
        Ok(_) => 0,
        Err(errno) => {
            crate::errno::set(errno);
            -1
        }
    })
}

// ---- exec ---------------------------------------------------------------------------------

/// Before an exec: the kernel resets handled signals to the default in the new image, but
/// keeps ignored ones ignored; a fault signal the application ignores is set ignored in the
/// kernel for the exec, and our handler put back if the exec fails ([`Drop`]).
pub struct ExecDispositions {
    ignored: [bool; 2],
}

impl ExecDispositions {
    /// Sets the ignored ones (nothing without our handler).
    pub fn prepare() -> ExecDispositions {
        let mut ignored = [false; 2];
        if !installed() {
            return ExecDispositions { ignored };
        }
        for (index, signal) in SIGNALS.into_iter().enumerate() {
            if RECORDS[index].read().handler == libc::SIG_IGN {
                let ignore = KernelAction {
                    handler: libc::SIG_IGN,
                    ..KernelAction::default()
                };
                // SAFETY: setting SIG_IGN; our struct.
                unsafe { rt_sigaction(signal, &ignore, core::ptr::null_mut()) };
                ignored[index] = true;
            }
        }
        ExecDispositions { ignored }
    }
}

impl Drop for ExecDispositions {
    fn drop(&mut self) {
        for (index, signal) in SIGNALS.into_iter().enumerate() {
            if self.ignored[index] {
                install_ours(signal, RECORDS[index].read());
            }
        }
    }
}
