//! The extent buffer: one validated tree block, immutable once made (the kernel's
//! `extent_buffer`), shared by the node cache, paths and readers through `Arc`, and
//! what a parent pointer or root item expects of the block it names.

use ubtrfs_format::{Key, NodeRef};

/// A validated tree block.
pub struct ExtentBuffer {
    pub bytenr: u64,
    pub(crate) data: Box<[u8]>,
}

impl ExtentBuffer {
    /// Wrap a block the write path has just validated and written.
    pub fn from_written(bytenr: u64, data: Box<[u8]>) -> ExtentBuffer {
        ExtentBuffer { bytenr, data }
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
            && e.owner.is_none_or(|o| if ubtrfs_format::tree_checker::is_fstree(o) { ubtrfs_format::tree_checker::is_fstree(n.owner()) } else { n.owner() == o })
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
