//! Quota groups on the write path. With quotas on (a QGROUP_STATUS item in the quota
//! tree, traditional mode), every commit leaves each qgroup's `referenced` and
//! `exclusive` exact, so the kernel and `btrfs check` accept the numbers:
//!
//! 1. the commit's trees are written as they will be committed;
//! 2. the whole filesystem is recounted in that state (a rescan: every extent counts
//!    for the qgroups of the subvolumes that reach it, the rule `ubtrfs check` and
//!    `btrfs check` verify; quota-tree blocks are not counted, so step 3 cannot change
//!    the result);
//! 3. QGROUP_INFO items that differ are rewritten, and the status item gets the
//!    commit's generation (the kernel distrusts a status of another generation) with
//!    the inconsistent and rescan flags cleared, since the numbers are now exact;
//! 4. the commit goes on to write the changed blocks and then the superblock, so the
//!    numbers land atomically with the change they account for.
//!
//! Simple quotas (accounting by extent owner, with OWNER_REF backrefs) are refused at
//! open. A recount walks every tree: commits on quota-enabled images cost a full walk.

use crate::error::Result;
use crate::transaction::FsWriter;
use std::collections::BTreeMap;
use ubtrfs_format::items::qgroup_status_flags;
use ubtrfs_format::key::{QGROUP_INFO_KEY, QGROUP_STATUS_KEY, QUOTA_TREE_OBJECTID};
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
