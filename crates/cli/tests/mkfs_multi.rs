//! `ubtrfs mkfs` over several devices, end to end: for each profile pair over the
//! device counts it needs (mixed device sizes among them), every member carries a
//! superblock of the one filesystem; `btrfs check --readonly --check-data-csum` over
//! loop devices of all members is clean; the kernel mounts all members, `btrfs
//! filesystem df` shows exactly the profiles asked for, the kernel writes a tree into
//! it and it checks clean again; then `ubtrfs put --device` writes into it and it checks
//! clean once more. Too few devices for a profile, RAID5/6 and a signature on one member
//! are refused before anything is touched, a failure part way leaves no image it made
//! and no superblock on the others, `--rootdir` on a RAID1 pair reads back through
//! the kernel, and `--shrink` cuts each member to its own size.
//!
//! The kernel keeps one registered device list per fsid and loop devices are shared
//! with the other tests of the machine, so these tests run one at a time and forget
//! their devices after.

#[path = "common/cmd.rs"]
mod cmd;
use cmd::{bin, fails, run, scratch_in};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

const MIB: u64 = 1 << 20;

/// One test at a time (see the module notes).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn scratch(name: &str) -> PathBuf {
    scratch_in("mkfs-multi", name)
}

/// The members of one filesystem attached as loop devices, detached (and forgotten by
/// the kernel's device registry) on drop.
struct Loops {
    devs: Vec<String>,
}

impl Loops {
    fn new(imgs: &[PathBuf]) -> Loops {
        let mut l = Loops { devs: Vec::new() };
        for p in imgs {
            let out = Command::new("losetup")
                .args(["-f", "--show"])
                .arg(p)
                .output()
                .expect("run losetup");
            assert!(
                out.status.success(),
                "losetup {}: {}",
                p.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            l.devs.push(String::from_utf8_lossy(&out.stdout).trim().to_string());
        }
        l
    }

    /// `btrfs check --readonly --check-data-csum` on the first member (progs finds the
    /// others by scanning; `btrfs device scan` registers them first).
    fn check(&self, what: &str) {
        let _ = Command::new("btrfs").args(["device", "scan"]).args(&self.devs).output();
        let out = Command::new("btrfs")
            .args(["check", "--readonly", "--check-data-csum"])
            .arg(&self.devs[0])
            .output()
            .expect("run btrfs check");
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // progs' scan of every block device trips over loop devices other tests are
        // detaching; that is not this filesystem's finding.
        let findings =
            text.lines().filter(|l| l.contains("ERROR") && !l.contains("cannot scan")).count();
        assert!(
            out.status.success() && text.contains("no error found") && findings == 0,
            "{what}: btrfs check failed:\n{text}"
        );
    }

    /// A kernel mount of all members at `dir`, unmounted on drop.
    fn mount(&self, dir: &Path) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        let o: Vec<String> = self.devs.iter().map(|d| format!("device={d}")).collect();
        let out = Command::new("mount")
            .args(["-t", "btrfs", "-o", &o.join(",")])
            .arg(&self.devs[0])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(out.status.success(), "mount {o:?}: {}", String::from_utf8_lossy(&out.stderr));
        Mounted { dir: dir.to_path_buf(), done: false }
    }
}

impl Drop for Loops {
    fn drop(&mut self) {
        for d in &self.devs {
            let _ = Command::new("btrfs").args(["device", "scan", "--forget", d]).output();
            let _ = Command::new("losetup").args(["-d", d]).output();
        }
    }
}

/// A kernel mount, unmounted on drop (a failing test leaves none behind).
struct Mounted {
    dir: PathBuf,
    done: bool,
}

impl Mounted {
    fn umount(mut self) {
        self.done = true;
        for _ in 0..40 {
            let out = Command::new("umount").arg(&self.dir).output().expect("run umount");
            if out.status.success() {
                return;
            }
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("busy"),
                "umount {}: {}",
                self.dir.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("umount {}: still busy", self.dir.display());
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if !self.done {
            let _ = Command::new("umount").arg(&self.dir).status();
        }
    }
}

/// The primary superblock of `img`, checked by the format crate.
fn superblock(img: &Path) -> ubtrfs_format::structs::Superblock {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(img).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 65536).unwrap();
    ubtrfs_format::superblock::check_super(&buf, 65536).unwrap()
}

/// `btrfs filesystem df`'s rows without GlobalReserve: "Data, RAID1" and so on, sorted.
fn df_profiles(mnt: &Path) -> Vec<String> {
    let out = run(Command::new("btrfs").args(["filesystem", "df"]).arg(mnt));
    let mut v: Vec<String> = out
        .lines()
        .filter(|l| !l.starts_with("GlobalReserve"))
        .filter_map(|l| l.split(':').next())
        .map(str::to_string)
        .collect();
    v.sort();
    v
}

fn df_name(p: &str) -> String {
    match p {
        "single" => "single".into(),
        p => p.to_ascii_uppercase(),
    }
}

/// The paths of `n` images in `d`.
fn images(d: &Path, n: usize) -> Vec<PathBuf> {
    (0..n).map(|i| d.join(format!("dev{i}.img"))).collect()
}

/// One filesystem over existing images of `sizes` made with `args`, whose `btrfs
/// filesystem df` must show data `data` and metadata and system `meta`.
fn run_case(tag: &str, sizes: &[u64], args: &[&str], data: &str, meta: &str) {
    let d = scratch(tag);
    let imgs = images(&d, sizes.len());
    for (p, &s) in imgs.iter().zip(sizes) {
        // Existing files of their own sizes: mixed sizes need each its own.
        std::fs::File::create(p).unwrap().set_len(s).unwrap();
    }
    run(bin().arg("mkfs").arg("-q").args(args).args(&imgs));
    let fsid = superblock(&imgs[0]).fsid;
    let total: u64 = sizes.iter().sum();
    for (i, p) in imgs.iter().enumerate() {
        let sb = superblock(p);
        assert_eq!(sb.fsid, fsid, "{tag}: member {i} of another filesystem");
        assert_eq!(sb.num_devices.get(), sizes.len() as u64, "{tag}: member {i} num_devices");
        assert_eq!(sb.total_bytes.get(), total, "{tag}: member {i} total_bytes");
        assert_eq!(sb.dev_item.devid.get(), i as u64 + 1, "{tag}: member {i} devid");
        assert_eq!(
            sb.dev_item.total_bytes.get(),
            sizes[i],
            "{tag}: member {i} dev_item.total_bytes"
        );
    }
    let want = {
        let mut v = if args.contains(&"--mixed") {
            vec![format!("Data+Metadata, {}", df_name(data)), format!("System, {}", df_name(meta))]
        } else {
            vec![
                format!("Data, {}", df_name(data)),
                format!("Metadata, {}", df_name(meta)),
                format!("System, {}", df_name(meta)),
            ]
        };
        v.sort();
        v
    };
    {
        let loops = Loops::new(&imgs);
        loops.check(&format!("{tag}: as made"));
        let mnt = d.join("mnt");
        let m = loops.mount(&mnt);
        assert_eq!(df_profiles(&mnt), want, "{tag}: profiles of the new filesystem");
        run(Command::new("cp").arg("-a").arg("/usr/include/linux").arg(&mnt));
        run(Command::new("sync").arg("-f").arg(mnt.join("linux")));
        assert_eq!(df_profiles(&mnt), want, "{tag}: profiles after the kernel wrote");
        m.umount();
        loops.check(&format!("{tag}: after the kernel wrote"));
    }
    // ubtrfs writes on top, given every member.
    let mut put = bin();
    put.args(["put", "-r"]).arg(&imgs[0]);
    for p in &imgs[1..] {
        put.arg("--device").arg(p);
    }
    run(put.arg("/usr/include/asm-generic").arg("/"));
    {
        let loops = Loops::new(&imgs);
        loops.check(&format!("{tag}: after ubtrfs put"));
        let mnt = d.join("mnt");
        let m = loops.mount(&mnt);
        let diff = Command::new("diff")
            .arg("-r")
            .arg("/usr/include/asm-generic")
            .arg(mnt.join("asm-generic"))
            .output()
            .unwrap();
        assert!(
            diff.status.success(),
            "{tag}: the kernel reads the put back differently: {}",
            String::from_utf8_lossy(&diff.stdout)
        );
        assert_eq!(df_profiles(&mnt), want, "{tag}: profiles after ubtrfs put");
        m.umount();
    }
    std::fs::remove_dir_all(&d).unwrap();
}

fn kernel(test: &str) -> bool {
    kernel::kernel_available_with(test, &["/usr/sbin/losetup"])
}

#[test]
fn raid1_pair() {
    if !kernel("mkfs_multi raid1_pair") {
        return;
    }
    let _g = serial();
    run_case("raid1", &[256 * MIB; 2], &["-d", "raid1", "-m", "raid1"], "raid1", "raid1");
}

#[test]
fn defaults_on_two_devices_are_single_data_raid1_metadata() {
    if !kernel("mkfs_multi defaults_on_two") {
        return;
    }
    let _g = serial();
    run_case("defaults", &[256 * MIB; 2], &[], "single", "raid1");
}

#[test]
fn raid1c3_three() {
    if !kernel("mkfs_multi raid1c3_three") {
        return;
    }
    let _g = serial();
    run_case("raid1c3", &[256 * MIB; 3], &["-d", "raid1c3", "-m", "raid1c3"], "raid1c3", "raid1c3");
}

#[test]
fn raid1c4_four() {
    if !kernel("mkfs_multi raid1c4_four") {
        return;
    }
    let _g = serial();
    run_case("raid1c4", &[256 * MIB; 4], &["-d", "raid1c4", "-m", "raid1c4"], "raid1c4", "raid1c4");
}

#[test]
fn raid10_four() {
    if !kernel("mkfs_multi raid10_four") {
        return;
    }
    let _g = serial();
    run_case("raid10", &[256 * MIB; 4], &["-d", "raid10", "-m", "raid10"], "raid10", "raid10");
}

#[test]
fn raid0_over_devices_of_mixed_sizes() {
    if !kernel("mkfs_multi raid0_mixed_sizes") {
        return;
    }
    let _g = serial();
    run_case("raid0", &[256 * MIB, 400 * MIB], &["-d", "raid0", "-m", "raid1"], "raid0", "raid1");
}

#[test]
fn data_raid0_metadata_raid1c3() {
    if !kernel("mkfs_multi raid0_raid1c3") {
        return;
    }
    let _g = serial();
    run_case(
        "raid0-raid1c3",
        &[256 * MIB, 300 * MIB, 256 * MIB],
        &["-d", "raid0", "-m", "raid1c3"],
        "raid0",
        "raid1c3",
    );
}

#[test]
fn dup_on_two_devices() {
    if !kernel("mkfs_multi dup_on_two") {
        return;
    }
    let _g = serial();
    run_case("dup", &[256 * MIB; 2], &["-d", "dup", "-m", "dup"], "dup", "dup");
}

#[test]
fn mixed_raid1_pair() {
    if !kernel("mkfs_multi mixed_raid1_pair") {
        return;
    }
    let _g = serial();
    run_case("mixed", &[256 * MIB; 2], &["--mixed", "-d", "raid1"], "raid1", "raid1");
}

/// Refusals come before any target is touched: nothing is created, and an existing
/// member keeps its bytes.
#[test]
fn bad_device_sets_refused() {
    let d = scratch("bad");
    let imgs = images(&d, 4);
    let cases: [(&[&str], usize, &[&str]); 6] = [
        (&["-d", "raid1c4"], 3, &["data profile raid1c4", "needs at least 4 devices, 3 given"]),
        (&["-m", "raid1c3"], 2, &["metadata profile raid1c3", "needs at least 3 devices, 2 given"]),
        (&["-d", "raid1"], 1, &["data profile raid1", "needs at least 2 devices, 1 given"]),
        (&["-d", "raid10"], 1, &["data profile raid10", "needs at least 2 devices, 1 given"]),
        (&["-d", "raid5"], 3, &["profile raid5", "RAID5/6"]),
        (&["-m", "raid6"], 4, &["profile raid6", "RAID5/6"]),
    ];
    for (args, n, want) in cases {
        let err = fails(bin().args(["mkfs", "--size", "128M"]).args(args).args(&imgs[..n]));
        for w in want {
            assert!(err.contains(w), "mkfs {args:?} over {n}: {err}");
        }
        assert!(imgs.iter().all(|p| !p.exists()), "mkfs {args:?} over {n} left an image");
    }
    // The same image twice.
    let err = fails(bin().args(["mkfs", "--size", "128M"]).arg(&imgs[0]).arg(&imgs[0]));
    assert!(err.contains("given twice"), "{err}");
    assert!(!imgs[0].exists());
    // A missing member without --size.
    std::fs::File::create(&imgs[0]).unwrap().set_len(128 * MIB).unwrap();
    let err = fails(bin().arg("mkfs").arg(&imgs[0]).arg(&imgs[1]));
    assert!(err.contains(&*imgs[1].display().to_string()) && err.contains("give --size"), "{err}");
    // A member holding a filesystem stops the others being touched.
    std::fs::File::create(&imgs[1]).unwrap().set_len(128 * MIB).unwrap();
    run(bin().args(["mkfs", "-q"]).arg(&imgs[1]));
    let before = std::fs::read(&imgs[1]).unwrap();
    let err = fails(bin().args(["mkfs", "--size", "128M"]).arg(&imgs[2]).arg(&imgs[1]));
    assert!(err.contains(&*imgs[1].display().to_string()) && err.contains("--force"), "{err}");
    assert!(!imgs[2].exists(), "an image made before the refusal was left");
    assert!(std::fs::read(&imgs[1]).unwrap() == before, "the refused member was changed");
    // A member too small.
    let tiny = d.join("tiny.img");
    std::fs::File::create(&tiny).unwrap().set_len(16 * MIB).unwrap();
    let err = fails(bin().args(["mkfs", "-f"]).arg(&imgs[0]).arg(&tiny));
    assert!(err.contains("tiny.img") && err.contains("too small"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}

/// A member that fails part way (its tmpfs fills after the bootstrap): the image mkfs
/// created is removed, and the existing member keeps no superblock.
#[test]
fn failure_part_way_cleans_every_member() {
    if !kernel("mkfs_multi failure_part_way") {
        return;
    }
    let _g = serial();
    use std::os::unix::fs::FileExt;
    let d = scratch("partway");
    let small = d.join("tmpfs");
    std::fs::create_dir_all(&small).unwrap();
    // Room for the bootstrap on the second member (its superblocks; the zeroed ranges
    // are holes in an image file) but not for the engine's RAID1 metadata on it.
    run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=32k", "tmpfs"]).arg(&small));
    let r = std::panic::catch_unwind(|| {
        let new = d.join("new.img");
        let old = small.join("old.img");
        std::fs::File::create(&old).unwrap().set_len(256 * MIB).unwrap();
        let err = fails(bin().args(["mkfs", "--size", "256M"]).arg(&new).arg(&old));
        assert!(err.contains("not usable") && err.contains("No space left on device"), "{err}");
        assert!(!new.exists(), "the image mkfs created was left behind");
        let f = std::fs::File::open(&old).unwrap();
        for off in [65536u64, 64 << 20] {
            let mut magic = [0u8; 8];
            f.read_exact_at(&mut magic, off + 64).unwrap();
            assert_eq!(magic, [0; 8], "a superblock of the half-made filesystem is left at {off}");
        }
    });
    let _ = Command::new("umount").arg(&small).status();
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// `--rootdir` on a RAID1 pair: the kernel reads the tree back, on both members.
#[test]
fn rootdir_on_a_raid1_pair() {
    if !kernel("mkfs_multi rootdir_on_a_raid1_pair") {
        return;
    }
    let _g = serial();
    let d = scratch("rootdir");
    let src = d.join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    run(Command::new("cp").arg("-a").arg("/usr/include/linux").arg(src.join("sub")));
    std::fs::write(src.join("small"), b"hello\n").unwrap();
    std::fs::File::create(src.join("sparse")).unwrap().set_len(10 * MIB).unwrap();
    std::os::unix::fs::symlink("sub/linux", src.join("link")).unwrap();
    let imgs = images(&d, 2);
    run(bin()
        .args(["mkfs", "-q", "--size", "256M", "-d", "raid1", "-m", "raid1", "--rootdir"])
        .arg(&src)
        .args(&imgs));
    let loops = Loops::new(&imgs);
    loops.check("rootdir raid1");
    let mnt = d.join("mnt");
    let m = loops.mount(&mnt);
    let diff =
        Command::new("diff").args(["-r", "--no-dereference"]).arg(&src).arg(&mnt).output().unwrap();
    assert!(
        diff.status.success(),
        "the kernel reads the rootdir back differently: {}",
        String::from_utf8_lossy(&diff.stdout)
    );
    assert_eq!(df_profiles(&mnt), ["Data, RAID1", "Metadata, RAID1", "System, RAID1"]);
    m.umount();
    drop(loops);
    std::fs::remove_dir_all(&d).unwrap();
}

/// `--shrink` over a RAID1 pair: each image file is cut to its own device's size (its
/// superblock's dev_item), the superblock's total is their sum, and the kernel mounts
/// both and reads the tree back.
#[test]
fn shrink_over_a_raid1_pair() {
    if !kernel("mkfs_multi shrink_over_a_raid1_pair") {
        return;
    }
    let _g = serial();
    let d = scratch("shrink");
    let src = d.join("src");
    std::fs::create_dir_all(&src).unwrap();
    run(Command::new("cp").arg("-a").arg("/usr/include/linux").arg(&src));
    let imgs = images(&d, 2);
    run(bin()
        .args(["mkfs", "-q", "--size", "2G", "-d", "raid1", "--shrink", "--rootdir"])
        .arg(&src)
        .args(&imgs));
    let mut sum = 0;
    for p in &imgs {
        let len = std::fs::metadata(p).unwrap().len();
        let sb = superblock(p);
        assert_eq!(
            sb.dev_item.total_bytes.get(),
            len,
            "{}: the file is cut to its device's size",
            p.display()
        );
        assert!(len < 512 * MIB, "{}: {len} bytes after --shrink", p.display());
        sum += len;
    }
    assert_eq!(
        superblock(&imgs[0]).total_bytes.get(),
        sum,
        "the superblock's total is the members' sum"
    );
    let loops = Loops::new(&imgs);
    loops.check("shrink raid1");
    let mnt = d.join("mnt");
    let m = loops.mount(&mnt);
    let diff =
        Command::new("diff").args(["-r", "--no-dereference"]).arg(&src).arg(&mnt).output().unwrap();
    assert!(
        diff.status.success(),
        "the kernel reads the shrunk tree back differently: {}",
        String::from_utf8_lossy(&diff.stdout)
    );
    assert_eq!(df_profiles(&mnt), ["Data, RAID1", "Metadata, RAID1", "System, RAID1"]);
    m.umount();
    drop(loops);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Block devices are used whole, as members like image files; the filesystem's size
/// is theirs summed.
#[test]
fn block_devices_as_members() {
    if !kernel("mkfs_multi block_devices_as_members") {
        return;
    }
    let _g = serial();
    let d = scratch("blockdev");
    let imgs = images(&d, 2);
    for (p, s) in imgs.iter().zip([200 * MIB, 300 * MIB]) {
        std::fs::File::create(p).unwrap().set_len(s).unwrap();
    }
    let loops = Loops::new(&imgs);
    run(bin().args(["mkfs", "-q", "-d", "raid1"]).args(&loops.devs));
    let sb = superblock(Path::new(&loops.devs[1]));
    assert_eq!(sb.total_bytes.get(), 500 * MIB, "both devices whole");
    assert_eq!(sb.dev_item.devid.get(), 2);
    assert_eq!(sb.dev_item.total_bytes.get(), 300 * MIB);
    loops.check("block devices");
    let mnt = d.join("mnt");
    let m = loops.mount(&mnt);
    assert_eq!(df_profiles(&mnt), ["Data, RAID1", "Metadata, RAID1", "System, RAID1"]);
    m.umount();
    drop(loops);
    std::fs::remove_dir_all(&d).unwrap();
}

/// With SOURCE_DATE_EPOCH, two builds over the same number of devices give the same
/// bytes on every member (device UUIDs included), and a different device count gives
/// another fsid.
#[test]
fn reproducible_over_several_devices() {
    let d = scratch("repro");
    let sha = |p: &Path| {
        run(Command::new("sha256sum").arg(p)).split_whitespace().next().unwrap().to_string()
    };
    let build = |tag: &str, n: usize| -> Vec<PathBuf> {
        let imgs: Vec<PathBuf> = (0..n).map(|i| d.join(format!("{tag}{i}.img"))).collect();
        run(bin()
            .env("SOURCE_DATE_EPOCH", "1700000000")
            .args(["mkfs", "-q", "--size", "128M", "-d", "raid1", "-m", "raid1"])
            .args(&imgs));
        imgs
    };
    let a = build("a", 2);
    let b = build("b", 2);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(sha(x), sha(y), "{} and {} differ", x.display(), y.display());
    }
    assert_ne!(
        superblock(&a[0]).dev_item.uuid,
        superblock(&a[1]).dev_item.uuid,
        "members share a device UUID"
    );
    let c = build("c", 3);
    assert_ne!(
        superblock(&a[0]).fsid,
        superblock(&c[0]).fsid,
        "two and three devices gave one fsid"
    );
    std::fs::remove_dir_all(&d).unwrap();
}
