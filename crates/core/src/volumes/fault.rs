//! A seeded fault-injecting `BlockDevice` for crash-consistency tests (redb's crash
//! backend, TigerBeetle's simulated storage, ZFS's ztest): lost unflushed writes,
//! reordered writes, torn writes, failing writes and flushes, bit flips on reads.
//!
//! # The device model
//!
//! `FaultyDevice` holds an image in memory. Its bytes are the *durable* state: what
//! survives a power loss. Every `write_at` and every `flush` is an *operation*,
//! numbered 0, 1, 2, ... in issue order (reads are not operations). A write does not
//! touch the durable state; it joins the *pending* (volatile cache) set. A successful
//! flush applies every pending write to the durable state, in issue order, and empties
//! the set. Reads return the durable state overlaid with the pending writes in issue
//! order, i.e. what a real disk returns while its cache is full.
//!
//! Power loss ("crash") at operation `k`: operations `0..k` completed; operation `k`
//! was in flight and fails, and so does every later call (reads included) with an
//! `Io` error. The disk after the power loss is the durable state plus an arbitrary
//! subset of the pending writes (including the in-flight write `k`, if it is a write),
//! applied in an arbitrary order (a disk cache may reorder writes between flushes), of
//! which one may be torn. A torn write reaches the disk in *atomic units*
//! (`atomic_unit` bytes, 4096 by default, aligned to device offsets): either a prefix of
//! its units, or any unit-by-unit mix. A unit is never split. A crash at a flush means
//! that flush did not complete: the writes before it are still only pending.
//! `crash_image(seed)` builds one such image; the seed picks the subset, the order and
//! the tear (see [`apply_power_loss`] for the mix of choices, and [`PowerLoss`] for the
//! record of what was chosen, which failure messages print).
//!
//! Injected failures that do not crash the device:
//! - a failing write (`fail_write_at(k)`, `fail_next_write(n)` or
//!   `fail_next_write_to(offset)`) returns `Io` and reaches neither the cache nor
//!   the disk;
//! - a failing flush (`fail_flush_at(k)`, or `fail_next_flush(n)`) returns `Io` and
//!   makes nothing durable: the pending writes stay pending (a later power loss may
//!   drop them), as when a disk reports a cache flush error;
//! - bit flips on reads (`flip_read_bits(seed, one_in)`): each read, with probability
//!   `1/one_in`, returns its buffer with one bit flipped; the stored bytes stay intact
//!   (a transient media or transfer error).
//!
//! Discards are not operations: the device takes them (granularity 4 KiB) and keeps
//! the list of ranges discarded (`discarded`), and the bytes stay as they were, as on
//! a disk that ignores the hint. `refuse_discards` makes it a device that takes none.
//!
//! # Invariants
//! - The durable state changes only at a successful flush, and only by the pending
//!   writes, applied in issue order.
//! - Operation numbers are dense and in issue order; the log (`log()`) holds every
//!   operation with its outcome, and the data of every write that was accepted, so a
//!   crash at any earlier point can be replayed later ([`CrashSweep`]).
//! - After the crash operation nothing is recorded and nothing changes: the device is
//!   gone.
//! - Everything is deterministic: the same operations, configuration and seed give the
//!   same images and the same read flips (there is no wall clock or global RNG here).
//!
//! Bounds: the device keeps the whole image plus the bytes of every write it accepted
//! (the log is what makes replaying any crash point possible), so it is for test-sized
//! images and workloads, not for long-running use. `CrashSweep` keeps one more image.
//!
//! Neighbours: `device` (the `BlockDevice` seam and `MemDevice`, which holds a
//! post-crash image for reopening); `crates/core/tests/crash.rs` (the crash tests that
//! drive `Transaction` through this device).

use crate::error::{Error, Result};
use crate::volumes::device::BlockDevice;
use std::collections::BTreeSet;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// SplitMix64: a small, fast, seedable generator (deterministic across platforms).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        // Mix the seed once so that nearby seeds give unrelated streams.
        let mut r = Rng(seed ^ 0x5851_f42d_4c95_7f2d);
        r.next_u64();
        r
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below(0)");
        // Multiply-shift: bias below 2^-64 * n, irrelevant for tests.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi, "Rng::range({lo}, {hi})");
        lo + self.below(hi - lo + 1)
    }
    /// True with probability `num/den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
    /// Fill `buf` with pseudo-random bytes.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let x = self.next_u64().to_le_bytes();
            c.copy_from_slice(&x[..c.len()]);
        }
    }
}

/// Mix a seed with a salt (e.g. a crash point) into a new seed.
pub fn mix_seed(seed: u64, salt: u64) -> u64 {
    Rng::new(seed ^ salt.wrapping_mul(0x2545_f491_4f6c_dd1d)).next_u64()
}

/// What an operation was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Write { offset: u64, len: u64 },
    Flush,
}

/// How an operation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpOutcome {
    /// Completed (a write is now pending; a flush made everything durable).
    Ok,
    /// An injected failure (`fail_write_at`/`fail_flush_at`): returned `Io`, changed
    /// nothing; the device lives on.
    Failed,
    /// The power-loss operation: in flight when the power went, returned `Io`.
    Crashed,
}

/// One operation of the log.
#[derive(Clone, Debug)]
pub struct OpRecord {
    pub kind: OpKind,
    pub outcome: OpOutcome,
    /// The bytes of a write that was accepted (Ok) or in flight (Crashed).
    pub data: Option<Arc<[u8]>>,
}

impl OpRecord {
    pub fn is_write(&self) -> bool {
        matches!(self.kind, OpKind::Write { .. })
    }
    pub fn is_flush(&self) -> bool {
        self.kind == OpKind::Flush
    }
}

/// What one simulated power loss did to the pending writes (for failure messages).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PowerLoss {
    /// How the subset was chosen: `lose-all`, `keep-all`, `prefix` or `subset`.
    pub mode: &'static str,
    /// Operation numbers of the writes that reached the disk, in the order applied.
    pub applied: Vec<u64>,
    /// Operation numbers of the writes lost entirely.
    pub lost: Vec<u64>,
    /// A torn write: (operation, which of its units reached the disk, in order).
    pub torn: Option<(u64, Vec<bool>)>,
}

impl fmt::Display for PowerLoss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "power loss {}: applied {:?}, lost {:?}", self.mode, self.applied, self.lost)?;
        if let Some((op, units)) = &self.torn {
            let s: String = units.iter().map(|&u| if u { '1' } else { '0' }).collect();
            write!(f, ", op {op} torn (units {s})")?;
        }
        Ok(())
    }
}

/// Apply a seeded power loss: `pending` (op number, offset, data; in issue order) onto
/// `img`, which holds the durable state.
///
/// The seed picks one of four modes, each a quarter of the time:
/// - `lose-all`: nothing pending reaches the disk;
/// - `keep-all`: everything does, in issue order (the cache drained just in time);
/// - `prefix`: the first `j` writes in issue order (an in-order device);
/// - `subset`: each write with probability 1/2, in a random order.
///
/// Then, half of the time, the last write applied is torn (a random prefix of its
/// units, or a random unit-by-unit mix), if it spans more than one unit.
pub fn apply_power_loss(
    img: &mut [u8],
    pending: &[(u64, u64, Arc<[u8]>)],
    seed: u64,
    atomic_unit: u64,
) -> PowerLoss {
    assert!(atomic_unit > 0, "atomic unit must be positive");
    let mut rng = Rng::new(seed);
    let n = pending.len();
    let mode = rng.below(4);
    let mut order: Vec<usize> = match mode {
        0 => Vec::new(),
        1 => (0..n).collect(),
        2 => (0..rng.range(0, n as u64) as usize).collect(),
        _ => {
            let mut v: Vec<usize> = (0..n).filter(|_| rng.chance(1, 2)).collect();
            rng.shuffle(&mut v);
            v
        }
    };
    let mut loss = PowerLoss {
        mode: ["lose-all", "keep-all", "prefix", "subset"][mode as usize],
        ..Default::default()
    };
    let kept: BTreeSet<usize> = order.iter().copied().collect();
    loss.lost = (0..n).filter(|i| !kept.contains(i)).map(|i| pending[i].0).collect();
    // Decide the tear before applying, so the order of rng draws stays fixed.
    let mut tear: Option<Vec<bool>> = None;
    if let Some(&last) = order.last() {
        let (_, off, data) = &pending[last];
        let units = unit_spans(*off, data.len() as u64, atomic_unit);
        if units.len() > 1 && rng.chance(1, 2) {
            let mask: Vec<bool> = if rng.chance(1, 2) {
                let keep = rng.below(units.len() as u64) as usize;
                (0..units.len()).map(|i| i < keep).collect()
            } else {
                (0..units.len()).map(|_| rng.chance(1, 2)).collect()
            };
            tear = Some(mask);
        }
    }
    let last = order.pop();
    for &i in &order {
        let (op, off, data) = &pending[i];
        apply(img, *off, data);
        loss.applied.push(*op);
    }
    if let Some(i) = last {
        let (op, off, data) = &pending[i];
        match tear {
            None => apply(img, *off, data),
            Some(mask) => {
                for (&(s, e), &on) in
                    unit_spans(*off, data.len() as u64, atomic_unit).iter().zip(&mask)
                {
                    if on {
                        let a = (s - off) as usize;
                        let b = (e - off) as usize;
                        apply(img, s, &data[a..b]);
                    }
                }
                loss.torn = Some((*op, mask));
            }
        }
        loss.applied.push(*op);
    }
    loss
}

/// The atomic units `[s, e)` a write of `len` bytes at `off` covers (clipped to it).
fn unit_spans(off: u64, len: u64, unit: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let end = off + len;
    let mut s = off;
    while s < end {
        let e = ((s / unit) + 1).saturating_mul(unit).min(end);
        out.push((s, e));
        s = e;
    }
    out
}

fn apply(img: &mut [u8], off: u64, data: &[u8]) {
    let o = usize::try_from(off).expect("in-memory image offset fits usize");
    img[o..o + data.len()].copy_from_slice(data);
}

struct State {
    durable: Vec<u8>,
    /// Accepted, unflushed writes: op numbers in issue order.
    pending: Vec<u64>,
    log: Vec<OpRecord>,
    crash_at: Option<u64>,
    crashed: bool,
    fail_writes: BTreeSet<u64>,
    fail_flushes: BTreeSet<u64>,
    /// Failing flushes/writes by ordinal among flushes/writes (see `fail_next_flush`).
    fail_flush_ordinals: BTreeSet<u64>,
    fail_write_ordinals: BTreeSet<u64>,
    fail_write_offsets: BTreeSet<u64>,
    flushes_seen: u64,
    writes_seen: u64,
    flip: Option<(u64, u64)>,
    reads: u64,
    flips: u64,
    atomic_unit: u64,
    /// Ranges discarded (offset, length), in order; None once discards are refused.
    discards: Option<Vec<(u64, u64)>>,
}

/// The fault-injecting in-memory device (see the module documentation for the model).
pub struct FaultyDevice {
    name: String,
    size: u64,
    state: Mutex<State>,
    /// Flushes (`hold_flushes`) or reads (`hold_reads`) wait while held, so a test can
    /// act while a commit's or a reader's I/O is under way.
    gate: Mutex<Gate>,
    gate_cv: Condvar,
}

#[derive(Clone, Copy)]
enum Gated {
    Read,
    Write,
    Flush,
}

#[derive(Default)]
struct Gate {
    flushes: bool,
    reads: bool,
    writes: bool,
    /// Operations waiting at the gate now.
    waiting: u64,
    /// How long each flush takes (`set_flush_time`).
    flush_time: std::time::Duration,
}

impl FaultyDevice {
    /// A device whose durable state is `image`, with no faults armed.
    pub fn new(image: Vec<u8>, name: impl Into<String>) -> FaultyDevice {
        let size = image.len() as u64;
        FaultyDevice {
            name: name.into(),
            size,
            state: Mutex::new(State {
                durable: image,
                pending: Vec::new(),
                log: Vec::new(),
                crash_at: None,
                crashed: false,
                fail_writes: BTreeSet::new(),
                fail_flushes: BTreeSet::new(),
                fail_flush_ordinals: BTreeSet::new(),
                fail_write_ordinals: BTreeSet::new(),
                fail_write_offsets: BTreeSet::new(),
                flushes_seen: 0,
                writes_seen: 0,
                flip: None,
                reads: 0,
                flips: 0,
                atomic_unit: 4096,
                discards: Some(Vec::new()),
            }),
            gate: Mutex::new(Gate::default()),
            gate_cv: Condvar::new(),
        }
    }

    fn gate(&self) -> MutexGuard<'_, Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Make every flush wait until `release_held` (a commit then stops in its I/O).
    pub fn hold_flushes(&self) {
        self.gate().flushes = true;
    }

    /// Make every read wait until `release_held`.
    pub fn hold_reads(&self) {
        self.gate().reads = true;
    }

    /// Make every write wait until `release_held`.
    pub fn hold_writes(&self) {
        self.gate().writes = true;
    }

    /// Make every flush take `t` before it is done, as a disk's cache flush does (the
    /// writes it makes durable are the ones issued before its end).
    pub fn set_flush_time(&self, t: std::time::Duration) {
        self.gate().flush_time = t;
    }

    /// Let held flushes and reads go on.
    pub fn release_held(&self) {
        let mut g = self.gate();
        g.flushes = false;
        g.reads = false;
        g.writes = false;
        self.gate_cv.notify_all();
    }

    /// Wait until an operation is waiting at the gate (`hold_flushes`, `hold_reads`), at
    /// most `timeout`. Returns whether one is.
    pub fn wait_for_held_op(&self, timeout: std::time::Duration) -> bool {
        let g = self.gate();
        let (g, _) = self
            .gate_cv
            .wait_timeout_while(g, timeout, |g| g.waiting == 0)
            .unwrap_or_else(|p| p.into_inner());
        g.waiting > 0
    }

    fn pass_gate(&self, op: Gated) {
        let held = |g: &Gate| match op {
            Gated::Read => g.reads,
            Gated::Write => g.writes,
            Gated::Flush => g.flushes,
        };
        let mut g = self.gate();
        if held(&g) {
            g.waiting += 1;
            self.gate_cv.notify_all();
            let mut g = self.gate_cv.wait_while(g, |g| held(g)).unwrap_or_else(|p| p.into_inner());
            g.waiting -= 1;
        }
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lose power at operation `k` (it and everything after fail).
    pub fn crash_at(&self, k: u64) {
        self.st().crash_at = Some(k);
    }
    /// Make the write that is operation `k` fail (the device lives on).
    pub fn fail_write_at(&self, k: u64) {
        self.st().fail_writes.insert(k);
    }
    /// Make the flush that is operation `k` fail (the device lives on).
    pub fn fail_flush_at(&self, k: u64) {
        self.st().fail_flushes.insert(k);
    }
    /// Make the `n`-th flush issued from now fail (0 = the next one), whatever its
    /// operation number (for targeting a flush inside a commit).
    pub fn fail_next_flush(&self, n: u64) {
        let mut st = self.st();
        let at = st.flushes_seen + n;
        st.fail_flush_ordinals.insert(at);
    }
    /// Make the `n`-th write issued from now fail (0 = the next one).
    pub fn fail_next_write(&self, n: u64) {
        let mut st = self.st();
        let at = st.writes_seen + n;
        st.fail_write_ordinals.insert(at);
    }
    /// Make the next write that starts at device offset `offset` fail (once).
    pub fn fail_next_write_to(&self, offset: u64) {
        self.st().fail_write_offsets.insert(offset);
    }
    /// Flip one bit in about one read of every `one_in`, seeded.
    pub fn flip_read_bits(&self, seed: u64, one_in: u64) {
        assert!(one_in > 0, "one_in must be positive");
        self.st().flip = Some((seed, one_in));
    }
    /// Stop flipping read bits.
    pub fn stop_flipping(&self) {
        self.st().flip = None;
    }
    /// Set the torn-write granularity (bytes; a power of two is typical).
    pub fn set_atomic_unit(&self, unit: u64) {
        assert!(unit > 0, "atomic unit must be positive");
        self.st().atomic_unit = unit;
    }
    pub fn atomic_unit(&self) -> u64 {
        self.st().atomic_unit
    }

    /// Take no discards from now on (`discard_granularity` says None).
    pub fn refuse_discards(&self) {
        self.st().discards = None;
    }
    /// Every range discarded so far (offset, length), in the order discarded.
    pub fn discarded(&self) -> Vec<(u64, u64)> {
        self.st().discards.clone().unwrap_or_default()
    }

    /// Operations issued so far (writes and flushes, the crash operation included).
    pub fn op_count(&self) -> u64 {
        self.st().log.len() as u64
    }
    /// True once the power-loss operation has happened.
    pub fn crashed(&self) -> bool {
        self.st().crashed
    }
    /// Bits flipped on reads so far.
    pub fn flips(&self) -> u64 {
        self.st().flips
    }
    /// Every operation so far, with its outcome and write data.
    pub fn log(&self) -> Vec<OpRecord> {
        self.st().log.clone()
    }
    /// Accepted writes not yet flushed (op numbers).
    pub fn pending_ops(&self) -> Vec<u64> {
        self.st().pending.clone()
    }
    /// A copy of the durable state (what a power loss that drops every pending write
    /// leaves).
    pub fn durable_image(&self) -> Vec<u8> {
        self.st().durable.clone()
    }
    /// A copy of what reads see: the durable state with every pending write applied in
    /// issue order (what a clean shutdown after a final flush leaves).
    pub fn current_image(&self) -> Vec<u8> {
        let st = self.st();
        let mut img = st.durable.clone();
        for &op in &st.pending {
            let (off, data) = write_of(&st.log[op as usize]);
            apply(&mut img, off, data);
        }
        img
    }

    /// Give up the device, returning its durable state.
    pub fn into_durable(self) -> Vec<u8> {
        self.state.into_inner().unwrap_or_else(|p| p.into_inner()).durable
    }

    /// The disk after a power loss now (or at the crash operation, if it happened):
    /// the durable state plus a seeded subset of the pending writes (and the in-flight
    /// crash write) in a seeded order, one possibly torn.
    pub fn crash_image(&self, seed: u64) -> Vec<u8> {
        self.crash_image_report(seed).0
    }

    /// `crash_image`, also saying what the power loss did.
    pub fn crash_image_report(&self, seed: u64) -> (Vec<u8>, PowerLoss) {
        let st = self.st();
        let mut img = st.durable.clone();
        let mut pending: Vec<(u64, u64, Arc<[u8]>)> = st
            .pending
            .iter()
            .map(|&op| {
                let r = &st.log[op as usize];
                let (off, _) = write_of(r);
                (op, off, r.data.clone().expect("accepted writes keep their data"))
            })
            .collect();
        if let Some(r) = st.log.last() {
            if r.outcome == OpOutcome::Crashed && r.is_write() {
                let (off, _) = write_of(r);
                pending.push((
                    st.log.len() as u64 - 1,
                    off,
                    r.data.clone().expect("the crash write keeps its data"),
                ));
            }
        }
        let loss = apply_power_loss(&mut img, &pending, seed, st.atomic_unit);
        (img, loss)
    }

    fn dead(&self, what: &str, at: Option<u64>) -> Error {
        let when = match at {
            Some(k) => format!("injected power loss at op {k}"),
            None => "device lost power earlier".to_string(),
        };
        Error::io(format!("{}: {what}", self.name), std::io::Error::other(when))
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<()> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(Error::io(
                format!(
                    "{}: access [{offset}, +{len}) beyond end of device ({} bytes)",
                    self.name, self.size
                ),
                std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
            )),
        }
    }
}

fn write_of(r: &OpRecord) -> (u64, &[u8]) {
    match (r.kind, &r.data) {
        (OpKind::Write { offset, .. }, Some(d)) => (offset, d),
        _ => panic!("op is not an accepted write: {r:?}"),
    }
}

impl BlockDevice for FaultyDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.pass_gate(Gated::Read);
        let mut st = self.st();
        if st.crashed {
            return Err(self.dead(&format!("read of {} bytes at {offset}", buf.len()), None));
        }
        self.check_range(offset, buf.len())?;
        let o = offset as usize;
        buf.copy_from_slice(&st.durable[o..o + buf.len()]);
        let end = offset + buf.len() as u64;
        for &op in &st.pending {
            let (woff, data) = write_of(&st.log[op as usize]);
            let wend = woff + data.len() as u64;
            let s = woff.max(offset);
            let e = wend.min(end);
            if s < e {
                buf[(s - offset) as usize..(e - offset) as usize]
                    .copy_from_slice(&data[(s - woff) as usize..(e - woff) as usize]);
            }
        }
        st.reads += 1;
        if let Some((seed, one_in)) = st.flip {
            let mut rng = Rng::new(mix_seed(seed, st.reads));
            if !buf.is_empty() && rng.below(one_in) == 0 {
                let bit = rng.below(buf.len() as u64 * 8);
                buf[(bit / 8) as usize] ^= 1 << (bit % 8);
                st.flips += 1;
            }
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.pass_gate(Gated::Write);
        let mut st = self.st();
        if st.crashed {
            return Err(self.dead(&format!("write of {} bytes at {offset}", buf.len()), None));
        }
        self.check_range(offset, buf.len())?;
        let k = st.log.len() as u64;
        let ordinal = st.writes_seen;
        st.writes_seen += 1;
        let kind = OpKind::Write { offset, len: buf.len() as u64 };
        if st.crash_at == Some(k) {
            st.crashed = true;
            st.log.push(OpRecord { kind, outcome: OpOutcome::Crashed, data: Some(buf.into()) });
            return Err(self.dead(&format!("write of {} bytes at {offset}", buf.len()), Some(k)));
        }
        if st.fail_writes.contains(&k)
            || st.fail_write_ordinals.contains(&ordinal)
            || st.fail_write_offsets.remove(&offset)
        {
            st.log.push(OpRecord { kind, outcome: OpOutcome::Failed, data: None });
            return Err(Error::io(
                format!("{}: write of {} bytes at {offset}", self.name, buf.len()),
                std::io::Error::other(format!("injected write failure at op {k}")),
            ));
        }
        st.log.push(OpRecord { kind, outcome: OpOutcome::Ok, data: Some(buf.into()) });
        st.pending.push(k);
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        self.pass_gate(Gated::Flush);
        let t = self.gate().flush_time;
        if !t.is_zero() {
            std::thread::sleep(t);
        }
        let mut st = self.st();
        if st.crashed {
            return Err(self.dead("flush", None));
        }
        let k = st.log.len() as u64;
        let ordinal = st.flushes_seen;
        st.flushes_seen += 1;
        if st.crash_at == Some(k) {
            st.crashed = true;
            st.log.push(OpRecord { kind: OpKind::Flush, outcome: OpOutcome::Crashed, data: None });
            return Err(self.dead("flush", Some(k)));
        }
        if st.fail_flushes.contains(&k) || st.fail_flush_ordinals.contains(&ordinal) {
            st.log.push(OpRecord { kind: OpKind::Flush, outcome: OpOutcome::Failed, data: None });
            return Err(Error::io(
                format!("{}: flush", self.name),
                std::io::Error::other(format!("injected flush failure at op {k}")),
            ));
        }
        st.log.push(OpRecord { kind: OpKind::Flush, outcome: OpOutcome::Ok, data: None });
        let pending = std::mem::take(&mut st.pending);
        let State { durable, log, .. } = &mut *st;
        for op in pending {
            let (off, data) = write_of(&log[op as usize]);
            apply(durable, off, data);
        }
        Ok(())
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn discard_granularity(&self) -> Option<u64> {
        self.st().discards.is_some().then_some(4096)
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let mut st = self.st();
        if st.crashed {
            return Err(self.dead(&format!("discard of {len} bytes at {offset}"), None));
        }
        let l = usize::try_from(len).map_err(|_| {
            Error::posix_detail(
                crate::error::PosixKind::Invalid,
                self.name.clone(),
                format!("discard of {len} bytes at {offset}"),
            )
        })?;
        self.check_range(offset, l)?;
        match st.discards.as_mut() {
            Some(d) => {
                d.push((offset, len));
                Ok(())
            }
            None => Err(Error::posix_detail(
                crate::error::PosixKind::NotSupported,
                self.name.clone(),
                "the device takes no discards",
            )),
        }
    }
}

/// Replays a recorded run to build the image a power loss at any operation would have
/// left, without rerunning the workload: crash points must be visited in
/// non-decreasing order, and the durable state is advanced flush by flush.
pub struct CrashSweep {
    durable: Vec<u8>,
    log: Vec<OpRecord>,
    /// Operations `0..folded` are folded into `durable`/`pending`.
    folded: usize,
    pending: Vec<u64>,
    atomic_unit: u64,
}

impl CrashSweep {
    /// `base` is the image the recorded device started from; `log` its operations.
    pub fn new(base: Vec<u8>, log: Vec<OpRecord>, atomic_unit: u64) -> CrashSweep {
        CrashSweep { durable: base, log, folded: 0, pending: Vec::new(), atomic_unit }
    }

    pub fn op_count(&self) -> u64 {
        self.log.len() as u64
    }

    pub fn log(&self) -> &[OpRecord] {
        &self.log
    }

    /// The durable state with operations `0..k` done (k non-decreasing across calls).
    fn advance(&mut self, k: u64) {
        let k = usize::try_from(k).expect("op number fits usize");
        assert!(k >= self.folded, "crash points must not decrease: {k} after {}", self.folded);
        assert!(k <= self.log.len(), "crash point {k} beyond the {} recorded ops", self.log.len());
        while self.folded < k {
            let r = &self.log[self.folded];
            match (r.kind, r.outcome) {
                (OpKind::Write { .. }, OpOutcome::Ok) => self.pending.push(self.folded as u64),
                (OpKind::Flush, OpOutcome::Ok) => {
                    for op in std::mem::take(&mut self.pending) {
                        let (off, data) = write_of(&self.log[op as usize]);
                        apply(&mut self.durable, off, data);
                    }
                }
                // A failed op changed nothing; a crash op cannot be passed.
                (_, OpOutcome::Failed) => {}
                (_, OpOutcome::Crashed) => {
                    panic!("cannot replay past the recorded crash at op {}", self.folded)
                }
            }
            self.folded += 1;
        }
    }

    /// Pending writes at crash point `k`: accepted unflushed writes, plus op `k` itself
    /// if it is a write (in flight when the power went).
    fn pending_at(&self, k: u64) -> Vec<(u64, u64, Arc<[u8]>)> {
        let mut v: Vec<(u64, u64, Arc<[u8]>)> = self
            .pending
            .iter()
            .map(|&op| {
                let r = &self.log[op as usize];
                (op, write_of(r).0, r.data.clone().expect("accepted"))
            })
            .collect();
        if let Some(r) = self.log.get(k as usize) {
            if r.is_write() {
                if let Some(d) = &r.data {
                    v.push((k, write_of(r).0, d.clone()));
                }
            }
        }
        v
    }

    /// Build into `out` the disk after a power loss at operation `k` (`k == op_count()`
    /// means after the last operation), with the seeded choices of `apply_power_loss`.
    /// `out` is reused to avoid a fresh allocation of the whole image per point.
    pub fn image_at(&mut self, k: u64, seed: u64, out: &mut Vec<u8>) -> PowerLoss {
        self.advance(k);
        out.clear();
        out.extend_from_slice(&self.durable);
        let pending = self.pending_at(k);
        apply_power_loss(out, &pending, seed, self.atomic_unit)
    }

    /// The durable state at crash point `k` before any pending write is applied.
    pub fn durable_at(&mut self, k: u64) -> &[u8] {
        self.advance(k);
        &self.durable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(n: usize) -> FaultyDevice {
        FaultyDevice::new(vec![0u8; n], "t")
    }

    #[test]
    fn writes_are_volatile_until_flush() {
        let d = dev(16384);
        d.write_at(&[1u8; 4096], 0).unwrap();
        let mut b = [0u8; 4096];
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [1u8; 4096], "reads see pending writes");
        assert_eq!(d.durable_image()[0], 0, "a write is not durable before a flush");
        d.flush().unwrap();
        assert_eq!(d.durable_image()[..4096], [1u8; 4096]);
        assert_eq!(d.op_count(), 2);
    }

    #[test]
    fn crash_fails_everything_after() {
        let d = dev(16384);
        d.crash_at(1);
        d.write_at(&[1u8; 4096], 0).unwrap();
        assert!(d.write_at(&[2u8; 4096], 4096).is_err());
        assert!(d.crashed());
        assert!(d.flush().is_err());
        let mut b = [0u8; 16];
        assert!(d.read_at(&mut b, 0).is_err());
        assert_eq!(d.op_count(), 2, "nothing is recorded after the crash");
        // Every image holds only bytes that were written or were there.
        for seed in 0..64 {
            let img = d.crash_image(seed);
            assert!(img[..4096].iter().all(|&x| x == 0) || img[..4096].iter().all(|&x| x == 1));
            for u in img[4096..8192].chunks(4096) {
                assert!(u.iter().all(|&x| x == 0) || u.iter().all(|&x| x == 2));
            }
            assert!(img[8192..].iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn durable_writes_survive_every_crash() {
        let d = dev(65536);
        d.write_at(&[7u8; 8192], 8192).unwrap();
        d.flush().unwrap();
        d.write_at(&[9u8; 16384], 0).unwrap();
        let mut seen = BTreeSet::new();
        for seed in 0..200 {
            let (img, loss) = d.crash_image_report(seed);
            // The durable write may be overwritten only where a later write landed.
            for (i, u) in img.chunks(4096).enumerate() {
                let v = u[0];
                assert!(u.iter().all(|&x| x == v), "unit {i} mixed inside: {loss}");
                match i {
                    0 | 1 => assert!(v == 0 || v == 9),
                    2 | 3 => assert!(v == 7 || v == 9),
                    _ => assert_eq!(v, 0),
                }
            }
            seen.insert(loss.mode);
            if loss.torn.is_some() {
                seen.insert("torn");
            }
        }
        assert_eq!(seen.len(), 5, "every mode and a tear happen: {seen:?}");
    }

    #[test]
    fn failed_flush_keeps_writes_pending() {
        let d = dev(8192);
        d.fail_flush_at(1);
        d.write_at(&[3u8; 4096], 0).unwrap();
        assert!(d.flush().is_err());
        assert_eq!(d.pending_ops(), vec![0]);
        assert_eq!(d.durable_image()[0], 0);
        d.flush().unwrap();
        assert_eq!(d.durable_image()[0], 3);
    }

    #[test]
    fn relative_failures_count_flushes_and_writes() {
        let d = dev(8192);
        d.write_at(&[1u8; 4096], 0).unwrap();
        d.fail_next_flush(1);
        d.fail_next_write(1);
        d.flush().unwrap();
        d.write_at(&[2u8; 4096], 0).unwrap();
        assert!(d.write_at(&[3u8; 4096], 4096).is_err());
        assert!(d.flush().is_err());
        d.flush().unwrap();
        assert_eq!(d.durable_image()[0], 2);
        assert_eq!(d.durable_image()[4096], 0);
    }

    #[test]
    fn failed_write_changes_nothing() {
        let d = dev(8192);
        d.fail_write_at(0);
        assert!(d.write_at(&[3u8; 4096], 0).is_err());
        d.flush().unwrap();
        assert_eq!(d.current_image()[0], 0);
        assert_eq!(d.log()[0].outcome, OpOutcome::Failed);
    }

    #[test]
    fn sweep_matches_live_crash() {
        // Record a run, then compare replayed crash images with live crashes.
        let run = |d: &FaultyDevice| {
            let mut r = Rng::new(5);
            for _ in 0..40 {
                if r.chance(1, 4) {
                    let _ = d.flush();
                } else {
                    let mut b = vec![0u8; 4096 * r.range(1, 3) as usize];
                    r.fill(&mut b);
                    let _ = d.write_at(&b, 4096 * r.below(12));
                }
            }
        };
        let rec = dev(65536);
        run(&rec);
        let mut sweep = CrashSweep::new(vec![0u8; 65536], rec.log(), 4096);
        let mut out = Vec::new();
        for k in 0..=rec.op_count() {
            let live = dev(65536);
            live.crash_at(k);
            run(&live);
            let seed = mix_seed(11, k);
            let loss = sweep.image_at(k, seed, &mut out);
            let (img, live_loss) = live.crash_image_report(seed);
            assert_eq!(loss, live_loss, "k={k}");
            assert!(img == out, "k={k}: replayed image differs from the live crash ({loss})");
        }
    }

    #[test]
    fn read_flips_are_seeded() {
        let a = dev(4096);
        let b = dev(4096);
        a.flip_read_bits(3, 2);
        b.flip_read_bits(3, 2);
        let mut x = vec![0u8; 4096];
        let mut y = vec![0u8; 4096];
        for _ in 0..20 {
            a.read_at(&mut x, 0).unwrap();
            b.read_at(&mut y, 0).unwrap();
            assert_eq!(x, y);
        }
        assert!(a.flips() > 0);
        assert_eq!(a.durable_image(), vec![0u8; 4096], "flips never reach the stored bytes");
    }

    #[test]
    fn unit_spans_clip() {
        assert_eq!(unit_spans(1000, 5000, 4096), vec![(1000, 4096), (4096, 6000)]);
        assert_eq!(unit_spans(0, 4096, 4096), vec![(0, 4096)]);
    }
}
