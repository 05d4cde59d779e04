//! Every kernel-made fixture, read by ubtrfs, must match the manifest the kernel's own
//! view produced: paths, types, modes, owners, sizes, link counts, inode numbers,
//! times, device numbers, contents (sha256), symlink targets and xattrs.

mod common;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use ubtrfs_core::data::read::DecompressCache;
use ubtrfs_core::inode::filesystem::{FileKind, Filesystem, InodeView, Load};
use ubtrfs_core::FileRead;
use ubtrfs_core::FsRead;
use ubtrfs_core::OpenOptions;
use ubtrfs_format::structs::rdev_decode;

fn open(name: &str) -> Filesystem {
    open_with(name, false)
}

/// Open fixture `name`; with `no_log_replay`, a log tree is left unreplayed.
fn open_with(name: &str, no_log_replay: bool) -> Filesystem {
    let imgs = common::fixture_images(name);
    Filesystem::open(&OpenOptions {
        devices: imgs,
        cache_bytes: 16 << 20,
        writable: false,
        sources: Default::default(),
        degraded: false,
        no_log_replay,
    })
    .unwrap_or_else(|e| panic!("{name}: open failed: {e}"))
}

fn ts_ns(t: &ubtrfs_format::structs::Timespec) -> i128 {
    i128::from(t.sec.get() as i64) * 1_000_000_000 + i128::from(t.nsec.get())
}

fn entry(fs: &Filesystem, path: &str, v: &InodeView, top: bool, parent_root: u64) -> Value {
    let kind = match v.kind() {
        FileKind::File => "file",
        FileKind::Dir => "dir",
        FileKind::Symlink => "symlink",
        FileKind::Fifo => "fifo",
        FileKind::CharDev => "chr",
        FileKind::BlockDev => "blk",
        FileKind::Socket => "sock",
    };
    let sha = if v.kind() == FileKind::File {
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut pos = 0;
        let mut cache = DecompressCache::default();
        loop {
            let n = fs
                .read_at_cached(v, pos, &mut buf, &mut cache)
                .unwrap_or_else(|e| panic!("{path}: read failed: {e}"));
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
            pos += n as u64;
        }
        assert_eq!(pos, v.size(), "{path}: read length");
        Value::String(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    } else {
        Value::Null
    };
    let target = if v.kind() == FileKind::Symlink {
        Value::String(String::from_utf8(fs.readlink(v.id).expect("readlink")).expect("utf8 target"))
    } else {
        Value::Null
    };
    let (ma, mi) = if matches!(v.kind(), FileKind::CharDev | FileKind::BlockDev) {
        rdev_decode(v.item.rdev.get())
    } else {
        (0, 0)
    };
    let mut x = serde_json::Map::new();
    for (k, val) in &v.xattrs {
        x.insert(
            String::from_utf8(k.clone()).expect("utf8 xattr name"),
            Value::String(val.iter().map(|b| format!("{b:02x}")).collect()),
        );
    }
    json!({
        "path": path, "type": kind, "mode": v.mode() & 0o7777, "uid": v.item.uid.get(), "gid": v.item.gid.get(),
        "size": v.size(), "nlink": v.nlink(), "ino": v.id.ino,
        "mtime_ns": ts_ns(&v.item.mtime).to_string(), "atime_ns": ts_ns(&v.item.atime).to_string(),
        "rdev_major": ma, "rdev_minor": mi, "sha256": sha, "target": target, "xattrs": Value::Object(x),
        "subvol": !top && v.id.root != parent_root,
    })
}

/// Walk the whole visible tree like the manifest script does (into subvolumes).
fn walk(fs: &Filesystem) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    let top = fs.load_inode(fs.root_dir(), Load::ALL).expect("root dir");
    out.insert(String::new(), entry(fs, "", &top, true, top.id.root));
    let mut stack = vec![(String::new(), top)];
    while let Some((path, dir)) = stack.pop() {
        for e in &dir.entries {
            let name = String::from_utf8(e.name.clone()).expect("utf8 name");
            let p = if path.is_empty() { name } else { format!("{path}/{name}") };
            let child =
                fs.load_inode(e.target, Load::ALL).unwrap_or_else(|err| panic!("{p}: {err}"));
            out.insert(p.clone(), entry(fs, &p, &child, false, dir.id.root));
            if child.kind() == FileKind::Dir {
                stack.push((p, child));
            }
        }
    }
    out
}

/// Compare what ubtrfs reads of fixture `name` with the kernel's manifest. A fixture
/// with a log tree has two: the kernel's view after its replay (`NAME.replayed`), which
/// a plain open must show, and the last commit, which an open without log replay shows.
fn compare(name: &str) {
    let replayed = common::fixtures_dir().join(format!("{name}.replayed.manifest.jsonl"));
    if replayed.exists() {
        compare_with(
            &format!("{name} after log replay"),
            &open(name),
            &common::manifest_file(&replayed),
        );
        compare_with(
            &format!("{name} without log replay"),
            &open_with(name, true),
            &common::manifest(name),
        );
    } else {
        compare_with(name, &open(name), &common::manifest(name));
    }
}

fn compare_with(name: &str, fs: &Filesystem, want: &BTreeMap<String, Value>) {
    let got = walk(fs);
    let mut diffs = Vec::new();
    for (p, w) in want {
        let Some(g) = got.get(p) else {
            diffs.push(format!("missing {p:?}"));
            continue;
        };
        for key in [
            "type",
            "mode",
            "uid",
            "gid",
            "size",
            "nlink",
            "ino",
            "rdev_major",
            "rdev_minor",
            "sha256",
            "target",
            "xattrs",
            "subvol",
        ] {
            if g[key] != w[key] {
                diffs.push(format!("{p:?}: {key}: ubtrfs {} kernel {}", g[key], w[key]));
            }
        }
        for key in ["mtime_ns", "atime_ns"] {
            if g[key].as_str().map(str::to_string) != Some(w[key].to_string()) {
                diffs.push(format!("{p:?}: {key}: ubtrfs {} kernel {}", g[key], w[key]));
            }
        }
    }
    for p in got.keys() {
        if !want.contains_key(p) {
            diffs.push(format!("extra {p:?}"));
        }
    }
    assert!(
        diffs.is_empty(),
        "{name}: {} differences from the kernel's view:\n{}",
        diffs.len(),
        diffs.iter().take(40).cloned().collect::<Vec<_>>().join("\n")
    );
    assert!(got.len() > 10, "{name}: suspiciously few entries");
}

macro_rules! fixture_tests {
    ($($t:ident => $n:expr),* $(,)?) => { $( #[test] fn $t() { compare($n); } )* };
}

fixture_tests! {
    fixture_default => "default",
    fixture_nodesize4k_xxhash => "nodesize4k-xxhash",
    fixture_sha256_64k => "sha256-64k",
    fixture_blake2 => "blake2",
    fixture_zlib => "zlib",
    fixture_lzo => "lzo",
    fixture_zstd => "zstd",
    fixture_dup_data => "dup-data",
    fixture_raid0 => "raid0",
    fixture_raid1 => "raid1",
    fixture_raid10 => "raid10",
    fixture_raid1c3 => "raid1c3",
    fixture_mixed => "mixed",
    fixture_logtree => "logtree",
    fixture_logreplay => "logreplay",
    fixture_logreplay_subvol => "logreplay-subvol",
    fixture_snapshots => "snapshots",
    fixture_convert => "convert",
}

#[test]
fn every_fixture_has_a_test() {
    // replace and sprout: crates/cli/tests/dev_replace.rs.
    let listed = [
        "default",
        "nodesize4k-xxhash",
        "sha256-64k",
        "blake2",
        "zlib",
        "lzo",
        "zstd",
        "dup-data",
        "raid0",
        "raid1",
        "raid10",
        "raid1c3",
        "mixed",
        "logtree",
        "logreplay",
        "logreplay-subvol",
        "snapshots",
        "replace",
        "sprout",
        "convert",
    ];
    for n in common::fixture_names() {
        assert!(listed.contains(&n.as_str()), "fixture {n} has no test");
    }
}

/// A read-only open replays a log tree in memory and says so; without log replay it
/// shows the last commit and says that.
#[test]
fn logtree_is_reported() {
    for name in ["logtree", "logreplay", "logreplay-subvol"] {
        let fs = open_with(name, true);
        let w = fs.info.take_warnings();
        assert!(
            w.iter().any(|m| m.contains("log tree") && m.contains("showing the last commit")),
            "{name}: no log tree warning in {w:?}"
        );
        assert!(fs.info.log_root().is_some(), "{name}: no log root");
        let fs = open(name);
        let w = fs.info.take_warnings();
        assert!(
            w.iter().any(|m| m.contains("log tree") && m.contains("replayed")),
            "{name}: no replay warning in {w:?}"
        );
        assert!(fs.info.log_root().is_none(), "{name}: the replayed view still has a log root");
    }
}

#[test]
fn nodesize4k_fs_tree_has_three_levels() {
    let fs = open("nodesize4k-xxhash");
    let r = fs.fs_root(5).unwrap();
    assert!(r.level >= 2, "fs tree root level {}", r.level);
}

/// RAID1 with one device missing still reads everything from the other copy.
#[test]
fn raid1_degraded_reads_everything() {
    let imgs = common::fixture_images("raid1");
    for (keep, img) in imgs.iter().enumerate().take(2) {
        let fs = Filesystem::open(&OpenOptions {
            devices: vec![img.clone()],
            cache_bytes: 16 << 20,
            writable: false,
            sources: Default::default(),
            degraded: false,
            no_log_replay: false,
        })
        .unwrap_or_else(|e| panic!("degraded open of device {keep}: {e}"));
        let got = walk(&fs);
        let want = common::manifest("raid1");
        for (p, w) in &want {
            assert_eq!(
                got.get(p).map(|g| &g["sha256"]),
                Some(&w["sha256"]),
                "device {keep} only: {p}"
            );
        }
        let warnings = fs.info.take_warnings();
        assert!(warnings.iter().any(|w| w.contains("2 devices but 1")), "{warnings:?}");
    }
}

/// RAID0 with a device missing fails with an error naming the missing device.
#[test]
fn raid0_missing_device_is_a_clear_error() {
    let imgs = common::fixture_images("raid0");
    let fs = Filesystem::open(&OpenOptions {
        devices: vec![imgs[0].clone()],
        cache_bytes: 16 << 20,
        writable: false,
        sources: Default::default(),
        degraded: false,
        no_log_replay: false,
    });
    let err = match fs {
        Err(e) => e.to_string(),
        Ok(fs) => {
            let mut err = None;
            let top = fs.load_inode(fs.root_dir(), Load::ALL).expect("metadata is RAID1");
            let mut stack = vec![top];
            'outer: while let Some(d) = stack.pop() {
                for e in &d.entries {
                    let c = fs.load_inode(e.target, Load::ALL).expect("metadata is RAID1");
                    if c.kind() == FileKind::Dir {
                        stack.push(c);
                    } else if c.kind() == FileKind::File && c.size() > 65536 {
                        let mut buf = vec![0u8; c.size() as usize];
                        if let Err(e) = fs.read_at(&c, 0, &mut buf) {
                            err = Some(e.to_string());
                            break 'outer;
                        }
                    }
                }
            }
            err.expect("reading striped data with a device missing must fail")
        }
    };
    assert!(err.contains("device 2 is missing"), "{err}");
}

/// A bad data sector in one DUP copy is read from the other copy with a warning naming
/// the bad copy; bad in both copies, the error names inode, file offset and logical.
#[test]
fn dup_data_csum_mismatch_uses_other_copy() {
    use std::sync::Arc;
    use ubtrfs_core::inode::filesystem::ExtentKind;
    use ubtrfs_core::volumes::device::{BlockDevice, MemDevice};
    use ubtrfs_core::FsInfo;
    let img = std::fs::read(&common::fixture_images("dup-data")[0]).expect("image");
    let fs = open("dup-data");
    // Find a regular uncompressed extent of some file.
    let top = fs.load_inode(fs.root_dir(), Load::ALL).unwrap();
    let mut stack = vec![top];
    let mut found = None;
    while let Some(d) = stack.pop() {
        for e in &d.entries {
            let c = fs.load_inode(e.target, Load::ALL).unwrap();
            if c.kind() == FileKind::Dir {
                stack.push(c);
            } else if let Some(x) = c.extents.iter().find(|x| matches!(x.kind, ExtentKind::Regular { disk_bytenr, compression: 0, prealloc: false, .. } if disk_bytenr != 0)) {
                found.get_or_insert((c.id, x.clone()));
            }
        }
    }
    let (id, ext) = found.expect("a regular extent");
    let ExtentKind::Regular { disk_bytenr, offset, .. } = ext.kind else { unreachable!() };
    let logical = disk_bytenr + offset;
    let chunk = fs.info.chunk_map.lookup(ubtrfs_core::ids::Logical(logical)).unwrap().clone();
    assert_eq!(chunk.num_copies(), 2, "dup data has two copies");
    let corrupt = |copies: &[usize]| {
        let mut bytes = img.clone();
        for &m in copies {
            let (_, phys, _) = chunk.map(logical, m);
            bytes[phys as usize + 100] ^= 0x40;
        }
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(bytes, "dup-data"));
        let fs = Filesystem::from_info(FsInfo::open_devices(vec![dev], 16 << 20).unwrap()).unwrap();
        fs.info.take_warnings();
        let v = fs.load_inode(id, Load::ALL).unwrap();
        let mut buf = vec![0u8; 4096];
        let r = fs.read_at(&v, ext.file_offset, &mut buf);
        (r, fs.info.take_warnings())
    };
    let (r, warnings) = corrupt(&[0]);
    r.expect("one bad copy is repaired around");
    assert!(
        warnings.iter().any(|w| w.contains(&format!("logical {logical}"))
            && w.contains("copy 1 is bad, read copy 2")),
        "{warnings:?}"
    );
    let (r, _) = corrupt(&[0, 1]);
    let msg = r.expect_err("both copies bad").to_string();
    assert!(
        msg.contains(&format!("ino={}", id.ino))
            && msg.contains(&format!("offset={}", ext.file_offset))
            && msg.contains(&format!("logical={logical}")),
        "{msg}"
    );
    assert!(msg.contains("csum mismatch"), "{msg}");
}
