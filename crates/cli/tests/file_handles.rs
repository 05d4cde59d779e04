//! File handles on the FUSE mount: `name_to_handle_at` and `open_by_handle_at` (what
//! an NFS export and fstests' open_by_handle use) decode as they do on the kernel's
//! btrfs. Each scenario runs on a kernel loop mount and on `ubtrfs mount` of its own
//! `mkfs.btrfs` image, and the outcomes (errno, bytes read, nlink, the path a decoded
//! directory or connectable handle reconnects to, the entries read through a decoded
//! directory) must be the same; the main ones are also asserted outright.
//!
//! The decodes run after `echo 3 > /proc/sys/vm/drop_caches` or after a remount, so
//! the kernel no longer holds the inodes and must ask the filesystem: FUSE's lookups
//! of `.` (the inode a handle names) and `..` (a directory's parent, to reconnect it).
//!
//! Needs root, the kernel btrfs driver, /dev/fuse and fusermount3 (the tests say why
//! they skip without them; under CI=true they must run).

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::{bin, run, scratch_in};
use fuse::{assert_check, mkfs, FuseMount, KernelMount, Stop};
use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// AT_HANDLE_CONNECTABLE: a handle that also names the parent directory, so that a
/// decoded non-directory reconnects to its path (fstests generic/777).
const AT_HANDLE_CONNECTABLE: i32 = 0x002;

fn available(test: &str) -> bool {
    kernel::kernel_available_with(test, &["/dev/fuse", "/usr/bin/fusermount3"])
}

/// `struct file_handle` with room for any handle (MAX_HANDLE_SZ is 128).
#[repr(C)]
#[derive(Clone)]
struct Handle {
    handle_bytes: u32,
    handle_type: i32,
    f_handle: [u8; 128],
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn encode(p: &Path, flags: i32) -> Handle {
    let mut h = Handle { handle_bytes: 128, handle_type: 0, f_handle: [0; 128] };
    let mut mount_id = 0;
    let c = cpath(p);
    // SAFETY: `h` is a file_handle followed by its 128 bytes, as handle_bytes says;
    // `c` is NUL-terminated.
    let r = unsafe {
        libc::name_to_handle_at(
            libc::AT_FDCWD,
            c.as_ptr(),
            (&raw mut h).cast(),
            &mut mount_id,
            flags,
        )
    };
    assert_eq!(r, 0, "name_to_handle_at {}: {}", p.display(), std::io::Error::last_os_error());
    h
}

/// open_by_handle_at(mount's root, `h`, `flags`): the descriptor or the errno.
fn open_handle(mount: &Path, h: &Handle, flags: i32) -> Result<OwnedFd, i32> {
    let m = std::fs::File::open(mount).unwrap();
    let mut h = h.clone();
    // SAFETY: as in `encode`; the mount's descriptor is open for the call.
    // O_CLOEXEC: the tests run in parallel, and a descriptor inherited by another
    // test's child (a mount daemon, umount) would keep this mount busy.
    let fd = unsafe {
        libc::open_by_handle_at(
            std::os::fd::AsRawFd::as_raw_fd(&m),
            (&raw mut h).cast(),
            flags | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap());
    }
    // SAFETY: a descriptor just opened, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn drop_caches() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").expect("drop_caches (needs root)");
}

/// What decoding a handle gave.
#[derive(Debug, PartialEq, Eq, Clone)]
enum Got {
    /// A file: its nlink, its bytes, and whether it is the inode the handle was made of.
    File {
        nlink: u64,
        data: Vec<u8>,
        same_inode: bool,
    },
    /// A directory or a connectable handle's file: the path it reconnected to (from the
    /// mount's root; "disconnected" for none), and its entries or bytes.
    Connected {
        path: String,
        names: Vec<String>,
        data: Vec<u8>,
        same_inode: bool,
    },
    Errno(i32),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    File,
    Dir,
    Connectable,
}

/// A handle made on a mount, with what it names.
struct Made {
    label: &'static str,
    handle: Handle,
    kind: Kind,
    ino: u64,
}

fn decode(mount: &Path, m: &Made) -> Got {
    let flags = libc::O_RDONLY | if m.kind == Kind::Dir { libc::O_DIRECTORY } else { 0 };
    let fd = match open_handle(mount, &m.handle, flags) {
        Ok(fd) => fd,
        Err(e) => return Got::Errno(e),
    };
    let f = std::fs::File::from(fd);
    let st = f.metadata().unwrap();
    let same_inode = st.ino() == m.ino;
    let proc = PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&f)));
    let data = if st.is_file() { std::fs::read(&proc).unwrap() } else { Vec::new() };
    if m.kind == Kind::File {
        return Got::File { nlink: st.nlink(), data, same_inode };
    }
    let target = std::fs::read_link(&proc).unwrap();
    let path = match target.strip_prefix(std::fs::canonicalize(mount).unwrap()) {
        Ok(rel) => format!("/{}", rel.display()),
        Err(_) => "disconnected".to_string(),
    };
    let mut names: Vec<String> = if st.is_dir() {
        std::fs::read_dir(&proc)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    } else {
        Vec::new()
    };
    names.sort();
    Got::Connected { path, names, data, same_inode }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Kernel,
    Fuse,
}

/// A mount of one side.
struct Mounted {
    side: Side,
    dir: PathBuf,
    fuse: Option<FuseMount>,
    kernel: Option<KernelMount>,
}

impl Side {
    fn mount(self, img: &Path, dir: &Path, subvol: Option<&str>) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        match self {
            Side::Kernel => {
                let opts = subvol.map_or("loop".to_string(), |s| format!("loop,subvol={s}"));
                run(Command::new("mount").args(["-o", &opts]).arg(img).arg(dir));
                Mounted {
                    side: self,
                    dir: dir.to_path_buf(),
                    fuse: None,
                    kernel: Some(KernelMount { dir: dir.to_path_buf() }),
                }
            }
            Side::Fuse => {
                let opts = subvol.map_or(String::new(), |s| format!("subvol={s}"));
                Mounted {
                    side: self,
                    dir: dir.to_path_buf(),
                    fuse: Some(FuseMount::start(img, dir, &opts)),
                    kernel: None,
                }
            }
        }
    }
}

impl Mounted {
    fn p(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    fn unmount(mut self) {
        if let Some(f) = self.fuse.take() {
            f.stop(Stop::Umount);
        }
        if let Some(k) = self.kernel.take() {
            run(Command::new("umount").arg(&k.dir));
            #[allow(clippy::mem_forget)]
            // unmounted above: the guard's drop must not unmount again
            std::mem::forget(k);
        }
    }

    /// `subvolume create|snapshot|delete` with paths from the mount's root: btrfs-progs
    /// on the kernel's mount, ubtrfs through ours.
    fn subvolume(&self, op: &str, paths: &[&str]) {
        match self.side {
            Side::Kernel => {
                let mut c = Command::new("btrfs");
                c.args(["-q", "subvolume", op]);
                if op == "delete" {
                    // Commit, so the deletion is on disk as ubtrfs's is.
                    c.arg("-C");
                }
                run(c.args(paths.iter().map(|p| self.p(p))));
            }
            Side::Fuse => {
                run(bin()
                    .args(["subvolume", op])
                    .arg(&self.dir)
                    .args(paths.iter().map(|p| format!("/{p}"))));
            }
        }
    }
}

fn write(m: &Mounted, rel: &str, data: &str) {
    std::fs::write(m.p(rel), data).unwrap();
}

fn mkdir(m: &Mounted, rel: &str) {
    std::fs::create_dir(m.p(rel)).unwrap();
}

fn made(m: &Mounted, label: &'static str, rel: &str, kind: Kind) -> Made {
    let p = m.p(rel);
    let flags = if kind == Kind::Connectable { AT_HANDLE_CONNECTABLE } else { 0 };
    Made {
        label,
        handle: encode(&p, flags),
        kind,
        ino: std::fs::symlink_metadata(&p).unwrap().ino(),
    }
}

/// Every handle's outcome: the step it was decoded in, its label, what it gave.
type Outcomes = Vec<(&'static str, &'static str, Got)>;

fn decode_all(m: &Mounted, step: &'static str, handles: &[&Made], out: &mut Outcomes) {
    for h in handles {
        out.push((step, h.label, decode(&m.dir, h)));
    }
}

/// The scenario: files, a hard link, directories, a subvolume with a nested one, a
/// snapshot (whose copy of the nested subvolume is a placeholder), decoded after
/// drop_caches, with files removed, with an unlinked file still open, after a
/// remount, with an inode number used again, and with the snapshot deleted.
fn scenario(side: Side, base: &Path) -> Outcomes {
    let img = base.join(format!("{side:?}.img"));
    mkfs(&img, "300M");
    let mnt = base.join(format!("{side:?}-mnt"));
    let m = side.mount(&img, &mnt, None);
    mkdir(&m, "d");
    write(&m, "d/f", "hello");
    std::fs::hard_link(m.p("d/f"), m.p("d/hl")).unwrap();
    mkdir(&m, "d/sub");
    write(&m, "d/sub/x", "ex");
    write(&m, "d/gone", "bye");
    mkdir(&m, "d/gonedir");
    write(&m, "d/kept", "kept");
    m.subvolume("create", &["sv"]);
    write(&m, "sv/g", "insv");
    mkdir(&m, "sv/sd");
    write(&m, "sv/sd/y", "why");
    m.subvolume("create", &["sv/nested"]);
    mkdir(&m, "sv/nested/deep");
    m.subvolume("snapshot", &["sv", "snap"]);
    // The placeholder first: a decoded directory's listing (readdirplus) hands the
    // kernel the entries in it, and then it holds the placeholder and never asks.
    let handles = vec![
        made(&m, "placeholder", "snap/nested", Kind::Dir),
        made(&m, "file", "d/f", Kind::File),
        made(&m, "hard link", "d/hl", Kind::File),
        made(&m, "dir", "d", Kind::Dir),
        made(&m, "dir in dir", "d/sub", Kind::Dir),
        made(&m, "connectable file", "d/sub/x", Kind::Connectable),
        made(&m, "subvolume file", "sv/g", Kind::File),
        made(&m, "subvolume top", "sv", Kind::Dir),
        made(&m, "subvolume dir", "sv/sd", Kind::Dir),
        made(&m, "connectable subvolume file", "sv/sd/y", Kind::Connectable),
        made(&m, "nested subvolume dir", "sv/nested/deep", Kind::Dir),
        made(&m, "snapshot file", "snap/g", Kind::File),
        made(&m, "snapshot top", "snap", Kind::Dir),
        made(&m, "snapshot dir", "snap/sd", Kind::Dir),
        made(&m, "mount root", "", Kind::Dir),
    ];
    let gone = made(&m, "removed file", "d/gone", Kind::File);
    let gonedir = made(&m, "removed dir", "d/gonedir", Kind::Dir);
    let kept = made(&m, "unlinked file", "d/kept", Kind::File);
    let mut out = Outcomes::new();

    // The kernel still holds everything: the FUSE kernel decodes without asking us.
    let all: Vec<&Made> = handles.iter().collect();
    let pick = |labels: &[&str]| -> Vec<&Made> {
        all.iter().copied().filter(|h| labels.contains(&h.label)).collect()
    };
    decode_all(&m, "cached", &pick(&["file"]), &mut out);

    let open = std::fs::File::open(m.p("d/kept")).unwrap();
    std::fs::remove_file(m.p("d/kept")).unwrap();
    std::fs::remove_file(m.p("d/gone")).unwrap();
    std::fs::remove_dir(m.p("d/gonedir")).unwrap();
    drop_caches();
    decode_all(&m, "evicted", &all, &mut out);
    decode_all(&m, "evicted", &[&gone, &gonedir], &mut out);
    decode_all(&m, "evicted, still open", &[&kept], &mut out);
    drop(open);
    drop_caches();
    // The kernel's btrfs frees the closed, unlinked inode at once. Over FUSE the close's
    // RELEASE and the eviction's FORGET go to the daemon without waiting for it (both
    // are asynchronous requests), so it may still hold the inode for a moment: ask again
    // (evicting again) until it answers as the kernel does, for at most 10 s.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while m.side == Side::Fuse
        && decode(&m.dir, &kept) != Got::Errno(libc::ESTALE)
        && std::time::Instant::now() < deadline
    {
        // A decode that found the inode holds it again: evict, then give the daemon
        // time for the FORGET before the next decode.
        drop_caches();
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    decode_all(&m, "evicted, closed", &[&kept], &mut out);

    m.unmount();
    let m = side.mount(&img, &mnt, None);
    decode_all(&m, "remounted", &all, &mut out);
    // After a mount the next inode of a tree is numbered after the highest objectid
    // left (`btrfs_init_root_free_objectid`; ubtrfs the same), so a new file takes the
    // number of the first one removed, with a new generation: the old handle must not
    // open it.
    write(&m, "d/new", "new");
    let new = made(&m, "new file", "d/new", Kind::File);
    assert_eq!(new.ino, gone.ino, "{side:?}: the new file takes the removed file's number");
    drop_caches();
    decode_all(&m, "reused number", &[&gone, &new], &mut out);

    m.subvolume("delete", &["snap"]);
    drop_caches();
    decode_all(
        &m,
        "snapshot deleted",
        &pick(&["snapshot file", "snapshot top", "snapshot dir"]),
        &mut out,
    );
    m.unmount();
    if side == Side::Fuse {
        assert_check(&img, "after the file handle scenario");
    }
    out
}

fn file(nlink: u64, data: &str) -> Got {
    Got::File { nlink, data: data.as_bytes().to_vec(), same_inode: true }
}

fn dir(path: &str, names: &[&str]) -> Got {
    Got::Connected {
        path: path.to_string(),
        names: names.iter().map(|s| s.to_string()).collect(),
        data: Vec::new(),
        same_inode: true,
    }
}

fn connected(path: &str, data: &str) -> Got {
    Got::Connected {
        path: path.to_string(),
        names: Vec::new(),
        data: data.as_bytes().to_vec(),
        same_inode: true,
    }
}

#[test]
fn handles_decode_as_on_the_kernel() {
    if !available("handles_decode_as_on_the_kernel") {
        return;
    }
    let base = scratch_in("fh", "decode");
    let kernel = scenario(Side::Kernel, &base);
    let ours = scenario(Side::Fuse, &base);
    let _ = std::fs::remove_dir_all(&base);

    // What the kernel's btrfs does (6.18), asserted so that a change on either side
    // shows here and not only as a difference.
    let want = |step: &str, label: &str| -> Got {
        let estale = Got::Errno(libc::ESTALE);
        match (step, label) {
            (_, "file" | "hard link") => file(2, "hello"),
            (_, "dir") => dir("/d", &["f", "hl", "sub"]),
            (_, "dir in dir") => dir("/d/sub", &["x"]),
            (_, "connectable file") => connected("/d/sub/x", "ex"),
            (_, "subvolume file") => file(1, "insv"),
            (_, "subvolume top") => dir("/sv", &["g", "nested", "sd"]),
            (_, "subvolume dir") => dir("/sv/sd", &["y"]),
            (_, "connectable subvolume file") => connected("/sv/sd/y", "why"),
            (_, "nested subvolume dir") => dir("/sv/nested/deep", &[]),
            ("snapshot deleted", _) => estale,
            (_, "snapshot file") => file(1, "insv"),
            (_, "snapshot top") => dir("/snap", &["g", "nested", "sd"]),
            (_, "snapshot dir") => dir("/snap/sd", &["y"]),
            // The kernel's btrfs never decodes a placeholder (objectid 2 has no inode).
            (_, "placeholder") => estale,
            (_, "mount root") => dir("/", &["d", "snap", "sv"]),
            (_, "removed file" | "removed dir") => estale,
            ("evicted, still open", "unlinked file") => file(0, "kept"),
            (_, "unlinked file") => estale,
            (_, "new file") => file(1, "new"),
            _ => panic!("no expectation for {step} {label}"),
        }
    };
    compare(&kernel, &ours, want);
}

/// A change made on a mount between two steps.
type Change = dyn Fn(&Mounted);

/// fstests generic/467, 477 and 777's cases, on both sides: handles of files (plain
/// and connectable) and of their directory decoded after the directory, then its
/// parent were renamed, and after the files moved to another directory, each time
/// after a remount.
fn renames(side: Side, base: &Path) -> Outcomes {
    let img = base.join(format!("{side:?}.img"));
    mkfs(&img, "300M");
    let mnt = base.join(format!("{side:?}-mnt"));
    let mut m = side.mount(&img, &mnt, None);
    mkdir(&m, "r");
    mkdir(&m, "r/t");
    for i in 0..3 {
        write(&m, &format!("r/t/file{i}"), "aaaa");
    }
    let handles = [
        made(&m, "file", "r/t/file0", Kind::File),
        made(&m, "connectable file", "r/t/file1", Kind::Connectable),
        made(&m, "dir", "r/t", Kind::Dir),
    ];
    let all: Vec<&Made> = handles.iter().collect();
    let mut out = Outcomes::new();
    let steps: [(&'static str, &Change); 4] = [
        ("remounted", &|_| {}),
        ("parent renamed", &|m| std::fs::rename(m.p("r/t"), m.p("r/t.renamed")).unwrap()),
        ("grandparent renamed", &|m| std::fs::rename(m.p("r"), m.p("r.renamed")).unwrap()),
        ("moved to a new parent", &|m| {
            mkdir(m, "r.renamed/new");
            for i in 0..3 {
                std::fs::rename(
                    m.p(&format!("r.renamed/t.renamed/file{i}")),
                    m.p(&format!("r.renamed/new/file{i}")),
                )
                .unwrap();
            }
        }),
    ];
    for (step, change) in steps {
        change(&m);
        m.unmount();
        m = side.mount(&img, &mnt, None);
        decode_all(&m, step, &all, &mut out);
    }
    m.unmount();
    if side == Side::Fuse {
        assert_check(&img, "after the renames");
    }
    out
}

#[test]
fn handles_follow_renames_across_remounts() {
    if !available("handles_follow_renames_across_remounts") {
        return;
    }
    let base = scratch_in("fh", "renames");
    let kernel = renames(Side::Kernel, &base);
    let ours = renames(Side::Fuse, &base);
    let _ = std::fs::remove_dir_all(&base);
    let want = |step: &str, label: &str| -> Got {
        let at = match step {
            "remounted" => "/r/t",
            "parent renamed" => "/r/t.renamed",
            _ => "/r.renamed/t.renamed",
        };
        match (step, label) {
            (_, "file") => file(1, "aaaa"),
            // The handle names the old directory, which no longer holds the file, so
            // it cannot be connected: ESTALE on the kernel's btrfs (generic/777 leaves
            // this case out for that reason).
            ("moved to a new parent", "connectable file") => Got::Errno(libc::ESTALE),
            (_, "connectable file") => connected(&format!("{at}/file1"), "aaaa"),
            ("moved to a new parent", "dir") => dir(at, &[]),
            (_, "dir") => dir(at, &["file0", "file1", "file2"]),
            _ => panic!("no expectation for {step} {label}"),
        }
    };
    compare(&kernel, &ours, want);
}

/// Assert that both sides gave what `want` says for every step.
fn compare(kernel: &Outcomes, ours: &Outcomes, want: impl Fn(&str, &str) -> Got) {
    let steps = |o: &Outcomes| o.iter().map(|(s, l, _)| (*s, *l)).collect::<Vec<_>>();
    assert_eq!(steps(kernel), steps(ours));
    let mut bad = Vec::new();
    for ((step, label, k), (_, _, o)) in kernel.iter().zip(ours) {
        let w = want(step, label);
        if *k != w || *o != w {
            bad.push(format!("{step}: {label}:\n  want   {w:?}\n  kernel {k:?}\n  ubtrfs {o:?}"));
        }
    }
    assert!(bad.is_empty(), "{} outcomes differ:\n{}", bad.len(), bad.join("\n"));
}

/// With `subvol=` the mount's root is a subvolume's top directory: a directory
/// decoded in it reconnects up to that root, which is its own parent there.
fn under_subvol_mount(side: Side, img: &Path, base: &Path) -> Outcomes {
    let m = side.mount(img, &base.join(format!("{side:?}-sub")), Some("sv"));
    let handles = [
        made(&m, "dir", "sd", Kind::Dir),
        made(&m, "dir in dir", "sd/deeper", Kind::Dir),
        made(&m, "connectable file", "sd/y", Kind::Connectable),
        made(&m, "mount root", "", Kind::Dir),
    ];
    let mut out = Outcomes::new();
    drop_caches();
    decode_all(&m, "evicted", &handles.iter().collect::<Vec<_>>(), &mut out);
    m.unmount();
    out
}

#[test]
fn handles_reconnect_under_a_subvolume_mount() {
    if !available("handles_reconnect_under_a_subvolume_mount") {
        return;
    }
    let base = scratch_in("fh", "subvol");
    let img = base.join("img");
    mkfs(&img, "300M");
    let m = Side::Kernel.mount(&img, &base.join("setup"), None);
    m.subvolume("create", &["sv"]);
    mkdir(&m, "sv/sd");
    mkdir(&m, "sv/sd/deeper");
    write(&m, "sv/sd/y", "why");
    m.unmount();
    let kernel = under_subvol_mount(Side::Kernel, &img, &base);
    let ours = under_subvol_mount(Side::Fuse, &img, &base);
    assert_check(&img, "after the subvolume mount");
    let _ = std::fs::remove_dir_all(&base);
    compare(&kernel, &ours, |_, label| match label {
        "dir" => dir("/sd", &["deeper", "y"]),
        "dir in dir" => dir("/sd/deeper", &[]),
        "connectable file" => connected("/sd/y", "why"),
        "mount root" => dir("/", &["sd"]),
        _ => panic!("no expectation for {label}"),
    });
}

/// A FUSE handle as the kernel encodes it (`fuse_encode_fh`, FILEID_INO64_GEN): the
/// node id's high and low words, then the generation.
fn fuse_handle(nodeid: u64, generation: u32) -> Handle {
    let mut h = Handle { handle_bytes: 12, handle_type: 0x81, f_handle: [0; 128] };
    for (i, w) in [(nodeid >> 32) as u32, nodeid as u32, generation].into_iter().enumerate() {
        h.f_handle[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
    }
    h
}

/// Handles no inode of the mount has (made up, or of an inode number the mount never
/// hands out) are ESTALE, never EIO or a wrong inode, and leave the mount working.
/// Ours alone: the kernel's btrfs handles have another layout.
#[test]
fn made_up_handles_are_stale() {
    if !available("made_up_handles_are_stale") {
        return;
    }
    let base = scratch_in("fh", "made-up");
    let img = base.join("img");
    mkfs(&img, "300M");
    let m = Side::Fuse.mount(&img, &base.join("mnt"), None);
    mkdir(&m, "d");
    write(&m, "d/f", "hello");
    let f = made(&m, "file", "d/f", Kind::File);
    assert_eq!(
        (f.handle.handle_type, f.handle.handle_bytes),
        (0x81, 12),
        "FILEID_INO64_GEN of 3 words"
    );
    let word =
        |i: usize| u32::from_ne_bytes(f.handle.f_handle[i * 4..i * 4 + 4].try_into().unwrap());
    let (nodeid, generation) = ((u64::from(word(0)) << 32) | u64::from(word(1)), word(2));
    assert_eq!(nodeid, f.ino, "the node id is the st_ino");
    drop_caches();
    for (what, nodeid, generation) in [
        ("node id 0", 0, 0),
        ("objectid 2 (a placeholder's inode)", 2, 0),
        ("the top directory's own number (the root is node id 1)", 256, 0),
        ("a placeholder number never handed out", 5, 0),
        ("a tree that does not exist", (7 << 44) | 256, 1),
        ("an objectid with no inode", (1 << 44) - 1, 1),
        ("the file with another generation", nodeid, generation + 1),
    ] {
        let r = open_handle(&m.dir, &fuse_handle(nodeid, generation), libc::O_RDONLY);
        assert_eq!(r.err(), Some(libc::ESTALE), "{what}: {nodeid:#x} generation {generation}");
    }
    // The real one opens the file, for writing too, and the root is node id 1.
    let fd = open_handle(&m.dir, &fuse_handle(nodeid, generation), libc::O_RDWR)
        .expect("the file's own handle");
    std::io::Write::write_all(&mut std::fs::File::from(fd), b"HE").unwrap();
    assert_eq!(std::fs::read(m.p("d/f")).unwrap(), b"HEllo");
    let root = open_handle(&m.dir, &fuse_handle(1, 0), libc::O_RDONLY | libc::O_DIRECTORY)
        .expect("the root's handle");
    assert_eq!(
        std::fs::File::from(root).metadata().unwrap().ino(),
        std::fs::metadata(&m.dir).unwrap().ino()
    );
    m.unmount();
    assert_check(&img, "after made-up handles");
    let _ = std::fs::remove_dir_all(&base);
}

/// A subvolume deleted but not yet dropped (ROOT_ITEM refs 0, its tree still there,
/// as `subvolume delete --no-clean` leaves it and as a read-only mount, which runs
/// no cleaner, keeps it): its inodes are gone for handles, as `btrfs_get_fs_root`
/// refuses a dead root on the kernel's btrfs.
fn dead_subvolume(side: Side, base: &Path) -> Outcomes {
    let img = base.join(format!("{side:?}.img"));
    mkfs(&img, "300M");
    let mnt = base.join(format!("{side:?}-mnt"));
    let m = side.mount(&img, &mnt, None);
    m.subvolume("create", &["sv"]);
    mkdir(&m, "sv/sd");
    write(&m, "sv/g", "insv");
    let handles = [
        made(&m, "subvolume file", "sv/g", Kind::File),
        made(&m, "subvolume dir", "sv/sd", Kind::Dir),
        made(&m, "subvolume top", "sv", Kind::Dir),
    ];
    m.unmount();
    run(bin().args(["subvolume", "delete", "--no-clean"]).arg(&img).arg("/sv"));
    let ro = match side {
        Side::Kernel => {
            run(Command::new("mount").args(["-o", "loop,ro"]).arg(&img).arg(&mnt));
            Mounted {
                side,
                dir: mnt.clone(),
                fuse: None,
                kernel: Some(KernelMount { dir: mnt.clone() }),
            }
        }
        Side::Fuse => Mounted {
            side,
            dir: mnt.clone(),
            fuse: Some(FuseMount::start(&img, &mnt, "ro")),
            kernel: None,
        },
    };
    let mut out = Outcomes::new();
    decode_all(&ro, "deleted, not dropped", &handles.iter().collect::<Vec<_>>(), &mut out);
    ro.unmount();
    let list = run(bin().args(["subvolume", "list", "-d"]).arg(&img));
    assert!(
        list.lines().count() == 1,
        "{side:?}: the deleted subvolume waits to be dropped:\n{list}"
    );
    out
}

#[test]
fn handles_of_a_deleted_subvolume_are_stale() {
    if !available("handles_of_a_deleted_subvolume_are_stale") {
        return;
    }
    let base = scratch_in("fh", "dead");
    let kernel = dead_subvolume(Side::Kernel, &base);
    let ours = dead_subvolume(Side::Fuse, &base);
    let _ = std::fs::remove_dir_all(&base);
    compare(&kernel, &ours, |_, _| Got::Errno(libc::ESTALE));
}
