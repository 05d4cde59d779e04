//! Parallel reads through one engine: `--files` files of `--file-mib` MiB each, read
//! whole (1 MiB `Engine::read_file` calls: lookups on the live view under the engine's
//! lock, data read and checksums verified without it) by one thread one
//! after the other, then by one thread per file at the same time, alternating, over
//! `--rounds` rounds. Prints the median throughput of each and the ratio (target: 4
//! threads at least 1.6x one thread on a 2-core machine).
//!
//! The files are written through the library into a fresh `mkfs.btrfs` image, which
//! stays in the page cache (one untimed pass first); every read is compared with a
//! checksum of the data written.
//!
//! `cargo build --release -p ubtrfs-bench && ./target/release/parallel_read`

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::{median, Image};
use std::path::PathBuf;
use std::time::Instant;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::filesystem::{InodeId, InodeView, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use ubtrfs_core::{FsRead, OpenOptions};

#[derive(Parser, Debug)]
#[command(
    about = "reads of several files through one engine: one thread against one thread per file"
)]
struct Args {
    #[arg(long, default_value_t = 4)]
    files: usize,
    #[arg(long, default_value_t = 256)]
    file_mib: u64,
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Where the image is made.
    #[arg(long, default_value = "/var/tmp")]
    dir: PathBuf,
}

const CHUNK: usize = 1 << 20;

/// The data of file `i`: a xorshift stream (incompressible, cheap to make again).
fn fill(i: usize, off: u64, buf: &mut [u8]) {
    for (k, c) in buf.chunks_mut(8).enumerate() {
        let mut x = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ (off / 8 + k as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x ^= x >> 31;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
}

fn digest(acc: u64, buf: &[u8]) -> u64 {
    buf.chunks(8)
        .fold(acc, |a, c| a.rotate_left(5) ^ c.iter().fold(0u64, |v, &b| (v << 8) | u64::from(b)))
}

fn read_whole(engine: &Engine, v: &InodeView) -> u64 {
    let mut buf = vec![0u8; CHUNK];
    let mut acc = 0;
    let mut pos = 0;
    while pos < v.size() {
        let n = engine.read_file(v.id, pos, &mut buf).expect("read");
        acc = digest(acc, &buf[..n]);
        pos += n as u64;
    }
    acc
}

fn main() {
    let a = Args::parse();
    let bytes = a.file_mib << 20;
    let img = Image::mkfs(
        &a.dir,
        "ubtrfs-parallel-read.img",
        (a.files as u64 * bytes) * 3 / 2 + (512 << 20),
    )
    .unwrap_or_else(|e| panic!("mkfs: {e}"));
    let mut w = FsWriter::open(&OpenOptions::new(&img.path)).expect("open");
    let mut ids = Vec::new();
    let mut want = Vec::new();
    for i in 0..a.files {
        let ino = w
            .create_file(5, 256, format!("file{i}").as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        let mut off = 0u64;
        let mut acc = 0;
        w.write_file_with(5, ino, 0, bytes, &mut |buf: &mut [u8]| {
            for piece in buf.chunks_mut(CHUNK) {
                fill(i, off, piece);
                acc = digest(acc, piece);
                off += piece.len() as u64;
            }
            Ok(())
        })
        .expect("write");
        ids.push(InodeId { root: 5, ino });
        want.push(acc);
    }
    w.commit().expect("commit");
    let engine = Engine::from_writer(w);
    let views: Vec<InodeView> = ids
        .iter()
        .map(|&id| {
            engine
                .read(|live| live.load_inode(id, Load { extents: true, ..Load::ITEM }))
                .expect("load")
        })
        .collect();
    let total = (a.files as u64 * bytes) as f64 / (1 << 20) as f64;
    let (mut one, mut many): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    // One untimed pass: the image's pages and the node cache are warm for both sides.
    for (v, w) in views.iter().zip(&want) {
        assert_eq!(read_whole(&engine, v), *w, "warm-up: data differs");
    }
    for round in 0..a.rounds {
        let t = Instant::now();
        for (v, w) in views.iter().zip(&want) {
            assert_eq!(read_whole(&engine, v), *w, "one thread: data differs");
        }
        one.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        std::thread::scope(|s| {
            let hs: Vec<_> = views.iter().map(|v| s.spawn(|| read_whole(&engine, v))).collect();
            for (h, w) in hs.into_iter().zip(&want) {
                assert_eq!(h.join().expect("reader"), *w, "threads: data differs");
            }
        });
        many.push(t.elapsed().as_secs_f64());
        eprintln!(
            "round {}: 1 thread {:.3} s, {} threads {:.3} s",
            round + 1,
            one[round],
            a.files,
            many[round]
        );
    }
    let (m1, mn) = (median(&one), median(&many));
    println!("| side | median (s) | throughput (MiB/s) |");
    println!("|---|---:|---:|");
    println!("| 1 thread, {} files in turn | {m1:.3} | {:.0} |", a.files, total / m1);
    println!("| {} threads, one file each | {mn:.3} | {:.0} |", a.files, total / mn);
    println!("ratio {} threads / 1 thread: {:.2} (target >= 1.6)", a.files, m1 / mn);
}
