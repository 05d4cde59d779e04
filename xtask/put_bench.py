#!/usr/bin/env python3
"""Put a large tree into a fresh image: `ubtrfs put -r` vs the kernel's `cp -a`.

The source is 180 directories of 1000 files (sizes log-uniform up to 60 KiB, 5% empty,
seeded, about 1 GB of data), generated once under WORKDIR/src. Each run makes a fresh
4 GiB `mkfs.btrfs` image in WORKDIR. ubtrfs side: `ubtrfs put -r IMG SRC /src` (one
commit), timed, with its peak RSS from /usr/bin/time. Kernel side: `mount -o loop`,
`cp -a SRC MNT/src`, `sync -f`, timed; the umount is not. Runs alternate. After the
first ubtrfs run the image passes `btrfs check --readonly --check-data-csum`.

Usage (root): python3 xtask/put_bench.py [--runs 3] [--workdir /var/tmp/putbench]
              [--binary target/release/ubtrfs]
"""
import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time


def gen_tree(src):
    if os.path.isdir(src):
        return
    rng = random.Random(7)
    pool = rng.randbytes(1 << 20) + bytes(range(256)) * 4096
    tmp = src + ".tmp"
    subprocess.run(["rm", "-rf", tmp], check=True)
    for d in range(180):
        dd = os.path.join(tmp, "d%03d" % d)
        os.makedirs(dd)
        for f in range(1000):
            size = int(2 ** rng.uniform(0, 15.9)) if rng.random() > 0.05 else 0
            off = rng.randrange(0, len(pool) - size - 1)
            with open(os.path.join(dd, "f%04d" % f), "wb") as fh:
                fh.write(pool[off:off + size])
    os.rename(tmp, src)


def fresh_image(path):
    if os.path.exists(path):
        os.remove(path)
    with open(path, "wb") as f:
        f.truncate(4 << 30)
    subprocess.run(["mkfs.btrfs", "-q", path], check=True, stdout=subprocess.DEVNULL)


def run_ubtrfs(binary, img, src):
    fresh_image(img)
    t = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-f", "%M", binary, "put", "-r", img, src, "/src"], check=True, capture_output=True, text=True)
    dt = time.monotonic() - t
    rss_kib = int(p.stderr.strip().splitlines()[-1])
    return dt, rss_kib


def run_kernel(img, src, mnt):
    fresh_image(img)
    subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
    try:
        t = time.monotonic()
        subprocess.run(["cp", "-a", src, os.path.join(mnt, "src")], check=True)
        subprocess.run(["sync", "-f", mnt], check=True)
        return time.monotonic() - t
    finally:
        subprocess.run(["umount", mnt], check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", default="/var/tmp/putbench")
    ap.add_argument("--binary", default="target/release/ubtrfs")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("put_bench: needs root (kernel loop mounts)")
    os.makedirs(a.workdir, exist_ok=True)
    src = os.path.join(a.workdir, "src")
    gen_tree(src)
    img = os.path.join(a.workdir, "img")
    mnt = tempfile.mkdtemp(prefix="putbench-mnt-")
    ut, rss, kt = [], [], []
    try:
        for i in range(a.runs):
            dt, r = run_ubtrfs(a.binary, img, src)
            ut.append(dt)
            rss.append(r)
            if i == 0:
                c = subprocess.run(["btrfs", "check", "--readonly", "--check-data-csum", img], capture_output=True, text=True)
                if c.returncode != 0:
                    sys.exit("put_bench: btrfs check failed after put:\n" + c.stdout + c.stderr)
            kt.append(run_kernel(img, src, mnt))
            print("run %d: ubtrfs %.2f s (peak RSS %.1f MiB), kernel %.2f s" % (i + 1, ut[-1], rss[-1] / 1024, kt[-1]), flush=True)
    finally:
        os.rmdir(mnt)
    um, km = statistics.median(ut), statistics.median(kt)
    print("median: ubtrfs put -r %.2f s, kernel cp -a + sync %.2f s, ratio kernel/ubtrfs %.2f; peak RSS max %.1f MiB" % (um, km, km / um, max(rss) / 1024))


if __name__ == "__main__":
    main()
