//! btrfs-progs' corrupt images (`common::corpus_dir`: ../shared/corpus): each must open
//! and walk to a clean result, an error or a correct read, never a panic or a hang,
//! in seconds and bounded memory.
//!
//! Raw images (`*.raw.xz`) are decompressed with `xz`; metadata dumps (`*.img`,
//! `*.img.xz`, and those inside `*.tar.xz`) are restored with `btrfs-image -r`. The
//! results are cached under target/tmp/corpus. Each image is opened and walked in a
//! thread under `catch_unwind` with a deadline; peak memory is measured per image
//! (the kernel's per-process high-water mark, reset before each). For information,
//! `btrfs check --readonly` is run on each image too. The table is printed and written
//! to target/tmp/corpus-report.txt.
//!
//! Skips (with a message, even under CI=true) when the corpus is absent, since it
//! lives outside the repository.

mod common;
#[path = "../../../fuzz/src/walk.rs"]
mod walk;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use ubtrfs_core::inode::filesystem::Filesystem;
use ubtrfs_core::OpenOptions;

/// A hang: the case is abandoned and reported.
const DEADLINE: Duration = Duration::from_secs(20);
/// The most any image may take.
const SLOW: Duration = Duration::from_secs(10);
/// Peak resident memory any one image may need (cache 16 MiB, nodes up to 64 KiB,
/// decompression buffers up to 1 MiB; generous because other test threads count too).
const PEAK_RSS_LIMIT: u64 = 512 << 20;

fn work_dir() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("corpus");
    std::fs::create_dir_all(&d).expect("corpus work dir");
    d
}

fn have(tool: &str, arg: &str) -> bool {
    Command::new(tool).arg(arg).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok()
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("{cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Decompress `src` (an .xz file) to `out`, sparse, once.
fn unxz(src: &Path, out: &Path) -> Result<(), String> {
    if out.exists() {
        return Ok(());
    }
    let tmp_xz = out.with_extension(format!("part{}.xz", std::process::id()));
    std::fs::copy(src, &tmp_xz).map_err(|e| format!("copy {}: {e}", src.display()))?;
    // CI's copy of shared/ is read-only, and copies keep the mode.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp_xz, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| format!("chmod {}: {e}", tmp_xz.display()))?;
    // `xz -d` writes sparse files and strips the .xz suffix.
    run(Command::new("xz").arg("-d").arg("-f").arg("-T1").arg(&tmp_xz))?;
    std::fs::rename(tmp_xz.with_extension(""), out).map_err(|e| format!("rename: {e}"))
}

/// Restore a btrfs-image metadata dump `src` to a raw image `out`, once.
fn restore(src: &Path, out: &Path) -> Result<(), String> {
    if out.exists() {
        return Ok(());
    }
    let tmp = out.with_extension(format!("part{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    run(Command::new("btrfs-image").arg("-r").arg(src).arg(&tmp))?;
    std::fs::rename(&tmp, out).map_err(|e| format!("rename: {e}"))
}

/// True if `p` looks like a raw btrfs image (superblock magic at 64 KiB + 64).
fn is_raw(p: &Path) -> bool {
    use std::os::unix::fs::FileExt;
    let mut m = [0u8; 8];
    std::fs::File::open(p).and_then(|f| f.read_exact_at(&mut m, 65536 + 64)).is_ok()
        && &m == b"_BHRfS_M"
}

/// Every image of the corpus as (label, raw image or why it could not be made).
fn prepare(corpus: &Path) -> Vec<(String, Result<PathBuf, String>)> {
    let work = work_dir();
    let xz = have("xz", "--version");
    let image_tool = have("btrfs-image", "-h");
    let mut out = Vec::new();
    for sub in ["fuzz-images", "fsck-images"] {
        let mut names: Vec<String> = match std::fs::read_dir(corpus.join(sub)) {
            Ok(rd) => rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect(),
            Err(_) => continue,
        };
        names.sort();
        for n in names {
            let src = corpus.join(sub).join(&n);
            let label = format!("{sub}/{n}");
            let dst = work.join(format!("{sub}--{n}"));
            if let Some(stem) = n.strip_suffix(".raw.xz") {
                let r = if xz {
                    unxz(&src, &work.join(format!("{sub}--{stem}.raw")))
                        .map(|()| work.join(format!("{sub}--{stem}.raw")))
                } else {
                    Err("skipped: no xz".into())
                };
                out.push((label, r));
            } else if let Some(stem) = n.strip_suffix(".img.xz") {
                let dump = work.join(format!("{sub}--{stem}.img"));
                let raw = work.join(format!("{sub}--{stem}.img.raw"));
                let r = if !xz || !image_tool {
                    Err("skipped: needs xz and btrfs-image".to_string())
                } else {
                    unxz(&src, &dump).and_then(|()| restore(&dump, &raw)).map(|()| raw)
                };
                out.push((label, r));
            } else if n.ends_with(".img") {
                let raw = PathBuf::from(format!("{}.raw", dst.display()));
                let r = if image_tool {
                    restore(&src, &raw).map(|()| raw)
                } else {
                    Err("skipped: no btrfs-image".into())
                };
                out.push((label, r));
            } else if let Some(stem) = n.strip_suffix(".tar.xz") {
                let dir = work.join(format!("{sub}--{stem}.d"));
                if !dir.exists() {
                    let tmp = work.join(format!("{sub}--{stem}.part{}", std::process::id()));
                    let _ = std::fs::remove_dir_all(&tmp);
                    let r = std::fs::create_dir_all(&tmp)
                        .map_err(|e| e.to_string())
                        .and_then(|()| {
                            run(Command::new("tar").arg("-xJf").arg(&src).arg("-C").arg(&tmp))
                        })
                        .and_then(|()| std::fs::rename(&tmp, &dir).map_err(|e| e.to_string()));
                    if let Err(e) = r {
                        out.push((label, Err(e)));
                        continue;
                    }
                }
                let mut inner: Vec<PathBuf> = std::fs::read_dir(&dir)
                    .map(|rd| rd.filter_map(|e| Some(e.ok()?.path())).collect())
                    .unwrap_or_default();
                inner.sort();
                for p in inner.into_iter().filter(|p| !p.to_string_lossy().ends_with(".raw")) {
                    let l = format!(
                        "{label}:{}",
                        p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default()
                    );
                    if is_raw(&p) {
                        out.push((l, Ok(p)));
                    } else {
                        let raw = PathBuf::from(format!("{}.raw", p.display()));
                        out.push((
                            l,
                            if image_tool {
                                restore(&p, &raw).map(|()| raw)
                            } else {
                                Err("skipped: no btrfs-image".into())
                            },
                        ));
                    }
                }
            }
        }
    }
    out
}

#[derive(Debug)]
enum Outcome {
    Ok(walk::WalkSummary),
    Err(String),
    Panic(String),
    Hang,
}

/// Reset the process's peak-RSS counter (Linux: write 5 to clear_refs).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(l.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

fn open_and_walk(img: &Path) -> (Outcome, Duration) {
    let (tx, rx) = mpsc::channel();
    let p = img.to_path_buf();
    let start = Instant::now();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(move || -> ubtrfs_core::Result<walk::WalkSummary> {
            let mut opts = OpenOptions::new(p);
            opts.cache_bytes = 16 << 20;
            let fs = Filesystem::open(&opts)?;
            walk::walk_summary(&fs)
        });
        let _ = tx.send(r);
    });
    let o = match rx.recv_timeout(DEADLINE) {
        Ok(Ok(Ok(s))) => Outcome::Ok(s),
        Ok(Ok(Err(e))) => Outcome::Err(e.to_string()),
        Ok(Err(p)) => Outcome::Panic(
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default(),
        ),
        Err(_) => Outcome::Hang,
    };
    (o, start.elapsed())
}

/// `btrfs check --readonly`: "clean", "errors (rc N)", or why it did not run.
fn btrfs_check(img: &Path, available: bool) -> String {
    if !available {
        return "n/a".into();
    }
    let child = Command::new("btrfs")
        .args(["check", "--readonly"])
        .arg(img)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    let Ok(mut child) = child else { return "n/a".into() };
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return "clean".into(),
            Ok(Some(st)) => {
                return st
                    .code()
                    .map(|c| format!("errors (rc {c})"))
                    .unwrap_or_else(|| format!("crashed ({st})"))
            }
            Ok(None) if start.elapsed() > Duration::from_secs(60) => {
                let _ = child.kill();
                let _ = child.wait();
                return "timeout".into();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => return "n/a".into(),
        }
    }
}

fn short(s: &str, n: usize) -> String {
    let s = s.replace('\n', " ");
    if s.chars().count() <= n {
        s
    } else {
        format!("{}...", s.chars().take(n).collect::<String>())
    }
}

#[test]
fn corpus_images_never_panic_or_hang() {
    let Some(corpus) = common::corpus_dir() else {
        eprintln!("corpus_images_never_panic_or_hang: skipped: no btrfs-progs corpus ($UBTRFS_CORPUS, ../shared/corpus beside the checkout, /work/shared/corpus)");
        return;
    };
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { geteuid() } == 0;
    let check = root && have("btrfs", "--version");
    if !check {
        eprintln!("btrfs check column: not run (needs root and btrfs-progs)");
    }
    let images = prepare(&corpus);
    assert!(!images.is_empty(), "corpus at {} has no images", corpus.display());
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    let (mut n_ok, mut n_err, mut n_panic, mut n_hang, mut n_skip) = (0, 0, 0, 0, 0);
    for (label, img) in &images {
        let img = match img {
            Ok(p) => p,
            Err(why) => {
                n_skip += 1;
                rows.push(format!("{label:<100} | not run: {}", short(why, 160)));
                continue;
            }
        };
        reset_peak_rss();
        let (o, t) = open_and_walk(img);
        let rss = peak_rss().unwrap_or(0);
        let outcome = match &o {
            Outcome::Ok(s) => {
                n_ok += 1;
                format!(
                    "ok: {} entries, {} trees, {} items, {} data bytes",
                    s.entries(),
                    s.trees,
                    s.items,
                    s.data_bytes
                )
            }
            Outcome::Err(e) => {
                n_err += 1;
                format!("error: {}", short(e, 200))
            }
            Outcome::Panic(m) => {
                n_panic += 1;
                failures.push(format!("{label}: PANIC: {m}"));
                format!("PANIC: {}", short(m, 200))
            }
            Outcome::Hang => {
                n_hang += 1;
                failures.push(format!("{label}: HANG (no result in {DEADLINE:?})"));
                "HANG".to_string()
            }
        };
        if !matches!(o, Outcome::Hang) && t > SLOW {
            failures.push(format!("{label}: took {t:?}"));
        }
        if !matches!(o, Outcome::Hang) && rss > PEAK_RSS_LIMIT {
            failures.push(format!("{label}: peak RSS {} MiB", rss >> 20));
        }
        let chk = btrfs_check(img, check);
        rows.push(format!(
            "{label:<100} | {:>6} ms | {:>4} MiB | check: {chk:<14} | {outcome}",
            t.as_millis(),
            rss >> 20
        ));
    }
    let summary = format!(
        "{} images: {n_ok} ok, {n_err} error, {n_panic} panic, {n_hang} hang, {n_skip} not run",
        images.len()
    );
    let table = format!("{}\n{summary}\n", rows.join("\n"));
    println!("{table}");
    let report = Path::new(env!("CARGO_TARGET_TMPDIR")).join("corpus-report.txt");
    let _ = std::fs::write(&report, &table);
    eprintln!("{summary} (table in {})", report.display());
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

extern "C" {
    fn geteuid() -> u32;
}
