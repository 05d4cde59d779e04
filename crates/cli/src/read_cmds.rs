//! `ls`, `stat`, `cat` and `extract`: argument parsing and output over `ubtrfs_core::Filesystem`.

use crate::ImageArgs;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use ubtrfs_core::{quote, Error, FileKind, Filesystem, FsRead, InodeView, Load, Result};
use ubtrfs_format::structs::{rdev_decode, Timespec};
use ubtrfs_tools::extract::{extract as do_extract, ExtractStats};

#[derive(clap::Args)]
pub struct LsArgs {
    #[command(flatten)]
    pub image: ImageArgs,
    /// Directory (or file) inside the image; default: the top of the default subvolume.
    #[arg(default_value = "/")]
    pub path: String,
    /// Long listing: type, mode, links, owner, size, mtime, name (-> target).
    #[arg(short = 'l')]
    pub long: bool,
    /// List subdirectories recursively.
    #[arg(short = 'R')]
    pub recursive: bool,
}

#[derive(clap::Args)]
pub struct StatArgs {
    #[command(flatten)]
    pub image: ImageArgs,
    /// Path inside the image (not followed if it is a symlink).
    pub path: String,
}

#[derive(clap::Args)]
pub struct CatArgs {
    #[command(flatten)]
    pub image: ImageArgs,
    /// File inside the image (symlinks are followed).
    pub path: String,
}

#[derive(clap::Args)]
#[command(after_help = "\
A damaged image is copied as far as it can be read: unreadable data is left as holes in
otherwise intact files, unreadable directories and files are skipped, and each loss is a
warning naming the path. What the destination cannot keep (owners when not root, xattrs it
refuses) is a warning too, one line per file, but not a failure. Nothing existing in DEST
is ever replaced.

Exit status: 0 when everything was copied (metadata warnings aside); 2 when extract
finished but something could not be read or created (a summary line counts it); 1 when
it stopped at an error (with --strict, the first unreadable part).")]
pub struct ExtractArgs {
    #[command(flatten)]
    pub image: ImageArgs,
    /// Host destination: a directory to fill (created if missing), or the new file's path.
    pub dest: PathBuf,
    /// What to extract from the image (default: everything under the top).
    #[arg(long, default_value = "/")]
    pub path: String,
    /// Stop at the first unreadable object or data range instead of going on.
    #[arg(long)]
    pub strict: bool,
    /// Write nothing: list what would be extracted on stdout (type letter and path; 'h' is
    /// another name of a file already listed) and read everything to report what could not be.
    #[arg(long, short = 'n')]
    pub dry_run: bool,
}

fn open_fs(a: &ImageArgs) -> Result<Filesystem> {
    let info = a.open()?;
    Filesystem::from_info(info)
}

fn stdout_err(e: std::io::Error) -> Error {
    Error::io("stdout", e)
}

fn fmt_time(t: &Timespec) -> String {
    let secs = t.sec.get() as i64;
    let days = secs.div_euclid(86400);
    let rem = secs.rem_euclid(86400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:09}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        t.nsec.get()
    )
}

/// Convert days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's method).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn mode_str(v: &InodeView) -> String {
    let mode = v.mode();
    let mut s = String::new();
    s.push(v.kind().letter());
    let bits = [
        (0o400, 'r'),
        (0o200, 'w'),
        (0o100, 'x'),
        (0o40, 'r'),
        (0o20, 'w'),
        (0o10, 'x'),
        (0o4, 'r'),
        (0o2, 'w'),
        (0o1, 'x'),
    ];
    for (i, (b, c)) in bits.iter().enumerate() {
        let set = mode & b != 0;
        let ch = match i {
            2 if mode & 0o4000 != 0 => {
                if set {
                    's'
                } else {
                    'S'
                }
            }
            5 if mode & 0o2000 != 0 => {
                if set {
                    's'
                } else {
                    'S'
                }
            }
            8 if mode & 0o1000 != 0 => {
                if set {
                    't'
                } else {
                    'T'
                }
            }
            _ if set => *c,
            _ => '-',
        };
        s.push(ch);
    }
    s
}

pub fn ls(a: &LsArgs) -> Result<()> {
    let fs = open_fs(&a.image)?;
    let top = fs.resolve(&a.path, true)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if top.kind() != FileKind::Dir {
        print_entry(&fs, &mut out, &top, a.path.as_bytes(), a.long)?;
        return out.flush().map_err(stdout_err);
    }
    let mut stack = vec![(quote::name(a.path.trim_end_matches('/').as_bytes()).into_owned(), top)];
    let mut first = true;
    while let Some((path, dir)) = stack.pop() {
        if a.recursive {
            if !first {
                writeln!(out).map_err(stdout_err)?;
            }
            writeln!(out, "{}:", if path.is_empty() { "/" } else { &path }).map_err(stdout_err)?;
        }
        first = false;
        let mut subdirs = Vec::new();
        let mut entries: Vec<_> = dir.entries.iter().collect();
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        for e in entries {
            let child = fs.load_inode(
                e.target,
                if a.recursive { Load { entries: true, ..Load::ITEM } } else { Load::ITEM },
            )?;
            print_entry(&fs, &mut out, &child, &e.name, a.long)?;
            if a.recursive && child.kind() == FileKind::Dir {
                subdirs.push((format!("{path}/{}", quote::name(&e.name)), child));
            }
        }
        fs.info.take_warnings().iter().for_each(|w| eprintln!("ubtrfs: warning: {w}"));
        subdirs.reverse();
        stack.extend(subdirs);
    }
    out.flush().map_err(stdout_err)
}

fn print_entry(
    fs: &Filesystem,
    out: &mut impl Write,
    v: &InodeView,
    name: &[u8],
    long: bool,
) -> Result<()> {
    let name = quote::name(name);
    if !long {
        return writeln!(out, "{name}").map_err(stdout_err);
    }
    let size = match v.kind() {
        FileKind::CharDev | FileKind::BlockDev => {
            let (ma, mi) = rdev_decode(v.item.rdev.get());
            format!("{ma}, {mi}")
        }
        _ => v.size().to_string(),
    };
    let link = if v.kind() == FileKind::Symlink {
        format!(" -> {}", quote::name(&fs.readlink(v.id)?))
    } else {
        String::new()
    };
    writeln!(
        out,
        "{} {:>3} {:>5} {:>5} {:>10} {} {name}{link}",
        mode_str(v),
        v.nlink(),
        v.item.uid.get(),
        v.item.gid.get(),
        size,
        fmt_time(&v.item.mtime)
    )
    .map_err(stdout_err)
}

pub fn stat(a: &StatArgs) -> Result<()> {
    let fs = open_fs(&a.image)?;
    let v = fs.resolve(&a.path, false)?;
    let i = &v.item;
    let mut out = String::new();
    use std::fmt::Write as _;
    let kind = match v.kind() {
        FileKind::File => "regular file",
        FileKind::Dir => "directory",
        FileKind::Symlink => "symbolic link",
        FileKind::Fifo => "fifo",
        FileKind::CharDev => "character special file",
        FileKind::BlockDev => "block special file",
        FileKind::Socket => "socket",
    };
    let _ = writeln!(out, "  File: {}", quote::name(a.path.as_bytes()));
    if v.kind() == FileKind::Symlink {
        let _ = writeln!(out, "  Link: {}", quote::name(&fs.readlink(v.id)?));
    }
    let _ = writeln!(out, "  Type: {kind}");
    let _ = writeln!(
        out,
        "  Size: {}  Bytes on disk (nbytes): {}  Links: {}",
        i.size.get(),
        i.nbytes.get(),
        i.nlink.get()
    );
    let _ = writeln!(
        out,
        "Subvol: {}  Inode: {}  Generation: {}  Transid: {}",
        v.id.root,
        v.id.ino,
        i.generation.get(),
        i.transid.get()
    );
    let _ = writeln!(
        out,
        "Access: ({:04o}/{})  Uid: {}  Gid: {}",
        v.mode() & 0o7777,
        mode_str(&v),
        i.uid.get(),
        i.gid.get()
    );
    if matches!(v.kind(), FileKind::CharDev | FileKind::BlockDev) {
        let (ma, mi) = rdev_decode(i.rdev.get());
        let _ = writeln!(out, "Device: {ma},{mi}");
    }
    let _ = writeln!(out, " Flags: {:#x}", i.flags.get());
    let _ = writeln!(out, "Access: {}", fmt_time(&i.atime));
    let _ = writeln!(out, "Modify: {}", fmt_time(&i.mtime));
    let _ = writeln!(out, "Change: {}", fmt_time(&i.ctime));
    let _ = writeln!(out, " Birth: {}", fmt_time(&i.otime));
    for (k, val) in &v.xattrs {
        let shown = match std::str::from_utf8(val) {
            Ok(s) if s.chars().all(|c| !c.is_control()) => format!("{s:?}"),
            _ => format!("0x{}", val.iter().map(|b| format!("{b:02x}")).collect::<String>()),
        };
        let _ = writeln!(out, " Xattr: {}={shown}", quote::name(k));
    }
    if v.kind() == FileKind::File {
        for e in &v.extents {
            let _ = writeln!(
                out,
                "Extent: {:?} at file offset {} len {}",
                e.kind_summary(),
                e.file_offset,
                e.len()
            );
        }
        // As FIEMAP reports them (filefrag -v): holes left out, physical bytes where the
        // range's data starts, and the FIEMAP flags.
        let data: Vec<_> = v
            .extents
            .iter()
            .filter(|e| !matches!(e.kind, ubtrfs_core::ExtentKind::Regular { disk_bytenr: 0, .. }))
            .collect();
        if !data.is_empty() {
            let _ = writeln!(out, "FIEMAP:   logical         physical         length  flags");
        }
        for (i, e) in data.iter().enumerate() {
            use ubtrfs_core::ExtentKind;
            let mut flags = Vec::new();
            let physical = match &e.kind {
                ExtentKind::Inline { compression, .. } => {
                    flags.extend(["not_aligned", "data_inline"]);
                    if *compression != 0 {
                        flags.push("encoded");
                    }
                    0
                }
                ExtentKind::Regular { disk_bytenr, offset, compression, prealloc, .. } => {
                    if *prealloc {
                        flags.push("unwritten");
                    }
                    if *compression != 0 {
                        flags.push("encoded");
                        *disk_bytenr
                    } else {
                        disk_bytenr + offset
                    }
                }
            };
            if i + 1 == data.len() {
                flags.push("last");
            }
            let _ = writeln!(
                out,
                "  {:>15} {:>16} {:>14}  {}",
                e.file_offset,
                physical,
                e.len(),
                flags.join(",")
            );
        }
    }
    std::io::stdout().write_all(out.as_bytes()).map_err(stdout_err)
}

trait Summary {
    fn kind_summary(&self) -> String;
}
impl Summary for ubtrfs_core::FileExtentRec {
    fn kind_summary(&self) -> String {
        use ubtrfs_core::ExtentKind;
        match &self.kind {
            ExtentKind::Inline { ram_bytes, compression, data } => format!(
                "inline ram_bytes={ram_bytes} compression={compression} stored={}",
                data.len()
            ),
            ExtentKind::Regular { disk_bytenr: 0, .. } => "hole".to_string(),
            ExtentKind::Regular {
                disk_bytenr,
                disk_num_bytes,
                offset,
                ram_bytes,
                compression,
                prealloc,
                ..
            } => {
                format!("{} disk_bytenr={disk_bytenr} disk_num_bytes={disk_num_bytes} offset={offset} ram_bytes={ram_bytes} compression={compression}", if *prealloc { "prealloc" } else { "regular" })
            }
        }
    }
}

pub fn cat(a: &CatArgs) -> Result<()> {
    let fs = open_fs(&a.image)?;
    let v = fs.resolve(&a.path, true)?;
    if v.kind() == FileKind::Dir {
        return Err(Error::posix(ubtrfs_core::PosixKind::IsDir, a.path.clone()));
    }
    if v.kind() != FileKind::File {
        return Err(Error::posix(
            ubtrfs_core::PosixKind::Invalid,
            format!("{}: not a regular file", a.path),
        ));
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(4);
    fs.stream_file(&v, threads, 2 << 20, &mut |data: &[u8]| {
        out.write_all(data).map_err(stdout_err)
    })?;
    out.flush().map_err(stdout_err)?;
    crate::print_warnings(&fs.info);
    Ok(())
}

pub fn extract(a: &ExtractArgs) -> Result<()> {
    use ubtrfs_tools::extract::{ExtractOptions, ExtractReport, Warning};
    let fs = open_fs(&a.image)?;
    // Only the path is resolved here: extract reads the inode itself, so damage in it
    // is salvaged like anywhere else.
    let src = if a.path.trim_matches('/').is_empty() {
        fs.root_dir()
    } else {
        fs.resolve_id(&a.path, true)?
    };
    let bar = if std::io::stderr().is_terminal() && !a.dry_run {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {elapsed} {msg}")
                .expect("static template"),
        );
        Some(b)
    } else {
        None
    };
    /// Listings to stdout, warnings (the engine's first, so they stay in order) to stderr.
    struct Cli<'a> {
        fs: &'a Filesystem,
        bar: Option<indicatif::ProgressBar>,
        out: std::io::BufWriter<std::io::StdoutLock<'static>>,
        out_err: Option<std::io::Error>,
        /// Only a dry run lists.
        list: bool,
    }
    impl Cli<'_> {
        fn eprint(&self, line: &str) {
            match &self.bar {
                Some(b) => b.suspend(|| eprintln!("{line}")),
                None => eprintln!("{line}"),
            }
        }
        fn engine_warnings(&self) {
            for w in self.fs.info.take_warnings() {
                self.eprint(&format!("ubtrfs: warning: {w}"));
            }
        }
    }
    impl ExtractReport for Cli<'_> {
        fn progress(&mut self, s: &ExtractStats) {
            self.engine_warnings();
            if let Some(b) = &self.bar {
                b.set_message(format!("{} files, {} dirs, {} MiB", s.files, s.dirs, s.bytes >> 20));
                b.tick();
            }
        }
        fn listed(&mut self, kind: char, path: &str) {
            if self.list && self.out_err.is_none() {
                if let Err(e) = writeln!(self.out, "{kind} {path}") {
                    self.out_err = Some(e);
                }
            }
        }
        fn warning(&mut self, w: &Warning) {
            self.engine_warnings();
            self.eprint(&format!("ubtrfs: warning: {}", w.text));
        }
    }
    let mut cli = Cli {
        fs: &fs,
        bar,
        out: std::io::BufWriter::new(std::io::stdout().lock()),
        out_err: None,
        list: a.dry_run,
    };
    let opts = ExtractOptions { strict: a.strict, dry_run: a.dry_run };
    let r = do_extract(&fs, src, &a.dest, &opts, &mut cli);
    if let Some(b) = cli.bar.take() {
        b.finish_and_clear();
    }
    cli.engine_warnings();
    cli.out.flush().map_err(stdout_err)?;
    if let Some(e) = cli.out_err.take() {
        return Err(stdout_err(e));
    }
    let stats = match r {
        Ok(s) => s,
        Err(e) => {
            // Say what the error leaves behind, after the error itself.
            eprintln!("ubtrfs: error: {e}");
            if a.dry_run {
                eprintln!("extract: stopped (a dry run: nothing was written)");
            } else {
                eprintln!(
                    "extract: stopped; {} holds only what was extracted before this error",
                    ubtrfs_core::quote::path(&a.dest)
                );
            }
            std::process::exit(1);
        }
    };
    let verb = if a.dry_run { "would extract" } else { "extracted" };
    eprintln!(
        "{verb} {} files, {} directories, {} symlinks, {} hard links, {} special files, {} bytes",
        stats.files, stats.dirs, stats.symlinks, stats.hardlinks, stats.specials, stats.bytes
    );
    if let Some(losses) = stats.losses() {
        eprintln!("extract: {losses}; see the warnings above");
        // Finished, but not everything was copied: distinct from 1 (stopped by an error).
        std::process::exit(2);
    }
    Ok(())
}
