//! Opening a filesystem and reading tree blocks: superblock selection, device
//! assembly, chunk-tree bootstrap from the sys_chunk_array, and `read_tree_block`, which
//! validates every block once (tree checker) and falls back to other copies.
//!
//! Neighbours: `volumes` (mapping), `ctree` (search over blocks read here),
//! `node_cache` (bounded cache of validated blocks).

use crate::error::{Error, Result};
use crate::ids::Logical;
use crate::sources::Sources;
use crate::tree::node_cache::NodeCache;
use crate::tree::search::{RootInfo, TreeView};
use crate::volumes::dev_replace::DevReplace;
use crate::volumes::device::{BlockDevice, FileDevice};
use crate::volumes::device_lock::InUse;
use crate::volumes::{num_copies, read_logical, ChunkMap, Device, Devices, MapLookup};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use ubtrfs_format::features::{self, FeatureVerdict};
use ubtrfs_format::key::*;
use ubtrfs_format::structs::*;
use ubtrfs_format::superblock::{check_super, sys_chunk_array};
use ubtrfs_format::tree_checker::{check_tree_block, CheckCtx};
use ubtrfs_format::{items, CsumType, Key};

pub use crate::tree::extent_buffer::{Expect, ExtentBuffer};

/// How to open a filesystem.
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// The main image and any extra devices of a multi-device filesystem.
    pub devices: Vec<PathBuf>,
    /// Node cache budget in bytes.
    pub cache_bytes: usize,
    /// Open the devices for writing (the write engine needs this).
    pub writable: bool,
    /// Where the engine takes time and new UUIDs from.
    pub sources: Sources,
    /// Allow writing with member devices missing, as `mount -o degraded` does, when
    /// every chunk keeps a copy on the devices given.
    pub degraded: bool,
    /// Leave a log tree unreplayed (the kernel's `rescue=nologreplay`): a read-only
    /// open shows the last commit; a writable open is refused while there is a log.
    pub no_log_replay: bool,
}

impl OpenOptions {
    pub fn new(image: impl Into<PathBuf>) -> OpenOptions {
        OpenOptions {
            devices: vec![image.into()],
            cache_bytes: 64 << 20,
            writable: false,
            sources: Sources::default(),
            degraded: false,
            no_log_replay: false,
        }
    }
}

/// Everything known about an open filesystem (the kernel's `btrfs_fs_info`), shared by
/// every thread that uses it (`Arc<FsInfo>`): what can change while it is shared (the
/// committed superblock, the chunk map, the node cache, the warnings) sits behind its
/// own lock, each a leaf lock held for a copy or an insert and never across I/O.
pub struct FsInfo {
    /// The committed superblock (the kernel's `super_copy`): replaced as a whole when a
    /// commit's superblocks are on disk.
    super_copy: RwLock<Arc<Superblock>>,
    pub csum_type: CsumType,
    pub nodesize: u32,
    pub sectorsize: u32,
    /// The fsid tree blocks carry (metadata_uuid when that feature is on).
    pub meta_fsid: [u8; 16],
    pub chunk_tree_uuid: [u8; 16],
    pub chunk_map: ChunkMap,
    pub devices: Devices,
    pub cache: NodeCache,
    /// Why writing is not allowed, if it is not.
    pub read_only_reason: Option<String>,
    /// Opened with `OpenOptions::degraded`.
    pub degraded: bool,
    /// Opened with `OpenOptions::no_log_replay`.
    pub no_log_replay: bool,
    /// The dev tree's DEV_REPLACE item, if it has one (`volumes::dev_replace`).
    pub dev_replace: Option<DevReplace>,
    /// Who else was using the devices when they were opened for reading: another ubtrfs
    /// process writing, the kernel's mount (each also a warning). Empty for writers,
    /// which are refused instead, and for devices opened by the caller.
    pub in_use: Vec<InUse>,
    /// Where the engine takes time and new UUIDs from (`OpenOptions::sources`).
    pub sources: Sources,
    /// Why the running transaction was aborted, once it was (the kernel's
    /// BTRFS_FS_STATE_TRANS_ABORTED with its message): the first failure wins, and the
    /// filesystem takes no more changes until it is opened again.
    aborted: std::sync::OnceLock<String>,
    /// The commits from here on are a long-lived holder's last (`set_last_commit`).
    last_commit: std::sync::atomic::AtomicBool,
    warnings: Mutex<Vec<String>>,
}

impl FsInfo {
    /// Why the filesystem was aborted to read-only, if it was.
    pub fn aborted(&self) -> Option<&str> {
        self.aborted.get().map(String::as_str)
    }

    /// Make the commits from here on check each device before its superblocks are
    /// written (`BlockDevice::claim_for_last_commit`): a commit that finds the kernel
    /// using a device writes no superblock and fails, and the filesystem aborts. A
    /// mount sets it at its unmount, when the kernel may mount the image at any moment.
    pub fn set_last_commit(&self) {
        self.last_commit.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether `set_last_commit` was called.
    pub fn is_last_commit(&self) -> bool {
        self.last_commit.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Record an abort (the first one wins).
    pub(crate) fn set_aborted(&self, why: String) {
        let _ = self.aborted.set(why);
    }

    /// Open the devices in `opts` as one filesystem.
    ///
    /// # Errors
    /// `Io` for unreadable devices, `Corrupt` for bad superblocks or chunk trees,
    /// `Incompatible` for unsupported features or mismatched devices. `Posix(Busy)`
    /// for a writer while another ubtrfs process or the kernel uses a device (a reader
    /// goes on with a warning and `in_use`; see `device_lock`).
    pub fn open(opts: &OpenOptions) -> Result<FsInfo> {
        let mut devs: Vec<Arc<dyn BlockDevice>> = Vec::new();
        let mut in_use = Vec::new();
        let mut warnings = Vec::new();
        for p in &opts.devices {
            let d = FileDevice::open(p, opts.writable)?;
            in_use.extend_from_slice(d.in_use());
            warnings.extend(d.in_use().iter().map(InUse::reader_warning));
            warnings.extend_from_slice(d.open_warnings());
            devs.push(Arc::new(d));
        }
        let mut fs = FsInfo::open_devices(devs, opts.cache_bytes)?;
        fs.in_use = in_use;
        fs.sources = opts.sources.clone();
        fs.degraded = opts.degraded;
        fs.no_log_replay = opts.no_log_replay;
        // Who else uses the image matters more than what the superblocks said: first.
        let later = fs.take_warnings();
        for w in warnings.into_iter().chain(later) {
            fs.warn(w);
        }
        Ok(fs)
    }

    /// Open already-opened devices (the first is the main one).
    ///
    /// # Errors
    /// As `open`.
    pub fn open_devices(devs: Vec<Arc<dyn BlockDevice>>, cache_bytes: usize) -> Result<FsInfo> {
        assert!(!devs.is_empty(), "open_devices needs at least one device");
        let mut warnings = Vec::new();
        let mut sbs = Vec::new();
        for d in &devs {
            sbs.push(read_super(d.as_ref(), &mut warnings)?);
        }
        let first_fsid = sbs[0].fsid;
        let mut devices = Devices::default();
        for (d, s) in devs.iter().zip(&sbs) {
            if s.fsid != first_fsid {
                // A seed device under a sprout has its own fsid: say what it is
                // rather than that it belongs elsewhere.
                let seeding = |s: &Superblock| s.flags.get() & features::SUPER_FLAG_SEEDING != 0;
                if let Some((sd, ss)) = devs.iter().zip(&sbs).find(|(_, s)| seeding(s)) {
                    return Err(seed_refusal(format!(
                        "{} is a seed device (filesystem {})",
                        crate::quote::name(sd.name().as_bytes()),
                        items::uuid_str(&ss.fsid)
                    )));
                }
                return Err(Error::Incompatible(format!(
                    "{} belongs to filesystem {}, not {}",
                    d.name(),
                    items::uuid_str(&s.fsid),
                    items::uuid_str(&first_fsid)
                )));
            }
            let devid = s.dev_item.devid.get();
            let dev = Device {
                devid,
                uuid: s.dev_item.uuid,
                dev: d.clone(),
                sb_generation: s.generation.get(),
            };
            if devid == DEV_REPLACE_DEVID {
                // The target of a device replace: not a member (no DEV_ITEM, not in
                // num_devices); whether it is used depends on the DEV_REPLACE item.
                if devices.replace_target.is_some() {
                    return Err(Error::Incompatible(format!(
                        "{}: a second device replace target (devid 0)",
                        d.name()
                    )));
                }
                devices.replace_target = Some(dev);
                continue;
            }
            if devices.by_id.contains_key(&devid) {
                return Err(Error::Incompatible(format!(
                    "{}: device id {devid} given twice",
                    d.name()
                )));
            }
            devices.by_id.insert(devid, dev);
        }
        let mut read_only_reason: Option<String> = None;
        // A device shorter than its dev_item says was cut short (a partial download or
        // copy, a full disk while writing the image): say so up front rather than fail
        // later with "beyond end of device". Reading what is there stays allowed;
        // writing is refused, since new chunks may be placed in the missing part.
        for (d, s) in devs.iter().zip(&sbs) {
            let want = s.dev_item.total_bytes.get();
            if d.size() < want {
                let msg = format!("{} is truncated: its superblock says the device holds {want} bytes, but it has {}; reads past the end fail", crate::quote::name(d.name().as_bytes()), d.size());
                read_only_reason.get_or_insert_with(|| msg.clone());
                warnings.push(msg);
            }
        }
        // Use the newest superblock among the devices, as the kernel does.
        let sb = Arc::new(*sbs.iter().max_by_key(|s| s.generation.get()).expect("non-empty"));
        let csum_type = CsumType::from_raw(sb.csum_type.get()).expect("checked by check_super");
        let incompat = sb.incompat_flags.get();
        let compat_ro = sb.compat_ro_flags.get();
        match features::check_features(incompat, compat_ro) {
            FeatureVerdict::ReadWrite => {}
            FeatureVerdict::ReadOnly { unknown_compat_ro } => {
                read_only_reason = Some(format!(
                    "unknown compat_ro features {}",
                    features::flag_names(unknown_compat_ro, features::COMPAT_RO_NAMES)
                ));
                warnings.push(format!("filesystem has unknown compat_ro features {unknown_compat_ro:#x}; read-only access only"));
            }
            FeatureVerdict::Refuse { unsupported_incompat } => {
                return Err(Error::Incompatible(format!(
                    "unsupported incompat features {} ({unsupported_incompat:#x})",
                    features::flag_names(unsupported_incompat, features::INCOMPAT_NAMES)
                )));
            }
        }
        let meta_fsid = if incompat & features::INCOMPAT_METADATA_UUID != 0 {
            sb.metadata_uuid
        } else {
            sb.fsid
        };
        let chunk_map = ChunkMap::default();
        for (key, c) in sys_chunk_array(&sb)? {
            chunk_map.insert(MapLookup::from_view(key.offset, &c))?;
        }
        let mut fs = FsInfo {
            nodesize: sb.nodesize.get(),
            sectorsize: sb.sectorsize.get(),
            super_copy: RwLock::new(sb.clone()),
            csum_type,
            meta_fsid,
            chunk_tree_uuid: [0; 16],
            chunk_map,
            devices,
            cache: NodeCache::new(cache_bytes),
            read_only_reason,
            degraded: false,
            no_log_replay: false,
            dev_replace: None,
            in_use: Vec::new(),
            sources: Sources::default(),
            aborted: Default::default(),
            last_commit: Default::default(),
            warnings: Mutex::new(warnings),
        };
        fs.read_chunk_tree(&sb)?;
        fs.load_dev_replace();
        if fs.devices.by_id.len() as u64 != sb.num_devices.get() {
            let have: Vec<u64> = fs.devices.by_id.keys().copied().collect();
            fs.warn(format!("filesystem has {} devices but {} were given (devids {:?}); reads needing a missing device use another copy or fail", sb.num_devices.get(), have.len(), have));
        }
        Ok(fs)
    }

    fn read_chunk_tree(&mut self, sb: &Superblock) -> Result<()> {
        let root = RootInfo {
            id: CHUNK_TREE_OBJECTID,
            bytenr: sb.chunk_root.get(),
            level: sb.chunk_root_level,
            generation: sb.chunk_root_generation.get(),
        };
        // The chunk root tells us the chunk tree uuid every other block must carry.
        let eb = self.read_tree_block(
            root.bytenr,
            &Expect {
                level: Some(root.level),
                generation: Some(root.generation),
                owner: Some(CHUNK_TREE_OBJECTID),
                first_key: None,
            },
        )?;
        self.chunk_tree_uuid = eb.node().header().chunk_tree_uuid;
        self.cache.clear();
        let mut chunks = Vec::new();
        // DEV_ITEMs first: one carrying another fsid is a seed device's (the kernel's
        // read_one_dev opens the seed filesystem there).
        let mut it = self.iter(&root, Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 0))?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k.objectid != DEV_ITEMS_OBJECTID || k.type_ != DEV_ITEM_KEY {
                break;
            }
            let Ok((d, _)) = <DevItem as zerocopy::FromBytes>::ref_from_prefix(item.data()) else {
                continue;
            };
            if d.fsid != self.meta_fsid {
                return Err(seed_refusal(format!(
                    "devid {} belongs to seed filesystem {} under this sprout filesystem {}",
                    k.offset,
                    items::uuid_str(&d.fsid),
                    items::uuid_str(&sb.fsid)
                )));
            }
        }
        let mut it = self.iter(&root, Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, 0))?;
        while let Some(item) = it.next_item()? {
            let k = item.key();
            if k.type_ != CHUNK_ITEM_KEY {
                continue;
            }
            let (c, _) = items::chunk(item.data()).expect("validated by the tree checker");
            chunks.push(MapLookup::from_view(k.offset, &c));
        }
        for c in chunks {
            if c.type_ & BLOCK_GROUP_SYSTEM != 0 {
                if let Ok(existing) = self.chunk_map.lookup(Logical(c.logical)) {
                    if *existing != c {
                        self.warn(format!("system chunk {} differs between the sys_chunk_array and the chunk tree; using the chunk tree", c.logical));
                    }
                }
            }
            let mapped = self.chunk_map.lookup(Logical(c.logical));
            if mapped.map(|e| e.logical == c.logical).unwrap_or(false) {
                continue;
            }
            self.chunk_map.insert(c)?;
        }
        Ok(())
    }

    /// Read the DEV_REPLACE item: with a replace in progress, reads of a missing
    /// source may use the target below the cursor, and writing is refused. A dev tree
    /// that cannot be read leaves the filesystem readable but not writable, since a
    /// replace might be in progress.
    fn load_dev_replace(&mut self) {
        let mut warnings = Vec::new();
        match read_dev_replace(&*self, &mut warnings) {
            Ok(r) => self.dev_replace = r,
            Err(e) => {
                let msg = format!("the dev tree's device replace item cannot be read ({e}); whether a replace is in progress is unknown");
                self.read_only_reason.get_or_insert_with(|| msg.clone());
                warnings.push(msg);
            }
        }
        match (&self.dev_replace, &self.devices.replace_target) {
            (Some(r), Some(_)) if r.is_ongoing() => {
                self.devices.replace_copied = Some((r.src_devid, r.cursor_left))
            }
            (_, Some(t)) => {
                warnings.push(format!("{} is a device replace target (devid 0), but no replace is in progress: not used", crate::quote::name(t.dev.name().as_bytes())));
                self.devices.replace_target = None;
            }
            _ => {}
        }
        for w in warnings {
            self.warn(w);
        }
    }

    /// Record a warning for the user (printed by the CLI).
    pub fn warn(&self, msg: String) {
        self.warnings.lock().unwrap_or_else(|p| p.into_inner()).push(msg);
    }
    /// Take the warnings recorded so far.
    pub fn take_warnings(&self) -> Vec<String> {
        std::mem::take(&mut *self.warnings.lock().unwrap_or_else(|p| p.into_inner()))
    }

    fn check_ctx(&self, bytenr: u64, expect: &Expect) -> CheckCtx {
        CheckCtx {
            nodesize: self.nodesize,
            sectorsize: self.sectorsize,
            csum_type: self.csum_type,
            fsid: self.meta_fsid,
            // The kernel does not check a header's chunk tree uuid at read.
            chunk_tree_uuid: None,
            super_generation: self.super_copy().generation.get(),
            bytenr,
            level: expect.level,
            generation: expect.generation,
            owner: expect.owner,
            first_key: expect.first_key,
        }
    }

    /// Read and validate the tree block at `bytenr`, trying every copy.
    ///
    /// # Errors
    /// The first copy's error when no copy passes (later copies' errors are warnings).
    pub fn read_tree_block(&self, bytenr: u64, expect: &Expect) -> Result<Arc<ExtentBuffer>> {
        if let Some(eb) = self.cache.get(bytenr) {
            if eb.matches(expect) {
                return Ok(eb);
            }
        }
        if !bytenr.is_multiple_of(u64::from(self.sectorsize)) {
            return Err(ubtrfs_format::Corrupt::new(
                ubtrfs_format::CorruptWhere::Block,
                format!("unaligned tree block address, sectorsize {}", self.sectorsize),
            )
            .block(bytenr)
            .into());
        }
        let copies = num_copies(&self.chunk_map, Logical(bytenr));
        let ctx = self.check_ctx(bytenr, expect);
        let mut first_err: Option<Error> = None;
        let mut bad = Vec::new();
        for mirror in 0..copies {
            let mut buf = vec![0u8; self.nodesize as usize].into_boxed_slice();
            let r = read_logical(&self.chunk_map, &self.devices, Logical(bytenr), &mut buf, mirror)
                .and_then(|()| check_tree_block(&buf, &ctx).map_err(Error::from));
            match r {
                Ok(()) => {
                    if !bad.is_empty() {
                        self.warn(format!(
                            "tree block {bytenr}: copy {} of {copies} is bad ({}); read copy {}",
                            bad.iter()
                                .map(|m: &usize| (m + 1).to_string())
                                .collect::<Vec<_>>()
                                .join(","),
                            first_err.as_ref().map(|e| e.to_string()).unwrap_or_default(),
                            mirror + 1
                        ));
                    }
                    let eb = Arc::new(ExtentBuffer::from_disk(bytenr, buf));
                    self.cache.insert(eb.clone());
                    return Ok(eb);
                }
                Err(e) => {
                    bad.push(mirror);
                    if first_err.is_none() {
                        first_err = Some(e);
                    }
                }
            }
        }
        Err(first_err.expect("at least one copy was tried"))
    }

    /// Read `len` bytes of data at `logical` from copy `mirror` (0-based).
    ///
    /// # Errors
    /// `Io` or `Corrupt` (unmapped address).
    pub fn read_data(&self, logical: Logical, buf: &mut [u8], mirror: usize) -> Result<()> {
        read_logical(&self.chunk_map, &self.devices, logical, buf, mirror)
    }

    /// How many copies the chunk holding `logical` keeps (1 if none maps it, so the
    /// read that follows reports the mapping error).
    pub fn num_copies(&self, logical: Logical) -> usize {
        num_copies(&self.chunk_map, logical)
    }
}

/// The committed view: the trees as the superblock in memory points at them.
impl TreeView for FsInfo {
    type Node = Arc<ExtentBuffer>;
    fn read_node(&self, bytenr: u64, expect: &Expect) -> Result<Arc<ExtentBuffer>> {
        self.read_tree_block(bytenr, expect)
    }
    fn tree_root(&self) -> RootInfo {
        super_tree_root(&self.super_copy())
    }
    fn chunk_root(&self) -> RootInfo {
        super_chunk_root(&self.super_copy())
    }
}

/// The root tree's root as superblock `sb` points at it.
pub fn super_tree_root(sb: &Superblock) -> RootInfo {
    RootInfo {
        id: ROOT_TREE_OBJECTID,
        bytenr: sb.root.get(),
        level: sb.root_level,
        generation: sb.generation.get(),
    }
}

/// The chunk tree's root as superblock `sb` points at it.
pub fn super_chunk_root(sb: &Superblock) -> RootInfo {
    RootInfo {
        id: CHUNK_TREE_OBJECTID,
        bytenr: sb.chunk_root.get(),
        level: sb.chunk_root_level,
        generation: sb.chunk_root_generation.get(),
    }
}

impl FsInfo {
    /// The committed superblock (a copy that stays as it is while held).
    pub fn super_copy(&self) -> Arc<Superblock> {
        self.super_copy.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Make `sb` the committed superblock: its commit is on disk.
    pub(crate) fn set_super_copy(&self, sb: Arc<Superblock>) {
        let mut g = self.super_copy.write().unwrap_or_else(|p| p.into_inner());
        assert!(
            sb.generation.get() >= g.generation.get(),
            "committed generation went back from {} to {}",
            g.generation.get(),
            sb.generation.get()
        );
        *g = sb;
    }

    /// The log tree root, if the superblock carries one.
    pub fn log_root(&self) -> Option<RootInfo> {
        let sb = self.super_copy();
        let b = sb.log_root.get();
        (b != 0).then(|| RootInfo {
            id: TREE_LOG_OBJECTID,
            bytenr: b,
            level: sb.log_root_level,
            generation: sb.generation.get().saturating_add(1),
        })
    }
}

/// The refusal of a sprout filesystem, `what` naming the seed device.
fn seed_refusal(what: String) -> Error {
    Error::Incompatible(format!("seed devices are not supported: {what}"))
}

/// Read the primary superblock, falling back to the best valid copy.
pub(crate) fn read_super(dev: &dyn BlockDevice, warnings: &mut Vec<String>) -> Result<Superblock> {
    let mut first_err = None;
    let mut best: Option<(usize, Superblock)> = None;
    for mirror in 0..SUPER_MIRROR_MAX {
        let off = sb_offset(mirror);
        if off + SUPER_INFO_SIZE as u64 > dev.size() {
            break;
        }
        let mut buf = vec![0u8; SUPER_INFO_SIZE];
        let r =
            dev.read_at(&mut buf, off).and_then(|()| check_super(&buf, off).map_err(Error::from));
        match r {
            Ok(sb) => {
                if mirror == 0 {
                    return Ok(sb);
                }
                if best.as_ref().is_none_or(|(_, b)| sb.generation.get() > b.generation.get()) {
                    best = Some((mirror, sb));
                }
            }
            Err(e) => {
                if first_err.is_none() {
                    first_err = Some(e);
                }
            }
        }
    }
    let err = first_err.unwrap_or_else(|| {
        Error::Incompatible(format!(
            "{}: too small for a btrfs superblock ({} bytes)",
            dev.name(),
            dev.size()
        ))
    });
    match best {
        Some((m, sb)) => {
            warnings.push(format!(
                "{}: primary superblock is bad ({err}); using copy {m} at {}",
                dev.name(),
                sb_offset(m)
            ));
            Ok(sb)
        }
        None => Err(match err {
            Error::Corrupt(c)
                if c.what == ubtrfs_format::CorruptWhere::Super
                    && c.reason.starts_with("bad magic") =>
            {
                Error::Incompatible(format!(
                    "{}: not a btrfs filesystem ({})",
                    dev.name(),
                    c.reason
                ))
            }
            e => e,
        }),
    }
}

/// What the item at (0 DEV_REPLACE 0) of the dev tree says, if there is one.
/// An item of another size is ignored with a warning, as btrfs_init_dev_replace does.
///
/// # Errors
/// `Io`/`Corrupt` reading the root or dev tree.
pub fn read_dev_replace<V: TreeView + ?Sized>(
    v: &V,
    warnings: &mut Vec<String>,
) -> Result<Option<DevReplace>> {
    let (root, _) = match v.read_root(DEV_TREE_OBJECTID) {
        Ok(r) => r,
        Err(e) if e.posix_kind() == Some(crate::error::PosixKind::NotFound) => return Ok(None),
        Err(e) => return Err(e),
    };
    let key = Key::new(DEV_REPLACE_DEVID, DEV_REPLACE_KEY, 0);
    let Some(item) = v.first_item_ge(&root, &key)? else { return Ok(None) };
    if item.key() != key {
        return Ok(None);
    }
    let Ok(r) = <DevReplaceItem as zerocopy::FromBytes>::read_from_bytes(item.data()) else {
        warnings.push(format!(
            "dev replace item has size {}, not {}: ignored, as the kernel does",
            item.data().len(),
            std::mem::size_of::<DevReplaceItem>()
        ));
        return Ok(None);
    };
    let src_devid = r.src_devid.get();
    let dk = Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, src_devid);
    let src_total_bytes = match v.first_item_ge(&v.chunk_root(), &dk)? {
        Some(it) if it.key() == dk => <DevItem as zerocopy::FromBytes>::ref_from_prefix(it.data())
            .map(|(d, _)| d.total_bytes.get())
            .unwrap_or(0),
        _ => 0,
    };
    Ok(Some(DevReplace {
        src_devid,
        cursor_left: r.cursor_left.get(),
        cursor_right: r.cursor_right.get(),
        state: r.replace_state.get(),
        src_total_bytes,
    }))
}
