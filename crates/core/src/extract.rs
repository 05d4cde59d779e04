//! Copy a tree out of the image into a host directory, preserving contents (sparse
//! files stay sparse), mode, owner, atime/mtime, symlinks, hard links, user.* xattrs,
//! fifos, sockets and device nodes.
//!
//! Safety against crafted images: every name is checked ('/', NUL, "." and ".." and
//! empty names are refused), every object is created relative to an open directory
//! descriptor with O_EXCL/O_NOFOLLOW semantics, nothing existing is ever replaced, and
//! directory loops or multiply-linked directories are errors. So nothing is written
//! outside DEST, whatever the image holds.

use crate::error::{Error, PosixKind, Result};
use crate::file::DecompressCache;
use crate::fs::{FileKind, Filesystem, InodeId, InodeView, Load};
use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use ubtrfs_format::structs::rdev_decode;
use ubtrfs_format::{Corrupt, CorruptWhere};

/// Counters reported to the progress callback and returned at the end.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtractStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    pub specials: u64,
    pub bytes: u64,
    /// Things that could not be preserved (e.g. owners when not root).
    pub skipped: Vec<String>,
}

/// How deep directories may nest; each level holds one open descriptor.
pub const MAX_DEPTH: usize = 2048;
/// Buffer size for data copies.
const COPY_CHUNK: usize = 4 << 20;

struct Ctx<'a> {
    fs: &'a Filesystem,
    stats: ExtractStats,
    links: HashMap<InodeId, PathBuf>,
    visited_dirs: HashSet<InodeId>,
    is_root: bool,
    progress: &'a mut dyn FnMut(&ExtractStats),
    buf: Vec<u8>,
    /// The descriptor hard-link paths in `links` are relative to.
    root_fd: i32,
}

fn cstr(b: &[u8], what: &str) -> Result<CString> {
    CString::new(b).map_err(|_| Error::posix(PosixKind::Invalid, format!("{what}: name contains NUL")))
}

fn os_err(what: String) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

fn check_name(dir: InodeId, name: &[u8]) -> Result<()> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0) {
        let mut c = Corrupt::new(CorruptWhere::Item, format!("refusing unsafe directory entry name {:?}", String::from_utf8_lossy(name))).root(dir.root);
        c.ino = Some(dir.ino);
        return Err(c.into());
    }
    Ok(())
}

/// Extract `src` into `dest`. A directory's contents go into `dest` (created if needed,
/// existing entries are never replaced); any other file becomes `dest` itself.
///
/// # Errors
/// `Io` naming the host path, `Corrupt` for unsafe names or loops, engine errors.
pub fn extract(fs: &Filesystem, src: &InodeView, dest: &Path, progress: &mut dyn FnMut(&ExtractStats)) -> Result<ExtractStats> {
    raise_fd_limit();
    // SAFETY: geteuid has no preconditions.
    let is_root = unsafe { libc::geteuid() } == 0;
    let mut ctx = Ctx { fs, stats: ExtractStats::default(), links: HashMap::new(), visited_dirs: HashSet::new(), is_root, progress, buf: vec![0u8; COPY_CHUNK], root_fd: libc::AT_FDCWD };
    if src.kind() == FileKind::Dir {
        std::fs::create_dir_all(dest).map_err(|e| Error::io(format!("cannot create {}", dest.display()), e))?;
        let d = cstr(dest.as_os_str().as_encoded_bytes(), "destination")?;
        // SAFETY: d is a valid C string; the returned fd is owned below.
        let fd = unsafe { libc::open(d.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(os_err(format!("cannot open {}", dest.display())));
        }
        // SAFETY: fd was just opened and is owned by nobody else.
        let dirfd = unsafe { OwnedFd::from_raw_fd(fd) };
        ctx.root_fd = dirfd.as_raw_fd();
        ctx.visited_dirs.insert(src.id);
        ctx.stats.dirs += 1;
        extract_dir(&mut ctx, &dirfd, src, &PathBuf::new(), 0, &dest.display().to_string())?;
        finish_meta(&mut ctx, &dirfd, None, src, &dest.display().to_string())?;
    } else {
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name = dest.file_name().ok_or_else(|| Error::posix(PosixKind::Invalid, dest.display().to_string()))?;
        let p = cstr(parent.as_os_str().as_encoded_bytes(), "destination")?;
        // SAFETY: p is a valid C string.
        let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(os_err(format!("cannot open {}", parent.display())));
        }
        // SAFETY: fd was just opened.
        let dirfd = unsafe { OwnedFd::from_raw_fd(fd) };
        extract_one(&mut ctx, &dirfd, name.as_encoded_bytes(), src, &PathBuf::from(name), 0, &dest.display().to_string())?;
    }
    (ctx.progress)(&ctx.stats);
    Ok(ctx.stats)
}

fn raise_fd_limit() {
    // SAFETY: plain getrlimit/setrlimit on a local struct.
    unsafe {
        let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max.min(1 << 20);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

fn extract_dir(ctx: &mut Ctx<'_>, dirfd: &OwnedFd, dir: &InodeView, rel: &Path, depth: usize, host: &str) -> Result<()> {
    if depth >= MAX_DEPTH {
        return Err(Error::posix(PosixKind::NameTooLong, format!("{host}: directories nest deeper than {MAX_DEPTH}")));
    }
    for e in &dir.entries {
        check_name(dir.id, &e.name)?;
        let child = ctx.fs.load_inode(e.target, Load { xattrs: true, extents: true, entries: true })?;
        let child_rel = rel.join(std::ffi::OsStr::from_bytes_compat(&e.name));
        let child_host = format!("{host}/{}", String::from_utf8_lossy(&e.name));
        extract_one(ctx, dirfd, &e.name, &child, &child_rel, depth + 1, &child_host)?;
    }
    Ok(())
}

trait FromBytesCompat {
    fn from_bytes_compat(b: &[u8]) -> &std::ffi::OsStr;
}
impl FromBytesCompat for std::ffi::OsStr {
    fn from_bytes_compat(b: &[u8]) -> &std::ffi::OsStr {
        use std::os::unix::ffi::OsStrExt;
        std::ffi::OsStr::from_bytes(b)
    }
}

fn extract_one(ctx: &mut Ctx<'_>, dirfd: &OwnedFd, name: &[u8], ino: &InodeView, rel: &Path, depth: usize, host: &str) -> Result<()> {
    let cname = cstr(name, host)?;
    let dfd = dirfd.as_raw_fd();
    let kind = ino.kind();
    if kind != FileKind::Dir && ino.nlink() > 1 {
        if let Some(first) = ctx.links.get(&ino.id) {
            let cfirst = cstr(first.as_os_str().as_encoded_bytes(), host)?;
            // The first path was created by us, relative to the extraction root.
            let root_fd = ctx.root_fd;
            // SAFETY: valid fds and C strings; flags 0 means do not follow symlinks.
            let rc = unsafe { libc::linkat(root_fd, cfirst.as_ptr(), dfd, cname.as_ptr(), 0) };
            if rc != 0 {
                return Err(os_err(format!("cannot link {host} to {}", first.display())));
            }
            ctx.stats.hardlinks += 1;
            return Ok(());
        }
    }
    match kind {
        FileKind::Dir => {
            if !ctx.visited_dirs.insert(ino.id) {
                let mut c = Corrupt::new(CorruptWhere::Item, "directory reached twice (loop or extra hard link)").root(ino.id.root);
                c.ino = Some(ino.id.ino);
                return Err(c.into());
            }
            // SAFETY: valid fd and C string.
            if unsafe { libc::mkdirat(dfd, cname.as_ptr(), 0o700) } != 0 {
                return Err(os_err(format!("cannot create directory {host}")));
            }
            // SAFETY: valid fd and C string; O_NOFOLLOW refuses a symlink swapped in.
            let fd = unsafe { libc::openat(dfd, cname.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(os_err(format!("cannot open directory {host}")));
            }
            // SAFETY: fd was just opened.
            let sub = unsafe { OwnedFd::from_raw_fd(fd) };
            ctx.stats.dirs += 1;
            extract_dir(ctx, &sub, ino, rel, depth, host)?;
            finish_meta(ctx, &sub, None, ino, host)?;
        }
        FileKind::File => {
            // SAFETY: valid fd and C string.
            let fd = unsafe { libc::openat(dfd, cname.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0o600) };
            if fd < 0 {
                return Err(os_err(format!("cannot create {host}")));
            }
            // SAFETY: fd was just opened.
            let f = unsafe { OwnedFd::from_raw_fd(fd) };
            copy_data(ctx, &f, ino, host)?;
            ctx.stats.files += 1;
            finish_meta(ctx, &f, None, ino, host)?;
        }
        FileKind::Symlink => {
            let target = ctx.fs.readlink(ino.id)?;
            let ct = cstr(&target, host)?;
            // SAFETY: valid C strings and fd.
            if unsafe { libc::symlinkat(ct.as_ptr(), dfd, cname.as_ptr()) } != 0 {
                return Err(os_err(format!("cannot create symlink {host}")));
            }
            ctx.stats.symlinks += 1;
            finish_meta(ctx, dirfd, Some(&cname), ino, host)?;
        }
        FileKind::Fifo | FileKind::CharDev | FileKind::BlockDev | FileKind::Socket => {
            let (maj, min) = rdev_decode(ino.item.rdev.get());
            let dev = libc::makedev(maj, min);
            let ftype = match kind {
                FileKind::Fifo => libc::S_IFIFO,
                FileKind::CharDev => libc::S_IFCHR,
                FileKind::BlockDev => libc::S_IFBLK,
                _ => libc::S_IFSOCK,
            };
            // SAFETY: valid fd and C string.
            if unsafe { libc::mknodat(dfd, cname.as_ptr(), ftype | 0o600, dev) } != 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EPERM) && !ctx.is_root {
                    ctx.stats.skipped.push(format!("{host}: device node needs root"));
                    return Ok(());
                }
                return Err(Error::io(format!("cannot create {host}"), err));
            }
            ctx.stats.specials += 1;
            finish_meta(ctx, dirfd, Some(&cname), ino, host)?;
        }
    }
    if kind != FileKind::Dir && ino.nlink() > 1 {
        ctx.links.insert(ino.id, rel.to_path_buf());
    }
    if (ctx.stats.files + ctx.stats.dirs).is_multiple_of(256) {
        (ctx.progress)(&ctx.stats);
    }
    Ok(())
}

fn copy_data(ctx: &mut Ctx<'_>, f: &OwnedFd, ino: &InodeView, host: &str) -> Result<()> {
    let size = ino.size();
    let mut cache = DecompressCache::default();
    let fd = f.as_raw_fd();
    for e in &ino.extents {
        if e.is_hole_like() || e.file_offset >= size {
            continue;
        }
        let mut pos = e.file_offset;
        let end = e.end().min(size);
        while pos < end {
            let n = ((end - pos) as usize).min(COPY_CHUNK);
            let buf = &mut ctx.buf[..n];
            let got = ctx.fs.read_at_cached(ino, pos, buf, &mut cache)?;
            let mut done = 0;
            while done < got {
                // SAFETY: buf is valid for got bytes; fd is open for writing.
                let w = unsafe { libc::pwrite(fd, buf[done..got].as_ptr().cast(), got - done, (pos + done as u64) as libc::off_t) };
                if w < 0 {
                    return Err(os_err(format!("write to {host}")));
                }
                done += w as usize;
            }
            ctx.stats.bytes += got as u64;
            pos += got as u64;
            if got == 0 {
                break;
            }
        }
    }
    // SAFETY: fd is open for writing.
    if unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
        return Err(os_err(format!("truncate {host}")));
    }
    Ok(())
}

/// Apply owner, mode, xattrs and times. `name` set = operate on `dirfd/name` without
/// following symlinks; unset = operate on `fd` itself.
fn finish_meta(ctx: &mut Ctx<'_>, fd: &OwnedFd, name: Option<&CString>, ino: &InodeView, host: &str) -> Result<()> {
    let raw = fd.as_raw_fd();
    let uid = ino.item.uid.get();
    let gid = ino.item.gid.get();
    let kind = ino.kind();
    // SAFETY (all calls below): valid fds, C strings and local structs.
    let rc = match name {
        Some(n) => unsafe { libc::fchownat(raw, n.as_ptr(), uid, gid, libc::AT_SYMLINK_NOFOLLOW) },
        None => unsafe { libc::fchown(raw, uid, gid) },
    };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if ctx.is_root || err.raw_os_error() != Some(libc::EPERM) {
            return Err(Error::io(format!("cannot chown {host}"), err));
        }
        if ctx.stats.skipped.len() < 1000 {
            ctx.stats.skipped.push(format!("{host}: owner {uid}:{gid} not kept (not root)"));
        }
    }
    if kind != FileKind::Symlink {
        let mode = ino.mode() & 0o7777;
        let rc = match name {
            Some(n) => unsafe { libc::fchmodat(raw, n.as_ptr(), mode, 0) },
            None => unsafe { libc::fchmod(raw, mode) },
        };
        if rc != 0 {
            return Err(os_err(format!("cannot chmod {host}")));
        }
    }
    if name.is_none() {
        for (k, v) in &ino.xattrs {
            if !k.starts_with(b"user.") {
                continue;
            }
            let ck = cstr(k, host)?;
            let rc = unsafe { libc::fsetxattr(raw, ck.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
            if rc != 0 {
                let err = std::io::Error::last_os_error();
                // The destination filesystem's limits (ext4 keeps all xattrs of an inode
                // in one block; some filesystems have none) lose the xattr, not the tree:
                // report it like cp -a does and go on.
                if matches!(err.raw_os_error(), Some(libc::ENOSPC) | Some(libc::E2BIG) | Some(libc::ENOTSUP) | Some(libc::ERANGE)) {
                    if ctx.stats.skipped.len() < 1000 {
                        ctx.stats.skipped.push(format!("{host}: xattr {} not kept: {err}", String::from_utf8_lossy(k)));
                    }
                    continue;
                }
                return Err(Error::io(format!("cannot set xattr {} on {host}", String::from_utf8_lossy(k)), err));
            }
        }
    }
    let ts = |t: &ubtrfs_format::structs::Timespec| libc::timespec { tv_sec: t.sec.get() as i64 as libc::time_t, tv_nsec: i64::from(t.nsec.get()) as libc::c_long };
    let times = [ts(&ino.item.atime), ts(&ino.item.mtime)];
    let rc = match name {
        Some(n) => unsafe { libc::utimensat(raw, n.as_ptr(), times.as_ptr(), libc::AT_SYMLINK_NOFOLLOW) },
        None => unsafe { libc::futimens(raw, times.as_ptr()) },
    };
    if rc != 0 {
        return Err(os_err(format!("cannot set times on {host}")));
    }
    Ok(())
}
