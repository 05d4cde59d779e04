//! Dropping a deleted subvolume's tree, step by step across transactions (the kernel's
//! `btrfs_drop_snapshot`, which its cleaner thread runs for every dead root).
//!
//! A deleted subvolume keeps its ROOT_ITEM (refs 0) and an ORPHAN_ITEM in the root
//! tree (key `ORPHAN -5, ORPHAN_ITEM, id`) until its tree is gone. The walk goes
//! depth first, left to right, and gives each block what the kernel gives it:
//! - a block this tree alone references (refs 1) is walked into; a leaf drops the
//!   references its file extents hold, then every such block is freed on the way up;
//! - a block shared with another tree (refs > 1) loses only this tree's reference
//!   (keyed by this tree, or naming the parent when the parent is FULL_BACKREF) and is
//!   not read at all;
//! - but a shared block this tree owns, newer than the tree's origin and not
//!   FULL_BACKREF, is first walked in the UPDATE_BACKREF stage: it and the blocks
//!   below it that this tree owns turn FULL_BACKREF (their children gain references
//!   naming them, and lose this tree's keyed ones), because this tree is going away
//!   and a keyed reference must name a tree that holds the block.
//!
//! Progress is the kernel's: after each step, the ROOT_ITEM's `drop_progress` is the
//! first key of the next child to walk at level `drop_level`, and every block left of
//! it at that level and below is done; the blocks on the path above are still
//! referenced, and go when the walk comes back up past them. A step saves its
//! progress only in the DROP_REFERENCE stage, so the progress and the references it
//! dropped land in the same commit: a crash resumes exactly where the last commit
//! stopped. The kernel resumes a drop we started and we resume one the kernel started
//! (for the kernel's, the first child of a resumed walk is checked to still hold this
//! tree's reference, as the kernel's `check_ref_exists` does: the kernel may commit
//! work of the UPDATE_BACKREF stage past its saved progress). When the walk comes back
//! above the root, the ROOT_ITEM and the ORPHAN_ITEM go.

use crate::error::{Error, PosixKind, Result};
use crate::extent::delayed_ref::RefKind;
use crate::transaction::{Blk, Transaction};
use crate::tree::extent_buffer::Expect;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::BLOCK_FLAG_FULL_BACKREF;
use ubtrfs_format::{items, Corrupt, CorruptWhere, Key};

/// Tree levels (`BTRFS_MAX_LEVEL`).
const MAX_LEVEL: usize = 8;

/// Items one drop step reserves: it changes only the extent tree (through delayed
/// refs, run in batches) and the dead tree's ROOT_ITEM.
const DROP_STEP_ITEMS: u64 = 8;

/// Work units (blocks read, references dropped) a step does by default before it
/// saves its progress.
pub const DROP_STEP_BUDGET: u32 = 1024;

/// The ORPHAN_ITEM key that marks tree `id` as deleted (`btrfs_insert_orphan_item`
/// in the root tree).
pub fn dead_root_key(id: u64) -> Key {
    Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, id)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    DropReference,
    UpdateBackref,
}

/// What a step did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DropStats {
    /// Tree blocks read.
    pub blocks_read: u64,
    /// References to tree blocks dropped (blocks freed or left to their other trees).
    pub tree_refs_dropped: u64,
    /// Leaves whose data references were dropped.
    pub leaves_emptied: u64,
    /// Shared blocks turned FULL_BACKREF.
    pub blocks_converted: u64,
    /// The tree is gone (its ROOT_ITEM and ORPHAN_ITEM deleted).
    pub done: bool,
}

impl DropStats {
    pub fn add(&mut self, o: &DropStats) {
        self.blocks_read += o.blocks_read;
        self.tree_refs_dropped += o.tree_refs_dropped;
        self.leaves_emptied += o.leaves_emptied;
        self.blocks_converted += o.blocks_converted;
        self.done = o.done;
    }
}

/// The walk's state (the kernel's `walk_control` with its path).
struct Walk {
    id: u64,
    /// The transaction the tree was made in (its ROOT_ITEM key offset): a block no
    /// newer cannot be this tree's own.
    origin: u64,
    top: usize,
    nodes: [Option<Blk>; MAX_LEVEL],
    slots: [usize; MAX_LEVEL],
    /// References and extent flags of `nodes[l]`, 0 while not looked up.
    refs: [u64; MAX_LEVEL],
    flags: [u64; MAX_LEVEL],
    level: usize,
    stage: Stage,
    shared_level: usize,
    /// Resumed from a saved progress: the first child met is checked to still hold
    /// this tree's reference.
    restarted: bool,
    stats: DropStats,
}

/// What the walk does with the child at the current slot.
enum Down {
    Descend,
    Skip,
}

fn corrupt(id: u64, bytenr: u64, why: String) -> Error {
    Corrupt::new(CorruptWhere::Block, why).root(id).block(bytenr).into()
}

impl Transaction {
    /// The deleted subvolumes whose trees are still to drop (the kernel's
    /// `btrfs_find_orphan_roots`): each ORPHAN_ITEM of the root tree naming a tree
    /// whose ROOT_ITEM has refs 0, in id order. An ORPHAN_ITEM naming no tree (the
    /// drop finished, the orphan item's deletion did not) is skipped; the next drop
    /// step of that id removes it.
    ///
    /// # Errors
    /// Read failures in the root tree.
    pub fn dead_roots(&mut self) -> Result<Vec<u64>> {
        let orphans =
            self.items_in_range(ROOT_TREE_OBJECTID, &dead_root_key(0), &dead_root_key(u64::MAX))?;
        let mut out = Vec::new();
        for (k, _) in orphans {
            match self.root(k.offset) {
                Ok(_) => {}
                Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => continue,
                Err(e) => return Err(e),
            }
            if self.roots.get(&k.offset).and_then(|s| s.item).is_some_and(|i| i.refs.get() == 0) {
                out.push(k.offset);
            }
        }
        Ok(out)
    }

    /// Drop part of deleted subvolume `id`'s tree: at most about `budget` blocks read
    /// and references dropped, in one transaction handle, then the progress saved in
    /// its ROOT_ITEM (committed with the references). Returns what the step did;
    /// `done` once the tree, its ROOT_ITEM and its ORPHAN_ITEM are gone.
    ///
    /// # Errors
    /// `Posix(Invalid)` for a tree that is not a deleted subvolume; `Posix(Busy)` for
    /// one whose tree changed in the running transaction (commit first: the walk frees
    /// committed blocks only); `Corrupt` when the extent tree disagrees with the tree
    /// (a block with no references, an unexpected owner), which aborts; read failures.
    pub fn drop_subvol_step(&mut self, id: u64, budget: u32) -> Result<DropStats> {
        self.check_writable()?;
        if !is_subvolume_tree(id) || id == FS_TREE_OBJECTID {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("tree {id}"),
                "only deleted subvolumes are dropped",
            ));
        }
        let info = match self.root(id) {
            Ok(i) => i,
            // Dropped already: at most a stale ORPHAN_ITEM is left.
            Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => {
                if self
                    .items_in_range(ROOT_TREE_OBJECTID, &dead_root_key(id), &dead_root_key(id))?
                    .is_empty()
                {
                    return Err(Error::posix_detail(
                        PosixKind::Invalid,
                        format!("subvolume {id}"),
                        "no such subvolume, and no deletion pending",
                    ));
                }
                return self.transaction("drop_snapshot", DROP_STEP_ITEMS, |w| {
                    w.delete_item(ROOT_TREE_OBJECTID, &dead_root_key(id))?;
                    Ok(DropStats { done: true, ..DropStats::default() })
                });
            }
            Err(e) => return Err(e),
        };
        if self.quotas {
            // A step drops references to shared subtrees without touching what is below
            // them, whose extents are then reached by one tree less although their own
            // references did not change: the commit recounts (the kernel traces those
            // subtrees instead).
            self.qgroup.needs_rescan("a deleted subvolume's tree is being dropped");
        }
        let st = self.roots.get(&id).expect("loaded above");
        let item = st.item.expect("a subvolume has its ROOT_ITEM");
        let origin = st.item_offset;
        if item.refs.get() != 0 {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("subvolume {id}"),
                "it is not deleted",
            ));
        }
        if info.generation >= self.transid {
            return Err(Error::posix_detail(
                PosixKind::Busy,
                format!("subvolume {id}"),
                "its tree changed in the running transaction; commit before dropping it",
            ));
        }
        self.transaction("drop_snapshot", DROP_STEP_ITEMS, |w| {
            w.drop_step_inner(id, origin, budget.max(1))
        })
    }

    fn drop_step_inner(&mut self, id: u64, origin: u64, budget: u32) -> Result<DropStats> {
        let info = self.root(id)?;
        let item = self.roots.get(&id).and_then(|s| s.item).expect("checked by drop_subvol_step");
        let top = usize::from(info.level);
        if top >= MAX_LEVEL {
            return Err(corrupt(
                id,
                info.bytenr,
                format!("root level {top} is past the deepest level {}", MAX_LEVEL - 1),
            ));
        }
        let mut wc = Walk {
            id,
            origin,
            top,
            nodes: Default::default(),
            slots: [0; MAX_LEVEL],
            refs: [0; MAX_LEVEL],
            flags: [0; MAX_LEVEL],
            level: top,
            stage: Stage::DropReference,
            shared_level: 0,
            restarted: false,
            stats: DropStats::default(),
        };
        let root = self.read_block(
            info.bytenr,
            &Expect {
                level: Some(info.level),
                generation: Some(info.generation),
                owner: Some(id),
                first_key: None,
            },
        )?;
        wc.stats.blocks_read += 1;
        let progress = Key::from(&item.drop_progress);
        if progress.objectid == 0 {
            wc.nodes[top] = Some(root);
        } else {
            // Back down to the saved point: the blocks above it are still ours.
            let dl = usize::from(item.drop_level);
            if dl == 0 || dl > top {
                return Err(corrupt(
                    id,
                    info.bytenr,
                    format!("drop level {dl} is outside the tree's levels 1..={top}"),
                ));
            }
            let mut b = root;
            let mut l = top;
            loop {
                let slot = match self.node(&b).search(&progress) {
                    Ok(s) => s,
                    Err(s) => s.saturating_sub(1),
                };
                let (refs, flags) = self.lookup_tree_block_info(b.bytenr(), l as u8)?;
                wc.nodes[l] = Some(b.clone());
                wc.slots[l] = slot;
                wc.refs[l] = refs;
                wc.flags[l] = flags;
                if l == dl {
                    break;
                }
                if refs != 1 {
                    return Err(corrupt(
                        id,
                        b.bytenr(),
                        format!(
                            "block at level {l} above the drop point has {refs} references, not 1"
                        ),
                    ));
                }
                let child = self.read_child(&b, slot, id)?;
                wc.stats.blocks_read += 1;
                b = child;
                l -= 1;
            }
            wc.level = dl;
            wc.restarted = true;
        }
        loop {
            self.drop_walk_down(&mut wc)?;
            if self.drop_walk_up(&mut wc)? {
                break;
            }
            let spent = wc.stats.blocks_read + wc.stats.tree_refs_dropped;
            // (Level 0 only when a shared leaf became ours alone: walked next.)
            if wc.stage == Stage::DropReference && spent >= u64::from(budget) && wc.level > 0 {
                let l = wc.level;
                let n = wc.nodes[l].as_ref().expect("the path holds the level it stopped at");
                let key = self.node(n).key(wc.slots[l]);
                let st = self.roots.get_mut(&id).expect("loaded");
                let it = st.item.as_mut().expect("a subvolume has its ROOT_ITEM");
                it.drop_progress = key.to_disk();
                it.drop_level = l as u8;
                st.dirty = true;
                return Ok(wc.stats);
            }
        }
        // The whole tree is done: its ROOT_ITEM and ORPHAN_ITEM go.
        let off = self.roots.get(&id).map_or(0, |s| s.item_offset);
        if !self.delete_item(ROOT_TREE_OBJECTID, &Key::new(id, ROOT_ITEM_KEY, off))? {
            return Err(Corrupt::new(
                CorruptWhere::Item,
                format!("root item of dropped subvolume {id} vanished"),
            )
            .root(ROOT_TREE_OBJECTID)
            .into());
        }
        self.delete_item(ROOT_TREE_OBJECTID, &dead_root_key(id))?;
        self.roots.remove(&id);
        wc.stats.done = true;
        Ok(wc.stats)
    }

    /// Whether tree block `bytenr` still holds reference `kind` (committed, with this
    /// transaction's pending changes).
    fn tree_ref_exists(&mut self, bytenr: u64, level: u8, kind: RefKind) -> Result<bool> {
        let pending =
            self.delayed.head_of(bytenr).and_then(|h| h.refs.get(&kind).copied()).unwrap_or(0);
        let key = Key::new(bytenr, METADATA_ITEM_KEY, u64::from(level));
        let (inline, keyed) = match kind {
            RefKind::TreeBlock { root } => {
                (items::InlineRef::TreeBlock { root }, Key::new(bytenr, TREE_BLOCK_REF_KEY, root))
            }
            RefKind::SharedBlock { parent } => (
                items::InlineRef::SharedBlock { parent },
                Key::new(bytenr, SHARED_BLOCK_REF_KEY, parent),
            ),
            _ => unreachable!("tree block references only"),
        };
        let mut have = 0i64;
        let found = self.items_in_range(EXTENT_TREE_OBJECTID, &key, &key)?;
        if let Some((_, d)) = found.first() {
            let v = items::extent_item(d, true)
                .map_err(|e| Corrupt::new(CorruptWhere::Item, e).root(EXTENT_TREE_OBJECTID))?;
            have += i64::from(v.inline_refs.contains(&inline));
        }
        have += self.items_in_range(EXTENT_TREE_OBJECTID, &keyed, &keyed)?.len() as i64;
        Ok(have + pending > 0)
    }

    /// The reference the walk holds on the block at `level` of its path, or (with
    /// `child_bytenr`) on a child of the block there: named by the parent when the
    /// parent is FULL_BACKREF, else keyed by this tree, which must own the parent.
    fn drop_ref_kind(&self, wc: &Walk, parent_level: usize) -> Result<RefKind> {
        let p = wc.nodes[parent_level].as_ref().expect("parent on the path");
        if wc.flags[parent_level] & BLOCK_FLAG_FULL_BACKREF != 0 {
            return Ok(RefKind::SharedBlock { parent: p.bytenr() });
        }
        let owner = self.node(p).owner();
        if owner != wc.id {
            return Err(corrupt(wc.id, p.bytenr(), format!("unexpected tree owner {owner} of a block referenced by tree {} without FULL_BACKREF", wc.id)));
        }
        Ok(RefKind::TreeBlock { root: wc.id })
    }

    /// The kernel's `walk_down_tree`: go down from `wc.level` through blocks only this
    /// tree references, dropping its references to the shared children it passes.
    fn drop_walk_down(&mut self, wc: &mut Walk) -> Result<()> {
        loop {
            let level = wc.level;
            if !self.drop_down_proc(wc, level)? {
                return Ok(());
            }
            if level == 0 {
                return Ok(());
            }
            let nritems = self.node(wc.nodes[level].as_ref().expect("on the path")).nritems();
            if wc.slots[level] >= nritems {
                return Ok(());
            }
            match self.drop_down_child(wc, level)? {
                Down::Skip => wc.slots[level] += 1,
                Down::Descend => {}
            }
        }
    }

    /// The kernel's `walk_down_proc` for the block at `level`: false stops the descent.
    fn drop_down_proc(&mut self, wc: &mut Walk, level: usize) -> Result<bool> {
        let b = wc.nodes[level].clone().expect("on the path");
        let (bytenr, owner) = {
            let n = self.node(&b);
            (n.bytenr(), n.owner())
        };
        if wc.stage == Stage::UpdateBackref && owner != wc.id {
            return Ok(false);
        }
        let full = wc.flags[level] & BLOCK_FLAG_FULL_BACKREF != 0;
        if (wc.stage == Stage::DropReference && wc.refs[level] != 1)
            || (wc.stage == Stage::UpdateBackref && !full)
        {
            let (refs, flags) = self.lookup_tree_block_info(bytenr, level as u8)?;
            if refs == 0 {
                return Err(corrupt(
                    wc.id,
                    bytenr,
                    format!("tree block at level {level} has no references"),
                ));
            }
            wc.refs[level] = refs;
            wc.flags[level] = flags;
        }
        if wc.stage == Stage::DropReference {
            return Ok(wc.refs[level] == 1);
        }
        // UPDATE_BACKREF: this tree's block, shared; its children's references name
        // it from now on.
        if wc.flags[level] & BLOCK_FLAG_FULL_BACKREF == 0 {
            self.mod_refs(&b, wc.id, true, 1)?;
            self.mod_refs(&b, wc.id, false, -1)?;
            let ns = u64::from(self.nodesize());
            self.delayed.set_tree_block_flags(
                bytenr,
                ns,
                level as u8,
                wc.id,
                BLOCK_FLAG_FULL_BACKREF,
            )?;
            wc.flags[level] |= BLOCK_FLAG_FULL_BACKREF;
            wc.stats.blocks_converted += 1;
        }
        Ok(true)
    }

    /// The kernel's `do_walk_down` for the child at `wc.slots[level]`: descend into it,
    /// or skip it (dropping this tree's reference in the DROP_REFERENCE stage).
    fn drop_down_child(&mut self, wc: &mut Walk, level: usize) -> Result<Down> {
        let (bytenr, generation) = {
            let n = self.node(wc.nodes[level].as_ref().expect("on the path"));
            (n.blockptr(wc.slots[level]), n.ptr_generation(wc.slots[level]))
        };
        let cl = level - 1;
        // Older than this tree: not its own, nothing to update below.
        if wc.stage == Stage::UpdateBackref && generation <= wc.origin {
            return Ok(Down::Skip);
        }
        let (refs, flags) = self.lookup_tree_block_info(bytenr, cl as u8)?;
        if refs == 0 {
            return Err(corrupt(
                wc.id,
                bytenr,
                format!("tree block at level {cl} has no references"),
            ));
        }
        if wc.restarted {
            // Resumed: the kernel may have dropped this reference in work committed
            // past its saved progress.
            let kind = self.drop_ref_kind(wc, level)?;
            if !self.tree_ref_exists(bytenr, cl as u8, kind)? {
                return Ok(Down::Skip);
            }
            wc.restarted = false;
        }
        let mut skip = false;
        if wc.stage == Stage::DropReference {
            if refs > 1 {
                if (cl == 0 && flags & BLOCK_FLAG_FULL_BACKREF != 0) || generation <= wc.origin {
                    skip = true;
                } else {
                    wc.stage = Stage::UpdateBackref;
                    wc.shared_level = cl;
                }
            }
        } else if cl == 0 && flags & BLOCK_FLAG_FULL_BACKREF != 0 {
            skip = true;
        }
        if skip {
            if wc.stage == Stage::DropReference {
                let kind = self.drop_ref_kind(wc, level)?;
                self.drop_tree_ref(bytenr, cl as u8, kind)?;
                wc.stats.tree_refs_dropped += 1;
            }
            return Ok(Down::Skip);
        }
        let child = self.read_child(
            wc.nodes[level].as_ref().expect("on the path"),
            wc.slots[level],
            wc.id,
        )?;
        wc.stats.blocks_read += 1;
        wc.nodes[cl] = Some(child);
        wc.slots[cl] = 0;
        wc.refs[cl] = refs;
        wc.flags[cl] = flags;
        wc.level = cl;
        Ok(Down::Descend)
    }

    /// The kernel's `walk_up_tree`: from `wc.level`, move to the next slot of the
    /// lowest block that has one (false: go down again), freeing on the way each block
    /// whose slots are all done. True once the walk has left the root.
    fn drop_walk_up(&mut self, wc: &mut Walk) -> Result<bool> {
        let mut level = wc.level;
        let n = self.node(wc.nodes[level].as_ref().expect("on the path")).nritems();
        wc.slots[level] = n;
        while level <= wc.top && wc.nodes[level].is_some() {
            wc.level = level;
            let nritems = self.node(wc.nodes[level].as_ref().expect("checked")).nritems();
            if wc.slots[level] + 1 < nritems {
                wc.slots[level] += 1;
                return Ok(false);
            }
            if !self.drop_up_proc(wc, level)? {
                return Ok(false);
            }
            wc.nodes[level] = None;
            level += 1;
        }
        Ok(true)
    }

    /// The kernel's `walk_up_proc` for the block at `level`, all its slots done:
    /// leave the UPDATE_BACKREF stage at the shared block that began it, then (in
    /// DROP_REFERENCE) drop this tree's reference to the block, its leaf's data
    /// references first when it was this tree's alone. False: walk down again from
    /// this block (its references changed under the walk).
    fn drop_up_proc(&mut self, wc: &mut Walk, level: usize) -> Result<bool> {
        let b = wc.nodes[level].clone().expect("on the path");
        if wc.stage == Stage::UpdateBackref {
            if level < wc.shared_level {
                wc.refs[level] = 0;
                wc.flags[level] = 0;
                return Ok(true);
            }
            assert_eq!(level, wc.shared_level, "the UPDATE_BACKREF stage ends at its shared block");
            wc.stage = Stage::DropReference;
            wc.shared_level = 0;
            let (refs, flags) = self.lookup_tree_block_info(b.bytenr(), level as u8)?;
            wc.refs[level] = refs;
            wc.flags[level] = flags;
            if refs == 1 {
                // Ours alone now: walk it as such.
                wc.slots[level] = 0;
                return Ok(false);
            }
        }
        if wc.refs[level] == 1 && level == 0 {
            let owner = self.node(&b).owner();
            let full = wc.flags[0] & BLOCK_FLAG_FULL_BACKREF != 0;
            self.mod_refs(&b, owner, full, -1)?;
            wc.stats.leaves_emptied += 1;
        }
        let kind = if level == wc.top {
            if wc.flags[level] & BLOCK_FLAG_FULL_BACKREF != 0 {
                RefKind::SharedBlock { parent: b.bytenr() }
            } else {
                let owner = self.node(&b).owner();
                if owner != wc.id {
                    return Err(corrupt(
                        wc.id,
                        b.bytenr(),
                        format!(
                            "unexpected tree owner {owner} of the root block of tree {}",
                            wc.id
                        ),
                    ));
                }
                RefKind::TreeBlock { root: wc.id }
            }
        } else {
            self.drop_ref_kind(wc, level + 1)?
        };
        self.drop_tree_ref(b.bytenr(), level as u8, kind)?;
        wc.stats.tree_refs_dropped += 1;
        wc.refs[level] = 0;
        wc.flags[level] = 0;
        Ok(true)
    }
}
