//! The extent tree's items: EXTENT_ITEM and METADATA_ITEM with their inline backrefs,
//! and the keyed backrefs (tree block, shared block, extent data, shared data).

use super::{aligned, exact, read_prefix, CheckResult, ItemCtx, ParseResult};
use crate::hash::hash_extent_data_ref;
use crate::key::*;
use crate::structs::*;
use zerocopy::FromBytes;

/// One inline backref of an EXTENT_ITEM / METADATA_ITEM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InlineRef {
    TreeBlock { root: u64 },
    SharedBlock { parent: u64 },
    ExtentData { root: u64, objectid: u64, offset: u64, count: u32 },
    SharedData { parent: u64, count: u32 },
    Owner { root: u64 },
}

impl InlineRef {
    pub fn type_(&self) -> u8 {
        match self {
            InlineRef::TreeBlock { .. } => TREE_BLOCK_REF_KEY,
            InlineRef::SharedBlock { .. } => SHARED_BLOCK_REF_KEY,
            InlineRef::ExtentData { .. } => EXTENT_DATA_REF_KEY,
            InlineRef::SharedData { .. } => SHARED_DATA_REF_KEY,
            InlineRef::Owner { .. } => EXTENT_OWNER_REF_KEY,
        }
    }
    /// The count this ref contributes to `refs`.
    pub fn count(&self) -> u64 {
        match self {
            InlineRef::ExtentData { count, .. } | InlineRef::SharedData { count, .. } => {
                u64::from(*count)
            }
            InlineRef::Owner { .. } => 0,
            _ => 1,
        }
    }
}

/// A parsed extent item: header, optional tree_block_info, inline refs.
#[derive(Clone, Debug)]
pub struct ExtentItemView {
    pub refs: u64,
    pub generation: u64,
    pub flags: u64,
    pub tree_block_info: Option<(Key, u8)>,
    pub inline_refs: Vec<InlineRef>,
}

/// Parse an EXTENT_ITEM (`skinny == false`) or METADATA_ITEM (`skinny == true`) body.
pub fn extent_item(data: &[u8], skinny: bool) -> ParseResult<ExtentItemView> {
    let ei: &ExtentItem = read_prefix(data, "extent item")?;
    let flags = ei.flags.get();
    let mut pos = core::mem::size_of::<ExtentItem>();
    let mut tbi = None;
    if flags & EXTENT_FLAG_TREE_BLOCK != 0 && !skinny {
        let info: &TreeBlockInfo = read_prefix(&data[pos..], "tree block info")?;
        tbi = Some((Key::from(&info.key), info.level));
        pos += core::mem::size_of::<TreeBlockInfo>();
    }
    let mut refs = Vec::new();
    while pos < data.len() {
        let t = data[pos];
        pos += 1;
        let rest = &data[pos..];
        let need = |n: usize| -> ParseResult<()> {
            if rest.len() < n {
                Err(format!(
                    "invalid inline ref type {t} at {}: need {n} bytes, have {}",
                    pos - 1,
                    rest.len()
                ))
            } else {
                Ok(())
            }
        };
        let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let r = match t {
            TREE_BLOCK_REF_KEY => {
                need(8)?;
                pos += 8;
                InlineRef::TreeBlock { root: le64(rest) }
            }
            SHARED_BLOCK_REF_KEY => {
                need(8)?;
                pos += 8;
                InlineRef::SharedBlock { parent: le64(rest) }
            }
            EXTENT_OWNER_REF_KEY => {
                need(8)?;
                pos += 8;
                InlineRef::Owner { root: le64(rest) }
            }
            EXTENT_DATA_REF_KEY => {
                need(28)?;
                pos += 28;
                let d = ExtentDataRef::ref_from_prefix(rest).expect("length checked").0;
                InlineRef::ExtentData {
                    root: d.root.get(),
                    objectid: d.objectid.get(),
                    offset: d.offset.get(),
                    count: d.count.get(),
                }
            }
            SHARED_DATA_REF_KEY => {
                need(12)?;
                pos += 12;
                InlineRef::SharedData {
                    parent: le64(rest),
                    count: u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes")),
                }
            }
            _ => return Err(format!("invalid inline ref type {t}")),
        };
        refs.push(r);
    }
    Ok(ExtentItemView {
        refs: ei.refs.get(),
        generation: ei.generation.get(),
        flags,
        tree_block_info: tbi,
        inline_refs: refs,
    })
}

/// As check_extent_item (the item alone; overlaps with the previous item are the leaf's rule).
pub(crate) fn check_extent_item(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    let skinny = key.type_ == METADATA_ITEM_KEY;
    if !aligned(key.objectid, ctx.sectorsize) {
        return Err(format!(
            "invalid extent bytenr {}, not aligned to {}",
            key.objectid, ctx.sectorsize
        ));
    }
    if skinny && key.offset >= u64::from(MAX_LEVEL) {
        return Err(format!("invalid tree level {}", key.offset));
    }
    let v = extent_item(data, skinny)?;
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
        return Err(format!(
            "invalid extent length, have {} expect aligned to {}",
            key.offset, ctx.sectorsize
        ));
    }
    if let Some((_, level)) = v.tree_block_info {
        if level >= MAX_LEVEL {
            return Err(format!(
                "invalid tree block info level, have {level} expect [0, {}]",
                MAX_LEVEL - 1
            ));
        }
    }
    ctx.gen_ok(v.generation, "extent")?;
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
            InlineRef::ExtentData { root, objectid, offset, .. } => {
                hash_extent_data_ref(root, objectid, offset)
            }
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
    Ok(())
}

/// As check_simple_keyed_refs: TREE_BLOCK_REF, SHARED_BLOCK_REF and SHARED_DATA_REF.
pub(crate) fn check_simple_keyed_ref(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    let want =
        if key.type_ == SHARED_DATA_REF_KEY { core::mem::size_of::<SharedDataRef>() } else { 0 };
    if data.len() != want {
        return Err(format!(
            "invalid item size, have {} expect {want} for key type {}",
            data.len(),
            key.type_
        ));
    }
    if !aligned(key.objectid, ctx.sectorsize) {
        return Err(format!(
            "invalid key objectid for shared block ref, have {} expect aligned to {}",
            key.objectid, ctx.sectorsize
        ));
    }
    if key.type_ != TREE_BLOCK_REF_KEY && !aligned(key.offset, ctx.sectorsize) {
        return Err(format!(
            "invalid tree parent bytenr, have {} expect aligned to {}",
            key.offset, ctx.sectorsize
        ));
    }
    if key.type_ == SHARED_DATA_REF_KEY {
        let r: &SharedDataRef = read_prefix(data, "shared data ref")?;
        check_ref_values(
            &InlineRef::SharedData { parent: key.offset, count: r.count.get() },
            ctx.sectorsize,
        )?;
    }
    Ok(())
}

/// As check_extent_data_ref. Kept beyond it: exactly one ref per item. The kernel allows
/// several (hash collisions), but no kernel writes them: insert_extent_data_ref moves to
/// the next key offset on a collision, and our readers take one ref per item.
pub(crate) fn check_extent_data_ref(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    exact::<ExtentDataRef>(data, "extent data ref")?;
    if !aligned(key.objectid, ctx.sectorsize) {
        return Err(format!(
            "invalid key objectid for shared block ref, have {} expect aligned to {}",
            key.objectid, ctx.sectorsize
        ));
    }
    let d: &ExtentDataRef = read_prefix(data, "extent data ref")?;
    check_ref_values(
        &InlineRef::ExtentData {
            root: d.root.get(),
            objectid: d.objectid.get(),
            offset: d.offset.get(),
            count: d.count.get(),
        },
        ctx.sectorsize,
    )?;
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
        InlineRef::SharedBlock { parent } if !aligned(parent, sectorsize) => {
            Err(format!("invalid tree parent bytenr, have {parent} expect aligned to {sectorsize}"))
        }
        InlineRef::SharedData { parent, .. } if !aligned(parent, sectorsize) => {
            Err(format!("invalid data parent bytenr, have {parent} expect aligned to {sectorsize}"))
        }
        InlineRef::SharedData { count: 0, .. } => {
            Err("invalid shared data ref count, should have non-zero value".into())
        }
        InlineRef::ExtentData { root, objectid, offset, count } => {
            if !is_valid_dref_root(root) {
                return Err(format!("invalid data ref root value {root}"));
            }
            if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&objectid) {
                return Err(format!("invalid data ref objectid value {objectid}"));
            }
            if !aligned(offset, sectorsize) {
                return Err(format!(
                    "invalid data ref offset, have {offset} expect aligned to {sectorsize}"
                ));
            }
            if count == 0 {
                return Err("invalid data ref count, should have non-zero value".into());
            }
            Ok(())
        }
        _ => Ok(()),
    }
}
