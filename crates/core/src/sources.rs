//! Where the engine takes time and identity from: a `Clock` for inode and root times
//! and a `UuidSource` for new filesystem, subvolume and device UUIDs. The defaults read
//! the system clock and the kernel's random source; tests, reproducible builds
//! (`SOURCE_DATE_EPOCH`) and the threaded engine's deterministic tests inject their own,
//! so the same operations give the same bytes.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// A point in time as btrfs stores it: seconds since the epoch and nanoseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Time {
    pub sec: i64,
    pub nsec: u32,
}

/// Where "now" comes from.
pub trait Clock: Send + Sync {
    /// Now, as finely as the clock tells it.
    fn now(&self) -> Time;

    /// Now at the clock's coarse granularity (the kernel's timer tick), and never
    /// before a time `now` has already given: what a write's time update compares
    /// the inode's times with, as the kernel's multigrain timestamps do
    /// (`current_time` of an inode whose ctime nobody has read). Successive readings
    /// inside one tick are equal, so a run of writes changes the times once. A clock
    /// without a coarse reading gives `now`.
    fn coarse_now(&self) -> Time {
        self.now()
    }
}

/// The system's wall clock. Its fine readings raise a floor that its coarse readings
/// never go below (the kernel's multigrain floor), so a coarse time given after a fine
/// one is never older: a file written after another is touched never looks older.
#[derive(Debug, Default)]
pub struct SystemClock {
    /// The latest fine reading, in nanoseconds since the epoch (readings before 1970
    /// raise no floor and are given as read).
    floor: AtomicU64,
}

/// `t` in nanoseconds since the epoch; None before it.
fn epoch_ns(t: Time) -> Option<u64> {
    u64::try_from(t.sec).ok()?.checked_mul(1_000_000_000)?.checked_add(u64::from(t.nsec))
}

impl Clock for SystemClock {
    fn now(&self) -> Time {
        let t = match SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(d) => {
                Time { sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX), nsec: d.subsec_nanos() }
            }
            // A clock set before 1970: btrfs stores signed seconds.
            Err(e) => {
                let d = e.duration();
                Time { sec: -i64::try_from(d.as_secs()).unwrap_or(i64::MAX), nsec: 0 }
            }
        };
        if let Some(ns) = epoch_ns(t) {
            self.floor.fetch_max(ns, Ordering::AcqRel);
        }
        t
    }

    fn coarse_now(&self) -> Time {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid timespec for the call to fill.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } != 0 {
            return self.now();
        }
        let t = Time { sec: ts.tv_sec, nsec: u32::try_from(ts.tv_nsec).unwrap_or(0) };
        let Some(ns) = epoch_ns(t) else { return t };
        let floor = self.floor.load(Ordering::Acquire);
        if floor <= ns {
            return t;
        }
        Time { sec: (floor / 1_000_000_000) as i64, nsec: (floor % 1_000_000_000) as u32 }
    }
}

/// A clock that starts at a fixed time and moves `step_ns` forward at every reading,
/// so successive changes stay ordered and every run reads the same times.
#[derive(Debug)]
pub struct FixedClock {
    start: Time,
    step_ns: u64,
    readings: AtomicU64,
}

impl FixedClock {
    pub fn new(start: Time, step_ns: u64) -> FixedClock {
        assert!(start.nsec < 1_000_000_000, "nanoseconds {} out of range", start.nsec);
        FixedClock { start, step_ns, readings: AtomicU64::new(0) }
    }
}

impl Clock for FixedClock {
    fn now(&self) -> Time {
        let n = self.readings.fetch_add(1, Ordering::Relaxed);
        let total = u64::from(self.start.nsec).saturating_add(n.saturating_mul(self.step_ns));
        let sec =
            self.start.sec.saturating_add(i64::try_from(total / 1_000_000_000).unwrap_or(i64::MAX));
        Time { sec, nsec: (total % 1_000_000_000) as u32 }
    }
}

/// Where new UUIDs come from.
pub trait UuidSource: Send + Sync {
    fn new_uuid(&self) -> [u8; 16];
}

/// Random version-4 UUIDs from the kernel's random source (`getrandom`).
#[derive(Clone, Copy, Debug, Default)]
pub struct RandomUuids;

impl UuidSource for RandomUuids {
    fn new_uuid(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        let mut got = 0;
        // getrandom(2) returns short only when interrupted; bounded by the 16 bytes.
        while got < b.len() {
            // SAFETY: the pointer and length name the unfilled tail of `b`.
            let r = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
            if r > 0 {
                got += r as usize;
            } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                // No random source at all: fall back to the clock and pid, still unique
                // enough for one machine, never a crash.
                let t = SystemClock::default().now();
                let seed =
                    (t.sec as u64) ^ (u64::from(t.nsec) << 32) ^ u64::from(std::process::id());
                return SeededUuids::new(seed).new_uuid();
            }
        }
        v4(b)
    }
}

/// Version-4-shaped UUIDs from a seed: the same seed gives the same sequence.
#[derive(Debug)]
pub struct SeededUuids {
    state: Mutex<u64>,
}

impl SeededUuids {
    pub fn new(seed: u64) -> SeededUuids {
        SeededUuids { state: Mutex::new(seed) }
    }
}

impl UuidSource for SeededUuids {
    fn new_uuid(&self) -> [u8; 16] {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut b = [0u8; 16];
        for half in b.chunks_mut(8) {
            half.copy_from_slice(&splitmix64(&mut s).to_le_bytes());
        }
        v4(b)
    }
}

fn splitmix64(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Set the version (4) and variant (RFC 4122) bits.
fn v4(mut b: [u8; 16]) -> [u8; 16] {
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    b
}

/// The clock and UUID source an engine uses.
#[derive(Clone)]
pub struct Sources {
    pub clock: Arc<dyn Clock>,
    pub uuids: Arc<dyn UuidSource>,
}

impl Default for Sources {
    fn default() -> Sources {
        Sources { clock: Arc::new(SystemClock::default()), uuids: Arc::new(RandomUuids) }
    }
}

impl Sources {
    /// Fixed sources for reproducible results: time starts at `start` and advances 1 µs
    /// per reading; UUIDs follow `seed`.
    pub fn deterministic(start: Time, seed: u64) -> Sources {
        Sources {
            clock: Arc::new(FixedClock::new(start, 1_000)),
            uuids: Arc::new(SeededUuids::new(seed)),
        }
    }
}

impl fmt::Debug for Sources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Sources { .. }")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_clock_advances_and_carries_into_seconds() {
        let c = FixedClock::new(Time { sec: 100, nsec: 999_999_500 }, 300);
        assert_eq!(c.now(), Time { sec: 100, nsec: 999_999_500 });
        assert_eq!(c.now(), Time { sec: 100, nsec: 999_999_800 });
        assert_eq!(c.now(), Time { sec: 101, nsec: 100 });
    }

    #[test]
    fn seeded_uuids_repeat_per_seed_and_are_v4() {
        let a = SeededUuids::new(7);
        let b = SeededUuids::new(7);
        let (a1, a2) = (a.new_uuid(), a.new_uuid());
        assert_eq!(a1, b.new_uuid());
        assert_eq!(a2, b.new_uuid());
        assert_ne!(a1, a2);
        assert_ne!(a1, SeededUuids::new(8).new_uuid());
        for u in [a1, a2, RandomUuids.new_uuid()] {
            assert_eq!(u[6] >> 4, 4, "version nibble of {u:02x?}");
            assert_eq!(u[8] >> 6, 0b10, "variant bits of {u:02x?}");
        }
        assert_ne!(RandomUuids.new_uuid(), RandomUuids.new_uuid());
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock::default().now().sec > 1_577_836_800);
    }

    #[test]
    fn coarse_readings_stay_put_within_a_tick_and_never_go_below_a_fine_one() {
        let c = SystemClock::default();
        let mut ticks = 0;
        let mut last = c.coarse_now();
        for _ in 0..100_000 {
            let fine = c.now();
            let coarse = c.coarse_now();
            assert!(coarse >= fine, "coarse {coarse:?} before an earlier fine reading {fine:?}");
            assert!(coarse >= last, "coarse readings went back: {last:?} then {coarse:?}");
            if coarse != last {
                ticks += 1;
            }
            last = coarse;
        }
        // Without fine readings in between, a run of coarse readings mostly repeats.
        let before = c.coarse_now();
        let same = (0..1000).filter(|_| c.coarse_now() == before).count();
        assert!(same > 0, "no two coarse readings were equal");
        assert!(ticks > 0, "the coarse clock never moved in 100,000 readings");
    }
}
