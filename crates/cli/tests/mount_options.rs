//! mount(8)'s options on a ubtrfs mount, each as the kernel (or mount.fuse3) does it,
//! measured on 6.18 with util-linux 2.38 and fuse3 3.14:
//! - `mount -o remount,ro|rw MNT` runs the helper with the mount's options merged
//!   (`-o ro,nosuid,nodev,relatime,remount,user_id=0,group_id=0,default_permissions`);
//!   on a kernel btrfs, ro refuses writes and snapshots with EROFS, moves no atime, is
//!   refused EBUSY while a file is open for writing, and rw writes again.
//! - mount(8) passes neither `dev` nor `suid` to a helper; mount.fuse3 adds both unless
//!   told `nodev`/`nosuid`, so a root `mount -t fuse.X` is dev,suid like a kernel mount.
//! - A second mount of a mounted btrfs shares its superblock (one filesystem, two
//!   mount points, each with its own flags).
//! - fusermount3 opens /dev/fuse as the calling user: who may not open /dev/fuse may
//!   not use FUSE, and the refusal says so.
//! - `strictatime` moves the atime at every read, `relatime` at the first read after a
//!   change, `noatime` never.
//!
//! mount(8) finds helpers only in /sbin, so the helper tests run in a private mount
//! namespace whose /usr/sbin is an overlay holding `mount.fuse.ubtrfs` (`Ns`); the
//! rootless test also replaces /dev/fuse there by a node a user may open. Needs root,
//! /dev/fuse, fusermount3, unshare, nsenter and setpriv (the tests say why they skip
//! without them; under CI=true they must run).

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::{bin, fails, out_of, pseudo_random as data, run, run_output, scratch_in};
use fuse::{assert_check, mkfs, FuseMount, KernelMount, Stop};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The tests of this file run one at a time: a namespace made while another test has
/// a kernel mount would hold it for a moment after that test unmounts it.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn available(test: &str) -> bool {
    kernel::kernel_available_with(
        test,
        &[
            "/dev/fuse",
            "/usr/bin/fusermount3",
            "/usr/bin/unshare",
            "/usr/bin/nsenter",
            "/usr/bin/setpriv",
        ],
    )
}

/// A private mount namespace for one test: /usr/sbin overlaid with the ubtrfs helpers,
/// and with `open_fuse` a /dev/fuse any user may open. Commands run in it through
/// nsenter; its files are reached from here through /proc/PID/root. It ends with its
/// holder process, and every mount in it with it.
struct Ns {
    holder: Child,
}

impl Ns {
    fn new(dir: &Path, open_fuse: bool) -> Ns {
        let (up, work) = (dir.join("ns-up"), dir.join("ns-work"));
        std::fs::create_dir_all(&up).unwrap();
        std::fs::create_dir_all(&work).unwrap();
        let exe = env!("CARGO_BIN_EXE_ubtrfs");
        // The namespace starts with a copy of every mount there is, other tests' kernel
        // and FUSE mounts too, which would then stay mounted after their own unmounts
        // (a loop device held, a daemon kept): those are detached here at once.
        let detach = r#"awk '{for(i=7;i<=NF;i++) if($i=="-"){t=$(i+1); s=$(i+2); break}; if (t ~ /^(btrfs|fuse)/ || s ~ /^\/dev\/loop/) print $5}' /proc/self/mountinfo | while read m; do umount -l "$m" 2>/dev/null || true; done"#;
        let mut script = format!(
            "set -e; mount --make-rprivate /; {detach}; mount -t overlay overlay -o lowerdir=/usr/sbin,upperdir={},workdir={} /usr/sbin; ln -sf {exe} /usr/sbin/mount.fuse.ubtrfs; ln -sf {exe} /usr/sbin/umount.fuse.ubtrfs; ",
            up.display(),
            work.display()
        );
        if open_fuse {
            let node = dir.join("fuse-0666");
            run(Command::new("mknod").args(["-m", "0666"]).arg(&node).args(["c", "10", "229"]));
            script.push_str(&format!("mount --bind {} /dev/fuse; ", node.display()));
        }
        script.push_str("echo ready; exec sleep 100000");
        let mut holder = Command::new("unshare")
            .args(["-m", "sh", "-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .expect("unshare");
        let mut line = String::new();
        BufReader::new(holder.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "the namespace did not start");
        Ns { holder }
    }

    fn pid(&self) -> u32 {
        self.holder.id()
    }

    /// `program` run inside the namespace.
    fn cmd(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg("-t").arg(self.pid().to_string()).args(["-m", "--"]).arg(program);
        c
    }

    /// `sh -c script` inside the namespace as user `uid` (with its groups).
    fn user_sh(&self, uid: u32, home: &Path, script: &str) -> Command {
        let mut c = self.cmd("setpriv");
        c.args([
            "--reuid",
            &uid.to_string(),
            "--regid",
            &uid.to_string(),
            "--init-groups",
            "sh",
            "-c",
            script,
        ]);
        let dir = Path::new(env!("CARGO_BIN_EXE_ubtrfs")).parent().unwrap();
        c.env("HOME", home).env("PATH", format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", dir.display()));
        c
    }

    /// umount(8) of `mnt`, given as a path relative to its parent: util-linux 2.38
    /// looks an absolute path up with statfs(2) as root, which names the type `fuse`
    /// only, and then runs no `umount.fuse.ubtrfs`.
    fn umount(&self, mnt: &Path) -> Command {
        let mut c = self.cmd("sh");
        c.arg("-c").arg(format!(
            "cd '{}' && umount '{}'",
            mnt.parent().unwrap().display(),
            mnt.file_name().unwrap().to_str().unwrap()
        ));
        c
    }

    /// `p` as seen inside the namespace.
    fn path(&self, p: &Path) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.pid())).join(p.strip_prefix("/").unwrap())
    }

    /// The namespace's mount table line for `mnt`, if mounted.
    fn mountinfo(&self, mnt: &Path) -> Option<String> {
        let text = std::fs::read_to_string(format!("/proc/{}/mountinfo", self.pid())).unwrap();
        text.lines()
            .rfind(|l| l.split(' ').nth(4) == Some(mnt.to_str().unwrap()))
            .map(str::to_string)
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        // A daemon started in the namespace keeps it alive, and it its mounts: detach
        // them first (after a failure; a passing test has unmounted them).
        let text =
            std::fs::read_to_string(format!("/proc/{}/mountinfo", self.pid())).unwrap_or_default();
        for m in text
            .lines()
            .filter(|l| l.contains(" - fuse.ubtrfs "))
            .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        {
            let _ = self.cmd("umount").arg("-l").arg(&m).output();
        }
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// The per-mount and superblock options of a mountinfo line.
fn options_of(line: &str) -> (Vec<String>, Vec<String>) {
    let f: Vec<&str> = line.split(' ').collect();
    let sep = f.iter().position(|x| *x == "-").unwrap();
    let split = |s: &str| s.split(',').map(str::to_string).collect();
    (split(f[5]), split(f[sep + 3]))
}

fn errno_of<T>(r: std::io::Result<T>) -> Option<i32> {
    r.err().and_then(|e| e.raw_os_error())
}

fn atime(p: &Path) -> (i64, i64) {
    let m = std::fs::metadata(p).unwrap();
    (m.atime(), m.atime_nsec())
}

/// The pids holding `img`'s flock, from /proc/locks.
fn lock_holders(img: &Path) -> Vec<u32> {
    let md = std::fs::metadata(img).unwrap();
    let id = format!("{:02x}:{:02x}:{}", libc::major(md.dev()), libc::minor(md.dev()), md.ino());
    let locks = std::fs::read_to_string("/proc/locks").unwrap();
    locks
        .lines()
        .filter(|l| l.contains(" FLOCK ") && l.split_whitespace().any(|f| f == id))
        .filter_map(|l| l.split_whitespace().nth(4)?.parse().ok())
        .collect()
}

/// Whether `pid` runs (a zombie has exited; whoever inherits it reaps it later).
fn alive(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X'))
}

/// Wait (a few seconds at most) for the image's lock to go with its exited holder:
/// the kernel may close an exiting process's last files a moment after its exit.
fn wait_unlocked(img: &Path) {
    let t = Instant::now();
    while !lock_holders(img).is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{} still locked by {:?}",
            img.display(),
            lock_holders(img)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `mount -o remount,ro` and `remount,rw` through mount(8) and the helper: read-only
/// refuses writes (EROFS from the VFS) and the daemon's own changes (a snapshot
/// ioctl, atime), what was written before is committed when the remount returns, a
/// file open for writing makes it EBUSY, and read-write writes again at once. The
/// kernel's btrfs does each of these (measured, see the module). A mount opened `ro`
/// is not made writable (its image is open read-only): refused by name.
#[test]
fn remount_read_only_and_back_through_mount8() {
    if !available("remount_read_only_and_back_through_mount8") {
        return;
    }
    let _serial = serial();
    let d = scratch_in("mountopts", "remount");
    let img = d.join("img");
    let mnt = d.join("m");
    std::fs::create_dir_all(&mnt).unwrap();
    mkfs(&img, "512M");
    let ns = Ns::new(&d, false);
    let m = ns.path(&mnt);
    run(ns.cmd("mount").args(["-t", "fuse.ubtrfs"]).arg(&img).arg(&mnt));
    let before = data(1, (3 << 20) + 17);
    std::fs::write(m.join("before"), &before).unwrap();

    // A writer keeps it read-write (EBUSY), as on the kernel.
    {
        let w = std::fs::OpenOptions::new().append(true).open(m.join("before")).unwrap();
        let err = fails(ns.cmd("mount").args(["-o", "remount,ro"]).arg(&mnt));
        assert!(err.contains("busy") && err.contains("open for writing"), "{err}");
        drop(w);
    }
    run(ns.cmd("mount").args(["-o", "remount,ro"]).arg(&mnt));
    let (mount_opts, super_opts) = options_of(&ns.mountinfo(&mnt).unwrap());
    assert_eq!((mount_opts[0].as_str(), super_opts[0].as_str()), ("ro", "ro"));
    // Committed before the remount returned: the image's last commit has it.
    assert!(
        run_output(bin().arg("cat").arg(&img).arg("/before")).stdout == before,
        "the remount returned before its commit"
    );
    assert_eq!(errno_of(std::fs::write(m.join("new"), b"x")), Some(libc::EROFS));
    assert_eq!(
        errno_of(std::fs::OpenOptions::new().append(true).open(m.join("before"))),
        Some(libc::EROFS)
    );
    assert_eq!(errno_of(std::fs::create_dir(m.join("dir"))), Some(libc::EROFS));
    // The daemon's own changes: an ioctl and the atime (relatime would move this one:
    // it was written after its last access).
    let err = fails(
        ns.cmd(env!("CARGO_BIN_EXE_ubtrfs")).args(["subvolume", "create"]).arg(&mnt).arg("/sub"),
    );
    assert!(err.contains("Read-only file system"), "a subvolume made on a read-only mount: {err}");
    let a = atime(&m.join("before"));
    assert!(std::fs::read(m.join("before")).unwrap() == before);
    assert_eq!(atime(&m.join("before")), a, "a read on a read-only mount moved the atime");

    // Read-write again: a write right after the remount returns goes through.
    run(ns.cmd("mount").args(["-o", "remount,rw"]).arg(&mnt));
    std::fs::write(m.join("after"), b"after\n").unwrap();
    let (mount_opts, super_opts) = options_of(&ns.mountinfo(&mnt).unwrap());
    assert_eq!((mount_opts[0].as_str(), super_opts[0].as_str()), ("rw", "rw"));
    // The unmount helper waits for the last commit and the daemon's exit.
    let daemon = lock_holders(&img);
    assert_eq!(daemon.len(), 1, "one daemon holds the image: {daemon:?}");
    run(&mut ns.umount(&mnt));
    assert!(!alive(daemon[0]), "umount returned while the daemon {} runs", daemon[0]);
    wait_unlocked(&img);
    assert_check(&img, "after the remounts");
    let k = d.join("k");
    let km = KernelMount::new(&img, &k);
    assert!(std::fs::read(k.join("before")).unwrap() == before);
    assert_eq!(std::fs::read(k.join("after")).unwrap(), b"after\n");
    assert!(!k.join("new").exists() && !k.join("sub").exists());
    drop(km);

    // Opened read-only: rw is refused, and the mount stays read-only.
    run(ns.cmd("mount").args(["-t", "fuse.ubtrfs", "-o", "ro"]).arg(&img).arg(&mnt));
    let err = fails(ns.cmd("mount").args(["-o", "remount,rw"]).arg(&mnt));
    assert!(err.contains("open read-only") && err.contains("mount it read-write"), "{err}");
    assert_eq!(options_of(&ns.mountinfo(&mnt).unwrap()).1[0], "ro");
    run(&mut ns.umount(&mnt));
    drop(ns);
    let _ = std::fs::remove_dir_all(&d);
}

/// Whether writing to the device node `null` works, and the effective uid of the
/// set-user-ID `id` (owned by 65534), both run inside `ns` (None: the host).
fn dev_and_suid_seen(ns: Option<&Ns>, dir: &Path) -> (bool, String) {
    let sh = |script: String| {
        let mut c = match ns {
            Some(ns) => ns.cmd("sh"),
            None => Command::new("sh"),
        };
        c.args(["-c", &script]);
        out_of(&mut c)
    };
    let null = sh(format!("echo x > {}/null", dir.display())).status.success();
    let id = sh(format!("{}/id -u", dir.display()));
    (null, String::from_utf8_lossy(&id.stdout).trim().to_string())
}

fn make_dev_and_suid(dir: &Path) {
    run(Command::new("mknod").arg(dir.join("null")).args(["c", "1", "3"]));
    std::fs::copy("/usr/bin/id", dir.join("id")).unwrap();
    run(Command::new("chown").arg("65534:65534").arg(dir.join("id")));
    run(Command::new("chmod").arg("4755").arg(dir.join("id")));
}

/// `mount -t fuse.ubtrfs` as root is dev,suid unless told nodev or nosuid, as
/// mount.fuse3 makes it (mount(8) passes neither option on) and as the kernel's btrfs
/// mount is: a device node opens as the device, a set-user-ID program runs as its
/// owner. `ubtrfs mount` itself stays nodev,nosuid unless asked, as a libfuse program
/// run directly does.
#[test]
fn dev_and_suid_as_mount_fuse3_makes_them() {
    if !available("dev_and_suid_as_mount_fuse3_makes_them") {
        return;
    }
    let _serial = serial();
    let d = scratch_in("mountopts", "devsuid");
    let img = d.join("img");
    let mnt = d.join("m");
    std::fs::create_dir_all(&mnt).unwrap();
    mkfs(&img, "512M");

    // The kernel's btrfs: dev,suid.
    let k = d.join("k");
    let km = KernelMount::new(&img, &k);
    make_dev_and_suid(&k);
    assert_eq!(dev_and_suid_seen(None, &k), (true, "65534".to_string()), "the kernel's mount");
    drop(km);

    let ns = Ns::new(&d, false);
    let cases: [(&str, bool, &str); 4] = [
        ("", true, "65534"),
        ("nodev", false, "65534"),
        ("nosuid", true, "0"),
        ("nodev,nosuid,noexec", false, ""),
    ];
    for (opts, null_ok, euid) in cases {
        let mut c = ns.cmd("mount");
        c.args(["-t", "fuse.ubtrfs"]);
        if !opts.is_empty() {
            c.args(["-o", opts]);
        }
        run(c.arg(&img).arg(&mnt));
        let (flags, _) = options_of(&ns.mountinfo(&mnt).unwrap());
        for f in ["nodev", "nosuid", "noexec"] {
            assert_eq!(
                flags.iter().any(|x| x == f),
                opts.contains(f),
                "-o {opts:?}: {f} in {flags:?}"
            );
        }
        assert_eq!(dev_and_suid_seen(Some(&ns), &mnt), (null_ok, euid.to_string()), "-o {opts:?}");
        run(&mut ns.umount(&mnt));
    }
    // `ubtrfs mount`: nodev,nosuid by default, dev,suid when asked.
    for (opts, want) in [("", (false, "0")), ("dev,suid", (true, "65534"))] {
        let m = FuseMount::start(&img, &mnt, opts);
        assert_eq!(
            dev_and_suid_seen(None, &mnt),
            (want.0, want.1.to_string()),
            "ubtrfs mount -o {opts:?}"
        );
        m.stop(Stop::Sigterm);
    }
    assert_check(&img, "after the dev and suid mounts");
    drop(ns);
    let _ = std::fs::remove_dir_all(&d);
}

/// A second mount of a mounted image (fstests generic/732) is, as root, a bind mount
/// of the first: one daemon serves both, a rename through one is seen through the
/// other, a read-only second mount leaves the first writable, unmounting the first
/// returns at once and leaves the second serving, and unmounting the last waits for
/// the daemon's last commit and exit.
#[test]
fn second_mount_shares_the_first_ones_daemon() {
    if !available("second_mount_shares_the_first_ones_daemon") {
        return;
    }
    let _serial = serial();
    let d = scratch_in("mountopts", "twice");
    let img = d.join("img");
    let (m1, m2, m3) = (d.join("m1"), d.join("m2"), d.join("m3"));
    for m in [&m1, &m2, &m3] {
        std::fs::create_dir_all(m).unwrap();
    }
    mkfs(&img, "512M");
    let ns = Ns::new(&d, false);
    run(ns.cmd("mount").args(["-t", "fuse.ubtrfs"]).arg(&img).arg(&m1));
    let t = Instant::now();
    run(ns.cmd("mount").args(["-t", "fuse.ubtrfs"]).arg(&img).arg(&m2));
    assert!(t.elapsed() < Duration::from_secs(10));
    run(ns.cmd(env!("CARGO_BIN_EXE_ubtrfs")).args(["mount", "-o", "ro"]).arg(&img).arg(&m3));
    let holders = lock_holders(&img);
    assert_eq!(holders.len(), 1, "one daemon: {holders:?}");
    let (p1, p2, p3) = (ns.path(&m1), ns.path(&m2), ns.path(&m3));
    let dev = |p: &Path| std::fs::metadata(p).unwrap().dev();
    assert!(
        dev(&p1) == dev(&p2) && dev(&p2) == dev(&p3),
        "one superblock behind the three mount points"
    );
    // generic/732's renames.
    std::fs::create_dir(p1.join("A")).unwrap();
    std::fs::create_dir(p1.join("B")).unwrap();
    std::fs::write(p1.join("A/f"), b"f\n").unwrap();
    std::fs::rename(p1.join("A/f"), p1.join("B/f")).unwrap();
    assert_eq!(std::fs::read(p2.join("B/f")).unwrap(), b"f\n");
    std::fs::rename(p2.join("B/f"), p2.join("A/f")).unwrap();
    assert_eq!(std::fs::read(p1.join("A/f")).unwrap(), b"f\n");
    std::fs::rename(p1.join("A/f"), p1.join("B/f")).unwrap();
    // The read-only one refuses; the others write.
    assert_eq!(errno_of(std::fs::write(p3.join("no"), b"x")), Some(libc::EROFS));
    assert_eq!(std::fs::read(p3.join("B/f")).unwrap(), b"f\n");
    let (flags, super_opts) = options_of(&ns.mountinfo(&m3).unwrap());
    assert_eq!((flags[0].as_str(), super_opts[0].as_str()), ("ro", "rw"));
    // Unmounting the first leaves the daemon serving the others.
    run(ns.cmd("umount").arg(&m1));
    run(ns.cmd(env!("CARGO_BIN_EXE_ubtrfs")).arg("umount").arg(&m3));
    assert!(
        Path::new(&format!("/proc/{}", holders[0])).exists(),
        "the daemon left with a mount point still there"
    );
    let big = data(7, 5 << 20);
    std::fs::write(p2.join("through-m2"), &big).unwrap();
    run(&mut ns.umount(&m2));
    // The last unmount waited for the daemon.
    assert!(!alive(holders[0]), "umount of the last mount point returned while the daemon runs");
    wait_unlocked(&img);
    assert_check(&img, "after the two mounts");
    let k = d.join("k");
    let km = KernelMount::new(&img, &k);
    assert_eq!(std::fs::read(k.join("B/f")).unwrap(), b"f\n");
    assert!(std::fs::read(k.join("through-m2")).unwrap() == big);
    assert!(!k.join("A/f").exists());
    drop(km);
    drop(ns);
    let _ = std::fs::remove_dir_all(&d);
}

const ROOTLESS_USER: &str = "ubtrfs-rootless";

/// The uid of the test's unprivileged user, made (as root) if missing; None, with
/// the reason printed, if it cannot be made (a failure under CI=true).
fn rootless_user(test: &str) -> Option<u32> {
    let id = || {
        Command::new("id")
            .args(["-u", ROOTLESS_USER])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
    };
    if id().is_none() {
        let out = Command::new("useradd")
            .args(["--no-create-home", "--shell", "/bin/sh", ROOTLESS_USER])
            .output();
        if let Ok(o) = &out {
            if !o.status.success() {
                eprintln!("useradd: {}", String::from_utf8_lossy(&o.stderr));
            }
        }
    }
    let uid = id();
    if uid.is_none() {
        let why =
            format!("{test}: skipped: no user {ROOTLESS_USER} and useradd could not make one");
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{why}, and CI=true forbids skipping"
        );
        eprintln!("{why}");
    }
    uid
}

/// A user mounts through fusermount3 where they may open /dev/fuse (the README's
/// rootless example, run as written), and every refusal names its cause: /dev/fuse
/// they may not open (fusermount3 opens it as the user too), a fusermount3 that is not
/// set-user-ID root, allow_other without user_allow_other, a second mount (naming the
/// first and its daemon), and a remount.
#[test]
fn rootless_mount_and_the_causes_of_its_refusals() {
    if !available("rootless_mount_and_the_causes_of_its_refusals") {
        return;
    }
    let _serial = serial();
    let Some(uid) = rootless_user("rootless_mount_and_the_causes_of_its_refusals") else { return };
    let d = scratch_in("mountopts", "rootless");
    let home = d.join("home");
    std::fs::create_dir_all(&home).unwrap();
    run(Command::new("chown").arg(format!("{uid}:{uid}")).arg(&home));
    let fuse_mode = std::fs::metadata("/dev/fuse").unwrap().mode() & 0o777;
    let ns = Ns::new(&d, true);

    // The README's example, as a user, as written there.
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    let after = readme
        .split_once("to themselves with `uid=` and `gid=`:\n\n")
        .expect("the rootless example in the README")
        .1;
    let example: Vec<&str> =
        after.lines().take_while(|l| l.starts_with("    ")).map(str::trim).collect();
    assert_eq!(example.len(), 3, "{example:?}");
    let example = example.join("\n");
    let out = run(&mut ns.user_sh(uid, &home, &format!("set -e\n{example}")));
    assert!(out.ends_with("hello\n"), "{out}");
    assert!(out.contains(&format!(" {uid} {uid} ")), "the user's file shows as theirs: {out}");
    let img = home.join("fs.img");
    assert_check(&img, "after the rootless example");

    // Mounted by the user: a second mount and a remount are refused by name.
    let mnt = home.join("mnt");
    let m2 = home.join("m2");
    run(&mut ns.user_sh(
        uid,
        &home,
        "mkdir -p ~/m2 && ubtrfs mount --daemon -o uid=$(id -u) ~/fs.img ~/mnt",
    ));
    let pid = lock_holders(&img)[0];
    let err = fails(&mut ns.user_sh(uid, &home, "ubtrfs mount ~/fs.img ~/m2"));
    assert!(
        err.contains(&format!("already mounted by ubtrfs at {} (process {pid})", mnt.display())),
        "{err}"
    );
    let err = fails(&mut ns.user_sh(uid, &home, "ubtrfs mount -o remount,ro ~/fs.img ~/mnt"));
    assert!(err.contains("a remount needs root"), "{err}");
    run(&mut ns.user_sh(uid, &home, "ubtrfs umount ~/mnt"));
    assert!(!alive(pid), "ubtrfs umount returned while the daemon runs");
    assert!(ns.mountinfo(&m2).is_none());
    wait_unlocked(&img);

    // allow_other needs user_allow_other in /etc/fuse.conf (not set here).
    let conf = std::fs::read_to_string("/etc/fuse.conf").unwrap_or_default();
    if !conf.lines().any(|l| l.trim() == "user_allow_other") {
        let err = fails(&mut ns.user_sh(uid, &home, "ubtrfs mount -o allow_other ~/fs.img ~/mnt"));
        assert!(err.contains("user_allow_other"), "{err}");
    }
    // A fusermount3 that is not set-user-ID root, first on PATH.
    let fake = home.join("bin");
    std::fs::create_dir_all(&fake).unwrap();
    std::fs::copy("/usr/bin/fusermount3", fake.join("fusermount3")).unwrap();
    std::fs::set_permissions(
        fake.join("fusermount3"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let err = fails(&mut ns.user_sh(uid, &home, "PATH=~/bin:$PATH ubtrfs mount ~/fs.img ~/mnt"));
    assert!(err.contains("fusermount3 is not set-user-ID root"), "{err}");
    drop(ns);

    // Outside the namespace /dev/fuse is as the host has it.
    if fuse_mode & 0o006 != 0o006 {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid",
            &uid.to_string(),
            "--regid",
            &uid.to_string(),
            "--init-groups",
            env!("CARGO_BIN_EXE_ubtrfs"),
            "mount",
        ])
        .arg(&img)
        .arg(&mnt);
        let err = fails(&mut c);
        assert!(
            err.contains(&format!(
                "cannot open /dev/fuse: Permission denied (os error 13) (mode {fuse_mode:04o}"
            )) && err.contains("this user may not use FUSE"),
            "{err}"
        );
    }
    wait_unlocked(&img);
    let _ = std::fs::remove_dir_all(&d);
}

/// Whether each of two reads of `f` (the second `gap` after the first) moved its
/// atime; `f` was written just before.
fn two_reads_move_atime(f: &Path, gap: Duration) -> (bool, bool) {
    std::thread::sleep(gap);
    let a0 = atime(f);
    std::fs::read(f).unwrap();
    let a1 = atime(f);
    std::thread::sleep(gap);
    std::fs::read(f).unwrap();
    let a2 = atime(f);
    (a1 != a0, a2 != a1)
}

/// The atime rules at reads, as the kernel's btrfs keeps them (fstests generic/003):
/// strictatime moves it at every read, the second one too although its pages are
/// cached; relatime at the first read after a write only, even when the write left
/// whole pages cached; noatime never. The same sequence runs on a kernel mount.
#[test]
fn atime_moves_at_reads_as_the_kernel_moves_it() {
    if !available("atime_moves_at_reads_as_the_kernel_moves_it") {
        return;
    }
    let _serial = serial();
    let d = scratch_in("mountopts", "atime");
    let img = d.join("img");
    let (mnt, k) = (d.join("m"), d.join("k"));
    mkfs(&img, "512M");
    let gap = Duration::from_millis(30);
    let mut seen = Vec::new();
    for side in ["kernel", "ubtrfs"] {
        for mode in ["strictatime", "relatime", "noatime"] {
            let (dir, guard): (&Path, Box<dyn std::any::Any>) = if side == "kernel" {
                std::fs::create_dir_all(&k).unwrap();
                run(Command::new("mount").args(["-o", &format!("loop,{mode}")]).arg(&img).arg(&k));
                (&k, Box::new(KernelMount { dir: k.clone() }))
            } else {
                (&mnt, Box::new(FuseMount::start(&img, &mnt, mode)))
            };
            for (name, len) in [("small", 4usize), ("pages", 8192)] {
                let f = dir.join(format!("{side}-{mode}-{name}"));
                std::fs::write(&f, data(len as u64, len)).unwrap();
                seen.push((side, mode, name, two_reads_move_atime(&f, gap)));
            }
            if let Ok(m) = guard.downcast::<FuseMount>() {
                m.stop(Stop::Sigterm);
            }
        }
    }
    let (kernel, ours): (Vec<_>, Vec<_>) = seen.into_iter().partition(|s| s.0 == "kernel");
    for (k, o) in kernel.iter().zip(&ours) {
        assert_eq!(
            (k.1, k.2, k.3),
            (o.1, o.2, o.3),
            "ubtrfs moved the atime differently from the kernel (first read, second read)"
        );
    }
    assert!(ours.iter().all(|o| o.3 == (o.1 != "noatime", o.1 == "strictatime")), "{ours:?}");
    assert_check(&img, "after the atime mounts");
    let _ = std::fs::remove_dir_all(&d);
}
