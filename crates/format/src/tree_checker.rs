//! The tree checker: every tree block is validated once, when it is read, before any
//! other code sees it (the kernel's tree-checker.c plus the read-time header checks of
//! disk-io.c). After `check_tree_block` succeeds, `NodeRef` accessors cannot go out of
//! bounds and item parsers cannot fail on structure.
//!
//! Checks, in order: size, checksum, header (bytenr, fsid, chunk_tree_uuid, level,
//! owner, generation), layout (item offsets packed from the end, no overlap, ptr
//! alignment), strictly increasing keys, then item contents by type.

use crate::csum::CsumType;
use crate::error::{Corrupt, CorruptWhere, Result};
use crate::hash::name_hash;
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
    /// None while bootstrapping (before the chunk tree uuid is known).
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
    if gen > ctx.super_generation.saturating_add(1) {
        return Err(blk(format!("generation {gen} is newer than the superblock generation {} + 1", ctx.super_generation)));
    }
    if let Some(o) = ctx.owner {
        let ok = if is_fstree(o) { is_fstree(owner) } else { owner == o };
        if !ok {
            return Err(blk(format!("owner mismatch, want {o} have {owner}")));
        }
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
        if bp == 0 || !bp.is_multiple_of(u64::from(ctx.sectorsize)) {
            return Err(err(format!("invalid block pointer {bp}")).slot(slot as u32, key));
        }
        if kp.generation.get() > ctx.super_generation.saturating_add(1) {
            return Err(err(format!("pointer generation {} too new", kp.generation.get())).slot(slot as u32, key));
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
        // These trees are never empty, so an empty leaf owned by them is damage.
        if matches!(owner, ROOT_TREE_OBJECTID | CHUNK_TREE_OBJECTID | DEV_TREE_OBJECTID | EXTENT_TREE_OBJECTID) {
            return Err(err(format!("unexpected empty leaf for tree {owner}")));
        }
        return Ok(());
    }
    if n > max_leaf_items(ctx.nodesize) {
        return Err(err(format!("invalid nritems {n}, max {}", max_leaf_items(ctx.nodesize))));
    }
    let data_area = ctx.nodesize as usize - HEADER_SIZE;
    let mut prev: Option<Key> = None;
    for slot in 0..n {
        let it = node.item(slot);
        let key = Key::from(&it.key);
        let e = |r: String| err(r).slot(slot as u32, key);
        if let Some(p) = prev {
            if p >= key {
                return Err(e(format!("bad key order, prev {p} current {key}")));
            }
        }
        prev = Some(key);
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
        DIR_ITEM_KEY | DIR_INDEX_KEY | XATTR_ITEM_KEY => {
            let mut count = 0;
            for e in items::dir_entries(data) {
                let e = e?;
                count += 1;
                if e.type_ & !FT_ENCRYPTED >= FT_MAX {
                    return Err(format!("invalid dir item type {}", e.type_));
                }
                let is_xattr = key.type_ == XATTR_ITEM_KEY;
                if is_xattr != (e.type_ == FT_XATTR) {
                    return Err(format!("invalid dir item type {} for key type {}", e.type_, key.type_));
                }
                if e.name.len() > NAME_LEN || e.name.is_empty() {
                    return Err(format!("invalid dir item name len {}", e.name.len()));
                }
                if !is_xattr && !e.data.is_empty() {
                    return Err(format!("invalid dir item data len {}", e.data.len()));
                }
                if e.data.len() > MAX_XATTR_SIZE_LIMIT {
                    return Err(format!("invalid xattr data len {}", e.data.len()));
                }
                if key.type_ != DIR_INDEX_KEY && name_hash(e.name) != key.offset {
                    return Err(format!("name hash mismatch with key, have {:#018x} expect {:#018x}", name_hash(e.name), key.offset));
                }
                if !is_xattr && e.location.type_ != INODE_ITEM_KEY && e.location.type_ != ROOT_ITEM_KEY {
                    return Err(format!("invalid dir item location key {}", e.location));
                }
                gen_ok(e.transid, "dir item")?;
            }
            if count == 0 {
                return Err("empty dir item".to_string());
            }
            if key.type_ == DIR_INDEX_KEY && count != 1 {
                return Err(format!("dir index item has {count} entries, expect 1"));
            }
        }
        INODE_REF_KEY => {
            for r in items::inode_refs(data, key.offset) {
                let r = r?;
                if r.name.is_empty() || r.name.len() > NAME_LEN {
                    return Err(format!("invalid inode ref name len {}", r.name.len()));
                }
            }
            if data.is_empty() {
                return Err("empty inode ref".into());
            }
        }
        INODE_EXTREF_KEY => {
            for r in items::inode_extrefs(data) {
                let r = r?;
                if r.name.is_empty() || r.name.len() > NAME_LEN {
                    return Err(format!("invalid inode extref name len {}", r.name.len()));
                }
            }
            if data.is_empty() {
                return Err("empty inode extref".into());
            }
        }
        EXTENT_DATA_KEY => {
            if !aligned(key.offset, ctx.sectorsize) {
                return Err(format!("unaligned file_pos for file extent, have {} should be aligned to {}", key.offset, ctx.sectorsize));
            }
            match items::file_extent(data)? {
                FileExtent::Inline { generation, ram_bytes, compression, data: inline } => {
                    gen_ok(generation, "file extent")?;
                    if compression > 3 {
                        return Err(format!("invalid compression type {compression}"));
                    }
                    if compression == 0 && ram_bytes != inline.len() as u64 {
                        return Err(format!("invalid ram_bytes for uncompressed inline extent, have {} expect {ram_bytes}", inline.len()));
                    }
                    if ram_bytes > u64::from(ctx.sectorsize).max(4096) * 16 {
                        return Err(format!("inline extent ram_bytes {ram_bytes} too large"));
                    }
                }
                FileExtent::Regular { generation, compression, disk_bytenr, disk_num_bytes, offset, num_bytes, ram_bytes, .. } => {
                    gen_ok(generation, "file extent")?;
                    if compression > 3 {
                        return Err(format!("invalid compression type {compression}"));
                    }
                    for (n, v) in [("disk_bytenr", disk_bytenr), ("disk_num_bytes", disk_num_bytes), ("offset", offset), ("num_bytes", num_bytes)] {
                        if !aligned(v, ctx.sectorsize) {
                            return Err(format!("invalid {n} for file extent, have {v}, should be aligned to {}", ctx.sectorsize));
                        }
                    }
                    if key.offset.checked_add(num_bytes).is_none() {
                        return Err(format!("file extent end overflows, key offset {} num_bytes {num_bytes}", key.offset));
                    }
                    if disk_bytenr != 0 && disk_bytenr.checked_add(disk_num_bytes).is_none() {
                        return Err("file extent disk range overflows".into());
                    }
                    if compression == 0 && disk_bytenr != 0 && offset.checked_add(num_bytes).is_none_or(|e| e > ram_bytes) {
                        return Err(format!("file extent offset {offset} + num_bytes {num_bytes} beyond ram_bytes {ram_bytes}"));
                    }
                }
            }
        }
        EXTENT_CSUM_KEY => {
            if key.objectid != EXTENT_CSUM_OBJECTID {
                return Err(format!("invalid csum item objectid {}", key.objectid));
            }
            if !aligned(key.offset, ctx.sectorsize) {
                return Err(format!("unaligned csum item key offset {}", key.offset));
            }
            if !data.len().is_multiple_of(ctx.csum_type.size()) || data.is_empty() {
                return Err(format!("unaligned csum item size {}, csum size {}", data.len(), ctx.csum_type.size()));
            }
        }
        ROOT_ITEM_KEY => {
            let v = items::root_item(data)?;
            gen_ok(v.item.generation.get(), "root item")?;
            if v.item.level >= MAX_LEVEL {
                return Err(format!("invalid root level {}", v.item.level));
            }
            if !aligned(v.item.bytenr.get(), ctx.sectorsize) {
                return Err(format!("invalid root bytenr {}", v.item.bytenr.get()));
            }
        }
        ROOT_REF_KEY | ROOT_BACKREF_KEY => {
            let r = items::root_ref(data)?;
            if r.name.is_empty() || r.name.len() > NAME_LEN {
                return Err(format!("invalid root ref name len {}", r.name.len()));
            }
        }
        CHUNK_ITEM_KEY => {
            let (c, used) = items::chunk(data)?;
            if used != data.len() {
                return Err(format!("invalid chunk item size, have {} expect {used}", data.len()));
            }
            check_chunk(&c, key.offset, ctx.sectorsize)?;
        }
        DEV_ITEM_KEY => {
            exact::<DevItem>(data, "dev")?;
            let d: &DevItem = items::read_prefix(data, "dev")?;
            if d.devid.get() != key.offset {
                return Err(format!("devid mismatch, key has {} item has {}", key.offset, d.devid.get()));
            }
            if d.bytes_used.get() > d.total_bytes.get() {
                return Err(format!("invalid bytes used {} > total {}", d.bytes_used.get(), d.total_bytes.get()));
            }
        }
        DEV_EXTENT_KEY => {
            exact::<DevExtent>(data, "dev extent")?;
            let d: &DevExtent = items::read_prefix(data, "dev extent")?;
            if d.length.get() == 0 {
                return Err("dev extent length 0".into());
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
            check_bg_flags(b.flags.get())?;
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
            gen_ok(v.generation, "extent")?;
            let mut total = 0u64;
            let mut prev_type = 0u8;
            for r in &v.inline_refs {
                let t = r.type_();
                if t < prev_type {
                    return Err(format!("inline ref out of order: type {t} after {prev_type}"));
                }
                prev_type = t;
                if is_data != matches!(r, InlineRef::ExtentData { .. } | InlineRef::SharedData { .. } | InlineRef::Owner { .. }) {
                    return Err(format!("inline ref type {t} does not match extent kind"));
                }
                total = total.saturating_add(r.count());
            }
            if total > v.refs {
                return Err(format!("invalid extent refs, have {} expect >= inline {total}", v.refs));
            }
        }
        TREE_BLOCK_REF_KEY | SHARED_BLOCK_REF_KEY if !data.is_empty() => {
            return Err(format!("invalid tree block ref item size {}", data.len()));
        }
        EXTENT_DATA_REF_KEY => exact::<ExtentDataRef>(data, "extent data ref")?,
        SHARED_DATA_REF_KEY => exact::<SharedDataRef>(data, "shared data ref")?,
        FREE_SPACE_INFO_KEY => exact::<FreeSpaceInfo>(data, "free space info")?,
        FREE_SPACE_EXTENT_KEY if !data.is_empty() => {
            return Err(format!("invalid free space extent item size {}", data.len()));
        }
        FREE_SPACE_BITMAP_KEY => {
            let bits = key.offset / u64::from(ctx.sectorsize);
            let want = bits.div_ceil(8);
            if key.offset == 0 || !aligned(key.offset, ctx.sectorsize) || data.len() as u64 != want {
                return Err(format!("invalid free space bitmap item size {}, expect {want} for length {}", data.len(), key.offset));
            }
        }
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

fn check_bg_flags(flags: u64) -> core::result::Result<(), String> {
    let t = flags & BLOCK_GROUP_TYPE_MASK;
    if !(t == BLOCK_GROUP_DATA || t == BLOCK_GROUP_SYSTEM || t == BLOCK_GROUP_METADATA || t == BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA) {
        return Err(format!("invalid block group type flags {flags:#x}"));
    }
    let p = flags & BLOCK_GROUP_PROFILE_MASK;
    if p.count_ones() > 1 {
        return Err(format!("invalid profile flags {flags:#x}"));
    }
    if flags & !(BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK) != 0 {
        return Err(format!("unknown block group flags {flags:#x}"));
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
    check_bg_flags(c.type_)?;
    let n = c.stripes.len();
    let p = c.type_ & BLOCK_GROUP_PROFILE_MASK;
    let ok = match p {
        0 => n == 1,
        BLOCK_GROUP_DUP => n == 2,
        BLOCK_GROUP_RAID1 => n == 2,
        BLOCK_GROUP_RAID1C3 => n == 3,
        BLOCK_GROUP_RAID1C4 => n == 4,
        BLOCK_GROUP_RAID0 => n >= 1,
        BLOCK_GROUP_RAID10 => n >= 2 && n.is_multiple_of(2) && c.sub_stripes == 2,
        BLOCK_GROUP_RAID5 => n >= 2,
        BLOCK_GROUP_RAID6 => n >= 3,
        _ => false,
    };
    if !ok {
        return Err(format!("invalid num_stripes {n} (sub_stripes {}) for profile {}", c.sub_stripes, profile_name(c.type_)));
    }
    for &(devid, off, _) in &c.stripes {
        if devid == 0 {
            return Err("chunk stripe devid 0".into());
        }
        if off.checked_add(c.length).is_none() {
            return Err(format!("chunk stripe offset {off} overflows"));
        }
    }
    Ok(())
}
