//! Pass 5: the csum tree. Items must not overlap, every csummed range must lie inside
//! an allocated data extent (`btrfs check` reports csums without an extent record), and
//! with `--check-data-csum` every sector is read from every copy and compared.
//! Coverage of file extents by csums is checked per inode in the inode pass, which
//! knows each inode's NODATASUM flag.

use super::codes::*;
use super::walk::State;
use super::{merge_ranges, ranges_str, uncovered, CheckOptions, Finding, Sink};
use ubtrfs_core::{Expect, FsInfo};
use ubtrfs_format::key::*;

/// Bytes of data read per request while verifying csums (bounds the buffer).
const VERIFY_CHUNK: u64 = 1 << 20;

/// The csummed logical ranges, merged.
pub(super) fn coverage(st: &State) -> Vec<(u64, u64)> {
    merge_ranges(st.csums.iter().map(|c| (c.start, c.end)).collect())
}

pub(super) fn check_csum_items(fs: &FsInfo, st: &State, opts: &CheckOptions, sink: &mut Sink) {
    let ct = CSUM_TREE_OBJECTID;
    let mut items: Vec<_> = st.csums.iter().collect();
    items.sort_by_key(|c| c.start);
    let mut prev_end = 0u64;
    for c in &items {
        if c.start < prev_end {
            sink.push(
                Finding::new(
                    CSUM_OVERLAP,
                    format!(
                        "csum item [{}, {}) overlaps the previous one ending at {prev_end}",
                        c.start, c.end
                    ),
                )
                .root(ct)
                .bytenr(c.start)
                .key(ubtrfs_format::Key::new(
                    EXTENT_CSUM_OBJECTID,
                    EXTENT_CSUM_KEY,
                    c.start,
                )),
            );
        }
        prev_end = prev_end.max(c.end);
    }
    let mut data: Vec<(u64, u64)> = st
        .extents
        .iter()
        .filter(|(_, r)| !r.is_tree)
        .map(|(&s, r)| (s, s.saturating_add(r.len)))
        .collect();
    data.extend(st.log_data.iter().map(|&(s, l)| (s, s.saturating_add(l))));
    let data_extents = merge_ranges(data);
    for (s, e) in coverage(st) {
        let orphan = uncovered(&data_extents, s, e);
        if !orphan.is_empty() {
            sink.push(
                Finding::new(
                    CSUM_ORPHAN,
                    format!("csums exist for ranges with no data extent: {}", ranges_str(&orphan)),
                )
                .root(ct)
                .bytenr(orphan[0].0),
            );
        }
    }
    if opts.check_data_csum {
        verify_data(fs, &items, sink);
    }
}

fn verify_data(fs: &FsInfo, items: &[&super::walk::CsumRec], sink: &mut Sink) {
    let ct = CSUM_TREE_OBJECTID;
    let s = u64::from(fs.sectorsize);
    let csize = fs.csum_type.size();
    for c in items {
        let Ok(eb) = fs.read_tree_block(c.leaf, &Expect::default()) else {
            continue;
        };
        let sums = eb.node().item_data(c.slot).to_vec();
        let copies = fs.num_copies(ubtrfs_core::Logical(c.start));
        let mut pos = c.start;
        while pos < c.end {
            let len = (c.end - pos).min(VERIFY_CHUNK);
            let mut buf = vec![0u8; len as usize];
            for mirror in 0..copies {
                if let Err(e) = fs.read_data(ubtrfs_core::Logical(pos), &mut buf, mirror) {
                    sink.push(
                        Finding::new(
                            DATA_UNREADABLE,
                            format!("copy {} of [{pos}, {}): {e}", mirror + 1, pos + len),
                        )
                        .root(ct)
                        .bytenr(pos),
                    );
                    continue;
                }
                for (k, sector) in buf.chunks(s as usize).enumerate() {
                    let at = pos.saturating_add(k as u64 * s);
                    let idx = ((at - c.start) / s) as usize * csize;
                    let Some(want) = sums.get(idx..idx + csize) else {
                        break;
                    };
                    if !fs.csum_type.verify(sector, want) {
                        sink.push(
                            Finding::new(
                                CSUM_MISMATCH,
                                format!(
                                    "copy {} of the data sector at {at} does not match its csum",
                                    mirror + 1
                                ),
                            )
                            .root(ct)
                            .bytenr(at),
                        );
                    }
                }
                sink.report.stats.data_bytes_verified += len;
            }
            pos += len;
        }
    }
}
