//! The image-editing commands (`ubtrfs mkdir`, `mv`, `ln`, `mknod`, `truncate`, `reflink`,
//! `chmod`, `chown`, `touch`, and `rm`), each a change in the caller's transaction:
//! the CLI commits once after one command, or after every line of a `batch`, and on
//! any error commits nothing. Paths inside the image are absolute.
//!
//! Each command does what its coreutils namesake does on a mounted filesystem, as a
//! client of the engine (`offline_engine`: one transaction, which the caller
//! commits): sizes, data, flags, names removed and renamed go through the engine's own
//! calls (`Engine::setattr`, `fallocate`, `clone_range`, `rename`, `unlink`, ...), so
//! the rules and errors are the engine's, which follow the kernel's. New inodes are
//! the writer's (`FsWriter::mkdir`, `create_file`, `symlink`, `mknod`) under the
//! engine's lock: the engine's creates add what the VFS adds for a process on a mount
//! (the directory's set-group-ID bit and default ACL, a umask), and an edit makes
//! exactly the mode and owner it names.

use crate::put;
use ubtrfs_core::{
    fsflags_of, Engine, Error, FsRead, InodeAttrs, InodeId, Load, NewInode, PosixKind, Result,
    SetAttr, TimeSet,
};
use ubtrfs_format::structs::*;

/// One editing command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Edit {
    Mkdir {
        path: String,
        parents: bool,
        mode: u32,
    },
    Rm {
        path: String,
        recursive: bool,
    },
    /// rename(2): `flags` are renameat2's.
    Mv {
        from: String,
        to: String,
        flags: u32,
    },
    /// A hard link to `target`, or a symlink holding `target`.
    Ln {
        target: String,
        link: String,
        symbolic: bool,
    },
    /// `kind` is p, c, b or s.
    Mknod {
        path: String,
        kind: char,
        major: u32,
        minor: u32,
        mode: u32,
    },
    Truncate {
        path: String,
        size: u64,
    },
    /// `cp --reflink=always SRC DST`: DST (made with SRC's permission bits when
    /// missing, emptied when a file, SRC's name inside it when a directory) shares
    /// all of SRC's extents.
    Reflink {
        src: String,
        dst: String,
    },
    /// fallocate(2) with `mode` (FALLOC_FL_*) over [offset, offset + len); with mode 0
    /// a missing file is made first (0644), as fallocate(1) does.
    Fallocate {
        path: String,
        mode: u32,
        offset: u64,
        len: u64,
    },
    Chmod {
        mode: Mode,
        path: String,
    },
    /// chattr: `spec` is `[+-=]LETTERS`, repeated (`+i`, `-a`, `=C`, `+c-m`).
    Chattr {
        spec: String,
        path: String,
    },
    Chown {
        uid: Option<u32>,
        gid: Option<u32>,
        path: String,
    },
    /// Set atime and mtime to `time` (now when None); the file is made if missing.
    Touch {
        path: String,
        time: Option<(i64, u32)>,
    },
}

/// A chmod mode: absolute, or symbolic clauses applied to the current mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mode {
    Octal(u32),
    Symbolic(String),
}

fn invalid(what: impl Into<String>, detail: impl Into<String>) -> Error {
    Error::posix_detail(PosixKind::Invalid, what.into(), detail.into())
}

/// Refuse a path that is not absolute (paths inside the image start at its top).
pub fn absolute(path: &str) -> Result<&str> {
    if path.starts_with('/') {
        Ok(path)
    } else {
        Err(invalid(
            ubtrfs_core::quote::name(path.as_bytes()),
            "paths inside the image are absolute (start with /)",
        ))
    }
}

/// Parse an octal (`0755`) or symbolic (`u+x,go-w`, `a=r`) mode.
///
/// # Errors
/// `Posix(Invalid)` naming the mode.
pub fn parse_mode(s: &str) -> Result<Mode> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        let m = u32::from_str_radix(s, 8)
            .map_err(|_| invalid(s, "not an octal mode (digits 0 to 7)"))?;
        if m > 0o7777 {
            return Err(invalid(s, "an octal mode is at most 7777"));
        }
        return Ok(Mode::Octal(m));
    }
    // Validate now; apply later against the inode's mode.
    apply_symbolic(s, 0, false)?;
    Ok(Mode::Symbolic(s.to_string()))
}

/// Apply symbolic mode clauses `s` to `mode` (chmod(1) without a umask: a clause
/// without who means all).
fn apply_symbolic(s: &str, mut mode: u32, is_dir: bool) -> Result<u32> {
    for clause in s.split(',') {
        let b = clause.as_bytes();
        let mut i = 0;
        let mut who = 0u32;
        while i < b.len() && b"ugoa".contains(&b[i]) {
            who |= match b[i] {
                b'u' => 0o4700,
                b'g' => 0o2070,
                b'o' => 0o1007,
                _ => 0o7777,
            };
            i += 1;
        }
        if who == 0 {
            who = 0o7777;
        }
        if i == b.len() {
            return Err(invalid(s, format!("clause {clause:?} has no operator (+, - or =)")));
        }
        while i < b.len() {
            let op = b[i];
            if !b"+-=".contains(&op) {
                return Err(invalid(
                    s,
                    format!("unexpected {:?} in clause {clause:?}", op as char),
                ));
            }
            i += 1;
            let mut perm = 0u32;
            while i < b.len() && !b"+-=".contains(&b[i]) {
                perm |= match b[i] {
                    b'r' => 0o444,
                    b'w' => 0o222,
                    b'x' => 0o111,
                    b'X' if is_dir || mode & 0o111 != 0 => 0o111,
                    b'X' => 0,
                    b's' => 0o6000,
                    b't' => 0o1000,
                    c => {
                        return Err(invalid(
                            s,
                            format!("unknown permission {:?} in clause {clause:?}", c as char),
                        ))
                    }
                };
                i += 1;
            }
            let bits = perm & who;
            match op {
                b'+' => mode |= bits,
                b'-' => mode &= !bits,
                _ => mode = (mode & !(who & 0o7777)) | bits,
            }
        }
    }
    Ok(mode)
}

/// chattr's letters, in lsattr's order (e2fsprogs' flag table), with their
/// FS_IOC_GETFLAGS bits.
const ATTR_LETTERS: [(char, u32); 22] = [
    ('s', 0x1),
    ('u', 0x2),
    ('S', 0x8),
    ('D', 0x1_0000),
    ('i', 0x10),
    ('a', 0x20),
    ('d', 0x40),
    ('A', 0x80),
    ('c', 0x4),
    ('E', 0x800),
    ('j', 0x4000),
    ('I', 0x1000),
    ('t', 0x8000),
    ('T', 0x2_0000),
    ('e', 0x8_0000),
    ('C', 0x80_0000),
    ('x', 0x200_0000),
    ('F', 0x4000_0000),
    ('N', 0x1000_0000),
    ('P', 0x2000_0000),
    ('V', 0x10_0000),
    ('m', 0x400),
];

/// The flag column `lsattr` prints for FS_IOC_GETFLAGS bits `fs`.
pub fn lsattr_string(fs: u32) -> String {
    ATTR_LETTERS.iter().map(|&(c, b)| if fs & b != 0 { c } else { '-' }).collect()
}

/// Apply a chattr spec (`+i`, `-a`, `=C`, `+c-m`) to flags `cur`.
///
/// # Errors
/// `Posix(Invalid)` for a malformed spec or an unknown letter.
pub fn apply_chattr(spec: &str, cur: u32) -> Result<u32> {
    let mut out = cur;
    let mut op = None;
    let mut set_mask = None::<u32>;
    for ch in spec.chars() {
        match ch {
            '+' | '-' | '=' => {
                op = Some(ch);
                if ch == '=' {
                    set_mask = Some(0);
                }
            }
            c => {
                let bit = ATTR_LETTERS
                    .iter()
                    .find(|(l, _)| *l == c)
                    .map(|&(_, b)| b)
                    .ok_or_else(|| invalid(spec, format!("unknown attribute {c:?}")))?;
                match op {
                    Some('+') => out |= bit,
                    Some('-') => out &= !bit,
                    Some('=') => *set_mask.get_or_insert(0) |= bit,
                    _ => return Err(invalid(spec, "give +, - or = before the attributes")),
                }
            }
        }
    }
    if op.is_none() {
        return Err(invalid(spec, "give +, - or = before the attributes"));
    }
    Ok(set_mask.unwrap_or(out))
}

/// Parse `UID:GID`, `UID`, `UID:` or `:GID` (numeric: the image has no user names).
///
/// # Errors
/// `Posix(Invalid)` naming the owner.
pub fn parse_owner(s: &str) -> Result<(Option<u32>, Option<u32>)> {
    let num = |p: &str| -> Result<Option<u32>> {
        if p.is_empty() {
            Ok(None)
        } else {
            p.parse::<u32>().map(Some).map_err(|_| {
                invalid(s, format!("{p:?} is not a numeric id (the image has no user database)"))
            })
        }
    };
    let (u, g) = match s.split_once(':') {
        Some((u, g)) => (num(u)?, num(g)?),
        None => (num(s)?, None),
    };
    if u.is_none() && g.is_none() {
        return Err(invalid(s, "give UID, UID:GID or :GID"));
    }
    Ok((u, g))
}

/// Parse a size with an optional binary suffix (K, M, G, T, P, E; KiB etc.; KB = 1000).
///
/// # Errors
/// `Posix(Invalid)` naming the size.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, suffix) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| invalid(s, "not a size (a number with an optional K, M, G... suffix)"))?;
    let (unit, rest) = match suffix.chars().next() {
        None => (1u64, ""),
        Some(c) => {
            let p = match c.to_ascii_uppercase() {
                'K' => 1,
                'M' => 2,
                'G' => 3,
                'T' => 4,
                'P' => 5,
                'E' => 6,
                _ => return Err(invalid(s, format!("unknown size suffix {suffix:?}"))),
            };
            let rest = &suffix[1..];
            let base: u64 = if rest == "B" { 1000 } else { 1024 };
            (base.pow(p), rest)
        }
    };
    if !matches!(rest, "" | "B" | "iB") {
        return Err(invalid(s, format!("unknown size suffix {suffix:?}")));
    }
    n.checked_mul(unit).ok_or_else(|| invalid(s, "too large"))
}

/// Parse a time for `touch -d`: `@SECONDS[.FRACTION]`, or UTC
/// `YYYY-MM-DD[ T]HH:MM[:SS[.FRACTION]][Z]`, or a date alone (midnight UTC).
///
/// # Errors
/// `Posix(Invalid)` naming the time.
pub fn parse_time(s: &str) -> Result<(i64, u32)> {
    let bad = || {
        invalid(
            s,
            "not a time: use @SECONDS[.FRACTION] or YYYY-MM-DD[ HH:MM[:SS[.FRACTION]]] (UTC)",
        )
    };
    let frac = |f: &str| -> Result<u32> {
        if f.is_empty() || f.len() > 9 || !f.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        Ok(f.parse::<u32>().map_err(|_| bad())? * 10u32.pow(9 - f.len() as u32))
    };
    if let Some(rest) = s.strip_prefix('@') {
        let (sec, ns) = match rest.split_once('.') {
            Some((a, b)) => (a, frac(b)?),
            None => (rest, 0),
        };
        return Ok((sec.parse::<i64>().map_err(|_| bad())?, ns));
    }
    let s2 = s.trim_end_matches('Z');
    let (date, time) = match s2.split_once(['T', ' ']) {
        Some((d, t)) => (d, t),
        None => (s2, "00:00"),
    };
    let d: Vec<&str> = date.split('-').collect();
    let [y, mo, da] = d[..] else { return Err(bad()) };
    let (y, mo, da): (i64, i64, i64) = (
        y.parse().map_err(|_| bad())?,
        mo.parse().map_err(|_| bad())?,
        da.parse().map_err(|_| bad())?,
    );
    let (hms, ns) = match time.split_once('.') {
        Some((a, b)) => (a, frac(b)?),
        None => (time, 0),
    };
    let t: Vec<i64> =
        hms.split(':').map(|p| p.parse::<i64>().map_err(|_| bad())).collect::<Result<_>>()?;
    let (h, mi, se) = match t[..] {
        [h, m] => (h, m, 0),
        [h, m, s] => (h, m, s),
        _ => return Err(bad()),
    };
    if !(1..=12).contains(&mo)
        || !(1..=31).contains(&da)
        || !(0..24).contains(&h)
        || !(0..60).contains(&mi)
        || !(0..61).contains(&se)
    {
        return Err(bad());
    }
    Ok((days_from_civil(y, mo, da) * 86400 + h * 3600 + mi * 60 + se, ns))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn reflink(e: &Engine, src: &str, dst: &str) -> Result<String> {
    let what = format!("reflink {} {}", quoted(src), quoted(dst));
    let s = lookup(e, src)?;
    let si = item(e, s)?;
    if si.mode.get() & S_IFMT != S_IFREG {
        let kind =
            if si.mode.get() & S_IFMT == S_IFDIR { PosixKind::IsDir } else { PosixKind::Invalid };
        return Err(Error::posix_detail(kind, quoted(src), "only regular files are cloned"));
    }
    // A directory DST takes SRC's name, as cp does.
    let mut dst_path = dst.to_string();
    if let Ok(d) = lookup(e, dst) {
        if item(e, d)?.mode.get() & S_IFMT == S_IFDIR {
            let name = absolute(src)?.rsplit('/').next().unwrap_or_default();
            dst_path = format!("{}/{name}", dst.trim_end_matches('/'));
        }
    }
    let d = match lookup(e, &dst_path) {
        Ok(d) if d == s => return Err(invalid(what, "SRC and DST are the same file".to_string())),
        Ok(d) => {
            e.setattr(d, &SetAttr { size: Some(0), ..Default::default() })
                .map_err(|err| in_image(err, &[(String::new(), &dst_path)], what.clone()))?;
            d
        }
        Err(err) if err.posix_kind() == Some(PosixKind::NotFound) => {
            let (p, n) = parent(e, absolute(&dst_path)?)?;
            let a = InodeAttrs::new(S_IFREG | (si.mode.get() & 0o777));
            e.create_exact(p, &n, NewInode::File, &a)
                .map_err(|err| in_image(err, &[(q(&n), &dst_path)], what.clone()))?
        }
        Err(err) => return Err(err),
    };
    let n = e
        .clone_range(s, 0, 0, d, 0)
        .map_err(|err| in_image(err, &[(String::new(), src)], what.clone()))?;
    Ok(format!("{} shares {n} bytes of {}", quoted(&dst_path), quoted(src)))
}

/// The inode at `path` (the last component not followed).
fn lookup(e: &Engine, path: &str) -> Result<InodeId> {
    let path = absolute(path)?;
    e.read(|l| l.resolve_id(path, false))
}

/// Split `path` into its directory and last name, as the running transaction sees them.
fn parent(e: &Engine, path: &str) -> Result<(InodeId, Vec<u8>)> {
    e.read(|l| l.resolve_parent(path))
}

/// Inode `id`'s item, as the running transaction has it.
fn item(e: &Engine, id: InodeId) -> Result<InodeItem> {
    e.read(|l| Ok(l.load_inode(id, Load::ITEM)?.item))
}

/// The inode at `path`, or when there is none, a new empty regular file there (mode
/// 0644, owned by root: the writer's create, with no directory's group or default ACL
/// and no umask), as truncate(1), touch(1) and fallocate(1) make one.
fn existing_or_new(e: &Engine, path: &str, create: bool) -> Result<InodeId> {
    match lookup(e, path) {
        Ok(id) => Ok(id),
        Err(err) if err.posix_kind() == Some(PosixKind::NotFound) && create => {
            let (p, n) = parent(e, absolute(path)?)?;
            e.create_exact(p, &n, NewInode::File, &InodeAttrs::new(0o644))
        }
        Err(err) => Err(err),
    }
}

/// An engine error said of image paths: its object (a name in a directory, an
/// inode number, or two names of a rename) becomes the path the user gave; any other
/// error is prefixed with `what`.
fn in_image(e: Error, subs: &[(String, &str)], what: String) -> Error {
    if let Error::Posix { kind, path, detail } = &e {
        for (from, to) in subs {
            if path == from || (from.is_empty() && path.starts_with("root=")) {
                return Error::Posix { kind: *kind, path: quoted(to), detail: detail.clone() };
            }
        }
    }
    e.at(what)
}

fn q(name: &[u8]) -> String {
    ubtrfs_core::quote::name(name).into_owned()
}

fn quoted(path: &str) -> String {
    ubtrfs_core::quote::name(path.as_bytes()).into_owned()
}

/// Apply one editing command in the engine's running transaction; returns a line
/// saying what it did.
///
/// # Errors
/// The engine's, naming the path; `Posix(Invalid)` for a relative path.
pub fn apply(e: &Engine, edit: &Edit) -> Result<String> {
    match edit {
        Edit::Mkdir { path, parents, mode } => mkdir(e, absolute(path)?, *parents, *mode),
        Edit::Rm { path, recursive } => {
            let n = put::remove(e, absolute(path)?, *recursive)?;
            Ok(format!("removed {} ({n} entries)", quoted(path)))
        }
        Edit::Mv { from, to, flags } => {
            let (op, on) = parent(e, absolute(from)?)?;
            let (np, nn) = parent(e, absolute(to)?)?;
            if op.root != np.root {
                return Err(Error::posix_detail(
                    PosixKind::CrossDevice,
                    format!("{} -> {}", quoted(from), quoted(to)),
                    "they are in different subvolumes",
                ));
            }
            e.rename(op, &on, np, &nn, *flags).map_err(|err| {
                let both = format!("{} -> {}", quoted(from), quoted(to));
                in_image(
                    err,
                    &[
                        (q(&on), from),
                        (q(&nn), to),
                        (format!("{} -> {}", q(&on), q(&nn)), both.as_str()),
                    ],
                    format!("mv {} {}", quoted(from), quoted(to)),
                )
            })?;
            Ok(format!("renamed {} to {}", quoted(from), quoted(to)))
        }
        Edit::Ln { target, link, symbolic } => {
            let (p, n) = parent(e, absolute(link)?)?;
            if *symbolic {
                // The writer's symlink: owned by root whatever the directory's group.
                e.create_exact(
                    p,
                    &n,
                    NewInode::Symlink(target.as_bytes()),
                    &InodeAttrs::new(0o777),
                )
                .map_err(|err| {
                    in_image(err, &[(q(&n), link)], format!("ln -s {}", quoted(link)))
                })?;
                return Ok(format!("{} -> {}", quoted(link), quoted(target)));
            }
            let t = lookup(e, target)?;
            if t.root != p.root {
                return Err(Error::posix_detail(
                    PosixKind::CrossDevice,
                    format!("{} -> {}", quoted(link), quoted(target)),
                    "hard links stay inside one subvolume",
                ));
            }
            // Read here so that a target that cannot be read fails on its own, before
            // the link (which then finds the attributes in memory).
            e.getattr(t)?;
            e.link(t, p, &n).map_err(|err| {
                in_image(
                    err,
                    &[(q(&n), link), (String::new(), target)],
                    format!("ln {}", quoted(link)),
                )
            })?;
            Ok(format!("linked {} to {}", quoted(link), quoted(target)))
        }
        Edit::Mknod { path, kind, major, minor, mode } => {
            let t = match kind {
                'p' => S_IFIFO,
                'c' | 'u' => S_IFCHR,
                'b' => S_IFBLK,
                's' => S_IFSOCK,
                k => {
                    return Err(invalid(
                        quoted(path),
                        format!("unknown node type {k:?} (p, c, b or s)"),
                    ))
                }
            };
            let (p, n) = parent(e, absolute(path)?)?;
            let a = InodeAttrs {
                rdev: rdev_encode(*major, *minor),
                ..InodeAttrs::new(t | (mode & 0o7777))
            };
            e.create_exact(p, &n, NewInode::Special, &a).map_err(|err| {
                in_image(err, &[(q(&n), path)], format!("mknod {}", quoted(path)))
            })?;
            Ok(format!("made {}", quoted(path)))
        }
        Edit::Reflink { src, dst } => reflink(e, src, dst),
        Edit::Truncate { path, size } => {
            // truncate(1) makes a missing file.
            let id = existing_or_new(e, path, true)?;
            e.setattr(id, &SetAttr { size: Some(*size), ..Default::default() }).map_err(|err| {
                in_image(err, &[(String::new(), path)], format!("truncate {}", quoted(path)))
            })?;
            Ok(format!("{} is {size} bytes", quoted(path)))
        }
        Edit::Fallocate { path, mode, offset, len } => {
            // fallocate(1) makes a missing file for the default mode only (O_CREAT,
            // 0666 less the umask): here 0644, as truncate and touch make them.
            let id = existing_or_new(e, path, *mode == 0)?;
            e.fallocate(id, *mode, *offset, *len).map_err(|err| {
                in_image(err, &[(String::new(), path)], format!("fallocate {}", quoted(path)))
            })?;
            Ok(format!("{} fallocated {len} bytes at {offset}", quoted(path)))
        }
        Edit::Chattr { spec, path } => {
            let id = lookup(e, path)?;
            let new = apply_chattr(spec, fsflags_of(item(e, id)?.flags.get()))?;
            e.set_fsflags(id, new).map_err(|err| {
                in_image(err, &[(String::new(), path)], format!("chattr {}", quoted(path)))
            })?;
            Ok(format!("{} {}", lsattr_string(new), quoted(path)))
        }
        Edit::Chmod { mode, path } => {
            let id = lookup(e, path)?;
            let cur = item(e, id)?.mode.get();
            let m = match mode {
                Mode::Octal(m) => *m,
                Mode::Symbolic(s) => apply_symbolic(s, cur & 0o7777, cur & S_IFMT == S_IFDIR)?,
            };
            e.setattr(id, &SetAttr { mode: Some(m), ..Default::default() }).map_err(|err| {
                in_image(err, &[(String::new(), path)], format!("chmod {}", quoted(path)))
            })?;
            Ok(format!("{} mode {m:04o}", quoted(path)))
        }
        Edit::Chown { uid, gid, path } => {
            let id = lookup(e, path)?;
            e.setattr(id, &SetAttr::chown(*uid, *gid)).map_err(|err| {
                in_image(err, &[(String::new(), path)], format!("chown {}", quoted(path)))
            })?;
            Ok(format!(
                "{} owner {}:{}",
                quoted(path),
                uid.map_or("-".into(), |u| u.to_string()),
                gid.map_or("-".into(), |g| g.to_string())
            ))
        }
        Edit::Touch { path, time } => {
            let t = time.map_or(TimeSet::Now, |(s, n)| TimeSet::At(s, n));
            let id = existing_or_new(e, path, true)?;
            e.setattr(id, &SetAttr { atime: Some(t), mtime: Some(t), ..Default::default() })
                .map_err(|err| {
                    in_image(err, &[(String::new(), path)], format!("touch {}", quoted(path)))
                })?;
            Ok(format!("touched {}", quoted(path)))
        }
    }
}

/// mkdir(1), with the writer's mkdir: the directory gets exactly `mode`, owned by
/// root, whatever its parent's set-group-ID bit or default ACL.
fn mkdir(e: &Engine, path: &str, parents: bool, mode: u32) -> Result<String> {
    if !parents {
        let (p, n) = parent(e, path)?;
        e.create_exact(p, &n, NewInode::Dir, &InodeAttrs::new(mode))
            .map_err(|err| in_image(err, &[(q(&n), path)], format!("mkdir {}", quoted(path))))?;
        return Ok(format!("made {}", quoted(path)));
    }
    // -p: every missing component, in turn; existing directories are fine.
    let mut made = 0;
    let mut cur = String::new();
    for c in path.split('/').filter(|c| !c.is_empty() && *c != ".") {
        cur.push('/');
        cur.push_str(c);
        match e.read(|l| l.resolve_id(&cur, true)) {
            Ok(id) => {
                if item(e, id)?.mode.get() & S_IFMT != S_IFDIR {
                    return Err(Error::posix(PosixKind::NotDir, quoted(&cur)));
                }
            }
            Err(err) if err.posix_kind() == Some(PosixKind::NotFound) => {
                let (p, n) = parent(e, &cur)?;
                e.create_exact(p, &n, NewInode::Dir, &InodeAttrs::new(mode)).map_err(|err| {
                    in_image(err, &[(q(&n), &cur)], format!("mkdir {}", quoted(&cur)))
                })?;
                made += 1;
            }
            Err(err) => return Err(err),
        }
    }
    Ok(format!("made {made} directories for {}", quoted(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(parse_mode("755").unwrap(), Mode::Octal(0o755));
        assert_eq!(parse_mode("04755").unwrap(), Mode::Octal(0o4755));
        assert!(
            parse_mode("8").is_err()
                && parse_mode("77777").is_err()
                && parse_mode("u+q").is_err()
                && parse_mode("u").is_err()
        );
        assert_eq!(apply_symbolic("u+x", 0o644, false).unwrap(), 0o744);
        assert_eq!(apply_symbolic("go-rwx", 0o777, false).unwrap(), 0o700);
        assert_eq!(apply_symbolic("a=r", 0o777, false).unwrap(), 0o444);
        assert_eq!(apply_symbolic("u=rw,g=r,o=", 0o777, false).unwrap(), 0o640);
        assert_eq!(apply_symbolic("+X", 0o644, true).unwrap(), 0o755);
        assert_eq!(apply_symbolic("+X", 0o644, false).unwrap(), 0o644);
        assert_eq!(apply_symbolic("u+s,g+s,+t", 0o755, false).unwrap(), 0o7755);
        assert_eq!(apply_symbolic("=", 0o7777, false).unwrap(), 0);
    }

    #[test]
    fn chattr_specs() {
        assert_eq!(apply_chattr("+i", 0).unwrap(), 0x10);
        assert_eq!(apply_chattr("-i+a", 0x10).unwrap(), 0x20);
        assert_eq!(apply_chattr("=C", 0x30).unwrap(), 0x80_0000);
        assert_eq!(apply_chattr("+cm", 0).unwrap(), 0x404);
        assert!(apply_chattr("i", 0).is_err() && apply_chattr("+q", 0).is_err());
        assert_eq!(lsattr_string(0x400), "---------------------m");
        assert_eq!(lsattr_string(0x80_0010), "----i----------C------");
    }

    #[test]
    fn owners_sizes_times() {
        assert_eq!(parse_owner("1000:100").unwrap(), (Some(1000), Some(100)));
        assert_eq!(parse_owner("7").unwrap(), (Some(7), None));
        assert_eq!(parse_owner(":5").unwrap(), (None, Some(5)));
        assert!(parse_owner(":").is_err() && parse_owner("root:root").is_err());
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("10K").unwrap(), 10 << 10);
        assert_eq!(parse_size("3MiB").unwrap(), 3 << 20);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert_eq!(parse_size("1KB").unwrap(), 1000);
        assert!(
            parse_size("1Q").is_err()
                && parse_size("x").is_err()
                && parse_size("99999999999E").is_err()
        );
        assert_eq!(parse_time("@1700000000").unwrap(), (1_700_000_000, 0));
        assert_eq!(parse_time("@1.5").unwrap(), (1, 500_000_000));
        assert_eq!(parse_time("1970-01-01").unwrap(), (0, 0));
        assert_eq!(parse_time("2000-03-01 00:00:00").unwrap(), (951_868_800, 0));
        assert_eq!(parse_time("2023-11-14T22:13:20.25Z").unwrap(), (1_700_000_000, 250_000_000));
        assert!(
            parse_time("2023-13-01").is_err()
                && parse_time("yesterday").is_err()
                && parse_time("@1.1234567890").is_err()
        );
    }
}
