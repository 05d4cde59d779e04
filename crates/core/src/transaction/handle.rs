//! Transaction handles (the kernel's `btrfs_trans_handle`): every change of the trees
//! runs inside one.
//!
//! - `Transaction::start_transaction(at, items)` reserves metadata space for `items` item
//!   changes before anything changes (`btrfs_start_transaction` with its
//!   `btrfs_block_rsv`): a change that cannot fit fails there with ENOSPC, with nothing
//!   half-done. `join_transaction` reserves nothing. A start inside a live handle joins
//!   it and adds its reservation to the handle's.
//! - The tree blocks the handle allocates are charged to its reservation; past it they
//!   come out of the global reserve (`allocator::metadata_reserve`), as the kernel's
//!   handles fall back to the global block reserve. What is left returns at the end.
//! - The handle records the tree blocks it COWed, or found dirty and reused, and
//!   inhibits them from background writeback while it lives: writing one
//!   out would make the handle's next search COW it again. The record is a small
//!   fixed buffer inside the handle (`INHIBIT_SLOTS`), so a handle allocates nothing
//!   for it and ends by walking the slots it used; past the bound blocks are simply not
//!   inhibited (only extra COW is paid). A commit's writes never skip inhibited
//!   blocks. Everything is uninhibited when the handle ends or aborts, before the
//!   writeback that ends a change and before any commit.
//! - `end` (or `end_with`) ends the handle; at the outermost end the change's
//!   writeback runs. A handle dropped without ending (an early return after an error, a
//!   panic) aborts the transaction: the filesystem turns read-only.
//!
//! Tree mutators refuse to run outside a handle (`Transaction::in_handle`), so every
//! change is under one.

use super::Transaction;
use crate::error::Result;

/// The live handle's state, kept in the writer (a handle borrows the writer whole, so
/// there is one at a time; nested starts join it).
#[derive(Default)]
pub(crate) struct HandleState {
    /// Nested starts and joins of this handle.
    depth: u32,
    /// Metadata bytes reserved for this handle and not used yet.
    pub(crate) rsv: u64,
    /// Tree blocks inhibited from background writeback while the handle lives, each
    /// once (a dirty block's inhibitor count says whether it is listed: there is one
    /// handle at a time).
    inhibited: Inhibited,
    /// The commit's own handle: it ends without the writeback of a change (the commit
    /// writes every block itself).
    commit: bool,
    /// The outermost end is under way: nothing is inhibited any more.
    ending: bool,
}

/// Slots of a handle's inline inhibition buffer. Measured (docs/benchmarks.md,
/// the clone and dedupe benchmark): the handle of a 4 KiB clone or dedupe inhibits 3 blocks at the
/// median, 4 at p99 and 6 at most (the leaf and path it COWs in the subvolume tree;
/// extent and checksum tree changes wait for the commit's delayed refs); creates,
/// small writes, renames and unlinks in a directory of thousands of files 4 at the
/// median, 6 at p99, 9 at most. 16 holds every one of them with room for a split
/// path, and walking 16 slots costs less than one set node. A longer handle (a
/// large clone) fills it and inhibits no more: it pays extra COW if writeback runs
/// meanwhile, never an error.
pub const INHIBIT_SLOTS: usize = 16;

/// A record of the blocks a handle inhibits in place of the inline buffer
/// (`TestHooks::inhibit_record`): a benchmark (crates/bench, seed002) installs a set
/// made for each handle, the kernel's first design, as its baseline. The record made by
/// the hook is kept with the handle state from one handle to the next while the hook
/// stays set, as the buffer is; what it allocates for a handle is its own affair.
#[cfg(feature = "test-hooks")]
pub trait InhibitRecord: Send + Sync {
    /// Record `bytenr`, which is not listed yet; false when it is not recorded (the
    /// block stays writable by background writeback).
    fn push(&mut self, bytenr: u64) -> bool;
    /// Blocks recorded.
    fn len(&self) -> usize;
    /// Whether no block is recorded.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Call `f` on every block recorded, emptying the record (the handle ends).
    fn drain(&mut self, f: &mut dyn FnMut(u64));
}

/// Make the record of `TestHooks::inhibit_record`.
#[cfg(feature = "test-hooks")]
pub type InhibitRecordFn = fn() -> Box<dyn InhibitRecord>;

/// The blocks a handle inhibits: the inline buffer, or a record a benchmark installed.
#[derive(Default)]
struct Inhibited {
    slots: [u64; INHIBIT_SLOTS],
    len: usize,
    /// A record installed in place of the buffer (`TestHooks::inhibit_record`).
    #[cfg(feature = "test-hooks")]
    other: Option<Box<dyn InhibitRecord>>,
}

impl Inhibited {
    fn is_empty(&self) -> bool {
        #[cfg(feature = "test-hooks")]
        if let Some(r) = &self.other {
            return r.is_empty();
        }
        self.len == 0
    }

    #[cfg(any(test, feature = "test-hooks"))]
    fn len(&self) -> usize {
        #[cfg(feature = "test-hooks")]
        if let Some(r) = &self.other {
            return r.len();
        }
        self.len
    }

    /// Record `b` (not listed yet); false when the buffer is full.
    fn push(&mut self, b: u64) -> bool {
        #[cfg(feature = "test-hooks")]
        if let Some(r) = &mut self.other {
            return r.push(b);
        }
        if self.len == INHIBIT_SLOTS {
            return false;
        }
        self.slots[self.len] = b;
        self.len += 1;
        true
    }

    /// Every block listed, emptying the record.
    fn drain(&mut self, mut f: impl FnMut(u64)) {
        #[cfg(feature = "test-hooks")]
        if let Some(r) = &mut self.other {
            r.drain(&mut f);
            return;
        }
        self.slots[..self.len].iter().for_each(|&b| f(b));
        self.len = 0;
    }
}

/// What handles inhibited (`TestHooks::inhibit_stats`): blocks per handle ended, and
/// the inhibitions refused for a full buffer.
#[cfg(feature = "test-hooks")]
#[derive(Debug, Default, Clone)]
pub struct InhibitStats {
    pub per_handle: Vec<u16>,
    pub full: u64,
}

/// A transaction handle: the writer, borrowed for one change (see the module docs).
/// Dereferences to the writer for the change's work: the transaction itself, or a
/// writer of the layer above that holds it (`AsMut<Transaction>`, as
/// `inode::FsWriter`), so the change can call that layer's methods.
#[must_use = "a handle dropped without `end` aborts the transaction"]
pub struct TransHandle<'a, W: AsMut<Transaction> = Transaction> {
    w: &'a mut W,
    at: &'static str,
    ended: bool,
}

impl<W: AsMut<Transaction>> std::ops::Deref for TransHandle<'_, W> {
    type Target = W;
    fn deref(&self) -> &W {
        self.w
    }
}

impl<W: AsMut<Transaction>> std::ops::DerefMut for TransHandle<'_, W> {
    fn deref_mut(&mut self) -> &mut W {
        self.w
    }
}

impl AsMut<Transaction> for Transaction {
    fn as_mut(&mut self) -> &mut Transaction {
        self
    }
}

/// Start a handle on `w` for a change of about `items` items (`Transaction::start_transaction`).
///
/// # Errors
/// As `Transaction::start_transaction`.
pub fn start<'a, W: AsMut<Transaction>>(
    w: &'a mut W,
    at: &'static str,
    items: u64,
) -> Result<TransHandle<'a, W>> {
    let t = w.as_mut();
    t.check_writable()?;
    t.begin_change()?;
    let bytes = crate::space::allocator::reserve_metadata(t, items)?;
    t.open_handle(bytes, false);
    Ok(TransHandle { w, at, ended: false })
}

/// Start a handle on `w` with a reservation taken earlier (`reserve_metadata`), which it
/// takes over (a direct write reserves before its data I/O and changes the trees after
/// it).
///
/// # Errors
/// `Posix(ReadOnly)` after an abort (the reservation is released).
pub fn start_reserved<'a, W: AsMut<Transaction>>(
    w: &'a mut W,
    at: &'static str,
    bytes: u64,
) -> Result<TransHandle<'a, W>> {
    let t = w.as_mut();
    if let Err(e) = t.check_writable().and_then(|()| t.begin_change()) {
        crate::space::allocator::release_metadata(t, bytes);
        return Err(e);
    }
    t.open_handle(bytes, false);
    Ok(TransHandle { w, at, ended: false })
}

/// Run `f` on `w` in a handle reserving `items` items (`Transaction::transaction`).
///
/// # Errors
/// As `Transaction::transaction`.
pub fn run<W: AsMut<Transaction>, T>(
    w: &mut W,
    at: &'static str,
    items: u64,
    f: impl FnOnce(&mut W) -> Result<T>,
) -> Result<T> {
    let mut h = start(w, at, items)?;
    let r = f(&mut h);
    h.end_with(r)
}

impl Transaction {
    /// Start a handle for a change of about `items` items (`btrfs_start_transaction`):
    /// metadata space for them (a COW of a full-height path each, as the kernel's
    /// `btrfs_calc_insert_metadata_size`) is reserved now, on top of the global
    /// reserve. `at` names the change in an abort.
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after an abort; `Posix(NoSpace)` when the space cannot be
    /// found or made (nothing has changed then); chunk allocation failures.
    pub fn start_transaction(&mut self, at: &'static str, items: u64) -> Result<TransHandle<'_>> {
        start(self, at, items)
    }

    /// Join the running transaction with no reservation of its own
    /// (`btrfs_join_transaction`): for changes that only delete or rewrite, which the
    /// global reserve covers.
    ///
    /// # Errors
    /// `Posix(ReadOnly)` after an abort.
    pub fn join_transaction(&mut self, at: &'static str) -> Result<TransHandle<'_>> {
        self.start_transaction(at, 0)
    }

    /// The commit's own handle.
    pub(crate) fn commit_handle(&mut self) -> TransHandle<'_> {
        self.open_handle(0, true);
        TransHandle { w: self, at: "commit", ended: false }
    }

    /// Run `f` in a handle reserving `items` items: ended when `f` succeeds, the
    /// transaction aborted with `f`'s error when it fails.
    ///
    /// # Errors
    /// As `start_transaction`, then `f`'s error (which aborts).
    pub fn transaction<T>(
        &mut self,
        at: &'static str,
        items: u64,
        f: impl FnOnce(&mut Transaction) -> Result<T>,
    ) -> Result<T> {
        run(self, at, items, f)
    }

    fn open_handle(&mut self, rsv: u64, commit: bool) {
        match &mut self.handle {
            Some(h) => {
                h.depth += 1;
                h.rsv += rsv;
            }
            None => {
                if !self.held_for_views.is_empty() {
                    self.release_space_held_for_views();
                }
                let mut h = std::mem::take(&mut self.spare_handle);
                debug_assert!(h.inhibited.is_empty() && h.rsv == 0);
                // The installed record, made once while the hook stays set.
                #[cfg(feature = "test-hooks")]
                match self.hooks.inhibit_record {
                    Some(make) if h.inhibited.other.is_none() => h.inhibited.other = Some(make()),
                    Some(_) => {}
                    None => h.inhibited.other = None,
                }
                h.depth = 1;
                h.rsv = rsv;
                h.commit = commit;
                self.handle = Some(h);
            }
        }
    }

    /// Whether a handle of a change (not a commit's, not one ending) is live: where
    /// background writeback may come between its searches.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn in_change_handle(&self) -> bool {
        self.handle.as_ref().is_some_and(|h| !h.commit && !h.ending)
    }

    /// Whether a handle is live (tree mutators assert it).
    pub(crate) fn in_handle(&self) -> bool {
        self.handle.is_some()
    }

    /// Assert that a handle is live: tree mutators are crate-internal and reached only
    /// from changes that started one, so a miss is a bug in the crate, not bad input.
    pub(crate) fn assert_in_handle(&self, what: &str) {
        assert!(self.in_handle(), "{what} outside a transaction handle");
    }

    /// Charge a tree block just allocated to the live handle's reservation.
    pub(crate) fn charge_tree_block(&mut self) {
        let ns = u64::from(self.nodesize());
        let Some(h) = &mut self.handle else { return };
        let take = h.rsv.min(ns);
        h.rsv -= take;
        crate::space::allocator::release_metadata(self, take);
    }

    /// Inhibit dirty block `bytenr` from background writeback for the live handle
    /// (called when the handle COWs a block and when it reuses a dirty one).
    pub(crate) fn inhibit_writeback(&mut self, bytenr: u64) {
        #[cfg(feature = "test-hooks")]
        if self.hooks.no_writeback_inhibition {
            return;
        }
        let Some(h) = &mut self.handle else { return };
        // The commit writes every block itself; nothing of it is background writeback.
        if h.commit || h.ending {
            return;
        }
        let eb = self
            .dirty
            .get_mut(&bytenr)
            .unwrap_or_else(|| panic!("inhibiting block {bytenr}, which is not dirty"));
        if eb.writeback_inhibitors == 0 {
            if h.inhibited.push(bytenr) {
                eb.writeback_inhibitors = 1;
            } else {
                #[cfg(feature = "test-hooks")]
                if let Some(s) = &mut self.hooks.inhibit_stats {
                    s.full += 1;
                }
            }
        }
    }

    /// Tree blocks the live handle inhibits from writeback (tests).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn handle_inhibited_blocks(&self) -> usize {
        self.handle.as_ref().map_or(0, |h| h.inhibited.len())
    }

    /// Metadata bytes the live handle still holds reserved (tests).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn handle_reserved_bytes(&self) -> u64 {
        self.handle.as_ref().map_or(0, |h| h.rsv)
    }

    /// End one level of the handle. At the outermost, uninhibit its blocks (no
    /// writeback or commit may meet an inhibited block of an ending handle) and return
    /// true: the change's writeback may follow, still in the handle (running delayed
    /// refs changes trees), then `release_handle`.
    fn close_handle(&mut self) -> bool {
        let h = self.handle.as_mut().expect("a handle ends only once");
        h.depth -= 1;
        if h.depth > 0 {
            return false;
        }
        h.ending = true;
        #[cfg(feature = "test-hooks")]
        if let Some(s) = &mut self.hooks.inhibit_stats {
            s.per_handle.push(h.inhibited.len().min(usize::from(u16::MAX)) as u16);
        }
        let dirty = &mut self.dirty;
        h.inhibited.drain(|b| {
            // A block the handle freed, or one sealed meanwhile, is no longer dirty; a
            // freed block's address allocated again is listed twice.
            if let Some(eb) = dirty.get_mut(&b) {
                debug_assert!(
                    eb.writeback_inhibitors <= 1,
                    "block {b} inhibited by another handle"
                );
                eb.writeback_inhibitors = 0;
            }
        });
        true
    }

    /// Release an ended handle: its unused reservation returns.
    fn release_handle(&mut self) {
        let mut h = self.handle.take().expect("released once, after close_handle");
        debug_assert!(h.inhibited.is_empty(), "an ending handle inhibited blocks");
        let rsv = std::mem::take(&mut h.rsv);
        crate::space::allocator::release_metadata(self, rsv);
        h.ending = false;
        h.commit = false;
        self.spare_handle = h;
    }
}

impl<W: AsMut<Transaction>> TransHandle<'_, W> {
    /// End the handle (`btrfs_end_transaction`). At the outermost end the unused
    /// reservation returns, the inhibited blocks are released, and dirty metadata past
    /// the limit is written back (or, under the engine, sealed for it).
    ///
    /// # Errors
    /// Writeback failures, which abort.
    pub fn end(mut self) -> Result<()> {
        self.ended = true;
        if !self.w.as_mut().close_handle() {
            return Ok(());
        }
        let commit = self.w.as_mut().handle.as_ref().is_some_and(|h| h.commit);
        let r = if commit {
            Ok(())
        } else {
            let defer = self.w.as_mut().defer_writeback;
            self.w.as_mut().balance_dirty_metadata_with(defer)
        };
        self.w.as_mut().release_handle();
        if let Err(e) = &r {
            self.w.as_mut().abort(self.at, e);
        }
        r
    }

    /// End the handle and leave the writeback to the next handle's end (test hooks
    /// whose callers keep using a block they changed).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn end_without_writeback(mut self) {
        self.ended = true;
        if self.w.as_mut().close_handle() {
            self.w.as_mut().release_handle();
        }
    }

    /// End the handle after work that returned `r`: ended when `r` is `Ok`, the
    /// transaction aborted with the error otherwise.
    ///
    /// # Errors
    /// `r`'s error; as `end`.
    pub fn end_with<T>(mut self, r: Result<T>) -> Result<T> {
        match r {
            Ok(v) => self.end().map(|()| v),
            Err(e) => {
                self.w.as_mut().abort(self.at, &e);
                self.ended = true;
                if self.w.as_mut().close_handle() {
                    self.w.as_mut().release_handle();
                }
                Err(e)
            }
        }
    }
}

impl<W: AsMut<Transaction>> Drop for TransHandle<'_, W> {
    fn drop(&mut self) {
        if self.ended {
            return;
        }
        let why = if std::thread::panicking() { "a panic" } else { "an error" };
        self.w.as_mut().abort_because(
            self.at,
            &format!("the transaction handle was dropped before it ended, after {why}"),
        );
        if self.w.as_mut().close_handle() {
            self.w.as_mut().release_handle();
        }
    }
}
