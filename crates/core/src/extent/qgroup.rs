//! Quota groups on the write path. With quotas on (a QGROUP_STATUS item in the quota
//! tree, traditional mode), every commit leaves each qgroup's `referenced` and
//! `exclusive` exact, so the kernel and `btrfs check` accept the numbers. Accounting
//! is incremental, as the kernel's (`btrfs_qgroup_account_extents`):
//!
//! 1. every extent whose references change in the transaction is recorded as the
//!    change is queued (`delayed_ref::QgroupRecords`, the "dirty extents");
//! 2. at commit the delayed refs are run, so the trees are as they will be committed;
//! 3. for each dirty extent, its old roots (the subvolumes reaching it in the last
//!    committed state: committed extent tree and subvolume trees, whose freed blocks
//!    stay pinned and readable until this commit) and its new roots (the running
//!    transaction's trees) are found by backref walks (`backref`), and the difference
//!    of its contribution is applied to the stored numbers (`account`). An extent
//!    reached from a set of subvolumes counts as referenced for every qgroup above one
//!    of them (itself included, through QGROUP_RELATION items) and as exclusive for a
//!    qgroup above all of them: the rule of the full recount (`rescan`), so
//!    rescan(new) == rescan(old) + the deltas, provided nothing changed which trees
//!    reach an extent without changing that extent's references;
//! 4. QGROUP_INFO items that differ are rewritten, and the status item gets the
//!    commit's generation (the kernel distrusts a status of another generation) with
//!    the inconsistent and rescan flags cleared, since the numbers are now exact;
//! 5. the commit goes on to write the changed blocks and then the superblock, so the
//!    numbers land atomically with the change they account for.
//!
//! The full recount (`rescan`, which walks every subvolume tree) runs instead when the
//! stored numbers cannot be trusted (a status flagged inconsistent or of another
//! generation at open), when more extents changed than are recorded
//! (`MAX_QGROUP_RECORDS`), when a backref walk finds backrefs that disagree with the
//! trees, and when an operation changed reachability without changing the extents'
//! own references (`QgroupState::needs_rescan`: a snapshot, which calls it, and a
//! subvolume deletion, a relation change or a qgroup made for a subvolume that already
//! has extents, which ubtrfs does not do with quotas on yet, and each must call it
//! when it comes). A deleted subvolume counts for the part of its tree its drop has
//! not reached yet (right of its drop point), as the kernel counts it; btrfs check
//! walks such a tree whole, so a half-dropped tree with quotas on (the kernel's too)
//! is reported there until the drop ends. Under the
//! `test-hooks` feature the recount is the oracle: with verification on (debug builds,
//! unless UBTRFS_QGROUP_VERIFY=0; or UBTRFS_QGROUP_VERIFY=1; or the hook) every
//! incremental result is compared with it and a mismatch panics.
//!
//! Quota-tree blocks are not counted (no subvolume reaches them), so step 4 cannot
//! change the result. Simple quotas (accounting by extent owner, with OWNER_REF
//! backrefs) are refused at open.

use crate::disk_io::Expect;
use crate::error::Result;
use crate::extent::backref::{Counted, RootFinder, WalkErr};
use crate::transaction::Transaction;
use crate::tree::search::TreeView;
use std::collections::{BTreeMap, HashMap, HashSet};
use ubtrfs_format::items::{self, qgroup_status_flags, FileExtent};
use ubtrfs_format::key::{
    is_subvolume_tree, EXTENT_DATA_KEY, QGROUP_INFO_KEY, QGROUP_RELATION_KEY, QGROUP_STATUS_KEY,
    QUOTA_TREE_OBJECTID, ROOT_ITEM_KEY, ROOT_TREE_OBJECTID,
};
use ubtrfs_format::structs::{
    QgroupInfoItem, QGROUP_STATUS_FLAG_INCONSISTENT, QGROUP_STATUS_FLAG_RESCAN,
};
use ubtrfs_format::{Corrupt, CorruptWhere, Key};
use zerocopy::{FromBytes, IntoBytes};

/// (referenced, exclusive) bytes by qgroupid.
pub(crate) type Counts = BTreeMap<u64, (u64, u64)>;

const STATUS_KEY: Key = Key::new(0, QGROUP_STATUS_KEY, 0);

fn corrupt(key: Key, reason: String) -> crate::error::Error {
    Corrupt::new(CorruptWhere::Item, reason).root(QUOTA_TREE_OBJECTID).slot(0, key).into()
}

/// The quota status (flags, generation), or None when quotas are off (no quota tree
/// or no status). The writer asks once, when it opens.
///
/// # Errors
/// Read failures; `Corrupt` for a status item of the wrong size.
pub fn status(w: &mut Transaction) -> Result<Option<(u64, u64)>> {
    let root = match w.root(QUOTA_TREE_OBJECTID) {
        Ok(r) => r,
        Err(e) if e.posix_kind() == Some(crate::error::PosixKind::NotFound) => return Ok(None),
        Err(e) => return Err(e),
    };
    match w.first_item_ge(&root, &STATUS_KEY)? {
        Some((k, d)) if k == STATUS_KEY => {
            let flags = qgroup_status_flags(&d).map_err(|e| corrupt(k, e))?;
            Ok(Some((
                flags,
                u64::from_le_bytes(
                    d[8..16].try_into().expect("the status item is at least 32 bytes"),
                ),
            )))
        }
        _ => Ok(None),
    }
}

/// Write `counts` (qgroupid -> (referenced, exclusive)) into the QGROUP_INFO items that
/// differ and stamp the status item with this transaction. Returns how many qgroups
/// changed.
///
/// # Errors
/// Read and allocation failures; `Corrupt` for malformed quota items.
pub(crate) fn store_counts(
    w: &mut Transaction,
    counts: &BTreeMap<u64, (u64, u64)>,
) -> Result<usize> {
    let transid = w.transid;
    let from = Key::new(0, QGROUP_INFO_KEY, 0);
    let to = Key::new(0, QGROUP_INFO_KEY, u64::MAX);
    let mut changed = 0;
    for (key, data) in w.items_in_range(QUOTA_TREE_OBJECTID, &from, &to)? {
        let cur = QgroupInfoItem::read_from_bytes(&data)
            .map_err(|_| corrupt(key, format!("qgroup info item of {} bytes", data.len())))?;
        let (rfer, excl) = counts.get(&key.offset).copied().unwrap_or((0, 0));
        if (cur.rfer.get(), cur.excl.get(), cur.rfer_cmpr.get(), cur.excl_cmpr.get())
            == (rfer, excl, rfer, excl)
        {
            continue;
        }
        let new = QgroupInfoItem {
            generation: transid.into(),
            rfer: rfer.into(),
            rfer_cmpr: rfer.into(),
            excl: excl.into(),
            excl_cmpr: excl.into(),
        };
        let (leaf, slot) = w
            .lookup_for_update(QUOTA_TREE_OBJECTID, &key, 0)?
            .ok_or_else(|| corrupt(key, "qgroup info item vanished".into()))?;
        w.item_data_mut(leaf, slot).copy_from_slice(new.as_bytes());
        changed += 1;
    }
    let (leaf, slot) = w
        .lookup_for_update(QUOTA_TREE_OBJECTID, &STATUS_KEY, 0)?
        .ok_or_else(|| corrupt(STATUS_KEY, "qgroup status item vanished".into()))?;
    // version, generation, flags, rescan (+ enable_gen in simple mode).
    let d = w.item_data_mut(leaf, slot);
    let flags = qgroup_status_flags(d).map_err(|e| corrupt(STATUS_KEY, e))?
        & !(QGROUP_STATUS_FLAG_INCONSISTENT | QGROUP_STATUS_FLAG_RESCAN);
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
pub(crate) fn rescan(w: &mut Transaction) -> Result<BTreeMap<u64, (u64, u64)>> {
    rescan_counted(w).map(|(counts, _)| counts)
}

/// `rescan`, and how many tree blocks its walk read.
fn rescan_counted(w: &mut Transaction) -> Result<(Counts, u64)> {
    let mut reads = 0u64;
    let mut subvols = Vec::new();
    // A deleted subvolume still counts for what its tree holds until the cleaner has
    // dropped it, as the kernel accounts it (its backref walks see the dead root, and
    // its drop accounts each reference it removes): only the part right of the drop
    // point is walked, the rest is freed.
    let mut drops: HashMap<u64, (Key, u8)> = HashMap::new();
    for (k, d) in w.items_in_range(ROOT_TREE_OBJECTID, &Key::MIN, &Key::MAX)? {
        if k.type_ == ROOT_ITEM_KEY
            && is_subvolume_tree(k.objectid)
            && subvols.last() != Some(&k.objectid)
        {
            subvols.push(k.objectid);
            if let Ok(v) = items::root_item(&d) {
                let dk = Key::from(&v.item.drop_progress);
                if v.item.refs.get() == 0 && dk.objectid != 0 {
                    drops.insert(k.objectid, (dk, v.item.drop_level));
                }
            }
        }
    }
    // Extent start -> (bytes, subvolumes reaching it, each once).
    let mut reach: HashMap<u64, (u64, Vec<u64>)> = HashMap::new();
    let nodesize = u64::from(w.nodesize());
    for &id in &subvols {
        let r = w.root(id)?;
        let mut seen: HashSet<u64> = HashSet::new();
        let mut seen_data: HashSet<u64> = HashSet::new();
        let mut stack = vec![(
            r.bytenr,
            Expect {
                level: Some(r.level),
                generation: Some(r.generation),
                owner: Some(id),
                first_key: None,
            },
        )];
        while let Some((bytenr, expect)) = stack.pop() {
            // A block shared inside one tree is impossible, but a crafted image may try:
            // visiting each block once per subvolume bounds the walk.
            if !seen.insert(bytenr) {
                continue;
            }
            let blk = w.read_block(bytenr, &expect)?;
            reads += 1;
            let n = w.node(&blk);
            reach.entry(bytenr).or_insert_with(|| (nodesize, Vec::new())).1.push(id);
            if n.level() > 0 {
                let first = match drops.get(&id) {
                    Some(&(dk, dl)) if n.level() > dl => match n.search(&dk) {
                        Ok(s) => s,
                        Err(s) => s.saturating_sub(1),
                    },
                    Some(&(dk, dl)) if n.level() == dl => {
                        (0..n.nritems()).find(|&s| n.key(s) >= dk).unwrap_or(n.nritems())
                    }
                    _ => 0,
                };
                for slot in first..n.nritems() {
                    let e = Expect {
                        level: Some(n.level() - 1),
                        generation: Some(n.ptr_generation(slot)),
                        owner: Some(id),
                        first_key: Some(n.key(slot)),
                    };
                    stack.push((n.blockptr(slot), e));
                }
                continue;
            }
            for slot in 0..n.nritems() {
                let k = n.key(slot);
                if k.type_ != EXTENT_DATA_KEY {
                    continue;
                }
                let fe = items::file_extent(n.item_data(slot)).map_err(|e| {
                    crate::error::Error::from(
                        Corrupt::new(CorruptWhere::Item, e)
                            .root(id)
                            .block(bytenr)
                            .slot(slot as u32, k),
                    )
                })?;
                if let FileExtent::Regular { disk_bytenr, disk_num_bytes, .. } = fe {
                    if disk_bytenr != 0 && seen_data.insert(disk_bytenr) {
                        reach
                            .entry(disk_bytenr)
                            .or_insert_with(|| (disk_num_bytes, Vec::new()))
                            .1
                            .push(id);
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
    Ok((counts, reads))
}

/// What the last commit's qgroup accounting did (statistics and tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QgroupStats {
    /// Extents whose references changed in the transaction (the dirty extents).
    pub dirty_extents: u64,
    /// Tree blocks read to account them: by the backref walks and the quota tree
    /// read, or by the full recount's walk (the verification recount not counted).
    pub blocks_read: u64,
    /// Why the full recount ran instead of the incremental accounting, if it did.
    pub recount: Option<String>,
}

/// The writer's quota accounting state (quotas on).
#[derive(Debug, Default)]
pub struct QgroupState {
    /// The next commit recounts every qgroup, and why.
    needs_rescan: Option<String>,
    /// Compare every incremental result with the full recount, panicking on a
    /// mismatch (see the module).
    pub verify: bool,
    /// The last commit's accounting.
    pub last: QgroupStats,
    /// Commits that recounted fully since the writer opened.
    pub full_recounts: u64,
}

impl QgroupState {
    /// The state of a writer opening with quota status `flags` of generation
    /// `status_gen` on a filesystem at generation `generation`: stored numbers the
    /// kernel would distrust (flagged inconsistent, a rescan under way, another
    /// generation) are recounted at the first commit.
    pub fn at_open(flags: u64, status_gen: u64, generation: u64) -> QgroupState {
        let mut st = QgroupState { verify: verify_default(), ..Default::default() };
        if flags & QGROUP_STATUS_FLAG_INCONSISTENT != 0 {
            st.needs_rescan("the quota status is flagged inconsistent");
        } else if flags & QGROUP_STATUS_FLAG_RESCAN != 0 {
            st.needs_rescan("a quota rescan was under way");
        } else if status_gen != generation {
            st.needs_rescan(format!(
                "the quota status is of generation {status_gen}, the filesystem of {generation}"
            ));
        }
        st
    }

    /// Recount every qgroup at the next commit: an operation changed which trees reach
    /// extents without changing those extents' references (a snapshot shares a whole
    /// tree by one new root; deleting a subvolume drops one; a relation or a qgroup
    /// for an existing subvolume changes who counts what), so the dirty extents do not
    /// tell the difference.
    pub fn needs_rescan(&mut self, why: impl Into<String>) {
        if self.needs_rescan.is_none() {
            self.needs_rescan = Some(why.into());
        }
    }
}

/// Verification default: on in debug builds with `test-hooks`, unless
/// UBTRFS_QGROUP_VERIFY=0; UBTRFS_QGROUP_VERIFY=1 turns it on in any build.
fn verify_default() -> bool {
    match std::env::var("UBTRFS_QGROUP_VERIFY").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => cfg!(debug_assertions) && cfg!(feature = "test-hooks"),
    }
}

/// Bring the stored qgroup numbers up to date with the running transaction, whose
/// delayed refs have run: incrementally from the dirty extents, or by the full
/// recount (see the module). Changes the quota tree; the caller settles the refs again
/// and then calls `after_settle`.
///
/// # Errors
/// Read and allocation failures; `Corrupt` from the recount or for malformed quota
/// items.
pub(crate) fn commit_qgroups(w: &mut Transaction) -> Result<()> {
    let records =
        w.delayed.take_qgroup_records().expect("with quotas on the delayed refs record extents");
    let mut stats =
        QgroupStats { dirty_extents: records.extents.len() as u64, ..Default::default() };
    let mut why = w.qgroup.needs_rescan.take();
    if records.overflowed && why.is_none() {
        why = Some("more extents changed than are recorded".to_string());
    }
    #[cfg(feature = "test-hooks")]
    if w.hooks.qgroup_full_recount && why.is_none() {
        why = Some("the test hook asks for it".into());
    }
    let mut counts = None;
    if why.is_none() {
        match account(w, &records.extents)? {
            Ok((c, reads)) => {
                stats.blocks_read = reads;
                counts = Some(c);
            }
            Err(reason) => {
                w.info.warn(format!("qgroup accounting: {reason}; recounting every subvolume"));
                why = Some(reason);
            }
        }
    }
    let counts = match counts {
        Some(c) => {
            if w.qgroup.verify {
                let full = rescan(w)?;
                assert_same_counts(&c, &full, w.transid);
            }
            c
        }
        None => {
            let (c, reads) = rescan_counted(w)?;
            stats.blocks_read = reads;
            stats.recount = why;
            w.qgroup.full_recounts += 1;
            c
        }
    };
    store_counts(w, &counts)?;
    w.qgroup.last = stats;
    Ok(())
}

/// After the refs settled again: storing the numbers changed only trees no qgroup
/// counts, so nothing was recorded that the numbers miss.
pub(crate) fn after_settle(w: &mut Transaction) {
    let late =
        w.delayed.take_qgroup_records().expect("with quotas on the delayed refs record extents");
    assert!(
        !late.overflowed && late.extents.is_empty(),
        "transaction {}: extents {:?} changed after the qgroups were accounted",
        w.transid,
        late.extents.iter().take(8).collect::<Vec<_>>()
    );
}

fn assert_same_counts(
    incremental: &BTreeMap<u64, (u64, u64)>,
    full: &BTreeMap<u64, (u64, u64)>,
    transid: u64,
) {
    if incremental == full {
        return;
    }
    let mut diff = Vec::new();
    for (g, f) in full {
        let i = incremental.get(g);
        if i != Some(f) {
            diff.push(format!(
                "qgroup {}/{}: incremental {i:?}, recount {f:?}",
                g >> 48,
                g & ((1 << 48) - 1)
            ));
        }
    }
    for g in incremental.keys().filter(|g| !full.contains_key(g)) {
        diff.push(format!(
            "qgroup {}/{}: only in the incremental result",
            g >> 48,
            g & ((1 << 48) - 1)
        ));
    }
    panic!(
        "transaction {transid}: incremental qgroup accounting disagrees with the full recount:\n{}",
        diff.join("\n")
    );
}

/// The stored numbers with the dirty extents' changes applied, and the blocks read;
/// `Err(reason)` when the backrefs disagree with the trees or a number would leave
/// its range (the caller recounts).
fn account(
    w: &Transaction,
    dirty: &std::collections::BTreeSet<u64>,
) -> Result<std::result::Result<(Counts, u64), String>> {
    let live = w.live();
    let new_view = Counted::new(&live);
    let old_view = Counted::new(&*w.info);
    let quota = new_view.read_root(QUOTA_TREE_OBJECTID)?.0;
    let mut counts: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    let mut parents: Vec<(u64, u64)> = Vec::new();
    for item in new_view.items_in_range(&quota, &Key::MIN, &Key::MAX)? {
        let k = item.key();
        match k.type_ {
            QGROUP_INFO_KEY => {
                let cur = QgroupInfoItem::read_from_bytes(item.data()).map_err(|_| {
                    corrupt(k, format!("qgroup info item of {} bytes", item.data().len()))
                })?;
                counts.insert(k.offset, (cur.rfer.get(), cur.excl.get()));
            }
            QGROUP_RELATION_KEY if k.objectid < k.offset => parents.push((k.objectid, k.offset)),
            _ => {}
        }
    }
    let tree = QgroupRelations::new(parents);
    let mut anc: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut delta: BTreeMap<u64, (i128, i128)> = BTreeMap::new();
    let mut contribute = |roots: &[u64], bytes: u64, sign: i128| {
        let mut hits: BTreeMap<u64, usize> = BTreeMap::new();
        for &r in roots {
            if !counts.contains_key(&r) {
                continue;
            }
            for &g in anc.entry(r).or_insert_with(|| tree.ancestors(r)).iter() {
                *hits.entry(g).or_default() += 1;
            }
        }
        for (g, n) in hits {
            if counts.contains_key(&g) {
                let d = delta.entry(g).or_default();
                d.0 += sign * i128::from(bytes);
                if n == roots.len() {
                    d.1 += sign * i128::from(bytes);
                }
            }
        }
    };
    let nodesize = w.nodesize();
    let mut old = RootFinder::new(&old_view, nodesize);
    let mut new = RootFinder::new(&new_view, nodesize);
    for &bytenr in dirty {
        let o = match old.extent_roots(bytenr) {
            Ok(o) => o,
            Err(WalkErr::Fs(e)) => return Err(e),
            Err(WalkErr::Inconsistent(r)) => return Ok(Err(format!("committed generation: {r}"))),
        };
        let n = match new.extent_roots(bytenr) {
            Ok(n) => n,
            Err(WalkErr::Fs(e)) => return Err(e),
            Err(WalkErr::Inconsistent(r)) => {
                return Ok(Err(format!("transaction {}: {r}", w.transid)))
            }
        };
        if let (Some((ob, _)), Some((nb, _))) = (&o, &n) {
            if ob != nb {
                return Ok(Err(format!("extent {bytenr} was {ob} bytes and is {nb} bytes")));
            }
        }
        if let Some((b, roots)) = &o {
            contribute(roots, *b, -1);
        }
        if let Some((b, roots)) = &n {
            contribute(roots, *b, 1);
        }
    }
    for (g, (dr, de)) in delta {
        let c = counts.get_mut(&g).expect("deltas are only made for stored qgroups");
        let apply = |cur: u64, d: i128| u64::try_from(i128::from(cur) + d).ok();
        match (apply(c.0, dr), apply(c.1, de)) {
            (Some(r), Some(e)) => *c = (r, e),
            _ => {
                return Ok(Err(format!(
                    "qgroup {}/{} ({} referenced, {} exclusive) cannot change by ({dr}, {de})",
                    g >> 48,
                    g & ((1 << 48) - 1),
                    c.0,
                    c.1
                )))
            }
        }
    }
    Ok(Ok((counts, old_view.reads.get() + new_view.reads.get())))
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

/// Items a qgroup creation or assignment changes (an info and a limit item, or the two
/// relation items).
#[cfg(any(test, feature = "test-hooks"))]
const QGROUP_ITEMS: u64 = 2;

#[cfg(any(test, feature = "test-hooks"))]
fn qgroup_name(q: u64) -> String {
    format!("qgroup {}/{}", q >> 48, q & ((1 << 48) - 1))
}

impl Transaction {
    /// Create qgroup `id` (`btrfs qgroup create`): its info and limit items, counting
    /// nothing. A level-0 qgroup of a subvolume that already exists makes the next
    /// commit recount (its extents are not dirty, yet they now count for it).
    ///
    /// # Errors
    /// `Posix(NotSupported)` with quotas off; `Posix(Exists)` for a qgroup that exists;
    /// tree failures (which abort).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn qgroup_create(&mut self, id: u64) -> Result<()> {
        self.check_writable()?;
        if !self.quotas {
            return Err(crate::error::Error::posix_detail(
                crate::error::PosixKind::NotSupported,
                qgroup_name(id),
                "quotas are off",
            ));
        }
        let key = Key::new(0, QGROUP_INFO_KEY, id);
        if !self.items_in_range(QUOTA_TREE_OBJECTID, &key, &key)?.is_empty() {
            return Err(crate::error::Error::posix(
                crate::error::PosixKind::Exists,
                qgroup_name(id),
            ));
        }
        let existing_subvol = id >> 48 == 0 && self.live().read_root(id).is_ok();
        self.transaction("qgroup_create", QGROUP_ITEMS, |w| {
            use zerocopy::FromZeros;
            let info =
                QgroupInfoItem { generation: w.transid.into(), ..QgroupInfoItem::new_zeroed() };
            w.insert_item(QUOTA_TREE_OBJECTID, &key, info.as_bytes())?;
            w.insert_item(
                QUOTA_TREE_OBJECTID,
                &Key::new(0, ubtrfs_format::key::QGROUP_LIMIT_KEY, id),
                ubtrfs_format::structs::QgroupLimitItem::new_zeroed().as_bytes(),
            )?;
            Ok(())
        })?;
        if existing_subvol {
            self.qgroup
                .needs_rescan(format!("{} was made for an existing subvolume", qgroup_name(id)));
        }
        Ok(())
    }

    /// Make qgroup `member` a member of the higher-level qgroup `parent` (`btrfs
    /// qgroup assign`): the two QGROUP_RELATION items. The extents already counted for
    /// `member` now count for `parent` too without changing, so the next commit
    /// recounts (the kernel marks the numbers inconsistent for a rescan).
    ///
    /// # Errors
    /// `Posix(NotSupported)` with quotas off; `Posix(Invalid)` unless `parent`
    /// is of a higher level; `Posix(NotFound)` for a missing qgroup; `Posix(Exists)`
    /// for an existing relation; tree failures (which abort).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn qgroup_assign(&mut self, member: u64, parent: u64) -> Result<()> {
        use crate::error::{Error, PosixKind};
        self.check_writable()?;
        if !self.quotas {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                qgroup_name(parent),
                "quotas are off",
            ));
        }
        if member >> 48 >= parent >> 48 {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                qgroup_name(parent),
                format!("not of a higher level than {}", qgroup_name(member)),
            ));
        }
        for q in [member, parent] {
            let k = Key::new(0, QGROUP_INFO_KEY, q);
            if self.items_in_range(QUOTA_TREE_OBJECTID, &k, &k)?.is_empty() {
                return Err(Error::posix(PosixKind::NotFound, qgroup_name(q)));
            }
        }
        let up = Key::new(member, QGROUP_RELATION_KEY, parent);
        if !self.items_in_range(QUOTA_TREE_OBJECTID, &up, &up)?.is_empty() {
            return Err(Error::posix_detail(
                PosixKind::Exists,
                qgroup_name(member),
                format!("already in {}", qgroup_name(parent)),
            ));
        }
        self.transaction("qgroup_assign", QGROUP_ITEMS, |w| {
            w.insert_item(QUOTA_TREE_OBJECTID, &up, &[])?;
            w.insert_item(QUOTA_TREE_OBJECTID, &Key::new(parent, QGROUP_RELATION_KEY, member), &[])
        })?;
        self.qgroup.needs_rescan(format!(
            "{} was assigned to {}",
            qgroup_name(member),
            qgroup_name(parent)
        ));
        Ok(())
    }
}
