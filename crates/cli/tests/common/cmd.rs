//! Running the `ubtrfs` binary and other commands in the CLI's tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

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

/// Run `cmd` (whatever its exit status); its output.
pub fn out_of(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

/// Run `cmd`, which must succeed; its output.
pub fn run_output(cmd: &mut Command) -> Output {
    let out = out_of(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Run `cmd`, which must succeed; its stdout.
pub fn run(cmd: &mut Command) -> String {
    String::from_utf8_lossy(&run_output(cmd).stdout).into_owned()
}

/// Run `cmd`, which must fail; its stderr.
pub fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(!out.status.success(), "{cmd:?} succeeded: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `len` pseudo-random bytes from `seed` (xorshift), the same for the same arguments.
pub fn pseudo_random(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
