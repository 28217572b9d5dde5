//! Completion queues with their completion channels.

use std::os::fd::RawFd;
use std::ptr::NonNull;

use rdma_sys::{
    ibv_ack_cq_events, ibv_comp_channel, ibv_cq, ibv_create_comp_channel, ibv_create_cq,
    ibv_destroy_comp_channel, ibv_destroy_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq,
    ibv_wc,
};

use crate::device::Device;
use crate::sys::{errno, set_nonblocking};
use crate::VerbsSetupError;

/// A CQ bound to its own completion channel, whose fd is non-blocking so that it can sit
/// in an epoll set. Must be dropped after every QP that uses it.
pub(crate) struct CompletionQueue {
    cq: NonNull<ibv_cq>,
    channel: NonNull<ibv_comp_channel>,
}

// SAFETY: verbs objects may be used from any thread; the owner serialises use (`&mut`).
unsafe impl Send for CompletionQueue {}

impl CompletionQueue {
    pub(crate) fn create(device: &Device, depth: u32) -> Result<Self, VerbsSetupError> {
        let depth = i32::try_from(depth).map_err(|_| VerbsSetupError::InvalidArgument)?;
        // SAFETY: live context (see `Device`).
        let channel = unsafe { ibv_create_comp_channel(device.context.as_ptr()) };
        let channel = NonNull::new(channel).ok_or_else(|| VerbsSetupError::Os(errno()))?;
        // SAFETY: live context and channel; no CQ context pointer is used.
        let cq = unsafe {
            ibv_create_cq(
                device.context.as_ptr(),
                depth,
                std::ptr::null_mut(),
                channel.as_ptr(),
                0,
            )
        };
        let Some(cq) = NonNull::new(cq) else {
            let error = VerbsSetupError::Os(errno());
            // SAFETY: created above, no CQ uses it.
            unsafe { ibv_destroy_comp_channel(channel.as_ptr()) };
            return Err(error);
        };
        let queue = Self { cq, channel };
        set_nonblocking(queue.fd())?;
        Ok(queue)
    }

    pub(crate) fn as_ptr(&self) -> *mut ibv_cq {
        self.cq.as_ptr()
    }

    /// The completion channel's fd (readable after an armed CQ got a completion).
    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: the channel is live; `fd` is set at creation and never changes.
        unsafe { (*self.channel.as_ptr()).fd }
    }

    /// Moves up to `out.len()` completions into `out`.
    pub(crate) fn poll(&mut self, out: &mut [ibv_wc]) -> Result<usize, i32> {
        let want = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: live CQ; `out` has room for `want` entries.
        let got = unsafe { ibv_poll_cq(self.cq.as_ptr(), want, out.as_mut_ptr()) };
        usize::try_from(got).map_err(|_| got)
    }

    /// Requests an event on the channel for the next completion.
    /// With `solicited_only`, only a receive of a message sent with the solicited flag (or a
    /// failed completion) raises the event.
    pub(crate) fn arm(&mut self, solicited_only: bool) -> Result<(), i32> {
        // SAFETY: live CQ.
        match unsafe { ibv_req_notify_cq(self.cq.as_ptr(), i32::from(solicited_only)) } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }

    /// Consumes one pending channel event (non-blocking) and acknowledges it: one system
    /// call where [`Self::consume_events`] needs a second to learn the channel is empty
    /// (one event per arm is the rule; a second one waiting keeps the fd readable and is
    /// consumed by the next caller that wakes on it).
    pub(crate) fn consume_one_event(&mut self) -> bool {
        let mut cq: *mut ibv_cq = std::ptr::null_mut();
        let mut context: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: live channel (non-blocking fd: returns -1/EAGAIN when empty); out pointers
        // valid.
        if unsafe { ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut context) } != 0 {
            return false;
        }
        // SAFETY: the event was for our CQ (the only one on this channel); ack once.
        unsafe { ibv_ack_cq_events(cq, 1) };
        true
    }

    /// Consumes every pending channel event (non-blocking) and acknowledges it at once, so
    /// that destroying the CQ never waits for unacknowledged events. Returns how many.
    pub(crate) fn consume_events(&mut self) -> u32 {
        let mut count = 0;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut context: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: live channel (non-blocking fd: returns -1/EAGAIN when empty); out
            // pointers valid.
            if unsafe { ibv_get_cq_event(self.channel.as_ptr(), &mut cq, &mut context) } != 0 {
                return count;
            }
            // SAFETY: the event was for our CQ (the only one on this channel); ack once.
            unsafe { ibv_ack_cq_events(cq, 1) };
            count += 1;
        }
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: no QP uses the CQ any more (owners drop QPs first) and every event was
        // acknowledged (`consume_events` acks immediately); each object is freed once,
        // the CQ before its channel.
        unsafe {
            ibv_destroy_cq(self.cq.as_ptr());
        }
        // SAFETY: the channel has no CQ left.
        unsafe {
            ibv_destroy_comp_channel(self.channel.as_ptr());
        }
    }
}
