//! Transaction handles: the metadata reservation a change takes before it begins, the
//! abort of a handle dropped unended, and the writeback inhibition of the blocks a
//! handle COWed (seed 002's mechanism).

mod common;
#[path = "common/write.rs"]
mod write_common;

use ubtrfs_core::data::write::WritePlan;
use ubtrfs_core::inode::filesystem::{InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::{FsRead, PosixKind};
use ubtrfs_format::key::FS_TREE_OBJECTID;
use write_common::*;

const ROOT: u64 = FS_TREE_OBJECTID;
const ROOT_DIR: u64 = 256;

#[test]
fn a_handle_dropped_unended_aborts() {
    let img = Scratch::fixture("blake2", "handle-dropped");
    let before = img.sha256();
    let mut w = img.writer();
    {
        let mut h = w.start_transaction("the dropped change", 3).expect("start");
        assert!(h.handle_reserved_bytes() > 0, "a start with items reserves metadata");
        assert_eq!(
            h.metadata_reserved(),
            h.handle_reserved_bytes(),
            "the handle's reservation is all that is reserved"
        );
        h.create_file(ROOT, ROOT_DIR, b"half-done", &InodeAttrs::new(0o644))
            .expect("create inside the handle");
        // Dropped here without `end`, as an early return after an error would.
    }
    let e = w.check_writable().expect_err("a dropped handle aborts");
    assert_eq!(e.posix_kind(), Some(PosixKind::ReadOnly));
    let msg = e.to_string();
    assert!(
        msg.contains("the dropped change") && msg.contains("dropped before it ended"),
        "abort names the handle: {msg}"
    );
    assert_eq!(w.metadata_reserved(), 0, "the dropped handle's reservation returned");
    assert!(w.commit().is_err(), "an aborted transaction does not commit");
    drop(w);
    assert_eq!(img.sha256(), before, "nothing of the aborted transaction reached the image");
}

#[test]
fn an_ended_handle_returns_its_reservation_and_keeps_its_changes() {
    let img = Scratch::fixture("blake2", "handle-ended");
    let mut w = img.writer();
    let ino = {
        let mut h = w.start_transaction("two files", 2).expect("start");
        let outer = h.handle_reserved_bytes();
        let a = h.create_file(ROOT, ROOT_DIR, b"a", &InodeAttrs::new(0o644)).expect("create a");
        let b = h.create_file(ROOT, ROOT_DIR, b"b", &InodeAttrs::new(0o644)).expect("create b");
        assert!(h.handle_reserved_bytes() > 0, "nested starts add to the handle's reservation");
        assert!(h.blocks_cowed() > 0);
        assert_ne!(a, b);
        assert!(outer > 0);
        h.end().expect("end");
        a
    };
    assert_eq!(w.metadata_reserved(), 0, "the rest of the reservation returned at the end");
    w.check_writable().expect("an ended handle does not abort");
    w.commit().expect("commit");
    drop(w);
    let fs = img.reader();
    let root = InodeId { root: ROOT, ino: ROOT_DIR };
    assert_eq!(fs.lookup(root, b"a").expect("lookup").map(|e| e.target.ino), Some(ino));
    assert!(fs.lookup(root, b"b").expect("lookup").is_some());
    drop(fs);
    if common::kernel_available(
        "an_ended_handle_returns_its_reservation_and_keeps_its_changes: btrfs check",
    ) {
        assert_check(&img.path, "after a handle of two creates");
    }
}

#[test]
fn a_reservation_that_cannot_be_met_fails_before_anything_changes() {
    let img = Scratch::fixture("blake2", "handle-enospc");
    let mut w = img.writer();
    w.hooks.refuse_chunk_alloc = true;
    let dirty = w.dirty_blocks();
    let e = w
        .start_transaction("too big", 1 << 30)
        .map(|_| ())
        .expect_err("a billion items do not fit");
    assert_eq!(e.posix_kind(), Some(PosixKind::NoSpace), "{e}");
    assert_eq!(w.dirty_blocks(), dirty, "nothing changed");
    assert_eq!(w.metadata_reserved(), 0);
    w.check_writable().expect("a refused start does not abort");
    w.create_file(ROOT, ROOT_DIR, b"after", &InodeAttrs::new(0o644))
        .expect("a small change still fits");
    w.commit().expect("commit");
}

/// A direct write holds its metadata reservation from `begin_write` (before its data
/// I/O) to `finish_write` or `cancel_write`; other changes meanwhile count it as taken.
#[test]
fn a_direct_write_holds_its_reservation_until_it_ends() {
    let img = Scratch::fixture("blake2", "handle-direct");
    let mut w = img.writer();
    let ino = w.create_file(ROOT, ROOT_DIR, b"direct", &InodeAttrs::new(0o644)).expect("create");
    assert_eq!(w.metadata_reserved(), 0);
    let data = vec![0x5au8; 256 << 10];
    let WritePlan::Direct(dw) = w.begin_write(ROOT, ino, 0, data.len() as u64).expect("begin")
    else {
        panic!("an aligned write into an empty file goes direct")
    };
    let held = w.metadata_reserved();
    assert!(held > 0, "begin_write reserved metadata");
    // A change in between leaves the direct write's reservation in place.
    w.create_file(ROOT, ROOT_DIR, b"meanwhile", &InodeAttrs::new(0o644)).expect("create meanwhile");
    assert_eq!(w.metadata_reserved(), held, "the direct write's reservation is still held");
    w.cancel_write(dw);
    assert_eq!(w.metadata_reserved(), 0, "cancel_write gave it back");
    let WritePlan::Direct(mut dw) =
        w.begin_write(ROOT, ino, 0, data.len() as u64).expect("begin again")
    else {
        panic!("direct")
    };
    assert_eq!(w.metadata_reserved(), held);
    dw.write_data(&w.info, &data).expect("data");
    w.finish_write(dw).expect("finish");
    assert_eq!(w.metadata_reserved(), 0, "finish_write used or returned it");
    w.commit().expect("commit");
    drop(w);
    let fs = img.reader();
    let v = fs.load_inode(InodeId { root: ROOT, ino }, Load::ALL).expect("inode");
    let mut got = vec![0u8; data.len()];
    fs.read_at(&v, 0, &mut got).expect("read");
    assert!(got == data, "the direct write's data");
}

/// Seed 002's COW amplification: a handle COWs a leaf, background writeback runs while
/// the handle lives, and the handle changes the leaf again. With the handle's blocks
/// inhibited the second change COWs nothing; without, the written leaf (and its path)
/// is COWed again.
#[test]
fn writeback_inside_a_handle_leaves_its_blocks_alone() {
    let run = |inhibit: bool| -> (u64, u64) {
        let img = Scratch::fixture(
            "blake2",
            if inhibit { "handle-inhibit" } else { "handle-no-inhibit" },
        );
        let mut w = img.writer();
        let mut inos = Vec::new();
        for i in 0..600 {
            inos.push(
                w.create_file(
                    ROOT,
                    ROOT_DIR,
                    format!("f{i:04}").as_bytes(),
                    &InodeAttrs::new(0o644),
                )
                .expect("create"),
            );
        }
        w.commit().expect("commit the files");
        let limit = 4 * w.nodesize() as usize;
        w.set_dirty_metadata_limit(limit);
        let early0 = w.blocks_written_early();
        let (second_cows, written) = {
            let mut h = w.join_transaction("amplification").expect("start");
            let touch = |h: &mut ubtrfs_core::FsWriter, ino: u64| {
                h.update_inode(InodeId { root: ROOT, ino }, |ii| {
                    ii.mode = (ii.mode.get() ^ 0o1).into()
                })
                .expect("update inode")
            };
            h.hooks.no_writeback_inhibition = !inhibit;
            touch(&mut h, inos[0]);
            assert!(
                !inhibit || h.handle_inhibited_blocks() > 0,
                "the handle inhibits the path it COWed"
            );
            // Other changes in the same handle, not inhibited, fill the dirty set past the
            // limit.
            h.hooks.no_writeback_inhibition = true;
            for &ino in inos.iter().step_by(25).skip(1) {
                touch(&mut h, ino);
            }
            h.hooks.no_writeback_inhibition = !inhibit;
            let over = h.dirty_blocks();
            h.background_writeback().expect("writeback inside the handle");
            let written = h.blocks_written_early() - early0;
            assert!(
                written > 0,
                "writeback wrote nothing ({over} dirty blocks): the test would prove nothing"
            );
            let before = h.blocks_cowed();
            touch(&mut h, inos[0]);
            let cows = h.blocks_cowed() - before;
            h.end().expect("end");
            (cows, written)
        };
        w.commit().expect("commit");
        drop(w);
        let fs = img.reader();
        let v = fs.load_inode(InodeId { root: ROOT, ino: inos[0] }, Load::ITEM).expect("inode");
        assert_eq!(v.item.mode.get() & 0o7777, 0o644, "touched twice: the mode is back");
        drop(fs);
        if inhibit
            && common::kernel_available(
                "writeback_inside_a_handle_leaves_its_blocks_alone: btrfs check",
            )
        {
            assert_check(&img.path, "after writeback inside a handle");
        }
        (second_cows, written)
    };
    let (with, written) = run(true);
    assert!(written > 0);
    let (without, _) = run(false);
    eprintln!("second change of the leaf: {with} blocks COWed with inhibition, {without} without ({written} blocks written inside the handle)");
    assert_eq!(with, 0, "an inhibited leaf is changed in place by its handle");
    assert!(without > 0, "without inhibition the written leaf is COWed again");
}

/// The inline buffer is bounded: a handle that COWs more blocks than it has slots
/// inhibits `INHIBIT_SLOTS` of them and no more, the rest stay writable by background
/// writeback inside the handle (nothing fails, only extra COW is possible), and
/// everything is released at the end. A record installed in its place
/// (`TestHooks::inhibit_record`, the seam of the benchmark's baseline) with no bound
/// records every block, and the handle releases them all.
#[test]
fn a_full_inhibition_buffer_stops_inhibiting_gracefully() {
    use ubtrfs_core::transaction::handle::{InhibitRecord, InhibitRecordFn, INHIBIT_SLOTS};
    /// Every block, in the order inhibited.
    #[derive(Default)]
    struct Unbounded(Vec<u64>);
    impl InhibitRecord for Unbounded {
        fn push(&mut self, bytenr: u64) -> bool {
            self.0.push(bytenr);
            true
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn drain(&mut self, f: &mut dyn FnMut(u64)) {
            self.0.drain(..).for_each(f);
        }
    }
    fn unbounded_record() -> Box<dyn InhibitRecord> {
        Box::<Unbounded>::default()
    }
    let run = |map: bool| -> usize {
        let img =
            Scratch::fixture("blake2", if map { "handle-full-map" } else { "handle-full-inline" });
        let mut w = img.writer();
        let mut inos = Vec::new();
        for i in 0..3000 {
            inos.push(
                w.create_file(
                    ROOT,
                    ROOT_DIR,
                    format!("g{i:05}").as_bytes(),
                    &InodeAttrs::new(0o644),
                )
                .expect("create"),
            );
        }
        w.commit().expect("commit the files");
        let limit = 4 * w.nodesize() as usize;
        w.set_dirty_metadata_limit(limit);
        w.hooks.inhibit_record = map.then_some(unbounded_record as InhibitRecordFn);
        let inhibited = {
            let mut h = w.join_transaction("many leaves").expect("start");
            // One inode in every 40: a different leaf each time.
            for &ino in inos.iter().step_by(40) {
                h.update_inode(InodeId { root: ROOT, ino }, |ii| {
                    ii.mode = (ii.mode.get() ^ 0o1).into()
                })
                .expect("update inode");
            }
            let n = h.handle_inhibited_blocks();
            h.background_writeback().expect("writeback inside the handle");
            for &ino in inos.iter().step_by(40) {
                h.update_inode(InodeId { root: ROOT, ino }, |ii| {
                    ii.mode = (ii.mode.get() ^ 0o1).into()
                })
                .expect("update inode again");
            }
            h.end().expect("end");
            n
        };
        assert_eq!(w.handle_inhibited_blocks(), 0, "nothing is inhibited after the handle");
        w.commit().expect("commit");
        drop(w);
        let fs = img.reader();
        for &ino in inos.iter().step_by(40) {
            assert_eq!(
                fs.load_inode(InodeId { root: ROOT, ino }, Load::ITEM)
                    .expect("inode")
                    .item
                    .mode
                    .get()
                    & 0o7777,
                0o644,
                "ino {ino}: touched twice"
            );
        }
        drop(fs);
        if common::kernel_available(
            "a_full_inhibition_buffer_stops_inhibiting_gracefully: btrfs check",
        ) {
            assert_check(&img.path, "after a handle that filled its inhibition buffer");
        }
        inhibited
    };
    assert_eq!(run(false), INHIBIT_SLOTS, "the inline buffer holds its slots and no more");
    assert!(run(true) > INHIBIT_SLOTS, "the installed record holds every block");
}
