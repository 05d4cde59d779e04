#!/usr/bin/env bash
# Run fstests (xfstests) on the ubtrfs FUSE mount, and on the kernel's btrfs over loop
# devices for comparison, then check both images with btrfs check and summarise.
#
#   xtask/fstests.sh [OPTIONS] [CHECK ARGS...]        (root; default CHECK ARGS: -g generic/quick)
#   xtask/fstests.sh --compare KERNEL.txt UBTRFS.txt  (the tests one passes and the other does not)
#
# Options:
#   --fstests DIR    a built fstests tree (default $FSTESTS_DIR or /work/xfstests)
#   --bin PATH       the ubtrfs binary (default target/release/ubtrfs of this repository);
#                    copied into the work dir first, so a rebuild during a run changes nothing
#   --kernel         also run on the kernel's btrfs (first, as the baseline)
#   --kernel-only    run on the kernel's btrfs only
#   --name NAME      name of the ubtrfs run (default ubtrfs); the kernel run is "kernel"
#   --results DIR    where results go (default $FSTESTS_RESULTS or /work/fstests-results)
#   --work DIR       where the images and mount points go (default /var/tmp/ubtrfs-fstests)
#   --size SIZE      size of each image (default 2G; the images are sparse)
#   --timeout SECS   a test whose run (with check's own checks after it) shows no progress
#                    for this long is killed and counted as a hang, which is a failure
#                    (default 300)
#   --keep-images    keep the images after the run (they are removed otherwise)
#
# Each run writes RESULTS/NAME.txt (one line a test: name, status, reason; status is
# pass, fail, hang or notrun) and RESULTS/NAME/ (check's output check.out, its results/
# directory with the .out.bad, .full, .notrun and .dmesg files, local.config, the btrfs
# check output btrfs-check.txt and summary.txt, which is also printed).
#
# How fstests sees ubtrfs: FSTYP=fuse with FUSE_SUBTYP=.ubtrfs, so fstests mounts with
# `mount -t fuse.ubtrfs IMAGE DIR` (through the mount.fuse.ubtrfs helper that
# `ubtrfs install-helper` links in /sbin; the links are put back as they were at the end)
# with -o allow_other, as root, and TEST_DEV and SCRATCH_DEV are the image files. fstests
# cannot make a new FUSE filesystem: its _scratch_mkfs for fuse empties the scratch
# mount instead, so both images are made once by `ubtrfs mkfs`, and tests that need
# mkfs options or sizes are "not run". fstests compares the type df shows with FSTYP;
# df shows a FUSE mount with a subtype as fuse.ubtrfs, so check runs with a df in front
# of PATH that shows it as fuse, as fstests' own _fs_type does for fuse.glusterfs.
#
# fstests has no per-test timeout: a watchdog here follows check's output, and when a
# test makes none for --timeout seconds it kills the test's processes, then (if check is
# still stuck, in an unmount for instance) the ubtrfs processes of the run, then check
# itself, which is restarted on the tests left.
#
# Each run happens in a private mount namespace: other programs that make mount
# namespaces (unshare, containers) would otherwise copy our mounts and keep the FUSE
# mounts alive after fstests unmounts them, and our namespace would keep theirs; the
# copies of FUSE and loop-device mounts this namespace starts with are detached at once.
set -uo pipefail

self=$(readlink -f "$0")
repo=$(cd "$(dirname "$self")/.." && pwd)

fstests=${FSTESTS_DIR:-/work/xfstests}
results=${FSTESTS_RESULTS:-/work/fstests-results}
work=/var/tmp/ubtrfs-fstests
bin=$repo/target/release/ubtrfs
name=ubtrfs
size=2G
timeout_secs=300
keep_images=0
do_kernel=0
do_ubtrfs=1
check_args=()
all_args=("$@")

die() {
    echo "fstests.sh: $*" >&2
    exit 1
}

usage() {
    sed -n '2,/^set -uo/p' "$self" | sed -e '/^set -uo/d' -e 's/^# \{0,1\}//'
    exit "${1:-0}"
}

# Tests that pass in run A and not in run B (status files as this script writes them):
# the failures one by one, the notruns by reason.
compare_one() {
    local a=$1 b=$2
    echo "pass in $(basename "$a" .txt), fail or hang in $(basename "$b" .txt):"
    awk 'NR == FNR { if ($2 == "pass") ok[$1] = 1; next }
         ($1 in ok) && ($2 == "fail" || $2 == "hang") { printf "  %s\n", substr($0, 1, 200); n++ }
         END { printf "  (%d tests)\n", n }' "$a" "$b"
    echo "pass in $(basename "$a" .txt), notrun in $(basename "$b" .txt), by reason:"
    awk 'NR == FNR { if ($2 == "pass") ok[$1] = 1; next }
         ($1 in ok) && $2 == "notrun" { t = $1; $1 = ""; $2 = ""; sub(/^ +/, ""); n[$0]++; l[$0] = l[$0] " " t }
         END { for (r in n) printf "  %4d  %s:%s\n", n[r], r, l[r] }' "$a" "$b" | sort -rn | cut -c1-240
}

compare() {
    [ -f "$1" ] || die "no such status file: $1"
    [ -f "$2" ] || die "no such status file: $2"
    compare_one "$1" "$2"
    compare_one "$2" "$1"
}

while [ $# -gt 0 ]; do
    case $1 in
    --fstests) fstests=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --kernel) do_kernel=1; shift ;;
    --kernel-only) do_kernel=1; do_ubtrfs=0; shift ;;
    --name) name=$2; shift 2 ;;
    --results) results=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --size) size=$2; shift 2 ;;
    --timeout) timeout_secs=$2; shift 2 ;;
    --keep-images) keep_images=1; shift ;;
    --compare) [ $# -ge 3 ] || usage 1; compare "$2" "$3"; exit 0 ;;
    -h | --help) usage 0 ;;
    --) shift; check_args+=("$@"); break ;;
    *) check_args+=("$1"); shift ;;
    esac
done
[ ${#check_args[@]} -gt 0 ] || check_args=(-g generic/quick)
[[ $timeout_secs =~ ^[0-9]+$ ]] || die "--timeout takes seconds, not $timeout_secs"
[[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "--name takes letters, digits, . _ -, not $name"
[ "$name" != kernel ] || die "--name kernel is the kernel run's name"

# What is missing, said once, before anything is touched.
missing=()
[ "$(id -u)" = 0 ] || missing+=("root (fstests mounts, makes loop devices and switches users)")
if [ ! -x "$fstests/check" ]; then
    missing+=("fstests at $fstests (git clone https://git.kernel.org/pub/scm/fs/xfs/xfstests-dev.git $fstests, or github.com/kdave/xfstests; or --fstests DIR)")
elif [ ! -x "$fstests/ltp/fsstress" ] || [ ! -x "$fstests/src/xfsctl" ]; then
    missing+=("a built fstests: make -j2 -C $fstests (build dependencies as its README lists: autoconf automake libtool xfslibs-dev uuid-dev libattr1-dev libacl1-dev libaio-dev libgdbm-dev liburing-dev libcap-dev, and xfsprogs acl attr bc fio psmisc quota)")
fi
for u in fsgqa fsgqa2 123456-fsgqa; do
    id "$u" >/dev/null 2>&1 || missing+=("the user $u (useradd -m fsgqa; useradd fsgqa2; useradd 123456-fsgqa), which fstests' README asks for")
done
for p in unshare setsid losetup findmnt timeout mkfs.btrfs btrfs xfs_io; do
    command -v "$p" >/dev/null 2>&1 || missing+=("the program $p")
done
if [ $do_ubtrfs = 1 ]; then
    [ -x "$bin" ] || missing+=("the ubtrfs binary $bin (cargo build --release -p ubtrfs, or --bin PATH)")
    [ -e /dev/fuse ] || missing+=("/dev/fuse")
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "fstests.sh: cannot run; missing:" >&2
    printf '  - %s\n' "${missing[@]}" >&2
    exit 2
fi

# Into a private mount namespace (see the top of this file).
if [ -z "${UBTRFS_FSTESTS_NS:-}" ]; then
    export UBTRFS_FSTESTS_NS=1
    exec unshare --mount --propagation private -- "$self" "${all_args[@]}"
fi
# Deepest first; -i: a copy of another process's FUSE mount is dropped here, not unmounted
# through its helper (which would wait for a daemon that keeps serving elsewhere).
awk '$0 ~ / - fuse/ || $0 ~ / - [a-z0-9]+ \/dev\/loop/ { print $5 }' /proc/self/mountinfo | tac |
    while read -r m; do
        umount -l -i "$(printf '%b' "$m")" 2>/dev/null || true
    done

mkdir -p "$results" "$work" || die "cannot make $results and $work"
results=$(readlink -f "$results")
work=$(readlink -f "$work")
real_df=$(command -v df)

# State of the run in progress, for the cleanup on exit.
cur_mode=
cur_label=
cur_test_dev=
cur_scratch_dev=
cur_test_dir=
cur_scratch_mnt=
check_pid=
helpers_saved=0
declare -A helper_was=()

# The processes of this run's ubtrfs copy: mount helpers, daemons, unmount helpers.
ubtrfs_pids() {
    local p exe
    for p in /proc/[0-9]*; do
        exe=$(readlink "$p/exe" 2>/dev/null) || continue
        [ "$exe" = "$work/ubtrfs" ] && echo "${p#/proc/}"
    done
}

kill_ubtrfs() {
    local pids
    pids=$(ubtrfs_pids)
    [ -n "$pids" ] || return 0
    echo "fstests.sh: killing the run's ubtrfs processes: $pids" | tr '\n' ' ' >&2
    echo >&2
    # shellcheck disable=SC2086  # one pid a word
    kill -KILL $pids 2>/dev/null
    sleep 1
}

# A process and all its descendants, the descendants first.
descendants() {
    local c
    for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        descendants "$c"
    done
    echo "$1"
}

kill_tree() {
    local pids
    pids=$(descendants "$1")
    # shellcheck disable=SC2086  # one pid a word
    kill -KILL $pids 2>/dev/null
}

# The pid of the shell running the test script FSTESTS/tests/$1, in check's session $2.
test_pid() {
    local p
    for p in $(ps -o pid= -s "$2" 2>/dev/null); do
        tr '\0' '\n' <"/proc/$p/cmdline" 2>/dev/null | grep -qxF "$fstests/tests/$1" && echo "$p"
    done
}

unmount_run() {
    local m
    for m in "$cur_test_dir" "$cur_scratch_mnt"; do
        [ -n "$m" ] || continue
        findmnt -rn --mountpoint "$m" >/dev/null 2>&1 || continue
        timeout 120 umount "$m" 2>/dev/null && continue
        echo "fstests.sh: $m does not unmount; detaching it" >&2
        [ "$cur_mode" = ubtrfs ] && kill_ubtrfs
        umount -l -i "$m" 2>/dev/null
    done
    # The daemons exit after their last commit; wait for that before the image is read.
    if [ "$cur_mode" = ubtrfs ]; then
        local i
        for i in $(seq 60); do
            [ -z "$(ubtrfs_pids)" ] && break
            [ "$i" = 60 ] && kill_ubtrfs
            sleep 1
        done
    fi
}

detach_loops() {
    local d
    for d in "$cur_test_dev" "$cur_scratch_dev"; do
        case $d in /dev/loop*) losetup -d "$d" 2>/dev/null ;; esac
    done
}

restore_helpers() {
    [ $helpers_saved = 1 ] || return 0
    local h
    for h in mount.fuse.ubtrfs umount.fuse.ubtrfs; do
        rm -f "/sbin/$h"
        [ -n "${helper_was[$h]}" ] && ln -s "${helper_was[$h]}" "/sbin/$h"
    done
    helpers_saved=0
    rm -f "$work/ubtrfs"
}

cleanup() {
    if [ -n "$check_pid" ] && kill -0 "$check_pid" 2>/dev/null; then
        kill -TERM -- "-$check_pid" 2>/dev/null
        sleep 2
        kill -KILL -- "-$check_pid" 2>/dev/null
    fi
    unmount_run
    detach_loops
    restore_helpers
}
trap cleanup EXIT
trap 'exit 130' INT TERM

install_helpers() {
    cp -f "$bin" "$work/ubtrfs" || die "cannot copy $bin to $work"
    if [ $helpers_saved = 0 ]; then
        local h
        for h in mount.fuse.ubtrfs umount.fuse.ubtrfs; do
            helper_was[$h]=
            [ -L "/sbin/$h" ] && helper_was[$h]=$(readlink "/sbin/$h")
            [ -e "/sbin/$h" ] && [ ! -L "/sbin/$h" ] && die "/sbin/$h is not a link; not replacing it"
        done
        helpers_saved=1
    fi
    "$work/ubtrfs" install-helper >/dev/null || die "ubtrfs install-helper failed"
}

# The test names `check ARGS` would run, from its -n (show only) mode.
list_tests() {
    local dir=$1 cfg=$2 shim=$3
    shift 3
    (cd "$fstests" && HOST_OPTIONS=$cfg RESULT_BASE=$dir/results PATH=$shim:$PATH \
        ./check -n "$@") >"$dir/check-n.out" 2>&1 </dev/null
    awk '$1 ~ /^[a-z0-9]+\/[0-9]+$/ && $0 !~ /expunged/ { print $1 }' "$dir/check-n.out"
}

# Status of each test from check's output: TEST STATUS REASON lines into $2. Tests the
# watchdog killed ($3, one name a line) are hangs.
parse_status() {
    local out=$1 status=$2 hangs=$3 resdir=$4
    local t rest reason first
    : >"$status"
    while IFS= read -r line || [ -n "$line" ]; do
        [[ $line =~ ^([a-z0-9]+/[0-9]+)[[:space:]]*(.*)$ ]] || continue
        t=${BASH_REMATCH[1]}
        rest=${BASH_REMATCH[2]}
        if grep -qx "$t" "$hangs" 2>/dev/null; then
            echo "$t hang no progress for ${timeout_secs}s: killed by the watchdog" >>"$status"
        elif [[ $rest =~ ^([0-9]+s\ \.\.\.\ *)?[0-9]+s$ ]]; then
            echo "$t pass" >>"$status"
        elif [[ $rest =~ \[not\ run\]\ *(.*)$ ]]; then
            echo "$t notrun ${BASH_REMATCH[1]}" >>"$status"
        elif [[ $rest =~ \[expunged\] ]]; then
            echo "$t expunged" >>"$status"
        elif [ -z "$rest" ]; then
            # check died in it, not stopped by the watchdog: the test's doing (it
            # killed check, or the machine's OOM killer did); not run again
            echo "$t fail check itself died while running it (see check.out)" >>"$status"
        else
            reason=$rest
            if [ -f "$resdir/$t.out.bad" ]; then
                first=$(diff "$fstests/tests/$t.out" "$resdir/$t.out.bad" 2>/dev/null |
                    grep -m1 '^[<>]' | cut -c1-160)
                [ -n "$first" ] && reason="output mismatch: $first"
            elif [ -f "$resdir/$t.dmesg" ]; then
                first=$(grep -m1 -E 'WARNING|BUG|Oops|INFO:' "$resdir/$t.dmesg" | cut -c1-160)
                reason="dmesg: ${first:-see $t.dmesg}"
            fi
            echo "$t fail $reason" >>"$status"
        fi
    done <"$out"
    # One line a test: the last run of a test counts (check restarted after a hang).
    tac "$status" | awk '!seen[$1]++' | sort -o "$status"
}

# check on the remaining tests, under the watchdog, until all have a status.
run_check() {
    local dir=$1 cfg=$2 shim=$3
    shift 3
    local out=$dir/check.out hangs=$dir/hangs.txt status=$dir/status.tmp
    local -a todo=("$@")
    local restarts=0 before after
    : >"$hangs"
    while [ ${#todo[@]} -gt 0 ]; do
        # After a line left open by a check that was stopped in a test.
        printf '\n== %s check on %d tests\n' "$(date '+%F %T')" ${#todo[@]} >>"$out"
        (cd "$fstests" && HOST_OPTIONS=$cfg RESULT_BASE=$dir/results PATH=$shim:$PATH \
            exec setsid ./check "${todo[@]}") >>"$out" 2>&1 </dev/null &
        check_pid=$!
        watchdog "$out" "$hangs"
        { wait "$check_pid"; } 2>/dev/null
        check_pid=
        before=${#todo[@]}
        parse_status "$out" "$status" "$hangs" "$dir/results"
        local -a left=()
        local t
        for t in "${todo[@]}"; do
            grep -q "^$t " "$status" || left+=("$t")
        done
        todo=("${left[@]}")
        after=${#todo[@]}
        [ "$after" -gt 0 ] || break
        unmount_run
        if [ "$after" = "$before" ]; then
            echo "fstests.sh: check ran none of the tests; stopping (see $out)" >&2
            tail -5 "$out" >&2
            break
        fi
        restarts=$((restarts + 1))
        [ $restarts -le 20 ] || { echo "fstests.sh: check stopped 20 times; giving up" >&2; break; }
        echo "fstests.sh: check stopped with ${#todo[@]} tests to go; restarting it" >&2
    done
    for t in "${todo[@]}"; do
        echo "$t fail check never ran it (it stopped; see check.out)" >>"$status"
    done
    sort -o "$status" "$status"
}

# Follow check's output; when it stalls for timeout_secs, kill the current test, then the
# run's ubtrfs processes, then check.
watchdog() {
    local out=$1 hangs=$2
    local size last=-1 since=$SECONDS stage=0 stage_at=0 cur pid
    while kill -0 "$check_pid" 2>/dev/null; do
        sleep 5
        size=$(stat -c %s "$out" 2>/dev/null || echo 0)
        if [ "$size" != "$last" ]; then
            last=$size
            since=$SECONDS
            stage=0
            continue
        fi
        cur=$(tail -c 512 "$out" | tail -n 1 | awk '$1 ~ /^[a-z0-9]+\/[0-9]+$/ { print $1 }')
        case $stage in
        0)
            [ $((SECONDS - since)) -ge "$timeout_secs" ] || continue
            echo "fstests.sh: $(date '+%T') ${cur:-check} made no progress for ${timeout_secs}s; killing it" >&2
            if [ -n "$cur" ]; then
                echo "$cur" >>"$hangs"
                for pid in $(test_pid "$cur" "$check_pid"); do
                    kill_tree "$pid"
                done
            fi
            stage=1
            stage_at=$SECONDS
            ;;
        1)
            [ $((SECONDS - stage_at)) -ge 30 ] || continue
            if [ "$cur_mode" = ubtrfs ]; then
                kill_ubtrfs
            fi
            stage=2
            stage_at=$SECONDS
            ;;
        2)
            [ $((SECONDS - stage_at)) -ge 60 ] || continue
            echo "fstests.sh: check itself is stuck; stopping it" >&2
            kill -TERM -- "-$check_pid" 2>/dev/null
            sleep 5
            kill -KILL -- "-$check_pid" 2>/dev/null
            [ "$cur_mode" = ubtrfs ] && kill_ubtrfs
            stage=3
            ;;
        esac
    done
}

summarise() {
    local dir=$1 status=$2 secs=$3
    local f n_pass n_fail n_hang n_notrun n_all
    n_all=$(wc -l <"$status")
    n_pass=$(awk '$2 == "pass"' "$status" | wc -l)
    n_fail=$(awk '$2 == "fail"' "$status" | wc -l)
    n_hang=$(awk '$2 == "hang"' "$status" | wc -l)
    n_notrun=$(awk '$2 == "notrun"' "$status" | wc -l)
    echo "== $cur_label: $n_all tests in $((secs / 60))m$((secs % 60))s: $n_pass pass, $((n_fail + n_hang)) fail ($n_hang of them hangs), $n_notrun notrun"
    echo
    if [ $((n_fail + n_hang)) -gt 0 ]; then
        echo "failures:"
        while read -r t s reason; do
            echo "  $t $s: $reason"
            f=$dir/results/$t.out.bad
            if [ -f "$f" ]; then
                diff -u "$fstests/tests/$t.out" "$f" 2>/dev/null | sed -n '3,10p' | sed 's/^/      /'
            fi
        done < <(awk '$2 == "fail" || $2 == "hang"' "$status")
        echo
    fi
    if [ "$n_notrun" -gt 0 ]; then
        echo "notrun, by reason (count, reason, tests):"
        awk '$2 == "notrun" { t = $1; $1 = ""; $2 = ""; sub(/^ +/, ""); n[$0]++; l[$0] = l[$0] " " t }
             END { for (r in n) printf "  %4d  %s:%s\n", n[r], r, l[r] }' "$status" |
            sort -rn | cut -c1-240
        echo
    fi
    echo "btrfs check --readonly --check-data-csum after the run:"
    sed 's/^/  /' "$dir/btrfs-check.summary"
}

# One whole run: mode is ubtrfs or kernel.
run_mode() {
    local mode=$1 label=$2
    local dir=$results/$label
    local test_img=$work/$label-test.img scratch_img=$work/$label-scratch.img
    local started=$SECONDS
    cur_mode=$mode
    cur_label=$label
    cur_test_dir=$work/$label-test
    cur_scratch_mnt=$work/$label-scratch
    rm -rf "$dir"
    mkdir -p "$dir/results" "$cur_test_dir" "$cur_scratch_mnt" "$dir/bin" || die "cannot make $dir"
    rm -f "$test_img" "$scratch_img"
    local cfg=$dir/local.config shim=$dir/bin
    if [ "$mode" = ubtrfs ]; then
        install_helpers
        "$work/ubtrfs" mkfs -q --size "$size" "$test_img" || die "ubtrfs mkfs $test_img failed"
        "$work/ubtrfs" mkfs -q --size "$size" "$scratch_img" || die "ubtrfs mkfs $scratch_img failed"
        cur_test_dev=$test_img
        cur_scratch_dev=$scratch_img
        # shellcheck disable=SC2016  # "$@" and PIPESTATUS belong to the shim
        printf '#!/bin/bash\n%s "$@" | sed -E %q\nexit "${PIPESTATUS[0]}"\n' "$real_df" \
            's/(^|[[:space:]])fuse\.ubtrfs([[:space:]])/\1fuse\2/' >"$shim/df"
        chmod +x "$shim/df"
        cat >"$cfg" <<EOF
export FSTYP=fuse
export FUSE_SUBTYP=.ubtrfs
export TEST_DEV=$test_img
export TEST_DIR=$cur_test_dir
export SCRATCH_DEV=$scratch_img
export SCRATCH_MNT=$cur_scratch_mnt
export TEST_FS_MOUNT_OPTS="-o allow_other"
export MOUNT_OPTIONS="-o allow_other"
EOF
        {
            echo "ubtrfs: $bin ($("$work/ubtrfs" --version), sha256 $(sha256sum <"$work/ubtrfs" | cut -c1-16))"
            git -C "$(dirname "$bin")" log -1 --format='repository HEAD %H %s' 2>/dev/null
        } >"$dir/version.txt"
    else
        truncate -s "$size" "$test_img" "$scratch_img" || die "cannot make the images"
        mkfs.btrfs -q -f "$test_img" >/dev/null || die "mkfs.btrfs $test_img failed"
        cur_test_dev=$(losetup -f --show "$test_img") || die "losetup $test_img failed"
        cur_scratch_dev=$(losetup -f --show "$scratch_img") || die "losetup $scratch_img failed"
        cat >"$cfg" <<EOF
export FSTYP=btrfs
export TEST_DEV=$cur_test_dev
export TEST_DIR=$cur_test_dir
export SCRATCH_DEV=$cur_scratch_dev
export SCRATCH_MNT=$cur_scratch_mnt
EOF
        echo "kernel: $(uname -r), $(mkfs.btrfs --version | head -1)" >"$dir/version.txt"
    fi

    local -a tests
    mapfile -t tests < <(list_tests "$dir" "$cfg" "$shim" "${check_args[@]}")
    if [ ${#tests[@]} = 0 ]; then
        echo "fstests.sh: check -n ${check_args[*]} lists no tests:" >&2
        tail -5 "$dir/check-n.out" >&2
        return 1
    fi
    echo "fstests.sh: $label: ${#tests[@]} tests (check ${check_args[*]}), results in $dir" >&2

    run_check "$dir" "$cfg" "$shim" "${tests[@]}"
    unmount_run
    detach_loops
    cur_test_dev=
    cur_scratch_dev=

    # The images as the run left them, read-only: an error is the run's finding.
    : >"$dir/btrfs-check.txt"
    : >"$dir/btrfs-check.summary"
    local img rc
    for img in "$test_img" "$scratch_img"; do
        {
            echo "== btrfs check --readonly --check-data-csum $img"
            btrfs check --readonly --check-data-csum "$img" 2>&1
            echo "== exit status $?"
        } >>"$dir/btrfs-check.txt"
        rc=$(tail -1 "$dir/btrfs-check.txt" | awk '{ print $NF }')
        if [ "$rc" = 0 ]; then
            echo "$(basename "$img"): clean" >>"$dir/btrfs-check.summary"
        elif [ "$mode" = kernel ] && [ "$img" = "$scratch_img" ] &&
            grep -q 'No valid Btrfs found' "$dir/btrfs-check.txt"; then
            # check runs wipefs on a block-device scratch before every test
            echo "$(basename "$img"): no filesystem (check wipes the scratch device before each test)" >>"$dir/btrfs-check.summary"
        else
            echo "$(basename "$img"): ERRORS (exit $rc; see $dir/btrfs-check.txt)" >>"$dir/btrfs-check.summary"
        fi
    done
    [ $keep_images = 1 ] || rm -f "$test_img" "$scratch_img"
    rmdir "$cur_test_dir" "$cur_scratch_mnt" 2>/dev/null
    cur_test_dir=
    cur_scratch_mnt=

    cp "$dir/status.tmp" "$results/$label.txt"
    rm -f "$dir/status.tmp"
    summarise "$dir" "$results/$label.txt" $((SECONDS - started)) | tee "$dir/summary.txt"
    [ "$mode" = ubtrfs ] && restore_helpers
    cur_mode=
}

if [ $do_kernel = 1 ]; then
    run_mode kernel kernel
fi
if [ $do_ubtrfs = 1 ]; then
    run_mode ubtrfs "$name"
    if [ -f "$results/kernel.txt" ]; then
        echo
        compare "$results/kernel.txt" "$results/$name.txt" | tee "$results/$name/compare-kernel.txt"
    fi
fi
