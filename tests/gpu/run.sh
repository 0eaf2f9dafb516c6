#!/usr/bin/env bash
# The GPU tier, from the repository root on a machine with a CUDA device:
#   bash tests/gpu/run.sh
# Needs torch with CUDA already installed (this script never installs torch), and no vLLM.
# Installs wsd (editable, no dependencies) and only those of its runtime and test
# dependencies that are missing, then runs tests/gpu and the CUDA tests of
# tests/integration/test_manager_reconfig.py. The log, nvidia-smi and the torch version go to $OUT
# (default /tmp). Bounded: pytest is stopped after 7 minutes, each test after its timeout.
set -euo pipefail

OUT="${OUT:-/tmp}"
PYTHON="${PYTHON:-$(command -v python || command -v python3 || echo python)}"
mkdir -p "$OUT"

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>"$OUT/torch-check.log"; then
    echo "run.sh: torch with CUDA is not importable by $PYTHON (no torch, a CPU-only build, or no visible device):" >&2
    cat "$OUT/torch-check.log" >&2
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' >&2 || true
    exit 1
fi

nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed (exit $?)" >>"$OUT/nvidia-smi.txt"
"$PYTHON" -c 'import torch; print(torch.__version__, torch.version.cuda)' | tee "$OUT/torch-version.txt"

# pyproject.toml: [project] dependencies and the [test] extra (torch aside), as "requirement import-name".
missing=()
while read -r requirement module; do
    "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$requirement")
done <<'EOF'
pyzmq>=25 zmq
msgpack>=1.0 msgpack
prometheus-client>=0.17 prometheus_client
numpy>=1.24 numpy
pytest>=8 pytest
pytest-timeout>=2.2 pytest_timeout
hypothesis>=6.100 hypothesis
EOF
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || "$PYTHON" -c 'import tomli' 2>/dev/null \
    || missing+=("tomli>=2")
if ((${#missing[@]})); then
    echo "run.sh: installing ${missing[*]}"
    "$PYTHON" -m pip install -q --retries 1 --timeout 20 "${missing[@]}"
fi
# --no-build-isolation: the build backend (setuptools) from this environment, nothing downloaded.
if ! "$PYTHON" -m pip install -q -e . --no-deps --no-build-isolation; then
    echo "run.sh: pip install -e . failed; running from the source tree (PYTHONPATH) instead" >&2
    export PYTHONPATH="$PWD:$PWD/clients${PYTHONPATH:+:$PYTHONPATH}"
fi

status=0
timeout 420 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu tests/integration/test_manager_reconfig.py -k "cuda or capture" \
    2>&1 | tee "$OUT/gpu-tier.log" || status=$?
echo "run.sh: pytest exited $status; log in $OUT/gpu-tier.log"
exit "$status"
