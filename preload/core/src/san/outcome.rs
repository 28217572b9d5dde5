//! What a SAN socket's stream operation answers when it moved no bytes: an errno for the
//! application, or a turn of the stream that the call's loop acts on and never reports.

use core::ffi::c_int;

use crate::errno::Errno;

/// The answer of a SAN entry point the hooks call (`send_iov`, `recv_iov`): `None` when the real call is to be made after all; `Some(Ok(value))`,
/// the call's count or status (a partial count included); `Some(Err(errno))`, the call fails
/// with that errno. The errno is data: a SAN entry point never leaves it in the thread's
/// `errno` for its caller.
pub type SanCall<T> = Option<Result<T, Errno>>;

/// Why a stream operation of a SAN socket (`SanSocket::send`, `recv`,
/// `start_send_rendezvous`) moved no bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SanError {
    /// The call fails with this errno (`EAGAIN`: nothing can move now).
    Errno(c_int),
    /// The SAN part of the stream is over in this direction (a downgrade, see
    /// `SanSocket::begin_downgrade`): the rest of it is on kernel TCP.
    Downgraded,
    /// The receive found a rendezvous segment at the head of the stream, `len` bytes of it
    /// unread: the caller receives it zero-copy (`SanSocket::start_recv_rendezvous`).
    SegmentAhead {
        /// Bytes of the segment still unread.
        len: u64,
    },
}

impl SanError {
    /// The errno the application sees: the errno itself; for a turn of the stream, which a
    /// call's loop acts on before it could reach the application, what the switch reports
    /// when one leaks (`switch::error`: `ENOTCONN` for a downgrade, `EAGAIN` for a segment).
    pub(crate) const fn errno(self) -> c_int {
        match self {
            SanError::Errno(errno) => errno,
            SanError::Downgraded => libc::ENOTCONN,
            SanError::SegmentAhead { .. } => libc::EAGAIN,
        }
    }
}

impl From<switch::error::SendError> for SanError {
    /// The switch's answer to a send (a downgrade stays a turn of the stream).
    fn from(error: switch::error::SendError) -> SanError {
        match error {
            switch::error::SendError::Downgraded => SanError::Downgraded,
            other => SanError::Errno(other.errno()),
        }
    }
}

impl From<switch::error::RecvError> for SanError {
    /// The switch's answer to a receive (a downgrade and a rendezvous segment stay turns of
    /// the stream).
    fn from(error: switch::error::RecvError) -> SanError {
        match error {
            switch::error::RecvError::Downgraded => SanError::Downgraded,
            switch::error::RecvError::RemoteSegment { len } => SanError::SegmentAhead { len },
            other => SanError::Errno(other.errno()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switch::error::{RecvError, SendError};

    #[test]
    fn the_switch_errors_keep_their_errno_and_the_turns_of_the_stream() {
        assert_eq!(
            SanError::from(SendError::WouldBlock),
            SanError::Errno(libc::EAGAIN)
        );
        assert_eq!(
            SanError::from(SendError::Closed),
            SanError::Errno(libc::EPIPE)
        );
        assert_eq!(
            SanError::from(SendError::TooLong),
            SanError::Errno(libc::EMSGSIZE)
        );
        assert_eq!(SanError::from(SendError::Downgraded), SanError::Downgraded);
        assert_eq!(
            SanError::from(RecvError::Interrupted),
            SanError::Errno(libc::EINTR)
        );
        assert_eq!(SanError::from(RecvError::Downgraded), SanError::Downgraded);
        assert_eq!(
            SanError::from(RecvError::RemoteSegment { len: 1 }),
            SanError::SegmentAhead { len: 1 }
        );
    }

    #[test]
    fn a_turn_of_the_stream_that_leaks_is_the_switch_s_errno() {
        assert_eq!(SanError::Downgraded.errno(), SendError::Downgraded.errno());
        assert_eq!(SanError::Downgraded.errno(), RecvError::Downgraded.errno());
        assert_eq!(
            SanError::SegmentAhead { len: 1 }.errno(),
            RecvError::RemoteSegment { len: 1 }.errno()
        );
        assert_eq!(SanError::Errno(libc::EPIPE).errno(), libc::EPIPE);
    }
}
