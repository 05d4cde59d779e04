#!/usr/bin/env python3
"""Workloads through a mount: `ubtrfs mount` against the kernel's btrfs driver, with two
other FUSE filesystems beside them for scale, all in one run.

Targets (names for --targets):

  kernel   `mount -o loop` of a fresh `mkfs.btrfs` image (the oracle and the yardstick).
  ubtrfs   `ubtrfs mount IMG MNT` of a fresh `mkfs.btrfs` image, with the fuse module's
           enable_uring parameter set to N for the run (the value found is restored after).
  ubtrfs-uring  the same with enable_uring set to Y, so that the kernel offers FUSE over
           io_uring: the two columns differ only in the transport. Skipped (with the
           reason printed) where /sys/module/fuse/parameters/enable_uring does not exist.
  bindfs   bindfs over a kernel btrfs loop mount: what passing every call through FUSE
           costs a filesystem that does nothing else.
  fuse2fs  fuse2fs on a fresh `mkfs.ext4` image: another filesystem served from userspace.

Workloads (names for --only); each run gets a fresh image and mount, set-up untimed:

  seqwrite   fio: one 2 GiB file, 1 MiB writes, fsync at the end.
  seqread    fio: read that file back in 1 MiB requests after a remount (cold caches).
  randwrite  fio: 4 KiB random writes over a 256 MiB file (64 MiB written), fsync at end.
  randread   fio: 4 KiB random reads of 64 MiB from a 256 MiB file after a remount.
  untar      tar -x of a tarball of /usr/include and /usr/share/doc (tens of thousands
             of small files).
  walk       `find -type f | wc -l` and `du -s` of that tree after a remount.
  fsmark     fs_mark: 20,000 empty files in two threads (one directory each), no fsync.
  dbench     dbench with 4 clients for --dbench-secs seconds (throughput, MB/s).
  fsyncrand  fio: 4 KiB random writes over a 64 MiB file, fsync after each (2048 fsyncs).
  sqlitewal  SQLite: 2000 single-row INSERT transactions, journal_mode=WAL, synchronous=FULL.
  sqliterollback  the same with journal_mode=DELETE (a rollback journal per transaction).
  dbenchsync dbench -s (every file opened O_SYNC), 4 clients (throughput, MB/s).
  cpa        `cp -a /usr/include DST` into the mount.
  rmrf       `rm -rf` of the untar tree after a remount (cold caches).
  gitclone   `git clone --no-hardlinks` of this repository into the mount, then `git log -p`.
  cbuild     `make -j2 -s` of 200 generated C files (one shared header) into one program.

For the fsync workloads the table also gives the bytes written per fsync or transaction:
the loop device's written sectors for the kernel, the daemon's write(2) bytes (/proc
PID/io wchar) for ubtrfs, during the timed body.

Timed: the workload, then the unmount (for the FUSE targets, until the daemon exits),
so every figure is the time until the data is on the image, whatever each target defers.
dbench is time-based and reports its throughput instead. Rounds alternate the targets
(kernel, ubtrfs, bindfs, fuse2fs, kernel, ...); figures are medians over --runs rounds;
ratio = kernel time / target time (above 1: faster than the kernel; for dbench the
throughputs' ratio target / kernel). Peak RSS of the ubtrfs daemon (each ubtrfs target)
from /proc VmHWM. After the first run of each workload of each ubtrfs target the image
passes `btrfs check --readonly --check-data-csum`.

Usage (root):  cargo build --release -p ubtrfs
               python3 xtask/fuse_bench.py [--runs 3] [--only seqwrite,untar]
                   [--targets kernel,ubtrfs] [--workdir /var/tmp/ufb (short: fs_mark overflows on long paths)]
                   [--binary target/release/ubtrfs] [--dbench-secs 20] [--mount-opts OPTS]

Needs fio, fs_mark, dbench, bindfs, fuse2fs, mkfs.btrfs, mkfs.ext4, tar, fusermount3
(and Python's sqlite3 module); cp and rm (coreutils) for cpa and rmrf, git for gitclone
(and this repository as a git checkout), make and gcc for cbuild.
Stdlib only. Prints a table; paste it into docs/benchmarks.md with the command.
"""

import argparse
import contextlib
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30
URING_PARAM = "/sys/module/fuse/parameters/enable_uring"
UBTRFS_TARGETS = ("ubtrfs", "ubtrfs-uring")
# enable_uring during a target's mount: N for ubtrfs, Y for ubtrfs-uring, untouched for others.
URING_VALUE = {"ubtrfs": "N", "ubtrfs-uring": "Y"}


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def quiet(cmd):
    return run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def is_mountpoint(path):
    return subprocess.run(["mountpoint", "-q", path]).returncode == 0


def wait_for(pred, what, limit=30.0):
    t = time.monotonic()
    while not pred():
        if time.monotonic() - t > limit:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.02)


def drop_caches():
    run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


@contextlib.contextmanager
def fuse_uring(value):
    """The fuse module's enable_uring parameter set to `value` ("Y" or "N") inside the
    block, and the value found there written back after it, errors included. Nothing is
    touched when `value` is None or the parameter does not exist."""
    if value is None or not os.path.exists(URING_PARAM):
        yield
        return
    with open(URING_PARAM) as f:
        old = f.read().strip()
    try:
        with open(URING_PARAM, "w") as f:
            f.write(value + "\n")
        yield
    finally:
        with open(URING_PARAM, "w") as f:
            f.write(old + "\n")


def fresh_image(path, size, fs):
    if os.path.exists(path):
        os.remove(path)
    with open(path, "wb") as f:
        f.truncate(size)
    if fs == "btrfs":
        quiet(["mkfs.btrfs", "-q", "-f", path])
    else:
        quiet(["mkfs.ext4", "-q", "-F", path])


class Target:
    """A mounted filesystem at `mnt`: mount() after a fresh image, unmount() commits."""

    def __init__(self, name, args, workdir):
        self.name, self.args = name, args
        self.ubtrfs = name in UBTRFS_TARGETS
        self.dir = os.path.join(workdir, name)
        os.makedirs(self.dir, exist_ok=True)
        self.img = os.path.join(self.dir, "img")
        self.mnt = os.path.join(self.dir, "mnt")
        self.lower = os.path.join(self.dir, "lower")
        os.makedirs(self.mnt, exist_ok=True)
        self.proc = None
        self.peak_rss_kib = 0

    def fresh(self):
        fresh_image(self.img, self.args.image_gib * GiB, "ext4" if self.name == "fuse2fs" else "btrfs")

    def mount(self):
        if self.name == "kernel":
            run(["mount", "-o", "loop", self.img, self.mnt])
        elif self.name == "bindfs":
            os.makedirs(self.lower, exist_ok=True)
            run(["mount", "-o", "loop", self.img, self.lower])
            run(["bindfs", "--multithreaded", self.lower, self.mnt])
        elif self.name == "fuse2fs":
            self.proc = subprocess.Popen(["fuse2fs", "-f", "-o", "rw,fakeroot", self.img, self.mnt], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            cmd = [self.args.binary, "mount"]
            if self.args.mount_opts:
                cmd += ["-o", self.args.mount_opts]
            self.proc = subprocess.Popen(cmd + [self.img, self.mnt], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(lambda: is_mountpoint(self.mnt), f"{self.name} mount")
        os.chmod(self.mnt, 0o777)

    def unmount(self):
        if self.ubtrfs and self.proc:
            try:
                with open(f"/proc/{self.proc.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmHWM:"):
                            self.peak_rss_kib = max(self.peak_rss_kib, int(line.split()[1]))
            except OSError:
                pass
        if self.name == "kernel":
            run(["umount", self.mnt])
            return
        run(["fusermount3", "-u", self.mnt])
        if self.name == "bindfs":
            run(["umount", self.lower])
            return
        self.proc.wait(timeout=600)
        err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
        if self.proc.returncode != 0:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {err}")
        self.proc = None

    def remount_cold(self):
        self.unmount()
        drop_caches()
        self.mount()


def fio(mnt, name, *args):
    run(["fio", "--name", name, "--directory", mnt, "--ioengine=psync", "--verify_state_save=0", "--minimal", *args], stdout=subprocess.DEVNULL)


def tarball(args):
    path = os.path.join(args.workdir, "include.tar")
    if not os.path.exists(path):
        run(["tar", "-C", "/usr", "-cf", path + ".tmp", "include", "share/doc"])
        os.rename(path + ".tmp", path)
    return path


# Each workload: (prepare(target) untimed on the fresh mount, body(target) timed).
def w_seqwrite():
    return None, lambda t: fio(t.mnt, "seq", "--rw=write", "--bs=1M", "--size=2G", "--end_fsync=1")


def w_seqread():
    def prep(t):
        fio(t.mnt, "seq", "--rw=write", "--bs=1M", "--size=2G", "--end_fsync=1")
        t.remount_cold()

    return prep, lambda t: fio(t.mnt, "seq", "--rw=read", "--bs=1M", "--size=2G")


def w_randwrite():
    def prep(t):
        fio(t.mnt, "rnd", "--rw=write", "--bs=1M", "--size=256M", "--end_fsync=1")

    return prep, lambda t: fio(t.mnt, "rnd", "--rw=randwrite", "--bs=4k", "--size=256M", "--io_size=64M", "--end_fsync=1", "--randrepeat=1")


def w_randread():
    def prep(t):
        fio(t.mnt, "rnd", "--rw=write", "--bs=1M", "--size=256M", "--end_fsync=1")
        t.remount_cold()

    return prep, lambda t: fio(t.mnt, "rnd", "--rw=randread", "--bs=4k", "--size=256M", "--io_size=64M", "--randrepeat=1")


def w_untar(args):
    tb = tarball(args)
    return None, lambda t: run(["tar", "-C", t.mnt, "-xf", tb])


def w_walk(args):
    tb = tarball(args)

    def prep(t):
        run(["tar", "-C", t.mnt, "-xf", tb])
        t.remount_cold()

    def body(t):
        subprocess.run(f"find {t.mnt} -type f | wc -l", shell=True, check=True, stdout=subprocess.DEVNULL)
        quiet(["du", "-s", t.mnt])

    return prep, body


def w_fsmark():
    def body(t):
        # fs_mark keeps a log in its working directory: give it the scratch one.
        cmd = ["fs_mark", "-d", os.path.join(t.mnt, "a"), "-d", os.path.join(t.mnt, "b"), "-n", "10000", "-s", "0", "-S", "0", "-L", "1"]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=t.dir)
        if out.returncode != 0 or "Files/sec" not in out.stdout:
            raise RuntimeError(f"fs_mark printed no result:\n{out.stdout}{out.stderr}")

    return None, body


def w_dbench(args):
    def body(t):
        out = subprocess.run(["dbench", "-D", t.mnt, "-t", str(args.dbench_secs), "4"], check=True, capture_output=True, text=True).stdout
        m = re.search(r"Throughput ([0-9.]+) MB/sec", out)
        if not m:
            raise RuntimeError(f"dbench printed no throughput:\n{out[-2000:]}")
        t.last_throughput = float(m.group(1))

    return None, body


def w_fsyncrand():
    def prep(t):
        fio(t.mnt, "fs", "--rw=write", "--bs=1M", "--size=64M", "--end_fsync=1")

    return prep, lambda t: fio(t.mnt, "fs", "--rw=randwrite", "--bs=4k", "--size=64M", "--io_size=8M", "--fsync=1", "--randrepeat=1")


def w_sqlite(mode):
    def db(t):
        return os.path.join(t.mnt, "bench.sqlite")

    def prep(t):
        c = sqlite3.connect(db(t), isolation_level=None)
        c.execute(f"PRAGMA journal_mode={mode}")
        c.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
        c.close()

    def body(t):
        c = sqlite3.connect(db(t), isolation_level=None)
        c.execute(f"PRAGMA journal_mode={mode}")
        c.execute("PRAGMA synchronous=FULL")
        for i in range(SQLITE_TXNS):
            c.execute("INSERT INTO t (v) VALUES (?)", (f"row {i} " + "x" * 100,))
        c.close()

    return prep, body


def w_dbenchsync(args):
    def body(t):
        out = subprocess.run(["dbench", "-s", "-D", t.mnt, "-t", str(args.dbench_secs), "4"], check=True, capture_output=True, text=True).stdout
        m = re.search(r"Throughput ([0-9.]+) MB/sec", out)
        if not m:
            raise RuntimeError(f"dbench printed no throughput:\n{out[-2000:]}")
        t.last_throughput = float(m.group(1))

    return None, body


def w_cpa():
    return None, lambda t: run(["cp", "-a", "/usr/include", os.path.join(t.mnt, "include")])


def w_rmrf(args):
    tb = tarball(args)

    # The tarball's top-level directories (see tarball()).
    def tops(t):
        return [os.path.join(t.mnt, "include"), os.path.join(t.mnt, "share")]

    def prep(t):
        run(["tar", "-C", t.mnt, "-xf", tb])
        if not all(os.path.isdir(d) for d in tops(t)):
            raise RuntimeError(f"rmrf: {tb} did not extract to {tops(t)}")
        t.remount_cold()

    return prep, lambda t: run(["rm", "-rf", *tops(t)])


def w_gitclone():
    if not os.path.isdir(os.path.join(REPO, ".git")):
        raise RuntimeError(f"gitclone: {REPO} is not a git checkout")

    def body(t):
        dst = os.path.join(t.mnt, "clone")
        # safe.directory: the checkout may belong to another user than root.
        quiet(["git", "-c", f"safe.directory={REPO}", "clone", "--no-hardlinks", "--quiet", REPO, dst])
        quiet(["git", "-C", dst, "log", "-p"])

    return None, body


CBUILD_FILES = 200
CBUILD_FUNCS = 4


def cbuild_sources():
    """{name: text} of the cbuild tree: gen.h, u000.c .. u199.c (u000.c has main) and a
    Makefile; the same every time."""
    n, k = CBUILD_FILES, CBUILD_FUNCS
    h = ["/* generated by xtask/fuse_bench.py */", "#ifndef GEN_H", "#define GEN_H", "",
         "struct acc { long sum; unsigned mix; int calls; };", "",
         "#define MIX(x, s) (((x) << (s)) ^ ((x) >> (32 - (s))) ^ 0x9e3779b9u)", ""]
    h += [f"long f_{i:03}_{j}(struct acc *a, int x);" for i in range(n) for j in range(k)]
    h += ["", "#endif", ""]
    files = {"gen.h": "\n".join(h)}
    for i in range(n):
        src = ["/* generated by xtask/fuse_bench.py */", "#include <string.h>", '#include "gen.h"', "",
               f'static const char tag_{i:03}[] = "unit {i:03}";', ""]
        for j in range(k):
            callee = f"f_{i - 1:03}_{(i * 7 + j) % k}(a, x - 1)" if i > 0 else "0"
            src += [f"long f_{i:03}_{j}(struct acc *a, int x)", "{",
                    "    long r = 0;",
                    f"    for (int n = 0; n < x % {3 + (i * 5 + j) % 13}; n++) {{",
                    f"        a->mix = MIX(a->mix + (unsigned)n, {1 + (i + j) % 31});",
                    f"        r += (long)(a->mix % {97 + i + j}u) * {j + 1};",
                    "    }",
                    "    a->calls++;",
                    f"    a->sum += r + (long)strlen(tag_{i:03});",
                    f"    return x > 0 ? r + {callee} : r;",
                    "}", ""]
        if i == 0:
            src += ["#include <stdio.h>", "", "int main(void)", "{",
                    "    struct acc a = { 0, 1, 0 };", "    long r = 0;"]
            src += [f"    r += f_{m:03}_{m % k}(&a, {m % 9});" for m in range(n - 1, -1, -1)]
            src += ['    printf("%ld %ld %d\\n", r, a.sum, a.calls);', "    return 0;", "}", ""]
        files[f"u{i:03}.c"] = "\n".join(src)
    objs = " ".join(f"u{i:03}.o" for i in range(n))
    files["Makefile"] = (f"CC = gcc\nCFLAGS = -O2 -Wall\nOBJS = {objs}\n\n"
                         "prog: $(OBJS)\n\t$(CC) -o $@ $(OBJS)\n\n"
                         "%.o: %.c gen.h\n\t$(CC) $(CFLAGS) -c -o $@ $<\n")
    return files


def w_cbuild():
    def dir_(t):
        return os.path.join(t.mnt, "cbuild")

    def prep(t):
        os.makedirs(dir_(t))
        for name, text in cbuild_sources().items():
            with open(os.path.join(dir_(t), name), "w") as f:
                f.write(text)

    return prep, lambda t: run(["make", "-C", dir_(t), "-j2", "-s"], stdout=subprocess.DEVNULL)


SQLITE_TXNS = 2000
# Durability points per run of the fsync workloads (for the bytes written per point).
FSYNC_POINTS = {"fsyncrand": 2048, "sqlitewal": SQLITE_TXNS, "sqliterollback": SQLITE_TXNS}
THROUGHPUT = ("dbench", "dbenchsync")

WORKLOADS = ["seqwrite", "seqread", "randwrite", "randread", "untar", "walk", "fsmark", "dbench",
             "fsyncrand", "sqlitewal", "sqliterollback", "dbenchsync",
             "cpa", "rmrf", "gitclone", "cbuild"]
# Tools a workload needs beyond those every run needs.
WORKLOAD_TOOLS = {"cpa": ["cp"], "rmrf": ["tar", "rm"], "gitclone": ["git"], "cbuild": ["make", "gcc"]}


def workload(name, args):
    return {
        "seqwrite": w_seqwrite,
        "seqread": w_seqread,
        "randwrite": w_randwrite,
        "randread": w_randread,
        "untar": lambda: w_untar(args),
        "walk": lambda: w_walk(args),
        "fsmark": w_fsmark,
        "dbench": lambda: w_dbench(args),
        "fsyncrand": w_fsyncrand,
        "sqlitewal": lambda: w_sqlite("WAL"),
        "sqliterollback": lambda: w_sqlite("DELETE"),
        "dbenchsync": lambda: w_dbenchsync(args),
        "cpa": w_cpa,
        "rmrf": lambda: w_rmrf(args),
        "gitclone": w_gitclone,
        "cbuild": w_cbuild,
    }[name]()


def written_bytes(t):
    """Bytes the target has written so far: the loop device's for the kernel, the
    daemon's write(2) bytes for ubtrfs; None for the others."""
    try:
        if t.name == "kernel":
            out = subprocess.run(["losetup", "-j", t.img], capture_output=True, text=True).stdout
            dev = os.path.basename(out.split(":")[0])
            with open(f"/sys/block/{dev}/stat") as f:
                return int(f.read().split()[6]) * 512
        if t.ubtrfs and t.proc:
            with open(f"/proc/{t.proc.pid}/io") as f:
                for line in f:
                    if line.startswith("wchar:"):
                        return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_image(t, what):
    p = subprocess.run(["btrfs", "check", "--readonly", "--check-data-csum", t.img], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"btrfs check failed on the ubtrfs image after {what}:\n{p.stdout}{p.stderr}")


def one_run(t, name, args, checked):
    prep, body = workload(name, args)
    t.fresh()
    # The transport is chosen at mount time; keep the parameter until the daemon is gone.
    with fuse_uring(URING_VALUE.get(t.name)):
        t.mount()
        try:
            if prep:
                prep(t)
            drop_caches()
            w0 = written_bytes(t)
            start = time.monotonic()
            body(t)
            w1 = written_bytes(t)
            t.last_written = (w1 - w0) if w0 is not None and w1 is not None else None
            t.unmount()
            dt = time.monotonic() - start
        except BaseException:
            if is_mountpoint(t.mnt):
                subprocess.run(["umount", "-l", t.mnt])
            if t.name == "bindfs" and is_mountpoint(t.lower):
                subprocess.run(["umount", "-l", t.lower])
            raise
    if t.ubtrfs and not checked:
        check_image(t, name)
    return getattr(t, "last_throughput", None) if name in THROUGHPUT else dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--targets", default="kernel,ubtrfs,bindfs,fuse2fs")
    ap.add_argument("--workdir", default="/var/tmp/ufb")
    ap.add_argument("--binary", default=os.path.join(REPO, "target", "release", "ubtrfs"))
    ap.add_argument("--image-gib", type=int, default=4)
    ap.add_argument("--dbench-secs", type=int, default=20)
    ap.add_argument("--mount-opts", default="")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("fuse_bench: needs root (loop mounts, drop_caches)")
    names = [w for w in args.only.split(",") if w]
    for w in names:
        if w not in WORKLOADS:
            sys.exit(f"fuse_bench: unknown workload {w!r} (known: {', '.join(WORKLOADS)})")
    tnames = [t for t in args.targets.split(",") if t]
    for t in tnames:
        if t not in ("kernel", "bindfs", "fuse2fs") + UBTRFS_TARGETS:
            sys.exit(f"fuse_bench: unknown target {t!r} (known: kernel, {', '.join(UBTRFS_TARGETS)}, bindfs, fuse2fs)")
    if "ubtrfs-uring" in tnames and not os.path.exists(URING_PARAM):
        print(f"fuse_bench: skipping ubtrfs-uring: {URING_PARAM} does not exist (fuse module without io_uring support)", flush=True)
        tnames.remove("ubtrfs-uring")
    for tool in ["fio", "fs_mark", "dbench", "bindfs", "fuse2fs", "fusermount3", "mkfs.btrfs", "mkfs.ext4"]:
        if shutil.which(tool) is None and (tool not in ("bindfs", "fuse2fs") or tool in tnames):
            sys.exit(f"fuse_bench: {tool} is missing")
    for tool in sorted({tool for w in names for tool in WORKLOAD_TOOLS.get(w, [])}):
        if shutil.which(tool) is None:
            sys.exit(f"fuse_bench: {tool} is missing (for {', '.join(w for w in names if tool in WORKLOAD_TOOLS.get(w, []))})")
    os.makedirs(args.workdir, exist_ok=True)
    targets = [Target(n, args, args.workdir) for n in tnames]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, binary {args.binary}", flush=True)
    results = {}
    written = {}
    for w in names:
        checked = set()  # the ubtrfs targets whose image has been checked for this workload
        for r in range(args.runs):
            for t in targets:
                v = one_run(t, w, args, t.name in checked)
                if t.ubtrfs:
                    checked.add(t.name)
                results.setdefault((w, t.name), []).append(v)
                if w in FSYNC_POINTS and getattr(t, "last_written", None) is not None:
                    written.setdefault((w, t.name), []).append(t.last_written / FSYNC_POINTS[w])
                print(f"{w:10} run {r + 1} {t.name:12} {v:8.2f}{' MB/s' if w in THROUGHPUT else ' s'}", flush=True)
    print()
    print("| workload | " + " | ".join(f"{t} (median)" for t in tnames) + " | " + " | ".join(f"kernel/{t}" for t in tnames if t != "kernel") + " |")
    print("|---|" + "---:|" * (2 * len(tnames) - 1))
    for w in names:
        med = {t: statistics.median(results[(w, t)]) for t in tnames}
        unit = " MB/s" if w in THROUGHPUT else " s"
        cells = [f"{med[t]:.2f}{unit}" for t in tnames]
        ratios = []
        for t in tnames:
            if t == "kernel" or "kernel" not in med:
                continue
            ratios.append(f"{(med[t] / med['kernel']) if w in THROUGHPUT else (med['kernel'] / med[t]):.2f}")
        print(f"| {w} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    if written:
        print("\n| bytes written per fsync/transaction (median) | " + " | ".join(t for t in tnames if any(k[1] == t for k in written)) + " |")
        wt = [t for t in tnames if any(k[1] == t for k in written)]
        print("|---|" + "---:|" * len(wt))
        for w in names:
            if w in FSYNC_POINTS:
                print(f"| {w} | " + " | ".join(f"{statistics.median(written[(w, t)]) / 1024:.1f} KiB" if (w, t) in written else "-" for t in wt) + " |")
    for t in targets:
        if t.ubtrfs:
            print(f"\n{t.name} daemon peak RSS over all runs: {t.peak_rss_kib / 1024:.1f} MiB")
    print("\nruns:", {f"{w}/{t}": [round(x, 2) for x in v] for (w, t), v in results.items()})


if __name__ == "__main__":
    main()
