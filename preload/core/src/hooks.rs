//! The hook table: the single declaration every interposed symbol is generated from.
//!
//! [`sandirect_hook_table!`](crate::sandirect_hook_table) hands the whole table to a callback
//! macro. Three callbacks consume it:
//!
//! * [`crate::real`] generates, per symbol, the `real::NAME` slot (resolved once in the
//!   constructor with `dlsym(RTLD_NEXT, …)`), a typed `real::NAME(…)` caller, and a
//!   compile-time proof that the table's signature equals `libc::NAME`'s;
//! * [`crate::inventory`] generates the symbol inventory (name, disposition, signature, note)
//!   that `sandirect symbols` prints and `.ci/check-exports.sh` diffs against `nm -D`;
//! * the `sandirect-preload` cdylib generates the exported `#[no_mangle] extern "C"` functions,
//!   each a one-line call into [`crate::ops`].
//!
//! Entry grammar (one per symbol):
//!
//! ```text
//! DISPOSITION CHECK EXPORT "note" fn NAME(arg: Type, …[; vararg: Type]) -> Ret;
//! ```
//!
//! * `DISPOSITION`: a [`crate::inventory::Disposition`] variant.
//! * `CHECK`: `libc` — the signature is checked against the `libc` crate's declaration;
//!   `glibc` — the `libc` crate does not declare it (FORTIFY entry points, `fcntl64`), the
//!   signature is taken from glibc's headers and its `debug/` sources.
//! * `EXPORT`: `generated` — the cdylib generates the export; `handwritten` — the cdylib
//!   writes it by hand (`vfork`, which must not have a stack frame of its own).
//! * `; vararg: Type, …` marks a C variadic function. Rust cannot *define* a C-variadic
//!   function on stable, so the export takes the optional arguments as pointer-sized integers,
//!   which is exactly what glibc's own `fcntl`/`ioctl` (`va_arg(ap, void *)`) and `syscall`
//!   (six argument registers) do; on the SysV x86-64 and Linux AAPCS64 ABIs variadic arguments
//!   travel in the same registers (and stack slots) as fixed ones. The real function is called
//!   through its variadic pointer type.

/// Hands the hook table to `$callback!`. See the [module docs](crate::hooks) for the grammar.
#[macro_export]
macro_rules! sandirect_hook_table {
    ($callback:ident) => {
        $callback! {
            // ---- sockets: creation, addressing, options -------------------------------------
            Accelerate libc generated "AF_INET/AF_INET6 SOCK_STREAM sockets become TCP candidates (tracked)"
                fn socket(domain: ::libc::c_int, ty: ::libc::c_int, protocol: ::libc::c_int) -> ::libc::c_int;
            PassThrough libc generated "AF_UNIX pairs are never SAN candidates"
                fn socketpair(domain: ::libc::c_int, ty: ::libc::c_int, protocol: ::libc::c_int, fds: *mut ::libc::c_int) -> ::libc::c_int;
            PassThrough libc generated "the kernel socket is bound; the SAN session reuses its address"
                fn bind(fd: ::libc::c_int, addr: *const ::libc::sockaddr, len: ::libc::socklen_t) -> ::libc::c_int;
            Accelerate libc generated "tracked candidate becomes a listener"
                fn listen(fd: ::libc::c_int, backlog: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "accepted sockets of a tracked listener are tracked (server role)"
                fn accept(fd: ::libc::c_int, addr: *mut ::libc::sockaddr, len: *mut ::libc::socklen_t) -> ::libc::c_int;
            Accelerate libc generated "as accept; SOCK_NONBLOCK/SOCK_CLOEXEC recorded"
                fn accept4(fd: ::libc::c_int, addr: *mut ::libc::sockaddr, len: *mut ::libc::socklen_t, flags: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "tracked candidate becomes connected (client role); config rules decide the path"
                fn connect(fd: ::libc::c_int, addr: *const ::libc::sockaddr, len: ::libc::socklen_t) -> ::libc::c_int;
            PassThrough libc generated "the kernel anchor holds the true addresses"
                fn getsockname(fd: ::libc::c_int, addr: *mut ::libc::sockaddr, len: *mut ::libc::socklen_t) -> ::libc::c_int;
            PassThrough libc generated "the kernel anchor holds the true addresses"
                fn getpeername(fd: ::libc::c_int, addr: *mut ::libc::sockaddr, len: *mut ::libc::socklen_t) -> ::libc::c_int;
            PassThrough libc generated "applied to the kernel anchor"
                fn setsockopt(fd: ::libc::c_int, level: ::libc::c_int, name: ::libc::c_int, value: *const ::libc::c_void, len: ::libc::socklen_t) -> ::libc::c_int;
            PassThrough libc generated "answered by the kernel anchor; an SO_ERROR answer settles a pending non-blocking connect"
                fn getsockopt(fd: ::libc::c_int, level: ::libc::c_int, name: ::libc::c_int, value: *mut ::libc::c_void, len: *mut ::libc::socklen_t) -> ::libc::c_int;
            Accelerate libc generated "half-close recorded per socket; on a SAN socket the session sends its FIN too"
                fn shutdown(fd: ::libc::c_int, how: ::libc::c_int) -> ::libc::c_int;
            // ---- descriptor lifetime ------------------------------------------------------------
            Accelerate libc generated "drops this fd's reference to the socket object"
                fn close(fd: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "drops every tracked fd in the range (or marks it close-on-exec)"
                fn close_range(first: ::libc::c_uint, last: ::libc::c_uint, flags: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "the copy maps to the same socket object"
                fn dup(fd: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "the copy maps to the same socket object; a tracked target is released"
                fn dup2(old: ::libc::c_int, new: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "as dup2, plus O_CLOEXEC"
                fn dup3(old: ::libc::c_int, new: ::libc::c_int, flags: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "F_DUPFD*, F_SETFL O_NONBLOCK and F_SETFD FD_CLOEXEC are tracked"
                fn fcntl(fd: ::libc::c_int, cmd: ::libc::c_int; arg: usize) -> ::libc::c_int;
            Accelerate glibc generated "glibc >= 2.28 alias of fcntl with 64-bit locks; tracked as fcntl"
                fn fcntl64(fd: ::libc::c_int, cmd: ::libc::c_int; arg: usize) -> ::libc::c_int;
            Accelerate libc generated "FIONBIO and FIOCLEX/FIONCLEX are tracked; FIONREAD on a SAN socket counts the bytes unread in its session (or stash) and on TCP; other requests are the kernel's"
                fn ioctl(fd: ::libc::c_int, request: ::libc::c_ulong; arg: usize) -> ::libc::c_int;
            // ---- data transfer --------------------------------------------------------------------
            Accelerate libc generated "SAN sockets read from their session (and, in stream order, what TCP carried before the switch or after a downgrade); byte counters per path"
                fn read(fd: ::libc::c_int, buf: *mut ::libc::c_void, count: ::libc::size_t) -> ::libc::ssize_t;
            Accelerate libc generated "as read"
                fn readv(fd: ::libc::c_int, iov: *const ::libc::iovec, iovcnt: ::libc::c_int) -> ::libc::ssize_t;
            Accelerate libc generated "SAN sockets write into their session (large blocking writes by rendezvous); byte counters per path"
                fn write(fd: ::libc::c_int, buf: *const ::libc::c_void, count: ::libc::size_t) -> ::libc::ssize_t;
            Accelerate libc generated "as write"
                fn writev(fd: ::libc::c_int, iov: *const ::libc::iovec, iovcnt: ::libc::c_int) -> ::libc::ssize_t;
            Accelerate libc generated "as write"
                fn send(fd: ::libc::c_int, buf: *const ::libc::c_void, len: ::libc::size_t, flags: ::libc::c_int) -> ::libc::ssize_t;
            Accelerate libc generated "as write; MSG_FASTOPEN connects like connect"
                fn sendto(fd: ::libc::c_int, buf: *const ::libc::c_void, len: ::libc::size_t, flags: ::libc::c_int, addr: *const ::libc::sockaddr, addrlen: ::libc::socklen_t) -> ::libc::ssize_t;
            Accelerate libc generated "as write; a SAN socket passed with SCM_RIGHTS is first downgraded to kernel TCP, exactly (the receiving process uses the kernel socket; bytes already received over the SAN stay in this process's stash)"
                fn sendmsg(fd: ::libc::c_int, msg: *const ::libc::msghdr, flags: ::libc::c_int) -> ::libc::ssize_t;
            Accelerate libc generated "SAN sockets: one sendmsg per message; byte counters per path; SCM_RIGHTS as sendmsg"
                fn sendmmsg(fd: ::libc::c_int, msgvec: *mut ::libc::mmsghdr, vlen: ::libc::c_uint, flags: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "as read"
                fn recv(fd: ::libc::c_int, buf: *mut ::libc::c_void, len: ::libc::size_t, flags: ::libc::c_int) -> ::libc::ssize_t;
            Accelerate libc generated "as read"
                fn recvfrom(fd: ::libc::c_int, buf: *mut ::libc::c_void, len: ::libc::size_t, flags: ::libc::c_int, addr: *mut ::libc::sockaddr, addrlen: *mut ::libc::socklen_t) -> ::libc::ssize_t;
            Accelerate libc generated "as read"
                fn recvmsg(fd: ::libc::c_int, msg: *mut ::libc::msghdr, flags: ::libc::c_int) -> ::libc::ssize_t;
            Accelerate libc generated "SAN sockets: one recvmsg per message; byte counters per path"
                fn recvmmsg(fd: ::libc::c_int, msgvec: *mut ::libc::mmsghdr, vlen: ::libc::c_uint, flags: ::libc::c_int, timeout: *mut ::libc::timespec) -> ::libc::c_int;
            Accelerate glibc generated "FORTIFY_SOURCE read (glibc debug/read_chk.c)"
                fn __read_chk(fd: ::libc::c_int, buf: *mut ::libc::c_void, nbytes: ::libc::size_t, buflen: ::libc::size_t) -> ::libc::ssize_t;
            Accelerate glibc generated "FORTIFY_SOURCE recv (glibc debug/recv_chk.c)"
                fn __recv_chk(fd: ::libc::c_int, buf: *mut ::libc::c_void, len: ::libc::size_t, buflen: ::libc::size_t, flags: ::libc::c_int) -> ::libc::ssize_t;
            Accelerate glibc generated "FORTIFY_SOURCE recvfrom (glibc debug/recvfrom_chk.c)"
                fn __recvfrom_chk(fd: ::libc::c_int, buf: *mut ::libc::c_void, len: ::libc::size_t, buflen: ::libc::size_t, flags: ::libc::c_int, addr: *mut ::libc::sockaddr, addrlen: *mut ::libc::socklen_t) -> ::libc::ssize_t;
            Accelerate libc generated "into a SAN socket: read from in_fd in 64 KiB chunks and sent through the session; otherwise the kernel's sendfile"
                fn sendfile(out_fd: ::libc::c_int, in_fd: ::libc::c_int, offset: *mut ::libc::off_t, count: ::libc::size_t) -> ::libc::ssize_t;
            Accelerate libc generated "as sendfile"
                fn sendfile64(out_fd: ::libc::c_int, in_fd: ::libc::c_int, offset: *mut ::libc::off64_t, count: ::libc::size_t) -> ::libc::ssize_t;
            Accelerate libc generated "a SAN socket on either end: copied through a 64 KiB buffer, consuming exactly what the target took; otherwise the kernel's splice"
                fn splice(fd_in: ::libc::c_int, off_in: *mut ::libc::loff_t, fd_out: ::libc::c_int, off_out: *mut ::libc::loff_t, len: ::libc::size_t, flags: ::libc::c_uint) -> ::libc::ssize_t;
            // ---- paths around the other hooks -----------------------------------------------------
            Accelerate libc generated "socket I/O by number (read, write, readv, writev, recvfrom, sendto, recvmsg, sendmsg, recvmmsg, sendmmsg) and close, shutdown, epoll_ctl run as their hooks; io_uring_setup fails with ENOSYS while connections may switch to the SAN (a ring would move socket I/O and epoll_ctl past every hook; libuv, Envoy and others then use epoll); any other number is the real syscall"
                fn syscall(number: ::libc::c_long; a1: ::libc::c_long, a2: ::libc::c_long, a3: ::libc::c_long, a4: ::libc::c_long, a5: ::libc::c_long, a6: ::libc::c_long) -> ::libc::c_long;
            Accelerate libc generated "on a SAN socket the stream reads and writes through the hooks (fopencookie, fileno is the socket), since glibc's stdio calls its internal read/write; otherwise glibc's fdopen"
                fn fdopen(fd: ::libc::c_int, mode: *const ::libc::c_char) -> *mut ::libc::FILE;
            // ---- readiness ------------------------------------------------------------------------
            Accelerate libc generated "SAN sockets are watched through their readiness mirrors; while any exist the wait is cut into slices that service them"
                fn poll(fds: *mut ::libc::pollfd, nfds: ::libc::nfds_t, timeout: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "SAN sockets are watched through their readiness mirrors, as poll (one wait, not sliced)"
                fn ppoll(fds: *mut ::libc::pollfd, nfds: ::libc::nfds_t, timeout: *const ::libc::timespec, sigmask: *const ::libc::sigset_t) -> ::libc::c_int;
            Accelerate glibc generated "FORTIFY_SOURCE poll (glibc debug/poll_chk.c): glibc's size check, then as poll"
                fn __poll_chk(fds: *mut ::libc::pollfd, nfds: ::libc::nfds_t, timeout: ::libc::c_int, fdslen: ::libc::size_t) -> ::libc::c_int;
            Accelerate glibc generated "FORTIFY_SOURCE ppoll (glibc debug/ppoll_chk.c): glibc's size check, then as ppoll"
                fn __ppoll_chk(fds: *mut ::libc::pollfd, nfds: ::libc::nfds_t, timeout: *const ::libc::timespec, sigmask: *const ::libc::sigset_t, fdslen: ::libc::size_t) -> ::libc::c_int;
            Accelerate libc generated "with SAN sockets in the sets, runs as ppoll over their readiness mirrors"
                fn select(nfds: ::libc::c_int, readfds: *mut ::libc::fd_set, writefds: *mut ::libc::fd_set, exceptfds: *mut ::libc::fd_set, timeout: *mut ::libc::timeval) -> ::libc::c_int;
            Accelerate libc generated "as select"
                fn pselect(nfds: ::libc::c_int, readfds: *mut ::libc::fd_set, writefds: *mut ::libc::fd_set, exceptfds: *mut ::libc::fd_set, timeout: *const ::libc::timespec, sigmask: *const ::libc::sigset_t) -> ::libc::c_int;
            Accelerate libc generated "epoll instances are tracked so registrations can move to a readiness mirror"
                fn epoll_create(size: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "as epoll_create"
                fn epoll_create1(flags: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "registrations of tracked sockets (epfd, events, data) are recorded; a SAN socket is registered through its readiness mirror"
                fn epoll_ctl(epfd: ::libc::c_int, op: ::libc::c_int, fd: ::libc::c_int, event: *mut ::libc::epoll_event) -> ::libc::c_int;
            Accelerate libc generated "SAN sockets report through their mirrors; events that are only handshake or credit tokens are dropped; while SAN sockets exist the wait is sliced"
                fn epoll_wait(epfd: ::libc::c_int, events: *mut ::libc::epoll_event, maxevents: ::libc::c_int, timeout: ::libc::c_int) -> ::libc::c_int;
            Accelerate libc generated "as epoll_wait"
                fn epoll_pwait(epfd: ::libc::c_int, events: *mut ::libc::epoll_event, maxevents: ::libc::c_int, timeout: ::libc::c_int, sigmask: *const ::libc::sigset_t) -> ::libc::c_int;
            Accelerate libc generated "as epoll_wait, in millisecond epoll_pwait slices while SAN sockets exist (ENOSYS where glibc < 2.35 lacks it)"
                fn epoll_pwait2(epfd: ::libc::c_int, events: *mut ::libc::epoll_event, maxevents: ::libc::c_int, timeout: *const ::libc::timespec, sigmask: *const ::libc::sigset_t) -> ::libc::c_int;
            // ---- signal dispositions --------------------------------------------------------------
            Chain libc generated "SIGSEGV and SIGBUS, once a connection switched to the SAN: the setting is recorded and reported back exactly as the kernel would report it, and runs behind the library's fault handler (which turns a fault in its own copy of a bad buffer into EFAULT); other signals, and these before, are the C library's call"
                fn sigaction(signum: ::libc::c_int, act: *const ::libc::sigaction, oldact: *mut ::libc::sigaction) -> ::libc::c_int;
            Chain glibc generated "as sigaction (glibc's other name for it)"
                fn __sigaction(signum: ::libc::c_int, act: *const ::libc::sigaction, oldact: *mut ::libc::sigaction) -> ::libc::c_int;
            Chain libc generated "as sigaction for SIGSEGV and SIGBUS, with the flags and mask glibc's signal sets (glibc calls its internal sigaction, which no preload sees)"
                fn signal(signum: ::libc::c_int, handler: ::libc::sighandler_t) -> ::libc::sighandler_t;
            Chain glibc generated "as signal"
                fn bsd_signal(signum: ::libc::c_int, handler: ::libc::sighandler_t) -> ::libc::sighandler_t;
            Chain glibc generated "as signal (glibc's ssignal is signal)"
                fn ssignal(signum: ::libc::c_int, handler: ::libc::sighandler_t) -> ::libc::sighandler_t;
            Chain glibc generated "as signal, with System V's one-shot flags"
                fn sysv_signal(signum: ::libc::c_int, handler: ::libc::sighandler_t) -> ::libc::sighandler_t;
            Chain glibc generated "as sysv_signal"
                fn __sysv_signal(signum: ::libc::c_int, handler: ::libc::sighandler_t) -> ::libc::sighandler_t;
            Chain glibc generated "as signal, with System V's SIG_HOLD and unblocking"
                fn sigset(signum: ::libc::c_int, disposition: ::libc::sighandler_t) -> ::libc::sighandler_t;
            Chain glibc generated "as sigaction with SIG_IGN"
                fn sigignore(signum: ::libc::c_int) -> ::libc::c_int;
            Chain glibc generated "as sigaction, changing SA_RESTART (and what a later signal sets)"
                fn siginterrupt(signum: ::libc::c_int, interrupt: ::libc::c_int) -> ::libc::c_int;
            // ---- processes ------------------------------------------------------------------------
            Accelerate libc generated "switched SAN connections are first downgraded to kernel TCP, exactly (a session cannot be shared; unread SAN bytes go to a stash both processes share); accepted connections not used yet attach later, in the process that uses them"
                fn fork() -> ::libc::pid_t;
            Accelerate libc handwritten "every SAN connection is downgraded to kernel TCP first (the child may pass any socket on); a trampoline then jumps to the real vfork: no Rust code of ours runs in the child, and the child's hook calls act like the kernel calls alone"
                fn vfork() -> ::libc::pid_t;
            Accelerate libc generated "surviving SAN sockets are downgraded to kernel TCP first; their stashes go to the new image (SANDIRECT_STASHES)"
                fn execve(path: *const ::libc::c_char, argv: *const *const ::libc::c_char, envp: *const *const ::libc::c_char) -> ::libc::c_int;
            Accelerate libc generated "as execve (glibc's execv calls its internal execve, which no preload sees)"
                fn execv(path: *const ::libc::c_char, argv: *const *const ::libc::c_char) -> ::libc::c_int;
            Accelerate libc generated "as execve (Rust's Command::exec, Python's os.execvp)"
                fn execvp(file: *const ::libc::c_char, argv: *const *const ::libc::c_char) -> ::libc::c_int;
            Accelerate glibc generated "as execve"
                fn execvpe(file: *const ::libc::c_char, argv: *const *const ::libc::c_char, envp: *const *const ::libc::c_char) -> ::libc::c_int;
            Accelerate libc generated "SAN sockets the child receives (no close-on-exec, or a dup2 file action's source) are downgraded first; their stashes go to the new image"
                fn posix_spawn(pid: *mut ::libc::pid_t, path: *const ::libc::c_char, file_actions: *const ::libc::posix_spawn_file_actions_t, attrp: *const ::libc::posix_spawnattr_t, argv: *const *mut ::libc::c_char, envp: *const *mut ::libc::c_char) -> ::libc::c_int;
            Accelerate libc generated "as posix_spawn"
                fn posix_spawnp(pid: *mut ::libc::pid_t, file: *const ::libc::c_char, file_actions: *const ::libc::posix_spawn_file_actions_t, attrp: *const ::libc::posix_spawnattr_t, argv: *const *mut ::libc::c_char, envp: *const *mut ::libc::c_char) -> ::libc::c_int;
            Accelerate libc generated "SAN sockets without close-on-exec (the shell inherits them) are downgraded to kernel TCP first; stashed bytes stay with this process"
                fn system(command: *const ::libc::c_char) -> ::libc::c_int;
            Accelerate libc generated "as system"
                fn popen(command: *const ::libc::c_char, mode: *const ::libc::c_char) -> *mut ::libc::FILE;
            Accelerate libc generated "as execve"
                fn fexecve(fd: ::libc::c_int, argv: *const *const ::libc::c_char, envp: *const *const ::libc::c_char) -> ::libc::c_int;
        }
    };
}
