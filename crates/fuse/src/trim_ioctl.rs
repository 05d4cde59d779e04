//! FITRIM through the mount (`fstrim MOUNTPOINT`): the kernel's FUSE passes it on as
//! a restricted ioctl whose size (24 bytes in, 24 out: `struct fstrim_range`) the
//! command number says, on any file or directory of the mount. The caller needs
//! CAP_SYS_ADMIN, as `btrfs_ioctl_fitrim` asks, and the daemon judges it from the
//! caller's `/proc/PID/status` (the request carries no capabilities); the rest, in the
//! kernel's order, is `Engine::fitrim`'s. As on the kernel's btrfs, a mount made
//! read-only (`-o ro`) answers with 0 bytes trimmed and discards nothing, one
//! remounted read-only still trims (free space is not the filesystem's contents), and
//! one with `rescue=nologreplay` (`norecovery`) refuses with EROFS.

use crate::fs::UbtrfsFs;
use fuser::Request;
use ubtrfs_core::{Error, FstrimRange, PosixKind, Result};

/// FITRIM: `_IOWR('X', 121, struct fstrim_range)`.
pub const FITRIM: u32 = 0xc018_5879;
/// `sizeof(struct fstrim_range)`: start, len, minlen.
const FSTRIM_RANGE_SIZE: usize = 24;

/// CAP_SYS_ADMIN's bit in a capability set.
const CAP_SYS_ADMIN: u32 = 21;

/// Whether the process `pid` (as the request names it; 0 when it lives in a pid
/// namespace the daemon cannot see) holds CAP_SYS_ADMIN in the initial user namespace,
/// as `capable()` asks. Where its status cannot be read, root (uid 0) is taken to.
fn caller_is_admin(pid: u32, uid: u32) -> bool {
    if pid == 0 {
        return uid == 0;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return uid == 0;
    };
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    if caps & (1 << CAP_SYS_ADMIN) == 0 {
        return false;
    }
    // A capability inside a user namespace of its own (`unshare -r`) is not one in
    // the initial namespace; where init's namespace cannot be read, it is not asked.
    match (
        std::fs::read_link(format!("/proc/{pid}/ns/user")),
        std::fs::read_link("/proc/1/ns/user"),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => true,
    }
}

fn u64_at(d: &[u8], i: usize) -> u64 {
    u64::from_ne_bytes(d[i * 8..i * 8 + 8].try_into().expect("eight bytes"))
}

impl UbtrfsFs {
    /// FITRIM on the mount: trim, and return the range with `len` set to the bytes
    /// discarded.
    ///
    /// # Errors
    /// `Posix(NotPermitted)` for a caller without CAP_SYS_ADMIN (EPERM, before the
    /// argument is read); `Posix(ReadOnly)` on a `rescue=nologreplay` mount;
    /// `Posix(Invalid)` for an argument shorter than `struct
    /// fstrim_range`; as `Engine::fitrim`.
    pub(crate) fn fitrim_ioctl(
        &self,
        req: &Request,
        in_data: &[u8],
        out_size: u32,
    ) -> Result<Vec<u8>> {
        if !caller_is_admin(req.pid(), req.uid()) {
            return Err(Error::posix_detail(
                PosixKind::NotPermitted,
                "FITRIM",
                "the caller lacks CAP_SYS_ADMIN",
            ));
        }
        // The log tree's extents are not in the free space until it is replayed.
        if self.opts.nologreplay {
            return Err(Error::posix_detail(
                PosixKind::ReadOnly,
                "FITRIM",
                "mounted with rescue=nologreplay",
            ));
        }
        let d = in_data.get(..FSTRIM_RANGE_SIZE).ok_or_else(|| {
            Error::posix_detail(
                PosixKind::Invalid,
                "FITRIM",
                "argument shorter than struct fstrim_range",
            )
        })?;
        let range = FstrimRange { start: u64_at(d, 0), len: u64_at(d, 1), minlen: u64_at(d, 2) };
        let r = self.engine.fitrim(range)?;
        let mut out = Vec::with_capacity(FSTRIM_RANGE_SIZE);
        for v in [r.start, r.len, r.minlen] {
            out.extend_from_slice(&v.to_ne_bytes());
        }
        out.truncate(out_size as usize);
        Ok(out)
    }
}
