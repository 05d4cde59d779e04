//! Writes to filesystems with mixed block groups (`mkfs.btrfs --mixed`: data and
//! metadata share DATA|METADATA groups), against the kernel: the kernel-made fixture
//! takes new files through ubtrfs and keeps its own; a fresh small mixed image is
//! filled until ENOSPC (which comes before anything changes), emptied and filled again,
//! new chunks are all mixed, and `btrfs check` is clean and the kernel reads the same
//! files at every round.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::BTreeMap;
use ubtrfs_core::inode::filesystem::FsRead;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsInfo;
use ubtrfs_core::FsWriter;
use ubtrfs_format::structs::*;
use write_common::*;

const MIB: u64 = 1 << 20;

fn group_types(img: &std::path::Path) -> Vec<u64> {
    let info = FsInfo::open(&ubtrfs_core::OpenOptions::new(img)).expect("open");
    info.block_groups()
        .expect("block groups")
        .into_iter()
        .map(|g| g.flags & BLOCK_GROUP_TYPE_MASK)
        .collect()
}

fn kernel_reads(img: &std::path::Path, files: &BTreeMap<String, Vec<u8>>, what: &str) {
    let m = Mount::new(img, false);
    for (p, data) in files {
        let got =
            std::fs::read(m.path(p)).unwrap_or_else(|e| panic!("{what}: kernel read /{p}: {e}"));
        assert!(
            got == *data,
            "{what}: kernel reads /{p}: {} bytes, {} written",
            got.len(),
            data.len()
        );
    }
    m.umount();
}

/// The kernel-made mixed fixture takes small, inline and multi-extent files; its own
/// files stay as they were.
#[test]
fn the_mixed_fixture_takes_writes() {
    if !common::kernel_available("the_mixed_fixture_takes_writes") {
        return;
    }
    let img = Scratch::fixture("mixed", "mixed-rw");
    let theirs = {
        let m = Mount::new(&img.path, false);
        let t = walk_kernel(&m.path(""));
        m.umount();
        t
    };
    let mut w = img.writer();
    let top = w.live().root_dir();
    let d = w.mkdir(top.root, top.ino, b"ours", &InodeAttrs::new(0o755)).expect("mkdir");
    let mut rng = Rng::new(4);
    let mut files = BTreeMap::new();
    for i in 0..120 {
        let n = [100, 3000, 70_000, 400_000][i % 4] + rng.below(1000) as usize;
        let data = rng.bytes(n);
        let ino = w
            .create_file(top.root, d, format!("f{i}").as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        w.write_file(top.root, ino, 0, &data).expect("write");
        files.insert(format!("ours/f{i}"), data);
    }
    w.commit().expect("commit");
    drop(w);
    assert!(
        group_types(&img.path)
            .iter()
            .all(|&t| t == BLOCK_GROUP_SYSTEM || t == BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA),
        "{:?}",
        group_types(&img.path)
    );
    assert_check(&img.path, "mixed fixture after ubtrfs wrote");
    kernel_reads(&img.path, &files, "mixed fixture");
    let m = Mount::new(&img.path, false);
    let now: Tree = walk_kernel(&m.path(""))
        .into_iter()
        .filter(|(p, _)| !p.is_empty() && p != "ours" && !p.starts_with("ours/"))
        .collect();
    m.umount();
    let was: Tree = theirs.into_iter().filter(|(p, _)| !p.is_empty()).collect();
    assert_same(&was, &now, "the fixture's own files");
}

/// Fill, delete, fill again on a small fresh mixed image.
#[test]
fn mixed_fill_delete_fill() {
    if !common::kernel_available("mixed_fill_delete_fill") {
        return;
    }
    let img = Scratch::mkfs("mixed-fill", 160 * MIB, &["--mixed"]);
    let groups_before = group_types(&img.path).len();
    let mut rng = Rng::new(12);
    let mut kept: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for round in 0..3 {
        let mut w = img.writer();
        let top = w.live().root_dir();
        let mut made = Vec::new();
        let mut refused = None;
        for i in 0..2000 {
            let name = format!("r{round}-{i}");
            // Mostly data, with bursts of small files (metadata in the same groups).
            let n = if i % 5 == 0 { 2 << 20 } else { rng.below(8000) as usize };
            let data = rng.bytes(n);
            let ino =
                match w.create_file(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o644)) {
                    Ok(ino) => ino,
                    Err(e) => {
                        refused = Some(e);
                        break;
                    }
                };
            if let Err(e) = w.write_file(top.root, ino, 0, &data) {
                w.unlink(top.root, top.ino, name.as_bytes()).expect("unlink the empty file");
                refused = Some(e);
                break;
            }
            made.push(name.clone());
            kept.insert(name, data);
        }
        let e = refused.unwrap_or_else(|| panic!("round {round}: never filled"));
        assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::NoSpace), "round {round}: {e}");
        w.check_writable().expect("ENOSPC does not abort");
        w.commit().expect("commit what fit");
        drop(w);
        assert_check(&img.path, &format!("round {round}: full"));
        kernel_reads(&img.path, &kept, &format!("round {round}: full"));
        let mut w = img.writer();
        for n in made.iter().take(made.len() * 3 / 4) {
            w.unlink(top.root, top.ino, n.as_bytes()).expect("unlink");
            kept.remove(n);
        }
        w.commit().expect("commit the deletes");
        drop(w);
        assert_check(&img.path, &format!("round {round}: after the deletes"));
    }
    let types = group_types(&img.path);
    assert!(types.len() > groups_before, "no new chunk: {types:?}");
    assert!(
        types
            .iter()
            .all(|&t| t == BLOCK_GROUP_SYSTEM || t == BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA),
        "a group that is not mixed: {types:?}"
    );
    let _ = FsWriter::open(&ubtrfs_core::OpenOptions::new(&img.path)).expect("still opens");
}
