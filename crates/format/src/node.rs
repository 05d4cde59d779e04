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
        Item::ref_from_bytes(&self.buf[off..off + ITEM_SIZE])
            .expect("item header is unaligned 25 bytes")
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
        KeyPtr::ref_from_bytes(&self.buf[off..off + KEY_PTR_SIZE])
            .expect("key ptr is unaligned 33 bytes")
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
        let data_start = if n == 0 {
            self.buf.len() - HEADER_SIZE
        } else {
            self.item(n - 1).offset.get() as usize
        };
        data_start - n * ITEM_SIZE
    }
}

/// A mutable view of a tree block being built or changed by the write path. It keeps
/// the leaf layout rules (item data packed from the end, no gaps) when items are
/// inserted, deleted, grown or shrunk; callers check free space first.
pub struct NodeMut<'a> {
    buf: &'a mut [u8],
}

impl<'a> NodeMut<'a> {
    pub fn new(buf: &'a mut [u8]) -> NodeMut<'a> {
        assert!(buf.len() >= HEADER_SIZE, "tree block shorter than its header: {}", buf.len());
        NodeMut { buf }
    }

    pub fn as_ref(&self) -> NodeRef<'_> {
        NodeRef { buf: self.buf }
    }

    pub fn header_mut(&mut self) -> &mut Header {
        Header::mut_from_prefix(self.buf).expect("length checked in new").0
    }

    pub fn set_nritems(&mut self, n: usize) {
        self.header_mut().nritems = (n as u32).into();
    }

    fn data_area(&self) -> usize {
        self.buf.len() - HEADER_SIZE
    }

    /// Offset (from the end of the header) where packed item data begins.
    pub fn leaf_data_end(&self) -> usize {
        let n = self.as_ref().nritems();
        if n == 0 {
            self.data_area()
        } else {
            self.as_ref().item(n - 1).offset.get() as usize
        }
    }

    pub fn item_mut(&mut self, slot: usize) -> &mut Item {
        let off = HEADER_SIZE + slot * ITEM_SIZE;
        Item::mut_from_bytes(&mut self.buf[off..off + ITEM_SIZE]).expect("item header is 25 bytes")
    }

    pub fn key_ptr_mut(&mut self, slot: usize) -> &mut KeyPtr {
        let off = HEADER_SIZE + slot * KEY_PTR_SIZE;
        KeyPtr::mut_from_bytes(&mut self.buf[off..off + KEY_PTR_SIZE]).expect("key ptr is 33 bytes")
    }

    /// Set the key of a leaf item or node pointer.
    pub fn set_key(&mut self, slot: usize, key: &Key) {
        if self.as_ref().is_leaf() {
            self.item_mut(slot).key = key.to_disk();
        } else {
            self.key_ptr_mut(slot).key = key.to_disk();
        }
    }

    pub fn set_ptr(&mut self, slot: usize, key: &Key, blockptr: u64, generation: u64) {
        let p = self.key_ptr_mut(slot);
        p.key = key.to_disk();
        p.blockptr = blockptr.into();
        p.generation = generation.into();
    }

    /// Like `item_data_mut`, keeping the block's borrow.
    pub fn into_item_data_mut(self, slot: usize) -> &'a mut [u8] {
        let (off, size) = {
            let it = self.as_ref().item(slot);
            (it.offset.get() as usize, it.size.get() as usize)
        };
        &mut self.buf[HEADER_SIZE + off..HEADER_SIZE + off + size]
    }

    pub fn item_data_mut(&mut self, slot: usize) -> &mut [u8] {
        let (off, size) = {
            let it = self.as_ref().item(slot);
            (it.offset.get() as usize, it.size.get() as usize)
        };
        &mut self.buf[HEADER_SIZE + off..HEADER_SIZE + off + size]
    }

    /// Make room for an item of `size` bytes at `slot` with `key`; its data is zeroed.
    /// The caller has checked `leaf_free_space() >= ITEM_SIZE + size`.
    pub fn insert_item(&mut self, slot: usize, key: &Key, size: usize) {
        let n = self.as_ref().nritems();
        assert!(slot <= n, "insert slot {slot} > nritems {n}");
        let free = self.as_ref().leaf_free_space();
        assert!(free >= ITEM_SIZE + size, "insert of {size} bytes into leaf with {free} free");
        let data_end = self.leaf_data_end();
        let old_data = if slot == n {
            data_end
        } else {
            let it = self.as_ref().item(slot);
            it.offset.get() as usize + it.size.get() as usize
        };
        if slot < n {
            // Shift the data of items slot.. down by `size`, then their headers right.
            self.buf.copy_within(
                HEADER_SIZE + data_end..HEADER_SIZE + old_data,
                HEADER_SIZE + data_end - size,
            );
            for i in slot..n {
                let it = self.item_mut(i);
                it.offset = (it.offset.get() - size as u32).into();
            }
            let src = HEADER_SIZE + slot * ITEM_SIZE;
            self.buf.copy_within(src..HEADER_SIZE + n * ITEM_SIZE, src + ITEM_SIZE);
        }
        {
            let it = self.item_mut(slot);
            it.key = key.to_disk();
            it.offset = ((old_data - size) as u32).into();
            it.size = (size as u32).into();
        }
        self.set_nritems(n + 1);
        self.buf[HEADER_SIZE + old_data - size..HEADER_SIZE + old_data].fill(0);
    }

    /// Remove `nr` items starting at `slot`, closing the gap in the data area.
    pub fn delete_items(&mut self, slot: usize, nr: usize) {
        let n = self.as_ref().nritems();
        assert!(nr > 0 && slot + nr <= n, "delete {nr} items at {slot} of {n}");
        let data_end = self.leaf_data_end();
        let last_off = self.as_ref().item(slot + nr - 1).offset.get() as usize;
        let dsize: usize =
            (slot..slot + nr).map(|i| self.as_ref().item(i).size.get() as usize).sum();
        if slot + nr < n {
            self.buf.copy_within(
                HEADER_SIZE + data_end..HEADER_SIZE + last_off,
                HEADER_SIZE + data_end + dsize,
            );
            for i in slot + nr..n {
                let it = self.item_mut(i);
                it.offset = (it.offset.get() + dsize as u32).into();
            }
            let src = HEADER_SIZE + (slot + nr) * ITEM_SIZE;
            self.buf.copy_within(src..HEADER_SIZE + n * ITEM_SIZE, HEADER_SIZE + slot * ITEM_SIZE);
        }
        self.set_nritems(n - nr);
    }

    /// Grow item `slot` by `by` bytes at its end (new bytes zeroed).
    pub fn extend_item(&mut self, slot: usize, by: usize) {
        let n = self.as_ref().nritems();
        assert!(slot < n, "extend slot {slot} >= {n}");
        assert!(self.as_ref().leaf_free_space() >= by, "extend by {by} without room");
        let data_end = self.leaf_data_end();
        let (off, size) = {
            let it = self.as_ref().item(slot);
            (it.offset.get() as usize, it.size.get() as usize)
        };
        self.buf.copy_within(
            HEADER_SIZE + data_end..HEADER_SIZE + off + size,
            HEADER_SIZE + data_end - by,
        );
        for i in slot..n {
            let it = self.item_mut(i);
            it.offset = (it.offset.get() - by as u32).into();
        }
        let it = self.item_mut(slot);
        it.size = ((size + by) as u32).into();
        let new_off = off - by;
        self.buf[HEADER_SIZE + new_off + size..HEADER_SIZE + new_off + size + by].fill(0);
    }

    /// Shrink item `slot` to `new_size`, keeping its first `new_size` bytes.
    pub fn truncate_item(&mut self, slot: usize, new_size: usize) {
        let n = self.as_ref().nritems();
        assert!(slot < n, "truncate slot {slot} >= {n}");
        let data_end = self.leaf_data_end();
        let (off, size) = {
            let it = self.as_ref().item(slot);
            (it.offset.get() as usize, it.size.get() as usize)
        };
        assert!(new_size <= size, "truncate to {new_size} > size {size}");
        let delta = size - new_size;
        if delta == 0 {
            return;
        }
        self.buf.copy_within(
            HEADER_SIZE + data_end..HEADER_SIZE + off + new_size,
            HEADER_SIZE + data_end + delta,
        );
        for i in slot..n {
            let it = self.item_mut(i);
            it.offset = (it.offset.get() + delta as u32).into();
        }
        self.item_mut(slot).size = (new_size as u32).into();
    }

    /// Insert a node pointer at `slot`.
    pub fn insert_ptr(&mut self, slot: usize, key: &Key, blockptr: u64, generation: u64) {
        let n = self.as_ref().nritems();
        assert!(
            slot <= n && n < max_node_ptrs(self.buf.len() as u32),
            "insert ptr at {slot} of {n}"
        );
        let src = HEADER_SIZE + slot * KEY_PTR_SIZE;
        self.buf.copy_within(src..HEADER_SIZE + n * KEY_PTR_SIZE, src + KEY_PTR_SIZE);
        self.set_ptr(slot, key, blockptr, generation);
        self.set_nritems(n + 1);
    }

    /// Remove the node pointer at `slot`.
    pub fn delete_ptr(&mut self, slot: usize) {
        let n = self.as_ref().nritems();
        assert!(slot < n, "delete ptr {slot} of {n}");
        let src = HEADER_SIZE + (slot + 1) * KEY_PTR_SIZE;
        self.buf.copy_within(src..HEADER_SIZE + n * KEY_PTR_SIZE, src - KEY_PTR_SIZE);
        self.set_nritems(n - 1);
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;

    fn leaf(nodesize: usize) -> Vec<u8> {
        let mut b = vec![0u8; nodesize];
        NodeMut::new(&mut b).set_nritems(0);
        b
    }

    fn check_layout(b: &[u8]) {
        let n = NodeRef::new_checked(b);
        let mut end = b.len() - HEADER_SIZE;
        for i in 0..n.nritems() {
            let it = n.item(i);
            assert_eq!(it.offset.get() as usize + it.size.get() as usize, end, "slot {i}");
            end = it.offset.get() as usize;
            if i > 0 {
                assert!(n.key(i - 1) < n.key(i));
            }
        }
    }

    #[test]
    fn insert_delete_extend_truncate_keep_layout() {
        let mut b = leaf(4096);
        let mut m = NodeMut::new(&mut b);
        for (slot, k, sz) in [(0, 10, 5), (1, 30, 7), (1, 20, 3), (0, 5, 0), (4, 40, 11)] {
            m.insert_item(slot, &Key::new(k, 1, 0), sz);
            let d = m.item_data_mut(slot);
            d.fill(k as u8);
        }
        check_layout(&b);
        let n = NodeRef::new_checked(&b);
        let keys: Vec<u64> = (0..n.nritems()).map(|i| n.key(i).objectid).collect();
        assert_eq!(keys, vec![5, 10, 20, 30, 40]);
        assert_eq!(n.item_data(2), &[20, 20, 20]);
        assert_eq!(n.item_data(4), &[40; 11]);
        let mut m = NodeMut::new(&mut b);
        m.extend_item(2, 4);
        assert_eq!(m.as_ref().item_data(2), &[20, 20, 20, 0, 0, 0, 0]);
        m.truncate_item(4, 2);
        assert_eq!(m.as_ref().item_data(4), &[40, 40]);
        assert_eq!(m.as_ref().item_data(3), &[30; 7]);
        m.delete_items(1, 2);
        check_layout(&b);
        let n = NodeRef::new_checked(&b);
        let keys: Vec<u64> = (0..n.nritems()).map(|i| n.key(i).objectid).collect();
        assert_eq!(keys, vec![5, 30, 40]);
        assert_eq!(n.item_data(1), &[30; 7]);
        assert_eq!(n.item_data(2), &[40, 40]);
    }

    #[test]
    fn node_ptrs() {
        let mut b = vec![0u8; 4096];
        let mut m = NodeMut::new(&mut b);
        m.header_mut().level = 1;
        m.set_nritems(0);
        m.insert_ptr(0, &Key::new(2, 0, 0), 8192, 5);
        m.insert_ptr(0, &Key::new(1, 0, 0), 4096, 5);
        m.insert_ptr(2, &Key::new(3, 0, 0), 12288, 6);
        m.delete_ptr(1);
        let n = m.as_ref();
        assert_eq!(n.nritems(), 2);
        assert_eq!(n.blockptr(0), 4096);
        assert_eq!(n.blockptr(1), 12288);
        assert_eq!(n.ptr_generation(1), 6);
    }
}
