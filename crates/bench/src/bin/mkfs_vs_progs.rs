//! `ubtrfs mkfs` against `mkfs.btrfs` (btrfs-progs), both sides in one run, alternating,
//! medians:
//!
//! (a) `--rootdir` of about 1 GiB of mixed files (a few large, many medium, very many
//!     small, in nested directories; incompressible data);
//! (b) `--rootdir` of a tree of 100,000 small files (0-4 KiB) in 1,000 directories;
//! (c) an empty filesystem on a 100 GiB sparse image.
//!
//! Each run makes a fresh sparse image of `--size-gib` (100 GiB for (c)); mkfs.btrfs
//! runs as `mkfs.btrfs -f -q [--rootdir DIR] IMG`, ubtrfs as the library does for
//! `ubtrfs mkfs [--rootdir DIR] IMG` (`mkfs::make_filesystem`, then `populate` and a
//! commit). Time is wall time to the end of the command (both flush before they
//! return); bytes are the image file's allocated blocks afterwards (what the image
//! uses on the host). Both sides' images pass `btrfs check --readonly` (first run).
//! The source trees are generated once under `--workdir` from a fixed seed and kept
//! for later runs.
//!
//!     cargo build --release -p ubtrfs-bench && target/release/mkfs_vs_progs [--runs 3]

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::{have, median, print_table, run_cmd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    about = "ubtrfs mkfs vs mkfs.btrfs: --rootdir of a mixed 1 GiB tree and of 100k small files, and an empty 100 GiB image"
)]
struct Args {
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Image size for the --rootdir shapes.
    #[arg(long, default_value_t = 4)]
    size_gib: u64,
    #[arg(long, default_value = "/var/tmp/ubtrfs-bench/mkfs_vs_progs")]
    workdir: PathBuf,
    /// Run only `mixed`, `small` or `empty`.
    #[arg(long)]
    only: Option<String>,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// The source trees: made once, marked complete by a stamp file.
fn make_tree(dir: &Path, shape: &str) -> Result<u64, String> {
    let stamp = dir.join(".complete");
    if stamp.exists() {
        return std::fs::read_to_string(&stamp)
            .map_err(|e| e.to_string())?
            .trim()
            .parse()
            .map_err(|e| format!("{e}"));
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut rng = Rng(0x5eed_0000 + shape.len() as u64);
    let mut total = 0u64;
    let mut buf = vec![0u8; 32 << 20];
    let mut write = |rng: &mut Rng, p: &Path, n: usize| -> Result<(), String> {
        rng.fill(&mut buf[..n]);
        std::fs::write(p, &buf[..n]).map_err(|e| format!("{}: {e}", p.display()))
    };
    match shape {
        "mixed" => {
            // ~1 GiB: 10 x 32 MiB, 340 x ~1 MiB, 34,000 x ~10 KiB.
            for i in 0..10 {
                let d = dir.join(format!("large/{i}"));
                std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
                write(&mut rng, &d.join("blob"), 32 << 20)?;
                total += 32 << 20;
            }
            for i in 0..340 {
                let d = dir.join(format!("medium/{}", i % 17));
                std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
                let n = (768 << 10) + rng.below(512 << 10) as usize;
                write(&mut rng, &d.join(format!("m{i}")), n)?;
                total += n as u64;
            }
            for i in 0..34_000 {
                let d = dir.join(format!("small/{}/{}", i % 40, (i / 40) % 25));
                std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
                let n = rng.below(20 << 10) as usize;
                write(&mut rng, &d.join(format!("s{i}")), n)?;
                total += n as u64;
            }
        }
        "small" => {
            for i in 0..100_000 {
                let d = dir.join(format!("d{}", i % 1000));
                if i < 1000 {
                    std::fs::create_dir_all(&d).map_err(|e| e.to_string())?;
                }
                let n = rng.below(4097) as usize;
                write(&mut rng, &d.join(format!("f{i}")), n)?;
                total += n as u64;
            }
        }
        _ => unreachable!("shape {shape}"),
    }
    std::fs::write(&stamp, total.to_string()).map_err(|e| e.to_string())?;
    Ok(total)
}

fn sparse(path: &Path, size: u64) -> Result<(), String> {
    let _ = std::fs::remove_file(path);
    std::fs::File::create(path)
        .and_then(|f| f.set_len(size))
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn allocated(path: &Path) -> Result<u64, String> {
    Ok(std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?.blocks() * 512)
}

/// mkfs.btrfs; (seconds, allocated bytes).
fn progs(img: &Path, size: u64, rootdir: Option<&Path>, check: bool) -> Result<(f64, u64), String> {
    sparse(img, size)?;
    let mut c = Command::new("mkfs.btrfs");
    c.args(["-f", "-q"]);
    if let Some(r) = rootdir {
        c.arg("--rootdir").arg(r);
    }
    c.arg(img);
    let t = Instant::now();
    run_cmd(&mut c)?;
    let secs = t.elapsed().as_secs_f64();
    if check {
        run_cmd(Command::new("btrfs").args(["check", "--readonly"]).arg(img))?;
    }
    Ok((secs, allocated(img)?))
}

/// ubtrfs, through the library as `ubtrfs mkfs` does; (seconds, allocated bytes).
fn ours(img: &Path, size: u64, rootdir: Option<&Path>, check: bool) -> Result<(f64, u64), String> {
    use ubtrfs_tools::mkfs::{make_filesystem, MkfsOptions};
    use ubtrfs_tools::populate::{populate, PopulateOptions};
    sparse(img, size)?;
    let t = Instant::now();
    make_filesystem(img, size, &MkfsOptions::default()).map_err(|e| format!("mkfs: {e}"))?;
    if let Some(r) = rootdir {
        let w = ubtrfs_core::FsWriter::open(&ubtrfs_core::OpenOptions {
            writable: true,
            cache_bytes: 256 << 20,
            ..ubtrfs_core::OpenOptions::new(img)
        })
        .map_err(|e| e.to_string())?;
        let opts = PopulateOptions {
            put: ubtrfs_tools::put::PutOptions { recursive: true, ..Default::default() },
            default_subvol: None,
        };
        let e = ubtrfs_tools::offline_engine(ubtrfs_core::Engine::from_writer(w));
        populate(&e, r, &opts).map_err(|e| e.to_string())?;
        e.sync().map_err(|e| e.to_string())?;
    }
    let secs = t.elapsed().as_secs_f64();
    if check {
        run_cmd(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(img))?;
    }
    Ok((secs, allocated(img)?))
}

fn main() {
    let a = Args::parse();
    if !have("mkfs.btrfs") || !have("btrfs") {
        println!("mkfs_vs_progs: skipped: mkfs.btrfs and btrfs (btrfs-progs) are needed");
        return;
    }
    if let Err(e) = std::fs::create_dir_all(&a.workdir) {
        println!("mkfs_vs_progs: {}: {e}", a.workdir.display());
        std::process::exit(2);
    }
    let shapes: Vec<&str> = ["mixed", "small", "empty"]
        .into_iter()
        .filter(|s| a.only.as_deref().is_none_or(|o| o == *s))
        .collect();
    let mut rows = Vec::new();
    let mut failed = false;
    for shape in shapes {
        let (src, size, what) = match shape {
            "empty" => (None, 100u64 << 30, "empty mkfs, 100 GiB sparse image".to_string()),
            s => {
                let dir = a.workdir.join(format!("src-{s}"));
                let total = match make_tree(&dir, s) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("mkfs_vs_progs: {s}: {e}");
                        failed = true;
                        continue;
                    }
                };
                let files = if s == "mixed" { "about 34,350 files" } else { "100,000 files" };
                (Some(dir), a.size_gib << 30, format!("--rootdir, {files}, {} MiB", total >> 20))
            }
        };
        let img_p = a.workdir.join("progs.img");
        let img_u = a.workdir.join("ubtrfs.img");
        let (mut tp, mut tu, mut bp, mut bu) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for r in 0..a.runs {
            let check = r == 0;
            let order: [bool; 2] = if r % 2 == 0 { [true, false] } else { [false, true] };
            for progs_side in order {
                let res = if progs_side {
                    progs(&img_p, size, src.as_deref(), check)
                } else {
                    ours(&img_u, size, src.as_deref(), check)
                };
                match res {
                    Ok((s, b)) => {
                        eprintln!(
                            "mkfs_vs_progs: {shape} run {} {}: {s:.2} s, {} bytes allocated",
                            r + 1,
                            if progs_side { "mkfs.btrfs" } else { "ubtrfs" },
                            b
                        );
                        if progs_side {
                            tp.push(s);
                            bp.push(b as f64);
                        } else {
                            tu.push(s);
                            bu.push(b as f64);
                        }
                    }
                    Err(e) => {
                        eprintln!(
                            "mkfs_vs_progs: {shape} {}: {e}",
                            if progs_side { "mkfs.btrfs" } else { "ubtrfs" }
                        );
                        failed = true;
                    }
                }
            }
        }
        let _ = std::fs::remove_file(&img_p);
        let _ = std::fs::remove_file(&img_u);
        if tp.is_empty() || tu.is_empty() {
            continue;
        }
        let (mp, mu) = (median(&tp), median(&tu));
        let (sp, su) = (median(&bp), median(&bu));
        rows.push(vec![
            what,
            format!("{mp:.3} s"),
            format!("{mu:.3} s"),
            format!("{:.2}x", mp / mu),
            format!("{:.1} MiB", sp / 1048576.0),
            format!("{:.1} MiB", su / 1048576.0),
            format!("{:.3}", su / sp),
        ]);
    }
    println!("## mkfs: ubtrfs vs mkfs.btrfs ({} run(s) per side, medians)\n", a.runs);
    print_table(
        &[
            "benchmark",
            "mkfs.btrfs",
            "ubtrfs",
            "ubtrfs speed-up",
            "mkfs.btrfs image",
            "ubtrfs image",
            "bytes (ubtrfs / mkfs.btrfs)",
        ],
        &rows,
    );
    if failed {
        std::process::exit(1);
    }
}
