//! End-to-end tests of `ubtrfs dump-super`, `dump-tree` and `info` on the kernel-made
//! fixtures in tests/fixtures: values checked against each fixture's meta.json and
//! manifest, item counts against btrfs-progs' own `dump-tree` when it is installed,
//! and damaged copies of images (bad tree blocks, a bad chunk root, a bad primary
//! superblock) to check that damage is reported without hiding the rest.
//!
//! Images are decompressed (sparsely) under `std::env::temp_dir()`: shared read-only
//! copies are cached there by compressed size; tests that damage an image get their
//! own copy, removed when the test ends.

use std::ffi::OsStr;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn meta(name: &str) -> serde_json::Value {
    let p = fixtures_dir().join(format!("{name}.meta.json"));
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Decompress `src` to `dst`, leaving all-zero 4 KiB blocks as holes.
fn decompress_sparse(src: &Path, dst: &Path) {
    let input = std::fs::File::open(src).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    let mut dec = zstd::stream::read::Decoder::new(input).expect("zstd decoder");
    let mut out = std::fs::File::create(dst).unwrap_or_else(|e| panic!("{}: {e}", dst.display()));
    let mut block = vec![0u8; 4096];
    let mut total = 0u64;
    loop {
        let mut have = 0;
        while have < block.len() {
            let n = dec.read(&mut block[have..]).expect("decompress fixture");
            if n == 0 {
                break;
            }
            have += n;
        }
        if have == 0 {
            break;
        }
        if block[..have].iter().any(|&b| b != 0) {
            out.seek(SeekFrom::Start(total)).expect("seek");
            out.write_all(&block[..have]).expect("write image");
        }
        total += have as u64;
    }
    out.set_len(total).expect("set image length");
}

fn image_src(name: &str, dev: usize) -> PathBuf {
    fixtures_dir().join(format!("{name}.{dev}.img.zst"))
}

/// A shared, read-only decompressed copy of device `dev` of fixture `name`.
fn image(name: &str, dev: usize) -> PathBuf {
    let src = image_src(name, dev);
    let size = std::fs::metadata(&src).unwrap_or_else(|e| panic!("{}: {e}", src.display())).len();
    let dir = std::env::temp_dir().join("ubtrfs-dump-info-images");
    std::fs::create_dir_all(&dir).expect("image cache dir");
    let dst = dir.join(format!("{name}.{dev}.{size}.img"));
    if !dst.exists() {
        // Decompress beside it and rename, so parallel tests never see half an image.
        let tmp = dir.join(format!(
            "{name}.{dev}.{size}.{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        decompress_sparse(&src, &tmp);
        std::fs::rename(&tmp, &dst).expect("rename cached image");
    }
    dst
}

/// A private copy of an image for a test to damage; removed on drop.
struct ScratchImage(PathBuf);

impl ScratchImage {
    fn new(name: &str, dev: usize, test: &str) -> ScratchImage {
        let dst = std::env::temp_dir()
            .join(format!("ubtrfs-dump-info-{test}-{}.img", std::process::id()));
        decompress_sparse(&image_src(name, dev), &dst);
        ScratchImage(dst)
    }
    fn path(&self) -> &Path {
        &self.0
    }
    /// Flip every bit of the byte at `offset`.
    fn flip(&self, offset: u64) {
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.0)
            .expect("open scratch image");
        let mut b = [0u8; 1];
        f.seek(SeekFrom::Start(offset)).expect("seek");
        f.read_exact(&mut b).expect("read byte");
        b[0] ^= 0xff;
        f.seek(SeekFrom::Start(offset)).expect("seek");
        f.write_all(&b).expect("write byte");
    }
}

impl Drop for ScratchImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn ubtrfs<I: IntoIterator<Item = S>, S: AsRef<OsStr>>(args: I) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ubtrfs"));
    cmd.args(args);
    cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_ok(o: &Output, what: &str) {
    assert!(o.status.success(), "{what} failed ({}): stderr:\n{}", o.status, stderr(o));
}

/// `item N key (...)` lines, as both ubtrfs and btrfs-progs print them.
fn item_lines(text: &str) -> usize {
    text.lines()
        .filter(|l| {
            l.strip_prefix("\titem ")
                .and_then(|r| r.split(' ').next())
                .is_some_and(|n| n.parse::<u32>().is_ok())
                && l.contains(" key (")
        })
        .count()
}

/// The value after `name` on a `name   value` line of dump-super output.
fn super_field(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some(name)).then(|| w.next().unwrap_or("").to_string())
    })
}

/// Chunks from printed chunk items (dump-tree's chunk tree or dump-super's
/// sys_chunk_array): (logical, length, [stripe physical offsets]).
fn chunks_from_dump(text: &str) -> Vec<(u64, u64, Vec<u64>)> {
    let mut out: Vec<(u64, u64, Vec<u64>)> = Vec::new();
    for l in text.lines() {
        let t = l.trim();
        if let Some(rest) = t.split_once("CHUNK_ITEM ").map(|(_, r)| r) {
            let logical =
                rest.split(')').next().and_then(|n| n.parse().ok()).expect("chunk key offset");
            out.push((logical, 0, Vec::new()));
        } else if let Some(rest) = t.strip_prefix("length ") {
            if let Some(c) = out.last_mut() {
                c.1 = rest.split(' ').next().and_then(|n| n.parse().ok()).expect("chunk length");
            }
        } else if t.starts_with("stripe ") {
            let w: Vec<&str> = t.split_whitespace().collect();
            let off = w
                .iter()
                .position(|&x| x == "offset")
                .and_then(|i| w.get(i + 1))
                .and_then(|n| n.parse().ok())
                .expect("stripe offset");
            out.last_mut().expect("stripe after a chunk").2.push(off);
        }
    }
    out
}

/// Physical offsets of every copy of logical `bytenr` (single/DUP/RAID1 chunks only).
fn physical_copies(chunks: &[(u64, u64, Vec<u64>)], bytenr: u64) -> Vec<u64> {
    let (logical, _, stripes) = chunks
        .iter()
        .find(|(l, len, _)| (*l..l + len).contains(&bytenr))
        .unwrap_or_else(|| panic!("no chunk maps {bytenr}"));
    stripes.iter().map(|p| p + (bytenr - logical)).collect()
}

/// Child block addresses printed after `node BYTENR ...`.
fn node_children(text: &str, node: u64) -> Vec<u64> {
    let head = format!("node {node} level");
    let mut lines = text.lines().skip_while(|l| !l.starts_with(&head)).skip(1);
    let mut out = Vec::new();
    for l in lines.by_ref() {
        if let Some(rest) = l.strip_prefix("\tkey (") {
            let w: Vec<&str> = rest.split_whitespace().collect();
            let b = w
                .iter()
                .position(|&x| x == "block")
                .and_then(|i| w.get(i + 1))
                .and_then(|n| n.parse().ok())
                .expect("child block");
            out.push(b);
        } else if l.starts_with("leaf ") || l.starts_with("node ") && !l.contains("flags") {
            break;
        }
    }
    out
}

#[test]
fn dump_super_default_matches_meta() {
    let m = meta("default");
    let img = image("default", 0);
    let o = ubtrfs([OsStr::new("dump-super"), img.as_os_str()]);
    assert_ok(&o, "dump-super default");
    let text = stdout(&o);
    assert_eq!(super_field(&text, "fsid").as_deref(), m["fsid"].as_str(), "fsid in:\n{text}");
    assert_eq!(super_field(&text, "nodesize"), Some(m["nodesize"].to_string()));
    assert_eq!(super_field(&text, "sectorsize"), Some(m["sectorsize"].to_string()));
    assert_eq!(super_field(&text, "generation"), Some(m["generation"].to_string()));
    assert_eq!(super_field(&text, "label").as_deref(), m["label"].as_str());
    assert!(text.contains("[match]"), "checksum and magic should match:\n{text}");
    assert!(super_field(&text, "incompat_flags")
        .is_some_and(|v| v.starts_with(m["incompat_flags"].as_str().expect("incompat_flags"))));
    assert!(
        text.contains("SKINNY_METADATA") && text.contains("FREE_SPACE_TREE"),
        "feature names:\n{text}"
    );
    assert!(text.contains("CHUNK_ITEM") && text.contains("SYSTEM|DUP"), "sys_chunk_array:\n{text}");
    assert_eq!(text.matches("\tbackup ").count(), 4, "four backup roots:\n{text}");

    // --all: the image (114 MiB) holds the copies at 64 KiB and 64 MiB, both valid.
    let o = ubtrfs([OsStr::new("dump-super"), OsStr::new("--all"), img.as_os_str()]);
    assert_ok(&o, "dump-super --all default");
    let text = stdout(&o);
    assert!(
        text.contains("copy 0 at bytenr 65536") && text.contains("copy 1 at bytenr 67108864"),
        "{text}"
    );
    assert!(!text.contains("copy 2"), "256 GiB copy is beyond the device:\n{text}");
    assert_eq!(
        text.matches(m["fsid"].as_str().expect("fsid")).count(),
        3 * 2,
        "fsid, metadata_uuid and dev_item.fsid per copy:\n{text}"
    );
}

#[test]
fn info_raid1_shows_profiles_and_devices() {
    let (a, b) = (image("raid1", 0), image("raid1", 1));
    let o = ubtrfs([OsStr::new("info"), a.as_os_str(), OsStr::new("--device"), b.as_os_str()]);
    assert_ok(&o, "info raid1");
    let text = stdout(&o);
    for group in ["Data, RAID1: total=", "Metadata, RAID1: total=", "System, RAID1: total="] {
        assert!(text.contains(group), "missing {group:?} in:\n{text}");
    }
    assert!(
        text.lines().any(|l| l.starts_with("devices:") && l.split_whitespace().nth(1) == Some("2")),
        "{text}"
    );
    let devids: Vec<&str> = text.lines().filter(|l| l.trim_start().starts_with("devid ")).collect();
    assert_eq!(devids.len(), 2, "{text}");
    assert!(
        devids[0].contains(a.to_str().expect("utf-8 path"))
            && devids[1].contains(b.to_str().expect("utf-8 path")),
        "{text}"
    );
    assert!(text.contains(meta("raid1")["fsid"].as_str().expect("fsid")));
}

#[test]
fn info_mixed_shows_mixed_group() {
    let img = image("mixed", 0);
    let o = ubtrfs([OsStr::new("info"), img.as_os_str()]);
    assert_ok(&o, "info mixed");
    let text = stdout(&o);
    assert!(
        text.lines().any(|l| l.starts_with("Data+Metadata, ")
            && l.contains("total=")
            && l.contains("used=")),
        "{text}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("Data, ") || l.starts_with("Metadata, ")),
        "mixed groups only:\n{text}"
    );
    assert!(text.contains("MIXED_GROUPS"), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("default subvolume:") && l.ends_with(" 5")),
        "{text}"
    );
    assert!(text.lines().any(|l| l.starts_with("log tree:") && l.ends_with("none")), "{text}");
}

#[test]
fn info_logtree_reports_log() {
    let img = image("logtree", 0);
    let o = ubtrfs([OsStr::new("info"), img.as_os_str()]);
    assert_ok(&o, "info logtree");
    assert!(
        stdout(&o).lines().any(|l| l.starts_with("log tree:") && l.contains("present")),
        "{}",
        stdout(&o)
    );
}

/// Reading commands show an image with a log tree as a kernel mount would, the log
/// replayed in memory and the image untouched; `--no-log-replay` shows the last commit.
/// `info` reads the image as it is on disk.
#[test]
fn read_commands_replay_the_log_in_memory() {
    let img = ScratchImage::new("logreplay", 0, "read-replay");
    let hash = || std::fs::read(img.path()).expect("image");
    let before = hash();
    let o = ubtrfs([OsStr::new("ls"), img.path().as_os_str(), OsStr::new("/")]);
    assert_ok(&o, "ls");
    let names: Vec<String> = stdout(&o).lines().map(str::to_string).collect();
    assert!(
        names.contains(&"newtree".into()) && names.contains(&"tree-renamed".into()),
        "{names:?}"
    );
    assert!(!names.contains(&"tree".into()), "{names:?}");
    assert!(stderr(&o).contains("replayed its 85 items in memory"), "{}", stderr(&o));
    let o = ubtrfs([
        OsStr::new("ls"),
        OsStr::new("--no-log-replay"),
        img.path().as_os_str(),
        OsStr::new("/"),
    ]);
    assert_ok(&o, "ls --no-log-replay");
    let names: Vec<String> = stdout(&o).lines().map(str::to_string).collect();
    assert!(names.contains(&"tree".into()) && !names.contains(&"newtree".into()), "{names:?}");
    assert!(stderr(&o).contains("showing the last commit"), "{}", stderr(&o));
    let o = ubtrfs([OsStr::new("cat"), img.path().as_os_str(), OsStr::new("/misc/append-me")]);
    assert_ok(&o, "cat");
    assert_eq!(o.stdout.len(), 136, "the append is in the log");
    let o = ubtrfs([OsStr::new("info"), img.path().as_os_str()]);
    assert!(stdout(&o).lines().any(|l| l.starts_with("log tree:") && l.contains("present")));
    assert!(before == hash(), "a reading command wrote to the image");
}

/// `check` on an image with a log tree checks the image as it is and the filesystem
/// after the log's replay (in memory); a log that cannot be replayed is a problem.
#[test]
fn check_checks_the_filesystem_after_log_replay() {
    let img = image("logreplay", 0);
    let o = ubtrfs([OsStr::new("check"), OsStr::new("--check-data-csum"), img.as_os_str()]);
    assert_ok(&o, "check");
    let text = stdout(&o);
    assert!(
        text.lines().any(|l| l.starts_with("after log replay: checked") && l.ends_with("no problems found")),
        "{text}"
    );
    // A bad byte in the log root tree's block: the committed trees are fine; the block is
    // reported, and the replay refused.
    let bad = ScratchImage::new("logreplay", 0, "check-bad-log");
    let text = stdout(&ubtrfs([OsStr::new("dump-super"), bad.path().as_os_str()]));
    let log_leaf: u64 =
        super_field(&text, "log_root").and_then(|v| v.parse().ok()).expect("log_root");
    assert_ne!(log_leaf, 0);
    let chunks = chunks_from_dump(&stdout(&ubtrfs([
        OsStr::new("dump-tree"),
        OsStr::new("--tree"),
        OsStr::new("chunk"),
        bad.path().as_os_str(),
    ])));
    for p in physical_copies(&chunks, log_leaf) {
        bad.flip(p + 2000);
    }
    let o = ubtrfs([OsStr::new("check"), bad.path().as_os_str()]);
    assert!(!o.status.success(), "check passed a damaged log: {}", stdout(&o));
    let text = stdout(&o);
    assert!(
        text.lines().any(|l| l.starts_with("after log replay: ")
            && l.contains("the log tree cannot be replayed")
            && l.contains("checksum mismatch")),
        "{text}"
    );
}

/// An editing command replays the log and commits before its own change, as a kernel
/// mount does: afterwards the superblock has no log tree and both states are there.
#[test]
fn editing_command_replays_the_log_first() {
    let img = ScratchImage::new("logreplay", 0, "edit-replay");
    let o = ubtrfs([OsStr::new("mkdir"), img.path().as_os_str(), OsStr::new("/after-replay")]);
    assert_ok(&o, "mkdir");
    let o = ubtrfs([OsStr::new("info"), img.path().as_os_str()]);
    assert!(
        stdout(&o).lines().any(|l| l.starts_with("log tree:") && l.ends_with("none")),
        "{}",
        stdout(&o)
    );
    let o = ubtrfs([OsStr::new("ls"), img.path().as_os_str(), OsStr::new("/")]);
    assert_ok(&o, "ls");
    let names: Vec<String> = stdout(&o).lines().map(str::to_string).collect();
    assert!(
        names.contains(&"newtree".into()) && names.contains(&"after-replay".into()),
        "{names:?}"
    );
    assert!(!stderr(&o).contains("log tree"), "{}", stderr(&o));
}

#[test]
fn dump_tree_fs_nodesize4k_has_level2_and_names_files() {
    let name = "nodesize4k-xxhash";
    assert_eq!(meta(name)["fs_tree_level"], 2);
    let img = image(name, 0);
    let o =
        ubtrfs([OsStr::new("dump-tree"), OsStr::new("--tree"), OsStr::new("fs"), img.as_os_str()]);
    assert_ok(&o, "dump-tree --tree fs");
    let text = stdout(&o);
    assert!(
        text.starts_with("fs tree key (FS_TREE ROOT_ITEM 0)"),
        "{}",
        &text[..text.len().min(300)]
    );
    let first = text.lines().nth(1).expect("root block line");
    assert!(
        first.starts_with("node ")
            && first.contains(" level 2 ")
            && first.ends_with("owner FS_TREE"),
        "{first}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("node ") && l.contains(" level 1 ")),
        "level 1 nodes below the root"
    );
    assert!(item_lines(&text) > 10_000, "every leaf is printed");
    // Names from the kernel's manifest appear in the dir items.
    let manifest = std::fs::read_to_string(fixtures_dir().join(format!("{name}.manifest.jsonl")))
        .expect("manifest");
    let mut checked = 0;
    for line in manifest.lines() {
        let e: serde_json::Value = serde_json::from_str(line).expect("manifest line");
        let path = e["path"].as_str().expect("path");
        let base = path.rsplit('/').next().expect("basename");
        if e["type"] == "file"
            && base.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            assert!(
                text.contains(&format!("name: {base}\n")),
                "file {path} not named in the fs tree dump"
            );
            checked += 1;
            if checked == 20 {
                break;
            }
        }
    }
    assert!(checked > 0, "manifest has plain file names");
}

/// Whether `btrfs` (btrfs-progs) runs; otherwise say why the comparison is skipped,
/// and fail instead under CI=true.
fn btrfs_progs(test: &str) -> bool {
    match Command::new("btrfs").arg("--version").output() {
        Ok(o) if o.status.success() => true,
        r => {
            let why = match r {
                Ok(o) => format!("`btrfs --version` failed ({})", o.status),
                Err(e) => format!("`btrfs` (btrfs-progs) is not runnable: {e}"),
            };
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{test}: {why}, and CI=true forbids skipping"
            );
            eprintln!("{test}: skipping the btrfs-progs comparison: {why}");
            false
        }
    }
}

#[test]
fn dump_tree_item_counts_match_btrfs_progs() {
    if !btrfs_progs("dump_tree_item_counts_match_btrfs_progs") {
        return;
    }
    let img = image("default", 0);
    let ours = ubtrfs([
        OsStr::new("dump-tree"),
        OsStr::new("--tree"),
        OsStr::new("root"),
        img.as_os_str(),
    ]);
    assert_ok(&ours, "dump-tree --tree root");
    let progs = Command::new("btrfs")
        .args(["inspect-internal", "dump-tree", "-t", "root"])
        .arg(&img)
        .output()
        .expect("btrfs inspect-internal dump-tree");
    assert!(progs.status.success(), "btrfs dump-tree failed: {}", stderr(&progs));
    let (a, b) = (item_lines(&stdout(&ours)), item_lines(&stdout(&progs)));
    assert!(a > 0);
    assert_eq!(a, b, "root tree items: ubtrfs {a}, btrfs-progs {b}");

    // The default dump (every tree) agrees too, block by block.
    let ours = ubtrfs([OsStr::new("dump-tree"), img.as_os_str()]);
    assert_ok(&ours, "dump-tree default");
    let progs = Command::new("btrfs")
        .args(["inspect-internal", "dump-tree"])
        .arg(&img)
        .output()
        .expect("btrfs inspect-internal dump-tree");
    assert!(progs.status.success(), "btrfs dump-tree failed: {}", stderr(&progs));
    let (ours, progs) = (stdout(&ours), stdout(&progs));
    assert_eq!(item_lines(&ours), item_lines(&progs));
    let blocks = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| {
                (l.starts_with("leaf ") || l.starts_with("node ")) && !l.contains(" flags ")
            })
            .map(|l| l.split_whitespace().take(2).collect::<Vec<_>>().join(" "))
            .collect()
    };
    assert_eq!(blocks(&ours), blocks(&progs), "same blocks in the same order");
}

#[test]
fn dump_tree_rejects_non_btrfs_file() {
    let path =
        std::env::temp_dir().join(format!("ubtrfs-dump-info-not-btrfs-{}.bin", std::process::id()));
    std::fs::write(&path, vec![0xabu8; 1 << 20]).expect("write junk file");
    for cmd in [&["dump-tree"][..], &["dump-super"], &["dump-super", "--all"], &["info"]] {
        let o = ubtrfs(cmd.iter().map(OsStr::new).chain([path.as_os_str()]));
        assert!(!o.status.success(), "{cmd:?} on junk succeeded:\n{}", stdout(&o));
        let err = stderr(&o);
        assert!(
            err.contains(path.to_str().expect("utf-8 path"))
                && err.contains("not a btrfs filesystem"),
            "{cmd:?}: {err}"
        );
    }
    let _ = std::fs::remove_file(&path);
    let o = ubtrfs(["dump-tree", "--tree", "no-such-tree", "/nonexistent"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no-such-tree"), "{}", stderr(&o));
}

#[test]
fn dump_tree_reports_bad_child_and_continues() {
    let scratch = ScratchImage::new("default", 0, "bad-child");
    let img = scratch.path();
    let fs = stdout(&ubtrfs([
        OsStr::new("dump-tree"),
        OsStr::new("--tree"),
        OsStr::new("fs"),
        img.as_os_str(),
    ]));
    let root: u64 = fs
        .lines()
        .nth(1)
        .and_then(|l| l.strip_prefix("node "))
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("fs tree root is a node");
    let children = node_children(&fs, root);
    assert!(children.len() > 3, "{children:?}");
    let (bad, next) = (children[1], children[2]);
    let chunks = chunks_from_dump(&stdout(&ubtrfs([
        OsStr::new("dump-tree"),
        OsStr::new("--tree"),
        OsStr::new("chunk"),
        img.as_os_str(),
    ])));
    let copies = physical_copies(&chunks, bad);
    assert_eq!(copies.len(), 2, "metadata is DUP in `default`");
    for p in copies {
        scratch.flip(p + 300);
    }
    let o =
        ubtrfs([OsStr::new("dump-tree"), OsStr::new("--tree"), OsStr::new("fs"), img.as_os_str()]);
    assert!(!o.status.success(), "a bad child must fail the command");
    let text = stdout(&o);
    let err_line = format!("error: tree block {bad} (slot 1 of node {root}): ");
    assert!(
        text.lines().any(|l| l.starts_with(&err_line) && l.contains("checksum mismatch")),
        "no error line for {bad}:\n{}",
        &text[..text.len().min(4000)]
    );
    assert!(
        text.lines().any(|l| l.starts_with(&format!("leaf {next} items "))),
        "sibling {next} was not printed after the bad child"
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("leaf {} items ", children[children.len() - 1]))),
        "last child was not printed"
    );
    assert!(stderr(&o).contains(&format!("block={bad}")), "{}", stderr(&o));
}

#[test]
fn dump_super_works_when_chunk_tree_is_damaged() {
    let m = meta("default");
    let scratch = ScratchImage::new("default", 0, "bad-chunk-root");
    let img = scratch.path();
    let text = stdout(&ubtrfs([OsStr::new("dump-super"), img.as_os_str()]));
    let chunk_root: u64 =
        super_field(&text, "chunk_root").and_then(|v| v.parse().ok()).expect("chunk_root");
    let copies = physical_copies(&chunks_from_dump(&text), chunk_root);
    assert_eq!(copies.len(), 2, "system chunk is DUP");
    for p in copies {
        scratch.flip(p + 200);
    }
    let o = ubtrfs([OsStr::new("info"), img.as_os_str()]);
    assert!(!o.status.success(), "info must fail on a damaged chunk root");
    assert!(stderr(&o).contains(&format!("block={chunk_root}")), "{}", stderr(&o));

    let o = ubtrfs([OsStr::new("dump-super"), img.as_os_str()]);
    assert_ok(&o, "dump-super with a damaged chunk tree");
    assert_eq!(super_field(&stdout(&o), "fsid").as_deref(), m["fsid"].as_str());

    // Now damage the primary superblock too: plain dump-super fails and says so,
    // --all reports copy 0 and still prints copy 1.
    scratch.flip(65536 + 0x100);
    let o = ubtrfs([OsStr::new("dump-super"), img.as_os_str()]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("checksum mismatch")
            && stderr(&o).contains(img.to_str().expect("utf-8 path")),
        "{}",
        stderr(&o)
    );
    let o = ubtrfs([OsStr::new("dump-super"), OsStr::new("--all"), img.as_os_str()]);
    assert_ok(&o, "dump-super --all with a bad primary");
    let text = stdout(&o);
    assert!(
        text.lines().any(|l| l.starts_with("error: ")
            && l.contains("block=65536")
            && l.contains("checksum mismatch")),
        "{text}"
    );
    let copy1 = text.split("copy 1 at bytenr 67108864").nth(1).expect("copy 1 printed");
    assert!(copy1.contains("[match]") && !copy1.contains("error:"), "{copy1}");
}

#[test]
fn dump_tree_closed_pipe_is_quiet() {
    let img = image("default", 0);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ubtrfs"))
        .arg("dump-tree")
        .arg(&img)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn ubtrfs");
    let mut head = [0u8; 64];
    child.stdout.take().expect("stdout").read_exact(&mut head).expect("first bytes");
    // stdout is now closed; the next writes fail with EPIPE.
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success(), "{}: {}", out.status, stderr(&out));
    assert!(stderr(&out).is_empty(), "{}", stderr(&out));
    assert!(head.starts_with(b"root tree\n"));
}
