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
//!
//! Two things do not start a daemon. `-o remount,...` (mount(8) runs the helper for a
//! remount of a `fuse.ubtrfs` mount, with the mount's options merged in) changes the
//! running mount with mount(2) `MS_REMOUNT`, as root only. And a mount of an image a
//! ubtrfs daemon already serves is, as root, a bind mount of its mount: the kernel
//! mounts one btrfs twice as two mounts of one superblock, and so do we, with one
//! daemon and one engine behind both; the daemon's last commit waits for the last of
//! them to go. A user's second mount is refused, naming the first and its daemon.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use ubtrfs_core::{device_lock, mountinfo, Error, PosixKind, Result};
use ubtrfs_fuse::{kernel_mount, MountOptions};

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
    /// dev, suid, noexec, degraded, device=PATH, rescue=nologreplay (with ro).
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

/// Parse every `-o` list over `base`.
fn options(base: MountOptions, lists: &[String]) -> Result<MountOptions> {
    let mut o = base;
    for l in lists {
        o.apply(l)?;
    }
    Ok(o)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The mount point must be a directory, as mount(2) wants for a directory tree
/// (ENOTDIR otherwise): FUSE would mount over a regular file and every access would
/// then fail with EIO. Checked before the image is opened, so a wrong mount point
/// locks nothing.
fn check_mountpoint(mountpoint: &Path) -> Result<()> {
    match std::fs::metadata(mountpoint) {
        Ok(m) if !m.is_dir() => Err(Error::posix_detail(
            PosixKind::NotDir,
            mountpoint.display().to_string(),
            "the mount point must be a directory",
        )),
        Ok(_) => Ok(()),
        Err(e) => Err(Error::io(format!("mount point {}", mountpoint.display()), e)),
    }
}

fn cstr(p: &Path) -> Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| {
        Error::posix(PosixKind::Invalid, format!("{}: a NUL in the path", p.display()))
    })
}

/// mount(2) with no type and no data (a bind mount or a remount).
fn mount2(source: Option<&Path>, target: &Path, flags: libc::c_ulong) -> std::io::Result<()> {
    let src = source.map(cstr).transpose().map_err(|e| std::io::Error::other(e.to_string()))?;
    let dst = cstr(target).map_err(|e| std::io::Error::other(e.to_string()))?;
    let src_ptr = src.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: NUL-terminated strings (or NULL) that outlive the call.
    if unsafe { libc::mount(src_ptr, dst.as_ptr(), std::ptr::null(), flags, std::ptr::null()) } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The mount table's entry for `mnt` (absolute): the last one mounted there.
fn mount_entry(mnt: &Path) -> Result<mountinfo::MountEntry> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| Error::io("read /proc/self/mountinfo", e))?;
    mountinfo::parse_mountinfo(&text).into_iter().rev().find(|m| m.mount_point == mnt).ok_or_else(
        || Error::posix_detail(PosixKind::Invalid, mnt.display().to_string(), "not a mount point"),
    )
}

/// The ubtrfs daemons holding `image` (pids), as `ubtrfs umount` finds them.
fn daemons(image: &Path) -> Vec<device_lock::FlockHolder> {
    device_lock::lock_holders(image)
        .unwrap_or_default()
        .into_iter()
        .filter(|h| h.pid.is_some_and(device_lock::is_fuse_daemon))
        .collect()
}

/// A ubtrfs daemon serving `image` in this mount namespace: its mount point and pid.
struct Served {
    mount_point: PathBuf,
    pid: u32,
}

/// The ubtrfs mount of `image` (the same file, whatever its name) whose daemon still
/// serves it; None when there is none, or its daemon is unmounting (a new mount then
/// waits for it, see `device_lock`).
fn served(image: &Path) -> Option<Served> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(image).ok()?;
    let pid = device_lock::lock_holders(image)
        .ok()?
        .into_iter()
        .filter_map(|h| h.pid)
        .find(|&p| !device_lock::is_unmounting(p))?;
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let same = |m: &mountinfo::MountEntry| {
        std::fs::metadata(&m.source).is_ok_and(|s| s.dev() == md.dev() && s.ino() == md.ino())
    };
    let m = mountinfo::parse_mountinfo(&text)
        .into_iter()
        .filter(|m| m.fstype == kernel_mount::FSTYPE && m.root == Path::new("/"))
        .find(same)?;
    Some(Served { mount_point: m.mount_point, pid })
}

/// A second mount of an image a ubtrfs daemon serves: a bind mount of the first, with
/// this mount's own flags (`ro`, `nodev`, ...), as the kernel's second mount of a
/// btrfs shares the superblock and keeps its own flags (measured on 6.18: `mount -o
/// loop,ro` of a mounted image makes a read-only mount of the read-write superblock,
/// and the btrfs options of a second mount, `commit=7`, change nothing).
fn bind_second(s: &Served, image: &Path, mountpoint: &Path, opts: &MountOptions) -> Result<()> {
    let shown = image.display().to_string();
    if !is_root() {
        let why = format!(
            "already mounted by ubtrfs at {} (process {}); a second mount of it is a bind mount, which needs root: use {}, or unmount it first",
            s.mount_point.display(),
            s.pid,
            s.mount_point.display()
        );
        return Err(Error::posix_detail(PosixKind::Busy, shown, why));
    }
    if opts.subvol.is_some() || opts.subvolid.is_some() {
        let why = format!(
            "already mounted by ubtrfs at {} (process {}); a second mount of another subvolume is not supported: bind-mount its directory under {}",
            s.mount_point.display(),
            s.pid,
            s.mount_point.display()
        );
        return Err(Error::posix_detail(PosixKind::Busy, shown, why));
    }
    check_mountpoint(mountpoint)?;
    let at = |e| Error::io(format!("mount {}", mountpoint.display()), e);
    mount2(Some(&s.mount_point), mountpoint, libc::MS_BIND).map_err(at)?;
    if let Err(e) =
        mount2(None, mountpoint, libc::MS_REMOUNT | libc::MS_BIND | kernel_mount::ms_flags(opts))
    {
        let _ = unmount(mountpoint, 0);
        return Err(at(e));
    }
    Ok(())
}

/// The BTRFS_IOC_SYNC ioctl: the daemon writes back and commits everything.
const BTRFS_IOC_SYNC: libc::c_ulong = 0x9408;

/// `-o remount,...`: change the running mount at `mountpoint` with mount(2)
/// `MS_REMOUNT`, its flags not named in `lists` kept (mount(8) passes the merged
/// list, `rw,nosuid,nodev,relatime,remount,user_id=0,group_id=0,default_permissions`,
/// unless given `-t` and the source, then only what was asked). `ro` makes the
/// superblock read-only (every mount of it; with `bind`, this mount point only):
/// the VFS refuses writes with EROFS from then on, and before this returns the daemon
/// has committed what was written before (BTRFS_IOC_SYNC), as the kernel's remount
/// syncs. `rw` makes it writable again. The btrfs and FUSE options in the list are
/// ignored, as the kernel's FUSE driver ignores a remount's options.
fn remount(mountpoint: &Path, lists: &[String]) -> Result<()> {
    let mnt = absolute(mountpoint)?;
    let shown = mnt.display().to_string();
    let m = mount_entry(&mnt)?;
    if m.fstype != kernel_mount::FSTYPE {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            shown,
            format!("not a ubtrfs mount (its type is {})", m.fstype),
        ));
    }
    if !is_root() {
        return Err(Error::posix_detail(PosixKind::NotPermitted, shown, "a remount needs root (fusermount3 has no remount): unmount it and mount it again with the options"));
    }
    // The mount's flags now, under what was asked: an absent nodev or nosuid is dev or suid.
    let mut o = MountOptions::for_helper();
    let known = ["ro", "rw", "nodev", "nosuid", "noexec", "noatime", "relatime", "nodiratime"];
    o.apply(
        &m.mount_options.split(',').filter(|f| known.contains(f)).collect::<Vec<_>>().join(","),
    )?;
    let o = options(o, lists)?;
    let going_ro = o.read_only && !o.bind;
    if !o.read_only
        && !o.bind
        && m.super_read_only()
        && daemons(&m.source).iter().any(|h| !h.exclusive)
    {
        return Err(Error::posix_detail(PosixKind::ReadOnly, shown, "mounted with -o ro, so the image is open read-only: unmount it and mount it read-write"));
    }
    let mut flags = libc::MS_REMOUNT | kernel_mount::ms_flags(&o);
    if o.bind {
        flags |= libc::MS_BIND;
    }
    if let Err(e) = mount2(None, &mnt, flags) {
        if e.raw_os_error() == Some(libc::EBUSY) && going_ro {
            return Err(Error::posix_detail(
                PosixKind::Busy,
                shown,
                "a file is open for writing there",
            ));
        }
        return Err(Error::io(format!("remount {shown}"), e));
    }
    if going_ro {
        use std::os::fd::AsRawFd;
        let dir = std::fs::File::open(&mnt).map_err(|e| Error::io(format!("open {shown}"), e))?;
        // SAFETY: an ioctl without an argument on a descriptor we own.
        if unsafe { libc::ioctl(dir.as_raw_fd(), BTRFS_IOC_SYNC as _, 0) } != 0 {
            return Err(Error::io(
                format!("commit {shown} at the remount"),
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

/// Mount, remount or bind as `opts` say; `daemon` detaches a new mount's process.
fn mount_or_change(
    image: &Path,
    devices: &[PathBuf],
    mountpoint: &Path,
    lists: &[String],
    base: MountOptions,
    daemon: bool,
) -> Result<()> {
    let opts = options(base, lists)?;
    if opts.remount {
        return remount(mountpoint, lists);
    }
    if let Some(o) = opts.fuse_shown.first() {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            format!("mount option {o:?}"),
            "the FUSE driver's own, meaningful only in a remount",
        ));
    }
    if let Some(s) = served(image) {
        return bind_second(&s, image, mountpoint, &opts);
    }
    if daemon {
        return daemonize(|ready| mount(image, devices, mountpoint, opts, ready));
    }
    mount(image, devices, mountpoint, opts, || {})
}

/// Open, mount and serve; `ready` runs once the kernel has the mount.
fn mount(
    image: &Path,
    devices: &[PathBuf],
    mountpoint: &Path,
    opts: MountOptions,
    ready: impl FnOnce(),
) -> Result<()> {
    check_mountpoint(mountpoint)?;
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
            None if msg.is_empty() => Err(Error::io(
                "mount",
                std::io::Error::other("the mount process exited before the mount was ready"),
            )),
            None => Err(Error::io(
                "mount",
                std::io::Error::other(msg.trim_start_matches("error: ").to_string()),
            )),
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
    // As a program using libfuse mounts when run by itself: nodev,nosuid unless asked.
    mount_or_change(
        &a.image,
        &a.devices,
        &a.mountpoint,
        &a.options,
        MountOptions::default(),
        a.daemon,
    )
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
    let shown = mnt.display().to_string();
    let m = mount_entry(&mnt)?;
    if m.fstype != kernel_mount::FSTYPE {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            shown,
            format!("not a ubtrfs mount (its type is {})", m.fstype),
        ));
    }
    let mut pids: Vec<u32> = device_lock::lock_holders(&m.source)
        .unwrap_or_default()
        .iter()
        .filter_map(|h| h.pid)
        .filter(|&p| device_lock::is_fuse_daemon(p))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    // Taken before the unmount: a pid reused after the daemon's exit is not waited for.
    let waits: Vec<(u32, Option<OwnedFd>)> = pids.iter().map(|&p| (p, pidfd(p))).collect();
    unmount(&mnt, flags)?;
    // A lazy unmount leaves the mount alive while it is in use; another mount point of
    // the mount (a second mount, bound to the first) keeps the daemon serving.
    if flags & libc::MNT_DETACH != 0 || !kernel_mount::mount_points(m.dev).is_empty() {
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
            return Err(Error::io(
                format!("unmount {}", mnt.display()),
                std::io::Error::other(why),
            ));
        }
        return Ok(());
    }
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(mnt.as_os_str().as_bytes()).map_err(|_| {
        Error::posix(PosixKind::Invalid, format!("{}: a NUL in the path", mnt.display()))
    })?;
    // SAFETY: umount2 reads a NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), flags) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EBUSY) {
            return Err(Error::posix_detail(
                PosixKind::Busy,
                mnt.display().to_string(),
                "in use (an open file or a process inside it)",
            ));
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
            eprintln!(
                "waiting for the ubtrfs process {pid} to write its last commit to {} and exit",
                image.display()
            );
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
            Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(&link)
                .map_err(|e| Error::io(format!("replace {}", link.display()), e))?,
            Ok(_) => {
                return Err(Error::io(
                    format!("install {}", link.display()),
                    std::io::Error::from(std::io::ErrorKind::AlreadyExists),
                ))
            }
            Err(_) => {}
        }
        std::os::unix::fs::symlink(&exe, &link)
            .map_err(|e| Error::io(format!("link {} to {}", link.display(), exe.display()), e))?;
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
                Some("-N") => {
                    return Err(Error::posix_detail(
                        PosixKind::NotSupported,
                        UMOUNT_HELPER_NAME,
                        "-N: another mount namespace",
                    ))
                }
                Some(s) if s.starts_with('-') && s.len() > 1 => {
                    for c in s[1..].chars() {
                        match c {
                            'l' => flags |= libc::MNT_DETACH,
                            'f' => flags |= libc::MNT_FORCE,
                            'n' | 'r' | 'v' => {}
                            _ => {
                                return Err(Error::posix_detail(
                                    PosixKind::Invalid,
                                    UMOUNT_HELPER_NAME,
                                    format!("unknown option -{c}"),
                                ))
                            }
                        }
                    }
                }
                _ => pos.push(PathBuf::from(a)),
            }
        }
        let [mountpoint] = <[PathBuf; 1]>::try_from(pos).map_err(|_| {
            Error::posix_detail(
                PosixKind::Invalid,
                UMOUNT_HELPER_NAME,
                "usage: umount.fuse.ubtrfs MOUNTPOINT [-flnrv]",
            )
        })?;
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
                Some("-o") => {
                    lists.push(it.next().and_then(|v| v.into_string().ok()).ok_or_else(|| {
                        Error::posix(ubtrfs_core::PosixKind::Invalid, "-o needs options")
                    })?)
                }
                Some(s) if s.starts_with("-o") => lists.push(s[2..].to_string()),
                Some("-f") => foreground = true,
                Some("-n" | "-s" | "-v") => {}
                _ => pos.push(PathBuf::from(a)),
            }
        }
        let [image, mountpoint] = <[PathBuf; 2]>::try_from(pos).map_err(|_| {
            Error::posix_detail(
                ubtrfs_core::PosixKind::Invalid,
                HELPER_NAME,
                "usage: mount.fuse.ubtrfs IMAGE MOUNTPOINT [-o OPTIONS]",
            )
        })?;
        // As mount.fuse3: dev and suid unless the options say nodev or nosuid.
        mount_or_change(&image, &[], &mountpoint, &lists, MountOptions::for_helper(), !foreground)
    })();
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{HELPER_NAME}: error: {e}");
            ExitCode::FAILURE
        }
    }
}
