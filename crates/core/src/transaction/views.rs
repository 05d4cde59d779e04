//! Readers' views that outlive the engine's lock, and the space they keep from reuse.
//!
//! A view of generation `g` reads the trees and data extents as generation `g` left
//! them (a committed snapshot for check, extract or a future send), or maps extents of
//! the running transaction and reads their data after dropping the lock. What it reads
//! must not be overwritten while it lives: space freed in transaction `f > g` goes back
//! to the allocator only once its commit is on disk and no view older than `f` remains
//! (the role of the kernel's tree-mod-seq list, which keeps old tree states readable
//! for backref walks).
//!
//! Views register under the engine's state lock (shared side), and the writer returns
//! freed space under the exclusive side, so a view either registers before the space it
//! may read is returned, or starts from a state that no longer uses it.

use crate::ids::Generation;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// The registry of live views, by generation (shared through `FsInfo`).
#[derive(Default)]
pub struct Views {
    by_gen: Mutex<BTreeMap<Generation, usize>>,
}

impl Views {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<Generation, usize>> {
        self.by_gen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register a view of generation `generation` until the guard drops.
    pub fn register(self: &Arc<Self>, generation: Generation) -> ViewGuard {
        *self.lock().entry(generation).or_insert(0) += 1;
        ViewGuard { views: self.clone(), generation }
    }

    /// The oldest generation a live view reads, if any view lives.
    pub fn oldest(&self) -> Option<Generation> {
        self.lock().keys().next().copied()
    }

    /// Whether space freed in transaction `freed_in` may be reused: no view of an
    /// older generation lives.
    pub fn may_reuse(&self, freed_in: Generation) -> bool {
        self.oldest().is_none_or(|g| g >= freed_in)
    }

    /// Number of live views (for tests and statistics).
    pub fn count(&self) -> usize {
        self.lock().values().sum()
    }
}

/// A registered view; dropping it ends the view.
pub struct ViewGuard {
    views: Arc<Views>,
    generation: Generation,
}

impl ViewGuard {
    /// The generation the view reads.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn generation(&self) -> Generation {
        self.generation
    }
}

impl Drop for ViewGuard {
    fn drop(&mut self) {
        let mut m = self.views.lock();
        let n = m.get_mut(&self.generation).expect("a registered view is counted");
        *n -= 1;
        if *n == 0 {
            m.remove(&self.generation);
        }
    }
}

impl std::fmt::Debug for ViewGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ViewGuard(generation {})", self.generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn space_is_reusable_only_past_the_oldest_view() {
        let v = Arc::new(Views::default());
        assert!(v.may_reuse(Generation(10)));
        let a = v.register(Generation(5));
        let b = v.register(Generation(5));
        let c = v.register(Generation(8));
        assert_eq!(v.oldest(), Some(Generation(5)));
        assert!(v.may_reuse(Generation(5)), "space freed in 5 was not in generation 5's trees");
        assert!(!v.may_reuse(Generation(6)));
        drop(a);
        assert!(!v.may_reuse(Generation(6)), "a second view of 5 lives");
        drop(b);
        assert_eq!(v.oldest(), Some(Generation(8)));
        assert!(v.may_reuse(Generation(8)) && !v.may_reuse(Generation(9)));
        assert_eq!(c.generation(), Generation(8));
        drop(c);
        assert_eq!((v.oldest(), v.count()), (None, 0));
    }
}
