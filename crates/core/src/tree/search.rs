//! B-tree reading: `search_slot`, `next_leaf`/`prev_leaf` and key-range iteration.
//!
//! Every child is read with the expectations its parent pointer implies (level one
//! less, pointer generation, first key, owner), so cycles and cross-links fail the tree
//! checker instead of looping. Iteration additionally requires strictly increasing keys
//! across leaves, which bounds it by the number of distinct keys.

use crate::disk_io::{Expect, ExtentBuffer, FsInfo};
use crate::error::{Error, Result};
use std::sync::Arc;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

/// Where a tree's root is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootInfo {
    pub id: u64,
    pub bytenr: u64,
    pub level: u8,
    pub generation: u64,
}

/// A root-to-leaf path; index = level.
#[derive(Clone, Default)]
pub struct Path {
    pub nodes: Vec<Option<Arc<ExtentBuffer>>>,
    pub slots: Vec<usize>,
}

impl Path {
    pub fn leaf(&self) -> &Arc<ExtentBuffer> {
        self.nodes[0].as_ref().expect("search_slot fills level 0")
    }
    pub fn slot(&self) -> usize {
        self.slots[0]
    }
    /// The item at the current slot, if the slot is inside the leaf.
    pub fn item(&self) -> Option<ItemRef> {
        let leaf = self.leaf();
        (self.slot() < leaf.node().nritems()).then(|| ItemRef { eb: leaf.clone(), slot: self.slot() })
    }
}

/// An item, keeping its leaf alive.
#[derive(Clone)]
pub struct ItemRef {
    pub eb: Arc<ExtentBuffer>,
    pub slot: usize,
}

impl ItemRef {
    pub fn key(&self) -> Key {
        self.eb.node().key(self.slot)
    }
    pub fn data(&self) -> &[u8] {
        self.eb.node().item_data(self.slot)
    }
}

impl FsInfo {
    fn read_child(&self, root: &RootInfo, parent: &ExtentBuffer, slot: usize) -> Result<Arc<ExtentBuffer>> {
        let n = parent.node();
        let expect = Expect { level: Some(n.level() - 1), generation: Some(n.ptr_generation(slot)), owner: Some(root.id), first_key: Some(n.key(slot)) };
        self.read_tree_block(n.blockptr(slot), &expect)
    }

    fn read_root_block(&self, root: &RootInfo) -> Result<Arc<ExtentBuffer>> {
        if root.level >= ubtrfs_format::structs::MAX_LEVEL {
            return Err(Corrupt::new(CorruptWhere::Block, format!("root level {} too big", root.level)).block(root.bytenr).root(root.id).into());
        }
        self.read_tree_block(root.bytenr, &Expect { level: Some(root.level), generation: Some(root.generation), owner: Some(root.id), first_key: None })
    }

    /// Search `root` for `key`. Returns the path and whether the key exists; on a miss
    /// the leaf slot is where the key would be inserted (possibly == nritems).
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    pub fn search_slot(&self, root: &RootInfo, key: &Key) -> Result<(Path, bool)> {
        let top = self.read_root_block(root)?;
        let levels = usize::from(top.node().level()) + 1;
        let mut path = Path { nodes: vec![None; levels], slots: vec![0; levels] };
        let mut cur = top;
        loop {
            let node = cur.node();
            let level = usize::from(node.level());
            let r = node.search(key);
            if level == 0 {
                let (slot, found) = match r {
                    Ok(s) => (s, true),
                    Err(s) => (s, false),
                };
                path.slots[0] = slot;
                path.nodes[0] = Some(cur);
                return Ok((path, found));
            }
            let slot = match r {
                Ok(s) => s,
                Err(s) => s.saturating_sub(1),
            };
            path.slots[level] = slot;
            let child = self.read_child(root, &cur, slot)?;
            path.nodes[level] = Some(cur);
            cur = child;
        }
    }

    /// Move `path` to the first item of the next leaf. Returns false at the end.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    pub fn next_leaf(&self, root: &RootInfo, path: &mut Path) -> Result<bool> {
        self.advance_leaf(root, path).map_err(|(e, _)| e)
    }

    /// `next_leaf`, telling on failure the level whose pointer at `path.slots[level]`
    /// named the block that could not be read, so an iterator can step over it.
    fn advance_leaf(&self, root: &RootInfo, path: &mut Path) -> std::result::Result<bool, (Error, usize)> {
        let levels = path.nodes.len();
        for level in 1..levels {
            let node = path.nodes[level].as_ref().expect("path filled to the root").clone();
            if path.slots[level] + 1 < node.node().nritems() {
                path.slots[level] += 1;
                let mut cur = node;
                let mut l = level;
                while l > 0 {
                    let child = self.read_child(root, &cur, path.slots[l]).map_err(|e| (e, l))?;
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

    /// Move `path` to the last item of the previous leaf. Returns false at the start.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    pub fn prev_leaf(&self, root: &RootInfo, path: &mut Path) -> Result<bool> {
        let levels = path.nodes.len();
        for level in 1..levels {
            if path.slots[level] > 0 {
                path.slots[level] -= 1;
                let mut cur = path.nodes[level].as_ref().expect("path filled to the root").clone();
                let mut l = level;
                while l > 0 {
                    let child = self.read_child(root, &cur, path.slots[l])?;
                    l -= 1;
                    let n = child.node().nritems();
                    path.slots[l] = if l == 0 { n.saturating_sub(1) } else { n - 1 };
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
    pub fn iter(&self, root: &RootInfo, start: Key) -> Result<TreeIter<'_>> {
        let (path, _) = self.search_slot(root, &start)?;
        Ok(TreeIter { fs: self, root: *root, path, last: None, done: false, failed_level: None })
    }

    /// The item with the greatest key <= `key`, if any.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading blocks.
    pub fn search_le(&self, root: &RootInfo, key: &Key) -> Result<Option<ItemRef>> {
        let (mut path, found) = self.search_slot(root, key)?;
        if found {
            return Ok(path.item());
        }
        if path.slot() > 0 {
            path.slots[0] -= 1;
            return Ok(path.item());
        }
        if self.prev_leaf(root, &mut path)? {
            return Ok(path.item());
        }
        Ok(None)
    }
}

/// Forward iteration over a tree.
pub struct TreeIter<'a> {
    fs: &'a FsInfo,
    root: RootInfo,
    path: Path,
    last: Option<Key>,
    done: bool,
    /// Set when moving to the next leaf failed: the level of the pointer (at
    /// `path.slots[level]`) to the block that could not be read.
    failed_level: Option<usize>,
}

impl TreeIter<'_> {
    /// The next item, or None at the end of the tree.
    ///
    /// # Errors
    /// `Io`/`Corrupt`, including keys that fail to increase across leaves.
    pub fn next_item(&mut self) -> Result<Option<ItemRef>> {
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
                        return Err(Corrupt::new(CorruptWhere::Leaf, format!("key order across leaves: {k} after {prev}")).block(item.eb.bytenr).root(self.root.id).into());
                    }
                }
                self.last = Some(k);
                return Ok(Some(item));
            }
            match self.fs.advance_leaf(&self.root, &mut self.path) {
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
        let from = self.path.nodes[level].as_ref().expect("path filled to the root").node().key(self.path.slots[level]);
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

impl Iterator for TreeIter<'_> {
    type Item = Result<ItemRef>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_item().transpose()
    }
}
