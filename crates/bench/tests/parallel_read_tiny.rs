//! The parallel-read benchmark in tiny form (2 files of 4 MiB, one round), so it never
//! rots: the binary verifies every byte it reads against the data it wrote, and must
//! report both sides and their ratio. Timings are not asserted.

use std::process::Command;

#[test]
fn parallel_read_tiny_reads_back_and_reports() {
    let have_mkfs = Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !have_mkfs {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "parallel_read_tiny: mkfs.btrfs missing, and CI=true forbids skipping"
        );
        eprintln!("parallel_read_tiny: skipped: mkfs.btrfs not installed");
        return;
    }
    let dir =
        std::env::temp_dir().join(format!("ubtrfs-parallel-read-tiny-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_parallel_read"))
        .args(["--files", "2", "--file-mib", "4", "--rounds", "1", "--dir"])
        .arg(&dir)
        .output()
        .expect("run parallel_read");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "parallel_read failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("| 1 thread, 2 files in turn |")
            && stdout.contains("| 2 threads, one file each |"),
        "both sides reported:\n{stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("ratio 2 threads / 1 thread: "))
        .unwrap_or_else(|| panic!("no ratio line:\n{stdout}"));
    let ratio: f64 = line
        .split_whitespace()
        .nth(6)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("unparsable {line:?}"));
    assert!(ratio.is_finite() && ratio > 0.0, "bad ratio in {line:?}");
    std::fs::remove_dir_all(&dir).ok();
}
