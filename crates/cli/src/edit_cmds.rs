//! The editing commands (`mkdir`, `rm`, `mv`, `ln`, `mknod`, `truncate`, `fallocate`, `chmod`,
//! `chown`, `touch`) and `batch`, which runs many of them as one transaction. Each
//! command takes IMAGE first after its options and absolute paths inside the image;
//! it commits once at the end, or, on any error, commits nothing.

use crate::WriteImageArgs;
use clap::{Args, Parser, Subcommand};
use std::io::BufRead;
use std::path::PathBuf;
use ubtrfs_core::{Error, PosixKind, Result, RENAME_EXCHANGE, RENAME_NOREPLACE};
use ubtrfs_tools::edit::{self, Edit};

/// A command's own arguments after IMAGE.
#[derive(Args)]
pub struct WithImage<T: Args> {
    #[command(flatten)]
    pub image: WriteImageArgs,
    #[command(flatten)]
    pub op: T,
}

#[derive(Args)]
pub struct MkdirOpts {
    /// Make missing parents too; an existing directory is no error.
    #[arg(short = 'p')]
    parents: bool,
    /// Permission bits (octal).
    #[arg(short = 'm', value_name = "MODE", default_value = "755")]
    mode: String,
    /// Absolute path inside the image.
    path: String,
}

#[derive(Args)]
pub struct RmOpts {
    /// Remove directories and their contents.
    #[arg(short = 'r')]
    recursive: bool,
    /// Absolute path inside the image.
    path: String,
}

#[derive(Args)]
pub struct MvOpts {
    /// Fail if TO exists (RENAME_NOREPLACE).
    #[arg(long, conflicts_with = "exchange")]
    no_replace: bool,
    /// Swap FROM and TO, which must both exist (RENAME_EXCHANGE).
    #[arg(long)]
    exchange: bool,
    from: String,
    to: String,
}

#[derive(Args)]
pub struct LnOpts {
    /// Make a symbolic link holding TARGET (any text) instead of a hard link.
    #[arg(short = 's')]
    symbolic: bool,
    /// The existing path (hard link) or the link's contents (-s).
    target: String,
    /// The new name.
    link: String,
}

#[derive(Args)]
pub struct MknodOpts {
    /// Permission bits (octal).
    #[arg(short = 'm', value_name = "MODE", default_value = "644")]
    mode: String,
    path: String,
    /// p (fifo), c (character device), b (block device) or s (socket).
    #[arg(value_name = "TYPE")]
    kind: String,
    /// Device numbers, for c and b.
    major: Option<u32>,
    minor: Option<u32>,
}

#[derive(Args)]
pub struct ReflinkOpts {
    /// The file whose extents are shared.
    src: String,
    /// The copy: made if missing, emptied first if a file; a directory takes SRC's name.
    dst: String,
}

#[derive(Args)]
pub struct TruncateOpts {
    path: String,
    /// The new size: bytes, or with K, M, G, T (1024-based; KB = 1000).
    size: String,
}

#[derive(Args)]
pub struct FallocateOpts {
    /// Keep the size (FALLOC_FL_KEEP_SIZE).
    #[arg(short = 'k')]
    keep_size: bool,
    /// Punch a hole (implies -k).
    #[arg(short = 'p', conflicts_with = "zero")]
    punch: bool,
    /// Zero the range (FALLOC_FL_ZERO_RANGE).
    #[arg(short = 'z')]
    zero: bool,
    /// Where the range starts (K, M, G suffixes).
    #[arg(short = 'o', value_name = "OFFSET", default_value = "0")]
    offset: String,
    /// How long it is (K, M, G suffixes).
    #[arg(short = 'l', value_name = "LEN")]
    len: String,
    /// The file; a missing one is made (mode 0644) when neither -k, -p nor -z is
    /// given, as fallocate(1) makes it.
    path: String,
}

#[derive(Args)]
pub struct ChmodOpts {
    /// Octal (0755) or symbolic (u+x,go-w).
    mode: String,
    path: String,
}

#[derive(Args)]
pub struct ChattrOpts {
    /// `+FLAGS`, `-FLAGS` or `=FLAGS` (chattr's letters: S D i a d A c C m on btrfs).
    #[arg(allow_hyphen_values = true)]
    spec: String,
    path: String,
}

#[derive(Args)]
pub struct ChownOpts {
    /// UID:GID, UID, or :GID (numeric).
    #[arg(value_name = "UID:GID")]
    owner: String,
    path: String,
}

#[derive(Args)]
pub struct TouchOpts {
    /// The time instead of now: @SECONDS[.FRACTION] or YYYY-MM-DD[ HH:MM[:SS[.FRACTION]]] (UTC).
    #[arg(short = 'd', value_name = "TIME")]
    date: Option<String>,
    path: String,
}

/// The commands a batch line holds (without IMAGE).
#[derive(Subcommand)]
pub enum EditCmd {
    Mkdir(MkdirOpts),
    Rm(RmOpts),
    Mv(MvOpts),
    Ln(LnOpts),
    Mknod(MknodOpts),
    Truncate(TruncateOpts),
    Reflink(ReflinkOpts),
    Fallocate(FallocateOpts),
    Chmod(ChmodOpts),
    Chattr(ChattrOpts),
    Chown(ChownOpts),
    Touch(TouchOpts),
}

fn octal(s: &str) -> Result<u32> {
    match edit::parse_mode(s)? {
        edit::Mode::Octal(m) => Ok(m),
        edit::Mode::Symbolic(_) => {
            Err(Error::posix_detail(PosixKind::Invalid, s.to_string(), "give an octal mode here"))
        }
    }
}

impl MkdirOpts {
    fn edit(&self) -> Result<Edit> {
        Ok(Edit::Mkdir { path: self.path.clone(), parents: self.parents, mode: octal(&self.mode)? })
    }
}
impl RmOpts {
    fn edit(&self) -> Result<Edit> {
        Ok(Edit::Rm { path: self.path.clone(), recursive: self.recursive })
    }
}
impl MvOpts {
    fn edit(&self) -> Result<Edit> {
        let flags = if self.no_replace {
            RENAME_NOREPLACE
        } else if self.exchange {
            RENAME_EXCHANGE
        } else {
            0
        };
        Ok(Edit::Mv { from: self.from.clone(), to: self.to.clone(), flags })
    }
}
impl LnOpts {
    fn edit(&self) -> Result<Edit> {
        Ok(Edit::Ln {
            target: self.target.clone(),
            link: self.link.clone(),
            symbolic: self.symbolic,
        })
    }
}
impl MknodOpts {
    fn edit(&self) -> Result<Edit> {
        let kind = match self.kind.as_str() {
            "p" | "c" | "u" | "b" | "s" => self.kind.chars().next().expect("one letter"),
            k => {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    k.to_string(),
                    "TYPE is p, c, b or s",
                ))
            }
        };
        let (major, minor) = match (kind, self.major, self.minor) {
            ('c' | 'u' | 'b', Some(a), Some(b)) => (a, b),
            ('c' | 'u' | 'b', _, _) => {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    self.path.clone(),
                    "a device needs MAJOR and MINOR",
                ))
            }
            (_, None, None) => (0, 0),
            _ => {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    self.path.clone(),
                    "only devices (c, b) take MAJOR and MINOR",
                ))
            }
        };
        Ok(Edit::Mknod { path: self.path.clone(), kind, major, minor, mode: octal(&self.mode)? })
    }
}
impl TruncateOpts {
    fn edit(&self) -> Result<Edit> {
        Ok(Edit::Truncate { path: self.path.clone(), size: edit::parse_size(&self.size)? })
    }
}
impl ReflinkOpts {
    fn edit(&self) -> Result<Edit> {
        Ok(Edit::Reflink { src: self.src.clone(), dst: self.dst.clone() })
    }
}

impl FallocateOpts {
    fn edit(&self) -> Result<Edit> {
        use ubtrfs_core::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE, FALLOC_FL_ZERO_RANGE};
        let mut mode = 0;
        if self.keep_size || self.punch {
            mode |= FALLOC_FL_KEEP_SIZE;
        }
        if self.punch {
            mode |= FALLOC_FL_PUNCH_HOLE;
        }
        if self.zero {
            mode |= FALLOC_FL_ZERO_RANGE;
        }
        Ok(Edit::Fallocate {
            path: self.path.clone(),
            mode,
            offset: edit::parse_size(&self.offset)?,
            len: edit::parse_size(&self.len)?,
        })
    }
}
impl ChmodOpts {
    fn edit(&self) -> Result<Edit> {
        Ok(Edit::Chmod { mode: edit::parse_mode(&self.mode)?, path: self.path.clone() })
    }
}
impl ChattrOpts {
    fn edit(&self) -> Result<Edit> {
        edit::apply_chattr(&self.spec, 0)?;
        Ok(Edit::Chattr { spec: self.spec.clone(), path: self.path.clone() })
    }
}
impl ChownOpts {
    fn edit(&self) -> Result<Edit> {
        let (uid, gid) = edit::parse_owner(&self.owner)?;
        Ok(Edit::Chown { uid, gid, path: self.path.clone() })
    }
}
impl TouchOpts {
    fn edit(&self) -> Result<Edit> {
        Ok(Edit::Touch {
            path: self.path.clone(),
            time: self.date.as_deref().map(edit::parse_time).transpose()?,
        })
    }
}

impl EditCmd {
    fn edit(&self) -> Result<Edit> {
        match self {
            EditCmd::Mkdir(o) => o.edit(),
            EditCmd::Rm(o) => o.edit(),
            EditCmd::Mv(o) => o.edit(),
            EditCmd::Ln(o) => o.edit(),
            EditCmd::Mknod(o) => o.edit(),
            EditCmd::Truncate(o) => o.edit(),
            EditCmd::Reflink(o) => o.edit(),
            EditCmd::Fallocate(o) => o.edit(),
            EditCmd::Chmod(o) => o.edit(),
            EditCmd::Chattr(o) => o.edit(),
            EditCmd::Chown(o) => o.edit(),
            EditCmd::Touch(o) => o.edit(),
        }
    }
}

/// Run the edits in one transaction: all land in one commit, or none does. Subvolumes
/// an `rm` deleted (rmdir of an empty subvolume deletes it, as on the kernel) then
/// have their trees dropped before the command returns, as `subvolume delete` does:
/// the kernel's cleaner would do it soon after the rmdir.
fn run_edits(image: &WriteImageArgs, what: &str, edits: &[(String, Edit)]) -> Result<()> {
    let e = image.open_offline()?;
    let dead_before = if edits.iter().any(|(_, ed)| matches!(ed, Edit::Rm { .. })) {
        Some(e.dead_roots()?.len())
    } else {
        None
    };
    let mut said = Vec::new();
    for (at, ed) in edits {
        match edit::apply(&e, ed) {
            Ok(s) => said.push(s),
            Err(err) => {
                let err = if at.is_empty() { err } else { err.at(at.clone()) };
                // Nothing of the transaction is committed. (An abort fails only after a
                // panic in a writer, which refuses every change already.)
                let _ = e.abort(what, &err);
                return Err(err);
            }
        }
    }
    e.writeback_all()?;
    let gen = e.commit()?;
    for s in &said {
        eprintln!("{s}");
    }
    eprintln!(
        "{what}: {} change{} committed (generation {gen})",
        edits.len(),
        if edits.len() == 1 { "" } else { "s" }
    );
    if dead_before.is_some_and(|n| n < e.dead_roots().map(|d| d.len()).unwrap_or(0)) {
        crate::subvol_cmds::clean_saying(&e, &|line| eprintln!("{what}: {line}"))?;
    }
    Ok(())
}

/// One editing command on its own.
pub fn run_one<T: Args>(
    a: &WithImage<T>,
    what: &str,
    edit: impl Fn(&T) -> Result<Edit>,
) -> Result<()> {
    run_edits(&a.image, what, &[(String::new(), edit(&a.op)?)])
}

pub fn mkdir(a: &WithImage<MkdirOpts>) -> Result<()> {
    run_one(a, "mkdir", MkdirOpts::edit)
}
pub fn rm(a: &WithImage<RmOpts>) -> Result<()> {
    run_one(a, "rm", RmOpts::edit)
}
pub fn mv(a: &WithImage<MvOpts>) -> Result<()> {
    run_one(a, "mv", MvOpts::edit)
}
pub fn ln(a: &WithImage<LnOpts>) -> Result<()> {
    run_one(a, "ln", LnOpts::edit)
}
pub fn mknod(a: &WithImage<MknodOpts>) -> Result<()> {
    run_one(a, "mknod", MknodOpts::edit)
}
pub fn truncate(a: &WithImage<TruncateOpts>) -> Result<()> {
    run_one(a, "truncate", TruncateOpts::edit)
}
pub fn reflink(a: &WithImage<ReflinkOpts>) -> Result<()> {
    run_one(a, "reflink", ReflinkOpts::edit)
}

pub fn fallocate(a: &WithImage<FallocateOpts>) -> Result<()> {
    run_one(a, "fallocate", FallocateOpts::edit)
}
pub fn chmod(a: &WithImage<ChmodOpts>) -> Result<()> {
    run_one(a, "chmod", ChmodOpts::edit)
}
pub fn chattr(a: &WithImage<ChattrOpts>) -> Result<()> {
    run_one(a, "chattr", ChattrOpts::edit)
}

#[derive(Args)]
pub struct LsattrArgs {
    #[command(flatten)]
    pub image: crate::ImageArgs,
    /// Paths inside the image.
    #[arg(required = true)]
    pub paths: Vec<String>,
}

/// `lsattr`: the inode flags as lsattr prints them, one line per path.
pub fn lsattr(a: &LsattrArgs) -> Result<()> {
    use ubtrfs_core::{Filesystem, FsRead, Load};
    let fs = Filesystem::from_info(a.image.open()?)?;
    for p in &a.paths {
        let v = fs.resolve(edit::absolute(p)?, false)?;
        let _ = Load::ITEM;
        println!(
            "{} {}",
            edit::lsattr_string(ubtrfs_core::fsflags_of(v.item.flags.get())),
            ubtrfs_core::quote::name(p.as_bytes())
        );
    }
    Ok(())
}

pub fn chown(a: &WithImage<ChownOpts>) -> Result<()> {
    run_one(a, "chown", ChownOpts::edit)
}
pub fn touch(a: &WithImage<TouchOpts>) -> Result<()> {
    run_one(a, "touch", TouchOpts::edit)
}

#[derive(Args)]
pub struct BatchArgs {
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// A file of commands, one per line, without IMAGE (`-` or none: standard input).
    /// Blank lines and lines starting with # are skipped; words are split as a shell
    /// splits them (quotes, backslashes).
    pub script: Option<PathBuf>,
}

/// How a batch line parses: the editing commands, with no program name.
#[derive(Parser)]
#[command(no_binary_name = true, name = "batch line")]
struct BatchLine {
    #[command(subcommand)]
    cmd: EditCmd,
}

/// Parse a whole script before anything changes, so a typo on line 90 changes nothing.
fn parse_script(name: &str, text: impl BufRead) -> Result<Vec<(String, Edit)>> {
    let mut edits = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let at = format!("{name}:{}", i + 1);
        let line = line.map_err(|e| Error::io(format!("cannot read {name}"), e))?;
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let words = shlex::split(t).ok_or_else(|| {
            Error::posix_detail(PosixKind::Invalid, at.clone(), "unbalanced quotes")
        })?;
        let parsed = BatchLine::try_parse_from(&words).map_err(|e| {
            let msg = e.render().to_string();
            let first = msg
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("cannot parse")
                .trim_start_matches("error: ")
                .to_string();
            Error::posix_detail(PosixKind::Invalid, at.clone(), first)
        })?;
        edits.push((at.clone(), parsed.cmd.edit().map_err(|e| e.at(at))?));
    }
    Ok(edits)
}

pub fn batch(a: &BatchArgs) -> Result<()> {
    let edits = match a.script.as_deref() {
        None => parse_script("stdin", std::io::stdin().lock())?,
        Some(p) if p.as_os_str() == "-" => parse_script("stdin", std::io::stdin().lock())?,
        Some(p) => {
            let f = std::fs::File::open(p).map_err(|e| {
                Error::io(format!("cannot open {}", ubtrfs_core::quote::path(p)), e)
            })?;
            parse_script(&p.display().to_string(), std::io::BufReader::new(f))?
        }
    };
    run_edits(&a.image, "batch", &edits)
}
