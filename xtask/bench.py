#!/usr/bin/env python3
"""Benchmarks: ubtrfs against the Linux kernel's btrfs driver, both measured in one run.

Usage (as root, from anywhere):

  python3 xtask/bench.py [--tiny] [--runs N] [--workdir DIR] [--out FILE]
                         [--only NAME,...] [--no-build]

Benchmarks (names for --only):

  cat-uncompressed  `cat MNT/file` on a fresh `mount -o ro,loop` vs `ubtrfs cat IMG /file`,
                    a 1 GiB file of pseudo-random data.
  cat-zstd          the same for a 1 GiB text-like file written with compress-force=zstd.
  extract           `cp -a MNT/. DEST/` vs `ubtrfs extract IMG DEST` for an image of
                    100,000 small files (0-8 KiB) in 100 directories; DEST on a tmpfs.
  peak-rss          peak RSS of `ubtrfs cat` on both 1 GiB files (target: < 64 MiB),
                    measured during the cat runs (needs both cat benchmarks).

The image file is put in the page cache before timing and kept there; the kernel side is
remounted fresh for every run (so btrfs's own caches start cold, like ubtrfs's do); only
the cat / cp / ubtrfs process is timed (each under `/usr/bin/time -f %M`, which also gives
ubtrfs's peak RSS), not mount or umount. Kernel and ubtrfs runs
alternate. Reported: medians, min/max, throughput, and ratio = kernel time / ubtrfs time
(> 1 means ubtrfs is faster). Outputs are verified once per benchmark outside the timing
(sha256 for cat, manifest diff via xtask/fixtures.py for extract).

Images live under --workdir (default /var/tmp/ubtrfs-bench/{full,tiny}) and are reused by
later invocations while their stamp (IMAGE_VERSION + parameters) matches. Results go to
--out (default docs/benchmarks.md; with --tiny, nowhere unless --out is given): each
benchmark is a section between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` markers,
and only the sections that were run are replaced, so other benchmarks can add theirs.

--tiny runs the same pipeline at a tiny scale (64 MiB files, 2,000 files, 1 run) for
`cargo test` (crates/cli/tests/bench_tiny.rs).

Stdlib only. Needs root, mkfs.btrfs, mount/umount with loop support, cp, cargo.
"""

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES_PY = os.path.join(REPO, "xtask", "fixtures.py")
DEFAULT_DOC = os.path.join(REPO, "docs", "benchmarks.md")
DEFAULT_WORKDIR = "/var/tmp/ubtrfs-bench"

# Bump when the way images are made changes: stale images are then rebuilt.
IMAGE_VERSION = "ubtrfs-bench-images-v1"

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

SCALES = {
    "full": dict(cat_bytes=1 * GiB, cat_img=1536 * MiB, ext_dirs=100, ext_per_dir=1000,
                 ext_max=8 * KiB, ext_img=2 * GiB, tmpfs="4G", runs=5),
    "tiny": dict(cat_bytes=64 * MiB, cat_img=512 * MiB, ext_dirs=20, ext_per_dir=100,
                 ext_max=8 * KiB, ext_img=512 * MiB, tmpfs="512M", runs=1),
}

BENCHES = ["cat-uncompressed", "cat-zstd", "extract", "peak-rss"]
RSS_TARGET_KIB = 64 * 1024
BENCH_FILE = "bench.bin"

WORDS = ("the quick brown fox jumps over lazy dog btrfs extent inode subvolume "
         "checksum chunk stripe device tree leaf node item key offset generation "
         "transaction snapshot reflink compress inline hole prealloc read write sync "
         "mount umount balance scrub replace resize label quota qgroup send receive").split()


def log(*a):
    print("bench:", *a, file=sys.stderr, flush=True)


def run(cmd, check=True, capture=False, **kw):
    if capture:
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
    r = subprocess.run(cmd, **kw)
    if check and r.returncode != 0:
        err = r.stderr.decode(errors="replace") if isinstance(r.stderr, bytes) else ""
        raise RuntimeError("command failed (exit %d): %s\n%s" % (r.returncode, shlex.join(map(str, cmd)), err))
    return r


def out_of(cmd, check=True):
    return run(cmd, check=check, capture=True).stdout.decode(errors="replace").strip()


class Interrupted(BaseException):
    pass


def _on_signal(signum, _frame):
    raise Interrupted("signal %d" % signum)


# --------------------------------------------------------------------------
# Mounts: everything mounted is unmounted in a finally
# --------------------------------------------------------------------------

class Mounts:
    def __init__(self):
        self.active = []

    def mount(self, src, mnt, opts, fstype=None):
        os.makedirs(mnt, exist_ok=True)
        cmd = ["mount"] + (["-t", fstype] if fstype else []) + ["-o", opts, src, mnt]
        run(cmd, capture=True)
        self.active.append(mnt)

    def umount(self, mnt):
        for i in range(20):
            r = run(["umount", mnt], check=False, capture=True)
            if r.returncode == 0:
                break
            time.sleep(0.2 * (i + 1))
        else:
            raise RuntimeError("umount %s: %s" % (mnt, r.stderr.decode(errors="replace")))
        self.active.remove(mnt)

    @contextlib.contextmanager
    def mounted(self, src, mnt, opts, fstype=None):
        self.mount(src, mnt, opts, fstype)
        try:
            yield mnt
        finally:
            self.umount(mnt)

    def cleanup(self):
        for mnt in reversed(list(self.active)):
            if run(["umount", mnt], check=False, capture=True).returncode != 0:
                log("umount %s failed; lazy unmount" % mnt)
                run(["umount", "-l", mnt], check=False, capture=True)
            self.active.remove(mnt)


def unmount_stale(workdir):
    """Unmount leftovers below workdir from a killed earlier run (deepest first)."""
    stale = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == workdir or mp.startswith(workdir.rstrip("/") + "/"):
                stale.append(mp)
    for mp in sorted(stale, key=len, reverse=True):
        log("unmounting stale %s" % mp)
        if run(["umount", mp], check=False, capture=True).returncode != 0:
            run(["umount", "-l", mp], check=False, capture=True)


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------

TIME_BIN = "/usr/bin/time"


def kill_child(p):
    """On interruption: stop the running child (and GNU time's own child) so that the
    mounts it uses can be unmounted."""
    with contextlib.suppress(OSError):
        for line in open("/proc/%d/task/%d/children" % (p.pid, p.pid)).read().split():
            with contextlib.suppress(OSError):
                os.kill(int(line), signal.SIGKILL)
    with contextlib.suppress(OSError):
        p.kill()
    with contextlib.suppress(Exception):
        p.wait(timeout=10)


def timed(cmd, stdout_path="/dev/null"):
    """Run cmd with stdout to stdout_path; return (seconds, peak RSS KiB, stderr text).

    The command runs under GNU time (`/usr/bin/time -f %M`), for both sides alike: Linux
    carries the RSS high-water mark of the pre-exec image over exec, so `wait4` on a child
    vforked by this (~30 MiB) Python process can never report less than Python's own peak.
    GNU time is a small process, so its child's figure is the command's own."""
    with open(stdout_path, "wb") as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile(prefix="bench-rss-") as rssf:
        full = [TIME_BIN, "-f", "%M", "-o", rssf.name, "--"] + list(cmd)
        t0 = time.perf_counter()
        p = subprocess.Popen(full, stdout=out, stderr=err)
        try:
            p.wait()
        except BaseException:
            kill_child(p)
            raise
        t1 = time.perf_counter()
        err.seek(0)
        etext = err.read().decode(errors="replace")
        rss_text = open(rssf.name).read().strip().splitlines()
    if p.returncode != 0:
        raise RuntimeError("command failed (exit %d): %s\n%s" % (p.returncode, shlex.join(map(str, cmd)), etext))
    return t1 - t0, int(rss_text[-1]), etext


def sha256_of_output(cmd):
    h = hashlib.sha256()
    n = 0
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        try:
            while True:
                b = p.stdout.read(1 * MiB)
                if not b:
                    break
                h.update(b)
                n += len(b)
            err = p.stderr.read().decode(errors="replace")
        except BaseException:
            kill_child(p)
            raise
    if p.returncode != 0:
        raise RuntimeError("command failed (exit %d): %s\n%s" % (p.returncode, shlex.join(map(str, cmd)), err))
    return h.hexdigest(), n


def prime_page_cache(path):
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 * MiB)
        while f.readinto(buf):
            pass
    log("page cache primed with %s (%.1f s)" % (os.path.basename(path), time.perf_counter() - t0))


def rm_tree(path):
    if os.path.lexists(path):
        run(["rm", "-rf", "--one-file-system", path])


# --------------------------------------------------------------------------
# Images (built through the kernel, reused while the stamp matches)
# --------------------------------------------------------------------------

def text_pool(seed, size=8 * MiB):
    """Text-like lines with counters: zstd (btrfs level 3, 128 KiB chunks) gets ~3.5-4x."""
    rng = random.Random(seed)
    lines, n, total = [], 0, 0
    while total < size:
        line = "%09d %s %d\n" % (n, " ".join(rng.choices(WORDS, k=rng.randint(4, 14))), rng.randrange(1000000))
        lines.append(line)
        total += len(line)
        n += 1
    return "".join(lines).encode()


def write_big_file(path, nbytes, kind, seed):
    """Write nbytes of deterministic data; returns its sha256."""
    rng = random.Random(seed)
    pool = text_pool(seed + 1) if kind == "text" else None
    h = hashlib.sha256()
    chunk = 1 * MiB
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(chunk, left)
            if kind == "random":
                b = rng.randbytes(n)
            else:
                off = rng.randrange(len(pool) - n)
                b = pool[off:off + n]
            f.write(b)
            h.update(b)
            left -= n
    return h.hexdigest()


def populate_small_files(root, sc, seed):
    """ext_dirs directories of ext_per_dir files, sizes 0..ext_max, 1 in 10 with a user xattr."""
    rng = random.Random(seed)
    pool = rng.randbytes(16 * MiB)
    nbytes = nfiles = 0
    for d in range(sc["ext_dirs"]):
        dpath = os.path.join(root, "d%03d" % d)
        os.mkdir(dpath, 0o755)
        for i in range(sc["ext_per_dir"]):
            size = rng.randint(0, sc["ext_max"])
            off = rng.randrange(len(pool) - size)
            p = os.path.join(dpath, "f%04d.dat" % i)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                if size:
                    os.write(fd, pool[off:off + size])
                os.fchmod(fd, rng.choice((0o644, 0o644, 0o644, 0o600, 0o755, 0o444)))
                if i % 10 == 0:
                    os.setxattr(fd, "user.bench", b"file %d/%d" % (d, i))
            finally:
                os.close(fd)
            nbytes += size
            nfiles += 1
    return nfiles, nbytes


def data_used_bytes(mnt):
    run(["sync", "-f", os.path.join(mnt, ".")])
    out = out_of(["btrfs", "filesystem", "df", "-b", mnt])
    m = re.search(r"^Data, \S+: total=\d+, used=(\d+)", out, re.M)
    return int(m.group(1)) if m else None


def ensure_image(mounts, dirpath, name, params, build):
    """Return the stamp dict of dirpath/name.img, (re)building it if missing or stale."""
    img = os.path.join(dirpath, name + ".img")
    stamp_path = os.path.join(dirpath, name + ".stamp.json")
    want = {"version": IMAGE_VERSION, "params": params}
    if os.path.exists(img) and os.path.exists(stamp_path):
        try:
            with open(stamp_path) as f:
                st = json.load(f)
            if st.get("version") == want["version"] and st.get("params") == want["params"]:
                log("reusing %s" % img)
                return st
        except ValueError:
            pass
    log("building %s ..." % img)
    t0 = time.perf_counter()
    for p in (img, stamp_path):
        if os.path.exists(p):
            os.unlink(p)
    tmp = img + ".tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    with open(tmp, "wb") as f:
        f.truncate(params["image_bytes"])
    run(["mkfs.btrfs", "-q", "-f", "-L", "ubtrfs-bench", tmp], capture=True)
    mnt = os.path.join(dirpath, "mnt-build")
    opts = "loop" + ("," + params["mount_opts"] if params.get("mount_opts") else "")
    with mounts.mounted(tmp, mnt, opts):
        info = build(mnt)
    run(["btrfs", "check", "--readonly", "--check-data-csum", tmp], capture=True)
    os.rename(tmp, img)
    st = dict(want, **info)
    with open(stamp_path + ".tmp", "w") as f:
        json.dump(st, f, indent=1, sort_keys=True)
    os.rename(stamp_path + ".tmp", stamp_path)
    log("built %s in %.1f s" % (img, time.perf_counter() - t0))
    return st


def cat_image(mounts, dirpath, sc, compressed):
    kind = "text" if compressed else "random"
    params = {"image_bytes": sc["cat_img"], "file_bytes": sc["cat_bytes"], "data": kind,
              "mount_opts": "compress-force=zstd" if compressed else "", "seed": 1000 + compressed}

    def build(mnt):
        sha = write_big_file(os.path.join(mnt, BENCH_FILE), params["file_bytes"], kind, params["seed"])
        return {"sha256": sha, "data_used": data_used_bytes(mnt)}

    name = "cat-zstd" if compressed else "cat-uncompressed"
    st = ensure_image(mounts, dirpath, name, params, build)
    return os.path.join(dirpath, name + ".img"), st


def extract_image(mounts, dirpath, sc):
    params = {"image_bytes": sc["ext_img"], "dirs": sc["ext_dirs"], "per_dir": sc["ext_per_dir"],
              "max_size": sc["ext_max"], "seed": 2000, "xattr_every": 10}

    def build(mnt):
        nfiles, nbytes = populate_small_files(mnt, sc, params["seed"])
        return {"files": nfiles, "bytes": nbytes, "data_used": data_used_bytes(mnt)}

    st = ensure_image(mounts, dirpath, "extract", params, build)
    return os.path.join(dirpath, "extract.img"), st


# --------------------------------------------------------------------------
# Benchmarks
# --------------------------------------------------------------------------

def loop_dio_note(mnt):
    """Whether the loop device behind mnt uses direct I/O (it then bypasses the page cache)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == mnt:
                src = line.split(" - ")[1].split()[1]
                dev = os.path.basename(src)
                try:
                    with open("/sys/block/%s/loop/dio" % dev) as g:
                        return dev, g.read().strip()
                except OSError:
                    return dev, "?"
    return "?", "?"


def bench_cat(ctx, name, img, st):
    runs = ctx.runs
    mnt = os.path.join(ctx.dir, "mnt")
    size = st["params"]["file_bytes"]
    prime_page_cache(img)
    kcmd = ["cat", os.path.join(mnt, BENCH_FILE)]
    ucmd = [ctx.bin, "cat", img, "/" + BENCH_FILE]

    # Warm-up + verification (untimed): both must produce the bytes written.
    with ctx.mounts.mounted(img, mnt, "ro,loop"):
        loopdev, dio = loop_dio_note(mnt)
        ksha, kn = sha256_of_output(kcmd)
    usha, un = sha256_of_output(ucmd)
    if not (ksha == usha == st["sha256"] and kn == un == size):
        raise RuntimeError("%s: output mismatch: kernel %s (%d bytes), ubtrfs %s (%d bytes), written %s (%d bytes)"
                           % (name, ksha, kn, usha, un, st["sha256"], size))
    log("%s: verified: kernel and ubtrfs output sha256 %s... (%d bytes); loop %s dio=%s"
        % (name, usha[:16], size, loopdev, dio))

    kt, ut, urss = [], [], []
    for i in range(runs):
        order = ("k", "u") if i % 2 == 0 else ("u", "k")
        for side in order:
            if side == "k":
                with ctx.mounts.mounted(img, mnt, "ro,loop"):
                    t, _, _ = timed(kcmd)
                kt.append(t)
            else:
                t, rss, _ = timed(ucmd)
                ut.append(t)
                urss.append(rss)
        log("%s run %d/%d: kernel %.3f s, ubtrfs %.3f s (peak RSS %d KiB)" % (name, i + 1, runs, kt[-1], ut[-1], urss[-1]))
    ctx.rss[name] = urss
    return {
        "name": name, "kernel": kt, "ubtrfs": ut, "bytes": size, "files": 1,
        "verified": "sha256 of both outputs equal to the data written (%s...)" % usha[:16],
        "loop_dio": dio, "stamp": st,
    }


def bench_extract(ctx, img, st):
    runs = ctx.runs
    mnt = os.path.join(ctx.dir, "mnt")
    dest_root = os.path.join(ctx.dir, "dest")
    prime_page_cache(img)
    kt, ut, urss = [], [], []
    verified = None
    with ctx.mounts.mounted("tmpfs", dest_root, "size=%s,mode=0755" % ctx.sc["tmpfs"], fstype="tmpfs"):
        kdest = os.path.join(dest_root, "kernel")
        udest = os.path.join(dest_root, "ubtrfs")
        for i in range(runs):
            order = ("k", "u") if i % 2 == 0 else ("u", "k")
            for side in order:
                if side == "k":
                    rm_tree(kdest)
                    os.mkdir(kdest)
                    with ctx.mounts.mounted(img, mnt, "ro,loop"):
                        t, _, _ = timed(["cp", "-a", mnt + "/.", kdest + "/"])
                    kt.append(t)
                else:
                    rm_tree(udest)
                    os.mkdir(udest)
                    t, rss, err = timed([ctx.bin, "extract", img, udest])
                    ut.append(t)
                    urss.append(rss)
                    warn = [ln for ln in err.splitlines() if "warning" in ln]
                    if warn:
                        log("ubtrfs extract warnings: %s" % " | ".join(warn[:5]))
            log("extract run %d/%d: kernel %.3f s, ubtrfs %.3f s (peak RSS %d KiB)" % (i + 1, runs, kt[-1], ut[-1], urss[-1]))
            if verified is None:
                verified = verify_trees(ctx, kdest, udest, st)
        rm_tree(kdest)
        rm_tree(udest)
    ctx.rss["extract"] = urss
    return {
        "name": "extract", "kernel": kt, "ubtrfs": ut, "bytes": st["bytes"], "files": st["files"],
        "verified": verified, "stamp": st,
    }


def verify_trees(ctx, kdest, udest, st):
    t0 = time.perf_counter()
    ma = os.path.join(ctx.dir, "manifest.kernel.jsonl")
    mb = os.path.join(ctx.dir, "manifest.ubtrfs.jsonl")
    run([sys.executable, FIXTURES_PY, "manifest", "--out", ma, kdest])
    run([sys.executable, FIXTURES_PY, "manifest", "--out", mb, udest])
    d = run([sys.executable, FIXTURES_PY, "diff", ma, mb, "--ignore-keys", "ino,blocks,subvol",
             "--ignore-dir-keys", "size,nlink"], check=False, capture=True)
    if d.returncode != 0:
        lines = d.stdout.decode(errors="replace").splitlines()
        raise RuntimeError("extract: `cp -a` and `ubtrfs extract` trees differ (%d lines; manifests kept in %s):\n%s"
                           % (len(lines), ctx.dir, "\n".join(lines[:30])))
    with open(ma) as f:
        n = sum(1 for _ in f)
    expect = st["files"] + st["params"]["dirs"] + 1
    if n != expect:
        raise RuntimeError("extract: manifest has %d entries, expected %d" % (n, expect))
    log("extract: verified: manifests of both trees identical (%d entries, %.1f s)" % (n, time.perf_counter() - t0))
    os.unlink(ma)
    os.unlink(mb)
    return "manifests of the two trees identical (%d entries; ignoring ino, blocks, subvol, dir size/nlink)" % n


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------

def loadavg():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def machine_info():
    cpu = "?"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    mem = "?"
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            m = re.search(r"MemTotal:\s+(\d+) kB", f.read())
            mem = "%.1f GiB" % (int(m.group(1)) / MiB)
    rev = out_of(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], check=False) or "?"
    if out_of(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], check=False):
        rev += " + uncommitted changes"
    return {
        "load_start": loadavg(),
        "kernel": platform.release(), "nproc": os.cpu_count(), "cpu": cpu, "mem": mem,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "rev": rev,
        "progs": out_of(["mkfs.btrfs", "--version"], check=False).splitlines()[0] if shutil.which("mkfs.btrfs") else "?",
        "coreutils": out_of(["cp", "--version"], check=False).splitlines()[0],
    }


def summarize(r):
    k = statistics.median(r["kernel"])
    u = statistics.median(r["ubtrfs"])
    r.update(kmed=k, umed=u, ratio=k / u, kmbs=r["bytes"] / MiB / k, umbs=r["bytes"] / MiB / u)
    return r


def fmt_runs(ts):
    return ", ".join("%.3f" % t for t in ts)


def verdict(ratio):
    if ratio >= 1.05:
        return "ubtrfs faster"
    if ratio <= 0.95:
        return "ubtrfs slower"
    return "about equal"


def title(name, sc):
    size = human(sc["cat_bytes"])
    return {
        "cat-uncompressed": "cat: %s uncompressed file" % size,
        "cat-zstd": "cat: %s zstd-compressed file" % size,
        "extract": "extract: %s small files vs `cp -a`" % format(sc["ext_dirs"] * sc["ext_per_dir"], ","),
        "peak-rss": "Peak RSS of `ubtrfs cat`",
    }[name]


def human(n):
    s = "%.2f GiB" % (n / GiB) if n >= GiB else "%.1f MiB" % (n / MiB)
    return re.sub(r"\.0+ ", " ", s)


def section_text(name, r, ctx):
    m = ctx.machine
    lines = []
    lines.append("## " + title(name, ctx.sc) + (" (tiny scale)" if ctx.scale == "tiny" else ""))
    lines.append("")
    if name in ("cat-uncompressed", "cat-zstd"):
        st = r["stamp"]
        p = st["params"]
        lines.append("**What**: read one %s file to /dev/null: `cat MNT/%s` on the kernel's mount vs "
                     "`ubtrfs cat IMG /%s`." % (human(p["file_bytes"]), BENCH_FILE, BENCH_FILE))
        lines.append("")
        if name == "cat-zstd":
            data = ("text-like lines (words + counters), written with `mount -o compress-force=zstd`; "
                    "data on disk %s, compression %.1fx" % (human(st["data_used"]), p["file_bytes"] / st["data_used"])
                    if st.get("data_used") else "text-like data, compress-force=zstd")
        else:
            data = "pseudo-random bytes (incompressible), default mount options; data on disk %s" % human(st.get("data_used") or 0)
        lines.append("**Setup**: %s sparse image, `mkfs.btrfs` defaults; the file was written through a kernel loop "
                     "mount (%s). The image is read once into the page cache before timing and stays there. "
                     "Kernel: a fresh `mount -o ro,loop IMG MNT` per run (btrfs caches cold; loop dio=%s), "
                     "only the `cat` is timed. ubtrfs: one process per run (its caches start cold too). "
                     "One untimed warm-up of each side first; runs alternate kernel/ubtrfs. "
                     "Verified: %s." % (human(p["image_bytes"]), data, r.get("loop_dio", "?"), r["verified"]))
    elif name == "extract":
        st = r["stamp"]
        p = st["params"]
        lines.append("**What**: copy a whole image's tree out to a tmpfs: `cp -a MNT/. DEST/` on the kernel's mount vs "
                     "`ubtrfs extract IMG DEST`.")
        lines.append("")
        lines.append("**Setup**: %s sparse image, `mkfs.btrfs` defaults, populated through a kernel loop mount: "
                     "%d directories of %d files, sizes uniform in 0..%d bytes (%s of file data; small files "
                     "inline), every %dth file has a user xattr, modes vary. Image read once into the page cache "
                     "before timing. Kernel: a fresh `mount -o ro,loop` per run, only `cp -a` timed. DEST is a "
                     "fresh directory on a tmpfs (size=%s) mounted by the script; it is deleted between runs, "
                     "untimed. Runs alternate kernel/ubtrfs. Verified after the first run: %s."
                     % (human(p["image_bytes"]), p["dirs"], p["per_dir"], p["max_size"], human(st["bytes"]),
                        p["xattr_every"], ctx.sc["tmpfs"], r["verified"]))
    elif name == "peak-rss":
        lines.append("**What**: peak resident set size (`/usr/bin/time -f %%M`) of the `ubtrfs cat` processes "
                     "timed above, max over %d run(s); target < %d MiB." % (ctx.runs, RSS_TARGET_KIB // 1024))
    lines.append("")
    lines.append("**Command**: `%s` (as root, from the repository root)." % ctx.command)
    lines.append("")
    lines.append("**Machine**: Linux %s, %s CPUs (%s), %s RAM; %s; %s; ubtrfs at %s; measured %s; "
                 "1-minute load average %s at the start, %s at the end (other work on the machine adds noise)."
                 % (m["kernel"], m["nproc"], m["cpu"], m["mem"], m["progs"], m["coreutils"], m["rev"], m["date"],
                    m["load_start"], m.get("load_end", "?")))
    lines.append("")
    if name == "peak-rss":
        lines.append("| file | peak RSS (max) | peak RSS (median) | target |")
        lines.append("|---|---:|---:|---|")
        for key, v in r["rows"]:
            lines.append("| %s | %.1f MiB | %.1f MiB | %s |" % (key, max(v) / 1024, statistics.median(v) / 1024,
                                                            "met" if max(v) < RSS_TARGET_KIB else "**over**"))
        if "extract" in ctx.rss:
            v = ctx.rss["extract"]
            lines.append("| (for reference: `ubtrfs extract`) | %.1f MiB | %.1f MiB | - |" % (max(v) / 1024, statistics.median(v) / 1024))
    else:
        unit = "MiB/s"
        lines.append("| side | median (s) | min (s) | max (s) | throughput (%s) | all runs (s) |" % unit)
        lines.append("|---|---:|---:|---:|---:|---|")
        kcmd = "`cp -a MNT/. DEST/`" if name == "extract" else "`cat MNT/%s > /dev/null`" % BENCH_FILE
        ucmd = "`ubtrfs extract IMG DEST`" if name == "extract" else "`ubtrfs cat IMG /%s > /dev/null`" % BENCH_FILE
        for side, cmd, ts, med, mbs in (("kernel", kcmd, r["kernel"], r["kmed"], r["kmbs"]),
                                        ("ubtrfs", ucmd, r["ubtrfs"], r["umed"], r["umbs"])):
            extra = ""
            if name == "extract":
                extra = " (%.0f files/s)" % (r["files"] / med)
            lines.append("| %s: %s | %.3f | %.3f | %.3f | %.1f%s | %s |"
                         % (side, cmd, med, min(ts), max(ts), mbs, extra, fmt_runs(ts)))
        lines.append("")
        lines.append("**Ratio kernel/ubtrfs (medians): %.2f** (%s; > 1 means ubtrfs is faster)." % (r["ratio"], verdict(r["ratio"])))
    return "\n".join(lines) + "\n"


DOC_HEADER = """# Benchmarks: ubtrfs vs the kernel's btrfs driver

Produced by `xtask/bench.py` (run it as root: `python3 xtask/bench.py --runs 5`; see its
docstring for options). Both sides are measured in the same run on the same image, which
sits in the page cache; the kernel side gets a fresh mount per run so btrfs's own caches
start cold, as ubtrfs's do. Times are medians of alternating runs; **ratio = kernel time /
ubtrfs time, above 1 means ubtrfs is faster**. The machines these run on are small and
noisy: compare ratios rather than absolute times.

Each benchmark is a section between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`
markers; re-running a benchmark replaces only its own section, and other benchmarks
(write path, further seeds) add their own sections below.
"""


def update_doc(path, sections):
    old = ""
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            old = f.read()
    text = old if old.strip() else DOC_HEADER
    for name, body in sections:
        block = "<!-- bench:%s -->\n%s<!-- /bench:%s -->\n" % (name, body, name)
        pat = re.compile(r"<!-- bench:%s -->\n.*?<!-- /bench:%s -->\n?" % (re.escape(name), re.escape(name)), re.S)
        if pat.search(text):
            text = pat.sub(lambda _m: block, text, count=1)
        else:
            text = text.rstrip("\n") + "\n\n" + block
    if os.path.isfile(path) or not os.path.exists(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    else:  # /dev/null or another special file
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def print_summary(results, ctx):
    print()
    print("ubtrfs vs kernel (%s scale, %d run(s) each; ratio = kernel/ubtrfs, > 1: ubtrfs faster)" % (ctx.scale, ctx.runs))
    print()
    print("| benchmark | kernel median (s) | ubtrfs median (s) | ratio | kernel MiB/s | ubtrfs MiB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print("| %s | %.3f | %.3f | %.2f | %.1f | %.1f |" % (r["name"], r["kmed"], r["umed"], r["ratio"], r["kmbs"], r["umbs"]))
    print()
    for r in results:
        print("ratio %s: kernel/ubtrfs = %.2f (%s)" % (r["name"], r["ratio"], verdict(r["ratio"])))
    for key, v in ctx.rss_rows:
        print("peak-rss %s: %.1f MiB (%s the %d MiB target)" % (key, max(v) / 1024, "within" if max(v) < RSS_TARGET_KIB else "OVER",
                                                               RSS_TARGET_KIB // 1024))
    if "extract" in ctx.rss:
        print("peak-rss ubtrfs extract: %.1f MiB (no target)" % (max(ctx.rss["extract"]) / 1024))
    print(flush=True)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

class Ctx:
    pass


def check_env():
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (loop mounts)")
    if not os.access(TIME_BIN, os.X_OK):
        problems.append("%s (GNU time) not found: apt-get install time" % TIME_BIN)
    for tool in ("mkfs.btrfs", "btrfs", "mount", "umount", "cp", "cargo"):
        if not shutil.which(tool):
            problems.append("%s not found" % tool)
    with open("/proc/filesystems") as f:
        if "btrfs" not in f.read():
            run(["modprobe", "btrfs"], check=False, capture=True)
    with open("/proc/filesystems") as f:
        if "btrfs" not in f.read():
            problems.append("the kernel has no btrfs driver")
    if problems:
        sys.exit("bench.py: " + "; ".join(problems))


def main(argv=None):
    ap = argparse.ArgumentParser(description="ubtrfs vs kernel benchmarks (see the module docstring)")
    ap.add_argument("--tiny", action="store_true", help="tiny scale for tests (64 MiB, 2,000 files, 1 run)")
    ap.add_argument("--runs", type=int, help="timed runs per side (default 5; 1 with --tiny)")
    ap.add_argument("--workdir", default=DEFAULT_WORKDIR, help="images and scratch (default %s)" % DEFAULT_WORKDIR)
    ap.add_argument("--out", help="markdown file to update (default docs/benchmarks.md; none with --tiny)")
    ap.add_argument("--only", help="comma-separated subset of: " + ",".join(BENCHES))
    ap.add_argument("--no-build", action="store_true", help="skip `cargo build --release` (use the existing binary)")
    ap.add_argument("--binary", help="use this ubtrfs binary instead of building target/release/ubtrfs (implies --no-build)")
    args = ap.parse_args(argv)

    ctx = Ctx()
    ctx.scale = "tiny" if args.tiny else "full"
    ctx.sc = SCALES[ctx.scale]
    ctx.runs = args.runs if args.runs else ctx.sc["runs"]
    if ctx.runs < 1:
        ap.error("--runs must be >= 1")
    only = BENCHES if not args.only else [b.strip() for b in args.only.split(",") if b.strip()]
    for b in only:
        if b not in BENCHES:
            ap.error("unknown benchmark %r (choose from %s)" % (b, ", ".join(BENCHES)))
    out = args.out if args.out else (None if args.tiny else DEFAULT_DOC)
    cmd = ["python3", "xtask/bench.py"] + (["--tiny"] if args.tiny else []) + ["--runs", str(ctx.runs)]
    if args.only:
        cmd += ["--only", ",".join(only)]
    ctx.command = shlex.join(cmd)

    check_env()
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)

    workdir = os.path.abspath(args.workdir)
    ctx.dir = os.path.join(workdir, ctx.scale)
    os.makedirs(ctx.dir, exist_ok=True)
    lock = open(os.path.join(workdir, ".lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        log("another bench.py holds %s; waiting" % workdir)
        fcntl.flock(lock, fcntl.LOCK_EX)
    unmount_stale(workdir)

    target_dir = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
    ctx.bin = args.binary or os.path.join(target_dir, "release", "ubtrfs")
    if not args.no_build and not args.binary:
        log("cargo build --release -p ubtrfs")
        run(["cargo", "build", "--release", "-p", "ubtrfs"], cwd=REPO)
    if not os.access(ctx.bin, os.X_OK):
        sys.exit("bench.py: %s missing" % ctx.bin)

    ctx.machine = machine_info()
    ctx.mounts = Mounts()
    ctx.rss = {}
    ctx.rss_rows = []
    results = []
    sections = []
    try:
        if "cat-uncompressed" in only or "peak-rss" in only:
            img, st = cat_image(ctx.mounts, ctx.dir, ctx.sc, compressed=False)
            results.append(summarize(bench_cat(ctx, "cat-uncompressed", img, st)))
        if "cat-zstd" in only or "peak-rss" in only:
            img, st = cat_image(ctx.mounts, ctx.dir, ctx.sc, compressed=True)
            results.append(summarize(bench_cat(ctx, "cat-zstd", img, st)))
        if "extract" in only:
            img, st = extract_image(ctx.mounts, ctx.dir, ctx.sc)
            results.append(summarize(bench_extract(ctx, img, st)))
    finally:
        ctx.mounts.cleanup()
        lock.close()

    ctx.machine["load_end"] = loadavg()
    for key, label in (("cat-uncompressed", "uncompressed"), ("cat-zstd", "zstd")):
        if key in ctx.rss:
            ctx.rss_rows.append(("cat %s %s" % (label, human(ctx.sc["cat_bytes"])), ctx.rss[key]))
    for r in results:
        if r["name"] in only:
            sections.append((r["name"], section_text(r["name"], r, ctx)))
    if "peak-rss" in only:
        sections.append(("peak-rss", section_text("peak-rss", {"rows": ctx.rss_rows}, ctx)))

    print_summary(results, ctx)
    for _, body in sections:
        print(body)
    if out:
        update_doc(out, sections)
        log("wrote %s" % out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Interrupted as e:
        sys.exit("bench.py: interrupted (%s); mounts cleaned up" % e)
    except KeyboardInterrupt:
        sys.exit("bench.py: interrupted; mounts cleaned up")
    except RuntimeError as e:
        sys.exit("bench.py: error: %s" % e)
