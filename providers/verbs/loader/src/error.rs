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
pub enum VerbsSetupError {
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

impl VerbsSetupError {
    /// The ABI status code for this error.
    pub fn to_status(self) -> i32 {
        match self {
            VerbsSetupError::NoDevice => status::NO_DEVICE,
            VerbsSetupError::InvalidArgument => status::INVALID_ARGUMENT,
            VerbsSetupError::TimedOut => status::TIMED_OUT,
            VerbsSetupError::Rejected => status::REJECTED,
            VerbsSetupError::Unreachable => status::UNREACHABLE,
            VerbsSetupError::WrongDevice => status::WRONG_DEVICE,
            VerbsSetupError::ConnectFailed => status::CONNECT_FAILED,
            VerbsSetupError::Os(errno) => -errno.saturating_abs().max(1),
            VerbsSetupError::Internal => status::INTERNAL,
            VerbsSetupError::Declined => status::DECLINED,
        }
    }

    /// Decodes an ABI status: `Ok(())` for [`status::OK`].
    ///
    /// # Errors
    /// The decoded error for any other value (unknown codes become [`VerbsSetupError::Internal`]).
    pub fn check(code: i32) -> Result<(), VerbsSetupError> {
        Err(match code {
            status::OK => return Ok(()),
            status::NO_DEVICE => VerbsSetupError::NoDevice,
            status::INVALID_ARGUMENT => VerbsSetupError::InvalidArgument,
            status::TIMED_OUT => VerbsSetupError::TimedOut,
            status::REJECTED => VerbsSetupError::Rejected,
            status::UNREACHABLE => VerbsSetupError::Unreachable,
            status::WRONG_DEVICE => VerbsSetupError::WrongDevice,
            status::CONNECT_FAILED => VerbsSetupError::ConnectFailed,
            status::DECLINED => VerbsSetupError::Declined,
            negative if negative < 0 => VerbsSetupError::Os(negative.saturating_neg()),
            _ => VerbsSetupError::Internal,
        })
    }
}

impl fmt::Display for VerbsSetupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VerbsSetupError::NoDevice => f.write_str("no RDMA device for that name or address"),
            VerbsSetupError::InvalidArgument => f.write_str("invalid argument"),
            VerbsSetupError::TimedOut => f.write_str("timed out"),
            VerbsSetupError::Rejected => f.write_str("connection rejected by the peer"),
            VerbsSetupError::Unreachable => f.write_str("peer unreachable over RDMA"),
            VerbsSetupError::WrongDevice => {
                f.write_str("connection resolved to another device than the domain's")
            }
            VerbsSetupError::ConnectFailed => f.write_str("connection establishment failed"),
            VerbsSetupError::Declined => {
                f.write_str("connect request declined: no resources to set the connection up")
            }
            VerbsSetupError::Os(errno) => write!(
                f,
                "verbs call failed: {}",
                std::io::Error::from_raw_os_error(*errno)
            ),
            VerbsSetupError::Internal => f.write_str("internal provider error"),
        }
    }
}

impl std::error::Error for VerbsSetupError {}

/// The provider-contract view of a verbs set-up failure, which decides whether the switch may
/// fall back to TCP ([`san_api::SetupError::allows_tcp_fallback`]).
///
/// rdma_cm answers a request to a host without a sandirect listener with a *reject*, the
/// same event as a listener declining: both are [`Rejected`](san_api::SetupError::Rejected)
/// (fallback allowed — a peer without sandirect may still accept TCP). A missing device is
/// [`NoResources`](san_api::SetupError::NoResources), and a failed establishment after the
/// request went out is [`Other`](san_api::SetupError::Other): the RDMA path failing says
/// nothing about the TCP path.
impl From<VerbsSetupError> for san_api::SetupError {
    fn from(error: VerbsSetupError) -> Self {
        match error {
            VerbsSetupError::NoDevice => san_api::SetupError::NoResources,
            VerbsSetupError::TimedOut => san_api::SetupError::TimedOut,
            VerbsSetupError::Rejected => san_api::SetupError::Rejected,
            VerbsSetupError::Unreachable => san_api::SetupError::Unreachable,
            VerbsSetupError::Declined => san_api::SetupError::NoResources,
            VerbsSetupError::Os(errno) => match errno {
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
            VerbsSetupError::InvalidArgument
            | VerbsSetupError::WrongDevice
            | VerbsSetupError::ConnectFailed
            | VerbsSetupError::Internal => san_api::SetupError::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setup_error_survives_the_status_round_trip() {
        for error in [
            VerbsSetupError::NoDevice,
            VerbsSetupError::InvalidArgument,
            VerbsSetupError::TimedOut,
            VerbsSetupError::Rejected,
            VerbsSetupError::Unreachable,
            VerbsSetupError::WrongDevice,
            VerbsSetupError::ConnectFailed,
            VerbsSetupError::Os(libc::ENOMEM),
            VerbsSetupError::Internal,
            VerbsSetupError::Declined,
        ] {
            assert_eq!(VerbsSetupError::check(error.to_status()), Err(error));
        }
        assert_eq!(VerbsSetupError::check(status::OK), Ok(()));
        assert_eq!(
            VerbsSetupError::check(12345),
            Err(VerbsSetupError::Internal),
            "unknown codes are internal errors"
        );
    }

    #[test]
    fn only_refusal_reset_and_unreachability_forbid_the_tcp_fallback() {
        use san_api::SetupError as Contract;
        let cases = [
            (VerbsSetupError::NoDevice, Contract::NoResources),
            (VerbsSetupError::InvalidArgument, Contract::Other),
            (VerbsSetupError::TimedOut, Contract::TimedOut),
            (VerbsSetupError::Rejected, Contract::Rejected),
            (VerbsSetupError::Unreachable, Contract::Unreachable),
            (VerbsSetupError::WrongDevice, Contract::Other),
            (VerbsSetupError::ConnectFailed, Contract::Other),
            (VerbsSetupError::Os(libc::ECONNREFUSED), Contract::Refused),
            (VerbsSetupError::Os(libc::ECONNRESET), Contract::Reset),
            (
                VerbsSetupError::Os(libc::ENETUNREACH),
                Contract::Unreachable,
            ),
            (VerbsSetupError::Os(libc::ENOMEM), Contract::NoResources),
            (VerbsSetupError::Os(libc::EINVAL), Contract::Other),
            (VerbsSetupError::Internal, Contract::Other),
        ];
        for (verbs, contract) in cases {
            assert_eq!(Contract::from(verbs), contract, "{verbs:?}");
        }
        assert!(Contract::from(VerbsSetupError::NoDevice).allows_tcp_fallback());
        assert!(!Contract::from(VerbsSetupError::Unreachable).allows_tcp_fallback());
    }
}
