//! The bodies of the fuzz targets, callable from tests (crates/core/tests/corrupt.rs
//! includes this file and `walk.rs` with `#[path]` to replay saved inputs).
//!
//! Each body fixes up checksums so the fuzzer's bytes reach the validators and parsers
//! instead of dying at the checksum, and asserts the invariants the engine relies on:
//! what the tree checker accepts, the item parsers parse (core `expect`s that).
#![allow(dead_code)]

use crate::walk::{fix_block_csum, fix_super_csum, tree_blocks, walk_all, OverlayDevice};
use std::collections::BTreeSet;
use std::sync::Arc;
use ubtrfs_core::disk_io::FsInfo;
use ubtrfs_core::inode::filesystem::Filesystem;
use ubtrfs_core::volumes::device::BlockDevice;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsRead;
use ubtrfs_format::key::*;
use ubtrfs_format::node::NodeRef;
use ubtrfs_format::structs::{InodeItem, Superblock, SUPER_INFO_OFFSET, SUPER_INFO_SIZE};
use ubtrfs_format::tree_checker::{check_tree_block, CheckCtx};
use ubtrfs_format::{features, items, superblock, CsumType, Key};
use zerocopy::FromBytes;

/// Superblock target. `data[0]` controls: bit 0 keeps the checksum as given, bit 1
/// validates at the buffer's own `bytenr` (else at 64 KiB). `data[1..]` is the
/// superblock, zero-padded to 4096 bytes.
pub fn superblock(data: &[u8]) {
    let Some((&ctl, body)) = data.split_first() else { return };
    let mut buf = [0u8; SUPER_INFO_SIZE];
    let n = body.len().min(SUPER_INFO_SIZE);
    buf[..n].copy_from_slice(&body[..n]);
    if ctl & 1 == 0 {
        fix_super_csum(&mut buf);
    }
    let raw = Superblock::read_from_bytes(&buf[..]).expect("exactly one superblock");
    let at = if ctl & 2 != 0 { raw.bytenr.get() } else { SUPER_INFO_OFFSET };
    // Parsing the chunk array of an unvalidated superblock must not panic either.
    let _ = superblock::sys_chunk_array(&raw);
    if let Ok(sb) = superblock::check_super(&buf, at) {
        let chunks =
            superblock::sys_chunk_array(&sb).expect("check_super accepted the sys_chunk_array");
        assert!(!chunks.is_empty(), "check_super accepted an empty sys_chunk_array");
        let _ = features::check_features(sb.incompat_flags.get(), sb.compat_ro_flags.get());
        let _ = features::flag_names(sb.incompat_flags.get(), features::INCOMPAT_NAMES);
        let _ = features::flag_names(sb.compat_ro_flags.get(), features::COMPAT_RO_NAMES);
        let _ = CsumType::from_raw(sb.csum_type.get()).expect("check_super accepted the csum type");
    }
}

const FSID: [u8; 16] = [0x11; 16];
const CHUNK_TREE_UUID: [u8; 16] = [0x22; 16];
const BYTENR: u64 = 30408704;
const SUPER_GEN: u64 = 1000;

/// Tree block target. `data[0]` controls: bit 0 nodesize 16 KiB (else 4 KiB), bits 1-2
/// the checksum type, bit 3 keeps bytenr/fsid/chunk_tree_uuid as given (else they are
/// written to match the context), bit 4 no chunk_tree_uuid in the context, bit 5
/// expectations (level, generation, owner, first key) taken from the block itself,
/// bit 6 keeps the checksum as given. `data[1..]` is the block, zero-padded.
pub fn tree_block(data: &[u8]) {
    let Some((&ctl, body)) = data.split_first() else { return };
    // Every item parser must be total on arbitrary bytes.
    parse_everything(&Key::new(256, INODE_ITEM_KEY, 0), body, false);
    let nodesize: u32 = if ctl & 1 != 0 { 16384 } else { 4096 };
    let csum = CsumType::from_raw(u16::from((ctl >> 1) & 3)).expect("0..=3 are known");
    let mut buf = vec![0u8; nodesize as usize];
    let n = body.len().min(buf.len());
    buf[..n].copy_from_slice(&body[..n]);
    if ctl & 8 == 0 {
        buf[32..48].copy_from_slice(&FSID);
        buf[48..56].copy_from_slice(&BYTENR.to_le_bytes());
        buf[64..80].copy_from_slice(&CHUNK_TREE_UUID);
    }
    if ctl & 64 == 0 {
        fix_block_csum(&mut buf, csum);
    }
    let mut ctx = CheckCtx {
        nodesize,
        sectorsize: 4096,
        csum_type: csum,
        fsid: FSID,
        chunk_tree_uuid: if ctl & 16 != 0 { None } else { Some(CHUNK_TREE_UUID) },
        super_generation: SUPER_GEN,
        bytenr: BYTENR,
        level: None,
        generation: None,
        owner: None,
        first_key: None,
    };
    if ctl & 32 != 0 {
        if let Some(h) = ubtrfs_format::node::header(&buf) {
            ctx.level = Some(h.level);
            ctx.generation = Some(h.generation.get());
            ctx.owner = Some(h.owner.get());
            let nr = h.nritems.get() as usize;
            if nr > 0 && h.level < 8 {
                // Only a guess at the first key's location; a wrong one just fails.
                let at = ubtrfs_format::node::HEADER_SIZE;
                if let Ok((dk, _)) = ubtrfs_format::key::DiskKey::read_from_prefix(&buf[at..]) {
                    ctx.first_key = Some(Key::from(&dk));
                }
            }
        }
    }
    if check_tree_block(&buf, &ctx).is_err() {
        return;
    }
    exercise_node(NodeRef::new_checked(&buf), &ctx);
}

/// Call every accessor of a block the tree checker accepted, and every parser on each
/// item, asserting that the parser for the item's own type succeeds.
pub fn exercise_node(n: NodeRef<'_>, ctx: &CheckCtx) {
    let h = n.header();
    let _ = (h.flags.get(), n.bytenr(), n.generation(), n.owner(), n.level(), n.bytes().len());
    let nr = n.nritems();
    let mut prev: Option<Key> = None;
    for slot in 0..nr {
        let k = n.key(slot);
        assert_eq!(Key::from(n.disk_key(slot)), k);
        if let Some(p) = prev {
            assert!(p < k, "checker passed unsorted keys: {p} then {k}");
        }
        prev = Some(k);
        assert_eq!(n.search(&k), Ok(slot), "search for slot {slot} key {k}");
        if n.is_leaf() {
            let it = n.item(slot);
            let d = n.item_data(slot);
            assert_eq!(d.len(), it.size.get() as usize);
            parse_everything(&k, d, true);
            let _ = ubtrfs_format::tree_checker::check_item(&k, d, ctx);
        } else {
            let kp = n.key_ptr(slot);
            assert_eq!(kp.blockptr.get(), n.blockptr(slot));
            assert_eq!(kp.generation.get(), n.ptr_generation(slot));
            // As the kernel's __btrfs_check_node, the checker leaves the last pointer to
            // fail when its child is read.
            assert!(n.blockptr(slot) != 0 || slot + 1 == nr);
        }
    }
    let _ = n.search(&Key::MIN);
    let _ = n.search(&Key::MAX);
    if n.is_leaf() {
        let _ = n.leaf_free_space();
    }
}

/// Run every item parser over `d`. With `strict`, the parser matching `k`'s type must
/// succeed (the caller says the tree checker accepted this item).
pub fn parse_everything(k: &Key, d: &[u8], strict: bool) {
    let dirs: Result<Vec<_>, _> = items::dir_entries(d).collect();
    let refs: Result<Vec<_>, _> = items::inode_refs(d, k.offset).collect();
    let extrefs: Result<Vec<_>, _> = items::inode_extrefs(d).collect();
    let root_ref = items::root_ref(d).map(|_| ());
    let root_item = items::root_item(d).map(|_| ());
    let chunk = items::chunk(d).map(|_| ());
    let fe = items::file_extent(d).map(|_| ());
    let ei = items::extent_item(d, false).map(|_| ());
    let mi = items::extent_item(d, true).map(|_| ());
    let uuid = items::uuid_item_ids(d).map(|_| ());
    let inode =
        InodeItem::read_from_bytes(d).map(|_| ()).map_err(|_| "inode item size".to_string());
    let _ = ubtrfs_format::hash::name_hash(d);
    if !strict {
        return;
    }
    let want = |what: &str, r: Result<(), String>| {
        if let Err(e) = r {
            panic!("tree checker accepted {what} item {k} that its parser rejects: {e}");
        }
    };
    match k.type_ {
        DIR_ITEM_KEY | DIR_INDEX_KEY | XATTR_ITEM_KEY => want("dir", dirs.map(|_| ())),
        INODE_REF_KEY => want("inode ref", refs.map(|_| ())),
        INODE_EXTREF_KEY => want("inode extref", extrefs.map(|_| ())),
        ROOT_REF_KEY | ROOT_BACKREF_KEY => want("root ref", root_ref),
        ROOT_ITEM_KEY => want("root", root_item),
        CHUNK_ITEM_KEY => want("chunk", chunk),
        EXTENT_DATA_KEY => want("file extent", fe),
        EXTENT_ITEM_KEY => want("extent", ei),
        METADATA_ITEM_KEY => want("metadata", mi),
        UUID_KEY_SUBVOL | UUID_KEY_RECEIVED_SUBVOL => want("uuid", uuid),
        INODE_ITEM_KEY => want("inode", inode),
        _ => {}
    }
}

/// The pristine image the image target patches, with its tree block locations.
pub struct ImageBase {
    pub img: Arc<Vec<u8>>,
    pub name: String,
    pub csum: CsumType,
    pub nodesize: u32,
    /// Physical offsets of every copy of every tree block.
    pub blocks: Vec<u64>,
}

impl ImageBase {
    /// Open `img` once to find its tree blocks.
    ///
    /// # Errors
    /// The pristine image does not open or walk.
    pub fn new(img: Vec<u8>, name: &str) -> ubtrfs_core::Result<ImageBase> {
        let img = Arc::new(img);
        let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(OverlayDevice::new(img.clone(), name))];
        let info = FsInfo::open_devices(devs, 8 << 20)?;
        let blocks = tree_blocks(&info)?
            .into_iter()
            .flat_map(|b| b.copies.into_iter().map(|c| c.1))
            .collect();
        Ok(ImageBase {
            img,
            name: name.to_string(),
            csum: info.csum_type,
            nodesize: info.nodesize,
            blocks,
        })
    }

    /// The base of fixture `name` (`tests/fixtures/NAME.0.img.zst`), for a fuzz target's
    /// one-time setup.
    ///
    /// # Panics
    /// When the fixture is missing or does not open: the target cannot run.
    pub fn from_fixture(name: &str) -> ImageBase {
        let path = format!("{}/../tests/fixtures/{name}.0.img.zst", env!("CARGO_MANIFEST_DIR"));
        let z = std::fs::read(&path).unwrap_or_else(|e| panic!("fuzz setup: {path}: {e}"));
        let mut dec = zstd::stream::read::Decoder::new(&z[..]).expect("fuzz setup: zstd");
        dec.window_log_max(31).expect("fuzz setup: zstd window");
        let mut img = Vec::new();
        std::io::Read::read_to_end(&mut dec, &mut img).expect("fuzz setup: decompress the fixture");
        ImageBase::new(img, name).expect("fuzz setup: the pristine fixture opens")
    }

    /// Build the patched device an image-target input describes.
    ///
    /// Input: records of `ctl: u8, index: u16 le, offset: u16 le, len: u8, bytes`.
    /// `index % (blocks + 1)` picks a tree block copy (or, for the last value, the
    /// primary superblock), `offset` is taken modulo its size; with `ctl` bit 1 the
    /// patch goes instead to the absolute offset `(index << 12 | offset & 0xfff)` modulo
    /// the image size. Every touched tree block and the superblock get their checksum
    /// recomputed unless a patch touching them had `ctl` bit 0 set. At most 64 records.
    pub fn patched(&self, data: &[u8]) -> OverlayDevice {
        let mut dev = OverlayDevice::new(self.img.clone(), self.name.clone());
        let ns = u64::from(self.nodesize);
        let sb_target = self.blocks.len();
        let mut touched = BTreeSet::new();
        let mut keep_bad = BTreeSet::new();
        let mut rest = data;
        let mut records = 0;
        while rest.len() >= 6 && records < 64 {
            records += 1;
            let ctl = rest[0];
            let index = usize::from(u16::from_le_bytes([rest[1], rest[2]]));
            let offset = u64::from(u16::from_le_bytes([rest[3], rest[4]]));
            let len = usize::from(rest[5]).min(rest.len() - 6);
            let bytes = rest[6..6 + len].to_vec();
            rest = &rest[6 + len..];
            let (at, targets): (u64, Vec<usize>) = if ctl & 2 != 0 {
                let at = ((index as u64) << 12 | offset & 0xfff) % self.img.len() as u64;
                let end = at + bytes.len() as u64;
                let mut t: Vec<usize> = self
                    .blocks
                    .iter()
                    .enumerate()
                    .filter(|(_, &b)| b < end && at < b + ns)
                    .map(|(i, _)| i)
                    .collect();
                if SUPER_INFO_OFFSET < end && at < SUPER_INFO_OFFSET + SUPER_INFO_SIZE as u64 {
                    t.push(sb_target);
                }
                (at, t)
            } else {
                let t = index % (self.blocks.len() + 1);
                let (start, size) = if t == sb_target {
                    (SUPER_INFO_OFFSET, SUPER_INFO_SIZE as u64)
                } else {
                    (self.blocks[t], ns)
                };
                let off = offset % size;
                let keep = (size - off) as usize;
                dev.patch(start + off, bytes[..bytes.len().min(keep)].to_vec());
                touched.insert(t);
                if ctl & 1 != 0 {
                    keep_bad.insert(t);
                }
                continue;
            };
            dev.patch(at, bytes);
            for t in targets {
                touched.insert(t);
                if ctl & 1 != 0 {
                    keep_bad.insert(t);
                }
            }
        }
        for t in touched.difference(&keep_bad) {
            if *t == sb_target {
                let mut sb = dev.read_vec(SUPER_INFO_OFFSET, SUPER_INFO_SIZE);
                fix_super_csum(&mut sb);
                dev.patch(SUPER_INFO_OFFSET, sb);
            } else {
                let mut blk = dev.read_vec(self.blocks[*t], self.nodesize as usize);
                fix_block_csum(&mut blk, self.csum);
                dev.patch(self.blocks[*t], blk);
            }
        }
        dev
    }
}

/// Image target: open the patched image and walk everything; errors are fine.
pub fn image(base: &ImageBase, data: &[u8]) {
    let dev = base.patched(data);
    let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(dev)];
    let Ok(info) = FsInfo::open_devices(devs, 4 << 20) else { return };
    let _ = info.block_groups();
    let Ok(fs) = Filesystem::from_info(info) else { return };
    let _ = walk_all(&fs);
    let _ = fs.subvolumes();
    let _ = fs.resolve("/dir/entry-00001", true);
    let _ = fs.resolve("/links/b/sym", true);
    let _ = fs.info.take_warnings();
}

/// Engine-operations target: a fuzzed image (as `image`, over a writable overlay)
/// opened for writing, then a sequence of operations applied through the engine,
/// commits and reopens among them, and the result walked. Nothing may panic or hang:
/// a change the damage reaches fails with an error and aborts to read-only, and every
/// later change is then refused.
///
/// Input: `patch_len: u16 le`, that many bytes of `image` patch records, then 4-byte
/// operations `op, a, b: u16 le`: mkdir, create+write, write, unlink, commit, reopen,
/// read back (op % 7). At most 64 operations.
pub fn engine_ops(base: &ImageBase, data: &[u8]) {
    use crate::walk::WritableOverlay;
    use ubtrfs_core::engine::Engine;
    use ubtrfs_core::inode::filesystem::{InodeId, Load};
    use ubtrfs_core::inode::write::InodeAttrs;
    use ubtrfs_core::FsWriter;
    if data.len() < 2 {
        return;
    }
    let plen = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
    let (patches, ops) = data[2..].split_at(plen);
    let dev: Arc<dyn BlockDevice> = Arc::new(WritableOverlay::new(base.patched(patches)));
    let open = |dev: &Arc<dyn BlockDevice>| {
        let mut w =
            FsInfo::open_devices(vec![dev.clone()], 4 << 20).and_then(FsWriter::from_info)?;
        let limit = 2 * w.nodesize() as usize;
        w.set_dirty_metadata_limit(limit);
        Ok::<_, ubtrfs_core::Error>(Engine::from_writer(w))
    };
    let Ok(mut engine) = open(&dev) else { return };
    let top = InodeId { root: FS_TREE_OBJECTID, ino: FIRST_FREE_OBJECTID };
    let mut dirs = vec![top];
    let mut files: Vec<(InodeId, InodeId, Vec<u8>)> = Vec::new();
    let mut aborted = false;
    for op in ops.chunks_exact(4).take(64) {
        let (kind, a, b) = (op[0] % 8, op[1], u16::from_le_bytes([op[2], op[3]]));
        // A write or unlink with no file to name is a read.
        let kind = if matches!(kind, 2 | 3 | 7) && files.is_empty() { 6 } else { kind };
        let dir = dirs[usize::from(a) % dirs.len()];
        let r: ubtrfs_core::Result<()> = match kind {
            0 => engine
                .write(|w| {
                    w.mkdir(
                        dir.root,
                        dir.ino,
                        format!("d{a}-{b}").as_bytes(),
                        &InodeAttrs::new(0o755),
                    )
                })
                .map(|ino| dirs.push(InodeId { root: dir.root, ino })),
            1 => {
                let name = format!("f{a}-{b}").into_bytes();
                engine
                    .write(|w| w.create_file(dir.root, dir.ino, &name, &InodeAttrs::new(0o644)))
                    .and_then(|ino| {
                        let id = InodeId { root: dir.root, ino };
                        files.push((dir, id, name));
                        engine.write_file(id, 0, &vec![a; usize::from(b) * 7])
                    })
            }
            2 => {
                // Odd `a`: whole sectors, written without the engine's lock.
                let (_, f, _) = &files[usize::from(a) % files.len()];
                let (off, len) = if a % 2 == 1 {
                    (u64::from(b) * 4096, usize::from(a) * 4096)
                } else {
                    (u64::from(b) * 512, usize::from(a) * 97)
                };
                engine.write_file(*f, off, &vec![b as u8; len])
            }
            3 => {
                let (d, _, name) = files.swap_remove(usize::from(a) % files.len());
                engine.unlink(d, &name)
            }
            4 => engine.commit().map(|_| ()),
            5 => {
                drop(engine);
                files.clear();
                dirs.truncate(1);
                let Ok(e) = open(&dev) else { return };
                engine = e;
                Ok(())
            }
            7 => {
                // Unlinked while open: written and read through the handle, then closed.
                let (d, f, name) = files.swap_remove(usize::from(a) % files.len());
                engine.open_file(f).and_then(|h| {
                    let r = engine
                        .unlink(d, &name)
                        .and_then(|()| h.write_at(u64::from(b), &[a; 5000]))
                        .and_then(|()| h.read_at(0, &mut [0u8; 8192]).map(drop));
                    let c = h.close();
                    r.and(c)
                })
            }
            _ => {
                let _ = engine.read(|l| l.readdir(dir));
                if let Some((_, f, _)) = files.first() {
                    let _ = engine.read_file(*f, 0, &mut vec![0u8; 64 << 10]);
                    if let Ok(c) = engine.committed() {
                        if let Ok(v) = c.load_inode(*f, Load::ALL) {
                            let _ = c.read_at(&v, 0, &mut vec![0u8; 64 << 10]);
                        }
                    }
                }
                Ok(())
            }
        };
        match kind {
            // A reopen starts a new engine; a read changes nothing.
            5 => aborted = false,
            6 => {}
            _ if aborted => assert!(r.is_err(), "op {kind} succeeded after the engine aborted"),
            _ => {}
        }
        if r.is_err() && engine.write(|w| w.check_writable()).is_err() {
            aborted = true;
        }
    }
    let _ = engine.commit();
    drop(engine);
    let Ok(info) = FsInfo::open_devices(vec![dev], 4 << 20) else { return };
    let Ok(fs) = Filesystem::from_info(info) else { return };
    let _ = walk_all(&fs);
}
