//! Devices and chunks: the map from logical addresses to (devid, physical) stripes for
//! every profile the read engine supports (SINGLE, DUP, RAID0, RAID1, RAID1C3, RAID1C4,
//! RAID10). RAID5/6 refuse by name at open (feature bit RAID56).
//!
//! Invariants: chunks never overlap in logical space; every chunk's stripe count is
//! valid for its profile (checked by the tree checker before insertion).

pub mod dev_replace;
pub mod device;
pub mod device_lock;
#[cfg(feature = "test-hooks")]
pub mod fault;
pub mod mountinfo;

use crate::error::{Error, Result};
use crate::ids::Logical;
use crate::volumes::device::BlockDevice;
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use ubtrfs_format::items::ChunkView;
use ubtrfs_format::structs::*;
use ubtrfs_format::{Corrupt, CorruptWhere};

/// One chunk in CPU form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapLookup {
    pub logical: u64,
    pub length: u64,
    pub type_: u64,
    pub stripe_len: u64,
    pub sub_stripes: u16,
    /// (devid, physical offset, device uuid).
    pub stripes: Vec<(u64, u64, [u8; 16])>,
}

impl MapLookup {
    pub fn from_view(logical: u64, c: &ChunkView) -> MapLookup {
        MapLookup {
            logical,
            length: c.length,
            type_: c.type_,
            stripe_len: c.stripe_len,
            sub_stripes: c.sub_stripes,
            stripes: c.stripes.clone(),
        }
    }

    pub fn profile(&self) -> u64 {
        self.type_ & BLOCK_GROUP_PROFILE_MASK
    }

    /// How many independent copies each byte has.
    pub fn num_copies(&self) -> usize {
        match self.profile() {
            BLOCK_GROUP_DUP | BLOCK_GROUP_RAID1 | BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID1C4 => {
                self.stripes.len()
            }
            BLOCK_GROUP_RAID10 => usize::from(self.sub_stripes.max(1)),
            _ => 1,
        }
    }

    /// Map `logical` (inside this chunk) for copy `mirror`: returns (stripe index,
    /// physical offset, bytes contiguous from there within this chunk).
    pub fn map(&self, logical: u64, mirror: usize) -> (usize, u64, u64) {
        assert!(
            logical >= self.logical && logical < self.logical + self.length,
            "logical {logical} outside chunk {} +{}",
            self.logical,
            self.length
        );
        assert!(mirror < self.num_copies(), "mirror {mirror} >= copies {}", self.num_copies());
        let off = logical - self.logical;
        let to_end = self.length - off;
        match self.profile() {
            BLOCK_GROUP_RAID0 | BLOCK_GROUP_RAID10 => {
                let sl = self.stripe_len;
                let stripe_nr = off / sl;
                let stripe_off = off % sl;
                let (index, row) = if self.profile() == BLOCK_GROUP_RAID0 {
                    let n = self.stripes.len() as u64;
                    ((stripe_nr % n) as usize, stripe_nr / n)
                } else {
                    let sub = u64::from(self.sub_stripes.max(1));
                    let factor = self.stripes.len() as u64 / sub;
                    (((stripe_nr % factor) * sub) as usize + mirror, stripe_nr / factor)
                };
                let phys = self.stripes[index].1 + row * sl + stripe_off;
                (index, phys, (sl - stripe_off).min(to_end))
            }
            _ => {
                let index = mirror;
                (index, self.stripes[index].1 + off, to_end)
            }
        }
    }
}

/// The logical address space: every chunk, by start (the kernel's `mapping_tree`).
/// Shared: new chunks are inserted while readers map addresses (a leaf lock, held for
/// one lookup or insert).
#[derive(Default)]
pub struct ChunkMap {
    chunks: RwLock<BTreeMap<u64, Arc<MapLookup>>>,
}

impl ChunkMap {
    /// Add a chunk; overlapping an existing different chunk is corruption.
    ///
    /// # Errors
    /// `Corrupt` naming both chunks.
    pub fn insert(&self, m: MapLookup) -> Result<()> {
        let mut chunks = self.chunks.write().unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = chunks.get(&m.logical) {
            if **existing == m {
                return Ok(());
            }
        }
        let end = m.logical + m.length;
        if let Some((_, prev)) = chunks.range(..end).next_back() {
            if prev.logical + prev.length > m.logical && prev.logical != m.logical {
                return Err(Corrupt::new(
                    CorruptWhere::Item,
                    format!(
                        "chunk {} +{} overlaps chunk {} +{}",
                        m.logical, m.length, prev.logical, prev.length
                    ),
                )
                .root(3)
                .into());
            }
            if prev.logical == m.logical {
                return Err(Corrupt::new(
                    CorruptWhere::Item,
                    format!("two different chunks at logical {}", m.logical),
                )
                .root(3)
                .into());
            }
        }
        chunks.insert(m.logical, Arc::new(m));
        Ok(())
    }

    /// The chunk containing `logical`.
    ///
    /// # Errors
    /// `Corrupt` when no chunk maps the address.
    pub fn lookup(&self, logical: Logical) -> Result<Arc<MapLookup>> {
        let Logical(logical) = logical;
        let chunks = self.chunks.read().unwrap_or_else(|p| p.into_inner());
        match chunks.range(..=logical).next_back() {
            Some((_, m)) if logical < m.logical + m.length => Ok(m.clone()),
            _ => Err(Corrupt::new(
                CorruptWhere::Item,
                format!("no chunk maps logical address {logical}"),
            )
            .into()),
        }
    }

    /// Every chunk, by start, as the map holds them now.
    pub fn iter(&self) -> std::vec::IntoIter<Arc<MapLookup>> {
        self.chunks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect::<Vec<_>>()
            .into_iter()
    }
    pub fn len(&self) -> usize {
        self.chunks.read().unwrap_or_else(|p| p.into_inner()).len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One opened device of the filesystem.
pub struct Device {
    pub devid: u64,
    pub uuid: [u8; 16],
    pub dev: Arc<dyn BlockDevice>,
    /// The generation of the superblock read from this device at open.
    pub sb_generation: u64,
}

/// The devices of one filesystem, by devid.
#[derive(Default)]
pub struct Devices {
    /// The members: one per DEV_ITEM of the chunk tree given (num_devices counts them).
    pub by_id: BTreeMap<u64, Device>,
    /// The target of a device replace (devid 0), when given: not a member.
    pub replace_target: Option<Device>,
    /// While a replace is in progress, the source devid and its `cursor_left`: below
    /// it the target holds the source's stripes at the same physical offsets.
    pub replace_copied: Option<(u64, u64)>,
}

impl Devices {
    /// Find the device for `devid`.
    ///
    /// # Errors
    /// `Io` (NotFound) naming the missing devid: the caller may try another copy.
    pub fn get(&self, devid: u64) -> Result<&Device> {
        self.by_id.get(&devid).ok_or_else(|| {
            Error::io(
                format!("device {devid} is missing (pass it with --device)"),
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )
        })
    }

    /// The device to read `len` bytes at `phys` of member `devid` from: the member,
    /// or, when it is missing and is the source of a replace in progress, the replace
    /// target if the range lies below the cursor (btrfs_map_block's extra mirror from
    /// the replace target).
    ///
    /// # Errors
    /// As `get`.
    pub fn reader(&self, devid: u64, phys: u64, len: u64) -> Result<&Device> {
        if let (None, Some((src, left)), Some(t)) =
            (self.by_id.get(&devid), self.replace_copied, &self.replace_target)
        {
            if src == devid && phys.checked_add(len).is_some_and(|end| end <= left) {
                return Ok(t);
            }
        }
        self.get(devid)
    }
}

/// Read `buf.len()` bytes at `logical` from copy `mirror`, splitting at stripe edges.
///
/// # Errors
/// `Corrupt` for unmapped addresses, `Io` for device failures or missing devices.
pub fn read_logical(
    map: &ChunkMap,
    devs: &Devices,
    logical: Logical,
    buf: &mut [u8],
    mirror: usize,
) -> Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        let cur = logical.0 + done as u64;
        let chunk = map.lookup(Logical(cur))?;
        let m = mirror.min(chunk.num_copies() - 1);
        let (index, phys, contig) = chunk.map(cur, m);
        let n = ((buf.len() - done) as u64).min(contig) as usize;
        let (devid, _, _) = chunk.stripes[index];
        devs.reader(devid, phys, n as u64)?.dev.read_at(&mut buf[done..done + n], phys)?;
        done += n;
    }
    Ok(())
}

/// How `write_logical` writes: tree blocks through the cache like any metadata, or
/// bulk file data bypassing it where the device allows (with early writeback).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteKind {
    Metadata,
    Data,
}

/// Write `buf` at `logical` to every copy, splitting at stripe edges.
///
/// # Errors
/// `Corrupt` for unmapped addresses, `Io` for device failures or missing devices.
pub fn write_logical(
    map: &ChunkMap,
    devs: &Devices,
    logical: u64,
    buf: &[u8],
    kind: WriteKind,
) -> Result<()> {
    // The writer refuses a filesystem with a replace in progress: a write here would
    // miss the target's copy below the cursor.
    assert!(
        devs.replace_copied.is_none(),
        "write at logical {logical} with a device replace in progress ({:?})",
        devs.replace_copied
    );
    let chunk = map.lookup(Logical(logical))?.clone();
    for mirror in 0..chunk.num_copies() {
        let mut done = 0usize;
        while done < buf.len() {
            let cur = logical + done as u64;
            let c = map.lookup(Logical(cur))?;
            let (index, phys, contig) = c.map(cur, mirror.min(c.num_copies() - 1));
            let n = ((buf.len() - done) as u64).min(contig) as usize;
            let devid = c.stripes[index].0;
            if !devs.by_id.contains_key(&devid) {
                // A degraded writer: this copy's device is missing. The writer made
                // sure every chunk keeps a whole copy on the devices present
                // (`check_rw_degradable`); a range no copy of which can be written
                // is an error.
                let any = (0..c.num_copies())
                    .any(|m| devs.by_id.contains_key(&c.stripes[c.map(cur, m).0].0));
                if !any {
                    devs.get(devid)?;
                }
                done += n;
                continue;
            }
            let dev = &devs.get(devid)?.dev;
            match kind {
                WriteKind::Metadata => dev.write_at(&buf[done..done + n], phys)?,
                WriteKind::Data => {
                    dev.write_data_at(&buf[done..done + n], phys)?;
                    dev.start_writeback(phys, n as u64);
                }
            }
            done += n;
        }
    }
    Ok(())
}

/// Number of copies at `logical` (1 if unmapped, so callers report the mapping error).
pub fn num_copies(map: &ChunkMap, logical: Logical) -> usize {
    map.lookup(logical).map(|c| c.num_copies()).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(profile: u64, n: usize, sub: u16) -> MapLookup {
        MapLookup {
            logical: 1 << 30,
            length: 4 * 64 * 1024 * n as u64,
            type_: BLOCK_GROUP_DATA | profile,
            stripe_len: 65536,
            sub_stripes: sub,
            stripes: (0..n).map(|i| (i as u64 + 1, (i as u64 + 1) << 20, [0; 16])).collect(),
        }
    }

    #[test]
    fn raid0_rotates_stripes() {
        let c = chunk(BLOCK_GROUP_RAID0, 2, 1);
        assert_eq!(c.map(1 << 30, 0), (0, 1 << 20, 65536));
        assert_eq!(c.map((1 << 30) + 65536 + 10, 0), (1, (2 << 20) + 10, 65526));
        assert_eq!(c.map((1 << 30) + 2 * 65536, 0), (0, (1 << 20) + 65536, 65536));
    }

    #[test]
    fn raid10_mirrors_within_pairs() {
        let c = chunk(BLOCK_GROUP_RAID10, 4, 2);
        assert_eq!(c.num_copies(), 2);
        assert_eq!(c.map(1 << 30, 0).0, 0);
        assert_eq!(c.map(1 << 30, 1).0, 1);
        assert_eq!(c.map((1 << 30) + 65536, 0).0, 2);
        assert_eq!(c.map((1 << 30) + 65536, 1).0, 3);
        assert_eq!(c.map((1 << 30) + 2 * 65536, 1), (1, (2 << 20) + 65536, 65536));
    }

    #[test]
    fn mirrored_profiles() {
        for (p, n) in [
            (BLOCK_GROUP_DUP, 2),
            (BLOCK_GROUP_RAID1, 2),
            (BLOCK_GROUP_RAID1C3, 3),
            (BLOCK_GROUP_RAID1C4, 4),
        ] {
            let c = chunk(p, n, 1);
            assert_eq!(c.num_copies(), n);
            for m in 0..n {
                assert_eq!(c.map((1 << 30) + 5, m), (m, ((m as u64 + 1) << 20) + 5, c.length - 5));
            }
        }
    }

    #[test]
    fn overlap_is_corrupt() {
        let m = ChunkMap::default();
        m.insert(chunk(0, 1, 1)).unwrap();
        let mut c2 = chunk(0, 1, 1);
        c2.logical += 4096;
        assert!(m.insert(c2).is_err());
        assert!(m.lookup(Logical(5)).is_err());
    }
}
