//! Differential test against the kernel: the same seeded sequence of POSIX operations
//! runs on a kernel loop mount (syscalls) and through the ubtrfs engine, from
//! byte-identical fresh `mkfs.btrfs` images. Every operation's result must agree
//! (success or the errno, and what reads return); every `CHECK_EVERY` operations the
//! kernel's tree and the engine's live view are compared; at the end the ubtrfs image,
//! committed and reopened, must equal the kernel's tree (contents, modes, owners, sizes,
//! nlink, xattrs, directory sizes, explicitly set times, and where SEEK_DATA and
//! SEEK_HOLE find each file's data), pass `btrfs check`, and look the same through a
//! kernel mount. The ubtrfs side commits and reopens at random points.
//! Seeds vary the image and the mount (`posix::mkfs_args`, `posix::compress_of`): 4 KiB
//! nodes, no extref, no no-holes, compress=zstd, compress-force=zlib:3, compress=lzo.
//! The machinery, and which checks stand for the VFS and which are the engine's, is in
//! common/posix.rs.
//!
//! CI's run (64 seeds of 3000 operations, about 190k in all) takes about 21 s of wall
//! time on 2 cores in a debug build (kernel side about 34k operations/s, ubtrfs side
//! about 11k operations/s, each counted inside its operations only).
//!
//! Commands (root; skipped otherwise, a failure under CI=true):
//!
//!     cargo test -p ubtrfs-core --test posix_diff                  # CI: CI_SEEDS x CI_OPS
//!     UBTRFS_SOAK_SEEDS=1000..1200 UBTRFS_SOAK_OPS=20000 \
//!         cargo test -p ubtrfs-core --test posix_diff -- --ignored soak --nocapture
//!
//! The soak test's seeds are a range `A..B` or one seed `S` (default 1000..1100, 10000
//! operations each). To replay a failing seed closely: `UBTRFS_SOAK_SEEDS=S`, with
//! `UBTRFS_POSIX_CHECK_EVERY=1` (compare the trees after every operation) and
//! `UBTRFS_POSIX_KEEP_GOING=1` (log every disagreement instead of stopping at the
//! first), `UBTRFS_POSIX_TRACE=1` (print every operation and the kernel's result);
//! `KEEP=1` keeps the images.
//!
//! Disagreements already found and reported are in `KNOWN`: an operation one matches is
//! applied to neither side, counted, and printed at the end of every run. Seeds that
//! meet an engine bug of another kind are in `KNOWN_SEEDS` (skipped, with a message,
//! unless `UBTRFS_POSIX_KNOWN_SEEDS=1`).

mod common;
#[path = "common/posix.rs"]
mod posix;
#[path = "common/write.rs"]
mod write_common;

use posix::{OpKind, Run, Stats};
use std::path::PathBuf;
use std::time::Instant;

/// The seeds and operations CI runs: at least 100k operations in all.
const CI_SEEDS: u64 = 64;
const CI_OPS: u64 = 3000;
const CHECK_EVERY: u64 = 250;
/// Seeds run on this many threads at once (each has its own images and mount).
const THREADS: u64 = 2;

/// The operations of the CI runs: every kind but `chattr` (which `with_chattr` adds;
/// without it the generator's stream, and so the seeds quoted in `posix::KNOWN`, stay
/// as they were).
fn available() -> Vec<OpKind> {
    posix::WEIGHTS.iter().map(|w| w.0).filter(|&k| k != OpKind::Chattr).collect()
}

/// Seeds that find an engine bug that is no disagreement of one operation, reported and
/// skipped (with a message) until fixed. CI's seeds hold none of them. (As in `KNOWN`,
/// the numbers are those of the commit that added the seed.)
const KNOWN_SEEDS: &[(u64, &str)] = &[
    // Seeds 49, 121, 3209, 4033 and 5033 (4 KiB nodes) found commits that did not converge
    // (leaves merged full split again each round); fixed by the merge's hysteresis.
];

fn scratch_dir() -> PathBuf {
    let base = match std::env::var_os("UBTRFS_SCRATCH") {
        Some(d) => PathBuf::from(d),
        None if std::path::Path::new("/dev/shm").is_dir() => PathBuf::from("/dev/shm"),
        None => std::env::temp_dir(),
    };
    let d = base.join("ubtrfs-posix-diff");
    std::fs::create_dir_all(&d).expect("scratch dir");
    d
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v}: not a number")))
        .unwrap_or(default)
}

/// Run `seeds` on `THREADS` threads; panic with every failing seed's first disagreement.
fn run_seeds(seeds: Vec<u64>, ops: u64, avail: &[OpKind]) -> Stats {
    // The kernel applies the umask to new modes; ubtrfs's callers pass modes as given.
    // SAFETY: umask has no preconditions (it is process-wide; this binary only runs
    // these tests).
    unsafe { libc::umask(0) };
    let check_every = env_u64("UBTRFS_POSIX_CHECK_EVERY", CHECK_EVERY);
    let keep_going = std::env::var_os("UBTRFS_POSIX_KEEP_GOING").is_some();
    let queue = std::sync::Mutex::new(seeds.into_iter());
    let total = std::sync::Mutex::new(Stats::default());
    let failures = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..THREADS {
            s.spawn(|| loop {
                let Some(seed) = queue.lock().unwrap().next() else { break };
                if let Some((_, why)) = KNOWN_SEEDS.iter().find(|(s, _)| *s == seed) {
                    if std::env::var_os("UBTRFS_POSIX_KNOWN_SEEDS").is_none() {
                        eprintln!("seed {seed}: skipped, known engine bug {why} (UBTRFS_POSIX_KNOWN_SEEDS=1 runs it)");
                        continue;
                    }
                }
                let run = Run { seed, ops, check_every, avail, known: posix::KNOWN, keep_going, dir: scratch_dir() };
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run.run())) {
                    Ok(Ok(st)) => total.lock().unwrap().add(&st),
                    Ok(Err(m)) => failures.lock().unwrap().push(m),
                    Err(p) => failures
                        .lock()
                        .unwrap()
                        .push(format!("seed {seed}: panicked: {}", p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default())),
                }
            });
        }
    });
    let st = total.into_inner().unwrap();
    let failures = failures.into_inner().unwrap();
    assert!(failures.is_empty(), "{} seeds disagree:\n{}", failures.len(), failures.join("\n\n"));
    st
}

fn report(what: &str, st: &Stats, wall: std::time::Duration) {
    let rate = |d: std::time::Duration| st.ops as f64 / d.as_secs_f64().max(1e-9);
    eprintln!(
        "{what}: {} ops ({} failed as the kernel says, {} commits, {} reopens, {} tree checks) in {:.1}s wall; kernel {:.0} ops/s, ubtrfs {:.0} ops/s (time inside the operations)",
        st.ops,
        st.failed,
        st.commits,
        st.reopens,
        st.checks,
        wall.as_secs_f64(),
        rate(st.kernel),
        rate(st.ubtrfs)
    );
    for (k, n) in &st.skipped {
        eprintln!("{what}: skipped {n} ops: known disagreement {k}");
    }
    let mut errs: Vec<String> = st
        .by_errno
        .iter()
        .map(|((k, e), n)| format!("{k:?}:{}={n}", posix::errno_name(*e)))
        .collect();
    errs.sort();
    eprintln!("{what}: failures by op and errno: {}", errs.join(" "));
    let ok: Vec<String> = st.ok.iter().map(|(k, n)| format!("{k:?}={n}")).collect();
    eprintln!("{what}: successes by op: {}", ok.join(" "));
}

#[test]
fn posix_diff_ci() {
    if !common::kernel_available("posix_diff_ci") {
        return;
    }
    let t = Instant::now();
    let st = run_seeds((0..CI_SEEDS).collect(), CI_OPS, &available());
    report("posix_diff_ci", &st, t.elapsed());
    assert!(
        st.ops >= 100_000 - st.skipped.values().sum::<u64>(),
        "CI runs at least 100k operations"
    );
}

#[test]
#[ignore = "soak: UBTRFS_SOAK_SEEDS=A..B UBTRFS_SOAK_OPS=N (see the top of the file)"]
fn soak() {
    if !common::kernel_available("posix_diff soak") {
        return;
    }
    let spec = std::env::var("UBTRFS_SOAK_SEEDS").unwrap_or_else(|_| "1000..1100".into());
    let seeds: Vec<u64> = match spec.split_once("..") {
        Some((a, b)) => {
            (a.parse().expect("seed range start")..b.parse().expect("seed range end")).collect()
        }
        None => vec![spec.parse().expect("a seed")],
    };
    let ops = env_u64("UBTRFS_SOAK_OPS", 10_000);
    let t = Instant::now();
    let avail =
        if std::env::var_os("UBTRFS_SOAK_CHATTR").is_some() { with_chattr() } else { available() };
    let st = run_seeds(seeds, ops, &avail);
    report("soak", &st, t.elapsed());
}

/// The operations with `chattr +i`, `+a`, `-i` and `-a` among them: what the flags
/// refuse (writes, truncations, names added or removed, renames, links, attribute and
/// xattr changes) meets every other operation.
fn with_chattr() -> Vec<OpKind> {
    let mut v = available();
    v.push(OpKind::Chattr);
    v
}

/// Refusals never abort: the same runs with immutable and append-only inodes, whose
/// refusals (EPERM) come mixed with the generator's own (EEXIST, ENOENT, ENOTEMPTY,
/// ENAMETOOLONG, EISDIR, ENOTDIR, EMLINK...). Each one's errno is the kernel's, and
/// everything after it still agrees: a refusal that aborted would turn every later
/// change into EROFS, and the final trees (committed, reopened, btrfs check) differ.
#[test]
fn refusals_with_flags_diff_ci() {
    if !common::kernel_available("refusals_with_flags_diff_ci") {
        return;
    }
    let t = Instant::now();
    let st = run_seeds((500..516).collect(), 2000, &with_chattr());
    report("refusals_with_flags_diff_ci", &st, t.elapsed());
    let flag_refusals: u64 = st
        .by_errno
        .iter()
        .filter(|((k, e), _)| *e == libc::EPERM && *k != OpKind::Link && *k != OpKind::LinkMany)
        .map(|(_, n)| n)
        .sum();
    assert!(
        flag_refusals >= 200,
        "only {flag_refusals} EPERM refusals: the flags refused too little to test anything"
    );
    assert!(
        st.ok.get(&OpKind::Chattr).copied().unwrap_or(0) >= 200,
        "too few chattr calls succeeded: {:?}",
        st.ok.get(&OpKind::Chattr)
    );
}
