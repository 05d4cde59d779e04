//! New inodes, names, extended attributes and inode flags through the engine: one call
//! per request a mount makes, naming inodes by `InodeId`, each running the writer's
//! operation under the engine's lock the way that operation must run. All of them
//! look up and check everything before they begin a change, so they run under
//! `write_retrying`: a block their checks miss is read without the lock.
//!
//! The rules of each change are the writer's (`inode::write`, `inode::namespace`,
//! `inode::xattr`, `inode::attr`). What the engine adds is what the kernel's VFS does
//! around btrfs's own operations: a new inode's owner and set-group-ID bit from its
//! directory (`inode_init_owner`) and the ACLs it inherits from the directory's
//! default ACL (`posix_acl_create`, then `btrfs_init_acl`), in the same transaction as
//! the inode.
//!
//! Neighbours: `engine::file` for the namespace changes that must know about open
//! files and take inode locks (unlink, rmdir, rename); `engine::subvol` for
//! subvolumes.

use crate::engine::Engine;
use crate::error::{Error, PosixKind, Result};
use crate::inode::filesystem::{FsRead, InodeId, Load};
use crate::inode::namespace::RENAME_WHITEOUT;
use crate::inode::perm::inode_init_owner;
use crate::inode::write::InodeAttrs;
use crate::inode::writer::FsWriter;
use ubtrfs_format::structs::{ft_from_mode, InodeItem, S_IFDIR, S_IFLNK, S_IFMT, S_IFREG};

/// `a` (the caller's mode, fsuid and fsgid, and whatever else it sets) for a new inode
/// of `mode` in the directory whose item is `dir`, as `inode_init_owner` settles it: a
/// set-group-ID directory gives its group, and to a new directory its bit too.
fn owned_in(dir: &InodeItem, a: &InodeAttrs, mode: u32) -> InodeAttrs {
    let o = inode_init_owner(dir, a.uid, a.gid, mode);
    InodeAttrs { mode: o.mode, gid: o.gid, ..*a }
}

/// The kind of inode `Engine::create_exact` makes.
#[derive(Clone, Copy, Debug)]
pub enum NewInode<'a> {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A special file (FIFO, socket, device), its type in the mode.
    Special,
    /// A symbolic link to the target.
    Symlink(&'a [u8]),
}

impl Engine {
    /// Create the empty regular file `name` in directory `dir` (creat(2), open(2) with
    /// O_CREAT) and return it. `a` carries the caller's permission bits, fsuid and
    /// fsgid; the directory settles the group (`inode_init_owner`), and its default ACL,
    /// when it has one, is inherited (`posix_acl_create`) where otherwise `umask` takes
    /// its bits from the mode.
    ///
    /// # Errors
    /// As `FsWriter::create_file`; `Posix(NotFound)` for no directory `dir`;
    /// `Posix(ReadOnly)` in a read-only subvolume; `Posix(Invalid)` for a default ACL
    /// that does not parse. A refusal changes nothing; a failure storing the inherited
    /// ACLs comes after the inode was made and aborts.
    pub fn create_file(
        &self,
        dir: InodeId,
        name: &[u8],
        a: &InodeAttrs,
        umask: u32,
    ) -> Result<InodeId> {
        let mode = S_IFREG | (a.mode & 0o7777);
        self.make_inode(dir, a, mode, umask, |w, a| w.create_file(dir.root, dir.ino, name, a))
    }

    /// Create the special file `name` in directory `dir` (mknod(2)): `a.mode` holds the
    /// type and permission bits, `a.rdev` the device (as btrfs stores it, see
    /// `rdev_encode`); a regular file (S_IFREG) is made as `create_file` makes it. Owner,
    /// ACLs and `umask` as `create_file`.
    ///
    /// # Errors
    /// As `FsWriter::mknod` (or `FsWriter::create_file` for a regular file), and as
    /// `create_file`.
    pub fn mknod(&self, dir: InodeId, name: &[u8], a: &InodeAttrs, umask: u32) -> Result<InodeId> {
        let mode = a.mode;
        self.make_inode(dir, a, mode, umask, |w, a| {
            if mode & S_IFMT == S_IFREG {
                w.create_file(dir.root, dir.ino, name, a)
            } else {
                w.mknod(dir.root, dir.ino, name, a)
            }
        })
    }

    /// Create the directory `name` in directory `dir` (mkdir(2)), with `a`'s permission
    /// bits. Owner, ACLs (a new directory also inherits the default ACL itself) and
    /// `umask` as `create_file`.
    ///
    /// # Errors
    /// As `FsWriter::mkdir`, and as `create_file`.
    pub fn mkdir(&self, dir: InodeId, name: &[u8], a: &InodeAttrs, umask: u32) -> Result<InodeId> {
        let mode = S_IFDIR | (a.mode & 0o7777);
        self.make_inode(dir, a, mode, umask, |w, a| w.mkdir(dir.root, dir.ino, name, a))
    }

    /// Create the symbolic link `name` in directory `dir` pointing at `target`
    /// (symlink(2)): mode 0777 whatever `a.mode` says, owned as `create_file` says. A
    /// symlink has no ACLs, so nothing is inherited and no umask applies.
    ///
    /// # Errors
    /// As `FsWriter::symlink`; `Posix(NotFound)` for no directory `dir`.
    pub fn symlink(
        &self,
        dir: InodeId,
        name: &[u8],
        target: &[u8],
        a: &InodeAttrs,
    ) -> Result<InodeId> {
        let ino = self.write_retrying(|w| {
            let d = w.live().load_inode(dir, Load::ITEM)?.item;
            w.symlink(dir.root, dir.ino, name, target, &owned_in(&d, a, S_IFLNK | 0o777))
        })?;
        Ok(InodeId { root: dir.root, ino })
    }

    /// Create an unnamed regular file for directory `dir` (open(2) with O_TMPFILE,
    /// `FsWriter::tmpfile`): nlink 0 and an orphan item until `link` names it. Owner,
    /// ACLs and `umask` as `create_file`. The caller opens or looks it up before
    /// anything else: an inode without a name that nobody holds waits for its removal.
    ///
    /// # Errors
    /// As `FsWriter::tmpfile`, and as `create_file`.
    pub fn tmpfile(&self, dir: InodeId, a: &InodeAttrs, umask: u32) -> Result<InodeId> {
        let mode = S_IFREG | (a.mode & 0o7777);
        self.make_inode(dir, a, mode, umask, |w, a| w.tmpfile(dir.root, dir.ino, a))
    }

    /// Make the new inode `name` in directory `dir` with exactly the mode, owner and
    /// times of `a`, as an offline command that names them does (`put`, `mkdir`,
    /// `mknod`, `ln -s` of the editing commands): the writer's create, with no
    /// directory's set-group-ID group, no inherited default ACL and no umask.
    ///
    /// # Errors
    /// As `FsWriter::create_file`, `mkdir`, `mknod` or `symlink` (a refusal changes
    /// nothing).
    pub fn create_exact(
        &self,
        dir: InodeId,
        name: &[u8],
        kind: NewInode<'_>,
        a: &InodeAttrs,
    ) -> Result<InodeId> {
        let ino = self.write_retrying(|w| match kind {
            NewInode::File => w.create_file(dir.root, dir.ino, name, a),
            NewInode::Dir => w.mkdir(dir.root, dir.ino, name, a),
            NewInode::Special => w.mknod(dir.root, dir.ino, name, a),
            NewInode::Symlink(target) => w.symlink(dir.root, dir.ino, name, target, a),
        })?;
        Ok(InodeId { root: dir.root, ino })
    }

    /// Make a new inode of `mode` in `dir` with `create`, given the caller's attributes
    /// `a` settled by the directory: its owner (`owned_in`), then the mode and ACLs of
    /// `posix_acl_create` (a default ACL of `dir` is inherited; without one `umask`
    /// applies, as the kernel leaves it to the filesystem once it hands ACLs over).
    fn make_inode(
        &self,
        dir: InodeId,
        a: &InodeAttrs,
        mode: u32,
        umask: u32,
        create: impl Fn(&mut FsWriter, &InodeAttrs) -> Result<u64>,
    ) -> Result<InodeId> {
        let ino = self.write_retrying(|w| {
            let d = w.live().load_inode(dir, Load::ITEM)?.item;
            let mut a = owned_in(&d, a, mode);
            w.check_root_writable(dir.root)?;
            let acls = w.acl_for_new_inode(dir, a.mode, umask)?;
            a.mode = acls.mode;
            // The create makes every check before it begins its own handle, so a
            // refusal (EEXIST, an immutable directory, a long name) changes nothing and
            // aborts nothing; it must not run inside a handle of ours, whose failure
            // would abort. The ACLs follow in a handle of their own, in the same
            // transaction: a failure there comes after the inode was made, and aborts.
            let ino = create(w, &a)?;
            if acls.access.is_some() || acls.default.is_some() {
                w.transaction("inherit ACLs", 2, |w| {
                    w.acl_init(InodeId { root: dir.root, ino }, &acls)
                })?;
            }
            Ok(ino)
        })?;
        Ok(InodeId { root: dir.root, ino })
    }

    /// Give inode `id` the new name `name` in directory `dir` (link(2)); an unnamed
    /// file (`tmpfile`) gets its first name and loses its orphan item.
    ///
    /// # Errors
    /// `Posix(CrossDevice)` for a directory in another subvolume; `Posix(NotFound)`
    /// for no inode `id`; as `FsWriter::link`.
    pub fn link(&self, id: InodeId, dir: InodeId, name: &[u8]) -> Result<()> {
        if id.root != dir.root {
            return Err(Error::posix(PosixKind::CrossDevice, "link across subvolumes"));
        }
        let ft = ft_from_mode(self.getattr(id)?.mode.get());
        self.write_retrying(|w| w.link(dir.root, dir.ino, name, id.ino, ft))
    }

    /// Rename `old_name` in `old_dir` to `new_name` in `new_dir` (renameat2(2)), where a
    /// RENAME_WHITEOUT's whiteout is owned by `owner` (the caller's fsuid and fsgid).
    /// Without RENAME_WHITEOUT this is `rename`, with its inode locks; with it, the
    /// writer's rename runs alone under the engine's lock.
    ///
    /// # Errors
    /// `Posix(CrossDevice)` for directories in two subvolumes; as `rename` and
    /// `FsWriter::rename_with_owner`.
    pub fn rename_with_owner(
        &self,
        old_dir: InodeId,
        old_name: &[u8],
        new_dir: InodeId,
        new_name: &[u8],
        flags: u32,
        owner: (u32, u32),
    ) -> Result<()> {
        if old_dir.root != new_dir.root {
            return Err(Error::posix(PosixKind::CrossDevice, "rename across subvolumes"));
        }
        if flags & RENAME_WHITEOUT == 0 {
            return self.rename(old_dir, old_name, new_dir, new_name, flags);
        }
        self.write_retrying(|w| {
            w.rename_with_owner(
                old_dir.root,
                old_dir.ino,
                old_name,
                new_dir.ino,
                new_name,
                flags,
                owner,
            )
        })
    }

    /// Set inode `id`'s flags from FS_IOC_SETFLAGS's `flags` (`chattr`, as
    /// `FsWriter::set_fsflags`); ctime moves. Who may change IMMUTABLE and APPEND is the
    /// caller's check.
    ///
    /// # Errors
    /// As `FsWriter::set_fsflags`.
    pub fn set_fsflags(&self, id: InodeId, flags: u32) -> Result<()> {
        self.write_retrying(|w| w.set_fsflags(id, flags))
    }

    /// Set extended attribute `name` of inode `id` to `value` (setxattr(2), `flags`
    /// XATTR_CREATE or XATTR_REPLACE), as `FsWriter::setxattr_opts` does: an access ACL
    /// also sets the mode, and with `kill_sgid` (a caller neither in the file's group
    /// nor holding CAP_FSETID) takes the set-group-ID bit from it.
    ///
    /// # Errors
    /// As `FsWriter::setxattr`.
    pub fn setxattr(
        &self,
        id: InodeId,
        name: &[u8],
        value: &[u8],
        flags: u32,
        kill_sgid: bool,
    ) -> Result<()> {
        self.write_retrying(|w| w.setxattr_opts(id, name, value, flags, kill_sgid))
    }

    /// Remove extended attribute `name` of inode `id` (removexattr(2), as
    /// `FsWriter::removexattr`).
    ///
    /// # Errors
    /// As `FsWriter::removexattr`: `Posix(NoData)` when it is absent.
    pub fn removexattr(&self, id: InodeId, name: &[u8]) -> Result<()> {
        self.write_retrying(|w| w.removexattr(id, name))
    }
}
