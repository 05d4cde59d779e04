//! Inodes: the filesystem view over subvolumes, inodes, directories and xattrs
//! (`filesystem`), file reads (`read`, `stream`), path resolution for writers
//! (`namei`), inode and file changes (`write`) and orphans (`orphan`).

pub mod filesystem;
pub mod namei;
pub mod orphan;
pub mod read;
pub mod stream;
pub mod write;
