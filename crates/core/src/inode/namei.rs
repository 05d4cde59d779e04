//! Path lookup for the write commands: the writer splits an image path into its parent
//! directory and last name as the running transaction sees the namespace, through the
//! read API (`FsRead::resolve_parent` over `FsWriter::live`), so a writer finds exactly
//! what a reader of the same state would.

use crate::error::Result;
use crate::inode::filesystem::{FsRead, InodeId};
use crate::inode::writer::FsWriter;

impl FsWriter {
    /// `FsRead::resolve_parent` in the running transaction.
    ///
    /// # Errors
    /// As `FsRead::resolve_parent`.
    pub fn resolve_parent(&self, path: &str) -> Result<(InodeId, Vec<u8>)> {
        self.live().resolve_parent(path)
    }
}
