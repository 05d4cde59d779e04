//! Opening and mounting a large image: a sparse 1 TiB image from `mkfs.btrfs` holding
//! 1M empty files in 1000 directories and a preallocated file across a quarter of the
//! space (hundreds of data block groups), made through the library once per run.
//! Each round times, alternating:
//! - `Engine::open` and one path lookup (the library);
//! - `ubtrfs mount` from spawn to a `stat` of a file through the mount (then unmounted);
//! - the kernel: `mount -o loop` to the same `stat` (then unmounted).
//!
//! The target: the FUSE mount ready in under 2 s, with no per-block-group work at open
//! (free space is cached per group on first use).
//!
//!     cargo build --release -p ubtrfs-bench -p ubtrfs && target/release/mount_scale [--runs 5]

#[path = "common/mod.rs"]
pub mod common;

use clap::Parser;
use common::{
    create_files, make_dirs, median, print_table, run_cmd, CommitPolicy, Image, Workload,
};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::filesystem::FsRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;

#[derive(Parser, Debug)]
#[command(
    about = "open and mount time of a 1 TiB image with 1M files: library open, FUSE mount, kernel mount"
)]
pub struct Args {
    #[arg(long, default_value_t = 1024)]
    pub size_gib: u64,
    #[arg(long, default_value_t = 1_000_000)]
    pub files: u64,
    #[arg(long, default_value_t = 1000)]
    pub dirs: u64,
    /// GiB preallocated in one file (data block groups).
    #[arg(long, default_value_t = 256)]
    pub prealloc_gib: u64,
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[arg(long, default_value = "/tmp")]
    pub dir: PathBuf,
}

fn mounted(dir: &Path) -> bool {
    let want = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(1).is_some_and(|m| Path::new(m) == want))
}

fn build(img: &Path, a: &Args) -> Result<String, String> {
    let mut w = FsWriter::open(&OpenOptions { writable: true, ..OpenOptions::new(img) })
        .map_err(|e| e.to_string())?;
    let top = w.live().root_dir().ino;
    let dirs = make_dirs(&mut w, top, a.dirs)?;
    let wl = Workload {
        files: a.files,
        dirs: a.dirs,
        round_robin: false,
        policy: CommitPolicy { every_files: 100_000, every: Duration::from_secs(3600) },
        seed: 7,
    };
    create_files(&mut w, &dirs, &wl)?;
    let big = w
        .create_file(5, top, b"prealloc", &ubtrfs_core::inode::write::InodeAttrs::new(0o644))
        .map_err(|e| e.to_string())?;
    for i in 0..a.prealloc_gib {
        w.fallocate(
            ubtrfs_core::inode::filesystem::InodeId { root: 5, ino: big },
            0,
            i << 30,
            1 << 30,
        )
        .map_err(|e| format!("fallocate: {e}"))?;
        if i % 16 == 15 {
            w.commit().map_err(|e| e.to_string())?;
        }
    }
    w.commit().map_err(|e| e.to_string())?;
    // A file deep in the last directory, to stat.
    let last = w
        .live()
        .readdir(ubtrfs_core::inode::filesystem::InodeId { root: 5, ino: dirs[dirs.len() - 1] })
        .map_err(|e| e.to_string())?;
    let name = String::from_utf8_lossy(&last[last.len() - 1].name).into_owned();
    Ok(format!("{:02}/{name}", a.dirs - 1))
}

fn main() {
    let a = Args::parse();
    if !common::is_root() {
        eprintln!("mount_scale: needs root (mkfs.btrfs, kernel mounts, FUSE)");
        std::process::exit(2);
    }
    let exe = std::env::current_exe().expect("this executable").with_file_name("ubtrfs");
    assert!(
        exe.is_file(),
        "build the ubtrfs binary too: cargo build --release -p ubtrfs ({})",
        exe.display()
    );
    let img = Image::mkfs(&a.dir.join("ubtrfs-mount-scale"), "img", a.size_gib << 30)
        .unwrap_or_else(|e| panic!("mkfs: {e}"));
    let t = Instant::now();
    let probe = build(&img.path, &a).unwrap_or_else(|e| panic!("build: {e}"));
    eprintln!(
        "built {} files and {} GiB preallocated in {:.1?}",
        a.files,
        a.prealloc_gib,
        t.elapsed()
    );
    img.check().unwrap_or_else(|e| panic!("btrfs check: {e}"));
    let groups = {
        let fs = ubtrfs_core::FsInfo::open(&OpenOptions::new(&img.path)).expect("open");
        fs.block_groups().expect("block groups").len()
    };
    let mnt = a.dir.join("ubtrfs-mount-scale/mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let (mut lib, mut fuse, mut kernel) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..=a.runs {
        let t = Instant::now();
        let e = Engine::open(&OpenOptions { writable: true, ..OpenOptions::new(&img.path) })
            .expect("Engine::open");
        e.read(|l| l.resolve(&probe, false)).expect("resolve");
        let tl = t.elapsed();
        drop(e);

        let t = Instant::now();
        let mut child = Command::new(&exe)
            .arg("mount")
            .arg(&img.path)
            .arg(&mnt)
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn ubtrfs mount");
        while !mounted(&mnt) {
            assert!(child.try_wait().unwrap().is_none(), "ubtrfs mount exited");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::fs::metadata(mnt.join(&probe)).expect("stat through the mount");
        let tf = t.elapsed();
        run_cmd(Command::new("fusermount3").arg("-u").arg(&mnt)).expect("fusermount3 -u");
        let _ = child.wait();

        let t = Instant::now();
        run_cmd(Command::new("mount").args(["-o", "loop"]).arg(&img.path).arg(&mnt))
            .expect("kernel mount");
        std::fs::metadata(mnt.join(&probe)).expect("stat through the kernel");
        let tk = t.elapsed();
        run_cmd(Command::new("umount").arg(&mnt)).expect("umount");
        if round > 0 {
            lib.push(tl.as_secs_f64());
            fuse.push(tf.as_secs_f64());
            kernel.push(tk.as_secs_f64());
        }
    }
    println!("{} GiB image, {} files, {groups} block groups; medians of {} rounds (one warm-up round dropped):", a.size_gib, a.files, a.runs);
    let ms = |v: &[f64]| format!("{:.1} ms", median(v) * 1e3);
    print_table(
        &[
            "",
            "library open + lookup",
            "ubtrfs mount to first stat",
            "kernel mount to first stat",
            "fuse / kernel",
        ],
        &[vec![
            "time".into(),
            ms(&lib),
            ms(&fuse),
            ms(&kernel),
            format!("{:.2}x", median(&fuse) / median(&kernel)),
        ]],
    );
}
