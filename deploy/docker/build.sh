#!/bin/sh
# Build the neuroshard image, or a Debian 12 base image to build it from, with the container
# engine this machine has (`make image`, `make image-base`).
#
#   build.sh image TAG [BUILD_ARG=VALUE ...]   deploy/docker/Dockerfile -> TAG
#   build.sh base TAG                          mmdebstrap Debian 12 + python3 -> TAG
#   build.sh deps image|base|check             only install what that target needs
#
# Engine (ENGINE=auto|docker|buildah): docker when its daemon answers, else buildah (podman's
# image store is buildah's). buildah builds with --isolation chroot, which needs no daemon and
# no user namespaces. `base` needs mmdebstrap, podman and buildah; `check` (image_check.sh)
# those and buildah. What is missing is installed with apt-get when this runs as root; else
# the exact command is printed and the script exits 1. DRY_RUN=1: print what would be
# installed (or the command to run) and change nothing.
#
# A TLS-inspecting proxy (a company network): buildah builds get the host's CA bundle and, if
# pip is configured with one, its find-links directory as read-only mounts
# (/run/neuroshard-build/ca.crt, /run/neuroshard-build/find-links), which the Dockerfile's
# pip steps use. Both are found here, never written in the repository:
#   CA bundle:  $CA_BUNDLE, else pip's cert ($PIP_CERT, `pip config get global.cert`), else
#               /etc/ssl/certs/ca-certificates.crt, else `python3 -m certifi`
#   find-links: $FIND_LINKS_DIR, else the first local directory of $PIP_FIND_LINKS or
#               `pip config get global.find-links`
# `docker build` has no host mounts: docker builds use the daemon's own network settings.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mounts=/run/neuroshard-build

die() {
    echo "build.sh: $*" >&2
    exit 1
}

pip_config() {
    python3 -m pip config get "$1" 2>/dev/null || true
}

host_ca_bundle() {
    for f in "${CA_BUNDLE:-}" "${PIP_CERT:-}" "$(pip_config global.cert)" \
        /etc/ssl/certs/ca-certificates.crt "$(python3 -m certifi 2>/dev/null || true)"; do
        if [ -n "$f" ] && [ -s "$f" ]; then
            echo "$f"
            return
        fi
    done
}

host_find_links() {
    if [ -n "${FIND_LINKS_DIR:-}" ]; then
        echo "$FIND_LINKS_DIR"
        return
    fi
    for d in ${PIP_FIND_LINKS:-} $(pip_config global.find-links); do
        d=${d#file://}
        if [ -d "$d" ]; then
            echo "$d"
            return
        fi
    done
}

# The engine `build.sh image` uses (installing buildah when it is the one and is missing).
engine() {
    case "${ENGINE:-auto}" in
        docker)
            command -v docker >/dev/null 2>&1 || die "ENGINE=docker: docker not found"
            echo docker
            ;;
        buildah)
            apt_install_missing buildah podman
            echo buildah
            ;;
        auto)
            if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
                echo docker
            else
                apt_install_missing buildah podman
                echo buildah
            fi
            ;;
        *) die "ENGINE must be auto, docker or buildah, not ${ENGINE}" ;;
    esac
}

# Install the Debian packages of the commands among "$@" that are missing (each command is
# its package's name): with apt-get as root; otherwise, or under DRY_RUN=1, print the exact
# command (and exit 1 unless DRY_RUN=1). Messages go to stderr (stdout carries `engine`).
apt_install_missing() {
    missing=""
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
    done
    [ -n "$missing" ] || return 0
    cmd="apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q$missing"
    if [ "${DRY_RUN:-0}" = 1 ]; then
        if [ "$(id -u)" = 0 ]; then
            echo "build.sh: missing$missing; would run: $cmd" >&2
        else
            echo "build.sh: missing$missing; would stop and ask for: sudo sh -c '$cmd'" >&2
        fi
        return 0
    fi
    command -v apt-get >/dev/null 2>&1 || die "missing$missing, and no apt-get to install" \
        "them: install those packages with this system's package manager"
    [ "$(id -u)" = 0 ] || die "missing$missing; install them as root: sudo sh -c '$cmd'"
    echo "build.sh: installing$missing with apt-get" >&2
    apt-get update -q >&2
    # shellcheck disable=SC2086 # one word per package
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $missing >&2
}

# What each target needs (`build.sh deps TARGET`, the Makefile's first step of each).
install_deps() {
    case "$1" in
        image) engine >/dev/null ;;
        base) apt_install_missing mmdebstrap podman buildah ;;
        check) apt_install_missing mmdebstrap podman buildah ;;
        *) die "deps: unknown target $1 (image, base or check)" ;;
    esac
}

build_base() {
    tag=$1
    apt_install_missing mmdebstrap podman buildah
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    # minbase: dpkg, apt and the Essential set (useradd included); Python 3.11 from Debian.
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$tmp/base.tar"
    podman import "$tmp/base.tar" "$tag"
}

build_image() {
    tag=$1
    shift
    args=""
    for kv in "$@"; do
        args="$args --build-arg $kv"
    done
    eng=$(engine) # an assignment: a failure in engine stops the script (set -e)
    case "$eng" in
        docker)
            # shellcheck disable=SC2086 # build args are KEY=VALUE words without spaces
            docker build -f "$root/deploy/docker/Dockerfile" -t "$tag" $args "$root"
            ;;
        buildah)
            ca=$(host_ca_bundle)
            links=$(host_find_links)
            vols=""
            [ -n "$ca" ] && vols="$vols --volume $ca:$mounts/ca.crt:ro"
            [ -n "$links" ] && vols="$vols --volume $links:$mounts/find-links:ro"
            echo "build.sh: buildah, CA bundle ${ca:-none}, find-links ${links:-none}" >&2
            # shellcheck disable=SC2086 # volumes and build args are words without spaces
            buildah build --isolation chroot --layers --force-rm -f "$root/deploy/docker/Dockerfile" \
                -t "$tag" $vols $args "$root"
            ;;
    esac
}

[ $# -ge 2 ] || die "usage: build.sh image TAG [BUILD_ARG=VALUE ...] | build.sh base TAG" \
    "| build.sh deps image|base|check"
what=$1
shift
case "$what" in
    image) build_image "$@" ;;
    base) build_base "$@" ;;
    deps) install_deps "$1" ;;
    *) die "unknown target $what (image, base or deps)" ;;
esac
