//! Pass 2: the extent tree against the real references collected in pass 1.
//!
//! A reference resolves to the backref btrfs keeps for it: a tree block's parent node
//! (or root item) and a file extent's leaf refer as `Shared(parent bytenr)` when that
//! parent block carries FULL_BACKREF in its own extent item, else as `Root(owner)`.
//! For every tree block and data extent the multiset of resolved references must equal
//! the backrefs (inline and keyed), and the item's `refs` must equal their total.

use super::codes::*;
use super::walk::{DataRef, ExtentRec, RefFrom, State, TreeRef};
use super::{Finding, Sink};
use std::collections::{BTreeMap, HashMap};
use ubtrfs_core::FsInfo;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;

/// How block `bytenr` refers to its children and file extents.
fn identity(st: &State, bytenr: u64) -> Option<(bool, u64)> {
    let info = st.blocks.get(&bytenr)?;
    let full = st
        .extents
        .get(&bytenr)
        .map(|r| r.is_tree && r.flags & BLOCK_FLAG_FULL_BACKREF != 0)
        .unwrap_or(false);
    Some((full, info.owner))
}

fn tree_ref_of(st: &State, child: u64, from: RefFrom) -> Option<TreeRef> {
    match from {
        RefFrom::Root(id) => Some(TreeRef::Root(id)),
        RefFrom::SelfShared => Some(TreeRef::Shared(child)),
        RefFrom::Block(parent) => {
            let (full, owner) = identity(st, parent)?;
            Some(if full { TreeRef::Shared(parent) } else { TreeRef::Root(owner) })
        }
    }
}

pub(super) fn check_extents(fs: &FsInfo, st: &State, sink: &mut Sink) {
    let nodesize = u64::from(fs.nodesize);
    let ext = EXTENT_TREE_OBJECTID;

    // Tree blocks: every referenced block needs a matching tree-block extent item.
    let mut children: Vec<u64> = st.edges.keys().copied().collect();
    children.sort_unstable();
    for &child in &children {
        let froms = &st.edges[&child];
        let mut found: Vec<TreeRef> =
            froms.iter().filter_map(|f| tree_ref_of(st, child, *f)).collect();
        found.sort_unstable();
        let info = st.blocks.get(&child);
        let Some(rec) = st.extents.get(&child) else {
            let inside = st
                .extents
                .range(..child)
                .next_back()
                .filter(|(s, r)| s.saturating_add(r.len) > child)
                .map(|(s, _)| format!(" (inside extent {s})"))
                .unwrap_or_default();
            sink.push(
                Finding::new(
                    EXTENT_ITEM_MISSING,
                    format!(
                        "tree block referenced by {} has no extent item{inside}",
                        refs_str(&found)
                    ),
                )
                .bytenr(child),
            );
            continue;
        };
        if !rec.is_tree {
            sink.push(
                Finding::new(EXTENT_KIND_MISMATCH, "tree block has a data extent item")
                    .root(ext)
                    .bytenr(child)
                    .key(rec.key),
            );
            continue;
        }
        if rec.len != nodesize {
            sink.push(
                Finding::new(
                    EXTENT_SIZE_MISMATCH,
                    format!("tree block extent length {}, nodesize {nodesize}", rec.len),
                )
                .root(ext)
                .bytenr(child)
                .key(rec.key),
            );
        }
        if let Some(i) = info.filter(|i| !i.bad) {
            if i.level != rec.level {
                sink.push(
                    Finding::new(
                        EXTENT_KIND_MISMATCH,
                        format!("extent item level {}, block level {}", rec.level, i.level),
                    )
                    .root(ext)
                    .bytenr(child)
                    .key(rec.key),
                );
            }
        }
        for w in found.windows(2) {
            if w[0] == w[1] {
                sink.push(
                    Finding::new(
                        BLOCK_MULTIPLY_REFERENCED,
                        format!("block referenced twice as {}", w[0]),
                    )
                    .bytenr(child),
                );
            }
        }
        found.dedup();
        compare_tree_refs(st, child, rec, &found, sink);
    }

    // Data extents: aggregate file extent references per backref.
    let mut data_starts: Vec<u64> = st.data_refs.keys().copied().collect();
    data_starts.sort_unstable();
    for &start in &data_starts {
        let raws = &st.data_refs[&start];
        let mut found: BTreeMap<DataRef, u64> = BTreeMap::new();
        for r in raws {
            let full = st
                .extents
                .get(&r.leaf)
                .map(|e| e.is_tree && e.flags & BLOCK_FLAG_FULL_BACKREF != 0)
                .unwrap_or(false);
            let d = if full {
                DataRef::Shared(r.leaf)
            } else {
                DataRef::Root { root: r.owner, ino: r.ino, offset: r.offset }
            };
            *found.entry(d).or_default() += 1;
        }
        let first = &raws[0];
        let Some(rec) = st.extents.get(&start) else {
            let inside = st
                .extents
                .range(..start)
                .next_back()
                .filter(|(s, r)| s.saturating_add(r.len) > start)
                .map(|(s, _)| format!(" (inside extent {s})"))
                .unwrap_or_default();
            sink.push(
                Finding::new(
                    EXTENT_ITEM_MISSING,
                    format!("data extent used by {} file extents (first: root {} ino {} offset {}) has no extent item{inside}", raws.len(), first.owner, first.ino, first.file_offset),
                )
                .bytenr(start),
            );
            continue;
        };
        if rec.is_tree {
            sink.push(
                Finding::new(
                    EXTENT_KIND_MISMATCH,
                    format!(
                        "file extent (root {} ino {} offset {}) points at a tree block extent",
                        first.owner, first.ino, first.file_offset
                    ),
                )
                .root(ext)
                .bytenr(start)
                .key(rec.key),
            );
            continue;
        }
        for r in raws {
            if r.disk_num_bytes != rec.len {
                sink.push(
                    Finding::new(
                        EXTENT_SIZE_MISMATCH,
                        format!("file extent root {} ino {} offset {} has disk_num_bytes {}, extent item length {}", r.owner, r.ino, r.file_offset, r.disk_num_bytes, rec.len),
                    )
                    .root(ext)
                    .bytenr(start)
                    .key(rec.key),
                );
            }
        }
        compare_data_refs(start, rec, &found, sink);
    }

    // Extent items nobody references; overlap; placement.
    let mut prev_end: Option<(u64, u64)> = None;
    for (&start, rec) in &st.extents {
        let referenced = if rec.is_tree {
            st.edges.contains_key(&start)
        } else {
            st.data_refs.contains_key(&start)
        };
        if !referenced {
            let backrefs = if rec.is_tree {
                rec.tree_refs.iter().map(|r| r.to_string()).collect::<Vec<_>>()
            } else {
                rec.data_refs.iter().map(|(r, c)| format!("{r} count {c}")).collect()
            };
            sink.push(
                Finding::new(
                    EXTENT_UNREFERENCED,
                    format!(
                        "extent item with refs {} is not referenced by any {} (backrefs: {})",
                        rec.refs,
                        if rec.is_tree { "tree" } else { "file extent" },
                        if backrefs.is_empty() { "none".into() } else { backrefs.join(", ") }
                    ),
                )
                .root(ext)
                .bytenr(start)
                .key(rec.key),
            );
        }
        if let Some((ps, pe)) = prev_end {
            if start < pe {
                sink.push(
                    Finding::new(
                        EXTENT_OVERLAP,
                        format!(
                            "extent [{start}, {}) overlaps extent [{ps}, {pe})",
                            start.saturating_add(rec.len)
                        ),
                    )
                    .root(ext)
                    .bytenr(start)
                    .key(rec.key),
                );
            }
        }
        let end = start.saturating_add(rec.len);
        if prev_end.is_none_or(|(_, pe)| end > pe) {
            prev_end = Some((start, end));
        }
        check_placement(st, start, rec, sink);
    }
}

fn refs_str(v: &[TreeRef]) -> String {
    if v.is_empty() {
        return "nothing resolvable".into();
    }
    v.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

fn compare_tree_refs(st: &State, bytenr: u64, rec: &ExtentRec, found: &[TreeRef], sink: &mut Sink) {
    let ext = EXTENT_TREE_OBJECTID;
    let mut have = rec.tree_refs.clone();
    have.sort_unstable();
    for w in have.windows(2) {
        if w[0] == w[1] {
            sink.push(
                Finding::new(BACKREF_DUPLICATE, format!("{} appears twice", w[0]))
                    .root(ext)
                    .bytenr(bytenr)
                    .key(rec.key),
            );
        }
    }
    have.dedup();
    for r in found {
        if have.binary_search(r).is_err() {
            sink.push(
                Finding::new(
                    BACKREF_MISSING,
                    format!("tree block is referenced as {r} but has no such backref"),
                )
                .root(ext)
                .bytenr(bytenr)
                .key(rec.key),
            );
        }
    }
    for r in &have {
        if found.binary_search(r).is_err() {
            sink.push(
                Finding::new(BACKREF_UNMATCHED, format!("backref {r} matches no reference"))
                    .root(ext)
                    .bytenr(bytenr)
                    .key(rec.key),
            );
        }
    }
    if rec.refs != found.len() as u64 {
        sink.push(
            Finding::new(
                EXTENT_REFS_MISMATCH,
                format!("extent item refs {}, found {} references", rec.refs, found.len()),
            )
            .root(ext)
            .bytenr(bytenr)
            .key(rec.key),
        );
    }
    // The owner must reference a block unless its backrefs are by parent.
    let Some(info) = st.blocks.get(&bytenr).filter(|i| !i.bad) else {
        return;
    };
    let full = rec.flags & BLOCK_FLAG_FULL_BACKREF != 0;
    // Like btrfs check, accept the owner reaching the block through a parent of its
    // own that carries FULL_BACKREF (the owner's tree still points at it).
    let owner_points = st.edges.get(&bytenr).is_some_and(|v| {
        v.iter().any(|f| match *f {
            RefFrom::Root(id) => id == info.owner,
            RefFrom::Block(p) => {
                st.blocks.get(&p).is_some_and(|pi| !pi.bad && pi.owner == info.owner)
            }
            RefFrom::SelfShared => false,
        })
    });
    if !full && !found.contains(&TreeRef::Root(info.owner)) && !owner_points {
        sink.push(
            Finding::new(
                OWNER_REF_MISSING,
                format!(
                    "block owned by {} without FULL_BACKREF is not referenced by its owner",
                    info.owner
                ),
            )
            .root(ext)
            .bytenr(bytenr)
            .key(rec.key),
        );
    }
    let reloc = info.hflags & HEADER_FLAG_RELOC != 0 || info.owner == TREE_RELOC_OBJECTID;
    if reloc && !full {
        sink.push(
            Finding::new(BAD_FULL_BACKREF, "relocation block without FULL_BACKREF")
                .root(ext)
                .bytenr(bytenr)
                .key(rec.key),
        );
    }
    if full && !reloc {
        // A block born after its owner's last snapshot was never shared, so it can
        // not have needed FULL_BACKREF.
        if let Some(root) = st.roots.iter().find(|r| r.key.objectid == info.owner) {
            if info.generation > root.last_snapshot {
                sink.push(
                    Finding::new(BAD_FULL_BACKREF, format!("FULL_BACKREF on a block of generation {} newer than its owner's last snapshot {}", info.generation, root.last_snapshot))
                        .root(ext)
                        .bytenr(bytenr)
                        .key(rec.key),
                );
            }
        }
    }
}

fn compare_data_refs(
    bytenr: u64,
    rec: &ExtentRec,
    found: &BTreeMap<DataRef, u64>,
    sink: &mut Sink,
) {
    let ext = EXTENT_TREE_OBJECTID;
    let mut have: HashMap<DataRef, u64> = HashMap::new();
    for (r, c) in &rec.data_refs {
        if have.insert(*r, *c).is_some() {
            sink.push(
                Finding::new(BACKREF_DUPLICATE, format!("{r} appears twice"))
                    .root(ext)
                    .bytenr(bytenr)
                    .key(rec.key),
            );
        }
    }
    let mut total = 0u64;
    for (r, &n) in found {
        total += n;
        match have.get(r) {
            None => sink.push(
                Finding::new(
                    BACKREF_MISSING,
                    format!("{n} file extents use the extent as {r} but there is no such backref"),
                )
                .root(ext)
                .bytenr(bytenr)
                .key(rec.key),
            ),
            Some(&c) if c != n => sink.push(
                Finding::new(
                    DATA_REF_COUNT,
                    format!("backref {r} has count {c}, found {n} file extents"),
                )
                .root(ext)
                .bytenr(bytenr)
                .key(rec.key),
            ),
            _ => {}
        }
    }
    let mut unmatched: Vec<_> = have.iter().filter(|(r, _)| !found.contains_key(r)).collect();
    unmatched.sort();
    for (r, c) in unmatched {
        sink.push(
            Finding::new(
                BACKREF_UNMATCHED,
                format!("backref {r} count {c} matches no file extent"),
            )
            .root(ext)
            .bytenr(bytenr)
            .key(rec.key),
        );
    }
    if rec.refs != total {
        sink.push(
            Finding::new(
                EXTENT_REFS_MISMATCH,
                format!("extent item refs {}, found {total} references", rec.refs),
            )
            .root(ext)
            .bytenr(bytenr)
            .key(rec.key),
        );
    }
}

/// An extent must lie inside one block group of a matching type.
fn check_placement(st: &State, start: u64, rec: &ExtentRec, sink: &mut Sink) {
    let ext = EXTENT_TREE_OBJECTID;
    let end = start.saturating_add(rec.len);
    let bg = st
        .block_groups
        .range(..=start)
        .next_back()
        .filter(|(s, b)| start < s.saturating_add(b.len));
    let Some((&bs, b)) = bg else {
        sink.push(
            Finding::new(
                EXTENT_OUTSIDE_BLOCK_GROUP,
                format!("extent [{start}, {end}) is in no block group"),
            )
            .root(ext)
            .bytenr(start)
            .key(rec.key),
        );
        return;
    };
    if end > bs.saturating_add(b.len) {
        sink.push(
            Finding::new(
                EXTENT_OUTSIDE_BLOCK_GROUP,
                format!(
                    "extent [{start}, {end}) runs past the end of block group [{bs}, {})",
                    bs.saturating_add(b.len)
                ),
            )
            .root(ext)
            .bytenr(start)
            .key(rec.key),
        );
    }
    let ok = if rec.is_tree {
        b.flags & (BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM) != 0
    } else {
        b.flags & BLOCK_GROUP_DATA != 0
    };
    if !ok {
        sink.push(
            Finding::new(
                EXTENT_WRONG_CHUNK,
                format!(
                    "{} extent in a {} block group",
                    if rec.is_tree { "tree block" } else { "data" },
                    block_group_flags_str(b.flags)
                ),
            )
            .root(ext)
            .bytenr(start)
            .key(rec.key),
        );
    }
}
