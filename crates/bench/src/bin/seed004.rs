//! Seed 004: the cost of writing back one dirty folio (`extent_writepage`, the part the
//! kernel patch times as `extent_writepage_io`) extent by extent (ours: one
//! ordered-extent lookup and one submission per contiguous piece) against block by
//! block (the kernel before the patch: one lookup and one submission per 4 KiB block).
//!
//! Workload: a file of `--file-mib` MiB wholly dirty in the page cache, in folios of
//! 64 KiB and of 2 MiB (the kernel's largest page-cache folio on x86_64, as in the
//! patch's `pwrite -b 2m` run), its ordered extents either large (128 MiB, the maximum
//! extent size: a folio lies in one) or fragmented (`--frag-kib`, on scattered disk
//! addresses, as delalloc makes on fragmented free space). Both modes write back the
//! same folios with the same ordered extents in the same run; every folio call is
//! timed, over `--rounds` rounds (folios re-dirtied between calls, untimed). Both modes
//! must build identical bios (checked in the first round). Reported: median, p90 and
//! mean ns per folio, and the ratio block/extent.
//!
//!     cargo run --release -p ubtrfs-bench --bin seed004 -- [--file-mib N] [--rounds R]

#[path = "common/mod.rs"]
pub mod common;

use clap::Parser;
use common::{print_table, summarize};
use std::time::Instant;
use ubtrfs_core::data::writeback::{extent_writepage, Bio, BioCtrl, SubmitMode};
use ubtrfs_core::mapping::ordered::{OrderedExtent, OrderedTree};
use ubtrfs_core::mapping::page_cache::Folio;

#[derive(Parser, Debug)]
#[command(about = "seed 004: folio writeback, extent-by-extent vs block-by-block submission")]
pub struct Args {
    /// Dirty file size per case, MiB.
    #[arg(long, default_value_t = 256)]
    pub file_mib: u64,
    /// Rounds over every folio of every case.
    #[arg(long, default_value_t = 5)]
    pub rounds: u32,
    /// Ordered-extent size of the fragmented layout, KiB.
    #[arg(long, default_value_t = 16)]
    pub frag_kib: u64,
}

const BLOCK: u32 = 4096;

/// One case: folio size and ordered-extent size.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub folio: u64,
    pub oe: u64,
    pub name: &'static str,
}

pub fn cases(frag_kib: u64) -> Vec<Case> {
    let big = 128 << 20;
    let frag = frag_kib << 10;
    vec![
        Case { folio: 64 << 10, oe: big, name: "64 KiB folio, 128 MiB extents" },
        Case { folio: 64 << 10, oe: frag, name: "64 KiB folio, fragmented" },
        Case { folio: 2 << 20, oe: big, name: "2 MiB folio, 128 MiB extents" },
        Case { folio: 2 << 20, oe: frag, name: "2 MiB folio, fragmented" },
    ]
}

/// Per-folio nanoseconds of both modes on one case: (extent, block).
pub struct CaseRun {
    pub extent: Vec<u32>,
    pub block: Vec<u32>,
    pub bios: usize,
}

fn redirty(f: &mut Folio) {
    let n = f.nblocks();
    f.writeback.clear_range(0, n);
    f.dirty.set_range(0, n);
}

/// Run `case` over a file of `file` bytes for `rounds` rounds.
///
/// # Errors
/// The modes built different bios.
pub fn run_case(case: Case, file: u64, rounds: u32) -> Result<CaseRun, String> {
    let file = file.max(case.folio).div_ceil(case.folio) * case.folio;
    let mut folios: Vec<Folio> = (0..file / case.folio)
        .map(|i| {
            let mut f = Folio::new(i * case.folio, case.folio, BLOCK);
            f.uptodate.set_range(0, f.nblocks());
            f
        })
        .collect();
    let mut tree = OrderedTree::new(BLOCK);
    let mut off = 0;
    while off < file {
        let len = case.oe.min(file - off);
        // Fragmented extents land apart on disk (every other slot), large ones in a row.
        let disk = (1 << 30) + if case.oe < case.folio { off * 2 } else { off };
        tree.insert(OrderedExtent::new(off, len, disk, BLOCK, 4, false), BLOCK);
        off += len;
    }
    let mut run = CaseRun { extent: Vec::new(), block: Vec::new(), bios: 0 };
    for r in 0..rounds {
        let order = if r % 2 == 0 {
            [SubmitMode::ExtentByExtent, SubmitMode::BlockByBlock]
        } else {
            [SubmitMode::BlockByBlock, SubmitMode::ExtentByExtent]
        };
        let mut bios: Vec<Vec<Bio>> = Vec::new();
        for mode in order {
            let mut ctrl = BioCtrl::new(mode);
            let mut all = Vec::new();
            for f in folios.iter_mut() {
                redirty(f);
                let t = Instant::now();
                let res = extent_writepage(f, &mut tree, file, &mut ctrl);
                let ns = t.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32;
                if res.submitted != f.size() {
                    return Err(format!(
                        "{}: folio {} submitted {} of {} bytes",
                        case.name,
                        f.start,
                        res.submitted,
                        f.size()
                    ));
                }
                match mode {
                    SubmitMode::ExtentByExtent => run.extent.push(ns),
                    SubmitMode::BlockByBlock => run.block.push(ns),
                }
                if r == 0 {
                    all.append(&mut ctrl.ready);
                } else {
                    ctrl.ready.clear();
                }
            }
            ctrl.submit();
            all.append(&mut ctrl.ready);
            bios.push(all);
        }
        if r == 0 {
            if bios[0] != bios[1] {
                return Err(format!(
                    "{}: the modes built different bios ({} vs {})",
                    case.name,
                    bios[0].len(),
                    bios[1].len()
                ));
            }
            run.bios = bios[0].len();
        }
    }
    Ok(run)
}

fn main() {
    let a = Args::parse();
    println!("## seed 004: writeback of one dirty folio, ns per folio\n");
    println!("{} MiB dirty per case, {} round(s), modes alternating within each round; identical bios in both modes: checked\n", a.file_mib, a.rounds);
    let mut rows = Vec::new();
    for case in cases(a.frag_kib) {
        let r = match run_case(case, a.file_mib << 20, a.rounds) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("seed004: {e}");
                std::process::exit(1);
            }
        };
        let (e, b) = (summarize(&r.extent), summarize(&r.block));
        let row = |mode: &str, s: &common::Summary| {
            vec![
                case.name.to_string(),
                mode.to_string(),
                s.n.to_string(),
                format!("{:.0}", s.median),
                format!("{:.0}", s.p90),
                format!("{:.0}", s.mean),
                r.bios.to_string(),
            ]
        };
        rows.push(row("extent by extent", &e));
        rows.push(row("block by block (baseline)", &b));
        rows.push(vec![
            case.name.to_string(),
            "ratio block/extent".into(),
            String::new(),
            format!("{:.2}", b.median / e.median.max(1.0)),
            format!("{:.2}", b.p90 / e.p90.max(1.0)),
            format!("{:.2}", b.mean / e.mean.max(1.0)),
            String::new(),
        ]);
    }
    print_table(&["case", "mode", "folios", "median", "p90", "mean", "bios"], &rows);
}
