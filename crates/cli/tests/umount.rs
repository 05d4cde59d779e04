//! The end of a mount as others see it: once `fusermount3 -u`, `umount` or `ubtrfs
//! umount` returns, the next user of the image finds our last commit. Another `ubtrfs
//! mount` at once waits for the unmounting process instead of failing; a kernel
//! `mount -o loop` at once keeps its own later writes, and mounts the state after our
//! last commit (always after a waiting unmount); `ubtrfs umount` and the umount helper
//! return only once the daemon has exited; and a kernel mount made while we were still
//! mounted is never written over.
//!
//! Needs root, /dev/fuse and fusermount3 (the tests say why they skip without them;
//! under CI=true they must run). `UBTRFS_UMOUNT_ROUNDS` sets the round count of the
//! remount test (200 by default).

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::{bin, pseudo_random as data, run, scratch_in};
use fuse::{assert_check, is_mountpoint, mkfs};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Remount rounds (about 7 s in a debug build); `UBTRFS_UMOUNT_ROUNDS` overrides.
const CI_ROUNDS: usize = 200;
/// Kernel-mount rounds.
const KERNEL_ROUNDS: usize = 20;
/// Block-device remount rounds.
const BLOCK_ROUNDS: usize = 50;

fn fuse_available(test: &str) -> bool {
    kernel::kernel_available_with(test, &["/dev/fuse", "/usr/bin/fusermount3", "/usr/sbin/losetup"])
}

/// Mount points and loop devices of one test, cleared on drop (also after a failure).
struct Cleanup {
    dirs: Vec<PathBuf>,
    loops: Vec<String>,
    /// The test's scratch directory (its image is 512 MiB to 1 GiB sparse): removed once
    /// everything is unmounted and detached, unless the test failed and it is evidence.
    scratch: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for d in &self.dirs {
            while is_mountpoint(d) {
                if !Command::new("umount").arg("-l").arg(d).status().is_ok_and(|s| s.success()) {
                    break;
                }
            }
        }
        for l in &self.loops {
            let _ = Command::new("losetup").arg("-d").arg(l).output();
        }
        if !std::thread::panicking() && !self.dirs.iter().any(|d| is_mountpoint(d)) {
            let _ = std::fs::remove_dir_all(&self.scratch);
        }
    }
}

/// `ubtrfs mount --daemon IMG DIR`, which returns once the kernel has the mount; it
/// must succeed at once, whatever was unmounted just before.
fn mount_daemon(img: &Path, dir: &Path, round: usize) {
    let out = bin().args(["mount", "--daemon"]).arg(img).arg(dir).output().unwrap();
    assert!(
        out.status.success(),
        "round {round}: ubtrfs mount failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(is_mountpoint(dir), "round {round}: {} not mounted", dir.display());
}

/// Run an unmount command, which must succeed. It is tried again on "busy" for a
/// while: the tests of this file run in parallel threads of one process, and a child
/// another thread forks holds a copy of every descriptor (a file just written in the
/// mount) until its exec.
fn unmount(cmd: &mut Command) {
    let t = Instant::now();
    loop {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        if out.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("busy") && t.elapsed() < Duration::from_secs(5),
            "{cmd:?} failed: {err}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The flock holders of `img` (pids), from /proc/locks.
fn lock_holders(img: &Path) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(img).unwrap();
    let (maj, min) = (libc::major(md.dev()), libc::minor(md.dev()));
    let id = format!("{maj:02x}:{min:02x}:{}", md.ino());
    let locks = std::fs::read_to_string("/proc/locks").unwrap();
    locks
        .lines()
        .filter(|l| l.contains(" FLOCK ") && l.split_whitespace().any(|f| f == id))
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect()
}

/// Whether `pid` runs (a zombie has exited: a daemon's parent is gone, and whoever
/// inherits it reaps it when it gets to it).
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
}

/// The size of round `i`'s file: mostly small, every seventh a few MiB, so that some
/// last commits write for a while after the kernel's unmount has returned.
fn round_len(i: usize) -> usize {
    if i % 7 == 3 {
        (4 << 20) + i
    } else {
        4096 * (i % 5) + 100 + i
    }
}

/// Mount, write, unmount (`fusermount3 -u`, `umount`, `ubtrfs umount` in turn), mount
/// again at once: every mount succeeds and every file is there afterwards.
#[test]
fn mount_again_at_once_after_unmount() {
    if !fuse_available("mount_again_at_once_after_unmount") {
        return;
    }
    let rounds: usize = std::env::var("UBTRFS_UMOUNT_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CI_ROUNDS);
    let d = scratch_in("umount", "again");
    let img = d.join("img");
    let mnt = d.join("m");
    std::fs::create_dir_all(&mnt).unwrap();
    mkfs(&img, "1G");
    let _c = Cleanup { dirs: vec![mnt.clone()], loops: vec![], scratch: d.clone() };
    let t = Instant::now();
    for i in 0..rounds {
        mount_daemon(&img, &mnt, i);
        std::fs::write(mnt.join(format!("f{i}")), data(i as u64, round_len(i))).unwrap();
        match i % 3 {
            0 => unmount(Command::new("fusermount3").arg("-u").arg(&mnt)),
            1 => unmount(Command::new("umount").arg(&mnt)),
            _ => unmount(bin().arg("umount").arg(&mnt)),
        };
    }
    eprintln!("{rounds} rounds of mount, write, unmount in {:?}", t.elapsed());
    // The last daemon may still be writing: the next open waits for it as the rounds did.
    mount_daemon(&img, &mnt, rounds);
    for i in 0..rounds {
        let got = std::fs::read(mnt.join(format!("f{i}"))).unwrap_or_else(|e| panic!("f{i}: {e}"));
        assert!(got == data(i as u64, round_len(i)), "f{i} differs");
    }
    unmount(bin().arg("umount").arg(&mnt));
    assert!(
        lock_holders(&img).is_empty(),
        "the image is still locked after ubtrfs umount: {:?}",
        lock_holders(&img)
    );
    assert_check(&img, "after the rounds");
}

/// The same through a loop device (a block device, opened O_EXCL): the next mount's
/// exclusive open meets the unmounting process first, and waits for it too.
#[test]
fn block_device_mount_again_at_once() {
    if !fuse_available("block_device_mount_again_at_once") {
        return;
    }
    let d = scratch_in("umount", "blockdev");
    let img = d.join("img");
    let mnt = d.join("m");
    std::fs::create_dir_all(&mnt).unwrap();
    mkfs(&img, "512M");
    let lo = run(Command::new("losetup").args(["-f", "--show"]).arg(&img)).trim().to_string();
    let _c = Cleanup { dirs: vec![mnt.clone()], loops: vec![lo.clone()], scratch: d.clone() };
    let dev = Path::new(&lo);
    let rounds = BLOCK_ROUNDS;
    for i in 0..rounds {
        mount_daemon(dev, &mnt, i);
        std::fs::write(mnt.join(format!("f{i}")), data(i as u64, round_len(i))).unwrap();
        match i % 2 {
            0 => unmount(Command::new("fusermount3").arg("-u").arg(&mnt)),
            _ => unmount(Command::new("umount").arg(&mnt)),
        };
    }
    mount_daemon(dev, &mnt, rounds);
    for i in 0..rounds {
        assert!(
            std::fs::read(mnt.join(format!("f{i}")))
                .is_ok_and(|g| g == data(i as u64, round_len(i))),
            "f{i} lost or different"
        );
    }
    unmount(bin().arg("umount").arg(&mnt));
    assert_check(&img, "after the block device rounds");
}

/// An unmount then at once `mount -o loop`: what the kernel writes and syncs stays, our
/// late commit never lands on top. Through the `umount.fuse.ubtrfs` helper (what a
/// plain `umount` runs once installed) the kernel always finds our last commit. After
/// `fusermount3 -u` it does too unless the kernel opened the image before the daemon
/// held it (possible when the CPUs are busy: the daemon learns of the unmount only from
/// the mount table); the daemon then writes nothing and says so, and exits non-zero.
#[test]
fn kernel_mount_at_once_after_unmount_keeps_both_sides() {
    if !fuse_available("kernel_mount_at_once_after_unmount_keeps_both_sides") {
        return;
    }
    let d = scratch_in("umount", "kernel");
    let img = d.join("img");
    let (mnt, k) = (d.join("m"), d.join("k"));
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::create_dir_all(&k).unwrap();
    mkfs(&img, "1G");
    let helpers = d.join("sbin");
    std::fs::create_dir_all(&helpers).unwrap();
    run(bin().arg("install-helper").arg("--dir").arg(&helpers));
    let _c = Cleanup { dirs: vec![mnt.clone(), k.clone()], loops: vec![], scratch: d.clone() };
    let ours = |i: usize| data(1000 + i as u64, (8 << 20) + i);
    let kern = |i: usize| format!("kernel {i}\n").into_bytes();
    let mut dropped = Vec::new();
    for i in 0..KERNEL_ROUNDS {
        // In the foreground, for its messages and exit status.
        let child = bin()
            .arg("mount")
            .arg(&img)
            .arg(&mnt)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        while !is_mountpoint(&mnt) {
            assert!(t.elapsed() < Duration::from_secs(30), "round {i}: no mount");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::write(mnt.join(format!("ours{i}")), ours(i)).unwrap();
        let waited = i % 2 == 1;
        if waited {
            unmount(Command::new(helpers.join("umount.fuse.ubtrfs")).arg(&mnt));
        } else {
            unmount(Command::new("fusermount3").arg("-u").arg(&mnt));
        }
        run(Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&k));
        let seen = std::fs::read(k.join(format!("ours{i}"))).is_ok_and(|g| g == ours(i));
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        if seen {
            assert!(out.status.success(), "round {i}: the mount failed: {err}");
        } else {
            assert!(!waited, "round {i}: the kernel mounted the state before our last commit after the waiting unmount; the mount said: {err}");
            assert!(
                !out.status.success() && err.contains("not written, so as not to overwrite the kernel's"),
                "round {i}: our last commit is neither under the kernel's mount nor refused aloud: {err}"
            );
            dropped.push(i);
        }
        std::fs::write(k.join(format!("kern{i}")), kern(i)).unwrap();
        run(Command::new("sync").arg("-f").arg(k.join(format!("kern{i}"))));
        unmount(Command::new("umount").arg(&k));
    }
    eprintln!("{} of {KERNEL_ROUNDS} rounds: the kernel mounted before our last commit after fusermount3 -u, which was then not written: {dropped:?}", dropped.len());
    assert!(
        lock_holders(&img).is_empty(),
        "a ubtrfs process still holds the image: {:?}",
        lock_holders(&img)
    );
    assert_check(&img, "after the kernel's rounds");
    run(Command::new("mount").args(["-o", "loop,ro"]).arg(&img).arg(&k));
    for i in 0..KERNEL_ROUNDS {
        let ok = std::fs::read(k.join(format!("ours{i}"))).is_ok_and(|g| g == ours(i));
        assert!(
            ok != dropped.contains(&i),
            "ours{i}: {}",
            if ok { "there though refused" } else { "lost" }
        );
        assert!(
            std::fs::read(k.join(format!("kern{i}"))).is_ok_and(|g| g == kern(i)),
            "the kernel's kern{i} lost"
        );
    }
    unmount(Command::new("umount").arg(&k));
}

/// `ubtrfs umount`, and the `umount.fuse.ubtrfs` helper umount(8) runs for our mounts,
/// return once the daemon has exited: its pid is gone, the image is unlocked and holds
/// what was written. They refuse what is not a ubtrfs mount.
#[test]
fn ubtrfs_umount_returns_after_the_daemon_exits() {
    if !fuse_available("ubtrfs_umount_returns_after_the_daemon_exits") {
        return;
    }
    let d = scratch_in("umount", "wait");
    let img = d.join("img");
    let mnt = d.join("m");
    std::fs::create_dir_all(&mnt).unwrap();
    mkfs(&img, "512M");
    let _c = Cleanup { dirs: vec![mnt.clone()], loops: vec![], scratch: d.clone() };
    // The helpers as install-helper links them (umount(8) finds them in /sbin).
    let helpers = d.join("sbin");
    std::fs::create_dir_all(&helpers).unwrap();
    run(bin().arg("install-helper").arg("--dir").arg(&helpers));
    let umount_helper = || Command::new(helpers.join("umount.fuse.ubtrfs"));
    for round in 0..3u64 {
        mount_daemon(&img, &mnt, round as usize);
        let pids = lock_holders(&img);
        assert_eq!(pids.len(), 1, "one daemon holds the image: {pids:?}");
        // Enough dirty data that the last commit takes a while.
        std::fs::write(mnt.join(format!("big{round}")), data(round, 48 << 20)).unwrap();
        match round {
            // As umount(8) calls it.
            1 => unmount(umount_helper().arg(&mnt).args(["-t", "fuse.ubtrfs"])),
            _ => unmount(bin().arg("umount").arg(&mnt)),
        };
        assert!(
            !alive(pids[0]),
            "round {round}: the unmount returned while the daemon {} runs",
            pids[0]
        );
        assert!(lock_holders(&img).is_empty(), "round {round}: the image is still locked");
        assert!(!is_mountpoint(&mnt));
    }
    let out = run(bin().arg("ls").arg(&img).arg("/"));
    assert_eq!(out.split_whitespace().collect::<Vec<_>>(), ["big0", "big1", "big2"]);
    assert_check(&img, "after ubtrfs umount");
    let e = cmd::fails(bin().arg("umount").arg(&mnt));
    assert!(e.contains("not a mount point"), "{e}");
    let e = cmd::fails(bin().arg("umount").arg("/proc"));
    assert!(e.contains("not a ubtrfs mount (its type is proc)"), "{e}");
    let e = cmd::fails(umount_helper().arg("/proc"));
    assert!(
        e.starts_with("umount.fuse.ubtrfs: error: /proc: invalid argument (not a ubtrfs mount"),
        "{e}"
    );
}

/// A kernel mount made (through a loop device) while our mount still serves: at the
/// unmount we write nothing, say so and fail; the kernel's writes stay and the image
/// checks clean.
#[test]
fn kernel_mount_under_a_live_mount_is_not_written_over() {
    if !fuse_available("kernel_mount_under_a_live_mount_is_not_written_over") {
        return;
    }
    let d = scratch_in("umount", "under");
    let img = d.join("img");
    let (mnt, k) = (d.join("m"), d.join("k"));
    std::fs::create_dir_all(&mnt).unwrap();
    std::fs::create_dir_all(&k).unwrap();
    mkfs(&img, "512M");
    std::fs::write(d.join("base"), b"base\n").unwrap();
    run(bin().arg("put").arg(&img).arg(d.join("base")).arg("/base"));
    let mut c = Cleanup { dirs: vec![mnt.clone(), k.clone()], loops: vec![], scratch: d.clone() };
    let child = bin()
        .arg("mount")
        .arg(&img)
        .arg(&mnt)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !is_mountpoint(&mnt) {
        assert!(t.elapsed() < Duration::from_secs(30), "no mount");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(mnt.join("ours"), data(7, 1 << 20)).unwrap();
    // The kernel ignores our lock: a loop device over the image mounts the last commit.
    let lo = run(Command::new("losetup").args(["-f", "--show"]).arg(&img)).trim().to_string();
    c.loops.push(lo.clone());
    run(Command::new("mount").arg(&lo).arg(&k));
    std::fs::write(k.join("kern"), b"kernel\n").unwrap();
    run(Command::new("sync").arg("-f").arg(k.join("kern")));
    unmount(Command::new("fusermount3").arg("-u").arg(&mnt));
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the mount must fail when it cannot write its last commit: {err}"
    );
    assert!(err.contains("is mounted by the kernel at") && err.contains("not written"), "{err}");
    assert!(std::fs::read(k.join("kern")).is_ok_and(|g| g == b"kernel\n"));
    assert!(!k.join("ours").exists(), "the kernel mounted the state before our write");
    unmount(Command::new("umount").arg(&k));
    assert_check(&img, "after the refused last commit");
    run(Command::new("mount").arg(&lo).arg(&k));
    assert!(
        std::fs::read(k.join("kern")).is_ok_and(|g| g == b"kernel\n"),
        "the kernel's file was written over"
    );
    assert!(std::fs::read(k.join("base")).is_ok_and(|g| g == b"base\n"));
    unmount(Command::new("umount").arg(&k));
}
