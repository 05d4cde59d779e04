//! Shared helpers for tests that use the kernel-made fixtures in tests/fixtures.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

/// btrfs-progs' test images (../shared/corpus/btrfs-progs-tests, read-only, outside
/// the repository): $UBTRFS_CORPUS, else beside the checkout, else the workplace's
/// /work/shared. None (the caller skips with a message) when absent.
pub fn corpus_dir() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("UBTRFS_CORPUS").map(PathBuf::from),
        Some(repo_root().join("../shared/corpus/btrfs-progs-tests")),
        Some(PathBuf::from("/work/shared/corpus/btrfs-progs-tests")),
    ];
    candidates.into_iter().flatten().find(|d| d.is_dir())
}

pub fn fixtures_dir() -> PathBuf {
    repo_root().join("tests/fixtures")
}

/// Every fixture name (from NAME.meta.json).
pub fn fixture_names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(fixtures_dir())
        .expect("fixtures dir")
        .filter_map(|e| {
            e.ok()?.file_name().to_str()?.strip_suffix(".meta.json").map(str::to_string)
        })
        .collect();
    v.sort();
    v
}

pub fn meta(name: &str) -> serde_json::Value {
    let s =
        std::fs::read_to_string(fixtures_dir().join(format!("{name}.meta.json"))).expect("meta");
    serde_json::from_str(&s).expect("meta json")
}

/// Decompress fixture `name`'s device images into a cache dir; returns their paths.
/// The cache is keyed by the compressed file's size and mtime, so edits refresh it.
pub fn fixture_images(name: &str) -> Vec<PathBuf> {
    let n = meta(name)["devices"].as_u64().expect("devices") as usize;
    let cache = repo_root().join("target/fixture-cache");
    std::fs::create_dir_all(&cache).expect("cache dir");
    (0..n)
        .map(|i| {
            let src = fixtures_dir().join(format!("{name}.{i}.img.zst"));
            let md = std::fs::metadata(&src).expect("fixture image");
            let stamp = format!(
                "{}-{}",
                md.len(),
                md.modified()
                    .map(|t| t
                        .duration_since(std::time::UNIX_EPOCH)
                        .map(|d| d.as_secs())
                        .unwrap_or(0))
                    .unwrap_or(0)
            );
            let dst = cache.join(format!("{name}.{i}.{stamp}.img"));
            if !dst.exists() {
                // Tests run in parallel threads of one process: the temp name must be
                // unique per thread, and the first finished rename wins.
                let tmp = cache.join(
                    format!(
                        "{name}.{i}.{stamp}.{}.{:?}.tmp",
                        std::process::id(),
                        std::thread::current().id()
                    )
                    .replace(['(', ')'], ""),
                );
                let input = std::fs::File::open(&src).expect("open fixture");
                let mut dec = zstd::stream::read::Decoder::new(input).expect("zstd");
                dec.window_log_max(31).expect("window");
                let mut out = std::fs::File::create(&tmp).expect("create cache image");
                sparse_copy(&mut dec, &mut out);
                std::fs::rename(&tmp, &dst).expect("rename cache image");
            }
            dst
        })
        .collect()
}

/// Copy keeping runs of zero blocks as holes, so cached images stay small on disk.
fn sparse_copy(r: &mut impl std::io::Read, w: &mut std::fs::File) {
    use std::io::{Seek, SeekFrom, Write};
    let mut buf = vec![0u8; 1 << 20];
    let mut len = 0u64;
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            let n = r.read(&mut buf[filled..]).expect("read fixture");
            if n == 0 {
                break;
            }
            filled += n;
        }
        if filled == 0 {
            break;
        }
        for chunk in buf[..filled].chunks(4096) {
            if chunk.iter().all(|&b| b == 0) {
                w.seek(SeekFrom::Current(chunk.len() as i64)).expect("seek");
            } else {
                w.write_all(chunk).expect("write");
            }
        }
        len += filled as u64;
    }
    w.set_len(len).expect("set_len");
}

/// The manifest lines of fixture `name` keyed by path.
pub fn manifest(name: &str) -> std::collections::BTreeMap<String, serde_json::Value> {
    manifest_file(&fixtures_dir().join(format!("{name}.manifest.jsonl")))
}

/// The manifest in `path`, by path.
#[allow(dead_code)]
pub fn manifest_file(
    path: &std::path::Path,
) -> std::collections::BTreeMap<String, serde_json::Value> {
    let s = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    s.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("manifest line"))
        .map(|v| (v["path"].as_str().expect("path").to_string(), v))
        .collect()
}

mod kernel;
#[allow(unused_imports)]
pub use kernel::{du_shared_bytes, kernel_available, kernel_available_with};

/// The kernel on image bytes `img`, copied to a scratch directory named by `tag`:
/// `btrfs check --readonly --check-data-csum` (a log tree checked as it is), then a
/// loop mount (which replays a log), `look` at the mounted tree, and the unmount.
/// Returns what `look` returns, or why the check or the mount failed.
pub fn kernel_check_and_mount<T>(
    img: &[u8],
    tag: &str,
    look: impl FnOnce(&Path) -> T,
) -> Result<T, String> {
    let dir = std::env::temp_dir().join(format!("ubtrfs-kernel-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mnt = dir.join("m");
    std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
    let path = dir.join("img");
    let r = (|| {
        std::fs::write(&path, img).map_err(|e| e.to_string())?;
        let out = std::process::Command::new("btrfs")
            .args(["check", "--readonly", "--check-data-csum"])
            .arg(&path)
            .output()
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if !out.status.success() || text.contains("ERROR") {
            return Err(format!("btrfs check:\n{text}"));
        }
        let st = std::process::Command::new("mount")
            .args(["-o", "loop"])
            .arg(&path)
            .arg(&mnt)
            .status()
            .map_err(|e| e.to_string())?;
        if !st.success() {
            return Err("the kernel did not mount the image".into());
        }
        let r = look(&mnt);
        let _ = std::process::Command::new("umount").arg(&mnt).status();
        Ok(r)
    })();
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// The extended attributes of `p`, by name (listxattr and getxattr, no tool).
pub fn xattrs_of(p: &Path) -> std::collections::BTreeMap<Vec<u8>, Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).expect("path");
    let mut names = vec![0u8; 4096];
    // SAFETY: listxattr writes at most names.len() bytes into names.
    let n = unsafe { libc::listxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    let mut out = std::collections::BTreeMap::new();
    if n <= 0 {
        return out;
    }
    for nm in names[..n as usize].split(|&b| b == 0).filter(|s| !s.is_empty()) {
        let cn = std::ffi::CString::new(nm).expect("name");
        let mut v = vec![0u8; 65536];
        // SAFETY: getxattr writes at most v.len() bytes into v.
        let l = unsafe { libc::getxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        if l >= 0 {
            v.truncate(l as usize);
            out.insert(nm.to_vec(), v);
        }
    }
    out
}
