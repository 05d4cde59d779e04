//! ubtrfs-tools: what ubtrfs does with a filesystem, as clients of the engine in
//! ubtrfs-core (btrfs-progs keeps check/, mkfs/ and cmds/ apart from kernel-shared/ the
//! same way): the checker (`check`), the export of a tree to a host directory
//! (`extract`), the import of host files (`put`), deduplication of identical files
//! (`dedupe`) and new filesystems (`mkfs`).

pub mod check;
pub mod dedupe;
pub mod edit;
pub mod extract;
pub mod mkfs;
pub mod populate;
pub mod put;
