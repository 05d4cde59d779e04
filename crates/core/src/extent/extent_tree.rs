//! The extent tree: allocating and freeing tree blocks and data extents through
//! delayed references, and running those references at commit into METADATA_ITEM /
//! EXTENT_ITEM items with inline and keyed backrefs in the kernel's ordering.
//!
//! Accounting kept exact here: block-group `used` (and so superblock `bytes_used`),
//! the free-space tree (every insert removes the range, every final drop adds it back),
//! and pinning (freed committed extents are reusable only after the commit).
//! Neighbours: `delayed_ref` (the queue), `alloc` (space), `free_space_tree`, `csum`.

use crate::error::{Error, PosixKind, Result};
use crate::extent::delayed_ref::{NewExtent, RefHead, RefKind};
use crate::transaction::Transaction;
use ubtrfs_format::hash::hash_extent_data_ref;
use ubtrfs_format::items::{self, InlineRef};
use ubtrfs_format::key::*;
use ubtrfs_format::node::ITEM_SIZE;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

/// Damage in the extent tree, said of the extent item `key`.
fn corrupt(key: Key, r: String) -> Error {
    Corrupt::new(CorruptWhere::Item, r).root(EXTENT_TREE_OBJECTID).key(key).into()
}

/// A reference error said of the item that makes it: slot `slot` (key `key`) of block
/// `block` in tree `root` (a file extent in a leaf, a pointer in a node).
fn at_referrer(e: Error, root: u64, block: u64, level: u8, slot: usize, key: Key) -> Error {
    match e {
        Error::Corrupt(mut c) => {
            c.what = if level == 0 { CorruptWhere::Leaf } else { CorruptWhere::Node };
            c.root = Some(root);
            c.block = Some(block);
            c.slot = Some(slot as u32);
            c.key = Some(key);
            Error::Corrupt(c)
        }
        e => e,
    }
}

/// A reference count the on-disk counters (u32) cannot hold.
fn count_fits(key: Key, kind: RefKind, count: i64) -> Result<()> {
    let counted = matches!(kind, RefKind::Data { .. } | RefKind::SharedData { .. });
    if counted && count > i64::from(u32::MAX) {
        return Err(corrupt(
            key,
            format!("reference {kind:?} count {count} overflows its 32-bit counter"),
        ));
    }
    Ok(())
}

fn to_inline(kind: RefKind, count: i64) -> InlineRef {
    match kind {
        RefKind::TreeBlock { root } => InlineRef::TreeBlock { root },
        RefKind::SharedBlock { parent } => InlineRef::SharedBlock { parent },
        RefKind::Data { root, ino, offset } => {
            InlineRef::ExtentData { root, objectid: ino, offset, count: count as u32 }
        }
        RefKind::SharedData { parent } => InlineRef::SharedData { parent, count: count as u32 },
    }
}

fn from_inline(r: &InlineRef) -> Option<(RefKind, i64)> {
    Some(match *r {
        InlineRef::TreeBlock { root } => (RefKind::TreeBlock { root }, 1),
        InlineRef::SharedBlock { parent } => (RefKind::SharedBlock { parent }, 1),
        InlineRef::ExtentData { root, objectid, offset, count } => {
            (RefKind::Data { root, ino: objectid, offset }, i64::from(count))
        }
        InlineRef::SharedData { parent, count } => {
            (RefKind::SharedData { parent }, i64::from(count))
        }
        InlineRef::Owner { .. } => return None,
    })
}

fn inline_size(r: &InlineRef) -> usize {
    1 + match r {
        InlineRef::ExtentData { .. } => 28,
        InlineRef::SharedData { .. } => 12,
        _ => 8,
    }
}

/// Sort key of an inline ref: type ascending, then seq descending.
fn inline_order(r: &InlineRef) -> (u8, std::cmp::Reverse<u64>) {
    let seq = match *r {
        InlineRef::TreeBlock { root } => root,
        InlineRef::SharedBlock { parent } => parent,
        InlineRef::ExtentData { root, objectid, offset, .. } => {
            hash_extent_data_ref(root, objectid, offset)
        }
        InlineRef::SharedData { parent, .. } => parent,
        InlineRef::Owner { root } => root,
    };
    (r.type_(), std::cmp::Reverse(seq))
}

/// Serialize an extent item body (skinny form for tree blocks).
pub fn serialize_extent_item(
    refs: u64,
    generation: u64,
    flags: u64,
    inline: &[InlineRef],
) -> Vec<u8> {
    let mut v = Vec::with_capacity(24 + inline.len() * 29);
    v.extend_from_slice(&refs.to_le_bytes());
    v.extend_from_slice(&generation.to_le_bytes());
    v.extend_from_slice(&flags.to_le_bytes());
    let mut sorted = inline.to_vec();
    sorted.sort_by_key(inline_order);
    for r in &sorted {
        v.push(r.type_());
        match *r {
            InlineRef::TreeBlock { root } | InlineRef::Owner { root } => {
                v.extend_from_slice(&root.to_le_bytes())
            }
            InlineRef::SharedBlock { parent } => v.extend_from_slice(&parent.to_le_bytes()),
            InlineRef::ExtentData { root, objectid, offset, count } => {
                v.extend_from_slice(&root.to_le_bytes());
                v.extend_from_slice(&objectid.to_le_bytes());
                v.extend_from_slice(&offset.to_le_bytes());
                v.extend_from_slice(&count.to_le_bytes());
            }
            InlineRef::SharedData { parent, count } => {
                v.extend_from_slice(&parent.to_le_bytes());
                v.extend_from_slice(&count.to_le_bytes());
            }
        }
    }
    v
}

fn keyed_key(bytenr: u64, kind: RefKind) -> Key {
    match kind {
        RefKind::TreeBlock { root } => Key::new(bytenr, TREE_BLOCK_REF_KEY, root),
        RefKind::SharedBlock { parent } => Key::new(bytenr, SHARED_BLOCK_REF_KEY, parent),
        RefKind::Data { root, ino, offset } => {
            Key::new(bytenr, EXTENT_DATA_REF_KEY, hash_extent_data_ref(root, ino, offset))
        }
        RefKind::SharedData { parent } => Key::new(bytenr, SHARED_DATA_REF_KEY, parent),
    }
}

fn keyed_body(kind: RefKind, count: i64) -> Vec<u8> {
    match kind {
        RefKind::TreeBlock { .. } | RefKind::SharedBlock { .. } => Vec::new(),
        RefKind::Data { root, ino, offset } => {
            let mut v = Vec::with_capacity(28);
            v.extend_from_slice(&root.to_le_bytes());
            v.extend_from_slice(&ino.to_le_bytes());
            v.extend_from_slice(&offset.to_le_bytes());
            v.extend_from_slice(&(count as u32).to_le_bytes());
            v
        }
        RefKind::SharedData { .. } => (count as u32).to_le_bytes().to_vec(),
    }
}

fn keyed_count(kind: RefKind, data: &[u8]) -> i64 {
    match kind {
        RefKind::TreeBlock { .. } | RefKind::SharedBlock { .. } => 1,
        RefKind::Data { .. } => i64::from(u32::from_le_bytes(
            data[24..28].try_into().expect("size checked by the tree checker"),
        )),
        RefKind::SharedData { .. } => i64::from(u32::from_le_bytes(
            data[0..4].try_into().expect("size checked by the tree checker"),
        )),
    }
}

impl Transaction {
    /// Largest extent item the kernel keeps inline refs in.
    fn max_extent_item_size(&self) -> usize {
        (self.nodesize() as usize - ubtrfs_format::node::HEADER_SIZE) / 16 - ITEM_SIZE
    }

    /// Allocate a tree block for tree `root_id`; the caller fills it in (new_block or
    /// copy_block). Its METADATA_ITEM is inserted at commit.
    ///
    /// # Errors
    /// `Posix(NoSpace)` when no metadata space can be found or made.
    pub(crate) fn alloc_tree_block(
        &mut self,
        root_id: u64,
        level: u8,
        first_key: Key,
    ) -> Result<u64> {
        let ty =
            if root_id == CHUNK_TREE_OBJECTID { BLOCK_GROUP_SYSTEM } else { BLOCK_GROUP_METADATA };
        let ns = u64::from(self.nodesize());
        self.assert_in_handle("tree block allocation");
        let bytenr = crate::space::allocator::alloc_extent(self, ty, ns)?;
        if ty == BLOCK_GROUP_METADATA {
            self.charge_tree_block();
        }
        self.delayed.add_tree_ref(
            bytenr,
            ns,
            level,
            RefKind::TreeBlock { root: root_id },
            1,
            Some(first_key),
        )?;
        Ok(bytenr)
    }

    /// Drop tree `root_id`'s reference to a tree block (the kernel's
    /// `btrfs_free_tree_block` with no parent). A block still shared with another tree
    /// keeps its other references; the last reference frees it when the refs run.
    ///
    /// # Errors
    /// `Corrupt` when a file extent names the block as data in this transaction.
    pub(crate) fn free_tree_block(&mut self, root_id: u64, bytenr: u64, level: u8) -> Result<()> {
        self.drop_tree_ref(bytenr, level, RefKind::TreeBlock { root: root_id })
    }

    /// Drop reference `kind` (keyed by a tree, or naming a parent block) to tree block
    /// `bytenr` (`btrfs_free_tree_block`); the last reference frees it, as in
    /// `free_tree_block`.
    ///
    /// # Errors
    /// As `free_tree_block`.
    pub(crate) fn drop_tree_ref(&mut self, bytenr: u64, level: u8, kind: RefKind) -> Result<()> {
        let was = self.forget_dirty(bytenr);
        let ns = u64::from(self.nodesize());
        self.delayed.add_tree_ref(bytenr, ns, level, kind, -1, None)?;
        // A block of this transaction (never committed, maybe written early) freed again:
        // nothing committed refers to it, so its space is free now rather than at commit;
        // under writeback, paths COWed again and again would otherwise fill the disk. One
        // whose writeback may still be writing it is held until the commit instead, so
        // that write cannot land on the block allocated there next.
        if self.delayed.drop_if_cancelled(bytenr) {
            crate::space::allocator::unreserve(
                self,
                bytenr,
                ns,
                was == crate::transaction::Forgot::Writing,
            );
        }
        Ok(())
    }

    /// As `alloc_data_extent`, but settle for less than `num_bytes` (down to one
    /// sector) when free space is fragmented or a chunk is smaller than the request.
    /// Returns (bytenr, length).
    ///
    /// # Errors
    /// `Posix(NoSpace)` when not even a sector can be found or made; `Corrupt` as for
    /// `alloc_data_extent`.
    pub fn alloc_data_extent_upto(
        &mut self,
        num_bytes: u64,
        root: u64,
        ino: u64,
        offset: u64,
    ) -> Result<(u64, u64)> {
        let ss = u64::from(self.sectorsize());
        let (bytenr, len) =
            crate::space::allocator::alloc_extent_upto(self, BLOCK_GROUP_DATA, num_bytes, ss)?;
        self.delayed.add_data_ref(bytenr, len, RefKind::Data { root, ino, offset }, 1, true)?;
        Ok((bytenr, len))
    }

    /// The first reference to a data extent a log tree used, which has no extent item
    /// yet (the kernel's `btrfs_alloc_logged_file_extent`): its space was taken out of
    /// the free space when the replay began (`allocator::exclude_logged`); the commit
    /// inserts its item and accounts it, as for an extent allocated now.
    ///
    /// # Errors
    /// As `DelayedRefs::add_data_ref`.
    pub(crate) fn add_logged_data_extent(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        root: u64,
        ino: u64,
        offset: u64,
    ) -> Result<()> {
        self.delayed.add_data_ref(bytenr, num_bytes, RefKind::Data { root, ino, offset }, 1, true)
    }

    /// Reference count and flags of committed tree block `bytenr` at `level`, with
    /// this transaction's pending changes applied (`btrfs_lookup_extent_info`).
    ///
    /// # Errors
    /// `Corrupt` if the block has no METADATA_ITEM; read failures.
    pub(crate) fn lookup_tree_block_info(&mut self, bytenr: u64, level: u8) -> Result<(u64, u64)> {
        let key = Key::new(bytenr, METADATA_ITEM_KEY, u64::from(level));
        let root = self.root(EXTENT_TREE_OBJECTID)?;
        let cur = match self.first_item_ge(&root, &key)? {
            Some((k, data)) if k == key => {
                items::extent_item(&data, true).map_err(|e| corrupt(key, e))?
            }
            _ => {
                return Err(corrupt(
                    key,
                    format!("tree block {bytenr} level {level} has no extent item {key}"),
                ))
            }
        };
        let (delta, flags) = self.delayed.pending(bytenr);
        let refs =
            i64::try_from(cur.refs).ok().and_then(|r| r.checked_add(delta)).ok_or_else(|| {
                corrupt(
                    key,
                    format!("tree block {bytenr} reference count {} + {delta} overflows", cur.refs),
                )
            })?;
        if refs < 0 {
            return Err(corrupt(key, format!("tree block {bytenr} would have {refs} references")));
        }
        Ok((refs as u64, cur.flags | flags))
    }

    /// Add or drop (`delta`) the references block `blk` holds on what it points at
    /// (`btrfs_inc_ref` / `btrfs_dec_ref`): child blocks of a node, data extents of a
    /// leaf's file extent items. With `full_backref` the references name `blk` as
    /// parent (SHARED_BLOCK_REF / SHARED_DATA_REF), else they name tree `root_id`.
    ///
    /// # Errors
    /// `Corrupt` for a file extent item that does not parse (the tree checker accepted
    /// the block, so this means memory and disk disagree), or for a reference that
    /// contradicts another one of this transaction (another length, another kind),
    /// naming the item that makes it.
    pub(crate) fn mod_refs(
        &mut self,
        blk: &crate::transaction::Blk,
        root_id: u64,
        full_backref: bool,
        delta: i64,
    ) -> Result<()> {
        let ns = u64::from(self.nodesize());
        let n = self.node(blk);
        let parent = n.bytenr();
        let level = n.level();
        let mut tree = Vec::new();
        let mut data = Vec::new();
        for slot in 0..n.nritems() {
            if level > 0 {
                tree.push((n.blockptr(slot), slot, n.key(slot)));
                continue;
            }
            let key = n.key(slot);
            if key.type_ != EXTENT_DATA_KEY {
                continue;
            }
            let fe = items::file_extent(n.item_data(slot)).map_err(|e| {
                Corrupt::new(CorruptWhere::Item, e)
                    .root(n.owner())
                    .block(parent)
                    .slot(slot as u32, key)
            })?;
            if let items::FileExtent::Regular { disk_bytenr, disk_num_bytes, offset, .. } = fe {
                if disk_bytenr != 0 {
                    data.push((
                        disk_bytenr,
                        disk_num_bytes,
                        key.objectid,
                        key.offset.wrapping_sub(offset),
                        slot,
                        key,
                    ));
                }
            }
        }
        for (child, slot, key) in tree {
            let kind = if full_backref {
                RefKind::SharedBlock { parent }
            } else {
                RefKind::TreeBlock { root: root_id }
            };
            self.delayed
                .add_tree_ref(child, ns, level - 1, kind, delta, None)
                .map_err(|e| at_referrer(e, root_id, parent, level, slot, key))?;
        }
        for (bytenr, len, ino, offset, slot, key) in data {
            let kind = if full_backref {
                RefKind::SharedData { parent }
            } else {
                RefKind::Data { root: root_id, ino, offset }
            };
            self.delayed
                .add_data_ref(bytenr, len, kind, delta, false)
                .map_err(|e| at_referrer(e, root_id, parent, level, slot, key))?;
        }
        Ok(())
    }

    /// Add or drop (`delta`) a file's reference to a data extent.
    ///
    /// # Errors
    /// `Corrupt` naming (root, ino) when this transaction already references `bytenr`
    /// with another length or as a tree block: the file extent contradicts another.
    pub(crate) fn data_ref(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        root: u64,
        ino: u64,
        offset: u64,
        delta: i64,
    ) -> Result<()> {
        self.delayed.add_data_ref(
            bytenr,
            num_bytes,
            RefKind::Data { root, ino, offset },
            delta,
            false,
        )
    }
}

/// Apply every delayed ref to the extent tree. Returns whether anything ran.
///
/// # Errors
/// `Corrupt` if the extent tree disagrees with the refs; allocation and I/O errors.
pub fn run_delayed_refs(w: &mut Transaction) -> Result<bool> {
    let heads = w.delayed.take_all();
    if heads.is_empty() {
        return Ok(false);
    }
    for (i, h) in heads.into_iter().enumerate() {
        run_one(w, h)?;
        // Running a large transaction's refs dirties many extent-tree leaves: write
        // back between heads (no path is held there) so a commit stays in its budget.
        if i % 256 == 255 {
            w.balance_dirty_metadata()?;
        }
    }
    Ok(true)
}

fn run_one(w: &mut Transaction, mut h: RefHead) -> Result<()> {
    h.refs.retain(|_, d| *d != 0);
    if let Some(new) = h.must_insert {
        if h.refs.is_empty() {
            // Allocated and freed within this transaction: it never reached disk. Its
            // data csums did reach the csum tree (`write_new_extent` inserts them at
            // once); left there they would cover free space and collide with the next
            // extent allocated here (the kernel's `cleanup_ref_head` deletes them too).
            if h.is_data {
                crate::extent::csum_tree::del_csums(w, h.bytenr, h.num_bytes)?;
            }
            crate::space::allocator::unreserve(w, h.bytenr, h.num_bytes, false);
            return Ok(());
        }
        for (k, d) in &h.refs {
            if *d < 0 {
                return Err(corrupt(
                    extent_key(&h),
                    format!("new extent {} has negative reference {k:?} {d}", h.bytenr),
                ));
            }
        }
        return insert_new_extent(w, &h, new);
    }
    if h.refs.is_empty() && h.set_flags == 0 {
        return Ok(());
    }
    update_extent(w, &h)
}

fn insert_new_extent(w: &mut Transaction, h: &RefHead, new: NewExtent) -> Result<()> {
    let total: i64 = h.total();
    let (key, flags) = match new {
        NewExtent::Tree { level, .. } => (
            Key::new(h.bytenr, METADATA_ITEM_KEY, u64::from(level)),
            EXTENT_FLAG_TREE_BLOCK | h.set_flags,
        ),
        NewExtent::Data => (Key::new(h.bytenr, EXTENT_ITEM_KEY, h.num_bytes), EXTENT_FLAG_DATA),
    };
    let max = w.max_extent_item_size();
    let mut inline = Vec::new();
    let mut keyed = Vec::new();
    let mut size = 24;
    for (&k, &d) in &h.refs {
        let r = to_inline(k, d);
        if size + inline_size(&r) <= max {
            size += inline_size(&r);
            inline.push(r);
        } else {
            keyed.push((k, d));
        }
    }
    let body = serialize_extent_item(total as u64, w.transid, flags, &inline);
    match w.insert_item(EXTENT_TREE_OBJECTID, &key, &body) {
        Err(e) if e.posix_kind() == Some(PosixKind::Exists) => {
            // The allocator handed out space the extent tree says is in use: the free
            // space tree (which the allocator's cache is loaded from) calls it free.
            return Err(corrupt(key, format!("extent item of newly allocated extent {} already exists: the free space tree marks space in use as free", h.bytenr)));
        }
        r => r?,
    }
    for (k, d) in keyed {
        w.insert_item(EXTENT_TREE_OBJECTID, &keyed_key(h.bytenr, k), &keyed_body(k, d))?;
    }
    crate::space::allocator::update_used(w, h.bytenr, h.num_bytes, true)?;
    crate::space::free_space_tree::remove_from_free_space_tree_in(w, h.bytenr, h.num_bytes)?;
    Ok(())
}

fn extent_key(h: &RefHead) -> Key {
    if h.is_data {
        Key::new(h.bytenr, EXTENT_ITEM_KEY, h.num_bytes)
    } else {
        Key::new(h.bytenr, METADATA_ITEM_KEY, u64::from(h.level))
    }
}

fn read_extent(w: &mut Transaction, h: &RefHead) -> Result<items::ExtentItemView> {
    let key = extent_key(h);
    let root = w.root(EXTENT_TREE_OBJECTID)?;
    match w.first_item_ge(&root, &key)? {
        Some((k, data)) if k == key => {
            items::extent_item(&data, !h.is_data).map_err(|e| corrupt(key, e))
        }
        _ => Err(corrupt(
            key,
            format!("extent item {key} missing while dropping or adding references"),
        )),
    }
}

fn update_extent(w: &mut Transaction, h: &RefHead) -> Result<()> {
    let cur = read_extent(w, h)?;
    let key = extent_key(h);
    let mut inline: Vec<(RefKind, i64)> = cur.inline_refs.iter().filter_map(from_inline).collect();
    let owners: Vec<InlineRef> =
        cur.inline_refs.iter().filter(|r| matches!(r, InlineRef::Owner { .. })).copied().collect();
    let mut refs = i64::try_from(cur.refs).map_err(|_| {
        corrupt(key, format!("extent {} reference count {} is out of range", h.bytenr, cur.refs))
    })?;
    let max = w.max_extent_item_size();
    for (&kind, &delta) in &h.refs {
        refs = refs.checked_add(delta).ok_or_else(|| {
            corrupt(key, format!("extent {} reference count {refs} + {delta} overflows", h.bytenr))
        })?;
        if let Some(pos) = inline.iter().position(|(k, _)| *k == kind) {
            inline[pos].1 += delta;
            if inline[pos].1 < 0 {
                return Err(corrupt(key, format!("reference {kind:?} would drop below zero")));
            }
            count_fits(key, kind, inline[pos].1)?;
            if inline[pos].1 == 0 {
                inline.remove(pos);
            }
            continue;
        }
        let kk = keyed_key(h.bytenr, kind);
        let root = w.root(EXTENT_TREE_OBJECTID)?;
        let existing = match w.first_item_ge(&root, &kk)? {
            Some((k, d)) if k == kk => Some(keyed_count(kind, &d)),
            _ => None,
        };
        match existing {
            Some(c) => {
                let n = c + delta;
                if n < 0 {
                    return Err(corrupt(
                        key,
                        format!("keyed reference {kind:?} would drop below zero"),
                    ));
                }
                count_fits(key, kind, n)?;
                w.delete_item(EXTENT_TREE_OBJECTID, &kk)?;
                if n > 0 {
                    w.insert_item(EXTENT_TREE_OBJECTID, &kk, &keyed_body(kind, n))?;
                }
            }
            None if delta > 0 => {
                count_fits(key, kind, delta)?;
                let cur_size: usize = 24
                    + inline.iter().map(|(k, c)| inline_size(&to_inline(*k, *c))).sum::<usize>()
                    + owners.len() * 9;
                if cur_size + inline_size(&to_inline(kind, delta)) <= max {
                    inline.push((kind, delta));
                } else {
                    w.insert_item(EXTENT_TREE_OBJECTID, &kk, &keyed_body(kind, delta))?;
                }
            }
            None => {
                return Err(corrupt(
                    key,
                    format!("dropping reference {kind:?} that does not exist"),
                ))
            }
        }
    }
    if refs < 0 {
        return Err(corrupt(key, format!("extent refs would become {refs}")));
    }
    if refs == 0 {
        w.delete_item(EXTENT_TREE_OBJECTID, &key)?;
        crate::space::allocator::update_used(w, h.bytenr, h.num_bytes, false)?;
        crate::space::free_space_tree::add_to_free_space_tree_in(w, h.bytenr, h.num_bytes)?;
        crate::space::allocator::pin(w, h.bytenr, h.num_bytes)?;
        if h.is_data {
            crate::extent::csum_tree::del_csums(w, h.bytenr, h.num_bytes)?;
        }
        return Ok(());
    }
    let mut all: Vec<InlineRef> = inline.iter().map(|(k, c)| to_inline(*k, *c)).collect();
    all.extend(owners);
    let body = serialize_extent_item(refs as u64, cur.generation, cur.flags | h.set_flags, &all);
    let (leaf, slot) = w
        .lookup_for_update(EXTENT_TREE_OBJECTID, &key, body.len())?
        .ok_or_else(|| corrupt(key, format!("extent item {key} vanished")))?;
    let old_len = w.item_data_mut(leaf, slot).len();
    if body.len() > old_len {
        w.extend_item(EXTENT_TREE_OBJECTID, &key, body.len() - old_len)?;
    } else if body.len() < old_len {
        w.truncate_item(EXTENT_TREE_OBJECTID, &key, body.len())?;
    }
    let (leaf, slot) = w
        .lookup_for_update(EXTENT_TREE_OBJECTID, &key, 0)?
        .ok_or_else(|| corrupt(key, format!("extent item {key} vanished")))?;
    w.item_data_mut(leaf, slot).copy_from_slice(&body);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_order_type_then_seq_descending() {
        let refs = [
            InlineRef::TreeBlock { root: 5 },
            InlineRef::SharedBlock { parent: 100 },
            InlineRef::TreeBlock { root: 7 },
        ];
        let v = serialize_extent_item(3, 9, EXTENT_FLAG_TREE_BLOCK, &refs);
        let p = items::extent_item(&v, true).unwrap();
        assert_eq!(
            p.inline_refs,
            vec![
                InlineRef::TreeBlock { root: 7 },
                InlineRef::TreeBlock { root: 5 },
                InlineRef::SharedBlock { parent: 100 }
            ]
        );
        assert_eq!(v.len(), 24 + 27);
    }
}
