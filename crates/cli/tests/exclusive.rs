//! Who may use an image at once, end to end with the built `ubtrfs`: a second writer is
//! refused while another holds the image (a writer held in this process, or two `put`
//! children racing), a reader goes on with a warning, a writer waits for no reader, and
//! (as root) `put`/`rm` refuse an image the kernel has mounted through a loop device, as a
//! file or as the block device itself, and leave it byte-identical.
//!
//! Without root the images are copies of a kernel-made fixture and the kernel parts are
//! skipped with a printed reason (CI=true forbids skipping). As root every image a test
//! writes is checked with `btrfs check --readonly --check-data-csum`.

#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use ubtrfs_core::{Engine, FsInfo, OpenOptions};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ubtrfs"))
}

fn text(o: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?} failed: {}", text(&out));
    out
}

/// Run `cmd`, which must fail with a message containing every one of `wanted`.
fn refused(cmd: &mut Command, wanted: &[&str]) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{cmd:?} should have been refused: {}", text(&out));
    for w in wanted {
        assert!(err.contains(w), "{cmd:?}: stderr lacks {w:?}: {}", text(&out));
    }
    out
}

fn sha256(p: &Path) -> String {
    let mut h = Sha256::new();
    std::io::copy(&mut std::fs::File::open(p).expect("open image"), &mut h).expect("hash image");
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A private work directory and image: a fresh 512 MiB `mkfs.btrfs` image when
/// btrfs-progs are installed (no root needed), else a copy of the blake2 fixture
/// (114 MiB, about 20 MiB free for data). Removed on drop.
struct Work {
    dir: PathBuf,
    img: PathBuf,
    /// Root with the kernel driver and btrfs-progs: check every image written.
    kernel: bool,
    /// Room for this much new data.
    room: usize,
}

fn have_mkfs() -> bool {
    Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

impl Work {
    fn new(tag: &str, kernel: bool) -> Work {
        let dir =
            std::env::temp_dir().join(format!("ubtrfs-exclusive-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("img");
        let room = if kernel || have_mkfs() {
            std::fs::File::create(&img).unwrap().set_len(512 << 20).unwrap();
            run(Command::new("mkfs.btrfs").arg("-q").arg("-f").arg(&img));
            256 << 20
        } else {
            let input =
                std::fs::File::open(repo().join("tests/fixtures/blake2.0.img.zst")).unwrap();
            let mut out = std::fs::File::create(&img).unwrap();
            std::io::copy(&mut zstd::stream::read::Decoder::new(input).unwrap(), &mut out).unwrap();
            16 << 20
        };
        Work { dir, img, kernel, room }
    }

    /// A one-file source tree `name` with `size` bytes derived from `seed`.
    fn source(&self, name: &str, size: usize, seed: u64) -> PathBuf {
        let src = self.dir.join(name);
        std::fs::create_dir_all(&src).unwrap();
        let mut x = seed | 1;
        let mut data = vec![0u8; size];
        for c in data.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
        }
        std::fs::write(src.join("data"), data).unwrap();
        src
    }

    /// `btrfs check --readonly --check-data-csum`, when the kernel tools are usable.
    fn check(&self, what: &str) {
        if !self.kernel {
            return;
        }
        let o = Command::new("btrfs")
            .args(["check", "--readonly", "--check-data-csum"])
            .arg(&self.img)
            .output()
            .expect("run btrfs check");
        assert!(o.status.success(), "{what}: btrfs check failed: {}", text(&o));
    }

    /// The names `ubtrfs ls` lists in `path`, sorted.
    fn ls(&self, path: &str) -> Vec<String> {
        let mut v: Vec<String> =
            String::from_utf8_lossy(&run(bin().arg("ls").arg(&self.img).arg(path)).stdout)
                .lines()
                .map(str::to_string)
                .collect();
        v.sort();
        v
    }

    /// The root listing plus `names`, sorted.
    fn root_with(&self, base: &[String], names: &[&str]) -> Vec<String> {
        let mut v: Vec<String> =
            base.iter().cloned().chain(names.iter().map(|n| n.to_string())).collect();
        v.sort();
        v
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Wait (up to 5 s) until /proc/locks lists no flock lock on `p`. A descriptor this
/// process closed lingers in a child another test thread has forked and not yet
/// exec'd, and `ubtrfs` children would be refused meanwhile.
fn wait_unlocked(p: &Path) {
    use std::os::unix::fs::MetadataExt;
    let md = std::fs::metadata(p).unwrap();
    let (major, minor) = ubtrfs_core::mountinfo::dev_num(md.dev());
    let me = format!("{major:02x}:{minor:02x}:{}", md.ino());
    let start = std::time::Instant::now();
    while std::fs::read_to_string("/proc/locks")
        .unwrap_or_default()
        .lines()
        .any(|l| l.contains(" FLOCK ") && l.split_whitespace().any(|f| f == me))
    {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "{} stays locked after its last open was dropped",
            p.display()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn root_with_kernel(test: &str) -> bool {
    kernel::kernel_available(test)
}

#[test]
fn writer_in_this_process_refuses_put_and_rm_and_warns_readers() {
    let w = Work::new("held", root_with_kernel("exclusive held-writer kernel checks"));
    let src = w.source("src", 10_000, 1);
    let base = w.ls("/");
    run(bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/first"));
    let before = sha256(&w.img);
    let writer = Engine::open(&OpenOptions::new(&w.img)).expect("open writer in the test process");
    let me = format!("in use by another ubtrfs process (pid {})", std::process::id());
    refused(
        bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/second"),
        &[&me, "device or resource busy"],
    );
    refused(bin().arg("rm").arg("-r").arg(&w.img).arg("/first"), &[&me]);
    assert_eq!(sha256(&w.img), before, "a refused writer changed the image");
    // A reader does not wait: it reads the committed state and says so.
    let ls = run(bin().arg("ls").arg(&w.img).arg("/first"));
    assert_eq!(String::from_utf8_lossy(&ls.stdout).trim(), "data");
    let warn = format!("ubtrfs: warning: {} is being changed by another ubtrfs process (pid {}); showing its last committed state", w.img.display(), std::process::id());
    assert!(
        String::from_utf8_lossy(&ls.stderr).contains(&warn),
        "ls lacks the warning: {}",
        text(&ls)
    );
    // check refuses an image under change unless forced, like btrfs check.
    refused(
        bin().arg("check").arg(&w.img),
        &["is being changed by another ubtrfs process", "use --force"],
    );
    let forced = run(bin().arg("check").arg("--force").arg(&w.img));
    assert!(
        String::from_utf8_lossy(&forced.stderr).contains(&warn),
        "check --force lacks the warning: {}",
        text(&forced)
    );
    drop(writer);
    wait_unlocked(&w.img);
    assert_eq!(sha256(&w.img), before, "an uncommitted writer changed the image");
    // The lock went with the writer.
    run(bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/second"));
    assert_eq!(w.ls("/"), w.root_with(&base, &["first", "second"]));
    w.check("after the held writer");
}

#[test]
fn reader_in_this_process_refuses_writers() {
    let w = Work::new("reader", false);
    let src = w.source("src", 5000, 2);
    let before = sha256(&w.img);
    let reader = FsInfo::open(&OpenOptions::new(&w.img)).expect("open reader");
    assert!(
        reader.in_use.is_empty() && reader.take_warnings().is_empty(),
        "a lone reader found another user"
    );
    // A long extract is protected from changes: the writer is refused, not the reader.
    refused(
        bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/x"),
        &[&format!("in use by another ubtrfs process (pid {})", std::process::id())],
    );
    // Readers share: another reader runs without a warning.
    let ls = run(bin().arg("ls").arg(&w.img).arg("/"));
    assert!(!String::from_utf8_lossy(&ls.stderr).contains("warning"), "{}", text(&ls));
    // So does a writer opened in this process: flock locks of two opens conflict.
    let e = Engine::open(&OpenOptions::new(&w.img))
        .err()
        .expect("writer beside a reader in one process");
    assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::Busy), "{e}");
    drop(reader);
    wait_unlocked(&w.img);
    assert_eq!(sha256(&w.img), before);
    run(bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/x"));
}

#[test]
fn two_racing_puts_one_wins() {
    let kernel = root_with_kernel("exclusive race kernel checks");
    let w = Work::new("race", kernel);
    // Big enough that the winner still holds the image when the other opens it (some
    // milliseconds apart, against a put of a few hundred milliseconds).
    let size = w.room.min(96 << 20);
    let a = w.source("a", size, 3);
    let b = w.source("b", size, 4);
    let base = w.ls("/");
    let pa = bin()
        .arg("put")
        .arg("-r")
        .arg(&w.img)
        .arg(&a)
        .arg("/a")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pb = bin()
        .arg("put")
        .arg("-r")
        .arg(&w.img)
        .arg(&b)
        .arg("/b")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let (ida, idb) = (pa.id(), pb.id());
    let (oa, ob) = (pa.wait_with_output().unwrap(), pb.wait_with_output().unwrap());
    let (winner, loser, win_src, lose_out, win_pid) =
        match (oa.status.success(), ob.status.success()) {
            (true, false) => ("a", "b", &a, &ob, ida),
            (false, true) => ("b", "a", &b, &oa, idb),
            _ => {
                panic!("exactly one put must succeed:\nput a: {}\nput b: {}", text(&oa), text(&ob))
            }
        };
    let err = String::from_utf8_lossy(&lose_out.stderr);
    assert!(
        err.contains(&format!("in use by another ubtrfs process (pid {win_pid})")),
        "put {loser} was refused for another reason: {}",
        text(lose_out)
    );
    // The image holds exactly the winner's change.
    assert_eq!(w.ls("/"), w.root_with(&base, &[winner]));
    let cat = run(bin().arg("cat").arg(&w.img).arg(format!("/{winner}/data")));
    assert!(
        cat.stdout == std::fs::read(win_src.join("data")).unwrap(),
        "/{winner}/data differs from its source"
    );
    w.check("after the race");
    if kernel {
        let mnt = w.dir.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        run(Command::new("mount").args(["-o", "ro,loop"]).arg(&w.img).arg(&mnt));
        let mut names: Vec<String> = std::fs::read_dir(&mnt)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        let same = std::fs::read(mnt.join(winner).join("data"))
            .map(|d| d == std::fs::read(win_src.join("data")).unwrap());
        let _ = Command::new("umount").arg(&mnt).status();
        assert_eq!(names, w.root_with(&base, &[winner]), "the kernel sees other names");
        assert!(same.expect("read through the kernel"), "the kernel reads other data");
    }
}

/// A kernel mount of an image (through a loop device), unmounted and detached on drop.
struct KernelMount {
    dir: PathBuf,
    loopdev: Option<String>,
}

impl KernelMount {
    /// `mount -o loop[,ro] IMG DIR`.
    fn image(img: &Path, dir: &Path, ro: bool) -> KernelMount {
        std::fs::create_dir_all(dir).unwrap();
        run(Command::new("mount")
            .args(["-o", if ro { "ro,loop" } else { "loop" }])
            .arg(img)
            .arg(dir));
        KernelMount { dir: dir.to_path_buf(), loopdev: None }
    }
    /// `losetup -f --show IMG`, then mount that device.
    fn device(img: &Path, dir: &Path) -> KernelMount {
        let dev = losetup(img);
        std::fs::create_dir_all(dir).unwrap();
        let m = KernelMount { dir: dir.to_path_buf(), loopdev: Some(dev.clone()) };
        run(Command::new("mount").arg(&dev).arg(dir));
        m
    }
    fn umount(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).output();
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        self.umount();
        if let Some(d) = self.loopdev.take() {
            let _ = Command::new("losetup").arg("-d").arg(d).output();
        }
    }
}

/// The loop device the kernel mounted `dir` from (mountinfo's source).
fn mount_source(dir: &Path) -> String {
    let o = run(Command::new("findmnt").args(["-n", "-o", "SOURCE", "--target"]).arg(dir));
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

#[test]
fn put_and_rm_refuse_a_kernel_mounted_image() {
    if !root_with_kernel("exclusive kernel-mounted image") {
        return;
    }
    let w = Work::new("mounted", true);
    let src = w.source("src", 100_000, 5);
    run(bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/keep"));
    // A mount point with a space: mountinfo escapes it as \040.
    let mnt = w.dir.join("mount point");
    let mnt_s = mnt.display().to_string();
    {
        // Read-only: the kernel writes nothing, so the image must stay byte-identical.
        let _m = KernelMount::image(&w.img, &mnt, true);
        let through = format!("(through {})", mount_source(&mnt));
        let before = sha256(&w.img);
        let at = format!("is mounted by the kernel at {mnt_s} {through}: device or resource busy (unmount it first)");
        refused(bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/new"), &[&at]);
        refused(bin().arg("rm").arg("-r").arg(&w.img).arg("/keep"), &[&at]);
        assert_eq!(sha256(&w.img), before, "a refused writer changed a mounted image");
        // Reading stays allowed, with a warning naming the mount point.
        let ls = run(bin().arg("ls").arg(&w.img).arg("/"));
        assert_eq!(String::from_utf8_lossy(&ls.stdout).trim(), "keep");
        assert!(
            String::from_utf8_lossy(&ls.stderr).contains(&format!("warning: {} is mounted by the kernel at {mnt_s} {through}; showing its last committed state", w.img.display())),
            "{}",
            text(&ls)
        );
        refused(
            bin().arg("check").arg(&w.img),
            &[&format!("is mounted by the kernel at {mnt_s}"), "use --force"],
        );
        run(bin().arg("check").arg("--force").arg(&w.img));
    }
    {
        // Read-write: the kernel itself writes the image (commits, discards), so only the
        // refusals are checked here.
        let m = KernelMount::image(&w.img, &mnt, false);
        std::fs::write(m.dir.join("by-kernel"), b"k").unwrap();
        let at = format!("is mounted by the kernel at {mnt_s}");
        refused(bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/new"), &[&at]);
        refused(bin().arg("rm").arg("-r").arg(&w.img).arg("/keep"), &[&at]);
        // A writer in this process is refused the same way, through the library.
        let e = Engine::open(&OpenOptions::new(&w.img))
            .err()
            .expect("library writer on a mounted image");
        assert!(e.to_string().contains(&at), "{e}");
        assert_eq!(e.posix_kind(), Some(ubtrfs_core::PosixKind::Busy));
    }
    w.check("after the kernel mounts");
    // Unmounted, writing works again.
    run(bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/new"));
    assert_eq!(w.ls("/"), ["by-kernel", "keep", "new"]);
    w.check("after the put that follows");
}

#[test]
fn block_device_of_a_mounted_image_is_refused() {
    if !root_with_kernel("exclusive mounted block device") {
        return;
    }
    let w = Work::new("blockdev", true);
    let src = w.source("src", 50_000, 6);
    let mnt = w.dir.join("mnt");
    let mut m = KernelMount::device(&w.img, &mnt);
    let dev = m.loopdev.clone().expect("a loop device");
    let mnt_s = mnt.display().to_string();
    std::fs::write(mnt.join("by-kernel"), b"k").unwrap();
    // The device itself: O_EXCL fails because the kernel holds it.
    refused(
        bin().arg("put").arg("-r").arg(&dev).arg(&src).arg("/x"),
        &[&format!(
            "{dev} is mounted by the kernel at {mnt_s}: device or resource busy (unmount it first)"
        )],
    );
    // The image file behind it: found through the loop device's backing file.
    refused(
        bin().arg("put").arg("-r").arg(&w.img).arg(&src).arg("/x"),
        &[&format!("is mounted by the kernel at {mnt_s} (through {dev})")],
    );
    for target in [dev.as_str(), w.img.to_str().unwrap()] {
        let ls = run(bin().arg("ls").arg(target).arg("/"));
        assert!(
            String::from_utf8_lossy(&ls.stderr)
                .contains(&format!("warning: {target} is mounted by the kernel at {mnt_s}")),
            "{}",
            text(&ls)
        );
    }
    m.umount();
    // Attached but unmounted: ubtrfs writes through the device, and the device and its
    // backing file are one image to the lock.
    let writer = Engine::open(&OpenOptions::new(&w.img)).expect("writer on the image file");
    let before = sha256(&w.img);
    refused(
        bin().arg("put").arg("-r").arg(&dev).arg(&src).arg("/x"),
        &[&format!("{dev} is in use by another ubtrfs process (pid {})", std::process::id())],
    );
    assert_eq!(sha256(&w.img), before);
    drop(writer);
    wait_unlocked(&w.img);
    run(bin().arg("put").arg("-r").arg(&dev).arg(&src).arg("/x"));
    let ls = run(bin().arg("ls").arg(&dev).arg("/"));
    assert_eq!(String::from_utf8_lossy(&ls.stdout).lines().collect::<Vec<_>>(), ["by-kernel", "x"]);
    drop(m);
    w.check("after put through the block device");
}

#[test]
fn second_member_of_a_mounted_multi_device_btrfs_is_refused() {
    if !root_with_kernel("exclusive mounted multi-device btrfs") {
        return;
    }
    let w = Work::new("multi", true);
    let img2 = w.dir.join("img2");
    std::fs::File::create(&img2).unwrap().set_len(512 << 20).unwrap();
    run(Command::new("mkfs.btrfs")
        .args(["-q", "-f", "-d", "single", "-m", "raid1"])
        .arg(&w.img)
        .arg(&img2));
    let loops = Loops(vec![losetup(&w.img), losetup(&img2)]);
    let (d1, d2) = (loops.0[0].clone(), loops.0[1].clone());
    let mnt = w.dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    // Mounted by the first device's name: the second is only listed in /sys/fs/btrfs.
    run(Command::new("mount").arg("-o").arg(format!("device={d2}")).arg(&d1).arg(&mnt));
    let m = KernelMount { dir: mnt.clone(), loopdev: None };
    let src = w.source("src", 1000, 7);
    let before = sha256(&img2);
    let at = format!("is mounted by the kernel at {}", mnt.display());
    refused(
        bin().arg("put").arg(&img2).arg(src.join("data")).arg("/x"),
        &[&format!("{} {at} (through {d2})", img2.display())],
    );
    refused(bin().arg("put").arg(&d2).arg(src.join("data")).arg("/x"), &[&format!("{d2} {at}")]);
    assert_eq!(sha256(&img2), before, "a refused writer changed the second member");
    drop(m);
    drop(loops);
}

/// `losetup -f --show IMG`: the new loop device.
fn losetup(img: &Path) -> String {
    String::from_utf8_lossy(&run(Command::new("losetup").args(["-f", "--show"]).arg(img)).stdout)
        .trim()
        .to_string()
}

/// Loop devices detached on drop.
struct Loops(Vec<String>);

impl Drop for Loops {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = Command::new("losetup").arg("-d").arg(d).output();
        }
    }
}
