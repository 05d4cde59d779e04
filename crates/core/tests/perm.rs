//! The VFS's permission checks against the kernel: for a matrix of callers (owner,
//! group member, other, root), files (modes, a POSIX ACL with a named user and a mask,
//! directories) and requests (read, write, execute), `perm::check_access` answers as
//! access(2) does on a kernel mount (`setpriv` runs `test -r/-w/-x` as each caller).

mod common;
#[path = "common/write.rs"]
mod write_common;

use std::process::Command;
use ubtrfs_core::inode::filesystem::{FsRead, Load};
use ubtrfs_core::inode::perm::{access_acl, check_access, Cred, MAY_EXEC, MAY_READ, MAY_WRITE};
use write_common::*;

#[test]
fn access_matches_the_kernel() {
    if !common::kernel_available_with(
        "access_matches_the_kernel",
        &["/usr/bin/setpriv", "/usr/bin/setfacl"],
    ) {
        return;
    }
    let img = Scratch::mkfs("perm", 256 << 20, &[]);
    let files: [(&str, u32, bool); 8] = [
        ("m640", 0o640, false),
        ("m007", 0o007, false),
        ("m750", 0o750, false),
        ("m000", 0o000, false),
        ("m111", 0o111, false),
        ("acl", 0o640, false),
        ("d711", 0o711, true),
        ("d070", 0o070, true),
    ];
    {
        let m = Mount::new(&img.path, true);
        for (n, mode, dir) in files {
            let p = m.path(n);
            if dir {
                std::fs::create_dir(&p).unwrap();
            } else {
                std::fs::write(&p, b"x").unwrap();
            }
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            std::os::unix::fs::chown(&p, Some(1000), Some(100)).unwrap();
        }
        let o = Command::new("setfacl")
            .args(["-m", "u:3000:rw,g:300:r,m::r"])
            .arg(m.path("acl"))
            .output()
            .unwrap();
        assert!(o.status.success(), "setfacl: {}", String::from_utf8_lossy(&o.stderr));
        m.umount();
    }
    let creds = [
        Cred::user(1000, 1000, &[]),
        Cred::user(2000, 2000, &[100]),
        Cred::user(3000, 3000, &[]),
        Cred::user(4000, 4000, &[300]),
        Cred::root(),
    ];
    let m = Mount::new(&img.path, false);
    let fs = img.reader();
    let mut bad = Vec::new();
    let mut n = 0;
    for (name, ..) in files {
        let id = fs.resolve_id(&format!("/{name}"), false).unwrap();
        let ii = fs.load_inode(id, Load::ITEM).unwrap().item;
        let acl = access_acl(&fs, id).unwrap();
        for c in &creds {
            for (mask, flag) in [(MAY_READ, "-r"), (MAY_WRITE, "-w"), (MAY_EXEC, "-x")] {
                let mut cmd = Command::new("setpriv");
                if c.uid != 0 {
                    cmd.arg(format!("--reuid={}", c.uid)).arg(format!("--regid={}", c.gid));
                    if c.groups.is_empty() {
                        cmd.arg("--clear-groups");
                    } else {
                        cmd.arg(format!(
                            "--groups={}",
                            c.groups.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(",")
                        ));
                    }
                }
                // A read-only mount refuses writes with EROFS; ask the kernel on a
                // path basis with the mount's read-only state out of the way: -w is
                // checked through access(2) semantics below only when it is not EROFS.
                let k = cmd.arg("test").arg(flag).arg(m.path(name)).status().unwrap().success();
                let u = check_access(c, &ii, acl.as_deref(), mask, name).is_ok();
                n += 1;
                if mask == MAY_WRITE {
                    // The mount is read-only: the kernel says no to every write.
                    assert!(!k, "{name}: a read-only mount allowed a write");
                    continue;
                }
                if k != u {
                    bad.push(format!("{name} (mode {:o}) uid {} gid {} groups {:?} {flag}: kernel {k}, ubtrfs {u}", ii.mode.get(), c.uid, c.gid, c.groups));
                }
            }
        }
    }
    m.umount();
    // The writes, on a writable mount.
    let m = Mount::new(&img.path, true);
    for (name, ..) in files {
        let id = fs.resolve_id(&format!("/{name}"), false).unwrap();
        let ii = fs.load_inode(id, Load::ITEM).unwrap().item;
        let acl = access_acl(&fs, id).unwrap();
        for c in &creds {
            let mut cmd = Command::new("setpriv");
            if c.uid != 0 {
                cmd.arg(format!("--reuid={}", c.uid)).arg(format!("--regid={}", c.gid));
                if c.groups.is_empty() {
                    cmd.arg("--clear-groups");
                } else {
                    cmd.arg(format!(
                        "--groups={}",
                        c.groups.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(",")
                    ));
                }
            }
            let k = cmd.arg("test").arg("-w").arg(m.path(name)).status().unwrap().success();
            let u = check_access(c, &ii, acl.as_deref(), MAY_WRITE, name).is_ok();
            n += 1;
            if k != u {
                bad.push(format!(
                    "{name} (mode {:o}) uid {} groups {:?} -w: kernel {k}, ubtrfs {u}",
                    ii.mode.get(),
                    c.uid,
                    c.groups
                ));
            }
        }
    }
    m.umount();
    assert!(bad.is_empty(), "{} of {n} answers differ:\n{}", bad.len(), bad.join("\n"));
}
