//! Shared pieces of the benchmark binaries in `src/bin/`: fresh images from
//! `mkfs.btrfs`, the fs_mark-like file-creation workload run through the library with
//! its commit policy, and the statistics and markdown tables they print.
//!
//! Commit policy (the kernel's, approximated): the kernel commits a transaction every
//! 30 s (`commit=30`) or earlier when dirty metadata or delayed refs pile up. ubtrfs
//! keeps a transaction's dirty tree blocks in memory and runs delayed refs only at
//! commit, so the workload commits after `every_files` creations (bounding that memory
//! and the work per commit) or after `every` of wall time, whichever comes first, and
//! once at the end.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;

/// The fs tree and its root directory.
pub const FS_TREE: u64 = 5;
pub const ROOT_DIR: u64 = 256;

pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Run a command, failing with its output when it fails.
pub fn run_cmd(cmd: &mut Command) -> Result<String, String> {
    let o = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !o.status.success() {
        return Err(format!(
            "{cmd:?} failed ({}):\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&o.stdout).into_owned())
}

/// A sparse image file made by `mkfs.btrfs` (defaults), deleted on drop unless kept.
pub struct Image {
    pub path: PathBuf,
    pub keep: bool,
}

impl Image {
    /// # Errors
    /// When the file cannot be made or `mkfs.btrfs` fails.
    pub fn mkfs(dir: &Path, name: &str, size: u64) -> Result<Image, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = dir.join(name);
        let _ = std::fs::remove_file(&path);
        let f = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        f.set_len(size).map_err(|e| format!("{}: {e}", path.display()))?;
        drop(f);
        run_cmd(Command::new("mkfs.btrfs").args(["-f", "-q"]).arg(&path))?;
        Ok(Image { path, keep: false })
    }

    /// `btrfs check --readonly`: Ok, or the checker's output.
    ///
    /// # Errors
    /// The checker's complaint.
    pub fn check(&self) -> Result<(), String> {
        run_cmd(
            Command::new("btrfs")
                .args(["check", "--readonly", "--check-data-csum"])
                .arg(&self.path),
        )
        .map(|_| ())
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// fs_mark-style names: 8 hex digits, 8 '~', 24 random [0-9A-Z] (40 bytes), from a
/// fixed seed so every run and variant creates the same names.
pub struct Names {
    state: u64,
    prefix: String,
}

impl Names {
    pub fn new(seed: u64) -> Names {
        Names { state: seed | 1, prefix: format!("{:08x}~~~~~~~~", (seed >> 16) as u32) }
    }
    fn next_u64(&mut self) -> u64 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn next_name(&mut self) -> String {
        const ALNUM: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ";
        let mut s = self.prefix.clone();
        let mut r = self.next_u64();
        for i in 0..24 {
            if i == 12 {
                r = self.next_u64();
            }
            s.push(ALNUM[(r % 36) as usize] as char);
            r /= 36;
        }
        s
    }
}

#[derive(Clone, Copy, Debug)]
pub struct CommitPolicy {
    pub every_files: u64,
    pub every: Duration,
}

#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub files: u64,
    pub dirs: u64,
    /// Files go to the directories round-robin (like fs_mark threads, one dir each)
    /// when true, else `files / dirs` per directory in turn (fs_mark `-D -N`).
    pub round_robin: bool,
    pub policy: CommitPolicy,
    pub seed: u64,
}

#[derive(Debug, Default)]
pub struct CreateStats {
    pub commits: u64,
    pub commit_time: Duration,
}

/// Make `dirs` directories under `parent` named 00, 01, ... (fs_mark's subdirectories).
///
/// # Errors
/// Library errors, as text.
pub fn make_dirs(w: &mut FsWriter, parent: u64, n: u64) -> Result<Vec<u64>, String> {
    (0..n)
        .map(|i| {
            w.mkdir(FS_TREE, parent, format!("{i:02}").as_bytes(), &InodeAttrs::new(0o755))
                .map_err(|e| format!("mkdir {i:02}: {e}"))
        })
        .collect()
}

/// Create the workload's empty files in `dirs`, committing by `policy` and at the end.
///
/// # Errors
/// Library errors, as text.
pub fn create_files(w: &mut FsWriter, dirs: &[u64], wl: &Workload) -> Result<CreateStats, String> {
    let mut names = Names::new(wl.seed);
    let mut st = CreateStats::default();
    let mut since_commit = 0u64;
    let mut last_commit = Instant::now();
    let per_dir = wl.files.div_ceil(dirs.len() as u64).max(1);
    let attrs = InodeAttrs::new(0o644);
    for i in 0..wl.files {
        let dir = if wl.round_robin {
            dirs[(i % dirs.len() as u64) as usize]
        } else {
            dirs[((i / per_dir) as usize).min(dirs.len() - 1)]
        };
        let name = names.next_name();
        w.create_file(FS_TREE, dir, name.as_bytes(), &attrs)
            .map_err(|e| format!("create {name}: {e}"))?;
        since_commit += 1;
        if since_commit >= wl.policy.every_files || last_commit.elapsed() >= wl.policy.every {
            let t = Instant::now();
            w.commit().map_err(|e| format!("commit: {e}"))?;
            st.commit_time += t.elapsed();
            st.commits += 1;
            since_commit = 0;
            last_commit = Instant::now();
        }
    }
    let t = Instant::now();
    w.commit().map_err(|e| format!("final commit: {e}"))?;
    st.commit_time += t.elapsed();
    st.commits += 1;
    Ok(st)
}

/// Distribution summary of nanosecond samples.
#[derive(Clone, Copy, Debug, Default)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub total: f64,
}

pub fn summarize(samples: &[u32]) -> Summary {
    if samples.is_empty() {
        return Summary::default();
    }
    let mut v: Vec<u32> = samples.to_vec();
    v.sort_unstable();
    let total: f64 = v.iter().map(|&x| f64::from(x)).sum();
    // Nearest-rank percentiles.
    let pct = |p: f64| {
        f64::from(v[(((p / 100.0) * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1])
    };
    Summary {
        n: v.len(),
        mean: total / v.len() as f64,
        median: pct(50.0),
        p90: pct(90.0),
        p99: pct(99.0),
        max: f64::from(v[v.len() - 1]),
        total,
    }
}

pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Print a markdown table.
pub fn print_table(header: &[&str], rows: &[Vec<String>]) {
    println!("| {} |", header.join(" | "));
    println!(
        "|{}",
        (0..header.len()).map(|i| if i == 0 { ":---|" } else { "---:|" }).collect::<String>()
    );
    for r in rows {
        println!("| {} |", r.join(" | "));
    }
}
