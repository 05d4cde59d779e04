//! fsync through the log tree, in the library, against the kernel's btrfs and against
//! the engine's own fsync by full commit, all three measured in one run (root only: the
//! kernel side needs a loop mount; without root it says why and exits 0).
//!
//! (a) randfsync: a `--file-mib` MiB file written and made durable (untimed), then
//!     `--fsyncs` times a 4 KiB write at a random block-aligned offset followed by an
//!     fsync of the file. Kernel: pwrite(2) + fsync(2) on a loop mount. ubtrfs log:
//!     `Engine::buffered_write` + `Engine::fsync` (the log tree). ubtrfs commit: the same
//!     write, then the file's writeback and a commit (what fsync did before the log).
//! (b) createfsync: `--files` new files in one directory, each created, given 4 KiB and
//!     fsynced (the log carries the new name, as the kernel's does).
//! (c) parfsync: `--threads` threads, each with its own file of `--file-mib` /
//!     `--threads` MiB, each making `--fsyncs` / `--threads` random 4 KiB writes with an
//!     fsync after each, all at once: concurrent fsyncs share log syncs on both sides
//!     (the kernel's log transactions; `Engine::fsync` on ubtrfs). The commit side makes
//!     each thread's file durable by a commit, commits one at a time.
//!
//! Every run uses a fresh `mkfs.btrfs` image (sparse, `--size-gib`) in `--workdir`;
//! the three sides alternate; medians over `--runs`; ratios are kernel time / ubtrfs
//! time and commit time / log time (above 1: the second is faster). After the first
//! ubtrfs runs each image passes `btrfs check --readonly --check-data-csum`.
//!
//!     cargo build --release -p ubtrfs-bench && target/release/fsync_vs_kernel [--runs 3]

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::{have, is_root, median, print_table, run_cmd, Image};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::{Engine, InodeId, OpenOptions};

#[derive(Parser, Debug)]
#[command(about = "fsync through the log tree vs the kernel and vs a full commit per fsync")]
struct Args {
    /// Runs per side; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: u32,
    /// Size of the file the random writes go to, in MiB.
    #[arg(long, default_value_t = 64)]
    file_mib: u64,
    /// Random 4 KiB writes, each followed by an fsync.
    #[arg(long, default_value_t = 2048)]
    fsyncs: u64,
    /// New files for createfsync.
    #[arg(long, default_value_t = 10_000)]
    files: u64,
    /// Threads of parfsync.
    #[arg(long, default_value_t = 4)]
    threads: u64,
    /// Image size in GiB.
    #[arg(long, default_value_t = 2)]
    size_gib: u64,
    /// Where the images go.
    #[arg(long, default_value = "/var/tmp/ubtrfs-bench")]
    workdir: PathBuf,
}

const TOP: InodeId = InodeId { root: 5, ino: 256 };

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Kernel,
    Log,
    Commit,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Kernel => "kernel (mount -o loop)",
            Side::Log => "ubtrfs fsync (log tree)",
            Side::Commit => "ubtrfs fsync by commit",
        }
    }
}

/// Offsets of the random writes: the same for every side and run.
fn offsets(a: &Args) -> Vec<u64> {
    let blocks = a.file_mib * 256;
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..a.fsyncs)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % blocks) * 4096
        })
        .collect()
}

fn open_engine(img: &Path) -> Result<Engine, String> {
    Engine::open(&OpenOptions { writable: true, ..OpenOptions::new(img) })
        .map_err(|e| e.to_string())
}

/// Make `id` durable as `side` does on the library.
fn sync_file(e: &Engine, id: InodeId, side: Side) -> Result<(), String> {
    match side {
        Side::Log => e.fsync(id).map(|_| ()),
        _ => e.writeback_inode(id).and_then(|()| e.commit().map(|_| ())),
    }
    .map_err(|err| err.to_string())
}

/// Run `f` on the kernel's loop mount of `img` at `mnt`, then unmount.
fn kernel_mounted(
    img: &Image,
    mnt: &Path,
    f: impl FnOnce(&Path) -> Result<f64, String>,
) -> Result<f64, String> {
    std::fs::create_dir_all(mnt).map_err(|e| e.to_string())?;
    run_cmd(Command::new("mount").args(["-o", "loop"]).arg(&img.path).arg(mnt))?;
    let r = f(mnt);
    run_cmd(Command::new("umount").arg(mnt))?;
    r
}

fn randfsync(a: &Args, side: Side, img: &Image, mnt: &Path) -> Result<f64, String> {
    let block = vec![0xa5u8; 4096];
    let offs = offsets(a);
    let file = vec![0x5au8; (a.file_mib << 20) as usize];
    if side == Side::Kernel {
        return kernel_mounted(img, mnt, |mnt| {
            let p = mnt.join("f");
            std::fs::write(&p, &file).map_err(|e| e.to_string())?;
            let f = std::fs::OpenOptions::new().write(true).open(&p).map_err(|e| e.to_string())?;
            f.sync_all().map_err(|e| e.to_string())?;
            run_cmd(&mut Command::new("sync"))?;
            let t = Instant::now();
            for &o in &offs {
                f.write_all_at(&block, o).map_err(|e| e.to_string())?;
                f.sync_all().map_err(|e| e.to_string())?;
            }
            Ok(t.elapsed().as_secs_f64())
        });
    }
    let e = open_engine(&img.path)?;
    let id = e.create_file(TOP, b"f", &InodeAttrs::new(0o100644), 0).map_err(|e| e.to_string())?;
    e.buffered_write(id, 0, &file).map_err(|e| e.to_string())?;
    e.sync().map_err(|e| e.to_string())?;
    let t = Instant::now();
    for &o in &offs {
        e.buffered_write(id, o, &block).map_err(|e| e.to_string())?;
        sync_file(&e, id, side)?;
    }
    let dt = t.elapsed().as_secs_f64();
    e.sync().map_err(|e| e.to_string())?;
    Ok(dt)
}

fn createfsync(a: &Args, side: Side, img: &Image, mnt: &Path) -> Result<f64, String> {
    let data = vec![0x3cu8; 4096];
    if side == Side::Kernel {
        return kernel_mounted(img, mnt, |mnt| {
            let d = mnt.join("d");
            std::fs::create_dir(&d).map_err(|e| e.to_string())?;
            run_cmd(&mut Command::new("sync"))?;
            let t = Instant::now();
            for i in 0..a.files {
                let p = d.join(format!("file-{i:06}"));
                let mut f = std::fs::File::create(&p).map_err(|e| e.to_string())?;
                std::io::Write::write_all(&mut f, &data).map_err(|e| e.to_string())?;
                f.sync_all().map_err(|e| e.to_string())?;
            }
            Ok(t.elapsed().as_secs_f64())
        });
    }
    let e = open_engine(&img.path)?;
    let a2 = InodeAttrs::new(0o40755);
    let dir = e.mkdir(TOP, b"d", &a2, 0).map_err(|e| e.to_string())?;
    e.sync().map_err(|e| e.to_string())?;
    let t = Instant::now();
    for i in 0..a.files {
        let name = format!("file-{i:06}");
        let id = e
            .create_file(dir, name.as_bytes(), &InodeAttrs::new(0o100644), 0)
            .map_err(|e| e.to_string())?;
        e.buffered_write(id, 0, &data).map_err(|e| e.to_string())?;
        sync_file(&e, id, side)?;
    }
    let dt = t.elapsed().as_secs_f64();
    e.sync().map_err(|e| e.to_string())?;
    Ok(dt)
}

fn parfsync(a: &Args, side: Side, img: &Image, mnt: &Path) -> Result<f64, String> {
    let n = a.threads.max(1);
    let per_file = (a.file_mib << 20) / n / 4096 * 4096;
    let per_thread = a.fsyncs / n;
    // Each thread's offsets, from the shared sequence, inside its file.
    let offs: Vec<Vec<u64>> = (0..n)
        .map(|t| {
            offsets(a)
                .iter()
                .skip(t as usize)
                .step_by(n as usize)
                .take(per_thread as usize)
                .map(|o| o % per_file)
                .collect()
        })
        .collect();
    let block = vec![0xa5u8; 4096];
    let file = vec![0x5au8; per_file as usize];
    if side == Side::Kernel {
        return kernel_mounted(img, mnt, |mnt| {
            let mut files = Vec::new();
            for t in 0..n {
                let p = mnt.join(format!("f{t}"));
                std::fs::write(&p, &file).map_err(|e| e.to_string())?;
                files.push(
                    std::fs::OpenOptions::new().write(true).open(&p).map_err(|e| e.to_string())?,
                );
            }
            run_cmd(&mut Command::new("sync"))?;
            let t = Instant::now();
            std::thread::scope(|sc| {
                let hs: Vec<_> = files
                    .iter()
                    .zip(&offs)
                    .map(|(f, offs)| {
                        let block = &block;
                        sc.spawn(move || -> Result<(), String> {
                            for &o in offs {
                                f.write_all_at(block, o).map_err(|e| e.to_string())?;
                                f.sync_all().map_err(|e| e.to_string())?;
                            }
                            Ok(())
                        })
                    })
                    .collect();
                hs.into_iter().try_for_each(|h| h.join().expect("thread"))
            })?;
            Ok(t.elapsed().as_secs_f64())
        });
    }
    let e = open_engine(&img.path)?;
    let mut ids = Vec::new();
    for t in 0..n {
        let name = format!("f{t}");
        let id = e
            .create_file(TOP, name.as_bytes(), &InodeAttrs::new(0o100644), 0)
            .map_err(|e| e.to_string())?;
        e.buffered_write(id, 0, &file).map_err(|e| e.to_string())?;
        ids.push(id);
    }
    e.sync().map_err(|e| e.to_string())?;
    let t = Instant::now();
    std::thread::scope(|sc| {
        let hs: Vec<_> = ids
            .iter()
            .zip(&offs)
            .map(|(&id, offs)| {
                let (e, block) = (&e, &block);
                sc.spawn(move || -> Result<(), String> {
                    for &o in offs {
                        e.buffered_write(id, o, block).map_err(|e| e.to_string())?;
                        sync_file(e, id, side)?;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().expect("thread"))
    })?;
    let dt = t.elapsed().as_secs_f64();
    if side == Side::Log {
        let st = e.log_stats();
        println!("parfsync: {} fsyncs through the log in {} log syncs", st.fsyncs, st.syncs);
    }
    e.sync().map_err(|e| e.to_string())?;
    Ok(dt)
}

fn main() {
    let a = Args::parse();
    if !is_root() || !have("mkfs.btrfs") {
        println!(
            "fsync_vs_kernel: needs root and mkfs.btrfs (the kernel side loop mounts); skipped"
        );
        return;
    }
    let sides = [Side::Kernel, Side::Log, Side::Commit];
    let mut rows = Vec::new();
    type Work = fn(&Args, Side, &Image, &Path) -> Result<f64, String>;
    let works: [(&str, Work, u64); 3] = [
        ("randfsync", randfsync, a.fsyncs),
        ("createfsync", createfsync, a.files),
        ("parfsync", parfsync, a.fsyncs / a.threads.max(1) * a.threads.max(1)),
    ];
    for (name, f, ops) in works {
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); sides.len()];
        for run in 0..a.runs {
            for (si, &side) in sides.iter().enumerate() {
                let img = Image::mkfs(&a.workdir, "fsync.img", a.size_gib << 30)
                    .unwrap_or_else(|e| panic!("mkfs: {e}"));
                let mnt = a.workdir.join("mnt");
                let t = f(&a, side, &img, &mnt)
                    .unwrap_or_else(|e| panic!("{name} {}: {e}", side.name()));
                if run == 0 && side != Side::Kernel {
                    img.check()
                        .unwrap_or_else(|e| panic!("{name} {}: btrfs check: {e}", side.name()));
                }
                println!(
                    "{name} run {} {}: {t:.2} s ({:.0} us per fsync)",
                    run + 1,
                    side.name(),
                    t * 1e6 / ops as f64
                );
                times[si].push(t);
            }
        }
        let m: Vec<f64> = times.iter().map(|v| median(v)).collect();
        rows.push(vec![
            name.to_string(),
            format!("{:.2} s", m[0]),
            format!("{:.2} s", m[1]),
            format!("{:.2} s", m[2]),
            format!("{:.2}", m[0] / m[1]),
            format!("{:.2}", m[2] / m[1]),
        ]);
    }
    println!();
    print_table(
        &["workload", "kernel", "ubtrfs log", "ubtrfs commit", "kernel/log", "commit/log"],
        &rows,
    );
}
