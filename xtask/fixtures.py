#!/usr/bin/env python3
"""Kernel-made btrfs fixture images and manifests of the kernel's view.

Subcommands:

  build [--out DIR] [--work DIR] [--keep-work] [NAME...]
      Build the named fixtures (default: all) with mkfs.btrfs and a kernel
      loop mount (`convert`: mkfs.ext4, an ext4 loop mount, btrfs-convert).
      Writes NAME.N.img.zst, NAME.manifest.jsonl, NAME.meta.json into DIR
      (default: tests/fixtures). Needs root, mkfs.btrfs, btrfs, losetup,
      mount, zstd (and xfs_io for the partial reflink; mkfs.ext4 and
      btrfs-convert for `convert`).

  manifest [--out FILE] DIR
      Print the manifest (JSON lines) of any directory tree: a mounted btrfs
      or a plain directory (e.g. the output of `ubtrfs extract`).

  diff [--ignore-keys k1,k2] [--ignore-paths REGEX] A.jsonl B.jsonl
      Print the differences between two manifests; exit 1 if there are any.

  list
      List the fixture names.

Stdlib only. See tests/fixtures/README.md for the manifest format.
"""

import argparse
import contextlib
import ctypes
import ctypes.util
import hashlib
import json
import os
import random
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "tests", "fixtures")

KiB = 1024
MiB = 1024 * 1024

# --------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------

MANIFEST_KEYS = [
    "path", "type", "mode", "uid", "gid", "size", "nlink", "ino", "mtime_ns",
    "atime_ns", "rdev_major", "rdev_minor", "sha256", "target", "xattrs",
    "blocks", "subvol",
]


def _ftype(m):
    if stat.S_ISREG(m):
        return "file"
    if stat.S_ISDIR(m):
        return "dir"
    if stat.S_ISLNK(m):
        return "symlink"
    if stat.S_ISFIFO(m):
        return "fifo"
    if stat.S_ISCHR(m):
        return "chr"
    if stat.S_ISBLK(m):
        return "blk"
    if stat.S_ISSOCK(m):
        return "sock"
    raise ValueError("unknown file type %o" % m)


def _open_noatime(path, flags):
    """Open without touching atime (O_NOATIME needs ownership or root)."""
    try:
        return os.open(path, flags | os.O_NOATIME | os.O_NOFOLLOW)
    except PermissionError:
        return os.open(path, flags | os.O_NOFOLLOW)


def _sha256_file(path):
    h = hashlib.sha256()
    fd = _open_noatime(path, os.O_RDONLY)
    try:
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            h.update(b)
    finally:
        os.close(fd)
    return h.hexdigest()


def _listdir(path):
    fd = _open_noatime(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def _readlink(path, st):
    """readlink() updates the symlink's atime on a writable mount (relatime);
    put it back so walking a tree twice gives the same manifest."""
    target = os.readlink(path)
    try:
        st2 = os.lstat(path)
        if st2.st_atime_ns != st.st_atime_ns:
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    except OSError:
        pass
    return target


def _xattrs(path):
    out = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return out
    for n in sorted(names):
        try:
            v = os.getxattr(path, n, follow_symlinks=False)
        except OSError:
            continue
        out[n] = v.hex()
    return out


def manifest_entry(abspath, relpath, st, parent_dev):
    m = st.st_mode
    t = _ftype(m)
    is_chr_blk = t in ("chr", "blk")
    return {
        "path": relpath,
        "type": t,
        "mode": stat.S_IMODE(m),
        "uid": st.st_uid,
        "gid": st.st_gid,
        "size": st.st_size,
        "nlink": st.st_nlink,
        "ino": st.st_ino,
        "mtime_ns": st.st_mtime_ns,
        "atime_ns": st.st_atime_ns,
        "rdev_major": os.major(st.st_rdev) if is_chr_blk else 0,
        "rdev_minor": os.minor(st.st_rdev) if is_chr_blk else 0,
        "sha256": _sha256_file(abspath) if t == "file" else None,
        "target": _readlink(abspath, st) if t == "symlink" else None,
        "xattrs": _xattrs(abspath),
        "blocks": st.st_blocks,
        # A btrfs subvolume root has inode 256 and its own (anonymous) st_dev.
        # The st_dev test keeps a plain directory that happens to have inode
        # 256 (e.g. extract output on another btrfs) from counting.
        "subvol": bool(parent_dev is not None and st.st_ino == 256
                       and st.st_dev != parent_dev),
    }


def manifest(root):
    """Return the manifest entries (list of dicts) of the tree at root."""
    root = os.path.abspath(root)
    entries = []
    stack = [(root, "", None)]
    while stack:
        ap, rp, pdev = stack.pop()
        st = os.lstat(ap)
        entries.append(manifest_entry(ap, rp, st, pdev))
        if stat.S_ISDIR(st.st_mode):
            for name in _listdir(ap):
                stack.append((os.path.join(ap, name),
                              rp + "/" + name if rp else name, st.st_dev))
    entries.sort(key=lambda e: e["path"])
    return entries


def manifest_lines(entries):
    return "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries)


def write_manifest(root, out_path):
    data = manifest_lines(manifest(root))
    with open(out_path, "w", encoding="utf-8", newline="\n") as f:
        f.write(data)
    return data


def load_manifest(path):
    out = {}
    with open(path, encoding="utf-8") as f:
        for ln, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            e = json.loads(line)
            if e["path"] in out:
                raise SystemExit("%s:%d: duplicate path %r" % (path, ln, e["path"]))
            out[e["path"]] = e
    return out


def diff_manifests(a, b, ignore_keys=(), ignore_paths=None, ignore_dir_keys=()):
    """Return a list of human-readable difference lines.

    ignore_keys: keys never compared; ignore_dir_keys: keys not compared when
    both entries are directories (e.g. size, nlink, blocks differ between
    btrfs and other filesystems); ignore_paths: regex (re.search) of paths
    to skip."""
    rx = re.compile(ignore_paths) if ignore_paths else None
    ign = set(ignore_keys)
    ign_dir = set(ignore_dir_keys)
    lines = []
    for p in sorted(set(a) | set(b)):
        if rx and rx.search(p):
            continue
        if p not in b:
            lines.append("- %s (only in A: %s)" % (p or "<top>", a[p]["type"]))
            continue
        if p not in a:
            lines.append("+ %s (only in B: %s)" % (p or "<top>", b[p]["type"]))
            continue
        ea, eb = a[p], b[p]
        for k in sorted(set(ea) | set(eb)):
            if k in ign or k == "path":
                continue
            if k in ign_dir and ea.get("type") == "dir" and eb.get("type") == "dir":
                continue
            va, vb = ea.get(k, "<absent>"), eb.get(k, "<absent>")
            if va != vb:
                if k == "xattrs" and isinstance(va, dict) and isinstance(vb, dict):
                    for xn in sorted(set(va) | set(vb)):
                        if va.get(xn) != vb.get(xn):
                            lines.append("~ %s: xattr %s: %s != %s" % (
                                p or "<top>", xn, _short(va.get(xn)), _short(vb.get(xn))))
                else:
                    lines.append("~ %s: %s: %s != %s" % (p or "<top>", k, _short(va), _short(vb)))
    return lines


def _short(v):
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= 80 else s[:60] + "...(%d chars)" % len(s)


# --------------------------------------------------------------------------
# Shell helpers, loop devices, mounts
# --------------------------------------------------------------------------

VERBOSE = True


def log(*a):
    if VERBOSE:
        print("[fixtures]", *a, file=sys.stderr, flush=True)


def run(cmd, check=True, capture=False, input=None):
    log("$", " ".join(cmd))
    r = subprocess.run(cmd, stdout=subprocess.PIPE if capture else None,
                       stderr=subprocess.PIPE if capture else None,
                       input=input)
    if check and r.returncode != 0:
        msg = "command failed (%d): %s" % (r.returncode, " ".join(cmd))
        if capture:
            msg += "\nstdout:\n%s\nstderr:\n%s" % (
                r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"))
        raise RuntimeError(msg)
    return r


def out_of(cmd, check=True):
    r = run(cmd, check=check, capture=True)
    return r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")


class Resources:
    """Tracks loop devices and mounts so they are always released."""

    def __init__(self):
        self.mounts = []
        self.loops = []

    def losetup(self, img, readonly=False):
        cmd = ["losetup", "-f", "--show"] + (["-r"] if readonly else []) + [img]
        dev = out_of(cmd).strip().splitlines()[-1].strip()
        self.loops.append(dev)
        return dev

    def detach(self, dev):
        # Drop the kernel's btrfs registration of the device first, so a later
        # mount of another image with the same fsid does not trip over it.
        subprocess.run(["btrfs", "device", "scan", "--forget", dev],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(50):
            r = subprocess.run(["losetup", "-d", dev], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
            if r.returncode == 0:
                break
            time.sleep(0.1)
        else:
            log("warning: could not detach", dev)
        if dev in self.loops:
            self.loops.remove(dev)

    def mount(self, devs, mnt, opts, quiet=False, fstype="btrfs"):
        o = [x for x in opts.split(",") if x]
        o += ["device=" + d for d in devs[1:]]
        for d in devs if fstype == "btrfs" else []:
            subprocess.run(["btrfs", "device", "scan", d],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cmd = ["mount", "-t", fstype]
        if o:
            cmd += ["-o", ",".join(o)]
        cmd += [devs[0], mnt]
        run(cmd, capture=quiet)
        self.mounts.append(mnt)

    def try_mount(self, devs, mnt, opts):
        try:
            self.mount(devs, mnt, opts, quiet=True)
            return True
        except RuntimeError as e:
            log("mount failed:", str(e).splitlines()[0])
            return False

    def umount(self, mnt):
        for i in range(50):
            r = subprocess.run(["umount", mnt], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
            if r.returncode == 0:
                break
            time.sleep(0.2)
        else:
            log("warning: umount failed, lazy umount", mnt)
            subprocess.run(["umount", "-l", mnt])
        if mnt in self.mounts:
            self.mounts.remove(mnt)

    def cleanup(self):
        for m in list(reversed(self.mounts)):
            self.umount(m)
        for d in list(reversed(self.loops)):
            self.detach(d)


@contextlib.contextmanager
def attached(res, imgs, readonly=False):
    devs = []
    try:
        for img in imgs:
            devs.append(res.losetup(img, readonly=readonly))
        yield devs
    finally:
        for d in reversed(devs):
            res.detach(d)


@contextlib.contextmanager
def mounted(res, devs, mnt, opts, fstype="btrfs"):
    os.makedirs(mnt, exist_ok=True)
    res.mount(devs, mnt, opts, fstype=fstype)
    try:
        yield mnt
    finally:
        res.umount(mnt)


def dump_super(dev):
    txt = out_of(["btrfs", "inspect-internal", "dump-super", dev])
    info = {}
    for line in txt.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0] not in info:
            info[parts[0]] = parts[1].strip()
    return info


def tree_root_level(dev, tree="5"):
    """Level of the root node of a tree, from dump-tree's first node line."""
    p = subprocess.Popen(["btrfs", "inspect-internal", "dump-tree", "-t", tree, dev],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         errors="replace")
    level = None
    try:
        for line in p.stdout:
            mt = re.match(r"^node \d+ level (\d+)", line)
            if mt:
                level = int(mt.group(1))
                break
            if re.match(r"^leaf \d+ ", line):
                level = 0
                break
    finally:
        p.kill()
        p.wait()
    if level is None:
        raise RuntimeError("could not find root level of tree %s on %s" % (tree, dev))
    return level


def have(cmd):
    return shutil.which(cmd) is not None


def ensure_tools():
    missing = [c for c in ("mkfs.btrfs", "btrfs", "losetup", "mount", "umount")
               if not have(c)]
    if missing:
        raise SystemExit("missing tools: %s (apt-get install -y btrfs-progs util-linux mount)"
                         % ", ".join(missing))
    if os.geteuid() != 0:
        raise SystemExit("build needs root (mkfs + loop mounts)")
    if not have("zstd"):
        log("zstd missing; installing with apt-get")
        subprocess.run(["apt-get", "install", "-y", "zstd"])
        if not have("zstd"):
            raise SystemExit("zstd missing: apt-get install -y zstd")
    if not have("xfs_io"):
        log("xfs_io missing; trying apt-get install -y xfsprogs (partial reflink)")
        subprocess.run(["apt-get", "install", "-y", "xfsprogs"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not have("xfs_io"):
            log("xfs_io still missing: partial reflink will be skipped")


# --------------------------------------------------------------------------
# Deterministic content helpers
# --------------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def fallocate(fd, mode, off, length):
    if _libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def tagged(tag, n):
    """Compressible but unique per 4 KiB block: detects misplaced blocks."""
    out = bytearray()
    blk = 0
    while len(out) < n:
        unit = ("%s:%08d|" % (tag, blk)).encode()
        out += (unit * (4096 // len(unit) + 1))[:4096]
        blk += 1
    return bytes(out[:n])


WORDS = ("the quick brown fox jumps over lazy dog btrfs extent inode subvolume "
         "checksum chunk stripe device tree leaf node item key offset generation "
         "transaction snapshot reflink compress inline hole prealloc").split()


def texty(rng, n):
    """Text-like data that compresses well (but not trivially)."""
    out = []
    size = 0
    while size < n:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))
        line += " %d\n" % rng.randint(0, 99999)
        out.append(line)
        size += len(line)
    return "".join(out).encode()[:n]


class Ctx:
    """Populates a mounted filesystem; records fixed timestamps."""

    def __init__(self, root, seed, res=None):
        self.root = root
        self.rng = random.Random(seed)
        self.res = res
        self.notes = []
        self.times = {}  # relpath -> (atime_ns, mtime_ns) explicit overrides

    def p(self, rel):
        return os.path.join(self.root, rel)

    def rand(self, n):
        return self.rng.randbytes(n)

    def mkdir(self, rel, mode=0o755):
        os.makedirs(self.p(rel), exist_ok=True)
        os.chmod(self.p(rel), mode)

    def write(self, rel, data, mode=0o644):
        path = self.p(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)

    def pwrite(self, rel, off, data):
        fd = os.open(self.p(rel), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, off)
        finally:
            os.close(fd)

    def truncate(self, rel, size):
        fd = os.open(self.p(rel), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def xattr(self, rel, name, value):
        os.setxattr(self.p(rel), name, value, follow_symlinks=False)

    def symlink(self, target, rel):
        os.makedirs(os.path.dirname(self.p(rel)), exist_ok=True)
        os.symlink(target, self.p(rel))

    def link(self, src, dst):
        os.makedirs(os.path.dirname(self.p(dst)), exist_ok=True)
        os.link(self.p(src), self.p(dst))

    def chown(self, rel, uid, gid):
        os.chown(self.p(rel), uid, gid, follow_symlinks=False)

    def btrfs(self, *args):
        run(["btrfs"] + list(args), capture=True)

    def no_commit(self, step):
        """In a `logged` callback: fail if a transaction commit happened since
        the base content was committed (the superblock generation moved), e.g.
        because an fsync fell back to a full commit instead of logging."""
        img = getattr(self, "img", None)
        if img is None:
            return
        gen = int(dump_super(img)["generation"])
        if gen != self.base_gen:
            raise RuntimeError("%s: a transaction was committed (generation %d -> %d)"
                               % (step, self.base_gen, gen))

    def set_time(self, rel, atime_ns, mtime_ns):
        self.times[rel] = (atime_ns, mtime_ns)

    def fix_times(self, only=None):
        """Give every inode a deterministic atime/mtime (post-order, so
        directory mtimes are not disturbed afterwards)."""
        base = 1_600_000_000 * 10**9
        order = []

        def walk(rel):
            ap = self.p(rel) if rel else self.root
            st = os.lstat(ap)
            if stat.S_ISDIR(st.st_mode):
                for name in sorted(os.listdir(ap)):
                    walk(rel + "/" + name if rel else name)
            order.append(rel)

        if only is None:
            walk("")
        else:
            order = list(only)
        for rel in order:
            if rel in self.times:
                at, mt = self.times[rel]
            else:
                h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "little")
                mt = base + (h % (10**8)) * 10**9 + (h >> 40) % 10**9
                at = mt + 86_400 * 10**9 + 123
            os.utime(self.p(rel) if rel else self.root, ns=(at, mt),
                     follow_symlinks=False)


# --------------------------------------------------------------------------
# Content recipes
# --------------------------------------------------------------------------

def pop_sizes(c, d, sizes, kind="rand"):
    for s in sizes:
        name = "%s/size-%d" % (d, s)
        if kind == "rand":
            c.write(name, c.rand(s))
        else:
            c.write(name, tagged(name, s))


def pop_bigdir(c, d, n, xattr=False):
    c.mkdir(d)
    for i in range(n):
        rel = "%s/entry-%05d" % (d, i)
        c.write(rel, b"entry %d\n" % i)
        if xattr:
            c.xattr(rel, "user.tag", b"value-%d" % i)


def pop_modest(c, n_entries=100, rand_size=96 * KiB, big_xattr=3000):
    """Generic modest content used by several fixtures."""
    c.mkdir("files")
    pop_sizes(c, "files", [0, 1, 100, 2047, 2048, 4095, 4096, 4097, 65537], "rand")
    c.write("files/tagged-512k", tagged("modest", 512 * KiB))
    c.write("files/random", c.rand(rand_size))
    c.write("files/text", texty(c.rng, 200 * KiB))
    c.mkdir("xattrs")
    c.write("xattrs/file", b"has xattrs\n")
    c.xattr("xattrs/file", "user.a", b"alpha")
    c.xattr("xattrs/file", "user.empty", b"")
    c.xattr("xattrs/file", "user.bin", bytes(range(256)))
    if big_xattr:
        c.xattr("xattrs/file", "user.large", c.rand(big_xattr))
    c.mkdir("xattrs/dir")
    c.xattr("xattrs/dir", "user.on-dir", b"dir value")
    c.mkdir("links/a")
    c.mkdir("links/b")
    c.write("links/a/orig", b"hard linked\n")
    c.link("links/a/orig", "links/b/link")
    c.symlink("../a/orig", "links/b/sym")
    c.symlink("nowhere/at/all", "links/dangling")
    pop_bigdir(c, "dir", n_entries)
    c.write("modes/m0600", b"secret\n", 0o600)
    c.chown("modes/m0600", 1000, 1000)
    c.write("sparse", b"")
    c.pwrite("sparse", 1 * MiB, tagged("sparse", 8 * KiB))
    c.truncate("sparse", 3 * MiB)
    c.set_time("files/size-1", 1_000_000_000 * 10**9, 1_234_567_890_123_456_789)


def pop_default(c):
    rng = c.rng
    # Regular files of interesting sizes.
    c.mkdir("files")
    for s in [0, 1, 100, 2047, 2048, 4095, 4096, 4097]:
        c.write("files/size-%d" % s, c.rand(s))
    c.write("files/size-1048579", tagged("files/1m+3", MiB + 3))
    c.write("files/random-3m", c.rand(3 * MiB))
    c.write("files/text-200k", texty(rng, 200 * KiB))

    # Extended attributes.
    c.mkdir("xattrs")
    c.write("xattrs/file", b"xattr carrier\n")
    c.xattr("xattrs/file", "user.alpha", b"one")
    c.xattr("xattrs/file", "user.beta", b"two two")
    c.xattr("xattrs/file", "user.empty", b"")
    c.xattr("xattrs/file", "user.binary", bytes(range(256)) + b"\x00\xff\x00")
    c.xattr("xattrs/file", "user.large", c.rand(3000))
    c.xattr("xattrs/file", "user.unicode-\u00e9\u2713", "v\u00e4lue \u2713".encode())
    c.mkdir("xattrs/dir")
    c.xattr("xattrs/dir", "user.on-dir", b"directory value")
    c.xattr("xattrs/dir", "user.second", b"\x01\x02\x03")
    c.write("xattrs/many", b"many xattrs\n")
    for i in range(40):
        c.xattr("xattrs/many", "user.k%03d" % i, b"v" * (i * 7))

    # Hard links: 3 links in three directories; 2 links in one directory;
    # 150 links with 200-byte names in one directory (overflows the
    # INODE_REF item, so the kernel uses INODE_EXTREF items).
    for d in ("hardlinks/a", "hardlinks/b", "hardlinks/c"):
        c.mkdir(d)
    c.write("hardlinks/a/three", b"three links\n")
    c.link("hardlinks/a/three", "hardlinks/b/three-link")
    c.link("hardlinks/a/three", "hardlinks/c/three-link-2")
    c.write("hardlinks/c/pair-1", b"two links, same dir\n")
    c.link("hardlinks/c/pair-1", "hardlinks/c/pair-2")
    c.mkdir("hardlinks/extref")
    c.write("hardlinks/extref/base", b"many links with long names\n")
    for i in range(150):
        c.link("hardlinks/extref/base", "hardlinks/extref/%s-%03d" % ("n" * 196, i))

    # Symlinks.
    c.mkdir("symlinks")
    c.symlink("../files/size-100", "symlinks/short")
    c.symlink("/".join(["d%02d" % (i % 100) for i in range(333)])[:1000], "symlinks/long-1000")
    c.symlink("does/not/exist", "symlinks/dangling")
    c.symlink("/etc/passwd", "symlinks/absolute")
    c.symlink("../files", "symlinks/to-dir")
    c.chown("symlinks/short", 1000, 1000)

    # Special files.
    c.mkdir("special")
    os.mkfifo(c.p("special/fifo"), 0o644)
    os.mknod(c.p("special/null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(c.p("special/loop0"), stat.S_IFBLK | 0o660, os.makedev(7, 0))
    os.mknod(c.p("special/big-dev"), stat.S_IFCHR | 0o600, os.makedev(259, 70000))
    cwd = os.getcwd()
    os.chdir(c.p("special"))
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind("sock")
        s.close()
    finally:
        os.chdir(cwd)

    # Names.
    c.mkdir("names")
    for name in ["L" * 255, "\u00e9" * 127 + "x",  # 255 bytes of UTF-8
                 "h\u00e9llo w\u00f6rld \u2713", "\u65e5\u672c\u8a9e\u306e\u30d5\u30a1\u30a4\u30eb",
                 "\u4e2d\u6587\u540d\u5b57", "\ud55c\uad6d\uc5b4", "\U0001F600\U0001F389",
                 "with space", "new\nline", "tab\there", "-leading-dash", ".hidden",
                 "back\\slash", "quote\"s'", "*?[]"]:
        c.write("names/" + name, ("name %s\n" % name).encode())
    c.mkdir("names/d\u00eer \u2713")
    c.write("names/d\u00eer \u2713/inner", b"inner\n")

    # Large directory.
    pop_bigdir(c, "bigdir", 3100)

    # Sparse files.
    c.mkdir("sparse")
    c.write("sparse/holes-20m", b"")
    c.pwrite("sparse/holes-20m", 0, tagged("sparse-0", 4096))
    c.pwrite("sparse/holes-20m", 10 * MiB, tagged("sparse-10m", 4096))
    c.truncate("sparse/holes-20m", 20 * MiB)
    c.write("sparse/hole-at-start", b"")
    c.pwrite("sparse/hole-at-start", 1 * MiB, tagged("hole-start", 4096))
    c.write("sparse/hole-at-end", tagged("hole-end", 4096))
    c.truncate("sparse/hole-at-end", 1 * MiB)
    c.write("sparse/unaligned", b"")
    c.pwrite("sparse/unaligned", 70000, b"x" * 5000)
    c.pwrite("sparse/unaligned", 300001, b"y" * 10)
    c.write("sparse/punched", tagged("punched", 256 * KiB))
    fd = os.open(c.p("sparse/punched"), os.O_RDWR)
    try:
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 64 * KiB, 64 * KiB)
    finally:
        os.close(fd)
    c.write("sparse/only-hole", b"")
    c.truncate("sparse/only-hole", 5 * MiB)

    # Preallocated extents.
    c.mkdir("prealloc")
    for rel in ("prealloc/falloc-1m", "prealloc/falloc-written-64k",
                "prealloc/falloc-keep-size"):
        c.write(rel, b"")
    fd = os.open(c.p("prealloc/falloc-1m"), os.O_RDWR)
    try:
        fallocate(fd, 0, 0, MiB)
    finally:
        os.close(fd)
    fd = os.open(c.p("prealloc/falloc-written-64k"), os.O_RDWR)
    try:
        fallocate(fd, 0, 0, MiB)
        os.pwrite(fd, tagged("prealloc-written", 64 * KiB), 0)
    finally:
        os.close(fd)
    fd = os.open(c.p("prealloc/falloc-keep-size"), os.O_RDWR)
    try:
        os.pwrite(fd, tagged("keep-size", 10000), 0)
        fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, MiB)
    finally:
        os.close(fd)

    # Subvolume, snapshot, nested subvolume (created after the snapshot, so
    # the snapshot has no empty-subvolume placeholder directory).
    c.btrfs("subvolume", "create", c.p("subvol"))
    c.write("subvol/file1", b"original content of file1\n")
    c.write("subvol/file2", c.rand(128 * KiB))
    c.mkdir("subvol/nested/dir")
    c.write("subvol/nested/dir/file3", tagged("subvol-file3", 20000))
    c.xattr("subvol/file1", "user.in-subvol", b"yes")
    c.btrfs("subvolume", "snapshot", c.p("subvol"), c.p("snap"))
    c.write("snap/file1", b"file1 changed in the snapshot after it was taken\n")
    c.write("snap/added-after", b"new in snapshot\n")
    c.pwrite("subvol/file2", 4096, b"changed in source after snapshot" * 4)
    c.btrfs("subvolume", "create", c.p("subvol/inner"))
    c.write("subvol/inner/deep", b"inside a nested subvolume\n")

    # Reflinks.
    c.mkdir("reflink")
    c.write("reflink/src", c.rand(256 * KiB))
    run(["cp", "--reflink=always", c.p("reflink/src"), c.p("reflink/full-clone")])
    run(["cp", "--reflink=always", c.p("subvol/file2"), c.p("reflink/from-subvol")])
    if have("xfs_io"):
        c.write("reflink/partial", tagged("partial-dst", 256 * KiB))
        run(["xfs_io", "-c", "reflink %s 0 64k 64k" % c.p("reflink/src"),
             c.p("reflink/partial")], capture=True)
        c.write("reflink/partial-same-file", tagged("self", 256 * KiB))
        run(["xfs_io", "-c", "reflink %s 0 128k 64k" % c.p("reflink/partial-same-file"),
             c.p("reflink/partial-same-file")], capture=True)
    else:
        c.notes.append("xfs_io missing: partial reflink skipped")

    # Modes and owners.
    c.mkdir("modes")
    c.write("modes/m0600", b"0600\n", 0o600)
    c.write("modes/m0755", b"#!/bin/sh\necho hi\n", 0o755)
    c.write("modes/m0000", b"no perms\n", 0o000)
    c.write("modes/setuid", b"setuid\n")
    c.chown("modes/setuid", 1000, 1000)
    os.chmod(c.p("modes/setuid"), 0o4755)
    c.write("modes/setgid", b"setgid\n")
    os.chmod(c.p("modes/setgid"), 0o2755)
    c.mkdir("modes/sticky", 0o1777)
    c.mkdir("modes/setgid-dir", 0o2775)
    c.chown("modes/setgid-dir", 0, 100)
    c.write("modes/u1000", b"uid 1000\n")
    c.chown("modes/u1000", 1000, 1000)
    c.write("modes/g100", b"gid 100\n")
    c.chown("modes/g100", 0, 100)
    c.write("modes/big-ids", b"big ids\n")
    c.chown("modes/big-ids", 4_000_000_000, 65534)

    # Timestamps (others get hash-derived fixed times in fix_times).
    c.mkdir("times")
    c.write("times/epoch", b"epoch\n")
    c.set_time("times/epoch", 0, 0)
    c.write("times/nanos", b"nanoseconds\n")
    c.set_time("times/nanos", 1_500_000_000_000_000_001, 1_234_567_890_987_654_321)
    c.write("times/pre-1970", b"before the epoch\n")
    c.set_time("times/pre-1970", -86_400 * 10**9, -1_000_000_000 * 10**9 + 500)
    c.write("times/y2100", b"future\n")
    c.set_time("times/y2100", 4_102_444_800 * 10**9, 4_102_444_800 * 10**9 + 999_999_999)

    c.fix_times()
    # A read-only snapshot of "snap", taken after the times were fixed (its
    # root inode copies the source's); re-fix the top directory afterwards.
    # (Not of "subvol": a snapshot of a subvolume that contains a nested
    # subvolume gets a kernel-synthesized placeholder dir whose times are
    # the lookup time, which no manifest can pin down.)
    c.btrfs("subvolume", "snapshot", "-r", c.p("snap"), c.p("snap-ro"))
    c.fix_times(only=[""])
    c.fixed = True


def pop_nodesize4k(c):
    pop_bigdir(c, "bigdir", 3100)
    c.mkdir("xattr-files")
    for i in range(2000):
        rel = "xattr-files/f%04d" % i
        c.write(rel, b"file %d with an xattr\n" % i)
        c.xattr(rel, "user.tag", b"x" * (i % 50) + b"-%d" % i)
    c.mkdir("data")
    pop_sizes(c, "data", [0, 1, 2047, 4095, 4096, 4097, 65537], "rand")
    c.write("data/random-300k", c.rand(300 * KiB))
    c.write("data/tagged-1m", tagged("4k", MiB))
    c.write("data/xattr", b"x\n")
    c.xattr("data/xattr", "user.medium", c.rand(1500))
    c.symlink("data/random-300k", "link")
    c.link("data/tagged-1m", "hardlink")


def pop_snapshots(c):
    """Quotas on; subvolume 'sv' deep enough for two levels of interior nodes
    (4K nodes), then 'snap' of it and 'snap2' of 'snap', so the three trees share
    nodes, leaves and data extents; a level-1 qgroup 1/100 holds all three. Times are
    fixed before the snapshots: fixing them afterwards would rewrite (unshare)
    every leaf of the snapshots."""
    c.btrfs("quota", "enable", c.root)
    c.btrfs("subvolume", "create", c.p("sv"))
    for i in range(2500):
        c.write("sv/file-%04d" % i, texty(c.rng, 20 + i % 90))
    for i in range(12):
        c.write("sv/big-%d" % i, tagged("b%d" % i, 100 * KiB))
    c.fix_times()
    os.sync()
    c.btrfs("subvolume", "snapshot", c.p("sv"), c.p("snap"))
    c.btrfs("subvolume", "snapshot", c.p("snap"), c.p("snap2"))
    c.btrfs("qgroup", "create", "1/100", c.root)
    for q in ("0/256", "0/257", "0/258"):
        run(["btrfs", "qgroup", "assign", "--no-rescan", q, "1/100", c.root], check=False, capture=True)
    c.btrfs("quota", "rescan", "-w", c.root)
    c.fix_times(only=[""])
    c.fixed = True


def pop_compress(c):
    rng = c.rng
    c.mkdir("c")
    c.write("c/text-300k", texty(rng, 300 * KiB))
    c.write("c/text-1.5m", texty(rng, 1536 * KiB))
    c.write("c/repetitive-5m", tagged("rep", 5 * MiB))
    c.write("c/inline-1000", (b"inline compressible text. " * 40)[:1000])
    c.write("c/inline-3000", (b"another inline compressible line\n" * 100)[:3000])
    c.write("c/small-uncompressible", c.rand(1500))
    c.write("c/random-256k", c.rand(256 * KiB))
    c.write("c/mixed", texty(rng, 64 * KiB) + c.rand(64 * KiB) + texty(rng, 64 * KiB))
    c.write("c/unaligned-size", texty(rng, 200_001))
    # Compressed, then partially overwritten after it hit the disk.
    c.write("c/overwritten", texty(rng, MiB))
    os.sync()
    c.pwrite("c/overwritten", 512 * KiB, tagged("ovw", 4096))
    c.pwrite("c/overwritten", 777_777, b"unaligned overwrite!" * 5)
    os.sync()
    c.pwrite("c/overwritten", 900 * KiB, c.rand(8192))
    # Sparse compressed file.
    c.write("c/sparse", b"")
    c.pwrite("c/sparse", 0, texty(rng, 64 * KiB))
    c.pwrite("c/sparse", 4 * MiB, texty(rng, 64 * KiB))
    c.truncate("c/sparse", 8 * MiB)
    # Reflink of a compressed file's range.
    run(["cp", "--reflink=always", c.p("c/text-300k"), c.p("c/text-300k-clone")])
    if have("xfs_io"):
        c.write("c/partial-clone", c.rand(192 * KiB))
        run(["xfs_io", "-c", "reflink %s 128k 64k 64k" % c.p("c/text-1.5m"),
             c.p("c/partial-clone")], capture=True)
    c.write("plain", b"small uncompressed-looking file\n")


def pop_raid(c):
    c.mkdir("data")
    c.write("data/random-1m", c.rand(MiB))
    c.write("data/tagged-1m-a", tagged("raid-a", MiB))
    c.write("data/tagged-1m-b", tagged("raid-b", MiB + 12345))
    c.write("data/tagged-3m", tagged("raid-3m", 3 * MiB))
    c.write("data/random-100k", c.rand(100 * KiB + 1))
    pop_sizes(c, "small", [0, 1, 2048, 4096, 4097, 70000], "rand")
    pop_bigdir(c, "dir", 200)
    c.write("sparse", b"")
    c.pwrite("sparse", 2 * MiB, tagged("raid-sparse", 200 * KiB))
    c.write("x", b"xattr\n")
    c.xattr("x", "user.raid", b"mirrored")


def pop_logtree_base(c):
    pop_modest(c, n_entries=50, rand_size=32 * KiB, big_xattr=0)
    c.write("will-grow", b"committed part\n")


def pop_logtree_logged(c):
    """Runs after the base content was committed; fsync puts it in the log."""
    t = 1_700_000_000 * 10**9
    fd = os.open(c.p("logged-new-file"), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, tagged("logged", 20000))
        os.utime(fd, ns=(t, t + 1))
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(c.p("will-grow"), os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"appended and fsynced, only in the log tree\n")
        os.utime(fd, ns=(t + 2, t + 3))
        os.fsync(fd)
    finally:
        os.close(fd)
    # Pin the top dir's times too (changed by the create) and log it.
    os.utime(c.root, ns=(t + 4, t + 5))
    fd = os.open(c.root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- logreplay: many kinds of fsynced changes left in the log tree ---------

LOGREPLAY_SMALL = [0, 1, 17, 100, 255, 512, 700, 1000, 1500, 2000, 2047, 2048,
                   2049, 3000, 4095, 4096, 4097, 5000, 8191, 8192, 10000, 12345,
                   16384, 20000, 32768, 40000, 65535, 65536, 65537, 100000]


def pop_logreplay_base(c):
    """Committed base content of `logreplay`; pop_logreplay_logged changes it."""
    c.mkdir("data")
    for i, s in enumerate(LOGREPLAY_SMALL):
        c.write("data/f%02d-%d" % (i, s), c.rand(s) if i % 2 else tagged("lr%d" % i, s))
    # Three extents (160K, 96K, 44K): written in pieces, each flushed to disk.
    # Data block groups have a size class (up to 128K, up to 8M, larger) taken
    # from their first extent; extents of both classes now make a block group
    # of each, committed with the base. The 200K file and the preallocation of
    # the log step fit in the 160K extent's one: allocating a new block group
    # there would make their fsync fall back to a transaction commit.
    fd = os.open(c.p("data/big-300k"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off, n in ((0, 160 * KiB), (160 * KiB, 96 * KiB), (256 * KiB, 44 * KiB)):
            os.pwrite(fd, tagged("big-300k-%d" % off, n), off)
            os.fsync(fd)
    finally:
        os.close(fd)
    c.write("data/text-60k", texty(c.rng, 60 * KiB))
    c.mkdir("misc")
    c.write("misc/append-me", b"committed line of append-me\n")
    c.write("misc/shrink-me", tagged("shrink", 64 * KiB))
    c.write("misc/keep", b"untouched\n")
    c.mkdir("attrs")
    c.write("attrs/chmod-me", b"mode and times change in the log\n")
    c.write("attrs/other", b"unchanged neighbour\n")
    c.mkdir("xattrs")
    c.write("xattrs/drop-one", b"one xattr is removed in the log\n")
    c.xattr("xattrs/drop-one", "user.keep", b"stays")
    c.xattr("xattrs/drop-one", "user.drop", b"removed after the commit")
    c.xattr("xattrs/drop-one", "user.bin", bytes(range(64)))
    c.write("xattrs/set-one", b"one xattr is added in the log\n")
    c.xattr("xattrs/set-one", "user.old", b"committed")
    c.mkdir("links")
    c.write("links/orig", b"hard linked twice in the base, a third time in the log\n")
    c.link("links/orig", "links/orig-link")
    c.symlink("orig", "links/sym")
    c.mkdir("movefrom")
    c.write("movefrom/move-me", tagged("move-me", 6000))
    c.write("movefrom/stay", b"stays in movefrom\n")
    c.mkdir("moveto")
    c.write("moveto/already", b"already in moveto\n")
    c.mkdir("tree/sub/deeper")
    c.write("tree/file", b"top of the tree that is renamed\n")
    c.write("tree/sub/x", tagged("tree-x", 9000))
    c.write("tree/sub/deeper/y", b"deep in the renamed tree\n")
    c.mkdir("unlinkdir")
    c.write("unlinkdir/unlink-me", tagged("unlink-me", 7000))
    c.write("unlinkdir/survivor", b"survives the unlink of its neighbour\n")
    c.mkdir("syms")
    c.write("syms/target", b"symlink target\n")


LOG_T0 = 1_700_000_000 * 10**9


def _log_fsync(c, rel, step, data=False):
    """fsync (or fdatasync) rel (file or dir) and check nothing was committed."""
    fd = _open_noatime(c.p(rel) if rel else c.root, os.O_RDONLY)
    try:
        (os.fdatasync if data else os.fsync)(fd)
    finally:
        os.close(fd)
    c.no_commit(step)


def _log_times(c, k, *rels):
    """Fixed times for step k (atime = mtime + 1 s)."""
    for i, rel in enumerate(rels):
        mt = LOG_T0 + k * 10**9 + i * 1000 + k
        os.utime(c.p(rel) if rel else c.root, ns=(mt + 10**9, mt), follow_symlinks=False)


def _log_new_file(c, rel, data, k, dirs=()):
    fd = os.open(c.p(rel), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    _log_times(c, k, rel, *dirs)


def pop_logreplay_logged(c):
    """Runs after the base content was committed (commit=300, no sync): every
    change is followed by the fsync that puts it in the log tree."""
    # 1. new files: inline-sized and 200 KiB.
    _log_new_file(c, "data/new-inline", texty(c.rng, 1200), 1, ["data"])
    _log_fsync(c, "data/new-inline", "new inline file")
    _log_new_file(c, "data/new-200k", tagged("new-200k", 200 * KiB), 2, ["data"])
    _log_fsync(c, "data/new-200k", "new 200K file")
    # 2. fdatasync of a new file.
    _log_new_file(c, "data/new-fdatasync", tagged("fdatasync", 30000), 3, ["data"])
    _log_fsync(c, "data/new-fdatasync", "fdatasync", data=True)
    # 3. append.
    fd = os.open(c.p("misc/append-me"), os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"appended line, only in the log tree\n" * 3)
    finally:
        os.close(fd)
    _log_times(c, 4, "misc/append-me")
    _log_fsync(c, "misc/append-me", "append")
    # 4. 8 KiB overwrite at 100 KiB (inside the first of three extents).
    c.pwrite("data/big-300k", 100 * KiB, tagged("overwrite", 8 * KiB))
    _log_times(c, 5, "data/big-300k")
    _log_fsync(c, "data/big-300k", "overwrite")
    # 5. shrink.
    c.truncate("misc/shrink-me", 5000)
    _log_times(c, 6, "misc/shrink-me")
    _log_fsync(c, "misc/shrink-me", "truncate")
    # 6. new tree newtree/a/b/c with files.
    c.mkdir("newtree/a/b/c")
    _log_new_file(c, "newtree/a/one", b"new file in newtree/a\n", 7)
    _log_new_file(c, "newtree/a/b/two", tagged("two", 3000), 7)
    _log_new_file(c, "newtree/a/b/c/deep", tagged("deep", 10000), 7)
    _log_times(c, 8, "newtree/a/b/c", "newtree/a/b", "newtree/a", "newtree", "")
    _log_fsync(c, "newtree/a/b/c/deep", "new deep file")
    # That logs deep and, as they are new, its ancestors (c, b, a, newtree),
    # but only the names on the path to it: the other new files are in the
    # log only once their directories are fsynced. A directory's fsync logs
    # a new file in it as existing only (size 0, no data: newtree/a/one is
    # empty after replay); newtree/a/b/two is fsynced itself, data and all.
    _log_fsync(c, "newtree/a/b/two", "new file two")
    _log_fsync(c, "newtree/a/b", "new dir b")
    _log_fsync(c, "newtree/a", "new dir a")
    # 7. rename of a file into another directory, fsync of the file. The
    # file is logged first (new times, fsync): then the rename itself updates
    # the log. A file not in the log when it is moved would mark both
    # directories (btrfs_record_unlink_dir), and the fsync after the move logs
    # the old directory in full, which falls back to a transaction commit.
    _log_times(c, 9, "movefrom/move-me")
    _log_fsync(c, "movefrom/move-me", "file to be renamed")
    # The rename logs the old directory (with the rename's time, the kernel's
    # now); fixed times and its own fsync log it again with those.
    os.rename(c.p("movefrom/move-me"), c.p("moveto/moved"))
    _log_times(c, 10, "movefrom", "moveto")
    _log_fsync(c, "moveto/moved", "rename file")
    _log_fsync(c, "movefrom", "old dir of the renamed file")
    # 8. rename of a directory, fsync of the directory.
    os.rename(c.p("tree"), c.p("tree-renamed"))
    _log_times(c, 11, "")
    _log_fsync(c, "tree-renamed", "rename dir")
    # 9. unlink, fsync of the parent.
    os.unlink(c.p("unlinkdir/unlink-me"))
    _log_times(c, 12, "unlinkdir")
    _log_fsync(c, "unlinkdir", "unlink")
    # 10. a new hard link, fsync of the file.
    os.link(c.p("links/orig"), c.p("links/third-link"))
    _log_times(c, 13, "links")
    _log_fsync(c, "links/orig", "hard link")
    # 11. xattr set on one file, removed from another.
    os.setxattr(c.p("xattrs/set-one"), "user.new", b"set in the log")
    _log_fsync(c, "xattrs/set-one", "xattr set")
    os.removexattr(c.p("xattrs/drop-one"), "user.drop")
    _log_fsync(c, "xattrs/drop-one", "xattr removed")
    # 12. preallocation beyond the size of a new file.
    _log_new_file(c, "data/falloc-new", tagged("falloc", 5000), 14, ["data"])
    fd = os.open(c.p("data/falloc-new"), os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, 192 * KiB)
    finally:
        os.close(fd)
    _log_times(c, 15, "data/falloc-new")
    _log_fsync(c, "data/falloc-new", "fallocate")
    # 13. chmod and times.
    os.chmod(c.p("attrs/chmod-me"), 0o600)
    _log_times(c, 16, "attrs/chmod-me")
    _log_fsync(c, "attrs/chmod-me", "chmod")
    # 14. new symlink, fsync of its directory.
    os.symlink("target", c.p("syms/new-sym"))
    _log_times(c, 17, "syms/new-sym", "syms")
    _log_fsync(c, "syms", "symlink")


# -- logreplay-subvol: log trees of two subvolumes -------------------------

def pop_logreplay_subvol_base(c):
    c.write("top-file", b"top-level file\n")
    c.write("top-grow", b"committed part of top-grow\n")
    c.btrfs("subvolume", "create", c.p("sv"))
    c.write("sv/file", b"file in the subvolume\n")
    c.write("sv/grow", b"committed part of sv/grow\n")
    c.write("sv/dir/ren-me", tagged("ren-me", 3000))
    c.fix_times()
    c.btrfs("subvolume", "snapshot", c.p("sv"), c.p("snap"))
    c.fix_times(only=[""])
    c.fixed = True


def pop_logreplay_subvol_logged(c):
    _log_new_file(c, "top-new", b"new in the top-level subvolume\n", 1, [""])
    _log_fsync(c, "top-new", "top: new file")
    fd = os.open(c.p("top-grow"), os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"appended in the top-level subvolume\n")
    finally:
        os.close(fd)
    _log_times(c, 2, "top-grow")
    _log_fsync(c, "top-grow", "top: append")
    _log_new_file(c, "sv/new", tagged("sv-new", 9000), 3, ["sv"])
    _log_fsync(c, "sv/new", "sv: new file")
    fd = os.open(c.p("sv/grow"), os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"appended in the subvolume\n")
    finally:
        os.close(fd)
    _log_times(c, 4, "sv/grow")
    _log_fsync(c, "sv/grow", "sv: append")
    os.rename(c.p("sv/dir/ren-me"), c.p("sv/dir/renamed"))
    _log_times(c, 5, "sv/dir")
    _log_fsync(c, "sv/dir/renamed", "sv: rename")


def pop_replace(c):
    # Tagged blocks: compressible, and a block read from the wrong place shows.
    c.mkdir("data")
    for i in range(4):
        c.write("data/tagged-%d" % i, tagged("replace-%d" % i, 40 * MiB + i * 4096))
    c.write("small", b"a small file\n")


def replace_percent(mnt):
    """The percent `btrfs replace status -1` prints, or None once it is not running."""
    txt = out_of(["btrfs", "replace", "status", "-1", mnt], check=False)
    mt = re.match(r"\s*([0-9.]+)% done", txt)
    return float(mt.group(1)) if mt else None


def make_replace(name, spec, imgs, fdir, res, size, seed):
    """A RAID1 filesystem (devices 0 and 1) whose `btrfs replace` of devid 2 onto
    device 2 was cut by a crash part-way.

    The images live in a subvolume of an outer btrfs; while the replace copies,
    a commit writes its cursor (`btrfs filesystem sync`) and a snapshot of that
    subvolume takes all three images at one instant: a crash image. The replace
    then finishes on the live images, which are thrown away."""
    outer_img = os.path.join(fdir, "outer.img")
    outer = os.path.join(fdir, "outer")
    os.makedirs(outer, exist_ok=True)
    with open(outer_img, "wb") as f:
        f.truncate(4 * 1024 * MiB)
    run(["mkfs.btrfs", "-q", "-f", outer_img])
    odev = res.losetup(outer_img)
    notes = []
    try:
        res.mount([odev], outer, "")
        live = os.path.join(outer, "live")
        run(["btrfs", "subvolume", "create", live], capture=True)
        limgs = [os.path.join(live, os.path.basename(i)) for i in imgs]
        for li in limgs:
            with open(li, "wb") as f:
                f.truncate(size)
        run(["mkfs.btrfs", "-q", "-f", "-L", name] + spec["mkfs"] + limgs[:2])
        mnt = os.path.join(fdir, "mnt")
        with attached(res, limgs) as devs:
            # commit=300: no periodic commit moves the cursor after the one asked for.
            with mounted(res, devs[:2], mnt, "commit=300"):
                c = Ctx(mnt, seed, res)
                pop_replace(c)
                c.fix_times()
                run(["btrfs", "filesystem", "sync", mnt])
                log("$ btrfs replace start -B", devs[1], devs[2], mnt)
                rep = subprocess.Popen(["btrfs", "replace", "start", "-B", devs[1], devs[2], mnt])
                try:
                    got = None
                    for _ in range(3000):
                        p = replace_percent(mnt)
                        if p is not None and p >= 30.0:
                            got = p
                            break
                        time.sleep(0.005)
                    if got is None or got > 80.0:
                        raise RuntimeError("replace: did not see it between 30% and 80% (%s)" % got)
                    run(["btrfs", "filesystem", "sync", mnt])
                    run(["btrfs", "subvolume", "snapshot", live, os.path.join(outer, "crash")],
                        capture=True)
                    notes.append("replace cut at %.1f%% by a snapshot of its devices" % got)
                finally:
                    rep.wait()
        for li, img in zip(limgs, imgs):
            run(["cp", "--sparse=always",
                 os.path.join(outer, "crash", os.path.basename(li)), img])
    finally:
        if outer in res.mounts:
            res.umount(outer)
        res.detach(odev)
        os.unlink(outer_img)
    return notes


def pop_seed(c):
    c.mkdir("seeded")
    c.write("seeded/tagged", tagged("seed", 3 * MiB))
    c.write("seeded/small", b"written before seeding\n")


def make_sprout(name, spec, imgs, fdir, res, size, seed):
    """A sprout (device 0) over a seed device (device 1): the seed made and
    flagged with `btrfstune -S 1`, mounted, the sprout added, remounted rw and
    written."""
    sprout, seed_img = imgs
    for img in imgs:
        with open(img, "wb") as f:
            f.truncate(size)
    run(["mkfs.btrfs", "-q", "-f", "-L", name] + spec["mkfs"] + [seed_img])
    mnt = os.path.join(fdir, "mnt")
    with attached(res, [seed_img]) as devs:
        with mounted(res, devs, mnt, ""):
            c = Ctx(mnt, seed, res)
            pop_seed(c)
            c.fix_times()
    run(["btrfstune", "-S", "1", seed_img])
    with attached(res, [sprout, seed_img]) as devs:
        with mounted(res, [devs[1]], mnt, ""):
            run(["btrfs", "device", "add", "-f", devs[0], mnt], capture=True)
            run(["mount", "-o", "remount,rw", mnt])
            c = Ctx(mnt, seed + 1, res)
            c.mkdir("sprouted")
            c.write("sprouted/tagged", tagged("sprout", 2 * MiB))
            c.fix_times()
    return ["seed device 1 (btrfstune -S 1), sprout device 0 added and written"]


def pop_convert(c):
    """Content written to an ext4 filesystem that btrfs-convert then converts."""
    c.mkdir("files")
    for s in [0, 1, 100, 2047, 2048, 3000, 4095, 4096, 4097, 65537]:
        c.write("files/size-%d" % s, c.rand(s))
    c.write("files/text-300k", texty(c.rng, 300 * KiB))
    c.write("files/tagged-1m+3", tagged("convert-1m", MiB + 3))
    # Nested and empty directories, a directory large enough for an ext4 htree.
    c.write("dirs/a/b/c/d/deep", b"deep file\n")
    c.mkdir("dirs/empty")
    c.mkdir("dirs/sticky", 0o1777)
    pop_bigdir(c, "dirs/big", 300)
    # Symlinks: fast (in the ext4 inode), slow (a data block), dangling, absolute.
    c.mkdir("symlinks")
    c.symlink("../files/size-100", "symlinks/short")
    c.symlink("/".join(["d%02d" % (i % 100) for i in range(70)])[:200], "symlinks/long-200")
    c.symlink("does/not/exist", "symlinks/dangling")
    c.symlink("/etc/passwd", "symlinks/absolute")
    # Hard links: three names in three directories, two in one.
    c.write("links/a/three", b"three links\n")
    c.link("links/a/three", "links/b/three-link")
    c.link("links/a/three", "links/c/three-link-2")
    c.write("links/c/pair-1", b"two links, same dir\n")
    c.link("links/c/pair-1", "links/c/pair-2")
    # Xattrs: in the ext4 inode and in an xattr block.
    c.write("xattrs/file", b"xattr carrier\n")
    c.xattr("xattrs/file", "user.alpha", b"one")
    c.xattr("xattrs/file", "user.empty", b"")
    c.xattr("xattrs/file", "user.binary", bytes(range(256)))
    c.xattr("xattrs/file", "user.large", c.rand(3000))
    c.mkdir("xattrs/dir")
    c.xattr("xattrs/dir", "user.on-dir", b"directory value")
    # Sparse and preallocated files.
    c.write("sparse/holes-12m", b"")
    c.pwrite("sparse/holes-12m", 0, tagged("sparse-0", 4096))
    c.pwrite("sparse/holes-12m", 10 * MiB, tagged("sparse-10m", 8192))
    c.truncate("sparse/holes-12m", 12 * MiB)
    c.write("sparse/hole-at-start", b"")
    c.pwrite("sparse/hole-at-start", 1 * MiB, tagged("hole-start", 4096))
    c.write("sparse/unaligned", b"")
    c.pwrite("sparse/unaligned", 70000, b"x" * 5000)
    c.write("sparse/only-hole", b"")
    c.truncate("sparse/only-hole", 5 * MiB)
    c.write("sparse/falloc-256k", b"")
    fd = os.open(c.p("sparse/falloc-256k"), os.O_RDWR)
    try:
        fallocate(fd, 0, 0, 256 * KiB)
        os.pwrite(fd, tagged("falloc", 8192), 64 * KiB)
    finally:
        os.close(fd)
    # Special files, names, modes and owners.
    c.mkdir("special")
    os.mkfifo(c.p("special/fifo"), 0o644)
    os.mknod(c.p("special/null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.mknod(c.p("special/loop0"), stat.S_IFBLK | 0o660, os.makedev(7, 0))
    for name in ["L" * 255, "h\u00e9llo w\u00f6rld \u2713", "\u65e5\u672c\u8a9e",
                 "with space", ".hidden"]:
        c.write("names/" + name, ("name %s\n" % name).encode())
    c.write("modes/m0600", b"secret\n", 0o600)
    c.chown("modes/m0600", 1000, 1000)
    c.write("modes/m4755", b"#!/bin/sh\n", 0o4755)
    c.chown("modes/m4755", 0, 100)
    c.set_time("files/size-1", 1_000_000_000 * 10**9, 1_234_567_890_123_456_789)


# --------------------------------------------------------------------------
# Fixture definitions
# --------------------------------------------------------------------------

FIXTURES = {
    "default": dict(
        mkfs=[], populate=pop_default, size=114 * MiB,
        notes="mkfs defaults (crc32c, nodesize 16K, metadata DUP, no-holes, "
              "free-space-tree); rich content: file sizes, xattrs, hard links "
              "(incl. INODE_EXTREF), symlinks, special files, long/unicode names, "
              "3100-entry dir, sparse, prealloc, subvolume + snapshot + ro snapshot "
              "+ nested subvolume, reflinks, modes/owners, fixed timestamps"),
    "nodesize4k-xxhash": dict(
        mkfs=["--csum", "xxhash", "-n", "4096"], populate=pop_nodesize4k, size=114 * MiB,
        min_fs_level=2,
        notes="xxhash64 checksums, 4K nodes; 3100-entry dir + 2000 files with an "
              "xattr each so the fs tree has 3+ levels"),
    "snapshots": dict(
        mkfs=["-n", "4096"], populate=pop_snapshots, size=114 * MiB,
        notes="4K nodes, quotas on: subvolume sv (2500 small files, 12 of 100K; "
              "two levels of interior nodes), snapshot snap of sv and snap2 of snap "
              "sharing its blocks and extents, level-1 qgroup 1/100 over the three"),
    "sha256-64k": dict(
        mkfs=["--csum", "sha256", "-n", "65536"],
        populate=lambda c: pop_modest(c, n_entries=500), size=256 * MiB,
        notes="sha256 checksums, 64K nodes; modest content, 500-entry dir"),
    "blake2": dict(
        mkfs=["--csum", "blake2", "-n", "16384"],
        populate=lambda c: pop_modest(c, n_entries=200), size=114 * MiB,
        notes="blake2b-256 checksums, 16K nodes; modest content"),
    "zlib": dict(
        mkfs=[], mount_opts="compress-force=zlib", populate=pop_compress, size=114 * MiB,
        notes="mounted compress-force=zlib: compressed regular and inline extents, "
              "partially overwritten compressed extents, sparse compressed file, "
              "reflinked compressed ranges, incompressible data"),
    "lzo": dict(
        mkfs=[], mount_opts="compress-force=lzo", populate=pop_compress, size=114 * MiB,
        notes="mounted compress-force=lzo; same content recipe as zlib"),
    "zstd": dict(
        mkfs=[], mount_opts="compress-force=zstd", populate=pop_compress, size=114 * MiB,
        notes="mounted compress-force=zstd; same content recipe as zlib"),
    "dup-data": dict(
        mkfs=["-d", "dup", "-m", "dup"], populate=lambda c: pop_modest(c, n_entries=100),
        size=114 * MiB, notes="data and metadata DUP; modest content"),
    "raid0": dict(
        mkfs=["-d", "raid0", "-m", "raid1"], devices=2, populate=pop_raid, size=128 * MiB,
        notes="2 devices, data raid0, metadata raid1; files span many 64K stripes"),
    "raid1": dict(
        mkfs=["-d", "raid1", "-m", "raid1"], devices=2, populate=pop_raid, size=128 * MiB,
        notes="2 devices, data+metadata raid1"),
    "raid10": dict(
        mkfs=["-d", "raid10", "-m", "raid10"], devices=4, populate=pop_raid, size=128 * MiB,
        notes="4 devices, data+metadata raid10"),
    "raid1c3": dict(
        mkfs=["-d", "raid1c3", "-m", "raid1c3"], devices=3, populate=pop_raid,
        size=128 * MiB, notes="3 devices, data+metadata raid1c3"),
    "mixed": dict(
        mkfs=["-M"], populate=lambda c: pop_modest(c, n_entries=100), size=64 * MiB,
        notes="mixed block groups (-M): data and metadata share block groups, "
              "nodesize = sectorsize = 4096"),
    "logtree": dict(
        mkfs=[], mount_opts="commit=300", populate=pop_logtree_base,
        logged=pop_logtree_logged, size=114 * MiB,
        notes="superblock has a log tree (log_root != 0): base content committed, "
              "then 'logged-new-file' created and 'will-grow' appended, each "
              "fsynced, and the image copied before any transaction commit. The "
              "manifest is the COMMITTED state (mounted with log replay disabled): "
              "logged-new-file is absent and will-grow has its old size. "
              "logtree.replayed.manifest.jsonl is the state after the kernel "
              "replays the log."),
    "logreplay": dict(
        mkfs=[], mount_opts="commit=300", populate=pop_logreplay_base,
        logged=pop_logreplay_logged, size=114 * MiB,
        notes="superblock has a log tree holding many kinds of fsynced changes "
              "made after the base content was committed: new inline and 200K "
              "files, an fdatasync, an append, an 8K overwrite inside a 300K "
              "file's first extent, a shrink, a new tree newtree/a/b/c, a file "
              "renamed into another dir, a renamed dir, an unlink, a new hard "
              "link, an xattr set and one removed, a preallocation beyond EOF of "
              "a new file, a chmod, a new symlink (see pop_logreplay_logged). The "
              "manifest is the COMMITTED state; logreplay.replayed.manifest.jsonl "
              "is the state after the kernel replays the log"),
    "logreplay-subvol": dict(
        mkfs=[], mount_opts="commit=300", populate=pop_logreplay_subvol_base,
        logged=pop_logreplay_subvol_logged, size=114 * MiB,
        notes="log root tree with two log trees: subvolume sv and its snapshot "
              "snap committed, then a new file and an append fsynced in both "
              "the top-level subvolume and sv, and a rename inside sv. The "
              "manifest is the COMMITTED state; "
              "logreplay-subvol.replayed.manifest.jsonl the state after replay"),
    "replace": dict(
        mkfs=["-d", "raid1", "-m", "raid1"], devices=3, make=make_replace, size=512 * MiB,
        check_devices=2,
        notes="RAID1 on devices 0 and 1; `btrfs replace` of devid 2 onto device 2 "
              "(devid 0, the replace target) cut part-way: a DEV_REPLACE item in "
              "state STARTED with the cursor mid-way"),
    "sprout": dict(
        mkfs=[], devices=2, make=make_sprout, size=128 * MiB,
        notes="sprout filesystem (device 0) over a seed device (device 1, SEEDING "
              "flag, its own fsid)"),
    "convert": dict(
        convert="ext4", mkfs=["-b", "4096", "-J", "size=4"], populate=pop_convert,
        size=192 * MiB,
        notes="btrfs-convert of an ext4 filesystem (mkfs.ext4 -b 4096 -J size=4, filled "
              "through an ext4 loop mount): the ext2_saved subvolume with its image "
              "file, DIR_ITEMs with garbage transids (progs 6.2), no free space tree; "
              "files of many sizes (inline and regular), nested/empty/300-entry dirs, "
              "fast and slow symlinks, hard links, xattrs in the inode and in an xattr "
              "block, sparse and preallocated files, special files, names, modes, owners"),
}


# --------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------

def mkfs(imgs, args, size, label):
    """mkfs.btrfs on sparse files; grow them if mkfs says they're too small."""
    for _ in range(4):
        for img in imgs:
            if os.path.exists(img):
                os.unlink(img)
            with open(img, "wb") as f:
                f.truncate(size)
        cmd = ["mkfs.btrfs", "-q", "-f", "-L", label] + args + imgs
        r = run(cmd, check=False, capture=True)
        if r.returncode == 0:
            return size
        err = r.stderr.decode(errors="replace")
        mt = re.search(r"minimum size for each btrfs device is (\d+)", err)
        if not mt:
            raise RuntimeError("mkfs failed: %s\n%s" % (" ".join(cmd), err))
        size = (int(mt.group(1)) + MiB - 1) // MiB * MiB
        log("mkfs wants at least", mt.group(1), "bytes; retrying with", size)
    raise RuntimeError("mkfs kept failing")


# A fixed uuid and hash seed, so the ext4 side is built the same way each time.
EXT4_UUID = "2d5f6c1e-7d0a-4c7b-9a52-6b1f0e0c4a11"


def mkfs_ext4(img, args, size, label):
    if os.path.exists(img):
        os.unlink(img)
    with open(img, "wb") as f:
        f.truncate(size)
    run(["mkfs.ext4", "-q", "-F", "-L", label, "-U", EXT4_UUID,
         "-E", "hash_seed=%s,lazy_itable_init=0,lazy_journal_init=0" % EXT4_UUID]
        + args + [img], capture=True)
    return size


def btrfs_check(res, imgs, data_csum=False):
    """btrfs check --readonly; returns its output, raises on errors."""
    if len(imgs) == 1:
        r = run(["btrfs", "check", "--readonly"] + (["--check-data-csum"] if data_csum else [])
                + [imgs[0]], check=False, capture=True)
    else:
        with attached(res, imgs, readonly=True) as devs:
            for d in devs:
                subprocess.run(["btrfs", "device", "scan", d],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            r = run(["btrfs", "check", "--readonly", devs[0]], check=False, capture=True)
    txt = r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")
    if r.returncode != 0 or re.search(r"^ERROR|errors found|error\(s\) found", txt, re.M):
        raise RuntimeError("btrfs check failed for %s:\n%s" % (imgs, txt))
    return txt


def sha256_path(path):
    return _sha256_file(path)


def build_one(name, spec, out_dir, work, res):
    t0 = time.time()
    ndev = spec.get("devices", 1)
    fdir = os.path.join(work, name)
    os.makedirs(fdir, exist_ok=True)
    imgs = [os.path.join(fdir, "%s.%d.img" % (name, i)) for i in range(ndev)]
    mnt = os.path.join(fdir, "mnt")
    os.makedirs(mnt, exist_ok=True)
    source = spec.get("convert", "btrfs")
    mount_opts = spec.get("mount_opts", "")
    notes = [spec.get("notes", "")]
    meta_extra = {}
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")

    # 1. populate (or a builder of its own for scenarios a plain mount cannot make;
    # an ext4 source is converted in place afterwards)
    if spec.get("make"):
        size = spec["size"]
        notes += spec["make"](name, spec, imgs, fdir, res, size, seed)
    else:
        if source == "btrfs":
            size = mkfs(imgs, spec["mkfs"], spec["size"], name[:200])
        else:
            size = mkfs_ext4(imgs[0], spec["mkfs"], spec["size"], name[:200])
        with attached(res, imgs) as devs:
            with mounted(res, devs, mnt, mount_opts, fstype=source):
                c = Ctx(mnt, seed, res)
                spec["populate"](c)
                if not getattr(c, "fixed", False):
                    c.fix_times()
                notes += c.notes
                if spec.get("logged"):
                    # Commit everything so far, then create log-tree-only changes
                    # and copy the device while the fs is still mounted.
                    os.sync()
                    c.img = imgs[0]
                    c.base_gen = int(dump_super(imgs[0])["generation"])
                    spec["logged"](c)
                    c.no_commit("logged changes")
                    copies = [img + ".logcopy" for img in imgs]
                    for src, dst in zip(imgs, copies):
                        run(["cp", "--sparse=always", src, dst])
                    sup = dump_super(copies[0])
                    if int(sup.get("log_root", "0")) == 0:
                        raise RuntimeError("logtree: copied superblock has log_root 0")
                    log("logtree: copy has log_root", sup["log_root"])
        if spec.get("logged"):
            for src, dst in zip(imgs, copies):
                os.replace(dst, src)
        if source != "btrfs":
            # -L: the btrfs label is the ext4 one (the fixture's name).
            run(["btrfs-convert", "--no-progress", "-L", imgs[0]], capture=True)
            meta_extra["source_fs"] = source
            meta_extra["convert_args"] = ["-L"]
            meta_extra["btrfs_progs"] = out_of(["btrfs", "--version"]).strip()

    # 2. fsck
    # btrfs-progs counts a replace target's size into the filesystem's and calls
    # that an error: the replace fixture checks without it.
    check_txt = btrfs_check(res, imgs[:spec.get("check_devices", ndev)], data_csum=source != "btrfs")
    log("btrfs check ok for", name)

    # 3. the kernel's view of what is on disk (read-only loops, ro mount)
    before = [sha256_path(i) for i in imgs]
    sup = dump_super(imgs[0])
    has_log = int(sup.get("log_root", "0")) != 0
    with attached(res, imgs, readonly=True) as devs:
        if has_log:
            used = None
            for opt in ("ro,nologreplay", "ro,rescue=nologreplay"):
                if res.try_mount(devs, mnt, opt):
                    used = opt
                    break
            if used is None:
                raise RuntimeError("could not mount %s without log replay" % name)
            notes.append("committed-state manifest taken with mount -o %s" % used)
            meta_extra["manifest_mount_opts"] = used
        else:
            res.mount(devs, mnt, "ro")
            meta_extra["manifest_mount_opts"] = "ro"
        try:
            write_manifest(mnt, os.path.join(out_dir, name + ".manifest.jsonl"))
        finally:
            res.umount(mnt)
        level = tree_root_level(devs[0], "5")
    after = [sha256_path(i) for i in imgs]
    if before != after:
        raise RuntimeError("read-only manifest mount changed the image(s)!")
    meta_extra["fs_tree_level"] = level
    if spec.get("min_fs_level") is not None:
        if level < spec["min_fs_level"]:
            raise RuntimeError("%s: fs tree root level %d < %d" % (
                name, level, spec["min_fs_level"]))
        notes.append("fs tree (tree 5) root level is %d" % level)

    # 3b. log tree: also record the replayed state, on a scratch copy.
    if has_log:
        scratch = [i + ".replay" for i in imgs]
        try:
            for s, d in zip(imgs, scratch):
                run(["cp", "--sparse=always", s, d])
            # rw mount replays the log (and commits); then look at the
            # result through a read-only mount, like every other manifest.
            with attached(res, scratch) as devs:
                with mounted(res, devs, mnt, "noatime"):
                    pass
            with attached(res, scratch, readonly=True) as devs:
                with mounted(res, devs, mnt, "ro"):
                    write_manifest(mnt, os.path.join(out_dir, name + ".replayed.manifest.jsonl"))
        finally:
            for d in scratch:
                if os.path.exists(d):
                    os.unlink(d)

    # 4. compress
    for old in os.listdir(out_dir):
        mt = re.fullmatch(re.escape(name) + r"\.(\d+)\.img\.zst", old)
        if mt and int(mt.group(1)) >= ndev:
            os.unlink(os.path.join(out_dir, old))
    zsizes = []
    for i, img in enumerate(imgs):
        dst = os.path.join(out_dir, "%s.%d.img.zst" % (name, i))
        tmp = dst + ".tmp"
        run(["zstd", "-19", "--long", "-T2", "-q", "-f", img, "-o", tmp])
        os.replace(tmp, dst)
        zsizes.append(os.path.getsize(dst))

    meta = {
        "devices": ndev,
        "mkfs_args": (["-L", name[:200]] if source == "btrfs" else
                      ["-L", name[:200], "-U", EXT4_UUID]) + spec["mkfs"],
        "mount_opts": mount_opts,
        "notes": "; ".join(n for n in notes if n),
        "has_log_tree": has_log,
        "sectorsize": int(sup["sectorsize"]),
        "nodesize": int(sup["nodesize"]),
        "csum": sup["csum_type"].split("(")[-1].rstrip(")").strip(),
        "csum_type": int(sup["csum_type"].split()[0]),
        "device_size": size,
        "fsid": sup.get("fsid"),
        "label": name[:200],
        "generation": int(sup["generation"]),
        "incompat_flags": sup.get("incompat_flags"),
        "compat_ro_flags": sup.get("compat_ro_flags"),
    }
    meta.update(meta_extra)
    with open(os.path.join(out_dir, name + ".meta.json"), "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    log("%s built in %.1fs: %s" % (name, time.time() - t0, zsizes))
    return zsizes


def cmd_build(args):
    ensure_tools()
    names = args.names or list(FIXTURES)
    for n in names:
        if n not in FIXTURES:
            raise SystemExit("unknown fixture %r (have: %s)" % (n, ", ".join(FIXTURES)))
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    work = args.work or tempfile.mkdtemp(prefix="ubtrfs-fixtures-")
    os.makedirs(work, exist_ok=True)
    res = Resources()
    results = {}
    try:
        for n in names:
            results[n] = build_one(n, FIXTURES[n], out_dir, work, res)
            fdir = os.path.join(work, n)
            if not args.keep_work:
                res.cleanup()
                shutil.rmtree(fdir, ignore_errors=True)
    finally:
        res.cleanup()
        if not args.keep_work and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    total = 0
    print("%-20s %s" % ("fixture", "compressed bytes per device"))
    for n, zs in results.items():
        print("%-20s %s  (total %.2f MiB)" % (n, " ".join(str(z) for z in zs), sum(zs) / MiB))
        total += sum(zs)
    print("total compressed images built: %.2f MiB" % (total / MiB))
    all_bytes = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)
                    if os.path.isfile(os.path.join(out_dir, f)))
    print("size of %s: %.2f MiB" % (out_dir, all_bytes / MiB))
    return 0


def cmd_manifest(args):
    data = manifest_lines(manifest(args.dir))
    if args.out:
        with open(args.out, "w", encoding="utf-8", newline="\n") as f:
            f.write(data)
    else:
        sys.stdout.buffer.write(data.encode("utf-8"))
    return 0


def cmd_diff(args):
    ign = [k.strip() for k in (args.ignore_keys or "").split(",") if k.strip()]
    ign_dir = [k.strip() for k in (args.ignore_dir_keys or "").split(",") if k.strip()]
    lines = diff_manifests(load_manifest(args.a), load_manifest(args.b), ign,
                           args.ignore_paths, ign_dir)
    for ln in lines:
        print(ln)
    if lines:
        print("%d difference(s)" % len(lines), file=sys.stderr)
        return 1
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build fixture images + manifests")
    b.add_argument("--out", default=DEFAULT_OUT, help="output dir (default tests/fixtures)")
    b.add_argument("--work", help="scratch dir for raw images (default: a temp dir)")
    b.add_argument("--keep-work", action="store_true", help="keep raw images")
    b.add_argument("names", nargs="*", metavar="NAME")
    m = sub.add_parser("manifest", help="print the manifest of a directory tree")
    m.add_argument("--out", help="write to FILE instead of stdout")
    m.add_argument("dir")
    d = sub.add_parser("diff", help="compare two manifests (exit 1 if different)")
    d.add_argument("--ignore-keys", default="", help="comma-separated keys to ignore")
    d.add_argument("--ignore-dir-keys", default="",
                   help="comma-separated keys ignored when both entries are dirs "
                        "(e.g. size,nlink,blocks for a non-btrfs extract dir)")
    d.add_argument("--ignore-paths", default=None, help="regex; matching paths are skipped")
    d.add_argument("a")
    d.add_argument("b")
    sub.add_parser("list", help="list fixture names")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        return cmd_build(args)
    if args.cmd == "manifest":
        return cmd_manifest(args)
    if args.cmd == "diff":
        return cmd_diff(args)
    if args.cmd == "list":
        for n, s in FIXTURES.items():
            print("%-20s %s" % (n, s.get("notes", "")))
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
