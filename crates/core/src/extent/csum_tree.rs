//! The csum tree (7): per-sector data checksums in EXTENT_CSUM items keyed by the
//! logical address of their first sector. Adding extends a preceding item that ends
//! exactly where the new run starts; deleting trims, splits or removes items.
//!
//! Invariant: items never overlap; each covers `size / csum_size` sectors.

use crate::error::Result;
use crate::transaction::Transaction;
use ubtrfs_format::csum::CsumType;
use ubtrfs_format::key::*;
use ubtrfs_format::node::{HEADER_SIZE, ITEM_SIZE};
use ubtrfs_format::Key;

const CSUM: u64 = CSUM_TREE_OBJECTID;

impl Transaction {
    /// Largest csum item, in bytes (a whole number of checksums).
    fn max_csum_item(&self) -> usize {
        let cs = self.info.csum_type.size();
        ((self.nodesize() as usize - HEADER_SIZE - 2 * ITEM_SIZE) / 2 / cs) * cs
    }
}

fn key(logical: u64) -> Key {
    Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical)
}

/// Existing checksums where new ones go: the csum tree covers space the allocator
/// believed free, which only a damaged image can cause.
fn overlap(k: &Key, logical: u64) -> crate::error::Error {
    ubtrfs_format::Corrupt::new(
        ubtrfs_format::CorruptWhere::Item,
        format!("csum item {k} overlaps new checksums at logical {logical}"),
    )
    .root(CSUM)
    .into()
}

/// Add checksums for the sectors starting at `logical` (`csums` = packed, csum_size each).
///
/// # Errors
/// Tree modification failures.
/// Append the checksum of each `sectorsize` piece of `data` to `out`: the body of
/// EXTENT_CSUM items, one checksum per data sector.
pub(crate) fn append_sector_csums(t: CsumType, sectorsize: usize, data: &[u8], out: &mut Vec<u8>) {
    let cs = t.size();
    for s in data.chunks(sectorsize) {
        out.extend_from_slice(&t.compute(s)[..cs]);
    }
}

pub(crate) fn insert_csums(w: &mut Transaction, mut logical: u64, mut csums: &[u8]) -> Result<()> {
    let cs = w.info.csum_type.size();
    let ss = u64::from(w.sectorsize());
    assert!(csums.len().is_multiple_of(cs), "csum bytes {} not a multiple of {cs}", csums.len());
    let max = w.max_csum_item();
    while !csums.is_empty() {
        // Extend the item that ends exactly at `logical`, if it has room.
        if let Some((k, d)) = w.last_item_le(CSUM, &key(logical))? {
            if k.objectid == EXTENT_CSUM_OBJECTID && k.type_ == EXTENT_CSUM_KEY {
                let end = k.offset + (d.len() / cs) as u64 * ss;
                if end > logical {
                    return Err(overlap(&k, logical));
                }
                if end == logical && d.len() < max {
                    let n = (max - d.len()).min(csums.len());
                    let (leaf, slot) = w.extend_item(CSUM, &k, n)?;
                    let data = w.item_data_mut(leaf, slot);
                    let l = data.len();
                    data[l - n..].copy_from_slice(&csums[..n]);
                    logical += (n / cs) as u64 * ss;
                    csums = &csums[n..];
                    continue;
                }
            }
        }
        let n = csums.len().min(max);
        // Do not run into the next item.
        let croot = w.root(CSUM)?;
        let n = match w.first_item_ge(&croot, &key(logical))? {
            Some((k, _)) if k.objectid == EXTENT_CSUM_OBJECTID && k.type_ == EXTENT_CSUM_KEY => {
                if k.offset <= logical {
                    return Err(overlap(&k, logical));
                }
                n.min(((k.offset - logical) / ss) as usize * cs)
            }
            _ => n,
        };
        w.insert_item(CSUM, &key(logical), &csums[..n])?;
        logical += (n / cs) as u64 * ss;
        csums = &csums[n..];
    }
    Ok(())
}

/// Remove checksums of [logical, logical + len).
///
/// # Errors
/// Tree modification failures.
pub(crate) fn del_csums(w: &mut Transaction, logical: u64, len: u64) -> Result<()> {
    let cs = w.info.csum_type.size();
    let ss = u64::from(w.sectorsize());
    let end = logical + len;
    loop {
        // The last item starting before `end`.
        let Some((k, d)) = w.last_item_le(CSUM, &key(end - 1))? else { return Ok(()) };
        if k.objectid != EXTENT_CSUM_OBJECTID || k.type_ != EXTENT_CSUM_KEY {
            return Ok(());
        }
        let istart = k.offset;
        let iend = istart + (d.len() / cs) as u64 * ss;
        if iend <= logical {
            return Ok(());
        }
        w.delete_item(CSUM, &k)?;
        if iend > end {
            let off = ((end - istart) / ss) as usize * cs;
            w.insert_item(CSUM, &key(end), &d[off..])?;
        }
        if istart < logical {
            let n = ((logical - istart) / ss) as usize * cs;
            w.insert_item(CSUM, &key(istart), &d[..n])?;
            return Ok(());
        }
    }
}
