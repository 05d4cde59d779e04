//! `ubtrfs_tools::mkfs` and core's `chunk_remove` as libraries: what the made
//! filesystem holds after the bootstrap chunk is gone (chunks, dev extents, device
//! usage, free-space tree, sys_chunk_array), the same bytes from the same sources,
//! and `remove_chunk` on the chunks of a made filesystem: refused while anything is in
//! the chunk, and a clean removal of an empty one (SINGLE and DUP) that btrfs check and
//! the kernel accept.

use std::path::{Path, PathBuf};
use std::process::Command;
use ubtrfs_core::sources::{Sources, Time};
use ubtrfs_core::space::chunk_remove::remove_chunk;
use ubtrfs_core::FsWriter;
use ubtrfs_core::{FsInfo, OpenOptions, PosixKind, TreeView};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_tools::mkfs::bootstrap::{TEMP_CHUNK_LEN, TEMP_CHUNK_START};
use ubtrfs_tools::mkfs::{make_filesystem, MkfsOptions};

#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

const SIZE: u64 = 256 << 20;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ubtrfs-mkfs-lib-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn made(path: &Path, opts: &MkfsOptions) {
    std::fs::File::create(path).unwrap().set_len(SIZE).unwrap();
    let r = make_filesystem(path, SIZE, opts)
        .unwrap_or_else(|f| panic!("mkfs {}: {f}", path.display()));
    assert_eq!(r.total_bytes, SIZE);
}

fn open(path: &Path) -> FsInfo {
    FsInfo::open(&OpenOptions::new(path)).unwrap()
}

fn writer(path: &Path) -> FsWriter {
    let mut o = OpenOptions::new(path);
    o.writable = true;
    FsWriter::open(&o).unwrap()
}

fn tools_check(path: &Path) {
    let fs = open(path);
    let r = ubtrfs_tools::check::check(&fs, &ubtrfs_tools::check::CheckOptions::default()).unwrap();
    assert!(
        r.is_clean(),
        "ubtrfs check: {:?}",
        r.findings.iter().map(|f| f.to_string()).collect::<Vec<_>>()
    );
}

fn progs_check(path: &Path, what: &str) {
    let out = Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(path)
        .output()
        .unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.contains("no error found"),
        "{what}: btrfs check:\n{text}"
    );
}

/// Dev extents of device 1: (physical offset, length, chunk).
fn dev_extents(fs: &FsInfo) -> Vec<(u64, u64, u64)> {
    let (root, _) = fs.read_root(DEV_TREE_OBJECTID).unwrap();
    let mut it = fs.iter(&root, Key::new(1, DEV_EXTENT_KEY, 0)).unwrap();
    let mut out = Vec::new();
    while let Some(i) = it.next_item().unwrap() {
        let d = i.data();
        out.push((
            i.key().offset,
            u64::from_le_bytes(d[24..32].try_into().unwrap()),
            u64::from_le_bytes(d[16..24].try_into().unwrap()),
        ));
    }
    out
}

#[test]
fn bootstrap_chunk_is_gone() {
    let d = scratch("gone");
    let img = d.join("a.img");
    made(&img, &MkfsOptions::default());
    let fs = open(&img);
    let sb = fs.super_copy();
    let chunks: Vec<_> = fs.chunk_map.iter().collect();
    let kinds: Vec<u64> = chunks.iter().map(|c| c.type_).collect();
    assert_eq!(kinds.len(), 3, "three chunks: {kinds:x?}");
    for want in [
        BLOCK_GROUP_SYSTEM | BLOCK_GROUP_DUP,
        BLOCK_GROUP_METADATA | BLOCK_GROUP_DUP,
        BLOCK_GROUP_DATA,
    ] {
        assert!(kinds.contains(&want), "a {} chunk: {kinds:x?}", block_group_flags_str(want));
    }
    assert!(
        chunks.iter().all(|c| c.logical >= TEMP_CHUNK_START + TEMP_CHUNK_LEN),
        "a chunk left in the bootstrap range: {chunks:?}"
    );
    // The device's usage is the sum of its dev extents, none in the bootstrap range.
    let de = dev_extents(&fs);
    assert_eq!(de.len(), 5, "DUP system and metadata, single data: {de:?}");
    assert!(de.iter().all(|&(p, _, _)| p >= TEMP_CHUNK_START + TEMP_CHUNK_LEN), "{de:?}");
    assert_eq!(sb.dev_item.bytes_used.get(), de.iter().map(|e| e.1).sum::<u64>());
    // The sys_chunk_array lists the one real SYSTEM chunk.
    let sys = ubtrfs_format::superblock::sys_chunk_array(&sb).unwrap();
    assert_eq!(sys.len(), 1);
    assert_eq!(sys[0].1.type_, BLOCK_GROUP_SYSTEM | BLOCK_GROUP_DUP);
    // The free-space tree has nothing of the bootstrap group.
    let (fst, _) = fs.read_root(FREE_SPACE_TREE_OBJECTID).unwrap();
    let mut it = fs.iter(&fst, Key::MIN).unwrap();
    let first = it.next_item().unwrap().unwrap().key();
    assert!(
        first.objectid >= TEMP_CHUNK_START + TEMP_CHUNK_LEN,
        "free space item {first} of the bootstrap group"
    );
    // Block groups: one per chunk, the bootstrap one gone, usage all tree blocks.
    let bgs = fs.block_groups().unwrap();
    assert_eq!(bgs.len(), 3);
    assert_eq!(bgs.iter().map(|g| g.used).sum::<u64>(), sb.bytes_used.get());
    assert_eq!(sb.bytes_used.get(), 9 * 16384, "nine trees of one leaf each");
    assert_eq!(sb.generation.get(), 3, "bootstrap 1, chunks 2, removal 3");
    if kernel::kernel_available("mkfs bootstrap_chunk_is_gone") {
        progs_check(&img, "fresh");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn same_sources_same_bytes() {
    let d = scratch("repro");
    let opts = || MkfsOptions {
        sources: Sources::deterministic(Time { sec: 1_700_000_000, nsec: 0 }, 42),
        ..MkfsOptions::default()
    };
    let (a, b) = (d.join("a.img"), d.join("b.img"));
    made(&a, &opts());
    made(&b, &opts());
    assert!(
        std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
        "two mkfs runs from the same sources differ"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn remove_chunk_refuses_a_used_chunk_and_removes_an_empty_one() {
    let d = scratch("remove");
    for (name, data) in [("single", 0), ("dup", BLOCK_GROUP_DUP)] {
        let img = d.join(format!("{name}.img"));
        made(&img, &MkfsOptions { data_profile: data, ..MkfsOptions::default() });
        let before = std::fs::read(&img).unwrap();
        let fs = open(&img);
        let meta =
            fs.chunk_map.iter().find(|c| c.type_ & BLOCK_GROUP_METADATA != 0).unwrap().logical;
        let data_chunk = fs.chunk_map.iter().find(|c| c.type_ & BLOCK_GROUP_DATA != 0).unwrap();
        drop(fs);
        let mut w = writer(&img);
        {
            let mut h = w.join_transaction("test: remove").unwrap();
            let e = remove_chunk(&mut h, meta).unwrap_err();
            assert_eq!(e.posix_kind(), Some(PosixKind::NotEmpty), "{e}");
            assert!(e.to_string().contains(&format!("chunk {meta}")), "{e}");
            let e = remove_chunk(&mut h, data_chunk.logical + 4096).unwrap_err();
            assert_eq!(e.posix_kind(), Some(PosixKind::Invalid), "{e}");
            h.end().unwrap();
        }
        // Refusals changed nothing.
        assert_eq!(w.commit().unwrap(), 3);
        drop(w);
        assert!(
            std::fs::read(&img).unwrap() == before,
            "{name}: a refused removal changed the image"
        );
        // The empty data chunk goes, with both dev extents of a DUP one.
        let mut w = writer(&img);
        {
            let mut h = w.join_transaction("test: remove").unwrap();
            let r = remove_chunk(&mut h, data_chunk.logical);
            h.end_with(r).unwrap();
        }
        w.commit().unwrap();
        drop(w);
        let fs = open(&img);
        assert!(
            fs.chunk_map.iter().all(|c| c.type_ & BLOCK_GROUP_DATA == 0),
            "{name}: the data chunk is still there"
        );
        let de = dev_extents(&fs);
        assert!(de.iter().all(|e| e.2 != data_chunk.logical), "{name}: {de:?}");
        assert_eq!(
            fs.super_copy().dev_item.bytes_used.get(),
            de.iter().map(|e| e.1).sum::<u64>(),
            "{name}: device usage"
        );
        drop(fs);
        tools_check(&img);
        if kernel::kernel_available("mkfs remove_chunk") {
            progs_check(&img, &format!("{name}: data chunk removed"));
        }
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A source tree for `make_filesystem_with`: nested directories, files of several
/// sizes (inline, one extent, several), a symlink and a hard link.
fn source_tree(dir: &Path) {
    std::fs::create_dir_all(dir.join("etc/conf.d")).unwrap();
    std::fs::create_dir_all(dir.join("usr/share/doc")).unwrap();
    std::fs::write(dir.join("etc/hostname"), b"mkfs-test\n").unwrap();
    std::fs::write(dir.join("etc/conf.d/big"), vec![0x5a; 300 * 1024]).unwrap();
    let mut x = 0x9e3779b97f4a7c15u64;
    let noise: Vec<u8> = (0..200_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(dir.join("usr/share/doc/noise"), &noise).unwrap();
    std::os::unix::fs::symlink("../etc/hostname", dir.join("usr/hostname-link")).unwrap();
    std::fs::hard_link(dir.join("etc/hostname"), dir.join("usr/share/doc/hostname")).unwrap();
    // Fixed times; the access times in the future, so that reading the tree (the
    // first build) does not move them under relatime before the second reads them.
    for p in [
        "",
        "etc",
        "etc/conf.d",
        "usr",
        "usr/share",
        "usr/share/doc",
        "etc/hostname",
        "etc/conf.d/big",
        "usr/share/doc/noise",
        "usr/hostname-link",
    ] {
        let path =
            std::ffi::CString::new(dir.join(p).into_os_string().into_encoded_bytes()).unwrap();
        let ts = [
            libc::timespec { tv_sec: 2_100_000_000, tv_nsec: 0 },
            libc::timespec { tv_sec: 1_600_000_000, tv_nsec: 0 },
        ];
        // SAFETY: a NUL-terminated path and two timespecs, as utimensat(2) takes.
        let r = unsafe {
            libc::utimensat(libc::AT_FDCWD, path.as_ptr(), ts.as_ptr(), libc::AT_SYMLINK_NOFOLLOW)
        };
        assert_eq!(r, 0, "utimensat {p}: {}", std::io::Error::last_os_error());
    }
}

/// mkfs filled by `populate` (what `--rootdir` will run) from reproducible sources:
/// the same tree gives the same bytes, checks clean, and the kernel reads the files.
#[test]
fn filled_and_reproducible() {
    use ubtrfs_tools::populate::{
        derive_uuid, populate, reproducible_sources, tree_digest, PopulateOptions,
    };
    let d = scratch("filled");
    let src = d.join("src");
    source_tree(&src);
    let digest = tree_digest(&src, &Default::default()).unwrap();
    let opts = || MkfsOptions {
        fsid: Some(derive_uuid(&digest, "", "fsid")),
        sources: reproducible_sources(1_700_000_000, &digest),
        ..MkfsOptions::default()
    };
    let mut images = Vec::new();
    for name in ["a.img", "b.img"] {
        let img = d.join(name);
        std::fs::File::create(&img).unwrap().set_len(SIZE).unwrap();
        ubtrfs_tools::mkfs::make_filesystem_with(&img, SIZE, &opts(), |e| {
            populate(e, &src, &PopulateOptions::default()).map(|_| ())
        })
        .unwrap_or_else(|f| panic!("mkfs: {f}"));
        images.push(img);
    }
    assert!(
        std::fs::read(&images[0]).unwrap() == std::fs::read(&images[1]).unwrap(),
        "two mkfs of one tree from the same sources differ"
    );
    assert_eq!(open(&images[0]).super_copy().fsid, derive_uuid(&digest, "", "fsid"));
    if kernel::kernel_available("mkfs filled_and_reproducible") {
        progs_check(&images[0], "filled");
        let mnt = d.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        assert!(Command::new("mount")
            .args(["-t", "btrfs", "-o", "loop,ro"])
            .arg(&images[0])
            .arg(&mnt)
            .status()
            .unwrap()
            .success());
        let got = (
            std::fs::read(mnt.join("usr/share/doc/noise")),
            std::fs::read(mnt.join("etc/conf.d/big")),
            std::fs::read_link(mnt.join("usr/hostname-link")),
        );
        let _ = Command::new("umount").arg(&mnt).status();
        assert_eq!(got.0.unwrap(), std::fs::read(src.join("usr/share/doc/noise")).unwrap());
        assert_eq!(got.1.unwrap(), vec![0x5a; 300 * 1024]);
        assert_eq!(got.2.unwrap(), Path::new("../etc/hostname"));
    }
    std::fs::remove_dir_all(&d).unwrap();
}
