//! Copies of the application's buffers that answer "bad address" (`EFAULT`) instead of
//! crashing, and the `SIGSEGV`/`SIGBUS` handler that makes them so.
//!
//! The kernel answers `EFAULT` when a system call's buffer is memory the process may not
//! access: it learns so by faulting in its own copy routine, whose faults its exception table
//! turns into an error return. The SAN path copies the application's bytes in user space, so
//! it does the same: every copy of application memory goes through [`copy`], one small
//! routine written in assembly whose instructions are known. A fault inside them reaches our
//! handler, which moves the instruction pointer to the routine's fixup (the routine then
//! returns "faulted at this address") and returns. A copy that does not fault costs what a
//! `memcpy` costs: checking every buffer beforehand would cost a system call per call.
//!
//! **Installed at the first SAN session of the process** ([`arm`]): a process that never
//! switches a connection is untouched. Any other fault goes on to the disposition the
//! application set, exactly: its `SA_SIGINFO` handler with the same `siginfo_t` and context
//! (which it may change), or its plain handler; for the default, and for an ignored fault
//! (which the kernel does not let a process ignore), the default is restored and the faulting
//! instruction runs again, so the process dies of the same signal, with its core. A signal
//! another process sent (`kill`) is told apart by its `si_code` and never taken for one of
//! ours. Our handler is installed with the application's mask and its `SA_ONSTACK`,
//! `SA_RESTART` and `SA_NODEFER`, so the application's handler runs as the kernel would run
//! it (on its alternate stack, with its mask).
//!
//! **Later settings of the two signals** by the application (`sigaction`, `signal` and glibc's
//! other forms of it: see the hook table) are recorded, not applied: the kernel keeps our
//! handler, the record holds what the kernel would hold (the flags as the kernel keeps them,
//! glibc's restorer, the mask without `SIGKILL` and `SIGSTOP`), and queries answer from it.
//! Every other signal goes straight to the C library, and so do these two before the first
//! session (then one load more: see `dispositions` for how a setting racing the installation
//! is kept).
//!
//! **Async-signal-safety.** The handler reads the record without a lock (two slots: writers
//! fill the one not published, then publish it with a generation count the reader checks) and
//! calls only the kernel's `rt_sigaction`, `raise` and the chained handler, with little stack
//! (the application's handler may run on a small alternate stack above our frames). Writers
//! take a spin lock with every signal blocked, so no handler ever waits for its own thread. A
//! fork child starts with the lock free (only the forking thread survives, and it held none);
//! `exec` resets handled signals to the default, so an ignored fault signal is set ignored
//! again just before an exec ([`ExecDispositions`]).
//!
//! Other architectures than x86-64 copy plainly and install nothing: there a bad buffer still
//! crashes in our copy (the documented limit).

mod dispositions;
mod guarded;

pub use guarded::{copy, read_app, write_app, Fault};

pub use dispositions::{
    after_fork_in_child, arm, bsd_signal, installed, recorded, sigaction, sigignore, siginterrupt,
    sigset, sysv_signal, Disposition, ExecDispositions,
};

#[cfg(test)]
mod tests;
