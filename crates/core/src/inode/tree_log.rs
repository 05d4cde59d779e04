//! Log trees: the replay of what an fsync left in them before a crash (the kernel's
//! tree-log.c, `btrfs_recover_log_trees`).
//!
//! An fsync that does not commit writes the inode's changed items into a log tree of
//! its subvolume (owner `TREE_LOG_OBJECTID`), lists that tree in the log root tree
//! (`ROOT_ITEM (TREE_LOG, subvolume id)`), and points the superblock's `log_root` at the
//! log root tree. Nothing else of the running transaction reaches the disk: the log's
//! tree blocks and the data extents its file extents name are free space in the
//! committed filesystem, and the log's EXTENT_CSUM items hold the data checksums.
//!
//! Replay copies the log into the subvolumes in the kernel's stages, every log tree per
//! stage, and then commits:
//! 1. *pin*: every log tree block is read (and so validated) and kept out of the
//!    allocator until the commit; every data extent the log names that has no extent
//!    item is kept out until its file extent is replayed (`allocator::exclude_logged`).
//!    A log that cannot be read whole is refused here, before anything changed.
//! 2. *inodes*: each logged INODE_ITEM replaces the subvolume's (nbytes kept, a new
//!    directory's size zero until its names are added back); xattrs the log lacks are
//!    deleted (`replay_xattr_deletes`); for a directory, the names in the index ranges
//!    the log covers (`DIR_LOG_INDEX`) that the log lacks are unlinked
//!    (`replay_dir_deletes`); a file's extents past its size are dropped.
//! 3. *dir index*: each logged DIR_INDEX name whose inode exists and whose back
//!    reference is not in the log is linked (`replay_one_name`).
//! 4. *everything else*: XATTR_ITEMs copied, INODE_REF/EXTREF names made to match the
//!    log (`add_inode_ref`), file extents replayed with their references and checksums
//!    (`replay_one_extent`); then every inode touched gets its link count recounted from
//!    its back references, and one left without a name becomes an orphan
//!    (`fixup_inode_link_counts`).
//!
//! The changes of replay go through the running transaction like any other; a failure
//! part way leaves it uncommitted (the open fails and nothing was written but blocks in
//! free space). The commit clears the superblock's `log_root`.
//!
//! Where this differs from the kernel, on purpose: an inode the log records with no
//! links (a tmpfile an older kernel logged) is skipped in every stage by its number (the
//! kernel's skip flag carries over from its inodes stage to the next item's); the fixup
//! list is kept in memory, not as ORPHAN items of objectid `TREE_LOG_FIXUP` in the
//! subvolume (they were inserted and deleted in the same transaction).

use crate::disk_io::{Expect, FsInfo, OpenOptions};
use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::InodeId;
use crate::inode::writer::FsWriter;
use crate::transaction::Transaction;
use crate::tree::search::{NodeHandle, RootInfo};
use crate::volumes::device::{BlockDevice, OverlayDevice};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use ubtrfs_format::hash::{extref_hash, name_hash};
use ubtrfs_format::items;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};
use zerocopy::{FromBytes, IntoBytes};

/// One log tree, read whole: the subvolume it replays into and its items in key order.
struct LogTree {
    subvol: u64,
    items: BTreeMap<Key, Vec<u8>>,
    /// Inodes the log records with no links (a tmpfile an older kernel logged), whose
    /// items every stage skips.
    ignored: BTreeSet<u64>,
}

/// What the log root tree leads to, read and validated before anything changes.
pub(crate) struct Logs {
    /// In the kernel's order of replay: subvolume ids from the highest down.
    trees: Vec<LogTree>,
    /// Every tree block of the log root tree and of the log trees.
    blocks: Vec<u64>,
    /// The data extents (bytenr → disk_num_bytes) the logged file extents name.
    data: BTreeMap<u64, u64>,
}

impl Logs {
    /// Logged items in all log trees.
    pub(crate) fn items(&self) -> usize {
        self.trees.iter().map(|t| t.items.len()).sum()
    }
}

/// The refusal of a log that cannot be replayed, with the way out.
fn damaged(e: Error) -> Error {
    Error::Incompatible(format!(
        "the log tree cannot be replayed: {e}; nothing was changed (open read-only with --no-log-replay, or mount -o ro,rescue=nologreplay, to see the last commit)"
    ))
}

fn corrupt(root: u64, key: Key, why: String) -> Error {
    Corrupt::new(CorruptWhere::Item, why).root(root).key(key).into()
}

/// Read every block of the log root tree at `log_root` and of each log tree it lists
/// (the pin stage's walk, which reads the whole log before replay uses any of it).
///
/// # Errors
/// `Incompatible` naming the failure (an unreadable or corrupt block, a bad item).
pub(crate) fn read_logs(info: &FsInfo, log_root: RootInfo) -> Result<Logs> {
    let mut blocks = Vec::new();
    let mut roots = BTreeMap::new();
    walk(info, log_root, &mut blocks, &mut |k, d| {
        if k.objectid == TREE_LOG_OBJECTID && k.type_ == ROOT_ITEM_KEY {
            let ri = items::root_item(d).map_err(|e| corrupt(TREE_LOG_OBJECTID, *k, e))?.item;
            roots.insert(
                k.offset,
                RootInfo {
                    id: TREE_LOG_OBJECTID,
                    bytenr: ri.bytenr.get(),
                    level: ri.level,
                    generation: ri.generation.get(),
                },
            );
        }
        Ok(())
    })
    .map_err(damaged)?;
    let mut trees = Vec::new();
    let mut data = BTreeMap::new();
    for (&subvol, &root) in roots.iter().rev() {
        let mut tree = BTreeMap::new();
        walk(info, root, &mut blocks, &mut |k, d| {
            if k.type_ == EXTENT_DATA_KEY {
                if let items::FileExtent::Regular { disk_bytenr, disk_num_bytes, .. } =
                    items::file_extent(d).map_err(|e| corrupt(subvol, *k, e))?
                {
                    if disk_bytenr != 0 {
                        match data.insert(disk_bytenr, disk_num_bytes) {
                            Some(n) if n != disk_num_bytes => {
                                let why = format!(
                                    "data extent {disk_bytenr} logged with lengths {n} and {disk_num_bytes}"
                                );
                                return Err(corrupt(subvol, *k, why));
                            }
                            _ => {}
                        }
                    }
                }
            }
            tree.insert(*k, d.to_vec());
            Ok(())
        })
        .map_err(damaged)?;
        let ignored = tree
            .iter()
            .filter(|(k, d)| k.type_ == INODE_ITEM_KEY && inode_item(d).nlink.get() == 0)
            .map(|(k, _)| k.objectid)
            .collect();
        trees.push(LogTree { subvol, items: tree, ignored });
    }
    Ok(Logs { trees, blocks, data })
}

/// Visit every block of the tree at `root` (recording its bytenr) and every leaf item.
fn walk(
    info: &FsInfo,
    root: RootInfo,
    blocks: &mut Vec<u64>,
    f: &mut dyn FnMut(&Key, &[u8]) -> Result<()>,
) -> Result<()> {
    let top = info.read_tree_block(
        root.bytenr,
        &Expect {
            level: Some(root.level),
            generation: Some(root.generation),
            owner: Some(root.id),
            first_key: None,
        },
    )?;
    let mut stack = vec![top];
    while let Some(eb) = stack.pop() {
        blocks.push(eb.node().bytenr());
        let n = eb.node();
        if n.level() == 0 {
            for slot in 0..n.nritems() {
                f(&n.key(slot), n.item_data(slot))?;
            }
            continue;
        }
        // Children pushed last-first so leaves are visited in key order.
        for slot in (0..n.nritems()).rev() {
            let child = info.read_tree_block(
                n.blockptr(slot),
                &Expect {
                    level: Some(n.level() - 1),
                    generation: Some(n.ptr_generation(slot)),
                    owner: Some(root.id),
                    first_key: Some(n.key(slot)),
                },
            )?;
            stack.push(child);
        }
    }
    Ok(())
}

/// Replay the log of a writer opened over an image that has one, and commit: the
/// writable open of the kernel's mount (`btrfs_replay_log`). Returns the writer under a
/// fresh inode cache.
///
/// # Errors
/// `Incompatible` for a log that cannot be read or replayed (nothing committed then);
/// the commit's errors.
pub(crate) fn replay_and_commit(mut w: FsWriter) -> Result<FsWriter> {
    let log = w.info.log_root().expect("a pending log replay has a log root");
    let logs = read_logs(&w.info, log)?;
    w.log_replay_pending = false;
    w.read_only = None;
    replay(&mut w, &logs).map_err(damaged)?;
    w.commit()?;
    debug_assert!(w.info.log_root().is_none(), "the replay's commit left the log root");
    Ok(w.with_fresh_inodes())
}

/// Open the devices of `opts` for reading as a kernel mount would show them: an
/// unreplayed log tree is replayed into memory (writes go to an `OverlayDevice` over
/// each device, and the image is not written), unless `opts.no_log_replay` asks for the
/// last commit. A filesystem ubtrfs cannot write (features, missing devices) shows its
/// last commit too; a warning says which state is shown.
///
/// # Errors
/// As `FsInfo::open`; `Incompatible` naming a log tree that cannot be read or replayed,
/// with the way to the last commit.
pub fn open_with_log_replay(opts: &OpenOptions) -> Result<FsInfo> {
    let mut o = opts.clone();
    o.writable = false;
    with_log_replayed(FsInfo::open(&o)?, opts)
}

/// `open_with_log_replay` of an opened `FsInfo` (its devices opened for reading);
/// `opts` gives the log replay switch, the cache size, the sources and `degraded`.
///
/// # Errors
/// As `open_with_log_replay`.
pub fn with_log_replayed(info: FsInfo, opts: &OpenOptions) -> Result<FsInfo> {
    let Some(log) = info.log_root() else { return Ok(info) };
    let generation = info.super_copy().generation.get();
    let last = |why: String| {
        format!(
            "the superblock carries a log tree (log_root={} level {}) {why}: showing the last commit (generation {generation})",
            log.bytenr, log.level
        )
    };
    if opts.no_log_replay {
        info.warn(last("and log replay is off".into()));
        return Ok(info);
    }
    let logs = read_logs(&info, log)?;
    let devs: Vec<Arc<dyn BlockDevice>> = info
        .devices
        .by_id
        .values()
        .chain(info.devices.replace_target.iter())
        .map(|d| Arc::new(OverlayDevice::new(d.dev.clone())) as Arc<dyn BlockDevice>)
        .collect();
    let reopen = || -> Result<FsInfo> {
        let mut i = FsInfo::open_devices(devs.clone(), opts.cache_bytes)?;
        // The first open said all there is to say about the devices.
        let _ = i.take_warnings();
        i.in_use = info.in_use.clone();
        i.sources = opts.sources.clone();
        i.degraded = opts.degraded;
        Ok(i)
    };
    let t = match Transaction::from_shared(Arc::new(reopen()?)) {
        Ok(t) => t,
        Err(e) => {
            info.warn(last(format!("that cannot be replayed in memory ({e})")));
            return Ok(info);
        }
    };
    let mut w = FsWriter::over(t);
    w.log_replay_pending = false;
    w.read_only = None;
    replay(&mut w, &logs).map_err(damaged)?;
    w.commit()?;
    drop(w);
    let replayed = reopen()?;
    for m in info.take_warnings() {
        replayed.warn(m);
    }
    replayed.warn(format!(
        "the superblock carries a log tree: replayed its {} items in memory, as a kernel mount would; the image is unchanged (--no-log-replay shows the last commit, generation {generation})",
        logs.items()
    ));
    Ok(replayed)
}

/// Replay `logs` into the running transaction of `w` (not committed here).
///
/// # Errors
/// `Corrupt` where the log and the subvolume contradict each other (a name of an inode
/// that exists nowhere, space the log claims that is in use); tree failures. The
/// transaction is then aborted and must not be committed.
pub(crate) fn replay(w: &mut FsWriter, logs: &Logs) -> Result<()> {
    let nodesize = u64::from(w.nodesize());
    w.transaction("log replay: pin", 0, |w| {
        for &b in &logs.blocks {
            crate::space::allocator::exclude_logged(w, b, nodesize, true, "tree block")?;
        }
        Ok(())
    })?;
    let mut r = Replay { excluded: BTreeMap::new(), fixup: BTreeSet::new() };
    w.transaction("log replay: exclude", 0, |w| {
        for (&bytenr, &len) in &logs.data {
            let from = Key::new(bytenr, EXTENT_ITEM_KEY, 0);
            let to = Key::new(bytenr, EXTENT_ITEM_KEY, u64::MAX);
            match w.items_in_range(EXTENT_TREE_OBJECTID, &from, &to)?.first() {
                Some((k, _)) if k.offset == len => {}
                Some((k, _)) => {
                    let why = format!(
                        "the log names data extent {bytenr} with length {len}, the extent tree with {}",
                        k.offset
                    );
                    return Err(corrupt(EXTENT_TREE_OBJECTID, *k, why));
                }
                None => {
                    crate::space::allocator::exclude_logged(w, bytenr, len, false, "data extent")?;
                    r.excluded.insert(bytenr, len);
                }
            }
        }
        Ok(())
    })?;
    let mut live = Vec::new();
    for t in &logs.trees {
        // A log of a subvolume deleted since is skipped (the kernel's ENOENT).
        match w.root(t.subvol) {
            Ok(_) => live.push(t),
            Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => {}
            Err(e) => return Err(e),
        }
    }
    for t in &live {
        r.stage_inodes(w, t)?;
    }
    for t in &live {
        r.stage_dir_index(w, t)?;
    }
    for t in &live {
        r.stage_all(w, t)?;
        r.fixup_inode_link_counts(w, t.subvol)?;
        // Replayed inodes may be past the tree's cached next objectid: it is found
        // again from the tree (the kernel's `btrfs_init_root_free_objectid`).
        w.next_objectid.remove(&t.subvol);
    }
    for (&bytenr, &len) in &r.excluded {
        crate::space::allocator::return_excluded(w, bytenr, len);
    }
    Ok(())
}

fn inode_item(d: &[u8]) -> InodeItem {
    InodeItem::read_from_bytes(d).expect("inode item size checked by the tree checker")
}

fn is_dir(mode: u32) -> bool {
    mode & S_IFMT == S_IFDIR
}

fn is_reg(mode: u32) -> bool {
    mode & S_IFMT == S_IFREG
}

/// One name in a directory as an entry of a DIR_ITEM / DIR_INDEX carries it.
struct Entry {
    location: Key,
    type_: u8,
    name: Vec<u8>,
}

struct Replay {
    /// Data extents taken out of the free space, not yet given an extent item.
    excluded: BTreeMap<u64, u64>,
    /// Inodes (subvolume, inode) whose link count is recounted after the last stage.
    fixup: BTreeSet<(u64, u64)>,
}

impl Replay {
    fn stage_inodes(&mut self, w: &mut FsWriter, t: &LogTree) -> Result<()> {
        let root = t.subvol;
        for (key, data) in &t.items {
            if key.type_ != INODE_ITEM_KEY || t.ignored.contains(&key.objectid) {
                continue;
            }
            let ino = key.objectid;
            let mode = inode_item(data).mode.get();
            w.transaction("log replay: inode", 8, |w| {
                self.replay_xattr_deletes(w, t, root, ino)?;
                if is_dir(mode) {
                    self.replay_dir_deletes(w, Some(t), root, ino)?;
                }
                overwrite_inode_item(w, root, ino, data)?;
                if is_reg(mode) {
                    // Extents past the size go before the log's extents come in: a
                    // preallocation past EOF the fsync logged must survive.
                    let id = InodeId { root, ino };
                    let size = load_inode(w, root, ino)?.map_or(0, |i| i.size.get());
                    let ss = u64::from(w.sectorsize());
                    let from = size.div_ceil(ss) * ss;
                    let dropped = w.drop_extents_inner(id, from, u64::MAX)?;
                    if dropped > 0 {
                        w.update_inode(id, |i| {
                            i.nbytes = i.nbytes.get().saturating_sub(dropped).into();
                        })?;
                    }
                }
                Ok(())
            })?;
            self.fixup.insert((root, ino));
        }
        Ok(())
    }

    fn stage_dir_index(&mut self, w: &mut FsWriter, t: &LogTree) -> Result<()> {
        let root = t.subvol;
        for (key, data) in &t.items {
            if key.type_ != DIR_INDEX_KEY || t.ignored.contains(&key.objectid) {
                continue;
            }
            let e = one_entry(root, key, data)?;
            w.transaction("log replay: dir index", 8, |w| {
                self.replay_one_name(w, t, root, key.objectid, key.offset, &e)
            })?;
        }
        Ok(())
    }

    fn stage_all(&mut self, w: &mut FsWriter, t: &LogTree) -> Result<()> {
        let root = t.subvol;
        for (key, data) in &t.items {
            if t.ignored.contains(&key.objectid) {
                continue;
            }
            match key.type_ {
                XATTR_ITEM_KEY => {
                    w.transaction("log replay: xattr", 2, |w| overwrite_item(w, root, key, data))?
                }
                INODE_REF_KEY | INODE_EXTREF_KEY => {
                    w.transaction("log replay: inode ref", 16, |w| {
                        self.add_inode_ref(w, t, root, key, data)
                    })?
                }
                EXTENT_DATA_KEY => w.transaction("log replay: file extent", 8, |w| {
                    self.replay_one_extent(w, t, root, key, data)
                })?,
                // DIR_INDEX was the last stage's; DIR_ITEM is derived from it (older
                // kernels logged both); DIR_LOG_INDEX and EXTENT_CSUM are read where
                // used; nothing else is replayed.
                _ => {}
            }
        }
        Ok(())
    }

    /// Unlink `name` of inode `ino` from `dir` (the kernel's `btrfs_unlink_inode` in
    /// replay): the entries, the back reference, the directory's size, the inode's link
    /// count and ctime; the inode's count is recounted at the end. The directory's times
    /// stay, as the kernel's replay leaves them (checked against its result).
    fn unlink(
        &mut self,
        w: &mut FsWriter,
        root: u64,
        dir: u64,
        ino: u64,
        name: &[u8],
    ) -> Result<()> {
        w.del_dir_item_entry(root, dir, name)?;
        let index = w.remove_inode_ref(root, ino, dir, name)?;
        if !w.delete_item(root, &Key::new(dir, DIR_INDEX_KEY, index))? {
            return Err(corrupt(
                root,
                Key::new(dir, DIR_INDEX_KEY, index),
                format!("directory {dir} has no index entry for {}", crate::quote::name(name)),
            ));
        }
        let nl = name.len() as u64;
        w.update_inode(InodeId { root, ino: dir }, |d| {
            d.size = d.size.get().saturating_sub(2 * nl).into()
        })?;
        let t = w.now();
        w.update_inode(InodeId { root, ino }, |i| {
            i.nlink = i.nlink.get().saturating_sub(1).into();
            i.ctime = t;
        })?;
        self.fixup.insert((root, ino));
        Ok(())
    }

    /// Drop a subvolume entry that conflicts with the log (`drop_one_dir_item`).
    fn drop_one_dir_item(
        &mut self,
        w: &mut FsWriter,
        root: u64,
        dir: u64,
        e: &Entry,
    ) -> Result<()> {
        let ino = entry_inode(root, dir, e)?;
        if load_inode(w, root, ino)?.is_none() {
            return Err(missing(root, ino, "a directory entry to be dropped names it"));
        }
        self.unlink(w, root, dir, ino, &e.name)
    }

    /// Delete the xattrs of `ino` that the log does not have (`replay_xattr_deletes`).
    fn replay_xattr_deletes(
        &mut self,
        w: &mut FsWriter,
        t: &LogTree,
        root: u64,
        ino: u64,
    ) -> Result<()> {
        let from = Key::new(ino, XATTR_ITEM_KEY, 0);
        let to = Key::new(ino, XATTR_ITEM_KEY, u64::MAX);
        for (k, d) in w.items_in_range(root, &from, &to)? {
            let mut keep = Vec::new();
            let mut dropped = false;
            for e in items::dir_entries(&d) {
                let e = e.map_err(|e| corrupt(root, k, e))?;
                let lk = Key::new(ino, XATTR_ITEM_KEY, name_hash(e.name));
                let in_log = t.items.get(&lk).is_some_and(|ld| {
                    items::dir_entries(ld).any(|le| le.is_ok_and(|le| le.name == e.name))
                });
                if in_log {
                    keep.extend_from_slice(&d[entry_span(&d, e.name)]);
                } else {
                    dropped = true;
                }
            }
            if dropped {
                w.delete_item(root, &k)?;
                if !keep.is_empty() {
                    w.insert_item(root, &k, &keep)?;
                }
            }
        }
        Ok(())
    }

    /// Unlink the names of directory `dir` in the index ranges the log covers that the
    /// log does not have; with no log (`del_all`), every name (`replay_dir_deletes`).
    fn replay_dir_deletes(
        &mut self,
        w: &mut FsWriter,
        t: Option<&LogTree>,
        root: u64,
        dir: u64,
    ) -> Result<()> {
        if load_inode(w, root, dir)?.is_none() {
            return Ok(());
        }
        let ranges: Vec<(u64, u64)> = match t {
            None => vec![(0, u64::MAX)],
            Some(t) => t
                .items
                .range(
                    Key::new(dir, DIR_LOG_INDEX_KEY, 0)
                        ..=Key::new(dir, DIR_LOG_INDEX_KEY, u64::MAX),
                )
                .map(|(k, d)| {
                    let end = d
                        .get(..8)
                        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                        .ok_or_else(|| corrupt(root, *k, "dir log item under 8 bytes".into()))?;
                    Ok((k.offset, end))
                })
                .collect::<Result<_>>()?,
        };
        for (start, end) in ranges {
            let from = Key::new(dir, DIR_INDEX_KEY, start);
            let to = Key::new(dir, DIR_INDEX_KEY, end);
            for (k, d) in w.items_in_range(root, &from, &to)? {
                let e = one_entry(root, &k, &d)?;
                let in_log = t.is_some_and(|t| {
                    t.items.get(&k).is_some_and(|ld| {
                        items::dir_entries(ld).any(|le| le.is_ok_and(|le| le.name == &e.name[..]))
                    })
                });
                if !in_log {
                    let ino = entry_inode(root, dir, &e)?;
                    if load_inode(w, root, ino)?.is_none() {
                        return Err(missing(root, ino, "a name the log deleted names it"));
                    }
                    self.unlink(w, root, dir, ino, &e.name)?;
                }
            }
        }
        Ok(())
    }

    /// Replay one logged DIR_INDEX name (`replay_one_name`, `replay_one_dir_item`).
    fn replay_one_name(
        &mut self,
        w: &mut FsWriter,
        t: &LogTree,
        root: u64,
        dir: u64,
        index: u64,
        e: &Entry,
    ) -> Result<()> {
        if load_inode(w, root, dir)?.is_none() {
            return Err(missing(root, dir, "the log has names in it"));
        }
        let exists = e.location.type_ == INODE_ITEM_KEY
            && load_inode(w, root, e.location.objectid)?.is_some();
        let mut dir_matches = false;
        if let Some(d) = dir_item_by_name(w, root, dir, &e.name)? {
            if d.location == e.location && d.type_ == e.type_ {
                dir_matches = true;
            } else if exists {
                self.drop_one_dir_item(w, root, dir, &d)?;
            }
        }
        let mut index_matches = false;
        if let Some(d) = dir_index_by_name(w, root, dir, index, &e.name)? {
            if d.location == e.location && d.type_ == e.type_ {
                index_matches = true;
            } else if exists {
                self.drop_one_dir_item(w, root, dir, &d)?;
            }
        }
        if dir_matches && index_matches {
            return Ok(());
        }
        // A name whose back reference is in the log is added with it, later.
        let ino = e.location.objectid;
        if backref_in_log(t, &Key::new(ino, INODE_REF_KEY, dir), dir, &e.name)
            || backref_in_log(
                t,
                &Key::new(ino, INODE_EXTREF_KEY, extref_hash(dir, &e.name)),
                dir,
                &e.name,
            )
        {
            return Ok(());
        }
        // Only names of inodes that exist are inserted (`insert_one_name`): a directory's
        // fsync does not log the new files in it.
        let item = match e.location.type_ {
            INODE_ITEM_KEY => load_inode(w, root, ino)?,
            _ => None,
        };
        let Some(item) = item else {
            return Ok(());
        };
        if dir_item_by_name(w, root, dir, &e.name)?.is_some() {
            return Ok(()); // EEXIST, as the kernel's insert_one_name tolerates
        }
        add_link(w, root, dir, ino, &e.name, ft_from_mode(item.mode.get()), index, true)?;
        if e.type_ != FT_DIR {
            self.fixup.insert((root, ino));
        }
        Ok(())
    }

    /// Make the names of one logged INODE_REF / INODE_EXTREF item the inode's names in
    /// the subvolume (`add_inode_ref`).
    fn add_inode_ref(
        &mut self,
        w: &mut FsWriter,
        t: &LogTree,
        root: u64,
        key: &Key,
        data: &[u8],
    ) -> Result<()> {
        let ino = key.objectid;
        let extref = key.type_ == INODE_EXTREF_KEY;
        let names: Vec<(u64, u64, Vec<u8>)> = if extref {
            items::inode_extrefs(data)
                .map(|r| r.map(|r| (r.parent, r.index, r.name.to_vec())))
                .collect::<std::result::Result<_, _>>()
        } else {
            items::inode_refs(data, key.offset)
                .map(|r| r.map(|r| (r.parent, r.index, r.name.to_vec())))
                .collect::<std::result::Result<_, _>>()
        }
        .map_err(|e| corrupt(root, *key, e))?;
        // A parent directory that was not logged may be missing: its names are skipped
        // and the link count fixup sees to the rest (the kernel's ENOENT).
        let Some(&(first_parent, _, _)) = names.first() else { return Ok(()) };
        if load_inode(w, root, first_parent)?.is_none() {
            return Ok(());
        }
        if load_inode(w, root, ino)?.is_none() {
            return Err(missing(root, ino, "the log has a back reference of it"));
        }
        let mut search_done = false;
        for (parent, index, name) in &names {
            let (parent, index) = (*parent, *index);
            if load_inode(w, root, parent)?.is_none() {
                return Ok(());
            }
            if inode_in_dir(w, root, parent, ino, index, name)? {
                continue;
            }
            if !search_done {
                match self.conflicting_refs(w, t, root, ino, parent, index, name)? {
                    Conflicts::RootDir => return Ok(()),
                    Conflicts::Searched(done) => search_done = done,
                }
            }
            // The same name in the same directory under another index goes first.
            if ref_has_name(w, root, ino, parent, name, extref)? {
                self.unlink(w, root, parent, ino, name)?;
            }
            // A name another (not yet replayed) inode holds in the directory goes too.
            if let Some(other) = dir_item_by_name(w, root, parent, name)? {
                let o = entry_inode(root, parent, &other)?;
                self.unlink(w, root, parent, o, name)?;
            }
            let item = load_inode(w, root, ino)?.expect("checked above");
            add_link(w, root, parent, ino, name, ft_from_mode(item.mode.get()), index, false)?;
        }
        // Names of the subvolume's item that the logged item does not have go
        // (`unlink_old_inode_refs`); then the item becomes the logged one.
        while let Some((_, cur)) = w.items_in_range(root, key, key)?.pop() {
            let Some((p, n)) = name_not_logged(&cur, key, &names) else { break };
            self.unlink(w, root, p, ino, &n)?;
        }
        overwrite_item(w, root, key, data)
    }

    /// The kernel's `__add_inode_ref`: names of `ino` in `parent` that the log does not
    /// have are unlinked, and entries of `parent` that collide with the logged name (by
    /// index or by name) are dropped.
    #[allow(clippy::too_many_arguments)]
    fn conflicting_refs(
        &mut self,
        w: &mut FsWriter,
        t: &LogTree,
        root: u64,
        ino: u64,
        parent: u64,
        index: u64,
        name: &[u8],
    ) -> Result<Conflicts> {
        let mut done = false;
        'again: loop {
            let rkey = Key::new(ino, INODE_REF_KEY, parent);
            if let Some((_, d)) = w.items_in_range(root, &rkey, &rkey)?.pop() {
                if ino == parent {
                    return Ok(Conflicts::RootDir);
                }
                for r in items::inode_refs(&d, parent) {
                    let r = r.map_err(|e| corrupt(root, rkey, e))?;
                    if !backref_in_log(t, &rkey, parent, r.name) {
                        let victim = r.name.to_vec();
                        self.unlink(w, root, parent, ino, &victim)?;
                        done = true;
                        continue 'again;
                    }
                }
                done = true;
            }
            let ekey = Key::new(ino, INODE_EXTREF_KEY, extref_hash(parent, name));
            if let Some((_, d)) = w.items_in_range(root, &ekey, &ekey)?.pop() {
                let has = items::inode_extrefs(&d)
                    .any(|r| r.is_ok_and(|r| r.parent == parent && r.name == name));
                if has {
                    for r in items::inode_extrefs(&d) {
                        let r = r.map_err(|e| corrupt(root, ekey, e))?;
                        if r.parent != parent {
                            continue;
                        }
                        let vkey = Key::new(ino, INODE_EXTREF_KEY, extref_hash(parent, r.name));
                        if !backref_in_log(t, &vkey, parent, r.name) {
                            let victim = r.name.to_vec();
                            if load_inode(w, root, parent)?.is_some() {
                                self.unlink(w, root, parent, ino, &victim)?;
                            }
                            done = true;
                            continue 'again;
                        }
                    }
                    done = true;
                }
            }
            break;
        }
        if let Some(d) = dir_index_by_name(w, root, parent, index, name)? {
            self.drop_one_dir_item(w, root, parent, &d)?;
        }
        if let Some(d) = dir_item_by_name(w, root, parent, name)? {
            self.drop_one_dir_item(w, root, parent, &d)?;
        }
        Ok(Conflicts::Searched(done))
    }

    /// Replay one logged file extent (`replay_one_extent`).
    fn replay_one_extent(
        &mut self,
        w: &mut FsWriter,
        t: &LogTree,
        root: u64,
        key: &Key,
        data: &[u8],
    ) -> Result<()> {
        let ino = key.objectid;
        let id = InodeId { root, ino };
        let start = key.offset;
        let fe = items::file_extent(data).map_err(|e| corrupt(root, *key, e))?;
        let ss = u64::from(w.sectorsize());
        let (end, nbytes) = match fe {
            items::FileExtent::Regular { disk_bytenr, num_bytes, .. } => {
                (start + num_bytes, if disk_bytenr == 0 { 0 } else { num_bytes })
            }
            items::FileExtent::Inline { ram_bytes, .. } => {
                ((start + ram_bytes).div_ceil(ss) * ss, ram_bytes)
            }
        };
        if load_inode(w, root, ino)?.is_none() {
            return Err(missing(root, ino, "the log has a file extent of it"));
        }
        if let items::FileExtent::Regular { .. } = fe {
            // The same extent in the same place: nothing to do.
            if let Some((_, cur)) = w.items_in_range(root, key, key)?.pop() {
                if cur.len() == data.len() && cur == data {
                    return Ok(());
                }
            }
        }
        let found = w.drop_extents_inner(id, start, end)?;
        match fe {
            items::FileExtent::Regular {
                disk_bytenr,
                disk_num_bytes,
                offset,
                num_bytes,
                compression,
                ..
            } => {
                let no_holes =
                    w.sb.incompat_flags.get() & ubtrfs_format::features::INCOMPAT_NO_HOLES != 0;
                if disk_bytenr != 0 || !no_holes {
                    w.insert_item(root, key, data)?;
                }
                if disk_bytenr != 0 {
                    let back = start.wrapping_sub(offset);
                    if self.excluded.remove(&disk_bytenr).is_some() {
                        w.add_logged_data_extent(disk_bytenr, disk_num_bytes, root, ino, back)?;
                    } else {
                        w.data_ref(disk_bytenr, disk_num_bytes, root, ino, back, 1)?;
                    }
                    let (cs, ce) = if compression != 0 {
                        (disk_bytenr, disk_bytenr + disk_num_bytes)
                    } else {
                        (disk_bytenr + offset, disk_bytenr + offset + num_bytes)
                    };
                    replay_csums(w, t, cs, ce)?;
                }
            }
            items::FileExtent::Inline { .. } => overwrite_item(w, root, key, data)?,
        }
        w.update_inode(id, |i| {
            i.nbytes = (i.nbytes.get() + nbytes).saturating_sub(found).into();
        })
    }

    /// Recount the links of every inode on the fixup list from its back references; an
    /// inode left with none becomes an orphan, a directory losing its names with it
    /// (`fixup_inode_link_counts`).
    fn fixup_inode_link_counts(&mut self, w: &mut FsWriter, root: u64) -> Result<()> {
        while let Some(&(_, ino)) = self.fixup.range((root, 0)..=(root, u64::MAX)).next_back() {
            self.fixup.remove(&(root, ino));
            w.transaction("log replay: link count", 4, |w| {
                let Some(item) = load_inode(w, root, ino)? else {
                    return Err(missing(root, ino, "its link count was to be recounted"));
                };
                let n = count_names(w, root, ino)?;
                if u64::from(item.nlink.get()) != n {
                    w.update_inode(InodeId { root, ino }, |i| i.nlink = (n as u32).into())?;
                }
                if n == 0 {
                    if is_dir(item.mode.get()) {
                        self.replay_dir_deletes(w, None, root, ino)?;
                    }
                    w.orphan_add(InodeId { root, ino })?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}

enum Conflicts {
    /// The back reference is the subvolume root directory's own: nothing to replay.
    RootDir,
    /// Whether a back reference item was found (the search need not run again).
    Searched(bool),
}

/// A name (parent, name) of the subvolume's back reference item `cur` at `key` that
/// the logged item's `names` lack.
fn name_not_logged(cur: &[u8], key: &Key, names: &[(u64, u64, Vec<u8>)]) -> Option<(u64, Vec<u8>)> {
    let sub: Vec<(u64, Vec<u8>)> = if key.type_ == INODE_EXTREF_KEY {
        items::inode_extrefs(cur)
            .filter_map(|r| r.ok())
            .map(|r| (r.parent, r.name.to_vec()))
            .collect()
    } else {
        items::inode_refs(cur, key.offset)
            .filter_map(|r| r.ok())
            .map(|r| (r.parent, r.name.to_vec()))
            .collect()
    };
    sub.into_iter().find(|(p, n)| !names.iter().any(|(lp, _, ln)| lp == p && ln == n))
}

/// The error of an inode the log needs that exists in neither the log nor the subvolume.
fn missing(root: u64, ino: u64, why: &str) -> Error {
    Corrupt::new(
        CorruptWhere::Item,
        format!("log replay: inode {ino} does not exist in subvolume {root}, but {why}"),
    )
    .root(root)
    .into()
}

/// The subvolume's inode item of `ino`, as the running transaction sees it.
fn load_inode(w: &mut FsWriter, root: u64, ino: u64) -> Result<Option<InodeItem>> {
    let k = Key::new(ino, INODE_ITEM_KEY, 0);
    Ok(w.items_in_range(root, &k, &k)?.pop().map(|(_, d)| inode_item(&d)))
}

/// The single entry of a DIR_INDEX item.
fn one_entry(root: u64, key: &Key, data: &[u8]) -> Result<Entry> {
    let e = items::dir_entries(data)
        .next()
        .ok_or_else(|| corrupt(root, *key, "empty directory entry".into()))?
        .map_err(|e| corrupt(root, *key, e))?;
    Ok(Entry { location: e.location, type_: e.type_, name: e.name.to_vec() })
}

/// The inode an entry of `dir` names; a subvolume's entry is not replayed over.
fn entry_inode(root: u64, dir: u64, e: &Entry) -> Result<u64> {
    if e.location.type_ != INODE_ITEM_KEY {
        return Err(Error::Incompatible(format!(
            "log replay would unlink the subvolume entry {} in directory {dir} of subvolume {root}, which ubtrfs does not replay",
            crate::quote::name(&e.name)
        )));
    }
    Ok(e.location.objectid)
}

/// The byte range of the entry named `name` in a packed DIR_ITEM / XATTR_ITEM body.
fn entry_span(d: &[u8], name: &[u8]) -> std::ops::Range<usize> {
    let mut at = 0;
    while at < d.len() {
        let di = DirItem::read_from_prefix(&d[at..]).expect("checked by the tree checker").0;
        let hdr = std::mem::size_of::<DirItem>();
        let len = hdr + usize::from(di.name_len.get()) + usize::from(di.data_len.get());
        if &d[at + hdr..at + hdr + usize::from(di.name_len.get())] == name {
            return at..at + len;
        }
        at += len;
    }
    unreachable!("entry_span of a name the item holds")
}

/// The entry `name` of directory `dir`'s DIR_ITEMs.
fn dir_item_by_name(w: &mut FsWriter, root: u64, dir: u64, name: &[u8]) -> Result<Option<Entry>> {
    let k = Key::new(dir, DIR_ITEM_KEY, name_hash(name));
    let Some((_, d)) = w.items_in_range(root, &k, &k)?.pop() else { return Ok(None) };
    for e in items::dir_entries(&d) {
        let e = e.map_err(|e| corrupt(root, k, e))?;
        if e.name == name {
            return Ok(Some(Entry { location: e.location, type_: e.type_, name: name.to_vec() }));
        }
    }
    Ok(None)
}

/// The DIR_INDEX `index` of `dir` if it holds `name`.
fn dir_index_by_name(
    w: &mut FsWriter,
    root: u64,
    dir: u64,
    index: u64,
    name: &[u8],
) -> Result<Option<Entry>> {
    let k = Key::new(dir, DIR_INDEX_KEY, index);
    let Some((_, d)) = w.items_in_range(root, &k, &k)?.pop() else { return Ok(None) };
    let e = one_entry(root, &k, &d)?;
    Ok((e.name == name).then_some(e))
}

/// Whether `dir` names `ino` as `name` at `index`, both by index and by name.
fn inode_in_dir(
    w: &mut FsWriter,
    root: u64,
    dir: u64,
    ino: u64,
    index: u64,
    name: &[u8],
) -> Result<bool> {
    let by_index = dir_index_by_name(w, root, dir, index, name)?;
    if by_index.is_none_or(|e| e.location.objectid != ino) {
        return Ok(false);
    }
    Ok(dir_item_by_name(w, root, dir, name)?.is_some_and(|e| e.location.objectid == ino))
}

/// Whether the log's back reference item at `key` holds `name` (in `parent`).
fn backref_in_log(t: &LogTree, key: &Key, parent: u64, name: &[u8]) -> bool {
    let Some(d) = t.items.get(key) else { return false };
    if key.type_ == INODE_EXTREF_KEY {
        items::inode_extrefs(d).any(|r| r.is_ok_and(|r| r.parent == parent && r.name == name))
    } else {
        items::inode_refs(d, key.offset).any(|r| r.is_ok_and(|r| r.name == name))
    }
}

/// Whether the subvolume already has a back reference of `ino` to `name` in `parent`
/// of the kind of the logged item (`btrfs_inode_ref_exists`).
fn ref_has_name(
    w: &mut FsWriter,
    root: u64,
    ino: u64,
    parent: u64,
    name: &[u8],
    extref: bool,
) -> Result<bool> {
    let k = if extref {
        Key::new(ino, INODE_EXTREF_KEY, extref_hash(parent, name))
    } else {
        Key::new(ino, INODE_REF_KEY, parent)
    };
    let Some((_, d)) = w.items_in_range(root, &k, &k)?.pop() else { return Ok(false) };
    Ok(if extref {
        items::inode_extrefs(&d).any(|r| r.is_ok_and(|r| r.parent == parent && r.name == name))
    } else {
        items::inode_refs(&d, parent).any(|r| r.is_ok_and(|r| r.name == name))
    })
}

/// The names (INODE_REF and INODE_EXTREF entries) inode `ino` has.
fn count_names(w: &mut FsWriter, root: u64, ino: u64) -> Result<u64> {
    let from = Key::new(ino, INODE_REF_KEY, 0);
    let to = Key::new(ino, INODE_EXTREF_KEY, u64::MAX);
    let mut n = 0;
    for (k, d) in w.items_in_range(root, &from, &to)? {
        n += match k.type_ {
            INODE_REF_KEY => items::inode_refs(&d, k.offset).count() as u64,
            INODE_EXTREF_KEY => items::inode_extrefs(&d).count() as u64,
            _ => 0,
        };
    }
    Ok(n)
}

/// A name of `ino` in `dir` at `index` (`btrfs_add_link` as replay calls it): the back
/// reference when `backref`, both entries, and the directory's size; the directory's
/// times stay (replay sets them from the log), and the link count is the fixup's.
#[allow(clippy::too_many_arguments)]
fn add_link(
    w: &mut FsWriter,
    root: u64,
    dir: u64,
    ino: u64,
    name: &[u8],
    ftype: u8,
    index: u64,
    backref: bool,
) -> Result<()> {
    if backref {
        w.add_inode_ref(root, ino, dir, name, index)?;
    }
    w.insert_dir_entries(root, dir, name, Key::new(ino, INODE_ITEM_KEY, 0), ftype, index)?;
    let nl = name.len() as u64;
    w.update_inode(InodeId { root, ino: dir }, |d| d.size = (d.size.get() + 2 * nl).into())
}

/// Copy the logged item `key` into the subvolume, replacing one there (`overwrite_item`
/// for items other than inodes).
fn overwrite_item(w: &mut FsWriter, root: u64, key: &Key, data: &[u8]) -> Result<()> {
    if w.overwrite_item(root, key, data)? {
        return Ok(());
    }
    w.delete_item(root, key)?;
    w.insert_item(root, key, data)
}

/// Copy a logged INODE_ITEM into the subvolume by the kernel's rules (`overwrite_item`
/// of an inode item): the subvolume's nbytes stays (the replayed extents adjust it), a
/// new inode starts with none; a directory keeps the size the subvolume gave it, a new
/// one starts empty (its names add to it); an item logged with generation 0 only says
/// the inode exists, so it changes at most a regular file's size; a zero generation
/// becomes this transaction's.
fn overwrite_inode_item(w: &mut FsWriter, root: u64, ino: u64, data: &[u8]) -> Result<()> {
    let key = Key::new(ino, INODE_ITEM_KEY, 0);
    let mut src = inode_item(data);
    let transid = w.transid;
    let new = match load_inode(w, root, ino)? {
        Some(dst) => {
            if dst.as_bytes() == data {
                return Ok(());
            }
            src.nbytes = dst.nbytes;
            if is_dir(src.mode.get()) {
                src.size = 0.into();
            }
            if src.generation.get() == 0 {
                let size = src.size.get();
                if is_reg(src.mode.get()) && is_reg(dst.mode.get()) && size != 0 {
                    let mut d = dst;
                    d.size = size.into();
                    d
                } else {
                    return Ok(());
                }
            } else {
                if is_dir(src.mode.get()) && is_dir(dst.mode.get()) {
                    src.size = dst.size;
                }
                src
            }
        }
        None => {
            src.nbytes = 0.into();
            if is_dir(src.mode.get()) {
                src.size = 0.into();
            }
            src
        }
    };
    let mut new = new;
    if new.generation.get() == 0 {
        new.generation = transid.into();
    }
    overwrite_item(w, root, &key, new.as_bytes())?;
    if let Some(i) = w.inodes().lookup(InodeId { root, ino }) {
        i.set_attrs(Some(new));
    }
    Ok(())
}

/// Replace the csum tree's checksums of `[start, end)` with the log's (replay of a
/// file extent's data checksums).
fn replay_csums(w: &mut FsWriter, t: &LogTree, start: u64, end: u64) -> Result<()> {
    let ss = u64::from(w.sectorsize());
    let cs = w.info.csum_type.size() as u64;
    let from = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 0);
    let to = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, end);
    let mut runs: Vec<(u64, Vec<u8>)> = Vec::new();
    for (k, d) in t.items.range(from..to) {
        let item_end = k.offset + d.len() as u64 / cs * ss;
        let (s, e) = (k.offset.max(start), item_end.min(end));
        if s >= e {
            continue;
        }
        let a = ((s - k.offset) / ss * cs) as usize;
        let b = ((e - k.offset) / ss * cs) as usize;
        match runs.last_mut() {
            Some((rs, rc)) if *rs + rc.len() as u64 / cs * ss == s => {
                rc.extend_from_slice(&d[a..b])
            }
            _ => runs.push((s, d[a..b].to_vec())),
        }
    }
    for (s, c) in runs {
        let len = c.len() as u64 / cs * ss;
        crate::extent::csum_tree::del_csums(w, s, len)?;
        crate::extent::csum_tree::insert_csums(w, s, &c)?;
    }
    Ok(())
}
