//! Logging: `tracing` events on stderr when `SANDIRECT_LOG` names a level, nothing (and no
//! cost) otherwise. The writer is one raw `write(2)` per event and the timer reads no lock, so
//! a fork can never leave a logging lock held in the child.

use crate::real;

/// Installs the subscriber for `level` (the value of `SANDIRECT_LOG`); `None`: logging off.
pub fn install(level: Option<&str>) {
    let Some(level) = level else { return };
    let Ok(parsed) = level.parse::<tracing::Level>() else {
        eprintln!("sandirect: SANDIRECT_LOG={level:?} is not a level (error..trace); logging off");
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_max_level(parsed)
        .with_ansi(false)
        .with_writer(|| RawStderr)
        .with_timer(WallClockAndPid)
        .try_init();
}

/// Log time stamps: wall-clock seconds (comparable across processes) and the pid, read at each
/// event (forked workers share a log: nginx's workers all write into one error log).
struct WallClockAndPid;

impl tracing_subscriber::fmt::time::FormatTime for WallClockAndPid {
    fn format_time(
        &self,
        w: &mut tracing_subscriber::fmt::format::Writer<'_>,
    ) -> core::fmt::Result {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        write!(w, "{:.6} pid={}", now.as_secs_f64(), std::process::id())
    }
}

/// stderr through a single `write(2)` per chunk: no lock (std's stderr lock could be left held
/// across fork), no buffering (one formatted event is one write).
struct RawStderr;

impl std::io::Write for RawStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // SAFETY: writing our own buffer to fd 2.
        let written = unsafe { real::write(2, buf.as_ptr().cast(), buf.len()) };
        if written < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(written as usize)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
