#!/usr/bin/env bash
# Creates .venv and installs leapfrog into it. Chooses the PyTorch build first, so that
# pip never resolves an unpinned `torch` to a multi-GB CUDA build on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install "torch==2.13.0"                      # CUDA build from PyPI
  else
    # CPU build: from the local wheel cache when present, else from PyTorch's CPU index.
    $PIP install "torch==2.13.0+cpu" 2>/dev/null \
      || $PIP install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
$PIP install -q -e ".[dev]"
# Build the optional CPU attention kernel now (about a minute), not on the first request.
"$VENV/bin/python" -c "from leapfrog.layers.cpu_kernels import cpu_kernels as m; m()" || true
