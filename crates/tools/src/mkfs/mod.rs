//! `mkfs`: a new filesystem on one device, made the way btrfs-progs' `make_btrfs`
//! makes it, and by the engine rather than by a second writer:
//!
//! 1. `bootstrap` writes a minimal filesystem whose trees are one leaf each, in a
//!    temporary SYSTEM chunk at 1 MiB;
//! 2. the engine opens it, takes the requested profiles, allocates the real SYSTEM,
//!    METADATA and DATA chunks and COWs every root leaf into them, and commits (the
//!    commit frees the bootstrap blocks);
//! 3. a second transaction removes the now empty temporary chunk
//!    (`ubtrfs_core::space::chunk_remove`) and commits.
//!
//! Then the result is opened again and checked by the checker (`crate::check`): a
//! filesystem mkfs made is clean or mkfs fails. Neighbours: `options` (what is asked
//! for and its validation), the cli's `mkfs` command (devices, signatures, cleanup).

pub mod bootstrap;
pub mod options;
pub mod signature;

use std::path::Path;
use ubtrfs_core::error::{Error, Result};
use ubtrfs_core::space::{chunk_alloc, chunk_remove};
use ubtrfs_core::transaction::FsWriter;
use ubtrfs_core::{FsInfo, OpenOptions};
use ubtrfs_format::structs::*;

pub use options::{Features, MkfsOptions};

/// What mkfs made.
#[derive(Clone, Debug)]
pub struct MkfsResult {
    pub fsid: [u8; 16],
    pub dev_uuid: [u8; 16],
    pub total_bytes: u64,
    /// The generation of the last commit.
    pub generation: u64,
}

/// Node cache for mkfs's writer: a handful of trees of one leaf each.
const MKFS_CACHE_BYTES: usize = 16 << 20;

/// Make a filesystem on the file or block device at `path`, of `size` bytes (the
/// caller sized it). Everything already on the device's first 5 MiB and in the
/// superblock slots is overwritten; the caller has looked for signatures.
///
/// # Errors
/// `Posix(Invalid)`/`Posix(NoSpace)` for options the device cannot take (before
/// anything is written); `Io` from the device; any engine error. A made filesystem
/// that does not check clean is a bug (an assertion).
pub fn make_filesystem(path: &Path, size: u64, opts: &MkfsOptions) -> Result<MkfsResult> {
    let name = path.display().to_string();
    opts.validate(&name, size, 1)?;
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
        let dev = std::fs::OpenOptions::new().read(true).write(true).open(path).map_err(|e| Error::io(format!("{name}: opening for writing"), e))?;
        bootstrap::write(&dev, &name, size, &l)?;
    }
    let generation = {
        let mut w = FsWriter::open(&OpenOptions { devices: vec![path.to_path_buf()], cache_bytes: MKFS_CACHE_BYTES, writable: true, sources: opts.sources.clone() })?;
        populate_chunks(&mut w, opts)?;
        w.commit()?
    };
    let fs = FsInfo::open(&OpenOptions { devices: vec![path.to_path_buf()], cache_bytes: MKFS_CACHE_BYTES, writable: false, sources: opts.sources.clone() })?;
    let report = crate::check::check(&fs, &crate::check::CheckOptions::default())?;
    if !report.is_clean() {
        let found: Vec<String> = report.findings.iter().map(|f| f.to_string()).collect();
        panic!("{name}: the filesystem mkfs made does not check clean: {}", found.join("; "));
    }
    Ok(MkfsResult { fsid: l.fsid, dev_uuid: l.dev_uuid, total_bytes: l.total_bytes, generation })
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
    {
        // No reservation: the metadata chunk this handle makes is where its blocks go.
        let mut h = w.start_transaction("mkfs: chunks", 0)?;
        let r = (|| {
            for ty in [BLOCK_GROUP_SYSTEM, BLOCK_GROUP_METADATA, BLOCK_GROUP_DATA] {
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
