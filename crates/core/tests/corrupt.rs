//! Damaged images must give a clean error or a correct read: never a panic, a hang or
//! unbounded memory. Each case opens a patched in-memory copy of a small kernel-made
//! fixture (an overlay over the shared image bytes, so cases do not copy the image) and
//! walks everything under `catch_unwind` in a thread with a deadline.
//!
//! Cases: a bit flip in every tree block (one copy: the other copy is read, with a
//! warning; every copy: an error naming the block), truncations, broken superblock
//! magic and checksum, node pointers aimed at themselves or their parent, unknown
//! feature bits, unsafe directory entry names given to `extract`, and the inputs the
//! fuzz targets in fuzz/ found (fuzz_regressions).

mod common;
#[path = "../../../fuzz/src/targets.rs"]
mod targets;
#[path = "../../../fuzz/src/walk.rs"]
mod walk;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use ubtrfs_core::disk_io::FsInfo;
use ubtrfs_core::inode::filesystem::Filesystem;
use ubtrfs_core::volumes::device::BlockDevice;
use ubtrfs_core::Error;
use ubtrfs_core::FsRead;
use ubtrfs_core::TreeView;
use ubtrfs_format::key::*;
use ubtrfs_format::node::{HEADER_SIZE, ITEM_SIZE, KEY_PTR_SIZE};
use ubtrfs_format::structs::{sb_offset, DirItem, Superblock, SUPER_INFO_OFFSET, SUPER_INFO_SIZE};
use ubtrfs_format::CsumType;
use walk::{
    fix_block_csum, fix_super_csum, tree_blocks, walk_summary, OverlayDevice, TreeBlock,
    WalkSummary,
};

/// Longest any single case may take (debug build, 2 cores, other builds running).
const CASE_LIMIT: Duration = Duration::from_secs(10);
const CACHE: usize = 8 << 20;

/// Load fixture `name`'s single device image into memory.
fn image(name: &str) -> Arc<Vec<u8>> {
    let paths = common::fixture_images(name);
    assert_eq!(paths.len(), 1, "{name}: expected a single-device fixture");
    Arc::new(std::fs::read(&paths[0]).expect("read fixture image"))
}

#[derive(Debug)]
enum Outcome {
    Ok { summary: WalkSummary, warnings: Vec<String> },
    Err(String),
    Panic(String),
    Hang,
}

/// Open `dev` and walk everything in a thread, catching panics, with `CASE_LIMIT`.
fn run_case(dev: OverlayDevice) -> (Outcome, Duration) {
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
            move || -> Result<(WalkSummary, Vec<String>), Error> {
                let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(dev)];
                let fs = Filesystem::from_info(FsInfo::open_devices(devs, CACHE)?)?;
                let s = walk_summary(&fs)?;
                Ok((s, fs.info.take_warnings()))
            },
        ));
        let _ = tx.send(r);
    });
    let out = match rx.recv_timeout(CASE_LIMIT) {
        Ok(Ok(Ok((summary, warnings)))) => Outcome::Ok { summary, warnings },
        Ok(Ok(Err(e))) => Outcome::Err(e.to_string()),
        Ok(Err(p)) => Outcome::Panic(
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        ),
        Err(_) => Outcome::Hang,
    };
    (out, start.elapsed())
}

/// Assert the case ended cleanly (Ok or Err) in time; return the outcome.
fn clean(label: &str, dev: OverlayDevice) -> Outcome {
    let (o, t) = run_case(dev);
    match &o {
        Outcome::Panic(m) => panic!("{label}: panicked: {m}"),
        Outcome::Hang => panic!("{label}: no result within {CASE_LIMIT:?}"),
        _ => assert!(t < CASE_LIMIT, "{label}: took {t:?}"),
    }
    o
}

fn baseline(name: &str, img: &Arc<Vec<u8>>) -> (WalkSummary, Vec<TreeBlock>, CsumType, u32) {
    let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(OverlayDevice::new(img.clone(), name))];
    let fs =
        Filesystem::from_info(FsInfo::open_devices(devs, CACHE).expect("open pristine fixture"))
            .expect("pristine fixture");
    let s = walk_summary(&fs).unwrap_or_else(|e| panic!("{name}: pristine walk failed: {e}"));
    let blocks = tree_blocks(&fs.info).expect("enumerate tree blocks");
    let w = fs.info.take_warnings();
    assert!(w.is_empty(), "{name}: pristine image warns: {w:?}");
    (s, blocks, fs.info.csum_type, fs.info.nodesize)
}

/// splitmix64: a seeded, dependency-free source of bit positions.
fn splitmix(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *seed;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A bit the checksum covers: in the stored checksum's significant bytes or in
/// `[32, nodesize)` (the csum field's zero padding is not checked, as in the kernel).
fn pick_bit(seed: &mut u64, csum: CsumType, nodesize: u32) -> (usize, u8) {
    let covered = csum.size() + nodesize as usize - 32;
    let r = (splitmix(seed) % (covered as u64 * 8)) as usize;
    let (byte, bit) = (r / 8, (r % 8) as u8);
    let byte = if byte < csum.size() { byte } else { byte - csum.size() + 32 };
    (byte, bit)
}

fn flipped(img: &Arc<Vec<u8>>, phys: u64, byte: usize, bit: u8) -> (u64, Vec<u8>) {
    let at = phys + byte as u64;
    (at, vec![img[at as usize] ^ (1 << bit)])
}

fn bitflip_every_block(name: &str, want_dup: bool) {
    let t0 = Instant::now();
    let img = image(name);
    let (base, blocks, csum, nodesize) = baseline(name, &img);
    assert!(blocks.len() > 5, "{name}: only {} tree blocks found", blocks.len());
    // The walk reaches every path the kernel's manifest lists (the root included).
    assert_eq!(base.entries(), common::manifest(name).len(), "{name}: walk {base:?}");
    let dup = blocks.iter().filter(|b| b.copies.len() > 1).count();
    if want_dup {
        assert_eq!(dup, blocks.len(), "{name}: expected every tree block to have two copies");
    }
    let mut seed = 0x5eed_0000 ^ u64::from(nodesize);
    for b in &blocks {
        let (byte, bit) = pick_bit(&mut seed, csum, nodesize);
        let label = format!(
            "{name}: block {} (root {} level {}) byte {byte} bit {bit}",
            b.bytenr, b.root, b.level
        );
        assert!(b.copies.iter().all(|c| c.0 == 1), "{label}: single-device fixture expected");
        if b.copies.len() > 1 {
            let mut dev = OverlayDevice::new(img.clone(), name);
            let (at, v) = flipped(&img, b.copies[0].1, byte, bit);
            dev.patch(at, v);
            match clean(&format!("{label}, copy 1 of {}", b.copies.len()), dev) {
                Outcome::Ok { summary, warnings } => {
                    assert_eq!(
                        summary, base,
                        "{label}: the walk with copy 1 damaged differs from the pristine walk"
                    );
                    let needle = format!("tree block {}", b.bytenr);
                    assert!(
                        warnings.iter().any(|w| w.contains(&needle)),
                        "{label}: no warning naming the block in {warnings:?}"
                    );
                }
                o => panic!("{label}: copy 1 damaged, copy 2 intact, yet: {o:?}"),
            }
        }
        let mut dev = OverlayDevice::new(img.clone(), name);
        for c in &b.copies {
            let (at, v) = flipped(&img, c.1, byte, bit);
            dev.patch(at, v);
        }
        match clean(&format!("{label}, every copy"), dev) {
            Outcome::Err(e) => assert!(
                e.contains(&b.bytenr.to_string()),
                "{label}: error does not name the block: {e}"
            ),
            o => panic!("{label}: every copy damaged, yet: {o:?}"),
        }
    }
    eprintln!("{name}: {base:?}");
    eprintln!(
        "{name}: {} tree blocks ({dup} with two copies) flipped in {:?}",
        blocks.len(),
        t0.elapsed()
    );
}

#[test]
fn bitflip_every_block_blake2_dup() {
    bitflip_every_block("blake2", true);
}

#[test]
fn bitflip_every_block_dup_data() {
    bitflip_every_block("dup-data", true);
}

#[test]
fn bitflip_every_block_mixed_single() {
    bitflip_every_block("mixed", false);
}

/// Flip bits inside every tree block, in every copy, and fix the checksums so the
/// damage reaches the tree checker and the item parsers. Any result is fine but a
/// panic or a hang; returns (ok, err) counts.
fn bitflip_fixed_csum(name: &str, flips_per_block: usize, max_blocks: usize) -> (usize, usize) {
    let t0 = Instant::now();
    let img = image(name);
    let (_, blocks, csum, nodesize) = baseline(name, &img);
    let mut seed = 0xf1f0_0000 ^ u64::from(nodesize);
    let step = blocks.len().div_ceil(max_blocks).max(1);
    let (mut ok, mut err) = (0, 0);
    for b in blocks.iter().step_by(step) {
        for _ in 0..flips_per_block {
            // Header and item area mostly: bias towards the first 512 bytes, where the
            // structure is, one flip in four anywhere in the block.
            let r = splitmix(&mut seed);
            let span = if r & 3 == 0 { nodesize as u64 - 32 } else { 512 - 32 };
            let byte = 32 + ((r >> 8) % span) as usize;
            let bit = ((r >> 40) % 8) as u8;
            let label = format!(
                "{name}: block {} (root {} level {}) byte {byte} bit {bit}, csum fixed",
                b.bytenr, b.root, b.level
            );
            let mut dev = OverlayDevice::new(img.clone(), name);
            for c in &b.copies {
                let mut blk = dev.read_vec(c.1, nodesize as usize);
                blk[byte] ^= 1 << bit;
                fix_block_csum(&mut blk, csum);
                dev.patch(c.1, blk);
            }
            match clean(&label, dev) {
                Outcome::Ok { .. } => ok += 1,
                _ => err += 1,
            }
        }
    }
    eprintln!(
        "{name}: {ok} ok, {err} errors from {} flips with fixed checksums in {:?}",
        ok + err,
        t0.elapsed()
    );
    (ok, err)
}

#[test]
fn bitflip_fixed_csum_mixed() {
    bitflip_fixed_csum("mixed", 24, usize::MAX);
}

#[test]
fn bitflip_fixed_csum_blake2() {
    bitflip_fixed_csum("blake2", 16, usize::MAX);
}

#[test]
fn bitflip_fixed_csum_nodesize4k_sampled() {
    bitflip_fixed_csum("nodesize4k-xxhash", 2, 40);
}

#[test]
fn truncated_images() {
    let img = image("mixed");
    let size = img.len() as u64;
    for len in [0, 4096, 65536, 65 * 1024, 65536 + 4095, size / 2, size - 4096] {
        let mut dev = OverlayDevice::new(img.clone(), "mixed");
        dev.truncate(len);
        let o = clean(&format!("mixed truncated to {len}"), dev);
        if len < SUPER_INFO_OFFSET + SUPER_INFO_SIZE as u64 {
            match o {
                Outcome::Err(e) => assert!(
                    e.contains("too small") || e.contains("superblock"),
                    "truncated to {len}: {e}"
                ),
                o => panic!("truncated to {len} (no superblock left): {o:?}"),
            }
        }
    }
}

fn patch_super(dev: &mut OverlayDevice, off: u64, f: impl FnOnce(&mut [u8]), fix_csum: bool) {
    let mut sb = dev.read_vec(off, SUPER_INFO_SIZE);
    f(&mut sb);
    if fix_csum {
        fix_super_csum(&mut sb);
    }
    dev.patch(off, sb);
}

const MAGIC_AT: usize = core::mem::offset_of!(Superblock, magic);
const INCOMPAT_AT: usize = core::mem::offset_of!(Superblock, incompat_flags);
const COMPAT_RO_AT: usize = core::mem::offset_of!(Superblock, compat_ro_flags);

#[test]
fn bad_magic_is_not_btrfs() {
    // mixed is exactly 64 MiB: no backup superblock fits.
    let img = image("mixed");
    let mut dev = OverlayDevice::new(img.clone(), "mixed");
    patch_super(&mut dev, SUPER_INFO_OFFSET, |sb| sb[MAGIC_AT] ^= 0x20, true);
    match clean("mixed, bad magic", dev) {
        Outcome::Err(e) => assert!(e.contains("not a btrfs filesystem"), "{e}"),
        o => panic!("bad magic opened: {o:?}"),
    }
    // blake2 has a backup copy at 64 MiB: damage both.
    let img = image("blake2");
    let mut dev = OverlayDevice::new(img.clone(), "blake2");
    for m in 0..2 {
        patch_super(&mut dev, sb_offset(m), |sb| sb[MAGIC_AT] ^= 0x20, true);
    }
    match clean("blake2, bad magic in both copies", dev) {
        Outcome::Err(e) => assert!(e.contains("not a btrfs filesystem"), "{e}"),
        o => panic!("bad magic opened: {o:?}"),
    }
}

#[test]
fn bad_super_csum_uses_backup_or_fails() {
    let img = image("blake2");
    assert!(img.len() as u64 > sb_offset(1) + SUPER_INFO_SIZE as u64);
    let mut dev = OverlayDevice::new(img.clone(), "blake2");
    patch_super(&mut dev, SUPER_INFO_OFFSET, |sb| sb[100] ^= 1, false);
    match clean("blake2, bad primary superblock csum", dev) {
        Outcome::Ok { warnings, .. } => assert!(
            warnings
                .iter()
                .any(|w| w.contains("primary superblock is bad") && w.contains("checksum")),
            "{warnings:?}"
        ),
        o => panic!("no fallback to the backup superblock: {o:?}"),
    }
    let img = image("mixed");
    assert!((img.len() as u64) < sb_offset(1) + SUPER_INFO_SIZE as u64);
    let mut dev = OverlayDevice::new(img.clone(), "mixed");
    patch_super(&mut dev, SUPER_INFO_OFFSET, |sb| sb[100] ^= 1, false);
    match clean("mixed, bad superblock csum", dev) {
        Outcome::Err(e) => {
            assert!(e.contains("checksum mismatch") && e.contains("superblock"), "{e}")
        }
        o => panic!("bad superblock csum opened: {o:?}"),
    }
}

#[test]
fn unknown_incompat_bit_refuses() {
    let img = image("mixed");
    for (bit, name) in [(1u64 << 40, "0x10000000000"), (1 << 7, "RAID56")] {
        let mut dev = OverlayDevice::new(img.clone(), "mixed");
        patch_super(
            &mut dev,
            SUPER_INFO_OFFSET,
            |sb| {
                let v =
                    u64::from_le_bytes(sb[INCOMPAT_AT..INCOMPAT_AT + 8].try_into().unwrap()) | bit;
                sb[INCOMPAT_AT..INCOMPAT_AT + 8].copy_from_slice(&v.to_le_bytes());
            },
            true,
        );
        match clean(&format!("incompat bit {bit:#x}"), dev) {
            Outcome::Err(e) => {
                assert!(e.starts_with("incompatible filesystem") && e.contains(name), "{e}")
            }
            o => panic!("incompat bit {bit:#x} opened: {o:?}"),
        }
    }
}

#[test]
fn unknown_compat_ro_bit_opens_read_only() {
    let img = image("mixed");
    let mut dev = OverlayDevice::new(img.clone(), "mixed");
    patch_super(
        &mut dev,
        SUPER_INFO_OFFSET,
        |sb| {
            let v = u64::from_le_bytes(sb[COMPAT_RO_AT..COMPAT_RO_AT + 8].try_into().unwrap())
                | 1 << 33;
            sb[COMPAT_RO_AT..COMPAT_RO_AT + 8].copy_from_slice(&v.to_le_bytes());
        },
        true,
    );
    let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(dev)];
    let info = FsInfo::open_devices(devs, CACHE).expect("unknown compat_ro bit must open");
    assert!(
        info.read_only_reason.as_deref().is_some_and(|r| r.contains("compat_ro")),
        "{:?}",
        info.read_only_reason
    );
    let fs = Filesystem::from_info(info).expect("from_info");
    walk::walk_all(&fs).expect("walk a filesystem with an unknown compat_ro bit");
    let w = fs.info.take_warnings();
    assert!(w.iter().any(|m| m.contains("compat_ro") && m.contains("read-only")), "{w:?}");
}

/// In the 4K-node fixture the fs tree has three levels: aim a key pointer of a level-1
/// node at that node itself and at its parent (the root), checksums fixed.
#[test]
fn node_pointer_loops() {
    let name = "nodesize4k-xxhash";
    let img = image(name);
    let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(OverlayDevice::new(img.clone(), name))];
    let fs = Filesystem::from_info(FsInfo::open_devices(devs, CACHE).expect("open")).expect("fs");
    let root = fs.fs_root(FS_TREE_OBJECTID).expect("fs root");
    assert_eq!(root.level, 2, "fixture fs tree level");
    let top = fs.info.read_tree_block(root.bytenr, &Default::default()).expect("root block");
    let mid_bytenr = top.node().blockptr(1);
    let blocks = tree_blocks(&fs.info).expect("blocks");
    let mid = blocks.iter().find(|b| b.bytenr == mid_bytenr).expect("level-1 block listed").clone();
    assert_eq!(mid.level, 1);
    let (csum, nodesize) = (fs.info.csum_type, fs.info.nodesize as usize);
    drop(fs);
    for (what, target) in [("itself", mid.bytenr), ("its parent", root.bytenr)] {
        for slot in [0usize, 5] {
            let mut dev = OverlayDevice::new(img.clone(), name);
            for &(_, phys) in &mid.copies {
                let mut blk = dev.read_vec(phys, nodesize);
                let at = HEADER_SIZE + slot * KEY_PTR_SIZE + 17;
                blk[at..at + 8].copy_from_slice(&target.to_le_bytes());
                fix_block_csum(&mut blk, csum);
                dev.patch(phys, blk);
            }
            let label =
                format!("{name}: node {} slot {slot} pointing at {what} ({target})", mid.bytenr);
            match clean(&label, dev) {
                Outcome::Err(e) => {
                    assert!(e.contains("level mismatch") || e.contains("transid"), "{label}: {e}")
                }
                o => panic!("{label}: {o:?}"),
            }
        }
    }
}

/// Rename DIR_INDEX entries of the `mixed` fixture in place to unsafe names, then make
/// sure `extract` refuses them by name and writes nothing outside its destination.
#[test]
fn unsafe_names_refused_by_extract() {
    let name = "mixed";
    let img = image(name);
    let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(OverlayDevice::new(img.clone(), name))];
    let fs = Filesystem::from_info(FsInfo::open_devices(devs, CACHE).expect("open")).expect("fs");
    let blocks = tree_blocks(&fs.info).expect("blocks");
    let csum = fs.info.csum_type;
    // (old name, new name of the same length)
    let cases: [(&[u8], &[u8]); 3] =
        [(b"dir", b"../"), (b"a", b"."), (b"entry-00003", b"../../../x.")];
    let mut found = 0;
    for (old, new) in cases {
        assert_eq!(old.len(), new.len());
        let mut dev = OverlayDevice::new(img.clone(), name);
        let mut hit = false;
        for b in blocks.iter().filter(|b| b.level == 0 && b.root == FS_TREE_OBJECTID) {
            let eb = fs.info.read_tree_block(b.bytenr, &Default::default()).expect("leaf");
            let n = eb.node();
            for slot in 0..n.nritems() {
                if n.key(slot).type_ != DIR_INDEX_KEY {
                    continue;
                }
                let item = n.item(slot);
                let name_at =
                    HEADER_SIZE + item.offset.get() as usize + core::mem::size_of::<DirItem>();
                let data = n.item_data(slot);
                if &data[core::mem::size_of::<DirItem>()..] != old {
                    continue;
                }
                assert!(HEADER_SIZE + slot * ITEM_SIZE < name_at);
                for &(_, phys) in &b.copies {
                    let mut blk = dev.read_vec(phys, eb.bytes().len());
                    blk[name_at..name_at + new.len()].copy_from_slice(new);
                    fix_block_csum(&mut blk, csum);
                    dev.patch(phys, blk);
                }
                hit = true;
            }
        }
        assert!(hit, "no DIR_INDEX named {:?}", String::from_utf8_lossy(old));
        found += 1;
        let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(dev)];
        let bad = Filesystem::from_info(FsInfo::open_devices(devs, CACHE).expect("open patched"))
            .expect("fs");
        let parent = std::env::temp_dir()
            .join(format!("ubtrfs-corrupt-extract-{}-{found}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        std::fs::create_dir_all(&parent).expect("temp parent");
        let dest = parent.join("dest");
        let listing = |p: &std::path::Path| {
            let mut v: Vec<String> = std::fs::read_dir(p)
                .expect("list")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        let before_tmp = listing(&std::env::temp_dir());
        use ubtrfs_tools::extract::{extract, CollectReport, ExtractOptions};
        let shown = format!("\"{}\"", ubtrfs_core::quote::name(new));
        // Strict: the first unsafe name stops the extraction, named.
        let strict = ExtractOptions { strict: true, ..Default::default() };
        match extract(&bad, bad.root_dir(), &dest, &strict, &mut CollectReport::default()) {
            Err(e) => {
                assert!(e.to_string().contains(&shown), "extract error does not name {shown}: {e}")
            }
            Ok(s) => panic!("extract accepted the unsafe name {shown}: {s:?}"),
        }
        assert_eq!(
            listing(&parent),
            vec!["dest".to_string()],
            "something was created beside the destination"
        );
        // Salvage: the entry is skipped with a warning naming it, the rest extracted.
        std::fs::remove_dir_all(&dest).expect("clean up");
        let mut report = CollectReport::default();
        let stats = extract(&bad, bad.root_dir(), &dest, &ExtractOptions::default(), &mut report)
            .expect("salvage goes on");
        assert!(!stats.complete(), "{stats:?}");
        assert!(
            report
                .warnings
                .iter()
                .any(|w| w.text.contains(&shown) && w.text.contains("not extracted")),
            "no warning names {shown}: {:?}",
            report.warnings
        );
        assert!(stats.files > 10, "{stats:?}");
        assert_eq!(
            listing(&parent),
            vec!["dest".to_string()],
            "something was created beside the destination"
        );
        let after_tmp = listing(&std::env::temp_dir());
        let new_in_tmp: Vec<&String> =
            after_tmp.iter().filter(|n| !before_tmp.contains(n) && n.starts_with('x')).collect();
        assert!(new_in_tmp.is_empty(), "created in the temp dir: {new_in_tmp:?}");
        std::fs::remove_dir_all(&parent).expect("clean up");
    }
}

/// Both copies of one FS-tree leaf bad: iteration steps over it with `skip_unreadable`
/// and sees every other item, in order; `load_inode_salvage` keeps what it can read of
/// an inode whose items run into that leaf, and does not blame an inode whose items end
/// just before it (which a strict load does, reading on to find the end).
#[test]
fn iteration_steps_over_an_unreadable_leaf() {
    use ubtrfs_core::inode::filesystem::{InodeId, Load};
    use ubtrfs_format::Key;
    let name = "default";
    let img = image(name);
    let open = |dev: OverlayDevice| {
        let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(dev)];
        Filesystem::from_info(FsInfo::open_devices(devs, CACHE).expect("open")).expect("fs")
    };
    let fs = open(OverlayDevice::new(img.clone(), name));
    let root = fs.fs_root(FS_TREE_OBJECTID).expect("fs tree");
    let keys = |fs: &Filesystem| -> (Vec<Key>, Vec<Key>) {
        let mut it = fs.info.iter(&root, Key::MIN).expect("iter");
        let (mut seen, mut skipped) = (Vec::new(), Vec::new());
        loop {
            match it.next_item() {
                Ok(Some(item)) => seen.push(item.key()),
                Ok(None) => break,
                Err(e) => skipped
                    .push(it.skip_unreadable().unwrap_or_else(|| panic!("cannot step over {e}"))),
            }
        }
        (seen, skipped)
    };
    let (all, none) = keys(&fs);
    assert!(none.is_empty());
    let blocks = tree_blocks(&fs.info).expect("blocks");
    let leaves: Vec<&TreeBlock> = blocks
        .iter()
        .filter(|b| b.level == 0 && b.root == FS_TREE_OBJECTID && b.owner == FS_TREE_OBJECTID)
        .collect();
    assert!(leaves.len() > 4, "{} fs tree leaves", leaves.len());
    // A dozen leaves spread over the tree (not the first: it holds the root directory).
    let step = (leaves.len() / 12).max(1);
    let (mut partial, mut clean_end) = (0, 0);
    for victim in leaves.iter().skip(1).step_by(step) {
        assert_eq!(victim.copies.len(), 2, "metadata is DUP");
        let eb = fs.info.read_tree_block(victim.bytenr, &Default::default()).expect("leaf");
        let lost: Vec<Key> = (0..eb.node().nritems()).map(|i| eb.node().key(i)).collect();
        let mut dev = OverlayDevice::new(img.clone(), name);
        for &(_, phys) in &victim.copies {
            let mut blk = dev.read_vec(phys, eb.bytes().len());
            blk[eb.bytes().len() / 2] ^= 0x5a;
            dev.patch(phys, blk);
        }
        let bad = open(dev);
        let (seen, skipped) = keys(&bad);
        assert_eq!(skipped, vec![lost[0]], "the one bad leaf is skipped, named by its first key");
        let want: Vec<Key> = all.iter().copied().filter(|k| !lost.contains(k)).collect();
        assert_eq!(seen, want, "every item outside the bad leaf, in order");

        // The inode whose items come last before the bad leaf.
        let before = all[all.iter().position(|k| *k == lost[0]).expect("first lost key") - 1];
        let id = InodeId { root: FS_TREE_OBJECTID, ino: before.objectid };
        let strict = bad.load_inode(id, Load::ALL);
        match bad.load_inode_salvage(id, Load::ALL) {
            Ok((_, damage)) if before.objectid == lost[0].objectid => {
                partial += 1;
                assert!(strict.is_err());
                assert_eq!(damage.lost.len(), 1, "{damage:?}");
                assert_eq!(damage.lost[0].from, lost[0]);
                assert!(
                    damage.lost[0].to.is_none_or(|t| t > *lost.last().expect("leaf has items")),
                    "{damage:?}"
                );
            }
            Ok((v, damage)) => {
                clean_end += 1;
                assert!(damage.is_empty(), "ino {} ends before the bad leaf: {damage:?}", id.ino);
                let clean = fs.load_inode(id, Load::ALL).expect("clean load");
                assert_eq!(
                    (v.xattrs, v.entries.len(), v.extents),
                    (clean.xattrs, clean.entries.len(), clean.extents)
                );
            }
            // Objectids below the first inode (e.g. the free-ino cache) have no INODE_ITEM.
            Err(e) => assert!(before.objectid < 256, "{e}"),
        }
    }
    eprintln!("{partial} leaves cut an inode's items, {clean_end} started a new inode");
    assert!(partial > 0, "no leaf cut an inode's items in two");
    assert!(clean_end > 0, "no leaf started a new inode");
}

/// Replay every input the fuzz targets ever crashed on (fuzz/regressions/TARGET/*),
/// through the same target bodies, each under `catch_unwind` with a deadline.
#[test]
fn fuzz_regressions() {
    let dir = common::repo_root().join("fuzz/regressions");
    let base = Arc::new(
        targets::ImageBase::new(image("mixed").to_vec(), "mixed").expect("image target base"),
    );
    let mut n = 0;
    let ops_base = Arc::new(
        targets::ImageBase::new(image("blake2").to_vec(), "blake2")
            .expect("engine_ops target base"),
    );
    for target in ["superblock", "tree_block", "image", "engine_ops"] {
        let Ok(rd) = std::fs::read_dir(dir.join(target)) else { continue };
        let mut files: Vec<_> = rd.map(|e| e.expect("entry").path()).collect();
        files.sort();
        for f in files {
            let data = std::fs::read(&f).expect("read regression input");
            let base = base.clone();
            let ops_base = ops_base.clone();
            let (tx, rx) = mpsc::channel();
            std::thread::spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match target {
                    "superblock" => targets::superblock(&data),
                    "tree_block" => targets::tree_block(&data),
                    "engine_ops" => targets::engine_ops(&ops_base, &data),
                    _ => targets::image(&base, &data),
                }));
                let _ = tx.send(r.is_ok());
            });
            match rx.recv_timeout(CASE_LIMIT) {
                Ok(true) => {}
                Ok(false) => panic!("{}: panicked", f.display()),
                Err(_) => panic!("{}: no result within {CASE_LIMIT:?}", f.display()),
            }
            n += 1;
        }
    }
    assert!(n > 0, "no regression inputs under {}", dir.display());
    eprintln!("{n} fuzz regression inputs replayed");
}

/// The engine-operations fuzz target on fixed inputs, so it runs under `cargo test`:
/// operations on the pristine image, and the same operations over images whose tree
/// blocks carry seeded random patches. Nothing may panic; the target itself asserts
/// that nothing changes after an abort.
#[test]
fn engine_ops_target_on_fixed_inputs() {
    let base = targets::ImageBase::new(image("blake2").to_vec(), "blake2")
        .expect("engine_ops target base");
    // mkdir, create+write, write, whole-sector write, readback, commit, unlink, reopen,
    // create, readback, create, unlink while open (and write and read it), commit
    let ops: Vec<u8> = [
        [0u8, 1, 3, 0],
        [1, 0, 40, 0],
        [2, 0, 9, 0],
        [2, 1, 3, 0],
        [6, 0, 0, 0],
        [4, 0, 0, 0],
        [3, 0, 0, 0],
        [5, 0, 0, 0],
        [1, 2, 200, 1],
        [6, 1, 0, 0],
        [1, 3, 20, 0],
        [7, 0, 10, 0],
        [4, 0, 0, 0],
    ]
    .concat();
    let mut inputs = vec![[vec![0u8, 0], ops.clone()].concat()];
    let mut x: u64 = 0x1234_5678;
    for _ in 0..40 {
        let mut patch = Vec::new();
        for _ in 0..4 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let b = x.to_le_bytes();
            // ctl 0 (checksum fixed), block index, offset, 4 bytes
            patch.extend_from_slice(&[0, b[0], b[1], b[2], b[3] & 0x3f, 4, b[4], b[5], b[6], b[7]]);
        }
        inputs.push([(patch.len() as u16).to_le_bytes().to_vec(), patch, ops.clone()].concat());
    }
    for (i, input) in inputs.iter().enumerate() {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            targets::engine_ops(&base, input)
        }));
        assert!(r.is_ok(), "engine_ops input {i} panicked");
    }
}

type Edits = Vec<(usize, Vec<u8>)>;

/// Find the first regular file extent item of fixture `name` (in the fs tree) whose
/// body satisfies `pred`, apply each case's edits to its body (checksum fixed), and
/// open + walk; print each outcome. Panics and hangs fail the test.
fn crafted_extent_cases(
    name: &str,
    pred: impl Fn(&[u8]) -> bool,
    cases: Vec<(&str, Edits)>,
) -> Vec<Outcome> {
    use ubtrfs_format::structs::{FILE_EXTENT_REG, FILE_EXTENT_REG_SIZE};
    let img = image(name);
    let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(OverlayDevice::new(img.clone(), name))];
    let fs = Filesystem::from_info(FsInfo::open_devices(devs, CACHE).expect("open")).expect("fs");
    let blocks = tree_blocks(&fs.info).expect("blocks");
    let (csum, nodesize) = (fs.info.csum_type, fs.info.nodesize as usize);
    let mut target = None;
    'find: for b in blocks.iter().filter(|b| b.level == 0 && b.root == FS_TREE_OBJECTID) {
        let eb = fs.info.read_tree_block(b.bytenr, &Default::default()).expect("leaf");
        let n = eb.node();
        for slot in 0..n.nritems() {
            let d = n.item_data(slot);
            if n.key(slot).type_ == EXTENT_DATA_KEY
                && d.len() == FILE_EXTENT_REG_SIZE
                && d[20] == FILE_EXTENT_REG
                && d[21..29] != [0; 8]
                && pred(d)
            {
                target = Some((
                    b.clone(),
                    HEADER_SIZE + n.item(slot).offset.get() as usize,
                    n.key(slot),
                ));
                break 'find;
            }
        }
    }
    let (b, body, key) =
        target.unwrap_or_else(|| panic!("{name}: no matching regular file extent"));
    let mut out = Vec::new();
    for (what, edits) in cases {
        let label = format!("{name}: extent {key} in block {}: {what}", b.bytenr);
        let mut dev = OverlayDevice::new(img.clone(), name);
        for &(_, phys) in &b.copies {
            let mut blk = dev.read_vec(phys, nodesize);
            for (off, bytes) in &edits {
                blk[body + off..body + off + bytes.len()].copy_from_slice(bytes);
            }
            fix_block_csum(&mut blk, csum);
            dev.patch(phys, blk);
        }
        let o = clean(&label, dev);
        eprintln!(
            "{label}: {}",
            match &o {
                Outcome::Err(e) => e.clone(),
                o => format!("{o:?}"),
            }
        );
        out.push(o);
    }
    out
}

fn le(v: u64) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// Hostile but tree-checker-valid file extents: compressed extents with absurd on-disk
/// sizes (once an allocation abort) or offsets past their data (once a slice panic),
/// uncompressed ones whose disk address overflows (once an overflow panic).
#[test]
fn crafted_file_extents() {
    use ubtrfs_format::structs::FILE_EXTENT_INLINE_DATA_START as AT;
    let outcomes = crafted_extent_cases(
        "mixed",
        |_| true,
        vec![
            ("zlib, disk_num_bytes 2^62", vec![(16, vec![1]), (AT + 8, le(1 << 62))]),
            ("zlib, disk_num_bytes 2^63", vec![(16, vec![1]), (AT + 8, le(1 << 63))]),
            ("lzo, offset 2^63", vec![(16, vec![2]), (AT + 16, le(1 << 63))]),
            (
                "uncompressed, disk_bytenr + offset overflows",
                vec![
                    (8, le((1 << 63) + (1 << 20))),
                    (AT, le(1 << 63)),
                    (AT + 8, le(1 << 20)),
                    (AT + 16, le(1 << 63)),
                    (AT + 24, le(4096)),
                ],
            ),
            (
                "uncompressed, disk_bytenr near the top",
                vec![(AT, le(u64::MAX - 4095 - (1 << 20))), (AT + 8, le(1 << 20))],
            ),
        ],
    );
    assert!(outcomes.iter().all(|o| matches!(o, Outcome::Err(_))), "{outcomes:?}");
    // A real zstd extent whose offset points past its decompressed bytes.
    let outcomes = crafted_extent_cases(
        "zstd",
        |d| d[16] == 3,
        vec![
            ("zstd, offset 2^40", vec![(AT + 16, le(1 << 40))]),
            ("zstd, offset 2^63", vec![(AT + 16, le(1 << 63))]),
            ("zstd, offset 1 MiB", vec![(AT + 16, le(1 << 20))]),
        ],
    );
    for o in &outcomes {
        match o {
            Outcome::Err(e) => {
                assert!(e.contains("beyond its") && e.contains("EXTENT_DATA"), "{e}")
            }
            o => panic!("offset past the data read fine: {o:?}"),
        }
    }
}
