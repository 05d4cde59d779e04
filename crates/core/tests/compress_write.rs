//! Compression on write, against the kernel: files ubtrfs writes with zlib, lzo and
//! zstd (at several levels, `compress` and `compress-force`, and by the per-inode
//! property and flag) read back through the kernel byte for byte and check clean; the
//! extents are what the kernel makes (128 KiB pieces, compressed inline for small
//! files, plain and NOCOMPRESS for data that does not shrink), and the space they take
//! is within a few percent of the kernel's for the same data.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::BTreeMap;
use ubtrfs_core::compression::CompressPolicy;
use ubtrfs_core::compression::CompressionType;
use ubtrfs_core::inode::filesystem::{ExtentKind, FsRead, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FsWriter;
use ubtrfs_format::structs::*;
use write_common::*;

/// Text-like data that compresses about 3:1 (varied enough not to collapse).
fn text(n: usize, seed: u64) -> Vec<u8> {
    let words = [
        "btrfs",
        "extent",
        "checksum",
        "subvolume",
        "transaction",
        "the",
        "of",
        "and",
        "compress",
        "zstd",
        "inode",
        "leaf",
        "node",
        "chunk",
        "device",
    ];
    let mut rng = Rng::new(seed);
    let mut v = Vec::with_capacity(n + 16);
    while v.len() < n {
        v.extend_from_slice(words[rng.below(words.len() as u64) as usize].as_bytes());
        v.push(if rng.chance(10) { b'\n' } else { b' ' });
        if rng.chance(5) {
            v.extend_from_slice(format!("{}", rng.below(100000)).as_bytes());
        }
    }
    v.truncate(n);
    v
}

/// Per file: (compression byte, uncompressed bytes, disk bytes) of each extent, and
/// the inode flags.
fn layout(w: &FsWriter, path: &str) -> (Vec<(u8, u64, u64, bool)>, u64) {
    let live = w.live();
    let id = live.resolve_id(path, false).expect("path");
    let v = live.load_inode(id, Load { extents: true, ..Load::ITEM }).expect("inode");
    let ext = v
        .extents
        .iter()
        .map(|f| match &f.kind {
            ExtentKind::Regular { disk_bytenr, disk_num_bytes, compression, num_bytes, .. } => (
                *compression,
                *num_bytes,
                if *disk_bytenr == 0 { 0 } else { *disk_num_bytes },
                false,
            ),
            ExtentKind::Inline { compression, ram_bytes, .. } => {
                (*compression, *ram_bytes, 0, true)
            }
        })
        .collect();
    (ext, v.item.flags.get())
}

fn create(w: &mut FsWriter, name: &str, data: &[u8]) -> InodeId {
    let top = w.live().root_dir();
    let ino =
        w.create_file(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o644)).expect("create");
    if !data.is_empty() {
        w.write_file(top.root, ino, 0, data).expect("write");
    }
    InodeId { root: top.root, ino }
}

fn kernel_reads(img: &std::path::Path, want: &BTreeMap<String, Vec<u8>>, what: &str) {
    let m = Mount::new(img, false);
    for (name, data) in want {
        let got = std::fs::read(m.path(name))
            .unwrap_or_else(|e| panic!("{what}: kernel read {name}: {e}"));
        assert!(
            got == *data,
            "{what}: /{name}: the kernel reads {} bytes, {} written; first difference at {:?}",
            got.len(),
            data.len(),
            got.iter().zip(data).position(|(a, b)| a != b)
        );
    }
    m.umount();
}

#[test]
fn every_algorithm_and_level_reads_back_through_the_kernel() {
    if !common::kernel_available("every_algorithm_and_level_reads_back_through_the_kernel") {
        return;
    }
    let img = Scratch::mkfs("cw-algs", 1 << 30, &[]);
    let mut want = BTreeMap::new();
    let mut rng = Rng::new(1);
    let random = rng.bytes(600_000);
    let cases: [(&str, bool); 8] = [
        ("zlib", false),
        ("zlib:9", false),
        ("lzo", false),
        ("zstd", false),
        ("zstd:1", false),
        ("zstd:15", false),
        ("zstd:-5", false),
        ("zstd", true),
    ];
    let mut w = img.writer();
    for (i, (spec, force)) in cases.iter().enumerate() {
        w.set_compress(CompressPolicy::parse(spec, *force).expect("policy"));
        let tag = format!("{}{}", spec.replace(':', "_"), if *force { "-force" } else { "" });
        let kind = CompressPolicy::parse(spec, *force).unwrap().alg.unwrap() as u8;
        let t = text(1_000_003, i as u64);
        // A large text file: 128 KiB compressed pieces, the last one short.
        create(&mut w, &format!("{tag}-text"), &t);
        let (ext, flags) = layout(&w, &format!("/{tag}-text"));
        assert!(
            ext.iter().all(|e| e.0 == kind && e.1 <= 128 << 10 && !e.3),
            "{tag}: text extents {ext:?}"
        );
        assert_eq!(
            ext.iter().map(|e| e.1).sum::<u64>(),
            1_000_003u64.div_ceil(4096) * 4096,
            "{tag}: extents cover the file"
        );
        assert_eq!(flags & INODE_NOCOMPRESS, 0, "{tag}: text is compressible");
        want.insert(format!("{tag}-text"), t);
        // Random data: compress's heuristic turns it down (one plain extent, the file
        // not marked, as the kernel does); compress-force tries every piece, none
        // shrinks, and the file is not marked either.
        create(&mut w, &format!("{tag}-random"), &random);
        let (ext, flags) = layout(&w, &format!("/{tag}-random"));
        assert!(ext.iter().all(|e| e.0 == 0), "{tag}: random data stays plain: {ext:?}");
        if !*force {
            assert_eq!(ext.len(), 1, "{tag}: one plain extent: {ext:?}");
        }
        assert_eq!(
            flags & INODE_NOCOMPRESS,
            0,
            "{tag}: random data turned down by the heuristic does not mark the file"
        );
        // 3000 random bytes: the heuristic sees the zero-padded sector, says yes, the
        // compression fails, and compress marks the file NOCOMPRESS (the kernel's `m`).
        let odd = rng.bytes(3000);
        create(&mut w, &format!("{tag}-odd"), &odd);
        let (ext, flags) = layout(&w, &format!("/{tag}-odd"));
        assert!(ext.iter().all(|e| e.0 == 0), "{tag}: {ext:?}");
        assert_eq!(
            flags & INODE_NOCOMPRESS != 0,
            !*force,
            "{tag}: NOCOMPRESS after a range that did not shrink"
        );
        want.insert(format!("{tag}-odd"), odd);
        want.insert(format!("{tag}-random"), random.clone());
        // Small files: compressed inline; one that does not fit inline but compresses.
        let small = text(1500, 99 + i as u64);
        create(&mut w, &format!("{tag}-small"), &small);
        let (ext, _) = layout(&w, &format!("/{tag}-small"));
        assert_eq!(ext, vec![(kind, 1500, 0, true)], "{tag}: small file");
        want.insert(format!("{tag}-small"), small);
        let tiny_random = rng.bytes(100);
        create(&mut w, &format!("{tag}-tiny"), &tiny_random);
        let (ext, _) = layout(&w, &format!("/{tag}-tiny"));
        assert_eq!(
            ext,
            vec![(0, 100, 0, true)],
            "{tag}: tiny incompressible file stays plain inline"
        );
        want.insert(format!("{tag}-tiny"), tiny_random);
        // Mixed: text, then random, then text, written in pieces and overwritten in
        // the middle (read-modify-write through compressed extents).
        let mut mixed = text(300_000, 7 + i as u64);
        mixed.extend_from_slice(&rng.bytes(200_000));
        mixed.extend_from_slice(&text(300_000, 8 + i as u64));
        let id = create(&mut w, &format!("{tag}-mixed"), &[]);
        for chunk in mixed.chunks(65_536).enumerate() {
            w.write_file(id.root, id.ino, (chunk.0 * 65_536) as u64, chunk.1).expect("write piece");
        }
        let patch = b"PATCHED IN THE MIDDLE OF A COMPRESSED EXTENT";
        w.write_file(id.root, id.ino, 12_345, patch).expect("patch");
        mixed[12_345..12_345 + patch.len()].copy_from_slice(patch);
        want.insert(format!("{tag}-mixed"), mixed);
    }
    w.commit().expect("commit");
    drop(w);
    assert_check(&img.path, "compressed writes");
    kernel_reads(&img.path, &want, "compressed writes");
    // The kernel can overwrite and truncate what ubtrfs compressed.
    {
        let m = Mount::new(&img.path, true);
        use std::os::unix::fs::FileExt;
        for name in want.keys() {
            let f = std::fs::OpenOptions::new().write(true).open(m.path(name)).expect("open");
            f.write_all_at(b"kernel", 70_000).expect("write");
            f.set_len(90_001).expect("truncate");
        }
        m.umount();
    }
    assert_check(&img.path, "after the kernel's overwrites");
    // The image says which algorithms it holds.
    let r = img.reader();
    let f = r.info().super_copy().incompat_flags.get();
    assert_ne!(f & ubtrfs_format::features::INCOMPAT_COMPRESS_ZSTD, 0, "COMPRESS_ZSTD set");
    assert_ne!(f & ubtrfs_format::features::INCOMPAT_COMPRESS_LZO, 0, "COMPRESS_LZO set");
}

/// The per-inode property (`btrfs property set F compression zstd`) and flag
/// (`chattr +c`) compress without a mount option; `chattr +m` (NOCOMPRESS) and
/// NODATACOW files never are, even with compress-force.
#[test]
fn property_and_flags_choose_compression() {
    if !common::kernel_available("property_and_flags_choose_compression") {
        return;
    }
    let img = Scratch::mkfs("cw-prop", 512 << 20, &[]);
    {
        let m = Mount::new(&img.path, true);
        for n in ["prop-zstd", "prop-lzo", "flag-c", "flag-m", "nocow"] {
            std::fs::write(m.path(n), b"").expect("create");
        }
        let run = |args: &[&str]| {
            let o = std::process::Command::new(args[0]).args(&args[1..]).output().expect("run");
            assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        };
        run(&[
            "btrfs",
            "property",
            "set",
            m.path("prop-zstd").to_str().unwrap(),
            "compression",
            "zstd",
        ]);
        run(&[
            "btrfs",
            "property",
            "set",
            m.path("prop-lzo").to_str().unwrap(),
            "compression",
            "lzo",
        ]);
        run(&["chattr", "+c", m.path("flag-c").to_str().unwrap()]);
        run(&["chattr", "+m", m.path("flag-m").to_str().unwrap()]);
        run(&["chattr", "+C", m.path("nocow").to_str().unwrap()]);
        m.umount();
    }
    let t = text(400_000, 5);
    let mut w = img.writer();
    let top = w.live().root_dir();
    for n in ["prop-zstd", "prop-lzo", "flag-c", "flag-m"] {
        let id = w.live().lookup(top, n.as_bytes()).expect("lookup").expect("exists").target;
        w.write_file(id.root, id.ino, 0, &t).expect("write");
    }
    let (zs, _) = layout(&w, "/prop-zstd");
    let (lz, _) = layout(&w, "/prop-lzo");
    let (fc, _) = layout(&w, "/flag-c");
    let (fm, _) = layout(&w, "/flag-m");
    assert!(zs.iter().all(|e| e.0 == CompressionType::Zstd as u8), "{zs:?}");
    assert!(lz.iter().all(|e| e.0 == CompressionType::Lzo as u8), "{lz:?}");
    // chattr +c sets the property to zlib (the kernel's default algorithm).
    assert!(fc.iter().all(|e| e.0 == CompressionType::Zlib as u8), "{fc:?}");
    assert!(fm.iter().all(|e| e.0 == 0), "{fm:?}");
    w.set_compress(CompressPolicy::parse("zstd", true).unwrap());
    let id = w.live().lookup(top, b"nocow").expect("lookup").expect("exists").target;
    w.write_file(id.root, id.ino, 0, &t).expect("write");
    let (nc, flags) = layout(&w, "/nocow");
    assert!(nc.iter().all(|e| e.0 == 0) && flags & INODE_NODATACOW != 0, "{nc:?}");
    w.commit().expect("commit");
    drop(w);
    assert_check(&img.path, "property and flags");
    let want: BTreeMap<String, Vec<u8>> = ["prop-zstd", "prop-lzo", "flag-c", "flag-m", "nocow"]
        .iter()
        .map(|n| (n.to_string(), t.clone()))
        .collect();
    kernel_reads(&img.path, &want, "property and flags");
}

/// The same data written by the kernel (mount -o compress=ALG) and by ubtrfs takes
/// the same space within 5%.
#[test]
fn compressed_size_is_the_kernels() {
    if !common::kernel_available("compressed_size_is_the_kernels") {
        return;
    }
    let mut rng = Rng::new(77);
    let mut data = text(3_000_000, 1);
    data.extend_from_slice(&rng.bytes(500_000));
    data.extend_from_slice(&text(2_000_000, 2));
    for alg in ["zlib", "lzo", "zstd"] {
        let k = Scratch::mkfs(&format!("cw-size-k-{alg}"), 512 << 20, &[]);
        let u = Scratch::mkfs(&format!("cw-size-u-{alg}"), 512 << 20, &[]);
        {
            let m = Mount::new_with(&k.path, &format!("loop,compress={alg}"));
            std::fs::write(m.path("f"), &data).expect("kernel write");
            m.umount();
        }
        let mut w = u.writer();
        w.set_compress(CompressPolicy::parse(alg, false).unwrap());
        create(&mut w, "f", &data);
        w.commit().expect("commit");
        drop(w);
        let disk = |img: &Scratch| {
            let w = img.writer();
            let (ext, _) = layout(&w, "/f");
            ext.iter().map(|e| e.2).sum::<u64>()
        };
        let (kd, ud) = (disk(&k), disk(&u));
        let ratio = ud as f64 / kd as f64;
        eprintln!("{alg}: kernel {kd} bytes on disk, ubtrfs {ud} ({ratio:.3})");
        // At most 5% more than the kernel (a better compressor may take less).
        assert!(ratio <= 1.05, "{alg}: ubtrfs takes {ud} bytes, the kernel {kd}");
    }
}

/// A small image filled with compressed writes until the space runs out: the refusal
/// is ENOSPC before the write changes anything, the image checks clean, and after the
/// deletes are committed the space takes new files again, several times over.
#[test]
fn fill_delete_fill_with_compression() {
    if !common::kernel_available("fill_delete_fill_with_compression") {
        return;
    }
    let img = Scratch::mkfs("cw-enospc", 160 << 20, &[]);
    let mut rng = Rng::new(5);
    for round in 0..3 {
        let mut w = img.writer();
        w.set_compress(CompressPolicy::parse("zstd", false).unwrap());
        let top = w.live().root_dir();
        let mut made = Vec::new();
        let mut refused = None;
        for i in 0..400 {
            let name = format!("r{round}-{i}");
            let ino = w
                .create_file(top.root, top.ino, name.as_bytes(), &InodeAttrs::new(0o644))
                .expect("create");
            // Half compressible, half not.
            let data = if i % 2 == 0 { text(3 << 20, i) } else { rng.bytes(3 << 20) };
            match w.write_file(top.root, ino, 0, &data) {
                Ok(()) => made.push(name),
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        let e = refused.unwrap_or_else(|| panic!("round {round}: the image never filled"));
        assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::NoSpace), "round {round}: {e}");
        w.check_writable().expect("ENOSPC does not abort");
        w.commit().expect("commit what fit");
        drop(w);
        assert_check(&img.path, &format!("round {round}: full"));
        // Delete most of it; commit; the next round fills again.
        let mut w = img.writer();
        for n in made.iter().take(made.len() * 3 / 4) {
            w.unlink(top.root, top.ino, n.as_bytes()).expect("unlink");
        }
        w.commit().expect("commit the deletes");
        drop(w);
        assert_check(&img.path, &format!("round {round}: after the deletes"));
    }
    let m = Mount::new(&img.path, false);
    m.umount();
}

/// Data block groups of the committed image: (start, length, used).
fn data_groups(img: &Scratch) -> Vec<(u64, u64, u64)> {
    let info =
        ubtrfs_core::disk_io::FsInfo::open(&ubtrfs_core::disk_io::OpenOptions::new(&img.path))
            .expect("open");
    info.block_groups()
        .expect("block groups")
        .into_iter()
        .filter(|g| g.flags & BLOCK_GROUP_DATA != 0)
        .map(|g| (g.start, g.length, g.used))
        .collect()
}

/// `n` files of one sector of random data each, named `{prefix}{i}`, committed.
fn small_files(
    img: &Scratch,
    prefix: &str,
    n: u64,
    rng: &mut Rng,
) -> Result<u64, ubtrfs_core::Error> {
    let mut w = img.writer();
    let top = w.live().root_dir();
    let mut made = 0;
    for i in 0..n {
        let ino = w
            .create_file(
                top.root,
                top.ino,
                format!("{prefix}{i}").as_bytes(),
                &InodeAttrs::new(0o644),
            )
            .expect("create");
        if let Err(e) = w.write_file(top.root, ino, 0, &rng.bytes(4096)) {
            w.commit().expect("commit what fit");
            return Err(e);
        }
        made += 1;
    }
    w.commit().expect("commit");
    Ok(made)
}

/// Every other one of `n` files `{prefix}{i}` deleted and committed, leaving one-sector
/// holes between them.
fn delete_every_other(img: &Scratch, prefix: &str, n: u64) {
    let mut w = img.writer();
    let top = w.live().root_dir();
    for i in (0..n).step_by(2) {
        w.unlink(top.root, top.ino, format!("{prefix}{i}").as_bytes()).expect("unlink");
    }
    w.commit().expect("commit the deletes");
}

/// compress-force on a data chunk whose free space is all in one-sector holes: a
/// compressed extent cannot be split, so it gets a new data chunk (the kernel forces one
/// in find_free_extent) rather than failing with ENOSPC while the free total holds it.
#[test]
fn compressed_extent_on_fragmented_space_gets_a_new_chunk() {
    if !common::kernel_available("compressed_extent_on_fragmented_space_gets_a_new_chunk") {
        return;
    }
    let img = Scratch::mkfs("cw-frag-chunk", 1 << 30, &[]);
    let before = data_groups(&img);
    assert_eq!(before.len(), 1, "mkfs made one data group: {before:?}");
    let (_, len, used) = before[0];
    // Fill the data group exactly with one-sector files, then free every other one.
    let n = (len - used) / 4096;
    let mut rng = Rng::new(7);
    assert_eq!(small_files(&img, "s", n, &mut rng).expect("fill the group"), n);
    assert_eq!(data_groups(&img).len(), 1, "the fill stayed in the first group");
    delete_every_other(&img, "s", n);
    let free = len - data_groups(&img)[0].2;
    let data = text(1 << 20, 3);
    assert!(free >= data.len() as u64, "{free} bytes free in holes, {} to write", data.len());
    let mut w = img.writer();
    w.set_compress(CompressPolicy::parse("zstd", true).unwrap());
    create(&mut w, "big", &data);
    let (ext, _) = layout(&w, "/big");
    w.commit().expect("commit");
    drop(w);
    assert!(
        ext.iter().all(|e| e.0 == CompressionType::Zstd as u8),
        "every piece compressed: {ext:?}"
    );
    assert_eq!(ext.len(), 8, "128 KiB pieces: {ext:?}");
    let after = data_groups(&img);
    assert_eq!(after.len(), 2, "a new data group: {after:?}");
    assert_check(&img.path, "compressed after a forced chunk");
    kernel_reads(&img.path, &BTreeMap::from([("big".to_string(), data)]), "forced chunk");
}

/// The same with no room on the device for another data chunk: the compressed pieces
/// go plain into the holes (the kernel's submit_uncompressed_range) and the write
/// succeeds, with no new group.
#[test]
fn compressed_write_on_fragmented_full_device_goes_plain() {
    if !common::kernel_available("compressed_write_on_fragmented_full_device_goes_plain") {
        return;
    }
    let img = Scratch::mkfs("cw-frag-full", 256 << 20, &[]);
    let mut rng = Rng::new(8);
    // Fill the device with 1 MiB files.
    {
        let mut w = img.writer();
        let top = w.live().root_dir();
        for i in 0.. {
            let ino = w
                .create_file(top.root, top.ino, format!("m{i}").as_bytes(), &InodeAttrs::new(0o644))
                .expect("create");
            if let Err(e) = w.write_file(top.root, ino, 0, &rng.bytes(1 << 20)) {
                assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::NoSpace), "{e}");
                break;
            }
        }
        w.commit().expect("commit");
    }
    // Free one big file's space, and fill it with one-sector files.
    {
        let mut w = img.writer();
        let top = w.live().root_dir();
        w.unlink(top.root, top.ino, b"m0").expect("unlink");
        w.commit().expect("commit");
    }
    let e = small_files(&img, "s", 1 << 20, &mut rng).expect_err("the data space fills");
    assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::NoSpace), "{e}");
    let n = {
        let w = img.writer();
        let live = w.live();
        (0..).take_while(|i| live.resolve_id(&format!("/s{i}"), false).is_ok()).count() as u64
    };
    assert!(
        n >= 64,
        "{n} small files fit after the big ones, then: {e}; groups {:?}",
        data_groups(&img)
    );
    delete_every_other(&img, "s", n);
    let groups = data_groups(&img);
    let data = text(256 << 10, 4);
    let mut w = img.writer();
    w.set_compress(CompressPolicy::parse("zstd", true).unwrap());
    create(&mut w, "big", &data);
    let (ext, _) = layout(&w, "/big");
    w.commit().expect("commit");
    drop(w);
    assert!(ext.iter().any(|e| e.0 == 0), "plain pieces where no compressed extent fits: {ext:?}");
    assert_eq!(ext.iter().map(|e| e.1).sum::<u64>(), data.len() as u64, "{ext:?}");
    assert_eq!(data_groups(&img).len(), groups.len(), "no new data group on a full device");
    assert_check(&img.path, "plain fallback on a full device");
    kernel_reads(&img.path, &BTreeMap::from([("big".to_string(), data)]), "plain fallback");
}
