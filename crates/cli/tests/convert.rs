//! A btrfs-convert image (tests/fixtures/convert: an ext4 filesystem converted by
//! btrfs-progs 6.2, with its ext2_saved subvolume and the garbage DIR_ITEM transids
//! that progs writes) end to end: `ubtrfs check --check-data-csum` and
//! `btrfs check --readonly --check-data-csum` find nothing; as root, `ubtrfs extract`
//! matches a kernel mount file by file; writing is refused cleanly while the image has
//! no free space tree, and once a kernel mount made one, `ubtrfs put`/`rm`/`mkdir`/`ln`
//! commit a result that both checkers pass, that the kernel mounts with the same view
//! as ours, and that btrfs-convert can still roll back to a clean ext4 holding the
//! original files. (The file-by-file read against the manifest without root is in
//! crates/core/tests/fixtures.rs.)

#[path = "common/cmd.rs"]
mod cmd;
#[path = "../../core/tests/common/mod.rs"]
mod common;

use cmd::{bin, out_of, pseudo_random};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

/// Copies of one fixture share its fsid: the kernel must see one of them at a time.
static KERNEL: Mutex<()> = Mutex::new(());

/// Run `cmd`, which must succeed; its stdout and stderr.
fn run(cmd: &mut Command) -> String {
    let o = out_of(cmd);
    assert!(
        o.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
}

fn script() -> PathBuf {
    common::repo_root().join("xtask/fixtures.py")
}

/// A private work directory (a tmpfs as root, so extracts keep every xattr), removed
/// on drop unless KEEP is set.
struct Work {
    dir: PathBuf,
    tmpfs: bool,
}

impl Work {
    fn new(tag: &str) -> Work {
        let dir = std::env::temp_dir().join(format!("ubtrfs-convert-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("work dir");
        Work { dir, tmpfs: false }
    }
    fn with_tmpfs(tag: &str) -> Work {
        let mut w = Work::new(tag);
        run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=1G", "tmpfs"]).arg(&w.dir));
        w.tmpfs = true;
        w
    }
    fn path(&self, p: &str) -> PathBuf {
        self.dir.join(p)
    }
    /// A private copy of the fixture image.
    fn image(&self, name: &str) -> PathBuf {
        let src = &common::fixture_images("convert")[0];
        let dst = self.path(name);
        run(Command::new("cp").arg("--sparse=always").arg(src).arg(&dst));
        dst
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if std::env::var_os("KEEP").is_some() {
            eprintln!("kept {}", self.dir.display());
            return;
        }
        if self.tmpfs {
            let _ = Command::new("umount").arg(&self.dir).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn sha256_file(p: &Path) -> String {
    let mut h = Sha256::new();
    let mut f = std::fs::File::open(p).expect("open");
    std::io::copy(&mut f, &mut h).expect("hash");
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// `btrfs check --readonly --check-data-csum` must find nothing. Needs btrfs-progs
/// only; without them the check is skipped, except under CI=true.
fn btrfs_check_clean(img: &Path) {
    let Ok(o) = Command::new("btrfs")
        .arg("check")
        .arg("--readonly")
        .arg("--check-data-csum")
        .arg(img)
        .output()
    else {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "btrfs-progs missing and CI=true forbids skipping btrfs check"
        );
        eprintln!("btrfs check skipped: no btrfs-progs");
        return;
    };
    let text =
        String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr);
    assert!(
        o.status.success() && text.contains("no error found"),
        "btrfs check {}:\n{text}",
        img.display()
    );
}

fn ubtrfs_check_clean(img: &Path) {
    let out = run(bin().arg("check").arg("--check-data-csum").arg(img));
    assert!(
        out.contains("no problems found") && out.contains("data bytes verified"),
        "ubtrfs check {}:\n{out}",
        img.display()
    );
}

/// The image as a loop device, attached (read-only when `ro`) and detached with the
/// kernel's registration of it forgotten.
struct Loop(String);

impl Loop {
    fn new(img: &Path, ro: bool) -> Loop {
        let mut cmd = Command::new("losetup");
        cmd.args(["-f", "--show"]);
        if ro {
            cmd.arg("-r");
        }
        Loop(run(cmd.arg(img)).trim().to_string())
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("btrfs").args(["device", "scan", "--forget", &self.0]).output();
        for _ in 0..50 {
            if Command::new("losetup")
                .args(["-d", &self.0])
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
            {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// Mount `dev` (as `fstype` with `opts`) at `mnt`, run `f`, unmount.
fn with_mount<T>(dev: &str, fstype: &str, opts: &str, mnt: &Path, f: impl FnOnce() -> T) -> T {
    std::fs::create_dir_all(mnt).expect("mount point");
    run(Command::new("mount").args(["-t", fstype, "-o", opts, dev]).arg(mnt));
    let r = f();
    for _ in 0..50 {
        let o = out_of(Command::new("umount").arg(mnt));
        if o.status.success() {
            return r;
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    panic!("umount {}: still busy", mnt.display());
}

/// The manifest (xtask/fixtures.py) of the tree at `dir`, written to `out`.
fn manifest_of(dir: &Path, out: &Path) {
    run(Command::new("python3").arg(script()).arg("manifest").arg("--out").arg(out).arg(dir));
}

/// Differences between two manifests, with `extra` arguments to fixtures.py diff;
/// empty when they agree.
fn diff(a: &Path, b: &Path, extra: &[&str]) -> String {
    let o = out_of(Command::new("python3").arg(script()).arg("diff").arg(a).arg(b).args(extra));
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success() || !text.is_empty(),
        "fixtures.py diff failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    text
}

/// The keys two views of one btrfs image agree on (inode numbers, block counts and the
/// subvolume mark differ by construction in an extract; directory sizes and link
/// counts are the host filesystem's).
const SAME_VIEW: [&str; 4] =
    ["--ignore-keys", "ino,blocks,subvol", "--ignore-dir-keys", "size,nlink"];

/// Extract `img` with ubtrfs into `dest` and compare with `kernel_manifest`.
fn extract_matches(img: &Path, dest: &Path, kernel_manifest: &Path, ours: &Path) {
    run(bin().arg("extract").arg(img).arg(dest));
    manifest_of(dest, ours);
    let d = diff(kernel_manifest, ours, &SAME_VIEW);
    assert!(
        d.is_empty(),
        "{}: ubtrfs extract differs from the kernel's view:\n{}",
        img.display(),
        d.lines().take(40).collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn convert_checks_clean() {
    let w = Work::new("check");
    let img = w.image("convert.img");
    ubtrfs_check_clean(&img);
    btrfs_check_clean(&img);
    let ls = run(bin().arg("ls").arg(&img).arg("/"));
    for name in ["ext2_saved", "files", "dirs", "lost+found"] {
        assert!(
            ls.lines().any(|l| l.split_whitespace().last() == Some(name)),
            "ls / has no {name}:\n{ls}"
        );
    }
    let listed = run(bin().arg("subvolume").arg("list").arg(&img));
    assert!(listed.contains("ext2_saved"), "no ext2_saved subvolume in:\n{listed}");
}

#[test]
fn convert_matches_a_kernel_mount() {
    if !common::kernel_available("convert_matches_a_kernel_mount") {
        return;
    }
    let w = Work::with_tmpfs("kernel");
    let img = w.image("convert.img");
    let before = sha256_file(&img);
    {
        let _k = KERNEL.lock().unwrap_or_else(|p| p.into_inner());
        let dev = Loop::new(&img, true);
        with_mount(&dev.0, "btrfs", "ro", &w.path("mnt"), || {
            manifest_of(&w.path("mnt"), &w.path("kernel.jsonl"))
        });
    }
    assert_eq!(sha256_file(&img), before, "the read-only mount changed the image");
    // The kernel sees what it saw when the fixture was made.
    let d =
        diff(&common::fixtures_dir().join("convert.manifest.jsonl"), &w.path("kernel.jsonl"), &[]);
    assert!(d.is_empty(), "the kernel's view differs from the stored manifest:\n{d}");
    extract_matches(&img, &w.path("out"), &w.path("kernel.jsonl"), &w.path("ours.jsonl"));
}

#[test]
fn convert_write_refused_without_a_free_space_tree() {
    let w = Work::new("refused");
    let img = w.image("convert.img");
    let before = sha256_file(&img);
    std::fs::write(w.path("host"), b"host file\n").expect("host file");
    let mut cmds = [
        bin().arg("put").arg(&img).arg(w.path("host")).arg("/files/host").output(),
        bin().arg("rm").arg(&img).arg("/files/size-100").output(),
        bin().arg("mkdir").arg(&img).arg("/new").output(),
    ];
    for o in &mut cmds {
        let o = o.as_ref().expect("run ubtrfs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "a write to an image without a free space tree succeeded");
        assert!(
            err.contains("incompatible filesystem")
                && err.contains("free-space tree")
                && err.contains("-o space_cache=v2 creates it"),
            "{err}"
        );
    }
    assert_eq!(sha256_file(&img), before, "a refused write changed the image");
}

#[test]
fn convert_written_after_a_kernel_mount_made_a_free_space_tree() {
    if !common::kernel_available_with(
        "convert_written_after_a_kernel_mount_made_a_free_space_tree",
        &["/usr/bin/btrfs-convert", "/usr/sbin/fsck.ext4"],
    ) {
        return;
    }
    let w = Work::with_tmpfs("write");
    let img = w.image("convert.img");
    let _k = KERNEL.lock().unwrap_or_else(|p| p.into_inner());
    {
        let dev = Loop::new(&img, false);
        with_mount(&dev.0, "btrfs", "space_cache=v2", &w.path("mnt"), || ());
    }
    let sup = run(bin().arg("dump-super").arg(&img));
    assert!(sup.contains("FREE_SPACE_TREE"), "the kernel made no free space tree:\n{sup}");

    // Writes next to, into and instead of converted files.
    let data = pseudo_random(0x2545_f491, 300_000);
    std::fs::write(w.path("host.bin"), &data).expect("host file");
    std::fs::create_dir_all(w.path("hostdir/sub")).expect("host dir");
    std::fs::write(w.path("hostdir/sub/small"), b"small\n").expect("host file");
    run(bin().arg("put").arg(&img).arg(w.path("host.bin")).arg("/files/host.bin"));
    run(bin().arg("put").arg("-r").arg(&img).arg(w.path("hostdir")).arg("/dirs/hostdir"));
    run(bin().arg("rm").arg(&img).arg("/files/size-100"));
    run(bin().arg("rm").arg("-r").arg(&img).arg("/dirs/big"));
    run(bin().arg("mkdir").arg(&img).arg("/dirs/a/new"));
    run(bin().arg("ln").arg(&img).arg("/files/tagged-1m+3").arg("/dirs/a/new/tagged-link"));
    ubtrfs_check_clean(&img);
    btrfs_check_clean(&img);
    let host_sha: String = Sha256::digest(&data).iter().map(|b| format!("{b:02x}")).collect();

    // The kernel's view of the result is ours.
    {
        let dev = Loop::new(&img, true);
        with_mount(&dev.0, "btrfs", "ro", &w.path("mnt"), || {
            manifest_of(&w.path("mnt"), &w.path("kernel.jsonl"))
        });
    }
    extract_matches(&img, &w.path("out"), &w.path("kernel.jsonl"), &w.path("ours.jsonl"));
    let kernel = std::fs::read_to_string(w.path("kernel.jsonl")).expect("manifest");
    let line = |p: &str| {
        kernel.lines().find(|l| l.starts_with(&format!("{{\"path\": \"{p}\","))).map(str::to_string)
    };
    assert!(
        line("files/host.bin").is_some_and(|l| l.contains(&host_sha)),
        "files/host.bin: {:?}",
        line("files/host.bin")
    );
    assert!(line("dirs/hostdir/sub/small").is_some());
    assert!(
        line("files/size-100").is_none()
            && line("dirs/big").is_none()
            && line("dirs/big/entry-00000").is_none()
    );
    assert!(line("dirs/a/new/tagged-link").is_some_and(|l| l.contains("\"nlink\": 2")));
    // Untouched converted files are as they were.
    let stored = std::fs::read_to_string(common::fixtures_dir().join("convert.manifest.jsonl"))
        .expect("manifest");
    for p in
        ["files/size-65537", "files/text-300k", "sparse/holes-12m", "xattrs/file", "links/a/three"]
    {
        let sha = |m: &str| {
            m.lines()
                .find(|l| l.starts_with(&format!("{{\"path\": \"{p}\",")))
                .and_then(|l| l.split("\"sha256\": ").nth(1))
                .map(|s| s[..66].to_string())
        };
        assert_eq!(sha(&kernel), sha(&stored), "{p}");
    }

    // btrfs-convert can still roll back: the ext4 it restores is clean and holds the
    // files as they were before the conversion.
    let rb = out_of(Command::new("btrfs-convert").arg("-r").arg(&img));
    assert!(
        rb.status.success(),
        "rollback failed: {}{}",
        String::from_utf8_lossy(&rb.stdout),
        String::from_utf8_lossy(&rb.stderr)
    );
    let fsck = out_of(Command::new("fsck.ext4").arg("-fn").arg(&img));
    assert!(
        fsck.status.success(),
        "fsck.ext4 after rollback: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    {
        let dev = Loop::new(&img, true);
        with_mount(&dev.0, "ext4", "ro", &w.path("mnt"), || {
            manifest_of(&w.path("mnt"), &w.path("ext4.jsonl"))
        });
    }
    let d = diff(
        &common::fixtures_dir().join("convert.manifest.jsonl"),
        &w.path("ext4.jsonl"),
        &[
            "--ignore-keys",
            "ino,blocks,subvol",
            "--ignore-dir-keys",
            "size,nlink,mtime_ns",
            "--ignore-paths",
            "^ext2_saved",
        ],
    );
    assert!(d.is_empty(), "the rolled-back ext4 differs from the converted files:\n{d}");
}
