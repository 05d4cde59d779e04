//! `put_contents` as mkfs --rootdir uses it: a host tree copied into the top directory
//! with owners mapped (a rootless build's files made root's), chosen directories made
//! subvolumes, hard links kept inside a tree and split where they would cross one, and
//! the top directory given the source's mode, owner and times. As root: `btrfs check`
//! clean, the kernel sees the owners, the subvolumes and the contents.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use ubtrfs_core::{Engine, FsRead, OpenOptions};
use ubtrfs_tools::offline_engine;
use ubtrfs_tools::populate::tree_digest;
use ubtrfs_tools::put::{put_contents, OwnerMap, PutOptions};

fn kernel() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let progs = Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    let fs =
        std::fs::read_to_string("/proc/filesystems").map(|s| s.contains("btrfs")).unwrap_or(false);
    if root && progs && fs {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "put_contents: needs root, btrfs-progs and the kernel driver, and CI=true forbids skipping"
    );
    eprintln!("put_contents: skipped: needs root ({root}), btrfs-progs ({progs}) and the kernel btrfs driver ({fs})");
    false
}

fn run(c: &mut Command) -> String {
    let o = c.output().unwrap_or_else(|e| panic!("{c:?}: {e}"));
    assert!(o.status.success(), "{c:?}: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn chown(p: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::lchown(p, Some(uid), Some(gid)).unwrap();
}

#[test]
fn rootdir_with_owner_map_and_subvolumes() {
    if !kernel() {
        return;
    }
    let work = std::env::temp_dir().join(format!("ubtrfs-putc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let src = work.join("src");
    std::fs::create_dir_all(src.join("home/user")).unwrap();
    std::fs::create_dir_all(src.join("var/lib")).unwrap();
    std::fs::write(src.join("etc-file"), b"config\n").unwrap();
    std::fs::write(src.join("home/user/notes"), vec![b'n'; 100_000]).unwrap();
    std::fs::write(src.join("var/lib/db"), vec![b'd'; 50_000]).unwrap();
    // Linked inside var/ (stays one inode) and from the top into home/ (a subvolume:
    // split into two files).
    std::fs::hard_link(src.join("var/lib/db"), src.join("var/db-link")).unwrap();
    std::fs::hard_link(src.join("etc-file"), src.join("home/user/etc-link")).unwrap();
    std::os::unix::fs::symlink("../etc-file", src.join("var/cfg")).unwrap();
    for p in [
        "",
        "home",
        "home/user",
        "home/user/notes",
        "var",
        "var/lib",
        "var/lib/db",
        "var/cfg",
        "etc-file",
    ] {
        chown(&src.join(p), 1000, 1000);
    }
    chown(&src.join("home/user/notes"), 100005, 1000);
    std::fs::set_permissions(&src, std::os::unix::fs::PermissionsExt::from_mode(0o750)).unwrap();
    let img = work.join("img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    run(Command::new("mkfs.btrfs").args(["-q", "-f"]).arg(&img));
    let eng = offline_engine(
        Engine::open(&OpenOptions { writable: true, ..OpenOptions::new(&img) }).unwrap(),
    );
    let top = eng.read(|l| Ok(l.root_dir())).unwrap();
    let opts = PutOptions {
        recursive: true,
        owners: OwnerMap::parse("u 1000 0\ng 1000 0\nu 100000 1 65536").unwrap(),
        subvols: vec![src.join("home")],
        progress: None,
        atime_from_mtime: false,
    };
    let stats = put_contents(&eng, &src, top, &opts).unwrap();
    assert_eq!(stats.hardlinks, 1, "{stats:?}");
    // The scan's estimate counts each name of the linked file: every byte written, and
    // the second name of var/lib/db on top.
    assert_eq!(stats.bytes, 7 + 100_000 + 50_000 + 7, "{stats:?}");
    assert_eq!(stats.expected_bytes, 7 + 100_000 + 2 * 50_000 + 7, "{stats:?}");
    // A subvolume outside the source is refused before anything changes.
    let bad = PutOptions { subvols: vec![work.clone()], ..opts.clone() };
    assert!(put_contents(&eng, &src, top, &bad).is_err());
    eng.sync().unwrap();
    drop(eng);
    let c = Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        c.status.success(),
        "btrfs check: {}{}",
        String::from_utf8_lossy(&c.stdout),
        String::from_utf8_lossy(&c.stderr)
    );
    let mnt = work.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    run(Command::new("mount").arg("-o").arg("loop,ro").arg(&img).arg(&mnt));
    let checks = (|| -> Result<(), String> {
        let md = |p: &str| std::fs::symlink_metadata(mnt.join(p)).map_err(|e| format!("{p}: {e}"));
        let top = md("")?;
        if (top.uid(), top.gid(), top.mode() & 0o7777) != (0, 0, 0o750) {
            return Err(format!(
                "top directory: uid {} gid {} mode {:o}",
                top.uid(),
                top.gid(),
                top.mode() & 0o7777
            ));
        }
        for (p, uid) in [("etc-file", 0), ("home/user/notes", 6), ("var/lib/db", 0), ("var/cfg", 0)]
        {
            let m = md(p)?;
            if (m.uid(), m.gid()) != (uid, 0) {
                return Err(format!("{p}: owner {}:{}, expected {uid}:0", m.uid(), m.gid()));
            }
        }
        if md("var/lib/db")?.ino() != md("var/db-link")?.ino() || md("var/db-link")?.nlink() != 2 {
            return Err("the link inside var/ is not one inode of two names".into());
        }
        if md("home/user/etc-link")?.nlink() != 1 || md("etc-file")?.nlink() != 1 {
            return Err("the link across the subvolume is not two files".into());
        }
        if std::fs::read(mnt.join("home/user/etc-link")).map_err(|e| e.to_string())? != b"config\n"
        {
            return Err("the split link lost its contents".into());
        }
        if md("home")?.ino() != 256 {
            return Err(format!("home is not a subvolume top (inode {})", md("home")?.ino()));
        }
        let list = String::from_utf8_lossy(
            &Command::new("btrfs").args(["subvolume", "list"]).arg(&mnt).output().unwrap().stdout,
        )
        .into_owned();
        if !list.lines().any(|l| l.ends_with("path home")) {
            return Err(format!("btrfs subvolume list: {list}"));
        }
        Ok(())
    })();
    let _ = Command::new("umount").arg(&mnt).status();
    let _ = std::fs::remove_dir_all(&work);
    checks.unwrap();
}

/// Build one tree's entries in the given order (so the host's readdir order and inode
/// numbers differ between two builds of the same content), with fixed times.
fn build_tree(root: &Path, reverse: bool) {
    let _ = std::fs::remove_dir_all(root);
    std::fs::create_dir_all(root).unwrap();
    let mut names: Vec<String> = (0..40).map(|i| format!("f{i:02}")).collect();
    if reverse {
        names.reverse();
    }
    let mut dirs = ["a", "b", "c"];
    if reverse {
        dirs.reverse();
    }
    for d in dirs {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for n in &names {
        let k: usize = n[1..].parse().unwrap();
        std::fs::write(root.join(["a", "b", "c"][k % 3]).join(n), vec![k as u8; k * 1000 + 1])
            .unwrap();
    }
    std::fs::hard_link(root.join("a/f00"), root.join("b/link")).unwrap();
    std::os::unix::fs::symlink("a/f03", root.join("sym")).unwrap();
    // Fixed times everywhere, deepest first so a directory's own times come last.
    let out = Command::new("find").arg(root).arg("-depth").output().unwrap();
    for p in String::from_utf8_lossy(&out.stdout).lines() {
        let o = Command::new("touch")
            .args(["-h", "-d", "2024-01-02 03:04:05.678"])
            .arg(p)
            .output()
            .unwrap();
        assert!(o.status.success());
    }
}

/// The same tree from two copies with different readdir order and inode numbers, put
/// into two copies of one image with deterministic clocks and UUIDs, gives the same
/// bytes.
#[test]
fn the_same_tree_gives_the_same_image() {
    if !kernel() {
        return;
    }
    let work = std::env::temp_dir().join(format!("ubtrfs-putrepro-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let base = work.join("base.img");
    std::fs::File::create(&base).unwrap().set_len(256 << 20).unwrap();
    run(Command::new("mkfs.btrfs").args(["-q", "-f"]).arg(&base));
    let base_sum =
        run(Command::new("sha256sum").arg(&base)).split_whitespace().next().unwrap().to_string();
    let mut sums = Vec::new();
    for (i, reverse) in [false, true].into_iter().enumerate() {
        let src = work.join(format!("src{i}"));
        build_tree(&src, reverse);
        let img = work.join(format!("img{i}"));
        std::fs::copy(&base, &img).unwrap();
        let sources = ubtrfs_core::Sources::deterministic(
            ubtrfs_core::Time { sec: 1_700_000_000, nsec: 0 },
            42,
        );
        let eng = offline_engine(
            Engine::open(&OpenOptions { writable: true, sources, ..OpenOptions::new(&img) })
                .unwrap(),
        );
        let top = eng.read(|l| Ok(l.root_dir())).unwrap();
        let opts =
            PutOptions { recursive: true, subvols: vec![src.join("c")], ..Default::default() };
        put_contents(&eng, &src, top, &opts).unwrap();
        eng.sync().unwrap();
        drop(eng);
        let h = run(Command::new("sha256sum").arg(&img));
        sums.push(h.split_whitespace().next().unwrap().to_string());
        let ino = |p: &str| std::fs::metadata(src.join(p)).unwrap().ino();
        eprintln!("build {i}: {} (host inode of a/f00 {})", sums[i], ino("a/f00"));
    }
    let owners = OwnerMap::default();
    let (d0, d1) = (
        tree_digest(&work.join("src0"), &owners).unwrap(),
        tree_digest(&work.join("src1"), &owners).unwrap(),
    );
    assert_eq!(d0, d1, "the digest of two copies of one tree");
    std::fs::set_permissions(
        work.join("src1/a/f00"),
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    assert_ne!(
        d0,
        tree_digest(&work.join("src1"), &owners).unwrap(),
        "a mode change changes the digest"
    );
    assert_ne!(
        d0,
        tree_digest(&work.join("src0"), &OwnerMap::force(5, 5)).unwrap(),
        "the owner map is part of it"
    );
    let _ = std::fs::remove_dir_all(&work);
    assert_ne!(sums[0], base_sum, "the build changed nothing");
    assert_eq!(sums[0], sums[1], "two builds of one tree differ");
}

/// `populate` with a default subvolume: a plain mount shows that subvolume; a default
/// that is not one of the subvolumes made is refused.
#[test]
fn populate_sets_the_default_subvolume() {
    if !kernel() {
        return;
    }
    use ubtrfs_tools::populate::{populate, PopulateOptions};
    let work = std::env::temp_dir().join(format!("ubtrfs-popdef-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let src = work.join("src");
    std::fs::create_dir_all(src.join("@root/etc")).unwrap();
    std::fs::create_dir_all(src.join("plain")).unwrap();
    std::fs::write(src.join("@root/etc/os-release"), b"ID=test\n").unwrap();
    let img = work.join("img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    run(Command::new("mkfs.btrfs").args(["-q", "-f"]).arg(&img));
    let eng = offline_engine(
        Engine::open(&OpenOptions { writable: true, ..OpenOptions::new(&img) }).unwrap(),
    );
    let put =
        PutOptions { recursive: true, subvols: vec![src.join("@root")], ..Default::default() };
    let bad = PopulateOptions { put: put.clone(), default_subvol: Some("/plain".into()) };
    let err = populate(&eng, &src, &bad).expect_err("a directory is not a subvolume");
    assert!(err.to_string().contains("must be one of the subvolumes"), "{err}");
    drop(eng);
    let eng = offline_engine(
        Engine::open(&OpenOptions { writable: true, ..OpenOptions::new(&img) }).unwrap(),
    );
    populate(&eng, &src, &PopulateOptions { put, default_subvol: Some("/@root".into()) }).unwrap();
    eng.sync().unwrap();
    drop(eng);
    let mnt = work.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    run(Command::new("mount").arg("-o").arg("loop,ro").arg(&img).arg(&mnt));
    let got = std::fs::read(mnt.join("etc/os-release"));
    let _ = Command::new("umount").arg(&mnt).status();
    let _ = std::fs::remove_dir_all(&work);
    assert_eq!(got.unwrap(), b"ID=test\n", "a plain mount shows the default subvolume");
}
