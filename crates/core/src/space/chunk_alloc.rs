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
use crate::transaction::Transaction;
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
        sub_stripes: m.sub_stripes.into(),
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
fn dev_holes(w: &mut Transaction, devid: u64, total: u64) -> Result<Vec<(u64, u64)>> {
    let mut used = dev_extents(w, devid)?;
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

/// Device `devid`'s dev extents (start, length): committed ones and the stripes of
/// chunks made in this transaction, unsorted.
///
/// # Errors
/// As `dev_holes`.
fn dev_extents(w: &mut Transaction, devid: u64) -> Result<Vec<(u64, u64)>> {
    let mut used: Vec<(u64, u64)> = Vec::new();
    for (k, d) in w.items_in_range(
        DEV_TREE_OBJECTID,
        &Key::new(devid, DEV_EXTENT_KEY, 0),
        &Key::new(devid, DEV_EXTENT_KEY, u64::MAX),
    )? {
        let len = u64::from_le_bytes(
            d[24..32].try_into().expect("dev extent size checked by the tree checker"),
        );
        if k.offset.checked_add(len).is_none() {
            return Err(Corrupt::new(
                CorruptWhere::Item,
                format!(
                    "dev extent at {} of length {len} runs past the end of the address space",
                    k.offset
                ),
            )
            .root(DEV_TREE_OBJECTID)
            .key(k)
            .into());
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
    Ok(used)
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

/// What a profile asks of chunk allocation (the kernel's `btrfs_raid_array` entry).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RaidAttr {
    /// Stripes of a chunk that hold one copy's data side by side (RAID10: 2).
    pub sub_stripes: u16,
    /// Stripes per device (DUP: 2).
    pub dev_stripes: usize,
    /// Most devices a chunk spans (0: all that have room).
    pub devs_max: usize,
    /// Fewest devices a chunk needs.
    pub devs_min: usize,
    /// The device count is rounded down to a multiple of this.
    pub devs_increment: usize,
    /// Copies of each byte.
    pub ncopies: usize,
    /// Devices a chunk may lose and stay whole.
    pub tolerated_failures: usize,
}

/// The attributes of `profile` (profile bits; 0 is SINGLE). RAID5/6 are not written.
pub fn raid_attr(profile: u64) -> Option<RaidAttr> {
    let a = |sub_stripes,
             dev_stripes,
             devs_max,
             devs_min,
             devs_increment,
             ncopies,
             tolerated_failures| RaidAttr {
        sub_stripes,
        dev_stripes,
        devs_max,
        devs_min,
        devs_increment,
        ncopies,
        tolerated_failures,
    };
    Some(match profile {
        0 => a(1, 1, 1, 1, 1, 1, 0),
        BLOCK_GROUP_DUP => a(1, 2, 1, 1, 1, 2, 0),
        BLOCK_GROUP_RAID0 => a(1, 1, 0, 1, 1, 1, 0),
        BLOCK_GROUP_RAID1 => a(1, 1, 2, 2, 2, 2, 1),
        BLOCK_GROUP_RAID1C3 => a(1, 1, 3, 3, 3, 3, 2),
        BLOCK_GROUP_RAID1C4 => a(1, 1, 4, 4, 4, 4, 3),
        BLOCK_GROUP_RAID10 => a(2, 1, 0, 2, 2, 2, 1),
        _ => return None,
    })
}

/// The profile new chunks of type `ty` get: the target set for the type
/// (`Transaction::set_alloc_profile`), else the most redundant profile the type's block
/// groups already use that the devices can hold (the kernel's
/// `btrfs_reduce_alloc_profile` over `avail_*_alloc_bits`), else SINGLE for data and
/// DUP (one device) or RAID1 (several) for metadata and system.
pub(crate) fn alloc_profile(w: &Transaction, ty: u64) -> u64 {
    let ty = w.alloc.space_type(ty);
    if let Some(&p) = w.alloc.target_profiles.get(&ty) {
        return p;
    }
    // Devices that can take stripes: the members present (a degraded writer has fewer).
    let ndevs = writable_devices(w).len();
    // Most redundant first, as the kernel prefers.
    const ORDER: [u64; 7] = [
        BLOCK_GROUP_RAID1C4,
        BLOCK_GROUP_RAID1C3,
        BLOCK_GROUP_RAID10,
        BLOCK_GROUP_RAID1,
        BLOCK_GROUP_DUP,
        BLOCK_GROUP_RAID0,
        0,
    ];
    let present = |p: u64| {
        w.alloc.groups.values().any(|g| {
            g.flags & BLOCK_GROUP_TYPE_MASK == ty && g.flags & BLOCK_GROUP_PROFILE_MASK == p
        })
    };
    if let Some(p) =
        ORDER.into_iter().find(|&p| present(p) && raid_attr(p).is_some_and(|a| a.devs_min <= ndevs))
    {
        return p;
    }
    if w.alloc.groups.values().any(|g| g.flags & BLOCK_GROUP_TYPE_MASK == ty) {
        // The type's profiles need more devices than are present (a degraded
        // writer): SINGLE, as the kernel reduces to.
        return 0;
    }
    match (ty, ndevs) {
        (t, _) if t & BLOCK_GROUP_DATA != 0 => 0,
        (_, 1) => BLOCK_GROUP_DUP,
        _ => BLOCK_GROUP_RAID1,
    }
}

impl Transaction {
    /// New chunks of type `ty` (DATA, METADATA or SYSTEM) get `profile` (profile bits, 0
    /// for SINGLE) from now on, as a balance's convert target or mkfs's `-d`/`-m` do.
    ///
    /// # Errors
    /// `Posix(Invalid)` for another type, a profile ubtrfs does not write (RAID5/6), or
    /// fewer devices than the profile needs (naming both counts).
    pub fn set_alloc_profile(&mut self, ty: u64, profile: u64) -> Result<()> {
        let name = || block_group_flags_str(ty | profile);
        if ![BLOCK_GROUP_DATA, BLOCK_GROUP_METADATA, BLOCK_GROUP_SYSTEM].contains(&ty) {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                name(),
                "not one block group type",
            ));
        }
        let attr = raid_attr(profile).ok_or_else(|| {
            Error::posix_detail(
                PosixKind::Invalid,
                name(),
                "this profile is not supported for writing",
            )
        })?;
        let ndevs = writable_devices(self).len();
        if ndevs < attr.devs_min {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                name(),
                format!(
                    "the profile needs at least {} devices, the filesystem has {ndevs}",
                    attr.devs_min
                ),
            ));
        }
        let ty = self.alloc.space_type(ty);
        self.alloc.target_profiles.insert(ty, profile);
        Ok(())
    }
}

impl Transaction {
    /// New chunks of type `ty` are at most `bytes` long (at least 1 MiB), below the
    /// kernel's limits: `mkfs --shrink` keeps the last chunk's unused tail small.
    ///
    /// # Errors
    /// `Posix(Invalid)` for another type or less than 1 MiB.
    pub fn set_max_chunk_size(&mut self, ty: u64, bytes: u64) -> Result<()> {
        if ![BLOCK_GROUP_DATA, BLOCK_GROUP_METADATA, BLOCK_GROUP_SYSTEM].contains(&ty)
            || bytes < MIB
        {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("chunk size {bytes} for {}", block_group_flags_str(ty)),
                "one block group type, at least 1 MiB",
            ));
        }
        let ty = self.alloc.space_type(ty);
        self.alloc.chunk_caps.insert(ty, bytes / STRIPE_LEN * STRIPE_LEN);
        Ok(())
    }

    /// New chunks follow the kernel's sizes again (`set_max_chunk_size` undone).
    pub fn clear_max_chunk_sizes(&mut self) {
        self.alloc.chunk_caps.clear();
    }

    /// The end of the last dev extent on device `devid`: the least size it can have.
    ///
    /// # Errors
    /// Read failures.
    pub fn device_used_end(&mut self, devid: u64) -> Result<u64> {
        Ok(dev_extents(self, devid)?.into_iter().map(|(s, l)| s + l).fold(MIB, u64::max))
    }

    /// Make device `devid` hold `bytes` (its DEV_ITEM's total_bytes, the superblock's
    /// total), as `btrfs filesystem resize` does; shrinking needs no dev extent past
    /// the new end (nothing is relocated).
    ///
    /// # Errors
    /// `Posix(NotFound)` for an unknown device; `Posix(Busy)` when a dev extent lies
    /// past `bytes`; `Posix(Invalid)` past the device's end or below 1 MiB; tree
    /// failures.
    pub fn set_device_size(&mut self, devid: u64, bytes: u64) -> Result<()> {
        self.check_writable()?;
        let what = || format!("device {devid}");
        let d = *self
            .alloc
            .dev_items
            .get(&devid)
            .ok_or_else(|| Error::posix(PosixKind::NotFound, what()))?;
        let ss = u64::from(self.sectorsize());
        let bytes = bytes / ss * ss;
        if bytes < MIB {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                what(),
                format!("{bytes} bytes is below the 1 MiB every device keeps"),
            ));
        }
        if let Ok(dev) = self.info.devices.get(devid) {
            if bytes > dev.dev.size() {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    what(),
                    format!("{bytes} bytes is more than the device's {}", dev.dev.size()),
                ));
            }
        }
        let end = self.device_used_end(devid)?;
        if end > bytes {
            return Err(Error::posix_detail(
                PosixKind::Busy,
                what(),
                format!("its chunks reach {end}, past {bytes}"),
            ));
        }
        let old = d.total_bytes.get();
        self.transaction("set_device_size", 1, |w| {
            let item = w.alloc.dev_items.get_mut(&devid).expect("checked above");
            item.total_bytes = bytes.into();
            let item = *item;
            let (leaf, slot) = w
                .lookup_for_update(
                    CHUNK_TREE_OBJECTID,
                    &Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
                    0,
                )?
                .ok_or_else(|| {
                    Error::from(
                        Corrupt::new(CorruptWhere::Item, format!("device {devid} has no DEV_ITEM"))
                            .root(CHUNK_TREE_OBJECTID),
                    )
                })?;
            w.item_data_mut(leaf, slot).copy_from_slice(item.as_bytes());
            let total = w.sb.total_bytes.get() - old + bytes;
            w.sb.total_bytes = total.into();
            Ok(())
        })
    }
}

/// The device items of the members present: those new stripes may go to.
fn writable_devices(w: &Transaction) -> Vec<u64> {
    w.alloc.dev_items.keys().copied().filter(|d| w.info.devices.by_id.contains_key(d)).collect()
}

/// With member devices missing (a degraded writer), every chunk must keep a whole copy
/// on the devices present (the kernel's `btrfs_check_rw_degradable`).
///
/// # Errors
/// `Incompatible` naming the first chunk that lost more stripes than its profile
/// tolerates.
pub(crate) fn check_rw_degradable(w: &Transaction) -> Result<()> {
    for c in w.info.chunk_map.iter() {
        let lost = c.stripes.iter().filter(|s| !w.info.devices.by_id.contains_key(&s.0)).count();
        let tolerated = raid_attr(c.profile()).map(|a| a.tolerated_failures).unwrap_or(0);
        if lost > tolerated {
            let missing: Vec<u64> = c
                .stripes
                .iter()
                .map(|s| s.0)
                .filter(|d| !w.info.devices.by_id.contains_key(d))
                .collect();
            return Err(Error::Incompatible(format!(
                "cannot write degraded: chunk {} ({}) has {lost} stripes on missing devices {missing:?}, and its profile keeps its data through {tolerated}",
                c.logical,
                block_group_flags_str(c.type_)
            )));
        }
    }
    Ok(())
}

/// One device's room for a stripe: its largest hole (64 KiB aligned, at most `want`),
/// where that hole starts, and its unallocated bytes in all.
#[derive(Clone, Copy, Debug)]
struct DevRoom {
    devid: u64,
    uuid: [u8; 16],
    max_avail: u64,
    start: u64,
    total_avail: u64,
}

pub(crate) fn alloc_chunk_in(w: &mut Transaction, ty: u64) -> Result<()> {
    #[cfg(feature = "test-hooks")]
    if w.hooks.refuse_chunk_alloc {
        return Err(Error::posix(
            PosixKind::NoSpace,
            format!("no room for a new {} chunk (test switch)", block_group_flags_str(ty)),
        ));
    }
    let ty = w.alloc.space_type(ty);
    let profile = alloc_profile(w, ty);
    let flags = ty | profile;
    let what = block_group_flags_str(flags);
    let attr = raid_attr(profile).ok_or_else(|| {
        Error::Incompatible(format!(
            "cannot allocate a {what} chunk: the profile is not supported for writing"
        ))
    })?;
    let fs_total = w.sb.total_bytes.get();
    // Chunk and stripe size limits (`init_alloc_chunk_ctl_policy_regular`): a chunk is
    // at most a tenth of the filesystem; data stripes at most 1 GiB (chunks 10 GiB),
    // metadata 256 MiB (1 GiB past 50 GiB), system 32 MiB.
    let (max_stripe, max_chunk) = match ty {
        // Mixed groups take data's limits, as the kernel's DATA bit decides.
        t if t & BLOCK_GROUP_DATA != 0 => (1 << 30, 10 << 30),
        BLOCK_GROUP_SYSTEM => (32 * MIB, 32 * MIB),
        _ if fs_total > 50 << 30 => (1 << 30, 1 << 30),
        _ => (256 * MIB, 256 * MIB),
    };
    let mut max_chunk = max_chunk.min(fs_total / 10).max(4 * MIB);
    if let Some(&cap) = w.alloc.chunk_caps.get(&ty) {
        max_chunk = max_chunk.min(cap);
    }
    let max_stripe = max_stripe.min(max_chunk);
    // Every device with a hole of at least one stripe length per device stripe.
    let devids: Vec<(u64, [u8; 16], u64, u64)> = writable_devices(w)
        .into_iter()
        .map(|id| (id, &w.alloc.dev_items[&id]))
        .map(|(id, d)| (id, d.uuid, d.bytes_used.get(), d.total_bytes.get()))
        .collect();
    let mut rooms: Vec<DevRoom> = Vec::with_capacity(devids.len());
    let mut dup_holes = Vec::new();
    for &(devid, uuid, used, total) in &devids {
        let holes = dev_holes(w, devid, total)?;
        let want = max_stripe.min(max_chunk) / STRIPE_LEN * STRIPE_LEN * attr.dev_stripes as u64;
        let best = holes.iter().map(|&(s, l)| {
            let a = s.div_ceil(STRIPE_LEN).saturating_mul(STRIPE_LEN);
            (a, (s + l).saturating_sub(a) / STRIPE_LEN * STRIPE_LEN)
        });
        // The lowest hole that holds the whole want, else the largest.
        let pick = best
            .clone()
            .find(|&(_, l)| l >= want)
            .or_else(|| best.max_by_key(|&(a, l)| (l, std::cmp::Reverse(a))));
        let Some((start, len)) = pick else { continue };
        if len < STRIPE_LEN * attr.dev_stripes as u64 {
            continue;
        }
        rooms.push(DevRoom {
            devid,
            uuid,
            max_avail: len.min(want),
            start,
            total_avail: total.saturating_sub(used),
        });
        if attr.dev_stripes == 2 {
            dup_holes = holes;
        }
    }
    // Most room first (`btrfs_cmp_device_info`), then by devid for a stable order.
    rooms.sort_by_key(|r| {
        (std::cmp::Reverse(r.max_avail), std::cmp::Reverse(r.total_avail), r.devid)
    });
    let mut ndevs = rooms.len();
    if attr.devs_max != 0 {
        ndevs = ndevs.min(attr.devs_max);
    }
    ndevs -= ndevs % attr.devs_increment;
    if ndevs < attr.devs_min {
        let with_room = rooms.len();
        return Err(Error::posix(
            PosixKind::NoSpace,
            if attr.devs_min > 1 {
                format!("no room for a new {what} chunk: it needs {} devices with free space, {with_room} of {} have any", attr.devs_min, devids.len())
            } else {
                format!(
                    "device {} has no room for a new {what} chunk",
                    devids.first().map(|d| d.0).unwrap_or(0)
                )
            },
        ));
    }
    let chosen = &rooms[..ndevs];
    let num_stripes = ndevs * attr.dev_stripes;
    let data_stripes = (num_stripes / attr.ncopies) as u64;
    let mut stripe;
    let mut offsets: Vec<(u64, u64, [u8; 16])> = Vec::with_capacity(num_stripes);
    if attr.dev_stripes == 2 {
        // DUP: both stripes on the one device, in one hole or the two largest.
        let r = chosen[0];
        stripe = (max_chunk / data_stripes).min(max_stripe) / STRIPE_LEN * STRIPE_LEN;
        let mut sorted: Vec<u64> =
            dup_holes.iter().map(|h| h.1 / STRIPE_LEN * STRIPE_LEN).collect();
        sorted.sort_by_key(|&l| std::cmp::Reverse(l));
        let best_two = if sorted.len() >= 2 {
            sorted[1].max(sorted[0] / 2)
        } else {
            sorted.first().copied().unwrap_or(0) / 2
        };
        stripe = stripe.min(best_two / STRIPE_LEN * STRIPE_LEN);
        if stripe < MIB {
            return Err(Error::posix(
                PosixKind::NoSpace,
                format!("device {} has no room for a new {what} chunk", r.devid),
            ));
        }
        for &(s, l) in &dup_holes {
            // Holes end at most at the device's total_bytes, which a crafted device
            // item may put at the top of the address space.
            let Some(mut p) = s.div_ceil(STRIPE_LEN).checked_mul(STRIPE_LEN) else { continue };
            while offsets.len() < 2 && p.checked_add(stripe).is_some_and(|e| e <= s + l) {
                offsets.push((r.devid, p, r.uuid));
                p += stripe;
            }
            if offsets.len() == 2 {
                break;
            }
        }
        if offsets.len() < 2 {
            return Err(Error::posix(
                PosixKind::NoSpace,
                format!("device {} has no room for a new {what} chunk", r.devid),
            ));
        }
    } else {
        // The smallest room among the chosen devices (`decide_stripe_size_regular`),
        // within the chunk size limit.
        stripe = chosen.iter().map(|r| r.max_avail).min().expect("ndevs >= devs_min >= 1");
        stripe = stripe.min((max_chunk / data_stripes).min(max_stripe)) / STRIPE_LEN * STRIPE_LEN;
        if stripe < MIB {
            return Err(Error::posix(
                PosixKind::NoSpace,
                format!(
                    "no room for a new {what} chunk: the devices with the most room have {} bytes",
                    chosen.iter().map(|r| r.max_avail).min().unwrap_or(0)
                ),
            ));
        }
        for r in chosen {
            offsets.push((r.devid, r.start, r.uuid));
        }
    }
    let length = stripe * data_stripes;
    // Chunks were checked not to overflow when read (`check_chunk`).
    let logical = w
        .info
        .chunk_map
        .iter()
        .map(|c| c.logical + c.length)
        .max()
        .unwrap_or(MIB)
        .div_ceil(STRIPE_LEN)
        .checked_mul(STRIPE_LEN)
        .filter(|l| l.checked_add(length).is_some());
    let Some(logical) = logical else {
        return Err(Error::posix(
            PosixKind::NoSpace,
            format!("no logical address space left for a new {what} chunk"),
        ));
    };
    // The device items' new usage, before anything changes: a device item whose sizes
    // sit at the top of the address space cannot take another chunk.
    let mut new_used: Vec<(u64, u64)> = Vec::with_capacity(ndevs);
    for r in chosen {
        let d = &w.alloc.dev_items[&r.devid];
        let add = stripe * attr.dev_stripes as u64;
        let used = d.bytes_used.get().checked_add(add).ok_or_else(|| {
            Error::from(
                Corrupt::new(
                    CorruptWhere::Item,
                    format!(
                        "device {} bytes used {} + {add} overflows",
                        r.devid,
                        d.bytes_used.get()
                    ),
                )
                .root(CHUNK_TREE_OBJECTID)
                .key(Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, r.devid)),
            )
        })?;
        new_used.push((r.devid, used));
    }
    let map = MapLookup {
        logical,
        length,
        type_: flags,
        stripe_len: STRIPE_LEN,
        sub_stripes: attr.sub_stripes,
        stripes: offsets,
    };
    debug_assert!(
        map.stripes.iter().all(|&(_, o, _)| o >= MIB && o.is_multiple_of(STRIPE_LEN)),
        "stripes of {map:?}"
    );
    w.info.chunk_map.insert(map.clone())?;
    crate::space::allocator::add_new_block_group(w, logical, length, flags)?;
    for (devid, used) in new_used {
        w.alloc.dev_items.get_mut(&devid).expect("device listed above").bytes_used = used.into();
    }
    if ty == BLOCK_GROUP_SYSTEM {
        let mut arr = w.sb.sys_chunk_array[..w.sb.sys_chunk_array_size.get() as usize].to_vec();
        arr.extend_from_slice(
            Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, logical).to_disk().as_bytes(),
        );
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
pub(crate) fn insert_pending_chunks(w: &mut Transaction) -> Result<bool> {
    if w.pending_chunks.is_empty() {
        return Ok(false);
    }
    let ss = w.sectorsize();
    // Each chunk stays in `pending_chunks` until its dev extents are in the dev tree: a
    // tree block allocated while inserting them may need a chunk of its own, and
    // `dev_holes` must still see this one's stripes.
    while let Some(p) = w.pending_chunks.first().cloned() {
        let m = &p.map;
        w.insert_item(
            CHUNK_TREE_OBJECTID,
            &Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, m.logical),
            &chunk_item_bytes(m, ss),
        )?;
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
        let body = BlockGroupItem {
            used: g.used.into(),
            chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(),
            flags: g.flags.into(),
        };
        w.insert_item(tree, &Key::new(m.logical, BLOCK_GROUP_ITEM_KEY, m.length), body.as_bytes())?;
        crate::space::free_space_tree::add_block_group_free_space_in(w, m.logical)?;
        let pos = w
            .pending_chunks
            .iter()
            .position(|q| q.map.logical == m.logical)
            .expect("pending chunk still listed");
        w.pending_chunks.remove(pos);
    }
    // Device items: bytes_used changed.
    let devs: Vec<(u64, DevItem)> = w.alloc.dev_items.iter().map(|(k, v)| (*k, *v)).collect();
    for (devid, d) in devs {
        if let Some((leaf, slot)) = w.lookup_for_update(
            CHUNK_TREE_OBJECTID,
            &Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
            0,
        )? {
            w.item_data_mut(leaf, slot).copy_from_slice(d.as_bytes());
        }
    }
    Ok(true)
}
