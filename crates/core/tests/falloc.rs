//! fallocate and SEEK_DATA / SEEK_HOLE against the kernel: the same random writes,
//! truncations and fallocate calls (default, KEEP_SIZE, PUNCH_HOLE, ZERO_RANGE, and
//! the refused modes) on a kernel loop mount and through ubtrfs, compared after every
//! step: the errno, the size, the bytes, the allocated bytes (nbytes, st_blocks), where
//! SEEK_DATA and SEEK_HOLE land, and whether mtime and ctime moved; then `btrfs check`
//! and a kernel read of ubtrfs's image. With and without no-holes.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use ubtrfs_core::data::falloc::*;
use ubtrfs_core::inode::attr::SetAttr;
use ubtrfs_core::inode::filesystem::{FsRead, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsWriter;
use write_common::*;

#[derive(Debug, Clone, Copy)]
enum Op {
    Write(u64, u64),
    Fallocate(u32, u64, u64),
    Truncate(u64),
}

fn errno(r: i64) -> i32 {
    if r >= 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }
}

struct Snap {
    size: u64,
    blocks: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
    seeks: Vec<Option<u64>>,
}

fn seek_points(size: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..24).map(|i| i * 16384 + if i % 3 == 0 { 100 } else { 0 }).collect();
    v.extend([size.saturating_sub(1), size, size + 1]);
    v
}

fn kernel_snap(f: &std::fs::File) -> Snap {
    let md = f.metadata().expect("stat");
    let mut seeks = Vec::new();
    for p in seek_points(md.len()) {
        for whence in [libc::SEEK_DATA, libc::SEEK_HOLE] {
            // SAFETY: lseek on an open descriptor.
            let r = unsafe { libc::lseek(f.as_raw_fd(), p as libc::off_t, whence) };
            seeks.push(if r < 0 { None } else { Some(r as u64) });
        }
    }
    Snap {
        size: md.len(),
        blocks: md.blocks(),
        mtime: (md.mtime(), md.mtime_nsec()),
        ctime: (md.ctime(), md.ctime_nsec()),
        seeks,
    }
}

fn ubtrfs_snap(w: &FsWriter, id: InodeId) -> Snap {
    let live = w.live();
    let v = live.load_inode(id, Load { extents: true, ..Load::ITEM }).expect("inode");
    let ext = live.file_extents(id, 0, u64::MAX).expect("extents");
    let size = v.size();
    let mut seeks = Vec::new();
    for p in seek_points(size) {
        for whence in [SEEK_DATA, SEEK_HOLE] {
            seeks.push(seek_data_hole(&v.item, live.info().sectorsize, &ext, p, whence));
        }
    }
    let t = |ts: ubtrfs_format::structs::Timespec| (ts.sec.get() as i64, i64::from(ts.nsec.get()));
    Snap {
        size,
        blocks: v.item.nbytes.get() / 512,
        mtime: t(v.item.mtime),
        ctime: t(v.item.ctime),
        seeks,
    }
}

fn read_ubtrfs(w: &FsWriter, id: InodeId) -> Vec<u8> {
    let live = w.live();
    let v = live.load_inode(id, Load { extents: true, ..Load::ITEM }).expect("inode");
    let mut buf = vec![0u8; v.size() as usize];
    let n = live.read_at(&v, 0, &mut buf).expect("read");
    buf.truncate(n);
    buf
}

fn run(tag: &str, mkfs: &[&str], seed: u64, steps: usize) {
    let k = Scratch::mkfs(&format!("{tag}-k"), 512 << 20, mkfs);
    let u = Scratch::mkfs(&format!("{tag}-u"), 512 << 20, mkfs);
    std::fs::copy(&k.path, &u.path).expect("copy");
    let m = Mount::new(&k.path, true);
    let kpath = m.path("f");
    let kf = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&kpath)
        .expect("create");
    let mut w = u.writer();
    let top = w.live().root_dir();
    let ino = w.create_file(top.root, top.ino, b"f", &InodeAttrs::new(0o644)).expect("create");
    let id = InodeId { root: top.root, ino };
    let mut rng = Rng::new(seed);
    let modes = [
        0,
        FALLOC_FL_KEEP_SIZE,
        FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
        FALLOC_FL_ZERO_RANGE,
        FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE,
        FALLOC_FL_PUNCH_HOLE,
        FALLOC_FL_COLLAPSE_RANGE,
        FALLOC_FL_INSERT_RANGE,
    ];
    let mut bad = Vec::new();
    let mut history: Vec<String> = Vec::new();
    for step in 0..steps {
        let off =
            if rng.chance(50) { rng.below(400_000) / 4096 * 4096 } else { rng.below(400_000) };
        let len = if rng.chance(20) {
            rng.range(1, 200)
        } else if rng.chance(50) {
            rng.range(1, 40) * 4096
        } else {
            rng.range(1, 150_000)
        };
        let op = match rng.below(10) {
            0..=2 => Op::Write(off, len),
            3..=8 => Op::Fallocate(
                modes
                    [if rng.chance(90) { rng.below(5) as usize } else { rng.range(5, 8) as usize }],
                off,
                if rng.chance(3) { 0 } else { len },
            ),
            _ => Op::Truncate(if rng.chance(50) { off } else { off / 4096 * 4096 }),
        };
        // Times move only when the operation changes them: take a step in time first.
        std::thread::sleep(std::time::Duration::from_millis(2));
        history.push(format!("{op:?}"));
        let kb = kernel_snap(&kf);
        let ub = ubtrfs_snap(&w, id);
        // A punch of a range with no extent in it: whether the kernel moves the times
        // depends on the extent maps it has cached (find_first_non_hole looks at one),
        // so the times are not compared then.
        let punch_in_hole = match op {
            Op::Fallocate(m, o, l) if m & FALLOC_FL_PUNCH_HOLE != 0 && l > 0 => {
                w.live().file_extents(id, o, o + l).expect("extents").iter().all(|f| {
                    matches!(
                        f.kind,
                        ubtrfs_core::inode::filesystem::ExtentKind::Regular { disk_bytenr: 0, .. }
                    ) || f.end() <= o
                        || f.file_offset >= o + l
                })
            }
            _ => false,
        };
        let data = rng.bytes(len as usize);
        let (ke, ue) = match op {
            Op::Write(o, l) => {
                use std::os::unix::fs::FileExt;
                assert_eq!(l as usize, data.len());
                kf.write_all_at(&data, o).expect("kernel write");
                w.write_file(id.root, id.ino, o, &data).expect("ubtrfs write");
                (0, 0)
            }
            Op::Fallocate(mode, o, l) => {
                // SAFETY: fallocate on an open descriptor.
                let ke = errno(i64::from(unsafe {
                    libc::fallocate(kf.as_raw_fd(), mode as i32, o as libc::off_t, l as libc::off_t)
                }));
                let ue = match w.fallocate(id, mode, o, l) {
                    Ok(()) => 0,
                    Err(e) => e
                        .posix_kind()
                        .unwrap_or_else(|| panic!("{tag} step {step}: {op:?}: {e}"))
                        .errno(),
                };
                (ke, ue)
            }
            Op::Truncate(s) => {
                kf.set_len(s).expect("kernel truncate");
                w.setattr(id, &SetAttr { size: Some(s), ..Default::default() })
                    .expect("ubtrfs truncate");
                (0, 0)
            }
        };
        let (ka, ua) = (kernel_snap(&kf), ubtrfs_snap(&w, id));
        let mut diffs = Vec::new();
        if ke != ue {
            diffs.push(format!("errno kernel {ke} ubtrfs {ue}"));
        }
        if ka.size != ua.size {
            diffs.push(format!("size kernel {} ubtrfs {}", ka.size, ua.size));
        }
        if ka.blocks != ua.blocks {
            diffs.push(format!("blocks kernel {} ubtrfs {}", ka.blocks, ua.blocks));
        }
        if ka.seeks != ua.seeks {
            diffs.push(format!("seeks kernel {:?}\n      ubtrfs {:?}", ka.seeks, ua.seeks));
        }
        if !punch_in_hole && (ka.mtime != kb.mtime) != (ua.mtime != ub.mtime) {
            diffs.push(format!(
                "mtime moved: kernel {} ubtrfs {}",
                ka.mtime != kb.mtime,
                ua.mtime != ub.mtime
            ));
        }
        if !punch_in_hole && (ka.ctime != kb.ctime) != (ua.ctime != ub.ctime) {
            diffs.push(format!(
                "ctime moved: kernel {} ubtrfs {}",
                ka.ctime != kb.ctime,
                ua.ctime != ub.ctime
            ));
        }
        let kd = std::fs::read(&kpath).expect("kernel read");
        let ud = read_ubtrfs(&w, id);
        if kd != ud {
            diffs.push(format!(
                "contents differ from byte {:?}",
                kd.iter().zip(&ud).position(|(a, b)| a != b)
            ));
        }
        if !diffs.is_empty() {
            let ext: Vec<String> = w
                .live()
                .file_extents(id, 0, u64::MAX)
                .expect("extents")
                .iter()
                .map(|f| {
                    format!("{}+{} {:?}", f.file_offset, f.len(), f.kind)
                        .chars()
                        .take(160)
                        .collect()
                })
                .collect();
            diffs.push(format!("ubtrfs extents now:\n      {}", ext.join("\n      ")));
            diffs.push(format!("ops so far: {}", history.join(", ")));
            bad.push(format!(
                "{tag} seed {seed} step {step}: {op:?} (size before {}):\n    {}",
                kb.size,
                diffs.join("\n    ")
            ));
            break;
        }
        if rng.chance(8) {
            w.commit().expect("commit");
        }
    }
    drop(kf);
    m.umount();
    w.commit().expect("commit");
    drop(w);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert_check(&u.path, tag);
    assert_check(&k.path, &format!("{tag} (the kernel's image)"));
    let m = Mount::new(&u.path, false);
    let kd = {
        let km = Mount::new(&k.path, false);
        let d = std::fs::read(km.path("f")).expect("read");
        km.umount();
        d
    };
    assert!(
        std::fs::read(m.path("f")).expect("kernel reads ubtrfs's file") == kd,
        "{tag}: the kernel reads other bytes from ubtrfs's image"
    );
    m.umount();
}

#[test]
fn fallocate_matches_the_kernel() {
    if !common::kernel_available("fallocate_matches_the_kernel") {
        return;
    }
    for seed in 1..=4 {
        run("falloc", &[], seed, 150);
    }
}

#[test]
fn fallocate_matches_the_kernel_without_no_holes() {
    if !common::kernel_available("fallocate_matches_the_kernel_without_no_holes") {
        return;
    }
    for seed in 11..=13 {
        run("falloc-holes", &["-O", "^no-holes"], seed, 150);
    }
}

/// Small files kept inline (plain or compressed) that fallocate, a truncation or a
/// write past EOF takes beyond their block: the inline extent becomes a regular first
/// block (or, with KEEP_SIZE, stays and the preallocation starts at the next block),
/// and the kernel reads the same bytes from a clean image.
#[test]
fn inline_files_grow_out_of_their_extent() {
    if !common::kernel_available("inline_files_grow_out_of_their_extent") {
        return;
    }
    let img = Scratch::mkfs("falloc-inline", 256 << 20, &[]);
    let mut w = img.writer();
    w.set_compress(ubtrfs_core::compression::CompressPolicy::parse("zstd", false).unwrap());
    let top = w.live().root_dir();
    let text: Vec<u8> =
        b"inline text that compresses well ".iter().cycle().take(1500).copied().collect();
    let mut want = std::collections::BTreeMap::new();
    for (i, (name, data)) in
        [("plain", b"small file".to_vec()), ("comp", text.clone())].into_iter().enumerate()
    {
        for (j, step) in ["keep", "grow", "truncate", "write"].iter().enumerate() {
            let n = format!("{name}-{step}");
            let ino = w
                .create_file(top.root, top.ino, n.as_bytes(), &InodeAttrs::new(0o644))
                .expect("create");
            w.write_file(top.root, ino, 0, &data).expect("write");
            let mut d = data.clone();
            match *step {
                "keep" => w
                    .fallocate(InodeId { root: top.root, ino }, FALLOC_FL_KEEP_SIZE, 0, 1 << 20)
                    .expect("fallocate keep"),
                "grow" => {
                    w.fallocate(
                        InodeId { root: top.root, ino },
                        0,
                        0,
                        300_000 + i as u64 + j as u64,
                    )
                    .expect("fallocate");
                    d.resize(300_000 + i + j, 0);
                }
                "truncate" => {
                    w.setattr(
                        InodeId { root: top.root, ino },
                        &SetAttr { size: Some(100_000), ..Default::default() },
                    )
                    .expect("truncate up");
                    d.resize(100_000, 0);
                }
                _ => {
                    w.write_file(top.root, ino, 50_000, b"far away").expect("write past EOF");
                    d.resize(50_000, 0);
                    d.extend_from_slice(b"far away");
                }
            }
            assert!(read_ubtrfs(&w, InodeId { root: top.root, ino }) == d, "{n}: contents");
            want.insert(n, d);
        }
    }
    w.commit().expect("commit");
    drop(w);
    assert_check(&img.path, "inline files grown");
    let m = Mount::new(&img.path, false);
    for (n, d) in &want {
        assert!(std::fs::read(m.path(n)).expect("read") == *d, "{n}: the kernel reads other bytes");
    }
    m.umount();
}

/// The offsets a scenario seeks from: every sector boundary up to a sector past EOF,
/// the bytes just before and after it and one inside its sector, and EOF and its
/// neighbours.
fn seek_offsets(size: u64) -> Vec<u64> {
    let mut v = Vec::new();
    let mut b = 0;
    while b <= size + 4096 {
        v.extend([b.saturating_sub(1), b, b + 1, b + 1000]);
        b += 4096;
    }
    v.extend([size.saturating_sub(1), size, size + 1]);
    v.sort_unstable();
    v.dedup();
    v
}

#[derive(Debug, Clone, Copy)]
enum Step {
    /// Random bytes at an offset.
    Write(u64, u64),
    /// Bytes that compress well (for inline and compressed extents).
    Text(u64, u64),
    Fallocate(u32, u64, u64),
    Truncate(u64),
    /// fsync on the kernel's side (its delalloc becomes extents), a commit on ubtrfs's.
    Sync,
}

/// Run `steps` on one file, on a kernel mount (`mount` options) and through the
/// ubtrfs engine (its write path as a mount's); after every step SEEK_DATA and
/// SEEK_HOLE from every `seek_offsets` must land at the same place on both, or be
/// ENXIO on both. The kernel's writes stay delalloc (dirty pages) until a `Sync`, so a
/// scenario sees both the kernel's page cache and its extents.
fn seek_scenario(tag: &str, mkfs: &[&str], mount: &str, steps: &[Step]) {
    let k = Scratch::mkfs(&format!("{tag}-k"), 256 << 20, mkfs);
    let u = Scratch::mkfs(&format!("{tag}-u"), 256 << 20, mkfs);
    std::fs::copy(&k.path, &u.path).expect("copy");
    let m = Mount::new_with(&k.path, &format!("loop{mount}"));
    let kf = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(m.path("f"))
        .expect("create");
    let e = ubtrfs_core::engine::Engine::from_writer(u.writer());
    if let Some(alg) = mount.strip_prefix(",compress=") {
        let p =
            ubtrfs_core::compression::CompressPolicy::parse(alg, false).expect("compress policy");
        e.write(|w| {
            w.set_compress(p);
            Ok(())
        })
        .expect("set compress");
    }
    let id = e
        .write(|w| {
            let top = w.live().root_dir();
            Ok(InodeId {
                root: top.root,
                ino: w.create_file(top.root, top.ino, b"f", &InodeAttrs::new(0o644))?,
            })
        })
        .expect("create");
    let mut rng = Rng::new(steps.len() as u64);
    for (i, step) in steps.iter().enumerate() {
        let fail =
            |side: &str, e: &dyn std::fmt::Display| panic!("{tag} step {i}: {side} {step:?}: {e}");
        match *step {
            Step::Write(o, l) | Step::Text(o, l) => {
                use std::os::unix::fs::FileExt;
                let data = if matches!(step, Step::Text(..)) {
                    b"seek text ".iter().cycle().take(l as usize).copied().collect()
                } else {
                    rng.bytes(l as usize)
                };
                kf.write_all_at(&data, o).unwrap_or_else(|e| fail("kernel", &e));
                e.write_file(id, o, &data).unwrap_or_else(|e| fail("ubtrfs", &e));
            }
            Step::Fallocate(mode, o, l) => {
                // SAFETY: fallocate on an open descriptor.
                if unsafe {
                    libc::fallocate(kf.as_raw_fd(), mode as i32, o as libc::off_t, l as libc::off_t)
                } != 0
                {
                    fail("kernel", &std::io::Error::last_os_error());
                }
                e.write(|w| w.fallocate(id, mode, o, l)).unwrap_or_else(|e| fail("ubtrfs", &e));
            }
            Step::Truncate(s) => {
                kf.set_len(s).unwrap_or_else(|e| fail("kernel", &e));
                e.setattr(id, &SetAttr { size: Some(s), ..Default::default() })
                    .unwrap_or_else(|e| fail("ubtrfs", &e));
            }
            Step::Sync => {
                kf.sync_all().unwrap_or_else(|e| fail("kernel", &e));
                e.commit().map(drop).unwrap_or_else(|e| fail("ubtrfs", &e));
            }
        }
        let size = kf.metadata().expect("stat").len();
        let (ii, ext) = e
            .read(|l| Ok((l.load_inode(id, Load::ITEM)?.item, l.file_extents(id, 0, u64::MAX)?)))
            .expect("extents");
        assert_eq!(size, ii.size.get(), "{tag} after step {i} ({step:?}): sizes");
        for p in seek_offsets(size) {
            for whence in [SEEK_DATA, SEEK_HOLE] {
                // SAFETY: lseek on an open descriptor.
                let r = unsafe { libc::lseek(kf.as_raw_fd(), p as libc::off_t, whence) };
                let kr = (r >= 0).then_some(r as u64);
                let ur = seek_data_hole(&ii, 4096, &ext, p, whence);
                if kr != ur {
                    let ext: Vec<String> = ext
                        .iter()
                        .map(|f| {
                            format!("{}+{} {:?}", f.file_offset, f.len(), f.kind)
                                .chars()
                                .take(120)
                                .collect()
                        })
                        .collect();
                    panic!(
                        "{tag} after step {i} ({step:?}) of {steps:?}: lseek {p} {}: kernel {kr:?}, ubtrfs {ur:?}; ubtrfs's extents:\n  {}",
                        if whence == SEEK_DATA { "SEEK_DATA" } else { "SEEK_HOLE" },
                        ext.join("\n  ")
                    );
                }
            }
        }
    }
    drop(kf);
    m.umount();
    drop(e);
}

/// Both kinds of filesystem: no-holes (mkfs's default: a range without an extent is
/// a hole) and hole extents written.
const HOLE_KINDS: [&[&str]; 2] = [&[], &["-O", "^no-holes"]];

/// Data with holes between the extents, before EOF and at its end; a write into a hole
/// from inside a sector; a write past an EOF that is not sector-aligned and sits in a
/// hole (the old last block is written, as `btrfs_cont_expand` does, and becomes data);
/// and an empty file (ENXIO from anywhere).
#[test]
fn seek_holes_between_extents() {
    if !common::kernel_available("seek_holes_between_extents") {
        return;
    }
    use Step::*;
    let steps = [
        Truncate(0),
        Write(0, 5000),
        Write(65536, 4096),
        Write(200_000, 100),
        Truncate(400_000),
        Sync,
        Write(100_000, 8192),
        Truncate(150_000),
        Write(307_200, 4096),
        Sync,
        Truncate(2292),
        Write(630_784, 42),
        Sync,
    ];
    for (i, mkfs) in HOLE_KINDS.iter().enumerate() {
        seek_scenario(&format!("seek-holes-{i}"), mkfs, "", &steps);
    }
    seek_scenario(
        "seek-holes-zstd",
        &[],
        ",compress=zstd",
        &[Text(0, 300_000), Truncate(500_000), Text(409_600, 20_000), Write(450_000, 5000), Sync],
    );
}

/// Preallocated extents read as holes, with and without KEEP_SIZE, inside and past
/// EOF; writes into them are data (delalloc in a preallocated extent, then written
/// parts of it); ZERO_RANGE preallocates; a punch of preallocated blocks leaves a hole.
#[test]
fn seek_preallocated_extents() {
    if !common::kernel_available("seek_preallocated_extents") {
        return;
    }
    use Step::*;
    let steps = [
        Fallocate(FALLOC_FL_KEEP_SIZE, 0, 65536),
        Write(0, 100),
        Fallocate(0, 8192, 20_000),
        Write(12_288, 4096),
        Sync,
        Fallocate(FALLOC_FL_KEEP_SIZE, 28_192, 100_000),
        Truncate(50_000),
        Fallocate(FALLOC_FL_ZERO_RANGE, 30_000, 5000),
        Fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 40_000, 8192),
        Sync,
        Write(45_000, 3),
        Fallocate(0, 200_000, 4096),
        Write(200_000, 1000),
        Sync,
    ];
    for (i, mkfs) in HOLE_KINDS.iter().enumerate() {
        seek_scenario(&format!("seek-prealloc-{i}"), mkfs, "", &steps);
    }
}

/// Inline files (plain and compressed): data to the end of their sector, EOF inside
/// it; growth by truncation and by a write past EOF.
#[test]
fn seek_inline_files() {
    if !common::kernel_available("seek_inline_files") {
        return;
    }
    use Step::*;
    let steps = [
        Write(0, 100),
        Sync,
        Write(200, 50),
        Sync,
        Truncate(3000),
        Sync,
        Truncate(20),
        Sync,
        Write(10_000, 5),
        Sync,
    ];
    for (i, mkfs) in HOLE_KINDS.iter().enumerate() {
        seek_scenario(&format!("seek-inline-{i}"), mkfs, "", &steps);
    }
    seek_scenario(
        "seek-inline-zstd",
        &[],
        ",compress=zstd",
        &[Text(0, 3000), Sync, Truncate(1000), Sync, Text(1000, 1500), Sync, Truncate(8000), Sync],
    );
}

/// What the kernel's rules give for files no kernel operation makes, so made by hand:
/// an inline extent counts as data to the end of its sector, past its own length when
/// the file is longer (`btrfs_file_extent_end`); data past EOF is none; and the
/// shortcut of a file whose nbytes equal its size.
#[test]
fn seek_inline_extent_covers_its_sector() {
    use ubtrfs_core::inode::filesystem::{ExtentKind, FileExtentRec};
    use zerocopy::FromZeros;
    let mut ii = ubtrfs_format::structs::InodeItem::new_zeroed();
    ii.size = 5000.into();
    ii.nbytes = 100.into();
    let ext = [FileExtentRec {
        file_offset: 0,
        generation: 1,
        kind: ExtentKind::Inline { ram_bytes: 100, compression: 0, data: vec![1; 100] },
    }];
    assert_eq!(seek_data_hole(&ii, 4096, &ext, 0, SEEK_HOLE), Some(4096));
    assert_eq!(seek_data_hole(&ii, 4096, &ext, 200, SEEK_DATA), Some(200));
    assert_eq!(seek_data_hole(&ii, 4096, &ext, 4096, SEEK_DATA), None);
    assert_eq!(seek_data_hole(&ii, 4096, &ext, 4096, SEEK_HOLE), Some(4096));
    // Data past EOF (which no kernel operation leaves, but an image may have) is none.
    let far = [FileExtentRec {
        file_offset: 8192,
        generation: 1,
        kind: ExtentKind::Regular {
            disk_bytenr: 1 << 20,
            disk_num_bytes: 4096,
            offset: 0,
            num_bytes: 4096,
            ram_bytes: 4096,
            compression: 0,
            prealloc: false,
        },
    }];
    assert_eq!(seek_data_hole(&ii, 4096, &far, 100, SEEK_DATA), None);
    assert_eq!(seek_data_hole(&ii, 4096, &far, 100, SEEK_HOLE), Some(100));
    // nbytes equal to the size and no PREALLOC flag: EOF at once.
    ii.nbytes = 5000.into();
    assert_eq!(seek_data_hole(&ii, 4096, &ext, 0, SEEK_HOLE), Some(5000));
}

/// Small files, where an inline extent, a hole or a preallocated block is all there is:
/// a punch over an inline extent drops it; a punch that starts past EOF in the EOF
/// block writes that block (`btrfs_truncate_block` makes it data, preallocated or a
/// hole); truncating a small file keeps a hole or a preallocated first block as it is
/// (only data becomes inline); ZERO_RANGE past an EOF inside a block looks at its edge
/// after that block is written. Found by posix_diff seeds 1010, 1024, 1060, 1110, 1125,
/// 2040.
#[test]
fn seek_small_files() {
    if !common::kernel_available("seek_small_files") {
        return;
    }
    use Step::*;
    let p = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE;
    let cases: [&[Step]; 12] = [
        &[Write(0, 28), Truncate(2809), Fallocate(p, 0, 88_989)],
        &[Write(0, 23), Fallocate(p, 0, 160_817)],
        &[Write(0, 23), Fallocate(p, 10, 5000), Sync, Fallocate(p, 0, 4096)],
        &[Write(0, 100), Fallocate(p, 20, 30), Sync],
        &[Truncate(2394), Truncate(533), Truncate(38)],
        &[Fallocate(0, 0, 1226), Truncate(533), Sync, Write(0, 1226), Truncate(533), Sync],
        &[Fallocate(FALLOC_FL_ZERO_RANGE, 0, 995), Fallocate(p, 2498, 294_872)],
        &[Truncate(995), Fallocate(p, 2498, 3000), Sync],
        &[Fallocate(FALLOC_FL_KEEP_SIZE, 0, 8192), Truncate(1000), Fallocate(p, 1500, 100)],
        &[Truncate(389), Fallocate(FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 3823, 28_672)],
        &[Truncate(389), Fallocate(FALLOC_FL_ZERO_RANGE, 3823, 28_672), Sync],
        &[
            Truncate(5000),
            Fallocate(FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, 6000, 10_000),
            Sync,
        ],
    ];
    for (i, mkfs) in HOLE_KINDS.iter().enumerate() {
        for (j, steps) in cases.iter().enumerate() {
            seek_scenario(&format!("seek-small-{i}-{j}"), mkfs, "", steps);
        }
    }
}
