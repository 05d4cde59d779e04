//! The POSIX surface against the kernel's btrfs, both sides in one run (root only: the
//! kernel side uses loop mounts of a same-size image; without root it says why and
//! exits 0). Every run starts from a fresh `mkfs.btrfs` image; sides alternate; medians.
//!
//! (a) names: `--files` files in `--dirs` directories, then each renamed (to a new
//!     name in the next directory), then each unlinked; ops/s per phase. Kernel: the
//!     syscalls (creat, renameat, unlinkat) on a loop mount, `sync -f` ending each
//!     phase; ubtrfs: the engine's calls, a commit every `--commit-every` operations and
//!     at the end of each phase.
//! (b) randwrite: a `--file-mib` file written and made durable first (not timed), then
//!     `--overwrites` 4 KiB writes at random 4 KiB-aligned offsets and an fsync (kernel,
//!     pwrite on the mount) or a commit (ubtrfs, `write_file`); ops/s. Then the same
//!     on a NODATACOW file (chattr +C), whose overwrites go in place.
//! (c) zstd: `--zstd-mib` of text-like data (about 3:1 with zstd) written sequentially
//!     in 4 MiB pieces with compress=zstd, then fsync / commit; MB/s, and the bytes on
//!     disk as `compsize` reports them on a kernel mount of each side's image.
//!
//!     cargo build --release -p ubtrfs-bench && target/release/posix_vs_kernel [--runs 3]

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::{have, median, print_table, run_cmd, Image, FS_TREE, ROOT_DIR};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use ubtrfs_core::compression::CompressPolicy;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;

#[derive(Parser, Debug)]
#[command(
    about = "ubtrfs POSIX operations vs the kernel: create/rename/unlink, 4 KiB random overwrites, a zstd-compressed write"
)]
struct Args {
    #[arg(long, default_value_t = 3)]
    runs: u32,
    #[arg(long, default_value_t = 100_000)]
    files: u64,
    #[arg(long, default_value_t = 100)]
    dirs: u64,
    #[arg(long, default_value_t = 10_000)]
    commit_every: u64,
    #[arg(long, default_value_t = 1024)]
    file_mib: u64,
    #[arg(long, default_value_t = 20_000)]
    overwrites: u64,
    #[arg(long, default_value_t = 1024)]
    zstd_mib: u64,
    #[arg(long, default_value_t = 4)]
    size_gib: u64,
    #[arg(long, default_value = "/var/tmp/ubtrfs-bench/posix_vs_kernel")]
    workdir: PathBuf,
    #[arg(long, default_value = "/mnt/ubtrfs-pvk")]
    mnt: PathBuf,
    /// Run only `names`, `randwrite` (both kinds), `randwrite-nocow` or `zstd`.
    #[arg(long)]
    only: Option<String>,
}

struct Mount(PathBuf);

impl Mount {
    fn new(img: &Path, at: &Path, opts: &str) -> Result<Mount, String> {
        std::fs::create_dir_all(at).map_err(|e| format!("{}: {e}", at.display()))?;
        run_cmd(Command::new("mount").args(["-o", opts]).arg(img).arg(at))?;
        Ok(Mount(at.to_path_buf()))
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if let Err(e) = run_cmd(Command::new("umount").arg(&self.0)) {
            eprintln!("posix_vs_kernel: {e}");
        }
    }
}

fn sync_fs(p: &Path) -> Result<(), String> {
    run_cmd(Command::new("sync").arg("-f").arg(p)).map(drop)
}

fn name(i: u64) -> String {
    format!("f{i:08}-{:016x}", i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Seconds of the create, rename and unlink phases.
fn kernel_names(a: &Args, img: &Image) -> Result<[f64; 3], String> {
    let m = Mount::new(&img.path, &a.mnt, "loop")?;
    let dirs: Vec<PathBuf> = (0..a.dirs).map(|d| m.0.join(format!("d{d:03}"))).collect();
    for d in &dirs {
        std::fs::create_dir(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    sync_fs(&m.0)?;
    let mut out = [0.0; 3];
    let t = Instant::now();
    for i in 0..a.files {
        std::fs::File::create(dirs[(i % a.dirs) as usize].join(name(i)))
            .map_err(|e| format!("create: {e}"))?;
    }
    sync_fs(&m.0)?;
    out[0] = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..a.files {
        let (from, to) = (
            dirs[(i % a.dirs) as usize].join(name(i)),
            dirs[((i + 1) % a.dirs) as usize].join(format!("r{}", name(i))),
        );
        std::fs::rename(&from, &to).map_err(|e| format!("rename: {e}"))?;
    }
    sync_fs(&m.0)?;
    out[1] = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..a.files {
        std::fs::remove_file(dirs[((i + 1) % a.dirs) as usize].join(format!("r{}", name(i))))
            .map_err(|e| format!("unlink: {e}"))?;
    }
    sync_fs(&m.0)?;
    out[2] = t.elapsed().as_secs_f64();
    Ok(out)
}

fn ubtrfs_names(a: &Args, img: &Image) -> Result<[f64; 3], String> {
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).map_err(|e| format!("open: {e}"))?;
    let e = |e: ubtrfs_core::Error| e.to_string();
    let dirs: Vec<u64> = (0..a.dirs)
        .map(|d| w.mkdir(FS_TREE, ROOT_DIR, format!("d{d:03}").as_bytes(), &InodeAttrs::new(0o755)))
        .collect::<Result<_, _>>()
        .map_err(e)?;
    w.commit().map_err(e)?;
    let mut out = [0.0; 3];
    let t = Instant::now();
    for i in 0..a.files {
        w.create_file(
            FS_TREE,
            dirs[(i % a.dirs) as usize],
            name(i).as_bytes(),
            &InodeAttrs::new(0o644),
        )
        .map_err(e)?;
        if (i + 1) % a.commit_every == 0 {
            w.commit().map_err(e)?;
        }
    }
    w.commit().map_err(e)?;
    out[0] = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..a.files {
        let (from, to) = (dirs[(i % a.dirs) as usize], dirs[((i + 1) % a.dirs) as usize]);
        w.rename(FS_TREE, from, name(i).as_bytes(), to, format!("r{}", name(i)).as_bytes(), 0)
            .map_err(e)?;
        if (i + 1) % a.commit_every == 0 {
            w.commit().map_err(e)?;
        }
    }
    w.commit().map_err(e)?;
    out[1] = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in 0..a.files {
        w.unlink(FS_TREE, dirs[((i + 1) % a.dirs) as usize], format!("r{}", name(i)).as_bytes())
            .map_err(e)?;
        if (i + 1) % a.commit_every == 0 {
            w.commit().map_err(e)?;
        }
    }
    w.commit().map_err(e)?;
    out[2] = t.elapsed().as_secs_f64();
    drop(w);
    img.check()?;
    Ok(out)
}

fn offsets(a: &Args) -> Vec<u64> {
    let blocks = (a.file_mib << 20) / 4096;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    (0..a.overwrites)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % blocks) * 4096
        })
        .collect()
}

fn kernel_randwrite(a: &Args, img: &Image, nocow: bool) -> Result<f64, String> {
    let m = Mount::new(&img.path, &a.mnt, "loop")?;
    let p = m.0.join("big");
    if nocow {
        std::fs::File::create(&p).map_err(|e| e.to_string())?;
        run_cmd(Command::new("chattr").arg("+C").arg(&p))?;
    }
    run_cmd(
        Command::new("xfs_io")
            .arg("-f")
            .args(["-c", &format!("pwrite -b 4m 0 {}m", a.file_mib), "-c", "fsync"])
            .arg(&p),
    )?;
    let f = std::fs::OpenOptions::new().write(true).open(&p).map_err(|e| e.to_string())?;
    let buf = vec![0x5au8; 4096];
    let offs = offsets(a);
    let t = Instant::now();
    for o in offs {
        f.write_all_at(&buf, o).map_err(|e| e.to_string())?;
    }
    let writes = t.elapsed().as_secs_f64();
    f.sync_all().map_err(|e| e.to_string())?;
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "posix_vs_kernel: randwrite{} kernel: writes {writes:.2} s, fsync {:.2} s",
        if nocow { " nocow" } else { "" },
        secs - writes
    );
    Ok(secs)
}

fn ubtrfs_randwrite(a: &Args, img: &Image, nocow: bool) -> Result<f64, String> {
    let e = |e: ubtrfs_core::Error| e.to_string();
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).map_err(e)?;
    let ino = w.create_file(FS_TREE, ROOT_DIR, b"big", &InodeAttrs::new(0o644)).map_err(e)?;
    if nocow {
        let id = ubtrfs_core::inode::filesystem::InodeId { root: FS_TREE, ino };
        w.set_fsflags(id, ubtrfs_core::inode::attr::fsflags::NOCOW).map_err(e)?;
    }
    let total = a.file_mib << 20;
    let mut off = 0;
    while off < total {
        let n = (128u64 << 20).min(total - off);
        w.write_file_with(FS_TREE, ino, off, n, &mut |b: &mut [u8]| {
            b.fill(0xcd);
            Ok(())
        })
        .map_err(e)?;
        off += n;
    }
    w.commit().map_err(e)?;
    let buf = vec![0x5au8; 4096];
    let offs = offsets(a);
    let t = Instant::now();
    for o in offs {
        w.write_file(FS_TREE, ino, o, &buf).map_err(e)?;
    }
    let writes = t.elapsed().as_secs_f64();
    w.commit().map_err(e)?;
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "posix_vs_kernel: randwrite{} ubtrfs: writes {writes:.2} s, commit {:.2} s",
        if nocow { " nocow" } else { "" },
        secs - writes
    );
    drop(w);
    img.check()?;
    Ok(secs)
}

/// Text-like bytes, about 3:1 under zstd.
fn text(n: usize) -> Vec<u8> {
    let words: [&[u8]; 16] = [
        b"btrfs",
        b"extent",
        b"checksum",
        b"subvolume",
        b"transaction",
        b"the",
        b"of",
        b"and",
        b"compress",
        b"zstd",
        b"inode",
        b"leaf",
        b"node",
        b"chunk",
        b"device",
        b"tree",
    ];
    let mut x = 0x1234_5678_9abc_def1u64;
    let mut v = Vec::with_capacity(n + 32);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(words[(x % 16) as usize]);
        v.push(if x.is_multiple_of(11) { b'\n' } else { b' ' });
        if x.is_multiple_of(7) {
            v.extend_from_slice(format!("{}", (x >> 20) % 100_000).as_bytes());
        }
    }
    v.truncate(n);
    v
}

/// compsize's "Disk Usage" of everything, in bytes, on a kernel mount of `img`.
fn disk_usage(img: &Path, at: &Path) -> Result<u64, String> {
    let m = Mount::new(img, at, "loop,ro")?;
    let out = run_cmd(Command::new("compsize").arg("-b").arg(&m.0))?;
    let line = out
        .lines()
        .find(|l| l.starts_with("TOTAL"))
        .ok_or_else(|| format!("compsize said: {out}"))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    f.get(2).and_then(|v| v.parse().ok()).ok_or_else(|| format!("compsize line: {line}"))
}

fn kernel_zstd(a: &Args, img: &Image, data: &[u8]) -> Result<(f64, u64), String> {
    let secs = {
        let m = Mount::new(&img.path, &a.mnt, "loop,compress=zstd")?;
        let f = std::fs::File::create(m.0.join("z")).map_err(|e| e.to_string())?;
        let t = Instant::now();
        for (i, c) in data.chunks(4 << 20).enumerate() {
            f.write_all_at(c, (i as u64) << 22).map_err(|e| e.to_string())?;
        }
        f.sync_all().map_err(|e| e.to_string())?;
        t.elapsed().as_secs_f64()
    };
    Ok((secs, disk_usage(&img.path, &a.mnt)?))
}

fn ubtrfs_zstd(a: &Args, img: &Image, data: &[u8]) -> Result<(f64, u64), String> {
    let e = |e: ubtrfs_core::Error| e.to_string();
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).map_err(e)?;
    w.set_compress(CompressPolicy::parse("zstd", false).map_err(e)?);
    let t = Instant::now();
    let ino = w.create_file(FS_TREE, ROOT_DIR, b"z", &InodeAttrs::new(0o644)).map_err(e)?;
    for (i, c) in data.chunks(4 << 20).enumerate() {
        w.write_file(FS_TREE, ino, (i as u64) << 22, c).map_err(e)?;
    }
    w.commit().map_err(e)?;
    let secs = t.elapsed().as_secs_f64();
    drop(w);
    img.check()?;
    Ok((secs, disk_usage(&img.path, &a.mnt)?))
}

fn main() {
    let a = Args::parse();
    if !common::is_root() {
        println!("posix_vs_kernel: skipped: the kernel side needs root (loop mounts); run as root");
        return;
    }
    for tool in ["mkfs.btrfs", "btrfs", "mount", "umount", "xfs_io", "compsize"] {
        if !have(tool) {
            println!("posix_vs_kernel: skipped: {tool} not found");
            return;
        }
    }
    let size = a.size_gib << 30;
    let fail = |what: &str, e: String| -> ! {
        eprintln!("posix_vs_kernel: {what}: {e}");
        std::process::exit(1)
    };
    let only = |n: &str| a.only.as_deref().is_none_or(|o| o == n);
    let mut rows: Vec<Vec<String>> = Vec::new();
    if only("names") {
        let (mut k, mut u) = (Vec::new(), Vec::new());
        for r in 0..a.runs {
            for side in if r % 2 == 0 { [0, 1] } else { [1, 0] } {
                let img =
                    Image::mkfs(&a.workdir, "names.img", size).unwrap_or_else(|e| fail("mkfs", e));
                let s = if side == 0 { kernel_names(&a, &img) } else { ubtrfs_names(&a, &img) }
                    .unwrap_or_else(|e| fail("names", e));
                eprintln!("posix_vs_kernel: names run {} {}: create {:.2} s, rename {:.2} s, unlink {:.2} s", r + 1, ["kernel", "ubtrfs"][side], s[0], s[1], s[2]);
                if side == 0 { &mut k } else { &mut u }.push(s);
            }
        }
        for (i, phase) in ["create", "rename", "unlink"].iter().enumerate() {
            let km = median(&k.iter().map(|s| s[i]).collect::<Vec<_>>());
            let um = median(&u.iter().map(|s| s[i]).collect::<Vec<_>>());
            rows.push(vec![
                format!("{phase} {} files", a.files),
                format!("{:.0} ops/s", a.files as f64 / km),
                format!("{:.0} ops/s", a.files as f64 / um),
                format!("{:.2}x", km / um),
            ]);
        }
    }
    for (nocow, label) in [(false, "randwrite"), (true, "randwrite-nocow")] {
        if !(only(label) || (nocow && only("randwrite"))) {
            continue;
        }
        let (mut k, mut u) = (Vec::new(), Vec::new());
        for r in 0..a.runs {
            for side in if r % 2 == 0 { [0, 1] } else { [1, 0] } {
                let img =
                    Image::mkfs(&a.workdir, "rand.img", size).unwrap_or_else(|e| fail("mkfs", e));
                let s = if side == 0 {
                    kernel_randwrite(&a, &img, nocow)
                } else {
                    ubtrfs_randwrite(&a, &img, nocow)
                }
                .unwrap_or_else(|e| fail(label, e));
                eprintln!(
                    "posix_vs_kernel: {label} run {} {}: {:.2} s",
                    r + 1,
                    ["kernel", "ubtrfs"][side],
                    s
                );
                if side == 0 { &mut k } else { &mut u }.push(s);
            }
        }
        let (km, um) = (median(&k), median(&u));
        rows.push(vec![
            format!(
                "{} x 4 KiB random overwrites of {} MiB{} + fsync/commit",
                a.overwrites,
                a.file_mib,
                if nocow { " (nodatacow: in place)" } else { "" }
            ),
            format!("{:.0} ops/s", a.overwrites as f64 / km),
            format!("{:.0} ops/s", a.overwrites as f64 / um),
            format!("{:.2}x", km / um),
        ]);
    }
    if only("zstd") {
        let data = text((a.zstd_mib << 20) as usize);
        let (mut k, mut u) = (Vec::new(), Vec::new());
        for r in 0..a.runs {
            for side in if r % 2 == 0 { [0, 1] } else { [1, 0] } {
                let img =
                    Image::mkfs(&a.workdir, "zstd.img", size).unwrap_or_else(|e| fail("mkfs", e));
                let s = if side == 0 {
                    kernel_zstd(&a, &img, &data)
                } else {
                    ubtrfs_zstd(&a, &img, &data)
                }
                .unwrap_or_else(|e| fail("zstd", e));
                eprintln!(
                    "posix_vs_kernel: zstd run {} {}: {:.2} s, {} bytes on disk",
                    r + 1,
                    ["kernel", "ubtrfs"][side],
                    s.0,
                    s.1
                );
                if side == 0 { &mut k } else { &mut u }.push(s);
            }
        }
        let mb = data.len() as f64 / 1e6;
        let (km, um) = (
            median(&k.iter().map(|s| s.0).collect::<Vec<_>>()),
            median(&u.iter().map(|s| s.0).collect::<Vec<_>>()),
        );
        let (kd, ud) = (
            median(&k.iter().map(|s| s.1 as f64).collect::<Vec<_>>()),
            median(&u.iter().map(|s| s.1 as f64).collect::<Vec<_>>()),
        );
        rows.push(vec![
            format!("{} MiB sequential write, compress=zstd", a.zstd_mib),
            format!("{:.0} MB/s", mb / km),
            format!("{:.0} MB/s", mb / um),
            format!("{:.2}x", km / um),
        ]);
        rows.push(vec![
            "  on disk (compsize)".into(),
            format!("{:.1} MiB", kd / 1048576.0),
            format!("{:.1} MiB", ud / 1048576.0),
            format!("{:.3} (ubtrfs / kernel)", ud / kd),
        ]);
    }
    println!("## POSIX operations: ubtrfs vs kernel btrfs ({} run(s) per side, medians)\n", a.runs);
    print_table(&["benchmark", "kernel", "ubtrfs", "ubtrfs speed-up"], &rows);
}
