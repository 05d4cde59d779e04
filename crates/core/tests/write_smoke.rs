mod common;
use ubtrfs_core::inode::filesystem::{Filesystem, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::FsRead;
use ubtrfs_core::FsWriter;
use ubtrfs_core::OpenOptions;

fn copy_fixture(name: &str, tag: &str) -> std::path::PathBuf {
    let src = &common::fixture_images(name)[0];
    let dst = std::env::temp_dir().join(format!("ubtrfs-write-{tag}-{}.img", std::process::id()));
    std::fs::copy(src, &dst).unwrap();
    dst
}

#[test]
fn smoke_mkdir_write_commit() {
    let img = copy_fixture("blake2", "smoke");
    {
        let mut w = FsWriter::open(&OpenOptions::new(&img)).unwrap();
        let d = w.mkdir(5, 256, b"newdir", &InodeAttrs::new(0o755)).unwrap();
        let f = w.create_file(5, d, b"small", &InodeAttrs::new(0o644)).unwrap();
        w.write_file(5, f, 0, b"hello world\n").unwrap();
        let g = w.create_file(5, d, b"big", &InodeAttrs::new(0o644)).unwrap();
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
        w.write_file(5, g, 0, &data).unwrap();
        w.commit().unwrap();
    }
    let out = std::process::Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(&img)
        .output();
    if let Ok(o) = out {
        eprintln!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "btrfs check failed");
    }
    let fs = Filesystem::open(&OpenOptions::new(&img)).unwrap();
    let v = fs.resolve("/newdir/small", false).unwrap();
    let mut buf = vec![0u8; 100];
    let n = fs.read_at(&v, 0, &mut buf).unwrap();
    assert_eq!(&buf[..n], b"hello world\n");
    let v = fs.resolve("/newdir/big", false).unwrap();
    let mut buf = vec![0u8; 300_000];
    fs.read_at(&v, 0, &mut buf).unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    assert_eq!(buf, data);
    let _ = fs.load_inode(v.id, Load::ALL);
    if std::env::var("KEEP").is_err() {
        std::fs::remove_file(&img).ok();
    } else {
        eprintln!("kept {}", img.display());
    }
}

/// With the clock and UUID source injected, the same changes to the same image give the
/// same bytes, and every time the engine stamps comes from the injected clock.
#[test]
fn injected_sources_make_writes_reproducible() {
    use ubtrfs_core::sources::{Sources, Time};
    let start = Time { sec: 1_700_000_000, nsec: 5 };
    let run = |tag: &str| -> (Vec<u8>, std::path::PathBuf) {
        let img = copy_fixture("default", tag);
        let mut opts = OpenOptions::new(&img);
        opts.sources = Sources::deterministic(start, 42);
        let mut w = FsWriter::open(&opts).unwrap();
        let d = w.mkdir(5, 256, b"repro", &InodeAttrs::new(0o755)).unwrap();
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 13 % 241) as u8).collect();
        for i in 0..50u32 {
            let f = w
                .create_file(5, d, format!("f{i:03}").as_bytes(), &InodeAttrs::new(0o644))
                .unwrap();
            w.write_file(5, f, 0, &data[..(i as usize * 3001) % data.len()]).unwrap();
        }
        w.commit().unwrap();
        drop(w);
        (std::fs::read(&img).unwrap(), img)
    };
    let (a, img_a) = run("repro-a");
    let (b, img_b) = run("repro-b");
    assert!(a == b, "two runs with the same sources wrote different images");
    let fs = Filesystem::open(&OpenOptions::new(&img_a)).unwrap();
    let dir = fs.resolve("/repro", false).unwrap();
    let file = fs.resolve("/repro/f000", false).unwrap();
    for (what, t) in [
        ("dir otime", dir.item.otime),
        ("dir mtime", dir.item.mtime),
        ("file ctime", file.item.ctime),
        ("file mtime", file.item.mtime),
    ] {
        let sec = t.sec.get();
        assert!(
            (1_700_000_000..1_700_000_001).contains(&sec),
            "{what} {sec} is not from the injected clock"
        );
    }
    // The directory was created first: its birth time is the clock's first reading.
    assert_eq!((dir.item.otime.sec.get(), dir.item.otime.nsec.get()), (1_700_000_000, 5));
    for p in [img_a, img_b] {
        std::fs::remove_file(p).ok();
    }
}
