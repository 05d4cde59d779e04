//! Log trees at fsync: what makes one file durable without committing the filesystem
//! (the kernel's tree-log.c, `btrfs_log_inode_parent` and `btrfs_sync_log`).
//!
//! An fsync copies the file's items into the log tree of its subvolume: its inode item,
//! its names (INODE_REF/EXTREF) and all its xattrs, the file extent items over every
//! byte range whose extents changed since the last commit or the file's last logging
//! (`Transaction::log_changes`), clipped to those ranges, with hole items where a range
//! has none (NO_HOLES), and the data checksums the committed csum tree lacks. Then
//! every log tree of the transaction and the log root tree are written to blocks no
//! tree uses, flushed, and each device's committed superblock is written again with its
//! `log_root` pointing at the log root tree, and flushed: the fsync is durable, and the
//! next open replays the log (`tree_log`). The commit that ends the transaction makes
//! the log obsolete (its superblock has no log root) and frees its blocks.
//!
//! The log is kept as items in memory, and every sync builds the log trees again from
//! them (`sync_log`): leaves end where their keys choose, so a change moves only the
//! leaves it touches; a block whose content hashes to one the last sync wrote is used
//! again, and only the others are written, into blocks freed two syncs back when there
//! are any. Every block the log took stays reserved until the commit pins it.
//! `MAX_LOG_BLOCKS` bounds them: past it, the fsync commits instead.
//!
//! A file made in this transaction is logged with its names (INODE_REF/EXTREF): replay
//! adds the directory entries through them (`add_inode_ref`), which needs every parent
//! directory committed, and no committed file under the same name (the kernel logs
//! that file too). An unlink of a logged file takes the name out of the log
//! (`log_unlink`, the kernel's `btrfs_del_inode_ref_in_log`), so a later sync does not
//! bring it back; a new name for a logged file (link, rename) makes every fsync commit
//! until the next commit (`log_new_name`; the kernel logs the new name).
//!
//! Where the log cannot make a file durable by the kernel's rules, the fsync commits
//! (`LogOutcome::Commit` says why): a file not regular or unlinked; a file made in this
//! transaction under a directory also made in it, or over a committed file's name; a
//! committed file whose names changed (link, rename: the kernel logs the parent
//! directories then); a subvolume or block group made in this transaction (replay
//! reads the log through the committed chunk tree and root tree); quotas on.

use crate::error::{PosixKind, Result};
use crate::inode::filesystem::{Filesystem, InodeId};
use crate::inode::writer::FsWriter;
use crate::tree::search::TreeView;
use std::collections::{BTreeMap, HashMap};
use ubtrfs_format::items;
use ubtrfs_format::key::*;
use ubtrfs_format::node::{NodeMut, HEADER_SIZE, ITEM_SIZE, KEY_PTR_SIZE};
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use zerocopy::{FromBytes, FromZeros, IntoBytes};

/// Most tree blocks the log trees of one transaction may take, all syncs together;
/// an fsync past it commits (which starts a new log).
pub const MAX_LOG_BLOCKS: usize = 4096;

/// What an fsync through the log did.
#[derive(Debug, PartialEq, Eq)]
pub enum LogOutcome {
    /// The file is durable in the log tree.
    Synced,
    /// The log cannot hold this fsync (why): the caller commits.
    Commit(&'static str),
}

/// The log trees of the running transaction, as items.
#[derive(Default)]
pub struct LogState {
    /// The transaction they belong to.
    transid: u64,
    /// Per subvolume: its log tree's items.
    trees: BTreeMap<u64, LogItems>,
    /// The blocks of the last synced log, by a 128-bit hash of their content (level,
    /// items or pointers).
    written: HashMap<u128, u64>,
    /// Blocks of logs before the last synced one: free for the next sync.
    pool: Vec<u64>,
    /// A logged inode got a new name (a link, a rename) since it was logged: the log
    /// cannot say where it is now, and fsyncs commit until the next commit (the kernel
    /// logs the new name, `btrfs_log_new_name`).
    need_commit: bool,
}

/// The blocks of one sync.
struct SyncBlocks<'a> {
    /// The last sync's blocks, by content hash.
    prev: &'a HashMap<u128, u64>,
    /// Free blocks of older logs.
    pool: &'a mut Vec<u64>,
    /// Built blocks to write.
    write: Vec<(u64, Box<[u8]>)>,
    /// Every block of this sync's log, by content hash.
    used: HashMap<u128, u64>,
    /// Blocks taken from the allocator by this sync.
    fresh: Vec<u64>,
}

/// Whether a leaf or node may end before the item or child with key `k`: about one
/// key in eight, chosen by the key, so the cuts stay where they were when items come
/// and go elsewhere.
fn cut_before(k: &Key) -> bool {
    let h = k.objectid.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ u64::from(k.type_).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)
        ^ k.offset.wrapping_mul(0x1656_67b1_9e37_79f9);
    (h ^ (h >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 61 == 0
}

#[derive(Default)]
struct LogItems {
    /// Items other than checksums, by key.
    items: BTreeMap<Key, Vec<u8>>,
    /// Data checksums: runs of consecutive sectors, by the address of the first.
    csums: BTreeMap<u64, Vec<u8>>,
}

/// A live file extent item: (key offset, start, end, item).
type LiveItem = (u64, u64, u64, Vec<u8>);

/// The last commit, for what it already holds.
struct CommittedView {
    fs: Filesystem,
    csum_root: crate::tree::search::RootInfo,
    sectorsize: u64,
    csum_size: u64,
}

impl CommittedView {
    /// Whether the committed csum tree has a checksum for every sector of data
    /// `[start, start + len)`: then they are the data's (extents are written once;
    /// NOCOW rewrites in place have none), and the log need not carry them. A split of
    /// an older extent needs none; data written into a preallocated extent does.
    fn has_csums(&self, start: u64, len: u64) -> Result<bool> {
        let end = start + len;
        let first = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, start);
        let mut items = Vec::new();
        if let Some(i) = self.fs.search_le(&self.csum_root, &first)? {
            let k = i.key();
            if k.objectid == EXTENT_CSUM_OBJECTID && k.type_ == EXTENT_CSUM_KEY && k.offset < start
            {
                items.push((k, i.data().len() as u64));
            }
        }
        let last = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, end - 1);
        for i in self.fs.items_in_range(&self.csum_root, &first, &last)? {
            items.push((i.key(), i.data().len() as u64));
        }
        let mut at = start;
        for (k, n) in items {
            let ie = k.offset + n / self.csum_size * self.sectorsize;
            if k.offset > at {
                return Ok(false);
            }
            at = at.max(ie);
        }
        Ok(at >= end)
    }
}

/// A tree's items in key order, borrowed.
type ItemRefs<'a> = Vec<(Key, &'a [u8])>;

/// `[start, end)` byte ranges, sorted and merged.
fn merge(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.retain(|r| r.0 < r.1);
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(l) if s <= l.1 => l.1 = l.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// The parts of `[s, e)` outside `ranges` (sorted, merged).
fn subtract(s: u64, e: u64, ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = s;
    for &(rs, re) in ranges.iter().filter(|r| r.0 < e && s < r.1) {
        if rs > at {
            out.push((at, rs));
        }
        at = at.max(re);
    }
    if at < e {
        out.push((at, e));
    }
    out
}

/// The parts of `[s, e)` inside `ranges` (sorted, merged).
fn intersect(s: u64, e: u64, ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    ranges.iter().filter(|r| r.0 < e && s < r.1).map(|r| (r.0.max(s), r.1.min(e))).collect()
}

fn is_inline(d: &[u8]) -> bool {
    matches!(items::file_extent(d), Ok(items::FileExtent::Inline { .. }))
}

/// File extent item `d`, which covers the file from `start`, cut to `[ps, pe)` (a
/// reference to the same extent further in, or a shorter hole); an inline item whole.
fn trimmed(d: &[u8], start: u64, ps: u64, pe: u64) -> Vec<u8> {
    let mut v = d.to_vec();
    if let Some((h, b)) = items::file_extent_reg_mut(&mut v) {
        let hole = b.disk_bytenr.get() == 0;
        b.offset = (b.offset.get() + (ps - start)).into();
        b.num_bytes = (pe - ps).into();
        if hole {
            h.ram_bytes = (pe - ps).into();
        }
    }
    v
}

fn overlaps(ranges: &[(u64, u64)], s: u64, e: u64) -> bool {
    ranges.iter().any(|&(rs, re)| s < re && rs < e)
}

/// The file range `[start, end)` a file extent item at `off` covers (an inline one up to
/// its sector end, as replay drops it).
fn item_range(off: u64, data: &[u8], ss: u64) -> (u64, u64) {
    match items::file_extent(data) {
        Ok(items::FileExtent::Regular { num_bytes, .. }) => (off, off + num_bytes),
        Ok(items::FileExtent::Inline { ram_bytes, .. }) => {
            (off, (off + ram_bytes).div_ceil(ss) * ss)
        }
        Err(_) => (off, off + 1),
    }
}

impl FsWriter {
    /// Turn on the recording of file extent changes that `log_inode` needs (an engine
    /// that fsyncs; an offline command never logs).
    pub(crate) fn set_log_tracking(&mut self, on: bool) {
        self.track_log_changes = on;
        if !on {
            self.log_changes.lock().unwrap_or_else(|p| p.into_inner()).clear();
        }
    }

    /// Make file `id` durable through the log tree (its data must be written back):
    /// copy its changed items into the log and sync the log. `Commit` when the log
    /// cannot hold it (see the module documentation); nothing is written then.
    ///
    /// # Errors
    /// Read and allocation failures; `Io` from the log's writes (the filesystem is then
    /// aborted: a superblock may be half written).
    pub(crate) fn log_inode(&mut self, id: InodeId) -> Result<LogOutcome> {
        use LogOutcome::Commit;
        self.check_writable()?;
        let InodeId { root, ino } = id;
        if !self.track_log_changes {
            return Ok(Commit("this engine does not record file changes for the log"));
        }
        if self.quotas {
            return Ok(Commit("quota groups are on: replay would have to account them"));
        }
        // Replay reads the log through the committed chunk tree: a block group made in
        // this transaction is not there (the kernel's btrfs_log_dentry_safe).
        let chunk_changed =
            self.roots.get(&CHUNK_TREE_OBJECTID).is_some_and(|s| s.info.generation == self.transid);
        if chunk_changed || !self.pending_chunks.is_empty() {
            return Ok(Commit("a block group was made in this transaction"));
        }
        let ik = Key::new(ino, INODE_ITEM_KEY, 0);
        let Some((_, idata)) = self.items_in_range(root, &ik, &ik)?.pop() else {
            return Ok(Commit("the inode has no item"));
        };
        let item = InodeItem::read_from_bytes(&idata).expect("inode item size checked");
        if item.mode.get() & S_IFMT != S_IFREG {
            return Ok(Commit(
                "not a regular file (directories, symlinks and special files commit)",
            ));
        }
        if item.nlink.get() == 0 {
            return Ok(Commit("the file has no name left"));
        }
        if self.log.transid != self.transid {
            self.log = LogState { transid: self.transid, ..Default::default() };
        }
        if self.log.need_commit {
            return Ok(Commit("a logged file got a new name since it was logged"));
        }
        let committed = Filesystem::committed(self.info.clone())?;
        let croot = match committed.read_root(root) {
            Ok((ri, _)) => ri,
            Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => {
                return Ok(Commit("the subvolume was made in this transaction"))
            }
            Err(e) => return Err(e),
        };
        let rfrom = Key::new(ino, INODE_REF_KEY, 0);
        let rto = Key::new(ino, INODE_EXTREF_KEY, u64::MAX);
        let live_refs = self.items_in_range(root, &rfrom, &rto)?;
        if item.generation.get() >= self.transid {
            // A file made in this transaction: replay adds its names through its back
            // references (`add_inode_ref`), which needs each parent directory in the
            // committed tree (the kernel logs new parents too; ubtrfs commits).
            for (k, d) in &live_refs {
                let names: Vec<(u64, Vec<u8>)> = if k.type_ == INODE_REF_KEY {
                    items::inode_refs(d, k.offset)
                        .filter_map(|r| r.ok())
                        .map(|r| (r.parent, r.name.to_vec()))
                        .collect()
                } else {
                    items::inode_extrefs(d)
                        .filter_map(|r| r.ok())
                        .map(|r| (r.parent, r.name.to_vec()))
                        .collect()
                };
                for (p, name) in names {
                    // A committed file under the same name (renamed or unlinked since)
                    // would lose it to the replay of this one (the kernel logs that file
                    // too, `btrfs_check_ref_name_override`; ubtrfs commits).
                    let dk = Key::new(p, DIR_ITEM_KEY, ubtrfs_format::hash::name_hash(&name));
                    let taken = committed.items_in_range(&croot, &dk, &dk)?.iter().any(|it| {
                        items::dir_entries(it.data()).any(|e| {
                            e.is_ok_and(|e| e.name == &name[..] && e.location.objectid != ino)
                        })
                    });
                    if taken {
                        return Ok(Commit("a committed file has the new file's name"));
                    }
                    let pk = Key::new(p, INODE_ITEM_KEY, 0);
                    let made_now =
                        self.items_in_range(root, &pk, &pk)?.pop().is_none_or(|(_, d)| {
                            InodeItem::read_from_bytes(&d)
                                .map_or(true, |i| i.generation.get() >= self.transid)
                        });
                    if made_now {
                        return Ok(Commit(
                            "a directory of the new file was made in this transaction",
                        ));
                    }
                }
            }
        } else {
            // Its names must be the committed ones: a link or rename in this
            // transaction needs the parent directories logged (the kernel logs them).
            let old_refs: Vec<(Key, Vec<u8>)> = committed
                .items_in_range(&croot, &rfrom, &rto)?
                .into_iter()
                .map(|i| (i.key(), i.data().to_vec()))
                .collect();
            if live_refs != old_refs {
                return Ok(Commit("the file's names changed in this transaction"));
            }
        }
        // Nothing to log: the file is as the last commit left it, or as the log has it
        // (the kernel's skip of an inode not changed since it was logged).
        let pending =
            self.log_changes.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&(root, ino));
        if !pending {
            let logged = self.log.trees.get(&root).and_then(|t| t.items.get(&ik));
            if item.transid.get() < self.transid || logged == Some(&idata) {
                return Ok(LogOutcome::Synced);
            }
        }
        let mut tree = self.log.trees.remove(&root).unwrap_or_default();
        let (csum_root, _) = committed.read_root(CSUM_TREE_OBJECTID)?;
        let committed = CommittedView {
            fs: committed,
            csum_root,
            sectorsize: u64::from(self.sectorsize()),
            csum_size: self.info.csum_type.size() as u64,
        };
        let r = self.log_items(id, &item, &mut tree, &committed);
        self.log.trees.insert(root, tree);
        r?;
        self.sync_log()
    }

    /// Whether inode (`root`, `ino`) is in this transaction's log.
    fn logged(&self, root: u64, ino: u64) -> bool {
        self.log.transid == self.transid
            && self
                .log
                .trees
                .get(&root)
                .is_some_and(|t| t.items.contains_key(&Key::new(ino, INODE_ITEM_KEY, 0)))
    }

    /// Inode (`root`, `ino`) gets a new name (a link, a rename): if it is logged, the
    /// log cannot follow, and fsyncs commit until the next commit.
    pub(crate) fn log_new_name(&mut self, root: u64, ino: u64) {
        if self.logged(root, ino) {
            self.log.need_commit = true;
        }
    }

    /// Name `name` of inode `ino` in directory `dir` is unlinked: a logged inode loses
    /// the name in the log too (the kernel's `btrfs_del_inode_ref_in_log`), so a replay
    /// does not bring it back; one left with no logged name is dropped by replay's link
    /// count fixup unless the committed tree names it.
    pub(crate) fn log_unlink(&mut self, root: u64, dir: u64, name: &[u8], ino: u64) {
        if !self.logged(root, ino) {
            return;
        }
        let Some(t) = self.log.trees.get_mut(&root) else { return };
        let rkey = Key::new(ino, INODE_REF_KEY, dir);
        let ekey = Key::new(ino, INODE_EXTREF_KEY, ubtrfs_format::hash::extref_hash(dir, name));
        for key in [rkey, ekey] {
            let Some(d) = t.items.get(&key) else { continue };
            let mut rest = Vec::new();
            let mut found = false;
            let mut at = 0;
            while at < d.len() {
                let (hdr, n, parent) = if key.type_ == INODE_REF_KEY {
                    let r = InodeRef::read_from_prefix(&d[at..]).expect("logged ref").0;
                    (std::mem::size_of::<InodeRef>(), usize::from(r.name_len.get()), dir)
                } else {
                    let r = InodeExtref::read_from_prefix(&d[at..]).expect("logged extref").0;
                    (
                        std::mem::size_of::<InodeExtref>(),
                        usize::from(r.name_len.get()),
                        r.parent_objectid.get(),
                    )
                };
                let entry = &d[at..at + hdr + n];
                if !found && parent == dir && &entry[hdr..] == name {
                    found = true;
                } else {
                    rest.extend_from_slice(entry);
                }
                at += hdr + n;
            }
            if found {
                if rest.is_empty() {
                    t.items.remove(&key);
                } else {
                    t.items.insert(key, rest);
                }
                return;
            }
        }
    }

    /// Copy the items of file `id` (item `item`) into `tree`.
    fn log_items(
        &mut self,
        id: InodeId,
        item: &InodeItem,
        tree: &mut LogItems,
        committed: &CommittedView,
    ) -> Result<()> {
        let InodeId { root, ino } = id;
        let ss = u64::from(self.sectorsize());
        // The inode item, names and xattrs, as they are now: replay deletes the xattrs
        // a logged inode lacks.
        let head_to = Key::new(ino, EXTENT_DATA_KEY - 1, u64::MAX);
        let old: Vec<Key> =
            tree.items.range(Key::new(ino, 0, 0)..=head_to).map(|(k, _)| *k).collect();
        for k in old {
            tree.items.remove(&k);
        }
        for (k, d) in self.items_in_range(root, &Key::new(ino, 0, 0), &head_to)? {
            tree.items.insert(k, d);
        }
        // File extents over every range changed since the last commit or logging.
        let changed = self
            .log_changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(root, ino))
            .unwrap_or_default();
        let eof = item.size.get().div_ceil(ss) * ss;
        // Replay drops everything past the logged size, so what changed there needs no
        // item now; but it stays pending, for a later sync after the file grew back
        // over it (a truncate, then a write past the old end).
        let beyond: Vec<(u64, u64)> =
            changed.iter().filter(|r| r.1 > eof).map(|&(s, e)| (s.max(eof), e)).collect();
        if !beyond.is_empty() {
            self.log_changes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert((root, ino), merge(beyond));
        }
        let mut cover = merge(changed.into_iter().map(|(s, e)| (s, e.min(eof))).collect());
        if cover.is_empty() {
            return Ok(());
        }
        let old_ext = |tree: &LogItems| -> Vec<(Key, u64, u64)> {
            tree.items
                .range(Key::new(ino, EXTENT_DATA_KEY, 0)..=Key::new(ino, EXTENT_DATA_KEY, u64::MAX))
                .map(|(k, d)| {
                    let (s, e) = item_range(k.offset, d, ss);
                    (*k, s, e)
                })
                .collect()
        };
        // Items are logged clipped to the cover (replay's drop of the range splits the
        // committed items around them, as the writes did); an inline extent cannot be
        // cut, so the cover takes it whole.
        let live = loop {
            let before = cover.clone();
            for (k, s, e) in old_ext(tree) {
                if overlaps(&cover, s, e) && is_inline(&tree.items[&k]) {
                    cover.push((s, e));
                }
            }
            cover = merge(cover);
            let live = self.live_extent_items(root, ino, &cover, ss)?;
            for (_, s, e, d) in &live {
                if is_inline(d) {
                    cover.push((*s, *e));
                }
            }
            cover = merge(cover);
            if cover == before {
                break live;
            }
        };
        // What the log had over the cover goes; its parts outside stay.
        for (k, s, e) in old_ext(tree) {
            if overlaps(&cover, s, e) {
                let d = tree.items.remove(&k).expect("listed");
                for (ps, pe) in subtract(s, e, &cover) {
                    tree.items.insert(Key::new(ino, EXTENT_DATA_KEY, ps), trimmed(&d, s, ps, pe));
                }
            }
        }
        let no_holes =
            self.sb.incompat_flags.get() & ubtrfs_format::features::INCOMPAT_NO_HOLES != 0;
        let transid = self.transid;
        let mut covered: Vec<(u64, u64)> = Vec::new();
        for (_, s, e, d) in live {
            for (ps, pe) in intersect(s, e, &cover) {
                covered.push((ps, pe));
                let piece = trimmed(&d, s, ps, pe);
                if let Ok(items::FileExtent::Regular {
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                    compression,
                    ..
                }) = items::file_extent(&piece)
                {
                    // The checksums of data this transaction wrote; older data's are
                    // committed.
                    if disk_bytenr != 0 {
                        let (cs, len) = if compression != 0 {
                            (disk_bytenr, disk_num_bytes)
                        } else {
                            (disk_bytenr + offset, num_bytes)
                        };
                        if !committed.has_csums(cs, len)? {
                            self.log_csums(tree, cs, len)?;
                        }
                    }
                }
                tree.items.insert(Key::new(ino, EXTENT_DATA_KEY, ps), piece);
            }
        }
        // What no live item covers is a hole: a hole item makes replay drop what the
        // committed file has there.
        if no_holes {
            let covered = merge(covered);
            for &(s, e) in &cover {
                for (hs, he) in subtract(s, e, &covered) {
                    let hole = crate::inode::write::reg_extent_item(transid, 0, he - hs);
                    tree.items.insert(Key::new(ino, EXTENT_DATA_KEY, hs), hole);
                }
            }
        }
        Ok(())
    }

    /// The live file extent items of `ino` overlapping `cover`: (key offset, start,
    /// end, item).
    fn live_extent_items(
        &mut self,
        root: u64,
        ino: u64,
        cover: &[(u64, u64)],
        ss: u64,
    ) -> Result<Vec<LiveItem>> {
        let mut out: Vec<LiveItem> = Vec::new();
        for &(s, e) in cover {
            let mut found = Vec::new();
            if let Some((k, d)) = self.last_item_le(root, &Key::new(ino, EXTENT_DATA_KEY, s))? {
                if k.objectid == ino && k.type_ == EXTENT_DATA_KEY && k.offset < s {
                    found.push((k, d));
                }
            }
            if e > s {
                found.extend(self.items_in_range(
                    root,
                    &Key::new(ino, EXTENT_DATA_KEY, s),
                    &Key::new(ino, EXTENT_DATA_KEY, e - 1),
                )?);
            }
            for (k, d) in found {
                let (is, ie) = item_range(k.offset, &d, ss);
                if is < e && s < ie && !out.iter().any(|o| o.0 == k.offset) {
                    out.push((k.offset, is, ie, d));
                }
            }
        }
        out.sort_by_key(|o| o.0);
        Ok(out)
    }

    /// Copy the checksums of data `[start, start + len)` from the csum tree into the
    /// log (sectors without one, of NODATASUM files, are left out).
    fn log_csums(&mut self, tree: &mut LogItems, start: u64, len: u64) -> Result<()> {
        let ss = u64::from(self.sectorsize());
        let cs = self.info.csum_type.size();
        let end = start + len;
        // The csum tree's items over the range (the first may begin before it).
        let mut found = Vec::new();
        let first = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, start);
        if let Some((k, d)) = self.last_item_le(CSUM_TREE_OBJECTID, &first)? {
            if k.objectid == EXTENT_CSUM_OBJECTID && k.type_ == EXTENT_CSUM_KEY && k.offset < start
            {
                found.push((k, d));
            }
        }
        found.extend(self.items_in_range(
            CSUM_TREE_OBJECTID,
            &first,
            &Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, end - 1),
        )?);
        let n = (len / ss) as usize;
        let mut present = vec![false; n];
        let mut csums = vec![0u8; n * cs];
        for (k, d) in found {
            for (i, c) in d.chunks_exact(cs).enumerate() {
                let at = k.offset + i as u64 * ss;
                if (start..end).contains(&at) {
                    let j = ((at - start) / ss) as usize;
                    present[j] = true;
                    csums[j * cs..(j + 1) * cs].copy_from_slice(c);
                }
            }
        }
        // Drop what the log has of the range first (a NOCOW rewrite, a second sync).
        let over: Vec<u64> = tree
            .csums
            .range(..end)
            .filter(|(&s, c)| s + c.len() as u64 / cs as u64 * ss > start)
            .map(|(&s, _)| s)
            .collect();
        for s in over {
            let c = tree.csums.remove(&s).expect("listed");
            let e = s + c.len() as u64 / cs as u64 * ss;
            if s < start {
                tree.csums.insert(s, c[..((start - s) / ss) as usize * cs].to_vec());
            }
            if e > end {
                tree.csums.insert(end, c[((end - s) / ss) as usize * cs..].to_vec());
            }
        }
        let mut i = 0;
        while i < n {
            if !present[i] {
                i += 1;
                continue;
            }
            let j = (i..n).find(|&j| !present[j]).unwrap_or(n);
            tree.csums.insert(start + i as u64 * ss, csums[i * cs..j * cs].to_vec());
            i = j;
        }
        Ok(())
    }

    /// Write every log tree of the transaction and the log root tree, then the
    /// superblocks that point at them (`btrfs_sync_log`). A block whose content the
    /// last sync wrote already is not written again: the trees are cut into leaves at
    /// points their keys choose (`cut_before`), so a change moves only the leaves it
    /// touches and the nodes above them, and blocks are known by a 128-bit hash of their
    /// content. A block that the last sync's log used and this one does not is free for
    /// the next sync (never for this one: until this sync's superblocks are down, a
    /// crash replays the last log), so the log keeps rewriting a few host blocks
    /// instead of spreading over new ones.
    fn sync_log(&mut self) -> Result<LogOutcome> {
        let mut log = std::mem::take(&mut self.log);
        let r = self.sync_log_of(&mut log);
        self.log = log;
        r
    }

    fn sync_log_of(&mut self, log: &mut LogState) -> Result<LogOutcome> {
        let transid = self.transid;
        let leaf_room = self.nodesize() as usize - HEADER_SIZE;
        let per = self.info.csum_type.size();
        let csum_room = (leaf_room - ITEM_SIZE) / per * per;
        let ss = u64::from(self.sectorsize());
        // Each log tree's items in key order (borrowed), then the log root tree's.
        let mut trees: Vec<(u64, ItemRefs<'_>)> = Vec::new();
        for (&subvol, t) in &log.trees {
            let mut v: Vec<(Key, &[u8])> = t.items.iter().map(|(k, d)| (*k, &d[..])).collect();
            for (&s, c) in &t.csums {
                for (i, chunk) in c.chunks(csum_room).enumerate() {
                    let at = s + (i * csum_room / per) as u64 * ss;
                    v.push((Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, at), chunk));
                }
            }
            if !v.is_empty() {
                trees.push((subvol, v));
            }
        }
        let mut out = SyncBlocks {
            prev: &log.written,
            pool: &mut log.pool,
            write: Vec::new(),
            used: HashMap::new(),
            fresh: Vec::new(),
        };
        let mut root_items: Vec<(Key, Vec<u8>)> = Vec::new();
        let r = (|| -> Result<(u64, u8)> {
            for (subvol, v) in &trees {
                let (bytenr, level) = self.build_tree(v, &mut out)?;
                let mut ri = RootItem::new_zeroed();
                ri.generation = transid.into();
                ri.generation_v2 = transid.into();
                ri.bytenr = bytenr.into();
                ri.level = level;
                root_items.push((
                    Key::new(TREE_LOG_OBJECTID, ROOT_ITEM_KEY, *subvol),
                    ri.as_bytes().to_vec(),
                ));
            }
            let refs: Vec<(Key, &[u8])> = root_items.iter().map(|(k, d)| (*k, &d[..])).collect();
            self.build_tree(&refs, &mut out)
        })();
        // Blocks taken stay the log's until the commit, whatever happens next.
        self.log_blocks.extend(out.fresh.iter().copied());
        let (root, level) = r?;
        if !self.pending_chunks.is_empty() {
            // The allocation made a block group: the log cannot use it.
            return Ok(LogOutcome::Commit("the log's blocks needed a new block group"));
        }
        if self.log_blocks.len() > MAX_LOG_BLOCKS {
            return Ok(LogOutcome::Commit("the log trees of this transaction are full"));
        }
        if let Err(e) = self.write_log(&mut out.write, root, level) {
            self.abort("log sync", &e);
            return Err(e);
        }
        // The last sync's blocks this log does not use are free for the next sync.
        let used = std::mem::take(&mut out.used);
        drop(out);
        let now: std::collections::HashSet<u64> = used.values().copied().collect();
        let old = std::mem::replace(&mut log.written, used);
        log.pool.extend(old.into_values().filter(|b| !now.contains(b)));
        Ok(LogOutcome::Synced)
    }

    /// Pack `items` (in key order) into leaves and nodes; a block the last sync wrote
    /// with the same content is used again, the others are built and queued in `out`.
    /// Returns the root's (bytenr, level).
    fn build_tree(
        &mut self,
        items: &[(Key, &[u8])],
        out: &mut SyncBlocks<'_>,
    ) -> Result<(u64, u8)> {
        let room = self.nodesize() as usize - HEADER_SIZE;
        // (first key, bytenr) of each block of the level being built.
        let mut level_blocks: Vec<(Key, u64)> = Vec::new();
        let mut i = 0;
        loop {
            let start = i;
            let mut used = 0;
            while i < items.len() && used + ITEM_SIZE + items[i].1.len() <= room {
                if i > start && used >= room / 2 && cut_before(&items[i].0) {
                    break;
                }
                used += ITEM_SIZE + items[i].1.len();
                i += 1;
            }
            assert!(
                i > start || items.is_empty(),
                "log item {} too big for a leaf",
                items[start].0
            );
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            h.update(&[0]);
            for (k, d) in &items[start..i] {
                h.update(k.to_disk().as_bytes());
                h.update(&(d.len() as u32).to_le_bytes());
                h.update(d);
            }
            let b = self.place_block(h.digest128(), 0, out, |buf| {
                let mut m = NodeMut::new(buf);
                let mut data_end = room;
                for (slot, (k, d)) in items[start..i].iter().enumerate() {
                    data_end -= d.len();
                    let it = m.item_mut(slot);
                    it.key = k.to_disk();
                    it.offset = (data_end as u32).into();
                    it.size = (d.len() as u32).into();
                }
                m.set_nritems(i - start);
                let mut data_end = room;
                for (_, d) in &items[start..i] {
                    data_end -= d.len();
                    let at = HEADER_SIZE + data_end;
                    buf[at..at + d.len()].copy_from_slice(d);
                }
            })?;
            let first = items.get(start).map_or(Key::new(0, 0, 0), |(k, _)| *k);
            level_blocks.push((first, b));
            if i >= items.len() {
                break;
            }
        }
        let per = (self.nodesize() as usize - HEADER_SIZE) / KEY_PTR_SIZE;
        let mut level = 0u8;
        while level_blocks.len() > 1 {
            level += 1;
            let mut up = Vec::new();
            let transid = self.transid;
            let mut start = 0;
            while start < level_blocks.len() {
                // Nodes are cut by their first keys too, at most `per` pointers.
                let mut end = start + 1;
                while end < level_blocks.len()
                    && end - start < per
                    && !(end - start >= per / 2 && cut_before(&level_blocks[end].0))
                {
                    end += 1;
                }
                let chunk = &level_blocks[start..end];
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                h.update(&[level]);
                for (k, child) in chunk {
                    h.update(k.to_disk().as_bytes());
                    h.update(&child.to_le_bytes());
                }
                let b = self.place_block(h.digest128(), level, out, |buf| {
                    let mut m = NodeMut::new(buf);
                    for (slot, (k, child)) in chunk.iter().enumerate() {
                        m.set_ptr(slot, k, *child, transid);
                    }
                    m.set_nritems(chunk.len());
                })?;
                up.push((chunk[0].0, b));
                start = end;
            }
            level_blocks = up;
        }
        Ok((level_blocks[0].1, level))
    }

    /// The block of content hash `content` at `level`: the last sync's block with the
    /// same content, or a new one filled by `fill` and queued to write.
    fn place_block(
        &mut self,
        content: u128,
        level: u8,
        out: &mut SyncBlocks<'_>,
        fill: impl FnOnce(&mut [u8]),
    ) -> Result<u64> {
        if let Some(&b) = out.used.get(&content) {
            return Ok(b);
        }
        if let Some(&b) = out.prev.get(&content) {
            out.used.insert(content, b);
            return Ok(b);
        }
        let b = match out.pool.pop() {
            Some(b) => b,
            None => {
                let b = self.alloc_log_block()?;
                out.fresh.push(b);
                b
            }
        };
        let mut buf = self.log_block(b, level);
        fill(&mut buf);
        out.write.push((b, buf));
        out.used.insert(content, b);
        Ok(b)
    }

    fn alloc_log_block(&mut self) -> Result<u64> {
        let ns = u64::from(self.nodesize());
        crate::space::allocator::alloc_extent(self, BLOCK_GROUP_METADATA, ns)
    }

    /// An empty log tree block at `bytenr`.
    fn log_block(&self, bytenr: u64, level: u8) -> Box<[u8]> {
        let mut buf = vec![0u8; self.nodesize() as usize].into_boxed_slice();
        {
            let mut m = NodeMut::new(&mut buf);
            let h = m.header_mut();
            h.fsid = self.info.meta_fsid;
            h.bytenr = bytenr.into();
            h.flags = (MIXED_BACKREF_REV << BACKREF_REV_SHIFT).into();
            h.chunk_tree_uuid = self.info.chunk_tree_uuid;
            h.generation = self.transid.into();
            h.owner = TREE_LOG_OBJECTID.into();
            h.level = level;
        }
        buf
    }
}
