//! Errors in four families that never mix: I/O, Corrupt (structured, printed in the
//! kernel's grammar), Incompatible (feature bits, unsupported layouts) and POSIX kinds.
//! A bug is an assertion, not an error. One more variant, `CacheMiss`, is none of the
//! four: it is the engine's own control flow, which never leaves the engine.

use std::fmt;
use ubtrfs_format::Corrupt;

/// POSIX-style failures of a request (the FUSE adapter maps these to errno). Each
/// kind prints as its errno's `strerror` text, lowercased (glibc's wording).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PosixKind {
    /// ENOENT.
    NotFound,
    /// ENOTDIR.
    NotDir,
    /// EISDIR.
    IsDir,
    /// EEXIST.
    Exists,
    /// EINVAL.
    Invalid,
    /// EROFS: an aborted filesystem, a read-only subvolume.
    ReadOnly,
    /// ENOSPC.
    NoSpace,
    /// ENAMETOOLONG.
    NameTooLong,
    /// ENOTEMPTY.
    NotEmpty,
    /// ELOOP.
    Loop,
    /// EACCES.
    PermissionDenied,
    /// EPERM: immutable or append-only inodes.
    NotPermitted,
    /// EBUSY: the image is held by another writer or mounted by the kernel.
    Busy,
    /// EXDEV: rename, link or reflink across subvolumes or filesystems.
    CrossDevice,
    /// ENODATA: no such extended attribute.
    NoData,
    /// ERANGE: a caller's buffer is too small (getxattr, listxattr).
    Range,
    /// EMLINK: an inode's link count or extref space is at its maximum.
    TooManyLinks,
    /// EFBIG: a file offset beyond the maximum file size.
    FileTooBig,
    /// EOPNOTSUPP: a valid request ubtrfs or this filesystem does not support.
    NotSupported,
    /// EDQUOT: a qgroup limit would be exceeded.
    QuotaExceeded,
    /// ENODEV: an operation the file's type has no driver for (fallocate of a
    /// device node, symlink or socket).
    NoDevice,
    /// ESPIPE: a seek-like operation on a fifo.
    NotSeekable,
    /// E2BIG: an xattr value (or list) beyond the VFS's 64 KiB limit.
    TooBig,
}

impl PosixKind {
    /// Every kind, for tables and tests.
    pub const ALL: [PosixKind; 23] = [
        PosixKind::NotFound,
        PosixKind::NotDir,
        PosixKind::IsDir,
        PosixKind::Exists,
        PosixKind::Invalid,
        PosixKind::ReadOnly,
        PosixKind::NoSpace,
        PosixKind::NameTooLong,
        PosixKind::NotEmpty,
        PosixKind::Loop,
        PosixKind::PermissionDenied,
        PosixKind::NotPermitted,
        PosixKind::Busy,
        PosixKind::CrossDevice,
        PosixKind::NoData,
        PosixKind::Range,
        PosixKind::TooManyLinks,
        PosixKind::FileTooBig,
        PosixKind::NotSupported,
        PosixKind::QuotaExceeded,
        PosixKind::NoDevice,
        PosixKind::NotSeekable,
        PosixKind::TooBig,
    ];

    /// The errno value (positive), as the FUSE adapter returns it.
    pub fn errno(self) -> i32 {
        match self {
            PosixKind::NotFound => libc::ENOENT,
            PosixKind::NotDir => libc::ENOTDIR,
            PosixKind::IsDir => libc::EISDIR,
            PosixKind::Exists => libc::EEXIST,
            PosixKind::Invalid => libc::EINVAL,
            PosixKind::ReadOnly => libc::EROFS,
            PosixKind::NoSpace => libc::ENOSPC,
            PosixKind::NameTooLong => libc::ENAMETOOLONG,
            PosixKind::NotEmpty => libc::ENOTEMPTY,
            PosixKind::Loop => libc::ELOOP,
            PosixKind::PermissionDenied => libc::EACCES,
            PosixKind::NotPermitted => libc::EPERM,
            PosixKind::Busy => libc::EBUSY,
            PosixKind::CrossDevice => libc::EXDEV,
            PosixKind::NoData => libc::ENODATA,
            PosixKind::Range => libc::ERANGE,
            PosixKind::TooManyLinks => libc::EMLINK,
            PosixKind::FileTooBig => libc::EFBIG,
            PosixKind::NotSupported => libc::EOPNOTSUPP,
            PosixKind::QuotaExceeded => libc::EDQUOT,
            PosixKind::NoDevice => libc::ENODEV,
            PosixKind::NotSeekable => libc::ESPIPE,
            PosixKind::TooBig => libc::E2BIG,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            PosixKind::NotFound => "no such file or directory",
            PosixKind::NotDir => "not a directory",
            PosixKind::IsDir => "is a directory",
            PosixKind::Exists => "file exists",
            PosixKind::Invalid => "invalid argument",
            PosixKind::ReadOnly => "read-only file system",
            PosixKind::NoSpace => "no space left on device",
            PosixKind::NameTooLong => "file name too long",
            PosixKind::NotEmpty => "directory not empty",
            PosixKind::Loop => "too many levels of symbolic links",
            PosixKind::PermissionDenied => "permission denied",
            PosixKind::NotPermitted => "operation not permitted",
            PosixKind::Busy => "device or resource busy",
            PosixKind::CrossDevice => "invalid cross-device link",
            PosixKind::NoData => "no data available",
            PosixKind::Range => "numerical result out of range",
            PosixKind::TooManyLinks => "too many links",
            PosixKind::FileTooBig => "file too large",
            PosixKind::NotSupported => "operation not supported",
            PosixKind::QuotaExceeded => "disk quota exceeded",
            PosixKind::NoDevice => "no such device",
            PosixKind::NotSeekable => "illegal seek",
            PosixKind::TooBig => "argument list too long",
        }
    }
}

impl fmt::Display for PosixKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Corrupt(Box<Corrupt>),
    #[error("incompatible filesystem: {0}")]
    Incompatible(String),
    /// `path` names the object; `detail`, when set, says what to do or why, after the
    /// kind (`/a: is a directory (use -r)`), so the message never repeats the kind.
    #[error("{path}: {kind}{}", detail.as_ref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Posix { kind: PosixKind, path: String, detail: Option<String> },
    /// A committed tree block missing from the cache, met by a run that must not read it
    /// under the engine's lock (a reader of `Engine::read`, a probed run of
    /// `Engine::write_retrying`): the run stops here, as the kernel's
    /// `read_block_for_search` returns -EAGAIN. It is the engine's internal control
    /// flow, not a failure: the engine reads the block without the lock and runs the
    /// closure again, and never returns this to its callers. It has a variant of its
    /// own so that no code that looks at POSIX kinds (an EBUSY retried, an ENOENT taken
    /// for absence) can mistake it for an answer.
    #[error("tree block {bytenr} is not cached (read it without the engine's lock and run again)")]
    CacheMiss { bytenr: u64 },
    /// Another error, said of the object (a host path, an image path) it happened to.
    /// Its family is the inner error's: the accessors below look through it.
    #[error("{what}: {source}")]
    At {
        what: String,
        #[source]
        source: Box<Error>,
    },
}

impl From<Corrupt> for Error {
    fn from(c: Corrupt) -> Error {
        Error::Corrupt(Box::new(c))
    }
}

impl Error {
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        Error::Io { context: context.into(), source }
    }
    pub fn posix(kind: PosixKind, path: impl Into<String>) -> Error {
        Error::Posix { kind, path: path.into(), detail: None }
    }
    /// A POSIX error on `path` with a hint or reason shown after the kind.
    pub fn posix_detail(
        kind: PosixKind,
        path: impl Into<String>,
        detail: impl Into<String>,
    ) -> Error {
        Error::Posix { kind, path: path.into(), detail: Some(detail.into()) }
    }
    /// Say which object `self` happened to.
    pub fn at(self, what: impl Into<String>) -> Error {
        Error::At { what: what.into(), source: Box::new(self) }
    }
    /// The error under any `At` wrappers.
    pub fn inner(&self) -> &Error {
        match self {
            Error::At { source, .. } => source.inner(),
            e => e,
        }
    }
    pub fn posix_kind(&self) -> Option<PosixKind> {
        match self.inner() {
            Error::Posix { kind, .. } => Some(*kind),
            _ => None,
        }
    }
    pub fn is_corrupt(&self) -> bool {
        matches!(self.inner(), Error::Corrupt(_))
    }
    /// Whether this is the engine's internal `CacheMiss` (see there).
    pub fn is_cache_miss(&self) -> bool {
        matches!(self.inner(), Error::CacheMiss { .. })
    }
}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    /// libc's text for `errno`, lowercased.
    fn strerror_lower(errno: i32) -> String {
        // SAFETY: strerror returns a pointer to a NUL-terminated string that stays valid
        // until the next strerror call; this thread copies it before making another.
        let s = unsafe { CStr::from_ptr(libc::strerror(errno)) };
        s.to_string_lossy().to_lowercase()
    }

    #[test]
    fn every_kind_is_its_errno_with_strerror_text() {
        let want: [(PosixKind, i32); 23] = [
            (PosixKind::NotFound, libc::ENOENT),
            (PosixKind::NotDir, libc::ENOTDIR),
            (PosixKind::IsDir, libc::EISDIR),
            (PosixKind::Exists, libc::EEXIST),
            (PosixKind::Invalid, libc::EINVAL),
            (PosixKind::ReadOnly, libc::EROFS),
            (PosixKind::NoSpace, libc::ENOSPC),
            (PosixKind::NameTooLong, libc::ENAMETOOLONG),
            (PosixKind::NotEmpty, libc::ENOTEMPTY),
            (PosixKind::Loop, libc::ELOOP),
            (PosixKind::PermissionDenied, libc::EACCES),
            (PosixKind::NotPermitted, libc::EPERM),
            (PosixKind::Busy, libc::EBUSY),
            (PosixKind::CrossDevice, libc::EXDEV),
            (PosixKind::NoData, libc::ENODATA),
            (PosixKind::Range, libc::ERANGE),
            (PosixKind::TooManyLinks, libc::EMLINK),
            (PosixKind::FileTooBig, libc::EFBIG),
            (PosixKind::NotSupported, libc::EOPNOTSUPP),
            (PosixKind::QuotaExceeded, libc::EDQUOT),
            (PosixKind::NoDevice, libc::ENODEV),
            (PosixKind::NotSeekable, libc::ESPIPE),
            (PosixKind::TooBig, libc::E2BIG),
        ];
        assert_eq!(
            want.map(|(k, _)| k),
            PosixKind::ALL,
            "the table above lists every kind, in order"
        );
        for (kind, errno) in want {
            assert_eq!(kind.errno(), errno, "{kind:?}");
            assert_eq!(kind.to_string(), strerror_lower(errno), "{kind:?} (errno {errno})");
        }
        let mut seen: Vec<i32> = PosixKind::ALL.iter().map(|k| k.errno()).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), PosixKind::ALL.len(), "two kinds share an errno");
    }

    #[test]
    fn posix_error_reads_path_kind_detail() {
        let e = Error::posix_detail(PosixKind::CrossDevice, "/a/b", "a reflink across subvolumes");
        assert_eq!(e.to_string(), "/a/b: invalid cross-device link (a reflink across subvolumes)");
        assert_eq!(e.at("image.img").posix_kind(), Some(PosixKind::CrossDevice));
    }

    #[test]
    fn a_cache_miss_is_no_posix_kind() {
        let e = Error::CacheMiss { bytenr: 30408704 }.at("lookup");
        assert!(e.is_cache_miss());
        assert_eq!(e.posix_kind(), None);
        assert!(!Error::posix(PosixKind::Busy, "x").is_cache_miss());
        assert_eq!(
            e.to_string(),
            "lookup: tree block 30408704 is not cached (read it without the engine's lock and run again)"
        );
    }
}
