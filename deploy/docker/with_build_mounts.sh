#!/bin/sh
# with-build-mounts CMD...: run CMD (a pip install of the image build) with the build host's
# CA bundle and pip find-links directory when the build mounts them (deploy/docker/Dockerfile).
# Without the mounts, CMD runs with pip's own configuration.
set -eu
mounts=/run/neuroshard-build
if [ -s "$mounts/ca.crt" ]; then
    export PIP_CERT="$mounts/ca.crt"
fi
if [ -d "$mounts/find-links" ]; then
    export PIP_FIND_LINKS="$mounts/find-links"
fi
exec "$@"
