//! Whether the kernel is using a device: mounted (directly, through a loop device
//! backed by an image file, or as one member of a multi-device btrfs), so that ubtrfs
//! refuses to write under a mounted filesystem and warns when it reads one.
//!
//! Sources, all read-only and all optional: `/proc/self/mountinfo` (mount points and
//! their sources), `/sys/block/loop*/loop/backing_file` (which files loop devices read),
//! `/sys/fs/btrfs/<fsid>/devices/` (every member of a mounted btrfs; the directory
//! exists only while the filesystem is mounted) and `/sys/dev/block/MAJ:MIN` (a block
//! device's kernel name). Devices are compared by number (`st_rdev`) and files by
//! `st_dev` + `st_ino`, never by path string, since one file has many names.
//!
//! Invariants: nothing here panics or loops on odd content. Every file read is capped
//! in size, every line that does not parse is skipped, and a missing entry means "not
//! mounted". Only sources under /dev/ are `stat`ed, so a mount of a hung network
//! filesystem cannot block the check.
//!
//! Neighbours: `device_lock` (the ubtrfs-to-ubtrfs lock, which calls in here),
//! `device` (`FileDevice::open`, where both run).

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

/// Largest /proc or /sys file read (mountinfo with many thousands of mounts fits).
const MAX_READ: u64 = 16 << 20;
/// Most loop devices or btrfs members looked at (far beyond any real system).
const MAX_ENTRIES: usize = 4096;

/// A device number, (major, minor).
pub type DevNum = (u32, u32);

/// Split a `dev_t` into (major, minor).
pub fn dev_num(dev: u64) -> DevNum {
    (libc::major(dev as libc::dev_t), libc::minor(dev as libc::dev_t))
}

/// One line of /proc/self/mountinfo, the fields ubtrfs needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// The mounted superblock's device (for btrfs an anonymous number, not a disk).
    pub dev: DevNum,
    pub mount_point: PathBuf,
    pub fstype: String,
    /// The device (or pseudo-name) that was mounted.
    pub source: PathBuf,
    /// The directory of the filesystem this mount shows (`/` for its root; a bind mount
    /// of a subdirectory, or a btrfs subvolume, shows that path).
    pub root: PathBuf,
    /// The mount's own flags (`rw,nosuid,nodev,relatime`): one mount point's view.
    pub mount_options: String,
    /// The superblock's options (`ro` or `rw` first), shared by every mount of it.
    pub super_options: String,
}

impl MountEntry {
    /// Whether the superblock is read-only (`mount -o remount,ro` makes it so for
    /// every mount of it; a read-only bind mount alone leaves it `rw`).
    pub fn super_read_only(&self) -> bool {
        self.super_options.split(',').any(|o| o == "ro")
    }

    /// Whether this mount point is read-only (its own flag, or its superblock's).
    pub fn read_only(&self) -> bool {
        self.mount_options.split(',').any(|o| o == "ro") || self.super_read_only()
    }
}

/// Undo mountinfo's octal escapes (`\040` space, `\011` tab, `\012` newline, `\134`
/// backslash); a backslash not followed by three octal digits stays as it is.
pub fn unescape(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = u32::from(b[i + 1] - b'0') * 64
                + u32::from(b[i + 2] - b'0') * 8
                + u32::from(b[i + 3] - b'0');
            // \400 and above do not fit a byte; the kernel never writes them.
            if let Ok(byte) = u8::try_from(v) {
                out.push(byte);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    out
}

fn path_of(bytes: Vec<u8>) -> PathBuf {
    PathBuf::from(OsString::from_vec(bytes))
}

/// Parse "MAJOR:MINOR" (decimal, as mountinfo and sysfs `dev` files write it).
pub fn parse_dev_num(s: &str) -> Option<DevNum> {
    let (a, b) = s.trim().split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Parse /proc/self/mountinfo text; lines that do not have the documented shape
/// (`ID PARENT MAJ:MIN ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`)
/// are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    let mut out = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // The separator comes after the six fixed fields and any optional ones.
        let Some(sep) = fields.iter().skip(6).position(|f| *f == "-").map(|p| p + 6) else {
            continue;
        };
        let (Some(dev), Some(fstype), Some(source)) =
            (parse_dev_num(fields[2]), fields.get(sep + 1), fields.get(sep + 2))
        else {
            continue;
        };
        out.push(MountEntry {
            dev,
            mount_point: path_of(unescape(fields[4])),
            fstype: String::from_utf8_lossy(&unescape(fstype)).into_owned(),
            source: path_of(unescape(source)),
            root: path_of(unescape(fields[3])),
            mount_options: fields[5].to_string(),
            super_options: fields.get(sep + 3).map(|o| o.to_string()).unwrap_or_default(),
        });
    }
    out
}

/// Read at most `MAX_READ` bytes of a small kernel file; None when absent or unreadable.
pub(crate) fn read_small(path: &Path) -> Option<String> {
    let f = std::fs::File::open(path).ok()?;
    let mut s = String::new();
    f.take(MAX_READ).read_to_string(&mut s).ok()?;
    Some(s)
}

/// How the kernel uses a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelUse {
    /// Mounted; the mount point is None when the mount is not visible from here (another
    /// mount namespace).
    Mounted { mount_point: Option<PathBuf> },
    /// Opened exclusively by something other than a visible mount (device mapper, md,
    /// a program holding O_EXCL).
    HeldExclusively,
}

/// A block device as the kernel knows it: its number and its name in /sys/block.
#[derive(Clone, Debug)]
pub(crate) struct BlockDev {
    pub rdev: DevNum,
    pub name: Option<String>,
}

impl BlockDev {
    pub fn from_rdev(rdev: u64) -> BlockDev {
        let rdev = dev_num(rdev);
        BlockDev { rdev, name: kernel_name(rdev) }
    }
    /// The node a user would name, for messages.
    pub fn dev_path(&self) -> String {
        match &self.name {
            Some(n) => format!("/dev/{n}"),
            None => format!("block device {}:{}", self.rdev.0, self.rdev.1),
        }
    }
}

/// The kernel name of block device `rdev` ("loop3"), from /sys/dev/block/MAJ:MIN.
fn kernel_name(rdev: DevNum) -> Option<String> {
    let link = std::fs::read_link(format!("/sys/dev/block/{}:{}", rdev.0, rdev.1)).ok()?;
    Some(link.file_name()?.to_str()?.to_string())
}

/// Whether mount `source` is the device `rdev` (named `name` in /sys/block).
fn source_is(source: &Path, rdev: DevNum, name: Option<&str>) -> bool {
    let Some(s) = source.to_str() else { return false };
    let Some(rest) = s.strip_prefix("/dev/") else { return false };
    if name == Some(rest) {
        return true;
    }
    match std::fs::metadata(source) {
        Ok(md) => md.file_type().is_block_device() && dev_num(md.rdev()) == rdev,
        Err(_) => false,
    }
}

/// Every member of every mounted btrfs, one list per filesystem (from /sys/fs/btrfs).
fn btrfs_members() -> Vec<Vec<BlockDev>> {
    let Ok(fsids) = std::fs::read_dir("/sys/fs/btrfs") else { return Vec::new() };
    let mut out = Vec::new();
    for fsid in fsids.flatten().take(MAX_ENTRIES) {
        let Ok(devs) = std::fs::read_dir(fsid.path().join("devices")) else { continue };
        let mut members = Vec::new();
        for d in devs.flatten().take(MAX_ENTRIES) {
            let Some(rdev) = read_small(&d.path().join("dev")).as_deref().and_then(parse_dev_num)
            else {
                continue;
            };
            members.push(BlockDev { rdev, name: d.file_name().to_str().map(str::to_string) });
        }
        if !members.is_empty() {
            out.push(members);
        }
    }
    out
}

/// Whether the kernel has block device `dev` mounted, and where.
pub(crate) fn mounted(dev: &BlockDev) -> Option<KernelUse> {
    let mounts = read_small(Path::new("/proc/self/mountinfo"))
        .map(|t| parse_mountinfo(&t))
        .unwrap_or_default();
    find_mount(dev, &mounts, &btrfs_members())
}

fn find_mount(dev: &BlockDev, mounts: &[MountEntry], btrfs: &[Vec<BlockDev>]) -> Option<KernelUse> {
    let is = |source: &Path, d: &BlockDev| source_is(source, d.rdev, d.name.as_deref());
    // Filesystems whose superblock is the device itself (ext4, a single-device btrfs
    // mounted by that name).
    if let Some(m) = mounts.iter().find(|m| m.dev == dev.rdev || is(&m.source, dev)) {
        return Some(KernelUse::Mounted { mount_point: Some(m.mount_point.clone()) });
    }
    // A multi-device btrfs is mounted by one member's name; the others are in sysfs.
    for members in btrfs {
        if !members.iter().any(|m| m.rdev == dev.rdev) {
            continue;
        }
        let mp = mounts
            .iter()
            .find(|m| m.fstype == "btrfs" && members.iter().any(|d| is(&m.source, d)))
            .map(|m| m.mount_point.clone());
        return Some(KernelUse::Mounted { mount_point: mp });
    }
    None
}

/// Loop devices whose backing file is the file with `st_dev` `dev` and inode `ino`.
pub(crate) fn loops_backed_by(dev: u64, ino: u64) -> Vec<BlockDev> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else { return Vec::new() };
    let mut out = Vec::new();
    for e in entries.flatten().take(MAX_ENTRIES) {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("loop") {
            continue;
        }
        let Some(backing) = read_small(&e.path().join("loop/backing_file")) else { continue };
        // The path as the loop's creator saw it; only its identity counts.
        let Ok(md) = std::fs::metadata(backing.trim_end_matches('\n')) else { continue };
        if md.dev() != dev || md.ino() != ino {
            continue;
        }
        let Some(rdev) = read_small(&e.path().join("dev")).as_deref().and_then(parse_dev_num)
        else {
            continue;
        };
        out.push(BlockDev { rdev, name: Some(name.to_string()) });
    }
    out
}

/// The backing file of loop device `dev`, if it is one and the file is visible here.
pub(crate) fn loop_backing_file(dev: &BlockDev) -> Option<PathBuf> {
    let name = dev.name.as_deref()?;
    if !name.starts_with("loop") {
        return None;
    }
    let backing = read_small(&Path::new("/sys/block").join(name).join("loop/backing_file"))?;
    let p = PathBuf::from(backing.trim_end_matches('\n'));
    p.is_file().then_some(p)
}

/// Whether some holder has `dev` open exclusively: a short O_EXCL open of its node.
/// None when that cannot be tried (no node, no permission).
pub(crate) fn held_exclusively(dev: &BlockDev) -> Option<bool> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = PathBuf::from(dev.dev_path());
    let md = std::fs::metadata(&path).ok()?;
    if !md.file_type().is_block_device() || dev_num(md.rdev()) != dev.rdev {
        return None;
    }
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_EXCL).open(&path) {
        Ok(_) => Some(false),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => Some(true),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:5 - proc proc rw
25 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
43 25 0:39 / /tmp/mx rw,relatime - btrfs /dev/loop0 rw,discard=async,space_cache=v2,subvolid=5,subvol=/
44 25 0:40 /sub /mnt/with\\040space\\011tab rw shared:7 master:2 - btrfs /dev/loop1 rw
this line is garbage
45 25 0:41 / /no/separator rw shared:8 btrfs /dev/loop2 rw
46 25 x:y / /bad/dev rw - btrfs /dev/loop3 rw
47 25 0:42 / /short rw -
48 25 0:43 / /odd\\1 rw - fuse.sshfs host:/dir rw

";

    #[test]
    fn mountinfo_fields_and_escapes() {
        let m = parse_mountinfo(MOUNTINFO);
        let points: Vec<&Path> = m.iter().map(|e| e.mount_point.as_path()).collect();
        assert_eq!(
            points,
            [
                Path::new("/proc"),
                Path::new("/"),
                Path::new("/tmp/mx"),
                Path::new("/mnt/with space\ttab"),
                Path::new("/odd\\1")
            ]
        );
        assert_eq!(m[2].dev, (0, 39));
        assert_eq!(
            (m[2].mount_point.as_path(), m[2].fstype.as_str(), m[2].source.as_path()),
            (Path::new("/tmp/mx"), "btrfs", Path::new("/dev/loop0"))
        );
        assert_eq!(
            (m[3].root.as_path(), m[3].mount_options.as_str(), m[3].super_options.as_str()),
            (Path::new("/sub"), "rw", "rw")
        );
        assert!(!m[3].read_only());
        assert_eq!(m[3].source, Path::new("/dev/loop1"));
        assert_eq!(m[1].dev, (254, 0));
        assert_eq!(m[4].fstype, "fuse.sshfs");
    }

    #[test]
    fn unescape_edges() {
        assert_eq!(unescape(r"a\040b"), b"a b");
        assert_eq!(unescape(r"\134"), b"\\");
        assert_eq!(unescape(r"\012end"), b"\nend");
        // Too short, not octal, out of byte range: kept literally.
        assert_eq!(unescape(r"x\04"), br"x\04");
        assert_eq!(unescape(r"\089"), br"\089");
        assert_eq!(unescape(r"\777"), br"\777");
        assert_eq!(unescape("\\"), b"\\");
        assert_eq!(unescape(""), b"");
    }

    #[test]
    fn dev_num_parsing() {
        assert_eq!(parse_dev_num("7:3\n"), Some((7, 3)));
        assert_eq!(parse_dev_num("259:65536"), Some((259, 65536)));
        assert_eq!(parse_dev_num("7"), None);
        assert_eq!(parse_dev_num("7:-1"), None);
        assert_eq!(parse_dev_num(":"), None);
    }

    #[test]
    fn mounts_found_by_number_name_and_btrfs_membership() {
        let mounts = parse_mountinfo(MOUNTINFO);
        let dev =
            |maj, min, name: &str| BlockDev { rdev: (maj, min), name: Some(name.to_string()) };
        // By name: the loop device a btrfs was mounted through.
        assert_eq!(
            find_mount(&dev(7, 0, "loop0"), &mounts, &[]),
            Some(KernelUse::Mounted { mount_point: Some("/tmp/mx".into()) })
        );
        // By superblock number: ext4 mounted from vda.
        assert_eq!(
            find_mount(&BlockDev { rdev: (254, 0), name: None }, &mounts, &[]),
            Some(KernelUse::Mounted { mount_point: Some("/".into()) })
        );
        // A second member of the btrfs mounted through loop1.
        let members = vec![vec![dev(7, 1, "loop1"), dev(7, 5, "loop5")]];
        assert_eq!(
            find_mount(&dev(7, 5, "loop5"), &mounts, &members),
            Some(KernelUse::Mounted { mount_point: Some("/mnt/with space\ttab".into()) })
        );
        // A member of a btrfs mounted where we cannot see.
        let hidden = vec![vec![dev(7, 6, "loop6"), dev(7, 7, "loop7")]];
        assert_eq!(
            find_mount(&dev(7, 7, "loop7"), &mounts, &hidden),
            Some(KernelUse::Mounted { mount_point: None })
        );
        // Not mounted; garbage lines name loop2 and loop3 but were skipped.
        assert_eq!(find_mount(&dev(7, 2, "loop2"), &mounts, &members), None);
        assert_eq!(find_mount(&dev(7, 3, "loop3"), &mounts, &members), None);
    }
}
