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
//! leaves it touches, and a sync reads only the items of those (its cost follows its
//! changes, not the log's size); a block whose content hashes to one the last sync wrote is used
//! again, and only the others are written, into blocks freed two syncs back when there
//! are any. Every block the log took stays reserved until the commit pins it.
//! `MAX_LOG_BLOCKS` bounds them: past it, the fsync commits instead.
//!
//! Names are logged as the kernel logs them (`log_closure`), and replay makes them
//! so: a fsync of a directory logs its inode and its entries changed in this
//! transaction (each run of changed DIR_INDEX keys, with a DIR_LOG_INDEX item over it,
//! so replay drops the names there the log lacks); an inode such an entry names is
//! logged too, a new directory, symlink or special file whole, a new file as
//! existing (empty unless an fsync logged it), a committed inode with its names
//! (generation 0: replay changes nothing else of it). A new file needs its new parent
//! directories logged, and its name's committed holder dealt with (its other names
//! logged, or the directory if it is gone); a committed inode whose names changed (a
//! link, a rename) needs every directory it has or had a name in. A child directory
//! that an inode was renamed out of is logged with its parent. An unlink takes a
//! logged name out of the log (`log_unlink`, the kernel's `btrfs_del_inode_ref_in_log`,
//! and `log_dir_change`, its `btrfs_del_dir_entries_in_log`); a logged inode that gets
//! a new name has its names logged again at the next sync (`LogState::relog`).
//!
//! Where the log cannot make an inode durable by the kernel's rules, the fsync commits
//! (`LogOutcome::Commit` says why): an unlinked file; a subvolume's entry that came or
//! went in a logged directory; a logged inode of another subvolume renamed; a
//! subvolume or block group made in this transaction (replay reads the log through
//! the committed chunk tree and root tree); quotas on; more than `MAX_LOG_INODES`
//! inodes or `MAX_LOG_BLOCKS` blocks.

use crate::error::{PosixKind, Result};
use crate::inode::filesystem::{Filesystem, InodeId};
use crate::inode::writer::FsWriter;
use crate::ranges::{merge_overlapping, merge_ranges};
use crate::tree::search::TreeView;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use ubtrfs_format::items;
use ubtrfs_format::key::*;
use ubtrfs_format::node::{NodeMut, HEADER_SIZE, ITEM_SIZE, KEY_PTR_SIZE};
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use zerocopy::{FromBytes, FromZeros, IntoBytes};

/// Most tree blocks the log trees of one transaction may take, all syncs together;
/// an fsync past it commits (which starts a new log).
pub const MAX_LOG_BLOCKS: usize = 4096;

/// What an fsync through the log did (`FsWriter::log_inode`).
#[derive(Debug, PartialEq, Eq)]
pub enum LogOutcome {
    /// Nothing to write: the inode is as the last commit left it.
    Durable,
    /// The inode is in the log's items, at logging `seq` of the log of transaction
    /// `transid`: durable once a sync of the log from that logging on has landed
    /// (`prepare_log_sync`), or the transaction has committed.
    Logged { transid: u64, seq: u64 },
    /// The log cannot hold this fsync (why): the caller commits.
    Commit(&'static str),
}

/// A log sync prepared (`FsWriter::prepare_log_sync`).
#[derive(Debug)]
pub enum LogSync {
    /// The log's blocks are written, not flushed: `LogWrite::finish` makes them
    /// durable.
    Write(LogWrite),
    /// The log cannot hold this transaction's changes any more (why): the caller
    /// commits.
    Commit(&'static str),
}

/// The second half of a log sync, run without the writer: the devices' flush, the
/// superblocks pointing at the log, another flush. Until it is done no other log
/// sync may be prepared (the next one reuses blocks the last durable log may still
/// use) and no commit may write its superblocks.
#[must_use]
pub struct LogWrite {
    /// Every logging up to this one is in the written log.
    pub seq: u64,
    /// Per device (by id): its primary superblock with the log root set.
    supers: Vec<(u64, Superblock)>,
}

impl std::fmt::Debug for LogWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LogWrite {{ seq: {}, devices: {} }}", self.seq, self.supers.len())
    }
}

impl LogWrite {
    /// Flush the log's blocks, then write each device's primary superblock and flush
    /// (the kernel's `btrfs_sync_log` writes the primary copy only: the mirrors keep
    /// the committed state, which a kernel or `btrfs check` reading a mirror
    /// accepts).
    ///
    /// # Errors
    /// `Io` from the devices; a superblock may then be half written, and the caller
    /// aborts the filesystem.
    pub fn finish(&self, info: &crate::disk_io::FsInfo) -> Result<()> {
        for d in info.devices.by_id.values() {
            d.dev.flush()?;
        }
        for (devid, sb) in &self.supers {
            let d = info.devices.get(*devid)?;
            crate::transaction::write_primary_super(info, d.dev.as_ref(), sb)?;
            d.dev.flush()?;
        }
        Ok(())
    }
}

/// The log trees of the running transaction, as items.
#[derive(Default)]
pub struct LogState {
    /// The transaction they belong to.
    transid: u64,
    /// How many loggings went into the log (`log_inode`), in all transactions: a sync
    /// carries every one up to its count.
    seq: u64,
    /// Per subvolume: its log tree's items.
    trees: BTreeMap<u64, LogItems>,
    /// The blocks of the last synced log, by a 128-bit hash of their content (level,
    /// items or pointers).
    written: HashMap<u128, u64>,
    /// Blocks of logs before the last synced one: free for the next sync.
    pool: Vec<u64>,
    /// Logged inodes (subvolume, inode) that got a new name (a link, a rename) since
    /// they were logged: the next sync logs their names again.
    relog: BTreeSet<(u64, u64)>,
    /// Per directory (subvolume, inode): its entries changed in this transaction.
    dirs: BTreeMap<(u64, u64), DirChanges>,
}

/// The changes to one directory's entries in a transaction (`log_dir_change`).
#[derive(Default)]
struct DirChanges {
    /// DIR_INDEX keys added or removed.
    indexes: BTreeSet<u64>,
    /// Inodes that lost a name in the directory.
    gone: BTreeSet<u64>,
    /// A subvolume's entry came or went.
    subvol: bool,
}

/// What the log needs of an inode (`log_closure`); the greater includes the lesser.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Want {
    /// Its names: the back references (and an inode item that says it exists).
    Names,
    /// All of it: a file's changed extents, a directory's changed entries.
    Inode,
}

/// Most inodes one fsync may log (a directory of many new files logs each); past it,
/// the fsync commits.
const MAX_LOG_INODES: usize = 20_000;

/// The (parent, name) pairs of INODE_REF / INODE_EXTREF items.
fn ref_names(refs: &[(Key, Vec<u8>)]) -> Vec<(u64, Vec<u8>)> {
    let mut out = Vec::new();
    for (k, d) in refs {
        if k.type_ == INODE_REF_KEY {
            out.extend(
                items::inode_refs(d, k.offset)
                    .filter_map(|r| r.ok())
                    .map(|r| (r.parent, r.name.to_vec())),
            );
        } else {
            out.extend(
                items::inode_extrefs(d).filter_map(|r| r.ok()).map(|r| (r.parent, r.name.to_vec())),
            );
        }
    }
    out
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

/// A log tree's items other than checksums, by key, and the key ranges changed since
/// the last sync (`sync_log` rebuilds only the leaves over them).
#[derive(Default)]
struct LogMap {
    map: BTreeMap<Key, Vec<u8>>,
    /// Changed since the last sync: inclusive key ranges.
    dirty: Vec<(Key, Key)>,
}

impl LogMap {
    fn get(&self, k: &Key) -> Option<&Vec<u8>> {
        self.map.get(k)
    }

    fn contains_key(&self, k: &Key) -> bool {
        self.map.contains_key(k)
    }

    fn range(
        &self,
        r: std::ops::RangeInclusive<Key>,
    ) -> std::collections::btree_map::Range<'_, Key, Vec<u8>> {
        self.map.range(r)
    }

    fn iter(&self) -> std::collections::btree_map::Iter<'_, Key, Vec<u8>> {
        self.map.iter()
    }

    fn insert(&mut self, k: Key, d: Vec<u8>) {
        if self.map.get(&k) != Some(&d) {
            self.dirty.push((k, k));
            self.map.insert(k, d);
        }
    }

    fn remove(&mut self, k: &Key) -> Option<Vec<u8>> {
        let r = self.map.remove(k);
        if r.is_some() {
            self.dirty.push((*k, *k));
        }
        r
    }

    /// Make the items in `r` exactly `new` (in key order, all inside `r`).
    fn replace_range(&mut self, r: std::ops::RangeInclusive<Key>, new: Vec<(Key, Vec<u8>)>) {
        let same = self.map.range(r.clone()).eq(new.iter().map(|(k, d)| (k, d)));
        if same {
            return;
        }
        let old: Vec<Key> = self.map.range(r.clone()).map(|(k, _)| *k).collect();
        for k in old {
            self.map.remove(&k);
        }
        for (k, d) in new {
            debug_assert!(r.contains(&k), "{k} outside the replaced range");
            self.map.insert(k, d);
        }
        self.dirty.push((*r.start(), *r.end()));
    }
}

impl std::ops::Index<&Key> for LogMap {
    type Output = Vec<u8>;
    fn index(&self, k: &Key) -> &Vec<u8> {
        &self.map[k]
    }
}

/// One leaf of the last sync of a log tree: its first key, the hash of its items
/// (which the next sync's test builds check a kept leaf against) and its block.
#[derive(Clone, Copy)]
struct LeafRec {
    first: Key,
    hash: u128,
    bytenr: u64,
}

#[derive(Default)]
struct LogItems {
    /// Items other than checksums, by key.
    items: LogMap,
    /// Data checksums: runs of consecutive sectors, by the address of the first.
    csums: BTreeMap<u64, Vec<u8>>,
    /// How many runs `csums` had after its last pruning (`prune_csums`).
    csums_kept: usize,
    /// Address ranges `[start, end)` whose checksum runs changed since the last sync.
    csums_dirty: Vec<(u64, u64)>,
    /// The leaves of the last sync, in key order (empty before the first).
    leaves: Vec<LeafRec>,
}

/// The content hash of a leaf of `items`.
fn leaf_hash(items: &[(Key, &[u8])]) -> u128 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(&[0]);
    for (k, d) in items {
        h.update(k.to_disk().as_bytes());
        h.update(&(d.len() as u32).to_le_bytes());
        h.update(d);
    }
    h.digest128()
}

/// A live file extent item: (key offset, start, end, item).
type LiveItem = (u64, u64, u64, Vec<u8>);

/// The last commit, for what it already holds.
struct CommittedView {
    fs: Filesystem,
    /// The subvolume's committed root.
    croot: crate::tree::search::RootInfo,
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

/// A log tree's items as its leaves hold them: the items, then the checksum runs cut
/// into EXTENT_CSUM items of at most `csum_room` bytes.
struct TreeItems<'a> {
    items: &'a LogMap,
    csums: &'a BTreeMap<u64, Vec<u8>>,
    csum_room: usize,
    per: usize,
    ss: u64,
}

impl<'a> TreeItems<'a> {
    /// The items with keys in `[lo, hi)` (unbounded where None), in key order.
    fn range(&self, lo: Option<Key>, hi: Option<Key>) -> Vec<(Key, &'a [u8])> {
        use std::ops::Bound::{Excluded, Included, Unbounded};
        let b = (lo.map_or(Unbounded, Included), hi.map_or(Unbounded, Excluded));
        let mut v: Vec<(Key, &'a [u8])> =
            self.items.map.range(b).map(|(k, d)| (*k, &d[..])).collect();
        // Checksum items sort after every other item of a log tree (their objectid
        // is the largest); a run's chunks have keys from its start on.
        let csum = |at: u64| Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, at);
        let in_range = |k: &Key| lo.is_none_or(|lo| *k >= lo) && hi.is_none_or(|hi| *k < hi);
        if hi.is_some_and(|hi| hi <= csum(0)) {
            return v;
        }
        let from = match lo {
            Some(lo) if lo > csum(0) => lo.offset,
            _ => 0,
        };
        // The run that may reach into the range from before it, then the ones in it.
        let first = self.csums.range(..=from).next_back().map_or(from, |(&s, _)| s);
        for (&s, c) in self.csums.range(first..) {
            if hi.is_some_and(|hi| csum(s) >= hi) {
                break;
            }
            for (i, chunk) in c.chunks(self.csum_room).enumerate() {
                let k = csum(s + (i * self.csum_room / self.per) as u64 * self.ss);
                if in_range(&k) {
                    v.push((k, chunk));
                }
            }
        }
        v
    }
}

/// A log tree at a sync: its subvolume, items, and the key ranges changed since the
/// last sync (sorted, disjoint).
type SyncTree<'a> = (u64, TreeItems<'a>, Vec<(Key, Key)>);

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

/// The data a file extent item's checksums cover, `(start, len)`: its whole disk
/// extent when compressed, else the part it refers to; None for a hole, an inline
/// extent or an unreadable item.
fn csum_span(d: &[u8]) -> Option<(u64, u64)> {
    match items::file_extent(d) {
        Ok(items::FileExtent::Regular {
            disk_bytenr,
            disk_num_bytes,
            offset,
            num_bytes,
            compression,
            ..
        }) if disk_bytenr != 0 => Some(if compression != 0 {
            (disk_bytenr, disk_num_bytes)
        } else {
            (disk_bytenr + offset, num_bytes)
        }),
        _ => None,
    }
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

    /// Make inode `id` durable through the log tree (a file's data must be written
    /// back): copy it, and what its replay needs, into the log, and sync the log.
    /// `Commit` when the log cannot hold it (see the module documentation); nothing is
    /// written then, and the caller commits, which starts a new log.
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
        if item.nlink.get() == 0 {
            return Ok(Commit("the file has no name left"));
        }
        self.fresh_log();
        // Nothing to log: the inode is as the last commit left it, or (a file) as the
        // log has it (the kernel's skip of an inode not changed since it was logged).
        let pending =
            self.log_changes.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&(root, ino));
        if !pending {
            let logged = self.log.trees.get(&root).and_then(|t| t.items.get(&ik));
            let reg = item.mode.get() & S_IFMT == S_IFREG;
            if item.transid.get() < self.transid {
                return Ok(LogOutcome::Durable);
            }
            if reg && logged == Some(&idata) {
                // Logged already: durable with the sync that carries that logging.
                return Ok(LogOutcome::Logged { transid: self.transid, seq: self.log.seq });
            }
        }
        if self.log.relog.iter().any(|&(r, _)| r != root) {
            return Ok(Commit("a logged inode of another subvolume got a new name"));
        }
        let fs = Filesystem::committed(self.info.clone())?;
        let croot = match fs.read_root(root) {
            Ok((ri, _)) => ri,
            Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => {
                return Ok(Commit("the subvolume was made in this transaction"))
            }
            Err(e) => return Err(e),
        };
        let (csum_root, _) = fs.read_root(CSUM_TREE_OBJECTID)?;
        let committed = CommittedView {
            fs,
            croot,
            csum_root,
            sectorsize: u64::from(self.sectorsize()),
            csum_size: self.info.csum_type.size() as u64,
        };
        let mut tree = self.log.trees.remove(&root).unwrap_or_default();
        let r = self.log_closure(root, ino, &mut tree, &committed);
        self.log.trees.insert(root, tree);
        if let Some(why) = r? {
            return Ok(Commit(why));
        }
        self.log.relog.clear();
        self.log.seq += 1;
        Ok(LogOutcome::Logged { transid: self.transid, seq: self.log.seq })
    }

    /// Write the log trees of the transaction and the log root tree, every logging so
    /// far in them, to blocks (`sync_log`); the caller flushes them and writes the
    /// superblocks with `LogWrite::finish`, without the writer, so that other fsyncs
    /// log their inodes meanwhile and the next sync carries them all (the kernel's
    /// batching of fsyncs that join a log transaction while its sync runs).
    ///
    /// # Errors
    /// Read and allocation failures; `Corrupt` from the write-time tree checker and
    /// `Io` from the block writes (the filesystem is then aborted).
    pub(crate) fn prepare_log_sync(&mut self) -> Result<LogSync> {
        self.check_writable()?;
        self.fresh_log();
        self.sync_log()
    }

    /// Start this transaction's log if the one kept is an older transaction's (whose
    /// loggings the commit made durable: the count goes on).
    fn fresh_log(&mut self) {
        if self.log.transid != self.transid {
            self.log = LogState { transid: self.transid, seq: self.log.seq, ..Default::default() };
        }
    }

    /// Log inode `ino` of tree `root` into `tree`, and with it every inode and
    /// directory its replay needs (the kernel's `btrfs_log_inode_parent`,
    /// `log_new_dir_dentries`, `btrfs_log_all_parents`, `log_all_new_ancestors`):
    /// - a file: its items (`log_items`); a directory: its inode item, names and
    ///   xattrs, and its entries changed in this transaction (`log_dir_entries`); a
    ///   symlink or special file: all its items;
    /// - each inode an entry logged that way names: a new one whole, a committed one
    ///   with its names only (`log_names_only`);
    /// - for each inode logged, the directories its names changed in (`log_parents`);
    /// - every logged inode renamed or linked since (`LogState::relog`).
    ///
    /// `Some(why)` when the log cannot hold it.
    fn log_closure(
        &mut self,
        root: u64,
        ino: u64,
        tree: &mut LogItems,
        committed: &CommittedView,
    ) -> Result<Option<&'static str>> {
        let mut queue: VecDeque<(Want, u64)> = VecDeque::new();
        queue.push_back((Want::Inode, ino));
        queue.extend(self.log.relog.iter().map(|&(_, i)| (Want::Names, i)));
        let mut done: HashMap<u64, Want> = HashMap::new();
        while let Some((want, ino)) = queue.pop_front() {
            let Some(item) = self.live_inode(root, ino)? else {
                continue; // gone since: its names went with it
            };
            if item.nlink.get() == 0 {
                continue; // unlinked: the log has its names out already (`log_unlink`)
            }
            // A new directory, symlink or special file is logged whole whatever asked
            // for it: replay makes it from the log alone. A new file named by a logged
            // entry is logged as existing, empty unless an fsync logged it (the
            // kernel's LOG_INODE_EXISTS: a directory's fsync makes names durable, not
            // their files' data).
            let is_new = item.generation.get() >= self.transid;
            let reg = item.mode.get() & S_IFMT == S_IFREG;
            let want = if is_new && !reg { Want::Inode } else { want };
            if done.get(&ino).is_some_and(|&d| d >= want) {
                continue;
            }
            done.insert(ino, want);
            if done.len() > MAX_LOG_INODES {
                return Ok(Some("one fsync would log too many inodes"));
            }
            let id = InodeId { root, ino };
            match (want, item.mode.get() & S_IFMT) {
                (Want::Names, _) => self.log_names_only(root, ino, &item, tree)?,
                (Want::Inode, S_IFREG) => self.log_items(id, &item, tree, committed)?,
                (Want::Inode, S_IFDIR) => {
                    self.log_head(root, ino, tree)?;
                    if let Some(why) = self.log_dir_entries(root, ino, tree, &mut queue)? {
                        return Ok(Some(why));
                    }
                }
                (Want::Inode, _) => {
                    let all = Key::new(ino, 0, 0)..=Key::new(ino, u8::MAX, u64::MAX);
                    let now = self.items_in_range(root, all.start(), all.end())?;
                    tree.items.replace_range(all, now);
                }
            }
            if let Some(why) = self.log_parents(root, ino, is_new, committed, &mut queue)? {
                return Ok(Some(why));
            }
        }
        Ok(None)
    }

    /// The live inode item of (`root`, `ino`).
    fn live_inode(&mut self, root: u64, ino: u64) -> Result<Option<InodeItem>> {
        let ik = Key::new(ino, INODE_ITEM_KEY, 0);
        Ok(self
            .items_in_range(root, &ik, &ik)?
            .pop()
            .map(|(_, d)| InodeItem::read_from_bytes(&d).expect("inode item size checked")))
    }

    /// Copy the inode item, names and xattrs of `ino` into `tree`, as they are now
    /// (replay deletes the xattrs a logged inode lacks).
    fn log_head(&mut self, root: u64, ino: u64, tree: &mut LogItems) -> Result<()> {
        let head = Key::new(ino, 0, 0)..=Key::new(ino, XATTR_ITEM_KEY, u64::MAX);
        let now = self.items_in_range(root, head.start(), head.end())?;
        tree.items.replace_range(head, now);
        Ok(())
    }

    /// The names of inode `ino` (item `item`) into `tree`: its back references, and
    /// unless an fsync logged it already, its xattrs and its inode item, logged with
    /// generation 0 and size 0, which replay reads as "this inode exists": a committed
    /// inode keeps its size and data, a new one is made empty (the kernel's
    /// LOG_INODE_EXISTS).
    fn log_names_only(
        &mut self,
        root: u64,
        ino: u64,
        item: &InodeItem,
        tree: &mut LogItems,
    ) -> Result<()> {
        let ik = Key::new(ino, INODE_ITEM_KEY, 0);
        let full = tree
            .items
            .get(&ik)
            .is_some_and(|d| InodeItem::read_from_bytes(d).is_ok_and(|i| i.generation.get() != 0));
        if full {
            let refs = Key::new(ino, INODE_REF_KEY, 0)..=Key::new(ino, INODE_EXTREF_KEY, u64::MAX);
            let now = self.items_in_range(root, refs.start(), refs.end())?;
            tree.items.replace_range(refs, now);
            return Ok(());
        }
        self.log_head(root, ino, tree)?;
        let mut exists = *item;
        exists.generation = 0.into();
        exists.size = 0.into();
        tree.items.insert(ik, exists.as_bytes().to_vec());
        Ok(())
    }

    /// The entries of directory `dir` changed in this transaction into `tree`: for
    /// each run of changed DIR_INDEX keys, the live entries in it and a DIR_LOG_INDEX
    /// item over it, so replay drops the names there the log lacks
    /// (`replay_dir_deletes`). The inodes those entries name, and those that lost a
    /// name in `dir`, go on `queue`. `Some(why)` where the log cannot say it.
    fn log_dir_entries(
        &mut self,
        root: u64,
        dir: u64,
        tree: &mut LogItems,
        queue: &mut VecDeque<(Want, u64)>,
    ) -> Result<Option<&'static str>> {
        let Some(ch) = self.log.dirs.get(&(root, dir)) else { return Ok(None) };
        if ch.subvol {
            // Replay would have to add or drop a subvolume's root reference.
            return Ok(Some("a subvolume's entry in the directory came or went"));
        }
        let indexes: Vec<u64> = ch.indexes.iter().copied().collect();
        queue.extend(ch.gone.iter().map(|&i| (Want::Names, i)));
        let mut ranges = Vec::new();
        let mut entries = Vec::new();
        let mut i = 0;
        while i < indexes.len() {
            let a = indexes[i];
            let mut b = a;
            while i + 1 < indexes.len() && indexes[i + 1] == b + 1 {
                i += 1;
                b += 1;
            }
            i += 1;
            let from = Key::new(dir, DIR_INDEX_KEY, a);
            for (k, d) in self.items_in_range(root, &from, &Key::new(dir, DIR_INDEX_KEY, b))? {
                for e in items::dir_entries(&d) {
                    let e = e.expect("validated by the tree checker");
                    if e.location.type_ != INODE_ITEM_KEY {
                        return Ok(Some("a subvolume's entry in the directory came or went"));
                    }
                    queue.push_back((Want::Names, e.location.objectid));
                }
                entries.push((k, d));
            }
            ranges.push((Key::new(dir, DIR_LOG_INDEX_KEY, a), b.to_le_bytes().to_vec()));
        }
        let logs = Key::new(dir, DIR_LOG_INDEX_KEY, 0)..=Key::new(dir, DIR_LOG_INDEX_KEY, u64::MAX);
        tree.items.replace_range(logs, ranges);
        let index = Key::new(dir, DIR_INDEX_KEY, 0)..=Key::new(dir, DIR_INDEX_KEY, u64::MAX);
        tree.items.replace_range(index, entries);
        // A child directory that an inode was renamed out of: logged too, so replay
        // moves the inode rather than leave it under its old name (the kernel logs the
        // child directories it meets and commits for one with such a rename,
        // `last_unlink_trans`; the log can say it).
        let children: Vec<u64> = self
            .log
            .dirs
            .iter()
            .filter(|(&(r, x), c)| r == root && x != dir && !c.gone.is_empty())
            .map(|(&(_, x), _)| x)
            .collect();
        for x in children {
            let rk = Key::new(x, INODE_REF_KEY, dir);
            if !self.items_in_range(root, &rk, &rk)?.is_empty() {
                queue.push_back((Want::Inode, x));
            }
        }
        Ok(None)
    }

    /// The directories that inode `ino` (already in the log with its names) needs
    /// logged for replay to give it exactly its names (`is_new`: made in this
    /// transaction, no committed names):
    /// - a committed inode whose names changed (a link, a rename): every directory it
    ///   has or had a name in (the kernel's `btrfs_log_all_parents`), so replay drops
    ///   the old names and adds the new ones with the other changes there;
    /// - a new inode: every new directory it has a name in (replay makes it); where its
    ///   name replaces a committed entry, that entry's inode's names if it lives on,
    ///   or else the directory. A name in a committed directory needs nothing more:
    ///   replay adds it from the back reference (`add_inode_ref`).
    fn log_parents(
        &mut self,
        root: u64,
        ino: u64,
        is_new: bool,
        committed: &CommittedView,
        queue: &mut VecDeque<(Want, u64)>,
    ) -> Result<Option<&'static str>> {
        let refs = Key::new(ino, INODE_REF_KEY, 0)..=Key::new(ino, INODE_EXTREF_KEY, u64::MAX);
        let live = ref_names(&self.items_in_range(root, refs.start(), refs.end())?);
        if !is_new {
            let v: Vec<(Key, Vec<u8>)> = committed
                .fs
                .items_in_range(&committed.croot, refs.start(), refs.end())?
                .into_iter()
                .map(|i| (i.key(), i.data().to_vec()))
                .collect();
            let old = ref_names(&v);
            if old != live {
                queue.extend(old.iter().chain(&live).map(|(p, _)| (Want::Inode, *p)));
            }
            return Ok(None);
        }
        for (p, name) in &live {
            let Some(pi) = self.live_inode(root, *p)? else { continue };
            if pi.generation.get() >= self.transid {
                queue.push_back((Want::Inode, *p));
                continue;
            }
            // A committed entry under the same name: replay drops it for this one. If
            // its inode lives on under other names (a rename, a link), they are logged
            // (which logs its directories); if it is gone, replay's link count fixup
            // frees it.
            let dk = Key::new(*p, DIR_ITEM_KEY, ubtrfs_format::hash::name_hash(name));
            let mut holders = Vec::new();
            for it in committed.fs.items_in_range(&committed.croot, &dk, &dk)? {
                for e in items::dir_entries(it.data()) {
                    let e = e.expect("validated by the tree checker");
                    if e.name == &name[..] && e.location.objectid != ino {
                        if e.location.type_ != INODE_ITEM_KEY {
                            return Ok(Some("a new file has a subvolume's committed name"));
                        }
                        holders.push(e.location.objectid);
                    }
                }
            }
            for h in holders {
                if self.live_inode(root, h)?.is_some_and(|i| i.nlink.get() > 0) {
                    queue.push_back((Want::Names, h));
                } else {
                    // Gone: the directory is logged, so the committed name stays
                    // dropped also if this file loses its name before the crash (the
                    // kernel's `add_conflicting_inode` of a deleted inode).
                    queue.push_back((Want::Inode, *p));
                }
            }
        }
        Ok(None)
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
    /// next sync logs its names again (the kernel logs the new name at once,
    /// `btrfs_log_new_name`).
    pub(crate) fn log_new_name(&mut self, root: u64, ino: u64) {
        if self.logged(root, ino) {
            self.log.relog.insert((root, ino));
        }
    }

    /// Record a change to directory `dir`'s entries for the log: DIR_INDEX `index`
    /// added or removed, inode `gone` lost a name in it, a subvolume's entry came or
    /// went (`subvol`). A removed index leaves the log too (the kernel's
    /// `btrfs_del_dir_entries_in_log`): replay must not bring the name back.
    pub(crate) fn log_dir_change(
        &mut self,
        root: u64,
        dir: u64,
        index: Option<(u64, bool)>,
        gone: Option<u64>,
        subvol: bool,
    ) {
        if !self.track_log_changes {
            return;
        }
        self.fresh_log();
        let c = self.log.dirs.entry((root, dir)).or_default();
        c.subvol |= subvol;
        if let Some(g) = gone {
            c.gone.insert(g);
        }
        if let Some((i, removed)) = index {
            c.indexes.insert(i);
            if removed {
                if let Some(t) = self.log.trees.get_mut(&root) {
                    t.items.remove(&Key::new(dir, DIR_INDEX_KEY, i));
                }
            }
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

    /// Inode `ino` (generation `generation`) lost its last name, in `dir`: the log need
    /// not follow it any more. A new one leaves the log whole (replay would make it
    /// only to free it: a file made and unlinked between two commits, as a rollback
    /// journal is, costs the log nothing after its unlink). A committed one keeps its
    /// logged inode and data (its committed name may outlive a crash, with what an
    /// fsync made durable) and loses its logged names: each was taken from it after
    /// it was logged (by a rename whose new name the log never got, then the unlink of
    /// that one), and replay would give it back.
    pub(crate) fn log_forget(&mut self, root: u64, dir: u64, ino: u64, generation: u64) {
        if !self.track_log_changes || self.log.transid != self.transid {
            return;
        }
        if let Some(c) = self.log.dirs.get_mut(&(root, dir)) {
            c.gone.remove(&ino);
        }
        self.log.relog.remove(&(root, ino));
        if generation < self.transid {
            if let Some(t) = self.log.trees.get_mut(&root) {
                let names =
                    Key::new(ino, INODE_REF_KEY, 0)..=Key::new(ino, INODE_EXTREF_KEY, u64::MAX);
                t.items.replace_range(names, Vec::new());
            }
        } else {
            if let Some(t) = self.log.trees.get_mut(&root) {
                let all = Key::new(ino, 0, 0)..=Key::new(ino, u8::MAX, u64::MAX);
                t.items.replace_range(all, Vec::new());
            }
            if let Some(mut t) = self.log.trees.remove(&root) {
                self.prune_csums(&mut t);
                self.log.trees.insert(root, t);
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
        self.log_head(root, ino, tree)?;
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
                .insert((root, ino), merge_ranges(beyond));
        }
        let mut cover = merge_ranges(changed.into_iter().map(|(s, e)| (s, e.min(eof))).collect());
        if cover.is_empty() {
            return Ok(());
        }
        // The logged file extent items over `cover`: those starting in a range, and
        // the one before each range (logged items do not overlap, so no other can
        // reach into it). Not all of the file's: a file of many logged extents would
        // make every fsync read them all.
        let old_ext = |tree: &LogItems, cover: &[(u64, u64)]| -> Vec<(Key, u64, u64)> {
            let mut out: BTreeMap<Key, (u64, u64)> = BTreeMap::new();
            for &(cs, ce) in cover {
                let span =
                    Key::new(ino, EXTENT_DATA_KEY, 0)..=Key::new(ino, EXTENT_DATA_KEY, ce - 1);
                for (k, d) in tree.items.range(span).rev() {
                    let (s, e) = item_range(k.offset, d, ss);
                    if e > cs {
                        out.insert(*k, (s, e));
                    }
                    if k.offset < cs {
                        break;
                    }
                }
            }
            out.into_iter().map(|(k, (s, e))| (k, s, e)).collect()
        };
        // Items are logged clipped to the cover (replay's drop of the range splits the
        // committed items around them, as the writes did); an inline extent cannot be
        // cut, so the cover takes it whole.
        let live = loop {
            let before = cover.clone();
            for (k, s, e) in old_ext(tree, &cover) {
                if overlaps(&cover, s, e) && is_inline(&tree.items[&k]) {
                    cover.push((s, e));
                }
            }
            cover = merge_ranges(cover);
            let live = self.live_extent_items(root, ino, &cover, ss)?;
            for (_, s, e, d) in &live {
                if is_inline(d) {
                    cover.push((*s, *e));
                }
            }
            cover = merge_ranges(cover);
            if cover == before {
                break live;
            }
        };
        // What the log had over the cover goes; its parts outside stay.
        for (k, s, e) in old_ext(tree, &cover) {
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
                // The checksums of data this transaction wrote; older data's are
                // committed.
                if let Some((cs, len)) = csum_span(&piece) {
                    if !committed.has_csums(cs, len)? {
                        self.log_csums(tree, cs, len)?;
                    }
                }
                tree.items.insert(Key::new(ino, EXTENT_DATA_KEY, ps), piece);
            }
        }
        self.prune_csums(tree);
        // What no live item covers is a hole: a hole item makes replay drop what the
        // committed file has there.
        if no_holes {
            let covered = merge_ranges(covered);
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

    /// Drop the checksums in `tree` of data no logged file extent refers to any more
    /// (an overwritten range's old extent, an unlinked file's): replay reads only those
    /// of the extents it replays, and a log that kept them would grow with every
    /// rewrite until the commit.
    ///
    /// A pruning reads every logged file extent: it runs once the runs have doubled
    /// since the last, so its cost per sync stays constant.
    fn prune_csums(&self, tree: &mut LogItems) {
        if tree.csums.len() <= 2 * tree.csums_kept + 64 {
            return;
        }
        let ss = u64::from(self.sectorsize());
        let cs = self.info.csum_type.size();
        let used: Vec<(u64, u64)> = tree
            .items
            .iter()
            .filter(|(k, _)| k.type_ == EXTENT_DATA_KEY)
            .filter_map(|(_, d)| csum_span(d))
            .map(|(s, l)| (s, s + l))
            .collect();
        let used = merge_ranges(used);
        let old = std::mem::take(&mut tree.csums);
        tree.csums_dirty.push((0, u64::MAX));
        for (s, c) in old {
            let e = s + (c.len() / cs) as u64 * ss;
            for (ps, pe) in intersect(s, e, &used) {
                let (ps, pe) = (ps / ss * ss, pe.div_ceil(ss) * ss);
                let a = ((ps - s) / ss) as usize * cs;
                let b = ((pe - s) / ss) as usize * cs;
                tree.csums.insert(ps, c[a..b].to_vec());
            }
        }
        tree.csums_kept = tree.csums.len();
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
        let mut dirty = (start, end);
        for s in over {
            let c = tree.csums.remove(&s).expect("listed");
            let e = s + c.len() as u64 / cs as u64 * ss;
            dirty = (dirty.0.min(s), dirty.1.max(e));
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
        tree.csums_dirty.push(dirty);
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
    fn sync_log(&mut self) -> Result<LogSync> {
        let mut log = std::mem::take(&mut self.log);
        let r = self.sync_log_of(&mut log);
        self.log = log;
        r
    }

    fn sync_log_of(&mut self, log: &mut LogState) -> Result<LogSync> {
        let transid = self.transid;
        let leaf_room = self.nodesize() as usize - HEADER_SIZE;
        let per = self.info.csum_type.size();
        let csum_room = (leaf_room - ITEM_SIZE) / per * per;
        let ss = u64::from(self.sectorsize());
        // Each log tree's items (read by key range: a sync reads only the ranges it
        // packs again), with the key ranges changed since the last sync; then the log
        // root tree's.
        let mut trees: Vec<SyncTree<'_>> = Vec::new();
        for (&subvol, t) in &log.trees {
            let v = TreeItems { items: &t.items, csums: &t.csums, csum_room, per, ss };
            if !t.items.map.is_empty() || !t.csums.is_empty() {
                let mut dirty = t.items.dirty.clone();
                for &(a, b) in &t.csums_dirty {
                    dirty.push((
                        Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, a),
                        Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, b.saturating_sub(1).max(a)),
                    ));
                }
                trees.push((subvol, v, merge_overlapping(dirty)));
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
        let mut new_leaves: Vec<(u64, Vec<LeafRec>)> = Vec::new();
        let r = (|| -> Result<(u64, u8)> {
            for (subvol, v, dirty) in &trees {
                let prev = &log.trees[subvol].leaves;
                let (bytenr, level, leaves) = self.build_tree(v, &mut out, prev, dirty)?;
                new_leaves.push((*subvol, leaves));
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
            let leaves = self.pack_all(&refs, &mut out)?;
            let (b, l) = self.build_nodes(&leaves, &mut out)?;
            Ok((b, l))
        })();
        // Blocks taken stay the log's until the commit, whatever happens next.
        self.log_blocks.extend(out.fresh.iter().copied());
        let (root, level) = r?;
        if !self.pending_chunks.is_empty() {
            // The allocation made a block group: the log cannot use it.
            return Ok(LogSync::Commit("the log's blocks needed a new block group"));
        }
        if self.log_blocks.len() > MAX_LOG_BLOCKS {
            return Ok(LogSync::Commit("the log trees of this transaction are full"));
        }
        let supers = match self.write_log(&mut out.write, root, level) {
            Ok(s) => s,
            Err(e) => {
                self.abort("log sync", &e);
                return Err(e);
            }
        };
        // The last sync's blocks this log does not use are free for the next sync.
        let used = std::mem::take(&mut out.used);
        drop(out);
        let now: std::collections::HashSet<u64> = used.values().copied().collect();
        let old = std::mem::replace(&mut log.written, used);
        log.pool.extend(old.into_values().filter(|b| !now.contains(b)));
        // The next sync starts from these leaves, and from no change.
        drop(trees);
        for t in log.trees.values_mut() {
            t.leaves.clear();
            t.items.dirty.clear();
            t.csums_dirty.clear();
        }
        for (subvol, leaves) in new_leaves {
            log.trees.get_mut(&subvol).expect("synced tree").leaves = leaves;
        }
        Ok(LogSync::Write(LogWrite { seq: log.seq, supers }))
    }

    /// Pack the items of `src` into leaves and nodes, the leaves from `prev` (the last
    /// sync's of this tree) where no key range in `dirty` (sorted, disjoint) touches
    /// them, and by `pack` elsewhere. Returns the root's (bytenr, level) and the
    /// leaves.
    fn build_tree(
        &mut self,
        src: &TreeItems<'_>,
        out: &mut SyncBlocks<'_>,
        prev: &[LeafRec],
        dirty: &[(Key, Key)],
    ) -> Result<(u64, u8, Vec<LeafRec>)> {
        let leaves = match self.reuse_leaves(src, out, prev, dirty)? {
            Some(l) => l,
            None => self.pack_all(&src.range(None, None), out)?,
        };
        let (bytenr, level) = self.build_nodes(&leaves, out)?;
        Ok((bytenr, level, leaves))
    }

    /// The leaves of all of `items` (in key order): one empty leaf for none.
    fn pack_all(
        &mut self,
        items: &[(Key, &[u8])],
        out: &mut SyncBlocks<'_>,
    ) -> Result<Vec<LeafRec>> {
        let mut l = Vec::new();
        self.pack(items, out, &mut l)?;
        Ok(l)
    }

    /// The leaves of `src` with the last sync's clean ones (`prev`) kept and the items
    /// between them read and packed again: a sync costs the leaves it changes, not the
    /// log's size. None where there is no last sync, for a packing of everything.
    fn reuse_leaves(
        &mut self,
        src: &TreeItems<'_>,
        out: &mut SyncBlocks<'_>,
        prev: &[LeafRec],
        dirty: &[(Key, Key)],
    ) -> Result<Option<Vec<LeafRec>>> {
        if prev.is_empty() {
            return Ok(None);
        }
        // Leaf j holds the keys from its first (from the smallest, for the first leaf)
        // to the next leaf's first: whether a dirty range meets that interval.
        let lo = |j: usize| (j > 0).then(|| prev[j].first);
        let hi = |j: usize| prev.get(j + 1).map(|l| l.first);
        let touched = |j: usize| {
            let at = lo(j).map_or(0, |lo| dirty.partition_point(|r| r.1 < lo));
            dirty.get(at).is_some_and(|r| hi(j).is_none_or(|hi| r.0 < hi))
        };
        let mut leaves = Vec::with_capacity(prev.len());
        let mut j = 0;
        while j < prev.len() {
            if !touched(j) {
                let l = prev[j];
                // Test builds check that no change escaped the dirty ranges.
                #[cfg(debug_assertions)]
                {
                    let items = src.range(lo(j), hi(j));
                    assert!(
                        leaf_hash(&items) == l.hash,
                        "log leaf at {} reused with items changed since the last sync",
                        l.first
                    );
                }
                out.used.insert(l.hash, l.bytenr);
                leaves.push(l);
                j += 1;
                continue;
            }
            let mut k = j;
            while k + 1 < prev.len() && touched(k + 1) {
                k += 1;
            }
            let items = src.range(lo(j), hi(k));
            if !items.is_empty() {
                self.pack(&items, out, &mut leaves)?;
            }
            j = k + 1;
        }
        if leaves.is_empty() {
            return Ok(None);
        }
        Ok(Some(leaves))
    }

    /// Pack `items` (in key order) into leaves cut where their keys choose
    /// (`cut_before`); a leaf the last sync wrote with the same content is used again,
    /// the others are built and queued in `out`. No items make one empty leaf.
    fn pack(
        &mut self,
        items: &[(Key, &[u8])],
        out: &mut SyncBlocks<'_>,
        leaves: &mut Vec<LeafRec>,
    ) -> Result<()> {
        let room = self.nodesize() as usize - HEADER_SIZE;
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
            let hash = leaf_hash(&items[start..i]);
            let b = self.place_block(hash, 0, out, |buf| {
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
            leaves.push(LeafRec { first, hash, bytenr: b });
            if i >= items.len() {
                return Ok(());
            }
        }
    }

    /// The nodes over `leaves`, built again at every sync (a node block the last sync
    /// wrote with the same pointers is used again). Returns the root's (bytenr, level).
    fn build_nodes(&mut self, leaves: &[LeafRec], out: &mut SyncBlocks<'_>) -> Result<(u64, u8)> {
        let mut level_blocks: Vec<(Key, u64)> =
            leaves.iter().map(|l| (l.first, l.bytenr)).collect();
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
