//! A verifying key-value client for the application tests: speaks redis (RESP) or memcached's
//! text protocol over several concurrent `std::net` connections, writes known values of many
//! sizes (1 B to 256 KiB) and reads every one back on a *different* connection, comparing
//! bytes. Then it prints `holding` and keeps its connections open until stdin closes, so the
//! test can read their data path from the published records while they are live.
//!
//! Usage: `app_kv redis|memcached PORT CONNECTIONS KEYS SEED [HOST]` (HOST: the server's IPv4
//! address, default loopback; the cross-host verbs tests name the other address).
//!
//! Every reply byte comes from the server, so parsing never panics: malformed or unexpected
//! replies are errors that name what was expected.

use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::process::ExitCode;
use std::sync::{mpsc, Arc, Barrier};

use integration::pattern::XorShift64;

/// Value sizes cycled through by key index: small, around common buffer sizes, and large enough
/// to need many segments (and, on the SAN, the rendezvous path).
const VALUE_SIZES: [usize; 8] = [1, 63, 512, 1460, 4096, 16_384, 65_537, 262_144];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Protocol {
    Redis,
    Memcached,
}

#[derive(Clone, Copy, Debug)]
struct Settings {
    protocol: Protocol,
    host: IpAddr,
    port: u16,
    connections: usize,
    keys: usize,
    seed: u64,
}

fn parse_arguments() -> Result<Settings, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (host, args) = match args.as_slice() {
        [rest @ .., host] if rest.len() == 5 => (
            host.parse::<IpAddr>()
                .map_err(|_| format!("HOST must be an IP address, not {host:?}"))?,
            rest,
        ),
        all => (IpAddr::V4(Ipv4Addr::LOCALHOST), all),
    };
    let [protocol, port, connections, keys, seed] = args else {
        return Err("usage: app_kv redis|memcached PORT CONNECTIONS KEYS SEED [HOST]".into());
    };
    let number = |text: &str, what: &str| -> Result<u64, String> {
        text.parse()
            .map_err(|_| format!("{what} must be a number, not {text:?}"))
    };
    let protocol = match protocol.as_str() {
        "redis" => Protocol::Redis,
        "memcached" => Protocol::Memcached,
        other => return Err(format!("unknown protocol {other:?}")),
    };
    let port = u16::try_from(number(port, "PORT")?).map_err(|_| "PORT out of range")?;
    let connections = number(connections, "CONNECTIONS")?.clamp(1, 256) as usize;
    let keys = number(keys, "KEYS")?.clamp(1, 100_000) as usize;
    Ok(Settings {
        protocol,
        host,
        port,
        connections,
        keys,
        seed: number(seed, "SEED")?,
    })
}

fn key_name(settings: &Settings, connection: usize, key: usize) -> String {
    format!("sandirect:{}:{connection}:{key}", settings.seed)
}

/// The value stored under a key: its size cycles through [`VALUE_SIZES`], its bytes come from a
/// xorshift generator seeded by the key, so any misplaced, stale or corrupted byte shows.
fn expected_value(settings: &Settings, connection: usize, key: usize) -> Vec<u8> {
    let size = VALUE_SIZES[key % VALUE_SIZES.len()];
    let seed = settings.seed ^ ((connection as u64) << 32) ^ (key as u64) ^ 0x9e37_79b9_7f4a_7c15;
    XorShift64::new(seed).low_bytes(size)
}

struct Client {
    protocol: Protocol,
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

fn protocol_error(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

impl Client {
    fn connect(settings: &Settings) -> io::Result<Client> {
        let stream = TcpStream::connect((settings.host, settings.port))?;
        stream.set_nodelay(true)?;
        Ok(Client {
            protocol: settings.protocol,
            reader: BufReader::new(stream.try_clone()?),
            writer: BufWriter::with_capacity(64 * 1024, stream),
        })
    }

    fn line(&mut self) -> io::Result<String> {
        let mut line = Vec::new();
        self.reader.read_until(b'\n', &mut line)?;
        if !line.ends_with(b"\r\n") {
            return Err(protocol_error(format!(
                "reply line not terminated by CRLF: {:?}",
                String::from_utf8_lossy(&line)
            )));
        }
        line.truncate(line.len() - 2);
        String::from_utf8(line).map_err(|_| protocol_error("reply line is not UTF-8".into()))
    }

    fn set(&mut self, key: &str, value: &[u8]) -> io::Result<()> {
        match self.protocol {
            Protocol::Redis => {
                write!(
                    self.writer,
                    "*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${}\r\n",
                    key.len(),
                    value.len()
                )?;
                self.writer.write_all(value)?;
                self.writer.write_all(b"\r\n")?;
                self.writer.flush()?;
                self.expect_line("+OK")
            }
            Protocol::Memcached => {
                write!(self.writer, "set {key} 0 0 {}\r\n", value.len())?;
                self.writer.write_all(value)?;
                self.writer.write_all(b"\r\n")?;
                self.writer.flush()?;
                self.expect_line("STORED")
            }
        }
    }

    fn get(&mut self, key: &str) -> io::Result<Vec<u8>> {
        match self.protocol {
            Protocol::Redis => {
                write!(
                    self.writer,
                    "*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n",
                    key.len()
                )?;
                self.writer.flush()?;
                let header = self.line()?;
                let length = header
                    .strip_prefix('$')
                    .and_then(|n| n.parse::<usize>().ok())
                    .ok_or_else(|| protocol_error(format!("GET {key}: reply {header:?}")))?;
                self.payload(length)
            }
            Protocol::Memcached => {
                write!(self.writer, "get {key}\r\n")?;
                self.writer.flush()?;
                let header = self.line()?;
                let mut fields = header.split(' ');
                let length = match (fields.next(), fields.next(), fields.next(), fields.next()) {
                    (Some("VALUE"), Some(name), Some(_flags), Some(length)) if name == key => {
                        length.parse::<usize>().ok()
                    }
                    _ => None,
                }
                .ok_or_else(|| protocol_error(format!("get {key}: reply {header:?}")))?;
                let value = self.payload(length)?;
                self.expect_line("END")?;
                Ok(value)
            }
        }
    }

    /// `length` bytes followed by CRLF.
    fn payload(&mut self, length: usize) -> io::Result<Vec<u8>> {
        let mut value = vec![0u8; length + 2];
        self.reader.read_exact(&mut value)?;
        if !value.ends_with(b"\r\n") {
            return Err(protocol_error("value not followed by CRLF".into()));
        }
        value.truncate(length);
        Ok(value)
    }

    fn expect_line(&mut self, expected: &str) -> io::Result<()> {
        let line = self.line()?;
        if line == expected {
            Ok(())
        } else {
            Err(protocol_error(format!(
                "expected {expected:?}, got {line:?}"
            )))
        }
    }

    fn quit(&mut self) -> io::Result<()> {
        match self.protocol {
            Protocol::Redis => {
                self.writer.write_all(b"*1\r\n$4\r\nQUIT\r\n")?;
                self.writer.flush()?;
                self.expect_line("+OK")
            }
            Protocol::Memcached => {
                self.writer.write_all(b"quit\r\n")?;
                self.writer.flush()
            }
        }
    }
}

/// What one connection verified: values and bytes.
type Tally = (usize, usize);

/// Writes this connection's values, waits until every connection has written, verifies its
/// neighbour's values, reports, and then stays connected until `release` is dropped.
fn run_connection(
    settings: Settings,
    connection: usize,
    written: Arc<Barrier>,
    report: mpsc::Sender<io::Result<Tally>>,
    release: mpsc::Receiver<()>,
) -> io::Result<()> {
    let outcome = write_and_verify(&settings, connection, &written);
    let (client, tally) = match outcome {
        Ok(done) => done,
        Err(error) => {
            let _ = report.send(Err(error));
            return Ok(());
        }
    };
    let _ = report.send(Ok(tally));
    // Hold the connection open until the main thread lets go (it drops the sender).
    let _ = release.recv();
    let mut client = client;
    client.quit()
}

fn write_and_verify(
    settings: &Settings,
    connection: usize,
    written: &Barrier,
) -> io::Result<(Client, Tally)> {
    let connected = Client::connect(settings);
    // Every connection reaches the barrier exactly once, even after a failure, so no neighbour
    // waits forever.
    let mut client = match connected {
        Ok(client) => client,
        Err(error) => {
            written.wait();
            return Err(error);
        }
    };
    let mut write_all = || -> io::Result<()> {
        for key in 0..settings.keys {
            let value = expected_value(settings, connection, key);
            client.set(&key_name(settings, connection, key), &value)?;
        }
        Ok(())
    };
    let wrote = write_all();
    written.wait();
    wrote?;
    let owner = (connection + 1) % settings.connections;
    let mut verified_bytes = 0;
    for key in 0..settings.keys {
        let name = key_name(settings, owner, key);
        let value = client.get(&name)?;
        let expected = expected_value(settings, owner, key);
        if value != expected {
            let first_difference = value.iter().zip(&expected).position(|(a, b)| a != b);
            return Err(protocol_error(format!(
                "{name}: read {} bytes, expected {} (first difference at {first_difference:?})",
                value.len(),
                expected.len()
            )));
        }
        verified_bytes += value.len();
    }
    Ok((client, (settings.keys, verified_bytes)))
}

fn main() -> ExitCode {
    let settings = match parse_arguments() {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("app_kv: {message}");
            return ExitCode::from(2);
        }
    };
    let written = Arc::new(Barrier::new(settings.connections));
    let (report, reports) = mpsc::channel();
    let mut releases = Vec::new();
    let workers: Vec<_> = (0..settings.connections)
        .map(|connection| {
            let (written, report) = (Arc::clone(&written), report.clone());
            let (release, released) = mpsc::channel();
            releases.push(release);
            std::thread::spawn(move || {
                run_connection(settings, connection, written, report, released)
            })
        })
        .collect();
    drop(report);
    let (mut values, mut bytes) = (0, 0);
    for outcome in reports.iter().take(settings.connections) {
        match outcome {
            Ok((verified_values, verified_bytes)) => {
                values += verified_values;
                bytes += verified_bytes;
            }
            Err(error) => {
                eprintln!("app_kv: {error}");
                return ExitCode::FAILURE;
            }
        }
    }
    println!(
        "holding: {} connections, wrote and verified {values} values ({bytes} bytes)",
        settings.connections
    );
    let _ = io::stdout().flush();
    let mut line = String::new();
    let _ = io::stdin().lock().read_line(&mut line);
    drop(releases);
    for worker in workers {
        match worker.join() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                eprintln!("app_kv: closing: {error}");
                return ExitCode::FAILURE;
            }
            Err(_) => return ExitCode::FAILURE,
        }
    }
    println!("closed");
    ExitCode::SUCCESS
}
