//! The tree checker: every tree block is validated once, when it is read, before any
//! other code sees it (the kernel's tree-checker.c plus the read-time header checks of
//! disk-io.c). After `check_tree_block` succeeds, `NodeRef` accessors cannot go out of
//! bounds and item parsers cannot fail on structure.
//!
//! Checks, in order: size, checksum, header (bytenr, fsid, level, generation against the
//! parent pointer, owner), layout (item offsets packed from the end, no overlap, ptr
//! alignment), strictly increasing keys, then item contents by type (each family's
//! rules live beside its parsers in `items`) and the rules between neighbours (file
//! extents, csums, dev extents and extents must not overlap).
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
use crate::items::{self, FileExtent, ItemCtx};
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
        return Err(blk(format!(
            "checksum mismatch: have {} expect {}",
            hex(&got[..n]),
            hex(&h.csum[..n])
        )));
    }
    let owner = h.owner.get();
    let blk = |r: String| {
        Corrupt::new(if h.level == 0 { CorruptWhere::Leaf } else { CorruptWhere::Node }, r)
            .block(ctx.bytenr)
            .root(owner)
    };
    if h.bytenr.get() != ctx.bytenr {
        return Err(blk(format!(
            "bad tree block start, want {} have {}",
            ctx.bytenr,
            h.bytenr.get()
        )));
    }
    if h.fsid != ctx.fsid {
        return Err(blk(format!(
            "bad fsid {}, expect {}",
            items::uuid_str(&h.fsid),
            items::uuid_str(&ctx.fsid)
        )));
    }
    if let Some(u) = ctx.chunk_tree_uuid {
        if h.chunk_tree_uuid != u {
            return Err(blk(format!(
                "bad chunk_tree_uuid {}",
                items::uuid_str(&h.chunk_tree_uuid)
            )));
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
        return Err(blk(format!(
            "invalid flag for {}, WRITTEN not set",
            if h.level == 0 { "leaf" } else { "node" }
        )));
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
            return Err(blk(format!(
                "tree first key mismatch detected, want {fk} have {}",
                node.key(0)
            )));
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
        return Err(err(format!(
            "invalid nritems, have {n} should be in range [1, {}]",
            max_node_ptrs(ctx.nodesize)
        )));
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
                return Err(
                    err(format!("bad key order, current {key} prev {p}")).slot(slot as u32, key)
                );
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
        if matches!(
            owner,
            ROOT_TREE_OBJECTID
                | CHUNK_TREE_OBJECTID
                | DEV_TREE_OBJECTID
                | FS_TREE_OBJECTID
                | DATA_RELOC_TREE_OBJECTID
                | EXTENT_TREE_OBJECTID
        ) {
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
        let expect_end =
            if slot == 0 { data_area } else { node.item(slot - 1).offset.get() as usize };
        let off = it.offset.get() as usize;
        let size = it.size.get() as usize;
        if off.checked_add(size) != Some(expect_end) {
            return Err(e(format!(
                "unexpected item end, have {} expect {expect_end}",
                off as u64 + size as u64
            )));
        }
        if off < n * ITEM_SIZE {
            return Err(e(format!(
                "item data overlaps the item array, offset {off} items end {}",
                n * ITEM_SIZE
            )));
        }
    }
    for slot in 0..n {
        let key = node.key(slot);
        check_item(&key, node.item_data(slot), ctx).map_err(|r| err(r).slot(slot as u32, key))?;
        if slot > 0 {
            check_against_prev(node, slot, ctx)
                .map_err(|(at, r)| err(r).slot(at as u32, node.key(at)))?;
        }
    }
    Ok(())
}

/// The kernel's rules between an item and the one before it in the same leaf (items
/// already checked one by one): file extents, csums, dev extents and extents must not
/// overlap. Returns the slot to blame with the reason.
fn check_against_prev(
    node: &NodeRef<'_>,
    slot: usize,
    ctx: &CheckCtx,
) -> core::result::Result<(), (usize, String)> {
    let (prev, key) = (node.key(slot - 1), node.key(slot));
    let (pdata, ss) = (node.item_data(slot - 1), u64::from(ctx.sectorsize));
    match (prev.type_, key.type_) {
        // check_extent_data_item; the end of an inline extent is rounded up to a sector.
        (EXTENT_DATA_KEY, EXTENT_DATA_KEY)
            if prev.objectid == key.objectid
                && items::file_extent(node.item_data(slot))
                    .is_ok_and(|f| matches!(f, FileExtent::Regular { .. })) =>
        {
            let prev_end = match items::file_extent(pdata) {
                Ok(FileExtent::Inline { ram_bytes, .. }) => {
                    prev.offset.wrapping_add(ram_bytes).wrapping_add(ss - 1) / ss * ss
                }
                Ok(FileExtent::Regular { num_bytes, .. }) => prev.offset.wrapping_add(num_bytes),
                Err(r) => return Err((slot - 1, r)),
            };
            if prev_end > key.offset {
                return Err((slot - 1, format!("file extent end range ({prev_end}) goes beyond start offset ({}) of the next file extent", key.offset)));
            }
        }
        // check_csum_item
        (EXTENT_CSUM_KEY, EXTENT_CSUM_KEY) => {
            let prev_end =
                prev.offset.wrapping_add((pdata.len() / ctx.csum_type.size()) as u64 * ss);
            if prev_end > key.offset {
                return Err((slot - 1, format!("csum end range ({prev_end}) goes beyond the start range ({}) of the next csum item", key.offset)));
            }
        }
        // check_dev_extent_item
        (DEV_EXTENT_KEY, DEV_EXTENT_KEY) if prev.objectid == key.objectid => {
            let len = items::read_prefix::<DevExtent>(pdata, "dev extent")
                .map_err(|r| (slot - 1, r))?
                .length
                .get();
            if prev.offset.wrapping_add(len) > key.offset {
                return Err((
                    slot,
                    format!(
                        "dev extent overlap, prev offset {} len {len} current offset {}",
                        prev.offset, key.offset
                    ),
                ));
            }
        }
        // check_extent_item
        (EXTENT_ITEM_KEY | METADATA_ITEM_KEY, EXTENT_ITEM_KEY | METADATA_ITEM_KEY) => {
            let prev_end = prev.objectid.wrapping_add(if prev.type_ == METADATA_ITEM_KEY {
                u64::from(ctx.nodesize)
            } else {
                prev.offset
            });
            if prev_end > key.objectid {
                return Err((
                    slot,
                    format!("previous extent {prev} overlaps current extent {key}"),
                ));
            }
        }
        _ => {}
    }
    Ok(())
}

/// Check one item's body against its key (the rules of its family in `items`).
///
/// # Errors
/// A reason string; the caller attaches block, slot and key.
pub fn check_item(key: &Key, data: &[u8], ctx: &CheckCtx) -> core::result::Result<(), String> {
    items::check_item(key, data, &ctx.items())
}

impl CheckCtx {
    /// What the item rules need of this context.
    fn items(&self) -> ItemCtx {
        ItemCtx {
            nodesize: self.nodesize,
            sectorsize: self.sectorsize,
            csum_type: self.csum_type,
            super_generation: self.super_generation,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::name_hash;
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
        let di = DirItem {
            location: location.to_disk(),
            transid: transid.into(),
            data_len: (data.len() as u16).into(),
            name_len: (name.len() as u16).into(),
            type_,
        };
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
        check_one(
            Key::new(256, DIR_ITEM_KEY, name_hash(b"")),
            dir_entry(file_loc(), 1, FT_REG_FILE, b"", b""),
        )
        .expect("empty name");
        let two = [
            dir_entry(file_loc(), 1, FT_REG_FILE, b"a", b""),
            dir_entry(Key::new(258, INODE_ITEM_KEY, 0), 1, FT_DIR, b"b", b""),
        ]
        .concat();
        check_one(Key::new(256, DIR_INDEX_KEY, 2), two).expect("two entries in a dir index");
        check_one(Key::new(256, DIR_INDEX_KEY, 2), Vec::new()).expect("empty dir index");
        check_one(
            Key::new(257, XATTR_ITEM_KEY, name_hash(b"x")),
            dir_entry(Key::new(0, 0, 0), 1, FT_XATTR | FT_ENCRYPTED, b"x", b""),
        )
        .expect("encrypted xattr type");
        check_one(
            Key::new(256, DIR_ITEM_KEY, name_hash(b"z")),
            dir_entry(Key::new(257, 0, 0), 1, FT_REG_FILE, b"z", b""),
        )
        .expect("location type 0");
    }

    #[test]
    fn dir_item_rules_the_kernel_has() {
        let k = |n: &[u8]| Key::new(256, DIR_ITEM_KEY, name_hash(n));
        refused(
            check_one(k(b"a"), dir_entry(file_loc(), 1, FT_UNKNOWN, b"a", b"")),
            "invalid dir item type",
        );
        refused(
            check_one(k(b"a"), dir_entry(file_loc(), 1, FT_MAX, b"a", b"")),
            "invalid dir item type",
        );
        refused(
            check_one(k(b"a"), dir_entry(file_loc(), 1, FT_XATTR, b"a", b"")),
            "xattr dir type found for non-XATTR key",
        );
        refused(
            check_one(k(b"a"), dir_entry(file_loc(), 1, FT_REG_FILE, b"a", b"v")),
            "invalid data len",
        );
        refused(
            check_one(
                Key::new(256, DIR_ITEM_KEY, 1),
                dir_entry(file_loc(), 1, FT_REG_FILE, b"a", b""),
            ),
            "name hash mismatch",
        );
        refused(
            check_one(
                k(b"a"),
                dir_entry(Key::new(257, EXTENT_DATA_KEY, 0), 1, FT_REG_FILE, b"a", b""),
            ),
            "invalid location key type",
        );
        refused(
            check_one(
                k(b"a"),
                dir_entry(Key::new(257, INODE_ITEM_KEY, 4), 1, FT_REG_FILE, b"a", b""),
            ),
            "invalid location key offset",
        );
        refused(
            check_one(
                k(b"a"),
                dir_entry(Key::new(7, INODE_ITEM_KEY, 0), 1, FT_REG_FILE, b"a", b""),
            ),
            "invalid location key objectid",
        );
        refused(
            check_one(
                k(b"a"),
                dir_entry(Key::new(0, ROOT_ITEM_KEY, u64::MAX), 1, FT_DIR, b"a", b""),
            ),
            "root id 0",
        );
        refused(
            check_one(
                k(b"a"),
                dir_entry(
                    Key::new(EXTENT_TREE_OBJECTID, ROOT_ITEM_KEY, u64::MAX),
                    1,
                    FT_DIR,
                    b"a",
                    b"",
                ),
            ),
            "invalid location key objectid",
        );
        check_one(k(b"a"), dir_entry(Key::new(256, ROOT_ITEM_KEY, u64::MAX), 1, FT_DIR, b"a", b""))
            .expect("subvolume entry");
        let xk = Key::new(257, XATTR_ITEM_KEY, name_hash(b"user.a"));
        refused(check_one(xk, dir_entry(file_loc(), 1, FT_XATTR, b"user.a", b"")), "for an xattr");
        refused(
            check_one(xk, dir_entry(Key::new(0, 0, 0), 1, FT_REG_FILE, b"user.a", b"")),
            "for XATTR key",
        );
        let long = vec![b'n'; NAME_LEN + 1];
        refused(
            check_one(k(&long), dir_entry(file_loc(), 1, FT_REG_FILE, &long, b"")),
            "name len too long",
        );
        let mut cut = dir_entry(file_loc(), 1, FT_REG_FILE, b"abc", b"");
        cut.pop();
        refused(check_one(k(b"abc"), cut), "invalid dir item name or data len");
    }

    #[test]
    fn inode_refs_as_the_kernel() {
        let r = |name: &[u8]| {
            [InodeRef { index: 2u64.into(), name_len: (name.len() as u16).into() }.as_bytes(), name]
                .concat()
        };
        let long = vec![b'n'; 300];
        check_one(Key::new(257, INODE_REF_KEY, 256), r(&long))
            .expect("a 300-byte name: no kernel rule");
        check_one(Key::new(257, INODE_REF_KEY, 256), [r(b"a"), r(b"")].concat())
            .expect("an empty second name");
        refused(check_one(Key::new(257, INODE_REF_KEY, 256), r(b"")), "invalid item size");
        refused(check_one(Key::new(257, INODE_REF_KEY, 256), Vec::new()), "invalid item size");
        refused(
            check_one(Key::new(257, INODE_REF_KEY, 256), r(b"ab")[..11].to_vec()),
            "inode ref name len",
        );
        let x = |name: &[u8]| {
            [
                InodeExtref {
                    parent_objectid: 256u64.into(),
                    index: 2u64.into(),
                    name_len: (name.len() as u16).into(),
                }
                .as_bytes(),
                name,
            ]
            .concat()
        };
        check_one(Key::new(257, INODE_EXTREF_KEY, 5), Vec::new()).expect("an empty extref item");
        check_one(Key::new(257, INODE_EXTREF_KEY, 5), x(b"")).expect("an empty extref name");
        refused(
            check_one(Key::new(257, INODE_EXTREF_KEY, 5), x(b"ab")[..19].to_vec()),
            "inode extref name len",
        );
    }

    fn file_extent(
        type_: u8,
        generation: u64,
        ram_bytes: u64,
        compression: u8,
        body: [u64; 4],
    ) -> Vec<u8> {
        let h = FileExtentHeader {
            generation: generation.into(),
            ram_bytes: ram_bytes.into(),
            compression,
            encryption: 0,
            other_encoding: 0.into(),
            type_,
        };
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
        check_one(k(0), file_extent(FILE_EXTENT_REG, u64::MAX, 4096, 0, [1 << 20, 4096, 0, 4096]))
            .expect("future generation");
        check_one(k(0), file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 8192, 4096]))
            .expect("offset past ram_bytes");
        check_one(k(0), file_extent(FILE_EXTENT_REG, 1, 4096, 0, [u64::MAX - 4095, 8192, 0, 4096]))
            .expect("disk range past 2^64");
        let mut other = file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 0, 4096]);
        other[18] = 1;
        check_one(k(0), other).expect("other_encoding");
        let mut inline = file_extent(FILE_EXTENT_INLINE, 1, 1 << 30, 3, [0; 4]);
        inline.truncate(FILE_EXTENT_INLINE_DATA_START + 10);
        check_one(k(0), inline.clone()).expect("compressed inline extent claiming 1 GiB");
        // The kernel's rules.
        refused(check_one(k(4096), inline), "invalid file_offset for inline file extent");
        refused(
            check_one(k(100), file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 0, 4096])),
            "unaligned file_offset",
        );
        refused(
            check_one(k(0), file_extent(FILE_EXTENT_REG, 1, 4000, 0, [1 << 20, 4096, 0, 4096])),
            "invalid ram_bytes",
        );
        refused(
            check_one(k(0), file_extent(FILE_EXTENT_REG, 1, 4096, 4, [1 << 20, 4096, 0, 4096])),
            "invalid compression",
        );
        refused(
            check_one(
                k(1 << 40),
                file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 0, u64::MAX - 4095]),
            ),
            "extent end overflow",
        );
        let mut enc = file_extent(FILE_EXTENT_REG, 1, 4096, 0, [1 << 20, 4096, 0, 4096]);
        enc[17] = 1;
        refused(check_one(k(0), enc), "invalid encryption");
    }

    #[test]
    fn header_rules_as_the_kernel() {
        let name = b"a";
        let buf = leaf(
            FS_TREE_OBJECTID,
            &[(
                Key::new(256, DIR_ITEM_KEY, name_hash(name)),
                dir_entry(file_loc(), 1, FT_REG_FILE, name, b""),
            )],
        );
        // A block newer than the superblock is not refused by itself (the parent's
        // pointer says which generation to expect), nor a foreign chunk tree uuid.
        check_tree_block(&buf, &CheckCtx { super_generation: 1, ..ctx() })
            .expect("generation past the superblock's");
        refused(
            check_tree_block(&buf, &CheckCtx { chunk_tree_uuid: Some([1; 16]), ..ctx() }),
            "bad chunk_tree_uuid",
        );
        refused(
            check_tree_block(&buf, &CheckCtx { generation: Some(GEN + 1), ..ctx() }),
            "parent transid verify failed",
        );
        // Owners: log and relocation trees are not checked; a subvolume tree's block
        // may belong to any subvolume tree; others must match.
        check_tree_block(&buf, &CheckCtx { owner: Some(TREE_LOG_OBJECTID), ..ctx() })
            .expect("log tree");
        check_tree_block(&buf, &CheckCtx { owner: Some(257), ..ctx() })
            .expect("a snapshot sharing the block");
        refused(
            check_tree_block(&buf, &CheckCtx { owner: Some(DATA_RELOC_TREE_OBJECTID), ..ctx() }),
            "owner mismatch",
        );
        refused(
            check_tree_block(&buf, &CheckCtx { owner: Some(EXTENT_TREE_OBJECTID), ..ctx() }),
            "owner mismatch",
        );
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
        let item = (
            Key::new(256, DIR_ITEM_KEY, name_hash(name)),
            dir_entry(file_loc(), 1, FT_REG_FILE, name, b""),
        );
        let mut unwritten = leaf(FS_TREE_OBJECTID, std::slice::from_ref(&item));
        NodeMut::new(&mut unwritten).header_mut().flags = 0.into();
        let c = CsumType::Crc32c.compute(&unwritten[CSUM_SIZE..]);
        unwritten[..CSUM_SIZE].copy_from_slice(&c);
        refused(check_tree_block(&unwritten, &ctx()), "WRITTEN not set");
        // Empty leaves: never of these trees (unless relocation's), nor of tree 0.
        refused(check_tree_block(&leaf(FS_TREE_OBJECTID, &[]), &ctx()), "must never be empty");
        refused(
            check_tree_block(&leaf(DATA_RELOC_TREE_OBJECTID, &[]), &ctx()),
            "must never be empty",
        );
        refused(check_tree_block(&leaf(0, &[]), &ctx()), "root 0 is not defined");
        check_tree_block(&leaf(257, &[]), &ctx()).expect("an empty subvolume leaf");
        check_tree_block(&leaf(CSUM_TREE_OBJECTID, &[]), &ctx()).expect("an empty csum tree");
        let mut reloc = leaf(FS_TREE_OBJECTID, &[]);
        NodeMut::new(&mut reloc).header_mut().flags =
            (HEADER_FLAG_WRITTEN | HEADER_FLAG_RELOC).into();
        let c = CsumType::Crc32c.compute(&reloc[CSUM_SIZE..]);
        reloc[..CSUM_SIZE].copy_from_slice(&c);
        check_tree_block(&reloc, &ctx()).expect("an empty relocation leaf");
        refused(
            check_tree_block(&leaf(257, &[(Key::new(0, 0, 0), Vec::new())]), &ctx()),
            "bad key order",
        );
        // Overlapping file extents in one leaf.
        let fe = |off: u64, len: u64| {
            (
                Key::new(257, EXTENT_DATA_KEY, off),
                file_extent(FILE_EXTENT_REG, 1, 8192, 0, [1 << 20, 8192, 0, len]),
            )
        };
        check_tree_block(&leaf(257, &[fe(0, 4096), fe(4096, 4096)]), &ctx())
            .expect("adjacent extents");
        refused(
            check_tree_block(&leaf(257, &[fe(0, 8192), fe(4096, 4096)]), &ctx()),
            "goes beyond start offset",
        );
        let mut inline = file_extent(FILE_EXTENT_INLINE, 1, 100, 0, [0; 4]);
        inline.truncate(FILE_EXTENT_INLINE_DATA_START + 100);
        refused(
            check_tree_block(
                &leaf(257, &[(Key::new(257, EXTENT_DATA_KEY, 0), inline), fe(0, 4096)]),
                &ctx(),
            ),
            "key order",
        );
    }

    #[test]
    fn item_rules_the_kernel_has() {
        let mut ii = InodeItem::new_zeroed();
        ii.mode = (S_IFREG | 0o644 | 0x10000).into();
        refused(
            check_one(Key::new(257, INODE_ITEM_KEY, 0), ii.as_bytes().to_vec()),
            "unknown mode bit",
        );
        // Inline refs of one type in descending order of their offsets.
        let extent = |roots: &[u64]| {
            let mut v = ExtentItem {
                refs: (roots.len() as u64).into(),
                generation: 1.into(),
                flags: EXTENT_FLAG_TREE_BLOCK.into(),
            }
            .as_bytes()
            .to_vec();
            for r in roots {
                v.push(TREE_BLOCK_REF_KEY);
                v.extend_from_slice(&r.to_le_bytes());
            }
            v
        };
        let tree = |data| {
            check_tree_block(
                &leaf(EXTENT_TREE_OBJECTID, &[(Key::new(1 << 20, METADATA_ITEM_KEY, 0), data)]),
                &ctx(),
            )
        };
        tree(extent(&[258, 257])).expect("descending");
        refused(tree(extent(&[257, 258])), "inline ref out-of-order");
        let de = DevExtent {
            chunk_tree: 4.into(),
            chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(),
            chunk_offset: (1 << 20).into(),
            length: 4096.into(),
            chunk_tree_uuid: [9; 16],
        };
        refused(
            check_tree_block(
                &leaf(
                    DEV_TREE_OBJECTID,
                    &[(Key::new(1, DEV_EXTENT_KEY, 1 << 20), de.as_bytes().to_vec())],
                ),
                &ctx(),
            ),
            "chunk tree id",
        );
    }

    #[test]
    fn other_items_as_the_kernel() {
        // An empty csum item, a dev extent of length 0, a block group with unknown
        // flag bits: no kernel rule refuses them.
        let tree = |owner, key, data| check_tree_block(&leaf(owner, &[(key, data)]), &ctx());
        tree(
            CSUM_TREE_OBJECTID,
            Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 1 << 20),
            Vec::new(),
        )
        .expect("empty csum item");
        refused(
            tree(
                CSUM_TREE_OBJECTID,
                Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 1 << 20),
                vec![0; 5],
            ),
            "unaligned item size for csum item",
        );
        let de = DevExtent {
            chunk_tree: CHUNK_TREE_OBJECTID.into(),
            chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(),
            chunk_offset: (1 << 20).into(),
            length: 0.into(),
            chunk_tree_uuid: [9; 16],
        };
        tree(DEV_TREE_OBJECTID, Key::new(1, DEV_EXTENT_KEY, 1 << 20), de.as_bytes().to_vec())
            .expect("dev extent of length 0");
        let bg = |flags: u64| {
            BlockGroupItem {
                used: 0.into(),
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(),
                flags: flags.into(),
            }
            .as_bytes()
            .to_vec()
        };
        tree(
            EXTENT_TREE_OBJECTID,
            Key::new(1 << 20, BLOCK_GROUP_ITEM_KEY, 1 << 20),
            bg(BLOCK_GROUP_DATA | 1 << 40),
        )
        .expect("unknown block group bits");
        refused(
            tree(
                EXTENT_TREE_OBJECTID,
                Key::new(1 << 20, BLOCK_GROUP_ITEM_KEY, 1 << 20),
                bg(BLOCK_GROUP_DATA | BLOCK_GROUP_SYSTEM),
            ),
            "invalid block group type",
        );
        refused(
            tree(
                EXTENT_TREE_OBJECTID,
                Key::new(1 << 20, BLOCK_GROUP_ITEM_KEY, 1 << 20),
                bg(BLOCK_GROUP_DATA | BLOCK_GROUP_RAID1 | BLOCK_GROUP_DUP),
            ),
            "invalid profile",
        );
    }
}
