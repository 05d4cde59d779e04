//! POSIX ACLs as fs/posix_acl.c carries them through an inode's life, beyond the
//! xattr handlers of `inode::xattr`: what a new inode inherits from its directory's
//! default ACL (`posix_acl_create`, with `posix_acl_create_masq`), and what a chmod
//! does to an access ACL (`posix_acl_chmod`, with `__posix_acl_chmod`).
//!
//! - A new inode in a directory without a default ACL gets `mode & !umask` and no
//!   ACL. In a directory with one, the umask does not apply: the default ACL, masked
//!   by the requested mode, becomes the access ACL (stored only when the mode cannot
//!   say it all: named entries or a mask), the mode takes the ACL's bits, and a new
//!   directory inherits the default ACL as its own. Symlinks get neither.
//! - A chmod of an inode with an access ACL rewrites the ACL's owner, group class
//!   (the mask when there is one, else the owning group) and other entries from the
//!   new mode, so that the two never disagree.
//!
//! Both run in the caller's transaction, beside the change they follow (the kernel's
//! `btrfs_init_acl` in the create's handle; the chmod's `posix_acl_chmod` after its
//! setattr), so a crash never leaves one without the other.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FsRead, InodeId, Load};
use crate::inode::perm::read_acl;
use crate::inode::writer::FsWriter;
use crate::inode::xattr::{
    acl_to_xattr, AclEntry, ACL_GROUP, ACL_GROUP_OBJ, ACL_MASK, ACL_OTHER, ACL_USER, ACL_USER_OBJ,
    XATTR_POSIX_ACL_ACCESS, XATTR_POSIX_ACL_DEFAULT,
};
use ubtrfs_format::structs::{S_IFDIR, S_IFLNK, S_IFMT};

/// What a new inode starts with: its mode, and the ACL xattrs to store beside it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewAcls {
    /// The mode to create the inode with (type bits kept).
    pub mode: u32,
    /// `system.posix_acl_access`'s value, when the inherited ACL says more than the mode.
    pub access: Option<Vec<u8>>,
    /// `system.posix_acl_default`'s value, for a directory made in a directory with one.
    pub default: Option<Vec<u8>>,
}

/// `posix_acl_create_masq`: mask `acl` (a copy of a default ACL) by `mode`'s
/// permission bits and fold the result back into `mode`. True when the ACL says more
/// than the mode (named entries or a mask), so it must be stored.
///
/// # Errors
/// `Posix(Invalid)` for an ACL with neither a mask nor an owning-group entry.
pub fn create_masq(acl: &mut [AclEntry], mode: &mut u32) -> Result<bool> {
    let mut m = *mode;
    let mut not_equiv = false;
    let (mut group_obj, mut mask_obj) = (None, None);
    for (i, e) in acl.iter_mut().enumerate() {
        let p = u32::from(e.perm);
        match e.tag {
            ACL_USER_OBJ => {
                let np = p & ((m >> 6) | !0o7);
                e.perm = np as u16;
                m &= (np << 6) | !0o700;
            }
            ACL_USER | ACL_GROUP => not_equiv = true,
            ACL_GROUP_OBJ => group_obj = Some(i),
            ACL_OTHER => {
                let np = p & (m | !0o7);
                e.perm = np as u16;
                m &= np | !0o7;
            }
            ACL_MASK => {
                mask_obj = Some(i);
                not_equiv = true;
            }
            _ => {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    "default ACL",
                    format!("entry tag {:#x}", e.tag),
                ))
            }
        }
    }
    let Some(class) = mask_obj.or(group_obj) else {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            "default ACL",
            "neither a mask nor an owning-group entry",
        ));
    };
    let e = &mut acl[class];
    let np = u32::from(e.perm) & ((m >> 3) | !0o7);
    e.perm = np as u16;
    m &= (np << 3) | !0o070;
    *mode = (*mode & !0o777) | (m & 0o777);
    Ok(not_equiv)
}

/// `__posix_acl_chmod`: the ACL's owner, group class and other entries from `mode`.
pub fn chmod_acl(acl: &mut [AclEntry], mode: u32) {
    let has_mask = acl.iter().any(|e| e.tag == ACL_MASK);
    for e in acl.iter_mut() {
        match e.tag {
            ACL_USER_OBJ => e.perm = ((mode >> 6) & 7) as u16,
            ACL_MASK => e.perm = ((mode >> 3) & 7) as u16,
            ACL_GROUP_OBJ if !has_mask => e.perm = ((mode >> 3) & 7) as u16,
            ACL_OTHER => e.perm = (mode & 7) as u16,
            _ => {}
        }
    }
}

impl FsWriter {
    /// `posix_acl_create`: the mode and ACLs of a new inode of `mode` (type and
    /// permission bits, set-group-ID already settled) made in directory `dir` by a
    /// caller with `umask`.
    ///
    /// # Errors
    /// Read failures; `Posix(Invalid)` for a directory default ACL that does not parse.
    pub fn acl_for_new_inode(&self, dir: InodeId, mode: u32, umask: u32) -> Result<NewAcls> {
        let no_acl = NewAcls { mode: mode & !(umask & 0o777), access: None, default: None };
        if mode & S_IFMT == S_IFLNK {
            return Ok(NewAcls { mode, access: None, default: None });
        }
        // A placeholder has no ACLs (nor takes new names: the create refuses).
        if dir.is_placeholder() {
            return Ok(no_acl);
        }
        let Some(default) = read_acl(&self.live(), dir, XATTR_POSIX_ACL_DEFAULT)? else {
            return Ok(no_acl);
        };
        let mut access = default.clone();
        let mut m = mode;
        let store = create_masq(&mut access, &mut m)?;
        Ok(NewAcls {
            mode: m,
            access: store.then(|| acl_to_xattr(&access)),
            default: (mode & S_IFMT == S_IFDIR).then(|| acl_to_xattr(&default)),
        })
    }

    /// Store a new inode's inherited ACLs (`btrfs_init_acl`), in the creating
    /// transaction.
    ///
    /// # Errors
    /// As `setxattr`.
    pub fn acl_init(&mut self, id: InodeId, acls: &NewAcls) -> Result<()> {
        if let Some(v) = &acls.default {
            self.setxattr(id, XATTR_POSIX_ACL_DEFAULT, v, 0)?;
        }
        if let Some(v) = &acls.access {
            self.setxattr(id, XATTR_POSIX_ACL_ACCESS, v, 0)?;
        }
        Ok(())
    }

    /// `posix_acl_chmod`: after inode `id`'s mode changed, bring its access ACL (if it
    /// has one) in line with the new mode.
    ///
    /// # Errors
    /// As `setxattr`.
    pub(crate) fn acl_chmod(&mut self, id: InodeId) -> Result<()> {
        let mode = self.live().load_inode(id, Load::ITEM)?.item.mode.get();
        if mode & S_IFMT == S_IFLNK {
            return Ok(());
        }
        let Some(mut acl) = read_acl(&self.live(), id, XATTR_POSIX_ACL_ACCESS)? else {
            return Ok(());
        };
        chmod_acl(&mut acl, mode);
        self.setxattr(id, XATTR_POSIX_ACL_ACCESS, &acl_to_xattr(&acl), 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(tag: u16, perm: u16, id: u32) -> AclEntry {
        AclEntry { tag, perm, id }
    }

    #[test]
    fn create_masq_folds_the_mode_in() {
        // Base entries only: equivalent to a mode, nothing to store.
        let mut acl = vec![
            e(ACL_USER_OBJ, 7, u32::MAX),
            e(ACL_GROUP_OBJ, 5, u32::MAX),
            e(ACL_OTHER, 5, u32::MAX),
        ];
        let mut mode = 0o100_666;
        assert!(!create_masq(&mut acl, &mut mode).unwrap());
        assert_eq!(mode, 0o100_644);
        assert_eq!(acl.iter().map(|e| e.perm).collect::<Vec<_>>(), [6, 4, 4]);
        // A named user and a mask: stored; the mask takes the group class of the mode.
        let mut acl = vec![
            e(ACL_USER_OBJ, 7, u32::MAX),
            e(ACL_USER, 7, 1000),
            e(ACL_GROUP_OBJ, 7, u32::MAX),
            e(ACL_MASK, 7, u32::MAX),
            e(ACL_OTHER, 0, u32::MAX),
        ];
        let mut mode = 0o040_750;
        assert!(create_masq(&mut acl, &mut mode).unwrap());
        assert_eq!(mode, 0o040_750);
        // The owning group's entry is left as it was when a mask stands for the class.
        assert_eq!(acl.iter().map(|e| e.perm).collect::<Vec<_>>(), [7, 7, 7, 5, 0]);
        // No class entry at all: refused.
        let mut acl = vec![e(ACL_USER_OBJ, 7, u32::MAX), e(ACL_OTHER, 0, u32::MAX)];
        assert!(create_masq(&mut acl, &mut 0o644).is_err());
    }

    #[test]
    fn chmod_rewrites_owner_class_other() {
        let mut acl = vec![
            e(ACL_USER_OBJ, 7, u32::MAX),
            e(ACL_USER, 7, 1000),
            e(ACL_GROUP_OBJ, 7, u32::MAX),
            e(ACL_MASK, 7, u32::MAX),
            e(ACL_OTHER, 7, u32::MAX),
        ];
        chmod_acl(&mut acl, 0o640);
        assert_eq!(acl.iter().map(|e| e.perm).collect::<Vec<_>>(), [6, 7, 7, 4, 0]);
        let mut acl = vec![
            e(ACL_USER_OBJ, 7, u32::MAX),
            e(ACL_GROUP_OBJ, 7, u32::MAX),
            e(ACL_OTHER, 7, u32::MAX),
        ];
        chmod_acl(&mut acl, 0o751);
        assert_eq!(acl.iter().map(|e| e.perm).collect::<Vec<_>>(), [7, 5, 1]);
    }
}
