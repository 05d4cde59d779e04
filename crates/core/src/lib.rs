//! ubtrfs-core: the btrfs filesystem engine. Devices and chunk mapping (`volumes`),
//! validated block reads and the node cache (`disk_io`, `node_cache`), tree search
//! (`ctree`), and the filesystem view: subvolumes, inodes, directories, xattrs and file
//! data (`fs`, `file`), with decompression (`compression`) and export (`extract`).

pub mod alloc;
pub mod block_group;
pub mod check;
pub mod chunk;
pub mod compression;
pub mod csum;
pub mod ctree;
pub mod ctree_modify;
pub mod delayed_ref;
pub mod device;
pub mod device_lock;
pub mod disk_io;
pub mod error;
pub mod extent_tree;
pub mod extract;
pub mod fault;
pub mod file;
pub mod file_stream;
pub mod free_space_cache;
pub mod free_space_tree;
pub mod fs;
pub mod inode;
pub mod mountinfo;
pub mod namei;
pub mod node_cache;
pub mod put;
pub mod qgroup;
pub mod quote;
pub mod transaction;
pub mod volumes;

pub use ctree::{ItemRef, Path, RootInfo};
pub use disk_io::{Expect, ExtentBuffer, FsInfo, OpenOptions};
pub use error::{Error, PosixKind, Result};
