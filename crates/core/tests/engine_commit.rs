//! A commit's I/O runs outside the engine's state lock: while the blocks and
//! superblocks of generation N are being written, readers see every change and the next
//! transaction takes new changes. The devices show generation N only once the commit
//! is done, and the space N freed is not reused before then.
//!
//! The commit is stopped in its I/O by holding the fault device's flushes.

mod common;

use std::sync::Arc;
use std::time::Duration;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::filesystem::{ExtentKind, Filesystem, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::volumes::device::{BlockDevice, MemDevice};
use ubtrfs_core::volumes::fault::FaultyDevice;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::{FsInfo, FsRead};
use ubtrfs_format::key::FS_TREE_OBJECTID;
use ubtrfs_tools::check::{check, CheckOptions};

const CACHE: usize = 16 << 20;
const ROOT: u64 = FS_TREE_OBJECTID;
const ROOT_DIR: u64 = 256;

fn fixture() -> Vec<u8> {
    std::fs::read(&common::fixture_images("blake2")[0]).expect("read fixture image")
}

fn engine_on(dev: &Arc<FaultyDevice>) -> Engine {
    let d: Arc<dyn BlockDevice> = dev.clone();
    Engine::from_writer(
        FsWriter::from_info(FsInfo::open_devices(vec![d], CACHE).expect("open")).expect("writer"),
    )
}

fn read_file(live: &impl FileRead, name: &[u8]) -> ubtrfs_core::Result<Option<Vec<u8>>> {
    let Some(e) = live.lookup(InodeId { root: ROOT, ino: ROOT_DIR }, name)? else {
        return Ok(None);
    };
    let v = live.load_inode(e.target, Load { extents: true, ..Load::ITEM })?;
    let mut buf = vec![0u8; v.size() as usize];
    let n = live.read_at(&v, 0, &mut buf)?;
    buf.truncate(n);
    Ok(Some(buf))
}

/// What a fresh open of `img` shows: (generation, contents of `names`).
fn reopen(img: Vec<u8>, names: &[&[u8]]) -> (u64, Vec<Option<Vec<u8>>>) {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(img, "reopened"));
    let fs = Filesystem::from_info(FsInfo::open_devices(vec![dev], CACHE).expect("open"))
        .expect("reader");
    let got = names.iter().map(|n| read_file(&fs, n).expect("read")).collect();
    (fs.sb.generation.get(), got)
}

/// Lets held flushes and reads go when a failed assertion unwinds the test, so the committer
/// thread ends and the failure is reported instead of hanging.
struct ReleaseOnDrop<'a>(&'a FaultyDevice);

impl Drop for ReleaseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.release_held();
    }
}

fn data(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn readers_and_the_next_transaction_go_on_while_a_commit_writes() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "commit-io"));
    let engine = engine_on(&dev);
    let g0 = engine.read(|l| Ok(l.committed_generation().get())).unwrap();
    let a = data(1, 300_000);
    let b = data(2, 200_000);
    engine
        .write(|w| {
            let ino = w.create_file(ROOT, ROOT_DIR, b"a", &InodeAttrs::new(0o644))?;
            w.write_file(ROOT, ino, 0, &a)
        })
        .unwrap();
    dev.hold_flushes();
    std::thread::scope(|s| {
        let _release = ReleaseOnDrop(&dev);
        let committer = s.spawn(|| engine.commit());
        assert!(
            dev.wait_for_held_op(Duration::from_secs(60)),
            "the commit never reached its flush"
        );
        // The commit is in its I/O, holding no lock readers or writers need.
        assert_eq!(
            engine.read(|l| read_file(l, b"a")).unwrap().as_deref(),
            Some(&a[..]),
            "a reader during the commit's I/O"
        );
        engine
            .write(|w| {
                // A tiny dirty limit: the next transaction writes blocks out early,
                // beside the committing one's.
                let limit = 4 * w.nodesize() as usize;
                w.set_dirty_metadata_limit(limit);
                for i in 0..300 {
                    w.create_file(
                        ROOT,
                        ROOT_DIR,
                        format!("many-{i:03}").as_bytes(),
                        &InodeAttrs::new(0o644),
                    )?;
                }
                let ino = w.create_file(ROOT, ROOT_DIR, b"b", &InodeAttrs::new(0o644))?;
                w.write_file(ROOT, ino, 0, &b)?;
                // Overwrite a: the committing generation's extent is freed in the next one.
                let e = w.live().lookup(InodeId { root: ROOT, ino: ROOT_DIR }, b"a")?.expect("a");
                w.write_file(ROOT, e.target.ino, 0, &b[..4096])
            })
            .unwrap();
        let mut a2 = a.clone();
        a2[..4096].copy_from_slice(&b[..4096]);
        assert_eq!(
            engine.read(|l| read_file(l, b"a")).unwrap().as_deref(),
            Some(&a2[..]),
            "a after the next transaction's overwrite"
        );
        assert_eq!(
            engine.read(|l| read_file(l, b"b")).unwrap().as_deref(),
            Some(&b[..]),
            "b, made while the commit writes"
        );
        assert!(!committer.is_finished(), "the commit finished with its flush held");
        assert!(
            engine.read(|l| Ok(l.blocks_written_early())).unwrap() > 0,
            "the next transaction wrote no block early"
        );
        // What the committing generation freed is held out of the allocator.
        let held = engine.write(|w| Ok(w.space_held_by_commit())).unwrap();
        assert!(
            !held.is_empty(),
            "the committing transaction freed nothing (COW frees the blocks it copied)"
        );
        for &(s, l) in &held {
            assert!(
                !engine.write(|w| Ok(w.space_is_allocatable(s, l))).unwrap(),
                "{s} +{l}, freed by the committing generation, is allocatable during its I/O"
            );
        }
        // The devices still show the generation before, both as flushed and with every
        // write issued so far: neither the commit's blocks nor the next transaction's
        // early ones landed on space that generation uses.
        for (what, img) in
            [("durable", dev.durable_image()), ("every write issued", dev.current_image())]
        {
            assert_clean(img.clone(), what);
            let (gen, got) = reopen(img, &[b"a", b"b"]);
            assert_eq!((gen, got), (g0, vec![None, None]), "{what} while the commit is held");
        }
        dev.release_held();
        let g1 = committer.join().expect("committer").expect("commit");
        assert_eq!(g1, g0 + 1);
        assert!(engine.write(|w| Ok(w.space_held_by_commit())).unwrap().is_empty());
        let back = held
            .iter()
            .filter(|&&(s, l)| engine.write(|w| Ok(w.space_is_allocatable(s, l))).unwrap())
            .count();
        assert_eq!(
            back,
            held.len(),
            "space freed by generation {g1} is allocatable once it is committed"
        );
    });
    let (gen, got) = reopen(dev.durable_image(), &[b"a", b"b"]);
    assert_eq!(
        (gen, got),
        (g0 + 1, vec![Some(a.clone()), None]),
        "after the first commit: a as it was committed, no b"
    );
    let g2 = engine.commit().unwrap();
    assert_eq!(g2, g0 + 2);
    let mut a2 = a.clone();
    a2[..4096].copy_from_slice(&b[..4096]);
    let img = dev.durable_image();
    let (gen, got) = reopen(img.clone(), &[b"a", b"b"]);
    assert_eq!((gen, got), (g2, vec![Some(a2), Some(b)]), "after the second commit");
    assert_clean(img, "after the second commit");
}

fn assert_clean(img: Vec<u8>, what: &str) {
    let mem: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(img, "checked"));
    let fs = FsInfo::open_devices(vec![mem], CACHE).unwrap();
    let report = check(&fs, &CheckOptions { check_data_csum: true, ..Default::default() }).unwrap();
    assert!(
        report.findings.is_empty(),
        "{what}: check findings: {:?}",
        report.findings.iter().map(|f| f.to_string()).collect::<Vec<_>>()
    );
}

#[test]
fn a_second_commit_waits_for_the_first() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "two-commits"));
    let engine = engine_on(&dev);
    let g0 = engine.read(|l| Ok(l.committed_generation().get())).unwrap();
    engine
        .write(|w| w.create_file(ROOT, ROOT_DIR, b"x", &InodeAttrs::new(0o644)).map(drop))
        .unwrap();
    dev.hold_flushes();
    std::thread::scope(|s| {
        let _release = ReleaseOnDrop(&dev);
        let first = s.spawn(|| engine.commit());
        assert!(dev.wait_for_held_op(Duration::from_secs(60)));
        engine
            .write(|w| w.create_file(ROOT, ROOT_DIR, b"y", &InodeAttrs::new(0o644)).map(drop))
            .unwrap();
        let second = s.spawn(|| engine.commit());
        std::thread::sleep(Duration::from_millis(200));
        assert!(!second.is_finished(), "a second commit ran while the first was writing");
        // A commit through the writer itself is refused while one is writing, not run.
        let e = engine.write(|w| w.commit()).unwrap_err();
        assert!(e.to_string().contains("previous commit is still writing"), "{e}");
        dev.release_held();
        assert_eq!(first.join().unwrap().unwrap(), g0 + 1);
        assert_eq!(second.join().unwrap().unwrap(), g0 + 2);
    });
    let (gen, _) = reopen(dev.durable_image(), &[]);
    assert_eq!(gen, g0 + 2);
}

#[test]
fn a_committed_view_reads_its_generation_while_the_engine_moves_on() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "committed-view"));
    let engine = engine_on(&dev);
    let old = data(3, 256 << 10);
    engine
        .write(|w| {
            let ino = w.create_file(ROOT, ROOT_DIR, b"f", &InodeAttrs::new(0o644))?;
            w.write_file(ROOT, ino, 0, &old)
        })
        .unwrap();
    let g = engine.commit().unwrap();
    let snap = engine.committed().unwrap();
    assert_eq!(snap.sb.generation.get(), g);
    let extents = |fs: &Filesystem| -> Vec<(u64, u64)> {
        let e = fs.lookup(InodeId { root: ROOT, ino: ROOT_DIR }, b"f").unwrap().expect("f");
        fs.file_extents(e.target, 0, u64::MAX)
            .unwrap()
            .iter()
            .filter_map(|x| match x.kind {
                ExtentKind::Regular { disk_bytenr, disk_num_bytes, .. } if disk_bytenr != 0 => {
                    Some((disk_bytenr, disk_num_bytes))
                }
                _ => None,
            })
            .collect()
    };
    let old_extents = extents(&snap);
    assert!(!old_extents.is_empty());
    // Replace f's data several times over, committing each time: without the view the
    // allocator would hand f's old extent out again.
    for round in 0..4u8 {
        let new = data(10 + round, 256 << 10);
        engine
            .write(|w| {
                let e = w.live().lookup(InodeId { root: ROOT, ino: ROOT_DIR }, b"f")?.expect("f");
                w.write_file(ROOT, e.target.ino, 0, &new)?;
                let ino = w.create_file(
                    ROOT,
                    ROOT_DIR,
                    format!("filler-{round}").as_bytes(),
                    &InodeAttrs::new(0o644),
                )?;
                w.write_file(ROOT, ino, 0, &new)
            })
            .unwrap();
        engine.commit().unwrap();
        for &(s, l) in &old_extents {
            assert!(!engine.write(|w| Ok(w.space_is_allocatable(s, l))).unwrap(), "round {round}: f's old extent {s} +{l} is allocatable while a view of generation {g} reads it");
        }
        assert_eq!(
            read_file(&*snap, b"f").unwrap().as_deref(),
            Some(&old[..]),
            "round {round}: the view's f"
        );
    }
    assert!(!engine.write(|w| Ok(w.space_held_for_views())).unwrap().is_empty());
    drop(snap);
    // The next change returns what only the view needed.
    engine
        .write(|w| w.create_file(ROOT, ROOT_DIR, b"after", &InodeAttrs::new(0o644)).map(drop))
        .unwrap();
    assert!(
        engine.write(|w| Ok(w.space_held_for_views())).unwrap().is_empty(),
        "space still held after the view ended"
    );
    for &(s, l) in &old_extents {
        assert!(
            engine.write(|w| Ok(w.space_is_allocatable(s, l))).unwrap(),
            "f's old extent {s} +{l} not free after the view ended"
        );
    }
    engine.commit().unwrap();
    assert_clean(dev.durable_image(), "after the view ended");
}

#[test]
fn a_reader_that_misses_the_cache_reads_without_the_lock() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "reader-miss"));
    let engine = engine_on(&dev);
    let names: Vec<Vec<u8>> = (0..400).map(|i| format!("entry-{i:04}").into_bytes()).collect();
    let big = engine
        .write(|w| {
            let big = w.mkdir(ROOT, ROOT_DIR, b"big", &InodeAttrs::new(0o755))?;
            for n in &names {
                w.create_file(ROOT, big, n, &InodeAttrs::new(0o644))?;
            }
            Ok(InodeId { root: ROOT, ino: big })
        })
        .unwrap();
    engine.commit().unwrap();
    // A cold cache: big's leaves must come from the device. One change in the root
    // directory reads what changes there need, so the next one reads nothing.
    engine.info().cache.clear();
    engine
        .write(|w| w.create_file(ROOT, ROOT_DIR, b"warm", &InodeAttrs::new(0o644)).map(drop))
        .unwrap();
    dev.hold_reads();
    std::thread::scope(|s| {
        let _release = ReleaseOnDrop(&dev);
        let reader = s.spawn(|| {
            let mut runs = 0;
            let listed = engine
                .read(|l| {
                    runs += 1;
                    l.readdir(big)
                })
                .expect("readdir");
            (runs, listed.len())
        });
        assert!(dev.wait_for_held_op(Duration::from_secs(60)), "the reader never read the device");
        // The reader waits for the device, holding no lock: a change goes through.
        let writer = s.spawn(|| {
            engine.write(|w| {
                w.create_file(ROOT, ROOT_DIR, b"made-during-the-read", &InodeAttrs::new(0o644))
                    .map(drop)
            })
        });
        let t = std::time::Instant::now();
        while !writer.is_finished() && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(writer.is_finished(), "a change waited for a reader's I/O (the reader held the lock, or the change needed a read)");
        writer.join().expect("writer").expect("create");
        assert!(!reader.is_finished());
        dev.release_held();
        let (runs, listed) = reader.join().expect("reader");
        assert!(runs > 1, "the reader was not run again after its miss");
        assert_eq!(listed, names.len());
    });
    let got: Vec<Vec<u8>> = engine
        .read(|l| l.readdir(InodeId { root: ROOT, ino: ROOT_DIR }))
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(got.iter().any(|n| n == b"made-during-the-read"));
}

/// The disk ranges of `name`'s data extents in the live view.
fn live_extents(engine: &Engine, name: &[u8]) -> Vec<(u64, u64)> {
    engine
        .read(|l| {
            let e = l.lookup(InodeId { root: ROOT, ino: ROOT_DIR }, name)?.expect("file");
            Ok(l.file_extents(e.target, 0, u64::MAX)?
                .iter()
                .filter_map(|x| match x.kind {
                    ExtentKind::Regular { disk_bytenr, disk_num_bytes, .. } if disk_bytenr != 0 => {
                        Some((disk_bytenr, disk_num_bytes))
                    }
                    _ => None,
                })
                .collect())
        })
        .unwrap()
}

fn overwrite(engine: &Engine, name: &[u8], bytes: &[u8]) {
    engine
        .write(|w| {
            let id = match w.live().lookup(InodeId { root: ROOT, ino: ROOT_DIR }, name)? {
                Some(e) => e.target.ino,
                None => w.create_file(ROOT, ROOT_DIR, name, &InodeAttrs::new(0o644))?,
            };
            w.write_file(ROOT, id, 0, bytes)
        })
        .unwrap();
}

#[test]
fn read_file_reads_data_without_the_lock_and_keeps_its_extents() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "read-file"));
    let engine = engine_on(&dev);
    const MIB: usize = 1 << 20;
    // Warm what the changes below read (the trees' leaves), so that with the device's
    // reads held only the reader waits.
    for v in 0..2 {
        overwrite(&engine, b"warm", &data(40 + v, 2 * MIB));
        engine.commit().unwrap();
    }
    // f is made in the running transaction: freeing its extent in this transaction
    // would give the space back at once, but for the reader.
    let v1 = data(1, MIB);
    overwrite(&engine, b"f", &v1);
    let f = engine
        .read(|l| Ok(l.lookup(InodeId { root: ROOT, ino: ROOT_DIR }, b"f")?.expect("f").target))
        .unwrap();
    let v1_extents = live_extents(&engine, b"f");
    dev.hold_reads();
    std::thread::scope(|s| {
        let _release = ReleaseOnDrop(&dev);
        let reader = s.spawn(|| {
            let mut buf = vec![0u8; MIB];
            let n = engine.read_file(f, 0, &mut buf)?;
            buf.truncate(n);
            Ok::<_, ubtrfs_core::Error>(buf)
        });
        assert!(dev.wait_for_held_op(Duration::from_secs(60)), "the reader never read the device");
        // The reader is in its data read, holding no lock: f is replaced twice, with
        // commits, and more data is written.
        let changes = s.spawn(|| {
            overwrite(&engine, b"f", &data(2, MIB));
            engine.commit().unwrap();
            overwrite(&engine, b"f", &data(3, MIB));
            overwrite(&engine, b"h", &data(4, 3 * MIB));
            engine.commit().unwrap();
        });
        let t = std::time::Instant::now();
        while !changes.is_finished() && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(changes.is_finished(), "changes waited for a reader's data read");
        changes.join().expect("changes");
        let now: Vec<(u64, u64)> =
            [&b"f"[..], b"h"].iter().flat_map(|n| live_extents(&engine, n)).collect();
        for &(s, l) in &v1_extents {
            assert!(
                !engine.write(|w| Ok(w.space_is_allocatable(s, l))).unwrap(),
                "f's first extent {s} +{l} is allocatable while a reader reads it"
            );
            assert!(
                now.iter().all(|&(a, b)| a + b <= s || s + l <= a),
                "f's first extent {s} +{l} was handed out again: {now:?}"
            );
        }
        assert!(!reader.is_finished());
        dev.release_held();
        let got = reader.join().expect("reader").expect("read_file");
        assert!(got == v1, "the reader got other bytes than f had when it looked the extents up");
    });
    // The reader is gone: the next change returns the space (and may take some of it).
    overwrite(&engine, b"after", &data(5, 4096));
    assert!(
        engine.write(|w| Ok(w.space_held_for_views())).unwrap().is_empty(),
        "space still held after the reader ended"
    );
    let after = live_extents(&engine, b"after");
    for &(s, l) in &v1_extents {
        let taken: Vec<_> = after.iter().filter(|&&(a, b)| a < s + l && s < a + b).collect();
        let free_from = taken.iter().map(|&&(a, b)| a + b).max().unwrap_or(s);
        assert!(
            engine.write(|w| Ok(w.space_is_allocatable(free_from, s + l - free_from))).unwrap(),
            "f's first extent {s} +{l} not free after the reader ended (after: {after:?})"
        );
    }
    let mut buf = vec![0u8; MIB];
    assert_eq!(engine.read_file(f, 0, &mut buf).unwrap(), MIB);
    assert!(buf == data(3, MIB));
    engine.commit().unwrap();
    assert_clean(dev.durable_image(), "after read_file");
}

#[test]
fn a_changes_writeback_runs_without_the_lock() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "writeback"));
    let engine = engine_on(&dev);
    // Warm the trees, then a tiny dirty limit: the next change ends in writeback.
    overwrite(&engine, b"warm", &data(7, 64 << 10));
    engine.commit().unwrap();
    engine
        .write(|w| {
            let limit = 4 * w.nodesize() as usize;
            w.set_dirty_metadata_limit(limit);
            Ok(())
        })
        .unwrap();
    let names: Vec<String> = (0..200).map(|i| format!("wb-{i:03}")).collect();
    dev.hold_writes();
    std::thread::scope(|s| {
        let _release = ReleaseOnDrop(&dev);
        let writer = s.spawn(|| {
            engine.write(|w| {
                for n in &names {
                    w.create_file(ROOT, ROOT_DIR, n.as_bytes(), &InodeAttrs::new(0o644))?;
                }
                Ok(())
            })
        });
        assert!(dev.wait_for_held_op(Duration::from_secs(60)), "the change wrote nothing back");
        // The change is done and its writeback is writing, holding no lock: readers
        // see every name, reading the sealed blocks from the writeback set.
        let t = std::time::Instant::now();
        let reader = s.spawn(|| engine.read(|l| l.readdir(InodeId { root: ROOT, ino: ROOT_DIR })));
        while !reader.is_finished() && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(reader.is_finished(), "a reader waited for a change's writeback");
        let listed: Vec<Vec<u8>> =
            reader.join().expect("reader").expect("readdir").into_iter().map(|e| e.name).collect();
        for n in &names {
            assert!(
                listed.iter().any(|l| l == n.as_bytes()),
                "{n} missing while its blocks are written back"
            );
        }
        assert!(!writer.is_finished(), "the writeback finished with writes held");
        dev.release_held();
        writer.join().expect("writer").expect("create");
    });
    assert!(engine.read(|l| Ok(l.blocks_written_early())).unwrap() > 0);
    // More changes free some of the written-back blocks (COW of a written block) while
    // others are still in the writeback set; then commit.
    for n in names.iter().step_by(3) {
        engine.write(|w| w.unlink(ROOT, ROOT_DIR, n.as_bytes())).unwrap();
    }
    engine.commit().unwrap();
    let img = dev.durable_image();
    assert_clean(img.clone(), "after writeback outside the lock");
    let dev2: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(img, "reopened"));
    let fs = Filesystem::from_info(FsInfo::open_devices(vec![dev2], CACHE).unwrap()).unwrap();
    for (i, n) in names.iter().enumerate() {
        let e = fs.lookup(InodeId { root: ROOT, ino: ROOT_DIR }, n.as_bytes()).unwrap();
        assert_eq!(e.is_some(), i % 3 != 0, "{n} after reopen");
    }
}

/// Every regular file under `dir` (subvolumes included), depth first.
fn regular_files(
    l: &impl FileRead,
    dir: InodeId,
    out: &mut Vec<InodeId>,
) -> ubtrfs_core::Result<()> {
    for e in l.readdir(dir)? {
        match e.ftype {
            ubtrfs_format::structs::FT_DIR => regular_files(l, e.target, out)?,
            ubtrfs_format::structs::FT_REG_FILE => out.push(e.target),
            _ => {}
        }
    }
    Ok(())
}

#[test]
fn read_file_reads_what_the_live_view_reads_on_kernel_made_images() {
    // Inline, compressed (zlib, lzo, zstd), holes, prealloc, reflinked and snapshot
    // extents, as the kernel wrote them.
    for fixture in ["default", "zlib", "lzo", "zstd", "snapshots", "sha256-64k"] {
        let img = std::fs::read(&common::fixture_images(fixture)[0]).expect("fixture");
        let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(img, fixture));
        let engine = Engine::from_writer(
            FsWriter::from_info(FsInfo::open_devices(vec![dev], CACHE).expect("open"))
                .expect("writer"),
        );
        let root = engine.read(|l| Ok(l.root_dir())).unwrap();
        let mut files = Vec::new();
        engine
            .read(|l| {
                files.clear();
                regular_files(l, root, &mut files)
            })
            .unwrap();
        assert!(files.len() > 5, "{fixture}: {} files", files.len());
        let mut bytes = 0;
        for id in files {
            let want = engine
                .read(|l| {
                    let v = l.load_inode(id, Load { extents: true, ..Load::ITEM })?;
                    let mut buf = vec![0u8; v.size() as usize];
                    let n = l.read_at(&v, 0, &mut buf)?;
                    buf.truncate(n);
                    Ok(buf)
                })
                .unwrap_or_else(|e| panic!("{fixture} {id:?}: live read: {e}"));
            let mut got = vec![0u8; want.len() + 100];
            let n = engine
                .read_file(id, 0, &mut got)
                .unwrap_or_else(|e| panic!("{fixture} {id:?}: read_file: {e}"));
            assert!(
                n == want.len() && got[..n] == want[..],
                "{fixture} {id:?}: read_file of the whole file"
            );
            // Pieces that start and end inside sectors and extents.
            for (off, len) in [
                (1u64, 4095usize),
                (want.len() as u64 / 3, 70_001),
                (want.len() as u64 / 2 + 7, 200_000),
            ] {
                let mut piece = vec![0u8; len];
                let n = engine.read_file(id, off, &mut piece).unwrap();
                let from = (off as usize).min(want.len());
                let end = (from + len).min(want.len());
                assert!(
                    n == end - from && piece[..n] == want[from..end],
                    "{fixture} {id:?}: read_file at {off} +{len}"
                );
            }
            bytes += want.len();
        }
        assert!(bytes > 0, "{fixture}: no data");
    }
}

#[test]
fn write_file_writes_data_without_the_lock() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "write-file"));
    let engine = engine_on(&dev);
    const MIB: usize = 1 << 20;
    let v1 = data(1, MIB);
    overwrite(&engine, b"f", &v1);
    engine.commit().unwrap();
    let f = engine
        .read(|l| Ok(l.lookup(InodeId { root: ROOT, ino: ROOT_DIR }, b"f")?.expect("f").target))
        .unwrap();
    let v2 = data(2, 2 * MIB);
    dev.hold_writes();
    std::thread::scope(|s| {
        let _release = ReleaseOnDrop(&dev);
        let writer = s.spawn(|| engine.write_file(f, 0, &v2));
        assert!(
            dev.wait_for_held_op(Duration::from_secs(60)),
            "the write never reached the device"
        );
        // The data write is under way, holding only f's lock: f reads as it was, and
        // another inode changes.
        let others = s.spawn(|| {
            let mut buf = vec![0u8; 2 * MIB];
            let n = engine.read_file(f, 0, &mut buf)?;
            engine.write(|w| {
                w.create_file(ROOT, ROOT_DIR, b"beside", &InodeAttrs::new(0o644)).map(drop)
            })?;
            Ok::<_, ubtrfs_core::Error>(buf[..n].to_vec())
        });
        let t = std::time::Instant::now();
        while !others.is_finished() && t.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(others.is_finished(), "a reader or another change waited for a file's data write");
        assert!(
            others.join().expect("others").expect("read and change") == v1,
            "f read other bytes than before the write while its data was written"
        );
        assert!(!writer.is_finished());
        dev.release_held();
        writer.join().expect("writer").expect("write_file");
    });
    let mut buf = vec![0u8; 2 * MIB + 1];
    assert_eq!(engine.read_file(f, 0, &mut buf).unwrap(), 2 * MIB);
    assert!(buf[..2 * MIB] == v2[..]);
    engine.commit().unwrap();
    assert_clean(dev.durable_image(), "after write_file");
    let (_, got) = reopen(dev.durable_image(), &[b"f", b"beside"]);
    assert_eq!(got, vec![Some(v2), Some(Vec::new())]);
}

#[test]
fn a_failed_data_write_leaves_the_file_and_its_space_as_they_were() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "write-file-fails"));
    let engine = engine_on(&dev);
    let v1 = data(1, 256 << 10);
    overwrite(&engine, b"f", &v1);
    engine.commit().unwrap();
    let f = engine
        .read(|l| Ok(l.lookup(InodeId { root: ROOT, ino: ROOT_DIR }, b"f")?.expect("f").target))
        .unwrap();
    dev.fail_next_write(0);
    let e = engine.write_file(f, 0, &data(2, 512 << 10)).unwrap_err();
    assert!(e.to_string().contains("injected"), "{e}");
    // Not aborted: the file is as it was, and the next write works.
    let mut buf = vec![0u8; 1 << 20];
    let n = engine.read_file(f, 0, &mut buf).unwrap();
    assert!(buf[..n] == v1[..]);
    let v3 = data(3, 512 << 10);
    engine.write_file(f, 0, &v3).unwrap();
    engine.commit().unwrap();
    assert_clean(dev.durable_image(), "after a failed data write");
    let (_, got) = reopen(dev.durable_image(), &[b"f"]);
    assert_eq!(got, vec![Some(v3)]);
}

/// A change's lookups that miss the cache read without the engine's lock
/// (`Engine::write_retrying`): while a write's read of a cold block (its inode, its
/// extents) is held at the device, readers still get the lock; the write then
/// completes.
#[test]
fn a_writers_cache_miss_is_read_without_the_lock() {
    let dev = Arc::new(FaultyDevice::new(fixture(), "writer-miss"));
    let engine = engine_on(&dev);
    let id = engine
        .write(|w| {
            let mut last = 0;
            for i in 0..300 {
                last = w.create_file(
                    ROOT,
                    ROOT_DIR,
                    format!("f{i:03}").as_bytes(),
                    &InodeAttrs::new(0o644),
                )?;
            }
            Ok(InodeId { root: ROOT, ino: last })
        })
        .unwrap();
    engine.commit().unwrap();
    let _release = ReleaseOnDrop(&dev);
    engine.info().cache.clear();
    dev.hold_reads();
    let new = data(7, 64 << 10);
    let e = &engine;
    std::thread::scope(|s| {
        let writer = s.spawn(|| e.write_file(id, 0, &new));
        assert!(dev.wait_for_held_op(Duration::from_secs(10)), "the write never read a block");
        // The write waits at the device for a block its lookups need: the engine's lock
        // is free meanwhile.
        let (tx, rx) = std::sync::mpsc::channel();
        s.spawn(move || tx.send(e.read(|l| Ok(l.transid()))).unwrap());
        let got = rx.recv_timeout(Duration::from_secs(10));
        dev.release_held();
        assert!(matches!(got, Ok(Ok(_))), "a reader waited for the writer's read: {got:?}");
        writer.join().unwrap().expect("write");
    });
    let mut back = vec![0u8; new.len()];
    assert_eq!(engine.read_file(id, 0, &mut back).unwrap(), new.len());
    assert!(back == new, "the write's data");
    engine.commit().unwrap();
}
