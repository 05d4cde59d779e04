//! Smoke test of the benchmark pipeline: `python3 xtask/bench.py --tiny --runs 1
//! --out /dev/null` builds tiny kernel-made images (64 MiB files, 2,000 small files),
//! runs every benchmark once on both sides (kernel mount and ubtrfs) and verifies the
//! outputs agree. Only checks that the script succeeds and reports a ratio for each
//! benchmark; timings are never asserted (this machine is noisy).
//! Needs root, btrfs-progs and the kernel driver; skips with a reason otherwise, and
//! fails instead of skipping under CI=true.

#[path = "../../core/tests/common/kernel.rs"]
mod kernel;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

fn kernel_available(test: &str) -> bool {
    kernel::kernel_available_with(test, &["/usr/bin/time"])
}

#[test]
fn bench_tiny_runs_and_reports_ratios() {
    if !kernel_available("bench_tiny") {
        return;
    }
    let repo = repo();
    let out = Command::new("python3")
        .arg(repo.join("xtask/bench.py"))
        // The test's own (debug) binary: the tiny form checks the pipeline, not speed,
        // and a release build would add minutes to every test run.
        .args([
            "--tiny",
            "--runs",
            "1",
            "--out",
            "/dev/null",
            "--binary",
            env!("CARGO_BIN_EXE_ubtrfs"),
        ])
        .current_dir(&repo)
        .output()
        .expect("run python3 xtask/bench.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench.py --tiny failed ({}):\n{stdout}\n{stderr}", out.status);
    for name in ["cat-uncompressed", "cat-zstd", "extract"] {
        let prefix = format!("ratio {name}: kernel/ubtrfs = ");
        let line = stdout.lines().find(|l| l.starts_with(&prefix));
        let Some(line) = line else {
            panic!("no ratio line for {name} in the output:\n{stdout}\n{stderr}")
        };
        let ratio: f64 = line[prefix.len()..]
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("unparsable ratio line {line:?}"));
        assert!(ratio.is_finite() && ratio > 0.0, "bad ratio in {line:?}");
    }
    for what in ["peak-rss cat uncompressed", "peak-rss cat zstd"] {
        assert!(
            stdout.lines().any(|l| l.starts_with(what)),
            "no {what:?} line in the output:\n{stdout}"
        );
    }
    eprintln!("{stdout}");
}
