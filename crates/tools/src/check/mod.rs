//! The read-only checker (`ubtrfs check`): verifies every on-disk rule a writer must
//! keep, the way `btrfs check --readonly` does, and names each violation with a stable
//! code (`E0601 nlink-mismatch`) and the object it concerns.
//!
//! It runs in passes over an open `FsInfo`:
//! 1. `walk`: every tree reachable from the superblock (chunk, root, then every
//!    ROOT_ITEM, and the log tree for structure only), each block read once with the
//!    expectations its parent implies; collects chunks, devices, dev extents, block
//!    groups, extent items and backrefs, csum ranges, free-space items, and every real
//!    reference (parent pointer or file extent) to a tree block or data extent.
//! 2. `extents`: the extent tree against the real references (counts, backrefs,
//!    FULL_BACKREF, sizes, overlap, placement).
//! 3. `space`: block-group `used`, superblock `bytes_used`, chunks against block groups
//!    and dev extents, device `bytes_used`.
//! 4. `fst`: the free-space tree against the complement of the allocated extents.
//! 5. `csum`: csum items against data extents (and, on request, the data itself).
//! 6. `inodes`: per fs tree, in key order: links, names, dir sizes, nbytes, file
//!    extents, orphans, csum coverage of every file extent.
//! 7. `qgroup`: with quotas on, each qgroup's referenced/exclusive bytes against the
//!    extents its subvolumes reach.
//!
//! Invariants: the checker never writes; bad bytes become findings, never panics;
//! memory is proportional to the metadata (hash maps keyed by bytenr or inode), and
//! each tree block is read once in pass 1 (fs trees are iterated again per subvolume in
//! pass 6, through the node cache, because snapshots share leaves).
//! Neighbours: `disk_io` (validated reads), `ctree` (iteration), format's tree checker
//! (which runs at every read, so item bodies parse here without re-checking).

mod csum;
mod extents;
mod fst;
mod inodes;
pub(crate) mod qgroup;
mod space;
mod walk;

use std::fmt;
use ubtrfs_core::{FsInfo, Result};
use ubtrfs_format::Key;

/// What to check beyond the metadata.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// Read every data sector that has a csum and verify it (every copy).
    pub check_data_csum: bool,
    /// Stop recording findings after this many (the count still grows), so a badly
    /// damaged image cannot exhaust memory with messages.
    pub max_findings: usize,
}

impl Default for CheckOptions {
    fn default() -> CheckOptions {
        CheckOptions { check_data_csum: false, max_findings: 10_000 }
    }
}

/// A finding's stable identity: numeric id (grouped by area) and kebab-case name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Code {
    pub id: u16,
    pub name: &'static str,
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "E{:04} {}", self.id, self.name)
    }
}

/// Every finding the checker can report. Ids never change meaning; new checks get new
/// ids. 01xx trees, 02xx extent refs, 03xx space accounting, 04xx free-space tree,
/// 05xx csums, 06xx inodes and subvolumes, 07xx quota groups.
pub mod codes {
    use super::Code;

    macro_rules! codes {
        ($($c:ident = $id:literal $name:literal: $desc:literal;)*) => {
            $(#[doc = $desc] pub const $c: Code = Code { id: $id, name: $name };)*
            /// Every code with its one-line description, in id order.
            pub const ALL: &[(Code, &str)] = &[$(($c, $desc)),*];
        };
    }

    codes! {
        TREE_BLOCK_INVALID = 101 "tree-block-invalid": "a tree block fails to read or validate (checksum, header, items)";
        LEVEL_MISMATCH = 102 "level-mismatch": "a block's level is not its parent's level minus one, or not the root item's level";
        KEY_ORDER = 103 "key-order": "keys do not increase across blocks (a child's keys reach its parent's next key)";
        GENERATION_MISMATCH = 104 "generation-mismatch": "a block's generation differs from its parent pointer, root item or superblock";
        GENERATION_TOO_NEW = 105 "generation-too-new": "a block's generation is newer than the superblock generation";
        CROSSING_STRIPE = 106 "crossing-stripe": "a tree block crosses a 64 KiB stripe boundary";
        BLOCK_WRONG_CHUNK = 107 "block-wrong-chunk": "a tree block is not inside a METADATA (or, for the chunk tree, SYSTEM) chunk";
        BLOCK_MULTIPLY_REFERENCED = 108 "block-multiply-referenced": "a tree block is referenced twice by the same owner";
        ITEM_WRONG_TREE = 109 "item-wrong-tree": "an item type appears in a tree that never holds it";
        EMPTY_LEAF = 110 "empty-leaf": "an empty leaf that is not a tree root";
        FIRST_KEY_MISMATCH = 111 "first-key-mismatch": "a block's first key differs from its parent pointer key";
        OWNER_MISMATCH = 112 "owner-mismatch": "a block's owner is not the tree that references it";
        ROOT_MISSING = 113 "root-missing": "a required tree (extent, dev, fs, csum, ...) has no root item";

        EXTENT_ITEM_MISSING = 201 "extent-item-missing": "a referenced tree block or data extent has no extent item";
        EXTENT_KIND_MISMATCH = 202 "extent-kind-mismatch": "an extent item's kind (data/tree block) or level disagrees with its references";
        EXTENT_REFS_MISMATCH = 203 "extent-refs-mismatch": "an extent item's refs count differs from the references found";
        BACKREF_MISSING = 205 "backref-missing": "a reference has no matching backref in the extent tree";
        BACKREF_UNMATCHED = 206 "backref-unmatched": "a backref in the extent tree matches no reference";
        OWNER_REF_MISSING = 207 "owner-ref-missing": "a tree block without FULL_BACKREF is not referenced by its owner";
        BAD_FULL_BACKREF = 208 "bad-full-backref": "FULL_BACKREF set or missing where the block's sharing says otherwise";
        EXTENT_SIZE_MISMATCH = 210 "extent-size-mismatch": "a data extent's length differs from a file extent's disk_num_bytes (or metadata from nodesize)";
        DATA_REF_COUNT = 211 "data-ref-count": "a data backref's count differs from the number of file extents using it";
        EXTENT_UNREFERENCED = 212 "extent-unreferenced": "an extent item that nothing references";
        EXTENT_OVERLAP = 213 "extent-overlap": "extent items overlap or repeat";
        EXTENT_OUTSIDE_BLOCK_GROUP = 214 "extent-outside-block-group": "an extent is not inside exactly one block group";
        EXTENT_WRONG_CHUNK = 215 "extent-wrong-chunk": "a data extent in a non-DATA group or a tree block in a DATA group";
        BACKREF_NO_EXTENT = 216 "backref-no-extent": "a keyed backref item without an extent item";
        INLINE_REF_ORDER = 217 "inline-ref-order": "inline backrefs are not ordered by type ascending, then sequence descending";
        KEYED_REF_HASH = 218 "keyed-ref-hash": "a keyed EXTENT_DATA_REF whose key offset is not the hash of its body";
        BACKREF_DUPLICATE = 219 "backref-duplicate": "the same backref appears twice for one extent";
        SKINNY_WITHOUT_FEATURE = 220 "skinny-without-feature": "a METADATA_ITEM on a filesystem without SKINNY_METADATA";

        BG_USED_MISMATCH = 301 "bg-used-mismatch": "a block group's used differs from the sum of extents inside it";
        SUPER_BYTES_USED = 302 "super-bytes-used": "superblock bytes_used differs from the sum of block-group used";
        DEV_BYTES_USED = 303 "dev-bytes-used": "a DEV_ITEM's bytes_used differs from the sum of its dev extents";
        CHUNK_NO_BLOCK_GROUP = 304 "chunk-no-block-group": "a chunk without a block group item";
        BLOCK_GROUP_NO_CHUNK = 305 "block-group-no-chunk": "a block group item without a chunk";
        BLOCK_GROUP_MISMATCH = 306 "block-group-mismatch": "a block group's length or flags differ from its chunk";
        DEV_EXTENT_MISSING = 307 "dev-extent-missing": "a chunk stripe without a matching dev extent";
        DEV_EXTENT_ORPHAN = 308 "dev-extent-orphan": "a dev extent that matches no chunk stripe";
        DEV_EXTENT_OVERLAP = 309 "dev-extent-overlap": "dev extents overlap on one device";
        DEV_EXTENT_RESERVED = 310 "dev-extent-reserved": "a dev extent below 1 MiB, where the superblock area is";
        DEV_EXTENT_BEYOND_DEVICE = 311 "dev-extent-beyond-device": "a dev extent ends past its device's total_bytes";
        DEV_ITEM_MISSING = 312 "dev-item-missing": "a chunk stripe or dev extent names a device without a DEV_ITEM";
        EXTENT_IN_SUPER_STRIPE = 313 "extent-in-super-stripe": "an extent overlaps a superblock mirror's stripe";
        SUPER_NUM_DEVICES = 314 "super-num-devices": "superblock num_devices differs from the number of DEV_ITEMs";
        SUPER_TOTAL_BYTES = 315 "super-total-bytes": "superblock total_bytes is smaller than the devices' total_bytes";

        FST_INFO_MISSING = 401 "fst-info-missing": "a block group without FREE_SPACE_INFO";
        FST_ORPHAN_ITEM = 402 "fst-orphan-item": "a free-space item outside every block group, or INFO not matching its group";
        FST_EXTENT_COUNT = 403 "fst-extent-count": "FREE_SPACE_INFO extent_count differs from the free runs in the items";
        FST_FLAGS = 404 "fst-flags": "USING_BITMAPS disagrees with the item types present";
        FST_BITMAP_SIZE = 405 "fst-bitmap-size": "a free-space bitmap whose size or length is wrong";
        FST_FREE_MISMATCH = 406 "fst-free-mismatch": "free ranges differ from the gaps between allocated extents";
        FST_OVERLAP = 407 "fst-overlap": "free-space extents overlap";

        CSUM_MISSING = 501 "csum-missing": "sectors of a checksummed file extent without csums";
        CSUM_OVERLAP = 502 "csum-overlap": "csum items overlap";
        CSUM_ORPHAN = 503 "csum-orphan": "csums for a range that is not an allocated data extent";
        CSUM_MISMATCH = 504 "csum-mismatch": "data does not match its csum (--check-data-csum)";
        CSUM_ON_NODATASUM = 505 "csum-on-nodatasum": "csums for an extent of a NODATASUM inode";
        CSUM_ON_PREALLOC = 506 "csum-on-prealloc": "csums for a preallocated extent nothing has written";
        DATA_UNREADABLE = 507 "data-unreadable": "a data sector could not be read (--check-data-csum)";

        NLINK_MISMATCH = 601 "nlink-mismatch": "an inode's nlink differs from its number of names";
        NAME_NO_DIR_ITEM = 603 "name-no-dir-item": "an inode name (INODE_REF/EXTREF) without its DIR_ITEM";
        NAME_NO_DIR_INDEX = 604 "name-no-dir-index": "an inode name without its DIR_INDEX";
        DIR_ENTRY_NO_NAME = 605 "dir-entry-no-name": "a DIR_ITEM/DIR_INDEX without the matching INODE_REF/EXTREF";
        DIR_ENTRY_DANGLING = 606 "dir-entry-dangling": "a directory entry naming an inode that does not exist";
        DIR_ENTRY_TYPE = 607 "dir-entry-type": "a directory entry's type differs from the inode's mode";
        DIR_HARDLINK = 608 "dir-hardlink": "a directory with more than one name";
        ORPHAN_ITEM_MISSING = 609 "orphan-item-missing": "an inode with nlink 0 and no orphan item";
        DIR_SIZE = 611 "dir-size": "a directory's size differs from the sum of its entry name lengths times two";
        NBYTES_MISMATCH = 612 "nbytes-mismatch": "an inode's nbytes differs from the bytes its file extents account";
        FILE_EXTENT_OVERLAP = 613 "file-extent-overlap": "file extents of one inode overlap";
        ROOT_DIR_MISSING = 614 "root-dir-missing": "an fs tree without its root directory inode";
        INODE_ITEM_MISSING = 615 "inode-item-missing": "items for an inode that has no INODE_ITEM";
        FILE_EXTENT_ON_DIR = 616 "file-extent-on-dir": "a directory with file extent items";
        DIR_ITEM_ON_FILE = 617 "dir-item-on-file": "a non-directory with directory entries";
        FILE_EXTENT_GAP = 618 "file-extent-gap": "a gap in a file's extents without the NO_HOLES feature";
        FILE_EXTENT_BAD = 619 "file-extent-bad": "a file extent with impossible values (zero length, compressed prealloc, ...)";
        ROOT_DIR_BAD = 620 "root-dir-bad": "a root directory that is not a directory, or lacks its \"..\" ref";
        EXTREF_HASH = 621 "extref-hash": "an INODE_EXTREF whose key offset is not the hash of its parent and name";
        DIR_ENTRY_DUPLICATE = 622 "dir-entry-duplicate": "two entries with one name in one directory";
        ROOT_REF_MISMATCH = 623 "root-ref-mismatch": "ROOT_REF and ROOT_BACKREF disagree or one is missing";
        SUBVOL_ENTRY_MISSING = 624 "subvol-entry-missing": "a ROOT_REF without the directory entries naming the subvolume";
        SUBVOL_UNREFERENCED = 625 "subvol-unreferenced": "a live subvolume that no ROOT_BACKREF names";
        DEAD_ROOT_NO_ORPHAN = 626 "dead-root-no-orphan": "a subvolume with refs 0 and no orphan item in the root tree";
        INODE_FLAGS = 627 "inode-flags": "inode flags impossible for its type (IMMUTABLE or APPEND on a symlink)";

        QGROUP_MISMATCH = 701 "qgroup-mismatch": "a qgroup's referenced or exclusive bytes differ from the extents its subvolumes reach";
    }
}

/// One problem, naming the object it concerns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub id: u16,
    pub name: &'static str,
    /// The tree (root objectid) the object lives in.
    pub root: Option<u64>,
    /// The logical address of the block, extent or range start.
    pub bytenr: Option<u64>,
    pub ino: Option<u64>,
    pub key: Option<Key>,
    pub message: String,
}

impl Finding {
    pub fn new(code: Code, message: impl Into<String>) -> Finding {
        Finding {
            id: code.id,
            name: code.name,
            root: None,
            bytenr: None,
            ino: None,
            key: None,
            message: message.into(),
        }
    }
    pub fn root(mut self, root: u64) -> Finding {
        self.root = Some(root);
        self
    }
    pub fn bytenr(mut self, bytenr: u64) -> Finding {
        self.bytenr = Some(bytenr);
        self
    }
    pub fn ino(mut self, ino: u64) -> Finding {
        self.ino = Some(ino);
        self
    }
    pub fn key(mut self, key: Key) -> Finding {
        self.key = Some(key);
        self
    }
    pub fn code(&self) -> Code {
        Code { id: self.id, name: self.name }
    }
}

impl fmt::Display for Finding {
    /// `E0601 nlink-mismatch root=5 ino=257: nlink 2, found 1 names`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "E{:04} {}", self.id, self.name)?;
        if let Some(r) = self.root {
            write!(f, " root={r}")?;
        }
        if let Some(b) = self.bytenr {
            write!(f, " bytenr={b}")?;
        }
        if let Some(i) = self.ino {
            write!(f, " ino={i}")?;
        }
        if let Some(k) = self.key {
            write!(f, " key={k}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// What was looked at, for the summary line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckStats {
    pub trees: u64,
    pub tree_blocks: u64,
    pub extent_items: u64,
    pub data_refs: u64,
    pub block_groups: u64,
    pub inodes: u64,
    pub csum_bytes: u64,
    pub data_bytes_verified: u64,
}

/// The result of a check.
#[derive(Clone, Debug, Default)]
pub struct CheckReport {
    /// Findings in the order found (recorded up to `max_findings`).
    pub findings: Vec<Finding>,
    /// Findings not recorded because of `max_findings`.
    pub dropped: usize,
    /// Checks skipped and why (not problems).
    pub notes: Vec<String>,
    pub stats: CheckStats,
}

impl CheckReport {
    pub fn is_clean(&self) -> bool {
        self.findings.is_empty() && self.dropped == 0
    }
    /// Total problems, including those not recorded.
    pub fn problems(&self) -> usize {
        self.findings.len() + self.dropped
    }
    pub fn has(&self, code: Code) -> bool {
        self.findings.iter().any(|f| f.id == code.id)
    }
    pub fn count(&self, code: Code) -> usize {
        self.findings.iter().filter(|f| f.id == code.id).count()
    }
    /// One line: what was checked and how many problems were found.
    pub fn summary(&self) -> String {
        let s = &self.stats;
        let mut line = format!(
            "checked {} trees, {} tree blocks, {} extent items, {} data refs, {} block groups, {} inodes, {} csum bytes",
            s.trees, s.tree_blocks, s.extent_items, s.data_refs, s.block_groups, s.inodes, s.csum_bytes
        );
        if s.data_bytes_verified > 0 {
            line.push_str(&format!(", {} data bytes verified", s.data_bytes_verified));
        }
        match self.problems() {
            0 => line.push_str("; no problems found"),
            1 => line.push_str("; 1 problem found"),
            n => line.push_str(&format!("; {n} problems found")),
        }
        line
    }
}

/// Findings and notes as they accumulate.
pub(crate) struct Sink {
    pub report: CheckReport,
    pub(crate) max: usize,
}

impl Sink {
    fn push(&mut self, f: Finding) {
        if self.report.findings.len() < self.max {
            self.report.findings.push(f);
        } else {
            self.report.dropped += 1;
        }
    }
    fn note(&mut self, s: impl Into<String>) {
        self.report.notes.push(s.into());
    }
}

/// Check the filesystem read-only and report every problem found.
///
/// Damage never aborts the check: unreadable blocks, bad items and inconsistent
/// accounting all become findings, and the passes that depend on damaged parts still
/// run on what could be read.
///
/// # Errors
/// None today for damaged metadata; the `Result` is kept for failures of the checker's
/// own environment.
pub fn check(fs: &FsInfo, opts: &CheckOptions) -> Result<CheckReport> {
    let mut sink = Sink { report: CheckReport::default(), max: opts.max_findings.max(1) };
    let state = walk::walk(fs, &mut sink);
    extents::check_extents(fs, &state, &mut sink);
    space::check_space(fs, &state, &mut sink);
    fst::check_free_space_tree(fs, &state, &mut sink);
    csum::check_csum_items(fs, &state, opts, &mut sink);
    inodes::check_fs_trees(fs, &state, &mut sink);
    qgroup::check_qgroups(fs, &state, &mut sink);
    sink.report.stats.trees = state.trees_walked;
    sink.report.stats.tree_blocks = state.blocks.len() as u64;
    sink.report.stats.extent_items = state.extents.len() as u64;
    sink.report.stats.data_refs = state.data_refs.values().map(|v| v.len() as u64).sum();
    sink.report.stats.block_groups = state.block_groups.len() as u64;
    sink.report.stats.csum_bytes = state.csums.iter().map(|c| c.end - c.start).sum();
    Ok(sink.report)
}

pub(crate) use ubtrfs_core::merge_ranges;

/// Parts of `[start, end)` not covered by `covered` (disjoint, sorted).
pub(crate) fn uncovered(covered: &[(u64, u64)], start: u64, end: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut cur = start;
    // First range that ends after `start`.
    let mut i = covered.partition_point(|r| r.1 <= start);
    while cur < end {
        match covered.get(i) {
            Some(&(s, e)) if s < end => {
                if s > cur {
                    out.push((cur, s));
                }
                cur = cur.max(e);
                i += 1;
            }
            _ => {
                out.push((cur, end));
                break;
            }
        }
    }
    out
}

/// Half-open `[start, end)` ranges.
pub(crate) type Ranges = Vec<(u64, u64)>;

/// Symmetric difference of two disjoint sorted range lists: (only in a, only in b).
pub(crate) fn range_diff(a: &[(u64, u64)], b: &[(u64, u64)]) -> (Ranges, Ranges) {
    let mut only_a = Vec::new();
    for &(s, e) in a {
        only_a.extend(uncovered(b, s, e));
    }
    let mut only_b = Vec::new();
    for &(s, e) in b {
        only_b.extend(uncovered(a, s, e));
    }
    (only_a, only_b)
}

/// Format ranges for a message, at most a few of them.
pub(crate) fn ranges_str(v: &[(u64, u64)]) -> String {
    const SHOW: usize = 4;
    let mut s: Vec<String> = v.iter().take(SHOW).map(|(a, b)| format!("[{a}, {b})")).collect();
    if v.len() > SHOW {
        s.push(format!("and {} more", v.len() - SHOW));
    }
    s.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(uncovered(&[(2, 4), (6, 8)], 0, 10), vec![(0, 2), (4, 6), (8, 10)]);
        assert_eq!(uncovered(&[(2, 4), (6, 8)], 3, 7), vec![(4, 6)]);
        assert_eq!(uncovered(&[], 3, 7), vec![(3, 7)]);
        assert_eq!(uncovered(&[(0, 10)], 3, 7), vec![]);
        let (a, b) = range_diff(&[(0, 10)], &[(0, 4), (6, 12)]);
        assert_eq!(a, vec![(4, 6)]);
        assert_eq!(b, vec![(10, 12)]);
    }

    #[test]
    fn codes_unique() {
        let mut ids = std::collections::HashSet::new();
        let mut names = std::collections::HashSet::new();
        for (c, _) in codes::ALL {
            assert!(ids.insert(c.id), "duplicate id {}", c.id);
            assert!(names.insert(c.name), "duplicate name {}", c.name);
            assert!((101..800).contains(&c.id));
        }
        let f = Finding::new(codes::NLINK_MISMATCH, "nlink 2, found 1 names").root(5).ino(257);
        assert_eq!(f.to_string(), "E0601 nlink-mismatch root=5 ino=257: nlink 2, found 1 names");
    }
}
