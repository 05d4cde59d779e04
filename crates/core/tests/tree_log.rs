//! Log tree replay against the kernel's: the kernel-made fixtures `logtree`, `logreplay`
//! and `logreplay-subvol` carry a log tree its fsyncs wrote after the last commit
//! (xtask/fixtures.py says which changes). `fixtures.rs` compares the in-memory replay
//! of a read-only open with the kernel's view after its own replay, file by file; here
//! the writable open replays on disk: the result reads the same, `btrfs check
//! --check-data-csum` finds it clean, the kernel mounts it with the same contents, and a
//! log that cannot be replayed is refused with the image unchanged.

mod common;
#[path = "common/write.rs"]
mod write_common;

use ubtrfs_core::disk_io::FsInfo;
use ubtrfs_core::inode::filesystem::Filesystem;
use ubtrfs_core::{Error, FsWriter, OpenOptions};
use write_common::{assert_check, walk_kernel, walk_ubtrfs, Mount, Scratch};

const LOG_FIXTURES: [&str; 3] = ["logtree", "logreplay", "logreplay-subvol"];

fn opts(img: &std::path::Path, writable: bool, no_log_replay: bool) -> OpenOptions {
    OpenOptions { writable, no_log_replay, ..OpenOptions::new(img) }
}

/// The log root of the image's superblock (0 for none).
fn log_root(img: &std::path::Path) -> u64 {
    FsInfo::open(&OpenOptions::new(img)).expect("open").super_copy().log_root.get()
}

/// A writable open replays the log and commits: the superblock loses its log root,
/// the files read as the in-memory replay of the untouched fixture shows them (which
/// `fixtures.rs` holds equal to the kernel's replay), and the kernel agrees: its check
/// is clean and its mount shows the same tree.
#[test]
fn writable_open_replays_the_log_and_commits() {
    for name in LOG_FIXTURES {
        let s = Scratch::fixture(name, &format!("replay-{name}"));
        assert_ne!(log_root(&s.path), 0, "{name}: fixture without a log tree");
        let expected = walk_ubtrfs(&common::fixture_images(name)[0]);
        drop(s.writer());
        assert_eq!(log_root(&s.path), 0, "{name}: the replay's commit left the log root");
        let got = walk_ubtrfs(&s.path);
        write_common::assert_same(&expected, &got, &format!("{name}: after replay on disk"));
        // A second open finds nothing to replay and changes nothing.
        let before = s.sha256();
        drop(s.writer());
        assert_eq!(before, s.sha256(), "{name}: an open after the replay wrote");
        if common::kernel_available(&format!("writable_open_replays_the_log_and_commits/{name}")) {
            assert_check(&s.path, &format!("{name} after replay"));
            let m = Mount::new(&s.path, false);
            let k = walk_kernel(&m.dir);
            m.umount();
            write_common::assert_same(&expected, &k, &format!("{name}: kernel mount after replay"));
        }
    }
}

/// A read-only open replays in memory and writes nothing; `no_log_replay` shows the
/// last commit instead, and a writable open with it is refused, the image unchanged.
#[test]
fn read_only_replay_writes_nothing_and_no_log_replay_refuses_writing() {
    for name in LOG_FIXTURES {
        let s = Scratch::fixture(name, &format!("ro-{name}"));
        let before = s.sha256();
        let replayed = Filesystem::open(&opts(&s.path, false, false)).expect("replayed open");
        assert!(replayed.info.log_root().is_none(), "{name}: replayed view has a log root");
        let last = Filesystem::open(&opts(&s.path, false, true)).expect("last-commit open");
        assert!(last.info.log_root().is_some(), "{name}: last commit without its log root");
        drop((replayed, last));
        let e = FsWriter::open(&opts(&s.path, true, true)).err().expect("writable without replay");
        assert!(
            matches!(&e, Error::Incompatible(m) if m.contains("log replay is off")),
            "{name}: {e}"
        );
        assert_eq!(before, s.sha256(), "{name}: an open wrote to the image");
    }
}

/// A log tree block that fails its checksum: every open that would replay it is
/// refused by name with the way out, nothing is written, and the last commit still
/// opens with `no_log_replay`.
#[test]
fn damaged_log_is_refused_before_anything_changes() {
    let s = Scratch::fixture("logreplay", "damaged-log");
    let info = FsInfo::open(&OpenOptions::new(&s.path)).expect("open");
    let log = info.log_root().expect("log root");
    let c = info.chunk_map.lookup(ubtrfs_core::ids::Logical(log.bytenr)).expect("mapped");
    let copies: Vec<u64> = (0..c.num_copies()).map(|m| c.map(log.bytenr, m).1).collect();
    drop(info);
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&s.path).expect("image");
        for phys in copies {
            // A byte in the middle of the block: its checksum fails.
            let at = phys + 2000;
            let mut b = [0u8];
            f.read_exact_at(&mut b, at).expect("read");
            b[0] ^= 0x5a;
            f.write_all_at(&b, at).expect("write");
        }
    }
    let before = s.sha256();
    for writable in [false, true] {
        let r = if writable {
            FsWriter::open(&opts(&s.path, true, false)).map(drop)
        } else {
            Filesystem::open(&opts(&s.path, false, false)).map(drop)
        };
        let e = r.err().unwrap_or_else(|| panic!("writable={writable}: damaged log replayed"));
        let m = e.to_string();
        assert!(
            m.contains("log tree cannot be replayed") && m.contains("--no-log-replay"),
            "writable={writable}: {m}"
        );
    }
    assert_eq!(before, s.sha256(), "a refused replay wrote to the image");
    let last = Filesystem::open(&opts(&s.path, false, true)).expect("last commit");
    assert!(last.info.log_root().is_some());
}
