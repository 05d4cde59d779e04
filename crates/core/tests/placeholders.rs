//! Placeholders: the entries a snapshot copies from its source for subvolumes nested in
//! it, which the snapshot does not hold. The kernel shows each as an empty directory
//! (objectid BTRFS_EMPTY_SUBVOL_DIR_OBJECTID, mode 0755, one link), answers ENOENT
//! below it, and its rmdir removes only the entry. Before ubtrfs knew them, it showed
//! the real subvolume there, and removing a file below the placeholder removed the real
//! subvolume's file.
//!
//! The images are the kernel's (`xtask/nested_snapshot.sh`); every result is compared
//! with what the kernel shows or does on a copy of the same image. Needs root, the
//! kernel btrfs driver and btrfs-progs; without them the tests print why and pass,
//! except under CI=true.

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;
use ubtrfs_core::engine::Engine;
use ubtrfs_core::error::PosixKind;
use ubtrfs_core::inode::attr::SetAttr;
use ubtrfs_core::inode::filesystem::{FileKind, InodeId, Load};
use ubtrfs_core::inode::write::InodeAttrs;
use ubtrfs_core::FileRead;
use ubtrfs_core::{FsRead, OpenOptions, TreeView};
use write_common::*;

const SV: u64 = 256;
const INNER: u64 = 257;
const HOME: u64 = 258;
const SNAP: u64 = 259;
const SVSNAP: u64 = 260;
const SNAP_RO: u64 = 261;

/// A scratch image made by `xtask/nested_snapshot.sh` (with `--delete` if asked).
fn kernel_image(tag: &str, delete: bool) -> Scratch {
    let s = Scratch::mkfs(tag, 256 << 20, &[]);
    let script = common::repo_root().join("xtask/nested_snapshot.sh");
    let mut c = Command::new("bash");
    c.arg(&script).arg(&s.path);
    if delete {
        c.arg("--delete");
    }
    let out = c.output().expect("run nested_snapshot.sh");
    assert!(out.status.success(), "nested_snapshot.sh: {}", String::from_utf8_lossy(&out.stderr));
    s
}

fn names<V: FsRead>(v: &V, path: &str) -> Vec<String> {
    let d = v.resolve(path, true).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut n: Vec<String> =
        d.entries.iter().map(|e| String::from_utf8_lossy(&e.name).into_owned()).collect();
    n.sort();
    n
}

fn kernel_names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    n.sort();
    n
}

/// Where the kernel and ubtrfs must agree: which entries are placeholders, their
/// attributes, their emptiness, and the real subvolumes' files.
#[test]
fn placeholders_read_as_the_kernel_shows_them() {
    if !common::kernel_available("placeholders_read_as_the_kernel_shows_them") {
        return;
    }
    let s = kernel_image("ph-read", false);
    let fs = s.reader();
    let m = Mount::new(&s.path, false);
    // (path, subvolume the entry names, tree holding the entry)
    let cases = [
        ("/snap/sv", SV, SNAP),
        ("/snap/home", HOME, SNAP),
        ("/svsnap/inner", INNER, SVSNAP),
        ("/snap-ro/sv", SV, SNAP_RO),
        ("/snap-ro/snap", SNAP, SNAP_RO),
        ("/snap-ro/svsnap", SVSNAP, SNAP_RO),
    ];
    for (path, subvol, tree) in cases {
        let (parent, name) = path.rsplit_once('/').unwrap();
        let dir = fs.resolve_id(if parent.is_empty() { "/" } else { parent }, true).unwrap();
        let e =
            fs.lookup(dir, name.as_bytes()).unwrap().unwrap_or_else(|| panic!("{path}: no entry"));
        assert_eq!(e.placeholder_of, Some(subvol), "{path}");
        assert!(e.is_subvol, "{path}");
        assert_eq!(e.target, InodeId::placeholder(tree), "{path}");
        let v = fs.load_inode(e.target, Load::ALL).unwrap();
        let k = std::fs::metadata(m.path(&path[1..])).unwrap();
        assert_eq!(v.id.ino, k.ino(), "{path}: inode number");
        assert_eq!(v.mode(), k.mode(), "{path}: mode");
        assert_eq!(v.nlink() as u64, k.nlink(), "{path}: links");
        assert_eq!(v.size(), k.size(), "{path}: size");
        assert_eq!((v.item.uid.get(), v.item.gid.get()), (k.uid(), k.gid()), "{path}: owner");
        assert_eq!(v.kind(), FileKind::Dir);
        assert!(v.entries.is_empty() && v.xattrs.is_empty(), "{path}: not empty");
        assert!(kernel_names(&m.path(&path[1..])).is_empty());
        // Nothing below it, as the kernel's ENOENT.
        let err = fs.resolve_id(&format!("{path}/f"), true).unwrap_err();
        assert_eq!(err.posix_kind(), Some(PosixKind::NotFound), "{path}/f: {err}");
        assert!(!m.path(&format!("{}/f", &path[1..])).exists());
    }
    // The real subvolumes read as before, and every listing is the kernel's.
    assert_eq!(fs.read_at(&fs.resolve("/sv/f", true).unwrap(), 0, &mut [0u8; 16]).unwrap(), 6);
    for dir in
        ["/", "/snap", "/snap-ro", "/sv", "/svsnap", "/sv/inner", "/snap/sv", "/svsnap/inner"]
    {
        assert_eq!(names(&fs, dir), kernel_names(&m.path(&dir[1..])), "{dir}");
    }
    let e = fs.lookup(fs.resolve_id("/sv", true).unwrap(), b"inner").unwrap().unwrap();
    assert_eq!(
        (e.placeholder_of, e.target),
        (None, InodeId { root: INNER, ino: 256 }),
        "the real nested subvolume"
    );
    m.umount();
}

/// After the kernel deletes the subvolumes, the snapshots' entries of them still list
/// (they were a "names subvolume 256 which has no root item" error before).
#[test]
fn placeholders_outlive_their_deleted_subvolumes() {
    if !common::kernel_available("placeholders_outlive_their_deleted_subvolumes") {
        return;
    }
    let s = kernel_image("ph-deleted", true);
    let fs = s.reader();
    let m = Mount::new(&s.path, false);
    for dir in ["/", "/snap", "/snap-ro", "/svsnap", "/snap/sv", "/svsnap/inner"] {
        assert_eq!(names(&fs, dir), kernel_names(&m.path(&dir[1..])), "{dir}");
    }
    let e = fs.lookup(fs.resolve_id("/snap", true).unwrap(), b"sv").unwrap().unwrap();
    assert_eq!(e.placeholder_of, Some(SV));
    assert!(fs.read_root(SV).is_err(), "the kernel's cleaner dropped subvolume {SV}");
    m.umount();
}

/// Every change aimed at a placeholder is refused with the kernel's errno (and changes
/// nothing; the filesystem stays writable), except its rmdir, which removes the entry
/// alone, and chmod/utimes, which the kernel's in-memory inode takes without storing.
/// The rmdir's result is compared with the kernel's rmdir on a copy of the image.
#[test]
fn placeholders_refuse_changes_and_rmdir_removes_only_the_entry() {
    if !common::kernel_available("placeholders_refuse_changes_and_rmdir_removes_only_the_entry") {
        return;
    }
    let s = kernel_image("ph-write", false);
    let before = s.sha256();
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("open");
    let ph = InodeId::placeholder(SNAP);
    let snap_top = 256;
    let a = InodeAttrs::new(0o644);
    let kind = |r: ubtrfs_core::Result<()>| {
        r.map_err(|e| e.posix_kind().unwrap_or_else(|| panic!("not a POSIX refusal: {e}")))
    };
    let refusals: Vec<(&str, Result<(), PosixKind>, PosixKind)> = vec![
        (
            "create in it",
            kind(e.write(|w| w.create_file(SNAP, ph.ino, b"x", &a).map(drop))),
            PosixKind::PermissionDenied,
        ),
        (
            "mkdir in it",
            kind(e.write(|w| w.mkdir(SNAP, ph.ino, b"d", &InodeAttrs::new(0o755)).map(drop))),
            PosixKind::NotPermitted,
        ),
        (
            "symlink in it",
            kind(e.write(|w| w.symlink(SNAP, ph.ino, b"l", b"t", &a).map(drop))),
            PosixKind::NotPermitted,
        ),
        (
            "unlink below it",
            kind(e.unlink(InodeId { root: SNAP, ino: ph.ino }, b"f")),
            PosixKind::NotFound,
        ),
        (
            "unlink of it",
            kind(e.unlink(InodeId { root: SNAP, ino: snap_top }, b"sv")),
            PosixKind::IsDir,
        ),
        (
            "rename of it",
            kind(e.rename(
                InodeId { root: SNAP, ino: snap_top },
                b"sv",
                InodeId { root: SNAP, ino: snap_top },
                b"sv2",
                0,
            )),
            PosixKind::NotEmpty,
        ),
        (
            "rename into it",
            kind(e.rename(
                InodeId { root: SNAP, ino: snap_top },
                b"topfile",
                InodeId { root: SNAP, ino: ph.ino },
                b"topfile",
                0,
            )),
            PosixKind::NotPermitted,
        ),
        (
            "setxattr",
            kind(e.write(|w| w.setxattr(InodeId { root: SNAP, ino: ph.ino }, b"user.a", b"1", 0))),
            PosixKind::NotSupported,
        ),
        (
            "chattr",
            kind(e.write(|w| w.set_fsflags(InodeId { root: SNAP, ino: ph.ino }, 0x10))),
            PosixKind::NotSupported,
        ),
        (
            "subvolume delete",
            kind(e.delete_subvol(InodeId { root: SNAP, ino: snap_top }, b"sv").map(drop)),
            PosixKind::Invalid,
        ),
    ];
    for (what, got, want) in refusals {
        assert_eq!(got, Err(want), "{what}");
    }
    // chmod succeeds and stores nothing.
    e.setattr(ph, &SetAttr { mode: Some(0o700), ..SetAttr::default() })
        .expect("chmod of a placeholder");
    assert_eq!(e.read(|l| l.load_inode(ph, Load::ITEM)).unwrap().mode(), 0o40755);
    // Nothing changed: the commit has nothing to write.
    e.commit().unwrap();
    drop(e);
    assert_eq!(s.sha256(), before, "a refused change wrote something");

    // The kernel's rmdir of the same placeholders, on a copy.
    let k = Scratch::mkfs("ph-write-kernel", 256 << 20, &[]);
    std::fs::copy(&s.path, &k.path).unwrap();
    let m = Mount::new(&k.path, true);
    for p in ["snap/sv", "snap/home", "svsnap/inner"] {
        std::fs::remove_dir(m.path(p)).unwrap_or_else(|err| panic!("kernel rmdir {p}: {err}"));
    }
    m.umount();

    // Ours, and the filesystem stays writable after the refusals above.
    let e = Engine::open(&OpenOptions::new(&s.path)).expect("reopen");
    e.rmdir(InodeId { root: SNAP, ino: snap_top }, b"sv").expect("rmdir /snap/sv");
    e.rmdir(InodeId { root: SNAP, ino: snap_top }, b"home").expect("rmdir /snap/home");
    e.rmdir(InodeId { root: SVSNAP, ino: 256 }, b"inner").expect("rmdir /svsnap/inner");
    e.write(|w| w.create_file(SNAP, snap_top, b"after", &a).map(drop))
        .expect("a create after the refusals");
    e.commit().unwrap();
    drop(e);
    assert_check(&s.path, "after the placeholders' rmdir");
    assert_check(&k.path, "after the kernel's rmdir");
    let (ours, theirs) = (s.reader(), k.reader());
    for dir in ["/snap", "/svsnap"] {
        let mut want = names(&theirs, dir);
        if dir == "/snap" {
            want.push("after".into());
            want.sort();
        }
        assert_eq!(names(&ours, dir), want, "{dir}");
        let (o, t) = (ours.resolve(dir, true).unwrap(), theirs.resolve(dir, true).unwrap());
        let extra = if dir == "/snap" { 2 * "after".len() as u64 } else { 0 };
        assert_eq!(o.size(), t.size() + extra, "{dir}: directory size");
    }
    // The real subvolumes lost nothing.
    assert_eq!(names(&ours, "/sv"), ["d", "f", "inner"]);
    assert_eq!(names(&ours, "/sv/inner"), ["g"]);
    let m = Mount::new(&s.path, false);
    assert_eq!(std::fs::read(m.path("sv/f")).unwrap(), b"in-sv\n");
    assert_eq!(std::fs::read(m.path("sv/inner/g")).unwrap(), b"in-inner\n");
    assert_eq!(kernel_names(&m.path("snap")), ["after", "topfile"]);
    m.umount();
}
