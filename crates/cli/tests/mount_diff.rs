//! The differential POSIX test through the mount: the same seeded operations
//! (crates/core/tests/common/posix.rs, with `chattr +i/+a/-i/-a` among them) run as
//! syscalls on a kernel loop mount and on `ubtrfs mount` of a byte-identical fresh
//! image. Every operation's result must be the same (success, or the errno of a
//! refusal: EPERM of an immutable or append-only inode, EEXIST, ENOENT, ENOTEMPTY,
//! ENAMETOOLONG, EISDIR, ENOTDIR, EMLINK...), and the whole trees are compared every
//! few hundred operations. A refusal that aborted the filesystem would make every later
//! change EROFS. After the unmount the image passes `btrfs check`, and a kernel mount
//! of it shows exactly the kernel's own tree: everything done before is there.
//!
//! Needs root, the kernel btrfs driver, btrfs-progs, /dev/fuse and fusermount3 (the
//! test says why it skips without them; under CI=true it must run).
//!
//!     cargo test -p ubtrfs --test mount_diff                     # CI: 4 seeds x 1500
//!     UBTRFS_MOUNT_DIFF_SEEDS=100..140 UBTRFS_MOUNT_DIFF_OPS=5000 \
//!         cargo test -p ubtrfs --test mount_diff -- --nocapture

#[path = "common/cmd.rs"]
mod cmd;
#[path = "../../core/tests/common/mod.rs"]
mod common;
#[path = "common/fuse.rs"]
mod fuse;
#[path = "../../core/tests/common/posix.rs"]
mod posix;
#[path = "../../core/tests/common/write.rs"]
mod write_common;

use cmd::{run, scratch_in};
use fuse::{FuseMount, Stop};
use posix::{diff_xtrees, xwalk_kernel, Gen, Kernel, Known, Op, OpKind};

use std::process::Command;
use std::time::Instant;

/// Every operation the kernel side can run through a mount: all but the engine-only
/// Commit and Reopen.
fn available() -> Vec<OpKind> {
    posix::WEIGHTS
        .iter()
        .map(|w| w.0)
        .filter(|k| !matches!(k, OpKind::Commit | OpKind::Reopen))
        .collect()
}

/// What differs between the two mounts for reasons that are not the filesystem's,
/// besides the kernel's own (`posix::KNOWN`, which hold here too).
const KNOWN_FUSE: &[Known] = &[
    // The VFS's may_delete refuses an immutable or append-only victim or directory
    // (EPERM) before it looks at the victim's type (EISDIR for unlink of a directory,
    // ENOTDIR for rmdir of anything else); it reads the flags from the inode's i_flags,
    // which FUSE never fills (its protocol carries no inode flags), so on a FUSE mount
    // the type error comes first and the request never reaches the daemon.
    Known {
        name: "fuse-vfs-type-before-inode-flags (the VFS sees no immutable/append-only flags on a FUSE inode: EISDIR/ENOTDIR before EPERM)",
        matches: |op, k| match op {
            Op::Unlink { path } => k.kind(path) == Some('d') && flagged(k, path),
            Op::Rmdir { path } => k.kind(path).is_some_and(|c| c != 'd') && flagged(k, path),
            // vfs_rename's may_delete of the source and of the target it replaces.
            Op::Rename { old, new, .. } => {
                let dirs = (k.kind(old).map(|c| c == 'd'), k.kind(new).map(|c| c == 'd'));
                matches!(dirs, (Some(a), Some(b)) if a != b) && (flagged(k, old) || flagged(k, new))
            }
            _ => false,
        },
    },
];

/// Whether `p` or its directory is immutable or append-only (as the kernel's mount
/// shows them).
fn flagged(k: &Kernel, p: &posix::P) -> bool {
    let parent: posix::P = p[..p.len().saturating_sub(1)].to_vec();
    (k.fsflags(p) | k.fsflags(&parent)) & (posix::FS_IMMUTABLE_FL | posix::FS_APPEND_FL) != 0
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name}={v}: not a number")))
        .unwrap_or(default)
}

/// One seed: returns (operations run, refusals seen) or the first disagreement.
fn run_seed(seed: u64, ops: u64, check_every: u64) -> Result<(u64, u64), String> {
    let s = scratch_in("mount-diff", &seed.to_string());
    let (kimg, uimg) = (s.join("k.img"), s.join("u.img"));
    std::fs::File::create(&kimg).and_then(|f| f.set_len(256 << 20)).unwrap();
    run(Command::new("mkfs.btrfs").args(["-q", "-f"]).args(posix::mkfs_args(seed)).arg(&kimg));
    run(Command::new("cp").arg("--sparse=always").arg(&kimg).arg(&uimg));
    let kdir = s.join("kmnt");
    std::fs::create_dir_all(&kdir).unwrap();
    run(Command::new("mount").args(["-o", "loop,nodev,noatime"]).arg(&kimg).arg(&kdir));
    let m = FuseMount::start(&uimg, &s.join("umnt"), "noatime");
    let k = Kernel { dir: kdir.clone(), mkfs: posix::mkfs_args(seed), compress: false };
    let u = Kernel { dir: m.dir.clone(), mkfs: posix::mkfs_args(seed), compress: false };
    let known = [posix::KNOWN, KNOWN_FUSE].concat();
    let mut g = Gen::new(seed, &available());
    let (mut n, mut refused) = (0, 0);
    let mut result = Ok(());
    for i in 0..ops {
        let op = g.next_op();
        if known.iter().any(|kn| (kn.matches)(&op, &k)) {
            continue;
        }
        let (kr, ur) = (k.apply(&op), u.apply(&op));
        if std::env::var_os("UBTRFS_POSIX_TRACE").is_some() {
            eprintln!("seed {seed} op {i}: {op} -> {kr:?}");
        }
        n += 1;
        refused += u64::from(kr.is_err());
        if kr != ur {
            result = Err(format!(
                "seed {seed} (mkfs {:?}) op {i}: {op}\n    kernel: {kr:?}\n    mount:  {ur:?}",
                posix::mkfs_args(seed)
            ));
            break;
        }
        if (i + 1) % check_every == 0 {
            let d = diff_xtrees(&xwalk_kernel(&kdir), &xwalk_kernel(&m.dir), 10);
            if !d.is_empty() {
                result = Err(format!(
                    "seed {seed} after op {i}: the trees differ:\n    {}",
                    d.join("\n    ")
                ));
                break;
            }
        }
    }
    let kernel_tree = xwalk_kernel(&kdir);
    let _ = write_common::umount_retrying(&kdir);
    let log = m.stop(Stop::Fusermount);
    result?;
    assert!(!log.contains("aborted"), "seed {seed}: the mount aborted: {log}");
    write_common::assert_check(&uimg, &format!("seed {seed}: the mount's image"));
    // Everything done through the mount is on disk, as the kernel reads it.
    run(Command::new("mount").args(["-o", "loop,ro"]).arg(&uimg).arg(&kdir));
    let d = diff_xtrees(&kernel_tree, &xwalk_kernel(&kdir), 10);
    let _ = write_common::umount_retrying(&kdir);
    if !d.is_empty() {
        return Err(format!(
            "seed {seed}: the kernel reads the mount's image otherwise:\n    {}",
            d.join("\n    ")
        ));
    }
    let _ = std::fs::remove_dir_all(&s);
    Ok((n, refused))
}

#[test]
fn refusals_through_the_mount_are_the_kernels() {
    if !common::kernel_available_with(
        "refusals_through_the_mount_are_the_kernels",
        &["/dev/fuse", "/usr/bin/fusermount3"],
    ) {
        return;
    }
    // SAFETY: umask only sets this process's file creation mask.
    unsafe { libc::umask(0) };
    let spec = std::env::var("UBTRFS_MOUNT_DIFF_SEEDS").unwrap_or_else(|_| "700..704".into());
    let (a, b) = spec.split_once("..").unwrap_or((&spec, ""));
    let first: u64 = a.parse().expect("seed");
    let seeds: Vec<u64> = if b.is_empty() {
        vec![first]
    } else {
        (first..b.parse().expect("seed range end")).collect()
    };
    let ops = env_u64("UBTRFS_MOUNT_DIFF_OPS", 1500);
    let t = Instant::now();
    let (mut total, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for seed in seeds {
        match run_seed(seed, ops, env_u64("UBTRFS_MOUNT_DIFF_CHECK_EVERY", 250)) {
            Ok((n, r)) => {
                total += n;
                refused += r;
            }
            Err(e) => {
                eprintln!("{e}");
                failures.push(e)
            }
        }
    }
    eprintln!(
        "mount_diff: {total} operations, {refused} refused as the kernel refused them, in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{} seeds disagree:\n{}", failures.len(), failures.join("\n\n"));
    assert!(refused * 4 > total, "only {refused} of {total} operations were refusals");
}
