//! The running transaction (the kernel's `btrfs_fs_info` write state plus
//! `btrfs_transaction`): `Transaction` holds the dirty tree blocks, the roots, the
//! allocator, the delayed refs and the commit. It knows no inode: the writer of the
//! layer above (`inode::FsWriter`) holds it, and hears of each file extent item change
//! through `file_extents_changed`.
//!
//! Invariants:
//! - Every tree block changed in the running transaction lives in `dirty`, carries
//!   header generation == `transid`, and is reached from its root only through blocks
//!   that are themselves dirty (COW is top-down). A block of an older generation is
//!   never modified in place; it is copied to a newly allocated block first.
//! - Committed blocks are never overwritten: their space returns to the allocator only
//!   after the commit that stops referencing them (pinned until then).
//! - Every change of a tree runs in a transaction handle (`handle`): the mutators
//!   assert one is live. A handle reserves the change's metadata before it begins,
//!   records the blocks it COWed (inhibiting their background writeback while it
//!   lives), and aborts the transaction if it is dropped without ending.
//! - After a failure once a change has begun, the abort is recorded in `FsInfo` and every later write
//!   fails with a read-only error (the kernel's `btrfs_abort_transaction`).
//! - Tree blocks are `ExtentBuffer`s: dirty ones belong to the running transaction
//!   (`dirty`), written ones are sealed and never change again.
//! - Every block passes the tree checker before any block of the commit is written; a
//!   block that fails is an error that aborts the commit (the kernel's -EUCLEAN on
//!   write), so a refused commit leaves the image as the last commit left it.
//!
//! Neighbours: `tree::modify` (B-tree changes over these blocks), `extent::delayed_ref`
//! and `extent::extent_tree` (reference counting run at commit), `space::allocator`
//! (block groups and free space), `disk_io` (the read side, whose cache receives blocks
//! after commit).

pub mod handle;
pub mod views;

pub use handle::TransHandle;

use crate::disk_io::{Expect, ExtentBuffer, FsInfo, OpenOptions};
use crate::error::{Error, PosixKind, Result};
use crate::ids::Generation;
use crate::tree::search::RootInfo;
use crate::tree::search::{NodeHandle, TreeView};
use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::{items, Corrupt, CorruptWhere, Key, NodeRef};
use zerocopy::{FromZeros, IntoBytes};

/// A tree block as the write path sees it: ours (dirty, mutable) or committed.
#[derive(Clone)]
pub enum Blk {
    Dirty(u64),
    Clean(Arc<ExtentBuffer>),
}

impl Blk {
    pub fn bytenr(&self) -> u64 {
        match self {
            Blk::Dirty(b) => *b,
            Blk::Clean(eb) => eb.bytenr,
        }
    }
}

/// A tree block as the live view hands it out: a block of the running transaction
/// (borrowed from the writer, so it cannot change while held) or a committed one.
#[derive(Clone)]
pub enum BlkRef<'a> {
    Dirty(u64, &'a [u8]),
    Clean(Arc<ExtentBuffer>),
}

impl NodeHandle for BlkRef<'_> {
    fn node(&self) -> NodeRef<'_> {
        match self {
            BlkRef::Dirty(_, buf) => NodeRef::new_checked(buf),
            BlkRef::Clean(eb) => eb.node(),
        }
    }
    fn bytenr(&self) -> u64 {
        match self {
            BlkRef::Dirty(b, _) => *b,
            BlkRef::Clean(eb) => eb.bytenr,
        }
    }
}

/// The running transaction as a reader sees it: every change made through the writer,
/// committed or not, over the committed trees (read-your-writes).
#[derive(Clone, Copy)]
pub struct Live<'a> {
    w: &'a Transaction,
    /// Set for a reader that holds the engine's lock only while it runs (`Engine::read`):
    /// a cache miss is not read under the lock but recorded here, and the reader is run
    /// again once the block has been read without it.
    misses: Option<&'a ReadMisses>,
}

/// Most times one `Engine::read` call gives up the lock to read a block; past it, the
/// rest of its misses are read under the lock (so a cold scan of many blocks is not
/// restarted without end).
const READ_RETRIES: usize = 32;

/// The cache misses of one reader run outside the writer (`Engine::read`), the role of
/// `read_block_for_search`'s -EAGAIN: a committed block the reader needs and the cache
/// lacks is read after the lock is dropped, then the reader runs again.
#[derive(Default)]
pub struct ReadMisses {
    /// Blocks read without the lock for this reader, kept until it ends (the cache may
    /// evict them before the rerun).
    fetched: Mutex<HashMap<u64, Arc<ExtentBuffer>>>,
    /// The block the last run stopped at.
    wanted: Mutex<Option<(u64, Expect)>>,
    /// Times the lock was dropped so far.
    retries: AtomicUsize,
    /// Misses are read under the lock from now on (retries used up, or a failed read
    /// the reader must see itself).
    under_lock: AtomicBool,
}

impl ReadMisses {
    fn lock_fetched(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ExtentBuffer>>> {
        self.fetched.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The block the last run stopped at, if it stopped at one.
    pub fn take_wanted(&self) -> Option<(u64, Expect)> {
        self.wanted.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Keep a block read without the lock for the reader's next run.
    pub fn keep(&self, eb: Arc<ExtentBuffer>) {
        if self.retries.fetch_add(1, Ordering::Relaxed) + 1 >= READ_RETRIES {
            self.under_lock.store(true, Ordering::Relaxed);
        }
        self.lock_fetched().insert(eb.bytenr, eb);
    }

    /// A block missing from the writer's memory, met by a reader run or a probed writer
    /// run: the copy this call already read, or a recorded miss that stops the run
    /// (`Err`), or `None` to read it under the lock. Only a committed block is read
    /// without the lock: it cannot be reused before the next commit, so a rerun that
    /// still points at it finds what was read. A block this transaction wrote early
    /// could be freed and its address handed out again within the transaction.
    fn meet(
        &self,
        w: &Transaction,
        bytenr: u64,
        expect: &Expect,
    ) -> Option<Result<Arc<ExtentBuffer>>> {
        if let Some(eb) = self.lock_fetched().get(&bytenr).filter(|eb| eb.matches(expect)) {
            return Some(Ok(eb.clone()));
        }
        let committed = expect.generation.is_some_and(|g| g < w.transid);
        if committed
            && !self.under_lock.load(Ordering::Relaxed)
            && !w.in_flight_has(bytenr)
            && w.info.cache.get(bytenr).is_none_or(|eb| !eb.matches(expect))
        {
            *self.wanted.lock().unwrap_or_else(|p| p.into_inner()) = Some((bytenr, *expect));
            return Some(Err(miss_error(bytenr)));
        }
        None
    }

    /// Read the remaining misses under the lock.
    pub fn read_under_lock(&self) {
        self.under_lock.store(true, Ordering::Relaxed);
    }
}

/// What a reader run returns when it stopped at a cache miss: never seen by callers
/// of `Engine::read` or `Engine::write_retrying`, which run the closure again.
fn miss_error(bytenr: u64) -> Error {
    Error::CacheMiss { bytenr }
}

impl Live<'_> {
    /// The generation last committed by the writer (or found at open).
    pub fn committed_generation(&self) -> Generation {
        Generation(self.w.sb.generation.get())
    }

    /// Blocks of the running transactions written before their commit, so far.
    pub fn blocks_written_early(&self) -> u64 {
        self.w.written_early
    }

    /// The running transaction's id.
    pub fn transid(&self) -> Generation {
        Generation(self.w.transid)
    }

    /// The filesystem this transaction changes.
    pub(crate) fn fs_info(&self) -> &FsInfo {
        &self.w.info
    }

    /// The default subvolume, as the running transaction has it.
    pub(crate) fn default_subvol(&self) -> u64 {
        self.w.default_subvol
    }
}

impl<'a> TreeView for Live<'a> {
    type Node = BlkRef<'a>;
    fn read_node(&self, bytenr: u64, expect: &Expect) -> Result<BlkRef<'a>> {
        match self.w.dirty.get(&bytenr) {
            Some(_) if expect.generation.is_some_and(|g| g != self.w.transid) => {
                let g = expect.generation.unwrap_or_default();
                Err(in_use_reallocated(bytenr, expect.owner, format!("tree block {bytenr} of generation {g} is in use, yet this transaction ({}) allocated it again", self.w.transid)))
            }
            Some(d) => Ok(BlkRef::Dirty(bytenr, &d.data)),
            None => {
                if let Some(r) = self.misses.and_then(|m| m.meet(self.w, bytenr, expect)) {
                    return r.map(BlkRef::Clean);
                }
                Ok(BlkRef::Clean(self.w.read_clean(bytenr, expect)?))
            }
        }
    }
    fn tree_root(&self) -> RootInfo {
        self.w.roots.get(&ROOT_TREE_OBJECTID).map_or_else(|| self.w.info.tree_root(), |s| s.info)
    }
    fn chunk_root(&self) -> RootInfo {
        self.w.roots.get(&CHUNK_TREE_OBJECTID).map_or_else(|| self.w.info.chunk_root(), |s| s.info)
    }
    fn read_root(&self, id: u64) -> Result<(RootInfo, RootItem)> {
        match self.w.roots.get(&id) {
            Some(RootState { info, item: Some(item), .. }) => Ok((*info, *item)),
            _ => crate::tree::search::root_from_root_tree(self, id),
        }
    }
}

/// Bytes of the dirty limit each pending delayed-ref head is counted as: heads run
/// before their commit once they would stand for a quarter of the limit (a head and its
/// refs take about 250 bytes).
const DELAYED_REF_HEAD_BUDGET: usize = 4 * 256;

/// The largest dirty-metadata limit a writer takes from its memory budget: the kernel's
/// BTRFS_DIRTY_METADATA_THRESH.
pub const DEFAULT_DIRTY_METADATA_BYTES: usize = 32 << 20;

/// A tree's root as the running transaction sees it.
#[derive(Clone)]
pub struct RootState {
    pub info: RootInfo,
    /// The ROOT_ITEM (absent for the root and chunk trees, which the superblock holds).
    pub item: Option<RootItem>,
    /// The ROOT_ITEM key offset (0, or otransid for snapshots).
    pub item_offset: u64,
    /// Changed in the running transaction: its ROOT_ITEM must be rewritten at commit.
    pub dirty: bool,
}

/// Switches for benchmarks and tests (feature `test-hooks`, never in the default
/// public API): they change how the engine works, not what it writes.
#[cfg(feature = "test-hooks")]
#[derive(Debug, Default)]
pub struct TestHooks {
    /// Benchmark seam: when Some, every free-space-tree update learns its group's
    /// format from this function instead of the flag cached in the block group.
    pub fst_format_lookup: Option<crate::space::free_space_tree::FstFormatFn>,
    /// Test switch: free-space-tree conversion thresholds (low, high) for every group.
    pub fst_thresholds_override: Option<(u32, u32)>,
    /// Benchmark hook: when Some, the duration in ns of every add/remove on the
    /// free-space tree is appended (the cost per update).
    pub fst_timings: Option<Vec<u32>>,
    /// Test switch: every chunk allocation fails as on a full device.
    pub refuse_chunk_alloc: bool,
    /// Test and benchmark switch: handles inhibit no block from writeback (the COW
    /// amplification the inhibition prevents).
    pub no_writeback_inhibition: bool,
    /// Benchmark seam: when Some, handles record their inhibited blocks in the record
    /// this function makes instead of the inline buffer.
    pub inhibit_record: Option<crate::transaction::handle::InhibitRecordFn>,
    /// Benchmark hook: when Some, the blocks each handle inhibited, and the
    /// inhibitions a full buffer refused.
    pub inhibit_stats: Option<crate::transaction::handle::InhibitStats>,
    /// Test and benchmark switch: with quotas on, every commit recounts every qgroup
    /// (`qgroup::rescan`) instead of accounting the changed extents.
    pub qgroup_full_recount: bool,
    /// Benchmark switch: memory pressure before every search of a change: background
    /// writeback runs there, as the kernel's flusher may between two searches of one
    /// handle. (Not at a search's own restarts: a split may leave an empty leaf
    /// there for the insert that follows, a state the kernel's tree locks keep from
    /// its flusher.)
    pub writeback_before_search: bool,
    /// Benchmark hook: when Some, the blocks each search COWed (the COW amplification
    /// the inhibition bounds).
    pub cow_stats: Option<CowStats>,
}

/// Blocks COWed per search (`TestHooks::cow_stats`).
#[cfg(feature = "test-hooks")]
#[derive(Debug, Default, Clone)]
pub struct CowStats {
    pub searches: u64,
    pub cows: u64,
    pub max_per_search: u64,
    /// Searches that restarted, and restarts in all.
    pub restarted: u64,
    pub restarts: u64,
}

/// The running transaction of a writable filesystem (one per open filesystem).
pub struct Transaction {
    /// The filesystem, shared with every reader of it.
    pub info: Arc<FsInfo>,
    /// Working copy of the superblock, written at commit.
    pub sb: Box<Superblock>,
    /// Id of the running transaction (last committed generation + 1).
    pub transid: u64,
    /// Blocks of the running transaction not yet written: changed in place until
    /// written (the kernel's `should_cow_block`: generation == transid and not WRITTEN).
    pub(crate) dirty: FxHashMap<u64, ExtentBuffer>,
    /// The blocks of the transaction being committed, sealed, while its I/O runs
    /// outside the writer (`start_commit` .. `finish_commit`).
    in_flight: Option<Arc<BTreeMap<u64, Arc<ExtentBuffer>>>>,
    /// Blocks sealed for writeback whose I/O the engine runs outside its lock
    /// (`take_writeback` .. `finish_writeback`), by address: readers find them here.
    writing: FxHashMap<u64, Arc<ExtentBuffer>>,
    /// Blocks sealed for writeback at the end of the last change, for `take_writeback`.
    pending_writeback: Vec<Arc<ExtentBuffer>>,
    /// The writeback at the end of a change is left to the engine, which writes the
    /// blocks after dropping its lock (set by `Engine`; a writer used alone writes them
    /// at once).
    pub(crate) defer_writeback: bool,
    /// Mount-wide compression of file writes (`data::compress_write`).
    pub(crate) compress: crate::compression::CompressPolicy,
    /// Space the committing transaction freed: out of the allocator until
    /// `finish_commit` returns it.
    committing_pins: Vec<(u64, u64)>,
    /// Space freed by committed transactions (by the transaction that freed it) that a
    /// reader's view of an older generation may still read (`views`).
    held_for_views: Vec<(Generation, Vec<(u64, u64)>)>,
    /// Bytes of dirty blocks above which writeback starts before commit.
    dirty_limit: usize,
    /// A counter of block changes, stamped on each dirty block it touches (writeback
    /// writes the blocks touched longest ago first).
    touch_seq: u64,
    /// Blocks of this transaction written before its commit, for statistics.
    pub(crate) written_early: u64,
    /// Tree blocks COWed so far, for statistics.
    pub(crate) cowed: u64,
    /// Set by `Engine::write_retrying` for a run of a change that may be run again: a
    /// committed block missing from the cache is recorded here and fails the run, as
    /// long as the run has changed nothing (`probe_spoiled`).
    pub(crate) probe: Option<Arc<ReadMisses>>,
    /// The probed run has begun a change: from now on misses are read under the lock.
    probe_spoiled: bool,
    /// The write under way is the page cache's writeback of data written earlier
    /// (`Engine::write_file_raw` from `writeback_direct`): the flags that refuse a
    /// write (immutable, append-only, fs-verity) were checked when that data was
    /// written, and a flag set since must not keep it from disk (the kernel's
    /// writeback does not look at them). Nor does it stamp the times: the buffered
    /// writes did.
    pub(crate) writing_back: bool,
    /// Metadata bytes reserved by direct writes between `begin_write` and
    /// `finish_write`/`cancel_write` (the part of `alloc.meta_may_use` no handle holds).
    pub(crate) write_rsv: u64,
    /// The live transaction handle (`handle`): writeback runs only when the outermost
    /// ends, when no path holds a dirty block.
    pub(crate) handle: Option<handle::HandleState>,
    /// The last ended handle's state, kept for the next so its set's memory is reused.
    spare_handle: handle::HandleState,
    /// Delayed refs are being run by writeback (which they call back into).
    pub(crate) running_refs: bool,
    pub(crate) roots: BTreeMap<u64, RootState>,
    pub(crate) delayed: crate::extent::delayed_ref::DelayedRefs,
    pub(crate) alloc: crate::space::allocator::Allocator,
    /// Commits done by this writer (for tests and statistics).
    pub commits: u64,
    /// Chunks created in this transaction whose items are inserted at commit.
    pub(crate) pending_chunks: Vec<crate::space::chunk_alloc::PendingChunk>,
    /// Benchmark and test switches (feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    pub hooks: TestHooks,
    /// Next free objectid per tree, once looked up.
    pub(crate) next_objectid: BTreeMap<u64, u64>,
    /// Quotas are on (looked up at open): every commit keeps the qgroups exact.
    pub(crate) quotas: bool,
    /// Quota accounting state (`qgroup`), meaningful while `quotas`.
    pub(crate) qgroup: crate::extent::qgroup::QgroupState,
    /// The default subvolume (looked up at open; nothing the writer does changes it).
    pub(crate) default_subvol: u64,
    /// Opened read-only (`open_read_only`): why, and every change is refused.
    pub(crate) read_only: Option<String>,
    /// The superblock carries a log tree that nothing has replayed yet: every change
    /// is refused (`read_only` says so) until `inode::tree_log` replays it.
    pub(crate) log_replay_pending: bool,
    /// Whether `log_changes` records (an engine that may fsync through a log tree).
    pub(crate) track_log_changes: bool,
    /// The byte ranges of each file (root, ino) whose file extent items this
    /// transaction changed since the file was last logged (`inode::log_writer`):
    /// what an fsync must copy into the log tree. Cleared at commit.
    pub(crate) log_changes: Mutex<LogChanges>,
    /// Every tree block the log trees of this transaction took (`inode::log_writer`):
    /// in no tree's extent items, reserved in the allocator, and pinned by the commit
    /// (which makes the log obsolete) until its superblocks are on disk.
    pub(crate) log_blocks: Vec<u64>,
    /// Readers' views of older generations, which keep freed space from reuse (shared
    /// with the engine, whose readers register them without the writer).
    pub(crate) views: Arc<views::Views>,
    /// Data space promised to dirty page-cache data (`space::data_rsv`; shared with the
    /// engine, which reserves it before it takes the writer).
    pub(crate) data_rsv: Arc<crate::space::data_rsv::DataReservations>,
    /// Unallocated device space FITRIM discarded since the open (`space::trim`).
    pub(crate) trimmed: crate::space::trim::TrimmedDevSpace,
    /// Told of every change to an EXTENT_DATA item (its tree, inode and file range), so
    /// the layer above can drop what it caches of those bytes (the extent maps).
    pub(crate) file_extents_changed: Option<Arc<FileExtentsChanged>>,
}

/// `Transaction::log_changes`: per file (tree, inode), byte ranges `[start, end)`.
pub(crate) type LogChanges = FxHashMap<(u64, u64), Vec<(u64, u64)>>;

/// The callback of `Transaction::file_extents_changed`: (tree, inode, start, end).
pub type FileExtentsChanged = dyn Fn(u64, u64, u64, u64) + Send + Sync;

impl Transaction {
    /// Open an image for writing.
    ///
    /// # Errors
    /// As `FsInfo::open`, plus `Incompatible` if features forbid writing or the
    /// superblock carries an unreplayed log tree.
    pub fn open(opts: &OpenOptions) -> Result<Transaction> {
        let mut o = opts.clone();
        o.writable = true;
        Transaction::from_info(FsInfo::open(&o)?)
    }

    /// A read-only writer over an opened `FsInfo` (its devices opened for reading):
    /// the same engine and live view, with nothing done at open that writes (no orphan
    /// cleanup) and every change refused with `Posix(ReadOnly)`. What would stop
    /// writing (features, a stale member) does not stop reading.
    ///
    /// # Errors
    /// Read failures loading the block groups.
    pub fn read_only_over(info: Arc<FsInfo>) -> Result<Transaction> {
        let mut w = Transaction::build(info, false)?;
        w.read_only = Some("opened read-only".into());
        Ok(w)
    }

    /// Make a writer from an opened `FsInfo` (its devices must accept writes).
    ///
    /// # Errors
    /// `Incompatible` when writing is not allowed.
    pub fn from_info(info: FsInfo) -> Result<Transaction> {
        Transaction::from_shared(Arc::new(info))
    }

    /// Make the writer of a shared `FsInfo` (its devices must accept writes; there is
    /// one writer per filesystem).
    ///
    /// # Errors
    /// As `from_info`.
    pub fn from_shared(info: Arc<FsInfo>) -> Result<Transaction> {
        let sb = info.super_copy();
        if let Some(r) = &info.read_only_reason {
            return Err(Error::Incompatible(format!("cannot write: {r}")));
        }
        // Before anything is written: with a replace in progress every write below the
        // cursor would have to reach the target too (the kernel's dev-replace).
        if let Some(r) = info.dev_replace.as_ref().filter(|r| r.is_ongoing()) {
            return Err(Error::Incompatible(format!("cannot write: {}", r.refusal())));
        }
        if sb.log_root.get() != 0 && info.no_log_replay {
            return Err(Error::Incompatible(format!("cannot write: the superblock carries a log tree (log_root={}) and log replay is off; open read-only to see the last commit, or let ubtrfs replay the log", sb.log_root.get())));
        }
        let incompat = sb.incompat_flags.get();
        let compat_ro = sb.compat_ro_flags.get();
        use ubtrfs_format::features::*;
        let no_write = sb.flags.get() & SUPER_FLAGS_NO_WRITE;
        if no_write != 0 {
            return Err(Error::Incompatible(format!(
                "cannot write: the superblock is flagged {} (a seed device, a metadata dump, or an interrupted conversion)",
                flag_names(no_write, SUPER_FLAG_NAMES)
            )));
        }
        if incompat & INCOMPAT_SKINNY_METADATA == 0 {
            return Err(Error::Incompatible("cannot write: filesystems without skinny-metadata are not supported for writing yet".into()));
        }
        if compat_ro & COMPAT_RO_FREE_SPACE_TREE == 0
            || compat_ro & COMPAT_RO_FREE_SPACE_TREE_VALID == 0
        {
            return Err(Error::Incompatible(
                "cannot write: only filesystems with a valid free-space tree are supported for writing (space_cache=v2); btrfs-convert and older mkfs.btrfs make none: one read-write kernel mount with -o space_cache=v2 creates it".into(),
            ));
        }
        let unwritable = incompat
            & (INCOMPAT_ZONED
                | INCOMPAT_EXTENT_TREE_V2
                | INCOMPAT_RAID_STRIPE_TREE
                | INCOMPAT_SIMPLE_QUOTA);
        if unwritable != 0 {
            return Err(Error::Incompatible(format!(
                "cannot write: features {} are not supported for writing yet",
                flag_names(unwritable, INCOMPAT_NAMES)
            )));
        }
        for c in info.chunk_map.iter() {
            if crate::space::chunk_alloc::raid_attr(c.profile()).is_none() {
                return Err(Error::Incompatible(format!(
                    "cannot write: chunk {} has profile {}, which ubtrfs does not write",
                    c.logical,
                    profile_name(c.type_)
                )));
            }
        }
        let ndevs = sb.num_devices.get();
        if info.devices.by_id.len() as u64 != ndevs && !info.degraded {
            let have: Vec<u64> = info.devices.by_id.keys().copied().collect();
            return Err(Error::Incompatible(format!(
                "cannot write: the filesystem has {ndevs} devices and {} were given (devids {have:?}); pass every device with --device, or allow degraded writes (--degraded)",
                have.len()
            )));
        }
        // Every device must be at the generation the filesystem is: one left behind
        // (missing while the others were written) holds stale copies that new writes
        // would not bring up to date.
        if let Some(d) =
            info.devices.by_id.values().find(|d| d.sb_generation != sb.generation.get())
        {
            return Err(Error::Incompatible(format!(
                "cannot write: device {} ({}) has superblock generation {}, the filesystem is at {}; let the kernel mount it and run `btrfs scrub` first",
                d.devid,
                crate::quote::name(d.dev.name().as_bytes()),
                d.sb_generation,
                sb.generation.get()
            )));
        }
        let log = sb.log_root.get() != 0;
        let mut w = Transaction::build(info, true)?;
        if log {
            w.log_replay_pending = true;
            w.read_only = Some("the superblock's log tree is not replayed yet".into());
        }
        Ok(w)
    }

    /// The writer over `info`, its block groups, quota state and default subvolume
    /// loaded; nothing written.
    fn build(info: Arc<FsInfo>, writing: bool) -> Result<Transaction> {
        let sb = info.super_copy();
        let sb = Box::new(*sb);
        let transid = sb
            .generation
            .get()
            .checked_add(1)
            .ok_or_else(|| last_generation(sb.generation.get()))?;
        let mut w = Transaction {
            sb,
            transid,
            dirty: FxHashMap::default(),
            in_flight: None,
            writing: FxHashMap::default(),
            pending_writeback: Vec::new(),
            defer_writeback: false,
            compress: Default::default(),
            committing_pins: Vec::new(),
            held_for_views: Vec::new(),
            dirty_limit: DEFAULT_DIRTY_METADATA_BYTES,
            touch_seq: 0,
            written_early: 0,
            cowed: 0,
            write_rsv: 0,
            probe: None,
            probe_spoiled: false,
            writing_back: false,
            handle: None,
            spare_handle: Default::default(),
            running_refs: false,
            roots: BTreeMap::new(),
            delayed: Default::default(),
            alloc: Default::default(),
            commits: 0,
            pending_chunks: Vec::new(),
            #[cfg(feature = "test-hooks")]
            hooks: TestHooks::default(),
            next_objectid: BTreeMap::new(),
            quotas: false,
            qgroup: Default::default(),
            default_subvol: FS_TREE_OBJECTID,
            read_only: None,
            log_replay_pending: false,
            track_log_changes: false,
            log_changes: Default::default(),
            log_blocks: Vec::new(),
            views: Default::default(),
            data_rsv: Default::default(),
            trimmed: Default::default(),
            file_extents_changed: None,
            info,
        };
        if writing {
            // An interrupted relocation (balance) leaves relocation trees that the kernel
            // merges at its next mount, relying on hooks every COW of the fs trees runs
            // (`btrfs_reloc_cow_block`); ubtrfs has none, so it must not change the trees.
            let reloc = w.items_in_range(
                ROOT_TREE_OBJECTID,
                &Key::new(TREE_RELOC_OBJECTID, ROOT_ITEM_KEY, 0),
                &Key::new(TREE_RELOC_OBJECTID, ROOT_ITEM_KEY, u64::MAX),
            )?;
            if !reloc.is_empty() {
                let of: Vec<String> = reloc.iter().map(|(k, _)| k.offset.to_string()).collect();
                return Err(Error::Incompatible(format!(
                    "cannot write: an interrupted balance left relocation trees (for trees {}); mount the filesystem with the kernel once to finish it",
                    of.join(", ")
                )));
            }
        }
        w.alloc = crate::space::allocator::Allocator::load(&w)?;
        if writing && w.info.devices.by_id.len() != w.alloc.dev_items.len() {
            crate::space::chunk_alloc::check_rw_degradable(&w)?;
        }
        if let Some((flags, status_gen)) = crate::extent::qgroup::status(&mut w)? {
            w.quotas = true;
            w.qgroup = crate::extent::qgroup::QgroupState::at_open(
                flags,
                status_gen,
                w.sb.generation.get(),
            );
            w.delayed.trace_qgroup();
        }
        w.default_subvol = crate::tree::search::find_default_subvol(&w.live())?;
        // One budget for metadata in memory (`OpenOptions::cache_bytes`): up to half of it,
        // and at most the kernel's threshold, holds dirty blocks; the rest caches clean ones.
        let budget = w.info.cache.budget();
        w.dirty_limit = DEFAULT_DIRTY_METADATA_BYTES.min(budget / 2);
        w.info.cache.set_budget(budget - w.dirty_limit);
        Ok(w)
    }

    /// The running transaction as readers see it (read-your-writes).
    pub fn live(&self) -> Live<'_> {
        Live { w: self, misses: None }
    }

    /// The live view for a reader that gives up the lock on a cache miss (`misses`).
    pub fn live_dropping_misses<'a>(&'a self, misses: &'a ReadMisses) -> Live<'a> {
        Live { w: self, misses: Some(misses) }
    }

    fn in_flight_has(&self, bytenr: u64) -> bool {
        (!self.writing.is_empty() && self.writing.contains_key(&bytenr))
            || self.in_flight.as_ref().is_some_and(|f| f.contains_key(&bytenr))
    }

    /// Fail if the filesystem was aborted to read-only.
    ///
    /// # Errors
    /// `Posix(ReadOnly)` naming the original failure.
    pub fn check_writable(&self) -> Result<()> {
        if let Some(why) = &self.read_only {
            return Err(Error::posix_detail(PosixKind::ReadOnly, "the filesystem", why.clone()));
        }
        match self.info.aborted() {
            Some(why) => Err(Error::posix(
                PosixKind::ReadOnly,
                format!("filesystem aborted to read-only after: {why}"),
            )),
            None => Ok(()),
        }
    }

    /// Fail if tree `root` may not change: the filesystem was aborted, or `root` is a
    /// read-only subvolume (ROOT_ITEM flag RDONLY, `btrfs subvolume snapshot -r` or
    /// `btrfs property set ro true`). Every public mutator calls this before it changes
    /// anything, so a refused change leaves the transaction as it was; send/receive
    /// rely on read-only snapshots never changing.
    ///
    /// # Errors
    /// `Posix(ReadOnly)` naming the subvolume; read failures loading its root.
    pub fn check_root_writable(&mut self, root: u64) -> Result<()> {
        self.check_writable()?;
        if self.root_is_readonly(root)? {
            if self.roots.get(&root).and_then(|s| s.item).is_some_and(|i| i.refs.get() == 0) {
                return Err(Error::posix_detail(
                    PosixKind::NotFound,
                    format!("subvolume id {root}"),
                    "the subvolume is deleted",
                ));
            }
            return Err(Error::posix_detail(
                PosixKind::ReadOnly,
                self.subvol_desc(root),
                "the subvolume is flagged read-only",
            ));
        }
        Ok(())
    }

    /// Flag subvolume `root` read-only or writable (ROOT_ITEM flag RDONLY), as
    /// `btrfs property set SUBVOL ro true|false` does; the change lands at commit.
    ///
    /// # Errors
    /// `Posix(Invalid)` for a tree that is not a subvolume; `Posix(ReadOnly)` after an
    /// abort; read failures loading the root.
    pub fn set_subvol_readonly(&mut self, root: u64, readonly: bool) -> Result<()> {
        self.check_writable()?;
        self.begin_change()?;
        if !is_subvolume_tree(root) {
            return Err(Error::posix(
                PosixKind::Invalid,
                format!("tree {root} is not a subvolume"),
            ));
        }
        self.root(root)?;
        let st = self.roots.get_mut(&root).expect("loaded just above");
        let item = st.item.as_mut().expect("subvolume trees have a ROOT_ITEM");
        let flags = item.flags.get();
        item.flags =
            if readonly { flags | ROOT_SUBVOL_RDONLY } else { flags & !ROOT_SUBVOL_RDONLY }.into();
        st.dirty = true;
        Ok(())
    }

    /// Whether `root` is a subvolume flagged read-only, or a deleted one (refs 0,
    /// whose tree only the cleaner touches, and only to free it).
    ///
    /// # Errors
    /// Read failures loading the root.
    pub(crate) fn root_is_readonly(&mut self, root: u64) -> Result<bool> {
        if !is_subvolume_tree(root) {
            return Ok(false);
        }
        self.root(root)?;
        let st = self.roots.get(&root).expect("loaded just above");
        Ok(st
            .item
            .as_ref()
            .is_some_and(|i| i.flags.get() & ROOT_SUBVOL_RDONLY != 0 || i.refs.get() == 0))
    }

    /// "subvolume NAME (id N)", with the name from its ROOT_BACKREF when
    /// there is one (the top-level tree has none).
    fn subvol_desc(&mut self, root: u64) -> String {
        let name = self
            .items_in_range(
                ROOT_TREE_OBJECTID,
                &Key::new(root, ROOT_BACKREF_KEY, 0),
                &Key::new(root, ROOT_BACKREF_KEY, u64::MAX),
            )
            .ok()
            .and_then(|v| v.into_iter().next())
            .and_then(|(_, d)| {
                items::root_ref(&d).ok().map(|r| crate::quote::name(r.name).into_owned())
            });
        match name {
            Some(n) => format!("subvolume {n} (id {root})"),
            None => format!("subvolume id {root}"),
        }
    }

    /// Turn the filesystem read-only after a failure that happened mid-change.
    pub fn abort(&mut self, at: &str, err: &Error) {
        self.abort_because(at, &err.to_string());
    }

    /// `abort` for a failure that is not an `Error` (a handle dropped unended).
    pub(crate) fn abort_because(&mut self, at: &str, why: &str) {
        self.info.set_aborted(format!("{at}: {why}"));
    }

    /// Return to the allocator the space committed transactions freed that no live view
    /// reads any more.
    pub(crate) fn release_space_held_for_views(&mut self) {
        let views = self.views.clone();
        let mut i = 0;
        while i < self.held_for_views.len() {
            if views.may_reuse(self.held_for_views[i].0) {
                let (_, ranges) = self.held_for_views.swap_remove(i);
                self.alloc.release_pinned(&ranges);
            } else {
                i += 1;
            }
        }
    }

    pub fn nodesize(&self) -> u32 {
        self.info.nodesize
    }
    pub fn sectorsize(&self) -> u32 {
        self.info.sectorsize
    }

    /// The root state of tree `id`, loaded on first use.
    ///
    /// # Errors
    /// `Posix(NotFound)` for an unknown tree.
    pub fn root(&mut self, id: u64) -> Result<RootInfo> {
        if let Some(r) = self.roots.get(&id) {
            return Ok(r.info);
        }
        let st = match id {
            ROOT_TREE_OBJECTID => {
                RootState { info: self.info.tree_root(), item: None, item_offset: 0, dirty: false }
            }
            CHUNK_TREE_OBJECTID => {
                RootState { info: self.info.chunk_root(), item: None, item_offset: 0, dirty: false }
            }
            _ => {
                let root = self.root(ROOT_TREE_OBJECTID)?;
                let found = self.first_item_ge(&root, &Key::new(id, ROOT_ITEM_KEY, 0))?;
                let (k, data) = match found {
                    Some((k, d)) if k.objectid == id && k.type_ == ROOT_ITEM_KEY => (k, d),
                    _ => return Err(Error::posix(PosixKind::NotFound, format!("tree {id}"))),
                };
                let v = items::root_item(&data).expect("validated by the tree checker");
                RootState {
                    info: RootInfo {
                        id,
                        bytenr: v.item.bytenr.get(),
                        level: v.item.level,
                        generation: v.item.generation.get(),
                    },
                    item: Some(v.item),
                    item_offset: k.offset,
                    dirty: false,
                }
            }
        };
        let info = st.info;
        self.roots.insert(id, st);
        Ok(info)
    }

    /// Point tree `id` at a new root block (after COW, split or collapse).
    pub(crate) fn set_root(&mut self, id: u64, bytenr: u64, level: u8) {
        let transid = self.transid;
        let st = self.roots.get_mut(&id).expect("root loaded before it changes");
        st.info.bytenr = bytenr;
        st.info.level = level;
        st.info.generation = transid;
        st.dirty = true;
    }

    /// Read a block for the write path: ours if dirty, else the validated committed one.
    ///
    /// # Errors
    /// `Io`/`Corrupt` from reading; `Corrupt` when the pointer expects a committed block
    /// where this transaction has a new one: the allocator handed out a block in use.
    pub fn read_block(&self, bytenr: u64, expect: &Expect) -> Result<Blk> {
        if self.dirty.contains_key(&bytenr) {
            // Pointers to our blocks carry this transaction's generation; an older one
            // names the committed block that was here.
            if let Some(g) = expect.generation.filter(|g| *g != self.transid) {
                return Err(in_use_reallocated(bytenr, expect.owner, format!("tree block {bytenr} of generation {g} is in use, yet this transaction ({}) allocated it again", self.transid)));
            }
            return Ok(Blk::Dirty(bytenr));
        }
        Ok(Blk::Clean(self.read_clean(bytenr, expect)?))
    }

    /// A block that is not dirty: one of the commit being written, or from the cache or
    /// the disk.
    fn read_clean(&self, bytenr: u64, expect: &Expect) -> Result<Arc<ExtentBuffer>> {
        // (Empty unless the engine writes back outside its lock: no hashing then.)
        if !self.writing.is_empty() {
            if let Some(eb) = self.writing.get(&bytenr).filter(|eb| eb.matches(expect)) {
                return Ok(eb.clone());
            }
        }
        if let Some(eb) = self.in_flight.as_ref().and_then(|f| f.get(&bytenr)) {
            if eb.matches(expect) {
                return Ok(eb.clone());
            }
        }
        if let Some(r) = self
            .probe
            .as_deref()
            .filter(|_| !self.probe_spoiled)
            .and_then(|m| m.meet(self, bytenr, expect))
        {
            return r;
        }
        self.info.read_tree_block(bytenr, expect)
    }

    /// Called where a change begins (a handle starts, space is reserved or allocated, a
    /// root item is flagged). In a probed run (`probe`) that already missed the cache
    /// this fails with the miss, so the run changes nothing and can run again (a
    /// closure that swallowed the miss cannot act on what it wrongly concluded);
    /// otherwise the run is marked as having changed something.
    ///
    /// # Errors
    /// The recorded miss.
    pub(crate) fn begin_change(&mut self) -> Result<()> {
        if let Some(m) = self.probe.as_deref() {
            if !self.probe_spoiled {
                if let Some((bytenr, _)) = *m.wanted.lock().unwrap_or_else(|p| p.into_inner()) {
                    return Err(miss_error(bytenr));
                }
                self.probe_spoiled = true;
            }
        }
        Ok(())
    }

    /// Start a probed run (`Engine::write_retrying`).
    pub(crate) fn set_probe(&mut self, m: Option<Arc<ReadMisses>>) {
        self.probe = m;
        self.probe_spoiled = false;
    }

    /// Whether the probed run changed something.
    pub(crate) fn probe_spoiled(&self) -> bool {
        self.probe_spoiled
    }

    pub fn node<'a>(&'a self, b: &'a Blk) -> NodeRef<'a> {
        match b {
            Blk::Dirty(bytenr) => NodeRef::new_checked(
                &self.dirty.get(bytenr).expect("dirty block present while referenced").data,
            ),
            Blk::Clean(eb) => eb.node(),
        }
    }

    pub(crate) fn node_mut(&mut self, bytenr: u64) -> ubtrfs_format::node::NodeMut<'_> {
        self.touch_seq += 1;
        let d = self
            .dirty
            .get_mut(&bytenr)
            .unwrap_or_else(|| panic!("block {bytenr} modified without being COWed first"));
        d.touched = self.touch_seq;
        ubtrfs_format::node::NodeMut::new(&mut d.data)
    }

    /// Create an empty block at `bytenr` owned by `owner` (caller allocated the space).
    pub(crate) fn new_block(&mut self, bytenr: u64, owner: u64, level: u8) {
        let mut buf = vec![0u8; self.nodesize() as usize].into_boxed_slice();
        {
            let mut m = ubtrfs_format::node::NodeMut::new(&mut buf);
            let fsid = self.info.meta_fsid;
            let ctu = self.info.chunk_tree_uuid;
            let transid = self.transid;
            let h = m.header_mut();
            h.fsid = fsid;
            h.bytenr = bytenr.into();
            h.flags = (MIXED_BACKREF_REV << BACKREF_REV_SHIFT).into();
            h.chunk_tree_uuid = ctu;
            h.generation = transid.into();
            h.owner = owner.into();
            h.nritems = 0.into();
            h.level = level;
        }
        self.insert_dirty(bytenr, buf);
    }

    /// Copy block `src` into a new block at `bytenr` owned by `owner` (the data of COW).
    ///
    /// # Errors
    /// `Corrupt` when `bytenr` is `src` itself: the allocator handed out the block
    /// being copied, which a committed tree still uses.
    pub(crate) fn copy_block(&mut self, src: &Blk, bytenr: u64, owner: u64) -> Result<()> {
        if src.bytenr() == bytenr {
            return Err(in_use_reallocated(
                bytenr,
                Some(owner),
                format!(
                    "tree block {bytenr} was allocated for its own copy while tree {owner} uses it"
                ),
            ));
        }
        let mut buf: Box<[u8]> = self.node(src).bytes().into();
        {
            let mut m = ubtrfs_format::node::NodeMut::new(&mut buf);
            let transid = self.transid;
            let h = m.header_mut();
            h.bytenr = bytenr.into();
            h.generation = transid.into();
            h.owner = owner.into();
            h.flags = (MIXED_BACKREF_REV << BACKREF_REV_SHIFT).into();
        }
        self.insert_dirty(bytenr, buf);
        Ok(())
    }

    fn insert_dirty(&mut self, bytenr: u64, buf: Box<[u8]>) {
        self.touch_seq += 1;
        let old = self.dirty.insert(bytenr, ExtentBuffer::new_dirty(bytenr, buf, self.touch_seq));
        assert!(old.is_none(), "block {bytenr} allocated twice in one transaction");
    }

    /// Drop a freed block: a dirty one is forgotten; one written early leaves the node
    /// cache, so a block allocated later at the same address is never shadowed by it.
    /// Returns what the block was: a block still being written back must not have its
    /// space handed out before that write is done.
    pub(crate) fn forget_dirty(&mut self, bytenr: u64) -> Forgot {
        if self.dirty.remove(&bytenr).is_some() {
            return Forgot::Dirty;
        }
        self.info.cache.remove(bytenr);
        if !self.writing.is_empty() && self.writing.remove(&bytenr).is_some() {
            return Forgot::Writing;
        }
        Forgot::Written
    }

    /// The blocks sealed by the last change's writeback, to be written without the
    /// engine's lock (`Writeback::write`), then `finish_writeback`.
    pub fn take_writeback(&mut self) -> Option<Writeback> {
        (!self.pending_writeback.is_empty())
            .then(|| Writeback { blocks: std::mem::take(&mut self.pending_writeback) })
    }

    /// End a writeback whose I/O is done: its blocks join the node cache (those not
    /// freed meanwhile).
    pub fn finish_writeback(&mut self, wb: Writeback) {
        for eb in wb.blocks {
            if self.writing.get(&eb.bytenr).is_some_and(|w| Arc::ptr_eq(w, &eb)) {
                self.writing.remove(&eb.bytenr);
                self.info.cache.insert(eb);
            }
        }
    }

    /// Set the dirty-metadata limit: past it, blocks are written out before the commit
    /// (the least recently changed first) so memory stays bounded however long the
    /// transaction runs. Crash safety is unchanged: such blocks sit in space the
    /// committed state treats as free, and a later change COWs them.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn set_dirty_metadata_limit(&mut self, bytes: usize) {
        self.dirty_limit = bytes;
    }

    /// Tree blocks COWed so far (each a new block allocated for a change).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn blocks_cowed(&self) -> u64 {
        self.cowed
    }

    /// Metadata bytes reserved now, by live handles and pending direct writes.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn metadata_reserved(&self) -> u64 {
        self.alloc.meta_may_use
    }

    /// Test hook: background writeback now, in the middle of a handle (as the kernel's
    /// flusher may run while a handle lives): dirty blocks past the limit are written,
    /// except those a live handle inhibits.
    ///
    /// # Errors
    /// Write failures.
    #[cfg(feature = "test-hooks")]
    pub fn background_writeback(&mut self) -> Result<()> {
        self.balance_dirty_metadata()
    }

    /// Blocks of the running transactions written before their commit, so far.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn blocks_written_early(&self) -> u64 {
        self.written_early
    }

    /// What the last commit's qgroup accounting did (None with quotas off).
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn qgroup_stats(&self) -> Option<crate::extent::qgroup::QgroupStats> {
        self.quotas.then(|| self.qgroup.last.clone())
    }

    /// Test hook: compare every commit's incremental qgroup numbers with the full
    /// recount, panicking on a mismatch (the default in debug builds).
    #[cfg(feature = "test-hooks")]
    pub fn set_qgroup_verify(&mut self, on: bool) {
        self.qgroup.verify = on;
    }

    /// Test hook: record at most `limit` changed extents for qgroup accounting per
    /// transaction (past it the commit recounts; `MAX_QGROUP_RECORDS` otherwise).
    #[cfg(feature = "test-hooks")]
    pub fn set_qgroup_record_limit(&mut self, limit: usize) {
        self.delayed.set_qgroup_record_limit(limit);
    }

    /// Test hook: the space the committing transaction freed, held out of the allocator
    /// until its commit finishes.
    #[cfg(feature = "test-hooks")]
    pub fn space_held_by_commit(&self) -> Vec<(u64, u64)> {
        self.committing_pins.clone()
    }

    /// Test hook: space committed transactions freed that older views still hold.
    #[cfg(feature = "test-hooks")]
    pub fn space_held_for_views(&self) -> Vec<(u64, u64)> {
        self.held_for_views.iter().flat_map(|(_, r)| r.iter().copied()).collect()
    }

    /// Test hook: whether `[bytenr, bytenr + len)` is free for allocation now.
    #[cfg(feature = "test-hooks")]
    pub fn space_is_allocatable(&self, bytenr: u64, len: u64) -> bool {
        self.alloc.group(bytenr).is_some_and(|g| g.ctl().is_some_and(|c| c.is_free(bytenr, len)))
    }

    /// Write dirty blocks out until their bytes are at most half the limit, if they are
    /// over it. Leaves go before nodes (upper levels change with every COW below them),
    /// and within a level the blocks changed longest ago first; a tree's root stays.
    pub(crate) fn balance_dirty_metadata(&mut self) -> Result<()> {
        self.balance_dirty_metadata_with(false)
    }

    /// `balance_dirty_metadata`; with `defer`, the blocks are sealed (from now on a
    /// change COWs them) and left for `take_writeback` instead of written here.
    pub(crate) fn balance_dirty_metadata_with(&mut self, defer: bool) -> Result<()> {
        // Pending references are memory too (a head per extent changed): past a share of
        // the limit they run now, as the kernel runs delayed refs in batches during a
        // transaction; what they dirty is written back below.
        if self.delayed.len() > (self.dirty_limit / DELAYED_REF_HEAD_BUDGET).max(16)
            && !self.running_refs
        {
            self.running_refs = true;
            let r = crate::extent::extent_tree::run_delayed_refs(self);
            self.running_refs = false;
            r?;
        }
        let ns = self.nodesize() as usize;
        if self.dirty.len() * ns <= self.dirty_limit {
            return Ok(());
        }
        let roots: std::collections::HashSet<u64> =
            self.roots.values().map(|r| r.info.bytenr).collect();
        let mut order: Vec<(u8, u64, u64)> = self
            .dirty
            .iter()
            .filter(|(b, d)| !roots.contains(b) && d.writeback_inhibitors == 0)
            .map(|(&b, d)| (NodeRef::new_checked(&d.data).level(), d.touched, b))
            .collect();
        order.sort_unstable();
        let target = self.dirty_limit / 2 / ns;
        let excess = self.dirty.len().saturating_sub(target);
        let mut picked: Vec<u64> = order.into_iter().take(excess).map(|(_, _, b)| b).collect();
        // Sequential addresses make one stream of writes.
        picked.sort_unstable();
        for b in picked {
            let d = self.dirty.remove(&b).expect("picked from the dirty set");
            if defer {
                let mut d = d;
                self.seal_tree_block(b, &mut d.data)?;
                let eb = Arc::new(d.mark_written());
                self.writing.insert(b, eb.clone());
                self.pending_writeback.push(eb);
            } else {
                let eb = self.write_tree_block(d)?;
                self.info.cache.insert(eb);
            }
            self.written_early += 1;
        }
        Ok(())
    }

    #[cfg(any(test, feature = "test-hooks"))]
    pub fn dirty_blocks(&self) -> usize {
        self.dirty.len()
    }

    /// Update the ROOT_ITEMs of changed trees (loops: updating the root tree changes it).
    fn update_root_items(&mut self) -> Result<bool> {
        let ids: Vec<u64> = self
            .roots
            .iter()
            .filter(|(_, s)| s.dirty && s.item.is_some())
            .map(|(&id, _)| id)
            .collect();
        if ids.is_empty() {
            return Ok(false);
        }
        for id in ids {
            let st = self.roots.get_mut(&id).expect("listed above");
            st.dirty = false;
            let mut item = st.item.expect("listed above");
            item.bytenr = st.info.bytenr.into();
            item.level = st.info.level;
            item.generation = st.info.generation.into();
            item.generation_v2 = st.info.generation.into();
            st.item = Some(item);
            let off = st.item_offset;
            let key = Key::new(id, ROOT_ITEM_KEY, off);
            let Some(path) = self.search_slot(ROOT_TREE_OBJECTID, &key, 0)?.into_found() else {
                return Err(ubtrfs_format::Corrupt::new(
                    ubtrfs_format::CorruptWhere::Item,
                    format!("root item {key} vanished"),
                )
                .root(1)
                .into());
            };
            let leaf = path.nodes[0].as_ref().expect("leaf").bytenr();
            let slot = path.slots[0];
            let size = self.node(&Blk::Dirty(leaf)).item(slot).size.get() as usize;
            let mut m = self.node_mut(leaf);
            let data = m.item_data_mut(slot);
            data.copy_from_slice(&item.as_bytes()[..size]);
        }
        Ok(true)
    }

    /// Commit the running transaction: run delayed refs, update root items, write every
    /// dirty block to every copy, flush, then write every superblock copy. A failure
    /// aborts the filesystem to read-only. Returns the committed generation.
    ///
    /// The three steps are apart for the engine, which runs the middle one (all the
    /// I/O) without holding the writer: `start_commit`, `CommitIo::write`,
    /// `finish_commit`.
    ///
    /// # Errors
    /// `Io` from writes and flushes, anything from running references.
    pub fn commit(&mut self) -> Result<u64> {
        let Some(io) = self.start_commit()? else {
            return Ok(self.sb.generation.get());
        };
        if let Err(e) = io.write(&self.info) {
            self.abort("commit", &e);
            return Err(e);
        }
        Ok(self.finish_commit(io))
    }

    /// Settle the running transaction and seal it (the kernel's commit up to
    /// TRANS_STATE_UNBLOCKED): delayed refs run, root items updated, every block
    /// checksummed and checked, the superblocks made. From here on the writer runs the
    /// next transaction: what it reads of the committing one comes from the sealed
    /// blocks (`in_flight`), which it COWs like any committed block. Space freed by the
    /// committing transaction stays out of the allocator until `finish_commit`.
    /// `None` when there is nothing to commit. A failure aborts.
    ///
    /// # Errors
    /// Anything from running references; `Corrupt` for a block the write-time tree
    /// checker refuses.
    pub fn start_commit(&mut self) -> Result<Option<CommitIo>> {
        self.check_writable()?;
        self.begin_change()?;
        assert!(
            self.handle.is_none(),
            "commit inside a live transaction handle ({})",
            self.transid
        );
        assert_eq!(
            self.alloc.meta_may_use, self.write_rsv,
            "metadata reservations left behind by ended handles"
        );
        if self.in_flight.is_some() {
            return Err(Error::posix_detail(PosixKind::Busy, "commit", "the previous commit is still writing (commit through the engine, which waits for it)"));
        }
        let mut h = self.commit_handle();
        let r = h.start_commit_inner();
        h.end_with(r)
    }

    fn start_commit_inner(&mut self) -> Result<Option<CommitIo>> {
        // The transaction after this one needs a generation too: refuse before writing.
        let next = self.transid.checked_add(1).ok_or_else(|| last_generation(self.transid))?;
        // A root item changed on its own (a subvolume flagged read-only) is a change.
        let root_items_changed = self.roots.values().any(|s| s.dirty && s.item.is_some());
        if self.dirty.is_empty()
            && self.delayed.is_empty()
            && !self.alloc.has_changes()
            && !root_items_changed
        {
            return Ok(None);
        }
        self.converge()?;
        if self.quotas {
            // Account the extents whose references changed against the trees as they
            // will be committed, store the numbers (see `qgroup`), and settle again.
            crate::extent::qgroup::commit_qgroups(self)?;
            self.converge()?;
            crate::extent::qgroup::after_settle(self);
        }
        self.check_dirty_invariants();
        let blocks = self.seal_dirty_blocks()?;
        self.in_flight = Some(blocks.clone());
        self.sb = self.next_super();
        self.sb.bytes_used = self.alloc.total_used().into();
        self.fill_backup_root()?;
        let mut supers = Vec::with_capacity(self.info.devices.by_id.len());
        for d in self.info.devices.by_id.values() {
            let mut sb = *self.sb;
            sb.dev_item = self.alloc.dev_item(d.devid).unwrap_or(sb.dev_item);
            supers.push((d.devid, Box::new(sb)));
        }
        // The log trees of this transaction die with it: their blocks stay out of the
        // allocator until this commit's superblocks (without a log root) are on disk.
        for b in std::mem::take(&mut self.log_blocks) {
            let n = u64::from(self.nodesize());
            crate::space::allocator::pin_log_block(self, b, n);
        }
        self.log_changes.lock().unwrap_or_else(|p| p.into_inner()).clear();
        self.committing_pins = self.alloc.take_pinned();
        let generation = self.transid;
        self.transid = next;
        for st in self.roots.values_mut() {
            st.dirty = false;
        }
        Ok(Some(CommitIo { generation, blocks, supers }))
    }

    /// End a commit whose I/O is done (`CommitIo::write`): its blocks join the node
    /// cache, its superblock becomes the committed one, and the space it freed returns
    /// to the allocator. Returns the committed generation.
    pub fn finish_commit(&mut self, io: CommitIo) -> u64 {
        let Some(flying) = self.in_flight.take() else {
            panic!("finish_commit of generation {} without a commit in flight", io.generation)
        };
        assert!(
            Arc::ptr_eq(&flying, &io.blocks),
            "finish_commit of generation {} with another commit's blocks",
            io.generation
        );
        for eb in io.blocks.values() {
            self.info.cache.insert(eb.clone());
        }
        let sb =
            io.supers.first().map(|(_, sb)| Arc::new(**sb)).expect("a filesystem has a device");
        self.info.set_super_copy(sb);
        let pins = std::mem::take(&mut self.committing_pins);
        self.held_for_views.push((Generation(io.generation), pins));
        self.release_space_held_for_views();
        self.commits += 1;
        io.generation
    }

    /// Running refs changes the extent and free-space trees, which COWs blocks and
    /// adds refs; root items change the root tree. Loop until nothing moves.
    fn converge(&mut self) -> Result<()> {
        let mut rounds = 0;
        loop {
            rounds += 1;
            assert!(rounds < 1000, "commit did not converge after {rounds} rounds");
            let ran = crate::extent::extent_tree::run_delayed_refs(self)?;
            let bg = crate::space::allocator::write_dirty_block_groups(self)?;
            let roots = self.update_root_items()?;
            if !ran && !bg && !roots && self.delayed.is_empty() {
                return Ok(());
            }
        }
    }

    /// The superblock this commit will write, root pointers included (backup roots
    /// and usage are filled in by `start_commit`).
    fn next_super(&self) -> Box<Superblock> {
        let root = self
            .roots
            .get(&ROOT_TREE_OBJECTID)
            .map(|s| s.info)
            .unwrap_or_else(|| self.info.tree_root());
        let chunk = self
            .roots
            .get(&CHUNK_TREE_OBJECTID)
            .map(|s| s.info)
            .unwrap_or_else(|| self.info.chunk_root());
        let transid = self.transid;
        let mut sb = self.sb.clone();
        sb.generation = transid.into();
        sb.root = root.bytenr.into();
        sb.root_level = root.level;
        // A commit makes every log tree obsolete (the kernel clears log_root at commit).
        sb.log_root = 0.into();
        sb.log_root_level = 0;
        if chunk.generation == transid {
            sb.chunk_root = chunk.bytenr.into();
            sb.chunk_root_level = chunk.level;
            sb.chunk_root_generation = transid.into();
        }
        sb
    }

    fn check_dirty_invariants(&self) {
        if cfg!(debug_assertions) {
            for (bytenr, d) in &self.dirty {
                let n = NodeRef::new_checked(&d.data);
                assert_eq!(n.bytenr(), *bytenr, "dirty block header bytenr");
                assert_eq!(n.generation(), self.transid, "dirty block {bytenr} generation");
            }
        }
    }

    /// Seal every dirty block (WRITTEN flag, checksum) and validate each as the kernel's
    /// write-time tree checker does, before any is written: a block that fails the
    /// check is an error (the kernel's -EUCLEAN on write), the commit aborts, and
    /// nothing of this transaction reaches the disk.
    ///
    /// # Errors
    /// `Corrupt` (under "write time tree block corruption detected") for a block the
    /// tree checker refuses.
    fn seal_dirty_blocks(&mut self) -> Result<Arc<BTreeMap<u64, Arc<ExtentBuffer>>>> {
        // Blocks whose writeback is still under way are written by the commit too (the
        // same bytes), so they are on disk before its superblocks whatever that
        // writeback's timing.
        let mut blocks: BTreeMap<u64, Arc<ExtentBuffer>> =
            self.writing.iter().map(|(&b, eb)| (b, eb.clone())).collect();
        for (bytenr, mut d) in std::mem::take(&mut self.dirty) {
            self.seal_tree_block(bytenr, &mut d.data)?;
            blocks.insert(bytenr, Arc::new(d.mark_written()));
        }
        Ok(Arc::new(blocks))
    }

    /// Make block `bytenr` of this transaction ready to write: mark it WRITTEN (from now
    /// on a change COWs it), checksum it and validate it as the kernel's write-time tree
    /// checker does.
    ///
    /// # Errors
    /// `Corrupt` (under "write time tree block corruption detected") for a block the
    /// tree checker refuses: a bug, or a bad item copied from a corrupt image.
    fn seal_tree_block(&self, bytenr: u64, buf: &mut [u8]) -> Result<()> {
        let csum_type = self.info.csum_type;
        {
            let mut m = ubtrfs_format::node::NodeMut::new(buf);
            let h = m.header_mut();
            h.flags = (h.flags.get() | HEADER_FLAG_WRITTEN).into();
        }
        let c = csum_type.compute(&buf[CSUM_SIZE..]);
        buf[..CSUM_SIZE].copy_from_slice(&c);
        let level = NodeRef::new_checked(buf).level();
        let ctx = ubtrfs_format::tree_checker::CheckCtx {
            nodesize: self.nodesize(),
            sectorsize: self.sectorsize(),
            csum_type,
            fsid: self.info.meta_fsid,
            chunk_tree_uuid: Some(self.info.chunk_tree_uuid),
            super_generation: self.transid,
            bytenr,
            level: Some(level),
            generation: Some(self.transid),
            owner: None,
            first_key: None,
        };
        ubtrfs_format::tree_checker::check_tree_block(buf, &ctx)
            .map_err(|e| Error::from(e).at("write time tree block corruption detected"))
    }

    /// Seal and write the log trees' `blocks` to every copy, not flushed, and return
    /// each device's committed superblock (by device id) with its log root at `root`
    /// (`level`), for `LogWrite::finish` to write once the blocks are flushed (the
    /// kernel's `btrfs_sync_log`): after a crash the devices show the last commit and,
    /// once a superblock is down, the log to replay over it.
    ///
    /// # Errors
    /// `Corrupt` for a block the write-time tree checker refuses; `Io` from the devices,
    /// or a device whose superblock is not at the committed generation.
    pub(crate) fn write_log(
        &mut self,
        blocks: &mut [(u64, Box<[u8]>)],
        root: u64,
        level: u8,
    ) -> Result<Vec<(u64, Superblock)>> {
        for (b, buf) in blocks.iter_mut() {
            self.seal_tree_block(*b, buf)?;
        }
        for (b, buf) in blocks.iter() {
            crate::volumes::write_logical(
                &self.info.chunk_map,
                &self.info.devices,
                *b,
                buf,
                crate::volumes::WriteKind::Metadata,
            )?;
        }
        let committed = self.info.super_copy().generation.get();
        let mut supers = Vec::new();
        for (&devid, d) in &self.info.devices.by_id {
            let mut warnings = Vec::new();
            let mut sb = crate::disk_io::read_super(d.dev.as_ref(), &mut warnings)?;
            if sb.generation.get() != committed {
                return Err(Error::io(
                    d.dev.name(),
                    std::io::Error::other(format!(
                        "its superblock is at generation {}, the filesystem at {committed}",
                        sb.generation.get()
                    )),
                ));
            }
            sb.log_root = root.into();
            sb.log_root_level = level;
            supers.push((devid, sb));
        }
        Ok(supers)
    }

    /// Seal and write block `bytenr` before its commit (writeback). Returns it as a clean
    /// block for the node cache.
    ///
    /// # Errors
    /// As `seal_tree_block`; `Io` from the devices.
    fn write_tree_block(&self, mut eb: ExtentBuffer) -> Result<Arc<ExtentBuffer>> {
        let bytenr = eb.bytenr;
        self.seal_tree_block(bytenr, &mut eb.data)?;
        crate::volumes::write_logical(
            &self.info.chunk_map,
            &self.info.devices,
            bytenr,
            &eb.data,
            crate::volumes::WriteKind::Metadata,
        )?;
        Ok(Arc::new(eb.mark_written()))
    }

    fn fill_backup_root(&mut self) -> Result<()> {
        // The kernel rotates through the four slots; the newest is the one after the
        // slot holding the previous generation.
        let prev = self
            .sb
            .super_roots
            .iter()
            .position(|b| b.tree_root_gen.get() == transid_prev(self.transid))
            .map(|i| (i + 1) % NUM_BACKUP_ROOTS)
            .unwrap_or(0);
        let mut b = RootBackup::new_zeroed();
        let get = |w: &mut Transaction, id: u64| -> Result<RootInfo> { w.root(id) };
        let tr = get(self, ROOT_TREE_OBJECTID)?;
        let ch = get(self, CHUNK_TREE_OBJECTID)?;
        let ex = get(self, EXTENT_TREE_OBJECTID)?;
        let fs = get(self, FS_TREE_OBJECTID)?;
        let dv = get(self, DEV_TREE_OBJECTID)?;
        let cs = get(self, CSUM_TREE_OBJECTID)?;
        b.tree_root = tr.bytenr.into();
        b.tree_root_gen = self.transid.into();
        b.tree_root_level = tr.level;
        b.chunk_root = ch.bytenr.into();
        b.chunk_root_gen = ch.generation.into();
        b.chunk_root_level = ch.level;
        b.extent_root = ex.bytenr.into();
        b.extent_root_gen = ex.generation.into();
        b.extent_root_level = ex.level;
        b.fs_root = fs.bytenr.into();
        b.fs_root_gen = fs.generation.into();
        b.fs_root_level = fs.level;
        b.dev_root = dv.bytenr.into();
        b.dev_root_gen = dv.generation.into();
        b.dev_root_level = dv.level;
        b.csum_root = cs.bytenr.into();
        b.csum_root_gen = cs.generation.into();
        b.csum_root_level = cs.level;
        b.total_bytes = self.sb.total_bytes;
        b.bytes_used = self.sb.bytes_used;
        b.num_devices = self.sb.num_devices;
        self.sb.super_roots[prev] = b;
        Ok(())
    }
}

/// What a freed block was when it was forgotten (`Transaction::forget_dirty`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Forgot {
    /// Dirty, never written.
    Dirty,
    /// Sealed for writeback, its write possibly still under way.
    Writing,
    /// Written (early, or committed).
    Written,
}

/// Blocks sealed for writeback at the end of a change, written by the engine without
/// its lock (`Transaction::take_writeback`).
pub struct Writeback {
    blocks: Vec<Arc<ExtentBuffer>>,
}

impl Writeback {
    /// Write every block to every copy (no flush: the commit flushes).
    ///
    /// # Errors
    /// `Io` from the devices (the caller aborts).
    pub fn write(&self, info: &FsInfo) -> Result<()> {
        for eb in &self.blocks {
            crate::volumes::write_logical(
                &info.chunk_map,
                &info.devices,
                eb.bytenr,
                &eb.data,
                crate::volumes::WriteKind::Metadata,
            )?;
        }
        Ok(())
    }
}

/// A sealed commit waiting for its I/O (`Transaction::start_commit`). Writing it needs
/// only the shared `FsInfo`, not the writer.
pub struct CommitIo {
    generation: u64,
    /// The transaction's blocks, sealed, by address (also the writer's `in_flight`).
    blocks: Arc<BTreeMap<u64, Arc<ExtentBuffer>>>,
    /// The superblock for each device (devid), its dev item filled in.
    supers: Vec<(u64, Box<Superblock>)>,
}

impl CommitIo {
    /// Write every block to every copy, flush, then write every superblock copy and
    /// flush again: after a crash the devices show either the previous commit or this
    /// one.
    ///
    /// # Errors
    /// `Io` from writes and flushes (the caller aborts).
    pub fn write(&self, info: &FsInfo) -> Result<()> {
        for (bytenr, eb) in self.blocks.iter() {
            crate::volumes::write_logical(
                &info.chunk_map,
                &info.devices,
                *bytenr,
                &eb.data,
                crate::volumes::WriteKind::Metadata,
            )?;
        }
        for d in info.devices.by_id.values() {
            d.dev.flush()?;
        }
        if info.is_last_commit() {
            // The kernel may have mounted the image since the unmount began (it ignores
            // our lock): a mount that read the previous superblock must not find ours
            // under its own writes. Its O_EXCL claim on the loop device comes before it
            // reads the superblock, so a mount under way is seen too.
            for d in info.devices.by_id.values() {
                if let Some(u) = d.dev.claim_for_last_commit().kernel.first() {
                    return Err(Error::posix_detail(
                        PosixKind::Busy,
                        u.to_string(),
                        "the last commit is not written, so as not to overwrite the kernel's",
                    ));
                }
            }
        }
        for (devid, sb) in &self.supers {
            let d = info.devices.by_id.get(devid).expect("supers made from these devices");
            write_super_mirrors(info, d.dev.as_ref(), sb)?;
            d.dev.flush()?;
        }
        Ok(())
    }
}

/// A superblock generation no transaction can follow (only a crafted one gets there).
fn last_generation(generation: u64) -> Error {
    Corrupt::new(
        CorruptWhere::Super,
        format!("generation {generation} is the last one, no transaction can follow it"),
    )
    .into()
}

/// The allocator handed out tree block `bytenr` while a committed tree uses it: the
/// free-space tree (the allocator's cache is loaded from it) calls space in use free.
/// The kernel detects the same in `btrfs_init_new_buffer` ("extent tree corruption").
fn in_use_reallocated(bytenr: u64, owner: Option<u64>, what: String) -> Error {
    let c = Corrupt::new(
        CorruptWhere::Block,
        format!("{what}: the free space tree marks space in use as free"),
    )
    .block(bytenr);
    match owner {
        Some(o) => c.root(o).into(),
        None => c.into(),
    }
}

fn transid_prev(t: u64) -> u64 {
    t - 1
}

impl Transaction {
    /// Create an empty tree `id` (one empty leaf) with a fresh ROOT_ITEM, as
    /// `btrfs_create_tree` does for new global trees and subvolumes.
    ///
    /// # Errors
    /// `Posix(Exists)` if the tree exists; allocation failures.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn create_tree(&mut self, id: u64) -> Result<RootInfo> {
        self.check_writable()?;
        if self.root(id).is_ok() {
            return Err(Error::posix(PosixKind::Exists, format!("tree {id}")));
        }
        self.transaction("create_tree", 0, |w| w.create_tree_inner(id))
    }

    pub(crate) fn create_tree_inner(&mut self, id: u64) -> Result<RootInfo> {
        let bytenr = self.alloc_tree_block(id, 0, Key::MIN)?;
        self.new_block(bytenr, id, 0);
        let mut item = RootItem::new_zeroed();
        item.inode.generation = 1.into();
        item.inode.size = 3.into();
        item.inode.nlink = 1.into();
        item.inode.nbytes = u64::from(self.nodesize()).into();
        item.inode.mode = (S_IFDIR | 0o755).into();
        item.generation = self.transid.into();
        item.generation_v2 = self.transid.into();
        item.bytenr = bytenr.into();
        item.refs = 1.into();
        item.ctransid = self.transid.into();
        item.otransid = self.transid.into();
        let info = RootInfo { id, bytenr, level: 0, generation: self.transid };
        self.insert_item(ROOT_TREE_OBJECTID, &Key::new(id, ROOT_ITEM_KEY, 0), item.as_bytes())?;
        self.roots.insert(id, RootState { info, item: Some(item), item_offset: 0, dirty: true });
        Ok(info)
    }
}

/// Write `sb` as copy `mirror` of the superblock of `dev`, with that copy's bytenr and
/// its checksum (not flushed).
///
/// # Errors
/// `Io` from the device.
fn write_super_copy(
    info: &FsInfo,
    dev: &dyn crate::volumes::device::BlockDevice,
    sb: &Superblock,
    mirror: usize,
) -> Result<()> {
    let mut sb = *sb;
    let off = sb_offset(mirror);
    sb.bytenr = off.into();
    let c = info.csum_type.compute(&sb.as_bytes()[CSUM_SIZE..]);
    sb.csum.copy_from_slice(&c);
    dev.write_at(sb.as_bytes(), off)
}

/// Write `sb` as the primary superblock of `dev`, not its mirrors (not flushed).
///
/// # Errors
/// `Io` from the device.
pub(crate) fn write_primary_super(
    info: &FsInfo,
    dev: &dyn crate::volumes::device::BlockDevice,
    sb: &Superblock,
) -> Result<()> {
    write_super_copy(info, dev, sb, 0)
}

/// Write `sb` to every superblock mirror that fits on `dev`, each with its own bytenr
/// and checksum (not flushed).
///
/// # Errors
/// `Io` from the writes.
pub(crate) fn write_super_mirrors(
    info: &FsInfo,
    dev: &dyn crate::volumes::device::BlockDevice,
    sb: &Superblock,
) -> Result<()> {
    for mirror in 0..SUPER_MIRROR_MAX {
        if sb_offset(mirror) + SUPER_INFO_SIZE as u64 > dev.size() {
            break;
        }
        write_super_copy(info, dev, sb, mirror)?;
    }
    Ok(())
}
