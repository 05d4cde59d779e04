//! Extent references: delayed refs queued by a transaction (`delayed_ref`), the
//! extent tree they are run into (`extent_tree`), data checksums (`csum_tree`),
//! quota-group accounting (`qgroup`) and the backref walks it uses (`backref`).

pub(crate) mod backref;
pub mod csum_tree;
pub mod delayed_ref;
pub mod extent_tree;
pub mod qgroup;
