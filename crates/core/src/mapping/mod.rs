//! The in-memory side of file data, per inode, below the inode layer (the kernel keeps
//! these apart from inode.c too): extent maps and their shrinker (`extent_map`,
//! `extent_map_shrinker`; extent_map.c), the page cache (`page_cache`; the pages and
//! per-block state of extent_io.c and subpage.c), ordered extents (`ordered`;
//! ordered-data.c), and the owned file extent records they are built from
//! (`file_extent`). Nothing here reads or changes a tree: the inode layer fills the
//! maps (`inode::get_extent`), runs delalloc and completes ordered extents
//! (`data::delalloc`), and the engine drives the page cache.

pub mod extent_map;
pub mod extent_map_shrinker;
pub mod file_extent;
pub mod ordered;
pub mod page_cache;

/// Largest extent the kernel writes (BTRFS_MAX_EXTENT_SIZE).
pub const MAX_EXTENT_SIZE: u64 = 128 << 20;
