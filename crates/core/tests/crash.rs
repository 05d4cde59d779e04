//! Crash consistency of the write engine, driven through `fault::FaultyDevice`.
//!
//! A seeded random workload runs once on a copy of a kernel-made fixture while the
//! device records every write and flush, with a commit every few operations: mkdir,
//! file creates with data of random sizes, bursts of small files, overwrites, hard
//! links, unlinks and emptying of directories, on new and on kernel-made files; and
//! rename with its flags (onto existing names, RENAME_NOREPLACE, RENAME_EXCHANGE,
//! RENAME_WHITEOUT, whole subtrees moving), truncate down and up, fallocate (mode 0,
//! KEEP_SIZE, PUNCH_HOLE, ZERO_RANGE), chmod and chown, xattrs (XATTR_CREATE,
//! XATTR_REPLACE, removal), symlinks, device nodes, fifos and sockets, NODATACOW files
//! (`chattr +C` on a new file, then written), inode flags, the compression property
//! (inherited by new entries of a directory), and compression on write (the seed picks
//! the writer's algorithm). Calls the model says must fail (a directory renamed under
//! itself, NOREPLACE onto a name, XATTR_CREATE of an existing name, ...) must fail with
//! the kernel's errno and change nothing. The run keeps an in-memory model of the whole
//! tree after every commit. Then, for every write and
//! flush point `k` of the run (or a seeded sample), the image a power loss at `k`
//! leaves (`CrashSweep`: unflushed writes dropped or kept, reordered, one possibly
//! torn) is reopened with the read engine and must show exactly the state of the last
//! commit whose superblock write and flush completed before `k` (when `k` falls inside
//! a commit's superblock writes, that commit's state or the previous one). The whole
//! tree is compared (paths, kinds, inode numbers, sizes, contents, symlink targets,
//! directory sizes, link counts, DIR_ITEM against DIR_INDEX, and per inode the mode,
//! owner, device numbers, NODATACOW flag and xattrs); a NODATACOW file's contents are
//! compared by size only, since its data may be overwritten in place and torn by the
//! crash (preallocated ranges are compared: the committed state reads them as zeros).
//! The image must pass `ubtrfs_tools::check::check`; a sample must pass `btrfs check
//! --readonly` and, loop mounted read-only, show the kernel the same tree, metadata
//! included (as root);
//! and on a sample the post-crash image is reopened for writing, written to,
//! committed and verified again (recovery), then crashed again during that recovery.
//!
//! Besides the sweep, the run's log is checked directly for the two ordering rules a
//! commit relies on: no superblock write while a tree-block or data write is unflushed,
//! and no write between two commits into space the last commit references (other than
//! its preallocated extents and the extents of NODATACOW files, which writes may fill
//! in place as the kernel's NOCOW writes do).
//!
//! Other tests: live crashes (the writer meets the dead device), failing flushes and
//! writes with the device alive (commit errors, abort, read-only errors naming the
//! cause, disk unchanged), bit flips on reads, superblocks torn at 512 bytes.
//!
//! Environment:
//! - `UBTRFS_CRASH_SEEDS`: run `crash_sweep_env` on these seeds (`N` = seeds 0..N,
//!   `A-B` = A..B, or a comma list); every crash point of every seed is tested.
//! - `UBTRFS_CRASH_OPS`: workload length for that run (default 40).
//! - `UBTRFS_CRASH_UNIT`: torn-write granularity for that run (default 4096).
//! - `UBTRFS_CRASH_RECORD_ONLY`: only record those seeds and print what they did.
//! - `UBTRFS_CRASH_KEEP`: keep the images of failing points in the temp dir.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use ubtrfs_core::compression::CompressPolicy;
use ubtrfs_core::data::falloc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
use ubtrfs_core::inode::attr::{fsflags, SetAttr};
use ubtrfs_core::inode::filesystem::{ExtentKind, FileKind, Filesystem, InodeId, Load};
use ubtrfs_core::inode::namespace::{
    max_symlink_len, RENAME_EXCHANGE, RENAME_NOREPLACE, RENAME_WHITEOUT,
};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::inode::xattr::{XATTR_CREATE, XATTR_REPLACE};
use ubtrfs_core::volumes::device::{BlockDevice, MemDevice};
use ubtrfs_core::volumes::fault::{
    mix_seed, CrashSweep, FaultyDevice, OpKind, OpOutcome, OpRecord, Rng,
};
use ubtrfs_core::FileRead;
use ubtrfs_core::FsRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::TreeView;
use ubtrfs_core::{Error, FsInfo, PosixKind};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use ubtrfs_tools::check::{check, CheckOptions};
use write_common::{
    check_refused, inherited_compression, model_fallocate, model_set_fsflags, model_setxattr,
    try_kernel_fsflags, try_kernel_xattrs, COMPRESSION_PROP,
};

/// Single device, SINGLE data and DUP metadata, skinny metadata, free-space tree: a
/// layout `FsWriter` accepts (`mixed` is refused: mixed block groups).
const FIXTURE: &str = "blake2";
const FS_TREE: u64 = FS_TREE_OBJECTID;
const CACHE: usize = 16 << 20;

// ---------------------------------------------------------------------------------
// Fixture and devices

fn base_image() -> Arc<Vec<u8>> {
    static BASE: OnceLock<Arc<Vec<u8>>> = OnceLock::new();
    BASE.get_or_init(|| {
        Arc::new(std::fs::read(&common::fixture_images(FIXTURE)[0]).expect("read fixture image"))
    })
    .clone()
}

fn open_info(dev: Arc<dyn BlockDevice>) -> ubtrfs_core::Result<FsInfo> {
    FsInfo::open_devices(vec![dev], CACHE)
}

fn open_writer(dev: Arc<dyn BlockDevice>) -> ubtrfs_core::Result<FsWriter> {
    FsWriter::from_info(open_info(dev)?)
}

/// Run `f` on a read engine over `img`, then give the image back.
fn with_image<T>(
    img: Vec<u8>,
    f: impl FnOnce(ubtrfs_core::Result<Filesystem>) -> T,
) -> (T, Vec<u8>) {
    let dev = Arc::new(MemDevice::new(img, "crash-image"));
    let r = f(open_info(dev.clone()).and_then(Filesystem::from_info));
    let img = Arc::try_unwrap(dev).ok().expect("the filesystem was dropped").into_inner();
    (r, img)
}

fn is_super_write(r: &OpRecord) -> bool {
    match r.kind {
        OpKind::Write { offset, len } => {
            len == SUPER_INFO_SIZE as u64 && (0..SUPER_MIRROR_MAX).any(|m| sb_offset(m) == offset)
        }
        OpKind::Flush => false,
    }
}

// ---------------------------------------------------------------------------------
// The model: what the tree must look like

#[derive(Clone, Debug, PartialEq, Eq)]
enum Node {
    Dir { root: u64, ino: u64 },
    File { root: u64, ino: u64 },
    Symlink { ino: u64, target: Vec<u8> },
    Special { ino: u64, kind: FileKind },
}

impl Node {
    /// (root, ino); symlinks and special files are in the top subvolume (the fixture
    /// has no other, and the workload makes none).
    fn id(&self) -> (u64, u64) {
        match *self {
            Node::Dir { root, ino } | Node::File { root, ino } => (root, ino),
            Node::Symlink { ino, .. } | Node::Special { ino, .. } => (FS_TREE, ino),
        }
    }
    fn is_dir(&self) -> bool {
        matches!(self, Node::Dir { .. })
    }
}

/// What an inode has besides its names and contents.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Meta {
    /// The whole mode: type and permission bits.
    mode: u32,
    uid: u32,
    gid: u32,
    /// (major, minor) of a device, (0, 0) for anything else.
    rdev: (u32, u32),
    /// The NODATACOW flag of a file or directory. A NODATACOW file's data is written in
    /// place, so after a crash it may be torn: its contents are compared by size only.
    nocow: bool,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// Paths (bytes, `/`-joined, "" for the top), file contents and inode metadata by
/// (root, ino).
#[derive(Clone, Default, PartialEq, Eq)]
struct Model {
    entries: BTreeMap<Vec<u8>, Node>,
    files: BTreeMap<(u64, u64), Arc<Vec<u8>>>,
    meta: BTreeMap<(u64, u64), Meta>,
}

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    if dir.is_empty() {
        name.to_vec()
    } else {
        [dir, b"/", name].concat()
    }
}

fn split_parent(path: &[u8]) -> (&[u8], &[u8]) {
    match path.iter().rposition(|&b| b == b'/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => (&[], path),
    }
}

fn show(p: &[u8]) -> String {
    format!("/{}", String::from_utf8_lossy(p))
}

impl Model {
    fn dirs(&self) -> Vec<(Vec<u8>, u64)> {
        self.entries
            .iter()
            .filter_map(|(p, n)| match n {
                Node::Dir { root: FS_TREE, ino } => Some((p.clone(), *ino)),
                _ => None,
            })
            .collect()
    }
    fn children(&self, dir: &[u8]) -> usize {
        self.entries.keys().filter(|p| !p.is_empty() && split_parent(p).0 == dir).count()
    }
    fn dir_ino(&self, dir: &[u8]) -> u64 {
        match self.entries.get(dir) {
            Some(Node::Dir { ino, .. }) => *ino,
            n => panic!("model: {} is not a directory: {n:?}", show(dir)),
        }
    }

    /// Every difference between `self` (expected) and `got`, at most `max`: names and
    /// kinds, contents (a NODATACOW file's by size only), and each inode's metadata.
    fn diff(&self, got: &Model, max: usize) -> Vec<String> {
        let mut out = Vec::new();
        let keys: BTreeSet<&Vec<u8>> = self.entries.keys().chain(got.entries.keys()).collect();
        let mut seen: BTreeSet<(u64, u64)> = BTreeSet::new();
        for p in keys {
            if out.len() >= max {
                out.push("...".into());
                break;
            }
            match (self.entries.get(p), got.entries.get(p)) {
                (Some(e), None) => out.push(format!("{} missing (expected {e:?})", show(p))),
                (None, Some(g)) => out.push(format!("{} unexpected ({g:?})", show(p))),
                (Some(e), Some(g)) if e != g => {
                    out.push(format!("{}: expected {e:?}, found {g:?}", show(p)))
                }
                (Some(e), Some(_)) => {
                    let id = e.id();
                    if !seen.insert(id) {
                        continue;
                    }
                    let (em, gm) = (self.meta.get(&id), got.meta.get(&id));
                    if em != gm {
                        out.push(format!(
                            "{}: metadata differs:\n      expected {}\n      found    {}",
                            show(p),
                            show_meta(em),
                            show_meta(gm)
                        ));
                        continue;
                    }
                    if let Node::File { .. } = e {
                        let (a, b) = (&self.files[&id], &got.files[&id]);
                        let nocow = em.is_some_and(|m| m.nocow);
                        if a.len() != b.len() || (!nocow && a != b) {
                            let first = a
                                .iter()
                                .zip(b.iter())
                                .position(|(x, y)| x != y)
                                .unwrap_or(a.len().min(b.len()));
                            out.push(format!("{}: content differs: expected {} bytes, found {}; first difference at byte {first}", show(p), a.len(), b.len()));
                        }
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// Meta of a new file or directory in `parent`, with `mode`: what it inherits
    /// (`btrfs_inherit_iflags`, `btrfs_inode_inherit_props`): NODATACOW, and unless it
    /// is NODATACOW the directory's compression algorithm.
    fn new_meta(&self, parent: &[u8], mode: u32) -> Meta {
        let pm = &self.meta[&self.entries[parent].id()];
        let mut xattrs = BTreeMap::new();
        if let Some(alg) = pm
            .xattrs
            .get(COMPRESSION_PROP)
            .and_then(|v| inherited_compression(v))
            .filter(|_| !pm.nocow)
        {
            xattrs.insert(COMPRESSION_PROP.to_vec(), alg.to_vec());
        }
        Meta { mode, nocow: pm.nocow, xattrs, ..Meta::default() }
    }

    fn meta_of(&mut self, path: &[u8]) -> &mut Meta {
        let id = self.entries[path].id();
        self.meta.get_mut(&id).expect("every inode with a name has its meta")
    }
}

fn show_meta(m: Option<&Meta>) -> String {
    let Some(m) = m else { return "nothing".into() };
    let x: Vec<String> = m
        .xattrs
        .iter()
        .map(|(n, v)| format!("{}=<{} bytes>", String::from_utf8_lossy(n), v.len()))
        .collect();
    format!(
        "mode {:o} uid {} gid {} rdev {:?} nocow {} xattrs {{{}}}",
        m.mode,
        m.uid,
        m.gid,
        m.rdev,
        m.nocow,
        x.join(", ")
    )
}

fn meta_of_view(iv: &ubtrfs_core::inode::filesystem::InodeView) -> Meta {
    let rdev = if matches!(iv.kind(), FileKind::CharDev | FileKind::BlockDev) {
        rdev_decode(iv.item.rdev.get())
    } else {
        (0, 0)
    };
    let nocow =
        matches!(iv.kind(), FileKind::File | FileKind::Dir) && iv.flags() & INODE_NODATACOW != 0;
    Meta {
        mode: iv.mode(),
        uid: iv.item.uid.get(),
        gid: iv.item.gid.get(),
        rdev,
        nocow,
        xattrs: iv.xattrs.iter().cloned().collect(),
    }
}

/// Read the whole tree through the read engine, checking as it goes that the image
/// agrees with itself (DIR_ITEM vs DIR_INDEX, directory sizes, link counts, file sizes).
fn walk(fs: &Filesystem) -> Result<Model, String> {
    let e = |what: String| move |err: Error| format!("{what}: {err}");
    let mut m = Model::default();
    let top = fs.root_dir();
    m.entries.insert(Vec::new(), Node::Dir { root: top.root, ino: top.ino });
    let tv = fs.load_inode(top, Load { xattrs: true, ..Load::ITEM }).map_err(e("/ stat".into()))?;
    m.meta.insert((top.root, top.ino), meta_of_view(&tv));
    let mut stack: Vec<(Vec<u8>, InodeId)> = vec![(Vec::new(), top)];
    let mut nlinks: BTreeMap<(u64, u64), (u32, u32)> = BTreeMap::new();
    let mut visited = 0usize;
    while let Some((path, dir)) = stack.pop() {
        visited += 1;
        if visited > 100_000 {
            return Err("walk: more than 100000 directories (a cycle?)".into());
        }
        let dv = fs.load_inode(dir, Load::ITEM).map_err(e(format!("{} stat", show(&path))))?;
        let entries = fs.readdir(dir).map_err(e(format!("{} readdir", show(&path))))?;
        let mut name_bytes = 0u64;
        for de in entries {
            name_bytes += 2 * de.name.len() as u64;
            let p = join(&path, &de.name);
            match fs.lookup(dir, &de.name).map_err(e(format!("{} lookup", show(&p))))? {
                Some(l) if l.target == de.target => {}
                other => {
                    return Err(format!(
                        "{}: DIR_INDEX says {:?}, DIR_ITEM lookup says {:?}",
                        show(&p),
                        de.target,
                        other.map(|l| l.target)
                    ))
                }
            }
            let iv = fs
                .load_inode(de.target, Load { extents: true, xattrs: true, ..Load::ITEM })
                .map_err(e(format!("{} stat", show(&p))))?;
            let want_ft = match iv.kind() {
                FileKind::File => FT_REG_FILE,
                FileKind::Dir => FT_DIR,
                FileKind::Symlink => FT_SYMLINK,
                FileKind::Fifo => FT_FIFO,
                FileKind::CharDev => FT_CHRDEV,
                FileKind::BlockDev => FT_BLKDEV,
                FileKind::Socket => FT_SOCK,
            };
            if de.ftype != want_ft {
                return Err(format!(
                    "{}: dir entry type {} but inode mode {:o}",
                    show(&p),
                    de.ftype,
                    iv.mode()
                ));
            }
            let id = de.target;
            m.meta.entry((id.root, id.ino)).or_insert_with(|| meta_of_view(&iv));
            let node = match iv.kind() {
                FileKind::Dir => {
                    stack.push((p.clone(), id));
                    Node::Dir { root: id.root, ino: id.ino }
                }
                FileKind::File => {
                    let n = nlinks.entry((id.root, id.ino)).or_insert((iv.nlink(), 0));
                    n.1 += 1;
                    if let std::collections::btree_map::Entry::Vacant(slot) =
                        m.files.entry((id.root, id.ino))
                    {
                        let size = usize::try_from(iv.size())
                            .map_err(|_| format!("{}: size {}", show(&p), iv.size()))?;
                        if size > 256 << 20 {
                            return Err(format!("{}: implausible size {size}", show(&p)));
                        }
                        let mut buf = vec![0u8; size];
                        let got = fs
                            .read_at(&iv, 0, &mut buf)
                            .map_err(e(format!("{} read", show(&p))))?;
                        if got != size {
                            return Err(format!("{}: read {got} of {size} bytes", show(&p)));
                        }
                        slot.insert(Arc::new(buf));
                    }
                    Node::File { root: id.root, ino: id.ino }
                }
                FileKind::Symlink => Node::Symlink {
                    ino: id.ino,
                    target: fs.readlink(id).map_err(e(format!("{} readlink", show(&p))))?,
                },
                k => Node::Special { ino: id.ino, kind: k },
            };
            m.entries.insert(p, node);
        }
        if dv.size() != name_bytes {
            return Err(format!(
                "{}: directory size {} but its entries' names sum to {name_bytes} (x2)",
                show(&path),
                dv.size()
            ));
        }
    }
    for ((root, ino), (nlink, seen)) in nlinks {
        if nlink != seen {
            return Err(format!("root={root} ino={ino}: nlink {nlink} but {seen} names"));
        }
    }
    Ok(m)
}

/// The fixture's tree as the read engine sees it (checked against the kernel's view by
/// the fixture tests), the starting point of every model.
fn base_model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| {
        let (m, _) = with_image(base_image().to_vec(), |fs| {
            walk(&fs.expect("open fixture")).expect("walk fixture")
        });
        Arc::new(m)
    })
    .clone()
}

// ---------------------------------------------------------------------------------
// The workload

/// How a seed's workload leans (chosen from the seed, so each seed is one flavour).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavour {
    /// The default mix.
    Plain,
    /// Files of up to 12 MiB: data chunks fill up and new ones are allocated.
    Heavy,
    /// Free-space-tree conversion thresholds of (2, 4): groups flip between extents and
    /// bitmaps all the time.
    Bitmaps,
}

impl Flavour {
    fn of(seed: u64) -> Flavour {
        match seed % 3 {
            0 => Flavour::Plain,
            1 => Flavour::Bitmaps,
            _ => Flavour::Heavy,
        }
    }
    fn apply(self, w: &mut FsWriter) {
        if self == Flavour::Bitmaps {
            w.hooks.fst_thresholds_override = Some((2, 4));
        }
    }
}

/// The writer's compression for a seed (`compress=`): none for two seeds in five,
/// else zlib, zstd or lzo. Files also get the `btrfs.compression` property now and then.
fn compress_of(seed: u64) -> CompressPolicy {
    let alg = match seed % 5 {
        2 => "zlib",
        3 => "zstd",
        4 => "lzo",
        _ => "none",
    };
    CompressPolicy::parse(alg, false).expect("a known algorithm")
}

/// Random operations applied to a writer and to the model in step.
struct Workload {
    flavour: Flavour,
    compress: CompressPolicy,
    rng: Rng,
    model: Model,
    /// Prefix of new names (distinct between a run and a recovery on top of it).
    prefix: &'static str,
    next_name: u64,
    /// Paths the fixture had (overwrites and unlinks prefer new files).
    fixture_paths: BTreeSet<Vec<u8>>,
}

/// A data size: empty, inline, small, medium, or several MiB (more than one 4 MiB
/// write piece), mostly not sector multiples.
fn pick_size(rng: &mut Rng, flavour: Flavour) -> usize {
    match rng.below(20) {
        0 | 1 => 0,
        2..=7 => rng.range(1, 2048) as usize,
        8..=13 => rng.range(2049, 64 << 10) as usize,
        15..=18 if flavour == Flavour::Heavy => rng.range(4 << 20, 12 << 20) as usize,
        14..=16 => rng.range(64 << 10, 1 << 20) as usize,
        17 | 18 => rng.range(1 << 20, 5 << 20) as usize,
        _ => 4096 * rng.range(1, 64) as usize,
    }
}

fn random_bytes(rng: &mut Rng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    // Mostly random, sometimes a run of one byte (compressible, zero-like).
    if rng.chance(1, 8) {
        let b = rng.below(256) as u8;
        v.fill(b);
    } else {
        rng.fill(&mut v);
    }
    v
}

impl Workload {
    fn new(seed: u64, model: Model, prefix: &'static str) -> Workload {
        let fixture_paths = base_model().entries.keys().cloned().collect();
        Workload {
            flavour: Flavour::of(seed),
            compress: compress_of(seed),
            rng: Rng::new(seed),
            model,
            prefix,
            next_name: 0,
            fixture_paths,
        }
    }

    /// Give a new writer the seed's settings.
    fn setup(&self, w: &mut FsWriter) {
        self.flavour.apply(w);
        w.set_compress(self.compress);
    }

    fn name(&mut self, kind: &str) -> Vec<u8> {
        self.next_name += 1;
        format!("{}{kind}{}", self.prefix, self.next_name).into_bytes()
    }

    fn pick_dir(&mut self) -> (Vec<u8>, u64) {
        let dirs = self.model.dirs();
        dirs[self.rng.below(dirs.len() as u64) as usize].clone()
    }

    /// Files (new ones three times in four when there are some).
    fn pick_file(&mut self) -> Option<(Vec<u8>, u64)> {
        let all: Vec<(Vec<u8>, u64)> = self
            .model
            .entries
            .iter()
            .filter_map(|(p, n)| match n {
                Node::File { root: FS_TREE, ino } => Some((p.clone(), *ino)),
                _ => None,
            })
            .collect();
        let new: Vec<(Vec<u8>, u64)> =
            all.iter().filter(|(p, _)| !self.fixture_paths.contains(p)).cloned().collect();
        let from = if !new.is_empty() && self.rng.chance(3, 4) { new } else { all };
        (!from.is_empty()).then(|| from[self.rng.below(from.len() as u64) as usize].clone())
    }

    /// Do one random operation. Returns a description, or the failing call and error.
    fn step(&mut self, w: &mut FsWriter) -> Result<String, (String, Error)> {
        match self.rng.below(100) {
            63..=68 => self.several(w, 4, Workload::op_rename),
            69..=71 => self.op_truncate(w),
            72..=75 => self.op_fallocate(w),
            76..=79 => self.several(w, 3, Workload::op_setattr),
            80..=84 => self.several(w, 4, Workload::op_xattr),
            85..=88 => self.several(w, 3, Workload::op_symlink_mknod),
            89..=91 => self.op_nocow_file(w),
            92 | 93 => self.op_fsflags(w),
            94 | 95 => self.op_compression_prop(w),
            96..=99 => self.several(w, 3, Workload::op_refused),
            7..=9 => {
                // A burst of small files in one directory: leaves split, the tree grows.
                let (dir, dino) = self.pick_dir();
                let n = self.rng.range(10, 120);
                let what = format!("burst of {n} small files in {}", show(&dir));
                for _ in 0..n {
                    let name = self.name("s");
                    let size = self.rng.range(0, 300) as usize;
                    let data = random_bytes(&mut self.rng, size);
                    let ino = w
                        .create_file(FS_TREE, dino, &name, &InodeAttrs::new(0o600))
                        .map_err(|e| (what.clone(), e))?;
                    let meta = self.model.new_meta(&dir, S_IFREG | 0o600);
                    self.model.meta.insert((FS_TREE, ino), meta);
                    self.model.entries.insert(join(&dir, &name), Node::File { root: FS_TREE, ino });
                    self.model.files.insert((FS_TREE, ino), Arc::new(Vec::new()));
                    w.write_file(FS_TREE, ino, 0, &data).map_err(|e| (what.clone(), e))?;
                    self.model.files.insert((FS_TREE, ino), Arc::new(data));
                }
                Ok(what)
            }
            0..=6 => {
                let (dir, dino) = self.pick_dir();
                let name = self.name("d");
                let what = format!("mkdir {}", show(&join(&dir, &name)));
                let ino = w
                    .mkdir(FS_TREE, dino, &name, &InodeAttrs::new(0o755))
                    .map_err(|e| (what.clone(), e))?;
                let meta = self.model.new_meta(&dir, S_IFDIR | 0o755);
                self.model.meta.insert((FS_TREE, ino), meta);
                self.model.entries.insert(join(&dir, &name), Node::Dir { root: FS_TREE, ino });
                Ok(what)
            }
            10..=33 => {
                let (dir, _) = self.pick_dir();
                let size = pick_size(&mut self.rng, self.flavour);
                let data = random_bytes(&mut self.rng, size);
                let (path, what) = self.create(w, &dir, "f", &format!("size {size}"))?;
                let ino = self.model.entries[&path].id().1;
                w.write_file(FS_TREE, ino, 0, &data).map_err(|e| (what.clone(), e))?;
                self.model.files.insert((FS_TREE, ino), Arc::new(data));
                Ok(what)
            }
            34..=49 => {
                let Some((path, ino)) = self.pick_file() else {
                    return Ok("overwrite: no file".into());
                };
                let size = self.model.files[&(FS_TREE, ino)].len() as u64;
                let off = match self.rng.below(4) {
                    0 => 0,
                    1 => size + self.rng.below(3 * 4096),
                    _ => self.rng.below(size + 1),
                };
                let len = match self.rng.below(4) {
                    0 => self.rng.range(1, 100),
                    1 => self.rng.range(1, 8192),
                    2 => self.rng.range(1, 256 << 10),
                    _ => pick_size(&mut self.rng, self.flavour).max(1) as u64,
                } as usize;
                let data = random_bytes(&mut self.rng, len);
                let what = format!("overwrite {} [{off}, +{len}) of {size}", show(&path));
                w.write_file(FS_TREE, ino, off, &data).map_err(|e| (what.clone(), e))?;
                let f = Arc::make_mut(
                    self.model.files.get_mut(&(FS_TREE, ino)).expect("file in model"),
                );
                let end = off as usize + len;
                if f.len() < end {
                    f.resize(end, 0);
                }
                f[off as usize..end].copy_from_slice(&data);
                Ok(what)
            }
            50..=52 => {
                // Empty a directory of its files and empty subdirectories: leaves
                // merge, the tree shrinks.
                let (dir, dino) = self.pick_dir();
                let victims: Vec<Vec<u8>> = self
                    .model
                    .entries
                    .iter()
                    .filter(|(p, n)| {
                        !p.is_empty()
                            && split_parent(p).0 == dir.as_slice()
                            && !matches!(n, Node::Dir { .. } if self.model.children(p) > 0)
                    })
                    .map(|(p, _)| p.clone())
                    .collect();
                let what = format!("empty {} ({} entries)", show(&dir), victims.len());
                for path in victims {
                    let (_, name) = split_parent(&path);
                    let r = if matches!(self.model.entries.get(&path), Some(Node::Dir { .. })) {
                        w.rmdir(FS_TREE, dino, name)
                    } else {
                        w.unlink(FS_TREE, dino, name)
                    };
                    r.map_err(|e| (format!("{what}: unlink {}", show(&path)), e))?;
                    self.forget(&path);
                }
                Ok(what)
            }
            53..=55 => {
                // A hard link to a file (new or the fixture's) in some directory.
                let Some((path, ino)) = self.pick_file() else { return Ok("link: no file".into()) };
                let (dir, dino) = self.pick_dir();
                let name = self.name("l");
                let what = format!("link {} to {}", show(&join(&dir, &name)), show(&path));
                w.link(FS_TREE, dino, &name, ino, FT_REG_FILE).map_err(|e| (what.clone(), e))?;
                self.model.entries.insert(join(&dir, &name), Node::File { root: FS_TREE, ino });
                Ok(what)
            }
            _ => {
                // A file (or symlink), or an empty directory.
                let cands: Vec<Vec<u8>> = self
                    .model
                    .entries
                    .iter()
                    .filter(|(p, n)| {
                        !p.is_empty()
                            && match n {
                                Node::Dir { root: FS_TREE, .. } => self.model.children(p) == 0,
                                Node::Dir { .. } => false,
                                _ => true,
                            }
                    })
                    .map(|(p, _)| p.clone())
                    .collect();
                let new: Vec<Vec<u8>> =
                    cands.iter().filter(|p| !self.fixture_paths.contains(*p)).cloned().collect();
                let from = if !new.is_empty() && self.rng.chance(3, 4) { new } else { cands };
                if from.is_empty() {
                    return Ok("unlink: nothing".into());
                }
                let path = from[self.rng.below(from.len() as u64) as usize].clone();
                let (dir, name) = split_parent(&path);
                let dino = self.model.dir_ino(dir);
                let what = format!("unlink {}", show(&path));
                let r = if matches!(self.model.entries.get(&path), Some(Node::Dir { .. })) {
                    w.rmdir(FS_TREE, dino, name)
                } else {
                    w.unlink(FS_TREE, dino, name)
                };
                r.map_err(|e| (what.clone(), e))?;
                self.forget(&path);
                Ok(what)
            }
        }
    }

    /// Drop an unlinked path from the model (and the inode, at its last name).
    fn forget(&mut self, path: &[u8]) {
        let node = self.model.entries.remove(path).expect("unlinked path was in the model");
        let id = node.id();
        if !self.model.entries.values().any(|n| n.id() == id) {
            self.model.files.remove(&id);
            self.model.meta.remove(&id);
        }
    }
}

/// Whether directory path `anc` is `dir` or above it.
fn is_ancestor_or_self(anc: &[u8], dir: &[u8]) -> bool {
    anc.is_empty() || dir == anc || (dir.starts_with(anc) && dir.get(anc.len()) == Some(&b'/'))
}

type StepResult = Result<String, (String, Error)>;

/// The POSIX operations beyond create, write, link and unlink, each on the writer and
/// the model; the calls the model says must fail are checked to fail with the
/// kernel's errno and to change nothing.
impl Workload {
    /// `op` one to `max` times (cheap metadata operations, several to a step).
    fn several(
        &mut self,
        w: &mut FsWriter,
        max: u64,
        op: fn(&mut Workload, &mut FsWriter) -> StepResult,
    ) -> StepResult {
        let n = self.rng.range(1, max);
        let mut done = Vec::new();
        for _ in 0..n {
            done.push(op(self, w)?);
        }
        Ok(done.join("; "))
    }

    /// Create an empty file in `dir`, with what it inherits from `dir`.
    fn create(
        &mut self,
        w: &mut FsWriter,
        dir: &[u8],
        kind: &str,
        note: &str,
    ) -> Result<(Vec<u8>, String), (String, Error)> {
        let dino = self.model.dir_ino(dir);
        let name = self.name(kind);
        let path = join(dir, &name);
        let what = format!("create {} {note}", show(&path));
        let ino = w
            .create_file(FS_TREE, dino, &name, &InodeAttrs::new(0o644))
            .map_err(|e| (what.clone(), e))?;
        let meta = self.model.new_meta(dir, S_IFREG | 0o644);
        self.model.meta.insert((FS_TREE, ino), meta);
        self.model.entries.insert(path.clone(), Node::File { root: FS_TREE, ino });
        self.model.files.insert((FS_TREE, ino), Arc::new(Vec::new()));
        Ok((path, what))
    }

    /// Every name in the top subvolume but the top (new ones three times in four when
    /// `new_first`).
    fn pick_name(&mut self, new_first: bool) -> Option<Vec<u8>> {
        let all: Vec<Vec<u8>> = self
            .model
            .entries
            .iter()
            .filter(|(p, n)| !p.is_empty() && n.id().0 == FS_TREE)
            .map(|(p, _)| p.clone())
            .collect();
        let new: Vec<Vec<u8>> =
            all.iter().filter(|p| !self.fixture_paths.contains(*p)).cloned().collect();
        let from = if new_first && !new.is_empty() && self.rng.chance(3, 4) { new } else { all };
        (!from.is_empty()).then(|| from[self.rng.below(from.len() as u64) as usize].clone())
    }

    /// Files and directories (not the top), for flags and the compression property.
    fn pick_file_or_dir(&mut self) -> Option<Vec<u8>> {
        let c: Vec<Vec<u8>> = self
            .model
            .entries
            .iter()
            .filter(|(p, n)| {
                !p.is_empty()
                    && matches!(
                        n,
                        Node::File { root: FS_TREE, .. } | Node::Dir { root: FS_TREE, .. }
                    )
            })
            .map(|(p, _)| p.clone())
            .collect();
        (!c.is_empty()).then(|| c[self.rng.below(c.len() as u64) as usize].clone())
    }

    /// The (root, ino) of `path` and of its parent, for what a refused call must not
    /// change.
    fn ids_of(&self, paths: &[&[u8]]) -> Vec<InodeId> {
        let mut v = Vec::new();
        for p in paths {
            for q in [*p, split_parent(p).0] {
                if let Some(n) = self.model.entries.get(q) {
                    let (root, ino) = n.id();
                    v.push(InodeId { root, ino });
                }
            }
        }
        v
    }

    /// Make a call the model says fails with `want`: it must, and change nothing.
    fn refuse(
        &mut self,
        w: &mut FsWriter,
        what: String,
        want: PosixKind,
        paths: &[&[u8]],
        f: impl FnOnce(&mut FsWriter) -> ubtrfs_core::Result<()>,
    ) -> StepResult {
        let ids = self.ids_of(paths);
        check_refused(w, &what, want, &ids, f).map_err(|e| (what.clone(), e))?;
        Ok(format!("{what}: {want:?} as expected"))
    }

    /// What `renameat2(from, to, flags)` returns, the checks in the kernel's order
    /// (see `Model::rename_outcome` in common/write.rs).
    fn rename_outcome(&self, from: &[u8], to: &[u8], flags: u32) -> Result<(), PosixKind> {
        let m = &self.model;
        let exchange = flags & RENAME_EXCHANGE != 0;
        let src = &m.entries[from];
        let dst = m.entries.get(to);
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return Err(PosixKind::Exists);
        }
        if exchange && dst.is_none() {
            return Err(PosixKind::NotFound);
        }
        let (fp, tp) = (split_parent(from).0, split_parent(to).0);
        if fp != tp {
            if src.is_dir() && is_ancestor_or_self(from, tp) {
                return Err(PosixKind::Invalid);
            }
            if dst.is_some_and(|d| d.is_dir() && is_ancestor_or_self(to, fp)) {
                return Err(if exchange { PosixKind::Invalid } else { PosixKind::NotEmpty });
            }
        }
        let Some(d) = dst else { return Ok(()) };
        if d.id() == src.id() {
            return Ok(());
        }
        let want_dir = if exchange { d.is_dir() } else { src.is_dir() };
        if want_dir && !d.is_dir() {
            return Err(PosixKind::NotDir);
        }
        if !want_dir && d.is_dir() {
            return Err(PosixKind::IsDir);
        }
        if !exchange && d.is_dir() && m.children(to) > 0 {
            return Err(PosixKind::NotEmpty);
        }
        Ok(())
    }

    /// Take `path` and everything below it out of the model's names (suffixes after
    /// `path`, "" for itself).
    fn take_subtree(&mut self, path: &[u8]) -> Vec<(Vec<u8>, Node)> {
        let keys: Vec<Vec<u8>> = self
            .model
            .entries
            .keys()
            .filter(|k| {
                k.as_slice() == path || (k.starts_with(path) && k.get(path.len()) == Some(&b'/'))
            })
            .cloned()
            .collect();
        keys.into_iter()
            .map(|k| (k[path.len()..].to_vec(), self.model.entries.remove(&k).expect("listed")))
            .collect()
    }

    fn put_subtree(&mut self, path: &[u8], items: Vec<(Vec<u8>, Node)>) {
        for (suffix, n) in items {
            self.model.entries.insert([path, &suffix].concat(), n);
        }
    }

    /// The model's side of a rename that succeeded (`whiteout`: the inode left at the
    /// old name).
    fn apply_rename(&mut self, from: &[u8], to: &[u8], flags: u32, whiteout: Option<u64>) {
        let src = self.model.entries[from].id();
        if self.model.entries.get(to).is_some_and(|d| d.id() == src) {
            return;
        }
        if flags & RENAME_EXCHANGE != 0 {
            let (a, b) = (self.take_subtree(from), self.take_subtree(to));
            self.put_subtree(to, a);
            self.put_subtree(from, b);
        } else {
            if self.model.entries.contains_key(to) {
                self.forget(to);
            }
            let a = self.take_subtree(from);
            self.put_subtree(to, a);
        }
        if let Some(ino) = whiteout {
            self.model
                .entries
                .insert(from.to_vec(), Node::Special { ino, kind: FileKind::CharDev });
            self.model.meta.insert((FS_TREE, ino), Meta { mode: S_IFCHR, ..Meta::default() });
        }
    }

    /// rename(2) with its flags: to a fresh name, onto an existing one (replacing it,
    /// or refused as the model predicts), swaps, whiteouts, directories moved under
    /// themselves.
    fn op_rename(&mut self, w: &mut FsWriter) -> StepResult {
        // A directory a third of the time (whole subtrees move, or must not).
        let dirs: Vec<Vec<u8>> =
            self.model.dirs().into_iter().map(|d| d.0).filter(|d| !d.is_empty()).collect();
        let from = if !dirs.is_empty() && self.rng.chance(1, 3) {
            dirs[self.rng.below(dirs.len() as u64) as usize].clone()
        } else {
            let Some(p) = self.pick_name(true) else { return Ok("rename: nothing".into()) };
            p
        };
        let flags = match self.rng.below(10) {
            0..=4 => 0,
            5 | 6 => RENAME_NOREPLACE,
            7 | 8 => RENAME_EXCHANGE,
            _ => RENAME_WHITEOUT,
        };
        let src_dir = self.model.entries[&from].is_dir();
        let to = if src_dir && self.rng.chance(1, 4) {
            let under: Vec<Vec<u8>> = self
                .model
                .dirs()
                .into_iter()
                .map(|d| d.0)
                .filter(|d| is_ancestor_or_self(&from, d))
                .collect();
            let d = under[self.rng.below(under.len() as u64) as usize].clone();
            join(&d, &self.name("m"))
        } else if flags == RENAME_EXCHANGE || self.rng.chance(2, 5) {
            let all: Vec<Vec<u8>> = self
                .model
                .entries
                .iter()
                .filter(|(p, n)| !p.is_empty() && n.id().0 == FS_TREE)
                .map(|(p, _)| p.clone())
                .collect();
            let same: Vec<Vec<u8>> = all
                .iter()
                .filter(|p| self.model.entries[*p].is_dir() == src_dir)
                .cloned()
                .collect();
            let from_set = if !same.is_empty() && self.rng.chance(1, 2) { same } else { all };
            from_set[self.rng.below(from_set.len() as u64) as usize].clone()
        } else {
            let (d, _) = self.pick_dir();
            join(&d, &self.name("m"))
        };
        let what = format!("rename {} -> {} flags {flags}", show(&from), show(&to));
        let ((odir, oname), (ndir, nname)) = (
            (split_parent(&from).0.to_vec(), split_parent(&from).1.to_vec()),
            (split_parent(&to).0.to_vec(), split_parent(&to).1.to_vec()),
        );
        let (oino, nino) = (self.model.dir_ino(&odir), self.model.dir_ino(&ndir));
        match self.rename_outcome(&from, &to, flags) {
            Ok(()) => {
                let same = self
                    .model
                    .entries
                    .get(&to)
                    .is_some_and(|d| d.id() == self.model.entries[&from].id());
                w.rename(FS_TREE, oino, &oname, nino, &nname, flags)
                    .map_err(|e| (what.clone(), e))?;
                let whiteout = if flags & RENAME_WHITEOUT != 0 && !same {
                    let e = w
                        .live()
                        .lookup(InodeId { root: FS_TREE, ino: oino }, &oname)
                        .map_err(|e| (what.clone(), e))?;
                    Some(
                        e.unwrap_or_else(|| panic!("{what}: no whiteout at the old name"))
                            .target
                            .ino,
                    )
                } else {
                    None
                };
                self.apply_rename(&from, &to, flags, whiteout);
                Ok(what)
            }
            Err(want) => self.refuse(w, what, want, &[&from, &to], |w| {
                w.rename(FS_TREE, oino, &oname, nino, &nname, flags)
            }),
        }
    }

    /// truncate(2) down or up.
    fn op_truncate(&mut self, w: &mut FsWriter) -> StepResult {
        let Some((path, ino)) = self.pick_file() else { return Ok("truncate: no file".into()) };
        let size = self.model.files[&(FS_TREE, ino)].len() as u64;
        let new = match self.rng.below(5) {
            0 => 0,
            1 | 2 => self.rng.below(size + 1),
            _ => size + self.rng.range(1, 256 << 10),
        };
        let what = format!("truncate {} from {size} to {new}", show(&path));
        w.setattr(
            InodeId { root: FS_TREE, ino },
            &SetAttr { size: Some(new), ..SetAttr::default() },
        )
        .map_err(|e| (what.clone(), e))?;
        Arc::make_mut(self.model.files.get_mut(&(FS_TREE, ino)).expect("file in model"))
            .resize(new as usize, 0);
        Ok(what)
    }

    /// fallocate(2): preallocation (growing the file or, with KEEP_SIZE, not), punched
    /// holes and zeroed ranges, inside the file, across its end and past it.
    fn op_fallocate(&mut self, w: &mut FsWriter) -> StepResult {
        let Some((path, ino)) = self.pick_file() else { return Ok("fallocate: no file".into()) };
        let size = self.model.files[&(FS_TREE, ino)].len() as u64;
        let modes = [
            0,
            FALLOC_FL_KEEP_SIZE,
            FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            FALLOC_FL_ZERO_RANGE,
            FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE,
        ];
        let mode = modes[self.rng.below(modes.len() as u64) as usize];
        let mut off = self.rng.below(size + (64 << 10));
        if self.rng.chance(1, 3) {
            off = off / 4096 * 4096;
        }
        let len = match self.rng.below(3) {
            0 => self.rng.range(1, 4096),
            1 => self.rng.range(1, 64 << 10),
            _ => self.rng.range(1, 1 << 20),
        };
        let what =
            format!("fallocate {} (size {size}) mode {mode:#x} [{off}, +{len})", show(&path));
        w.fallocate(InodeId { root: FS_TREE, ino }, mode, off, len)
            .map_err(|e| (what.clone(), e))?;
        model_fallocate(
            Arc::make_mut(self.model.files.get_mut(&(FS_TREE, ino)).expect("file in model")),
            mode,
            off,
            len,
        );
        Ok(what)
    }

    /// chmod and chown of any name (chown clears set-user-ID, and set-group-ID with
    /// group execute, of anything but a directory).
    fn op_setattr(&mut self, w: &mut FsWriter) -> StepResult {
        let Some(path) = self.pick_name(false) else { return Ok("setattr: nothing".into()) };
        const MODES: [u32; 8] = [0o644, 0o600, 0o755, 0o4755, 0o2755, 0o2745, 0o6711, 0o1777];
        const IDS: [u32; 4] = [0, 1000, 65534, 123_456];
        let node = self.model.entries[&path].clone();
        let mut a = SetAttr::default();
        if !matches!(node, Node::Symlink { .. }) && self.rng.chance(3, 5) {
            a.mode = Some(MODES[self.rng.below(MODES.len() as u64) as usize]);
        }
        if self.rng.chance(1, 2) {
            a.uid = Some(IDS[self.rng.below(4) as usize]);
        }
        if a.mode.is_none() || self.rng.chance(1, 2) {
            a.gid = Some(IDS[self.rng.below(4) as usize]);
        }
        let what = format!(
            "setattr {} mode {:?} uid {:?} gid {:?}",
            show(&path),
            a.mode.map(|m| format!("{m:o}")),
            a.uid,
            a.gid
        );
        let (root, ino) = node.id();
        w.setattr(InodeId { root, ino }, &a).map_err(|e| (what.clone(), e))?;
        let m = self.model.meta_of(&path);
        if let Some(mode) = a.mode {
            m.mode = (m.mode & S_IFMT) | mode;
        }
        m.uid = a.uid.unwrap_or(m.uid);
        m.gid = a.gid.unwrap_or(m.gid);
        if (a.uid.is_some() || a.gid.is_some()) && !node.is_dir() {
            m.mode &= !0o4000;
            if m.mode & 0o2010 == 0o2010 {
                m.mode &= !0o2000;
            }
        }
        Ok(what)
    }

    /// setxattr(2) (XATTR_CREATE, XATTR_REPLACE or neither) and removexattr(2):
    /// user.* on files and directories, trusted.* on anything; EEXIST and ENODATA as
    /// the model predicts.
    fn op_xattr(&mut self, w: &mut FsWriter) -> StepResult {
        let Some(path) = self.pick_name(true) else { return Ok("xattr: nothing".into()) };
        let node = self.model.entries[&path].clone();
        let (root, ino) = node.id();
        let reg_or_dir = matches!(node, Node::File { .. } | Node::Dir { .. });
        let ns = if reg_or_dir && self.rng.chance(4, 5) { "user" } else { "trusted" };
        let name = format!("{ns}.c{}", self.rng.below(5)).into_bytes();
        let exists = self.model.meta_of(&path).xattrs.contains_key(&name);
        let shown = format!("{} {}", show(&path), String::from_utf8_lossy(&name));
        if self.rng.chance(1, 4) {
            let what = format!("removexattr {shown}");
            if !exists {
                return self.refuse(w, what, PosixKind::NoData, &[&path], |w| {
                    w.removexattr(InodeId { root, ino }, &name)
                });
            }
            w.removexattr(InodeId { root, ino }, &name).map_err(|e| (what.clone(), e))?;
            self.model.meta_of(&path).xattrs.remove(&name);
            return Ok(what);
        }
        let len =
            if self.rng.chance(1, 10) { self.rng.range(500, 3000) } else { self.rng.below(100) }
                as usize;
        let value = random_bytes(&mut self.rng, len);
        let flags = [0, 0, XATTR_CREATE, XATTR_REPLACE][self.rng.below(4) as usize];
        let what = format!("setxattr {shown} ({len} bytes) flags {flags}");
        if flags == XATTR_CREATE && exists {
            return self.refuse(w, what, PosixKind::Exists, &[&path], |w| {
                w.setxattr(InodeId { root, ino }, &name, &value, flags)
            });
        }
        if flags == XATTR_REPLACE && !exists {
            return self.refuse(w, what, PosixKind::NoData, &[&path], |w| {
                w.setxattr(InodeId { root, ino }, &name, &value, flags)
            });
        }
        w.setxattr(InodeId { root, ino }, &name, &value, flags).map_err(|e| (what.clone(), e))?;
        self.model.meta_of(&path).xattrs.insert(name, value);
        Ok(what)
    }

    /// A symlink (a target of 1 to 300 bytes, or near the node size's limit), or a
    /// fifo, socket, character or block device.
    fn op_symlink_mknod(&mut self, w: &mut FsWriter) -> StepResult {
        let (dir, dino) = self.pick_dir();
        if self.rng.chance(1, 2) {
            let name = self.name("y");
            let max = max_symlink_len(w.nodesize()) as u64;
            let len = if self.rng.chance(1, 10) {
                self.rng.range(max - 10, max)
            } else {
                self.rng.range(1, 300)
            };
            let target: Vec<u8> =
                (0..len).map(|_| b"abcdefghij/._-XYZ"[self.rng.below(17) as usize]).collect();
            let what = format!("symlink {} -> {len} bytes", show(&join(&dir, &name)));
            let ino = w
                .symlink(FS_TREE, dino, &name, &target, &InodeAttrs::new(0o777))
                .map_err(|e| (what.clone(), e))?;
            self.model
                .meta
                .insert((FS_TREE, ino), Meta { mode: S_IFLNK | 0o777, ..Meta::default() });
            self.model.entries.insert(join(&dir, &name), Node::Symlink { ino, target });
            return Ok(what);
        }
        let name = self.name("n");
        let (t, kind) = [
            (S_IFIFO, FileKind::Fifo),
            (S_IFSOCK, FileKind::Socket),
            (S_IFCHR, FileKind::CharDev),
            (S_IFBLK, FileKind::BlockDev),
        ][self.rng.below(4) as usize];
        let dev = if matches!(kind, FileKind::CharDev | FileKind::BlockDev) {
            (self.rng.below(4096) as u32, self.rng.below(1 << 20) as u32)
        } else {
            (0, 0)
        };
        let mode = t | 0o640;
        let what = format!("mknod {} mode {mode:o} rdev {dev:?}", show(&join(&dir, &name)));
        let ino = w
            .mknod(
                FS_TREE,
                dino,
                &name,
                &InodeAttrs { rdev: rdev_encode(dev.0, dev.1), ..InodeAttrs::new(mode) },
            )
            .map_err(|e| (what.clone(), e))?;
        self.model.meta.insert((FS_TREE, ino), Meta { mode, rdev: dev, ..Meta::default() });
        self.model.entries.insert(join(&dir, &name), Node::Special { ino, kind });
        Ok(what)
    }

    /// A NODATACOW file: created empty, `chattr +C`, then written. Later overwrites,
    /// truncates and fallocates may pick it; its contents are compared by size only.
    fn op_nocow_file(&mut self, w: &mut FsWriter) -> StepResult {
        let (dir, _) = self.pick_dir();
        let size = pick_size(&mut self.rng, self.flavour).min(4 << 20);
        let data = random_bytes(&mut self.rng, size);
        let (path, what) = self.create(w, &dir, "c", &format!("+C size {size}"))?;
        let ino = self.model.entries[&path].id().1;
        w.set_fsflags(InodeId { root: FS_TREE, ino }, fsflags::NOCOW)
            .map_err(|e| (what.clone(), e))?;
        let alg = self.mount_alg();
        let m = self.model.meta_of(&path);
        model_set_fsflags('f', true, &mut m.nocow, &mut m.xattrs, fsflags::NOCOW, alg);
        w.write_file(FS_TREE, ino, 0, &data).map_err(|e| (what.clone(), e))?;
        self.model.files.insert((FS_TREE, ino), Arc::new(data));
        Ok(what)
    }

    /// The compression property's value `chattr +c` sets: the writer's algorithm.
    fn mount_alg(&self) -> &'static [u8] {
        match self.compress.alg {
            Some(ubtrfs_core::compression::CompressionType::Lzo) => b"lzo",
            Some(ubtrfs_core::compression::CompressionType::Zstd) => b"zstd",
            _ => b"zlib",
        }
    }

    /// FS_IOC_SETFLAGS on a file or directory: NOCOW (kept by directories and empty
    /// files only), COMPR and NOCOMP (the compression property), flags without a model.
    fn op_fsflags(&mut self, w: &mut FsWriter) -> StepResult {
        let Some(path) = self.pick_file_or_dir() else { return Ok("set_fsflags: nothing".into()) };
        let fs =
            [fsflags::NOCOW, 0, fsflags::NODUMP, fsflags::COMPR, fsflags::NOCOMP, fsflags::NOATIME]
                [self.rng.below(6) as usize];
        let node = self.model.entries[&path].clone();
        let (root, ino) = node.id();
        let alg = self.mount_alg();
        let m = self.model.meta_of(&path).clone();
        let what = format!("set_fsflags {} {fs:#x}", show(&path));
        if fs & fsflags::COMPR != 0
            && m.nocow
            && m.xattrs.get(COMPRESSION_PROP).map(Vec::as_slice) != Some(alg)
        {
            return self.refuse(w, what, PosixKind::Invalid, &[&path], |w| {
                w.set_fsflags(InodeId { root, ino }, fs)
            });
        }
        w.set_fsflags(InodeId { root, ino }, fs).map_err(|e| (what.clone(), e))?;
        let (kind, empty) = if node.is_dir() {
            ('d', false)
        } else {
            ('f', self.model.files[&(root, ino)].is_empty())
        };
        let m = self.model.meta_of(&path);
        model_set_fsflags(kind, empty, &mut m.nocow, &mut m.xattrs, fs, alg);
        Ok(what)
    }

    /// The `btrfs.compression` property of a file or directory (a directory's is
    /// inherited by new files and directories); EINVAL on a NODATACOW inode.
    fn op_compression_prop(&mut self, w: &mut FsWriter) -> StepResult {
        let Some(path) = self.pick_file_or_dir() else { return Ok("compression: nothing".into()) };
        const VALUES: [&[u8]; 6] = [b"zlib", b"lzo", b"zstd", b"zstd:3", b"no", b""];
        let value = VALUES[self.rng.below(VALUES.len() as u64) as usize];
        let (root, ino) = self.model.entries[&path].id();
        let what = format!(
            "setxattr {} btrfs.compression {:?}",
            show(&path),
            String::from_utf8_lossy(value)
        );
        if self.model.meta_of(&path).nocow && !value.is_empty() {
            return self.refuse(w, what, PosixKind::Invalid, &[&path], |w| {
                w.setxattr(InodeId { root, ino }, COMPRESSION_PROP, value, 0)
            });
        }
        w.setxattr(InodeId { root, ino }, COMPRESSION_PROP, value, 0)
            .map_err(|e| (what.clone(), e))?;
        let kind = if self.model.entries[&path].is_dir() { 'd' } else { 'f' };
        model_setxattr(kind, &mut self.model.meta_of(&path).xattrs, COMPRESSION_PROP, value);
        Ok(what)
    }

    /// A call the engine must refuse with the kernel's errno, changing nothing.
    fn op_refused(&mut self, w: &mut FsWriter) -> StepResult {
        let Some(path) = self.pick_name(true) else { return Ok("refused: nothing".into()) };
        let node = self.model.entries[&path].clone();
        let (root, ino) = node.id();
        let (parent, name) = (split_parent(&path).0.to_vec(), split_parent(&path).1.to_vec());
        let pino = self.model.dir_ino(&parent);
        let p = show(&path);
        match (self.rng.below(7), &node) {
            (0, Node::Dir { .. }) => {
                self.refuse(w, format!("unlink {p}"), PosixKind::IsDir, &[&path], |w| {
                    w.unlink(FS_TREE, pino, &name)
                })
            }
            (0, _) => self.refuse(w, format!("rmdir {p}"), PosixKind::NotDir, &[&path], |w| {
                w.rmdir(FS_TREE, pino, &name)
            }),
            (1, Node::Dir { .. }) if self.model.children(&path) > 0 => self.refuse(
                w,
                format!("rmdir {p} (not empty)"),
                PosixKind::NotEmpty,
                &[&path],
                |w| w.rmdir(FS_TREE, pino, &name),
            ),
            (1, _) => {
                self.refuse(w, format!("create {p} (exists)"), PosixKind::Exists, &[&path], |w| {
                    w.create_file(FS_TREE, pino, &name, &InodeAttrs::new(0o644)).map(drop)
                })
            }
            (2, Node::Dir { .. }) => self.refuse(
                w,
                format!("truncate {p} (a directory)"),
                PosixKind::IsDir,
                &[&path],
                |w| {
                    w.setattr(
                        InodeId { root, ino },
                        &SetAttr { size: Some(0), ..SetAttr::default() },
                    )
                },
            ),
            (2, Node::Symlink { .. } | Node::Special { .. }) => self.refuse(
                w,
                format!("truncate {p} (not a file)"),
                PosixKind::Invalid,
                &[&path],
                |w| {
                    w.setattr(
                        InodeId { root, ino },
                        &SetAttr { size: Some(0), ..SetAttr::default() },
                    )
                },
            ),
            (3, Node::Dir { .. }) => self.refuse(
                w,
                format!("fallocate {p} (a directory)"),
                PosixKind::IsDir,
                &[&path],
                |w| w.fallocate(InodeId { root, ino }, 0, 0, 4096),
            ),
            (3, Node::File { .. }) => self.refuse(
                w,
                format!("fallocate {p} PUNCH_HOLE without KEEP_SIZE"),
                PosixKind::NotSupported,
                &[&path],
                |w| w.fallocate(InodeId { root, ino }, FALLOC_FL_PUNCH_HOLE, 0, 4096),
            ),
            (4, Node::Symlink { .. } | Node::Special { .. }) => self.refuse(
                w,
                format!("setxattr {p} user.c0 (not a file or directory)"),
                PosixKind::NotPermitted,
                &[&path],
                |w| w.setxattr(InodeId { root, ino }, b"user.c0", b"v", 0),
            ),
            (5, Node::Dir { .. }) => {
                // Into its own subtree with EXCHANGE onto a name below: EINVAL.
                let below: Vec<Vec<u8>> = self
                    .model
                    .entries
                    .keys()
                    .filter(|k| k.len() > path.len() && is_ancestor_or_self(&path, k))
                    .cloned()
                    .collect();
                let Some(t) = below.first().cloned() else {
                    return Ok(format!("refused: {p} has nothing below"));
                };
                let (tp, tn) = (split_parent(&t).0.to_vec(), split_parent(&t).1.to_vec());
                let tino = self.model.dir_ino(&tp);
                self.refuse(
                    w,
                    format!("rename {p} <-> {} (exchange with its own descendant)", show(&t)),
                    PosixKind::Invalid,
                    &[&path, &t],
                    |w| w.rename(FS_TREE, pino, &name, tino, &tn, RENAME_EXCHANGE),
                )
            }
            _ => self.refuse(
                w,
                format!("rename {p} flags EXCHANGE|NOREPLACE"),
                PosixKind::Invalid,
                &[&path],
                |w| w.rename(FS_TREE, pino, &name, pino, b"zz", RENAME_EXCHANGE | RENAME_NOREPLACE),
            ),
        }
    }
}

// ---------------------------------------------------------------------------------
// Recording run

/// A committed state of the run.
#[derive(Clone)]
struct CommitRec {
    generation: u64,
    /// Op number of the commit's first superblock write (None: the fixture's state).
    sb_first: Option<u64>,
    /// Op number of the commit's last operation, the flush after the superblocks.
    done: Option<u64>,
    model: Arc<Model>,
}

struct Run {
    seed: u64,
    log: Vec<OpRecord>,
    commits: Vec<CommitRec>,
    /// Steps with the op number each started at, for failure messages.
    steps: Vec<(u64, String)>,
    /// Problems found while running (ordering rules, baseline mismatches).
    problems: Vec<String>,
    flavour: Flavour,
    /// Chunks before and after the run.
    chunks: (usize, usize),
    /// The step that ran out of space, which ended the run early.
    enospc: Option<String>,
}

impl Run {
    fn op_count(&self) -> u64 {
        self.log.len() as u64
    }
    fn writes(&self) -> usize {
        self.log.iter().filter(|r| r.is_write()).count()
    }
    fn flushes(&self) -> usize {
        self.log.iter().filter(|r| r.is_flush()).count()
    }
    /// Indices into `commits` acceptable after a power loss at op `k`.
    fn acceptable(&self, k: u64) -> Vec<usize> {
        let j = self
            .commits
            .iter()
            .rposition(|c| c.done.is_none_or(|d| d < k))
            .expect("the fixture state is always committed");
        let mut v = vec![j];
        if let Some(n) = self.commits.get(j + 1) {
            if n.sb_first.is_some_and(|s| s <= k) {
                v.push(j + 1);
            }
        }
        v
    }
    fn step_at(&self, k: u64) -> String {
        match self.steps.iter().rposition(|(s, _)| *s <= k) {
            Some(i) => format!("step {i} ({})", self.steps[i].1),
            None => "before the first step".into(),
        }
    }
}

/// Add the physical byte ranges (single device, every copy) of logical `[l, l + len)`.
fn push_physical(
    info: &FsInfo,
    l: u64,
    len: u64,
    out: &mut Vec<(u64, u64)>,
) -> ubtrfs_core::Result<()> {
    let c = info.chunk_map.lookup(ubtrfs_core::ids::Logical(l))?.clone();
    for m in 0..c.num_copies() {
        let mut done = 0;
        while done < len {
            let (_, phys, contig) = c.map(l + done, m);
            let n = (len - done).min(contig);
            out.push((phys, phys + n));
            done += n;
        }
    }
    Ok(())
}

fn sort_merge(mut out: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    out.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (s, e) in out {
        match merged.last_mut() {
            Some(l) if s <= l.1 => l.1 = l.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged
}

/// Physical byte ranges (single device) of every extent the committed state `info`
/// shows references: tree blocks and data extents, every copy. Sorted and merged.
fn referenced_ranges(info: &FsInfo) -> ubtrfs_core::Result<Vec<(u64, u64)>> {
    let (root, _) = info.read_root(EXTENT_TREE_OBJECTID)?;
    let mut out = Vec::new();
    let mut it = info.iter(&root, Key::MIN)?;
    while let Some(item) = it.next_item()? {
        let k = item.key();
        let (l, len) = match k.type_ {
            EXTENT_ITEM_KEY => (k.objectid, k.offset),
            METADATA_ITEM_KEY => (k.objectid, u64::from(info.nodesize)),
            _ => continue,
        };
        push_physical(info, l, len, &mut out)?;
    }
    Ok(sort_merge(out))
}

/// Physical byte ranges of the committed state in `fs` that a writer may overwrite in
/// place before its next commit (the kernel's NOCOW writes): the preallocated extents
/// of every file of `model`, which that state reads as zeros whatever they hold, and
/// every extent of a NODATACOW file, whose data the crash comparison does not look at.
fn in_place_ranges(fs: &Filesystem, model: &Model) -> ubtrfs_core::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    for &(root, ino) in model.files.keys() {
        let nocow = model.meta.get(&(root, ino)).is_some_and(|m| m.nocow);
        let v = fs.load_inode(InodeId { root, ino }, Load { extents: true, ..Load::ITEM })?;
        for f in &v.extents {
            if let ExtentKind::Regular { disk_bytenr, disk_num_bytes, prealloc, .. } = f.kind {
                if disk_bytenr != 0 && (prealloc || nocow) {
                    push_physical(&fs.info, disk_bytenr, disk_num_bytes, &mut out)?;
                }
            }
        }
    }
    Ok(sort_merge(out))
}

/// `a` less `b` (both sorted and merged).
fn subtract(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for &(mut s, e) in a {
        for &(bs, be) in b.iter().skip(b.partition_point(|r| r.1 <= s)) {
            if bs >= e {
                break;
            }
            if bs > s {
                out.push((s, bs));
            }
            s = s.max(be);
            if s >= e {
                break;
            }
        }
        if s < e {
            out.push((s, e));
        }
    }
    out
}

/// What no write may touch between the commit shown by `info` (with `model`'s files)
/// and the next: the referenced ranges less the in-place ones.
fn ordering_ranges(info: FsInfo, model: &Model) -> ubtrfs_core::Result<Vec<(u64, u64)>> {
    let referenced = referenced_ranges(&info)?;
    let fs = Filesystem::from_info(info)?;
    Ok(subtract(&referenced, &in_place_ranges(&fs, model)?))
}

fn overlaps(ranges: &[(u64, u64)], s: u64, e: u64) -> Option<(u64, u64)> {
    let i = ranges.partition_point(|r| r.1 <= s);
    ranges.get(i).filter(|r| r.0 < e).copied()
}

/// Check the two ordering rules on `log[from..to]`, given the ranges the committed
/// state at `from` references: no non-superblock write may land in them, and no
/// superblock may be written while a non-superblock write is unflushed.
fn check_ordering(
    log: &[OpRecord],
    from: usize,
    to: usize,
    referenced: &[(u64, u64)],
    what: &str,
    problems: &mut Vec<String>,
) {
    let mut unflushed: Option<u64> = None;
    for (i, r) in log.iter().enumerate().take(to).skip(from) {
        match r.kind {
            OpKind::Flush if r.outcome == OpOutcome::Ok => unflushed = None,
            OpKind::Flush => {}
            OpKind::Write { offset, len } => {
                if is_super_write(r) {
                    if let Some(w) = unflushed {
                        problems.push(format!(
                            "{what}: superblock write at op {i} while write op {w} is not flushed"
                        ));
                    }
                } else {
                    if let Some((s, e)) = overlaps(referenced, offset, offset + len) {
                        problems.push(format!("{what}: write op {i} [{offset}, +{len}) overwrites space [{s}, {e}) the committed state references"));
                    }
                    if r.outcome == OpOutcome::Ok {
                        unflushed = Some(i as u64);
                    }
                }
            }
        }
    }
}

/// Run the seeded workload on a copy of the fixture, recording everything.
fn record(seed: u64, nops: usize) -> Run {
    let dev = Arc::new(FaultyDevice::new(base_image().to_vec(), format!("seed-{seed}")));
    let mut w = open_writer(dev.clone()).expect("open fixture for writing");
    let mut wl = Workload::new(seed, (*base_model()).clone(), "");
    wl.setup(&mut w);
    // Odd seeds write metadata back between operations (a dirty limit of two blocks):
    // a crash must still show exactly the last commit, never a block written early.
    if seed % 2 == 1 {
        let limit = 2 * w.nodesize() as usize;
        w.set_dirty_metadata_limit(limit);
    }
    let mut run = Run {
        seed,
        log: Vec::new(),
        commits: Vec::new(),
        steps: Vec::new(),
        problems: Vec::new(),
        flavour: wl.flavour,
        chunks: (w.info.chunk_map.len(), 0),
        enospc: None,
    };
    run.commits.push(CommitRec {
        generation: w.info.super_copy().generation.get(),
        sb_first: None,
        done: None,
        model: base_model(),
    });
    let mut referenced = ordering_ranges(open_info(dev.clone()).expect("open fixture"), &wl.model)
        .expect("fixture extents");
    let mut interval_start = 0usize;
    let mut until_commit = wl.rng.range(1, 5);
    for i in 0..nops {
        let start = dev.op_count();
        match wl.step(&mut w) {
            Ok(what) => run.steps.push((start, what)),
            Err((what, e)) if e.posix_kind() == Some(PosixKind::NoSpace) => {
                // A full filesystem is a legitimate end of the run; what was committed
                // so far is swept as usual, the rest is an uncommitted tail.
                run.enospc = Some(format!(
                    "step {i} {what}: {e} (writer aborted: {})",
                    w.check_writable().is_err()
                ));
                break;
            }
            Err((what, e)) => panic!("seed {seed}: step {i} {what}: {e}"),
        }
        until_commit -= 1;
        let last = i + 1 == nops;
        // The last steps stay uncommitted half of the time.
        if until_commit == 0 || (last && seed.is_multiple_of(2)) {
            until_commit = wl.rng.range(1, 5);
            let before = dev.op_count();
            let generation =
                w.commit().unwrap_or_else(|e| panic!("seed {seed}: commit after step {i}: {e}"));
            let log = dev.log();
            let after = log.len();
            if after == before as usize {
                continue;
            }
            let sb_first = (before as usize..after)
                .find(|&o| is_super_write(&log[o]))
                .unwrap_or_else(|| panic!("seed {seed}: commit {generation} wrote no superblock"));
            assert!(
                log[after - 1].is_flush(),
                "seed {seed}: commit {generation} does not end with a flush"
            );
            if let Some(o) =
                (sb_first..after).find(|&o| !is_super_write(&log[o]) && log[o].is_write())
            {
                run.problems.push(format!(
                    "commit {generation}: write op {o} after the first superblock write {sb_first}"
                ));
            }
            check_ordering(
                &log,
                interval_start,
                after,
                &referenced,
                &format!("transaction {generation}"),
                &mut run.problems,
            );
            run.steps.push((before, format!("commit {generation}")));
            run.commits.push(CommitRec {
                generation,
                sb_first: Some(sb_first as u64),
                done: Some(after as u64 - 1),
                model: Arc::new(wl.model.clone()),
            });
            // Reads see the durable state now (nothing is pending after the flush).
            assert!(
                dev.pending_ops().is_empty(),
                "seed {seed}: writes pending after commit {generation}"
            );
            let info = open_info(dev.clone()).expect("open after commit");
            referenced = ordering_ranges(info, &wl.model).expect("extents after commit");
            interval_start = after;
        }
    }
    // Uncommitted tail: its writes must not touch committed space either.
    let log = dev.log();
    check_ordering(
        &log,
        interval_start,
        log.len(),
        &referenced,
        "uncommitted tail",
        &mut run.problems,
    );
    run.log = log;
    run.chunks.1 = w.info.chunk_map.len();
    if seed % 2 == 1 && w.blocks_written_early() == 0 && run.commits.len() > 1 {
        run.problems.push("the dirty limit never wrote a block before its commit".into());
    }
    // Baseline: the last commit, read back cleanly.
    let last = run.commits.last().expect("at least the fixture").clone();
    let img = dev.durable_image();
    let (r, _) = with_image(img, |fs| verify_state(fs, &[last], true));
    if let Err(e) = r {
        run.problems.push(format!("baseline (no crash): {e}"));
    }
    drop(w);
    run
}

/// Verify that `fs` shows one of `want` and is clean. Returns the generation seen.
fn verify_state(
    fs: ubtrfs_core::Result<Filesystem>,
    want: &[CommitRec],
    run_check: bool,
) -> Result<u64, String> {
    let fs = fs.map_err(|e| format!("open: {e}"))?;
    let generation = fs.info.super_copy().generation.get();
    let Some(rec) = want.iter().find(|c| c.generation == generation) else {
        return Err(format!(
            "shows generation {generation}, expected {:?}",
            want.iter().map(|c| c.generation).collect::<Vec<_>>()
        ));
    };
    let got = walk(&fs)?;
    let d = rec.model.diff(&got, 8);
    if !d.is_empty() {
        return Err(format!(
            "generation {generation} differs from its commit:\n    {}",
            d.join("\n    ")
        ));
    }
    if run_check {
        let rep = check(&fs.info, &CheckOptions::default()).map_err(|e| format!("check: {e}"))?;
        if !rep.is_clean() {
            let f: Vec<String> = rep.findings.iter().take(8).map(|f| f.to_string()).collect();
            return Err(format!("ubtrfs check: {}\n    {}", rep.summary(), f.join("\n    ")));
        }
    }
    Ok(generation)
}

/// Root, btrfs-progs and the kernel driver (asked once; CI=true must have them).
fn kernel_oracle() -> bool {
    static A: OnceLock<bool> = OnceLock::new();
    *A.get_or_init(|| common::kernel_available("crash: btrfs check and kernel mounts"))
}

fn btrfs_check(img: &[u8], tag: &str) -> Result<(), String> {
    let path = std::env::temp_dir().join(format!("ubtrfs-crash-{tag}-{}.img", std::process::id()));
    std::fs::write(&path, img).map_err(|e| format!("write {}: {e}", path.display()))?;
    let o = std::process::Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(&path)
        .output()
        .map_err(|e| format!("run btrfs check: {e}"))?;
    std::fs::remove_file(&path).ok();
    if o.status.success() {
        Ok(())
    } else {
        let out =
            format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        let lines: Vec<&str> = out.lines().filter(|l| !l.is_empty()).take(20).collect();
        Err(format!("btrfs check --readonly failed:\n    {}", lines.join("\n    ")))
    }
}

/// The kernel's view of `img`: loop-mount it read-only and walk it into a model
/// (every path, inode number, type, size, content and symlink target).
fn kernel_walk(img: &[u8], tag: &str) -> Result<Model, String> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    // Every image of a run has the same fsid: one mount at a time in this process.
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let base =
        std::env::temp_dir().join(format!("ubtrfs-crash-kernel-{tag}-{}", std::process::id()));
    let (file, mnt) = (base.with_extension("img"), base.with_extension("mnt"));
    std::fs::write(&file, img).map_err(|e| format!("write {}: {e}", file.display()))?;
    std::fs::create_dir_all(&mnt).map_err(|e| format!("mkdir {}: {e}", mnt.display()))?;
    let out = std::process::Command::new("mount")
        .args(["-t", "btrfs", "-o", "ro,loop"])
        .arg(&file)
        .arg(&mnt)
        .output()
        .map_err(|e| format!("run mount: {e}"))?;
    let r = if !out.status.success() {
        Err(format!("kernel mount failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
    } else {
        let mut m = Model::default();
        // Mode, owner, device numbers, NOCOW (FS_IOC_GETFLAGS of files and directories)
        // and xattrs (llistxattr, lgetxattr), as the kernel reports them.
        let kmeta = |path: &std::path::Path, md: &std::fs::Metadata| -> std::io::Result<Meta> {
            let ft = md.file_type();
            let rdev = if ft.is_char_device() || ft.is_block_device() {
                (libc::major(md.rdev()), libc::minor(md.rdev()))
            } else {
                (0, 0)
            };
            let nocow =
                (ft.is_file() || ft.is_dir()) && try_kernel_fsflags(path)? & fsflags::NOCOW != 0;
            Ok(Meta {
                mode: md.mode(),
                uid: md.uid(),
                gid: md.gid(),
                rdev,
                nocow,
                xattrs: try_kernel_xattrs(path)?,
            })
        };
        let walked = (|| -> std::io::Result<()> {
            let top = std::fs::symlink_metadata(&mnt)?;
            m.entries.insert(Vec::new(), Node::Dir { root: FS_TREE, ino: top.ino() });
            m.meta.insert((FS_TREE, top.ino()), kmeta(&mnt, &top)?);
            let mut stack = vec![(Vec::new(), mnt.clone())];
            while let Some((rel, dir)) = stack.pop() {
                for e in std::fs::read_dir(&dir)? {
                    let e = e?;
                    let p = join(&rel, e.file_name().as_bytes());
                    let md = e.path().symlink_metadata()?;
                    let ft = md.file_type();
                    if let std::collections::btree_map::Entry::Vacant(v) =
                        m.meta.entry((FS_TREE, md.ino()))
                    {
                        v.insert(kmeta(&e.path(), &md)?);
                    }
                    let node = if ft.is_dir() {
                        stack.push((p.clone(), e.path()));
                        Node::Dir { root: FS_TREE, ino: md.ino() }
                    } else if ft.is_file() {
                        if let std::collections::btree_map::Entry::Vacant(v) =
                            m.files.entry((FS_TREE, md.ino()))
                        {
                            v.insert(Arc::new(std::fs::read(e.path())?));
                        }
                        Node::File { root: FS_TREE, ino: md.ino() }
                    } else if ft.is_symlink() {
                        Node::Symlink {
                            ino: md.ino(),
                            target: std::fs::read_link(e.path())?.as_os_str().as_bytes().to_vec(),
                        }
                    } else {
                        let kind = if ft.is_fifo() {
                            FileKind::Fifo
                        } else if ft.is_char_device() {
                            FileKind::CharDev
                        } else if ft.is_block_device() {
                            FileKind::BlockDev
                        } else {
                            FileKind::Socket
                        };
                        Node::Special { ino: md.ino(), kind }
                    };
                    m.entries.insert(p, node);
                }
            }
            Ok(())
        })();
        let _ = std::process::Command::new("umount").arg(&mnt).status();
        walked.map(|()| m).map_err(|e| format!("walking the kernel mount: {e}"))
    };
    std::fs::remove_dir(&mnt).ok();
    std::fs::remove_file(&file).ok();
    r
}

fn keep_image(img: &[u8], tag: &str) {
    if std::env::var_os("UBTRFS_CRASH_KEEP").is_some() {
        let path = std::env::temp_dir().join(format!("ubtrfs-crash-{tag}.img"));
        if !path.exists() && std::fs::write(&path, img).is_ok() {
            eprintln!("kept {}", path.display());
        }
    }
}

// ---------------------------------------------------------------------------------
// Recovery: reopen a post-crash image for writing and go on

/// Write on top of the post-crash `img` showing `state`, commit, and verify.
/// How a recovery ended.
#[derive(Debug, PartialEq, Eq)]
enum Recovery {
    Committed,
    /// The workload on top ran out of space (a legitimate outcome on a full disk).
    NoSpace,
}

fn recover(img: Vec<u8>, state: &CommitRec, seed: u64) -> Result<Recovery, String> {
    let before = img.clone();
    let dev = Arc::new(FaultyDevice::new(img, "recovered"));
    let referenced =
        ordering_ranges(open_info(dev.clone()).map_err(|e| format!("open: {e}"))?, &state.model)
            .map_err(|e| format!("extents: {e}"))?;
    let mut w = open_writer(dev.clone()).map_err(|e| format!("open for writing: {e}"))?;
    let mut wl = Workload::new(seed, (*state.model).clone(), "r");
    wl.setup(&mut w);
    for _ in 0..wl.rng.range(2, 6) {
        match wl.step(&mut w) {
            Ok(_) => {}
            Err((_, e)) if e.posix_kind() == Some(PosixKind::NoSpace) => {
                // Out of space: nothing of the recovery may have reached the disk's
                // committed state.
                drop(w);
                let dev = Arc::try_unwrap(dev).ok().expect("writer dropped");
                let (r, _) = with_image(dev.into_durable(), |fs| {
                    verify_state(fs, std::slice::from_ref(state), false)
                });
                return r
                    .map(|_| Recovery::NoSpace)
                    .map_err(|e| format!("after running out of space: {e}"));
            }
            Err((what, e)) => return Err(format!("{what}: {e}")),
        }
    }
    let generation = w.commit().map_err(|e| format!("commit: {e}"))?;
    if generation <= state.generation {
        return Err(format!("committed generation {generation} after {}", state.generation));
    }
    let mut problems = Vec::new();
    let log = dev.log();
    check_ordering(&log, 0, log.len(), &referenced, "its transaction", &mut problems);
    if !problems.is_empty() {
        return Err(problems.join("; "));
    }
    drop(w);
    let want =
        CommitRec { generation, sb_first: None, done: None, model: Arc::new(wl.model.clone()) };
    let dev = Arc::try_unwrap(dev).ok().expect("writer dropped");
    let (r, _) =
        with_image(dev.into_durable(), |fs| verify_state(fs, std::slice::from_ref(&want), true));
    r.map_err(|e| format!("after its commit: {e}"))?;
    // A second power loss, during the recovery: at a random op and at the recovery's
    // first superblock write.
    let sb =
        log.iter().position(is_super_write).expect("the recovery commit wrote a superblock") as u64;
    let mut rng = Rng::new(mix_seed(seed, 2));
    let mut points = [rng.below(log.len() as u64 + 1), sb];
    points.sort_unstable();
    let pre = CommitRec {
        generation: state.generation,
        sb_first: None,
        done: None,
        model: state.model.clone(),
    };
    let mut sw = CrashSweep::new(before, log.clone(), 4096);
    let mut buf = Vec::new();
    for k in points {
        let loss = sw.image_at(k, mix_seed(seed, k), &mut buf);
        let ok: Vec<CommitRec> = if k < sb {
            vec![pre.clone()]
        } else if k as usize >= log.len() {
            vec![want.clone()]
        } else {
            vec![pre.clone(), want.clone()]
        };
        let (r, img) = with_image(std::mem::take(&mut buf), |fs| verify_state(fs, &ok, false));
        r.map_err(|e| format!("second power loss at recovery op {k} ({loss}): {e}"))?;
        buf = img;
    }
    Ok(Recovery::Committed)
}

// ---------------------------------------------------------------------------------
// The sweep

#[derive(Default)]
struct SweepStats {
    points: usize,
    write_points: usize,
    flush_points: usize,
    end_points: usize,
    btrfs_checks: usize,
    recoveries: usize,
    /// How many points showed the newer of two acceptable states.
    newer: usize,
    /// How many images had a bad primary superblock (read from another copy).
    sb_fallbacks: usize,
    /// Recoveries whose workload ran out of space (the disk was verified unchanged).
    recoveries_enospc: usize,
    /// Images loop-mounted with the kernel and compared with the model.
    kernel_mounts: usize,
    failures: Vec<String>,
}

struct SweepOpts {
    /// Test at most this many points (a seeded sample keeps every flush and
    /// superblock write); None = every point.
    max_points: Option<usize>,
    /// Run `btrfs check` on every n-th tested point.
    btrfs_every: usize,
    /// Recover (write + commit on top) at every n-th tested point.
    recover_every: usize,
    /// Torn-write granularity (bytes).
    unit: u64,
    /// Test only the superblock writes and the flushes around them.
    only_super: bool,
}

impl SweepOpts {
    fn ci() -> SweepOpts {
        SweepOpts {
            max_points: Some(250),
            btrfs_every: 50,
            recover_every: 25,
            unit: 4096,
            only_super: false,
        }
    }
}

fn crash_points(run: &Run, opts: &SweepOpts) -> Vec<u64> {
    if opts.only_super {
        let mut v = BTreeSet::new();
        for (i, r) in run.log.iter().enumerate() {
            if is_super_write(r) {
                v.extend([i as u64, i as u64 + 1]);
            }
        }
        return v.into_iter().collect();
    }
    let all: Vec<u64> = (0..=run.op_count()).collect();
    let Some(max) = opts.max_points.filter(|&m| m < all.len()) else { return all };
    let mut rng = Rng::new(mix_seed(run.seed, 0xc0ffee));
    // Flushes, superblock writes, the op after each and the end are always in.
    let mut keep: BTreeSet<u64> = BTreeSet::new();
    for (i, r) in run.log.iter().enumerate() {
        if r.is_flush() || is_super_write(r) {
            keep.insert(i as u64);
            keep.insert(i as u64 + 1);
        }
    }
    keep.insert(run.op_count());
    let rest: Vec<u64> = all.iter().copied().filter(|k| !keep.contains(k)).collect();
    let want = max.saturating_sub(keep.len());
    let mut rest = rest;
    rng.shuffle(&mut rest);
    keep.extend(rest.into_iter().take(want));
    keep.into_iter().collect()
}

fn sweep(run: &Run, opts: &SweepOpts) -> SweepStats {
    let mut st = SweepStats::default();
    let mut sw = CrashSweep::new(base_image().to_vec(), run.log.clone(), opts.unit);
    let mut buf = Vec::new();
    let points = crash_points(run, opts);
    for (n, &k) in points.iter().enumerate() {
        let seed = mix_seed(run.seed, k);
        let loss = sw.image_at(k, seed, &mut buf);
        st.points += 1;
        match run.log.get(k as usize) {
            Some(r) if r.is_write() => st.write_points += 1,
            Some(_) => st.flush_points += 1,
            None => st.end_points += 1,
        }
        let ok: Vec<CommitRec> =
            run.acceptable(k).into_iter().map(|i| run.commits[i].clone()).collect();
        let img = std::mem::take(&mut buf);
        let (r, img) = with_image(img, |fs| {
            catch(|| {
                let fallback = fs
                    .as_ref()
                    .map(|f| {
                        f.info
                            .take_warnings()
                            .iter()
                            .any(|w| w.contains("primary superblock is bad"))
                    })
                    .unwrap_or(false);
                verify_state(fs, &ok, true).map(|g| (g, fallback))
            })
        });
        let what = || {
            format!(
                "seed {} point {k}/{} ({}; {}; {loss})",
                run.seed,
                run.op_count(),
                op_name(run, k),
                run.step_at(k)
            )
        };
        let mut torn_primary = false;
        let shown = match r {
            Ok((g, fallback)) => {
                st.sb_fallbacks += usize::from(fallback);
                torn_primary = fallback;
                if ok.len() == 2 && g == ok[1].generation {
                    st.newer += 1;
                }
                ok.iter().find(|c| c.generation == g)
            }
            Err(e) => {
                keep_image(&img, &format!("seed{}-k{k}", run.seed));
                st.failures.push(format!("{}: {e}", what()));
                None
            }
        };
        // btrfs-progs reads only the primary superblock: a torn one (possible when the
        // atomic unit is below 4 KiB) is for `btrfs rescue super-recover`, so those
        // images are not given to it.
        if opts.btrfs_every > 0 && n % opts.btrfs_every == 0 && !torn_primary && kernel_oracle() {
            st.btrfs_checks += 1;
            if let Err(e) = btrfs_check(&img, &format!("seed{}-k{k}", run.seed)) {
                keep_image(&img, &format!("seed{}-k{k}-progs", run.seed));
                st.failures.push(format!("{}: {e}", what()));
            }
            // The kernel must see the same tree as the read engine did.
            if let Some(state) = shown.filter(|_| kernel_oracle()) {
                st.kernel_mounts += 1;
                let r = kernel_walk(&img, &format!("seed{}-k{k}", run.seed)).and_then(|km| {
                    let d = state.model.diff(&km, 8);
                    if d.is_empty() {
                        Ok(())
                    } else {
                        Err(format!(
                            "the kernel's view differs from generation {}:\n    {}",
                            state.generation,
                            d.join("\n    ")
                        ))
                    }
                });
                if let Err(e) = r {
                    keep_image(&img, &format!("seed{}-k{k}-kernel", run.seed));
                    st.failures.push(format!("{}: {e}", what()));
                }
            }
        }
        if opts.recover_every > 0 && n % opts.recover_every == opts.recover_every / 2 {
            // Recover from whichever acceptable state the image shows.
            if let Some(state) = shown {
                st.recoveries += 1;
                match catch(|| recover(img.clone(), state, mix_seed(seed, 7))) {
                    Ok(Recovery::Committed) => {}
                    Ok(Recovery::NoSpace) => st.recoveries_enospc += 1,
                    Err(e) => st
                        .failures
                        .push(format!("{}: writing on after the crash (recovery): {e}", what())),
                }
            }
        }
        buf = img;
    }
    st
}

/// Run `f`, turning a panic into an error (the message was printed by the hook).
fn catch<T>(f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "non-string panic".into());
            Err(format!("panicked: {msg}"))
        }
    }
}

fn op_name(run: &Run, k: u64) -> String {
    match run.log.get(k as usize) {
        Some(r) if is_super_write(r) => format!("superblock write {:?}", r.kind),
        Some(r) => format!("{:?}", r.kind),
        None => "after the last op".into(),
    }
}

/// Record, sweep and report one seed; the failures include the recording run's.
fn crash_seed(seed: u64, nops: usize, opts: &SweepOpts) -> SweepStats {
    let t = Instant::now();
    let run = match catch(|| Ok(record(seed, nops))) {
        Ok(r) => r,
        Err(e) => {
            return SweepStats {
                failures: vec![format!("seed {seed}: the recording run (no faults) failed: {e}")],
                ..Default::default()
            }
        }
    };
    let rec_time = t.elapsed();
    let mut st = sweep(&run, opts);
    eprintln!(
        "crash seed {seed} ({:?}, chunks {} -> {}): {nops} steps, {} commits, {} ops ({} writes, {} flushes); tested {} points ({} write, {} flush, {} end; {} showed the newer of two acceptable states, {} read a superblock copy), {} btrfs checks, {} kernel mounts, {} recoveries ({} out of space); {} failures{}; record {:.1}s, total {:.1}s",
        run.flavour,
        run.chunks.0,
        run.chunks.1,
        run.commits.len() - 1,
        run.op_count(),
        run.writes(),
        run.flushes(),
        st.points,
        st.write_points,
        st.flush_points,
        st.end_points,
        st.newer,
        st.sb_fallbacks,
        st.btrfs_checks,
        st.kernel_mounts,
        st.recoveries,
        st.recoveries_enospc,
        run.problems.len() + st.failures.len(),
        run.enospc.as_ref().map(|e| format!("; the run ran out of space at {e}")).unwrap_or_default(),
        rec_time.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    let mut all: Vec<String> = run.problems.iter().map(|p| format!("seed {seed}: {p}")).collect();
    all.append(&mut st.failures);
    st.failures = all;
    st
}

fn report(failures: Vec<String>) {
    if !failures.is_empty() {
        for f in &failures {
            eprintln!("FAILURE {f}");
        }
        let n = failures.len();
        let shown: Vec<String> = failures.into_iter().take(30).collect();
        panic!("{n} crash-consistency failures:\n  {}", shown.join("\n  "));
    }
}

// ---------------------------------------------------------------------------------
// Tests

/// The CI sweep: five seeds (plain with zstd and without compression, bitmaps with
/// lzo, and two heavy ones that allocate a data chunk, without compression and with
/// zlib; between them every kind of step, NODATACOW files among them), every flush and
/// superblock point and a seeded sample of the other writes (at most 250 points per
/// seed), `btrfs check` and the kernel's view on every 50th tested point, recovery on
/// every 25th. (The seeds are picked with `UBTRFS_CRASH_RECORD_ONLY`, which prints
/// what each seed's steps do; any change to the workload changes every seed's stream.)
#[test]
fn crash_sweep_ci() {
    let mut failures = Vec::new();
    for seed in [3, 4, 21, 71, 182] {
        failures.extend(crash_seed(seed, 30, &SweepOpts::ci()).failures);
    }
    report(failures);
}

/// Superblocks torn at 512-byte granularity (a disk with 512-byte atomic writes): a
/// torn primary copy fails its checksum and the read engine falls back to the second
/// copy, which holds the previous or the new generation; either is acceptable. (The
/// kernel and btrfs-progs read only the primary: such an image needs `btrfs rescue
/// super-recover` first, so `btrfs check` sees only the images with an intact one.)
#[test]
fn crash_torn_superblocks() {
    let opts = SweepOpts {
        max_points: None,
        btrfs_every: 6,
        recover_every: 4,
        unit: 512,
        only_super: true,
    };
    let mut failures = Vec::new();
    let mut fallbacks = 0;
    for seed in [6, 7] {
        let st = crash_seed(seed, 20, &opts);
        fallbacks += st.sb_fallbacks;
        failures.extend(st.failures);
    }
    report(failures);
    assert!(
        fallbacks > 0,
        "no image had a torn primary superblock: the fallback path went untested"
    );
}

/// Long runs: `UBTRFS_CRASH_SEEDS=N` (or `A-B`, or `a,b,c`), every point of every seed.
#[test]
fn crash_sweep_env() {
    let Ok(spec) = std::env::var("UBTRFS_CRASH_SEEDS") else {
        eprintln!("crash_sweep_env: set UBTRFS_CRASH_SEEDS (e.g. 100, 10-50, 3,7,9) for long runs");
        return;
    };
    let seeds: Vec<u64> = if let Some((a, b)) = spec.split_once('-') {
        (a.trim().parse().expect("seed range start")..b.trim().parse().expect("seed range end"))
            .collect()
    } else if spec.contains(',') {
        spec.split(',').map(|s| s.trim().parse().expect("seed")).collect()
    } else {
        (0..spec.trim().parse().expect("seed count")).collect()
    };
    let nops: usize =
        std::env::var("UBTRFS_CRASH_OPS").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
    if std::env::var_os("UBTRFS_CRASH_RECORD_ONLY").is_some() {
        for seed in seeds {
            let run = record(seed, nops);
            // What the steps did, by the first word of each part ("rename", "setxattr").
            let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
            for (_, what) in &run.steps {
                for part in what.split("; ") {
                    let mut k = part.split(' ').next().unwrap_or("").to_string();
                    if part.contains(" +C ") {
                        k.push_str(" +C");
                    }
                    *kinds
                        .entry(if part.contains(" as expected") {
                            format!("{k} (refused)")
                        } else {
                            k
                        })
                        .or_default() += 1;
                }
            }
            eprintln!(
                "seed {seed} ({:?}, {:?}): chunks {} -> {}, {} commits, {} ops, out of space: {:?}, problems {:?}, steps {kinds:?}",
                run.flavour,
                compress_of(seed).alg,
                run.chunks.0,
                run.chunks.1,
                run.commits.len() - 1,
                run.op_count(),
                run.enospc,
                run.problems
            );
        }
        return;
    }
    let unit = std::env::var("UBTRFS_CRASH_UNIT").ok().and_then(|s| s.parse().ok()).unwrap_or(4096);
    let opts =
        SweepOpts { max_points: None, btrfs_every: 50, recover_every: 10, unit, only_super: false };
    let t = Instant::now();
    let mut failures = Vec::new();
    for seed in seeds {
        failures.extend(crash_seed(seed, nops, &opts).failures);
    }
    eprintln!("crash_sweep_env: {:.1}s", t.elapsed().as_secs_f64());
    report(failures);
}

// ---------------------------------------------------------------------------------
// Live crashes: the writer itself meets the failing device

/// Run the workload with the power lost at op `k`: the writer must fail cleanly (an
/// `Io` error from the device, then nothing but errors), and the disk left behind must
/// show the last commit that returned Ok (or the failing commit, if it had already
/// written a superblock).
fn live_crash(seed: u64, nops: usize, k: u64) -> Result<(), String> {
    let dev = Arc::new(FaultyDevice::new(base_image().to_vec(), format!("live-{seed}")));
    dev.crash_at(k);
    let mut w = open_writer(dev.clone()).map_err(|e| format!("open: {e}"))?;
    let mut wl = Workload::new(seed, (*base_model()).clone(), "");
    wl.setup(&mut w);
    let generation = w.info.super_copy().generation.get();
    let mut last_ok = CommitRec { generation, sb_first: None, done: None, model: base_model() };
    let mut failed_commit: Option<CommitRec> = None;
    let mut until_commit = wl.rng.range(1, 5);
    let mut first_err: Option<(String, Error)> = None;
    for i in 0..nops {
        if let Err((what, e)) = wl.step(&mut w) {
            first_err = Some((what, e));
            break;
        }
        until_commit -= 1;
        if until_commit == 0 || (i + 1 == nops && seed.is_multiple_of(2)) {
            until_commit = wl.rng.range(1, 5);
            let before_ops = dev.op_count();
            // The generation this commit writes (the writer moves on to the next one
            // before the commit's I/O, so `w.transid` after a failure is one more).
            let committing = w.transid;
            match w.commit() {
                Ok(g) => {
                    if dev.op_count() > before_ops {
                        last_ok = CommitRec {
                            generation: g,
                            sb_first: None,
                            done: None,
                            model: Arc::new(wl.model.clone()),
                        };
                    }
                }
                Err(e) => {
                    // The failed commit's state counts if a superblock write was issued.
                    let log = dev.log();
                    if log[before_ops as usize..].iter().any(is_super_write) {
                        failed_commit = Some(CommitRec {
                            generation: committing,
                            sb_first: None,
                            done: None,
                            model: Arc::new(wl.model.clone()),
                        });
                    }
                    if w.check_writable().is_ok() {
                        return Err(format!("commit failed ({e}) but the writer is not aborted"));
                    }
                    first_err = Some(("commit".into(), e));
                    break;
                }
            }
        }
    }
    if k < dev.op_count() || dev.crashed() {
        let Some((what, e)) = &first_err else {
            return Err("the device lost power but no call failed".into());
        };
        let msg = e.to_string();
        if !matches!(e, Error::Io { .. }) || !msg.contains("injected power loss") {
            return Err(format!("{what}: first error is not the device's: {msg}"));
        }
        // Everything after fails; nothing panics.
        let top = wl.model.dir_ino(b"");
        if w.mkdir(FS_TREE, top, b"after-crash", &InodeAttrs::new(0o755)).is_ok()
            && w.commit().is_ok()
        {
            return Err("a commit succeeded after the power loss".into());
        }
    } else if let Some((what, e)) = first_err {
        return Err(format!("{what}: failed without a crash: {e}"));
    }
    let mut want = vec![last_ok];
    want.extend(failed_commit);
    for s in 0..2 {
        let (img, loss) = dev.crash_image_report(mix_seed(seed ^ k, s));
        let (r, _) = with_image(img, |fs| catch(|| verify_state(fs, &want, true)));
        r.map_err(|e| format!("crash image {s} ({loss}): {e}"))?;
    }
    Ok(())
}

/// Live crashes at a few points: every op of the tail of one commit (last writes,
/// flush, superblocks, final flush), and a sample of other points.
#[test]
fn crash_live_points() {
    let mut failures = Vec::new();
    let (seed, nops) = (5u64, 12);
    let run = record(seed, nops);
    let mut pts: BTreeSet<u64> = BTreeSet::new();
    if let Some(c) = run.commits.get(2).or(run.commits.get(1)) {
        let (s, d) = (c.sb_first.expect("real commit"), c.done.expect("real commit"));
        pts.extend(s.saturating_sub(2)..=d + 1);
    }
    let mut rng = Rng::new(seed);
    for _ in 0..4 {
        pts.insert(rng.below(run.op_count() + 1));
    }
    let n = pts.len();
    for k in pts {
        if let Err(e) = catch(|| live_crash(seed, nops, k)) {
            failures.push(format!(
                "seed {seed} live crash at op {k} ({}; {}): {e}",
                op_name(&run, k),
                run.step_at(k)
            ));
        }
    }
    eprintln!("live crashes: seed {seed}, {n} points, {} failures", failures.len());
    report(failures);
}

// ---------------------------------------------------------------------------------
// Failing flushes and writes with the device alive

/// A writer on a fresh copy of the fixture with some committed work (state A) and
/// some uncommitted work on top (model B).
fn setup_a_then_b(seed: u64) -> (Arc<FaultyDevice>, FsWriter, CommitRec, Workload) {
    let dev = Arc::new(FaultyDevice::new(base_image().to_vec(), format!("flush-{seed}")));
    let mut w = open_writer(dev.clone()).expect("open");
    let mut wl = Workload::new(seed, (*base_model()).clone(), "");
    wl.setup(&mut w);
    for _ in 0..4 {
        wl.step(&mut w).map_err(|(what, e)| format!("{what}: {e}")).expect("step");
    }
    let g = w.commit().expect("commit A");
    let a =
        CommitRec { generation: g, sb_first: None, done: None, model: Arc::new(wl.model.clone()) };
    // Make sure B changes something that must reach disk.
    let top = wl.model.dir_ino(b"");
    let ino = w.create_file(FS_TREE, top, b"in-b", &InodeAttrs::new(0o644)).expect("create");
    w.write_file(FS_TREE, ino, 0, &vec![0x5a; 50_000]).expect("write");
    let meta = wl.model.new_meta(b"", S_IFREG | 0o644);
    wl.model.meta.insert((FS_TREE, ino), meta);
    wl.model.entries.insert(b"in-b".to_vec(), Node::File { root: FS_TREE, ino });
    wl.model.files.insert((FS_TREE, ino), Arc::new(vec![0x5a; 50_000]));
    for _ in 0..3 {
        wl.step(&mut w).map_err(|(what, e)| format!("{what}: {e}")).expect("step");
    }
    (dev, w, a, wl)
}

fn assert_aborted_naming(w: &mut FsWriter, needle: &str) {
    let e = w.check_writable().expect_err("the writer must be aborted");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{e}");
    assert!(e.to_string().contains(needle), "read-only error does not name the failure: {e}");
    let top = FIRST_FREE_OBJECTID;
    let e = w.mkdir(FS_TREE, top, b"late", &InodeAttrs::new(0o755)).expect_err("mkdir after abort");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{e}");
    assert!(e.to_string().contains(needle), "{e}");
    let e = w
        .create_file(FS_TREE, top, b"late", &InodeAttrs::new(0o644))
        .expect_err("create after abort");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{e}");
    let e = w.write_file(FS_TREE, top, 0, b"x").expect_err("write after abort");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{e}");
    let e = w.unlink(FS_TREE, top, b"nothing").expect_err("unlink after abort");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{e}");
    let e = w.commit().expect_err("commit after abort");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly), "{e}");
    assert!(e.to_string().contains(needle), "{e}");
}

fn verify_images(dev: &FaultyDevice, want: &[CommitRec], what: &str) {
    let (r, _) = with_image(dev.current_image(), |fs| verify_state(fs, want, true));
    r.unwrap_or_else(|e| panic!("{what}: image as reads see it: {e}"));
    for s in 0..4 {
        let (img, loss) = dev.crash_image_report(s);
        let (r, _) = with_image(img, |fs| verify_state(fs, want, s == 0));
        r.unwrap_or_else(|e| panic!("{what}: crash image {s} ({loss}): {e}"));
    }
}

/// The flush before the superblocks fails: the commit errors, the writer is aborted
/// (later calls get a read-only error naming the flush failure), no superblock is
/// written, and the disk shows state A whatever happens to the unflushed writes.
#[test]
fn failing_flush_before_superblocks() {
    let (dev, mut w, a, _) = setup_a_then_b(21);
    let before = dev.op_count() as usize;
    dev.fail_next_flush(0);
    let e = w.commit().expect_err("commit with a failing flush");
    assert!(e.to_string().contains("injected flush failure"), "{e}");
    assert_aborted_naming(&mut w, "injected flush failure");
    let log = dev.log();
    assert!(
        !log[before..].iter().any(is_super_write),
        "a superblock was written after the flush failed"
    );
    assert_eq!(
        log.last().map(|r| r.outcome),
        Some(OpOutcome::Failed),
        "nothing is issued after the failed flush"
    );
    drop(w);
    verify_images(&dev, std::slice::from_ref(&a), "flush before superblocks failed");
    // A new writer (a remount) on the surviving disk works and commits.
    let r = recover(dev.crash_image(9), &a, 99)
        .unwrap_or_else(|e| panic!("recovery after a failed flush: {e}"));
    assert_eq!(r, Recovery::Committed);
}

/// The flush after the superblocks fails: the commit errors and the writer is aborted;
/// the superblocks were issued, so the disk shows A or the new state B (the caller
/// cannot know which, as with the kernel), never anything else.
#[test]
fn failing_flush_after_superblocks() {
    let (dev, mut w, a, wl) = setup_a_then_b(22);
    let before = dev.op_count() as usize;
    dev.fail_next_flush(1);
    let e = w.commit().expect_err("commit with a failing superblock flush");
    assert!(e.to_string().contains("injected flush failure"), "{e}");
    let b = CommitRec {
        generation: a.generation + 1,
        sb_first: None,
        done: None,
        model: Arc::new(wl.model.clone()),
    };
    assert_aborted_naming(&mut w, "injected flush failure");
    let log = dev.log();
    assert!(
        log[before..].iter().any(is_super_write),
        "the superblocks were written before the failing flush"
    );
    drop(w);
    verify_images(&dev, &[a, b], "flush after superblocks failed");
}

/// A superblock write fails: the commit errors and the writer is aborted. When the
/// primary copy fails nothing of the new superblock is on disk (state A); when the
/// second copy fails the primary may be (A or B).
#[test]
fn failing_superblock_write() {
    for (mirror, seed) in [(0usize, 23u64), (1, 24)] {
        let (dev, mut w, a, wl) = setup_a_then_b(seed);
        dev.fail_next_write_to(sb_offset(mirror));
        let e = w.commit().expect_err("commit with a failing superblock write");
        assert!(e.to_string().contains("injected write failure"), "{e}");
        assert_aborted_naming(&mut w, "injected write failure");
        drop(w);
        let mut want = vec![a.clone()];
        if mirror > 0 {
            want.push(CommitRec {
                generation: a.generation + 1,
                sb_first: None,
                done: None,
                model: Arc::new(wl.model.clone()),
            });
        }
        verify_images(&dev, &want, &format!("superblock copy {mirror} write failed"));
    }
}

/// A data write inside `write_file` fails. Run in a transaction handle, as the write engine's
/// rules ask of a caller, the writer is aborted and the disk keeps state A.
#[test]
fn failing_data_write_guarded() {
    let (dev, mut w, a, _) = setup_a_then_b(25);
    let top = FIRST_FREE_OBJECTID;
    let ino = w.create_file(FS_TREE, top, b"big-one", &InodeAttrs::new(0o644)).expect("create");
    dev.fail_next_write(0);
    let e = w
        .transaction("write_file", 0, |w| w.write_file(FS_TREE, ino, 0, &vec![7u8; 300_000]))
        .expect_err("failing data write");
    assert!(e.to_string().contains("injected write failure"), "{e}");
    assert_aborted_naming(&mut w, "injected write failure");
    drop(w);
    verify_images(&dev, &[a], "data write failed");
}

// ---------------------------------------------------------------------------------
// Bit flips on reads

/// Reads that flip bits (one read in `one_in`) on a fixture with DUP data and
/// metadata: the read engine must return either the right bytes or an error (checksum
/// mismatch on both copies), never wrong bytes, and never panic.
#[test]
fn read_bit_flips_never_return_wrong_data() {
    let img = std::fs::read(&common::fixture_images("dup-data")[0]).expect("fixture");
    let clean = {
        let (m, _) = with_image(img.clone(), |fs| walk(&fs.expect("open")).expect("walk"));
        m
    };
    let (mut ok, mut errs, mut flips) = (0, 0, 0);
    for seed in 0..12u64 {
        let dev = Arc::new(FaultyDevice::new(img.clone(), "flips"));
        dev.flip_read_bits(seed, 6);
        let r = catch(|| {
            let fs = open_info(dev.clone())
                .and_then(Filesystem::from_info)
                .map_err(|e| format!("open: {e}"))?;
            walk(&fs)
        });
        match r {
            Ok(m) => {
                let d = clean.diff(&m, 8);
                assert!(
                    d.is_empty(),
                    "seed {seed}: a walk with bit flips returned wrong data ({} flips):\n  {}",
                    dev.flips(),
                    d.join("\n  ")
                );
                ok += 1;
            }
            Err(e) => {
                assert!(!e.contains("panicked"), "seed {seed}: {e}");
                // Only when both copies of something were hit (1 in 36 per pair).
                assert!(
                    e.contains("checksum mismatch") || e.contains("csum"),
                    "seed {seed}: unexpected error kind: {e}"
                );
                errs += 1;
            }
        }
        flips += dev.flips();
    }
    eprintln!("read bit flips: {flips} flips; {ok} clean walks, {errs} walks ending in a reported checksum error");
    assert!(flips > 12, "too few flips to mean anything: {flips}");
    assert!(ok > 0, "DUP should survive most single flips");
}

/// A read-modify-write of a partly overwritten sector reads the old data through the
/// write path; a flipped bit there must not be baked into the new extent under a fresh
/// checksum (the kernel verifies the csum of what it reads back).
#[test]
fn rmw_read_is_verified() {
    let dev = Arc::new(FaultyDevice::new(base_image().to_vec(), "rmw"));
    let mut w = open_writer(dev.clone()).expect("open");
    let top = FIRST_FREE_OBJECTID;
    let ino = w.create_file(FS_TREE, top, b"rmw", &InodeAttrs::new(0o644)).expect("create");
    let data: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    w.write_file(FS_TREE, ino, 0, &data).expect("write");
    w.commit().expect("commit");
    // Tree blocks are in the node cache after the commit; the next device reads are
    // the data reads of the read-modify-write. Flip a bit in every one of them.
    dev.flip_read_bits(1, 1);
    let r = w.write_file(FS_TREE, ino, 5000, b"0123456789");
    dev.stop_flipping();
    if r.is_err() {
        return; // detected: fine
    }
    w.commit().expect("commit");
    drop(w);
    let mut want = data.clone();
    want[5000..5010].copy_from_slice(b"0123456789");
    let dev = Arc::try_unwrap(dev).ok().expect("writer dropped");
    let (got, _) = with_image(dev.into_durable(), |fs| {
        let fs = fs.expect("open");
        let v = fs.resolve("/rmw", false).expect("resolve");
        let mut buf = vec![0u8; v.size() as usize];
        fs.read_at(&v, 0, &mut buf).map(|_| buf)
    });
    let got = got.expect("the file reads back (its new csums match its new, wrong bytes)");
    let first = got.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(first, None, "a bit flipped while reading old data was written into the new extent");
}

/// A data write inside `write_file` fails and the caller does not guard: the engine's
/// rule (a failure after a change has begun turns the filesystem read-only at the
/// failing line) means `write_file` aborts by itself, so no later commit can persist a
/// half-done write.
#[test]
fn failing_data_write_unguarded() {
    for (seed, overwrite) in [(26u64, false), (27, true)] {
        let (dev, mut w, a, wl) = setup_a_then_b(seed);
        let top = FIRST_FREE_OBJECTID;
        let ino = if overwrite {
            // Overwrite the middle of a committed file: old extents are dropped first.
            match wl.model.entries.get(b"in-b".as_slice()) {
                Some(Node::File { ino, .. }) => *ino,
                n => panic!("in-b: {n:?}"),
            }
        } else {
            w.create_file(FS_TREE, top, b"big-one", &InodeAttrs::new(0o644)).expect("create")
        };
        dev.fail_next_write(0);
        let e =
            w.write_file(FS_TREE, ino, 4096, &vec![7u8; 300_000]).expect_err("failing data write");
        assert!(e.to_string().contains("injected write failure"), "{e}");
        let aborted = w.check_writable().is_err();
        let committed = if aborted { None } else { Some(w.commit()) };
        drop(w);
        if let Some(c) = committed {
            let (r, _) = with_image(dev.current_image(), |fs| {
                let fs = fs.expect("open");
                check(&fs.info, &CheckOptions::default())
                    .map(|r| r.findings.iter().take(6).map(|f| f.to_string()).collect::<Vec<_>>())
            });
            panic!("seed {seed}: write_file failed but the writer was not aborted; the commit after it returned {c:?}; check of the result: {r:?}");
        }
        verify_images(&dev, &[a], "unguarded data write failed");
    }
}

/// Seeds reproduce: the same seed issues the same operations (offsets, lengths,
/// flushes) in the same order, so a failing seed and crash point can be rerun. Only
/// the bytes differ (inode times).
#[test]
fn recording_is_deterministic() {
    let a = record(8, 10);
    let b = record(8, 10);
    let kinds = |r: &Run| r.log.iter().map(|o| o.kind).collect::<Vec<_>>();
    assert_eq!(kinds(&a), kinds(&b), "seed 8 issued different operations in two runs");
    assert_eq!(
        a.commits.iter().map(|c| (c.generation, c.sb_first, c.done)).collect::<Vec<_>>(),
        b.commits.iter().map(|c| (c.generation, c.sb_first, c.done)).collect::<Vec<_>>()
    );
}
