//! Copy a host tree into the image (`ubtrfs put`), like `cp -a SRC DEST`: regular files
//! and directories with contents, mode, owner, atime/mtime, and hard links among the
//! copied files. Everything happens in the caller's transaction; a failure leaves the
//! committed image untouched (the caller does not commit).
//!
//! Other file types are refused up front, before anything is written, naming the path.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use ubtrfs_core::error::{Error, PosixKind, Result};
use ubtrfs_core::inode::filesystem::{FsRead, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::transaction::FsWriter;
use ubtrfs_format::structs::*;

/// What `put` copied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutStats {
    pub files: u64,
    pub dirs: u64,
    pub hardlinks: u64,
    pub bytes: u64,
}

fn io(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", ubtrfs_core::quote::path(path)), e)
}

fn attrs(md: &std::fs::Metadata) -> InodeAttrs {
    InodeAttrs { mode: md.mode() & 0o7777, uid: md.uid(), gid: md.gid(), rdev: 0, atime: Some((md.atime(), md.atime_nsec() as u32)), mtime: Some((md.mtime(), md.mtime_nsec() as u32)), flags: 0 }
}

/// Refuse anything but regular files and directories (and directories without -r), and
/// record each directory's metadata before this scan reads it: reading a directory
/// updates its atime, and the copy keeps the atime from before. Files are not read
/// here, so the copy stats them when it comes to them (memory stays bounded by the
/// number of directories, not files).
fn prescan(src: &Path, recursive: bool, seen: &mut HashMap<std::path::PathBuf, std::fs::Metadata>) -> Result<()> {
    let md = std::fs::symlink_metadata(src).map_err(|e| io(src, "cannot stat", e))?;
    let ft = md.file_type();
    if ft.is_dir() {
        seen.insert(src.to_path_buf(), md);
        if !recursive {
            return Err(Error::posix_detail(PosixKind::IsDir, ubtrfs_core::quote::path(src), "use -r"));
        }
        for e in std::fs::read_dir(src).map_err(|e| io(src, "cannot read", e))? {
            let e = e.map_err(|e| io(src, "cannot read", e))?;
            prescan(&e.path(), true, seen)?;
        }
        Ok(())
    } else if ft.is_file() {
        Ok(())
    } else {
        Err(Error::posix(PosixKind::Invalid, format!("{}: only regular files and directories can be put for now", ubtrfs_core::quote::path(src))))
    }
}

/// Copy `src` to the new path `dest` in the image.
///
/// # Errors
/// `Posix(Exists)` if `dest` exists; host I/O errors naming the path; engine errors.
pub fn put(w: &mut FsWriter, src: &Path, dest: &str, recursive: bool) -> Result<PutStats> {
    let mut seen = HashMap::new();
    prescan(src, recursive, &mut seen)?;
    let (parent, name) = w.resolve_parent(dest)?;
    if w.live().lookup(parent, &name)?.is_some() {
        return Err(Error::posix(PosixKind::Exists, ubtrfs_core::quote::name(dest.as_bytes())));
    }
    let mut stats = PutStats::default();
    let mut links = HashMap::new();
    put_one(w, src, parent, &name, &mut stats, &mut links, &seen)?;
    Ok(stats)
}

fn put_one(
    w: &mut FsWriter,
    src: &Path,
    parent: InodeId,
    name: &[u8],
    stats: &mut PutStats,
    links: &mut HashMap<(u64, u64), InodeId>,
    seen: &HashMap<std::path::PathBuf, std::fs::Metadata>,
) -> Result<()> {
    let md = match seen.get(src) {
        Some(m) => m.clone(),
        None => {
            let m = std::fs::symlink_metadata(src).map_err(|e| io(src, "cannot stat", e))?;
            // Checked as a regular file by the scan, unless it changed since.
            if !m.file_type().is_file() {
                return Err(Error::posix(PosixKind::Invalid, format!("{} changed while copying (it is no longer a regular file)", ubtrfs_core::quote::path(src))));
            }
            m
        }
    };
    let a = attrs(&md);
    if md.is_dir() {
        let ino = w.mkdir(parent.root, parent.ino, name, &a)?;
        stats.dirs += 1;
        let mut entries: Vec<_> = std::fs::read_dir(src).map_err(|e| io(src, "cannot read", e))?.collect::<std::result::Result<_, _>>().map_err(|e| io(src, "cannot read", e))?;
        entries.sort_by_key(|e| e.file_name());
        let here = InodeId { root: parent.root, ino };
        for e in entries {
            let n = e.file_name();
            put_one(w, &e.path(), here, n.as_encoded_bytes(), stats, links, seen)?;
        }
        // Linking children changed the directory's times; put the source's back.
        set_times(w, here, &a)?;
        return Ok(());
    }
    if md.nlink() > 1 {
        if let Some(first) = links.get(&(md.dev(), md.ino())) {
            w.link(parent.root, parent.ino, name, first.ino, FT_REG_FILE)?;
            stats.hardlinks += 1;
            return Ok(());
        }
    }
    let ino = w.create_file(parent.root, parent.ino, name, &a)?;
    let len = md.len();
    let mut f = std::fs::File::open(src).map_err(|e| io(src, "cannot open", e))?;
    let mut got = 0u64;
    w.write_file_with(parent.root, ino, 0, len, &mut |buf: &mut [u8]| {
        f.read_exact(buf).map_err(|e| io(src, "cannot read (did it change while copying?)", e))?;
        got += buf.len() as u64;
        Ok(())
    })?;
    stats.bytes += got;
    stats.files += 1;
    set_times(w, InodeId { root: parent.root, ino }, &a)?;
    if md.nlink() > 1 {
        links.insert((md.dev(), md.ino()), InodeId { root: parent.root, ino });
    }
    Ok(())
}

fn set_times(w: &mut FsWriter, i: InodeId, a: &InodeAttrs) -> Result<()> {
    let (Some(at), Some(mt)) = (a.atime, a.mtime) else { return Ok(()) };
    w.update_inode(i.root, i.ino, |ii| {
        ii.atime = Timespec { sec: (at.0 as u64).into(), nsec: at.1.into() };
        ii.mtime = Timespec { sec: (mt.0 as u64).into(), nsec: mt.1.into() };
    })
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
    }
    if ftype == FT_DIR {
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
