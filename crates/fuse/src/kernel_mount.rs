//! How the FUSE mount is made and unmade: mount(2) of type `fuse.ubtrfs` on a
//! /dev/fuse descriptor of our own where we may (root), else the set-user-ID
//! `fusermount3`, which opens /dev/fuse and mounts for us and hands the descriptor
//! back over a socket (`_FUSE_COMMFD`), as libfuse's `fuse_kern_mount` does.
//!
//! libfuse (3.14, lib/mount.c) and fuser 0.18 (mnt/fuse_pure.rs) fall back to
//! fusermount3 only when mount(2) fails with EPERM: a user who cannot open /dev/fuse
//! (mode 0600, as in some containers) got "Permission denied" though fusermount3,
//! which opens it as root, would have worked. Here any user who is not root goes to
//! fusermount3 when /dev/fuse does not open or mount(2) is not allowed, and when
//! nothing works the error names each cause: /dev/fuse's mode and owner, fusermount3
//! missing or not set-user-ID root, and fusermount3's own words (`user_allow_other`
//! missing from /etc/fuse.conf, a mount point the user does not own, ...).
//!
//! The flags: `nodev` and `nosuid` unless `dev` / `suid` are asked for, which only
//! root gets (fusermount3 forces both on users, saying so); `noexec` and `ro` as asked.
//! The mount's source is the image's path and its type `fuse.ubtrfs`.
//!
//! Neighbours: `session` (which serves the descriptor), `options`.

use crate::options::MountOptions;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use ubtrfs_core::{
    mountinfo::{self, DevNum},
    Error, PosixKind, Result,
};

/// The mount's type as mount(8), findmnt and umount(8) see it.
pub const FSTYPE: &str = "fuse.ubtrfs";
const SUBTYPE: &str = "ubtrfs";

/// Who made the mount, which decides how it is unmade.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mounter {
    /// mount(2) by this process (root): umount(2) undoes it.
    Direct,
    /// fusermount3 (a user): `fusermount3 -u` undoes it.
    Fusermount,
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| {
        Error::posix(PosixKind::Invalid, format!("{}: a NUL in the path", p.display()))
    })
}

/// mount(2)'s flags for `opts`: `MS_NODEV`, `MS_NOSUID`, `MS_NOEXEC`, `MS_RDONLY`,
/// and the atime rule, which the mount table then shows as a kernel mount's (the
/// atime updates themselves are the daemon's).
pub fn ms_flags(opts: &MountOptions) -> libc::c_ulong {
    use ubtrfs_core::AtimeMode;
    let mut f = match opts.atime.mode {
        AtimeMode::Noatime => libc::MS_NOATIME,
        AtimeMode::Relatime => libc::MS_RELATIME,
        AtimeMode::Strict => libc::MS_STRICTATIME,
    };
    if opts.atime.nodiratime {
        f |= libc::MS_NODIRATIME;
    }
    if !opts.dev {
        f |= libc::MS_NODEV;
    }
    if !opts.suid {
        f |= libc::MS_NOSUID;
    }
    if !opts.exec {
        f |= libc::MS_NOEXEC;
    }
    if opts.read_only {
        f |= libc::MS_RDONLY;
    }
    f
}

/// Mount the FUSE filesystem for `source` on `mountpoint` (absolute); returns the
/// /dev/fuse descriptor to serve and who mounted.
///
/// # Errors
/// `Io` naming the mount point and every reason the mount could not be made.
pub fn mount(source: &Path, mountpoint: &Path, opts: &MountOptions) -> Result<(OwnedFd, Mounter)> {
    let at = |e: std::io::Error| Error::io(format!("mount {}", mountpoint.display()), e);
    let rootmode = std::fs::metadata(mountpoint).map_err(at)?.mode() & libc::S_IFMT;
    let dev_fuse = std::fs::OpenOptions::new().read(true).write(true).open("/dev/fuse");
    let why_not_direct = match dev_fuse {
        Ok(f) => {
            let fd = OwnedFd::from(f);
            // SAFETY: getuid and getgid have no preconditions.
            let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
            let mut data = format!(
                "fd={},rootmode={rootmode:o},user_id={uid},group_id={gid},default_permissions",
                fd.as_raw_fd()
            );
            if opts.allow_other {
                data.push_str(",allow_other");
            }
            let (src, mnt, ty, data) = (
                cstr(source)?,
                cstr(mountpoint)?,
                CString::new(FSTYPE).expect("no NUL"),
                CString::new(data).expect("no NUL"),
            );
            // SAFETY: NUL-terminated strings for mount(2), which copies them.
            let r = unsafe {
                libc::mount(
                    src.as_ptr(),
                    mnt.as_ptr(),
                    ty.as_ptr(),
                    ms_flags(opts),
                    data.as_ptr().cast(),
                )
            };
            if r == 0 {
                return Ok((fd, Mounter::Direct));
            }
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EPERM) || is_root() {
                return Err(at(e));
            }
            "mount(2) is for root only".to_string()
        }
        Err(e) if is_root() => return Err(Error::io("open /dev/fuse", e)),
        Err(e) => format!("cannot open /dev/fuse: {}{}", e, dev_fuse_mode()),
    };
    let why = match fusermount(source, mountpoint, opts) {
        Ok(fd) => return Ok((fd, Mounter::Fusermount)),
        // fusermount3 opens /dev/fuse as the calling user (its `drop_privs`): who
        // cannot open it may not use FUSE at all.
        Err(e) if e.contains("failed to open /dev/fuse") => {
            format!("{why_not_direct}; fusermount3 opens it as the calling user too, so this user may not use FUSE here (/dev/fuse is usually mode 0666)")
        }
        Err(e) => format!("{why_not_direct}, and fusermount3: {e}"),
    };
    Err(Error::io(
        format!("mount {}", mountpoint.display()),
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, why),
    ))
}

/// " (mode 0600, owner root)" for /dev/fuse, to say why a user cannot open it.
fn dev_fuse_mode() -> String {
    match std::fs::metadata("/dev/fuse") {
        Ok(m) => format!(" (mode {:04o}, owner uid {})", m.permissions().mode() & 0o7777, m.uid()),
        Err(_) => String::new(),
    }
}

/// The fusermount3 executable: on PATH, else where the fuse3 package puts it.
fn fusermount_bin() -> std::result::Result<PathBuf, String> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("fusermount3")).collect::<Vec<_>>())
        .unwrap_or_default();
    let found = on_path
        .into_iter()
        .chain(["/usr/bin/fusermount3", "/bin/fusermount3"].map(PathBuf::from))
        .find(|p| p.is_file());
    let Some(bin) = found else {
        return Err("fusermount3 is not installed (the fuse3 package has it)".to_string());
    };
    let md = std::fs::metadata(&bin).map_err(|e| format!("{}: {e}", bin.display()))?;
    if md.uid() != 0 || md.permissions().mode() & 0o4000 == 0 {
        return Err(format!(
            "{} is not set-user-ID root (mode {:04o}, owner uid {}): chown root and chmod u+s it",
            bin.display(),
            md.permissions().mode() & 0o7777,
            md.uid()
        ));
    }
    Ok(bin)
}

/// A value inside fusermount3's `-o` list: its commas and backslashes escaped, as
/// libfuse's `fuse_opt_add_opt_escaped` does.
fn escaped(v: &str) -> String {
    v.replace('\\', "\\\\").replace(',', "\\,")
}

/// Mount through fusermount3: it mounts and passes the /dev/fuse descriptor back on
/// the socket named by `_FUSE_COMMFD`.
fn fusermount(
    source: &Path,
    mountpoint: &Path,
    opts: &MountOptions,
) -> std::result::Result<OwnedFd, String> {
    let bin = fusermount_bin()?;
    if opts.dev || opts.suid {
        // fusermount3 says "unsafe option ... ignored" and mounts nodev,nosuid.
        crate::log::log("dev and suid need root; the mount is nodev,nosuid");
    }
    let mut o =
        vec![if opts.read_only { "ro" } else { "rw" }.to_string(), "nodev".into(), "nosuid".into()];
    if !opts.exec {
        o.push("noexec".into());
    }
    if opts.atime.mode == ubtrfs_core::AtimeMode::Noatime {
        o.push("noatime".into());
    }
    o.push("default_permissions".into());
    if opts.allow_other {
        o.push("allow_other".into());
    }
    o.push(format!("fsname={}", escaped(&source.display().to_string())));
    o.push(format!("subtype={SUBTYPE}"));
    let (ours, theirs) =
        std::os::unix::net::UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
    // The child's end must survive the exec: a duplicate without CLOEXEC.
    // SAFETY: dup of a descriptor we own; the result is owned below.
    let raw = unsafe { libc::dup(theirs.as_raw_fd()) };
    if raw < 0 {
        return Err(format!("dup: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh descriptor from dup.
    let child_end = unsafe { OwnedFd::from_raw_fd(raw) };
    drop(theirs);
    let child = std::process::Command::new(&bin)
        .arg("-o")
        .arg(o.join(","))
        .arg("--")
        .arg(mountpoint)
        .env("_FUSE_COMMFD", raw.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("{}: {e}", bin.display()));
    drop(child_end);
    let child = child?;
    let fd = receive_fd(&ours);
    drop(ours);
    let out = child.wait_with_output().map_err(|e| format!("{}: {e}", bin.display()))?;
    let said = String::from_utf8_lossy(&out.stderr).trim().to_string();
    match fd {
        Some(fd) if out.status.success() => Ok(fd),
        _ if said.is_empty() => Err(format!("{} failed ({})", bin.display(), out.status)),
        _ => Err(said),
    }
}

/// The descriptor fusermount3 sends (SCM_RIGHTS), None if it sent none.
fn receive_fd(sock: &std::os::unix::net::UnixStream) -> Option<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    // Room for one control message with one descriptor, aligned for cmsghdr.
    let mut cbuf = [0u64; 8];
    // SAFETY: msghdr is plain data; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    loop {
        // SAFETY: msg points at live buffers of the sizes it states.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if n <= 0 {
            return None;
        }
        break;
    }
    // SAFETY: the CMSG macros walk the control buffer recvmsg filled, within
    // msg_controllen.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS
        {
            return None;
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
        (fd >= 0).then(|| OwnedFd::from_raw_fd(fd))
    }
}

/// Every mount point of the mount `dev` in this namespace (the first mount and the
/// bind mounts of it), deepest last.
pub fn mount_points(dev: DevNum) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mountinfo::parse_mountinfo(&text)
        .into_iter()
        .filter(|m| m.dev == dev)
        .map(|m| m.mount_point)
        .collect()
}

/// Unmount `mountpoint` as `by` mounted it (umount(2), or `fusermount3 -u`).
///
/// # Errors
/// `Io` with the reason (busy, ...).
pub fn unmount(mountpoint: &Path, by: Mounter) -> Result<()> {
    let at = |e: std::io::Error| Error::io(format!("unmount {}", mountpoint.display()), e);
    if by == Mounter::Direct || is_root() {
        let c = cstr(mountpoint)?;
        // SAFETY: umount2 reads a NUL-terminated path.
        if unsafe { libc::umount2(c.as_ptr(), 0) } != 0 {
            return Err(at(std::io::Error::last_os_error()));
        }
        return Ok(());
    }
    let bin = fusermount_bin().map_err(|e| at(std::io::Error::other(e)))?;
    let out = std::process::Command::new(&bin)
        .args(["-u", "-q", "-z", "--"])
        .arg(mountpoint)
        .output()
        .map_err(at)?;
    if !out.status.success() {
        return Err(at(std::io::Error::other(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_follow_the_options() {
        let d = MountOptions::default();
        assert_eq!(ms_flags(&d), libc::MS_RELATIME | libc::MS_NODEV | libc::MS_NOSUID);
        let h = MountOptions::for_helper();
        assert_eq!(ms_flags(&h), libc::MS_RELATIME);
        let o = MountOptions::parse("ro,noexec,dev,noatime,nodiratime").unwrap();
        assert_eq!(
            ms_flags(&o),
            libc::MS_NOATIME
                | libc::MS_NODIRATIME
                | libc::MS_NOSUID
                | libc::MS_NOEXEC
                | libc::MS_RDONLY
        );
        let o = MountOptions::parse("strictatime").unwrap();
        assert_eq!(ms_flags(&o) & libc::MS_STRICTATIME, libc::MS_STRICTATIME);
    }

    #[test]
    fn fusermount_values_are_escaped() {
        assert_eq!(escaped("/a,b\\c"), "/a\\,b\\\\c");
    }
}
