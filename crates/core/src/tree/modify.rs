//! B-tree changes under COW: `search_slot` with COW and room-making, item insert,
//! delete, extend and truncate, leaf split and push, node split and merge, root growth
//! and collapse, and `check_invariants`.
//!
//! Strategy: structural changes happen on the way down and the search restarts
//! afterwards ("goto again" in the kernel), so a path never points at a block that a
//! split moved. Nodes with fewer than 4 free pointers are split before descending for
//! an insert, which guarantees the parent has room when a leaf splits; nodes under a
//! quarter full are merged with a sibling before descending for a delete.
//! After any call that changes structure, a `WPath` is stale and must not be reused.

use crate::error::{Error, PosixKind, Result};
use crate::transaction::{Blk, Transaction};
use crate::tree::extent_buffer::Expect;
use crate::tree::search::{Path, RootInfo, Search, TreeView};
use ubtrfs_format::key::EXTENT_DATA_KEY;
use ubtrfs_format::node::{max_node_ptrs, HEADER_SIZE, ITEM_SIZE};
use ubtrfs_format::{Corrupt, CorruptWhere, Key, NodeRef};

/// The COW path of the write engine is a `Path` over the transaction's block
/// references: its blocks are the transaction's own once COWed, named by bytenr.
pub type WPath = Path<Blk>;

impl Path<Blk> {
    /// The leaf's bytenr.
    pub fn leaf(&self) -> u64 {
        self.nodes[0].as_ref().expect("search fills level 0").bytenr()
    }
}

/// The end in the file of the extent an EXTENT_DATA item describes; the end of the
/// file when the item does not parse or is inline (its map is one block, not its bytes).
fn extent_item_end(key: &Key, data: &[u8]) -> u64 {
    match ubtrfs_format::items::file_extent(data) {
        Ok(ubtrfs_format::items::FileExtent::Regular { num_bytes, .. }) => {
            key.offset.saturating_add(num_bytes)
        }
        _ => u64::MAX,
    }
}

/// The file range whose extent maps an in-place change of EXTENT_DATA item `key` from
/// `old` to `new` makes stale: only the bytes gained or lost when nothing but the
/// length changed (a trimmed or extended reference), else all it described before
/// and after.
fn extent_item_change(key: &Key, old: &[u8], new: &[u8]) -> (u64, u64) {
    use ubtrfs_format::items::{file_extent, FileExtent};
    if let (
        Ok(FileExtent::Regular { num_bytes: a, .. }),
        Ok(FileExtent::Regular { num_bytes: b, .. }),
    ) = (file_extent(old), file_extent(new))
    {
        let with_len = |f: FileExtent<'_>| match f {
            FileExtent::Regular {
                generation,
                ram_bytes,
                compression,
                prealloc,
                disk_bytenr,
                disk_num_bytes,
                offset,
                ..
            } => Some((
                generation,
                ram_bytes,
                compression,
                prealloc,
                disk_bytenr,
                disk_num_bytes,
                offset,
            )),
            FileExtent::Inline { .. } => None,
        };
        if with_len(file_extent(old).expect("parsed above"))
            == with_len(file_extent(new).expect("parsed above"))
        {
            return (key.offset.saturating_add(a.min(b)), key.offset.saturating_add(a.max(b)));
        }
    }
    (key.offset, extent_item_end(key, old).max(extent_item_end(key, new)))
}

fn leaf_data_size(nodesize: u32) -> usize {
    nodesize as usize - HEADER_SIZE
}

/// Bytes items [from, to) of a leaf use (headers + data).
fn leaf_space_used(n: &NodeRef<'_>, from: usize, to: usize) -> usize {
    (from..to).map(|i| ITEM_SIZE + n.item(i).size.get() as usize).sum()
}

impl Transaction {
    fn child_expect(&self, parent: &Blk, slot: usize, root_id: u64) -> (u64, Expect) {
        let n = self.node(parent);
        (
            n.blockptr(slot),
            Expect {
                level: Some(n.level() - 1),
                generation: Some(n.ptr_generation(slot)),
                owner: Some(root_id),
                first_key: Some(n.key(slot)),
            },
        )
    }

    pub(crate) fn read_child(&self, parent: &Blk, slot: usize, root_id: u64) -> Result<Blk> {
        let (bytenr, e) = self.child_expect(parent, slot, root_id);
        self.read_block(bytenr, &e)
    }

    fn read_root_blk(&mut self, root_id: u64) -> Result<Blk> {
        let r = self.root(root_id)?;
        self.read_block(
            r.bytenr,
            &Expect {
                level: Some(r.level),
                generation: Some(r.generation),
                owner: Some(root_id),
                first_key: None,
            },
        )
    }

    /// COW `b` unless it already belongs to the running transaction; `parent` is the
    /// (dirty) parent and slot, or None for the root. Blocks a snapshot (or the
    /// kernel's relocation) may share have their references moved as the kernel's
    /// `update_ref_for_cow` does, so the other trees keep theirs.
    ///
    /// # Errors
    /// Allocation failures; `Corrupt` if the extent tree disagrees with the block;
    /// `Incompatible` for blocks in the pre-mixed-backref format.
    pub(crate) fn cow_block(
        &mut self,
        root_id: u64,
        b: Blk,
        parent: Option<(u64, usize)>,
    ) -> Result<Blk> {
        if let Blk::Dirty(bytenr) = b {
            // Reused without COW: the handle inhibits its writeback too, or another
            // handle's end would leave it unprotected.
            self.inhibit_writeback(bytenr);
            return Ok(b);
        }
        self.assert_in_handle("COW of a tree block");
        // The last line of defence: every public mutator refuses read-only subvolumes
        // before it starts (`check_root_writable`), so reaching this is a missing check,
        // and the caller's handle aborts rather than change a read-only snapshot.
        if self.root_is_readonly(root_id)? {
            return Err(Error::posix(
                PosixKind::ReadOnly,
                format!("refusing to COW a block of read-only subvolume id {root_id}"),
            ));
        }
        let (old, level, first_key) = {
            let n = self.node(&b);
            (n.bytenr(), n.level(), if n.nritems() > 0 { n.key(0) } else { Key::MIN })
        };
        let new = self.alloc_tree_block(root_id, level, first_key)?;
        self.copy_block(&b, new, root_id)?;
        self.update_ref_for_cow(root_id, &b, new, parent.is_none())?;
        match parent {
            Some((p, slot)) => {
                let t = self.transid;
                let mut m = self.node_mut(p);
                let kp = m.key_ptr_mut(slot);
                kp.blockptr = new.into();
                kp.generation = t.into();
            }
            None => self.set_root(root_id, new, level),
        }
        self.free_tree_block(root_id, old, level)?;
        self.cowed += 1;
        self.inhibit_writeback(new);
        Ok(Blk::Dirty(new))
    }

    /// Reference bookkeeping for COWing committed block `buf` of tree `root_id` into
    /// `cow` (the kernel's backref rules):
    /// - a block only this tree uses (refs 1, no FULL_BACKREF) just moves;
    /// - a shared block this tree owns turns FULL_BACKREF: its children gain references
    ///   naming it as parent, and keep this tree's references for the copy;
    /// - a shared block owned elsewhere, or already FULL_BACKREF, gives the copy's
    ///   children references from this tree;
    /// - a FULL_BACKREF block with one reference left hands its children over: this
    ///   tree's references for the copy, the parent-named ones dropped.
    ///
    /// Then `free_tree_block` drops this tree's reference to `buf`.
    fn update_ref_for_cow(
        &mut self,
        root_id: u64,
        buf: &Blk,
        cow: u64,
        is_root: bool,
    ) -> Result<()> {
        use ubtrfs_format::key::{is_subvolume_tree, TREE_RELOC_OBJECTID};
        use ubtrfs_format::structs::{
            BACKREF_REV_SHIFT, BLOCK_FLAG_FULL_BACKREF, HEADER_FLAG_RELOC, MIXED_BACKREF_REV,
        };
        let (bytenr, level, gen, owner, hflags) = {
            let n = self.node(buf);
            (n.bytenr(), n.level(), n.generation(), n.owner(), n.header().flags.get())
        };
        if hflags >> BACKREF_REV_SHIFT < MIXED_BACKREF_REV {
            return Err(Error::Incompatible(format!("tree {root_id}: block {bytenr} uses the old (pre-2.6.31) backref format; changing it is not supported")));
        }
        let shareable = is_subvolume_tree(root_id);
        let last_snapshot =
            self.roots.get(&root_id).and_then(|s| s.item).map_or(0, |i| i.last_snapshot.get());
        let can_be_shared =
            shareable && !is_root && (gen <= last_snapshot || hflags & HEADER_FLAG_RELOC != 0);
        let (refs, flags) =
            if can_be_shared { self.lookup_tree_block_info(bytenr, level)? } else { (1, 0) };
        let bad = |reason: String| -> Error {
            Corrupt::new(CorruptWhere::Block, reason).root(root_id).block(bytenr).into()
        };
        if refs == 0 {
            return Err(bad(format!("tree block {bytenr} level {level} has 0 references")));
        }
        if owner == TREE_RELOC_OBJECTID && flags & BLOCK_FLAG_FULL_BACKREF == 0 {
            return Err(bad(format!("relocation tree block {bytenr} without FULL_BACKREF")));
        }
        if !shareable && owner != root_id {
            return Err(bad(format!(
                "tree block {bytenr} of tree {root_id} is owned by tree {owner}"
            )));
        }
        let full = flags & BLOCK_FLAG_FULL_BACKREF != 0;
        let cow = Blk::Dirty(cow);
        if refs > 1 {
            if owner == root_id && !full {
                self.mod_refs(buf, root_id, true, 1)?;
                let ns = u64::from(self.nodesize());
                self.delayed.set_tree_block_flags(
                    bytenr,
                    ns,
                    level,
                    root_id,
                    BLOCK_FLAG_FULL_BACKREF,
                )?;
            } else {
                self.mod_refs(&cow, root_id, false, 1)?;
            }
        } else if full {
            self.mod_refs(&cow, root_id, false, 1)?;
            self.mod_refs(buf, root_id, true, -1)?;
        }
        Ok(())
    }

    /// Find `key` in tree `root_id` for a change: every block on the path is COWed;
    /// `ins_len > 0` makes sure the leaf has that many free bytes (include ITEM_SIZE for
    /// a new item); `ins_len < 0` merges underfull nodes on the way (for deletes).
    /// Returns `Found` with the path to the key's item, else `NotFound` with the path to
    /// the slot where it would go.
    /// Reads that change nothing go through the live view (`Transaction::live`).
    ///
    /// # Errors
    /// `Io`/`Corrupt` reading blocks, allocation failures.
    pub(crate) fn search_slot(
        &mut self,
        root_id: u64,
        key: &Key,
        ins_len: i32,
    ) -> Result<Search<WPath>> {
        #[cfg(feature = "test-hooks")]
        if self.hooks.writeback_before_search && !self.running_refs && self.in_change_handle() {
            self.balance_dirty_metadata()?;
        }
        #[cfg(feature = "test-hooks")]
        if self.hooks.cow_stats.is_some() {
            let before = self.cowed;
            let mut restarts = 0;
            let r = self.search_slot_counted(root_id, key, ins_len, &mut restarts);
            let d = self.cowed - before;
            let s = self.hooks.cow_stats.as_mut().expect("checked above");
            s.searches += 1;
            s.cows += d;
            s.max_per_search = s.max_per_search.max(d);
            s.restarted += u64::from(restarts > 1);
            s.restarts += u64::from(restarts.saturating_sub(1));
            return r;
        }
        let mut restarts = 0;
        self.search_slot_counted(root_id, key, ins_len, &mut restarts)
    }

    fn search_slot_counted(
        &mut self,
        root_id: u64,
        key: &Key,
        ins_len: i32,
        restarts: &mut u32,
    ) -> Result<Search<WPath>> {
        'again: loop {
            *restarts += 1;
            let restarts = *restarts;
            assert!(
                restarts < 64,
                "search_slot restarted {restarts} times for {key} in tree {root_id}"
            );

            let root = self.read_root_blk(root_id)?;
            let mut b = self.cow_block(root_id, root, None)?;
            let levels = usize::from(self.node(&b).level()) + 1;
            let mut path = WPath::with_levels(levels);
            loop {
                let (level, nritems, search) = {
                    let n = self.node(&b);
                    (usize::from(n.level()), n.nritems(), n.search(key))
                };
                if level > 0 {
                    if ins_len > 0 && nritems >= max_node_ptrs(self.nodesize()) - 3 {
                        path.nodes[level] = Some(b);
                        self.split_node(root_id, &path, level)?;
                        continue 'again;
                    }
                    if ins_len < 0 {
                        path.nodes[level] = Some(b.clone());
                        if self.balance_node(root_id, &path, level)? {
                            continue 'again;
                        }
                    }
                    let slot = match search {
                        Ok(s) => s,
                        Err(s) => s.saturating_sub(1),
                    };
                    path.nodes[level] = Some(b.clone());
                    path.slots[level] = slot;
                    let child = self.read_child(&b, slot, root_id)?;
                    b = self.cow_block(root_id, child, Some((b.bytenr(), slot)))?;
                } else {
                    let slot = match search {
                        Ok(s) | Err(s) => s,
                    };
                    path.nodes[0] = Some(b.clone());
                    path.slots[0] = slot;
                    if ins_len > 0 {
                        let free = self.node(&b).leaf_free_space();
                        if free < ins_len as usize {
                            self.split_leaf(root_id, &path, key, ins_len as usize)?;
                            continue 'again;
                        }
                    }
                    return Ok(match search {
                        Ok(_) => Search::Found(path),
                        Err(_) => Search::NotFound(path),
                    });
                }
            }
        }
    }

    /// Grow the tree by one level: a new root node pointing at the old root.
    fn insert_new_root(&mut self, root_id: u64, old_root: &Blk) -> Result<()> {
        let (level, first_key, old_bytenr, old_gen) = {
            let n = self.node(old_root);
            (
                n.level(),
                if n.nritems() > 0 { n.key(0) } else { Key::MIN },
                n.bytenr(),
                n.generation(),
            )
        };
        let new = self.alloc_tree_block(root_id, level + 1, first_key)?;
        self.new_block(new, root_id, level + 1);
        self.node_mut(new).insert_ptr(0, &first_key, old_bytenr, old_gen);
        self.set_root(root_id, new, level + 1);
        Ok(())
    }

    /// Split the node at `level` of `path` in two (the parent has room, or it is the root).
    fn split_node(&mut self, root_id: u64, path: &WPath, level: usize) -> Result<()> {
        let b = path.nodes[level].clone().expect("node on path");
        if level + 1 >= path.levels() {
            return self.insert_new_root(root_id, &b);
        }
        let (n, mid_key) = {
            let node = self.node(&b);
            let n = node.nritems();
            (n, node.key(n / 2))
        };
        let mid = n / 2;
        let right = self.alloc_tree_block(root_id, level as u8, mid_key)?;
        self.new_block(right, root_id, level as u8);
        let ptrs: Vec<(Key, u64, u64)> = {
            let node = self.node(&b);
            (mid..n).map(|i| (node.key(i), node.blockptr(i), node.ptr_generation(i))).collect()
        };
        {
            let mut m = self.node_mut(right);
            for (i, (k, p, g)) in ptrs.iter().enumerate() {
                m.insert_ptr(i, k, *p, *g);
            }
        }
        self.node_mut(b.bytenr()).set_nritems(mid);
        let parent = path.nodes[level + 1].clone().expect("parent on path");
        let pslot = path.slots[level + 1];
        let t = self.transid;
        self.node_mut(parent.bytenr()).insert_ptr(pslot + 1, &mid_key, right, t);
        Ok(())
    }

    /// Merge an underfull node at `level` with a sibling, or collapse a one-child root.
    /// Returns true if the tree changed (the caller restarts its search).
    fn balance_node(&mut self, root_id: u64, path: &WPath, level: usize) -> Result<bool> {
        let b = path.nodes[level].clone().expect("node on path");
        let n = self.node(&b).nritems();
        let max = max_node_ptrs(self.nodesize());
        if level + 1 >= path.levels() {
            if n == 1 {
                // Collapse: the only child becomes the root.
                let child = self.read_child(&b, 0, root_id)?;
                let child = self.cow_block(root_id, child, Some((b.bytenr(), 0)))?;
                let clevel = self.node(&child).level();
                self.set_root(root_id, child.bytenr(), clevel);
                self.free_tree_block(root_id, b.bytenr(), level as u8)?;
                return Ok(true);
            }
            return Ok(false);
        }
        if n >= max / 4 {
            return Ok(false);
        }
        let parent = path.nodes[level + 1].clone().expect("parent on path");
        let pslot = path.slots[level + 1];
        let pn = self.node(&parent).nritems();
        // Prefer merging into the left sibling, else pull the right one in.
        if pslot > 0 {
            let left = self.read_child(&parent, pslot - 1, root_id)?;
            let ln = self.node(&left).nritems();
            if ln + n <= max - 4 {
                let left = self.cow_block(root_id, left, Some((parent.bytenr(), pslot - 1)))?;
                self.move_ptrs(&b, 0, n, left.bytenr(), ln);
                self.node_mut(parent.bytenr()).delete_ptr(pslot);
                self.free_tree_block(root_id, b.bytenr(), level as u8)?;
                return Ok(true);
            }
        }
        if pslot + 1 < pn {
            let right = self.read_child(&parent, pslot + 1, root_id)?;
            let rn = self.node(&right).nritems();
            if rn + n <= max - 4 {
                // COW first, as the kernel does, so a shared sibling's references move.
                let right = self.cow_block(root_id, right, Some((parent.bytenr(), pslot + 1)))?;
                self.move_ptrs(&right, 0, rn, b.bytenr(), n);
                self.node_mut(parent.bytenr()).delete_ptr(pslot + 1);
                self.free_tree_block(root_id, right.bytenr(), level as u8)?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Append node pointers [from, from+count) of `src` to dirty node `dst` at `at`.
    fn move_ptrs(&mut self, src: &Blk, from: usize, count: usize, dst: u64, at: usize) {
        let ptrs: Vec<(Key, u64, u64)> = {
            let s = self.node(src);
            (from..from + count).map(|i| (s.key(i), s.blockptr(i), s.ptr_generation(i))).collect()
        };
        let mut m = self.node_mut(dst);
        for (i, (k, p, g)) in ptrs.iter().enumerate() {
            m.insert_ptr(at + i, k, *p, *g);
        }
    }

    /// Copy leaf items [from, to) of `src` into dirty leaf `dst` starting at slot `at`.
    fn copy_leaf_items(&mut self, src: &Blk, from: usize, to: usize, dst: u64, at: usize) {
        let items: Vec<(Key, Vec<u8>)> = {
            let s = self.node(src);
            (from..to).map(|i| (s.key(i), s.item_data(i).to_vec())).collect()
        };
        let mut m = self.node_mut(dst);
        for (i, (k, d)) in items.iter().enumerate() {
            m.insert_item(at + i, k, d.len());
            m.item_data_mut(at + i).copy_from_slice(d);
        }
    }

    /// Make `need` bytes of room in the leaf of `path` for `key`: push items to a
    /// sibling, or split the leaf.
    fn split_leaf(&mut self, root_id: u64, path: &WPath, key: &Key, need: usize) -> Result<()> {
        let leaf = path.nodes[0].clone().expect("leaf on path");
        if path.levels() == 1 {
            return self.insert_new_root(root_id, &leaf);
        }
        if self.push_leaf_right(root_id, path, need)? || self.push_leaf_left(root_id, path, need)? {
            return Ok(());
        }
        let slot = path.slots[0];
        let area = leaf_data_size(self.nodesize());
        let (n, mut mid) = {
            let l = self.node(&leaf);
            let n = l.nritems();
            let mut mid = n.div_ceil(2);
            if slot < n && l.key(slot) == *key {
                // Growing the existing item at `slot`: it must end up in a leaf with
                // `need` bytes free and both halves must keep items (an emptied left
                // leaf would keep a parent key equal to the right one's, and searches
                // could land in it). Prefer the middle, then the item last on the
                // left, then first on the right; if neither side has room beside it,
                // split at its edge and let the restarted search split again.
                let size = ITEM_SIZE + l.item(slot).size.get() as usize;
                if size + need > area {
                    return Err(Error::posix(PosixKind::Invalid, format!("tree {root_id}: item {key} of {size} bytes cannot grow by {need} within a leaf")));
                }
                assert!(
                    n >= 2,
                    "tree {root_id}: leaf {} with one item {key} has no room to grow it by {need}",
                    leaf.bytenr()
                );
                let fits_left = |m: usize| leaf_space_used(&l, 0, m) + need <= area;
                let fits_right = |m: usize| leaf_space_used(&l, m, n) + need <= area;
                let ok = if slot < mid { fits_left(mid) } else { fits_right(mid) };
                if !ok {
                    mid = if slot + 1 < n && fits_left(slot + 1) {
                        slot + 1
                    } else if slot > 0 {
                        slot
                    } else {
                        1
                    };
                }
            } else if slot >= n {
                mid = n;
            } else if slot < mid {
                if leaf_space_used(&l, 0, mid) + need > area {
                    mid = slot;
                }
            } else if leaf_space_used(&l, mid, n) + need > area {
                mid = slot;
            }
            (n, mid)
        };
        if mid > n {
            mid = n;
        }
        let right_key = if mid < n { self.node(&leaf).key(mid) } else { *key };
        let right = self.alloc_tree_block(root_id, 0, right_key)?;
        self.new_block(right, root_id, 0);
        if mid < n {
            self.copy_leaf_items(&leaf, mid, n, right, 0);
            self.node_mut(leaf.bytenr()).delete_items(mid, n - mid);
        }
        let parent = path.nodes[1].clone().expect("parent on path");
        let pslot = path.slots[1];
        let t = self.transid;
        self.node_mut(parent.bytenr()).insert_ptr(pslot + 1, &right_key, right, t);
        Ok(())
    }

    /// Move items from the end of the leaf into its right sibling if that frees `need`.
    fn push_leaf_right(&mut self, root_id: u64, path: &WPath, need: usize) -> Result<bool> {
        let parent = path.nodes[1].clone().expect("parent on path");
        let pslot = path.slots[1];
        if pslot + 1 >= self.node(&parent).nritems() {
            return Ok(false);
        }
        let leaf = path.nodes[0].clone().expect("leaf on path");
        let slot = path.slots[0];
        let right = self.read_child(&parent, pslot + 1, root_id)?;
        let rfree = self.node(&right).leaf_free_space();
        let (n, lfree, k) = {
            let l = self.node(&leaf);
            let n = l.nritems();
            let mut used = 0;
            let mut k = 0;
            while k < n && n - k > slot {
                let sz = ITEM_SIZE + l.item(n - 1 - k).size.get() as usize;
                if used + sz > rfree {
                    break;
                }
                used += sz;
                k += 1;
            }
            (n, l.leaf_free_space(), k)
        };
        if k == 0 || k == n {
            return Ok(false);
        }
        let moved: usize = {
            let l = self.node(&leaf);
            leaf_space_used(&l, n - k, n)
        };
        if lfree + moved < need {
            return Ok(false);
        }
        let right = self.cow_block(root_id, right, Some((parent.bytenr(), pslot + 1)))?;
        self.copy_leaf_items(&leaf, n - k, n, right.bytenr(), 0);
        self.node_mut(leaf.bytenr()).delete_items(n - k, k);
        let first = self.node(&right).key(0);
        self.node_mut(parent.bytenr()).set_key(pslot + 1, &first);
        Ok(true)
    }

    /// Move items from the start of the leaf into its left sibling if that frees `need`.
    fn push_leaf_left(&mut self, root_id: u64, path: &WPath, need: usize) -> Result<bool> {
        let parent = path.nodes[1].clone().expect("parent on path");
        let pslot = path.slots[1];
        if pslot == 0 {
            return Ok(false);
        }
        let leaf = path.nodes[0].clone().expect("leaf on path");
        let slot = path.slots[0];
        let left = self.read_child(&parent, pslot - 1, root_id)?;
        let lfree_sib = self.node(&left).leaf_free_space();
        let (n, free, k) = {
            let l = self.node(&leaf);
            let n = l.nritems();
            let mut used = 0;
            let mut k = 0;
            while k < slot && k + 1 < n {
                let sz = ITEM_SIZE + l.item(k).size.get() as usize;
                if used + sz > lfree_sib {
                    break;
                }
                used += sz;
                k += 1;
            }
            (n, l.leaf_free_space(), k)
        };
        if k == 0 {
            return Ok(false);
        }
        let moved = {
            let l = self.node(&leaf);
            leaf_space_used(&l, 0, k)
        };
        if free + moved < need {
            return Ok(false);
        }
        let _ = n;
        let left = self.cow_block(root_id, left, Some((parent.bytenr(), pslot - 1)))?;
        let ln = self.node(&left).nritems();
        self.copy_leaf_items(&leaf, 0, k, left.bytenr(), ln);
        self.node_mut(leaf.bytenr()).delete_items(0, k);
        let first = self.node(&leaf).key(0);
        self.node_mut(parent.bytenr()).set_key(pslot, &first);
        Ok(true)
    }

    /// After the first key of the block at `level` changed to `key`, fix the pointer
    /// keys above it.
    fn fixup_low_keys(&mut self, path: &WPath, level: usize, key: &Key) {
        for i in level + 1..path.levels() {
            let p = path.nodes[i].as_ref().expect("path filled to the root").bytenr();
            let slot = path.slots[i];
            self.node_mut(p).set_key(slot, key);
            if slot != 0 {
                break;
            }
        }
    }

    /// Insert an empty item of `size` bytes at `key`; returns (leaf, slot). An
    /// EXTENT_DATA item describes file bytes up to `end`: the inode's extent maps are
    /// dropped over `[key.offset, end)` (u64::MAX when not known).
    ///
    /// # Errors
    /// `Posix(Exists)` if the key is present; allocation and read failures.
    fn insert_empty_item_covering(
        &mut self,
        root_id: u64,
        key: &Key,
        size: usize,
        end: u64,
    ) -> Result<(u64, usize)> {
        let max = leaf_data_size(self.nodesize()) - ITEM_SIZE;
        if size > max {
            return Err(Error::posix(
                PosixKind::Invalid,
                format!("item {key} of {size} bytes exceeds the leaf capacity {max}"),
            ));
        }
        let Search::NotFound(path) = self.search_slot(root_id, key, (size + ITEM_SIZE) as i32)?
        else {
            return Err(Error::posix(PosixKind::Exists, format!("tree {root_id} key {key}")));
        };
        self.extent_data_changed(root_id, key, end);
        let leaf = path.leaf();
        let slot = path.slot();
        self.node_mut(leaf).insert_item(slot, key, size);
        if slot == 0 {
            self.fixup_low_keys(&path, 0, key);
        }
        Ok((leaf, slot))
    }

    /// Insert an item with `data`.
    ///
    /// # Errors
    /// As `insert_empty_item_covering`.
    pub(crate) fn insert_item(&mut self, root_id: u64, key: &Key, data: &[u8]) -> Result<()> {
        let end = if key.type_ == EXTENT_DATA_KEY { extent_item_end(key, data) } else { u64::MAX };
        let (leaf, slot) = self.insert_empty_item_covering(root_id, key, data.len(), end)?;
        self.node_mut(leaf).item_data_mut(slot).copy_from_slice(data);
        Ok(())
    }

    /// Overwrite the item at `key` with `data` of the same size, in place; false (and
    /// nothing changed) when there is no such item or its size differs. An EXTENT_DATA
    /// item's extent maps are dropped over the bytes it described before and after.
    ///
    /// # Errors
    /// Read and allocation failures.
    pub(crate) fn overwrite_item(&mut self, root_id: u64, key: &Key, data: &[u8]) -> Result<bool> {
        let Search::Found(path) = self.search_slot(root_id, key, 0)? else {
            return Ok(false);
        };
        let (leaf, slot) = (path.leaf(), path.slot());
        let stale = {
            let lb = Blk::Dirty(leaf);
            let n = self.node(&lb);
            if n.item_data(slot).len() != data.len() {
                return Ok(false);
            }
            (key.type_ == EXTENT_DATA_KEY).then(|| extent_item_change(key, n.item_data(slot), data))
        };
        if let Some((start, end)) = stale {
            if start < end {
                self.extent_data_range_changed(root_id, key, start, end);
            }
        }
        self.node_mut(leaf).item_data_mut(slot).copy_from_slice(data);
        Ok(true)
    }

    /// Find `key` for modification (COWed path); `extra` bytes of room are made.
    ///
    /// # Errors
    /// Read and allocation failures.
    pub(crate) fn lookup_for_update(
        &mut self,
        root_id: u64,
        key: &Key,
        extra: usize,
    ) -> Result<Option<(u64, usize)>> {
        let Search::Found(path) = self.search_slot(root_id, key, extra as i32)? else {
            return Ok(None);
        };
        // The caller changes the item through `item_data_mut`, to any length.
        self.extent_data_changed(root_id, key, u64::MAX);
        Ok(Some((path.leaf(), path.slot())))
    }

    /// Mutable access to an item's data in a dirty leaf.
    pub(crate) fn item_data_mut(&mut self, leaf: u64, slot: usize) -> &mut [u8] {
        self.node_mut(leaf).into_item_data_mut(slot)
    }

    /// Grow the item at `key` by `by` bytes (zeroed, at its end).
    ///
    /// # Errors
    /// `Posix(NotFound)` when absent.
    pub(crate) fn extend_item(
        &mut self,
        root_id: u64,
        key: &Key,
        by: usize,
    ) -> Result<(u64, usize)> {
        let Search::Found(path) = self.search_slot(root_id, key, by as i32)? else {
            return Err(Error::posix(PosixKind::NotFound, format!("tree {root_id} key {key}")));
        };
        self.extent_data_changed(root_id, key, u64::MAX);
        self.node_mut(path.leaf()).extend_item(path.slot(), by);
        Ok((path.leaf(), path.slot()))
    }

    /// Shrink the item at `key` to `new_size` bytes.
    ///
    /// # Errors
    /// `Posix(NotFound)` when absent.
    pub(crate) fn truncate_item(&mut self, root_id: u64, key: &Key, new_size: usize) -> Result<()> {
        let Search::Found(path) = self.search_slot(root_id, key, 0)? else {
            return Err(Error::posix(PosixKind::NotFound, format!("tree {root_id} key {key}")));
        };
        self.extent_data_changed(root_id, key, u64::MAX);
        self.node_mut(path.leaf()).truncate_item(path.slot(), new_size);
        Ok(())
    }

    /// Delete the item at `key`. Returns false if it was not there.
    ///
    /// # Errors
    /// Read and allocation failures.
    pub(crate) fn delete_item(&mut self, root_id: u64, key: &Key) -> Result<bool> {
        let Search::Found(path) = self.search_slot(root_id, key, -1)? else {
            return Ok(false);
        };
        self.del_items(root_id, &path, path.slot(), 1)?;
        Ok(true)
    }

    /// Delete `nr` items at `slot` of the path's leaf, then merge or free the leaf if
    /// it became small or empty. The path is stale afterwards.
    ///
    /// # Errors
    /// Allocation and read failures while rebalancing.
    pub(crate) fn del_items(
        &mut self,
        root_id: u64,
        path: &WPath,
        slot: usize,
        nr: usize,
    ) -> Result<()> {
        let leaf = path.leaf();
        let lb = Blk::Dirty(leaf);
        for i in slot..slot + nr {
            let (key, end) = {
                let n = self.node(&lb);
                let key = n.key(i);
                (
                    key,
                    if key.type_ == EXTENT_DATA_KEY {
                        extent_item_end(&key, n.item_data(i))
                    } else {
                        0
                    },
                )
            };
            self.extent_data_changed(root_id, &key, end);
        }
        self.node_mut(leaf).delete_items(slot, nr);
        let n = self.node(&Blk::Dirty(leaf)).nritems();
        if path.levels() == 1 {
            return Ok(());
        }
        if n == 0 {
            self.del_ptr(root_id, path, 1)?;
            self.free_tree_block(root_id, leaf, 0)?;
            return self.maybe_collapse_root(root_id);
        }
        if slot == 0 {
            let first = self.node(&Blk::Dirty(leaf)).key(0);
            self.fixup_low_keys(path, 0, &first);
        }
        let lb = Blk::Dirty(leaf);
        let used = leaf_space_used(&self.node(&lb), 0, n);
        if used < leaf_data_size(self.nodesize()) / 3 {
            self.merge_leaf(root_id, path, used)?;
        }
        self.maybe_collapse_root(root_id)
    }

    /// An EXTENT_DATA item at `key` of fs tree `root_id` is changing: tell the layer
    /// above (`file_extents_changed`), which drops what it caches of the inode's
    /// `[key.offset, end)` (the extent maps). Every primitive that
    /// changes an item calls this before the change, under the writer's exclusive side,
    /// so no reader fills the maps from the tree between the drop and the change.
    fn extent_data_changed(&self, root_id: u64, key: &Key, end: u64) {
        self.extent_data_range_changed(
            root_id,
            key,
            key.offset,
            end.max(key.offset.saturating_add(1)),
        );
    }

    /// As `extent_data_changed`, for a change of the bytes `[start, end)` only.
    fn extent_data_range_changed(&self, root_id: u64, key: &Key, start: u64, end: u64) {
        if key.type_ == EXTENT_DATA_KEY {
            if let Some(f) = &self.file_extents_changed {
                f(root_id, key.objectid, start, end);
            }
            if self.track_log_changes {
                let mut m = self.log_changes.lock().unwrap_or_else(|p| p.into_inner());
                let v = m.entry((root_id, key.objectid)).or_default();
                match v.last_mut() {
                    // Sequential writes extend one range instead of adding one each.
                    Some(l) if l.0 <= end && start <= l.1 => *l = (l.0.min(start), l.1.max(end)),
                    _ => v.push((start, end)),
                }
            }
        }
    }

    /// Merge a small leaf into its left sibling, or its right sibling into it.
    fn merge_leaf(&mut self, root_id: u64, path: &WPath, used: usize) -> Result<()> {
        let leaf = path.leaf();
        let parent = path.nodes[1].clone().expect("parent on path");
        let pslot = path.slots[1];
        let pn = self.node(&parent).nritems();
        if pslot > 0 {
            let left = self.read_child(&parent, pslot - 1, root_id)?;
            // Only when the merged leaf keeps a quarter of its room: a leaf merged full
            // splits again at the next insertion, and a commit's rounds (each adding
            // and dropping extent items) could split and merge the same leaves forever.
            if self.node(&left).leaf_free_space() >= used + leaf_data_size(self.nodesize()) / 4 {
                let left = self.cow_block(root_id, left, Some((parent.bytenr(), pslot - 1)))?;
                let ln = self.node(&left).nritems();
                let n = self.node(&Blk::Dirty(leaf)).nritems();
                self.copy_leaf_items(&Blk::Dirty(leaf), 0, n, left.bytenr(), ln);
                self.node_mut(leaf).set_nritems(0);
                let mut p = path.clone();
                p.nodes.truncate(path.levels());
                self.del_ptr(root_id, &p, 1)?;
                self.free_tree_block(root_id, leaf, 0)?;
                return Ok(());
            }
        }
        if pslot + 1 < pn {
            let right = self.read_child(&parent, pslot + 1, root_id)?;
            let rused = {
                let r = self.node(&right);
                leaf_space_used(&r, 0, r.nritems())
            };
            if self.node(&Blk::Dirty(leaf)).leaf_free_space()
                >= rused + leaf_data_size(self.nodesize()) / 4
            {
                let right = self.cow_block(root_id, right, Some((parent.bytenr(), pslot + 1)))?;
                let rn = self.node(&right).nritems();
                let n = self.node(&Blk::Dirty(leaf)).nritems();
                self.copy_leaf_items(&right, 0, rn, leaf, n);
                let mut p = path.clone();
                p.slots[1] = pslot + 1;
                self.del_ptr(root_id, &p, 1)?;
                self.free_tree_block(root_id, right.bytenr(), 0)?;
            }
        }
        Ok(())
    }

    /// Remove the pointer at `path.slots[level]` from the node at `level`.
    fn del_ptr(&mut self, root_id: u64, path: &WPath, level: usize) -> Result<()> {
        let node = path.nodes[level].as_ref().expect("node on path").bytenr();
        let slot = path.slots[level];
        self.node_mut(node).delete_ptr(slot);
        let n = self.node(&Blk::Dirty(node)).nritems();
        if n == 0 {
            if level + 1 >= path.levels() {
                // The whole tree is gone: the root becomes an empty leaf, and the
                // METADATA_ITEM it gets at commit says so.
                self.node_mut(node).header_mut().level = 0;
                self.delayed.relevel_new_tree_block(node, 0);
                self.set_root(root_id, node, 0);
                return Ok(());
            }
            self.del_ptr(root_id, path, level + 1)?;
            return self.free_tree_block(root_id, node, level as u8);
        }
        if slot == 0 {
            let first = self.node(&Blk::Dirty(node)).key(0);
            self.fixup_low_keys(path, level, &first);
        }
        Ok(())
    }

    /// A root node with a single child hands the root to that child.
    fn maybe_collapse_root(&mut self, root_id: u64) -> Result<()> {
        loop {
            let root = self.read_root_blk(root_id)?;
            let (level, n) = {
                let r = self.node(&root);
                (r.level(), r.nritems())
            };
            if level == 0 || n != 1 {
                return Ok(());
            }
            let root = self.cow_block(root_id, root, None)?;
            let child = self.read_child(&root, 0, root_id)?;
            let child = self.cow_block(root_id, child, Some((root.bytenr(), 0)))?;
            let clevel = self.node(&child).level();
            self.set_root(root_id, child.bytenr(), clevel);
            self.free_tree_block(root_id, root.bytenr(), level)?;
        }
    }

    /// The first item with key >= `key`, as the running transaction sees it, copied
    /// out (the live view's `first_item_ge`).
    ///
    /// # Errors
    /// Read failures.
    pub fn first_item_ge(&mut self, root: &RootInfo, key: &Key) -> Result<Option<(Key, Vec<u8>)>> {
        Ok(self.live().first_item_ge(root, key)?.map(|i| (i.key(), i.data().to_vec())))
    }

    /// Items with keys in [from, to] of tree `root_id`, as the running transaction
    /// sees them, copied out.
    ///
    /// # Errors
    /// Read failures.
    pub fn items_in_range(
        &mut self,
        root_id: u64,
        from: &Key,
        to: &Key,
    ) -> Result<Vec<(Key, Vec<u8>)>> {
        let root = self.root(root_id)?;
        Ok(self
            .live()
            .items_in_range(&root, from, to)?
            .into_iter()
            .map(|i| (i.key(), i.data().to_vec()))
            .collect())
    }

    /// The item with the greatest key <= `key` in tree `root_id`, as the running
    /// transaction sees it, copied out.
    ///
    /// # Errors
    /// Read failures.
    pub fn last_item_le(&mut self, root_id: u64, key: &Key) -> Result<Option<(Key, Vec<u8>)>> {
        let root = self.root(root_id)?;
        Ok(self.live().search_le(&root, key)?.map(|i| (i.key(), i.data().to_vec())))
    }

    /// Check tree `root_id`: key order within and across blocks, pointer keys equal to
    /// child first keys, pointer generations equal to child generations, levels
    /// decreasing by one, leaf layout packed, no empty non-root blocks.
    ///
    /// # Errors
    /// `Corrupt` describing the first violation.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn check_invariants(&mut self, root_id: u64) -> Result<()> {
        let root = self.read_root_blk(root_id)?;
        let mut last: Option<Key> = None;
        let mut stack = vec![(root, true)];
        let bad = |b: u64, r: String| -> Error {
            Corrupt::new(CorruptWhere::Block, r).block(b).root(root_id).into()
        };
        while let Some((b, is_root)) = stack.pop() {
            let n = self.node(&b);
            let bytenr = n.bytenr();
            if n.nritems() == 0 && !is_root {
                return Err(bad(bytenr, "empty non-root block".into()));
            }
            if n.level() == 0 {
                let mut end = leaf_data_size(self.nodesize());
                for i in 0..n.nritems() {
                    let it = n.item(i);
                    if it.offset.get() as usize + it.size.get() as usize != end {
                        return Err(bad(bytenr, format!("slot {i} not packed")));
                    }
                    end = it.offset.get() as usize;
                    let k = n.key(i);
                    if let Some(l) = last {
                        if k <= l {
                            return Err(bad(bytenr, format!("key {k} after {l}")));
                        }
                    }
                    last = Some(k);
                }
                continue;
            }
            let mut children = Vec::new();
            for i in 0..n.nritems() {
                children.push((i, n.key(i), n.ptr_generation(i)));
            }
            let level = n.level();
            let mut kids = Vec::new();
            for (i, k, g) in children {
                let c = self.read_child(&b, i, root_id)?;
                let cn = self.node(&c);
                if cn.level() + 1 != level {
                    return Err(bad(
                        bytenr,
                        format!("child {i} level {} under level {level}", cn.level()),
                    ));
                }
                if cn.generation() != g {
                    return Err(bad(
                        bytenr,
                        format!("child {i} generation {} != ptr generation {g}", cn.generation()),
                    ));
                }
                if cn.nritems() > 0 && cn.key(0) != k {
                    return Err(bad(
                        bytenr,
                        format!("child {i} first key {} != ptr key {k}", cn.key(0)),
                    ));
                }
                kids.push((c, false));
            }
            kids.reverse();
            stack.extend(kids);
        }
        Ok(())
    }
}

/// The B-tree operations themselves, for tests of the tree code (`Transaction::raw_tree`,
/// behind the test-hooks feature). Everything else changes trees through the inode and
/// extent operations, which check what they change first and abort on failure; here a
/// failure aborts the transaction too. Writeback never runs between these calls, so a
/// (leaf, slot) from one stays valid for `item_data_mut`.
#[cfg(feature = "test-hooks")]
pub struct RawTree<'a> {
    w: &'a mut Transaction,
}

#[cfg(feature = "test-hooks")]
impl Transaction {
    /// The raw B-tree operations (test hook).
    pub fn raw_tree(&mut self) -> RawTree<'_> {
        RawTree { w: self }
    }
}

#[cfg(feature = "test-hooks")]
impl<'a> RawTree<'a> {
    fn run<T>(
        &mut self,
        at: &'static str,
        root_id: u64,
        f: impl FnOnce(&mut Transaction) -> Result<T>,
    ) -> Result<T> {
        // Refused before anything changes (a read-only subvolume), as the public
        // mutators do: no abort for that.
        self.w.check_root_writable(root_id)?;
        let mut h = self.w.join_transaction(at)?;
        let r = f(&mut h);
        match r {
            // No writeback at the end: a (leaf, slot) returned stays dirty for
            // `item_data_mut`.
            Ok(v) => {
                h.end_without_writeback();
                Ok(v)
            }
            Err(e) => h.end_with(Err(e)),
        }
    }
    /// # Errors
    /// As the tree operation; a failure aborts.
    pub fn insert_item(&mut self, root_id: u64, key: &Key, data: &[u8]) -> Result<()> {
        self.run("insert_item", root_id, |w| w.insert_item(root_id, key, data))
    }
    /// # Errors
    /// As the tree operation; a failure aborts.
    pub fn delete_item(&mut self, root_id: u64, key: &Key) -> Result<bool> {
        self.run("delete_item", root_id, |w| w.delete_item(root_id, key))
    }
    /// # Errors
    /// As the tree operation; a failure aborts.
    pub fn extend_item(&mut self, root_id: u64, key: &Key, by: usize) -> Result<(u64, usize)> {
        self.run("extend_item", root_id, |w| w.extend_item(root_id, key, by))
    }
    /// # Errors
    /// As the tree operation; a failure aborts.
    pub fn truncate_item(&mut self, root_id: u64, key: &Key, new_size: usize) -> Result<()> {
        self.run("truncate_item", root_id, |w| w.truncate_item(root_id, key, new_size))
    }
    /// # Errors
    /// As the tree operation; a failure aborts.
    pub fn lookup_for_update(
        &mut self,
        root_id: u64,
        key: &Key,
        extra: usize,
    ) -> Result<Option<(u64, usize)>> {
        self.run("lookup_for_update", root_id, |w| w.lookup_for_update(root_id, key, extra))
    }
    /// The data of the item at (leaf, slot), which the previous call COWed.
    pub fn item_data_mut(self, leaf: u64, slot: usize) -> &'a mut [u8] {
        self.w.item_data_mut(leaf, slot)
    }
}
