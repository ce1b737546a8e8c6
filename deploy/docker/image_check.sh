#!/bin/sh
# `make image-check`: build the image from nothing and run neuroshard inside it.
#
# 1. A Debian 12 base with mmdebstrap (build.sh base), then the image from it (build.sh image):
#    no container registry is needed, only Debian's and PyPI's.
# 2. In a container of the image (buildah run --isolation chroot, the image's own user):
#    `neuroshard --help`; `neuroshard demo --json` (3 workers, the digits MLP) with a test
#    accuracy of at least MIN_ACCURACY; `neuroshard up --workers 2` in the background and a
#    small memory job (configs/jobs/memory-zipf.yaml with 10,000 memories, 3 iterations)
#    submitted to it, then the cluster stopped with SIGTERM.
# 3. The image's size, and the time of each phase: installing the tools, base, image, checks.
# The container is removed whatever happens; the images stay. Needs mmdebstrap, podman and
# buildah (podman run is not used: some sandboxes refuse the rlimits it sets), installed with
# apt-get when missing and run as root (else the exact command is printed, exit 1). Exit code 0
# when every check passed.
# DRY_RUN=1: only say what would be installed.
#
# Environment: IMAGE (default neuroshard:dev), BASE_IMAGE (default
# localhost/neuroshard-base:bookworm), MIN_ACCURACY (default 0.95); build.sh's ENGINE,
# CA_BUNDLE and FIND_LINKS_DIR apply to the build.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
image=${IMAGE:-neuroshard:dev}
base=${BASE_IMAGE:-localhost/neuroshard-base:bookworm}
min_accuracy=${MIN_ACCURACY:-0.95}

say() {
    echo "image-check: $*"
}

# buildah, and mmdebstrap + podman for the base: installed when missing and run as root,
# else build.sh prints the exact command and this stops (exit 1).
t0=$(date +%s)
"$here/build.sh" deps check
[ "${DRY_RUN:-0}" != 1 ] || exit 0
t1=$(date +%s)
"$here/build.sh" base "$base"
t2=$(date +%s)
ENGINE=buildah "$here/build.sh" image "$image" "BASE_IMAGE=$base"
t3=$(date +%s)
say "tools ready in $((t1 - t0)) s, base image $base built in $((t2 - t1)) s," \
    "image $image in $((t3 - t2)) s"

ctr=$(buildah from --pull=never "$image")
trap 'buildah rm "$ctr" >/dev/null' EXIT

in_image() {
    buildah run --isolation chroot "$ctr" -- "$@"
}

# Every step runs as the image's user (USER in the Dockerfile), not root.
uid=$(in_image id -u)
[ "$uid" != 0 ] || {
    echo "image-check: the image runs as root" >&2
    exit 1
}
say "runs as uid $uid"

in_image neuroshard --help >/dev/null
say "neuroshard --help: ok"

demo=$(in_image neuroshard demo --json)
accuracy=$(printf '%s\n' "$demo" | tail -n 1 | in_image python -c \
    'import json, sys; d = json.load(sys.stdin); assert d["state"] == "SUCCEEDED", d; print(d["result"]["test_accuracy"])')
if ! in_image python -c "import sys; sys.exit(not $accuracy >= $min_accuracy)"; then
    echo "image-check: demo test accuracy $accuracy < $min_accuracy" >&2
    exit 1
fi
say "neuroshard demo: SUCCEEDED, test accuracy $accuracy (>= $min_accuracy)"

# up runs in the foreground: start it in the background of one shell, wait for the address it
# prints when every worker is alive, submit the job, stop the cluster with SIGTERM.
# shellcheck disable=SC2016 # expanded by the shell in the container
memory=$(in_image sh -c '
    set -eu
    sed -e "s/^workers: .*/workers: 2/" -e "s/^memories: .*/memories: 10000/" \
        -e "s/^iterations: .*/iterations: 3/" /etc/neuroshard/jobs/memory-zipf.yaml \
        > /tmp/memory-small.yaml
    neuroshard up --workers 2 --port 0 >/tmp/up.out 2>/tmp/up.err &
    up=$!
    i=0
    until [ -s /tmp/up.out ]; do
        i=$((i + 1))
        if [ "$i" -gt 120 ] || ! kill -0 "$up" 2>/dev/null; then
            cat /tmp/up.err >&2
            kill "$up" 2>/dev/null || true
            exit 1
        fi
        sleep 1
    done
    status=0
    neuroshard submit --coordinator "$(head -n 1 /tmp/up.out)" --follow --json \
        /tmp/memory-small.yaml || status=$?
    kill -TERM "$up"
    wait "$up" || status=$?
    exit "$status"
')
printf '%s\n' "$memory" | tail -n 1 | in_image python -c '
import json, sys
d = json.load(sys.stdin)
assert d["state"] == "SUCCEEDED", d
print("image-check: neuroshard up --workers 2 + memory job (10000 memories, 3 iterations):",
      d["state"], json.dumps(d["result"])[:300])'

size=$(podman image inspect --format '{{.Size}}' "$image")
t4=$(date +%s)
say "image $image: $((size / 1000000)) MB"
say "all checks passed in $((t4 - t0)) s (tools $((t1 - t0)) s, base $((t2 - t1)) s," \
    "image $((t3 - t2)) s, checks $((t4 - t3)) s)"
