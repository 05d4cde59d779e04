//! Reading file data: inline, regular, prealloc, holes (explicit and no-holes) and
//! compressed extents, with every sector's data checksum verified against the csum tree.
//! A bad sector is re-read from the other copies; if none is good the error names the
//! inode, file offset and logical address.
//!
//! Neighbours: `fs` (extent lists), `compression` (codecs), `volumes` (mirrors).

use crate::compression::{CompressionType, MAX_RAM_BYTES};
use crate::error::{Error, Result};
use crate::ids::Logical;
use crate::inode::filesystem::{ExtentKind, FileExtentRec, FsRead, InodeView};

use ubtrfs_format::key::*;
use ubtrfs_format::structs::INODE_NODATASUM;
use ubtrfs_format::{Corrupt, CorruptWhere, Key};

/// Checksums for a run of sectors: `csums[i*size..]` is valid where `present[i]`.
pub struct CsumRun {
    pub csums: Vec<u8>,
    pub present: Vec<bool>,
}

/// A sector that no copy could make match its checksum.
pub(crate) struct BadSector {
    /// Index of the sector in the buffer.
    pub index: usize,
    /// What the sector (as first read) hashes to, and what the csum tree wants.
    pub got: Vec<u8>,
    pub want: Vec<u8>,
    pub copies: usize,
}

/// Verify `buf`, read from copy `first` at `logical`, sector by sector against
/// `want(i)` (None: no checksum for sector i, counted and skipped). A mismatching
/// sector is re-read from each other copy and replaced by the first that matches;
/// `repaired(i, good_copy)` hears of each. Returns the number of sectors without a
/// checksum, or the first sector no copy could fix.
pub(crate) fn verify_sectors<'a>(
    info: &crate::disk_io::FsInfo,
    logical: u64,
    buf: &mut [u8],
    first: usize,
    want: impl Fn(usize) -> Option<&'a [u8]>,
    mut repaired: impl FnMut(usize, usize),
) -> std::result::Result<usize, BadSector> {
    let ss = info.sectorsize as usize;
    let ct = info.csum_type;
    let copies = info.num_copies(Logical(logical));
    let mut missing = 0;
    for (i, sector) in buf.chunks_mut(ss).enumerate() {
        let Some(want) = want(i) else {
            missing += 1;
            continue;
        };
        if ct.verify(sector, want) {
            continue;
        }
        let slog = logical + (i * ss) as u64;
        let mut alt = vec![0u8; sector.len()];
        let good = (0..copies)
            .filter(|&m| m != first)
            .find(|&m| info.read_data(Logical(slog), &mut alt, m).is_ok() && ct.verify(&alt, want));
        match good {
            Some(m) => {
                sector.copy_from_slice(&alt);
                repaired(i, m);
            }
            None => {
                return Err(BadSector {
                    index: i,
                    got: ct.compute(sector)[..want.len()].to_vec(),
                    want: want.to_vec(),
                    copies,
                })
            }
        }
    }
    Ok(missing)
}

/// Look up the data checksums of `[logical, logical + len)` (sector aligned).
///
/// # Errors
/// `Corrupt`/`Io` from the csum tree.
pub(crate) fn lookup_csums<V: FileRead>(fs: &V, logical: u64, len: u64) -> Result<CsumRun> {
    let ss = u64::from(fs.info().sectorsize);
    let cs = fs.info().csum_type.size();
    assert!(
        logical.is_multiple_of(ss) && len.is_multiple_of(ss),
        "unaligned csum lookup {logical} +{len}"
    );
    let n = (len / ss) as usize;
    let mut run = CsumRun { csums: vec![0u8; n * cs], present: vec![false; n] };
    let root = fs.fs_root(CSUM_TREE_OBJECTID)?;
    let end = logical + len;
    let start_key = Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, logical);
    // The item covering `logical` may start before it.
    let first = fs.search_le(&root, &start_key)?;
    let mut from = start_key;
    if let Some(item) = first {
        let k = item.key();
        if k.objectid == EXTENT_CSUM_OBJECTID && k.type_ == EXTENT_CSUM_KEY {
            from = k;
        }
    }
    let mut it = fs.iter(&root, from)?;
    while let Some(item) = it.next_item()? {
        let k = item.key();
        if k.objectid != EXTENT_CSUM_OBJECTID || k.type_ != EXTENT_CSUM_KEY || k.offset >= end {
            break;
        }
        let data = item.data();
        let count = (data.len() / cs) as u64;
        let istart = k.offset;
        let iend = istart.saturating_add(count * ss);
        if iend <= logical {
            continue;
        }
        let lo = istart.max(logical);
        let hi = iend.min(end);
        let mut a = lo;
        while a < hi {
            let src = ((a - istart) / ss) as usize * cs;
            let dst = ((a - logical) / ss) as usize;
            run.csums[dst * cs..dst * cs + cs].copy_from_slice(&data[src..src + cs]);
            run.present[dst] = true;
            a += ss;
        }
    }
    Ok(run)
}

/// Read `buf.len()` bytes of data at `logical` (sector aligned) and verify every
/// sector, falling back to other copies sector by sector.
///
/// # Errors
/// `Corrupt` (data) naming ino, file offset and logical when no copy is good.
pub(crate) fn read_verified<V: FileRead>(
    fs: &V,
    inode: &InodeView,
    file_offset: u64,
    logical: u64,
    buf: &mut [u8],
) -> Result<()> {
    let ss = fs.info().sectorsize as usize;
    let copies = fs.info().num_copies(Logical(logical));
    // A copy on a missing or failing device is skipped for the next one.
    let mut first = 0;
    loop {
        match fs.info().read_data(Logical(logical), buf, first) {
            Ok(()) => break,
            Err(e) if first + 1 < copies => {
                fs.info().warn(format!("data at logical {logical} (ino {} offset {file_offset}): copy {} unreadable ({e}); trying copy {}", inode.id.ino, first + 1, first + 2));
                first += 1;
            }
            Err(e) => return Err(e),
        }
    }
    if inode.flags() & INODE_NODATASUM != 0 {
        return Ok(());
    }
    let run = fs.lookup_csums(logical, buf.len() as u64)?;
    let cs = fs.info().csum_type.size();
    let want = |i: usize| run.present[i].then(|| &run.csums[i * cs..(i + 1) * cs]);
    let repaired = |i: usize, m: usize| {
        fs.info().warn(format!(
            "data csum mismatch at logical {} (ino {} offset {}): copy {} is bad, read copy {}",
            logical + (i * ss) as u64,
            inode.id.ino,
            file_offset + (i * ss) as u64,
            first + 1,
            m + 1
        ))
    };
    let missing =
        verify_sectors(fs.info(), logical, buf, first, want, repaired).map_err(|b| -> Error {
            Corrupt::new(
                CorruptWhere::Data,
                format!(
                    "csum mismatch: have {} expect {} ({} copies tried)",
                    hex(&b.got),
                    hex(&b.want),
                    b.copies
                ),
            )
            .root(inode.id.root)
            .data(
                inode.id.ino,
                file_offset + (b.index * ss) as u64,
                logical + (b.index * ss) as u64,
            )
            .into()
        })?;
    if missing > 0 {
        fs.info().warn(format!("ino {} root {}: {missing} sectors at logical {logical} have no data checksum; read unverified", inode.id.ino, inode.id.root));
    }
    Ok(())
}

/// Read file data at `offset` into `buf`; returns the bytes read (short at EOF).
///
/// # Errors
/// `Io`/`Corrupt` from the extent read, decompression or checksum.
pub(crate) fn read_at<V: FileRead>(
    fs: &V,
    inode: &InodeView,
    offset: u64,
    buf: &mut [u8],
) -> Result<usize> {
    let mut cache = DecompressCache::default();
    read_at_cached(fs, inode, offset, buf, &mut cache)
}

/// `read_at` with a caller-held cache of the last decompressed extent, so sequential
/// reads of a compressed file decompress each extent once.
///
/// # Errors
/// As `read_at`.
pub(crate) fn read_at_cached<V: FileRead>(
    fs: &V,
    inode: &InodeView,
    offset: u64,
    buf: &mut [u8],
    cache: &mut DecompressCache,
) -> Result<usize> {
    let size = inode.size();
    if offset >= size {
        return Ok(0);
    }
    let want = (buf.len() as u64).min(size - offset) as usize;
    let buf = &mut buf[..want];
    let exts = &inode.extents;
    // First extent that ends after `offset`.
    let mut idx = exts.partition_point(|e| e.end() <= offset);
    let mut pos = offset;
    let end = offset + want as u64;
    while pos < end {
        let out_off = (pos - offset) as usize;
        let Some(e) = exts.get(idx).filter(|e| e.file_offset < end) else {
            buf[out_off..].fill(0);
            break;
        };
        if e.file_offset > pos {
            // A hole with no item (no-holes), up to the next extent.
            let gap = (e.file_offset.min(end) - pos) as usize;
            buf[out_off..out_off + gap].fill(0);
            pos += gap as u64;
            continue;
        }
        let n = (e.end().min(end) - pos) as usize;
        read_extent_piece(fs, inode, e, pos, &mut buf[out_off..out_off + n], cache)?;
        pos += n as u64;
        idx += 1;
    }
    Ok(want)
}

/// The disk range `len` bytes at `within` of a plain extent map to (`disk_bytenr` +
/// the extent's `offset` + `within`), as (start rounded down to a sector, exact start,
/// end rounded up to a sector); `None` when the sum overflows (the tree checker bounds
/// each field, not their sum, so a hostile extent can).
fn plain_disk_span(
    disk_bytenr: u64,
    offset: u64,
    within: u64,
    len: u64,
    ss: u64,
) -> Option<(u64, u64, u64)> {
    let logical = disk_bytenr.checked_add(offset)?.checked_add(within)?;
    let end = logical.checked_add(len)?.div_ceil(ss).checked_mul(ss)?;
    Some((logical - logical % ss, logical, end))
}

pub(crate) fn read_extent_piece<V: FileRead>(
    fs: &V,
    inode: &InodeView,
    e: &FileExtentRec,
    pos: u64,
    out: &mut [u8],
    cache: &mut DecompressCache,
) -> Result<()> {
    let within = pos - e.file_offset;
    match &e.kind {
        ExtentKind::Inline { ram_bytes, compression, data } => {
            let plain: std::borrow::Cow<'_, [u8]> = if *compression == 0 {
                std::borrow::Cow::Borrowed(data)
            } else {
                let mut v = Vec::new();
                decompress_for(
                    fs,
                    inode,
                    e.file_offset,
                    0,
                    *compression,
                    data,
                    *ram_bytes as usize,
                    &mut v,
                )?;
                std::borrow::Cow::Owned(v)
            };
            let s = within as usize;
            let avail = plain.len().saturating_sub(s).min(out.len());
            out[..avail].copy_from_slice(&plain[s..s + avail]);
            out[avail..].fill(0);
        }
        ExtentKind::Regular { disk_bytenr: 0, .. } | ExtentKind::Regular { prealloc: true, .. } => {
            out.fill(0)
        }
        ExtentKind::Regular {
            disk_bytenr,
            disk_num_bytes,
            offset,
            ram_bytes,
            compression: 0,
            ..
        } => {
            let _ = (disk_num_bytes, ram_bytes);
            let ss = u64::from(fs.info().sectorsize);
            // The tree checker bounds each field, not their sum: a hostile extent can
            // overflow the address space here.
            let Some((a_start, logical, a_end)) =
                plain_disk_span(*disk_bytenr, *offset, within, out.len() as u64, ss)
            else {
                return Err(extent_corrupt(
                    inode,
                    e,
                    format!(
                        "extent disk_bytenr {disk_bytenr} + offset {offset} + {within} overflows"
                    ),
                ));
            };
            let fo = pos - (logical - a_start);
            if a_start == logical && a_end == logical + out.len() as u64 {
                read_verified(fs, inode, fo, a_start, out)?;
            } else {
                let mut tmp = vec![0u8; (a_end - a_start) as usize];
                read_verified(fs, inode, fo, a_start, &mut tmp)?;
                let s = (logical - a_start) as usize;
                out.copy_from_slice(&tmp[s..s + out.len()]);
            }
        }
        ExtentKind::Regular {
            disk_bytenr, disk_num_bytes, offset, ram_bytes, compression, ..
        } => {
            if cache.disk_bytenr != *disk_bytenr || cache.data.is_empty() && *ram_bytes != 0 {
                // Bound the read before allocating for it: btrfs compresses at most
                // 128 KiB per extent; allow the decompressor's tolerance.
                if *disk_num_bytes > MAX_RAM_BYTES as u64 {
                    return Err(extent_corrupt(inode, e, format!("compressed extent disk_num_bytes {disk_num_bytes} exceeds {MAX_RAM_BYTES}")));
                }
                let mut raw = vec![0u8; *disk_num_bytes as usize];
                read_verified(fs, inode, e.file_offset, *disk_bytenr, &mut raw)?;
                // The common case of a sequential reader: the whole extent lands in
                // `out`, so decode straight into it instead of through the cache.
                if *offset == 0
                    && within == 0
                    && out.len() as u64 == *ram_bytes
                    && e.len() == *ram_bytes
                {
                    let kind = CompressionType::from_raw(*compression).ok_or_else(|| {
                        extent_corrupt(inode, e, format!("unknown compression type {compression}"))
                    })?;
                    crate::compression::decompress_into(
                        kind,
                        &raw,
                        out,
                        fs.info().sectorsize as usize,
                    )
                    .map_err(|err| {
                        extent_corrupt(
                            inode,
                            e,
                            format!("{} decompression failed: {err}", kind.name()),
                        )
                    })?;
                    return Ok(());
                }
                let mut plain = Vec::new();
                decompress_for(
                    fs,
                    inode,
                    e.file_offset,
                    *disk_bytenr,
                    *compression,
                    &raw,
                    *ram_bytes as usize,
                    &mut plain,
                )?;
                cache.disk_bytenr = *disk_bytenr;
                cache.data = plain;
            }
            let len = cache.data.len();
            let Some(s) = offset
                .checked_add(within)
                .and_then(|s| usize::try_from(s).ok())
                .filter(|&s| s <= len)
            else {
                return Err(extent_corrupt(inode, e, format!("compressed extent offset {offset} + {within} is beyond its {len} decompressed bytes")));
            };
            let avail = len.saturating_sub(s).min(out.len());
            out[..avail].copy_from_slice(&cache.data[s..s + avail]);
            out[avail..].fill(0);
        }
    }
    Ok(())
}

fn extent_corrupt(inode: &InodeView, e: &FileExtentRec, reason: String) -> Error {
    let mut c = Corrupt::new(CorruptWhere::Item, reason).root(inode.id.root);
    c.key = Some(Key::new(inode.id.ino, EXTENT_DATA_KEY, e.file_offset));
    c.ino = Some(inode.id.ino);
    c.into()
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn decompress_for<V: FileRead>(
    fs: &V,
    inode: &InodeView,
    file_offset: u64,
    logical: u64,
    compression: u8,
    input: &[u8],
    ram_bytes: usize,
    out: &mut Vec<u8>,
) -> Result<()> {
    let corrupt = |r: String| -> Error {
        Corrupt::new(CorruptWhere::Data, r)
            .root(inode.id.root)
            .data(inode.id.ino, file_offset, logical)
            .into()
    };
    crate::compression::decompress_item(
        compression,
        input,
        ram_bytes,
        fs.info().sectorsize as usize,
        out,
    )
    .map_err(corrupt)
}

/// The last decompressed extent of a sequential reader.
#[derive(Default)]
pub struct DecompressCache {
    disk_bytenr: u64,
    data: Vec<u8>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The data checksums a read of `[offset, end)` of `inode` will ask for, looked up now
/// (under the engine's lock) so the data can be read and verified without it
/// (`DataView`). One run per extent piece: the sector-aligned disk range of the bytes
/// read, or the whole extent when it is compressed. Extents a read would refuse as
/// corrupt are left out; the read then reports them itself.
///
/// # Errors
/// `Corrupt`/`Io` from the csum tree.
pub(crate) fn prefetch_csums<V: FileRead>(
    fs: &V,
    inode: &InodeView,
    offset: u64,
    end: u64,
) -> Result<Vec<(u64, CsumRun)>> {
    let mut out = Vec::new();
    if inode.flags() & INODE_NODATASUM != 0 {
        return Ok(out);
    }
    let ss = u64::from(fs.info().sectorsize);
    let end = end.min(inode.size());
    for e in inode.extents.iter().filter(|e| e.end() > offset && e.file_offset < end) {
        let ExtentKind::Regular {
            disk_bytenr,
            disk_num_bytes,
            offset: eoff,
            compression,
            prealloc: false,
            ..
        } = e.kind
        else {
            continue;
        };
        if disk_bytenr == 0 {
            continue;
        }
        let range = if compression != 0 {
            (disk_num_bytes <= MAX_RAM_BYTES as u64)
                .then(|| disk_bytenr.checked_add(disk_num_bytes).map(|b| (disk_bytenr, b)))
                .flatten()
        } else {
            let lo = offset.max(e.file_offset) - e.file_offset;
            let hi = end.min(e.end()) - e.file_offset;
            plain_disk_span(disk_bytenr, eoff, lo, hi - lo, ss).map(|(a, _, b)| (a, b))
        };
        if let Some((a, b)) = range {
            if a % ss == 0 && b > a && b % ss == 0 {
                out.push((a, fs.lookup_csums(a, b - a)?));
            }
        }
    }
    Ok(out)
}

/// A view for reading file data without the engine's lock: the devices through the
/// shared `FsInfo`, and the data checksums looked up beforehand (`prefetch_csums`). It
/// reads no tree block; anything that needs one is a bug in the caller.
pub(crate) struct DataView<'a> {
    pub(crate) info: &'a crate::disk_io::FsInfo,
    pub(crate) default_subvol: u64,
    pub(crate) csums: Vec<(u64, CsumRun)>,
}

fn detached(what: String) -> Error {
    Error::posix_detail(
        crate::error::PosixKind::Invalid,
        "data read",
        format!("{what}: a read without the engine's lock reads no tree blocks"),
    )
}

impl crate::tree::search::TreeView for DataView<'_> {
    type Node = std::sync::Arc<crate::disk_io::ExtentBuffer>;
    fn read_node(&self, bytenr: u64, _expect: &crate::disk_io::Expect) -> Result<Self::Node> {
        Err(detached(format!("tree block {bytenr}")))
    }
    fn tree_root(&self) -> crate::tree::search::RootInfo {
        crate::tree::search::TreeView::tree_root(self.info)
    }
    fn chunk_root(&self) -> crate::tree::search::RootInfo {
        crate::tree::search::TreeView::chunk_root(self.info)
    }
}

impl FsRead for DataView<'_> {
    fn info(&self) -> &crate::disk_io::FsInfo {
        self.info
    }
    fn default_subvol(&self) -> u64 {
        self.default_subvol
    }
}

impl FileRead for DataView<'_> {
    fn lookup_csums(&self, logical: u64, len: u64) -> Result<CsumRun> {
        let ss = u64::from(self.info.sectorsize);
        let cs = self.info.csum_type.size();
        let end = logical
            .checked_add(len)
            .ok_or_else(|| detached(format!("csums of {logical} +{len}")))?;
        let (start, run) = self
            .csums
            .iter()
            .find(|(s, r)| *s <= logical && end <= s + r.present.len() as u64 * ss)
            .ok_or_else(|| detached(format!("csums of {logical} +{len} were not looked up")))?;
        let first = ((logical - start) / ss) as usize;
        let n = (len / ss) as usize;
        Ok(CsumRun {
            csums: run.csums[first * cs..(first + n) * cs].to_vec(),
            present: run.present[first..first + n].to_vec(),
        })
    }
}

/// Reading file data through a read view (`FsRead`): checksums, verified reads with
/// the fallback to other copies, reads of a file's bytes (holes as zeros, inline and
/// compressed extents decoded), symlink targets. Every read view has it; a view with
/// checksums of its own at hand (`DataView`) answers `lookup_csums` from them.
pub trait FileRead: FsRead {
    /// Look up the data checksums of `[logical, logical + len)` (sector aligned).
    ///
    /// # Errors
    /// `Corrupt`/`Io` from the csum tree.
    fn lookup_csums(&self, logical: u64, len: u64) -> Result<CsumRun> {
        lookup_csums(self, logical, len)
    }

    /// Read `buf.len()` bytes of data at `logical` (sector aligned) and verify every
    /// sector, falling back to other copies sector by sector.
    ///
    /// # Errors
    /// `Corrupt` (data) naming ino, file offset and logical when no copy is good.
    fn read_verified(
        &self,
        inode: &InodeView,
        file_offset: u64,
        logical: u64,
        buf: &mut [u8],
    ) -> Result<()> {
        read_verified(self, inode, file_offset, logical, buf)
    }

    /// Read file data at `offset` into `buf`; returns the bytes read (short at EOF).
    ///
    /// # Errors
    /// `Io`/`Corrupt` from the extent read, decompression or checksum.
    fn read_at(&self, inode: &InodeView, offset: u64, buf: &mut [u8]) -> Result<usize> {
        read_at(self, inode, offset, buf)
    }

    /// `read_at` with a caller-held cache of the last decompressed extent, so sequential
    /// reads of a compressed file decompress each extent once.
    ///
    /// # Errors
    /// As `read_at`.
    fn read_at_cached(
        &self,
        inode: &InodeView,
        offset: u64,
        buf: &mut [u8],
        cache: &mut DecompressCache,
    ) -> Result<usize> {
        read_at_cached(self, inode, offset, buf, cache)
    }
}

impl FileRead for crate::inode::filesystem::Filesystem {}

impl FileRead for crate::transaction::Live<'_> {}
