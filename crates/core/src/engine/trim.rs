//! The engine's side of FITRIM (the kernel's `btrfs_ioctl_fitrim` after its permission
//! check, and the loop of `btrfs_trim_fs`): the range checked, then each block group and
//! each device trimmed under the writer lock of its own (`space::trim` does the work), so
//! writers wait at most one group's discards.

use crate::engine::Engine;
use crate::error::{Error, PosixKind, Result};
use crate::space::trim::{trim_block_group, trim_free_dev_extents, FstrimRange};

impl Engine {
    /// Run FITRIM on the engine's filesystem (`btrfs_ioctl_fitrim` after its permission
    /// check, then `btrfs_trim_fs`). Returns the range as the kernel copies it back: `len`
    /// the bytes discarded, `minlen` raised to the devices' discard granularity.
    ///
    /// # Errors
    /// In the kernel's order: `Posix(NotSupported)` when no device takes discards;
    /// `Posix(Invalid)` for `len` below the sector size, `start` at the top of the address
    /// space, or `start + len` past it; `Posix(ReadOnly)` for an aborted filesystem; then
    /// the first error of a block group's discards (or of its caching), else of a
    /// device's (the others are still trimmed; each failure is also a warning).
    pub fn fitrim(&self, range: FstrimRange) -> Result<FstrimRange> {
        let info = self.info();
        let sectorsize = u64::from(info.sectorsize);
        let what = "FITRIM";
        let granularity =
            info.devices.by_id.values().filter_map(|d| d.dev.discard_granularity()).min();
        let granularity = granularity.ok_or_else(|| {
            Error::posix_detail(
                PosixKind::NotSupported,
                what,
                "no device of the filesystem takes discards",
            )
        })?;
        if range.len < sectorsize {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what,
                format!("length {} is below the sector size {sectorsize}", range.len),
            ));
        }
        let minlen = range.minlen.max(granularity);
        if range.start == u64::MAX {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what,
                "start is the last byte of the address space",
            ));
        }
        // A length of U64_MAX means "to the end", whatever the start.
        let range_end = match range.len {
            u64::MAX => u64::MAX,
            len => range.start.checked_add(len).ok_or_else(|| {
                Error::posix_detail(
                    PosixKind::Invalid,
                    what,
                    format!("start {} + length {len} overflows", range.start),
                )
            })?,
        };
        let out = |len| FstrimRange { start: range.start, len, minlen };
        let groups = self.write(|w| {
            if w.read_only.is_some() {
                return Ok(None);
            }
            w.check_writable()?;
            // From the group holding `start` (`btrfs_lookup_first_block_group`) to the
            // last one starting before the end.
            let first = w.alloc.group(range.start).map_or(range.start, |g| g.start);
            Ok(Some(
                w.alloc
                    .groups
                    .range(first..range_end)
                    .map(|(&s, g)| (s, g.length))
                    .collect::<Vec<_>>(),
            ))
        })?;
        let Some(groups) = groups else {
            // Opened read-only: the kernel's `ro` mount discards nothing and says so.
            return Ok(out(0));
        };
        let mut trimmed = 0u64;
        let (mut bg_failed, mut bg_error) = (0u64, None);
        for (bg_start, bg_len) in groups {
            let start = range.start.max(bg_start);
            let end = range_end.min(bg_start + bg_len);
            if end - start < minlen {
                continue;
            }
            let step = self.write(|w| Ok(trim_block_group(w, bg_start, start, end, minlen)))?;
            trimmed += step.bytes;
            if let Some(e) = step.error {
                bg_failed += 1;
                bg_error = Some(e);
            }
        }
        let (mut dev_failed, mut dev_error) = (0u64, None);
        for &devid in info.devices.by_id.keys() {
            let step = self.write(|w| Ok(trim_free_dev_extents(w, devid)))?;
            trimmed += step.bytes;
            if let Some(e) = step.error {
                // The kernel stops at the first device that fails.
                dev_failed += 1;
                dev_error = Some(e);
                break;
            }
        }
        if let Some(e) = &bg_error {
            info.warn(format!("failed to trim {bg_failed} block group(s), last error: {e}"));
        }
        if let Some(e) = &dev_error {
            info.warn(format!("failed to trim {dev_failed} device(s), last error: {e}"));
        }
        match bg_error.or(dev_error) {
            Some(e) => Err(e),
            None => Ok(out(trimmed)),
        }
    }
}
