//! The editing commands end to end: mkdir, mv, ln, mknod, truncate, fallocate, chmod,
//! chown, touch, rm and batch on a fresh image, read back through a kernel mount and checked
//! with `btrfs check`; a batch is one commit, and a batch that fails anywhere (even on
//! its last line, or in parsing) leaves the image byte for byte as it was.

#[path = "common/cmd.rs"]
mod cmd;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ubtrfs"))
}

fn ok(args: &[&str], img: &Path) -> String {
    let mut c = bin();
    c.arg(args[0]);
    let mut image_placed = false;
    for a in &args[1..] {
        if *a == "IMG" {
            c.arg(img);
            image_placed = true;
        } else {
            c.arg(a);
        }
    }
    assert!(image_placed, "{args:?}: no IMG");
    let o = c.output().expect("run ubtrfs");
    assert!(o.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn fails(args: &[&str], img: &Path) -> String {
    let before = sha(img);
    let mut c = bin();
    for a in args {
        if *a == "IMG" {
            c.arg(img);
        } else {
            c.arg(a);
        }
    }
    let o = c.output().expect("run ubtrfs");
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{args:?} succeeded");
    assert_eq!(e.lines().count(), 1, "{args:?}: one line of error: {e}");
    assert!(e.starts_with("ubtrfs: error: "), "{args:?}: {e}");
    assert_eq!(sha(img), before, "{args:?} changed the image");
    e
}

fn sha(p: &Path) -> String {
    let o = Command::new("sha256sum").arg(p).output().expect("sha256sum");
    String::from_utf8_lossy(&o.stdout).split_whitespace().next().unwrap_or_default().to_string()
}

fn check(img: &Path) {
    let o = Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(img)
        .output()
        .expect("btrfs check");
    assert!(
        o.status.success(),
        "btrfs check: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

struct Mnt(PathBuf);
impl Mnt {
    fn new(img: &Path, dir: &Path) -> Mnt {
        std::fs::create_dir_all(dir).unwrap();
        let o = Command::new("mount").args(["-o", "loop,ro"]).arg(img).arg(dir).output().unwrap();
        assert!(o.status.success(), "mount: {}", String::from_utf8_lossy(&o.stderr));
        Mnt(dir.to_path_buf())
    }
}
impl Drop for Mnt {
    fn drop(&mut self) {
        for _ in 0..40 {
            if Command::new("umount").arg(&self.0).status().map(|s| s.success()).unwrap_or(false) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }
}

/// A fresh 256 MiB `mkfs.btrfs` image in `work`.
fn fresh_image(work: &Path) -> PathBuf {
    let img = work.join("img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    assert!(Command::new("mkfs.btrfs").arg("-q").arg(&img).status().unwrap().success());
    img
}

fn generation(img: &Path) -> u64 {
    let o = bin().arg("dump-super").arg(img).output().expect("dump-super");
    let t = String::from_utf8_lossy(&o.stdout);
    t.lines()
        .find_map(|l| {
            l.strip_prefix("generation")
                .map(|v| v.trim().parse::<u64>().expect("generation number"))
        })
        .expect("a generation line")
}

#[test]
fn editing_commands_round_trip_through_the_kernel() {
    if !kernel::kernel_available("editing_commands_round_trip_through_the_kernel") {
        return;
    }
    let work = std::env::temp_dir().join(format!("ubtrfs-edit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let img = fresh_image(&work);
    ok(&["mkdir", "-p", "IMG", "/a/b/c"], &img);
    ok(&["mkdir", "-p", "IMG", "/a/b"], &img);
    ok(&["mkdir", "-m", "700", "IMG", "/a/private"], &img);
    ok(&["touch", "-d", "2020-02-02 10:00:00.5", "IMG", "/a/f"], &img);
    ok(&["truncate", "IMG", "/a/g", "10K"], &img);
    ok(&["truncate", "IMG", "/a/g", "3000"], &img);
    // fallocate(1) makes a missing file in its default mode only.
    ok(&["fallocate", "-l", "64K", "IMG", "/a/prealloc"], &img);
    ok(&["fallocate", "-o", "4K", "-l", "5000", "IMG", "/a/prealloc-at"], &img);
    ok(&["fallocate", "-k", "-o", "64K", "-l", "8K", "IMG", "/a/prealloc"], &img);
    ok(&["ln", "-s", "IMG", "../f", "/a/b/lnk"], &img);
    ok(&["ln", "IMG", "/a/f", "/a/hard"], &img);
    ok(&["mknod", "IMG", "/a/fifo", "p"], &img);
    ok(&["mknod", "-m", "600", "IMG", "/a/null", "c", "1", "3"], &img);
    ok(&["mknod", "IMG", "/a/sock", "s"], &img);
    ok(&["chmod", "IMG", "u+x,g-r", "/a/f"], &img);
    ok(&["chmod", "IMG", "4750", "/a/g"], &img);
    ok(&["chown", "IMG", "1000:100", "/a/g"], &img);
    ok(&["chown", "IMG", ":7", "/a/private"], &img);
    ok(&["mv", "IMG", "/a/g", "/a/b/g2"], &img);
    ok(&["mv", "--exchange", "IMG", "/a/private", "/a/b/c"], &img);
    ok(&["mv", "--no-replace", "IMG", "/a/sock", "/a/sock2"], &img);
    ok(&["rm", "IMG", "/a/hard"], &img);
    ok(&["chattr", "IMG", "+iA", "/a/f"], &img);
    ok(&["chattr", "IMG", "+c", "/a/b/g2"], &img);
    ok(&["touch", "IMG", "/a/empty-nocow"], &img);
    ok(&["chattr", "IMG", "+C", "/a/empty-nocow"], &img);
    ok(&["chattr", "IMG", "+C", "/a/b/g2"], &img);
    ok(&["chattr", "IMG", "=dm", "/a/b/c"], &img);
    assert!(fails(&["chattr", "IMG", "+e", "/a/f"], &img).contains("not supported"));
    assert!(fails(&["chattr", "IMG", "+cm", "/a/b/g2"], &img).contains("exclude"));
    // Refusals: one line each, naming the object, and the image unchanged.
    assert!(fails(&["mv", "IMG", "/a", "/a/b/inside"], &img).contains("cannot move inside itself"));
    assert!(fails(&["mv", "--no-replace", "IMG", "/a/f", "/a/fifo"], &img).contains("file exists"));
    assert!(fails(&["mkdir", "IMG", "relative"], &img).contains("absolute"));
    assert!(fails(&["mkdir", "IMG", "/no/such/parent"], &img).contains("no such file"));
    assert!(fails(&["mkdir", "-p", "IMG", "/a/f/x"], &img).contains("not a directory"));
    assert!(fails(&["rm", "IMG", "/a/b"], &img).contains("use -r"));
    assert!(fails(&["chmod", "IMG", "u+q", "/a/f"], &img).contains("unknown permission"));
    assert!(fails(&["chown", "IMG", "root", "/a/f"], &img).contains("numeric"));
    assert!(fails(&["truncate", "IMG", "/a/b", "0"], &img).contains("is a directory"));
    for mode in ["-k", "-p", "-z"] {
        assert!(
            fails(&["fallocate", mode, "-l", "4K", "IMG", "/a/missing"], &img)
                .contains("no such file"),
            "fallocate {mode} of a missing file"
        );
    }
    assert!(fails(&["fallocate", "-l", "0", "IMG", "/a/zero-length"], &img).contains("invalid"));
    assert!(fails(&["touch", "-d", "yesterday", "IMG", "/a/f"], &img).contains("not a time"));
    assert!(fails(&["mknod", "IMG", "/a/dev", "c"], &img).contains("MAJOR"));
    assert!(fails(&["ln", "-s", "IMG", "", "/a/empty-link"], &img).contains("empty"));
    check(&img);
    let m = Mnt::new(&img, &work.join("mnt"));
    let st =
        |p: &str| std::fs::symlink_metadata(m.0.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
    assert!(
        st("a/b/c").is_dir() && st("a/b/c").mode() & 0o7777 == 0o700 && st("a/b/c").gid() == 7,
        "exchanged private dir"
    );
    assert!(st("a/private").is_dir() && st("a/private").mode() & 0o7777 == 0o755);
    assert_eq!(
        (st("a/f").mode() & 0o7777, st("a/f").mtime(), st("a/f").mtime_nsec(), st("a/f").nlink()),
        (0o704, 1_580_637_600, 500_000_000, 1)
    );
    let g2 = st("a/b/g2");
    // chown after chmod 4750 clears set-user-ID, as chown(2) does.
    assert_eq!((g2.len(), g2.mode() & 0o7777, g2.uid(), g2.gid()), (3000, 0o750, 1000, 100));
    assert_eq!(std::fs::read(m.0.join("a/b/g2")).unwrap(), vec![0u8; 3000]);
    assert_eq!(std::fs::read_link(m.0.join("a/b/lnk")).unwrap(), Path::new("../f"));
    assert!(st("a/fifo").file_type().is_fifo());
    assert!(st("a/sock2").file_type().is_socket() && !m.0.join("a/sock").exists());
    let null = st("a/null");
    assert!(
        null.file_type().is_char_device()
            && null.rdev() == libc::makedev(1, 3)
            && null.mode() & 0o7777 == 0o600
    );
    assert!(!m.0.join("a/hard").exists());
    // The files fallocate made: 0644 and root's, preallocated (allocated, read as
    // zeros, a hole to SEEK_DATA), -k's range past EOF allocated too.
    for (p, size, blocks) in
        [("a/prealloc", 65536, (65536 + 8192) / 512), ("a/prealloc-at", 9096, 8192 / 512)]
    {
        let s = st(p);
        assert_eq!(
            (s.mode(), s.uid(), s.gid(), s.len(), s.blocks()),
            (0o100644, 0, 0, size, blocks),
            "/{p}: (mode, uid, gid, size, blocks)"
        );
        assert!(std::fs::read(m.0.join(p)).unwrap().iter().all(|&b| b == 0), "/{p} reads zeros");
        let f = std::fs::File::open(m.0.join(p)).unwrap();
        // SAFETY: lseek on an open descriptor.
        let r =
            unsafe { libc::lseek(std::os::unix::io::AsRawFd::as_raw_fd(&f), 0, libc::SEEK_DATA) };
        assert_eq!(
            (r, std::io::Error::last_os_error().raw_os_error()),
            (-1, Some(libc::ENXIO)),
            "/{p}: SEEK_DATA finds no data"
        );
    }
    // lsattr through the kernel shows what ubtrfs lsattr shows; chattr +c set the
    // compression property, and +C on a non-empty file changed nothing (as the kernel).
    for p in ["a/f", "a/b/g2", "a/empty-nocow", "a/b/c"] {
        let k = Command::new("lsattr").arg("-d").arg(m.0.join(p)).output().expect("lsattr");
        let kflags = String::from_utf8_lossy(&k.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        let u = bin().arg("lsattr").arg(&img).arg(format!("/{p}")).output().expect("ubtrfs lsattr");
        let uflags = String::from_utf8_lossy(&u.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string();
        assert_eq!(uflags, kflags, "/{p}: ubtrfs lsattr vs the kernel's");
    }
    let prop = Command::new("btrfs")
        .args(["property", "get"])
        .arg(m.0.join("a/b/g2"))
        .arg("compression")
        .output()
        .expect("btrfs property");
    assert_eq!(String::from_utf8_lossy(&prop.stdout).trim(), "compression=zlib");
    drop(m);

    // A batch: a hundred edits, one commit.
    let gen = generation(&img);
    let mut script = String::from("# build a tree\nmkdir -p /batch/deep/er\n");
    for i in 0..30 {
        script.push_str(&format!("touch -d @{} /batch/f{i}\nchmod 6{}{} /batch/f{i}\nmv /batch/f{i} \"/batch/deep/file {i}\"\n", 1_600_000_000 + i, (i / 8) % 8, i % 8));
    }
    script.push_str(
        "ln -s 'file 0' '/batch/deep/it'\"'\"'s a link'\n\ntruncate /batch/deep/er/t 1M\n",
    );
    let path = work.join("script");
    std::fs::write(&path, &script).unwrap();
    ok(&["batch", "IMG", path.to_str().unwrap()], &img);
    assert_eq!(generation(&img), gen + 1, "a batch is one commit");
    check(&img);
    let m = Mnt::new(&img, &work.join("mnt"));
    for i in 0..30 {
        let s = std::fs::metadata(m.0.join(format!("batch/deep/file {i}"))).unwrap();
        assert_eq!(
            (s.mode() & 0o7777, s.mtime()),
            (0o600 + ((i as u32 / 8) % 8) * 8 + (i as u32 % 8), 1_600_000_000 + i),
            "file {i}"
        );
    }
    assert_eq!(
        std::fs::read_link(m.0.join("batch/deep/it's a link")).unwrap(),
        Path::new("file 0")
    );
    assert_eq!(std::fs::metadata(m.0.join("batch/deep/er/t")).unwrap().len(), 1 << 20);
    drop(m);
    // A batch that fails on its last line, or on a parse error anywhere, or on a
    // missing script, changes nothing.
    for (name, text, want) in [
        ("late", "mkdir /x\ntouch /x/y\nrm /x/missing\n", "late:3"),
        ("parse", "mkdir /x\nfrobnicate /x\n", "parse:2"),
        ("quote", "mkdir /x\nmkdir '/y\n", "quote:2"),
    ] {
        let p = work.join(name);
        std::fs::write(&p, text).unwrap();
        let e = fails(&["batch", "IMG", p.to_str().unwrap()], &img);
        assert!(e.contains(want), "{name}: {e}");
    }
    fails(&["batch", "IMG", work.join("no-such-script").to_str().unwrap()], &img);
    let mut c = bin();
    c.arg("batch")
        .arg(&img)
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(b"mkdir /from-stdin\n").unwrap();
    assert!(child.wait_with_output().unwrap().status.success(), "batch from stdin");
    check(&img);
    let _ = std::fs::remove_dir_all(&work);
}

/// `ubtrfs reflink`: the copy shares the source's extents (the kernel's `btrfs
/// filesystem du` counts them shared) and reads the same; a directory DST takes the
/// source's name; a directory SRC, a missing SRC and SRC = DST are refused, naming
/// them, with the image unchanged.
#[test]
fn reflink_copies_share_extents() {
    if !kernel::kernel_available("reflink_copies_share_extents") {
        return;
    }
    let work = std::env::temp_dir().join(format!("ubtrfs-reflink-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let img = fresh_image(&work);
    let src = work.join("src");
    let data: Vec<u8> = (0..(3u32 << 20) + 5).map(|i| (i.wrapping_mul(40503) >> 7) as u8).collect();
    std::fs::write(&src, &data).unwrap();
    ok(&["put", "IMG", src.to_str().unwrap(), "/a"], &img);
    ok(&["mkdir", "IMG", "/d"], &img);
    ok(&["reflink", "IMG", "/a", "/b"], &img);
    ok(&["reflink", "IMG", "/a", "/d"], &img);
    assert!(fails(&["reflink", "IMG", "/d", "/c"], &img).contains("/d"));
    assert!(fails(&["reflink", "IMG", "/nope", "/c"], &img).contains("/nope"));
    assert!(fails(&["reflink", "IMG", "/a", "/a"], &img).contains("same file"));
    check(&img);
    let m = Mnt::new(&img, &work.join("mnt"));
    for f in ["a", "b", "d/a"] {
        assert!(std::fs::read(m.0.join(f)).unwrap() == data, "/{f} reads differently");
    }
    let shared = kernel::du_shared_bytes(&m.0);
    assert!(shared >= data.len() as u64, "btrfs filesystem du counts {shared} bytes shared");
    drop(m);
    let _ = std::fs::remove_dir_all(&work);
}

/// `ubtrfs dedupe`: two copies of a tree (and a file that differs in one byte) end
/// sharing the copies' extents: the image's bytes used shrink by about one copy, the
/// kernel reads every file as before and counts the bytes as shared, the image checks
/// clean, and a second run finds everything already shared.
#[test]
fn dedupe_shares_identical_files() {
    if !kernel::kernel_available("dedupe_shares_identical_files") {
        return;
    }
    let work = std::env::temp_dir().join(format!("ubtrfs-dedupe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let tree = work.join("tree");
    std::fs::create_dir_all(tree.join("sub")).unwrap();
    let mut files = Vec::new();
    for i in 0..20u32 {
        let data: Vec<u8> = (0..(i + 1) * 37_000)
            .map(|x| (x.wrapping_mul(2_654_435_761).wrapping_add(i) >> 11) as u8)
            .collect();
        let p =
            if i % 2 == 0 { tree.join(format!("f{i}")) } else { tree.join(format!("sub/f{i}")) };
        std::fs::write(&p, &data).unwrap();
        files.push((p.strip_prefix(&tree).unwrap().to_path_buf(), data));
    }
    let img = fresh_image(&work);
    ok(&["put", "-r", "IMG", tree.to_str().unwrap(), "/a"], &img);
    ok(&["put", "-r", "IMG", tree.to_str().unwrap(), "/b"], &img);
    let mut odd = files[3].1.clone();
    odd[1000] ^= 1;
    std::fs::write(work.join("odd"), &odd).unwrap();
    ok(&["put", "IMG", work.join("odd").to_str().unwrap(), "/odd"], &img);
    let used = |img: &Path| -> u64 {
        let o = bin().arg("info").arg(img).output().unwrap();
        let t = String::from_utf8_lossy(&o.stdout).into_owned();
        let line = t
            .lines()
            .find(|l| l.starts_with("bytes used:"))
            .unwrap_or_else(|| panic!("no bytes used in {t}"));
        line.split_whitespace()
            .find_map(|w| w.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("{line}"))
    };
    let before = used(&img);
    let data_bytes: u64 = files.iter().map(|(_, d)| d.len() as u64).sum();
    let o = bin().args(["dedupe"]).arg(&img).arg("/").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "dedupe: {out}{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("20 groups") && out.contains("20 files now share"), "{out}");
    let after = used(&img);
    assert!(
        before - after >= data_bytes * 9 / 10,
        "bytes used went from {before} to {after}; one copy is {data_bytes}"
    );
    check(&img);
    let o = bin().args(["dedupe"]).arg(&img).arg("/a").arg("/b").output().unwrap();
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("20 already did"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let m = Mnt::new(&img, &work.join("mnt"));
    for (rel, data) in &files {
        for top in ["a", "b"] {
            assert!(
                std::fs::read(m.0.join(top).join(rel)).unwrap() == *data,
                "/{top}/{} reads differently",
                rel.display()
            );
        }
    }
    assert!(std::fs::read(m.0.join("odd")).unwrap() == odd, "/odd changed");
    let shared = kernel::du_shared_bytes(&m.0);
    assert!(
        shared >= data_bytes,
        "btrfs filesystem du counts {shared} bytes shared of {data_bytes}"
    );
    drop(m);
    let _ = std::fs::remove_dir_all(&work);
}

/// The block pass: two files that differ but hold the same 1 MiB at different
/// (128 KiB-aligned) offsets share it after `ubtrfs dedupe`, read back unchanged, and
/// the image checks clean; `btrfs filesystem du` counts the shared MiB.
#[test]
fn dedupe_shares_identical_blocks_of_different_files() {
    if !kernel::kernel_available("dedupe_shares_identical_blocks_of_different_files") {
        return;
    }
    let work = std::env::temp_dir().join(format!("ubtrfs-dedupe-blocks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let bytes = cmd::pseudo_random;
    let common = bytes(7, 1 << 20);
    let p1 = [bytes(1, 1 << 20), common.clone()].concat();
    let p2 = [bytes(2, 256 << 10), common.clone(), bytes(3, 100_000)].concat();
    std::fs::write(work.join("p1"), &p1).unwrap();
    std::fs::write(work.join("p2"), &p2).unwrap();
    let img = fresh_image(&work);
    ok(&["put", "IMG", work.join("p1").to_str().unwrap(), "/p1"], &img);
    ok(&["put", "IMG", work.join("p2").to_str().unwrap(), "/p2"], &img);
    let o = bin().args(["dedupe"]).arg(&img).arg("/").output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "dedupe: {out}{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.contains("ranges now share 1048576 bytes"), "{out}");
    check(&img);
    let m = Mnt::new(&img, &work.join("mnt"));
    assert!(
        std::fs::read(m.0.join("p1")).unwrap() == p1
            && std::fs::read(m.0.join("p2")).unwrap() == p2,
        "the files read differently"
    );
    let shared = kernel::du_shared_bytes(&m.0);
    assert!(shared >= 1 << 20, "btrfs filesystem du counts {shared} bytes shared");
    drop(m);
    let _ = std::fs::remove_dir_all(&work);
}
