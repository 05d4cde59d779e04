//! Access times: when a read, a readdir or a readlink moves an inode's atime
//! (`touch_atime`, `atime_needs_update`, `relatime_need_update`).
//!
//! - Never for an inode flagged NOATIME (chattr +A), on a `noatime` mount, for a
//!   directory on a `nodiratime` mount, or in a read-only subvolume or filesystem.
//! - `strictatime`: always.
//! - `relatime` (the default): when the atime is not after the mtime, or not after the
//!   ctime, or at least a day old.
//! - Never when the atime already is the time now.
//!
//! The update changes the atime alone (not the ctime), in the running transaction.

use crate::error::Result;
use crate::inode::filesystem::{FsRead, InodeId, Load};
use crate::inode::writer::FsWriter;
use ubtrfs_format::structs::*;

/// The mount's atime rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AtimeMode {
    /// Every access.
    Strict,
    #[default]
    Relatime,
    Noatime,
}

/// The atime options of a mount.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AtimeOpts {
    pub mode: AtimeMode,
    /// No atime updates for directories.
    pub nodiratime: bool,
}

/// A day, relatime's longest wait.
const RELATIME_MAX_AGE: i64 = 24 * 60 * 60;

fn key(t: &Timespec) -> (i64, u32) {
    (t.sec.get() as i64, t.nsec.get())
}

/// Whether an access at `now` moves the atime of inode `ii` (the read-only checks
/// are the caller's).
pub fn atime_needs_update(ii: &InodeItem, now: Timespec, opts: AtimeOpts) -> bool {
    if ii.flags.get() & INODE_NOATIME != 0 || opts.mode == AtimeMode::Noatime {
        return false;
    }
    if opts.nodiratime && ii.mode.get() & S_IFMT == S_IFDIR {
        return false;
    }
    let (atime, now) = (key(&ii.atime), key(&now));
    if opts.mode == AtimeMode::Relatime {
        let stale = key(&ii.mtime) >= atime
            || key(&ii.ctime) >= atime
            || now.0.saturating_sub(atime.0) >= RELATIME_MAX_AGE;
        if !stale {
            return false;
        }
    }
    atime != now
}

impl FsWriter {
    /// Inode `id` was read (data, directory entries or link target): move its atime
    /// if `opts` say so. Returns whether it moved. Nothing happens in a read-only
    /// subvolume or on a read-only filesystem.
    ///
    /// # Errors
    /// `Posix(NotFound)` for no such inode; tree failures.
    pub fn file_accessed(&mut self, id: InodeId, opts: AtimeOpts) -> Result<bool> {
        if self.check_root_writable(id.root).is_err() || id.is_placeholder() {
            return Ok(false);
        }
        let ii = self.live().load_inode(id, Load::ITEM)?.item;
        let now = self.now();
        if !atime_needs_update(&ii, now, opts) {
            return Ok(false);
        }
        self.transaction("file_accessed", 1, |w| w.update_inode(id, |i| i.atime = now))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::FromZeros;

    fn at(sec: i64) -> Timespec {
        Timespec { sec: (sec as u64).into(), nsec: 0.into() }
    }

    fn inode(atime: i64, mtime: i64, ctime: i64) -> InodeItem {
        let mut i = InodeItem::new_zeroed();
        i.mode = (S_IFREG | 0o644).into();
        (i.atime, i.mtime, i.ctime) = (at(atime), at(mtime), at(ctime));
        i
    }

    #[test]
    fn relatime_rules() {
        let r = AtimeOpts::default();
        let day = RELATIME_MAX_AGE;
        // Not after the mtime, or the ctime: moves.
        assert!(atime_needs_update(&inode(100, 100, 50), at(200), r));
        assert!(atime_needs_update(&inode(100, 50, 100), at(200), r));
        // After both, and fresh: stays.
        assert!(!atime_needs_update(&inode(100, 50, 50), at(200), r));
        assert!(!atime_needs_update(&inode(100, 50, 50), at(100 + day - 1), r));
        // A day old: moves.
        assert!(atime_needs_update(&inode(100, 50, 50), at(100 + day), r));
        // Already now: stays.
        assert!(!atime_needs_update(&inode(200, 200, 200), at(200), r));
    }

    #[test]
    fn the_flags_and_the_other_modes() {
        let strict = AtimeOpts { mode: AtimeMode::Strict, nodiratime: false };
        assert!(atime_needs_update(&inode(100, 50, 50), at(200), strict));
        assert!(!atime_needs_update(&inode(200, 50, 50), at(200), strict));
        let no = AtimeOpts { mode: AtimeMode::Noatime, nodiratime: false };
        assert!(!atime_needs_update(&inode(100, 100, 100), at(200), no));
        let mut flagged = inode(100, 100, 100);
        flagged.flags = INODE_NOATIME.into();
        assert!(!atime_needs_update(&flagged, at(200), strict));
        let mut dir = inode(100, 100, 100);
        dir.mode = (S_IFDIR | 0o755).into();
        assert!(!atime_needs_update(
            &dir,
            at(200),
            AtimeOpts { mode: AtimeMode::Strict, nodiratime: true }
        ));
        assert!(atime_needs_update(
            &dir,
            at(200),
            AtimeOpts { mode: AtimeMode::Strict, nodiratime: false }
        ));
    }
}
