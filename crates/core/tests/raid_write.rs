//! Writes to multi-device images, against the kernel: kernel-made RAID0, RAID1, RAID10
//! and RAID1C3 images (the fixtures) and fresh `mkfs.btrfs` images of several devices
//! take files through the engine, with enough data and metadata for new chunks of every
//! type. Each result passes `btrfs check --readonly --check-data-csum` over loop devices
//! of all its members, mounts in the kernel with exactly the files written, shows only
//! the image's profiles in `btrfs filesystem df`, and reads back through ubtrfs from
//! each mirror alone (every copy was written). New chunks follow the kernel's device
//! choice: the devices with the most unallocated space.
//!
//! Copies of one fixture share its fsid, and the kernel keeps one registered device
//! list per fsid, so the tests here run one at a time and forget their devices after.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use ubtrfs_core::disk_io::FsInfo;
use ubtrfs_core::inode::filesystem::{FsRead, InodeId};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::{Error, OpenOptions, XattrRead};
use ubtrfs_format::structs::*;
use write_common::*;

const MIB: u64 = 1 << 20;

/// One test at a time (see the module notes).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn opts(paths: &[PathBuf], writable: bool) -> OpenOptions {
    OpenOptions {
        devices: paths.to_vec(),
        cache_bytes: 32 << 20,
        writable,
        sources: Default::default(),
        degraded: false,
        no_log_replay: false,
    }
}

/// Fresh image files made by `mkfs.btrfs ARGS` over all of them, of these sizes.
fn mkfs_multi(tag: &str, sizes: &[u64], args: &[&str]) -> Vec<Scratch> {
    let imgs: Vec<Scratch> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let path =
                std::env::temp_dir().join(format!("ubtrfs-{tag}-{i}-{}.img", std::process::id()));
            let _ = std::fs::remove_file(&path);
            std::fs::File::create(&path).and_then(|f| f.set_len(size)).expect("create image");
            Scratch { path }
        })
        .collect();
    let out = Command::new("mkfs.btrfs")
        .args(["-q", "-f"])
        .args(args)
        .args(imgs.iter().map(|s| &s.path))
        .output()
        .expect("run mkfs.btrfs");
    assert!(
        out.status.success(),
        "mkfs.btrfs {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    imgs
}

fn fixture_copies(f: &str, tag: &str) -> Vec<Scratch> {
    let n = common::fixture_images(f).len();
    (0..n).map(|i| Scratch::fixture_device(f, i, &format!("{tag}-{f}-{i}"))).collect()
}

/// The members of one filesystem attached as loop devices, detached (and forgotten by
/// the kernel's device registry) on drop.
struct Loops {
    devs: Vec<String>,
}

impl Loops {
    fn new(imgs: &[Scratch]) -> Loops {
        let mut devs = Vec::new();
        for s in imgs {
            let out = Command::new("losetup")
                .args(["-f", "--show"])
                .arg(&s.path)
                .output()
                .expect("run losetup");
            assert!(
                out.status.success(),
                "losetup {}: {}",
                s.path.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            devs.push(String::from_utf8_lossy(&out.stdout).trim().to_string());
        }
        Loops { devs }
    }

    /// `btrfs check --readonly --check-data-csum` on the first member (progs finds the
    /// others by scanning).
    fn check(&self, what: &str) {
        if let Err(t) = btrfs_check(Path::new(&self.devs[0])) {
            panic!("{what}: btrfs check failed:\n{t}");
        }
    }

    /// A kernel mount of all members.
    fn mount(&self, ro: bool) -> Mount {
        let mut o = String::from(if ro { "ro" } else { "rw" });
        for d in &self.devs {
            o.push_str(&format!(",device={d}"));
        }
        // Not a loop mount: the members already are loop devices.
        let dir = std::env::temp_dir().join(format!("ubtrfs-raid-mnt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mount dir");
        let out = Command::new("mount")
            .args(["-t", "btrfs", "-o", &o])
            .arg(&self.devs[0])
            .arg(&dir)
            .output()
            .expect("run mount");
        assert!(out.status.success(), "mount {o}: {}", String::from_utf8_lossy(&out.stderr));
        Mount::adopt(dir)
    }
}

impl Drop for Loops {
    fn drop(&mut self) {
        for d in &self.devs {
            let _ = Command::new("btrfs").args(["device", "scan", "--forget", d]).output();
            let _ = Command::new("losetup").args(["-d", d]).output();
        }
    }
}

/// File contents with a recognisable pattern per file.
fn content(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut v = rng.bytes(n.min(4096));
    while v.len() < n {
        let k = v.len();
        v.extend_from_within(..(n - k).min(k));
    }
    v
}

/// Chunks of type `ty` the writer knows (committed and new).
fn chunks_of(w: &FsWriter, ty: u64) -> usize {
    w.info.chunk_map.iter().filter(|c| c.type_ & BLOCK_GROUP_TYPE_MASK == ty).count()
}

/// What one file holds: its data and its `user.pad` xattr, if any.
type Files = BTreeMap<String, (Vec<u8>, Option<Vec<u8>>)>;

/// Files in a few directories, committing every 50: empty files each with a
/// 12000-byte xattr (most of a leaf apiece) until a new metadata chunk was needed, then
/// data files (up to 1 MiB) until a new data chunk was needed.
fn write_files(w: &mut FsWriter, rng: &mut Rng, prefix: &str) -> Files {
    let top = w.live().root_dir();
    let mut dirs = Vec::new();
    for d in 0..4 {
        let name = format!("{prefix}-d{d}");
        let ino =
            w.mkdir(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o755)).expect("mkdir");
        dirs.push((name, ino));
    }
    let (data0, meta0) = (chunks_of(w, BLOCK_GROUP_DATA), chunks_of(w, BLOCK_GROUP_METADATA));
    let mut files = Files::new();
    for i in 0..20000 {
        let data_phase = chunks_of(w, BLOCK_GROUP_METADATA) > meta0;
        if data_phase && chunks_of(w, BLOCK_GROUP_DATA) > data0 {
            break;
        }
        let (dname, dino) = &dirs[i % dirs.len()];
        let name = format!("f{i}");
        let ino = w
            .create_file(top.root, *dino, name.as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        let (data, x) = if data_phase {
            let size = if rng.chance(30) { rng.below(3000) } else { rng.below(1 << 20) } as usize;
            (content(rng, size), None)
        } else {
            (Vec::new(), Some(content(rng, 12000)))
        };
        if !data.is_empty() {
            w.write_file(top.root, ino, 0, &data).expect("write");
        }
        if let Some(x) = &x {
            w.setxattr(InodeId { root: top.root, ino }, b"user.pad", x, 0).expect("setxattr");
        }
        files.insert(format!("{dname}/{name}"), (data, x));
        if i % 50 == 49 {
            w.commit().expect("commit");
        }
    }
    w.commit().expect("commit");
    files
}

/// Every file read back through ubtrfs from the devices `paths` (a subset of the
/// members: the reads use the copies on them).
fn ubtrfs_reads(paths: &[PathBuf], files: &Files, what: &str) {
    let fs = ubtrfs_core::inode::filesystem::Filesystem::open(&opts(paths, false))
        .unwrap_or_else(|e| panic!("{what}: open: {e}"));
    for (p, (data, x)) in files {
        let id =
            fs.resolve_id(&format!("/{p}"), false).unwrap_or_else(|e| panic!("{what}: /{p}: {e}"));
        if let Some(x) = x {
            let got = fs
                .getxattr(id, b"user.pad")
                .unwrap_or_else(|e| panic!("{what}: getxattr /{p}: {e}"));
            assert!(got == *x, "{what}: /{p}: user.pad differs");
        }
        let v = fs
            .load_inode(
                id,
                ubtrfs_core::inode::filesystem::Load {
                    extents: true,
                    ..ubtrfs_core::inode::filesystem::Load::ITEM
                },
            )
            .unwrap_or_else(|e| panic!("{what}: /{p}: {e}"));
        let mut got = vec![0u8; v.size() as usize];
        let n = fs.read_at(&v, 0, &mut got).unwrap_or_else(|e| panic!("{what}: read /{p}: {e}"));
        assert_eq!(n, got.len(), "{what}: /{p}: short read");
        assert!(got == *data, "{what}: /{p}: {} bytes read, {} written", got.len(), data.len());
    }
}

fn kernel_reads(m: &Mount, files: &Files, what: &str) {
    for (p, (data, x)) in files {
        if let Some(x) = x {
            let got = kernel_xattr(&m.path(p), "user.pad");
            assert!(
                got == *x,
                "{what}: kernel reads user.pad of /{p}: {} bytes, {} written",
                got.len(),
                x.len()
            );
        }
        let got =
            std::fs::read(m.path(p)).unwrap_or_else(|e| panic!("{what}: kernel read /{p}: {e}"));
        assert!(
            got == *data,
            "{what}: kernel reads /{p}: {} bytes, {} written",
            got.len(),
            data.len()
        );
    }
}

/// Block groups of the committed image: (start, length, flags).
fn groups(paths: &[PathBuf]) -> Vec<(u64, u64, u64)> {
    let info = FsInfo::open(&opts(paths, false)).expect("open");
    info.block_groups()
        .expect("block groups")
        .into_iter()
        .map(|g| (g.start, g.length, g.flags))
        .collect()
}

/// The value of xattr `name` of `path` through the kernel.
fn kernel_xattr(path: &Path, name: &str) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let p = std::ffi::CString::new(path.as_os_str().as_bytes()).expect("path");
    let n = std::ffi::CString::new(name).expect("name");
    let mut buf = vec![0u8; 65536];
    // SAFETY: valid NUL-terminated strings and a buffer of the length passed.
    let r = unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(r >= 0, "lgetxattr {} {name}: {}", path.display(), std::io::Error::last_os_error());
    buf.truncate(r as usize);
    buf
}

/// Profiles in use per type, as `btrfs filesystem df` on the kernel mount lists them.
fn df_profiles(m: &Mount) -> Vec<String> {
    let out = Command::new("btrfs")
        .args(["filesystem", "df"])
        .arg(m.path(""))
        .output()
        .expect("btrfs filesystem df");
    assert!(out.status.success(), "btrfs filesystem df: {}", String::from_utf8_lossy(&out.stderr));
    let mut v: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.starts_with("GlobalReserve"))
        .filter_map(|l| l.split(':').next())
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

/// Kernel-made RAID images take new files and chunks of every type through ubtrfs;
/// the kernel reads them and its own files unchanged, btrfs check is clean, each
/// mirror holds every byte, and the kernel can then delete and write on top. The
/// images are fresh `mkfs.btrfs` ones the kernel populated first (the fixtures' 128 MiB
/// devices leave no room for new chunks of both types; `fixture_raid_images_take_writes`
/// covers them).
#[test]
fn kernel_made_raid_images_take_writes() {
    if !common::kernel_available_with("kernel_made_raid_images_take_writes", &["/usr/sbin/losetup"])
    {
        return;
    }
    let _g = serial();
    // (profile, devices, device subsets that each hold a full copy)
    let cases: [(&str, usize, &[&[usize]]); 4] = [
        ("raid0", 2, &[]),
        ("raid1", 2, &[&[0], &[1]]),
        ("raid10", 4, &[&[0, 2], &[1, 3]]),
        ("raid1c3", 3, &[&[0], &[1], &[2]]),
    ];
    for (f, ndev, halves) in cases {
        let sizes = vec![256 * MIB; ndev];
        let imgs = mkfs_multi(&format!("rw-{f}"), &sizes, &["-d", f, "-m", f]);
        let paths: Vec<PathBuf> = imgs.iter().map(|s| s.path.clone()).collect();
        let mut rng = Rng::new(f.len() as u64);
        // The kernel's own files first.
        let theirs = {
            let loops = Loops::new(&imgs);
            let m = loops.mount(false);
            std::fs::create_dir(m.path("k")).expect("mkdir");
            for i in 0..8 {
                std::fs::write(m.path(&format!("k/{i}")), content(&mut rng, (i + 1) << 18))
                    .expect("kernel write");
            }
            let t = walk_kernel(&m.path(""));
            m.umount();
            t
        };
        let before = groups(&paths);
        let mut w = FsWriter::open(&opts(&paths, true))
            .unwrap_or_else(|e| panic!("{f}: open for writing: {e}"));
        let files = write_files(&mut w, &mut rng, "u");
        drop(w);
        let after = groups(&paths);
        for ty in [BLOCK_GROUP_DATA, BLOCK_GROUP_METADATA] {
            let n = |g: &[(u64, u64, u64)]| {
                g.iter().filter(|x| x.2 & BLOCK_GROUP_TYPE_MASK == ty).count()
            };
            assert!(
                n(&after) > n(&before),
                "{f}: no new {} chunk: before {before:?}, after {after:?}",
                block_group_flags_str(ty)
            );
        }
        let profiles_before: std::collections::BTreeSet<u64> = before.iter().map(|g| g.2).collect();
        for g in &after {
            assert!(
                profiles_before.contains(&g.2),
                "{f}: new group {g:?} has a profile the image did not use ({profiles_before:?})"
            );
        }
        for half in halves {
            let sub: Vec<PathBuf> = half.iter().map(|&i| paths[i].clone()).collect();
            ubtrfs_reads(&sub, &files, &format!("{f}: devices {half:?} alone"));
        }
        let loops = Loops::new(&imgs);
        loops.check(&format!("{f}: after ubtrfs wrote"));
        let m = loops.mount(false);
        kernel_reads(&m, &files, f);
        let mine = |t: Tree| -> Tree {
            t.into_iter().filter(|(p, _)| p == "k" || p.starts_with("k/")).collect()
        };
        assert_same(
            &mine(theirs),
            &mine(walk_kernel(&m.path(""))),
            &format!("{f}: the kernel's own files"),
        );
        let df = df_profiles(&m);
        let want: Vec<String> = ["Data", "Metadata", "System"]
            .iter()
            .map(|t| format!("{t}, {}", f.to_uppercase()))
            .collect();
        assert_eq!(df, want, "{f}: btrfs filesystem df");
        // The kernel deletes half of what ubtrfs wrote and writes on top.
        for p in files.keys().step_by(2) {
            std::fs::remove_file(m.path(p)).expect("kernel unlink");
        }
        let out = Command::new("sync").arg("-f").arg(m.path("")).output().expect("sync");
        assert!(out.status.success());
        std::fs::write(m.path("kernel-file"), content(&mut rng, 8 << 20))
            .unwrap_or_else(|e| panic!("{f}: kernel write: {e}"));
        m.umount();
        loops.check(&format!("{f}: after the kernel wrote on top"));
    }
}

/// The kernel-made RAID fixtures (files of many 64 KiB stripes, sparse files, xattrs)
/// take a few hundred files through ubtrfs with their own files unchanged, check
/// clean, and mount with everything.
#[test]
fn fixture_raid_images_take_writes() {
    if !common::kernel_available_with("fixture_raid_images_take_writes", &["/usr/sbin/losetup"]) {
        return;
    }
    let _g = serial();
    for f in ["raid0", "raid1", "raid10", "raid1c3"] {
        let imgs = fixture_copies(f, "fx");
        let paths: Vec<PathBuf> = imgs.iter().map(|s| s.path.clone()).collect();
        let theirs = {
            let loops = Loops::new(&imgs);
            let m = loops.mount(true);
            let t = walk_kernel(&m.path(""));
            m.umount();
            t
        };
        let mut w = FsWriter::open(&opts(&paths, true))
            .unwrap_or_else(|e| panic!("{f}: open for writing: {e}"));
        let top = w.live().root_dir();
        let mut rng = Rng::new(3);
        let mut files = Files::new();
        for i in 0..300 {
            let name = format!("u{i}");
            let n = rng.below(64 << 10) as usize;
            let data = content(&mut rng, n);
            let ino = w
                .create_file(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o644))
                .expect("create");
            w.write_file(top.root, ino, 0, &data).expect("write");
            files.insert(name, (data, None));
        }
        w.commit().expect("commit");
        drop(w);
        let loops = Loops::new(&imgs);
        loops.check(&format!("{f}: after ubtrfs wrote"));
        let m = loops.mount(true);
        kernel_reads(&m, &files, f);
        // Everything but the top directory (whose size and times the new names changed).
        let now: Tree = walk_kernel(&m.path(""))
            .into_iter()
            .filter(|(p, _)| !p.is_empty() && !files.contains_key(p))
            .collect();
        m.umount();
        let was: Tree = theirs.into_iter().filter(|(p, _)| !p.is_empty()).collect();
        assert_same(&was, &now, &format!("{f}: the fixture's own files"));
    }
}

/// Per chunk in allocation (logical) order: (logical, flags, stripe size, devids).
fn chunks(paths: &[PathBuf]) -> Vec<(u64, u64, u64, Vec<u64>)> {
    let info = FsInfo::open(&opts(paths, false)).expect("open");
    info.chunk_map
        .iter()
        .map(|c| {
            let n = c.stripes.len() as u64;
            let stripe = match c.profile() {
                BLOCK_GROUP_RAID0 => c.length / n,
                BLOCK_GROUP_RAID10 => c.length * u64::from(c.sub_stripes) / n,
                _ => c.length,
            };
            (c.logical, c.type_, stripe, c.stripes.iter().map(|s| s.0).collect())
        })
        .collect()
}

/// Fresh multi-device images of unequal devices, filled by ubtrfs until the space runs
/// out: every new chunk goes to the devices with the most unallocated space (the
/// kernel's rule: nothing is freed here, so each device's largest hole is its
/// unallocated tail), ENOSPC comes before anything changes, no chunk has a profile the
/// image did not ask for, and the result checks clean and mounts with every file.
#[test]
fn new_chunks_go_to_the_devices_with_most_room() {
    if !common::kernel_available_with(
        "new_chunks_go_to_the_devices_with_most_room",
        &["/usr/sbin/losetup"],
    ) {
        return;
    }
    let _g = serial();
    for (profile, sizes, args) in [
        ("raid1", &[256 * MIB, 384 * MIB, 512 * MIB][..], &["-d", "raid1", "-m", "raid1"][..]),
        (
            "raid10",
            &[256 * MIB, 256 * MIB, 384 * MIB, 384 * MIB, 512 * MIB][..],
            &["-d", "raid10", "-m", "raid1c3"][..],
        ),
        ("raid0", &[256 * MIB, 512 * MIB][..], &["-d", "raid0", "-m", "raid1"][..]),
    ] {
        let imgs = mkfs_multi(&format!("grow-{profile}"), sizes, args);
        let paths: Vec<PathBuf> = imgs.iter().map(|s| s.path.clone()).collect();
        let initial = chunks(&paths);
        let flags_made: std::collections::BTreeSet<u64> = initial.iter().map(|c| c.1).collect();
        let mut w =
            FsWriter::open(&opts(&paths, true)).unwrap_or_else(|e| panic!("{profile}: open: {e}"));
        let top = w.live().root_dir();
        let mut rng = Rng::new(9);
        let mut files = BTreeMap::new();
        for i in 0.. {
            let name = format!("big{i}");
            let data = content(&mut rng, 8 << 20);
            let ino = w
                .create_file(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o644))
                .expect("create");
            if let Err(e) = w.write_file(top.root, ino, 0, &data) {
                assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::NoSpace), "{profile}: {e}");
                w.unlink(top.root, top.ino, name.as_bytes()).expect("unlink the empty file");
                break;
            }
            files.insert(name, (data, None));
            if i % 4 == 3 {
                w.commit().expect("commit");
            }
        }
        w.commit().expect("commit");
        drop(w);
        assert!(files.len() > 8, "{profile}: only {} files fit", files.len());
        // Replay the allocations: each new chunk's devices had at least as much
        // unallocated space as any device it left out.
        let mut unalloc: BTreeMap<u64, u64> =
            sizes.iter().enumerate().map(|(i, &s)| (i as u64 + 1, s - MIB)).collect();
        let all = chunks(&paths);
        let mut new = 0;
        for (logical, flags, stripe, devs) in &all {
            let is_new = !initial.iter().any(|c| c.0 == *logical);
            if is_new {
                new += 1;
                assert!(
                    flags_made.contains(flags),
                    "{profile}: chunk {logical} is {}, not a profile mkfs made",
                    block_group_flags_str(*flags)
                );
                let low = devs.iter().map(|d| unalloc[d]).min().expect("a stripe");
                for (d, &u) in &unalloc {
                    if !devs.contains(d) {
                        assert!(u <= low, "{profile}: chunk {logical} ({}) on devices {devs:?} left out device {d} with {u} bytes unallocated, more than {low}", block_group_flags_str(*flags));
                    }
                }
            }
            for d in devs {
                let u = unalloc.get_mut(d).expect("a member");
                *u = u
                    .checked_sub(*stripe)
                    .unwrap_or_else(|| panic!("{profile}: device {d} allocated past its end"));
            }
        }
        assert!(new > 4, "{profile}: {new} new chunks");
        let loops = Loops::new(&imgs);
        loops.check(&format!("{profile}: filled"));
        let m = loops.mount(true);
        kernel_reads(&m, &files, profile);
        let df = df_profiles(&m);
        m.umount();
        eprintln!("{profile}: {} files of 8 MiB, {new} new chunks; df {df:?}; unallocated at the end {unalloc:?}", files.len());
    }
}

/// A device whose superblock is older than the others' (it missed commits while the
/// filesystem was mounted without it) makes the writer refuse, naming it.
#[test]
fn a_stale_device_is_refused_for_writing() {
    let _g = serial();
    let imgs = fixture_copies("raid1", "stale");
    let paths: Vec<PathBuf> = imgs.iter().map(|s| s.path.clone()).collect();
    let old = std::fs::read(&paths[1]).expect("read device 2");
    {
        let mut w = FsWriter::open(&opts(&paths, true)).expect("open");
        let top = w.live().root_dir();
        w.create_file(top.root, top.ino, b"new", &InodeAttrs::new(0o644)).expect("create");
        w.commit().expect("commit");
    }
    std::fs::write(&paths[1], &old).expect("put device 2 back as it was");
    let before: Vec<String> = imgs.iter().map(|s| s.sha256()).collect();
    match FsWriter::open(&opts(&paths, true)) {
        Err(Error::Incompatible(msg)) => {
            assert!(msg.contains("device 2") && msg.contains("generation"), "{msg}")
        }
        Err(e) => panic!("expected Incompatible, got {e}"),
        Ok(_) => panic!("opened a stale device for writing"),
    }
    assert_eq!(
        before,
        imgs.iter().map(|s| s.sha256()).collect::<Vec<_>>(),
        "refusing changed the images"
    );
}

/// `btrfs check` of a filesystem with members missing: clean but for progs' warning
/// that they are.
fn check_degraded(dev: &str, what: &str) {
    let out = Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum", dev])
        .output()
        .expect("run btrfs check");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let bad = text.lines().any(|l| {
        (l.contains("ERROR") && !l.contains("cannot scan"))
            || l.contains("error(s) found")
            || l.contains("mismatch")
    });
    assert!(
        out.status.success() && !bad && text.contains("no error found"),
        "{what}: btrfs check:\n{text}"
    );
}

/// A RAID1 image with one device missing is written only when degraded writes are
/// asked for; then files land on the member present, a new chunk there is SINGLE (the
/// profile needs two devices), progs checks it clean but for the missing device, and
/// the kernel mounts it degraded with every file. A RAID10 image is writable degraded
/// without one device and refused without two (its chunks keep no whole copy).
#[test]
fn degraded_writes_only_when_asked() {
    if !common::kernel_available_with("degraded_writes_only_when_asked", &["/usr/sbin/losetup"]) {
        return;
    }
    let _g = serial();
    let imgs = mkfs_multi("deg-raid1", &[256 * MIB, 256 * MIB], &["-d", "raid1", "-m", "raid1"]);
    let one = vec![imgs[0].path.clone()];
    let before = imgs[0].sha256();
    match FsWriter::open(&opts(&one, true)) {
        Err(Error::Incompatible(msg)) => assert!(msg.contains("--degraded"), "{msg}"),
        Err(e) => panic!("expected Incompatible, got {e}"),
        Ok(_) => panic!("opened a RAID1 image missing a device without degraded"),
    }
    assert_eq!(before, imgs[0].sha256(), "refusing changed the image");
    let groups_before = groups(&one);
    let mut w =
        FsWriter::open(&OpenOptions { degraded: true, ..opts(&one, true) }).expect("open degraded");
    let top = w.live().root_dir();
    let mut rng = Rng::new(11);
    let mut files = Files::new();
    // More than the data chunk holds: a new data chunk on the one device.
    for i in 0..90 {
        let name = format!("deg{i}");
        let data = content(&mut rng, 1 << 20);
        let ino = w
            .create_file(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        w.write_file(top.root, ino, 0, &data).expect("write");
        files.insert(name, (data, None));
    }
    w.commit().expect("commit");
    drop(w);
    let new: Vec<(u64, u64, u64)> =
        groups(&one).into_iter().filter(|g| !groups_before.contains(g)).collect();
    assert!(!new.is_empty(), "no new chunk");
    for g in &new {
        assert_eq!(
            g.2 & BLOCK_GROUP_PROFILE_MASK,
            0,
            "new group {g:?} on one device is not SINGLE"
        );
    }
    ubtrfs_reads(&one, &files, "degraded raid1, device 1 alone");
    let loops = Loops::new(&imgs[..1]);
    check_degraded(&loops.devs[0], "degraded raid1");
    let dir = std::env::temp_dir().join(format!("ubtrfs-raid-mnt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mount dir");
    let out = Command::new("mount")
        .args(["-t", "btrfs", "-o", "ro,degraded"])
        .arg(&loops.devs[0])
        .arg(&dir)
        .output()
        .expect("run mount");
    assert!(out.status.success(), "mount -o degraded: {}", String::from_utf8_lossy(&out.stderr));
    let m = Mount::adopt(dir);
    kernel_reads(&m, &files, "degraded raid1");
    m.umount();
    drop(loops);
    // RAID10 over four devices: one missing is tolerated, two are not.
    let imgs = fixture_copies("raid10", "deg");
    let three: Vec<PathBuf> = imgs[1..].iter().map(|s| s.path.clone()).collect();
    let mut w = FsWriter::open(&OpenOptions { degraded: true, ..opts(&three, true) })
        .expect("raid10 without one device, degraded");
    let top = w.live().root_dir();
    let data = content(&mut rng, 300 << 10);
    let ino = w.create_file(top.root, top.ino, b"r10", &InodeAttrs::new(0o644)).expect("create");
    w.write_file(top.root, ino, 0, &data).expect("write");
    w.commit().expect("commit");
    drop(w);
    ubtrfs_reads(&three, &Files::from([("r10".to_string(), (data, None))]), "degraded raid10");
    let two: Vec<PathBuf> = imgs[2..].iter().map(|s| s.path.clone()).collect();
    // Refused either way: by the degradable check, or before it, reading a tree block
    // whose copies were all on the missing devices.
    match FsWriter::open(&OpenOptions { degraded: true, ..opts(&two, true) }) {
        Err(Error::Incompatible(msg)) => {
            assert!(msg.contains("stripes on missing devices"), "{msg}")
        }
        Err(e) => assert!(e.to_string().contains("is missing"), "{e}"),
        Ok(_) => panic!("opened raid10 missing two devices for writing"),
    }
    // RAID1 metadata over RAID0 data: the trees read from either device, but a data
    // chunk without one of its stripes keeps no copy, so the degraded open refuses.
    let imgs = fixture_copies("raid0", "deg");
    let one = vec![imgs[0].path.clone()];
    match FsWriter::open(&OpenOptions { degraded: true, ..opts(&one, true) }) {
        Err(Error::Incompatible(msg)) => assert!(
            msg.contains("Data, RAID0") && msg.contains("stripes on missing devices [2]"),
            "{msg}"
        ),
        Err(e) => panic!("expected Incompatible, got {e}"),
        Ok(_) => panic!("opened raid0 data missing a device for writing"),
    }
}

/// Random creates, overwrites at any offset, truncations, renames and unlinks on
/// multi-device images, against a map of what each file holds, with commits and
/// reopens along the way: after every reopen each file reads back as the model says
/// from every mirror alone; at the end `btrfs check` is clean and the kernel reads the
/// same.
#[test]
fn random_operations_on_raid_against_a_model() {
    if !common::kernel_available_with(
        "random_operations_on_raid_against_a_model",
        &["/usr/sbin/losetup"],
    ) {
        return;
    }
    let _g = serial();
    let ops: usize =
        std::env::var("UBTRFS_RAID_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(500);
    for (seed, profile, ndev, halves) in [
        (1u64, "raid1", 2, &[&[0usize][..], &[1]][..]),
        (2, "raid10", 4, &[&[0, 2][..], &[1, 3]][..]),
        (3, "raid0", 3, &[][..]),
        (4, "raid1c3", 3, &[&[0][..], &[2]][..]),
    ] {
        let imgs = mkfs_multi(
            &format!("model-{profile}"),
            &vec![192 * MIB; ndev],
            &["-d", profile, "-m", profile],
        );
        let paths: Vec<PathBuf> = imgs.iter().map(|s| s.path.clone()).collect();
        let mut rng = Rng::new(seed);
        let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        let mut w = FsWriter::open(&opts(&paths, true)).expect("open");
        let verify = |model: &BTreeMap<String, Vec<u8>>, what: &str| {
            let files: Files = model.iter().map(|(k, v)| (k.clone(), (v.clone(), None))).collect();
            ubtrfs_reads(&paths, &files, what);
            for half in halves {
                let sub: Vec<PathBuf> = half.iter().map(|&i| paths[i].clone()).collect();
                ubtrfs_reads(&sub, &files, &format!("{what}, devices {half:?} alone"));
            }
        };
        let budget_used =
            |m: &BTreeMap<String, Vec<u8>>| m.values().map(|v| v.len()).sum::<usize>();
        for op in 0..ops {
            let top = w.live().root_dir();
            let names: Vec<String> = model.keys().cloned().collect();
            let pick = |rng: &mut Rng| names[rng.below(names.len() as u64) as usize].clone();
            match rng.below(100) {
                0..=29 if budget_used(&model) < 40 << 20 => {
                    let name = format!("f{op}");
                    let n = rng.below(400_000) as usize;
                    let data = content(&mut rng, n);
                    let ino = w
                        .create_file(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o644))
                        .expect("create");
                    w.write_file(top.root, ino, 0, &data).expect("write");
                    model.insert(name, data);
                }
                30..=59 if !names.is_empty() => {
                    let name = pick(&mut rng);
                    let id = w.live().resolve_id(&format!("/{name}"), false).expect("resolve");
                    let buf = model.get_mut(&name).expect("in the model");
                    let off = rng.below(buf.len() as u64 + 5000) as usize;
                    let n = 1 + rng.below(100_000) as usize;
                    let data = content(&mut rng, n);
                    w.write_file(id.root, id.ino, off as u64, &data).expect("overwrite");
                    model_write(buf, off as u64, &data);
                }
                60..=69 if !names.is_empty() => {
                    let name = pick(&mut rng);
                    let id = w.live().resolve_id(&format!("/{name}"), false).expect("resolve");
                    let buf = model.get_mut(&name).expect("in the model");
                    let size = rng.below(buf.len() as u64 * 2 + 1);
                    w.setattr(
                        id,
                        &ubtrfs_core::inode::attr::SetAttr {
                            size: Some(size),
                            ..Default::default()
                        },
                    )
                    .expect("truncate");
                    buf.resize(size as usize, 0);
                }
                70..=79 if !names.is_empty() => {
                    let (a, b) = (pick(&mut rng), format!("r{op}"));
                    w.rename(top.root, top.ino, a.as_bytes(), top.ino, b.as_bytes(), 0)
                        .expect("rename");
                    let v = model.remove(&a).expect("in the model");
                    model.insert(b, v);
                }
                80..=91 if !names.is_empty() => {
                    let name = pick(&mut rng);
                    w.unlink(top.root, top.ino, name.as_bytes()).expect("unlink");
                    model.remove(&name);
                }
                92..=97 => {
                    w.commit().expect("commit");
                }
                _ => {
                    w.commit().expect("commit");
                    drop(w);
                    verify(&model, &format!("{profile} seed {seed} op {op}"));
                    w = FsWriter::open(&opts(&paths, true)).expect("reopen");
                }
            }
        }
        w.commit().expect("commit");
        drop(w);
        verify(&model, &format!("{profile} seed {seed} end"));
        let loops = Loops::new(&imgs);
        loops.check(&format!("{profile}: after the model run"));
        let m = loops.mount(true);
        let files: Files = model.iter().map(|(k, v)| (k.clone(), (v.clone(), None))).collect();
        kernel_reads(&m, &files, profile);
        m.umount();
    }
}
