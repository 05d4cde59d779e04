//! Space management: block groups and their accounting (`block_group`), the
//! allocator and reservations (`allocator`), the in-memory free-space cache
//! (`free_space_cache`), the on-disk free-space tree (`free_space_tree`) and chunk
//! allocation (`chunk_alloc`), and the data space promised to buffered writes
//! (`data_rsv`).

pub mod allocator;
pub mod block_group;
pub mod chunk_alloc;
pub mod chunk_remove;
pub mod data_rsv;
pub mod free_space_cache;
pub mod free_space_tree;
pub mod statfs;
