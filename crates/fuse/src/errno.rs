//! The one mapping from engine errors to the errno a FUSE reply carries.
//!
//! POSIX kinds are their errno. An I/O error is EIO; a corrupt tree block or item is
//! EUCLEAN, as the kernel's tree-checker answers; an incompatible filesystem (a
//! feature ubtrfs cannot write) is EROFS for changes, as a kernel mount that fell back
//! to read-only answers. Every error that is not a plain POSIX answer is worth a line
//! in the mount's log: `loggable` says which.

use fuser::Errno;
use ubtrfs_core::Error;

/// The errno for `e`.
pub fn errno_of(e: &Error) -> Errno {
    Errno::from_i32(raw_errno(e))
}

/// The errno value (positive) for `e`.
pub fn raw_errno(e: &Error) -> i32 {
    match e.inner() {
        Error::Posix { kind, .. } => kind.errno(),
        Error::Io { source, .. } => source
            .raw_os_error()
            .filter(|&n| n == libc::ENOSPC || n == libc::EDQUOT)
            .unwrap_or(libc::EIO),
        Error::Corrupt(_) => libc::EUCLEAN,
        Error::Incompatible(_) => libc::EROFS,
        // The engine's own control flow: it reads the block named and runs the
        // operation again, and never returns one, so none comes here.
        Error::CacheMiss { .. } => {
            debug_assert!(false, "a cache miss left the engine: {e}");
            libc::EIO
        }
        Error::At { .. } => unreachable!("inner() looks through At"),
    }
}

/// Whether `e` says something went wrong in the filesystem (I/O, corruption, an
/// abort), rather than answering a request with a POSIX error.
pub fn loggable(e: &Error) -> bool {
    match e.inner() {
        Error::Posix { kind, .. } => *kind == ubtrfs_core::PosixKind::ReadOnly,
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ubtrfs_core::PosixKind;

    #[test]
    fn each_family_has_its_errno() {
        assert_eq!(raw_errno(&Error::posix(PosixKind::NotEmpty, "/d")), libc::ENOTEMPTY);
        assert_eq!(raw_errno(&Error::posix(PosixKind::NotFound, "/x").at("lookup")), libc::ENOENT);
        assert_eq!(
            raw_errno(&Error::io("read", std::io::Error::from_raw_os_error(libc::EBADF))),
            libc::EIO
        );
        assert_eq!(
            raw_errno(&Error::io("write", std::io::Error::from_raw_os_error(libc::ENOSPC))),
            libc::ENOSPC
        );
        assert_eq!(raw_errno(&Error::Incompatible("x".into())), libc::EROFS);
        let c = ubtrfs_format::Corrupt::new(ubtrfs_format::CorruptWhere::Item, "bad");
        assert_eq!(raw_errno(&Error::from(c)), libc::EUCLEAN);
        assert!(!loggable(&Error::posix(PosixKind::Exists, "/a")));
        assert!(loggable(&Error::posix(PosixKind::ReadOnly, "engine")));
    }
}
