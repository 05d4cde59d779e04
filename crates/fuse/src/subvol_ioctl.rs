//! The btrfs subvolume ioctls through the mount: the same requests, argument structs
//! and checks as the kernel's (`btrfs_ioctl_subvol_create`, `..._snap_create_v2`,
//! `..._snap_destroy`, `..._default_subvol`, `..._subvol_getflags/setflags`), so a
//! program that calls them on a btrfs directory calls them here the same way. (btrfs-
//! progs refuses a FUSE mount before it asks: its statfs f_type check. `ubtrfs
//! subvolume` with a mount point in place of an image uses these.)
//!
//! FUSE carries them as restricted ioctls: the sizes in the command numbers (4096
//! bytes for `btrfs_ioctl_vol_args` and `_v2`) say what the kernel copies in and out.
//! A snapshot names its source by a file descriptor of the caller; the daemon finds it
//! through `/proc/PID/fd/N` (the inode number the kernel reports is ours, and its
//! device must be this mount's).

use crate::fs::UbtrfsFs;
use crate::ino::FuseIno;
use crate::options::IdMap;
use fuser::Request;
use ubtrfs_core::{
    access_acl, check_access, Cred, Error, FsRead, InodeAttrs, InodeId, Load, PosixKind, Result,
    MAY_EXEC, MAY_WRITE,
};
use ubtrfs_format::key::FIRST_FREE_OBJECTID;

/// The btrfs ioctl type byte (`BTRFS_IOCTL_MAGIC`).
pub const BTRFS_IOCTL_MAGIC: u32 = 0x94;

const fn iow(nr: u32, size: u32) -> u32 {
    (1 << 30) | (size << 16) | (BTRFS_IOCTL_MAGIC << 8) | nr
}
const fn ior(nr: u32, size: u32) -> u32 {
    (2 << 30) | (size << 16) | (BTRFS_IOCTL_MAGIC << 8) | nr
}
const fn iowr(nr: u32, size: u32) -> u32 {
    (3 << 30) | (size << 16) | (BTRFS_IOCTL_MAGIC << 8) | nr
}
const fn io(nr: u32) -> u32 {
    (BTRFS_IOCTL_MAGIC << 8) | nr
}

/// `struct btrfs_ioctl_vol_args`: fd, then the name (4088 bytes).
pub const VOL_ARGS_SIZE: u32 = 4096;
/// `struct btrfs_ioctl_vol_args_v2`: fd, transid, flags, 32 bytes of size/qgroup
/// inherit, then the name (4040 bytes) or a subvolume id.
pub const VOL_ARGS_V2_SIZE: u32 = 4096;
const V2_NAME_AT: usize = 56;

pub const BTRFS_IOC_SNAP_CREATE: u32 = iow(1, VOL_ARGS_SIZE);
pub const BTRFS_IOC_SYNC: u32 = io(8);
pub const BTRFS_IOC_SUBVOL_CREATE: u32 = iow(14, VOL_ARGS_SIZE);
pub const BTRFS_IOC_SNAP_DESTROY: u32 = iow(15, VOL_ARGS_SIZE);
pub const BTRFS_IOC_INO_LOOKUP: u32 = iowr(18, 4096);
pub const BTRFS_IOC_DEFAULT_SUBVOL: u32 = iow(19, 8);
pub const BTRFS_IOC_SNAP_CREATE_V2: u32 = iow(23, VOL_ARGS_V2_SIZE);
pub const BTRFS_IOC_SUBVOL_CREATE_V2: u32 = iow(24, VOL_ARGS_V2_SIZE);
pub const BTRFS_IOC_SUBVOL_GETFLAGS: u32 = ior(25, 8);
pub const BTRFS_IOC_SUBVOL_SETFLAGS: u32 = iow(26, 8);
pub const BTRFS_IOC_SNAP_DESTROY_V2: u32 = iow(63, VOL_ARGS_V2_SIZE);

/// `BTRFS_SUBVOL_RDONLY`, `_QGROUP_INHERIT`, `_SPEC_BY_ID`.
pub const BTRFS_SUBVOL_RDONLY: u64 = 1 << 1;
pub const BTRFS_SUBVOL_QGROUP_INHERIT: u64 = 1 << 2;
pub const BTRFS_SUBVOL_SPEC_BY_ID: u64 = 1 << 4;

fn invalid(what: &str, why: &str) -> Error {
    Error::posix_detail(PosixKind::Invalid, what.to_string(), why.to_string())
}

/// The NUL-terminated name in `field` (the kernel's checks: not empty, no `/`, not
/// `.` or `..`).
fn name_in(field: &[u8]) -> Result<&[u8]> {
    let n = field
        .iter()
        .position(|&b| b == 0)
        .ok_or_else(|| invalid("subvolume name", "not NUL-terminated"))?;
    let name = &field[..n];
    if name.is_empty() || name.contains(&b'/') || name == b"." || name == b".." {
        return Err(invalid(&String::from_utf8_lossy(name), "not a valid subvolume name"));
    }
    Ok(name)
}

/// The name and flags of a `vol_args` (`v1`: flags 0) or `vol_args_v2` argument.
fn vol_name(in_data: &[u8], v1: bool) -> Result<(&[u8], u64)> {
    if v1 {
        return Ok((name_in(in_data.get(8..).unwrap_or_default())?, 0));
    }
    Ok((name_in(in_data.get(V2_NAME_AT..).unwrap_or_default())?, u64_at(in_data, 16)?))
}

fn u64_at(d: &[u8], at: usize) -> Result<u64> {
    d.get(at..at + 8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("eight bytes")))
        .ok_or_else(|| invalid("ioctl argument", "too short"))
}

impl UbtrfsFs {
    /// The caller as a credential for the kernel's permission checks.
    fn cred_of(&self, req: &Request) -> Cred {
        let groups = crate::fs::caller_creds(req.pid())
            .1
            .into_iter()
            .map(|g| IdMap::store(self.opts.gid, g))
            .collect();
        Cred {
            uid: IdMap::store(self.opts.uid, req.uid()),
            gid: IdMap::store(self.opts.gid, req.gid()),
            groups,
            privileged: req.uid() == 0,
        }
    }

    /// `may_create` of a new entry in `dir`: write and search permission.
    fn may_create_in(&self, req: &Request, dir: InodeId, name: &[u8]) -> Result<()> {
        let (ii, acl) =
            self.engine.read(|l| Ok((l.load_inode(dir, Load::ITEM)?.item, access_acl(l, dir)?)))?;
        check_access(
            &self.cred_of(req),
            &ii,
            acl.as_deref(),
            MAY_WRITE | MAY_EXEC,
            &String::from_utf8_lossy(name),
        )
    }

    /// The subvolume a caller's file descriptor `fd` names: its top directory, on this
    /// mount (EXDEV otherwise).
    ///
    /// Read from /proc (the descriptor's mount and inode number, the mount's device),
    /// never by a stat of the descriptor or of the mount point: that would be a request
    /// to this mount, which the thread serving this one may be the only one to take (an
    /// io_uring queue serves its CPU's requests on one thread).
    fn subvol_of_fd(&self, req: &Request, fd: i64) -> Result<InodeId> {
        let what = format!("source descriptor {fd} of process {}", req.pid());
        let (dev, ino) = fd_dev_ino(req.pid(), fd).map_err(|e| Error::io(what.clone(), e))?;
        let ours = crate::session::mount_dev(&self.mountpoint).ok_or_else(|| {
            Error::io(
                format!("the mount point {}", self.mountpoint.display()),
                std::io::Error::other("not in the mount table"),
            )
        })?;
        if dev != ours {
            return Err(Error::posix_detail(
                PosixKind::CrossDevice,
                what,
                "it is not on this mount",
            ));
        }
        let id = self.map.from_fuse(FuseIno(ino))?;
        // A subvolume's top (FIRST_FREE_OBJECTID) is always a directory.
        if id.ino != FIRST_FREE_OBJECTID {
            return Err(invalid(&what, "not a subvolume"));
        }
        Ok(id)
    }

    /// Tell the kernel that `name` in `dir` changed (its dentry, or a negative one).
    fn invalidate_entry(&self, dir: InodeId, name: &[u8]) {
        if let (Some(n), Ok(ino)) = (self.notifier.get(), self.map.to_fuse(dir)) {
            let _ = n.inval_entry(
                fuser::INodeNo(ino.0),
                <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(name),
            );
        }
    }

    /// A btrfs ioctl on inode `id`. Returns what goes back to the caller's argument.
    pub(crate) fn btrfs_ioctl(
        &self,
        req: &Request,
        id: InodeId,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
    ) -> Result<Vec<u8>> {
        match cmd {
            BTRFS_IOC_SUBVOL_CREATE | BTRFS_IOC_SUBVOL_CREATE_V2 => {
                self.writable()?;
                let (name, flags) = vol_name(in_data, cmd == BTRFS_IOC_SUBVOL_CREATE)?;
                if flags & BTRFS_SUBVOL_QGROUP_INHERIT != 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotSupported,
                        "subvolume create",
                        "qgroup inheritance is not supported yet",
                    ));
                }
                self.may_create_in(req, id, name)?;
                let mut a = InodeAttrs::new(0o755);
                a.uid = IdMap::store(self.opts.uid, req.uid());
                a.gid = IdMap::store(self.opts.gid, req.gid());
                self.engine.create_subvol(id, name, &a)?;
                self.invalidate_entry(id, name);
                Ok(Vec::new())
            }
            BTRFS_IOC_SNAP_CREATE | BTRFS_IOC_SNAP_CREATE_V2 => {
                self.writable()?;
                let fd = u64_at(in_data, 0)? as i64;
                let (name, flags) = vol_name(in_data, cmd == BTRFS_IOC_SNAP_CREATE)?;
                if flags & BTRFS_SUBVOL_QGROUP_INHERIT != 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotSupported,
                        "snapshot",
                        "qgroup inheritance is not supported yet",
                    ));
                }
                if flags & !(BTRFS_SUBVOL_RDONLY | BTRFS_SUBVOL_QGROUP_INHERIT) != 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotSupported,
                        "snapshot",
                        format!("flags {flags:#x}"),
                    ));
                }
                self.may_create_in(req, id, name)?;
                let src = self.subvol_of_fd(req, fd)?;
                // Snapshots are limited to one's own subvolumes (`inode_owner_or_capable`).
                let owner = self.engine.getattr(src)?.uid.get();
                if req.uid() != 0 && owner != IdMap::store(self.opts.uid, req.uid()) {
                    return Err(Error::posix_detail(
                        PosixKind::NotPermitted,
                        format!("subvolume {}", src.root),
                        "only its owner snapshots it",
                    ));
                }
                self.engine.create_snapshot(
                    src.root,
                    id,
                    name,
                    flags & BTRFS_SUBVOL_RDONLY != 0,
                )?;
                self.invalidate_entry(id, name);
                Ok(Vec::new())
            }
            BTRFS_IOC_SNAP_DESTROY | BTRFS_IOC_SNAP_DESTROY_V2 => {
                self.writable()?;
                if cmd == BTRFS_IOC_SNAP_DESTROY_V2
                    && u64_at(in_data, 16)? & BTRFS_SUBVOL_SPEC_BY_ID != 0
                {
                    return Err(Error::posix_detail(
                        PosixKind::NotSupported,
                        "subvolume delete",
                        "by id: give the name in its directory",
                    ));
                }
                let (name, _) = vol_name(in_data, cmd == BTRFS_IOC_SNAP_DESTROY)?;
                // The kernel lets others delete only with user_subvol_rm_allowed.
                if req.uid() != 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotPermitted,
                        String::from_utf8_lossy(name).into_owned(),
                        "deleting a subvolume needs CAP_SYS_ADMIN",
                    ));
                }
                self.engine.delete_subvol(id, name)?;
                self.invalidate_entry(id, name);
                self.kick_cleaner();
                Ok(Vec::new())
            }
            BTRFS_IOC_DEFAULT_SUBVOL => {
                self.writable()?;
                if req.uid() != 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotPermitted,
                        "default subvolume",
                        "setting it needs CAP_SYS_ADMIN",
                    ));
                }
                let sub = u64_at(in_data, 0)?;
                self.engine.set_default_subvol(if sub == 0 {
                    ubtrfs_format::key::FS_TREE_OBJECTID
                } else {
                    sub
                })?;
                Ok(Vec::new())
            }
            BTRFS_IOC_SUBVOL_GETFLAGS => {
                let ro = self.engine.read(|l| {
                    Ok(ubtrfs_core::TreeView::read_root(l, id.root)?.1.flags.get()
                        & ubtrfs_format::structs::ROOT_SUBVOL_RDONLY
                        != 0)
                })?;
                let f: u64 = if ro { BTRFS_SUBVOL_RDONLY } else { 0 };
                Ok(f.to_le_bytes()[..(out_size as usize).min(8)].to_vec())
            }
            BTRFS_IOC_SUBVOL_SETFLAGS => {
                self.writable()?;
                let f = u64_at(in_data, 0)?;
                if f & !BTRFS_SUBVOL_RDONLY != 0 {
                    return Err(Error::posix_detail(
                        PosixKind::NotSupported,
                        "subvolume flags",
                        format!("{f:#x}"),
                    ));
                }
                if id.ino != FIRST_FREE_OBJECTID {
                    return Err(invalid(&id.to_string(), "not the top directory of a subvolume"));
                }
                let owner = self.engine.getattr(id)?.uid.get();
                if req.uid() != 0 && owner != IdMap::store(self.opts.uid, req.uid()) {
                    return Err(Error::posix_detail(
                        PosixKind::NotPermitted,
                        format!("subvolume {}", id.root),
                        "only its owner changes its flags",
                    ));
                }
                self.engine.set_subvol_readonly(id.root, f & BTRFS_SUBVOL_RDONLY != 0)?;
                Ok(Vec::new())
            }
            BTRFS_IOC_INO_LOOKUP => {
                // `struct btrfs_ioctl_ino_lookup_args`: treeid, objectid, name. Tree 0
                // asks for the tree of the inode the ioctl is on (`btrfs inspect-internal
                // rootid`); the path of another objectid is not looked up here.
                let tree = u64_at(in_data, 0)?;
                let objectid = u64_at(in_data, 8)?;
                if objectid != FIRST_FREE_OBJECTID {
                    return Err(Error::posix_detail(
                        PosixKind::NotSupported,
                        "ino lookup",
                        format!("the path of objectid {objectid}"),
                    ));
                }
                let mut out = vec![0u8; (out_size as usize).min(4096)];
                if out.len() >= 16 {
                    out[..8]
                        .copy_from_slice(&(if tree == 0 { id.root } else { tree }).to_le_bytes());
                    out[8..16].copy_from_slice(&objectid.to_le_bytes());
                }
                Ok(out)
            }
            BTRFS_IOC_SYNC => {
                self.engine.sync()?;
                Ok(Vec::new())
            }
            _ => Err(Error::posix_detail(
                PosixKind::NotSupported,
                id.to_string(),
                format!("btrfs ioctl {cmd:#x}"),
            )),
        }
    }
}

/// The device (of its mount, from the process's mountinfo) and inode number of process
/// `pid`'s descriptor `fd`, from /proc/PID/fdinfo: no request to any filesystem.
fn fd_dev_ino(pid: u32, fd: i64) -> std::io::Result<(ubtrfs_core::mountinfo::DevNum, u64)> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))?;
    let field = |name: &str| {
        info.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<u64>().ok())
    };
    let (Some(mnt_id), Some(ino)) = (field("mnt_id:"), field("ino:")) else {
        return Err(bad("fdinfo without mnt_id or ino"));
    };
    let table = std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
    let dev = table
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let id = f.next()?.parse::<u64>().ok()?;
            let _parent = f.next()?;
            (id == mnt_id).then(|| ubtrfs_core::mountinfo::parse_dev_num(f.next()?)).flatten()
        })
        .ok_or_else(|| bad("the descriptor's mount is not in its mountinfo"))?;
    Ok((dev, ino))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        // From linux/btrfs.h as the compiler lays them out on x86-64.
        assert_eq!(BTRFS_IOC_SNAP_CREATE, 0x5000_9401);
        assert_eq!(BTRFS_IOC_SYNC, 0x9408);
        assert_eq!(BTRFS_IOC_SUBVOL_CREATE, 0x5000_940e);
        assert_eq!(BTRFS_IOC_SNAP_DESTROY, 0x5000_940f);
        assert_eq!(BTRFS_IOC_INO_LOOKUP, 0xd000_9412);
        assert_eq!(BTRFS_IOC_DEFAULT_SUBVOL, 0x4008_9413);
        assert_eq!(BTRFS_IOC_SNAP_CREATE_V2, 0x5000_9417);
        assert_eq!(BTRFS_IOC_SUBVOL_CREATE_V2, 0x5000_9418);
        assert_eq!(BTRFS_IOC_SUBVOL_GETFLAGS, 0x8008_9419);
        assert_eq!(BTRFS_IOC_SUBVOL_SETFLAGS, 0x4008_941a);
        assert_eq!(BTRFS_IOC_SNAP_DESTROY_V2, 0x5000_943f);
    }

    #[test]
    fn names_are_checked_as_the_kernel_checks_them() {
        assert_eq!(name_in(b"snap\0rest").unwrap(), b"snap");
        for bad in [&b"\0"[..], b".\0", b"..\0", b"a/b\0", b"no-nul"] {
            assert!(name_in(bad).is_err(), "{bad:?}");
        }
    }
}
