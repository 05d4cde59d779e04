//! `put` and `rm`: each is one atomic transaction; on any error nothing is committed.

use crate::WriteImageArgs;
use std::path::PathBuf;
use ubtrfs_core::transaction::FsWriter;
use ubtrfs_core::{OpenOptions, Result};

#[derive(clap::Args)]
pub struct PutArgs {
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// Host file or directory to copy in.
    pub src: PathBuf,
    /// New path inside the image (must not exist; its parent must).
    pub dest: String,
    /// Copy directories recursively.
    #[arg(short = 'r')]
    pub recursive: bool,
}

#[derive(clap::Args)]
pub struct RmArgs {
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// Path inside the image.
    pub path: String,
    /// Remove directories and their contents.
    #[arg(short = 'r')]
    pub recursive: bool,
}

fn open_writer(a: &WriteImageArgs) -> Result<FsWriter> {
    let w = FsWriter::open(&OpenOptions { devices: vec![a.image.clone()], cache_bytes: a.cache_mib << 20, writable: true, sources: Default::default() })?;
    crate::print_warnings(&w.info);
    Ok(w)
}

pub fn put(a: &PutArgs) -> Result<()> {
    let mut w = open_writer(&a.image)?;
    // A failure part way leaves the transaction half done: abort it, nothing is committed.
    let stats = ubtrfs_tools::put::put(&mut w, &a.src, &a.dest, a.recursive).inspect_err(|e| w.abort("put", e))?;
    let gen = w.commit()?;
    eprintln!("put {} files, {} directories, {} hard links, {} bytes (generation {gen})", stats.files, stats.dirs, stats.hardlinks, stats.bytes);
    Ok(())
}

pub fn rm(a: &RmArgs) -> Result<()> {
    let mut w = open_writer(&a.image)?;
    let n = ubtrfs_tools::put::remove(&mut w, &a.path, a.recursive).inspect_err(|e| w.abort("rm", e))?;
    let gen = w.commit()?;
    eprintln!("removed {n} entries (generation {gen})");
    Ok(())
}
