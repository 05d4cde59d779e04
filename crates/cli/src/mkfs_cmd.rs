//! `ubtrfs mkfs`: the images or devices, their sizes, signatures and cleanup, and the
//! summary printed; the filesystem itself is `ubtrfs_tools::mkfs`'s.
//!
//! Every target is looked at (size, in use, signatures) before any is touched. A
//! failed mkfs leaves nothing half-made: every image file it created is removed; the
//! existing files or devices it had begun writing have their superblocks wiped and are
//! named as not usable.

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use ubtrfs_core::{Error, FileDevice, PosixKind, Result};
use ubtrfs_format::structs::*;
use ubtrfs_tools::mkfs::{options, signature, MkfsDevice, MkfsFailure, MkfsOptions};

#[derive(clap::Args)]
pub struct MkfsArgs {
    /// The image files (made if missing; need --size then) or block devices; several
    /// make one filesystem, devids 1, 2, ... in this order.
    #[arg(required = true, value_name = "IMAGE")]
    pub images: Vec<PathBuf>,
    /// Size of each device (`256M`, `1G`): a missing image is created at it, a smaller
    /// one grown to it; default the whole file or device.
    #[arg(short = 'b', long, value_name = "SIZE")]
    pub size: Option<String>,
    /// Tree block size, 4K to 64K and at least the sector size [default: 16K, the
    /// sector size with --mixed].
    #[arg(short = 'n', long, value_name = "SIZE")]
    pub nodesize: Option<String>,
    /// Data block size: 4096, or the page size.
    #[arg(short = 's', long, default_value = "4K", value_name = "SIZE")]
    pub sectorsize: String,
    /// Checksum algorithm: crc32c, xxhash, sha256 or blake2.
    #[arg(long, visible_alias = "checksum", default_value = "crc32c", value_name = "ALG")]
    pub csum: String,
    /// Filesystem label (at most 255 bytes).
    #[arg(short = 'L', long)]
    pub label: Option<String>,
    /// Filesystem UUID (random by default).
    #[arg(short = 'U', long)]
    pub uuid: Option<String>,
    /// Data profile: single (default), dup, raid0, raid1 (2 devices or more), raid1c3
    /// (3), raid1c4 (4) or raid10 (2). With --mixed, data and metadata share one profile.
    #[arg(short = 'd', long, value_name = "PROFILE")]
    pub data: Option<String>,
    /// Metadata (and system) profile, one of the data profiles [default: dup on one
    /// device, raid1 on several, single with --mixed].
    #[arg(short = 'm', long, value_name = "PROFILE")]
    pub metadata: Option<String>,
    /// Comma-separated features to add (block-group-tree) or, with ^, remove
    /// (^no-holes, ^extref). The default is extref, skinny-metadata, no-holes and
    /// free-space-tree.
    #[arg(short = 'O', long, value_name = "LIST")]
    pub features: Option<String>,
    /// Mixed data and metadata block groups (for small filesystems; the node size is
    /// the sector size).
    #[arg(short = 'M', long)]
    pub mixed: bool,
    /// Copy this directory's tree into the new filesystem (contents with holes kept,
    /// modes, owners, times, hard links, symlinks, xattrs, special files).
    #[arg(short = 'r', long, value_name = "DIR")]
    pub rootdir: Option<PathBuf>,
    /// With --rootdir: make this directory of it (a path relative to DIR) a
    /// subvolume; repeat for each.
    #[arg(long, value_name = "PATH", requires = "rootdir")]
    pub subvol: Vec<String>,
    /// With --rootdir: make the subvolume at this path (relative to DIR, one of the
    /// --subvol ones) the default one a mount shows.
    #[arg(long, value_name = "PATH", requires = "rootdir")]
    pub default_subvol: Option<String>,
    /// With --rootdir: map host owners to the image's, one mapping per line:
    /// `u HOST IMAGE [COUNT]` or `g HOST IMAGE [COUNT]`.
    #[arg(long, value_name = "FILE", requires = "rootdir", conflicts_with = "force_owner")]
    pub owner_map: Option<PathBuf>,
    /// With --rootdir: every file belongs to UID:GID (a rootless build's files made
    /// root's with 0:0).
    #[arg(long, value_name = "UID:GID", requires = "rootdir")]
    pub force_owner: Option<String>,
    /// With --rootdir: compress the files copied in (zlib, lzo, zstd, with a level
    /// as zstd:3), as mount -o compress= does.
    #[arg(long, value_name = "ALG[:LEVEL]", requires = "rootdir")]
    pub compress: Option<String>,
    /// Make the filesystem no larger than it needs: small chunks, then the image file
    /// (or the filesystem on a block device) cut to the end of the last one.
    #[arg(long)]
    pub shrink: bool,
    /// The same input gives the same bytes: times from SOURCE_DATE_EPOCH (0 when it
    /// is unset), UUIDs derived from the tree and the label. Implied by
    /// SOURCE_DATE_EPOCH in the environment.
    #[arg(long)]
    pub reproducible: bool,
    /// Overwrite an existing filesystem or partition table.
    #[arg(short = 'f', long)]
    pub force: bool,
    /// Print nothing on success.
    #[arg(short = 'q', long)]
    pub quiet: bool,
}

fn options_from(a: &MkfsArgs, ndevs: usize) -> Result<MkfsOptions> {
    let num = |what: &str, s: &str| -> Result<u32> {
        let v = options::parse_size(what, s)?;
        u32::try_from(v).map_err(|_| {
            Error::posix_detail(PosixKind::Invalid, format!("{what} {s}"), "too large")
        })
    };
    let mut features =
        a.features.as_deref().map(options::Features::parse).transpose()?.unwrap_or_default();
    features.mixed |= a.mixed;
    let sectorsize = num("sectorsize", &a.sectorsize)?;
    let nodesize = match &a.nodesize {
        Some(n) => num("nodesize", n)?,
        None if features.mixed => sectorsize,
        None => 16384,
    };
    let data = a.data.as_deref().map(options::parse_profile).transpose()?;
    let metadata = a.metadata.as_deref().map(options::parse_profile).transpose()?;
    // Mixed groups have one profile: either option sets it, SINGLE by default.
    let (dd, dm) = options::default_profiles(ndevs, features.mixed);
    let (data, metadata) = match (features.mixed, data, metadata) {
        (true, Some(d), None) => (d, d),
        (true, None, Some(m)) => (m, m),
        (_, d, m) => (d.unwrap_or(dd), m.unwrap_or(dm)),
    };
    Ok(MkfsOptions {
        nodesize,
        sectorsize,
        csum: options::parse_csum(&a.csum)?,
        label: a.label.clone().unwrap_or_default().into_bytes(),
        fsid: a.uuid.as_deref().map(options::parse_uuid).transpose()?,
        data_profile: data,
        metadata_profile: metadata,
        features,
        sources: Default::default(),
        shrink: a.shrink,
    })
}

/// What `--rootdir` and its companions ask for, checked before anything is written.
struct Fill {
    rootdir: PathBuf,
    opts: ubtrfs_tools::populate::PopulateOptions,
    compress: Option<ubtrfs_core::CompressPolicy>,
}

fn fill_from(a: &MkfsArgs) -> Result<Option<Fill>> {
    let Some(dir) = &a.rootdir else { return Ok(None) };
    let md = std::fs::metadata(dir)
        .map_err(|e| Error::io(format!("--rootdir {}", ubtrfs_core::quote::path(dir)), e))?;
    if !md.is_dir() {
        return Err(Error::posix_detail(
            PosixKind::NotDir,
            format!("--rootdir {}", ubtrfs_core::quote::path(dir)),
            "not a directory",
        ));
    }
    let owners = match (&a.owner_map, &a.force_owner) {
        (Some(f), _) => {
            let text = std::fs::read_to_string(f).map_err(|e| {
                Error::io(format!("--owner-map {}", ubtrfs_core::quote::path(f)), e)
            })?;
            ubtrfs_tools::put::OwnerMap::parse(&text)?
        }
        (None, Some(o)) => {
            let bad = || {
                Error::posix_detail(
                    PosixKind::Invalid,
                    format!("--force-owner {o:?}"),
                    "expected UID:GID",
                )
            };
            let (u, g) = o.split_once(':').ok_or_else(bad)?;
            ubtrfs_tools::put::OwnerMap::force(
                u.parse().map_err(|_| bad())?,
                g.parse().map_err(|_| bad())?,
            )
        }
        (None, None) => Default::default(),
    };
    let rel = |what: &str, p: &str| -> Result<PathBuf> {
        let t = p.trim_matches('/');
        if t.is_empty() || t.split('/').any(|c| c == ".." || c == ".") {
            return Err(Error::posix_detail(
                PosixKind::Invalid,
                format!("{what} {p:?}"),
                "a path inside --rootdir, without . or ..",
            ));
        }
        Ok(dir.join(t))
    };
    let mut subvols = Vec::new();
    for p in &a.subvol {
        let full = rel("--subvol", p)?;
        if !std::fs::symlink_metadata(&full).is_ok_and(|m| m.is_dir()) {
            return Err(Error::posix_detail(
                PosixKind::NotDir,
                format!("--subvol {p}"),
                format!("{} is not a directory of --rootdir", ubtrfs_core::quote::path(&full)),
            ));
        }
        subvols.push(full);
    }
    let default_subvol = match &a.default_subvol {
        Some(p) => {
            let full = rel("--default-subvol", p)?;
            if !subvols.contains(&full) {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    format!("--default-subvol {p}"),
                    "not one of the --subvol paths",
                ));
            }
            Some(format!("/{}", p.trim_matches('/')))
        }
        None => None,
    };
    let compress =
        a.compress.as_deref().map(|c| ubtrfs_core::CompressPolicy::parse(c, false)).transpose()?;
    let reproducible = a.reproducible || std::env::var_os("SOURCE_DATE_EPOCH").is_some();
    let put = ubtrfs_tools::put::PutOptions {
        recursive: true,
        owners,
        subvols,
        progress: None,
        atime_from_mtime: reproducible,
    };
    Ok(Some(Fill {
        rootdir: dir.clone(),
        opts: ubtrfs_tools::populate::PopulateOptions { put, default_subvol },
        compress,
    }))
}

/// How the target exists before mkfs.
enum Target {
    Missing,
    File { len: u64 },
    Block { len: u64 },
}

fn device_len(path: &Path, name: &str) -> Result<u64> {
    use std::io::Seek;
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(format!("{name}: opening"), e))?;
    f.seek(std::io::SeekFrom::End(0)).map_err(|e| Error::io(format!("{name}: finding the size"), e))
}

fn target(path: &Path, name: &str) -> Result<Target> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Target::Missing),
        Err(e) => Err(Error::io(name.to_string(), e)),
        Ok(m) if m.file_type().is_block_device() => {
            Ok(Target::Block { len: device_len(path, name)? })
        }
        Ok(m) if m.is_file() => Ok(Target::File { len: m.len() }),
        Ok(_) => Err(Error::posix_detail(
            PosixKind::Invalid,
            name.to_string(),
            "neither a regular file nor a block device",
        )),
    }
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut u = "B";
    for unit in UNITS {
        if v < 1024.0 {
            break;
        }
        v /= 1024.0;
        u = unit;
    }
    if u == "B" {
        format!("{bytes}B")
    } else {
        format!("{v:.2}{u}")
    }
}

fn profile_name(p: u64) -> String {
    block_group_flags_str(BLOCK_GROUP_DATA | p).split(", ").nth(1).unwrap_or("single").to_string()
}

/// One target as it is before mkfs, and the size it will have.
struct Planned {
    path: PathBuf,
    name: String,
    target: Target,
    size: u64,
}

impl Planned {
    /// Create the image at its size or grow it.
    ///
    /// # Errors
    /// `Io` naming the image.
    fn prepare(&self) -> Result<()> {
        let (name, size) = (&self.name, self.size);
        match self.target {
            Target::Missing => {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&self.path)
                    .map_err(|e| Error::io(format!("{name}: creating"), e))?;
                f.set_len(size).map_err(|e| {
                    let _ = std::fs::remove_file(&self.path);
                    Error::io(format!("{name}: sizing to {size} bytes"), e)
                })
            }
            Target::File { len } if size > len => {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&self.path)
                    .map_err(|e| Error::io(format!("{name}: opening for writing"), e))?;
                f.set_len(size)
                    .map_err(|e| Error::io(format!("{name}: growing to {size} bytes"), e))
            }
            _ => Ok(()),
        }
    }
}

/// Look at one target: how it exists and the size the filesystem gets of it.
///
/// # Errors
/// `Posix(NotFound)` for a missing image without --size, `Posix(NoSpace)` for a
/// --size larger than a block device, `Io`.
fn plan(path: &Path, want: Option<u64>) -> Result<Planned> {
    let name = path.display().to_string();
    let t = target(path, &name)?;
    let size = match (&t, want) {
        (Target::Missing, None) => {
            return Err(Error::posix_detail(
                PosixKind::NotFound,
                name,
                "give --size to create the image",
            ))
        }
        (Target::Missing, Some(s)) => s,
        (Target::File { len }, s) => s.unwrap_or(*len),
        (Target::Block { len }, Some(s)) if s > *len => {
            return Err(Error::posix_detail(
                PosixKind::NoSpace,
                name,
                format!("--size {s} is larger than the device ({len} bytes)"),
            ));
        }
        (Target::Block { len }, s) => s.unwrap_or(*len),
    };
    Ok(Planned { path: path.to_path_buf(), name, target: t, size })
}

pub fn run(a: &MkfsArgs) -> Result<()> {
    let ndevs = a.images.len();
    let mut opts = options_from(a, ndevs)?;
    let fill = fill_from(a)?;
    let epoch = ubtrfs_tools::populate::source_date_epoch()?;
    if a.reproducible || epoch.is_some() {
        // The tree's digest with the options that shape the image: two builds of one
        // input agree, different inputs differ. (Reading the source's directories
        // here changes their atimes; a reproducible copy takes each atime from the
        // mtime.)
        let owners = fill.as_ref().map(|f| f.opts.put.owners.clone()).unwrap_or_default();
        let tree = match &fill {
            Some(f) => ubtrfs_tools::populate::tree_digest(&f.rootdir, &owners)?,
            None => [0; 32],
        };
        let mut seed = tree.to_vec();
        seed.extend_from_slice(
            format!(
                "{} {} {} {} {} {:?} {:?} {:?} {:?}",
                opts.nodesize,
                opts.sectorsize,
                opts.csum.name(),
                opts.data_profile,
                opts.metadata_profile,
                a.size,
                a.subvol,
                a.default_subvol,
                a.compress
            )
            .as_bytes(),
        );
        if ndevs > 1 {
            // Not for one device, whose seed (and so its image) stays what it was.
            seed.extend_from_slice(format!(" devices {ndevs}").as_bytes());
        }
        let digest = ubtrfs_tools::populate::tree_digest_of_bytes(&seed);
        let label = a.label.as_deref().unwrap_or("");
        opts.sources = ubtrfs_tools::populate::reproducible_sources(epoch.unwrap_or(0), &digest);
        if opts.fsid.is_none() {
            opts.fsid = Some(ubtrfs_tools::populate::derive_uuid(&digest, label, "fsid"));
        }
    }
    let want = a.size.as_deref().map(|s| options::parse_size("size", s)).transpose()?;
    let planned: Vec<Planned> = a.images.iter().map(|p| plan(p, want)).collect::<Result<_>>()?;
    let devices: Vec<MkfsDevice> =
        planned.iter().map(|p| MkfsDevice { path: p.path.clone(), size: p.size }).collect();
    // Everything that can be refused is refused before any target is touched.
    ubtrfs_tools::mkfs::check_distinct(&devices)?;
    for p in &planned {
        opts.validate(&p.name, p.size, ndevs)?;
    }
    for p in &planned {
        let (Target::File { len } | Target::Block { len }) = p.target else { continue };
        // Refused while mounted or in use before anything changes (growing included);
        // mkfs takes the same lock again to write.
        drop(FileDevice::open(&p.path, true)?);
        let f = std::fs::File::open(&p.path)
            .map_err(|e| Error::io(format!("{}: opening", p.name), e))?;
        if let Some(found) = signature::probe(&f, &p.name, len)? {
            if !a.force {
                return Err(Error::posix_detail(
                    PosixKind::Exists,
                    p.name.clone(),
                    format!("appears to contain {found}; use --force to overwrite it"),
                ));
            }
            if !a.quiet {
                eprintln!("ubtrfs: {}: overwriting {found} (--force)", p.name);
            }
        }
    }
    let mut created: Vec<&Path> = Vec::new();
    let mut prepare = || -> Result<()> {
        for p in &planned {
            p.prepare()?;
            if matches!(p.target, Target::Missing) {
                created.push(&p.path);
            }
        }
        Ok(())
    };
    // Its total comes from the scan the copy makes first (which records each
    // directory's times before reading it, so the atimes kept are the source's).
    let bar = if fill.is_some() && !a.quiet { crate::write_cmds::copy_progress() } else { None };
    let mut copied = None;
    let r = prepare().map_err(|error| MkfsFailure { error, began_writing: false }).and_then(|()| {
        ubtrfs_tools::mkfs::make_filesystem_on(&devices, &opts, |e| {
            let Some(f) = &fill else { return Ok(()) };
            if let Some(c) = f.compress {
                e.set_compress(c)?;
            }
            let mut po = f.opts.clone();
            po.put.progress = bar.as_ref().map(|b| b.callback());
            copied = Some(ubtrfs_tools::populate::populate(e, &f.rootdir, &po)?);
            Ok(())
        })
    });
    drop(bar);
    let made = match r {
        Ok(m) => m,
        Err(f) => {
            for p in &created {
                let _ = std::fs::remove_file(p);
            }
            let kept: Vec<&str> = planned
                .iter()
                .filter(|p| !matches!(p.target, Target::Missing))
                .map(|p| p.name.as_str())
                .collect();
            if f.began_writing && !kept.is_empty() {
                let what = if kept.len() == 1 {
                    format!("{} is", kept[0])
                } else {
                    format!("{} are", kept.join(", "))
                };
                return Err(f
                    .error
                    .at(format!("{what} not usable, mkfs failed after it began writing")));
            }
            return Err(f.error);
        }
    };
    if a.shrink {
        for (p, &size) in planned.iter().zip(&made.dev_sizes) {
            if matches!(p.target, Target::Block { .. }) {
                continue;
            }
            let name = &p.name;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&p.path)
                .map_err(|e| Error::io(format!("{name}: opening to shrink"), e))?;
            f.set_len(size)
                .map_err(|e| Error::io(format!("{name}: shrinking to {size} bytes"), e))?;
        }
    }
    let name = planned.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(" ");
    if !a.quiet {
        println!("ubtrfs mkfs: {name}");
        println!("Label:              {}", a.label.as_deref().unwrap_or("(null)"));
        println!("UUID:               {}", ubtrfs_format::items::uuid_str(&made.fsid));
        println!("Node size:          {}", opts.nodesize);
        println!("Sector size:        {}", opts.sectorsize);
        println!("Filesystem size:    {}", human(made.total_bytes));
        println!("Block group profiles:");
        if opts.features.mixed {
            println!("  Data+Metadata:    {}", profile_name(opts.data_profile));
        } else {
            println!("  Data:             {}", profile_name(opts.data_profile));
            println!("  Metadata:         {}", profile_name(opts.metadata_profile));
        }
        println!("  System:           {}", profile_name(opts.metadata_profile));
        println!("Checksum:           {}", opts.csum.name());
        let f = opts.features;
        let mut names = Vec::new();
        if f.extref {
            names.push("extref");
        }
        names.push("skinny-metadata");
        if f.no_holes {
            names.push("no-holes");
        }
        names.push("free-space-tree");
        if f.block_group_tree {
            names.push("block-group-tree");
        }
        if f.mixed {
            names.push("mixed-bg");
        }
        println!("Features:           {}", names.join(", "));
        println!("Number of devices:  {ndevs}");
        println!("Devices:");
        println!("   ID        SIZE  PATH");
        for (i, p) in planned.iter().enumerate() {
            let ss = u64::from(opts.sectorsize);
            println!("  {:>3}  {:>10}  {}", i + 1, human(p.size / ss * ss), p.name);
        }
        if let Some(c) = copied {
            println!("Copied:             {} files, {} directories, {} symlinks, {} special files, {} hard links, {} bytes", c.files, c.dirs, c.symlinks, c.special, c.hardlinks, c.bytes);
        }
    }
    Ok(())
}
