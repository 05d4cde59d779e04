//! `mkfs`: a new filesystem on one device, made the way btrfs-progs' `make_btrfs`
//! makes it, and by the engine rather than by a second writer:
//!
//! 1. `bootstrap` writes a minimal filesystem whose trees are one leaf each, in a
//!    temporary SYSTEM chunk at 1 MiB;
//! 2. the engine opens it, takes the requested profiles, allocates the real SYSTEM,
//!    METADATA and DATA chunks (SYSTEM and DATA|METADATA with mixed block groups) and
//!    COWs every root leaf into them, and commits (the commit frees the bootstrap
//!    blocks);
//! 3. a second transaction removes the now empty temporary chunk
//!    (`ubtrfs_core::space::chunk_remove`) and commits.
//!
//! Then the result is opened again and checked by the checker (`crate::check`): a
//! filesystem mkfs made is clean or mkfs fails. Neighbours: `options` (what is asked
//! for and its validation), the cli's `mkfs` command (devices, signatures, cleanup).

pub mod bootstrap;
pub mod options;
pub mod shrink;
pub mod signature;

use std::path::Path;
use ubtrfs_core::error::{Error, PosixKind, Result};
use ubtrfs_core::space::{chunk_alloc, chunk_remove};
use ubtrfs_core::transaction::FsWriter;
use ubtrfs_core::volumes::device::{BlockDevice, FileDevice};
use ubtrfs_core::{FsInfo, OpenOptions};
use ubtrfs_format::structs::*;

pub use options::{Features, MkfsOptions};

/// Why mkfs failed, and whether it had begun writing to the device (then what was
/// on it is gone and the device does not hold a filesystem).
#[derive(Debug)]
pub struct MkfsFailure {
    pub error: Error,
    pub began_writing: bool,
}

impl std::fmt::Display for MkfsFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

fn before_writing(error: Error) -> MkfsFailure {
    MkfsFailure { error, began_writing: false }
}

fn after_writing(error: Error) -> MkfsFailure {
    MkfsFailure { error, began_writing: true }
}

/// After a failure part way, make sure no superblock of the half-made filesystem
/// remains for a mount or a tool to find: zero every mirror slot (best effort: the
/// device may be what failed, and the error that matters is the first one).
fn wipe_superblocks(path: &Path, size: u64) {
    use std::os::unix::fs::FileExt;
    let Ok(f) = std::fs::OpenOptions::new().write(true).open(path) else { return };
    let zeros = [0u8; SUPER_INFO_SIZE];
    for mirror in 0..SUPER_MIRROR_MAX {
        let off = sb_offset(mirror);
        if off + SUPER_INFO_SIZE as u64 > size {
            break;
        }
        let _ = f.write_all_at(&zeros, off);
    }
    let _ = f.sync_all();
}

/// What mkfs made.
#[derive(Clone, Debug)]
pub struct MkfsResult {
    pub fsid: [u8; 16],
    pub dev_uuid: [u8; 16],
    pub total_bytes: u64,
    /// The generation of the last commit.
    pub generation: u64,
}

/// Node cache for mkfs's writer: a handful of trees of one leaf each, until `--rootdir`
/// fills them (then the cache bounds the dirty tree blocks between commits too).
const MKFS_CACHE_BYTES: usize = 256 << 20;

/// Make a filesystem on the file or block device at `path`, of `size` bytes (the
/// caller sized it). Everything already on the device's first 5 MiB and in the
/// superblock slots is overwritten; the caller has looked for signatures.
///
/// # Errors
/// `Posix(Invalid)`/`Posix(NoSpace)` for options the device cannot take,
/// `Posix(Busy)` for a device in use (both before anything is written); `Io` from the
/// device; any engine error. The failure says whether writing had begun; then the
/// superblock slots are zeroed, so no half-made filesystem is found there. A made
/// filesystem that does not check clean is a bug (an assertion).
pub fn make_filesystem(path: &Path, size: u64, opts: &MkfsOptions) -> std::result::Result<MkfsResult, MkfsFailure> {
    make_filesystem_with(path, size, opts, |_| Ok(()))
}

/// As `make_filesystem`, with `fill` run on the new filesystem's writer once its
/// chunks are made and before the last commit (where `--rootdir` copies a tree in,
/// `populate::populate`); the check runs on the filled filesystem.
///
/// # Errors
/// As `make_filesystem`, and `fill`'s error (after writing began).
pub fn make_filesystem_with(path: &Path, size: u64, opts: &MkfsOptions, fill: impl FnOnce(&mut FsWriter) -> Result<()>) -> std::result::Result<MkfsResult, MkfsFailure> {
    let r = make_filesystem_inner(path, size, opts, fill);
    if let Err(f) = &r {
        if f.began_writing {
            wipe_superblocks(path, size);
        }
    }
    r
}

fn make_filesystem_inner(path: &Path, size: u64, opts: &MkfsOptions, fill: impl FnOnce(&mut FsWriter) -> Result<()>) -> std::result::Result<MkfsResult, MkfsFailure> {
    let name = path.display().to_string();
    opts.validate(&name, size, 1).map_err(before_writing)?;
    let uuids = &opts.sources.uuids;
    let l = bootstrap::Layout {
        nodesize: opts.nodesize,
        sectorsize: opts.sectorsize,
        csum: opts.csum,
        fsid: opts.fsid.unwrap_or_else(|| uuids.new_uuid()),
        chunk_tree_uuid: uuids.new_uuid(),
        dev_uuid: uuids.new_uuid(),
        fs_tree_uuid: uuids.new_uuid(),
        total_bytes: size / u64::from(opts.sectorsize) * u64::from(opts.sectorsize),
        label: opts.label.clone(),
        incompat: opts.features.incompat(),
        compat_ro: opts.features.compat_ro(),
        now: opts.sources.clock.now(),
    };
    {
        // Locked as every writer is: refused while the kernel has it mounted or another
        // program or ubtrfs process uses it, before a byte is written. The lock ends
        // before the engine's writer takes its own.
        let dev = FileDevice::open(path, true).map_err(before_writing)?;
        if dev.size() < size {
            return Err(before_writing(Error::posix_detail(PosixKind::NoSpace, name, format!("{} bytes, less than the {size} asked for", dev.size()))));
        }
        bootstrap::write(&dev, &l).map_err(after_writing)?;
    }
    let generation = (|| {
        let mut w = FsWriter::open(&OpenOptions { devices: vec![path.to_path_buf()], cache_bytes: MKFS_CACHE_BYTES, writable: true, sources: opts.sources.clone(), degraded: false })?;
        if opts.shrink {
            shrink::cap_chunks(&mut w)?;
        }
        populate_chunks(&mut w, opts)?;
        w.commit()?;
        if let Err(e) = fill(&mut w) {
            w.abort("mkfs: filling the new filesystem", &e);
            return Err(e);
        }
        if opts.shrink {
            w.commit()?;
            shrink::shrink_devices(&mut w)?;
        }
        let g = w.commit()?;
        Ok((g, w.info.super_copy().total_bytes.get()))
    })()
    .map_err(after_writing)?;
    let (generation, total_bytes) = generation;
    let report = FsInfo::open(&OpenOptions { devices: vec![path.to_path_buf()], cache_bytes: MKFS_CACHE_BYTES, writable: false, sources: opts.sources.clone(), degraded: false })
        .and_then(|fs| crate::check::check(&fs, &crate::check::CheckOptions::default()))
        .map_err(after_writing)?;
    if !report.is_clean() {
        let found: Vec<String> = report.findings.iter().map(|f| f.to_string()).collect();
        panic!("{name}: the filesystem mkfs made does not check clean: {}", found.join("; "));
    }
    Ok(MkfsResult { fsid: l.fsid, dev_uuid: l.dev_uuid, total_bytes, generation })
}

/// Steps 2 and 3 of the module docs, on the writer of the bootstrap filesystem.
///
/// # Errors
/// Engine errors (a failure after a change began aborts the writer).
pub fn populate_chunks(w: &mut FsWriter, opts: &MkfsOptions) -> Result<()> {
    let start = bootstrap::TEMP_CHUNK_START;
    w.set_alloc_profile(BLOCK_GROUP_DATA, opts.data_profile)?;
    w.set_alloc_profile(BLOCK_GROUP_METADATA, opts.metadata_profile)?;
    w.set_alloc_profile(BLOCK_GROUP_SYSTEM, opts.metadata_profile)?;
    // With mixed block groups one DATA|METADATA chunk serves both.
    let types: &[u64] = if opts.features.mixed { &[BLOCK_GROUP_SYSTEM, BLOCK_GROUP_METADATA] } else { &[BLOCK_GROUP_SYSTEM, BLOCK_GROUP_METADATA, BLOCK_GROUP_DATA] };
    {
        // No reservation: the metadata chunk this handle makes is where its blocks go.
        let mut h = w.start_transaction("mkfs: chunks", 0)?;
        let r = (|| {
            for &ty in types {
                chunk_alloc::alloc_chunk(&mut h, ty)?;
            }
            let moved = chunk_remove::relocate_root_leaves(&mut h, start)?;
            assert!(moved >= 9, "moved {moved} trees out of the bootstrap chunk, expected every tree");
            Ok(())
        })();
        h.end_with(r)?;
    }
    w.commit()?;
    let mut h = w.start_transaction("mkfs: remove the bootstrap chunk", 0)?;
    let r = chunk_remove::remove_chunk(&mut h, start);
    h.end_with(r)
}
