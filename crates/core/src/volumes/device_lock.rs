//! Who else is using a device, settled when `FileDevice` opens it: the lock every
//! ubtrfs open takes, and the kernel's own claims (mounts, exclusive opens).
//!
//! - A writer takes `flock(LOCK_EX|LOCK_NB)` on each device, and opens block devices
//!   with O_EXCL, so the kernel refuses while it has the device mounted or another
//!   program holds it exclusively. It then refuses image files a loop device the kernel
//!   mounted reads from (`mountinfo`). Any conflict fails the open with
//!   `PosixKind::Busy` before a byte is written; nothing offers to force it.
//! - A reader takes `flock(LOCK_SH|LOCK_NB)`, so a writer cannot start under a long
//!   `extract`: it is refused as "in use by another ubtrfs process".
//! - A loop device and its backing file are one image under two names: opening the
//!   loop device also locks the backing file, so `put /dev/loop0` and `put IMG` exclude
//!   each other too.
//! - The locks live as long as the open file description (the `File` in `FileDevice`),
//!   so they are the ones a long-lived FUSE mount holds. flock rather than fcntl locks:
//!   fcntl locks belong to the process and silently vanish when any descriptor of the
//!   file is closed. flock locks of two opens conflict even inside one process, so code
//!   (and tests) must close a reader before opening a writer on the same image. A child
//!   that another thread forks shares every descriptor until its exec, so a lock just
//!   let go may linger for milliseconds under our own pid; writers wait briefly for
//!   that case only.
//! - The one wait: a holder that is a ubtrfs mount in its unmount (it names its main
//!   thread `UNMOUNTING_COMM` from the moment its mount leaves the mount table until
//!   it exits) is committing its last changes and letting go. `umount; ubtrfs mount` is
//!   what scripts do, so an open waits for it (at most `UNMOUNT_PATIENCE`, saying so
//!   on stderr) instead of failing, at its lock or, for a block device, at its O_EXCL
//!   open, which meets the mount first. A FUSE daemon that holds the lock but is not yet
//!   marked may be between the kernel's unmount and its own notice of it: a writer
//!   looks again for `UNMOUNT_NOTICE` before it is refused.
//! - From that moment a mount also holds its image file against new opens until it
//!   has committed and closed it (`hold_opens`, a write lease): `mount -o loop IMG` right
//!   after an unmount then waits in the kernel for our last commit instead of mounting
//!   the state before it (the kernel ignores flock). Just before that commit it looks
//!   for a kernel mount of the file once more (`kernel_use_of_file`) and writes nothing
//!   if there is one.
//!
//! Why readers do not wait for a writer: the writer may be a FUSE mount holding its
//! lock for days, and a reader that waited would hang `ubtrfs ls` without a word. A
//! reader therefore goes on without the lock and is told, in a warning, that it shows
//! the last committed state, which may change while it is read; the same treatment as
//! reading an image the kernel has mounted. Writers do not wait either, but for a mount
//! in its unmount (above): a second writer is told who holds the image (the pid, from
//! /proc/locks) and can retry.
//!
//! Neighbours: `device` (the open path), `mountinfo` (the kernel's view).

use crate::error::{Error, PosixKind, Result};
use crate::volumes::mountinfo::{self, BlockDev, DevNum, KernelUse};
use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// How long a writer waits for a lock held under its own pid (see `lock`).
const OWN_LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(500);
/// How long an open waits for a ubtrfs mount that is unmounting: its last commit
/// writes what the mount held dirty (up to the dirty limit, 128 MiB by default) and
/// syncs, seconds on a slow disk; past this the open is refused as for any holder.
pub const UNMOUNT_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a writer looks again at a FUSE daemon holding the lock before refusing:
/// the kernel's unmount may return before the daemon has seen the mount table change,
/// and the daemon marks itself only then.
const UNMOUNT_NOTICE: std::time::Duration = std::time::Duration::from_secs(1);
/// The name (`/proc/PID/comm`) a ubtrfs mount gives its main thread from the end of its
/// session to its exit: the final commit, and the release of the image.
pub const UNMOUNTING_COMM: &str = "ubtrfs-unmount";

/// One flock lock listed in /proc/locks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlockHolder {
    /// None when the holder is outside our pid namespace (listed as 0 or -1).
    pub pid: Option<u32>,
    /// LOCK_EX (a writer) rather than LOCK_SH.
    pub exclusive: bool,
}

/// The granted FLOCK locks on inode `ino` of the filesystem `dev`, from /proc/locks
/// text (`ID: FLOCK ADVISORY WRITE PID MAJ:MIN:INO START END`, major and minor in hex);
/// waiters (`ID: -> FLOCK ...`) and lines that do not parse are skipped.
pub fn parse_proc_locks(text: &str, dev: DevNum, ino: u64) -> Vec<FlockHolder> {
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [_, class, _, mode, pid, id, ..] = f.as_slice() else { continue };
        if *class != "FLOCK" {
            continue;
        }
        let mut parts = id.split(':');
        let (Some(maj), Some(min), Some(i), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (Ok(maj), Ok(min), Ok(i)) =
            (u32::from_str_radix(maj, 16), u32::from_str_radix(min, 16), i.parse::<u64>())
        else {
            continue;
        };
        if (maj, min) != dev || i != ino {
            continue;
        }
        let exclusive = match *mode {
            "WRITE" => true,
            "READ" => false,
            _ => continue,
        };
        let Ok(pid) = pid.parse::<i64>() else { continue };
        out.push(FlockHolder { pid: u32::try_from(pid).ok().filter(|&p| p > 0), exclusive });
    }
    out
}

fn flock_holders(md: &std::fs::Metadata) -> Vec<FlockHolder> {
    let text = mountinfo::read_small(Path::new("/proc/locks")).unwrap_or_default();
    parse_proc_locks(&text, mountinfo::dev_num(md.dev()), md.ino())
}

/// The flock locks held on `path` (a ubtrfs image or device), from /proc/locks.
///
/// # Errors
/// `Io` when `path` cannot be looked up.
pub fn lock_holders(path: &Path) -> Result<Vec<FlockHolder>> {
    let md = std::fs::metadata(path)
        .map_err(|e| Error::io(format!("cannot look up {}", path.display()), e))?;
    Ok(flock_holders(&md))
}

/// Mark this process as a ubtrfs mount in its unmount (`UNMOUNTING_COMM`), from any of
/// its threads: /proc/self/comm is the main thread's name, which /proc/PID/comm shows.
pub fn mark_unmounting() {
    // Only a name for others to see: nothing depends on the write succeeding here.
    let _ = std::fs::write("/proc/self/comm", UNMOUNTING_COMM);
}

/// Whether process `pid` is a ubtrfs mount in its unmount (`mark_unmounting`).
pub fn is_unmounting(pid: u32) -> bool {
    mountinfo::read_small(Path::new(&format!("/proc/{pid}/comm")))
        .is_some_and(|c| c.trim_end() == UNMOUNTING_COMM)
}

/// Whether process `pid` has /dev/fuse open: a FUSE daemon. False when its descriptors
/// cannot be listed (another user's process, without privilege).
pub fn is_fuse_daemon(pid: u32) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    // A daemon has a few dozen descriptors; the bound keeps a huge table from stalling us.
    fds.flatten()
        .take(4096)
        .any(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == Path::new("/dev/fuse")))
}

/// Another user of a device, found when it was opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InUse {
    /// The device as given to open.
    pub device: String,
    pub by: User,
    /// The other name the conflict was found under (a loop device, a backing file).
    pub through: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum User {
    /// Other ubtrfs processes hold the lock (pids when known). `writing`: the holder
    /// has it exclusively, which is what a reader meets; a writer may meet readers.
    Ubtrfs {
        pids: Vec<u32>,
        writing: bool,
    },
    Kernel(KernelUse),
}

impl fmt::Display for InUse {
    /// The subject of every message: "IMAGE is mounted by the kernel at /mnt (through /dev/loop3)".
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dev = &self.device;
        let through = self.through.as_ref().map(|t| format!(" (through {t})")).unwrap_or_default();
        match &self.by {
            User::Ubtrfs { pids, writing } => {
                let verb = if *writing { "is being changed by" } else { "is in use by" };
                let pids = match pids.as_slice() {
                    [] => String::new(),
                    [p] => format!(" (pid {p})"),
                    ps => format!(
                        " (pids {})",
                        ps.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
                    ),
                };
                write!(f, "{dev} {verb} another ubtrfs process{pids}{through}")
            }
            User::Kernel(KernelUse::Mounted { mount_point: Some(mp) }) => write!(
                f,
                "{dev} is mounted by the kernel at {}{through}",
                crate::quote::name(mp.as_os_str().as_bytes())
            ),
            User::Kernel(KernelUse::Mounted { mount_point: None }) => write!(
                f,
                "{dev} is mounted by the kernel{through}, at a mount point not visible here"
            ),
            User::Kernel(KernelUse::HeldExclusively) => {
                write!(f, "{dev} is held exclusively by another program{through}")
            }
        }
    }
}

impl InUse {
    /// The error a writer gets.
    pub fn refusal(&self) -> Error {
        match &self.by {
            User::Kernel(KernelUse::Mounted { .. }) => {
                Error::posix_detail(PosixKind::Busy, self.to_string(), "unmount it first")
            }
            _ => Error::posix(PosixKind::Busy, self.to_string()),
        }
    }
    /// The warning a reader gets.
    pub fn reader_warning(&self) -> String {
        match &self.by {
            User::Ubtrfs { .. } => format!("{self}; showing its last committed state, which may change while it is read"),
            User::Kernel(KernelUse::Mounted { .. }) => format!("{self}; showing its last committed state, which may be inconsistent while it is mounted"),
            User::Kernel(KernelUse::HeldExclusively) => format!("{self}; what is read may be inconsistent"),
        }
    }
}

/// An opened device and what its open found.
pub(crate) struct Claimed {
    pub file: File,
    /// Other files held only for their locks (a loop device's backing file).
    pub lock_files: Vec<File>,
    /// Other users a reader goes on despite (a writer is refused instead).
    pub in_use: Vec<InUse>,
    /// Warnings for the user (a lock the host filesystem does not support).
    pub warnings: Vec<String>,
}

/// Open `path` for reading or writing and settle who else uses it (module docs).
///
/// # Errors
/// `Io` when it cannot be opened; `Posix(Busy)` for a writer when another ubtrfs
/// process, the kernel or another program holds the device.
pub(crate) fn open(path: &Path, writable: bool) -> Result<Claimed> {
    let name = path.display().to_string();
    let md = std::fs::metadata(path).map_err(|e| Error::io(format!("cannot open {name}"), e))?;
    let block = md.file_type().is_block_device();
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true).write(writable);
    if writable && block {
        opts.custom_flags(libc::O_EXCL);
    }
    // A block device's O_EXCL open meets an unmounting mount before its lock does.
    let start = std::time::Instant::now();
    let mut told = None;
    let mut retried_gone = false;
    let file = loop {
        match opts.open(path) {
            Ok(f) => break f,
            Err(e) if writable && block && e.raw_os_error() == Some(libc::EBUSY) => {
                let u = exclusive_holder(&name, &md);
                let pids = match &u.by {
                    User::Ubtrfs { pids, .. } => pids.clone(),
                    User::Kernel(_) => Vec::new(),
                };
                // No holder listed: a ubtrfs process may have let go of its lock just
                // before its O_EXCL descriptor; look once more.
                let gone = pids.is_empty() && !std::mem::replace(&mut retried_gone, true);
                if gone || wait_for(&pids, &name, true, start, &mut told) {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    continue;
                }
                return Err(u.refusal());
            }
            Err(e) => return Err(Error::io(format!("cannot open {name}"), e)),
        }
    };
    let fmd = file.metadata().map_err(|e| Error::io(format!("cannot open {name}"), e))?;
    if fmd.file_type().is_block_device() != block {
        // Renamed over between stat and open: the O_EXCL choice was for another file.
        return Err(Error::io(
            format!("cannot open {name}"),
            std::io::Error::other("it was replaced while being opened"),
        ));
    }
    let mut c = Claimed { file, lock_files: Vec::new(), in_use: Vec::new(), warnings: Vec::new() };
    lock(&mut c, &name, None, None, &fmd, writable)?;
    if block {
        let bd = BlockDev::from_rdev(fmd.rdev());
        if let Some(backing) = mountinfo::loop_backing_file(&bd) {
            if let Ok(f) = File::open(&backing) {
                let bmd = f
                    .metadata()
                    .map_err(|e| Error::io(format!("cannot open {}", backing.display()), e))?;
                lock(&mut c, &name, Some(&f), Some(backing.display().to_string()), &bmd, writable)?;
                c.lock_files.push(f);
            }
        }
        // A writer's O_EXCL open succeeded, so nothing has it mounted.
        if !writable {
            if let Some(how) = mountinfo::mounted(&bd) {
                c.in_use.push(InUse { device: name.clone(), by: User::Kernel(how), through: None });
            }
        }
    } else {
        // Probing with O_EXCL briefly claims the loop device, so only writers, which
        // need the answer, do it.
        for u in kernel_use_of_file(&name, &fmd, writable) {
            if writable {
                return Err(u.refusal());
            }
            c.in_use.push(u);
        }
    }
    Ok(c)
}

/// How the kernel uses the image file `name` (metadata `md`) now: loop devices reading
/// it that are mounted, or (with `probe`) held exclusively by someone.
pub(crate) fn kernel_use_of_file(name: &str, md: &std::fs::Metadata, probe: bool) -> Vec<InUse> {
    let mut out = Vec::new();
    for lp in mountinfo::loops_backed_by(md.dev(), md.ino()) {
        let how = match mountinfo::mounted(&lp) {
            Some(how) => how,
            None if probe && mountinfo::held_exclusively(&lp) == Some(true) => {
                KernelUse::HeldExclusively
            }
            None => continue,
        };
        out.push(InUse {
            device: name.to_string(),
            by: User::Kernel(how),
            through: Some(lp.dev_path()),
        });
    }
    out
}

/// Make every later open(2) of the regular file behind `file` wait until `file` is
/// closed: a write lease (F_SETLEASE F_WRLCK), which the kernel breaks for any open by
/// anyone, making the opener wait for the holder to give it up (at most the kernel's
/// lease-break-time, 45 s by default). The loop driver takes its backing file from
/// an open(2) (losetup's, mount's), so `mount -o loop IMG` waits too.
///
/// The kernel asks for the lease back with SIGIO, whose default action ends the process:
/// SIGIO is ignored from here on (nothing else in ubtrfs uses it), and the lease goes
/// only when `file` is closed, once the holder's last write is done.
///
/// # Errors
/// Why the lease was not granted: `file` is not the only open of the file (a reader,
/// a loop device, a second descriptor of ours), a host filesystem without leases, or
/// an owner who is not us (without CAP_LEASE).
pub(crate) fn hold_opens(file: &File) -> std::result::Result<(), std::io::Error> {
    // SAFETY: sigaction with a zeroed struct and SIG_IGN installs no handler code; the
    // fcntl acts on a descriptor `file` keeps open.
    unsafe {
        let mut ign: libc::sigaction = std::mem::zeroed();
        ign.sa_sigaction = libc::SIG_IGN;
        libc::sigaction(libc::SIGIO, &ign, std::ptr::null_mut());
        if libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_WRLCK) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Give up the lease `hold_opens` took on `file`: waiting opens go on.
pub(crate) fn release_opens(file: &File) {
    // SAFETY: fcntl on a descriptor `file` keeps open; F_UNLCK only drops our lease.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETLEASE, libc::F_UNLCK) };
}

/// Take the flock lock on `other` (or the main file), whose metadata is `md`; `through`
/// names `other` in messages.
fn lock(
    c: &mut Claimed,
    name: &str,
    other: Option<&File>,
    through: Option<String>,
    md: &std::fs::Metadata,
    writable: bool,
) -> Result<()> {
    let fd = other.unwrap_or(&c.file).as_raw_fd();
    let op = if writable { libc::LOCK_EX } else { libc::LOCK_SH } | libc::LOCK_NB;
    let me = std::process::id();
    let start = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(1);
    let mut retried_gone = false;
    let mut told = None;
    let holders = loop {
        // SAFETY: flock on a descriptor that `c` or `other` keeps open.
        if unsafe { libc::flock(fd, op) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            c.warnings.push(format!(
                "cannot lock {} ({e}); another ubtrfs process could change it at the same time",
                through.as_deref().unwrap_or(name)
            ));
            return Ok(());
        }
        // A reader only conflicts with exclusive holders; a writer with any.
        let holders: Vec<FlockHolder> =
            flock_holders(md).into_iter().filter(|h| writable || h.exclusive).collect();
        if holders.is_empty() && !retried_gone {
            // The holder let go between our try and the listing: try once more.
            retried_gone = true;
            continue;
        }
        // A lock listed under our own pid may be a descriptor this process has closed
        // but a child forked by another thread still shares until its exec, which
        // takes milliseconds. A writer gives that a bounded wait.
        let own = !holders.is_empty() && holders.iter().all(|h| h.pid == Some(me));
        if writable && own && start.elapsed() < OWN_LOCK_PATIENCE {
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(50));
            continue;
        }
        let others: Vec<u32> = holders.iter().filter_map(|h| h.pid).filter(|&p| p != me).collect();
        if wait_for(&others, through.as_deref().unwrap_or(name), writable, start, &mut told) {
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        break holders;
    };
    let mut pids: Vec<u32> = holders.iter().filter_map(|h| h.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let u =
        InUse { device: name.to_string(), by: User::Ubtrfs { pids, writing: !writable }, through };
    if writable {
        return Err(u.refusal());
    }
    c.in_use.push(u);
    Ok(())
}

/// Whether an open of `name` that met the other processes `pids` holding it should look
/// again (after a pause) rather than give up: a mount that is unmounting lets go once its
/// last commit is written, so it is waited for (readers too, so they see that commit),
/// at most `UNMOUNT_PATIENCE` since `start`, saying so once per process in `told`. A
/// writer also gives a FUSE daemon that holds the image `UNMOUNT_NOTICE` to notice its
/// unmount. Any other holder is reported at once.
fn wait_for(
    pids: &[u32],
    name: &str,
    writable: bool,
    start: std::time::Instant,
    told: &mut Option<u32>,
) -> bool {
    if let Some(&p) = pids.iter().find(|&&p| is_unmounting(p)) {
        if start.elapsed() >= UNMOUNT_PATIENCE {
            return false;
        }
        if *told != Some(p) {
            // The open has no other channel while it waits, and a silent wait of seconds
            // looks like a hang.
            eprintln!("waiting for the ubtrfs process {p} that is unmounting {name}");
            *told = Some(p);
        }
        return true;
    }
    writable && start.elapsed() < UNMOUNT_NOTICE && pids.iter().any(|&p| is_fuse_daemon(p))
}

/// Why a writer's O_EXCL open of a block device got EBUSY.
fn exclusive_holder(name: &str, md: &std::fs::Metadata) -> InUse {
    let bd = BlockDev::from_rdev(md.rdev());
    let by = if let Some(how) = mountinfo::mounted(&bd) {
        User::Kernel(how)
    } else {
        // A ubtrfs writer holds O_EXCL and its flock lock together.
        let pids: Vec<u32> =
            flock_holders(md).iter().filter(|h| h.exclusive).filter_map(|h| h.pid).collect();
        if pids.is_empty() {
            User::Kernel(KernelUse::HeldExclusively)
        } else {
            User::Ubtrfs { pids, writing: false }
        }
    };
    InUse { device: name.to_string(), by, through: None }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCKS: &str = "\
1: FLOCK  ADVISORY  WRITE 15834 fe:00:10010708 0 EOF
2: POSIX  ADVISORY  WRITE 999 fe:00:10010708 0 EOF
3: FLOCK  ADVISORY  READ 200 fe:00:10010708 0 EOF
3: -> FLOCK  ADVISORY  WRITE 201 fe:00:10010708 0 EOF
4: FLOCK  ADVISORY  READ 300 fe:01:10010708 0 EOF
5: FLOCK  ADVISORY  READ 301 fe:00:10010709 0 EOF
6: FLOCK  ADVISORY  WRITE 0 fe:00:10010708 0 EOF
7: FLOCK  ADVISORY  WRITE -1 fe:00:10010708 0 EOF
8: OFDLCK ADVISORY  READ  -1 00:05:1234 0 EOF
9: FLOCK  ADVISORY  UNLCK 400 fe:00:10010708 0 EOF
10: FLOCK ADVISORY  WRITE 401 zz:00:10010708 0 EOF
11: FLOCK ADVISORY  WRITE 402 fe:00:10010708:9 0 EOF
12: FLOCK ADVISORY  WRITE abc fe:00:10010708 0 EOF
garbage
13: FLOCK ADVISORY
14: LEASE  ACTIVE    READ 500 103:02:1234 0 EOF

";

    #[test]
    fn proc_locks_holders_of_one_inode() {
        let h = parse_proc_locks(LOCKS, (0xfe, 0), 10010708);
        let w = |pid| FlockHolder { pid, exclusive: true };
        let r = |pid| FlockHolder { pid, exclusive: false };
        // POSIX locks, waiters, other devices and inodes, unknown modes and broken
        // fields are not holders; pids outside our namespace are unknown.
        assert_eq!(h, vec![w(Some(15834)), r(Some(200)), w(None), w(None)]);
        assert_eq!(parse_proc_locks(LOCKS, (0xfe, 1), 10010708), vec![r(Some(300))]);
        assert!(parse_proc_locks(LOCKS, (0x103, 2), 1234).is_empty(), "leases are not flock locks");
        assert!(parse_proc_locks("", (0, 0), 0).is_empty());
    }

    #[test]
    fn messages_name_the_device_and_the_holder() {
        let u = |by, through: Option<&str>| InUse {
            device: "img".into(),
            by,
            through: through.map(str::to_string),
        };
        let e = u(User::Ubtrfs { pids: vec![42], writing: false }, None).refusal();
        assert_eq!(e.posix_kind(), Some(PosixKind::Busy));
        assert!(
            e.to_string().starts_with("img is in use by another ubtrfs process (pid 42)"),
            "{e}"
        );
        assert_eq!(
            u(User::Ubtrfs { pids: vec![], writing: false }, None).to_string(),
            "img is in use by another ubtrfs process"
        );
        assert_eq!(
            u(User::Ubtrfs { pids: vec![1, 2], writing: true }, None).to_string(),
            "img is being changed by another ubtrfs process (pids 1, 2)"
        );
        assert_eq!(
            u(User::Ubtrfs { pids: vec![7], writing: true }, None).reader_warning(),
            "img is being changed by another ubtrfs process (pid 7); showing its last committed state, which may change while it is read"
        );
        let m = u(
            User::Kernel(KernelUse::Mounted { mount_point: Some("/mnt/a b\n".into()) }),
            Some("/dev/loop3"),
        );
        assert!(m.refusal().to_string().starts_with("img is mounted by the kernel at /mnt/a b\\n (through /dev/loop3): device or resource busy (unmount it first)"), "{}", m.refusal());
        assert_eq!(
            u(User::Kernel(KernelUse::HeldExclusively), None).to_string(),
            "img is held exclusively by another program"
        );
    }
}
