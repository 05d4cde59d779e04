//! Pass 1: walk every tree block once and collect what the later passes compare.
//!
//! Each tree is walked depth-first with an explicit stack of (block, next slot, upper
//! bound) frames, so memory is one path per tree. A child is read with the
//! expectations its parent pointer implies (level, generation, owner, first key); a
//! failed read is re-read without them to tell a mismatch (named finding) from a block
//! that is bad in itself. A block reached a second time (shared by snapshots, or
//! cross-linked) is not walked again, but the new parent's expectations are still
//! compared and the reference is still recorded.
//!
//! Every reference is recorded against the referencing block (`RefFrom::Block`) and
//! resolved later, once the extent tree tells which blocks carry FULL_BACKREF: a block
//! refers to its children and file extents as `parent = itself` when it has
//! FULL_BACKREF, else as `root = its owner` (how btrfs counts backrefs).

use super::codes::*;
use super::{Finding, Sink};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use ubtrfs_core::{Expect, ExtentBuffer, FsInfo, RootInfo, TreeView};
use ubtrfs_format::features::*;
use ubtrfs_format::hash::hash_extent_data_ref;
use ubtrfs_format::items::{self, FileExtent, InlineRef};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;

/// How far past its hash a keyed EXTENT_DATA_REF's key offset may be (collisions).
const KEYED_REF_COLLISION_WINDOW: u64 = 64;

/// What is known about a tree block after pass 1.
#[derive(Clone, Debug)]
pub(super) struct BlockInfo {
    pub level: u8,
    pub generation: u64,
    pub owner: u64,
    pub first: Option<Key>,
    pub last: Option<Key>,
    /// Header flags (WRITTEN, RELOC, backref revision).
    pub hflags: u64,
    /// The read failed: nothing else here is meaningful.
    pub bad: bool,
    /// Reached from the log tree (not accounted in the extent tree).
    pub log: bool,
}

/// Where a reference to a tree block comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RefFrom {
    /// A pointer in a node.
    Block(u64),
    /// A root item (or the superblock) of tree `id`.
    Root(u64),
    /// A root that refers to its root block with a shared ref (reloc trees, old
    /// backref revision).
    SelfShared,
}

/// A tree-block backref, as the extent tree keys it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum TreeRef {
    Root(u64),
    Shared(u64),
}

impl std::fmt::Display for TreeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TreeRef::Root(r) => write!(f, "tree block ref root {r}"),
            TreeRef::Shared(p) => write!(f, "shared block ref parent {p}"),
        }
    }
}

/// A data backref, as the extent tree keys it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum DataRef {
    Root { root: u64, ino: u64, offset: u64 },
    Shared(u64),
}

impl std::fmt::Display for DataRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataRef::Root { root, ino, offset } => {
                write!(f, "extent data ref root {root} ino {ino} offset {offset}")
            }
            DataRef::Shared(p) => write!(f, "shared data ref parent {p}"),
        }
    }
}

/// A file extent item's reference to a data extent, before resolution.
#[derive(Clone, Debug)]
pub(super) struct RawDataRef {
    pub leaf: u64,
    /// The leaf's owner (the root the ref counts against without FULL_BACKREF).
    pub owner: u64,
    pub ino: u64,
    /// `key.offset - fi.offset` (wrapping, as btrfs computes it).
    pub offset: u64,
    pub file_offset: u64,
    pub disk_num_bytes: u64,
    pub prealloc: bool,
}

/// An EXTENT_ITEM or METADATA_ITEM with all its backrefs (inline and keyed).
#[derive(Clone, Debug)]
pub(super) struct ExtentRec {
    pub key: Key,
    pub len: u64,
    pub is_tree: bool,
    /// Tree level (METADATA_ITEM offset or tree_block_info level).
    pub level: u8,
    pub refs: u64,
    pub flags: u64,
    pub tree_refs: Vec<TreeRef>,
    pub data_refs: Vec<(DataRef, u64)>,
}

#[derive(Clone, Debug)]
pub(super) struct BgRec {
    pub len: u64,
    pub used: u64,
    pub flags: u64,
}

#[derive(Clone, Debug)]
pub(super) struct ChunkRec {
    pub length: u64,
    pub type_: u64,
    pub sub_stripes: u16,
    pub stripes: Vec<(u64, u64)>,
}

#[derive(Clone, Debug)]
pub(super) struct DevRec {
    pub total_bytes: u64,
    pub bytes_used: u64,
}

#[derive(Clone, Debug)]
pub(super) struct DevExtRec {
    pub length: u64,
    pub chunk_offset: u64,
}

#[derive(Clone, Debug)]
pub(super) struct CsumRec {
    pub start: u64,
    pub end: u64,
    pub leaf: u64,
    pub slot: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FstKind {
    Extent,
    Bitmap,
}

/// A FREE_SPACE_EXTENT or FREE_SPACE_BITMAP item, with its free runs.
#[derive(Clone, Debug)]
pub(super) struct FstItem {
    pub key: Key,
    pub kind: FstKind,
    /// Free ranges it describes (for a bitmap: its runs of set bits).
    pub runs: Vec<(u64, u64)>,
}

/// A ROOT_ITEM of the root tree.
#[derive(Clone, Debug)]
pub(super) struct RootRec {
    pub key: Key,
    pub info: RootInfo,
    pub refs: u32,
    pub last_snapshot: u64,
    pub root_dirid: u64,
    /// drop_progress and drop_level while the tree is being deleted.
    pub drop: Option<(Key, u8)>,
    /// Some block of this tree could not be read or was not walked.
    pub damaged: bool,
}

/// A ROOT_REF or ROOT_BACKREF.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct RootLink {
    pub parent: u64,
    pub child: u64,
    pub dirid: u64,
    pub sequence: u64,
    pub name: Vec<u8>,
}

/// Everything pass 1 collects.
#[derive(Default)]
pub(super) struct State {
    pub trees_walked: u64,
    pub blocks: HashMap<u64, BlockInfo>,
    /// Child block -> every reference to it.
    pub edges: HashMap<u64, Vec<RefFrom>>,
    /// Data extent start -> every file extent item that uses it.
    pub data_refs: HashMap<u64, Vec<RawDataRef>>,
    pub extents: BTreeMap<u64, ExtentRec>,
    pub block_groups: BTreeMap<u64, BgRec>,
    pub chunks: BTreeMap<u64, ChunkRec>,
    pub devices: BTreeMap<u64, DevRec>,
    pub dev_extents: BTreeMap<(u64, u64), DevExtRec>,
    pub csums: Vec<CsumRec>,
    pub fst_infos: BTreeMap<u64, (u64, u32, u32)>,
    pub fst_items: Vec<FstItem>,
    pub roots: Vec<RootRec>,
    pub root_refs: Vec<RootLink>,
    pub root_backrefs: Vec<RootLink>,
    /// Root ids with an ORPHAN_ITEM in the root tree.
    pub root_orphans: HashSet<u64>,
    /// The tree holding block group items.
    pub bg_tree: u64,
    /// Trees (by id) with unreadable blocks.
    pub damaged_trees: HashSet<u64>,
    /// Data extents (start, length) that file extents in the log tree use; they get
    /// extent items only when the log is replayed, but their csums are already in the
    /// csum tree.
    pub log_data: Vec<(u64, u64)>,
    /// QGROUP_STATUS flags, if the quota tree has a status item.
    pub qgroup_status: Option<u64>,
    /// QGROUP_INFO: qgroupid -> (referenced, exclusive).
    pub qgroup_info: BTreeMap<u64, (u64, u64)>,
    /// QGROUP_RELATION items as (member, parent), member < parent.
    pub qgroup_relations: Vec<(u64, u64)>,
}

/// How one tree is walked.
struct TreeCtx {
    id: u64,
    root: RootInfo,
    log: bool,
    drop: Option<(Key, u8)>,
    root_from: RefFrom,
}

/// Who states the expectations a block is read with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ExpectFrom {
    RootItem,
    Parent,
}

struct Frame {
    eb: Arc<ExtentBuffer>,
    slot: usize,
    bound: Option<Key>,
}

struct Walker<'a> {
    fs: &'a FsInfo,
    st: State,
    sink: &'a mut Sink,
    /// Keyed backrefs, merged into `extents` after the walk.
    keyed: Vec<(Key, KeyedRef)>,
    /// ROOT_ITEMs found in the log root tree.
    log_roots: Vec<(Key, RootInfo)>,
}

enum KeyedRef {
    Tree(TreeRef),
    Data(DataRef, u64),
}

/// Walk every tree and collect pass-1 state.
pub(super) fn walk(fs: &FsInfo, sink: &mut Sink) -> State {
    let compat_ro = fs.super_copy().compat_ro_flags.get();
    let bg_tree = if compat_ro & COMPAT_RO_BLOCK_GROUP_TREE != 0 {
        BLOCK_GROUP_TREE_OBJECTID
    } else {
        EXTENT_TREE_OBJECTID
    };
    let mut w = Walker {
        fs,
        st: State { bg_tree, ..State::default() },
        sink,
        keyed: Vec::new(),
        log_roots: Vec::new(),
    };

    let chunk = fs.chunk_root();
    w.walk_tree(&TreeCtx {
        id: CHUNK_TREE_OBJECTID,
        root: chunk,
        log: false,
        drop: None,
        root_from: RefFrom::Root(CHUNK_TREE_OBJECTID),
    });
    let root = fs.tree_root();
    w.walk_tree(&TreeCtx {
        id: ROOT_TREE_OBJECTID,
        root,
        log: false,
        drop: None,
        root_from: RefFrom::Root(ROOT_TREE_OBJECTID),
    });

    let mut roots = std::mem::take(&mut w.st.roots);
    roots.sort_by_key(|r| (r.key.objectid, r.key.offset));
    for r in &mut roots {
        let from = if r.key.objectid == TREE_RELOC_OBJECTID {
            RefFrom::SelfShared
        } else {
            RefFrom::Root(r.key.objectid)
        };
        let ctx =
            TreeCtx { id: r.key.objectid, root: r.info, log: false, drop: r.drop, root_from: from };
        w.walk_tree(&ctx);
        r.damaged = w.st.damaged_trees.contains(&r.key.objectid) || r.drop.is_some();
    }
    w.st.roots = roots;
    w.check_required_roots();

    if let Some(log) = fs.log_root() {
        w.walk_tree(&TreeCtx {
            id: TREE_LOG_OBJECTID,
            root: log,
            log: true,
            drop: None,
            root_from: RefFrom::SelfShared,
        });
        let log_roots = std::mem::take(&mut w.log_roots);
        for (key, info) in log_roots {
            let _ = key;
            w.walk_tree(&TreeCtx {
                id: TREE_LOG_OBJECTID,
                root: info,
                log: true,
                drop: None,
                root_from: RefFrom::SelfShared,
            });
        }
        w.sink.note(format!("log tree at {} (generation {}): its blocks are checked here; the filesystem after its replay is checked apart (`ubtrfs check` replays it in memory)", log.bytenr, log.generation));
    }
    w.merge_keyed();
    w.st
}

impl Walker<'_> {
    fn push(&mut self, f: Finding) {
        self.sink.push(f);
    }

    fn check_required_roots(&mut self) {
        let compat_ro = self.fs.super_copy().compat_ro_flags.get();
        let have: HashSet<u64> = self.st.roots.iter().map(|r| r.key.objectid).collect();
        let mut need = vec![
            (EXTENT_TREE_OBJECTID, "extent"),
            (DEV_TREE_OBJECTID, "dev"),
            (FS_TREE_OBJECTID, "fs"),
            (CSUM_TREE_OBJECTID, "csum"),
        ];
        if compat_ro & COMPAT_RO_FREE_SPACE_TREE != 0 {
            need.push((FREE_SPACE_TREE_OBJECTID, "free space"));
        }
        if compat_ro & COMPAT_RO_BLOCK_GROUP_TREE != 0 {
            need.push((BLOCK_GROUP_TREE_OBJECTID, "block group"));
        }
        for (id, name) in need {
            if !have.contains(&id) {
                self.push(
                    Finding::new(ROOT_MISSING, format!("the {name} tree has no root item"))
                        .root(id),
                );
            }
        }
    }

    /// Walk one tree from its root block.
    fn walk_tree(&mut self, t: &TreeCtx) {
        self.st.trees_walked += 1;
        let r = t.root;
        if r.level >= MAX_LEVEL {
            self.push(
                Finding::new(
                    LEVEL_MISMATCH,
                    format!("root level {} is not below {MAX_LEVEL}", r.level),
                )
                .root(t.id)
                .bytenr(r.bytenr),
            );
            self.st.damaged_trees.insert(t.id);
            return;
        }
        if !t.log {
            self.st.edges.entry(r.bytenr).or_default().push(t.root_from);
        }
        let owner = if t.log { TREE_LOG_OBJECTID } else { t.id };
        let expect = Expect {
            level: Some(r.level),
            generation: Some(r.generation),
            owner: Some(owner),
            first_key: None,
        };
        let Some(eb) = self.read_block(t, r.bytenr, &expect, None, ExpectFrom::RootItem) else {
            return;
        };
        let mut stack = vec![self.frame(t, eb, None)];
        while let Some(top) = stack.last_mut() {
            let n = top.eb.node();
            if n.is_leaf() || top.slot >= n.nritems() {
                stack.pop();
                continue;
            }
            let slot = top.slot;
            top.slot += 1;
            let (level, child, gen, key) =
                (n.level(), n.blockptr(slot), n.ptr_generation(slot), n.key(slot));
            if let Some((dkey, dlevel)) = t.drop {
                // Slots left of the drop point were already freed by the deletion.
                if level == dlevel && key < dkey {
                    continue;
                }
            }
            let bound = if slot + 1 < n.nritems() { Some(n.key(slot + 1)) } else { top.bound };
            let parent = top.eb.bytenr;
            if !t.log {
                self.st.edges.entry(child).or_default().push(RefFrom::Block(parent));
            }
            let expect = Expect {
                level: Some(level - 1),
                generation: Some(gen),
                owner: Some(owner),
                first_key: Some(key),
            };
            if let Some(ceb) = self.read_block(t, child, &expect, bound, ExpectFrom::Parent) {
                let f = self.frame(t, ceb, bound);
                stack.push(f);
            }
        }
    }

    /// A frame for a freshly read block; leaves are processed here.
    fn frame(&mut self, t: &TreeCtx, eb: Arc<ExtentBuffer>, bound: Option<Key>) -> Frame {
        let n = eb.node();
        let mut slot = 0;
        if n.is_leaf() {
            self.collect_leaf(t, &eb);
        } else if let Some((dkey, dlevel)) = t.drop {
            if dlevel > 0 && n.level() > dlevel {
                slot = match n.search(&dkey) {
                    Ok(s) => s,
                    Err(s) => s.saturating_sub(1),
                };
            }
        }
        Frame { eb, slot, bound }
    }

    /// Read a block once. Returns it only when it is new and good (to be walked).
    fn read_block(
        &mut self,
        t: &TreeCtx,
        bytenr: u64,
        expect: &Expect,
        bound: Option<Key>,
        from: ExpectFrom,
    ) -> Option<Arc<ExtentBuffer>> {
        let is_root = from == ExpectFrom::RootItem;
        if let Some(info) = self.st.blocks.get(&bytenr).cloned() {
            self.compare_seen(t, bytenr, &info, expect, bound, from);
            return None;
        }
        match self.fs.read_tree_block(bytenr, expect) {
            Ok(eb) => {
                let n = eb.node();
                let nr = n.nritems();
                let info = BlockInfo {
                    level: n.level(),
                    generation: n.generation(),
                    owner: n.owner(),
                    first: (nr > 0).then(|| n.key(0)),
                    last: (nr > 0).then(|| n.key(nr - 1)),
                    hflags: n.header().flags.get(),
                    bad: false,
                    log: t.log,
                };
                self.block_checks(t, bytenr, &info, bound, is_root);
                self.st.blocks.insert(bytenr, info);
                Some(eb)
            }
            Err(e) => {
                self.st.damaged_trees.insert(t.id);
                let plain = self.fs.read_tree_block(bytenr, &Expect::default());
                let mut info = BlockInfo {
                    level: 0,
                    generation: 0,
                    owner: 0,
                    first: None,
                    last: None,
                    hflags: 0,
                    bad: true,
                    log: t.log,
                };
                match plain {
                    Ok(eb) => {
                        let n = eb.node();
                        info.level = n.level();
                        info.generation = n.generation();
                        info.owner = n.owner();
                        info.first = (n.nritems() > 0).then(|| n.key(0));
                        let before = self.sink.report.findings.len() + self.sink.report.dropped;
                        self.compare_seen(t, bytenr, &info, expect, None, from);
                        if self.sink.report.findings.len() + self.sink.report.dropped == before {
                            self.push(
                                Finding::new(TREE_BLOCK_INVALID, e.to_string())
                                    .root(t.id)
                                    .bytenr(bytenr),
                            );
                        }
                    }
                    Err(e2) => {
                        self.push(
                            Finding::new(TREE_BLOCK_INVALID, e2.to_string())
                                .root(t.id)
                                .bytenr(bytenr),
                        );
                    }
                }
                self.st.blocks.insert(bytenr, info);
                None
            }
        }
    }

    /// Compare what a parent (or root item) expects with a block already known.
    fn compare_seen(
        &mut self,
        t: &TreeCtx,
        bytenr: u64,
        info: &BlockInfo,
        expect: &Expect,
        bound: Option<Key>,
        from: ExpectFrom,
    ) {
        let from = match from {
            ExpectFrom::RootItem => "root item",
            ExpectFrom::Parent => "parent",
        };
        if info.bad && info.owner == 0 && info.generation == 0 {
            return;
        }
        if let Some(l) = expect.level {
            if info.level != l {
                self.push(
                    Finding::new(
                        LEVEL_MISMATCH,
                        format!("block level {}, {from} expects {l}", info.level),
                    )
                    .root(t.id)
                    .bytenr(bytenr),
                );
            }
        }
        if let Some(g) = expect.generation {
            if info.generation != g {
                self.push(
                    Finding::new(
                        GENERATION_MISMATCH,
                        format!("block generation {}, {from} expects {g}", info.generation),
                    )
                    .root(t.id)
                    .bytenr(bytenr),
                );
            }
        }
        if let Some(k) = expect.first_key {
            if let Some(first) = info.first {
                if first != k {
                    self.push(
                        Finding::new(
                            FIRST_KEY_MISMATCH,
                            format!("first key {first}, parent pointer key {k}"),
                        )
                        .root(t.id)
                        .bytenr(bytenr),
                    );
                }
            }
        }
        if let Some(o) = expect.owner {
            let ok = if is_fstree(o) { is_fstree(info.owner) } else { info.owner == o };
            if !ok {
                self.push(
                    Finding::new(
                        OWNER_MISMATCH,
                        format!("block owner {}, referenced from tree {}", info.owner, t.id),
                    )
                    .root(t.id)
                    .bytenr(bytenr),
                );
            }
        }
        if let (Some(b), Some(last)) = (bound, info.last) {
            if last >= b {
                self.push(
                    Finding::new(
                        KEY_ORDER,
                        format!("last key {last} is not below the parent's next key {b}"),
                    )
                    .root(t.id)
                    .bytenr(bytenr),
                );
            }
        }
        if info.log != t.log {
            self.push(
                Finding::new(
                    BLOCK_MULTIPLY_REFERENCED,
                    "block is used by both the log tree and a committed tree",
                )
                .root(t.id)
                .bytenr(bytenr),
            );
        }
    }

    /// Checks of a block that passed its read.
    fn block_checks(
        &mut self,
        t: &TreeCtx,
        bytenr: u64,
        info: &BlockInfo,
        bound: Option<Key>,
        is_root: bool,
    ) {
        let sb_gen = self.fs.super_copy().generation.get();
        let nodesize = u64::from(self.fs.nodesize);
        if !t.log && info.generation > sb_gen {
            self.push(
                Finding::new(
                    GENERATION_TOO_NEW,
                    format!(
                        "block generation {} is newer than the superblock generation {sb_gen}",
                        info.generation
                    ),
                )
                .root(t.id)
                .bytenr(bytenr),
            );
        }
        let end = bytenr.saturating_add(nodesize);
        if nodesize <= STRIPE_LEN && bytenr / STRIPE_LEN != (end - 1) / STRIPE_LEN {
            self.push(
                Finding::new(
                    CROSSING_STRIPE,
                    format!("tree block [{bytenr}, {end}) crosses a 64 KiB stripe boundary"),
                )
                .root(t.id)
                .bytenr(bytenr),
            );
        }
        match self.fs.chunk_map.lookup(ubtrfs_core::Logical(bytenr)) {
            Ok(c) => {
                let want = if t.id == CHUNK_TREE_OBJECTID {
                    BLOCK_GROUP_SYSTEM
                } else {
                    BLOCK_GROUP_METADATA
                };
                if c.type_ & want == 0 {
                    let what = if want == BLOCK_GROUP_SYSTEM { "SYSTEM" } else { "METADATA" };
                    self.push(
                        Finding::new(
                            BLOCK_WRONG_CHUNK,
                            format!(
                                "tree block is in chunk {} of type {}, expected {what}",
                                c.logical,
                                block_group_flags_str(c.type_)
                            ),
                        )
                        .root(t.id)
                        .bytenr(bytenr),
                    );
                } else if end > c.logical.saturating_add(c.length) {
                    self.push(
                        Finding::new(
                            BLOCK_WRONG_CHUNK,
                            format!("tree block ends past chunk {} +{}", c.logical, c.length),
                        )
                        .root(t.id)
                        .bytenr(bytenr),
                    );
                }
            }
            Err(_) => self.push(
                Finding::new(BLOCK_WRONG_CHUNK, "tree block is not inside any chunk")
                    .root(t.id)
                    .bytenr(bytenr),
            ),
        }
        if info.level == 0 && info.first.is_none() && !is_root {
            self.push(
                Finding::new(EMPTY_LEAF, "empty leaf below a node").root(t.id).bytenr(bytenr),
            );
        }
        if let (Some(b), Some(last)) = (bound, info.last) {
            if last >= b {
                self.push(
                    Finding::new(
                        KEY_ORDER,
                        format!("last key {last} is not below the parent's next key {b}"),
                    )
                    .root(t.id)
                    .bytenr(bytenr),
                );
            }
        }
    }

    /// Does item type `ty` belong in tree `tree`? Only the types that live in exactly
    /// one kind of tree are judged.
    fn item_allowed(&self, tree: u64, ty: u8) -> bool {
        match ty {
            EXTENT_ITEM_KEY | METADATA_ITEM_KEY | TREE_BLOCK_REF_KEY | EXTENT_DATA_REF_KEY
            | EXTENT_REF_V0_KEY | SHARED_BLOCK_REF_KEY | SHARED_DATA_REF_KEY => {
                tree == EXTENT_TREE_OBJECTID
            }
            BLOCK_GROUP_ITEM_KEY => tree == self.st.bg_tree,
            CHUNK_ITEM_KEY | DEV_ITEM_KEY => tree == CHUNK_TREE_OBJECTID,
            DEV_EXTENT_KEY => tree == DEV_TREE_OBJECTID,
            EXTENT_CSUM_KEY => tree == CSUM_TREE_OBJECTID,
            FREE_SPACE_INFO_KEY | FREE_SPACE_EXTENT_KEY | FREE_SPACE_BITMAP_KEY => {
                tree == FREE_SPACE_TREE_OBJECTID
            }
            ROOT_ITEM_KEY | ROOT_REF_KEY | ROOT_BACKREF_KEY => tree == ROOT_TREE_OBJECTID,
            _ => true,
        }
    }

    fn collect_leaf(&mut self, t: &TreeCtx, eb: &Arc<ExtentBuffer>) {
        let n = eb.node();
        for slot in 0..n.nritems() {
            let key = n.key(slot);
            let data = n.item_data(slot);
            if t.log {
                if key.type_ == EXTENT_DATA_KEY {
                    if let Ok(FileExtent::Regular { disk_bytenr, disk_num_bytes, .. }) =
                        items::file_extent(data)
                    {
                        if disk_bytenr != 0 {
                            self.st.log_data.push((disk_bytenr, disk_num_bytes));
                        }
                    }
                }
                if key.type_ == ROOT_ITEM_KEY && key.objectid == TREE_LOG_OBJECTID {
                    if let Ok(v) = items::root_item(data) {
                        let info = RootInfo {
                            id: TREE_LOG_OBJECTID,
                            bytenr: v.item.bytenr.get(),
                            level: v.item.level,
                            generation: v.item.generation.get(),
                        };
                        self.log_roots.push((key, info));
                    }
                }
                continue;
            }
            if !self.item_allowed(t.id, key.type_) {
                self.push(
                    Finding::new(
                        ITEM_WRONG_TREE,
                        format!("{} item in tree {}", item_type_name(key.type_), t.id),
                    )
                    .root(t.id)
                    .bytenr(eb.bytenr)
                    .key(key),
                );
                continue;
            }
            match key.type_ {
                EXTENT_DATA_KEY => {
                    if let Ok(FileExtent::Regular {
                        disk_bytenr,
                        disk_num_bytes,
                        offset,
                        prealloc,
                        ..
                    }) = items::file_extent(data)
                    {
                        if disk_bytenr != 0 {
                            self.st.data_refs.entry(disk_bytenr).or_default().push(RawDataRef {
                                leaf: eb.bytenr,
                                owner: n.owner(),
                                ino: key.objectid,
                                offset: key.offset.wrapping_sub(offset),
                                file_offset: key.offset,
                                disk_num_bytes,
                                prealloc,
                            });
                        }
                    }
                }
                EXTENT_ITEM_KEY | METADATA_ITEM_KEY => {
                    self.collect_extent_item(eb.bytenr, key, data)
                }
                TREE_BLOCK_REF_KEY => {
                    self.keyed.push((key, KeyedRef::Tree(TreeRef::Root(key.offset))))
                }
                SHARED_BLOCK_REF_KEY => {
                    self.keyed.push((key, KeyedRef::Tree(TreeRef::Shared(key.offset))))
                }
                EXTENT_DATA_REF_KEY => {
                    if let Ok(r) = items::read_prefix::<ExtentDataRef>(data, "extent data ref") {
                        let (root, ino, off) = (r.root.get(), r.objectid.get(), r.offset.get());
                        let h = hash_extent_data_ref(root, ino, off);
                        // On a hash collision the kernel bumps the key offset by one
                        // until it is free, so a few steps past the hash are valid.
                        if key.offset.wrapping_sub(h) >= KEYED_REF_COLLISION_WINDOW {
                            self.push(
                                Finding::new(KEYED_REF_HASH, format!("key offset {:#x}, hash of (root {root}, ino {ino}, offset {off}) is {h:#x}", key.offset))
                                    .root(t.id)
                                    .bytenr(key.objectid)
                                    .key(key),
                            );
                        }
                        self.keyed.push((
                            key,
                            KeyedRef::Data(
                                DataRef::Root { root, ino, offset: off },
                                u64::from(r.count.get()),
                            ),
                        ));
                    }
                }
                SHARED_DATA_REF_KEY => {
                    if let Ok(r) = items::read_prefix::<SharedDataRef>(data, "shared data ref") {
                        self.keyed.push((
                            key,
                            KeyedRef::Data(DataRef::Shared(key.offset), u64::from(r.count.get())),
                        ));
                    }
                }
                BLOCK_GROUP_ITEM_KEY => {
                    if let Ok(b) = items::read_prefix::<BlockGroupItem>(data, "block group") {
                        match self.st.block_groups.entry(key.objectid) {
                            std::collections::btree_map::Entry::Occupied(_) => {
                                self.sink.push(
                                    Finding::new(
                                        BLOCK_GROUP_MISMATCH,
                                        "two block group items start here",
                                    )
                                    .root(t.id)
                                    .bytenr(key.objectid)
                                    .key(key),
                                );
                            }
                            std::collections::btree_map::Entry::Vacant(v) => {
                                v.insert(BgRec {
                                    len: key.offset,
                                    used: b.used.get(),
                                    flags: b.flags.get(),
                                });
                            }
                        }
                    }
                }
                CHUNK_ITEM_KEY => {
                    if let Ok((c, _)) = items::chunk(data) {
                        self.st.chunks.insert(
                            key.offset,
                            ChunkRec {
                                length: c.length,
                                type_: c.type_,
                                sub_stripes: c.sub_stripes,
                                stripes: c.stripes.iter().map(|s| (s.0, s.1)).collect(),
                            },
                        );
                    }
                }
                DEV_ITEM_KEY => {
                    if let Ok(d) = items::read_prefix::<DevItem>(data, "dev item") {
                        self.st.devices.insert(
                            key.offset,
                            DevRec {
                                total_bytes: d.total_bytes.get(),
                                bytes_used: d.bytes_used.get(),
                            },
                        );
                    }
                }
                DEV_EXTENT_KEY => {
                    if let Ok(d) = items::read_prefix::<DevExtent>(data, "dev extent") {
                        self.st.dev_extents.insert(
                            (key.objectid, key.offset),
                            DevExtRec {
                                length: d.length.get(),
                                chunk_offset: d.chunk_offset.get(),
                            },
                        );
                    }
                }
                EXTENT_CSUM_KEY => {
                    let csize = self.fs.csum_type.size() as u64;
                    let len = data.len() as u64 / csize * u64::from(self.fs.sectorsize);
                    self.st.csums.push(CsumRec {
                        start: key.offset,
                        end: key.offset.saturating_add(len),
                        leaf: eb.bytenr,
                        slot,
                    });
                }
                FREE_SPACE_INFO_KEY => {
                    if let Ok(i) = items::read_prefix::<FreeSpaceInfo>(data, "free space info") {
                        self.st.fst_infos.insert(
                            key.objectid,
                            (key.offset, i.extent_count.get(), i.flags.get()),
                        );
                    }
                }
                FREE_SPACE_EXTENT_KEY => {
                    self.st.fst_items.push(FstItem {
                        key,
                        kind: FstKind::Extent,
                        runs: vec![(key.objectid, key.objectid.saturating_add(key.offset))],
                    });
                }
                FREE_SPACE_BITMAP_KEY => {
                    let runs =
                        bitmap_runs(key.objectid, key.offset, u64::from(self.fs.sectorsize), data);
                    self.st.fst_items.push(FstItem { key, kind: FstKind::Bitmap, runs });
                }
                ROOT_ITEM_KEY => {
                    if let Ok(v) = items::root_item(data) {
                        let it = &v.item;
                        let dk = Key::from(&it.drop_progress);
                        self.st.roots.push(RootRec {
                            key,
                            info: RootInfo {
                                id: key.objectid,
                                bytenr: it.bytenr.get(),
                                level: it.level,
                                generation: it.generation.get(),
                            },
                            refs: it.refs.get(),
                            last_snapshot: it.last_snapshot.get(),
                            root_dirid: it.root_dirid.get(),
                            drop: (dk.objectid != 0).then_some((dk, it.drop_level)),
                            damaged: false,
                        });
                    }
                }
                ROOT_REF_KEY | ROOT_BACKREF_KEY => {
                    if let Ok(r) = items::root_ref(data) {
                        let (parent, child) = if key.type_ == ROOT_REF_KEY {
                            (key.objectid, key.offset)
                        } else {
                            (key.offset, key.objectid)
                        };
                        let link = RootLink {
                            parent,
                            child,
                            dirid: r.dirid,
                            sequence: r.sequence,
                            name: r.name.to_vec(),
                        };
                        if key.type_ == ROOT_REF_KEY {
                            self.st.root_refs.push(link);
                        } else {
                            self.st.root_backrefs.push(link);
                        }
                    }
                }
                QGROUP_STATUS_KEY if t.id == QUOTA_TREE_OBJECTID => {
                    if let Ok(flags) = items::qgroup_status_flags(data) {
                        self.st.qgroup_status = Some(flags);
                    }
                }
                QGROUP_INFO_KEY if t.id == QUOTA_TREE_OBJECTID => {
                    if let Ok(q) = items::read_prefix::<QgroupInfoItem>(data, "qgroup info") {
                        self.st.qgroup_info.insert(key.offset, (q.rfer.get(), q.excl.get()));
                    }
                }
                QGROUP_RELATION_KEY if t.id == QUOTA_TREE_OBJECTID && key.objectid < key.offset => {
                    self.st.qgroup_relations.push((key.objectid, key.offset));
                }
                ORPHAN_ITEM_KEY
                    if t.id == ROOT_TREE_OBJECTID && key.objectid == ORPHAN_OBJECTID =>
                {
                    self.st.root_orphans.insert(key.offset);
                }
                _ => {}
            }
        }
    }

    fn collect_extent_item(&mut self, leaf: u64, key: Key, data: &[u8]) {
        let skinny = key.type_ == METADATA_ITEM_KEY;
        let Ok(v) = items::extent_item(data, skinny) else {
            return;
        };
        if skinny && self.fs.super_copy().incompat_flags.get() & INCOMPAT_SKINNY_METADATA == 0 {
            self.push(
                Finding::new(
                    SKINNY_WITHOUT_FEATURE,
                    "METADATA_ITEM without the SKINNY_METADATA feature",
                )
                .root(EXTENT_TREE_OBJECTID)
                .bytenr(key.objectid)
                .key(key),
            );
        }
        let is_tree = v.flags & EXTENT_FLAG_TREE_BLOCK != 0;
        let nodesize = u64::from(self.fs.nodesize);
        let (len, level) = if skinny {
            (nodesize, key.offset as u8)
        } else {
            (key.offset, v.tree_block_info.map(|(_, l)| l).unwrap_or(0))
        };
        // Inline refs: type ascending (the tree checker enforces it), then sequence
        // descending within a type; equal sequences are tolerated as btrfs does.
        let mut last: Option<(u8, u64)> = None;
        let mut tree_refs = Vec::new();
        let mut data_refs = Vec::new();
        for r in &v.inline_refs {
            let seq = match *r {
                InlineRef::TreeBlock { root } => {
                    tree_refs.push(TreeRef::Root(root));
                    root
                }
                InlineRef::SharedBlock { parent } => {
                    tree_refs.push(TreeRef::Shared(parent));
                    parent
                }
                InlineRef::ExtentData { root, objectid, offset, count } => {
                    data_refs
                        .push((DataRef::Root { root, ino: objectid, offset }, u64::from(count)));
                    hash_extent_data_ref(root, objectid, offset)
                }
                InlineRef::SharedData { parent, count } => {
                    data_refs.push((DataRef::Shared(parent), u64::from(count)));
                    parent
                }
                InlineRef::Owner { root } => root,
            };
            let ty = r.type_();
            if let Some((lt, ls)) = last {
                if ty == lt && seq > ls {
                    self.push(
                        Finding::new(
                            INLINE_REF_ORDER,
                            format!(
                                "inline ref type {ty} sequence {seq:#x} after sequence {ls:#x}"
                            ),
                        )
                        .root(EXTENT_TREE_OBJECTID)
                        .bytenr(key.objectid)
                        .key(key),
                    );
                }
            }
            last = Some((ty, seq));
        }
        let rec = ExtentRec {
            key,
            len,
            is_tree,
            level,
            refs: v.refs,
            flags: v.flags,
            tree_refs,
            data_refs,
        };
        if let Some(prev) = self.st.extents.get(&key.objectid) {
            self.push(
                Finding::new(
                    EXTENT_OVERLAP,
                    format!("second extent item {key} for the extent of {}", prev.key),
                )
                .root(EXTENT_TREE_OBJECTID)
                .bytenr(key.objectid)
                .key(key),
            );
            let _ = leaf;
            return;
        }
        self.st.extents.insert(key.objectid, rec);
    }

    /// Attach keyed backrefs to their extent items.
    fn merge_keyed(&mut self) {
        for (key, r) in std::mem::take(&mut self.keyed) {
            match self.st.extents.get_mut(&key.objectid) {
                Some(rec) => match r {
                    KeyedRef::Tree(t) => rec.tree_refs.push(t),
                    KeyedRef::Data(d, c) => rec.data_refs.push((d, c)),
                },
                None => self.sink.push(
                    Finding::new(
                        BACKREF_NO_EXTENT,
                        format!("{} item without an extent item", item_type_name(key.type_)),
                    )
                    .root(EXTENT_TREE_OBJECTID)
                    .bytenr(key.objectid)
                    .key(key),
                ),
            }
        }
    }
}

/// The free runs of a FREE_SPACE_BITMAP item covering `[start, start + len)`.
pub(super) fn bitmap_runs(start: u64, len: u64, sectorsize: u64, bits: &[u8]) -> Vec<(u64, u64)> {
    let nbits = (len / sectorsize).min(bits.len() as u64 * 8);
    let mut runs = Vec::new();
    let mut run_start: Option<u64> = None;
    for k in 0..nbits {
        let set = bits[(k / 8) as usize] & (1 << (k % 8)) != 0;
        let at = start.saturating_add(k * sectorsize);
        match (set, run_start) {
            (true, None) => run_start = Some(at),
            (false, Some(s)) => {
                runs.push((s, at));
                run_start = None;
            }
            _ => {}
        }
    }
    if let Some(s) = run_start {
        runs.push((s, start.saturating_add(nbits * sectorsize)));
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bitmap_decode() {
        // bits 0,1 set, 2 clear, 3..=9 set (LSB first).
        let bits = [0b1111_1011u8, 0b0000_0011];
        assert_eq!(bitmap_runs(1000, 16 * 10, 10, &bits), vec![(1000, 1020), (1030, 1100)]);
        assert_eq!(bitmap_runs(0, 40, 10, &[0x0f]), vec![(0, 40)]);
        assert_eq!(bitmap_runs(0, 40, 10, &[0]), vec![]);
    }
}
