#!/usr/bin/env bash
# Build, with the kernel, snapshots of subvolumes that hold other subvolumes (the usual
# layout: / with /home as a subvolume, then a snapshot of /), so the snapshots carry
# entries of subvolumes they do not contain; the kernel shows those as empty
# placeholder directories. Needs root, mkfs.btrfs and the btrfs driver.
#
#   xtask/nested_snapshot.sh IMAGE [--delete]
#
# Subvolume ids: sv 256 (holds f, d/, inner), inner 257 (holds g), home 258, snap 259
# (a snapshot of the top: placeholders sv and home), svsnap 260 (a snapshot of sv:
# placeholder inner), snap-ro 261 (read-only snapshot of the top: placeholders sv,
# home, snap, svsnap). With --delete the kernel then deletes inner and sv and waits
# for its cleaner, so the placeholders of sv and inner outlive their subvolumes.
set -euo pipefail
img=$1
mnt=$(mktemp -d)
truncate -s 256M "$img"
mkfs.btrfs -q -f "$img" >/dev/null
mount -o loop "$img" "$mnt"
trap 'umount "$mnt"; rmdir "$mnt"' EXIT
btrfs subvolume create "$mnt/sv" >/dev/null
echo in-sv >"$mnt/sv/f"
mkdir "$mnt/sv/d"
btrfs subvolume create "$mnt/sv/inner" >/dev/null
echo in-inner >"$mnt/sv/inner/g"
btrfs subvolume create "$mnt/home" >/dev/null
echo top >"$mnt/topfile"
btrfs subvolume snapshot "$mnt" "$mnt/snap" >/dev/null
btrfs subvolume snapshot "$mnt/sv" "$mnt/svsnap" >/dev/null
btrfs subvolume snapshot -r "$mnt" "$mnt/snap-ro" >/dev/null
if [ "${2:-}" = --delete ]; then
    btrfs subvolume delete -c "$mnt/sv/inner" "$mnt/sv" >/dev/null
    btrfs subvolume sync "$mnt" >/dev/null
fi
