//! A device replace the kernel left in the filesystem (its dev-replace.c): the
//! DEV_REPLACE item of the dev tree, read at open.
//!
//! While a replace runs, the target device (devid 0, same fsid, no DEV_ITEM, not
//! counted in num_devices) holds a copy of the source device's stripes below the
//! item's `cursor_left`, at the same physical offsets. ubtrfs reads such a target
//! when the source is missing (as btrfs_map_block's extra mirror from the replace
//! target does) and never writes a filesystem with a replace in progress: the
//! kernel would have to duplicate every write below the cursor onto the target,
//! and resumes the replace at its next mount.
//!
//! Neighbours: `disk_io` (open reads the item, `read_dev_replace`, and hands it to
//! `Devices`), `volumes`
//! (the read path's redirection), `transaction` (the writer's refusal).

use ubtrfs_format::structs::*;

/// The DEV_REPLACE item in CPU form, with the source device's size from its
/// DEV_ITEM (for the progress the kernel reports).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevReplace {
    pub src_devid: u64,
    pub cursor_left: u64,
    pub cursor_right: u64,
    /// `DEV_REPLACE_STATE_*`.
    pub state: u64,
    /// The source device's total_bytes (its DEV_ITEM), 0 if it has none.
    pub src_total_bytes: u64,
}

impl DevReplace {
    /// Started or suspended: the target is being filled and the kernel resumes the
    /// copy at its next read-write mount (btrfs_dev_replace_is_ongoing, plus the
    /// suspended state the kernel leaves at unmount).
    pub fn is_ongoing(&self) -> bool {
        matches!(self.state, DEV_REPLACE_STATE_STARTED | DEV_REPLACE_STATE_SUSPENDED)
    }

    /// Progress in tenths of a percent, as btrfs_dev_replace_progress computes it
    /// (the cursor against the source device's size, in units of its thousandth)
    /// and `btrfs replace status` prints it.
    pub fn progress_permille(&self) -> u64 {
        match self.state {
            DEV_REPLACE_STATE_FINISHED => 1000,
            DEV_REPLACE_STATE_STARTED | DEV_REPLACE_STATE_SUSPENDED => {
                self.cursor_left.checked_div(self.src_total_bytes / 1000).map_or(0, |p| p.min(1000))
            }
            _ => 0,
        }
    }

    /// Why a writer must not run: the replace named, with its progress.
    pub fn refusal(&self) -> String {
        let p = self.progress_permille();
        let state = dev_replace_state_name(self.state).unwrap_or("ongoing").to_ascii_lowercase();
        format!(
            "a device replace of devid {} is {}.{}% done ({state}): finish it with a kernel mount",
            self.src_devid,
            p / 10,
            p % 10
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(state: u64, left: u64, total: u64) -> DevReplace {
        DevReplace {
            src_devid: 2,
            cursor_left: left,
            cursor_right: left,
            state,
            src_total_bytes: total,
        }
    }

    #[test]
    fn progress_as_the_kernel_counts_it() {
        // 43.9% of 1 GiB: the kernel truncates to tenths.
        let r = item(DEV_REPLACE_STATE_STARTED, 471_859_200, 1 << 30);
        assert_eq!(r.progress_permille(), 439);
        assert!(r.is_ongoing());
        assert_eq!(
            r.refusal(),
            "a device replace of devid 2 is 43.9% done (started): finish it with a kernel mount"
        );
        assert!(item(DEV_REPLACE_STATE_SUSPENDED, 0, 1 << 30).is_ongoing());
        for s in [
            DEV_REPLACE_STATE_NEVER_STARTED,
            DEV_REPLACE_STATE_FINISHED,
            DEV_REPLACE_STATE_CANCELED,
        ] {
            assert!(!item(s, 5 << 20, 1 << 30).is_ongoing(), "state {s}");
        }
        assert_eq!(item(DEV_REPLACE_STATE_FINISHED, 0, 1 << 30).progress_permille(), 1000);
        assert_eq!(item(DEV_REPLACE_STATE_STARTED, 5, 0).progress_permille(), 0);
    }
}
