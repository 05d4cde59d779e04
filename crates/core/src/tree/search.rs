//! B-tree reading over a view: `search_slot`, `next_leaf`/`prev_leaf`, key-range
//! iteration and the lookups built on them (`first_item_ge`, `search_le`,
//! `items_in_range`). One implementation for every reader: a view is what the reads
//! see, either a committed generation (`FsInfo`, for check, extract, dump-tree) or
//! the running transaction (the writer's live view, which sees its own uncommitted
//! changes). A view only has to say how to read one block and where a tree's root is.
//!
//! Every child is read with the expectations its parent pointer implies (level one
//! less, pointer generation, first key, owner), so cycles and cross-links fail the tree
//! checker instead of looping. Iteration additionally requires strictly increasing keys
//! across leaves, which bounds it by the number of distinct keys.

use crate::error::{Error, PosixKind, Result};
use crate::tree::extent_buffer::{Expect, ExtentBuffer};
use std::sync::Arc;
use ubtrfs_format::key::{
    CHUNK_TREE_OBJECTID, DIR_ITEM_KEY, FS_TREE_OBJECTID, ROOT_ITEM_KEY, ROOT_TREE_DIR_OBJECTID,
    ROOT_TREE_OBJECTID,
};
use ubtrfs_format::structs::RootItem;
use ubtrfs_format::{items, Corrupt, CorruptWhere, Key, NodeRef};

/// Where a tree's root is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootInfo {
    pub id: u64,
    pub bytenr: u64,
    pub level: u8,
    pub generation: u64,
}

/// A validated tree block as a view hands it out: it stays readable (and unchanged)
/// for as long as the handle lives.
pub trait NodeHandle: Clone {
    fn node(&self) -> NodeRef<'_>;
    fn bytenr(&self) -> u64;
}

impl NodeHandle for Arc<ExtentBuffer> {
    fn node(&self) -> NodeRef<'_> {
        ExtentBuffer::node(self)
    }
    fn bytenr(&self) -> u64 {
        self.bytenr
    }
}

/// A root-to-leaf path; index = level. Readers hold node handles (`N`); the COW path
/// of the write engine holds its own block references (`tree::modify`).
#[derive(Clone)]
pub struct Path<N = Arc<ExtentBuffer>> {
    pub nodes: Vec<Option<N>>,
    pub slots: Vec<usize>,
}

impl<N> Path<N> {
    pub(crate) fn with_levels(levels: usize) -> Path<N> {
        Path { nodes: (0..levels).map(|_| None).collect(), slots: vec![0; levels] }
    }
    pub fn slot(&self) -> usize {
        self.slots[0]
    }
    pub fn levels(&self) -> usize {
        self.nodes.len()
    }
}

impl<N: NodeHandle> Path<N> {
    pub fn leaf(&self) -> &N {
        self.nodes[0].as_ref().expect("search_slot fills level 0")
    }
    /// The item at the current slot, if the slot is inside the leaf.
    pub fn item(&self) -> Option<ItemRef<N>> {
        let leaf = self.leaf();
        (self.slot() < leaf.node().nritems())
            .then(|| ItemRef { eb: leaf.clone(), slot: self.slot() })
    }
}

/// What `search_slot` found: the path to the key's item, or the path to the slot where
/// the key would be inserted (possibly == nritems). `P` is the path type of the search
/// (`Path` for a view, `WPath` for the COW search of the write engine).
#[derive(Clone)]
pub enum Search<P> {
    /// The key exists; the leaf slot holds its item.
    Found(P),
    /// The key does not exist; the leaf slot is where it would be inserted.
    NotFound(P),
}

impl<P> Search<P> {
    /// Whether the key exists.
    pub fn found(&self) -> bool {
        matches!(self, Search::Found(_))
    }

    /// The path, wherever it points.
    pub fn into_path(self) -> P {
        match self {
            Search::Found(p) | Search::NotFound(p) => p,
        }
    }

    /// The path to the key's item, if the key exists.
    pub fn into_found(self) -> Option<P> {
        match self {
            Search::Found(p) => Some(p),
            Search::NotFound(_) => None,
        }
    }
}

/// An item, keeping its leaf alive.
#[derive(Clone)]
pub struct ItemRef<N = Arc<ExtentBuffer>> {
    pub eb: N,
    pub slot: usize,
}

impl<N: NodeHandle> ItemRef<N> {
    pub fn key(&self) -> Key {
        self.eb.node().key(self.slot)
    }
    pub fn data(&self) -> &[u8] {
        self.eb.node().item_data(self.slot)
    }
}

/// What a read sees. Implementors give block reads and tree roots; the searches are
/// provided, identical for every view.
pub trait TreeView {
    type Node: NodeHandle;

    /// Read and validate the block at `bytenr` as this view sees it.
    ///
    /// # Errors
    /// `Io`/`Corrupt`.
    fn read_node(&self, bytenr: u64, expect: &Expect) -> Result<Self::Node>;

    /// The root tree's root in this view.
    fn tree_root(&self) -> RootInfo;

    /// The chunk tree's root in this view.
    fn chunk_root(&self) -> RootInfo;

    /// Where tree `id` is rooted in this view, and its ROOT_ITEM (zeroed for the root
    /// and chunk trees, which the superblock holds). The default reads the root tree.
    ///
    /// # Errors
    /// `Posix(NotFound)` if there is no such tree; `Corrupt`/`Io` from the search.
    fn read_root(&self, id: u64) -> Result<(RootInfo, RootItem)> {
        root_from_root_tree(self, id)
    }

    /// Search `root` for `key`: `Found` with the path to its item, or `NotFound` with the
    /// path to the leaf slot where it would be inserted (possibly == nritems).
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    fn search_slot(&self, root: &RootInfo, key: &Key) -> Result<Search<Path<Self::Node>>> {
        if root.level >= ubtrfs_format::structs::MAX_LEVEL {
            return Err(Corrupt::new(
                CorruptWhere::Block,
                format!("root level {} too big", root.level),
            )
            .block(root.bytenr)
            .root(root.id)
            .into());
        }
        let top = self.read_node(
            root.bytenr,
            &Expect {
                level: Some(root.level),
                generation: Some(root.generation),
                owner: Some(root.id),
                first_key: None,
            },
        )?;
        let levels = usize::from(top.node().level()) + 1;
        let mut path = Path::with_levels(levels);
        let mut cur = top;
        loop {
            let (level, r) = {
                let node = cur.node();
                (usize::from(node.level()), node.search(key))
            };
            if level == 0 {
                path.nodes[0] = Some(cur);
                return Ok(match r {
                    Ok(slot) => {
                        path.slots[0] = slot;
                        Search::Found(path)
                    }
                    Err(slot) => {
                        path.slots[0] = slot;
                        Search::NotFound(path)
                    }
                });
            }
            let slot = match r {
                Ok(s) => s,
                Err(s) => s.saturating_sub(1),
            };
            path.slots[level] = slot;
            let child = read_child(self, root, &cur, slot)?;
            path.nodes[level] = Some(cur);
            cur = child;
        }
    }

    /// Move `path` to the first item of the next leaf. Returns false at the end.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    fn next_leaf(&self, root: &RootInfo, path: &mut Path<Self::Node>) -> Result<bool> {
        advance_leaf(self, root, path).map_err(|(e, _)| e)
    }

    /// Move `path` to the last item of the previous leaf. Returns false at the start.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    fn prev_leaf(&self, root: &RootInfo, path: &mut Path<Self::Node>) -> Result<bool> {
        let levels = path.nodes.len();
        for level in 1..levels {
            if path.slots[level] > 0 {
                path.slots[level] -= 1;
                let mut cur = path.nodes[level].as_ref().expect("path filled to the root").clone();
                let mut l = level;
                while l > 0 {
                    let child = read_child(self, root, &cur, path.slots[l])?;
                    l -= 1;
                    let n = child.node().nritems();
                    path.slots[l] = n.saturating_sub(1);
                    path.nodes[l] = Some(child.clone());
                    cur = child;
                }
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Iterate items with key >= `start`, in order.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from the initial search.
    fn iter(&self, root: &RootInfo, start: Key) -> Result<TreeIter<'_, Self>>
    where
        Self: Sized,
    {
        let path = self.search_slot(root, &start)?.into_path();
        Ok(TreeIter { view: self, root: *root, path, last: None, done: false, failed_level: None })
    }

    /// The item with the greatest key <= `key`, if any.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    fn search_le(&self, root: &RootInfo, key: &Key) -> Result<Option<ItemRef<Self::Node>>> {
        let mut path = match self.search_slot(root, key)? {
            Search::Found(path) => return Ok(path.item()),
            Search::NotFound(path) => path,
        };
        if path.slot() > 0 {
            path.slots[0] -= 1;
            return Ok(path.item());
        }
        if self.prev_leaf(root, &mut path)? {
            return Ok(path.item());
        }
        Ok(None)
    }

    /// The item with the smallest key >= `key`, if any.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    fn first_item_ge(&self, root: &RootInfo, key: &Key) -> Result<Option<ItemRef<Self::Node>>> {
        let mut path = self.search_slot(root, key)?.into_path();
        loop {
            if let Some(item) = path.item() {
                return Ok(Some(item));
            }
            if !self.next_leaf(root, &mut path)? {
                return Ok(None);
            }
        }
    }

    /// Every item with `from <= key <= to`, in order.
    ///
    /// # Errors
    /// `Io`/`Corrupt`, including keys that fail to increase across leaves.
    fn items_in_range(
        &self,
        root: &RootInfo,
        from: &Key,
        to: &Key,
    ) -> Result<Vec<ItemRef<Self::Node>>>
    where
        Self: Sized,
    {
        let mut out = Vec::new();
        let mut it = self.iter(root, *from)?;
        while let Some(item) = it.next_item()? {
            if item.key() > *to {
                break;
            }
            out.push(item);
        }
        Ok(out)
    }
}

/// `TreeView::read_root` as the root tree of `v` says it.
///
/// # Errors
/// As `TreeView::read_root`.
pub fn root_from_root_tree<V: TreeView + ?Sized>(v: &V, id: u64) -> Result<(RootInfo, RootItem)> {
    use zerocopy::FromZeros;
    if id == ROOT_TREE_OBJECTID {
        return Ok((v.tree_root(), RootItem::new_zeroed()));
    }
    if id == CHUNK_TREE_OBJECTID {
        return Ok((v.chunk_root(), RootItem::new_zeroed()));
    }
    match v.first_item_ge(&v.tree_root(), &Key::new(id, ROOT_ITEM_KEY, 0))? {
        Some(item) if item.key().objectid == id && item.key().type_ == ROOT_ITEM_KEY => {
            let bad = |e: String| {
                Error::from(
                    Corrupt::new(CorruptWhere::Item, e)
                        .root(ROOT_TREE_OBJECTID)
                        .block(item.eb.bytenr())
                        .slot(item.slot as u32, item.key()),
                )
            };
            let r = items::root_item(item.data()).map_err(bad)?.item;
            Ok((
                RootInfo {
                    id,
                    bytenr: r.bytenr.get(),
                    level: r.level,
                    generation: r.generation.get(),
                },
                r,
            ))
        }
        _ => Err(Error::posix(PosixKind::NotFound, format!("tree {id}"))),
    }
}

fn read_child<V: TreeView + ?Sized>(
    v: &V,
    root: &RootInfo,
    parent: &V::Node,
    slot: usize,
) -> Result<V::Node> {
    let n = parent.node();
    let expect = Expect {
        level: Some(n.level() - 1),
        generation: Some(n.ptr_generation(slot)),
        owner: Some(root.id),
        first_key: Some(n.key(slot)),
    };
    v.read_node(n.blockptr(slot), &expect)
}

/// `next_leaf`, telling on failure the level whose pointer at `path.slots[level]`
/// named the block that could not be read, so an iterator can step over it.
fn advance_leaf<V: TreeView + ?Sized>(
    v: &V,
    root: &RootInfo,
    path: &mut Path<V::Node>,
) -> std::result::Result<bool, (Error, usize)> {
    let levels = path.nodes.len();
    for level in 1..levels {
        let node = path.nodes[level].as_ref().expect("path filled to the root").clone();
        if path.slots[level] + 1 < node.node().nritems() {
            path.slots[level] += 1;
            let mut cur = node;
            let mut l = level;
            while l > 0 {
                let child = read_child(v, root, &cur, path.slots[l]).map_err(|e| (e, l))?;
                l -= 1;
                path.slots[l] = 0;
                path.nodes[l] = Some(child.clone());
                cur = child;
            }
            return Ok(true);
        }
    }
    Ok(false)
}

/// Forward iteration over a tree.
pub struct TreeIter<'a, V: TreeView> {
    view: &'a V,
    root: RootInfo,
    path: Path<V::Node>,
    last: Option<Key>,
    done: bool,
    /// Set when moving to the next leaf failed: the level of the pointer (at
    /// `path.slots[level]`) to the block that could not be read.
    failed_level: Option<usize>,
}

impl<V: TreeView> TreeIter<'_, V> {
    /// The next item, or None at the end of the tree.
    ///
    /// # Errors
    /// `Io`/`Corrupt`, including keys that fail to increase across leaves.
    pub fn next_item(&mut self) -> Result<Option<ItemRef<V::Node>>> {
        if self.done {
            return Ok(None);
        }
        loop {
            if let Some(item) = self.path.item() {
                self.path.slots[0] += 1;
                let k = item.key();
                if let Some(prev) = self.last {
                    if k <= prev {
                        self.done = true;
                        return Err(Corrupt::new(
                            CorruptWhere::Leaf,
                            format!("key order across leaves: {k} after {prev}"),
                        )
                        .block(item.eb.bytenr())
                        .root(self.root.id)
                        .into());
                    }
                }
                self.last = Some(k);
                return Ok(Some(item));
            }
            match advance_leaf(self.view, &self.root, &mut self.path) {
                Ok(true) => {}
                Ok(false) => {
                    self.done = true;
                    return Ok(None);
                }
                Err((e, level)) => {
                    self.failed_level = Some(level);
                    return Err(e);
                }
            }
        }
    }

    /// After `next_item` failed to read a tree block, step over that block (and the
    /// subtree under it) so iteration goes on with the items after it. Returns the first
    /// key the skipped block covers; the items lost are those from it up to the next
    /// item returned. None if the failure was not an unreadable block (then the
    /// iterator stays failed: a key-order error means the tree cannot be trusted).
    pub fn skip_unreadable(&mut self) -> Option<Key> {
        let level = self.failed_level.take()?;
        let from = self.path.nodes[level]
            .as_ref()
            .expect("path filled to the root")
            .node()
            .key(self.path.slots[level]);
        // Mark every level below as used up, so the next advance resumes at the pointer
        // after the bad one. The nodes below are still the previous leaf's path (or the
        // fresh nodes read on the way down); either way none of their slots is wanted.
        for l in 1..level {
            let n = self.path.nodes[l].as_ref().expect("path filled to the root").node().nritems();
            self.path.slots[l] = n.saturating_sub(1);
        }
        let leaf_items = self.path.leaf().node().nritems();
        self.path.slots[0] = leaf_items;
        Some(from)
    }
}

impl<V: TreeView> Iterator for TreeIter<'_, V> {
    type Item = Result<ItemRef<V::Node>>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_item().transpose()
    }
}

/// The default subvolume as view `fs` sees it: the root tree's "default" dir item, else 5.
///
/// # Errors
/// Read failures.
pub fn find_default_subvol<V: TreeView>(fs: &V) -> Result<u64> {
    let root = fs.tree_root();
    let key =
        Key::new(ROOT_TREE_DIR_OBJECTID, DIR_ITEM_KEY, ubtrfs_format::hash::name_hash(b"default"));
    if let Search::Found(path) = fs.search_slot(&root, &key)? {
        let item = path.item().expect("found slot is in the leaf");
        for e in items::dir_entries(item.data()) {
            let e = e.expect("validated by the tree checker");
            if e.name == b"default" && e.location.type_ == ROOT_ITEM_KEY {
                return Ok(e.location.objectid);
            }
        }
    }
    Ok(FS_TREE_OBJECTID)
}
