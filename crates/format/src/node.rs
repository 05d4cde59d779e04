//! Views over tree blocks: the header, a leaf's items and a node's key pointers.
//!
//! A `NodeRef` is only built over a buffer that `tree_checker::check_tree_block` has
//! accepted (or that a caller just built), so item offsets and sizes are in bounds and
//! indexing cannot fail. Neighbours: `tree_checker` (validation), core's node cache.

use crate::key::{DiskKey, Key};
use crate::structs::{Header, Item, KeyPtr};
use zerocopy::FromBytes;

pub const HEADER_SIZE: usize = core::mem::size_of::<Header>();
pub const ITEM_SIZE: usize = core::mem::size_of::<Item>();
pub const KEY_PTR_SIZE: usize = core::mem::size_of::<KeyPtr>();

/// Maximum items in a leaf / pointers in a node of `nodesize`.
pub fn max_leaf_items(nodesize: u32) -> usize {
    (nodesize as usize - HEADER_SIZE) / ITEM_SIZE
}
pub fn max_node_ptrs(nodesize: u32) -> usize {
    (nodesize as usize - HEADER_SIZE) / KEY_PTR_SIZE
}

/// Read the header of any buffer at least `HEADER_SIZE` long.
pub fn header(buf: &[u8]) -> Option<&Header> {
    Header::ref_from_prefix(buf).ok().map(|(h, _)| h)
}

/// A view of a validated tree block.
#[derive(Clone, Copy)]
pub struct NodeRef<'a> {
    buf: &'a [u8],
}

impl<'a> NodeRef<'a> {
    /// Wrap a buffer already accepted by the tree checker.
    pub fn new_checked(buf: &'a [u8]) -> NodeRef<'a> {
        assert!(buf.len() >= HEADER_SIZE, "tree block shorter than its header: {}", buf.len());
        NodeRef { buf }
    }

    pub fn bytes(&self) -> &'a [u8] {
        self.buf
    }
    pub fn header(&self) -> &'a Header {
        header(self.buf).expect("length checked in new_checked")
    }
    pub fn bytenr(&self) -> u64 {
        self.header().bytenr.get()
    }
    pub fn generation(&self) -> u64 {
        self.header().generation.get()
    }
    pub fn owner(&self) -> u64 {
        self.header().owner.get()
    }
    pub fn level(&self) -> u8 {
        self.header().level
    }
    pub fn is_leaf(&self) -> bool {
        self.level() == 0
    }
    pub fn nritems(&self) -> usize {
        self.header().nritems.get() as usize
    }

    /// The item header of leaf slot `slot`.
    pub fn item(&self, slot: usize) -> &'a Item {
        let off = HEADER_SIZE + slot * ITEM_SIZE;
        Item::ref_from_bytes(&self.buf[off..off + ITEM_SIZE]).expect("item header is unaligned 25 bytes")
    }

    /// The key of slot `slot` (leaf item or node pointer).
    pub fn key(&self, slot: usize) -> Key {
        if self.is_leaf() {
            Key::from(&self.item(slot).key)
        } else {
            Key::from(&self.key_ptr(slot).key)
        }
    }

    pub fn disk_key(&self, slot: usize) -> &'a DiskKey {
        if self.is_leaf() {
            &self.item(slot).key
        } else {
            &self.key_ptr(slot).key
        }
    }

    /// The data of leaf slot `slot`.
    pub fn item_data(&self, slot: usize) -> &'a [u8] {
        let it = self.item(slot);
        let start = HEADER_SIZE + it.offset.get() as usize;
        &self.buf[start..start + it.size.get() as usize]
    }

    pub fn key_ptr(&self, slot: usize) -> &'a KeyPtr {
        let off = HEADER_SIZE + slot * KEY_PTR_SIZE;
        KeyPtr::ref_from_bytes(&self.buf[off..off + KEY_PTR_SIZE]).expect("key ptr is unaligned 33 bytes")
    }

    pub fn blockptr(&self, slot: usize) -> u64 {
        self.key_ptr(slot).blockptr.get()
    }
    pub fn ptr_generation(&self, slot: usize) -> u64 {
        self.key_ptr(slot).generation.get()
    }

    /// Binary search for `key`: `Ok(slot)` when found, `Err(slot)` where it would go.
    pub fn search(&self, key: &Key) -> Result<usize, usize> {
        let (mut lo, mut hi) = (0usize, self.nritems());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.key(mid).cmp(key) {
                core::cmp::Ordering::Less => lo = mid + 1,
                core::cmp::Ordering::Greater => hi = mid,
                core::cmp::Ordering::Equal => return Ok(mid),
            }
        }
        Err(lo)
    }

    /// Bytes free in a leaf (between the item array and the packed data).
    pub fn leaf_free_space(&self) -> usize {
        let n = self.nritems();
        let data_start = if n == 0 { self.buf.len() - HEADER_SIZE } else { self.item(n - 1).offset.get() as usize };
        data_start - n * ITEM_SIZE
    }
}
