//! Parsers for item bodies, including the variable-length ones (dir entries, inode
//! refs, extent inline refs, chunk stripes, root refs, file extents).
//!
//! Each parser is total: given any bytes it returns a value or a reason string; the tree
//! checker turns reasons into `Corrupt` errors with the block and slot attached.

use crate::key::*;
use crate::structs::*;
use zerocopy::FromBytes;

pub type ParseResult<T> = core::result::Result<T, String>;

/// Read a fixed-size struct from the front of `data`.
pub fn read_prefix<'a, T: FromBytes + zerocopy::KnownLayout + zerocopy::Immutable>(data: &'a [u8], what: &str) -> ParseResult<&'a T> {
    T::ref_from_prefix(data).map(|(t, _)| t).map_err(|_| format!("invalid {what} size, have {} expect at least {}", data.len(), core::mem::size_of::<T>()))
}

/// One entry of a DIR_ITEM, DIR_INDEX or XATTR_ITEM.
#[derive(Clone, Copy, Debug)]
pub struct DirEntry<'a> {
    pub location: Key,
    pub transid: u64,
    pub type_: u8,
    pub name: &'a [u8],
    pub data: &'a [u8],
}

/// Iterate the packed entries of a DIR_ITEM / DIR_INDEX / XATTR_ITEM body.
pub fn dir_entries(data: &[u8]) -> impl Iterator<Item = ParseResult<DirEntry<'_>>> {
    let mut rest = data;
    let mut failed = false;
    core::iter::from_fn(move || {
        if rest.is_empty() || failed {
            return None;
        }
        let r = (|| {
            let di: &DirItem = read_prefix(rest, "dir item")?;
            let hdr = core::mem::size_of::<DirItem>();
            let name_len = di.name_len.get() as usize;
            let data_len = di.data_len.get() as usize;
            let total = hdr + name_len + data_len;
            if total > rest.len() {
                return Err(format!("invalid dir item name or data len, name_len={name_len} data_len={data_len} item left={}", rest.len()));
            }
            let e = DirEntry { location: Key::from(&di.location), transid: di.transid.get(), type_: di.type_, name: &rest[hdr..hdr + name_len], data: &rest[hdr + name_len..total] };
            rest = &rest[total..];
            Ok(e)
        })();
        failed = r.is_err();
        Some(r)
    })
}

/// One name of an INODE_REF or INODE_EXTREF.
#[derive(Clone, Copy, Debug)]
pub struct InodeName<'a> {
    pub parent: u64,
    pub index: u64,
    pub name: &'a [u8],
}

/// Iterate INODE_REF entries; `parent` comes from the key offset.
pub fn inode_refs(data: &[u8], parent: u64) -> impl Iterator<Item = ParseResult<InodeName<'_>>> {
    let mut rest = data;
    let mut failed = false;
    core::iter::from_fn(move || {
        if rest.is_empty() || failed {
            return None;
        }
        let r = (|| {
            let ir: &InodeRef = read_prefix(rest, "inode ref")?;
            let hdr = core::mem::size_of::<InodeRef>();
            let n = ir.name_len.get() as usize;
            if hdr + n > rest.len() {
                return Err(format!("invalid inode ref name len {n}, item left {}", rest.len()));
            }
            let e = InodeName { parent, index: ir.index.get(), name: &rest[hdr..hdr + n] };
            rest = &rest[hdr + n..];
            Ok(e)
        })();
        failed = r.is_err();
        Some(r)
    })
}

/// Iterate INODE_EXTREF entries.
pub fn inode_extrefs(data: &[u8]) -> impl Iterator<Item = ParseResult<InodeName<'_>>> {
    let mut rest = data;
    let mut failed = false;
    core::iter::from_fn(move || {
        if rest.is_empty() || failed {
            return None;
        }
        let r = (|| {
            let er: &InodeExtref = read_prefix(rest, "inode extref")?;
            let hdr = core::mem::size_of::<InodeExtref>();
            let n = er.name_len.get() as usize;
            if hdr + n > rest.len() {
                return Err(format!("invalid inode extref name len {n}, item left {}", rest.len()));
            }
            let e = InodeName { parent: er.parent_objectid.get(), index: er.index.get(), name: &rest[hdr..hdr + n] };
            rest = &rest[hdr + n..];
            Ok(e)
        })();
        failed = r.is_err();
        Some(r)
    })
}

/// A ROOT_REF / ROOT_BACKREF body.
#[derive(Clone, Copy, Debug)]
pub struct RootRefEntry<'a> {
    pub dirid: u64,
    pub sequence: u64,
    pub name: &'a [u8],
}

pub fn root_ref(data: &[u8]) -> ParseResult<RootRefEntry<'_>> {
    let rr: &RootRef = read_prefix(data, "root ref")?;
    let hdr = core::mem::size_of::<RootRef>();
    let n = rr.name_len.get() as usize;
    if hdr + n != data.len() {
        return Err(format!("invalid root ref name len {n}, item size {}", data.len()));
    }
    Ok(RootRefEntry { dirid: rr.dirid.get(), sequence: rr.sequence.get(), name: &data[hdr..] })
}

/// A parsed ROOT_ITEM, accepting the old 239-byte form (v2 fields then read as zero).
#[derive(Clone, Copy)]
pub struct RootItemView {
    pub item: RootItem,
    /// True when generation_v2 matches generation, i.e. the v2 fields are valid.
    pub v2_valid: bool,
}

pub fn root_item(data: &[u8]) -> ParseResult<RootItemView> {
    let full = core::mem::size_of::<RootItem>();
    if data.len() != full && data.len() != ROOT_ITEM_V1_SIZE {
        return Err(format!("invalid root item size, have {} expect {} or {}", data.len(), ROOT_ITEM_V1_SIZE, full));
    }
    let mut buf = [0u8; core::mem::size_of::<RootItem>()];
    buf[..data.len()].copy_from_slice(data);
    let item = RootItem::read_from_bytes(&buf).expect("buffer has the exact size");
    let v2_valid = item.generation_v2.get() == item.generation.get();
    Ok(RootItemView { item, v2_valid })
}

/// A chunk: its header and stripes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkView {
    pub length: u64,
    pub owner: u64,
    pub stripe_len: u64,
    pub type_: u64,
    pub io_align: u32,
    pub io_width: u32,
    pub sector_size: u32,
    pub sub_stripes: u16,
    pub stripes: Vec<(u64, u64, [u8; UUID_SIZE])>,
}

/// Byte size of a chunk item with `num_stripes` stripes (48 + 32 n).
pub fn chunk_item_size(num_stripes: usize) -> usize {
    core::mem::size_of::<ChunkHeader>() + num_stripes * core::mem::size_of::<Stripe>()
}

/// Parse a chunk item from the front of `data`; returns the chunk and the bytes used.
/// Structural checks only (counts and sizes); `tree_checker::check_chunk` checks values.
pub fn chunk(data: &[u8]) -> ParseResult<(ChunkView, usize)> {
    let ch: &ChunkHeader = read_prefix(data, "chunk item")?;
    let n = ch.num_stripes.get() as usize;
    if n == 0 {
        return Err("invalid chunk num_stripes, have 0".to_string());
    }
    // btrfs_chunk embeds the first stripe; its 48-byte header here excludes it.
    let size = core::mem::size_of::<ChunkHeader>() + n * core::mem::size_of::<Stripe>();
    if data.len() < size {
        return Err(format!("invalid chunk item size, have {} expect {} for {} stripes", data.len(), size, n));
    }
    let mut stripes = Vec::with_capacity(n);
    for i in 0..n {
        let off = core::mem::size_of::<ChunkHeader>() + i * core::mem::size_of::<Stripe>();
        let s = Stripe::ref_from_prefix(&data[off..]).expect("size checked above").0;
        stripes.push((s.devid.get(), s.offset.get(), s.dev_uuid));
    }
    Ok((
        ChunkView {
            length: ch.length.get(),
            owner: ch.owner.get(),
            stripe_len: ch.stripe_len.get(),
            type_: ch.type_.get(),
            io_align: ch.io_align.get(),
            io_width: ch.io_width.get(),
            sector_size: ch.sector_size.get(),
            sub_stripes: ch.sub_stripes.get(),
            stripes,
        },
        size,
    ))
}

/// A file extent item, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileExtent<'a> {
    Inline {
        generation: u64,
        ram_bytes: u64,
        compression: u8,
        data: &'a [u8],
    },
    /// REG or PREALLOC; `disk_bytenr == 0` is an explicit hole.
    Regular {
        generation: u64,
        ram_bytes: u64,
        compression: u8,
        prealloc: bool,
        disk_bytenr: u64,
        disk_num_bytes: u64,
        offset: u64,
        num_bytes: u64,
    },
}

/// The `flags` of a QGROUP_STATUS item (32 bytes, or 40 with simple quotas).
pub fn qgroup_status_flags(data: &[u8]) -> ParseResult<u64> {
    if data.len() < QGROUP_STATUS_SIZE_V1 {
        return Err(format!("qgroup status item of {} bytes, expect at least {QGROUP_STATUS_SIZE_V1}", data.len()));
    }
    Ok(u64::from_le_bytes(data[16..24].try_into().expect("8 bytes")))
}

pub fn file_extent(data: &[u8]) -> ParseResult<FileExtent<'_>> {
    let h: &FileExtentHeader = read_prefix(data, "file extent")?;
    // As check_extent_data_item: encryption must be 0; other_encoding is never read.
    if h.encryption != 0 {
        return Err(format!("invalid encryption for file extent, have {} expect 0", h.encryption));
    }
    match h.type_ {
        FILE_EXTENT_INLINE => Ok(FileExtent::Inline { generation: h.generation.get(), ram_bytes: h.ram_bytes.get(), compression: h.compression, data: &data[FILE_EXTENT_INLINE_DATA_START..] }),
        FILE_EXTENT_REG | FILE_EXTENT_PREALLOC => {
            if data.len() != FILE_EXTENT_REG_SIZE {
                return Err(format!("invalid file extent item size, have {} expect {}", data.len(), FILE_EXTENT_REG_SIZE));
            }
            let b = FileExtentBody::ref_from_bytes(&data[FILE_EXTENT_INLINE_DATA_START..]).expect("size checked");
            Ok(FileExtent::Regular {
                generation: h.generation.get(),
                ram_bytes: h.ram_bytes.get(),
                compression: h.compression,
                prealloc: h.type_ == FILE_EXTENT_PREALLOC,
                disk_bytenr: b.disk_bytenr.get(),
                disk_num_bytes: b.disk_num_bytes.get(),
                offset: b.offset.get(),
                num_bytes: b.num_bytes.get(),
            })
        }
        t => Err(format!("invalid file extent type {t}")),
    }
}

/// The two parts of a REG/PREALLOC file extent item (`FILE_EXTENT_REG_SIZE` bytes), for
/// editing an item in place; `None` for any other size (an inline extent).
pub fn file_extent_reg_mut(data: &mut [u8]) -> Option<(&mut FileExtentHeader, &mut FileExtentBody)> {
    if data.len() != FILE_EXTENT_REG_SIZE {
        return None;
    }
    let (h, b) = data.split_at_mut(FILE_EXTENT_INLINE_DATA_START);
    Some((FileExtentHeader::mut_from_bytes(h).expect("header size"), FileExtentBody::mut_from_bytes(b).expect("body size")))
}

/// A REG or PREALLOC file extent item from its parts.
pub fn file_extent_reg_item(h: &FileExtentHeader, b: &FileExtentBody) -> Vec<u8> {
    use zerocopy::IntoBytes;
    let mut d = Vec::with_capacity(FILE_EXTENT_REG_SIZE);
    d.extend_from_slice(h.as_bytes());
    d.extend_from_slice(b.as_bytes());
    d
}

/// One inline backref of an EXTENT_ITEM / METADATA_ITEM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InlineRef {
    TreeBlock { root: u64 },
    SharedBlock { parent: u64 },
    ExtentData { root: u64, objectid: u64, offset: u64, count: u32 },
    SharedData { parent: u64, count: u32 },
    Owner { root: u64 },
}

impl InlineRef {
    pub fn type_(&self) -> u8 {
        match self {
            InlineRef::TreeBlock { .. } => TREE_BLOCK_REF_KEY,
            InlineRef::SharedBlock { .. } => SHARED_BLOCK_REF_KEY,
            InlineRef::ExtentData { .. } => EXTENT_DATA_REF_KEY,
            InlineRef::SharedData { .. } => SHARED_DATA_REF_KEY,
            InlineRef::Owner { .. } => EXTENT_OWNER_REF_KEY,
        }
    }
    /// The count this ref contributes to `refs`.
    pub fn count(&self) -> u64 {
        match self {
            InlineRef::ExtentData { count, .. } | InlineRef::SharedData { count, .. } => u64::from(*count),
            InlineRef::Owner { .. } => 0,
            _ => 1,
        }
    }
}

/// A parsed extent item: header, optional tree_block_info, inline refs.
#[derive(Clone, Debug)]
pub struct ExtentItemView {
    pub refs: u64,
    pub generation: u64,
    pub flags: u64,
    pub tree_block_info: Option<(Key, u8)>,
    pub inline_refs: Vec<InlineRef>,
}

/// Parse an EXTENT_ITEM (`skinny == false`) or METADATA_ITEM (`skinny == true`) body.
pub fn extent_item(data: &[u8], skinny: bool) -> ParseResult<ExtentItemView> {
    let ei: &ExtentItem = read_prefix(data, "extent item")?;
    let flags = ei.flags.get();
    let mut pos = core::mem::size_of::<ExtentItem>();
    let mut tbi = None;
    if flags & EXTENT_FLAG_TREE_BLOCK != 0 && !skinny {
        let info: &TreeBlockInfo = read_prefix(&data[pos..], "tree block info")?;
        tbi = Some((Key::from(&info.key), info.level));
        pos += core::mem::size_of::<TreeBlockInfo>();
    }
    let mut refs = Vec::new();
    while pos < data.len() {
        let t = data[pos];
        pos += 1;
        let rest = &data[pos..];
        let need = |n: usize| -> ParseResult<()> {
            if rest.len() < n {
                Err(format!("invalid inline ref type {t} at {}: need {n} bytes, have {}", pos - 1, rest.len()))
            } else {
                Ok(())
            }
        };
        let le64 = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let r = match t {
            TREE_BLOCK_REF_KEY => {
                need(8)?;
                pos += 8;
                InlineRef::TreeBlock { root: le64(rest) }
            }
            SHARED_BLOCK_REF_KEY => {
                need(8)?;
                pos += 8;
                InlineRef::SharedBlock { parent: le64(rest) }
            }
            EXTENT_OWNER_REF_KEY => {
                need(8)?;
                pos += 8;
                InlineRef::Owner { root: le64(rest) }
            }
            EXTENT_DATA_REF_KEY => {
                need(28)?;
                pos += 28;
                let d = ExtentDataRef::ref_from_prefix(rest).expect("length checked").0;
                InlineRef::ExtentData { root: d.root.get(), objectid: d.objectid.get(), offset: d.offset.get(), count: d.count.get() }
            }
            SHARED_DATA_REF_KEY => {
                need(12)?;
                pos += 12;
                InlineRef::SharedData { parent: le64(rest), count: u32::from_le_bytes(rest[8..12].try_into().expect("4 bytes")) }
            }
            _ => return Err(format!("invalid inline ref type {t}")),
        };
        refs.push(r);
    }
    Ok(ExtentItemView { refs: ei.refs.get(), generation: ei.generation.get(), flags, tree_block_info: tbi, inline_refs: refs })
}

/// Iterate the UUID tree item's u64 subvolume ids.
pub fn uuid_item_ids(data: &[u8]) -> ParseResult<Vec<u64>> {
    if !data.len().is_multiple_of(8) {
        return Err(format!("invalid uuid item size {}, not a multiple of 8", data.len()));
    }
    Ok(data.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
}

/// Format a uuid as 8-4-4-4-12 hex.
pub fn uuid_str(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{}-{}-{}-{}", h[0..4].concat(), h[4..6].concat(), h[6..8].concat(), h[8..10].concat(), h[10..16].concat())
}
