//! The real functions: one slot per hooked symbol, resolved once.
//!
//! [`resolve_all`] runs in the library's constructor and fills every slot with
//! `dlsym(RTLD_NEXT, name)`. After that a hook path never calls `dlsym`: a slot is either a
//! function pointer or `MISSING` (the C library lacks the symbol, e.g. `epoll_pwait2` before
//! glibc 2.35), and a missing function fails with `ENOSYS`, which is what glibc's own stubs do.
//!
//! **Pre-init path.** Another library's constructor may run before ours (a `DT_NEEDED` library
//! of the program is initialised before an `LD_PRELOAD`ed one) and call `socket()`. A slot that
//! is still empty is then resolved on first use, for that one symbol, by the same
//! `dlsym(RTLD_NEXT, …)`; the store is idempotent (every racer computes the same pointer), so the
//! one-time guard is the slot itself. This is the only place besides the constructor that
//! calls `dlsym`, and it can only run before the constructor has finished.
//!
//! A resolution that lands inside this library (which would recurse forever) is refused and
//! counted in [`self_resolved_count`]; the call then fails with `ENOSYS` instead of hanging.

use core::ffi::c_void;
use core::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use crate::errno;

/// A [`RealFn`] pointer meaning "resolved, and the C library has no such symbol".
const MISSING: *mut c_void = core::ptr::dangling_mut::<c_void>();

static SELF_RESOLVED: AtomicUsize = AtomicUsize::new(0);

/// Number of symbols whose `dlsym(RTLD_NEXT)` resolution pointed back into this library.
pub fn self_resolved_count() -> usize {
    SELF_RESOLVED.load(Ordering::Relaxed)
}

/// One real function: the resolved pointer and its NUL-terminated name.
///
/// `repr(C)` with the pointer first: the cdylib's `vfork` trampoline loads it from offset 0.
#[repr(C)]
pub struct RealFn {
    ptr: AtomicPtr<c_void>,
    name: &'static str,
}

impl RealFn {
    const fn new(nul_terminated_name: &'static str) -> Self {
        Self {
            ptr: AtomicPtr::new(core::ptr::null_mut()),
            name: nul_terminated_name,
        }
    }

    /// The symbol name, without the terminating NUL.
    pub fn name(&self) -> &'static str {
        self.name.trim_end_matches('\0')
    }

    /// The function pointer, or `None` when the C library lacks the symbol.
    #[inline(always)]
    pub fn get(&self) -> Option<*mut c_void> {
        let ptr = self.ptr.load(Ordering::Acquire);
        if ptr as usize > MISSING as usize {
            return Some(ptr);
        }
        self.get_cold(ptr)
    }

    #[cold]
    #[inline(never)]
    fn get_cold(&self, ptr: *mut c_void) -> Option<*mut c_void> {
        if ptr == MISSING {
            return None;
        }
        // Pre-init path (see the module docs): resolve this one symbol now.
        let resolved = self.resolve();
        (resolved != MISSING).then_some(resolved)
    }

    /// Resolves the slot with `dlsym(RTLD_NEXT, …)` and stores the result (or [`MISSING`]).
    fn resolve(&self) -> *mut c_void {
        // SAFETY: `name` is a NUL-terminated static string (checked by `slot_names_are_c_strings`).
        let found = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr().cast()) };
        let value = if found.is_null() {
            MISSING
        } else if points_into_this_library(found) {
            SELF_RESOLVED.fetch_add(1, Ordering::Relaxed);
            MISSING
        } else {
            found
        };
        self.ptr.store(value, Ordering::Release);
        value
    }

    /// True once the slot holds its final value (a pointer or `MISSING`).
    pub fn is_resolved(&self) -> bool {
        !self.ptr.load(Ordering::Acquire).is_null()
    }

    /// True when the C library provides the symbol (resolving it if needed).
    pub fn is_available(&self) -> bool {
        self.get().is_some()
    }
}

/// True when `addr` lies in the shared object (or executable) that contains this code.
fn points_into_this_library(addr: *mut c_void) -> bool {
    let own_base = object_base(points_into_this_library as *const c_void);
    own_base.is_some() && object_base(addr) == own_base
}

/// The file this library was loaded from, as the dynamic linker names it (`None` when it
/// cannot say).
pub fn own_path() -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    let info = object_info(own_path as *const c_void)?;
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated name owned by the dynamic linker for the library's lifetime.
    let name = unsafe { core::ffi::CStr::from_ptr(info.dli_fname) };
    Some(std::ffi::OsStr::from_bytes(name.to_bytes()).into())
}

fn object_base(addr: *const c_void) -> Option<usize> {
    object_info(addr).map(|info| info.dli_fbase as usize)
}

/// What `dladdr` says of the object containing `addr`.
fn object_info(addr: *const c_void) -> Option<libc::Dl_info> {
    let mut info = core::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only writes into `info`; any address is acceptable input.
    let found = unsafe { libc::dladdr(addr, info.as_mut_ptr()) };
    // SAFETY: dladdr returned non-zero, so it filled `info` (it was zeroed before anyway).
    (found != 0).then(|| unsafe { info.assume_init() })
}

/// Resolves every slot (idempotent). Called from the constructor before anything else.
pub fn resolve_all() {
    for slot in ALL_SLOTS {
        if !slot.is_resolved() {
            slot.resolve();
        }
    }
}

/// Every slot, in table order.
pub fn all_slots() -> &'static [&'static RealFn] {
    ALL_SLOTS
}

/// Return types of hooked functions: what "failed" looks like.
pub trait HookReturn: Copy {
    /// The failure value (`-1`, or null for a pointer).
    const FAILED: Self;
}
impl HookReturn for i32 {
    const FAILED: Self = -1;
}
impl HookReturn for isize {
    const FAILED: Self = -1;
}
/// `syscall`'s `long`.
impl HookReturn for i64 {
    const FAILED: Self = -1;
}
/// `signal` and its relatives: `SIG_ERR`.
impl HookReturn for usize {
    const FAILED: Self = libc::SIG_ERR;
}
/// `popen`: a null stream.
impl HookReturn for *mut libc::FILE {
    const FAILED: Self = core::ptr::null_mut();
}

#[cold]
fn missing<R: HookReturn>() -> R {
    errno::set(libc::ENOSYS);
    R::FAILED
}

/// The function-pointer type of a table entry (variadic when the entry has a `; vararg`).
macro_rules! fn_ptr_type {
    ($ret:ty; ($($ty:ty),*)) => { unsafe extern "C" fn($($ty),*) -> $ret };
    ($ret:ty; ($($ty:ty),*); $($vty:ty),+) => { unsafe extern "C" fn($($ty),*, ...) -> $ret };
}

/// Compile-time proof that the table's signature is the `libc` crate's.
macro_rules! check_signature {
    (libc $name:ident, $fn_type:ty) => {
        // `libc` deprecates vfork (unsafe to call from Rust); only its type is used here.
        #[allow(deprecated)]
        const _: $fn_type = ::libc::$name;
    };
    (glibc $name:ident, $fn_type:ty) => {};
}

macro_rules! define_real {
    ($( $disp:ident $check:ident $export:ident $note:literal
        fn $name:ident($($arg:ident: $ty:ty),* $(; $($va:ident: $vty:ty),+)?) -> $ret:ty; )*) => {
        /// The slots, one per hooked symbol, named after it.
        #[allow(non_upper_case_globals)]
        pub mod slot {
            $( #[doc = concat!("The real `", stringify!($name), "`.")]
               pub static $name: super::RealFn = super::RealFn::new(concat!(stringify!($name), "\0")); )*
        }

        static ALL_SLOTS: &[&RealFn] = &[$(&slot::$name),*];

        $(
            check_signature!($check $name, fn_ptr_type!($ret; ($($ty),*) $(; $($vty),+)?));

            #[doc = concat!("Calls the real `", stringify!($name), "` (`ENOSYS` if the C library lacks it).")]
            ///
            /// # Safety
            /// Exactly the C function's contract.
            #[inline(always)]
            pub unsafe fn $name($($arg: $ty),* $($(, $va: $vty)+)?) -> $ret {
                let Some(ptr) = slot::$name.get() else { return missing() };
                // SAFETY: the slot holds the address dlsym returned for this very symbol, whose
                // C type the table states (checked against `libc` where it declares it).
                let real = unsafe {
                    core::mem::transmute::<*mut c_void, fn_ptr_type!($ret; ($($ty),*) $(; $($vty),+)?)>(ptr)
                };
                // SAFETY: forwarded contract of the caller.
                unsafe { real($($arg),* $($(, $va)+)?) }
            }
        )*
    };
}

crate::sandirect_hook_table!(define_real);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_c_strings() {
        for slot in all_slots() {
            assert!(slot.name.ends_with('\0'), "{}", slot.name);
            assert_eq!(slot.name.matches('\0').count(), 1);
        }
    }

    #[test]
    fn every_glibc_236_symbol_resolves_outside_this_object() {
        resolve_all();
        for slot in all_slots() {
            assert!(slot.is_resolved(), "{}", slot.name());
            assert!(slot.is_available(), "glibc here lacks {}", slot.name());
        }
        assert_eq!(self_resolved_count(), 0);
    }

    #[test]
    fn real_calls_reach_the_kernel_and_keep_errno() {
        // SAFETY: closing an fd number that is certainly not open.
        let rc = unsafe { close(-1) };
        assert_eq!(rc, -1);
        assert_eq!(errno::get(), libc::EBADF);
        // SAFETY: plain socket creation; the fd is closed below.
        let fd = unsafe { socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        assert!(fd >= 0);
        // SAFETY: variadic call with an integer third argument, as glibc reads it.
        let fl = unsafe { fcntl(fd, libc::F_GETFD, 0) };
        assert_eq!(fl & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
        // SAFETY: fd is ours.
        assert_eq!(unsafe { close(fd) }, 0);
    }
}
