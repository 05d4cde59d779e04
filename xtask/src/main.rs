//! Project automation. Thin wrapper around python scripts in this crate's
//! directory, so nothing here needs dependencies.
//!
//! ```text
//! cargo run -p xtask -- fixtures [--out DIR] [NAME...]      # = fixtures.py build ...
//! cargo run -p xtask -- fixtures manifest DIR               # = fixtures.py manifest DIR
//! cargo run -p xtask -- fixtures diff A.jsonl B.jsonl ...   # = fixtures.py diff ...
//! cargo run -p xtask -- fixtures list
//! ```

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::{Command, ExitCode};

const USAGE: &str = "\
usage: cargo run -p xtask -- <task> [args]

tasks:
  fixtures [build] [--out DIR] [--work DIR] [--keep-work] [NAME...]
                         build kernel-made fixture images (needs root)
  fixtures manifest [--out FILE] DIR
                         print the manifest of a directory tree
  fixtures diff [--ignore-keys K,..] [--ignore-dir-keys K,..] [--ignore-paths RE] A B
                         compare two manifests (exit 1 if different)
  fixtures list          list fixture names
";

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(task) = args.next() else {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    };
    match task.as_str() {
        "fixtures" => fixtures(args.collect()),
        "help" | "-h" | "--help" => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        other => {
            eprintln!("xtask: unknown task {other:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}

fn fixtures(rest: Vec<String>) -> ExitCode {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures.py");
    let mut cmd = Command::new("python3");
    cmd.arg(&script);
    let explicit =
        matches!(rest.first().map(String::as_str), Some("build" | "manifest" | "diff" | "list"));
    if !explicit {
        cmd.arg("build");
    }
    cmd.args(&rest);
    run(cmd)
}

#[cfg(unix)]
fn run(mut cmd: Command) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let err = cmd.exec();
    eprintln!("xtask: failed to exec python3: {err}");
    ExitCode::from(127)
}

#[cfg(not(unix))]
fn run(mut cmd: Command) -> ExitCode {
    match cmd.status() {
        Ok(st) => ExitCode::from(st.code().unwrap_or(1).clamp(0, 255) as u8),
        Err(err) => {
            eprintln!("xtask: failed to run python3: {err}");
            ExitCode::from(127)
        }
    }
}
