//! NOCOW writes against the kernel: the same steps on a kernel loop mount and through
//! ubtrfs, and after each one the file's extent items compared, with disk extents
//! named by the order they first appear. An overwrite in place keeps its extent; a COW
//! makes a new one; a write into a preallocated extent splits it and merges the
//! written parts. Covered: NODATACOW files (overwrites, partial sectors, writes past
//! EOF, small files that stay regular), preallocated extents (default and KEEP_SIZE,
//! merges on either side, checksummed data of a normal file), and the cases that must
//! COW: an extent shared by a reflink or by a snapshot, a regular extent of a normal
//! file, a PREALLOC file under compress (in place, uncompressed). Then the contents,
//! `btrfs check --check-data-csum`, and a full disk where only in-place writes fit.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;
use ubtrfs_core::data::falloc::FALLOC_FL_KEEP_SIZE;
use ubtrfs_core::error::PosixKind;
use ubtrfs_core::inode::attr::fsflags;
use ubtrfs_core::inode::filesystem::{ExtentKind, Filesystem, FsRead, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;
use write_common::*;

#[derive(Clone, Copy, Debug)]
enum Step {
    /// An empty file in the top directory, NODATACOW (chattr +C) or not.
    Create(&'static str, bool),
    /// Seeded random bytes at [off, off + len).
    Write(&'static str, u64, u64),
    Falloc(&'static str, u32, u64, u64),
    Truncate(&'static str, u64),
    /// Compressible bytes (one repeated line) at [off, off + len).
    WriteText(&'static str, u64, u64),
    /// compress=zstd from here on.
    Compress,
}

fn data_of(step: usize, len: u64, text: bool) -> Vec<u8> {
    if text {
        return b"a line of text that compresses very well indeed\n"
            .iter()
            .cycle()
            .take(len as usize)
            .copied()
            .collect();
    }
    Rng::new(0x5eed ^ step as u64).bytes(len as usize)
}

/// One extent item: file offset, kind (i inline, h hole, r regular, p prealloc),
/// disk extent (by first appearance), offset into it, length, compression.
type Item = (u64, char, usize, u64, u64, u8);

fn layout<V: FileRead>(v: &V, name: &str, names: &mut HashMap<u64, usize>) -> Vec<Item> {
    let id =
        v.resolve_id(&format!("/{name}"), false).unwrap_or_else(|e| panic!("resolve {name}: {e}"));
    let mut out = Vec::new();
    for f in v.file_extents(id, 0, u64::MAX).expect("file extents") {
        out.push(match f.kind {
            ExtentKind::Inline { ram_bytes, compression, .. } => {
                (f.file_offset, 'i', 0, 0, ram_bytes, compression)
            }
            ExtentKind::Regular { disk_bytenr: 0, num_bytes, .. } => {
                (f.file_offset, 'h', 0, 0, num_bytes, 0)
            }
            ExtentKind::Regular {
                disk_bytenr, offset, num_bytes, compression, prealloc, ..
            } => {
                let n = names.len();
                let idx = *names.entry(disk_bytenr).or_insert(n);
                (
                    f.file_offset,
                    if prealloc { 'p' } else { 'r' },
                    idx,
                    offset,
                    num_bytes,
                    compression,
                )
            }
        });
    }
    out
}

fn contents<V: FileRead>(v: &V, name: &str) -> Vec<u8> {
    let id = v.resolve_id(&format!("/{name}"), false).expect("resolve");
    let iv = v.load_inode(id, Load { extents: true, ..Load::ITEM }).expect("inode");
    let mut buf = vec![0u8; iv.size() as usize];
    let n = v.read_at(&iv, 0, &mut buf).expect("read");
    buf.truncate(n);
    buf
}

fn run_cmd(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// Apply `steps` on the kernel, unmounting after each to read the items.
fn kernel_side(img: &Path, steps: &[Step]) -> (Vec<Vec<Item>>, HashMap<&'static str, Vec<u8>>) {
    // No discards: the kernel's async discard worker takes free extents out of the
    // allocator's reach while it trims them, so where a write lands would depend on
    // its timing (ubtrfs discards nothing on free).
    let mut opts = "loop,nodiscard".to_string();
    let mut names = HashMap::new();
    let mut layouts = Vec::new();
    let mut files: HashMap<&'static str, Vec<u8>> = HashMap::new();
    for (i, &s) in steps.iter().enumerate() {
        let m = Mount::new_with(img, &opts);
        let name = match s {
            Step::Create(n, nocow) => {
                std::fs::File::create(m.path(n)).expect("create");
                if nocow {
                    run_cmd(Command::new("chattr").arg("+C").arg(m.path(n)));
                }
                n
            }
            Step::Write(n, off, len) | Step::WriteText(n, off, len) => {
                let f = std::fs::OpenOptions::new().write(true).open(m.path(n)).expect("open");
                f.write_all_at(&data_of(i, len, matches!(s, Step::WriteText(..))), off)
                    .expect("write");
                f.sync_all().expect("fsync");
                n
            }
            Step::Falloc(n, mode, off, len) => {
                let f = std::fs::OpenOptions::new().write(true).open(m.path(n)).expect("open");
                // SAFETY: fallocate on an open descriptor.
                let r = unsafe {
                    libc::fallocate(
                        std::os::unix::io::AsRawFd::as_raw_fd(&f),
                        mode as i32,
                        off as i64,
                        len as i64,
                    )
                };
                assert_eq!(r, 0, "kernel fallocate {s:?}: {}", std::io::Error::last_os_error());
                n
            }
            Step::Truncate(n, size) => {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(m.path(n))
                    .expect("open")
                    .set_len(size)
                    .expect("truncate");
                n
            }
            Step::Compress => {
                opts = "loop,nodiscard,compress=zstd".into();
                m.umount();
                continue;
            }
        };
        m.umount();
        let r = Filesystem::open(&OpenOptions::new(img)).expect("open the kernel's image");
        layouts.push(layout(&r, name, &mut names));
        files.insert(name, contents(&r, name));
    }
    (layouts, files)
}

/// Apply `steps` through ubtrfs, committing after each.
fn ubtrfs_side(img: &Path, steps: &[Step]) -> (Vec<Vec<Item>>, HashMap<&'static str, Vec<u8>>) {
    let mut w = FsWriter::open(&OpenOptions::new(img)).expect("open for writing");
    let top = w.live().root_dir();
    let mut names = HashMap::new();
    let mut layouts = Vec::new();
    let mut files = HashMap::new();
    let ino_of =
        |w: &FsWriter, n: &str| w.live().resolve_id(&format!("/{n}"), false).expect("resolve").ino;
    for (i, &s) in steps.iter().enumerate() {
        let name = match s {
            Step::Create(n, nocow) => {
                let ino = w
                    .create_file(top.root, top.ino, n.as_bytes(), &InodeAttrs::new(0o644))
                    .expect("create");
                if nocow {
                    w.set_fsflags(InodeId { root: top.root, ino }, fsflags::NOCOW)
                        .expect("chattr +C");
                }
                n
            }
            Step::Write(n, off, len) | Step::WriteText(n, off, len) => {
                let ino = ino_of(&w, n);
                w.write_file(
                    top.root,
                    ino,
                    off,
                    &data_of(i, len, matches!(s, Step::WriteText(..))),
                )
                .unwrap_or_else(|e| panic!("ubtrfs {s:?}: {e}"));
                n
            }
            Step::Falloc(n, mode, off, len) => {
                let ino = ino_of(&w, n);
                w.fallocate(InodeId { root: top.root, ino }, mode, off, len)
                    .unwrap_or_else(|e| panic!("ubtrfs {s:?}: {e}"));
                n
            }
            Step::Truncate(n, size) => {
                let ino = ino_of(&w, n);
                w.setattr(
                    InodeId { root: top.root, ino },
                    &ubtrfs_core::inode::attr::SetAttr { size: Some(size), ..Default::default() },
                )
                .expect("truncate");
                n
            }
            Step::Compress => {
                w.set_compress(
                    ubtrfs_core::compression::CompressPolicy::parse("zstd", false).expect("policy"),
                );
                continue;
            }
        };
        w.commit().expect("commit");
        layouts.push(layout(&w.live(), name, &mut names));
        files.insert(name, contents(&w.live(), name));
    }
    (layouts, files)
}

/// `prefix` runs on the kernel for both sides (what ubtrfs cannot make yet: reflinks
/// and snapshots); then `steps` on each side; the item layouts must match after every
/// step.
fn scenario(tag: &str, prefix: &dyn Fn(&Path), steps: &[Step]) {
    let k = Scratch::mkfs(&format!("nocow-{tag}-k"), 512 << 20, &[]);
    {
        let m = Mount::new(&k.path, true);
        prefix(&m.path(""));
        m.umount();
    }
    let u = Scratch::mkfs(&format!("nocow-{tag}-u"), 512 << 20, &[]);
    std::fs::copy(&k.path, &u.path).expect("copy image");
    let (kl, kf) = kernel_side(&k.path, steps);
    let (ul, uf) = ubtrfs_side(&u.path, steps);
    let mut bad = Vec::new();
    for (i, (a, b)) in kl.iter().zip(&ul).enumerate() {
        if a != b {
            bad.push(format!(
                "after step {i} {:?}:\n  kernel {a:?}\n  ubtrfs {b:?}",
                steps.iter().filter(|s| !matches!(s, Step::Compress)).nth(i)
            ));
        }
    }
    for (n, want) in &kf {
        if uf.get(n) != Some(want) {
            bad.push(format!(
                "{n}: contents differ from the kernel's ({} vs {:?} bytes)",
                want.len(),
                uf.get(n).map(Vec::len)
            ));
        }
    }
    assert!(bad.is_empty(), "{tag}:\n{}", bad.join("\n"));
    assert_check(&u.path, tag);
    let m = Mount::new(&u.path, false);
    for (n, want) in &kf {
        assert_eq!(
            &std::fs::read(m.path(n)).expect("kernel read"),
            want,
            "{tag}: {n} as the kernel reads ubtrfs's image"
        );
    }
    m.umount();
}

fn nothing(_: &Path) {}

/// Whether `btrfs check` is here for `test` (which needs no kernel); a skip says why,
/// and under CI=true it is a failure.
fn check_available(test: &str) -> bool {
    if have_btrfs_check() {
        return true;
    }
    assert_ne!(
        std::env::var("CI").as_deref(),
        Ok("true"),
        "{test}: btrfs check missing under CI=true"
    );
    eprintln!("{test}: skipped: needs btrfs check");
    false
}

#[test]
fn nodatacow_overwrites_stay_in_place() {
    if !common::kernel_available("nodatacow_overwrites_stay_in_place") {
        return;
    }
    use Step::*;
    scenario(
        "overwrite",
        &nothing,
        &[
            Create("f", true),
            Write("f", 0, 1 << 20),
            Write("f", 64 << 10, 4096),
            // A partial sector: read, modify, write in place.
            Write("f", 100_000, 10),
            // In place up to EOF, COW past it.
            Write("f", 700 << 10, 300 << 10),
            Write("f", 1 << 20, 8192),
            // A small NODATACOW file is a regular extent, never inline.
            Create("small", true),
            Write("small", 0, 11),
            Write("small", 3, 5),
        ],
    );
}

#[test]
fn preallocated_extents_are_written_in_place() {
    if !common::kernel_available("preallocated_extents_are_written_in_place") {
        return;
    }
    use Step::*;
    scenario(
        "prealloc",
        &nothing,
        &[
            Create("p", false),
            Falloc("p", 0, 0, 1 << 20),
            Write("p", 0, 4096),
            // Continues the written part: one regular item.
            Write("p", 4096, 4096),
            // Splits the preallocated rest.
            Write("p", 512 << 10, 8192),
            // Joins both written parts.
            Write("p", 8192, (512 << 10) - 8192),
            // A written part already checksummed is COWed (a normal file).
            Write("p", 4096, 4096),
            Write("p", (1 << 20) - 4096, 4096),
            // KEEP_SIZE past EOF, then writes that extend the file into it.
            Create("k", false),
            Write("k", 0, 5000),
            Falloc("k", FALLOC_FL_KEEP_SIZE, 8192, 256 << 10),
            Write("k", 8192, 16384),
            Write("k", 5000, 3192),
            // A NODATACOW file's preallocation.
            Create("c", true),
            Falloc("c", 0, 0, 128 << 10),
            Write("c", 4096, 100),
            Write("c", 0, 128 << 10),
        ],
    );
}

/// NODATACOW and preallocated files in `top`, written by the kernel; reflinked copies
/// when `reflink`, a snapshot of the top subvolume when `snapshot`.
fn shared_prefix(top: &Path, reflink: bool, snapshot: bool) {
    for n in ["r", "s"] {
        std::fs::File::create(top.join(n)).expect("create");
        run_cmd(Command::new("chattr").arg("+C").arg(top.join(n)));
        run_cmd(
            Command::new("xfs_io")
                .args(["-c", "pwrite -S 0x61 0 256k", "-c", "fsync"])
                .arg(top.join(n)),
        );
    }
    run_cmd(
        Command::new("xfs_io")
            .args(["-f", "-c", "falloc 0 256k", "-c", "fsync"])
            .arg(top.join("q")),
    );
    if reflink {
        // Clones need the same NODATACOW on both sides.
        std::fs::File::create(top.join("r2")).expect("create");
        run_cmd(Command::new("chattr").arg("+C").arg(top.join("r2")));
        run_cmd(Command::new("cp").arg("--reflink=always").arg(top.join("r")).arg(top.join("r2")));
        run_cmd(Command::new("cp").arg("--reflink=always").arg(top.join("q")).arg(top.join("q2")));
    }
    std::fs::File::create(top.join("late")).expect("create");
    run_cmd(Command::new("chattr").arg("+C").arg(top.join("late")));
    run_cmd(&mut Command::new("sync"));
    if snapshot {
        // Enough small files for leaves under the root node: a snapshot copies the
        // root only, so the data extents gain no reference of the snapshot's.
        for i in 0..600 {
            std::fs::write(top.join(format!("pad{i}")), [b'x'; 100]).expect("pad file");
        }
        run_cmd(&mut Command::new("sync"));
        // Nothing changes the subvolume after it: its leaves stay shared, and only the
        // last-snapshot generation tells that the extents may be.
        run_cmd(
            Command::new("btrfs").args(["subvolume", "snapshot"]).arg(top).arg(top.join("snap")),
        );
    }
}

#[test]
fn extents_shared_by_a_reflink_are_cowed() {
    if !common::kernel_available("extents_shared_by_a_reflink_are_cowed") {
        return;
    }
    use Step::*;
    scenario(
        "reflink",
        &|top| shared_prefix(top, true, false),
        &[
            // Shared with r2: COW; then the new extent is r's alone: in place.
            Write("r", 4096, 8192),
            Write("r", 4096, 4096),
            Write("r2", 0, 4096),
            // Not shared: in place.
            Write("s", 128 << 10, 4096),
            // A preallocated extent shared by a reflink: COW, from both sides.
            Write("q", 0, 4096),
            Write("q2", 8192, 4096),
            Write("late", 0, 64 << 10),
            Write("late", 4096, 4096),
        ],
    );
}

#[test]
fn extents_older_than_a_snapshot_are_cowed() {
    if !common::kernel_available("extents_older_than_a_snapshot_are_cowed") {
        return;
    }
    use Step::*;
    scenario(
        "snapshot",
        &|top| shared_prefix(top, false, true),
        &[
            // Made before the snapshot: COW; the new extent is newer: in place.
            Write("s", 128 << 10, 4096),
            Write("s", 128 << 10, 4096),
            Write("r", 0, 256 << 10),
            Write("q", 64 << 10, 4096),
            // An empty file, written after the snapshot: in place.
            Write("late", 0, 64 << 10),
            Write("late", 4096, 4096),
        ],
    );
}

#[test]
fn prealloc_files_do_not_compress() {
    if !common::kernel_available("prealloc_files_do_not_compress") {
        return;
    }
    use Step::*;
    scenario(
        "compress",
        &nothing,
        &[
            Create("z", false),
            Falloc("z", 0, 0, 512 << 10),
            Compress,
            WriteText("z", 0, 256 << 10),
            // Past the preallocation: COW, still plain (the PREALLOC flag stays).
            WriteText("z", 512 << 10, 256 << 10),
            Truncate("z", 0),
            WriteText("z", 0, 200 << 10),
            // A normal file compresses.
            Create("n", false),
            WriteText("n", 0, 256 << 10),
        ],
    );
}

/// With no data space left, writes that go in place still succeed (they need no new
/// space), and a write that needs new space fails before anything changes.
#[test]
fn in_place_writes_need_no_data_space() {
    if !check_available("in_place_writes_need_no_data_space") {
        return;
    }
    let img = Scratch::mkfs("nocow-full", 256 << 20, &[]);
    let mut w = img.writer();
    let top = w.live().root_dir();
    let c = w.create_file(top.root, top.ino, b"c", &InodeAttrs::new(0o644)).expect("create");
    w.set_fsflags(InodeId { root: top.root, ino: c }, fsflags::NOCOW).expect("chattr +C");
    let mut want = Rng::new(7).bytes(8 << 20);
    w.write_file(top.root, c, 0, &want).expect("write c");
    let p = w.create_file(top.root, top.ino, b"p", &InodeAttrs::new(0o644)).expect("create");
    w.fallocate(InodeId { root: top.root, ino: p }, 0, 0, 4 << 20).expect("fallocate p");
    w.commit().expect("commit");
    // Fill the data space.
    let fill = w.create_file(top.root, top.ino, b"fill", &InodeAttrs::new(0o644)).expect("create");
    let chunk = vec![0x5a; 1 << 20];
    let mut off = 0;
    loop {
        match w.write_file(top.root, fill, off, &chunk) {
            Ok(()) => off += chunk.len() as u64,
            Err(e) if e.posix_kind() == Some(PosixKind::NoSpace) => break,
            Err(e) => panic!("filling: {e}"),
        }
        if off > 1 << 30 {
            panic!("the filesystem never filled");
        }
    }
    w.commit().expect("commit");
    let before = contents(&w.live(), "fill");
    // COW needs space: refused.
    let n = w.create_file(top.root, top.ino, b"n", &InodeAttrs::new(0o644)).expect("create");
    let e = w.write_file(top.root, n, 0, &chunk).expect_err("a COW write on a full disk");
    assert_eq!(e.posix_kind(), Some(PosixKind::NoSpace), "{e}");
    // In place: fine, several times over the space that is left.
    for round in 0..4u64 {
        let d = Rng::new(100 + round).bytes(2 << 20);
        let at = round * (1 << 20);
        w.write_file(top.root, c, at, &d)
            .unwrap_or_else(|e| panic!("in-place overwrite {round} on a full disk: {e}"));
        want[at as usize..at as usize + d.len()].copy_from_slice(&d);
        w.write_file(top.root, p, at, &d[..1 << 20])
            .unwrap_or_else(|e| panic!("write into preallocation {round} on a full disk: {e}"));
        w.commit().expect("commit");
    }
    assert_eq!(contents(&w.live(), "c"), want);
    let pw: Vec<u8> =
        (0..4u64).flat_map(|r| Rng::new(100 + r).bytes(2 << 20)[..1 << 20].to_vec()).collect();
    assert_eq!(contents(&w.live(), "p"), pw);
    assert_eq!(contents(&w.live(), "fill"), before);
    drop(w);
    assert_check(&img.path, "nocow-full");
}

/// Through the engine, whose aligned writes put their data on disk without its lock:
/// the parts that go in place do so there too, beside parts that COW.
#[test]
fn engine_direct_writes_go_in_place() {
    if !check_available("engine_direct_writes_go_in_place") {
        return;
    }
    let img = Scratch::mkfs("nocow-engine", 256 << 20, &[]);
    let e = ubtrfs_core::engine::Engine::open(&OpenOptions::new(&img.path)).expect("engine");
    let top = e.read(|l| Ok(l.root_dir())).expect("root");
    let (c, p) = e
        .write(|w| {
            let c = w.create_file(top.root, top.ino, b"c", &InodeAttrs::new(0o644))?;
            w.set_fsflags(InodeId { root: top.root, ino: c }, fsflags::NOCOW)?;
            let p = w.create_file(top.root, top.ino, b"p", &InodeAttrs::new(0o644))?;
            w.fallocate(InodeId { root: top.root, ino: p }, 0, 0, 1 << 20)?;
            Ok((c, p))
        })
        .expect("create");
    let id = |ino| ubtrfs_core::inode::filesystem::InodeId { root: top.root, ino };
    let mut want_c = Rng::new(1).bytes(1 << 20);
    e.write_file(id(c), 0, &want_c).expect("write c");
    e.commit().expect("commit");
    let items = |name: &str| {
        let mut names = HashMap::new();
        e.read(|l| Ok(layout(l, name, &mut names))).expect("layout")
    };
    let before = e.read(|l| l.file_extents(id(c), 0, u64::MAX)).expect("extents");
    // In place up to EOF, a new extent past it.
    let d = Rng::new(2).bytes(768 << 10);
    e.write_file(id(c), 512 << 10, &d).expect("overwrite c");
    want_c.resize((512 << 10) + d.len(), 0);
    want_c[512 << 10..].copy_from_slice(&d);
    assert_eq!(items("c"), vec![(0, 'r', 0, 0, 1 << 20, 0), (1 << 20, 'r', 1, 0, 256 << 10, 0)]);
    let after = e.read(|l| l.file_extents(id(c), 0, 1 << 20)).expect("extents");
    assert_eq!(before, after, "the overwritten extent stayed where it was");
    // Into the preallocation: split, then merged.
    let d1 = Rng::new(3).bytes(64 << 10);
    e.write_file(id(p), 128 << 10, &d1).expect("write p");
    assert_eq!(
        items("p"),
        vec![
            (0, 'p', 0, 0, 128 << 10, 0),
            (128 << 10, 'r', 0, 128 << 10, 64 << 10, 0),
            (192 << 10, 'p', 0, 192 << 10, 832 << 10, 0)
        ]
    );
    let d2 = Rng::new(4).bytes(128 << 10);
    e.write_file(id(p), 0, &d2).expect("write p");
    assert_eq!(
        items("p"),
        vec![(0, 'r', 0, 0, 192 << 10, 0), (192 << 10, 'p', 0, 192 << 10, 832 << 10, 0)]
    );
    e.commit().expect("commit");
    let mut want_p = vec![0u8; 1 << 20];
    want_p[..128 << 10].copy_from_slice(&d2);
    want_p[128 << 10..192 << 10].copy_from_slice(&d1);
    assert_eq!(e.read(|l| Ok(contents(l, "c"))).expect("read c"), want_c);
    assert_eq!(e.read(|l| Ok(contents(l, "p"))).expect("read p"), want_p);
    drop(e);
    assert_check(&img.path, "nocow-engine");
}
