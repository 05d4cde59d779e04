//! Item bodies by family: each file holds the parsers of its items (including the
//! variable-length ones: dir entries, inode refs, inline backrefs, chunk stripes, root
//! refs, file extents) and beside them the rules each item must meet when its leaf is
//! read (the kernel's per-type checks of tree-checker.c). `tree_checker` runs the rules;
//! everyone else uses the parsers.
//!
//! Each parser is total: given any bytes it returns a value or a reason string; the tree
//! checker turns reasons into `Corrupt` errors with the block and slot attached. After
//! an item's rule passed, its parser cannot fail on structure.

mod dir;
mod extent;
mod file_extent;
mod free_space;
mod inode;
mod root;
mod volumes;

pub use dir::{dir_entries, DirEntry};
pub use extent::{extent_item, ExtentItemView, InlineRef};
pub use file_extent::{file_extent, file_extent_reg_item, file_extent_reg_mut, FileExtent};
pub use inode::{inode_extrefs, inode_refs, InodeName};
pub use root::{
    qgroup_status_flags, root_item, root_ref, uuid_item_ids, RootItemView, RootRefEntry,
};
pub use volumes::{check_chunk, chunk, chunk_item_size, ChunkView};

use crate::csum::CsumType;
use crate::key::*;
use zerocopy::FromBytes;

pub type ParseResult<T> = core::result::Result<T, String>;

/// An item rule's verdict: the reason it fails, for the caller to attach block, slot and
/// key to.
pub type CheckResult = core::result::Result<(), String>;

/// What an item's rules need to know of the filesystem.
#[derive(Clone, Copy, Debug)]
pub struct ItemCtx {
    pub nodesize: u32,
    pub sectorsize: u32,
    pub csum_type: CsumType,
    pub super_generation: u64,
}

impl ItemCtx {
    /// A generation may be at most one past the superblock's (the running transaction's).
    fn gen_ok(&self, g: u64, what: &str) -> CheckResult {
        if g > self.super_generation.saturating_add(1) {
            Err(format!(
                "invalid {what} generation {g}, super generation {}",
                self.super_generation
            ))
        } else {
            Ok(())
        }
    }
}

/// Check one item's body against its key, by its type (the kernel's check_leaf_item).
/// Types without a rule pass.
///
/// # Errors
/// A reason string; the caller attaches block, slot and key.
pub fn check_item(key: &Key, data: &[u8], ctx: &ItemCtx) -> CheckResult {
    match key.type_ {
        INODE_ITEM_KEY => inode::check_inode_item(key, data, ctx),
        DIR_ITEM_KEY | DIR_INDEX_KEY | XATTR_ITEM_KEY => dir::check_dir_item(key, data, ctx),
        INODE_REF_KEY => inode::check_inode_ref(key, data),
        INODE_EXTREF_KEY => inode::check_inode_extref(data),
        EXTENT_DATA_KEY => file_extent::check_file_extent(key, data, ctx),
        EXTENT_CSUM_KEY => file_extent::check_csum_item(key, data, ctx),
        ROOT_ITEM_KEY => root::check_root_item(key, data, ctx),
        ROOT_REF_KEY | ROOT_BACKREF_KEY => root::check_root_ref(data),
        CHUNK_ITEM_KEY => volumes::check_chunk_item(key, data, ctx),
        DEV_ITEM_KEY => volumes::check_dev_item(key, data),
        DEV_EXTENT_KEY => volumes::check_dev_extent(key, data, ctx),
        BLOCK_GROUP_ITEM_KEY => volumes::check_block_group_item(key, data),
        EXTENT_ITEM_KEY | METADATA_ITEM_KEY => extent::check_extent_item(key, data, ctx),
        TREE_BLOCK_REF_KEY | SHARED_BLOCK_REF_KEY | SHARED_DATA_REF_KEY => {
            extent::check_simple_keyed_ref(key, data, ctx)
        }
        EXTENT_DATA_REF_KEY => extent::check_extent_data_ref(key, data, ctx),
        FREE_SPACE_INFO_KEY => free_space::check_free_space_info(key, data, ctx),
        FREE_SPACE_BITMAP_KEY => free_space::check_free_space_bitmap(key, data, ctx),
        UUID_KEY_SUBVOL | UUID_KEY_RECEIVED_SUBVOL => root::check_uuid_item(data),
        QGROUP_STATUS_KEY | QGROUP_INFO_KEY | QGROUP_LIMIT_KEY => {
            root::check_qgroup_item(key, data)
        }
        _ => Ok(()),
    }
}

/// Read a fixed-size struct from the front of `data`.
pub fn read_prefix<'a, T: FromBytes + zerocopy::KnownLayout + zerocopy::Immutable>(
    data: &'a [u8],
    what: &str,
) -> ParseResult<&'a T> {
    T::ref_from_prefix(data).map(|(t, _)| t).map_err(|_| {
        format!(
            "invalid {what} size, have {} expect at least {}",
            data.len(),
            core::mem::size_of::<T>()
        )
    })
}

/// Iterate the entries packed back to back in an item body (dir entries, inode refs):
/// `one` parses the entry at the front of what is left and says how many bytes it
/// took. The first failure is the last item yielded.
fn packed_entries<'a, T: 'a>(
    data: &'a [u8],
    one: impl Fn(&'a [u8]) -> ParseResult<(T, usize)> + 'a,
) -> impl Iterator<Item = ParseResult<T>> + 'a {
    let mut rest = data;
    let mut failed = false;
    core::iter::from_fn(move || {
        if rest.is_empty() || failed {
            return None;
        }
        Some(match one(rest) {
            Ok((e, used)) => {
                rest = &rest[used..];
                Ok(e)
            }
            Err(r) => {
                failed = true;
                Err(r)
            }
        })
    })
}

/// Format a uuid as 8-4-4-4-12 hex.
pub fn uuid_str(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

fn aligned(v: u64, a: u32) -> bool {
    v.is_multiple_of(u64::from(a))
}

/// The item is exactly one `T`.
fn exact<T>(data: &[u8], what: &str) -> CheckResult {
    let want = core::mem::size_of::<T>();
    if data.len() != want {
        return Err(format!("invalid {what} item size, have {} expect {want}", data.len()));
    }
    Ok(())
}
