//! # libsandirect.so — the exported hook table
//!
//! Only what must live in the shared object lives here: the exported functions (generated from
//! [`preload_core::sandirect_hook_table!`], each a one-line call into `preload_core::ops`), the
//! hand-written `vfork` trampoline, and the constructor/destructor entries. All logic is in
//! `preload-core`.
//!
//! The exported set is exactly the hook table: rustc's cdylib version script exports only
//! `#[no_mangle]` items, and `.ci/check-exports.sh` diffs `nm -D --defined-only` against the
//! inventory (`sandirect symbols --names`).

use core::ffi::{c_char, c_int, CStr};

macro_rules! define_exports {
    ($( $disp:ident $check:ident $export:ident $note:literal
        fn $name:ident($($arg:ident: $ty:ty),* $(; $($va:ident: $vty:ty),+)?) -> $ret:ty; )*) => {
        $( export_hook!($export $name ($($arg: $ty),* $($(, $va: $vty)+)?) -> $ret); )*
    };
}

macro_rules! export_hook {
    (generated $name:ident ($($arg:ident: $ty:ty),*) -> $ret:ty) => {
        #[doc = concat!("Interposed `", stringify!($name), "`.")]
        ///
        /// # Safety
        /// Exactly the C function's contract.
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // The exec calls still hand the stashes of the sockets a vfork child passes on
            // to the new image (reading the parent's state only).
            if preload_core::guard::in_vfork_child()
                && !matches!(stringify!($name), "execve" | "execv" | "execvp" | "execvpe" | "fexecve")
            {
                // The parent's state is not the child's to touch: the kernel call alone.
                // SAFETY: forwarded contract of the C caller.
                return unsafe { preload_core::real::$name($($arg),*) };
            }
            // SAFETY: forwarded contract of the C caller.
            unsafe { preload_core::ops::$name($($arg),*) }
        }
    };
    (handwritten $($rest:tt)*) => {};
}

preload_core::sandirect_hook_table!(define_exports);

/// `vfork`, as a frameless trampoline: a wrapper with a stack frame cannot survive vfork (the
/// child returns through the frame, then the parent resumes on the clobbered stack), and the
/// child must not run any Rust code. So this jumps straight to the real `vfork` with the
/// caller's own return address. Before our constructor has resolved it (a `vfork` from another
/// library's constructor), it falls back to fork semantics, which every correct vfork user
/// (exec or _exit in the child) tolerates.
///
/// # Safety
/// Exactly the C function's contract.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    core::arch::naked_asm!(
        "mov rax, qword ptr [rip + {slot}]",
        "cmp rax, 1",
        "jbe 2f",
        // The parent's preparation, as an ordinary call: at entry rsp is 8 mod 16 (our return
        // address), so 8 more bytes align the stack for it; the frame is gone before the jump.
        "sub rsp, 8",
        "call {before}",
        "add rsp, 8",
        "mov rax, qword ptr [rip + {slot}]",
        "jmp rax",
        "2:",
        "jmp {fallback}",
        slot = sym preload_core::real::slot::vfork,
        before = sym before_vfork,
        fallback = sym vfork_before_init,
    )
}

/// `vfork`: see the x86-64 version.
///
/// # Safety
/// Exactly the C function's contract.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    core::arch::naked_asm!(
        "adrp x16, {slot}",
        "ldr x16, [x16, :lo12:{slot}]",
        "cmp x16, #1",
        "b.ls 2f",
        // The parent's preparation, as an ordinary call (the link register saved around it).
        "stp x29, x30, [sp, #-16]!",
        "bl {before}",
        "ldp x29, x30, [sp], #16",
        "adrp x16, {slot}",
        "ldr x16, [x16, :lo12:{slot}]",
        "br x16",
        "2:",
        "b {fallback}",
        slot = sym preload_core::real::slot::vfork,
        before = sym before_vfork,
        fallback = sym vfork_before_init,
    )
}

/// `vfork` on other architectures: fork semantics (see the x86-64 version for why).
///
/// # Safety
/// Exactly the C function's contract.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
#[no_mangle]
pub unsafe extern "C" fn vfork() -> libc::pid_t {
    vfork_before_init()
}

/// Runs in the parent just before the real `vfork` (an ordinary call from the trampoline):
/// marks the thread (see `preload_core::guard::note_vfork`) and downgrades the SAN
/// connections the child could inherit.
extern "C" fn before_vfork() {
    preload_core::ops::before_vfork();
}

extern "C" fn vfork_before_init() -> libc::pid_t {
    // SAFETY: fork has no preconditions; the child continues like a vfork child that is
    // allowed to touch its own copy of memory.
    unsafe { preload_core::real::fork() }
}

/// glibc calls `.init_array` entries with `(argc, argv, envp)`; argv[0] names the program
/// for the config rules without touching `std::env` this early.
unsafe extern "C" fn constructor(
    argc: c_int,
    argv: *const *const c_char,
    _envp: *const *const c_char,
) {
    let argv0 = if argc > 0 && !argv.is_null() {
        // SAFETY: glibc passes the process's argv, argc > 0 entries long.
        let first = unsafe { *argv };
        // SAFETY: a non-null argv entry is a NUL-terminated string.
        (!first.is_null()).then(|| unsafe { CStr::from_ptr(first) })
    } else {
        None
    };
    preload_core::runtime::init(argv0);
}

extern "C" fn destructor() {
    preload_core::runtime::at_exit();
}

#[used]
#[link_section = ".init_array"]
static CONSTRUCTOR: unsafe extern "C" fn(c_int, *const *const c_char, *const *const c_char) =
    constructor;

#[used]
#[link_section = ".fini_array"]
static DESTRUCTOR: extern "C" fn() = destructor;
