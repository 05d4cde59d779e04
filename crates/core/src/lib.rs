//! ubtrfs-core: the btrfs filesystem engine. Devices and chunk mapping (`volumes`),
//! validated block reads and the node cache (`disk_io`, `node_cache`), tree search
//! (`ctree`), and the filesystem view: subvolumes, inodes, directories, xattrs and file
//! data (`fs`, `file`), with decompression (`compression`) and export (`extract`).

pub mod compression;
pub mod block_group;
pub mod ctree;
pub mod device;
pub mod disk_io;
pub mod error;
pub mod extract;
pub mod file;
pub mod fs;
pub mod node_cache;
pub mod volumes;

pub use ctree::{ItemRef, Path, RootInfo};
pub use disk_io::{Expect, ExtentBuffer, FsInfo, OpenOptions};
pub use error::{Error, PosixKind, Result};
