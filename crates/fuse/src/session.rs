//! A mount's life: open the engine, find the directory to mount, mount it, serve
//! requests on several threads, commit every `commit=` seconds, and on unmount
//! (`fusermount3 -u`, `umount`, SIGINT, SIGTERM or SIGHUP) commit and let the image go.
//!
//! Order at the end: the session loop stops (the kernel unmounted, or a signal made us
//! unmount), `UbtrfsFs::destroy` closes the handles left and makes the last commit
//! (`last_commit`), the commit thread is stopped, and the engine is dropped, which
//! releases the image lock. An error in that last commit makes `mount` fail, so the
//! command exits non-zero and says what was lost.
//!
//! The kernel's unmount of a FUSE mount returns before that commit (nothing in the
//! kernel waits for a `fuse` daemon), so the end is made visible to others: the
//! process is marked as unmounting (a new open of the image waits for it, see
//! `device_lock`), its image files are held against new opens until it exits (a
//! `mount -o loop` waits in the kernel), and the commit is not written at all if the
//! kernel has mounted the image meanwhile. `ubtrfs umount` waits for the process.

use crate::fs::UbtrfsFs;
use crate::kernel_mount;
use crate::options::MountOptions;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use ubtrfs_core::{
    device_lock,
    mountinfo::{self, DevNum},
    Engine, Error, FsRead, InodeId, OpenOptions, PosixKind, Result,
};

/// The first inode of every subvolume tree: its top directory.
const SUBVOL_TOP: u64 = 256;
const FS_TREE: u64 = 5;

/// Open the filesystem on `devices` as `opts` ask.
///
/// `ro` opens the devices read-only and writes nothing at all, not even at open: a log
/// tree is replayed in memory (unless `rescue=nologreplay`), where a kernel mount would
/// write its replay; orphans are not cleaned. A writable mount replays a log tree and
/// commits before anything else, as the kernel's mount does.
///
/// # Errors
/// As `Engine::open` or `Engine::open_read_only`.
pub fn open_engine(devices: &[PathBuf], opts: &MountOptions) -> Result<Arc<Engine>> {
    let mut all: Vec<PathBuf> = devices.to_vec();
    all.extend(opts.devices.iter().map(PathBuf::from));
    let o = OpenOptions {
        devices: all,
        cache_bytes: opts.cache_mib << 20,
        writable: !opts.read_only,
        sources: Default::default(),
        degraded: opts.degraded,
        no_log_replay: opts.nologreplay,
    };
    if opts.read_only {
        let engine = Engine::open_read_only(&o)?;
        engine.set_page_cache_limits(opts.page_cache_mib << 20, opts.dirty_mib << 20);
        return Ok(Arc::new(engine));
    }
    let engine = Engine::open(&o)?;
    engine.set_page_cache_limits(opts.page_cache_mib << 20, opts.dirty_mib << 20);
    if let Some(p) = opts.compress {
        engine.set_compress(p)?;
    }
    Ok(Arc::new(engine))
}

/// The directory the mount shows: `subvol=` (a path from the top level) or
/// `subvolid=`, else the default subvolume, as the kernel chooses.
///
/// # Errors
/// `Posix(NotFound)` for a missing subvolume; `Posix(Invalid)` for a path that is not a
/// subvolume, or a `subvol=` and `subvolid=` that disagree.
pub fn find_top(engine: &Engine, opts: &MountOptions) -> Result<InodeId> {
    let by_path = match &opts.subvol {
        None => None,
        Some(p) => Some(engine.read(|l| {
            let mut at = InodeId { root: FS_TREE, ino: SUBVOL_TOP };
            for c in p.split('/').filter(|c| !c.is_empty() && *c != ".") {
                let e = l
                    .lookup(at, c.as_bytes())?
                    .ok_or_else(|| Error::posix(PosixKind::NotFound, format!("subvol={p}")))?;
                at = e.target;
            }
            if at.ino != SUBVOL_TOP {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    format!("subvol={p}"),
                    "not a subvolume",
                ));
            }
            Ok(at)
        })?),
    };
    let by_id = match opts.subvolid {
        None => None,
        Some(id) => {
            let id = if id == 0 { FS_TREE } else { id };
            engine.read(|l| l.fs_root(id)).map_err(|e| e.at(format!("subvolid={id}")))?;
            Some(InodeId { root: id, ino: SUBVOL_TOP })
        }
    };
    match (by_path, by_id) {
        (Some(a), Some(b)) if a != b => Err(Error::posix_detail(
            PosixKind::Invalid,
            "subvol= and subvolid=",
            format!("they name different subvolumes ({} and {})", a.root, b.root),
        )),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => engine.read(|l| Ok(l.root_dir())),
    }
}

/// The session's settings (the mount itself is `kernel_mount`'s).
fn fuse_config(opts: &MountOptions) -> fuser::Config {
    let mut c = fuser::Config::default();
    if opts.allow_other {
        c.acl = fuser::SessionACL::All;
    }
    c.n_threads = Some(opts.threads);
    c.clone_fd = true;
    c.io_uring_queue_depth = Some(opts.io_uring_depth);
    c
}

/// The unmount's last commit, from `UbtrfsFs::destroy` in the main thread once the
/// session has ended: mark the process as unmounting, hold each image file against new
/// opens, and commit, unless the kernel now has an image mounted (a `mount -o loop`
/// that ran before the hold): then nothing is written, the engine aborts and the mount
/// fails saying so, which keeps the kernel's writes and loses ours since the last
/// commit, never both sides' at once.
pub(crate) fn last_commit(engine: &Engine, read_only: bool) {
    device_lock::mark_unmounting();
    if read_only {
        return;
    }
    // The commit checks once more just before its superblocks.
    engine.info().set_last_commit();
    for d in engine.info().devices.by_id.values() {
        let claim = d.dev.claim_for_last_commit();
        if let Some(why) = claim.not_held {
            crate::log::log(&format!(
                "{}: a new open does not wait for the last commit ({why})",
                d.dev.name()
            ));
        }
        if let Some(u) = claim.kernel.first() {
            let why = format!("{u}; the changes since the last commit are not written, so as not to overwrite the kernel's");
            crate::log::log_error(&format!("unmount: {why}"));
            let _ = engine.abort("unmount", &Error::posix(PosixKind::Busy, why));
            return;
        }
    }
    if let Err(e) = engine.sync() {
        crate::log::log(&format!("sync at unmount: {e}"));
    }
}

/// The device number of the FUSE mount at `mountpoint` (absolute), from mountinfo.
pub(crate) fn mount_dev(mountpoint: &Path) -> Option<DevNum> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo::parse_mountinfo(&text)
        .into_iter()
        .rev()
        .find(|m| m.mount_point == mountpoint && m.fstype.starts_with("fuse"))
        .map(|m| m.dev)
}

/// Watch the mount table until the mount `dev` leaves it (an unmount), then mark the
/// process as unmounting and hold its image files against new opens at once: the
/// kernel's unmount returns before our session loop sees its end, and a `mount -o
/// loop` or `ubtrfs mount` started right after it must already find them held.
/// /proc/self/mountinfo polls readable (POLLPRI) at each change of the mount table, so
/// this wakes for mounts, remounts and unmounts only, never per request. Returns when
/// `stop` closes. After a lazy unmount (`umount -l`) the session may serve open files
/// for a while longer: the image stays held meanwhile, and others' opens of it wait
/// (at most the kernel's lease-break-time, 45 s by default). The mount leaves the
/// table when its last mount point goes (bind mounts share its `dev`).
///
/// A remount read-only (the superblock's `ro`) is followed here: changes are refused
/// from then on (`MountOptions::is_read_only`; the VFS already refuses writes, this
/// covers the ioctls, atime updates, the cleaner and the periodic commits), and what
/// was written before is committed, as the kernel's `btrfs_remount_ro` commits
/// (`mount.fuse.ubtrfs` also asks for that commit before the remount returns).
fn watch_unmount(
    engine: &Engine,
    opts: &MountOptions,
    dev: DevNum,
    stop: &std::os::unix::net::UnixStream,
) {
    use std::os::fd::AsRawFd;
    let read_only = opts.read_only;
    let Ok(table) = std::fs::File::open("/proc/self/mountinfo") else { return };
    let devices = || engine.info().devices.by_id.values();
    loop {
        // Hold first and look after: the caller of the unmount runs on meanwhile, and an
        // open it makes before the hold would beat our last commit. While the mount is
        // still there the hold goes again at once (a mount table event is rare).
        if !read_only {
            for d in devices() {
                // `last_commit` claims again and reports what this found.
                let _ = d.dev.claim_for_last_commit();
            }
        }
        let now = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let ours = mountinfo::parse_mountinfo(&now).into_iter().find(|m| m.dev == dev);
        if !now.is_empty() && ours.is_none() {
            device_lock::mark_unmounting();
            return;
        }
        if !read_only {
            for d in devices() {
                d.dev.release_claim();
            }
            if let Some(m) = ours {
                remounted(engine, opts, m.super_read_only());
            }
        }
        let mut fds = [
            libc::pollfd { fd: table.as_raw_fd(), events: libc::POLLPRI, revents: 0 },
            libc::pollfd { fd: stop.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        // SAFETY: two pollfds for descriptors held open above.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
    }
}

/// The superblock is `ro` (or not) now: on the switch to read-only, refuse changes
/// first, then commit what came before.
fn remounted(engine: &Engine, opts: &MountOptions, ro: bool) {
    let was = opts.state.set_remounted_ro(ro);
    if ro && !was {
        if let Err(e) = engine.sync() {
            crate::log::log(&format!("commit at the remount read-only: {e}"));
        }
    }
}

/// Block the signals that end a mount in this thread and the threads it starts; a
/// thread of their own waits for them (`sigwait`).
fn block_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; the calls only fill and install it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Mount `engine`'s directory `top` on `mountpoint` and serve it until unmounted.
/// `ready` runs once the kernel has the mount (a daemon tells its parent then).
///
/// # Errors
/// `Io` when the mount fails or the session ends with an error; the last commit's
/// error.
pub fn serve(
    engine: Arc<Engine>,
    top: InodeId,
    source: &Path,
    mountpoint: &Path,
    opts: MountOptions,
    ready: impl FnOnce(),
) -> Result<()> {
    let sigs = block_signals();
    // The mount's source is the image's absolute path: `ubtrfs umount` finds the
    // daemon through the image's lock holder.
    let source = std::fs::canonicalize(source).unwrap_or_else(|_| source.to_path_buf());
    let config = fuse_config(&opts);
    let commit_every = Duration::from_secs(opts.commit_secs);
    let state = opts.state.clone();
    let read_only = opts.read_only;
    let watch_opts = opts.clone();
    let notifier = Arc::new(std::sync::OnceLock::new());
    // Wakes the cleaner (below) when a subvolume is deleted through the mount.
    let (clean_tx, clean_rx) = mpsc::channel::<()>();
    // Absolute before the mount: afterwards a look at it would be a request to ourselves.
    let mount_abs = std::fs::canonicalize(mountpoint).unwrap_or_else(|_| mountpoint.to_path_buf());
    let (fd, mounter) = kernel_mount::mount(&source, &mount_abs, &opts)?;
    let fs =
        UbtrfsFs::new(engine.clone(), top, opts, mountpoint, notifier.clone(), clean_tx.clone());
    let dev = mount_dev(&mount_abs);
    let session = fuser::Session::from_fd(fs, fd, config.acl, config);
    let session = match session {
        Ok(s) => s,
        Err(e) => {
            let _ = kernel_mount::unmount(&mount_abs, mounter);
            return Err(Error::io(format!("mount {}", mountpoint.display()), e));
        }
    };
    let _ = notifier.set(session.notifier());

    // The unmount watcher (none when the mount is not visible in our mount table).
    let (stop_watching, watch_stop) = std::os::unix::net::UnixStream::pair()
        .map_err(|e| Error::io("make the unmount watcher's socket", e))?;
    let watcher = match dev {
        Some(dev) => {
            state.set_dev(dev);
            let engine = engine.clone();
            Some(
                std::thread::Builder::new()
                    .name("ubtrfs-watch".into())
                    .spawn(move || watch_unmount(&engine, &watch_opts, dev, &watch_stop))
                    .map_err(|e| Error::io("start the unmount watcher", e))?,
            )
        }
        None => None,
    };
    ready();

    // Periodic commits (none on a read-only mount, or while remounted read-only).
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let committer = {
        let engine = engine.clone();
        let state = state.clone();
        std::thread::Builder::new()
            .name("ubtrfs-commit".into())
            .spawn(move || loop {
                match stop_rx.recv_timeout(commit_every) {
                    Err(mpsc::RecvTimeoutError::Timeout) if read_only || state.remounted_ro() => {}
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        // Dirty pages first: a commit writes only what the trees hold.
                        if let Err(e) = engine.sync() {
                            crate::log::log(&format!("periodic commit: {e}"));
                        }
                    }
                    _ => return,
                }
            })
            .map_err(|e| Error::io("start the commit thread", e))?
    };

    // The cleaner (none on a read-only mount; idle while remounted read-only, as the
    // kernel's cleaner sleeps on a read-only superblock): drops the trees of deleted
    // subvolumes, those pending at mount (ours or the kernel's, half dropped or not)
    // and those deleted since, a few steps between commits, as the kernel's cleaner
    // thread does. It wakes at each commit interval, and at once after a deletion.
    let stop_cleaning = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cleaner = if read_only {
        None
    } else {
        let engine = engine.clone();
        let stop = stop_cleaning.clone();
        let state = state.clone();
        Some(
            std::thread::Builder::new()
                .name("ubtrfs-cleaner".into())
                .spawn(move || loop {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    let keep_going = &mut |_: u64, _: &ubtrfs_core::DropStats| {
                        !stop.load(std::sync::atomic::Ordering::Relaxed) && !state.remounted_ro()
                    };
                    if !state.remounted_ro() {
                        if let Err(e) = engine.clean_dead_roots(keep_going) {
                            crate::log::log(&format!("cleaner: {e}"));
                        }
                    }
                    if let Err(mpsc::RecvTimeoutError::Disconnected) =
                        clean_rx.recv_timeout(commit_every)
                    {
                        return;
                    }
                })
                .map_err(|e| Error::io("start the cleaner thread", e))?,
        )
    };

    // Signals unmount every mount point of the mount (bind mounts too); the session
    // loop then ends as for any unmount.
    let mp = mount_abs.clone();
    std::thread::Builder::new()
        .name("ubtrfs-signals".into())
        .spawn(move || {
            let mut sig = 0;
            // SAFETY: `sigs` is the initialised set blocked above.
            unsafe { libc::sigwait(&sigs, &mut sig) };
            crate::log::log(&format!("signal {sig}: unmounting {}", mp.display()));
            let mut points = dev.map(kernel_mount::mount_points).unwrap_or_default();
            if points.is_empty() {
                points.push(mp);
            }
            for p in points.iter().rev() {
                if let Err(e) = kernel_mount::unmount(p, mounter) {
                    crate::log::log(&e.to_string());
                }
            }
        })
        .map_err(|e| Error::io("start the signal thread", e))?;

    let served = session.run();
    drop(stop_watching);
    if let Some(w) = watcher {
        let _ = w.join();
    }
    let _ = stop_tx.send(());
    let _ = committer.join();
    stop_cleaning.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = clean_tx.send(());
    if let Some(c) = cleaner {
        let _ = c.join();
        // What the cleaner did since the unmount's commit (it stops between steps).
        if engine.info().aborted().is_none() {
            if let Err(e) = engine.commit() {
                crate::log::log(&format!("commit after the cleaner: {e}"));
            }
        }
    }
    served.map_err(|e| Error::io(format!("serve {}", mountpoint.display()), e))?;
    // destroy() committed; a failure there left the engine aborted, and this says so.
    if let Some(why) = engine.info().aborted() {
        return Err(Error::posix_detail(
            PosixKind::ReadOnly,
            "the filesystem",
            format!("aborted: {why}; changes since the last commit are lost"),
        ));
    }
    let (errs, more) = engine.take_close_errors();
    for e in errs {
        crate::log::log(&format!("close: {e}"));
    }
    if more > 0 {
        crate::log::log(&format!("{more} more close errors"));
    }
    Ok(())
}
