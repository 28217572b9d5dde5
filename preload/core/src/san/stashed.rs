//! A downgraded socket whose stash still holds bytes (the SAN object of a stash holder): the
//! stash, the epoll sets its eventfd sits in beside the socket, and the identities that let
//! a new image find it again after `exec`.

use core::ffi::c_int;

use super::kernel::file_inode;
use super::stash::Stash;
use crate::real;

/// A downgraded socket whose stash still holds bytes.
#[derive(Debug)]
pub(crate) struct Stashed {
    /// The bytes received over the SAN that the application has not read yet.
    pub stash: Stash,
    /// Epoll sets where the stash's eventfd sits beside the socket: (epfd, events, data).
    sets: Vec<(c_int, u32, u64)>,
    /// The socket's inode: finds its copies in a child's descriptor table (`dup2` onto 0-2
    /// in a `vfork` child, file actions of `posix_spawn`), whatever our table says.
    pub(super) socket_inode: Option<u64>,
    /// The stash memfd's inode: tells whether the number still names it in a child that
    /// closed or reused it (CPython closes every descriptor above 2 before its exec).
    pub(super) memfd_inode: Option<u64>,
}

impl Stashed {
    /// A stash holder for `stash`, of the socket whose inode is `socket_inode`.
    pub(super) fn new(stash: Stash, socket_inode: Option<u64>) -> Stashed {
        // Reads copy the stash into the application's buffers (an image that inherited the
        // stash across exec may never have switched a connection itself).
        crate::fault::arm();
        let memfd_inode = file_inode(stash.memfd()).map(|(_, inode)| inode);
        Stashed {
            stash,
            sets: Vec::new(),
            socket_inode,
            memfd_inode,
        }
    }

    /// Puts the stash's eventfd into epoll set `epfd` beside the socket (registered there
    /// for `events` with `data`), when the registration watches reading.
    pub(super) fn add_to_set(&mut self, epfd: c_int, events: u32, data: u64) {
        if events & libc::EPOLLIN as u32 == 0 {
            return;
        }
        let keep = libc::EPOLLET | libc::EPOLLONESHOT;
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32 | (events & keep as u32),
            u64: data,
        };
        // SAFETY: plain epoll_ctl(2) on the application's epoll instance with our eventfd.
        let rc = unsafe {
            real::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, self.stash.ready_fd(), &mut event)
        };
        if rc == 0 {
            self.sets.push((epfd, events, data));
        }
    }

    fn remove_from_sets(&mut self) {
        for (epfd, _, _) in core::mem::take(&mut self.sets) {
            self.remove_from(epfd);
        }
    }

    /// Takes the stash's eventfd out of epoll set `epfd`.
    fn remove_from(&self, epfd: c_int) {
        // SAFETY: plain epoll_ctl(2).
        unsafe {
            real::epoll_ctl(
                epfd,
                libc::EPOLL_CTL_DEL,
                self.stash.ready_fd(),
                core::ptr::null_mut(),
            )
        };
    }

    /// The socket was added to (or changed in, or removed from) epoll set `epfd`: the
    /// stash's eventfd follows it there while the stash holds bytes.
    pub(super) fn epoll_ctl(&mut self, epfd: c_int, op: c_int, events: u32, data: u64) {
        if let Some(position) = self.sets.iter().position(|&(e, _, _)| e == epfd) {
            self.sets.swap_remove(position);
            self.remove_from(epfd);
        }
        if op != libc::EPOLL_CTL_DEL && self.stash.remaining() > 0 {
            self.add_to_set(epfd, events, data);
        }
    }
}

impl Drop for Stashed {
    fn drop(&mut self) {
        self.remove_from_sets();
    }
}
