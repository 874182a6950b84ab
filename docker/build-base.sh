#!/usr/bin/env bash
# Builds a local base image (default tag hypic-base:bookworm): Debian bookworm with Python 3.11,
# venv and pip, made with debootstrap from a Debian mirror. For machines that reach a Debian
# mirror but no image registry; build the gateway on it with
#     docker build --build-arg BASE_IMAGE=hypic-base:bookworm -f docker/Dockerfile .
# (docker/smoke.sh does). Needs root, debootstrap and a running Docker daemon.
#
#   docker/build-base.sh [TAG]        # skips the build when TAG exists; HYPIC_BASE_REBUILD=1 rebuilds
#
# DEBIAN_MIRROR: the mirror (default: the first Debian one in this machine's apt sources, else
# debootstrap's own default). CA certificates added to this machine (/usr/local/share/ca-certificates/*.crt,
# e.g. a company proxy's) are added to the image too, so that pip in the image trusts the same
# servers; HYPIC_BASE_EXTRA_CA=0 leaves them out.
set -euo pipefail

TAG="${1:-hypic-base:bookworm}"
SUITE=bookworm
PACKAGES=python3,python3-venv,python3-pip,ca-certificates

if [ "${HYPIC_BASE_REBUILD:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "build-base: $TAG exists (HYPIC_BASE_REBUILD=1 rebuilds it)" >&2
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "build-base: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "build-base: debootstrap missing (apt-get install debootstrap)" >&2; exit 1; }

mirror_from_apt() {
    # deb822 sources ("URIs: http://.../debian") first, then one-line ones ("deb http://.../debian bookworm main").
    local uri
    uri="$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}' \
           | grep -E '/debian/?$' | head -n1 || true)"
    if [ -z "$uri" ]; then
        uri="$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
               | awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) {print $i; break}}' \
               | grep -E '/debian/?$' | head -n1 || true)"
    fi
    echo "$uri"
}
MIRROR="${DEBIAN_MIRROR:-$(mirror_from_apt)}"

ROOTFS="$(mktemp -d /tmp/hypic-base-rootfs.XXXXXX)"
cleanup() {
    # debootstrap interrupted may leave /proc or /sys mounted in the tree: unmount, and never delete across mounts.
    awk -v root="$ROOTFS/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l || true
    rm -rf --one-file-system "$ROOTFS"
}
trap cleanup EXIT
chmod 755 "$ROOTFS"   # it becomes the image's /, which every user must be able to enter (mktemp makes it 0700)

echo "build-base: debootstrap $SUITE from ${MIRROR:-the default mirror} into $ROOTFS" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" ${MIRROR:+"$MIRROR"} >&2

if [ "${HYPIC_BASE_EXTRA_CA:-1}" = 1 ] && compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    echo "build-base: adding this machine's extra CA certificates" >&2
    cp /usr/local/share/ca-certificates/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates >&2
fi
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/tmp/* "$ROOTFS"/var/log/*.log
chroot "$ROOTFS" python3 -c "import venv, ensurepip"

tar -C "$ROOTFS" --numeric-owner -c . | docker import \
    -c 'ENV LANG=C.UTF-8' \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["python3"]' \
    -m "debootstrap --variant=minbase $SUITE + $PACKAGES" - "$TAG" >/dev/null
echo "build-base: $TAG: $(docker run --rm --user 65534 "$TAG" python3 --version) (run as an unprivileged user)" >&2
