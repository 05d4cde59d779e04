//! The tree checker: every tree block is validated once, when it is read, before any
//! other code sees it (the kernel's tree-checker.c plus the read-time header checks of
//! disk-io.c). After `check_tree_block` succeeds, `NodeRef` accessors cannot go out of
//! bounds and item parsers cannot fail on structure.
//!
//! Checks, in order: size, checksum, header (bytenr, fsid, level, generation against the
//! parent pointer, owner), layout (item offsets packed from the end, no overlap, ptr
//! alignment), strictly increasing keys, then item contents by type.
//!
//! Exactly as strict as the kernel's, no stricter: what the kernel reads, we read
//! (btrfs-convert, old kernels and other writers leave values the kernel does not look
//! at, e.g. a DIR_ITEM's `transid`). The only rules beyond the kernel's are structural
//! ones that keep the item parsers total and the accessors in bounds (an item holds the
//! struct its type names); no kernel-written item can fail them, and each says why it
//! is kept. Checks only the writer needs (the chunk tree uuid it stamps) run only when
//! the caller asks for them, as the write-time check does.
//!
//! Kernel rules not here yet (so we are laxer there, never stricter): check_prev_ino
//! (an fs tree item whose inode's INODE_ITEM is not before it in the leaf), the rules
//! that need the incompat flags (a METADATA_ITEM without skinny-metadata, a
//! DATA|METADATA chunk without mixed-bg), and unknown inode ro_flags, which the kernel
//! refuses only on a writable mount and we refuse always.

use crate::csum::CsumType;
use crate::error::{Corrupt, CorruptWhere, Result};
use crate::hash::{hash_extent_data_ref, name_hash};
use crate::items::{self, ChunkView, FileExtent, InlineRef};
use crate::key::*;
use crate::node::{header, max_leaf_items, max_node_ptrs, NodeRef, HEADER_SIZE, ITEM_SIZE};
use crate::structs::*;

/// What the reader knows about the block it asked for.
#[derive(Clone, Debug)]
pub struct CheckCtx {
    pub nodesize: u32,
    pub sectorsize: u32,
    pub csum_type: CsumType,
    /// `metadata_uuid` when that feature is on, else `fsid`.
    pub fsid: [u8; 16],
    /// The chunk tree uuid every header must carry: set by the writer (write time) to
    /// catch a block stamped with the wrong one. The kernel does not check it at read
    /// (btrfs_validate_extent_buffer), so readers pass None.
    pub chunk_tree_uuid: Option<[u8; 16]>,
    pub super_generation: u64,
    pub bytenr: u64,
    /// Expected values from the parent pointer or root item, when known.
    pub level: Option<u8>,
    pub generation: Option<u64>,
    pub owner: Option<u64>,
    pub first_key: Option<Key>,
}

/// Is `id` a subvolume-like tree (fs tree, subvolumes, snapshots, data-reloc, reloc)?
pub fn is_fstree(id: u64) -> bool {
    id == FS_TREE_OBJECTID || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) || id == DATA_RELOC_TREE_OBJECTID || id == TREE_RELOC_OBJECTID
}

/// The kernel's `btrfs_is_fstree`, which the tree checker's rules use: tree 5, or an id
/// from 256 that is a level-0 qgroup id (below 2^48). Unlike [`is_fstree`], neither
/// relocation tree counts.
fn btrfs_is_fstree(id: u64) -> bool {
    id == FS_TREE_OBJECTID || (FIRST_FREE_OBJECTID..1 << 48).contains(&id)
}

/// Validate a whole tree block read from `ctx.bytenr`.
///
/// # Errors
/// `Corrupt` with the block, owner and (for item problems) slot and key.
pub fn check_tree_block(buf: &[u8], ctx: &CheckCtx) -> Result<()> {
    let blk = |r: String| Corrupt::new(CorruptWhere::Block, r).block(ctx.bytenr);
    if buf.len() != ctx.nodesize as usize {
        return Err(blk(format!("block size {} != nodesize {}", buf.len(), ctx.nodesize)));
    }
    let h = header(buf).ok_or_else(|| blk("short block".into()))?;
    if !ctx.csum_type.verify(&buf[CSUM_SIZE..], &h.csum) {
        let got = ctx.csum_type.compute(&buf[CSUM_SIZE..]);
        let n = ctx.csum_type.size();
        return Err(blk(format!("checksum mismatch: have {} expect {}", hex(&got[..n]), hex(&h.csum[..n]))));
    }
    let owner = h.owner.get();
    let blk = |r: String| Corrupt::new(if h.level == 0 { CorruptWhere::Leaf } else { CorruptWhere::Node }, r).block(ctx.bytenr).root(owner);
    if h.bytenr.get() != ctx.bytenr {
        return Err(blk(format!("bad tree block start, want {} have {}", ctx.bytenr, h.bytenr.get())));
    }
    if h.fsid != ctx.fsid {
        return Err(blk(format!("bad fsid {}, expect {}", items::uuid_str(&h.fsid), items::uuid_str(&ctx.fsid))));
    }
    if let Some(u) = ctx.chunk_tree_uuid {
        if h.chunk_tree_uuid != u {
            return Err(blk(format!("bad chunk_tree_uuid {}", items::uuid_str(&h.chunk_tree_uuid))));
        }
    }
    if h.level >= MAX_LEVEL {
        return Err(blk(format!("invalid level {} >= {MAX_LEVEL}", h.level)));
    }
    if let Some(l) = ctx.level {
        if h.level != l {
            return Err(blk(format!("level mismatch, want {l} have {}", h.level)));
        }
    }
    let gen = h.generation.get();
    if let Some(g) = ctx.generation {
        if gen != g {
            return Err(blk(format!("parent transid verify failed, wanted {g} found {gen}")));
        }
    }
    // No rule ties the header generation to the superblock's: the kernel checks it only
    // against the parent pointer (above).
    // As btrfs_check_eb_owner: log and relocation trees name their owner in the key
    // offset, so they are not checked; other trees must match, and a subvolume tree's
    // blocks may be owned by any subvolume tree (shared with snapshots).
    if let Some(o) = ctx.owner.filter(|&o| o != TREE_LOG_OBJECTID && o != TREE_RELOC_OBJECTID) {
        let ok = if btrfs_is_fstree(o) { btrfs_is_fstree(owner) } else { owner == o };
        if !ok {
            return Err(blk(format!("owner mismatch, want {o} have {owner}")));
        }
    }
    // As __btrfs_check_leaf and __btrfs_check_node.
    if h.flags.get() & HEADER_FLAG_WRITTEN == 0 {
        return Err(blk(format!("invalid flag for {}, WRITTEN not set", if h.level == 0 { "leaf" } else { "node" })));
    }
    let node = NodeRef::new_checked(buf);
    let n = h.nritems.get() as usize;
    if h.level == 0 {
        check_leaf(&node, n, ctx, owner)?;
    } else {
        check_node(&node, n, ctx, owner)?;
    }
    if let Some(fk) = ctx.first_key {
        if n > 0 && node.key(0) != fk {
            return Err(blk(format!("tree first key mismatch detected, want {fk} have {}", node.key(0))));
        }
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    let mut s = String::from("0x");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

fn check_node(node: &NodeRef<'_>, n: usize, ctx: &CheckCtx, owner: u64) -> Result<()> {
    let err = |r: String| Corrupt::new(CorruptWhere::Node, r).block(ctx.bytenr).root(owner);
    if n == 0 || n > max_node_ptrs(ctx.nodesize) {
        return Err(err(format!("invalid nritems, have {n} should be in range [1, {}]", max_node_ptrs(ctx.nodesize))));
    }
    let mut prev: Option<Key> = None;
    for slot in 0..n {
        let kp = node.key_ptr(slot);
        let key = Key::from(&kp.key);
        let bp = kp.blockptr.get();
        // As __btrfs_check_node, which checks every pointer but the last (a bad last
        // pointer fails when its child is read); pointer generations are only checked
        // against the child's header when it is read.
        if slot + 1 < n && (bp == 0 || !bp.is_multiple_of(u64::from(ctx.sectorsize))) {
            return Err(err(format!("invalid block pointer {bp}")).slot(slot as u32, key));
        }
        if let Some(p) = prev {
            if p >= key {
                return Err(err(format!("bad key order, current {key} prev {p}")).slot(slot as u32, key));
            }
        }
        prev = Some(key);
    }
    Ok(())
}

fn check_leaf(node: &NodeRef<'_>, n: usize, ctx: &CheckCtx, owner: u64) -> Result<()> {
    let err = |r: String| Corrupt::new(CorruptWhere::Leaf, r).block(ctx.bytenr).root(owner);
    if n == 0 {
        // As __btrfs_check_leaf: these trees are never empty, and no tree has id 0. A
        // relocation tree's blocks carry their subvolume's owner, so they are not
        // checked.
        if node.header().flags.get() & HEADER_FLAG_RELOC != 0 {
            return Ok(());
        }
        if matches!(owner, ROOT_TREE_OBJECTID | CHUNK_TREE_OBJECTID | DEV_TREE_OBJECTID | FS_TREE_OBJECTID | DATA_RELOC_TREE_OBJECTID | EXTENT_TREE_OBJECTID) {
            return Err(err(format!("invalid root, root {owner} must never be empty")));
        }
        if owner == 0 {
            return Err(err("invalid owner, root 0 is not defined".into()));
        }
        return Ok(());
    }
    if n > max_leaf_items(ctx.nodesize) {
        return Err(err(format!("invalid nritems {n}, max {}", max_leaf_items(ctx.nodesize))));
    }
    let data_area = ctx.nodesize as usize - HEADER_SIZE;
    // No valid key type is 0, so every key is above (0, 0, 0).
    let mut prev = Key::new(0, 0, 0);
    for slot in 0..n {
        let it = node.item(slot);
        let key = Key::from(&it.key);
        let e = |r: String| err(r).slot(slot as u32, key);
        if prev >= key {
            return Err(e(format!("bad key order, prev {prev} current {key}")));
        }
        prev = key;
        let expect_end = if slot == 0 { data_area } else { node.item(slot - 1).offset.get() as usize };
        let off = it.offset.get() as usize;
        let size = it.size.get() as usize;
        if off.checked_add(size) != Some(expect_end) {
            return Err(e(format!("unexpected item end, have {} expect {expect_end}", off as u64 + size as u64)));
        }
        if off < n * ITEM_SIZE {
            return Err(e(format!("item data overlaps the item array, offset {off} items end {}", n * ITEM_SIZE)));
        }
    }
    for slot in 0..n {
        let key = node.key(slot);
        check_item(&key, node.item_data(slot), ctx).map_err(|r| err(r).slot(slot as u32, key))?;
        if slot > 0 {
            check_against_prev(node, slot, ctx).map_err(|(at, r)| err(r).slot(at as u32, node.key(at)))?;
        }
    }
    Ok(())
}

/// The kernel's rules between an item and the one before it in the same leaf (items
/// already checked one by one): file extents, csums, dev extents and extents must not
/// overlap. Returns the slot to blame with the reason.
fn check_against_prev(node: &NodeRef<'_>, slot: usize, ctx: &CheckCtx) -> core::result::Result<(), (usize, String)> {
    let (prev, key) = (node.key(slot - 1), node.key(slot));
    let (pdata, ss) = (node.item_data(slot - 1), u64::from(ctx.sectorsize));
    match (prev.type_, key.type_) {
        // check_extent_data_item; the end of an inline extent is rounded up to a sector.
        (EXTENT_DATA_KEY, EXTENT_DATA_KEY) if prev.objectid == key.objectid && items::file_extent(node.item_data(slot)).is_ok_and(|f| matches!(f, FileExtent::Regular { .. })) => {
            let prev_end = match items::file_extent(pdata) {
                Ok(FileExtent::Inline { ram_bytes, .. }) => prev.offset.wrapping_add(ram_bytes).wrapping_add(ss - 1) / ss * ss,
                Ok(FileExtent::Regular { num_bytes, .. }) => prev.offset.wrapping_add(num_bytes),
                Err(r) => return Err((slot - 1, r)),
            };
            if prev_end > key.offset {
                return Err((slot - 1, format!("file extent end range ({prev_end}) goes beyond start offset ({}) of the next file extent", key.offset)));
            }
        }
        // check_csum_item
        (EXTENT_CSUM_KEY, EXTENT_CSUM_KEY) => {
            let prev_end = prev.offset.wrapping_add((pdata.len() / ctx.csum_type.size()) as u64 * ss);
            if prev_end > key.offset {
                return Err((slot - 1, format!("csum end range ({prev_end}) goes beyond the start range ({}) of the next csum item", key.offset)));
            }
        }
        // check_dev_extent_item
        (DEV_EXTENT_KEY, DEV_EXTENT_KEY) if prev.objectid == key.objectid => {
            let len = items::read_prefix::<DevExtent>(pdata, "dev extent").map_err(|r| (slot - 1, r))?.length.get();
            if prev.offset.wrapping_add(len) > key.offset {
                return Err((slot, format!("dev extent overlap, prev offset {} len {len} current offset {}", prev.offset, key.offset)));
            }
        }
        // check_extent_item
        (EXTENT_ITEM_KEY | METADATA_ITEM_KEY, EXTENT_ITEM_KEY | METADATA_ITEM_KEY) => {
            let prev_end = prev.objectid.wrapping_add(if prev.type_ == METADATA_ITEM_KEY { u64::from(ctx.nodesize) } else { prev.offset });
            if prev_end > key.objectid {
                return Err((slot, format!("previous extent {prev} overlaps current extent {key}")));
            }
        }
        _ => {}
    }
    Ok(())
}

fn aligned(v: u64, a: u32) -> bool {
    v.is_multiple_of(u64::from(a))
}

fn exact<T>(data: &[u8], what: &str) -> core::result::Result<(), String> {
    let want = core::mem::size_of::<T>();
    if data.len() != want {
        return Err(format!("invalid {what} item size, have {} expect {want}", data.len()));
    }
    Ok(())
}

/// Check one item's body against its key.
///
/// # Errors
/// A reason string; the caller attaches block, slot and key.
pub fn check_item(key: &Key, data: &[u8], ctx: &CheckCtx) -> core::result::Result<(), String> {
    let gen_ok = |g: u64, what: &str| -> core::result::Result<(), String> {
        if g > ctx.super_generation.saturating_add(1) {
            Err(format!("invalid {what} generation {g}, super generation {}", ctx.super_generation))
        } else {
            Ok(())
        }
    };
    match key.type_ {
        INODE_ITEM_KEY => {
            exact::<InodeItem>(data, "inode")?;
            if key.offset != 0 {
                return Err(format!("invalid inode key offset {}", key.offset));
            }
            let ok_id = key.objectid >= FIRST_FREE_OBJECTID && key.objectid <= LAST_FREE_OBJECTID || key.objectid == ROOT_TREE_DIR_OBJECTID || key.objectid == FREE_INO_OBJECTID;
            if !ok_id {
                return Err(format!("invalid inode objectid {}", key.objectid));
            }
            let ii: &InodeItem = items::read_prefix(data, "inode")?;
            gen_ok(ii.generation.get(), "inode")?;
            gen_ok(ii.transid.get(), "inode transid")?;
            let mode = ii.mode.get();
            if mode & !(S_IFMT | 0o7777) != 0 {
                return Err(format!("unknown mode bit detected: {:#x}", mode & !(S_IFMT | 0o7777)));
            }
            if ft_from_mode(mode) == FT_UNKNOWN {
                return Err(format!("invalid inode mode {mode:#o}"));
            }
            if mode & S_IFMT == S_IFDIR && ii.nlink.get() > 1 {
                return Err(format!("invalid nlink {} for directory", ii.nlink.get()));
            }
            if ii.flags.get() & !INODE_FLAGS_MASK != 0 {
                return Err(format!("unknown inode flags {:#x}", ii.flags.get() & !INODE_FLAGS_MASK));
            }
        }
        // As check_dir_item. Not checked, as by the kernel: the entry's `transid`
        // (btrfs-convert writes garbage there), empty names, how many entries an item
        // holds (a DIR_INDEX is read through its first; an empty item has none).
        DIR_ITEM_KEY | DIR_INDEX_KEY | XATTR_ITEM_KEY => {
            let is_xattr = key.type_ == XATTR_ITEM_KEY;
            for e in items::dir_entries(data) {
                let e = e?;
                check_dir_location(is_xattr, &e.location)?;
                let ftype = e.type_ & !FT_ENCRYPTED;
                if ftype == FT_UNKNOWN || ftype >= FT_MAX {
                    return Err(format!("invalid dir item type, have {ftype} expect (0, {FT_MAX})"));
                }
                if is_xattr && ftype != FT_XATTR {
                    return Err(format!("invalid dir item type for XATTR key, have {ftype} expect {FT_XATTR}"));
                }
                if !is_xattr && ftype == FT_XATTR {
                    return Err("xattr dir type found for non-XATTR key".into());
                }
                // XATTR_NAME_MAX and BTRFS_NAME_LEN are both 255.
                if e.name.len() > NAME_LEN {
                    return Err(format!("dir item name len too long, have {} max {NAME_LEN}", e.name.len()));
                }
                // BTRFS_MAX_XATTR_SIZE: what one item can hold after its dir item header.
                let max = (ctx.nodesize as usize).saturating_sub(HEADER_SIZE + ITEM_SIZE + core::mem::size_of::<DirItem>());
                if e.name.len() + e.data.len() > max {
                    return Err(format!("dir item name and data len too long, have {} max {max}", e.name.len() + e.data.len()));
                }
                if !is_xattr && !e.data.is_empty() {
                    return Err(format!("dir item with invalid data len, have {} expect 0", e.data.len()));
                }
                if key.type_ != DIR_INDEX_KEY && name_hash(e.name) != key.offset {
                    return Err(format!("name hash mismatch with key, have {:#018x} expect {:#018x}", name_hash(e.name), key.offset));
                }
            }
        }
        // As check_inode_ref: at least one header and a name byte; names are not
        // otherwise checked (the kernel has no rule on their length).
        INODE_REF_KEY => {
            if data.len() <= core::mem::size_of::<InodeRef>() {
                return Err(format!("invalid item size, have {} expect > {}", data.len(), core::mem::size_of::<InodeRef>()));
            }
            for r in items::inode_refs(data, key.offset) {
                r?;
            }
        }
        // As check_inode_extref: only the entries' bounds (an empty item is accepted).
        INODE_EXTREF_KEY => {
            for r in items::inode_extrefs(data) {
                r?;
            }
        }
        // As check_extent_data_item. Not checked, as by the kernel: the generation, how
        // large a compressed inline extent claims to be (the reader bounds what it
        // decompresses), sums of fields (the readers add them checked).
        EXTENT_DATA_KEY => {
            if !aligned(key.offset, ctx.sectorsize) {
                return Err(format!("unaligned file_offset for file extent, have {} should be aligned to {}", key.offset, ctx.sectorsize));
            }
            match items::file_extent(data)? {
                FileExtent::Inline { ram_bytes, compression, data: inline, .. } => {
                    if compression > 3 {
                        return Err(format!("invalid compression for file extent, have {compression} expect range [0, 3]"));
                    }
                    if key.offset != 0 {
                        return Err(format!("invalid file_offset for inline file extent, have {} expect 0", key.offset));
                    }
                    if compression == 0 && ram_bytes != inline.len() as u64 {
                        return Err(format!("invalid ram_bytes for uncompressed inline extent, have {} expect {ram_bytes}", inline.len()));
                    }
                }
                FileExtent::Regular { compression, disk_bytenr, disk_num_bytes, offset, num_bytes, ram_bytes, .. } => {
                    if compression > 3 {
                        return Err(format!("invalid compression for file extent, have {compression} expect range [0, 3]"));
                    }
                    for (n, v) in [("ram_bytes", ram_bytes), ("disk_bytenr", disk_bytenr), ("disk_num_bytes", disk_num_bytes), ("offset", offset), ("num_bytes", num_bytes)] {
                        if !aligned(v, ctx.sectorsize) {
                            return Err(format!("invalid {n} for file extent, have {v}, should be aligned to {}", ctx.sectorsize));
                        }
                    }
                    if key.offset.checked_add(num_bytes).is_none() {
                        return Err(format!("extent end overflow, have file offset {} extent num bytes {num_bytes}", key.offset));
                    }
                }
            }
        }
        // As check_csum_item (an empty item covers nothing).
        EXTENT_CSUM_KEY => {
            if key.objectid != EXTENT_CSUM_OBJECTID {
                return Err(format!("invalid key objectid for csum item, have {} expect {EXTENT_CSUM_OBJECTID}", key.objectid));
            }
            if !aligned(key.offset, ctx.sectorsize) {
                return Err(format!("unaligned key offset for csum item, have {} should be aligned to {}", key.offset, ctx.sectorsize));
            }
            if !data.len().is_multiple_of(ctx.csum_type.size()) {
                return Err(format!("unaligned item size for csum item, have {} should be aligned to {}", data.len(), ctx.csum_type.size()));
            }
        }
        // As check_root_item with check_root_key.
        ROOT_ITEM_KEY => {
            if key.objectid == TREE_RELOC_OBJECTID && !btrfs_is_fstree(key.offset) {
                return Err(format!("invalid reloc tree for root {}, root id is not a subvolume tree", key.offset as i64));
            }
            if key.objectid == 0 {
                return Err("invalid root id 0".into());
            }
            let v = items::root_item(data)?;
            gen_ok(v.item.generation.get(), "root")?;
            gen_ok(v.item.generation_v2.get(), "root v2")?;
            gen_ok(v.item.last_snapshot.get(), "root last_snapshot")?;
            if !aligned(v.item.bytenr.get(), ctx.sectorsize) {
                return Err(format!("invalid root bytenr, have {} expect to be aligned to {}", v.item.bytenr.get(), ctx.sectorsize));
            }
            if v.item.level >= MAX_LEVEL {
                return Err(format!("invalid root level, have {} expect [0, {}]", v.item.level, MAX_LEVEL - 1));
            }
            if v.item.drop_level >= MAX_LEVEL {
                return Err(format!("invalid root drop_level, have {} expect [0, {}]", v.item.drop_level, MAX_LEVEL - 1));
            }
            let valid = ROOT_SUBVOL_RDONLY | ROOT_SUBVOL_DEAD;
            if v.item.flags.get() & !valid != 0 {
                return Err(format!("invalid root flags, have {:#x} expect mask {valid:#x}", v.item.flags.get()));
            }
        }
        // The kernel has no rule for these; kept: the item holds its header and name
        // (what items::root_ref hands its readers).
        ROOT_REF_KEY | ROOT_BACKREF_KEY => {
            items::root_ref(data)?;
        }
        CHUNK_ITEM_KEY => {
            let (c, used) = items::chunk(data)?;
            if used != data.len() {
                return Err(format!("invalid chunk item size, have {} expect {used}", data.len()));
            }
            check_chunk(&c, key.offset, ctx.sectorsize)?;
        }
        DEV_ITEM_KEY => {
            if key.objectid != DEV_ITEMS_OBJECTID {
                return Err(format!("invalid objectid: has={} expect={DEV_ITEMS_OBJECTID}", key.objectid));
            }
            exact::<DevItem>(data, "dev")?;
            let d: &DevItem = items::read_prefix(data, "dev")?;
            if d.devid.get() != key.offset {
                return Err(format!("devid mismatch, key has {} item has {}", key.offset, d.devid.get()));
            }
            if d.bytes_used.get() > d.total_bytes.get() {
                return Err(format!("invalid bytes used {} > total {}", d.bytes_used.get(), d.total_bytes.get()));
            }
        }
        // As check_dev_extent_item; kept beyond it: the item size (readers take the
        // struct).
        DEV_EXTENT_KEY => {
            exact::<DevExtent>(data, "dev extent")?;
            let d: &DevExtent = items::read_prefix(data, "dev extent")?;
            if d.chunk_tree.get() != CHUNK_TREE_OBJECTID {
                return Err(format!("invalid dev extent chunk tree id, has {} expect {CHUNK_TREE_OBJECTID}", d.chunk_tree.get()));
            }
            if d.chunk_objectid.get() != FIRST_CHUNK_TREE_OBJECTID {
                return Err(format!("invalid dev extent chunk objectid, has {} expect {FIRST_CHUNK_TREE_OBJECTID}", d.chunk_objectid.get()));
            }
            for (what, v) in [("key.offset", key.offset), ("chunk offset", d.chunk_offset.get()), ("length", d.length.get())] {
                if !aligned(v, ctx.sectorsize) {
                    return Err(format!("invalid dev extent {what}, has {v} not aligned to {}", ctx.sectorsize));
                }
            }
        }
        BLOCK_GROUP_ITEM_KEY => {
            exact::<BlockGroupItem>(data, "block group")?;
            let b: &BlockGroupItem = items::read_prefix(data, "block group")?;
            if key.offset == 0 {
                return Err("invalid block group size 0".into());
            }
            if b.used.get() > key.offset {
                return Err(format!("invalid block group used, have {} expect [0, {}]", b.used.get(), key.offset));
            }
            if b.chunk_objectid.get() != FIRST_CHUNK_TREE_OBJECTID {
                return Err(format!("invalid block group chunk objectid {}", b.chunk_objectid.get()));
            }
            // As check_block_group_item: type and profile, no rule on other bits
            // (unknown ones are refused in the chunk item).
            check_bg_type(b.flags.get())?;
        }
        EXTENT_ITEM_KEY | METADATA_ITEM_KEY => {
            let skinny = key.type_ == METADATA_ITEM_KEY;
            if !aligned(key.objectid, ctx.sectorsize) {
                return Err(format!("invalid extent bytenr {}, not aligned to {}", key.objectid, ctx.sectorsize));
            }
            if skinny && key.offset >= u64::from(MAX_LEVEL) {
                return Err(format!("invalid tree level {}", key.offset));
            }
            let v = items::extent_item(data, skinny)?;
            let is_data = v.flags & EXTENT_FLAG_DATA != 0;
            let is_tree = v.flags & EXTENT_FLAG_TREE_BLOCK != 0;
            if is_data == is_tree {
                return Err(format!("invalid extent flags {:#x}", v.flags));
            }
            if skinny && is_data {
                return Err("metadata item with data flag".into());
            }
            if is_data && v.flags & BLOCK_FLAG_FULL_BACKREF != 0 {
                return Err("data extent with FULL_BACKREF".into());
            }
            if is_tree && !skinny && key.offset != u64::from(ctx.nodesize) {
                return Err(format!("invalid extent length, have {} expect {}", key.offset, ctx.nodesize));
            }
            if is_data && !aligned(key.offset, ctx.sectorsize) {
                return Err(format!("invalid extent length, have {} expect aligned to {}", key.offset, ctx.sectorsize));
            }
            if let Some((_, level)) = v.tree_block_info {
                if level >= MAX_LEVEL {
                    return Err(format!("invalid tree block info level, have {level} expect [0, {}]", MAX_LEVEL - 1));
                }
            }
            gen_ok(v.generation, "extent")?;
            // As check_extent_item: types ascending, and within a type the sequence
            // (the offset, or for EXTENT_DATA_REF its hash) descending. The kernel does
            // not match ref kinds to the extent's (a data ref on a tree block is left to
            // the backref code and btrfs check).
            let mut total = 0u64;
            let (mut prev_type, mut prev_seq) = (0u8, u64::MAX);
            for r in &v.inline_refs {
                check_ref_values(r, ctx.sectorsize)?;
                let t = r.type_();
                if t < prev_type {
                    return Err(format!("inline ref out-of-order: has type {t}, prev type {prev_type}"));
                }
                if t > prev_type {
                    prev_seq = u64::MAX;
                }
                let seq = match *r {
                    InlineRef::TreeBlock { root } | InlineRef::Owner { root } => root,
                    InlineRef::SharedBlock { parent } | InlineRef::SharedData { parent, .. } => parent,
                    InlineRef::ExtentData { root, objectid, offset, .. } => hash_extent_data_ref(root, objectid, offset),
                };
                if seq > prev_seq {
                    return Err(format!("inline ref out-of-order: has type {t} seq {seq:#x}, prev type {prev_type} seq {prev_seq:#x}"));
                }
                (prev_type, prev_seq) = (t, seq);
                total = total.saturating_add(r.count());
            }
            if total > v.refs {
                return Err(format!("invalid extent refs, have {} expect >= inline {total}", v.refs));
            }
        }
        // As check_simple_keyed_refs.
        TREE_BLOCK_REF_KEY | SHARED_BLOCK_REF_KEY | SHARED_DATA_REF_KEY => {
            let want = if key.type_ == SHARED_DATA_REF_KEY { core::mem::size_of::<SharedDataRef>() } else { 0 };
            if data.len() != want {
                return Err(format!("invalid item size, have {} expect {want} for key type {}", data.len(), key.type_));
            }
            if !aligned(key.objectid, ctx.sectorsize) {
                return Err(format!("invalid key objectid for shared block ref, have {} expect aligned to {}", key.objectid, ctx.sectorsize));
            }
            if key.type_ != TREE_BLOCK_REF_KEY && !aligned(key.offset, ctx.sectorsize) {
                return Err(format!("invalid tree parent bytenr, have {} expect aligned to {}", key.offset, ctx.sectorsize));
            }
            if key.type_ == SHARED_DATA_REF_KEY {
                let r: &SharedDataRef = items::read_prefix(data, "shared data ref")?;
                check_ref_values(&InlineRef::SharedData { parent: key.offset, count: r.count.get() }, ctx.sectorsize)?;
            }
        }
        // As check_extent_data_ref. Kept beyond it: exactly one ref per item. The
        // kernel allows several (hash collisions), but no kernel writes them:
        // insert_extent_data_ref moves to the next key offset on a collision, and our
        // readers take one ref per item.
        EXTENT_DATA_REF_KEY => {
            exact::<ExtentDataRef>(data, "extent data ref")?;
            if !aligned(key.objectid, ctx.sectorsize) {
                return Err(format!("invalid key objectid for shared block ref, have {} expect aligned to {}", key.objectid, ctx.sectorsize));
            }
            let d: &ExtentDataRef = items::read_prefix(data, "extent data ref")?;
            check_ref_values(&InlineRef::ExtentData { root: d.root.get(), objectid: d.objectid.get(), offset: d.offset.get(), count: d.count.get() }, ctx.sectorsize)?;
        }
        // As check_free_space_info.
        FREE_SPACE_INFO_KEY => {
            if !aligned(key.objectid, ctx.sectorsize) || !aligned(key.offset, ctx.sectorsize) {
                return Err(format!("free space info key is not aligned to {}, has {key}", ctx.sectorsize));
            }
            exact::<FreeSpaceInfo>(data, "free space info")?;
            let f: &FreeSpaceInfo = items::read_prefix(data, "free space info")?;
            if f.flags.get() & !FREE_SPACE_USING_BITMAPS != 0 {
                return Err(format!("unknown flags for free space info, has {:#x} valid mask {FREE_SPACE_USING_BITMAPS:#x}", f.flags.get()));
            }
            let max = key.offset / u64::from(ctx.sectorsize);
            if u64::from(f.extent_count.get()) > max {
                return Err(format!("suspicious extent count, has {} max valid {max}", f.extent_count.get()));
            }
        }
        // The kernel has no rule for the free space tree's extents and bitmaps; kept:
        // a bitmap holds one bit per sector of its range (what the readers index).
        FREE_SPACE_BITMAP_KEY => {
            let bits = key.offset / u64::from(ctx.sectorsize);
            let want = bits.div_ceil(8);
            if key.offset == 0 || !aligned(key.offset, ctx.sectorsize) || data.len() as u64 != want {
                return Err(format!("invalid free space bitmap item size {}, expect {want} for length {}", data.len(), key.offset));
            }
        }
        // The kernel has no rule for UUID and qgroup items; kept: their sizes (what
        // their readers take).
        UUID_KEY_SUBVOL | UUID_KEY_RECEIVED_SUBVOL => {
            items::uuid_item_ids(data)?;
        }
        // Kernels before simple quotas wrote a 32-byte status item (no enable_gen).
        QGROUP_STATUS_KEY if data.len() != 40 && data.len() != 32 => {
            return Err(format!("invalid qgroup status item size {}", data.len()));
        }
        QGROUP_INFO_KEY | QGROUP_LIMIT_KEY if data.len() != 40 => {
            return Err(format!("invalid qgroup item size {}", data.len()));
        }
        _ => {}
    }
    Ok(())
}

/// Is `root` allowed to hold a data backref (is_valid_dref_root): a subvolume tree,
/// the data relocation tree, or the root tree (v1 space cache inodes)?
fn is_valid_dref_root(root: u64) -> bool {
    btrfs_is_fstree(root) || root == DATA_RELOC_TREE_OBJECTID || root == ROOT_TREE_OBJECTID
}

/// The values of one backref, inline or keyed (check_extent_item and its keyed
/// counterparts): parent bytenrs aligned, data refs naming a valid root, inode and
/// offset, counts not zero.
fn check_ref_values(r: &InlineRef, sectorsize: u32) -> core::result::Result<(), String> {
    match *r {
        InlineRef::SharedBlock { parent } if !aligned(parent, sectorsize) => Err(format!("invalid tree parent bytenr, have {parent} expect aligned to {sectorsize}")),
        InlineRef::SharedData { parent, .. } if !aligned(parent, sectorsize) => Err(format!("invalid data parent bytenr, have {parent} expect aligned to {sectorsize}")),
        InlineRef::SharedData { count: 0, .. } => Err("invalid shared data ref count, should have non-zero value".into()),
        InlineRef::ExtentData { root, objectid, offset, count } => {
            if !is_valid_dref_root(root) {
                return Err(format!("invalid data ref root value {root}"));
            }
            if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&objectid) {
                return Err(format!("invalid data ref objectid value {objectid}"));
            }
            if !aligned(offset, sectorsize) {
                return Err(format!("invalid data ref offset, have {offset} expect aligned to {sectorsize}"));
            }
            if count == 0 {
                return Err("invalid data ref count, should have non-zero value".into());
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// A dir item entry's location key (check_dir_item with check_root_key and
/// check_inode_key): a subvolume root, or an inode (type INODE_ITEM or 0) of this tree;
/// an xattr's location is all zeros.
fn check_dir_location(is_xattr: bool, loc: &Key) -> core::result::Result<(), String> {
    match loc.type_ {
        ROOT_ITEM_KEY => {
            if loc.objectid == 0 {
                return Err("invalid location key root id 0".into());
            }
            if !btrfs_is_fstree(loc.objectid) {
                return Err(format!("invalid location key objectid, have {} expect [{FIRST_FREE_OBJECTID}, {}]", loc.objectid, (1u64 << 48) - 1));
            }
        }
        INODE_ITEM_KEY | 0 if is_xattr => {
            if *loc != Key::new(0, 0, 0) {
                return Err(format!("invalid location key {loc} for an xattr, expect all zeros"));
            }
        }
        INODE_ITEM_KEY | 0 => {
            let ok = (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&loc.objectid) || loc.objectid == ROOT_TREE_DIR_OBJECTID || loc.objectid == FREE_INO_OBJECTID;
            if !ok {
                return Err(format!("invalid location key objectid: has {}", loc.objectid));
            }
            if loc.offset != 0 {
                return Err(format!("invalid location key offset: has {} expect 0", loc.offset));
            }
        }
        t => return Err(format!("invalid location key type, have {t}, expect {ROOT_ITEM_KEY} or {INODE_ITEM_KEY}")),
    }
    Ok(())
}

/// A block group's or chunk's type and profile bits (check_block_group_item).
fn check_bg_type(flags: u64) -> core::result::Result<(), String> {
    let t = flags & BLOCK_GROUP_TYPE_MASK;
    if !(t == BLOCK_GROUP_DATA || t == BLOCK_GROUP_SYSTEM || t == BLOCK_GROUP_METADATA || t == BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA) {
        return Err(format!("invalid block group type flags {flags:#x}"));
    }
    let p = flags & BLOCK_GROUP_PROFILE_MASK;
    if p.count_ones() > 1 {
        return Err(format!("invalid profile flags {flags:#x}"));
    }
    Ok(())
}

/// Check a chunk's values (shared by the chunk tree and the sys_chunk_array).
///
/// # Errors
/// A reason string naming the bad field.
pub fn check_chunk(c: &ChunkView, logical: u64, sectorsize: u32) -> core::result::Result<(), String> {
    // The sys_chunk_array is parsed from superblocks not yet validated (fuzz: superblock).
    if !sectorsize.is_power_of_two() {
        return Err(format!("invalid sectorsize {sectorsize} for chunk {logical}"));
    }
    if c.length == 0 || !aligned(c.length, sectorsize) {
        return Err(format!("invalid chunk length {}", c.length));
    }
    if !aligned(logical, sectorsize) || logical.checked_add(c.length).is_none() {
        return Err(format!("invalid chunk logical {logical}"));
    }
    if c.stripe_len != STRIPE_LEN {
        return Err(format!("invalid chunk stripe length {}", c.stripe_len));
    }
    if c.sector_size != sectorsize {
        return Err(format!("invalid chunk sectorsize, have {} expect {sectorsize}", c.sector_size));
    }
    // Stripe numbers must fit in 32 bits (btrfs_stripe_nr_to_offset(U32_MAX)).
    if c.length >= u64::from(u32::MAX) * STRIPE_LEN {
        return Err(format!("chunk length too large: have {} limit {}", c.length, u64::from(u32::MAX) * STRIPE_LEN));
    }
    if c.type_ & !(BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK) != 0 {
        return Err(format!("unrecognized chunk type: {:#x}", c.type_ & !(BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK)));
    }
    check_bg_type(c.type_)?;
    let n = c.stripes.len();
    let p = c.type_ & BLOCK_GROUP_PROFILE_MASK;
    let ok = match p {
        0 => n == 1,
        BLOCK_GROUP_DUP => n == 2,
        BLOCK_GROUP_RAID1 => n == 2,
        BLOCK_GROUP_RAID1C3 => n == 3,
        BLOCK_GROUP_RAID1C4 => n == 4,
        BLOCK_GROUP_RAID0 => n >= 1,
        // valid_stripe_count asks only for sub_stripes 2 (and ncopies, 2, stripes);
        // an odd stripe is left unused by the mapping.
        BLOCK_GROUP_RAID10 => n >= 2 && c.sub_stripes == 2,
        BLOCK_GROUP_RAID5 => n >= 2,
        BLOCK_GROUP_RAID6 => n >= 3,
        _ => false,
    };
    if !ok {
        return Err(format!("invalid num_stripes {n} (sub_stripes {}) for profile {}", c.sub_stripes, profile_name(c.type_)));
    }
    // A stripe's devid is not checked (a missing device is found when the chunk is
    // mapped). Kept beyond btrfs_check_chunk_valid: the stripe's physical end, which
    // the mapping adds unchecked; the kernel refuses such a chunk at mount too, finding
    // no dev extent for it (btrfs_verify_dev_extents).
    for &(_, off, _) in &c.stripes {
        if off.checked_add(c.length).is_none() {
            return Err(format!("chunk stripe offset {off} overflows"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::NodeMut;
    use zerocopy::{FromZeros, IntoBytes};

    const NODESIZE: u32 = 4096;
    const BYTENR: u64 = 1 << 20;
    const GEN: u64 = 10;

    fn ctx() -> CheckCtx {
        CheckCtx {
            nodesize: NODESIZE,
            sectorsize: 4096,
            csum_type: CsumType::Crc32c,
            fsid: [7; 16],
            chunk_tree_uuid: None,
            super_generation: GEN,
            bytenr: BYTENR,
            level: Some(0),
            generation: Some(GEN),
            owner: None,
            first_key: None,
        }
    }

    /// A checksummed leaf of tree `owner` holding `items` in the order given.
    fn leaf(owner: u64, items: &[(Key, Vec<u8>)]) -> Vec<u8> {
        let mut buf = vec![0u8; NODESIZE as usize];
        let mut m = NodeMut::new(&mut buf);
        {
            let h = m.header_mut();
            h.fsid = [7; 16];
            h.chunk_tree_uuid = [9; 16];
            h.bytenr = BYTENR.into();
            h.flags = HEADER_FLAG_WRITTEN.into();
            h.generation = GEN.into();
            h.owner = owner.into();
        }
        for (slot, (key, data)) in items.iter().enumerate() {
            m.insert_item(slot, key, data.len());
            m.item_data_mut(slot).copy_from_slice(data);
        }
        let c = CsumType::Crc32c.compute(&buf[CSUM_SIZE..]);
        buf[..CSUM_SIZE].copy_from_slice(&c);
        buf
    }

    fn dir_entry(location: Key, transid: u64, type_: u8, name: &[u8], data: &[u8]) -> Vec<u8> {
        let di = DirItem { location: location.to_disk(), transid: transid.into(), data_len: (data.len() as u16).into(), name_len: (name.len() as u16).into(), type_ };
        [di.as_bytes(), name, data].concat()
    }

    fn check_one(key: Key, data: Vec<u8>) -> Result<()> {
        check_tree_block(&leaf(FS_TREE_OBJECTID, &[(key, data)]), &ctx())
    }

    fn refused(r: Result<()>, needle: &str) {
        let e = r.expect_err(needle).to_string();
        assert!(e.contains(needle), "{e} does not say {needle:?}");
    }

    fn file_loc() -> Key {
        Key::new(257, INODE_ITEM_KEY, 0)
    }

    #[test]
    fn dir_item_transid_is_not_checked() {
        // btrfs-convert (progs 6.2) leaves garbage in a DIR_ITEM's transid.
        let name = b"a.txt";
        let e = dir_entry(file_loc(), 8028794434885779456, FT_REG_FILE, name, b"");
        check_one(Key::new(256, DIR_ITEM_KEY, name_hash(name)), e.clone()).expect("dir item");
        check_one(Key::new(256, DIR_INDEX_KEY, 2), e).expect("dir index");
        let x = dir_entry(Key::new(0, 0, 0), u64::MAX, FT_XATTR, b"user.a", b"v");
        check_one(Key::new(257, XATTR_ITEM_KEY, name_hash(b"user.a")), x).expect("xattr");
    }

    #[test]
    fn dir_item_rules_the_kernel_has_not() {
        // An empty name, several entries in a DIR_INDEX, an empty item, an encrypted
        // xattr type, a location of type 0: all accepted by check_dir_item.
        check_one(Key::new(256, DIR_ITEM_KEY, name_hash(b"")), dir_entry(file_loc(), 1, FT_REG_FILE, b"", b"")).expect("empty name");
        let two = [dir_entry(file_loc(), 1, FT_REG_FILE, b"a", b""), dir_entry(Key::new(258, INODE_ITEM_KEY, 0), 1, FT_DIR, b"b", b"")].concat();
        check_one(Key::new(256, DIR_INDEX_KEY, 2), two).expect("two entries in a dir index");
        check_one(Key::new(256, DIR_INDEX_KEY, 2), Vec::new()).expect("empty dir index");
        check_one(Key::new(257, XATTR_ITEM_KEY, name_hash(b"x")), dir_entry(Key::new(0, 0, 0), 1, FT_XATTR | FT_ENCRYPTED, b"x", b"")).expect("encrypted xattr type");
        check_one(Key::new(256, DIR_ITEM_KEY, name_hash(b"z")), dir_entry(Key::new(257, 0, 0), 1, FT_REG_FILE, b"z", b"")).expect("location type 0");
    }

    #[test]
    fn dir_item_rules_the_kernel_has() {
        let k = |n: &[u8]| Key::new(256, DIR_ITEM_KEY, name_hash(n));
        refused(check_one(k(b"a"), dir_entry(file_loc(), 1, FT_UNKNOWN, b"a", b"")), "invalid dir item type");
        refused(check_one(k(b"a"), dir_entry(file_loc(), 1, FT_MAX, b"a", b"")), "invalid dir item type");
        refused(check_one(k(b"a"), dir_entry(file_loc(), 1, FT_XATTR, b"a", b"")), "xattr dir type found for non-XATTR key");
        refused(check_one(k(b"a"), dir_entry(file_loc(), 1, FT_REG_FILE, b"a", b"v")), "invalid data len");
        refused(check_one(Key::new(256, DIR_ITEM_KEY, 1), dir_entry(file_loc(), 1, FT_REG_FILE, b"a", b"")), "name hash mismatch");
        refused(check_one(k(b"a"), dir_entry(Key::new(257, EXTENT_DATA_KEY, 0), 1, FT_REG_FILE, b"a", b"")), "invalid location key type");
        refused(check_one(k(b"a"), dir_entry(Key::new(257, INODE_ITEM_KEY, 4), 1, FT_REG_FILE, b"a", b"")), "invalid location key offset");
        refused(check_one(k(b"a"), dir_entry(Key::new(7, INODE_ITEM_KEY, 0), 1, FT_REG_FILE, b"a", b"")), "invalid location key objectid");
        refused(check_one(k(b"a"), dir_entry(Key::new(0, ROOT_ITEM_KEY, u64::MAX), 1, FT_DIR, b"a", b"")), "root id 0");
        refused(check_one(k(b"a"), dir_entry(Key::new(EXTENT_TREE_OBJECTID, ROOT_ITEM_KEY, u64::MAX), 1, FT_DIR, b"a", b"")), "invalid location key objectid");
        check_one(k(b"a"), dir_entry(Key::new(256, ROOT_ITEM_KEY, u64::MAX), 1, FT_DIR, b"a", b"")).expect("subvolume entry");
        let xk = Key::new(257, XATTR_ITEM_KEY, name_hash(b"user.a"));
        refused(check_one(xk, dir_entry(file_loc(), 1, FT_XATTR, b"user.a", b"")), "for an xattr");
        refused(check_one(xk, dir_entry(Key::new(0, 0, 0), 1, FT_REG_FILE, b"user.a", b"")), "for XATTR key");
        let long = vec![b'n'; NAME_LEN + 1];
        refused(check_one(k(&long), dir_entry(file_loc(), 1, FT_REG_FILE, &long, b"")), "name len too long");
        let mut cut = dir_entry(file_loc(), 1, FT_REG_FILE, b"abc", b"");
        cut.pop();
        refused(check_one(k(b"abc"), cut), "invalid dir item name or data len");
    }

    #[test]
    fn inode_refs_as_the_kernel() {
        let r = |name: &[u8]| [InodeRef { index: 2u64.into(), name_len: (name.len() as u16).into() }.as_bytes(), name].concat();
        let long = vec![b'n'; 300];
        check_one(Key::new(257, INODE_REF_KEY, 256), r(&long)).expect("a 300-byte name: no kernel rule");
        check_one(Key::new(257, INODE_REF_KEY, 256), [r(b"a"), r(b"")].concat()).expect("an empty second name");
        refused(check_one(Key::new(257, INODE_REF_KEY, 256), r(b"")), "invalid item size");
        refused(check_one(Key::new(257, INODE_REF_KEY, 256), Vec::new()), "invalid item size");
        refused(check_one(Key::new(257, INODE_REF_KEY, 256), r(b"ab")[..11].to_vec()), "inode ref name len");
        let x = |name: &[u8]| [InodeExtref { parent_objectid: 256u64.into(), index: 2u64.into(), name_len: (name.len() as u16).into() }.as_bytes(), name].concat();
        check_one(Key::new(257, INODE_EXTREF_KEY, 5), Vec::new()).expect("an empty extref item");
        check_one(Key::new(257, INODE_EXTREF_KEY, 5), x(b"")).expect("an empty extref name");
        refused(check_one(Key::new(257, INODE_EXTREF_KEY, 5), x(b"ab")[..19].to_vec()), "inode extref name len");
    }

    fn file_extent(type_: u8, generation: u64, ram_bytes: u64, compression: u8, body: [u64; 4]) -> Vec<u8> {
        let h = FileExtentHeader { generation: generation.into(), ram_bytes: ram_bytes.into(), compression, encryption: 0, other_encoding: 0.into(), type_ };
        let mut v = h.as_bytes().to_vec();
        for x in body {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v
    }

    #[test]
    fn file_extents_as_the_kernel() {
        let k = |off| Key::new(257, EXTENT_DATA_KEY, off);
        // Generations are not checked, nor the sums of fields, nor ram_bytes against
        // offset + num_bytes, nor other_encoding.
        check_one(k(0), file_extent(FILE_EXTENT_REG, u64::MAX, 4096, 0, [1 << 20, 4096, 0, 4096])).expect("future generation");
        check_one(k(0), file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 8192, 4096])).expect("offset past ram_bytes");
        check_one(k(0), file_extent(FILE_EXTENT_REG, 1, 4096, 0, [u64::MAX - 4095, 8192, 0, 4096])).expect("disk range past 2^64");
        let mut other = file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 0, 4096]);
        other[18] = 1;
        check_one(k(0), other).expect("other_encoding");
        let mut inline = file_extent(FILE_EXTENT_INLINE, 1, 1 << 30, 3, [0; 4]);
        inline.truncate(FILE_EXTENT_INLINE_DATA_START + 10);
        check_one(k(0), inline.clone()).expect("compressed inline extent claiming 1 GiB");
        // The kernel's rules.
        refused(check_one(k(4096), inline), "invalid file_offset for inline file extent");
        refused(check_one(k(100), file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 0, 4096])), "unaligned file_offset");
        refused(check_one(k(0), file_extent(FILE_EXTENT_REG, 1, 4000, 0, [1 << 20, 4096, 0, 4096])), "invalid ram_bytes");
        refused(check_one(k(0), file_extent(FILE_EXTENT_REG, 1, 4096, 4, [1 << 20, 4096, 0, 4096])), "invalid compression");
        refused(check_one(k(1 << 40), file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 0, u64::MAX - 4095])), "extent end overflow");
        let mut enc = file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 0, 4096]);
        enc[17] = 1;
        refused(check_one(k(0), enc), "invalid encryption");
    }

    #[test]
    fn header_rules_as_the_kernel() {
        let name = b"a";
        let buf = leaf(FS_TREE_OBJECTID, &[(Key::new(256, DIR_ITEM_KEY, name_hash(name)), dir_entry(file_loc(), 1, FT_REG_FILE, name, b""))]);
        // A block newer than the superblock is not refused by itself (the parent's
        // pointer says which generation to expect), nor a foreign chunk tree uuid.
        check_tree_block(&buf, &CheckCtx { super_generation: 1, ..ctx() }).expect("generation past the superblock's");
        refused(check_tree_block(&buf, &CheckCtx { chunk_tree_uuid: Some([1; 16]), ..ctx() }), "bad chunk_tree_uuid");
        refused(check_tree_block(&buf, &CheckCtx { generation: Some(GEN + 1), ..ctx() }), "parent transid verify failed");
        // Owners: log and relocation trees are not checked; a subvolume tree's block
        // may belong to any subvolume tree; others must match.
        check_tree_block(&buf, &CheckCtx { owner: Some(TREE_LOG_OBJECTID), ..ctx() }).expect("log tree");
        check_tree_block(&buf, &CheckCtx { owner: Some(257), ..ctx() }).expect("a snapshot sharing the block");
        refused(check_tree_block(&buf, &CheckCtx { owner: Some(DATA_RELOC_TREE_OBJECTID), ..ctx() }), "owner mismatch");
        refused(check_tree_block(&buf, &CheckCtx { owner: Some(EXTENT_TREE_OBJECTID), ..ctx() }), "owner mismatch");
    }

    #[test]
    fn node_pointers_as_the_kernel() {
        let mut buf = vec![0u8; NODESIZE as usize];
        let mut m = NodeMut::new(&mut buf);
        {
            let h = m.header_mut();
            h.fsid = [7; 16];
            h.bytenr = BYTENR.into();
            h.flags = HEADER_FLAG_WRITTEN.into();
            h.generation = GEN.into();
            h.owner = FS_TREE_OBJECTID.into();
            h.level = 1;
        }
        // A pointer generation past the superblock's is not checked, nor the last
        // pointer (its child fails when read).
        m.insert_ptr(0, &Key::new(256, INODE_ITEM_KEY, 0), 1 << 22, u64::MAX);
        m.insert_ptr(1, &Key::new(300, INODE_ITEM_KEY, 0), 0, 5);
        let seal = |buf: &mut Vec<u8>| {
            let c = CsumType::Crc32c.compute(&buf[CSUM_SIZE..]);
            buf[..CSUM_SIZE].copy_from_slice(&c);
        };
        seal(&mut buf);
        let c = CheckCtx { level: Some(1), ..ctx() };
        check_tree_block(&buf, &c).expect("node");
        NodeMut::new(&mut buf).set_ptr(0, &Key::new(256, INODE_ITEM_KEY, 0), 0, 5);
        seal(&mut buf);
        refused(check_tree_block(&buf, &c), "invalid block pointer");
    }

    #[test]
    fn leaf_rules_as_the_kernel() {
        let name = b"a";
        let item = (Key::new(256, DIR_ITEM_KEY, name_hash(name)), dir_entry(file_loc(), 1, FT_REG_FILE, name, b""));
        let mut unwritten = leaf(FS_TREE_OBJECTID, std::slice::from_ref(&item));
        NodeMut::new(&mut unwritten).header_mut().flags = 0.into();
        let c = CsumType::Crc32c.compute(&unwritten[CSUM_SIZE..]);
        unwritten[..CSUM_SIZE].copy_from_slice(&c);
        refused(check_tree_block(&unwritten, &ctx()), "WRITTEN not set");
        // Empty leaves: never of these trees (unless relocation's), nor of tree 0.
        refused(check_tree_block(&leaf(FS_TREE_OBJECTID, &[]), &ctx()), "must never be empty");
        refused(check_tree_block(&leaf(DATA_RELOC_TREE_OBJECTID, &[]), &ctx()), "must never be empty");
        refused(check_tree_block(&leaf(0, &[]), &ctx()), "root 0 is not defined");
        check_tree_block(&leaf(257, &[]), &ctx()).expect("an empty subvolume leaf");
        check_tree_block(&leaf(CSUM_TREE_OBJECTID, &[]), &ctx()).expect("an empty csum tree");
        let mut reloc = leaf(FS_TREE_OBJECTID, &[]);
        NodeMut::new(&mut reloc).header_mut().flags = (HEADER_FLAG_WRITTEN | HEADER_FLAG_RELOC).into();
        let c = CsumType::Crc32c.compute(&reloc[CSUM_SIZE..]);
        reloc[..CSUM_SIZE].copy_from_slice(&c);
        check_tree_block(&reloc, &ctx()).expect("an empty relocation leaf");
        refused(check_tree_block(&leaf(257, &[(Key::new(0, 0, 0), Vec::new())]), &ctx()), "bad key order");
        // Overlapping file extents in one leaf.
        let fe = |off: u64, len: u64| (Key::new(257, EXTENT_DATA_KEY, off), file_extent(FILE_EXTENT_REG, 1, 8192, 0, [1 << 20, 8192, 0, len]));
        check_tree_block(&leaf(257, &[fe(0, 4096), fe(4096, 4096)]), &ctx()).expect("adjacent extents");
        refused(check_tree_block(&leaf(257, &[fe(0, 8192), fe(4096, 4096)]), &ctx()), "goes beyond start offset");
        let mut inline = file_extent(FILE_EXTENT_INLINE, 1, 100, 0, [0; 4]);
        inline.truncate(FILE_EXTENT_INLINE_DATA_START + 100);
        refused(check_tree_block(&leaf(257, &[(Key::new(257, EXTENT_DATA_KEY, 0), inline), fe(0, 4096)]), &ctx()), "key order");
    }

    #[test]
    fn item_rules_the_kernel_has() {
        let mut ii = InodeItem::new_zeroed();
        ii.mode = (S_IFREG | 0o644 | 0x10000).into();
        refused(check_one(Key::new(257, INODE_ITEM_KEY, 0), ii.as_bytes().to_vec()), "unknown mode bit");
        // Inline refs of one type in descending order of their offsets.
        let extent = |roots: &[u64]| {
            let mut v = ExtentItem { refs: (roots.len() as u64).into(), generation: 1.into(), flags: EXTENT_FLAG_TREE_BLOCK.into() }.as_bytes().to_vec();
            for r in roots {
                v.push(TREE_BLOCK_REF_KEY);
                v.extend_from_slice(&r.to_le_bytes());
            }
            v
        };
        let tree = |data| check_tree_block(&leaf(EXTENT_TREE_OBJECTID, &[(Key::new(1 << 20, METADATA_ITEM_KEY, 0), data)]), &ctx());
        tree(extent(&[258, 257])).expect("descending");
        refused(tree(extent(&[257, 258])), "inline ref out-of-order");
        let de = DevExtent { chunk_tree: 4.into(), chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(), chunk_offset: (1 << 20).into(), length: 4096.into(), chunk_tree_uuid: [9; 16] };
        refused(check_tree_block(&leaf(DEV_TREE_OBJECTID, &[(Key::new(1, DEV_EXTENT_KEY, 1 << 20), de.as_bytes().to_vec())]), &ctx()), "chunk tree id");
    }

    #[test]
    fn other_items_as_the_kernel() {
        // An empty csum item, a dev extent of length 0, a block group with unknown
        // flag bits: no kernel rule refuses them.
        let tree = |owner, key, data| check_tree_block(&leaf(owner, &[(key, data)]), &ctx());
        tree(CSUM_TREE_OBJECTID, Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 1 << 20), Vec::new()).expect("empty csum item");
        refused(tree(CSUM_TREE_OBJECTID, Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 1 << 20), vec![0; 5]), "unaligned item size for csum item");
        let de = DevExtent { chunk_tree: CHUNK_TREE_OBJECTID.into(), chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(), chunk_offset: (1 << 20).into(), length: 0.into(), chunk_tree_uuid: [9; 16] };
        tree(DEV_TREE_OBJECTID, Key::new(1, DEV_EXTENT_KEY, 1 << 20), de.as_bytes().to_vec()).expect("dev extent of length 0");
        let bg = |flags: u64| BlockGroupItem { used: 0.into(), chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(), flags: flags.into() }.as_bytes().to_vec();
        tree(EXTENT_TREE_OBJECTID, Key::new(1 << 20, BLOCK_GROUP_ITEM_KEY, 1 << 20), bg(BLOCK_GROUP_DATA | 1 << 40)).expect("unknown block group bits");
        refused(tree(EXTENT_TREE_OBJECTID, Key::new(1 << 20, BLOCK_GROUP_ITEM_KEY, 1 << 20), bg(BLOCK_GROUP_DATA | BLOCK_GROUP_SYSTEM)), "invalid block group type");
        refused(tree(EXTENT_TREE_OBJECTID, Key::new(1 << 20, BLOCK_GROUP_ITEM_KEY, 1 << 20), bg(BLOCK_GROUP_DATA | BLOCK_GROUP_RAID1 | BLOCK_GROUP_DUP)), "invalid profile");
    }
}
