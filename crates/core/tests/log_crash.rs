//! fsync through the log tree, crashed at every flush point (`fault::FaultyDevice`).
//!
//! A seeded workload runs on the engine over a copy of a kernel-made fixture while the
//! device records every write and flush: a few files made and committed, then random
//! writes, appends, truncates (down and up), hole punches, xattr sets and removals,
//! unlinks, new files under the unlinked names, renames over other names and hard links
//! (a name a rename or link touches, and the other names of its inodes, are not checked
//! until their next durable point; a file's names share its state), each followed now
//! and then by an
//! fsync of that file (through the log tree, or a commit where the log cannot hold it)
//! or by a commit of everything. After every fsync and commit the model records the
//! state (contents and xattrs, or no file) that is now durable; an fsync that commits
//! instead leaves the other files' states unknown until their next durable point (it
//! writes back only its own file, as the kernel's does), and an unlink after a file's
//! last durable point lets it be gone (a later log sync carries the unlink). Then, for every flush point and superblock write of the run, the image a
//! power loss there leaves (`CrashSweep`: unflushed writes dropped or kept, one
//! possibly torn) is opened as a mount would open it (the log replayed) and every file
//! must show the state of its last durability point that completed before the crash,
//! or of the one in progress at the crash; ubtrfs's checker must find the replayed
//! filesystem clean. On a sample of points, as root, the kernel does the same: `btrfs
//! check --check-data-csum` of the image with its log is clean, and the kernel's mount
//! replays the log and shows each file in an allowed state.
//!
//! `concurrent_fsyncs_survive_a_crash_at_every_flush_point` does the same for threads
//! that rewrite and fsync their own files at once (log syncs shared between them),
//! with commits in between.
//!
//! `btrfs_206_without_no_holes_every_flush_point_checks_clean` sweeps btrfs/206's
//! operations (prealloc past the size, a punched hole, writes, a truncate up) on a
//! filesystem without NO_HOLES, with fsyncs and with commits.
//!
//! `UBTRFS_LOG_CRASH_SEEDS=N` runs seeds 0..N instead of the CI's three (`A..B`: seeds A
//! to B - 1).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use ubtrfs_core::data::falloc::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE};
use ubtrfs_core::inode::attr::SetAttr;
use ubtrfs_core::inode::filesystem::{FileKind, Filesystem, InodeId, Load};
use ubtrfs_core::inode::tree_log::with_log_replayed;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::volumes::device::{BlockDevice, MemDevice};
use ubtrfs_core::volumes::fault::{CrashSweep, FaultyDevice, OpKind, Rng};
use ubtrfs_core::{Engine, FileRead, FsInfo, FsRead, FsWriter, OpenOptions};
use ubtrfs_format::structs::{sb_offset, SUPER_INFO_SIZE, SUPER_MIRROR_MAX};

const FIXTURE: &str = "blake2";
const CACHE: usize = 16 << 20;

#[derive(Clone, Debug, PartialEq, Eq, Default)]
struct FileState {
    data: Vec<u8>,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

/// A point after which states are durable: ops `[start, end)` of the device did it.
struct Event {
    start: u64,
    end: u64,
    what: String,
    /// (file, its durable state: None when it has no name).
    states: Vec<(usize, Option<FileState>)>,
    /// Files whose durable state this event made unknown.
    unknown: Vec<usize>,
}

struct Run {
    files: usize,
    base: Vec<u8>,
    log: Vec<ubtrfs_core::volumes::fault::OpRecord>,
    events: Vec<Event>,
    /// (events completed before it, file): unlinks, which no event records.
    unlinks: Vec<(usize, usize)>,
    /// (events completed before it, file): new files under a name.
    creates: Vec<(usize, usize)>,
}

/// The state a new file may show when a log made its name durable and not its data
/// (a directory logged for another fsync logs the new files it names as existing,
/// empty, as the kernel's does): empty, with whatever xattrs.
fn new_and_empty() -> FileState {
    FileState { data: Vec::new(), xattrs: BTreeMap::from([(b"*".to_vec(), Vec::new())]) }
}

fn matches(allowed: &FileState, got: &FileState) -> bool {
    allowed == got || (*allowed == new_and_empty() && got.data.is_empty())
}

fn name(f: usize) -> Vec<u8> {
    format!("logf-{f}").into_bytes()
}

/// `lo..hi` random bytes.
fn bytes(rng: &mut Rng, lo: u64, hi: u64) -> Vec<u8> {
    let mut v = vec![0u8; rng.range(lo, hi) as usize];
    rng.fill(&mut v);
    v
}

/// The workload of `seed`, recorded.
fn record(seed: u64, ops: usize, files: usize) -> Run {
    let base = std::fs::read(&common::fixture_images(FIXTURE)[0]).expect("fixture image");
    let dev = Arc::new(FaultyDevice::new(base.clone(), "log-crash"));
    let info =
        FsInfo::open_devices(vec![dev.clone() as Arc<dyn BlockDevice>], CACHE).expect("open");
    let e = Engine::from_writer(FsWriter::from_info(info).expect("writer"));
    let top = InodeId { root: 5, ino: 256 };
    let mut rng = Rng::new(seed);
    let mut ids: Vec<Option<InodeId>> = Vec::new();
    let mut cur: Vec<Option<FileState>> = Vec::new();
    for f in 0..files {
        let id = e.create_file(top, &name(f), &InodeAttrs::new(0o100644), 0).expect("create");
        let d = bytes(&mut rng, 0, 300_000);
        e.buffered_write(id, 0, &d).expect("write");
        ids.push(Some(id));
        cur.push(Some(FileState { data: d, xattrs: BTreeMap::new() }));
    }
    let mut events = Vec::new();
    let mut unlinks = Vec::new();
    let mut creates = Vec::new();
    // Files made since their last fsync or commit.
    let mut fresh = vec![false; files];
    // Names a rename took an inode away from, with that inode: its next fsync makes
    // the name's absence durable (it logs every directory its names changed in).
    let mut renamed_from: BTreeMap<usize, InodeId> = BTreeMap::new();
    let s = dev.op_count();
    e.sync().expect("first commit");
    let all = |cur: &[Option<FileState>]| cur.iter().cloned().enumerate().collect::<Vec<_>>();
    events.push(Event {
        start: s,
        end: dev.op_count(),
        what: "commit 0".into(),
        states: all(&cur),
        unknown: Vec::new(),
    });
    let trace = std::env::var_os("UBTRFS_LOG_CRASH_TRACE").is_some();
    for step in 0..ops {
        let f = rng.below(files as u64) as usize;
        if rng.chance(1, 10) {
            dir_fsync_event(&e, &dev, &mut events, &cur, &fresh, top, step, trace);
            continue;
        }
        let op = rng.below(10);
        if trace {
            eprintln!("step {step}: file {f} op {op}");
        }
        let Some(id) = ids[f] else {
            // A new file under the name of one unlinked before.
            let id = e.create_file(top, &name(f), &InodeAttrs::new(0o100644), 0).expect("create");
            let d = bytes(&mut rng, 0, 100_000);
            e.buffered_write(id, 0, &d).expect("write");
            ids[f] = Some(id);
            renamed_from.remove(&f);
            creates.push((events.len(), f));
            fresh[f] = true;
            cur[f] = Some(FileState { data: d, xattrs: BTreeMap::new() });
            if trace {
                eprintln!("  create ino {}", id.ino);
            }
            if rng.chance(1, 2) {
                let what = format!("step {step}: fsync of new {f}");
                fsync_event(
                    &e,
                    &dev,
                    &mut events,
                    &cur,
                    &ids,
                    &mut fresh,
                    &mut renamed_from,
                    f,
                    what,
                    trace,
                );
            }
            continue;
        };
        let c = cur[f].as_mut().expect("a file with an id has a state");
        let size = c.data.len() as u64;
        match op {
            0 | 1 => {
                let off = rng.range(0, size + 8192);
                let d = bytes(&mut rng, 1, 40_000);
                e.buffered_write(id, off, &d).expect("pwrite");
                if trace {
                    eprintln!("  pwrite {off} +{}", d.len());
                }
                let end = off as usize + d.len();
                if c.data.len() < end {
                    c.data.resize(end, 0);
                }
                c.data[off as usize..end].copy_from_slice(&d);
            }
            2 => {
                let d = bytes(&mut rng, 1, 20_000);
                e.buffered_write(id, size, &d).expect("append");
                c.data.extend_from_slice(&d);
            }
            3 => {
                let n = if rng.chance(1, 2) {
                    rng.range(0, size + 1)
                } else {
                    size + rng.range(1, 50_000)
                };
                e.setattr(id, &SetAttr { size: Some(n), ..Default::default() }).expect("truncate");
                if trace {
                    eprintln!("  truncate {n}");
                }
                c.data.resize(n as usize, 0);
            }
            4 if size > 0 => {
                let off = rng.range(0, size);
                let len = rng.range(1, 64 * 1024);
                e.fallocate(id, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, len)
                    .expect("punch");
                if trace {
                    eprintln!("  punch {off} +{len}");
                }
                let end = (off + len).min(size) as usize;
                c.data[off as usize..end].fill(0);
            }
            8 => {
                // A rename over another name (or to a free one): both names, and the
                // other names of both inodes, are not checked until their next durable
                // point (a log that takes a committed inode's names takes its xattrs
                // too, as the kernel's LOG_INODE_EXISTS does, and not its data).
                let g = rng.below(files as u64) as usize;
                if g == f || ids[g] == Some(id) {
                    continue;
                }
                let unknown: Vec<usize> = (0..files)
                    .filter(|&h| {
                        h == g || ids[h] == Some(id) || (ids[g].is_some() && ids[h] == ids[g])
                    })
                    .collect();
                e.rename(top, &name(f), top, &name(g), 0).expect("rename");
                if trace {
                    eprintln!("  rename to {g}");
                }
                if ids[g].is_some() {
                    unlinks.push((events.len(), g));
                }
                cur[g] = cur[f].take();
                ids[g] = ids[f].take();
                fresh[g] = std::mem::take(&mut fresh[f]);
                renamed_from.insert(f, id);
                renamed_from.remove(&g);
                events.push(unchecked(&dev, format!("step {step}: rename of {f} to {g}"), unknown));
                continue;
            }
            9 => {
                // A new hard link under a free name: the inode's names are not checked
                // until their next durable point (as for a rename); they share its state
                // from now on.
                let Some(g) = (0..files).find(|&g| ids[g].is_none()) else { continue };
                let mut unknown: Vec<usize> = (0..files).filter(|&h| ids[h] == Some(id)).collect();
                unknown.push(g);
                e.link(id, top, &name(g)).expect("link");
                if trace {
                    eprintln!("  link as {g}");
                }
                cur[g] = cur[f].clone();
                ids[g] = Some(id);
                fresh[g] = fresh[f];
                renamed_from.remove(&g);
                events.push(unchecked(&dev, format!("step {step}: link of {f} as {g}"), unknown));
                continue;
            }
            7 => {
                e.unlink(top, &name(f)).expect("unlink");
                if trace {
                    eprintln!("  unlink");
                }
                unlinks.push((events.len(), f));
                ids[f] = None;
                cur[f] = None;
                continue;
            }
            _ => {
                let k = format!("user.k{}", rng.below(3)).into_bytes();
                if rng.chance(1, 3) && c.xattrs.contains_key(&k) {
                    e.removexattr(id, &k).expect("removexattr");
                    c.xattrs.remove(&k);
                } else {
                    let v = bytes(&mut rng, 1, 200);
                    e.setxattr(id, &k, &v, 0, false).expect("setxattr");
                    c.xattrs.insert(k, v);
                }
            }
        }
        // The file's other names show the same inode.
        for g in 0..files {
            if g != f && ids[g] == Some(id) {
                cur[g] = cur[f].clone();
            }
        }
        if rng.chance(1, 2) {
            let what = format!("step {step}: fsync of {f}");
            fsync_event(
                &e,
                &dev,
                &mut events,
                &cur,
                &ids,
                &mut fresh,
                &mut renamed_from,
                f,
                what,
                trace,
            );
        } else if rng.chance(1, 12) {
            let s = dev.op_count();
            e.sync().expect("commit");
            if trace {
                eprintln!("  commit");
            }
            fresh.fill(false);
            let what = format!("step {step}: commit");
            let (end, states) = (dev.op_count(), all(&cur));
            events.push(Event { start: s, end, what, states, unknown: Vec::new() });
        }
    }
    drop(e);
    Run { files, base, log: dev.log(), events, unlinks, creates }
}

/// The point, now, from which the names `unknown` are not checked until their next
/// durable point (a rename or a link touched them).
fn unchecked(dev: &FaultyDevice, what: String, unknown: Vec<usize>) -> Event {
    let at = dev.op_count();
    Event { start: at, end: at, what, states: Vec::new(), unknown }
}

/// fsync file `f` and record what it made durable: the file, or everything when the
/// fsync committed (the log could not hold it).
#[allow(clippy::too_many_arguments)]
fn fsync_event(
    e: &Engine,
    dev: &FaultyDevice,
    events: &mut Vec<Event>,
    cur: &[Option<FileState>],
    ids: &[Option<InodeId>],
    fresh: &mut [bool],
    renamed_from: &mut BTreeMap<usize, InodeId>,
    f: usize,
    what: String,
    trace: bool,
) {
    let id = ids[f].expect("an fsynced file has an inode");
    // Its inode is durable now, under every name it has: none is new any more.
    for (g, fr) in fresh.iter_mut().enumerate() {
        if ids[g] == Some(id) {
            *fr = false;
        }
    }
    let g0 = e.committed().expect("committed").info.super_copy().generation.get();
    let s = dev.op_count();
    let g1 = e.fsync(id).expect("fsync");
    if trace {
        eprintln!("  fsync -> {}", if g1 > g0 { "commit" } else { "log" });
    }
    // A commit instead of a log makes the file durable, and whatever else of the others
    // was written back by then: their states are not known until their next durable
    // point (a commit writes back no other file's dirty data, as the kernel's does not).
    // Every name of the inode is durable with it, and the absence of the names a
    // rename took it from.
    let mine: Vec<usize> = (0..cur.len()).filter(|&g| ids[g] == Some(id)).collect();
    let unknown =
        if g1 > g0 { (0..cur.len()).filter(|i| !mine.contains(i)).collect() } else { Vec::new() };
    let mut states: Vec<(usize, Option<FileState>)> =
        mine.iter().map(|&g| (g, cur[g].clone())).collect();
    renamed_from.retain(|&old, &mut was| {
        let now_gone = was == id && ids[old].is_none();
        if now_gone {
            states.push((old, None));
        }
        !now_gone
    });
    events.push(Event { start: s, end: dev.op_count(), what, states, unknown });
}

/// fsync the directory of the files and record what it made durable: its names (a
/// file unlinked has none; a file made since its last fsync exists, empty, as its
/// directory's log says) or, when it committed, every name and no file's contents.
#[allow(clippy::too_many_arguments)]
fn dir_fsync_event(
    e: &Engine,
    dev: &FaultyDevice,
    events: &mut Vec<Event>,
    cur: &[Option<FileState>],
    fresh: &[bool],
    top: InodeId,
    step: usize,
    trace: bool,
) {
    let g0 = e.committed().expect("committed").info.super_copy().generation.get();
    let s = dev.op_count();
    let g1 = e.fsync(top).expect("fsync of the directory");
    if trace {
        eprintln!(
            "step {step}: fsync of the directory -> {}",
            if g1 > g0 { "commit" } else { "log" }
        );
    }
    let mut states = Vec::new();
    let mut unknown = Vec::new();
    for (f, c) in cur.iter().enumerate() {
        match c {
            None => states.push((f, None)),
            Some(_) if g1 > g0 => unknown.push(f),
            Some(_) if fresh[f] => states.push((f, Some(new_and_empty()))),
            Some(_) => {}
        }
    }
    let what = format!("step {step}: fsync of the directory");
    events.push(Event { start: s, end: dev.op_count(), what, states, unknown });
}

/// The states each file may show after a crash before op `k`: its last durable state
/// completed before `k`, any in progress at `k`, and none if it was unlinked after that
/// durable state (the unlink may have reached the disk with a later log sync). None
/// before the first commit.
fn allowed(run: &Run, k: u64) -> Option<Vec<Vec<Option<FileState>>>> {
    let mut out = vec![Vec::new(); run.files];
    for (f, states) in out.iter_mut().enumerate() {
        // (index, event, Some(state), or None where the event made it unknown).
        let mine = || {
            run.events.iter().enumerate().filter_map(|(i, e)| {
                if let Some(s) = e.states.iter().find(|s| s.0 == f) {
                    Some((i, e, Some(&s.1)))
                } else if e.unknown.contains(&f) {
                    Some((i, e, None))
                } else {
                    None
                }
            })
        };
        let (last_i, _, last) = mine().rfind(|(_, e, _)| e.end <= k)?;
        let Some(last) = last else {
            // Unknown since a commit that was not its own: not checked.
            continue;
        };
        states.push(last.clone());
        for (_, _, s) in mine().filter(|(_, e, _)| e.start < k && k < e.end) {
            match s {
                Some(s) => states.push(s.clone()),
                None => {
                    states.clear();
                    break;
                }
            }
        }
        if !states.is_empty() && run.unlinks.iter().any(|&(after, uf)| uf == f && after > last_i) {
            states.push(None);
        }
        if !states.is_empty() && run.creates.iter().any(|&(after, cf)| cf == f && after > last_i) {
            states.push(Some(new_and_empty()));
        }
    }
    Some(out)
}

/// Each file's state in `fs`.
fn read_states(fs: &Filesystem, files: usize) -> Result<Vec<Option<FileState>>, String> {
    let top = fs.load_inode(fs.root_dir(), Load::ALL).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for f in 0..files {
        let Some(ent) = top.entries.iter().find(|en| en.name == name(f)) else {
            out.push(None);
            continue;
        };
        let v = fs.load_inode(ent.target, Load::ALL).map_err(|e| e.to_string())?;
        if v.kind() != FileKind::File {
            return Err(format!("file {f} is not a file"));
        }
        let mut data = vec![0u8; v.size() as usize];
        let mut at = 0;
        while at < data.len() {
            let n =
                fs.read_at(&v, at as u64, &mut data[at..]).map_err(|e| format!("file {f}: {e}"))?;
            if n == 0 {
                return Err(format!("file {f}: short read at {at} of {}", data.len()));
            }
            at += n;
        }
        let xattrs = v.xattrs.iter().map(|(k, val)| (k.clone(), val.clone())).collect();
        out.push(Some(FileState { data, xattrs }));
    }
    Ok(out)
}

fn describe(s: &Option<FileState>) -> String {
    let Some(s) = s else { return "no file".into() };
    format!(
        "{} bytes, xattrs {:?}",
        s.data.len(),
        s.xattrs.keys().map(|k| String::from_utf8_lossy(k).into_owned()).collect::<Vec<_>>()
    )
}

fn compare(
    got: &[Option<FileState>],
    allowed: &[Vec<Option<FileState>>],
    run: &Run,
    k: u64,
) -> Result<(), String> {
    for f in 0..run.files {
        // An empty set: the file's state is not known (see `allowed`).
        let ok = allowed[f].iter().any(|a| match (a, &got[f]) {
            (Some(a), Some(g)) => matches(a, g),
            (a, g) => a == g,
        });
        if !allowed[f].is_empty() && !ok {
            if std::env::var_os("UBTRFS_LOG_CRASH_TRACE").is_some() {
                for a in allowed[f].iter().flatten() {
                    let Some(g) = &got[f] else { continue };
                    let d: Vec<usize> = (0..a.data.len().min(g.data.len()))
                        .filter(|&i| a.data[i] != g.data[i])
                        .collect();
                    eprintln!(
                        "op {k} file {f}: differs from an allowed state at {:?}..{:?} ({} bytes)",
                        d.first(),
                        d.last(),
                        d.len()
                    );
                }
            }
            let around: Vec<&str> = run
                .events
                .iter()
                .filter(|e| e.start <= k + 50 && k <= e.end + 50)
                .map(|e| e.what.as_str())
                .collect();
            return Err(format!(
                "file {f}: {} is none of the allowed [{}] (events near: {around:?})",
                describe(&got[f]),
                allowed[f].iter().map(describe).collect::<Vec<_>>().join("; ")
            ));
        }
    }
    Ok(())
}

fn is_super_write(r: &ubtrfs_core::volumes::fault::OpRecord) -> bool {
    matches!(r.kind, OpKind::Write { offset, len }
        if len == SUPER_INFO_SIZE as u64 && (0..SUPER_MIRROR_MAX).any(|m| sb_offset(m) == offset))
}

fn check_point(
    img: Vec<u8>,
    run: &Run,
    k: u64,
    allowed: &[Vec<Option<FileState>>],
) -> Result<(), String> {
    let dev = Arc::new(MemDevice::new(img, "crash"));
    let info = FsInfo::open_devices(vec![dev as Arc<dyn BlockDevice>], CACHE)
        .map_err(|e| e.to_string())?;
    let info =
        with_log_replayed(info, &OpenOptions::new("crash")).map_err(|e| format!("replay: {e}"))?;
    let report =
        ubtrfs_tools::check::check(&info, &Default::default()).map_err(|e| e.to_string())?;
    if !report.is_clean() {
        return Err(format!(
            "ubtrfs check: {:?}",
            report.findings.iter().take(5).map(|f| f.to_string()).collect::<Vec<_>>()
        ));
    }
    let fs = Filesystem::from_info(info).map_err(|e| e.to_string())?;
    compare(&read_states(&fs, run.files)?, allowed, run, k)
}

/// The kernel on the crash image: its check of the image with the log, then its
/// The kernel on the crash image: its check of the image with the log, then its
/// mount, which replays the log.
fn kernel_point(
    img: &[u8],
    tag: &str,
    allowed: &[Vec<Option<FileState>>],
    run: &Run,
    k: u64,
) -> Result<(), String> {
    let got = common::kernel_check_and_mount(img, &format!("log-crash-{tag}"), |mnt| {
        let mut got = Vec::new();
        for f in 0..run.files {
            let p = mnt.join(String::from_utf8(name(f)).expect("ascii"));
            match std::fs::read(&p) {
                Ok(data) => got.push(Some(FileState { data, xattrs: common::xattrs_of(&p) })),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => got.push(None),
                Err(e) => return Err(format!("kernel: file {f}: {e}")),
            }
        }
        Ok(got)
    })??;
    compare(&got, allowed, run, k).map_err(|e| format!("kernel: {e}"))
}

fn sweep(seed: u64, ops: usize, files: usize, kernel_samples: usize) -> Vec<String> {
    sweep_run(record(seed, ops, files), seed, kernel_samples)
}

/// Check the image a power loss leaves at every flush point and superblock write of
/// `run` (the kernel on `kernel_samples` of them and the last).
fn sweep_run(run: Run, seed: u64, kernel_samples: usize) -> Vec<String> {
    let logged = run.events.iter().filter(|e| e.states.len() == 1 && e.unknown.is_empty()).count();
    eprintln!(
        "seed {seed}: {} ops on the device, {} durability points ({logged} logged fsyncs)",
        run.log.len(),
        run.events.len()
    );
    assert!(logged > 0, "seed {seed}: no fsync went through the log");
    let n = run.log.len() as u64;
    let points: Vec<u64> = (1..=n)
        .filter(|&k| {
            k == n
                || run.log[k as usize - 1].kind == OpKind::Flush
                || is_super_write(&run.log[k as usize - 1])
                || is_super_write(&run.log[k as usize])
        })
        .collect();
    let kernel = common::kernel_available("log_crash (kernel replay of crash images)");
    let mut rng = Rng::new(seed ^ 0x5eed);
    let mut sample: Vec<u64> =
        points.iter().copied().filter(|_| rng.chance(1, 8)).take(kernel_samples).collect();
    sample.push(n);
    let mut sweep = CrashSweep::new(run.base.clone(), run.log.clone(), 4096);
    let mut fails = Vec::new();
    let mut img = Vec::new();
    let mut tested = 0;
    for &k in &points {
        let Some(allowed) = allowed(&run, k) else { continue };
        let loss = sweep.image_at(k, seed ^ k, &mut img);
        tested += 1;
        if kernel && sample.contains(&k) {
            if let Err(e) = kernel_point(&img, &format!("{seed}-{k}"), &allowed, &run, k) {
                fails.push(format!("seed {seed} op {k}: {e}"));
            }
        }
        let keep = std::env::var_os("UBTRFS_LOG_CRASH_KEEP").map(|_| img.clone());
        let r = check_point(std::mem::take(&mut img), &run, k, &allowed);
        // `UBTRFS_LOG_CRASH_KEEP=all` keeps every point's image, else the failing ones.
        let all = std::env::var_os("UBTRFS_LOG_CRASH_KEEP").is_some_and(|v| v == "all");
        if let Some(i) = keep.filter(|_| all || r.is_err()) {
            let p = std::env::temp_dir().join(format!("ubtrfs-log-crash-{seed}-{k}.img"));
            std::fs::write(&p, i).expect("keep the image");
            eprintln!("kept {}", p.display());
        }
        if let Err(e) = r {
            fails.push(format!("seed {seed} op {k} ({loss:?}): {e}"));
        }
    }
    eprintln!("seed {seed}: {tested} crash points checked, {} failures", fails.len());
    fails
}

#[test]
fn fsync_log_survives_a_crash_at_every_flush_point() {
    let seeds: Vec<u64> = match std::env::var("UBTRFS_LOG_CRASH_SEEDS") {
        Ok(v) => match v.split_once("..") {
            Some((a, b)) => (a.parse().expect("seed")..b.parse().expect("seed")).collect(),
            None => (0..v.parse::<u64>().expect("UBTRFS_LOG_CRASH_SEEDS=N")).collect(),
        },
        // Seed 23: a logged file's stale name came back at replay (a rename took the
        // name, an unlink the new one).
        Err(_) => vec![1, 2, 23],
    };
    let mut fails = Vec::new();
    for s in seeds {
        fails.extend(sweep(s, 40, 4, 3));
    }
    // A bigger log: more files and operations, so log trees of several leaves and a
    // node, cut and reused across syncs.
    if std::env::var_os("UBTRFS_LOG_CRASH_SEEDS")
        .is_none_or(|v| !v.to_string_lossy().contains(".."))
    {
        fails.extend(sweep(100, 150, 24, 2));
    }
    assert!(
        fails.is_empty(),
        "{} failures:\n{}",
        fails.len(),
        fails.iter().take(10).cloned().collect::<Vec<_>>().join("\n")
    );
}

/// Version `v` of file `t` of the concurrent run: longer than every earlier version
/// (each is written over the last from offset 0), its bytes its own.
fn version(t: usize, v: usize) -> Vec<u8> {
    let mut rng = Rng::new((t as u64) << 32 | v as u64);
    let mut d = vec![0u8; 2000 + 3000 * v];
    rng.fill(&mut d);
    d
}

/// What the concurrent run did, in order, with the device's operation count at each.
enum ConcurrentEvent {
    /// File `t` is about to get version `v` (no operation before `ops` has it).
    Write {
        t: usize,
        v: usize,
        ops: u64,
    },
    /// The fsync of file `t` at version `v` returned (operations `0..ops` made it
    /// durable).
    Fsynced {
        t: usize,
        v: usize,
        ops: u64,
    },
    /// A commit (`Engine::sync`) started, and ended.
    SyncStart,
    SyncEnd {
        ops: u64,
    },
}

/// Concurrent fsyncs, crashed at every flush point: threads each rewrite and fsync
/// their own file while another commits now and then, so log syncs carry other
/// threads' loggings (`Engine::fsync`'s batching) and logs cross transactions. After a
/// power loss at each flush point or superblock write, ubtrfs's replay shows each file
/// at a version no older than its last fsync that returned before the crash (or that
/// a commit that ended before it carried) and no newer than the last one written
/// before the crash, whole; a sample of points is checked clean by ubtrfs's checker,
/// and by the kernel's check and mount.
#[test]
fn concurrent_fsyncs_survive_a_crash_at_every_flush_point() {
    const THREADS: usize = 4;
    const VERSIONS: usize = 8;
    let base = std::fs::read(&common::fixture_images(FIXTURE)[0]).expect("fixture image");
    let dev = Arc::new(FaultyDevice::new(base.clone(), "log-concurrent"));
    let info =
        FsInfo::open_devices(vec![dev.clone() as Arc<dyn BlockDevice>], CACHE).expect("open");
    let e = Engine::from_writer(FsWriter::from_info(info).expect("writer"));
    let top = InodeId { root: 5, ino: 256 };
    let ids: Vec<InodeId> = (0..THREADS)
        .map(|t| {
            let id = e.create_file(top, &name(t), &InodeAttrs::new(0o100644), 0).expect("create");
            e.buffered_write(id, 0, &version(t, 0)).expect("write");
            id
        })
        .collect();
    e.sync().expect("first commit");
    let first = dev.op_count();
    // Flushes take time, as a disk's do: fsyncs that log while a sync flushes share
    // the next one.
    dev.set_flush_time(std::time::Duration::from_millis(2));
    let events = std::sync::Mutex::new(Vec::new());
    let note = |ev: fn(u64) -> ConcurrentEvent| {
        let mut l = events.lock().unwrap();
        l.push(ev(dev.op_count()));
    };
    let before = e.log_stats();
    std::thread::scope(|sc| {
        for (t, &id) in ids.iter().enumerate() {
            let (e, dev, events) = (&e, &dev, &events);
            sc.spawn(move || {
                for v in 1..=VERSIONS {
                    events.lock().unwrap().push(ConcurrentEvent::Write {
                        t,
                        v,
                        ops: dev.op_count(),
                    });
                    e.buffered_write(id, 0, &version(t, v)).expect("write");
                    e.fsync(id).expect("fsync");
                    events.lock().unwrap().push(ConcurrentEvent::Fsynced {
                        t,
                        v,
                        ops: dev.op_count(),
                    });
                }
            });
        }
        sc.spawn(|| {
            for _ in 0..2 {
                std::thread::sleep(std::time::Duration::from_millis(30));
                note(|_| ConcurrentEvent::SyncStart);
                e.sync().expect("commit");
                note(|ops| ConcurrentEvent::SyncEnd { ops });
            }
        });
    });
    let st = e.log_stats();
    eprintln!("concurrent run: {:?} (before: {before:?})", st);
    assert!(st.syncs > before.syncs, "no fsync went through the log");
    assert!(
        st.syncs - before.syncs < st.fsyncs - before.fsyncs,
        "no log sync carried two fsyncs: {st:?}"
    );
    let events = events.into_inner().unwrap();
    let log = dev.log();
    drop(e);
    // For crash point k (operations 0..k done): per file, the oldest and newest
    // versions allowed.
    let bounds = |k: u64| -> Vec<(usize, usize)> {
        let mut lo = vec![0usize; THREADS];
        let mut hi = vec![0usize; THREADS];
        // Versions whose write began before a commit started, per file.
        let mut written = vec![0usize; THREADS];
        let mut sync_written: Option<Vec<usize>> = None;
        for ev in &events {
            match *ev {
                ConcurrentEvent::Write { t, v, ops } => {
                    if ops < k {
                        hi[t] = hi[t].max(v);
                    }
                    written[t] = v;
                }
                ConcurrentEvent::Fsynced { t, v, ops } if ops <= k => lo[t] = lo[t].max(v),
                ConcurrentEvent::SyncStart => {
                    // A write in progress at the start may or may not be in it: only
                    // the ones before count (the thread's own fsync follows).
                    sync_written = Some(written.clone());
                }
                ConcurrentEvent::SyncEnd { ops } if ops <= k => {
                    if let Some(w) = sync_written.take() {
                        for t in 0..THREADS {
                            lo[t] = lo[t].max(w[t].saturating_sub(1));
                        }
                    }
                }
                _ => {}
            }
        }
        lo.into_iter().zip(hi).collect()
    };
    let n = log.len() as u64;
    let points: Vec<u64> = (first..=n)
        .filter(|&k| {
            k == n
                || log[k as usize - 1].kind == OpKind::Flush
                || is_super_write(&log[k as usize - 1])
                || is_super_write(&log[k as usize])
        })
        .collect();
    let kernel = common::kernel_available("log_crash (kernel replay of concurrent fsyncs)");
    let mut sweep = CrashSweep::new(base, log, 4096);
    let mut fails = Vec::new();
    let mut img = Vec::new();
    for (i, &k) in points.iter().enumerate() {
        let b = bounds(k);
        let loss = sweep.image_at(k, k, &mut img);
        let sampled = i % 8 == 0 || k == n;
        let r = (|| -> Result<(), String> {
            let dev = Arc::new(MemDevice::new(img.clone(), "crash"));
            let info = FsInfo::open_devices(vec![dev as Arc<dyn BlockDevice>], CACHE)
                .map_err(|e| e.to_string())?;
            let info = with_log_replayed(info, &OpenOptions::new("crash"))
                .map_err(|e| format!("replay: {e}"))?;
            if sampled {
                let report = ubtrfs_tools::check::check(&info, &Default::default())
                    .map_err(|e| e.to_string())?;
                if !report.is_clean() {
                    return Err(format!("ubtrfs check: {:?}", report.findings));
                }
            }
            let fs = Filesystem::from_info(info).map_err(|e| e.to_string())?;
            let got = read_states(&fs, THREADS)?;
            for (t, (lo, hi)) in b.iter().enumerate() {
                let Some(g) = &got[t] else { return Err(format!("file {t} is gone")) };
                if !(*lo..=*hi).any(|v| g.data == version(t, v)) {
                    let which = (0..=VERSIONS).find(|&v| g.data == version(t, v));
                    return Err(format!(
                        "file {t}: {} bytes (version {which:?}), want a version in {lo}..={hi}",
                        g.data.len()
                    ));
                }
            }
            Ok(())
        })();
        if let Err(e) = r {
            fails.push(format!("op {k} ({loss:?}): {e}"));
        }
        if kernel && (i % 16 == 0 || k == n) {
            if let Err(e) = kernel_versions(&img, k, &b) {
                fails.push(format!("op {k}, kernel: {e}"));
            }
        }
    }
    eprintln!("concurrent fsyncs: {} crash points checked, {} failures", points.len(), fails.len());
    assert!(fails.is_empty(), "{} failures:\n{}", fails.len(), fails.join("\n"));
}

/// The kernel on a crash image of the concurrent run: its check, then its mount
/// (which replays the log) shows each file at an allowed version.
fn kernel_versions(img: &[u8], k: u64, bounds: &[(usize, usize)]) -> Result<(), String> {
    common::kernel_check_and_mount(img, &format!("log-conc-{k}"), |mnt| {
        for (t, (lo, hi)) in bounds.iter().enumerate() {
            let got = std::fs::read(mnt.join(String::from_utf8_lossy(&name(t)).as_ref()));
            let ok = got.as_ref().is_ok_and(|g| (*lo..=*hi).any(|v| *g == version(t, v)));
            if !ok {
                return Err(format!(
                    "file {t}: {:?} bytes, want a version in {lo}..={hi}",
                    got.map(|g| g.len()).ok()
                ));
            }
        }
        Ok(())
    })?
}

/// btrfs/206 on a filesystem without NO_HOLES (made by ubtrfs's mkfs), where every
/// hole needs its own file extent item and the size must not reach past a gap in
/// them: a file given a preallocated range past its size, a hole punched in it, two
/// writes at its start and a truncate up, with an fsync (through the log) after each
/// operation, then the same with a commit after each; a power loss at every flush
/// point leaves an image that both checkers find clean, and the file in its last
/// durable state or the one in progress.
#[test]
fn btrfs_206_without_no_holes_every_flush_point_checks_clean() {
    use ubtrfs_tools::mkfs::{make_filesystem, Features, MkfsOptions};
    let dir = std::env::temp_dir().join(format!("ubtrfs-btrfs206-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("img");
    let size = 256u64 << 20;
    std::fs::File::create(&path).and_then(|f| f.set_len(size)).expect("image file");
    let opts = MkfsOptions {
        features: Features { no_holes: false, ..Default::default() },
        ..Default::default()
    };
    make_filesystem(&path, size, &opts).map_err(|f| f.to_string()).expect("mkfs ^no-holes");
    let base = std::fs::read(&path).expect("image");
    let _ = std::fs::remove_dir_all(&dir);
    let mut fails = Vec::new();
    for by_commit in [false, true] {
        let dev = Arc::new(FaultyDevice::new(base.clone(), "btrfs-206"));
        let info =
            FsInfo::open_devices(vec![dev.clone() as Arc<dyn BlockDevice>], CACHE).expect("open");
        let incompat = info.super_copy().incompat_flags.get();
        assert_eq!(incompat & ubtrfs_format::features::INCOMPAT_NO_HOLES, 0, "NO_HOLES");
        let e = Engine::from_writer(FsWriter::from_info(info).expect("writer"));
        let top = InodeId { root: 5, ino: 256 };
        let id = e.create_file(top, &name(0), &InodeAttrs::new(0o100644), 0).expect("create");
        let mut events = Vec::new();
        let s0 = dev.op_count();
        e.sync().expect("commit");
        let mut cur = FileState::default();
        let what = "the empty file committed".to_string();
        let states = vec![(0, Some(cur.clone()))];
        events.push(Event { start: s0, end: dev.op_count(), what, states, unknown: Vec::new() });
        let keep = FALLOC_FL_KEEP_SIZE;
        for step in 0..5 {
            let what = match step {
                0 => {
                    e.fallocate(id, keep, 4096, 8192).expect("falloc -k 4k 8k");
                    "falloc -k 4k 8k"
                }
                1 => {
                    e.fallocate(id, FALLOC_FL_PUNCH_HOLE | keep, 4096, 4096).expect("fpunch");
                    "fpunch 4k 4k"
                }
                2 => {
                    e.buffered_write(id, 0, &[0xaa; 4096]).expect("pwrite 0 4k");
                    cur.data = vec![0xaa; 4096];
                    "pwrite 0 4k"
                }
                3 => {
                    e.buffered_write(id, 0, &[0xbb; 8192]).expect("pwrite 0 8k");
                    cur.data = vec![0xbb; 8192];
                    "pwrite 0 8k"
                }
                _ => {
                    e.setattr(id, &SetAttr { size: Some(12288), ..Default::default() })
                        .expect("truncate 12k");
                    cur.data.resize(12288, 0);
                    "truncate 12k"
                }
            };
            let s = dev.op_count();
            if by_commit {
                e.sync().expect("commit");
            } else {
                e.fsync(id).expect("fsync");
            }
            let states = vec![(0, Some(cur.clone()))];
            let what = format!("{what}, then {}", if by_commit { "a commit" } else { "fsync" });
            events.push(Event { start: s, end: dev.op_count(), what, states, unknown: Vec::new() });
        }
        if !by_commit {
            assert!(e.log_stats().syncs > 0, "no fsync went through the log");
        }
        drop(e);
        let run = Run {
            files: 1,
            base: base.clone(),
            log: dev.log(),
            events,
            unlinks: Vec::new(),
            creates: Vec::new(),
        };
        fails.extend(sweep_run(run, u64::from(by_commit), 4));
    }
    assert!(fails.is_empty(), "{} failures:\n{}", fails.len(), fails.join("\n"));
}
