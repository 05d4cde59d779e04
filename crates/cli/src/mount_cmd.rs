//! `ubtrfs mount`, the `mount.fuse.ubtrfs` helper that mount(8) runs for
//! `mount -t fuse.ubtrfs` and fstab lines, and `ubtrfs install-helper`, which puts the
//! helper where mount(8) looks for it.
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
use ubtrfs_core::error::{Error, Result};
use ubtrfs_fuse::MountOptions;

/// The helper's name: mount(8) runs `/sbin/mount.fuse.ubtrfs` for `-t fuse.ubtrfs`.
pub const HELPER_NAME: &str = "mount.fuse.ubtrfs";

#[derive(clap::Args)]
pub struct MountArgs {
    /// Mount options, comma-separated (repeatable): ro, rw, compress=ALG[:LEVEL],
    /// compress-force=ALG[:LEVEL], commit=SECONDS, subvol=PATH, subvolid=N,
    /// allow_other, default_permissions, uid=N, gid=N, noatime, relatime,
    /// strictatime, nodiratime, cache_mib=N, threads=N, dev, suid, noexec, degraded,
    /// device=PATH.
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

/// `ubtrfs install-helper`: a `mount.fuse.ubtrfs` link to this executable in `dir`.
///
/// # Errors
/// `Io` when the link cannot be made.
pub fn install_helper(a: &InstallHelperArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("find this executable", e))?;
    let link = a.dir.join(HELPER_NAME);
    match std::fs::symlink_metadata(&link) {
        Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(&link).map_err(|e| Error::io(format!("replace {}", link.display()), e))?,
        Ok(_) => return Err(Error::io(format!("install {}", link.display()), std::io::Error::from(std::io::ErrorKind::AlreadyExists))),
        Err(_) => {}
    }
    std::os::unix::fs::symlink(&exe, &link).map_err(|e| Error::io(format!("link {} to {}", link.display(), exe.display()), e))?;
    println!("{} -> {}", link.display(), exe.display());
    Ok(())
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
