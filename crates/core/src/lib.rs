//! ubtrfs-core: the btrfs filesystem engine. Devices and chunk mapping (`volumes`),
//! validated block reads (`disk_io`), B-trees (`tree`), space management (`space`),
//! extent references (`extent`), transactions (`transaction`), file data in memory
//! (`mapping`: extent maps, page cache, ordered extents), inodes and the writer over
//! them (`inode`), compression (`compression`), and the engine that shares one
//! filesystem between threads (`engine`). The tools (check, extract, put) live in
//! ubtrfs-tools, apart from the engine.
//!
//! The public surface is the list of `pub use` below, and `quote`: the `Engine` (every
//! change is one engine call, which takes the locks and runs the transaction it needs),
//! the read views (`Filesystem` for a committed generation, `Engine::read` for the live
//! one, the low-level `FsInfo` and `TreeView` for the checker and dump-tree), the types
//! those calls take and return, errors and ids. The modules themselves are private: the
//! writer (`FsWriter`), the transaction and its handles, and everything else inside are
//! the engine's, and a client cannot call them around its locking.
//!
//! With the `test-hooks` feature every module is public, and so are `FsWriter` and the
//! engine's calls that hand out the writer or its innards (`Engine::write`,
//! `write_retrying`, `from_writer`, `into_writer`, `inodes`, `extent_maps`): core's own
//! integration tests, the benchmarks and the fuzz targets drive the layers below the
//! engine directly, and the fault-injecting device and the engine's test switches live
//! there too. Items only those use are compiled with `test` or `test-hooks` alone. No
//! client of the engine turns the feature on.

// Each module is private, and public with the `test-hooks` feature (see above). Declared
// in pairs rather than by a macro, so rustfmt reaches every file.
#[cfg(feature = "test-hooks")]
pub mod compression;
#[cfg(not(feature = "test-hooks"))]
mod compression;
#[cfg(feature = "test-hooks")]
pub mod data;
#[cfg(not(feature = "test-hooks"))]
mod data;
#[cfg(feature = "test-hooks")]
pub mod disk_io;
#[cfg(not(feature = "test-hooks"))]
mod disk_io;
#[cfg(feature = "test-hooks")]
pub mod engine;
#[cfg(not(feature = "test-hooks"))]
mod engine;
#[cfg(feature = "test-hooks")]
pub mod error;
#[cfg(not(feature = "test-hooks"))]
mod error;
#[cfg(feature = "test-hooks")]
pub mod extent;
#[cfg(not(feature = "test-hooks"))]
mod extent;
#[cfg(feature = "test-hooks")]
pub mod ids;
#[cfg(not(feature = "test-hooks"))]
mod ids;
#[cfg(feature = "test-hooks")]
pub mod inode;
#[cfg(not(feature = "test-hooks"))]
mod inode;
#[cfg(feature = "test-hooks")]
pub mod mapping;
#[cfg(not(feature = "test-hooks"))]
mod mapping;
#[cfg(feature = "test-hooks")]
pub mod ranges;
#[cfg(not(feature = "test-hooks"))]
mod ranges;
#[cfg(feature = "test-hooks")]
pub mod sources;
#[cfg(not(feature = "test-hooks"))]
mod sources;
#[cfg(feature = "test-hooks")]
pub mod space;
#[cfg(not(feature = "test-hooks"))]
mod space;
#[cfg(feature = "test-hooks")]
pub mod transaction;
#[cfg(not(feature = "test-hooks"))]
mod transaction;
#[cfg(feature = "test-hooks")]
pub mod tree;
#[cfg(not(feature = "test-hooks"))]
mod tree;
#[cfg(feature = "test-hooks")]
pub mod volumes;
#[cfg(not(feature = "test-hooks"))]
mod volumes;

/// Quoting of names and paths in messages, as coreutils quotes them.
pub mod quote;

// The engine: opening, its calls' argument and result types.
pub use disk_io::OpenOptions;
pub use engine::{Committed, DeadRoot, Engine, LogStats, NewInode, OpenFile};
pub use extent::drop_snapshot::DropStats;
pub use inode::tree_log::open_with_log_replay;
/// The writer the engine holds, for tests that drive it directly.
#[cfg(feature = "test-hooks")]
pub use inode::writer::FsWriter;
pub use space::statfs::StatFs;
pub use space::trim::FstrimRange;

// Errors and ids.
pub use error::{Error, PosixKind, Result};
pub use ids::{Generation, InodeId, Logical};
pub use tree::search::Search;

// Reading: the committed and live views of the filesystem and what they hand out.
pub use data::read::{DecompressCache, FileRead};
pub use inode::filesystem::{
    DirEntry, ExtentKind, FileExtentRec, FileKind, Filesystem, FsRead, InodeView, Load, LoadDamage,
    SubvolInfo,
};
pub use inode::xattr::{XattrRead, XattrReply};

// Low-level reading, for the checker and the tree dumps.
pub use disk_io::{Expect, ExtentBuffer, FsInfo};
pub use extent::qgroup::QgroupRelations;
pub use ranges::merge_ranges;
pub use tree::search::{ItemRef, NodeHandle, RootInfo, TreeView};

// Inode attributes, permissions and flags as the calls take them.
pub use data::falloc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
pub use data::reflink::{Dedupe, MAX_DEDUPE_LEN};
pub use inode::atime::{atime_needs_update, AtimeMode, AtimeOpts};
pub use inode::attr::{fsflags_of, SetAttr, TimeSet};
pub use inode::namespace::{RENAME_EXCHANGE, RENAME_NOREPLACE};
pub use inode::perm::{access_acl, check_access, Cred, MAY_EXEC, MAY_WRITE};
pub use inode::subvol::subvol_top;
pub use inode::write::{mode_without_privs, InodeAttrs};

// File data: compression and the page cache's settings.
pub use compression::{CompressPolicy, CompressionType};
pub use mapping::page_cache::{WriteOpts, DEFAULT_CACHE_BYTES, DEFAULT_DIRTY_BYTES};
pub use mapping::MAX_EXTENT_SIZE;

// Devices, mounts and new filesystems (mkfs's bootstrap writes the first blocks).
pub use sources::{Sources, Time};
pub use space::chunk_alloc::raid_attr;
pub use volumes::device::{BlockDevice, FileDevice};
pub use volumes::{device_lock, mountinfo};
