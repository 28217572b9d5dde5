//! # san-verbs-loader: the RDMA provider, loaded only where it can work
//!
//! `libsandirect.so` (the preload) must load and fall back to kernel TCP on a host without
//! rdma-core or without RDMA devices. The verbs provider links libibverbs and librdmacm, so
//! it lives in its own shared object (`libsandirect_verbs.so`, crate `san-verbs`) that this
//! crate `dlopen`s, and only when `/sys/class/infiniband` lists a device. The two sides
//! talk through the `#[repr(C)]` vtable in [`abi`]; this crate wraps it in safe types that
//! implement [`san_api::SanDomain`] and [`san_api::SanConnection`], and [`LoadedConnector`]
//! implements [`san_api::SanConnector`] (set-up failures convert into
//! [`san_api::SetupError`], which carries the TCP-fallback rule).
//!
//! ```no_run
//! use san_verbs_loader::{VerbsLibrary, LoadError};
//! match VerbsLibrary::load(None) {
//!     Ok(lib) => { let _domain = lib.open_domain_for(std::net::Ipv4Addr::new(192, 0, 2, 1).into()); }
//!     Err(LoadError::NoProvider(why)) => eprintln!("no RDMA, staying on TCP: {why:?}"),
//!     Err(other) => eprintln!("RDMA provider unusable: {other}"),
//! }
//! ```
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod abi;
pub mod convert;
mod error;
mod handles;
mod setup;

pub use error::{LoadError, NoProviderReason, VerbsSetupError};
pub use handles::{LoadedConnection, LoadedDomain, LoadedListener, LoadedRequest};
pub use setup::{ConnectorConfig, LoadedConnecting, LoadedConnector, LoadedIncoming};

use std::ffi::{CStr, CString};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;

use abi::{AbiDomain, AbiSockAddr, VerbsVtable};

/// How to set up a connection (either side). The same type is used by `san-verbs`.
#[derive(Clone, Copy, Debug)]
pub struct ConnectParams<'a> {
    /// Slot pools to allocate and register.
    pub slots: san_api::SlotConfig,
    /// RDMA reads and writes that may be in flight at once (beyond the send slots).
    pub rdma_depth: u16,
    /// Post every receive slot before the connection is established, with work-request id
    /// = slot number, so a peer that sends first never meets an empty receive queue.
    pub pre_post_receives: bool,
    /// Connection-setup blob for the peer: the request's private data when connecting, the
    /// reply's when accepting. At most [`abi::MAX_PRIVATE_DATA`] bytes.
    pub private_data: &'a [u8],
    /// Bound on resolution and establishment.
    pub timeout: std::time::Duration,
    /// Local address to bind before connecting (active side only).
    pub local: Option<std::net::SocketAddr>,
}

impl<'a> ConnectParams<'a> {
    /// Parameters with `slots`, 16 RDMA operations in flight, receives pre-posted, no
    /// setup blob, a 10 s timeout (soft-RDMA under emulation is slow) and no local bind.
    pub fn new(slots: san_api::SlotConfig) -> Self {
        Self {
            slots,
            rdma_depth: 16,
            pre_post_receives: true,
            private_data: &[],
            timeout: std::time::Duration::from_secs(10),
            local: None,
        }
    }

    /// The ABI form (borrowing `private_data`).
    pub fn to_abi(&self) -> abi::AbiConnectParams {
        abi::AbiConnectParams {
            slots: convert::slots_to_abi(self.slots),
            rdma_depth: self.rdma_depth,
            pre_post_receives: u8::from(self.pre_post_receives),
            private_data: self.private_data.as_ptr(),
            private_data_len: self.private_data.len(),
            timeout_ms: u32::try_from(self.timeout.as_millis()).unwrap_or(u32::MAX),
            local: self.local.map_or(
                AbiSockAddr {
                    family: 0,
                    port: 0,
                    flowinfo: 0,
                    addr: [0; 16],
                    scope_id: 0,
                },
                AbiSockAddr::from_std,
            ),
        }
    }
}

/// Where the kernel lists RDMA devices.
pub const SYSFS_DEVICES: &str = "/sys/class/infiniband";

/// A loaded provider library. Cheap to clone; every handle keeps it alive.
#[derive(Clone)]
pub struct VerbsLibrary {
    inner: Arc<Library>,
}

/// The library is never unloaded: libibverbs and librdmacm start threads and keep global
/// state that does not survive `dlclose`, so the handle is deliberately leaked.
pub(crate) struct Library {
    pub(crate) vtable: &'static VerbsVtable,
}

impl VerbsLibrary {
    /// Loads `libsandirect_verbs.so` through the dynamic linker's search path, if the host
    /// has RDMA devices; `library` (the preload's `SANDIRECT_VERBS_LIBRARY`) overrides the
    /// path.
    ///
    /// # Errors
    /// [`LoadError::NoProvider`] when there is nothing to use (no device, library or
    /// libibverbs absent): the caller stays on TCP. [`LoadError::Incompatible`] when the
    /// library is there but speaks another ABI.
    pub fn load(library: Option<&Path>) -> Result<Self, LoadError> {
        let path = library.unwrap_or_else(|| Path::new(abi::LIBRARY_NAME));
        Self::load_from(path, Path::new(SYSFS_DEVICES))
    }

    /// Loads the library at `library` (a bare name goes through the search path), checking
    /// `devices_dir` (normally [`SYSFS_DEVICES`]) for devices first.
    ///
    /// # Errors
    /// As [`VerbsLibrary::load`].
    pub fn load_from(library: &Path, devices_dir: &Path) -> Result<Self, LoadError> {
        if !has_devices(devices_dir) {
            return Err(LoadError::NoProvider(NoProviderReason::NoDevices));
        }
        let name = CString::new(library.as_os_str().as_encoded_bytes()).map_err(|_| {
            LoadError::NoProvider(NoProviderReason::LibraryMissing("path contains NUL".into()))
        })?;
        // SAFETY: `name` is a valid NUL-terminated string. Loading runs the library's
        // constructors: ours has none beyond what libibverbs/librdmacm register, which are
        // designed to be loaded with dlopen (rdma-core's own providers are dlopened).
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(LoadError::NoProvider(NoProviderReason::LibraryMissing(
                last_dl_error(),
            )));
        }
        // SAFETY: `handle` is a live dlopen handle and the symbol name is NUL-terminated.
        let symbol = unsafe { libc::dlsym(handle, abi::VTABLE_SYMBOL.as_ptr().cast()) };
        if symbol.is_null() {
            return Err(LoadError::Incompatible(format!(
                "symbol missing: {}",
                last_dl_error()
            )));
        }
        // SAFETY: the symbol is exported by our library with exactly this signature
        // (`abi::VtableEntry`); its name carries the ABI major version, so a library of
        // another major version has no such symbol and failed above.
        let entry: abi::VtableEntry =
            unsafe { std::mem::transmute::<*mut libc::c_void, abi::VtableEntry>(symbol) };
        // SAFETY: `entry` takes no arguments and returns a pointer to a static.
        let table = unsafe { entry() };
        // SAFETY: the library returns null or a pointer to a `'static` vtable it never
        // frees or mutates; the library itself is never unloaded (see `Library`).
        let Some(vtable) = (unsafe { table.as_ref() }) else {
            return Err(LoadError::Incompatible("null vtable".into()));
        };
        if vtable.abi_version != abi::ABI_VERSION
            || (vtable.struct_size as usize) < std::mem::size_of::<VerbsVtable>()
        {
            return Err(LoadError::Incompatible(format!(
                "library ABI {} (table {} bytes), loader ABI {} ({} bytes)",
                vtable.abi_version,
                vtable.struct_size,
                abi::ABI_VERSION,
                std::mem::size_of::<VerbsVtable>()
            )));
        }
        Ok(Self {
            inner: Arc::new(Library { vtable }),
        })
    }

    /// Opens a protection domain on the device that serves the local address `ip`.
    ///
    /// # Errors
    /// [`VerbsSetupError::NoDevice`] when no RDMA device serves the address.
    pub fn open_domain_for(&self, ip: IpAddr) -> Result<LoadedDomain, VerbsSetupError> {
        let addr = AbiSockAddr::from_std((ip, 0).into());
        self.open_domain(&addr, std::ptr::null())
    }

    /// Opens a protection domain on the device named `name` (e.g. `rxe0`).
    ///
    /// # Errors
    /// [`VerbsSetupError::NoDevice`] when there is no such device;
    /// [`VerbsSetupError::InvalidArgument`] for a name containing NUL.
    pub fn open_domain_by_name(&self, name: &str) -> Result<LoadedDomain, VerbsSetupError> {
        let name = CString::new(name).map_err(|_| VerbsSetupError::InvalidArgument)?;
        self.open_domain(std::ptr::null(), name.as_ptr())
    }

    fn open_domain(
        &self,
        ip: *const AbiSockAddr,
        name: *const libc::c_char,
    ) -> Result<LoadedDomain, VerbsSetupError> {
        let mut raw: *mut AbiDomain = std::ptr::null_mut();
        // SAFETY: `ip` and `name` are null or valid for the call; `raw` is a valid out slot.
        let status = unsafe { (self.inner.vtable.domain_open)(ip, name, &mut raw) };
        VerbsSetupError::check(status)?;
        handles::LoadedDomain::new(self.inner.clone(), raw)
    }
}

/// True when `dir` exists and holds at least one entry (one per RDMA device).
fn has_devices(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some())
}

fn last_dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl*
    // call on this thread; it is copied at once.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        return "unknown dynamic-linker error".into();
    }
    // SAFETY: non-null, NUL-terminated (see above).
    unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .into_owned()
}
