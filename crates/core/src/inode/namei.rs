//! Path lookup for the write commands: split an image path into its parent directory
//! and last name, as the running transaction sees the namespace. Resolution itself is
//! the read API's (`FsRead::resolve_id` over `FsWriter::live`), so a writer finds
//! exactly what a reader of the same state would.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FileKind, FsRead, InodeId, Load};
use crate::inode::writer::FsWriter;

impl FsWriter {
    /// Split `path` into (parent directory, last name); the parent must exist and be a
    /// directory (symlinks on the way are followed, the last name is not).
    ///
    /// # Errors
    /// `Posix` Invalid for the top itself, NotFound / NotDir for the parent.
    pub fn resolve_parent(&self, path: &str) -> Result<(InodeId, Vec<u8>)> {
        let trimmed = path.trim_end_matches('/');
        let (dir, name) = match trimmed.rfind('/') {
            Some(i) => (&trimmed[..i], &trimmed[i + 1..]),
            None => ("", trimmed),
        };
        if name.is_empty() || name == "." || name == ".." {
            return Err(Error::posix(
                PosixKind::Invalid,
                format!("{}: needs a name inside a directory", crate::quote::name(path.as_bytes())),
            ));
        }
        let live = self.live();
        let parent = live.resolve_id(dir, true)?;
        if live.load_inode(parent, Load::ITEM)?.kind() != FileKind::Dir {
            return Err(Error::posix(PosixKind::NotDir, crate::quote::name(dir.as_bytes())));
        }
        Ok((parent, name.as_bytes().to_vec()))
    }
}
