//! Extended attributes, as the kernel keeps them: the VFS rules of fs/xattr.c (name and
//! size limits, who may carry `user.*`, immutable and append-only inodes), POSIX ACLs
//! as fs/posix_acl.c takes them (parsed, validated, folded into the mode when the mode
//! says it all), the btrfs handlers of fs/btrfs/xattr.c, and the `btrfs.compression`
//! property of fs/btrfs/props.c.
//!
//! On disk an xattr is an entry of an XATTR_ITEM `(ino, 24, name_hash(name))` laid out
//! as a DIR_ITEM entry: type FT_XATTR, a zeroed location, `data_len` = value length,
//! then the name, then the value. Names whose hashes collide share one item, entries
//! packed one after another.
//!
//! Invariants kept per change: every argument is checked and the new item computed
//! from the current one before anything changes (a refused change leaves the trees as
//! they were); one transaction handle holds the item change and the inode update (ctime,
//! and the flags or mode a property or an ACL implies), so the change is whole or, on
//! a failure inside, the filesystem aborts. A changed item never exceeds one leaf.
//!
//! Neighbours: `inode::write` keeps the inode item (`update_inode`, the one place it
//! changes) and the immutable/append-only rules of names and data; `inode::filesystem`
//! is the read side this file extends (`XattrRead`).

use crate::compression::CompressionType;
use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FsRead, InodeId, Load};
use crate::inode::writer::FsWriter;
use crate::tree::search::Search;
use ubtrfs_format::features::{INCOMPAT_COMPRESS_LZO, INCOMPAT_COMPRESS_ZSTD};
use ubtrfs_format::hash::name_hash;
use ubtrfs_format::items;
use ubtrfs_format::key::*;
use ubtrfs_format::node::{HEADER_SIZE, ITEM_SIZE};
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;
use zerocopy::{FromZeros, IntoBytes};

/// setxattr(2) flag: fail with EEXIST if the attribute exists.
pub const XATTR_CREATE: u32 = 1;
/// setxattr(2) flag: fail with ENODATA if the attribute does not exist.
pub const XATTR_REPLACE: u32 = 2;
/// Longest name the VFS takes (XATTR_NAME_MAX); longer is ERANGE.
pub const XATTR_NAME_MAX: usize = 255;
/// Largest value the VFS takes (XATTR_SIZE_MAX); larger is E2BIG.
pub const XATTR_SIZE_MAX: usize = 65536;
/// Largest name list listxattr(2) returns (XATTR_LIST_MAX).
pub const XATTR_LIST_MAX: usize = 65536;
/// The per-inode compression property (`btrfs property set FILE compression ALG`).
pub const XATTR_BTRFS_COMPRESSION: &[u8] = b"btrfs.compression";
/// The access ACL.
pub const XATTR_POSIX_ACL_ACCESS: &[u8] = b"system.posix_acl_access";
/// A directory's default ACL, inherited by new entries.
pub const XATTR_POSIX_ACL_DEFAULT: &[u8] = b"system.posix_acl_default";

/// Items one xattr change touches: the xattr item and the inode item (the kernel's
/// `btrfs_start_transaction(root, 2)` in `btrfs_setxattr_trans`).
const XATTR_ITEMS: u64 = 2;

/// The most name and value bytes one xattr may hold (BTRFS_MAX_XATTR_SIZE): one leaf
/// item (the leaf less its item header) less the dir item header. More is ENOSPC, as
/// `btrfs_setxattr` refuses it.
pub fn max_xattr_size(nodesize: u32) -> usize {
    max_item_size(nodesize) - core::mem::size_of::<DirItem>()
}

/// BTRFS_MAX_ITEM_SIZE: the most data one leaf item holds.
fn max_item_size(nodesize: u32) -> usize {
    nodesize as usize - HEADER_SIZE - ITEM_SIZE
}

/// The handler a name goes to (the kernel's `btrfs_xattr_handlers` and the VFS's ACL
/// names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Handler {
    User,
    Trusted,
    Security,
    /// `btrfs.*`: properties.
    Btrfs,
    AclAccess,
    AclDefault,
}

/// The ACL an exact name is (`is_posix_acl_xattr`).
fn acl_kind(name: &[u8]) -> Option<Handler> {
    match name {
        XATTR_POSIX_ACL_ACCESS => Some(Handler::AclAccess),
        XATTR_POSIX_ACL_DEFAULT => Some(Handler::AclDefault),
        _ => None,
    }
}

/// "root=R ino=I xattr NAME", the object of every message here.
fn what(id: InodeId, name: &[u8]) -> String {
    format!("{id} xattr {}", crate::quote::name(name))
}

/// The syscall's name checks: 1 to 255 bytes, else ERANGE (`import_xattr_name`). A NUL
/// cannot reach the kernel inside a name; here it is refused as EINVAL.
fn check_name(id: InodeId, name: &[u8]) -> Result<()> {
    if name.is_empty() || name.len() > XATTR_NAME_MAX {
        return Err(Error::posix_detail(
            PosixKind::Range,
            what(id, name),
            format!("names are 1 to {XATTR_NAME_MAX} bytes, this one is {}", name.len()),
        ));
    }
    if name.contains(&0) {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            what(id, name),
            "the name holds a NUL byte",
        ));
    }
    Ok(())
}

/// The handler for a name that is not an ACL (`xattr_resolve_name`): a known prefix
/// with an empty rest is EINVAL, an unknown prefix (other `system.*` names among them)
/// EOPNOTSUPP.
fn resolve(id: InodeId, name: &[u8]) -> Result<Handler> {
    let prefixes: [(&[u8], Handler); 4] = [
        (b"security.", Handler::Security),
        (b"trusted.", Handler::Trusted),
        (b"user.", Handler::User),
        (b"btrfs.", Handler::Btrfs),
    ];
    for (p, h) in prefixes {
        if let Some(rest) = name.strip_prefix(p) {
            if rest.is_empty() {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    what(id, name),
                    "a namespace prefix without a name",
                ));
            }
            return Ok(h);
        }
    }
    Err(Error::posix_detail(
        PosixKind::NotSupported,
        what(id, name),
        "btrfs keeps the user., trusted., security., btrfs. namespaces and the POSIX ACLs only",
    ))
}

fn is_reg_or_dir(mode: u32) -> bool {
    matches!(mode & S_IFMT, S_IFREG | S_IFDIR)
}

/// `may_write_xattr`: no xattr of an immutable or append-only inode changes.
fn may_write_xattr(id: InodeId, name: &[u8], flags: u64) -> Result<()> {
    if flags & (INODE_IMMUTABLE | INODE_APPEND) != 0 {
        return Err(Error::posix_detail(
            PosixKind::NotPermitted,
            what(id, name),
            "the inode is immutable or append-only",
        ));
    }
    Ok(())
}

/// `xattr_permission` for a change: `may_write_xattr`, and `user.*` only on regular
/// files and directories (EPERM). The caller is taken to be privileged (trusted.* and
/// sticky directories need no further check).
fn xattr_permission_write(id: InodeId, name: &[u8], ii: &InodeItem) -> Result<()> {
    may_write_xattr(id, name, ii.flags.get())?;
    if name.starts_with(b"user.") && !is_reg_or_dir(ii.mode.get()) {
        return Err(Error::posix_detail(
            PosixKind::NotPermitted,
            what(id, name),
            "user.* xattrs belong to regular files and directories only",
        ));
    }
    Ok(())
}

// ---- POSIX ACLs (the xattr format of include/uapi/linux/posix_acl_xattr.h) ----

const POSIX_ACL_XATTR_VERSION: u32 = 2;
pub const ACL_USER_OBJ: u16 = 0x01;
pub const ACL_USER: u16 = 0x02;
pub const ACL_GROUP_OBJ: u16 = 0x04;
pub const ACL_GROUP: u16 = 0x08;
pub const ACL_MASK: u16 = 0x10;
pub const ACL_OTHER: u16 = 0x20;
const ACL_UNDEFINED_ID: u32 = u32::MAX;
/// Header (a_version) and entry (e_tag, e_perm, e_id) sizes.
const ACL_HEADER_SIZE: usize = 4;
const ACL_ENTRY_SIZE: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AclEntry {
    /// ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK or ACL_OTHER.
    pub tag: u16,
    /// rwx bits.
    pub perm: u16,
    /// The uid or gid of a named entry (u32::MAX otherwise).
    pub id: u32,
}

/// `posix_acl_from_xattr`: None for a header without entries (which removes the ACL).
pub(crate) fn acl_from_xattr(id: InodeId, name: &[u8], v: &[u8]) -> Result<Option<Vec<AclEntry>>> {
    let bad = |why: &str| Error::posix_detail(PosixKind::Invalid, what(id, name), why.to_string());
    if v.len() < ACL_HEADER_SIZE {
        return Err(bad("an ACL starts with a 4-byte version"));
    }
    let version = u32::from_le_bytes(v[..4].try_into().expect("4 bytes"));
    if version != POSIX_ACL_XATTR_VERSION {
        return Err(Error::posix_detail(
            PosixKind::NotSupported,
            what(id, name),
            format!("ACL version {version}, not {POSIX_ACL_XATTR_VERSION}"),
        ));
    }
    let body = &v[ACL_HEADER_SIZE..];
    if !body.len().is_multiple_of(ACL_ENTRY_SIZE) {
        return Err(bad("the ACL's entries are not a multiple of 8 bytes"));
    }
    if body.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(body.len() / ACL_ENTRY_SIZE);
    for e in body.chunks_exact(ACL_ENTRY_SIZE) {
        let tag = u16::from_le_bytes([e[0], e[1]]);
        let perm = u16::from_le_bytes([e[2], e[3]]);
        let eid = u32::from_le_bytes([e[4], e[5], e[6], e[7]]);
        match tag {
            ACL_USER_OBJ | ACL_GROUP_OBJ | ACL_MASK | ACL_OTHER => {
                out.push(AclEntry { tag, perm, id: ACL_UNDEFINED_ID })
            }
            // (uid_t)-1 maps to no kuid.
            ACL_USER | ACL_GROUP if eid != ACL_UNDEFINED_ID => {
                out.push(AclEntry { tag, perm, id: eid })
            }
            ACL_USER | ACL_GROUP => return Err(bad("a named ACL entry with id -1")),
            _ => return Err(bad(&format!("ACL entry tag {tag:#x}"))),
        }
    }
    Ok(Some(out))
}

/// `posix_acl_valid`: permission bits rwx only; USER_OBJ, then USERs, GROUP_OBJ, then
/// GROUPs, MASK (required when there are named entries), OTHER, each once.
fn acl_valid(acl: &[AclEntry]) -> bool {
    #[derive(PartialEq)]
    enum S {
        UserObj,
        User,
        Group,
        Other,
        Done,
    }
    let mut state = S::UserObj;
    let mut needs_mask = false;
    for e in acl {
        if e.perm & !7 != 0 {
            return false;
        }
        state = match (e.tag, state) {
            (ACL_USER_OBJ, S::UserObj) => S::User,
            (ACL_USER, S::User) => {
                needs_mask = true;
                S::User
            }
            (ACL_GROUP_OBJ, S::User) => S::Group,
            (ACL_GROUP, S::Group) => {
                needs_mask = true;
                S::Group
            }
            (ACL_MASK, S::Group) => S::Other,
            (ACL_OTHER, S::Other) => S::Done,
            (ACL_OTHER, S::Group) if !needs_mask => S::Done,
            _ => return false,
        };
    }
    state == S::Done
}

/// `posix_acl_equiv_mode`: the permission bits an ACL gives `mode`, and whether the
/// ACL says more than the mode can (named entries or a mask).
fn acl_equiv_mode(acl: &[AclEntry], mode: u32) -> (u32, bool) {
    let mut m = 0u32;
    let mut not_equiv = false;
    for e in acl {
        let p = u32::from(e.perm) & 7;
        match e.tag {
            ACL_USER_OBJ => m |= p << 6,
            ACL_GROUP_OBJ => m |= p << 3,
            ACL_OTHER => m |= p,
            ACL_MASK => {
                m = (m & !0o070) | (p << 3);
                not_equiv = true;
            }
            _ => not_equiv = true,
        }
    }
    ((mode & !0o777) | m, not_equiv)
}

/// `posix_acl_to_xattr`: the bytes stored (ids of the unnamed entries read -1).
pub(crate) fn acl_to_xattr(acl: &[AclEntry]) -> Vec<u8> {
    let mut v = Vec::with_capacity(ACL_HEADER_SIZE + acl.len() * ACL_ENTRY_SIZE);
    v.extend_from_slice(&POSIX_ACL_XATTR_VERSION.to_le_bytes());
    for e in acl {
        v.extend_from_slice(&e.tag.to_le_bytes());
        v.extend_from_slice(&e.perm.to_le_bytes());
        v.extend_from_slice(&e.id.to_le_bytes());
    }
    v
}

// ---- file capabilities (security/commoncap.c) ----

/// File capabilities, which the VFS checks and rewrites before they are stored.
const XATTR_NAME_CAPS: &[u8] = b"security.capability";
const VFS_CAP_REVISION_2: u32 = 0x0200_0000;
const VFS_CAP_REVISION_3: u32 = 0x0300_0000;
const VFS_CAP_FLAGS_EFFECTIVE: u32 = 0x0000_0001;
/// `vfs_cap_data` (magic_etc, two permitted/inheritable pairs) and `vfs_ns_cap_data`
/// (the same and a root id).
const XATTR_CAPS_SZ_2: usize = 20;
const XATTR_CAPS_SZ_3: usize = 24;

/// `cap_convert_nscap`'s checks for a privileged caller in the initial namespaces:
/// the header must be revision 2 (20 bytes) or 3 (24 bytes, a root id that maps) with
/// no flag but the effective one (`validheader`, `sansflags`), else EINVAL. A valid
/// value is stored as given (the conversions there concern other user namespaces).
fn check_caps(id: InodeId, name: &[u8], v: &[u8]) -> Result<()> {
    let bad = || {
        Error::posix_detail(
            PosixKind::Invalid,
            what(id, name),
            "not a revision 2 or 3 file capability",
        )
    };
    let magic = u32::from_le_bytes(v.get(..4).ok_or_else(bad)?.try_into().expect("4 bytes"));
    match (v.len(), magic & !VFS_CAP_FLAGS_EFFECTIVE) {
        (XATTR_CAPS_SZ_2, VFS_CAP_REVISION_2) => Ok(()),
        // (uid_t)-1 maps to no kuid.
        (XATTR_CAPS_SZ_3, VFS_CAP_REVISION_3) if v[20..24] != [0xff; 4] => Ok(()),
        _ => Err(bad()),
    }
}

// ---- the compression property ----

/// The `btrfs.compression` property of an inode, as the write path takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CompressionProperty {
    /// `CompressionType::None` for "no" / "none": never compress this inode.
    pub kind: CompressionType,
    /// The level after a colon ("zstd:3"). The kernel's property keeps the type only
    /// (its writes use the mount's level); this is for callers that want more.
    pub level: Option<i32>,
}

/// What `prop_compression_apply` makes of a value: None for values it refuses.
fn parse_compression(v: &[u8]) -> Option<CompressionProperty> {
    if v == b"no" || v == b"none" {
        return Some(CompressionProperty { kind: CompressionType::None, level: None });
    }
    // Prefixes, as the kernel compares them (`btrfs_compress_is_valid_type`).
    let (kind, rest) = if let Some(r) = v.strip_prefix(b"lzo") {
        (CompressionType::Lzo, r)
    } else if let Some(r) = v.strip_prefix(b"zlib") {
        (CompressionType::Zlib, r)
    } else if let Some(r) = v.strip_prefix(b"zstd") {
        (CompressionType::Zstd, r)
    } else {
        return None;
    };
    let level = rest
        .strip_prefix(b":")
        .and_then(|l| std::str::from_utf8(l).ok())
        .and_then(|l| l.parse::<i32>().ok());
    Some(CompressionProperty { kind, level })
}

// ---- the change ----

/// What becomes of the XATTR_ITEM holding a name.
#[derive(Debug)]
enum ItemEdit {
    Unchanged,
    Insert(Vec<u8>),
    Rewrite { old_len: usize, new: Vec<u8> },
    Delete,
}

/// A checked change, ready to apply.
struct XattrChange {
    id: InodeId,
    key: Key,
    edit: ItemEdit,
    flags_set: u64,
    flags_clear: u64,
    mode: Option<u32>,
    incompat: u64,
    /// The change moves ctime (every change through the xattr calls does).
    ctime: bool,
}

/// One entry's bytes: DIR_ITEM header (FT_XATTR, zeroed location), name, value.
fn xattr_entry(transid: u64, name: &[u8], value: &[u8]) -> Vec<u8> {
    let di = DirItem {
        location: DiskKey::new_zeroed(),
        transid: transid.into(),
        data_len: u16::try_from(value.len())
            .expect("value checked against BTRFS_MAX_XATTR_SIZE")
            .into(),
        name_len: u16::try_from(name.len()).expect("name checked against XATTR_NAME_MAX").into(),
        type_: FT_XATTR,
    };
    let mut e = Vec::with_capacity(core::mem::size_of::<DirItem>() + name.len() + value.len());
    e.extend_from_slice(di.as_bytes());
    e.extend_from_slice(name);
    e.extend_from_slice(value);
    e
}

/// A placeholder takes no xattrs: the kernel clears IOP_XATTR on it (EOPNOTSUPP).
fn refuse_placeholder(id: InodeId, name: &[u8]) -> Result<()> {
    if id.is_placeholder() {
        return Err(Error::posix_detail(
            PosixKind::NotSupported,
            what(id, name),
            "an empty subvolume placeholder takes no extended attributes",
        ));
    }
    Ok(())
}

impl FsWriter {
    /// Set xattr `name` of inode `id` to `value` (setxattr(2)):
    /// `XATTR_CREATE` fails if it exists, `XATTR_REPLACE` if it does not. ACL names
    /// are parsed and validated and an access ACL the mode expresses becomes the mode;
    /// `btrfs.compression` sets the inode's compression flags too. The inode's ctime
    /// moves. One transaction handle; nothing changes when it fails.
    ///
    /// # Errors
    /// `Posix`: EINVAL (flags, a malformed ACL or `security.capability`, `btrfs.`
    /// names and values the kernel refuses), ERANGE (name of 0 or over 255 bytes),
    /// E2BIG (value over 64 KiB), ENOENT, EPERM (immutable or append-only inode;
    /// `user.*` on other than regular files and directories), EOPNOTSUPP (unknown
    /// namespace, ACL on a symlink), EACCES (default ACL on a non-directory), EEXIST,
    /// ENODATA, ENOSPC (name and value beyond one leaf item), EROFS (a read-only
    /// subvolume: for ACLs too, where the kernel 6.18 on this machine lets setfacl
    /// change a read-only snapshot's mode; read-only snapshots stay unchanged here, as
    /// send/receive need); tree failures (which abort).
    pub fn setxattr(&mut self, id: InodeId, name: &[u8], value: &[u8], flags: u32) -> Result<()> {
        self.setxattr_opts(id, name, value, flags, false)
    }

    /// `setxattr`, for a caller that may not keep a set-group-ID bit: with `kill_sgid`,
    /// an access ACL takes the bit from the mode it sets, as `posix_acl_update_mode`
    /// does for a caller neither in the file's group nor holding CAP_FSETID (the
    /// kernel's FUSE_SETXATTR_ACL_KILL_SGID). Other names ignore it.
    ///
    /// # Errors
    /// As `setxattr`.
    pub fn setxattr_opts(
        &mut self,
        id: InodeId,
        name: &[u8],
        value: &[u8],
        flags: u32,
        kill_sgid: bool,
    ) -> Result<()> {
        if flags & !(XATTR_CREATE | XATTR_REPLACE) != 0 {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what(id, name),
                format!("unknown setxattr flags {flags:#x}"),
            ));
        }
        check_name(id, name)?;
        if value.len() > XATTR_SIZE_MAX {
            return Err(Error::posix_detail(
                PosixKind::TooBig,
                what(id, name),
                format!("values are at most {XATTR_SIZE_MAX} bytes, this one is {}", value.len()),
            ));
        }
        if name == XATTR_NAME_CAPS && !value.is_empty() {
            check_caps(id, name, value)?;
        }
        self.check_root_writable(id.root)?;
        refuse_placeholder(id, name)?;
        let change = match acl_kind(name) {
            Some(kind) => {
                let acl = if value.is_empty() { None } else { acl_from_xattr(id, name, value)? };
                let mut change = self.plan_set_acl(id, name, kind, acl)?;
                if let Some(XattrChange { mode: Some(m), .. }) = &mut change {
                    if kill_sgid {
                        *m &= !S_ISGID;
                    }
                }
                change
            }
            None => self.plan_setxattr(id, name, Some(value), flags)?,
        };
        self.apply_xattr_change(change, "setxattr")
    }

    /// Remove xattr `name` of inode `id` (removexattr(2)); removing `btrfs.compression`
    /// resets the inode's compression flags. Removing an absent ACL succeeds, as the
    /// kernel's does.
    ///
    /// # Errors
    /// As `setxattr`; ENODATA when the attribute is absent.
    pub fn removexattr(&mut self, id: InodeId, name: &[u8]) -> Result<()> {
        check_name(id, name)?;
        self.check_root_writable(id.root)?;
        refuse_placeholder(id, name)?;
        let change = match acl_kind(name) {
            Some(kind) => self.plan_set_acl(id, name, kind, None)?,
            None => self.plan_setxattr(id, name, None, XATTR_REPLACE)?,
        };
        self.apply_xattr_change(change, "removexattr")
    }

    /// Remove inode `id`'s file capabilities (`security.capability`) if it has any, as
    /// `cap_inode_killpriv` does for a chown's ATTR_KILL_PRIV: without removexattr(2)'s
    /// permission checks (an immutable inode loses them too), ctime moving.
    pub(crate) fn kill_file_caps(&mut self, id: InodeId) -> Result<()> {
        let key = xattr_key(id, XATTR_NAME_CAPS);
        let edit = self.plan_item_edit(id, XATTR_NAME_CAPS, None, 0)?;
        if matches!(edit, ItemEdit::Unchanged) {
            return Ok(());
        }
        self.apply_xattr_change(
            Some(XattrChange {
                id,
                key,
                edit,
                flags_set: 0,
                flags_clear: 0,
                mode: None,
                incompat: 0,
                ctime: true,
            }),
            "killpriv",
        )
    }

    /// The change of a name that is not an ACL (`vfs_setxattr`, `__vfs_removexattr`
    /// for `value` None): the VFS permission, the handler, then the property or plain
    /// xattr rules. None: nothing to do (a property on an inode that ignores it).
    fn plan_setxattr(
        &mut self,
        id: InodeId,
        name: &[u8],
        value: Option<&[u8]>,
        flags: u32,
    ) -> Result<Option<XattrChange>> {
        let ii = self.live().load_inode(id, Load::ITEM)?.item;
        xattr_permission_write(id, name, &ii)?;
        match resolve(id, name)? {
            Handler::Btrfs => self.plan_set_prop(id, name, value, flags, &ii),
            _ => {
                let edit = self.plan_item_edit(id, name, value, flags)?;
                Ok(Some(XattrChange {
                    id,
                    key: xattr_key(id, name),
                    edit,
                    flags_set: 0,
                    flags_clear: 0,
                    mode: None,
                    incompat: 0,
                    ctime: true,
                }))
            }
        }
    }

    /// `btrfs_xattr_handler_set_prop`: `btrfs_validate_prop`, `btrfs_ignore_prop`,
    /// `btrfs_set_prop` with the compression handler's apply.
    fn plan_set_prop(
        &mut self,
        id: InodeId,
        name: &[u8],
        value: Option<&[u8]>,
        flags: u32,
        ii: &InodeItem,
    ) -> Result<Option<XattrChange>> {
        if name != XATTR_BTRFS_COMPRESSION {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what(id, name),
                "the only btrfs property of an inode is btrfs.compression",
            ));
        }
        let v = value.unwrap_or(b"");
        let prop = if v.is_empty() {
            None
        } else {
            // `btrfs_inode_can_compress`: nodatacow and nodatasum files never compress.
            if ii.flags.get() & (INODE_NODATACOW | INODE_NODATASUM) != 0 {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    what(id, name),
                    "the inode is nodatacow or nodatasum and cannot compress",
                ));
            }
            let p = parse_compression(v).ok_or_else(|| {
                Error::posix_detail(
                    PosixKind::Invalid,
                    what(id, name),
                    format!(
                        "{:?} is none of zlib, lzo, zstd, no, none",
                        String::from_utf8_lossy(v)
                    ),
                )
            })?;
            Some(p)
        };
        // Compression means nothing to symlinks, devices, fifos and sockets: the kernel
        // stores nothing for them and reports success.
        if !is_reg_or_dir(ii.mode.get()) {
            return Ok(None);
        }
        let edit = self.plan_item_edit(id, name, prop.map(|_| v), flags)?;
        let (flags_set, flags_clear, incompat) = match prop {
            None => (0, INODE_COMPRESS | INODE_NOCOMPRESS, 0),
            Some(CompressionProperty { kind: CompressionType::None, .. }) => {
                (INODE_NOCOMPRESS, INODE_COMPRESS, 0)
            }
            Some(CompressionProperty { kind: CompressionType::Lzo, .. }) => {
                (INODE_COMPRESS, INODE_NOCOMPRESS, INCOMPAT_COMPRESS_LZO)
            }
            Some(CompressionProperty { kind: CompressionType::Zstd, .. }) => {
                (INODE_COMPRESS, INODE_NOCOMPRESS, INCOMPAT_COMPRESS_ZSTD)
            }
            Some(CompressionProperty { kind: CompressionType::Zlib, .. }) => {
                (INODE_COMPRESS, INODE_NOCOMPRESS, 0)
            }
        };
        Ok(Some(XattrChange {
            id,
            key: xattr_key(id, name),
            edit,
            flags_set,
            flags_clear,
            mode: None,
            incompat,
            ctime: true,
        }))
    }

    /// `vfs_set_acl` / `vfs_remove_acl` and `btrfs_set_acl` (`acl` None removes, as an
    /// empty value does). None: nothing to do (no default ACL on a non-directory).
    fn plan_set_acl(
        &mut self,
        id: InodeId,
        name: &[u8],
        kind: Handler,
        acl: Option<Vec<AclEntry>>,
    ) -> Result<Option<XattrChange>> {
        let ii = self.live().load_inode(id, Load::ITEM)?.item;
        may_write_xattr(id, name, ii.flags.get())?;
        let mode = ii.mode.get();
        if mode & S_IFMT == S_IFLNK {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                what(id, name),
                "symlinks carry no ACLs",
            ));
        }
        if kind == Handler::AclDefault && mode & S_IFMT != S_IFDIR {
            if acl.is_some() {
                return Err(Error::posix_detail(
                    PosixKind::PermissionDenied,
                    what(id, name),
                    "only directories have a default ACL",
                ));
            }
            return Ok(None);
        }
        let mut acl = acl;
        if let Some(a) = &acl {
            if !acl_valid(a) {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    what(id, name),
                    "the ACL's entries are not in order, or bits beyond rwx",
                ));
            }
        }
        let mut new_mode = None;
        if kind == Handler::AclAccess {
            if let Some(a) = &acl {
                let (m, not_equiv) = acl_equiv_mode(a, mode);
                new_mode = Some(m);
                if !not_equiv {
                    acl = None;
                }
            }
        }
        let value = acl.as_deref().map(acl_to_xattr);
        let edit = self.plan_item_edit(id, name, value.as_deref(), 0)?;
        Ok(Some(XattrChange {
            id,
            key: xattr_key(id, name),
            edit,
            flags_set: 0,
            flags_clear: 0,
            mode: new_mode,
            incompat: 0,
            ctime: true,
        }))
    }

    /// `btrfs_setxattr`'s decisions on the current item, made before any change: set
    /// `value` (or remove, for None) with `flags`, returning the item's new bytes.
    fn plan_item_edit(
        &mut self,
        id: InodeId,
        name: &[u8],
        value: Option<&[u8]>,
        flags: u32,
    ) -> Result<ItemEdit> {
        let max = max_xattr_size(self.nodesize());
        let vlen = value.map_or(0, <[u8]>::len);
        if name.len() + vlen > max {
            return Err(Error::posix_detail(
                PosixKind::NoSpace,
                what(id, name),
                format!(
                    "name and value take {} bytes, one xattr holds at most {max}",
                    name.len() + vlen
                ),
            ));
        }
        let key = xattr_key(id, name);
        let cur = self.items_in_range(id.root, &key, &key)?.pop().map(|(_, d)| d);
        let mut rest = Vec::new();
        let mut found = false;
        if let Some(d) = &cur {
            for e in items::dir_entries(d) {
                let e = e.expect("validated by the tree checker");
                if e.name == name && !found {
                    found = true;
                    continue;
                }
                let di = DirItem {
                    location: e.location.to_disk(),
                    transid: e.transid.into(),
                    data_len: (e.data.len() as u16).into(),
                    name_len: (e.name.len() as u16).into(),
                    type_: e.type_,
                };
                rest.extend_from_slice(di.as_bytes());
                rest.extend_from_slice(e.name);
                rest.extend_from_slice(e.data);
            }
        }
        if !found && flags & XATTR_REPLACE != 0 {
            return Err(Error::posix(PosixKind::NoData, what(id, name)));
        }
        let Some(v) = value else {
            return Ok(match (&cur, found) {
                (Some(_), true) if rest.is_empty() => ItemEdit::Delete,
                (Some(d), true) => ItemEdit::Rewrite { old_len: d.len(), new: rest },
                _ => ItemEdit::Unchanged,
            });
        };
        if found && flags & XATTR_CREATE != 0 {
            return Err(Error::posix(PosixKind::Exists, what(id, name)));
        }
        // The new or replaced entry goes last, as the kernel appends it.
        rest.extend_from_slice(&xattr_entry(self.transid, name, v));
        let item_max = max_item_size(self.nodesize());
        if rest.len() > item_max {
            return Err(Error::posix_detail(
                PosixKind::NoSpace,
                what(id, name),
                format!("its item, shared with names of the same hash, would take {} bytes, a leaf item holds at most {item_max}", rest.len()),
            ));
        }
        Ok(match cur {
            Some(d) => ItemEdit::Rewrite { old_len: d.len(), new: rest },
            None => ItemEdit::Insert(rest),
        })
    }

    /// Give new inode `ino` the compression property of its directory `dir`, as the
    /// kernel's `btrfs_inode_inherit_props` does when it creates an inode: the parent's
    /// algorithm without its level ("zstd:3" passes on "zstd"), its flags, nothing for
    /// "no"/"none" (the NOCOMPRESS flag passes on by the inode flags), nothing for other
    /// than regular files and directories or for a nodatacow/nodatasum inode. For the
    /// create paths, inside their handle; the new inode's times stay as created.
    ///
    /// # Errors
    /// ENOENT; ENOSPC; tree failures.
    pub fn inherit_props(&mut self, root: u64, dir: u64, ino: u64) -> Result<()> {
        let id = InodeId { root, ino };
        let Some(p) = self.live().compression_property(InodeId { root, ino: dir })? else {
            return Ok(());
        };
        let value: &[u8] = match p.kind {
            CompressionType::Zlib => b"zlib",
            CompressionType::Lzo => b"lzo",
            CompressionType::Zstd => b"zstd",
            CompressionType::None => return Ok(()),
        };
        let ii = self.live().load_inode(id, Load::ITEM)?.item;
        if !is_reg_or_dir(ii.mode.get())
            || ii.flags.get() & (INODE_NODATACOW | INODE_NODATASUM) != 0
        {
            return Ok(());
        }
        self.check_root_writable(root)?;
        let edit = self.plan_item_edit(id, XATTR_BTRFS_COMPRESSION, Some(value), 0)?;
        let incompat = match p.kind {
            CompressionType::Lzo => INCOMPAT_COMPRESS_LZO,
            CompressionType::Zstd => INCOMPAT_COMPRESS_ZSTD,
            _ => 0,
        };
        let change = XattrChange {
            id,
            key: xattr_key(id, XATTR_BTRFS_COMPRESSION),
            edit,
            flags_set: INODE_COMPRESS,
            flags_clear: INODE_NOCOMPRESS,
            mode: None,
            incompat,
            ctime: false,
        };
        self.apply_xattr_change(Some(change), "inherit_props")
    }

    /// Apply a checked change in one handle: the item, then the inode.
    fn apply_xattr_change(&mut self, change: Option<XattrChange>, at: &'static str) -> Result<()> {
        let Some(c) = change else { return Ok(()) };
        self.transaction(at, XATTR_ITEMS, |w| {
            let root = c.id.root;
            match c.edit {
                ItemEdit::Unchanged => {}
                ItemEdit::Insert(d) => w.insert_item(root, &c.key, &d)?,
                ItemEdit::Delete => {
                    let gone = w.delete_item(root, &c.key)?;
                    assert!(gone, "{}: xattr item {} vanished inside its change", c.id, c.key);
                }
                ItemEdit::Rewrite { old_len, new } => {
                    let (leaf, slot) = if new.len() > old_len {
                        w.extend_item(root, &c.key, new.len() - old_len)?
                    } else {
                        if new.len() < old_len {
                            w.truncate_item(root, &c.key, new.len())?;
                        }
                        w.lookup_for_update(root, &c.key, 0)?.unwrap_or_else(|| {
                            panic!("{}: xattr item {} vanished inside its change", c.id, c.key)
                        })
                    };
                    let d = w.item_data_mut(leaf, slot);
                    assert_eq!(
                        d.len(),
                        new.len(),
                        "{}: xattr item {} resized to {} bytes, wanted {}",
                        c.id,
                        c.key,
                        d.len(),
                        new.len()
                    );
                    d.copy_from_slice(&new);
                }
            }
            let t = w.now();
            w.update_inode(c.id, |ii| {
                if c.ctime {
                    ii.ctime = t;
                }
                ii.flags = ((ii.flags.get() | c.flags_set) & !c.flags_clear).into();
                if let Some(m) = c.mode {
                    ii.mode = m.into();
                }
            })?;
            if c.incompat != 0 {
                // `btrfs_set_fs_incompat`: written with the next commit's superblock.
                w.sb.incompat_flags = (w.sb.incompat_flags.get() | c.incompat).into();
            }
            Ok(())
        })
    }
}

fn xattr_key(id: InodeId, name: &[u8]) -> Key {
    Key::new(id.ino, XATTR_ITEM_KEY, name_hash(name))
}

/// A reply in the size protocol of getxattr(2) / listxattr(2), as the FUSE adapter
/// answers: asked with size 0, the length the caller needs; otherwise the bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum XattrReply {
    Size(usize),
    Data(Vec<u8>),
}

/// `size` 0 asks for the length; a shorter buffer than the data is ERANGE, or E2BIG
/// when the buffer is already at the syscall's `limit`.
fn sized(what: String, data: Vec<u8>, size: usize, limit: usize) -> Result<XattrReply> {
    if size == 0 {
        return Ok(XattrReply::Size(data.len()));
    }
    if data.len() > size {
        let kind = if size >= limit { PosixKind::TooBig } else { PosixKind::Range };
        return Err(Error::posix_detail(
            kind,
            what,
            format!("{} bytes do not fit a buffer of {size}", data.len()),
        ));
    }
    Ok(XattrReply::Data(data))
}

/// Xattr reads over any view (committed `Filesystem`, the writer's `live()`, the
/// engine's `read`), with the VFS's rules for who may read what.
pub trait XattrRead: FsRead {
    /// The value of xattr `name` of inode `id` (getxattr(2)).
    ///
    /// # Errors
    /// `Posix`: ERANGE (name length), EINVAL / EOPNOTSUPP (namespace, as `setxattr`),
    /// ENODATA (absent, or `user.*` of other than a regular file or directory),
    /// ENOENT; read failures.
    fn getxattr(&self, id: InodeId, name: &[u8]) -> Result<Vec<u8>> {
        check_name(id, name)?;
        refuse_placeholder(id, name)?;
        let ii = self.load_inode(id, Load::ITEM)?.item;
        let mode = ii.mode.get();
        if acl_kind(name).is_some() {
            if mode & S_IFMT == S_IFLNK {
                return Err(Error::posix_detail(
                    PosixKind::NotSupported,
                    what(id, name),
                    "symlinks carry no ACLs",
                ));
            }
        } else {
            if name.starts_with(b"user.") && !is_reg_or_dir(mode) {
                return Err(Error::posix_detail(
                    PosixKind::NoData,
                    what(id, name),
                    "user.* xattrs belong to regular files and directories only",
                ));
            }
            resolve(id, name)?;
        }
        lookup_xattr(self, id, name)?.ok_or_else(|| Error::posix(PosixKind::NoData, what(id, name)))
    }

    /// Every xattr name of inode `id`, in key order (listxattr(2)'s order).
    ///
    /// # Errors
    /// ENOENT; read failures.
    fn listxattr(&self, id: InodeId) -> Result<Vec<Vec<u8>>> {
        self.load_inode(id, Load::ITEM)?;
        // A placeholder lists none (the kernel's listxattr without IOP_XATTR).
        if id.is_placeholder() {
            return Ok(Vec::new());
        }
        let root = self.fs_root(id.root)?;
        let mut out = Vec::new();
        let mut it = self.iter(&root, Key::new(id.ino, XATTR_ITEM_KEY, 0))?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k.objectid != id.ino || k.type_ != XATTR_ITEM_KEY {
                break;
            }
            for e in items::dir_entries(item.data()) {
                out.push(e.expect("validated by the tree checker").name.to_vec());
            }
        }
        Ok(out)
    }

    /// `getxattr` in the size protocol (`size` 0 asks for the length).
    ///
    /// # Errors
    /// As `getxattr`; ERANGE for a too small `size`.
    fn getxattr_sized(&self, id: InodeId, name: &[u8], size: usize) -> Result<XattrReply> {
        let v = self.getxattr(id, name)?;
        sized(what(id, name), v, size, XATTR_SIZE_MAX)
    }

    /// `listxattr` in the size protocol: the names, each ended by a NUL.
    ///
    /// # Errors
    /// As `listxattr`; ERANGE for a too small `size`, E2BIG when even 64 KiB is.
    fn listxattr_sized(&self, id: InodeId, size: usize) -> Result<XattrReply> {
        let mut v = Vec::new();
        for n in self.listxattr(id)? {
            v.extend_from_slice(&n);
            v.push(0);
        }
        sized(format!("{id} xattr list"), v, size, XATTR_LIST_MAX)
    }

    /// The inode's `btrfs.compression` property, as the kernel applies it when it loads
    /// the inode: None when absent or a value it would not apply.
    ///
    /// # Errors
    /// ENOENT; read failures.
    fn compression_property(&self, id: InodeId) -> Result<Option<CompressionProperty>> {
        self.load_inode(id, Load::ITEM)?;
        Ok(lookup_xattr(self, id, XATTR_BTRFS_COMPRESSION)?.and_then(|v| parse_compression(&v)))
    }
}

impl<V: FsRead> XattrRead for V {}

/// The value of xattr `name` of `id`, read raw (no namespace rules).
fn lookup_xattr<V: FsRead>(fs: &V, id: InodeId, name: &[u8]) -> Result<Option<Vec<u8>>> {
    let root = fs.fs_root(id.root)?;
    let Search::Found(path) = fs.search_slot(&root, &xattr_key(id, name))? else {
        return Ok(None);
    };
    let item = path.item().expect("found slot is in the leaf");
    for e in items::dir_entries(item.data()) {
        let e = e.expect("validated by the tree checker");
        if e.name == name {
            return Ok(Some(e.data.to_vec()));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(tag: u16, perm: u16, id: u32) -> AclEntry {
        AclEntry { tag, perm, id }
    }

    #[test]
    fn acl_order_and_mask_rules() {
        let u = ACL_UNDEFINED_ID;
        assert!(acl_valid(&[e(ACL_USER_OBJ, 6, u), e(ACL_GROUP_OBJ, 4, u), e(ACL_OTHER, 4, u)]));
        assert!(acl_valid(&[
            e(ACL_USER_OBJ, 6, u),
            e(ACL_USER, 6, 1000),
            e(ACL_GROUP_OBJ, 4, u),
            e(ACL_MASK, 6, u),
            e(ACL_OTHER, 4, u)
        ]));
        // A named entry needs a mask; bits beyond rwx; order; OTHER missing.
        assert!(!acl_valid(&[
            e(ACL_USER_OBJ, 6, u),
            e(ACL_USER, 6, 1000),
            e(ACL_GROUP_OBJ, 4, u),
            e(ACL_OTHER, 4, u)
        ]));
        assert!(!acl_valid(&[e(ACL_USER_OBJ, 8, u), e(ACL_GROUP_OBJ, 4, u), e(ACL_OTHER, 4, u)]));
        assert!(!acl_valid(&[e(ACL_GROUP_OBJ, 4, u), e(ACL_USER_OBJ, 6, u), e(ACL_OTHER, 4, u)]));
        assert!(!acl_valid(&[e(ACL_USER_OBJ, 6, u), e(ACL_GROUP_OBJ, 4, u)]));
    }

    #[test]
    fn acl_equivalent_mode() {
        let u = ACL_UNDEFINED_ID;
        assert_eq!(
            acl_equiv_mode(
                &[e(ACL_USER_OBJ, 7, u), e(ACL_GROUP_OBJ, 4, u), e(ACL_OTHER, 0, u)],
                0o100644
            ),
            (0o100740, false)
        );
        // The mask stands for the group bits, and the ACL says more than the mode.
        assert_eq!(
            acl_equiv_mode(
                &[
                    e(ACL_USER_OBJ, 6, u),
                    e(ACL_USER, 6, 1000),
                    e(ACL_GROUP_OBJ, 4, u),
                    e(ACL_MASK, 6, u),
                    e(ACL_OTHER, 4, u)
                ],
                0o100644
            ),
            (0o100664, true)
        );
    }

    #[test]
    fn compression_values_as_the_kernel_reads_them() {
        let p = |s: &[u8]| parse_compression(s);
        assert_eq!(
            p(b"zstd:3"),
            Some(CompressionProperty { kind: CompressionType::Zstd, level: Some(3) })
        );
        assert_eq!(
            p(b"zlibx"),
            Some(CompressionProperty { kind: CompressionType::Zlib, level: None })
        );
        assert_eq!(
            p(b"lzo"),
            Some(CompressionProperty { kind: CompressionType::Lzo, level: None })
        );
        assert_eq!(p(b"none").map(|c| c.kind), Some(CompressionType::None));
        assert_eq!(p(b"nonex"), None);
        assert_eq!(p(b"zst"), None);
    }

    #[test]
    fn max_xattr_size_is_the_kernels() {
        // 16 KiB nodes: 16384 - 101 (header) - 25 (item) - 30 (dir item), the size a
        // kernel mount refuses one byte past.
        assert_eq!(max_xattr_size(16384), 16228);
        assert_eq!(max_xattr_size(4096), 3940);
    }
}
