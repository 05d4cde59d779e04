//! `dump-super` and `dump-tree`: print on-disk metadata readably, field by field, with
//! the kernel's names (as `btrfs inspect-internal dump-super` / `dump-tree` do), so the
//! output maps onto `ubtrfs_format::structs` and the kernel's `btrfs_tree.h`.
//!
//! `dump-super` reads superblock copies straight from the device with `check_super`,
//! so it works when the filesystem cannot be opened (a damaged chunk tree, say).
//! `dump-tree` walks trees depth-first through the validated reader: every child is
//! read with what its parent pointer says (level, generation, owner, first key), and a
//! child that fails is reported on its own line while its siblings are still printed.
//! Recursion is bounded by the level, which strictly decreases and is below 8.
//!
//! Output goes through one `BufWriter`; a write error (EPIPE from `| head`) ends the
//! command through `Error::Io`, which `main` turns into a quiet exit.

use crate::ImageArgs;
use std::io::{self, BufWriter, Write};
use std::sync::Arc;
use ubtrfs_core::{
    quote, BlockDevice, Error, Expect, ExtentBuffer, FileDevice, FsInfo, PosixKind, Result,
    RootInfo, TreeView,
};
use ubtrfs_format::features::{self, flag_names, COMPAT_RO_NAMES, INCOMPAT_NAMES};
use ubtrfs_format::items::{self, read_prefix, uuid_str, ChunkView, FileExtent, InlineRef};
use ubtrfs_format::key::*;
use ubtrfs_format::node::max_node_ptrs;
use ubtrfs_format::structs::*;
use ubtrfs_format::superblock::check_super;
use ubtrfs_format::{CsumType, Key};

#[derive(clap::Args)]
pub struct DumpSuperArgs {
    #[command(flatten)]
    pub image: ImageArgs,
    /// Print every superblock copy that fits on the device (64KiB, 64MiB, 256GiB);
    /// a damaged copy is reported and the others are still printed.
    #[arg(long)]
    pub all: bool,
}

#[derive(clap::Args)]
pub struct DumpTreeArgs {
    #[command(flatten)]
    pub image: ImageArgs,
    /// Dump only this tree: an id or a name (root, extent, chunk, dev, fs, csum, quota,
    /// uuid, free-space, block-group, data-reloc, log). Repeat for several.
    #[arg(long = "tree", short = 't', value_name = "ID|NAME")]
    pub trees: Vec<String>,
    /// Dump only the tree block at this logical address. Repeat for several.
    #[arg(long = "block", short = 'b', value_name = "BYTENR")]
    pub blocks: Vec<u64>,
    /// With --block, also dump every block below it.
    #[arg(long)]
    pub follow: bool,
}

fn out_err(e: io::Error) -> Error {
    Error::io("stdout", e)
}

// ---------------------------------------------------------------------------------
// Shared formatting
// ---------------------------------------------------------------------------------

const HEADER_FLAG_NAMES: &[(u64, &str)] =
    &[(HEADER_FLAG_WRITTEN, "WRITTEN"), (HEADER_FLAG_RELOC, "RELOC")];

const INODE_FLAG_NAMES: &[(u64, &str)] = &[
    (INODE_NODATASUM, "NODATASUM"),
    (INODE_NODATACOW, "NODATACOW"),
    (INODE_READONLY, "READONLY"),
    (INODE_NOCOMPRESS, "NOCOMPRESS"),
    (INODE_PREALLOC, "PREALLOC"),
    (INODE_SYNC, "SYNC"),
    (INODE_IMMUTABLE, "IMMUTABLE"),
    (INODE_APPEND, "APPEND"),
    (INODE_NODUMP, "NODUMP"),
    (INODE_NOATIME, "NOATIME"),
    (INODE_DIRSYNC, "DIRSYNC"),
    (INODE_COMPRESS, "COMPRESS"),
    (INODE_ROOT_ITEM_INIT, "ROOT_ITEM_INIT"),
    (INODE_RO_VERITY, "VERITY"),
];

const ROOT_FLAG_NAMES: &[(u64, &str)] =
    &[(ROOT_SUBVOL_RDONLY, "RDONLY"), (ROOT_SUBVOL_DEAD, "DEAD")];

const EXTENT_FLAG_NAMES: &[(u64, &str)] = &[
    (EXTENT_FLAG_DATA, "DATA"),
    (EXTENT_FLAG_TREE_BLOCK, "TREE_BLOCK"),
    (BLOCK_FLAG_FULL_BACKREF, "FULL_BACKREF"),
];

const DEV_STAT_NAMES: [&str; DEV_STAT_VALUES_MAX] =
    ["write_errs", "read_errs", "flush_errs", "corruption_errs", "generation_errs"];

/// `0x361(MIXED_BACKREF|...)`, `0x0(none)`.
fn flags_str(bits: u64, table: &[(u64, &str)]) -> String {
    let names = flag_names(bits, table);
    format!("{bits:#x}({})", if names.is_empty() { "none" } else { &names })
}

/// A block group / chunk type with its profile: `DATA|single`, `METADATA|DUP`.
fn bg_flags_str(flags: u64) -> String {
    let mut parts = Vec::new();
    for (bit, name) in [
        (BLOCK_GROUP_DATA, "DATA"),
        (BLOCK_GROUP_SYSTEM, "SYSTEM"),
        (BLOCK_GROUP_METADATA, "METADATA"),
    ] {
        if flags & bit != 0 {
            parts.push(name.to_string());
        }
    }
    parts.push(profile_name(flags).to_string());
    let unknown = flags & !(BLOCK_GROUP_TYPE_MASK | BLOCK_GROUP_PROFILE_MASK);
    if unknown != 0 {
        parts.push(format!("unknown({unknown:#x})"));
    }
    parts.join("|")
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(2 + 2 * b.len());
    s.push_str("0x");
    for x in b {
        s.push_str(&format!("{x:02x}"));
    }
    s
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day). Eras of 400
/// years (146097 days) repeat exactly, so the arithmetic works on any i64 input the
/// caller can produce from seconds / 86400 without overflow.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // shift the epoch to 0000-03-01
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `SEC.NSEC (YYYY-MM-DD HH:MM:SS UTC)`; seconds are signed on disk.
fn time_str(ts: &Timespec) -> String {
    let sec = ts.sec.get() as i64;
    format!("{sec}.{:09} ({})", ts.nsec.get(), civil_str(sec))
}

/// `SEC (YYYY-MM-DD HH:MM:SS UTC)` for a bare count of seconds (the replace item's
/// times, unsigned on disk: progs prints them through a signed time_t).
fn seconds_str(sec: u64) -> String {
    format!("{sec} ({})", civil_str(sec as i64))
}

/// `YYYY-MM-DD HH:MM:SS` in UTC.
fn civil_str(sec: i64) -> String {
    let days = sec.div_euclid(86_400);
    let rem = sec.rem_euclid(86_400);
    let (y, mo, d) = civil_from_days(days);
    format!("{y:04}-{mo:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem / 60 % 60, rem % 60)
}

/// A key as `dump-tree` prints it; uuid-tree keys show both halves of the uuid in hex.
fn key_str(k: &Key) -> String {
    if k.type_ == UUID_KEY_SUBVOL || k.type_ == UUID_KEY_RECEIVED_SUBVOL {
        return format!("({:#018x} {} {:#018x})", k.objectid, item_type_name(k.type_), k.offset);
    }
    if k.objectid == DEV_STATS_OBJECTID && k.type_ == PERSISTENT_ITEM_KEY {
        return format!("(DEV_STATS {} {})", item_type_name(k.type_), k.offset);
    }
    k.to_string()
}

fn root_name(id: u64) -> String {
    objectid_name(id, ROOT_ITEM_KEY)
}

fn compression_name(c: u8) -> &'static str {
    match c {
        0 => "none",
        1 => "zlib",
        2 => "lzo",
        3 => "zstd",
        _ => "unknown",
    }
}

fn dir_type_name(t: u8) -> String {
    let base = match t & !FT_ENCRYPTED {
        FT_UNKNOWN => "UNKNOWN",
        FT_REG_FILE => "FILE",
        FT_DIR => "DIR",
        FT_CHRDEV => "CHRDEV",
        FT_BLKDEV => "BLKDEV",
        FT_FIFO => "FIFO",
        FT_SOCK => "SOCK",
        FT_SYMLINK => "SYMLINK",
        FT_XATTR => "XATTR",
        other => return format!("UNKNOWN.{other}"),
    };
    if t & FT_ENCRYPTED != 0 {
        format!("{base}|ENCRYPTED")
    } else {
        base.to_string()
    }
}

/// A qgroup id as `level/id`.
fn qgroup_str(q: u64) -> String {
    format!("{}/{}", q >> 48, q & ((1u64 << 48) - 1))
}

/// Print a chunk's header and stripes at `indent` tabs.
fn print_chunk(o: &mut dyn Write, c: &ChunkView, indent: usize) -> io::Result<()> {
    let t = "\t".repeat(indent);
    writeln!(
        o,
        "{t}length {} owner {} stripe_len {} type {}",
        c.length,
        c.owner,
        c.stripe_len,
        bg_flags_str(c.type_)
    )?;
    writeln!(
        o,
        "{t}io_align {} io_width {} sector_size {}",
        c.io_align, c.io_width, c.sector_size
    )?;
    writeln!(o, "{t}num_stripes {} sub_stripes {}", c.stripes.len(), c.sub_stripes)?;
    for (i, (devid, offset, uuid)) in c.stripes.iter().enumerate() {
        writeln!(o, "{t}\tstripe {i} devid {devid} offset {offset}")?;
        writeln!(o, "{t}\tdev_uuid {}", uuid_str(uuid))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// dump-super
// ---------------------------------------------------------------------------------

/// Print the superblock (or with `--all` every copy) of the image and of every
/// `--device`.
///
/// # Errors
/// `Io` for an unreadable device or stdout; `Incompatible` when there is no btrfs
/// magic; `Corrupt` when a primary copy (or, with `--all`, every copy of a device) is
/// damaged. Every device is printed before the first error is returned.
pub fn run_super(a: &DumpSuperArgs) -> Result<()> {
    let mut o = BufWriter::new(io::stdout().lock());
    let mut first_err: Option<Error> = None;
    for (i, path) in std::iter::once(&a.image.image).chain(&a.image.devices).enumerate() {
        if i > 0 {
            writeln!(o).map_err(out_err)?;
        }
        if let Err(e) = super_of_device(&mut o, path, a.all) {
            if let Error::Io { source, .. } = &e {
                if source.kind() == io::ErrorKind::BrokenPipe {
                    return Err(e);
                }
            }
            first_err.get_or_insert(e);
        }
    }
    o.flush().map_err(out_err)?;
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn super_of_device(o: &mut dyn Write, path: &std::path::Path, all: bool) -> Result<()> {
    let dev = FileDevice::open(path, false)?;
    let name = dev.name().to_string();
    let mirrors: Vec<usize> = (0..SUPER_MIRROR_MAX)
        .filter(|&m| sb_offset(m) + SUPER_INFO_SIZE as u64 <= dev.size())
        .collect();
    if mirrors.is_empty() {
        return Err(Error::Incompatible(format!(
            "{name}: too small for a btrfs superblock ({} bytes)",
            dev.size()
        )));
    }
    let wanted: &[usize] = if all { &mirrors } else { &mirrors[..1] };
    let mut first_err: Option<Error> = None;
    let mut good = 0usize;
    let mut magic_seen = false;
    for (n, &m) in wanted.iter().enumerate() {
        if n > 0 {
            writeln!(o).map_err(out_err)?;
        }
        let off = sb_offset(m);
        let mut buf = vec![0u8; SUPER_INFO_SIZE];
        dev.read_at(&mut buf, off)?;
        let sb: Superblock = *read_prefix::<Superblock>(&buf, "superblock")
            .expect("buffer is exactly SUPER_INFO_SIZE bytes");
        if !all && sb.magic.get() != MAGIC {
            return Err(Error::Incompatible(format!(
                "{name}: not a btrfs filesystem (no btrfs magic at {off})"
            )));
        }
        magic_seen |= sb.magic.get() == MAGIC;
        writeln!(o, "superblock copy {m} at bytenr {off} on {name}").map_err(out_err)?;
        writeln!(o, "---------------------------------------------------------")
            .map_err(out_err)?;
        match check_super(&buf, off) {
            Ok(_) => good += 1,
            Err(c) => {
                let bad_magic = sb.magic.get() != MAGIC;
                writeln!(o, "error: {c}").map_err(out_err)?;
                first_err.get_or_insert(c.into());
                if bad_magic {
                    // Without the magic these bytes are not a superblock; printing them
                    // as fields would only invent meaning.
                    continue;
                }
                writeln!(o, "(fields below are printed as found)").map_err(out_err)?;
            }
        }
        print_super(o, &sb, &buf).map_err(out_err)?;
    }
    match first_err {
        // With --all, one good copy is enough: the damaged ones were reported above.
        Some(_) if all && good > 0 => Ok(()),
        Some(_) if !magic_seen => Err(Error::Incompatible(format!(
            "{name}: not a btrfs filesystem (no copy has the btrfs magic)"
        ))),
        Some(e) => {
            o.flush().map_err(out_err)?;
            if !all {
                eprintln!("ubtrfs: {name}: the primary superblock is damaged; `dump-super --all` shows the other copies");
            }
            Err(e)
        }
        None => Ok(()),
    }
}

fn print_super(o: &mut dyn Write, sb: &Superblock, raw: &[u8]) -> io::Result<()> {
    macro_rules! field {
        ($name:expr, $($v:tt)*) => {
            writeln!(o, "{:<24}{}", $name, format!($($v)*))?
        };
    }
    let csum_type = CsumType::from_raw(sb.csum_type.get());
    match csum_type {
        Some(t) => {
            field!("csum_type", "{} ({})", sb.csum_type.get(), t.name());
            field!("csum_size", "{}", t.size());
            let ok = t.verify(&raw[CSUM_SIZE..SUPER_INFO_SIZE], &sb.csum);
            field!(
                "csum",
                "{} [{}]",
                hex(&sb.csum[..t.size()]),
                if ok { "match" } else { "mismatch" }
            );
        }
        None => {
            field!("csum_type", "{} (unknown)", sb.csum_type.get());
            field!("csum", "{} [not checked]", hex(&sb.csum));
        }
    }
    field!("bytenr", "{}", sb.bytenr.get());
    field!("flags", "{}", flags_str(sb.flags.get(), ubtrfs_format::features::SUPER_FLAG_NAMES));
    let magic = sb.magic.get();
    let magic_text = quote::name(&magic.to_le_bytes()).into_owned();
    field!("magic", "{magic_text} [{}]", if magic == MAGIC { "match" } else { "mismatch" });
    let incompat = sb.incompat_flags.get();
    let has_meta_uuid = incompat & features::INCOMPAT_METADATA_UUID != 0;
    let meta_fsid = if has_meta_uuid { sb.metadata_uuid } else { sb.fsid };
    field!("fsid", "{}", uuid_str(&sb.fsid));
    if has_meta_uuid {
        field!("metadata_uuid", "{}", uuid_str(&sb.metadata_uuid));
    } else {
        field!("metadata_uuid", "{} (same as fsid)", uuid_str(&sb.fsid));
    }
    let label_len = sb.label.iter().position(|&b| b == 0).unwrap_or(LABEL_SIZE);
    field!("label", "{}", quote::name(&sb.label[..label_len]));
    field!("generation", "{}", sb.generation.get());
    field!("root", "{}", sb.root.get());
    field!("sys_array_size", "{}", sb.sys_chunk_array_size.get());
    field!("chunk_root_generation", "{}", sb.chunk_root_generation.get());
    field!("root_level", "{}", sb.root_level);
    field!("chunk_root", "{}", sb.chunk_root.get());
    field!("chunk_root_level", "{}", sb.chunk_root_level);
    field!("log_root", "{}", sb.log_root.get());
    field!("log_root_transid", "{}", sb.log_root_transid.get());
    field!("log_root_level", "{}", sb.log_root_level);
    field!("total_bytes", "{}", sb.total_bytes.get());
    field!("bytes_used", "{}", sb.bytes_used.get());
    field!("sectorsize", "{}", sb.sectorsize.get());
    field!("nodesize", "{}", sb.nodesize.get());
    field!("leafsize", "{}", sb.leafsize.get());
    field!("stripesize", "{}", sb.stripesize.get());
    field!("root_dir", "{}", sb.root_dir_objectid.get());
    field!("num_devices", "{}", sb.num_devices.get());
    field!("compat_flags", "{}", flags_str(sb.compat_flags.get(), &[]));
    field!("compat_ro_flags", "{}", flags_str(sb.compat_ro_flags.get(), COMPAT_RO_NAMES));
    field!("incompat_flags", "{}", flags_str(incompat, INCOMPAT_NAMES));
    field!("cache_generation", "{}", sb.cache_generation.get());
    field!("uuid_tree_generation", "{}", sb.uuid_tree_generation.get());
    if sb.nr_global_roots.get() != 0 {
        field!("nr_global_roots", "{}", sb.nr_global_roots.get());
    }
    let d = &sb.dev_item;
    field!("dev_item.uuid", "{}", uuid_str(&d.uuid));
    field!(
        "dev_item.fsid",
        "{} [{}]",
        uuid_str(&d.fsid),
        if d.fsid == meta_fsid { "match" } else { "mismatch" }
    );
    field!("dev_item.type", "{}", d.type_.get());
    field!("dev_item.total_bytes", "{}", d.total_bytes.get());
    field!("dev_item.bytes_used", "{}", d.bytes_used.get());
    field!("dev_item.io_align", "{}", d.io_align.get());
    field!("dev_item.io_width", "{}", d.io_width.get());
    field!("dev_item.sector_size", "{}", d.sector_size.get());
    field!("dev_item.devid", "{}", d.devid.get());
    field!("dev_item.dev_group", "{}", d.dev_group.get());
    field!("dev_item.seek_speed", "{}", d.seek_speed);
    field!("dev_item.bandwidth", "{}", d.bandwidth);
    field!("dev_item.generation", "{}", d.generation.get());
    field!("dev_item.start_offset", "{}", d.start_offset.get());
    print_sys_chunk_array(o, sb)?;
    writeln!(o, "backup_roots[{NUM_BACKUP_ROOTS}]:")?;
    for (i, b) in sb.super_roots.iter().enumerate() {
        writeln!(o, "\tbackup {i}:")?;
        let rows = [
            ("tree_root", b.tree_root.get(), b.tree_root_gen.get(), b.tree_root_level),
            ("chunk_root", b.chunk_root.get(), b.chunk_root_gen.get(), b.chunk_root_level),
            ("extent_root", b.extent_root.get(), b.extent_root_gen.get(), b.extent_root_level),
            ("fs_root", b.fs_root.get(), b.fs_root_gen.get(), b.fs_root_level),
            ("dev_root", b.dev_root.get(), b.dev_root_gen.get(), b.dev_root_level),
            ("csum_root", b.csum_root.get(), b.csum_root_gen.get(), b.csum_root_level),
        ];
        for (name, bytenr, gen, level) in rows {
            writeln!(o, "\t\t{name:<14}{bytenr} gen {gen} level {level}")?;
        }
        writeln!(o, "\t\t{:<14}{}", "total_bytes", b.total_bytes.get())?;
        writeln!(o, "\t\t{:<14}{}", "bytes_used", b.bytes_used.get())?;
        writeln!(o, "\t\t{:<14}{}", "num_devices", b.num_devices.get())?;
    }
    Ok(())
}

/// Print the sys_chunk_array tolerantly: a damaged superblock is exactly when someone
/// wants to see it, so a bad entry prints an error line and ends the listing.
fn print_sys_chunk_array(o: &mut dyn Write, sb: &Superblock) -> io::Result<()> {
    let size = sb.sys_chunk_array_size.get() as usize;
    writeln!(o, "sys_chunk_array[{size} of {SYSTEM_CHUNK_ARRAY_SIZE} bytes]:")?;
    let arr = &sb.sys_chunk_array[..size.min(SYSTEM_CHUNK_ARRAY_SIZE)];
    let mut pos = 0usize;
    let mut i = 0usize;
    while pos < arr.len() {
        let dk: &DiskKey = match read_prefix(&arr[pos..], "sys_chunk_array key") {
            Ok(k) => k,
            Err(r) => return writeln!(o, "\terror: at offset {pos}: {r}"),
        };
        let key = Key::from(dk);
        writeln!(o, "\titem {i} key {}", key_str(&key))?;
        if key.type_ != CHUNK_ITEM_KEY {
            return writeln!(o, "\terror: at offset {pos}: not a chunk item key");
        }
        pos += core::mem::size_of::<DiskKey>();
        match items::chunk(&arr[pos..]) {
            Ok((c, used)) => {
                print_chunk(o, &c, 2)?;
                pos += used;
            }
            Err(r) => return writeln!(o, "\terror: at offset {pos}: {r}"),
        }
        i += 1;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------
// dump-tree
// ---------------------------------------------------------------------------------

/// Print trees (by default every tree) or single tree blocks.
///
/// # Errors
/// Opening errors; `Posix(Invalid)` for an unknown tree name; after printing
/// everything it could, the first error met while reading blocks.
pub fn run_tree(a: &DumpTreeArgs) -> Result<()> {
    let mut wanted = Vec::new();
    for spec in &a.trees {
        match tree_id_from_name(spec) {
            Some(id) => wanted.push(id),
            None => {
                return Err(Error::posix(
                    PosixKind::Invalid,
                    format!("unknown tree {spec:?} (give a tree id or one of root, extent, chunk, dev, fs, csum, quota, uuid, free-space, block-group, data-reloc, log)"),
                ))
            }
        }
    }
    let fs = a.image.open_raw()?;
    let mut d = Dumper {
        fs: &fs,
        o: BufWriter::new(io::stdout().lock()),
        first_err: None,
        nerr: 0,
        roots: Vec::new(),
        csum_size: fs.csum_type.size(),
        sectorsize: fs.sectorsize,
    };
    let r = if a.trees.is_empty() && a.blocks.is_empty() {
        d.dump_all()
    } else {
        d.dump_selected(&wanted, &a.blocks, a.follow)
    };
    r.and_then(|()| d.o.flush()).map_err(out_err)?;
    let Dumper { first_err, nerr, .. } = d;
    crate::print_warnings(&fs);
    match first_err {
        Some(e) => {
            if nerr > 1 {
                eprintln!("ubtrfs: {nerr} errors while dumping; the first follows");
            }
            Err(e)
        }
        None => Ok(()),
    }
}

struct Dumper<'a, W: Write> {
    fs: &'a FsInfo,
    o: W,
    first_err: Option<Error>,
    nerr: usize,
    /// ROOT_ITEMs met in the leaves just dumped (root tree, log root tree).
    roots: Vec<(Key, RootInfo)>,
    csum_size: usize,
    sectorsize: u32,
}

impl<W: Write> Dumper<'_, W> {
    fn record(&mut self, e: Error) {
        self.nerr += 1;
        if self.first_err.is_none() {
            self.first_err = Some(e);
        }
    }

    fn dump_all(&mut self) -> io::Result<()> {
        writeln!(self.o, "root tree")?;
        self.roots.clear();
        self.dump_tree(&self.fs.tree_root())?;
        let trees = std::mem::take(&mut self.roots);
        writeln!(self.o, "chunk tree")?;
        self.dump_tree(&self.fs.chunk_root())?;
        // Like btrfs-progs: the log root tree right after the chunk tree, the log
        // trees it lists after every other tree.
        let logs = self.dump_log_root()?;
        for (key, ri) in trees {
            writeln!(self.o, "{} key {}", tree_title(&key), key_str(&key))?;
            self.dump_tree(&ri)?;
        }
        self.dump_logs(logs)?;
        let sb = self.fs.super_copy();
        writeln!(self.o, "total bytes {}", sb.total_bytes.get())?;
        writeln!(self.o, "bytes used {}", sb.bytes_used.get())?;
        writeln!(self.o, "uuid {}", uuid_str(&sb.fsid))
    }

    /// The log root tree; returns the per-subvolume log trees it lists.
    fn dump_log_root(&mut self) -> io::Result<Vec<(Key, RootInfo)>> {
        let Some(log) = self.fs.log_root() else { return Ok(Vec::new()) };
        writeln!(self.o, "log root tree")?;
        self.roots.clear();
        self.dump_tree(&log)?;
        Ok(std::mem::take(&mut self.roots))
    }

    fn dump_logs(&mut self, logs: Vec<(Key, RootInfo)>) -> io::Result<()> {
        for (key, ri) in logs {
            writeln!(self.o, "log tree key {}", key_str(&key))?;
            self.dump_tree(&ri)?;
        }
        Ok(())
    }

    fn dump_selected(&mut self, ids: &[u64], blocks: &[u64], follow: bool) -> io::Result<()> {
        for &id in ids {
            match id {
                ROOT_TREE_OBJECTID => {
                    writeln!(self.o, "root tree")?;
                    self.dump_tree(&self.fs.tree_root())?;
                }
                CHUNK_TREE_OBJECTID => {
                    writeln!(self.o, "chunk tree")?;
                    self.dump_tree(&self.fs.chunk_root())?;
                }
                TREE_LOG_OBJECTID => {
                    if self.fs.log_root().is_none() {
                        writeln!(self.o, "error: no log tree (superblock log_root is 0)")?;
                        self.record(Error::posix(
                            PosixKind::NotFound,
                            "log tree (superblock log_root is 0)",
                        ));
                    }
                    let logs = self.dump_log_root()?;
                    self.dump_logs(logs)?;
                }
                _ => match self.fs.read_root(id) {
                    Ok((ri, _)) => {
                        // read_root finds the first ROOT_ITEM of `id`; show its real key.
                        let key = self.root_item_key(id);
                        writeln!(self.o, "{} key {}", tree_title(&key), key_str(&key))?;
                        self.dump_tree(&ri)?;
                    }
                    Err(e) => {
                        writeln!(self.o, "error: {e}")?;
                        self.record(e);
                    }
                },
            }
        }
        for &b in blocks {
            self.dump_block(b, &Expect::default(), None, follow)?;
        }
        Ok(())
    }

    fn root_item_key(&self, id: u64) -> Key {
        let fallback = Key::new(id, ROOT_ITEM_KEY, 0);
        match self.fs.iter(&self.fs.tree_root(), fallback) {
            Ok(mut it) => match it.next_item() {
                Ok(Some(item))
                    if item.key().objectid == id && item.key().type_ == ROOT_ITEM_KEY =>
                {
                    item.key()
                }
                _ => fallback,
            },
            Err(_) => fallback,
        }
    }

    fn dump_tree(&mut self, root: &RootInfo) -> io::Result<()> {
        if root.level >= MAX_LEVEL {
            let e = ubtrfs_format::Corrupt::new(
                ubtrfs_format::CorruptWhere::Block,
                format!("root level {} too big", root.level),
            )
            .block(root.bytenr)
            .root(root.id);
            writeln!(self.o, "error: tree {} root block {}: {e}", root_name(root.id), root.bytenr)?;
            self.record(e.into());
            return Ok(());
        }
        let expect = Expect {
            level: Some(root.level),
            generation: Some(root.generation),
            owner: Some(root.id),
            first_key: None,
        };
        self.dump_block(root.bytenr, &expect, None, true)
    }

    /// Print one block and, when `follow`, its children depth-first. `parent` is
    /// (node bytenr, slot) for the error line of a child that cannot be read.
    fn dump_block(
        &mut self,
        bytenr: u64,
        expect: &Expect,
        parent: Option<(u64, usize)>,
        follow: bool,
    ) -> io::Result<()> {
        let eb = match self.fs.read_tree_block(bytenr, expect) {
            Ok(eb) => eb,
            Err(e) => {
                match parent {
                    Some((p, slot)) => writeln!(
                        self.o,
                        "error: tree block {bytenr} (slot {slot} of node {p}): {e}"
                    )?,
                    None => writeln!(self.o, "error: tree block {bytenr}: {e}")?,
                }
                self.record(e);
                return Ok(());
            }
        };
        self.print_header(&eb)?;
        let n = eb.node();
        if n.is_leaf() {
            return self.print_leaf(&eb);
        }
        for slot in 0..n.nritems() {
            writeln!(
                self.o,
                "\tkey {} block {} gen {}",
                key_str(&n.key(slot)),
                n.blockptr(slot),
                n.ptr_generation(slot)
            )?;
        }
        if !follow {
            return Ok(());
        }
        let owner = expect.owner.unwrap_or_else(|| n.owner());
        for slot in 0..n.nritems() {
            // The tree checker accepted this node, so its level is in 1..MAX_LEVEL and
            // the child's expected level is one lower: recursion depth is bounded.
            let child = Expect {
                level: Some(n.level() - 1),
                generation: Some(n.ptr_generation(slot)),
                owner: Some(owner),
                first_key: Some(n.key(slot)),
            };
            self.dump_block(n.blockptr(slot), &child, Some((eb.bytenr, slot)), true)?;
        }
        Ok(())
    }

    fn print_header(&mut self, eb: &ExtentBuffer) -> io::Result<()> {
        let n = eb.node();
        let h = n.header();
        let owner = root_name(n.owner());
        if n.is_leaf() {
            writeln!(
                self.o,
                "leaf {} items {} free space {} generation {} owner {owner}",
                eb.bytenr,
                n.nritems(),
                n.leaf_free_space(),
                n.generation()
            )?;
        } else {
            let free = max_node_ptrs(self.fs.nodesize).saturating_sub(n.nritems());
            writeln!(
                self.o,
                "node {} level {} items {} free {free} generation {} owner {owner}",
                eb.bytenr,
                n.level(),
                n.nritems(),
                n.generation()
            )?;
        }
        let flags = h.flags.get();
        let rev = flags >> BACKREF_REV_SHIFT;
        writeln!(
            self.o,
            "{} {} flags {} backref revision {rev}",
            if n.is_leaf() { "leaf" } else { "node" },
            eb.bytenr,
            flags_str(flags & ((1 << BACKREF_REV_SHIFT) - 1), HEADER_FLAG_NAMES)
        )?;
        writeln!(self.o, "fs uuid {}", uuid_str(&h.fsid))?;
        writeln!(self.o, "chunk uuid {}", uuid_str(&h.chunk_tree_uuid))
    }

    fn print_leaf(&mut self, eb: &Arc<ExtentBuffer>) -> io::Result<()> {
        let n = eb.node();
        for slot in 0..n.nritems() {
            let it = n.item(slot);
            let key = n.key(slot);
            writeln!(
                self.o,
                "\titem {slot} key {} itemoff {} itemsize {}",
                key_str(&key),
                it.offset.get(),
                it.size.get()
            )?;
            let data = n.item_data(slot);
            let cx = BodyCtx { csum_size: self.csum_size, sectorsize: self.sectorsize };
            print_body(&mut self.o, &key, data, &cx)?;
            if key.type_ == ROOT_ITEM_KEY
                && (n.owner() == ROOT_TREE_OBJECTID || n.owner() == TREE_LOG_OBJECTID)
            {
                if let Ok(v) = items::root_item(data) {
                    self.roots.push((
                        key,
                        RootInfo {
                            id: key.objectid,
                            bytenr: v.item.bytenr.get(),
                            level: v.item.level,
                            generation: v.item.generation.get(),
                        },
                    ));
                }
            }
        }
        Ok(())
    }
}

/// How `dump-tree` titles a tree found through its ROOT_ITEM.
fn tree_title(key: &Key) -> String {
    let t = match key.objectid {
        ROOT_TREE_OBJECTID => "root tree",
        EXTENT_TREE_OBJECTID => "extent tree",
        CHUNK_TREE_OBJECTID => "chunk tree",
        DEV_TREE_OBJECTID => "device tree",
        FS_TREE_OBJECTID => "fs tree",
        CSUM_TREE_OBJECTID => "checksum tree",
        QUOTA_TREE_OBJECTID => "quota tree",
        UUID_TREE_OBJECTID => "uuid tree",
        FREE_SPACE_TREE_OBJECTID => "free space tree",
        BLOCK_GROUP_TREE_OBJECTID => "block group tree",
        RAID_STRIPE_TREE_OBJECTID => "raid stripe tree",
        TREE_LOG_OBJECTID => "log tree",
        TREE_RELOC_OBJECTID => "reloc tree",
        DATA_RELOC_TREE_OBJECTID => "data reloc tree",
        FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID => "file tree",
        _ => "tree",
    };
    t.to_string()
}

// ---------------------------------------------------------------------------------
// Item bodies
// ---------------------------------------------------------------------------------

struct BodyCtx {
    csum_size: usize,
    sectorsize: u32,
}

/// Print the decoded body of one item, two tabs deep. Every parser is total: bytes a
/// type does not fit print an `invalid item` line instead of failing.
fn print_body(o: &mut dyn Write, key: &Key, data: &[u8], cx: &BodyCtx) -> io::Result<()> {
    match body(o, key, data, cx) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(reason)) => writeln!(o, "\t\tinvalid item: {reason}"),
        Err(e) => Err(e),
    }
}

type BodyResult = io::Result<core::result::Result<(), String>>;

macro_rules! parse {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(r) => return Ok(Err(r)),
        }
    };
}

fn body(o: &mut dyn Write, key: &Key, data: &[u8], cx: &BodyCtx) -> BodyResult {
    match key.type_ {
        INODE_ITEM_KEY => {
            let ii: &InodeItem = parse!(read_prefix(data, "inode item"));
            print_inode(o, ii)?;
        }
        INODE_REF_KEY => {
            for r in items::inode_refs(data, key.offset) {
                let r = parse!(r);
                writeln!(
                    o,
                    "\t\tindex {} namelen {} name: {}",
                    r.index,
                    r.name.len(),
                    quote::name(r.name)
                )?;
            }
        }
        INODE_EXTREF_KEY => {
            for r in items::inode_extrefs(data) {
                let r = parse!(r);
                writeln!(
                    o,
                    "\t\tindex {} parent {} namelen {} name: {}",
                    r.index,
                    r.parent,
                    r.name.len(),
                    quote::name(r.name)
                )?;
            }
        }
        DIR_ITEM_KEY | DIR_INDEX_KEY | XATTR_ITEM_KEY => {
            for e in items::dir_entries(data) {
                let e = parse!(e);
                writeln!(
                    o,
                    "\t\tlocation key {} type {}",
                    key_str(&e.location),
                    dir_type_name(e.type_)
                )?;
                writeln!(
                    o,
                    "\t\ttransid {} data_len {} name_len {}",
                    e.transid,
                    e.data.len(),
                    e.name.len()
                )?;
                writeln!(o, "\t\tname: {}", quote::name(e.name))?;
                if !e.data.is_empty() {
                    writeln!(o, "\t\tdata {}", quote::name(e.data))?;
                }
            }
        }
        DIR_LOG_ITEM_KEY | DIR_LOG_INDEX_KEY => {
            let end: &[u8; 8] = parse!(read_prefix(data, "dir log item"));
            writeln!(o, "\t\tdir log end {}", u64::from_le_bytes(*end))?;
        }
        ORPHAN_ITEM_KEY => writeln!(o, "\t\torphan item for objectid {}", key.offset)?,
        EXTENT_DATA_KEY => print_file_extent(o, parse!(items::file_extent(data)))?,
        EXTENT_CSUM_KEY | CSUM_ITEM_KEY => {
            let n = data.len() / cx.csum_size.max(1);
            let len = (n as u64).saturating_mul(u64::from(cx.sectorsize));
            writeln!(
                o,
                "\t\trange start {} end {} length {len} ({n} csums of {} bytes)",
                key.offset,
                key.offset.saturating_add(len),
                cx.csum_size
            )?;
        }
        ROOT_ITEM_KEY => print_root_item(o, data)?,
        ROOT_REF_KEY | ROOT_BACKREF_KEY => {
            let r = parse!(items::root_ref(data));
            let what = if key.type_ == ROOT_REF_KEY { "root ref" } else { "root backref" };
            writeln!(
                o,
                "\t\t{what} dirid {} sequence {} name {}",
                r.dirid,
                r.sequence,
                quote::name(r.name)
            )?;
        }
        EXTENT_ITEM_KEY | METADATA_ITEM_KEY => {
            let skinny = key.type_ == METADATA_ITEM_KEY;
            let v = parse!(items::extent_item(data, skinny));
            writeln!(
                o,
                "\t\trefs {} gen {} flags {}",
                v.refs,
                v.generation,
                flag_names(v.flags, EXTENT_FLAG_NAMES)
            )?;
            if skinny {
                writeln!(o, "\t\ttree block skinny level {}", key.offset)?;
            } else if let Some((k, level)) = v.tree_block_info {
                writeln!(o, "\t\ttree block key {} level {level}", key_str(&k))?;
            }
            for r in &v.inline_refs {
                print_inline_ref(o, r)?;
            }
        }
        TREE_BLOCK_REF_KEY => writeln!(o, "\t\ttree block backref root {}", root_name(key.offset))?,
        SHARED_BLOCK_REF_KEY => writeln!(o, "\t\tshared block backref parent {}", key.offset)?,
        EXTENT_DATA_REF_KEY => {
            let r: &ExtentDataRef = parse!(read_prefix(data, "extent data ref"));
            writeln!(
                o,
                "\t\textent data backref root {} objectid {} offset {} count {}",
                root_name(r.root.get()),
                r.objectid.get(),
                r.offset.get(),
                r.count.get()
            )?;
        }
        SHARED_DATA_REF_KEY => {
            let r: &SharedDataRef = parse!(read_prefix(data, "shared data ref"));
            writeln!(o, "\t\tshared data backref parent {} count {}", key.offset, r.count.get())?;
        }
        EXTENT_REF_V0_KEY => {
            let r: &ExtentRefV0 = parse!(read_prefix(data, "extent ref v0"));
            writeln!(
                o,
                "\t\textent ref v0 root {} generation {} objectid {} count {}",
                root_name(r.root.get()),
                r.generation.get(),
                r.objectid.get(),
                r.count.get()
            )?;
        }
        BLOCK_GROUP_ITEM_KEY => {
            let b: &BlockGroupItem = parse!(read_prefix(data, "block group item"));
            writeln!(
                o,
                "\t\tblock group used {} chunk_objectid {} flags {}",
                b.used.get(),
                b.chunk_objectid.get(),
                bg_flags_str(b.flags.get())
            )?;
        }
        FREE_SPACE_INFO_KEY => {
            let f: &FreeSpaceInfo = parse!(read_prefix(data, "free space info"));
            let flags = u64::from(f.flags.get());
            writeln!(
                o,
                "\t\tfree space info extent count {} flags {}",
                f.extent_count.get(),
                flags_str(flags, &[(u64::from(FREE_SPACE_USING_BITMAPS), "USING_BITMAPS")])
            )?;
        }
        FREE_SPACE_EXTENT_KEY => writeln!(
            o,
            "\t\tfree space extent start {} end {}",
            key.objectid,
            key.objectid.saturating_add(key.offset)
        )?,
        FREE_SPACE_BITMAP_KEY => {
            let sectors = key.offset / u64::from(cx.sectorsize.max(1));
            let mut free = 0u64;
            for i in 0..sectors.min(data.len() as u64 * 8) {
                if data[(i / 8) as usize] & (1 << (i % 8)) != 0 {
                    free += 1;
                }
            }
            writeln!(o, "\t\tfree space bitmap: {free} of {sectors} sectors free")?;
        }
        DEV_EXTENT_KEY => {
            let d: &DevExtent = parse!(read_prefix(data, "dev extent"));
            writeln!(
                o,
                "\t\tdev extent chunk_tree {} chunk_objectid {} chunk_offset {} length {}",
                d.chunk_tree.get(),
                d.chunk_objectid.get(),
                d.chunk_offset.get(),
                d.length.get()
            )?;
            writeln!(o, "\t\tchunk_tree_uuid {}", uuid_str(&d.chunk_tree_uuid))?;
        }
        DEV_ITEM_KEY => {
            let d: &DevItem = parse!(read_prefix(data, "dev item"));
            writeln!(
                o,
                "\t\tdevid {} total_bytes {} bytes_used {}",
                d.devid.get(),
                d.total_bytes.get(),
                d.bytes_used.get()
            )?;
            writeln!(
                o,
                "\t\tio_align {} io_width {} sector_size {} type {}",
                d.io_align.get(),
                d.io_width.get(),
                d.sector_size.get(),
                d.type_.get()
            )?;
            writeln!(
                o,
                "\t\tgeneration {} start_offset {} dev_group {}",
                d.generation.get(),
                d.start_offset.get(),
                d.dev_group.get()
            )?;
            writeln!(o, "\t\tseek_speed {} bandwidth {}", d.seek_speed, d.bandwidth)?;
            writeln!(o, "\t\tuuid {}", uuid_str(&d.uuid))?;
            writeln!(o, "\t\tfsid {}", uuid_str(&d.fsid))?;
        }
        CHUNK_ITEM_KEY => {
            let (c, _) = parse!(items::chunk(data));
            print_chunk(o, &c, 2)?;
        }
        RAID_STRIPE_KEY => {
            // Older raid-stripe items carry an 8-byte encoding header before the strides.
            let strides = if data.len() % 16 == 8 { &data[8..] } else { data };
            for (i, s) in strides.chunks_exact(16).enumerate() {
                let s: &RaidStride = parse!(read_prefix(s, "raid stride"));
                writeln!(
                    o,
                    "\t\tstride {i} devid {} physical {}",
                    s.devid.get(),
                    s.physical.get()
                )?;
            }
        }
        UUID_KEY_SUBVOL | UUID_KEY_RECEIVED_SUBVOL => {
            let what =
                if key.type_ == UUID_KEY_SUBVOL { "subvol_id" } else { "received_subvol_id" };
            for id in parse!(items::uuid_item_ids(data)) {
                writeln!(o, "\t\t{what} {id}")?;
            }
        }
        QGROUP_STATUS_KEY => {
            let s: &QgroupStatusItem = parse!(read_prefix(data, "qgroup status"));
            writeln!(
                o,
                "\t\tqgroup status version {} generation {} flags {}",
                s.version.get(),
                s.generation.get(),
                flags_str(s.flags.get(), QGROUP_STATUS_FLAG_NAMES)
            )?;
            writeln!(o, "\t\trescan {} enable_gen {}", s.rescan.get(), s.enable_gen.get())?;
        }
        QGROUP_INFO_KEY => {
            let q: &QgroupInfoItem = parse!(read_prefix(data, "qgroup info"));
            writeln!(
                o,
                "\t\tqgroup info {} generation {}",
                qgroup_str(key.offset),
                q.generation.get()
            )?;
            writeln!(
                o,
                "\t\treferenced {} referenced_compressed {}",
                q.rfer.get(),
                q.rfer_cmpr.get()
            )?;
            writeln!(
                o,
                "\t\texclusive {} exclusive_compressed {}",
                q.excl.get(),
                q.excl_cmpr.get()
            )?;
        }
        QGROUP_LIMIT_KEY => {
            let q: &QgroupLimitItem = parse!(read_prefix(data, "qgroup limit"));
            writeln!(o, "\t\tqgroup limit {} flags {:#x}", qgroup_str(key.offset), q.flags.get())?;
            writeln!(
                o,
                "\t\tmax_referenced {} max_exclusive {}",
                q.max_rfer.get(),
                q.max_excl.get()
            )?;
            writeln!(
                o,
                "\t\trsv_referenced {} rsv_exclusive {}",
                q.rsv_rfer.get(),
                q.rsv_excl.get()
            )?;
        }
        QGROUP_RELATION_KEY => writeln!(
            o,
            "\t\tqgroup relation {} -> {}",
            qgroup_str(key.objectid),
            qgroup_str(key.offset)
        )?,
        PERSISTENT_ITEM_KEY if key.objectid == DEV_STATS_OBJECTID => {
            writeln!(o, "\t\tdevice stats of devid {}", key.offset)?;
            let vals: Vec<String> = data
                .chunks_exact(8)
                .zip(DEV_STAT_NAMES)
                .map(|(c, name)| {
                    format!(
                        "{name} {}",
                        u64::from_le_bytes(c.try_into().expect("chunks_exact gives 8 bytes"))
                    )
                })
                .collect();
            writeln!(o, "\t\t{}", vals.join(" "))?;
        }
        TEMPORARY_ITEM_KEY if key.objectid == BALANCE_OBJECTID => {
            let b: &BalanceItem = parse!(read_prefix(data, "balance item"));
            writeln!(o, "\t\tbalance flags {:#x}", b.flags.get())?;
            for (name, a) in [("data", &b.data), ("metadata", &b.meta), ("system", &b.sys)] {
                writeln!(
                    o,
                    "\t\t{name}: profiles {:#x} usage {} devid {} pstart {} pend {} vstart {} vend {}",
                    a.profiles.get(),
                    a.usage.get(),
                    a.devid.get(),
                    a.pstart.get(),
                    a.pend.get(),
                    a.vstart.get(),
                    a.vend.get()
                )?;
                writeln!(
                    o,
                    "\t\t{name}: target {:#x} flags {:#x} limit {} stripes_min {} stripes_max {}",
                    a.target.get(),
                    a.flags.get(),
                    a.limit.get(),
                    a.stripes_min.get(),
                    a.stripes_max.get()
                )?;
            }
        }
        DEV_REPLACE_KEY => {
            // btrfs-progs' print_dev_replace_item, except that the stop time is the
            // item's time_stopped (progs prints time_started twice).
            let r: &DevReplaceItem = parse!(read_prefix(data, "dev replace item"));
            let mode = match r.cont_reading_from_srcdev_mode.get() {
                DEV_REPLACE_ITEM_CONT_READING_FROM_SRCDEV_MODE_ALWAYS => "ALWAYS".to_string(),
                DEV_REPLACE_ITEM_CONT_READING_FROM_SRCDEV_MODE_AVOID => "AVOID".to_string(),
                m => format!("unknown value({m})"),
            };
            let state = dev_replace_state_name(r.replace_state.get())
                .map(str::to_string)
                .unwrap_or_else(|| format!("unknown value({})", r.replace_state.get()));
            writeln!(
                o,
                "\t\tsrc devid {} cursor left {} cursor right {} mode {mode}",
                r.src_devid.get() as i64,
                r.cursor_left.get(),
                r.cursor_right.get()
            )?;
            writeln!(
                o,
                "\t\tstate {state} write errors {} uncorrectable read errors {}",
                r.num_write_errors.get(),
                r.num_uncorrectable_read_errors.get()
            )?;
            writeln!(o, "\t\tstart time {}", seconds_str(r.time_started.get()))?;
            writeln!(o, "\t\tstop time {}", seconds_str(r.time_stopped.get()))?;
        }
        VERITY_DESC_ITEM_KEY if key.offset == 0 => {
            let v: &VerityDescriptorItem = parse!(read_prefix(data, "verity descriptor item"));
            writeln!(o, "\t\tverity descriptor size {} encryption {}", v.size.get(), v.encryption)?;
        }
        STRING_ITEM_KEY => writeln!(o, "\t\tstring {}", quote::name(data))?,
        0 if key.objectid == FREE_SPACE_OBJECTID => {
            let h: &FreeSpaceHeader = parse!(read_prefix(data, "free space header"));
            writeln!(o, "\t\tlocation key {}", key_str(&Key::from(&h.location)))?;
            writeln!(
                o,
                "\t\tcache generation {} entries {} bitmaps {}",
                h.generation.get(),
                h.num_entries.get(),
                h.num_bitmaps.get()
            )?;
        }
        _ => writeln!(o, "\t\titem data {} bytes", data.len())?,
    }
    Ok(Ok(()))
}

fn print_inode(o: &mut dyn Write, ii: &InodeItem) -> io::Result<()> {
    writeln!(
        o,
        "\t\tgeneration {} transid {} size {} nbytes {}",
        ii.generation.get(),
        ii.transid.get(),
        ii.size.get(),
        ii.nbytes.get()
    )?;
    let rdev = ii.rdev.get();
    let rdev_s = if rdev == 0 {
        "0".to_string()
    } else {
        let (maj, min) = rdev_decode(rdev);
        format!("{rdev} ({maj}:{min})")
    };
    writeln!(
        o,
        "\t\tblock group {} mode {:o} links {} uid {} gid {} rdev {rdev_s}",
        ii.block_group.get(),
        ii.mode.get(),
        ii.nlink.get(),
        ii.uid.get(),
        ii.gid.get()
    )?;
    writeln!(
        o,
        "\t\tsequence {} flags {}",
        ii.sequence.get(),
        flags_str(ii.flags.get(), INODE_FLAG_NAMES)
    )?;
    for (name, t) in
        [("atime", &ii.atime), ("ctime", &ii.ctime), ("mtime", &ii.mtime), ("otime", &ii.otime)]
    {
        writeln!(o, "\t\t{name} {}", time_str(t))?;
    }
    Ok(())
}

fn print_file_extent(o: &mut dyn Write, fe: FileExtent<'_>) -> io::Result<()> {
    match fe {
        FileExtent::Inline { generation, ram_bytes, compression, data } => {
            writeln!(o, "\t\tgeneration {generation} type {FILE_EXTENT_INLINE} (inline)")?;
            writeln!(o, "\t\tinline extent data size {} ram_bytes {ram_bytes} compression {compression} ({})", data.len(), compression_name(compression))?;
        }
        FileExtent::Regular {
            generation,
            ram_bytes,
            compression,
            prealloc,
            disk_bytenr,
            disk_num_bytes,
            offset,
            num_bytes,
        } => {
            let (t, name) = if prealloc {
                (FILE_EXTENT_PREALLOC, "prealloc")
            } else {
                (FILE_EXTENT_REG, "regular")
            };
            writeln!(o, "\t\tgeneration {generation} type {t} ({name})")?;
            writeln!(
                o,
                "\t\textent data disk byte {disk_bytenr} nr {disk_num_bytes}{}",
                if disk_bytenr == 0 { " (hole)" } else { "" }
            )?;
            writeln!(o, "\t\textent data offset {offset} nr {num_bytes} ram {ram_bytes}")?;
            writeln!(
                o,
                "\t\textent compression {compression} ({})",
                compression_name(compression)
            )?;
        }
    }
    Ok(())
}

fn print_root_item(o: &mut dyn Write, data: &[u8]) -> io::Result<()> {
    let v = match items::root_item(data) {
        Ok(v) => v,
        Err(r) => return writeln!(o, "\t\tinvalid item: {r}"),
    };
    let r = &v.item;
    writeln!(
        o,
        "\t\tgeneration {} root_dirid {} bytenr {} byte_limit {} bytes_used {}",
        r.generation.get(),
        r.root_dirid.get(),
        r.bytenr.get(),
        r.byte_limit.get(),
        r.bytes_used.get()
    )?;
    writeln!(
        o,
        "\t\tlast_snapshot {} flags {} refs {}",
        r.last_snapshot.get(),
        flags_str(r.flags.get(), ROOT_FLAG_NAMES),
        r.refs.get()
    )?;
    writeln!(
        o,
        "\t\tdrop_progress key {} drop_level {}",
        key_str(&Key::from(&r.drop_progress)),
        r.drop_level
    )?;
    writeln!(o, "\t\tlevel {} generation_v2 {}", r.level, r.generation_v2.get())?;
    if data.len() == ROOT_ITEM_V1_SIZE {
        return writeln!(o, "\t\t(old root item without uuids and times)");
    }
    writeln!(o, "\t\tuuid {}", uuid_str(&r.uuid))?;
    writeln!(o, "\t\tparent_uuid {}", uuid_str(&r.parent_uuid))?;
    writeln!(o, "\t\treceived_uuid {}", uuid_str(&r.received_uuid))?;
    writeln!(
        o,
        "\t\tctransid {} otransid {} stransid {} rtransid {}",
        r.ctransid.get(),
        r.otransid.get(),
        r.stransid.get(),
        r.rtransid.get()
    )?;
    for (name, t) in
        [("ctime", &r.ctime), ("otime", &r.otime), ("stime", &r.stime), ("rtime", &r.rtime)]
    {
        writeln!(o, "\t\t{name} {}", time_str(t))?;
    }
    Ok(())
}

fn print_inline_ref(o: &mut dyn Write, r: &InlineRef) -> io::Result<()> {
    match *r {
        InlineRef::TreeBlock { root } => {
            writeln!(o, "\t\ttree block backref root {}", root_name(root))
        }
        InlineRef::SharedBlock { parent } => {
            writeln!(o, "\t\tshared block backref parent {parent}")
        }
        InlineRef::ExtentData { root, objectid, offset, count } => writeln!(
            o,
            "\t\textent data backref root {} objectid {objectid} offset {offset} count {count}",
            root_name(root)
        ),
        InlineRef::SharedData { parent, count } => {
            writeln!(o, "\t\tshared data backref parent {parent} count {count}")
        }
        InlineRef::Owner { root } => writeln!(o, "\t\textent owner root {}", root_name(root)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(47_482), (2100, 1, 1));
        // Extremes must not overflow.
        let _ = civil_from_days(i64::MAX / 86_400);
        let _ = civil_from_days(i64::MIN / 86_400 - 1);
    }

    #[test]
    fn flag_strings() {
        assert_eq!(flags_str(0, INODE_FLAG_NAMES), "0x0(none)");
        assert_eq!(bg_flags_str(BLOCK_GROUP_METADATA | BLOCK_GROUP_DUP), "METADATA|DUP");
        assert_eq!(bg_flags_str(BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA), "DATA|METADATA|single");
        assert_eq!(qgroup_str((1 << 48) | 5), "1/5");
    }
}
