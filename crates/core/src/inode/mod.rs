//! Inodes: the writer at the inode level (`writer`: `FsWriter`, the running transaction
//! with the in-memory inodes), the in-memory inodes (`inode_cache`), the filesystem view
//! over subvolumes, inodes, directories and xattrs (`filesystem`), file reads (`read`,
//! `stream`), inode and file changes (`write`),
//! unlink, rmdir, symlink, mknod and rename (`namespace`), clone and dedupe of ranges
//! (`reflink`), attributes and truncation (`attr`), access times (`atime`), compression
//! on write (`compress_write`), NOCOW writes in place (`nocow`), fallocate and
//! SEEK_DATA/SEEK_HOLE (`falloc`), extended attributes and properties (`xattr`), ACL
//! inheritance and chmod (`acl`), filling and dropping extent maps (`get_extent`),
//! delalloc and ordered-extent completion (`delalloc`), the writeback of dirty ranges
//! (`writeback`), open files through the engine (`file`), orphans (`orphan`), subvolume
//! creation (`subvol`), the VFS's permission checks for callers that ask (`perm`), and
//! the replay of log trees an fsync left (`tree_log`).
//! The structures of file data in memory (extent maps, page cache, ordered extents) sit
//! below, in `mapping`.

pub mod acl;
pub mod atime;
pub mod attr;
pub mod file;
pub mod filesystem;
pub mod get_extent;
pub mod inode_cache;
pub mod log_writer;
pub mod namespace;
pub mod orphan;
pub mod perm;
pub mod subvol;
pub mod tree_log;
pub mod write;
pub mod writer;
pub mod xattr;
