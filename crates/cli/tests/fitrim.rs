//! FITRIM (`fstrim`) on a `ubtrfs mount`, side by side with the kernel's btrfs on a
//! loop mount of the same scenario: the image file gives the freed space back to the
//! host as the kernel's discards do, every file still reads its bytes, the image
//! checks clean and the kernel reads it; the numbers FITRIM returns and its errors
//! are the kernel's.
//!
//! Measured on the kernel (6.18, loop device over an image file, `-o nodiscard` so
//! that only FITRIM discards), on a fresh 1 GiB `mkfs.btrfs` image:
//! - `fstrim` reports 1072267264 bytes the first time (block-group free space, DUP
//!   metadata counted twice, plus the unallocated device space from 1 MiB on) and
//!   132087808 every later time (the unallocated space is remembered as trimmed
//!   until the next mount);
//! - EINVAL for len 0, 100 or 4095, for start 2^64-1 (with any len) and for start +
//!   len past 2^64; start 2^63-1 or 2^47 with any len succeeds with 0 bytes; a len
//!   of 2^64-1 runs to the end from any start; minlen comes back raised to the
//!   device's discard granularity (4096), and the unallocated device space is
//!   trimmed whatever the range and minlen;
//! - EPERM for a caller without CAP_SYS_ADMIN, before the argument is looked at;
//! - a filesystem mounted `ro` answers 0 bytes and discards nothing (one remounted
//!   read-only still trims, and so does ubtrfs's); EROFS only with
//!   `rescue=nologreplay`, which ubtrfs's mount does not take;
//! - EOPNOTSUPP when the device takes no discards (a loop device over a file on
//!   ramfs, which cannot punch holes).
//!
//! Needs root, /dev/fuse, fusermount3 and fstrim (the tests say why they skip without
//! them; under CI=true they must run).

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::{bin, pseudo_random as data, run, scratch_in};
use fuse::{assert_check, mkfs, FuseMount, KernelMount, Stop};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

const FITRIM: libc::c_ulong = 0xc018_5879;
const BTRFS_IOC_SYNC: libc::c_ulong = 0x9408;
const MIB: u64 = 1 << 20;

fn available(test: &str) -> bool {
    kernel::kernel_available_with(test, &["/dev/fuse", "/usr/bin/fusermount3", "/usr/sbin/fstrim"])
}

/// FITRIM on `dir`: the range as it comes back, or the errno.
fn fitrim(dir: &Path, start: u64, len: u64, minlen: u64) -> Result<[u64; 3], i32> {
    let f = std::fs::File::open(dir).unwrap_or_else(|e| panic!("open {}: {e}", dir.display()));
    let mut r = [start, len, minlen];
    // SAFETY: FITRIM reads and writes the 24 bytes of `r`, a struct fstrim_range.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), FITRIM, r.as_mut_ptr()) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    Ok(r)
}

/// Commit (the running transaction's frees come back to the free space).
fn sync_fs(dir: &Path) {
    let f = std::fs::File::open(dir).unwrap();
    // SAFETY: BTRFS_IOC_SYNC takes no argument.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), BTRFS_IOC_SYNC, 0) };
    assert_eq!(rc, 0, "BTRFS_IOC_SYNC on {}: {}", dir.display(), std::io::Error::last_os_error());
}

/// Bytes the host has allocated for `img`.
fn allocated(img: &Path) -> u64 {
    std::fs::metadata(img).unwrap().blocks() * 512
}

/// A kernel loop mount without the default async discard (only FITRIM discards),
/// with `opts` added (`",ro"`).
fn kernel_mount(img: &Path, dir: &Path, opts: &str) -> KernelMount {
    std::fs::create_dir_all(dir).unwrap();
    run(Command::new("mount").args(["-o", &format!("loop,nodiscard{opts}")]).arg(img).arg(dir));
    KernelMount { dir: dir.to_path_buf() }
}

fn fstrim_v(dir: &Path) -> u64 {
    let out = run(Command::new("fstrim").arg("-v").arg(dir));
    // "DIR: 1022.6 MiB (1072267264 bytes) trimmed"
    out.split('(')
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("fstrim -v said {out:?}"))
}

/// The scenario both sides run: files written and committed, half of them deleted
/// and committed. Returns the files kept and the bytes deleted.
fn write_and_delete(dir: &Path) -> (BTreeMap<String, Vec<u8>>, u64) {
    let mut kept = BTreeMap::new();
    let mut deleted = 0;
    for i in 0..8u64 {
        let body = data(i, (6 * MIB + i * 777_777) as usize);
        std::fs::write(dir.join(format!("f{i}")), &body).unwrap();
        kept.insert(format!("f{i}"), body);
    }
    sync_fs(dir);
    for i in (0..8).step_by(2) {
        let n = format!("f{i}");
        deleted += kept.remove(&n).unwrap().len() as u64;
        std::fs::remove_file(dir.join(&n)).unwrap();
    }
    settle(dir);
    (kept, deleted)
}

/// Commit until the free space stops changing. The kernel sends a FUSE RELEASE without
/// waiting for it, so a file closed just before its unlink may reach the daemon as
/// still open and be freed a moment later, at its RELEASE; its space is free for a
/// trim only after the commit that follows. (On the kernel's btrfs the first commit
/// settles it.)
fn settle(dir: &Path) {
    let free = || free_blocks(dir);
    let mut last = None;
    for _ in 0..50 {
        sync_fs(dir);
        let now = free();
        if last == Some(now) {
            return;
        }
        last = Some(now);
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("{}: the free space kept changing", dir.display());
}

/// Free blocks of the filesystem at `dir` (statvfs).
fn free_blocks(dir: &Path) -> u64 {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and a statvfs the call fills.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    assert_eq!(rc, 0, "statvfs {}: {}", dir.display(), std::io::Error::last_os_error());
    st.f_bfree
}

fn assert_files(dir: &Path, files: &BTreeMap<String, Vec<u8>>, what: &str) {
    for (n, body) in files {
        let got = std::fs::read(dir.join(n)).unwrap_or_else(|e| panic!("{what}: read {n}: {e}"));
        assert!(
            got == *body,
            "{what}: {n} reads {} bytes, not its {} bytes",
            got.len(),
            body.len()
        );
    }
}

struct Side {
    trimmed: u64,
    freed: u64,
    after: u64,
}

/// Write, delete, fstrim on one side; what the image gave back.
fn run_side(img: &Path, dir: &Path, ubtrfs: bool) -> (Side, BTreeMap<String, Vec<u8>>, u64) {
    mkfs(img, "1G");
    let (side, kept, deleted) = {
        let fm = ubtrfs.then(|| FuseMount::start(img, dir, ""));
        let km = (!ubtrfs).then(|| kernel_mount(img, dir, ""));
        let (kept, deleted) = write_and_delete(dir);
        let before = allocated(img);
        let trimmed = fstrim_v(dir);
        let after = allocated(img);
        assert_files(dir, &kept, "after fstrim");
        if let Some(m) = fm {
            m.stop(Stop::Umount);
        }
        drop(km);
        (Side { trimmed, freed: before.saturating_sub(after), after }, kept, deleted)
    };
    (side, kept, deleted)
}

#[test]
fn fstrim_gives_the_freed_space_back_as_the_kernel_does() {
    if !available("fstrim_gives_the_freed_space_back_as_the_kernel_does") {
        return;
    }
    let d = scratch_in("fitrim", "space");
    let (k, _, deleted) = run_side(&d.join("k.img"), &d.join("km"), false);
    let (u, kept, _) = run_side(&d.join("u.img"), &d.join("um"), true);
    // Kernel: the deleted files' bytes, and the rest of the never-written space,
    // come back to the host.
    for (who, s) in [("kernel", &k), ("ubtrfs", &u)] {
        assert!(
            s.freed >= deleted * 9 / 10,
            "{who}: the image gave back {} bytes after deleting {deleted}",
            s.freed
        );
        assert!(
            s.trimmed >= deleted,
            "{who}: fstrim reported {} bytes after deleting {deleted}",
            s.trimmed
        );
    }
    // Both images end with about what their files and trees take.
    assert!(
        u.after.abs_diff(k.after) <= 8 * MIB,
        "the ubtrfs image keeps {} bytes, the kernel's {}",
        u.after,
        k.after
    );
    // The kernel's count in that mount misses the data chunk the deletes emptied (its
    // cleaner is removing it, and a trim skips a group being removed while its device
    // space is still allocated): about 101 MiB less, measured. A fresh kernel mount of
    // its image trims what ubtrfs trimmed (all but about 64 KiB of tree blocks, which
    // the two lay out differently).
    let k_fresh = {
        let _m = kernel_mount(&d.join("k.img"), &d.join("km"), "");
        fstrim_v(&d.join("km"))
    };
    assert!(u.trimmed >= k.trimmed, "ubtrfs trimmed {} bytes, the kernel {}", u.trimmed, k.trimmed);
    assert!(
        u.trimmed.abs_diff(k_fresh) <= 8 * MIB,
        "ubtrfs trimmed {} bytes, the kernel {k_fresh} after a fresh mount",
        u.trimmed
    );
    let img = d.join("u.img");
    assert_check(&img, "after fstrim on the mount");
    {
        let _k = KernelMount::new(&img, &d.join("kread"));
        assert_files(&d.join("kread"), &kept, "the kernel reading the trimmed image");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// The FITRIM answers of a mount, in order, on a fresh image.
fn answers(dir: &Path) -> Vec<Result<[u64; 3], i32>> {
    let max = u64::MAX;
    let cases = [
        (0, max, 0),
        (0, max, 0),
        (0, 0, 0),
        (0, 100, 0),
        (0, 4095, 0),
        (0, 4096, 0),
        (max, MIB, 0),
        (max, max, 0),
        (max - 1, 2, 0),
        (max - 1, max, 0),
        (max >> 1, max >> 1, 0),
        (1 << 47, MIB, 0),
        (1 << 63, 1 << 63, 0),
        ((1 << 63) + 1, (1 << 63) - 1, 0),
        (1, max - 1, 0),
        (1, 4096, 0),
        (0, max, 1 << 30),
        (0, max, 1),
        (10 * MIB, max, 0),
    ];
    cases.iter().map(|&(s, l, m)| fitrim(dir, s, l, m)).collect()
}

#[test]
fn fitrim_answers_as_the_kernel_does() {
    if !available("fitrim_answers_as_the_kernel_does") {
        return;
    }
    let d = scratch_in("fitrim", "answers");
    let (ki, ui) = (d.join("k.img"), d.join("u.img"));
    mkfs(&ki, "1G");
    mkfs(&ui, "1G");
    let kernel = {
        let _m = kernel_mount(&ki, &d.join("km"), "");
        answers(&d.join("km"))
    };
    let ours = {
        let m = FuseMount::start(&ui, &d.join("um"), "");
        let a = answers(&d.join("um"));
        m.stop(Stop::Umount);
        a
    };
    assert_eq!(ours, kernel, "FITRIM answers differ (left: ubtrfs, right: the kernel)");
    assert_eq!(
        kernel[0].unwrap()[1],
        1_072_267_264,
        "the kernel's first full trim of a fresh 1 GiB image"
    );
    assert_check(&ui, "after the FITRIM calls");
    let _ = std::fs::remove_dir_all(&d);
}

/// `cmd` run as the unprivileged user 65534, its stderr.
fn as_nobody(cmd: &mut Command) -> String {
    use std::os::unix::process::CommandExt;
    // SAFETY: setgroups/setgid/setuid in the child before exec touch only its
    // credentials.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(65534) != 0
                || libc::setuid(65534) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "{cmd:?} succeeded as an unprivileged user");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn fitrim_needs_cap_sys_admin_trims_nothing_read_only_and_refuses_nologreplay() {
    if !available("fitrim_needs_cap_sys_admin_trims_nothing_read_only_and_refuses_nologreplay") {
        return;
    }
    let d = scratch_in("fitrim", "perm");
    let (ki, ui) = (d.join("k.img"), d.join("u.img"));
    for img in [&ki, &ui] {
        mkfs(img, "1G");
    }
    // Data written and deleted before, so the image has space to give back.
    let prepare = |img: &Path, dir: &Path, ubtrfs: bool| {
        let fm = ubtrfs.then(|| FuseMount::start(img, dir, ""));
        let km = (!ubtrfs).then(|| kernel_mount(img, dir, ""));
        write_and_delete(dir);
        if let Some(m) = fm {
            m.stop(Stop::Umount);
        }
        drop(km);
    };
    prepare(&ki, &d.join("km"), false);
    prepare(&ui, &d.join("um"), true);
    for (who, img, dir) in [("kernel", &ki, d.join("km")), ("ubtrfs", &ui, d.join("um"))] {
        // A caller without CAP_SYS_ADMIN, on a mount others may use.
        {
            let fm = (who == "ubtrfs").then(|| FuseMount::start(img, &dir, "allow_other"));
            let km = (who == "kernel").then(|| kernel_mount(img, &dir, ""));
            let before = allocated(img);
            let err = as_nobody(Command::new("fstrim").arg(&dir));
            assert!(
                err.contains("Operation not permitted"),
                "{who}: fstrim as nobody said {err:?}"
            );
            assert_eq!(allocated(img), before, "{who}: a refused FITRIM gave space back");
            if let Some(m) = fm {
                m.stop(Stop::Umount);
            }
            drop(km);
        }
        // Mounted read-only: 0 bytes, nothing discarded.
        {
            let fm = (who == "ubtrfs").then(|| FuseMount::start(img, &dir, "ro"));
            let km = (who == "kernel").then(|| kernel_mount(img, &dir, ",ro"));
            let before = allocated(img);
            let r = fitrim(&dir, 0, u64::MAX, 0);
            assert_eq!(r, Ok([0, 0, 4096]), "{who}: FITRIM on a read-only mount");
            assert_eq!(
                allocated(img),
                before,
                "{who}: FITRIM on a read-only mount gave space back"
            );
            if let Some(m) = fm {
                m.stop(Stop::Umount);
            }
            drop(km);
        }
        // rescue=nologreplay (norecovery): read-only only, and FITRIM is EROFS.
        {
            let refused = match who {
                "ubtrfs" => {
                    bin().args(["mount", "-o", "norecovery"]).arg(img).arg(&dir).output().unwrap()
                }
                _ => Command::new("mount")
                    .args(["-o", "loop,norecovery"])
                    .arg(img)
                    .arg(&dir)
                    .output()
                    .unwrap(),
            };
            assert!(!refused.status.success(), "{who}: a read-write norecovery mount was made");
            let fm =
                (who == "ubtrfs").then(|| FuseMount::start(img, &dir, "ro,rescue=nologreplay"));
            let km = (who == "kernel").then(|| kernel_mount(img, &dir, ",ro,rescue=nologreplay"));
            assert_eq!(
                fitrim(&dir, 0, u64::MAX, 0),
                Err(libc::EROFS),
                "{who}: FITRIM with rescue=nologreplay"
            );
            if let Some(m) = fm {
                m.stop(Stop::Umount);
            }
            drop(km);
        }
    }
    assert_check(&ui, "after the FITRIM calls");
    let _ = std::fs::remove_dir_all(&d);
}

/// A ramfs mounted at `dir` (it cannot punch holes: a loop device over one of its
/// files takes no discards), unmounted on drop.
struct Ramfs(PathBuf);

impl Drop for Ramfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn fitrim_is_not_supported_where_the_device_takes_no_discards() {
    if !available("fitrim_is_not_supported_where_the_device_takes_no_discards") {
        return;
    }
    let d = scratch_in("fitrim", "nodiscard");
    let rd = d.join("ramfs");
    std::fs::create_dir_all(&rd).unwrap();
    run(Command::new("mount").args(["-t", "ramfs", "none"]).arg(&rd));
    let _ramfs = Ramfs(rd.clone());
    let img = rd.join("r.img");
    mkfs(&img, "300M");
    let kernel = {
        let _m = KernelMount::new(&img, &d.join("km"));
        fitrim(&d.join("km"), 0, u64::MAX, 0)
    };
    let ours = {
        let m = FuseMount::start(&img, &d.join("um"), "");
        // EOPNOTSUPP comes before the argument is judged.
        let bad = fitrim(&d.join("um"), 0, 0, 0);
        let r = fitrim(&d.join("um"), 0, u64::MAX, 0);
        m.stop(Stop::Umount);
        assert_eq!(bad, Err(libc::EOPNOTSUPP));
        r
    };
    assert_eq!(kernel, Err(libc::EOPNOTSUPP), "the kernel on a loop device over ramfs");
    assert_eq!(ours, kernel);
    drop(_ramfs);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn fstrim_on_a_block_device_discards_through_it() {
    if !available("fstrim_on_a_block_device_discards_through_it") {
        return;
    }
    let d = scratch_in("fitrim", "blockdev");
    let img = d.join("l.img");
    mkfs(&img, "1G");
    // Stale bytes in space no chunk holds: the discard must reach the backing file.
    let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &data(5, 50 * MIB as usize), 500 * MIB).unwrap();
    drop(f);
    let loopdev = run(Command::new("losetup").args(["-f", "--show"]).arg(&img)).trim().to_string();
    let before = allocated(&img);
    let trimmed = {
        let m = FuseMount::start(Path::new(&loopdev), &d.join("um"), "");
        let a = fstrim_v(&d.join("um"));
        let b = fstrim_v(&d.join("um"));
        m.stop(Stop::Umount);
        (a, b)
    };
    let after = allocated(&img);
    let _ = Command::new("losetup").arg("-d").arg(&loopdev).status();
    // The kernel on the same fresh image: 1072267264, then 132087808.
    assert_eq!(trimmed, (1_072_267_264, 132_087_808), "fstrim through a loop device");
    assert!(before - after >= 50 * MIB, "the backing file went from {before} to {after} bytes");
    assert_check(&img, "after fstrim through a loop device");
    let _ = std::fs::remove_dir_all(&d);
}

/// Random writes, overwrites, deletes and snapshots on the mount, with FITRIM of
/// random ranges between them and commits now and then: every file still reads what
/// the model says, through the mount and through the kernel afterwards, and the image
/// checks clean (a trim of allocated space would show as wrong bytes or csum errors).
#[test]
fn random_work_with_trims_keeps_every_byte() {
    if !available("random_work_with_trims_keeps_every_byte") {
        return;
    }
    let d = scratch_in("fitrim", "random");
    let img = d.join("u.img");
    let dir = d.join("um");
    mkfs(&img, "512M");
    let mut model: BTreeMap<PathBuf, Vec<u8>> = BTreeMap::new();
    let mut x: u64 = 0x5eed_f17e;
    let mut rnd = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n.max(1)
    };
    let m = FuseMount::start(&img, &dir, "");
    let mut snaps = 0;
    let mut trims = 0u64;
    for step in 0..160u64 {
        let names: Vec<PathBuf> =
            model.keys().filter(|p| p.parent() == Some(Path::new(""))).cloned().collect();
        match rnd(10) {
            0..=3 => {
                let p = PathBuf::from(format!("f{}", rnd(40)));
                let body = data(step, rnd(3 * MIB) as usize + 1);
                std::fs::write(dir.join(&p), &body).unwrap();
                model.insert(p, body);
            }
            4 if !names.is_empty() => {
                let p = &names[rnd(names.len() as u64) as usize];
                let body = model.get_mut(p).unwrap();
                let at = rnd(body.len() as u64) as usize;
                let patch = data(step + 1000, rnd(256 * 1024) as usize + 1);
                let f = std::fs::OpenOptions::new().write(true).open(dir.join(p)).unwrap();
                std::os::unix::fs::FileExt::write_all_at(&f, &patch, at as u64).unwrap();
                if body.len() < at + patch.len() {
                    body.resize(at + patch.len(), 0);
                }
                body[at..at + patch.len()].copy_from_slice(&patch);
            }
            5 | 6 if !names.is_empty() => {
                let p = names[rnd(names.len() as u64) as usize].clone();
                std::fs::remove_file(dir.join(&p)).unwrap();
                model.remove(&p);
            }
            7 if snaps < 4 => {
                // A snapshot of the top: it shares every extent the top has now.
                let s = format!("s{snaps}");
                run(bin().args(["subvolume", "snapshot"]).arg(&dir).arg("/").arg(format!("/{s}")));
                for (p, b) in
                    model.clone().into_iter().filter(|(p, _)| p.parent() == Some(Path::new("")))
                {
                    model.insert(Path::new(&s).join(p), b);
                }
                snaps += 1;
            }
            8 => sync_fs(&dir),
            _ => {
                let start = if rnd(3) == 0 { 0 } else { rnd(700 * MIB) };
                let len = match rnd(3) {
                    0 => u64::MAX,
                    _ => rnd(300 * MIB) + 4096,
                };
                let minlen = [0, 4096, 65536, MIB][rnd(4) as usize];
                match fitrim(&dir, start, len, minlen) {
                    Ok(r) => trims += r[1],
                    Err(e) => {
                        let log = m.stop(Stop::Umount);
                        panic!("step {step}: FITRIM {start} +{len} min {minlen}: errno {e}; the mount said: {log}");
                    }
                }
            }
        }
        if step % 40 == 39 {
            assert_files(
                &dir,
                &model.iter().map(|(p, b)| (p.to_string_lossy().into_owned(), b.clone())).collect(),
                &format!("step {step}"),
            );
        }
    }
    assert!(trims > 0, "no FITRIM trimmed anything");
    let files: BTreeMap<String, Vec<u8>> =
        model.iter().map(|(p, b)| (p.to_string_lossy().into_owned(), b.clone())).collect();
    assert_files(&dir, &files, "at the end, through the mount");
    m.stop(Stop::Umount);
    assert_check(&img, "after random work with trims");
    {
        let _k = KernelMount::new(&img, &d.join("kread"));
        assert_files(&d.join("kread"), &files, "the kernel reading the image");
    }
    let _ = std::fs::remove_dir_all(&d);
}
