"""llama.cpp as a peer: converting a checkpoint to GGUF with its own converter, and running its
llama-bench in a clean environment.

llama.cpp's CPU backend uses OpenMP. leapfrog sets its own OpenMP wait (GOMP_SPINCOUNT, see
leapfrog/__init__.py), and a user may have set others; a child process that inherits
OMP_WAIT_POLICY=PASSIVE sleeps at every OpenMP barrier and runs many times slower. Every peer
therefore starts from `peer_env()`: this process's environment without OpenMP, MKL and leapfrog
variables. The variables removed are recorded with the results.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from leapfrog.bench.common import log

# prefixes of variables a peer must not inherit: OpenMP (GNU, LLVM/Intel), MKL, leapfrog's own
DROPPED_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "LEAPFROG_")


def peer_env() -> tuple[dict[str, str], list[str]]:
    """A clean environment for a peer process, and the names of the variables left out."""
    dropped = sorted(k for k in os.environ if k.startswith(DROPPED_PREFIXES))
    return {k: v for k, v in os.environ.items() if k not in dropped}, dropped


def find_binary(name: str, cpp_dir: str | None) -> str | None:
    cands = [os.environ.get(name.upper().replace("-", "_")), shutil.which(name)]
    if cpp_dir:
        cands += [str(Path(cpp_dir) / "build" / "bin" / name), str(Path(cpp_dir) / "bin" / name)]
    return next((c for c in cands if c and Path(c).is_file()), None)


def make_gguf(folder: Path, cpp_dir: str | None, out: Path, outtype: str) -> Path | None:
    """The checkpoint converted by llama.cpp's own converter (same weights), cached by name."""
    if not cpp_dir or not (Path(cpp_dir) / "convert_hf_to_gguf.py").is_file():
        return None
    out.mkdir(parents=True, exist_ok=True)
    gguf = out / f"{folder.name}-{outtype}.gguf"
    if gguf.is_file() and gguf.stat().st_mtime >= max(f.stat().st_mtime for f in folder.iterdir()):
        return gguf
    env = {**peer_env()[0], "PYTHONPATH": str(Path(cpp_dir) / "gguf-py")}
    proc = subprocess.run([sys.executable, str(Path(cpp_dir) / "convert_hf_to_gguf.py"), str(folder),
                           "--outfile", str(gguf), "--outtype", outtype], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        log(f"llama.cpp's converter refused {folder} ({outtype}): {tail}")
        return None
    return gguf


def llama_bench(exe: str, gguf: Path, new_tokens: int, threads: int, repetitions: int) -> dict:
    """Single-request decode speed: `llama-bench -p 0 -n N` (no prompt, N generated tokens),
    with its own repetitions, in a clean environment."""
    env, dropped = peer_env()
    cmd = [exe, "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-t", str(threads),
           "-r", str(repetitions), "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    row = json.loads(out)[0]
    return {"decode_tokens_per_s": float(row["avg_ts"]), "stddev_tokens_per_s": float(row.get("stddev_ts", 0.0)),
            "command": " ".join(cmd), "env_dropped": dropped}
