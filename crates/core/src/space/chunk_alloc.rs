//! Chunk allocation (the kernel's volumes.c `btrfs_create_chunk` and the two-phase
//! block-group creation): when a type runs out of space, carve a dev extent (SINGLE) or
//! two (DUP) from the device, add the chunk to the in-memory map and a new block group
//! to the allocator at once, and insert the CHUNK_ITEM, DEV_EXTENTs, updated DEV_ITEM,
//! BLOCK_GROUP_ITEM and free-space-tree INFO at commit (phase two). SYSTEM chunks are
//! also appended to the superblock's sys_chunk_array.
//!
//! Invariants: dev extents never overlap and never start below 1 MiB; each chunk has
//! one dev extent per stripe; a DUP chunk's two stripes sit on the same device.

use crate::error::{Error, PosixKind, Result};
use crate::transaction::FsWriter;
use crate::volumes::MapLookup;
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};
use zerocopy::IntoBytes;

const MIB: u64 = 1 << 20;

/// A chunk created in this transaction whose items are not in the trees yet.
#[derive(Clone, Debug)]
pub struct PendingChunk {
    pub map: MapLookup,
    pub stripe_size: u64,
}

fn chunk_item_bytes(m: &MapLookup, sectorsize: u32) -> Vec<u8> {
    let h = ChunkHeader {
        length: m.length.into(),
        owner: EXTENT_TREE_OBJECTID.into(),
        stripe_len: STRIPE_LEN.into(),
        type_: m.type_.into(),
        io_align: sectorsize.into(),
        io_width: sectorsize.into(),
        sector_size: sectorsize.into(),
        num_stripes: (m.stripes.len() as u16).into(),
        sub_stripes: 1.into(),
    };
    let mut v = h.as_bytes().to_vec();
    for &(devid, off, uuid) in &m.stripes {
        let s = Stripe { devid: devid.into(), offset: off.into(), dev_uuid: uuid };
        v.extend_from_slice(s.as_bytes());
    }
    v
}

/// Free holes of device `devid`: committed dev extents plus chunks made this transaction.
///
/// # Errors
/// `Corrupt` for a dev extent that runs past the end of the address space; read
/// failures.
fn dev_holes(w: &mut FsWriter, devid: u64, total: u64) -> Result<Vec<(u64, u64)>> {
    let mut used: Vec<(u64, u64)> = Vec::new();
    for (k, d) in w.items_in_range(DEV_TREE_OBJECTID, &Key::new(devid, DEV_EXTENT_KEY, 0), &Key::new(devid, DEV_EXTENT_KEY, u64::MAX))? {
        let len = u64::from_le_bytes(d[24..32].try_into().expect("dev extent size checked by the tree checker"));
        if k.offset.checked_add(len).is_none() {
            return Err(Corrupt::new(CorruptWhere::Item, format!("dev extent at {} of length {len} runs past the end of the address space", k.offset)).root(DEV_TREE_OBJECTID).key(k).into());
        }
        used.push((k.offset, len));
    }
    for p in &w.pending_chunks {
        for &(d, off, _) in &p.map.stripes {
            if d == devid {
                used.push((off, p.stripe_size));
            }
        }
    }
    used.sort();
    let mut holes = Vec::new();
    let mut cur = MIB;
    for (s, l) in used {
        if s > cur {
            holes.push((cur, s - cur));
        }
        cur = cur.max(s + l);
    }
    if total > cur {
        holes.push((cur, total - cur));
    }
    Ok(holes)
}

/// Create a chunk and block group of type `ty` (phase one: in memory).
///
/// # Errors
/// `Posix(NoSpace)` when the device has no room for another chunk.
/// In the handle `h` (the public form; the engine's own allocations call
/// `alloc_chunk_in`).
pub fn alloc_chunk(h: &mut crate::transaction::TransHandle<'_>, ty: u64) -> Result<()> {
    alloc_chunk_in(h, ty)
}

pub(crate) fn alloc_chunk_in(w: &mut FsWriter, ty: u64) -> Result<()> {
    #[cfg(feature = "test-hooks")]
    if w.hooks.refuse_chunk_alloc {
        return Err(Error::posix(PosixKind::NoSpace, format!("no room for a new {} chunk (test switch)", block_group_flags_str(ty))));
    }
    let profile =
        w.alloc.groups.values().find(|g| g.flags & BLOCK_GROUP_TYPE_MASK == ty).map(|g| g.flags & BLOCK_GROUP_PROFILE_MASK).unwrap_or(if ty == BLOCK_GROUP_DATA { 0 } else { BLOCK_GROUP_DUP });
    let (&devid, dev) = w.alloc.dev_items.iter().next().ok_or_else(|| Error::posix(PosixKind::NoSpace, "no device item"))?;
    let dev_uuid = dev.uuid;
    let dev_bytes_used = dev.bytes_used.get();
    let total = dev.total_bytes.get();
    let fs_total = w.sb.total_bytes.get();
    let type_max = match ty {
        BLOCK_GROUP_DATA => 1 << 30,
        BLOCK_GROUP_SYSTEM => 32 * MIB,
        _ => 256 * MIB,
    };
    let nstripes = if profile == BLOCK_GROUP_DUP { 2 } else { 1 };
    let mut stripe = (fs_total / 10).min(type_max) / STRIPE_LEN * STRIPE_LEN;
    stripe = stripe.max(4 * MIB);
    let holes = dev_holes(w, devid, total)?;
    let mut offsets = Vec::new();
    // Largest holes first; shrink the stripe to what fits.
    let mut sorted = holes.clone();
    sorted.sort_by_key(|h| std::cmp::Reverse(h.1));
    let avail: Vec<u64> = sorted.iter().map(|h| h.1 / STRIPE_LEN * STRIPE_LEN).collect();
    if nstripes == 2 {
        let best_two = if avail.len() >= 2 { avail[1].max(avail[0] / 2) } else { avail.first().copied().unwrap_or(0) / 2 };
        stripe = stripe.min(best_two / STRIPE_LEN * STRIPE_LEN);
    } else {
        stripe = stripe.min(avail.first().copied().unwrap_or(0));
    }
    if stripe < MIB {
        return Err(Error::posix(PosixKind::NoSpace, format!("device {devid} has no room for a new {} chunk", block_group_flags_str(ty | profile))));
    }
    for &(s, l) in &holes {
        // Holes end at most at the device's total_bytes, which a crafted device item may
        // put at the top of the address space.
        let Some(mut p) = s.div_ceil(STRIPE_LEN).checked_mul(STRIPE_LEN) else { continue };
        while offsets.len() < nstripes && p.checked_add(stripe).is_some_and(|e| e <= s + l) {
            offsets.push(p);
            p += stripe;
        }
        if offsets.len() == nstripes {
            break;
        }
    }
    if offsets.len() < nstripes {
        return Err(Error::posix(PosixKind::NoSpace, format!("device {devid} has no room for a new {} chunk", block_group_flags_str(ty | profile))));
    }
    // Chunks were checked not to overflow when read (`check_chunk`).
    let logical = w.info.chunk_map.iter().map(|c| c.logical + c.length).max().unwrap_or(MIB).div_ceil(STRIPE_LEN).checked_mul(STRIPE_LEN).filter(|l| l.checked_add(stripe).is_some());
    let Some(logical) = logical else {
        return Err(Error::posix(PosixKind::NoSpace, format!("no logical address space left for a new {} chunk", block_group_flags_str(ty | profile))));
    };
    // The device item's new usage, before anything changes: a device item whose sizes
    // sit at the top of the address space cannot take another chunk.
    let dev_used = dev_bytes_used.checked_add(stripe * nstripes as u64).ok_or_else(|| {
        Error::from(Corrupt::new(CorruptWhere::Item, format!("device {devid} bytes used {dev_bytes_used} + {} overflows", stripe * nstripes as u64)).root(CHUNK_TREE_OBJECTID).key(Key::new(
            DEV_ITEMS_OBJECTID,
            DEV_ITEM_KEY,
            devid,
        )))
    })?;
    let flags = ty | profile;
    let map = MapLookup { logical, length: stripe, type_: flags, stripe_len: STRIPE_LEN, sub_stripes: 1, stripes: offsets.iter().map(|&o| (devid, o, dev_uuid)).collect() };
    w.info.chunk_map.insert(map.clone())?;
    crate::space::allocator::add_new_block_group(w, logical, stripe, flags)?;
    let d = w.alloc.dev_items.get_mut(&devid).expect("device listed above");
    d.bytes_used = dev_used.into();
    if ty == BLOCK_GROUP_SYSTEM {
        let mut arr = w.sb.sys_chunk_array[..w.sb.sys_chunk_array_size.get() as usize].to_vec();
        arr.extend_from_slice(Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, logical).to_disk().as_bytes());
        arr.extend_from_slice(&chunk_item_bytes(&map, w.sectorsize()));
        if arr.len() > SYSTEM_CHUNK_ARRAY_SIZE {
            return Err(Error::posix(PosixKind::NoSpace, "sys_chunk_array is full"));
        }
        w.sb.sys_chunk_array[..arr.len()].copy_from_slice(&arr);
        w.sb.sys_chunk_array_size = (arr.len() as u32).into();
    }
    w.pending_chunks.push(PendingChunk { map, stripe_size: stripe });
    Ok(())
}

/// Phase two: insert the items of chunks created in this transaction.
///
/// # Errors
/// Tree modification failures.
pub(crate) fn insert_pending_chunks(w: &mut FsWriter) -> Result<bool> {
    if w.pending_chunks.is_empty() {
        return Ok(false);
    }
    let ss = w.sectorsize();
    // Each chunk stays in `pending_chunks` until its dev extents are in the dev tree: a
    // tree block allocated while inserting them may need a chunk of its own, and
    // `dev_holes` must still see this one's stripes.
    while let Some(p) = w.pending_chunks.first().cloned() {
        let m = &p.map;
        w.insert_item(CHUNK_TREE_OBJECTID, &Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, m.logical), &chunk_item_bytes(m, ss))?;
        for &(devid, off, _) in &m.stripes {
            let de = DevExtent {
                chunk_tree: CHUNK_TREE_OBJECTID.into(),
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(),
                chunk_offset: m.logical.into(),
                length: p.stripe_size.into(),
                chunk_tree_uuid: w.info.chunk_tree_uuid,
            };
            w.insert_item(DEV_TREE_OBJECTID, &Key::new(devid, DEV_EXTENT_KEY, off), de.as_bytes())?;
        }
        let tree = if w.alloc.bg_tree { BLOCK_GROUP_TREE_OBJECTID } else { EXTENT_TREE_OBJECTID };
        let g = w.alloc.groups.get_mut(&m.logical).expect("pending chunk has a block group");
        g.new = false;
        g.dirty = true;
        let body = BlockGroupItem { used: g.used.into(), chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(), flags: g.flags.into() };
        w.insert_item(tree, &Key::new(m.logical, BLOCK_GROUP_ITEM_KEY, m.length), body.as_bytes())?;
        crate::space::free_space_tree::add_block_group_free_space_in(w, m.logical)?;
        let pos = w.pending_chunks.iter().position(|q| q.map.logical == m.logical).expect("pending chunk still listed");
        w.pending_chunks.remove(pos);
    }
    // Device items: bytes_used changed.
    let devs: Vec<(u64, DevItem)> = w.alloc.dev_items.iter().map(|(k, v)| (*k, *v)).collect();
    for (devid, d) in devs {
        if let Some((leaf, slot)) = w.lookup_for_update(CHUNK_TREE_OBJECTID, &Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid), 0)? {
            w.item_data_mut(leaf, slot).copy_from_slice(d.as_bytes());
        }
    }
    Ok(true)
}
