//! `ubtrfs mount`, the `mount.fuse.ubtrfs` helper that mount(8) runs for
//! `mount -t fuse.ubtrfs` and fstab lines, `ubtrfs install-helper`, which puts the
//! helper where mount(8) looks for it, and `ubtrfs umount`, which unmounts and waits
//! for the mount's process to write its last commit and exit (the kernel's umount of a
//! FUSE mount returns before that).
//!
//! `--daemon` (and the helper, unless given `-f`) forks before anything else runs, so
//! the child that serves the mount is the only process with threads; the parent waits
//! for the child to say the mount is ready (or why it failed) on a pipe, and exits
//! with that outcome, as mount(8) expects of a helper.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use ubtrfs_core::error::{Error, PosixKind, Result};
use ubtrfs_core::volumes::{device_lock, mountinfo};
use ubtrfs_fuse::MountOptions;

/// The helper's name: mount(8) runs `/sbin/mount.fuse.ubtrfs` for `-t fuse.ubtrfs`.
pub const HELPER_NAME: &str = "mount.fuse.ubtrfs";
/// The unmount helper's name: umount(8) runs `/sbin/umount.fuse.ubtrfs` for a mount of
/// type `fuse.ubtrfs`, which makes a plain `umount` wait as `ubtrfs umount` does.
pub const UMOUNT_HELPER_NAME: &str = "umount.fuse.ubtrfs";

#[derive(clap::Args)]
pub struct MountArgs {
    /// Mount options, comma-separated (repeatable): ro, rw, compress=ALG[:LEVEL],
    /// compress-force=ALG[:LEVEL], commit=SECONDS, subvol=PATH, subvolid=N,
    /// allow_other, default_permissions, uid=N, gid=N, noatime, relatime,
    /// strictatime, nodiratime, cache_mib=N, page_cache_mib=N, dirty_mib=N, threads=N,
    /// dev, suid, noexec, degraded, device=PATH.
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// The image file or block device (for multi-device filesystems, any one member).
    pub image: PathBuf,
    /// Where to mount it.
    pub mountpoint: PathBuf,
    /// Another device of a multi-device filesystem (repeat for each).
    #[arg(long = "device", value_name = "DEV")]
    pub devices: Vec<PathBuf>,
    /// Detach once the mount is ready (the default is to stay in the foreground until
    /// unmounted).
    #[arg(long)]
    pub daemon: bool,
}

#[derive(clap::Args)]
pub struct UmountArgs {
    /// The mount point of a ubtrfs mount.
    pub mountpoint: PathBuf,
}

#[derive(clap::Args)]
pub struct InstallHelperArgs {
    /// The directory mount(8) searches for helpers.
    #[arg(long, default_value = "/sbin")]
    pub dir: PathBuf,
}

/// Parse every `-o` list.
fn options(lists: &[String]) -> Result<MountOptions> {
    let mut o = MountOptions::default();
    for l in lists {
        o.apply(l)?;
    }
    Ok(o)
}

/// Open, mount and serve; `ready` runs once the kernel has the mount.
fn mount(image: &Path, devices: &[PathBuf], mountpoint: &Path, opts: MountOptions, ready: impl FnOnce()) -> Result<()> {
    // A directory, as mount(2) wants for a directory tree (ENOTDIR otherwise): FUSE
    // would mount over a regular file and every access would then fail with EIO.
    // Checked before the image is opened, so a wrong mount point locks nothing.
    match std::fs::metadata(mountpoint) {
        Ok(m) if !m.is_dir() => return Err(Error::posix_detail(PosixKind::NotDir, mountpoint.display().to_string(), "the mount point must be a directory")),
        Ok(_) => {}
        Err(e) => return Err(Error::io(format!("mount point {}", mountpoint.display()), e)),
    }
    let mut all = vec![image.to_path_buf()];
    all.extend(devices.iter().cloned());
    let engine = ubtrfs_fuse::open_engine(&all, &opts)?;
    crate::print_warnings(engine.info());
    let top = ubtrfs_fuse::find_top(&engine, &opts)?;
    ubtrfs_fuse::serve(engine, top, image, mountpoint, opts, ready)
}

/// Run `mount` in a forked child; return in the parent once the child reports.
fn daemonize(run: impl FnOnce(Box<dyn FnOnce()>) -> Result<()>) -> Result<()> {
    let mut fds = [0; 2];
    // SAFETY: pipe fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Error::io("pipe", std::io::Error::last_os_error()));
    }
    // SAFETY: both are fresh descriptors from pipe2.
    let (rd, wr) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: no other thread runs yet (the command forks before opening anything).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(Error::io("fork", std::io::Error::last_os_error()));
    }
    if pid > 0 {
        drop(wr);
        let mut msg = String::new();
        let _ = std::fs::File::from(rd).read_to_string(&mut msg);
        return match msg.strip_prefix("ok") {
            Some(_) => Ok(()),
            None if msg.is_empty() => Err(Error::io("mount", std::io::Error::other("the mount process exited before the mount was ready"))),
            None => Err(Error::io("mount", std::io::Error::other(msg.trim_start_matches("error: ").to_string()))),
        };
    }
    drop(rd);
    // SAFETY: the child leaves the parent's session, and its stdin/stdout go to
    // /dev/null (stderr stays until the mount is ready, for an error before it).
    unsafe {
        libc::setsid();
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            libc::dup2(null, 0);
            libc::dup2(null, 1);
            libc::close(null);
        }
    }
    let wr = std::sync::Arc::new(std::sync::Mutex::new(Some(std::fs::File::from(wr))));
    let wr2 = wr.clone();
    let r = run(Box::new(move || {
        if let Some(mut f) = wr2.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = f.write_all(b"ok");
        }
        // Detached: messages go to syslog, and stderr lets go of whoever started us.
        ubtrfs_fuse::log::to_syslog();
        // SAFETY: fd 2 is replaced by /dev/null; nothing holds a borrowed copy of it.
        unsafe {
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            if null >= 0 {
                libc::dup2(null, 2);
                libc::close(null);
            }
        }
    }));
    if let Err(e) = &r {
        if let Some(mut f) = wr.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = write!(f, "error: {e}");
        }
    }
    std::process::exit(if r.is_ok() { 0 } else { 1 });
}

/// `ubtrfs mount`.
///
/// # Errors
/// A bad option, an image that does not open for writing, a mount that fails, or a
/// last commit that fails.
pub fn run(a: &MountArgs) -> Result<()> {
    let opts = options(&a.options)?;
    if a.daemon {
        return daemonize(|ready| mount(&a.image, &a.devices, &a.mountpoint, opts, ready));
    }
    mount(&a.image, &a.devices, &a.mountpoint, opts, || {})
}

/// `ubtrfs umount`: unmount a ubtrfs mount, then wait until the process that served it
/// has written its last commit and exited, so that the image is complete and free for
/// the next user (another mount, the kernel) when this returns.
///
/// The process is the FUSE daemon holding the image's lock (the mount's source is the
/// image's absolute path). As root the unmount is umount(2); otherwise `fusermount3 -u`.
///
/// # Errors
/// `Posix(Invalid)` for a directory that is not a ubtrfs mount point; `Io` or
/// `Posix(Busy)` when the unmount fails (nothing is waited for then).
pub fn umount(a: &UmountArgs) -> Result<()> {
    unmount_and_wait(&a.mountpoint, 0)
}

/// Unmount `mountpoint` with umount2 `flags` (as root) and wait for its process, as
/// `umount` says; a lazy unmount (MNT_DETACH) waits for nothing, since the mount lives
/// on while it is in use.
fn unmount_and_wait(mountpoint: &Path, flags: libc::c_int) -> Result<()> {
    let mnt = absolute(mountpoint)?;
    let text = std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| Error::io("read /proc/self/mountinfo", e))?;
    let shown = mnt.display().to_string();
    let Some(m) = mountinfo::parse_mountinfo(&text).into_iter().rev().find(|m| m.mount_point == mnt) else {
        return Err(Error::posix_detail(PosixKind::Invalid, shown, "not a mount point"));
    };
    if m.fstype != "fuse.ubtrfs" {
        return Err(Error::posix_detail(PosixKind::Invalid, shown, format!("not a ubtrfs mount (its type is {})", m.fstype)));
    }
    let mut pids: Vec<u32> = device_lock::lock_holders(&m.source).unwrap_or_default().iter().filter_map(|h| h.pid).filter(|&p| device_lock::is_fuse_daemon(p)).collect();
    pids.sort_unstable();
    pids.dedup();
    // Taken before the unmount: a pid reused after the daemon's exit is not waited for.
    let waits: Vec<(u32, Option<OwnedFd>)> = pids.iter().map(|&p| (p, pidfd(p))).collect();
    unmount(&mnt, flags)?;
    if flags & libc::MNT_DETACH != 0 {
        return Ok(());
    }
    if waits.is_empty() {
        eprintln!("warning: no process serving {shown} was found (holding {}); not waiting for its last commit", m.source.display());
    }
    for (pid, fd) in waits {
        wait_exit(pid, fd, &m.source);
    }
    Ok(())
}

/// `p` made absolute without looking at its last component, which may be the root of a
/// mount whose daemon no longer answers.
fn absolute(p: &Path) -> Result<PathBuf> {
    let cannot = |e| Error::io(format!("cannot find {}", p.display()), e);
    let name = p.file_name().filter(|n| *n != ".." && *n != ".");
    match (p.parent(), name) {
        (Some(dir), Some(name)) => {
            let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
            Ok(std::fs::canonicalize(dir).map_err(cannot)?.join(name))
        }
        _ => std::fs::canonicalize(p).map_err(cannot),
    }
}

fn unmount(mnt: &Path, flags: libc::c_int) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        let mut cmd = std::process::Command::new("fusermount3");
        cmd.arg("-u");
        if flags & libc::MNT_DETACH != 0 {
            cmd.arg("-z");
        }
        let out = cmd.arg(mnt).output().map_err(|e| Error::io("run fusermount3", e))?;
        if !out.status.success() {
            let why = String::from_utf8_lossy(&out.stderr).trim().to_string();
            return Err(Error::io(format!("unmount {}", mnt.display()), std::io::Error::other(why)));
        }
        return Ok(());
    }
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(mnt.as_os_str().as_bytes()).map_err(|_| Error::posix(PosixKind::Invalid, format!("{}: a NUL in the path", mnt.display())))?;
    // SAFETY: umount2 reads a NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), flags) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EBUSY) {
            return Err(Error::posix_detail(PosixKind::Busy, mnt.display().to_string(), "in use (an open file or a process inside it)"));
        }
        return Err(Error::io(format!("unmount {}", mnt.display()), e));
    }
    Ok(())
}

/// A pidfd for `pid` (Linux 5.3 and later), None where there is none.
fn pidfd(pid: u32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    // SAFETY: a fresh descriptor the call returned, owned from here on.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Wait for process `pid` to exit (its pidfd turns readable), saying so after a second.
fn wait_exit(pid: u32, fd: Option<OwnedFd>, image: &Path) {
    use std::os::fd::AsRawFd;
    let start = std::time::Instant::now();
    let mut told = false;
    loop {
        let gone = match &fd {
            Some(fd) => {
                let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one pollfd for a descriptor we own.
                let n = unsafe { libc::poll(&mut p, 1, 100) };
                n > 0
            }
            None => {
                std::thread::sleep(std::time::Duration::from_millis(10));
                // SAFETY: signal 0 only checks that the process exists.
                unsafe { libc::kill(pid as libc::pid_t, 0) != 0 }
            }
        };
        if gone {
            return;
        }
        if !told && start.elapsed() >= std::time::Duration::from_secs(1) {
            eprintln!("waiting for the ubtrfs process {pid} to write its last commit to {} and exit", image.display());
            told = true;
        }
    }
}

/// `ubtrfs install-helper`: `mount.fuse.ubtrfs` and `umount.fuse.ubtrfs` links to this
/// executable in `dir`.
///
/// # Errors
/// `Io` when a link cannot be made.
pub fn install_helper(a: &InstallHelperArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("find this executable", e))?;
    for name in [HELPER_NAME, UMOUNT_HELPER_NAME] {
        let link = a.dir.join(name);
        match std::fs::symlink_metadata(&link) {
            Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(&link).map_err(|e| Error::io(format!("replace {}", link.display()), e))?,
            Ok(_) => return Err(Error::io(format!("install {}", link.display()), std::io::Error::from(std::io::ErrorKind::AlreadyExists))),
            Err(_) => {}
        }
        std::os::unix::fs::symlink(&exe, &link).map_err(|e| Error::io(format!("link {} to {}", link.display(), exe.display()), e))?;
        println!("{} -> {}", link.display(), exe.display());
    }
    Ok(())
}

/// Run as the `umount.fuse.ubtrfs` helper: `MOUNTPOINT [-flnrv] [-N NS] [-t TYPE]`, as
/// umount(8) calls it. `-l` unmounts lazily without waiting, `-f` forces; `-n`, `-r`,
/// `-v` and `-t` mean nothing here; `-N` (another mount namespace) is refused.
pub fn umount_helper_main(args: Vec<OsString>) -> ExitCode {
    let r = (|| {
        let mut pos: Vec<PathBuf> = Vec::new();
        let mut flags = 0;
        let mut it = args.into_iter().skip(1);
        while let Some(a) = it.next() {
            match a.to_str() {
                Some("-t") => {
                    it.next();
                }
                Some("-N") => return Err(Error::posix_detail(PosixKind::NotSupported, UMOUNT_HELPER_NAME, "-N: another mount namespace")),
                Some(s) if s.starts_with('-') && s.len() > 1 => {
                    for c in s[1..].chars() {
                        match c {
                            'l' => flags |= libc::MNT_DETACH,
                            'f' => flags |= libc::MNT_FORCE,
                            'n' | 'r' | 'v' => {}
                            _ => return Err(Error::posix_detail(PosixKind::Invalid, UMOUNT_HELPER_NAME, format!("unknown option -{c}"))),
                        }
                    }
                }
                _ => pos.push(PathBuf::from(a)),
            }
        }
        let [mountpoint] = <[PathBuf; 1]>::try_from(pos).map_err(|_| Error::posix_detail(PosixKind::Invalid, UMOUNT_HELPER_NAME, "usage: umount.fuse.ubtrfs MOUNTPOINT [-flnrv]"))?;
        unmount_and_wait(&mountpoint, flags)
    })();
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{UMOUNT_HELPER_NAME}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Run as the `mount.fuse.ubtrfs` helper: `SOURCE MOUNTPOINT [-o OPTIONS] [-f] [-n]
/// [-s] [-v]`, as mount(8) calls it (`-f` foreground; `-n`, `-s`, `-v` are mount(8)'s
/// and mean nothing here).
pub fn helper_main(args: Vec<OsString>) -> ExitCode {
    let r = (|| {
        let mut pos: Vec<PathBuf> = Vec::new();
        let mut lists = Vec::new();
        let mut foreground = false;
        let mut it = args.into_iter().skip(1);
        while let Some(a) = it.next() {
            match a.to_str() {
                Some("-o") => lists.push(it.next().and_then(|v| v.into_string().ok()).ok_or_else(|| Error::posix(ubtrfs_core::PosixKind::Invalid, "-o needs options"))?),
                Some(s) if s.starts_with("-o") => lists.push(s[2..].to_string()),
                Some("-f") => foreground = true,
                Some("-n" | "-s" | "-v") => {}
                _ => pos.push(PathBuf::from(a)),
            }
        }
        let [image, mountpoint] =
            <[PathBuf; 2]>::try_from(pos).map_err(|_| Error::posix_detail(ubtrfs_core::PosixKind::Invalid, HELPER_NAME, "usage: mount.fuse.ubtrfs IMAGE MOUNTPOINT [-o OPTIONS]"))?;
        let opts = options(&lists)?;
        if foreground {
            mount(&image, &[], &mountpoint, opts, || {})
        } else {
            daemonize(|ready| mount(&image, &[], &mountpoint, opts, ready))
        }
    })();
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{HELPER_NAME}: error: {e}");
            ExitCode::FAILURE
        }
    }
}
