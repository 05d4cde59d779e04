//! Pass 7: quota groups. With quotas on (a QGROUP_STATUS item in the quota tree), every
//! qgroup's `referenced` and `exclusive` must equal what its subvolumes reach: an
//! extent (data extent by its length, tree block by nodesize) counts as referenced by
//! every qgroup that contains one of the subvolumes reaching it, and as exclusive to a
//! qgroup that contains all of them (btrfs check's rule). Skipped while a rescan runs,
//! when the status says the numbers are inconsistent, and in simple-quota mode, whose
//! accounting follows the extent owner instead.
//!
//! Which subvolumes reach a block is propagated top-down over the references pass 1
//! recorded: a root item of a subvolume reaches its root block, a node passes its set
//! to its children, a leaf to its data extents. Relocation and log trees add nothing.

use super::codes::*;
use super::walk::{RefFrom, State};
use super::{Finding, Sink};
use std::collections::{BTreeMap, HashMap};
use ubtrfs_core::FsInfo;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::MAX_LEVEL;

use ubtrfs_format::structs::{
    QGROUP_STATUS_FLAG_INCONSISTENT, QGROUP_STATUS_FLAG_RESCAN, QGROUP_STATUS_FLAG_SIMPLE_MODE,
};

/// What every qgroup's (referenced, exclusive) should be, from the walk's references.
fn compute(fs: &FsInfo, st: &State) -> BTreeMap<u64, (u64, u64)> {
    // Subvolumes reaching each tree block, parents before children.
    let mut by_level: Vec<Vec<u64>> = vec![Vec::new(); usize::from(MAX_LEVEL)];
    for (&b, i) in &st.blocks {
        if !i.bad && !i.log && i.level < MAX_LEVEL {
            by_level[usize::from(i.level)].push(b);
        }
    }
    let mut reach: HashMap<u64, Vec<u64>> = HashMap::new();
    for level in (0..usize::from(MAX_LEVEL)).rev() {
        for &b in &by_level[level] {
            let mut set = Vec::new();
            for f in st.edges.get(&b).map(Vec::as_slice).unwrap_or_default() {
                match *f {
                    RefFrom::Root(id) if is_subvolume_tree(id) => set.push(id),
                    RefFrom::Block(p) => {
                        set.extend(reach.get(&p).map(Vec::as_slice).unwrap_or_default())
                    }
                    _ => {}
                }
            }
            set.sort_unstable();
            set.dedup();
            reach.insert(b, set);
        }
    }

    // Each level-0 qgroup's ancestors (itself included), through the relations.
    let tree = ubtrfs_core::QgroupRelations::new(st.qgroup_relations.iter().copied());
    let mut anc_cache: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut computed: BTreeMap<u64, (u64, u64)> =
        st.qgroup_info.keys().map(|&q| (q, (0, 0))).collect();
    let nodesize = u64::from(fs.nodesize);
    for (&start, rec) in &st.extents {
        let roots: Vec<u64> = if rec.is_tree {
            reach.get(&start).cloned().unwrap_or_default()
        } else {
            let mut v: Vec<u64> = st
                .data_refs
                .get(&start)
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .flat_map(|r| {
                    reach.get(&r.leaf).map(Vec::as_slice).unwrap_or_default().iter().copied()
                })
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        if roots.is_empty() {
            continue;
        }
        let bytes = if rec.is_tree { nodesize } else { rec.len };
        let mut hits: BTreeMap<u64, usize> = BTreeMap::new();
        for &r in &roots {
            if !st.qgroup_info.contains_key(&r) {
                continue;
            }
            let anc = anc_cache.entry(r).or_insert_with(|| tree.ancestors(r));
            for &g in anc.iter() {
                *hits.entry(g).or_default() += 1;
            }
        }
        for (g, n) in hits {
            if let Some(c) = computed.get_mut(&g) {
                c.0 += bytes;
                if n == roots.len() {
                    c.1 += bytes;
                }
            }
        }
    }
    computed
}

pub(super) fn check_qgroups(fs: &FsInfo, st: &State, sink: &mut Sink) {
    let Some(flags) = st.qgroup_status else {
        return;
    };
    if flags & QGROUP_STATUS_FLAG_SIMPLE_MODE != 0 {
        sink.note("simple quotas: qgroup numbers not verified");
        return;
    }
    if flags & (QGROUP_STATUS_FLAG_RESCAN | QGROUP_STATUS_FLAG_INCONSISTENT) != 0 {
        sink.note(format!("qgroup status flags {flags:#x} (rescan running or inconsistent): qgroup numbers not verified"));
        return;
    }
    let computed = compute(fs, st);
    for (&q, &(rfer, excl)) in &st.qgroup_info {
        let (crfer, cexcl) = computed[&q];
        if (rfer, excl) != (crfer, cexcl) {
            let id = format!("{}/{}", q >> 48, q & ((1 << 48) - 1));
            sink.push(
                Finding::new(QGROUP_MISMATCH, format!("qgroup {id} referenced {rfer} exclusive {excl}, extents give referenced {crfer} exclusive {cexcl}"))
                    .root(QUOTA_TREE_OBJECTID)
                    .key(ubtrfs_format::Key::new(0, QGROUP_INFO_KEY, q)),
            );
        }
    }
}
