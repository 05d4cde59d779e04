//! Filling a new filesystem from a host directory (`mkfs --rootdir`), and what makes
//! the result reproducible.
//!
//! `populate` copies the tree into the top directory (`put::put_contents`: contents
//! with holes kept, modes, owners through an owner map, times, hard links, symlinks,
//! xattrs, special files, the chosen directories as subvolumes) and sets the default
//! subvolume.
//!
//! Reproducibility (`SOURCE_DATE_EPOCH`, or `--reproducible`): the same input gives the
//! same bytes. What varies between two builds of one tree is taken out:
//! - the engine's clock and UUIDs come from `reproducible_sources`: times mkfs makes
//!   (the top directory's ctime and otime, subvolumes' times, every ctime) count from
//!   the epoch, and UUIDs follow a seed;
//! - the filesystem's own UUIDs come from `derive_uuid`, a hash of the tree's digest,
//!   the label and what the UUID is for;
//! - the tree's digest (`tree_digest`) covers what the image will hold (each path in
//!   byte order, its type, mode, mapped owner, a file's size, mtime, a device's rdev,
//!   link target, and xattr names and values) and nothing of the host's inode numbers,
//!   readdir order or directory sizes (which are the host filesystem's: 4096 on ext4,
//!   the entries' count on tmpfs);
//! - entries are copied in byte order of their names, not the host's readdir order.

use crate::put::{put_contents, OwnerMap, PutOptions, PutStats};
use sha2::{Digest, Sha256};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use ubtrfs_core::{Engine, Error, FileKind, FsRead, Load, PosixKind, Result, Sources, Time};

/// What `populate` does besides copying.
#[derive(Clone, Debug, Default)]
pub struct PopulateOptions {
    /// The copy's options (owner map, subvolumes as source paths, progress).
    pub put: PutOptions,
    /// Make the subvolume at this path (inside the image, e.g. "/@root") the default.
    pub default_subvol: Option<String>,
}

/// Copy `rootdir` into the top directory of the filesystem `w` writes and set the
/// default subvolume (in the engine's running transaction; the caller syncs).
///
/// # Errors
/// As `put::put_contents`, naming the host path; `Posix(Invalid)` when the default
/// subvolume's path is not one of the subvolumes made.
pub fn populate(e: &Engine, rootdir: &Path, opts: &PopulateOptions) -> Result<PutStats> {
    let top = e.read(|l| Ok(l.root_dir()))?;
    let stats = put_contents(e, rootdir, top, &opts.put)?;
    if let Some(p) = &opts.default_subvol {
        let path = crate::edit::absolute(p)?;
        let id = e.read(|l| l.resolve_id(path, true))?;
        let v = e.read(|l| l.load_inode(id, Load::ITEM))?;
        if id.ino != ubtrfs_format::key::FIRST_FREE_OBJECTID
            || v.kind() != FileKind::Dir
            || id.root == top.root
        {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                ubtrfs_core::quote::name(path.as_bytes()),
                "the default subvolume must be one of the subvolumes made (--subvol)",
            ));
        }
        e.set_default_subvol(id.root)?;
    }
    Ok(stats)
}

/// A digest of what the image will hold of `root` (see the module notes): equal for two
/// copies of one tree, whatever their inode numbers and readdir order.
///
/// # Errors
/// `Io` naming an entry that cannot be read.
pub fn tree_digest(root: &Path, owners: &OwnerMap) -> Result<[u8; 32]> {
    let mut h = Sha256::new();
    let mut stack: Vec<PathBuf> = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let p = root.join(&rel);
        let md = std::fs::symlink_metadata(&p)
            .map_err(|e| Error::io(format!("cannot stat {}", ubtrfs_core::quote::path(&p)), e))?;
        let (uid, gid) = owners.map(md.uid(), md.gid());
        h.update(rel.as_os_str().as_encoded_bytes());
        h.update([0]);
        // A directory's st_size is the host filesystem's (4096 on ext4, the entries'
        // count on tmpfs), not what the image holds (its names, hashed below); an
        // rdev counts only for device nodes.
        let ft = md.file_type();
        use std::os::unix::fs::FileTypeExt;
        let size = if md.is_dir() { 0 } else { md.len() };
        let rdev = if ft.is_char_device() || ft.is_block_device() { md.rdev() } else { 0 };
        h.update(
            format!("{:o} {uid} {gid} {size} {} {} {rdev}", md.mode(), md.mtime(), md.mtime_nsec())
                .as_bytes(),
        );
        for (name, value) in xattrs_of(&p)? {
            h.update([1]);
            h.update(&name);
            h.update([0]);
            h.update((value.len() as u64).to_le_bytes());
            h.update(&value);
        }
        if md.file_type().is_symlink() {
            let t = std::fs::read_link(&p).map_err(|e| {
                Error::io(format!("cannot read the link {}", ubtrfs_core::quote::path(&p)), e)
            })?;
            h.update(t.as_os_str().as_encoded_bytes());
        }
        h.update([0]);
        if md.is_dir() {
            let mut names: Vec<_> = std::fs::read_dir(&p)
                .map_err(|e| Error::io(format!("cannot read {}", ubtrfs_core::quote::path(&p)), e))?
                .map(|e| e.map(|e| e.file_name()))
                .collect::<std::io::Result<_>>()
                .map_err(|e| {
                    Error::io(format!("cannot read {}", ubtrfs_core::quote::path(&p)), e)
                })?;
            // Reverse byte order onto the stack: popped in byte order.
            names.sort();
            for n in names.into_iter().rev() {
                stack.push(rel.join(n));
            }
        }
    }
    Ok(h.finalize().into())
}

/// The extended attributes of `p` (not followed), sorted by name; none where the host
/// filesystem keeps none.
///
/// # Errors
/// `Io` naming `p` when they cannot be listed or read.
fn xattrs_of(p: &Path) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::posix(PosixKind::Invalid, ubtrfs_core::quote::path(p).into_owned()))?;
    let fail = || {
        Error::io(
            format!("cannot read the xattrs of {}", ubtrfs_core::quote::path(p)),
            std::io::Error::last_os_error(),
        )
    };
    let unsupported =
        || matches!(std::io::Error::last_os_error().raw_os_error(), Some(libc::ENOTSUP));
    // A list that grows between the size query and the read is asked again.
    let names = loop {
        // SAFETY: a size query (NULL buffer, size 0) of a NUL-terminated path.
        let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
        if n < 0 {
            return if unsupported() { Ok(Vec::new()) } else { Err(fail()) };
        }
        let mut buf = vec![0u8; n as usize];
        // SAFETY: `buf` has room for `buf.len()` bytes.
        let m = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if m >= 0 {
            buf.truncate(m as usize);
            break buf;
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::ERANGE) {
            return Err(fail());
        }
    };
    let mut out = Vec::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cn = std::ffi::CString::new(name).expect("split at NULs");
        let value = loop {
            // SAFETY: as above, for one name.
            let n = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), std::ptr::null_mut(), 0) };
            if n < 0 {
                return Err(fail());
            }
            let mut v = vec![0u8; n as usize];
            // SAFETY: `v` has room for `v.len()` bytes.
            let m =
                unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
            if m >= 0 {
                v.truncate(m as usize);
                break v;
            }
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::ERANGE) {
                return Err(fail());
            }
        };
        out.push((name.to_vec(), value));
    }
    out.sort();
    Ok(out)
}

/// The SHA-256 of `bytes` (a digest of what else shapes the image, next to the tree's).
pub fn tree_digest_of_bytes(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// A UUID for `what` ("fsid", "chunk tree", "device 1", ...) of a reproducible build:
/// a hash of the tree's digest, the label and `what`, as an RFC 4122 version-8
/// (name-based, custom hash) UUID.
pub fn derive_uuid(digest: &[u8; 32], label: &str, what: &str) -> [u8; 16] {
    let mut h = Sha256::new();
    h.update(b"ubtrfs mkfs uuid\0");
    h.update(digest);
    h.update(label.as_bytes());
    h.update([0]);
    h.update(what.as_bytes());
    let d = h.finalize();
    let mut u = [0u8; 16];
    u.copy_from_slice(&d[..16]);
    u[6] = (u[6] & 0x0f) | 0x80;
    u[8] = (u[8] & 0x3f) | 0x80;
    u
}

/// The engine's clock and UUID source for a reproducible build: time starts at `epoch`
/// (SOURCE_DATE_EPOCH) and UUIDs follow a seed taken from the digest.
pub fn reproducible_sources(epoch: i64, digest: &[u8; 32]) -> Sources {
    let seed = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
    Sources::deterministic(Time { sec: epoch, nsec: 0 }, seed)
}

/// SOURCE_DATE_EPOCH from the environment, if set.
///
/// # Errors
/// `Posix(Invalid)` when it is set but not a decimal number of seconds.
pub fn source_date_epoch() -> Result<Option<i64>> {
    match std::env::var("SOURCE_DATE_EPOCH") {
        Ok(v) => v.trim().parse::<i64>().map(Some).map_err(|_| {
            Error::posix_detail(
                PosixKind::Invalid,
                format!("SOURCE_DATE_EPOCH={v:?}"),
                "not a number of seconds",
            )
        }),
        Err(_) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_stable_and_distinct() {
        let d = [7u8; 32];
        let a = derive_uuid(&d, "root", "fsid");
        assert_eq!(a, derive_uuid(&d, "root", "fsid"));
        assert_ne!(a, derive_uuid(&d, "root", "chunk tree"));
        assert_ne!(a, derive_uuid(&d, "other", "fsid"));
        assert_ne!(a, derive_uuid(&[8u8; 32], "root", "fsid"));
        assert_eq!(a[6] >> 4, 8, "version 8");
        assert_eq!(a[8] >> 6, 2, "RFC 4122 variant");
    }
}
