#!/usr/bin/env python3
"""Dedupe of a tree with duplicate files: `ubtrfs dedupe IMAGE /` against duperemove
on a kernel btrfs mount of the same tree, both in one run.

The tree (made once under --workdir): --unique-mib of files with pseudo-random
contents (sizes from 4 KiB to 4 MiB, a fixed seed), and a second copy of every one
of them under another directory, so half the bytes are duplicates.

Each round, on fresh images of --image-gib:
  kernel  mkfs.btrfs, mount -o loop, cp -a the tree, sync, drop caches; timed:
          `duperemove -dr` of the mount (whole-file and extent matching, its
          defaults otherwise; hashes kept in memory), then sync.
  ubtrfs  mkfs.btrfs, `ubtrfs put -r` the tree, sync, drop caches; timed: `ubtrfs
          dedupe IMAGE /` (which commits).
Both start cold (nothing of the tree in the page cache).
Bytes saved: the data bytes used before minus after (`btrfs filesystem usage -b` on the
kernel's mount after a sync; `ubtrfs info` for ours). After each ubtrfs round the
image passes `btrfs check --readonly --check-data-csum` and a kernel mount reads every
file as the tree has it (compared by SHA-256).

Usage (root):  cargo build --release -p ubtrfs
               python3 xtask/dedupe_bench.py [--runs 3] [--unique-mib 1024]
Prints a table for docs/benchmarks.md.
"""

import argparse
import hashlib
import os
import random
import re
import shutil
import statistics
import subprocess
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def out(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def make_tree(root, unique_mib, seed=2):
    if os.path.exists(os.path.join(root, ".done")):
        return
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(seed)
    total, i = 0, 0
    for half in ("one", "two"):
        os.makedirs(os.path.join(root, half), exist_ok=True)
    while total < unique_mib << 20:
        size = min(int(rng.lognormvariate(12.5, 1.2)) // 4096 * 4096 + rng.randrange(4096), 4 << 20)
        size = max(size, 4096)
        data = rng.randbytes(size)
        sub = f"d{i % 37}"
        for half in ("one", "two"):
            d = os.path.join(root, half, sub)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"f{i}"), "wb") as f:
                f.write(data)
        total += size
        i += 1
    open(os.path.join(root, ".done"), "w").close()


def tree_hashes(root):
    h = {}
    for dp, _, fs in os.walk(root):
        for f in fs:
            if f == ".done":
                continue
            p = os.path.join(dp, f)
            with open(p, "rb") as fh:
                h[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return h


def fresh(img, gib):
    if os.path.exists(img):
        os.remove(img)
    with open(img, "wb") as f:
        f.truncate(gib << 30)
    run(["mkfs.btrfs", "-q", "-f", img], stdout=subprocess.DEVNULL)


def kernel_data_used(mnt):
    run(["sync"])
    t = out(["btrfs", "filesystem", "usage", "-b", mnt])
    m = re.search(r"Data,[^:]*: Size:\d+, Used:(\d+)", t)
    if not m:
        raise RuntimeError(f"no data usage in:\n{t}")
    return int(m.group(1))


def ubtrfs_data_used(binary, img):
    t = out([binary, "info", img])
    m = re.search(r"Data, [^:]*: total=[^,]*, used=([0-9.]+)(KiB|MiB|GiB|B)", t)
    if not m:
        raise RuntimeError(f"no data usage in:\n{t}")
    unit = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]
    return int(float(m.group(1)) * unit)


def drop_caches():
    """Both sides start cold: written, synced, and nothing of it in the page cache
    (`ubtrfs put` writes its data with O_DIRECT, `cp -a` onto the mount leaves it
    cached; without this the kernel's side would read from memory and ours from disk)."""
    run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def kernel_round(a, tree):
    img, mnt = os.path.join(a.workdir, "k.img"), os.path.join(a.workdir, "kmnt")
    os.makedirs(mnt, exist_ok=True)
    fresh(img, a.image_gib)
    run(["mount", "-o", "loop", img, mnt])
    try:
        run(["cp", "-a", os.path.join(tree, "one"), os.path.join(tree, "two"), mnt])
        before = kernel_data_used(mnt)
        drop_caches()
        t = time.monotonic()
        run(["duperemove", "-dr", "-q", mnt], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run(["sync"])
        secs = time.monotonic() - t
        after = kernel_data_used(mnt)
    finally:
        run(["umount", mnt])
    return secs, before - after


def ubtrfs_round(a, tree, want, verify):
    img = os.path.join(a.workdir, "u.img")
    fresh(img, a.image_gib)
    run([a.binary, "put", "-r", img, os.path.join(tree, "one"), os.path.join(tree, "two"), "/"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before = ubtrfs_data_used(a.binary, img)
    drop_caches()
    t = time.monotonic()
    run([a.binary, "dedupe", img, "/"], stdout=subprocess.DEVNULL)
    secs = time.monotonic() - t
    after = ubtrfs_data_used(a.binary, img)
    if verify:
        run(["btrfs", "check", "--readonly", "--check-data-csum", img], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        mnt = os.path.join(a.workdir, "umnt")
        os.makedirs(mnt, exist_ok=True)
        run(["mount", "-o", "loop,ro", img, mnt])
        try:
            got = tree_hashes(mnt)
        finally:
            run(["umount", mnt])
        if got != want:
            raise RuntimeError("the kernel reads the deduplicated image differently from the tree")
    return secs, before - after


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--unique-mib", type=int, default=1024)
    p.add_argument("--image-gib", type=int, default=4)
    p.add_argument("--workdir", default="/var/tmp/ubtrfs-dedupe-bench")
    p.add_argument("--binary", default=os.path.join(REPO, "target/release/ubtrfs"))
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    tree = os.path.join(a.workdir, "tree")
    make_tree(tree, a.unique_mib)
    want = tree_hashes(tree)
    res = {"kernel": [], "ubtrfs": []}
    for r in range(a.runs):
        for name in (["kernel", "ubtrfs"] if r % 2 == 0 else ["ubtrfs", "kernel"]):
            if name == "kernel":
                res[name].append(kernel_round(a, tree))
            else:
                res[name].append(ubtrfs_round(a, tree, want, verify=(r == 0)))
            secs, saved = res[name][-1]
            print(f"round {r}: {name}: {secs:.2f} s, {saved / 2**20:.1f} MiB saved", flush=True)
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(tree) for f in fs)
    print(f"\ntree: {len(want)} files, {total / 2**20:.0f} MiB, half of them copies; {a.runs} rounds, medians\n")
    print("| tool | time | data saved |")
    print("|:---|---:|---:|")
    med = {}
    for name, label in (("kernel", "duperemove -dr on the kernel's mount"), ("ubtrfs", "ubtrfs dedupe IMAGE /")):
        s = statistics.median(x[0] for x in res[name])
        b = statistics.median(x[1] for x in res[name])
        med[name] = (s, b)
        print(f"| {label} | {s:.2f} s | {b / 2**20:.1f} MiB |")
    print(f"\ntime ratio duperemove / ubtrfs: {med['kernel'][0] / med['ubtrfs'][0]:.2f}x; bytes saved ubtrfs / duperemove: {med['ubtrfs'][1] / max(med['kernel'][1], 1):.2f}")
    print(f"runs: {res}")


if __name__ == "__main__":
    main()
