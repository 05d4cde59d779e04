//! `ubtrfs mount` over FUSE's io_uring transport (the fuse module's `enable_uring`):
//! the mount serves its requests on one pinned thread per CPU queue; files, directories,
//! links, xattrs, writes and reads larger than a ring entry's payload, and the btrfs
//! subvolume ioctls (whose handler once stat'ed the caller's descriptor, a request to
//! the mount itself, which the only thread of that CPU's queue could never serve) all
//! work, the image checks clean, and the kernel mounts it with exactly the files the
//! mount showed. `-o noio_uring` keeps to /dev/fuse.
//!
//! Needs root, the kernel btrfs driver, /dev/fuse, fusermount3 and a kernel with FUSE
//! over io_uring (`/sys/module/fuse/parameters/enable_uring`); says why it skips
//! otherwise, and fails under CI=true.

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::{pseudo_random, run, scratch_in};
use fuse::{assert_check, mkfs, FuseMount, KernelMount, Stop};
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

const PARAM: &str = "/sys/module/fuse/parameters/enable_uring";

fn available(test: &str) -> bool {
    kernel::kernel_available_with(test, &["/dev/fuse", "/usr/bin/fusermount3", PARAM])
}

/// `enable_uring` set to `value` while it lives, the old value written back on drop.
struct Param(String);

impl Param {
    fn set(value: &str) -> Param {
        let old = std::fs::read_to_string(PARAM).expect("read enable_uring").trim().to_string();
        std::fs::write(PARAM, value).expect("write enable_uring");
        Param(old)
    }
}

impl Drop for Param {
    fn drop(&mut self) {
        let _ = std::fs::write(PARAM, &self.0);
    }
}

/// The names of the daemon's threads that serve io_uring queues.
fn ring_threads(pid: i32) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("tasks")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| c.starts_with("fuser-ring-"))
        .collect();
    out.sort();
    out
}

fn possible_cpus() -> usize {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible").expect("possible");
    text.trim()
        .split(',')
        .map(|p| match p.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

/// What a tree holds: path → (kind, contents or target, user.test xattr, link count).
type Tree = BTreeMap<String, (char, Vec<u8>, Option<Vec<u8>>, u64)>;

fn tree(root: &Path) -> Tree {
    let mut out = Tree::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let p = e.expect("entry").path();
            let md = std::fs::symlink_metadata(&p).expect("stat");
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let (kind, body) = if md.is_dir() {
                stack.push(p.clone());
                ('d', Vec::new())
            } else if md.file_type().is_symlink() {
                ('l', std::fs::read_link(&p).unwrap().into_os_string().into_encoded_bytes())
            } else {
                ('f', std::fs::read(&p).expect("read"))
            };
            let x = if kind == 'l' { None } else { xattr(&p) };
            out.insert(rel, (kind, body, x, if kind == 'd' { 0 } else { md.nlink() }));
        }
    }
    out
}

fn xattr(p: &Path) -> Option<Vec<u8>> {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let mut buf = vec![0u8; 256];
    // SAFETY: valid C strings and a buffer of the given length.
    let n = unsafe {
        libc::lgetxattr(c.as_ptr(), c"user.test".as_ptr(), buf.as_mut_ptr().cast(), buf.len())
    };
    (n >= 0).then(|| buf[..n as usize].to_vec())
}

fn set_xattr(p: &Path, v: &[u8]) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: valid C strings and value.
    let r =
        unsafe { libc::setxattr(c.as_ptr(), c"user.test".as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(r, 0, "setxattr {}: {}", p.display(), std::io::Error::last_os_error());
}

/// `ubtrfs subvolume OP MNT PATHS...` (the ioctls of the running mount), failing rather
/// than hanging if the daemon stops answering.
fn subvolume(op: &str, mnt: &Path, paths: &[&str]) {
    let mut c = Command::new("timeout");
    c.arg("60").arg(env!("CARGO_BIN_EXE_ubtrfs")).args(["subvolume", op]).arg(mnt).args(paths);
    run(&mut c);
}

/// Files of many sizes (empty, inline, one block, past a ring entry's 1 MiB payload),
/// directories, a rename over a name, a hard link, a symlink, xattrs, an append, a
/// truncate and unlinks; returns what reading it back must show.
fn workload(m: &Path) {
    let sizes = [0usize, 1, 100, 2048, 4096, 5000, 65_536, 131_073, 1 << 20, (3 << 20) + 17];
    for d in 0..4 {
        let dir = m.join(format!("d{d}/sub"));
        std::fs::create_dir_all(&dir).unwrap();
        for (i, &n) in sizes.iter().enumerate() {
            std::fs::write(dir.join(format!("f{i}")), pseudo_random((d * 100 + i) as u64, n))
                .unwrap();
        }
    }
    for i in 0..300 {
        std::fs::write(m.join(format!("d0/small{i}")), format!("small file {i}\n")).unwrap();
    }
    std::fs::rename(m.join("d1/sub/f3"), m.join("d2/sub/f4")).unwrap();
    std::fs::hard_link(m.join("d0/sub/f8"), m.join("d3/hard")).unwrap();
    std::os::unix::fs::symlink("d0/sub/f1", m.join("link")).unwrap();
    set_xattr(&m.join("d0/sub/f2"), b"value one");
    set_xattr(&m.join("d1"), b"dir value");
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().append(true).open(m.join("d2/sub/f9")).unwrap();
        f.write_all(&pseudo_random(77, 300_000)).unwrap();
        f.sync_all().unwrap();
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(m.join("d3/sub/f9"))
        .unwrap()
        .set_len(12_345)
        .unwrap();
    for i in (0..300).step_by(3) {
        std::fs::remove_file(m.join(format!("d0/small{i}"))).unwrap();
    }
}

#[test]
fn mount_over_io_uring_serves_every_request_and_the_kernel_agrees() {
    if !available("mount_over_io_uring_serves_every_request_and_the_kernel_agrees") {
        return;
    }
    let dir = scratch_in("uring-mount", "serve");
    let img = dir.join("u.img");
    mkfs(&img, "1G");
    let mnt: PathBuf = dir.join("m");
    let shown = {
        let _p = Param::set("Y");
        let m = FuseMount::start(&img, &mnt, "");
        workload(&mnt);
        // The ring threads start just after the mount appears; the kernel holds every
        // request until each queue has its entries, so once the workload's requests
        // are answered they are there.
        let rings = ring_threads(m.pid());
        let want: Vec<String> = (0..possible_cpus()).map(|q| format!("fuser-ring-{q}")).collect();
        assert_eq!(rings, want, "a ring thread per possible CPU");
        subvolume("create", &mnt, &["/sv"]);
        std::fs::write(mnt.join("sv/inside"), b"in the subvolume").unwrap();
        subvolume("snapshot", &mnt, &["/sv", "/snap"]);
        let shown = tree(&mnt);
        assert_eq!(shown["snap/inside"].1, b"in the subvolume");
        assert_eq!(shown["d3/hard"].3, 2, "the hard link's count");
        assert_eq!(shown["d2/sub/f9"].1.len(), (3 << 20) + 17 + 300_000);
        assert_eq!(shown["d0/sub/f2"].2.as_deref(), Some(&b"value one"[..]));
        m.stop(Stop::Umount);
        shown
    };
    assert_check(&img, "after the io_uring mount");
    let kdir = dir.join("k");
    {
        let _k = KernelMount::new(&img, &kdir);
        assert!(tree(&kdir) == shown, "the kernel's view differs from the io_uring mount's");
    }

    // -o noio_uring: no ring threads, the same files.
    let _p = Param::set("Y");
    let m = FuseMount::start(&img, &mnt, "noio_uring");
    assert!(tree(&mnt) == shown, "the /dev/fuse mount's view differs");
    assert!(ring_threads(m.pid()).is_empty(), "noio_uring still made ring threads");
    m.stop(Stop::Umount);
    let _ = std::fs::remove_dir_all(&dir);
}
