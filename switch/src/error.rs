//! # Errors of the switch (rustls-style taxonomy) and their errno mapping
//!
//! [`Error`] is what the session returns from its `handle_*` inputs: every variant except
//! [`Error::InvalidState`] also moves the session to a terminal state. [`SendError`] and
//! [`RecvError`] are the application-facing results of `send`/`recv`, shaped after the errno a
//! Linux TCP socket would give; [`SendError::errno`] and [`RecvError::errno`] are the one place
//! where they become numbers.

use core::fmt;
use san_api::{CompletionError, PostError};

/// Linux errno values used by the switch. Literal values (the switch has no libc): they are
/// the x86-64/aarch64 Linux numbers, identical on every Linux architecture we target.
pub mod errno {
    /// Interrupted system call.
    pub const EINTR: i32 = 4;
    /// Bad address.
    pub const EFAULT: i32 = 14;
    /// Resource temporarily unavailable (`EWOULDBLOCK`).
    pub const EAGAIN: i32 = 11;
    /// Invalid argument.
    pub const EINVAL: i32 = 22;
    /// Broken pipe.
    pub const EPIPE: i32 = 32;
    /// Message too long.
    pub const EMSGSIZE: i32 = 90;
    /// Connection reset by peer.
    pub const ECONNRESET: i32 = 104;
    /// No buffer space available.
    pub const ENOBUFS: i32 = 105;
    /// Transport endpoint is not connected.
    pub const ENOTCONN: i32 = 107;
}

/// Why a session failed. `#[non_exhaustive]`: later versions add variants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Error {
    /// The peer broke the protocol. The session is reset.
    PeerMisbehaved(PeerMisbehaved),
    /// The peer speaks a protocol we cannot use (negotiation failed before any data moved
    /// on the SAN): the caller falls back to kernel TCP.
    PeerIncompatible(PeerIncompatible),
    /// The provider reported a failure. The session is reset.
    Provider(ProviderError),
    /// The call is not valid in the session's current state (caller bug; state unchanged).
    InvalidState,
}

impl Error {
    /// True when the caller should carry the connection over kernel TCP instead (only
    /// possible during negotiation, before any application byte moved on the SAN).
    pub const fn is_fallback(&self) -> bool {
        matches!(self, Error::PeerIncompatible(_))
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::PeerMisbehaved(why) => write!(f, "peer misbehaved: {why:?}"),
            Error::PeerIncompatible(why) => write!(f, "peer incompatible: {why:?}"),
            Error::Provider(why) => write!(f, "provider error: {why}"),
            Error::InvalidState => f.write_str("call not valid in the session's state"),
        }
    }
}

impl From<PeerMisbehaved> for Error {
    fn from(why: PeerMisbehaved) -> Self {
        Error::PeerMisbehaved(why)
    }
}

impl From<PeerIncompatible> for Error {
    fn from(why: PeerIncompatible) -> Self {
        Error::PeerIncompatible(why)
    }
}

impl From<ProviderError> for Error {
    fn from(why: ProviderError) -> Self {
        Error::Provider(why)
    }
}

/// Specific protocol violations by the peer. A flat list, one variant per check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PeerMisbehaved {
    /// The bytes are not a valid control message (see [`crate::wire`]).
    MalformedMessage,
    /// A second `Hello`.
    UnexpectedHello,
    /// Anything but `Hello` before the peer's `Hello`.
    MessageBeforeHello,
    /// A message arrived although the peer had no credit left.
    CreditOverrun,
    /// A data message used one of the reserved credits.
    ReservedCreditMisuse,
    /// The peer returned more credits than we ever consumed.
    ExcessCredits,
    /// A message larger than our receive slot.
    MessageTooLong,
    /// A rendezvous message that matches no rendezvous in progress.
    UnknownRendezvous,
    /// A second rendezvous started before the first ended.
    RendezvousOverlap,
    /// A rendezvous length or offset that contradicts the rendezvous state.
    RendezvousLengthMismatch,
    /// A rendezvous start in the mode the negotiation did not select.
    UnexpectedRendezvousMode,
    /// Data after the peer's `Fin`.
    DataAfterFin,
    /// Data, a rendezvous start or `Fin` after the peer's `Downgrade` (its stream goes on
    /// over kernel TCP, so nothing of it may follow on the SAN).
    DataAfterDowngrade,
    /// A second `Downgrade`.
    UnexpectedDowngrade,
}

/// Why [`crate::session::Session::downgrade`] refused. Nothing changed in the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DowngradeError {
    /// The peer did not announce `caps::DOWNGRADE` in its hello: the stream cannot move back
    /// to kernel TCP live.
    Unsupported,
    /// The session was reset: there is no stream left to move.
    Reset,
    /// Negotiation fell back: the stream is on kernel TCP already.
    FellBack,
}

impl fmt::Display for DowngradeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DowngradeError::Unsupported => f.write_str("the peer cannot downgrade to kernel TCP"),
            DowngradeError::Reset => f.write_str("the session was reset"),
            DowngradeError::FellBack => f.write_str("the session fell back to kernel TCP"),
        }
    }
}

/// Why negotiation failed (the caller falls back to kernel TCP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PeerIncompatible {
    /// The peer's protocol version is not ours.
    Version {
        /// The version the peer announced.
        peer: u16,
    },
    /// The peer posts too few receive slots for the credit reserve.
    TooFewSlots {
        /// The peer's count.
        peer: u16,
    },
    /// The peer's slots cannot hold the largest control message.
    SlotTooSmall {
        /// The peer's slot size.
        peer: u32,
    },
}

/// A failure reported by the provider, named after what failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProviderError {
    /// A work request completed with an error.
    Completion(CompletionError),
    /// Posting a work request failed.
    Post(PostError),
}

impl fmt::Display for ProviderError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProviderError::Completion(e) => write!(f, "completion failed: {e}"),
            ProviderError::Post(e) => write!(f, "post failed: {e}"),
        }
    }
}

/// Result of a send, errno-shaped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SendError {
    /// No send space (credits, buffer, or a rendezvous in progress): `EAGAIN`.
    WouldBlock,
    /// The stream was shut down for writing or closed: `EPIPE`.
    Closed,
    /// The connection was reset (by the peer or a provider failure): `ECONNRESET`.
    Reset,
    /// Registration or buffer allocation failed: `ENOBUFS`.
    NoBuffers,
    /// The handshake has not finished: `ENOTCONN` (the preload waits for `Established`).
    NotConnected,
    /// A rendezvous prefix longer than one message: `EMSGSIZE`.
    TooLong,
    /// Malformed arguments (empty rendezvous rest, range outside its registration, …): `EINVAL`.
    InvalidArgument,
    /// The session is moving (or moved) the stream back to kernel TCP: the caller writes
    /// these bytes to the kernel TCP socket instead (the peer reads it after our
    /// `Downgrade`). Never meant for the application; `ENOTCONN` if it leaks.
    Downgraded,
    /// The application's buffer could not be read (the process may not access it): nothing
    /// was taken. `EFAULT`.
    BadAddress,
}

impl SendError {
    /// The Linux errno for this error.
    pub const fn errno(&self) -> i32 {
        match self {
            SendError::WouldBlock => errno::EAGAIN,
            SendError::Closed => errno::EPIPE,
            SendError::Reset => errno::ECONNRESET,
            SendError::NoBuffers => errno::ENOBUFS,
            SendError::NotConnected => errno::ENOTCONN,
            SendError::TooLong => errno::EMSGSIZE,
            SendError::InvalidArgument => errno::EINVAL,
            SendError::Downgraded => errno::ENOTCONN,
            SendError::BadAddress => errno::EFAULT,
        }
    }
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "send failed: {self:?} (errno {})", self.errno())
    }
}

/// Result of a receive, errno-shaped (end of stream is `Ok(0)`, as in Linux).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecvError {
    /// Nothing to read yet: `EAGAIN`.
    WouldBlock,
    /// The next bytes of the stream are a rendezvous segment of `len` bytes that must be
    /// received zero-copy with `post_recv` (the driver registers the application buffer and
    /// posts it; never returned to the application). Maps to `EAGAIN` if it ever leaks.
    RemoteSegment {
        /// Bytes of the segment still unread.
        len: u64,
    },
    /// `post_recv` was called but the head of the stream is inline data (use `recv`), or a
    /// zero-copy receive is already posted: `EAGAIN` to callers that loop.
    NotRemote,
    /// A zero-copy receive ended without data (the rendezvous was aborted, or the sink's
    /// registration was invalidated); the stream is intact. The driver simply receives
    /// again: `EINTR`.
    Interrupted,
    /// The connection was reset: `ECONNRESET`.
    Reset,
    /// The handshake has not finished: `ENOTCONN`.
    NotConnected,
    /// Unsupported flags (MSG_OOB without urgent data) or an empty buffer: `EINVAL`.
    InvalidArgument,
    /// Every byte the peer sent over the SAN was read and the peer downgraded: the stream
    /// continues on kernel TCP (read it there). Not an end of stream. Never meant for the
    /// application; `ENOTCONN` if it leaks.
    Downgraded,
    /// The application's buffer could not be written (the process may not access it): the
    /// bytes stay unread. `EFAULT`.
    BadAddress,
}

impl RecvError {
    /// The Linux errno for this error.
    pub const fn errno(&self) -> i32 {
        match self {
            RecvError::WouldBlock | RecvError::RemoteSegment { .. } | RecvError::NotRemote => {
                errno::EAGAIN
            }
            RecvError::Interrupted => errno::EINTR,
            RecvError::Reset => errno::ECONNRESET,
            RecvError::NotConnected | RecvError::Downgraded => errno::ENOTCONN,
            RecvError::InvalidArgument => errno::EINVAL,
            RecvError::BadAddress => errno::EFAULT,
        }
    }
}

impl fmt::Display for RecvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "receive failed: {self:?} (errno {})", self.errno())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_values_are_the_linux_ones() {
        assert_eq!(SendError::WouldBlock.errno(), 11);
        assert_eq!(SendError::Closed.errno(), 32);
        assert_eq!(SendError::Reset.errno(), 104);
        assert_eq!(SendError::NoBuffers.errno(), 105);
        assert_eq!(RecvError::Reset.errno(), 104);
        assert_eq!(RecvError::NotConnected.errno(), 107);
        assert_eq!(SendError::BadAddress.errno(), 14);
        assert_eq!(RecvError::BadAddress.errno(), 14);
    }

    #[test]
    fn only_incompatibility_falls_back_to_tcp() {
        assert!(Error::PeerIncompatible(PeerIncompatible::Version { peer: 2 }).is_fallback());
        assert!(!Error::PeerMisbehaved(PeerMisbehaved::CreditOverrun).is_fallback());
        assert!(!Error::InvalidState.is_fallback());
    }
}
