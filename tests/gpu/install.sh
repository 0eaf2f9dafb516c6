#!/usr/bin/env bash
# Installs, for $PYTHON, what tests/gpu/requirements.txt lists and $PYTHON cannot import yet,
# from tests/gpu/wheels/ only (--no-index: the GPU machine reaches no registry; nothing is
# fetched), then wsd itself (editable, no dependencies, no build isolation). Exit 1 naming
# what is missing when the wheels cannot provide it; 3 when only wsd's own install failed
# (the caller then runs it from the source tree).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-tests/gpu/wheels}

missing=()
while read -r line; do
    [[ -z $line || $line == \#* ]] && continue
    requirement=${line%%  # *}
    module=${line##*# }
    if [[ $requirement == *";"* ]]; then  # an environment marker (pip's own parser): only where it holds
        marker=${requirement#*;}
        requirement=${requirement%%;*}
        MARKER=$marker "$PYTHON" -c 'import os, sys; from pip._vendor.packaging.markers import Marker
sys.exit(not Marker(os.environ["MARKER"].strip()).evaluate())' || continue
    fi
    requirement=${requirement%% }
    "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$requirement")
done <tests/gpu/requirements.txt

if ((${#missing[@]})); then
    if [[ ! -d $WHEELS ]]; then
        echo "install.sh: $PYTHON lacks ${missing[*]}, and there are no wheels in $WHEELS: run" \
             "'bash tests/gpu/wheels.sh $("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')'" \
             "where a package registry is reachable, and carry $WHEELS" >&2
        exit 1
    fi
    echo "install.sh: installing ${missing[*]} from $WHEELS"
    if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$WHEELS" \
            -c .ci/constraints.txt "${missing[@]}"; then
        echo "install.sh: the wheels in $WHEELS do not provide ${missing[*]} for $PYTHON" >&2
        exit 1
    fi
fi
# wsd itself: editable, built with this Python's own setuptools (nothing fetched); without one,
# exit 3: the caller runs wsd from the source tree instead.
if "$PYTHON" -c 'import setuptools' 2>/dev/null && "$PYTHON" -m pip install --quiet --disable-pip-version-check \
        --no-index -e . --no-deps --no-build-isolation >/dev/null 2>&1; then
    echo "install.sh: wsd installed (editable)"
else
    echo "install.sh: wsd not installed ($PYTHON has no setuptools to build it, or the build failed)"
    exit 3
fi
