//! Runs everywhere: on a host without RDMA the provider and its loader must say "no
//! provider" cleanly (the preload then stays on TCP), and the built library must speak the
//! loader's ABI.

mod common;

use std::path::{Path, PathBuf};

use common::built_library;

use san_verbs_loader::{LoadError, NoProviderReason, VerbsLibrary, VerbsSetupError, SYSFS_DEVICES};
use sandirect_verbs::VerbsDomain;

fn host_has_rdma() -> bool {
    std::fs::read_dir(SYSFS_DEVICES).is_ok_and(|mut entries| entries.next().is_some())
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("san-verbs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn opening_a_domain_without_rdma_reports_no_device() {
    let opened = VerbsDomain::open(None);
    if host_has_rdma() {
        assert!(opened.is_ok(), "a host with devices opens the first one");
    } else {
        assert_eq!(opened.err(), Some(VerbsSetupError::NoDevice));
        assert_eq!(
            VerbsDomain::open_for_address("127.0.0.1".parse().unwrap()).err(),
            Some(VerbsSetupError::NoDevice)
        );
    }
}

#[test]
fn without_a_device_the_contract_error_allows_the_tcp_fallback() {
    if host_has_rdma() {
        return; // Covered by the device tests in the VM.
    }
    let missing = VerbsDomain::open(None).err().map(san_api::SetupError::from);
    assert_eq!(missing, Some(san_api::SetupError::NoResources));
    assert!(
        missing.is_some_and(san_api::SetupError::allows_tcp_fallback),
        "a host without RDMA must stay on TCP, not fail the connect"
    );
    let by_address = VerbsDomain::open_for_address("192.0.2.1".parse().unwrap())
        .err()
        .map(san_api::SetupError::from);
    assert_eq!(by_address, Some(san_api::SetupError::NoResources));
}

#[test]
fn loader_says_no_provider_when_there_are_no_devices() {
    let empty = temp_dir("empty");
    let loaded = VerbsLibrary::load_from(&built_library(), &empty);
    assert_eq!(
        loaded.err(),
        Some(LoadError::NoProvider(NoProviderReason::NoDevices))
    );
    let absent = empty.join("does-not-exist");
    let loaded = VerbsLibrary::load_from(&built_library(), &absent);
    assert_eq!(
        loaded.err(),
        Some(LoadError::NoProvider(NoProviderReason::NoDevices))
    );
}

#[test]
fn loader_says_no_provider_when_the_library_is_missing() {
    let devices = temp_dir("fake-devices");
    std::fs::create_dir_all(devices.join("rxe0")).expect("fake device entry");
    let loaded = VerbsLibrary::load_from(Path::new("/nonexistent/libsandirect_verbs.so"), &devices);
    match loaded.err() {
        Some(LoadError::NoProvider(NoProviderReason::LibraryMissing(why))) => {
            assert!(
                why.contains("libsandirect_verbs.so"),
                "the reason names the library: {why}"
            );
        }
        other => panic!("expected LibraryMissing, got {other:?}"),
    }
}

#[test]
fn the_built_library_speaks_the_loader_abi_and_fails_cleanly_without_devices() {
    let devices = temp_dir("fake-devices-2");
    std::fs::create_dir_all(devices.join("rxe0")).expect("fake device entry");
    let library =
        VerbsLibrary::load_from(&built_library(), &devices).expect("ABI-compatible library loads");
    if !host_has_rdma() {
        // The sysfs check was fooled; the library itself must still fail cleanly.
        assert_eq!(
            library.open_domain_by_name("rxe0").err(),
            Some(VerbsSetupError::NoDevice)
        );
        assert_eq!(
            library.open_domain_for("192.0.2.1".parse().unwrap()).err(),
            Some(VerbsSetupError::NoDevice)
        );
    }
    assert_eq!(
        library.open_domain_by_name("bad\0name").err(),
        Some(VerbsSetupError::InvalidArgument)
    );
}
