//! The writer at the inode level: the running transaction (`transaction::Transaction`:
//! trees, space, extent references, commit) and the in-memory inodes (`inode_cache`)
//! that its namespace and data changes keep in step with the items. The methods of
//! this layer (names, links, attributes, xattrs, file data) are `impl FsWriter`
//! blocks in the files of `inode/`; the transaction's own (items, blocks, space,
//! commit) are reached through `Deref`.
//!
//! The engine holds one writer and shares its inode cache with its readers; an
//! offline tool may use a writer alone, with an inode cache of its own.

#[cfg(any(test, feature = "test-hooks"))]
use crate::disk_io::FsInfo;
use crate::disk_io::OpenOptions;
use crate::error::Result;
use crate::ids::InodeId;
use crate::inode::inode_cache::InodeCache;
use crate::transaction::handle::{self, TransHandle};
use crate::transaction::Transaction;
use std::sync::Arc;

/// The writable filesystem (one per open filesystem).
pub struct FsWriter {
    t: Transaction,
    /// The in-memory inodes (open and lookup counts, locks, cached attributes, extent
    /// maps, page cache; `inode_cache`), shared with every reader of the engine: an
    /// unlink through any of them sees which are in use.
    pub(crate) inodes: Arc<InodeCache>,
    /// The running transaction's log trees, as items (`log_writer`).
    pub(crate) log: crate::inode::log_writer::LogState,
}

impl std::ops::Deref for FsWriter {
    type Target = Transaction;
    fn deref(&self) -> &Transaction {
        &self.t
    }
}

impl std::ops::DerefMut for FsWriter {
    fn deref_mut(&mut self) -> &mut Transaction {
        &mut self.t
    }
}

impl AsMut<Transaction> for FsWriter {
    fn as_mut(&mut self) -> &mut Transaction {
        &mut self.t
    }
}

impl FsWriter {
    /// Open an image for writing; orphans a crash left are freed before it returns.
    ///
    /// # Errors
    /// As `FsInfo::open`, plus `Incompatible` if features forbid writing or the
    /// superblock carries an unreplayed log tree; failures freeing orphans.
    pub fn open(opts: &OpenOptions) -> Result<FsWriter> {
        FsWriter::writable(Transaction::open(opts)?)
    }

    /// Open an image read-only (`Transaction::read_only_over`), a log tree replayed in
    /// memory (`tree_log::open_with_log_replay`): every read, and every
    /// change refused with `Posix(ReadOnly)`; nothing done at open that writes.
    ///
    /// # Errors
    /// As `FsInfo::open`; read failures loading the block groups.
    pub fn open_read_only(opts: &OpenOptions) -> Result<FsWriter> {
        let info = crate::inode::tree_log::open_with_log_replay(opts)?;
        Ok(FsWriter::over(Transaction::read_only_over(Arc::new(info))?))
    }

    /// Make a writer from an opened `FsInfo` (its devices must accept writes).
    ///
    /// # Errors
    /// As `Transaction::from_info`; failures freeing orphans.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn from_info(info: FsInfo) -> Result<FsWriter> {
        FsWriter::writable(Transaction::from_info(info)?)
    }

    /// Make the writer of a shared `FsInfo` (there is one writer per filesystem).
    ///
    /// # Errors
    /// As `from_info`.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn from_shared(info: Arc<FsInfo>) -> Result<FsWriter> {
        FsWriter::writable(Transaction::from_shared(info)?)
    }

    /// A writable transaction with its log tree replayed and committed, then its
    /// orphans freed (the kernel's mount: `btrfs_replay_log`, then
    /// `btrfs_orphan_cleanup`).
    fn writable(t: Transaction) -> Result<FsWriter> {
        let mut w = FsWriter::over(t);
        if w.log_replay_pending {
            w = crate::inode::tree_log::replay_and_commit(w)?;
        }
        w.orphan_cleanup()?;
        Ok(w)
    }

    /// This writer's transaction under a new, empty inode cache (after a log replay
    /// wrote items under the old one).
    pub(crate) fn with_fresh_inodes(self) -> FsWriter {
        FsWriter::over(self.t)
    }

    /// The writer over `t`, with an empty inode cache that hears of every change to a
    /// file extent item (to drop the extent maps over it).
    pub(crate) fn over(mut t: Transaction) -> FsWriter {
        let inodes = Arc::new(InodeCache::default());
        let cache = Arc::clone(&inodes);
        t.file_extents_changed = Some(Arc::new(move |root, ino, start, end| {
            crate::inode::get_extent::drop_for_item_change(
                &cache,
                InodeId { root, ino },
                start,
                end,
            );
        }));
        FsWriter { t, inodes, log: Default::default() }
    }

    /// The in-memory inodes.
    pub fn inodes(&self) -> &Arc<InodeCache> {
        &self.inodes
    }

    /// Start a handle for a change of about `items` items, whose work may use this
    /// layer's methods (`Transaction::start_transaction`).
    ///
    /// # Errors
    /// As `Transaction::start_transaction`.
    pub fn start_transaction(
        &mut self,
        at: &'static str,
        items: u64,
    ) -> Result<TransHandle<'_, FsWriter>> {
        handle::start(self, at, items)
    }

    /// Join the running transaction with no reservation of its own
    /// (`Transaction::join_transaction`).
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after an abort.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn join_transaction(&mut self, at: &'static str) -> Result<TransHandle<'_, FsWriter>> {
        handle::start(self, at, 0)
    }

    /// Start a handle with a reservation taken earlier (`handle::start_reserved`).
    pub(crate) fn start_transaction_reserved(
        &mut self,
        at: &'static str,
        bytes: u64,
    ) -> Result<TransHandle<'_, FsWriter>> {
        handle::start_reserved(self, at, bytes)
    }

    /// Run `f` as a writeback of data written earlier when `on` (`writing_back`):
    /// that data's write was allowed when it was made, so no flag set since refuses it,
    /// and the times stay as the buffered writes set them.
    pub(crate) fn as_writeback<T>(
        &mut self,
        on: bool,
        f: impl FnOnce(&mut FsWriter) -> Result<T>,
    ) -> Result<T> {
        self.writing_back = on;
        let r = f(self);
        self.writing_back = false;
        r
    }

    /// Run `f` in a handle reserving `items` items (`Transaction::transaction`).
    ///
    /// # Errors
    /// As `Transaction::transaction`, then `f`'s error (which aborts).
    pub fn transaction<T>(
        &mut self,
        at: &'static str,
        items: u64,
        f: impl FnOnce(&mut FsWriter) -> Result<T>,
    ) -> Result<T> {
        handle::run(self, at, items, f)
    }
}
