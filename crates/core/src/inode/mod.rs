//! Inodes: their name (`id`), the filesystem view over subvolumes, inodes, directories and xattrs
//! (`filesystem`), file reads (`read`, `stream`), path resolution for writers
//! (`namei`), inode and file changes (`write`), unlink, rmdir, symlink, mknod and
//! rename (`namespace`), clone and dedupe of ranges (`reflink`), attributes and truncation (`attr`), access times (`atime`), compression on write
//! (`compress_write`), NOCOW writes in place (`nocow`), fallocate and SEEK_DATA/SEEK_HOLE (`falloc`), extended
//! attributes and properties (`xattr`), ACL inheritance and chmod (`acl`), the in-memory inodes
//! (`inode_cache`), their extent maps and the maps' shrinker (`extent_map`,
//! `extent_map_shrinker`), open files through the engine (`file`), orphans (`orphan`),
//! the page cache, buffered reads and writes (`page_cache`), ordered extents
//! (`ordered`) and their writeback (`writeback`), and the VFS's permission checks
//! for callers that ask (`perm`).

pub mod acl;
pub mod atime;
pub mod attr;
pub mod compress_write;
pub mod extent_map;
pub mod extent_map_shrinker;
pub mod falloc;
pub mod file;
pub mod filesystem;
pub mod id;
pub mod inode_cache;
pub mod namei;
pub mod namespace;
pub mod nocow;
pub mod ordered;
pub mod orphan;
pub mod page_cache;
pub mod perm;
pub mod read;
pub mod reflink;
pub mod stream;
pub mod subvol;
pub mod write;
pub mod writeback;
pub mod writer;
pub mod xattr;
