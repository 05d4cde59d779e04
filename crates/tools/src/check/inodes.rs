//! Pass 6: every fs tree (subvolumes, snapshots, the data-reloc tree), in key order.
//!
//! Per inode: nlink equals its names (INODE_REF + INODE_EXTREF entries), each name has
//! its DIR_ITEM and DIR_INDEX in the parent and the reverse, entry types match modes,
//! a directory's size is the sum of its entries' name lengths (DIR_ITEM and DIR_INDEX
//! each count once), nbytes is what btrfs accounts (inline ram_bytes plus num_bytes of
//! every non-hole REG/PREALLOC extent), file extents do not overlap (nor leave gaps
//! without NO_HOLES), nlink 0 needs an orphan item, and every checksummed file extent is
//! fully covered by csums. Then ROOT_REF/ROOT_BACKREF pairs and subvolume entries.
//!
//! Snapshots share leaves, so each tree is iterated on its own (through the node
//! cache); a tree with unreadable blocks is skipped with a note, since its inode
//! records would be incomplete. Inode checks are skipped, as btrfs check does, for dead
//! roots and roots being dropped.

use super::codes::*;
use super::walk::{RootRec, State};
use super::{ranges_str, uncovered, Finding, Sink};
use std::collections::{HashMap, HashSet};
use ubtrfs_core::{FsInfo, TreeView};
use ubtrfs_format::features::INCOMPAT_NO_HOLES;
use ubtrfs_format::hash::extref_hash;
use ubtrfs_format::items::{self, FileExtent};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::Key;

#[derive(Default)]
struct Ino {
    item: Option<InodeSum>,
    names: u32,
    dir_size: u64,
    has_dirents: bool,
    has_extents: bool,
    found_nbytes: u64,
    ext_start: Option<u64>,
    ext_end: u64,
    first_gap: Option<u64>,
}

#[derive(Clone, Copy)]
struct InodeSum {
    mode: u32,
    nlink: u32,
    size: u64,
    nbytes: u64,
    flags: u64,
}

#[derive(Default)]
struct Entry {
    /// (child ino, index) from INODE_REF / INODE_EXTREF.
    refs: Vec<(u64, u64)>,
    /// (location, type) from DIR_ITEM.
    items: Vec<(Key, u8)>,
    /// (index, location, type) from DIR_INDEX.
    indexes: Vec<(u64, Key, u8)>,
}

struct TreeCheck<'a> {
    fs: &'a FsInfo,
    st: &'a State,
    root: u64,
    root_dirid: u64,
    no_holes: bool,
    coverage: &'a [(u64, u64)],
    inodes: HashMap<u64, Ino>,
    dirents: HashMap<(u64, Vec<u8>), Entry>,
    orphans: HashSet<u64>,
    findings: Vec<Finding>,
}

pub(super) fn check_fs_trees(fs: &FsInfo, st: &State, sink: &mut Sink) {
    let coverage = super::csum::coverage(st);
    let no_holes = fs.super_copy().incompat_flags.get() & INCOMPAT_NO_HOLES != 0;
    let mut csum_done: HashSet<(u64, u64, u64, bool)> = HashSet::new();
    for r in &st.roots {
        let id = r.key.objectid;
        if !is_fstree(id) || id == TREE_RELOC_OBJECTID {
            continue;
        }
        if r.refs == 0 {
            sink.note(format!("root {id} is deleted (refs 0): inode checks skipped"));
            continue;
        }
        if r.drop.is_some() {
            sink.note(format!("root {id} is being dropped: inode checks skipped"));
            continue;
        }
        if r.damaged {
            sink.note(format!("root {id} has unreadable blocks: inode checks skipped"));
            continue;
        }
        let mut t = TreeCheck {
            fs,
            st,
            root: id,
            root_dirid: r.root_dirid,
            no_holes,
            coverage: &coverage,
            inodes: HashMap::new(),
            dirents: HashMap::new(),
            orphans: HashSet::new(),
            findings: Vec::new(),
        };
        match t.scan(r, &mut csum_done) {
            Ok(()) => {
                t.finish();
                sink.report.stats.inodes +=
                    t.inodes.values().filter(|i| i.item.is_some()).count() as u64;
                for f in t.findings {
                    sink.push(f);
                }
            }
            Err(e) => sink.note(format!("root {id}: inode checks stopped: {e}")),
        }
    }
    check_root_refs(st, sink);
}

impl TreeCheck<'_> {
    fn push(&mut self, f: Finding) {
        self.findings.push(f.root(self.root));
    }

    fn scan(
        &mut self,
        r: &RootRec,
        csum_done: &mut HashSet<(u64, u64, u64, bool)>,
    ) -> ubtrfs_core::Result<()> {
        let mut it = self.fs.iter(&r.info, Key::MIN)?;
        while let Some(item) = it.next_item()? {
            let key = item.key();
            let data = item.data();
            match key.type_ {
                INODE_ITEM_KEY => {
                    if let Ok(ii) = items::read_prefix::<InodeItem>(data, "inode") {
                        let sum = InodeSum {
                            mode: ii.mode.get(),
                            nlink: ii.nlink.get(),
                            size: ii.size.get(),
                            nbytes: ii.nbytes.get(),
                            flags: ii.flags.get(),
                        };
                        self.inodes.entry(key.objectid).or_default().item = Some(sum);
                    }
                }
                INODE_REF_KEY => {
                    for n in items::inode_refs(data, key.offset).flatten() {
                        self.add_name(key.objectid, n.parent, n.index, n.name);
                    }
                }
                INODE_EXTREF_KEY => {
                    for n in items::inode_extrefs(data).flatten() {
                        let h = extref_hash(n.parent, n.name);
                        if h != key.offset {
                            self.push(
                                Finding::new(EXTREF_HASH, format!("key offset {:#x}, hash of parent {} and name {:?} is {h:#x}", key.offset, n.parent, String::from_utf8_lossy(n.name)))
                                    .ino(key.objectid)
                                    .key(key),
                            );
                        }
                        self.add_name(key.objectid, n.parent, n.index, n.name);
                    }
                }
                DIR_ITEM_KEY | DIR_INDEX_KEY => {
                    let dir = key.objectid;
                    for e in items::dir_entries(data).flatten() {
                        let rec = self.inodes.entry(dir).or_default();
                        rec.dir_size += e.name.len() as u64;
                        rec.has_dirents = true;
                        let ent = self.dirents.entry((dir, e.name.to_vec())).or_default();
                        if key.type_ == DIR_ITEM_KEY {
                            ent.items.push((e.location, e.type_));
                        } else {
                            ent.indexes.push((key.offset, e.location, e.type_));
                        }
                    }
                }
                EXTENT_DATA_KEY => {
                    if let Ok(fe) = items::file_extent(data) {
                        self.file_extent(key, &fe, csum_done);
                    }
                }
                ORPHAN_ITEM_KEY if key.objectid == ORPHAN_OBJECTID => {
                    self.orphans.insert(key.offset);
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn add_name(&mut self, ino: u64, parent: u64, index: u64, name: &[u8]) {
        self.inodes.entry(ino).or_default().names += 1;
        if ino == self.root_dirid && parent == ino {
            // The root directory's ".." ref names itself; checked in `finish`.
            return;
        }
        self.inodes.entry(parent).or_default();
        self.dirents.entry((parent, name.to_vec())).or_default().refs.push((ino, index));
    }

    fn file_extent(
        &mut self,
        key: Key,
        fe: &FileExtent<'_>,
        csum_done: &mut HashSet<(u64, u64, u64, bool)>,
    ) {
        let ino = key.objectid;
        let s = u64::from(self.fs.sectorsize);
        let rec = self.inodes.entry(ino).or_default();
        let inode = rec.item;
        let nodatasum = inode.is_some_and(|i| i.flags & INODE_NODATASUM != 0);
        let is_symlink = inode.is_some_and(|i| i.mode & S_IFMT == S_IFLNK);
        rec.has_extents = true;
        let off = key.offset;
        let mut bad: Option<String> = None;
        let end = match *fe {
            FileExtent::Inline { ram_bytes, .. } => {
                if ram_bytes == 0 {
                    bad = Some("inline extent with ram_bytes 0".into());
                }
                rec.found_nbytes = rec.found_nbytes.saturating_add(ram_bytes);
                off.saturating_add(ram_bytes.div_ceil(s).saturating_mul(s))
            }
            FileExtent::Regular { compression, prealloc, disk_bytenr, num_bytes, .. } => {
                if num_bytes == 0 {
                    bad = Some("file extent with num_bytes 0".into());
                } else if prealloc && compression != 0 {
                    bad = Some("compressed preallocated extent".into());
                } else if compression != 0 && nodatasum {
                    bad = Some("compressed extent of a NODATASUM inode".into());
                } else if is_symlink {
                    bad = Some("symlink with a regular file extent".into());
                }
                if disk_bytenr != 0 {
                    rec.found_nbytes = rec.found_nbytes.saturating_add(num_bytes);
                }
                off.saturating_add(num_bytes)
            }
        };
        let mut overlap = None;
        match rec.ext_start {
            None => {
                rec.ext_start = Some(off);
                if off > 0 && rec.first_gap.is_none() {
                    rec.first_gap = Some(0);
                }
            }
            Some(_) => {
                if off < rec.ext_end {
                    overlap = Some(rec.ext_end);
                } else if off > rec.ext_end && rec.first_gap.is_none() {
                    rec.first_gap = Some(rec.ext_end);
                }
            }
        }
        rec.ext_end = rec.ext_end.max(end);
        if let Some(b) = bad {
            self.push(Finding::new(FILE_EXTENT_BAD, b).ino(ino).key(key));
        }
        if let Some(pe) = overlap {
            self.push(
                Finding::new(
                    FILE_EXTENT_OVERLAP,
                    format!("file extent at {off} starts before the previous one ends at {pe}"),
                )
                .ino(ino)
                .key(key),
            );
        }
        self.csum_coverage(key, fe, nodatasum, csum_done);
    }

    /// Every sector a REG extent reads must have a csum (unless NODATASUM), and no
    /// NODATASUM or unwritten preallocated extent may have csums.
    fn csum_coverage(
        &mut self,
        key: Key,
        fe: &FileExtent<'_>,
        nodatasum: bool,
        done: &mut HashSet<(u64, u64, u64, bool)>,
    ) {
        let FileExtent::Regular {
            compression,
            prealloc,
            disk_bytenr,
            disk_num_bytes,
            offset,
            num_bytes,
            ..
        } = *fe
        else {
            return;
        };
        // The data-reloc tree copies csums with the data, and may hold prealloc copies
        // without any (btrfs check skips it too).
        if disk_bytenr == 0 || self.root == DATA_RELOC_TREE_OBJECTID {
            return;
        }
        let (start, len) = if compression != 0 {
            (disk_bytenr, disk_num_bytes)
        } else {
            (disk_bytenr.saturating_add(offset), num_bytes)
        };
        if !done.insert((start, len, disk_bytenr, nodatasum || prealloc)) {
            return;
        }
        let end = start.saturating_add(len);
        let missing = uncovered(self.coverage, start, end);
        let covered_any = missing.iter().map(|(a, b)| b - a).sum::<u64>() < len;
        let ino = key.objectid;
        if prealloc {
            if covered_any {
                let written = self
                    .st
                    .data_refs
                    .get(&disk_bytenr)
                    .is_some_and(|v| v.iter().any(|r| !r.prealloc));
                if !written {
                    self.push(Finding::new(CSUM_ON_PREALLOC, format!("preallocated extent [{start}, {end}) has csums but nothing has written it")).ino(ino).key(key).bytenr(disk_bytenr));
                }
            }
        } else if nodatasum {
            if covered_any {
                self.push(
                    Finding::new(
                        CSUM_ON_NODATASUM,
                        format!("extent [{start}, {end}) of a NODATASUM inode has csums"),
                    )
                    .ino(ino)
                    .key(key)
                    .bytenr(disk_bytenr),
                );
            }
        } else if !missing.is_empty() {
            let n: u64 = missing.iter().map(|(a, b)| (b - a) / u64::from(self.fs.sectorsize)).sum();
            self.push(
                Finding::new(
                    CSUM_MISSING,
                    format!(
                        "{n} sectors of extent [{start}, {end}) have no csum: {}",
                        ranges_str(&missing)
                    ),
                )
                .ino(ino)
                .key(key)
                .bytenr(disk_bytenr),
            );
        }
    }

    fn finish(&mut self) {
        let root_dirid = self.root_dirid;
        match self.inodes.get(&root_dirid).and_then(|i| i.item) {
            None => self.push(
                Finding::new(
                    ROOT_DIR_MISSING,
                    format!("root directory inode {root_dirid} has no INODE_ITEM"),
                )
                .ino(root_dirid),
            ),
            Some(i) if i.mode & S_IFMT != S_IFDIR => self.push(
                Finding::new(
                    ROOT_DIR_BAD,
                    format!("root directory mode {:#o} is not a directory", i.mode),
                )
                .ino(root_dirid),
            ),
            Some(_) => {
                let names = self.inodes[&root_dirid].names;
                if names != 1 {
                    self.push(
                        Finding::new(
                            ROOT_DIR_BAD,
                            format!(
                                "root directory has {names} names, expected only its \"..\" ref"
                            ),
                        )
                        .ino(root_dirid),
                    );
                }
            }
        }
        let mut inos: Vec<u64> = self.inodes.keys().copied().collect();
        inos.sort_unstable();
        for ino in inos {
            let rec = &self.inodes[&ino];
            let Some(i) = rec.item else {
                let what = if rec.names > 0 {
                    "names"
                } else if rec.has_dirents {
                    "directory entries"
                } else if rec.has_extents {
                    "file extents"
                } else {
                    "entries naming it"
                };
                if (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&ino) {
                    self.push(
                        Finding::new(
                            INODE_ITEM_MISSING,
                            format!("inode has {what} but no INODE_ITEM"),
                        )
                        .ino(ino),
                    );
                }
                continue;
            };
            if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&ino) {
                continue;
            }
            let mut out = Vec::new();
            let kind = i.mode & S_IFMT;
            // An unlinked inode waiting for orphan cleanup keeps whatever it had.
            let orphan = i.nlink == 0 && self.orphans.contains(&ino);
            if kind == S_IFLNK && i.flags & (INODE_IMMUTABLE | INODE_APPEND) != 0 {
                out.push(Finding::new(
                    INODE_FLAGS,
                    format!("symlink with flags {:#x} (IMMUTABLE or APPEND)", i.flags),
                ));
            }
            if kind == S_IFDIR {
                if rec.dir_size != i.size && !orphan {
                    out.push(Finding::new(
                        DIR_SIZE,
                        format!(
                            "directory size {}, its entries' names total {}",
                            i.size, rec.dir_size
                        ),
                    ));
                }
                if rec.has_extents {
                    out.push(Finding::new(FILE_EXTENT_ON_DIR, "directory has file extent items"));
                }
                if ino != root_dirid && rec.names > 1 {
                    out.push(Finding::new(
                        DIR_HARDLINK,
                        format!("directory has {} names", rec.names),
                    ));
                }
            } else if rec.has_dirents {
                out.push(Finding::new(
                    DIR_ITEM_ON_FILE,
                    format!("inode of mode {:#o} has directory entries", i.mode),
                ));
            }
            if (kind == S_IFREG || kind == S_IFLNK) && i.nlink > 0 {
                if rec.found_nbytes != i.nbytes {
                    out.push(Finding::new(
                        NBYTES_MISMATCH,
                        format!("nbytes {}, file extents account {}", i.nbytes, rec.found_nbytes),
                    ));
                }
                if !self.no_holes && i.size > 0 {
                    let gap = match rec.ext_start {
                        None => Some(0),
                        Some(_) if rec.first_gap.is_some_and(|g| g < i.size) => rec.first_gap,
                        Some(_) if rec.ext_end < i.size => Some(rec.ext_end),
                        Some(_) => None,
                    };
                    if let Some(g) = gap {
                        out.push(Finding::new(FILE_EXTENT_GAP, format!("no file extent covers offset {g} of a {}-byte file, and NO_HOLES is off", i.size)));
                    }
                }
            }
            if ino != root_dirid {
                if i.nlink == 0 && !self.orphans.contains(&ino) {
                    out.push(Finding::new(
                        ORPHAN_ITEM_MISSING,
                        format!("inode has nlink 0 and {} names but no orphan item", rec.names),
                    ));
                }
                if i.nlink != rec.names && !(i.nlink == 0 && rec.names == 0) {
                    out.push(Finding::new(
                        NLINK_MISMATCH,
                        format!("nlink {}, found {} names", i.nlink, rec.names),
                    ));
                }
            }
            for f in out {
                self.push(f.ino(ino));
            }
        }
        self.check_dirents();
        self.check_subvol_entries();
    }

    fn is_orphan(&self, ino: u64) -> bool {
        self.orphans.contains(&ino)
            && self.inodes.get(&ino).and_then(|i| i.item).is_some_and(|i| i.nlink == 0)
    }

    fn check_dirents(&mut self) {
        let mut keys: Vec<(u64, Vec<u8>)> = self.dirents.keys().cloned().collect();
        keys.sort_unstable();
        for k in keys {
            if self.is_orphan(k.0) {
                // A directory being deleted by orphan cleanup may still list entries.
                continue;
            }
            let ent = &self.dirents[&k];
            let (dir, name) = (k.0, String::from_utf8_lossy(&k.1).into_owned());
            let mut out: Vec<Finding> = Vec::new();
            if ent.items.len() > 1 || ent.indexes.len() > 1 || ent.refs.len() > 1 {
                out.push(
                    Finding::new(DIR_ENTRY_DUPLICATE, format!("name {name:?} appears in {} DIR_ITEM, {} DIR_INDEX and {} inode ref entries", ent.items.len(), ent.indexes.len(), ent.refs.len()))
                        .ino(dir),
                );
            }
            for &(child, index) in &ent.refs {
                if !ent
                    .items
                    .iter()
                    .any(|(loc, _)| loc.type_ == INODE_ITEM_KEY && loc.objectid == child)
                {
                    out.push(
                        Finding::new(
                            NAME_NO_DIR_ITEM,
                            format!("name {name:?} in directory {dir} has no DIR_ITEM"),
                        )
                        .ino(child),
                    );
                }
                if !ent.indexes.iter().any(|(idx, loc, _)| {
                    *idx == index && loc.type_ == INODE_ITEM_KEY && loc.objectid == child
                }) {
                    out.push(
                        Finding::new(
                            NAME_NO_DIR_INDEX,
                            format!("name {name:?} in directory {dir} has no DIR_INDEX {index}"),
                        )
                        .ino(child),
                    );
                }
            }
            let mut children: Vec<(u64, u8, bool, bool)> = Vec::new();
            for (loc, ty) in &ent.items {
                if loc.type_ == INODE_ITEM_KEY {
                    children.push((loc.objectid, *ty, true, false));
                }
            }
            for (idx, loc, ty) in &ent.indexes {
                if loc.type_ == INODE_ITEM_KEY {
                    let has_ref = ent.refs.iter().any(|&(c, i)| c == loc.objectid && i == *idx);
                    if !has_ref && ent.refs.iter().any(|&(c, _)| c == loc.objectid) {
                        out.push(Finding::new(DIR_ENTRY_NO_NAME, format!("DIR_INDEX {idx} for name {name:?} names ino {} whose ref has another index", loc.objectid)).ino(dir));
                    }
                    children.push((loc.objectid, *ty, false, true));
                }
            }
            children.sort_unstable();
            children.dedup_by(|a, b| {
                if a.0 == b.0 && a.1 == b.1 {
                    b.2 |= a.2;
                    b.3 |= a.3;
                    true
                } else {
                    false
                }
            });
            for (child, ty, in_item, in_index) in children {
                let what = match (in_item, in_index) {
                    (true, true) => "DIR_ITEM and DIR_INDEX",
                    (true, false) => "DIR_ITEM",
                    _ => "DIR_INDEX",
                };
                match self.inodes.get(&child).and_then(|i| i.item) {
                    None => out.push(
                        Finding::new(
                            DIR_ENTRY_DANGLING,
                            format!("{what} {name:?} names ino {child}, which does not exist"),
                        )
                        .ino(dir),
                    ),
                    Some(ci) => {
                        let unlinked = ci.nlink == 0 && self.orphans.contains(&child);
                        if !unlinked && !ent.refs.iter().any(|&(c, _)| c == child) {
                            out.push(Finding::new(DIR_ENTRY_NO_NAME, format!("{what} {name:?} names ino {child}, which has no such inode ref")).ino(dir));
                        }
                        if ft_from_mode(ci.mode) != ty & !FT_ENCRYPTED {
                            out.push(
                                Finding::new(
                                    DIR_ENTRY_TYPE,
                                    format!(
                                        "{what} {name:?} has type {ty}, ino {child} has mode {:#o}",
                                        ci.mode
                                    ),
                                )
                                .ino(dir),
                            );
                        }
                    }
                }
            }
            for f in out {
                self.push(f);
            }
        }
    }

    /// Each ROOT_REF from this tree needs the DIR_ITEM and DIR_INDEX that show it.
    fn check_subvol_entries(&mut self) {
        let mut out = Vec::new();
        for l in self.st.root_refs.iter().filter(|l| l.parent == self.root) {
            let name = String::from_utf8_lossy(&l.name);
            let ent = self.dirents.get(&(l.dirid, l.name.clone()));
            let has_item = ent.is_some_and(|e| {
                e.items.iter().any(|(loc, _)| loc.type_ == ROOT_ITEM_KEY && loc.objectid == l.child)
            });
            let has_index = ent.is_some_and(|e| {
                e.indexes.iter().any(|(i, loc, _)| {
                    *i == l.sequence && loc.type_ == ROOT_ITEM_KEY && loc.objectid == l.child
                })
            });
            if !has_item || !has_index {
                let missing = match (has_item, has_index) {
                    (false, false) => "DIR_ITEM and DIR_INDEX",
                    (false, true) => "DIR_ITEM",
                    _ => "DIR_INDEX",
                };
                out.push(Finding::new(SUBVOL_ENTRY_MISSING, format!("subvolume {} named {name:?} in directory {} (index {}) has no {missing}", l.child, l.dirid, l.sequence)).ino(l.dirid));
            }
        }
        for f in out {
            self.push(f);
        }
    }
}

/// ROOT_REF and ROOT_BACKREF must pair up; live subvolumes must be named; deleted ones
/// need an orphan item so the kernel finishes dropping them.
fn check_root_refs(st: &State, sink: &mut Sink) {
    let rt = ROOT_TREE_OBJECTID;
    for l in &st.root_refs {
        if !st.root_backrefs.contains(l) {
            sink.push(
                Finding::new(
                    ROOT_REF_MISMATCH,
                    format!(
                        "ROOT_REF {} -> {} ({:?} in dir {}) has no matching ROOT_BACKREF",
                        l.parent,
                        l.child,
                        String::from_utf8_lossy(&l.name),
                        l.dirid
                    ),
                )
                .root(rt)
                .key(Key::new(l.parent, ROOT_REF_KEY, l.child)),
            );
        }
    }
    for l in &st.root_backrefs {
        if !st.root_refs.contains(l) {
            sink.push(
                Finding::new(
                    ROOT_REF_MISMATCH,
                    format!(
                        "ROOT_BACKREF {} -> {} ({:?} in dir {}) has no matching ROOT_REF",
                        l.child,
                        l.parent,
                        String::from_utf8_lossy(&l.name),
                        l.dirid
                    ),
                )
                .root(rt)
                .key(Key::new(l.child, ROOT_BACKREF_KEY, l.parent)),
            );
        }
    }
    for r in &st.roots {
        let id = r.key.objectid;
        if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) {
            continue;
        }
        if r.refs == 0 {
            if !st.root_orphans.contains(&id) {
                sink.push(
                    Finding::new(
                        DEAD_ROOT_NO_ORPHAN,
                        "deleted subvolume (refs 0) has no orphan item",
                    )
                    .root(id),
                );
            }
        } else if !st.root_backrefs.iter().any(|l| l.child == id) {
            sink.push(
                Finding::new(
                    SUBVOL_UNREFERENCED,
                    format!("subvolume with refs {} has no ROOT_BACKREF", r.refs),
                )
                .root(id),
            );
        }
    }
}
