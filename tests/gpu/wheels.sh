#!/usr/bin/env bash
# Wheels for the GPU tier, fetched here for a GPU machine that reaches no package registry:
#   bash tests/gpu/wheels.sh [PYTHON_VERSION ...]     (default: 3.12, the GPU machine's)
# Downloads, for each CPython version, the wheels of tests/gpu/requirements.txt and their
# dependencies, at the versions .ci/constraints.txt pins, for Linux x86_64, into
# tests/gpu/wheels/ (ignored by git; the device tool carries it: carry=["tests/gpu/wheels"]).
# tests/gpu/install.sh installs from there with --no-index.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-python3}
DEST=tests/gpu/wheels
versions=("$@")
((${#versions[@]})) || versions=(3.12)
mkdir -p "$DEST"
for version in "${versions[@]}"; do
    [[ $version =~ ^3\.[0-9]+$ ]] || { echo "wheels.sh: a CPython version such as 3.12, got '$version'" >&2; exit 2; }
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
        --implementation cp --python-version "$version" \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64 \
        -c .ci/constraints.txt -r tests/gpu/requirements.txt -d "$DEST"
done
echo "wheels.sh: $(find "$DEST" -name '*.whl' | wc -l) wheels in $DEST ($(du -sh "$DEST" | cut -f1)) for CPython ${versions[*]}"
