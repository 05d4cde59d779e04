//! `ubtrfs dedupe IMAGE PATH...`: find identical data under the paths and make it share
//! extents, as duperemove does on a kernel mount: whole files first, then blocks.
//!
//! Whole files:
//! Files are grouped by size (files smaller than a block are left alone: they are
//! inline or nearly), then the candidates of each size are hashed (XXH3-128 of the
//! contents: not a cryptographic hash, and it need not be one), and each group of equal hashes is deduplicated against its first file in
//! `MAX_DEDUPE_LEN` steps through `FsWriter::dedupe_range`, which compares the bytes
//! themselves before it shares anything, so a hash collision costs only time. Files that
//! already share every extent with the first are counted and skipped. A file the
//! kernel's rules refuse (one checksummed and one not, an immutable or append-only
//! one, a read-only subvolume) is counted as skipped, and the rest goes on.
//!
//! Blocks: the files not shared whole are hashed in aligned `DEDUPE_BLOCK` pieces
//! (duperemove's default block size); each piece whose hash another piece has (in any
//! file, or elsewhere in the same one) is deduplicated against the first of them, runs
//! of consecutive pieces matching consecutive pieces as one range. Pieces already
//! sharing their extent with the first are left.
//!
//! It runs on the engine (`Engine::dedupe_range`, which compares under both inodes'
//! locks and shares under the writer's), so the sizes are spread over worker threads,
//! one per CPU: the hashing and comparing reads run side by side, the sharing one at
//! a time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use ubtrfs_core::{
    Dedupe, Engine, ExtentKind, FileKind, FsRead, InodeId, Load, PosixKind, Result, MAX_DEDUPE_LEN,
};

/// What a dedupe run found and did, so far (the progress callback sees it grow).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DedupeStats {
    /// Regular files found under the paths.
    pub files: u64,
    /// Bytes of the files with a same-size partner, which are hashed.
    pub candidate_bytes: u64,
    /// Bytes hashed (or, for a size shared by two files only, compared) so far.
    pub hashed_bytes: u64,
    /// Groups of two or more files with equal contents.
    pub groups: u64,
    /// Files made to share a group's first file's extents, and their bytes.
    pub deduped_files: u64,
    pub deduped_bytes: u64,
    /// Files that already shared every extent with their group's first.
    pub already_shared: u64,
    /// Files the kernel's rules refused to share.
    pub refused: u64,
    /// The block pass: bytes hashed, ranges shared and their bytes.
    pub block_hashed_bytes: u64,
    pub block_ranges: u64,
    pub block_bytes: u64,
}

/// A piece of the block pass: (index into the files, piece number).
type Piece = (usize, u64);

/// The piece size of the block pass.
pub const DEDUPE_BLOCK: u64 = 128 << 10;

/// A progress callback.
pub struct Progress(pub std::sync::Arc<dyn Fn(&DedupeStats) + Send + Sync>);

/// The regular files at or under `id` (following into subvolumes), with their sizes.
fn collect<V: FsRead>(
    live: &V,
    id: InodeId,
    out: &mut Vec<(InodeId, u64)>,
    depth: u32,
) -> Result<()> {
    let v = live.load_inode(id, Load::ITEM)?;
    match v.kind() {
        FileKind::File => out.push((id, v.size())),
        FileKind::Dir if depth < 4096 => {
            for e in live.readdir(id)? {
                collect(live, e.target, out, depth + 1)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// The shared tally and its reporting.
struct Tally<'a> {
    stats: Mutex<DedupeStats>,
    progress: Option<&'a Progress>,
}

impl Tally<'_> {
    fn add(&self, f: impl FnOnce(&mut DedupeStats)) {
        let mut s = self.stats.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
        if let Some(p) = self.progress {
            (p.0)(&s);
        }
    }
}

/// XXH3-128 of file `id`'s `size` bytes, read through `buf`.
fn hash(e: &Engine, id: InodeId, size: u64, buf: &mut [u8], tally: &Tally<'_>) -> Result<u128> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut off = 0u64;
    while off < size {
        let n = e.read_file(id, off, buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        off += n as u64;
        tally.add(|s| s.hashed_bytes += n as u64);
    }
    Ok(h.digest128())
}

/// The disk extents of `id` (file offset, bytenr, extent offset, length).
fn layout(e: &Engine, id: InodeId) -> Result<Vec<(u64, u64, u64, u64)>> {
    let all = e.read(|l| l.file_extents(id, 0, u64::MAX))?;
    Ok(all
        .iter()
        .filter_map(|f| match f.kind {
            ExtentKind::Regular { disk_bytenr, offset, num_bytes, .. } if disk_bytenr != 0 => {
                Some((f.file_offset, disk_bytenr, offset, num_bytes))
            }
            _ => None,
        })
        .collect())
}

/// The files of one size: hash them if more than two, then share each group of equal
/// contents with its first file.
fn one_size(
    e: &Engine,
    size: u64,
    ids: Vec<InodeId>,
    buf: &mut [u8],
    tally: &Tally<'_>,
    whole: &Mutex<Vec<InodeId>>,
) -> Result<()> {
    // Two files of a size are compared directly (the dedupe reads both anyway); more
    // are hashed first, so each is read once before the comparisons.
    let groups: Vec<Vec<InodeId>> = if ids.len() == 2 {
        tally.add(|s| s.hashed_bytes += 2 * size);
        vec![ids]
    } else {
        let mut by_hash: BTreeMap<u128, Vec<InodeId>> = BTreeMap::new();
        for id in ids {
            let h = hash(e, id, size, buf, tally)?;
            by_hash.entry(h).or_default().push(id);
        }
        by_hash.into_values().filter(|g| g.len() > 1).collect()
    };
    for group in groups {
        let mut counted = false;
        let src = group[0];
        let src_layout = layout(e, src)?;
        for &dst in &group[1..] {
            if layout(e, dst)? == src_layout {
                tally.add(|s| {
                    s.groups += u64::from(!counted);
                    s.already_shared += 1;
                });
                counted = true;
                whole.lock().unwrap_or_else(|p| p.into_inner()).extend([src, dst]);
                continue;
            }
            let mut off = 0u64;
            let mut done = 0u64;
            let ok = loop {
                if off >= size {
                    break true;
                }
                match e.dedupe_range(src, off, (size - off).min(MAX_DEDUPE_LEN), dst, off) {
                    // An unhashed pair that differs from its first piece is no pair.
                    Ok(Dedupe::Differs) if off == 0 && group.len() == 2 => break true,
                    Ok(Dedupe::Same(0)) | Ok(Dedupe::Differs) => break false,
                    Ok(Dedupe::Same(n)) => {
                        off += n;
                        done += n;
                    }
                    Err(err)
                        if matches!(
                            err.posix_kind(),
                            Some(
                                PosixKind::Invalid | PosixKind::NotPermitted | PosixKind::ReadOnly
                            )
                        ) =>
                    {
                        break false
                    }
                    Err(err) => return Err(err),
                }
            };
            // (ok with nothing done: the unhashed pair that was no pair.)
            let pair = !(ok && done == 0);
            if ok && done == size {
                whole.lock().unwrap_or_else(|p| p.into_inner()).extend([src, dst]);
            }
            tally.add(|s| {
                s.deduped_bytes += done;
                if pair {
                    s.groups += u64::from(!counted);
                    if ok {
                        s.deduped_files += 1;
                    } else {
                        s.refused += 1;
                    }
                }
            });
            counted |= pair;
        }
    }
    Ok(())
}

/// Deduplicate the identical files at or under `paths` (absolute, from the default
/// subvolume) in the engine's running transaction, on `threads` worker threads (0:
/// one per CPU); the caller commits.
///
/// # Errors
/// A path that does not resolve; read and tree failures (which abort).
pub fn dedupe(
    e: &Engine,
    paths: &[&str],
    threads: usize,
    progress: Option<&Progress>,
) -> Result<DedupeStats> {
    let mut files = Vec::new();
    for p in paths {
        let p = crate::edit::absolute(p)?;
        let mut found = Vec::new();
        e.read(|l| {
            found.clear();
            let id = l.resolve_id(p, false)?;
            collect(l, id, &mut found, 0)
        })?;
        files.extend(found);
    }
    files.sort();
    files.dedup();
    let all = files.clone();
    let bs = u64::from(e.info().sectorsize);
    let mut by_size: BTreeMap<u64, Vec<InodeId>> = BTreeMap::new();
    let nfiles = files.len() as u64;
    for (id, size) in files {
        if size >= bs {
            by_size.entry(size).or_default().push(id);
        }
    }
    by_size.retain(|_, v| v.len() > 1);
    let candidate_bytes = by_size.iter().map(|(s, v)| s * v.len() as u64).sum();
    let tally = Tally {
        stats: Mutex::new(DedupeStats { files: nfiles, candidate_bytes, ..Default::default() }),
        progress,
    };
    let whole: Mutex<Vec<InodeId>> = Mutex::new(Vec::new());
    // Largest sizes first: the longest jobs start early and the threads end together.
    let jobs: Vec<(u64, Vec<InodeId>)> = by_size.into_iter().rev().collect();
    let next = AtomicUsize::new(0);
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    }
    .min(jobs.len().max(1));
    let first_err: Mutex<Option<ubtrfs_core::Error>> = Mutex::new(None);
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| {
                let mut buf = vec![0u8; 1 << 20];
                loop {
                    if first_err.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((size, ids)) = jobs.get(i) else { return };
                    if let Err(err) = one_size(e, *size, ids.clone(), &mut buf, &tally, &whole) {
                        first_err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(err);
                        return;
                    }
                }
            });
        }
    });
    if let Some(err) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(err);
    }
    let mut whole = whole.into_inner().unwrap_or_else(|p| p.into_inner());
    whole.sort();
    whole.dedup();
    let rest: Vec<(InodeId, u64)> = files_left(&all, &whole);
    blocks(e, &rest, threads, &tally)?;
    Ok(tally.stats.into_inner().unwrap_or_else(|p| p.into_inner()))
}

/// The files (and sizes) the whole-file pass did not share, of at least one piece.
fn files_left(all: &[(InodeId, u64)], whole: &[InodeId]) -> Vec<(InodeId, u64)> {
    all.iter()
        .filter(|(id, size)| *size >= DEDUPE_BLOCK && whole.binary_search(id).is_err())
        .copied()
        .collect()
}

/// The block pass (see the module): hash every piece of `files` on `threads` threads,
/// then share runs of pieces equal to earlier pieces, one file at a time.
fn blocks(e: &Engine, files: &[(InodeId, u64)], threads: usize, tally: &Tally<'_>) -> Result<()> {
    if files.is_empty() {
        return Ok(());
    }
    // (hash, file index, piece index) for every piece.
    let next = AtomicUsize::new(0);
    let hashed: Mutex<Vec<(u128, usize, u64)>> = Mutex::new(Vec::new());
    let first_err: Mutex<Option<ubtrfs_core::Error>> = Mutex::new(None);
    std::thread::scope(|sc| {
        for _ in 0..threads.min(files.len()).max(1) {
            sc.spawn(|| {
                let mut buf = vec![0u8; DEDUPE_BLOCK as usize];
                let mut mine = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(id, size)) = files.get(i) else { break };
                    for piece in 0..size / DEDUPE_BLOCK {
                        match e.read_file(id, piece * DEDUPE_BLOCK, &mut buf) {
                            Ok(n) if n == buf.len() => {
                                mine.push((xxhash_rust::xxh3::xxh3_128(&buf), i, piece))
                            }
                            Ok(_) => break,
                            Err(err) => {
                                first_err
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .get_or_insert(err);
                                return;
                            }
                        }
                        tally.add(|s| s.block_hashed_bytes += DEDUPE_BLOCK);
                    }
                }
                hashed.lock().unwrap_or_else(|p| p.into_inner()).extend(mine);
            });
        }
    });
    if let Some(err) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(err);
    }
    let mut hashed = hashed.into_inner().unwrap_or_else(|p| p.into_inner());
    // The first piece of each hash (lowest file, then piece) is the source of the rest.
    hashed.sort_unstable();
    let mut src_of: BTreeMap<Piece, Piece> = BTreeMap::new();
    for run in hashed.chunk_by(|a, b| a.0 == b.0) {
        let (_, fi, pi) = run[0];
        for &(_, f, p) in &run[1..] {
            src_of.insert((f, p), (fi, pi));
        }
    }
    // Consecutive pieces of a file matching consecutive pieces of one source: one range.
    let mut runs: Vec<(Piece, Piece, u64)> = Vec::new();
    for (&(f, p), &(sf, sp)) in &src_of {
        if let Some(last) = runs.last_mut() {
            let ((lf, lp), (lsf, lsp), n) = *last;
            if lf == f && lp + n == p && lsf == sf && lsp + n == sp {
                last.2 += 1;
                continue;
            }
        }
        runs.push(((f, p), (sf, sp), 1));
    }
    for ((f, p), (sf, sp), n) in runs {
        let (dst, src) = (files[f].0, files[sf].0);
        let (doff, soff) = (p * DEDUPE_BLOCK, sp * DEDUPE_BLOCK);
        let len = n * DEDUPE_BLOCK;
        // Overlapping ranges of one file cannot be deduplicated (the kernel's rule).
        if src == dst && soff < doff + len && doff < soff + len {
            continue;
        }
        if same_extents(e, src, soff, dst, doff, len)? {
            continue;
        }
        let mut done = 0u64;
        while done < len {
            match e.dedupe_range(
                src,
                soff + done,
                (len - done).min(MAX_DEDUPE_LEN),
                dst,
                doff + done,
            ) {
                Ok(Dedupe::Same(0)) | Ok(Dedupe::Differs) => break,
                Ok(Dedupe::Same(k)) => done += k,
                Err(err)
                    if matches!(
                        err.posix_kind(),
                        Some(PosixKind::Invalid | PosixKind::NotPermitted | PosixKind::ReadOnly)
                    ) =>
                {
                    break
                }
                Err(err) => return Err(err),
            }
        }
        if done > 0 {
            tally.add(|s| {
                s.block_ranges += 1;
                s.block_bytes += done;
            });
        }
    }
    Ok(())
}

/// Whether `len` bytes of `dst` at `doff` already sit on the same disk bytes as `src`
/// at `soff` (or both are holes).
fn same_extents(
    e: &Engine,
    src: InodeId,
    soff: u64,
    dst: InodeId,
    doff: u64,
    len: u64,
) -> Result<bool> {
    let map = |id: InodeId, off: u64| -> Result<Vec<(u64, u64, u64)>> {
        let all = e.read(|l| l.file_extents(id, off, off + len))?;
        Ok(all
            .iter()
            .filter_map(|x| match x.kind {
                ExtentKind::Regular { disk_bytenr, offset, num_bytes, .. } if disk_bytenr != 0 => {
                    // Clipped to the range, relative to its start.
                    let a = x.file_offset.max(off);
                    let z = (x.file_offset + num_bytes).min(off + len);
                    (a < z).then(|| (a - off, disk_bytenr, offset + (a - x.file_offset)))
                }
                _ => None,
            })
            .collect())
    };
    let (a, b) = (map(src, soff)?, map(dst, doff)?);
    Ok(a == b)
}
