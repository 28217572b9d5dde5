//! The symbol inventory, generated from the hook table: what is exported and what it does.
//!
//! `sandirect symbols` prints it (the README's coverage table), and `.ci/check-exports.sh`
//! diffs [`exported_names`] against `nm -D --defined-only libsandirect.so`.

use std::fmt::Write as _;

/// What the library does with a symbol.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum Disposition {
    /// Tracked today; will serve SAN sockets (connected TCP) from user space.
    Accelerate,
    /// Always the kernel's behaviour, for every fd.
    PassThrough,
    /// Kernel-only operation: a SAN socket used with it is downgraded to TCP.
    FallBack,
    /// Fails with an errno (reserved: no symbol has it today).
    Unsupported,
    /// The C library's call, except for the signals the library handles itself once a
    /// connection switched (SIGSEGV, SIGBUS): the application's setting is recorded and
    /// reported back as set, and runs behind the library's own handler.
    Chain,
}

impl Disposition {
    /// Table label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Accelerate => "accelerate",
            Self::PassThrough => "pass through",
            Self::FallBack => "fall back",
            Self::Unsupported => "unsupported (errno)",
            Self::Chain => "chain",
        }
    }
}

/// One exported symbol.
#[derive(Clone, Copy, Debug)]
pub struct HookInfo {
    /// Symbol name.
    pub name: &'static str,
    /// Disposition.
    pub disposition: Disposition,
    /// `true`: checked at compile time against the `libc` crate; `false`: from glibc headers.
    pub checked_against_libc: bool,
    /// Rust-syntax parameter list as written in the table.
    pub params: &'static str,
    /// Rust-syntax return type.
    pub ret: &'static str,
    /// True for C variadic functions.
    pub variadic: bool,
    /// What the hook does.
    pub note: &'static str,
}

impl HookInfo {
    /// A C-like rendering of the signature (types without the `::libc::` path).
    pub fn signature(&self) -> String {
        let clean = |text: &str| {
            let stripped = text.replace(":: libc ::", "").replace("::libc::", "");
            stripped
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
                .replace(" :", ":")
                .replace("* mut", "*mut")
                .replace("* const", "*const")
                .replace(" ,", ",")
        };
        let mut params = clean(self.params);
        if self.variadic {
            params = params.replacen(';', ", ...", 1);
            if let Some(cut) = params.find(", ...") {
                params.truncate(cut + 5);
            }
        }
        format!("{} {}({})", clean(self.ret), self.name, params)
    }
}

macro_rules! define_inventory {
    ($( $disp:ident $check:ident $export:ident $note:literal
        fn $name:ident($($arg:ident: $ty:ty),* $(; $($va:ident: $vty:ty),+)?) -> $ret:ty; )*) => {
        /// Every exported symbol, in table order.
        pub static INVENTORY: &[HookInfo] = &[$(
            HookInfo {
                name: stringify!($name),
                disposition: Disposition::$disp,
                checked_against_libc: matches!(stringify!($check).as_bytes(), b"libc"),
                params: stringify!($($arg: $ty),* $(; $($va: $vty),+)?),
                ret: stringify!($ret),
                variadic: false $(|| { let _ = stringify!($($va)+); true })?,
                note: $note,
            },
        )*];
    };
}

crate::sandirect_hook_table!(define_inventory);

/// The exported symbol names, sorted (what `nm -D --defined-only` must list).
pub fn exported_names() -> Vec<&'static str> {
    let mut names: Vec<_> = INVENTORY.iter().map(|hook| hook.name).collect();
    names.sort_unstable();
    names
}

/// The README coverage table (Markdown).
pub fn markdown_table() -> String {
    let mut out = String::from(
        "| symbol | disposition | signature source | what it does |\n|---|---|---|---|\n",
    );
    for hook in INVENTORY {
        let source = if hook.checked_against_libc {
            "libc crate (compile-time check)"
        } else {
            "glibc headers"
        };
        let _ = writeln!(
            out,
            "| `{}` | {} | {} | {} |",
            hook.signature(),
            hook.disposition.label(),
            source,
            hook.note
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inventory_covers_the_brief_and_has_no_duplicates() {
        let names = exported_names();
        let mut unique = names.clone();
        unique.dedup();
        assert_eq!(unique.len(), names.len());
        for required in [
            "socket",
            "socketpair",
            "bind",
            "listen",
            "accept",
            "accept4",
            "connect",
            "getsockname",
            "getpeername",
            "setsockopt",
            "getsockopt",
            "shutdown",
            "close",
            "close_range",
            "read",
            "readv",
            "write",
            "writev",
            "send",
            "sendto",
            "sendmsg",
            "sendmmsg",
            "recv",
            "recvfrom",
            "recvmsg",
            "recvmmsg",
            "sendfile",
            "sendfile64",
            "splice",
            "poll",
            "ppoll",
            "select",
            "pselect",
            "epoll_create",
            "epoll_create1",
            "epoll_ctl",
            "epoll_wait",
            "epoll_pwait",
            "epoll_pwait2",
            "fcntl",
            "fcntl64",
            "ioctl",
            "dup",
            "dup2",
            "dup3",
            "fork",
            "vfork",
            "execve",
            "execv",
            "execvp",
            "execvpe",
            "fexecve",
            "posix_spawn",
            "posix_spawnp",
            "system",
            "popen",
            "__read_chk",
            "__recv_chk",
            "__recvfrom_chk",
            "__poll_chk",
            "__ppoll_chk",
            "syscall",
            "fdopen",
            "sigaction",
            "__sigaction",
            "signal",
            "bsd_signal",
            "ssignal",
            "sysv_signal",
            "__sysv_signal",
            "sigset",
            "sigignore",
            "siginterrupt",
        ] {
            assert!(
                names.contains(&required),
                "{required} missing from the hook table"
            );
        }
        assert_eq!(names.len(), 73);
    }

    #[test]
    fn signatures_render_like_c() {
        let find = |name| INVENTORY.iter().find(|hook| hook.name == name).unwrap();
        assert_eq!(
            find("fcntl").signature(),
            "c_int fcntl(fd: c_int, cmd: c_int, ...)"
        );
        assert_eq!(
            find("syscall").signature(),
            "c_long syscall(number: c_long, ...)"
        );
        assert_eq!(find("close").signature(), "c_int close(fd: c_int)");
        assert_eq!(find("fork").signature(), "pid_t fork()");
        assert!(find("fcntl").variadic && !find("close").variadic);
        assert!(!find("__read_chk").checked_against_libc);
        assert!(find("read").checked_against_libc);
        assert_eq!(
            find("accept").signature(),
            "c_int accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t)"
        );
    }

    #[test]
    fn markdown_table_has_one_row_per_symbol() {
        let table = markdown_table();
        assert_eq!(table.lines().count(), INVENTORY.len() + 2);
        assert!(table.contains("| `c_int ioctl(fd: c_int, request: c_ulong, ...)` | accelerate |"));
    }
}
