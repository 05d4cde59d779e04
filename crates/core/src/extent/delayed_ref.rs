//! Delayed references: every change to an extent's reference count is recorded here
//! during the transaction, merged per bytenr and per backref, and applied to the extent
//! tree when the transaction commits (`extent_tree::run_delayed_refs`).
//!
//! Invariant: a head with `must_insert` is an extent allocated in this transaction
//! whose EXTENT/METADATA item does not exist yet; its deltas are never negative in sum
//! per backref. A head whose deltas all cancel is dropped (allocated and freed inside
//! one transaction: the space returns to the allocator without ever reaching disk).
//!
//! Every reference to one bytenr must agree on the extent's length and kind (data or
//! tree block). References come from on-disk file extents and node pointers, so a
//! disagreement is damage, a `Corrupt` error naming the referrer, never an assertion;
//! the caller's change has begun, and its guard aborts the transaction.
//!
//! With quotas on, every extent whose references change is also recorded (the
//! kernel's qgroup extent records, `btrfs_qgroup_trace_extent`): the records outlive
//! the heads (which may run before the commit) and are taken by the commit's qgroup
//! accounting (`qgroup::account`). A tree block referenced only by trees that are not
//! subvolumes (extent, csum, free-space, root, quota trees) is not recorded: no qgroup
//! counts it.

use crate::error::Result;
use std::collections::{BTreeMap, BTreeSet};
use ubtrfs_format::key::is_subvolume_tree;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

/// Which backref a delta applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RefKind {
    TreeBlock { root: u64 },
    SharedBlock { parent: u64 },
    Data { root: u64, ino: u64, offset: u64 },
    SharedData { parent: u64 },
}

/// What to insert for a newly allocated extent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewExtent {
    Tree { level: u8, first_key: Key },
    Data,
}

/// All pending changes of one extent.
#[derive(Clone, Debug)]
pub struct RefHead {
    pub bytenr: u64,
    pub num_bytes: u64,
    pub is_data: bool,
    /// Tree level (tree blocks), needed to find the METADATA_ITEM.
    pub level: u8,
    pub refs: BTreeMap<RefKind, i64>,
    pub must_insert: Option<NewExtent>,
    /// Extent flags to set when the head runs (the kernel's delayed extent op):
    /// FULL_BACKREF on a tree block whose children now point back at it by bytenr.
    pub set_flags: u64,
}

impl RefHead {
    pub fn total(&self) -> i64 {
        self.refs.values().sum()
    }
}

/// Most extents recorded for qgroup accounting in one transaction (about 40 bytes
/// each in memory, so 40 MiB): past that, walking each of them costs about what the
/// full recount does, so the records are dropped and the commit recounts.
pub const MAX_QGROUP_RECORDS: usize = 1 << 20;

/// The extents whose references changed in the running transaction (quotas on).
#[derive(Default, Debug)]
pub struct QgroupRecords {
    pub extents: BTreeSet<u64>,
    /// More than the limit changed: `extents` was dropped, recount.
    pub overflowed: bool,
}

#[derive(Default, Debug)]
pub struct DelayedRefs {
    heads: BTreeMap<u64, RefHead>,
    /// Some while quotas are on.
    qgroup: Option<QgroupRecords>,
    /// Most extents recorded (`MAX_QGROUP_RECORDS`, lower in tests).
    qgroup_limit: usize,
}

impl DelayedRefs {
    pub fn is_empty(&self) -> bool {
        self.heads.is_empty()
    }
    pub fn len(&self) -> usize {
        self.heads.len()
    }

    /// Record (from now on) every extent whose references change, for quotas.
    pub fn trace_qgroup(&mut self) {
        self.qgroup.get_or_insert_with(Default::default);
        self.qgroup_limit = MAX_QGROUP_RECORDS;
    }

    /// Record at most `limit` extents (tests of the overflow).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn set_qgroup_record_limit(&mut self, limit: usize) {
        assert!(
            limit <= MAX_QGROUP_RECORDS,
            "qgroup record limit {limit} above {MAX_QGROUP_RECORDS}"
        );
        self.qgroup_limit = limit;
    }

    /// The extents recorded since the last call (None with quotas off).
    pub fn take_qgroup_records(&mut self) -> Option<QgroupRecords> {
        self.qgroup.as_mut().map(std::mem::take)
    }

    fn record_qgroup(&mut self, bytenr: u64, kind: RefKind) {
        let Some(q) = self.qgroup.as_mut() else { return };
        if q.overflowed || matches!(kind, RefKind::TreeBlock { root } if !is_subvolume_tree(root)) {
            return;
        }
        q.extents.insert(bytenr);
        if q.extents.len() > self.qgroup_limit {
            q.extents = BTreeSet::new();
            q.overflowed = true;
        }
    }

    /// The head of `bytenr`, made on first use; later references must agree with it.
    ///
    /// # Errors
    /// `Corrupt` naming the referrer (`kind`) when `bytenr` is already referenced in
    /// this transaction with another length, or as the other kind of extent.
    fn head(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        is_data: bool,
        level: u8,
        kind: RefKind,
    ) -> Result<&mut RefHead> {
        let h = self.heads.entry(bytenr).or_insert_with(|| RefHead {
            bytenr,
            num_bytes,
            is_data,
            level,
            refs: BTreeMap::new(),
            must_insert: None,
            set_flags: 0,
        });
        if h.is_data != is_data {
            return Err(referrer(
                kind,
                format!("extent {bytenr} is referenced both as a data extent and as a tree block"),
            )
            .into());
        }
        if h.num_bytes != num_bytes {
            return Err(referrer(
                kind,
                format!(
                    "extent {bytenr} is referenced with length {num_bytes} and with length {}",
                    h.num_bytes
                ),
            )
            .into());
        }
        Ok(h)
    }

    /// Record a tree block reference change; `new` marks a block allocated now.
    ///
    /// # Errors
    /// `Corrupt` when `bytenr` is referenced as data too (see `head`).
    pub fn add_tree_ref(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        level: u8,
        kind: RefKind,
        delta: i64,
        new: Option<Key>,
    ) -> Result<()> {
        self.record_qgroup(bytenr, kind);
        let h = self.head(bytenr, num_bytes, false, level, kind)?;
        if let Some(first_key) = new {
            // The allocator never hands out space reserved in this transaction.
            assert!(h.must_insert.is_none(), "tree block {bytenr} allocated twice");
            h.must_insert = Some(NewExtent::Tree { level, first_key });
        }
        *h.refs.entry(kind).or_insert(0) += delta;
        Ok(())
    }

    /// Record a data extent reference change; `new` marks an extent allocated now.
    ///
    /// # Errors
    /// `Corrupt` when `bytenr` is referenced with another length or as a tree block
    /// (see `head`).
    pub fn add_data_ref(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        kind: RefKind,
        delta: i64,
        new: bool,
    ) -> Result<()> {
        self.record_qgroup(bytenr, kind);
        let h = self.head(bytenr, num_bytes, true, 0, kind)?;
        if new {
            // The allocator never hands out space reserved in this transaction.
            assert!(h.must_insert.is_none(), "data extent {bytenr} allocated twice");
            h.must_insert = Some(NewExtent::Data);
        }
        *h.refs.entry(kind).or_insert(0) += delta;
        Ok(())
    }

    /// A tree block allocated in this transaction changed level before its item was
    /// inserted (a root node whose last child went turns into an empty leaf).
    pub fn relevel_new_tree_block(&mut self, bytenr: u64, level: u8) {
        let h = self.heads.get_mut(&bytenr).expect("a dirty block has a pending head");
        match &mut h.must_insert {
            Some(NewExtent::Tree { level: l, .. }) => *l = level,
            other => panic!("tree block {bytenr} is not newly allocated: {other:?}"),
        }
        h.level = level;
    }

    /// Set extent item flags of tree block `bytenr` when its head runs.
    ///
    /// # Errors
    /// `Corrupt` when `bytenr` is referenced as data too (see `head`).
    pub fn set_tree_block_flags(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        level: u8,
        root: u64,
        flags: u64,
    ) -> Result<()> {
        self.head(bytenr, num_bytes, false, level, RefKind::TreeBlock { root })?.set_flags |= flags;
        Ok(())
    }

    /// The pending change of `bytenr`: (sum of reference deltas, flags to be set).
    pub fn pending(&self, bytenr: u64) -> (i64, u64) {
        self.heads.get(&bytenr).map_or((0, 0), |h| (h.total(), h.set_flags))
    }

    /// The pending changes of `bytenr`, if any.
    pub fn head_of(&self, bytenr: u64) -> Option<&RefHead> {
        self.heads.get(&bytenr)
    }

    /// Take every head for running, in bytenr order.
    pub fn take_all(&mut self) -> Vec<RefHead> {
        std::mem::take(&mut self.heads).into_values().collect()
    }

    /// Drop the head of `bytenr` if it is an extent allocated in this transaction whose
    /// references now cancel out: it was freed before its commit, and its space may be
    /// used again at once. Returns whether it was dropped.
    pub fn drop_if_cancelled(&mut self, bytenr: u64) -> bool {
        let cancelled = self
            .heads
            .get(&bytenr)
            .is_some_and(|h| h.must_insert.is_some() && h.refs.values().all(|&d| d == 0));
        if cancelled {
            self.heads.remove(&bytenr);
        }
        cancelled
    }

    /// Is `bytenr` a data extent allocated in this transaction and not yet inserted?
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn is_new(&self, bytenr: u64) -> bool {
        self.heads.get(&bytenr).is_some_and(|h| h.must_insert.is_some())
    }
}

/// A corruption said of the item that makes reference `kind`: a file extent of
/// (root, ino), a node of tree `root`, or the parent block of a shared reference.
fn referrer(kind: RefKind, reason: String) -> Corrupt {
    let c = Corrupt::new(CorruptWhere::Item, reason);
    match kind {
        RefKind::TreeBlock { root } => c.root(root),
        RefKind::Data { root, ino, .. } => c.root(root).ino(ino),
        RefKind::SharedBlock { parent } | RefKind::SharedData { parent } => c.block(parent),
    }
}
