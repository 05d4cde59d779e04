//! Small helpers shared by benchmarks: per-call time summaries and duration formatting.
//! (Seeded randomness comes from `ubtrfs_core::volumes::fault::Rng`.)

use std::time::{Duration, Instant};

/// Summary of per-call times in nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CallStats {
    pub calls: usize,
    pub median_ns: u64,
    pub mean_ns: f64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

impl CallStats {
    pub fn from_samples(mut ns: Vec<u32>) -> CallStats {
        if ns.is_empty() {
            return CallStats::default();
        }
        ns.sort_unstable();
        let n = ns.len();
        let sum: u64 = ns.iter().map(|&x| u64::from(x)).sum();
        CallStats {
            calls: n,
            median_ns: u64::from(ns[n / 2]),
            mean_ns: sum as f64 / n as f64,
            p99_ns: u64::from(ns[(n * 99 / 100).min(n - 1)]),
            max_ns: u64::from(ns[n - 1]),
        }
    }
}

/// Cost of one `Instant::now()` + `elapsed()` pair, the overhead inside every probed call.
pub fn timer_overhead_ns() -> u64 {
    let mut samples: Vec<u32> = (0..20_000)
        .map(|_| {
            let t = Instant::now();
            u32::try_from(t.elapsed().as_nanos()).unwrap_or(u32::MAX)
        })
        .collect();
    samples.sort_unstable();
    u64::from(samples[samples.len() / 2])
}

/// Seconds with three decimals.
pub fn secs(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64())
}

/// `a / b` as "12.3x", or "-" when b is zero.
pub fn ratio(a: Duration, b: Duration) -> String {
    if b.is_zero() {
        "-".to_string()
    } else {
        format!("{:.1}x", a.as_secs_f64() / b.as_secs_f64())
    }
}

/// CPU time of the calling thread, from `/proc/thread-self/schedstat` (nanoseconds on
/// CPU); `None` where that file is missing. On a shared machine this, not wall time,
/// shows what the code costs.
pub fn thread_cpu() -> Option<Duration> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = s.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Wall and CPU time of one phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timing {
    pub wall: Duration,
    pub cpu: Option<Duration>,
}

impl Timing {
    pub fn sum(parts: &[Timing]) -> Timing {
        Timing { wall: parts.iter().map(|t| t.wall).sum(), cpu: parts.iter().map(|t| t.cpu).sum() }
    }
}

/// Times one phase: `let t = Stopwatch::start(); ...; let timing = t.stop();`.
pub struct Stopwatch {
    wall: Instant,
    cpu: Option<Duration>,
}

impl Stopwatch {
    pub fn start() -> Stopwatch {
        let cpu = thread_cpu();
        Stopwatch { wall: Instant::now(), cpu }
    }

    pub fn stop(self) -> Timing {
        let wall = self.wall.elapsed();
        let cpu = match (self.cpu, thread_cpu()) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a)),
            _ => None,
        };
        Timing { wall, cpu }
    }
}

/// Optional seconds, "-" when unknown.
pub fn secs_opt(d: Option<Duration>) -> String {
    d.map_or_else(|| "-".to_string(), secs)
}

/// Optional ratio, "-" when either side is unknown.
pub fn ratio_opt(a: Option<Duration>, b: Option<Duration>) -> String {
    match (a, b) {
        (Some(a), Some(b)) => ratio(a, b),
        _ => "-".to_string(),
    }
}
