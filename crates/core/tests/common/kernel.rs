//! Whether a test can use the kernel oracle (root, the btrfs driver, btrfs-progs).
//! One copy for every test crate: crates/cli's tests include this file by path.
#![allow(dead_code)]

/// True when running as root with the kernel btrfs driver and btrfs-progs; otherwise
/// print why and return false, except under CI=true where skipping is a failure.
pub fn kernel_available(test: &str) -> bool {
    kernel_available_with(test, &[])
}

/// As `kernel_available`, also requiring the executables at `tools` (absolute paths).
pub fn kernel_available_with(test: &str, tools: &[&str]) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc_geteuid() } == 0;
    let progs = ["btrfs", "mkfs.btrfs"].iter().all(|t| {
        std::process::Command::new(t)
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    });
    let fs =
        std::fs::read_to_string("/proc/filesystems").map(|s| s.contains("btrfs")).unwrap_or(false);
    let missing: Vec<&str> =
        tools.iter().copied().filter(|t| !std::path::Path::new(t).exists()).collect();
    if root && progs && fs && missing.is_empty() {
        return true;
    }
    let mut why = format!("{test}: skipped: needs root ({root}), btrfs-progs ({progs}) and the kernel btrfs driver ({fs})");
    if !missing.is_empty() {
        why.push_str(&format!(", and {}", missing.join(", ")));
    }
    if std::env::var("CI").as_deref() == Ok("true") {
        panic!("{why}, and CI=true forbids skipping");
    }
    eprintln!("{why}");
    false
}

/// The "Set shared" total of `btrfs filesystem du -s --raw DIR` (a kernel mount).
pub fn du_shared_bytes(dir: &std::path::Path) -> u64 {
    let out = std::process::Command::new("btrfs")
        .args(["filesystem", "du", "-s", "--raw"])
        .arg(dir)
        .output()
        .expect("btrfs filesystem du");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "btrfs filesystem du: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .last()
        .and_then(|l| l.split_whitespace().nth(2))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no shared bytes in {text:?}"))
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}
