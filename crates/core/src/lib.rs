//! ubtrfs-core: the btrfs filesystem engine. Devices and chunk mapping (`volumes`),
//! validated block reads (`disk_io`), B-trees (`tree`), space management (`space`),
//! extent references (`extent`), transactions (`transaction`), file data in memory
//! (`mapping`: extent maps, page cache, ordered extents), inodes and the writer over
//! them (`inode`), compression (`compression`), and the engine that shares one
//! filesystem between threads (`engine`). The tools (check, extract, put) live in
//! ubtrfs-tools, apart from the engine.

pub mod compression;
pub mod data;
pub mod disk_io;
pub mod engine;
pub mod error;
pub mod extent;
pub mod ids;
pub mod inode;
pub mod mapping;
pub mod quote;
pub mod ranges;
pub mod sources;
pub mod space;
pub mod transaction;
pub mod tree;
pub mod volumes;

pub use data::read::FileRead;
pub use disk_io::{Expect, ExtentBuffer, FsInfo, OpenOptions};
pub use error::{Error, PosixKind, Result};
pub use inode::filesystem::{Filesystem, FsRead};
pub use inode::writer::FsWriter;
pub use inode::xattr::XattrRead;
pub use tree::search::{ItemRef, NodeHandle, Path, RootInfo, TreeView};
