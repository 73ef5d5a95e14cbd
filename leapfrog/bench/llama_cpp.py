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
import time
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


def llama_bench(exe: str, gguf: Path, new_tokens: int, threads: int, repetitions: int, depth: int = 0) -> dict:
    """Single-request decode speed: `llama-bench -p 0 -n N` (no prompt, N generated tokens; with
    `depth`, `-d depth`: after that many cached positions), with its own repetitions, in a clean
    environment."""
    r = _llama_bench(exe, gguf, ["-p", "0", "-n", str(new_tokens), "-t", str(threads), "-r", str(repetitions)],
                     ["-d", str(depth)] if depth else [])
    return {"decode_tokens_per_s": r.pop("tokens_per_s"), **r}


def llama_bench_prompt(exe: str, gguf: Path, prompt_tokens: int, threads: int, repetitions: int) -> dict:
    """Prompt processing speed: `llama-bench -p N -n 0` (a prompt of N tokens, nothing generated)."""
    r = _llama_bench(exe, gguf, ["-p", str(prompt_tokens), "-n", "0", "-t", str(threads), "-r", str(repetitions)])
    return {"prompt_tokens_per_s": r.pop("tokens_per_s"), **r}


def _llama_bench(exe: str, gguf: Path, args: list[str], tail: list[str] | None = None) -> dict:
    env, dropped = peer_env()
    cmd = [exe, "-m", str(gguf), *args, "-o", "json", *(tail or [])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    row = json.loads(out)[0]
    return {"tokens_per_s": float(row["avg_ts"]), "stddev_tokens_per_s": float(row.get("stddev_ts", 0.0)),
            "command": " ".join(cmd), "env_dropped": dropped}


def llama_server_decode(exe: str, gguf: Path, prompts: list[list[int]], new_tokens: int, threads: int,
                        spec_args: list[str] | None = None, timeout: float = 120.0) -> dict:
    """llama-server (in a clean environment, on a free port, `spec_args` such as `--spec-type
    ngram-simple` for its own speculative decoding) decoding `prompts` (token ids) one at a time,
    greedy, up to `new_tokens` each: output tokens over the wall-clock of the requests (prompt
    included, as leapfrog's rows), its own decode-only rate, and its drafts' counts."""
    # deferred: the HTTP client modules load only when llama-server is measured
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env, dropped = peer_env()
    cmd = [exe, "-m", str(gguf), "-t", str(threads), "-np", "1", "-c", "8192", "--port", str(port),
           "--host", "127.0.0.1", *(spec_args or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base = f"http://127.0.0.1:{port}"

    def post(body: dict) -> dict:
        req = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    try:
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"llama-server did not start: {' '.join(cmd)}") from None
                time.sleep(0.5)
        body = {"n_predict": new_tokens, "temperature": 0.0, "cache_prompt": False}
        post({**body, "prompt": prompts[0], "n_predict": 8})               # warm-up
        tokens = wall = decode_ms = drafted = accepted = 0.0
        for p in prompts:
            t0 = time.perf_counter()
            out = post({**body, "prompt": p})
            wall += time.perf_counter() - t0
            t = out.get("timings", {})
            tokens += t.get("predicted_n", 0)
            decode_ms += t.get("predicted_ms", 0.0)
            drafted += t.get("draft_n", 0)
            accepted += t.get("draft_n_accepted", 0)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"tokens_per_s": tokens / wall, "decode_tokens_per_s": tokens / (decode_ms / 1e3) if decode_ms else None,
            "output_tokens": tokens, "draft_n": drafted, "draft_n_accepted": accepted,
            "command": " ".join(cmd), "env_dropped": dropped}
