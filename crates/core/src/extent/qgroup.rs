//! Quota groups on the write path. With quotas on (a QGROUP_STATUS item in the quota
//! tree, traditional mode), every commit leaves each qgroup's `referenced` and
//! `exclusive` exact, so the kernel and `btrfs check` accept the numbers:
//!
//! 1. the delayed refs are run, so the trees are as they will be committed;
//! 2. the whole filesystem is recounted in that state (`rescan`, over the running
//!    transaction's trees: every extent counts for the qgroups of the subvolumes that
//!    reach it, the rule `ubtrfs check` and `btrfs check` verify; quota-tree blocks are
//!    not counted, so step 3 cannot change the result);
//! 3. QGROUP_INFO items that differ are rewritten, and the status item gets the
//!    commit's generation (the kernel distrusts a status of another generation) with
//!    the inconsistent and rescan flags cleared, since the numbers are now exact;
//! 4. the commit goes on to write the changed blocks and then the superblock, so the
//!    numbers land atomically with the change they account for.
//!
//! Simple quotas (accounting by extent owner, with OWNER_REF backrefs) are refused at
//! open. A recount walks every tree: commits on quota-enabled images cost a full walk.

use crate::disk_io::Expect;
use crate::error::Result;
use crate::transaction::FsWriter;
use std::collections::{BTreeMap, HashMap, HashSet};
use ubtrfs_format::items::{self, qgroup_status_flags, FileExtent};
use ubtrfs_format::key::{is_subvolume_tree, EXTENT_DATA_KEY, QGROUP_INFO_KEY, QGROUP_RELATION_KEY, QGROUP_STATUS_KEY, QUOTA_TREE_OBJECTID, ROOT_ITEM_KEY, ROOT_TREE_OBJECTID};
use ubtrfs_format::structs::{QgroupInfoItem, QGROUP_STATUS_FLAG_INCONSISTENT, QGROUP_STATUS_FLAG_RESCAN};
use ubtrfs_format::{Corrupt, CorruptWhere, Key};
use zerocopy::{FromBytes, IntoBytes};

const STATUS_KEY: Key = Key::new(0, QGROUP_STATUS_KEY, 0);

fn corrupt(key: Key, reason: String) -> crate::error::Error {
    Corrupt::new(CorruptWhere::Item, reason).root(QUOTA_TREE_OBJECTID).slot(0, key).into()
}

/// The quota status flags, or None when quotas are off (no quota tree or no status).
/// The writer asks once, when it opens.
///
/// # Errors
/// Read failures; `Corrupt` for a status item of the wrong size.
pub fn status(w: &mut FsWriter) -> Result<Option<u64>> {
    let root = match w.root(QUOTA_TREE_OBJECTID) {
        Ok(r) => r,
        Err(e) if e.posix_kind() == Some(crate::error::PosixKind::NotFound) => return Ok(None),
        Err(e) => return Err(e),
    };
    match w.first_item_ge(&root, &STATUS_KEY)? {
        Some((k, d)) if k == STATUS_KEY => qgroup_status_flags(&d).map(Some).map_err(|e| corrupt(k, e)),
        _ => Ok(None),
    }
}

/// Write `counts` (qgroupid -> (referenced, exclusive)) into the QGROUP_INFO items that
/// differ and stamp the status item with this transaction. Returns how many qgroups
/// changed.
///
/// # Errors
/// Read and allocation failures; `Corrupt` for malformed quota items.
pub(crate) fn store_counts(w: &mut FsWriter, counts: &BTreeMap<u64, (u64, u64)>) -> Result<usize> {
    let transid = w.transid;
    let from = Key::new(0, QGROUP_INFO_KEY, 0);
    let to = Key::new(0, QGROUP_INFO_KEY, u64::MAX);
    let mut changed = 0;
    for (key, data) in w.items_in_range(QUOTA_TREE_OBJECTID, &from, &to)? {
        let cur = QgroupInfoItem::read_from_bytes(&data).map_err(|_| corrupt(key, format!("qgroup info item of {} bytes", data.len())))?;
        let (rfer, excl) = counts.get(&key.offset).copied().unwrap_or((0, 0));
        if (cur.rfer.get(), cur.excl.get(), cur.rfer_cmpr.get(), cur.excl_cmpr.get()) == (rfer, excl, rfer, excl) {
            continue;
        }
        let new = QgroupInfoItem { generation: transid.into(), rfer: rfer.into(), rfer_cmpr: rfer.into(), excl: excl.into(), excl_cmpr: excl.into() };
        let (leaf, slot) = w.lookup_for_update(QUOTA_TREE_OBJECTID, &key, 0)?.ok_or_else(|| corrupt(key, "qgroup info item vanished".into()))?;
        w.item_data_mut(leaf, slot).copy_from_slice(new.as_bytes());
        changed += 1;
    }
    let (leaf, slot) = w.lookup_for_update(QUOTA_TREE_OBJECTID, &STATUS_KEY, 0)?.ok_or_else(|| corrupt(STATUS_KEY, "qgroup status item vanished".into()))?;
    // version, generation, flags, rescan (+ enable_gen in simple mode).
    let d = w.item_data_mut(leaf, slot);
    let flags = qgroup_status_flags(d).map_err(|e| corrupt(STATUS_KEY, e))? & !(QGROUP_STATUS_FLAG_INCONSISTENT | QGROUP_STATUS_FLAG_RESCAN);
    d[8..16].copy_from_slice(&transid.to_le_bytes());
    d[16..24].copy_from_slice(&flags.to_le_bytes());
    Ok(changed)
}

/// Count every qgroup's (referenced, exclusive) from scratch over the trees of the
/// running transaction (a full rescan, as `btrfs quota rescan` does): a tree block
/// (nodesize) or data extent (its disk length) reached from a set of subvolumes is
/// referenced by every qgroup containing one of them, and exclusive to a qgroup
/// containing all of them.
///
/// # Errors
/// Read failures; `Corrupt` for malformed file extent items, or extents whose lengths
/// overflow a qgroup's byte counts.
pub(crate) fn rescan(w: &mut FsWriter) -> Result<BTreeMap<u64, (u64, u64)>> {
    let mut subvols = Vec::new();
    for (k, _) in w.items_in_range(ROOT_TREE_OBJECTID, &Key::MIN, &Key::MAX)? {
        if k.type_ == ROOT_ITEM_KEY && is_subvolume_tree(k.objectid) && subvols.last() != Some(&k.objectid) {
            subvols.push(k.objectid);
        }
    }
    // Extent start -> (bytes, subvolumes reaching it, each once).
    let mut reach: HashMap<u64, (u64, Vec<u64>)> = HashMap::new();
    let nodesize = u64::from(w.nodesize());
    for &id in &subvols {
        let r = w.root(id)?;
        let mut seen: HashSet<u64> = HashSet::new();
        let mut seen_data: HashSet<u64> = HashSet::new();
        let mut stack = vec![(r.bytenr, Expect { level: Some(r.level), generation: Some(r.generation), owner: Some(id), first_key: None })];
        while let Some((bytenr, expect)) = stack.pop() {
            // A block shared inside one tree is impossible, but a crafted image may try:
            // visiting each block once per subvolume bounds the walk.
            if !seen.insert(bytenr) {
                continue;
            }
            let blk = w.read_block(bytenr, &expect)?;
            let n = w.node(&blk);
            reach.entry(bytenr).or_insert_with(|| (nodesize, Vec::new())).1.push(id);
            if n.level() > 0 {
                for slot in 0..n.nritems() {
                    let e = Expect { level: Some(n.level() - 1), generation: Some(n.ptr_generation(slot)), owner: Some(id), first_key: Some(n.key(slot)) };
                    stack.push((n.blockptr(slot), e));
                }
                continue;
            }
            for slot in 0..n.nritems() {
                let k = n.key(slot);
                if k.type_ != EXTENT_DATA_KEY {
                    continue;
                }
                let fe = items::file_extent(n.item_data(slot)).map_err(|e| crate::error::Error::from(Corrupt::new(CorruptWhere::Item, e).root(id).block(bytenr).slot(slot as u32, k)))?;
                if let FileExtent::Regular { disk_bytenr, disk_num_bytes, .. } = fe {
                    if disk_bytenr != 0 && seen_data.insert(disk_bytenr) {
                        reach.entry(disk_bytenr).or_insert_with(|| (disk_num_bytes, Vec::new())).1.push(id);
                    }
                }
            }
        }
    }
    let mut parents: Vec<(u64, u64)> = Vec::new();
    let mut counts: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for (k, _) in w.items_in_range(QUOTA_TREE_OBJECTID, &Key::MIN, &Key::MAX)? {
        match k.type_ {
            QGROUP_INFO_KEY => {
                counts.insert(k.offset, (0, 0));
            }
            QGROUP_RELATION_KEY if k.objectid < k.offset => parents.push((k.objectid, k.offset)),
            _ => {}
        }
    }
    let tree = QgroupRelations::new(parents);
    let mut anc_cache: HashMap<u64, Vec<u64>> = HashMap::new();
    for (&bytenr, (bytes, roots)) in &reach {
        let mut hits: BTreeMap<u64, usize> = BTreeMap::new();
        for &r in roots {
            if !counts.contains_key(&r) {
                continue;
            }
            for &g in anc_cache.entry(r).or_insert_with(|| tree.ancestors(r)).iter() {
                *hits.entry(g).or_default() += 1;
            }
        }
        for (g, n) in hits {
            if let Some(c) = counts.get_mut(&g) {
                // File extents say how long their extents are; absurd lengths (each
                // below 2^64, as the tree checker makes sure) can still overflow a sum.
                let overflow = || -> crate::error::Error {
                    Corrupt::new(CorruptWhere::Item, format!("qgroup {}/{} byte count overflows adding extent {bytenr} of {bytes} bytes", g >> 48, g & ((1 << 48) - 1))).root(roots[0]).into()
                };
                c.0 = c.0.checked_add(*bytes).ok_or_else(overflow)?;
                if n == roots.len() {
                    c.1 = c.1.checked_add(*bytes).ok_or_else(overflow)?;
                }
            }
        }
    }
    Ok(counts)
}

/// The qgroup hierarchy from its QGROUP_RELATION items (member, parent).
pub struct QgroupRelations {
    parents: HashMap<u64, Vec<u64>>,
}

impl QgroupRelations {
    pub fn new(relations: impl IntoIterator<Item = (u64, u64)>) -> QgroupRelations {
        let mut parents: HashMap<u64, Vec<u64>> = HashMap::new();
        for (m, p) in relations {
            parents.entry(m).or_default().push(p);
        }
        QgroupRelations { parents }
    }

    /// `q` and every qgroup above it, each once (so a cycle in a crafted image ends).
    pub fn ancestors(&self, q: u64) -> Vec<u64> {
        let mut out = vec![q];
        let mut i = 0;
        while i < out.len() {
            for &p in self.parents.get(&out[i]).map(Vec::as_slice).unwrap_or_default() {
                if !out.contains(&p) {
                    out.push(p);
                }
            }
            i += 1;
        }
        out
    }
}
