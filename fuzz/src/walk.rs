//! Whole-filesystem walks for robustness tests and fuzzing: visit every tree listed in
//! the root tree (every item of each), every directory, every file's data, xattrs and
//! symlink targets, and fold what was seen into a digest so two walks can be compared.
//!
//! Shared by `crates/core/tests/{corrupt,corpus}.rs` (included with `#[path]`) and the
//! fuzz targets; it depends only on ubtrfs-core, ubtrfs-format and std. Every loop is
//! bounded: directories are visited once, each file's data once, and reads stop at a
//! byte budget, so a hostile image cannot make the walker itself run away.
//!
//! Also here: `OverlayDevice` (an image plus byte patches, without copying the image)
//! and `tree_blocks` (every tree block reachable from the superblock, with its copies).
#![allow(dead_code)]

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use ubtrfs_core::data::read::DecompressCache;
use ubtrfs_core::disk_io::{Expect, FsInfo};
use ubtrfs_core::inode::filesystem::{FileKind, Filesystem, InodeId, InodeView, Load};
use ubtrfs_core::tree::search::RootInfo;
use ubtrfs_core::volumes::device::BlockDevice;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsRead;
use ubtrfs_core::TreeView;
use ubtrfs_core::{Error, Result};
use ubtrfs_format::key::*;
use ubtrfs_format::{items, CsumType, Key};

/// Bytes of file data one walk reads at most (a corrupt size or extent could claim
/// exabytes; the walker reads extents, not sizes, but still caps the total).
pub const WALK_DATA_BUDGET: u64 = 1 << 30;
/// Data read per call.
const READ_CHUNK: usize = 256 << 10;

/// What a walk saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WalkSummary {
    pub trees: usize,
    pub items: usize,
    pub dirs: usize,
    pub files: usize,
    pub symlinks: usize,
    pub others: usize,
    pub xattrs: usize,
    pub data_bytes: u64,
    /// Everything above plus names, modes, sizes, data, item keys and bodies.
    pub digest: u64,
}

impl WalkSummary {
    /// Directory entries visited (plus the root directory).
    pub fn entries(&self) -> usize {
        self.dirs + self.files + self.symlinks + self.others
    }
}

struct Digest(u64);

impl Digest {
    fn u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    fn bytes(&mut self, b: &[u8]) {
        let h = CsumType::Xxhash64.compute(b);
        self.u64(u64::from_le_bytes(h[..8].try_into().expect("xxhash64 is 8 bytes")));
        self.u64(b.len() as u64);
    }
}

/// Walk everything; returns the number of directory entries visited.
///
/// # Errors
/// The first engine error met.
pub fn walk_all(fs: &Filesystem) -> Result<usize> {
    walk_summary(fs).map(|s| s.entries())
}

/// Walk everything and summarize it.
///
/// # Errors
/// The first engine error met.
pub fn walk_summary(fs: &Filesystem) -> Result<WalkSummary> {
    let mut s = WalkSummary::default();
    let mut d = Digest(0xcbf2_9ce4_8422_2325);
    walk_trees(&fs.info, &mut s, &mut d)?;
    walk_dirs(fs, &mut s, &mut d)?;
    s.digest = d.0;
    Ok(s)
}

/// Every tree root: the root tree, the chunk tree, each ROOT_ITEM of the root tree
/// (except deleted subvolumes still being dropped) and the log tree if the superblock
/// has one.
///
/// # Errors
/// Engine errors from iterating the root tree.
pub fn all_roots(info: &FsInfo) -> Result<Vec<RootInfo>> {
    let mut roots = vec![info.tree_root(), info.chunk_root()];
    let mut it = info.iter(&info.tree_root(), Key::MIN)?;
    let mut seen = HashSet::new();
    while let Some(item) = it.next_item()? {
        let k = item.key();
        if k.type_ != ROOT_ITEM_KEY {
            continue;
        }
        // Validated by the tree checker when the leaf was read; an error here would be
        // a checker gap, reported as such rather than unwrapped.
        let v = items::root_item(item.data()).map_err(|e| {
            Error::Incompatible(format!("tree checker passed a bad root item {k}: {e}"))
        })?;
        let bytenr = v.item.bytenr.get();
        // A deleted subvolume (no references left) is being dropped: its blocks may
        // already be freed and reused, so the kernel never reads it as a tree.
        if ubtrfs_format::key::is_fstree(k.objectid) && v.item.refs.get() == 0 {
            continue;
        }
        if seen.insert((k.objectid, bytenr)) {
            roots.push(RootInfo {
                id: k.objectid,
                bytenr,
                level: v.item.level,
                generation: v.item.generation.get(),
            });
        }
    }
    if let Some(l) = info.log_root() {
        roots.push(l);
    }
    Ok(roots)
}

fn walk_trees(info: &FsInfo, s: &mut WalkSummary, d: &mut Digest) -> Result<()> {
    for root in all_roots(info)? {
        s.trees += 1;
        d.u64(root.id);
        let mut it = info.iter(&root, Key::MIN)?;
        while let Some(item) = it.next_item()? {
            s.items += 1;
            let k = item.key();
            d.u64(k.objectid);
            d.u64(u64::from(k.type_));
            d.u64(k.offset);
            d.bytes(item.data());
        }
    }
    Ok(())
}

fn walk_dirs(fs: &Filesystem, s: &mut WalkSummary, d: &mut Digest) -> Result<()> {
    let top = fs.load_inode(fs.root_dir(), Load::ALL)?;
    let mut visited_dirs: HashSet<InodeId> = HashSet::new();
    let mut read_files: HashSet<InodeId> = HashSet::new();
    let mut budget = WALK_DATA_BUDGET;
    visit(fs, &top, s, d, &mut read_files, &mut budget)?;
    visited_dirs.insert(top.id);
    let mut stack = vec![top];
    while let Some(dir) = stack.pop() {
        // readdir reloads the same entries; compare, which also exercises it.
        let listed = fs.readdir(dir.id)?;
        d.u64(listed.len() as u64);
        for e in &dir.entries {
            d.bytes(&e.name);
            d.u64(u64::from(e.ftype));
            d.u64(e.index);
            // The DIR_ITEM (hash) lookup of each DIR_INDEX name.
            let by_hash = fs.lookup(dir.id, &e.name)?;
            d.u64(u64::from(by_hash.is_some_and(|h| h.target == e.target)));
            let child = fs.load_inode(e.target, Load::ALL)?;
            visit(fs, &child, s, d, &mut read_files, &mut budget)?;
            if child.kind() == FileKind::Dir && visited_dirs.insert(child.id) {
                stack.push(child);
            }
        }
    }
    Ok(())
}

fn visit(
    fs: &Filesystem,
    v: &InodeView,
    s: &mut WalkSummary,
    d: &mut Digest,
    read_files: &mut HashSet<InodeId>,
    budget: &mut u64,
) -> Result<()> {
    d.u64(u64::from(v.mode()));
    d.u64(v.size());
    d.u64(u64::from(v.nlink()));
    d.u64(u64::from(v.item.uid.get()));
    d.u64(u64::from(v.item.gid.get()));
    for (k, val) in &v.xattrs {
        s.xattrs += 1;
        d.bytes(k);
        d.bytes(val);
    }
    match v.kind() {
        FileKind::Dir => s.dirs += 1,
        FileKind::Symlink => {
            s.symlinks += 1;
            let t = fs.readlink(v.id)?;
            d.bytes(&t);
        }
        FileKind::File => {
            s.files += 1;
            if read_files.insert(v.id) {
                read_file(fs, v, s, d, budget)?;
            }
        }
        _ => s.others += 1,
    }
    Ok(())
}

/// Read the ranges the file's extents cover (clamped to its size), plus its first and
/// last bytes, within `budget`.
fn read_file(
    fs: &Filesystem,
    v: &InodeView,
    s: &mut WalkSummary,
    d: &mut Digest,
    budget: &mut u64,
) -> Result<()> {
    let size = v.size();
    let mut ranges: Vec<(u64, u64)> = v
        .extents
        .iter()
        .filter(|e| !e.is_hole_like())
        .map(|e| (e.file_offset.min(size), e.end().min(size)))
        .collect();
    ranges.push((0, size.min(4096)));
    ranges.push((size.saturating_sub(4096), size));
    let mut buf = vec![0u8; READ_CHUNK];
    let mut cache = DecompressCache::default();
    for (start, end) in ranges {
        let mut pos = start;
        while pos < end && *budget > 0 {
            let want = ((end - pos).min(READ_CHUNK as u64).min(*budget)) as usize;
            let n = fs.read_at_cached(v, pos, &mut buf[..want], &mut cache)?;
            if n == 0 {
                break;
            }
            d.u64(pos);
            d.bytes(&buf[..n]);
            s.data_bytes += n as u64;
            *budget -= n as u64;
            pos += n as u64;
        }
    }
    Ok(())
}

/// One tree block and where its copies live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeBlock {
    pub bytenr: u64,
    pub level: u8,
    pub owner: u64,
    /// The tree that reached it first.
    pub root: u64,
    /// The parent node, if any (None for a root).
    pub parent: Option<u64>,
    /// (devid, physical offset) of each copy.
    pub copies: Vec<(u64, u64)>,
}

/// Every tree block reachable from `all_roots`, each once, with its copies.
///
/// # Errors
/// Engine errors from reading blocks.
pub fn tree_blocks(info: &FsInfo) -> Result<Vec<TreeBlock>> {
    let mut out: BTreeMap<u64, TreeBlock> = BTreeMap::new();
    for root in all_roots(info)? {
        let mut stack = vec![(
            root.bytenr,
            Expect {
                level: Some(root.level),
                generation: Some(root.generation),
                owner: Some(root.id),
                first_key: None,
            },
            None,
        )];
        while let Some((bytenr, expect, parent)) = stack.pop() {
            if out.contains_key(&bytenr) {
                continue;
            }
            let eb = info.read_tree_block(bytenr, &expect)?;
            let n = eb.node();
            let chunk = info.chunk_map.lookup(ubtrfs_core::ids::Logical(bytenr))?;
            let copies = (0..chunk.num_copies())
                .map(|m| {
                    let (idx, phys, _) = chunk.map(bytenr, m);
                    (chunk.stripes[idx].0, phys)
                })
                .collect();
            out.insert(
                bytenr,
                TreeBlock {
                    bytenr,
                    level: n.level(),
                    owner: n.owner(),
                    root: root.id,
                    parent,
                    copies,
                },
            );
            if !n.is_leaf() {
                for slot in 0..n.nritems() {
                    let e = Expect {
                        level: Some(n.level() - 1),
                        generation: Some(n.ptr_generation(slot)),
                        owner: Some(root.id),
                        first_key: Some(n.key(slot)),
                    };
                    stack.push((n.blockptr(slot), e, Some(bytenr)));
                }
            }
        }
    }
    Ok(out.into_values().collect())
}

/// A read-only device over a shared image with byte patches laid on top, so a test can
/// damage many variants of one image without copying it each time.
pub struct OverlayDevice {
    base: Arc<Vec<u8>>,
    len: u64,
    /// (offset, bytes), applied in order (later ones win).
    patches: Vec<(u64, Vec<u8>)>,
    name: String,
}

impl OverlayDevice {
    pub fn new(base: Arc<Vec<u8>>, name: impl Into<String>) -> OverlayDevice {
        let len = base.len() as u64;
        OverlayDevice { base, len, patches: Vec::new(), name: name.into() }
    }
    /// Pretend the device ends at `len` (at most the image size).
    pub fn truncate(&mut self, len: u64) {
        self.len = len.min(self.base.len() as u64);
    }
    /// Overwrite `bytes` at `offset` (clipped to the device).
    pub fn patch(&mut self, offset: u64, bytes: Vec<u8>) {
        self.patches.push((offset, bytes));
    }
    /// The current bytes of `[offset, offset + len)`, patches applied.
    pub fn read_vec(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.fill(&mut v, offset);
        v
    }
    fn fill(&self, buf: &mut [u8], offset: u64) {
        let o = offset as usize;
        let end = (o + buf.len()).min(self.base.len());
        if o < end {
            buf[..end - o].copy_from_slice(&self.base[o..end]);
        }
        apply_patches(buf, offset, &self.patches);
    }
}

/// Lay `patches` (offset, bytes; later ones win) over `buf`, which holds the bytes at
/// `offset`.
fn apply_patches(buf: &mut [u8], offset: u64, patches: &[(u64, Vec<u8>)]) {
    let (start, stop) = (offset, offset + buf.len() as u64);
    for (po, pb) in patches {
        let (ps, pe) = (*po, *po + pb.len() as u64);
        let (s, e) = (ps.max(start), pe.min(stop));
        if s < e {
            buf[(s - start) as usize..(e - start) as usize]
                .copy_from_slice(&pb[(s - ps) as usize..(e - ps) as usize]);
        }
    }
}

impl BlockDevice for OverlayDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match offset.checked_add(buf.len() as u64) {
            Some(end) if end <= self.len => {}
            _ => {
                return Err(Error::io(
                    format!(
                        "{}: access [{offset}, +{}) beyond end of device ({} bytes)",
                        self.name,
                        buf.len(),
                        self.len
                    ),
                    std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                ))
            }
        }
        self.fill(buf, offset);
        Ok(())
    }
    fn write_at(&self, _buf: &[u8], offset: u64) -> Result<()> {
        Err(Error::io(
            format!("{}: write at {offset} to a read-only overlay", self.name),
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        ))
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn size(&self) -> u64 {
        self.len
    }
    fn name(&self) -> &str {
        &self.name
    }
}

/// Recompute the checksum of the tree block (`nodesize` bytes) at the front of `block`.
pub fn fix_block_csum(block: &mut [u8], csum: CsumType) {
    let c = csum.compute(&block[32..]);
    block[..32].copy_from_slice(&c);
}

/// Recompute the checksum of a 4096-byte superblock, using the csum type it names
/// (crc32c if that is unknown).
pub fn fix_super_csum(sb: &mut [u8]) {
    let at = core::mem::offset_of!(ubtrfs_format::structs::Superblock, csum_type);
    let t = u16::from_le_bytes([sb[at], sb[at + 1]]);
    let csum = CsumType::from_raw(t).unwrap_or(CsumType::Crc32c);
    let c = csum.compute(&sb[32..4096]);
    sb[..32].copy_from_slice(&c);
}

/// An `OverlayDevice` that takes writes: each write becomes another patch over the
/// image (later ones win), so a writer can run on a fuzzed image without copying it.
pub struct WritableOverlay {
    inner: OverlayDevice,
    writes: std::sync::Mutex<Vec<(u64, Vec<u8>)>>,
}

impl WritableOverlay {
    pub fn new(inner: OverlayDevice) -> WritableOverlay {
        WritableOverlay { inner, writes: std::sync::Mutex::new(Vec::new()) }
    }
}

impl BlockDevice for WritableOverlay {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_at(buf, offset)?;
        apply_patches(buf, offset, &self.writes.lock().unwrap_or_else(|p| p.into_inner()));
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        match offset.checked_add(buf.len() as u64) {
            Some(end) if end <= self.inner.size() => {}
            _ => {
                return Err(Error::io(
                    format!(
                        "{}: write [{offset}, +{}) beyond end of device",
                        self.inner.name(),
                        buf.len()
                    ),
                    std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                ))
            }
        }
        self.writes.lock().unwrap_or_else(|p| p.into_inner()).push((offset, buf.to_vec()));
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        Ok(())
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
}
