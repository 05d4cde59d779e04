//! The write engine against the kernel's btrfs, both measured in one run (root only:
//! the kernel side needs loop mounts; without root it says why and exits 0).
//!
//! (a) create: `--files` empty files in `--dirs` directories through the library
//!     (open + mkdirs + creates + periodic commits + final commit, the policy of
//!     `common`) against `fs_mark -S 0 -s 0 -t 1 -L 1 -k -n FILES -D DIRS -N FILES/DIRS
//!     -d MNT/bench` plus `sync -f MNT` on a loop mount of an image of the same size.
//!     fs_mark spreads files over its subdirectories the same way and its 40-byte names
//!     are what the library side uses.
//! (b) write: one `--write-gib` GiB file written sequentially through
//!     `write_file_with` in `--piece-mib` pieces, then a commit, against
//!     `xfs_io -f -c "pwrite -b 4m 0 1g" -c fsync MNT/big` (both write 0xcd bytes).
//!
//! Every run uses a fresh `mkfs.btrfs` image (sparse, `--size-gib`) in `--workdir`
//! (one filesystem for both sides, /var/tmp by default); kernel and ubtrfs alternate;
//! medians over `--runs`. After each ubtrfs run the image is checked once with
//! `btrfs check --readonly`, outside the timing.
//!
//!     cargo build --release -p ubtrfs-bench && target/release/write_vs_kernel [--runs 3]

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::{
    create_files, have, make_dirs, median, print_table, run_cmd, CommitPolicy, Image, Workload,
    FS_TREE, ROOT_DIR,
};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;

#[derive(Parser, Debug)]
#[command(
    about = "ubtrfs write engine vs the kernel: file creation (fs_mark) and a 1 GiB sequential write"
)]
struct Args {
    /// Runs per side; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Empty files for the create benchmark.
    #[arg(long, default_value_t = 100_000)]
    files: u64,
    /// Directories the files are spread over.
    #[arg(long, default_value_t = 100)]
    dirs: u64,
    /// Library side: commit after this many files ...
    #[arg(long, default_value_t = 10_000)]
    commit_every: u64,
    /// ... or after this many seconds, whichever comes first (the kernel's commit=30).
    #[arg(long, default_value_t = 30)]
    commit_secs: u64,
    /// Size of the written file in GiB.
    #[arg(long, default_value_t = 1)]
    write_gib: u64,
    /// Library side: bytes per write_file_with call, in MiB.
    #[arg(long, default_value_t = 128)]
    piece_mib: u64,
    /// Image size in GiB (sparse file), the same for both sides.
    #[arg(long, default_value_t = 4)]
    size_gib: u64,
    /// Where the images go.
    #[arg(long, default_value = "/var/tmp/ubtrfs-bench/write_vs_kernel")]
    workdir: PathBuf,
    /// Mount point of the kernel side (fs_mark wants directory paths under 40 bytes).
    #[arg(long, default_value = "/mnt/ubtrfs-wvk")]
    mnt: PathBuf,
    /// Run only `create` or only `write`.
    #[arg(long)]
    only: Option<String>,
    /// Run only the library side (for profiling).
    #[arg(long)]
    ubtrfs_only: bool,
}

/// A loop mount (`mount -o loop`, or a `losetup --direct-io=on` device), unmounted and
/// detached on drop.
struct Mount {
    at: PathBuf,
    loopdev: Option<String>,
}

impl Mount {
    fn new(img: &Path, at: &Path, dio: bool) -> Result<Mount, String> {
        std::fs::create_dir_all(at).map_err(|e| format!("{}: {e}", at.display()))?;
        if !dio {
            run_cmd(Command::new("mount").args(["-o", "loop"]).arg(img).arg(at))?;
            return Ok(Mount { at: at.to_path_buf(), loopdev: None });
        }
        let dev =
            run_cmd(Command::new("losetup").args(["-f", "--show", "--direct-io=on"]).arg(img))?
                .trim()
                .to_string();
        if let Err(e) = run_cmd(Command::new("mount").arg(&dev).arg(at)) {
            let _ = run_cmd(Command::new("losetup").args(["-d", &dev]));
            return Err(e);
        }
        Ok(Mount { at: at.to_path_buf(), loopdev: Some(dev) })
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = run_cmd(Command::new("umount").arg(&self.at)) {
            eprintln!("write_vs_kernel: {e}");
        }
        if let Some(d) = &self.loopdev {
            let _ = run_cmd(Command::new("losetup").args(["-d", d]));
        }
    }
}

fn sync_all() {
    let _ = Command::new("sync").status();
}

/// One timed run: seconds, and for ubtrfs the `btrfs check` verdict and a breakdown.
struct Sample {
    secs: f64,
    check: Option<Result<(), String>>,
    breakdown: String,
}

fn kernel_create(a: &Args, img: &Image, mnt: &Path, dio: bool) -> Result<Sample, String> {
    let m = Mount::new(&img.path, mnt, dio)?;
    let dir = m.at.join("bench");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    sync_all();
    let per_dir = a.files.div_ceil(a.dirs);
    let t = Instant::now();
    run_cmd(
        Command::new("fs_mark")
            .args(["-S", "0", "-s", "0", "-t", "1", "-L", "1", "-k"])
            .args([
                "-n",
                &a.files.to_string(),
                "-D",
                &a.dirs.to_string(),
                "-N",
                &per_dir.to_string(),
            ])
            .arg("-d")
            .arg(&dir)
            // fs_mark writes fs_log.txt into its working directory; keep it out of the repo.
            .current_dir(&a.workdir),
    )?;
    run_cmd(Command::new("sync").arg("-f").arg(&m.at))?;
    let secs = t.elapsed().as_secs_f64();
    Ok(Sample { secs, check: None, breakdown: String::new() })
}

fn ubtrfs_create(a: &Args, img: &Image) -> Result<Sample, String> {
    sync_all();
    let wl = Workload {
        files: a.files,
        dirs: a.dirs,
        round_robin: false,
        policy: CommitPolicy {
            every_files: a.commit_every,
            every: Duration::from_secs(a.commit_secs),
        },
        seed: 0x00f5_3a4b,
    };
    let t = Instant::now();
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).map_err(|e| format!("open: {e}"))?;
    let t_open = t.elapsed();
    let bench = w
        .mkdir(FS_TREE, ROOT_DIR, b"bench", &InodeAttrs::new(0o755))
        .map_err(|e| format!("mkdir bench: {e}"))?;
    let dirs = make_dirs(&mut w, bench, a.dirs)?;
    let st = create_files(&mut w, &dirs, &wl)?;
    drop(w);
    let secs = t.elapsed().as_secs_f64();
    let breakdown = format!(
        "open {:.3} s, creates {:.3} s, {} commits {:.3} s",
        t_open.as_secs_f64(),
        secs - t_open.as_secs_f64() - st.commit_time.as_secs_f64(),
        st.commits,
        st.commit_time.as_secs_f64()
    );
    Ok(Sample { secs, check: Some(img.check()), breakdown })
}

fn kernel_write(a: &Args, img: &Image, mnt: &Path, dio: bool) -> Result<Sample, String> {
    let m = Mount::new(&img.path, mnt, dio)?;
    sync_all();
    let t = Instant::now();
    run_cmd(
        Command::new("xfs_io")
            .arg("-f")
            .args(["-c", &format!("pwrite -b 4m 0 {}g", a.write_gib), "-c", "fsync"])
            .arg(m.at.join("big")),
    )?;
    let secs = t.elapsed().as_secs_f64();
    Ok(Sample { secs, check: None, breakdown: String::new() })
}

fn ubtrfs_write(a: &Args, img: &Image) -> Result<Sample, String> {
    sync_all();
    let total = a.write_gib << 30;
    let piece = a.piece_mib << 20;
    let t = Instant::now();
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).map_err(|e| format!("open: {e}"))?;
    let t_open = t.elapsed();
    let ino = w
        .create_file(FS_TREE, ROOT_DIR, b"big", &InodeAttrs::new(0o644))
        .map_err(|e| format!("create big: {e}"))?;
    let mut off = 0;
    while off < total {
        let n = piece.min(total - off);
        w.write_file_with(FS_TREE, ino, off, n, &mut |buf: &mut [u8]| {
            buf.fill(0xcd);
            Ok(())
        })
        .map_err(|e| format!("write at {off}: {e}"))?;
        off += n;
    }
    let t_written = t.elapsed();
    w.commit().map_err(|e| format!("commit: {e}"))?;
    drop(w);
    let secs = t.elapsed().as_secs_f64();
    let breakdown = format!(
        "open {:.3} s, write {:.3} s, commit {:.3} s",
        t_open.as_secs_f64(),
        (t_written - t_open).as_secs_f64(),
        secs - t_written.as_secs_f64()
    );
    Ok(Sample { secs, check: Some(img.check()), breakdown })
}

#[derive(Clone, Copy, PartialEq)]
enum Side {
    /// `mount -o loop` (util-linux default: buffered loop device).
    KernelLoop,
    /// `losetup --direct-io=on` + mount: no double caching of the image.
    KernelLoopDio,
    Ubtrfs,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::KernelLoop => "kernel (mount -o loop)",
            Side::KernelLoopDio => "kernel (loop, direct-io=on)",
            Side::Ubtrfs => "ubtrfs",
        }
    }
}

type RunFn<'a> = &'a dyn Fn(Side, &Image) -> Result<Sample, String>;

fn main() {
    let a = Args::parse();
    if !common::is_root() {
        println!("write_vs_kernel: skipped: the kernel side needs root (loop mounts); run as root");
        return;
    }
    for tool in ["mkfs.btrfs", "btrfs", "mount", "umount", "losetup", "xfs_io"] {
        if !have(tool) {
            println!("write_vs_kernel: skipped: {tool} not found");
            return;
        }
    }
    let do_create = a.only.as_deref().is_none_or(|o| o == "create");
    let do_write = a.only.as_deref().is_none_or(|o| o == "write");
    if do_create && !have("fs_mark") && !a.ubtrfs_only {
        println!("write_vs_kernel: fs_mark not found (apt-get install fsmark)");
        std::process::exit(2);
    }
    let size = a.size_gib << 30;
    let mnt = a.mnt.clone();
    let sides: Vec<Side> = if a.ubtrfs_only {
        vec![Side::Ubtrfs]
    } else {
        vec![Side::KernelLoop, Side::KernelLoopDio, Side::Ubtrfs]
    };
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    let mut failed = false;
    let mut bench = |name: &str, unit: &str, amount: f64, run: RunFn| {
        let mut secs: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
        for r in 0..a.runs {
            // Rotate the order so no side always runs first.
            for k in 0..sides.len() {
                let si = (k + r as usize) % sides.len();
                let side = sides[si];
                let img =
                    Image::mkfs(&a.workdir, &format!("{name}.img"), size).unwrap_or_else(|e| {
                        eprintln!("write_vs_kernel: {e}");
                        std::process::exit(1)
                    });
                let s = run(side, &img).unwrap_or_else(|e| {
                    eprintln!("write_vs_kernel: {name} {}: {e}", side.name());
                    std::process::exit(1)
                });
                eprintln!(
                    "write_vs_kernel: {name} run {} {}: {:.3} s {}",
                    r + 1,
                    side.name(),
                    s.secs,
                    s.breakdown
                );
                if let Some(c) = &s.check {
                    if let Err(e) = c {
                        eprintln!(
                            "write_vs_kernel: {name} run {}: btrfs check failed:\n{e}",
                            r + 1
                        );
                        failed = true;
                    }
                    notes.push(format!(
                        "{name} run {}: ubtrfs {:.2} s = {}; btrfs check --readonly: {}",
                        r + 1,
                        s.secs,
                        s.breakdown,
                        if c.is_ok() { "ok" } else { "FAILED" }
                    ));
                }
                secs[si].push(s.secs);
            }
        }
        let u = median(&secs[sides.len() - 1]);
        for (si, side) in sides.iter().enumerate() {
            let m = median(&secs[si]);
            let runs = secs[si].iter().map(|s| format!("{s:.2}")).collect::<Vec<_>>().join(", ");
            let ratio =
                if *side == Side::Ubtrfs { String::new() } else { format!("{:.2}x", m / u) };
            rows.push(vec![
                name.to_string(),
                side.name().to_string(),
                format!("{:.0}", amount / m),
                unit.to_string(),
                format!("{m:.3}"),
                runs,
                ratio,
            ]);
        }
    };
    if do_create {
        bench("create", "files/s", a.files as f64, &|side, img| match side {
            Side::KernelLoop => kernel_create(&a, img, &mnt, false),
            Side::KernelLoopDio => kernel_create(&a, img, &mnt, true),
            Side::Ubtrfs => ubtrfs_create(&a, img),
        });
    }
    if do_write {
        let mb = (a.write_gib << 30) as f64 / 1e6;
        bench("write", "MB/s", mb, &|side, img| match side {
            Side::KernelLoop => kernel_write(&a, img, &mnt, false),
            Side::KernelLoopDio => kernel_write(&a, img, &mnt, true),
            Side::Ubtrfs => ubtrfs_write(&a, img),
        });
    }
    println!("## ubtrfs write engine vs kernel btrfs ({} run(s) per side, medians)\n", a.runs);
    print_table(
        &[
            "benchmark",
            "side",
            "rate (median)",
            "unit",
            "median s",
            "runs (s)",
            "ubtrfs speed-up (kernel s / ubtrfs s)",
        ],
        &rows,
    );
    println!();
    println!("- create: kernel `fs_mark -S 0 -s 0 -t 1 -L 1 -k -n {} -D {} -N {} -d MNT/bench` then `sync -f MNT`, timed together; ubtrfs (in process): open + mkdir bench/00..{:02} + {} creates of empty files (fs_mark-style 40-byte names, {} per directory in turn) + commit every {} files or {} s + final commit", a.files, a.dirs, a.files.div_ceil(a.dirs), a.dirs - 1, a.files, a.files.div_ceil(a.dirs), a.commit_every, a.commit_secs);
    println!(
        "- write: kernel `xfs_io -f -c \"pwrite -b 4m 0 {}g\" -c fsync MNT/big`; ubtrfs: open + create + write_file_with in {} MiB pieces (0xcd bytes, like xfs_io) + commit",
        a.write_gib, a.piece_mib
    );
    println!("- every run on a fresh sparse {} GiB `mkfs.btrfs` image in {}; `sync` before each timed part; mount/umount and btrfs check outside the timing", a.size_gib, a.workdir.display());
    for n in notes {
        println!("- {n}");
    }
    if failed {
        std::process::exit(1);
    }
}
