//! Log trees at fsync: what makes one file durable without committing the filesystem
//! (the kernel's tree-log.c, `btrfs_log_inode_parent` and `btrfs_sync_log`).
//!
//! An fsync copies the file's items into the log tree of its subvolume: its inode item,
//! its names (INODE_REF/EXTREF) and all its xattrs, the file extent items over every
//! byte range whose extents changed since the last commit or the file's last logging
//! (`Transaction::log_changes`), with hole items where the range has none (NO_HOLES),
//! and the data checksums of the extents this transaction wrote. Then every log tree of
//! the transaction and the log root tree are written to blocks no tree uses, flushed,
//! and each device's committed superblock is written again with its `log_root` pointing
//! at the log root tree, and flushed: the fsync is durable, and the next open replays
//! the log (`tree_log`). The commit that ends the transaction makes the log obsolete
//! (its superblock has no log root) and frees its blocks.
//!
//! The log is kept as items in memory, and every sync writes the log trees again from
//! them, packed into new blocks (the blocks of earlier syncs stay reserved until the
//! commit, since a crash before the new superblock needs them). So a sync costs the
//! log's size, which `MAX_LOG_BLOCKS` bounds: past it, the fsync commits instead.
//!
//! Where the log cannot make a file durable by the kernel's rules, the fsync commits
//! (`LogOutcome::Commit` says why): a file not regular, unlinked or created in this
//! transaction, a file whose names changed (link, unlink, rename: the kernel logs the
//! parent directories then), a subvolume or block group created in this transaction
//! (replay reads the log through the committed chunk tree and root tree), and quotas on.

use crate::error::{PosixKind, Result};
use crate::inode::filesystem::{Filesystem, InodeId};
use crate::inode::writer::FsWriter;
use crate::tree::search::TreeView;
use std::collections::BTreeMap;
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

/// A tree's items in key order.
type Items = Vec<(Key, Vec<u8>)>;

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
        if item.generation.get() >= self.transid {
            return Ok(Commit("the file was made in this transaction: its name is not committed"));
        }
        // Its names must be the committed ones: a link, unlink or rename in this
        // transaction needs the parent directories logged (the kernel logs them).
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
        let old_refs: Vec<(Key, Vec<u8>)> = committed
            .items_in_range(&croot, &rfrom, &rto)?
            .into_iter()
            .map(|i| (i.key(), i.data().to_vec()))
            .collect();
        if live_refs != old_refs {
            return Ok(Commit("the file's names changed in this transaction"));
        }
        if self.log.transid != self.transid {
            self.log = LogState { transid: self.transid, trees: BTreeMap::new() };
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
        let r = self.log_items(id, &item, &mut tree);
        self.log.trees.insert(root, tree);
        r?;
        self.sync_log()
    }

    /// Copy the items of file `id` (item `item`) into `tree`.
    fn log_items(&mut self, id: InodeId, item: &InodeItem, tree: &mut LogItems) -> Result<()> {
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
        let old_ext = |tree: &LogItems| -> Vec<(Key, u64, u64)> {
            tree.items
                .range(Key::new(ino, EXTENT_DATA_KEY, 0)..=Key::new(ino, EXTENT_DATA_KEY, u64::MAX))
                .map(|(k, d)| {
                    let (s, e) = item_range(k.offset, d, ss);
                    (*k, s, e)
                })
                .collect()
        };
        // Grow the cover until it holds whole items, old (logged before) and live.
        let live = loop {
            let before = cover.clone();
            for (_, s, e) in old_ext(tree) {
                if overlaps(&cover, s, e) {
                    cover.push((s, e));
                }
            }
            cover = merge(cover);
            let live = self.live_extent_items(root, ino, &cover, ss)?;
            for (_, s, e, _) in &live {
                cover.push((*s, *e));
            }
            cover = merge(cover);
            if cover == before {
                break live;
            }
        };
        if cover.is_empty() {
            return Ok(());
        }
        for (k, s, e) in old_ext(tree) {
            if overlaps(&cover, s, e) {
                tree.items.remove(&k);
            }
        }
        let no_holes =
            self.sb.incompat_flags.get() & ubtrfs_format::features::INCOMPAT_NO_HOLES != 0;
        let transid = self.transid;
        let mut covered: Vec<(u64, u64)> = Vec::new();
        for (off, s, e, d) in live {
            covered.push((s, e));
            if let Ok(items::FileExtent::Regular {
                generation,
                disk_bytenr,
                disk_num_bytes,
                offset,
                num_bytes,
                compression,
                ..
            }) = items::file_extent(&d)
            {
                if disk_bytenr != 0 && generation == transid {
                    let (cs, len) = if compression != 0 {
                        (disk_bytenr, disk_num_bytes)
                    } else {
                        (disk_bytenr + offset, num_bytes)
                    };
                    self.log_csums(tree, cs, len)?;
                }
            }
            tree.items.insert(Key::new(ino, EXTENT_DATA_KEY, off), d);
        }
        // What no live item covers is a hole: a hole item makes replay drop what the
        // committed file has there.
        if no_holes {
            let covered = merge(covered);
            for &(s, e) in &cover {
                let mut at = s;
                for &(cs, ce) in covered.iter().filter(|r| r.0 < e && s < r.1) {
                    if cs > at {
                        let hole = crate::inode::write::reg_extent_item(transid, 0, cs - at);
                        tree.items.insert(Key::new(ino, EXTENT_DATA_KEY, at), hole);
                    }
                    at = at.max(ce);
                }
                if at < e {
                    let hole = crate::inode::write::reg_extent_item(transid, 0, e - at);
                    tree.items.insert(Key::new(ino, EXTENT_DATA_KEY, at), hole);
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

    /// Write every log tree of the transaction and the log root tree to new blocks,
    /// then the superblocks that point at them (`btrfs_sync_log`).
    fn sync_log(&mut self) -> Result<LogOutcome> {
        let ns = self.nodesize() as usize;
        let transid = self.transid;
        let leaf_room = ns - HEADER_SIZE;
        let csum_room =
            (leaf_room - ITEM_SIZE) / self.info.csum_type.size() * self.info.csum_type.size();
        // Each log tree's items in key order, then the log root tree's.
        let mut trees: Vec<(u64, Items)> = Vec::new();
        for (&subvol, t) in &self.log.trees {
            let mut v: Vec<(Key, Vec<u8>)> = t.items.iter().map(|(k, d)| (*k, d.clone())).collect();
            for (&s, c) in &t.csums {
                let ss = u64::from(self.sectorsize());
                let per = self.info.csum_type.size();
                for (i, chunk) in c.chunks(csum_room).enumerate() {
                    let at = s + (i * csum_room / per) as u64 * ss;
                    v.push((Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, at), chunk.to_vec()));
                }
            }
            if !v.is_empty() {
                trees.push((subvol, v));
            }
        }
        let need: usize =
            trees.iter().map(|(_, v)| blocks_for(v, leaf_room, ns)).sum::<usize>() + 1;
        if self.log_blocks.len() + need > MAX_LOG_BLOCKS {
            return Ok(LogOutcome::Commit("the log trees of this transaction are full"));
        }
        let mut blocks: Vec<(u64, Box<[u8]>)> = Vec::new();
        let mut root_items: Vec<(Key, Vec<u8>)> = Vec::new();
        let r = (|| -> Result<(u64, u8)> {
            for (subvol, v) in &trees {
                let (bytenr, level) = self.build_tree(v, &mut blocks)?;
                let mut ri = RootItem::new_zeroed();
                ri.generation = transid.into();
                ri.generation_v2 = transid.into();
                ri.bytenr = bytenr.into();
                ri.level = level;
                ri.refs = 0.into();
                root_items.push((
                    Key::new(TREE_LOG_OBJECTID, ROOT_ITEM_KEY, *subvol),
                    ri.as_bytes().to_vec(),
                ));
            }
            self.build_tree(&root_items, &mut blocks)
        })();
        // Blocks taken stay the log's until the commit, whatever happens next.
        self.log_blocks.extend(blocks.iter().map(|(b, _)| *b));
        let (root, level) = r?;
        if !self.pending_chunks.is_empty() {
            // The allocation made a block group: the log cannot use it.
            return Ok(LogOutcome::Commit("the log's blocks needed a new block group"));
        }
        if let Err(e) = self.write_log(&mut blocks, root, level) {
            self.abort("log sync", &e);
            return Err(e);
        }
        Ok(LogOutcome::Synced)
    }

    /// Pack `items` (in key order) into leaves and nodes of new blocks appended to
    /// `blocks`; returns the root's (bytenr, level).
    fn build_tree(
        &mut self,
        items: &[(Key, Vec<u8>)],
        blocks: &mut Vec<(u64, Box<[u8]>)>,
    ) -> Result<(u64, u8)> {
        let ns = self.nodesize() as usize;
        let room = ns - HEADER_SIZE;
        // (first key, bytenr) of each block of the level being built.
        let mut level_blocks: Vec<(Key, u64)> = Vec::new();
        let mut i = 0;
        loop {
            let start = i;
            let mut used = 0;
            while i < items.len() && used + ITEM_SIZE + items[i].1.len() <= room {
                used += ITEM_SIZE + items[i].1.len();
                i += 1;
            }
            assert!(
                i > start || items.is_empty(),
                "log item {} too big for a leaf",
                items[start].0
            );
            let b = self.alloc_log_block()?;
            let mut buf = self.log_block(b, 0);
            {
                let mut m = NodeMut::new(&mut buf);
                let mut data_end = room;
                for (slot, (k, d)) in items[start..i].iter().enumerate() {
                    data_end -= d.len();
                    let it = m.item_mut(slot);
                    it.key = k.to_disk();
                    it.offset = (data_end as u32).into();
                    it.size = (d.len() as u32).into();
                }
                m.set_nritems(i - start);
            }
            let mut data_end = room;
            for (_, d) in &items[start..i] {
                data_end -= d.len();
                let at = HEADER_SIZE + data_end;
                buf[at..at + d.len()].copy_from_slice(d);
            }
            let first = items.get(start).map_or(Key::new(0, 0, 0), |(k, _)| *k);
            level_blocks.push((first, b));
            blocks.push((b, buf));
            if i >= items.len() {
                break;
            }
        }
        let per = (ns - HEADER_SIZE) / KEY_PTR_SIZE;
        let mut level = 0u8;
        while level_blocks.len() > 1 {
            level += 1;
            let mut up = Vec::new();
            for chunk in level_blocks.chunks(per) {
                let b = self.alloc_log_block()?;
                let mut buf = self.log_block(b, level);
                {
                    let mut m = NodeMut::new(&mut buf);
                    for (slot, (k, child)) in chunk.iter().enumerate() {
                        m.set_ptr(slot, k, *child, self.transid);
                    }
                    m.set_nritems(chunk.len());
                }
                up.push((chunk[0].0, b));
                blocks.push((b, buf));
            }
            level_blocks = up;
        }
        Ok((level_blocks[0].1, level))
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

/// Blocks a tree of `items` takes (leaves packed full, then nodes).
fn blocks_for(items: &[(Key, Vec<u8>)], room: usize, ns: usize) -> usize {
    let bytes: usize = items.iter().map(|(_, d)| ITEM_SIZE + d.len()).sum();
    let leaves = bytes.div_ceil(room / 2).max(1);
    let per = (ns - HEADER_SIZE) / KEY_PTR_SIZE;
    let mut n = leaves;
    let mut at = leaves;
    while at > 1 {
        at = at.div_ceil(per);
        n += at;
    }
    n
}
