//! `mkfs`: a new filesystem on one device or several, made the way btrfs-progs'
//! `make_btrfs` makes it, and by the engine rather than by a second writer:
//!
//! 1. `bootstrap` writes a minimal filesystem whose trees are one leaf each, in a
//!    temporary SYSTEM chunk at 1 MiB of device 1, with every device already a member
//!    (a device item each in the chunk tree, a superblock on each);
//! 2. the engine opens all the devices, takes the requested profiles, allocates the real SYSTEM,
//!    METADATA and DATA chunks (SYSTEM and DATA|METADATA with mixed block groups) and
//!    COWs every root leaf into them, and commits (the commit frees the bootstrap
//!    blocks);
//! 3. a second transaction removes the now empty temporary chunk
//!    (`Engine::remove_chunk`) and commits.
//!
//! Then the result is opened again and checked by the checker (`crate::check`): a
//! filesystem mkfs made is clean or mkfs fails. Neighbours: `options` (what is asked
//! for and its validation), the cli's `mkfs` command (devices, signatures, cleanup).

pub mod bootstrap;
pub mod options;
pub mod shrink;
pub mod signature;

use std::path::{Path, PathBuf};
use ubtrfs_core::{BlockDevice, Engine, Error, FileDevice, FsInfo, OpenOptions, PosixKind, Result};
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

/// One device to make part of the new filesystem: devids follow the order given.
#[derive(Clone, Debug)]
pub struct MkfsDevice {
    pub path: PathBuf,
    /// Bytes of it the filesystem uses (the caller sized the file).
    pub size: u64,
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
    /// Per device, devid 1 first.
    pub dev_uuids: Vec<[u8; 16]>,
    /// The sum of the devices' sizes (each rounded down to the sector size, or cut
    /// by `--shrink`).
    pub total_bytes: u64,
    /// Per device, devid 1 first: the bytes of it the filesystem uses (with `--shrink`
    /// the size an image file is cut to).
    pub dev_sizes: Vec<u64>,
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
pub fn make_filesystem(
    path: &Path,
    size: u64,
    opts: &MkfsOptions,
) -> std::result::Result<MkfsResult, MkfsFailure> {
    make_filesystem_with(path, size, opts, |_| Ok(()))
}

/// As `make_filesystem`, with `fill` run on an engine over the new filesystem once
/// its chunks are made and before the last commit (its page cache's dirty data is
/// written back after it) (where `--rootdir` copies a tree in,
/// `populate::populate`); the check runs on the filled filesystem.
///
/// # Errors
/// As `make_filesystem`, and `fill`'s error (after writing began).
pub fn make_filesystem_with(
    path: &Path,
    size: u64,
    opts: &MkfsOptions,
    fill: impl FnOnce(&Engine) -> Result<()>,
) -> std::result::Result<MkfsResult, MkfsFailure> {
    make_filesystem_on(&[MkfsDevice { path: path.to_path_buf(), size }], opts, fill)
}

/// As `make_filesystem_with`, over every device in `devices` (devids 1..N in that
/// order): one filesystem whose chunks take the profiles asked for.
///
/// # Errors
/// As `make_filesystem`; also `Posix(Invalid)` for no device, one given twice, or
/// fewer devices than a profile needs (before anything is written). After writing
/// began, every device's superblock slots are zeroed.
pub fn make_filesystem_on(
    devices: &[MkfsDevice],
    opts: &MkfsOptions,
    fill: impl FnOnce(&Engine) -> Result<()>,
) -> std::result::Result<MkfsResult, MkfsFailure> {
    let r = make_filesystem_inner(devices, opts, fill);
    if let Err(f) = &r {
        if f.began_writing {
            for d in devices {
                wipe_superblocks(&d.path, d.size);
            }
        }
    }
    r
}

/// Refuse a device named twice (by path or, for existing ones, by identity): its two
/// roles would overwrite each other.
///
/// # Errors
/// `Posix(Invalid)` naming the device given twice.
pub fn check_distinct(devices: &[MkfsDevice]) -> Result<()> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    /// What an existing target is, whatever path names it.
    #[derive(PartialEq)]
    enum Identity {
        Block { rdev: u64 },
        File { dev: u64, ino: u64 },
    }
    let mut seen: Vec<(&Path, Option<Identity>)> = Vec::new();
    for d in devices {
        let id = std::fs::metadata(&d.path).ok().map(|m| {
            if m.file_type().is_block_device() {
                Identity::Block { rdev: m.rdev() }
            } else {
                Identity::File { dev: m.dev(), ino: m.ino() }
            }
        });
        if seen.iter().any(|(p, i)| *p == d.path || (id.is_some() && *i == id)) {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                d.path.display().to_string(),
                "given twice; each device can be one member only",
            ));
        }
        seen.push((&d.path, id));
    }
    Ok(())
}

fn make_filesystem_inner(
    devices: &[MkfsDevice],
    opts: &MkfsOptions,
    fill: impl FnOnce(&Engine) -> Result<()>,
) -> std::result::Result<MkfsResult, MkfsFailure> {
    if devices.is_empty() {
        return Err(before_writing(Error::posix_detail(
            PosixKind::Invalid,
            "mkfs",
            "no device given",
        )));
    }
    check_distinct(devices).map_err(before_writing)?;
    for d in devices {
        opts.validate(&d.path.display().to_string(), d.size, devices.len())
            .map_err(before_writing)?;
    }
    let uuids = &opts.sources.uuids;
    let ss = u64::from(opts.sectorsize);
    let fsid = opts.fsid.unwrap_or_else(|| uuids.new_uuid());
    let chunk_tree_uuid = uuids.new_uuid();
    let members: Vec<bootstrap::DevLayout> = devices
        .iter()
        .map(|d| bootstrap::DevLayout { uuid: uuids.new_uuid(), total_bytes: d.size / ss * ss })
        .collect();
    let l = bootstrap::Layout {
        nodesize: opts.nodesize,
        sectorsize: opts.sectorsize,
        csum: opts.csum,
        fsid,
        chunk_tree_uuid,
        devices: members,
        fs_tree_uuid: uuids.new_uuid(),
        label: opts.label.clone(),
        incompat: opts.features.incompat(),
        compat_ro: opts.features.compat_ro(),
        now: opts.sources.clock.now(),
    };
    {
        // Locked as every writer is: refused while the kernel has one mounted or another
        // program or ubtrfs process uses it, before a byte is written to any. The locks
        // end before the engine's writer takes its own.
        let mut devs = Vec::new();
        for d in devices {
            let dev = FileDevice::open(&d.path, true).map_err(before_writing)?;
            if dev.size() < d.size {
                return Err(before_writing(Error::posix_detail(
                    PosixKind::NoSpace,
                    d.path.display().to_string(),
                    format!("{} bytes, less than the {} asked for", dev.size(), d.size),
                )));
            }
            devs.push(dev);
        }
        let refs: Vec<&dyn BlockDevice> = devs.iter().map(|d| d as &dyn BlockDevice).collect();
        bootstrap::write(&refs, &l).map_err(after_writing)?;
    }
    let paths: Vec<PathBuf> = devices.iter().map(|d| d.path.clone()).collect();
    let generation = (|| {
        let e = crate::offline_engine(Engine::open(&OpenOptions {
            devices: paths.clone(),
            cache_bytes: MKFS_CACHE_BYTES,
            writable: true,
            sources: opts.sources.clone(),
            degraded: false,
            no_log_replay: false,
        })?);
        if opts.shrink {
            shrink::cap_chunks(&e)?;
        }
        populate_chunks(&e, opts)?;
        e.commit()?;
        if let Err(err) = fill(&e).and_then(|()| e.writeback_all()) {
            e.abort("mkfs: filling the new filesystem", &err)?;
            return Err(err);
        }
        let mut dev_sizes: Vec<u64> = l.devices.iter().map(|d| d.total_bytes).collect();
        if opts.shrink {
            e.commit()?;
            for (devid, size) in e.shrink_devices()? {
                let i = usize::try_from(devid - 1).expect("devids are 1..=N");
                dev_sizes[i] = size;
            }
        }
        let g = e.commit()?;
        Ok((g, e.info().super_copy().total_bytes.get(), dev_sizes))
    })()
    .map_err(after_writing)?;
    let (generation, total_bytes, dev_sizes) = generation;
    let report = FsInfo::open(&OpenOptions {
        devices: paths.clone(),
        cache_bytes: MKFS_CACHE_BYTES,
        writable: false,
        sources: opts.sources.clone(),
        degraded: false,
        no_log_replay: false,
    })
    .and_then(|fs| crate::check::check(&fs, &crate::check::CheckOptions::default()))
    .map_err(after_writing)?;
    if !report.is_clean() {
        let found: Vec<String> = report.findings.iter().map(|f| f.to_string()).collect();
        panic!(
            "{}: the filesystem mkfs made does not check clean: {}",
            devices[0].path.display(),
            found.join("; ")
        );
    }
    debug_assert_eq!(
        dev_sizes.iter().sum::<u64>(),
        total_bytes,
        "device sizes and the superblock's total differ"
    );
    Ok(MkfsResult {
        fsid: l.fsid,
        dev_uuids: l.devices.iter().map(|d| d.uuid).collect(),
        total_bytes,
        dev_sizes,
        generation,
    })
}

/// Steps 2 and 3 of the module docs, on the engine of the bootstrap filesystem.
///
/// # Errors
/// Engine errors (a failure after a change began aborts the transaction).
fn populate_chunks(e: &Engine, opts: &MkfsOptions) -> Result<()> {
    let start = bootstrap::TEMP_CHUNK_START;
    e.set_alloc_profile(BLOCK_GROUP_DATA, opts.data_profile)?;
    e.set_alloc_profile(BLOCK_GROUP_METADATA, opts.metadata_profile)?;
    e.set_alloc_profile(BLOCK_GROUP_SYSTEM, opts.metadata_profile)?;
    // The first chunks are mkfs.btrfs's sizes, smaller than the kernel makes later: 8 MiB
    // of system and of data, metadata a twentieth of the filesystem within 32-256 MiB
    // (--shrink has set its own, smaller ones).
    if !opts.shrink {
        let total = e.info().super_copy().total_bytes.get();
        e.set_max_chunk_size(Some((BLOCK_GROUP_SYSTEM, 8 << 20)))?;
        e.set_max_chunk_size(Some((BLOCK_GROUP_DATA, 8 << 20)))?;
        let meta = (total / 20).clamp(32 << 20, 256 << 20);
        e.set_max_chunk_size(Some((BLOCK_GROUP_METADATA, meta)))?;
    }
    // With mixed block groups one DATA|METADATA chunk serves both.
    let types: &[u64] = if opts.features.mixed {
        &[BLOCK_GROUP_SYSTEM, BLOCK_GROUP_METADATA]
    } else {
        &[BLOCK_GROUP_SYSTEM, BLOCK_GROUP_METADATA, BLOCK_GROUP_DATA]
    };
    let moved = e.alloc_chunks_moving_roots(types, start)?;
    assert!(moved >= 9, "moved {moved} trees out of the bootstrap chunk, expected every tree");
    if !opts.shrink {
        e.set_max_chunk_size(None)?;
    }
    e.commit()?;
    e.remove_chunk(start)
}
