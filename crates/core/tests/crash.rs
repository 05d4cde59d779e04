//! Crash consistency of the write engine, driven through `fault::FaultyDevice`.
//!
//! A seeded random workload (mkdir, file creates with data of random sizes, bursts of
//! small files, overwrites, hard links, unlinks and emptying of directories, on new and
//! on kernel-made files, with a commit every few operations) runs once on a copy of a
//! kernel-made fixture while the device records every write and flush. The run keeps
//! an in-memory model of the whole tree after every commit. Then, for every write and
//! flush point `k` of the run (or a seeded sample), the image a power loss at `k`
//! leaves (`CrashSweep`: unflushed writes dropped or kept, reordered, one possibly
//! torn) is reopened with the read engine and must show exactly the state of the last
//! commit whose superblock write and flush completed before `k` (when `k` falls inside
//! a commit's superblock writes, that commit's state or the previous one). The whole
//! tree is compared (paths, kinds, inode numbers, sizes, contents, symlink targets,
//! directory sizes, link counts, DIR_ITEM against DIR_INDEX); the image must pass
//! `ubtrfs_tools::check::check`; a sample must pass `btrfs check --readonly` and, loop
//! mounted read-only, show the kernel the same tree (as root);
//! and on a sample the post-crash image is reopened for writing, written to,
//! committed and verified again (recovery), then crashed again during that recovery.
//!
//! Besides the sweep, the run's log is checked directly for the two ordering rules a
//! commit relies on: no superblock write while a tree-block or data write is unflushed,
//! and no write between two commits into space the last commit references.
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

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use ubtrfs_core::inode::filesystem::{FileKind, Filesystem, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::transaction::FsWriter;
use ubtrfs_core::volumes::device::{BlockDevice, MemDevice};
use ubtrfs_core::volumes::fault::{mix_seed, CrashSweep, FaultyDevice, OpKind, OpOutcome, OpRecord, Rng};
use ubtrfs_core::FsRead;
use ubtrfs_core::TreeView;
use ubtrfs_core::{Error, FsInfo, PosixKind};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use ubtrfs_tools::check::{check, CheckOptions};

/// Single device, SINGLE data and DUP metadata, skinny metadata, free-space tree: a
/// layout `FsWriter` accepts (`mixed` is refused: mixed block groups).
const FIXTURE: &str = "blake2";
const FS_TREE: u64 = FS_TREE_OBJECTID;
const CACHE: usize = 16 << 20;

// ---------------------------------------------------------------------------------
// Fixture and devices

fn base_image() -> Arc<Vec<u8>> {
    static BASE: OnceLock<Arc<Vec<u8>>> = OnceLock::new();
    BASE.get_or_init(|| Arc::new(std::fs::read(&common::fixture_images(FIXTURE)[0]).expect("read fixture image"))).clone()
}

fn open_info(dev: Arc<dyn BlockDevice>) -> ubtrfs_core::Result<FsInfo> {
    FsInfo::open_devices(vec![dev], CACHE)
}

fn open_writer(dev: Arc<dyn BlockDevice>) -> ubtrfs_core::Result<FsWriter> {
    FsWriter::from_info(open_info(dev)?)
}

/// Run `f` on a read engine over `img`, then give the image back.
fn with_image<T>(img: Vec<u8>, f: impl FnOnce(ubtrfs_core::Result<Filesystem>) -> T) -> (T, Vec<u8>) {
    let dev = Arc::new(MemDevice::new(img, "crash-image"));
    let r = f(open_info(dev.clone()).and_then(Filesystem::from_info));
    let img = Arc::try_unwrap(dev).ok().expect("the filesystem was dropped").into_inner();
    (r, img)
}

fn is_super_write(r: &OpRecord) -> bool {
    match r.kind {
        OpKind::Write { offset, len } => len == SUPER_INFO_SIZE as u64 && (0..SUPER_MIRROR_MAX).any(|m| sb_offset(m) == offset),
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

/// Paths (bytes, `/`-joined, "" for the top) and file contents by (root, ino).
#[derive(Clone, Default, PartialEq, Eq)]
struct Model {
    entries: BTreeMap<Vec<u8>, Node>,
    files: BTreeMap<(u64, u64), Arc<Vec<u8>>>,
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

    /// Every difference between `self` (expected) and `got`, at most `max`.
    fn diff(&self, got: &Model, max: usize) -> Vec<String> {
        let mut out = Vec::new();
        let keys: BTreeSet<&Vec<u8>> = self.entries.keys().chain(got.entries.keys()).collect();
        for p in keys {
            if out.len() >= max {
                out.push("...".into());
                break;
            }
            match (self.entries.get(p), got.entries.get(p)) {
                (Some(e), None) => out.push(format!("{} missing (expected {e:?})", show(p))),
                (None, Some(g)) => out.push(format!("{} unexpected ({g:?})", show(p))),
                (Some(e), Some(g)) if e != g => out.push(format!("{}: expected {e:?}, found {g:?}", show(p))),
                (Some(Node::File { root, ino }), Some(_)) => {
                    let (a, b) = (&self.files[&(*root, *ino)], &got.files[&(*root, *ino)]);
                    if a != b {
                        let first = a.iter().zip(b.iter()).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()));
                        out.push(format!("{}: content differs: expected {} bytes, found {}; first difference at byte {first}", show(p), a.len(), b.len()));
                    }
                }
                _ => {}
            }
        }
        out
    }
}

/// Read the whole tree through the read engine, checking as it goes that the image
/// agrees with itself (DIR_ITEM vs DIR_INDEX, directory sizes, link counts, file sizes).
fn walk(fs: &Filesystem) -> Result<Model, String> {
    let e = |what: String| move |err: Error| format!("{what}: {err}");
    let mut m = Model::default();
    let top = fs.root_dir();
    m.entries.insert(Vec::new(), Node::Dir { root: top.root, ino: top.ino });
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
                other => return Err(format!("{}: DIR_INDEX says {:?}, DIR_ITEM lookup says {:?}", show(&p), de.target, other.map(|l| l.target))),
            }
            let iv = fs.load_inode(de.target, Load { extents: true, ..Load::ITEM }).map_err(e(format!("{} stat", show(&p))))?;
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
                return Err(format!("{}: dir entry type {} but inode mode {:o}", show(&p), de.ftype, iv.mode()));
            }
            let id = de.target;
            let node = match iv.kind() {
                FileKind::Dir => {
                    stack.push((p.clone(), id));
                    Node::Dir { root: id.root, ino: id.ino }
                }
                FileKind::File => {
                    let n = nlinks.entry((id.root, id.ino)).or_insert((iv.nlink(), 0));
                    n.1 += 1;
                    if let std::collections::btree_map::Entry::Vacant(slot) = m.files.entry((id.root, id.ino)) {
                        let size = usize::try_from(iv.size()).map_err(|_| format!("{}: size {}", show(&p), iv.size()))?;
                        if size > 256 << 20 {
                            return Err(format!("{}: implausible size {size}", show(&p)));
                        }
                        let mut buf = vec![0u8; size];
                        let got = fs.read_at(&iv, 0, &mut buf).map_err(e(format!("{} read", show(&p))))?;
                        if got != size {
                            return Err(format!("{}: read {got} of {size} bytes", show(&p)));
                        }
                        slot.insert(Arc::new(buf));
                    }
                    Node::File { root: id.root, ino: id.ino }
                }
                FileKind::Symlink => Node::Symlink { ino: id.ino, target: fs.readlink(id).map_err(e(format!("{} readlink", show(&p))))? },
                k => Node::Special { ino: id.ino, kind: k },
            };
            m.entries.insert(p, node);
        }
        if dv.size() != name_bytes {
            return Err(format!("{}: directory size {} but its entries' names sum to {name_bytes} (x2)", show(&path), dv.size()));
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
        let (m, _) = with_image(base_image().to_vec(), |fs| walk(&fs.expect("open fixture")).expect("walk fixture"));
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

/// Random operations applied to a writer and to the model in step.
struct Workload {
    flavour: Flavour,
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
        Workload { flavour: Flavour::of(seed), rng: Rng::new(seed), model, prefix, next_name: 0, fixture_paths }
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
        let new: Vec<(Vec<u8>, u64)> = all.iter().filter(|(p, _)| !self.fixture_paths.contains(p)).cloned().collect();
        let from = if !new.is_empty() && self.rng.chance(3, 4) { new } else { all };
        (!from.is_empty()).then(|| from[self.rng.below(from.len() as u64) as usize].clone())
    }

    /// Do one random operation. Returns a description, or the failing call and error.
    fn step(&mut self, w: &mut FsWriter) -> Result<String, (String, Error)> {
        match self.rng.below(100) {
            10..=14 => {
                // A burst of small files in one directory: leaves split, the tree grows.
                let (dir, dino) = self.pick_dir();
                let n = self.rng.range(10, 120);
                let what = format!("burst of {n} small files in {}", show(&dir));
                for _ in 0..n {
                    let name = self.name("s");
                    let size = self.rng.range(0, 300) as usize;
                    let data = random_bytes(&mut self.rng, size);
                    let ino = w.create_file(FS_TREE, dino, &name, &InodeAttrs::new(0o600)).map_err(|e| (what.clone(), e))?;
                    self.model.entries.insert(join(&dir, &name), Node::File { root: FS_TREE, ino });
                    self.model.files.insert((FS_TREE, ino), Arc::new(Vec::new()));
                    w.write_file(FS_TREE, ino, 0, &data).map_err(|e| (what.clone(), e))?;
                    self.model.files.insert((FS_TREE, ino), Arc::new(data));
                }
                Ok(what)
            }
            0..=9 => {
                let (dir, dino) = self.pick_dir();
                let name = self.name("d");
                let what = format!("mkdir {}", show(&join(&dir, &name)));
                let ino = w.mkdir(FS_TREE, dino, &name, &InodeAttrs::new(0o755)).map_err(|e| (what.clone(), e))?;
                self.model.entries.insert(join(&dir, &name), Node::Dir { root: FS_TREE, ino });
                Ok(what)
            }
            15..=54 => {
                let (dir, dino) = self.pick_dir();
                let name = self.name("f");
                let size = pick_size(&mut self.rng, self.flavour);
                let data = random_bytes(&mut self.rng, size);
                let what = format!("create {} size {size}", show(&join(&dir, &name)));
                let ino = w.create_file(FS_TREE, dino, &name, &InodeAttrs::new(0o644)).map_err(|e| (what.clone(), e))?;
                self.model.entries.insert(join(&dir, &name), Node::File { root: FS_TREE, ino });
                self.model.files.insert((FS_TREE, ino), Arc::new(Vec::new()));
                w.write_file(FS_TREE, ino, 0, &data).map_err(|e| (what.clone(), e))?;
                self.model.files.insert((FS_TREE, ino), Arc::new(data));
                Ok(what)
            }
            55..=79 => {
                let Some((path, ino)) = self.pick_file() else { return Ok("overwrite: no file".into()) };
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
                let f = Arc::make_mut(self.model.files.get_mut(&(FS_TREE, ino)).expect("file in model"));
                let end = off as usize + len;
                if f.len() < end {
                    f.resize(end, 0);
                }
                f[off as usize..end].copy_from_slice(&data);
                Ok(what)
            }
            80..=84 => {
                // Empty a directory of its files and empty subdirectories: leaves
                // merge, the tree shrinks.
                let (dir, dino) = self.pick_dir();
                let victims: Vec<Vec<u8>> = self
                    .model
                    .entries
                    .iter()
                    .filter(|(p, n)| !p.is_empty() && split_parent(p).0 == dir.as_slice() && !matches!(n, Node::Dir { .. } if self.model.children(p) > 0))
                    .map(|(p, _)| p.clone())
                    .collect();
                let what = format!("empty {} ({} entries)", show(&dir), victims.len());
                for path in victims {
                    let (_, name) = split_parent(&path);
                    let r = if matches!(self.model.entries.get(&path), Some(Node::Dir { .. })) { w.rmdir(FS_TREE, dino, name) } else { w.unlink(FS_TREE, dino, name) };
                    r.map_err(|e| (format!("{what}: unlink {}", show(&path)), e))?;
                    self.forget(&path);
                }
                Ok(what)
            }
            85..=89 => {
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
                let new: Vec<Vec<u8>> = cands.iter().filter(|p| !self.fixture_paths.contains(*p)).cloned().collect();
                let from = if !new.is_empty() && self.rng.chance(3, 4) { new } else { cands };
                if from.is_empty() {
                    return Ok("unlink: nothing".into());
                }
                let path = from[self.rng.below(from.len() as u64) as usize].clone();
                let (dir, name) = split_parent(&path);
                let dino = self.model.dir_ino(dir);
                let what = format!("unlink {}", show(&path));
                let r = if matches!(self.model.entries.get(&path), Some(Node::Dir { .. })) { w.rmdir(FS_TREE, dino, name) } else { w.unlink(FS_TREE, dino, name) };
                r.map_err(|e| (what.clone(), e))?;
                self.forget(&path);
                Ok(what)
            }
        }
    }

    /// Drop an unlinked path from the model (and the file, at its last name).
    fn forget(&mut self, path: &[u8]) {
        let node = self.model.entries.remove(path).expect("unlinked path was in the model");
        if let Node::File { root, ino } = node {
            if !self.model.entries.values().any(|n| *n == node) {
                self.model.files.remove(&(root, ino));
            }
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
        let j = self.commits.iter().rposition(|c| c.done.is_none_or(|d| d < k)).expect("the fixture state is always committed");
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
        let c = info.chunk_map.lookup(l)?.clone();
        for m in 0..c.num_copies() {
            let mut done = 0;
            while done < len {
                let (_, phys, contig) = c.map(l + done, m);
                let n = (len - done).min(contig);
                out.push((phys, phys + n));
                done += n;
            }
        }
    }
    out.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::new();
    for (s, e) in out {
        match merged.last_mut() {
            Some(l) if s <= l.1 => l.1 = l.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    Ok(merged)
}

fn overlaps(ranges: &[(u64, u64)], s: u64, e: u64) -> Option<(u64, u64)> {
    let i = ranges.partition_point(|r| r.1 <= s);
    ranges.get(i).filter(|r| r.0 < e).copied()
}

/// Check the two ordering rules on `log[from..to]`, given the ranges the committed
/// state at `from` references: no non-superblock write may land in them, and no
/// superblock may be written while a non-superblock write is unflushed.
fn check_ordering(log: &[OpRecord], from: usize, to: usize, referenced: &[(u64, u64)], what: &str, problems: &mut Vec<String>) {
    let mut unflushed: Option<u64> = None;
    for (i, r) in log.iter().enumerate().take(to).skip(from) {
        match r.kind {
            OpKind::Flush if r.outcome == OpOutcome::Ok => unflushed = None,
            OpKind::Flush => {}
            OpKind::Write { offset, len } => {
                if is_super_write(r) {
                    if let Some(w) = unflushed {
                        problems.push(format!("{what}: superblock write at op {i} while write op {w} is not flushed"));
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
    wl.flavour.apply(&mut w);
    // Odd seeds write metadata back between operations (a dirty limit of two blocks):
    // a crash must still show exactly the last commit, never a block written early.
    if seed % 2 == 1 {
        w.set_dirty_metadata_limit(2 * w.nodesize() as usize);
    }
    let mut run = Run { seed, log: Vec::new(), commits: Vec::new(), steps: Vec::new(), problems: Vec::new(), flavour: wl.flavour, chunks: (w.info.chunk_map.len(), 0), enospc: None };
    run.commits.push(CommitRec { generation: w.info.super_copy().generation.get(), sb_first: None, done: None, model: base_model() });
    let mut referenced = referenced_ranges(&w.info).expect("fixture extents");
    let mut interval_start = 0usize;
    let mut until_commit = wl.rng.range(1, 5);
    for i in 0..nops {
        let start = dev.op_count();
        match wl.step(&mut w) {
            Ok(what) => run.steps.push((start, what)),
            Err((what, e)) if e.posix_kind() == Some(PosixKind::NoSpace) => {
                // A full filesystem is a legitimate end of the run; what was committed
                // so far is swept as usual, the rest is an uncommitted tail.
                run.enospc = Some(format!("step {i} {what}: {e} (writer aborted: {})", w.check_writable().is_err()));
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
            let generation = w.commit().unwrap_or_else(|e| panic!("seed {seed}: commit after step {i}: {e}"));
            let log = dev.log();
            let after = log.len();
            if after == before as usize {
                continue;
            }
            let sb_first = (before as usize..after).find(|&o| is_super_write(&log[o])).unwrap_or_else(|| panic!("seed {seed}: commit {generation} wrote no superblock"));
            assert!(log[after - 1].is_flush(), "seed {seed}: commit {generation} does not end with a flush");
            if let Some(o) = (sb_first..after).find(|&o| !is_super_write(&log[o]) && log[o].is_write()) {
                run.problems.push(format!("commit {generation}: write op {o} after the first superblock write {sb_first}"));
            }
            check_ordering(&log, interval_start, after, &referenced, &format!("transaction {generation}"), &mut run.problems);
            run.steps.push((before, format!("commit {generation}")));
            run.commits.push(CommitRec { generation, sb_first: Some(sb_first as u64), done: Some(after as u64 - 1), model: Arc::new(wl.model.clone()) });
            // Reads see the durable state now (nothing is pending after the flush).
            assert!(dev.pending_ops().is_empty(), "seed {seed}: writes pending after commit {generation}");
            let info = open_info(dev.clone()).expect("open after commit");
            referenced = referenced_ranges(&info).expect("extents after commit");
            interval_start = after;
        }
    }
    // Uncommitted tail: its writes must not touch committed space either.
    let log = dev.log();
    check_ordering(&log, interval_start, log.len(), &referenced, "uncommitted tail", &mut run.problems);
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
fn verify_state(fs: ubtrfs_core::Result<Filesystem>, want: &[CommitRec], run_check: bool) -> Result<u64, String> {
    let fs = fs.map_err(|e| format!("open: {e}"))?;
    let generation = fs.info.super_copy().generation.get();
    let Some(rec) = want.iter().find(|c| c.generation == generation) else {
        return Err(format!("shows generation {generation}, expected {:?}", want.iter().map(|c| c.generation).collect::<Vec<_>>()));
    };
    let got = walk(&fs)?;
    let d = rec.model.diff(&got, 8);
    if !d.is_empty() {
        return Err(format!("generation {generation} differs from its commit:\n    {}", d.join("\n    ")));
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
    let o = std::process::Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&path).output().map_err(|e| format!("run btrfs check: {e}"))?;
    std::fs::remove_file(&path).ok();
    if o.status.success() {
        Ok(())
    } else {
        let out = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
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
    let base = std::env::temp_dir().join(format!("ubtrfs-crash-kernel-{tag}-{}", std::process::id()));
    let (file, mnt) = (base.with_extension("img"), base.with_extension("mnt"));
    std::fs::write(&file, img).map_err(|e| format!("write {}: {e}", file.display()))?;
    std::fs::create_dir_all(&mnt).map_err(|e| format!("mkdir {}: {e}", mnt.display()))?;
    let out = std::process::Command::new("mount").args(["-t", "btrfs", "-o", "ro,loop"]).arg(&file).arg(&mnt).output().map_err(|e| format!("run mount: {e}"))?;
    let r = if !out.status.success() {
        Err(format!("kernel mount failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
    } else {
        let mut m = Model::default();
        let walked = (|| -> std::io::Result<()> {
            let top = std::fs::symlink_metadata(&mnt)?;
            m.entries.insert(Vec::new(), Node::Dir { root: FS_TREE, ino: top.ino() });
            let mut stack = vec![(Vec::new(), mnt.clone())];
            while let Some((rel, dir)) = stack.pop() {
                for e in std::fs::read_dir(&dir)? {
                    let e = e?;
                    let p = join(&rel, e.file_name().as_bytes());
                    let md = e.path().symlink_metadata()?;
                    let ft = md.file_type();
                    let node = if ft.is_dir() {
                        stack.push((p.clone(), e.path()));
                        Node::Dir { root: FS_TREE, ino: md.ino() }
                    } else if ft.is_file() {
                        if let std::collections::btree_map::Entry::Vacant(v) = m.files.entry((FS_TREE, md.ino())) {
                            v.insert(Arc::new(std::fs::read(e.path())?));
                        }
                        Node::File { root: FS_TREE, ino: md.ino() }
                    } else if ft.is_symlink() {
                        Node::Symlink { ino: md.ino(), target: std::fs::read_link(e.path())?.as_os_str().as_bytes().to_vec() }
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
    let referenced = referenced_ranges(&open_info(dev.clone()).map_err(|e| format!("open: {e}"))?).map_err(|e| format!("extents: {e}"))?;
    let mut w = open_writer(dev.clone()).map_err(|e| format!("open for writing: {e}"))?;
    let mut wl = Workload::new(seed, (*state.model).clone(), "r");
    wl.flavour.apply(&mut w);
    for _ in 0..wl.rng.range(2, 6) {
        match wl.step(&mut w) {
            Ok(_) => {}
            Err((_, e)) if e.posix_kind() == Some(PosixKind::NoSpace) => {
                // Out of space: nothing of the recovery may have reached the disk's
                // committed state.
                drop(w);
                let dev = Arc::try_unwrap(dev).ok().expect("writer dropped");
                let (r, _) = with_image(dev.into_durable(), |fs| verify_state(fs, std::slice::from_ref(state), false));
                return r.map(|_| Recovery::NoSpace).map_err(|e| format!("after running out of space: {e}"));
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
    let want = CommitRec { generation, sb_first: None, done: None, model: Arc::new(wl.model.clone()) };
    let dev = Arc::try_unwrap(dev).ok().expect("writer dropped");
    let (r, _) = with_image(dev.into_durable(), |fs| verify_state(fs, std::slice::from_ref(&want), true));
    r.map_err(|e| format!("after its commit: {e}"))?;
    // A second power loss, during the recovery: at a random op and at the recovery's
    // first superblock write.
    let sb = log.iter().position(is_super_write).expect("the recovery commit wrote a superblock") as u64;
    let mut rng = Rng::new(mix_seed(seed, 2));
    let mut points = [rng.below(log.len() as u64 + 1), sb];
    points.sort_unstable();
    let pre = CommitRec { generation: state.generation, sb_first: None, done: None, model: state.model.clone() };
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
        SweepOpts { max_points: Some(250), btrfs_every: 50, recover_every: 25, unit: 4096, only_super: false }
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
        let ok: Vec<CommitRec> = run.acceptable(k).into_iter().map(|i| run.commits[i].clone()).collect();
        let img = std::mem::take(&mut buf);
        let (r, img) = with_image(img, |fs| {
            catch(|| {
                let fallback = fs.as_ref().map(|f| f.info.take_warnings().iter().any(|w| w.contains("primary superblock is bad"))).unwrap_or(false);
                verify_state(fs, &ok, true).map(|g| (g, fallback))
            })
        });
        let what = || format!("seed {} point {k}/{} ({}; {}; {loss})", run.seed, run.op_count(), op_name(run, k), run.step_at(k));
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
                        Err(format!("the kernel's view differs from generation {}:\n    {}", state.generation, d.join("\n    ")))
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
                    Err(e) => st.failures.push(format!("{}: writing on after the crash (recovery): {e}", what())),
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
            let msg = p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "non-string panic".into());
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
        Err(e) => return SweepStats { failures: vec![format!("seed {seed}: the recording run (no faults) failed: {e}")], ..Default::default() },
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

/// The CI sweep: four seeds (plain, bitmaps, and two heavy ones that allocate a data
/// chunk), every flush and superblock point and a seeded sample of the other writes (at
/// most 250 points per seed), `btrfs check` on every 50th tested point, recovery on
/// every 25th.
#[test]
fn crash_sweep_ci() {
    let mut failures = Vec::new();
    for seed in [3, 4, 8, 17] {
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
    let opts = SweepOpts { max_points: None, btrfs_every: 6, recover_every: 4, unit: 512, only_super: true };
    let mut failures = Vec::new();
    let mut fallbacks = 0;
    for seed in [6, 7] {
        let st = crash_seed(seed, 20, &opts);
        fallbacks += st.sb_fallbacks;
        failures.extend(st.failures);
    }
    report(failures);
    assert!(fallbacks > 0, "no image had a torn primary superblock: the fallback path went untested");
}

/// Long runs: `UBTRFS_CRASH_SEEDS=N` (or `A-B`, or `a,b,c`), every point of every seed.
#[test]
fn crash_sweep_env() {
    let Ok(spec) = std::env::var("UBTRFS_CRASH_SEEDS") else {
        eprintln!("crash_sweep_env: set UBTRFS_CRASH_SEEDS (e.g. 100, 10-50, 3,7,9) for long runs");
        return;
    };
    let seeds: Vec<u64> = if let Some((a, b)) = spec.split_once('-') {
        (a.trim().parse().expect("seed range start")..b.trim().parse().expect("seed range end")).collect()
    } else if spec.contains(',') {
        spec.split(',').map(|s| s.trim().parse().expect("seed")).collect()
    } else {
        (0..spec.trim().parse().expect("seed count")).collect()
    };
    let nops: usize = std::env::var("UBTRFS_CRASH_OPS").ok().and_then(|s| s.parse().ok()).unwrap_or(40);
    if std::env::var_os("UBTRFS_CRASH_RECORD_ONLY").is_some() {
        for seed in seeds {
            let run = record(seed, nops);
            eprintln!(
                "seed {seed} ({:?}): chunks {} -> {}, {} commits, {} ops, out of space: {:?}, problems {:?}",
                run.flavour,
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
    let opts = SweepOpts { max_points: None, btrfs_every: 50, recover_every: 10, unit, only_super: false };
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
    wl.flavour.apply(&mut w);
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
            match w.commit() {
                Ok(g) => {
                    if dev.op_count() > before_ops {
                        last_ok = CommitRec { generation: g, sb_first: None, done: None, model: Arc::new(wl.model.clone()) };
                    }
                }
                Err(e) => {
                    // The failed commit's state counts if a superblock write was issued.
                    let log = dev.log();
                    if log[before_ops as usize..].iter().any(is_super_write) {
                        failed_commit = Some(CommitRec { generation: w.transid, sb_first: None, done: None, model: Arc::new(wl.model.clone()) });
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
        if w.mkdir(FS_TREE, top, b"after-crash", &InodeAttrs::new(0o755)).is_ok() && w.commit().is_ok() {
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
            failures.push(format!("seed {seed} live crash at op {k} ({}; {}): {e}", op_name(&run, k), run.step_at(k)));
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
    wl.flavour.apply(&mut w);
    for _ in 0..4 {
        wl.step(&mut w).map_err(|(what, e)| format!("{what}: {e}")).expect("step");
    }
    let g = w.commit().expect("commit A");
    let a = CommitRec { generation: g, sb_first: None, done: None, model: Arc::new(wl.model.clone()) };
    // Make sure B changes something that must reach disk.
    let top = wl.model.dir_ino(b"");
    let ino = w.create_file(FS_TREE, top, b"in-b", &InodeAttrs::new(0o644)).expect("create");
    w.write_file(FS_TREE, ino, 0, &vec![0x5a; 50_000]).expect("write");
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
    let e = w.create_file(FS_TREE, top, b"late", &InodeAttrs::new(0o644)).expect_err("create after abort");
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
    assert!(!log[before..].iter().any(is_super_write), "a superblock was written after the flush failed");
    assert_eq!(log.last().map(|r| r.outcome), Some(OpOutcome::Failed), "nothing is issued after the failed flush");
    drop(w);
    verify_images(&dev, std::slice::from_ref(&a), "flush before superblocks failed");
    // A new writer (a remount) on the surviving disk works and commits.
    let r = recover(dev.crash_image(9), &a, 99).unwrap_or_else(|e| panic!("recovery after a failed flush: {e}"));
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
    let b = CommitRec { generation: a.generation + 1, sb_first: None, done: None, model: Arc::new(wl.model.clone()) };
    assert_aborted_naming(&mut w, "injected flush failure");
    let log = dev.log();
    assert!(log[before..].iter().any(is_super_write), "the superblocks were written before the failing flush");
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
            want.push(CommitRec { generation: a.generation + 1, sb_first: None, done: None, model: Arc::new(wl.model.clone()) });
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
    let e = w.transaction("write_file", 0, |w| w.write_file(FS_TREE, ino, 0, &vec![7u8; 300_000])).expect_err("failing data write");
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
            let fs = open_info(dev.clone()).and_then(Filesystem::from_info).map_err(|e| format!("open: {e}"))?;
            walk(&fs)
        });
        match r {
            Ok(m) => {
                let d = clean.diff(&m, 8);
                assert!(d.is_empty(), "seed {seed}: a walk with bit flips returned wrong data ({} flips):\n  {}", dev.flips(), d.join("\n  "));
                ok += 1;
            }
            Err(e) => {
                assert!(!e.contains("panicked"), "seed {seed}: {e}");
                // Only when both copies of something were hit (1 in 36 per pair).
                assert!(e.contains("checksum mismatch") || e.contains("csum"), "seed {seed}: unexpected error kind: {e}");
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
        let e = w.write_file(FS_TREE, ino, 4096, &vec![7u8; 300_000]).expect_err("failing data write");
        assert!(e.to_string().contains("injected write failure"), "{e}");
        let aborted = w.check_writable().is_err();
        let committed = if aborted { None } else { Some(w.commit()) };
        drop(w);
        if let Some(c) = committed {
            let (r, _) = with_image(dev.current_image(), |fs| {
                let fs = fs.expect("open");
                check(&fs.info, &CheckOptions::default()).map(|r| r.findings.iter().take(6).map(|f| f.to_string()).collect::<Vec<_>>())
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
    assert_eq!(a.commits.iter().map(|c| (c.generation, c.sb_first, c.done)).collect::<Vec<_>>(), b.commits.iter().map(|c| (c.generation, c.sb_first, c.done)).collect::<Vec<_>>());
}
