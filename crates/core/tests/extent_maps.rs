//! Extent maps through the engine: reads served from the maps return the bytes a model
//! of the file holds after every kind of change (writes, overwrites, truncation down and
//! up, punched holes, zeroed ranges, preallocation), so every EXTENT_DATA change drops
//! what it made stale; the maps really serve reads (hit and miss counts); and the
//! shrinker keeps them within the budget while readers go on reading correct bytes.

mod common;
#[path = "common/write.rs"]
mod write_common;

use ubtrfs_core::data::falloc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::attr::SetAttr;
use ubtrfs_core::inode::filesystem::InodeId;
use ubtrfs_core::inode::write::InodeAttrs;
use write_common::*;

const SS: u64 = 4096;

fn engine(tag: &str, args: &[&str]) -> (Scratch, Engine) {
    let img = Scratch::mkfs(tag, 512 << 20, args);
    let w = img.writer();
    (img, Engine::from_writer(w))
}

fn create(e: &Engine, name: &str) -> InodeId {
    let ino = e
        .write(|w| w.create_file(5, 256, name.as_bytes(), &InodeAttrs::new(0o644)))
        .expect("create");
    InodeId { root: 5, ino }
}

fn read_all(e: &Engine, id: InodeId, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let n = e.read_file(id, 0, &mut buf).expect("read");
    buf.truncate(n);
    buf
}

fn check_range(e: &Engine, id: InodeId, model: &[u8], off: u64, len: u64, what: &str) {
    let mut buf = vec![0u8; len as usize];
    let n = e.read_file(id, off, &mut buf).expect("read");
    let want = &model[(off as usize).min(model.len())..((off + len) as usize).min(model.len())];
    assert_eq!(n, want.len(), "{what}: read of [{off}, +{len}) returned {n} bytes");
    if buf[..n] != *want {
        let at = buf.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
        panic!(
            "{what}: bytes differ at file offset {} (got {:#x}, want {:#x})",
            off + at as u64,
            buf[at],
            want[at]
        );
    }
}

/// Random changes of every kind against a model, each followed by reads of random
/// ranges (twice, so the second is served by the maps the first filled).
fn model_run(args: &[&str], seed: u64) {
    let (_img, e) = engine(&format!("em-model-{seed}"), args);
    let id = create(&e, "f");
    let mut model: Vec<u8> = Vec::new();
    let mut rng = Rng::new(seed);
    let max = 64 * SS;
    for step in 0..300 {
        let roll = rng.below(100);
        let off = rng.below(max / SS) * SS;
        let len = rng.range(1, 12) * SS;
        let what = match roll {
            0..45 => {
                let data = rng.bytes(len as usize);
                e.write_file(id, off, &data).expect("write");
                if model.len() < (off + len) as usize {
                    model.resize((off + len) as usize, 0);
                }
                model[off as usize..(off + len) as usize].copy_from_slice(&data);
                format!("step {step}: write [{off}, +{len})")
            }
            45..55 => {
                let size = rng.below(max / SS) * SS + rng.below(2) * rng.below(SS);
                e.setattr(id, &SetAttr { size: Some(size), ..Default::default() })
                    .expect("truncate");
                model.resize(size as usize, 0);
                format!("step {step}: truncate to {size}")
            }
            55..70 => {
                e.fallocate(id, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, len)
                    .expect("punch");
                let end = ((off + len) as usize).min(model.len());
                if (off as usize) < end {
                    model[off as usize..end].fill(0);
                }
                format!("step {step}: punch [{off}, +{len})")
            }
            70..80 => {
                e.fallocate(id, FALLOC_FL_ZERO_RANGE, off, len).expect("zero range");
                if model.len() < (off + len) as usize {
                    model.resize((off + len) as usize, 0);
                }
                model[off as usize..(off + len) as usize].fill(0);
                format!("step {step}: zero [{off}, +{len})")
            }
            80..90 => {
                e.fallocate(id, 0, off, len).expect("prealloc");
                if model.len() < (off + len) as usize {
                    model.resize((off + len) as usize, 0);
                }
                format!("step {step}: prealloc [{off}, +{len})")
            }
            _ => {
                e.fallocate(id, FALLOC_FL_KEEP_SIZE, off, len).expect("prealloc keep size");
                format!("step {step}: prealloc keep-size [{off}, +{len})")
            }
        };
        if rng.chance(5) {
            e.commit().expect("commit");
        }
        for _ in 0..2 {
            let roff = rng.below(max + SS);
            let rlen = rng.range(1, 20 * SS);
            check_range(&e, id, &model, roff, rlen, &what);
            check_range(&e, id, &model, roff, rlen, &what);
        }
        assert_eq!(read_all(&e, id, (max * 2) as usize), model, "{what}: whole file");
    }
    let st = e.extent_map_stats();
    assert!(st.hits > 300, "the maps served only {} of the reads ({} misses)", st.hits, st.misses);
    e.extent_maps().check_invariants();
}

#[test]
fn reads_after_every_change_match_the_model_no_holes() {
    model_run(&[], 1);
}

#[test]
fn reads_after_every_change_match_the_model_with_hole_items() {
    model_run(&["-O", "^no-holes"], 2);
}

#[test]
fn the_maps_serve_repeated_reads_and_a_write_drops_them() {
    let (_img, e) = engine("em-hits", &[]);
    let id = create(&e, "f");
    // Four extents, not adjacent on disk after interleaving with another file.
    let other = create(&e, "g");
    for i in 0..4u64 {
        e.write_file(id, i * 8 * SS, &vec![i as u8 + 1; (8 * SS) as usize]).expect("write");
        e.write_file(other, i * SS, &[9u8; SS as usize]).expect("write other");
    }
    let s0 = e.extent_map_stats();
    let a = read_all(&e, id, (32 * SS) as usize);
    let s1 = e.extent_map_stats();
    assert_eq!((s1.misses - s0.misses, s1.hits - s0.hits), (1, 0), "first read fills the maps");
    assert!(s1.evictable >= 4, "{} maps after reading 4 extents", s1.evictable);
    let inode = e.inodes().lookup(id).expect("in memory");
    assert_eq!(inode.mapping.extent_map.lookup(0, 1).map(|m| m.len), Some(8 * SS));
    for _ in 0..10 {
        assert_eq!(read_all(&e, id, (32 * SS) as usize), a);
    }
    let s2 = e.extent_map_stats();
    assert_eq!(
        (s2.misses - s1.misses, s2.hits - s1.hits),
        (0, 10),
        "repeated reads come from the maps"
    );
    // An overwrite in the middle drops the range it changed and the split extent's
    // tail (a new item): the maps before and after stay, and the split extent's head.
    e.write_file(id, 12 * SS, &[0xaa; SS as usize]).expect("overwrite");
    let em = &inode.mapping.extent_map;
    assert!(em.lookup(0, 8 * SS).is_some(), "the map before the change stays");
    assert!(em.lookup(12 * SS, SS).is_none(), "the changed range was dropped");
    assert_eq!(
        em.lookup(8 * SS, 4 * SS).map(|m| (m.start, m.len)),
        Some((8 * SS, 4 * SS)),
        "the split extent's head stays"
    );
    assert_eq!(
        em.lookup(16 * SS, 16 * SS).map(|m| m.start),
        Some(16 * SS),
        "the maps after the change stay"
    );
    assert!(em.lookup(24 * SS, 8 * SS).is_some(), "the last extent's map stays");
    let mut want = a.clone();
    want[(12 * SS) as usize..(13 * SS) as usize].fill(0xaa);
    assert_eq!(read_all(&e, id, (32 * SS) as usize), want);
    let s3 = e.extent_map_stats();
    assert_eq!(s3.misses - s2.misses, 1);
    e.extent_maps().check_invariants();
}

/// Many files read once: the maps pass a small budget, a run brings them back under it,
/// and the files still read right (from the trees again).
#[test]
fn the_budget_bounds_the_maps_and_reads_stay_right() {
    let (_img, e) = engine("em-budget", &[]);
    let mut files = Vec::new();
    for f in 0..40u64 {
        let id = create(&e, &format!("f{f}"));
        let mut data = Vec::new();
        for i in 0..6u64 {
            let piece = vec![(f * 7 + i) as u8; SS as usize];
            // Every other block: separate extents that cannot merge once read back.
            e.write_file(id, 2 * i * SS, &piece).expect("write");
            data.resize((2 * i * SS) as usize, 0);
            data.extend_from_slice(&piece);
        }
        files.push((id, data));
    }
    // Inodes without maps: stat'ed only.
    let mut dirs = Vec::new();
    for d in 0..200u64 {
        let ino = e
            .write(|w| w.mkdir(5, 256, format!("d{d}").as_bytes(), &InodeAttrs::new(0o755)))
            .expect("mkdir");
        e.getattr(InodeId { root: 5, ino }).expect("stat");
        dirs.push(ino);
    }
    for (id, data) in &files {
        assert_eq!(&read_all(&e, *id, data.len() + 100), data);
    }
    let before = e.extent_map_stats();
    assert!(before.evictable >= 40 * 11, "{} maps", before.evictable);
    assert_eq!(before.registered, 40);
    e.set_extent_map_limit(100);
    let after = e.extent_map_stats();
    assert!(after.evictable <= 100, "{} maps over the budget of 100", after.evictable);
    assert!(
        after.visited - before.visited <= 40,
        "visited {} registry entries, 40 inodes have maps",
        after.visited - before.visited
    );
    e.extent_maps().check_invariants();
    // Reads past the budget shrink as they go.
    for (id, data) in &files {
        assert_eq!(&read_all(&e, *id, data.len() + 100), data);
        assert!(
            e.extent_map_stats().evictable <= 100 + 12,
            "{} maps",
            e.extent_map_stats().evictable
        );
    }
    e.extent_maps().check_invariants();
}

#[test]
fn readers_read_right_while_the_shrinker_frees() {
    let (_img, e) = engine("em-concurrent", &[]);
    let mut files = Vec::new();
    for f in 0..8u64 {
        let id = create(&e, &format!("f{f}"));
        let mut data = Vec::new();
        for i in 0..16u64 {
            let piece: Vec<u8> = (0..SS).map(|b| (b as u8) ^ (f * 31 + i) as u8).collect();
            e.write_file(id, 2 * i * SS, &piece).expect("write");
            data.resize((2 * i * SS) as usize, 0);
            data.extend_from_slice(&piece);
        }
        files.push((id, data));
    }
    e.commit().expect("commit");
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        for r in 0..3usize {
            let (e, files, stop) = (&e, &files, &stop);
            s.spawn(move || {
                let mut rng = Rng::new(r as u64 + 10);
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) || n < 200 {
                    let (id, data) = &files[rng.below(files.len() as u64) as usize];
                    let off = rng.below(data.len() as u64);
                    let len = rng.range(1, 6 * SS);
                    check_range(e, *id, data, off, len, &format!("reader {r}"));
                    n += 1;
                }
            });
        }
        // At least 200 rounds, and on until the shrinker has freed maps the readers
        // filled (the readers may not have started when the first rounds run), for
        // at most 20 s.
        let t0 = std::time::Instant::now();
        let mut round = 0u64;
        while round < 200
            || (e.extent_map_stats().freed == 0
                && t0.elapsed() < std::time::Duration::from_secs(20))
        {
            e.set_extent_map_limit(if round.is_multiple_of(2) { 0 } else { 1000 });
            e.extent_maps().free_extent_maps(50);
            round += 1;
            if round >= 200 {
                std::thread::yield_now();
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    let st = e.extent_map_stats();
    assert!(st.freed > 0 && st.hits > 0 && st.misses > 0, "{st:?}");
    e.extent_maps().check_invariants();
}

/// Inline extents (grown, shrunk, then pushed out to a regular extent) and the maps
/// around them: every read returns the model's bytes.
#[test]
fn inline_extents_grow_shrink_and_convert_under_the_maps() {
    let (_img, e) = engine("em-inline", &[]);
    let id = create(&e, "small");
    let mut model = Vec::new();
    let steps: [(u64, usize); 5] = [(0, 100), (100, 50), (10, 200), (0, 3000), (3000, 9000)];
    for (i, (off, len)) in steps.into_iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|b| (b as u8).wrapping_mul(7) ^ i as u8).collect();
        e.write_file(id, off, &data).expect("write");
        if model.len() < off as usize + len {
            model.resize(off as usize + len, 0);
        }
        model[off as usize..off as usize + len].copy_from_slice(&data);
        for _ in 0..2 {
            assert_eq!(read_all(&e, id, 1 << 16), model, "after write {i} [{off}, +{len})");
        }
        if i == 2 {
            e.setattr(id, &SetAttr { size: Some(30), ..Default::default() }).expect("truncate");
            model.truncate(30);
            assert_eq!(read_all(&e, id, 1 << 16), model, "after truncate to 30");
        }
    }
    e.extent_maps().check_invariants();
}
