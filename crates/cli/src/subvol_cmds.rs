//! `ubtrfs subvolume create|snapshot|delete|sync|list|set-default|get-default`: subvolumes of an image, as
//! `btrfs subvolume` shows and changes them on a mount. Paths inside the image are
//! absolute and start at the default subvolume, as a mount without subvol= does.

use crate::{ImageArgs, WriteImageArgs};
use clap::{Args, Subcommand};
use ubtrfs_core::{
    DropStats, Engine, Error, FileKind, Filesystem, FsRead, InodeAttrs, Load, OpenOptions,
    PosixKind, Result, SubvolInfo,
};
use ubtrfs_format::key::{FIRST_FREE_OBJECTID, FS_TREE_OBJECTID};

#[derive(Subcommand)]
pub enum SubvolCmd {
    /// Make a subvolume at PATH (its parent directory must exist), as
    /// `btrfs subvolume create` does. IMAGE may be the mount point of a running
    /// `ubtrfs mount` (the same for snapshot, delete and set-default).
    Create(SubvolCreateArgs),
    /// Snapshot the subvolume at SRC as DST (its parent directory must exist), as
    /// `btrfs subvolume snapshot [-r]` does: DST shares every block of SRC.
    Snapshot(SubvolSnapshotArgs),
    /// Delete the subvolumes at PATH..., as `btrfs subvolume delete` does, then drop
    /// their trees (the kernel's cleaner does that after the command returns; here it
    /// runs before the command ends, unless --no-clean leaves it to the next `sync`
    /// or mount, by us or by the kernel).
    Delete(SubvolDeleteArgs),
    /// Drop the trees of every deleted subvolume still waiting for it (`btrfs
    /// subvolume sync` waits for the kernel's cleaner to do this).
    Sync(WriteImageArgs),
    /// List every subvolume: id, parent id and path from the top-level subvolume.
    List(SubvolListArgs),
    /// Make the subvolume at PATH (or with that numeric ID) the one a mount shows.
    SetDefault(SubvolSetDefaultArgs),
    /// Print the default subvolume's id and path.
    GetDefault(ImageArgs),
}

#[derive(Args)]
pub struct SubvolCreateArgs {
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// Absolute path of the new subvolume inside the image.
    pub path: String,
    /// Permission bits of its top directory (octal).
    #[arg(short = 'm', value_name = "MODE", default_value = "755")]
    pub mode: String,
}

#[derive(Args)]
pub struct SubvolSnapshotArgs {
    /// Make the snapshot read-only.
    #[arg(short = 'r')]
    pub readonly: bool,
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// Absolute path of the subvolume to snapshot (`/` for the default one).
    pub src: String,
    /// Absolute path of the new snapshot.
    pub dst: String,
}

#[derive(Args)]
pub struct SubvolDeleteArgs {
    /// Only mark them deleted; leave the dropping of their trees to the next
    /// `subvolume sync` or mount.
    #[arg(long)]
    pub no_clean: bool,
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// Absolute paths of the subvolumes inside the image.
    #[arg(required = true)]
    pub paths: Vec<String>,
}

#[derive(Args)]
pub struct SubvolListArgs {
    /// List the deleted subvolumes whose trees are not dropped yet instead (as `btrfs
    /// subvolume list -d`).
    #[arg(short = 'd')]
    pub deleted: bool,
    #[command(flatten)]
    pub image: ImageArgs,
}

#[derive(Args)]
pub struct SubvolSetDefaultArgs {
    #[command(flatten)]
    pub image: WriteImageArgs,
    /// The subvolume: its path inside the image, or its numeric id (5 is the top level).
    pub subvol: String,
}

impl SubvolCmd {
    pub fn run(&self) -> Result<()> {
        match self {
            SubvolCmd::Create(a) => create(a),
            SubvolCmd::Snapshot(a) => snapshot(a),
            SubvolCmd::Delete(a) => delete(a),
            SubvolCmd::Sync(a) => sync(a),
            SubvolCmd::List(a) => list(a),
            SubvolCmd::SetDefault(a) => set_default(a),
            SubvolCmd::GetDefault(a) => get_default(a),
        }
    }
}

/// The mount point, when IMAGE names a directory (a running `ubtrfs mount`): the
/// command then goes through the mount's btrfs ioctls (`ubtrfs_fuse::subvol_ioctl`).
fn mount_of(image: &WriteImageArgs) -> Option<&std::path::Path> {
    image.image.is_dir().then_some(image.image.as_path())
}

/// Open directory `p` (on a mount) for an ioctl.
fn open_dir(p: &std::path::Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(p)
        .map_err(|e| Error::io(p.display().to_string(), e))
}

/// The host path of in-filesystem path `path` on mount `mnt`, split into its parent
/// directory and name.
fn on_mount(mnt: &std::path::Path, path: &str) -> Result<(std::path::PathBuf, Vec<u8>)> {
    use std::os::unix::ffi::OsStrExt;
    let host = mnt.join(path.trim_start_matches('/'));
    let name = host
        .file_name()
        .ok_or_else(|| {
            Error::posix_detail(PosixKind::Invalid, path.to_string(), "no name to make or remove")
        })?
        .as_bytes()
        .to_vec();
    Ok((host.parent().expect("a path with a name has a parent").to_path_buf(), name))
}

/// Issue btrfs ioctl `cmd` on `f` with the 4096-byte argument `arg` (in and out).
fn btrfs_ioctl(f: &std::fs::File, cmd: u32, arg: &mut [u8], what: &str) -> Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `arg` is as large as the size the command encodes (checked by the
    // callers' buffers of 4096 or 8 bytes), and lives across the call.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), cmd as _, arg.as_mut_ptr()) };
    if r < 0 {
        return Err(Error::io(what.to_string(), std::io::Error::last_os_error()));
    }
    Ok(())
}

/// A `btrfs_ioctl_vol_args_v2` with `fd`, `flags` and `name`.
fn vol_args_v2(fd: i64, flags: u64, name: &[u8]) -> Result<Vec<u8>> {
    let mut a = vec![0u8; 4096];
    if name.len() >= 4040 {
        return Err(Error::posix(PosixKind::NameTooLong, ubtrfs_core::quote::name(name)));
    }
    a[..8].copy_from_slice(&fd.to_le_bytes());
    a[16..24].copy_from_slice(&flags.to_le_bytes());
    a[56..56 + name.len()].copy_from_slice(name);
    Ok(a)
}

fn create(a: &SubvolCreateArgs) -> Result<()> {
    let mode = u32::from_str_radix(&a.mode, 8).ok().filter(|m| *m <= 0o7777).ok_or_else(|| {
        Error::posix_detail(
            PosixKind::Invalid,
            format!("mode {:?}", a.mode),
            "not octal permission bits",
        )
    })?;
    let path = ubtrfs_tools::edit::absolute(&a.path)?;
    if let Some(mnt) = mount_of(&a.image) {
        let (parent, name) = on_mount(mnt, path)?;
        let mut arg = vol_args_v2(0, 0, &name)?;
        btrfs_ioctl(
            &open_dir(&parent)?,
            ubtrfs_fuse::subvol_ioctl::BTRFS_IOC_SUBVOL_CREATE_V2,
            &mut arg,
            &format!("create subvolume {path}"),
        )?;
        // The ioctl makes it 0755, as the kernel's.
        if mode != 0o755 {
            use std::os::unix::fs::PermissionsExt;
            let host = mnt.join(path.trim_start_matches('/'));
            std::fs::set_permissions(&host, std::fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io(host.display().to_string(), e))?;
        }
        println!("created subvolume at {path} through the mount");
        return Ok(());
    }
    let e = a.image.open_engine()?;
    let (parent, name) = e.read(|l| l.resolve_parent(path))?;
    let id = e.create_subvol(parent, &name, &InodeAttrs::new(mode))?;
    e.commit()?;
    println!("created subvolume {id} at {path}");
    Ok(())
}

fn snapshot(a: &SubvolSnapshotArgs) -> Result<()> {
    let (src, dst) = (ubtrfs_tools::edit::absolute(&a.src)?, ubtrfs_tools::edit::absolute(&a.dst)?);
    if let Some(mnt) = mount_of(&a.image) {
        use std::os::fd::AsRawFd;
        let s = open_dir(&mnt.join(src.trim_start_matches('/')))?;
        let (parent, name) = on_mount(mnt, dst)?;
        let flags = if a.readonly { ubtrfs_fuse::subvol_ioctl::BTRFS_SUBVOL_RDONLY } else { 0 };
        let mut arg = vol_args_v2(i64::from(s.as_raw_fd()), flags, &name)?;
        btrfs_ioctl(
            &open_dir(&parent)?,
            ubtrfs_fuse::subvol_ioctl::BTRFS_IOC_SNAP_CREATE_V2,
            &mut arg,
            &format!("snapshot {src} as {dst}"),
        )?;
        println!(
            "created {}snapshot of {src} at {dst} through the mount",
            if a.readonly { "read-only " } else { "" }
        );
        return Ok(());
    }
    let e = a.image.open_engine()?;
    let id = e.read(|l| l.resolve_id(src, true))?;
    if id.ino != FIRST_FREE_OBJECTID
        || e.read(|l| Ok(l.load_inode(id, Load::ITEM)?.kind()))? != FileKind::Dir
    {
        return Err(Error::posix_detail(
            PosixKind::Invalid,
            ubtrfs_core::quote::name(src.as_bytes()),
            "not a subvolume",
        ));
    }
    let (parent, name) = e.read(|l| l.resolve_parent(dst))?;
    // Commits, before and after.
    let new = e.create_snapshot(id.root, parent, &name, a.readonly)?;
    println!(
        "created {}snapshot {new} of {src} at {dst}",
        if a.readonly { "read-only " } else { "" }
    );
    Ok(())
}

fn delete(a: &SubvolDeleteArgs) -> Result<()> {
    let paths: Vec<&str> =
        a.paths.iter().map(|p| ubtrfs_tools::edit::absolute(p)).collect::<Result<_>>()?;
    if let Some(mnt) = mount_of(&a.image) {
        // The mount's cleaner drops the trees.
        for path in paths {
            let (parent, name) = on_mount(mnt, path)?;
            let mut arg = vol_args_v2(0, 0, &name)?;
            btrfs_ioctl(
                &open_dir(&parent)?,
                ubtrfs_fuse::subvol_ioctl::BTRFS_IOC_SNAP_DESTROY_V2,
                &mut arg,
                &format!("delete subvolume {path}"),
            )?;
            println!("deleted subvolume at {path} through the mount");
        }
        return Ok(());
    }
    let e = a.image.open_engine()?;
    for path in paths {
        let (parent, name) = e.read(|l| l.resolve_parent(path))?;
        let id = e.delete_subvol(parent, &name)?;
        println!("deleted subvolume {id} at {path}");
    }
    e.commit()?;
    if !a.no_clean {
        clean(&e)?;
    }
    Ok(())
}

fn sync(a: &WriteImageArgs) -> Result<()> {
    let e = a.open_engine()?;
    let st = clean(&e)?;
    if st.tree_refs_dropped == 0 && e.dead_roots()?.is_empty() {
        println!("no deleted subvolume waits for its tree to be dropped");
    }
    Ok(())
}

/// Drop every deleted subvolume's tree, with a spinner on a terminal; a line on stdout
/// for each tree dropped.
fn clean(e: &Engine) -> Result<DropStats> {
    clean_saying(e, &|line| println!("{line}"))
}

/// `clean`, saying each tree dropped through `say`.
pub(crate) fn clean_saying(e: &Engine, say: &dyn Fn(&str)) -> Result<DropStats> {
    use std::io::IsTerminal;
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {elapsed} {msg}")
                .expect("static template"),
        );
        b
    });
    let mut cur = 0;
    let st = e.clean_dead_roots(&mut |id, st| {
        if id != cur {
            if cur != 0 {
                say(&format!("dropped the tree of subvolume {cur}"));
            }
            cur = id;
        }
        if let Some(b) = &bar {
            b.set_message(format!(
                "dropping subvolume {id}: {} tree blocks read, {} references dropped",
                st.blocks_read, st.tree_refs_dropped
            ));
            b.tick();
        }
        true
    })?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if cur != 0 {
        say(&format!("dropped the tree of subvolume {cur}"));
    }
    Ok(st)
}

fn open(a: &ImageArgs) -> Result<Filesystem> {
    let mut devices = vec![a.image.clone()];
    devices.extend(a.devices.iter().cloned());
    let fs = Filesystem::open(&OpenOptions {
        devices,
        cache_bytes: a.cache_mib << 20,
        writable: false,
        sources: Default::default(),
        degraded: false,
        no_log_replay: false,
    })?;
    crate::print_warnings(fs.info());
    Ok(fs)
}

/// Path of subvolume `id` from the top-level subvolume.
fn subvol_path(fs: &Filesystem, subvols: &[SubvolInfo], id: u64) -> Result<String> {
    let mut parts: Vec<String> = Vec::new();
    let mut cur = id;
    for _ in 0..=subvols.len() {
        if cur == FS_TREE_OBJECTID {
            parts.reverse();
            return Ok(parts.join("/"));
        }
        let s = subvols.iter().find(|s| s.id == cur).ok_or_else(|| {
            Error::posix_detail(
                PosixKind::NotFound,
                format!("subvolume {cur}"),
                "no ROOT_BACKREF names it",
            )
        })?;
        let mut p = String::from_utf8_lossy(&s.name).into_owned();
        let dir = fs.dir_path(s.parent, s.dirid)?;
        if !dir.is_empty() {
            p = format!("{}/{p}", String::from_utf8_lossy(&dir));
        }
        parts.push(p);
        cur = s.parent;
    }
    Err(Error::posix_detail(PosixKind::Invalid, format!("subvolume {id}"), "its parents loop"))
}

fn list(a: &SubvolListArgs) -> Result<()> {
    if a.deleted {
        let mut devices = vec![a.image.image.clone()];
        devices.extend(a.image.devices.iter().cloned());
        let opts = OpenOptions {
            devices,
            cache_bytes: a.image.cache_mib << 20,
            writable: false,
            sources: Default::default(),
            degraded: false,
            no_log_replay: false,
        };
        let e = Engine::open_read_only(&opts)?;
        crate::print_warnings(e.info());
        for d in e.dead_roots()? {
            println!("ID {} gen {} top level 0 path <deleted>", d.id, d.generation);
        }
        return Ok(());
    }
    let fs = open(&a.image)?;
    let subvols = fs.subvolumes()?;
    for s in &subvols {
        println!("ID {} parent {} path {}", s.id, s.parent, subvol_path(&fs, &subvols, s.id)?);
    }
    Ok(())
}

fn set_default(a: &SubvolSetDefaultArgs) -> Result<()> {
    if let Some(mnt) = mount_of(&a.image) {
        use ubtrfs_fuse::subvol_ioctl::{BTRFS_IOC_DEFAULT_SUBVOL, BTRFS_IOC_INO_LOOKUP};
        let id = match a.subvol.parse::<u64>() {
            Ok(id) => id,
            Err(_) => {
                // The tree of the path's top directory (`btrfs inspect-internal rootid`).
                let path = ubtrfs_tools::edit::absolute(&a.subvol)?;
                let mut arg = vec![0u8; 4096];
                arg[8..16].copy_from_slice(&FIRST_FREE_OBJECTID.to_le_bytes());
                btrfs_ioctl(
                    &open_dir(&mnt.join(path.trim_start_matches('/')))?,
                    BTRFS_IOC_INO_LOOKUP,
                    &mut arg,
                    &format!("the subvolume of {path}"),
                )?;
                u64::from_le_bytes(arg[..8].try_into().expect("eight bytes"))
            }
        };
        let mut arg = id.to_le_bytes().to_vec();
        btrfs_ioctl(
            &open_dir(mnt)?,
            BTRFS_IOC_DEFAULT_SUBVOL,
            &mut arg,
            &format!("set subvolume {id} as the default"),
        )?;
        return Ok(());
    }
    let e = a.image.open_engine()?;
    let id = match a.subvol.parse::<u64>() {
        Ok(id) => id,
        Err(_) => {
            let path = ubtrfs_tools::edit::absolute(&a.subvol)?;
            let id = e.read(|l| l.resolve_id(path, true))?;
            let kind = e.read(|l| Ok(l.load_inode(id, Load::ITEM)?.kind()))?;
            if id.ino != FIRST_FREE_OBJECTID || kind != FileKind::Dir {
                return Err(Error::posix_detail(
                    PosixKind::Invalid,
                    ubtrfs_core::quote::name(path.as_bytes()),
                    "not a subvolume",
                ));
            }
            id.root
        }
    };
    e.set_default_subvol(id)?;
    e.commit()?;
    Ok(())
}

fn get_default(a: &ImageArgs) -> Result<()> {
    let fs = open(a)?;
    let id = fs.default_subvol();
    if id == FS_TREE_OBJECTID {
        println!("ID 5 (FS_TREE)");
    } else {
        let subvols = fs.subvolumes()?;
        println!("ID {id} path {}", subvol_path(&fs, &subvols, id)?);
    }
    Ok(())
}
