//! Copy a tree out of the image into a host directory, preserving contents (sparse
//! files stay sparse, preallocated ranges stay preallocated), mode, owner,
//! atime/mtime, symlinks, hard links, xattrs of every namespace the destination takes
//! (user, trusted, security, btrfs, POSIX ACLs, file capabilities), fifos, sockets and
//! device nodes.
//!
//! Safety against crafted images: every name is checked ('/', NUL, "." and ".." and
//! empty names are refused), every object is created relative to an open directory
//! descriptor with O_EXCL/O_NOFOLLOW semantics, nothing existing is ever replaced, and
//! directory loops or multiply-linked directories are refused. So nothing is written
//! outside DEST, whatever the image holds.
//!
//! Salvage: by default a damaged image is copied as far as it can be read. A data
//! range no copy can read is left as a hole in an otherwise intact file (found at
//! sector granularity, or per compressed/inline extent, the unit such data is stored
//! in); a directory or inode whose tree blocks are unreadable is reported and skipped
//! while its siblings go on. Every loss is a `Warning` naming the host path, counted in
//! `ExtractStats`. `ExtractOptions::strict` instead stops at the first such error. What
//! the *destination* cannot hold (owners when not root, xattrs it refuses) is a
//! metadata warning, one line per object, and not a failure of the extraction. What it
//! cannot create (a name it cannot hold, a file larger than it allows: EFBIG, found
//! from the size before any data is written) is a loss, counted in `not_created`, and
//! the rest goes on. Errors of the destination itself (a full disk, an existing name)
//! stop the extraction; a file left half-written by one is removed first.
//!
//! Order of the metadata of one object, each step for a reason: create (private
//! mode), data, the plain xattrs (while the file is still ours and writable: user.*
//! and trusted.* need write permission), chown (which clears setuid/setgid and file
//! capabilities), chmod (so the setuid bits survive the chown), ACLs (they imply mode
//! bits, so they follow the chmod), security.capability (last: chown would clear it),
//! times (last of all: every step before changes ctime/mtime). Directories get theirs
//! after their contents, so a default ACL or a read-only mode does not apply to what
//! extract creates inside them.
//!
//! Neighbours: `fs` (`load_inode_salvage`, directory entries), `file` (reads and the
//! errors they give), `quote` (every name in a message).

use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use ubtrfs_core::{
    quote, DecompressCache, DirEntry, Error, ExtentKind, FileExtentRec, FileKind, FileRead,
    Filesystem, FsRead, InodeId, InodeView, Load, LoadDamage, PosixKind, Result,
};
use ubtrfs_format::key::{DIR_INDEX_KEY, EXTENT_DATA_KEY, XATTR_ITEM_KEY};
use ubtrfs_format::structs::{rdev_decode, FT_DIR};
use ubtrfs_format::{Corrupt, CorruptWhere};

/// How to extract.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExtractOptions {
    /// Stop at the first unreadable object or data range instead of going on.
    pub strict: bool,
    /// Write nothing: list what would be extracted and read everything to find what
    /// could not be.
    pub dry_run: bool,
}

/// Counters reported to the progress callback and returned at the end.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExtractStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub hardlinks: u64,
    pub specials: u64,
    pub bytes: u64,
    /// Files kept with unreadable data left as holes (or unreadable xattrs).
    pub files_incomplete: u64,
    /// Bytes of file data left as holes because no copy could be read.
    pub bytes_unreadable: u64,
    /// Directories extracted with some of their entries unreadable.
    pub dirs_incomplete: u64,
    /// Directories not extracted at all (nor anything under them).
    pub dirs_unreadable: u64,
    /// Other objects not extracted because they could not be read.
    pub files_unreadable: u64,
    /// Objects the destination would not let us create (device nodes when not root,
    /// names it cannot hold, files larger than it allows).
    pub not_created: u64,
    /// Objects whose owner could not be given (usually: not root).
    pub owners_not_kept: u64,
    /// Objects with some metadata not kept (xattrs the destination refused, setuid
    /// bits cleared, ...): warned about, but their contents are complete.
    pub metadata_warnings: u64,
}

impl ExtractStats {
    /// True if every object was extracted with all its data and entries (metadata the
    /// destination cannot hold does not count).
    pub fn complete(&self) -> bool {
        self.files_incomplete == 0
            && self.dirs_incomplete == 0
            && self.dirs_unreadable == 0
            && self.files_unreadable == 0
            && self.not_created == 0
    }

    /// What was lost, in words ("3 files incomplete, 1 directory unreadable"); None if
    /// nothing was.
    pub fn losses(&self) -> Option<String> {
        let count = |n: u64, one: &str, many: &str, what: &str| {
            (n > 0).then(|| format!("{n} {} {what}", if n == 1 { one } else { many }))
        };
        let parts: Vec<String> = [
            count(self.files_incomplete, "file", "files", "incomplete"),
            count(self.dirs_incomplete, "directory", "directories", "incomplete"),
            count(self.files_unreadable, "file", "files", "unreadable"),
            count(self.dirs_unreadable, "directory", "directories", "unreadable"),
            count(self.not_created, "file", "files", "not created"),
        ]
        .into_iter()
        .flatten()
        .collect();
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

/// What a warning says about its object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarningKind {
    /// Some metadata was not kept; the object and its data are complete.
    Metadata,
    /// The object was extracted, but some of its data or entries could not be read.
    Incomplete,
    /// The object (and anything under it) was not extracted.
    NotExtracted,
}

/// One line for the user: `text` starts with the escaped host path it is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    pub kind: WarningKind,
    pub text: String,
}

/// Where extraction reports as it goes.
pub trait ExtractReport {
    /// Called every few hundred objects and at the end.
    fn progress(&mut self, _stats: &ExtractStats) {}
    /// A dry run would create `path` (escaped), of type `kind` (`ls -l`'s letter, or
    /// 'h' for another name of a file already listed).
    fn listed(&mut self, _kind: char, _path: &str) {}
    /// Something was lost or not kept.
    fn warning(&mut self, _w: &Warning) {}
}

/// A report that keeps everything, for tests and library callers.
#[derive(Clone, Debug, Default)]
pub struct CollectReport {
    pub listed: Vec<(char, String)>,
    pub warnings: Vec<Warning>,
}

impl ExtractReport for CollectReport {
    fn listed(&mut self, kind: char, path: &str) {
        self.listed.push((kind, path.to_string()));
    }
    fn warning(&mut self, w: &Warning) {
        self.warnings.push(w.clone());
    }
}

/// How deep directories may nest; each level holds one open descriptor.
pub const MAX_DEPTH: usize = 2048;
/// Buffer size for data copies.
const COPY_CHUNK: usize = 4 << 20;
/// Unreadable ranges listed per file; the rest are summed up in one more line.
const MAX_RANGES_LISTED: usize = 16;
/// Xattr names listed per reason in a warning.
const MAX_XATTR_NAMES: usize = 3;
/// New engine warnings kept from one salvage re-read (per-sector re-reads repeat them).
const MAX_SALVAGE_WARNINGS: usize = 8;

struct Ctx<'a> {
    fs: &'a Filesystem,
    opts: ExtractOptions,
    stats: ExtractStats,
    /// First path (relative to `root_fd`) of each multiply-linked inode extracted.
    links: HashMap<InodeId, PathBuf>,
    visited_dirs: HashSet<InodeId>,
    is_root: bool,
    report: &'a mut dyn ExtractReport,
    buf: Vec<u8>,
    /// The descriptor hard-link paths in `links` are relative to.
    root_fd: RawFd,
    /// Cleared at the first EOPNOTSUPP: the destination cannot preallocate.
    fallocate_ok: bool,
    /// Why the first chown failed (for the one summary line).
    owner_reason: Option<String>,
    objects: u64,
}

fn cstr(b: &[u8], what: &str) -> Result<CString> {
    CString::new(b)
        .map_err(|_| Error::posix(PosixKind::Invalid, format!("{what}: name contains NUL")))
}

fn last_os_error() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn errno(e: &std::io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

/// An OS error as words for a message: "no space left on device".
fn os_words(e: &std::io::Error) -> String {
    let s = e.to_string();
    let s = s.split(" (os error").next().unwrap_or(&s);
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_lowercase().chain(c).collect(),
        None => String::new(),
    }
}

fn check_name(dir: InodeId, name: &[u8]) -> Result<()> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        let mut c = Corrupt::new(
            CorruptWhere::Item,
            format!("refusing unsafe directory entry name \"{}\"", quote::name(name)),
        )
        .root(dir.root);
        c.ino = Some(dir.ino);
        return Err(c.into());
    }
    Ok(())
}

/// Extract inode `src` into `dest`. A directory's contents go into `dest` (created if
/// needed, existing entries are never replaced); any other file becomes `dest` itself.
/// Returns what was extracted and lost; see `ExtractStats::complete`.
///
/// # Errors
/// `Io` naming the host path when the destination fails; in `strict` mode, the first
/// unreadable object or data range (`At` the host path). Unreadable parts of the image
/// otherwise become warnings.
pub fn extract(
    fs: &Filesystem,
    src: InodeId,
    dest: &Path,
    opts: &ExtractOptions,
    report: &mut dyn ExtractReport,
) -> Result<ExtractStats> {
    raise_fd_limit();
    // SAFETY: geteuid has no preconditions.
    let is_root = unsafe { libc::geteuid() } == 0;
    let mut ctx = Ctx {
        fs,
        opts: *opts,
        stats: ExtractStats::default(),
        links: HashMap::new(),
        visited_dirs: HashSet::new(),
        is_root,
        report,
        buf: vec![0u8; COPY_CHUNK],
        root_fd: libc::AT_FDCWD,
        fallocate_ok: true,
        owner_reason: None,
        objects: 0,
    };
    let host = quote::path(dest).into_owned();
    // The top must be readable: without it there is nothing to salvage.
    let (top, mut damage) = fs
        .load_inode_salvage(src, Load::ALL)
        .map_err(|e| e.at(format!("{host}: cannot read the source ({src})")))?;
    if top.kind() == FileKind::Dir {
        let dirfd = if opts.dry_run {
            None
        } else {
            std::fs::create_dir_all(dest)
                .map_err(|e| Error::io(format!("cannot create {host}"), e))?;
            let d = cstr(dest.as_os_str().as_encoded_bytes(), &host)?;
            // SAFETY: d is a valid C string; the returned fd is owned below.
            let fd = unsafe {
                libc::open(d.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC)
            };
            if fd < 0 {
                return Err(Error::io(format!("cannot open {host}"), last_os_error()));
            }
            // SAFETY: fd was just opened and is owned by nobody else.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        if let Some(d) = &dirfd {
            ctx.root_fd = d.as_raw_fd();
        }
        ctx.visited_dirs.insert(top.id);
        ctx.stats.dirs += 1;
        ctx.report.listed('d', &host);
        let entries_lost = extract_dir_contents(
            &mut ctx,
            dirfd.as_ref(),
            &top,
            &mut damage,
            Path::new(""),
            0,
            &host,
        )?;
        if xattrs_lost(&mut ctx, &top, &mut damage, &host)? && !entries_lost {
            ctx.stats.dirs_incomplete += 1;
        }
        if let Some(d) = &dirfd {
            finish_meta(&mut ctx, &Target::Fd(d.as_raw_fd()), &top, &host, Vec::new());
        }
    } else {
        let parent = dest.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let name =
            dest.file_name().ok_or_else(|| Error::posix(PosixKind::Invalid, host.clone()))?;
        let dirfd = if opts.dry_run {
            None
        } else {
            let p = cstr(parent.as_os_str().as_encoded_bytes(), &host)?;
            // SAFETY: p is a valid C string.
            let fd = unsafe {
                libc::open(p.as_ptr(), libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC)
            };
            if fd < 0 {
                return Err(Error::io(
                    format!("cannot open {}", quote::path(parent)),
                    last_os_error(),
                ));
            }
            // SAFETY: fd was just opened.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        };
        if let Some(d) = &dirfd {
            ctx.root_fd = d.as_raw_fd();
        }
        extract_one(
            &mut ctx,
            dirfd.as_ref(),
            name.as_encoded_bytes(),
            &top,
            &mut damage,
            Path::new(name),
            0,
            &host,
        )?;
    }
    if ctx.stats.owners_not_kept > 0 {
        // One line for the whole tree: as non-root this is every object, and expected.
        // SAFETY: geteuid/getegid have no preconditions.
        let (u, g) = unsafe { (libc::geteuid(), libc::getegid()) };
        let n = ctx.stats.owners_not_kept;
        let why = ctx.owner_reason.take().unwrap_or_default();
        let text = format!(
            "{host}: owner not kept on {n} object{} ({why}); they belong to {u}:{g}",
            if n == 1 { "" } else { "s" }
        );
        ctx.report.warning(&Warning { kind: WarningKind::Metadata, text });
    }
    ctx.report.progress(&ctx.stats);
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

impl Ctx<'_> {
    fn warn(&mut self, kind: WarningKind, text: String) {
        self.report.warning(&Warning { kind, text });
    }

    /// `host` could not be read: an error in strict mode, else a warning and a count.
    fn not_extracted(&mut self, is_dir: bool, host: &str, err: Error) -> Result<()> {
        if self.opts.strict {
            return Err(err.at(host));
        }
        if is_dir {
            self.stats.dirs_unreadable += 1;
            self.warn(
                WarningKind::NotExtracted,
                format!("{host}: directory not extracted, nor anything under it ({err})"),
            );
        } else {
            self.stats.files_unreadable += 1;
            self.warn(WarningKind::NotExtracted, format!("{host}: not extracted ({err})"));
        }
        Ok(())
    }

    /// The destination would not create `host`: a warning and a count (any mode).
    fn not_created(&mut self, host: &str, why: &str) {
        self.stats.not_created += 1;
        self.warn(WarningKind::NotExtracted, format!("{host}: not created ({why})"));
    }

    fn tick(&mut self) {
        self.objects += 1;
        if self.objects.is_multiple_of(256) {
            self.report.progress(&self.stats);
        }
    }
}

/// Whether the destination refused a name it cannot hold (the rest of the tree may
/// still fit), as opposed to failing as a whole.
fn name_refused(e: &std::io::Error) -> bool {
    matches!(errno(e), libc::ENAMETOOLONG | libc::EILSEQ)
}

/// The error for a failed create of `host`.
fn create_error(what: &str, host: &str, e: std::io::Error) -> Error {
    if errno(&e) == libc::EEXIST {
        return Error::io(
            format!("cannot create {what}{host} (extract never replaces what exists)"),
            e,
        );
    }
    Error::io(format!("cannot create {what}{host}"), e)
}

#[allow(clippy::too_many_arguments)]
fn extract_dir_contents(
    ctx: &mut Ctx<'_>,
    dirfd: Option<&OwnedFd>,
    dir: &InodeView,
    damage: &mut LoadDamage,
    rel: &Path,
    depth: usize,
    host: &str,
) -> Result<bool> {
    let lost = damage
        .lost
        .iter()
        .position(|l| l.overlaps(dir.id.ino, DIR_INDEX_KEY))
        .filter(|_| !entries_complete(dir, damage));
    if let Some(i) = lost {
        if ctx.opts.strict {
            return Err(damage.lost.swap_remove(i).error.at(format!("{host}: directory entries")));
        }
        ctx.stats.dirs_incomplete += 1;
        let text = format!(
            "{host}: directory incomplete: some entries unreadable ({}); the rest are extracted",
            damage.lost[i].error
        );
        ctx.warn(WarningKind::Incomplete, text);
    }
    for b in std::mem::take(&mut damage.bad_entries) {
        let child_host = format!("{host}/{}", quote::name(&b.name));
        ctx.not_extracted(b.ftype == FT_DIR, &child_host, b.error)?;
    }
    for e in &dir.entries {
        extract_entry(ctx, dirfd, dir.id, e, rel, depth + 1, host)?;
    }
    Ok(lost.is_some())
}

/// Whether a directory's readable entries account for its whole size (btrfs counts
/// each name twice, for its DIR_ITEM and its DIR_INDEX): then an unreadable block next
/// to its items held none of them.
fn entries_complete(dir: &InodeView, damage: &LoadDamage) -> bool {
    let names = dir
        .entries
        .iter()
        .map(|e| e.name.len() as u64)
        .chain(damage.bad_entries.iter().map(|b| b.name.len() as u64))
        .fold(0u64, u64::saturating_add);
    names.checked_mul(2) == Some(dir.size())
}

/// Whether the readable extents account for all the file's bytes (`nbytes` counts
/// inline data and every extent that is not a hole): then an unreadable block next to
/// its items held none of its data.
fn extents_complete(ino: &InodeView) -> bool {
    let bytes = ino
        .extents
        .iter()
        .map(|e| match e.kind {
            ExtentKind::Inline { ram_bytes, .. } => ram_bytes,
            ExtentKind::Regular { disk_bytenr: 0, .. } => 0,
            ExtentKind::Regular { num_bytes, .. } => num_bytes,
        })
        .fold(0u64, u64::saturating_add);
    bytes == ino.item.nbytes.get()
}

fn extract_entry(
    ctx: &mut Ctx<'_>,
    dirfd: Option<&OwnedFd>,
    parent: InodeId,
    e: &DirEntry,
    rel: &Path,
    depth: usize,
    parent_host: &str,
) -> Result<()> {
    let host = format!("{parent_host}/{}", quote::name(&e.name));
    let is_dir = e.ftype == FT_DIR;
    if let Err(err) = check_name(parent, &e.name) {
        return ctx.not_extracted(is_dir, &host, err);
    }
    let (child, mut damage) = match ctx.fs.load_inode_salvage(e.target, Load::ALL) {
        Ok(x) => x,
        Err(err) => return ctx.not_extracted(is_dir, &host, err),
    };
    use std::os::unix::ffi::OsStrExt;
    let child_rel = rel.join(std::ffi::OsStr::from_bytes(&e.name));
    extract_one(ctx, dirfd, &e.name, &child, &mut damage, &child_rel, depth, &host)
}

/// Extract one object as `dirfd/name` (`dirfd` None: a dry run).
#[allow(clippy::too_many_arguments)]
fn extract_one(
    ctx: &mut Ctx<'_>,
    dirfd: Option<&OwnedFd>,
    name: &[u8],
    ino: &InodeView,
    damage: &mut LoadDamage,
    rel: &Path,
    depth: usize,
    host: &str,
) -> Result<()> {
    let cname = cstr(name, host)?;
    let dfd = dirfd.map(|d| d.as_raw_fd());
    let kind = ino.kind();
    if kind != FileKind::Dir && ino.nlink() > 1 {
        if let Some(first) = ctx.links.get(&ino.id) {
            if let Some(dfd) = dfd {
                let cfirst = cstr(first.as_os_str().as_encoded_bytes(), host)?;
                // SAFETY: valid fds and C strings; flags 0 means do not follow symlinks.
                let rc =
                    unsafe { libc::linkat(ctx.root_fd, cfirst.as_ptr(), dfd, cname.as_ptr(), 0) };
                if rc != 0 {
                    let err = last_os_error();
                    if name_refused(&err) {
                        ctx.not_created(host, &os_words(&err));
                        return Ok(());
                    }
                    return Err(create_error("hard link ", host, err));
                }
            }
            ctx.stats.hardlinks += 1;
            ctx.report.listed('h', host);
            ctx.tick();
            return Ok(());
        }
    }
    let created = match kind {
        FileKind::Dir => extract_dir(ctx, dfd, &cname, ino, damage, rel, depth, host)?,
        FileKind::File => extract_file(ctx, dfd, &cname, ino, damage, host)?,
        FileKind::Symlink => extract_symlink(ctx, dfd, &cname, ino, damage, host)?,
        FileKind::Fifo | FileKind::CharDev | FileKind::BlockDev | FileKind::Socket => {
            extract_special(ctx, dfd, &cname, ino, host)?
        }
    };
    if created && kind != FileKind::Dir && ino.nlink() > 1 {
        ctx.links.insert(ino.id, rel.to_path_buf());
    }
    ctx.tick();
    Ok(())
}

/// Returns whether the directory was created.
#[allow(clippy::too_many_arguments)]
fn extract_dir(
    ctx: &mut Ctx<'_>,
    dfd: Option<RawFd>,
    cname: &CStr,
    ino: &InodeView,
    damage: &mut LoadDamage,
    rel: &Path,
    depth: usize,
    host: &str,
) -> Result<bool> {
    // Placeholders of subvolumes a snapshot does not hold share one number per tree,
    // as on the kernel, and are always empty: no loop can pass through them.
    if !ino.id.is_placeholder() && !ctx.visited_dirs.insert(ino.id) {
        let mut c =
            Corrupt::new(CorruptWhere::Item, "directory reached twice (loop or extra hard link)")
                .root(ino.id.root);
        c.ino = Some(ino.id.ino);
        ctx.not_extracted(true, host, c.into())?;
        return Ok(false);
    }
    if depth >= MAX_DEPTH {
        ctx.not_extracted(
            true,
            host,
            Error::posix(
                PosixKind::NameTooLong,
                format!("directories nest deeper than {MAX_DEPTH}"),
            ),
        )?;
        return Ok(false);
    }
    let sub = match dfd {
        None => None,
        Some(dfd) => {
            // SAFETY: valid fd and C string.
            if unsafe { libc::mkdirat(dfd, cname.as_ptr(), 0o700) } != 0 {
                let err = last_os_error();
                if name_refused(&err) {
                    ctx.not_created(host, &os_words(&err));
                    return Ok(false);
                }
                return Err(create_error("directory ", host, err));
            }
            // SAFETY: valid fd and C string; O_NOFOLLOW refuses a symlink swapped in.
            let fd = unsafe {
                libc::openat(
                    dfd,
                    cname.as_ptr(),
                    libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                )
            };
            if fd < 0 {
                return Err(Error::io(format!("cannot open directory {host}"), last_os_error()));
            }
            // SAFETY: fd was just opened.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    };
    ctx.stats.dirs += 1;
    ctx.report.listed('d', host);
    let entries_lost = extract_dir_contents(ctx, sub.as_ref(), ino, damage, rel, depth, host)?;
    // Counted once, whether entries or xattrs (or both) were lost.
    if xattrs_lost(ctx, ino, damage, host)? && !entries_lost {
        ctx.stats.dirs_incomplete += 1;
    }
    if let Some(sub) = &sub {
        finish_meta(ctx, &Target::Fd(sub.as_raw_fd()), ino, host, Vec::new());
    }
    Ok(true)
}

/// Report xattrs of `ino` lost to unreadable blocks (a loss of the source: strict
/// mode stops).
fn xattrs_lost(
    ctx: &mut Ctx<'_>,
    ino: &InodeView,
    damage: &mut LoadDamage,
    host: &str,
) -> Result<bool> {
    let Some(i) = damage.lost.iter().position(|l| l.overlaps(ino.id.ino, XATTR_ITEM_KEY)) else {
        return Ok(false);
    };
    if ctx.opts.strict {
        return Err(damage.lost.swap_remove(i).error.at(format!("{host}: xattrs")));
    }
    let text = format!(
        "{host}: xattrs may be incomplete: some of its items are unreadable ({})",
        damage.lost[i].error
    );
    ctx.warn(WarningKind::Incomplete, text);
    Ok(true)
}

/// Returns whether the file was created.
fn extract_file(
    ctx: &mut Ctx<'_>,
    dfd: Option<RawFd>,
    cname: &CStr,
    ino: &InodeView,
    damage: &mut LoadDamage,
    host: &str,
) -> Result<bool> {
    let f = match dfd {
        None => None,
        Some(dfd) => {
            // SAFETY: valid fd and C string.
            let fd = unsafe {
                libc::openat(
                    dfd,
                    cname.as_ptr(),
                    libc::O_WRONLY
                        | libc::O_CREAT
                        | libc::O_EXCL
                        | libc::O_NOFOLLOW
                        | libc::O_CLOEXEC,
                    0o600,
                )
            };
            if fd < 0 {
                let err = last_os_error();
                if name_refused(&err) {
                    ctx.not_created(host, &os_words(&err));
                    return Ok(false);
                }
                return Err(create_error("", host, err));
            }
            // SAFETY: fd was just opened.
            Some(unsafe { OwnedFd::from_raw_fd(fd) })
        }
    };
    let fd = f.as_ref().map(|f| f.as_raw_fd());
    // The size first: a file larger than the destination takes (btrfs files reach
    // 8 EiB, ext4's 16 TiB with 4 KiB blocks) is EFBIG here, before any data is read
    // or written, and the rest of the tree goes on, as cp -a goes on past it ("failed
    // to extend"). The data then goes below the size, into a sparse file.
    let size = i64::try_from(ino.size()).unwrap_or(i64::MAX);
    let sized = match fd {
        // SAFETY: fd is open for writing.
        Some(fd) if unsafe { libc::ftruncate(fd, size) } != 0 => Err(last_os_error()),
        _ => Ok(()),
    };
    let copied = match sized {
        Err(err) if errno(&err) == libc::EFBIG => {
            if let (Some(dfd), Some(f)) = (dfd, f) {
                drop(f);
                // SAFETY: valid fd and C string.
                if unsafe { libc::unlinkat(dfd, cname.as_ptr(), 0) } != 0 {
                    return Err(Error::io(
                        format!(
                            "cannot remove the empty {host} after the destination refused its size"
                        ),
                        last_os_error(),
                    ));
                }
            }
            ctx.not_created(
                host,
                &format!(
                    "{}: its size, {} bytes, is more than the destination holds in one file",
                    os_words(&err),
                    ino.size()
                ),
            );
            return Ok(false);
        }
        Err(err) => Err(Error::io(format!("cannot truncate {host}"), err)),
        Ok(()) => copy_data(ctx, fd, ino, damage, host),
    };
    let bad = match copied {
        Ok(bad) => bad,
        Err(e) => {
            // Never leave a half-written file behind without saying so.
            if let (Some(dfd), Some(f)) = (dfd, f) {
                drop(f);
                // SAFETY: valid fd and C string.
                let removed = unsafe { libc::unlinkat(dfd, cname.as_ptr(), 0) } == 0;
                let text = if removed {
                    format!("{host}: removed the partial copy")
                } else {
                    format!(
                        "{host}: the partial copy is left incomplete ({})",
                        os_words(&last_os_error())
                    )
                };
                ctx.warn(WarningKind::NotExtracted, text);
            }
            return Err(e);
        }
    };
    let mut notes = Vec::new();
    if let Some(fd) = fd {
        preallocate(ctx, fd, ino, &mut notes);
    }
    ctx.stats.files += 1;
    ctx.report.listed(FileKind::File.letter(), host);
    let lost_xattrs = xattrs_lost(ctx, ino, damage, host)?;
    if !bad.is_empty() || lost_xattrs {
        ctx.stats.files_incomplete += 1;
    }
    report_bad_ranges(ctx, &bad, host);
    if let Some(fd) = fd {
        finish_meta(ctx, &Target::Fd(fd), ino, host, notes);
    }
    Ok(true)
}

/// Returns whether the symlink was created.
fn extract_symlink(
    ctx: &mut Ctx<'_>,
    dfd: Option<RawFd>,
    cname: &CStr,
    ino: &InodeView,
    damage: &mut LoadDamage,
    host: &str,
) -> Result<bool> {
    let lost = damage.lost.iter().position(|l| l.overlaps(ino.id.ino, EXTENT_DATA_KEY));
    if let Some(i) = lost.filter(|_| !extents_complete(ino)) {
        let err = damage.lost.swap_remove(i).error;
        ctx.not_extracted(false, host, err)?;
        return Ok(false);
    }
    let mut target = vec![0u8; usize::try_from(ino.size()).unwrap_or(usize::MAX).min(4096)];
    match ctx.fs.read_at(ino, 0, &mut target) {
        Ok(n) => target.truncate(n),
        Err(e) => {
            ctx.not_extracted(false, host, e)?;
            return Ok(false);
        }
    }
    let ct = match CString::new(target) {
        Ok(c) => c,
        Err(_) => {
            let mut c =
                Corrupt::new(CorruptWhere::Item, "symlink target contains NUL").root(ino.id.root);
            c.ino = Some(ino.id.ino);
            ctx.not_extracted(false, host, c.into())?;
            return Ok(false);
        }
    };
    if let Some(dfd) = dfd {
        // SAFETY: valid C strings and fd.
        if unsafe { libc::symlinkat(ct.as_ptr(), dfd, cname.as_ptr()) } != 0 {
            let err = last_os_error();
            if name_refused(&err) {
                ctx.not_created(host, &os_words(&err));
                return Ok(false);
            }
            return Err(create_error("symlink ", host, err));
        }
    }
    ctx.stats.symlinks += 1;
    ctx.report.listed(FileKind::Symlink.letter(), host);
    if xattrs_lost(ctx, ino, damage, host)? {
        ctx.stats.files_incomplete += 1;
    }
    if let Some(dfd) = dfd {
        finish_meta(ctx, &Target::At { dirfd: dfd, name: cname }, ino, host, Vec::new());
    }
    Ok(true)
}

/// Returns whether the fifo, socket or device node was created.
fn extract_special(
    ctx: &mut Ctx<'_>,
    dfd: Option<RawFd>,
    cname: &CStr,
    ino: &InodeView,
    host: &str,
) -> Result<bool> {
    let kind = ino.kind();
    if let Some(dfd) = dfd {
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
            let err = last_os_error();
            if errno(&err) == libc::EPERM && !ctx.is_root {
                ctx.not_created(host, "a device node needs root");
                return Ok(false);
            }
            if name_refused(&err) {
                ctx.not_created(host, &os_words(&err));
                return Ok(false);
            }
            return Err(create_error("", host, err));
        }
    }
    ctx.stats.specials += 1;
    ctx.report.listed(kind.letter(), host);
    if let Some(dfd) = dfd {
        finish_meta(ctx, &Target::At { dirfd: dfd, name: cname }, ino, host, Vec::new());
    }
    Ok(true)
}

/// Why a range of file data is missing.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Why {
    /// Every copy fails its data checksum; `logical` is the range's first sector.
    Csum {
        logical: u64,
        copies: usize,
    },
    Other(String),
}

/// File bytes `[start, end)` that could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
struct BadRange {
    start: u64,
    end: u64,
    why: Why,
}

fn why(fs: &Filesystem, e: &Error) -> Why {
    if let Error::Corrupt(c) = e.inner() {
        if c.what == CorruptWhere::Data && c.reason.starts_with("csum mismatch") {
            if let Some(logical) = c.logical {
                let copies = fs.info.num_copies(ubtrfs_core::Logical(logical));
                return Why::Csum { logical, copies };
            }
        }
    }
    Why::Other(e.to_string())
}

/// Add `r` to `bad`, merging it into the last range when it continues it for the same
/// reason (the next sector of the same extent).
fn push_bad(bad: &mut Vec<BadRange>, r: BadRange) {
    if let Some(last) = bad.last_mut() {
        if last.end == r.start {
            let merge = match (&last.why, &r.why) {
                (Why::Csum { logical: a, copies: ca }, Why::Csum { logical: b, copies: cb }) => {
                    ca == cb && a + (last.end - last.start) == *b
                }
                (Why::Other(a), Why::Other(b)) => a == b,
                _ => false,
            };
            if merge {
                last.end = r.end;
                return;
            }
        }
    }
    bad.push(r);
}

fn write_all_at(fd: RawFd, mut data: &[u8], mut off: u64) -> std::io::Result<()> {
    while !data.is_empty() {
        // SAFETY: data is valid for data.len() bytes; fd is open for writing.
        let w = unsafe { libc::pwrite(fd, data.as_ptr().cast(), data.len(), off as libc::off_t) };
        if w < 0 {
            let e = last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if w == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::WriteZero, "write returned 0"));
        }
        data = &data[w as usize..];
        off += w as u64;
    }
    Ok(())
}

/// Copy the file's data into `fd` (None: read only, for a dry run). Returns the ranges
/// that could not be read (left as holes); in strict mode the first is an error.
fn copy_data(
    ctx: &mut Ctx<'_>,
    fd: Option<RawFd>,
    ino: &InodeView,
    damage: &mut LoadDamage,
    host: &str,
) -> Result<Vec<BadRange>> {
    let size = ino.size();
    let mut cache = DecompressCache::default();
    let mut bad = Vec::new();
    let write = |data: &[u8], off: u64| -> Result<()> {
        match fd {
            Some(fd) => write_all_at(fd, data, off)
                .map_err(|e| Error::io(format!("cannot write {host}"), e)),
            None => Ok(()),
        }
    };
    for e in &ino.extents {
        if e.is_hole_like() || e.file_offset >= size {
            continue;
        }
        let mut pos = e.file_offset;
        let end = e.end().min(size);
        while pos < end {
            let n = ((end - pos) as usize).min(COPY_CHUNK);
            match ctx.fs.read_at_cached(ino, pos, &mut ctx.buf[..n], &mut cache) {
                Ok(got) => {
                    write(&ctx.buf[..got], pos)?;
                    ctx.stats.bytes += got as u64;
                    if got == 0 {
                        break;
                    }
                    pos += got as u64;
                }
                Err(err) if ctx.opts.strict => return Err(err.at(host)),
                Err(_) => {
                    salvage_piece(ctx, e, ino, pos, n, &mut cache, &mut bad, &write)?;
                    pos += n as u64;
                }
            }
        }
    }
    // Extent items in unreadable leaves: their ranges are lost (with no-holes some may
    // have been holes; there is no telling).
    let lost_extents = !extents_complete(ino);
    if ctx.opts.strict && lost_extents {
        if let Some(i) = damage.lost.iter().position(|l| l.overlaps(ino.id.ino, EXTENT_DATA_KEY)) {
            return Err(damage.lost.swap_remove(i).error.at(format!("{host}: file extents")));
        }
    }
    for l in damage.lost.iter().filter(|l| lost_extents && l.overlaps(ino.id.ino, EXTENT_DATA_KEY))
    {
        let lo = if l.from.objectid == ino.id.ino && l.from.type_ == EXTENT_DATA_KEY {
            l.from.offset
        } else {
            0
        };
        let hi = match l.to {
            Some(t) if t.objectid == ino.id.ino && t.type_ == EXTENT_DATA_KEY => t.offset,
            _ => u64::MAX,
        }
        .min(size);
        let why = Why::Other(format!("file extent items unreadable: {}", l.error));
        for (s, e) in uncovered(&ino.extents, lo, hi) {
            push_bad(&mut bad, BadRange { start: s, end: e, why: why.clone() });
        }
    }
    bad.sort_by_key(|r| r.start);
    ctx.stats.bytes_unreadable += bad.iter().map(|r| r.end - r.start).sum::<u64>();
    Ok(bad)
}

/// The parts of `[lo, hi)` no extent in `exts` (sorted, not overlapping) covers.
fn uncovered(exts: &[FileExtentRec], lo: u64, hi: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut cur = lo;
    for e in exts.iter().filter(|e| e.end() > lo && e.file_offset < hi) {
        if e.file_offset > cur {
            out.push((cur, e.file_offset));
        }
        cur = cur.max(e.end());
    }
    if cur < hi {
        out.push((cur, hi));
    }
    out
}

/// A read of `[pos, pos + n)` of extent `e` failed: read it again unit by unit (a
/// sector of a plain extent; the whole piece of a compressed or inline one, which is
/// only readable whole), keep every unit that reads, and record the others in `bad`.
#[allow(clippy::too_many_arguments)]
fn salvage_piece(
    ctx: &mut Ctx<'_>,
    e: &FileExtentRec,
    ino: &InodeView,
    pos: u64,
    n: usize,
    cache: &mut DecompressCache,
    bad: &mut Vec<BadRange>,
    write: &dyn Fn(&[u8], u64) -> Result<()>,
) -> Result<()> {
    let fs: &Filesystem = ctx.fs;
    let info = &fs.info;
    let before = info.take_warnings();
    let ss = u64::from(info.sectorsize);
    let unit = match e.kind {
        ExtentKind::Regular { compression: 0, .. } => ss,
        _ => n as u64,
    };
    let end = pos + n as u64;
    let mut p = pos;
    while p < end {
        // Sector boundaries are file-offset aligned (extents start on sectors).
        let m = (unit - (p - e.file_offset) % unit).min(end - p) as usize;
        match fs.read_at_cached(ino, p, &mut ctx.buf[..m], cache) {
            Ok(got) => {
                write(&ctx.buf[..got], p)?;
                ctx.stats.bytes += got as u64;
            }
            Err(err) => push_bad(bad, BadRange { start: p, end: p + m as u64, why: why(fs, &err) }),
        }
        p += m as u64;
    }
    // The re-reads repeat what the first read already warned about (and add a "copy
    // unreadable" per sector); keep the first pass's warnings and a few new ones.
    let during = info.take_warnings();
    for w in &before {
        info.warn(w.clone());
    }
    let new: Vec<String> = during.into_iter().filter(|w| !before.contains(w)).collect();
    let extra = new.len().saturating_sub(MAX_SALVAGE_WARNINGS);
    for w in new.into_iter().take(MAX_SALVAGE_WARNINGS) {
        info.warn(w);
    }
    if extra > 0 {
        info.warn(format!(
            "ino {} root {}: {extra} more read warnings for file offsets {pos}..{end}",
            ino.id.ino, ino.id.root
        ));
    }
    Ok(())
}

fn report_bad_ranges(ctx: &mut Ctx<'_>, bad: &[BadRange], host: &str) {
    for r in bad.iter().take(MAX_RANGES_LISTED) {
        let why = match &r.why {
            Why::Csum { logical, copies: 1 } => {
                format!("data checksum mismatch at logical {logical}, the only copy")
            }
            Why::Csum { logical, .. } => {
                format!("data checksum mismatch at logical {logical} in every copy")
            }
            Why::Other(s) => s.clone(),
        };
        ctx.warn(
            WarningKind::Incomplete,
            format!("{host}: bytes {}..{} unreadable ({why}); left as a hole", r.start, r.end),
        );
    }
    if bad.len() > MAX_RANGES_LISTED {
        let rest = &bad[MAX_RANGES_LISTED..];
        let bytes: u64 = rest.iter().map(|r| r.end - r.start).sum();
        ctx.warn(
            WarningKind::Incomplete,
            format!("{host}: {} more unreadable ranges ({bytes} bytes); left as holes", rest.len()),
        );
    }
}

/// Keep preallocated extents preallocated: inside the file as allocated zeros, past
/// its end with KEEP_SIZE. A destination without fallocate is skipped silently (the
/// data is the same); other refusals are a note.
fn preallocate(ctx: &mut Ctx<'_>, fd: RawFd, ino: &InodeView, notes: &mut Vec<String>) {
    let size = ino.size();
    for e in &ino.extents {
        if !ctx.fallocate_ok {
            return;
        }
        if !matches!(e.kind, ExtentKind::Regular { prealloc: true, .. }) || e.is_empty() {
            continue;
        }
        let (s, t) = (e.file_offset, e.end());
        let inside = (s < size).then(|| (s, t.min(size), 0));
        let beyond = (t > size).then(|| (s.max(size), t, libc::FALLOC_FL_KEEP_SIZE));
        for (a, b, mode) in [inside, beyond].into_iter().flatten() {
            let (Ok(off), Ok(len)) = (libc::off_t::try_from(a), libc::off_t::try_from(b - a))
            else {
                continue;
            };
            // SAFETY: fd is open for writing; plain integers.
            if unsafe { libc::fallocate(fd, mode, off, len) } != 0 {
                let err = last_os_error();
                if matches!(errno(&err), libc::EOPNOTSUPP | libc::ENOSYS) {
                    ctx.fallocate_ok = false;
                    return;
                }
                notes.push(format!("preallocated bytes {a}..{b} not kept ({})", os_words(&err)));
            }
        }
    }
}

/// What metadata calls act on: an open descriptor, or `dirfd/name` without following
/// a symlink (symlinks and special files, which extract does not open).
enum Target<'a> {
    Fd(RawFd),
    At { dirfd: RawFd, name: &'a CStr },
}

impl Target<'_> {
    fn chown(&self, uid: u32, gid: u32) -> std::io::Result<()> {
        // SAFETY: valid fds and C strings.
        let rc = unsafe {
            match self {
                Target::Fd(fd) => libc::fchown(*fd, uid, gid),
                Target::At { dirfd, name } => {
                    libc::fchownat(*dirfd, name.as_ptr(), uid, gid, libc::AT_SYMLINK_NOFOLLOW)
                }
            }
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_os_error())
        }
    }

    fn chmod(&self, mode: u32) -> std::io::Result<()> {
        // SAFETY: valid fds and C strings. Never called for symlinks, so following
        // `name` cannot leave the directory.
        let rc = unsafe {
            match self {
                Target::Fd(fd) => libc::fchmod(*fd, mode),
                Target::At { dirfd, name } => libc::fchmodat(*dirfd, name.as_ptr(), mode, 0),
            }
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_os_error())
        }
    }

    /// Set an xattr. `at_path` is `/proc/self/fd/DIRFD/NAME` for `At` targets: there is
    /// no lsetxattr relative to a descriptor, and through the descriptor's /proc link
    /// the name is still looked up in the directory extract holds open.
    fn set_xattr(&self, at_path: Option<&CStr>, name: &CStr, value: &[u8]) -> std::io::Result<()> {
        // SAFETY: valid fds, C strings and a value buffer of value.len() bytes.
        let rc = unsafe {
            match (self, at_path) {
                (Target::Fd(fd), _) => {
                    libc::fsetxattr(*fd, name.as_ptr(), value.as_ptr().cast(), value.len(), 0)
                }
                (Target::At { .. }, Some(p)) => libc::lsetxattr(
                    p.as_ptr(),
                    name.as_ptr(),
                    value.as_ptr().cast(),
                    value.len(),
                    0,
                ),
                (Target::At { .. }, None) => {
                    return Err(std::io::Error::from_raw_os_error(libc::EBADF))
                }
            }
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_os_error())
        }
    }

    fn set_times(&self, times: &[libc::timespec; 2]) -> std::io::Result<()> {
        // SAFETY: valid fds, C strings and a two-element array.
        let rc = unsafe {
            match self {
                Target::Fd(fd) => libc::futimens(*fd, times.as_ptr()),
                Target::At { dirfd, name } => libc::utimensat(
                    *dirfd,
                    name.as_ptr(),
                    times.as_ptr(),
                    libc::AT_SYMLINK_NOFOLLOW,
                ),
            }
        };
        if rc == 0 {
            Ok(())
        } else {
            Err(last_os_error())
        }
    }
}

const ACL_ACCESS: &[u8] = b"system.posix_acl_access";
const ACL_DEFAULT: &[u8] = b"system.posix_acl_default";
const CAPABILITY: &[u8] = b"security.capability";

/// When an xattr is set; see the module docs for why.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum XattrStage {
    BeforeChown,
    Acl,
    Capability,
}

fn xattr_stage(name: &[u8]) -> XattrStage {
    match name {
        ACL_ACCESS | ACL_DEFAULT => XattrStage::Acl,
        CAPABILITY => XattrStage::Capability,
        _ => XattrStage::BeforeChown,
    }
}

/// Why the destination refused xattr `name`, in words that say what happened.
fn xattr_refusal(err: &std::io::Error, name: &[u8], kind: FileKind, is_root: bool) -> String {
    let privileged = name.starts_with(b"trusted.") || name.starts_with(b"security.");
    match errno(err) {
        libc::ENOSPC | libc::E2BIG | libc::EDQUOT => {
            "the destination filesystem cannot store more xattrs on this file".into()
        }
        libc::ERANGE => "the destination filesystem cannot store values this large".into(),
        libc::EOPNOTSUPP if xattr_stage(name) == XattrStage::Acl => {
            "the destination filesystem does not support ACLs here".into()
        }
        libc::EOPNOTSUPP => {
            let ns = name.split(|&b| b == b'.').next().unwrap_or_default();
            format!("the destination filesystem does not support {} xattrs", quote::name(ns))
        }
        libc::EPERM if privileged && !is_root => "needs root".into(),
        libc::EPERM
            if name.starts_with(b"user.") && !matches!(kind, FileKind::File | FileKind::Dir) =>
        {
            "user xattrs are only allowed on regular files and directories".into()
        }
        libc::EINVAL => "the destination refused the value as invalid".into(),
        _ => os_words(err),
    }
}

/// "14 of 30 xattrs not kept (REASON): user.a, user.b, user.c and 11 more".
fn xattr_note(failed: &[(String, Vec<u8>)], total: usize) -> String {
    let mut reasons: Vec<(&str, Vec<&[u8]>)> = Vec::new();
    for (why, name) in failed {
        match reasons.iter_mut().find(|(w, _)| w == why) {
            Some((_, names)) => names.push(name),
            None => reasons.push((why, vec![name])),
        }
    }
    // Sorted, so the names shown are the same on every run (the image keeps xattrs in
    // name-hash order).
    for (_, names) in &mut reasons {
        names.sort_unstable();
    }
    let list = |names: &[&[u8]]| {
        let mut s = names
            .iter()
            .take(MAX_XATTR_NAMES)
            .map(|n| quote::name(n).into_owned())
            .collect::<Vec<_>>()
            .join(", ");
        if names.len() > MAX_XATTR_NAMES {
            s.push_str(&format!(" and {} more", names.len() - MAX_XATTR_NAMES));
        }
        s
    };
    let n = failed.len();
    if let [(why, names)] = reasons.as_slice() {
        return format!("{n} of {total} xattrs not kept ({why}): {}", list(names));
    }
    let parts: Vec<String> =
        reasons.iter().map(|(why, names)| format!("{why}: {}", list(names))).collect();
    format!("{n} of {total} xattrs not kept ({})", parts.join("; "))
}

/// Apply xattrs, owner, mode and times (in the order the module docs give), and say in
/// one warning what the destination did not keep. Failures here are never errors.
fn finish_meta(
    ctx: &mut Ctx<'_>,
    t: &Target<'_>,
    ino: &InodeView,
    host: &str,
    mut notes: Vec<String>,
) {
    let kind = ino.kind();
    let at_path = match t {
        Target::At { dirfd, name } => {
            let mut p = format!("/proc/self/fd/{dirfd}/").into_bytes();
            p.extend_from_slice(name.to_bytes());
            CString::new(p).ok()
        }
        Target::Fd(_) => None,
    };
    let mut failed: Vec<(String, Vec<u8>)> = Vec::new();
    let is_root = ctx.is_root;
    let set_stage = |stage: XattrStage, failed: &mut Vec<(String, Vec<u8>)>| {
        for (k, v) in ino.xattrs.iter().filter(|(k, _)| xattr_stage(k) == stage) {
            let r = match CString::new(k.as_slice()) {
                Ok(ck) => t.set_xattr(at_path.as_deref(), &ck, v),
                Err(_) => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
            };
            if let Err(e) = r {
                failed.push((xattr_refusal(&e, k, kind, is_root), k.clone()));
            }
        }
    };
    set_stage(XattrStage::BeforeChown, &mut failed);

    let uid = ino.item.uid.get();
    let gid = ino.item.gid.get();
    let mut mode = ino.mode() & 0o7777;
    if let Err(e) = t.chown(uid, gid) {
        // Like cp -a: keep at least the group if we are in it.
        let group_kept = t.chown(u32::MAX, gid).is_ok();
        ctx.stats.owners_not_kept += 1;
        let why = if errno(&e) == libc::EPERM && !ctx.is_root {
            "not root".to_string()
        } else {
            os_words(&e)
        };
        ctx.owner_reason.get_or_insert_with(|| why.clone());
        // A setuid/setgid file must not end up privileged for whoever extracted it.
        if kind != FileKind::Dir {
            let mut cleared = Vec::new();
            if mode & libc::S_ISUID != 0 {
                mode &= !libc::S_ISUID;
                cleared.push(format!("setuid bit cleared (owner {uid} not kept: {why})"));
            }
            if mode & libc::S_ISGID != 0 && !group_kept {
                mode &= !libc::S_ISGID;
                cleared.push(format!("setgid bit cleared (group {gid} not kept: {why})"));
            }
            notes.extend(cleared);
        }
    }
    if kind != FileKind::Symlink {
        if let Err(e) = t.chmod(mode) {
            notes.push(format!("mode {mode:04o} not kept ({})", os_words(&e)));
        }
    }
    set_stage(XattrStage::Acl, &mut failed);
    set_stage(XattrStage::Capability, &mut failed);
    if !failed.is_empty() {
        notes.push(xattr_note(&failed, ino.xattrs.len()));
    }

    let ts = |t: &ubtrfs_format::structs::Timespec| libc::timespec {
        tv_sec: t.sec.get() as i64 as libc::time_t,
        tv_nsec: i64::from(t.nsec.get()) as libc::c_long,
    };
    if let Err(e) = t.set_times(&[ts(&ino.item.atime), ts(&ino.item.mtime)]) {
        notes.push(format!("times not kept ({})", os_words(&e)));
    }
    if !notes.is_empty() {
        ctx.stats.metadata_warnings += 1;
        ctx.warn(WarningKind::Metadata, format!("{host}: {}", notes.join("; ")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xattr_note_collapses_by_reason() {
        let f = |w: &str, n: &str| (w.to_string(), n.as_bytes().to_vec());
        let one = [
            f("r", "user.a"),
            f("r", "user.b"),
            f("r", "user.c"),
            f("r", "user.d"),
            f("r", "user.e"),
        ];
        assert_eq!(
            xattr_note(&one, 30),
            "5 of 30 xattrs not kept (r): user.a, user.b, user.c and 2 more"
        );
        let two = [f("full", "user.a"), f("needs root", "trusted.x"), f("full", "user.b\n")];
        assert_eq!(
            xattr_note(&two, 3),
            "3 of 3 xattrs not kept (full: user.a, user.b\\n; needs root: trusted.x)"
        );
    }

    #[test]
    fn bad_ranges_merge_only_when_contiguous() {
        let mut v = Vec::new();
        let csum = |l| Why::Csum { logical: l, copies: 2 };
        push_bad(&mut v, BadRange { start: 0, end: 4096, why: csum(8192) });
        push_bad(&mut v, BadRange { start: 4096, end: 8192, why: csum(12288) });
        // Contiguous in the file, not on disk: a new range.
        push_bad(&mut v, BadRange { start: 8192, end: 12288, why: csum(65536) });
        push_bad(&mut v, BadRange { start: 16384, end: 20480, why: Why::Other("x".into()) });
        assert_eq!(v.len(), 3, "{v:?}");
        assert_eq!((v[0].start, v[0].end), (0, 8192));
    }

    #[test]
    fn uncovered_subtracts_extents() {
        let ext = |o, n| FileExtentRec {
            file_offset: o,
            generation: 1,
            kind: ExtentKind::Regular {
                disk_bytenr: 1,
                disk_num_bytes: n,
                offset: 0,
                num_bytes: n,
                ram_bytes: n,
                compression: 0,
                prealloc: false,
            },
        };
        let exts = [ext(0, 4096), ext(8192, 4096)];
        assert_eq!(uncovered(&exts, 0, 16384), vec![(4096, 8192), (12288, 16384)]);
        assert_eq!(uncovered(&exts, 2048, 4096), vec![]);
        assert_eq!(uncovered(&[], 0, 10), vec![(0, 10)]);
    }

    #[test]
    fn losses_in_words() {
        let s = ExtractStats { files_incomplete: 3, dirs_unreadable: 1, ..Default::default() };
        assert_eq!(s.losses().as_deref(), Some("3 files incomplete, 1 directory unreadable"));
        assert!(!s.complete());
        assert_eq!(
            ExtractStats { owners_not_kept: 5, metadata_warnings: 2, ..Default::default() }
                .losses(),
            None
        );
    }
}
