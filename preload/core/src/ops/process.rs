//! The process hooks: `fork`, `vfork`, the exec calls, `posix_spawn`, `system`, `popen`, and
//! the fork child handler. A SAN session cannot cross into another process or image: the
//! connections a child or new image receives are downgraded to kernel TCP first, and bytes
//! received but not read yet travel in stashes (`SANDIRECT_STASHES`).

use core::ffi::c_int;
use core::sync::atomic::Ordering;

use crate::fdtable::table;
use crate::guard::{self, bookkeeping};
use crate::registry::registry;
use crate::{errno, real};

/// `fork(2)`: a SAN session cannot be shared by two processes, so every SAN connection is
/// first moved back to kernel TCP, live and exactly (`san::before_fork`); both processes then
/// hold plain TCP sockets (with a shared stash of bytes received but not read yet).
///
/// While the socket records are published (shared with `sandirect stat`), the child copies
/// them into a file of its own in its atfork handler; the parent waits (bounded) until it has,
/// so a socket the parent closes right after the fork is still the child's.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn fork() -> libc::pid_t {
    // The child shares every epoll instance: none keeps output in user space from now on
    // (one atomic add while none does, see `san::epoll_instances_shared`).
    crate::san::epoll_instances_shared();
    let published = crate::registry::registry().is_published();
    let san = crate::san::ever_used();
    if (!san && !published) || guard::is_inside() {
        // SAFETY: forwarded.
        return unsafe { real::fork() };
    }
    // (A panic of ours: a fork without the slot locks, as a process without SAN sockets.)
    // (Also with no SAN socket yet: another thread may be accepting one right now, which the
    // fork must either count or see after it.)
    let held = (san || crate::san::live_sockets() != 0)
        .then(|| guard::contained(crate::san::before_fork))
        .flatten();
    let signal = published.then(ForkSignal::new).flatten();
    let forked = || {
        // SAFETY: forwarded.
        let pid = unsafe { real::fork() };
        let errno = errno::Preserved::save();
        if let Some(signal) = signal {
            if pid > 0 {
                signal.wait_for_child();
            }
        }
        (pid, errno)
    };
    // The library's process-wide locks too: another thread inside one at the fork would
    // leave it locked for ever in the child.
    let (pid, _errno) = if san {
        crate::san::with_library_locks(forked)
    } else {
        forked()
    };
    // Both processes release the slot locks held across the fork (no thread of the parent
    // can have been inside one in the child).
    drop(held);
    pid
}

/// Before a `vfork` (the exported trampoline calls it in the parent, then jumps to the real
/// `vfork`): every SAN connection is downgraded to kernel TCP first, then the thread is marked
/// so that the child's hook calls act like the kernel calls alone
/// ([`guard::in_vfork_child`]). All of them, not only those without close-on-exec: between
/// `vfork` and exec the child may make any socket inheritable (CPython's subprocess `dup2`s
/// onto 0-2 and clears close-on-exec there) for a program that will use it, and a SAN session
/// cannot go with it; the child cannot downgrade for its parent.
pub fn before_vfork() {
    if crate::san::live_sockets() != 0 && !guard::is_inside() {
        bookkeeping(|| crate::san::downgrade_all(None));
    }
    // Last: our own calls above would clear the mark (they run in the parent).
    guard::note_vfork();
}

/// The socket indices with a descriptor that survives an exec here: open and without
/// close-on-exec, as the kernel says (the flag may have changed behind our table's back:
/// a raw system call, an interposed call we do not see).
fn inherited_indices() -> Vec<u32> {
    let mut indices = Vec::new();
    table().for_each_in(0, c_int::MAX, |fd, entry| {
        if let Some(index) = entry.socket_index() {
            // SAFETY: F_GETFD only reads the descriptor's flags.
            let fd_flags = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
            if fd_flags >= 0 && fd_flags & libc::FD_CLOEXEC == 0 && !indices.contains(&index) {
                indices.push(index);
            }
        }
    });
    indices
}

/// Before an exec: surviving SAN sockets are downgraded to kernel TCP and their stashes
/// prepared for the new image. Returns the `SANDIRECT_STASHES=...` entry when there is one.
fn prepare_exec() -> Option<std::ffi::CString> {
    tracing::debug!(
        live = crate::san::live_sockets(),
        inside = guard::is_inside(),
        vfork_child = guard::in_vfork_child(),
        "exec: preparing"
    );
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        return None;
    }
    let stashes = if guard::in_vfork_child() || crate::process::in_vfork_child() {
        // The parent downgraded every SAN connection before the vfork; only the copies this
        // child passes on are to be found (by identity: the table is the parent's). No
        // reentrancy guard: this thread's TLS is the parent's, and a successful exec would
        // never restore it.
        crate::san::stash_env()
    } else {
        // (A panic of ours: the exec goes ahead without stashes.)
        guard::contained(|| {
            let inherited = inherited_indices();
            let survives = |fd: c_int| {
                table()
                    .lookup(fd)
                    .socket_index()
                    .is_some_and(|index| inherited.contains(&index))
            };
            crate::san::release_unclaimed_at_exec(&survives);
            crate::san::downgrade_all(Some(&survives));
            crate::san::stash_env()
        })
        .flatten()
    }?;
    std::ffi::CString::new(format!("{}={stashes}", crate::settings::STASHES)).ok()
}

/// What a `posix_spawn` child receives of our sockets, read from glibc's file actions.
enum SpawnInherits {
    /// The file actions could not be read (an unknown action): assume every socket.
    Everything,
    /// `(source fd, fd in the child)` of every `dup2` action, besides the descriptors
    /// without close-on-exec, which the child inherits as they are.
    Dup2s(Vec<(c_int, c_int)>),
}

/// glibc's `struct __spawn_action` (posix/spawn_int.h, stable since glibc 2.x; newer tags
/// are appended): a tag and a pointer-aligned union (at offset 8) whose `dup2_action` is
/// `{ int fd; int newfd; }`.
#[repr(C)]
struct SpawnAction {
    tag: c_int,
    _union_alignment: c_int,
    first: c_int,
    second: c_int,
    rest: [u8; 16],
}

/// glibc's `posix_spawn_file_actions_t`.
#[repr(C)]
struct SpawnFileActions {
    allocated: c_int,
    used: c_int,
    actions: *const SpawnAction,
}

const SPAWN_DO_DUP2: c_int = 1;
/// Highest action tag glibc 2.36 knows (`spawn_do_tcsetpgrp`).
const SPAWN_LAST_KNOWN_TAG: c_int = 6;

/// Reads the `dup2` actions of `file_actions`.
///
/// # Safety
/// `file_actions` is null or points to an initialised `posix_spawn_file_actions_t` (the
/// caller's contract with `posix_spawn`).
unsafe fn spawn_inherits(file_actions: *const libc::posix_spawn_file_actions_t) -> SpawnInherits {
    if file_actions.is_null() {
        return SpawnInherits::Dup2s(Vec::new());
    }
    const _: () = assert!(
        core::mem::size_of::<SpawnAction>() == 32
            && core::mem::size_of::<SpawnFileActions>()
                <= core::mem::size_of::<libc::posix_spawn_file_actions_t>()
    );
    // SAFETY: the public type is at least as large as glibc's internal layout (checked
    // above) and initialised by posix_spawn_file_actions_init.
    let actions = unsafe { &*file_actions.cast::<SpawnFileActions>() };
    if actions.used < 0 || actions.used > actions.allocated || actions.used > 65_536 {
        return SpawnInherits::Everything;
    }
    if actions.used > 0 && actions.actions.is_null() {
        return SpawnInherits::Everything;
    }
    let mut dup2s = Vec::new();
    for position in 0..actions.used as usize {
        // SAFETY: glibc keeps `used` initialised actions in the array.
        let action = unsafe { &*actions.actions.add(position) };
        match action.tag {
            SPAWN_DO_DUP2 => dup2s.push((action.first, action.second)),
            tag if (0..=SPAWN_LAST_KNOWN_TAG).contains(&tag) => {}
            _ => return SpawnInherits::Everything,
        }
    }
    SpawnInherits::Dup2s(dup2s)
}

/// Around a `posix_spawn`: the SAN sockets the child may receive (without close-on-exec,
/// or the source of a `dup2` file action) are downgraded first, and the stashes of those
/// among them holding bytes are handed to the child's image (`SANDIRECT_STASHES`, their
/// memfds inheritable for the duration of the call: glibc returns after the child's exec).
///
/// # Safety
/// As `posix_spawn`'s contract for `file_actions` and `envp`.
unsafe fn spawn_with(
    file_actions: *const libc::posix_spawn_file_actions_t,
    envp: *const *mut libc::c_char,
    call: impl FnOnce(*const *mut libc::c_char) -> c_int,
) -> c_int {
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        return call(envp);
    }
    let errno = errno::Preserved::save();
    // (A panic of ours: the spawn goes ahead without stashes.)
    let prepared = guard::contained(|| {
        // SAFETY: the caller's file actions.
        let inherits = unsafe { spawn_inherits(file_actions) };
        let mut passed = inherited_indices();
        let dup2s = match &inherits {
            SpawnInherits::Everything => None,
            SpawnInherits::Dup2s(dup2s) => Some(dup2s.as_slice()),
        };
        for &(source, _) in dup2s.unwrap_or_default() {
            if let Some(index) = table().lookup(source).socket_index() {
                passed.push(index);
            }
        }
        let survives = |fd: c_int| {
            dup2s.is_none()
                || table()
                    .lookup(fd)
                    .socket_index()
                    .is_some_and(|index| passed.contains(&index))
        };
        crate::san::downgrade_all(Some(&survives));
        stash_environment(dup2s.unwrap_or_default())
    })
    .flatten();
    drop(errno);
    let Some(stashes) = prepared else {
        return call(envp);
    };
    // SAFETY: the caller's environment array.
    let env = unsafe { environment_with(envp.cast(), &stashes.variable) };
    stashes.inheritable_during(|| call(env.as_ptr().cast()))
}

/// Stashes to hand to a child's image: the `SANDIRECT_STASHES=…` entry and the memfds it
/// names (made inheritable only while the child is spawned, see
/// [`ChildStashes::inheritable_during`]).
struct ChildStashes {
    variable: std::ffi::CString,
    memfds: Vec<c_int>,
}

impl ChildStashes {
    fn inheritable_during<T>(&self, call: impl FnOnce() -> T) -> T {
        for &memfd in &self.memfds {
            // SAFETY: our own memfd, inheritable only for this call.
            unsafe { libc::fcntl(memfd, libc::F_SETFD, 0) };
        }
        let result = call();
        let _errno = errno::Preserved::save();
        for &memfd in &self.memfds {
            // SAFETY: as above.
            unsafe { libc::fcntl(memfd, libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        result
    }
}

/// The stashes a child receives (after the downgrade): those of its inherited descriptors
/// (no close-on-exec) and of the sources of `dup2s` (source, target) file actions. `None`
/// when no stash holds bytes for it. Inside the guard.
fn stash_environment(dup2s: &[(c_int, c_int)]) -> Option<ChildStashes> {
    // The child's descriptors holding a stashed socket: inherited as they are, or dup2
    // targets of a stashed source.
    let mut entries = Vec::new();
    table().for_each_in(0, c_int::MAX, |fd, entry| {
        // SAFETY: F_GETFD only reads the descriptor's flags.
        let fd_flags = unsafe { real::fcntl(fd, libc::F_GETFD, 0) };
        if entry.socket_index().is_some() && fd_flags >= 0 && fd_flags & libc::FD_CLOEXEC == 0 {
            if let Some((memfd, inode)) = crate::san::stash_of(fd) {
                entries.push((fd, memfd, inode));
            }
        }
    });
    for &(source, target) in dup2s {
        if let Some((memfd, inode)) = crate::san::stash_of(source) {
            entries.retain(|&(fd, _, _)| fd != target);
            entries.push((target, memfd, inode));
        }
    }
    let value = crate::san::pass_on(&entries, false)?;
    let variable = std::ffi::CString::new(format!("{}={value}", crate::settings::STASHES)).ok()?;
    let mut memfds: Vec<c_int> = entries.iter().map(|&(_, memfd, _)| memfd).collect();
    memfds.sort_unstable();
    memfds.dedup();
    Some(ChildStashes { variable, memfds })
}

/// Around `system`/`popen`, which spawn the shell through glibc's internal `posix_spawn` (no
/// preload sees it): the SAN sockets the shell inherits (without close-on-exec) are
/// downgraded to kernel TCP first, and stashes holding bytes for them reach the shell (a
/// preloaded image, which hands them on to its own children) through the environment glibc
/// passes: `environ` itself, swapped for a copy with our entry for the duration of the call.
///
/// The swap is a pointer store; a thread reading the environment meanwhile sees either array,
/// both valid (ours is leaked, not freed: other threads may still hold it, and this happens
/// only when stashes hold bytes). A `setenv` racing with the call may be lost (POSIX already
/// forbids `setenv` concurrently with other threads).
fn around_shell<T>(call: impl FnOnce() -> T) -> T {
    if crate::san::live_sockets() == 0 || guard::is_inside() {
        return call();
    }
    let errno = errno::Preserved::save();
    // (A panic of ours: the call goes ahead without stashes.)
    let prepared = guard::contained(|| {
        let inherited = inherited_indices();
        let survives = |fd: c_int| {
            table()
                .lookup(fd)
                .socket_index()
                .is_some_and(|index| inherited.contains(&index))
        };
        if inherited.is_empty() {
            None
        } else {
            crate::san::downgrade_all(Some(&survives));
            stash_environment(&[])
        }
    })
    .flatten();
    drop(errno);
    let Some(stashes) = prepared else {
        return call();
    };
    let original = process_environment();
    let variable: &'static std::ffi::CStr = Box::leak(stashes.variable.clone().into_boxed_c_str());
    // SAFETY: the process environment array (NULL-terminated by contract).
    let ours: &'static [*const libc::c_char] =
        Vec::leak(unsafe { environment_with(original, variable) });
    // SAFETY: a pointer store to libc's `environ`; the array and its strings outlive the call.
    unsafe { core::ptr::addr_of_mut!(environ).write(ours.as_ptr()) };
    let result = stashes.inheritable_during(call);
    // Restore only if nobody replaced it meanwhile (a racing setenv keeps its own array).
    // SAFETY: as above.
    unsafe {
        if core::ptr::addr_of!(environ).read() == ours.as_ptr() {
            core::ptr::addr_of_mut!(environ).write(original);
        }
    }
    result
}

/// `system(3)`: see `around_shell`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn system(command: *const libc::c_char) -> c_int {
    // SAFETY: forwarded.
    around_shell(|| unsafe { real::system(command) })
}

/// `popen(3)`: see `around_shell`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn popen(command: *const libc::c_char, mode: *const libc::c_char) -> *mut libc::FILE {
    // SAFETY: forwarded.
    around_shell(|| unsafe { real::popen(command, mode) })
}

/// `posix_spawn(3)`: the SAN sockets the child receives are downgraded first, their stashes
/// handed on (`spawn_with`).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn posix_spawn(
    pid: *mut libc::pid_t,
    path: *const libc::c_char,
    file_actions: *const libc::posix_spawn_file_actions_t,
    attrp: *const libc::posix_spawnattr_t,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
) -> c_int {
    // SAFETY: forwarded contract of the caller.
    unsafe {
        spawn_with(file_actions, envp, |env| {
            real::posix_spawn(pid, path, file_actions, attrp, argv, env)
        })
    }
}

/// `posix_spawnp(3)`: as `posix_spawn`.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn posix_spawnp(
    pid: *mut libc::pid_t,
    file: *const libc::c_char,
    file_actions: *const libc::posix_spawn_file_actions_t,
    attrp: *const libc::posix_spawnattr_t,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
) -> c_int {
    // SAFETY: forwarded contract of the caller.
    unsafe {
        spawn_with(file_actions, envp, |env| {
            real::posix_spawnp(pid, file, file_actions, attrp, argv, env)
        })
    }
}

/// `envp` without an older `SANDIRECT_STASHES`, plus `ours`; NULL-terminated.
///
/// # Safety
/// `envp` is null or a NULL-terminated array of C strings.
unsafe fn environment_with(
    envp: *const *const libc::c_char,
    ours: &std::ffi::CStr,
) -> Vec<*const libc::c_char> {
    let prefix = format!("{}=", crate::settings::STASHES);
    let mut entries: Vec<*const libc::c_char> = Vec::new();
    if !envp.is_null() {
        // Bounded by the caller's NULL-terminated array.
        for position in 0.. {
            // SAFETY: `envp` is a NULL-terminated array of C strings (the caller's contract).
            let entry = unsafe { *envp.add(position) };
            if entry.is_null() {
                break;
            }
            // SAFETY: as above.
            let bytes = unsafe { std::ffi::CStr::from_ptr(entry) }.to_bytes();
            if !bytes.starts_with(prefix.as_bytes()) {
                entries.push(entry);
            }
        }
    }
    entries.push(ours.as_ptr());
    entries.push(core::ptr::null());
    entries
}

extern "C" {
    /// libc's process environment.
    static mut environ: *const *const libc::c_char;
}

/// The process environment (for the exec calls without an `envp`).
fn process_environment() -> *const *const libc::c_char {
    // SAFETY: reading the pointer value of libc's `environ`.
    unsafe { core::ptr::addr_of!(environ).read() }
}

/// An exec call. Surviving SAN sockets are downgraded to kernel TCP first (`prepare_exec`);
/// when stashes of bytes received but not read yet are left for the new image, `exec` gets
/// `envp` (the process environment when `None`) plus `SANDIRECT_STASHES`, otherwise `None`:
/// the call exactly as the caller made it.
///
/// # Safety
/// `envp` is null or a NULL-terminated array of C strings.
#[inline(always)]
unsafe fn exec_with(
    envp: Option<*const *const libc::c_char>,
    exec: impl FnOnce(Option<*const *const libc::c_char>) -> c_int,
) -> c_int {
    // The new image starts with the fault signals the application ignores still ignored (our
    // handler, as any handler, would become the default); put back if the exec fails.
    let _dispositions = crate::fault::ExecDispositions::prepare();
    let Some(ours) = prepare_exec() else {
        return exec(None);
    };
    let base = envp.unwrap_or_else(process_environment);
    // SAFETY: the caller's environment array or the process environment, NULL-terminated.
    let env = unsafe { environment_with(base, &ours) };
    // `env` (and the strings it points to) outlives the call.
    exec(Some(env.as_ptr()))
}

/// `execve(2)`: surviving SAN sockets are downgraded to kernel TCP first, and the stashes of
/// bytes received but not read yet are handed to the new image (`SANDIRECT_STASHES`).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn execve(
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    // SAFETY: forwarded, with the caller's environment or a valid copy of it.
    unsafe {
        exec_with(Some(envp), |env| {
            real::execve(path, argv, env.unwrap_or(envp))
        })
    }
}

/// `execvpe(3)`: as [`execve`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn execvpe(
    file: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    // SAFETY: forwarded, with the caller's environment or a valid copy of it.
    unsafe {
        exec_with(Some(envp), |env| {
            real::execvpe(file, argv, env.unwrap_or(envp))
        })
    }
}

/// `fexecve(3)`: as [`execve`].
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn fexecve(
    fd: c_int,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> c_int {
    // SAFETY: forwarded, with the caller's environment or a valid copy of it.
    unsafe {
        exec_with(Some(envp), |env| {
            real::fexecve(fd, argv, env.unwrap_or(envp))
        })
    }
}

/// `execv(3)`: as [`execve`] with the process environment (glibc's `execv` calls its internal
/// `execve`, which an interposer does not see).
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn execv(path: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    // SAFETY: forwarded; with stashes, as `execve` with a valid copy of the process
    // environment.
    unsafe {
        exec_with(None, |env| match env {
            Some(env) => real::execve(path, argv, env),
            None => real::execv(path, argv),
        })
    }
}

/// `execvp(3)`: as [`execvpe`] with the process environment.
///
/// # Safety
/// As the C function.
#[inline(always)]
pub unsafe fn execvp(file: *const libc::c_char, argv: *const *const libc::c_char) -> c_int {
    // SAFETY: forwarded; with stashes, as `execvpe` with a valid copy of the process
    // environment.
    unsafe {
        exec_with(None, |env| match env {
            Some(env) => real::execvpe(file, argv, env),
            None => real::execvp(file, argv),
        })
    }
}

/// `pthread_atfork` child handler. Async-signal-safe: syscalls and atomics only.
pub extern "C" fn after_fork_in_child() {
    crate::fault::after_fork_in_child();
    crate::process::note_process_id();
    registry().after_fork_in_child();
    crate::san::after_fork_in_child();
    if let Some((read, write)) = unpack_pipe(FORK_SIGNAL.swap(NO_PIPE, Ordering::AcqRel)) {
        // SAFETY: one byte to the pipe our fork hook made; then our copies of it are closed.
        unsafe {
            libc::write(write, [1u8].as_ptr().cast(), 1);
            libc::close(write);
            libc::close(read);
        }
    }
}

/// The pipe of a fork in progress, both ends in one word (read end low, write end high), so
/// the child handler takes it with one atomic swap; [`NO_PIPE`] when none.
static FORK_SIGNAL: core::sync::atomic::AtomicU64 = core::sync::atomic::AtomicU64::new(NO_PIPE);
const NO_PIPE: u64 = u64::MAX;

fn pack_pipe(read: c_int, write: c_int) -> u64 {
    u64::from(read as u32) | u64::from(write as u32) << 32
}

fn unpack_pipe(word: u64) -> Option<(c_int, c_int)> {
    (word != NO_PIPE).then_some((word as u32 as c_int, (word >> 32) as u32 as c_int))
}

/// The child's "my records are copied" signal to the parent of a fork (see `ops::fork`).
pub struct ForkSignal {
    read: c_int,
    write: c_int,
}

impl ForkSignal {
    /// A pipe whose ends the child's atfork handler takes; `None` if no pipe (or another fork
    /// of this process is in progress: that one keeps the signal).
    pub fn new() -> Option<ForkSignal> {
        let mut ends = [-1; 2];
        // SAFETY: plain pipe2(2) into our array.
        if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return None;
        }
        // Owns the ends from here on: closed on drop, whatever happens next.
        let signal = ForkSignal {
            read: ends[0],
            write: ends[1],
        };
        FORK_SIGNAL
            .compare_exchange(
                NO_PIPE,
                signal.packed(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()
            .map(|_| signal)
    }

    fn packed(&self) -> u64 {
        pack_pipe(self.read, self.write)
    }

    /// No later fork may signal through this pipe (the parent's copy of the slot).
    fn disarm(&self) {
        let _ = FORK_SIGNAL.compare_exchange(
            self.packed(),
            NO_PIPE,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Parent: waits (up to a second) until the child copied its records.
    pub fn wait_for_child(&self) {
        self.disarm();
        let mut entry = libc::pollfd {
            fd: self.read,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd.
        unsafe { real::poll(&mut entry, 1, 1000) };
    }
}

impl Drop for ForkSignal {
    fn drop(&mut self) {
        self.disarm();
        // SAFETY: closing our own pipe ends.
        unsafe {
            real::close(self.read);
            real::close(self.write);
        }
    }
}
