//! Running the `ubtrfs` binary and other commands in the CLI's tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ubtrfs"))
}

/// A fresh scratch directory `ubtrfs-{prefix}-{pid}-{name}` in the temp dir.
pub fn scratch_in(prefix: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ubtrfs-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Run `cmd`, which must succeed; its stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Run `cmd`, which must fail; its stderr.
pub fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(!out.status.success(), "{cmd:?} succeeded: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}
