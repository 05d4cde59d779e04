//! Seed 002: 4 KiB clone-range and dedupe-range operations, with the handle's
//! writeback-inhibition record as a fixed inline buffer (ours) against a set made for
//! each handle (the kernel's first design, an xarray; `PerHandleSet` below, installed
//! through `TestHooks::inhibit_record`),
//! and against the kernel's FICLONERANGE and FIDEDUPERANGE on a loop mount of an image
//! of the same size.
//!
//! Workload (the seed's reproducer, through the library): file A of `--ops` blocks of
//! random data, file C a second copy of A's bytes written separately (both through
//! the page cache and synced, on both sides, so both compare cached pages), file B empty;
//! then `--ops` clones of A's block i to B's block i, and `--ops` dedupes of A's
//! block i with C's block i (each finds them equal and shares). Every operation is
//! timed. Each variant runs on its own fresh image; variants alternate over `--runs`
//! rounds; figures are the medians of the rounds' medians, with the mean beside them.
//! After every library round B reads back as A; the first round of each variant is
//! checked with `btrfs check --readonly --check-data-csum`. Also printed: how many
//! blocks each handle inhibited during the operations (which sizes the buffer).
//!
//!     cargo run --release -p ubtrfs-bench --bin seed002 -- [--ops N] [--runs R] [--no-kernel]

#[path = "common/mod.rs"]
pub mod common;

use clap::Parser;
use common::{is_root, median, print_table, run_cmd, summarize, Image};
use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use ubtrfs_core::data::reflink::Dedupe;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::filesystem::InodeId;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::transaction::handle::{InhibitRecord, InhibitRecordFn};
use ubtrfs_core::OpenOptions;

#[derive(Parser, Debug)]
#[command(
    about = "seed 002: 4 KiB clone and dedupe, inline inhibition buffer vs per-handle set vs the kernel's ioctls"
)]
pub struct Args {
    /// Operations of each kind per round.
    #[arg(long, default_value_t = 10_000)]
    pub ops: u64,
    /// Rounds; each runs every variant on fresh images, in alternating order.
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Image size in GiB (sparse file).
    #[arg(long, default_value_t = 1)]
    pub size_gib: u64,
    /// Leave out the kernel's ioctls (they need root and loop devices).
    #[arg(long)]
    pub no_kernel: bool,
    /// Where the images go.
    #[arg(long, default_value = "/var/tmp/ubtrfs-bench/seed002")]
    pub workdir: PathBuf,
}

const BS: u64 = 4096;

/// The baseline's record of the blocks a handle inhibits: a set made for each handle
/// and dropped at its end, unbounded, as the kernel's first design kept an xarray in
/// every `btrfs_trans_handle`. The engine keeps this object from one handle to the
/// next; the set inside it lives for one handle.
#[derive(Default)]
pub struct PerHandleSet(BTreeSet<u64>);

impl InhibitRecord for PerHandleSet {
    fn push(&mut self, bytenr: u64) -> bool {
        self.0.insert(bytenr)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn drain(&mut self, f: &mut dyn FnMut(u64)) {
        std::mem::take(&mut self.0).into_iter().for_each(f);
    }
}

/// Make the baseline's record (`TestHooks::inhibit_record`).
pub fn per_handle_set() -> Box<dyn InhibitRecord> {
    Box::<PerHandleSet>::default()
}

/// Per-operation nanoseconds of one round: clones, dedupes.
pub struct Round {
    pub clone: Vec<u32>,
    pub dedupe: Vec<u32>,
}

pub fn data(ops: u64) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..ops * BS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn ns(t: Instant) -> u32 {
    t.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32
}

/// One library round on a fresh image; `map`: the per-handle set. Returns the
/// timings and the blocks inhibited per handle.
pub fn library_round(
    a: &Args,
    bytes: &[u8],
    map: bool,
    check: bool,
) -> Result<(Round, Vec<u16>, u64), String> {
    let img = Image::mkfs(
        &a.workdir,
        if map { "lib-map.img" } else { "lib-inline.img" },
        a.size_gib << 30,
    )?;
    let e = Engine::open(&OpenOptions::new(&img.path)).map_err(|e| format!("open: {e}"))?;
    let file = |name: &str| -> Result<InodeId, String> {
        let ino = e
            .write(|w| w.create_file(5, 256, name.as_bytes(), &InodeAttrs::new(0o644)))
            .map_err(|e| format!("create {name}: {e}"))?;
        Ok(InodeId { root: 5, ino })
    };
    let (fa, fb, fc) = (file("a")?, file("b")?, file("c")?);
    // Through the page cache, as the kernel side writes them: both keep their pages.
    for (f, name) in [(fa, "a"), (fc, "c")] {
        for (i, piece) in bytes.chunks(1 << 20).enumerate() {
            e.buffered_write(f, (i as u64) << 20, piece)
                .map_err(|e| format!("write {name}: {e}"))?;
        }
    }
    e.sync().map_err(|e| format!("sync: {e}"))?;
    e.write(|w| {
        w.hooks.inhibit_record = map.then_some(per_handle_set as InhibitRecordFn);
        w.hooks.inhibit_stats = Some(Default::default());
        Ok(())
    })
    .map_err(|e| e.to_string())?;
    // Untimed, in both variants (the trees then look the same to the timed part), and
    // for the buffer's size: handles of other changes (creates, small writes,
    // renames, unlinks) in a directory of a few thousand files.
    let other = {
        let dir = e
            .write(|w| w.mkdir(5, 256, b"d", &InodeAttrs::new(0o755)))
            .map_err(|e| e.to_string())?;
        for i in 0..3000u64 {
            let name = format!("file-{:08x}", i.wrapping_mul(0x9e37_79b9));
            let ino = e
                .write(|w| w.create_file(5, dir, name.as_bytes(), &InodeAttrs::new(0o644)))
                .map_err(|e| e.to_string())?;
            e.write_file(InodeId { root: 5, ino }, 0, &bytes[..4096 + (i as usize % 3) * 5000])
                .map_err(|e| e.to_string())?;
            if i % 3 == 0 {
                e.rename(
                    InodeId { root: 5, ino: dir },
                    name.as_bytes(),
                    InodeId { root: 5, ino: dir },
                    format!("{name}-r").as_bytes(),
                    0,
                )
                .map_err(|e| e.to_string())?;
            }
            if i % 5 == 0 {
                e.unlink(
                    InodeId { root: 5, ino: dir },
                    if i % 3 == 0 { format!("{name}-r") } else { name.clone() }.as_bytes(),
                )
                .map_err(|e| e.to_string())?;
            }
        }
        e.commit().map_err(|e| format!("commit: {e}"))?;
        let o = e
            .write(|w| Ok(w.hooks.inhibit_stats.replace(Default::default()).unwrap_or_default()))
            .map_err(|e| e.to_string())?
            .per_handle;
        if map {
            Vec::new()
        } else {
            o
        }
    };
    let mut r = Round {
        clone: Vec::with_capacity(a.ops as usize),
        dedupe: Vec::with_capacity(a.ops as usize),
    };
    for i in 0..a.ops {
        let t = Instant::now();
        e.clone_range(fa, i * BS, BS, fb, i * BS).map_err(|e| format!("clone {i}: {e}"))?;
        r.clone.push(ns(t));
    }
    for i in 0..a.ops {
        let t = Instant::now();
        let d =
            e.dedupe_range(fa, i * BS, BS, fc, i * BS).map_err(|e| format!("dedupe {i}: {e}"))?;
        r.dedupe.push(ns(t));
        if d != Dedupe::Same(BS) {
            return Err(format!("dedupe {i}: {d:?}, not the block's bytes"));
        }
    }
    let stats = e
        .write(|w| Ok(w.hooks.inhibit_stats.take().unwrap_or_default()))
        .map_err(|e| e.to_string())?;
    e.commit().map_err(|e| format!("commit: {e}"))?;
    let mut back = vec![0u8; bytes.len()];
    let n = e.read_file(fb, 0, &mut back).map_err(|e| format!("read b: {e}"))?;
    if n != bytes.len() || back != bytes {
        return Err("b does not read back as a".into());
    }
    drop(e);
    if check {
        let o = Command::new("btrfs")
            .args(["check", "--readonly", "--check-data-csum"])
            .arg(&img.path)
            .output()
            .map_err(|e| format!("btrfs check: {e}"))?;
        if !o.status.success() {
            return Err(format!(
                "btrfs check:\n{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            ));
        }
    }
    OTHER.with(|o| o.borrow_mut().extend(other));
    Ok((r, stats.per_handle, stats.full))
}

thread_local! {
    /// Blocks inhibited per handle by the untimed other changes.
    static OTHER: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[repr(C)]
struct FileCloneRange {
    src_fd: i64,
    src_offset: u64,
    src_length: u64,
    dest_offset: u64,
}

#[repr(C)]
struct FileDedupeRange {
    src_offset: u64,
    src_length: u64,
    dest_count: u16,
    reserved1: u16,
    reserved2: u32,
    dest_fd: i64,
    dest_offset: u64,
    bytes_deduped: u64,
    status: i32,
    reserved: u32,
}

const FICLONERANGE: libc::c_ulong = 0x4020_940d;
const FIDEDUPERANGE: libc::c_ulong = 0xc018_9436;

/// One kernel round: the same files on a fresh image's loop mount, then the ioctls.
pub fn kernel_round(a: &Args, bytes: &[u8]) -> Result<Round, String> {
    let img = Image::mkfs(&a.workdir, "kernel.img", a.size_gib << 30)?;
    let mnt = a.workdir.join("mnt");
    std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
    run_cmd(Command::new("mount").args(["-o", "loop"]).arg(&img.path).arg(&mnt))?;
    let r = (|| -> Result<Round, String> {
        let open = |p: &Path, write: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .create(write)
                .truncate(false)
                .open(p)
                .map_err(|e| format!("{}: {e}", p.display()))
        };
        std::fs::write(mnt.join("a"), bytes).map_err(|e| e.to_string())?;
        std::fs::write(mnt.join("c"), bytes).map_err(|e| e.to_string())?;
        let (fa, fb, fc) =
            (open(&mnt.join("a"), true)?, open(&mnt.join("b"), true)?, open(&mnt.join("c"), true)?);
        fa.sync_all().map_err(|e| e.to_string())?;
        fc.sync_all().map_err(|e| e.to_string())?;
        run_cmd(&mut Command::new("sync"))?;
        let mut r = Round {
            clone: Vec::with_capacity(a.ops as usize),
            dedupe: Vec::with_capacity(a.ops as usize),
        };
        for i in 0..a.ops {
            let arg = FileCloneRange {
                src_fd: i64::from(fa.as_raw_fd()),
                src_offset: i * BS,
                src_length: BS,
                dest_offset: i * BS,
            };
            let t = Instant::now();
            // SAFETY: FICLONERANGE with a valid file_clone_range that outlives the call.
            let rc = unsafe { libc::ioctl(fb.as_raw_fd(), FICLONERANGE, &arg) };
            r.clone.push(ns(t));
            if rc != 0 {
                return Err(format!("FICLONERANGE {i}: {}", std::io::Error::last_os_error()));
            }
        }
        for i in 0..a.ops {
            let mut arg = FileDedupeRange {
                src_offset: i * BS,
                src_length: BS,
                dest_count: 1,
                reserved1: 0,
                reserved2: 0,
                dest_fd: i64::from(fc.as_raw_fd()),
                dest_offset: i * BS,
                bytes_deduped: 0,
                status: 0,
                reserved: 0,
            };
            let t = Instant::now();
            // SAFETY: FIDEDUPERANGE with a valid file_dedupe_range holding one info entry.
            let rc = unsafe { libc::ioctl(fa.as_raw_fd(), FIDEDUPERANGE, &mut arg) };
            r.dedupe.push(ns(t));
            if rc != 0 || arg.status != 0 || arg.bytes_deduped != BS {
                return Err(format!(
                    "FIDEDUPERANGE {i}: rc {rc} status {} bytes {} ({})",
                    arg.status,
                    arg.bytes_deduped,
                    std::io::Error::last_os_error()
                ));
            }
        }
        Ok(r)
    })();
    let _ = run_cmd(Command::new("umount").arg(&mnt));
    r
}

fn main() {
    let a = Args::parse();
    if let Err(e) = run(&a) {
        eprintln!("seed002: {e}");
        std::process::exit(1);
    }
}

fn run(a: &Args) -> Result<(), String> {
    let kernel = !a.no_kernel && is_root();
    if !a.no_kernel && !kernel {
        eprintln!("seed002: not root: the kernel's ioctls are left out");
    }
    let bytes = data(a.ops);
    let names = ["inline buffer", "per-handle set", "kernel ioctl"];
    let mut med: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); 3];
    let mut mean: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); 3];
    let mut per_handle: Vec<u16> = Vec::new();
    let mut full = 0;
    for round in 0..a.runs {
        let mut order: Vec<usize> = if kernel { vec![0, 1, 2] } else { vec![0, 1] };
        let k = round as usize % order.len();
        order.rotate_left(k);
        for v in order {
            let r = match v {
                0 | 1 => {
                    let (r, ph, f) = library_round(a, &bytes, v == 1, round == 0)?;
                    if v == 0 {
                        per_handle.extend(ph);
                        full += f;
                    }
                    r
                }
                _ => kernel_round(a, &bytes)?,
            };
            let (c, d) = (summarize(&r.clone), summarize(&r.dedupe));
            eprintln!("round {round}: {:>14}: clone median {:.0} ns mean {:.0}; dedupe median {:.0} ns mean {:.0}", names[v], c.median, c.mean, d.median, d.mean);
            med[v].0.push(c.median);
            med[v].1.push(d.median);
            mean[v].0.push(c.mean);
            mean[v].1.push(d.mean);
        }
    }
    println!("{} x 4 KiB FICLONERANGE-equivalent and {} x FIDEDUPERANGE-equivalent per round, {} rounds (medians of the rounds' median ns/op; means in brackets):\n", a.ops, a.ops, a.runs);
    let mut rows = Vec::new();
    let n = if kernel { 3 } else { 2 };
    for v in 0..n {
        rows.push(vec![
            names[v].to_string(),
            format!("{:.0} ({:.0})", median(&med[v].0), median(&mean[v].0)),
            format!("{:.0} ({:.0})", median(&med[v].1), median(&mean[v].1)),
        ]);
    }
    print_table(&["variant", "clone ns/op", "dedupe ns/op"], &rows);
    let ratio = |v: usize, k: usize| {
        if k == 0 {
            median(&med[v].0) / median(&med[0].0)
        } else {
            median(&med[v].1) / median(&med[0].1)
        }
    };
    println!(
        "\nper-handle set / inline buffer: clone {:.2}x, dedupe {:.2}x",
        ratio(1, 0),
        ratio(1, 1)
    );
    if kernel {
        println!(
            "kernel ioctl / inline buffer: clone {:.2}x, dedupe {:.2}x",
            ratio(2, 0),
            ratio(2, 1)
        );
    }
    let show = |what: &str, mut v: Vec<u16>| {
        v.sort_unstable();
        if let Some(&max) = v.last() {
            let q = |p: f64| v[((p * v.len() as f64) as usize).min(v.len() - 1)];
            println!(
                "blocks inhibited per handle, {what} ({} handles): median {}, p99 {}, max {}",
                v.len(),
                q(0.5),
                q(0.99),
                max
            );
        }
    };
    show("clones and dedupes", per_handle);
    show("creates, small writes, renames, unlinks and their commits", OTHER.with(|o| o.take()));
    println!(
        "inhibitions refused for a full buffer ({} slots) during the clones and dedupes: {full}",
        ubtrfs_core::transaction::handle::INHIBIT_SLOTS
    );
    Ok(())
}
