//! Space management: block groups and their accounting (`block_group`), the
//! allocator and reservations (`allocator`), the in-memory free-space cache
//! (`free_space_cache`), the on-disk free-space tree (`free_space_tree`) and chunk
//! allocation (`chunk_alloc`), the data space promised to buffered writes
//! (`data_rsv`), and FITRIM's discards of free space (`trim`).

pub mod allocator;
pub mod block_group;
pub mod chunk_alloc;
pub mod chunk_remove;
pub mod data_rsv;
pub mod free_space_cache;
pub mod free_space_tree;
pub mod statfs;
pub mod trim;
