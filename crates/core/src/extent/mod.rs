//! Extent references: delayed refs queued by a transaction (`delayed_ref`), the
//! extent tree they are run into (`extent_tree`), data checksums (`csum_tree`) and
//! quota-group accounting (`qgroup`).

pub mod csum_tree;
pub mod delayed_ref;
pub mod extent_tree;
pub mod qgroup;
