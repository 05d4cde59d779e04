//! `put` and `dedupe`: each one atomic transaction; on any error nothing is committed.

use crate::WriteImageArgs;
use std::path::PathBuf;
use ubtrfs_core::{CompressPolicy, Engine, Error, Result};

#[derive(clap::Args)]
pub struct PutArgs {
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// Host files or directories to copy in.
    #[arg(required = true, num_args = 1..)]
    pub srcs: Vec<PathBuf>,
    /// Where they go in the image: into it if it is a directory, else as it (as cp -a).
    pub dest: String,
    /// Copy directories recursively.
    #[arg(short = 'r')]
    pub recursive: bool,
    /// Compress the data as `mount -o compress=ALG[:LEVEL]` does (zlib, lzo, zstd;
    /// ranges the kernel's heuristic turns down, or that do not shrink, stay plain).
    #[arg(long, value_name = "ALG[:LEVEL]", conflicts_with = "compress_force")]
    pub compress: Option<String>,
    /// As --compress, but every range that shrinks is compressed (compress-force).
    #[arg(long, value_name = "ALG[:LEVEL]")]
    pub compress_force: Option<String>,
}

fn open_offline(a: &WriteImageArgs) -> Result<Engine> {
    a.open_offline()
}

pub fn put(a: &PutArgs) -> Result<()> {
    let policy = match (&a.compress, &a.compress_force) {
        (Some(c), _) => Some(CompressPolicy::parse(c, false)?),
        (None, Some(c)) => Some(CompressPolicy::parse(c, true)?),
        (None, None) => None,
    };
    let e = open_offline(&a.image).map_err(|e| swapped_put_arguments(a, e))?;
    if let Some(p) = policy {
        e.set_compress(p)?;
    }
    let srcs: Vec<&std::path::Path> = a.srcs.iter().map(|p| p.as_path()).collect();
    let bar = copy_progress();
    let opts = ubtrfs_tools::put::PutOptions {
        recursive: a.recursive,
        progress: bar.as_ref().map(|b| b.callback()),
        ..Default::default()
    };
    // A failure part way leaves the transaction half done: abort it, nothing is
    // committed. Else the dirty data is written back and all of it committed at once.
    let abort = |err: &Error| {
        let _ = e.abort("put", err);
    };
    let stats = ubtrfs_tools::put::put(&e, &srcs, &a.dest, &opts)
        .and_then(|s| e.writeback_all().map(|()| s))
        .inspect_err(abort)?;
    drop(bar);
    let gen = e.commit()?;
    eprintln!(
        "put {} files, {} directories, {} symlinks, {} special files, {} hard links, {} bytes (generation {gen})",
        stats.files, stats.dirs, stats.symlinks, stats.special, stats.hardlinks, stats.bytes
    );
    Ok(())
}

/// The error of a `put` whose IMAGE is no btrfs filesystem while one of its sources is
/// one (`ubtrfs put SRC IMAGE DEST`, the order of cp's arguments): say which argument
/// the image is.
fn swapped_put_arguments(a: &PutArgs, e: Error) -> Error {
    let Error::Incompatible(why) = &e else { return e };
    let Some(img) = a.srcs.iter().find(|p| is_btrfs_image(p)) else { return e };
    Error::Incompatible(format!(
        "{why}; the image comes first: `ubtrfs put IMAGE SRC... DEST` ({} looks like the btrfs image, {} is given as IMAGE)",
        ubtrfs_core::quote::name(img.as_os_str().as_encoded_bytes()),
        ubtrfs_core::quote::name(a.image.image.as_os_str().as_encoded_bytes())
    ))
}

/// Whether `p` holds a btrfs superblock's magic at the primary copy's place.
fn is_btrfs_image(p: &std::path::Path) -> bool {
    use std::io::{Read, Seek, SeekFrom};
    let mut magic = [0u8; 8];
    let Ok(mut f) = std::fs::File::open(p) else { return false };
    f.seek(SeekFrom::Start(ubtrfs_format::structs::SUPER_INFO_OFFSET + 64)).is_ok()
        && f.read_exact(&mut magic).is_ok()
        && u64::from_le_bytes(magic) == ubtrfs_format::structs::MAGIC
}

/// A progress bar for a copy into the image, on stderr when it is a terminal: the
/// bytes written against what the scan before the copy found (with the rate and the
/// time left), and the counts. Cleared when dropped.
pub struct CopyProgress {
    bar: indicatif::ProgressBar,
}

/// The bar, or None when stderr is not a terminal. (The total comes with the first
/// report, from the scan `put` makes before it copies.)
pub fn copy_progress() -> Option<CopyProgress> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
        )
        .expect("static template"),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    Some(CopyProgress { bar })
}

impl CopyProgress {
    /// The callback `put` reports to.
    pub fn callback(&self) -> ubtrfs_tools::put::Progress {
        let b = self.bar.clone();
        ubtrfs_tools::put::Progress(std::sync::Arc::new(move |s: &ubtrfs_tools::put::PutStats| {
            b.set_length(s.expected_bytes.max(s.bytes));
            b.set_position(s.bytes);
            b.set_message(format!("{} files, {} directories", s.files, s.dirs));
        }))
    }
}

impl Drop for CopyProgress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

#[derive(clap::Args)]
pub struct DedupeArgs {
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// Files or directories inside the image (absolute paths; directories are searched
    /// recursively, into subvolumes too).
    #[arg(required = true, num_args = 1..)]
    pub paths: Vec<String>,
    /// Worker threads reading and comparing files (0: one per CPU).
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub threads: usize,
}

/// `ubtrfs dedupe`: share the extents of identical files (`ubtrfs_tools::dedupe`),
/// with a progress bar on a terminal; one commit at the end.
pub fn dedupe(a: &DedupeArgs) -> Result<()> {
    use std::io::IsTerminal;
    let e = open_offline(&a.image)?;
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new(0);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {bytes}/{total_bytes} hashed {bytes_per_sec} {msg}",
            )
            .expect("static template"),
        );
        b.enable_steady_tick(std::time::Duration::from_millis(120));
        b
    });
    let progress = bar.clone().map(|b| {
        ubtrfs_tools::dedupe::Progress(std::sync::Arc::new(
            move |s: &ubtrfs_tools::dedupe::DedupeStats| {
                b.set_length(s.candidate_bytes);
                b.set_position(s.hashed_bytes);
                b.set_message(format!("{} files shared", s.deduped_files));
            },
        ))
    });
    let paths: Vec<&str> = a.paths.iter().map(String::as_str).collect();
    let s = ubtrfs_tools::dedupe::dedupe(&e, &paths, a.threads, progress.as_ref())?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let generation = e.commit()?;
    println!(
        "{} files scanned, {} groups of identical files: {} files now share {} bytes with another{}{} (generation {generation})",
        s.files,
        s.groups,
        s.deduped_files,
        s.deduped_bytes,
        if s.already_shared > 0 { format!(", {} already did", s.already_shared) } else { String::new() },
        if s.refused > 0 { format!(", {} refused (checksummed and not, immutable, append-only or read-only)", s.refused) } else { String::new() },
    );
    if s.block_hashed_bytes > 0 {
        println!(
            "blocks of the other files: {} bytes hashed, {} ranges now share {} bytes",
            s.block_hashed_bytes, s.block_ranges, s.block_bytes
        );
    }
    Ok(())
}
