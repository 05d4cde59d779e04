//! The extent buffer: one validated tree block, immutable once made (the kernel's
//! `extent_buffer`), shared by the node cache, paths and readers through `Arc`, and
//! what a parent pointer or root item expects of the block it names.

use ubtrfs_format::key::is_fstree;
use ubtrfs_format::{Key, NodeRef};

/// A validated tree block and the state the write path keeps on it (the kernel's
/// `extent_buffer` with its DIRTY and WRITTEN bits):
/// - **dirty**: a block of the running transaction, owned by it (`Transaction`'s dirty
///   set) and changed in place until it is written (`should_cow_block`: generation ==
///   transid and not written);
/// - **written**: sealed (header WRITTEN set, checksummed, checked) for writeback or a
///   commit, and immutable from then on: a later change COWs it, never rewrites it;
/// - **neither**: read from disk.
///
/// Written and read blocks are shared by the node cache, paths and readers through
/// `Arc`; a dirty block is reached only through its transaction.
pub struct ExtentBuffer {
    pub bytenr: u64,
    pub(crate) data: Box<[u8]>,
    flags: u8,
    /// The transaction's change counter when a dirty block was last changed (writeback
    /// writes the blocks changed longest ago first).
    pub(crate) touched: u64,
    /// Transaction handles that COWed this dirty block, or reused it, and still live:
    /// background writeback leaves it alone while any does (writing it out would make the
    /// handle COW it again at its next search), a commit never.
    pub(crate) writeback_inhibitors: u32,
}

const EB_DIRTY: u8 = 1;
const EB_WRITTEN: u8 = 2;

impl ExtentBuffer {
    /// Wrap a block read from disk and validated.
    pub(crate) fn from_disk(bytenr: u64, data: Box<[u8]>) -> ExtentBuffer {
        ExtentBuffer { bytenr, data, flags: 0, touched: 0, writeback_inhibitors: 0 }
    }

    /// Wrap a block the write path has just validated and written.
    pub fn from_written(bytenr: u64, data: Box<[u8]>) -> ExtentBuffer {
        ExtentBuffer { bytenr, data, flags: EB_WRITTEN, touched: 0, writeback_inhibitors: 0 }
    }

    /// A new dirty block of the running transaction.
    pub(crate) fn new_dirty(bytenr: u64, data: Box<[u8]>, touched: u64) -> ExtentBuffer {
        ExtentBuffer { bytenr, data, flags: EB_DIRTY, touched, writeback_inhibitors: 0 }
    }

    /// Whether the block belongs to the running transaction and may change in place.
    pub fn is_dirty(&self) -> bool {
        self.flags & EB_DIRTY != 0
    }

    /// Whether the block was sealed for writing (it never changes again).
    pub fn is_written(&self) -> bool {
        self.flags & EB_WRITTEN != 0
    }

    /// Seal a dirty block for writing: from now on it is written, not dirty, and no
    /// handle inhibits it (the caller has checksummed and checked its bytes).
    pub(crate) fn mark_written(mut self) -> ExtentBuffer {
        debug_assert!(self.is_dirty() && !self.is_written(), "block {} sealed twice", self.bytenr);
        self.flags = EB_WRITTEN;
        self.writeback_inhibitors = 0;
        self
    }

    pub fn node(&self) -> NodeRef<'_> {
        NodeRef::new_checked(&self.data)
    }
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Whether this block is what `e` expects (a cached block is reused only then).
    pub fn matches(&self, e: &Expect) -> bool {
        let n = self.node();
        e.level.is_none_or(|l| l == n.level())
            && e.generation.is_none_or(|g| g == n.generation())
            && e.first_key.is_none_or(|k| n.nritems() == 0 || n.key(0) == k)
            && e.owner
                .is_none_or(|o| if is_fstree(o) { is_fstree(n.owner()) } else { n.owner() == o })
    }
}

/// What the parent pointer (or root item) says about a block.
#[derive(Clone, Copy, Debug, Default)]
pub struct Expect {
    pub level: Option<u8>,
    pub generation: Option<u64>,
    pub owner: Option<u64>,
    pub first_key: Option<Key>,
}
