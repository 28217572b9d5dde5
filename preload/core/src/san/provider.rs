//! The process-wide resources of the shm provider, made on first use: the segment
//! directory, the domain with its registration cache, the negative cache of plain servers,
//! and the settings read with them.

use core::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::registrations::SharedRegistrations;
use crate::discovery::SegmentDir;
use crate::negative_cache::{NegativeCache, NegativeCacheConfig};
use std::os::fd::{AsFd, BorrowedFd};

/// Process-wide SAN resources, created on first use.
pub(super) struct Provider {
    /// The process-wide domain and registration cache.
    pub(super) registrations: SharedRegistrations,
    /// Servers known to be plain (not preloaded), asked before a probe.
    pub(super) negative: NegativeCache,
    /// Where the segments are created: the directory opened and checked once, reached only
    /// through its descriptor from then on (see `SegmentDir`).
    pub(super) dir: SegmentDir,
    /// Which local ports have a pending client of ours (see `san_shm::PendingPorts`): an
    /// acceptor probes a client's exchange only when its port may have one. `None` (the
    /// table could not be made): every acceptor probes.
    pub(super) pending: Option<san_shm::PendingPorts>,
    /// Whether large blocking sends use the rendezvous (`SANDIRECT_SAN_RENDEZVOUS`).
    rendezvous: bool,
    /// Whether verbs connections offer to RDMA-READ their peers' rendezvous sends
    /// (`SANDIRECT_SAN_RDMA_READ`; `None`: the device's default, see [`rdma_read_offered`]).
    rdma_read: Option<bool>,
}

/// Whether this process offers rendezvous to its peers (the negotiated threshold is the
/// larger of both sides', so one side turning it off turns it off for the connection).
pub(super) fn rendezvous_enabled() -> bool {
    provider().is_some_and(|p| p.rendezvous)
}

/// Whether this process's verbs connections offer READ-mode rendezvous on a device that can
/// read: `SANDIRECT_SAN_RDMA_READ` when set, else READ on RoCE and InfiniBand and WRITE on
/// iWARP, where the sink of a READ needs remote-write rights (a wider exposure than WRITE
/// mode's) and soft-iWARP moves READs far slower than WRITEs (1 MiB blocking sends over siw ran
/// at ~0.6x the WRITE mode's rate); over soft-RoCE both modes run at the inline path's rate
/// with a third of its CPU time. `iwarp`: the device follows iWARP's rules.
pub(super) fn rdma_read_offered(iwarp: bool) -> bool {
    provider().and_then(|p| p.rdma_read).unwrap_or(!iwarp)
}

static PROVIDER: OnceLock<Option<Provider>> = OnceLock::new();

/// Held while [`PROVIDER`] is being made, and across `fork()`: a child must not inherit an
/// initialisation in progress (its first SAN call would wait for it for ever). The
/// initialisation takes no other lock of ours.
static PROVIDER_INIT: Mutex<()> = Mutex::new(());

/// The resources, `None` while the SAN path is off or the segment directory is unusable.
pub(super) fn provider() -> Option<&'static Provider> {
    if !enabled() {
        return None;
    }
    if let Some(made) = PROVIDER.get() {
        return made.as_ref();
    }
    TOUCHED.store(true, Ordering::Release);
    let _init = hold_init();
    PROVIDER
        .get_or_init(|| {
            // The name our nudge responder takes carries it: unpredictable, so that nobody
            // can take the name first (see `nudge`).
            san_shm::set_contact(random_u64());
            let override_dir = crate::settings::shm_dir();
            match SegmentDir::open(override_dir.as_deref()) {
                Ok(dir) => Some(Provider {
                    pending: san_shm::PendingPorts::open(dir.handle()),
                    registrations: SharedRegistrations::new(san_shm::ShmDomain::new(
                        san_shm::DomainConfig::default(),
                    )),
                    negative: NegativeCache::new(NegativeCacheConfig::default()),
                    dir,
                    rendezvous: crate::settings::rendezvous_allowed(),
                    rdma_read: crate::settings::rdma_read(),
                }),
                Err(error) => {
                    tracing::warn!(%error, "SAN segment directory unusable; staying on TCP");
                    None
                }
            }
        })
        .as_ref()
}

/// Set before the resources are first made.
static TOUCHED: AtomicBool = AtomicBool::new(false);

/// Whether making the resources ever started in this process.
pub(super) fn touched() -> bool {
    TOUCHED.load(Ordering::Acquire)
}

/// The resources if they were made (never makes them).
pub(super) fn made() -> Option<&'static Provider> {
    PROVIDER.get().and_then(Option::as_ref)
}

/// The initialisation lock (see [`PROVIDER_INIT`]).
pub(super) fn hold_init() -> MutexGuard<'static, ()> {
    PROVIDER_INIT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether the SAN path is enabled (not turned off with `SANDIRECT_SAN=0`).
/// The segment directory of this process's provider, when it has one (where peers' socket
/// files are, see `crate::discovery::address_in_dir`).
pub(super) fn segment_dir() -> Option<BorrowedFd<'static>> {
    provider().map(|provider| provider.dir.as_fd())
}

pub fn enabled() -> bool {
    crate::settings::san_enabled()
}

/// Eight random bytes from the kernel (`getrandom`); the time and pid when it has none.
pub(super) fn random_u64() -> u64 {
    let mut value = 0u64;
    // SAFETY: getrandom(2) writes at most 8 bytes into `value`.
    let n = unsafe { libc::getrandom((&mut value as *mut u64).cast(), 8, libc::GRND_NONBLOCK) };
    if n != 8 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        value = now ^ (u64::from(std::process::id()) << 32);
    }
    value
}
