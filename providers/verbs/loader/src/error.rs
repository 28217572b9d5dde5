//! Errors of loading the provider and of setting up domains and connections.
//!
//! rustls-style taxonomy: one enum per stage, named after what the caller can do about it.
//! [`LoadError::NoProvider`] is the normal outcome on a host without RDMA: fall back to TCP.

use std::fmt;

use crate::abi::status;

/// Why the provider library could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LoadError {
    /// Nothing to use on this host: stay on TCP. Expected, not a fault.
    NoProvider(NoProviderReason),
    /// The library is present but incompatible with this loader (ABI version, symbol).
    Incompatible(String),
}

/// Why there is no provider.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NoProviderReason {
    /// `/sys/class/infiniband` is absent or empty.
    NoDevices,
    /// `dlopen` failed: the library, libibverbs or librdmacm is not installed.
    LibraryMissing(String),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::NoProvider(NoProviderReason::NoDevices) => {
                f.write_str("no RDMA provider: no RDMA devices")
            }
            LoadError::NoProvider(NoProviderReason::LibraryMissing(why)) => {
                write!(f, "no RDMA provider: cannot load library: {why}")
            }
            LoadError::Incompatible(why) => write!(f, "RDMA provider library incompatible: {why}"),
        }
    }
}

impl std::error::Error for LoadError {}

/// Why opening a domain, listening or connecting failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SetupError {
    /// No RDMA device (with that name, or serving that address).
    NoDevice,
    /// An argument was rejected before any verbs call.
    InvalidArgument,
    /// Resolution or establishment did not finish in time.
    TimedOut,
    /// The peer refused the connection (no sandirect listener there, or it declined).
    Rejected,
    /// The peer address or route is unreachable over RDMA.
    Unreachable,
    /// The connection resolved to a device other than the domain's.
    WrongDevice,
    /// Establishment failed after the request was sent (peer vanished, QP error).
    ConnectFailed,
    /// A verbs or rdma_cm call failed with this errno.
    Os(i32),
    /// A bug in the provider (a caught panic, a broken invariant).
    Internal,
    /// Accepting: this side could not set the connection up (memory it may not pin, queue
    /// pairs) and refused the request before any reply went out; the peer sees a rejection.
    Declined,
}

impl SetupError {
    /// The ABI status code for this error.
    pub fn to_status(self) -> i32 {
        match self {
            SetupError::NoDevice => status::NO_DEVICE,
            SetupError::InvalidArgument => status::INVALID_ARGUMENT,
            SetupError::TimedOut => status::TIMED_OUT,
            SetupError::Rejected => status::REJECTED,
            SetupError::Unreachable => status::UNREACHABLE,
            SetupError::WrongDevice => status::WRONG_DEVICE,
            SetupError::ConnectFailed => status::CONNECT_FAILED,
            SetupError::Os(errno) => -errno.saturating_abs().max(1),
            SetupError::Internal => status::INTERNAL,
            SetupError::Declined => status::DECLINED,
        }
    }

    /// Decodes an ABI status: `Ok(())` for [`status::OK`].
    ///
    /// # Errors
    /// The decoded error for any other value (unknown codes become [`SetupError::Internal`]).
    pub fn check(code: i32) -> Result<(), SetupError> {
        Err(match code {
            status::OK => return Ok(()),
            status::NO_DEVICE => SetupError::NoDevice,
            status::INVALID_ARGUMENT => SetupError::InvalidArgument,
            status::TIMED_OUT => SetupError::TimedOut,
            status::REJECTED => SetupError::Rejected,
            status::UNREACHABLE => SetupError::Unreachable,
            status::WRONG_DEVICE => SetupError::WrongDevice,
            status::CONNECT_FAILED => SetupError::ConnectFailed,
            status::DECLINED => SetupError::Declined,
            negative if negative < 0 => SetupError::Os(negative.saturating_neg()),
            _ => SetupError::Internal,
        })
    }
}

impl fmt::Display for SetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SetupError::NoDevice => f.write_str("no RDMA device for that name or address"),
            SetupError::InvalidArgument => f.write_str("invalid argument"),
            SetupError::TimedOut => f.write_str("timed out"),
            SetupError::Rejected => f.write_str("connection rejected by the peer"),
            SetupError::Unreachable => f.write_str("peer unreachable over RDMA"),
            SetupError::WrongDevice => {
                f.write_str("connection resolved to another device than the domain's")
            }
            SetupError::ConnectFailed => f.write_str("connection establishment failed"),
            SetupError::Declined => {
                f.write_str("connect request declined: no resources to set the connection up")
            }
            SetupError::Os(errno) => write!(
                f,
                "verbs call failed: {}",
                std::io::Error::from_raw_os_error(*errno)
            ),
            SetupError::Internal => f.write_str("internal provider error"),
        }
    }
}

impl std::error::Error for SetupError {}

/// The provider-contract view of a verbs set-up failure, which decides whether the switch may
/// fall back to TCP ([`san_api::SetupError::allows_tcp_fallback`]).
///
/// rdma_cm answers a request to a host without a sandirect listener with a *reject*, the
/// same event as a listener declining: both are [`Rejected`](san_api::SetupError::Rejected)
/// (fallback allowed — a peer without sandirect may still accept TCP). A missing device is
/// [`NoResources`](san_api::SetupError::NoResources), and a failed establishment after the
/// request went out is [`Other`](san_api::SetupError::Other): the RDMA path failing says
/// nothing about the TCP path.
impl From<SetupError> for san_api::SetupError {
    fn from(error: SetupError) -> Self {
        match error {
            SetupError::NoDevice => san_api::SetupError::NoResources,
            SetupError::TimedOut => san_api::SetupError::TimedOut,
            SetupError::Rejected => san_api::SetupError::Rejected,
            SetupError::Unreachable => san_api::SetupError::Unreachable,
            SetupError::Declined => san_api::SetupError::NoResources,
            SetupError::Os(errno) => match errno {
                libc::ECONNREFUSED => san_api::SetupError::Refused,
                libc::ECONNRESET => san_api::SetupError::Reset,
                libc::EHOSTUNREACH | libc::ENETUNREACH => san_api::SetupError::Unreachable,
                libc::ETIMEDOUT => san_api::SetupError::TimedOut,
                libc::ENOMEM
                | libc::ENOBUFS
                | libc::EAGAIN
                | libc::ENOSPC
                | libc::EMFILE
                | libc::ENFILE => san_api::SetupError::NoResources,
                _ => san_api::SetupError::Other,
            },
            SetupError::InvalidArgument
            | SetupError::WrongDevice
            | SetupError::ConnectFailed
            | SetupError::Internal => san_api::SetupError::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setup_error_survives_the_status_round_trip() {
        for error in [
            SetupError::NoDevice,
            SetupError::InvalidArgument,
            SetupError::TimedOut,
            SetupError::Rejected,
            SetupError::Unreachable,
            SetupError::WrongDevice,
            SetupError::ConnectFailed,
            SetupError::Os(libc::ENOMEM),
            SetupError::Internal,
            SetupError::Declined,
        ] {
            assert_eq!(SetupError::check(error.to_status()), Err(error));
        }
        assert_eq!(SetupError::check(status::OK), Ok(()));
        assert_eq!(
            SetupError::check(12345),
            Err(SetupError::Internal),
            "unknown codes are internal errors"
        );
    }

    #[test]
    fn only_refusal_reset_and_unreachability_forbid_the_tcp_fallback() {
        use san_api::SetupError as Contract;
        let cases = [
            (SetupError::NoDevice, Contract::NoResources),
            (SetupError::InvalidArgument, Contract::Other),
            (SetupError::TimedOut, Contract::TimedOut),
            (SetupError::Rejected, Contract::Rejected),
            (SetupError::Unreachable, Contract::Unreachable),
            (SetupError::WrongDevice, Contract::Other),
            (SetupError::ConnectFailed, Contract::Other),
            (SetupError::Os(libc::ECONNREFUSED), Contract::Refused),
            (SetupError::Os(libc::ECONNRESET), Contract::Reset),
            (SetupError::Os(libc::ENETUNREACH), Contract::Unreachable),
            (SetupError::Os(libc::ENOMEM), Contract::NoResources),
            (SetupError::Os(libc::EINVAL), Contract::Other),
            (SetupError::Internal, Contract::Other),
        ];
        for (verbs, contract) in cases {
            assert_eq!(Contract::from(verbs), contract, "{verbs:?}");
        }
        assert!(Contract::from(SetupError::NoDevice).allows_tcp_fallback());
        assert!(!Contract::from(SetupError::Unreachable).allows_tcp_fallback());
    }
}
