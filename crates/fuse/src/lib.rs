//! The FUSE adapter of ubtrfs: the kernel's FUSE requests onto the engine's operations
//! (`fs`), FUSE node ids for btrfs inodes (`ino`), the errno of each engine error
//! (`errno`), the mount's options (`options`), the mount(2) or fusermount3 that makes
//! the mount (`kernel_mount`), a mount's life from open to the last commit (`session`), the btrfs subvolume ioctls (`subvol_ioctl`) and FITRIM (`trim_ioctl`). It holds no filesystem logic: the engine in ubtrfs-core
//! decides what every operation does.

pub mod errno;
pub mod fs;
pub mod ino;
pub mod kernel_mount;
pub mod log;
pub mod options;
pub mod session;
pub mod subvol_ioctl;
pub mod trim_ioctl;

pub use options::MountOptions;
pub use session::{find_top, open_engine, serve};
