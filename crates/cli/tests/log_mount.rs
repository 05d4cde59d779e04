//! `ubtrfs mount` of a kernel image whose superblock carries a log tree (the fixture
//! `logreplay`: fsyncs after the last commit, see xtask/fixtures.py): a read-only mount
//! shows the replayed files and writes nothing; a writable mount replays the log and
//! commits at once, as the kernel's mount does, so the image after its unmount has no
//! log, checks clean, and the kernel mounts it with the same files.

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::{bin, run, run_output, scratch_in};
use fuse::{assert_check, FuseMount, KernelMount, Stop};
use std::io::Read;
use std::path::Path;

fn available(test: &str) -> bool {
    kernel::kernel_available_with(test, &["/dev/fuse", "/usr/bin/fusermount3"])
}

/// The fixture's image, decompressed into `dir`.
fn fixture(dir: &Path) -> std::path::PathBuf {
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/logreplay.0.img.zst");
    let mut dec = zstd::stream::read::Decoder::new(std::fs::File::open(&src).expect("fixture"))
        .expect("zstd");
    let mut bytes = Vec::new();
    dec.read_to_end(&mut bytes).expect("decompress");
    let img = dir.join("logreplay.img");
    std::fs::write(&img, bytes).expect("write image");
    img
}

/// Names, sizes and contents under `root` (a mount), sorted.
fn tree(root: &Path) -> Vec<(String, u64, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir") {
            let e = e.expect("entry");
            let p = e.path();
            let md = std::fs::symlink_metadata(&p).expect("stat");
            let rel = p.strip_prefix(root).expect("under root").to_string_lossy().into_owned();
            let content = if md.is_file() { std::fs::read(&p).expect("read") } else { Vec::new() };
            out.push((rel, md.len(), content));
            if md.is_dir() {
                stack.push(p);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn mount_replays_the_log_read_only_in_memory_and_writable_on_disk() {
    if !available("mount_replays_the_log_read_only_in_memory_and_writable_on_disk") {
        return;
    }
    let dir = scratch_in("log-mount", "replay");
    let img = fixture(&dir);
    let before = std::fs::read(&img).expect("image");
    // The kernel's view after its own replay, on a copy.
    let kimg = dir.join("kernel.img");
    std::fs::copy(&img, &kimg).expect("copy");
    let kdir = dir.join("k");
    let kernel = {
        let _m = KernelMount::new(&kimg, &kdir);
        tree(&kdir)
    };
    assert!(kernel.iter().any(|(p, _, _)| p == "newtree/a/b/c/deep"), "kernel: no replayed file");

    let mnt = dir.join("m");
    let ro = FuseMount::start(&img, &mnt, "ro");
    assert_eq!(tree(&mnt), kernel, "read-only mount against the kernel's replay");
    ro.stop(Stop::Umount);
    assert!(before == std::fs::read(&img).expect("image"), "a read-only mount wrote");

    let rw = FuseMount::start(&img, &mnt, "");
    assert_eq!(tree(&mnt), kernel, "writable mount against the kernel's replay");
    rw.stop(Stop::Umount);
    let info = run(bin().arg("info").arg(&img));
    assert!(
        info.lines().any(|l| l.starts_with("log tree:") && l.ends_with("none")),
        "the log is still there after a writable mount:\n{info}"
    );
    assert_check(&img, "after a writable mount replayed the log");
    let after = {
        let _m = KernelMount::new(&img, &kdir);
        tree(&kdir)
    };
    assert_eq!(after, kernel, "kernel mount of our replay");
    let _ = std::fs::remove_dir_all(&dir);
}

/// fsync through the mount goes into the log tree: after a kill -9 of the mount, the
/// image carries the log (no commit made the append durable), `btrfs check` finds the
/// image with its log clean, and both the kernel's mount and ubtrfs replay it and show
/// the fsynced bytes.
#[test]
fn fsync_through_the_mount_survives_kill_9_by_the_log() {
    if !available("fsync_through_the_mount_survives_kill_9_by_the_log") {
        return;
    }
    let dir = scratch_in("log-mount", "fsync");
    let img = dir.join("img");
    fuse::mkfs(&img, "256M");
    let mnt = dir.join("m");
    let m = FuseMount::start(&img, &mnt, "commit=300");
    let p = mnt.join("db");
    let first = cmd::pseudo_random(1, 100_000);
    std::fs::write(&p, &first).expect("write");
    std::fs::File::open(&p).expect("open").sync_all().expect("fsync");
    let gen_before = super_generation(&img);
    let mut want = first.clone();
    {
        use std::io::{Seek, SeekFrom, Write};
        use std::os::unix::fs::FileExt;
        let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&p).expect("open");
        for i in 0..20u64 {
            let d = cmd::pseudo_random(100 + i, 4096 + i as usize * 100);
            let off = (i * 7919 * 13) % 120_000;
            f.write_all_at(&d, off).expect("pwrite");
            let end = off as usize + d.len();
            if want.len() < end {
                want.resize(end, 0);
            }
            want[off as usize..end].copy_from_slice(&d);
            f.sync_data().expect("fdatasync");
        }
        f.seek(SeekFrom::End(0)).expect("seek");
        f.write_all(b"appended and fsynced").expect("append");
        want.extend_from_slice(b"appended and fsynced");
        f.sync_all().expect("fsync");
    }
    assert_eq!(super_generation(&img), gen_before, "the fsyncs committed instead of logging");
    m.kill9();
    let info = run(bin().arg("info").arg(&img));
    assert!(info.lines().any(|l| l.starts_with("log tree:") && l.contains("present")), "{info}");
    assert_check(&img, "the image with its log, before any replay");
    let got = run_output(bin().args(["cat"]).arg(&img).arg("/db")).stdout;
    assert!(got == want, "ubtrfs's in-memory replay: {} bytes, want {}", got.len(), want.len());
    kernel_replay(&img, &dir, |kdir| {
        let got = std::fs::read(kdir.join("db")).expect("kernel read");
        assert!(got == want, "the kernel's replay: {} bytes, want {}", got.len(), want.len());
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// The kernel's replay of a copy of `img` (in `dir`): mounted, `look` at it, unmounted,
/// and `btrfs check` of the replayed copy clean.
fn kernel_replay(img: &Path, dir: &Path, look: impl FnOnce(&Path)) {
    let kcopy = dir.join("kernel.img");
    std::fs::copy(img, &kcopy).expect("copy");
    let kdir = dir.join("k");
    {
        let _k = KernelMount::new(&kcopy, &kdir);
        look(&kdir);
    }
    assert_check(&kcopy, "after the kernel's replay");
}

/// The superblock's generation, from `dump-super`.
fn super_generation(img: &Path) -> u64 {
    let t = run(bin().arg("dump-super").arg(img));
    t.lines()
        .find_map(|l| l.strip_prefix("generation").map(|v| v.trim().to_string()))
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        .expect("generation line")
}

/// A directory's fsync through the mount goes into the log tree too: names made,
/// removed and renamed after the last commit survive a kill -9 of the mount, in
/// ubtrfs's replay and in the kernel's, and the fsynced file's data with them.
#[test]
fn directory_fsync_through_the_mount_survives_kill_9_by_the_log() {
    if !available("directory_fsync_through_the_mount_survives_kill_9_by_the_log") {
        return;
    }
    let dir = scratch_in("log-mount", "dirfsync");
    let img = dir.join("img");
    fuse::mkfs(&img, "256M");
    let mnt = dir.join("m");
    let d = mnt.join("d");
    {
        // Committed by the unmount: what follows is only in the log.
        let m = FuseMount::start(&img, &mnt, "commit=300");
        std::fs::create_dir(&d).expect("mkdir");
        std::fs::write(d.join("old"), b"old").expect("write");
        std::fs::write(d.join("moved"), b"moved").expect("write");
        m.stop(Stop::Umount);
    }
    let m = FuseMount::start(&img, &mnt, "commit=300");
    let gen_before = super_generation(&img);
    let journal = cmd::pseudo_random(7, 20_000);
    std::fs::write(d.join("db-journal"), &journal).expect("journal");
    std::fs::File::open(d.join("db-journal")).expect("open").sync_all().expect("fsync");
    std::fs::remove_file(d.join("old")).expect("unlink");
    std::fs::rename(d.join("moved"), d.join("renamed")).expect("rename");
    std::fs::create_dir(d.join("sub")).expect("mkdir");
    std::fs::File::open(&d).expect("open the directory").sync_all().expect("fsync the directory");
    assert_eq!(super_generation(&img), gen_before, "the fsyncs committed instead of logging");
    m.kill9();
    let want: Vec<(&str, Option<&[u8]>)> =
        vec![("db-journal", Some(&journal)), ("renamed", Some(b"moved")), ("sub", None)];
    let listing = run(bin().arg("ls").arg(&img).arg("/d"));
    let mut names: Vec<&str> =
        listing.lines().filter_map(|l| l.split_whitespace().last()).collect();
    names.sort_unstable();
    assert_eq!(names, ["db-journal", "renamed", "sub"], "ubtrfs's replay:\n{listing}");
    for (n, data) in &want {
        if let Some(data) = data {
            let got = run_output(bin().arg("cat").arg(&img).arg(format!("/d/{n}"))).stdout;
            assert!(&got[..] == *data, "ubtrfs's replay of /d/{n}: {} bytes", got.len());
        }
    }
    assert_check(&img, "the image with its log, before any replay");
    kernel_replay(&img, &dir, |kdir| {
        let mut got: Vec<String> = std::fs::read_dir(kdir.join("d"))
            .expect("kernel readdir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        got.sort_unstable();
        assert_eq!(got, ["db-journal", "renamed", "sub"], "the kernel's replay");
        for (n, data) in &want {
            match data {
                Some(data) => {
                    let got = std::fs::read(kdir.join("d").join(n)).expect("kernel read");
                    assert!(&got[..] == *data, "the kernel's replay of d/{n}");
                }
                None => assert!(kdir.join("d").join(n).is_dir(), "the kernel's d/{n}"),
            }
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// O_DSYNC writes and concurrent fsyncs through the mount go into the log: a file
/// written through an O_DSYNC descriptor (each write durable when it returns, the
/// kernel's generic_write_sync sending an fsync to the daemon) and four threads each
/// rewriting and fsyncing their own file at once (log syncs shared between them);
/// no commit happens; after a kill -9, ubtrfs's replay and the kernel's show every
/// byte, and both checks are clean.
#[test]
fn o_dsync_and_concurrent_fsyncs_through_the_mount_survive_kill_9() {
    if !available("o_dsync_and_concurrent_fsyncs_through_the_mount_survive_kill_9") {
        return;
    }
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let dir = scratch_in("log-mount", "dsync");
    let img = dir.join("img");
    fuse::mkfs(&img, "256M");
    let mnt = dir.join("m");
    let m = FuseMount::start(&img, &mnt, "commit=300");
    let gen_before = super_generation(&img);
    let mut want: Vec<(String, Vec<u8>)> = Vec::new();
    {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DSYNC)
            .open(mnt.join("dsync"))
            .expect("open O_DSYNC");
        let mut d = Vec::new();
        for i in 0..16u64 {
            let b = cmd::pseudo_random(200 + i, 5000);
            f.write_all_at(&b, d.len() as u64).expect("O_DSYNC write");
            d.extend_from_slice(&b);
        }
        want.push(("dsync".into(), d));
    }
    let per_thread: Vec<Vec<u8>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4u64)
            .map(|t| {
                let p = mnt.join(format!("t{t}"));
                sc.spawn(move || {
                    let f = std::fs::File::create(&p).expect("create");
                    let mut d = vec![0u8; 64 * 1024];
                    for i in 0..40u64 {
                        let b = cmd::pseudo_random(1000 * t + i, 4096);
                        let off = (i * 7 % 16) * 4096;
                        f.write_all_at(&b, off).expect("pwrite");
                        d[off as usize..off as usize + 4096].copy_from_slice(&b);
                        f.sync_all().expect("fsync");
                    }
                    let len = f.metadata().expect("stat").len() as usize;
                    d.truncate(len);
                    d
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    for (t, d) in per_thread.into_iter().enumerate() {
        want.push((format!("t{t}"), d));
    }
    assert_eq!(super_generation(&img), gen_before, "the fsyncs committed instead of logging");
    m.kill9();
    assert_check(&img, "the image with its log, before any replay");
    for (name, d) in &want {
        let got = run_output(bin().args(["cat"]).arg(&img).arg(format!("/{name}"))).stdout;
        assert!(got == *d, "ubtrfs's replay of {name}: {} bytes, want {}", got.len(), d.len());
    }
    kernel_replay(&img, &dir, |kdir| {
        for (name, d) in &want {
            let got = std::fs::read(kdir.join(name)).expect("kernel read");
            assert!(
                got == *d,
                "the kernel's replay of {name}: {} bytes, want {}",
                got.len(),
                d.len()
            );
        }
    });
    let _ = std::fs::remove_dir_all(&dir);
}
