//! The side channel of the switch-over: an abstract Unix stream socket named by the connection
//! key, through which the two processes pass their readiness-mirror raising ends (`SCM_RIGHTS`)
//! and the shared page holding both sides' [`MirrorWords`].
//!
//! **Why the acceptor connects.** The acceptor must finish inside `accept()` without waiting
//! for the client, which may be blocked anywhere. A Unix stream `connect()` succeeds as soon as
//! the client's listener has room in its backlog, and data (with descriptors) can be queued on
//! the connection before the client accepts it. So the connecting side listens at `connect()`
//! time; the acceptor connects, queues its raising end and the words page, and only then attaches the
//! segment. When the client sees the segment attached, everything it needs is already queued.
//! The client answers with its own the raising end before it sends its `Hello`, so by the time the
//! acceptor's session is established the client's raising end is waiting on the same socket.
//!
//! **Who may connect.** The name lives in the abstract namespace, which anyone can reach; the
//! acceptor checks the listener's credentials (`SO_PEERCRED`) and the client checks the
//! acceptor's, so descriptors are only ever exchanged between processes of the same user.
//! A squatter that connects to a client's name first (the name is visible in
//! `/proc/net/unix` and follows from the 4-tuple) must not cost the connection: the client
//! takes the first queued connection that is of our user *and* already carries the acceptor's
//! mirror end and words page (the acceptor queues both before it attaches, and the client
//! only looks once it sees the attach), and discards the others. A squatter that fills the
//! backlog makes the acceptor's connect fail instead: the acceptor stays on TCP, and so does
//! the client, which never sees an attach.
//!
//! **Other users.** A client of another user's server listens at a name of no user's
//! (`\0sandirect/x/X/<segment name>`), and its offer thread, not this module's
//! [`accept_offer`], takes the acceptor's connection and passes it the private segment (see
//! `super::other_users`): there the users the policy names are checked instead of ours.
//!
//! **Who the peer is.** The exchange is also where each side learns the other process as the
//! kernel names it to *it* ([`peer_process`]), which the pid recorded in the segment cannot do
//! for a peer in another pid namespace (a container sharing `/dev/shm` and the network
//! namespace): `SO_PEERCRED`'s pid, which the kernel translates into the reader's namespace
//! (0 when the peer has no pid there), and a pidfd, which names the process in any
//! namespace. The acceptor passes a pidfd of itself along with its mirror end and the words
//! page (`SCM_RIGHTS`); the client's pidfd comes from `SO_PEERPIDFD` (Linux 6.5) or from
//! `pidfd_open` on the translated pid. An acceptor that can get neither for its client
//! declines (the client's pid namespace is not below its own and the kernel is older): both
//! stay on TCP.

use core::fmt::Write as _;
use core::mem::size_of;
use core::ops::Deref;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use crate::discovery::{address_in_dir, SegmentName};
use crate::mirror::MirrorWords;

/// The payload byte sent with a mirror end.
pub(crate) const MIRROR_END: u8 = b'K';
/// The payload byte sent with the words page.
pub(crate) const WORDS_PAGE: u8 = b'W';
/// The payload byte sent with the acceptor's pidfd of itself.
pub(crate) const PIDFD: u8 = b'P';
/// The payload byte sent with a private segment (a connection between two users).
pub(crate) const SEGMENT: u8 = b'S';

/// `SO_PEERPIDFD` (Linux 6.5) where its value is the generic one; elsewhere the pidfd is
/// opened from the translated pid.
#[cfg(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "riscv64"
))]
const SO_PEERPIDFD: Option<libc::c_int> = Some(77);
#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "x86",
    target_arch = "aarch64",
    target_arch = "arm",
    target_arch = "riscv64"
)))]
const SO_PEERPIDFD: Option<libc::c_int> = None;

/// Offsets of the two sides' words in the page (separate cache lines).
const WORDS_OFFSETS: [usize; 2] = [0, 128];
const PAGE: usize = 4096;

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A descriptor the kernel just returned, moved above the application's numbers (`None`,
/// and closed, when it cannot be: the set-up fails rather than take one of the application's).
fn owned(fd: libc::c_int) -> Option<OwnedFd> {
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    (fd >= 0).then(|| crate::mirror::move_internal_fd(unsafe { OwnedFd::from_raw_fd(fd) }).ok())?
}

/// `\0sandirect/<euid>/X/<segment name>`.
fn exchange_address(name: &SegmentName) -> Option<(libc::sockaddr_un, libc::socklen_t)> {
    abstract_address(format_args!(
        "sandirect/{}/X/{}",
        effective_uid(),
        name.as_str()
    ))
}

/// `\0sandirect/x/X/<segment name>`: the exchange of a client whose server is another
/// user's (see `super::other_users`). No uid in it: the acceptor may be neither the
/// client's user nor the listener's publisher's (nginx's workers).
fn other_user_address(name: &SegmentName) -> Option<(libc::sockaddr_un, libc::socklen_t)> {
    abstract_address(format_args!("sandirect/x/X/{}", name.as_str()))
}

/// The abstract address `\0<text>`.
fn abstract_address(
    text_args: core::fmt::Arguments<'_>,
) -> Option<(libc::sockaddr_un, libc::socklen_t)> {
    let mut text = String::with_capacity(128);
    text.write_fmt(text_args).ok()?;
    // SAFETY: plain data, zero is valid.
    let mut sun: libc::sockaddr_un = unsafe { core::mem::zeroed() };
    if text.len() + 1 > sun.sun_path.len() {
        return None;
    }
    sun.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, &src) in sun.sun_path[1..].iter_mut().zip(text.as_bytes()) {
        *dst = src as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + 1 + text.len();
    Some((sun, len as libc::socklen_t))
}

fn unix_stream() -> Option<OwnedFd> {
    // SAFETY: plain socket(2) call.
    owned(unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })
}

/// `.X-<segment name>`: the exchange listener's socket file in the segment directory, for a
/// client that found its server there (another network namespace, see
/// `crate::discovery::address_in_dir`).
fn exchange_file_name(name: &SegmentName) -> String {
    format!(".X-{}", name.as_str())
}

/// The exchange listener's socket file, removed when the pending client's socket is dropped
/// (it switched, gave up or closed).
pub(crate) struct ExchangeFile {
    dir: san_shm::ShmDir,
    file: String,
}

impl Drop for ExchangeFile {
    fn drop(&mut self) {
        let _ = self.dir.remove(&self.file);
    }
}

/// The connecting side's exchange listener (created right after the TCP connect): at its
/// abstract name, or with `dir` (the server was found through the segment directory) as a
/// socket file there, whose removal the returned [`ExchangeFile`] owns.
pub(crate) fn listen(
    name: &SegmentName,
    dir: Option<&san_shm::ShmDir>,
) -> Option<(OwnedFd, Option<ExchangeFile>)> {
    let (socket, file) = match dir {
        Some(dir) => {
            let file = exchange_file_name(name);
            let address = address_in_dir(dir.as_fd(), &file)?;
            (
                bind_listener(address)?,
                Some(ExchangeFile {
                    dir: dir.clone(),
                    file,
                }),
            )
        }
        None => (bind_listener(exchange_address(name)?)?, None),
    };
    Some((socket, file))
}

/// A client whose server is another user's: its exchange listener at the name of
/// [`other_user_address`].
pub(crate) fn listen_for_other_user(name: &SegmentName) -> Option<OwnedFd> {
    bind_listener(other_user_address(name)?)
}

/// The acceptor's connection to the exchange of a client of another user, when one listens
/// for this connection and `SO_PEERCRED` says it runs as one of `allowed` (a name taken by
/// anyone else is left at once). Costs a plain client three system calls (see
/// `super::other_users`).
pub(crate) fn connect_to_other_user(
    name: &SegmentName,
    allowed: &dyn Fn(u32) -> bool,
) -> Result<OwnedFd, ConnectError> {
    let address = other_user_address(name).ok_or(ConnectError::NoListener)?;
    connect_checked(address, &|socket| {
        peer_credentials(socket).is_some_and(|cred| allowed(cred.uid))
    })
}

/// `SO_PEERCRED`'s uid of the other end of `socket`.
pub(crate) fn peer_uid(socket: BorrowedFd<'_>) -> Option<u32> {
    peer_credentials(socket).map(|cred| cred.uid)
}

fn bind_listener((sun, len): (libc::sockaddr_un, libc::socklen_t)) -> Option<OwnedFd> {
    let socket = unix_stream()?;
    // SAFETY: `sun` is a valid sockaddr_un of length `len`.
    let bound = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&sun as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    // SAFETY: plain listen(2) on our socket.
    (bound == 0 && unsafe { libc::listen(socket.as_raw_fd(), BACKLOG) } == 0).then_some(socket)
}

/// The exchange listener's backlog: the acceptor needs one place; the others leave room for
/// the odd squatter before the acceptor is refused (see "Who may connect").
const BACKLOG: libc::c_int = 4;

/// At most this many queued connections are looked at (the kernel queues up to `BACKLOG + 1`).
const MOST_QUEUED: usize = BACKLOG as usize + 1;

/// Why the acceptor has no exchange connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConnectError {
    /// Nobody listens (the client is not preloaded, or not upgrading), the listener is
    /// another user's, or its backlog is full.
    NoListener,
    /// This process could not make the socket (descriptors).
    Resource,
}

/// The acceptor's connection to the client's exchange listener: its abstract name, else (a
/// client in another network namespace) its socket file in the segment directory `dir`.
pub(crate) fn connect(
    name: &SegmentName,
    dir: Option<&san_shm::ShmDir>,
) -> Result<OwnedFd, ConnectError> {
    let address = exchange_address(name).ok_or(ConnectError::NoListener)?;
    match connect_to(address) {
        Err(ConnectError::NoListener) => {
            let file = dir
                .and_then(|dir| address_in_dir(dir.as_fd(), &exchange_file_name(name)))
                .ok_or(ConnectError::NoListener)?;
            connect_to(file)
        }
        other => other,
    }
}

fn connect_to(address: (libc::sockaddr_un, libc::socklen_t)) -> Result<OwnedFd, ConnectError> {
    connect_checked(address, &peer_is_same_user)
}

fn connect_checked(
    (sun, len): (libc::sockaddr_un, libc::socklen_t),
    accepted: &dyn Fn(BorrowedFd<'_>) -> bool,
) -> Result<OwnedFd, ConnectError> {
    // Moved above the application's numbers only once it connected: most accepted clients
    // are plain, and for them this probe is all the SAN costs the acceptor.
    // SAFETY: plain socket(2) call.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(ConnectError::Resource);
    }
    // SAFETY: just returned by the kernel, owned by nobody else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: `sun` is a valid sockaddr_un of length `len`.
    let rc = unsafe {
        libc::connect(
            socket.as_raw_fd(),
            (&sun as *const libc::sockaddr_un).cast(),
            len,
        )
    };
    if rc != 0 || !accepted(socket.as_fd()) {
        // Closed by the kernel call itself: the close hook's look at the descriptor is one
        // system call more for every plain client.
        let fd = std::os::fd::IntoRawFd::into_raw_fd(socket);
        // SAFETY: our own descriptor, taken out of its owner first so it closes once.
        unsafe { crate::real::close(fd) };
        return Err(ConnectError::NoListener);
    }
    crate::mirror::move_internal_fd(socket).map_err(|_| ConnectError::Resource)
}

/// What the acceptor queued on its exchange connection before it attached.
pub(crate) struct Offer {
    /// The exchange connection (our mirror end goes back on it).
    pub(crate) link: OwnedFd,
    /// The raising end of the acceptor's mirror.
    pub(crate) their_end: OwnedFd,
    /// The words page's memfd.
    pub(crate) page: OwnedFd,
    /// The acceptor's pidfd of itself (absent on kernels without pidfds).
    pub(crate) their_pidfd: Option<OwnedFd>,
}

/// Client, once the acceptor attached: the acceptor's connection among those queued on
/// `listener` (nonblocking): the first of our user that carries a mirror end and then a words
/// page (then, optionally, the acceptor's pidfd). Every connection before it is closed unread
/// (see "Who may connect").
pub(crate) fn accept_offer(listener: BorrowedFd<'_>) -> Option<Offer> {
    for _ in 0..MOST_QUEUED {
        // Nothing (more) queued: no acceptor.
        let Some(link) = accept(listener)? else {
            continue;
        };
        if let Some(offer) = take_offer(link) {
            return Some(offer);
        }
    }
    None
}

/// The offer queued on exchange connection `link`: a mirror end, then a words page, then
/// optionally the acceptor's pidfd (`None`, and `link` closed, when it is not there).
pub(crate) fn take_offer(link: OwnedFd) -> Option<Offer> {
    let their_end = receive(link.as_fd(), MIRROR_END)?;
    let page = receive(link.as_fd(), WORDS_PAGE)?;
    let their_pidfd = receive(link.as_fd(), PIDFD);
    Some(Offer {
        link,
        their_end,
        page,
        their_pidfd,
    })
}

/// Accepts one queued connection (nonblocking): `Some(None)` for one that is not of our user
/// (closed), `None` when nothing is queued.
fn accept(listener: BorrowedFd<'_>) -> Option<Option<OwnedFd>> {
    // SAFETY: plain accept4(2) on our listener; the peer address is not wanted.
    let fd = unsafe {
        libc::accept4(
            listener.as_raw_fd(),
            core::ptr::null_mut(),
            core::ptr::null_mut(),
            libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
        )
    };
    owned(fd).map(|socket| Some(socket).filter(|socket| peer_is_same_user(socket.as_fd())))
}

/// `SO_PEERCRED` of the other end: its uid, and its pid as the kernel translates it into our
/// pid namespace (0 when it has none here).
fn peer_credentials(socket: BorrowedFd<'_>) -> Option<libc::ucred> {
    // SAFETY: plain data, zero is valid.
    let mut cred: libc::ucred = unsafe { core::mem::zeroed() };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `cred`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred)
}

/// `SO_PEERCRED` says the other end runs under our effective uid.
fn peer_is_same_user(socket: BorrowedFd<'_>) -> bool {
    peer_credentials(socket).is_some_and(|cred| cred.uid == effective_uid())
}

/// The process at the other end of exchange connection `socket`, as the kernel names it to
/// us (see "Who the peer is"): the translated pid, and `passed` (a pidfd the peer sent) or
/// else one of our own making. Says nothing (`is_known` false) when the peer has no pid
/// in our namespace and no pidfd could be had.
pub(crate) fn peer_process(
    socket: BorrowedFd<'_>,
    passed: Option<OwnedFd>,
) -> san_shm::PeerProcess {
    let pid = peer_credentials(socket)
        .and_then(|cred| u32::try_from(cred.pid).ok())
        .filter(|&pid| pid != 0);
    let pidfd = passed
        .or_else(|| peer_pidfd(socket))
        .or_else(|| pid.and_then(san_shm::pidfd_open));
    san_shm::PeerProcess { pid, pidfd }
}

/// `SO_PEERPIDFD`: a pidfd of the process at the other end (`None` before Linux 6.5).
fn peer_pidfd(socket: BorrowedFd<'_>) -> Option<OwnedFd> {
    let option = SO_PEERPIDFD?;
    let mut fd: libc::c_int = -1;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `fd`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&mut fd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    owned(fd)
}

/// A pidfd of this process, to pass to the peer (`None` on kernels without pidfds).
pub(crate) fn own_pidfd() -> Option<OwnedFd> {
    san_shm::pidfd_open(std::process::id())
}

/// Receives one descriptor tagged `tag` (nonblocking): `None` if nothing is queued yet or
/// the message is not what the protocol sends.
pub(crate) fn receive(socket: BorrowedFd<'_>, tag: u8) -> Option<OwnedFd> {
    let mut byte = [0u8; 1];
    match crate::mirror::recv_fd(socket, &mut byte) {
        Ok((1, Some(fd))) if byte[0] == tag => Some(fd),
        _ => None,
    }
}

/// Sends one descriptor tagged `tag`.
pub(crate) fn send(socket: BorrowedFd<'_>, fd: BorrowedFd<'_>, tag: u8) -> bool {
    matches!(crate::mirror::send_fd(socket, fd, &[tag]), Ok(1))
}

/// The page both processes map, holding the two sides' [`MirrorWords`]. Its memfd is closed
/// once mapped (the mapping keeps the page): a SAN socket holds one descriptor fewer.
#[derive(Debug)]
pub(crate) struct WordsPage {
    base: *mut u8,
}

// SAFETY: the page holds only atomics; the pointer is valid until drop.
unsafe impl Send for WordsPage {}
// SAFETY: as above; shared access goes through atomics only.
unsafe impl Sync for WordsPage {}

impl WordsPage {
    /// A fresh zeroed page (the acceptor creates it; all-zero words are the initial state),
    /// with its memfd for the peer (to pass on, then close).
    pub(crate) fn create() -> Option<(WordsPage, OwnedFd)> {
        // Not moved to a high number: it is closed before the hook returns.
        let fd = san_shm::memfd_sealable(c"sandirect-mirror").ok()?;
        // Allocated, not only sized: the words are written through a shared mapping, where
        // a page the kernel cannot supply would be SIGBUS instead of a failed set-up. Then
        // sealed: the peer maps it too, and a page it could truncate under our mapping would
        // be SIGBUS here.
        san_shm::allocate_file(fd.as_fd(), PAGE).ok()?;
        san_shm::seal_size(fd.as_fd()).ok()?;
        let page = WordsPage::map(fd.as_fd())?;
        Some((page, fd))
    }

    /// Maps a page received from the acceptor (the caller closes the memfd afterwards);
    /// refuses anything that is not a page-sized memfd sealed against shrinking (see
    /// [`WordsPage::create`]).
    pub(crate) fn map(memfd: BorrowedFd<'_>) -> Option<WordsPage> {
        // The seals before the size: sealed, the size cannot change after it was read.
        if !san_shm::size_sealed(memfd) {
            return None;
        }
        // SAFETY: plain data, zero is valid.
        let mut stat: libc::stat = unsafe { core::mem::zeroed() };
        // SAFETY: fstat writes a whole `struct stat`.
        if unsafe { libc::fstat(memfd.as_raw_fd(), &mut stat) } != 0
            || stat.st_mode & libc::S_IFMT != libc::S_IFREG
            || stat.st_size != PAGE as libc::off_t
        {
            return None;
        }
        // SAFETY: a fresh shared mapping of a file of exactly PAGE bytes (checked above).
        let base = unsafe {
            libc::mmap(
                core::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        Some(WordsPage { base: base.cast() })
    }

    fn words(&self, side: usize) -> &MirrorWords {
        // SAFETY: the offsets are inside the page, aligned for MirrorWords (two u32 atomics),
        // and all-zero bytes are a valid MirrorWords; the mapping lives as long as `self`.
        unsafe { &*self.base.add(WORDS_OFFSETS[side & 1]).cast::<MirrorWords>() }
    }
}

impl Drop for WordsPage {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly the mapping made in `map`.
        unsafe { libc::munmap(self.base.cast(), PAGE) };
    }
}

/// One side's words inside a shared [`WordsPage`] (what [`crate::mirror::Mirror`] derefs).
#[derive(Clone, Debug)]
pub(crate) struct SideWords {
    page: Arc<WordsPage>,
    side: usize,
}

impl SideWords {
    /// The words of `side` (0: the connecting side, 1: the acceptor).
    pub(crate) fn new(page: Arc<WordsPage>, side: usize) -> SideWords {
        SideWords { page, side }
    }
}

impl Deref for SideWords {
    type Target = MirrorWords;

    fn deref(&self) -> &MirrorWords {
        self.page.words(self.side)
    }
}
