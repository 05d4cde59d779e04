//! `ubtrfs setfattr` and `ubtrfs getfattr` end to end: every value encoding in, every
//! output encoding out, errors on stderr with a non-zero status, one commit for all
//! paths (a failure on any commits nothing: the image's bytes stay the same). With the
//! kernel, `ubtrfs getfattr` prints byte for byte what attr's getfattr prints on a loop
//! mount, for what ubtrfs set and for what the kernel set.

#[path = "../../core/tests/common/kernel.rs"]
mod kernel;

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ubtrfs"))
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stdout(cmd: &mut Command) -> String {
    String::from_utf8(run(cmd).stdout).expect("utf-8 output")
}

fn sha(p: &Path) -> String {
    let mut h = Sha256::new();
    h.update(std::fs::read(p).expect("read image"));
    format!("{:x}", h.finalize())
}

/// A scratch image made by `mkfs.btrfs --rootdir` holding /f, /g, /d and /l -> f.
struct Img(PathBuf);

impl Img {
    fn new(tag: &str) -> Img {
        let base =
            std::env::temp_dir().join(format!("ubtrfs-xattr-cli-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("root");
        std::fs::create_dir_all(root.join("d")).expect("rootdir");
        std::fs::write(root.join("f"), b"f").expect("rootdir");
        std::fs::write(root.join("g"), b"g").expect("rootdir");
        std::os::unix::fs::symlink("f", root.join("l")).expect("symlink");
        let img = base.join("img");
        std::fs::File::create(&img).and_then(|f| f.set_len(256 << 20)).expect("image");
        let o = Command::new("mkfs.btrfs")
            .args(["-q", "-f", "--rootdir"])
            .arg(&root)
            .arg(&img)
            .output()
            .expect("mkfs.btrfs");
        assert!(o.status.success(), "mkfs.btrfs: {}", String::from_utf8_lossy(&o.stderr));
        Img(base)
    }
    fn path(&self) -> PathBuf {
        self.0.join("img")
    }
}

impl Drop for Img {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn setfattr(img: &Path, args: &[&str]) -> Command {
    let mut c = bin();
    c.arg("setfattr").arg(img).args(args);
    c
}

fn getfattr(img: &Path, args: &[&str]) -> Command {
    let mut c = bin();
    c.arg("getfattr").arg(img).args(args);
    c
}

/// The values attr's tools exchange, each set through one encoding of setfattr.
const SETS: [(&str, &str); 8] = [
    ("user.text", "hello world"),
    ("user.quoted", r#""a \"q\" \\ \101\012end""#),
    ("user.hex", "0x00ff0a41"),
    ("user.b64", "0saGVsbG8="),
    ("user.empty", ""),
    ("user.trailing_nul", "0x61626300"),
    ("trusted.t", "0x7f"),
    ("security.s", "sec"),
];

fn set_all(img: &Path, path: &str) {
    for (n, v) in SETS {
        run(&mut setfattr(img, &["-n", n, "-v", v, path]));
    }
}

#[test]
fn encodings_in_and_out() {
    let img = Img::new("enc");
    set_all(&img.path(), "/f");
    let got = stdout(&mut getfattr(&img.path(), &["-d", "-m", "-", "/f"]));
    let want = "# file: f\n\
        security.s=\"sec\"\n\
        trusted.t=0sfw==\n\
        user.b64=\"hello\"\n\
        user.empty=\"\"\n\
        user.hex=0sAP8KQQ==\n\
        user.quoted=\"a \\\"q\\\" \\\\ A\\012end\"\n\
        user.text=\"hello world\"\n\
        user.trailing_nul=\"abc\"\n\n";
    assert_eq!(got, want);
    // Without -m, only user.*; without -d, names only.
    assert_eq!(
        stdout(&mut getfattr(&img.path(), &["/f"])),
        "# file: f\nuser.b64\nuser.empty\nuser.hex\nuser.quoted\nuser.text\nuser.trailing_nul\n\n"
    );
    assert_eq!(
        stdout(&mut getfattr(&img.path(), &["-n", "user.hex", "-e", "hex", "/f"])),
        "# file: f\nuser.hex=0x00ff0a41\n\n"
    );
    assert_eq!(
        stdout(&mut getfattr(&img.path(), &["-n", "user.quoted", "-e", "text", "/f"])),
        "# file: f\nuser.quoted=\"a \\\"q\\\" \\\\ A\\012end\"\n\n"
    );
    assert_eq!(
        stdout(&mut getfattr(&img.path(), &["-d", "-m", "^user\\.t", "-e", "base64", "/f"])),
        "# file: f\nuser.text=0saGVsbG8gd29ybGQ=\nuser.trailing_nul=0sYWJjAA==\n\n"
    );
    // A file with nothing matching prints nothing.
    assert_eq!(stdout(&mut getfattr(&img.path(), &["-d", "/g"])), "");
    // Removal, and -h on a symlink (trusted.* may sit on one; without -h it is the target).
    run(&mut setfattr(&img.path(), &["-x", "user.text", "/f"]));
    run(&mut setfattr(&img.path(), &["-h", "-n", "trusted.link", "-v", "on the link", "/l"]));
    run(&mut setfattr(&img.path(), &["-n", "user.via_link", "-v", "on f", "/l"]));
    assert_eq!(
        stdout(&mut getfattr(&img.path(), &["-h", "-d", "-m", "-", "/l"])),
        "# file: l\ntrusted.link=\"on the link\"\n\n"
    );
    let f = stdout(&mut getfattr(&img.path(), &["-d", "/f"]));
    assert!(f.contains("user.via_link=\"on f\"\n") && !f.contains("user.text"), "{f}");
    let o = Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(img.path())
        .output()
        .expect("btrfs check");
    assert!(
        o.status.success(),
        "btrfs check: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn errors_name_the_object_and_commit_nothing() {
    let img = Img::new("err");
    run(&mut setfattr(&img.path(), &["-n", "user.keep", "-v", "1", "/f"]));
    let before = sha(&img.path());
    let cases: [(&[&str], &str); 7] = [
        // The second path fails after the first changed: nothing may be committed.
        (&["-n", "user.new", "-v", "1", "/f", "/missing"], "/missing: no such file or directory"),
        (&["-x", "user.absent", "/f"], "xattr user.absent: no data available"),
        (&["-n", "user.", "-v", "1", "/f"], "invalid argument"),
        (&["-n", "other.x", "-v", "1", "/f"], "operation not supported"),
        (
            &["-n", "user.bad", "-v", "0xabc", "/f"],
            "value 0xabc: invalid argument (an odd number of hex digits)",
        ),
        (&["-n", "btrfs.compression", "-v", "gzip", "/f"], "invalid argument"),
        (
            &["-n", "user.rel", "-v", "1", "f"],
            "f: invalid argument (paths inside the image are absolute)",
        ),
    ];
    for (args, msg) in cases {
        let o = setfattr(&img.path(), args).output().expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(
            err.starts_with("ubtrfs: error: ") && err.contains(msg),
            "{args:?}: stderr {err:?}, wanted {msg:?}"
        );
        assert_eq!(sha(&img.path()), before, "{args:?}: a failed setfattr changed the image");
    }
    let o = getfattr(&img.path(), &["-n", "user.nope", "/f"]).output().expect("run");
    assert!(
        !o.status.success()
            && String::from_utf8_lossy(&o.stderr).contains("xattr user.nope: no data available"),
        "{o:?}"
    );
    let o = getfattr(&img.path(), &["-m", "a|b", "/f"]).output().expect("run");
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("pattern a|b"),
        "{o:?}"
    );
    assert_eq!(stdout(&mut getfattr(&img.path(), &["-d", "/f"])), "# file: f\nuser.keep=\"1\"\n\n");
}

/// attr's getfattr on a loop mount and `ubtrfs getfattr` on the image print the same
/// bytes, in every encoding, for what ubtrfs set and for what the kernel set.
#[test]
fn getfattr_prints_what_attrs_getfattr_prints() {
    if !kernel::kernel_available_with(
        "getfattr_prints_what_attrs_getfattr_prints",
        &["/usr/bin/getfattr", "/usr/bin/setfattr"],
    ) {
        return;
    }
    let img = Img::new("kernel");
    set_all(&img.path(), "/f");
    run(&mut setfattr(&img.path(), &["-n", "btrfs.compression", "-v", "zstd", "/d"]));
    let mnt = img.0.join("mnt");
    std::fs::create_dir_all(&mnt).expect("mount dir");
    let mount = |ro: bool| {
        run(Command::new("mount")
            .args(["-t", "btrfs", "-o", if ro { "loop,ro" } else { "loop" }])
            .arg(img.path())
            .arg(&mnt))
    };
    let umount = || {
        for _ in 0..40 {
            let o = Command::new("umount").arg(&mnt).output().expect("umount");
            if o.status.success() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        panic!("umount {}: busy", mnt.display());
    };
    // The kernel adds its own to /g, the same values through attr's setfattr.
    mount(false);
    for (n, v) in SETS {
        run(Command::new("setfattr").args(["-n", n, "-v", v, "g"]).current_dir(&mnt));
    }
    umount();
    mount(true);
    let mut diffs = Vec::new();
    for f in ["f", "g", "d"] {
        for args in [
            &["-d", "-m", "-"][..],
            &["-d"],
            &[],
            &["-d", "-m", "-", "-e", "hex"],
            &["-d", "-m", "-", "-e", "text"],
            &["-d", "-m", "-", "-e", "base64"],
            &["-n", "user.quoted"],
        ] {
            if f == "d" && args.contains(&"user.quoted") {
                continue;
            }
            let theirs = Command::new("getfattr")
                .args(args)
                .arg(f)
                .current_dir(&mnt)
                .output()
                .expect("getfattr");
            let ours =
                getfattr(&img.path(), args).arg(format!("/{f}")).output().expect("ubtrfs getfattr");
            if theirs.stdout != ours.stdout {
                diffs.push(format!(
                    "{f} {args:?}:\n  getfattr: {:?}\n  ubtrfs:   {:?}",
                    String::from_utf8_lossy(&theirs.stdout),
                    String::from_utf8_lossy(&ours.stdout)
                ));
            }
        }
    }
    umount();
    assert!(diffs.is_empty(), "{}", diffs.join("\n"));
}
