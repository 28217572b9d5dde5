//! The guarded copy: one routine whose faults return "bad address" (see the parent module).

/// A guarded copy stopped at `address`, which the process may not access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The faulting address, as the kernel reported it.
    pub address: usize,
}

/// Copies `len` bytes from `src` to `dst`, where either may be memory the process cannot
/// access (the application's buffer): `Err` with the faulting address instead of a crash,
/// once [`arm`](super::arm) installed the handler. What was written before the fault is
/// unspecified.
///
/// # Safety
/// Neither range may be memory a live Rust reference other than the caller's own owns, and
/// the two may not overlap: `dst` is the caller's buffer (or the application's, handed over
/// to be written) and `src` is readable as far as the process is allowed to read it.
#[inline]
pub unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) -> Result<(), Fault> {
    if len == 0 {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: the routine copies `len` bytes from `src` to `dst` (the caller's contract)
        // and touches nothing else; a fault in it returns through the fixup.
        let outcome = unsafe { routine::sandirect_guarded_copy(dst, src, len) };
        if outcome.faulted != 0 {
            return Err(Fault {
                address: outcome.address,
            });
        }
        Ok(())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // SAFETY: the caller's contract; a bad address crashes here (the documented limit).
        unsafe { core::ptr::copy_nonoverlapping(src, dst, len) };
        Ok(())
    }
}

/// Reads a `T` from the application's memory at `from` (a struct it handed to a call):
/// `None` when the process may not read it.
///
/// # Safety
/// `T` is plain C data (every bit pattern is a valid value).
pub unsafe fn read_app<T: Copy>(from: *const T) -> Option<T> {
    let mut value = core::mem::MaybeUninit::<T>::uninit();
    // SAFETY: `value` is ours, `size_of::<T>()` bytes; `from` is the application's.
    unsafe {
        copy(
            value.as_mut_ptr().cast(),
            from.cast(),
            core::mem::size_of::<T>(),
        )
    }
    .ok()?;
    // SAFETY: every byte was written, and any bit pattern is a valid `T` (the contract).
    Some(unsafe { value.assume_init() })
}

/// Writes `value` into the application's memory at `to` (a struct it handed to a call to be
/// filled): `Err` when the process may not write there.
///
/// # Safety
/// `to` is the application's memory, handed over to be written.
pub unsafe fn write_app<T: Copy>(to: *mut T, value: T) -> Result<(), Fault> {
    // SAFETY: the caller's contract; `value` is ours.
    unsafe {
        copy(
            to.cast(),
            (&value as *const T).cast(),
            core::mem::size_of::<T>(),
        )
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod routine {
    //! The copy routine. `rdi` = destination, `rsi` = source, `rdx` = length (the System V
    //! argument registers); returns `rax` = 0, or 1 from the fixup with `rdx` = the faulting
    //! address the handler put there. Sizes below 64 bytes move in two overlapping loads and
    //! stores of the largest width that fits, 64 to 4095 bytes in 64-byte rounds of SSE2
    //! moves (every x86-64 has them) ending in one overlapping round, and from 4 KiB on by
    //! `rep movsb`, which the processor runs at full speed there. The stack is never touched,
    //! so the fixup's `ret` returns to the caller from any instruction. Every instruction
    //! from the entry to `sandirect_guarded_copy_end` may fault; nothing else in the process
    //! is redirected.
    core::arch::global_asm!(
        ".pushsection .text.sandirect_guarded_copy,\"ax\",@progbits",
        ".globl sandirect_guarded_copy",
        ".hidden sandirect_guarded_copy",
        ".type sandirect_guarded_copy,@function",
        ".globl sandirect_guarded_copy_end",
        ".hidden sandirect_guarded_copy_end",
        ".globl sandirect_guarded_copy_fixup",
        ".hidden sandirect_guarded_copy_fixup",
        ".p2align 4",
        "sandirect_guarded_copy:",
        "cmp rdx, 64",
        "jb 5f",
        "cmp rdx, 4096",
        "jae 9f",
        // 64 to 4095 bytes: 64 a round, then the last 64 (overlapping the previous round).
        "lea rcx, [rsi + rdx - 64]",
        "lea r8, [rdi + rdx - 64]",
        "2:",
        "movdqu xmm0, [rsi]",
        "movdqu xmm1, [rsi + 16]",
        "movdqu xmm2, [rsi + 32]",
        "movdqu xmm3, [rsi + 48]",
        "movdqu [rdi], xmm0",
        "movdqu [rdi + 16], xmm1",
        "movdqu [rdi + 32], xmm2",
        "movdqu [rdi + 48], xmm3",
        "add rsi, 64",
        "add rdi, 64",
        "cmp rsi, rcx",
        "jb 2b",
        "movdqu xmm0, [rcx]",
        "movdqu xmm1, [rcx + 16]",
        "movdqu xmm2, [rcx + 32]",
        "movdqu xmm3, [rcx + 48]",
        "movdqu [r8], xmm0",
        "movdqu [r8 + 16], xmm1",
        "movdqu [r8 + 32], xmm2",
        "movdqu [r8 + 48], xmm3",
        "xor eax, eax",
        "ret",
        // Below 64 bytes: the first and the last part of each width (they overlap).
        "5:",
        "cmp rdx, 32",
        "jb 6f",
        "movdqu xmm0, [rsi]",
        "movdqu xmm1, [rsi + 16]",
        "movdqu xmm2, [rsi + rdx - 32]",
        "movdqu xmm3, [rsi + rdx - 16]",
        "movdqu [rdi], xmm0",
        "movdqu [rdi + 16], xmm1",
        "movdqu [rdi + rdx - 32], xmm2",
        "movdqu [rdi + rdx - 16], xmm3",
        "xor eax, eax",
        "ret",
        "6:",
        "cmp rdx, 16",
        "jb 7f",
        "movdqu xmm0, [rsi]",
        "movdqu xmm1, [rsi + rdx - 16]",
        "movdqu [rdi], xmm0",
        "movdqu [rdi + rdx - 16], xmm1",
        "xor eax, eax",
        "ret",
        "7:",
        "cmp rdx, 8",
        "jb 8f",
        "mov rax, [rsi]",
        "mov rcx, [rsi + rdx - 8]",
        "mov [rdi], rax",
        "mov [rdi + rdx - 8], rcx",
        "xor eax, eax",
        "ret",
        "8:",
        "cmp rdx, 4",
        "jb 10f",
        "mov eax, [rsi]",
        "mov ecx, [rsi + rdx - 4]",
        "mov [rdi], eax",
        "mov [rdi + rdx - 4], ecx",
        "xor eax, eax",
        "ret",
        // 1 to 3 bytes (never 0: the caller returns first).
        "10:",
        "movzx eax, byte ptr [rsi]",
        "movzx ecx, byte ptr [rsi + rdx - 1]",
        "cmp rdx, 2",
        "jbe 11f",
        "movzx r8d, byte ptr [rsi + 1]",
        "mov [rdi + 1], r8b",
        "11:",
        "mov [rdi], al",
        "mov [rdi + rdx - 1], cl",
        "xor eax, eax",
        "ret",
        // 4 KiB and more.
        "9:",
        "mov rcx, rdx",
        "rep movsb",
        "xor eax, eax",
        "ret",
        "sandirect_guarded_copy_end:",
        "sandirect_guarded_copy_fixup:",
        "mov eax, 1",
        "ret",
        ".size sandirect_guarded_copy, . - sandirect_guarded_copy",
        ".popsection",
    );

    /// What the routine returns (`rax`, `rdx`).
    #[repr(C)]
    pub(super) struct Outcome {
        pub(super) faulted: usize,
        pub(super) address: usize,
    }

    extern "C" {
        pub(super) fn sandirect_guarded_copy(dst: *mut u8, src: *const u8, len: usize) -> Outcome;
        static sandirect_guarded_copy_end: u8;
        static sandirect_guarded_copy_fixup: u8;
    }

    /// The instructions that may fault, `[start, end)`, and the fixup's address.
    pub(crate) fn addresses() -> (usize, usize, usize) {
        (
            sandirect_guarded_copy as *const () as usize,
            core::ptr::addr_of!(sandirect_guarded_copy_end) as usize,
            core::ptr::addr_of!(sandirect_guarded_copy_fixup) as usize,
        )
    }
}
