//! Copy host files into the image (`ubtrfs put`), as `cp -a SRC... DEST` does: regular
//! files (sparse ones stay sparse: only the source's data ranges are written), directories,
//! symlinks, fifos, sockets and device nodes, with mode, owner, atime/mtime, every
//! xattr the host lets us read, and hard links among the copied files.
//!
//! It is a client of the engine, as a program writing on a mount is: names,
//! attributes and data are changes of the engine's running transaction (the data
//! through its page cache and writeback, each file written back once its data is in).
//! Nothing is committed here: the caller syncs (writes dirty data back, commits) when
//! the copy succeeded, and a failure leaves the committed image untouched.
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
use ubtrfs_core::{
    Engine, Error, FsRead, InodeAttrs, InodeId, Load, NewInode, PosixKind, Result, SetAttr,
    TimeSet, WriteOpts, MAX_EXTENT_SIZE,
};
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
    /// File data the whole copy will write, as the scan before it found (for a
    /// progress bar; the files may change meanwhile).
    pub expected_bytes: u64,
}

/// How `put` copies.
#[derive(Clone, Debug, Default)]
pub struct PutOptions {
    /// Copy directories and their contents (`-r`); without it a directory is refused.
    pub recursive: bool,
    /// How host owners become the image's (`mkfs --owner-map`, `--force-owner`).
    pub owners: OwnerMap,
    /// Source directories (as the paths `put` reaches them by) copied as new
    /// subvolumes instead of directories (`mkfs --subvol`). A hard link between a
    /// subvolume and the outside becomes two files, as links cannot cross trees.
    pub subvols: Vec<PathBuf>,
    /// Called after each file, directory or other inode is copied, with the totals so
    /// far (a progress bar).
    pub progress: Option<Progress>,
    /// Give each inode its source's mtime as its atime too (a reproducible build: the
    /// host's atimes change as the source is read).
    pub atime_from_mtime: bool,
}

/// A callback `put` reports its totals to.
#[derive(Clone)]
pub struct Progress(pub std::sync::Arc<dyn Fn(&PutStats) + Send + Sync>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}

/// A mapping of host user and group ids to the image's: `force` gives every inode one
/// owner; otherwise each range maps ids `host..host+count` to `image..image+count`,
/// and ids outside every range stay as they are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnerMap {
    pub force: Option<(u32, u32)>,
    /// (host start, image start, count).
    pub uids: Vec<(u32, u32, u32)>,
    pub gids: Vec<(u32, u32, u32)>,
}

impl OwnerMap {
    /// Every inode owned by `uid`:`gid`.
    pub fn force(uid: u32, gid: u32) -> OwnerMap {
        OwnerMap { force: Some((uid, gid)), ..OwnerMap::default() }
    }

    /// Parse an owner-map file: one mapping per line, `u HOST IMAGE [COUNT]` for user
    /// ids or `g HOST IMAGE [COUNT]` for group ids (COUNT 1 if left out, as in
    /// /etc/subuid ranges); blank lines and `#` comments are skipped. Ranges of one
    /// kind must not overlap on the host side.
    ///
    /// # Errors
    /// `Posix(Invalid)` naming the line.
    pub fn parse(text: &str) -> Result<OwnerMap> {
        let mut m = OwnerMap::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let bad = |why: &str| {
                Error::posix_detail(
                    PosixKind::Invalid,
                    format!("owner map line {}", n + 1),
                    format!("{why}: {line:?}"),
                )
            };
            let f: Vec<&str> = line.split_whitespace().collect();
            if !(3..=4).contains(&f.len()) {
                return Err(bad("expected `u|g HOST IMAGE [COUNT]`"));
            }
            let num = |s: &str| s.parse::<u32>().map_err(|_| bad("not an id"));
            let (host, image) = (num(f[1])?, num(f[2])?);
            let count = if f.len() == 4 { num(f[3])? } else { 1 };
            if count == 0
                || host.checked_add(count - 1).is_none()
                || image.checked_add(count - 1).is_none()
            {
                return Err(bad("the range is empty or runs past the largest id"));
            }
            let v = match f[0] {
                "u" => &mut m.uids,
                "g" => &mut m.gids,
                _ => return Err(bad("the kind must be u or g")),
            };
            if v.iter().any(|&(h, _, c)| host < h + c && h < host + count) {
                return Err(bad("overlaps an earlier range"));
            }
            v.push((host, image, count));
        }
        Ok(m)
    }

    /// The image's (uid, gid) for host (uid, gid).
    pub fn map(&self, uid: u32, gid: u32) -> (u32, u32) {
        if let Some(f) = self.force {
            return f;
        }
        let one = |v: &[(u32, u32, u32)], id: u32| {
            v.iter()
                .find(|&&(h, _, c)| id >= h && id - h < c)
                .map(|&(h, i, _)| i + (id - h))
                .unwrap_or(id)
        };
        (one(&self.uids, uid), one(&self.gids, gid))
    }
}

/// What one `put` carries through its recursion.
struct Ctx<'a> {
    opts: &'a PutOptions,
    stats: PutStats,
    links: HashMap<(u64, u64), InodeId>,
    seen: HashMap<PathBuf, std::fs::Metadata>,
    /// The buffer file data is read into (`copy_data`).
    buf: Vec<u8>,
}

impl Ctx<'_> {
    fn report(&self) {
        if let Some(p) = &self.opts.progress {
            (p.0)(&self.stats);
        }
    }
}

fn io(path: &Path, what: &str, e: std::io::Error) -> Error {
    Error::io(format!("{what} {}", ubtrfs_core::quote::path(path)), e)
}

fn attrs(md: &std::fs::Metadata, opts: &PutOptions) -> InodeAttrs {
    let mut a = attrs_of(md, &opts.owners);
    if opts.atime_from_mtime {
        a.atime = a.mtime;
    }
    a
}

fn attrs_of(md: &std::fs::Metadata, owners: &OwnerMap) -> InodeAttrs {
    let rdev = if md.file_type().is_char_device() || md.file_type().is_block_device() {
        rdev_encode(libc::major(md.rdev()), libc::minor(md.rdev()))
    } else {
        0
    };
    let (uid, gid) = owners.map(md.uid(), md.gid());
    InodeAttrs {
        mode: md.mode(),
        uid,
        gid,
        rdev,
        atime: Some((md.atime(), md.atime_nsec() as u32)),
        mtime: Some((md.mtime(), md.mtime_nsec() as u32)),
        flags: 0,
    }
}

/// Record every directory's metadata before this scan reads it (reading a directory
/// updates its atime, and the copy keeps the atime from before), and refuse a
/// directory without `recursive`. Files are stat'ed again when they are copied, so
/// memory stays bounded by the number of directories.
/// Returns the data bytes the copy will write (each regular file's length, or its
/// allocated bytes when fewer: holes are not written), for a progress bar.
fn prescan(
    src: &Path,
    recursive: bool,
    seen: &mut HashMap<PathBuf, std::fs::Metadata>,
) -> Result<u64> {
    let md = std::fs::symlink_metadata(src).map_err(|e| io(src, "cannot stat", e))?;
    if md.is_dir() {
        seen.insert(src.to_path_buf(), md);
        if !recursive {
            return Err(Error::posix_detail(
                PosixKind::IsDir,
                ubtrfs_core::quote::path(src),
                "use -r",
            ));
        }
        let mut total = 0u64;
        for e in std::fs::read_dir(src).map_err(|e| io(src, "cannot read", e))? {
            let e = e.map_err(|e| io(src, "cannot read", e))?;
            total = total.saturating_add(prescan(&e.path(), true, seen)?);
        }
        return Ok(total);
    }
    Ok(if md.is_file() { md.len().min(md.blocks().saturating_mul(512)) } else { 0 })
}

/// The host file name of `p` (`..` and `/` have none).
fn base_name(p: &Path) -> Result<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    match p.file_name() {
        Some(n) => Ok(n.as_bytes().to_vec()),
        None => Err(Error::posix_detail(
            PosixKind::Invalid,
            ubtrfs_core::quote::path(p),
            "the source has no name to copy it under",
        )),
    }
}

/// Copy `srcs` to `dest` in the image (see the module documentation).
///
/// # Errors
/// `Posix` for a target that cannot take the copy (NotDir, Exists, IsDir without -r);
/// host I/O errors naming the path; engine errors.
pub fn put(e: &Engine, srcs: &[&Path], dest: &str, opts: &PutOptions) -> Result<PutStats> {
    let dest = crate::edit::absolute(dest)?;
    if srcs.is_empty() {
        return Err(Error::posix_detail(PosixKind::Invalid, dest.to_string(), "nothing to copy"));
    }
    let mut seen = HashMap::new();
    let mut expected = 0u64;
    for s in srcs {
        expected = expected.saturating_add(prescan(s, opts.recursive, &mut seen)?);
    }
    for s in &opts.subvols {
        if !seen.get(s).is_some_and(|m| m.is_dir()) {
            return Err(Error::posix_detail(
                PosixKind::NotDir,
                ubtrfs_core::quote::path(s),
                "a subvolume must be a directory of the source",
            ));
        }
    }
    let dest_dir = match e.read(|l| l.resolve_id(dest, true)) {
        Ok(id) if e.read(|l| l.load_inode(id, Load::ITEM))?.item.mode.get() & S_IFMT == S_IFDIR => {
            Some(id)
        }
        Ok(_) if dest.ends_with('/') => {
            return Err(Error::posix(PosixKind::NotDir, ubtrfs_core::quote::name(dest.as_bytes())))
        }
        Ok(_) => None,
        Err(e) if e.posix_kind() == Some(PosixKind::NotFound) => None,
        Err(e) => return Err(e),
    };
    let mut ctx = Ctx {
        opts,
        stats: PutStats { expected_bytes: expected, ..PutStats::default() },
        links: HashMap::new(),
        seen,
        buf: Vec::new(),
    };
    match dest_dir {
        Some(dir) => {
            for s in srcs {
                let name = base_name(s)?;
                put_one(e, s, dir, &name, &child_path(dest.as_bytes(), &name), &mut ctx)?;
            }
        }
        None => {
            if srcs.len() > 1 {
                return Err(Error::posix_detail(
                    PosixKind::NotDir,
                    ubtrfs_core::quote::name(dest.as_bytes()),
                    "several sources need an existing directory to copy into",
                ));
            }
            if dest.ends_with('/') && !ctx.seen.contains_key(srcs[0]) {
                return Err(Error::posix_detail(
                    PosixKind::NotDir,
                    ubtrfs_core::quote::name(dest.as_bytes()),
                    "a trailing / names a directory, and the source is not one",
                ));
            }
            let (parent, name) = e.read(|l| l.resolve_parent(dest))?;
            put_one(e, srcs[0], parent, &name, dest.trim_end_matches('/').as_bytes(), &mut ctx)?;
        }
    }
    Ok(ctx.stats)
}

/// Copy the contents of host directory `src` into the existing directory `dir` of the
/// image, with `src`'s own owner, mode, times and xattrs given to `dir` (`mkfs
/// --rootdir`: the source becomes the top directory).
///
/// # Errors
/// As `put`.
pub fn put_contents(e: &Engine, src: &Path, dir: InodeId, opts: &PutOptions) -> Result<PutStats> {
    let mut seen = HashMap::new();
    let expected = prescan(src, true, &mut seen)?;
    for s in &opts.subvols {
        if !seen.get(s).is_some_and(|m| m.is_dir()) || s == src {
            return Err(Error::posix_detail(
                PosixKind::NotDir,
                ubtrfs_core::quote::path(s),
                "a subvolume must be a directory inside the source",
            ));
        }
    }
    let md = seen.get(src).cloned().expect("prescan recorded the source directory");
    let mut ctx = Ctx {
        opts,
        stats: PutStats { expected_bytes: expected, ..PutStats::default() },
        links: HashMap::new(),
        seen,
        buf: Vec::new(),
    };
    copy_dir_into(e, src, dir, &md, true, b"/", &mut ctx).map_err(|e| said_of(e, None, b"/"))?;
    Ok(ctx.stats)
}

/// The image path of entry `name` of the directory at image path `dir`.
fn child_path(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = dir.to_vec();
    if !p.ends_with(b"/") {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

/// An engine error met while `put` made the object at image path `at`, said of that
/// path, which the user knows, rather than of an inode number they never saw: an error
/// whose object is an inode (`root=5 ino=258`) other than the directory `parent` it
/// goes into names `at` instead, and a refusal for want of space or quota that names
/// no image path (metadata space, a chunk) is said `at` it. Errors of the objects
/// inside a directory are said of their own paths already (the engine never names an
/// image path: one starting with `/` was named here). (The kernel's write(2) says only
/// ENOSPC, and cp names the file it was writing: "/big: no space left on device (N
/// bytes of data space are needed, M are free, ...)".)
fn said_of(e: Error, parent: Option<InodeId>, at: &[u8]) -> Error {
    let here = ubtrfs_core::quote::name(at).into_owned();
    match e {
        Error::Posix { kind, path, detail }
            if inode_named(&path).is_some_and(|id| Some(id) != parent) =>
        {
            Error::Posix { kind, path: here, detail }
        }
        Error::Posix { kind: PosixKind::NoSpace | PosixKind::QuotaExceeded, ref path, .. }
            if !path.starts_with('/') =>
        {
            e.at(here)
        }
        e => e,
    }
}

/// The inode `p` names when it is an inode's ids and nothing more (`root=R ino=I`, as
/// `InodeId` prints).
fn inode_named(p: &str) -> Option<InodeId> {
    let (root, ino) = p.strip_prefix("root=")?.split_once(" ino=")?;
    let number =
        |s: &str| s.bytes().all(|b| b.is_ascii_digit()).then(|| s.parse::<u64>().ok()).flatten();
    Some(InodeId { root: number(root)?, ino: number(ino)? })
}

/// Copy the entries of host directory `src` (whose metadata is `md`) into `here`, then
/// give `here` the source's owner, xattrs, mode and times. `at` is `here`'s image path.
#[allow(clippy::too_many_arguments)]
fn copy_dir_into(
    e: &Engine,
    src: &Path,
    here: InodeId,
    md: &std::fs::Metadata,
    set_mode: bool,
    at: &[u8],
    ctx: &mut Ctx<'_>,
) -> Result<()> {
    let a = attrs(md, ctx.opts);
    let mut entries: Vec<_> = std::fs::read_dir(src)
        .map_err(|e| io(src, "cannot read", e))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| io(src, "cannot read", e))?;
    // Byte order of the names, not the host's readdir order: the same tree gives the
    // same image.
    entries.sort_by_key(|e| e.file_name());
    for ent in entries {
        let n = ent.file_name();
        put_one(
            e,
            &ent.path(),
            here,
            n.as_encoded_bytes(),
            &child_path(at, n.as_encoded_bytes()),
            ctx,
        )?;
    }
    let chowned = set_owner(e, here, &a)?;
    copy_xattrs(e, src, None, here)?;
    // Linking children changed the directory's times; the source's go back last.
    finish_attrs(e, here, &a, set_mode || chowned)?;
    ctx.report();
    Ok(())
}

/// Copy `src` as entry `name` of `parent`, whose image path is `at`; errors are said
/// of `at`.
fn put_one(
    e: &Engine,
    src: &Path,
    parent: InodeId,
    name: &[u8],
    at: &[u8],
    ctx: &mut Ctx<'_>,
) -> Result<()> {
    put_one_inner(e, src, parent, name, at, ctx).map_err(|e| said_of(e, Some(parent), at))
}

fn put_one_inner(
    e: &Engine,
    src: &Path,
    parent: InodeId,
    name: &[u8],
    at: &[u8],
    ctx: &mut Ctx<'_>,
) -> Result<()> {
    let md = match ctx.seen.get(src) {
        Some(m) => m.clone(),
        None => {
            let m = std::fs::symlink_metadata(src).map_err(|e| io(src, "cannot stat", e))?;
            if m.is_dir() {
                return Err(Error::posix(
                    PosixKind::Invalid,
                    format!(
                        "{} changed while copying (it became a directory)",
                        ubtrfs_core::quote::path(src)
                    ),
                ));
            }
            m
        }
    };
    let a = attrs(&md, ctx.opts);
    let existing = e.read(|l| l.lookup(parent, name))?;
    let ft = md.file_type();
    if ft.is_dir() {
        let subvol = ctx.opts.subvols.iter().any(|p| p == src);
        let (here, set_mode) = match &existing {
            // cp -a merges into a directory of the same name.
            Some(e) if e.ftype == FT_DIR && !subvol => (e.target, true),
            Some(_) if subvol => {
                return Err(Error::posix_detail(
                    PosixKind::Exists,
                    ubtrfs_core::quote::name(name),
                    "cannot make a subvolume over an existing name",
                ))
            }
            Some(_) => {
                return Err(Error::posix_detail(
                    PosixKind::NotDir,
                    ubtrfs_core::quote::name(name),
                    "cannot put a directory over a non-directory",
                ))
            }
            None if subvol => {
                let id = e.create_subvol(parent, name, &a)?;
                ctx.stats.dirs += 1;
                (ubtrfs_core::subvol_top(id), true)
            }
            None => {
                let id = e.create_exact(parent, name, NewInode::Dir, &a)?;
                ctx.stats.dirs += 1;
                (id, false)
            }
        };
        return copy_dir_into(e, src, here, &md, set_mode, at, ctx);
    }
    if md.nlink() > 1 {
        // A hard link to an inode of another tree (across a subvolume boundary)
        // cannot be: that name becomes a copy of its own.
        if let Some(first) = ctx.links.get(&(md.dev(), md.ino())).filter(|f| f.root == parent.root)
        {
            if existing.is_some() {
                return Err(Error::posix(PosixKind::Exists, ubtrfs_core::quote::name(name)));
            }
            e.link(*first, parent, name)?;
            ctx.stats.hardlinks += 1;
            return Ok(());
        }
    }
    let id = if ft.is_file() {
        let id = match &existing {
            // cp overwrites a regular file in place (the inode stays).
            Some(t) if t.ftype == FT_REG_FILE => {
                e.setattr(t.target, &SetAttr { size: Some(0), ..Default::default() })?;
                t.target
            }
            Some(_) => return Err(Error::posix(PosixKind::Exists, ubtrfs_core::quote::name(name))),
            None => e.create_exact(parent, name, NewInode::File, &a)?,
        };
        let f = std::fs::File::open(src).map_err(|e| io(src, "cannot open", e))?;
        ctx.stats.bytes += copy_data(e, src, &f, id, &md, &mut ctx.buf)?;
        let chowned = set_owner(e, id, &a)?;
        copy_xattrs(e, src, Some(&f), id)?;
        ctx.stats.files += 1;
        finish_attrs(e, id, &a, existing.is_some() || chowned)?;
        id
    } else {
        if existing.is_some() {
            return Err(Error::posix(PosixKind::Exists, ubtrfs_core::quote::name(name)));
        }
        let id = if ft.is_symlink() {
            use std::os::unix::ffi::OsStrExt;
            let target = std::fs::read_link(src).map_err(|e| io(src, "cannot read the link", e))?;
            ctx.stats.symlinks += 1;
            e.create_exact(parent, name, NewInode::Symlink(target.as_os_str().as_bytes()), &a)?
        } else {
            ctx.stats.special += 1;
            e.create_exact(parent, name, NewInode::Special, &a)?
        };
        let chowned = set_owner(e, id, &a)?;
        copy_xattrs(e, src, None, id)?;
        finish_attrs(e, id, &a, !ft.is_symlink() || chowned)?;
        id
    };
    if md.nlink() > 1 {
        ctx.links.entry((md.dev(), md.ino())).or_insert(id);
    }
    ctx.report();
    Ok(())
}

/// Copy every extended attribute of host path `src` (not following a symlink; through
/// `open`, its open descriptor, when the caller has one: no second lookup of the path)
/// to the inode: every namespace the host lets us read (user, security, trusted as
/// root, system.posix_acl_*), as cp -a does.
fn copy_xattrs(e: &Engine, src: &Path, open: Option<&std::fs::File>, id: InodeId) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::io::AsRawFd;
    let c = std::ffi::CString::new(src.as_os_str().as_bytes())
        .map_err(|_| Error::posix(PosixKind::Invalid, ubtrfs_core::quote::path(src)))?;
    let fd = open.map(|f| f.as_raw_fd());
    let list = |buf: &mut [u8]| -> std::io::Result<usize> {
        // SAFETY: flistxattr and llistxattr write at most buf.len() bytes into buf;
        // `fd` stays open while `open` is borrowed.
        let n = unsafe {
            match fd {
                Some(fd) => libc::flistxattr(fd, buf.as_mut_ptr().cast(), buf.len()),
                None => libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()),
            }
        };
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
            // SAFETY: fgetxattr and lgetxattr write at most buf.len() bytes into buf.
            let r = unsafe {
                match fd {
                    Some(fd) => {
                        libc::fgetxattr(fd, cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
                    }
                    None => {
                        libc::lgetxattr(c.as_ptr(), cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
                    }
                }
            };
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
            Err(e) => {
                return Err(io(
                    src,
                    &format!("cannot read xattr {} of", String::from_utf8_lossy(name)),
                    e,
                ))
            }
        };
        let mut v = vec![0u8; len];
        let got = get(&mut v).map_err(|e| {
            io(src, &format!("cannot read xattr {} of", String::from_utf8_lossy(name)), e)
        })?;
        v.truncate(got);
        e.setxattr(id, name, &v, 0, false).map_err(|e| {
            e.at(format!(
                "{}: xattr {}",
                ubtrfs_core::quote::path(src),
                String::from_utf8_lossy(name)
            ))
        })?;
    }
    Ok(())
}

/// The source's owner, for an inode that has another (one that existed, or a
/// symlink, which is made root's): before the xattrs, as cp -a orders it, since a chown
/// takes a non-directory's file capabilities. Returns whether the owner changed (a
/// chown clears set-ID bits: the mode is set again after).
fn set_owner(e: &Engine, id: InodeId, a: &InodeAttrs) -> Result<bool> {
    if a.atime.is_none() || a.mtime.is_none() {
        return Ok(false);
    }
    let cur = e.getattr(id)?;
    if cur.uid.get() == a.uid && cur.gid.get() == a.gid {
        return Ok(false);
    }
    e.setattr(id, &SetAttr::chown(Some(a.uid), Some(a.gid)))?;
    Ok(true)
}

/// The mode (for an inode that existed or changed owner; a symlink has none to set),
/// then the source's times, last.
fn finish_attrs(e: &Engine, id: InodeId, a: &InodeAttrs, mode: bool) -> Result<()> {
    let (Some(at), Some(mt)) = (a.atime, a.mtime) else { return Ok(()) };
    let mut s = SetAttr {
        atime: Some(TimeSet::At(at.0, at.1)),
        mtime: Some(TimeSet::At(mt.0, mt.1)),
        ..Default::default()
    };
    let cur = e.getattr(id)?;
    if mode && cur.mode.get() & S_IFMT != S_IFLNK {
        s.mode = Some(a.mode & 0o7777);
    }
    e.setattr(id, &s)
}

/// Bytes of a source file read and written at a time.
const COPY_CHUNK: u64 = 1 << 20;

/// Write the data ranges of source `src`, open as `f` with metadata `md` (holes stay
/// holes), and set the size, reading through `buf`. Returns the bytes written.
fn copy_data(
    e: &Engine,
    src: &Path,
    mut f: &std::fs::File,
    id: InodeId,
    md: &std::fs::Metadata,
    buf: &mut Vec<u8>,
) -> Result<u64> {
    use std::os::unix::io::AsRawFd;
    let len = md.len();
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
    // Only a file with fewer blocks than its size needs is searched for its data
    // (SEEK_DATA / SEEK_HOLE), as cp decides (coreutils' `is_probably_sparse`): two
    // system calls per file saved on the many that have no holes.
    let mut ranges = Vec::new();
    let probably_sparse = md.blocks() < len / 512;
    if !probably_sparse && len > 0 {
        ranges.push((0, len));
    }
    let mut pos = if probably_sparse { 0 } else { len };
    while pos < len {
        let Some(start) =
            seek(pos, libc::SEEK_DATA).map_err(|e| io(src, "cannot find data in", e))?
        else {
            break;
        };
        if start >= len {
            break;
        }
        let end = seek(start, libc::SEEK_HOLE)
            .map_err(|e| io(src, "cannot find holes in", e))?
            .unwrap_or(len)
            .min(len);
        ranges.push((start, end));
        pos = end;
    }
    // Through the page cache, as cp's write(2)s go on a mount, then written back at
    // once: the file's data leaves memory before the next file comes, and the inode
    // item and its leaf are still at hand for the completion. A large file is written
    // back at every `MAX_EXTENT_SIZE` of dirty data, so its extents are of that size
    // and the cache holds at most that much of it.
    // The writes leave the times alone (`no_cmtime`): the source's are set after.
    let opts = WriteOpts { no_cmtime: true, ..WriteOpts::default() };
    // A file the data space cannot hold is refused before any of it is written.
    let total: u64 = ranges.iter().map(|r| r.1 - r.0).sum();
    e.check_data_space(id, 0, total)?;
    let mut written = 0;
    let mut dirty = 0u64;
    // Where the descriptor reads next: at 0 as opened, unless the search moved it.
    let mut at = if probably_sparse { None } else { Some(0) };
    for &(start, end) in &ranges {
        use std::io::Seek;
        if at != Some(start) {
            f.seek(std::io::SeekFrom::Start(start)).map_err(|e| io(src, "cannot seek", e))?;
        }
        at = Some(end);
        let mut pos = start;
        while pos < end {
            let n = (end - pos).min(COPY_CHUNK).min(MAX_EXTENT_SIZE - dirty);
            buf.resize(n as usize, 0);
            f.read_exact(buf)
                .map_err(|e| io(src, "cannot read (did it change while copying?)", e))?;
            e.buffered_write_opts(id, pos, buf, opts)?;
            pos += n;
            dirty += n;
            if dirty == MAX_EXTENT_SIZE {
                e.writeback_inode(id)?;
                dirty = 0;
            }
        }
        written += end - start;
    }
    e.writeback_inode(id)?;
    // The file was empty before the copy: its size is the end of the last range, and a
    // hole at the end takes a truncate to the source's size.
    let size = ranges.last().map_or(0, |r| r.1);
    if size != len {
        e.setattr(id, &SetAttr { size: Some(len), ..Default::default() })?;
    }
    Ok(written)
}

/// Remove `path` from the image (`ubtrfs rm`); directories need `recursive` unless empty.
/// As `rm -r` on a kernel mount: the contents go first, depth first in directory
/// order, each through the engine's unlink(2) and rmdir(2) (`Engine::unlink`,
/// `Engine::rmdir`), and an rmdir of a subvolume (now empty) deletes it as the kernel's
/// `btrfs_rmdir` does (`delete_subvol`): subvolumes nested anywhere below go the same
/// way, an empty read-only snapshot goes, one with contents is EROFS at its first
/// entry, and the default subvolume is EPERM. Unlike rm on a mount, a refusal part way
/// leaves nothing removed: the engine runs one transaction (`offline_engine`) and the
/// caller commits nothing.
///
/// # Errors
/// `Posix` NotFound / IsDir / NotEmpty / ReadOnly / NotPermitted; engine errors.
pub fn remove(e: &Engine, path: &str, recursive: bool) -> Result<u64> {
    let (parent, name) = e.read(|l| l.resolve_parent(path))?;
    let entry = e.read(|l| l.lookup(parent, &name))?.ok_or_else(|| {
        Error::posix(PosixKind::NotFound, ubtrfs_core::quote::name(path.as_bytes()))
    })?;
    let ftype = entry.ftype;
    if ftype == FT_DIR
        && !recursive
        && e.read(|l| l.load_inode(entry.target, Load::ITEM))?.size() != 0
    {
        return Err(Error::posix_detail(
            PosixKind::IsDir,
            ubtrfs_core::quote::name(path.as_bytes()),
            "use -r",
        ));
    }
    let mut count = 0;
    if ftype == FT_DIR {
        count += remove_dir_contents(e, entry.target, path)?;
        e.rmdir(parent, &name).map_err(|err| removing(err, &name, path))?;
    } else {
        e.unlink(parent, &name).map_err(|err| removing(err, &name, path))?;
    }
    Ok(count + 1)
}

fn remove_dir_contents(e: &Engine, dir: InodeId, path: &str) -> Result<u64> {
    let entries = e.read(|l| l.readdir(dir))?;
    let mut count = 0;
    for ent in entries {
        let child_path = format!("{path}/{}", ubtrfs_core::quote::name(&ent.name));
        if ent.ftype == FT_DIR {
            count += remove_dir_contents(e, ent.target, &child_path)?;
            e.rmdir(dir, &ent.name).map_err(|err| removing(err, &ent.name, &child_path))?;
        } else {
            e.unlink(dir, &ent.name).map_err(|err| removing(err, &ent.name, &child_path))?;
        }
        count += 1;
    }
    Ok(count)
}

/// A refused unlink or rmdir of entry `name`, said of its image path `path` (as rm
/// says "cannot remove 'k/ro/s': Read-only file system"): an error naming the entry
/// names the path instead; any other (one naming the read-only subvolume, say) is
/// said at the path. The path given on the command line names itself already.
fn removing(e: Error, name: &[u8], path: &str) -> Error {
    let shown = ubtrfs_core::quote::name(path.as_bytes()).into_owned();
    match e {
        Error::Posix { kind, path: p, detail } if p == ubtrfs_core::quote::name(name) => {
            Error::Posix { kind, path: shown, detail }
        }
        Error::Posix { ref path, .. } if *path == shown => e,
        e => e.at(shown),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_maps() {
        let m = OwnerMap::parse(
            "# rootless build\nu 1000 0\ng 1000 0\nu 100000 1 65536 # the rest\n\n",
        )
        .unwrap();
        assert_eq!(m.map(1000, 1000), (0, 0));
        assert_eq!(m.map(100000, 1000), (1, 0));
        assert_eq!(m.map(165535, 5), (65536, 5));
        assert_eq!(m.map(165536, 5), (165536, 5), "outside every range: unchanged");
        assert_eq!(OwnerMap::force(0, 0).map(1234, 99), (0, 0));
        for bad in [
            "x 1 2",
            "u 1",
            "u a 2",
            "u 1 2 0",
            "u 4294967295 0 2",
            "u 10 0 5\nu 12 100",
            "u 1 2 3 4",
        ] {
            let e = OwnerMap::parse(bad).expect_err(bad);
            assert!(e.to_string().contains("owner map line"), "{bad}: {e}");
        }
    }
}
