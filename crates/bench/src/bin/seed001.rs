//! Seed 001: the cost of finding the inodes an extent-map shrinker run can free from,
//! when most in-memory inodes have no extent maps, with the kernel's scan against
//! ubtrfs's registry, side by side in one run.
//!
//! Workload (the thread's micro benchmark, in memory): `--empty` in-memory inodes with
//! no extent maps (the thread's 100,000 empty files kept open; stat'ed files and
//! directories), plus `--mapped` inodes created last, with the highest inode numbers,
//! each with `--maps` extent maps (the thread's 200 files of 1 MiB: 256 maps of 4 KiB
//! that cannot merge). Each round refills the maps (the thread re-reads the files) and
//! then frees all of them (its `drop_caches`), once per variant, variants alternating:
//! - kernel: `find_first_inode_to_shrink` as the kernel has it: under the root's
//!   inode-map lock, from `last_ino + 1`, write-trylock every in-memory inode's tree,
//!   check whether it is empty, unlock and go on; the first with maps is handed back
//!   and scanned. (The kernel hands it back with the tree lock held; here the lock is
//!   dropped and taken again for the scan, one more uncontended trylock per inode with
//!   maps, a few hundred per run against the walk's hundred thousand.)
//! - kernel + seed patch: the same walk, skipping an inode whose tree looks empty
//!   without its lock before the trylock (`ExtentMapTree::len_unlocked`), as seed 001
//!   proposes.
//! - ubtrfs: `ExtentMapShrinker::free_extent_maps`: batches of 64 entries of the
//!   registry of inodes that have maps, copied under its lock, trylocked outside it.
//!
//! Both free the same maps of the same `Inode` objects through the same tree guard,
//! so the difference is the search; each run also times its freeing, and the rest of
//! the run is the search. Reported: time per run, search time per run and per inode
//! walked (medians over rounds), and tree-lock attempts per run; idle and with `--readers`
//! threads looking maps up in random inodes meanwhile (the tree's read lock, so some
//! trylocks fail).
//!
//!     cargo run --release -p ubtrfs-bench --bin seed001 -- [--empty N] [--mapped M] [--rounds R]

#[path = "common/mod.rs"]
pub mod common;

use clap::Parser;
use common::{median, print_table};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use ubtrfs_core::ids::InodeId;
use ubtrfs_core::inode::inode_cache::{Inode, InodeCache};
use ubtrfs_core::mapping::extent_map::ExtentMap;
use ubtrfs_core::mapping::extent_map_shrinker::ExtentMapShrinker;

#[derive(Parser, Debug)]
#[command(
    about = "seed 001: extent-map shrinker search, kernel scan of every inode vs registry of inodes with maps"
)]
pub struct Args {
    /// In-memory inodes without extent maps.
    #[arg(long, default_value_t = 100_000)]
    pub empty: u64,
    /// Inodes with extent maps (created last: the highest inode numbers).
    #[arg(long, default_value_t = 200)]
    pub mapped: u64,
    /// Extent maps per mapped inode (256: a 1 MiB file of 4 KiB extents).
    #[arg(long, default_value_t = 256)]
    pub maps: u64,
    /// Rounds per variant and reader setting.
    #[arg(long, default_value_t = 15)]
    pub rounds: u32,
    /// Reader threads in the loaded setting.
    #[arg(long, default_value_t = 4)]
    pub readers: usize,
}

const ROOT: u64 = 5;
const FIRST_INO: u64 = 256;
const BLOCK: u64 = 4096;

/// The in-memory inodes of one root, as the kernel's per-root `inodes` xarray holds
/// them (the baseline walks it), and the same inodes' trees attached to `shrinker`.
pub struct Setup {
    pub cache: InodeCache,
    pub shrinker: Arc<ExtentMapShrinker>,
    pub root_inodes: Mutex<BTreeMap<u64, Arc<Inode>>>,
    pub mapped: Vec<Arc<Inode>>,
    pub maps: u64,
}

impl Setup {
    pub fn new(empty: u64, mapped: u64, maps: u64) -> Setup {
        let cache = InodeCache::new((empty + mapped + 16) as usize);
        let shrinker = Arc::new(ExtentMapShrinker::default());
        let mut root_inodes = BTreeMap::new();
        let mut m = Vec::new();
        for i in 0..empty + mapped {
            let ino = FIRST_INO + i;
            let inode = cache.get(InodeId { root: ROOT, ino });
            // Every inode's tree is attached, as the engine's reads attach them.
            inode.attach_extent_maps(&shrinker);
            if i >= empty {
                m.push(Arc::clone(&inode));
            }
            root_inodes.insert(ino, inode);
        }
        Setup { cache, shrinker, root_inodes: Mutex::new(root_inodes), mapped: m, maps }
    }

    /// Give every mapped inode its maps again (the thread's re-read of the files).
    pub fn refill(&self) {
        for inode in &self.mapped {
            let mut g = inode.mapping.extent_map.write();
            for i in 0..self.maps {
                // Every other disk block: adjacent in the file, not on disk, so no merge.
                g.add(ExtentMap::plain(
                    i * BLOCK,
                    BLOCK,
                    (inode.id.ino * self.maps * 2 + 2 * i) * BLOCK,
                    BLOCK,
                    0,
                ))
                .expect("a fresh range");
            }
        }
    }

    pub fn total_maps(&self) -> u64 {
        self.mapped.len() as u64 * self.maps
    }
}

/// What one run did.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunStats {
    pub ns: u64,
    /// Inodes looked at (the kernel: every in-memory inode from the cursor; ubtrfs:
    /// registry entries).
    pub walked: u64,
    /// Tree write-lock attempts.
    pub trylocks: u64,
    pub freed: u64,
    /// Of `ns`, the time spent freeing maps (the same work in every variant).
    pub free_ns: u64,
}

impl RunStats {
    /// The time spent finding inodes to shrink.
    pub fn search_ns(&self) -> u64 {
        self.ns.saturating_sub(self.free_ns)
    }
}

/// The kernel's `find_first_inode_to_shrink`: the first inode from `min_ino` whose tree
/// is not busy and has maps, walking every in-memory inode under the inode-map lock.
/// With `peek` (the seed's patch), an inode whose tree looks empty without its lock is
/// skipped before the trylock.
fn kernel_find_first(
    root: &Mutex<BTreeMap<u64, Arc<Inode>>>,
    min_ino: u64,
    peek: bool,
    st: &mut RunStats,
) -> Option<Arc<Inode>> {
    let xa = root.lock().unwrap_or_else(|p| p.into_inner());
    for (_, inode) in xa.range(min_ino..) {
        st.walked += 1;
        if peek && inode.mapping.extent_map.len_unlocked() == 0 {
            continue;
        }
        st.trylocks += 1;
        let Some(g) = inode.mapping.extent_map.try_write() else { continue };
        if g.is_empty() {
            continue;
        }
        drop(g);
        return Some(Arc::clone(inode));
    }
    None
}

/// One kernel-style run freeing up to `target` maps of `root` from `last_ino + 1`.
pub fn kernel_run(s: &Setup, target: u64, peek: bool, last_ino: &mut u64) -> RunStats {
    let mut st = RunStats::default();
    let t = Instant::now();
    let mut scanned = 0;
    let mut wrapped = false;
    while scanned < target {
        let Some(inode) =
            kernel_find_first(&s.root_inodes, last_ino.saturating_add(1), peek, &mut st)
        else {
            if wrapped || *last_ino == 0 {
                *last_ino = 0;
                break;
            }
            wrapped = true;
            *last_ino = 0;
            continue;
        };
        st.trylocks += 1;
        let t = Instant::now();
        if let Some(mut g) = inode.mapping.extent_map.try_write() {
            let (sc, fr) = g.shrink(target - scanned);
            scanned += sc;
            st.freed += fr;
        }
        st.free_ns += t.elapsed().as_nanos() as u64;
        *last_ino = inode.id.ino;
    }
    st.ns = t.elapsed().as_nanos() as u64;
    st
}

/// One ubtrfs run (`free_extent_maps`), counted from the shrinker's statistics.
pub fn ubtrfs_run(s: &Setup, target: u64) -> RunStats {
    let before = s.shrinker.stats();
    let t = Instant::now();
    assert!(s.shrinker.free_extent_maps(target), "no run was pending");
    let ns = t.elapsed().as_nanos() as u64;
    let after = s.shrinker.stats();
    let visited = after.visited - before.visited;
    RunStats {
        ns,
        walked: visited,
        trylocks: visited,
        freed: after.freed - before.freed,
        free_ns: after.free_ns - before.free_ns,
    }
}

/// Per-variant results of one reader setting.
pub struct Compared {
    pub kernel: Vec<RunStats>,
    pub patched: Vec<RunStats>,
    pub ubtrfs: Vec<RunStats>,
}

/// Run `rounds` rounds of both variants (alternating which goes first) with `readers`
/// threads looking up maps meanwhile.
///
/// # Panics
/// When a variant leaves maps behind (the comparison would be void).
pub fn compare(s: &Setup, rounds: u32, readers: usize) -> Compared {
    let stop = AtomicBool::new(false);
    let lookups = AtomicU64::new(0);
    let all: Vec<Arc<Inode>> = s.root_inodes.lock().unwrap().values().cloned().collect();
    let mut out = Compared { kernel: Vec::new(), patched: Vec::new(), ubtrfs: Vec::new() };
    std::thread::scope(|sc| {
        for r in 0..readers {
            let (all, stop, lookups) = (&all, &stop, &lookups);
            sc.spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ r as u64;
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let inode = &all[(x % all.len() as u64) as usize];
                    std::hint::black_box(
                        inode.mapping.extent_map.lookup((x >> 32) % (256 * BLOCK), BLOCK),
                    );
                    // Bursts with pauses, as readers between their I/Os: spinning
                    // readers would only starve the shrinker on a small machine.
                    if lookups.fetch_add(1, Ordering::Relaxed) % 64 == 63 {
                        std::thread::sleep(std::time::Duration::from_micros(20));
                    }
                }
            });
        }
        let mut last_ino = 0;
        for round in 0..rounds {
            let order = if round % 2 == 0 { [0, 1, 2] } else { [2, 1, 0] };
            for variant in order {
                s.refill();
                let target = s.shrinker.evictable();
                assert_eq!(target, s.total_maps(), "refill");
                let st = match variant {
                    0 => kernel_run(s, target, false, &mut last_ino),
                    1 => kernel_run(s, target, true, &mut last_ino),
                    _ => ubtrfs_run(s, target),
                };
                // A reader holding a tree makes its trylock fail; free what is left so
                // the next run starts from the same state.
                let mut left = s.shrinker.evictable();
                while left > 0 {
                    s.shrinker.free_extent_maps(left);
                    left = s.shrinker.evictable();
                }
                match variant {
                    0 => out.kernel.push(st),
                    1 => out.patched.push(st),
                    _ => out.ubtrfs.push(st),
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    s.shrinker.check_invariants();
    out
}

fn med(v: &[RunStats], f: impl Fn(&RunStats) -> f64) -> f64 {
    median(&v.iter().map(f).collect::<Vec<_>>())
}

fn main() {
    let a = Args::parse();
    eprintln!("seed001: {} inodes without maps, {} with {} maps each", a.empty, a.mapped, a.maps);
    let s = Setup::new(a.empty, a.mapped, a.maps);
    println!("## seed 001: extent-map shrinker, finding inodes to shrink\n");
    println!(
        "{} in-memory inodes without extent maps, then {} with {} maps each (highest inode numbers); each round refills the maps and frees all {} of them, once per variant, alternating; {} rounds; median per run\n",
        a.empty,
        a.mapped,
        a.maps,
        s.total_maps(),
        a.rounds
    );
    let mut rows = Vec::new();
    for readers in [0, a.readers] {
        let c = compare(&s, a.rounds, readers);
        let setting =
            if readers == 0 { "idle".to_string() } else { format!("{readers} concurrent readers") };
        let row = |name: &str, v: &[RunStats]| -> Vec<String> {
            let (t, f, w) = (
                med(v, |r| r.ns as f64),
                med(v, |r| r.search_ns() as f64),
                med(v, |r| r.walked as f64),
            );
            vec![
                setting.clone(),
                name.into(),
                format!("{:.3}", t / 1e6),
                format!("{:.3}", f / 1e6),
                format!("{w:.0}"),
                format!("{:.1}", f / w.max(1.0)),
                format!("{:.0}", med(v, |r| r.trylocks as f64)),
                format!("{:.0}", med(v, |r| r.freed as f64)),
            ]
        };
        rows.push(row("kernel scan (baseline)", &c.kernel));
        rows.push(row("kernel scan + seed patch (unlocked peek)", &c.patched));
        rows.push(row("ubtrfs registry", &c.ubtrfs));
        let ratio = |f: &dyn Fn(&RunStats) -> f64| {
            format!("{:.1}", med(&c.kernel, f) / med(&c.ubtrfs, f).max(1.0))
        };
        rows.push(vec![
            setting.clone(),
            "ratio baseline/ubtrfs".into(),
            ratio(&|r| r.ns as f64),
            ratio(&|r| r.search_ns() as f64),
            ratio(&|r| r.walked as f64),
            String::new(),
            ratio(&|r| r.trylocks as f64),
            String::new(),
        ]);
        let pr = |f: &dyn Fn(&RunStats) -> f64| {
            format!("{:.1}", med(&c.patched, f) / med(&c.ubtrfs, f).max(1.0))
        };
        rows.push(vec![
            setting,
            "ratio seed patch/ubtrfs".into(),
            pr(&|r| r.ns as f64),
            pr(&|r| r.search_ns() as f64),
            pr(&|r| r.walked as f64),
            String::new(),
            pr(&|r| r.trylocks as f64),
            String::new(),
        ]);
    }
    print_table(
        &[
            "setting",
            "variant",
            "ms per run",
            "ms searching",
            "inodes walked",
            "search ns per inode walked",
            "tree trylocks",
            "maps freed",
        ],
        &rows,
    );
    println!("\nsearching = each run's time less the time it spent freeing maps (measured inside the run; the same work in every variant)");
}
