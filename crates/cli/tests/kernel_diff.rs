//! Diff-walk against the kernel: build fresh images with mkfs.btrfs and a kernel loop
//! mount (xtask/fixtures.py), take the kernel's view of each, run `ubtrfs extract`
//! into a tmpfs, and compare the two trees file by file (type, mode, owner, size,
//! nlink, times, device numbers, sha256 of contents, symlink targets, xattrs).
//! Needs root, btrfs-progs and the kernel driver; skips with a reason otherwise, and
//! fails instead of skipping under CI=true.

#[path = "../../core/tests/common/kernel.rs"]
mod kernel;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

use kernel::kernel_available;

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

struct Tmpfs(PathBuf);
impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn diff_walk(name: &str) {
    if !kernel_available(&format!("diff_walk_{name}")) {
        return;
    }
    let work = std::env::temp_dir().join(format!("ubtrfs-diffwalk-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).expect("work dir");
    let script = repo().join("xtask/fixtures.py");
    run(Command::new("python3").arg(&script).arg("build").arg("--out").arg(&work).arg(name));
    let meta: String =
        std::fs::read_to_string(work.join(format!("{name}.meta.json"))).expect("meta");
    let ndev: usize = meta
        .split("\"devices\":")
        .nth(1)
        .and_then(|s| s.trim_start().split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|s| s.parse().ok())
        .expect("devices in meta");
    let mut imgs = Vec::new();
    for i in 0..ndev {
        let raw = work.join(format!("{name}.{i}.img"));
        run(Command::new("zstd")
            .arg("-q")
            .arg("-d")
            .arg("--long=31")
            .arg("-f")
            .arg(work.join(format!("{name}.{i}.img.zst")))
            .arg("-o")
            .arg(&raw));
        imgs.push(raw);
    }
    // tmpfs keeps every xattr the image can hold (ext4 caps them at one block).
    let mnt = Tmpfs(work.join("dest"));
    std::fs::create_dir_all(&mnt.0).expect("dest dir");
    run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=1G", "tmpfs"]).arg(&mnt.0));
    let dest = mnt.0.join("out");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ubtrfs"));
    cmd.arg("extract").arg(&imgs[0]).arg(&dest);
    for d in &imgs[1..] {
        cmd.arg("--device").arg(d);
    }
    run(&mut cmd);
    let ours = run(Command::new("python3").arg(&script).arg("manifest").arg(&dest));
    let ours_path = work.join("ubtrfs.manifest.jsonl");
    std::fs::write(&ours_path, &ours.stdout).expect("write manifest");
    // Directory size/nlink are filesystem-specific (btrfs: 2 x names, nlink 1); inode
    // numbers and block counts differ by construction.
    let d = Command::new("python3")
        .arg(&script)
        .arg("diff")
        .arg(work.join(format!("{name}.manifest.jsonl")))
        .arg(&ours_path)
        .args(["--ignore-keys", "ino,blocks,subvol", "--ignore-dir-keys", "size,nlink"])
        .output()
        .expect("diff");
    assert!(
        d.status.success(),
        "{name}: extract differs from the kernel's view:\n{}",
        String::from_utf8_lossy(&d.stdout).lines().take(40).collect::<Vec<_>>().join("\n")
    );
    let lines = String::from_utf8_lossy(&ours.stdout).lines().count();
    assert!(lines > 10, "{name}: only {lines} entries extracted");
    drop(mnt);
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn diff_walk_default() {
    diff_walk("default");
}

#[test]
fn diff_walk_zstd() {
    diff_walk("zstd");
}

#[test]
fn diff_walk_lzo() {
    diff_walk("lzo");
}

#[test]
fn diff_walk_raid10() {
    diff_walk("raid10");
}
