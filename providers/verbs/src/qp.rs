//! Posting work requests on a queue pair (owned by its rdma_cm id, see `cm`).

use std::ptr::NonNull;

use rdma_sys::{
    ibv_modify_qp, ibv_post_recv, ibv_post_send, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask,
    ibv_qp_state, ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode,
};

/// What a send-queue work request does.
#[derive(Clone, Copy, Debug)]
pub(crate) enum SendOp {
    Send,
    Write { remote_addr: u64, rkey: u32 },
    Read { remote_addr: u64, rkey: u32 },
}

/// A non-owning handle to a live QP. Its owner (`cm::CmId`) destroys the QP.
#[derive(Clone, Copy)]
pub(crate) struct QueuePair {
    qp: NonNull<ibv_qp>,
}

impl QueuePair {
    pub(crate) fn new(qp: NonNull<ibv_qp>) -> Self {
        Self { qp }
    }

    /// Posts one signalled send-queue work request with one scatter/gather entry.
    ///
    /// # Safety
    /// The QP must be live. The memory named by `sge` must stay registered (under
    /// `sge.lkey`) and, for a read sink, not be accessed by Rust code, until the work
    /// request's completion has been polled or the QP has been destroyed.
    ///
    /// # Errors
    /// The errno-style code from the provider (ENOMEM: send queue full, EINVAL).
    pub(crate) unsafe fn post_send(
        &self,
        wr_id: u64,
        op: SendOp,
        mut sge: ibv_sge,
        signaled: bool,
    ) -> Result<(), i32> {
        // SAFETY: ibv_send_wr is plain data; all-zero is a valid "no flags" request.
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        // An unsignaled request completes silently when it succeeds (a failed one always
        // completes, with its id).
        wr.send_flags = if signaled {
            ibv_send_flags::IBV_SEND_SIGNALED.0
        } else {
            0
        };
        match op {
            SendOp::Send => {
                wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
                // Every message is solicited: a peer that armed its CQ for solicited events
                // only (to sleep through its own send completions) wakes for each of ours.
                wr.send_flags |= ibv_send_flags::IBV_SEND_SOLICITED.0;
            }
            SendOp::Write { remote_addr, rkey } => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                wr.wr.rdma.remote_addr = remote_addr;
                wr.wr.rdma.rkey = rkey;
            }
            SendOp::Read { remote_addr, rkey } => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                wr.wr.rdma.remote_addr = remote_addr;
                wr.wr.rdma.rkey = rkey;
            }
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP (caller); `wr` and `sge` live across the call (the provider
        // copies them into its queue); buffer lifetime is the caller's contract.
        match unsafe { ibv_post_send(self.qp.as_ptr(), &mut wr, &mut bad) } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }

    /// Posts one receive work request.
    ///
    /// # Safety
    /// As for [`QueuePair::post_send`]: the buffer must stay registered and untouched by
    /// Rust code until the completion is polled or the QP destroyed.
    ///
    /// # Errors
    /// The errno-style code from the provider.
    pub(crate) unsafe fn post_recv(&self, wr_id: u64, mut sge: ibv_sge) -> Result<(), i32> {
        let mut wr = ibv_recv_wr {
            wr_id,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: live QP (caller); `wr`/`sge` live across the call.
        match unsafe { ibv_post_recv(self.qp.as_ptr(), &mut wr, &mut bad) } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }

    /// Moves the QP to the error state: every outstanding work request completes with a
    /// flush error.
    ///
    /// # Safety
    /// The QP must be live.
    pub(crate) unsafe fn set_error(&self) -> Result<(), i32> {
        // SAFETY: ibv_qp_attr is plain data; all-zero is valid.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: live QP (caller); valid attribute struct, mask names only the state.
        match unsafe {
            ibv_modify_qp(
                self.qp.as_ptr(),
                &mut attr,
                ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
            )
        } {
            0 => Ok(()),
            rc => Err(rc),
        }
    }
}
