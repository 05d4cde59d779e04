//! The file data path, over the inode layer (the kernel's file.c, the data half of
//! inode.c, reflink.c): reads of file bytes (`read`, `stream`), writes through the
//! writer and the direct write (`write`), `setattr` with its size change (`setattr`),
//! delalloc and ordered-extent completion (`delalloc`), the writeback of dirty ranges
//! (`writeback`), compression on write (`compress_write`), NOCOW writes in place
//! (`nocow`), fallocate and SEEK_DATA/SEEK_HOLE (`falloc`), and clone and dedupe of
//! ranges (`reflink`). The structures of file data in memory are `mapping`'s; the
//! items it changes go through `inode::write`.

pub mod compress_write;
pub mod delalloc;
pub mod falloc;
pub mod nocow;
pub mod read;
pub mod reflink;
pub mod setattr;
pub mod stream;
pub mod write;
pub mod writeback;
