//! The rules file (libsdp.conf-like): which connections may use the SAN.
//!
//! # Grammar
//!
//! ```text
//! file     = { line }
//! line     = [ rule ] [ "#" comment ] NEWLINE
//! rule     = "use" MODE ROLE PROGRAM ENDPOINT
//! MODE     = "san" | "tcp" | "both"
//! ROLE     = "client" | "server" | "any"
//! PROGRAM  = shell-style glob on the program name (basename of argv[0]): "*", "?", literals
//! ENDPOINT = ADDRESS ":" PORTS
//! ADDRESS  = "*" | IPV4 [ "/" PREFIX ] | "[" IPV6 "]" [ "/" PREFIX ]
//! PORTS    = "*" | PORT | PORT "-" PORT
//! ```
//!
//! Tokens are separated by blanks; keywords are case-sensitive. The endpoint is the *peer* for a
//! client (the address given to `connect`) and the *local* address for a server (the listening
//! address of an accepted connection). IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) match
//! IPv4 rules. Rules are tried in order; the **first match wins**; when none matches the mode is
//! `both`.
//!
//! * `san`  — upgrade to the SAN; if that is impossible the connection still works over TCP
//!   (transparency is never traded away), but the fallback is logged as a warning.
//! * `both` — upgrade when possible, fall back silently.
//! * `tcp`  — never attempt an upgrade.
//!
//! A file that fails to parse is reported once, with file and line, and the whole process then
//! stays on TCP.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::record::unmap_v4;

/// What a rule asks for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum UseMode {
    /// SAN required (fallback still works, but is a warning).
    San,
    /// TCP only.
    Tcp,
    /// SAN when possible, TCP otherwise.
    Both,
}

/// Which side of a connection a rule applies to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// We called `connect`.
    Client,
    /// We accepted.
    Server,
    /// Either.
    Any,
}

/// An address pattern.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum AddressPattern {
    /// `*`.
    Any,
    /// A network: address and prefix length.
    Network(IpAddr, u8),
}

impl AddressPattern {
    /// True when `ip` is inside the pattern (v4-mapped v6 addresses count as v4). A network
    /// written as a v4-mapped v6 address is compared in the v6 space, where its prefix counts
    /// the 96 bits of the mapping too (`[::ffff:10.0.0.0]/104` is `10.0.0.0/8`).
    pub fn matches(&self, ip: IpAddr) -> bool {
        let (network, prefix) = match *self {
            Self::Any => return true,
            Self::Network(network, prefix) => (network, u32::from(prefix)),
        };
        match (network, unmap_v4(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - prefix.min(32)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), ip) => {
                let ip = match ip {
                    IpAddr::V6(ip) => ip,
                    IpAddr::V4(ip) if net.to_ipv4_mapped().is_some() => ip.to_ipv6_mapped(),
                    IpAddr::V4(_) => return false,
                };
                let mask = u128::MAX.checked_shl(128 - prefix.min(128)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// One `use` line.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct Rule {
    /// Requested mode.
    pub mode: UseMode,
    /// Side.
    pub role: Role,
    /// Program glob.
    pub program: String,
    /// Address pattern.
    pub address: AddressPattern,
    /// Inclusive port range.
    pub ports: (u16, u16),
    /// 1-based line in the file.
    pub line: usize,
}

impl Rule {
    fn matches(&self, program: &str, role: Role, ip: IpAddr, port: u16) -> bool {
        (self.role == Role::Any || self.role == role)
            && (self.ports.0..=self.ports.1).contains(&port)
            && self.address.matches(ip)
            && glob_matches(self.program.as_bytes(), program.as_bytes())
    }
}

/// A parsed rules file.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct Config {
    /// Rules in file order.
    pub rules: Vec<Rule>,
}

impl Config {
    /// The mode for a connection of `program` in `role` with endpoint `ip:port`.
    pub fn decide(&self, program: &str, role: Role, ip: IpAddr, port: u16) -> UseMode {
        self.rules
            .iter()
            .find(|rule| rule.matches(program, role, ip, port))
            .map_or(UseMode::Both, |rule| rule.mode)
    }

    /// Keeps only the rules whose program glob matches `program` (done once per process).
    pub fn for_program(&self, program: &str) -> Config {
        Config {
            rules: self
                .rules
                .iter()
                .filter(|rule| glob_matches(rule.program.as_bytes(), program.as_bytes()))
                .map(|rule| Rule {
                    program: "*".into(),
                    ..rule.clone()
                })
                .collect(),
        }
    }
}

/// What is wrong with a rules line.
#[derive(Clone, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum ConfigErrorKind {
    /// The line does not start with `use`.
    ExpectedUse(String),
    /// Fewer than the five tokens of a rule.
    MissingField(&'static str),
    /// More tokens than a rule has.
    TrailingToken(String),
    /// Not `san`, `tcp` or `both`.
    BadMode(String),
    /// Not `client`, `server` or `any`.
    BadRole(String),
    /// The endpoint has no `:` separating address and ports.
    BadEndpoint(String),
    /// Unparsable address.
    BadAddress(String),
    /// Prefix longer than the address.
    BadPrefix(String),
    /// Unparsable port or reversed range.
    BadPorts(String),
}

impl fmt::Display for ConfigErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ExpectedUse(token) => write!(f, "expected `use`, found `{token}`"),
            Self::MissingField(field) => write!(f, "missing {field}"),
            Self::TrailingToken(token) => write!(f, "unexpected `{token}` after the endpoint"),
            Self::BadMode(token) => write!(f, "mode must be san, tcp or both, not `{token}`"),
            Self::BadRole(token) => write!(f, "role must be client, server or any, not `{token}`"),
            Self::BadEndpoint(token) => write!(f, "endpoint `{token}` is not ADDRESS:PORTS"),
            Self::BadAddress(token) => {
                write!(f, "`{token}` is not an address (IPv6 needs [brackets])")
            }
            Self::BadPrefix(token) => write!(f, "bad prefix length `{token}`"),
            Self::BadPorts(token) => write!(f, "bad port or port range `{token}`"),
        }
    }
}

/// A config error with its location.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ConfigError {
    /// The file (as given).
    pub file: String,
    /// 1-based line.
    pub line: usize,
    /// What is wrong.
    pub kind: ConfigErrorKind,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.line, self.kind)
    }
}

impl std::error::Error for ConfigError {}

/// Parses a rules file. `file` names it in errors.
pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
    let mut rules = Vec::new();
    for (number, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("");
        if line.trim().is_empty() {
            continue;
        }
        let rule = parse_rule(line, number + 1).map_err(|kind| ConfigError {
            file: file.to_owned(),
            line: number + 1,
            kind,
        })?;
        rules.push(rule);
    }
    Ok(Config { rules })
}

fn parse_rule(line: &str, number: usize) -> Result<Rule, ConfigErrorKind> {
    let mut tokens = line.split_ascii_whitespace();
    let keyword = tokens
        .next()
        .ok_or(ConfigErrorKind::MissingField("`use`"))?;
    if keyword != "use" {
        return Err(ConfigErrorKind::ExpectedUse(keyword.to_owned()));
    }
    let mode = match tokens.next().ok_or(ConfigErrorKind::MissingField("mode"))? {
        "san" => UseMode::San,
        "tcp" => UseMode::Tcp,
        "both" => UseMode::Both,
        other => return Err(ConfigErrorKind::BadMode(other.to_owned())),
    };
    let role = match tokens.next().ok_or(ConfigErrorKind::MissingField("role"))? {
        "client" => Role::Client,
        "server" => Role::Server,
        "any" => Role::Any,
        other => return Err(ConfigErrorKind::BadRole(other.to_owned())),
    };
    let program = tokens
        .next()
        .ok_or(ConfigErrorKind::MissingField("program"))?
        .to_owned();
    let endpoint = tokens
        .next()
        .ok_or(ConfigErrorKind::MissingField("endpoint"))?;
    if let Some(extra) = tokens.next() {
        return Err(ConfigErrorKind::TrailingToken(extra.to_owned()));
    }
    let (address, ports) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| ConfigErrorKind::BadEndpoint(endpoint.to_owned()))?;
    Ok(Rule {
        mode,
        role,
        program,
        address: parse_address(address)?,
        ports: parse_ports(ports)?,
        line: number,
    })
}

fn parse_address(text: &str) -> Result<AddressPattern, ConfigErrorKind> {
    if text == "*" {
        return Ok(AddressPattern::Any);
    }
    let (address, prefix) = match text.rsplit_once('/') {
        Some((address, prefix)) if !address.ends_with(':') => (address, Some(prefix)),
        _ => (text, None),
    };
    let ip = if let Some(inner) = address.strip_prefix('[').and_then(|a| a.strip_suffix(']')) {
        IpAddr::V6(
            inner
                .parse::<Ipv6Addr>()
                .map_err(|_| ConfigErrorKind::BadAddress(text.to_owned()))?,
        )
    } else {
        IpAddr::V4(
            address
                .parse::<Ipv4Addr>()
                .map_err(|_| ConfigErrorKind::BadAddress(text.to_owned()))?,
        )
    };
    let max = if ip.is_ipv4() { 32 } else { 128 };
    let prefix = match prefix {
        None => max,
        Some(prefix) => prefix
            .parse::<u8>()
            .ok()
            .filter(|&p| p <= max)
            .ok_or_else(|| ConfigErrorKind::BadPrefix(prefix.to_owned()))?,
    };
    Ok(AddressPattern::Network(ip, prefix))
}

fn parse_ports(text: &str) -> Result<(u16, u16), ConfigErrorKind> {
    if text == "*" {
        return Ok((0, u16::MAX));
    }
    let bad = || ConfigErrorKind::BadPorts(text.to_owned());
    let (low, high) = text.split_once('-').unwrap_or((text, text));
    let low: u16 = low.parse().map_err(|_| bad())?;
    let high: u16 = high.parse().map_err(|_| bad())?;
    if low > high {
        return Err(bad());
    }
    Ok((low, high))
}

/// Shell-style glob: `*` any run, `?` one byte, everything else literal. Iterative with one
/// backtrack point, so hostile patterns stay linear-ish (no recursion, no panics).
pub fn glob_matches(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((star_p, star_t)) => {
                    p = star_p + 1;
                    t = star_t + 1;
                    star = Some((star_p, star_t + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn globs() {
        assert!(glob_matches(b"*", b""));
        assert!(glob_matches(b"redis-*", b"redis-server"));
        assert!(glob_matches(b"r?dis*r", b"redis-server"));
        assert!(!glob_matches(b"redis", b"redis-server"));
        assert!(glob_matches(b"*a*b*c", b"xxaxxbxxc"));
        assert!(!glob_matches(b"*a*b*c", b"xxaxxcxxb"));
        assert!(glob_matches(b"", b""));
        assert!(!glob_matches(b"", b"x"));
    }

    #[test]
    fn first_match_wins_with_roles_ports_and_networks() {
        let config = parse(
            "# comment line\n\
             use tcp client * 10.0.0.0/8:*        # backups go over TCP\n\
             use san server redis* *:6379\n\
             use san any * [fd00::]/8:1000-2000\n\
             use tcp any * *:*\n",
            "test.conf",
        )
        .unwrap();
        assert_eq!(config.rules.len(), 4);
        assert_eq!(
            config.decide("curl", Role::Client, ip("10.9.8.7"), 80),
            UseMode::Tcp
        );
        assert_eq!(
            config.decide("redis-server", Role::Server, ip("127.0.0.1"), 6379),
            UseMode::San
        );
        assert_eq!(
            config.decide("redis-server", Role::Client, ip("127.0.0.1"), 6379),
            UseMode::Tcp
        );
        assert_eq!(
            config.decide("x", Role::Client, ip("fd12::1"), 1500),
            UseMode::San
        );
        assert_eq!(
            config.decide("x", Role::Client, ip("fd12::1"), 2001),
            UseMode::Tcp
        );
        assert_eq!(
            Config::default().decide("x", Role::Any, ip("1.2.3.4"), 1),
            UseMode::Both
        );
    }

    #[test]
    fn v4_mapped_peers_match_v4_rules() {
        let config = parse("use tcp client * 127.0.0.0/8:*", "f").unwrap();
        assert_eq!(
            config.decide("p", Role::Client, ip("::ffff:127.0.0.1"), 5),
            UseMode::Tcp
        );
        assert_eq!(
            config.decide("p", Role::Client, ip("::1"), 5),
            UseMode::Both
        );
    }

    #[test]
    fn v4_mapped_v6_networks_keep_their_prefix() {
        // Written as IPv6, the prefix counts the 96 bits of the mapping prefix too.
        let config = parse("use tcp any * [::ffff:10.1.2.3]/104:*", "f").unwrap();
        let decide = |peer: &str| config.decide("p", Role::Client, ip(peer), 5);
        assert_eq!(decide("10.9.8.7"), UseMode::Tcp);
        assert_eq!(decide("::ffff:10.200.0.1"), UseMode::Tcp);
        assert_eq!(decide("192.0.2.1"), UseMode::Both);
        assert_eq!(decide("11.1.2.3"), UseMode::Both);
        // The default prefix of an IPv6 address is 128: that one IPv4 address only.
        let single = parse("use tcp any * [::ffff:10.1.2.3]:*", "f").unwrap();
        let decide = |peer: &str| single.decide("p", Role::Client, ip(peer), 5);
        assert_eq!(decide("10.1.2.3"), UseMode::Tcp);
        assert_eq!(decide("192.0.2.1"), UseMode::Both);
        assert_eq!(decide("10.1.2.4"), UseMode::Both);
        // A prefix shorter than the mapping holds every IPv4 address (and IPv6 ones).
        let wide = AddressPattern::Network(ip("::ffff:10.1.2.3"), 80);
        assert!(wide.matches(ip("192.0.2.1")));
        assert!(wide.matches(ip("::1")));
        assert!(!wide.matches(ip("fe80::1")));
        let narrow = AddressPattern::Network(ip("::ffff:10.1.2.3"), 96);
        assert!(narrow.matches(ip("192.0.2.1")));
        assert!(!narrow.matches(ip("::1")));
    }

    #[test]
    fn prefix_zero_and_full_length() {
        assert!(AddressPattern::Network(ip("1.2.3.4"), 0).matches(ip("200.1.1.1")));
        assert!(AddressPattern::Network(ip("1.2.3.4"), 32).matches(ip("1.2.3.4")));
        assert!(!AddressPattern::Network(ip("1.2.3.4"), 32).matches(ip("1.2.3.5")));
        assert!(AddressPattern::Network(ip("::"), 0).matches(ip("fe80::1")));
        assert!(!AddressPattern::Network(ip("::1"), 128).matches(ip("1.2.3.4")));
    }

    #[test]
    fn errors_name_file_line_and_problem() {
        let cases = [
            (
                "use san client *",
                ConfigErrorKind::MissingField("endpoint"),
            ),
            (
                "allow san client * *:*",
                ConfigErrorKind::ExpectedUse("allow".into()),
            ),
            (
                "use fast client * *:*",
                ConfigErrorKind::BadMode("fast".into()),
            ),
            (
                "use san peer * *:*",
                ConfigErrorKind::BadRole("peer".into()),
            ),
            (
                "use san any * 1.2.3.4",
                ConfigErrorKind::BadEndpoint("1.2.3.4".into()),
            ),
            (
                "use san any * ::1:80",
                ConfigErrorKind::BadAddress("::1".into()),
            ),
            (
                "use san any * 1.2.3.4/33:80",
                ConfigErrorKind::BadPrefix("33".into()),
            ),
            (
                "use san any * *:90-80",
                ConfigErrorKind::BadPorts("90-80".into()),
            ),
            (
                "use san any * *:70000",
                ConfigErrorKind::BadPorts("70000".into()),
            ),
            (
                "use san any * *:* extra",
                ConfigErrorKind::TrailingToken("extra".into()),
            ),
        ];
        for (line, kind) in cases {
            let error = parse(&format!("\n# ok\n{line}\n"), "/etc/sandirect.conf").unwrap_err();
            assert_eq!(error.kind, kind, "{line}");
            assert_eq!(error.line, 3);
            assert!(
                error.to_string().starts_with("/etc/sandirect.conf:3: "),
                "{error}"
            );
        }
    }

    #[test]
    fn program_prefiltering_keeps_order() {
        let config = parse("use tcp any nginx *:*\nuse san any * *:*\n", "f").unwrap();
        let for_redis = config.for_program("redis-server");
        assert_eq!(for_redis.rules.len(), 1);
        assert_eq!(
            for_redis.decide("ignored", Role::Client, ip("1.1.1.1"), 1),
            UseMode::San
        );
        assert_eq!(
            config
                .for_program("nginx")
                .decide("", Role::Client, ip("1.1.1.1"), 1),
            UseMode::Tcp
        );
    }
}
