#!/usr/bin/env bash
# The GPU tier, from the repository root on a machine with a CUDA device:
#   bash tests/gpu/run.sh
# Needs torch with CUDA already installed (this script never installs torch), and no vLLM.
# Installs wsd (editable, no dependencies) and only those of its runtime and test
# dependencies that are missing, from tests/gpu/wheels only (tests/gpu/install.sh; no
# network), then runs tests/gpu and the CUDA tests of
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

# What is missing besides torch, from the wheels that travel with the checkout (tests/gpu/wheels,
# made by tests/gpu/wheels.sh where a registry is reachable): this machine reaches none.
installed=0
PYTHON="$PYTHON" bash tests/gpu/install.sh || installed=$?
case $installed in
    0) ;;
    3) echo "run.sh: running wsd from the source tree (PYTHONPATH)"
       export PYTHONPATH="$PWD:$PWD/clients${PYTHONPATH:+:$PYTHONPATH}" ;;
    *) exit 1 ;;
esac

status=0
timeout 420 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu tests/integration/test_manager_reconfig.py -k "cuda or capture" \
    2>&1 | tee "$OUT/gpu-tier.log" || status=$?
echo "run.sh: pytest exited $status; log in $OUT/gpu-tier.log"
exit "$status"
