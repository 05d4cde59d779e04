//! `ubtrfs dedupe IMAGE PATH...`: find regular files with identical contents under the
//! paths and make them share their extents, as duperemove does on a kernel mount (whole
//! files here: a file whose bytes equal another file's bytes shares all of them; parts
//! of files are not matched yet).
//!
//! Files are grouped by size (files smaller than a block are left alone: they are
//! inline or nearly), then the candidates of each size are hashed (XXH3-128 of the
//! contents: not a cryptographic hash, and it need not be one), and each group of equal hashes is deduplicated against its first file in
//! `MAX_DEDUPE_LEN` steps through `FsWriter::dedupe_range`, which compares the bytes
//! themselves before it shares anything, so a hash collision costs only time. Files that
//! already share every extent with the first are counted and skipped. A file the
//! kernel's rules refuse (one checksummed and one not, an immutable or append-only
//! one, a read-only subvolume) is counted as skipped, and the rest goes on.

use std::collections::BTreeMap;
use ubtrfs_core::error::{PosixKind, Result};
use ubtrfs_core::inode::filesystem::{ExtentKind, FileKind, FsRead, InodeId, Load};
use ubtrfs_core::inode::reflink::{Dedupe, MAX_DEDUPE_LEN};
use ubtrfs_core::transaction::FsWriter;

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
}

/// A progress callback.
pub struct Progress(pub std::sync::Arc<dyn Fn(&DedupeStats) + Send + Sync>);

/// The regular files at or under `id` (following into subvolumes), with their sizes.
fn collect(w: &FsWriter, id: InodeId, out: &mut Vec<(InodeId, u64)>, depth: u32) -> Result<()> {
    let live = w.live();
    let v = live.load_inode(id, Load::ITEM)?;
    match v.kind() {
        FileKind::File => out.push((id, v.size())),
        FileKind::Dir if depth < 4096 => {
            for e in live.readdir(id)? {
                collect(w, e.target, out, depth + 1)?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// XXH3-128 of file `id`'s `size` bytes, read through `buf`.
fn hash(w: &FsWriter, id: InodeId, size: u64, buf: &mut [u8], stats: &mut DedupeStats, progress: Option<&Progress>) -> Result<u128> {
    let live = w.live();
    let v = live.load_inode(id, Load { extents: true, ..Load::ITEM })?;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut off = 0u64;
    while off < size {
        let n = live.read_at(&v, off, buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        off += n as u64;
        stats.hashed_bytes += n as u64;
        if let Some(p) = progress {
            (p.0)(stats);
        }
    }
    Ok(h.digest128())
}

/// The disk extents of `id` (file offset, bytenr, extent offset, length).
fn layout(w: &FsWriter, id: InodeId) -> Result<Vec<(u64, u64, u64, u64)>> {
    Ok(w.live()
        .file_extents(id, 0, u64::MAX)?
        .iter()
        .filter_map(|f| match f.kind {
            ExtentKind::Regular { disk_bytenr, offset, num_bytes, .. } if disk_bytenr != 0 => Some((f.file_offset, disk_bytenr, offset, num_bytes)),
            _ => None,
        })
        .collect())
}

/// Deduplicate the identical files at or under `paths` (absolute, from the default
/// subvolume) in the writer's running transaction; the caller commits.
///
/// # Errors
/// A path that does not resolve; read and tree failures (which abort).
pub fn dedupe(w: &mut FsWriter, paths: &[&str], progress: Option<&Progress>) -> Result<DedupeStats> {
    let mut files = Vec::new();
    for p in paths {
        let id = w.live().resolve_id(crate::edit::absolute(p)?, false)?;
        collect(w, id, &mut files, 0)?;
    }
    files.sort();
    files.dedup();
    let bs = u64::from(w.sectorsize());
    let mut stats = DedupeStats { files: files.len() as u64, ..Default::default() };
    let mut by_size: BTreeMap<u64, Vec<InodeId>> = BTreeMap::new();
    for (id, size) in files {
        if size >= bs {
            by_size.entry(size).or_default().push(id);
        }
    }
    by_size.retain(|_, v| v.len() > 1);
    stats.candidate_bytes = by_size.iter().map(|(s, v)| s * v.len() as u64).sum();
    let mut buf = vec![0u8; 1 << 20];
    for (size, ids) in by_size {
        // Two files of a size are compared directly (the dedupe reads both anyway); more
        // are hashed first, so each is read once before the comparisons.
        let groups: Vec<Vec<InodeId>> = if ids.len() == 2 {
            stats.hashed_bytes += 2 * size;
            vec![ids]
        } else {
            let mut by_hash: BTreeMap<u128, Vec<InodeId>> = BTreeMap::new();
            for id in ids {
                let h = hash(w, id, size, &mut buf, &mut stats, progress)?;
                by_hash.entry(h).or_default().push(id);
            }
            by_hash.into_values().filter(|g| g.len() > 1).collect()
        };
        for group in groups {
            let mut counted = false;
            let src = group[0];
            let src_layout = layout(w, src)?;
            for &dst in &group[1..] {
                if layout(w, dst)? == src_layout {
                    if !counted {
                        stats.groups += 1;
                        counted = true;
                    }
                    stats.already_shared += 1;
                    continue;
                }
                let mut off = 0u64;
                let mut done = 0u64;
                let ok = loop {
                    if off >= size {
                        break true;
                    }
                    match w.dedupe_range(src, off, (size - off).min(MAX_DEDUPE_LEN), dst, off) {
                        // An unhashed pair that differs from its first piece is no pair.
                        Ok(Dedupe::Differs) if off == 0 && group.len() == 2 => break true,
                        Ok(Dedupe::Same(0)) | Ok(Dedupe::Differs) => break false,
                        Ok(Dedupe::Same(n)) => {
                            off += n;
                            done += n;
                        }
                        Err(e) if matches!(e.posix_kind(), Some(PosixKind::Invalid | PosixKind::NotPermitted | PosixKind::ReadOnly)) => break false,
                        Err(e) => return Err(e),
                    }
                };
                stats.deduped_bytes += done;
                if ok && done == 0 {
                    // The unhashed pair that was no pair.
                } else {
                    if !counted {
                        stats.groups += 1;
                        counted = true;
                    }
                    if ok {
                        stats.deduped_files += 1;
                    } else {
                        stats.refused += 1;
                    }
                }
                if let Some(p) = progress {
                    (p.0)(&stats);
                }
            }
        }
    }
    Ok(stats)
}
