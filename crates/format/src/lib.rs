//! The btrfs on-disk format: keys, structures, checksums, name hashes, feature flags,
//! item parsers and the tree checker. No I/O lives here, so every parser can be fuzzed
//! alone; `ubtrfs-core` reads bytes from devices and hands them to this crate.

// Parsers of untrusted bytes: safe code only, so a bad image can at worst be refused.
#![forbid(unsafe_code)]
// Corrupt carries the object it names (block, root, slot, key, inode); errors are the
// cold path, so its size is accepted rather than boxed at every call.
#![allow(clippy::result_large_err)]

pub mod csum;
pub mod error;
pub mod features;
pub mod hash;
pub mod items;
pub mod key;
pub mod node;
pub mod structs;
pub mod superblock;
pub mod tree_checker;

pub use csum::CsumType;
pub use error::{Corrupt, CorruptWhere};
pub use key::Key;
pub use node::NodeRef;
