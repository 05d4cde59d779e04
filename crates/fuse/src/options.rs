//! The mount's `-o` options, parsed once into `MountOptions`.
//!
//! The btrfs options keep the kernel's names and defaults (`commit=30`, `relatime`,
//! `compress=ALG[:LEVEL]`, `compress-force=`, `subvol=`, `subvolid=`); the FUSE ones
//! are the kernel FUSE driver's (`allow_other`, `default_permissions`); `uid=` and
//! `gid=` map one id for rootless use; the generic mount options mount(8) passes to a
//! helper (`dev`, `suid`, `exec`, `auto`, `nofail`, `_netdev`, ...) are accepted and
//! passed on or ignored as the kernel FUSE driver does. Anything else is an error
//! naming the option: an option that is silently dropped is a surprise waiting.
//!
//! `remount` (with `ro`, `rw` and the per-mount flags) changes a running mount; the
//! FUSE driver's own options that mountinfo shows (`user_id=`, `group_id=`, ...) and
//! that mount(8) passes back on a remount are accepted there and nowhere else.
//! `MountState` is what changes while the mount runs: whether its superblock is
//! read-only now (a `mount -o remount,ro`), shared by the session and the requests.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use ubtrfs_core::{
    mountinfo::{self, DevNum},
    AtimeMode, AtimeOpts, CompressPolicy, Error, PosixKind, Result,
};

/// The kernel's default commit interval, in seconds.
pub const DEFAULT_COMMIT_SECS: u64 = 30;
/// The kernel warns past this commit interval (BTRFS_DEFAULT_MAX_COMMIT_AGE is 300).
pub const MAX_COMMIT_SECS: u64 = 300;

/// An id mapping for rootless use: the image's `inside` id shows as `outside`, and
/// what `outside` creates is stored as `inside` (bindfs's `--map=inside/outside`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdMap {
    pub inside: u32,
    pub outside: u32,
}

impl IdMap {
    /// The id the mount shows for `id` on disk.
    pub fn show(m: Option<IdMap>, id: u32) -> u32 {
        match m {
            Some(m) if id == m.inside => m.outside,
            _ => id,
        }
    }

    /// The id stored for `id` from a request.
    pub fn store(m: Option<IdMap>, id: u32) -> u32 {
        match m {
            Some(m) if id == m.outside => m.inside,
            _ => id,
        }
    }
}

/// What `-o` asked for.
#[derive(Clone, Debug)]
pub struct MountOptions {
    pub read_only: bool,
    pub compress: Option<CompressPolicy>,
    /// Seconds between periodic commits.
    pub commit_secs: u64,
    /// Mount this subvolume (a path from the top level) instead of the default one.
    pub subvol: Option<String>,
    pub subvolid: Option<u64>,
    pub allow_other: bool,
    pub default_permissions: bool,
    pub uid: Option<IdMap>,
    pub gid: Option<IdMap>,
    pub atime: AtimeOpts,
    /// Tree-block cache, MiB.
    pub cache_mib: usize,
    /// File data cached in memory (the page cache), MiB.
    pub page_cache_mib: u64,
    /// Dirty file data held before writers write back (the dirty limit), MiB.
    pub dirty_mib: u64,
    /// FUSE worker threads.
    pub threads: usize,
    /// Take requests over io_uring when the kernel offers it (`io_uring`, the default;
    /// `noio_uring` keeps to /dev/fuse).
    pub io_uring: bool,
    /// Entries per io_uring queue (`io_uring_depth=N`, 1 to 64).
    pub io_uring_depth: usize,
    /// Allow device nodes to be opened as devices (FUSE's `dev`; `nodev` is the
    /// default for FUSE mounts, as for the kernel driver).
    pub dev: bool,
    pub suid: bool,
    pub exec: bool,
    /// Mount with member devices missing (as `-o degraded`).
    pub degraded: bool,
    /// `rescue=nologreplay` (or its old name `norecovery`), read-only mounts only, as
    /// on the kernel: a log tree is not replayed (the mount shows the last commit), and
    /// FITRIM is refused with EROFS, since the log's extents are not in the free space.
    pub nologreplay: bool,
    /// Extra devices (`device=PATH`, repeatable, as the kernel's option).
    pub devices: Vec<String>,
    /// Change a running mount (`-o remount,...`) instead of mounting.
    pub remount: bool,
    /// With `remount`: only this mount point's flags (`remount,bind,ro`).
    pub bind: bool,
    /// The FUSE driver's options that mountinfo shows (`user_id=0`), which mount(8)
    /// passes back with a remount; refused in a new mount.
    pub fuse_shown: Vec<String>,
    /// What changes while the mount runs (shared by every clone).
    pub state: Arc<MountState>,
}

/// A running mount's state that a remount changes.
#[derive(Debug, Default)]
pub struct MountState {
    /// The superblock is read-only now (`mount -o remount,ro`), while the image stays
    /// open for writing.
    remounted_ro: AtomicBool,
    /// The mount's device number, once it is mounted.
    dev: OnceLock<DevNum>,
}

impl MountState {
    /// Note the device number of the mount (once).
    pub fn set_dev(&self, dev: DevNum) {
        let _ = self.dev.set(dev);
    }

    /// The mount's device number, once known.
    pub fn dev(&self) -> Option<DevNum> {
        self.dev.get().copied()
    }

    /// Note whether the superblock is read-only; returns the previous state.
    pub fn set_remounted_ro(&self, ro: bool) -> bool {
        self.remounted_ro.swap(ro, Ordering::SeqCst)
    }

    /// Whether the superblock was read-only when last seen. A read-write remount is
    /// seen by the session's watcher a moment after the remount returns; a change
    /// refused meanwhile looks again (`MountOptions::is_read_only`).
    pub fn remounted_ro(&self) -> bool {
        self.remounted_ro.load(Ordering::SeqCst)
    }

    /// Read the superblock's state from the mount table now (None: not found).
    pub fn look(&self) -> Option<bool> {
        let dev = self.dev()?;
        let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        mountinfo::parse_mountinfo(&text).iter().find(|m| m.dev == dev).map(|m| m.super_read_only())
    }
}

impl Default for MountOptions {
    fn default() -> MountOptions {
        MountOptions {
            read_only: false,
            compress: None,
            commit_secs: DEFAULT_COMMIT_SECS,
            subvol: None,
            subvolid: None,
            allow_other: false,
            default_permissions: false,
            uid: None,
            gid: None,
            atime: AtimeOpts { mode: AtimeMode::Relatime, nodiratime: false },
            cache_mib: 256,
            page_cache_mib: ubtrfs_core::DEFAULT_CACHE_BYTES >> 20,
            dirty_mib: ubtrfs_core::DEFAULT_DIRTY_BYTES >> 20,
            threads: default_threads(),
            io_uring: true,
            io_uring_depth: 4,
            dev: false,
            suid: false,
            exec: true,
            degraded: false,
            nologreplay: false,
            devices: Vec::new(),
            remount: false,
            bind: false,
            fuse_shown: Vec::new(),
            state: Arc::default(),
        }
    }
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).clamp(2, 8)
}

fn bad(opt: &str, why: impl Into<String>) -> Error {
    Error::posix_detail(PosixKind::Invalid, format!("mount option {opt:?}"), why)
}

fn number<T: std::str::FromStr>(opt: &str, v: &str) -> Result<T> {
    v.parse().map_err(|_| bad(opt, format!("{v:?} is not a number")))
}

/// `N` or `INSIDE:OUTSIDE`... `uid=N` maps the image's 0 to N.
fn id_map(opt: &str, v: &str) -> Result<IdMap> {
    match v.split_once(':') {
        Some((i, o)) => Ok(IdMap { inside: number(opt, i)?, outside: number(opt, o)? }),
        None => Ok(IdMap { inside: 0, outside: number(opt, v)? }),
    }
}

impl MountOptions {
    /// The defaults of the `mount.fuse.ubtrfs` helper: `dev` and `suid`, as
    /// mount.fuse3 adds them unless told `nodev` or `nosuid` (mount(8) passes neither
    /// `dev` nor `suid` on, they are the absence of a flag; it passes `nodev,nosuid`
    /// itself for an fstab line with `user`). A mount by a user through fusermount3
    /// stays `nodev,nosuid` whatever is asked.
    pub fn for_helper() -> MountOptions {
        MountOptions { dev: true, suid: true, ..MountOptions::default() }
    }

    /// Whether changes are refused: opened read-only, or remounted read-only. A
    /// remount back to read-write may not have reached the session's watcher yet, so
    /// a refusal looks at the mount table first.
    pub fn is_read_only(&self) -> bool {
        if self.read_only {
            return true;
        }
        if !self.state.remounted_ro() {
            return false;
        }
        match self.state.look() {
            Some(false) => {
                self.state.set_remounted_ro(false);
                false
            }
            _ => true,
        }
    }

    /// Apply one comma-separated `-o` list (later options win, as in mount(8)).
    ///
    /// # Errors
    /// `Posix(Invalid)` naming an unknown option or a bad value.
    pub fn apply(&mut self, list: &str) -> Result<()> {
        for opt in list.split(',').filter(|o| !o.is_empty()) {
            let (k, v) = match opt.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (opt, None),
            };
            let need = || v.ok_or_else(|| bad(opt, "needs a value"));
            let none = || if v.is_some() { Err(bad(opt, "takes no value")) } else { Ok(()) };
            match k {
                "ro" => {
                    none()?;
                    self.read_only = true
                }
                "rw" => {
                    none()?;
                    self.read_only = false
                }
                "compress" | "compress-force" => {
                    let v = v.unwrap_or("zlib");
                    let p = CompressPolicy::parse(v, k == "compress-force")
                        .map_err(|e| bad(opt, e.to_string()))?;
                    self.compress = p.alg.is_some().then_some(p);
                }
                "commit" => {
                    let n: u64 = number(opt, need()?)?;
                    if n == 0 {
                        return Err(bad(opt, "the interval is at least 1 second"));
                    }
                    self.commit_secs = n;
                }
                "subvol" => self.subvol = Some(need()?.to_string()),
                "subvolid" => self.subvolid = Some(number(opt, need()?)?),
                "allow_other" => {
                    none()?;
                    self.allow_other = true
                }
                "default_permissions" => {
                    none()?;
                    self.default_permissions = true
                }
                "uid" => self.uid = Some(id_map(opt, need()?)?),
                "gid" => self.gid = Some(id_map(opt, need()?)?),
                "noatime" => self.atime.mode = AtimeMode::Noatime,
                "relatime" => self.atime.mode = AtimeMode::Relatime,
                "strictatime" | "atime" => self.atime.mode = AtimeMode::Strict,
                "nodiratime" => self.atime.nodiratime = true,
                "diratime" => self.atime.nodiratime = false,
                "cache_mib" => self.cache_mib = number(opt, need()?)?,
                "page_cache_mib" => {
                    self.page_cache_mib = number(opt, need()?)?;
                    if self.page_cache_mib == 0 {
                        return Err(bad(opt, "the page cache takes at least 1 MiB"));
                    }
                }
                "dirty_mib" => {
                    self.dirty_mib = number(opt, need()?)?;
                    if self.dirty_mib == 0 {
                        return Err(bad(opt, "the dirty limit is at least 1 MiB"));
                    }
                }
                "threads" => {
                    let n: usize = number(opt, need()?)?;
                    if !(1..=64).contains(&n) {
                        return Err(bad(opt, "threads are 1 to 64"));
                    }
                    self.threads = n;
                }
                "io_uring" => {
                    none()?;
                    self.io_uring = true
                }
                "noio_uring" => {
                    none()?;
                    self.io_uring = false
                }
                "io_uring_depth" => {
                    let n: usize = number(opt, need()?)?;
                    if !(1..=64).contains(&n) {
                        return Err(bad(opt, "the queue depth is 1 to 64"));
                    }
                    self.io_uring_depth = n;
                }
                "dev" => self.dev = true,
                "nodev" => self.dev = false,
                "suid" => self.suid = true,
                "nosuid" => self.suid = false,
                "exec" => self.exec = true,
                "noexec" => self.exec = false,
                "degraded" => self.degraded = true,
                "norecovery" => {
                    none()?;
                    self.nologreplay = true
                }
                "rescue" if v == Some("nologreplay") => self.nologreplay = true,
                "remount" => {
                    none()?;
                    self.remount = true
                }
                "bind" => {
                    none()?;
                    self.bind = true
                }
                // The FUSE driver's options as mountinfo shows them: mount(8) merges them
                // into a remount's options.
                "user_id" | "group_id" | "rootmode" | "max_read" | "blksize" => {
                    need()?;
                    self.fuse_shown.push(opt.to_string())
                }
                "device" => self.devices.push(need()?.to_string()),
                // mount(8) and fstab pass these to every helper; they mean nothing here.
                "auto"
                | "noauto"
                | "nofail"
                | "_netdev"
                | "user"
                | "nouser"
                | "users"
                | "defaults"
                | "async"
                | "x-systemd.automount" => {}
                // btrfs options with nothing to do in a single-process mount.
                "space_cache" | "ssd" | "nossd" | "discard" | "nodiscard" | "autodefrag"
                | "noautodefrag" => {}
                _ if k.starts_with("x-") || k.starts_with("comment=") => {}
                _ => return Err(bad(opt, "unknown option")),
            }
        }
        if self.nologreplay && !self.read_only && !self.remount {
            return Err(bad("rescue=nologreplay", "must be used with ro, as on the kernel"));
        }
        if self.dirty_mib > self.page_cache_mib {
            return Err(bad(
                &format!("dirty_mib={}", self.dirty_mib),
                format!(
                    "the dirty limit cannot pass the page cache (page_cache_mib={})",
                    self.page_cache_mib
                ),
            ));
        }
        if self.commit_secs > MAX_COMMIT_SECS {
            eprintln!("warning: commit={} is past the kernel's {MAX_COMMIT_SECS}-second maximum age; a crash loses up to that much", self.commit_secs);
        }
        Ok(())
    }

    /// Parse a whole option list from the defaults.
    ///
    /// # Errors
    /// As `apply`.
    pub fn parse(list: &str) -> Result<MountOptions> {
        let mut o = MountOptions::default();
        o.apply(list)?;
        Ok(o)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ubtrfs_core::CompressionType;

    #[test]
    fn options_parse_with_the_kernels_names_and_defaults() {
        let o = MountOptions::parse("").unwrap();
        assert_eq!(o.commit_secs, 30);
        assert_eq!(o.atime.mode, AtimeMode::Relatime);
        assert!(!o.read_only && !o.allow_other && o.compress.is_none());
        let o = MountOptions::parse("ro,compress=zstd:3,commit=5,subvol=/a/b,allow_other,default_permissions,uid=1000,gid=5:100,noatime,nodev,auto,x-systemd.foo").unwrap();
        assert!(o.read_only && o.allow_other && o.default_permissions);
        let c = o.compress.unwrap();
        assert_eq!((c.alg, c.level, c.force), (Some(CompressionType::Zstd), Some(3), false));
        assert_eq!(o.commit_secs, 5);
        assert_eq!(o.subvol.as_deref(), Some("/a/b"));
        assert_eq!(o.uid, Some(IdMap { inside: 0, outside: 1000 }));
        assert_eq!(o.gid, Some(IdMap { inside: 5, outside: 100 }));
        assert_eq!(o.atime.mode, AtimeMode::Noatime);
        let o = MountOptions::parse("compress-force=lzo,rw,subvolid=257").unwrap();
        assert!(!o.read_only && o.compress.unwrap().force);
        assert_eq!(o.subvolid, Some(257));
        assert!(MountOptions::parse("compress=no").unwrap().compress.is_none());
        let o = MountOptions::parse("page_cache_mib=64,dirty_mib=16").unwrap();
        assert_eq!((o.page_cache_mib, o.dirty_mib), (64, 16));
        let d = MountOptions::parse("").unwrap();
        assert_eq!((d.page_cache_mib, d.dirty_mib), (512, 128));
    }

    #[test]
    fn bad_options_are_named() {
        for (list, what) in [
            ("bogus", "bogus"),
            ("commit=0", "commit=0"),
            ("commit=x", "commit=x"),
            ("compress=brotli", "compress=brotli"),
            ("ro=1", "ro=1"),
            ("subvol", "subvol"),
            ("threads=0", "threads=0"),
            ("page_cache_mib=0", "page_cache_mib=0"),
            ("page_cache_mib=64,dirty_mib=65", "dirty_mib=65"),
        ] {
            let e = MountOptions::parse(list).unwrap_err().to_string();
            assert!(e.contains(what), "{list}: {e}");
        }
    }

    #[test]
    fn remount_lists_as_mount8_passes_them() {
        // util-linux 2.38's argv for `mount -o remount,ro MNT` of a fuse.ubtrfs mount.
        let o = MountOptions::parse(
            "ro,nosuid,nodev,relatime,remount,user_id=0,group_id=0,default_permissions",
        )
        .unwrap();
        assert!(o.remount && o.read_only && !o.bind && !o.dev && !o.suid);
        assert_eq!(o.fuse_shown, ["user_id=0", "group_id=0"]);
        assert!(MountOptions::parse("remount,bind,ro").unwrap().bind);
        assert!(MountOptions::parse("user_id").is_err());
        let h = MountOptions::for_helper();
        assert!(h.dev && h.suid && !h.remount);
        // Opened read-only stays read-only, whatever the mount table says.
        assert!(MountOptions::parse("ro").unwrap().is_read_only());
        assert!(!MountOptions::default().is_read_only());
    }

    #[test]
    fn id_maps_swap_one_id() {
        let m = Some(IdMap { inside: 0, outside: 1000 });
        assert_eq!(IdMap::show(m, 0), 1000);
        assert_eq!(IdMap::show(m, 5), 5);
        assert_eq!(IdMap::store(m, 1000), 0);
        assert_eq!(IdMap::store(m, 5), 5);
        assert_eq!(IdMap::show(None, 0), 0);
    }
}
