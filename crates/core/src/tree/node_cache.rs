//! A bounded cache of validated tree blocks (CLOCK replacement).
//!
//! Bound: `capacity` blocks, from a byte budget / nodesize, never fewer than 32 so a
//! full root-to-leaf path (8 levels) plus siblings always fits. Entries are immutable
//! validated blocks, so a hit needs no re-check beyond the caller's parent expectations.

use crate::tree::extent_buffer::ExtentBuffer;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

struct Slot {
    eb: Arc<ExtentBuffer>,
    referenced: bool,
}

struct Inner {
    map: HashMap<u64, usize>,
    slots: Vec<Slot>,
    hand: usize,
}

pub struct NodeCache {
    inner: Mutex<Inner>,
    budget_bytes: Mutex<usize>,
    capacity: Mutex<usize>,
}

impl NodeCache {
    pub fn new(budget_bytes: usize) -> NodeCache {
        NodeCache {
            inner: Mutex::new(Inner { map: HashMap::new(), slots: Vec::new(), hand: 0 }),
            budget_bytes: Mutex::new(budget_bytes),
            capacity: Mutex::new(0),
        }
    }

    fn capacity(&self, nodesize: usize) -> usize {
        let mut c = self.capacity.lock().unwrap_or_else(|p| p.into_inner());
        if *c == 0 {
            *c = (*self.budget_bytes.lock().unwrap_or_else(|p| p.into_inner()) / nodesize.max(1))
                .max(32);
        }
        *c
    }

    pub fn get(&self, bytenr: u64) -> Option<Arc<ExtentBuffer>> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let idx = *g.map.get(&bytenr)?;
        let s = &mut g.slots[idx];
        s.referenced = true;
        Some(s.eb.clone())
    }

    pub fn insert(&self, eb: Arc<ExtentBuffer>) {
        let cap = self.capacity(eb.bytes().len());
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&idx) = g.map.get(&eb.bytenr) {
            g.slots[idx] = Slot { eb, referenced: true };
            return;
        }
        if g.slots.len() < cap {
            let idx = g.slots.len();
            g.map.insert(eb.bytenr, idx);
            g.slots.push(Slot { eb, referenced: false });
            return;
        }
        // CLOCK: at most two sweeps clear every referenced bit, so this ends.
        for _ in 0..2 * g.slots.len() + 1 {
            let h = g.hand;
            g.hand = (h + 1) % g.slots.len();
            if g.slots[h].referenced {
                g.slots[h].referenced = false;
                continue;
            }
            let old = g.slots[h].eb.bytenr;
            g.map.remove(&old);
            g.map.insert(eb.bytenr, h);
            g.slots[h] = Slot { eb, referenced: false };
            return;
        }
        unreachable!("clock sweep always finds a victim within two rounds");
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        *self.budget_bytes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Change the byte budget (a writer gives part of it to its dirty blocks). A smaller
    /// budget bounds the cache from here on; blocks already cached past it stay.
    pub fn set_budget(&self, bytes: usize) {
        *self.budget_bytes.lock().unwrap_or_else(|p| p.into_inner()) = bytes;
        *self.capacity.lock().unwrap_or_else(|p| p.into_inner()) = 0;
    }

    /// Drop the block at `bytenr`, if cached (its space was freed: a new block there must
    /// not be shadowed by the old one).
    pub fn remove(&self, bytenr: u64) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Some(idx) = g.map.remove(&bytenr) else { return };
        g.slots.swap_remove(idx);
        if idx < g.slots.len() {
            let moved = g.slots[idx].eb.bytenr;
            g.map.insert(moved, idx);
        }
        if g.hand >= g.slots.len() {
            g.hand = 0;
        }
    }

    pub fn clear(&self) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.map.clear();
        g.slots.clear();
        g.hand = 0;
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).slots.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
