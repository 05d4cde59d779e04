//! `ubtrfs put` and `ubtrfs rm` end to end: copy a host tree in, check it with
//! `btrfs check` and a kernel mount (diff-walk against the source tree), remove parts,
//! check again. Without root, a fixture copy is used and the result is read back with
//! `ubtrfs ls/cat` instead of the kernel.

#[path = "common/cmd.rs"]
mod cmd;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ubtrfs"))
}

fn run(cmd: &mut Command) -> std::process::Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `umount`, retried while the target is busy: a child another test thread starts
/// shares this process's descriptors until it execs.
fn umount(mnt: &Path) {
    for _ in 0..40 {
        let o = Command::new("umount").arg(mnt).output().expect("run umount");
        if o.status.success() {
            return;
        }
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("busy"),
            "umount {}: {}",
            mnt.display(),
            String::from_utf8_lossy(&o.stderr)
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("umount {}: still busy", mnt.display());
}

fn root_with_kernel() -> bool {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false);
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
        "put_rm: needs root, btrfs-progs and the kernel driver, and CI=true forbids skipping"
    );
    eprintln!("put_rm: kernel checks skipped: needs root ({root}), btrfs-progs ({progs}) and the kernel btrfs driver ({fs})");
    false
}

/// A deterministic source tree: nested dirs, empty/inline/multi-extent files, a hard link.
fn make_source(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir.join("a/b/c")).unwrap();
    std::fs::create_dir_all(dir.join("empty")).unwrap();
    let mut seed = 0;
    let mut bytes = |n: usize| {
        seed += 1;
        cmd::pseudo_random(seed, n)
    };
    for (p, n) in [
        ("zero", 0),
        ("one", 1),
        ("inline", 2047),
        ("edge", 4096),
        ("a/mid", 100_000),
        ("a/b/big", 3_000_000),
        ("a/b/c/deep", 5000),
    ] {
        std::fs::write(dir.join(p), bytes(n)).unwrap();
    }
    for i in 0..300 {
        std::fs::write(dir.join(format!("a/many-{i:04}")), format!("file {i}\n")).unwrap();
    }
    std::fs::hard_link(dir.join("a/mid"), dir.join("a/b/mid-link")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.join("a/b/big"), std::fs::Permissions::from_mode(0o600)).unwrap();
    // Symlinks: relative, absolute, dangling, long, and a hard-linked one.
    std::fs::create_dir_all(dir.join("links")).unwrap();
    std::os::unix::fs::symlink("../a/mid", dir.join("links/rel")).unwrap();
    std::os::unix::fs::symlink("/etc/hostname", dir.join("links/abs")).unwrap();
    std::os::unix::fs::symlink("nowhere/at/all", dir.join("links/dangling")).unwrap();
    std::os::unix::fs::symlink("x".repeat(3000), dir.join("links/long")).unwrap();
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: plain syscalls on NUL-terminated paths.
    unsafe {
        assert_eq!(
            libc::linkat(
                libc::AT_FDCWD,
                c(&dir.join("links/rel")).as_ptr(),
                libc::AT_FDCWD,
                c(&dir.join("links/rel-hard")).as_ptr(),
                0
            ),
            0,
            "link a symlink"
        );
        assert_eq!(libc::mkfifo(c(&dir.join("fifo")).as_ptr(), 0o640), 0, "mkfifo");
        if libc::geteuid() == 0 {
            assert_eq!(
                libc::mknod(
                    c(&dir.join("null")).as_ptr(),
                    libc::S_IFCHR | 0o666,
                    libc::makedev(1, 3)
                ),
                0,
                "mknod"
            );
            assert_eq!(
                libc::mknod(
                    c(&dir.join("disk")).as_ptr(),
                    libc::S_IFBLK | 0o600,
                    libc::makedev(259, 70000)
                ),
                0,
                "mknod"
            );
        }
    }
    // Extended attributes of several namespaces (trusted.* needs root).
    let setx = |p: &Path, n: &str, v: &[u8]| {
        let (cp, cn) = (c(p), std::ffi::CString::new(n).unwrap());
        // SAFETY: plain syscall on NUL-terminated strings and a live buffer.
        let r = unsafe { libc::lsetxattr(cp.as_ptr(), cn.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
        assert_eq!(r, 0, "setxattr {n} on {}: {}", p.display(), std::io::Error::last_os_error());
    };
    setx(&dir.join("a/mid"), "user.origin", b"put test");
    setx(&dir.join("a/mid"), "user.empty", b"");
    setx(&dir.join("a"), "user.dir", &[0, 1, 2, 255]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        setx(&dir.join("inline"), "trusted.secret", b"root only");
        setx(&dir.join("links/rel"), "trusted.on-a-link", b"x");
    }
    let sock = std::os::unix::net::UnixListener::bind(dir.join("sock")).unwrap();
    drop(sock);
    // Sparse: 300 MiB holding 2 bytes, and a file with data, a hole, data.
    let f = std::fs::File::create(dir.join("sparse")).unwrap();
    f.set_len(300 << 20).unwrap();
    use std::os::unix::fs::FileExt;
    f.write_all_at(b"x", 100 << 20).unwrap();
    f.write_all_at(b"y", (300 << 20) - 1).unwrap();
    let f = std::fs::File::create(dir.join("holey")).unwrap();
    f.write_all_at(&bytes(70_000), 0).unwrap();
    f.write_all_at(&bytes(5000), 10 << 20).unwrap();
    f.set_len(12 << 20).unwrap();
}

#[test]
fn put_then_rm_round_trip() {
    let work = std::env::temp_dir().join(format!("ubtrfs-putrm-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let src = work.join("src");
    make_source(&src);
    let kernel = root_with_kernel();
    let img = work.join("img");
    if kernel {
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(512 << 20).unwrap();
        run(Command::new("mkfs.btrfs").arg("-q").arg("-f").arg(&img));
    } else {
        let fx = repo().join("tests/fixtures/blake2.0.img.zst");
        let input = std::fs::File::open(fx).unwrap();
        let mut out = std::fs::File::create(&img).unwrap();
        std::io::copy(&mut zstd::stream::read::Decoder::new(input).unwrap(), &mut out).unwrap();
    }
    // The source's view before put: reading it for the copy updates its atimes, and
    // put keeps the atimes it saw (like cp -a).
    let script = repo().join("xtask/fixtures.py");
    let src_manifest = if kernel {
        Some(run(Command::new("python3").arg(&script).arg("manifest").arg(&src)).stdout)
    } else {
        None
    };
    run(bin().arg("put").arg("-r").arg(&img).arg(&src).arg("/copy"));
    // put refuses to overwrite and a directory without -r.
    let o = bin().arg("put").arg(&img).arg(&src).arg("/other").output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("use -r"), "{o:?}");
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(e.matches("is a directory").count(), 1, "the error repeats itself: {e}");
    assert_eq!(e.lines().count(), 1, "one line: {e}");
    // A name taken by another type is refused, naming it; an existing directory takes
    // the copy inside it, as cp -a does.
    let o =
        bin().arg("put").arg(&img).arg(src.join("links/rel")).arg("/copy/one").output().unwrap();
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("one: file exists"),
        "{o:?}"
    );
    let o = bin().arg("put").arg("-r").arg(&img).arg(&src).arg("/copy/zero").output().unwrap();
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not a directory"),
        "{o:?}"
    );
    let o = bin()
        .arg("put")
        .arg(&img)
        .arg(src.join("one"))
        .arg(src.join("zero"))
        .arg("/copy/inline")
        .output()
        .unwrap();
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("several sources"),
        "{o:?}"
    );
    let o = bin().arg("put").arg(&img).arg(src.join("one")).arg("/copy/new-dir/").output().unwrap();
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("not a directory"),
        "{o:?}"
    );
    run(bin().arg("mkdir").arg(&img).arg("/into"));
    run(bin().arg("put").arg("-r").arg(&img).arg(src.join("a")).arg(src.join("one")).arg("/into"));
    let ls = run(bin().arg("ls").arg(&img).arg("/into"));
    assert_eq!(String::from_utf8_lossy(&ls.stdout).lines().collect::<Vec<_>>(), ["a", "one"]);
    run(bin().arg("rm").arg("-r").arg(&img).arg("/into"));
    // Read back with ubtrfs.
    let cat = run(bin().arg("cat").arg(&img).arg("/copy/a/b/big"));
    assert_eq!(cat.stdout, std::fs::read(src.join("a/b/big")).unwrap());
    let ls = run(bin().arg("ls").arg(&img).arg("/copy/a"));
    assert_eq!(
        String::from_utf8_lossy(&ls.stdout).lines().filter(|l| l.starts_with("many-")).count(),
        300
    );
    if kernel {
        run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&img));
        let mnt = work.join("mnt");
        std::fs::create_dir_all(&mnt).unwrap();
        run(Command::new("mount").arg("-o").arg("loop,ro").arg(&img).arg(&mnt));
        let b = run(Command::new("python3").arg(&script).arg("manifest").arg(mnt.join("copy")));
        umount(&mnt);
        std::fs::write(work.join("a.jsonl"), src_manifest.as_ref().expect("taken when kernel"))
            .unwrap();
        std::fs::write(work.join("b.jsonl"), &b.stdout).unwrap();
        let d = Command::new("python3")
            .arg(&script)
            .arg("diff")
            .arg(work.join("a.jsonl"))
            .arg(work.join("b.jsonl"))
            .args(["--ignore-keys", "ino,blocks,subvol", "--ignore-dir-keys", "size,nlink"])
            .output()
            .unwrap();
        assert!(
            d.status.success(),
            "kernel view differs from the source:\n{}",
            String::from_utf8_lossy(&d.stdout)
        );
        // Sparse stays sparse: 300 MiB holding two bytes takes two blocks (plus slack).
        run(Command::new("mount").arg("-o").arg("loop,ro").arg(&img).arg(&mnt));
        use std::os::unix::fs::MetadataExt;
        let blocks = std::fs::metadata(mnt.join("copy/sparse")).unwrap().blocks();
        let holey = std::fs::metadata(mnt.join("copy/holey")).unwrap().blocks();
        umount(&mnt);
        assert!(blocks * 512 <= 64 << 10, "the sparse file takes {} bytes", blocks * 512);
        assert!(holey * 512 <= 128 << 10, "the holey file takes {} bytes", holey * 512);
    }
    run(bin().arg("rm").arg("-r").arg(&img).arg("/copy/a/b"));
    let o = bin().arg("rm").arg(&img).arg("/copy/a").output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("use -r"), "{o:?}");
    run(bin().arg("rm").arg(&img).arg("/copy/edge"));
    let ls = run(bin().arg("ls").arg(&img).arg("/copy"));
    let names: Vec<String> =
        String::from_utf8_lossy(&ls.stdout).lines().map(str::to_string).collect();
    assert_eq!(
        names,
        vec![
            "a", "disk", "empty", "fifo", "holey", "inline", "links", "null", "one", "sock",
            "sparse", "zero"
        ]
        .into_iter()
        .filter(|n| kernel || !["disk", "null"].contains(n))
        .collect::<Vec<_>>()
    );
    let o = bin().arg("cat").arg(&img).arg("/copy/a/b/big").output().unwrap();
    assert!(!o.status.success());
    // The hard link's other name survives with its data.
    let cat = run(bin().arg("cat").arg(&img).arg("/copy/a/mid"));
    assert_eq!(cat.stdout, std::fs::read(src.join("a/mid")).unwrap());
    if kernel {
        run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&img));
        let mnt = work.join("mnt");
        run(Command::new("mount").arg("-o").arg("loop").arg(&img).arg(&mnt));
        let st = std::fs::metadata(mnt.join("copy/a/mid")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(st.nlink(), 1);
        std::fs::write(mnt.join("copy/kernel-wrote"), b"k").unwrap();
        umount(&mnt);
        run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&img));
        run(bin().arg("rm").arg(&img).arg("/copy/kernel-wrote"));
        run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&img));
    }
    let _ = std::fs::remove_dir_all(&work);
}

fn sha256(p: &Path) -> String {
    let o = run(Command::new("sha256sum").arg(p));
    String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap_or_default().to_string()
}

/// A read-only snapshot made by the kernel (`btrfs subvolume snapshot -r`) refuses
/// every write path with EROFS naming the subvolume, and the image stays
/// byte-identical; a writable sibling still takes changes.
#[test]
fn kernel_readonly_snapshot_is_refused() {
    if !root_with_kernel() {
        return;
    }
    let work = std::env::temp_dir().join(format!("ubtrfs-rosnap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(work.join("mnt")).unwrap();
    let src = work.join("src");
    make_source(&src);
    let img = work.join("img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    run(Command::new("mkfs.btrfs").arg("-q").arg("-f").arg(&img));
    let mnt = work.join("mnt");
    run(Command::new("mount").arg("-o").arg("loop").arg(&img).arg(&mnt));
    run(Command::new("btrfs").args(["subvolume", "create"]).arg(mnt.join("sv")));
    run(Command::new("cp").arg("-a").arg(src.join("a")).arg(mnt.join("sv/a")));
    std::fs::write(mnt.join("sv/file"), b"in the snapshot").unwrap();
    run(Command::new("btrfs")
        .args(["subvolume", "snapshot", "-r"])
        .arg(mnt.join("sv"))
        .arg(mnt.join("snap-ro")));
    umount(&mnt);
    let before = sha256(&img);
    let refused: [&[&str]; 6] = [
        &["put", "IMG", "/etc/hostname", "/snap-ro/x"],
        &["put", "-r", "IMG", "SRC", "/snap-ro/tree"],
        &["put", "IMG", "/etc/hostname", "/snap-ro/a/b/new"],
        &["rm", "IMG", "/snap-ro/file"],
        &["rm", "-r", "IMG", "/snap-ro/a"],
        &["rm", "IMG", "/snap-ro/a/b/c/deep"],
    ];
    for args in refused {
        let mut c = bin();
        for a in args {
            match *a {
                "IMG" => c.arg(&img),
                "SRC" => c.arg(&src),
                a => c.arg(a),
            };
        }
        let o = c.output().unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded on a read-only snapshot");
        assert!(
            e.contains("subvolume snap-ro (id 257)") || e.contains("subvolume snap-ro (id 258)"),
            "{args:?}: error does not name the subvolume: {e}"
        );
        assert!(e.contains("read-only file system"), "{args:?}: not EROFS: {e}");
        assert_eq!(sha256(&img), before, "{args:?} changed the image");
    }
    // The writable subvolume beside it still takes changes.
    run(bin().arg("put").arg(&img).arg("/etc/hostname").arg("/sv/x"));
    run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&img));
    run(Command::new("mount").arg("-o").arg("loop,ro").arg(&img).arg(&mnt));
    let ro = run(Command::new("btrfs")
        .args(["property", "get", "-ts"])
        .arg(mnt.join("snap-ro"))
        .arg("ro"));
    let snap_file = std::fs::read(mnt.join("snap-ro/file"));
    let sv_x = std::fs::read(mnt.join("sv/x"));
    let leaked = mnt.join("snap-ro/x").exists();
    umount(&mnt);
    assert_eq!(String::from_utf8_lossy(&ro.stdout).trim(), "ro=true");
    assert_eq!(snap_file.unwrap(), b"in the snapshot");
    assert_eq!(sv_x.unwrap(), std::fs::read("/etc/hostname").unwrap());
    assert!(!leaked);
    let _ = std::fs::remove_dir_all(&work);
}

/// On a multi-device image (the RAID1 fixture), `put` without the other member is
/// refused, naming what is missing and changing nothing; with `--device` it copies,
/// and `ls`/`cat` (given both members, or either alone) read the copy back.
#[test]
fn put_on_a_raid1_image_needs_every_device() {
    let work = std::env::temp_dir().join(format!("ubtrfs-putraid-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let devs: Vec<PathBuf> = (0..2)
        .map(|i| {
            let fx = repo().join(format!("tests/fixtures/raid1.{i}.img.zst"));
            let dst = work.join(format!("raid1.{i}.img"));
            let mut out = std::fs::File::create(&dst).unwrap();
            std::io::copy(
                &mut zstd::stream::read::Decoder::new(std::fs::File::open(fx).unwrap()).unwrap(),
                &mut out,
            )
            .unwrap();
            dst
        })
        .collect();
    let src = work.join("hello.txt");
    std::fs::write(&src, b"written to both mirrors\n".repeat(1000)).unwrap();
    let before = std::fs::read(&devs[0]).unwrap();
    let o = bin().arg("put").arg(&devs[0]).arg(&src).arg("/hello.txt").output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("2 devices and 1 were given") && e.contains("--device"),
        "{o:?}"
    );
    assert!(std::fs::read(&devs[0]).unwrap() == before, "a refused put changed the image");
    run(bin().arg("put").arg("--device").arg(&devs[1]).arg(&devs[0]).arg(&src).arg("/hello.txt"));
    let want = std::fs::read(&src).unwrap();
    for given in [&[0usize, 1][..], &[0], &[1]] {
        let mut c = bin();
        c.arg("cat");
        for &i in &given[1..] {
            c.arg("--device").arg(&devs[i]);
        }
        c.arg(&devs[given[0]]).arg("/hello.txt");
        let out = run(&mut c);
        assert!(out.stdout == want, "cat with devices {given:?}: {} bytes", out.stdout.len());
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// A put that does not fit (100 MiB of data onto a 128 MiB image with some 47 MiB of
/// data space) is refused with ENOSPC naming the image path the user gave (`/big`,
/// `/dir/big`, `/dir/tree/big` inside a recursive copy), not an inode number, with the
/// bytes needed and free; the image stays byte-identical, `btrfs check` finds it clean,
/// the kernel mounts it with the earlier files intact, and a put that fits still
/// works. Measured on the kernel (6.18), same image size: `cp` of a 200 MiB file
/// writes 46 MiB, then "cp: error writing 'k/big': No space left on device"; nothing
/// goes to the kernel log, and the partial file stays. Ours is one transaction:
/// refused before anything of it is committed.
#[test]
fn put_that_does_not_fit_names_the_path_and_changes_nothing() {
    if !root_with_kernel() {
        return;
    }
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let work = base.join(format!("ubtrfs-enospc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(work.join("mnt")).unwrap();
    let img = work.join("img");
    std::fs::File::create(&img).unwrap().set_len(128 << 20).unwrap();
    run(Command::new("mkfs.btrfs").arg("-q").arg("-f").arg(&img));
    let small = cmd::pseudo_random(1, 1 << 20);
    std::fs::write(work.join("small"), &small).unwrap();
    std::fs::create_dir_all(work.join("d")).unwrap();
    std::fs::write(work.join("d/a"), b"in the directory\n").unwrap();
    run(bin().arg("put").arg(&img).arg(work.join("small")).arg("/small"));
    run(bin().arg("put").arg("-r").arg(&img).arg(work.join("d")).arg("/dir"));
    std::fs::write(work.join("big"), cmd::pseudo_random(2, 100 << 20)).unwrap();
    std::fs::create_dir_all(work.join("tree")).unwrap();
    std::fs::write(work.join("tree/first"), b"fits\n").unwrap();
    std::fs::hard_link(work.join("big"), work.join("tree/big")).unwrap();
    let before = sha256(&img);
    let refused: [(&[&str], &str); 3] = [
        (&["BIG", "/big"], "/big"),
        (&["BIG", "/dir"], "/dir/big"),
        (&["-r", "TREE", "/dir"], "/dir/tree/big"),
    ];
    for (args, named) in refused {
        let mut c = bin();
        c.arg("put").arg(&img);
        for a in args {
            match *a {
                "BIG" => c.arg(work.join("big")),
                "TREE" => c.arg(work.join("tree")),
                a => c.arg(a),
            };
        }
        let err = cmd::fails(&mut c);
        let want = format!("ubtrfs: error: {named}: no space left on device (104857600 bytes of data space are needed, ");
        assert!(
            err.starts_with(&want) && err.contains(" are free") && err.lines().count() == 1,
            "{args:?}: want {want:?}...: {err}"
        );
        assert!(!err.contains("root=") && !err.contains("ino="), "{args:?}: {err}");
        assert_eq!(sha256(&img), before, "{args:?}: a refused put changed the image");
    }
    run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&img));
    run(bin().arg("put").arg(&img).arg(work.join("tree/first")).arg("/after"));
    run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&img));
    let mnt = work.join("mnt");
    run(Command::new("mount").arg("-o").arg("loop,ro").arg(&img).arg(&mnt));
    let seen = (
        std::fs::read(mnt.join("small")),
        std::fs::read(mnt.join("dir/a")),
        std::fs::read(mnt.join("after")),
    );
    let names: Vec<String> = std::fs::read_dir(&mnt)
        .unwrap()
        .chain(std::fs::read_dir(mnt.join("dir")).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    umount(&mnt);
    assert_eq!(seen.0.unwrap(), small);
    assert_eq!(seen.1.unwrap(), b"in the directory\n");
    assert_eq!(seen.2.unwrap(), b"fits\n");
    let mut names = names;
    names.sort();
    assert_eq!(names, ["a", "after", "dir", "small"], "nothing of the refused puts is there");
    let _ = std::fs::remove_dir_all(&work);
}

/// The layout of `rm_r_of_subvolumes_matches_the_kernel`, made by the kernel on a
/// fresh loop mount at `mnt`: subvolumes with nested ones (directly and below a
/// directory), a directory holding one, a writable snapshot holding the placeholders
/// of the subvolumes nested in its source, an empty read-only subvolume, read-only
/// snapshots (one alone, one nested in a subvolume), and `top`, which becomes the
/// default subvolume afterwards and holds `inner`.
const SUBVOL_LAYOUT: &str = "
    btrfs -q subvolume create sub; mkdir -p sub/d; head -c 200000 /dev/zero | tr '\\0' 'q' > sub/d/f
    echo b > sub/g; ln -s g sub/l; ln sub/g sub/d/hard
    btrfs -q subvolume create sub/nested; echo n > sub/nested/x
    mkdir sub/e; btrfs -q subvolume create sub/e/deep; echo y > sub/e/deep/y
    mkdir outer; btrfs -q subvolume create outer/in; echo o > outer/in/o; echo z > outer/z
    btrfs -q subvolume snapshot sub subsnap
    btrfs -q subvolume create emptyro; btrfs property set emptyro ro true
    btrfs -q subvolume create src; echo s > src/s; btrfs -q subvolume snapshot -r src ro
    btrfs -q subvolume create box; btrfs -q subvolume snapshot -r src box/snap
    btrfs -q subvolume create top; echo t > top/t; btrfs -q subvolume create top/inner; mkdir top/inner/d; echo i > top/inner/d/i
    mkdir keep; echo k > keep/k
";

/// Every path under `dir` with its type, mode, size, and contents or link target.
fn tree_listing(dir: &Path) -> Vec<String> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let mut names: Vec<_> =
            std::fs::read_dir(dir.join(&rel)).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        for n in names {
            let r = rel.join(&n);
            let p = dir.join(&r);
            let md = std::fs::symlink_metadata(&p).unwrap();
            let what = if md.is_dir() {
                stack.push(r.clone());
                String::new()
            } else if md.file_type().is_symlink() {
                std::fs::read_link(&p).unwrap().display().to_string()
            } else {
                format!(
                    "{:?}",
                    std::fs::read(&p)
                        .unwrap()
                        .iter()
                        .fold(0u64, |h, &b| h.wrapping_mul(31).wrapping_add(u64::from(b)))
                )
            };
            out.push(format!(
                "{} {:o} {} nlink={} {what}",
                r.display(),
                md.mode(),
                if md.is_dir() { 0 } else { md.len() },
                if md.is_dir() { 0 } else { md.nlink() }
            ));
        }
    }
    out.sort();
    out
}

/// `ubtrfs rm -r` of subvolumes does what `rm -r` does on a kernel mount, checked on
/// two copies of one kernel-made layout, one changed by the kernel and one by ubtrfs,
/// then both read by the kernel. Measured on the kernel (6.18), as root: rm -r
/// removes a subvolume's contents depth first, and its rmdir(2) of each subvolume,
/// empty by then, deletes it (`btrfs_rmdir` -> `btrfs_delete_subvolume`), so nested
/// subvolumes go too, and the subvolumes below a plain directory; the placeholders in
/// a snapshot of a subvolume that held others go as entries; an empty read-only
/// subvolume is deleted by its rmdir; a read-only snapshot with contents refuses its
/// first unlink with EROFS, and rm then leaves its parents alone; rmdir of the default
/// subvolume is EPERM (its contents gone first; our paths start at the default
/// subvolume, so no path names it). Where the kernel's rm stops part way it keeps what
/// it removed; ubtrfs refuses the whole command, and the image stays as it was. Then
/// `btrfs check` is clean, the deleted trees are dropped, and the kernel sees the same
/// tree and subvolume list in both.
#[test]
fn rm_r_of_subvolumes_matches_the_kernel() {
    if !root_with_kernel() {
        return;
    }
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let work = base.join(format!("ubtrfs-rmsubvol-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let mnt = work.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let (kimg, uimg) = (work.join("kernel.img"), work.join("ubtrfs.img"));
    for img in [&kimg, &uimg] {
        std::fs::File::create(img).unwrap().set_len(256 << 20).unwrap();
        run(Command::new("mkfs.btrfs")
            .args(["-q", "-f", "-U", "4d8e2f51-1b3a-4c7e-9a65-2f0b6c1d3e70"])
            .arg(img));
        run(Command::new("mount").arg("-o").arg("loop").arg(img).arg(&mnt));
        run(Command::new("sh").arg("-ec").arg(SUBVOL_LAYOUT).current_dir(&mnt));
        umount(&mnt);
    }
    // (path, the error both give, or None). Paths are from the top-level subvolume.
    let cases: [(&str, Option<&str>); 7] = [
        ("/sub", None),
        ("/outer", None),
        ("/subsnap", None),
        ("/emptyro", None),
        ("/ro", Some("read-only file system")),
        ("/box", Some("read-only file system")),
        ("/keep", None),
    ];
    run(Command::new("mount").arg("-o").arg("loop").arg(&kimg).arg(&mnt));
    let mut kernel_said = Vec::new();
    for (path, _) in cases {
        let o = Command::new("rm").arg("-r").arg(mnt.join(&path[1..])).output().unwrap();
        kernel_said.push((o.status.success(), String::from_utf8_lossy(&o.stderr).to_lowercase()));
    }
    umount(&mnt);
    for ((path, want), (k_ok, k_err)) in cases.iter().zip(&kernel_said) {
        let before = sha256(&uimg);
        let o = bin().arg("rm").arg("-r").arg(&uimg).arg(path).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        match want {
            None => {
                assert!(*k_ok, "kernel rm -r {path}: {k_err}");
                assert!(o.status.success(), "ubtrfs rm -r {path}: {err}");
            }
            Some(w) => {
                assert!(!*k_ok && k_err.contains(w), "kernel rm -r {path}: want {w}: {k_err}");
                assert!(
                    !o.status.success() && err.contains(w),
                    "ubtrfs rm -r {path}: want {w}: {err}"
                );
                assert!(
                    err.starts_with(&format!("ubtrfs: error: {path}/")),
                    "the error names the entry: {err}"
                );
                assert_eq!(sha256(&uimg), before, "a refused rm -r {path} changed the image");
            }
        }
    }
    // The default subvolume: paths start there, as a kernel mount without subvol=.
    for img in [&kimg, &uimg] {
        run(Command::new("mount").arg("-o").arg("loop").arg(img).arg(&mnt));
        run(Command::new("btrfs").args(["subvolume", "set-default"]).arg(mnt.join("top")));
        umount(&mnt);
    }
    run(Command::new("mount").arg("-o").arg("loop").arg(&kimg).arg(&mnt));
    run(Command::new("rm").arg("-r").arg(mnt.join("inner")));
    umount(&mnt);
    let o = run(bin().arg("rm").arg("-r").arg(&uimg).arg("/inner"));
    let said = String::from_utf8_lossy(&o.stderr);
    assert!(
        said.contains("dropped the tree of subvolume"),
        "the deleted trees are dropped before rm returns: {said}"
    );
    run(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(&uimg));
    let deleted = run(bin().arg("subvolume").arg("list").arg("-d").arg(&uimg));
    assert!(
        deleted.stdout.is_empty(),
        "trees left to drop: {}",
        String::from_utf8_lossy(&deleted.stdout)
    );
    let mut seen = Vec::new();
    for img in [&kimg, &uimg] {
        run(Command::new("mount").arg("-o").arg("loop,ro,subvolid=5").arg(img).arg(&mnt));
        let list = String::from_utf8_lossy(
            &run(Command::new("btrfs").args(["subvolume", "list"]).arg(&mnt)).stdout,
        )
        .into_owned();
        let list: Vec<String> = list
            .lines()
            .map(|l| {
                l.split_whitespace()
                    .filter(|w| !w.chars().all(|c| c.is_ascii_digit()))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        seen.push((tree_listing(&mnt), list));
        umount(&mnt);
    }
    assert_eq!(seen[0].1, seen[1].1, "subvolume lists differ (kernel, then ubtrfs)");
    assert_eq!(seen[0].0, seen[1].0, "trees differ (kernel, then ubtrfs)");
    assert!(
        seen[1].0.iter().any(|l| l.starts_with("top/t "))
            && seen[1].0.iter().any(|l| l.starts_with("ro/s ")),
        "{:#?}",
        seen[1].0
    );
    let _ = std::fs::remove_dir_all(&work);
}
