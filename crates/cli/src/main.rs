//! The `ubtrfs` command: argument parsing and output only. Every subcommand opens the
//! image through `ubtrfs-core`, prints what it was asked for, prints the engine's
//! warnings to stderr, and exits non-zero with a one-line error on failure.

mod check_cmd;
mod dump;
mod edit_cmds;
mod info;
mod mkfs_cmd;
mod mount_cmd;
mod read_cmds;
mod subvol_cmds;
mod write_cmds;
mod xattr_cmds;

use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;
use ubtrfs_core::{Engine, FsInfo, OpenOptions};

#[derive(Parser)]
#[command(
    name = "ubtrfs",
    version,
    about = "Read, inspect, change and check btrfs images in userspace, without the kernel driver or root"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// Options shared by every command that opens an image.
#[derive(clap::Args, Clone)]
pub struct ImageArgs {
    /// The image file or block device (for multi-device filesystems, any one member).
    pub image: PathBuf,
    /// Another device of a multi-device filesystem (repeat for each).
    #[arg(long = "device", value_name = "DEV")]
    pub devices: Vec<PathBuf>,
    /// Tree-block cache size in MiB.
    #[arg(long, default_value_t = 64, value_name = "MIB")]
    pub cache_mib: usize,
    /// Show the last commit, leaving a log tree (what fsyncs after it left) unreplayed,
    /// as the kernel's `-o rescue=nologreplay`. Without it a log tree is replayed in
    /// memory and the image is not written. `dump-tree` and `info` always read the image
    /// as it is on disk; `check` checks it as it is, then (unless this is given) as it
    /// is after the replay.
    #[arg(long)]
    pub no_log_replay: bool,
}

/// Options of the commands that change an image.
#[derive(clap::Args, Clone)]
pub struct WriteImageArgs {
    /// The image file or block device (for multi-device filesystems, any one member).
    pub image: PathBuf,
    /// Another device of a multi-device filesystem (repeat for each; writing needs
    /// every member).
    #[arg(long = "device", value_name = "DEV")]
    pub devices: Vec<PathBuf>,
    /// Write with member devices missing, as `mount -o degraded`: allowed when every
    /// chunk keeps a copy on the devices given; new chunks are SINGLE where the
    /// profile needs more devices than are present.
    #[arg(long)]
    pub degraded: bool,
    /// Tree-block cache size in MiB.
    #[arg(long, default_value_t = 64, value_name = "MIB")]
    pub cache_mib: usize,
}

impl WriteImageArgs {
    /// Open the filesystem for writing, printing the engine's warnings to stderr.
    pub fn open_engine(&self) -> ubtrfs_core::Result<Engine> {
        let mut devices = vec![self.image.clone()];
        devices.extend(self.devices.iter().cloned());
        let e = Engine::open(&OpenOptions {
            devices,
            cache_bytes: self.cache_mib << 20,
            writable: true,
            sources: Default::default(),
            degraded: self.degraded,
            no_log_replay: false,
        })?;
        print_warnings(e.info());
        Ok(e)
    }

    /// `open_engine` for an offline command that is one transaction
    /// (`ubtrfs_tools::offline_engine`).
    pub fn open_offline(&self) -> ubtrfs_core::Result<Engine> {
        self.open_engine().map(ubtrfs_tools::offline_engine)
    }
}

impl ImageArgs {
    /// Open the filesystem as a kernel mount would show it (a log tree replayed in
    /// memory unless `--no-log-replay`), printing the engine's warnings to stderr.
    pub fn open(&self) -> ubtrfs_core::Result<FsInfo> {
        let fs = ubtrfs_core::open_with_log_replay(&self.options())?;
        print_warnings(&fs);
        Ok(fs)
    }

    /// Open the filesystem as it is on disk (a log tree is left as it is), printing
    /// the engine's warnings to stderr.
    pub fn open_raw(&self) -> ubtrfs_core::Result<FsInfo> {
        let fs = self.open_quiet()?;
        print_warnings(&fs);
        Ok(fs)
    }

    /// `open`, leaving the warnings for the caller to print.
    pub fn open_replayed_quiet(&self) -> ubtrfs_core::Result<FsInfo> {
        ubtrfs_core::open_with_log_replay(&self.options())
    }

    /// `open_raw`, leaving the warnings for the caller to print.
    pub fn open_quiet(&self) -> ubtrfs_core::Result<FsInfo> {
        FsInfo::open(&self.options())
    }

    fn options(&self) -> OpenOptions {
        let mut devices = vec![self.image.clone()];
        devices.extend(self.devices.iter().cloned());
        OpenOptions {
            devices,
            cache_bytes: self.cache_mib << 20,
            writable: false,
            sources: Default::default(),
            degraded: false,
            no_log_replay: self.no_log_replay,
        }
    }
}

pub fn print_warnings(fs: &FsInfo) {
    for w in fs.take_warnings() {
        eprintln!("ubtrfs: warning: {w}");
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Show features, sizes, profiles and usage per block-group type.
    Info(ImageArgs),
    /// Print the superblock (like `btrfs inspect-internal dump-super`).
    DumpSuper(dump::DumpSuperArgs),
    /// Print tree blocks (like `btrfs inspect-internal dump-tree`).
    DumpTree(dump::DumpTreeArgs),
    /// List a directory.
    Ls(read_cmds::LsArgs),
    /// Show an inode's metadata.
    Stat(read_cmds::StatArgs),
    /// Write a file's contents to stdout.
    Cat(read_cmds::CatArgs),
    /// Copy a tree out of the image into a host directory.
    Extract(read_cmds::ExtractArgs),
    /// Copy a host file or directory tree into the image (one atomic commit).
    Put(write_cmds::PutArgs),
    /// Remove a file, a symlink, an empty directory, or with -r a tree (one atomic commit).
    Rm(edit_cmds::WithImage<edit_cmds::RmOpts>),
    /// Make a directory.
    Mkdir(edit_cmds::WithImage<edit_cmds::MkdirOpts>),
    /// Rename FROM to TO, as rename(2) does (TO is replaced, not entered).
    Mv(edit_cmds::WithImage<edit_cmds::MvOpts>),
    /// Make a hard link, or with -s a symbolic link.
    Ln(edit_cmds::WithImage<edit_cmds::LnOpts>),
    /// Make a fifo, socket or device node.
    Mknod(edit_cmds::WithImage<edit_cmds::MknodOpts>),
    /// Set a file's size (a missing file is made).
    Truncate(edit_cmds::WithImage<edit_cmds::TruncateOpts>),
    /// Copy a file by sharing its extents (`cp --reflink=always`): no data is written.
    Reflink(edit_cmds::WithImage<edit_cmds::ReflinkOpts>),
    /// Make identical files, and identical 128 KiB blocks of other files, share their
    /// extents, as duperemove does on a mount.
    Dedupe(write_cmds::DedupeArgs),
    /// Preallocate (or with -p punch, -z zero) a range of a file, as fallocate(1) does
    /// (a missing file is made, mode 0644, when neither -k, -p nor -z is given).
    Fallocate(edit_cmds::WithImage<edit_cmds::FallocateOpts>),
    /// Change permission bits.
    Chmod(edit_cmds::WithImage<edit_cmds::ChmodOpts>),
    /// Change inode flags, as chattr does (+i, -a, =C, +c...).
    Chattr(edit_cmds::WithImage<edit_cmds::ChattrOpts>),
    /// List inode flags, as lsattr does.
    Lsattr(edit_cmds::LsattrArgs),
    /// Change the owner and group (numeric).
    Chown(edit_cmds::WithImage<edit_cmds::ChownOpts>),
    /// Set access and modification times (a missing file is made).
    Touch(edit_cmds::WithImage<edit_cmds::TouchOpts>),
    /// Run editing commands from a script, one per line without IMAGE, as one atomic commit.
    Batch(edit_cmds::BatchArgs),
    /// Make a new filesystem on an image file or block device, like mkfs.btrfs.
    Mkfs(Box<mkfs_cmd::MkfsArgs>),
    /// Check the filesystem's consistency (read-only), like `btrfs check --readonly`.
    Check(check_cmd::CheckArgs),
    /// Mount the filesystem with FUSE, read-write, until unmounted (fusermount3 -u,
    /// umount, SIGINT or SIGTERM commit first).
    Mount(mount_cmd::MountArgs),
    /// Unmount a ubtrfs mount and wait until its process has written the last commit
    /// and let the image go (`fusermount3 -u` and umount return before that).
    Umount(mount_cmd::UmountArgs),
    /// Link `mount.fuse.ubtrfs` and `umount.fuse.ubtrfs` to this executable, so `mount -t
    /// fuse.ubtrfs` and fstab lines work, and `umount` waits for the last commit.
    InstallHelper(mount_cmd::InstallHelperArgs),
    /// Subvolumes: create, snapshot, delete, sync, list, set-default, get-default.
    #[command(subcommand)]
    Subvolume(subvol_cmds::SubvolCmd),
    #[command(flatten)]
    Xattr(xattr_cmds::XattrCmd),
}

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == mount_cmd::HELPER_NAME)
    {
        return mount_cmd::helper_main(args);
    }
    if args
        .first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .is_some_and(|n| n == mount_cmd::UMOUNT_HELPER_NAME)
    {
        return mount_cmd::umount_helper_main(args);
    }
    let cli = Cli::parse_from(args);
    let r = match cli.cmd {
        Cmd::Info(a) => info::run(&a),
        Cmd::DumpSuper(a) => dump::run_super(&a),
        Cmd::DumpTree(a) => dump::run_tree(&a),
        Cmd::Ls(a) => read_cmds::ls(&a),
        Cmd::Stat(a) => read_cmds::stat(&a),
        Cmd::Cat(a) => read_cmds::cat(&a),
        Cmd::Extract(a) => read_cmds::extract(&a),
        Cmd::Check(a) => check_cmd::run(&a),
        Cmd::Mkfs(a) => mkfs_cmd::run(&a),
        Cmd::Put(a) => write_cmds::put(&a),
        Cmd::Rm(a) => edit_cmds::rm(&a),
        Cmd::Mkdir(a) => edit_cmds::mkdir(&a),
        Cmd::Mv(a) => edit_cmds::mv(&a),
        Cmd::Ln(a) => edit_cmds::ln(&a),
        Cmd::Mknod(a) => edit_cmds::mknod(&a),
        Cmd::Truncate(a) => edit_cmds::truncate(&a),
        Cmd::Reflink(a) => edit_cmds::reflink(&a),
        Cmd::Dedupe(a) => write_cmds::dedupe(&a),
        Cmd::Fallocate(a) => edit_cmds::fallocate(&a),
        Cmd::Chmod(a) => edit_cmds::chmod(&a),
        Cmd::Chattr(a) => edit_cmds::chattr(&a),
        Cmd::Lsattr(a) => edit_cmds::lsattr(&a),
        Cmd::Chown(a) => edit_cmds::chown(&a),
        Cmd::Touch(a) => edit_cmds::touch(&a),
        Cmd::Batch(a) => edit_cmds::batch(&a),
        Cmd::Xattr(c) => c.run(),
        Cmd::Subvolume(c) => c.run(),
        Cmd::Mount(a) => mount_cmd::run(&a),
        Cmd::Umount(a) => mount_cmd::umount(&a),
        Cmd::InstallHelper(a) => mount_cmd::install_helper(&a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // A closed stdout (`ubtrfs cat img f | head`) is not an error worth a message.
            if let ubtrfs_core::Error::Io { source, .. } = &e {
                if source.kind() == std::io::ErrorKind::BrokenPipe {
                    return ExitCode::SUCCESS;
                }
            }
            eprintln!("ubtrfs: error: {e}");
            ExitCode::FAILURE
        }
    }
}
