//! Copy host files into the image (`ubtrfs put`), as `cp -a SRC... DEST` does: regular
//! files (sparse ones stay sparse: only the source's data ranges are written), directories,
//! symlinks, fifos, sockets and device nodes, with mode, owner, atime/mtime, every
//! xattr the host lets us read, and hard links among the copied files. Everything happens in the caller's transaction; a
//! failure leaves the committed image untouched (the caller does not commit).
//!
//! Where the copy goes, as cp decides it: into DEST when DEST is an existing directory
//! (as DEST/NAME, merging into a directory of that name), else as DEST itself; several
//! SRCs need a directory DEST; a DEST ending in `/` must be (or, for one directory
//! SRC, becomes) a directory. A regular file onto an existing regular file replaces its
//! contents; any other type onto an existing name is EEXIST, a directory onto a
//! non-directory ENOTDIR.
//!
//! The whole source is scanned first (types, and directories' metadata before the copy
//! reads them and changes their atime), so a refusal comes before anything is written.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use ubtrfs_core::error::{Error, PosixKind, Result};
use ubtrfs_core::inode::attr::{SetAttr, TimeSet};
use ubtrfs_core::inode::filesystem::{FsRead, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::transaction::FsWriter;
use ubtrfs_format::structs::*;

/// What `put` copied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// Fifos, sockets and device nodes.
    pub special: u64,
    pub hardlinks: u64,
    /// File data written (holes not counted).
    pub bytes: u64,
}

/// How `put` copies.
#[derive(Clone, Debug, Default)]
pub struct PutOptions {
    /// Copy directories and their contents (`-r`); without it a directory is refused.
    pub recursive: bool,
}

fn io(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", ubtrfs_core::quote::path(path)), e)
}

fn attrs(md: &std::fs::Metadata) -> InodeAttrs {
    let rdev = if md.file_type().is_char_device() || md.file_type().is_block_device() { rdev_encode(libc::major(md.rdev()), libc::minor(md.rdev())) } else { 0 };
    InodeAttrs { mode: md.mode(), uid: md.uid(), gid: md.gid(), rdev, atime: Some((md.atime(), md.atime_nsec() as u32)), mtime: Some((md.mtime(), md.mtime_nsec() as u32)), flags: 0 }
}

/// Record every directory's metadata before this scan reads it (reading a directory
/// updates its atime, and the copy keeps the atime from before), and refuse a
/// directory without `recursive`. Files are stat'ed again when they are copied, so
/// memory stays bounded by the number of directories.
fn prescan(src: &Path, recursive: bool, seen: &mut HashMap<PathBuf, std::fs::Metadata>) -> Result<()> {
    let md = std::fs::symlink_metadata(src).map_err(|e| io(src, "cannot stat", e))?;
    if md.is_dir() {
        seen.insert(src.to_path_buf(), md);
        if !recursive {
            return Err(Error::posix_detail(PosixKind::IsDir, ubtrfs_core::quote::path(src), "use -r"));
        }
        for e in std::fs::read_dir(src).map_err(|e| io(src, "cannot read", e))? {
            let e = e.map_err(|e| io(src, "cannot read", e))?;
            prescan(&e.path(), true, seen)?;
        }
    }
    Ok(())
}

/// The host file name of `p` (`..` and `/` have none).
fn base_name(p: &Path) -> Result<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    match p.file_name() {
        Some(n) => Ok(n.as_bytes().to_vec()),
        None => Err(Error::posix_detail(PosixKind::Invalid, ubtrfs_core::quote::path(p), "the source has no name to copy it under")),
    }
}

/// Copy `srcs` to `dest` in the image (see the module documentation).
///
/// # Errors
/// `Posix` for a target that cannot take the copy (NotDir, Exists, IsDir without -r);
/// host I/O errors naming the path; engine errors.
pub fn put(w: &mut FsWriter, srcs: &[&Path], dest: &str, opts: &PutOptions) -> Result<PutStats> {
    let dest = crate::edit::absolute(dest)?;
    if srcs.is_empty() {
        return Err(Error::posix_detail(PosixKind::Invalid, dest.to_string(), "nothing to copy"));
    }
    let mut seen = HashMap::new();
    for s in srcs {
        prescan(s, opts.recursive, &mut seen)?;
    }
    let dest_dir = match w.live().resolve_id(dest, true) {
        Ok(id) if w.live().load_inode(id, Load::ITEM)?.item.mode.get() & S_IFMT == S_IFDIR => Some(id),
        Ok(_) if dest.ends_with('/') => return Err(Error::posix(PosixKind::NotDir, ubtrfs_core::quote::name(dest.as_bytes()))),
        Ok(_) => None,
        Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => None,
        Err(e) => return Err(e),
    };
    let mut stats = PutStats::default();
    let mut links = HashMap::new();
    match dest_dir {
        Some(dir) => {
            for s in srcs {
                let name = base_name(s)?;
                put_one(w, s, dir, &name, &mut stats, &mut links, &seen)?;
            }
        }
        None => {
            if srcs.len() > 1 {
                return Err(Error::posix_detail(PosixKind::NotDir, ubtrfs_core::quote::name(dest.as_bytes()), "several sources need an existing directory to copy into"));
            }
            if dest.ends_with('/') && !seen.contains_key(srcs[0]) {
                return Err(Error::posix_detail(PosixKind::NotDir, ubtrfs_core::quote::name(dest.as_bytes()), "a trailing / names a directory, and the source is not one"));
            }
            let (parent, name) = w.resolve_parent(dest)?;
            put_one(w, srcs[0], parent, &name, &mut stats, &mut links, &seen)?;
        }
    }
    Ok(stats)
}

fn put_one(w: &mut FsWriter, src: &Path, parent: InodeId, name: &[u8], stats: &mut PutStats, links: &mut HashMap<(u64, u64), InodeId>, seen: &HashMap<PathBuf, std::fs::Metadata>) -> Result<()> {
    let md = match seen.get(src) {
        Some(m) => m.clone(),
        None => {
            let m = std::fs::symlink_metadata(src).map_err(|e| io(src, "cannot stat", e))?;
            if m.is_dir() {
                return Err(Error::posix(PosixKind::Invalid, format!("{} changed while copying (it became a directory)", ubtrfs_core::quote::path(src))));
            }
            m
        }
    };
    let a = attrs(&md);
    let existing = w.live().lookup(parent, name)?;
    let ft = md.file_type();
    if ft.is_dir() {
        let here = match &existing {
            // cp -a merges into a directory of the same name.
            Some(e) if e.ftype == FT_DIR => e.target,
            Some(_) => return Err(Error::posix_detail(PosixKind::NotDir, ubtrfs_core::quote::name(name), "cannot put a directory over a non-directory")),
            None => {
                let ino = w.mkdir(parent.root, parent.ino, name, &a)?;
                stats.dirs += 1;
                InodeId { root: parent.root, ino }
            }
        };
        let mut entries: Vec<_> = std::fs::read_dir(src).map_err(|e| io(src, "cannot read", e))?.collect::<std::result::Result<_, _>>().map_err(|e| io(src, "cannot read", e))?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let n = e.file_name();
            put_one(w, &e.path(), here, n.as_encoded_bytes(), stats, links, seen)?;
        }
        let chowned = set_owner(w, here, &a)?;
        copy_xattrs(w, src, here)?;
        // Linking children changed the directory's times; the source's go back last.
        return finish_attrs(w, here, &a, existing.is_some() || chowned);
    }
    if md.nlink() > 1 {
        if let Some(first) = links.get(&(md.dev(), md.ino())) {
            if existing.is_some() {
                return Err(Error::posix(PosixKind::Exists, ubtrfs_core::quote::name(name)));
            }
            let ftype = ft_from_mode(md.mode());
            w.link(parent.root, parent.ino, name, first.ino, ftype)?;
            stats.hardlinks += 1;
            return Ok(());
        }
    }
    let id = if ft.is_file() {
        let id = match &existing {
            // cp overwrites a regular file in place (the inode stays).
            Some(e) if e.ftype == FT_REG_FILE => {
                w.setattr(e.target.root, e.target.ino, &SetAttr { size: Some(0), ..Default::default() })?;
                e.target
            }
            Some(_) => return Err(Error::posix(PosixKind::Exists, ubtrfs_core::quote::name(name))),
            None => InodeId { root: parent.root, ino: w.create_file(parent.root, parent.ino, name, &a)? },
        };
        stats.bytes += copy_data(w, src, id, md.len())?;
        let chowned = set_owner(w, id, &a)?;
        copy_xattrs(w, src, id)?;
        stats.files += 1;
        finish_attrs(w, id, &a, existing.is_some() || chowned)?;
        id
    } else {
        if existing.is_some() {
            return Err(Error::posix(PosixKind::Exists, ubtrfs_core::quote::name(name)));
        }
        let ino = if ft.is_symlink() {
            use std::os::unix::ffi::OsStrExt;
            let target = std::fs::read_link(src).map_err(|e| io(src, "cannot read the link", e))?;
            stats.symlinks += 1;
            w.symlink(parent.root, parent.ino, name, target.as_os_str().as_bytes(), &a)?
        } else {
            stats.special += 1;
            w.mknod(parent.root, parent.ino, name, &a)?
        };
        let id = InodeId { root: parent.root, ino };
        let chowned = set_owner(w, id, &a)?;
        copy_xattrs(w, src, id)?;
        finish_attrs(w, id, &a, !ft.is_symlink() || chowned)?;
        id
    };
    if md.nlink() > 1 {
        links.insert((md.dev(), md.ino()), id);
    }
    Ok(())
}

/// Copy every extended attribute of host path `src` (not following a symlink) to the
/// inode: every namespace the host lets us read (user, security, trusted as root,
/// system.posix_acl_*), as cp -a does.
fn copy_xattrs(w: &mut FsWriter, src: &Path, id: InodeId) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(src.as_os_str().as_bytes()).map_err(|_| Error::posix(PosixKind::Invalid, ubtrfs_core::quote::path(src)))?;
    let list = |buf: &mut [u8]| -> std::io::Result<usize> {
        // SAFETY: llistxattr writes at most buf.len() bytes into buf.
        let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    };
    let n = match list(&mut []) {
        Ok(n) => n,
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => return Ok(()),
        Err(e) => return Err(io(src, "cannot list the xattrs of", e)),
    };
    if n == 0 {
        return Ok(());
    }
    let mut names = vec![0u8; n + 256];
    let n = list(&mut names).map_err(|e| io(src, "cannot list the xattrs of", e))?;
    for name in names[..n].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cn = std::ffi::CString::new(name).expect("no NUL inside a listed name");
        let get = |buf: &mut [u8]| -> std::io::Result<usize> {
            // SAFETY: lgetxattr writes at most buf.len() bytes into buf.
            let r = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
            if r < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(r as usize)
            }
        };
        let len = match get(&mut []) {
            Ok(l) => l,
            // Gone since the listing (or not readable by us): nothing to copy.
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => continue,
            Err(e) => return Err(io(src, &format!("cannot read xattr {} of", String::from_utf8_lossy(name)), e)),
        };
        let mut v = vec![0u8; len];
        let got = get(&mut v).map_err(|e| io(src, &format!("cannot read xattr {} of", String::from_utf8_lossy(name)), e))?;
        v.truncate(got);
        w.setxattr(id.root, id.ino, name, &v, 0).map_err(|e| e.at(format!("{}: xattr {}", ubtrfs_core::quote::path(src), String::from_utf8_lossy(name))))?;
    }
    Ok(())
}

/// The source's owner, for an inode that has another (one that existed, or a
/// symlink, which is made root's): before the xattrs, as cp -a orders it, since a chown
/// takes a non-directory's file capabilities. Returns whether the owner changed (a
/// chown clears set-ID bits: the mode is set again after).
fn set_owner(w: &mut FsWriter, id: InodeId, a: &InodeAttrs) -> Result<bool> {
    if a.atime.is_none() || a.mtime.is_none() {
        return Ok(false);
    }
    let cur = w.live().load_inode(id, Load::ITEM)?.item;
    if cur.uid.get() == a.uid && cur.gid.get() == a.gid {
        return Ok(false);
    }
    w.setattr(id.root, id.ino, &SetAttr::chown(Some(a.uid), Some(a.gid)))?;
    Ok(true)
}

/// The mode (for an inode that existed or changed owner; a symlink has none to set),
/// then the source's times, last.
fn finish_attrs(w: &mut FsWriter, id: InodeId, a: &InodeAttrs, mode: bool) -> Result<()> {
    let (Some(at), Some(mt)) = (a.atime, a.mtime) else { return Ok(()) };
    let mut s = SetAttr { atime: Some(TimeSet::At(at.0, at.1)), mtime: Some(TimeSet::At(mt.0, mt.1)), ..Default::default() };
    let cur = w.live().load_inode(id, Load::ITEM)?.item;
    if mode && cur.mode.get() & S_IFMT != S_IFLNK {
        s.mode = Some(a.mode & 0o7777);
    }
    w.setattr(id.root, id.ino, &s)
}

/// Write the source's data ranges (SEEK_DATA / SEEK_HOLE: holes stay holes) and set
/// the size. Returns the bytes written.
fn copy_data(w: &mut FsWriter, src: &Path, id: InodeId, len: u64) -> Result<u64> {
    use std::os::unix::io::AsRawFd;
    let mut f = std::fs::File::open(src).map_err(|e| io(src, "cannot open", e))?;
    let fd = f.as_raw_fd();
    let seek = |off: u64, whence: libc::c_int| -> std::io::Result<Option<u64>> {
        // SAFETY: lseek on a descriptor this function owns.
        let r = unsafe { libc::lseek(fd, off as libc::off_t, whence) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::ENXIO) { Ok(None) } else { Err(e) };
        }
        Ok(Some(r as u64))
    };
    let mut ranges = Vec::new();
    let mut pos = 0u64;
    while pos < len {
        let Some(start) = seek(pos, libc::SEEK_DATA).map_err(|e| io(src, "cannot find data in", e))? else { break };
        if start >= len {
            break;
        }
        let end = seek(start, libc::SEEK_HOLE).map_err(|e| io(src, "cannot find holes in", e))?.unwrap_or(len).min(len);
        ranges.push((start, end));
        pos = end;
    }
    let mut written = 0;
    for (start, end) in ranges {
        use std::io::Seek;
        f.seek(std::io::SeekFrom::Start(start)).map_err(|e| io(src, "cannot seek", e))?;
        w.write_file_with(id.root, id.ino, start, end - start, &mut |buf: &mut [u8]| f.read_exact(buf).map_err(|e| io(src, "cannot read (did it change while copying?)", e)))?;
        written += end - start;
    }
    let size = w.live().load_inode(id, Load::ITEM)?.item.size.get();
    if size != len {
        w.setattr(id.root, id.ino, &SetAttr { size: Some(len), ..Default::default() })?;
    }
    Ok(written)
}

/// Remove `path` from the image (`ubtrfs rm`); directories need `recursive` unless empty.
///
/// # Errors
/// `Posix` NotFound / IsDir / NotEmpty; engine errors.
pub fn remove(w: &mut FsWriter, path: &str, recursive: bool) -> Result<u64> {
    let (parent, name) = w.resolve_parent(path)?;
    let entry = w.live().lookup(parent, &name)?.ok_or_else(|| Error::posix(PosixKind::NotFound, ubtrfs_core::quote::name(path.as_bytes())))?;
    let (ino, ftype) = (entry.target.ino, entry.ftype);
    if entry.is_subvol {
        return Err(Error::posix(PosixKind::Invalid, format!("{} is a subvolume; deleting subvolumes is not supported yet", ubtrfs_core::quote::name(path.as_bytes()))));
    }
    if ftype == FT_DIR && !recursive && w.live().load_inode(entry.target, Load::ITEM)?.size() != 0 {
        return Err(Error::posix_detail(PosixKind::IsDir, ubtrfs_core::quote::name(path.as_bytes()), "use -r"));
    }
    let mut count = 0;
    if ftype == FT_DIR {
        count += remove_dir_contents(w, InodeId { root: parent.root, ino }, path)?;
        w.rmdir(parent.root, parent.ino, &name)?;
    } else {
        w.unlink(parent.root, parent.ino, &name)?;
    }
    Ok(count + 1)
}

fn remove_dir_contents(w: &mut FsWriter, dir: InodeId, path: &str) -> Result<u64> {
    let entries = w.live().readdir(dir)?;
    let mut count = 0;
    for e in entries {
        let child_path = format!("{path}/{}", ubtrfs_core::quote::name(&e.name));
        if e.is_subvol {
            return Err(Error::posix(PosixKind::Invalid, format!("{child_path} is a subvolume; deleting subvolumes is not supported yet")));
        }
        if e.ftype == FT_DIR {
            count += remove_dir_contents(w, e.target, &child_path)?;
            w.rmdir(dir.root, dir.ino, &e.name)?;
        } else {
            w.unlink(dir.root, dir.ino, &e.name)?;
        }
        count += 1;
    }
    Ok(count)
}
