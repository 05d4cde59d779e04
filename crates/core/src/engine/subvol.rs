//! Subvolumes as the engine drives them: creation, the default subvolume and the
//! read-only flag, each one call; a snapshot waits for its source's dirty data
//! and a commit (the kernel snapshots at commit); a deletion writes back first and
//! takes the directory's lock; the cleaner drops dead trees step by step between
//! commits (the kernel's cleaner thread). The tree work itself is the transaction's
//! (`inode::subvol`, `extent::drop_snapshot`).

use crate::engine::Engine;
use crate::error::{Error, PosixKind, Result};
use crate::extent::drop_snapshot::{DropStats, DROP_STEP_BUDGET};
use crate::inode::file::write_lock_two;
use crate::inode::filesystem::{FsRead, InodeId};
use crate::inode::write::InodeAttrs;

/// Drop steps between the cleaner's commits: each commit makes the progress so far
/// durable, and a crash resumes from it.
const STEPS_PER_COMMIT: u32 = 16;

impl Engine {
    /// Create subvolume `name` in directory `dir` (`btrfs subvolume create`,
    /// `FsWriter::create_subvol`), its top directory with `a`'s permission bits, owner
    /// and times. Returns the new tree's id. Who may create in `dir` is the caller's
    /// check (`may_create`).
    ///
    /// # Errors
    /// As `FsWriter::create_subvol`.
    pub fn create_subvol(&self, dir: InodeId, name: &[u8], a: &InodeAttrs) -> Result<u64> {
        self.write_retrying(|w| w.create_subvol(dir.root, dir.ino, name, a))
    }

    /// Make subvolume `id` the default, the one a mount without subvol= shows
    /// (`FsWriter::set_default_subvol`).
    ///
    /// # Errors
    /// As `FsWriter::set_default_subvol`.
    pub fn set_default_subvol(&self, id: u64) -> Result<()> {
        self.write_retrying(|w| w.set_default_subvol(id))
    }

    /// Flag subvolume `root` read-only or writable (`FsWriter::set_subvol_readonly`)
    /// and commit, as the kernel's `btrfs_ioctl_subvol_setflags` commits the change
    /// before it returns.
    ///
    /// # Errors
    /// As `FsWriter::set_subvol_readonly`; commit errors.
    pub fn set_subvol_readonly(&self, root: u64, readonly: bool) -> Result<()> {
        // Not `write_retrying`: the writer begins its change before it reads the root,
        // so a run could never stop at a miss and go again.
        self.write(|w| w.set_subvol_readonly(root, readonly))?;
        self.commit()?;
        Ok(())
    }

    /// Snapshot subvolume `src` as `name` in directory `dir`, read-only
    /// if `readonly` (`FsWriter::create_snapshot_of_committed`): every dirty file is
    /// written back and the running transaction committed first (the kernel's snapshot
    /// flushes the source's delalloc and snapshots at commit), then the snapshot is
    /// made and committed. Returns its id.
    ///
    /// # Errors
    /// As `FsWriter::create_snapshot_of_committed`; writeback and commit errors;
    /// `Posix(Busy)` when the source kept changing between commits.
    pub fn create_snapshot(
        &self,
        src: u64,
        dir: InodeId,
        name: &[u8],
        readonly: bool,
    ) -> Result<u64> {
        self.writeback_all()?;
        for _ in 0..8 {
            self.commit()?;
            if let Some(id) = self.write_retrying(|w| {
                w.create_snapshot_of_committed(src, dir.root, dir.ino, name, readonly)
            })? {
                self.commit()?;
                return Ok(id);
            }
        }
        Err(Error::posix_detail(
            PosixKind::Busy,
            format!("subvolume {src}"),
            "it kept changing between commits; no snapshot was made",
        ))
    }

    /// Delete subvolume `name` of directory `dir` (`FsWriter::delete_subvol`), with the
    /// directory's lock. Dirty file data is written back first (none may be left for
    /// the deleted tree). Returns its id; its tree is dropped by `clean_dead_roots`.
    ///
    /// # Errors
    /// As `FsWriter::delete_subvol`; `Posix(Busy)` while a file of the subvolume is
    /// open (the kernel would let the file live on until closed; we refuse instead);
    /// writeback errors.
    pub fn delete_subvol(&self, dir_id: InodeId, name: &[u8]) -> Result<u64> {
        let entry = self
            .read(|l| FsRead::lookup(l, dir_id, name))?
            .ok_or_else(|| Error::posix(PosixKind::NotFound, crate::quote::name(name)))?;
        if entry.is_subvol && !entry.is_placeholder() {
            let id = entry.target.root;
            if let Some(busy) = self.inodes.open_in_root(id) {
                return Err(Error::posix_detail(
                    PosixKind::Busy,
                    format!("subvolume {} (id {id})", crate::quote::name(name)),
                    format!("inode {} of it is open", busy.ino),
                ));
            }
            self.writeback_all()?;
        }
        let dir_inode = self.inodes.get(dir_id);
        let _lock = write_lock_two(&dir_inode, None);
        self.write_retrying(|w| w.delete_subvol(dir_id.root, dir_id.ino, name))
    }

    /// Drop the trees of deleted subvolumes (the kernel's cleaner thread): every dead
    /// root (`FsWriter::dead_roots`), step by step (`FsWriter::drop_subvol_step`),
    /// committing every few steps and when a tree is gone, until none is left or
    /// `keep_going(id, totals)` (asked before each step) says stop. A deletion of the
    /// running transaction is committed first. Returns the totals (`done` once no
    /// dead root is left). With quotas on, each tree is dropped in one transaction
    /// (its commit recounts the qgroups, see `drop_subvol_step`).
    ///
    /// # Errors
    /// Step and commit errors (a step's failure has aborted the filesystem).
    pub fn clean_dead_roots(
        &self,
        keep_going: &mut dyn FnMut(u64, &DropStats) -> bool,
    ) -> Result<DropStats> {
        let mut total = DropStats::default();
        let mut since_commit = 0u32;
        // With quotas on each commit of a drop recounts every qgroup: the tree is
        // dropped in one transaction, one recount for it.
        let steps_per_commit =
            if self.write(|w| Ok(w.quotas))? { u32::MAX } else { STEPS_PER_COMMIT };
        while let Some(id) = self.write(|w| w.dead_roots())?.first().copied() {
            let mut busy = 0;
            loop {
                if !keep_going(id, &total) {
                    if since_commit > 0 {
                        self.commit()?;
                    }
                    return Ok(total);
                }
                match self.write(|w| w.drop_subvol_step(id, DROP_STEP_BUDGET)) {
                    Ok(s) => {
                        total.add(&s);
                        since_commit += 1;
                        if s.done || since_commit >= steps_per_commit {
                            self.commit()?;
                            since_commit = 0;
                        }
                        if s.done {
                            break;
                        }
                    }
                    // Deleted (or changed) in the running transaction: commit, then drop.
                    Err(e) if e.posix_kind() == Some(PosixKind::Busy) && busy == 0 => {
                        busy += 1;
                        self.commit()?;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        total.done = true;
        Ok(total)
    }
}
