//! Access times against the kernel: the same reads, readdirs and readlinks on a kernel
//! loop mount (relatime, strictatime, noatime, nodiratime) and through ubtrfs
//! (`FsWriter::file_accessed` with the same options), and after each one whether the
//! atime moved, and that the ctime did not.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use ubtrfs_core::inode::atime::{AtimeMode, AtimeOpts};
use ubtrfs_core::inode::attr::{fsflags, SetAttr, TimeSet};
use ubtrfs_core::inode::filesystem::{FsRead, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use write_common::*;

#[derive(Clone, Copy, Debug)]
enum Step {
    /// A file with a few bytes, a directory with an entry, a symlink.
    Make,
    ReadFile,
    ReadDir,
    ReadLink,
    /// atime two days ago (explicit, so the ctime is now).
    OldAtime(&'static str),
    /// atime now (utimens with UTIME_NOW for the atime only: the ctime is now too,
    /// and the mtime older).
    AtimeNow(&'static str),
    /// chattr +A.
    NoatimeFlag,
}

const STEPS: &[Step] = &[
    Step::Make,
    Step::ReadFile,
    Step::ReadFile,
    // Only the ctime rule moves it.
    Step::AtimeNow("f"),
    Step::ReadFile,
    Step::ReadFile,
    Step::OldAtime("f"),
    Step::ReadFile,
    Step::ReadFile,
    Step::ReadDir,
    Step::ReadDir,
    Step::OldAtime("d"),
    Step::ReadDir,
    Step::ReadLink,
    Step::ReadLink,
    Step::NoatimeFlag,
    Step::OldAtime("f"),
    Step::ReadFile,
];

const TWO_DAYS: i64 = 2 * 24 * 3600;

fn now_secs() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs()
        as i64
}

/// (atime, ctime) of a path on the kernel mount, without following a symlink.
fn times(p: &Path) -> ((i64, i64), (i64, i64)) {
    let m = std::fs::symlink_metadata(p).expect("lstat");
    ((m.atime(), m.atime_nsec()), (m.ctime(), m.ctime_nsec()))
}

/// For each read step: (atime moved, ctime moved).
fn kernel_side(img: &Path, opts: &str) -> Vec<(bool, bool)> {
    let m = Mount::new_with(img, &format!("loop,{opts}"));
    let mut out = Vec::new();
    for &s in STEPS {
        std::thread::sleep(Duration::from_millis(15));
        let target = match s {
            Step::Make => {
                std::fs::write(m.path("f"), b"some bytes").expect("write");
                std::fs::create_dir(m.path("d")).expect("mkdir");
                std::fs::write(m.path("d/x"), b"x").expect("write");
                std::os::unix::fs::symlink("f", m.path("l")).expect("symlink");
                continue;
            }
            Step::OldAtime(n) => {
                let out = Command::new("touch")
                    .args(["-a", "-h", "-d", &format!("@{}", now_secs() - TWO_DAYS)])
                    .arg(m.path(n))
                    .output()
                    .expect("touch");
                assert!(out.status.success(), "touch: {}", String::from_utf8_lossy(&out.stderr));
                continue;
            }
            Step::AtimeNow(n) => {
                let out = Command::new("touch")
                    .args(["-a", "-h"])
                    .arg(m.path(n))
                    .output()
                    .expect("touch");
                assert!(out.status.success(), "touch: {}", String::from_utf8_lossy(&out.stderr));
                continue;
            }
            Step::NoatimeFlag => {
                let out =
                    Command::new("chattr").arg("+A").arg(m.path("f")).output().expect("chattr");
                assert!(out.status.success(), "chattr: {}", String::from_utf8_lossy(&out.stderr));
                continue;
            }
            Step::ReadFile => "f",
            Step::ReadDir => "d",
            Step::ReadLink => "l",
        };
        let p = m.path(target);
        let before = times(&p);
        std::thread::sleep(Duration::from_millis(15));
        match s {
            Step::ReadFile => drop(std::fs::read(&p).expect("read")),
            Step::ReadDir => drop(std::fs::read_dir(&p).expect("readdir").count()),
            _ => drop(std::fs::read_link(&p).expect("readlink")),
        }
        let after = times(&p);
        out.push((after.0 != before.0, after.1 != before.1));
    }
    m.umount();
    out
}

fn ubtrfs_side(img: &Path, opts: AtimeOpts) -> Vec<(bool, bool)> {
    let mut w = FsWriter::open(&ubtrfs_core::OpenOptions::new(img)).expect("open");
    let top = w.live().root_dir();
    let (mut f, mut d, mut l) = (0, 0, 0);
    let mut out = Vec::new();
    let t = |w: &FsWriter, ino: u64| {
        let i = w
            .live()
            .load_inode(ubtrfs_core::inode::filesystem::InodeId { root: top.root, ino }, Load::ITEM)
            .expect("inode")
            .item;
        ((i.atime.sec.get(), i.atime.nsec.get()), (i.ctime.sec.get(), i.ctime.nsec.get()))
    };
    for &s in STEPS {
        std::thread::sleep(Duration::from_millis(15));
        let ino = match s {
            Step::Make => {
                f = w
                    .create_file(top.root, top.ino, b"f", &InodeAttrs::new(0o644))
                    .expect("create");
                w.write_file(top.root, f, 0, b"some bytes").expect("write");
                d = w.mkdir(top.root, top.ino, b"d", &InodeAttrs::new(0o755)).expect("mkdir");
                let x = w.create_file(top.root, d, b"x", &InodeAttrs::new(0o644)).expect("create");
                w.write_file(top.root, x, 0, b"x").expect("write");
                l = w
                    .symlink(top.root, top.ino, b"l", b"f", &InodeAttrs::new(0o777))
                    .expect("symlink");
                continue;
            }
            Step::OldAtime(n) => {
                let ino = if n == "f" { f } else { d };
                w.setattr(
                    InodeId { root: top.root, ino },
                    &SetAttr {
                        atime: Some(TimeSet::At(now_secs() - TWO_DAYS, 0)),
                        ..Default::default()
                    },
                )
                .expect("utimens");
                continue;
            }
            Step::AtimeNow(n) => {
                let ino = if n == "f" { f } else { d };
                w.setattr(
                    InodeId { root: top.root, ino },
                    &SetAttr { atime: Some(TimeSet::Now), ..Default::default() },
                )
                .expect("utimens");
                continue;
            }
            Step::NoatimeFlag => {
                w.set_fsflags(InodeId { root: top.root, ino: f }, fsflags::NOATIME)
                    .expect("chattr +A");
                continue;
            }
            Step::ReadFile => f,
            Step::ReadDir => d,
            Step::ReadLink => l,
        };
        let before = t(&w, ino);
        std::thread::sleep(Duration::from_millis(15));
        let moved = w.file_accessed(InodeId { root: top.root, ino }, opts).expect("file_accessed");
        let after = t(&w, ino);
        assert_eq!(moved, after.0 != before.0, "file_accessed's answer and the atime agree");
        out.push((after.0 != before.0, after.1 != before.1));
    }
    w.commit().expect("commit");
    out
}

#[test]
fn atime_moves_as_the_kernels() {
    if !common::kernel_available("atime_moves_as_the_kernels") {
        return;
    }
    let cases = [
        ("relatime", AtimeOpts { mode: AtimeMode::Relatime, nodiratime: false }),
        ("strictatime", AtimeOpts { mode: AtimeMode::Strict, nodiratime: false }),
        ("noatime", AtimeOpts { mode: AtimeMode::Noatime, nodiratime: false }),
        ("relatime,nodiratime", AtimeOpts { mode: AtimeMode::Relatime, nodiratime: true }),
    ];
    for (mount_opts, opts) in cases {
        let k = Scratch::mkfs("atime-k", 256 << 20, &[]);
        let u = Scratch::mkfs("atime-u", 256 << 20, &[]);
        let want = kernel_side(&k.path, mount_opts);
        let got = ubtrfs_side(&u.path, opts);
        let reads: Vec<&Step> = STEPS
            .iter()
            .filter(|s| matches!(s, Step::ReadFile | Step::ReadDir | Step::ReadLink))
            .collect();
        let bad: Vec<String> = reads
            .iter()
            .zip(want.iter().zip(&got))
            .enumerate()
            .filter(|(_, (_, (a, b)))| a != b)
            .map(|(i, (s, (a, b)))| format!("read {i} ({s:?}): kernel {a:?}, ubtrfs {b:?}"))
            .collect();
        assert!(
            bad.is_empty(),
            "{mount_opts}: (atime moved, ctime moved) differ:\n{}",
            bad.join("\n")
        );
        assert!(
            want.iter().any(|m| m.0) || mount_opts == "noatime",
            "{mount_opts}: the kernel moved no atime at all: {want:?}"
        );
        assert_check(&u.path, mount_opts);
    }
}
