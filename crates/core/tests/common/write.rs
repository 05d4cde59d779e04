//! Helpers for the write-path tests (write_roundtrip, write_model): scratch images
//! (fresh `mkfs.btrfs` or copies of the kernel-made fixtures), an in-memory model of
//! the namespace we expect (types, modes, owners, sizes, contents, link counts), walks
//! of the same through ubtrfs's reader and through a kernel mount, `btrfs check`, and
//! invariant checks of the writer's trees.
//!
//! The model is the oracle: every change goes through it and through the filesystem
//! (ubtrfs's `FsWriter`, or the kernel via a mount) in the same call, and the walks must
//! equal `Model::expect()` exactly. Link counts and directory sizes are derived from the
//! model's names, so they check the writer's bookkeeping rather than repeat it.
//! Declared from test files with `#[path = "common/write.rs"] mod write_common;` next to
//! `mod common;` (it uses `crate::common` for fixtures and the root check).
#![allow(dead_code)]

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use ubtrfs_core::data::falloc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
use ubtrfs_core::inode::attr::{fsflags, SetAttr};
use ubtrfs_core::inode::filesystem::{
    DirEntry, FileExtentRec, FileKind, Filesystem, InodeId, Load,
};
use ubtrfs_core::inode::namespace::{RENAME_EXCHANGE, RENAME_NOREPLACE, RENAME_WHITEOUT};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;
use ubtrfs_core::PosixKind;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;

/// xorshift64*: tiny, seeded, good enough to drive tests reproducibly.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, n) (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        self.next_u64() % n
    }
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    pub fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len() as u64) as usize]
    }
    /// Bytes that do not compress and differ per call.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        for c in v.chunks_mut(8) {
            let x = self.next_u64().to_le_bytes();
            c.copy_from_slice(&x[..c.len()]);
        }
        v
    }
}

pub fn keep() -> bool {
    std::env::var_os("KEEP").is_some()
}

/// Where scratch images go: $UBTRFS_SCRATCH, else /dev/shm (commits fsync, which is
/// free on tmpfs and slow on a VM disk), else the temp dir.
fn scratch_dir() -> PathBuf {
    let base = match std::env::var_os("UBTRFS_SCRATCH") {
        Some(d) => PathBuf::from(d),
        None if Path::new("/dev/shm").is_dir()
            && std::fs::metadata("/dev/shm")
                .map(|m| !m.permissions().readonly())
                .unwrap_or(false) =>
        {
            PathBuf::from("/dev/shm")
        }
        None => std::env::temp_dir(),
    };
    let d = base.join("ubtrfs-write-tests");
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// A scratch image file, deleted on drop unless KEEP is set.
pub struct Scratch {
    pub path: PathBuf,
}

impl Scratch {
    /// A sparse file of `size` bytes made by `mkfs.btrfs -q -f ARGS`.
    pub fn mkfs(tag: &str, size: u64, args: &[&str]) -> Scratch {
        let path = scratch_dir().join(format!("{tag}-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        std::fs::File::create(&path).and_then(|f| f.set_len(size)).expect("create image");
        let out = Command::new("mkfs.btrfs")
            .args(["-q", "-f"])
            .args(args)
            .arg(&path)
            .output()
            .expect("run mkfs.btrfs");
        assert!(
            out.status.success(),
            "mkfs.btrfs {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Scratch { path }
    }

    /// A private copy of (the first device of) fixture `name`.
    pub fn fixture(name: &str, tag: &str) -> Scratch {
        Scratch::fixture_device(name, 0, tag)
    }

    /// A private copy of device `dev` of fixture `name`.
    pub fn fixture_device(name: &str, dev: usize, tag: &str) -> Scratch {
        let src = &crate::common::fixture_images(name)[dev];
        let path = scratch_dir().join(format!("{tag}-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        // cp keeps the copy sparse; std::fs::copy would too on most systems, but be sure.
        let ok = Command::new("cp")
            .arg("--sparse=always")
            .arg(src)
            .arg(&path)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        if !ok {
            std::fs::copy(src, &path).expect("copy fixture");
        }
        Scratch { path }
    }

    pub fn sha256(&self) -> String {
        let mut h = Sha256::new();
        let mut f = std::fs::File::open(&self.path).expect("open image");
        std::io::copy(&mut f, &mut h).expect("hash image");
        hex(&h.finalize())
    }

    pub fn writer(&self) -> FsWriter {
        FsWriter::open(&OpenOptions::new(&self.path))
            .unwrap_or_else(|e| panic!("{}: FsWriter::open: {e}", self.path.display()))
    }

    pub fn reader(&self) -> Filesystem {
        Filesystem::open(&OpenOptions::new(&self.path))
            .unwrap_or_else(|e| panic!("{}: Filesystem::open: {e}", self.path.display()))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if keep() {
            eprintln!("kept {}", self.path.display());
        } else {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// True when mkfs.btrfs and btrfs-progs are here; otherwise print why and return false,
/// except under CI=true, where skipping is a failure.
pub fn mkfs_tools(test: &str) -> bool {
    let mkfs = Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if mkfs && have_btrfs_check() {
        return true;
    }
    let why = format!("{test}: skipped: needs mkfs.btrfs ({mkfs}) and btrfs-progs");
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{why}, and CI=true forbids skipping");
    }
    eprintln!("{why}");
    false
}

/// Every byte of file `id` as a fresh reader of the image shows it.
pub fn read_image(img: &Path, id: InodeId) -> Vec<u8> {
    let fs = Filesystem::open(&OpenOptions::new(img)).expect("open image");
    let v = fs.load_inode(id, Load { extents: true, ..Load::ITEM }).expect("load inode");
    let mut buf = vec![0u8; v.size() as usize];
    let n = fs.read_at(&v, 0, &mut buf).expect("read file");
    assert_eq!(n, buf.len(), "{id}: short read of the image");
    buf
}

pub fn have_btrfs_check() -> bool {
    Command::new("btrfs").arg("--version").output().map(|o| o.status.success()).unwrap_or(false)
}

/// `btrfs check --readonly --check-data-csum`: Ok(output) when clean. progs scans
/// every block device for members of multi-device filesystems, and a loop device that
/// another test is detaching at that moment fails the scan ("cannot scan /dev/loopN"),
/// which is not this image's damage: such a run is repeated.
pub fn btrfs_check(img: &Path) -> Result<String, String> {
    let mut attempt = 0;
    loop {
        match btrfs_check_once(img) {
            Err(t)
                if attempt < 10
                    && t.lines()
                        .filter(|l| l.contains("ERROR"))
                        .all(|l| l.contains("cannot scan"))
                    && t.contains("cannot scan") =>
            {
                attempt += 1;
                std::thread::sleep(std::time::Duration::from_millis(300));
            }
            r => return r,
        }
    }
}

fn btrfs_check_once(img: &Path) -> Result<String, String> {
    let out = Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(img)
        .output()
        .map_err(|e| format!("cannot run btrfs check: {e}"))?;
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let bad_line = text.lines().any(|l| {
        l.contains("ERROR")
            || l.contains("error(s) found")
            || (l.contains("errors found") && !l.contains("no error"))
            || l.contains("mismatch")
            || l.contains("missing")
    });
    if out.status.success() && !bad_line && text.contains("no error found") {
        Ok(text)
    } else {
        Err(text)
    }
}

/// Panic with btrfs check's output unless the image is clean.
pub fn assert_check(img: &Path, what: &str) {
    if let Err(t) = btrfs_check(img) {
        panic!("{what}: btrfs check failed on {}:\n{t}", img.display());
    }
}

/// A kernel loop mount, unmounted on drop.
pub struct Mount {
    pub dir: PathBuf,
    mounted: bool,
}

impl Mount {
    pub fn new(img: &Path, rw: bool) -> Mount {
        Mount::new_with(img, if rw { "loop" } else { "loop,ro" })
    }

    /// A mount with these `-o` options (which must include `loop`).
    pub fn new_with(img: &Path, opts: &str) -> Mount {
        let dir = scratch_dir().join(format!(
            "mnt-{}-{}",
            img.file_stem().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).expect("mount dir");
        let mount = || {
            Command::new("mount")
                .args(["-t", "btrfs", "-o", opts])
                .arg(img)
                .arg(&dir)
                .output()
                .expect("run mount")
        };
        let mut out = mount();
        // Two mounts at once (another test thread, another test binary) may race for
        // the same free loop device; the loser fails to set it up and may try again.
        for _ in 0..20 {
            if out.status.success()
                || !String::from_utf8_lossy(&out.stderr).contains("failed to setup loop device")
            {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
            out = mount();
        }
        if !out.status.success() {
            let dmesg = Command::new("dmesg")
                .output()
                .map(|o| {
                    String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .rev()
                        .take(30)
                        .collect::<Vec<_>>()
                        .join("\n")
                })
                .unwrap_or_default();
            panic!(
                "mount {} failed: {}\nrecent dmesg (newest first):\n{dmesg}",
                img.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Mount { dir, mounted: true }
    }

    /// A mount the caller made at `dir`, unmounted on drop like the others.
    #[allow(dead_code)]
    pub fn adopt(dir: PathBuf) -> Mount {
        Mount { dir, mounted: true }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        if rel.is_empty() {
            self.dir.clone()
        } else {
            self.dir.join(rel)
        }
    }

    pub fn umount(mut self) {
        self.do_umount();
    }

    fn do_umount(&mut self) {
        if self.mounted {
            self.mounted = false;
            let out = umount_retrying(&self.dir);
            assert!(
                out.status.success() || std::thread::panicking(),
                "umount {} failed: {}",
                self.dir.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            let _ = std::fs::remove_dir(&self.dir);
        }
    }
}

/// `umount DIR`, retried for a moment while the kernel says the target is busy: a
/// child process another test thread is starting shares this process's descriptors
/// (files inside the mount among them) until it execs, which makes a umount at that
/// instant fail although nobody uses the mount.
pub fn umount_retrying(dir: &Path) -> std::process::Output {
    let mut out = Command::new("umount").arg(dir).output().expect("run umount");
    for _ in 0..40 {
        if out.status.success() || !String::from_utf8_lossy(&out.stderr).contains("busy") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        out = Command::new("umount").arg(dir).output().expect("run umount");
    }
    out
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.do_umount();
    }
}

/// What a walk records per path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rec {
    /// 'f' file, 'd' dir, 'l' symlink, 'p' fifo, 'c' chr, 'b' blk, 's' socket.
    pub kind: char,
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub nlink: u32,
    /// sha256 of a file's contents, a symlink's target, or a device's rdev.
    pub content: String,
}

pub type Tree = BTreeMap<String, Rec>;

/// `ls -l`'s letter, except 'f' for regular files (the model's and `walk_kernel`'s).
fn kind_char(k: FileKind) -> char {
    match k {
        FileKind::File => 'f',
        k => k.letter(),
    }
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}/{name}")
    }
}

/// The whole visible namespace as ubtrfs's reader sees it (fresh open, into subvolumes).
pub fn walk_ubtrfs(img: &Path) -> Tree {
    let fs = Filesystem::open(&OpenOptions::new(img))
        .unwrap_or_else(|e| panic!("{}: Filesystem::open: {e}", img.display()));
    let mut out = Tree::new();
    let mut stack = vec![(String::new(), fs.root_dir())];
    while let Some((path, id)) = stack.pop() {
        let v =
            fs.load_inode(id, Load::ALL).unwrap_or_else(|e| panic!("ubtrfs walk: /{path}: {e}"));
        let kind = kind_char(v.kind());
        let content = match v.kind() {
            FileKind::File => {
                let mut h = Sha256::new();
                let mut buf = vec![0u8; 4 << 20];
                let mut pos = 0u64;
                loop {
                    let n = fs
                        .read_at(&v, pos, &mut buf)
                        .unwrap_or_else(|e| panic!("ubtrfs walk: read /{path} at {pos}: {e}"));
                    if n == 0 {
                        break;
                    }
                    h.update(&buf[..n]);
                    pos += n as u64;
                }
                assert_eq!(pos, v.size(), "ubtrfs walk: /{path}: read length");
                hex(&h.finalize())
            }
            FileKind::Symlink => String::from_utf8_lossy(
                &fs.readlink(id).unwrap_or_else(|e| panic!("readlink /{path}: {e}")),
            )
            .into_owned(),
            FileKind::CharDev | FileKind::BlockDev => rdev_str(v.item.rdev.get()),
            _ => String::new(),
        };
        out.insert(
            path.clone(),
            Rec {
                kind,
                perm: v.mode() & 0o7777,
                uid: v.item.uid.get(),
                gid: v.item.gid.get(),
                size: v.size(),
                nlink: v.nlink(),
                content,
            },
        );
        if v.kind() == FileKind::Dir {
            for e in &v.entries {
                stack.push((join(&path, &String::from_utf8_lossy(&e.name)), e.target));
            }
        }
    }
    out
}

/// glibc's dev_t as "major:minor".
fn rdev_of(md: &std::fs::Metadata) -> String {
    let dev = md.rdev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    format!("{major}:{minor}")
}

/// btrfs's on-disk rdev as "major:minor".
fn rdev_str(rdev: u64) -> String {
    let (ma, mi) = rdev_decode(rdev);
    format!("{ma}:{mi}")
}

/// The namespace under a kernel mount (symlinks not followed, into subvolumes).
pub fn walk_kernel(root: &Path) -> Tree {
    let mut out = Tree::new();
    let mut stack = vec![(String::new(), root.to_path_buf())];
    while let Some((path, p)) = stack.pop() {
        let md = std::fs::symlink_metadata(&p)
            .unwrap_or_else(|e| panic!("kernel walk: stat {}: {e}", p.display()));
        let ft = md.file_type();
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_file() {
            'f'
        } else if ft.is_dir() {
            'd'
        } else if ft.is_symlink() {
            'l'
        } else if ft.is_fifo() {
            'p'
        } else if ft.is_char_device() {
            'c'
        } else if ft.is_block_device() {
            'b'
        } else {
            's'
        };
        let content = match kind {
            'f' => {
                let mut h = Sha256::new();
                let mut f = std::fs::File::open(&p)
                    .unwrap_or_else(|e| panic!("kernel walk: open {}: {e}", p.display()));
                std::io::copy(&mut f, &mut h)
                    .unwrap_or_else(|e| panic!("kernel walk: read {}: {e}", p.display()));
                hex(&h.finalize())
            }
            'l' => String::from_utf8_lossy(
                std::fs::read_link(&p).expect("readlink").as_os_str().as_bytes(),
            )
            .into_owned(),
            'c' | 'b' => rdev_of(&md),
            _ => String::new(),
        };
        out.insert(
            path.clone(),
            Rec {
                kind,
                perm: md.mode() & 0o7777,
                uid: md.uid(),
                gid: md.gid(),
                size: md.size(),
                nlink: md.nlink() as u32,
                content,
            },
        );
        if kind == 'd' {
            let mut names: Vec<_> = std::fs::read_dir(&p)
                .unwrap_or_else(|e| panic!("kernel walk: readdir {}: {e}", p.display()))
                .map(|e| e.expect("dir entry").file_name())
                .collect();
            names.sort();
            for n in names {
                stack.push((join(&path, &String::from_utf8_lossy(n.as_bytes())), p.join(&n)));
            }
        }
    }
    out
}

/// Differences between two walks, at most `max` lines.
pub fn diff_trees(expected: &Tree, actual: &Tree, max: usize) -> Vec<String> {
    let mut d = Vec::new();
    for (p, e) in expected {
        match actual.get(p) {
            None => d.push(format!("missing /{p}: expected {e:?}")),
            Some(a) if a != e => {
                d.push(format!("differs /{p}:\n    expected {e:?}\n    actual   {a:?}"))
            }
            _ => {}
        }
    }
    for (p, a) in actual {
        if !expected.contains_key(p) {
            d.push(format!("unexpected /{p}: {a:?}"));
        }
    }
    let n = d.len();
    d.truncate(max);
    if n > max {
        d.push(format!("... and {} more", n - max));
    }
    d
}

pub fn assert_same(expected: &Tree, actual: &Tree, what: &str) {
    let d = diff_trees(expected, actual, 20);
    assert!(d.is_empty(), "{what}: {} differences:\n{}", d.len(), d.join("\n"));
}

/// One inode of the model.
#[derive(Clone, Debug)]
pub struct MInode {
    pub kind: char,
    pub perm: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u64,
    /// File contents, or a symlink's target.
    pub data: Vec<u8>,
    /// Directory entries: name -> handle.
    pub children: BTreeMap<Vec<u8>, usize>,
    /// Where it lives on disk; None for inodes the kernel made that were not looked up.
    pub id: Option<InodeId>,
    /// Extended attributes, name -> value (what listxattr and getxattr return).
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    /// The NODATACOW inode flag (`chattr +C`), kept for regular files and directories.
    pub nocow: bool,
}

/// The namespace we expect, with contents.
#[derive(Clone, Debug)]
pub struct Model {
    pub inodes: Vec<Option<MInode>>,
    pub top: usize,
}

fn split_path(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("", path),
    }
}

fn mode_kind(mode: u32) -> char {
    kind_char(FileKind::from_mode(mode).expect("valid mode"))
}

impl Model {
    /// Everything ubtrfs's reader sees in `img` (into subvolumes), contents included.
    pub fn load(img: &Path) -> Model {
        let fs = Filesystem::open(&OpenOptions::new(img))
            .unwrap_or_else(|e| panic!("{}: Filesystem::open: {e}", img.display()));
        let mut m = Model { inodes: Vec::new(), top: 0 };
        let mut by_id: HashMap<InodeId, usize> = HashMap::new();
        m.top = m.load_inode(&fs, fs.root_dir(), &mut by_id);
        m
    }

    fn load_inode(
        &mut self,
        fs: &Filesystem,
        id: InodeId,
        by_id: &mut HashMap<InodeId, usize>,
    ) -> usize {
        if let Some(&h) = by_id.get(&id) {
            return h;
        }
        let v = fs.load_inode(id, Load::ALL).unwrap_or_else(|e| panic!("model load {id}: {e}"));
        let kind = kind_char(v.kind());
        let data = match v.kind() {
            FileKind::File => {
                let mut buf = vec![0u8; v.size() as usize];
                let n =
                    fs.read_at(&v, 0, &mut buf).unwrap_or_else(|e| panic!("model load {id}: {e}"));
                assert_eq!(n as u64, v.size());
                buf
            }
            FileKind::Symlink => fs.readlink(id).expect("readlink"),
            _ => Vec::new(),
        };
        let xattrs = v.xattrs.iter().cloned().collect();
        let nocow = matches!(kind, 'f' | 'd') && v.flags() & INODE_NODATACOW != 0;
        let h = self.inodes.len();
        self.inodes.push(Some(MInode {
            kind,
            perm: v.mode() & 0o7777,
            uid: v.item.uid.get(),
            gid: v.item.gid.get(),
            rdev: v.item.rdev.get(),
            data,
            children: BTreeMap::new(),
            id: Some(id),
            xattrs,
            nocow,
        }));
        by_id.insert(id, h);
        for e in &v.entries {
            let c = self.load_inode(fs, e.target, by_id);
            self.node_mut(h).children.insert(e.name.clone(), c);
        }
        h
    }

    pub fn node(&self, h: usize) -> &MInode {
        self.inodes[h].as_ref().expect("live inode handle")
    }
    pub fn node_mut(&mut self, h: usize) -> &mut MInode {
        self.inodes[h].as_mut().expect("live inode handle")
    }

    /// Handle of `path` ("" = top), if it exists.
    pub fn lookup(&self, path: &str) -> Option<usize> {
        let mut h = self.top;
        for c in path.split('/').filter(|c| !c.is_empty()) {
            h = *self.node(h).children.get(c.as_bytes())?;
        }
        Some(h)
    }

    pub fn handle(&self, path: &str) -> usize {
        self.lookup(path).unwrap_or_else(|| panic!("model: no /{path}"))
    }

    pub fn id(&self, path: &str) -> InodeId {
        self.node(self.handle(path))
            .id
            .unwrap_or_else(|| panic!("model: /{path} has no inode id yet (call resolve_ids)"))
    }

    pub fn data(&self, path: &str) -> &[u8] {
        &self.node(self.handle(path)).data
    }

    /// Every path with its handle, parents before children.
    pub fn paths(&self) -> Vec<(String, usize)> {
        let mut out = Vec::new();
        let mut stack = vec![(String::new(), self.top)];
        while let Some((p, h)) = stack.pop() {
            for (n, &c) in self.node(h).children.iter().rev() {
                stack.push((join(&p, &String::from_utf8_lossy(n)), c));
            }
            out.push((p, h));
        }
        out
    }

    /// What the walks must see. Link counts and directory sizes are derived from names.
    pub fn expect(&self) -> Tree {
        let paths = self.paths();
        let mut names: HashMap<usize, u32> = HashMap::new();
        for (_, h) in &paths {
            for &c in self.node(*h).children.values() {
                *names.entry(c).or_insert(0) += 1;
            }
        }
        let mut out = Tree::new();
        for (p, h) in paths {
            let n = self.node(h);
            let (size, content) = match n.kind {
                'f' => (n.data.len() as u64, hex(&Sha256::digest(&n.data))),
                'd' => (n.children.keys().map(|k| 2 * k.len() as u64).sum(), String::new()),
                'l' => (n.data.len() as u64, String::from_utf8_lossy(&n.data).into_owned()),
                'c' | 'b' => (0, rdev_str(n.rdev)),
                _ => (0, String::new()),
            };
            let nlink = if n.kind == 'd' { 1 } else { names.get(&h).copied().unwrap_or(1) };
            out.insert(
                p,
                Rec { kind: n.kind, perm: n.perm, uid: n.uid, gid: n.gid, size, nlink, content },
            );
        }
        out
    }

    /// Fill in the inode ids of inodes the kernel created, by path, from `img`.
    pub fn resolve_ids(&mut self, img: &Path) {
        let missing: Vec<(String, usize)> =
            self.paths().into_iter().filter(|(_, h)| self.node(*h).id.is_none()).collect();
        if missing.is_empty() {
            return;
        }
        let fs = Filesystem::open(&OpenOptions::new(img)).expect("open for resolve_ids");
        for (p, h) in missing {
            let v =
                fs.resolve(&format!("/{p}"), false).unwrap_or_else(|e| panic!("resolve /{p}: {e}"));
            self.node_mut(h).id = Some(v.id);
        }
    }

    fn add_child(&mut self, path: &str, node: MInode) -> usize {
        let (parent, name) = split_path(path);
        let ph = self.handle(parent);
        assert!(!self.node(ph).children.contains_key(name.as_bytes()), "model: /{path} exists");
        let h = self.inodes.len();
        self.inodes.push(Some(node));
        self.node_mut(ph).children.insert(name.as_bytes().to_vec(), h);
        h
    }

    /// Drop a name; the inode goes when no name is left.
    fn remove_name(&mut self, path: &str) -> usize {
        let (parent, name) = split_path(path);
        let ph = self.handle(parent);
        let h = self
            .node_mut(ph)
            .children
            .remove(name.as_bytes())
            .unwrap_or_else(|| panic!("model: no /{path}"));
        let still = self.inodes.iter().flatten().any(|n| n.children.values().any(|&c| c == h));
        if !still {
            self.inodes[h] = None;
        }
        h
    }

    /// Record a file made outside the helpers below (a test driving `FsWriter` itself).
    pub fn record_file(&mut self, path: &str, perm: u32, data: Vec<u8>, id: InodeId) -> usize {
        let (xattrs, nocow) = self.inherited(split_path(path).0);
        self.add_child(
            path,
            MInode {
                kind: 'f',
                perm,
                uid: 0,
                gid: 0,
                rdev: 0,
                data,
                children: BTreeMap::new(),
                id: Some(id),
                xattrs,
                nocow,
            },
        )
    }

    /// Record a name removed outside the helpers below.
    pub fn record_unlink(&mut self, path: &str) {
        self.remove_name(path);
    }

    /// What a new regular file or directory in directory `parent` takes from it
    /// (`btrfs_inherit_iflags`, `btrfs_inode_inherit_props`): NODATACOW, and unless it is
    /// NODATACOW, the directory's compression property without its level.
    pub fn inherited(&self, parent: &str) -> (BTreeMap<Vec<u8>, Vec<u8>>, bool) {
        let p = self.node(self.handle(parent));
        let mut x = BTreeMap::new();
        if let Some(alg) = p
            .xattrs
            .get(COMPRESSION_PROP)
            .and_then(|v| inherited_compression(v))
            .filter(|_| !p.nocow)
        {
            x.insert(COMPRESSION_PROP.to_vec(), alg.to_vec());
        }
        (x, p.nocow)
    }

    /// Whether directory `anc` is `dir` or one of its ancestors (paths; a directory has
    /// one name).
    pub fn is_ancestor_or_self(anc: &str, dir: &str) -> bool {
        anc.is_empty() || dir == anc || dir.strip_prefix(anc).is_some_and(|r| r.starts_with('/'))
    }

    /// What `renameat2(from, to, flags)` returns, by the checks in the kernel's order
    /// (`do_renameat2`, `vfs_rename`, `btrfs_rename`): EEXIST for NOREPLACE onto a name,
    /// ENOENT for EXCHANGE with none, EINVAL for a directory moved under itself,
    /// ENOTEMPTY (EINVAL for EXCHANGE) when the target is a directory above the source,
    /// success for two names of one inode, then ENOTDIR / EISDIR for mixed types and
    /// ENOTEMPTY for a directory onto a non-empty one. `from` must exist.
    pub fn rename_outcome(&self, from: &str, to: &str, flags: u32) -> Result<(), PosixKind> {
        let exchange = flags & RENAME_EXCHANGE != 0;
        let src = self.handle(from);
        let dst = self.lookup(to);
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return Err(PosixKind::Exists);
        }
        if exchange && dst.is_none() {
            return Err(PosixKind::NotFound);
        }
        let (fp, tp) = (split_path(from).0, split_path(to).0);
        let is_dir = |h: usize| self.node(h).kind == 'd';
        if fp != tp {
            if is_dir(src) && Model::is_ancestor_or_self(from, tp) {
                return Err(PosixKind::Invalid);
            }
            if dst.is_some_and(|d| is_dir(d) && Model::is_ancestor_or_self(to, fp)) {
                return Err(if exchange { PosixKind::Invalid } else { PosixKind::NotEmpty });
            }
        }
        let Some(d) = dst else { return Ok(()) };
        if d == src {
            return Ok(());
        }
        let want_dir = if exchange { is_dir(d) } else { is_dir(src) };
        if want_dir && !is_dir(d) {
            return Err(PosixKind::NotDir);
        }
        if !want_dir && is_dir(d) {
            return Err(PosixKind::IsDir);
        }
        if !exchange && is_dir(d) && !self.node(d).children.is_empty() {
            return Err(PosixKind::NotEmpty);
        }
        Ok(())
    }

    // ---- changes through ubtrfs (FsWriter) and the model together ----

    fn parent_id(&self, path: &str) -> InodeId {
        self.id(split_path(path).0)
    }

    pub fn w_mkdir(&mut self, w: &mut FsWriter, path: &str, perm: u32) -> usize {
        let p = self.parent_id(path);
        let name = split_path(path).1;
        let ino = w
            .mkdir(p.root, p.ino, name.as_bytes(), &InodeAttrs::new(perm))
            .unwrap_or_else(|e| panic!("mkdir /{path}: {e}"));
        let (xattrs, nocow) = self.inherited(split_path(path).0);
        self.add_child(
            path,
            MInode {
                kind: 'd',
                perm,
                uid: 0,
                gid: 0,
                rdev: 0,
                data: Vec::new(),
                children: BTreeMap::new(),
                id: Some(InodeId { root: p.root, ino }),
                xattrs,
                nocow,
            },
        )
    }

    /// Create file `path` and write `data` to it (no write for empty data).
    pub fn w_create(&mut self, w: &mut FsWriter, path: &str, perm: u32, data: &[u8]) -> usize {
        let p = self.parent_id(path);
        let name = split_path(path).1;
        let ino = w
            .create_file(p.root, p.ino, name.as_bytes(), &InodeAttrs::new(perm))
            .unwrap_or_else(|e| panic!("create /{path}: {e}"));
        if !data.is_empty() {
            w.write_file(p.root, ino, 0, data).unwrap_or_else(|e| panic!("write /{path}: {e}"));
        }
        let (xattrs, nocow) = self.inherited(split_path(path).0);
        self.add_child(
            path,
            MInode {
                kind: 'f',
                perm,
                uid: 0,
                gid: 0,
                rdev: 0,
                data: data.to_vec(),
                children: BTreeMap::new(),
                id: Some(InodeId { root: p.root, ino }),
                xattrs,
                nocow,
            },
        )
    }

    /// Write `data` at `off` of file `path`.
    pub fn w_write(&mut self, w: &mut FsWriter, path: &str, off: u64, data: &[u8]) {
        let id = self.id(path);
        w.write_file(id.root, id.ino, off, data)
            .unwrap_or_else(|e| panic!("write /{path} at {off} len {}: {e}", data.len()));
        model_write(&mut self.node_mut(self.handle(path)).data, off, data);
    }

    /// Remove `path`: unlink, or rmdir for an (empty) directory.
    pub fn w_unlink(&mut self, w: &mut FsWriter, path: &str) {
        let p = self.parent_id(path);
        let name = split_path(path).1.as_bytes();
        let is_dir = w
            .live()
            .lookup(p, name)
            .ok()
            .flatten()
            .is_some_and(|e| e.ftype == ubtrfs_format::structs::FT_DIR);
        let r = if is_dir { w.rmdir(p.root, p.ino, name) } else { w.unlink(p.root, p.ino, name) };
        r.unwrap_or_else(|e| panic!("unlink /{path}: {e}"));
        self.remove_name(path);
    }

    /// Hard link `existing` as `path`.
    pub fn w_link(&mut self, w: &mut FsWriter, existing: &str, path: &str) {
        let h = self.handle(existing);
        let id = self.node(h).id.expect("linked inode has an id");
        let p = self.parent_id(path);
        assert_eq!(p.root, id.root, "hard links stay inside one subvolume");
        let ft = match self.node(h).kind {
            'f' => FT_REG_FILE,
            'l' => FT_SYMLINK,
            k => panic!("model: cannot hard link kind {k}"),
        };
        w.link(p.root, p.ino, split_path(path).1.as_bytes(), id.ino, ft)
            .unwrap_or_else(|e| panic!("link /{existing} -> /{path}: {e}"));
        let (parent, name) = split_path(path);
        let ph = self.handle(parent);
        assert!(
            self.node_mut(ph).children.insert(name.as_bytes().to_vec(), h).is_none(),
            "model: /{path} exists"
        );
    }

    /// Symlink `path` -> `target`.
    pub fn w_symlink(&mut self, w: &mut FsWriter, path: &str, target: &[u8]) -> usize {
        let p = self.parent_id(path);
        let name = split_path(path).1;
        let ino = w
            .symlink(p.root, p.ino, name.as_bytes(), target, &InodeAttrs::new(0o777))
            .unwrap_or_else(|e| panic!("symlink /{path}: {e}"));
        self.add_child(
            path,
            MInode {
                kind: 'l',
                perm: 0o777,
                uid: 0,
                gid: 0,
                rdev: 0,
                data: target.to_vec(),
                children: BTreeMap::new(),
                id: Some(InodeId { root: p.root, ino }),
                xattrs: BTreeMap::new(),
                nocow: false,
            },
        )
    }

    /// Special file `path` (`mode` with its type; `rdev` for devices).
    pub fn w_mknod(&mut self, w: &mut FsWriter, path: &str, mode: u32, rdev: u64) -> usize {
        let p = self.parent_id(path);
        let name = split_path(path).1;
        let ino = w
            .mknod(p.root, p.ino, name.as_bytes(), &InodeAttrs { rdev, ..InodeAttrs::new(mode) })
            .unwrap_or_else(|e| panic!("mknod /{path}: {e}"));
        self.add_child(
            path,
            MInode {
                kind: mode_kind(mode),
                perm: mode & 0o7777,
                uid: 0,
                gid: 0,
                rdev,
                data: Vec::new(),
                children: BTreeMap::new(),
                id: Some(InodeId { root: p.root, ino }),
                xattrs: BTreeMap::new(),
                nocow: false,
            },
        )
    }

    /// Rename `from` to `to` with renameat2 `flags`, in ubtrfs and the model.
    pub fn w_rename(&mut self, w: &mut FsWriter, from: &str, to: &str, flags: u32) {
        let (op, np) = (self.parent_id(from), self.parent_id(to));
        // Two names of one inode: vfs_rename does nothing, and leaves no whiteout.
        let same = self.lookup(to).is_some() && self.lookup(to) == self.lookup(from);
        w.rename(
            op.root,
            op.ino,
            split_path(from).1.as_bytes(),
            np.ino,
            split_path(to).1.as_bytes(),
            flags,
        )
        .unwrap_or_else(|e| panic!("rename /{from} /{to} {flags}: {e}"));
        self.rename(from, to, flags);
        if flags & RENAME_WHITEOUT != 0 && !same {
            let (op, name) = (self.parent_id(from), split_path(from).1);
            let found = w
                .live()
                .lookup(op, name.as_bytes())
                .expect("lookup whiteout")
                .expect("whiteout exists");
            self.add_child(
                from,
                MInode {
                    kind: 'c',
                    perm: 0,
                    uid: 0,
                    gid: 0,
                    rdev: 0,
                    data: Vec::new(),
                    children: BTreeMap::new(),
                    id: Some(found.target),
                    xattrs: BTreeMap::new(),
                    nocow: false,
                },
            );
        }
    }

    /// The model's side of a rename (a whiteout is the caller's to add).
    pub fn rename(&mut self, from: &str, to: &str, flags: u32) {
        let (fp, fname) = split_path(from);
        let (tp, tname) = split_path(to);
        let (fh, th) = (self.handle(fp), self.handle(tp));
        let src = *self.node(fh).children.get(fname.as_bytes()).expect("model: rename source");
        if flags & 2 != 0 {
            let dst =
                *self.node(th).children.get(tname.as_bytes()).expect("model: exchange target");
            self.node_mut(fh).children.insert(fname.as_bytes().to_vec(), dst);
            self.node_mut(th).children.insert(tname.as_bytes().to_vec(), src);
            return;
        }
        if self.node(th).children.get(tname.as_bytes()) == Some(&src) {
            return;
        }
        if self.node(th).children.contains_key(tname.as_bytes()) {
            self.remove_name(to);
        }
        self.node_mut(fh).children.remove(fname.as_bytes());
        self.node_mut(th).children.insert(tname.as_bytes().to_vec(), src);
    }

    /// chmod / chown / truncate of `path` through `setattr`, in ubtrfs and the model.
    pub fn w_setattr(&mut self, w: &mut FsWriter, path: &str, a: &SetAttr) {
        let id = self.id(path);
        w.setattr(id, a).unwrap_or_else(|e| panic!("setattr /{path} {a:?}: {e}"));
        let h = self.handle(path);
        model_setattr(self.node_mut(h), a);
    }

    /// fallocate(2) of file `path`, in ubtrfs and the model.
    pub fn w_fallocate(&mut self, w: &mut FsWriter, path: &str, mode: u32, off: u64, len: u64) {
        let id = self.id(path);
        w.fallocate(id, mode, off, len)
            .unwrap_or_else(|e| panic!("fallocate /{path} mode {mode:#x} [{off}, +{len}): {e}"));
        model_fallocate(&mut self.node_mut(self.handle(path)).data, mode, off, len);
    }

    /// setxattr(2) of `path` (flags XATTR_CREATE / XATTR_REPLACE), in ubtrfs and the
    /// model; the compression property is stored only on files and directories.
    pub fn w_setxattr(
        &mut self,
        w: &mut FsWriter,
        path: &str,
        name: &[u8],
        value: &[u8],
        flags: u32,
    ) {
        let id = self.id(path);
        w.setxattr(id, name, value, flags).unwrap_or_else(|e| {
            panic!(
                "setxattr /{path} {} ({} bytes, flags {flags}): {e}",
                String::from_utf8_lossy(name),
                value.len()
            )
        });
        let n = self.node_mut(self.handle(path));
        model_setxattr(n.kind, &mut n.xattrs, name, value);
    }

    /// removexattr(2) of `path`, in ubtrfs and the model.
    pub fn w_removexattr(&mut self, w: &mut FsWriter, path: &str, name: &[u8]) {
        let id = self.id(path);
        w.removexattr(id, name).unwrap_or_else(|e| {
            panic!("removexattr /{path} {}: {e}", String::from_utf8_lossy(name))
        });
        self.node_mut(self.handle(path)).xattrs.remove(name);
    }

    /// FS_IOC_SETFLAGS of file or directory `path` (see `model_set_fsflags`; `mount_alg`
    /// is the writer's compression algorithm name, for COMPR).
    pub fn w_set_fsflags(&mut self, w: &mut FsWriter, path: &str, fs: u32, mount_alg: &[u8]) {
        let id = self.id(path);
        w.set_fsflags(id, fs).unwrap_or_else(|e| panic!("set_fsflags /{path} {fs:#x}: {e}"));
        let n = self.node_mut(self.handle(path));
        let empty = n.data.is_empty();
        model_set_fsflags(n.kind, empty, &mut n.nocow, &mut n.xattrs, fs, mount_alg);
    }

    // ---- changes through a kernel mount and the model together ----

    pub fn k_mkdir(&mut self, m: &Mount, path: &str) {
        std::fs::create_dir(m.path(path)).unwrap_or_else(|e| panic!("kernel mkdir /{path}: {e}"));
        // The kernel's mode and owner (inode_init_owner: a set-group-ID directory
        // passes on its group, and to directories its set-group-ID bit).
        let md = std::fs::metadata(m.path(path)).expect("stat");
        let (perm, uid, gid) = (md.mode() & 0o7777, md.uid(), md.gid());
        let (xattrs, nocow) = kernel_inherited(m, path);
        self.add_child(
            path,
            MInode {
                kind: 'd',
                perm,
                uid,
                gid,
                rdev: 0,
                data: Vec::new(),
                children: BTreeMap::new(),
                id: None,
                xattrs,
                nocow,
            },
        );
    }

    pub fn k_create(&mut self, m: &Mount, path: &str, data: &[u8]) {
        std::fs::write(m.path(path), data).unwrap_or_else(|e| panic!("kernel write /{path}: {e}"));
        let md = std::fs::metadata(m.path(path)).expect("stat");
        let (perm, uid, gid) = (md.mode() & 0o7777, md.uid(), md.gid());
        let (xattrs, nocow) = kernel_inherited(m, path);
        self.add_child(
            path,
            MInode {
                kind: 'f',
                perm,
                uid,
                gid,
                rdev: 0,
                data: data.to_vec(),
                children: BTreeMap::new(),
                id: None,
                xattrs,
                nocow,
            },
        );
    }

    pub fn k_write(&mut self, m: &Mount, path: &str, off: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(m.path(path))
            .unwrap_or_else(|e| panic!("kernel open /{path}: {e}"));
        f.write_all_at(data, off).unwrap_or_else(|e| panic!("kernel write /{path}: {e}"));
        model_write(&mut self.node_mut(self.handle(path)).data, off, data);
    }

    pub fn k_unlink(&mut self, m: &Mount, path: &str) {
        let h = self.handle(path);
        if self.node(h).kind == 'd' {
            std::fs::remove_dir(m.path(path))
                .unwrap_or_else(|e| panic!("kernel rmdir /{path}: {e}"));
        } else {
            std::fs::remove_file(m.path(path))
                .unwrap_or_else(|e| panic!("kernel unlink /{path}: {e}"));
        }
        self.remove_name(path);
    }

    pub fn k_link(&mut self, m: &Mount, existing: &str, path: &str) {
        std::fs::hard_link(m.path(existing), m.path(path))
            .unwrap_or_else(|e| panic!("kernel link /{existing} /{path}: {e}"));
        let h = self.handle(existing);
        let (parent, name) = split_path(path);
        let ph = self.handle(parent);
        self.node_mut(ph).children.insert(name.as_bytes().to_vec(), h);
    }
}

/// What the kernel gave a file or directory it just made at `path`: its xattrs and
/// NOCOW flag, read back rather than predicted. Whether a new inode inherits its
/// directory's compression property depends on the kernel having loaded that
/// directory's properties, and `btrfs_read_locked_inode` loads them only from xattr
/// items in the inode item's own leaf (`acls_after_inode_item` stops at the end of the
/// leaf, and then `btrfs_load_inode_props` is not called). Seed 27 of `model_soak` met
/// a directory, made by ubtrfs with the property and read back by ubtrfs and the
/// kernel's listxattr alike, whose new subdirectory the kernel made without it: its
/// INODE_ITEM was the last item of its leaf, its INODE_REF and XATTR_ITEM in the next.
/// ubtrfs honours the property wherever its item is.
fn kernel_inherited(m: &Mount, path: &str) -> (BTreeMap<Vec<u8>, Vec<u8>>, bool) {
    let p = m.path(path);
    (kernel_xattrs(&p), kernel_fsflags(&p) & fsflags::NOCOW != 0)
}

/// Apply a write to model contents (zero-filling any gap).
pub fn model_write(buf: &mut Vec<u8>, off: u64, data: &[u8]) {
    let end = off as usize + data.len();
    if buf.len() < end {
        buf.resize(end, 0);
    }
    buf[off as usize..end].copy_from_slice(data);
}

/// The per-inode compression property (`btrfs property set ... compression`).
pub const COMPRESSION_PROP: &[u8] = b"btrfs.compression";

/// The value a new inode inherits from a directory whose compression property is `v`:
/// the algorithm without a level, nothing for "no" / "none".
pub fn inherited_compression(v: &[u8]) -> Option<&'static [u8]> {
    [b"zlib".as_slice(), b"lzo", b"zstd"].into_iter().find(|a| v.starts_with(a))
}

/// The algorithm name `chattr +c` gives the compression property: the writer's
/// compression, zlib without one.
pub fn mount_alg_name(w: &FsWriter) -> &'static [u8] {
    use ubtrfs_core::compression::CompressionType;
    match w.compress_policy().alg {
        Some(CompressionType::Lzo) => b"lzo",
        Some(CompressionType::Zstd) => b"zstd",
        _ => b"zlib",
    }
}

/// `setattr` on a model inode: the mode's permission bits, the owner, then chown's
/// clearing of set-user-ID (and set-group-ID with group execute) on anything but a
/// directory, and a new size (cut, or zero-extended).
pub fn model_setattr(n: &mut MInode, a: &SetAttr) {
    if let Some(m) = a.mode {
        n.perm = m & 0o7777;
    }
    if let Some(u) = a.uid {
        n.uid = u;
    }
    if let Some(g) = a.gid {
        n.gid = g;
    }
    if (a.uid.is_some() || a.gid.is_some()) && n.kind != 'd' {
        n.perm &= !0o4000;
        if n.perm & 0o2010 == 0o2010 {
            n.perm &= !0o2000;
        }
    }
    if let Some(size) = a.size {
        n.data.resize(size as usize, 0);
    }
}

/// fallocate(2) on file contents: PUNCH_HOLE and ZERO_RANGE zero the range inside the
/// file; without KEEP_SIZE the file grows to the range's end (zeros).
pub fn model_fallocate(buf: &mut Vec<u8>, mode: u32, off: u64, len: u64) {
    let (off, end) = (off as usize, (off + len) as usize);
    if mode & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE) != 0 {
        let zend = end.min(buf.len());
        if off < zend {
            buf[off..zend].fill(0);
        }
    }
    if mode & FALLOC_FL_KEEP_SIZE == 0 && buf.len() < end {
        buf.resize(end, 0);
    }
}

/// setxattr(2) on a model inode of kind `kind`: an empty compression property removes
/// it, and only files and directories keep one.
pub fn model_setxattr(kind: char, x: &mut BTreeMap<Vec<u8>, Vec<u8>>, name: &[u8], value: &[u8]) {
    if name == COMPRESSION_PROP && (value.is_empty() || !matches!(kind, 'f' | 'd')) {
        if value.is_empty() {
            x.remove(name);
        }
        return;
    }
    x.insert(name.to_vec(), value.to_vec());
}

/// FS_IOC_SETFLAGS on a model file or directory, as `set_fsflags` does it: NOCOW is set
/// or cleared on a directory or an empty file (a non-empty file keeps its state); COMPR
/// sets the compression property to `mount_alg`, NOCOMP and neither remove it.
pub fn model_set_fsflags(
    kind: char,
    empty: bool,
    nocow: &mut bool,
    x: &mut BTreeMap<Vec<u8>, Vec<u8>>,
    fs: u32,
    mount_alg: &[u8],
) {
    if kind == 'd' || (kind == 'f' && empty) {
        *nocow = fs & fsflags::NOCOW != 0;
    }
    if fs & fsflags::COMPR != 0 && fs & fsflags::NOCOMP == 0 {
        x.insert(COMPRESSION_PROP.to_vec(), mount_alg.to_vec());
    } else {
        x.remove(COMPRESSION_PROP);
    }
}

/// What a refused call must leave alone, per inode: the item's bytes, xattrs, extents
/// and directory entries (None: no such inode).
type InodeState = Option<(Vec<u8>, Vec<(Vec<u8>, Vec<u8>)>, Vec<FileExtentRec>, Vec<DirEntry>)>;

fn inode_states(w: &FsWriter, ids: &[InodeId]) -> ubtrfs_core::Result<Vec<InodeState>> {
    use zerocopy::IntoBytes;
    let mut out = Vec::new();
    for &id in ids {
        out.push(match w.live().load_inode(id, Load::ALL) {
            Ok(v) => Some((v.item.as_bytes().to_vec(), v.xattrs, v.extents, v.entries)),
            Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => None,
            Err(e) => return Err(e),
        });
    }
    Ok(out)
}

/// Run `f`, which must fail with `want`, and check that it changed nothing: the inodes
/// `ids` (the parents, source and target of the call) are as they were and the writer
/// is not aborted. Panics on a wrong outcome.
pub fn expect_refused(
    w: &mut FsWriter,
    what: &str,
    want: PosixKind,
    ids: &[InodeId],
    f: impl FnOnce(&mut FsWriter) -> ubtrfs_core::Result<()>,
) {
    check_refused(w, what, want, ids, f).unwrap_or_else(|e| panic!("{what}: {e}"));
}

/// `expect_refused`, except that an error without a POSIX kind (the device's, a
/// corrupt block) is returned, for a caller whose device may fail.
pub fn check_refused(
    w: &mut FsWriter,
    what: &str,
    want: PosixKind,
    ids: &[InodeId],
    f: impl FnOnce(&mut FsWriter) -> ubtrfs_core::Result<()>,
) -> ubtrfs_core::Result<()> {
    let before = inode_states(w, ids)?;
    match f(w) {
        Ok(()) => panic!("{what}: succeeded; the model expects {want:?}"),
        Err(e) if e.posix_kind() == Some(want) => {}
        Err(e) if e.posix_kind().is_none() => return Err(e),
        Err(e) => panic!("{what}: expected {want:?}, failed with another error: {e}"),
    }
    if let Err(e) = w.check_writable() {
        panic!("{what}: the refused call left the writer aborted: {e}");
    }
    let after = inode_states(w, ids)?;
    for ((id, b), a) in ids.iter().zip(&before).zip(&after) {
        let part = match (b, a) {
            (None, None) => continue,
            (Some(b), Some(a)) if b == a => continue,
            (Some(b), Some(a)) if b.0 != a.0 => "inode item",
            (Some(b), Some(a)) if b.1 != a.1 => "xattrs",
            (Some(b), Some(a)) if b.2 != a.2 => "file extents",
            (Some(_), Some(_)) => "directory entries",
            (Some(_), None) => "existence (it is gone)",
            (None, Some(_)) => "existence (it appeared)",
        };
        panic!("{what}: the refused call changed the {part} of {id}");
    }
    Ok(())
}

/// What `Tree` leaves out, per path: the xattrs, and NODATACOW of files and directories.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XMeta {
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    pub nocow: bool,
}

pub type MetaTree = BTreeMap<String, XMeta>;

impl Model {
    /// The xattrs and NOCOW flags the walks must see.
    pub fn expect_meta(&self) -> MetaTree {
        self.paths()
            .into_iter()
            .map(|(p, h)| {
                (p, XMeta { xattrs: self.node(h).xattrs.clone(), nocow: self.node(h).nocow })
            })
            .collect()
    }
}

/// Every path's xattrs and NOCOW flag as ubtrfs's reader sees `img`.
pub fn meta_ubtrfs(img: &Path) -> MetaTree {
    let fs = Filesystem::open(&OpenOptions::new(img))
        .unwrap_or_else(|e| panic!("{}: Filesystem::open: {e}", img.display()));
    let mut out = MetaTree::new();
    let mut stack = vec![(String::new(), fs.root_dir())];
    while let Some((path, id)) = stack.pop() {
        let v = fs
            .load_inode(id, Load { xattrs: true, entries: true, extents: false })
            .unwrap_or_else(|e| panic!("ubtrfs meta walk: /{path}: {e}"));
        let nocow =
            matches!(v.kind(), FileKind::File | FileKind::Dir) && v.flags() & INODE_NODATACOW != 0;
        out.insert(path.clone(), XMeta { xattrs: v.xattrs.iter().cloned().collect(), nocow });
        for e in &v.entries {
            stack.push((join(&path, &String::from_utf8_lossy(&e.name)), e.target));
        }
    }
    out
}

/// The xattrs of `p` (symlinks not followed) as the kernel lists them.
pub fn kernel_xattrs(p: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    try_kernel_xattrs(p).unwrap_or_else(|e| panic!("xattrs of {}: {e}", p.display()))
}

/// `kernel_xattrs`, with the errors.
pub fn try_kernel_xattrs(p: &Path) -> std::io::Result<BTreeMap<Vec<u8>, Vec<u8>>> {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut names = vec![0u8; 65536];
    // SAFETY: the buffer is valid for its length; the path is NUL-terminated.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = BTreeMap::new();
    let mut value = vec![0u8; 65536];
    for name in names[..n as usize].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cn = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
        // SAFETY: as above.
        let m = unsafe {
            libc::lgetxattr(c.as_ptr(), cn.as_ptr(), value.as_mut_ptr().cast(), value.len())
        };
        if m < 0 {
            return Err(std::io::Error::last_os_error());
        }
        out.insert(name.to_vec(), value[..m as usize].to_vec());
    }
    Ok(out)
}

/// FS_IOC_GETFLAGS of the regular file or directory `p` under a kernel mount.
pub fn kernel_fsflags(p: &Path) -> u32 {
    try_kernel_fsflags(p).unwrap_or_else(|e| panic!("FS_IOC_GETFLAGS {}: {e}", p.display()))
}

/// `kernel_fsflags`, with the errors.
pub fn try_kernel_fsflags(p: &Path) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(p)?;
    let mut flags: libc::c_int = 0;
    // SAFETY: FS_IOC_GETFLAGS writes one int to the pointer.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(flags as u32)
}

/// Every path's xattrs and NOCOW flag under a kernel mount (symlinks not followed).
pub fn meta_kernel(root: &Path) -> MetaTree {
    let mut out = MetaTree::new();
    let mut stack = vec![(String::new(), root.to_path_buf())];
    while let Some((path, p)) = stack.pop() {
        let ft = std::fs::symlink_metadata(&p)
            .unwrap_or_else(|e| panic!("kernel meta walk: stat {}: {e}", p.display()))
            .file_type();
        let nocow = (ft.is_file() || ft.is_dir()) && kernel_fsflags(&p) & fsflags::NOCOW != 0;
        out.insert(path.clone(), XMeta { xattrs: kernel_xattrs(&p), nocow });
        if ft.is_dir() {
            for e in std::fs::read_dir(&p)
                .unwrap_or_else(|e| panic!("kernel meta walk: readdir {}: {e}", p.display()))
            {
                let n = e.expect("dir entry").file_name();
                stack.push((join(&path, &String::from_utf8_lossy(n.as_bytes())), p.join(&n)));
            }
        }
    }
    out
}

/// Differences between two meta walks, at most `max` lines.
pub fn diff_meta(expected: &MetaTree, actual: &MetaTree, max: usize) -> Vec<String> {
    let show = |x: &BTreeMap<Vec<u8>, Vec<u8>>| {
        x.iter()
            .map(|(n, v)| {
                format!(
                    "{}={}",
                    String::from_utf8_lossy(n),
                    if v.len() <= 16 {
                        String::from_utf8_lossy(v).into_owned()
                    } else {
                        format!("<{} bytes {}>", v.len(), &hex(&Sha256::digest(v))[..12])
                    }
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut d = Vec::new();
    for (p, e) in expected {
        match actual.get(p) {
            None => d.push(format!("missing /{p}")),
            Some(a) if a.nocow != e.nocow => {
                d.push(format!("/{p}: NOCOW expected {}, found {}", e.nocow, a.nocow))
            }
            Some(a) if a.xattrs != e.xattrs => d.push(format!(
                "/{p}: xattrs differ:\n    expected {{{}}}\n    actual   {{{}}}",
                show(&e.xattrs),
                show(&a.xattrs)
            )),
            _ => {}
        }
    }
    d.extend(
        actual.keys().filter(|p| !expected.contains_key(*p)).map(|p| format!("unexpected /{p}")),
    );
    let n = d.len();
    d.truncate(max);
    if n > max {
        d.push(format!("... and {} more", n - max));
    }
    d
}

/// ubtrfs's reader shows the model's xattrs and NOCOW flags in `img`.
pub fn verify_meta_ubtrfs(img: &Path, m: &Model, what: &str) {
    let d = diff_meta(&m.expect_meta(), &meta_ubtrfs(img), 20);
    assert!(
        d.is_empty(),
        "{what}: ubtrfs reader vs model (xattrs, NOCOW): {} differences:\n{}",
        d.len(),
        d.join("\n")
    );
}

/// One read-only kernel mount of `img`: the tree and the xattrs and NOCOW flags are
/// the model's.
pub fn verify_kernel_with_meta(img: &Path, m: &Model, what: &str) {
    let mnt = Mount::new(img, false);
    let got = walk_kernel(&mnt.dir);
    let meta = meta_kernel(&mnt.dir);
    mnt.umount();
    assert_same(&m.expect(), &got, &format!("{what}: kernel mount vs model"));
    let d = diff_meta(&m.expect_meta(), &meta, 20);
    assert!(
        d.is_empty(),
        "{what}: kernel mount vs model (xattrs, NOCOW): {} differences:\n{}",
        d.len(),
        d.join("\n")
    );
}

/// The trees a data write touches, checked with `FsWriter::check_invariants`.
pub const GLOBAL_TREES: [u64; 5] = [
    ROOT_TREE_OBJECTID,
    EXTENT_TREE_OBJECTID,
    CSUM_TREE_OBJECTID,
    FREE_SPACE_TREE_OBJECTID,
    DEV_TREE_OBJECTID,
];

/// `check_invariants` on the global trees and on `fs_trees`.
pub fn check_trees(w: &mut FsWriter, fs_trees: &[u64], what: &str) {
    for &t in GLOBAL_TREES.iter().chain(fs_trees) {
        w.check_invariants(t).unwrap_or_else(|e| panic!("{what}: tree {t} invariants: {e}"));
    }
    w.check_invariants(CHUNK_TREE_OBJECTID)
        .unwrap_or_else(|e| panic!("{what}: chunk tree invariants: {e}"));
}

/// `ubtrfs check` finds nothing, and ubtrfs's view of `img` matches the model.
pub fn verify_ubtrfs(img: &Path, m: &Model, what: &str) {
    let fs = Filesystem::open(&OpenOptions::new(img))
        .unwrap_or_else(|e| panic!("{what}: open for check: {e}"));
    let rep = ubtrfs_tools::check::check(&fs.info, &ubtrfs_tools::check::CheckOptions::default())
        .unwrap_or_else(|e| panic!("{what}: ubtrfs check: {e}"));
    let problems: Vec<String> = rep.findings.iter().take(10).map(|f| f.to_string()).collect();
    assert!(
        rep.is_clean(),
        "{what}: ubtrfs check found {} problems:\n{}",
        rep.problems(),
        problems.join("\n")
    );
    drop(fs);
    assert_same(&m.expect(), &walk_ubtrfs(img), &format!("{what}: ubtrfs reader vs model"));
}

/// Mount `img` read-only and compare the kernel's view with the model.
pub fn verify_kernel(img: &Path, m: &Model, what: &str) {
    let mnt = Mount::new(img, false);
    let got = walk_kernel(&mnt.dir);
    mnt.umount();
    assert_same(&m.expect(), &got, &format!("{what}: kernel mount vs model"));
}

/// btrfs check, kernel walk and ubtrfs walk; `kernel` says root is available.
pub fn verify_all(img: &Path, m: &Model, kernel: bool, what: &str) {
    if kernel {
        assert_check(img, what);
        verify_kernel(img, m, what);
    }
    verify_ubtrfs(img, m, what);
}

/// (referenced, exclusive) of every qgroup as the QGROUP_INFO items store them.
pub fn qgroup_counts(w: &mut FsWriter) -> BTreeMap<u64, (u64, u64)> {
    use zerocopy::FromBytes;
    let from = ubtrfs_format::Key::new(0, QGROUP_INFO_KEY, 0);
    let to = ubtrfs_format::Key::new(0, QGROUP_INFO_KEY, u64::MAX);
    w.items_in_range(QUOTA_TREE_OBJECTID, &from, &to)
        .expect("quota tree")
        .into_iter()
        .map(|(k, d)| {
            let i = QgroupInfoItem::read_from_bytes(&d).expect("qgroup info");
            (k.offset, (i.rfer.get(), i.excl.get()))
        })
        .collect()
}
