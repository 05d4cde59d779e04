//! What the FUSE tests share: images made by mkfs.btrfs, btrfs check, the mount table,
//! a `ubtrfs mount` in the foreground (`FuseMount`) and a kernel loop mount
//! (`KernelMount`), each cleared on drop. Included by path (`#[path =
//! "common/fuse.rs"]`) beside `common/cmd.rs` as `cmd`.
#![allow(dead_code)]

use crate::cmd::{bin, run};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn mkfs(img: &Path, size: &str) {
    run(Command::new("truncate").args(["-s", size]).arg(img));
    run(Command::new("mkfs.btrfs").arg("-q").arg("-f").arg(img));
}

pub fn assert_check(img: &Path, what: &str) {
    let out = Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(img)
        .output()
        .expect("run btrfs check");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && text.contains("no error found") && !text.contains("ERROR"),
        "{what}: btrfs check failed on {}:\n{text}",
        img.display()
    );
}

pub fn is_mountpoint(dir: &Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let want = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    mounts.lines().any(|l| l.split(' ').nth(1).map(|m| Path::new(m) == want).unwrap_or(false))
}

/// A running `ubtrfs mount` in the foreground.
pub struct FuseMount {
    pub child: Option<Child>,
    pub dir: PathBuf,
}

pub enum Stop {
    Sigterm,
    Sigint,
    Fusermount,
    Umount,
}

impl FuseMount {
    pub fn start(img: &Path, dir: &Path, opts: &str) -> FuseMount {
        std::fs::create_dir_all(dir).unwrap();
        let mut c = bin();
        c.arg("mount");
        if !opts.is_empty() {
            c.args(["-o", opts]);
        }
        let child = c
            .arg(img)
            .arg(dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ubtrfs mount");
        let mut m = FuseMount { child: Some(child), dir: dir.to_path_buf() };
        let t = Instant::now();
        while !is_mountpoint(dir) {
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                let out = m.child.take().unwrap().wait_with_output().unwrap();
                panic!(
                    "ubtrfs mount exited ({st}) before mounting: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "ubtrfs mount did not mount {} within 30 s",
                dir.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// Unmount as `how` says; the command must exit 0. Returns its stderr.
    pub fn stop(mut self, how: Stop) -> String {
        match how {
            // SAFETY: kill on our own child's pid.
            Stop::Sigterm => unsafe {
                libc::kill(self.pid(), libc::SIGTERM);
            },
            // SAFETY: as above.
            Stop::Sigint => unsafe {
                libc::kill(self.pid(), libc::SIGINT);
            },
            Stop::Fusermount => {
                run(Command::new("fusermount3").arg("-u").arg(&self.dir));
            }
            Stop::Umount => {
                run(Command::new("umount").arg(&self.dir));
            }
        }
        let out = self.wait(Duration::from_secs(120));
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "ubtrfs mount exited with {}: {err}", out.status);
        assert!(!is_mountpoint(&self.dir), "{} still mounted", self.dir.display());
        err
    }

    pub fn wait(&mut self, limit: Duration) -> std::process::Output {
        let t = Instant::now();
        let child = self.child.as_mut().unwrap();
        while child.try_wait().unwrap().is_none() {
            if t.elapsed() > limit {
                // What each thread waits in, then what the process said: enough to
                // tell a hang in the kernel's unmount from one of ours.
                let pid = child.id();
                let threads: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
                    .map(|d| {
                        d.flatten()
                            .map(|t| {
                                let read = |f: &str| {
                                    std::fs::read_to_string(t.path().join(f))
                                        .unwrap_or_default()
                                        .trim()
                                        .to_string()
                                };
                                format!(
                                    "{} {} in {}",
                                    read("comm"),
                                    t.file_name().to_string_lossy(),
                                    read("wchan")
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                let _ = child.kill();
                let out = self.child.take().unwrap().wait_with_output().unwrap();
                panic!("ubtrfs mount did not exit within {limit:?}; its threads: {threads:?}; it said: {}", String::from_utf8_lossy(&out.stderr));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child.take().unwrap().wait_with_output().unwrap()
    }

    /// kill -9, then clear the dead mount.
    pub fn kill9(mut self) {
        let mut c = self.child.take().unwrap();
        c.kill().unwrap();
        let _ = c.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        assert!(!is_mountpoint(&self.dir));
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        }
    }
}

/// A kernel loop mount, unmounted on drop.
pub struct KernelMount {
    pub dir: PathBuf,
}

impl KernelMount {
    pub fn new(img: &Path, dir: &Path) -> KernelMount {
        std::fs::create_dir_all(dir).unwrap();
        run(Command::new("mount").args(["-o", "loop"]).arg(img).arg(dir));
        KernelMount { dir: dir.to_path_buf() }
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}
