#!/usr/bin/env python3
"""Snapshots of a 100k-file subvolume: snapshot creation and the first writes into
the snapshot (each COWs the shared leaves and nodes on its path), the kernel's btrfs
against `ubtrfs mount`, both in one run, through the same ioctls.

The base image (made once under --workdir with the kernel): mkfs.btrfs of
--image-gib, a subvolume `src` with --files files (0 to 2000 bytes of pseudo-random
contents, 1000 per directory), committed.

Each round, on fresh copies of the base image, for each side (order alternates):
  mount       kernel: mount -o loop; ubtrfs: `ubtrfs mount --daemon`
  snapshot    timed: BTRFS_IOC_SNAP_CREATE_V2 of src as snapN (--snapshots of them,
              one after another; the kernel commits each; so do we)
  first write timed: one 16-byte pwrite into --writes files of the newest snapshot
              (spread over every directory), then BTRFS_IOC_SYNC (a commit)
  unmount; then for ubtrfs `btrfs check --readonly --check-data-csum` and a kernel
  mount reading a sample of the written files back.
Prints the medians and ratios (kernel time / ubtrfs time: above 1 means ubtrfs is
faster) for docs/benchmarks.md.

Usage (root):  cargo build --release -p ubtrfs
               python3 xtask/snapshot_bench.py [--runs 5] [--files 100000]
"""

import argparse
import fcntl
import os
import random
import shutil
import statistics
import struct
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UBTRFS = os.path.join(REPO, "target", "release", "ubtrfs")

BTRFS_IOC_SNAP_CREATE_V2 = 0x50009417
BTRFS_IOC_SYNC = 0x9408


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def make_base(path, files, gib):
    done = path + ".done"
    if os.path.exists(done) and os.path.exists(path):
        return
    with open(path, "wb") as f:
        f.truncate(gib << 30)
    run(["mkfs.btrfs", "-q", "-f", path])
    mnt = path + ".mnt"
    os.makedirs(mnt, exist_ok=True)
    run(["mount", "-o", "loop", path, mnt])
    try:
        run(["btrfs", "subvolume", "create", os.path.join(mnt, "src")], stdout=subprocess.DEVNULL)
        rng = random.Random(5)
        for i in range(files):
            d = os.path.join(mnt, "src", f"d{i // 1000:03}")
            if i % 1000 == 0:
                os.mkdir(d)
            with open(os.path.join(d, f"f{i:06}"), "wb") as f:
                f.write(rng.randbytes(rng.randrange(2001)))
        run(["sync"])
    finally:
        run(["umount", mnt])
    open(done, "w").close()


def vol_args_v2(fd, name):
    a = bytearray(4096)
    struct.pack_into("<qQQ", a, 0, fd, 0, 0)
    a[56:56 + len(name)] = name
    return a


def snapshot(mnt, name):
    src = os.open(os.path.join(mnt, "src"), os.O_RDONLY | os.O_DIRECTORY)
    dst = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(dst, BTRFS_IOC_SNAP_CREATE_V2, vol_args_v2(src, name.encode()))
    finally:
        os.close(src)
        os.close(dst)


def fs_sync(mnt):
    fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.ioctl(fd, BTRFS_IOC_SYNC)
    finally:
        os.close(fd)


def targets(files, writes):
    step = max(files // writes, 1)
    return [(f"d{i // 1000:03}", f"f{i:06}") for i in range(0, files, step)][:writes]


def side(kind, img, mnt, a):
    os.makedirs(mnt, exist_ok=True)
    if kind == "kernel":
        run(["mount", "-o", "loop", img, mnt])
    else:
        run([UBTRFS, "mount", "--daemon", img, mnt])
    try:
        snaps = []
        for n in range(a.snapshots):
            t = time.perf_counter()
            snapshot(mnt, f"snap{n}")
            snaps.append(time.perf_counter() - t)
        newest = os.path.join(mnt, f"snap{a.snapshots - 1}")

        def writes(data):
            t = time.perf_counter()
            for d, f in targets(a.files, a.writes):
                fd = os.open(os.path.join(newest, d, f), os.O_WRONLY)
                os.pwrite(fd, data, 0)
                os.close(fd)
            fs_sync(mnt)
            return time.perf_counter() - t

        first = writes(b"first write here")
        # The same writes again: the paths are the snapshot's own now, nothing shared
        # is COWed; the difference is what sharing cost the first writes.
        again = writes(b"first write here")
    finally:
        for _ in range(100):
            if subprocess.run(["umount", mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
    if kind == "ubtrfs":
        # The daemon exits once the unmount's commit is done and the image released.
        for _ in range(600):
            if subprocess.run([UBTRFS, "info", img], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
    return statistics.median(snaps), first, again


def verify(img, mnt, a):
    run(["btrfs", "check", "--readonly", "--check-data-csum", img], capture_output=True)
    os.makedirs(mnt, exist_ok=True)
    run(["mount", "-o", "loop,ro", img, mnt])
    try:
        for d, f in targets(a.files, a.writes)[::97]:
            with open(os.path.join(mnt, f"snap{a.snapshots - 1}", d, f), "rb") as fh:
                assert fh.read(16) == b"first write here", f"{d}/{f}"
    finally:
        run(["umount", mnt])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--files", type=int, default=100_000)
    p.add_argument("--snapshots", type=int, default=5)
    p.add_argument("--writes", type=int, default=10_000)
    p.add_argument("--image-gib", type=int, default=4)
    p.add_argument("--workdir", default="/var/tmp/ubtrfs-bench/snapshot")
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    base = os.path.join(a.workdir, f"base-{a.files}.img")
    make_base(base, a.files, a.image_gib)
    res = {"kernel": [], "ubtrfs": []}
    for r in range(a.runs):
        order = ["kernel", "ubtrfs"] if r % 2 == 0 else ["ubtrfs", "kernel"]
        for kind in order:
            img = os.path.join(a.workdir, f"{kind}.img")
            run(["cp", "--sparse=always", base, img])
            run(["sync"])
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            snap, first, again = side(kind, img, os.path.join(a.workdir, f"{kind}.mnt"), a)
            if kind == "ubtrfs" and r == 0:
                verify(img, os.path.join(a.workdir, "verify.mnt"), a)
            res[kind].append((snap, first, again, first - again))
            print(f"round {r} {kind}: snapshot {snap * 1e3:.1f} ms (median of {a.snapshots}), {a.writes} writes + sync: first {first:.3f} s, again {again:.3f} s", flush=True)
    med = lambda kind, i: statistics.median(x[i] for x in res[kind])
    print()
    print(f"| {a.files} files, medians of {a.runs} rounds | kernel | ubtrfs mount | kernel / ubtrfs |")
    print("|---|---:|---:|---:|")
    k, u = med("kernel", 0), med("ubtrfs", 0)
    print(f"| snapshot creation (committed) | {k * 1e3:.1f} ms | {u * 1e3:.1f} ms | {k / u:.2f}x |")
    for i, what in ((1, "first writes into the snapshot + sync"), (2, "the same writes again + sync"), (3, "first-write COW cost (first - again)")):
        k, u = med("kernel", i), med("ubtrfs", i)
        print(f"| {a.writes} {what} | {k:.3f} s | {u:.3f} s | {k / u:.2f}x |")


if __name__ == "__main__":
    main()
