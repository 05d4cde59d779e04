//! Decompression (and compression) of btrfs compressed file extents.
//!
//! # What
//!
//! btrfs stores a compressed file extent as one opaque blob: for a regular
//! extent the `disk_num_bytes` bytes at `disk_bytenr` (sector aligned, so the
//! stream may be followed by zero padding), for an inline extent the bytes
//! after the file extent item header. The extent item says which algorithm
//! wrote it (`compression`: 0 none, 1 zlib, 2 lzo, 3 zstd) and how many bytes
//! it decodes to (`ram_bytes`). [`decompress`] turns such a blob back into
//! exactly `ram_bytes` bytes; [`compress`] produces blobs in the same framing for
//! the write path, which asks [`heuristic`] first whether a range is worth it.
//!
//! Framing per algorithm:
//!
//! * zlib: one zlib stream (RFC 1950: 2-byte header, deflate data, adler32).
//!   Like the kernel, the header is checked and the deflate data is inflated
//!   raw; the adler32 trailer is not verified (the kernel skips it too, and a
//!   decode that stops at `ram_bytes` would never reach it anyway).
//! * zstd: one zstd frame, written by the kernel with a window of at most
//!   128 KiB and possibly without a content size. Decoded with a streaming
//!   decoder whose window limit is 128 KiB (or the next power of two at or
//!   above `ram_bytes`, if that is larger), so a hostile frame cannot make it
//!   allocate more.
//! * lzo: btrfs's own segmented framing around LZO1X payloads. A le32 total
//!   length (counting itself) comes first; then segments, each a le32 length
//!   and that many bytes of one LZO1X stream that decodes to at most one
//!   sector. A segment header never straddles a sector boundary: when fewer
//!   than 4 bytes are left in the current sector the writer pads to the next
//!   boundary with zeros (these pad bytes are counted in the total length and
//!   may also follow the last segment). Inline extents use the same framing.
//!   LZO1X itself comes from the `lzokay` crate (pure, safe Rust).
//!
//! # Invariants
//!
//! * Never panics and never loops without consuming input, whatever the
//!   bytes; memory is bounded by `ram_bytes` (at most [`MAX_RAM_BYTES`]), one
//!   sector of scratch for lzo and the zstd window limit above.
//! * On success the output is exactly `ram_bytes` long. Decoding stops as soon
//!   as `ram_bytes` bytes exist; whatever the stream would produce past that
//!   is neither decoded nor checked (the kernel does the same). If the stream
//!   ends properly (zlib/zstd end of stream, lzo total length consumed) before
//!   `ram_bytes` bytes, the rest is zero-filled, as the kernel does for inline
//!   extents and the tail of the last sector. A stream that runs out of input
//!   before its end and before `ram_bytes` is an error
//!   ([`DecompressError::Truncated`]).
//! * On error [`decompress`] leaves its output buffer empty.
//!
//! Not handled: the kernel's "lzo-rle" bitstream (an LZO1X stream starting
//! with byte 17 plus a version byte). btrfs never writes it, and an LZO1X-1
//! compressor never emits 17 as the first byte, so such a segment is decoded
//! as plain LZO1X and almost surely fails.
//!
//! # Neighbours
//!
//! The caller is the file reading code: it reads the extent's on-disk bytes
//! (verifying their data checksums, which cover the compressed bytes), maps
//! the item's `compression` byte with [`CompressionType::from_raw`], calls
//! [`decompress`] with the item's `ram_bytes` and the filesystem sectorsize,
//! and then takes the `[offset, offset + num_bytes)` window of the result.
//! The item layout itself lives in the `ubtrfs-format` crate, whose tree
//! checker already rejects compression values above 3.

pub mod heuristic;

use std::fmt;
use std::io::Write;

use crate::error::{Error, PosixKind};

/// Largest `ram_bytes` [`decompress`] accepts. btrfs itself never exceeds
/// [`BTRFS_MAX_UNCOMPRESSED`] for regular extents and one sector for inline
/// ones; the extra room is tolerance, not a format feature.
pub const MAX_RAM_BYTES: usize = 1 << 20;

/// Largest amount of file data btrfs puts in one compressed extent (128 KiB);
/// also the largest input [`compress`] accepts.
pub const BTRFS_MAX_UNCOMPRESSED: usize = 128 * 1024;

/// Smallest sectorsize accepted (power of two).
pub const MIN_SECTORSIZE: usize = 512;
/// Largest sectorsize accepted (power of two), the btrfs maximum.
pub const MAX_SECTORSIZE: usize = 64 * 1024;

/// log2 of the largest zstd window the kernel writes and reads (128 KiB).
pub const ZSTD_BTRFS_MAX_WINDOWLOG: u32 = 17;

/// Size of the lzo total-length field and of each lzo segment header.
const LZO_LEN: usize = 4;

/// The kernel's default level for zlib and zstd.
const DEFAULT_LEVEL: i32 = 3;

/// Worst-case size of LZO1X-compressed data for `len` input bytes, as the
/// kernel computes it (including the 2 bytes newer kernels reserve for the
/// lzo-rle header; older kernels used 2 less, which is covered). A valid lzo
/// segment is never longer than `lzo1x_worst_compress(sectorsize)`.
pub const fn lzo1x_worst_compress(len: usize) -> usize {
    len + len / 16 + 64 + 3 + 2
}

/// Compression algorithm of a file extent, as stored in the extent item's
/// `compression` byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompressionType {
    /// Not compressed.
    None = 0,
    /// zlib stream (deflate with zlib header).
    Zlib = 1,
    /// btrfs segmented lzo framing around LZO1X streams.
    Lzo = 2,
    /// One zstd frame.
    Zstd = 3,
}

impl CompressionType {
    /// Maps the on-disk `compression` byte; `None` for values btrfs does not
    /// define (4 and above).
    pub fn from_raw(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::None),
            1 => Some(Self::Zlib),
            2 => Some(Self::Lzo),
            3 => Some(Self::Zstd),
            _ => None,
        }
    }

    /// Lowercase name, as used by the `compress=` mount option.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Zlib => "zlib",
            Self::Lzo => "lzo",
            Self::Zstd => "zstd",
        }
    }
}

impl fmt::Display for CompressionType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a compressed extent could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecompressError {
    /// `ram_bytes` is above [`MAX_RAM_BYTES`].
    #[error("ram_bytes {ram_bytes} exceeds the supported maximum of {max}")]
    RamBytesTooLarge { ram_bytes: usize, max: usize },
    /// The sectorsize argument is unusable.
    #[error("sectorsize {sectorsize} is not a power of two between 512 and 65536")]
    InvalidSectorsize { sectorsize: usize },
    /// The input ended before the stream's end marker and before `ram_bytes`
    /// bytes were produced.
    #[error(
        "{algo}: truncated input: stream incomplete after {consumed} input bytes, \
         {produced} of {ram_bytes} output bytes decoded"
    )]
    Truncated { algo: CompressionType, consumed: usize, produced: usize, ram_bytes: usize },
    /// The zlib or zstd decoder rejected the data.
    #[error("{algo}: corrupt stream after {produced} output bytes: {detail}")]
    Corrupt { algo: CompressionType, produced: usize, detail: String },
    /// The decoder could not be set up (allocation or parameter failure).
    #[error("{algo}: decoder setup failed: {detail}")]
    DecoderSetup { algo: CompressionType, detail: String },
    /// The 2-byte zlib header is not one a btrfs extent can carry.
    #[error("zlib: invalid stream header {header:#06x}: {reason}")]
    ZlibHeader { header: u16, reason: &'static str },
    /// The lzo total length is larger than the extent.
    #[error("lzo: total length {total} exceeds extent length {available}")]
    LzoTotalLengthTooLarge { total: u32, available: usize },
    /// The lzo total length cannot even hold itself.
    #[error("lzo: total length {total} is smaller than its own 4-byte field")]
    LzoTotalLengthTooSmall { total: u32 },
    /// A segment header would extend past the total length.
    #[error("lzo: segment header at offset {offset} crosses total length {total}")]
    LzoSegmentHeaderTruncated { offset: usize, total: usize },
    /// A segment with length 0.
    #[error("lzo: segment at offset {offset} has length 0")]
    LzoSegmentEmpty { offset: usize },
    /// A segment longer than LZO1X can make one sector.
    #[error(
        "lzo: segment length {len} at offset {offset} exceeds the worst-case compressed size \
         {max} of a {sectorsize}-byte sector"
    )]
    LzoSegmentTooLong { offset: usize, len: usize, max: usize, sectorsize: usize },
    /// A segment's data would extend past the total length.
    #[error("lzo: segment length {len} at offset {offset} overruns total length {total}")]
    LzoSegmentOverrun { offset: usize, len: usize, total: usize },
    /// A segment decodes to more than one sector.
    #[error(
        "lzo: segment at offset {offset} decompresses to more than one {sectorsize}-byte sector"
    )]
    LzoSegmentOutputTooLarge { offset: usize, sectorsize: usize },
    /// The LZO1X decoder rejected a segment.
    #[error("lzo: segment at offset {offset} is corrupt: {reason}")]
    LzoSegmentCorrupt { offset: usize, reason: &'static str },
}

/// Why [`compress`] could not produce a stream.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompressError {
    /// More than [`BTRFS_MAX_UNCOMPRESSED`] bytes of input.
    #[error("compression input of {len} bytes exceeds the btrfs maximum of {max}")]
    InputTooLarge { len: usize, max: usize },
    /// The sectorsize argument is unusable.
    #[error("sectorsize {sectorsize} is not a power of two between 512 and 65536")]
    InvalidSectorsize { sectorsize: usize },
    /// A level outside what the kernel accepts for this algorithm (zlib 1..=9,
    /// zstd -15..=15 without 0; lzo has no levels).
    #[error("{algo}: compression level {level} is out of range")]
    InvalidLevel { algo: CompressionType, level: i32 },
    /// The underlying compressor failed.
    #[error("{algo}: compressor failed: {detail}")]
    Backend { algo: CompressionType, detail: String },
}

fn sectorsize_ok(sectorsize: usize) -> bool {
    sectorsize.is_power_of_two() && (MIN_SECTORSIZE..=MAX_SECTORSIZE).contains(&sectorsize)
}

/// Lowercases the first character of a backend's message, so that all of
/// this module's messages read alike.
fn lower_first(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) => c.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Decompresses one btrfs compressed extent into `out`.
///
/// `input` is the whole extent as stored: `disk_num_bytes` bytes of a regular
/// extent (trailing padding allowed) or the inline data. `ram_bytes` is the
/// extent item's `ram_bytes`; `sectorsize` the filesystem's (checked for
/// every kind, used by lzo).
///
/// `out` is cleared first. On success it holds exactly `ram_bytes` bytes:
/// the decoded data, cut off at `ram_bytes` if the stream would give more, and
/// zero-filled up to `ram_bytes` if the stream ends properly with fewer. On
/// error it is left empty. `ram_bytes == 0` succeeds without looking at
/// `input`. [`CompressionType::None`] copies `input` with the same cut-off and
/// zero-fill rule.
///
/// Use [`decompress_into`] to decode into an existing buffer and learn how
/// many bytes the stream itself produced.
pub fn decompress(
    kind: CompressionType,
    input: &[u8],
    ram_bytes: usize,
    sectorsize: usize,
    out: &mut Vec<u8>,
) -> Result<(), DecompressError> {
    out.clear();
    if ram_bytes > MAX_RAM_BYTES {
        return Err(DecompressError::RamBytesTooLarge { ram_bytes, max: MAX_RAM_BYTES });
    }
    if !sectorsize_ok(sectorsize) {
        return Err(DecompressError::InvalidSectorsize { sectorsize });
    }
    out.resize(ram_bytes, 0);
    match decompress_into(kind, input, out, sectorsize) {
        Ok(_) => Ok(()),
        Err(e) => {
            out.clear();
            Err(e)
        }
    }
}

/// [`decompress`] for an extent item's raw `compression` byte, as every reader of file
/// data meets it: the error is the message a reader puts in its `Corrupt` (an unknown
/// type, or the decoder's failure named by the algorithm).
pub fn decompress_item(
    compression: u8,
    input: &[u8],
    ram_bytes: usize,
    sectorsize: usize,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let kind = CompressionType::from_raw(compression)
        .ok_or_else(|| format!("unknown compression type {compression}"))?;
    decompress(kind, input, ram_bytes, sectorsize, out)
        .map_err(|e| format!("{} decompression failed: {e}", kind.name()))
}

/// Like [`decompress`], but decodes into `dst`, whose length is the extent's
/// `ram_bytes`, and returns how many bytes the stream itself produced (at
/// most `dst.len()`); the bytes of `dst` after that are set to zero. On error
/// the contents of `dst` are unspecified.
pub fn decompress_into(
    kind: CompressionType,
    input: &[u8],
    dst: &mut [u8],
    sectorsize: usize,
) -> Result<usize, DecompressError> {
    if dst.len() > MAX_RAM_BYTES {
        return Err(DecompressError::RamBytesTooLarge { ram_bytes: dst.len(), max: MAX_RAM_BYTES });
    }
    if !sectorsize_ok(sectorsize) {
        return Err(DecompressError::InvalidSectorsize { sectorsize });
    }
    if dst.is_empty() {
        return Ok(0);
    }
    let produced = match kind {
        CompressionType::None => {
            let n = input.len().min(dst.len());
            dst[..n].copy_from_slice(&input[..n]);
            n
        }
        CompressionType::Zlib => zlib_decompress(input, dst)?,
        CompressionType::Lzo => lzo_decompress(input, dst, sectorsize)?,
        CompressionType::Zstd => zstd_decompress(input, dst)?,
    };
    dst[produced..].fill(0);
    Ok(produced)
}

/// Checks the zlib header and inflates the raw deflate data after it into
/// `dst`; returns the number of bytes produced.
fn zlib_decompress(input: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
    use flate2::{Decompress, FlushDecompress, Status};
    let algo = CompressionType::Zlib;
    if input.len() < 2 {
        return Err(DecompressError::Truncated {
            algo,
            consumed: input.len(),
            produced: 0,
            ram_bytes: dst.len(),
        });
    }
    let header = u16::from_be_bytes([input[0], input[1]]);
    let reason = if input[0] & 0x0f != 8 {
        Some("compression method is not deflate")
    } else if input[0] >> 4 > 7 {
        Some("window size above 32 KiB")
    } else if !header.is_multiple_of(31) {
        Some("header check bits do not match")
    } else if input[1] & 0x20 != 0 {
        Some("stream needs a preset dictionary")
    } else {
        None
    };
    if let Some(reason) = reason {
        return Err(DecompressError::ZlibHeader { header, reason });
    }
    let body = &input[2..];
    let mut inflater = Decompress::new(false);
    loop {
        // total_in/total_out never exceed the slices handed in, so the casts
        // and slicing below stay in bounds.
        let in_pos = inflater.total_in() as usize;
        let out_pos = inflater.total_out() as usize;
        let status = inflater
            .decompress(&body[in_pos..], &mut dst[out_pos..], FlushDecompress::None)
            .map_err(|e| DecompressError::Corrupt {
                algo,
                produced: out_pos,
                detail: lower_first(&e.to_string()),
            })?;
        let new_in = inflater.total_in() as usize;
        let new_out = inflater.total_out() as usize;
        if status == Status::StreamEnd || new_out == dst.len() {
            return Ok(new_out);
        }
        if new_in == in_pos && new_out == out_pos {
            return Err(DecompressError::Truncated {
                algo,
                consumed: 2 + new_in,
                produced: new_out,
                ram_bytes: dst.len(),
            });
        }
    }
}

/// Decodes the first zstd frame of `input` into `dst`; returns the number of
/// bytes produced. Anything after the frame (padding) is ignored.
fn zstd_decompress(input: &[u8], dst: &mut [u8]) -> Result<usize, DecompressError> {
    use zstd::stream::raw::{Decoder, Operation};
    let algo = CompressionType::Zstd;
    let _ = dst.len();
    let setup = |e: std::io::Error| DecompressError::DecoderSetup {
        algo,
        detail: lower_first(&e.to_string()),
    };
    thread_local! {
        // Creating a decompression context costs more than decoding a 128 KiB extent,
        // so each thread keeps one and resets it per frame.
        static DCTX: std::cell::RefCell<Option<Decoder<'static>>> = const { std::cell::RefCell::new(None) };
    }
    DCTX.with(|cell| {
        let mut slot = cell.borrow_mut();
        let decoder = match slot.as_mut() {
            Some(d) => {
                d.reinit().map_err(setup)?;
                d
            }
            None => slot.insert(Decoder::new().map_err(setup)?),
        };
        zstd_run(decoder, input, dst)
    })
}

fn zstd_run(
    decoder: &mut zstd::stream::raw::Decoder<'static>,
    input: &[u8],
    dst: &mut [u8],
) -> Result<usize, DecompressError> {
    use zstd::stream::raw::{DParameter, InBuffer, Operation, OutBuffer};
    let algo = CompressionType::Zstd;
    let ram_bytes = dst.len();
    let setup = |e: std::io::Error| DecompressError::DecoderSetup {
        algo,
        detail: lower_first(&e.to_string()),
    };
    // A window never needs to be larger than the whole output.
    let window_log = ZSTD_BTRFS_MAX_WINDOWLOG.max(ram_bytes.next_power_of_two().trailing_zeros());
    decoder.set_parameter(DParameter::WindowLogMax(window_log)).map_err(setup)?;
    let mut inbuf = InBuffer::around(input);
    let mut outbuf = OutBuffer::around(dst);
    loop {
        let (in_pos, out_pos) = (inbuf.pos(), outbuf.pos());
        let hint = decoder.run(&mut inbuf, &mut outbuf).map_err(|e| DecompressError::Corrupt {
            algo,
            produced: out_pos,
            detail: lower_first(&e.to_string()),
        })?;
        // hint 0: the frame is complete and fully flushed.
        if hint == 0 || outbuf.pos() == ram_bytes {
            return Ok(outbuf.pos());
        }
        if inbuf.pos() == in_pos && outbuf.pos() == out_pos {
            return Err(DecompressError::Truncated {
                algo,
                consumed: inbuf.pos(),
                produced: outbuf.pos(),
                ram_bytes,
            });
        }
    }
}

fn read_le32(buf: &[u8], pos: usize) -> u32 {
    u32::from_le_bytes([buf[pos], buf[pos + 1], buf[pos + 2], buf[pos + 3]])
}

fn lzokay_reason(e: lzokay::Error) -> &'static str {
    #[allow(unreachable_patterns)]
    match e {
        lzokay::Error::LookbehindOverrun => "match refers to data before the start of the segment",
        lzokay::Error::InputOverrun => "segment data ends inside an instruction",
        lzokay::Error::InputNotConsumed => "bytes follow the end-of-stream marker",
        lzokay::Error::Error => "invalid end-of-stream marker",
        _ => "lzo1x decoder error",
    }
}

/// Walks btrfs lzo framing (module docs) and decodes each segment into `dst`;
/// returns the number of bytes produced.
fn lzo_decompress(
    input: &[u8],
    dst: &mut [u8],
    sectorsize: usize,
) -> Result<usize, DecompressError> {
    let algo = CompressionType::Lzo;
    if input.len() < LZO_LEN {
        return Err(DecompressError::Truncated {
            algo,
            consumed: input.len(),
            produced: 0,
            ram_bytes: dst.len(),
        });
    }
    let total_raw = read_le32(input, 0);
    let total = total_raw as usize;
    if total > input.len() {
        return Err(DecompressError::LzoTotalLengthTooLarge {
            total: total_raw,
            available: input.len(),
        });
    }
    if total < LZO_LEN {
        return Err(DecompressError::LzoTotalLengthTooSmall { total: total_raw });
    }
    let max_seg = lzo1x_worst_compress(sectorsize);
    let mut sector = vec![0u8; sectorsize];
    let mut pos = LZO_LEN;
    let mut produced = 0;
    // Every pass either skips padding to a sector boundary or consumes a
    // header plus at least one data byte, so `pos` strictly grows.
    while pos < total && produced < dst.len() {
        let left_in_sector = sectorsize - pos % sectorsize;
        if left_in_sector < LZO_LEN {
            pos += left_in_sector;
            continue;
        }
        if total - pos < LZO_LEN {
            return Err(DecompressError::LzoSegmentHeaderTruncated { offset: pos, total });
        }
        let len = read_le32(input, pos) as usize;
        let data = pos + LZO_LEN;
        if len == 0 {
            return Err(DecompressError::LzoSegmentEmpty { offset: pos });
        }
        if len > max_seg {
            return Err(DecompressError::LzoSegmentTooLong {
                offset: pos,
                len,
                max: max_seg,
                sectorsize,
            });
        }
        if len > total - data {
            return Err(DecompressError::LzoSegmentOverrun { offset: pos, len, total });
        }
        let n =
            lzokay::decompress::decompress(&input[data..data + len], &mut sector).map_err(|e| {
                match e {
                    lzokay::Error::OutputOverrun => {
                        DecompressError::LzoSegmentOutputTooLarge { offset: pos, sectorsize }
                    }
                    other => DecompressError::LzoSegmentCorrupt {
                        offset: pos,
                        reason: lzokay_reason(other),
                    },
                }
            })?;
        let take = n.min(dst.len() - produced);
        dst[produced..produced + take].copy_from_slice(&sector[..take]);
        produced += take;
        pos = data + len;
    }
    Ok(produced)
}

/// Compresses `input` (at most [`BTRFS_MAX_UNCOMPRESSED`] bytes of file data,
/// starting at a sector boundary) into the on-disk framing of `kind` at the
/// kernel's default level.
///
/// Returns `Ok(None)` when storing it compressed would not make it smaller
/// (the stream is not shorter than `input`, which includes empty input), and
/// always for [`CompressionType::None`]. A write path should additionally
/// apply the kernel's rule of keeping compression only if it saves at least
/// one sector once rounded up. The returned bytes are what goes on disk (for
/// a regular extent, padded to a sector by the caller); its `ram_bytes` is
/// `input.len()`.
#[cfg(any(test, feature = "test-hooks"))]
pub fn compress(
    kind: CompressionType,
    input: &[u8],
    sectorsize: usize,
) -> Result<Option<Vec<u8>>, CompressError> {
    compress_with_level(kind, input, sectorsize, None)
}

/// [`compress`] with an explicit level: `None` is the kernel default (3 for
/// zlib and zstd); zlib takes 1..=9, zstd -15..=15 except 0; lzo takes no
/// level (LZO1X has one speed here).
pub fn compress_with_level(
    kind: CompressionType,
    input: &[u8],
    sectorsize: usize,
    level: Option<i32>,
) -> Result<Option<Vec<u8>>, CompressError> {
    if kind == CompressionType::None {
        return Ok(None);
    }
    let stream = compress_stream(kind, input, sectorsize, level)?;
    Ok((stream.len() < input.len()).then_some(stream))
}

/// Produces the framed stream whether or not it is smaller than `input`.
fn compress_stream(
    kind: CompressionType,
    input: &[u8],
    sectorsize: usize,
    level: Option<i32>,
) -> Result<Vec<u8>, CompressError> {
    if !sectorsize_ok(sectorsize) {
        return Err(CompressError::InvalidSectorsize { sectorsize });
    }
    if input.len() > BTRFS_MAX_UNCOMPRESSED {
        return Err(CompressError::InputTooLarge { len: input.len(), max: BTRFS_MAX_UNCOMPRESSED });
    }
    let backend = |algo: CompressionType| {
        move |e: std::io::Error| CompressError::Backend {
            algo,
            detail: lower_first(&e.to_string()),
        }
    };
    match kind {
        CompressionType::None => Ok(input.to_vec()),
        CompressionType::Zlib => {
            let level = level.unwrap_or(DEFAULT_LEVEL);
            if !(1..=9).contains(&level) {
                return Err(CompressError::InvalidLevel { algo: kind, level });
            }
            let mut enc =
                flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(level as u32));
            enc.write_all(input).map_err(backend(kind))?;
            enc.finish().map_err(backend(kind))
        }
        CompressionType::Zstd => {
            let level = level.unwrap_or(DEFAULT_LEVEL);
            if level == 0 || !(-15..=15).contains(&level) {
                return Err(CompressError::InvalidLevel { algo: kind, level });
            }
            let mut enc = zstd::bulk::Compressor::new(level).map_err(backend(kind))?;
            enc.set_parameter(zstd::zstd_safe::CParameter::WindowLog(ZSTD_BTRFS_MAX_WINDOWLOG))
                .map_err(backend(kind))?;
            enc.compress(input).map_err(backend(kind))
        }
        CompressionType::Lzo => {
            if let Some(level) = level {
                return Err(CompressError::InvalidLevel { algo: kind, level });
            }
            lzo_compress(input, sectorsize)
        }
    }
}

/// Builds btrfs lzo framing: one LZO1X stream per sector of input, a header
/// before each, zero padding after a segment when fewer than 4 bytes remain
/// in its sector (the kernel pads there, including after the last segment).
fn lzo_compress(input: &[u8], sectorsize: usize) -> Result<Vec<u8>, CompressError> {
    let algo = CompressionType::Lzo;
    let fail = |detail: String| CompressError::Backend { algo, detail };
    let mut dict = lzokay::compress::Dict::new();
    let mut out = vec![0u8; LZO_LEN];
    for chunk in input.chunks(sectorsize) {
        let seg = lzokay::compress::compress_with_dict(chunk, &mut dict)
            .map_err(|e| fail(lower_first(&e.to_string())))?;
        if seg.len() > lzo1x_worst_compress(sectorsize) {
            return Err(fail(format!("segment of {} bytes exceeds the worst case", seg.len())));
        }
        // The kernel reads a stream of 5+ bytes starting with 17 as lzo-rle.
        if seg.len() >= 5 && seg[0] == 17 {
            return Err(fail("segment would be read as lzo-rle".to_string()));
        }
        out.extend_from_slice(&(seg.len() as u32).to_le_bytes());
        out.extend_from_slice(&seg);
        let left_in_sector = sectorsize - out.len() % sectorsize;
        if left_in_sector < LZO_LEN {
            out.resize(out.len() + left_in_sector, 0);
        }
    }
    let total = out.len() as u32;
    out[..LZO_LEN].copy_from_slice(&total.to_le_bytes());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ALL: [CompressionType; 3] =
        [CompressionType::Zlib, CompressionType::Lzo, CompressionType::Zstd];

    /// Deterministic, moderately compressible text; the real-kernel test
    /// vectors below were made from files with exactly this content.
    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 32);
        let mut i = 0u64;
        while v.len() < len {
            writeln!(v, "{:06} btrfs {:05} ubtrfs", i, (i * 7919 + seed) % 10007).unwrap();
            i += 1;
        }
        v.truncate(len);
        v
    }

    /// xorshift bytes: incompressible.
    fn random(len: usize, mut seed: u64) -> Vec<u8> {
        seed |= 1;
        (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed as u8
            })
            .collect()
    }

    fn dec(
        kind: CompressionType,
        input: &[u8],
        ram: usize,
        ss: usize,
    ) -> Result<Vec<u8>, DecompressError> {
        let mut out = vec![0xAA; 3];
        let r = decompress(kind, input, ram, ss, &mut out);
        match r {
            Ok(()) => {
                assert_eq!(out.len(), ram);
                Ok(out)
            }
            Err(e) => {
                assert!(out.is_empty());
                Err(e)
            }
        }
    }

    /// Header offsets and lengths of each lzo segment, checking the framing
    /// rules on the way (used on compressor output).
    fn lzo_layout(stream: &[u8], ss: usize) -> (Vec<(usize, usize)>, usize) {
        let total = read_le32(stream, 0) as usize;
        assert_eq!(total, stream.len());
        let mut pos = 4;
        let mut segs = Vec::new();
        let mut pads = 0;
        while pos < total {
            let left = ss - pos % ss;
            if left < 4 {
                assert!(stream[pos..pos + left].iter().all(|&b| b == 0));
                pads += 1;
                pos += left;
                continue;
            }
            let len = read_le32(stream, pos) as usize;
            assert!(len > 0 && len <= lzo1x_worst_compress(ss));
            segs.push((pos, len));
            pos += 4 + len;
        }
        assert_eq!(pos, total);
        (segs, pads)
    }

    #[test]
    fn decompress_item_names_an_unknown_type_and_the_failing_algorithm() {
        let mut out = Vec::new();
        assert_eq!(
            decompress_item(9, b"x", 1, 4096, &mut out),
            Err("unknown compression type 9".to_string())
        );
        let err = decompress_item(3, b"not a zstd frame", 4096, 4096, &mut out).unwrap_err();
        assert!(err.starts_with("zstd decompression failed: "), "{err}");
        let z = zstd::bulk::compress(&[7u8; 4096], 3).unwrap();
        decompress_item(3, &z, 4096, 4096, &mut out).unwrap();
        assert_eq!(out, vec![7u8; 4096]);
    }

    #[test]
    fn compression_type_raw_and_names() {
        for (v, t, n) in [
            (0, CompressionType::None, "none"),
            (1, CompressionType::Zlib, "zlib"),
            (2, CompressionType::Lzo, "lzo"),
            (3, CompressionType::Zstd, "zstd"),
        ] {
            assert_eq!(CompressionType::from_raw(v), Some(t));
            assert_eq!(t as u8, v);
            assert_eq!(t.name(), n);
            assert_eq!(t.to_string(), n);
        }
        for v in 4..=255 {
            assert_eq!(CompressionType::from_raw(v), None);
        }
    }

    #[test]
    fn round_trips() {
        let sizes =
            [0usize, 1, 100, 4095, 4096, 4097, 3 * 4096 + 17, 65536, BTRFS_MAX_UNCOMPRESSED];
        for kind in ALL {
            for &size in &sizes {
                for (label, data) in [
                    ("text", pattern(size, 5)),
                    ("random", random(size, size as u64 + 1)),
                    ("zeros", vec![0u8; size]),
                ] {
                    let stream = compress_stream(kind, &data, 4096, None).unwrap();
                    let got = dec(kind, &stream, size, 4096)
                        .unwrap_or_else(|e| panic!("{kind} {label} {size}: {e}"));
                    assert!(got == data, "{kind} {label} {size}: mismatch");
                    // With disk padding up to the next sector.
                    let mut padded = stream.clone();
                    padded.resize(stream.len().next_multiple_of(4096).max(4096), 0);
                    assert_eq!(dec(kind, &padded, size, 4096).unwrap(), data);
                    // compress() only keeps streams that are smaller.
                    let kept = compress(kind, &data, 4096).unwrap();
                    match &kept {
                        Some(s) => assert!(s.len() < data.len() && *s == stream),
                        None => assert!(stream.len() >= data.len()),
                    }
                    if label == "random" && size > 0 {
                        assert_eq!(kept, None, "{kind} random {size}");
                    }
                    if label != "random" && size >= 4096 {
                        assert!(kept.is_some(), "{kind} {label} {size}");
                    }
                    if kind == CompressionType::Lzo {
                        let (segs, _) = lzo_layout(&stream, 4096);
                        assert_eq!(segs.len(), size.div_ceil(4096));
                    }
                }
            }
        }
    }

    #[test]
    fn lzo_round_trip_other_sectorsizes() {
        for ss in [2048usize, 16384, 65536] {
            for size in [1usize, ss - 1, ss, ss + 1, BTRFS_MAX_UNCOMPRESSED] {
                for data in [pattern(size, 9), random(size, 3)] {
                    let stream = compress_stream(CompressionType::Lzo, &data, ss, None).unwrap();
                    let (segs, _) = lzo_layout(&stream, ss);
                    assert_eq!(segs.len(), size.div_ceil(ss));
                    assert_eq!(dec(CompressionType::Lzo, &stream, size, ss).unwrap(), data);
                }
            }
        }
    }

    #[test]
    fn lzo_compressor_pads_before_straddling_headers() {
        // Grow the incompressible part of the first sector byte by byte until
        // its segment ends 1, 2 and 3 bytes before the sector boundary; each
        // time the next header must follow a zero pad, and decode.
        let mut seen = [false; 4];
        for seed in 1..=8u64 {
            for noisy in 3900..=4096usize {
                let mut data = random(noisy, seed);
                data.extend(pattern(4096 - noisy, seed));
                data.extend(pattern(3000, seed + 1));
                let stream = compress_stream(CompressionType::Lzo, &data, 4096, None).unwrap();
                let (segs, pads) = lzo_layout(&stream, 4096);
                let end = segs[0].0 + 4 + segs[0].1;
                let left = 4096 - end % 4096;
                if left < 4 {
                    seen[left] = true;
                    assert_eq!(pads, 1);
                    assert_eq!(segs[1].0, 4096);
                    assert_eq!(dec(CompressionType::Lzo, &stream, data.len(), 4096).unwrap(), data);
                }
            }
        }
        assert!(seen[1] && seen[2] && seen[3], "padding cases not reached: {seen:?}");
    }

    /// An LZO1X stream that is one literal run (any length >= 4) plus the
    /// end marker, written by hand so the framing tests do not depend on a
    /// compressor.
    fn lzo_literal_stream(data: &[u8]) -> Vec<u8> {
        let n = data.len();
        assert!(n >= 4);
        let mut s = Vec::new();
        if n <= 238 {
            s.push(17 + n as u8);
        } else {
            // First byte 0: length = 18 + 255 * (zero bytes) + final byte.
            let mut rest = n - 18;
            s.push(0);
            while rest > 255 {
                s.push(0);
                rest -= 255;
            }
            s.push(rest as u8);
        }
        s.extend_from_slice(data);
        s.extend_from_slice(&[0x11, 0, 0]);
        s
    }

    /// Literal-run length whose hand-made stream is exactly `comp_len` bytes.
    fn literal_len_for(comp_len: usize) -> usize {
        (4..=4096).find(|&n| lzo_literal_stream(&vec![1; n]).len() == comp_len).unwrap()
    }

    fn push_segment(out: &mut Vec<u8>, seg: &[u8]) {
        out.extend_from_slice(&(seg.len() as u32).to_le_bytes());
        out.extend_from_slice(seg);
    }

    #[test]
    fn lzo_hand_framed_sector_boundary_rule() {
        // Segment 1 ends at `end`; the next header must start at `end` when
        // at least 4 bytes remain in the sector, else at the boundary.
        for end in [4090usize, 4092, 4093, 4094, 4095, 4096, 4100] {
            let n1 = literal_len_for(end - 8);
            let a = pattern(n1, 1);
            let b = random(3000, 7);
            let c = pattern(500, 3);
            let mut ext = vec![0u8; 4];
            push_segment(&mut ext, &lzo_literal_stream(&a));
            assert_eq!(ext.len(), end);
            let left = 4096 - end % 4096;
            if left < 4 {
                // Garbage in the pad bytes must be skipped, not parsed.
                ext.extend(std::iter::repeat_n(0xEE, left));
            }
            push_segment(&mut ext, &lzo_literal_stream(&b));
            push_segment(&mut ext, &lzo_literal_stream(&c));
            let total = ext.len() as u32;
            ext[..4].copy_from_slice(&total.to_le_bytes());
            let mut want = [a, b, c].concat();
            assert_eq!(
                dec(CompressionType::Lzo, &ext, want.len(), 4096).unwrap(),
                want,
                "end {end}"
            );
            // Zero-filled when ram_bytes is larger; cut off when smaller.
            let ram = want.len() + 1000;
            want.resize(ram, 0);
            assert_eq!(dec(CompressionType::Lzo, &ext, ram, 4096).unwrap(), want);
            assert_eq!(dec(CompressionType::Lzo, &ext, 5000, 4096).unwrap(), want[..5000]);
        }
    }

    #[test]
    fn lzo_trailing_pad_counted_in_total() {
        // The kernel counts the pad after the last segment in the total.
        let n1 = literal_len_for(4094 - 8);
        let a = pattern(n1, 4);
        let mut ext = vec![0u8; 4];
        push_segment(&mut ext, &lzo_literal_stream(&a));
        ext.extend([0, 0]);
        let total = ext.len() as u32;
        ext[..4].copy_from_slice(&total.to_le_bytes());
        ext.resize(8192, 0);
        assert_eq!(dec(CompressionType::Lzo, &ext, 4096, 4096).unwrap()[..n1], a[..]);
    }

    #[test]
    fn lzo_stops_at_ram_bytes_and_ignores_later_segments() {
        let a = pattern(4096, 1);
        let mut ext = vec![0u8; 4];
        push_segment(&mut ext, &lzo_literal_stream(&a));
        push_segment(&mut ext, &[0xFF; 40]); // garbage never decoded
        let total = ext.len() as u32;
        ext[..4].copy_from_slice(&total.to_le_bytes());
        assert_eq!(dec(CompressionType::Lzo, &ext, 4096, 4096).unwrap(), a);
        assert!(matches!(
            dec(CompressionType::Lzo, &ext, 4097, 4096),
            Err(DecompressError::LzoSegmentCorrupt { offset: 4124, .. })
        ));
    }

    #[test]
    fn lzo_framing_errors() {
        use DecompressError::*;
        let lzo = CompressionType::Lzo;
        let seg = lzo_literal_stream(&pattern(100, 1));
        let build = |total: Option<u32>, segs: &[&[u8]]| {
            let mut e = vec![0u8; 4];
            for s in segs {
                push_segment(&mut e, s);
            }
            let t = total.unwrap_or(e.len() as u32);
            e[..4].copy_from_slice(&t.to_le_bytes());
            e
        };
        assert!(matches!(dec(lzo, &[1, 0], 10, 4096), Err(Truncated { .. })));
        assert_eq!(
            dec(lzo, &build(Some(u32::MAX), &[&seg]), 100, 4096),
            Err(LzoTotalLengthTooLarge { total: u32::MAX, available: 4 + 4 + seg.len() })
        );
        assert_eq!(
            dec(lzo, &build(Some(3), &[&seg]), 100, 4096),
            Err(LzoTotalLengthTooSmall { total: 3 })
        );
        // Total exactly the field: no segments, all zeros.
        assert_eq!(dec(lzo, &build(Some(4), &[&seg]), 100, 4096).unwrap(), vec![0; 100]);
        assert_eq!(
            dec(lzo, &build(Some(6), &[&seg]), 100, 4096),
            Err(LzoSegmentHeaderTruncated { offset: 4, total: 6 })
        );
        assert_eq!(dec(lzo, &build(None, &[&[]]), 100, 4096), Err(LzoSegmentEmpty { offset: 4 }));
        let mut huge = build(None, &[&seg]);
        huge[4..8].copy_from_slice(&70000u32.to_le_bytes());
        let e = dec(lzo, &huge, 100, 4096).unwrap_err();
        assert_eq!(e, LzoSegmentTooLong { offset: 4, len: 70000, max: 4421, sectorsize: 4096 });
        assert_eq!(
            e.to_string(),
            "lzo: segment length 70000 at offset 4 exceeds the worst-case compressed size 4421 of a \
             4096-byte sector"
        );
        let mut over = build(None, &[&seg]);
        over[4..8].copy_from_slice(&((seg.len() + 1) as u32).to_le_bytes());
        assert_eq!(
            dec(lzo, &over, 100, 4096),
            Err(LzoSegmentOverrun { offset: 4, len: seg.len() + 1, total: over.len() })
        );
        // A segment decoding to more than one sector.
        let big = build(None, &[&lzo_literal_stream(&pattern(2100, 1))]);
        assert_eq!(
            dec(lzo, &big, 4096, 2048),
            Err(LzoSegmentOutputTooLarge { offset: 4, sectorsize: 2048 })
        );
        // Trailing bytes inside a segment after the end marker.
        let mut trailing = seg.clone();
        trailing.push(0);
        assert!(matches!(
            dec(lzo, &build(None, &[&trailing]), 100, 4096),
            Err(LzoSegmentCorrupt { .. })
        ));
        // A match that reaches before the segment start.
        let bad_match = [18u8, b'x', 0x40, 0x10, 0x11, 0, 0];
        assert!(matches!(
            dec(lzo, &build(None, &[&bad_match]), 100, 4096),
            Err(LzoSegmentCorrupt { .. })
        ));
    }

    #[test]
    fn argument_errors() {
        for kind in [
            CompressionType::None,
            CompressionType::Zlib,
            CompressionType::Lzo,
            CompressionType::Zstd,
        ] {
            assert_eq!(
                dec(kind, &[], MAX_RAM_BYTES + 1, 4096),
                Err(DecompressError::RamBytesTooLarge {
                    ram_bytes: MAX_RAM_BYTES + 1,
                    max: MAX_RAM_BYTES
                })
            );
            for ss in [0usize, 256, 4095, 128 * 1024] {
                assert_eq!(
                    dec(kind, &[], 10, ss),
                    Err(DecompressError::InvalidSectorsize { sectorsize: ss })
                );
                assert_eq!(
                    compress_stream(kind, &[1, 2, 3], ss, None),
                    Err(CompressError::InvalidSectorsize { sectorsize: ss })
                );
            }
            // ram_bytes 0 never looks at the input.
            assert_eq!(dec(kind, &[0xFF; 7], 0, 4096).unwrap(), Vec::<u8>::new());
            assert_eq!(
                compress(kind, &vec![0; BTRFS_MAX_UNCOMPRESSED + 1], 4096).err(),
                (kind != CompressionType::None).then_some(CompressError::InputTooLarge {
                    len: BTRFS_MAX_UNCOMPRESSED + 1,
                    max: BTRFS_MAX_UNCOMPRESSED
                })
            );
        }
        let zeros = vec![0u8; 8192];
        assert_eq!(compress(CompressionType::None, &zeros, 4096), Ok(None));
        for (kind, level) in [
            (CompressionType::Zlib, 0),
            (CompressionType::Zlib, 10),
            (CompressionType::Zstd, 0),
            (CompressionType::Zstd, 16),
            (CompressionType::Zstd, -16),
            (CompressionType::Lzo, 1),
        ] {
            assert_eq!(
                compress_with_level(kind, &zeros, 4096, Some(level)),
                Err(CompressError::InvalidLevel { algo: kind, level })
            );
        }
        for (kind, level) in
            [(CompressionType::Zlib, 9), (CompressionType::Zstd, 15), (CompressionType::Zstd, -3)]
        {
            let s = compress_with_level(kind, &zeros, 4096, Some(level)).unwrap().unwrap();
            assert_eq!(dec(kind, &s, 8192, 4096).unwrap(), zeros);
        }
    }

    #[test]
    fn none_copies_with_cutoff_and_zero_fill() {
        let none = CompressionType::None;
        assert_eq!(dec(none, b"abcdef", 3, 4096).unwrap(), b"abc");
        assert_eq!(dec(none, b"ab", 4, 4096).unwrap(), b"ab\0\0");
        let mut dst = [9u8; 5];
        assert_eq!(decompress_into(none, b"xy", &mut dst, 4096), Ok(2));
        assert_eq!(dst, *b"xy\0\0\0");
    }

    #[test]
    fn zlib_and_zstd_short_stream_zero_fill_and_cutoff() {
        for kind in [CompressionType::Zlib, CompressionType::Zstd] {
            let data = pattern(1500, 2);
            let s = compress_stream(kind, &data, 4096, None).unwrap();
            let mut dst = vec![7u8; 4096];
            assert_eq!(decompress_into(kind, &s, &mut dst, 4096), Ok(1500));
            assert_eq!(dst[..1500], data[..]);
            assert!(dst[1500..].iter().all(|&b| b == 0));
            assert_eq!(dec(kind, &s, 1000, 4096).unwrap(), data[..1000]);
        }
    }

    #[test]
    fn zlib_header_errors() {
        let zlib = CompressionType::Zlib;
        let good = compress_stream(zlib, &pattern(300, 1), 4096, None).unwrap();
        assert!(matches!(dec(zlib, &good[..1], 300, 4096), Err(DecompressError::Truncated { .. })));
        for (hdr, reason) in [
            ([0x79, 0x5e], "compression method is not deflate"),
            ([0x88, 0x5e], "window size above 32 KiB"),
            ([0x78, 0x5f], "header check bits do not match"),
            ([0x78, 0x20], "stream needs a preset dictionary"),
        ] {
            let mut s = good.clone();
            s[..2].copy_from_slice(&hdr);
            let header = u16::from_be_bytes(hdr);
            if reason == "stream needs a preset dictionary" {
                assert_eq!(header % 31, 0);
            }
            assert_eq!(
                dec(zlib, &s, 300, 4096),
                Err(DecompressError::ZlibHeader { header, reason })
            );
        }
    }

    #[test]
    fn zstd_rejects_windows_above_limit() {
        // A frame whose window is 8 MiB: refused without allocating it.
        let data = pattern(BTRFS_MAX_UNCOMPRESSED, 1);
        let mut enc = zstd::stream::raw::Encoder::new(3).unwrap();
        use zstd::stream::raw::{CParameter, InBuffer, Operation, OutBuffer};
        enc.set_parameter(CParameter::WindowLog(23)).unwrap();
        enc.set_parameter(CParameter::ContentSizeFlag(false)).unwrap();
        let mut buf = vec![0u8; 200_000];
        let mut out = OutBuffer::around(&mut buf[..]);
        let mut inb = InBuffer::around(&data);
        while inb.pos() < data.len() {
            enc.run(&mut inb, &mut out).unwrap();
        }
        while enc.finish(&mut out, true).unwrap() != 0 {}
        let n = out.pos();
        let frame = &buf[..n];
        assert!(matches!(
            dec(CompressionType::Zstd, frame, data.len(), 4096),
            Err(DecompressError::Corrupt { .. })
        ));
    }

    /// Every strict prefix of a small stream must fail or, where the prefix
    /// happens to carry all output, yield exactly the right bytes.
    #[test]
    fn truncation_at_every_position() {
        let data = pattern(3 * 4096 + 700, 8);
        for kind in ALL {
            let s = compress_stream(kind, &data, 4096, None).unwrap();
            for cut in 0..s.len() {
                match dec(kind, &s[..cut], data.len(), 4096) {
                    Ok(got) => assert!(got == data, "{kind} cut {cut}: wrong data"),
                    Err(e) => {
                        let _ = e.to_string();
                    }
                }
            }
        }
    }

    #[test]
    fn bit_flips_never_panic() {
        let data = pattern(2 * 4096 + 300, 6);
        for kind in ALL {
            let s = compress_stream(kind, &data, 4096, None).unwrap();
            for byte in 0..s.len() {
                for bit in [0u8, 3, 7] {
                    let mut c = s.clone();
                    c[byte] ^= 1 << bit;
                    if let Ok(got) = dec(kind, &c, data.len(), 4096) {
                        assert_eq!(got.len(), data.len());
                    }
                }
            }
        }
    }

    #[test]
    fn huge_and_garbage_inputs() {
        for kind in ALL {
            for input in
                [vec![], vec![0xFF; 4], vec![0xFF; 100_000], vec![0u8; 100_000], random(70_000, 4)]
            {
                for ram in [1usize, 4096, BTRFS_MAX_UNCOMPRESSED, MAX_RAM_BYTES] {
                    if let Ok(got) = dec(kind, &input, ram, 4096) {
                        assert_eq!(got.len(), ram);
                    }
                }
            }
        }
    }

    // Extents written by Linux 6.18 (mount -o compress-force=ALG, sectorsize
    // 4096) and read back from the image: file "big" is pattern(136072, 1),
    // stored as a 128 KiB extent and an 8 KiB tail extent holding the last
    // 5000 bytes; file "small" is pattern(1500, 2), stored inline.
    /// (algorithm, 128 KiB extent, 8 KiB tail extent, inline extent)
    type RealExtents = (CompressionType, &'static [u8], &'static [u8], &'static [u8]);
    const REAL: [RealExtents; 3] = [
        (
            CompressionType::Lzo,
            include_bytes!("testdata/lzo_regular_0.bin"),
            include_bytes!("testdata/lzo_regular_131072.bin"),
            include_bytes!("testdata/lzo_inline.bin"),
        ),
        (
            CompressionType::Zlib,
            include_bytes!("testdata/zlib_regular_0.bin"),
            include_bytes!("testdata/zlib_regular_131072.bin"),
            include_bytes!("testdata/zlib_inline.bin"),
        ),
        (
            CompressionType::Zstd,
            include_bytes!("testdata/zstd_regular_0.bin"),
            include_bytes!("testdata/zstd_regular_131072.bin"),
            include_bytes!("testdata/zstd_inline.bin"),
        ),
    ];

    #[test]
    fn real_kernel_extents() {
        let big = pattern(131072 + 5000, 1);
        let small = pattern(1500, 2);
        for (kind, first, tail, inline) in REAL {
            assert_eq!(dec(kind, first, 131072, 4096).unwrap(), big[..131072], "{kind} first");
            let mut want_tail = big[131072..].to_vec();
            want_tail.resize(8192, 0);
            assert_eq!(dec(kind, tail, 8192, 4096).unwrap(), want_tail, "{kind} tail");
            assert_eq!(dec(kind, inline, 1500, 4096).unwrap(), small, "{kind} inline");
            if kind == CompressionType::Lzo {
                // Each regular lzo segment holds exactly one sector.
                let total = read_le32(first, 0) as usize;
                let (segs, _) = lzo_layout(&first[..total], 4096);
                assert_eq!(segs.len(), 32);
            }
            // Our own stream for the same data decodes to the same bytes.
            let ours = compress(kind, &big[..131072], 4096).unwrap().unwrap();
            assert_eq!(dec(kind, &ours, 131072, 4096).unwrap(), big[..131072]);
        }
    }

    // Real lzo extents whose first segment ends 3, 2 and 1 bytes before the
    // first sector boundary, so the kernel padded and put the second header
    // at offset 4096. File content: n zero bytes short of a sector, then
    // random(n, 77), then 7 sectors of zeros (32 KiB, compress-force=lzo).
    const REAL_LZO_PADDED: [(usize, usize, &[u8]); 3] = [
        (3, 4055, include_bytes!("testdata/lzo_pad3_4055.bin")),
        (2, 4056, include_bytes!("testdata/lzo_pad2_4056.bin")),
        (1, 4057, include_bytes!("testdata/lzo_pad1_4057.bin")),
    ];

    #[test]
    fn real_kernel_lzo_sector_padding() {
        for (pad, n, ext) in REAL_LZO_PADDED {
            let mut want = vec![0u8; 4096 - n];
            want.extend(random(n, 77));
            want.resize(32768, 0);
            let total = read_le32(ext, 0) as usize;
            let (segs, pads) = lzo_layout(&ext[..total], 4096);
            assert_eq!(pads, 1);
            assert_eq!(4096 - (segs[0].0 + 4 + segs[0].1), pad);
            assert_eq!(segs[1].0, 4096);
            assert_eq!(dec(CompressionType::Lzo, ext, 32768, 4096).unwrap(), want, "pad {pad}");
            // The unpadded stream alone decodes the same.
            assert_eq!(dec(CompressionType::Lzo, &ext[..total], 32768, 4096).unwrap(), want);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        #[test]
        fn random_bytes_into_decoders(
            input in proptest::collection::vec(any::<u8>(), 0..6000),
            ram in 0usize..20000,
            kind in 0u8..4,
            ss_shift in 0u32..3,
        ) {
            let kind = CompressionType::from_raw(kind).unwrap();
            let ss = 2048usize << ss_shift;
            if let Ok(got) = dec(kind, &input, ram, ss) {
                prop_assert_eq!(got.len(), ram);
            }
        }

        #[test]
        fn random_lzo_framing_around_valid_segments(
            lens in proptest::collection::vec(0u32..6000, 1..6),
            body in proptest::collection::vec(any::<u8>(), 0..9000),
            ram in 1usize..30000,
        ) {
            // Plausible headers with random payloads stress the framing walk.
            let mut ext = vec![0u8; 4];
            for (i, l) in lens.iter().enumerate() {
                ext.extend_from_slice(&l.to_le_bytes());
                let start = (i * 997) % (body.len() + 1);
                let end = (start + *l as usize).min(body.len());
                ext.extend_from_slice(&body[start..end]);
            }
            let total = ext.len() as u32;
            ext[..4].copy_from_slice(&total.to_le_bytes());
            if let Ok(got) = dec(CompressionType::Lzo, &ext, ram, 4096) {
                prop_assert_eq!(got.len(), ram);
            }
        }

        #[test]
        fn round_trip_any_data(
            data in proptest::collection::vec(any::<u8>(), 0..20000),
            kind in 1u8..4,
        ) {
            let kind = CompressionType::from_raw(kind).unwrap();
            let s = compress_stream(kind, &data, 4096, None).unwrap();
            prop_assert_eq!(dec(kind, &s, data.len(), 4096).unwrap(), data);
        }
    }
}

/// Mount-wide compression (`compress=` / `compress-force=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompressPolicy {
    /// The algorithm, None for no mount-wide compression.
    pub alg: Option<CompressionType>,
    /// The level (zlib 1..=9, zstd -15..=15 but 0); None for the algorithm's default.
    pub level: Option<i32>,
    /// compress-force: compress every range that shrinks.
    pub force: bool,
}

impl CompressPolicy {
    /// Parse `ALG[:LEVEL]` (zlib, lzo, zstd; `no` / `none` for none), as the mount option
    /// and `put --compress` take it.
    ///
    /// # Errors
    /// `Posix(Invalid)` naming the value.
    pub fn parse(s: &str, force: bool) -> crate::error::Result<CompressPolicy> {
        let bad =
            |d: String| Error::posix_detail(PosixKind::Invalid, format!("compression {s:?}"), d);
        let (name, level) = match s.split_once(':') {
            Some((n, l)) => {
                (n, Some(l.parse::<i32>().map_err(|_| bad(format!("{l:?} is not a level")))?))
            }
            None => (s, None),
        };
        let alg = match name {
            "zlib" => CompressionType::Zlib,
            "lzo" => CompressionType::Lzo,
            "zstd" => CompressionType::Zstd,
            "no" | "none" if level.is_none() => return Ok(CompressPolicy::default()),
            _ => return Err(bad("the algorithm is zlib, lzo or zstd".into())),
        };
        if let Some(l) = level {
            let ok = match alg {
                CompressionType::Zlib => (1..=9).contains(&l),
                CompressionType::Zstd => l != 0 && (-15..=15).contains(&l),
                _ => false,
            };
            if !ok {
                return Err(bad(format!(
                    "{alg} takes {}",
                    if alg == CompressionType::Lzo {
                        "no level".to_string()
                    } else if alg == CompressionType::Zlib {
                        "levels 1 to 9".into()
                    } else {
                        "levels -15 to -1 and 1 to 15".into()
                    }
                )));
            }
        }
        Ok(CompressPolicy { alg: Some(alg), level, force })
    }
}
