//! ubtrfs-tools: what ubtrfs does with a filesystem, as clients of the engine in
//! ubtrfs-core (btrfs-progs keeps check/, mkfs/ and cmds/ apart from kernel-shared/ the
//! same way): the checker (`check`), the export of a tree to a host directory
//! (`extract`), the import of host files (`put`), deduplication of identical files
//! (`dedupe`), the editing commands (`edit`) and new filesystems (`mkfs`). The
//! commands that change files of an image (put, mkfs --rootdir, the editing commands,
//! dedupe) do it as a program on a mount does, through an `Engine` that runs one
//! transaction (`offline_engine`).

pub mod check;
pub mod dedupe;
pub mod edit;
pub mod extract;
pub mod mkfs;
pub mod populate;
pub mod put;

use ubtrfs_core::Engine;

/// Engine `e`, just opened, set up for an offline command (`put`, `put_contents`,
/// `populate`, the editing commands, `dedupe`, mkfs): one transaction, which the caller
/// commits (`Engine::set_single_transaction`), so a failure part way leaves the
/// committed image as it was. Its inode cache keeps few inodes not in use
/// (`OFFLINE_INODE_CACHE`): a command visits each inode once or twice in a row.
pub fn offline_engine(e: Engine) -> Engine {
    e.set_single_transaction(true);
    e.set_inode_cache_capacity(OFFLINE_INODE_CACHE);
    e
}

/// Inodes not in use an offline engine keeps in memory (a mount keeps
/// `DEFAULT_INODE_CACHE_CAPACITY`, for the lookups the kernel repeats).
pub const OFFLINE_INODE_CACHE: usize = 256;
