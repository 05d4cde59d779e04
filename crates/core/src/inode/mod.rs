//! Inodes: the filesystem view over subvolumes, inodes, directories and xattrs
//! (`filesystem`), file reads (`read`, `stream`), path resolution for writers
//! (`namei`) and inode and file changes (`write`).

pub mod filesystem;
pub mod namei;
pub mod read;
pub mod stream;
pub mod write;
