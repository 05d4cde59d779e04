//! Inodes: their name (`id`), the filesystem view over subvolumes, inodes, directories and xattrs
//! (`filesystem`), file reads (`read`, `stream`), path resolution for writers
//! (`namei`), inode and file changes (`write`), extended attributes and properties
//! (`xattr`), the in-memory inodes (`inode_cache`), open files through the engine
//! (`file`) and orphans (`orphan`).

pub mod file;
pub mod filesystem;
pub mod id;
pub mod inode_cache;
pub mod namei;
pub mod orphan;
pub mod read;
pub mod stream;
pub mod write;
pub mod xattr;
