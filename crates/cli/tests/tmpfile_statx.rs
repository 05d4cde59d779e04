//! open(O_TMPFILE) and statx's birth time through `ubtrfs mount`, each scenario run
//! the same way on a kernel btrfs loop mount of its own `mkfs.btrfs` image: what the
//! script prints (bytes read back, nlink, modes, owners, errnos) must be the same on
//! both, and the images both pass `btrfs check --readonly --check-data-csum` and hold
//! the same items afterwards (`btrfs inspect-internal dump-tree`): a file that never
//! got a name leaves nothing, one linked later is an ordinary file.
//!
//! Measured on the kernel's btrfs (6.18), and asserted here: an O_TMPFILE file has
//! nlink 0, its mode and owner as a created file's (umask, set-group-ID directories,
//! default ACLs), and its directory does not change; linkat (through /proc/self/fd or
//! AT_EMPTY_PATH) gives it nlink 1 and a new ctime; one opened with O_EXCL cannot be
//! linked (ENOENT); O_RDONLY is EINVAL, a non-directory ENOTDIR, a directory the
//! caller may not write EACCES, a read-only mount EROFS. statx reports the inode's
//! otime as stx_btime, which the kernel and the mount show alike for the same image.
//!
//! Needs root, the kernel btrfs driver, python3, /dev/fuse and fusermount3 (the tests
//! say why they skip without them; under CI=true they must run).

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::{run, scratch_in};
use fuse::{assert_check, mkfs, FuseMount, KernelMount, Stop};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The scenarios, one subcommand each; every line printed is compared.
const SCRIPT: &str = r#"
import ctypes, errno, os, struct, sys, time

libc = ctypes.CDLL(None, use_errno=True)
libc.linkat.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
libc.statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_char_p]
AT_FDCWD, AT_SYMLINK_NOFOLLOW, AT_SYMLINK_FOLLOW, AT_EMPTY_PATH = -100, 0x100, 0x400, 0x1000
STATX_BTIME = 0x800
DATA = bytes(range(256)) * 40

def tmpfile(d, flags=os.O_RDWR, mode=0o666):
    try:
        return os.open(d, os.O_TMPFILE | flags, mode)
    except OSError as e:
        return errno.errorcode[e.errno]

def link_fd(fd, dst, empty_path=False):
    # os.link would link the /proc symlink itself: linkat follows it, or takes the fd.
    if empty_path:
        r = libc.linkat(fd, b"", AT_FDCWD, dst.encode(), AT_EMPTY_PATH)
    else:
        r = libc.linkat(AT_FDCWD, b"/proc/self/fd/%d" % fd, AT_FDCWD, dst.encode(), AT_SYMLINK_FOLLOW)
    return "ok" if r == 0 else errno.errorcode[ctypes.get_errno()]

def statx(path, fd=AT_FDCWD, flags=0):
    buf = ctypes.create_string_buffer(256)
    if libc.statx(fd, path.encode(), flags, 0xfff, buf) != 0:
        return errno.errorcode[ctypes.get_errno()]
    mask, = struct.unpack_from("<I", buf.raw, 0)
    nlink, = struct.unpack_from("<I", buf.raw, 0x10)
    sec, nsec = struct.unpack_from("<qI", buf.raw, 0x50)
    return mask, nlink, sec, nsec

def describe(st):
    return "nlink %d mode %o uid %d gid %d size %d" % (st.st_nlink, st.st_mode, st.st_uid, st.st_gid, st.st_size)

def basic(m):
    os.umask(0o022)
    d = m + "/d"
    os.mkdir(d)
    before = os.stat(d)
    fd = tmpfile(d)
    os.write(fd, DATA)
    os.lseek(fd, 0, 0)
    print("read back", os.read(fd, len(DATA) + 1) == DATA)
    st = os.fstat(fd)
    print("fstat", describe(st))
    sx = statx("", fd, AT_EMPTY_PATH)
    print("statx nlink", sx[1], "btime", sx[0] & STATX_BTIME != 0)
    after = os.stat(d)
    print("directory unchanged", (after.st_mtime_ns, after.st_ctime_ns, after.st_size) == (before.st_mtime_ns, before.st_ctime_ns, before.st_size))
    time.sleep(0.05)
    print("link", link_fd(fd, d + "/named"))
    st2 = os.fstat(fd)
    print("after link", describe(st2), "ctime moved", st2.st_ctime_ns > st.st_ctime_ns)
    print("second link", link_fd(fd, d + "/second"), os.fstat(fd).st_nlink)
    os.close(fd)
    fd = tmpfile(d, os.O_WRONLY, 0o640)
    os.write(fd, b"linked by AT_EMPTY_PATH")
    print("link AT_EMPTY_PATH", link_fd(fd, d + "/empty", True), describe(os.fstat(fd)))
    os.close(fd)
    fd = tmpfile(d, os.O_RDWR | os.O_EXCL, 0o600)
    print("O_EXCL", link_fd(fd, d + "/excl"), link_fd(fd, d + "/excl", True), describe(os.fstat(fd)))
    os.close(fd)
    print("O_RDONLY", tmpfile(d, os.O_RDONLY))
    print("on a file", tmpfile(d + "/named"))
    print("names", sorted(os.listdir(d)))
    print("named", open(d + "/named", "rb").read() == DATA, describe(os.stat(d + "/named")))
    # chattr: an immutable directory refuses (inode_permission for writing), an
    # append-only one does not.
    for flag in ["i", "a"]:
        os.mkdir(m + "/" + flag)
        os.system("chattr +%s %s/%s" % (flag, m, flag))
        fd = tmpfile(m + "/" + flag)
        print("in a +%s directory" % flag, fd if isinstance(fd, str) else "ok")
        if not isinstance(fd, str):
            os.close(fd)
        os.system("chattr -%s %s/%s" % (flag, m, flag))

def gone(m):
    d = m + "/g"
    os.mkdir(d)
    fd = tmpfile(d)
    os.write(fd, os.urandom(1 << 20))
    os.fsync(fd)
    print("fstat", describe(os.fstat(fd)))
    os.close(fd)
    fd = tmpfile(d, os.O_RDWR | os.O_EXCL)
    os.write(fd, b"x" * 5000)
    os.close(fd)
    print("names", sorted(os.listdir(d)))

def hold(m, ready):
    fd = tmpfile(m)
    os.write(fd, os.urandom(200000))
    os.fsync(fd)
    open(ready, "w").close()
    time.sleep(600)

def owner_prepare(m):
    os.umask(0)
    for name, mode, gid in [("sgid", 0o2777, 4242), ("plain", 0o777, 4242), ("closed", 0o755, 0), ("acl", 0o777, 0)]:
        os.mkdir(m + "/" + name)
        os.chown(m + "/" + name, 0, gid)
        os.chmod(m + "/" + name, mode)
    os.system("setfacl -d -m u::rw,g::r,o::- " + m + "/acl")
    os.umask(0o022)
    fd = tmpfile(m + "/sgid", os.O_RDWR, 0o2775)
    print("root in sgid", describe(os.fstat(fd)))
    os.close(fd)

def owner(m):
    os.umask(0o022)
    for name in ["sgid", "plain", "closed", "acl"]:
        fd = tmpfile(m + "/" + name, os.O_RDWR, 0o2775)
        if isinstance(fd, str):
            print(name, fd)
            continue
        print(name, describe(os.fstat(fd)), "link", link_fd(fd, m + "/" + name + "/named"))
        os.close(fd)

def read_only(m):
    print("O_TMPFILE", tmpfile(m))
    print("O_TMPFILE|O_WRONLY", tmpfile(m, os.O_WRONLY))

def btime(m, *names):
    for n in names:
        sx = statx(m + "/" + n, flags=AT_SYMLINK_NOFOLLOW)
        print(n, "btime" if sx[0] & STATX_BTIME else "no btime", sx[2], sx[3])

def make(m):
    os.mkdir(m + "/dir")
    time.sleep(0.05)
    open(m + "/file", "w").write("file")
    os.symlink("file", m + "/sym")

{"basic": basic, "gone": gone, "hold": hold, "owner_prepare": owner_prepare, "owner": owner, "read_only": read_only, "btime": btime, "make": make}[sys.argv[1]](*sys.argv[2:])
"#;

fn available(test: &str) -> bool {
    kernel::kernel_available_with(
        test,
        &[
            "/dev/fuse",
            "/usr/bin/fusermount3",
            "/usr/bin/setpriv",
            "/usr/bin/setfacl",
            "/usr/bin/chattr",
            "/usr/bin/python3",
        ],
    )
}

fn scratch(name: &str) -> PathBuf {
    let s = scratch_in("tmpfile", name);
    std::fs::set_permissions(&s, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(s.join("t.py"), SCRIPT).unwrap();
    s
}

/// Run scenario `args` of the script (in scratch `s`), as root or, with `as_daemon`, as
/// the unprivileged user daemon without supplementary groups; what it printed.
fn py(s: &Path, as_daemon: bool, args: &[&str]) -> String {
    let mut c = if as_daemon {
        let mut c = Command::new("setpriv");
        // The system's python3: one under root's home (pyenv) is out of daemon's reach.
        c.args(["--reuid=daemon", "--regid=daemon", "--clear-groups", "/usr/bin/python3"]);
        c
    } else {
        Command::new("python3")
    };
    let out = c.arg(s.join("t.py")).args(args).output().expect("run python3");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "python3 t.py {args:?} failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn arg(p: &Path) -> &str {
    p.to_str().expect("scratch paths are UTF-8")
}

/// Every line of `want` is in `text`: the scenario shows what it is for, not only that
/// both sides agree.
fn assert_shows(text: &str, want: &[&str]) {
    for w in want {
        assert!(text.lines().any(|l| l == *w), "expected the line {w:?} in:\n{text}");
    }
}

/// The keys of the fs tree's items, as btrfs-progs prints them: `(256 INODE_ITEM 0)`.
fn fs_tree_keys(img: &Path) -> Vec<String> {
    let out =
        run(Command::new("btrfs").args(["inspect-internal", "dump-tree", "-t", "5"]).arg(img));
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("item "))
        .filter_map(|l| Some(l[l.find("key (")? + 4..=l.find(')')?].to_string()))
        .collect()
}

/// The inode numbers of the fs tree's INODE_ITEMs and ORPHAN_ITEMs.
fn inodes_and_orphans(keys: &[String]) -> (Vec<u64>, Vec<u64>) {
    let field = |k: &String, i: usize| {
        k.trim_matches(|c| c == '(' || c == ')').split(' ').nth(i).map(str::to_string)
    };
    let num = |k: &String, i: usize| field(k, i).and_then(|v| v.parse().ok());
    let inodes = keys
        .iter()
        .filter(|k| field(k, 1).as_deref() == Some("INODE_ITEM"))
        .filter_map(|k| num(k, 0))
        .collect();
    let orphans = keys
        .iter()
        .filter(|k| field(k, 1).as_deref() == Some("ORPHAN_ITEM"))
        .filter_map(|k| num(k, 2))
        .collect();
    (inodes, orphans)
}

/// Scenario `args` on a kernel mount of a fresh `kimg` and on `ubtrfs mount -o opts` of a
/// fresh `uimg`, each unmounted after: (ours, the kernel's).
fn on_both(s: &Path, opts: &str, run_it: impl Fn(&Path) -> String) -> (String, String) {
    let (kimg, uimg) = (s.join("k.img"), s.join("u.img"));
    mkfs(&kimg, "300M");
    mkfs(&uimg, "300M");
    let k = KernelMount::new(&kimg, &s.join("kmnt"));
    std::fs::set_permissions(&k.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let kernel = run_it(&k.dir);
    drop(k);
    let m = FuseMount::start(&uimg, &s.join("umnt"), opts);
    let ours = run_it(&s.join("umnt"));
    let err = m.stop(Stop::Sigterm);
    assert!(!err.contains("error"), "the mount reported errors: {err}");
    (ours, kernel)
}

/// An O_TMPFILE file through the mount: written and read back, nlink 0 until linkat
/// names it (then 1, and its ctime moves), its directory untouched; O_EXCL forbids the
/// link, O_RDONLY, a non-directory and an immutable directory are refused (an
/// append-only one is not). After the unmount the names hold
/// the bytes (read by the kernel), and the image has the same items as the kernel's.
#[test]
fn tmpfile_writes_reads_and_links_as_on_the_kernel() {
    if !available("tmpfile_writes_reads_and_links_as_on_the_kernel") {
        return;
    }
    let s = scratch("basic");
    let (ours, kernel) = on_both(&s, "", |m| py(&s, false, &["basic", arg(m)]));
    assert_eq!(ours, kernel, "O_TMPFILE through the mount differs from the kernel's");
    assert_shows(
        &ours,
        &[
            "read back True",
            "fstat nlink 0 mode 100644 uid 0 gid 0 size 10240",
            "statx nlink 0 btime True",
            "directory unchanged True",
            "link ok",
            "after link nlink 1 mode 100644 uid 0 gid 0 size 10240 ctime moved True",
            "second link ok 2",
            "link AT_EMPTY_PATH ok nlink 1 mode 100640 uid 0 gid 0 size 23",
            "O_EXCL ENOENT ENOENT nlink 0 mode 100600 uid 0 gid 0 size 0",
            "O_RDONLY EINVAL",
            "on a file ENOTDIR",
            "names ['empty', 'named', 'second']",
            "named True nlink 2 mode 100644 uid 0 gid 0 size 10240",
            "in a +i directory EPERM",
            "in a +a directory ok",
        ],
    );
    let (kimg, uimg) = (s.join("k.img"), s.join("u.img"));
    assert_check(&uimg, "after O_TMPFILE files were linked");
    assert_check(&kimg, "the kernel's image");
    let ukeys = fs_tree_keys(&uimg);
    assert_eq!(ukeys, fs_tree_keys(&kimg), "the mount's image holds other items than the kernel's");
    assert!(inodes_and_orphans(&ukeys).1.is_empty(), "orphan items left: {ukeys:?}");
    // The bytes, as the kernel reads them from the mount's image.
    let k = KernelMount::new(&uimg, &s.join("kmnt"));
    assert_eq!(
        std::fs::read(k.dir.join("d/named")).unwrap(),
        (0..40).flat_map(|_| 0..=255u8).collect::<Vec<u8>>()
    );
    assert_eq!(std::fs::read(k.dir.join("d/empty")).unwrap(), b"linked by AT_EMPTY_PATH");
    drop(k);
    let _ = std::fs::remove_dir_all(&s);
}

/// An O_TMPFILE file closed without a name (one of 1 MiB, fsynced, so its data and
/// orphan item were committed; one opened O_EXCL) is freed at its close: the image
/// checks clean, and holds no inode and no orphan item but the directory's, as the
/// kernel's does.
#[test]
fn tmpfile_closed_without_a_name_leaves_no_trace() {
    if !available("tmpfile_closed_without_a_name_leaves_no_trace") {
        return;
    }
    let s = scratch("gone");
    let (ours, kernel) = on_both(&s, "", |m| py(&s, false, &["gone", arg(m)]));
    assert_eq!(ours, kernel, "unnamed O_TMPFILE files through the mount differ from the kernel's");
    assert_shows(&ours, &["fstat nlink 0 mode 100644 uid 0 gid 0 size 1048576", "names []"]);
    let (kimg, uimg) = (s.join("k.img"), s.join("u.img"));
    assert_check(&uimg, "after O_TMPFILE files were closed unnamed");
    let ukeys = fs_tree_keys(&uimg);
    assert_eq!(ukeys, fs_tree_keys(&kimg), "the mount's image holds other items than the kernel's");
    assert_eq!(
        inodes_and_orphans(&ukeys),
        (vec![256, 257], vec![]),
        "an unnamed file left items: {ukeys:?}"
    );
    let _ = std::fs::remove_dir_all(&s);
}

/// Start scenario `hold` on mount `m`: an O_TMPFILE file of 200000 bytes, fsynced, held
/// open until the process is killed. Returns once it is fsynced.
fn hold(s: &Path, m: &Path) -> std::process::Child {
    let ready = s.join("ready");
    let _ = std::fs::remove_file(&ready);
    let mut child = Command::new("python3")
        .arg(s.join("t.py"))
        .args(["hold", arg(m), arg(&ready)])
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn python3");
    let t = Instant::now();
    while !ready.exists() {
        if let Some(st) = child.try_wait().unwrap() {
            panic!("the O_TMPFILE holder exited ({st}) before it was ready");
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the O_TMPFILE holder did not get ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn kill(mut c: std::process::Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// An O_TMPFILE file still open when its mount goes: a lazy unmount (`umount -l`)
/// waits for its last close, which frees it (on the kernel too); a crash (kill -9 of
/// the mount after an fsync committed it) leaves it an orphan (nlink 0 and an orphan
/// item), which btrfs check accepts and the next writable mount removes.
#[test]
fn tmpfile_open_at_unmount_or_crash_is_freed() {
    if !available("tmpfile_open_at_unmount_or_crash_is_freed") {
        return;
    }
    let s = scratch("held");
    let (kimg, uimg) = (s.join("k.img"), s.join("u.img"));
    mkfs(&kimg, "300M");
    mkfs(&uimg, "300M");
    let no_trace = |img: &Path, what: &str| {
        assert_check(img, what);
        let keys = fs_tree_keys(img);
        assert_eq!(inodes_and_orphans(&keys), (vec![256], vec![]), "{what}: {keys:?}");
    };

    // The kernel: lazily unmounted while held; the superblock goes at the last close.
    let kmnt = s.join("kmnt");
    std::fs::create_dir_all(&kmnt).unwrap();
    run(Command::new("mount").args(["-o", "loop"]).arg(&kimg).arg(&kmnt));
    let holder = hold(&s, &kmnt);
    run(Command::new("umount").arg("-l").arg(&kmnt));
    kill(holder);
    let t = Instant::now();
    while !run(Command::new("losetup").arg("-j").arg(&kimg)).trim().is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the kernel's lazily unmounted loop device stayed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    no_trace(&kimg, "the kernel's image after a lazy unmount while an O_TMPFILE file was open");

    // Ours, the same way: the daemon serves the open file until its release.
    let umnt = s.join("umnt");
    let mut m = FuseMount::start(&uimg, &umnt, "");
    let holder = hold(&s, &umnt);
    run(Command::new("umount").arg("-l").arg(&umnt));
    kill(holder);
    let out = m.wait(Duration::from_secs(120));
    assert!(
        out.status.success(),
        "ubtrfs mount exited with {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    no_trace(&uimg, "after a lazy unmount while an O_TMPFILE file was open");

    // A crash: the committed unnamed file is an orphan on disk, valid as it is.
    let m = FuseMount::start(&uimg, &umnt, "");
    let holder = hold(&s, &umnt);
    m.kill9();
    kill(holder);
    assert_check(&uimg, "after a crash with an O_TMPFILE file open");
    let keys = fs_tree_keys(&uimg);
    let (inodes, orphans) = inodes_and_orphans(&keys);
    assert_eq!(inodes.len(), 2, "the unnamed file's inode is on disk: {keys:?}");
    assert_eq!(orphans, inodes[1..].to_vec(), "its orphan item marks it: {keys:?}");
    // The next writable mount removes it, as a kernel mount would.
    let m = FuseMount::start(&uimg, &umnt, "");
    m.stop(Stop::Sigterm);
    no_trace(&uimg, "after the mount that followed the crash");
    let _ = std::fs::remove_dir_all(&s);
}

/// Owner and mode of O_TMPFILE files made by an unprivileged user, as on the kernel: in
/// a set-group-ID directory the file takes the directory's group and loses its own
/// set-group-ID bit (the user is not in that group); elsewhere the user's group and the
/// bit kept; a directory's default ACL gives the mode; one the user may not write is
/// EACCES. Root keeps the bit in the set-group-ID directory.
#[test]
fn tmpfile_owner_and_mode_as_create_gives_them() {
    if !available("tmpfile_owner_and_mode_as_create_gives_them") {
        return;
    }
    let s = scratch("owner");
    let (ours, kernel) = on_both(&s, "allow_other,default_permissions", |m| {
        py(&s, false, &["owner_prepare", arg(m)]) + &py(&s, true, &["owner", arg(m)])
    });
    assert_eq!(
        ours, kernel,
        "owners or modes of O_TMPFILE files through the mount differ from the kernel's"
    );
    let daemon = run(Command::new("id").args(["-u", "daemon"]));
    let daemon = daemon.trim();
    assert_shows(
        &ours,
        &[
            "root in sgid nlink 0 mode 102755 uid 0 gid 4242 size 0",
            &format!("sgid nlink 0 mode 100755 uid {daemon} gid 4242 size 0 link ok"),
            &format!("plain nlink 0 mode 102755 uid {daemon} gid {daemon} size 0 link ok"),
            "closed EACCES",
            &format!("acl nlink 0 mode 102640 uid {daemon} gid {daemon} size 0 link ok"),
        ],
    );
    assert_check(&s.join("u.img"), "after O_TMPFILE files of an unprivileged user");
    let _ = std::fs::remove_dir_all(&s);
}

/// O_TMPFILE on a read-only mount is EROFS, as on a read-only kernel mount.
#[test]
fn tmpfile_on_a_read_only_mount_is_erofs() {
    if !available("tmpfile_on_a_read_only_mount_is_erofs") {
        return;
    }
    let s = scratch("ro");
    let img = s.join("img");
    mkfs(&img, "300M");
    let kmnt = s.join("kmnt");
    std::fs::create_dir_all(&kmnt).unwrap();
    run(Command::new("mount").args(["-o", "loop,ro"]).arg(&img).arg(&kmnt));
    let kernel = py(&s, false, &["read_only", arg(&kmnt)]);
    run(Command::new("umount").arg(&kmnt));
    let m = FuseMount::start(&img, &s.join("umnt"), "ro");
    let ours = py(&s, false, &["read_only", arg(&s.join("umnt"))]);
    m.stop(Stop::Sigterm);
    assert_eq!(ours, kernel);
    assert_shows(&ours, &["O_TMPFILE EROFS", "O_TMPFILE|O_WRONLY EROFS"]);
    let _ = std::fs::remove_dir_all(&s);
}

/// statx's stx_btime is the inode's otime, the same through the mount and the kernel
/// for the same image, both ways: files made on the mount show the kernel the btime
/// the mount showed, and files the kernel made show through the mount the btime the
/// kernel showed. coreutils' `stat -c %W` (statx) shows it too.
#[test]
fn statx_btime_is_the_kernels_both_ways() {
    if !available("statx_btime_is_the_kernels_both_ways") {
        return;
    }
    let s = scratch("btime");
    let (kimg, uimg) = (s.join("k.img"), s.join("u.img"));
    mkfs(&kimg, "300M");
    mkfs(&uimg, "300M");
    let names = ["btime", "", "dir", "file", "sym"];
    let show = |m: &Path| {
        let mut args = names.to_vec();
        args[1] = arg(m);
        let text = py(&s, false, &args);
        let w = run(Command::new("stat").args(["-c", "%W"]).arg(m.join("file")));
        (text, w.trim().to_string())
    };
    let umnt = s.join("umnt");

    // Made on the mount, read by the kernel.
    let m = FuseMount::start(&uimg, &umnt, "");
    py(&s, false, &["make", arg(&umnt)]);
    let ours = show(&umnt);
    m.stop(Stop::Sigterm);
    let k = KernelMount::new(&uimg, &s.join("kmnt"));
    let kernel = show(&k.dir);
    drop(k);
    assert_eq!(
        ours, kernel,
        "the kernel shows other birth times than the mount that made the files"
    );
    for n in &names[2..] {
        let line = ours
            .0
            .lines()
            .find(|l| l.starts_with(&format!("{n} ")))
            .unwrap_or_else(|| panic!("no line for {n}: {}", ours.0));
        assert!(
            line.starts_with(&format!("{n} btime ")) && !line.ends_with(" 0 0"),
            "{n}: the mount reports no birth time: {line}"
        );
    }
    let sec = |text: &str, n: &str| -> i64 {
        text.lines()
            .find(|l| l.starts_with(&format!("{n} ")))
            .and_then(|l| l.split(' ').nth(2))
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    assert_eq!(ours.1, sec(&ours.0, "file").to_string(), "stat -c %W shows statx's btime");
    assert!(sec(&ours.0, "file") >= sec(&ours.0, "dir"), "the file was born after the directory");

    // Made by the kernel, read through the mount.
    let k = KernelMount::new(&kimg, &s.join("kmnt"));
    py(&s, false, &["make", arg(&k.dir)]);
    let kernel = show(&k.dir);
    drop(k);
    let m = FuseMount::start(&kimg, &umnt, "");
    let ours = show(&umnt);
    m.stop(Stop::Sigterm);
    assert_eq!(
        ours, kernel,
        "the mount shows other birth times than the kernel that made the files"
    );
    assert_check(&uimg, "after the birth-time scenario");
    assert_check(&kimg, "after the birth-time scenario on the kernel's image");
    let _ = std::fs::remove_dir_all(&s);
}
