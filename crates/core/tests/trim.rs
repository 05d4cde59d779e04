//! FITRIM in the engine (`space::trim`) on in-memory devices that record what they
//! are told to discard (and read it back as zeros afterwards): on kernel-made images
//! of every profile, with files written, deleted before and after commits, and freed
//! space still read by a view, no discarded byte is allocated (before or after the
//! running transaction), pinned, held for a reader, a superblock copy or in the first
//! MiB of a device; the files read back, the image checks clean, and the bytes FITRIM
//! reports are the bytes the devices were told to discard.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::error::PosixKind;
use ubtrfs_core::inode::filesystem::{InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::space::trim::FstrimRange;
use ubtrfs_core::volumes::device::{BlockDevice, MemDevice};
use ubtrfs_core::volumes::fault::FaultyDevice;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsInfo;
use ubtrfs_core::FsRead;
use ubtrfs_core::FsWriter;
use ubtrfs_format::key::{
    EXTENT_ITEM_KEY, EXTENT_TREE_OBJECTID, FS_TREE_OBJECTID, METADATA_ITEM_KEY,
};
use ubtrfs_format::structs::{sb_offset, SUPER_INFO_SIZE, SUPER_MIRROR_MAX};
use ubtrfs_format::Key;
use ubtrfs_tools::check::{check, CheckOptions};

const CACHE: usize = 16 << 20;
const ROOT: u64 = FS_TREE_OBJECTID;
const ROOT_DIR: u64 = 256;
const ALL: FstrimRange = FstrimRange { start: 0, len: u64::MAX, minlen: 0 };

fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The fixture's devices in memory, and an engine over them.
fn open(name: &str) -> (Vec<Arc<MemDevice>>, Engine) {
    let mems: Vec<Arc<MemDevice>> = common::fixture_images(name)
        .iter()
        .enumerate()
        .map(|(i, p)| {
            Arc::new(MemDevice::new(std::fs::read(p).expect("read fixture"), format!("{name}.{i}")))
        })
        .collect();
    let devs: Vec<Arc<dyn BlockDevice>> =
        mems.iter().map(|m| m.clone() as Arc<dyn BlockDevice>).collect();
    let engine = Engine::from_writer(
        FsWriter::from_info(FsInfo::open_devices(devs, CACHE).expect("open")).expect("writer"),
    );
    (mems, engine)
}

/// Logical ranges the extent tree holds now: data extents, and (unless `data_only`)
/// tree blocks.
fn extents(engine: &Engine, data_only: bool) -> Vec<(u64, u64)> {
    engine
        .write(|w| {
            let nodesize = u64::from(w.info.nodesize);
            let items = w.items_in_range(EXTENT_TREE_OBJECTID, &Key::MIN, &Key::MAX)?;
            Ok(items
                .into_iter()
                .filter_map(|(k, d)| {
                    // btrfs_extent_item: refs, generation, flags (EXTENT_FLAG_DATA = 1).
                    let data =
                        d.len() >= 24 && u64::from_le_bytes(d[16..24].try_into().unwrap()) & 1 != 0;
                    match k.type_ {
                        EXTENT_ITEM_KEY if data || !data_only => Some((k.objectid, k.offset)),
                        METADATA_ITEM_KEY if !data_only => Some((k.objectid, nodesize)),
                        _ => None,
                    }
                })
                .collect())
        })
        .unwrap()
}

/// Every copy of logical `[s, s + l)`, as (devid, physical start, length).
fn physical(info: &FsInfo, s: u64, l: u64) -> Vec<(u64, u64, u64)> {
    let mut out = Vec::new();
    let mut cur = s;
    while cur < s + l {
        let c = info.chunk_map.lookup(ubtrfs_core::ids::Logical(cur)).unwrap();
        let mut step = u64::MAX;
        for m in 0..c.num_copies() {
            let (i, phys, contig) = c.map(cur, m);
            let n = contig.min(s + l - cur);
            out.push((c.stripes[i].0, phys, n));
            step = step.min(n);
        }
        cur += step;
    }
    out
}

/// What each device was told to discard, by devid.
fn discarded(engine: &Engine, mems: &[Arc<MemDevice>]) -> BTreeMap<u64, Vec<(u64, u64)>> {
    let mut out = BTreeMap::new();
    for (&devid, d) in &engine.info().devices.by_id {
        let m = mems.iter().find(|m| m.name() == d.dev.name()).unwrap();
        out.insert(devid, m.discarded());
    }
    out
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// No discarded range meets `logical` (mapped to every copy), a superblock copy or a
/// device's first MiB.
fn assert_untouched(
    engine: &Engine,
    disc: &BTreeMap<u64, Vec<(u64, u64)>>,
    logical: &[(u64, u64)],
    what: &str,
) {
    let info = engine.info();
    for (&devid, ranges) in disc {
        for &r in ranges {
            assert!(r.0 >= 1 << 20, "{what}: device {devid}: discarded {r:?} in the first MiB");
            for m in 0..SUPER_MIRROR_MAX {
                assert!(
                    !overlaps(r, (sb_offset(m), SUPER_INFO_SIZE as u64)),
                    "{what}: device {devid}: discarded {r:?} over superblock copy {m}"
                );
            }
        }
    }
    for &(s, l) in logical {
        for (devid, p, n) in physical(info, s, l) {
            for &r in disc.get(&devid).into_iter().flatten() {
                assert!(!overlaps(r, (p, n)), "{what}: device {devid}: discarded {r:?} over logical {s} +{l} (physical {p} +{n})");
            }
        }
    }
}

fn read_all(engine: &Engine, ino: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let n = engine.read_file(InodeId { root: ROOT, ino }, 0, &mut buf).unwrap();
    buf.truncate(n);
    buf
}

fn assert_clean(mems: &[Arc<MemDevice>], what: &str) {
    let devs: Vec<Arc<dyn BlockDevice>> = mems
        .iter()
        .enumerate()
        .map(|(i, m)| {
            Arc::new(MemDevice::new(m.snapshot(), format!("checked.{i}"))) as Arc<dyn BlockDevice>
        })
        .collect();
    let fs = FsInfo::open_devices(devs, CACHE).unwrap();
    let report = check(&fs, &CheckOptions { check_data_csum: true, ..Default::default() }).unwrap();
    assert!(
        report.findings.is_empty(),
        "{what}: check findings: {:?}",
        report.findings.iter().map(|f| f.to_string()).collect::<Vec<_>>()
    );
}

fn create(engine: &Engine, name: &str, body: &[u8]) -> u64 {
    engine
        .write(|w| {
            let ino = w.create_file(ROOT, ROOT_DIR, name.as_bytes(), &InodeAttrs::new(0o644))?;
            w.write_file(ROOT, ino, 0, body)?;
            Ok(ino)
        })
        .unwrap()
}

fn unlink(engine: &Engine, name: &str) {
    engine.write(|w| w.unlink(ROOT, ROOT_DIR, name.as_bytes())).unwrap();
}

fn load(ino: u64) -> (InodeId, Load) {
    (InodeId { root: ROOT, ino }, Load { extents: true, ..Load::ITEM })
}

#[test]
fn trim_discards_only_free_space_on_every_profile() {
    for name in ["default", "dup-data", "mixed", "raid0", "raid1", "raid10"] {
        let (mems, engine) = open(name);
        let mut files: BTreeMap<String, (u64, Vec<u8>)> = BTreeMap::new();
        let add = |engine: &Engine,
                   files: &mut BTreeMap<String, (u64, Vec<u8>)>,
                   n: String,
                   seed: u64,
                   len: usize| {
            let body = data(seed, len);
            let ino = create(engine, &n, &body);
            files.insert(n, (ino, body));
        };
        // Committed files, half of them deleted and committed: freed space comes back.
        for i in 0..8u64 {
            add(&engine, &mut files, format!("c{i}"), i, 100_000 + 150_000 * i as usize);
        }
        engine.commit().unwrap();
        for i in (0..8).step_by(2) {
            let n = format!("c{i}");
            unlink(&engine, &n);
            files.remove(&n);
        }
        engine.commit().unwrap();
        // A view of a generation holding a file that is then deleted and committed:
        // its extents are freed but held for the view.
        add(&engine, &mut files, "held".into(), 99, 700_000);
        engine.commit().unwrap();
        let view = engine.committed().unwrap();
        let (held, held_body) = files.remove("held").unwrap();
        unlink(&engine, "held");
        engine.commit().unwrap();
        // The running transaction: new files (reserved, their refs delayed) and a
        // committed file deleted (pinned).
        for i in 0..3u64 {
            add(&engine, &mut files, format!("r{i}"), 100 + i, 300_000);
        }
        unlink(&engine, "c1");
        files.remove("c1");
        // Its extents freed now, not at the commit: they are pinned.
        engine
            .write(|w| {
                w.transaction("test", 8, |w| ubtrfs_core::extent::extent_tree::run_delayed_refs(w))
            })
            .unwrap();
        let before = extents(&engine, false);

        let r = engine.fitrim(ALL).unwrap();
        let disc = discarded(&engine, &mems);
        let total: u64 = disc.values().flatten().map(|r| r.1).sum();
        assert!(r.len > 0, "{name}: nothing trimmed");
        assert_eq!(
            r.len, total,
            "{name}: FITRIM reports {} bytes, the devices were told to discard {total}",
            r.len
        );
        assert_eq!(
            (r.start, r.minlen),
            (0, 4096),
            "{name}: start as given, minlen raised to the granularity"
        );
        assert_untouched(&engine, &disc, &before, &format!("{name}: allocated before the trim"));
        // The view still reads the deleted file whole (the test device zeroes what it
        // discards: a discarded extent would fail its checksum).
        let (id, how) = load(held);
        let v = view.load_inode(id, how).unwrap();
        let mut buf = vec![0u8; held_body.len()];
        let n = view.read_at(&v, 0, &mut buf).unwrap();
        assert!(
            n == held_body.len() && buf == held_body,
            "{name}: the view's deleted file reads wrong after the trim"
        );
        drop(view);

        // The data extents after the commit: the running transaction's were reserved
        // at the trim (the commit itself allocates only tree blocks, which may take
        // space the trim discarded).
        engine.commit().unwrap();
        assert_untouched(
            &engine,
            &disc,
            &extents(&engine, true),
            &format!("{name}: data allocated before the trim"),
        );
        for (n, (ino, body)) in &files {
            assert!(
                read_all(&engine, *ino, body.len()) == *body,
                "{name}: {n} reads wrong after the trim"
            );
        }
        // A second trim discards block-group free space again, but not the
        // unallocated device space the first one discarded.
        engine.fitrim(ALL).unwrap();
        let info = engine.info();
        for (devid, ranges) in discarded(&engine, &mems) {
            let mut pieces: Vec<(u64, u64)> = info
                .chunk_map
                .iter()
                .flat_map(|c| physical(info, c.logical, c.length))
                .filter(|p| p.0 == devid)
                .map(|p| (p.1, p.2))
                .collect();
            pieces.sort_unstable();
            let mut stripes: Vec<(u64, u64)> = Vec::new();
            for (s, l) in pieces {
                match stripes.last_mut() {
                    Some(last) if last.0 + last.1 >= s => last.1 = last.1.max(s + l - last.0),
                    _ => stripes.push((s, l)),
                }
            }
            for &d in &ranges[disc[&devid].len()..] {
                assert!(
                    stripes.iter().any(|&st| d.0 >= st.0 && d.0 + d.1 <= st.0 + st.1),
                    "{name}: device {devid}: the second trim discarded {d:?} outside every chunk"
                );
            }
        }
        engine.commit().unwrap();
        assert_clean(&mems, name);
    }
}

/// The kernel's answers (measured on 6.18 with a loop device over a file, as in the
/// FUSE tests): EOPNOTSUPP before anything else when no device takes discards; EINVAL
/// for a length below the sector size, a start of U64_MAX and a start + length past
/// U64_MAX (a length of U64_MAX is "to the end" from any start); otherwise success,
/// with `minlen` raised to the granularity and 0 bytes where nothing is free.
#[test]
fn fitrim_refuses_as_the_kernel_does() {
    let img = std::fs::read(&common::fixture_images("default")[0]).unwrap();
    let dev = Arc::new(FaultyDevice::new(img, "faulty"));
    let d: Arc<dyn BlockDevice> = dev.clone();
    let engine = Engine::from_writer(
        FsWriter::from_info(FsInfo::open_devices(vec![d], CACHE).unwrap()).unwrap(),
    );
    let kind = |start, len, minlen| {
        engine.fitrim(FstrimRange { start, len, minlen }).map_err(|e| e.posix_kind())
    };
    let first = kind(0, u64::MAX, 0).unwrap();
    assert!(first.len > 0 && first.minlen == 4096, "{first:?}");
    let discards = dev.discarded();
    assert_eq!(discards.iter().map(|d| d.1).sum::<u64>(), first.len);
    for (start, len) in [
        (0, 0),
        (0, 100),
        (0, 4095),
        (u64::MAX, 1 << 20),
        (u64::MAX, u64::MAX),
        (u64::MAX - 1, 2),
        (1 << 63, 1 << 63),
        ((1 << 63) + 1, (1 << 63) - 1),
    ] {
        assert_eq!(kind(start, len, 0), Err(Some(PosixKind::Invalid)), "start {start} len {len}");
    }
    assert_eq!(dev.discarded(), discards, "a refused FITRIM discarded something");
    // Past every block group, or runs shorter than minlen: nothing (the unallocated
    // device space was discarded by the first trim).
    for (start, len, minlen) in
        [(u64::MAX - 1, u64::MAX, 0), (1 << 62, 1 << 62, 0), (0, u64::MAX, 1 << 40), (1, 4096, 0)]
    {
        let r = kind(start, len, minlen).unwrap();
        assert_eq!(
            r,
            FstrimRange { start, len: 0, minlen: minlen.max(4096) },
            "start {start} len {len} minlen {minlen}"
        );
    }
    // Block-group free space is discarded again by a second full trim.
    let again = kind(0, u64::MAX, 0).unwrap();
    assert!(
        again.len > 0 && again.len < first.len,
        "second trim {} bytes, first {}",
        again.len,
        first.len
    );
    dev.refuse_discards();
    assert_eq!(kind(0, 0, 0), Err(Some(PosixKind::NotSupported)), "EOPNOTSUPP comes before EINVAL");
    assert_eq!(kind(0, u64::MAX, 0), Err(Some(PosixKind::NotSupported)));
}
