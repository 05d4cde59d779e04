//! Orphans: inodes with no name left that still exist on disk, marked by an
//! ORPHAN_ITEM (key `(ORPHAN_OBJECTID, ORPHAN_ITEM, ino)`, no data) in their subvolume
//! tree, as the kernel's `btrfs_orphan_add` / `btrfs_orphan_cleanup` keep them.
//!
//! Life of an orphan:
//! - The last name of an inode in use (open, see `inode_cache`) goes (`unlink`): the
//!   ORPHAN_ITEM goes in, in the same transaction, and the inode keeps its items and
//!   extents with nlink 0. One not in use is dropped at once (a large one after its
//!   orphan item goes in, deleted last; see `drop_last_link`).
//! - The last close of an inode with nlink 0 drops it: every item and extent
//!   reference, then the orphan item (the kernel's `btrfs_evict_inode`).
//! - A crash (ours, or the kernel's) in between leaves the orphan item on disk; the
//!   next writable open finishes the job (`orphan_cleanup`), as the kernel's mount does.
//!
//! Invariant on disk, which `btrfs check` and our checker (ORPHAN_ITEM_MISSING) verify:
//! an inode item with nlink 0 always has an orphan item in the same committed state.
//!
//! Neighbours: `write` (unlink, remove_inode), `file` (open handles, which decide
//! whether an inode is in use), `transaction` (the writable open calls the cleanup).

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FsRead, InodeId, Load};
use crate::inode::writer::FsWriter;
use crate::tree::search::TreeView;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::{InodeItem, Timespec};
use ubtrfs_format::Key;

/// The key of inode `ino`'s orphan item.
pub fn orphan_key(ino: u64) -> Key {
    Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, ino)
}

/// Files of at least this many bytes (size or allocated) are the ones whose drop may
/// span transactions: more than the largest extent (`MAX_EXTENT_SIZE`), so possibly
/// more extent items than one leaf holds. Their last unlink writes the orphan item
/// before the drop begins, as the kernel does for every file.
pub const ORPHAN_FIRST_BYTES: u64 = crate::inode::write::MAX_EXTENT_SIZE;

/// Whether dropping the inode `i` may take more than one transaction.
pub fn drop_spans_transactions(i: &InodeItem) -> bool {
    i.size.get().max(i.nbytes.get()) >= ORPHAN_FIRST_BYTES
}

/// What `orphan_cleanup` did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrphanCleanup {
    /// Unlinked inodes (nlink 0) dropped with everything they owned.
    pub removed: u64,
    /// Orphan items of inodes that still have names, deleted (the inode is left alone).
    pub linked: u64,
    /// Orphan items naming no inode, deleted.
    pub missing: u64,
}

impl FsWriter {
    /// Insert inode `id`'s orphan item in its tree (`btrfs_orphan_add`). One that is
    /// there already stays: it marks the same inode.
    pub(crate) fn orphan_add(&mut self, id: InodeId) -> Result<()> {
        match self.insert_item(id.root, &orphan_key(id.ino), &[]) {
            Err(e) if e.posix_kind() == Some(PosixKind::Exists) => Ok(()),
            r => r,
        }
    }

    /// Delete inode `id`'s orphan item from its tree; false if there was none.
    pub(crate) fn orphan_del(&mut self, id: InodeId) -> Result<bool> {
        // Looked up first: a delete's search COWs its path even when the key is absent.
        let key = orphan_key(id.ino);
        let root_info = self.root(id.root)?;
        if self.live().search_slot(&root_info, &key)?.found() {
            self.delete_item(id.root, &key)
        } else {
            Ok(false)
        }
    }

    /// The last name of inode `id` (item `child`) went, at time `t`. An inode `in_use`
    /// gets its orphan item and keeps its items and extents with nlink 0 until its last
    /// close; any other is dropped now, its orphan item (if any) deleted last.
    ///
    /// The kernel writes the orphan item at every last unlink, because its drop of a
    /// large file spans transactions (its truncate stops to refill its reservation) and
    /// a crash half-way must leave the orphan for the next mount to finish. Our drop
    /// happens in the unlink's transaction, so an orphan item inserted and deleted in it
    /// would change nothing on disk; it costs a COW of the tree's last leaf, which a
    /// snapshot may share. So only a file of at least `ORPHAN_FIRST_BYTES` gets it first,
    /// in the kernel's order, and a drop split over transactions later must use the
    /// same test (`drop_spans_transactions`) to stay crash-safe.
    pub(crate) fn drop_last_link(
        &mut self,
        id: InodeId,
        child: &InodeItem,
        t: Timespec,
        in_use: bool,
    ) -> Result<()> {
        if in_use || drop_spans_transactions(child) {
            self.orphan_add(id)?;
        }
        if in_use {
            self.update_inode(id, |i| {
                i.nlink = 0.into();
                i.ctime = t;
            })
        } else {
            self.evict_inode_inner(id)
        }
    }

    /// Drop inode `id` with every item and extent it owns, then its orphan item (the
    /// kernel's `btrfs_evict_inode` of an unlinked inode).
    fn evict_inode_inner(&mut self, id: InodeId) -> Result<()> {
        self.remove_inode_inner(id)?;
        self.orphan_del(id)?;
        Ok(())
    }

    /// Drop inode `id` if it has no name left (nlink 0): the last close or forget of an
    /// orphan. Returns whether it was dropped; an inode that is gone already, or still
    /// has names, or any inode of a read-only open, is left alone.
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after an abort or in a read-only subvolume (the orphan stays
    /// for the next writable open); tree failures, which abort.
    pub fn evict_if_unlinked(&mut self, id: InodeId) -> Result<bool> {
        if self.read_only.is_some() {
            // Opened read-only: an inode the image left unlinked stays an orphan for
            // the next writable open to clean, as a read-only kernel mount leaves it.
            return Ok(false);
        }
        let nlink = match self.live().load_inode(id, Load::ITEM) {
            Ok(v) => v.nlink(),
            Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => return Ok(false),
            Err(e) => return Err(e),
        };
        if nlink != 0 {
            return Ok(false);
        }
        self.check_root_writable(id.root)?;
        self.transaction("evict_inode", 0, |w| w.evict_inode_inner(id))?;
        Ok(true)
    }

    /// The orphan items of tree `root`, by inode number.
    ///
    /// # Errors
    /// Read failures.
    pub fn orphans(&mut self, root: u64) -> Result<Vec<u64>> {
        Ok(self
            .items_in_range(root, &orphan_key(0), &orphan_key(u64::MAX))?
            .into_iter()
            .map(|(k, _)| k.offset)
            .collect())
    }

    /// Finish what crashes left (the kernel's `btrfs_orphan_cleanup`), in the default
    /// FS tree and every subvolume tree, for each orphan item:
    /// - its inode has nlink 0: drop it with everything it owns, then the orphan item;
    /// - its inode still has names: delete only the orphan item (and any fs-verity items
    ///   of the inode, which an interrupted enabling of verity leaves). Kernels before
    ///   3.12 also marked an interrupted truncate this way; the kernel no longer
    ///   truncates for it, and neither do we: extents past i_size can be wanted
    ///   (preallocated with KEEP_SIZE);
    /// - no such inode: delete the orphan item.
    ///
    /// The writable open runs this. Its changes join the running transaction and land
    /// with the caller's next commit, as the kernel's cleanup at mount joins the running
    /// transaction rather than committing it: an open followed by no commit leaves the
    /// image as it was, and the next writable open does the same cleanup again.
    ///
    /// Differences from the kernel: it cleans only the default FS tree at mount and a
    /// subvolume when a lookup first enters it; we clean them all at once. Read-only
    /// subvolumes are skipped (send relies on them never changing; the kernel cleans one
    /// when a lookup enters it), and so are deleted ones (refs 0), which the cleaner
    /// drops whole. A subvolume other than the FS tree whose orphans cannot be read is
    /// skipped with a warning, as the kernel would meet the error only on entering it.
    ///
    /// # Errors
    /// Read failures listing the subvolumes or the FS tree's orphans; any failure while
    /// dropping, which aborts.
    pub fn orphan_cleanup(&mut self) -> Result<OrphanCleanup> {
        let mut done = OrphanCleanup::default();
        let mut trees = vec![FS_TREE_OBJECTID];
        let roots = self.items_in_range(
            ROOT_TREE_OBJECTID,
            &Key::new(FIRST_FREE_OBJECTID, ROOT_ITEM_KEY, 0),
            &Key::new(LAST_FREE_OBJECTID, ROOT_ITEM_KEY, u64::MAX),
        )?;
        trees.extend(
            roots.iter().filter(|(k, _)| k.type_ == ROOT_ITEM_KEY).map(|(k, _)| k.objectid),
        );
        trees.dedup();
        for root in trees {
            let orphans = match self.cleanable_orphans(root) {
                Ok(o) => o,
                // No such tree (an image without an FS tree yet): nothing to clean.
                Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => continue,
                Err(e) if root != FS_TREE_OBJECTID => {
                    self.info.warn(format!("orphan cleanup of subvolume {root} skipped: {e}"));
                    continue;
                }
                Err(e) => return Err(e.at(format!("orphan cleanup of tree {root}"))),
            };
            for ino in orphans {
                self.cleanup_one(InodeId { root, ino }, &mut done)?;
            }
        }
        Ok(done)
    }

    /// The orphans of subvolume `root` if the cleanup may change it.
    fn cleanable_orphans(&mut self, root: u64) -> Result<Vec<u64>> {
        self.root(root)?;
        let item = self
            .roots
            .get(&root)
            .and_then(|s| s.item)
            .ok_or_else(|| Error::posix(PosixKind::NotFound, format!("tree {root}")))?;
        if item.refs.get() == 0 || self.root_is_readonly(root)? {
            return Ok(Vec::new());
        }
        self.orphans(root)
    }

    fn cleanup_one(&mut self, id: InodeId, done: &mut OrphanCleanup) -> Result<()> {
        let (root, ino) = (id.root, id.ino);
        let nlink = match self.live().load_inode(id, Load::ITEM) {
            Ok(v) => Some(v.nlink()),
            Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => None,
            Err(e) => return Err(e.at(format!("orphan cleanup of {id}"))),
        };
        match nlink {
            None => {
                self.transaction("orphan_cleanup", 0, |w| w.orphan_del(id))?;
                done.missing += 1;
            }
            Some(0) => {
                self.transaction("orphan_cleanup", 0, |w| w.evict_inode_inner(id))?;
                done.removed += 1;
            }
            Some(_) => {
                self.transaction("orphan_cleanup", 0, |w| {
                    let verity = w.items_in_range(
                        root,
                        &Key::new(ino, VERITY_DESC_ITEM_KEY, 0),
                        &Key::new(ino, VERITY_MERKLE_ITEM_KEY, u64::MAX),
                    )?;
                    for (k, _) in verity.iter().rev() {
                        w.delete_item(root, k)?;
                    }
                    w.orphan_del(id)
                })?;
                done.linked += 1;
            }
        }
        Ok(())
    }
}
