//! Segment files: validation of corrupt/hostile files, access control, name collisions.

mod common;

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::PermissionsExt;

use common::{segment_config, TestDir};
use san_shm::{
    AccessPolicy, CorruptSegment, PermissionProblem, SegmentConfig, ShmDir, ShmError, ShmSegment,
};

/// Byte offsets of header fields (layout version 1; see layout.rs).
const SLOT_SIZE_AT: usize = 24;
const RECV_SLOTS_AT: usize = 28;
const TOTAL_SIZE_AT: usize = 16;
const SIDE1_OFFSET_AT: usize = 56;
const STATE_AT: usize = 72;

fn valid_segment_bytes(dir: &TestDir) -> Vec<u8> {
    let segment = ShmSegment::create(dir.handle(), "template", &segment_config(512, 8)).unwrap();
    let bytes = fs::read(segment.path()).unwrap();
    drop(segment);
    bytes
}

fn attach_bytes(dir: &TestDir, name: &str, bytes: &[u8]) -> Result<ShmSegment, ShmError> {
    let path = dir.path().join(name);
    fs::write(&path, bytes).unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
    ShmSegment::attach(dir.handle(), name)
}

fn with_u32(mut bytes: Vec<u8>, at: usize, value: u32) -> Vec<u8> {
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    bytes
}

fn with_u64(mut bytes: Vec<u8>, at: usize, value: u64) -> Vec<u8> {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
    bytes
}

#[test]
fn an_unmodified_copy_attaches_so_the_corruption_cases_below_are_meaningful() {
    let dir = TestDir::new("copy");
    let bytes = valid_segment_bytes(&dir);
    let segment = attach_bytes(&dir, "copy", &bytes).expect("a faithful copy is a valid segment");
    assert!(segment.is_attached());
}

#[test]
fn corrupt_segment_files_give_errors_not_crashes() {
    let dir = TestDir::new("corrupt");
    let bytes = valid_segment_bytes(&dir);
    let cases: Vec<(&str, Vec<u8>, ShmError)> = vec![
        (
            "tiny",
            bytes[..100].to_vec(),
            ShmError::Corrupt(CorruptSegment::Truncated),
        ),
        (
            "half",
            bytes[..bytes.len() / 2].to_vec(),
            ShmError::Corrupt(CorruptSegment::Truncated),
        ),
        (
            "magic",
            with_u64(bytes.clone(), 0, 0x4142_4344_4546_4748),
            ShmError::Corrupt(CorruptSegment::BadMagic),
        ),
        (
            "version",
            with_u32(bytes.clone(), 8, 99),
            ShmError::Corrupt(CorruptSegment::UnsupportedVersion(99)),
        ),
        (
            "huge-slot",
            with_u32(bytes.clone(), SLOT_SIZE_AT, u32::MAX),
            ShmError::Corrupt(CorruptSegment::SizeOutOfRange),
        ),
        (
            "huge-count",
            with_u32(bytes.clone(), RECV_SLOTS_AT, 0xFFFF_FFFF),
            ShmError::Corrupt(CorruptSegment::SizeOutOfRange),
        ),
        (
            "huge-total",
            with_u64(bytes.clone(), TOTAL_SIZE_AT, u64::MAX),
            ShmError::Corrupt(CorruptSegment::GeometryMismatch),
        ),
        (
            "moved-side",
            with_u64(bytes.clone(), SIDE1_OFFSET_AT, 1 << 40),
            ShmError::Corrupt(CorruptSegment::GeometryMismatch),
        ),
        (
            "bad-state",
            with_u32(bytes.clone(), STATE_AT, 77),
            ShmError::Corrupt(CorruptSegment::BadState),
        ),
        (
            "taken",
            with_u32(bytes.clone(), STATE_AT, 3),
            ShmError::AlreadyAttached,
        ),
    ];
    for (name, file, expected) in cases {
        let got = attach_bytes(&dir, name, &file).map(|_| ());
        assert_eq!(got, Err(expected), "case {name}");
    }
}

#[test]
fn randomly_mutated_headers_never_crash_the_attacher() {
    let dir = TestDir::new("fuzz");
    let bytes = valid_segment_bytes(&dir);
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut refused = 0;
    for round in 0..500 {
        let mut file = bytes.clone();
        for _ in 0..1 + next() % 4 {
            let at = (next() % 80) as usize;
            file[at] = next() as u8;
        }
        if next() % 8 == 0 {
            file.truncate((next() % bytes.len() as u64) as usize);
        }
        if attach_bytes(&dir, &format!("fuzz{}", round % 4), &file).is_err() {
            refused += 1;
        }
    }
    assert!(
        refused > 400,
        "almost every mutation must be refused, got {refused}/500"
    );
}

#[test]
fn files_open_to_group_or_world_symlinks_and_directories_are_refused() {
    let dir = TestDir::new("perm");
    let segment = ShmSegment::create(dir.handle(), "seg", &segment_config(256, 4)).unwrap();
    fs::set_permissions(segment.path(), fs::Permissions::from_mode(0o644)).unwrap();
    assert_eq!(
        ShmSegment::attach(dir.handle(), "seg").map(|_| ()),
        Err(ShmError::PermissionDenied(PermissionProblem::ModeTooOpen {
            mode: 0o644
        }))
    );
    fs::set_permissions(segment.path(), fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(segment.path(), dir.path().join("link")).unwrap();
    assert_eq!(
        ShmSegment::attach(dir.handle(), "link").map(|_| ()),
        Err(ShmError::PermissionDenied(PermissionProblem::Symlink))
    );
    fs::create_dir(dir.path().join("sub")).unwrap();
    assert!(matches!(
        ShmSegment::attach(dir.handle(), "sub"),
        Err(ShmError::PermissionDenied(_) | ShmError::Io { .. })
    ));
    assert_eq!(
        ShmSegment::attach(dir.handle(), "../x").map(|_| ()),
        Err(ShmError::InvalidName)
    );
    assert_eq!(
        ShmSegment::attach(dir.handle(), "absent").map(|_| ()),
        Err(ShmError::NotFound)
    );
    // The refusals left the segment untouched: its rightful attacher still gets in.
    let attached = ShmSegment::attach(dir.handle(), "seg").unwrap();
    assert!(segment.is_attached());
    assert_eq!(attached.peer_pid(), Some(std::process::id()));
    assert_eq!(segment.peer_uid(), Some(effective_uid_from_proc()));
}

/// Our effective uid, read from /proc so the test needs no `unsafe`.
fn effective_uid_from_proc() -> u32 {
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

#[test]
fn a_configured_group_may_attach_and_nobody_else_by_default() {
    let dir = TestDir::new("group");
    let status = fs::read_to_string("/proc/self/status").unwrap();
    let gid: u32 = status
        .lines()
        .find(|l| l.starts_with("Gid:"))
        .unwrap()
        .split_whitespace()
        .nth(2)
        .unwrap()
        .parse()
        .unwrap();
    let config = SegmentConfig {
        access: AccessPolicy { group: Some(gid) },
        ..segment_config(256, 4)
    };
    let segment = ShmSegment::create(dir.handle(), "seg", &config).unwrap();
    let mode = fs::metadata(segment.path()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660);
    assert_eq!(
        ShmSegment::attach(dir.handle(), "seg").map(|_| ()),
        Err(ShmError::PermissionDenied(PermissionProblem::ModeTooOpen {
            mode: 0o660
        })),
        "the default policy is same-user only"
    );
    assert!(
        ShmSegment::attach_with(dir.handle(), "seg", &AccessPolicy { group: Some(gid) }).is_ok()
    );
}

#[test]
fn a_live_creator_keeps_its_name_and_attach_is_exclusive() {
    let dir = TestDir::new("live");
    let first = ShmSegment::create(dir.handle(), "seg", &segment_config(256, 4)).unwrap();
    assert_eq!(
        ShmSegment::create(dir.handle(), "seg", &segment_config(256, 4)).map(|_| ()),
        Err(ShmError::AlreadyExists)
    );
    assert!(!first.is_attached());
    let _attached = ShmSegment::attach(dir.handle(), "seg").unwrap();
    assert!(first.is_attached());
    assert_eq!(
        ShmSegment::attach(dir.handle(), "seg").map(|_| ()),
        Err(ShmError::AlreadyAttached)
    );
    first.unlink().unwrap();
    assert!(!dir.path().join("seg").exists());
    // The name is free again for a new connection.
    assert!(ShmSegment::create(dir.handle(), "seg", &segment_config(256, 4)).is_ok());
}

#[test]
fn a_corrupt_file_of_ours_squatting_a_name_is_replaced() {
    let dir = TestDir::new("squat");
    fs::write(dir.path().join("seg"), b"garbage").unwrap();
    fs::set_permissions(dir.path().join("seg"), fs::Permissions::from_mode(0o600)).unwrap();
    let segment = ShmSegment::create(dir.handle(), "seg", &segment_config(256, 4)).unwrap();
    assert!(ShmSegment::attach(dir.handle(), "seg").is_ok());
    drop(segment);
    assert!(
        !dir.path().join("seg").exists(),
        "the creator removes its name on drop"
    );
}

#[test]
fn invalid_configurations_are_refused() {
    let dir = TestDir::new("config");
    for config in [
        segment_config(0, 4),
        segment_config(4096, 0),
        SegmentConfig {
            window_size: 16,
            ..segment_config(64, 4)
        },
        SegmentConfig {
            journal_size: 0,
            ..segment_config(64, 4)
        },
        SegmentConfig {
            journal_size: 5000,
            ..segment_config(64, 4)
        },
    ] {
        assert!(matches!(
            ShmSegment::create(dir.handle(), "seg", &config),
            Err(ShmError::InvalidConfig(_))
        ));
    }
}

#[test]
fn file_size_is_the_size_of_the_file_created() {
    let dir = TestDir::new("file-size");
    for config in [
        segment_config(512, 8),
        SegmentConfig::new(san_api::SlotConfig {
            send_slots: 32,
            recv_slots: 32,
            slot_size: 16 << 10,
        }),
    ] {
        let segment = ShmSegment::create(dir.handle(), "sized", &config).unwrap();
        let on_disk = fs::metadata(segment.path()).unwrap().len();
        assert_eq!(config.file_size(), Some(on_disk as usize));
        drop(segment);
        let _ = fs::remove_file(dir.path().join("sized"));
    }
    let mut too_big = segment_config(512, 8);
    too_big.window_size = u32::MAX;
    assert_eq!(too_big.file_size(), None);
}

/// The names in the directory at `path`, sorted.
fn names_in(path: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(path)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A private directory at `path` (what `ShmDir::open` accepts).
fn private_dir(path: &std::path::Path) {
    fs::create_dir(path).unwrap();
    fs::set_permissions(path, fs::Permissions::from_mode(0o700)).unwrap();
}

#[test]
fn a_directory_swapped_at_its_path_after_the_check_is_not_followed() {
    let dir = TestDir::new("swap");
    let handle = dir.handle();
    let first = ShmSegment::create(handle, "first", &segment_config(256, 4)).unwrap();
    // Whoever may write the parent renames the checked directory away and puts another
    // directory at its path, with a segment-looking file of ours planted there.
    let original = dir.path().with_extension("original");
    fs::rename(dir.path(), &original).unwrap();
    private_dir(dir.path());
    let other = ShmDir::open(dir.path()).unwrap();
    let planted = ShmSegment::create(&other, "planted", &segment_config(256, 4)).unwrap();
    std::mem::forget(planted);

    // Every operation through the handle lands in the directory that was checked.
    let second = ShmSegment::create(handle, "second", &segment_config(256, 4)).unwrap();
    assert!(handle.contains("second") && handle.contains("first"));
    assert!(!handle.contains("planted"));
    assert_eq!(
        ShmSegment::attach(handle, "planted").map(|_| ()),
        Err(ShmError::NotFound),
        "the file planted at the path is not reached"
    );
    let attached = ShmSegment::attach(handle, "first").unwrap();
    assert!(first.is_attached());
    attached.unlink().unwrap();
    drop(second);
    assert_eq!(names_in(&original), Vec::<String>::new());
    assert_eq!(names_in(dir.path()), ["planted"], "untouched");

    // A symbolic link at the path, to another directory of ours: the same.
    let decoy = dir.path().with_extension("decoy");
    private_dir(&decoy);
    fs::remove_file(dir.path().join("planted")).unwrap();
    fs::remove_dir(dir.path()).unwrap();
    std::os::unix::fs::symlink(&decoy, dir.path()).unwrap();
    let third = ShmSegment::create(handle, "third", &segment_config(256, 4)).unwrap();
    assert_eq!(names_in(&original), ["third"]);
    assert_eq!(names_in(&decoy), Vec::<String>::new());
    handle.remove("third").unwrap();
    assert_eq!(names_in(&original), Vec::<String>::new());
    drop(third);
    for path in [&original, &decoy] {
        let _ = fs::remove_dir_all(path);
    }
    let _ = fs::remove_file(dir.path());
}

#[test]
fn a_stale_segment_is_replaced_in_the_checked_directory_only() {
    let dir = TestDir::new("swap-stale");
    let handle = dir.handle();
    let original = dir.path().with_extension("original");
    fs::rename(dir.path(), &original).unwrap();
    private_dir(dir.path());
    // In the checked directory, a corrupt file of ours under the name (stale: replaceable);
    // in the directory now at the path, a live segment under the same name.
    fs::write(original.join("seg"), b"garbage").unwrap();
    fs::set_permissions(original.join("seg"), fs::Permissions::from_mode(0o600)).unwrap();
    let other = ShmDir::open(dir.path()).unwrap();
    let live = ShmSegment::create(&other, "seg", &segment_config(256, 4)).unwrap();
    // Replacing the stale name happens where it is, and leaves the other directory's alone.
    let replaced = ShmSegment::create(handle, "seg", &segment_config(256, 4))
        .expect("the corrupt file in the checked directory is replaced");
    let _attached = ShmSegment::attach(handle, "seg").unwrap();
    assert!(replaced.is_attached());
    let _other_attached = ShmSegment::attach(&other, "seg").unwrap();
    assert!(
        live.is_attached(),
        "the live segment at the path is still its own"
    );
    drop(replaced);
    drop(live);
    let _ = fs::remove_dir_all(&original);
}

#[test]
fn a_directory_descriptor_reused_for_another_directory_is_not_written_through() {
    use std::os::fd::AsRawFd;
    let dir = TestDir::new("reused");
    let handle = dir.handle();
    let elsewhere = dir.path().with_extension("elsewhere");
    private_dir(&elsewhere);
    let elsewhere_fd = fs::File::open(&elsewhere).unwrap();
    // The program closes our descriptor and its number comes to name another directory.
    // SAFETY: dup2 onto the handle's own number (which the handle goes on holding): the test
    // plays a program that closed a descriptor it did not know and reused its number.
    let rc = unsafe { libc::dup2(elsewhere_fd.as_raw_fd(), handle.as_fd().as_raw_fd()) };
    assert!(rc >= 0);
    assert!(matches!(
        ShmSegment::create(handle, "seg", &segment_config(256, 4)),
        Err(ShmError::Io {
            errno: libc::EBADF,
            ..
        })
    ));
    assert!(!handle.contains("seg"));
    assert_eq!(names_in(&elsewhere), Vec::<String>::new());
    let _ = fs::remove_dir_all(&elsewhere);
}

/// The bytes of a fresh private segment, read through its descriptor before anyone attached.
fn private_segment_bytes() -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let (segment, fd) = ShmSegment::create_private(&segment_config(512, 8), 7).unwrap();
    let file = fs::File::from(fd);
    let mut bytes = vec![0u8; file.metadata().unwrap().len() as usize];
    file.read_exact_at(&mut bytes, 0).unwrap();
    drop(segment);
    bytes
}

/// A memfd holding `bytes`, sealed like a private segment when `sealed`.
fn memfd_with(bytes: &[u8], sealed: bool) -> fs::File {
    use std::io::Write;
    let mut file = fs::File::from(san_shm::memfd_sealable(c"test-segment").unwrap());
    file.write_all(bytes).unwrap();
    if sealed {
        san_shm::seal_size(file.as_fd()).unwrap();
    }
    file
}

#[test]
fn a_private_segment_carries_messages_both_ways_and_never_offers_cma() {
    use common::{test_connection_config, Endpoint};
    use san_shm::{ShmConnection, ShmDomain};
    use std::time::Duration;
    let (segment, fd) = ShmSegment::create_private(&segment_config(512, 8), 7).unwrap();
    assert!(segment.is_private());
    let attached = ShmSegment::attach_private(fd.as_fd()).unwrap();
    drop(fd);
    assert!(attached.is_private() && attached.is_attached() && segment.is_attached());
    assert_eq!(
        attached.private_token(),
        Some(7),
        "the creator's token reaches the attacher"
    );
    let domain = ShmDomain::default();
    let mut creator =
        Endpoint::new(ShmConnection::new(segment, &domain, test_connection_config()).unwrap());
    let mut attacher =
        Endpoint::new(ShmConnection::new(attached, &domain, test_connection_config()).unwrap());
    creator.send(b"over a private segment");
    assert_eq!(
        attacher.next_message(Duration::from_secs(10)).as_deref(),
        Some(&b"over a private segment"[..])
    );
    attacher.send(b"and back");
    assert_eq!(
        creator.next_message(Duration::from_secs(10)).as_deref(),
        Some(&b"and back"[..])
    );
    // Whatever the kernel would allow: no process_vm_* into the peer.
    assert!(!creator.conn.capabilities().rdma_read);
    assert!(!attacher.conn.capabilities().rdma_read);
}

#[test]
fn a_private_segment_cannot_be_shrunk_or_grown_by_its_peer() {
    let (_segment, fd) = ShmSegment::create_private(&segment_config(256, 4), 7).unwrap();
    let file = fs::File::from(fd);
    let len = file.metadata().unwrap().len();
    assert!(file.set_len(0).is_err(), "shrinking is sealed");
    assert!(file.set_len(len + 4096).is_err(), "growing is sealed");
    assert_eq!(file.metadata().unwrap().len(), len);
}

#[test]
fn attaching_a_private_segment_refuses_what_a_hostile_peer_could_pass() {
    let bytes = private_segment_bytes();
    // A faithful copy, sealed: accepted (so the refusals below are meaningful).
    assert!(ShmSegment::attach_private(memfd_with(&bytes, true).as_fd()).is_ok());
    // The same bytes unsealed: the peer could truncate it under our mapping.
    assert_eq!(
        ShmSegment::attach_private(memfd_with(&bytes, false).as_fd()).map(|_| ()),
        Err(ShmError::PermissionDenied(PermissionProblem::NotSealed))
    );
    // A file that takes no seals at all.
    let dir = TestDir::new("private");
    let path = dir.path().join("plain");
    fs::write(&path, &bytes).unwrap();
    assert_eq!(
        ShmSegment::attach_private(fs::File::open(&path).unwrap().as_fd()).map(|_| ()),
        Err(ShmError::PermissionDenied(PermissionProblem::NotSealed))
    );
    // Not a file.
    assert_eq!(
        ShmSegment::attach_private(fs::File::open(dir.path()).unwrap().as_fd()).map(|_| ()),
        Err(ShmError::PermissionDenied(
            PermissionProblem::NotRegularFile
        ))
    );
    // Sealed, but its header lies about the size, or it is cut short.
    assert_eq!(
        ShmSegment::attach_private(
            memfd_with(
                &with_u64(bytes.clone(), TOTAL_SIZE_AT, bytes.len() as u64 + 4096),
                true
            )
            .as_fd()
        )
        .map(|_| ()),
        Err(ShmError::Corrupt(CorruptSegment::GeometryMismatch))
    );
    assert!(matches!(
        ShmSegment::attach_private(memfd_with(&bytes[..bytes.len() / 2], true).as_fd()),
        Err(ShmError::Corrupt(_))
    ));
    assert!(matches!(
        ShmSegment::attach_private(
            memfd_with(&with_u32(bytes.clone(), SLOT_SIZE_AT, u32::MAX), true).as_fd()
        ),
        Err(ShmError::Corrupt(_))
    ));
    // Attached once, never twice (a peer passing one segment to two connections).
    let file = memfd_with(&bytes, true);
    let first = ShmSegment::attach_private(file.as_fd()).unwrap();
    assert_eq!(
        ShmSegment::attach_private(file.as_fd()).map(|_| ()),
        Err(ShmError::AlreadyAttached)
    );
    drop(first);
    // A state word no creator writes.
    assert_eq!(
        ShmSegment::attach_private(memfd_with(&with_u32(bytes, STATE_AT, 77), true).as_fd())
            .map(|_| ()),
        Err(ShmError::Corrupt(CorruptSegment::BadState))
    );
}
