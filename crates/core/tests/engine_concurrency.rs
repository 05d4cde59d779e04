//! Threads over one engine against a model of what it must show.
//!
//! Writer threads create, overwrite, append to and unlink files in a few directories
//! and commit now and then; reader threads list directories, look names up and read
//! files at the same time. A change and its update of the model happen together under
//! the engine's exclusive side; a read compares what the live view shows with the model
//! under the shared side. So every read must see exactly the changes made so far,
//! committed or not (read-your-writes), and a directory listing must never show half a
//! change. The dirty-metadata limit is four blocks, so writeback happens in the middle
//! of transactions while readers run. Afterwards the image must pass `btrfs check` and,
//! with the kernel, mount with exactly the model's files.
//!
//! Seeded: each thread's operations follow `UBTRFS_ENGINE_SEED` (default 1) and its
//! index; the interleaving is the scheduler's. `UBTRFS_ENGINE_OPS` scales the run (the
//! CI run does about 24k operations).

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::inode::filesystem::{InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsRead;
use write_common::*;

const DIRS: usize = 4;
const READERS: usize = 4;
const WRITERS: usize = 2;

/// A directory's entries: name -> (inode, contents).
type Entries = BTreeMap<Vec<u8>, (InodeId, Vec<u8>)>;

/// What the engine must show: each directory and its entries.
struct Model {
    dirs: Vec<(InodeId, Entries)>,
    /// Changes made to each inode so far: a read outside the engine's lock
    /// (`Engine::read_file`) is compared only when none happened while it ran.
    versions: std::collections::HashMap<InodeId, u64>,
}

fn ops_scale() -> u64 {
    std::env::var("UBTRFS_ENGINE_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(1)
}

fn seed() -> u64 {
    std::env::var("UBTRFS_ENGINE_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(1)
}

fn writer_thread(
    engine: &Engine,
    model: &Mutex<Model>,
    rng: &mut Rng,
    t: usize,
    ops: u64,
    commits: &AtomicU64,
) {
    for i in 0..ops {
        let d = rng.below(DIRS as u64) as usize;
        let roll = rng.below(100);
        let name = format!("w{t}-{}", rng.below(40)).into_bytes();
        let len = rng.below(3) as usize * rng.range(1, 20_000) as usize;
        let data = rng.bytes(len);
        let off_pick = rng.next_u64();
        let commit_now = rng.chance(3);
        engine
            .write(|w| {
                let mut m = model.lock().unwrap();
                let Model { dirs, versions } = &mut *m;
                let (dir, entries) = &mut dirs[d];
                let dir = *dir;
                match (entries.get(&name).cloned(), roll) {
                    (None, _) => {
                        let ino =
                            w.create_file(dir.root, dir.ino, &name, &InodeAttrs::new(0o644))?;
                        w.write_file(dir.root, ino, 0, &data)?;
                        entries
                            .insert(name.clone(), (InodeId { root: dir.root, ino }, data.clone()));
                        *versions.entry(InodeId { root: dir.root, ino }).or_default() += 1;
                    }
                    (Some((id, _)), 0..25) => {
                        w.unlink(dir.root, dir.ino, &name)?;
                        entries.remove(&name);
                        *versions.entry(id).or_default() += 1;
                    }
                    (Some((id, mut cur)), 25..60) => {
                        w.write_file(id.root, id.ino, cur.len() as u64, &data)?;
                        *versions.entry(id).or_default() += 1;
                        cur.extend_from_slice(&data);
                        entries.insert(name.clone(), (id, cur));
                    }
                    (Some((id, mut cur)), _) => {
                        let off = off_pick % (cur.len() as u64 + 1);
                        w.write_file(id.root, id.ino, off, &data)?;
                        *versions.entry(id).or_default() += 1;
                        let end = off as usize + data.len();
                        if cur.len() < end {
                            cur.resize(end, 0);
                        }
                        cur[off as usize..end].copy_from_slice(&data);
                        entries.insert(name.clone(), (id, cur));
                    }
                }
                Ok(())
            })
            .unwrap_or_else(|e| panic!("writer {t} op {i} in dir {d}: {e}"));
        if commit_now {
            // Through the engine: the commit's I/O runs while the readers and the other
            // writer go on.
            engine.commit().unwrap_or_else(|e| panic!("writer {t} commit after op {i}: {e}"));
            commits.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Read a file with `Engine::read_file` (data read without the engine's lock) and
/// compare it with the model when the file did not change meanwhile. Returns the bytes
/// compared.
fn read_file_outside_the_lock(
    engine: &Engine,
    model: &Mutex<Model>,
    d: usize,
    pick: u64,
    t: usize,
    i: u64,
) -> Option<u64> {
    let (id, data, version) = {
        let m = model.lock().unwrap();
        let entries = &m.dirs[d].1;
        let (_, (id, data)) = entries.iter().nth((pick % entries.len().max(1) as u64) as usize)?;
        (*id, data.clone(), m.versions.get(id).copied())
    };
    // One byte more than the model holds: the read must stop at EOF.
    let mut buf = vec![0u8; data.len() + 1];
    let r = engine.read_file(id, 0, &mut buf);
    let m = model.lock().unwrap();
    if m.versions.get(&id).copied() != version {
        return None;
    }
    let n = r.unwrap_or_else(|e| panic!("reader {t} op {i}: read_file of {id:?}: {e}"));
    assert!(
        n == data.len() && buf[..n] == data[..],
        "reader {t} op {i}: read_file of {id:?}: {n} bytes, differ from the model's {}",
        data.len()
    );
    Some(n as u64)
}

fn reader_thread(
    engine: &Engine,
    model: &Mutex<Model>,
    rng: &mut Rng,
    t: usize,
    ops: u64,
) -> (u64, u64) {
    let mut bytes = 0;
    let mut outside = 0;
    for i in 0..ops {
        let d = rng.below(DIRS as u64) as usize;
        let what = rng.below(4);
        let pick = rng.next_u64();
        if what == 3 {
            if let Some(n) = read_file_outside_the_lock(engine, model, d, pick, t, i) {
                outside += 1;
                bytes += n;
            }
            continue;
        }
        engine
            .read(|live| {
                let m = model.lock().unwrap();
                let (dir, entries) = &m.dirs[d];
                match what {
                    0 => {
                        // The whole directory, as one consistent state.
                        let got: Vec<Vec<u8>> =
                            live.readdir(*dir)?.into_iter().map(|e| e.name).collect();
                        let want: Vec<Vec<u8>> = entries.keys().cloned().collect();
                        let mut got_sorted = got.clone();
                        got_sorted.sort();
                        assert_eq!(got_sorted, want, "reader {t} op {i}: listing of dir {d}");
                    }
                    _ if entries.is_empty() => {
                        assert!(
                            live.lookup(*dir, b"w0-none")?.is_none(),
                            "reader {t} op {i}: a name that was never made"
                        );
                    }
                    _ => {
                        let (name, (id, data)) = entries
                            .iter()
                            .nth((pick % entries.len() as u64) as usize)
                            .expect("non-empty");
                        let e = live.lookup(*dir, name)?.unwrap_or_else(|| {
                            panic!("reader {t} op {i}: {} missing", String::from_utf8_lossy(name))
                        });
                        assert_eq!(
                            e.target,
                            *id,
                            "reader {t} op {i}: {} names another inode",
                            String::from_utf8_lossy(name)
                        );
                        let v = live.load_inode(*id, Load { extents: true, ..Load::ITEM })?;
                        assert_eq!(
                            v.size(),
                            data.len() as u64,
                            "reader {t} op {i}: size of {}",
                            String::from_utf8_lossy(name)
                        );
                        let mut buf = vec![0u8; data.len()];
                        let n = live.read_at(&v, 0, &mut buf)?;
                        assert!(
                            n == data.len() && buf == *data,
                            "reader {t} op {i}: contents of {} differ",
                            String::from_utf8_lossy(name)
                        );
                        bytes += n as u64;
                    }
                }
                Ok(())
            })
            .unwrap_or_else(|e| panic!("reader {t} op {i}: {e}"));
    }
    (bytes, outside)
}

#[test]
fn readers_and_writers_share_one_engine() {
    let img = Scratch::fixture("blake2", "engine-concurrency");
    let mut w = img.writer();
    let limit = 4 * w.nodesize() as usize;
    w.set_dirty_metadata_limit(limit);
    let mut dirs = Vec::new();
    for d in 0..DIRS {
        let ino =
            w.mkdir(5, 256, format!("cc{d}").as_bytes(), &InodeAttrs::new(0o755)).expect("mkdir");
        dirs.push((InodeId { root: 5, ino }, BTreeMap::new()));
    }
    let engine = Engine::from_writer(w);
    let model = Mutex::new(Model { dirs, versions: Default::default() });
    let commits = AtomicU64::new(0);
    let scale = ops_scale();
    let (wops, rops) = (3000 * scale, 4500 * scale);
    let seed = seed();
    let (read_bytes, outside): (u64, u64) = std::thread::scope(|s| {
        for t in 0..WRITERS {
            let (engine, model, commits) = (&engine, &model, &commits);
            s.spawn(move || {
                writer_thread(
                    engine,
                    model,
                    &mut Rng::new(seed * 1000 + t as u64),
                    t,
                    wops,
                    commits,
                )
            });
        }
        let readers: Vec<_> = (0..READERS)
            .map(|t| {
                let (engine, model) = (&engine, &model);
                s.spawn(move || {
                    reader_thread(
                        engine,
                        model,
                        &mut Rng::new(seed * 1000 + 100 + t as u64),
                        t,
                        rops,
                    )
                })
            })
            .collect();
        readers
            .into_iter()
            .map(|h| h.join().expect("reader thread"))
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
    });
    engine.commit().expect("final commit");
    let mut w = engine.into_writer().expect("engine intact");
    let early = w.blocks_written_early();
    w.commit().expect("nothing left");
    drop(w);
    let model = model.into_inner().unwrap();
    let files: usize = model.dirs.iter().map(|(_, e)| e.len()).sum();
    eprintln!(
        "{} writer and {} reader ops, {} commits, {early} blocks written before their commit, {read_bytes} bytes read back ({outside} whole-file reads without the lock compared), {files} files at the end",
        WRITERS as u64 * wops,
        READERS as u64 * rops,
        commits.load(Ordering::Relaxed)
    );
    assert!(
        early > 0,
        "the dirty limit never wrote a block early: writeback under readers went untested"
    );
    assert!(commits.load(Ordering::Relaxed) > 0, "no commit happened while readers ran");
    assert!(outside > 100, "only {outside} reads without the lock could be compared");

    // A fresh open shows the committed state, which is the model.
    let fs = img.reader();
    for (d, (dir, entries)) in model.dirs.iter().enumerate() {
        let got: BTreeMap<Vec<u8>, InodeId> =
            fs.readdir(*dir).expect("readdir").into_iter().map(|e| (e.name, e.target)).collect();
        assert_eq!(got.len(), entries.len(), "dir {d} after reopen");
        for (name, (id, data)) in entries {
            assert_eq!(
                got.get(name),
                Some(id),
                "dir {d}: {} after reopen",
                String::from_utf8_lossy(name)
            );
            let v = fs.load_inode(*id, Load::ALL).expect("inode");
            let mut buf = vec![0u8; data.len()];
            fs.read_at(&v, 0, &mut buf).expect("read");
            assert!(
                buf == *data,
                "dir {d}: contents of {} after reopen",
                String::from_utf8_lossy(name)
            );
        }
    }
    drop(fs);
    if !common::kernel_available(
        "readers_and_writers_share_one_engine: btrfs check and kernel mount",
    ) {
        return;
    }
    assert_check(&img.path, "after the concurrent run");
    let mnt = Mount::new(&img.path, false);
    for (d, (_, entries)) in model.dirs.iter().enumerate() {
        let dir = mnt.path(&format!("cc{d}"));
        let mut names: Vec<Vec<u8>> = std::fs::read_dir(&dir)
            .expect("kernel readdir")
            .map(|e| e.expect("entry").file_name().into_encoded_bytes())
            .collect();
        names.sort();
        assert_eq!(names, entries.keys().cloned().collect::<Vec<_>>(), "kernel listing of cc{d}");
        for (name, (_, data)) in entries {
            let got = std::fs::read(dir.join(String::from_utf8_lossy(name).as_ref()))
                .expect("kernel read");
            assert!(
                got == *data,
                "kernel: contents of cc{d}/{} differ",
                String::from_utf8_lossy(name)
            );
        }
    }
    mnt.umount();
}

/// A file owned by one writer thread, as the model knows it. `seq` is odd while a
/// write is under way (a seqlock): a read outside the engine's lock is compared only
/// when it began and ended at the same even `seq`.
struct Owned {
    id: InodeId,
    data: Vec<u8>,
    seq: u64,
}

#[test]
fn direct_writes_share_one_engine() {
    const FILES_PER_WRITER: usize = 3;
    let img = Scratch::fixture("blake2", "engine-direct-writes");
    let mut w = img.writer();
    let limit = 4 * w.nodesize() as usize;
    w.set_dirty_metadata_limit(limit);
    let dir = w.mkdir(5, 256, b"direct", &InodeAttrs::new(0o755)).expect("mkdir");
    let side = w.mkdir(5, 256, b"side", &InodeAttrs::new(0o755)).expect("mkdir");
    let mut files = Vec::new();
    for i in 0..WRITERS * FILES_PER_WRITER {
        let ino = w
            .create_file(5, dir, format!("f{i}").as_bytes(), &InodeAttrs::new(0o644))
            .expect("create");
        files.push(Mutex::new(Owned { id: InodeId { root: 5, ino }, data: Vec::new(), seq: 0 }));
    }
    let engine = Engine::from_writer(w);
    let ss = 4096u64;
    let scale = ops_scale();
    let seed = seed();
    let compared = AtomicU64::new(0);
    std::thread::scope(|s| {
        for t in 0..WRITERS {
            let (engine, files) = (&engine, &files);
            s.spawn(move || {
                let mut rng = Rng::new(seed * 1000 + 500 + t as u64);
                for i in 0..400 * scale {
                    let f =
                        &files[t * FILES_PER_WRITER + rng.below(FILES_PER_WRITER as u64) as usize];
                    let (id, cur_len) = {
                        let mut o = f.lock().unwrap();
                        o.seq += 1;
                        (o.id, o.data.len() as u64)
                    };
                    // Whole sectors (written without the lock) or any bytes (old data needed).
                    let (off, len) = if rng.chance(60) {
                        (rng.below(cur_len / ss + 2) * ss, rng.range(1, 24) * ss)
                    } else {
                        (rng.below(cur_len + 1), rng.range(1, 100_000))
                    };
                    let data = rng.bytes(len as usize);
                    engine.write_file(id, off, &data).unwrap_or_else(|e| {
                        panic!("writer {t} op {i}: write_file {id:?} at {off} +{len}: {e}")
                    });
                    let mut o = f.lock().unwrap();
                    let end = (off + len) as usize;
                    if o.data.len() < end {
                        o.data.resize(end, 0);
                    }
                    o.data[off as usize..end].copy_from_slice(&data);
                    o.seq += 1;
                    drop(o);
                    if rng.chance(5) {
                        engine.commit().unwrap_or_else(|e| panic!("writer {t} commit: {e}"));
                    }
                }
            });
        }
        // Changes to other inodes in between: they must never wait for a data write.
        s.spawn(|| {
            let mut rng = Rng::new(seed * 1000 + 700);
            for i in 0..300 * scale {
                let name = format!("s{}", rng.below(30)).into_bytes();
                engine
                    .write(|w| match w.live().lookup(InodeId { root: 5, ino: side }, &name)? {
                        Some(_) => w.unlink(5, side, &name),
                        None => w.create_file(5, side, &name, &InodeAttrs::new(0o644)).map(drop),
                    })
                    .unwrap_or_else(|e| panic!("side op {i}: {e}"));
            }
        });
        for t in 0..2 {
            let (engine, files, compared) = (&engine, &files, &compared);
            s.spawn(move || {
                let mut rng = Rng::new(seed * 1000 + 800 + t);
                for i in 0..1500 * scale {
                    let f = &files[rng.below(files.len() as u64) as usize];
                    let (id, want, seq) = {
                        let o = f.lock().unwrap();
                        (o.id, o.data.clone(), o.seq)
                    };
                    if seq % 2 == 1 {
                        continue;
                    }
                    let mut buf = vec![0u8; want.len() + 1];
                    let r = engine.read_file(id, 0, &mut buf);
                    if f.lock().unwrap().seq != seq {
                        continue;
                    }
                    let n =
                        r.unwrap_or_else(|e| panic!("reader {t} op {i}: read_file {id:?}: {e}"));
                    assert!(
                        n == want.len() && buf[..n] == want[..],
                        "reader {t} op {i}: {id:?} reads {n} bytes other than the model's {}",
                        want.len()
                    );
                    compared.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    engine.commit().expect("final commit");
    // No reader is left: nothing may still be held for one.
    engine
        .write(|w| w.create_file(5, side, b"last", &InodeAttrs::new(0o644)).map(drop))
        .expect("last change");
    assert!(
        engine.write(|w| Ok(w.space_held_for_views())).unwrap().is_empty(),
        "space held for readers after they all ended"
    );
    engine.commit().expect("final commit");
    let compared = compared.load(Ordering::Relaxed);
    eprintln!("{} direct-write ops, {compared} reads compared", WRITERS as u64 * 400 * scale);
    assert!(compared > 50, "only {compared} reads could be compared");
    drop(engine);
    let fs = img.reader();
    for f in &files {
        let o = f.lock().unwrap();
        let v = fs.load_inode(o.id, Load::ALL).expect("inode");
        let mut buf = vec![0u8; o.data.len() + 1];
        let n = fs.read_at(&v, 0, &mut buf).expect("read");
        assert!(n == o.data.len() && buf[..n] == o.data[..], "{:?} after reopen", o.id);
    }
    drop(fs);
    if !common::kernel_available("direct_writes_share_one_engine: btrfs check and kernel mount") {
        return;
    }
    assert_check(&img.path, "after direct writes");
    let mnt = Mount::new(&img.path, false);
    for (i, f) in files.iter().enumerate() {
        let got = std::fs::read(mnt.path(&format!("direct/f{i}"))).expect("kernel read");
        assert!(got == f.lock().unwrap().data, "kernel: contents of direct/f{i} differ");
    }
    mnt.umount();
}
