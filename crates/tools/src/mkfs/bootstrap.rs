//! The first filesystem, written from nothing (btrfs-progs' `make_btrfs`, with every
//! further device already added to it): a superblock on every device (every mirror
//! that fits, each carrying its own device item) and a temporary SINGLE SYSTEM chunk at
//! 1 MiB of device 1, logical = physical, holding one leaf per tree:
//!
//! - root tree: ROOT_ITEMs of every other tree, the root directory 6 with its
//!   `default` entry naming the fs tree;
//! - chunk tree: a device item per device and the temporary chunk;
//! - extent tree: a skinny METADATA_ITEM per tree block and the block group item
//!   (in the block-group tree instead when that feature is on);
//! - dev tree: the temporary chunk's dev extent;
//! - fs tree and data-relocation tree: directory 256 with its `..` INODE_REF;
//! - csum tree: empty; uuid tree: the fs tree's UUID_KEY_SUBVOL;
//! - free-space tree: INFO and one free extent for the temporary group.
//!
//! Every leaf goes through the format crate's tree checker before it is written, and
//! the superblock through its superblock checker. The engine then opens this
//! filesystem and moves everything into real chunks (see `mod.rs`).
//! Neighbours: `options` (what is asked for), `ubtrfs_format::node::NodeMut`.

use ubtrfs_core::{BlockDevice, Error, Result, Time};
use ubtrfs_format::key::*;
use ubtrfs_format::node::{NodeMut, NodeRef};
use ubtrfs_format::structs::*;
use ubtrfs_format::tree_checker::{check_tree_block, CheckCtx};
use ubtrfs_format::{CsumType, Key};
use zerocopy::{FromZeros, IntoBytes};

/// Where the temporary SYSTEM chunk sits, logical and physical (the first MiB stays
/// unallocated, as the kernel keeps it).
pub const TEMP_CHUNK_START: u64 = 1 << 20;
/// Its length (btrfs-progs' `BTRFS_MKFS_SYSTEM_GROUP_SIZE`).
pub const TEMP_CHUNK_LEN: u64 = 4 << 20;
/// The generation the bootstrap is written at; the engine's first transaction is 2.
pub const BOOTSTRAP_GENERATION: u64 = 1;
/// `BTRFS_FT_DIR`.
const FT_DIR: u8 = 2;
const S_IFDIR: u32 = 0o040000;

/// One member device: devid is its index in `Layout::devices` plus one.
#[derive(Clone, Copy, Debug)]
pub struct DevLayout {
    pub uuid: [u8; 16],
    /// The device's size rounded down to the sector size.
    pub total_bytes: u64,
}

/// What the bootstrap writes: the settled options plus the identities drawn for it.
#[derive(Clone, Debug)]
pub struct Layout {
    pub nodesize: u32,
    pub sectorsize: u32,
    pub csum: CsumType,
    pub fsid: [u8; 16],
    pub chunk_tree_uuid: [u8; 16],
    /// The member devices, devid 1 first (it holds the temporary chunk); at least one.
    pub devices: Vec<DevLayout>,
    /// The fs tree's UUID (ROOT_ITEM uuid and its uuid-tree entry).
    pub fs_tree_uuid: [u8; 16],
    pub label: Vec<u8>,
    pub incompat: u64,
    pub compat_ro: u64,
    pub now: Time,
}

impl Layout {
    /// The filesystem's size: the sum of its devices'.
    pub fn total_bytes(&self) -> u64 {
        self.devices.iter().map(|d| d.total_bytes).sum()
    }

    fn dev(&self, devid: u64) -> &DevLayout {
        let i = usize::try_from(devid).ok().and_then(|d| d.checked_sub(1));
        i.and_then(|i| self.devices.get(i)).unwrap_or_else(|| {
            panic!("devid {devid} is not one of the {} devices", self.devices.len())
        })
    }

    fn bg_tree(&self) -> bool {
        self.compat_ro & ubtrfs_format::features::COMPAT_RO_BLOCK_GROUP_TREE != 0
    }

    /// The trees, in the order their leaves sit in the temporary chunk.
    pub fn trees(&self) -> Vec<u64> {
        let mut t = vec![
            ROOT_TREE_OBJECTID,
            EXTENT_TREE_OBJECTID,
            CHUNK_TREE_OBJECTID,
            DEV_TREE_OBJECTID,
            FS_TREE_OBJECTID,
            CSUM_TREE_OBJECTID,
            UUID_TREE_OBJECTID,
            FREE_SPACE_TREE_OBJECTID,
        ];
        if self.bg_tree() {
            t.push(BLOCK_GROUP_TREE_OBJECTID);
        }
        t.push(DATA_RELOC_TREE_OBJECTID);
        t
    }

    /// The logical (= physical) address of tree `id`'s leaf.
    pub fn block_of(&self, id: u64) -> u64 {
        let i = self
            .trees()
            .iter()
            .position(|&t| t == id)
            .unwrap_or_else(|| panic!("tree {id} is not bootstrapped"));
        TEMP_CHUNK_START + i as u64 * u64::from(self.nodesize)
    }

    fn used(&self) -> u64 {
        self.trees().len() as u64 * u64::from(self.nodesize)
    }
}

fn timespec(t: Time) -> Timespec {
    // Times before 1970 are stored as their two's complement, as the kernel does.
    Timespec { sec: (t.sec as u64).into(), nsec: t.nsec.into() }
}

/// A directory inode as mkfs.btrfs makes the top of a tree: one link, size 0.
fn dir_inode(generation: u64, nbytes: u64, now: Time, otime: bool) -> InodeItem {
    let mut i = InodeItem::new_zeroed();
    i.generation = generation.into();
    i.nbytes = nbytes.into();
    i.nlink = 1.into();
    i.mode = (S_IFDIR | 0o755).into();
    i.atime = timespec(now);
    i.ctime = timespec(now);
    i.mtime = timespec(now);
    if otime {
        i.otime = timespec(now);
    }
    i
}

fn inode_ref(index: u64, name: &[u8]) -> Vec<u8> {
    let mut v =
        InodeRef { index: index.into(), name_len: (name.len() as u16).into() }.as_bytes().to_vec();
    v.extend_from_slice(name);
    v
}

fn root_item(l: &Layout, bytenr: u64, root_dirid: u64, uuid: [u8; 16], times: bool) -> RootItem {
    let mut r = RootItem::new_zeroed();
    // The root item's own inode is a directory stub, as every btrfs tool writes it.
    r.inode.generation = 1.into();
    r.inode.size = 3.into();
    r.inode.nlink = 1.into();
    r.inode.nbytes = u64::from(l.nodesize).into();
    r.inode.mode = (S_IFDIR | 0o755).into();
    r.generation = BOOTSTRAP_GENERATION.into();
    r.generation_v2 = BOOTSTRAP_GENERATION.into();
    r.root_dirid = root_dirid.into();
    r.bytenr = bytenr.into();
    r.bytes_used = u64::from(l.nodesize).into();
    r.refs = 1.into();
    r.uuid = uuid;
    if times {
        r.ctime = timespec(l.now);
        r.otime = timespec(l.now);
    }
    r
}

fn chunk_item(l: &Layout) -> Vec<u8> {
    let h = ChunkHeader {
        length: TEMP_CHUNK_LEN.into(),
        owner: EXTENT_TREE_OBJECTID.into(),
        stripe_len: STRIPE_LEN.into(),
        type_: BLOCK_GROUP_SYSTEM.into(),
        io_align: l.sectorsize.into(),
        io_width: l.sectorsize.into(),
        sector_size: l.sectorsize.into(),
        num_stripes: 1.into(),
        sub_stripes: 1.into(),
    };
    let mut v = h.as_bytes().to_vec();
    v.extend_from_slice(
        Stripe { devid: 1.into(), offset: TEMP_CHUNK_START.into(), dev_uuid: l.dev(1).uuid }
            .as_bytes(),
    );
    v
}

/// Device `devid`'s item: only device 1 has bytes allocated (the temporary chunk).
fn dev_item(l: &Layout, devid: u64) -> DevItem {
    let d = l.dev(devid);
    DevItem {
        devid: devid.into(),
        total_bytes: d.total_bytes.into(),
        bytes_used: if devid == 1 { TEMP_CHUNK_LEN } else { 0 }.into(),
        io_align: l.sectorsize.into(),
        io_width: l.sectorsize.into(),
        sector_size: l.sectorsize.into(),
        type_: 0.into(),
        generation: 0.into(),
        start_offset: 0.into(),
        dev_group: 0.into(),
        seek_speed: 0,
        bandwidth: 0,
        uuid: d.uuid,
        fsid: l.fsid,
    }
}

/// The items of tree `id`'s leaf, in key order.
fn tree_items(l: &Layout, id: u64) -> Vec<(Key, Vec<u8>)> {
    let ns = u64::from(l.nodesize);
    let mut items: Vec<(Key, Vec<u8>)> = Vec::new();
    let bg_item = || {
        (
            Key::new(TEMP_CHUNK_START, BLOCK_GROUP_ITEM_KEY, TEMP_CHUNK_LEN),
            BlockGroupItem {
                used: l.used().into(),
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(),
                flags: BLOCK_GROUP_SYSTEM.into(),
            }
            .as_bytes()
            .to_vec(),
        )
    };
    match id {
        ROOT_TREE_OBJECTID => {
            for t in l.trees() {
                if t == ROOT_TREE_OBJECTID || t == CHUNK_TREE_OBJECTID {
                    continue;
                }
                let (dirid, uuid, times) = match t {
                    FS_TREE_OBJECTID => (FIRST_FREE_OBJECTID, l.fs_tree_uuid, true),
                    DATA_RELOC_TREE_OBJECTID => (FIRST_FREE_OBJECTID, [0; 16], false),
                    _ => (0, [0; 16], false),
                };
                items.push((
                    Key::new(t, ROOT_ITEM_KEY, 0),
                    root_item(l, l.block_of(t), dirid, uuid, times).as_bytes().to_vec(),
                ));
            }
            // The root directory (objectid 6) and its `default` entry, which names the
            // subvolume mounted by default; mkfs.btrfs also gives the fs tree a ref
            // of that name from it.
            items.push((
                Key::new(FS_TREE_OBJECTID, INODE_REF_KEY, ROOT_TREE_DIR_OBJECTID),
                inode_ref(0, b"default"),
            ));
            items.push((
                Key::new(ROOT_TREE_DIR_OBJECTID, INODE_ITEM_KEY, 0),
                dir_inode(BOOTSTRAP_GENERATION, ns, l.now, true).as_bytes().to_vec(),
            ));
            items.push((
                Key::new(ROOT_TREE_DIR_OBJECTID, INODE_REF_KEY, ROOT_TREE_DIR_OBJECTID),
                inode_ref(0, b".."),
            ));
            let di = DirItem {
                location: Key::new(FS_TREE_OBJECTID, ROOT_ITEM_KEY, u64::MAX).to_disk(),
                transid: 0.into(),
                data_len: 0.into(),
                name_len: 7.into(),
                type_: FT_DIR,
            };
            let mut d = di.as_bytes().to_vec();
            d.extend_from_slice(b"default");
            items.push((
                Key::new(
                    ROOT_TREE_DIR_OBJECTID,
                    DIR_ITEM_KEY,
                    ubtrfs_format::hash::name_hash(b"default"),
                ),
                d,
            ));
        }
        EXTENT_TREE_OBJECTID => {
            for t in l.trees() {
                let mut v = ExtentItem {
                    refs: 1.into(),
                    generation: BOOTSTRAP_GENERATION.into(),
                    flags: EXTENT_FLAG_TREE_BLOCK.into(),
                }
                .as_bytes()
                .to_vec();
                v.push(TREE_BLOCK_REF_KEY);
                v.extend_from_slice(&t.to_le_bytes());
                items.push((Key::new(l.block_of(t), METADATA_ITEM_KEY, 0), v));
            }
            if !l.bg_tree() {
                items.push(bg_item());
            }
        }
        BLOCK_GROUP_TREE_OBJECTID => items.push(bg_item()),
        CHUNK_TREE_OBJECTID => {
            for devid in 1..=l.devices.len() as u64 {
                items.push((
                    Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid),
                    dev_item(l, devid).as_bytes().to_vec(),
                ));
            }
            items.push((
                Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, TEMP_CHUNK_START),
                chunk_item(l),
            ));
        }
        DEV_TREE_OBJECTID => {
            let de = DevExtent {
                chunk_tree: CHUNK_TREE_OBJECTID.into(),
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID.into(),
                chunk_offset: TEMP_CHUNK_START.into(),
                length: TEMP_CHUNK_LEN.into(),
                chunk_tree_uuid: l.chunk_tree_uuid,
            };
            items.push((Key::new(1, DEV_EXTENT_KEY, TEMP_CHUNK_START), de.as_bytes().to_vec()));
        }
        FS_TREE_OBJECTID | DATA_RELOC_TREE_OBJECTID => {
            // mkfs.btrfs counts the fs tree's root directory as one node of bytes.
            let fs = id == FS_TREE_OBJECTID;
            let ino = dir_inode(BOOTSTRAP_GENERATION, if fs { ns } else { 0 }, l.now, fs);
            items.push((Key::new(FIRST_FREE_OBJECTID, INODE_ITEM_KEY, 0), ino.as_bytes().to_vec()));
            items.push((
                Key::new(FIRST_FREE_OBJECTID, INODE_REF_KEY, FIRST_FREE_OBJECTID),
                inode_ref(0, b".."),
            ));
        }
        UUID_TREE_OBJECTID => {
            let u = l.fs_tree_uuid;
            let lo = u64::from_le_bytes(u[..8].try_into().expect("8 bytes"));
            let hi = u64::from_le_bytes(u[8..].try_into().expect("8 bytes"));
            items
                .push((Key::new(lo, UUID_KEY_SUBVOL, hi), FS_TREE_OBJECTID.to_le_bytes().to_vec()));
        }
        FREE_SPACE_TREE_OBJECTID => {
            items.push((
                Key::new(TEMP_CHUNK_START, FREE_SPACE_INFO_KEY, TEMP_CHUNK_LEN),
                FreeSpaceInfo { extent_count: 1.into(), flags: 0.into() }.as_bytes().to_vec(),
            ));
            let free = TEMP_CHUNK_START + l.used();
            items.push((
                Key::new(free, FREE_SPACE_EXTENT_KEY, TEMP_CHUNK_START + TEMP_CHUNK_LEN - free),
                Vec::new(),
            ));
        }
        CSUM_TREE_OBJECTID => {}
        _ => unreachable!("tree {id} is not bootstrapped"),
    }
    items.sort_by_key(|(k, _)| *k);
    for w in items.windows(2) {
        assert!(w[0].0 < w[1].0, "tree {id}: keys {} and {} out of order", w[0].0, w[1].0);
    }
    items
}

/// Build, checksum and check tree `id`'s leaf.
///
/// # Errors
/// `Corrupt` when the format crate's tree checker refuses the leaf (a bug here).
pub fn build_leaf(l: &Layout, id: u64) -> Result<Vec<u8>> {
    let bytenr = l.block_of(id);
    let mut buf = vec![0u8; l.nodesize as usize];
    {
        let mut m = NodeMut::new(&mut buf);
        let h = m.header_mut();
        h.fsid = l.fsid;
        h.bytenr = bytenr.into();
        h.flags = (HEADER_FLAG_WRITTEN | (MIXED_BACKREF_REV << BACKREF_REV_SHIFT)).into();
        h.chunk_tree_uuid = l.chunk_tree_uuid;
        h.generation = BOOTSTRAP_GENERATION.into();
        h.owner = id.into();
        h.level = 0;
        m.set_nritems(0);
        for (slot, (k, d)) in tree_items(l, id).into_iter().enumerate() {
            m.insert_item(slot, &k, d.len());
            m.item_data_mut(slot).copy_from_slice(&d);
        }
    }
    let c = l.csum.compute(&buf[CSUM_SIZE..]);
    buf[..CSUM_SIZE].copy_from_slice(&c);
    let ctx = CheckCtx {
        nodesize: l.nodesize,
        sectorsize: l.sectorsize,
        csum_type: l.csum,
        fsid: l.fsid,
        chunk_tree_uuid: Some(l.chunk_tree_uuid),
        super_generation: BOOTSTRAP_GENERATION,
        bytenr,
        level: Some(0),
        generation: Some(BOOTSTRAP_GENERATION),
        owner: Some(id),
        first_key: None,
    };
    check_tree_block(&buf, &ctx)
        .map_err(|e| Error::from(e).at(format!("mkfs bootstrap leaf of tree {id}")))?;
    debug_assert_eq!(NodeRef::new_checked(&buf).owner(), id);
    Ok(buf)
}

/// The bootstrap superblock of device `devid` (its `bytenr` and checksum are set per
/// mirror on write).
pub fn build_super(l: &Layout, devid: u64) -> Superblock {
    let mut sb = Superblock::new_zeroed();
    sb.fsid = l.fsid;
    sb.magic = MAGIC.into();
    sb.generation = BOOTSTRAP_GENERATION.into();
    sb.root = l.block_of(ROOT_TREE_OBJECTID).into();
    sb.chunk_root = l.block_of(CHUNK_TREE_OBJECTID).into();
    sb.total_bytes = l.total_bytes().into();
    sb.bytes_used = l.used().into();
    sb.root_dir_objectid = ROOT_TREE_DIR_OBJECTID.into();
    sb.num_devices = (l.devices.len() as u64).into();
    sb.sectorsize = l.sectorsize.into();
    sb.nodesize = l.nodesize.into();
    sb.leafsize = l.nodesize.into();
    sb.stripesize = l.sectorsize.into();
    let mut arr = Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, TEMP_CHUNK_START)
        .to_disk()
        .as_bytes()
        .to_vec();
    arr.extend_from_slice(&chunk_item(l));
    sb.sys_chunk_array[..arr.len()].copy_from_slice(&arr);
    sb.sys_chunk_array_size = (arr.len() as u32).into();
    sb.chunk_root_generation = BOOTSTRAP_GENERATION.into();
    sb.compat_ro_flags = l.compat_ro.into();
    sb.incompat_flags = l.incompat.into();
    sb.csum_type = l.csum.raw().into();
    sb.dev_item = dev_item(l, devid);
    sb.label[..l.label.len()].copy_from_slice(&l.label);
    sb
}

/// Write the bootstrap filesystem to `devs` (devid 1 first, one per
/// `Layout::devices`): on each, zero the first MiB (old signatures there go), the span
/// of the temporary chunk and the last MiB; write every leaf to device 1; flush; then
/// write every superblock mirror that fits on each device, and flush again.
///
/// # Errors
/// `Io` from a device; `Corrupt` if a leaf or a superblock fails its checker (nothing
/// is written then).
pub fn write(devs: &[&dyn BlockDevice], l: &Layout) -> Result<()> {
    assert_eq!(devs.len(), l.devices.len(), "devices given and devices laid out differ");
    assert!(
        l.dev(1).total_bytes >= TEMP_CHUNK_START + TEMP_CHUNK_LEN,
        "device 1 of {} bytes cannot hold the bootstrap chunk",
        l.dev(1).total_bytes
    );
    let leaves: Vec<(u64, Vec<u8>)> = l
        .trees()
        .into_iter()
        .map(|id| build_leaf(l, id).map(|b| (l.block_of(id), b)))
        .collect::<Result<_>>()?;
    let mut supers = Vec::new();
    for (i, dev) in devs.iter().enumerate() {
        let devid = i as u64 + 1;
        let total = l.dev(devid).total_bytes;
        assert!(
            dev.size() >= total,
            "device {} of {} bytes is smaller than its part of the filesystem ({total} bytes)",
            dev.name(),
            dev.size()
        );
        let mut sb = build_super(l, devid);
        for mirror in 0..SUPER_MIRROR_MAX {
            let off = sb_offset(mirror);
            if off + SUPER_INFO_SIZE as u64 > dev.size() {
                break;
            }
            sb.bytenr = off.into();
            let c = l.csum.compute(&sb.as_bytes()[CSUM_SIZE..]);
            sb.csum.copy_from_slice(&c);
            ubtrfs_format::superblock::check_super(sb.as_bytes(), off).map_err(|e| {
                Error::from(e)
                    .at(format!("mkfs bootstrap superblock of devid {devid} mirror {mirror}"))
            })?;
            supers.push((i, off, sb));
        }
    }
    for (i, dev) in devs.iter().enumerate() {
        let total = l.devices[i].total_bytes;
        // Zeroed as holes in an image file (no host space), with zeros on a device.
        dev.zero_range(0, (TEMP_CHUNK_START + TEMP_CHUNK_LEN).min(total))?;
        // The last MiB too, where a GPT keeps its backup header (mkfs.btrfs zeroes the
        // end as well); what lies between is never read before it is written.
        let tail = total.saturating_sub(1 << 20);
        if tail >= TEMP_CHUNK_START + TEMP_CHUNK_LEN {
            dev.zero_range(tail, total - tail)?;
        }
    }
    for (bytenr, leaf) in &leaves {
        devs[0].write_at(leaf, *bytenr)?;
    }
    for dev in devs {
        dev.flush()?;
    }
    for (i, off, sb) in &supers {
        devs[*i].write_at(sb.as_bytes(), *off)?;
    }
    for dev in devs {
        dev.flush()?;
    }
    Ok(())
}
