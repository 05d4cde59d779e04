//! Extent references: delayed refs queued by a transaction (`delayed_ref`), the
//! extent tree they are run into (`extent_tree`), data checksums (`csum_tree`),
//! quota-group accounting (`qgroup`), the backref walks it uses (`backref`), and
//! the dropping of deleted subvolumes' trees (`drop_snapshot`).

pub(crate) mod backref;
pub mod csum_tree;
pub mod delayed_ref;
pub mod drop_snapshot;
pub mod extent_tree;
pub mod qgroup;
