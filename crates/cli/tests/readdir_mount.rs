//! Directory streams through `ubtrfs mount`, which answers OPENDIR with ENOSYS (the
//! kernel then opens directories without asking and readdir works from the directory
//! alone): a directory of thousands of entries, listed in many small getdents calls,
//! shows every name once; two streams on one directory, interleaved, each do; names
//! removed and made while a stream is under way never make it skip or repeat a name that
//! stayed; telldir/seekdir come back to the same place; rewinddir sees a name made
//! since; a directory removed while open lists as empty. The same steps on a kernel
//! mount give the same answers where POSIX fixes them.
//!
//! Needs root, the kernel btrfs driver, /dev/fuse and fusermount3; says why it skips
//! otherwise, and fails under CI=true.

#[path = "common/cmd.rs"]
mod cmd;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use cmd::scratch_in;
use fuse::{assert_check, mkfs, FuseMount, KernelMount, Stop};
use std::collections::BTreeSet;
use std::ffi::{CStr, CString};
use std::path::Path;

fn available(test: &str) -> bool {
    kernel::kernel_available_with(test, &["/dev/fuse", "/usr/bin/fusermount3"])
}

/// A directory stream (libc's DIR, which reads with getdents64 in its own buffer).
struct Dir(*mut libc::DIR);

impl Dir {
    fn open(p: &Path) -> Dir {
        let c = CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid C string.
        let d = unsafe { libc::opendir(c.as_ptr()) };
        assert!(!d.is_null(), "opendir {}: {}", p.display(), std::io::Error::last_os_error());
        Dir(d)
    }

    /// The next name other than `.` and `..`, or None at the end.
    fn next(&mut self) -> Option<String> {
        loop {
            // SAFETY: errno is this thread's; cleared to tell the end from an error.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: an open stream.
            let e = unsafe { libc::readdir64(self.0) };
            if e.is_null() {
                let err = std::io::Error::last_os_error();
                assert_eq!(err.raw_os_error(), Some(0), "readdir: {err}");
                return None;
            }
            // SAFETY: readdir's entry is valid until the next call.
            let name =
                unsafe { CStr::from_ptr((*e).d_name.as_ptr()) }.to_string_lossy().into_owned();
            if name != "." && name != ".." {
                return Some(name);
            }
        }
    }

    fn rest(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next()).collect()
    }

    fn tell(&mut self) -> i64 {
        // SAFETY: an open stream.
        unsafe { libc::telldir(self.0) }
    }

    fn seek(&mut self, at: i64) {
        // SAFETY: an open stream, a position telldir gave.
        unsafe { libc::seekdir(self.0, at) }
    }

    fn rewind(&mut self) {
        // SAFETY: an open stream.
        unsafe { libc::rewinddir(self.0) }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        // SAFETY: opened by `open`, closed once.
        unsafe { libc::closedir(self.0) };
    }
}

fn make(p: &Path) {
    std::fs::write(p, b"").unwrap();
}

/// The steps, on a mount at `m`; returns what each found, for the comparison.
fn steps(m: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let big = m.join("big");
    std::fs::create_dir(&big).unwrap();
    let names: BTreeSet<String> =
        (0..3000).map(|i| format!("entry-{i:05}-{}", "x".repeat(i % 40))).collect();
    for n in &names {
        make(&big.join(n));
    }

    // Every name once, in many getdents calls.
    let listed = Dir::open(&big).rest();
    assert_eq!(listed.len(), names.len(), "a name listed twice or missed");
    assert_eq!(listed.iter().cloned().collect::<BTreeSet<_>>(), names);

    // Two streams interleaved, one taking two names for the other's one.
    let (mut a, mut b) = (Dir::open(&big), Dir::open(&big));
    let (mut la, mut lb) = (Vec::new(), Vec::new());
    let (mut a_done, mut b_done) = (false, false);
    while !(a_done && b_done) {
        if !a_done {
            match a.next() {
                Some(x) => la.push(x),
                None => a_done = true,
            }
        }
        for _ in 0..2 {
            if !b_done {
                match b.next() {
                    Some(y) => lb.push(y),
                    None => b_done = true,
                }
            }
        }
    }
    assert_eq!((la.len(), lb.len()), (names.len(), names.len()), "two streams' counts");
    assert_eq!(la.iter().cloned().collect::<BTreeSet<_>>(), names, "first of two streams");
    assert_eq!(lb.iter().cloned().collect::<BTreeSet<_>>(), names, "second of two streams");

    // Changes while a stream is under way: names that stayed show exactly once.
    let mut d = Dir::open(&big);
    let mut seen: Vec<String> = (0..1000).map(|_| d.next().unwrap()).collect();
    let gone: Vec<String> = names.iter().step_by(7).cloned().collect();
    for g in &gone {
        std::fs::remove_file(big.join(g)).unwrap();
    }
    for i in 0..200 {
        make(&big.join(format!("new-{i}")));
    }
    seen.extend(d.rest());
    let stayed: BTreeSet<String> = names.iter().filter(|n| !gone.contains(n)).cloned().collect();
    for n in &stayed {
        assert_eq!(seen.iter().filter(|s| *s == n).count(), 1, "{n} seen other than once");
    }
    let unique: BTreeSet<&String> = seen.iter().collect();
    assert_eq!(unique.len(), seen.len(), "a name repeated in one stream");

    // telldir / seekdir, and rewinddir seeing a name made since.
    let mut d = Dir::open(&big);
    for _ in 0..500 {
        d.next().unwrap();
    }
    let at = d.tell();
    let after: Vec<String> = (0..50).map(|_| d.next().unwrap()).collect();
    d.seek(at);
    let again: Vec<String> = (0..50).map(|_| d.next().unwrap()).collect();
    assert_eq!(after, again, "seekdir to telldir's position");
    make(&big.join("made-before-rewind"));
    d.rewind();
    let all = d.rest();
    assert!(all.iter().any(|n| n == "made-before-rewind"), "rewinddir missed a new name");
    found.push(format!("entries after the changes: {}", all.len()));

    // A directory removed while open lists as empty, without an error.
    let doomed = m.join("doomed");
    std::fs::create_dir(&doomed).unwrap();
    make(&doomed.join("f"));
    let mut d = Dir::open(&doomed);
    std::fs::remove_file(doomed.join("f")).unwrap();
    std::fs::remove_dir(&doomed).unwrap();
    d.rewind();
    found.push(format!("removed directory: {:?}", d.rest()));
    found
}

#[test]
fn directory_streams_page_and_survive_changes_as_on_the_kernel() {
    if !available("directory_streams_page_and_survive_changes_as_on_the_kernel") {
        return;
    }
    let dir = scratch_in("readdir-mount", "streams");
    let kimg = dir.join("k.img");
    mkfs(&kimg, "512M");
    let kernel = {
        let kdir = dir.join("k");
        let _k = KernelMount::new(&kimg, &kdir);
        steps(&kdir)
    };
    let img = dir.join("u.img");
    mkfs(&img, "512M");
    let mnt = dir.join("m");
    let m = FuseMount::start(&img, &mnt, "");
    let ours = steps(&mnt);
    m.stop(Stop::Umount);
    assert_eq!(ours, kernel);
    assert_check(&img, "after the directory streams");
    let _ = std::fs::remove_dir_all(&dir);
}
