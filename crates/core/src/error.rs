//! Errors in four families that never mix: I/O, Corrupt (structured, printed in the
//! kernel's grammar), Incompatible (feature bits, unsupported layouts) and POSIX kinds.
//! A bug is an assertion, not an error.

use std::fmt;
use ubtrfs_format::Corrupt;

/// POSIX-style failures of a request (the FUSE adapter maps these to errno).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PosixKind {
    NotFound,
    NotDir,
    IsDir,
    Exists,
    Invalid,
    ReadOnly,
    NoSpace,
    NameTooLong,
    NotEmpty,
    Loop,
    PermissionDenied,
    /// EPERM: immutable or append-only inodes.
    NotPermitted,
    /// EBUSY: the image is held by another writer or mounted by the kernel.
    Busy,
}

impl PosixKind {
    pub fn errno(self) -> i32 {
        match self {
            PosixKind::NotFound => 2,
            PosixKind::NotDir => 20,
            PosixKind::IsDir => 21,
            PosixKind::Exists => 17,
            PosixKind::Invalid => 22,
            PosixKind::ReadOnly => 30,
            PosixKind::NoSpace => 28,
            PosixKind::NameTooLong => 36,
            PosixKind::NotEmpty => 39,
            PosixKind::Loop => 40,
            PosixKind::PermissionDenied => 13,
            PosixKind::NotPermitted => 1,
            PosixKind::Busy => 16,
        }
    }
    fn as_str(self) -> &'static str {
        match self {
            PosixKind::NotFound => "no such file or directory",
            PosixKind::NotDir => "not a directory",
            PosixKind::IsDir => "is a directory",
            PosixKind::Exists => "file exists",
            PosixKind::Invalid => "invalid argument",
            PosixKind::ReadOnly => "read-only filesystem",
            PosixKind::NoSpace => "no space left on device",
            PosixKind::NameTooLong => "file name too long",
            PosixKind::NotEmpty => "directory not empty",
            PosixKind::Loop => "too many levels of symbolic links",
            PosixKind::PermissionDenied => "permission denied",
            PosixKind::NotPermitted => "operation not permitted",
            PosixKind::Busy => "device or resource busy",
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
    pub fn posix_detail(kind: PosixKind, path: impl Into<String>, detail: impl Into<String>) -> Error {
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
}

pub type Result<T> = std::result::Result<T, Error>;
