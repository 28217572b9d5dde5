//! Who owns a listening TCP socket of this host: one exact `sock_diag` lookup in the kernel's
//! socket table (used to tell a preloaded server of another user from a plain one).

use core::mem::size_of;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// `struct inet_diag_sockid` (`linux/inet_diag.h`): ports and addresses in network order.
#[repr(C)]
#[derive(Clone, Copy)]
struct InetDiagSockId {
    sport: u16,
    dport: u16,
    src: [u8; 16],
    dst: [u8; 16],
    interface: u32,
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2` behind its netlink header.
#[repr(C)]
struct InetDiagRequest {
    header: libc::nlmsghdr,
    family: u8,
    protocol: u8,
    extensions: u8,
    pad: u8,
    states: u32,
    id: InetDiagSockId,
}

/// The listening state of `linux/tcp_states.h`.
const TCP_LISTEN: u32 = 10;
/// `SOCK_DIAG_BY_FAMILY` (`linux/sock_diag.h`).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// Offset of `idiag_uid` in `struct inet_diag_msg` (4 bytes, the 48-byte id, 3 words).
const DIAG_UID_OFFSET: usize = 4 + size_of::<InetDiagSockId>() + 12;

/// The uid owning the TCP socket that accepts connections to `addr` (a listener of this
/// host): the kernel's exact lookup with no remote end, as for an arriving SYN.
pub fn listener_owner(addr: SocketAddr) -> Option<u32> {
    owner(addr, None, 1 << TCP_LISTEN)
}

/// The uid owning the TCP socket of this host whose local end is `local` and whose peer is
/// `remote` (a connection's one end; its other end, if also here, is another socket): what
/// the kernel recorded when that socket was made (a listener's, for an accepted one).
pub fn connection_owner(local: SocketAddr, remote: SocketAddr) -> Option<u32> {
    owner(local, Some(remote), !(1 << TCP_LISTEN)).or_else(|| {
        // An IPv6 socket connected to an IPv4 address names both v4-mapped.
        let mapped = |a: SocketAddr| match a.ip() {
            IpAddr::V4(v4) => Some(SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port())),
            IpAddr::V6(_) => None,
        };
        owner(mapped(local)?, Some(mapped(remote)?), !(1 << TCP_LISTEN))
    })
}

/// One `sock_diag` lookup: the uid of the TCP socket `addr` → `remote` (`None`: no remote
/// end, a listener) in one of `states` (a bit per TCP state).
fn owner(addr: SocketAddr, remote: Option<SocketAddr>, states: u32) -> Option<u32> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by socket() and is owned by nobody else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let octets = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => {
            let mut bytes = [0u8; 16];
            bytes[..4].copy_from_slice(&v4.octets());
            bytes
        }
        IpAddr::V6(v6) => v6.octets(),
    };
    let family = match addr.ip() {
        IpAddr::V4(_) => libc::AF_INET,
        IpAddr::V6(_) => libc::AF_INET6,
    };
    if remote.is_some_and(|remote| remote.is_ipv4() != addr.is_ipv4()) {
        return None;
    }
    let request = InetDiagRequest {
        header: libc::nlmsghdr {
            nlmsg_len: size_of::<InetDiagRequest>() as u32,
            nlmsg_type: SOCK_DIAG_BY_FAMILY,
            nlmsg_flags: libc::NLM_F_REQUEST as u16,
            nlmsg_seq: 1,
            nlmsg_pid: 0,
        },
        family: family as u8,
        protocol: libc::IPPROTO_TCP as u8,
        extensions: 0,
        pad: 0,
        states,
        id: InetDiagSockId {
            sport: addr.port().to_be(),
            dport: remote.map_or(0, |remote| remote.port().to_be()),
            src: octets(addr.ip()),
            dst: remote.map_or([0; 16], |remote| octets(remote.ip())),
            interface: 0,
            // INET_DIAG_NOCOOKIE: any socket.
            cookie: [u32::MAX; 2],
        },
    };
    // SAFETY: plain data, zero is valid.
    let mut kernel: libc::sockaddr_nl = unsafe { core::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: sendto(2) reads the request and the kernel's address, both of the given sizes.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            (&request as *const InetDiagRequest).cast(),
            size_of::<InetDiagRequest>(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return None;
    }
    // The kernel answers inside sendto: the reply is queued already.
    let mut reply = [0u64; 64];
    // SAFETY: recv(2) writes at most the buffer's size.
    let n = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            reply.as_mut_ptr().cast(),
            size_of::<[u64; 64]>(),
            libc::MSG_DONTWAIT,
        )
    };
    let n = usize::try_from(n).ok()?;
    let header_len = size_of::<libc::nlmsghdr>();
    if n < header_len + DIAG_UID_OFFSET + 4 {
        return None;
    }
    // SAFETY: the buffer holds at least a header (checked), and is 8-byte aligned.
    let header = unsafe { &*reply.as_ptr().cast::<libc::nlmsghdr>() };
    if header.nlmsg_type != SOCK_DIAG_BY_FAMILY {
        return None;
    }
    // SAFETY: as above; the byte view of the same buffer, within `n` (checked).
    let bytes = unsafe { core::slice::from_raw_parts(reply.as_ptr().cast::<u8>(), n) };
    let at = header_len + DIAG_UID_OFFSET;
    let state = bytes[header_len + 1];
    (states & (1 << u32::from(state)) != 0)
        .then(|| u32::from_ne_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::effective_uid;

    /// The kernel names the owner of a listener of this host, for its exact address and
    /// through a wildcard one; nothing listens on a closed port.
    #[test]
    fn the_owner_of_a_listener_is_found() {
        let exact = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = exact.local_addr().unwrap().port();
        assert_eq!(
            listener_owner(SocketAddr::from(([127, 0, 0, 1], port))),
            Some(effective_uid())
        );
        let wildcard = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = wildcard.local_addr().unwrap().port();
        assert_eq!(
            listener_owner(SocketAddr::from(([127, 0, 0, 1], port))),
            Some(effective_uid())
        );
        drop(wildcard);
        assert_eq!(
            listener_owner(SocketAddr::from(([127, 0, 0, 1], port))),
            None
        );
    }

    /// Both ends of a connection of this host are found, each by its own 4-tuple.
    #[test]
    fn the_owner_of_each_end_of_a_connection_is_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let (client_end, server_end) = (client.local_addr().unwrap(), client.peer_addr().unwrap());
        assert_eq!(
            connection_owner(client_end, server_end),
            Some(effective_uid())
        );
        assert_eq!(
            connection_owner(server_end, client_end),
            Some(effective_uid())
        );
        drop((client, accepted));
        let nobody = SocketAddr::from(([127, 0, 0, 1], 1));
        assert_eq!(connection_owner(nobody, server_end), None);
    }
}
