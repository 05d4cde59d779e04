//! What users read: names with control characters are escaped in listings, warnings
//! and errors (one line per entry, no raw escape sequences); errors say a thing once;
//! data goes to stdout and summaries to stderr; a truncated image says it is
//! truncated, and is not written. Runs on fixture copies, without root.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("repo root")
}

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

/// A private copy of fixture `name`'s first device.
fn fixture_copy(name: &str, work: &Path) -> PathBuf {
    let img = work.join(format!("{name}.img"));
    let input =
        std::fs::File::open(repo().join(format!("tests/fixtures/{name}.0.img.zst"))).unwrap();
    let mut out = std::fs::File::create(&img).unwrap();
    std::io::copy(&mut zstd::stream::read::Decoder::new(input).unwrap(), &mut out).unwrap();
    img
}

fn workdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ubtrfs-msg-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn control_characters_in_names_are_escaped() {
    let work = workdir("names");
    let img = fixture_copy("default", &work);
    let src = work.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("new\nline"), b"x").unwrap();
    std::fs::write(src.join("esc\x1b[2Jape"), b"y").unwrap();
    std::fs::write(src.join("plain"), b"z").unwrap();
    let put = run(bin().arg("put").arg("-r").arg(&img).arg(&src).arg("/odd"));
    assert!(put.stdout.is_empty(), "put prints its summary to stderr, not stdout: {put:?}");
    assert!(
        String::from_utf8_lossy(&put.stderr).starts_with("put 3 files, 1 directories"),
        "{put:?}"
    );

    let ls = run(bin().arg("ls").arg(&img).arg("/odd"));
    assert_eq!(String::from_utf8_lossy(&ls.stdout), "esc\\x1b[2Jape\nnew\\nline\nplain\n");
    let ls = run(bin().arg("ls").arg("-l").arg(&img).arg("/odd"));
    let out = String::from_utf8_lossy(&ls.stdout);
    assert_eq!(out.lines().count(), 3, "{out}");
    assert!(!out.contains('\x1b'), "raw escape sequence in the listing: {out:?}");
    assert!(out.lines().any(|l| l.ends_with(" new\\nline")), "{out}");
    let ls = run(bin().arg("ls").arg("-R").arg(&img).arg("/odd"));
    assert!(String::from_utf8_lossy(&ls.stdout).starts_with("/odd:\n"), "{ls:?}");

    // The data of a file with such a name comes out unchanged on stdout.
    let cat = run(bin().arg("cat").arg(&img).arg("/odd/new\nline"));
    assert_eq!(cat.stdout, b"x");

    // Errors naming such a path escape it and end in one newline.
    let o = bin().arg("cat").arg(&img).arg("/odd/missing\nname").output().unwrap();
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(e, "ubtrfs: error: /odd/missing\\nname: no such file or directory\n");
    let o = bin().arg("mkdir").arg(&img).arg("/odd/new\nline").output().unwrap();
    assert!(!o.status.success());
    assert_eq!(String::from_utf8_lossy(&o.stderr), "ubtrfs: error: /odd/new\\nline: file exists\n");
    let o = bin().arg("rm").arg(&img).arg("/odd").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&o.stderr),
        "ubtrfs: error: /odd: is a directory (use -r)\n"
    );
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn truncated_image_says_so_and_is_not_written() {
    let work = workdir("trunc");
    let img = fixture_copy("default", &work);
    let full = std::fs::metadata(&img).unwrap().len();
    let cut = full - (8 << 20);
    std::fs::OpenOptions::new().write(true).open(&img).unwrap().set_len(cut).unwrap();
    let want = format!(
        "is truncated: its superblock says the device holds {full} bytes, but it has {cut}"
    );
    // Reading what is there works, with the warning.
    let ls = run(bin().arg("ls").arg(&img).arg("/"));
    assert!(!ls.stdout.is_empty());
    assert!(String::from_utf8_lossy(&ls.stderr).contains(&want), "{ls:?}");
    // Writing is refused, and changes nothing.
    let before = std::fs::read(&img).unwrap();
    let o = bin().arg("put").arg(&img).arg("/etc/hostname").arg("/h").output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains(&want), "{o:?}");
    let o = bin().arg("rm").arg(&img).arg("/files").arg("-r").output().unwrap();
    assert!(!o.status.success());
    assert_eq!(std::fs::read(&img).unwrap(), before, "a refused write changed the image");
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn write_commands_offer_device_and_degraded() {
    for cmd in ["put", "rm", "mkdir", "setfattr", "subvolume create"] {
        let mut c = bin();
        c.args(cmd.split(' ')).arg("--help");
        let h = run(&mut c);
        let text = String::from_utf8_lossy(&h.stdout);
        assert!(
            text.contains("--device") && text.contains("--degraded"),
            "{cmd} --help lacks --device or --degraded:\n{text}"
        );
    }
    let h = run(bin().arg("ls").arg("--help"));
    let text = String::from_utf8_lossy(&h.stdout);
    assert!(
        text.contains("--device") && !text.contains("--degraded"),
        "readers take --device and need no --degraded:\n{text}"
    );
}

/// `ubtrfs put SRC IMAGE DEST` (cp's order) says which argument is the image instead
/// of only that SRC is too small for a superblock; nothing is written.
#[test]
fn put_with_swapped_arguments_names_the_image() {
    let work = workdir("put-swapped");
    let img = fixture_copy("default", &work);
    let src = work.join("src.txt");
    std::fs::write(&src, b"hello").unwrap();
    let before = std::fs::read(&img).unwrap();
    let o = bin().arg("put").arg(&src).arg(&img).arg("/x").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("the image comes first") && err.contains(&img.display().to_string()),
        "{err}"
    );
    assert!(std::fs::read(&img).unwrap() == before, "the image changed");
    let _ = std::fs::remove_dir_all(&work);
}
