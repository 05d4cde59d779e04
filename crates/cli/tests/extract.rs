//! `ubtrfs extract` end to end: salvage of damaged images (a data sector bad in every
//! copy, a tree leaf bad in both DUP copies), `--strict`, `--dry-run`, escaped names in
//! warnings, exit statuses, preallocation, non-root extraction (setuid bits cleared),
//! and, as root, xattrs of every namespace (file capabilities, ACLs, trusted.*) checked
//! with getcap/getfacl/getfattr against a kernel mount of the source, and the short
//! warnings of an ext4 destination that cannot hold every xattr.
//!
//! Damaged images are copies of the kernel-made fixtures, patched at physical offsets
//! found through ubtrfs's own chunk map, so everything but the root tests runs without
//! root. Trees are compared through `xtask/fixtures.py manifest` (contents, modes,
//! owners, times, xattrs).

#[path = "../../core/tests/common/mod.rs"]
mod common;

use serde_json::Value;
use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use ubtrfs_core::{
    quote, ExtentKind, FileKind, Filesystem, FsRead, InodeView, Load, OpenOptions, TreeView,
};
use ubtrfs_format::key::{DIR_INDEX_KEY, FS_TREE_OBJECTID, INODE_ITEM_KEY};
use ubtrfs_format::Key;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ubtrfs"))
}

fn out_of(cmd: &mut Command) -> Output {
    cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

fn run(cmd: &mut Command) -> Output {
    let out = out_of(cmd);
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A private work directory, removed on drop unless KEEP is set.
struct Work(PathBuf);

impl Work {
    fn new(tag: &str, base: &Path) -> Work {
        let d = base.join(format!("ubtrfs-extract-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("work dir");
        Work(d)
    }
    fn path(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        if std::env::var_os("KEEP").is_some() {
            eprintln!("kept {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Extract an undamaged image: all arrives, but as non-root device nodes (exit status 2
/// for those alone) and owners.
fn clean_extract(img: &Path, dest: &Path) -> String {
    let o = out_of(bin().arg("extract").arg(img).arg(dest));
    let err = stderr(&o);
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc_geteuid() } == 0;
    let only_devices = !root
        && err
            .lines()
            .filter(|l| l.starts_with("extract: "))
            .all(|l| l.ends_with(" files not created; see the warnings above") && !l.contains(','));
    assert!(
        o.status.success() || o.status.code() == Some(2) && only_devices,
        "clean extract failed:\n{err}"
    );
    assert!(!err.contains("unreadable"), "{err}");
    err
}

/// A copy of fixture `name`'s (single) device image.
fn fixture_copy(name: &str, dst: &Path) {
    let src = &common::fixture_images(name)[0];
    let ok = Command::new("cp")
        .arg("--sparse=always")
        .arg(src)
        .arg(dst)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        std::fs::copy(src, dst).expect("copy fixture");
    }
}

fn open(img: &Path) -> Filesystem {
    Filesystem::open(&OpenOptions::new(img)).unwrap_or_else(|e| panic!("{}: {e}", img.display()))
}

/// Flip bytes at `len` bytes from `logical` in every copy (single-device image).
fn damage_every_copy(img: &Path, logical: u64, at: u64, len: usize) {
    let fs = open(img);
    let chunk = fs.info.chunk_map.lookup(ubtrfs_core::Logical(logical)).expect("mapped").clone();
    drop(fs);
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().read(true).write(true).open(img).expect("open image");
    for m in 0..chunk.num_copies() {
        let (_, phys, _) = chunk.map(logical, m);
        let mut b = vec![0u8; len];
        f.read_exact_at(&mut b, phys + at).expect("read");
        b.iter_mut().for_each(|x| *x ^= 0xa5);
        f.write_all_at(&b, phys + at).expect("write");
    }
}

/// Every inode under the top with its path (names joined by '/', raw bytes).
fn walk(fs: &Filesystem) -> Vec<(Vec<u8>, InodeView)> {
    let top = fs.load_inode(fs.root_dir(), Load::ALL).expect("root dir");
    let mut out = Vec::new();
    let mut stack = vec![(Vec::new(), top)];
    while let Some((path, dir)) = stack.pop() {
        for e in &dir.entries {
            let mut p = path.clone();
            if !p.is_empty() {
                p.push(b'/');
            }
            p.extend_from_slice(&e.name);
            let child = fs.load_inode(e.target, Load::ALL).expect("inode");
            if child.kind() == FileKind::Dir {
                stack.push((p.clone(), child.clone()));
            }
            out.push((p, child));
        }
    }
    out
}

/// The manifest of a host tree, keyed by path (as the script prints it).
fn manifest(dir: &Path) -> BTreeMap<String, Value> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } != 0 {
        // The script reads every file; without root a mode-0000 file of ours cannot be
        // read. Both trees of a comparison get the same change.
        run(Command::new("chmod").arg("-R").arg("u+rX").arg(dir));
    }
    let script = common::repo_root().join("xtask/fixtures.py");
    let o = run(Command::new("python3").arg(script).arg("manifest").arg(dir));
    String::from_utf8(o.stdout)
        .expect("utf8 manifest")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("json"))
        .map(|v| (v["path"].as_str().expect("path").to_string(), v))
        .collect()
}

/// What must agree between two extracts of the same tree (directory sizes and link
/// counts follow what the destination holds, inode numbers and blocks differ anyway,
/// and listing a directory, as `manifest` does without root, moves its atime).
fn same_object(a: &Value, b: &Value) -> bool {
    let dir = a["type"] == "dir" && b["type"] == "dir";
    [
        "type",
        "mode",
        "uid",
        "gid",
        "size",
        "mtime_ns",
        "atime_ns",
        "rdev_major",
        "rdev_minor",
        "sha256",
        "target",
        "xattrs",
    ]
    .iter()
    .all(|k| (dir && matches!(*k, "size" | "atime_ns")) || a[*k] == b[*k])
}

/// True if a warning line names `host` or a directory above it.
fn named_in(warnings: &[&str], dest: &Path, rel: &str) -> bool {
    let mut p = rel;
    loop {
        let host = if p.is_empty() {
            quote::path(dest).into_owned()
        } else {
            format!("{}/{}", quote::path(dest), quote::name(p.as_bytes()))
        };
        if warnings.iter().any(|w| w.starts_with(&format!("ubtrfs: warning: {host}: "))) {
            return true;
        }
        if p.is_empty() {
            return false;
        }
        p = p.rfind('/').map(|i| &p[..i]).unwrap_or("");
    }
}

/// Compare a salvage extract with a clean one: every path of the clean tree is in the
/// salvaged one unchanged, or it (or a directory above it) is named in a warning, and
/// the salvaged tree has nothing extra. Returns the paths that differ.
fn compare_salvaged(clean: &Path, bad: &Path, err: &str) -> Vec<String> {
    let (a, b) = (manifest(clean), manifest(bad));
    let warnings: Vec<&str> = err.lines().filter(|l| l.starts_with("ubtrfs: warning: ")).collect();
    // Other names of a damaged file are the same host inode.
    let named_inodes: std::collections::HashSet<&Value> =
        b.iter().filter(|(p, _)| named_in(&warnings, bad, p)).map(|(_, v)| &v["ino"]).collect();
    let mut differ = Vec::new();
    for (p, va) in &a {
        if b.get(p).is_some_and(|vb| same_object(va, vb)) {
            continue;
        }
        let link_of_named =
            b.get(p).is_some_and(|vb| vb["type"] == "file" && named_inodes.contains(&vb["ino"]));
        assert!(link_of_named || named_in(&warnings, bad, p), "{p:?} is missing or differs, and no warning names it or a directory above it\nclean: {va}\nsalvaged: {:?}\nstderr:\n{err}", b.get(p));
        differ.push(p.clone());
    }
    for p in b.keys() {
        assert!(a.contains_key(p), "{p:?} extracted from the damaged image only");
    }
    differ
}

/// A file of the image (at `want`, else any but `exclude`) with an uncompressed regular
/// extent of at least three sectors inside the file's size, and one link: its path,
/// and the file offset and logical address of the middle one of those sectors.
fn three_sector_file(fs: &Filesystem, want: Option<&[u8]>, exclude: &[u8]) -> (Vec<u8>, u64, u64) {
    let ss = u64::from(fs.info.sectorsize);
    for (path, v) in walk(fs) {
        if v.kind() != FileKind::File
            || v.nlink() != 1
            || path == exclude
            || want.is_some_and(|w| w != path)
        {
            continue;
        }
        for e in &v.extents {
            if let ExtentKind::Regular {
                disk_bytenr,
                offset,
                num_bytes,
                compression: 0,
                prealloc: false,
                ..
            } = e.kind
            {
                if disk_bytenr != 0 && num_bytes >= 3 * ss && e.file_offset + 3 * ss <= v.size() {
                    return (path, e.file_offset + ss, disk_bytenr + offset + ss);
                }
            }
        }
    }
    panic!("no file with a three-sector uncompressed extent (want {want:?})");
}

/// A data sector bad in both DUP copies, in a fixture file and in a file with a newline
/// in its name: both files are kept with that sector as a hole and the rest intact, the
/// ranges are listed (escaped), the rest of the tree is identical, exit status 2;
/// `--dry-run` reports the same without writing; `--strict` stops with an error naming
/// the file and removes the partial copy.
#[test]
fn bad_data_sector_is_left_as_a_hole() {
    let w = Work::new("data", &std::env::temp_dir());
    let img = w.path("img");
    fixture_copy("dup-data", &img);
    // A file with a newline in its name, written by ubtrfs itself (no root needed).
    let host_src = w.path("new\nline-data");
    let content: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8 + 1).collect();
    std::fs::write(&host_src, &content).unwrap();
    run(bin().arg("put").arg(&img).arg(&host_src).arg("/new\nline-data"));
    let clean = w.path("clean");
    clean_extract(&img, &clean);

    let fs = open(&img);
    let ss = u64::from(fs.info.sectorsize);
    let (nl_path, nl_off, nl_logical) = three_sector_file(&fs, Some(b"new\nline-data"), b"");
    let (path, off, logical) = three_sector_file(&fs, None, &nl_path);
    assert_eq!(fs.info.num_copies(ubtrfs_core::Logical(logical)), 2, "data is DUP");
    drop(fs);
    damage_every_copy(&img, logical, 100, 8);
    damage_every_copy(&img, nl_logical, 4000, 8);

    let bad = w.path("bad");
    let o = out_of(bin().arg("extract").arg(&img).arg(&bad));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let host = format!("{}/{}", bad.display(), quote::name(&path));
    let want = format!("ubtrfs: warning: {host}: bytes {off}..{} unreadable (data checksum mismatch at logical {logical} in every copy); left as a hole", off + ss);
    assert!(err.lines().any(|l| l == want), "no line {want:?} in\n{err}");
    let want_nl =
        format!("ubtrfs: warning: {}/new\\nline-data: bytes {nl_off}..{} unreadable (data checksum mismatch at logical {nl_logical} in every copy); left as a hole", bad.display(), nl_off + ss);
    assert!(err.lines().any(|l| l == want_nl), "no line {want_nl:?} (escaped newline) in\n{err}");
    assert!(err.contains("extract: 2 files incomplete"), "{err}");

    let mut differ = compare_salvaged(&clean, &bad, &err);
    differ.sort();
    let mut expect = vec![String::from_utf8(path.clone()).unwrap(), "new\nline-data".to_string()];
    expect.sort();
    assert_eq!(differ, expect, "only the damaged files differ");
    for (p, o) in [(path.as_slice(), off), (nl_path.as_slice(), nl_off)] {
        let rel = String::from_utf8(p.to_vec()).unwrap();
        let good = std::fs::read(clean.join(&rel)).unwrap();
        let got = std::fs::read(bad.join(&rel)).unwrap();
        assert_eq!(got.len(), good.len(), "{rel:?}: size");
        let (s, e) = (o as usize, (o + ss) as usize);
        assert_eq!(&got[..s], &good[..s], "{rel:?}: bytes before the bad sector");
        assert_eq!(&got[e..], &good[e..], "{rel:?}: bytes after the bad sector");
        assert!(got[s..e].iter().all(|&b| b == 0), "{rel:?}: the bad sector reads as zeros");
        let (gb, cb) = (
            std::fs::metadata(bad.join(&rel)).unwrap().blocks(),
            std::fs::metadata(clean.join(&rel)).unwrap().blocks(),
        );
        assert!(gb < cb, "{rel:?}: the bad sector is a hole ({gb} blocks, clean copy {cb})");
    }
    assert_eq!(std::fs::read(bad.join("new\nline-data")).unwrap()[..4096], content[..4096]);

    // A dry run reports the same and writes nothing.
    let dry = w.path("dry/dest");
    let o = out_of(bin().arg("extract").arg("--dry-run").arg(&img).arg(&dry));
    let derr = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{derr}");
    assert!(
        derr.contains(&format!(
            "{}: bytes {off}..{} unreadable",
            quote::path(&dry.join(String::from_utf8(path.clone()).unwrap())),
            off + ss
        )),
        "{derr}"
    );
    assert!(!w.path("dry").exists(), "a dry run created its destination's parent");

    // Strict: stop at the first error, naming the file, without a partial copy.
    let strict = w.path("strict");
    let o = out_of(bin().arg("extract").arg("--strict").arg(&img).arg(&strict));
    let serr = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{serr}");
    let error = serr
        .lines()
        .find(|l| l.starts_with("ubtrfs: error: "))
        .unwrap_or_else(|| panic!("no error line in {serr}"));
    let first = [&path, &nl_path]
        .into_iter()
        .find(|p| error.contains(&format!("{}/{}: ", strict.display(), quote::name(p))))
        .unwrap_or_else(|| panic!("the error names neither damaged file: {error}"));
    assert!(error.contains("csum mismatch"), "{error}");
    let rel = String::from_utf8(first.clone()).unwrap();
    assert!(!strict.join(&rel).exists(), "strict left a partial copy of {rel:?}");
    assert!(serr.contains("removed the partial copy"), "{serr}");
}

/// A compressed extent bad on disk: it is only readable whole, so its whole file range
/// becomes a hole and the file's other extents arrive intact.
#[test]
fn bad_compressed_extent_is_left_as_a_hole() {
    let w = Work::new("zstd", &std::env::temp_dir());
    let img = w.path("img");
    fixture_copy("zstd", &img);
    let clean = w.path("clean");
    clean_extract(&img, &clean);
    let fs = open(&img);
    let compressed = |e: &ubtrfs_core::FileExtentRec| matches!(e.kind, ExtentKind::Regular { disk_bytenr, compression, .. } if disk_bytenr != 0 && compression != 0);
    let tree = walk(&fs);
    // Extents referenced once (a reflink would lose the range too).
    let mut refs: BTreeMap<u64, usize> = BTreeMap::new();
    for (_, v) in &tree {
        for x in &v.extents {
            if let ExtentKind::Regular { disk_bytenr, .. } = x.kind {
                *refs.entry(disk_bytenr).or_default() += 1;
            }
        }
    }
    let unshared = |x: &ubtrfs_core::FileExtentRec| matches!(x.kind, ExtentKind::Regular { disk_bytenr, .. } if refs[&disk_bytenr] == 1);
    // A compressed extent with data before and after it in the same file.
    let (path, v, e) = tree
        .iter()
        .filter(|(_, v)| v.kind() == FileKind::File && v.nlink() == 1)
        .find_map(|(p, v)| {
            let n = v.extents.len();
            v.extents
                .iter()
                .enumerate()
                .find(|(i, x)| {
                    *i > 0 && *i + 1 < n && compressed(x) && unshared(x) && x.end() <= v.size()
                })
                .map(|(_, x)| (p.clone(), v.clone(), x.clone()))
        })
        .expect("an unshared compressed extent inside a file");
    let ExtentKind::Regular { disk_bytenr, .. } = e.kind else { unreachable!() };
    drop(fs);
    damage_every_copy(&img, disk_bytenr, 100, 8);
    let bad = w.path("bad");
    let o = out_of(bin().arg("extract").arg(&img).arg(&bad));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let (s, t) = (e.file_offset, e.end().min(v.size()));
    let want = format!("ubtrfs: warning: {}/{}: bytes {s}..{t} unreadable (data checksum mismatch at logical {disk_bytenr}, the only copy); left as a hole", bad.display(), quote::name(&path));
    assert!(err.lines().any(|l| l == want), "no line {want:?} in\n{err}");
    let differ = compare_salvaged(&clean, &bad, &err);
    assert_eq!(differ, vec![String::from_utf8(path.clone()).unwrap()]);
    let rel = String::from_utf8(path).unwrap();
    let (good, got) =
        (std::fs::read(clean.join(&rel)).unwrap(), std::fs::read(bad.join(&rel)).unwrap());
    let (s, t) = (s as usize, t as usize);
    assert_eq!((&got[..s], &got[t..]), (&good[..s], &good[t..]), "outside the bad extent");
    assert!(got[s..t].iter().all(|&b| b == 0));
}

/// Both DUP copies of one fs-tree leaf bad: (a) a leaf in the middle of a big
/// directory's entries: the directory is extracted without those entries and named as
/// incomplete; (b) the leaf holding a directory's inode and its children's: that
/// subtree is named as not extracted. Everything else is identical to a clean extract;
/// exit status 2.
#[test]
fn unreadable_leaf_skips_only_what_it_held() {
    let w = Work::new("leaf", &std::env::temp_dir());
    let orig = w.path("orig");
    fixture_copy("default", &orig);
    let clean = w.path("clean");
    clean_extract(&orig, &clean);
    let fs = open(&orig);
    let tree = walk(&fs);
    let (big_path, big) = tree
        .iter()
        .filter(|(_, v)| v.kind() == FileKind::Dir && v.id.root == FS_TREE_OBJECTID)
        .max_by_key(|(_, v)| v.entries.len())
        .expect("a directory");
    assert!(big.entries.len() > 1000, "{} entries", big.entries.len());
    let root = fs.fs_root(FS_TREE_OBJECTID).unwrap();
    let leaf_of =
        |k: Key| fs.info.search_slot(&root, &k).expect("search").into_path().leaf().bytenr;
    let mid =
        leaf_of(Key::new(big.id.ino, DIR_INDEX_KEY, big.entries[big.entries.len() / 2].index));
    assert_ne!(
        mid,
        leaf_of(Key::new(big.id.ino, INODE_ITEM_KEY, 0)),
        "the big directory's inode is in another leaf"
    );
    let (names_path, names) = tree.iter().find(|(p, _)| p == b"names").expect("names dir");
    let names_leaf = leaf_of(Key::new(names.id.ino, INODE_ITEM_KEY, 0));
    let nodesize = fs.info.nodesize as u64;
    drop(fs);
    let cases = [
        (
            mid,
            big_path.clone(),
            "directory incomplete: some entries unreadable (",
            "1 directory incomplete",
        ),
        (
            names_leaf,
            names_path.clone(),
            "directory not extracted, nor anything under it (",
            " directories unreadable",
        ),
    ];
    for (i, (leaf, dir, says, summary)) in cases.into_iter().enumerate() {
        let img = w.path(&format!("img{i}"));
        std::fs::copy(&orig, &img).unwrap();
        damage_every_copy(&img, leaf, nodesize / 2, 16);
        let bad = w.path(&format!("bad{i}"));
        let o = out_of(bin().arg("extract").arg(&img).arg(&bad));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        let want = format!("ubtrfs: warning: {}/{}: {says}", bad.display(), quote::name(&dir));
        assert!(err.lines().any(|l| l.starts_with(&want)), "no line starting {want:?} in\n{err}");
        assert!(err.contains(summary), "no {summary:?} in the summary:\n{err}");
        let differ = compare_salvaged(&clean, &bad, &err);
        assert!(!differ.is_empty(), "nothing was lost with leaf {leaf} bad");
        eprintln!(
            "leaf {leaf} bad: {} paths lost or changed, warnings:\n{}",
            differ.len(),
            err.lines().filter(|l| l.contains("warning")).take(10).collect::<Vec<_>>().join("\n")
        );
    }
}

/// `--dry-run` writes nothing (not even DEST) and lists every path with its type,
/// names escaped.
#[test]
fn dry_run_lists_every_path_and_writes_nothing() {
    let w = Work::new("dry", &std::env::temp_dir());
    let img = &common::fixture_images("default")[0];
    let dest = w.path("not/there");
    let o = run(bin().arg("extract").arg("-n").arg(img).arg(&dest));
    assert!(!w.path("not").exists(), "a dry run created something");
    let listing = String::from_utf8(o.stdout).expect("escaped listing is UTF-8");
    let prefix = format!("{}", dest.display());
    let mut got = BTreeMap::new();
    for l in listing.lines() {
        let (kind, path) = l.split_once(' ').unwrap_or_else(|| panic!("bad line {l:?}"));
        let rel =
            path.strip_prefix(&prefix).unwrap_or_else(|| panic!("{path:?} is not under {prefix}"));
        assert!(
            got.insert(rel.trim_start_matches('/').to_string(), kind.to_string()).is_none(),
            "{rel:?} listed twice"
        );
    }
    let want = common::manifest("default");
    assert_eq!(got.len(), want.len(), "one line per path");
    let mut links = 0;
    for (p, v) in &want {
        let shown = quote::name(p.as_bytes()).into_owned();
        let kind = got.get(&shown).unwrap_or_else(|| panic!("{shown:?} not listed"));
        let letter = match v["type"].as_str().unwrap() {
            "file" => "-",
            "dir" => "d",
            "symlink" => "l",
            "fifo" => "p",
            "chr" => "c",
            "blk" => "b",
            "sock" => "s",
            t => panic!("type {t}"),
        };
        // 'h': another name of a file listed before (the fixture's 151-link file, ...).
        let is_link = kind == "h" && v["nlink"].as_u64() > Some(1);
        links += usize::from(is_link);
        assert!(
            kind == letter || is_link && letter == "-",
            "{shown:?}: listed as {kind}, is {letter}"
        );
    }
    assert!(links > 150, "{links} hard links listed");
    assert!(got.contains_key("names/new\\nline"), "the newline name is escaped");
    assert!(!listing.contains("new\nline"));
}

/// Preallocated ranges stay preallocated (inside the file and past its end); a second
/// extract into the same place stops at the first existing name.
#[test]
fn preallocated_extents_stay_preallocated() {
    let w = Work::new("prealloc", &std::env::temp_dir());
    let img = &common::fixture_images("default")[0];
    let dest = w.path("out");
    run(bin().arg("extract").arg(img).arg("--path").arg("/prealloc").arg(&dest));
    let want = common::manifest("default");
    for name in ["falloc-1m", "falloc-keep-size", "falloc-written-64k"] {
        let md = std::fs::metadata(dest.join(name)).unwrap();
        let kernel_blocks = want[&format!("prealloc/{name}")]["blocks"].as_u64().unwrap();
        assert!(
            md.blocks() >= kernel_blocks,
            "{name}: {} blocks, the kernel's {kernel_blocks}",
            md.blocks()
        );
        assert_eq!(md.len(), want[&format!("prealloc/{name}")]["size"].as_u64().unwrap());
    }
    // A second run into the same place replaces nothing and says why it stopped.
    let before = std::fs::read(dest.join("falloc-written-64k")).unwrap();
    let o = out_of(bin().arg("extract").arg(img).arg("--path").arg("/prealloc").arg(&dest));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("(extract never replaces what exists): ")
            && err.contains("extract: stopped; "),
        "{err}"
    );
    assert_eq!(std::fs::read(dest.join("falloc-written-64k")).unwrap(), before);
}

/// Without root: owners are not kept (one summary line), setuid/setgid bits of files
/// whose owner is not kept are cleared and said once for the file, device nodes are not
/// created, and the exit status says something was not created. As root the extract
/// runs as `nobody` through setpriv.
#[test]
fn non_root_clears_setuid_and_says_so() {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc_geteuid() };
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let w = Work::new("nonroot", &base);
    let img = w.path("img");
    fixture_copy("default", &img);
    let mut cmd = if uid == 0 {
        let have = Command::new("setpriv")
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !have {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "setpriv missing, and CI=true forbids skipping"
            );
            eprintln!("non_root_clears_setuid_and_says_so: skipped: root without setpriv");
            return;
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&w.0, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o644)).unwrap();
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", env!("CARGO_BIN_EXE_ubtrfs")]);
        c
    } else {
        bin()
    };
    let dest = w.path("out");
    let o = out_of(cmd.arg("extract").arg(&img).arg(&dest));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let setuid = dest.join("modes/setuid");
    let md = std::fs::symlink_metadata(&setuid).unwrap();
    if uid != 1000 {
        assert_eq!(md.mode() & 0o7777, 0o755, "setuid bit cleared");
        let line = format!(
            "ubtrfs: warning: {}: setuid bit cleared (owner 1000 not kept: not root)",
            setuid.display()
        );
        assert_eq!(err.lines().filter(|l| l.starts_with(&line)).count(), 1, "{err}");
    }
    assert!(
        err.lines().any(|l| l.contains(": owner not kept on ") && l.contains("(not root)")),
        "{err}"
    );
    assert_eq!(
        err.lines().filter(|l| l.contains("owner")).count(),
        2,
        "one line about owners, one for the setuid file:\n{err}"
    );
    assert!(err.contains(": not created (a device node needs root)"), "{err}");
    assert!(err.contains("extract: 3 files not created; see the warnings above"), "{err}");
    // Everything else arrived.
    assert_eq!(
        std::fs::read(dest.join("modes/m0755")).unwrap().len() as u64,
        common::manifest("default")["modes/m0755"]["size"].as_u64().unwrap()
    );
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

fn have_tools(test: &str, tools: &[&str]) -> bool {
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| {
            Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {t}"))
                .output()
                .map(|o| !o.status.success())
                .unwrap_or(true)
        })
        .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test}: needs {missing:?}, and CI=true forbids skipping"
    );
    eprintln!("{test}: skipped: needs {missing:?}");
    false
}

/// A loop or tmpfs mount, unmounted on drop.
struct Mounted(PathBuf);

impl Mounted {
    fn new(args: &[&str], src: &Path, dir: &Path) -> Mounted {
        std::fs::create_dir_all(dir).unwrap();
        run(Command::new("mount").args(args).arg(src).arg(dir));
        Mounted(dir.to_path_buf())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// `getfattr -d` of every name, `getfacl` and `getcap` of one path, with the path left out.
fn xattr_view(p: &Path) -> String {
    let dump = |cmd: &mut Command| {
        let o = out_of(cmd);
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| !l.starts_with("# file:"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let attrs = dump(
        Command::new("getfattr")
            .args(["-h", "-d", "-m", "-", "-e", "hex", "--absolute-names"])
            .arg(p),
    );
    let is_link = std::fs::symlink_metadata(p).unwrap().file_type().is_symlink();
    let acl = if is_link {
        String::new()
    } else {
        dump(Command::new("getfacl").args(["-n", "-p", "--absolute-names"]).arg(p))
    };
    let cap = if is_link {
        String::new()
    } else {
        dump(Command::new("getcap").arg(p)).replace(&p.display().to_string(), "")
    };
    format!("{attrs}\n{acl}\n{cap}")
}

/// As root: file capabilities (also on a setuid file owned by someone else, which the
/// chown would strip if done after), access and default ACLs, trusted.* and user.*
/// xattrs on files, a directory and a symlink all arrive, as getcap/getfacl/getfattr
/// see them on a kernel mount of the source; nothing is warned about. Then an ext4
/// destination, which cannot hold the `default` fixture's 40 xattrs on one file: one
/// short warning per such file, no failure.
#[test]
fn root_keeps_capabilities_acls_and_trusted_xattrs() {
    if !common::kernel_available("root_keeps_capabilities_acls_and_trusted_xattrs")
        || !have_tools(
            "root_keeps_capabilities_acls_and_trusted_xattrs",
            &["setcap", "getcap", "setfacl", "getfacl", "setfattr", "getfattr", "mkfs.ext4"],
        )
    {
        return;
    }
    let w = Work::new("root", Path::new("/dev/shm"));
    let img = w.path("src.img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    run(Command::new("mkfs.btrfs").args(["-q", "-f"]).arg(&img));
    let src = w.path("src");
    {
        let m = Mounted::new(&["-t", "btrfs", "-o", "loop"], &img, &src);
        let p = |s: &str| m.0.join(s);
        let sh = |script: &str| run(Command::new("sh").arg("-ec").arg(script).current_dir(&m.0));
        std::fs::write(p("cap"), b"caps\n").unwrap();
        std::fs::write(p("capsuid"), b"setuid with caps\n").unwrap();
        std::fs::write(p("acl"), b"acl\n").unwrap();
        std::fs::write(p("trusted"), b"trusted\n").unwrap();
        std::fs::write(p("readonly"), b"ro\n").unwrap();
        std::fs::write(p("new\nline"), b"nl\n").unwrap();
        std::fs::create_dir(p("dir")).unwrap();
        sh("setcap cap_net_raw+ep cap
            chown 1234:2345 capsuid; chmod 6755 capsuid; setcap cap_net_admin,cap_sys_time+eip capsuid
            setfacl -m u:1234:rwx,g:2345:r-x acl
            setfacl -m u:1234:r-x dir; setfacl -d -m u:1234:rwx,g:2345:r-x dir
            echo inherited > dir/inherited
            setfattr -n trusted.test -v hello trusted; setfattr -n user.plain -v there trusted
            setfattr -n user.dir -v d dir; setfattr -n trusted.dir -v t dir
            ln -s cap link; setfattr -h -n trusted.onlink -v v link
            setfattr -n user.ro -v r readonly; chown 1234:1234 readonly; chmod 0444 readonly
            setfattr -n trusted.nl -v n \"$(printf 'new\\nline')\"");
    }
    let paths = [
        "cap",
        "capsuid",
        "acl",
        "dir",
        "dir/inherited",
        "trusted",
        "link",
        "readonly",
        "new\nline",
    ];
    let dest_mnt = w.path("dest");
    let dest_m = Mounted::new(&["-t", "tmpfs", "-o", "size=64m"], Path::new("tmpfs"), &dest_mnt);
    let dest = dest_m.0.join("out");
    let o = run(bin().arg("extract").arg(&img).arg(&dest));
    let err = stderr(&o);
    assert!(!err.contains("warning"), "warnings extracting to tmpfs as root:\n{err}");
    {
        let m = Mounted::new(&["-t", "btrfs", "-o", "loop,ro"], &img, &src);
        for rel in paths {
            let (a, b) = (xattr_view(&m.0.join(rel)), xattr_view(&dest.join(rel)));
            assert_eq!(a, b, "{rel:?}: xattrs, ACLs or capabilities differ (source, then extract)");
            let (ma, mb) = (
                std::fs::symlink_metadata(m.0.join(rel)).unwrap(),
                std::fs::symlink_metadata(dest.join(rel)).unwrap(),
            );
            assert_eq!(
                (ma.mode(), ma.uid(), ma.gid()),
                (mb.mode(), mb.uid(), mb.gid()),
                "{rel:?}: mode/owner"
            );
        }
    }
    // And spelled out, so a failure of the tools themselves cannot hide one.
    let cap =
        String::from_utf8_lossy(&run(Command::new("getcap").arg(dest.join("capsuid"))).stdout)
            .into_owned();
    assert!(cap.contains("cap_net_admin,cap_sys_time=eip"), "{cap}");
    assert_eq!(std::fs::metadata(dest.join("capsuid")).unwrap().mode() & 0o7777, 0o6755);
    let acl = String::from_utf8_lossy(
        &run(Command::new("getfacl").arg("-n").arg(dest.join("dir"))).stdout,
    )
    .into_owned();
    assert!(acl.contains("default:user:1234:rwx") && acl.contains("user:1234:r-x"), "{acl}");
    let t = run(Command::new("getfattr")
        .args(["-h", "-n", "trusted.onlink", "--only-values"])
        .arg(dest.join("link")));
    assert_eq!(t.stdout, b"v");
    drop(dest_m);

    // ext4 keeps an inode's xattrs in one block: the default fixture's 40-xattr file
    // does not fit. One line per such file, not a line per xattr; not a failure.
    let e4 = w.path("e4.img");
    std::fs::File::create(&e4).unwrap().set_len(256 << 20).unwrap();
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&e4));
    let m4 = Mounted::new(&["-t", "ext4", "-o", "loop"], &e4, &w.path("e4"));
    let dest = m4.0.join("out");
    let o = out_of(bin().arg("extract").arg(&common::fixture_images("default")[0]).arg(&dest));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    let warnings: Vec<&str> = err.lines().filter(|l| l.contains("warning")).collect();
    assert!(!warnings.is_empty() && warnings.len() <= 4, "{err}");
    for l in &warnings {
        assert!(l.contains(" xattrs not kept (the destination filesystem cannot store more xattrs on this file): "), "{l}");
    }
    let many = format!("{}/xattrs/many: ", dest.display());
    assert!(
        warnings.iter().any(|l| l.contains(&many)
            && l.contains(" of 40 xattrs not kept")
            && l.ends_with(" more")),
        "{err}"
    );
    assert!(!err.contains("No space left"), "{err}");
}

/// A btrfs file larger than the destination allows (btrfs files reach 8 EiB; ext4 with
/// 4 KiB blocks stops at 16 TiB) is skipped with a warning naming it and the host's
/// EFBIG, the rest of the tree arrives intact, and the exit status is 2, as for any
/// other loss. Measured with the kernel (6.18): `truncate -s 17T` on a btrfs mount
/// makes the sparse file; `cp -a` of that mount onto ext4 says "failed to extend ...:
/// File too large", leaves an empty file and goes on with the other files (exit 1).
/// Nothing of the big files' data is read or written (the summary's byte count is
/// the other files' bytes): the size is set before any data, and refused there.
#[test]
fn file_larger_than_the_destination_is_skipped() {
    if !common::kernel_available("file_larger_than_the_destination_is_skipped")
        || !have_tools("file_larger_than_the_destination_is_skipped", &["mkfs.ext4"])
    {
        return;
    }
    let w = Work::new("efbig", Path::new("/dev/shm"));
    let img = w.path("src.img");
    std::fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    run(Command::new("mkfs.btrfs").args(["-q", "-f"]).arg(&img));
    let src = w.path("src");
    let random: Vec<u8> =
        (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    {
        let m = Mounted::new(&["-t", "btrfs", "-o", "loop"], &img, &src);
        let p = |s: &str| m.0.join(s);
        std::fs::write(p("a"), b"hello\n").unwrap();
        std::fs::create_dir(p("d")).unwrap();
        std::fs::write(p("d/r"), &random).unwrap();
        std::fs::hard_link(p("d/r"), p("r2")).unwrap();
        std::fs::write(p("z"), b"world\n").unwrap();
        run(Command::new("truncate").args(["-s", "17T"]).arg(p("huge")));
        // Data at its start, then the same size: its 1 MiB must not be copied either.
        std::fs::write(p("d/huge-data"), vec![7u8; 1 << 20]).unwrap();
        run(Command::new("truncate").args(["-s", "17T"]).arg(p("d/huge-data")));
    }
    let e4 = w.path("e4.img");
    std::fs::File::create(&e4).unwrap().set_len(64 << 20).unwrap();
    run(Command::new("mkfs.ext4").args(["-q", "-F", "-b", "4096"]).arg(&e4));
    let m4 = Mounted::new(&["-t", "ext4", "-o", "loop"], &e4, &w.path("e4"));
    let dest = m4.0.join("out");
    let o = out_of(bin().arg("extract").arg(&img).arg(&dest));
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for rel in ["huge", "d/huge-data"] {
        let line = format!("ubtrfs: warning: {}/{rel}: not created (file too large: its size, 18691697672192 bytes, is more than the destination holds in one file)", dest.display());
        assert_eq!(
            err.lines().filter(|l| *l == line).count(),
            1,
            "{rel}: want {line:?} in:\n{err}"
        );
        assert!(
            std::fs::symlink_metadata(dest.join(rel)).is_err(),
            "{rel} was left on the destination"
        );
    }
    assert!(err.contains("extract: 2 files not created; see the warnings above"), "{err}");
    let other_bytes = 6 + 300_000 + 6;
    assert!(err.contains(&format!("extracted 3 files, 2 directories, 0 symlinks, 1 hard links, 0 special files, {other_bytes} bytes")), "{err}");
    assert_eq!(std::fs::read(dest.join("a")).unwrap(), b"hello\n");
    assert_eq!(std::fs::read(dest.join("d/r")).unwrap(), random);
    assert_eq!(std::fs::read(dest.join("z")).unwrap(), b"world\n");
    let (r, r2) =
        (std::fs::metadata(dest.join("d/r")).unwrap(), std::fs::metadata(dest.join("r2")).unwrap());
    assert_eq!((r.ino(), r.nlink()), (r2.ino(), 2), "the hard link stays one");
    // Only the small files' blocks are in use on the 64 MiB destination.
    let used =
        String::from_utf8_lossy(&run(Command::new("du").args(["-s", "-B1"]).arg(&dest)).stdout)
            .split_whitespace()
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap();
    assert!(used < 1 << 20, "{used} bytes used under {}", dest.display());
}
