//! Backref walking: which subvolume trees reach an extent in one state of the
//! filesystem (the kernel's `btrfs_find_all_roots`), read from that state's extent tree
//! and subvolume trees only, never by walking a whole tree.
//!
//! - A tree block's keyed `TREE_BLOCK_REF(root)` says `root`'s tree points at it: the
//!   block is that tree's root node, or its parent is found by searching `root`'s tree
//!   for the block's first key down to the level above (the pointer found there must
//!   name the block); a `SHARED_BLOCK_REF(parent)` names the parent directly. The
//!   block's roots are the union of its parents' roots.
//! - A data extent's `EXTENT_DATA_REF(root, ino, offset)` with count `n` is `n` file
//!   extent items of `ino` in `root`'s tree, found from key (ino, EXTENT_DATA, offset)
//!   on (as the kernel's `resolve_indirect_ref`); a `SHARED_DATA_REF(parent)` names the
//!   leaf. The extent's roots are the union of those leaves' roots.
//!
//! Only subvolume trees (`is_subvolume_tree`) with a ROOT_ITEM in the state count, the
//! rule the full recount (`qgroup::rescan`) uses. Levels strictly increase along a walk
//! (checked), so a walk ends within eight steps up; results are memoized per finder (one
//! finder per state per commit). Backrefs that disagree with the trees are not an
//! error here but `Walk::Inconsistent`: the caller recounts from the trees instead.
//!
//! Neighbours: `qgroup` (the only user), `delayed_ref` (records which extents to walk).

use crate::disk_io::Expect;
use crate::error::{Error, PosixKind, Result};
use crate::extent::delayed_ref::RefKind;
use crate::tree::search::{NodeHandle, RootInfo, TreeView};
use std::cell::Cell;
use std::collections::HashMap;
use ubtrfs_format::items::{self, FileExtent, InlineRef};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::{EXTENT_FLAG_DATA, MAX_LEVEL};
use ubtrfs_format::Key;

/// Why a walk stopped short.
#[derive(Debug)]
pub(crate) enum WalkErr {
    /// A read failed.
    Fs(Error),
    /// The backrefs disagree with the trees (the reason, naming the extent).
    Inconsistent(String),
}

impl From<Error> for WalkErr {
    fn from(e: Error) -> WalkErr {
        WalkErr::Fs(e)
    }
}

pub(crate) type Walk<T> = std::result::Result<T, WalkErr>;

fn inconsistent<T>(why: String) -> Walk<T> {
    Err(WalkErr::Inconsistent(why))
}

/// A view that counts the blocks read through it (the work of accounting).
pub(crate) struct Counted<'a, V: TreeView + ?Sized> {
    view: &'a V,
    pub reads: Cell<u64>,
}

impl<'a, V: TreeView + ?Sized> Counted<'a, V> {
    pub fn new(view: &'a V) -> Counted<'a, V> {
        Counted { view, reads: Cell::new(0) }
    }
}

impl<V: TreeView + ?Sized> TreeView for Counted<'_, V> {
    type Node = V::Node;
    fn read_node(&self, bytenr: u64, expect: &Expect) -> Result<V::Node> {
        self.reads.set(self.reads.get() + 1);
        self.view.read_node(bytenr, expect)
    }
    fn tree_root(&self) -> RootInfo {
        self.view.tree_root()
    }
    fn chunk_root(&self) -> RootInfo {
        self.view.chunk_root()
    }
    fn read_root(&self, id: u64) -> Result<(RootInfo, ubtrfs_format::structs::RootItem)> {
        self.view.read_root(id)
    }
}

/// An extent's item and backrefs in one state.
#[derive(Clone, Debug)]
pub(crate) struct ExtentRefs {
    pub is_data: bool,
    /// Bytes the extent accounts for: its length (data) or the nodesize.
    pub bytes: u64,
    /// Tree level (tree blocks).
    pub level: u8,
    pub refs: Vec<(RefKind, u64)>,
}

/// The roots reaching extents in one state of the filesystem.
pub(crate) struct RootFinder<'a, V: TreeView> {
    view: &'a V,
    nodesize: u64,
    extents: HashMap<u64, Option<ExtentRefs>>,
    blocks: HashMap<u64, Vec<u64>>,
    trees: HashMap<u64, Option<RootInfo>>,
}

impl<'a, V: TreeView> RootFinder<'a, V> {
    pub fn new(view: &'a V, nodesize: u32) -> RootFinder<'a, V> {
        RootFinder {
            view,
            nodesize: u64::from(nodesize),
            extents: HashMap::new(),
            blocks: HashMap::new(),
            trees: HashMap::new(),
        }
    }

    /// The bytes and roots (sorted, each once) of the extent at `bytenr`, or None when
    /// this state has no extent there.
    pub fn extent_roots(&mut self, bytenr: u64) -> Walk<Option<(u64, Vec<u64>)>> {
        let Some(ext) = self.extent(bytenr)? else { return Ok(None) };
        let roots = if ext.is_data {
            self.data_roots(bytenr, &ext)?
        } else {
            self.block_roots(bytenr, None)?
        };
        Ok(Some((ext.bytes, roots)))
    }

    /// Subvolume tree `id`'s root in this state, if it is a subvolume tree here.
    fn subvol(&mut self, id: u64) -> Walk<Option<RootInfo>> {
        if !is_subvolume_tree(id) {
            return Ok(None);
        }
        if let Some(r) = self.trees.get(&id) {
            return Ok(*r);
        }
        let r = match self.view.read_root(id) {
            Ok((r, _)) => Some(r),
            Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => None,
            Err(e) => return Err(e.into()),
        };
        self.trees.insert(id, r);
        Ok(r)
    }

    /// The extent item at `bytenr` and its inline and keyed backrefs.
    fn extent(&mut self, bytenr: u64) -> Walk<Option<ExtentRefs>> {
        if let Some(e) = self.extents.get(&bytenr) {
            return Ok(e.clone());
        }
        let (root, _) = self.view.read_root(EXTENT_TREE_OBJECTID)?;
        let from = Key::new(bytenr, EXTENT_ITEM_KEY, 0);
        let to = Key::new(bytenr, SHARED_DATA_REF_KEY, u64::MAX);
        let mut found: Option<ExtentRefs> = None;
        let mut it = self.view.iter(&root, from)?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k > to {
                break;
            }
            let d = item.data();
            match k.type_ {
                EXTENT_ITEM_KEY | METADATA_ITEM_KEY => {
                    if found.is_some() {
                        return inconsistent(format!("extent {bytenr} has two extent items"));
                    }
                    let skinny = k.type_ == METADATA_ITEM_KEY;
                    let ei = items::extent_item(d, skinny)
                        .map_err(|e| WalkErr::Inconsistent(format!("extent item {k}: {e}")))?;
                    let is_data = ei.flags & EXTENT_FLAG_DATA != 0;
                    let level = if skinny {
                        u8::try_from(k.offset).unwrap_or(u8::MAX)
                    } else {
                        ei.tree_block_info.map_or(0, |(_, l)| l)
                    };
                    let bytes = if is_data { k.offset } else { self.nodesize };
                    let mut refs = Vec::with_capacity(ei.inline_refs.len());
                    for r in &ei.inline_refs {
                        refs.push(match *r {
                            InlineRef::TreeBlock { root } => (RefKind::TreeBlock { root }, 1),
                            InlineRef::SharedBlock { parent } => {
                                (RefKind::SharedBlock { parent }, 1)
                            }
                            InlineRef::ExtentData { root, objectid, offset, count } => {
                                (RefKind::Data { root, ino: objectid, offset }, u64::from(count))
                            }
                            InlineRef::SharedData { parent, count } => {
                                (RefKind::SharedData { parent }, u64::from(count))
                            }
                            InlineRef::Owner { .. } => continue,
                        });
                    }
                    found = Some(ExtentRefs { is_data, bytes, level, refs });
                }
                _ => {
                    let Some(f) = found.as_mut() else {
                        return inconsistent(format!("keyed backref {k} without an extent item"));
                    };
                    let short =
                        || WalkErr::Inconsistent(format!("keyed backref {k} of {} bytes", d.len()));
                    let le32 = |at: usize| {
                        d.get(at..at + 4)
                            .map(|b| u64::from(u32::from_le_bytes(b.try_into().expect("4 bytes"))))
                    };
                    let le64 = |at: usize| {
                        d.get(at..at + 8)
                            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                    };
                    f.refs.push(match k.type_ {
                        TREE_BLOCK_REF_KEY => (RefKind::TreeBlock { root: k.offset }, 1),
                        SHARED_BLOCK_REF_KEY => (RefKind::SharedBlock { parent: k.offset }, 1),
                        EXTENT_DATA_REF_KEY => {
                            let (root, ino, offset, count) = (
                                le64(0).ok_or_else(short)?,
                                le64(8).ok_or_else(short)?,
                                le64(16).ok_or_else(short)?,
                                le32(24).ok_or_else(short)?,
                            );
                            (RefKind::Data { root, ino, offset }, count)
                        }
                        SHARED_DATA_REF_KEY => {
                            (RefKind::SharedData { parent: k.offset }, le32(0).ok_or_else(short)?)
                        }
                        _ => continue,
                    });
                }
            }
        }
        self.extents.insert(bytenr, found.clone());
        Ok(found)
    }

    /// The roots of tree block `bytenr`; `level` is what its referrer says it is.
    fn block_roots(&mut self, bytenr: u64, level: Option<u8>) -> Walk<Vec<u64>> {
        if let Some(r) = self.blocks.get(&bytenr) {
            return Ok(r.clone());
        }
        let Some(ext) = self.extent(bytenr)? else {
            return inconsistent(format!(
                "tree block {bytenr} is referenced but has no extent item"
            ));
        };
        if ext.is_data {
            return inconsistent(format!("tree block {bytenr} is a data extent"));
        }
        if level.is_some_and(|l| l != ext.level) || ext.level >= MAX_LEVEL {
            return inconsistent(format!(
                "tree block {bytenr} at level {} is referenced as level {level:?}",
                ext.level
            ));
        }
        let mut roots: Vec<u64> = Vec::new();
        let mut first_key: Option<Key> = None;
        for (kind, _) in ext.refs.clone() {
            match kind {
                RefKind::TreeBlock { root } => {
                    let Some(r) = self.subvol(root)? else { continue };
                    if r.bytenr == bytenr {
                        if r.level != ext.level {
                            return inconsistent(format!("tree {root} root {bytenr} at level {} has an extent item of level {}", r.level, ext.level));
                        }
                        roots.push(root);
                        continue;
                    }
                    if r.level <= ext.level {
                        return inconsistent(format!("tree block {bytenr} level {} has a backref from tree {root}, whose root is at level {}", ext.level, r.level));
                    }
                    let key = match first_key {
                        Some(k) => k,
                        None => {
                            let eb = self.view.read_node(
                                bytenr,
                                &Expect { level: Some(ext.level), ..Default::default() },
                            )?;
                            let n = eb.node();
                            if n.nritems() == 0 {
                                return inconsistent(format!("empty tree block {bytenr} is not a root but has a backref from tree {root}"));
                            }
                            *first_key.insert(n.key(0))
                        }
                    };
                    let Some(parent) = self.find_parent(&r, &key, ext.level, bytenr)? else {
                        return inconsistent(format!("tree block {bytenr} has a backref from tree {root}, whose tree does not point at it"));
                    };
                    roots.extend(self.block_roots(parent, Some(ext.level + 1))?);
                }
                RefKind::SharedBlock { parent } => {
                    roots.extend(self.block_roots(parent, Some(ext.level + 1))?)
                }
                RefKind::Data { .. } | RefKind::SharedData { .. } => {
                    return inconsistent(format!("tree block {bytenr} has data backref {kind:?}"))
                }
            }
        }
        roots.sort_unstable();
        roots.dedup();
        self.blocks.insert(bytenr, roots.clone());
        Ok(roots)
    }

    /// The node of tree `r` at level `level + 1` whose pointer for `key` names
    /// `bytenr`, if any.
    fn find_parent(
        &mut self,
        r: &RootInfo,
        key: &Key,
        level: u8,
        bytenr: u64,
    ) -> Walk<Option<u64>> {
        let mut cur = self.view.read_node(
            r.bytenr,
            &Expect {
                level: Some(r.level),
                generation: Some(r.generation),
                owner: Some(r.id),
                first_key: None,
            },
        )?;
        loop {
            let next = {
                let n = cur.node();
                if n.nritems() == 0 || n.level() == 0 {
                    return Ok(None);
                }
                let slot = match n.search(key) {
                    Ok(s) => s,
                    Err(s) => s.saturating_sub(1),
                };
                if n.level() == level + 1 {
                    return Ok((n.blockptr(slot) == bytenr).then(|| cur.bytenr()));
                }
                (
                    n.blockptr(slot),
                    Expect {
                        level: Some(n.level() - 1),
                        generation: Some(n.ptr_generation(slot)),
                        owner: Some(r.id),
                        first_key: Some(n.key(slot)),
                    },
                )
            };
            cur = self.view.read_node(next.0, &next.1)?;
        }
    }

    /// The roots of data extent `bytenr`.
    fn data_roots(&mut self, bytenr: u64, ext: &ExtentRefs) -> Walk<Vec<u64>> {
        let mut roots = Vec::new();
        for &(kind, count) in &ext.refs {
            match kind {
                RefKind::Data { root, ino, offset } => {
                    let Some(r) = self.subvol(root)? else { continue };
                    let mut leaves: Vec<u64> = Vec::new();
                    let mut seen = 0u64;
                    // A file extent before the extent's start (a clone of its tail) makes
                    // the offset wrap: search the whole file then, as the kernel does.
                    let from = if offset >= i64::MAX as u64 { 0 } else { offset };
                    let mut it = self.view.iter(&r, Key::new(ino, EXTENT_DATA_KEY, from))?;
                    while seen < count {
                        let Some(item) = it.next_item()? else { break };
                        let k = item.key();
                        if k.objectid != ino || k.type_ != EXTENT_DATA_KEY {
                            break;
                        }
                        let fe = items::file_extent(item.data()).map_err(|e| {
                            WalkErr::Inconsistent(format!("tree {root} file extent {k}: {e}"))
                        })?;
                        if let FileExtent::Regular { disk_bytenr, offset: fo, .. } = fe {
                            if disk_bytenr == bytenr && k.offset.wrapping_sub(fo) == offset {
                                seen += 1;
                                let leaf = item.eb.bytenr();
                                if leaves.last() != Some(&leaf) {
                                    leaves.push(leaf);
                                }
                            }
                        }
                    }
                    if seen < count {
                        return inconsistent(format!("data extent {bytenr} has {count} references from root {root} ino {ino} offset {offset}, the tree holds {seen}"));
                    }
                    for leaf in leaves {
                        roots.extend(self.block_roots(leaf, Some(0))?);
                    }
                }
                RefKind::SharedData { parent } => roots.extend(self.block_roots(parent, Some(0))?),
                RefKind::TreeBlock { .. } | RefKind::SharedBlock { .. } => {
                    return inconsistent(format!("data extent {bytenr} has tree backref {kind:?}"))
                }
            }
        }
        roots.sort_unstable();
        roots.dedup();
        Ok(roots)
    }
}
