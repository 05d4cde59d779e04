//! Clone range and dedupe range (`data::reflink`) against the oracles: the bytes
//! every file shows through a fresh reader and through the kernel, `btrfs check
//! --check-data-csum`, the kernel's `btrfs filesystem du` counting the bytes shared,
//! and the kernel then overwriting and deleting shared data on the image, which must
//! check clean again. Also the kernel's refusals (EINVAL, EISDIR) and 10,000 extents
//! in one clone.
//!
//! Needs mkfs.btrfs, btrfs-progs and (for the kernel side) root with loop devices;
//! without them the tests print why and pass, except under CI=true.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::BTreeMap;
use ubtrfs_core::data::reflink::Dedupe;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::error::PosixKind;
use ubtrfs_core::inode::filesystem::{ExtentKind, InodeId};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::{FsRead, OpenOptions};
use write_common::*;

fn create(e: &Engine, root: u64, name: &str) -> InodeId {
    let ino = e
        .write(|w| w.create_file(root, 256, name.as_bytes(), &InodeAttrs::new(0o644)))
        .expect("create file");
    InodeId { root, ino }
}

/// The disk extents file `id` references, as (bytenr, file offset) pairs.
fn disk_extents(e: &Engine, id: InodeId) -> Vec<(u64, u64)> {
    e.read(|l| l.file_extents(id, 0, u64::MAX))
        .expect("file extents")
        .iter()
        .filter_map(|f| match f.kind {
            ExtentKind::Regular { disk_bytenr, .. } if disk_bytenr != 0 => {
                Some((disk_bytenr, f.file_offset))
            }
            _ => None,
        })
        .collect()
}

/// `model[at..at + src.len()] = src`, growing it with zeros.
fn put(model: &mut Vec<u8>, at: usize, src: &[u8]) {
    if src.is_empty() {
        return;
    }
    if model.len() < at + src.len() {
        model.resize(at + src.len(), 0);
    }
    model[at..at + src.len()].copy_from_slice(src);
}

fn kernel_reads(m: &Mount, files: &BTreeMap<String, Vec<u8>>, what: &str) {
    for (name, data) in files {
        let got = std::fs::read(m.path(name))
            .unwrap_or_else(|e| panic!("{what}: kernel read {name}: {e}"));
        assert!(
            got == *data,
            "{what}: /{name}: the kernel reads {} bytes, {} expected; first difference at {:?}",
            got.len(),
            data.len(),
            got.iter().zip(data).position(|(a, b)| a != b)
        );
    }
}

#[test]
fn clones_share_extents_the_kernel_reads_overwrites_and_deletes() {
    if !common::kernel_available("clones_share_extents_the_kernel_reads_overwrites_and_deletes") {
        return;
    }
    clone_scenario("rl-basic", &[]);
}

/// The same with quotas on (the clones' refs reach the qgroups through the delayed
/// refs, and `btrfs check` verifies the counts) and without no-holes (holes cloned
/// as explicit hole items).
#[test]
fn clones_keep_quotas_and_hole_items_exact() {
    if !common::kernel_available("clones_keep_quotas_and_hole_items_exact") {
        return;
    }
    clone_scenario("rl-quota", &["-R", "quota", "-O", "^no-holes"]);
}

fn clone_scenario(tag: &str, mkfs_args: &[&str]) {
    let s = Scratch::mkfs(tag, 512 << 20, mkfs_args);
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    let mut rng = Rng::new(11);
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut ids: BTreeMap<String, InodeId> = BTreeMap::new();
    let mut new = |name: &str, root: u64| {
        let id = create(&e, root, name.rsplit('/').next().expect("a name"));
        ids.insert(name.to_string(), id);
        id
    };
    // a: three extents, 3 MiB and 1000 bytes (its last block partial).
    let a = new("a", 5);
    let da = rng.bytes((3 << 20) + 1000);
    for (i, piece) in da.chunks(1 << 20).enumerate() {
        e.write_file(a, (i as u64) << 20, piece).expect("write a");
    }
    files.insert("a".into(), da.clone());
    // 1. All of a (length 0: to its EOF) into a new file.
    let b = new("b", 5);
    assert_eq!(e.clone_range(a, 0, 0, b, 0).expect("clone a to b"), da.len() as u64);
    files.insert("b".into(), da.clone());
    assert_eq!(
        disk_extents(&e, a),
        disk_extents(&e, b),
        "b points at a's extents, at the same offsets"
    );
    // 2. A piece from inside two extents over c's own data.
    let c = new("c", 5);
    let mut dc = rng.bytes(64 << 10);
    e.write_file(c, 0, &dc).expect("write c");
    let (from, len) = ((1 << 20) + 4096, (1 << 20) + 8192);
    e.clone_range(a, from, len, c, 8192).expect("clone into c");
    put(&mut dc, 8192, &da[from as usize..(from + len) as usize]);
    files.insert("c".into(), dc);
    // 3. Within one file: a's first MiB past its EOF (the gap becomes a hole and the
    // old last block's tail zeros).
    e.clone_range(a, 0, 1 << 20, a, 5 << 20).expect("clone within a");
    let mut da2 = da.clone();
    put(&mut da2, 5 << 20, &da[..1 << 20]);
    files.insert("a".into(), da2.clone());
    // 4. Across subvolumes.
    let sv = e
        .write(|w| w.create_subvol(5, 256, b"sv", &InodeAttrs::new(0o755)))
        .expect("create subvolume");
    let d = new("sv/d", sv);
    e.clone_range(a, 0, 2 << 20, d, 0).expect("clone across subvolumes");
    files.insert("sv/d".into(), da[..2 << 20].to_vec());
    // 5. An inline file: its bytes are copied.
    let small = new("small", 5);
    let ds = rng.bytes(100);
    e.write_file(small, 0, &ds).expect("write small");
    let s2 = new("small2", 5);
    assert_eq!(e.clone_range(small, 0, 0, s2, 0).expect("clone an inline file"), 100);
    files.insert("small".into(), ds.clone());
    files.insert("small2".into(), ds);
    // 6. Holes cloned as holes.
    let h = new("h", 5);
    let mut dh = Vec::new();
    let p1 = rng.bytes(64 << 10);
    let p2 = rng.bytes(64 << 10);
    e.write_file(h, 0, &p1).expect("write h");
    e.write_file(h, 1 << 20, &p2).expect("write h");
    put(&mut dh, 0, &p1);
    put(&mut dh, 1 << 20, &p2);
    let h2 = new("h2", 5);
    e.clone_range(h, 0, 0, h2, 0).expect("clone h");
    files.insert("h".into(), dh.clone());
    files.insert("h2".into(), dh);
    // 7. Dirty page-cache data is written back before it is cloned.
    let f = new("f", 5);
    let df = rng.bytes(300 << 10);
    e.buffered_write(f, 0, &df).expect("buffered write f");
    let g = new("g", 5);
    e.clone_range(f, 0, 0, g, 0).expect("clone dirty f");
    files.insert("f".into(), df.clone());
    files.insert("g".into(), df);
    // The clones point at the source's disk extents.
    let shared = |x: InodeId, y: InodeId| {
        disk_extents(&e, x)
            .iter()
            .filter(|(bn, _)| disk_extents(&e, y).iter().any(|(b2, _)| b2 == bn))
            .count()
    };
    assert!(shared(a, c) > 0, "c shares a's extents");
    assert!(shared(f, g) > 0, "g shares f's extents");
    assert!(shared(a, d) > 0, "d (another subvolume) shares a's extents");
    for (name, want) in &files {
        let mut buf = vec![0u8; want.len() + 10];
        let n = e.read_file(ids[name], 0, &mut buf).expect("read");
        assert!(
            n == want.len() && buf[..n] == want[..],
            "{name} reads back wrong before the commit"
        );
    }
    e.commit().expect("commit");
    drop(e);
    for (name, want) in &files {
        assert!(read_image(&s.path, ids[name]) == *want, "{name} differs on the image");
    }
    assert_check(&s.path, "after the clones");
    // The kernel reads every file, counts the sharing, then overwrites and deletes
    // shared data.
    let m = Mount::new(&s.path, true);
    kernel_reads(&m, &files, "kernel after the clones");
    let shared_bytes = common::du_shared_bytes(&m.path(""));
    assert!(shared_bytes >= 3 << 20, "btrfs filesystem du counts {shared_bytes} shared bytes");
    {
        use std::os::unix::fs::FileExt;
        let fb = std::fs::OpenOptions::new().write(true).open(m.path("b")).expect("open b");
        let over = vec![0x5au8; 1 << 20];
        fb.write_all_at(&over, 1 << 19).expect("overwrite b");
        fb.sync_all().expect("fsync b");
        put(files.get_mut("b").unwrap(), 1 << 19, &over);
    }
    std::fs::remove_file(m.path("a")).expect("remove a");
    files.remove("a");
    m.umount();
    assert_check(&s.path, "after the kernel overwrote and deleted shared data");
    let m = Mount::new(&s.path, false);
    kernel_reads(&m, &files, "kernel after its own changes");
    m.umount();
}

#[test]
fn dedupe_shares_equal_ranges_and_leaves_different_ones() {
    if !mkfs_tools("dedupe_shares_equal_ranges_and_leaves_different_ones") {
        return;
    }
    let s = Scratch::mkfs("rl-dedupe", 256 << 20, &[]);
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    let mut rng = Rng::new(5);
    let data = rng.bytes((2 << 20) + 123);
    let (x, y, z) = (create(&e, 5, "x"), create(&e, 5, "y"), create(&e, 5, "z"));
    e.write_file(x, 0, &data).expect("write x");
    e.write_file(y, 0, &data).expect("write y");
    let mut dz = data.clone();
    dz[1 << 20] ^= 1;
    e.write_file(z, 0, &dz).expect("write z");
    e.commit().expect("commit");
    let before = e.getattr(y).expect("getattr y");
    assert_eq!(
        e.dedupe_range(x, 0, data.len() as u64, y, 0).expect("dedupe x y"),
        Dedupe::Same(data.len() as u64)
    );
    let after = e.getattr(y).expect("getattr y");
    assert_eq!(disk_extents(&e, x), disk_extents(&e, y), "y shares x's extents");
    assert_eq!(
        (before.mtime.sec.get(), before.mtime.nsec.get()),
        (after.mtime.sec.get(), after.mtime.nsec.get()),
        "a dedupe changes no times"
    );
    let zext = disk_extents(&e, z);
    assert_eq!(e.dedupe_range(x, 0, data.len() as u64, z, 0).expect("dedupe x z"), Dedupe::Differs);
    assert_eq!(disk_extents(&e, z), zext, "a dedupe of different bytes changes nothing");
    // Shortened to whole blocks where the range does not reach both ends.
    assert_eq!(
        e.dedupe_range(x, 0, (1 << 20) + 100, z, 0).expect("dedupe the equal first MiB"),
        Dedupe::Same(1 << 20)
    );
    e.commit().expect("commit");
    drop(e);
    assert!(
        read_image(&s.path, y) == data && read_image(&s.path, z) == dz,
        "bytes changed on the image"
    );
    assert_check(&s.path, "after the dedupes");
}

#[test]
fn refusals_are_the_kernels() {
    if !mkfs_tools("refusals_are_the_kernels") {
        return;
    }
    let s = Scratch::mkfs("rl-refuse", 256 << 20, &[]);
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    let (a, b) = (create(&e, 5, "a"), create(&e, 5, "b"));
    e.write_file(a, 0, &vec![1u8; (1 << 20) + 10]).expect("write a");
    e.write_file(b, 0, &vec![2u8; 1 << 20]).expect("write b");
    let kind = |r: ubtrfs_core::Result<u64>| r.expect_err("refused").posix_kind();
    assert_eq!(
        kind(e.clone_range(a, 100, 4096, b, 0)),
        Some(PosixKind::Invalid),
        "unaligned source offset"
    );
    assert_eq!(
        kind(e.clone_range(a, 0, 4096, b, 100)),
        Some(PosixKind::Invalid),
        "unaligned destination offset"
    );
    assert_eq!(
        kind(e.clone_range(a, 0, 5000, b, 0)),
        Some(PosixKind::Invalid),
        "unaligned length inside the source"
    );
    assert_eq!(
        kind(e.clone_range(a, 1 << 20, 10, b, 0)),
        Some(PosixKind::Invalid),
        "a partial block into the destination's data"
    );
    assert_eq!(
        kind(e.clone_range(a, 0, 2 << 20, b, 0)),
        Some(PosixKind::Invalid),
        "past the source's end"
    );
    assert_eq!(
        kind(e.clone_range(a, 0, 8192, a, 4096)),
        Some(PosixKind::Invalid),
        "overlap in one file"
    );
    let dir = InodeId { root: 5, ino: 256 };
    assert_eq!(kind(e.clone_range(a, 0, 4096, dir, 0)), Some(PosixKind::IsDir), "a directory");
    // The EOF case is allowed: the unaligned tail of a to b's end (b grows).
    assert_eq!(e.clone_range(a, 1 << 20, 10, b, 1 << 20).expect("the tail at EOF"), 10);
    assert_eq!(e.getattr(b).expect("getattr").size.get(), (1 << 20) + 10);
    e.commit().expect("commit");
    drop(e);
    let mut want = vec![2u8; 1 << 20];
    want.extend_from_slice(&[1u8; 10]);
    assert!(read_image(&s.path, b) == want, "b differs");
    assert_check(&s.path, "after the refusals");
}

/// 10,000 extents in one clone: with 4 KiB nodes the file's items make a tree of
/// three levels, the destination's items span many leaves, and the refs all land.
#[test]
fn ten_thousand_extents_clone_in_one_call() {
    if !common::kernel_available("ten_thousand_extents_clone_in_one_call") {
        return;
    }
    let s = Scratch::mkfs("rl-10k", 512 << 20, &["-n", "4096"]);
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    let a = create(&e, 5, "a");
    let mut model = Vec::new();
    // One block every other block: no two extents merge.
    let n = 10_000u64;
    let w = e.open_file(a).expect("open a");
    for i in 0..n {
        let block = [(i % 251) as u8; 4096];
        w.write_at(i * 8192, &block).expect("write");
        put(&mut model, (i * 8192) as usize, &block);
    }
    drop(w);
    assert_eq!(disk_extents(&e, a).len() as u64, n);
    e.sync().expect("sync");
    let levels = e.write(|w| Ok(w.root(5)?.level)).expect("root") + 1;
    assert!(levels >= 3, "the tree has {levels} levels");
    let b = create(&e, 5, "b");
    e.clone_range(a, 0, 0, b, 0).expect("clone 10k extents");
    assert_eq!(disk_extents(&e, b).len() as u64, n, "b has every extent");
    e.commit().expect("commit");
    drop(e);
    assert!(read_image(&s.path, b) == model, "b differs on the image");
    assert_check(&s.path, "after cloning 10k extents");
    let m = Mount::new(&s.path, true);
    let files: BTreeMap<String, Vec<u8>> =
        [("a".to_string(), model.clone()), ("b".to_string(), model)].into();
    kernel_reads(&m, &files, "kernel after the 10k clone");
    std::fs::remove_file(m.path("a")).expect("remove a");
    m.umount();
    assert_check(&s.path, "after the kernel removed the source");
}

/// Random writes (direct and buffered), truncations, punched holes, clones and
/// dedupes over a few files (one in another subvolume) against a byte model, with
/// commits and reopenings between; every refusal must be one the kernel's rules
/// predict. Then every byte through a fresh reader, and `btrfs check`.
/// UBTRFS_RL_SEEDS and UBTRFS_RL_OPS lengthen the run.
#[test]
fn random_clones_against_a_model() {
    if !mkfs_tools("random_clones_against_a_model") {
        return;
    }
    let seeds: u64 =
        std::env::var("UBTRFS_RL_SEEDS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let ops: usize =
        std::env::var("UBTRFS_RL_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(250);
    for seed in 0..seeds {
        model_run(seed, ops);
    }
}

fn model_run(seed: u64, ops: usize) {
    const BS: u64 = 4096;
    let s = Scratch::mkfs(
        &format!("rl-model-{seed}"),
        512 << 20,
        if seed % 2 == 1 { &["-O", "^no-holes"] } else { &[] },
    );
    let mut e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    let sv =
        e.write(|w| w.create_subvol(5, 256, b"sv", &InodeAttrs::new(0o755))).expect("subvolume");
    let ids: Vec<InodeId> =
        (0..4).map(|i| create(&e, if i == 3 { sv } else { 5 }, &format!("f{i}"))).collect();
    let mut model: Vec<Vec<u8>> = vec![Vec::new(); ids.len()];
    let mut rng = Rng::new(seed * 7919 + 1);
    let aligned = |rng: &mut Rng, max: u64| rng.below(max / BS + 1) * BS;
    for op in 0..ops {
        let f = rng.below(ids.len() as u64) as usize;
        let what = format!("seed {seed} op {op}");
        let pick = rng.below(100);
        if std::env::var("UBTRFS_RL_TRACE").is_ok() {
            eprintln!(
                "{what}: f{f} kind {pick} sizes {:?}",
                model.iter().map(Vec::len).collect::<Vec<_>>()
            );
        }
        match pick {
            0..=24 => {
                let off = rng.below(3 << 20);
                let n = rng.range(1, 200_000) as usize;
                let data = rng.bytes(n);
                if rng.chance(50) {
                    e.write_file(ids[f], off, &data)
                        .unwrap_or_else(|err| panic!("{what}: write: {err}"));
                } else {
                    e.buffered_write(ids[f], off, &data)
                        .unwrap_or_else(|err| panic!("{what}: buffered write: {err}"));
                }
                put(&mut model[f], off as usize, &data);
            }
            25..=29 => {
                let size = rng.below(4 << 20);
                e.setattr(
                    ids[f],
                    &ubtrfs_core::inode::attr::SetAttr { size: Some(size), ..Default::default() },
                )
                .unwrap_or_else(|err| panic!("{what}: truncate: {err}"));
                model[f].resize(size as usize, 0);
            }
            30..=34 => {
                let (off, len) = (rng.below(3 << 20), rng.range(1, 1 << 20));
                e.fallocate(
                    ids[f],
                    ubtrfs_core::data::falloc::FALLOC_FL_PUNCH_HOLE
                        | ubtrfs_core::data::falloc::FALLOC_FL_KEEP_SIZE,
                    off,
                    len,
                )
                .unwrap_or_else(|err| panic!("{what}: punch: {err}"));
                let m = &mut model[f];
                let (a, z) = ((off as usize).min(m.len()), ((off + len) as usize).min(m.len()));
                m[a..z].fill(0);
            }
            35..=84 => {
                let g = rng.below(ids.len() as u64) as usize;
                let (ssize, dsize) = (model[f].len() as u64, model[g].len() as u64);
                let src_off = aligned(&mut rng, ssize);
                let to_eof = rng.chance(30);
                let len = if to_eof { 0 } else { rng.range(1, 600) * BS };
                let dst_off = aligned(&mut rng, dsize + (1 << 20));
                let n = if to_eof { ssize.saturating_sub(src_off) } else { len };
                let span = n.div_ceil(BS) * BS;
                let valid = src_off <= ssize
                    && src_off + n <= ssize
                    && (n.is_multiple_of(BS) || dst_off + n >= dsize)
                    && !(f == g && src_off < dst_off + span && dst_off < src_off + span);
                let dedupe = rng.chance(20) && dst_off + n <= dsize;
                if dedupe {
                    // A dedupe of n bytes: Same when they are equal (nothing changes
                    // either way in the model), shortened as the kernel shortens it.
                    let r = e.dedupe_range(ids[f], src_off, n, ids[g], dst_off);
                    match r {
                        Ok(Dedupe::Same(k)) => {
                            assert!(
                                model[f][src_off as usize..(src_off + k) as usize]
                                    == model[g][dst_off as usize..(dst_off + k) as usize],
                                "{what}: dedupe called different bytes the same"
                            );
                        }
                        Ok(Dedupe::Differs) => {}
                        Err(err) => assert_eq!(
                            err.posix_kind(),
                            Some(PosixKind::Invalid),
                            "{what}: dedupe: {err}"
                        ),
                    }
                    continue;
                }
                match e.clone_range(ids[f], src_off, len, ids[g], dst_off) {
                    Ok(k) => {
                        assert!(valid, "{what}: clone of {f}@{src_off}+{len} to {g}@{dst_off} accepted, the kernel refuses it");
                        assert_eq!(k, n, "{what}: cloned bytes");
                        let piece = model[f][src_off as usize..(src_off + n) as usize].to_vec();
                        put(&mut model[g], dst_off as usize, &piece);
                    }
                    Err(err) => {
                        assert!(
                            !valid || n == 0,
                            "{what}: clone of {f}@{src_off}+{len} to {g}@{dst_off} refused: {err}"
                        );
                        assert!(
                            n == 0 || err.posix_kind() == Some(PosixKind::Invalid),
                            "{what}: {err}"
                        );
                    }
                }
            }
            85..=94 => e.commit().map(|_| ()).unwrap_or_else(|err| panic!("{what}: commit: {err}")),
            _ => {
                e.sync().unwrap_or_else(|err| panic!("{what}: sync: {err}"));
                drop(e);
                e = Engine::open(&OpenOptions::new(&s.path)).expect("reopen");
            }
        }
        if op % 50 == 49 {
            for (i, id) in ids.iter().enumerate() {
                let mut buf = vec![0u8; model[i].len() + 1];
                let n = e.buffered_read(*id, 0, &mut buf).expect("read");
                assert!(
                    n == model[i].len() && buf[..n] == model[i][..],
                    "{what}: f{i} reads wrong ({n} bytes, {} in the model)",
                    model[i].len()
                );
            }
        }
    }
    e.sync().expect("sync");
    drop(e);
    for (i, id) in ids.iter().enumerate() {
        assert!(read_image(&s.path, *id) == model[i], "seed {seed}: f{i} differs on the image");
    }
    assert_check(&s.path, &format!("seed {seed} after random clones"));
}
