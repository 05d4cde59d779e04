//! `ubtrfs mount` end to end: scripted POSIX workloads through a FUSE mount of a
//! `mkfs.btrfs` image, checked against the kernel afterwards. After every unmount the
//! image passes `btrfs check --readonly --check-data-csum`, and a kernel mount shows
//! exactly the tree the FUSE mount showed (path, type, mode, owner, size, nlink,
//! inode number, contents, symlink target, rdev, xattrs, mtime).
//!
//! Needs root, /dev/fuse and fusermount3 (the tests say why they skip without them;
//! under CI=true they must run).

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::{bin, fails, pseudo_random as data, run, scratch_in};
use fuse::{assert_check, is_mountpoint, mkfs, FuseMount, KernelMount, Stop};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn fuse_available(test: &str) -> bool {
    if !kernel::kernel_available_with(test, &["/dev/fuse", "/usr/bin/fusermount3"]) {
        return false;
    }
    true
}

fn scratch(name: &str) -> PathBuf {
    scratch_in("mount", name)
}

/// One walked entry.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Rec {
    kind: char,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
    blocks: u64,
    nlink: u64,
    ino: u64,
    mtime: (i64, i64),
    rdev: u64,
    sha: Option<String>,
    target: Option<Vec<u8>>,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

fn xattrs(p: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut out = BTreeMap::new();
    let mut buf = vec![0u8; 65536];
    // SAFETY: buf is valid for its length; c is NUL-terminated.
    let n = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "llistxattr {}: {}", p.display(), std::io::Error::last_os_error());
    for name in buf[..n as usize].split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cn = CString::new(name).unwrap();
        let mut v = vec![0u8; 65536];
        // SAFETY: as above.
        let m = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        assert!(
            m >= 0,
            "lgetxattr {} {:?}: {}",
            p.display(),
            String::from_utf8_lossy(name),
            std::io::Error::last_os_error()
        );
        v.truncate(m as usize);
        out.insert(name.to_vec(), v);
    }
    out
}

fn sha_file(p: &Path) -> String {
    let mut f = std::fs::File::open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    format!("{:x}", h.finalize())
}

fn walk(root: &Path) -> BTreeMap<String, Rec> {
    let mut out = BTreeMap::new();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((p, rel)) = stack.pop() {
        let md =
            std::fs::symlink_metadata(&p).unwrap_or_else(|e| panic!("lstat {}: {e}", p.display()));
        let ft = md.file_type();
        let kind = if ft.is_dir() {
            'd'
        } else if ft.is_symlink() {
            'l'
        } else if ft.is_file() {
            'f'
        } else if ft.is_fifo() {
            'p'
        } else if ft.is_socket() {
            's'
        } else if ft.is_char_device() {
            'c'
        } else {
            'b'
        };
        let rec = Rec {
            kind,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            size: if kind == 'd' { 0 } else { md.size() },
            blocks: if kind == 'd' { 0 } else { md.blocks() },
            nlink: md.nlink(),
            ino: md.ino(),
            mtime: (md.mtime(), md.mtime_nsec()),
            rdev: if kind == 'c' || kind == 'b' { md.rdev() } else { 0 },
            sha: (kind == 'f').then(|| sha_file(&p)),
            target: (kind == 'l')
                .then(|| std::fs::read_link(&p).unwrap().as_os_str().as_bytes().to_vec()),
            xattrs: xattrs(&p),
        };
        if kind == 'd' {
            for e in std::fs::read_dir(&p).unwrap() {
                let e = e.unwrap();
                let name = e.file_name().to_string_lossy().into_owned();
                stack.push((e.path(), if rel.is_empty() { name } else { format!("{rel}/{name}") }));
            }
        }
        out.insert(rel, rec);
    }
    out
}

fn assert_same_tree(fuse: &BTreeMap<String, Rec>, kernel: &BTreeMap<String, Rec>, what: &str) {
    let fk: Vec<&String> = fuse.keys().collect();
    let kk: Vec<&String> = kernel.keys().collect();
    assert_eq!(fk, kk, "{what}: the kernel shows other names than the FUSE mount did");
    for (p, f) in fuse {
        let mut k = kernel[p].clone();
        if p.is_empty() {
            // The mount point itself: the kernel's root is inode 256 in the top tree,
            // as ours is; its times change with every entry.
            k.mtime = f.mtime;
        }
        assert_eq!(f, &k, "{what}: {p:?} differs (left: FUSE mount, right: kernel mount)");
    }
}

fn fallocate(f: &std::fs::File, mode: i32, off: i64, len: i64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid fd.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) };
    assert_eq!(r, 0, "fallocate mode {mode} {off}+{len}: {}", std::io::Error::last_os_error());
}

fn seek(f: &std::fs::File, off: i64, whence: i32) -> i64 {
    use std::os::fd::AsRawFd;
    // SAFETY: a valid fd.
    unsafe { libc::lseek(f.as_raw_fd(), off, whence) }
}

fn set_times(p: &Path, sec: i64, nsec: i64) {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let ts = [
        libc::timespec { tv_sec: sec, tv_nsec: nsec },
        libc::timespec { tv_sec: sec, tv_nsec: nsec },
    ];
    // SAFETY: c is NUL-terminated, ts two timespecs.
    let r = unsafe {
        libc::utimensat(libc::AT_FDCWD, c.as_ptr(), ts.as_ptr(), libc::AT_SYMLINK_NOFOLLOW)
    };
    assert_eq!(r, 0, "utimensat {}: {}", p.display(), std::io::Error::last_os_error());
}

fn setxattr(p: &Path, name: &str, value: &[u8]) {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let n = CString::new(name).unwrap();
    // SAFETY: valid strings and buffer.
    let r =
        unsafe { libc::lsetxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    assert_eq!(r, 0, "setxattr {} {name}: {}", p.display(), std::io::Error::last_os_error());
}

/// The scripted workload: every kind of inode, data of every shape (inline, several
/// extents, sparse, preallocated, punched), links, renames, an unlinked open file,
/// xattrs, modes, owners, times and flags.
fn workload(m: &Path) {
    let d = m.join("dir");
    std::fs::create_dir(&d).unwrap();
    std::fs::create_dir_all(m.join("deep/a/b/c")).unwrap();
    std::fs::write(d.join("small"), b"hello, fuse\n").unwrap();
    std::fs::write(d.join("big"), data(1, 5 << 20)).unwrap();
    std::fs::write(d.join("odd"), data(2, 123_457)).unwrap();
    // Overwrite inside, extend past the end.
    {
        let mut f = std::fs::OpenOptions::new().write(true).open(d.join("big")).unwrap();
        f.seek(SeekFrom::Start(4096 * 100 + 17)).unwrap();
        f.write_all(&data(3, 300_000)).unwrap();
        f.seek(SeekFrom::Start((5 << 20) + 4096)).unwrap();
        f.write_all(b"tail").unwrap();
    }
    // Sparse, then SEEK_DATA/SEEK_HOLE.
    {
        let f = std::fs::File::create(d.join("sparse")).unwrap();
        f.set_len(64 << 20).unwrap();
        let mut f2 = &f;
        f2.seek(SeekFrom::Start(32 << 20)).unwrap();
        f2.write_all(&data(4, 8192)).unwrap();
        assert_eq!(seek(&f, 0, libc::SEEK_DATA), 32 << 20, "SEEK_DATA finds the only data");
        assert_eq!(seek(&f, 32 << 20, libc::SEEK_HOLE), (32 << 20) + 8192, "SEEK_HOLE after it");
        // Preallocate, punch.
        fallocate(&f, 0, 1 << 20, 1 << 20);
        fallocate(
            &f,
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            (32 << 20) + 4096,
            4096,
        );
    }
    // Truncate down and up.
    {
        let f = std::fs::OpenOptions::new().write(true).open(d.join("odd")).unwrap();
        f.set_len(50_001).unwrap();
        f.set_len(70_000).unwrap();
    }
    // Links, symlinks, special files.
    std::fs::hard_link(d.join("small"), m.join("deep/a/small-link")).unwrap();
    std::os::unix::fs::symlink("../dir/small", m.join("deep/sym")).unwrap();
    std::os::unix::fs::symlink("x".repeat(3000), m.join("deep/long-sym")).unwrap();
    let fifo = CString::new(m.join("deep/fifo").as_os_str().as_bytes()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o640) }, 0);
    let dev = CString::new(m.join("deep/null").as_os_str().as_bytes()).unwrap();
    assert_eq!(
        // SAFETY: as above.
        unsafe { libc::mknod(dev.as_ptr(), libc::S_IFCHR | 0o600, libc::makedev(1, 3)) },
        0,
        "{}",
        std::io::Error::last_os_error()
    );
    // Renames: plain, over an existing file, a directory, an exchange.
    std::fs::write(m.join("r1"), b"one").unwrap();
    std::fs::write(m.join("r2"), b"two").unwrap();
    std::fs::rename(m.join("r1"), m.join("r2")).unwrap();
    std::fs::rename(m.join("deep/a/b"), m.join("moved-b")).unwrap();
    std::fs::write(m.join("x1"), b"x1").unwrap();
    std::fs::create_dir(m.join("x2")).unwrap();
    let (a, b) = (
        CString::new(m.join("x1").as_os_str().as_bytes()).unwrap(),
        CString::new(m.join("x2").as_os_str().as_bytes()).unwrap(),
    );
    // SAFETY: NUL-terminated paths.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    assert_eq!(r, 0, "RENAME_EXCHANGE: {}", std::io::Error::last_os_error());
    // An unlinked file stays readable while open.
    {
        std::fs::write(m.join("gone"), data(5, 70_000)).unwrap();
        let mut f = std::fs::File::open(m.join("gone")).unwrap();
        std::fs::remove_file(m.join("gone")).unwrap();
        assert!(!m.join("gone").exists());
        let mut back = Vec::new();
        f.read_to_end(&mut back).unwrap();
        assert_eq!(back, data(5, 70_000), "an unlinked open file reads back");
    }
    // Removals.
    std::fs::write(m.join("deep/a/victim"), b"bye").unwrap();
    std::fs::remove_file(m.join("deep/a/victim")).unwrap();
    std::fs::create_dir(m.join("deep/empty")).unwrap();
    std::fs::remove_dir(m.join("deep/empty")).unwrap();
    assert_eq!(
        std::fs::remove_dir(m.join("deep/a")).unwrap_err().raw_os_error(),
        Some(libc::ENOTEMPTY)
    );
    // Attributes.
    std::fs::set_permissions(d.join("odd"), std::fs::Permissions::from_mode(0o4751)).unwrap();
    std::os::unix::fs::lchown(d.join("small"), Some(1234), Some(5678)).unwrap();
    set_times(&d.join("big"), 946_684_800, 123_456_789);
    set_times(&m.join("deep/sym"), 1_000_000_000, 5);
    setxattr(&d.join("small"), "user.one", b"1");
    setxattr(&d.join("small"), "user.big", &data(6, 3000));
    setxattr(&m.join("deep"), "user.dir", b"on a directory");
    setxattr(&d.join("small"), "user.gone", b"x");
    let c = CString::new(d.join("small").as_os_str().as_bytes()).unwrap();
    let n = CString::new("user.gone").unwrap();
    // SAFETY: NUL-terminated strings.
    assert_eq!(unsafe { libc::lremovexattr(c.as_ptr(), n.as_ptr()) }, 0);
    // O_APPEND and O_TRUNC.
    {
        let mut f = std::fs::OpenOptions::new().append(true).open(d.join("small")).unwrap();
        f.write_all(b"appended\n").unwrap();
        std::fs::write(m.join("trunc"), data(7, 9000)).unwrap();
        let mut t =
            std::fs::OpenOptions::new().write(true).truncate(true).open(m.join("trunc")).unwrap();
        t.write_all(b"short").unwrap();
    }
    // An O_EXCL create of an existing name fails.
    let e = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(d.join("small"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
    assert_eq!(std::fs::read(d.join("small")).unwrap(), b"hello, fuse\nappended\n");
}

/// The workload through the mount, unmounted by SIGTERM: btrfs check is clean and the
/// kernel sees exactly the tree the mount showed.
#[test]
fn workload_through_the_mount_is_what_the_kernel_sees() {
    if !fuse_available("workload_through_the_mount_is_what_the_kernel_sees") {
        return;
    }
    let s = scratch("workload");
    let img = s.join("img");
    mkfs(&img, "1G");
    let m = FuseMount::start(&img, &s.join("mnt"), "");
    workload(&s.join("mnt"));
    // lsattr/chattr through FS_IOC_GETFLAGS/SETFLAGS.
    std::fs::write(s.join("mnt/flagged"), b"").unwrap();
    run(Command::new("chattr").arg("+dA").arg(s.join("mnt/flagged")));
    let la = run(Command::new("lsattr").arg("-d").arg(s.join("mnt/flagged")));
    let fuse_flags = la.split_whitespace().next().unwrap_or_default().to_string();
    assert!(fuse_flags.starts_with("------dA"), "lsattr shows the flags set: {la}");
    let mut fuse = walk(&s.join("mnt"));
    let err = m.stop(Stop::Sigterm);
    assert!(!err.contains("error"), "the mount reported errors: {err}");
    assert_check(&img, "after the workload");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    let kernel = walk(&k.dir);
    let la = run(Command::new("lsattr").arg("-d").arg(k.dir.join("flagged")));
    assert_eq!(
        la.split_whitespace().next(),
        Some(fuse_flags.as_str()),
        "the kernel sees the flags lsattr showed through the mount"
    );
    drop(k);
    // While data is dirty st_blocks is an estimate (the kernel's counts delalloc
    // bytes too, and settles at writeback); everything else must agree at once.
    for (p, r) in fuse.iter_mut() {
        r.blocks = kernel.get(p).map_or(r.blocks, |k| k.blocks);
    }
    assert_same_tree(&fuse, &kernel, "workload");
    // Mounted again, with nothing dirty, every field agrees, st_blocks included.
    let m = FuseMount::start(&img, &s.join("mnt"), "");
    let again = walk(&s.join("mnt"));
    m.stop(Stop::Sigterm);
    assert_same_tree(&again, &kernel, "workload, mounted again");
    let _ = std::fs::remove_dir_all(&s);
}

/// Every way a mount ends commits and lets the image go: SIGINT, SIGTERM,
/// `fusermount3 -u`, `umount`. The file written is there afterwards, read by
/// `ubtrfs cat` (which the image lock would refuse while the mount held it).
#[test]
fn every_unmount_commits_and_releases_the_image() {
    if !fuse_available("every_unmount_commits_and_releases_the_image") {
        return;
    }
    let s = scratch("unmounts");
    let img = s.join("img");
    mkfs(&img, "300M");
    for (i, how) in
        [Stop::Sigint, Stop::Sigterm, Stop::Fusermount, Stop::Umount].into_iter().enumerate()
    {
        // A long commit interval: only the unmount commits.
        let m = FuseMount::start(&img, &s.join("mnt"), "commit=300");
        if i == 0 {
            // The mount table names the image and the type `fuse.ubtrfs`.
            let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
            let mnt = s.join("mnt").display().to_string();
            let line = mounts
                .lines()
                .find(|l| l.split(' ').nth(1) == Some(mnt.as_str()))
                .expect("the mount is in /proc/self/mounts");
            let f: Vec<&str> = line.split(' ').collect();
            assert_eq!((f[0], f[2]), (img.display().to_string().as_str(), "fuse.ubtrfs"), "{line}");
        }
        let name = format!("f{i}");
        std::fs::write(s.join("mnt").join(&name), data(i as u64, 200_000)).unwrap();
        m.stop(how);
        let out = bin().arg("cat").arg(&img).arg(format!("/{name}")).output().unwrap();
        assert!(
            out.status.success(),
            "unmount {i}: ubtrfs cat: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.stdout, data(i as u64, 200_000), "unmount {i}: the file is on disk");
        assert_check(&img, &format!("unmount {i}"));
    }
    let _ = std::fs::remove_dir_all(&s);
}

/// kill -9 during fsync-heavy work, many times: every image checks clean and holds
/// every byte fsynced before the kill.
#[test]
fn kill9_keeps_every_fsynced_byte() {
    if !fuse_available("kill9_keeps_every_fsynced_byte") {
        return;
    }
    let s = scratch("kill9");
    let img = s.join("img");
    mkfs(&img, "512M");
    let mut synced: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for round in 0..6u64 {
        let m = FuseMount::start(&img, &s.join("mnt"), "commit=300");
        // Files fsynced this round, then files written without fsync, then the kill
        // lands while a writer is still writing.
        for k in 0..5u64 {
            let name = format!("r{round}-{k}");
            let body = data(round * 100 + k, 4096 * (1 + k as usize * 7) + 11);
            let mut f = std::fs::File::create(s.join("mnt").join(&name)).unwrap();
            f.write_all(&body).unwrap();
            f.sync_all().unwrap();
            synced.insert(name, body);
        }
        let dir = s.join("mnt");
        let writer = std::thread::spawn(move || {
            for k in 0..1000u64 {
                if std::fs::write(dir.join(format!("unsynced-{round}-{k}")), data(k, 10_000))
                    .is_err()
                {
                    return;
                }
            }
        });
        std::thread::sleep(Duration::from_millis(150 + 50 * round));
        m.kill9();
        let _ = writer.join();
        assert_check(&img, &format!("after kill -9 in round {round}"));
        let k = KernelMount::new(&img, &s.join("kmnt"));
        for (name, body) in &synced {
            let got = std::fs::read(k.dir.join(name))
                .unwrap_or_else(|e| panic!("round {round}: fsynced {name} lost: {e}"));
            assert_eq!(&got, body, "round {round}: fsynced {name} changed");
        }
        drop(k);
    }
    let _ = std::fs::remove_dir_all(&s);
}

/// Real data: a copy of /usr/include's linux/ and asm-generic/ trees with `cp -a`,
/// compared with the source through the mount, then through the kernel.
#[test]
fn copy_of_usr_include_round_trips() {
    if !fuse_available("copy_of_usr_include_round_trips") {
        return;
    }
    let src = Path::new("/usr/include/linux");
    if !src.is_dir() {
        eprintln!(
            "copy_of_usr_include_round_trips: skipped: no /usr/include/linux on this machine"
        );
        return;
    }
    let s = scratch("usrinclude");
    let img = s.join("img");
    mkfs(&img, "1G");
    let m = FuseMount::start(&img, &s.join("mnt"), "compress=zstd");
    run(Command::new("cp").arg("-a").arg(src).arg(s.join("mnt/linux")));
    let diff = Command::new("diff")
        .arg("-r")
        .arg("--no-dereference")
        .arg(src)
        .arg(s.join("mnt/linux"))
        .output()
        .unwrap();
    assert!(
        diff.status.success(),
        "diff -r of the copy: {}",
        String::from_utf8_lossy(&diff.stdout)
    );
    let fuse = walk(&s.join("mnt"));
    m.stop(Stop::Fusermount);
    assert_check(&img, "after cp -a");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    let kernel = walk(&k.dir);
    drop(k);
    assert_same_tree(&fuse, &kernel, "cp -a /usr/include/linux");
    let _ = std::fs::remove_dir_all(&s);
}

/// `cp --reflink=auto` through the mount shares extents (copy_file_range clones):
/// the kernel's `btrfs filesystem du` counts the copy's bytes as shared, both files
/// read the same, and after the kernel overwrites part of the copy the image checks
/// clean and the source is unchanged.
#[test]
fn cp_through_the_mount_makes_reflink_copies() {
    if !fuse_available("cp_through_the_mount_makes_reflink_copies") {
        return;
    }
    let s = scratch("reflinkcp");
    let img = s.join("img");
    mkfs(&img, "512M");
    let data: Vec<u8> =
        (0..(8u32 << 20) + 777).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let m = FuseMount::start(&img, &s.join("mnt"), "");
    std::fs::write(s.join("mnt/a"), &data).unwrap();
    run(Command::new("cp").arg("--reflink=auto").arg(s.join("mnt/a")).arg(s.join("mnt/b")));
    assert!(
        std::fs::read(s.join("mnt/b")).unwrap() == data,
        "the copy reads differently through the mount"
    );
    m.stop(Stop::Fusermount);
    assert_check(&img, "after cp --reflink=auto");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    let shared = kernel::du_shared_bytes(&k.dir);
    assert!(shared >= data.len() as u64, "btrfs filesystem du counts {shared} bytes shared");
    assert!(
        std::fs::read(k.dir.join("b")).unwrap() == data,
        "the kernel reads the copy differently"
    );
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(k.dir.join("b")).unwrap();
        f.write_all_at(&[0xeeu8; 65536], 1 << 20).unwrap();
        f.sync_all().unwrap();
    }
    assert!(
        std::fs::read(k.dir.join("a")).unwrap() == data,
        "overwriting the copy changed the source"
    );
    drop(k);
    assert_check(&img, "after the kernel overwrote the shared copy");
    let _ = std::fs::remove_dir_all(&s);
}

/// The mount's cleaner drops deleted subvolumes: one deleted offline and left for it,
/// and one removed through the mount with rmdir(2) (empty subvolumes only, as the
/// kernel's rmdir); rmdir of a full one is ENOTEMPTY. Afterwards nothing waits, the
/// image checks clean and the kernel shows the snapshot of the deleted subvolume whole.
#[test]
fn the_mount_cleaner_drops_deleted_subvolumes() {
    if !fuse_available("the_mount_cleaner_drops_deleted_subvolumes") {
        return;
    }
    let s = scratch("cleaner");
    let img = s.join("img");
    mkfs(&img, "512M");
    {
        let k = KernelMount::new(&img, &s.join("kmnt"));
        run(Command::new("btrfs").args(["subvolume", "create"]).arg(k.dir.join("big")));
        run(Command::new("btrfs").args(["subvolume", "create"]).arg(k.dir.join("empty")));
        for i in 0..3000 {
            std::fs::write(
                k.dir.join(format!("big/f{i}")),
                format!("file {i} ").repeat(i % 50 + 1),
            )
            .unwrap();
        }
        run(Command::new("btrfs")
            .args(["subvolume", "snapshot", "-r"])
            .arg(k.dir.join("big"))
            .arg(k.dir.join("big-snap")));
    }
    let i = img.to_str().unwrap();
    run(bin().args(["subvolume", "delete", "--no-clean", i, "/big"]));
    assert!(run(bin().args(["subvolume", "list", "-d", i])).contains("<deleted>"));
    // The default commit interval (30 s): the cleaner runs at mount and when a deletion
    // wakes it.
    let m = FuseMount::start(&img, &s.join("mnt"), "");
    std::fs::remove_dir(s.join("mnt/empty"))
        .expect("rmdir of an empty subvolume through the mount");
    let e = std::fs::remove_dir(s.join("mnt/big-snap")).expect_err("rmdir of a full subvolume");
    assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY), "{e}");
    assert!(!s.join("mnt/empty").exists());
    std::thread::sleep(Duration::from_secs(2));
    m.stop(Stop::Fusermount);
    // Only the mount's cleaner drops them: mount again until it has.
    for _ in 0..10 {
        if run(bin().args(["subvolume", "list", "-d", i])).trim().is_empty() {
            break;
        }
        let m = FuseMount::start(&img, &s.join("mnt"), "");
        std::thread::sleep(Duration::from_secs(2));
        m.stop(Stop::Fusermount);
    }
    let left = run(bin().args(["subvolume", "list", "-d", i]));
    assert!(left.trim().is_empty(), "still waiting for the cleaner: {left}");
    assert_check(&img, "after the mount's cleaner");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    assert!(!k.dir.join("big").exists() && !k.dir.join("empty").exists());
    for i in (0..3000).step_by(37) {
        assert_eq!(
            std::fs::read_to_string(k.dir.join(format!("big-snap/f{i}"))).unwrap(),
            format!("file {i} ").repeat(i % 50 + 1)
        );
    }
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

/// kill -9 of the mount while its cleaner drops a large deleted subvolume: every time,
/// the image checks clean (the last commit, with the drop's progress so far), and the
/// next drop resumes there and ends with exact references.
#[test]
fn kill9_during_the_cleaner_resumes_exactly() {
    if !fuse_available("kill9_during_the_cleaner_resumes_exactly") {
        return;
    }
    let s = scratch("cleaner-kill9");
    let img = s.join("img");
    run(Command::new("truncate").args(["-s", "1G"]).arg(&img));
    run(Command::new("mkfs.btrfs").args(["-q", "-f", "-n", "4096"]).arg(&img));
    {
        let k = KernelMount::new(&img, &s.join("kmnt"));
        run(Command::new("btrfs").args(["subvolume", "create"]).arg(k.dir.join("big")));
        for d in 0..40 {
            std::fs::create_dir(k.dir.join(format!("big/d{d}"))).unwrap();
            for i in 0..1000 {
                std::fs::write(
                    k.dir.join(format!("big/d{d}/f{i}")),
                    format!("{d}/{i} ").repeat(i % 30 + 1),
                )
                .unwrap();
            }
        }
        run(Command::new("btrfs")
            .args(["subvolume", "snapshot", "-r"])
            .arg(k.dir.join("big"))
            .arg(k.dir.join("snap")));
        // The source changes after the snapshot: its own blocks and shared ones mix.
        for d in (0..40).step_by(3) {
            std::fs::write(k.dir.join(format!("big/d{d}/f7")), b"changed").unwrap();
        }
    }
    let i = img.to_str().unwrap();
    run(bin().args(["subvolume", "delete", "--no-clean", i, "/big"]));
    let mut mid_drop = 0;
    for delay_ms in [100u64, 200, 300, 400, 600, 900, 1400, 2000] {
        if run(bin().args(["subvolume", "list", "-d", i])).trim().is_empty() {
            break;
        }
        let m = FuseMount::start(&img, &s.join("mnt"), "commit=1");
        std::thread::sleep(Duration::from_millis(delay_ms));
        m.kill9();
        wait_unlocked(&img);
        assert_check(&img, &format!("after kill -9 {delay_ms} ms into the cleaner"));
        mid_drop += usize::from(!run(bin().args(["subvolume", "list", "-d", i])).trim().is_empty());
    }
    assert!(mid_drop > 0, "every kill came after the cleaner had finished");
    eprintln!(
        "kill9_during_the_cleaner_resumes_exactly: {mid_drop} kills landed before the drop's end"
    );
    run(bin().args(["subvolume", "sync", i]));
    assert!(run(bin().args(["subvolume", "list", "-d", i])).trim().is_empty());
    assert_check(&img, "after the resumed drop");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    assert!(!k.dir.join("big").exists());
    for d in (0..40).step_by(7) {
        for i in (0..1000).step_by(97) {
            assert_eq!(
                std::fs::read_to_string(k.dir.join(format!("snap/d{d}/f{i}"))).unwrap(),
                format!("{d}/{i} ").repeat(i % 30 + 1)
            );
        }
    }
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

/// `ubtrfs subvolume create|snapshot|delete|set-default` with the mount point in
/// place of the image go through the mount's btrfs ioctls: the mount shows each change
/// at once, a read-only snapshot refuses writes, deleting needs root, and afterwards
/// the image checks clean and the kernel shows the same subvolumes and default.
#[test]
fn subvolume_commands_through_the_mount() {
    if !fuse_available("subvolume_commands_through_the_mount") {
        return;
    }
    let s = scratch("subvol-ioctl");
    let img = s.join("img");
    mkfs(&img, "512M");
    let mnt = s.join("mnt");
    let m = FuseMount::start(&img, &mnt, "allow_other");
    let mp = mnt.to_str().unwrap();
    assert!(run(bin().args(["subvolume", "create", mp, "/sv"])).contains("through the mount"));
    for i in 0..200 {
        std::fs::write(mnt.join(format!("sv/f{i}")), format!("{i}").repeat(i + 1)).unwrap();
    }
    run(bin().args(["subvolume", "snapshot", "-r", mp, "/sv", "/sv-ro"]));
    run(bin().args(["subvolume", "snapshot", mp, "/sv", "/sv-rw"]));
    std::fs::write(mnt.join("sv-rw/f1"), b"changed in the snapshot").unwrap();
    assert_eq!(std::fs::read_to_string(mnt.join("sv-ro/f199")).unwrap(), "199".repeat(200));
    let e = std::fs::write(mnt.join("sv-ro/new"), b"x")
        .expect_err("a write into the read-only snapshot");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    // Deleting is for root (CAP_SYS_ADMIN), as on the kernel without user_subvol_rm_allowed.
    let o = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(env!("CARGO_BIN_EXE_ubtrfs"))
        .args(["subvolume", "delete", mp, "/sv-rw"])
        .output()
        .unwrap();
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not permitted"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    run(bin().args(["subvolume", "delete", mp, "/sv"]));
    assert!(!mnt.join("sv").exists(), "the mount still shows the deleted subvolume");
    assert_eq!(std::fs::read_to_string(mnt.join("sv-rw/f1")).unwrap(), "changed in the snapshot");
    let o = bin().args(["subvolume", "snapshot", mp, "/sv-ro/f1", "/x"]).output().unwrap();
    assert!(!o.status.success(), "a snapshot of a plain file");
    run(bin().args(["subvolume", "set-default", mp, "/sv-rw"]));
    m.stop(Stop::Fusermount);
    run(bin().args(["subvolume", "sync", img.to_str().unwrap()]));
    assert_check(&img, "after subvolume commands through the mount");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    // The default is sv-rw: a plain mount shows its files.
    assert_eq!(std::fs::read_to_string(k.dir.join("f1")).unwrap(), "changed in the snapshot");
    assert_eq!(std::fs::read_to_string(k.dir.join("f7")).unwrap(), "7".repeat(8));
    let list = run(Command::new("btrfs").args(["subvolume", "list", "-r"]).arg(&k.dir));
    assert!(
        list.lines().any(|l| l.ends_with("path sv-ro")) && !list.contains("path sv\n"),
        "{list}"
    );
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

/// statfs through the mount agrees with the kernel's statfs of the same image (the
/// numbers `df` shows), within the global reserve's difference.
#[test]
fn statfs_agrees_with_the_kernel() {
    if !fuse_available("statfs_agrees_with_the_kernel") {
        return;
    }
    let s = scratch("statfs");
    let img = s.join("img");
    mkfs(&img, "2G");
    let m = FuseMount::start(&img, &s.join("mnt"), "");
    for i in 0..8u64 {
        std::fs::write(s.join("mnt").join(format!("f{i}")), data(i, 20 << 20)).unwrap();
    }
    run(Command::new("sync").arg("-f").arg(s.join("mnt")));
    let ours = statvfs(&s.join("mnt"));
    m.stop(Stop::Sigterm);
    let k = KernelMount::new(&img, &s.join("kmnt"));
    let theirs = statvfs(&k.dir);
    drop(k);
    assert_eq!(ours.0, theirs.0, "block size");
    assert_eq!(ours.1, theirs.1, "total blocks");
    let slack = (32u64 << 20) / ours.0;
    for (what, a, b) in [("free", ours.2, theirs.2), ("available", ours.3, theirs.3)] {
        assert!(
            a.abs_diff(b) <= slack,
            "{what} blocks: ours {a}, the kernel's {b} (allowed {slack} apart)"
        );
    }
    assert_eq!(ours.4, 255, "name length");
    let _ = std::fs::remove_dir_all(&s);
}

/// (bsize, blocks, bfree, bavail, namemax).
fn statvfs(p: &Path) -> (u64, u64, u64, u64, u64) {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    // SAFETY: zeroed statvfs is valid output space.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is NUL-terminated, st valid.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    (st.f_frsize, st.f_blocks, st.f_bfree, st.f_bavail, st.f_namemax)
}

/// `--daemon` and the `mount.fuse.ubtrfs` helper return once the mount is ready and
/// serve it in the background until unmounted; the helper takes mount(8)'s argument
/// order and `-o`.
#[test]
fn daemon_and_mount_helper() {
    if !fuse_available("daemon_and_mount_helper") {
        return;
    }
    let s = scratch("daemon");
    let img = s.join("img");
    mkfs(&img, "300M");
    let mnt = s.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    run(bin().args(["mount", "--daemon", "-o", "commit=2"]).arg(&img).arg(&mnt));
    assert!(is_mountpoint(&mnt), "--daemon returned with the mount ready");
    std::fs::write(mnt.join("via-daemon"), b"d").unwrap();
    // The periodic commit puts it on disk while the mount runs.
    std::thread::sleep(Duration::from_secs(4));
    run(Command::new("fusermount3").arg("-u").arg(&mnt));
    wait_unlocked(&img);
    assert_eq!(run(bin().arg("cat").arg(&img).arg("/via-daemon")), "d");

    let helper = s.join(ubtrfs_helper_name());
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ubtrfs"), &helper).unwrap();
    run(Command::new(&helper).arg(&img).arg(&mnt).args(["-o", "rw,noatime,nodev,nosuid"]));
    assert!(is_mountpoint(&mnt));
    assert_eq!(std::fs::read(mnt.join("via-daemon")).unwrap(), b"d");
    std::fs::write(mnt.join("via-helper"), b"h").unwrap();
    run(Command::new("umount").arg(&mnt));
    wait_unlocked(&img);
    assert_eq!(run(bin().arg("cat").arg(&img).arg("/via-helper")), "h");
    assert_check(&img, "after the daemon and the helper");
    // A bad option: the helper fails with its name, and nothing is mounted.
    let err = fails(Command::new(&helper).arg(&img).arg(&mnt).args(["-o", "bogus"]));
    assert!(err.contains("\"bogus\"") && err.contains("unknown option"), "{err}");
    assert!(!is_mountpoint(&mnt));
    let _ = std::fs::remove_dir_all(&s);
}

fn ubtrfs_helper_name() -> &'static str {
    "mount.fuse.ubtrfs"
}

/// Wait until the daemon let the image go (its lock refuses `ubtrfs check` before).
fn wait_unlocked(img: &Path) {
    let t = Instant::now();
    loop {
        let out = bin().arg("check").arg(img).output().unwrap();
        if out.status.success() {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the daemon still holds {}: {}",
            img.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Bad input gets a clear error and mounts nothing: an unknown option, a second
/// writer of an image in use, an image that is not btrfs, a missing mount point.
#[test]
fn bad_input_is_refused_by_name() {
    if !fuse_available("bad_input_is_refused_by_name") {
        return;
    }
    let s = scratch("bad");
    let img = s.join("img");
    mkfs(&img, "300M");
    let mnt = s.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let err = fails(bin().args(["mount", "-o", "commit=0"]).arg(&img).arg(&mnt));
    assert!(err.contains("commit=0"), "{err}");
    let m = FuseMount::start(&img, &mnt, "");
    // (A second mount of it is a bind mount as root: mount_options.rs.)
    let err = fails(bin().args(["mkdir"]).arg(&img).arg("/x"));
    assert!(
        err.contains(&img.display().to_string()),
        "a second writer is refused naming the image: {err}"
    );
    m.stop(Stop::Sigterm);
    let junk = s.join("junk");
    std::fs::write(&junk, vec![0u8; 1 << 20]).unwrap();
    let err = fails(bin().arg("mount").arg(&junk).arg(&mnt));
    assert!(err.contains("junk"), "{err}");
    let err = fails(bin().arg("mount").arg(&img).arg(s.join("nowhere")));
    assert!(err.contains("nowhere"), "{err}");
    // A regular file is no mount point (FUSE took it, and every access was EIO).
    let file = s.join("file");
    std::fs::write(&file, b"x").unwrap();
    let err = fails(bin().arg("mount").arg(&img).arg(&file));
    assert!(err.contains("not a directory") && err.contains("file"), "{err}");
    assert!(!is_mountpoint(&file));
    assert_check(&img, "after the refusals");
    let _ = std::fs::remove_dir_all(&s);
}

/// A refused open leaves the file alone: opening a running executable with
/// O_TRUNC (even read-only) fails with ETXTBSY, the program keeps running, and its
/// bytes are all there, on the mount and in the kernel's view afterwards.
#[test]
fn refused_truncating_open_of_a_running_program_truncates_nothing() {
    if !fuse_available("refused_truncating_open_of_a_running_program_truncates_nothing") {
        return;
    }
    let s = scratch("etxtbsy");
    let img = s.join("img");
    mkfs(&img, "300M");
    let m = FuseMount::start(&img, &s.join("mnt"), "");
    let prog = s.join("mnt/sleep");
    let want = std::fs::read("/bin/sleep").unwrap();
    std::fs::write(&prog, &want).unwrap();
    std::fs::set_permissions(&prog, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut child =
        Command::new(&prog).arg("30").spawn().expect("run the copy of sleep on the mount");
    // Let it settle into its sleep, as a long-running program would be.
    std::thread::sleep(Duration::from_millis(300));
    for (what, flags) in [
        ("O_WRONLY", libc::O_WRONLY),
        ("O_RDWR", libc::O_RDWR),
        ("O_RDONLY|O_TRUNC", libc::O_RDONLY | libc::O_TRUNC),
        ("O_WRONLY|O_TRUNC", libc::O_WRONLY | libc::O_TRUNC),
    ] {
        let err = std::fs::OpenOptions::new()
            .read(flags & libc::O_ACCMODE != libc::O_WRONLY)
            .write(flags & libc::O_ACCMODE != libc::O_RDONLY)
            .custom_flags(flags & libc::O_TRUNC)
            .open(&prog)
            .map(|_| ())
            .expect_err(what);
        assert_eq!(
            err.raw_os_error(),
            Some(libc::ETXTBSY),
            "open({what}) of a running program: {err}"
        );
        assert_eq!(
            std::fs::metadata(&prog).unwrap().len(),
            want.len() as u64,
            "open({what}) was refused but changed the size"
        );
    }
    assert!(child.try_wait().unwrap().is_none(), "the program died under the refused opens");
    assert!(std::fs::read(&prog).unwrap() == want, "the program's bytes changed");
    child.kill().unwrap();
    child.wait().unwrap();
    m.stop(Stop::Sigterm);
    assert_check(&img, "after the refused opens");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    assert!(std::fs::read(k.dir.join("sleep")).unwrap() == want, "the kernel reads other bytes");
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

/// Every line of `wants` is in a script's output `out`: the script shows what it is
/// for, not only agreement with the kernel.
fn assert_shows(out: &str, wants: &[&str]) {
    for want in wants {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

/// `script` (bash, the directory as $1) run on a kernel mount of a fresh image and
/// then through `ubtrfs mount -o OPTS` of another: the scratch directory, the mount's
/// image (unmounted again), and the script's output on the mount and on the kernel.
/// A failing script fails the test, naming `what`.
fn same_script_on_both(
    tag: &str,
    what: &str,
    script: &str,
    opts: &str,
) -> (PathBuf, PathBuf, PathBuf, String, String) {
    let s = scratch(tag);
    std::fs::set_permissions(&s, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (kimg, uimg) = (s.join("k.img"), s.join("u.img"));
    mkfs(&kimg, "300M");
    mkfs(&uimg, "300M");
    let path = s.join(format!("{tag}.sh"));
    std::fs::write(&path, script).unwrap();
    let play = |dir: &Path| {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = Command::new("bash").arg(&path).arg(dir).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "the {what} script failed in {}: {text}{}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let k = KernelMount::new(&kimg, &s.join("kmnt"));
    let kernel = play(&k.dir);
    drop(k);
    let m = FuseMount::start(&uimg, &s.join("umnt"), opts);
    let ours = play(&s.join("umnt"));
    m.stop(Stop::Sigterm);
    (s, kimg, uimg, ours, kernel)
}

/// POSIX ACLs through the mount as the kernel keeps them: a directory's default ACL
/// is inherited by new files, directories and fifos (the umask ignored there, applied
/// elsewhere), chmod rewrites an access ACL, and the kernel enforces ACL entries for
/// other users. The same script on a kernel mount prints exactly the same.
#[test]
fn posix_acls_as_the_kernel_keeps_them() {
    if !fuse_available("posix_acls_as_the_kernel_keeps_them") {
        return;
    }
    const SCRIPT: &str = r#"set -e
cd "$1"
umask 022
mkdir d; setfacl -d -m u:daemon:rwx,g::r-x,o::--- d
mkdir d/sub; touch d/f; mknod d/p p; ln -s f d/l
mkdir e; touch e/f
touch g; setfacl -m u:daemon:rw g; chmod 640 g
touch h; setfacl -m u:daemon:rwx,m::r h; chmod 755 h
for x in d d/sub d/f d/p d/l e e/f g h; do echo "== $x $(stat -c %A $x)"; getfacl -p --omit-header $x; done
as_daemon() { setpriv --reuid=daemon --regid=daemon --clear-groups sh -c "$1" 2>/dev/null && echo "$2 ok" || echo "$2 denied"; }
as_daemon 'cat g' read-g
as_daemon 'touch d/f' write-d/f
as_daemon 'touch e/f' write-e/f
as_daemon 'touch d/sub/new' create-in-d/sub
"#;
    let (s, kimg, uimg, ours, kernel) = same_script_on_both("acl", "ACL", SCRIPT, "allow_other");
    assert_eq!(
        ours, kernel,
        "getfacl, modes and access through the mount differ from the kernel's"
    );
    // The script shows inheritance and enforcement, not only agreement.
    assert_shows(
        &ours,
        &[
            "== d/sub drwxrwx---",
            "default:user:daemon:rwx",
            "== d/f -rw-rw----",
            "== e/f -rw-r--r--",
            "read-g ok",
            "write-d/f ok",
            "write-e/f denied",
            "create-in-d/sub ok",
        ],
    );
    assert_check(&uimg, "after the ACL script");
    // What the mount stored reads the same in the kernel.
    let k = KernelMount::new(&uimg, &s.join("kmnt"));
    let facl = |p: &Path| {
        String::from_utf8_lossy(
            &Command::new("getfacl")
                .args(["-p", "-R", "--omit-header"])
                .arg(p)
                .current_dir(p)
                .output()
                .unwrap()
                .stdout,
        )
        .into_owned()
    };
    let in_kernel = facl(&k.dir);
    drop(k);
    let k = KernelMount::new(&kimg, &s.join("kmnt"));
    assert_eq!(
        in_kernel,
        facl(&k.dir),
        "the kernel reads other ACLs from the mount's image than from its own"
    );
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

/// The set-user-ID rules, which the mount owns (FUSE_HANDLE_KILLPRIV_V2): a write,
/// truncation or fallocate by a caller without CAP_FSETID takes set-user-ID, and
/// set-group-ID where the group may execute or the caller is outside the group; root's
/// writes keep them; any chown takes
/// them; file capabilities go at the first write after they are set. The same script on
/// a kernel mount prints the same modes and capabilities.
#[test]
fn set_user_id_bits_go_as_the_kernel_takes_them() {
    if !fuse_available("set_user_id_bits_go_as_the_kernel_takes_them") {
        return;
    }
    const SCRIPT: &str = r#"set -e
cd "$1"
as_daemon() { setpriv --reuid=daemon --regid=daemon --clear-groups sh -c "$1"; }
for f in w t a r c n; do printf 0123456789 > $f; done
chmod 6777 w t a r c; chmod 2767 n
as_daemon 'printf x >> w'
as_daemon 'truncate -s 4 t'
as_daemon 'fallocate -l 64K a'
printf x >> r
chown -h 0:0 c
as_daemon 'printf x >> n'
printf 0123 > cap; setcap cap_net_raw+ep cap; echo "cap before: $(getcap cap)"
printf y >> cap; echo "cap after write: $(getcap cap)"
setcap cap_net_raw+ep cap; printf y >> cap; echo "cap after a second setcap and write: $(getcap cap)"
for f in w t a r c n cap; do echo "$f $(stat -c '%a %s' $f) $(cksum < $f)"; done
"#;
    let (s, _, uimg, ours, kernel) =
        same_script_on_both("suid", "set-user-ID", SCRIPT, "allow_other,default_permissions");
    assert_eq!(ours, kernel, "modes or capabilities through the mount differ from the kernel's");
    // The script shows the bits going, not only agreement.
    assert_shows(
        &ours,
        &[
            "\nw 777 11 ",
            "\nt 777 4 ",
            "\na 777 65536 ",
            "\nr 6777 11 ",
            "\nc 777 10 ",
            "\nn 767 11 ",
            "cap before: cap cap_net_raw=ep",
            "cap after write: \n",
        ],
    );
    assert_check(&uimg, "after the set-user-ID script");
    let _ = std::fs::remove_dir_all(&s);
}

/// st_blocks through the mount as the kernel counts it, before and after the data is
/// written back: writes past the end, into a hole inside the file, over data, into a
/// size grown by truncate and into preallocated space show the blocks writeback will
/// take at once. The same script on a kernel mount prints the same.
#[test]
fn st_blocks_counts_dirty_data_as_the_kernel_does() {
    if !fuse_available("st_blocks_counts_dirty_data_as_the_kernel_does") {
        return;
    }
    const SCRIPT: &str = r#"set -e
cd "$1"
w() { dd if=/dev/urandom of=a bs="$2" count=1 seek="$1" oflag=seek_bytes conv=notrunc status=none; }
show() { echo "$1: $(stat -c '%s %b' a)"; }
w 0 64K; w 1114112 64K; show "head and tail"
sync a; show "written back"
w 298908 579; show "579 bytes into the hole"
w 409600 4096; show "a block into the hole"
w 8192 8192; show "over data"
sync a; show "written back"
truncate -s 2M a; w 1900000 10000; show "into the grown size"
fallocate -n -o 3M -l 256K a; show "preallocated past the end"
w 3145728 100000; show "into the preallocation"
w 3670016 4096; show "past it"
sync a; show "written back"
"#;
    let (s, _, uimg, ours, kernel) = same_script_on_both("blocks", "st_blocks", SCRIPT, "");
    assert_eq!(ours, kernel, "st_blocks through the mount differs from the kernel's");
    assert_shows(
        &ours,
        &[
            "head and tail: 1179648 256\n",
            "579 bytes into the hole: 1179648 272\n",
            "a block into the hole: 1179648 280\n",
            "into the grown size: 2097152 312\n",
            "into the preallocation: 3245728 824\n",
        ],
    );
    assert_check(&uimg, "after the st_blocks script");
    let _ = std::fs::remove_dir_all(&s);
}

/// A write the image has no room for fails at write(2) with ENOSPC, as on the
/// kernel's mount, not at the unmount's writeback: dd into a 300 MiB image stops at
/// about the size the kernel's does, and everything it wrote is on the image after
/// the unmount, which checks clean.
#[test]
fn a_full_image_refuses_the_write_as_the_kernel_does() {
    if !fuse_available("a_full_image_refuses_the_write_as_the_kernel_does") {
        return;
    }
    const SCRIPT: &str = r#"cd "$1"
# (the messages go to a pipe: the full filesystem has no room for a file of them)
{ dd if=/dev/zero of=big bs=1M count=400 status=none && echo "all of it fit"; } 2>&1 | grep -o "No space left on device" | sed 's/.*/ENOSPC/'
echo "size $(stat -c %s big)"
"#;
    let (s, _, uimg, ours, kernel) = same_script_on_both("full", "full image", SCRIPT, "");
    let size = |out: &str| -> u64 {
        out.lines()
            .find_map(|l| l.strip_prefix("size "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no size in {out:?}"))
    };
    assert!(kernel.contains("ENOSPC\n") && !kernel.contains("fit"), "the kernel's dd: {kernel}");
    assert!(ours.contains("ENOSPC\n") && !ours.contains("fit"), "our dd: {ours}");
    let (k, u) = (size(&kernel), size(&ours));
    assert!(u.abs_diff(k) <= 16 << 20, "dd stopped at {u} bytes here and at {k} on the kernel");
    assert_check(&uimg, "after the write that found no room");
    let m = KernelMount::new(&uimg, &s.join("kmnt"));
    let data = std::fs::read(m.dir.join("big")).unwrap();
    assert_eq!(data.len() as u64, u, "the kernel reads another size than dd wrote");
    assert!(data.iter().all(|&b| b == 0), "the admitted bytes differ on the image");
    drop(m);
    let _ = std::fs::remove_dir_all(&s);
}

/// Memory stays bounded by the options whatever is written: 1 GiB through a mount
/// with a 32 MiB page cache (8 MiB dirty) and a 32 MiB tree-block cache keeps the
/// daemon's peak RSS within those plus a fixed allowance, and every byte lands.
#[test]
fn memory_stays_bounded_under_a_large_write() {
    if !fuse_available("memory_stays_bounded_under_a_large_write") {
        return;
    }
    let s = scratch("rss");
    let img = s.join("img");
    mkfs(&img, "2G");
    let m = FuseMount::start(&img, &s.join("mnt"), "page_cache_mib=32,dirty_mib=8,cache_mib=32");
    let chunk = data(9, 1 << 20);
    let mut sha = Sha256::new();
    {
        let mut f = std::fs::File::create(s.join("mnt/big")).unwrap();
        for i in 0..1024u32 {
            let mut c = chunk.clone();
            c[..4].copy_from_slice(&i.to_le_bytes());
            f.write_all(&c).unwrap();
            sha.update(&c);
        }
        f.sync_all().unwrap();
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", m.pid())).unwrap();
    let hwm_kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    eprintln!("peak RSS of the mount after a 1 GiB write: {} MiB", hwm_kib >> 10);
    assert!(
        hwm_kib < (32 + 32 + 160) << 10,
        "peak RSS {} MiB past the caches (64 MiB) and the allowance",
        hwm_kib >> 10
    );
    m.stop(Stop::Sigterm);
    assert_check(&img, "after the large write");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    assert_eq!(
        sha_file(&k.dir.join("big")),
        format!("{:x}", sha.finalize()),
        "the kernel reads other bytes"
    );
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

/// A test tool installed with `cargo install NAME` (in PATH or ~/.cargo/bin); None,
/// after saying why, when it is missing outside CI.
fn cargo_tool(test: &str, name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    if let Some(h) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(h).join(".cargo/bin"));
    }
    if let Some(p) = dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file()) {
        return Some(p);
    }
    let why = format!("{test}: skipped: needs `{name}` (cargo install {name})");
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{why}, and CI=true forbids skipping");
    }
    eprintln!("{why}");
    None
}

const FSX_CONFIG: &str = "flen = 4194304
[opsize]
max = 262144
[weights]
close_open = 1
read = 10
write = 10
mapread = 5
mapwrite = 5
invalidate = 1
truncate = 3
fsync = 1
fdatasync = 1
posix_fallocate = 2
punch_hole = 2
sendfile = 1
posix_fadvise = 1
copy_file_range = 2
";

/// fsx (every operation it has: writes, reads, mmap, truncate, fallocate, punch,
/// copy_file_range, fsync) on four files at once through one mount, seeds 1 to 4 of
/// 20,000 operations each; then the kernel reads the same bytes the mount read.
/// A soak: `UBTRFS_FSX_OPS=1000000 cargo test -p ubtrfs --release --test mount fsx --
/// --nocapture` (`UBTRFS_FSX_SEEDS=A..B` for other seeds).
#[test]
fn fsx_through_the_mount() {
    if !fuse_available("fsx_through_the_mount") {
        return;
    }
    let Some(fsx) = cargo_tool("fsx_through_the_mount", "fsx") else { return };
    let ops: u64 =
        std::env::var("UBTRFS_FSX_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20_000);
    let seeds: Vec<u64> = match std::env::var("UBTRFS_FSX_SEEDS")
        .ok()
        .and_then(|v| v.split_once("..").map(|(a, b)| (a.parse().ok(), b.parse().ok())))
    {
        Some((Some(a), Some(b))) => (a..b).collect(),
        _ => (1..5).collect(),
    };
    let s = scratch("fsx");
    let img = s.join("img");
    mkfs(&img, "2G");
    std::fs::write(s.join("fsx.toml"), FSX_CONFIG).unwrap();
    let m = FuseMount::start(&img, &s.join("mnt"), "");
    let runs: Vec<(u64, Child)> = seeds
        .iter()
        .map(|&seed| {
            let art = s.join(format!("art{seed}"));
            std::fs::create_dir_all(&art).unwrap();
            let c = Command::new(&fsx)
                .arg("-f")
                .arg(s.join("fsx.toml"))
                .args(["-N", &ops.to_string(), "-S", &seed.to_string(), "-P"])
                .arg(&art)
                .arg(s.join("mnt").join(format!("fsx{seed}")))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn fsx");
            (seed, c)
        })
        .collect();
    for (seed, c) in runs {
        let out = c.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && text.contains("All operations completed A-OK!"),
            "fsx seed {seed} ({ops} operations) failed:\n{}",
            text.lines()
                .rev()
                .take(40)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    let shas: Vec<(u64, String)> = seeds
        .iter()
        .map(|&seed| (seed, sha_file(&s.join("mnt").join(format!("fsx{seed}")))))
        .collect();
    m.stop(Stop::Sigterm);
    assert_check(&img, "after fsx");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    for (seed, sha) in shas {
        assert_eq!(
            sha_file(&k.dir.join(format!("fsx{seed}"))),
            sha,
            "fsx seed {seed}: the kernel reads other bytes"
        );
    }
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

const PJDFSTEST_CONFIG: &str = "[features]
posix_fallocate = {}
rename_ctime = {}
utime_now = {}
utimensat = {}
[settings]
naptime = 0.001
allow_remount = false
[dummy_auth]
entries = [
  [\"nobody\", \"nogroup\"],
  [\"daemon\", \"daemon\"],
]
";

/// pjdfstest's results: test name to ok / FAILED / skipped (a failure with the
/// message pjdfstest printed under it), and its summary line.
fn pjdfstest(tool: &Path, config: &Path, dir: &Path) -> (BTreeMap<String, String>, String) {
    let out = Command::new(tool)
        .arg("-c")
        .arg(config)
        .arg("-p")
        .arg(dir)
        .output()
        .expect("run pjdfstest");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let mut res = BTreeMap::new();
    let mut failing: Option<String> = None;
    for l in text.lines() {
        let w: Vec<&str> = l.split_whitespace().collect();
        if w.len() >= 2
            && w[0].contains("::")
            && matches!(w[w.len() - 1], "ok" | "FAILED" | "skipped")
        {
            res.insert(w[0].to_string(), w[w.len() - 1].to_string());
            failing = (w[w.len() - 1] == "FAILED").then(|| w[0].to_string());
        } else if l.starts_with("Backtrace") {
            failing = None;
        } else if let Some(t) = &failing {
            let r = res.get_mut(t).expect("failing test recorded");
            r.push_str("\n    ");
            r.push_str(l.trim());
        }
    }
    let summary =
        text.lines().find(|l| l.starts_with("Summary:")).unwrap_or("no summary").to_string();
    assert!(res.len() > 300, "pjdfstest on {} ran {} tests: {text}", dir.display(), res.len());
    (res, summary)
}

/// pjdfstest on the mount (`-o allow_other,default_permissions`) and on a kernel
/// btrfs loop mount of the same size, in the same run: the mount passes at least as
/// many, and no test that passes on the kernel fails on the mount.
#[test]
fn pjdfstest_passes_what_the_kernel_passes() {
    if !fuse_available("pjdfstest_passes_what_the_kernel_passes") {
        return;
    }
    let Some(tool) = cargo_tool("pjdfstest_passes_what_the_kernel_passes", "pjdfstest") else {
        return;
    };
    let s = scratch("pjdfstest");
    // pjdfstest switches to these users: the scratch tree must be theirs to walk.
    std::fs::set_permissions(&s, std::fs::Permissions::from_mode(0o755)).unwrap();
    let conf = s.join("pjdfstest.toml");
    std::fs::write(&conf, PJDFSTEST_CONFIG).unwrap();
    let (kimg, uimg) = (s.join("k.img"), s.join("u.img"));
    mkfs(&kimg, "1G");
    mkfs(&uimg, "1G");
    let k = KernelMount::new(&kimg, &s.join("kmnt"));
    let (kernel, ksum) = pjdfstest(&tool, &conf, &k.dir);
    drop(k);
    let m = FuseMount::start(&uimg, &s.join("umnt"), "allow_other,default_permissions");
    let (ours, usum) = pjdfstest(&tool, &conf, &s.join("umnt"));
    let err = m.stop(Stop::Sigterm);
    assert!(!err.contains("error"), "the mount reported errors: {err}");
    eprintln!("pjdfstest: kernel btrfs: {ksum}\npjdfstest: ubtrfs mount: {usum}");
    let passed = |r: &BTreeMap<String, String>| r.values().filter(|v| *v == "ok").count();
    let regressions: Vec<String> = kernel
        .iter()
        .filter(|(t, v)| *v == "ok" && ours.get(*t).map(String::as_str) != Some("ok"))
        .map(|(t, _)| format!("{t}: {}", ours.get(t).map_or("not run", String::as_str)))
        .collect();
    assert!(
        regressions.is_empty(),
        "tests the kernel passes and the mount does not:\n{}",
        regressions.join("\n")
    );
    assert!(
        passed(&ours) >= passed(&kernel),
        "the mount passes {} tests, the kernel {}",
        passed(&ours),
        passed(&kernel)
    );
    assert_check(&uimg, "after pjdfstest");
    let _ = std::fs::remove_dir_all(&s);
}

/// fio jobs with `--verify=crc32c` through the mount: sequential, random, mixed
/// read/write, and four jobs at once; every block read back matches what was
/// written, and so does the kernel's view after unmount.
#[test]
fn fio_verify_jobs() {
    if !fuse_available("fio_verify_jobs") {
        return;
    }
    let Some(fio) =
        ["/usr/bin/fio", "/usr/local/bin/fio"].iter().map(PathBuf::from).find(|p| p.is_file())
    else {
        let why = "fio_verify_jobs: skipped: needs fio (apt-get install fio)";
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{why}, and CI=true forbids skipping"
        );
        eprintln!("{why}");
        return;
    };
    let s = scratch("fio");
    let img = s.join("img");
    mkfs(&img, "2G");
    let mnt = s.join("mnt");
    let m = FuseMount::start(&img, &mnt, "");
    let jobs: [(&str, &[&str]); 4] = [
        ("seq", &["--rw=write", "--bs=1M", "--size=96M"]),
        ("rand", &["--rw=randwrite", "--bs=4k", "--size=16M"]),
        ("mixed", &["--rw=randrw", "--bs=64k", "--size=32M", "--rwmixread=40"]),
        ("parallel", &["--rw=randwrite", "--bs=16k", "--size=12M", "--numjobs=4"]),
    ];
    for (name, args) in jobs {
        let out = Command::new(&fio)
            .args(["--name", name, "--directory"])
            .arg(&mnt)
            .args(args)
            .args([
                "--verify=crc32c",
                "--do_verify=1",
                "--verify_fatal=1",
                "--verify_state_save=0",
                "--end_fsync=1",
                "--ioengine=psync",
                "--group_reporting",
            ])
            // fio leaves nothing in the working directory (its state files would).
            .current_dir(&s)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success() && !text.contains("verify: bad"),
            "fio {name} failed:\n{text}"
        );
        let errs: Vec<&str> =
            text.lines().filter(|l| l.contains("err=") && !l.contains("err= 0")).collect();
        assert!(
            text.contains("err= 0") && errs.is_empty(),
            "fio {name} reported errors: {errs:?}\n{text}"
        );
    }
    let fuse = walk(&mnt);
    m.stop(Stop::Sigterm);
    assert_check(&img, "after the fio jobs");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    let kernel = walk(&k.dir);
    drop(k);
    assert_same_tree(&fuse, &kernel, "fio");
    let _ = std::fs::remove_dir_all(&s);
}

/// `-o ro` reads what the kernel wrote, refuses every change with EROFS, and leaves
/// the image's bytes as they were, also when the image file cannot be opened for
/// writing at all (immutable).
#[test]
fn read_only_mount_changes_nothing() {
    if !fuse_available("read_only_mount_changes_nothing") {
        return;
    }
    let s = scratch("ro");
    let img = s.join("img");
    mkfs(&img, "512M");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    workload(&k.dir);
    // A file unlinked while open would leave an orphan; a kernel unmount cleans it,
    // so the image holds plain files here.
    let kernel = walk(&k.dir);
    drop(k);
    let before = sha_file(&img);
    run(Command::new("chattr").arg("+i").arg(&img));
    let m = FuseMount::start(&img, &s.join("mnt"), "ro");
    let mnt = s.join("mnt");
    let fuse = walk(&mnt);
    for (what, r) in [
        ("create", std::fs::write(mnt.join("new"), b"x").map(|_| ())),
        ("mkdir", std::fs::create_dir(mnt.join("newdir"))),
        ("unlink", std::fs::remove_file(mnt.join("dir/small"))),
        ("truncate", std::fs::OpenOptions::new().write(true).open(mnt.join("dir/big")).map(|_| ())),
    ] {
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::EROFS), "{what} on a read-only mount");
    }
    let err = m.stop(Stop::Fusermount);
    // Reads, closes and forgets of a read-only mount report nothing (no eviction is
    // tried: there is nothing to write, and nothing may be written).
    assert!(
        !err.to_lowercase().contains("error") && !err.contains("read-only"),
        "the read-only mount reported: {err}"
    );
    run(Command::new("chattr").arg("-i").arg(&img));
    assert_eq!(sha_file(&img), before, "a read-only mount changed the image");
    // The kernel's view and ours agree; atimes are not compared (ro moves none).
    assert_same_tree(&fuse, &kernel, "read-only mount");
    let _ = std::fs::remove_dir_all(&s);
}

/// Readers of other files keep streaming while a large write and its fsync (a commit)
/// run: reads that reach the engine (O_DIRECT, so the kernel's page cache does not
/// answer them) go on during the fsync, and none stalls for long. Prints both sides:
/// the fsync's duration and the readers' longest wait and throughput meanwhile.
#[test]
fn readers_stream_through_a_large_write_and_commit() {
    if !fuse_available("readers_stream_through_a_large_write_and_commit") {
        return;
    }
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let s = scratch("stall");
    let img = s.join("img");
    mkfs(&img, "3G");
    let mnt = s.join("mnt");
    let m = FuseMount::start(&img, &mnt, "commit=300");
    for i in 0..2 {
        std::fs::write(mnt.join(format!("r{i}")), data(i, 32 << 20)).unwrap();
    }
    run(Command::new("sync").arg("-f").arg(&mnt));
    let stop = Arc::new(AtomicBool::new(false));
    // (time of each read's end, its latency) per reader.
    let log: Arc<Mutex<Vec<(Instant, Duration)>>> = Arc::default();
    let bytes = Arc::new(AtomicU64::new(0));
    let readers: Vec<_> = (0..2)
        .map(|i| {
            let (stop, log, bytes, p) =
                (stop.clone(), log.clone(), bytes.clone(), mnt.join(format!("r{i}")));
            std::thread::spawn(move || {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&p)
                    .unwrap();
                let mut buf = AlignedBuf::new(1 << 20);
                let mut off = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let n = std::os::unix::fs::FileExt::read_at(&f, buf.as_mut(), off).unwrap();
                    log.lock().unwrap().push((Instant::now(), t.elapsed()));
                    bytes.fetch_add(n as u64, Ordering::Relaxed);
                    off = if n == 0 { 0 } else { off + n as u64 };
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    {
        let mut f = std::fs::File::create(mnt.join("big")).unwrap();
        let chunk = data(9, 4 << 20);
        for _ in 0..64 {
            f.write_all(&chunk).unwrap();
        }
        let t_sync = Instant::now();
        f.sync_all().unwrap();
        let (sync_start, sync_end) = (t_sync, Instant::now());
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            r.join().unwrap();
        }
        let log = log.lock().unwrap();
        let during: Vec<Duration> = log
            .iter()
            .filter(|(end, lat)| *end >= sync_start && *end - *lat <= sync_end)
            .map(|(_, l)| *l)
            .collect();
        let worst =
            log.iter().filter(|(end, _)| *end >= t0).map(|(_, l)| *l).max().unwrap_or_default();
        let fsync = sync_end - sync_start;
        eprintln!(
            "stall: 256 MiB write {:?}, fsync {fsync:?}; readers: {} reads during the fsync, longest wait {worst:?}, {} MiB read in all",
            sync_start - t0,
            during.len(),
            bytes.load(Ordering::Relaxed) >> 20
        );
        assert!(
            !during.is_empty() || fsync < Duration::from_millis(50),
            "no read finished during a {fsync:?} fsync"
        );
        let bound = Duration::from_millis(500).max(fsync / 2);
        assert!(worst < bound, "a reader waited {worst:?} (fsync {fsync:?}, bound {bound:?})");
    }
    m.stop(Stop::Sigterm);
    assert_check(&img, "after the stall test");
    let _ = std::fs::remove_dir_all(&s);
}

/// A buffer aligned for O_DIRECT.
struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        AlignedBuf { ptr, len }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr holds len initialised bytes, owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr,
                std::alloc::Layout::from_size_align(self.len, 4096).unwrap(),
            )
        };
    }
}

// SAFETY: the buffer is plain bytes owned by one thread at a time.
unsafe impl Send for AlignedBuf {}

/// Subvolume placeholders through the mount, on the kernel's image of snapshots that
/// hold nested subvolumes (`xtask/nested_snapshot.sh`): each is an empty, read-only
/// directory of its own (two in one snapshot do not share a FUSE node), nothing below
/// it exists or can be made, and `rm -rf` of it removes only the entry, never the real
/// subvolume's files (it removed them before).
#[test]
fn subvolume_placeholders_through_the_mount() {
    if !fuse_available("subvolume_placeholders_through_the_mount") {
        return;
    }
    let s = scratch("placeholders");
    let img = s.join("img");
    run(Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../xtask/nested_snapshot.sh"))
        .arg(&img));
    let mnt = s.join("mnt");
    let m = FuseMount::start(&img, &mnt, "");
    let (sv, home) = (
        std::fs::metadata(mnt.join("snap/sv")).unwrap(),
        std::fs::metadata(mnt.join("snap/home")).unwrap(),
    );
    for (md, what) in [(&sv, "snap/sv"), (&home, "snap/home")] {
        assert!(md.is_dir(), "{what}");
        assert_eq!((md.mode(), md.nlink(), md.size(), md.uid()), (0o40755, 1, 0, 0), "{what}");
        assert_eq!(std::fs::read_dir(mnt.join(what)).unwrap().count(), 0, "{what} is not empty");
    }
    assert_ne!(sv.ino(), home.ino(), "two placeholders share a node");
    let errno = |r: std::io::Result<()>| r.expect_err("refused").raw_os_error();
    assert_eq!(errno(std::fs::read(mnt.join("snap/sv/f")).map(drop)), Some(libc::ENOENT));
    assert_eq!(errno(std::fs::write(mnt.join("snap/sv/new"), b"x")), Some(libc::EACCES));
    assert_eq!(errno(std::fs::create_dir(mnt.join("snap/sv/d"))), Some(libc::EPERM));
    assert_eq!(
        errno(std::fs::rename(mnt.join("snap/sv"), mnt.join("snap/sv2"))),
        Some(libc::ENOTEMPTY)
    );
    // Still writable after the refusals.
    std::fs::write(mnt.join("snap/after"), b"after").unwrap();
    run(Command::new("rm").arg("-rf").arg(mnt.join("snap/sv")).arg(mnt.join("svsnap/inner")));
    assert!(!mnt.join("snap/sv").exists() && !mnt.join("svsnap/inner").exists());
    assert_eq!(std::fs::read(mnt.join("sv/f")).unwrap(), b"in-sv\n");
    assert_eq!(std::fs::read(mnt.join("sv/inner/g")).unwrap(), b"in-inner\n");
    m.stop(Stop::Fusermount);
    assert_check(&img, "after rm -rf of placeholders through the mount");
    // extract copies placeholders as empty directories, with no loss reported (four
    // of them in one read-only snapshot).
    let out = s.join("out");
    let o = bin().arg("extract").arg(&img).arg(&out).output().unwrap();
    assert!(o.status.success(), "extract: {}", String::from_utf8_lossy(&o.stderr));
    for p in ["snap-ro/sv", "snap-ro/home", "snap-ro/snap", "snap-ro/svsnap", "snap/home"] {
        assert_eq!(
            std::fs::read_dir(out.join(p)).unwrap_or_else(|e| panic!("{p}: {e}")).count(),
            0,
            "{p}"
        );
    }
    assert_eq!(std::fs::read(out.join("sv/inner/g")).unwrap(), b"in-inner\n");
    let k = KernelMount::new(&img, &s.join("kmnt"));
    let names = |d: &str| {
        let mut v: Vec<String> = std::fs::read_dir(k.dir.join(d))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names("snap"), ["after", "home", "topfile"]);
    assert_eq!(names("svsnap"), ["d", "f"]);
    assert_eq!(std::fs::read(k.dir.join("sv/f")).unwrap(), b"in-sv\n");
    assert_eq!(std::fs::read(k.dir.join("sv/inner/g")).unwrap(), b"in-inner\n");
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

/// SEEK_DATA and SEEK_HOLE at a negative offset seek from 0, as the kernel's btrfs
/// does (they were EINVAL through the mount).
#[test]
fn seek_at_a_negative_offset_seeks_from_zero() {
    if !fuse_available("seek_at_a_negative_offset_seeks_from_zero") {
        return;
    }
    let s = scratch("seekneg");
    let img = s.join("img");
    mkfs(&img, "300M");
    let seek = |dir: &Path| -> Vec<i64> {
        std::fs::write(dir.join("f"), b"data").unwrap();
        let f = std::fs::File::open(dir.join("f")).unwrap();
        [libc::SEEK_DATA, libc::SEEK_HOLE]
            .iter()
            .map(|&w| {
                // SAFETY: lseek on an open descriptor.
                let r = unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&f), -1, w) };
                if r < 0 {
                    -i64::from(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
                } else {
                    r
                }
            })
            .collect()
    };
    let k = KernelMount::new(&img, &s.join("kmnt"));
    let kernel = seek(&k.dir);
    drop(k);
    let m = FuseMount::start(&img, &s.join("umnt"), "");
    let ours = seek(&s.join("umnt"));
    m.stop(Stop::Fusermount);
    // Data at 0, the hole at EOF (the position, or minus the errno).
    assert_eq!(kernel, [0, 4]);
    assert_eq!(ours, kernel);
    let _ = std::fs::remove_dir_all(&s);
}

/// What the daemon changes on its own shows in the very next `stat`, as on the
/// kernel: the set-user-ID bits a buffered or direct write, fallocate, punch-hole,
/// zero-range and copy_file_range by a caller without CAP_FSETID take (fstests
/// generic/683-685's modes: set-group-ID with and without group execute); the ctime of `chattr`; the set-group-ID bit a
/// `setfacl` by the owner outside the file's group takes (as chmod does); the atime a
/// read or a listing moves (relatime). Each `stat`
/// follows its operation at once, well inside the attribute timeout, so a cached
/// attribute the kernel was not told about shows as a difference.
#[test]
fn attributes_the_daemon_changes_show_at_once() {
    if !fuse_available("attributes_the_daemon_changes_show_at_once") {
        return;
    }
    const SCRIPT: &str = r#"set -e
cd "$1"
as_daemon() { setpriv --reuid=daemon --regid=daemon --clear-groups "$@"; }
mkdir j; chmod a+rw j
for op in "falloc 64k 64k" "fpunch 64k 64k" "fzero 64k 64k" "pwrite -q 64k 4k" "-d pwrite -q 64k 4k" "copy_range -s 0 -d 64k -l 4k src"; do
  for m in a+rws g+x,a+rws a+rw,g+rwxs a+rw,g+rws; do
    rm -f j/a; xfs_io -f -c "pwrite -q -S 0x58 0 192k" j/a j/src; chmod 666 j/src; chmod 0 j/a; chmod $m j/a; before=$(stat -c %a j/a)
    case "$op" in -d*) as_daemon xfs_io -d -c "${op#-d }" j/a;; copy*) (cd j && as_daemon xfs_io -c "$op" a);; *) as_daemon xfs_io -c "$op" j/a;; esac
    echo "$op on $m: $before -> $(stat -c '%a %A' j/a)"
  done
done
echo data > o; chmod 644 o; chown daemon:daemon o
for x in "" u+x "g+x,u-x" u+x; do chmod ug+s o; [ -n "$x" ] && chmod $x o; b=$(stat -c %A o); as_daemon xfs_io -d -c "pwrite -q 0 4k" o; echo "owner's direct write: $b -> $(stat -c %A o)"; done
touch c; before=$(stat -c %z c); sleep 0.05; chattr +a c; after=$(stat -c %z c)
[ "$before" != "$after" ] && echo "chattr moved ctime" || echo "chattr left ctime"
chattr -a c; c2=$(stat -c %z c); [ "$after" != "$c2" ] && echo "chattr -a moved ctime" || echo "chattr -a left ctime"
touch g; chown daemon:root g; chmod 2755 g; stat -c "g %a" g
as_daemon setfacl -m u::rwx,g::rwx,o::rwx g; stat -c "g after setfacl outside the group: %a" g
as_daemon chmod 2777 g; stat -c "g after chmod outside the group: %a" g
touch e; touch -d 2000-01-01 e; : > e
[ "$(stat -c %Y e)" -gt 946771200 ] && echo "open(O_TRUNC) of an empty file moved mtime" || echo "open(O_TRUNC) of an empty file left mtime"
printf abcd > t; touch -d 2000-01-01 t; python3 -c 'import os; os.truncate("t", 4)'
[ "$(stat -c %Y t)" -gt 946771200 ] && echo "truncate(2) to its size moved mtime" || echo "truncate(2) to its size left mtime"
python3 -c 'import os; os.truncate("e", 0)'; stat -c "truncate(2) of an empty file: %s" e
printf data > r; touch -d 2000-01-01 r; cat r > /dev/null
[ "$(stat -c %X r)" -gt 946771200 ] && echo "a read moved atime" || echo "a read left atime"
mkdir dr; touch -d 2000-01-01 dr; ls dr > /dev/null
[ "$(stat -c %X dr)" -gt 946771200 ] && echo "a listing moved atime" || echo "a listing left atime"
"#;
    let (s, _, uimg, ours, kernel) = same_script_on_both(
        "attrs",
        "daemon-made attribute",
        SCRIPT,
        "allow_other,default_permissions",
    );
    assert_eq!(ours, kernel, "stat after a daemon-made change differs from the kernel's");
    assert_shows(
        &ours,
        &[
            "falloc 64k 64k on a+rws: 6666 -> 666 ",
            "fpunch 64k 64k on g+x,a+rws: 6676 -> 676 ",
            "fzero 64k 64k on a+rw,g+rws: 2666 -> 666 ",
            "-d pwrite -q 64k 4k on a+rws: 6666 -> 666 ",
            "pwrite -q 64k 4k on a+rw,g+rws: 2666 -> 666 ",
            "copy_range -s 0 -d 64k -l 4k src on a+rws: 6666 -> 666 ",
            "owner's direct write: -rwSr-Sr-- -> -rw-r-Sr--",
            "owner's direct write: -rwSr-sr-- -> -rw-r-xr--",
            "chattr moved ctime",
            "chattr -a moved ctime",
            "g after setfacl outside the group: 777",
            "g after chmod outside the group: 777",
            "a read moved atime",
            "open(O_TRUNC) of an empty file moved mtime",
            "truncate(2) to its size left mtime",
            "a listing moved atime",
        ],
    );
    assert_check(&uimg, "after the attribute script");
    let _ = std::fs::remove_dir_all(&s);
}

/// The XFS-style attribute ioctls (FS_IOC_FSGETXATTR, FS_IOC_FSSETXATTR, which
/// `xfs_io chattr` and `lsattr` of xfs_io use) as on the kernel's btrfs: the common
/// flags (immutable, append, sync, nodump, noatime) set and clear, the flags they
/// cannot say stay, and what btrfs does not keep (filestream, DAX, project inherit, an
/// extent size) is EOPNOTSUPP. Before, FSSETXATTR was EOPNOTSUPP for everything and
/// FSGETXATTR showed nodump as noatime.
#[test]
fn fsxattr_ioctls_as_on_the_kernel() {
    if !fuse_available("fsxattr_ioctls_as_on_the_kernel") {
        return;
    }
    const SCRIPT: &str = r#"set -e
cd "$1"
touch z; chattr +C z
for f in +a -a +i -i +d +S +A -d -S -A +e +x +s -s; do
  out=$(xfs_io -r -c "chattr $f" z 2>&1) && rc=0 || rc=$?
  echo "$f rc=$rc ${out#*: } $(lsattr z | cut -c1-22) $(xfs_io -r -c lsattr z | cut -c1-17)"
done
mkdir dd; out=$(xfs_io -r -c "chattr +P" dd 2>&1) || true; echo "dir +P ${out#*: } $(xfs_io -r -c lsattr dd | cut -c1-17)"
"#;
    let (s, _, uimg, ours, kernel) = same_script_on_both("fsxattr", "fsxattr", SCRIPT, "");
    assert_eq!(ours, kernel, "xfs_io chattr/lsattr through the mount differ from the kernel's");
    assert_shows(
        &ours,
        &[
            "+a rc=0  -----a---------C------ ---a-------------",
            "+d rc=0  ------d--------C------ ------d----------",
            "+x rc=1 cannot set flags on z: Operation not supported",
        ],
    );
    assert_check(&uimg, "after xfs_io chattr");
    let _ = std::fs::remove_dir_all(&s);
}
