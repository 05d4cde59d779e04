//! INODE_ITEM, INODE_REF and INODE_EXTREF: an inode and the names that point at it.

use super::{exact, packed_entries, read_prefix, CheckResult, ItemCtx, ParseResult};
use crate::key::*;
use crate::structs::*;

/// As check_inode_item with check_inode_key.
pub(crate) fn check_inode_item(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    exact::<InodeItem>(data, "inode")?;
    if key.offset != 0 {
        return Err(format!("invalid inode key offset {}", key.offset));
    }
    let ok_id = key.objectid >= FIRST_FREE_OBJECTID && key.objectid <= LAST_FREE_OBJECTID
        || key.objectid == ROOT_TREE_DIR_OBJECTID
        || key.objectid == FREE_INO_OBJECTID;
    if !ok_id {
        return Err(format!("invalid inode objectid {}", key.objectid));
    }
    let ii: &InodeItem = read_prefix(data, "inode")?;
    ctx.gen_ok(ii.generation.get(), "inode")?;
    ctx.gen_ok(ii.transid.get(), "inode transid")?;
    let mode = ii.mode.get();
    if mode & !(S_IFMT | 0o7777) != 0 {
        return Err(format!("unknown mode bit detected: {:#x}", mode & !(S_IFMT | 0o7777)));
    }
    if ft_from_mode(mode) == FT_UNKNOWN {
        return Err(format!("invalid inode mode {mode:#o}"));
    }
    if mode & S_IFMT == S_IFDIR && ii.nlink.get() > 1 {
        return Err(format!("invalid nlink {} for directory", ii.nlink.get()));
    }
    if ii.flags.get() & !INODE_FLAGS_MASK != 0 {
        return Err(format!("unknown inode flags {:#x}", ii.flags.get() & !INODE_FLAGS_MASK));
    }
    Ok(())
}

/// One name of an INODE_REF or INODE_EXTREF.
#[derive(Clone, Copy, Debug)]
pub struct InodeName<'a> {
    pub parent: u64,
    pub index: u64,
    pub name: &'a [u8],
}

/// Iterate INODE_REF entries; `parent` comes from the key offset.
pub fn inode_refs(data: &[u8], parent: u64) -> impl Iterator<Item = ParseResult<InodeName<'_>>> {
    packed_entries(data, move |rest| {
        let ir: &InodeRef = read_prefix(rest, "inode ref")?;
        let hdr = core::mem::size_of::<InodeRef>();
        let n = ir.name_len.get() as usize;
        if hdr + n > rest.len() {
            return Err(format!("invalid inode ref name len {n}, item left {}", rest.len()));
        }
        Ok((InodeName { parent, index: ir.index.get(), name: &rest[hdr..hdr + n] }, hdr + n))
    })
}

/// Iterate INODE_EXTREF entries.
pub fn inode_extrefs(data: &[u8]) -> impl Iterator<Item = ParseResult<InodeName<'_>>> {
    packed_entries(data, |rest| {
        let er: &InodeExtref = read_prefix(rest, "inode extref")?;
        let hdr = core::mem::size_of::<InodeExtref>();
        let n = er.name_len.get() as usize;
        if hdr + n > rest.len() {
            return Err(format!("invalid inode extref name len {n}, item left {}", rest.len()));
        }
        let e = InodeName {
            parent: er.parent_objectid.get(),
            index: er.index.get(),
            name: &rest[hdr..hdr + n],
        };
        Ok((e, hdr + n))
    })
}

/// As check_inode_ref: at least one header and a name byte; names are not otherwise
/// checked (the kernel has no rule on their length).
pub(crate) fn check_inode_ref(key: &Key, data: &[u8]) -> CheckResult {
    if data.len() <= core::mem::size_of::<InodeRef>() {
        return Err(format!(
            "invalid item size, have {} expect > {}",
            data.len(),
            core::mem::size_of::<InodeRef>()
        ));
    }
    for r in inode_refs(data, key.offset) {
        r?;
    }
    Ok(())
}

/// As check_inode_extref: only the entries' bounds (an empty item is accepted).
pub(crate) fn check_inode_extref(data: &[u8]) -> CheckResult {
    for r in inode_extrefs(data) {
        r?;
    }
    Ok(())
}
