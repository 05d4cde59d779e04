//! Filesystems ubtrfs reads but does not write, made by the kernel (xtask/fixtures.py):
//! an interrupted device replace (`replace`: RAID1 on devices 0 and 1, the replace of
//! devid 2 onto device 2, the target, cut part-way) and a sprout over a seed device
//! (`sprout`: device 0 the sprout, device 1 the seed).
//!
//! The replace: `dump-tree` prints the DEV_REPLACE item as btrfs-progs does; the
//! target is accepted among the devices; every file reads as the kernel's manifest
//! says, also with the source missing and the other copy damaged below the cursor
//! (read from the target, as the kernel's extra mirror); every writing command is
//! refused, naming the replace and its progress (the percent `btrfs replace status`
//! prints on a kernel mount), and changes no byte. The sprout is refused by name,
//! whichever devices are given.

#[path = "common/cmd.rs"]
mod cmd;
#[path = "../../core/tests/common/mod.rs"]
mod common;

use cmd::{bin, out_of, run_output as run};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;
use ubtrfs_core::{ExtentKind, FileKind, Filesystem, FsRead, OpenOptions};

/// A scratch directory with private copies of fixture `name`'s devices.
struct Work {
    dir: PathBuf,
    imgs: Vec<PathBuf>,
}

impl Work {
    fn new(name: &str, tag: &str) -> Work {
        let dir = std::env::temp_dir().join(format!("ubtrfs-replace-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let imgs = common::fixture_images(name)
            .iter()
            .enumerate()
            .map(|(i, src)| {
                let dst = dir.join(format!("{name}.{i}.img"));
                let ok = Command::new("cp")
                    .arg("--sparse=always")
                    .arg(src)
                    .arg(&dst)
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false);
                assert!(ok, "cp {} {}", src.display(), dst.display());
                dst
            })
            .collect();
        Work { dir, imgs }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if std::env::var_os("KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn sha256_file(p: &Path) -> String {
    let mut h = Sha256::new();
    std::io::copy(&mut std::fs::File::open(p).expect("open"), &mut h).expect("hash");
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// `ubtrfs SUB ... IMAGE [--device D]... ARGS` with `devs[0]` as IMAGE.
fn cmd(sub: &[&str], devs: &[&PathBuf], args: &[&str]) -> Command {
    let mut c = bin();
    c.args(sub).arg(devs[0]);
    for d in &devs[1..] {
        c.arg("--device").arg(d);
    }
    c.args(args);
    c
}

/// The kernel's files (path, sha256) from the fixture's manifest.
fn kernel_files(name: &str) -> Vec<(String, String)> {
    common::manifest(name)
        .into_iter()
        .filter(|(_, v)| v["type"] == "file")
        .map(|(p, v)| (p, v["sha256"].as_str().expect("sha256").to_string()))
        .collect()
}

fn assert_reads_as_the_kernel(devs: &[&PathBuf], what: &str) {
    let files = kernel_files("replace");
    assert!(files.len() >= 5, "{files:?}");
    for (p, want) in files {
        let o = run(&mut cmd(&["cat"], devs, &[&format!("/{p}")]));
        let got: String = Sha256::digest(&o.stdout).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(got, want, "{what}: /{p} differs from the kernel's");
    }
}

/// The DEV_REPLACE item's fields as ubtrfs dump-tree prints them.
struct Item {
    /// -1 once the replace is over (the kernel then has no source device).
    src_devid: i64,
    cursor_left: u64,
    state: String,
}

fn dump_item(devs: &[&PathBuf]) -> (String, Item) {
    let o = run(&mut cmd(&["dump-tree", "-t", "dev"], devs, &[]));
    let text = String::from_utf8(o.stdout).expect("utf8");
    let at = text
        .find("key (0 DEV_REPLACE 0)")
        .unwrap_or_else(|| panic!("no DEV_REPLACE item:\n{text}"));
    let lines: Vec<&str> = text[at..].lines().take(5).collect();
    let block = lines.join("\n");
    let w: Vec<&str> = lines[1].split_whitespace().collect();
    // "src devid N cursor left N cursor right N mode M"
    assert_eq!(
        (w[0], w[1], w[3], w[4], w[6], w[7], w[9]),
        ("src", "devid", "cursor", "left", "cursor", "right", "mode"),
        "{block}"
    );
    let s: Vec<&str> = lines[2].split_whitespace().collect();
    let item = Item {
        src_devid: w[2].parse().expect("devid"),
        cursor_left: w[5].parse().expect("cursor"),
        state: s[1].to_string(),
    };
    (block, item)
}

#[test]
fn interrupted_replace_is_read_and_dumped() {
    let w = Work::new("replace", "read");
    let [d0, d1, target] = [&w.imgs[0], &w.imgs[1], &w.imgs[2]];
    let (block, item) = dump_item(&[d0, d1, target]);
    // btrfs-progs' print_dev_replace_item layout, the item 72 bytes.
    assert!(block.contains("itemsize 72"), "{block}");
    let l: Vec<&str> = block.lines().collect();
    assert!(
        l[1].starts_with("\t\tsrc devid 2 cursor left ") && l[1].ends_with(" mode ALWAYS"),
        "{block}"
    );
    assert_eq!(l[2], "\t\tstate STARTED write errors 0 uncorrectable read errors 0", "{block}");
    assert!(l[3].starts_with("\t\tstart time ") && l[3].ends_with(')'), "{block}");
    assert!(l[4].starts_with("\t\tstop time 0 (1970-01-01 00:00:00)"), "{block}");
    assert_eq!((item.src_devid, item.state.as_str()), (2, "STARTED"));
    assert!(item.cursor_left > 0 && item.cursor_left < 512 << 20, "cursor {}", item.cursor_left);

    // The target among the devices is no extra member.
    for devs in
        [&[d0, d1, target][..], &[target, d0, d1], &[d0, target], &[d1, target], &[d0, d1], &[d0]]
    {
        let o = out_of(&mut cmd(&["ls"], devs, &["/data"]));
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success() && !e.contains("were given (devids [1, 2])"), "{devs:?}: {o:?}");
        assert!(!e.contains("3 were given"), "{devs:?}: {e}");
    }
    let info =
        String::from_utf8(run(&mut cmd(&["info"], &[d0, d1, target], &[])).stdout).expect("utf8");
    let line = info
        .lines()
        .find(|l| l.starts_with("device replace:"))
        .unwrap_or_else(|| panic!("no replace in info:\n{info}"));
    assert!(
        line.contains("a device replace of devid 2 is ")
            && line.ends_with(&format!("target devid 0 path {}", target.display())),
        "{line}"
    );
    assert_reads_as_the_kernel(&[d0, d1, target], "all three devices");
    assert_reads_as_the_kernel(&[d0, target], "source missing");
}

/// The source device missing and devid 1's copy of every data extent damaged where
/// devid 2's copy lies below the cursor: the reads come from the target. An extent
/// above the cursor damaged the same way has no good copy left.
#[test]
fn missing_source_reads_the_target_below_the_cursor() {
    let w = Work::new("replace", "target");
    let [d0, d1, target] = [&w.imgs[0], &w.imgs[1], &w.imgs[2]];
    let (_, item) = dump_item(&[d0, d1, target]);
    let fs = Filesystem::open(&OpenOptions {
        devices: vec![d0.clone(), d1.clone()],
        ..OpenOptions::new(d0)
    })
    .expect("open");
    let mut below = Vec::new();
    let mut above = Vec::new();
    for name in ["data/tagged-0", "data/tagged-1", "data/tagged-2", "data/tagged-3"] {
        let v = fs.resolve(&format!("/{name}"), false).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(v.kind(), FileKind::File);
        for e in &v.extents {
            let ExtentKind::Regular { disk_bytenr, disk_num_bytes, compression: 0, .. } = e.kind
            else {
                continue;
            };
            let chunk = fs
                .info
                .chunk_map
                .lookup(ubtrfs_core::ids::Logical(disk_bytenr))
                .expect("mapped")
                .clone();
            let copy = |devid: u64| {
                (0..chunk.num_copies())
                    .map(|m| chunk.map(disk_bytenr, m))
                    .find(|(i, _, _)| chunk.stripes[*i].0 == devid)
                    .expect("a copy on the device")
            };
            let (_, p1, _) = copy(1);
            let (_, p2, _) = copy(2);
            if p2 + disk_num_bytes <= item.cursor_left {
                below.push((name, p1, disk_num_bytes));
            } else if p2 >= item.cursor_left {
                above.push((name, p1, disk_num_bytes));
            }
        }
    }
    drop(fs);
    assert!(
        !below.is_empty() && !above.is_empty(),
        "extents below the cursor {below:?}, above {above:?}"
    );
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(d0).expect("open device 0");
    let damage = |phys: u64, len: u64| {
        let mut b = vec![0u8; len as usize];
        f.read_exact_at(&mut b, phys).expect("read");
        b.iter_mut().for_each(|x| *x ^= 0x5a);
        f.write_all_at(&b, phys).expect("write");
    };
    for &(_, p, n) in &below {
        damage(p, n);
    }
    // Every file still reads as the kernel wrote it: devid 1's bad blocks come from the target.
    assert_reads_as_the_kernel(&[d0, target], "devid 1 damaged below the cursor, source missing");
    let (name, p, n) = above[0];
    damage(p, n);
    let o = out_of(&mut cmd(&["cat"], &[d0, target], &[&format!("/{name}")]));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("device 2 is missing"),
        "{name} above the cursor: {e}"
    );
    // With the source back, the same file reads from it.
    run(&mut cmd(&["cat"], &[d0, d1, target], &[&format!("/{name}")]));
}

/// Every writing command is refused before anything is written, naming the replace and
/// its progress; no image changes by a byte.
#[test]
fn interrupted_replace_refuses_every_write() {
    let w = Work::new("replace", "write");
    let [d0, d1, target] = [&w.imgs[0], &w.imgs[1], &w.imgs[2]];
    let (_, item) = dump_item(&[d0, d1, target]);
    let host = w.dir.join("host.txt");
    std::fs::write(&host, b"host file\n").expect("host file");
    let script = w.dir.join("script");
    std::fs::write(&script, b"mkdir /b\n").expect("script");
    let h = host.to_str().expect("utf8");
    let s = script.to_str().expect("utf8");
    let writes: &[(&[&str], &[&str])] = &[
        (&["put"], &[h, "/new.txt"]),
        (&["rm"], &["/small"]),
        (&["mkdir"], &["/newdir"]),
        (&["mv"], &["/small", "/moved"]),
        (&["ln"], &["/small", "/link"]),
        (&["ln", "-s"], &["target", "/symlink"]),
        (&["mknod"], &["/fifo", "p"]),
        (&["truncate"], &["/small", "1"]),
        (&["reflink"], &["/data/tagged-0", "/clone"]),
        (&["dedupe"], &["/data"]),
        (&["fallocate", "-l", "4096"], &["/small"]),
        (&["chmod"], &["600", "/small"]),
        (&["chattr"], &["+i", "/small"]),
        (&["chown"], &["1:1", "/small"]),
        (&["touch"], &["/small"]),
        (&["setfattr", "--name", "user.a", "--value", "b"], &["/small"]),
        (&["batch"], &[s]),
    ];
    let before: Vec<String> = w.imgs.iter().map(|p| sha256_file(p)).collect();
    for devs in [&[d0, d1, target][..], &[d0, d1], &[target, d1, d0]] {
        for (sub, args) in writes {
            let o = out_of(&mut cmd(sub, devs, args));
            let e = String::from_utf8_lossy(&o.stderr);
            assert!(!o.status.success(), "{sub:?} {args:?} with {devs:?} succeeded");
            assert!(
                e.contains("a device replace of devid 2 is ")
                    && e.contains("% done")
                    && e.contains("finish it with a kernel mount"),
                "{sub:?} {args:?}: {e}"
            );
            assert!(!e.contains("were given"), "{sub:?}: {e}");
        }
    }
    let after: Vec<String> = w.imgs.iter().map(|p| sha256_file(p)).collect();
    assert_eq!(before, after, "a refused write changed an image");

    // The percent is the one `btrfs replace status` prints on a kernel mount.
    if !common::kernel_available_with(
        "interrupted_replace_refuses_every_write",
        &["/usr/sbin/losetup"],
    ) {
        return;
    }
    let o = out_of(&mut cmd(&["mkdir"], &[d0, d1, target], &["/x"]));
    let e = String::from_utf8_lossy(&o.stderr).into_owned();
    let ours = e
        .split("is ")
        .nth(1)
        .and_then(|r| r.split("% done").next())
        .unwrap_or_else(|| panic!("no percent in {e}"))
        .to_string();
    let status = kernel_replace_status(&w, &[d0, d1, target]);
    assert!(
        status.starts_with(&format!("{ours}% done")),
        "kernel: {status:?}, ubtrfs: {ours}% (cursor {})",
        item.cursor_left
    );
    assert_eq!(
        w.imgs.iter().map(|p| sha256_file(p)).collect::<Vec<_>>(),
        before,
        "the read-only kernel mount changed an image"
    );
}

/// `btrfs replace status -1` on a read-only kernel mount of read-only loop devices.
fn kernel_replace_status(w: &Work, imgs: &[&PathBuf]) -> String {
    let mut loops = Vec::new();
    for i in imgs {
        let o = run(Command::new("losetup").args(["-f", "--show", "-r"]).arg(i));
        loops.push(String::from_utf8_lossy(&o.stdout).trim().to_string());
    }
    let mnt = w.dir.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mnt");
    let opts = format!(
        "ro,{}",
        loops[1..].iter().map(|l| format!("device={l}")).collect::<Vec<_>>().join(",")
    );
    let m =
        out_of(Command::new("mount").args(["-t", "btrfs", "-o", &opts]).arg(&loops[0]).arg(&mnt));
    let status = if m.status.success() {
        let s = out_of(Command::new("btrfs").args(["replace", "status", "-1"]).arg(&mnt));
        let _ = Command::new("umount").arg(&mnt).status();
        String::from_utf8_lossy(&s.stdout).into_owned()
    } else {
        String::new()
    };
    for l in &loops {
        let _ = Command::new("btrfs").args(["device", "scan", "--forget", l]).output();
        let _ = Command::new("losetup").args(["-d", l]).status();
    }
    assert!(m.status.success(), "mount: {}", String::from_utf8_lossy(&m.stderr));
    status
}

/// A sprout over a seed device is refused by name, for reading and writing, whichever
/// of its devices are given; the seed alone reads as the filesystem it was.
#[test]
fn sprout_filesystems_are_refused_by_name() {
    let w = Work::new("sprout", "seed");
    let [sprout, seed] = [&w.imgs[0], &w.imgs[1]];
    let before: Vec<String> = w.imgs.iter().map(|p| sha256_file(p)).collect();
    for devs in [&[sprout, seed][..], &[seed, sprout], &[sprout]] {
        for (sub, args) in [
            (&["ls"][..], &["/"][..]),
            (&["cat"], &["/sprouted/tagged"]),
            (&["mkdir"], &["/x"]),
            (&["dump-tree", "-t", "fs"], &[]),
        ] {
            let o = out_of(&mut cmd(sub, devs, args));
            let e = String::from_utf8_lossy(&o.stderr);
            assert!(
                !o.status.success() && e.contains("seed devices are not supported"),
                "{sub:?} with {devs:?}: {e}"
            );
            assert!(!e.contains("belongs to filesystem"), "{sub:?} with {devs:?}: {e}");
        }
    }
    let e = String::from_utf8_lossy(&out_of(&mut cmd(&["ls"], &[sprout, seed], &["/"])).stderr)
        .into_owned();
    assert!(e.contains("sprout.1.img is a seed device"), "{e}");
    let e =
        String::from_utf8_lossy(&out_of(&mut cmd(&["ls"], &[sprout], &["/"])).stderr).into_owned();
    assert!(e.contains("devid 1 belongs to seed filesystem"), "{e}");
    // The seed alone is the filesystem it was when seeded: readable, not writable.
    let o = run(&mut cmd(&["ls"], &[seed], &["/seeded"]));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().collect::<Vec<_>>(), ["small", "tagged"]);
    let e = String::from_utf8_lossy(&out_of(&mut cmd(&["mkdir"], &[seed], &["/x"])).stderr)
        .into_owned();
    assert!(e.contains("SEEDING"), "{e}");
    assert_eq!(
        w.imgs.iter().map(|p| sha256_file(p)).collect::<Vec<_>>(),
        before,
        "an image changed"
    );
}

/// A replace the kernel finished leaves its item, FINISHED: that is no reason to refuse.
/// ubtrfs writes the filesystem, `btrfs check` finds it clean and the kernel mounts it
/// with the file.
#[test]
fn finished_replace_is_written() {
    if !common::kernel_available_with("finished_replace_is_written", &["/usr/sbin/losetup"]) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ubtrfs-replace-finished-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("mnt")).expect("scratch dir");
    let imgs: Vec<PathBuf> = ["a", "b"].iter().map(|n| dir.join(format!("{n}.img"))).collect();
    for i in &imgs {
        std::fs::File::create(i).and_then(|f| f.set_len(300 << 20)).expect("image");
    }
    let loops: Vec<String> = imgs
        .iter()
        .map(|i| {
            String::from_utf8_lossy(
                &run(Command::new("losetup").args(["-f", "--show"]).arg(i)).stdout,
            )
            .trim()
            .to_string()
        })
        .collect();
    let mnt = dir.join("mnt");
    let kernel = (|| -> Result<(), String> {
        let ok = |c: &mut Command| -> Result<(), String> {
            let o = out_of(c);
            o.status
                .success()
                .then_some(())
                .ok_or_else(|| format!("{c:?}: {}", String::from_utf8_lossy(&o.stderr)))
        };
        ok(Command::new("mkfs.btrfs").args(["-q", "-f", &loops[0]]))?;
        ok(Command::new("mount").arg(&loops[0]).arg(&mnt))?;
        std::fs::write(mnt.join("before"), vec![7u8; 3 << 20]).map_err(|e| e.to_string())?;
        ok(Command::new("btrfs").args(["replace", "start", "-B", &loops[0], &loops[1]]).arg(&mnt))?;
        ok(Command::new("umount").arg(&mnt))
    })();
    let _ = Command::new("umount").arg(&mnt).output();
    for l in &loops {
        let _ = Command::new("btrfs").args(["device", "scan", "--forget", l]).output();
        let _ = Command::new("losetup").args(["-d", l]).status();
    }
    kernel.expect("the kernel's replace");
    let img = &imgs[1];
    let (_, item) = dump_item(&[img]);
    assert_eq!((item.state.as_str(), item.src_devid), ("FINISHED", -1));
    let host = dir.join("host");
    std::fs::write(&host, b"written after the replace\n").expect("host file");
    run(&mut cmd(&["put"], &[img], &[host.to_str().expect("utf8"), "/after"]));
    let c =
        out_of(Command::new("btrfs").args(["check", "--readonly", "--check-data-csum"]).arg(img));
    assert!(
        c.status.success(),
        "btrfs check: {}{}",
        String::from_utf8_lossy(&c.stdout),
        String::from_utf8_lossy(&c.stderr)
    );
    let l = String::from_utf8_lossy(
        &run(Command::new("losetup").args(["-f", "--show"]).arg(img)).stdout,
    )
    .trim()
    .to_string();
    let m = out_of(Command::new("mount").args(["-o", "ro"]).arg(&l).arg(&mnt));
    let read = m
        .status
        .success()
        .then(|| (std::fs::read(mnt.join("after")), std::fs::read(mnt.join("before"))));
    let _ = Command::new("umount").arg(&mnt).output();
    let _ = Command::new("btrfs").args(["device", "scan", "--forget", &l]).output();
    let _ = Command::new("losetup").args(["-d", &l]).status();
    let (after, before) =
        read.unwrap_or_else(|| panic!("mount: {}", String::from_utf8_lossy(&m.stderr)));
    assert_eq!(after.expect("after"), b"written after the replace\n");
    assert_eq!(before.expect("before"), vec![7u8; 3 << 20]);
    if std::env::var_os("KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
