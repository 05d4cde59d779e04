//! The engine as threads share it: one filesystem, opened once, used by many threads
//! at the same time (a mount's request workers, the tools' worker threads).
//!
//! Shape (first step; see issue "One engine"): the running transaction's state is one
//! `FsWriter` behind a reader-writer lock.
//! - Readers (`read`) share the lock and see the live view (`FsWriter::live`): every
//!   change made through the engine, committed or not. They run in parallel with each
//!   other; a read sees either all of a change or none of it, because changes happen
//!   under the exclusive side (no torn directory).
//! - Changes (`write`) take the lock exclusively, one at a time (writes are serialised
//!   at first), and the mutators abort the transaction on failure as before.
//! - `commit` runs under the exclusive side too.
//!
//! Lock order: inode locks (`inode::inode_cache`, two in inode order), then the engine
//! lock, then the node cache's and the warnings' internal mutexes (leaf locks, never
//! held across a call back into the engine). Open files: `inode::file`.
//!
//! A thread that panics while changing the filesystem leaves the lock poisoned; the
//! engine then refuses further changes and reads (the state may be half changed), with
//! a read-only error naming the panic, as an abort would.

use crate::disk_io::OpenOptions;
use crate::error::{Error, PosixKind, Result};
use crate::transaction::{FsWriter, Live};
use std::sync::{PoisonError, RwLock};

/// A filesystem shared by threads.
pub struct Engine {
    state: RwLock<FsWriter>,
    /// The in-memory inodes: open counts, locks (see `inode::file`).
    pub(crate) inodes: crate::inode::inode_cache::InodeCache,
}

fn poisoned<T>(_: PoisonError<T>) -> Error {
    Error::posix_detail(PosixKind::ReadOnly, "engine", "a thread panicked while changing the filesystem; its state is not trusted")
}

impl Engine {
    /// Open the image(s) in `opts` for reading and writing.
    ///
    /// # Errors
    /// As `FsWriter::open`.
    pub fn open(opts: &OpenOptions) -> Result<Engine> {
        Ok(Engine::from_writer(FsWriter::open(opts)?))
    }

    /// Share an opened writer.
    pub fn from_writer(w: FsWriter) -> Engine {
        Engine { state: RwLock::new(w), inodes: Default::default() }
    }

    /// Run `f` on the live view (read-your-writes), sharing the engine with other
    /// readers.
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    pub fn read<T>(&self, f: impl FnOnce(&Live<'_>) -> Result<T>) -> Result<T> {
        let g = self.state.read().map_err(poisoned)?;
        f(&g.live())
    }

    /// Run `f` with the engine to itself, to change the filesystem.
    ///
    /// # Errors
    /// `f`'s errors; `Posix(ReadOnly)` after a panic in a writer.
    pub fn write<T>(&self, f: impl FnOnce(&mut FsWriter) -> Result<T>) -> Result<T> {
        let mut g = self.state.write().map_err(poisoned)?;
        f(&mut g)
    }

    /// Commit the running transaction. Returns the generation now on disk.
    ///
    /// # Errors
    /// As `FsWriter::commit`.
    pub fn commit(&self) -> Result<u64> {
        self.write(|w| w.commit())
    }

    /// Take the writer back (all other users are gone: the engine is owned).
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after a panic in a writer.
    pub fn into_writer(self) -> Result<FsWriter> {
        self.state.into_inner().map_err(poisoned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn engine_is_shared_between_threads() {
        assert_send_sync::<Engine>();
    }
}
