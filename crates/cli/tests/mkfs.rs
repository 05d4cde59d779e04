//! `ubtrfs mkfs` end to end. A matrix of options (node sizes 4K/16K/64K, every
//! checksum, single and dup data and metadata, mixed block groups, the block-group
//! tree on and off, label and UUID): the image checks clean with `btrfs check --check-data-csum`, carries the
//! UUID and label asked for, has the same trees, item kinds and chunk kinds as
//! mkfs.btrfs makes with the same options, mounts, takes a copy of /usr/include/linux
//! from the kernel, shows the profiles in `btrfs filesystem df`, checks clean again,
//! and takes a `ubtrfs put`. Bad input is refused with a message naming it, leaving no
//! image behind or the existing one unchanged.

#[path = "common/cmd.rs"]
mod cmd;
use cmd::{bin, fails, run, scratch_in};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

fn scratch(name: &str) -> PathBuf {
    scratch_in("mkfs", name)
}

/// `btrfs check --readonly --check-data-csum`, retried when progs' device scan trips
/// over a loop device another test is detaching (not this image's damage).
fn assert_check(img: &Path, what: &str) {
    for attempt in 0.. {
        let out = Command::new("btrfs")
            .args(["check", "--readonly", "--check-data-csum"])
            .arg(img)
            .output()
            .expect("run btrfs check");
        let text = format!(
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() && text.contains("no error found") && !text.contains("ERROR") {
            return;
        }
        if attempt < 10 && text.contains("cannot scan") {
            std::thread::sleep(std::time::Duration::from_millis(300));
            continue;
        }
        panic!("{what}: btrfs check failed on {}:\n{text}", img.display());
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
        umount(&self.dir);
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if !self.done {
            let _ = Command::new("umount").arg(&self.dir).status();
        }
    }
}

/// A mount (through a loop device for an image file), retried while another test
/// races for the same loop device.
fn mount(img: &Path, dir: &Path) -> Mounted {
    std::fs::create_dir_all(dir).unwrap();
    let opts = if img.starts_with("/dev") { "defaults" } else { "loop" };
    for _ in 0..20 {
        let out = Command::new("mount")
            .args(["-t", "btrfs", "-o", opts])
            .arg(img)
            .arg(dir)
            .output()
            .expect("run mount");
        if out.status.success() {
            return Mounted { dir: dir.to_path_buf(), done: false };
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("failed to setup loop device"), "mount {}: {err}", img.display());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("mount {}: no loop device", img.display());
}

fn umount(dir: &Path) {
    for _ in 0..40 {
        let out = Command::new("umount").arg(dir).output().expect("run umount");
        if out.status.success() {
            return;
        }
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("busy"),
            "umount {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("umount {}: still busy", dir.display());
}

/// The primary superblock, checked by the format crate.
fn superblock(img: &Path) -> ubtrfs_format::structs::Superblock {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(img).unwrap();
    let mut buf = vec![0u8; 4096];
    f.read_exact_at(&mut buf, 65536).unwrap();
    ubtrfs_format::superblock::check_super(&buf, 65536).unwrap()
}

/// What dump-tree shows, without addresses: per tree, the item types (the root tree:
/// named objectid and type), the chunk types, and the trees owning metadata extents.
fn tree_shape(img: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let text = run(Command::new("btrfs").args(["inspect-internal", "dump-tree"]).arg(img));
    let mut shape: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut cur = String::new();
    for line in text.lines() {
        if !line.starts_with(['\t', ' '])
            && (line.ends_with(" tree") || line.contains(" tree key ("))
        {
            cur = line.split(" key (").next().unwrap().trim().to_string();
            shape.entry(cur.clone()).or_default();
            continue;
        }
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("item ") {
            let key =
                rest.split(" key (").nth(1).and_then(|k| k.split(')').next()).unwrap_or_default();
            let parts: Vec<&str> = key.split(' ').collect();
            let what = if cur == "root tree" {
                format!("{} {}", parts[0], parts[1])
            } else {
                parts.get(1).unwrap_or(&"?").to_string()
            };
            shape.get_mut(&cur).unwrap().insert(what);
        } else if let Some(ty) = t.strip_prefix("length ").and_then(|r| r.split(" type ").nth(1)) {
            shape.get_mut(&cur).unwrap().insert(format!("chunk {ty}"));
        } else if let Some(root) = t.strip_prefix("tree block backref root ") {
            shape.get_mut(&cur).unwrap().insert(format!("backref {root}"));
        }
    }
    shape
}

struct Case {
    name: &'static str,
    nodesize: &'static str,
    csum: &'static str,
    data: &'static str,
    metadata: &'static str,
    /// `--features` for ubtrfs; what mkfs.btrfs 6.2 gets is this without
    /// block-group-tree, which it cannot make.
    features: &'static str,
    bg_tree: bool,
    label: Option<&'static str>,
    uuid: Option<&'static str>,
    /// `--mixed` (and `-d` gives the one profile).
    mixed: bool,
}

const CASES: &[Case] = &[
    Case {
        name: "default",
        nodesize: "16K",
        csum: "crc32c",
        data: "single",
        metadata: "dup",
        features: "",
        bg_tree: false,
        label: None,
        uuid: None,
        mixed: false,
    },
    Case {
        name: "n4k-xxhash",
        nodesize: "4K",
        csum: "xxhash",
        data: "dup",
        metadata: "single",
        features: "",
        bg_tree: false,
        label: Some("small nodes"),
        uuid: None,
        mixed: false,
    },
    Case {
        name: "n64k-sha256-bgt",
        nodesize: "64K",
        csum: "sha256",
        data: "single",
        metadata: "dup",
        features: "block-group-tree",
        bg_tree: true,
        label: None,
        uuid: Some("0f4c5390-03e1-46a1-a376-89233a9a63a8"),
        mixed: false,
    },
    Case {
        name: "blake2-single-bgt",
        nodesize: "16K",
        csum: "blake2",
        data: "single",
        metadata: "single",
        features: "block-group-tree,^extref",
        bg_tree: true,
        label: Some("b2"),
        uuid: None,
        mixed: false,
    },
    Case {
        name: "n64k-dup-dup",
        nodesize: "64K",
        csum: "crc32c",
        data: "dup",
        metadata: "dup",
        features: "^no-holes",
        bg_tree: false,
        label: Some("dd"),
        uuid: Some("5d1e9c3a77f04b8e9a3f3c2b1a0e9d8c"),
        mixed: false,
    },
    Case {
        name: "mixed-dup",
        nodesize: "4K",
        csum: "xxhash",
        data: "dup",
        metadata: "dup",
        features: "",
        bg_tree: false,
        label: Some("mixed"),
        uuid: None,
        mixed: true,
    },
];

fn profile_df(p: &str) -> &'static str {
    if p == "dup" {
        "DUP"
    } else {
        "single"
    }
}

fn run_case(c: &Case) {
    let d = scratch(c.name);
    let img = d.join("fs.img");
    let mut cmd = bin();
    cmd.args([
        "mkfs",
        "-q",
        "--size",
        "256M",
        "--nodesize",
        c.nodesize,
        "--csum",
        c.csum,
        "-d",
        c.data,
        "-m",
        c.metadata,
    ]);
    if !c.features.is_empty() {
        cmd.args(["--features", c.features]);
    }
    if c.mixed {
        cmd.arg("--mixed");
    }
    if let Some(l) = c.label {
        cmd.args(["--label", l]);
    }
    if let Some(u) = c.uuid {
        cmd.args(["--uuid", u]);
    }
    run(cmd.arg(&img));
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 256 << 20, "{}: image size", c.name);
    let sb = superblock(&img);
    let nodesize = ubtrfs_tools::mkfs::options::parse_size("n", c.nodesize).unwrap() as u32;
    assert_eq!(sb.nodesize.get(), nodesize, "{}", c.name);
    assert_eq!(
        ubtrfs_format::CsumType::from_raw(sb.csum_type.get()),
        Some(ubtrfs_tools::mkfs::options::parse_csum(c.csum).unwrap()),
        "{}",
        c.name
    );
    let label_len = sb.label.iter().position(|&b| b == 0).unwrap();
    assert_eq!(&sb.label[..label_len], c.label.unwrap_or("").as_bytes(), "{}: label", c.name);
    if let Some(u) = c.uuid {
        assert_eq!(
            sb.fsid,
            ubtrfs_tools::mkfs::options::parse_uuid(u).unwrap(),
            "{}: fsid",
            c.name
        );
        assert_eq!(sb.dev_item.fsid, sb.fsid, "{}: dev item fsid", c.name);
    }
    assert_eq!(
        sb.compat_ro_flags.get() & ubtrfs_format::features::COMPAT_RO_BLOCK_GROUP_TREE != 0,
        c.bg_tree,
        "{}: compat_ro {:#x}",
        c.name,
        sb.compat_ro_flags.get()
    );
    // ubtrfs's own checker and writer take it.
    run(bin().arg("check").arg(&img));
    run(bin().args(["put"]).arg(&img).arg("/etc/hostname").arg("/hostname"));
    if !kernel::kernel_available(&format!("mkfs {}", c.name)) {
        return;
    }
    assert_check(&img, &format!("{} as made", c.name));
    // The same trees, item kinds and chunk kinds as mkfs.btrfs's (before the put).
    let ours_img = d.join("fresh.img");
    let mut cmd = bin();
    cmd.args([
        "mkfs",
        "-q",
        "--size",
        "256M",
        "--nodesize",
        c.nodesize,
        "--csum",
        c.csum,
        "-d",
        c.data,
        "-m",
        c.metadata,
    ]);
    if !c.features.is_empty() {
        cmd.args(["--features", c.features]);
    }
    if c.mixed {
        cmd.arg("--mixed");
    }
    run(cmd.arg(&ours_img));
    let theirs = d.join("progs.img");
    std::fs::File::create(&theirs).unwrap().set_len(256 << 20).unwrap();
    let progs_features: Vec<&str> =
        c.features.split(',').filter(|f| !f.is_empty() && *f != "block-group-tree").collect();
    let mut mk = Command::new("mkfs.btrfs");
    mk.args([
        "-q",
        "-f",
        "--nodesize",
        c.nodesize,
        "--csum",
        c.csum,
        "-d",
        c.data,
        "-m",
        c.metadata,
    ]);
    if !progs_features.is_empty() {
        mk.args(["-O", &progs_features.join(",")]);
    }
    if c.mixed {
        mk.arg("--mixed");
    }
    run(mk.arg(&theirs));
    let mut want = tree_shape(&theirs);
    if c.bg_tree {
        want.get_mut("extent tree").unwrap().remove("BLOCK_GROUP_ITEM");
        want.get_mut("extent tree").unwrap().insert("backref BLOCK_GROUP_TREE".into());
        want.get_mut("root tree").unwrap().insert("BLOCK_GROUP_TREE ROOT_ITEM".into());
        want.insert("block group tree".into(), ["BLOCK_GROUP_ITEM".to_string()].into());
    }
    let got = tree_shape(&ours_img);
    // The comparison is of something: every tree is there with the items that matter.
    let has = |tree: &str, what: &str| got.get(tree).is_some_and(|s| s.contains(what));
    for (tree, what) in [
        ("root tree", "FS_TREE ROOT_ITEM"),
        ("root tree", "UUID_TREE ROOT_ITEM"),
        ("root tree", "DATA_RELOC_TREE ROOT_ITEM"),
        ("root tree", "ROOT_TREE_DIR DIR_ITEM"),
        ("chunk tree", "DEV_ITEM"),
        ("extent tree", "METADATA_ITEM"),
        ("extent tree", "backref FS_TREE"),
        ("device tree", "DEV_EXTENT"),
        ("fs tree", "INODE_REF"),
        ("uuid tree", "UUID_KEY_SUBVOL"),
        ("free space tree", "FREE_SPACE_INFO"),
        ("data reloc tree", "INODE_ITEM"),
    ] {
        assert!(has(tree, what), "{}: {tree} lacks {what}: {got:?}", c.name);
    }
    assert!(got.contains_key("checksum tree"), "{}: no csum tree: {got:?}", c.name);
    let chunks: BTreeSet<&String> =
        got["chunk tree"].iter().filter(|s| s.starts_with("chunk ")).collect();
    assert_eq!(
        chunks.len(),
        if c.mixed { 2 } else { 3 },
        "{}: one chunk kind per type: {chunks:?}",
        c.name
    );
    assert_eq!(got, want, "{}: trees of ubtrfs mkfs vs mkfs.btrfs", c.name);
    // The kernel writes a file tree into it.
    let mnt = d.join("mnt");
    let m = mount(&img, &mnt);
    let copied = Command::new("cp")
        .arg("-a")
        .arg("/usr/include/linux")
        .arg(&mnt)
        .status()
        .unwrap()
        .success();
    let df = Command::new("btrfs").args(["filesystem", "df"]).arg(&mnt).output().unwrap();
    let synced = Command::new("sync").arg("-f").arg(&mnt).status().unwrap().success();
    m.umount();
    assert!(copied && synced, "{}: cp -a into the mount", c.name);
    let df = String::from_utf8_lossy(&df.stdout).into_owned();
    let want: Vec<String> = if c.mixed {
        vec![
            format!("Data+Metadata, {}:", profile_df(c.data)),
            format!("System, {}:", profile_df(c.metadata)),
        ]
    } else {
        vec![
            format!("Data, {}:", profile_df(c.data)),
            format!("Metadata, {}:", profile_df(c.metadata)),
            format!("System, {}:", profile_df(c.metadata)),
        ]
    };
    for line in &want {
        assert!(df.contains(line.as_str()), "{}: btrfs filesystem df lacks {line}:\n{df}", c.name);
    }
    let rows = df
        .lines()
        .filter(|l| l.starts_with("Data") || l.starts_with("Metadata") || l.starts_with("System"))
        .count();
    assert_eq!(rows, want.len(), "{}: one profile per type:\n{df}", c.name);
    assert_check(&img, &format!("{} after the kernel's writes", c.name));
    // And ubtrfs writes after the kernel.
    run(bin().args(["put", "-r"]).arg(&img).arg("/usr/include/asm-generic").arg("/"));
    assert_check(&img, &format!("{} after ubtrfs put", c.name));
    let ls = run(bin().arg("ls").arg(&img).arg("/linux"));
    assert!(ls.contains("types.h"), "{}: the kernel's copy is there: {ls}", c.name);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn matrix_default() {
    run_case(&CASES[0]);
}

#[test]
fn matrix_4k_xxhash_dup_data() {
    run_case(&CASES[1]);
}

#[test]
fn matrix_64k_sha256_bgt_uuid() {
    run_case(&CASES[2]);
}

#[test]
fn matrix_blake2_single_bgt_label() {
    run_case(&CASES[3]);
}

#[test]
fn matrix_64k_dup_dup() {
    run_case(&CASES[4]);
}

#[test]
fn matrix_mixed_dup() {
    run_case(&CASES[5]);
}

fn sha(path: &Path) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    Sha256::digest(std::fs::read(path).unwrap()).to_vec()
}

#[test]
fn bad_input_leaves_no_image() {
    let d = scratch("bad");
    let img = d.join("new.img");
    let cases: &[(&[&str], &str)] = &[
        (&["--size", "16M"], "too small"),
        (&["--size", "256M", "--csum", "md5"], "checksum md5"),
        (&["--size", "256M", "--nodesize", "2K"], "nodesize 2048: invalid argument (smaller than the sectorsize 4096)"),
        (&["--size", "256M", "--nodesize", "128K"], "nodesize 131072"),
        (&["--size", "256M", "--sectorsize", "8K"], "sectorsize 8192"),
        (&["--size", "256M", "-d", "raid1"], "needs at least 2 devices, 1 given"),
        (&["--size", "256M", "-m", "raid1c3"], "needs at least 3 devices, 1 given"),
        (&["--size", "256M", "-m", "raid5"], "RAID5/6"),
        (&["--size", "256M", "--features", "bogus"], "feature bogus"),
        (&["--size", "256M", "--mixed", "--nodesize", "16K"], "nodesize 16384: invalid argument (mixed block groups need it equal to the sectorsize 4096)"),
        (&["--size", "256M", "--mixed", "-d", "single", "-m", "dup"], "data and metadata profiles must be the same"),
        (&["--size", "256M", "--uuid", "not-a-uuid"], "uuid not-a-uuid"),
        (&["--size", "lots"], "size lots"),
        (&[], "give --size"),
    ];
    for (args, want) in cases {
        let err = fails(bin().arg("mkfs").args(*args).arg(&img));
        assert!(err.contains(want), "mkfs {args:?}: {err}");
        assert!(err.starts_with("ubtrfs: error: "), "mkfs {args:?}: {err}");
        assert!(!img.exists(), "mkfs {args:?} left {}", img.display());
    }
    let err = fails(bin().arg("mkfs").arg("--size").arg("256M").arg(&d));
    assert!(err.contains("neither a regular file nor a block device"), "{err}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn existing_signatures_refused_without_force() {
    let d = scratch("sig");
    let img = d.join("old.img");
    let plant = |off: u64, magic: &[u8]| {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(128 << 20).unwrap();
        f.write_all_at(magic, off).unwrap();
    };
    for (off, magic, name) in [
        (1080u64, &[0x53u8, 0xef][..], "ext2"),
        (0, b"XFSB", "xfs"),
        (4086, b"SWAPSPACE2", "swap"),
        (0, b"LUKS\xba\xbe", "crypto_LUKS"),
        (512, b"EFI PART", "GPT"),
        (32769, b"CD001", "iso9660"),
    ] {
        plant(off, magic);
        let before = sha(&img);
        let err = fails(bin().arg("mkfs").arg(&img));
        assert!(
            err.contains("appears to contain") && err.contains(name) && err.contains("--force"),
            "{name}: {err}"
        );
        assert_eq!(sha(&img), before, "{name}: the refused image changed");
    }
    // --force overwrites a GPT's primary and backup headers (the last sector).
    {
        use std::os::unix::fs::FileExt;
        plant(512, b"EFI PART");
        let f = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
        f.write_all_at(b"EFI PART", (128 << 20) - 512).unwrap();
        run(bin().args(["mkfs", "-q", "--force"]).arg(&img));
        let mut b = [0u8; 8];
        let f = std::fs::File::open(&img).unwrap();
        f.read_exact_at(&mut b, 512).unwrap();
        assert_eq!(b, [0; 8], "primary GPT header left");
        f.read_exact_at(&mut b, (128 << 20) - 512).unwrap();
        assert_eq!(b, [0; 8], "backup GPT header left");
        run(bin().arg("check").arg(&img));
    }
    // A btrfs made here is refused the second time, and --force replaces it.
    std::fs::remove_file(&img).unwrap();
    run(bin().args(["mkfs", "-q", "--size", "100M"]).arg(&img));
    let first = superblock(&img).fsid;
    let before = sha(&img);
    let err = fails(bin().arg("mkfs").arg(&img));
    assert!(err.contains("appears to contain btrfs"), "{err}");
    assert_eq!(sha(&img), before);
    // An existing file is used at its size, or grown to --size.
    run(bin().args(["mkfs", "-q", "--force"]).arg(&img));
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 100 << 20);
    assert_eq!(superblock(&img).total_bytes.get(), 100 << 20);
    assert_ne!(superblock(&img).fsid, first, "--force made a new filesystem");
    run(bin().args(["mkfs", "-q", "--force", "--size", "160M"]).arg(&img));
    assert_eq!(std::fs::metadata(&img).unwrap().len(), 160 << 20);
    assert_eq!(superblock(&img).total_bytes.get(), 160 << 20);
    run(bin().arg("check").arg(&img));
    std::fs::remove_dir_all(&d).unwrap();
}

/// A block device is used whole, refused when it holds a filesystem (without
/// --force) or is mounted (even with --force), before anything on it changes.
#[test]
fn block_device_whole_and_in_use() {
    if !kernel::kernel_available("mkfs block_device_whole_and_in_use") {
        return;
    }
    let d = scratch("blockdev");
    let backing = d.join("backing.img");
    std::fs::File::create(&backing).unwrap().set_len(200 << 20).unwrap();
    let dev = run(Command::new("losetup").args(["-f", "--show"]).arg(&backing)).trim().to_string();
    let attached = std::cell::Cell::new(true);
    let detach = || {
        if attached.replace(false) {
            let _ = Command::new("losetup").args(["-d", &dev]).status();
        }
    };
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let out = run(bin().args(["mkfs", &dev]));
        assert!(out.contains("Filesystem size:    200.00MiB"), "{out}");
        assert_eq!(superblock(Path::new(&dev)).total_bytes.get(), 200 << 20, "the whole device");
        assert_check(Path::new(&dev), "mkfs on a block device");
        let err = fails(bin().args(["mkfs", &dev]));
        assert!(err.contains("appears to contain btrfs"), "{err}");
        let err = fails(bin().args(["mkfs", "--size", "300M", "--force", &dev]));
        assert!(err.contains("larger than the device"), "{err}");
        let mnt = d.join("mnt");
        let m = mount(Path::new(&dev), &mnt);
        let err = fails(bin().args(["mkfs", "--force", &dev]));
        m.umount();
        assert!(err.contains("busy"), "{err}");
        assert!(!err.contains("not usable"), "refused before writing: {err}");
        assert_check(Path::new(&dev), "after a refused mkfs of the mounted device");
        detach();
        let m = mount(&backing, &mnt);
        let err = fails(bin().args(["mkfs", "--force", "--size", "250M"]).arg(&backing));
        m.umount();
        assert!(err.contains("busy"), "{err}");
        assert_eq!(
            std::fs::metadata(&backing).unwrap().len(),
            200 << 20,
            "a refused mkfs grew the mounted image"
        );
        assert_check(&backing, "after a refused mkfs of the mounted image");
    }));
    detach();
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

/// A mkfs that fails once it has begun writing (the host filesystem is full) removes
/// the image it created, and names an existing one as not usable.
#[test]
fn failure_after_writing_began() {
    if !kernel::kernel_available("mkfs failure_after_writing_began") {
        return;
    }
    let d = scratch("full");
    let small = d.join("tmpfs");
    std::fs::create_dir_all(&small).unwrap();
    run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=64k", "tmpfs"]).arg(&small));
    let r = std::panic::catch_unwind(|| {
        let img = small.join("new.img");
        let err = fails(bin().args(["mkfs", "--size", "256M"]).arg(&img));
        assert!(err.contains("No space left on device"), "{err}");
        assert!(!img.exists(), "the half-written image it created was left behind");
        std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
        let err = fails(bin().arg("mkfs").arg(&img));
        assert!(
            err.contains("is not usable, mkfs failed after it began writing")
                && err.contains("No space left on device"),
            "{err}"
        );
        assert!(img.exists(), "an existing image is not removed");
    });
    umount(&small);
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
    // Room for the bootstrap (its leaves and superblocks; the zeroed ranges are holes
    // in an image file and take none) but not for the engine's first commit: the
    // failure comes after a valid superblock was written, and mkfs zeroes it again.
    run(Command::new("mount").args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"]).arg(&small));
    let r = std::panic::catch_unwind(|| {
        use std::os::unix::fs::FileExt;
        let img = small.join("old.img");
        std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
        let err = fails(bin().arg("mkfs").arg(&img));
        assert!(err.contains("is not usable") && err.contains("No space left on device"), "{err}");
        assert!(
            err.contains("write of 16384 bytes"),
            "the failure is the engine's tree block write, after the bootstrap: {err}"
        );
        let f = std::fs::File::open(&img).unwrap();
        for off in [65536u64, 64 << 20] {
            let mut magic = [0u8; 8];
            f.read_exact_at(&mut magic, off + 64).unwrap();
            assert_eq!(magic, [0; 8], "a superblock of the half-made filesystem is left at {off}");
        }
    });
    umount(&small);
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
    std::fs::remove_dir_all(&d).unwrap();
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

/// A source tree with what `--rootdir` must keep: nested directories, empty, inline,
/// multi-extent and sparse files, a hard link, symlinks, a fifo, a device node, user
/// and security xattrs, owners and modes, and a directory for a subvolume.
fn rootdir_source(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    for d in ["etc", "usr/share/doc", "@home/user/.config", "empty"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::write(dir.join("etc/hostname"), b"image\n").unwrap();
    std::fs::write(dir.join("etc/empty"), b"").unwrap();
    let mut x = 0x1234_5678_9abc_def1u64;
    let big: Vec<u8> = (0..3_000_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(dir.join("usr/share/doc/big"), &big).unwrap();
    let f = std::fs::File::create(dir.join("usr/sparse")).unwrap();
    f.set_len(300 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, b"one byte island", 150 << 20).unwrap();
    std::fs::hard_link(dir.join("etc/hostname"), dir.join("usr/hostname-link")).unwrap();
    std::os::unix::fs::symlink("../etc/hostname", dir.join("usr/rel-link")).unwrap();
    std::os::unix::fs::symlink("/nowhere", dir.join("dangling")).unwrap();
    std::fs::write(dir.join("@home/user/.config/rc"), b"set -o vi\n").unwrap();
    run(Command::new("mkfifo").arg(dir.join("fifo")));
    run(Command::new("mknod").arg(dir.join("null")).args(["c", "1", "3"]));
    run(Command::new("setfattr")
        .args(["-n", "user.note", "-v", "kept"])
        .arg(dir.join("etc/hostname")));
    run(Command::new("setfattr")
        .args(["-n", "security.test", "-v", "secret"])
        .arg(dir.join("usr/share/doc/big")));
    std::os::unix::fs::chown(dir.join("@home/user"), Some(1000), Some(1000)).unwrap();
    std::os::unix::fs::chown(dir.join("@home/user/.config/rc"), Some(1000), Some(100)).unwrap();
    std::fs::set_permissions(
        dir.join("etc/hostname"),
        std::os::unix::fs::PermissionsExt::from_mode(0o640),
    )
    .unwrap();
}

fn manifest(dir: &Path) -> String {
    run(Command::new("python3").arg(repo().join("xtask/fixtures.py")).arg("manifest").arg(dir))
}

/// `--rootdir` with a subvolume and a default subvolume: the kernel sees the source
/// exactly (contents, holes, modes, owners, times, xattrs, links, special files), the
/// subvolume in `btrfs subvolume list`, and the default as a plain mount; the sparse
/// 300 MiB file takes a few KiB; btrfs check is clean.
#[test]
fn rootdir_with_subvolumes() {
    if !kernel::kernel_available("rootdir_with_subvolumes") {
        return;
    }
    let d = scratch("rootdir");
    let src = d.join("src");
    rootdir_source(&src);
    let want = manifest(&src);
    let img = d.join("img");
    let out = run(bin()
        .args(["mkfs", "--size", "512M", "--rootdir"])
        .arg(&src)
        .args(["--subvol", "@home", "--default-subvol", "@home", "--compress", "zstd"])
        .arg(&img));
    assert!(out.contains("Copied:"), "{out}");
    assert_check(&img, "after mkfs --rootdir");
    let mnt = d.join("mnt");
    // The default subvolume first (read-only mounts: reads leave the atimes alone).
    std::fs::create_dir_all(&mnt).unwrap();
    let out = Command::new("mount")
        .args(["-t", "btrfs", "-o", "loop,ro"])
        .arg(&img)
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let m = Mounted { dir: mnt.clone(), done: false };
    assert_eq!(
        std::fs::read(mnt.join("user/.config/rc")).unwrap(),
        b"set -o vi\n",
        "a plain mount shows @home"
    );
    m.umount();
    let out = Command::new("mount")
        .args(["-t", "btrfs", "-o", "loop,ro,subvolid=5"])
        .arg(&img)
        .arg(&mnt)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let m = Mounted { dir: mnt.clone(), done: false };
    let got = manifest(&mnt);
    let list = run(Command::new("btrfs").args(["subvolume", "list"]).arg(&mnt));
    let sparse_blocks = std::fs::metadata(mnt.join("usr/sparse"))
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m))
        .unwrap();
    m.umount();
    let (w, g) = (d.join("want.jsonl"), d.join("got.jsonl"));
    std::fs::write(&w, &want).unwrap();
    std::fs::write(&g, &got).unwrap();
    // Block counts, inode numbers and directory sizes are the filesystem's own; @home
    // is a subvolume on one side only. (ctime: the copy's.)
    let diff = Command::new("python3")
        .arg(repo().join("xtask/fixtures.py"))
        .args([
            "diff",
            "--ignore-keys",
            "ino,blocks,subvol,ctime_ns",
            "--ignore-dir-keys",
            "size,nlink",
            "--ignore-paths",
            "^(/|\\.)?$",
        ])
        .arg(&w)
        .arg(&g)
        .output()
        .unwrap();
    assert!(
        diff.status.success(),
        "the kernel's view differs from the source:\n{}{}",
        String::from_utf8_lossy(&diff.stdout),
        String::from_utf8_lossy(&diff.stderr)
    );
    assert!(list.lines().any(|l| l.ends_with("path @home")), "{list}");
    assert!(sparse_blocks * 512 < 1 << 20, "the sparse file takes {} bytes", sparse_blocks * 512);
    let _ = std::fs::remove_dir_all(&d);
}

/// With SOURCE_DATE_EPOCH (or --reproducible), two copies of one tree, with different
/// inode numbers and readdir order and read at different times, give identical
/// images; another label gives another image. The owners come out as --force-owner
/// says.
#[test]
fn reproducible_from_two_copies() {
    if !kernel::kernel_available("reproducible_from_two_copies") {
        return;
    }
    let d = scratch("repro");
    let a = d.join("a");
    // The copy on another host filesystem where there is one (tmpfs): other directory
    // sizes (tmpfs counts entries, ext4 says 4096), which the image does not hold.
    let shm = Path::new("/dev/shm");
    let b = if shm.is_dir() {
        shm.join(format!("ubtrfs-repro-b-{}", std::process::id()))
    } else {
        d.join("b")
    };
    rootdir_source(&a);
    let _ = std::fs::remove_dir_all(&b);
    std::fs::create_dir_all(&b).unwrap();
    // A copy has other inode numbers and, depending on the host filesystem, another
    // readdir order (crates/tools/tests/put_contents.rs builds two orders on purpose).
    run(Command::new("cp").arg("-a").arg(format!("{}/.", a.display())).arg(&b));
    let sum = |p: &Path| -> String {
        run(Command::new("sha256sum").arg(p)).split_whitespace().next().unwrap().to_string()
    };
    let mk = |src: &Path, img: &Path, label: &str, env: bool| {
        let mut c = bin();
        c.args([
            "mkfs",
            "-q",
            "--size",
            "400M",
            "--label",
            label,
            "--force-owner",
            "0:0",
            "--subvol",
            "@home",
            "--rootdir",
        ])
        .arg(src)
        .arg(img);
        if env {
            c.env("SOURCE_DATE_EPOCH", "1700000000");
        } else {
            c.env_remove("SOURCE_DATE_EPOCH").arg("--reproducible");
        }
        run(&mut c);
    };
    let imgs: Vec<PathBuf> = (0..4).map(|i| d.join(format!("img{i}"))).collect();
    mk(&a, &imgs[0], "L", true);
    mk(&b, &imgs[1], "L", true);
    mk(&a, &imgs[2], "other", true);
    mk(&b, &imgs[3], "L", false);
    assert_eq!(sum(&imgs[0]), sum(&imgs[1]), "two copies of one tree");
    assert_ne!(sum(&imgs[0]), sum(&imgs[2]), "another label");
    assert_ne!(sum(&imgs[0]), sum(&imgs[3]), "another epoch (0 for --reproducible alone)");
    assert_check(&imgs[0], "reproducible image");
    let mnt = d.join("mnt");
    let m = mount(&imgs[0], &mnt);
    let owners: Vec<(u32, u32)> = ["@home/user", "@home/user/.config/rc", "etc/hostname"]
        .iter()
        .map(|p| {
            std::fs::symlink_metadata(mnt.join(p))
                .map(|m| {
                    (
                        std::os::unix::fs::MetadataExt::uid(&m),
                        std::os::unix::fs::MetadataExt::gid(&m),
                    )
                })
                .unwrap()
        })
        .collect();
    m.umount();
    assert!(owners.iter().all(|&o| o == (0, 0)), "--force-owner 0:0: {owners:?}");
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_dir_all(&b);
}

/// Bad --rootdir companions are refused before anything is made, naming the option.
#[test]
fn rootdir_bad_input() {
    let d = scratch("rootdir-bad");
    let src = d.join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("file"), b"x").unwrap();
    let img = d.join("img");
    for (args, says) in [
        (vec!["--rootdir", "/nonexistent-ubtrfs"], "--rootdir"),
        (vec!["--rootdir", src.join("file").to_str().unwrap()], "not a directory"),
        (vec!["--rootdir", src.to_str().unwrap(), "--subvol", "missing"], "--subvol missing"),
        (vec!["--rootdir", src.to_str().unwrap(), "--subvol", "../x"], "without . or .."),
        (
            vec!["--rootdir", src.to_str().unwrap(), "--subvol", "sub", "--default-subvol", "file"],
            "--default-subvol",
        ),
        (vec!["--rootdir", src.to_str().unwrap(), "--force-owner", "root"], "UID:GID"),
        (vec!["--rootdir", src.to_str().unwrap(), "--compress", "gzip"], "compression"),
        (vec!["--subvol", "sub"], "--rootdir"),
    ] {
        let e = fails(bin().args(["mkfs", "--size", "256M"]).args(&args).arg(&img));
        assert!(e.contains(says), "{args:?}: {e}");
        assert!(!img.exists(), "{args:?} left an image");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// `--shrink`: the image file ends where the last chunk does (the superblock's
/// total_bytes), well below the size asked for; it checks clean, mounts with the
/// tree, and the kernel can still write into it. The zeroed ranges of a new image are
/// holes: an empty 100 GiB image takes less than 2 MiB of host space.
#[test]
fn shrink_and_holes() {
    if !kernel::kernel_available("mkfs shrink_and_holes") {
        return;
    }
    let d = scratch("shrink");
    let src = d.join("src");
    rootdir_source(&src);
    let img = d.join("img");
    run(bin().args(["mkfs", "-q", "--size", "4G", "--shrink", "--rootdir"]).arg(&src).arg(&img));
    let len = std::fs::metadata(&img).unwrap().len();
    let sb = superblock(&img);
    assert_eq!(sb.total_bytes.get(), len, "the file is cut to the filesystem's size");
    assert_eq!(sb.dev_item.total_bytes.get(), len, "the device item says so too");
    assert!(len < 256 << 20, "a few MiB of files made a {len}-byte image");
    assert_check(&img, "after --shrink");
    let mnt = d.join("mnt");
    let m = mount(&img, &mnt);
    assert_eq!(std::fs::read(mnt.join("etc/hostname")).unwrap(), b"image\n");
    std::fs::write(mnt.join("more"), vec![5u8; 1 << 20]).unwrap();
    m.umount();
    assert_check(&img, "after the kernel wrote into the shrunk image");
    let empty = d.join("empty");
    run(bin().args(["mkfs", "-q", "--size", "100G"]).arg(&empty));
    let used = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&empty).unwrap()) * 512;
    assert!(used < 2 << 20, "an empty 100 GiB image takes {used} bytes of host space");
    assert_check(&empty, "empty 100 GiB");
    let _ = std::fs::remove_dir_all(&d);
}

/// The kernel writes a further 1 GiB into an image ubtrfs made (new chunks of its own
/// on top of ours), deletes it, and the image checks clean after each step.
#[test]
fn the_kernel_writes_a_gib_on_top() {
    if !kernel::kernel_available("mkfs the_kernel_writes_a_gib_on_top") {
        return;
    }
    let d = scratch("gib");
    let img = d.join("img");
    run(bin().args(["mkfs", "-q", "--size", "3G"]).arg(&img));
    let mnt = d.join("mnt");
    let m = mount(&img, &mnt);
    {
        use std::io::Write;
        let mut f = std::fs::File::create(mnt.join("gib")).unwrap();
        let block: Vec<u8> =
            (0..1 << 20).map(|i: u32| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
        for i in 0..1024u32 {
            let mut b = block.clone();
            b[..4].copy_from_slice(&i.to_le_bytes());
            f.write_all(&b).unwrap();
        }
        f.sync_all().unwrap();
    }
    m.umount();
    assert_check(&img, "after the kernel wrote 1 GiB");
    let m = mount(&img, &mnt);
    std::fs::remove_file(mnt.join("gib")).unwrap();
    m.umount();
    assert_check(&img, "after the kernel deleted it");
    let _ = std::fs::remove_dir_all(&d);
}

/// Chunk lengths per block-group type ("DATA|single" -> bytes), from dump-tree.
fn chunk_space(img: &Path) -> BTreeMap<String, u64> {
    let out =
        run(Command::new("btrfs").args(["inspect-internal", "dump-tree", "-t", "chunk"]).arg(img));
    let mut m = BTreeMap::new();
    for l in out.lines().filter(|l| l.contains(" length ") && l.contains(" type ")) {
        let f: Vec<&str> = l.split_whitespace().collect();
        let len: u64 = f[1].parse().unwrap();
        *m.entry(f[7].to_string()).or_insert(0) += len;
    }
    m
}

/// An empty ubtrfs mkfs allocates no more chunk space of any type than mkfs.btrfs
/// does for the same size.
#[test]
fn no_more_chunk_space_than_mkfs_btrfs() {
    if !kernel::kernel_available("mkfs no_more_chunk_space_than_mkfs_btrfs") {
        return;
    }
    let d = scratch("chunkspace");
    for size in ["256M", "1G", "20G"] {
        let (ours, theirs) = (d.join(format!("ours-{size}")), d.join(format!("theirs-{size}")));
        run(bin().args(["mkfs", "-q", "--size", size]).arg(&ours));
        std::fs::File::create(&theirs).unwrap().set_len(options_size(size)).unwrap();
        run(Command::new("mkfs.btrfs").args(["-q", "-f"]).arg(&theirs));
        let (o, t) = (chunk_space(&ours), chunk_space(&theirs));
        assert_eq!(
            o.keys().collect::<Vec<_>>(),
            t.keys().collect::<Vec<_>>(),
            "{size}: chunk types"
        );
        for (ty, bytes) in &o {
            assert!(*bytes <= t[ty], "{size}: {ty}: ubtrfs {bytes} bytes, mkfs.btrfs {}", t[ty]);
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

fn options_size(s: &str) -> u64 {
    let (n, unit) = s.split_at(s.len() - 1);
    n.parse::<u64>().unwrap() << if unit == "G" { 30 } else { 20 }
}

/// An entry of --rootdir that cannot be read (mkfs run by an unprivileged user, as a
/// rootless build is, over a file mode 000) fails mkfs with an error naming the entry,
/// and the image it was creating is gone.
#[test]
fn unreadable_rootdir_entry_is_named() {
    if !kernel::kernel_available_with(
        "mkfs unreadable_rootdir_entry_is_named",
        &["/usr/bin/setpriv"],
    ) {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let d = scratch("unreadable");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).unwrap();
    let src = d.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("open"), b"readable\n").unwrap();
    std::fs::write(src.join("locked"), b"secret\n").unwrap();
    std::fs::set_permissions(src.join("locked"), std::fs::Permissions::from_mode(0o000)).unwrap();
    // The binary where the unprivileged user can run it.
    let exe = d.join("ubtrfs");
    std::fs::copy(env!("CARGO_BIN_EXE_ubtrfs"), &exe).unwrap();
    let img = d.join("img");
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&exe)
        .args(["mkfs", "-q", "--size", "256M", "--rootdir"])
        .arg(&src)
        .arg(&img)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "mkfs over an unreadable entry succeeded");
    assert!(
        err.contains(&format!("{}", src.join("locked").display()))
            && err.contains("Permission denied"),
        "{err}"
    );
    assert!(!img.exists(), "the image mkfs was creating is left behind");
    let _ = std::fs::remove_dir_all(&d);
}
