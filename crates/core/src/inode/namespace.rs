//! Namespace operations beyond `write`'s create and link: unlink and rmdir, symlink,
//! mknod, and rename with its flags (`btrfs_unlink`, `btrfs_rmdir`, `btrfs_symlink`,
//! `btrfs_mknod`, `btrfs_rename`, `btrfs_rename_exchange` with the VFS checks in front
//! of them: `may_delete`, `may_create`, `do_renameat2`'s traps).
//!
//! Each operation checks everything the kernel checks before it changes anything, in
//! the kernel's order, so the errno of a failing call is the kernel's and a failed call
//! leaves the tree as it was. The change itself is one transaction handle.
//!
//! Names are one path component: not empty, no `/`, at most 255 bytes. `.` and `..`
//! are the VFS's to resolve and are refused here.

use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{DirEntry, FsRead, InodeId, Load};
use crate::inode::write::{iflags_allow, inherited_flags, IflagOp, InodeAttrs, LINK_ITEMS};
use crate::inode::writer::FsWriter;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

/// `renameat2` flags (the libc values).
pub const RENAME_NOREPLACE: u32 = 1;
pub const RENAME_EXCHANGE: u32 = 2;
pub const RENAME_WHITEOUT: u32 = 4;

/// The kernel's PATH_MAX: a symlink target is copied from user space as a path, so it
/// holds at most PATH_MAX - 1 bytes.
pub const PATH_MAX: usize = 4096;

/// The largest symlink target: what fits inline in a leaf (BTRFS_MAX_INLINE_DATA_SIZE),
/// and never more than a path.
pub fn max_symlink_len(nodesize: u32) -> usize {
    let inline = nodesize as usize
        - ubtrfs_format::node::HEADER_SIZE
        - ubtrfs_format::node::ITEM_SIZE
        - FILE_EXTENT_INLINE_DATA_START;
    inline.min(PATH_MAX - 1)
}

fn name_of(name: &[u8]) -> String {
    crate::quote::name(name).into_owned()
}

/// Refuse what is not one component, as the lookup would: too long is ENAMETOOLONG
/// (`btrfs_lookup`), the rest EINVAL.
fn check_component(name: &[u8]) -> Result<()> {
    if name.len() > NAME_LEN {
        return Err(Error::posix_detail(
            PosixKind::NameTooLong,
            name_of(name),
            format!("a name holds at most {NAME_LEN} bytes, this one {}", name.len()),
        ));
    }
    if name.is_empty() || name.contains(&b'/') || name == b"." || name == b".." {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            name_of(name),
            "not a single name inside a directory",
        ));
    }
    Ok(())
}

/// Refuse a new name in directory `dir` when it is a placeholder (EPERM: the kernel's
/// `simple_dir_inode_operations` have no mkdir, mknod, symlink or link; create is
/// EACCES, refused by `create_file`'s caller path the same way).
pub(crate) fn refuse_placeholder_dir(root: u64, dir: u64, name: &[u8]) -> Result<()> {
    if (InodeId { root, ino: dir }).is_placeholder() {
        return Err(Error::posix_detail(PosixKind::NotPermitted, name_of(name), "the directory is the empty placeholder of a subvolume this snapshot does not hold; nothing can be made in it"));
    }
    Ok(())
}

/// What a rename or removal found at a name: the entry and its inode's item.
struct Victim {
    entry: DirEntry,
    item: InodeItem,
}

impl Victim {
    fn is_dir(&self) -> bool {
        self.entry.ftype == FT_DIR
    }
}

impl FsWriter {
    /// Directory `dir`'s inode item; ENOTDIR for anything else.
    fn dir_item(&mut self, root: u64, dir: u64) -> Result<InodeItem> {
        let d = self.live().load_inode(InodeId { root, ino: dir }, Load::ITEM)?.item;
        if d.mode.get() & S_IFMT != S_IFDIR {
            return Err(Error::posix(PosixKind::NotDir, format!("root={root} ino={dir}")));
        }
        Ok(d)
    }

    /// Look `name` up in directory `dir` (checked to be one) with the lookup's own
    /// errors.
    fn lookup_victim(&mut self, root: u64, dir: u64, name: &[u8]) -> Result<Option<Victim>> {
        check_component(name)?;
        let Some(entry) = self.live().lookup(InodeId { root, ino: dir }, name)? else {
            return Ok(None);
        };
        // A subvolume's entry leads to its root directory, in another tree.
        let item = self.live().load_inode(entry.target, Load::ITEM)?.item;
        Ok(Some(Victim { entry, item }))
    }

    /// The VFS's `may_delete` of `v` from directory `dir` (flags `dflags`): EPERM for an
    /// immutable or append-only directory or victim, then the type: ENOTDIR when a
    /// directory is wanted and `v` is not, EISDIR when `v` is one and is not wanted.
    fn may_delete(
        &self,
        root: u64,
        dir: u64,
        dflags: u64,
        name: &[u8],
        v: &Victim,
        want_dir: bool,
    ) -> Result<()> {
        iflags_allow(InodeId { root, ino: dir }, dflags, IflagOp::RemoveName, name)?;
        // Named in this directory's tree: a subvolume entry's target is in another one.
        let victim = InodeId { root, ino: v.entry.target.ino };
        iflags_allow(victim, v.item.flags.get(), IflagOp::Relink, name)?;
        if want_dir && !v.is_dir() {
            return Err(Error::posix(PosixKind::NotDir, name_of(name)));
        }
        if !want_dir && v.is_dir() {
            return Err(Error::posix(PosixKind::IsDir, name_of(name)));
        }
        Ok(())
    }

    /// Whether the inode is in use in the shared inode cache (open, or looked up and
    /// not forgotten): its last name then leaves it an orphan (see `inode::orphan`).
    fn in_use(&self, id: InodeId) -> bool {
        self.inodes.lookup(id).is_some_and(|i| i.in_use())
    }

    /// Remove name `name` (not a directory) from directory `dir` (`unlink(2)`); the
    /// inode goes with its last name, or, when it is in use in the shared inode cache,
    /// once it no longer is (an orphan until then). `Engine::unlink` takes the inode
    /// locks around this.
    ///
    /// # Errors
    /// `Posix`: NameTooLong, NotFound, NotDir (for `dir`), NotPermitted (immutable or
    /// append-only), IsDir; tree failures.
    pub fn unlink(&mut self, root: u64, dir: u64, name: &[u8]) -> Result<()> {
        self.remove_name(root, dir, name, false)
    }

    /// Remove the empty directory `name` from `dir` (`rmdir(2)`).
    ///
    /// # Errors
    /// As `unlink`, with NotDir for a non-directory and NotEmpty.
    pub fn rmdir(&mut self, root: u64, dir: u64, name: &[u8]) -> Result<()> {
        self.remove_name(root, dir, name, true)
    }

    fn remove_name(&mut self, root: u64, dir: u64, name: &[u8], want_dir: bool) -> Result<()> {
        self.check_root_writable(root)?;
        let dflags = self.dir_item(root, dir)?.flags.get();
        let v = self
            .lookup_victim(root, dir, name)?
            .ok_or_else(|| Error::posix(PosixKind::NotFound, name_of(name)))?;
        self.may_delete(root, dir, dflags, name, &v, want_dir)?;
        if want_dir && v.item.size.get() != 0 {
            return Err(Error::posix(PosixKind::NotEmpty, name_of(name)));
        }
        // rmdir(2) of a placeholder removes only its entry (`btrfs_rmdir` on
        // BTRFS_EMPTY_SUBVOL_DIR_OBJECTID: `btrfs_unlink_subvol`); no ROOT_REF names
        // it, and the subvolume it stands for is another tree's.
        if let Some(id) = v.entry.placeholder_of {
            return self.remove_placeholder(root, dir, name, id);
        }
        // rmdir(2) of an empty subvolume deletes it, as the kernel's `btrfs_rmdir`.
        if v.entry.is_subvol {
            return self.delete_subvol(root, dir, name).map(|_| ());
        }
        if want_dir && v.item.size.get() != 0 {
            return Err(Error::posix(PosixKind::NotEmpty, name_of(name)));
        }
        let in_use = self.in_use(v.entry.target);
        let ino = v.entry.target.ino;
        self.transaction(if want_dir { "rmdir" } else { "unlink" }, 0, |w| {
            w.unlink_inner(root, dir, name, ino, v.entry.ftype, &v.item, in_use)
        })
    }

    /// Remove the entry `name` of directory `dir` that is the placeholder of subvolume
    /// `id` (its DIR_ITEM and DIR_INDEX; the directory's size and times change), as
    /// the kernel's `btrfs_unlink_subvol` does when the tree holds no ROOT_REF for it.
    fn remove_placeholder(&mut self, root: u64, dir: u64, name: &[u8], id: u64) -> Result<()> {
        // The DIR_INDEX is found by name (`btrfs_search_dir_index_item`): no back
        // reference records it.
        let from = Key::new(dir, DIR_INDEX_KEY, 0);
        let to = Key::new(dir, DIR_INDEX_KEY, u64::MAX);
        let mut index = None;
        for (k, d) in self.items_in_range(root, &from, &to)? {
            let found = ubtrfs_format::items::dir_entries(&d).any(|e| {
                let e = e.expect("validated by the tree checker");
                e.name == name && e.location.type_ == ROOT_ITEM_KEY && e.location.objectid == id
            });
            if found {
                index = Some(k.offset);
                break;
            }
        }
        let Some(index) = index else {
            return Err(Corrupt::new(
                CorruptWhere::Item,
                format!(
                    "directory {dir}: no DIR_INDEX for the entry {} of subvolume {id}",
                    name_of(name)
                ),
            )
            .root(root)
            .into());
        };
        self.transaction("rmdir placeholder", 0, |w| {
            w.del_dir_item_entry(root, dir, name)?;
            w.log_dir_change(root, dir, None, None, true);
            w.del_dir_index(root, dir, name, index)
        })
    }

    /// Create the symbolic link `name` in `dir` pointing at `target`, kept inline as the
    /// kernel keeps every symlink (mode 0777 whatever `a.mode` says).
    ///
    /// # Errors
    /// `Posix`: NotFound for an empty target, NameTooLong past `max_symlink_len`, and
    /// as `create_file`.
    pub fn symlink(
        &mut self,
        root: u64,
        dir: u64,
        name: &[u8],
        target: &[u8],
        a: &InodeAttrs,
    ) -> Result<u64> {
        self.check_root_writable(root)?;
        if target.is_empty() {
            return Err(Error::posix_detail(
                PosixKind::NotFound,
                name_of(name),
                "a symlink target cannot be empty",
            ));
        }
        // The target is copied in as a path first (getname), the name looked up
        // next, and the inline room checked last (btrfs_symlink).
        if target.len() >= PATH_MAX {
            return Err(Error::posix_detail(
                PosixKind::NameTooLong,
                name_of(name),
                format!(
                    "a symlink target holds less than {PATH_MAX} bytes, this one {}",
                    target.len()
                ),
            ));
        }
        if target.contains(&0) {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                name_of(name),
                "a symlink target cannot hold a NUL byte",
            ));
        }
        let mut a = *a;
        a.mode = S_IFLNK | 0o777;
        let dflags = self.check_new_name(root, dir, name)?;
        let max = max_symlink_len(self.nodesize());
        if target.len() > max {
            return Err(Error::posix_detail(
                PosixKind::NameTooLong,
                name_of(name),
                format!(
                    "a symlink target holds at most {max} bytes with this node size, this one {}",
                    target.len()
                ),
            ));
        }
        a.flags |= inherited_flags(dflags, false);
        self.transaction("symlink", LINK_ITEMS + 2, |w| {
            let ino = w.create_inode_inner(root, &a)?;
            let id = InodeId { root, ino };
            w.insert_inline(id, target)?;
            let len = target.len() as u64;
            w.update_inode(id, |i| {
                i.size = len.into();
                i.nbytes = len.into();
            })?;
            w.link_new_inner(root, dir, name, ino, FT_SYMLINK)?;
            Ok(ino)
        })
    }

    /// Create the special file `name` in `dir` (`mknod(2)`): a fifo, socket, character
    /// or block device (`a.mode` holds the type, `a.rdev` the device as btrfs stores it,
    /// see `rdev_encode`), or a regular file for type 0 or S_IFREG.
    ///
    /// # Errors
    /// `Posix`: NotPermitted for a directory (use `mkdir`), Invalid for an unknown type
    /// or a symlink (use `symlink`); as `create_file`.
    pub fn mknod(&mut self, root: u64, dir: u64, name: &[u8], a: &InodeAttrs) -> Result<u64> {
        self.check_root_writable(root)?;
        let mut a = *a;
        let ftype = match a.mode & S_IFMT {
            0 | S_IFREG => {
                a.mode = S_IFREG | (a.mode & 0o7777);
                FT_REG_FILE
            }
            S_IFCHR | S_IFBLK | S_IFIFO | S_IFSOCK => ft_from_mode(a.mode),
            S_IFDIR => {
                return Err(Error::posix_detail(
                    PosixKind::NotPermitted,
                    name_of(name),
                    "mknod cannot make a directory",
                ))
            }
            t => {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    name_of(name),
                    format!("mknod cannot make file type {t:#o}"),
                ))
            }
        };
        if !matches!(ftype, FT_CHRDEV | FT_BLKDEV) {
            a.rdev = 0;
        }
        let dflags = self.check_new_name(root, dir, name)?;
        a.flags |= inherited_flags(dflags, ftype == FT_REG_FILE);
        self.transaction("mknod", LINK_ITEMS + 3, |w| {
            let ino = w.create_inode_inner(root, &a)?;
            w.link_new_inner(root, dir, name, ino, ftype)?;
            // A regular file takes the directory's properties; `inherit_props` skips
            // the other types, as the kernel's compression property ignores them.
            w.inherit_props(root, dir, ino)?;
            Ok(ino)
        })
    }

    /// Whether directory `anc` is `dir` or one of its ancestors (directories have one
    /// name; the walk follows INODE_REF parents up to the subvolume's top).
    fn is_ancestor_or_self(&mut self, root: u64, anc: u64, mut dir: u64) -> Result<bool> {
        for _ in 0..=u16::MAX {
            if dir == anc {
                return Ok(true);
            }
            if dir == FIRST_FREE_OBJECTID {
                return Ok(false);
            }
            let refs = self.items_in_range(
                root,
                &Key::new(dir, INODE_REF_KEY, 0),
                &Key::new(dir, INODE_REF_KEY, u64::MAX),
            )?;
            match refs.first() {
                Some((k, _)) if k.offset != dir => dir = k.offset,
                _ => return Ok(false),
            }
        }
        Err(crate::inode::write::ino_err(
            InodeId { root, ino: dir },
            "the directory's parents go round in a loop".into(),
        ))
    }

    /// Rename `old_name` in `old_dir` to `new_name` in `new_dir` (`renameat2(2)`): a
    /// name that exists is replaced (a file by a file, a directory by an empty
    /// directory), unless `flags` has RENAME_NOREPLACE (EEXIST); RENAME_EXCHANGE swaps
    /// two existing names; RENAME_WHITEOUT leaves a whiteout (a 0:0 character device,
    /// owned by root) at the old name, as overlayfs asks.
    ///
    /// # Errors
    /// `Posix` as the kernel: Invalid for bad flags or a directory moved under itself,
    /// NotFound, Exists, NotDir, IsDir, NotEmpty (also a target that is an ancestor of
    /// the source), NotPermitted, NameTooLong; NotSupported for a subvolume's entry.
    pub fn rename(
        &mut self,
        root: u64,
        old_dir: u64,
        old_name: &[u8],
        new_dir: u64,
        new_name: &[u8],
        flags: u32,
    ) -> Result<()> {
        self.rename_with_owner(root, old_dir, old_name, new_dir, new_name, flags, (0, 0))
    }

    /// `rename` with the owner (uid, gid) a RENAME_WHITEOUT's whiteout gets (the
    /// caller's fsuid and fsgid in the kernel).
    #[allow(clippy::too_many_arguments)]
    pub fn rename_with_owner(
        &mut self,
        root: u64,
        old_dir: u64,
        old_name: &[u8],
        new_dir: u64,
        new_name: &[u8],
        flags: u32,
        owner: (u32, u32),
    ) -> Result<()> {
        let what = || format!("{} -> {}", name_of(old_name), name_of(new_name));
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT) != 0 {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what(),
                format!("unknown rename flags {flags:#x}"),
            ));
        }
        if flags & RENAME_EXCHANGE != 0 && flags & (RENAME_NOREPLACE | RENAME_WHITEOUT) != 0 {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what(),
                "RENAME_EXCHANGE goes with neither RENAME_NOREPLACE nor RENAME_WHITEOUT",
            ));
        }
        let exchange = flags & RENAME_EXCHANGE != 0;
        self.check_root_writable(root)?;
        // Both parents are resolved before either name is looked up.
        let odflags = self.dir_item(root, old_dir)?.flags.get();
        let ndflags = self.dir_item(root, new_dir)?.flags.get();
        refuse_placeholder_dir(root, new_dir, new_name)?;
        let src = self
            .lookup_victim(root, old_dir, old_name)?
            .ok_or_else(|| Error::posix(PosixKind::NotFound, name_of(old_name)))?;
        let dst = self.lookup_victim(root, new_dir, new_name)?;
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return Err(Error::posix(PosixKind::Exists, name_of(new_name)));
        }
        if exchange && dst.is_none() {
            return Err(Error::posix(PosixKind::NotFound, name_of(new_name)));
        }
        // lock_rename's traps: the source may not be an ancestor of the new directory;
        // the target may not be an ancestor of the old one.
        if old_dir != new_dir {
            if src.is_dir()
                && !src.entry.is_subvol
                && self.is_ancestor_or_self(root, src.entry.target.ino, new_dir)?
            {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    what(),
                    "a directory cannot move inside itself",
                ));
            }
            if let Some(d) = &dst {
                if d.is_dir()
                    && !d.entry.is_subvol
                    && self.is_ancestor_or_self(root, d.entry.target.ino, old_dir)?
                {
                    let kind = if exchange { PosixKind::Invalid } else { PosixKind::NotEmpty };
                    return Err(Error::posix_detail(
                        kind,
                        what(),
                        "the target is a directory above the source",
                    ));
                }
            }
        }
        // vfs_rename: two names of one inode: nothing to do.
        if dst.as_ref().is_some_and(|d| d.entry.target == src.entry.target) {
            return Ok(());
        }
        self.may_delete(root, old_dir, odflags, old_name, &src, src.is_dir())?;
        match &dst {
            None => {
                iflags_allow(InodeId { root, ino: new_dir }, ndflags, IflagOp::AddName, new_name)?
            }
            Some(d) => self.may_delete(
                root,
                new_dir,
                ndflags,
                new_name,
                d,
                if exchange { d.is_dir() } else { src.is_dir() },
            )?,
        }
        // btrfs_rename: a placeholder does not move (ENOTEMPTY, the kernel's answer).
        if src.entry.is_placeholder() {
            return Err(Error::posix_detail(
                PosixKind::NotEmpty,
                what(),
                "the placeholder of a subvolume this snapshot does not hold cannot be renamed",
            ));
        }
        if src.entry.is_subvol || dst.as_ref().is_some_and(|d| d.entry.is_subvol) {
            return Err(Error::posix_detail(
                PosixKind::NotSupported,
                what(),
                "renaming onto or from a subvolume's entry is not supported yet",
            ));
        }
        if !exchange {
            if let Some(d) = &dst {
                if d.is_dir() && d.item.size.get() != 0 {
                    return Err(Error::posix(PosixKind::NotEmpty, name_of(new_name)));
                }
            }
        }
        if flags & RENAME_WHITEOUT != 0 {
            // The whiteout takes the old name's place in the old directory, which the
            // rename has just emptied, so only the directory's immutability counts.
            iflags_allow(InodeId { root, ino: old_dir }, odflags, IflagOp::AddName, old_name)?;
        }
        // The new back references must fit (EMLINK without extrefs, as the kernel
        // finds when it inserts them).
        self.check_ref_room(root, src.entry.target.ino, new_dir, new_name)?;
        if let Some(d) = dst.as_ref().filter(|_| exchange) {
            self.check_ref_room(root, d.entry.target.ino, old_dir, old_name)?;
        }
        let items = 2 * LINK_ITEMS + 2;
        if exchange {
            let d = dst.expect("checked above");
            return self.transaction("rename_exchange", items, |w| {
                w.rename_exchange_inner(root, old_dir, old_name, &src, new_dir, new_name, &d)
            });
        }
        let victim_in_use = dst.as_ref().is_some_and(|d| self.in_use(d.entry.target));
        self.transaction("rename", items + LINK_ITEMS, |w| {
            // btrfs_rename: the new index first, the new back reference, the old name
            // out, the replaced name out, the new entries in.
            let s = src.entry.target.ino;
            let index = w.next_dir_index(root, new_dir)?;
            w.add_inode_ref(root, s, new_dir, new_name, index)?;
            w.del_name(root, old_dir, old_name, s)?;
            if let Some(d) = &dst {
                w.unlink_inner(
                    root,
                    new_dir,
                    new_name,
                    d.entry.target.ino,
                    d.entry.ftype,
                    &d.item,
                    victim_in_use,
                )?;
            }
            w.add_dir_entries(root, new_dir, new_name, s, src.entry.ftype, index)?;
            let t = w.now();
            w.update_inode(src.entry.target, |i| i.ctime = t)?;
            if flags & RENAME_WHITEOUT != 0 {
                let a = InodeAttrs {
                    uid: owner.0,
                    gid: owner.1,
                    flags: inherited_flags(odflags, false),
                    ..InodeAttrs::new(S_IFCHR)
                };
                let ino = w.create_inode_inner(root, &a)?;
                w.link_new_inner(root, old_dir, old_name, ino, FT_CHRDEV)?;
            }
            Ok(())
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn rename_exchange_inner(
        &mut self,
        root: u64,
        old_dir: u64,
        old_name: &[u8],
        src: &Victim,
        new_dir: u64,
        new_name: &[u8],
        dst: &Victim,
    ) -> Result<()> {
        let (s, d) = (src.entry.target.ino, dst.entry.target.ino);
        // btrfs_rename_exchange takes the source's new index from the new directory
        // first, then the target's from the old one.
        let s_index = self.next_dir_index(root, new_dir)?;
        let d_index = self.next_dir_index(root, old_dir)?;
        self.add_inode_ref(root, s, new_dir, new_name, s_index)?;
        self.add_inode_ref(root, d, old_dir, old_name, d_index)?;
        self.del_name(root, old_dir, old_name, s)?;
        self.del_name(root, new_dir, new_name, d)?;
        self.add_dir_entries(root, new_dir, new_name, s, src.entry.ftype, s_index)?;
        self.add_dir_entries(root, old_dir, old_name, d, dst.entry.ftype, d_index)?;
        let t = self.now();
        self.update_inode(src.entry.target, |i| i.ctime = t)?;
        self.update_inode(dst.entry.target, |i| i.ctime = t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symlink_limit_is_the_inline_room_or_a_path() {
        // 4 KiB leaves: 4096 - 101 - 25 - 21.
        assert_eq!(max_symlink_len(4096), 3949);
        assert_eq!(max_symlink_len(16384), PATH_MAX - 1);
        assert_eq!(max_symlink_len(65536), PATH_MAX - 1);
    }
}
