//! Seed 000: `steal_from_bitmap_to_front()` with the kernel's old forward walk against
//! ubtrfs's backward word scan, on the workload of the patch report ("deleting a 4 GiB
//! file of about one million 4K extents, after scattered 4K rewrites had put the block
//! group's free space into bitmaps, made the next fsync take 29 to 36 seconds").
//!
//! The workload, on one block group of `ubtrfs_core::space::free_space_cache::FreeSpaceCtl`
//! (sectorsize 4 KiB, default `use_bitmap` policy), reproduces that sequence in userspace.
//! Every bitmap span of `n` sectors is laid out the same way:
//!
//! ```text
//! [0, n/8)                       other data, each sector free with probability 1/4
//! [n/8, n/8 + 256)               a 1 MiB hole (free: an extent entry, it is >= 1 MiB)
//! [n/8 + 256, n/8 + 256 + 2F)    the file: a 4 KiB extent every other sector, the
//!                                sector between them free (F = n/4 in the full form)
//! [n/8 + 256 + 2F, n)            other data, each sector free with probability 1/4
//! ```
//!
//! 1. fragment: the group starts free, is filled by 1 MiB allocations, then every free
//!    sector above is freed in shuffled order through `pin` + `unpin_all` (a commit every
//!    64 Ki frees). Past the extent threshold the scattered 4 KiB frees go into bitmaps.
//! 2. delete: the file's extents are pinned (`pin`), as freeing them in a transaction does.
//! 3. commit: `unpin_all` returns them lowest first, as `btrfs_finish_extent_commit` does.
//!    Each one merges with the extent entry growing from the hole, steals the free sector
//!    above it from the bitmap, and looks for free space just below the entry's start,
//!    where the bit is clear: nothing to steal. The forward walk still visits every
//!    allocated sector from bit 0 up to there; the word scan looks at one word.
//! 4. write: 4 GiB allocated by `find_space_for_alloc` in 1 MiB requests, which also takes
//!    the space out of the cache (kernel semantics), as buffered writeback would.
//!
//! Both strategies run in one process on identical input; their final states (entries,
//! bitmaps, free ranges, allocation results) must be identical.

use crate::stats::{CallStats, Stopwatch, Timing};
use ubtrfs_core::space::free_space_cache::{
    find_next_zero_bit, EntryInfo, EntryKind, FreeSpaceCtl, Unpinned,
};
use ubtrfs_core::volumes::fault::Rng;

pub const SECTOR: u64 = 4096;

/// Which scan finds the free run below a new extent entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// The kernel before seed 000: `for_each_clear_bit_from(j, bitmap, BITS_PER_BITMAP)`
    /// from bit 0, keeping the last `j <= i`.
    ForwardWalk,
    /// ubtrfs (and the seed 000 patch): backward from `i` a word at a time.
    WordScan,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::ForwardWalk => "forward walk",
            Strategy::WordScan => "word scan",
        }
    }
}

/// The baseline, kept here and only here: the kernel's loop before the change. One
/// `find_next_zero_bit` call per clear (allocated) bit below `i`.
pub fn forward_walk_last_clear(words: &[u64], i: usize) -> Option<usize> {
    let nbits = words.len() * 64;
    let mut prev = None;
    let mut j = find_next_zero_bit(words, nbits, 0);
    while j < nbits {
        if j > i {
            break;
        }
        prev = Some(j);
        j = find_next_zero_bit(words, nbits, j + 1);
    }
    prev
}

/// Workload shape; see the module docs.
#[derive(Clone, Debug)]
pub struct Config {
    pub bits: u32,
    /// Block group start.
    pub start: u64,
    /// Bitmap spans in the group (group length = spans × bits × 4 KiB).
    pub spans: u64,
    /// File extents per span (F).
    pub file_extents_per_span: u64,
    /// Other-data sectors below the hole in each span.
    pub low_sectors: u64,
    pub hole_sectors: u64,
    /// Other-data sectors are free with probability `other_free_per_1024 / 1024`.
    pub other_free_per_1024: u64,
    /// Frees per commit while fragmenting.
    pub commit_every: usize,
    pub write_bytes: u64,
    pub write_request: u64,
    pub seed: u64,
}

impl Config {
    /// 16 GiB group, 1 Mi file extents (4 GiB), 4 GiB written.
    pub fn full(bits: u32) -> Config {
        let n = u64::from(bits);
        Config {
            bits,
            start: 1 << 30,
            spans: (16u64 << 30) / (n * SECTOR),
            file_extents_per_span: n / 4,
            low_sectors: n / 8,
            hole_sectors: 256,
            other_free_per_1024: 256,
            commit_every: 65536,
            write_bytes: 4 << 30,
            write_request: 1 << 20,
            seed: 0x5eed_0000,
        }
    }

    /// The full layout on a 2 GiB group (4 spans at 131072 bits, 16 at 32768): 128 Ki
    /// front steals per run, enough for per-call statistics at a quarter of the time.
    pub fn per_call(bits: u32) -> Config {
        let n = u64::from(bits);
        Config { spans: ((2u64 << 30) / (n * SECTOR)).max(1), ..Config::full(bits) }
    }

    /// The same layout on a group of at least 256 MiB, 1024 file extents per span.
    pub fn tiny(bits: u32) -> Config {
        let n = u64::from(bits);
        Config {
            spans: ((256u64 << 20) / (n * SECTOR)).max(1),
            file_extents_per_span: 1024,
            commit_every: 4096,
            write_bytes: 8 << 20,
            ..Config::full(bits)
        }
    }

    pub fn group_length(&self) -> u64 {
        self.spans * u64::from(self.bits) * SECTOR
    }

    pub fn file_extents(&self) -> u64 {
        self.spans * self.file_extents_per_span
    }

    fn check(&self) -> Result<(), String> {
        let n = u64::from(self.bits);
        if self.low_sectors + self.hole_sectors + 2 * self.file_extents_per_span > n {
            return Err(format!("seed000: layout does not fit a {n}-sector span"));
        }
        if self.write_request == 0
            || self.write_request & (SECTOR - 1) != 0
            || self.commit_every == 0
        {
            return Err("seed000: write request must be a positive multiple of 4096".into());
        }
        Ok(())
    }

    /// The ranges freed while fragmenting (shuffled) and the file's sectors (ascending), as
    /// `(offset, bytes)`.
    fn layout(&self) -> (Vec<(u64, u64)>, Vec<u64>) {
        let n = u64::from(self.bits);
        let mut rng = Rng::new(self.seed);
        let mut frees = Vec::new();
        let mut file = Vec::with_capacity(self.file_extents() as usize);
        let at = |sector: u64| self.start + sector * SECTOR;
        for span in 0..self.spans {
            let base = span * n;
            let hole = base + self.low_sectors;
            let file_base = hole + self.hole_sectors;
            let high = file_base + 2 * self.file_extents_per_span;
            let mut other = |s: u64, frees: &mut Vec<(u64, u64)>| {
                if rng.below(1024) < self.other_free_per_1024 {
                    frees.push((at(s), SECTOR));
                }
            };
            for s in base..hole {
                other(s, &mut frees);
            }
            for s in high..base + n {
                other(s, &mut frees);
            }
            frees.push((at(hole), self.hole_sectors * SECTOR));
            for e in 0..self.file_extents_per_span {
                file.push(at(file_base + 2 * e));
                frees.push((at(file_base + 2 * e + 1), SECTOR));
            }
        }
        rng.shuffle(&mut frees);
        (frees, file)
    }
}

/// Counters of the cache at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counts {
    pub free_extents: u64,
    pub total_bitmaps: u64,
    pub free_space: u64,
    /// Free bytes held in bitmap entries.
    pub bitmap_bytes: u64,
}

impl Counts {
    fn of(ctl: &FreeSpaceCtl) -> Counts {
        let bitmap_bytes =
            ctl.entries().iter().filter(|e| e.kind == EntryKind::Bitmap).map(|e| e.bytes).sum();
        Counts {
            free_extents: ctl.free_extents(),
            total_bitmaps: ctl.total_bitmaps(),
            free_space: ctl.free_space(),
            bitmap_bytes,
        }
    }
}

/// Everything observable at the end of a run; equal across strategies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FinalState {
    pub entries: Vec<EntryInfo>,
    pub free_ranges: Vec<(u64, u64)>,
    pub counts: Counts,
    /// FNV-1a over every bitmap's words.
    pub bitmap_digest: u64,
    /// FNV-1a over the starts returned by the write phase.
    pub write_digest: u64,
}

#[derive(Clone, Debug)]
pub struct Run {
    pub strategy: Strategy,
    pub fragment: Timing,
    pub delete: Timing,
    pub commit: Timing,
    pub write: Timing,
    pub frees_while_fragmenting: u64,
    pub after_fragment: Counts,
    pub unpinned: Unpinned,
    pub writes: u64,
    pub state: FinalState,
    /// Front-steal times during the commit, when probed.
    pub front_steal_ns: Vec<u32>,
}

impl Run {
    pub fn total(&self) -> Timing {
        Timing::sum(&[self.fragment, self.delete, self.commit, self.write])
    }

    /// The part the seed measured: the delete's commit and the write after it.
    pub fn stall(&self) -> Timing {
        Timing::sum(&[self.delete, self.commit, self.write])
    }
}

/// What to run.
#[derive(Clone, Copy, Debug)]
pub struct RunOptions {
    /// Record every front steal of the commit (adds timer overhead: not for wall times).
    pub probe: bool,
    /// Run the write phase.
    pub write: bool,
}

fn fnv(h: &mut u64, x: u64) {
    for b in x.to_le_bytes() {
        *h ^= u64::from(b);
        *h = h.wrapping_mul(0x0100_0000_01b3);
    }
}

/// Run the workload once.
///
/// # Errors
/// A message when the workload cannot be laid out or the cache refuses a step (a bug in
/// the workload or in the cache).
pub fn run(cfg: &Config, strategy: Strategy, opts: RunOptions) -> Result<Run, String> {
    cfg.check()?;
    let length = cfg.group_length();
    let mut ctl =
        FreeSpaceCtl::new(cfg.start, length, SECTOR as u32, cfg.bits).map_err(|e| e.to_string())?;
    // Invariants are checked between phases, outside the timed sections.
    ctl.set_debug_checks(false);
    if strategy == Strategy::ForwardWalk {
        ctl.set_front_scan_override(Some(forward_walk_last_clear));
    }
    let (frees, file) = cfg.layout();
    let start = cfg.start;

    // 1. fragment
    let t = Stopwatch::start();
    ctl.add_free_space(start, length).map_err(|e| e.to_string())?;
    loop {
        let (got, _) = ctl.find_space_for_alloc(start, 1 << 20, 0);
        if got == 0 {
            break;
        }
    }
    if ctl.free_space() != 0 {
        return Err(format!("fill left {} bytes free", ctl.free_space()));
    }
    for batch in frees.chunks(cfg.commit_every) {
        for &(off, bytes) in batch {
            ctl.pin(off, bytes).map_err(|e| e.to_string())?;
        }
        ctl.unpin_all();
    }
    let fragment = t.stop();
    ctl.check_invariants();
    let after_fragment = Counts::of(&ctl);

    // 2. delete
    let t = Stopwatch::start();
    for &off in &file {
        ctl.pin(off, SECTOR).map_err(|e| e.to_string())?;
    }
    let delete = t.stop();
    ctl.check_invariants();

    // 3. commit
    ctl.set_front_steal_probe(opts.probe);
    let t = Stopwatch::start();
    let unpinned = ctl.unpin_all();
    let commit = t.stop();
    let front_steal_ns = ctl.take_front_steal_times();
    ctl.set_front_steal_probe(false);
    ctl.check_invariants();

    // 4. write
    let mut write_digest = 0xcbf2_9ce4_8422_2325;
    let mut writes = 0;
    let t = Stopwatch::start();
    if opts.write {
        let mut left = cfg.write_bytes;
        while left > 0 {
            let req = left.min(cfg.write_request);
            let (got, max_extent_size) = ctl.find_space_for_alloc(start, req, 0);
            if got == 0 {
                return Err(format!("write: no {req} bytes free after {writes} allocations (max_extent_size {max_extent_size})"));
            }
            fnv(&mut write_digest, got);
            writes += 1;
            left -= req;
        }
    }
    let write = t.stop();
    ctl.check_invariants();

    let mut bitmap_digest = 0xcbf2_9ce4_8422_2325;
    let entries = ctl.entries();
    for e in entries.iter().filter(|e| e.kind == EntryKind::Bitmap) {
        fnv(&mut bitmap_digest, e.offset);
        for &w in ctl.bitmap_words(e.offset).unwrap_or(&[]) {
            fnv(&mut bitmap_digest, w);
        }
    }
    let state = FinalState {
        free_ranges: ctl.free_ranges(),
        counts: Counts::of(&ctl),
        entries,
        bitmap_digest,
        write_digest,
    };
    Ok(Run {
        strategy,
        fragment,
        delete,
        commit,
        write,
        frees_while_fragmenting: frees.len() as u64,
        after_fragment,
        unpinned,
        writes,
        state,
        front_steal_ns,
    })
}

/// Per-call front-steal cost of one strategy at one bitmap size.
#[derive(Clone, Debug)]
pub struct PerCall {
    pub bits: u32,
    pub group_length: u64,
    pub strategy: Strategy,
    pub stats: CallStats,
    /// Thread CPU time of the whole commit per unpinned extent (not disturbed by
    /// preemption, unlike the per-call wall times), when known.
    pub commit_cpu_ns_per_add: Option<f64>,
}

/// Measure front-steal calls during the commit, for each bitmap size and strategy.
///
/// # Errors
/// As [`run`], or when the two strategies disagree.
pub fn per_call(configs: &[Config]) -> Result<Vec<PerCall>, String> {
    let mut out = Vec::new();
    for cfg in configs {
        let mut states = Vec::new();
        for strategy in [Strategy::ForwardWalk, Strategy::WordScan] {
            let r = run(cfg, strategy, RunOptions { probe: true, write: false })?;
            let adds = r.unpinned.ranges.max(1) as f64;
            out.push(PerCall {
                bits: cfg.bits,
                group_length: cfg.group_length(),
                strategy,
                stats: CallStats::from_samples(r.front_steal_ns),
                commit_cpu_ns_per_add: r.commit.cpu.map(|c| c.as_nanos() as f64 / adds),
            });
            states.push(r.state);
        }
        if states[0] != states[1] {
            return Err(format!("per-call runs at {} bits ended in different states", cfg.bits));
        }
    }
    Ok(out)
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / f64::from(1u32 << 30))
}

fn size(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes & ((1 << 30) - 1) == 0 {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes >> 20)
    }
}

/// The `ubtrfs-bench seed000` command: both strategies on `cfg`, then per-call costs on
/// `percall` configs; prints the tables.
///
/// # Errors
/// As [`run`], or when the strategies end in different states.
pub fn report(cfg: &Config, percall: &[Config]) -> Result<(), String> {
    use crate::stats::{ratio, ratio_opt, secs, secs_opt};
    let n = u64::from(cfg.bits);
    println!(
        "seed000: steal_from_bitmap_to_front, kernel forward walk vs ubtrfs backward word scan"
    );
    println!(
        "group: {} at {}, sectorsize 4096, {}-bit bitmaps ({} each, {} of them)",
        size(cfg.group_length()),
        size(cfg.start),
        cfg.bits,
        size(n * SECTOR),
        cfg.spans
    );
    println!(
        "file: {} extents of 4 KiB, every other sector, {} per bitmap above {} sectors of other data ({}% free)",
        cfg.file_extents(),
        cfg.file_extents_per_span,
        cfg.low_sectors,
        cfg.other_free_per_1024 * 100 / 1024
    );
    let word = run(cfg, Strategy::WordScan, RunOptions { probe: false, write: true })?;
    let walk = run(cfg, Strategy::ForwardWalk, RunOptions { probe: false, write: true })?;
    let a = &word.after_fragment;
    println!(
        "after fragmenting: {} entries ({} bitmaps), {} free, {}% of it in bitmaps",
        a.free_extents,
        a.total_bitmaps,
        gib(a.free_space),
        (a.bitmap_bytes * 100).checked_div(a.free_space).unwrap_or(0)
    );
    println!();
    println!(
        "{:<42} {:>12} {:>10} {:>8}   {:>12} {:>10} {:>8}",
        "phase", "walk wall s", "scan wall", "speedup", "walk cpu s", "scan cpu", "speedup"
    );
    let rows: [(String, Timing, Timing); 6] = [
        (
            format!("fragment: fill, free {} ranges", word.frees_while_fragmenting),
            walk.fragment,
            word.fragment,
        ),
        (format!("delete: pin {} extents", cfg.file_extents()), walk.delete, word.delete),
        (format!("commit: unpin_all, {} adds", word.unpinned.ranges), walk.commit, word.commit),
        (
            format!("write: {} in {} allocs", size(cfg.write_bytes), word.writes),
            walk.write,
            word.write,
        ),
        ("delete + commit + write (the seed's stall)".to_string(), walk.stall(), word.stall()),
        ("all phases, with the fragment setup".to_string(), walk.total(), word.total()),
    ];
    for (name, w, s) in &rows {
        println!(
            "{:<42} {:>12} {:>10} {:>8}   {:>12} {:>10} {:>8}",
            name,
            secs(w.wall),
            secs(s.wall),
            ratio(w.wall, s.wall),
            secs_opt(w.cpu),
            secs_opt(s.cpu),
            ratio_opt(w.cpu, s.cpu)
        );
    }
    if walk.state != word.state || walk.unpinned != word.unpinned {
        return Err("the two strategies ended in different free-space states".into());
    }
    let st = &word.state;
    println!(
        "final state identical: yes ({} entries, {} bitmaps, {} free, bitmaps {:016x}, writes {:016x})",
        st.counts.free_extents,
        st.counts.total_bitmaps,
        gib(st.counts.free_space),
        st.bitmap_digest,
        st.write_digest
    );
    if percall.is_empty() {
        return Ok(());
    }
    println!();
    let overhead = crate::stats::timer_overhead_ns();
    println!(
        "per-call steal_from_bitmap_to_front during the commit, same layout on a smaller group"
    );
    println!("(wall time per call, including ~{overhead} ns of timer; the mean includes preemption on a busy machine,");
    println!(" the last column does not: thread CPU time of the whole commit / number of adds)");
    println!(
        "{:<8} {:<8} {:<14} {:>9} {:>11} {:>11} {:>10} {:>10} {:>12}",
        "bits", "group", "scan", "calls", "median ns", "mean ns", "p99 ns", "max ns", "cpu ns/add"
    );
    for p in per_call(percall)? {
        let cpu = p.commit_cpu_ns_per_add.map_or_else(
            || "-".to_string(),
            |x| if x == 0.0 { "<tick".to_string() } else { format!("{x:.0}") },
        );
        println!(
            "{:<8} {:<8} {:<14} {:>9} {:>11} {:>11.0} {:>10} {:>10} {:>12}",
            p.bits,
            size(p.group_length),
            p.strategy.name(),
            p.stats.calls,
            p.stats.median_ns,
            p.stats.mean_ns,
            p.stats.p99_ns,
            p.stats.max_ns,
            cpu
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forward_walk_is_the_linear_definition() {
        let mut rng = Rng::new(3);
        for _ in 0..50 {
            let words: Vec<u64> = (0..8).map(|_| rng.next_u64() | rng.next_u64()).collect();
            for i in 0..512 {
                let want = (0..=i).rfind(|&j| words[j / 64] >> (j % 64) & 1 == 0);
                assert_eq!(forward_walk_last_clear(&words, i), want);
                assert_eq!(
                    ubtrfs_core::space::free_space_cache::find_last_clear_bit_upto(&words, i),
                    want
                );
            }
        }
    }
}
