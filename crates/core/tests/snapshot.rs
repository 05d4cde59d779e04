//! Snapshots (`FsWriter::create_snapshot_of_committed`, `Engine::create_snapshot`)
//! against the oracles: after a snapshot, changes on both sides (overwrites, deletes,
//! new files) COW the shared blocks with the kernel's backref rules, and then
//! `btrfs check --check-data-csum` is clean, the kernel shows each subvolume as its
//! model says, `btrfs subvolume list` shows the snapshot with the source as parent,
//! and the kernel can delete the snapshot and change the source, after which the image
//! checks clean again.
//!
//! Needs root, the kernel btrfs driver and btrfs-progs; without them the tests print
//! why and pass, except under CI=true.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::collections::BTreeMap;
use std::path::Path;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::error::PosixKind;
use ubtrfs_core::inode::filesystem::InodeId;
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::{FsRead, OpenOptions};
use write_common::*;

type Model = BTreeMap<String, Vec<u8>>;

fn create(e: &Engine, root: u64, name: &str, data: &[u8]) -> InodeId {
    let ino = e
        .write(|w| w.create_file(root, 256, name.as_bytes(), &InodeAttrs::new(0o644)))
        .expect("create file");
    let id = InodeId { root, ino };
    if !data.is_empty() {
        e.buffered_write(id, 0, data).expect("write");
    }
    id
}

fn lookup(e: &Engine, root: u64, name: &str) -> u64 {
    let ino = e
        .read(|l| l.lookup(InodeId { root, ino: 256 }, name.as_bytes()))
        .expect("lookup")
        .unwrap_or_else(|| panic!("{name} missing in {root}"))
        .target
        .ino;
    ino
}

/// Every regular file of the kernel's `dir` (not descending into subvolumes, which
/// show as directories) equals the model, and nothing else is there.
fn kernel_matches(dir: &Path, model: &Model, what: &str) {
    let mut seen = Model::new();
    for e in
        std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{what}: read_dir {}: {e}", dir.display()))
    {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            seen.insert(
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            );
        }
    }
    assert_eq!(
        seen.len(),
        model.len(),
        "{what}: the kernel shows {} files, the model {}",
        seen.len(),
        model.len()
    );
    for (name, want) in model {
        let got =
            seen.get(name).unwrap_or_else(|| panic!("{what}: {name} missing on the kernel's side"));
        assert!(
            got == want,
            "{what}: {name} differs ({} bytes, {} in the model)",
            got.len(),
            want.len()
        );
    }
}

#[test]
fn snapshots_share_blocks_both_sides_change_and_the_kernel_agrees() {
    if !common::kernel_available("snapshots_share_blocks_both_sides_change_and_the_kernel_agrees") {
        return;
    }
    let s = Scratch::mkfs("snap-basic", 512 << 20, &[]);
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    let mut rng = Rng::new(3);
    let mut top = Model::new();
    // Enough files for a tree of several levels' worth of leaves; a few large ones.
    for i in 0..2500 {
        let n = if i % 500 == 0 { 1 << 20 } else { (i % 7) * 300 };
        let data = rng.bytes(n as usize);
        let name = format!("f{i:05}");
        create(&e, 5, &name, &data);
        top.insert(name, data);
    }
    // Dirty data and uncommitted changes: the snapshot writes back and commits first.
    let rw = e.create_snapshot(5, InodeId { root: 5, ino: 256 }, b"snap", false).expect("snapshot");
    let ro = e
        .create_snapshot(5, InodeId { root: 5, ino: 256 }, b"snap-ro", true)
        .expect("read-only snapshot");
    let mut snap = top.clone();
    let snap_ro = top.clone();
    // The read-only snapshot refuses changes.
    let f = lookup(&e, ro, "f00001");
    let err = e
        .buffered_write(InodeId { root: ro, ino: f }, 0, b"x")
        .expect_err("write into a read-only snapshot");
    assert_eq!(err.posix_kind(), Some(PosixKind::ReadOnly), "{err}");
    // Changes on both sides.
    for i in (2..2500).step_by(5) {
        let name = format!("f{i:05}");
        e.unlink(InodeId { root: 5, ino: 256 }, name.as_bytes()).expect("unlink in the source");
        top.remove(&name);
    }
    for i in (1..2500).step_by(7) {
        let name = format!("f{i:05}");
        let data = rng.bytes(5000);
        let id = lookup(&e, rw, &name);
        e.buffered_write(InodeId { root: rw, ino: id }, 0, &data)
            .expect("overwrite in the snapshot");
        let m = snap.get_mut(&name).unwrap();
        if m.len() < data.len() {
            m.resize(data.len(), 0);
        }
        m[..data.len()].copy_from_slice(&data);
    }
    for i in (3..2500).step_by(11) {
        let name = format!("f{i:05}");
        e.unlink(InodeId { root: rw, ino: 256 }, name.as_bytes()).expect("unlink in the snapshot");
        snap.remove(&name);
    }
    let big = rng.bytes(2 << 20);
    create(&e, 5, "new-in-source", &big);
    top.insert("new-in-source".into(), big);
    let id = lookup(&e, 5, "f00500");
    let over = rng.bytes(100_000);
    e.buffered_write(InodeId { root: 5, ino: id }, 4096, &over)
        .expect("overwrite a large source file");
    top.get_mut("f00500").unwrap()[4096..4096 + over.len()].copy_from_slice(&over);
    // A snapshot of the snapshot.
    let rw2 = e
        .create_snapshot(rw, InodeId { root: rw, ino: 256 }, b"snap-of-snap", false)
        .expect("snapshot of a snapshot");
    let snap2 = snap.clone();
    e.sync().expect("sync");
    drop(e);
    assert_check(&s.path, "after snapshots and changes on both sides");
    let m = Mount::new(&s.path, true);
    kernel_matches(&m.path(""), &top, "source");
    kernel_matches(&m.path("snap"), &snap, "snapshot");
    kernel_matches(&m.path("snap-ro"), &snap_ro, "read-only snapshot");
    kernel_matches(&m.path("snap/snap-of-snap"), &snap2, "snapshot of the snapshot");
    let out = std::process::Command::new("btrfs")
        .args(["subvolume", "list", "-uq"])
        .arg(m.path(""))
        .output()
        .expect("btrfs subvolume list");
    let list = String::from_utf8_lossy(&out.stdout).into_owned();
    for id in [rw, ro, rw2] {
        assert!(
            list.lines()
                .any(|l| l.starts_with(&format!("ID {id} ")) && !l.contains("parent_uuid -")),
            "subvolume {id} with a parent uuid: {list}"
        );
    }
    let show = std::process::Command::new("btrfs")
        .args(["property", "get", "-ts"])
        .arg(m.path("snap-ro"))
        .arg("ro")
        .output()
        .expect("btrfs property get");
    assert!(
        String::from_utf8_lossy(&show.stdout).contains("ro=true"),
        "snap-ro is read-only for the kernel: {}{}",
        String::from_utf8_lossy(&show.stdout),
        String::from_utf8_lossy(&show.stderr)
    );
    // The kernel deletes the snapshot of the snapshot and the read-only one, and changes
    // shared files on both sides.
    for p in ["snap/snap-of-snap", "snap-ro"] {
        if p == "snap-ro" {
            assert!(std::process::Command::new("btrfs")
                .args(["property", "set", "-ts"])
                .arg(m.path(p))
                .args(["ro", "false"])
                .status()
                .unwrap()
                .success());
        }
        let o = std::process::Command::new("btrfs")
            .args(["subvolume", "delete"])
            .arg(m.path(p))
            .output()
            .expect("btrfs subvolume delete");
        assert!(
            o.status.success(),
            "btrfs subvolume delete {p}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    std::fs::write(m.path("f00001"), b"kernel was here").unwrap();
    std::fs::write(m.path("snap/f00002"), b"and here").unwrap();
    top.insert("f00001".into(), b"kernel was here".to_vec());
    snap.insert("f00002".into(), b"and here".to_vec());
    let o = std::process::Command::new("btrfs")
        .args(["subvolume", "sync"])
        .arg(m.path(""))
        .output()
        .expect("btrfs subvolume sync");
    assert!(o.status.success(), "btrfs subvolume sync: {}", String::from_utf8_lossy(&o.stderr));
    m.umount();
    assert_check(&s.path, "after the kernel deleted snapshots and changed shared files");
    let m = Mount::new(&s.path, false);
    kernel_matches(&m.path(""), &top, "source after the kernel's changes");
    kernel_matches(&m.path("snap"), &snap, "snapshot after the kernel's changes");
    m.umount();
}

#[test]
fn snapshot_refusals() {
    if !common::kernel_available("snapshot_refusals") {
        return;
    }
    let s = Scratch::mkfs("snap-refuse", 256 << 20, &[]);
    let mut w = s.writer();
    w.create_file(5, 256, b"a", &InodeAttrs::new(0o644)).expect("create");
    let kind = |r: ubtrfs_core::Result<u64>| r.expect_err("refused").posix_kind();
    assert_eq!(
        kind(w.create_snapshot(5, 5, 256, b"a", false)),
        Some(PosixKind::Exists),
        "a taken name"
    );
    assert_eq!(
        kind(w.create_snapshot(2, 5, 256, b"x", false)),
        Some(PosixKind::Invalid),
        "the extent tree is no subvolume"
    );
    assert_eq!(
        kind(w.create_snapshot(300, 5, 256, b"x", false)),
        Some(PosixKind::NotFound),
        "no such subvolume"
    );
    // The offline writer commits the source's changes first, then snapshots.
    let id = w.create_snapshot(5, 5, 256, b"snap", true).expect("snapshot");
    w.commit().expect("commit");
    drop(w);
    assert_check(&s.path, "after an offline snapshot");
    let m = Mount::new(&s.path, false);
    assert!(m.path("snap/a").exists(), "the snapshot holds the file made before it");
    m.umount();
    let _ = id;
}

/// With quotas on, a snapshot gets its level-0 qgroup and the commit recounts: right
/// after it the two share everything but their root blocks, and after changes on both
/// sides every qgroup is what `btrfs check` computes (in debug builds each incremental
/// commit is also compared with the full recount). Then the source is deleted and
/// dropped: its qgroup counts its tree until the drop ends, then nothing, and the
/// snapshot's exclusive is all it references.
#[test]
fn snapshots_with_quotas_keep_the_qgroups_exact() {
    if !common::kernel_available("snapshots_with_quotas_keep_the_qgroups_exact") {
        return;
    }
    let s = Scratch::mkfs("snap-quota", 512 << 20, &["-R", "quota", "-n", "4096"]);
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    let sv =
        e.write(|w| w.create_subvol(5, 256, b"sv", &InodeAttrs::new(0o755))).expect("subvolume");
    let mut rng = Rng::new(11);
    for i in 0..1500 {
        create(&e, sv, &format!("f{i:04}"), &rng.bytes((i % 5) * 3000));
    }
    let snap = e
        .create_snapshot(sv, InodeId { root: 5, ino: 256 }, b"snap", false)
        .expect("snapshot with quotas");
    let counts = |e: &Engine| e.write(|w| Ok(qgroup_counts(w))).expect("qgroup counts");
    let c = counts(&e);
    let ns = 4096;
    assert_eq!(c[&sv].0, c[&snap].0, "the snapshot references what its source does: {c:?}");
    assert_eq!((c[&sv].1, c[&snap].1), (ns, ns), "each owns only its root block: {c:?}");
    for i in (0..1500).step_by(9) {
        e.unlink(InodeId { root: sv, ino: 256 }, format!("f{i:04}").as_bytes())
            .expect("unlink in the source");
    }
    for i in (1..1500).step_by(13) {
        let id = lookup(&e, snap, &format!("f{i:04}"));
        e.buffered_write(InodeId { root: snap, ino: id }, 0, &rng.bytes(8000))
            .expect("overwrite in the snapshot");
    }
    e.sync().expect("sync");
    let c2 = counts(&e);
    assert!(c2[&snap].1 > ns && c2[&sv].1 > ns, "both own blocks of their own now: {c2:?}");
    drop(e);
    assert_check(&s.path, "after a snapshot with quotas and changes on both sides");
    // Deleting the source: its qgroup counts its tree until the drop, then nothing;
    // the snapshot then owns what they shared.
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    e.delete_subvol(InodeId { root: 5, ino: 256 }, b"sv").expect("delete with quotas");
    e.commit().expect("commit");
    assert_eq!(counts(&e)[&sv], c2[&sv], "a deleted subvolume counts its tree until it is dropped");
    let st = e.clean_dead_roots(&mut |_, _| true).expect("drop with quotas");
    assert!(st.done && st.tree_refs_dropped > 0, "{st:?}");
    let c3 = counts(&e);
    assert_eq!(c3[&sv], (0, 0), "the dropped subvolume's qgroup: {c3:?}");
    assert_eq!(c3[&snap].0, c3[&snap].1, "the snapshot owns everything it references now: {c3:?}");
    drop(e);
    assert_check(&s.path, "after deleting and dropping the source with quotas");
}
