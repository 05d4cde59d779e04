//! Permission checks as the VFS makes them, for callers that ask the core to check (a
//! mount without `default_permissions`, a tool acting for another user): who may read,
//! write or search an inode (`generic_permission` with `acl_permission_check` and
//! `posix_acl_permission`), and who may change which attributes (`setattr_prepare`).
//!
//! A caller is a `Cred`: fsuid, fsgid, supplementary groups, and whether it holds the
//! capabilities root holds (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER,
//! CAP_CHOWN, CAP_FSETID). The engine's own calls do not check: they act as root.

use crate::error::{Error, PosixKind, Result};
#[cfg(any(test, feature = "test-hooks"))]
use crate::inode::attr::{SetAttr, TimeSet};
use crate::inode::xattr::{
    AclEntry, ACL_GROUP, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER, ACL_USER, ACL_USER_OBJ,
};
use ubtrfs_format::structs::*;

pub const MAY_EXEC: u32 = 1;
pub const MAY_WRITE: u32 = 2;
#[cfg(any(test, feature = "test-hooks"))]
pub const MAY_READ: u32 = 4;

/// Who asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cred {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// Holds root's capabilities (DAC override, fowner, chown, fsetid).
    pub privileged: bool,
}

impl Cred {
    /// Root: uid 0 with every capability.
    pub fn root() -> Cred {
        Cred { uid: 0, gid: 0, groups: Vec::new(), privileged: true }
    }

    /// An unprivileged user.
    pub fn user(uid: u32, gid: u32, groups: &[u32]) -> Cred {
        Cred { uid, gid, groups: groups.to_vec(), privileged: uid == 0 }
    }

    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}

/// The owner of a new inode made by `uid`/`gid` in directory `dir` with `mode` (the
/// kernel's `inode_init_owner`): the creator owns it, except that a set-group-ID
/// directory passes on its group, and to a new directory its set-group-ID bit too.
/// `mode` is what the VFS passes down: the umask and `mode_strip_sgid` already applied.
pub fn inode_init_owner(
    dir: &InodeItem,
    uid: u32,
    gid: u32,
    mode: u32,
) -> crate::inode::write::InodeAttrs {
    let mut a = crate::inode::write::InodeAttrs::new(mode);
    a.uid = uid;
    a.gid = gid;
    const S_ISGID: u32 = 0o2000;
    if dir.mode.get() & S_ISGID != 0 {
        a.gid = dir.gid.get();
        if mode & S_IFMT == S_IFDIR {
            a.mode |= S_ISGID;
        }
    }
    a
}

/// Inode `id`'s access ACL (`system.posix_acl_access`), parsed; None without one.
///
/// # Errors
/// Read failures; `Posix(Invalid)` for an ACL that does not parse.
pub fn access_acl<V: crate::inode::filesystem::FsRead>(
    fs: &V,
    id: crate::inode::filesystem::InodeId,
) -> Result<Option<Vec<AclEntry>>> {
    read_acl(fs, id, crate::inode::xattr::XATTR_POSIX_ACL_ACCESS)
}

/// Inode `id`'s ACL `name` (access or default), parsed; None without one.
///
/// # Errors
/// Read failures; `Posix(Invalid)` for an ACL that does not parse.
pub fn read_acl<V: crate::inode::filesystem::FsRead>(
    fs: &V,
    id: crate::inode::filesystem::InodeId,
    name: &[u8],
) -> Result<Option<Vec<AclEntry>>> {
    use crate::inode::xattr::XattrRead;
    match fs.getxattr(id, name) {
        Ok(v) => crate::inode::xattr::acl_from_xattr(id, name, &v),
        Err(e) if e.posix_kind() == Some(PosixKind::NoData) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether `cred` may access inode `ii` (its access ACL, when it has one, in `acl`)
/// for `mask` (MAY_READ | MAY_WRITE | MAY_EXEC). A write to an immutable inode is EPERM
/// (`inode_permission`); a refusal otherwise is EACCES.
///
/// # Errors
/// `Posix` NotPermitted or PermissionDenied, naming `what`.
pub fn check_access(
    cred: &Cred,
    ii: &InodeItem,
    acl: Option<&[AclEntry]>,
    mask: u32,
    what: &str,
) -> Result<()> {
    if mask & MAY_WRITE != 0 && ii.flags.get() & INODE_IMMUTABLE != 0 {
        return Err(Error::posix_detail(
            PosixKind::NotPermitted,
            what.to_string(),
            "it is immutable",
        ));
    }
    if dac_allows(cred, ii, acl, mask) || cap_overrides(cred, ii, mask) {
        return Ok(());
    }
    Err(Error::posix(PosixKind::PermissionDenied, what.to_string()))
}

/// `acl_permission_check`: the mode bits of the caller's class, or the ACL.
fn dac_allows(cred: &Cred, ii: &InodeItem, acl: Option<&[AclEntry]>, mask: u32) -> bool {
    let mode = ii.mode.get();
    let want = mask & 7;
    if cred.uid == ii.uid.get() {
        return want & !(mode >> 6) == 0;
    }
    if let Some(acl) = acl {
        if mode & 0o070 != 0 {
            return acl_allows(cred, ii, acl, want);
        }
    }
    let bits = if cred.in_group(ii.gid.get()) { mode >> 3 } else { mode };
    want & !bits & 7 == 0
}

/// `posix_acl_permission` (the owner was handled before).
fn acl_allows(cred: &Cred, ii: &InodeItem, acl: &[AclEntry], want: u32) -> bool {
    let want = want as u16;
    let mask_perm = acl.iter().find(|e| e.tag == ACL_MASK).map(|e| e.perm);
    let masked = |perm: u16| perm & mask_perm.unwrap_or(7) & want == want;
    let mut found = false;
    for e in acl {
        match e.tag {
            ACL_USER_OBJ if cred.uid == ii.uid.get() => return e.perm & want == want,
            ACL_USER if e.id == cred.uid => return masked(e.perm),
            ACL_GROUP_OBJ if cred.in_group(ii.gid.get()) => {
                found = true;
                if e.perm & want == want {
                    return masked(e.perm);
                }
            }
            ACL_GROUP if cred.in_group(e.id) => {
                found = true;
                if e.perm & want == want {
                    return masked(e.perm);
                }
            }
            ACL_OTHER => return !found && e.perm & want == want,
            _ => {}
        }
    }
    false
}

/// The capabilities' part of `generic_permission`.
fn cap_overrides(cred: &Cred, ii: &InodeItem, mask: u32) -> bool {
    if !cred.privileged {
        return false;
    }
    let mode = ii.mode.get();
    if mode & S_IFMT == S_IFDIR {
        // Directories: search and read always; write with DAC override.
        return true;
    }
    // Read and write always; execute when someone may execute.
    mask & MAY_EXEC == 0 || mode & 0o111 != 0
}

/// Whether `cred` may make change `a` to inode `ii` (`setattr_prepare`), and what the
/// change becomes: a mode set by someone outside the file's group and without
/// CAP_FSETID loses set-group-ID (`setattr_copy`), and so does a chown's non-directory
/// whose group may not execute (`setattr_should_drop_sgid`: `SetAttr::setattr` drops
/// it only when the group may execute).
///
/// # Errors
/// `Posix(NotPermitted)` for a chown, chgrp, chmod or explicit time set the caller may
/// not make, and for a chown without ids by someone else than the owner of a file
/// that would lose set-user-ID or set-group-ID (the kill bits become a mode change);
/// `Posix(PermissionDenied)` for times set to now without write access.
#[cfg(any(test, feature = "test-hooks"))]
pub fn may_setattr(
    cred: &Cred,
    ii: &InodeItem,
    acl: Option<&[AclEntry]>,
    a: &SetAttr,
    what: &str,
) -> Result<SetAttr> {
    let owner = cred.uid == ii.uid.get() || cred.privileged;
    let denied = |why: &str| {
        Err(Error::posix_detail(PosixKind::NotPermitted, what.to_string(), why.to_string()))
    };
    if let Some(u) = a.uid {
        if !(cred.privileged || (cred.uid == ii.uid.get() && u == ii.uid.get())) {
            return denied("only root may give a file away");
        }
    }
    if let Some(g) = a.gid {
        let may = cred.privileged
            || (cred.uid == ii.uid.get()
                && (a.uid.is_none() || a.uid == Some(ii.uid.get()))
                && (g == ii.gid.get() || cred.in_group(g)));
        if !may {
            return denied("only the owner may change the group, to one of its own groups");
        }
    }
    let mut out = *a;
    if let Some(m) = a.mode {
        if !owner {
            return denied("only the owner may change the mode");
        }
        let gid = a.gid.unwrap_or(ii.gid.get());
        if !cred.privileged && !cred.in_group(gid) {
            out.mode = Some(m & !0o2000);
        }
    }
    let m = a.mode.unwrap_or(ii.mode.get());
    if a.kills_privs() && ii.mode.get() & S_IFMT != S_IFDIR {
        // Set-group-ID without group execute marks mandatory locking and stays, unless
        // the caller is outside the group without CAP_FSETID.
        let outsider_sgid =
            m & 0o2010 == 0o2000 && !(cred.privileged || cred.in_group(ii.gid.get()));
        let kills = m & 0o4000 != 0 || m & 0o2010 == 0o2010 || outsider_sgid;
        if kills && !owner {
            return denied("only the owner may lose a file's set-user-ID or set-group-ID");
        }
        if outsider_sgid {
            out.mode = Some(m & 0o7777 & !0o2000);
        }
    }
    let explicit = matches!(a.atime, Some(TimeSet::At(..)))
        || matches!(a.mtime, Some(TimeSet::At(..)))
        || a.ctime.is_some();
    if explicit && !owner {
        return denied("only the owner may set the times");
    }
    if !explicit && (a.atime.is_some() || a.mtime.is_some()) && !owner {
        check_access(cred, ii, acl, MAY_WRITE, what)?;
    }
    if a.size.is_some() {
        check_access(cred, ii, acl, MAY_WRITE, what)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerocopy::FromZeros;

    fn inode(mode: u32, uid: u32, gid: u32) -> InodeItem {
        let mut i = InodeItem::new_zeroed();
        i.mode = mode.into();
        i.uid = uid.into();
        i.gid = gid.into();
        i
    }

    #[test]
    fn classes_and_root() {
        let f = inode(S_IFREG | 0o640, 1000, 100);
        let owner = Cred::user(1000, 1000, &[]);
        let member = Cred::user(2000, 2000, &[100]);
        let other = Cred::user(3000, 3000, &[]);
        assert!(check_access(&owner, &f, None, MAY_READ | MAY_WRITE, "f").is_ok());
        assert!(check_access(&owner, &f, None, MAY_EXEC, "f").is_err());
        assert!(check_access(&member, &f, None, MAY_READ, "f").is_ok());
        assert_eq!(
            check_access(&member, &f, None, MAY_WRITE, "f").unwrap_err().posix_kind(),
            Some(PosixKind::PermissionDenied)
        );
        assert!(check_access(&other, &f, None, MAY_READ, "f").is_err());
        // The owner's class decides, even when others have more.
        let odd = inode(S_IFREG | 0o007, 1000, 100);
        assert!(check_access(&owner, &odd, None, MAY_READ, "f").is_err());
        assert!(check_access(&other, &odd, None, MAY_READ, "f").is_ok());
        // Root reads and writes anything, executes what someone may execute.
        assert!(check_access(&Cred::root(), &f, None, MAY_READ | MAY_WRITE, "f").is_ok());
        assert!(check_access(&Cred::root(), &f, None, MAY_EXEC, "f").is_err());
        assert!(
            check_access(&Cred::root(), &inode(S_IFREG | 0o001, 5, 5), None, MAY_EXEC, "f").is_ok()
        );
        assert!(check_access(
            &Cred::root(),
            &inode(S_IFDIR, 5, 5),
            None,
            MAY_EXEC | MAY_WRITE,
            "d"
        )
        .is_ok());
        let mut frozen = f;
        frozen.flags = INODE_IMMUTABLE.into();
        assert_eq!(
            check_access(&Cred::root(), &frozen, None, MAY_WRITE, "f").unwrap_err().posix_kind(),
            Some(PosixKind::NotPermitted)
        );
    }

    #[test]
    fn acls() {
        let f = inode(S_IFREG | 0o640, 1000, 100);
        let e = |tag, perm, id| AclEntry { tag, perm, id };
        // user 3000 gets rw through a named entry, masked to r.
        let acl = [
            e(ACL_USER_OBJ, 6, u32::MAX),
            e(ACL_USER, 6, 3000),
            e(ACL_GROUP_OBJ, 4, u32::MAX),
            e(ACL_MASK, 4, u32::MAX),
            e(ACL_OTHER, 0, u32::MAX),
        ];
        let named = Cred::user(3000, 3000, &[]);
        assert!(check_access(&named, &f, Some(&acl), MAY_READ, "f").is_ok());
        assert!(check_access(&named, &f, Some(&acl), MAY_WRITE, "f").is_err());
        assert!(check_access(&Cred::user(4000, 4000, &[]), &f, Some(&acl), MAY_READ, "f").is_err());
        // A group member whose groups grant nothing wanted is refused, not sent to other.
        let acl2 = [
            e(ACL_USER_OBJ, 6, u32::MAX),
            e(ACL_GROUP_OBJ, 0, u32::MAX),
            e(ACL_MASK, 7, u32::MAX),
            e(ACL_OTHER, 4, u32::MAX),
        ];
        assert!(
            check_access(&Cred::user(2000, 2000, &[100]), &f, Some(&acl2), MAY_READ, "f").is_err()
        );
    }

    #[test]
    fn setattr_rules() {
        let f = inode(S_IFREG | 0o2755, 1000, 100);
        let owner = Cred::user(1000, 1000, &[100, 200]);
        let other = Cred::user(3000, 3000, &[]);
        let s = |a: SetAttr| a;
        assert!(may_setattr(
            &owner,
            &f,
            None,
            &s(SetAttr { uid: Some(0), ..Default::default() }),
            "f"
        )
        .is_err());
        assert!(may_setattr(
            &owner,
            &f,
            None,
            &s(SetAttr { gid: Some(200), ..Default::default() }),
            "f"
        )
        .is_ok());
        assert!(may_setattr(
            &owner,
            &f,
            None,
            &s(SetAttr { gid: Some(300), ..Default::default() }),
            "f"
        )
        .is_err());
        assert!(may_setattr(
            &other,
            &f,
            None,
            &s(SetAttr { mode: Some(0o777), ..Default::default() }),
            "f"
        )
        .is_err());
        assert!(may_setattr(
            &other,
            &f,
            None,
            &s(SetAttr { mtime: Some(TimeSet::At(1, 0)), ..Default::default() }),
            "f"
        )
        .is_err());
        // Touch to now needs write access only.
        assert_eq!(
            may_setattr(
                &other,
                &f,
                None,
                &s(SetAttr { mtime: Some(TimeSet::Now), ..Default::default() }),
                "f"
            )
            .unwrap_err()
            .posix_kind(),
            Some(PosixKind::PermissionDenied)
        );
        // chmod g+s by an owner outside the group drops set-group-ID.
        let g = inode(S_IFREG | 0o755, 1000, 999);
        assert_eq!(
            may_setattr(
                &owner,
                &g,
                None,
                &s(SetAttr { mode: Some(0o2755), ..Default::default() }),
                "f"
            )
            .unwrap()
            .mode,
            Some(0o755)
        );
        assert_eq!(
            may_setattr(
                &Cred::root(),
                &g,
                None,
                &s(SetAttr { mode: Some(0o2755), uid: Some(5), ..Default::default() }),
                "f"
            )
            .unwrap()
            .mode,
            Some(0o2755)
        );
        // chown(-1, -1): by anyone when there is nothing to kill; of a set-user-ID
        // file only by its owner; a set-group-ID file whose group may not execute
        // loses the bit when the caller is outside the group.
        let plain = inode(S_IFREG | 0o644, 1000, 100);
        assert_eq!(
            may_setattr(&other, &plain, None, &SetAttr::chown(None, None), "f").unwrap(),
            SetAttr::chown(None, None)
        );
        let suid = inode(S_IFREG | 0o4755, 1000, 100);
        assert_eq!(
            may_setattr(&other, &suid, None, &SetAttr::chown(None, None), "f")
                .unwrap_err()
                .posix_kind(),
            Some(PosixKind::NotPermitted)
        );
        assert!(may_setattr(&owner, &suid, None, &SetAttr::chown(None, None), "f").is_ok());
        let sgid_nx = inode(S_IFREG | 0o2745, 1000, 999);
        assert_eq!(
            may_setattr(&owner, &sgid_nx, None, &SetAttr::chown(None, None), "f").unwrap().mode,
            Some(0o745)
        );
        assert_eq!(
            may_setattr(&Cred::root(), &sgid_nx, None, &SetAttr::chown(None, None), "f")
                .unwrap()
                .mode,
            None
        );
        assert_eq!(
            may_setattr(&other, &sgid_nx, None, &SetAttr::chown(None, None), "f")
                .unwrap_err()
                .posix_kind(),
            Some(PosixKind::NotPermitted)
        );
        // A directory keeps its bits; nobody's chown without ids is refused.
        let dir = inode(S_IFDIR | 0o6755, 1000, 999);
        assert!(may_setattr(&other, &dir, None, &SetAttr::chown(None, None), "d").is_ok());
    }
}
