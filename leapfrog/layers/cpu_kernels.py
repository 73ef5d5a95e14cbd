"""Optional C++ kernels for CPU inference (paged decode attention, few-row matmul, RMSNorm), compiled on first use with torch's extension
builder (gcc) on an x86-64 CPU with AVX2 and FMA. Elsewhere, or when the build fails, the
portable torch paths (SDPA, float32 products) are in charge. Set LEAPFROG_CPU_KERNELS=0 to
disable them."""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

_module = None
_tried = False
# Instruction sets turned off on top of -march=native, by LEAPFROG_CPU_ISA.
ISA_FLAGS = {
    "native": [],
    "avx2": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"],

}


def cpu_inference(x: torch.Tensor, w: torch.Tensor) -> bool:
    """True when a float32 CPU op needs no autograd: the C++ kernels may run it."""
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


# A build takes about a minute; a lock older than this was left by a killed build, and torch
# would wait on it forever (the server would stay "loading").
STALE_LOCK_SECONDS = 600


def _clear_stale_lock(name: str) -> None:
    try:
        # deferred: cpp_extension (setuptools) loads only when the kernels are built
        from torch.utils.cpp_extension import _get_build_directory
        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
            print(f"[leapfrog] removing a stale build lock left by a killed build: {lock}", file=sys.stderr)
            lock.unlink()
    except (ImportError, OSError):
        pass


def _built_marker(name: str) -> Path:
    """Where the path of a finished build of `name` is recorded (the name carries the sources'
    and flags' hash, so a recorded build is of these sources)."""
    # deferred: checkpoint.build (safetensors) loads only when the kernels are looked up
    from leapfrog.checkpoint.build import cache_root
    return cache_root() / "kernels" / f"{name}.path"


def _import_built(name: str, marker: Path):
    """The module a previous process built, imported straight from its file: torch's extension
    builder (and the setuptools it imports) is not needed to load it. None
    when there is no record, or the file is gone or does not import (then it is built again)."""
    import importlib.util
    try:
        path = marker.read_text().strip()
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None or not Path(path).is_file():
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError):
        return None


def _remember_built(marker: Path, module) -> None:
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_name(marker.name + f".tmp{os.getpid()}")
        tmp.write_text(str(Path(module.__file__).resolve()))
        tmp.replace(marker)
    except (OSError, AttributeError, TypeError):
        pass


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where they cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration, IndexError):
        return None


def unsupported_cpu() -> str | None:
    """Why this CPU cannot run the kernels (their vector code is AVX2 with FMA), or None."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"they need an x86-64 CPU with AVX2 (this one is {machine or 'unknown'})"
    flags = _cpu_flags()
    missing = [f for f in ("avx2", "fma") if flags is not None and f not in flags]
    return f"they need AVX2 and FMA (this CPU lacks {' and '.join(missing)})" if missing else None


def cpu_kernels():
    """The compiled module, or None when unavailable (no compiler, disabled, a CPU without
    AVX2, build error)."""
    global _module, _tried
    if _tried:
        return _module
    _tried = True
    if os.environ.get("LEAPFROG_CPU_KERNELS", "1") == "0":
        return None
    why = unsupported_cpu()
    if why is not None:       # not built at all: the build would fail, a minute at every start
        print(f"[leapfrog] CPU kernels unavailable, using the torch paths: {why}", file=sys.stderr)
        return None
    try:
        csrc = Path(__file__).resolve().parent.parent / "csrc"
        sources = [csrc / "cpu_kernels.cpp", csrc / "decode_loop.cpp"]
        # -march=native: the build runs on the machine that uses it, so the vector width is
        # chosen there (AVX2 + FMA kernels, AVX-512, VNNI and AMX where present). No contraction:
        # the compiler never fuses a multiply-add in one caller and not in another, so the
        # decode loop and the layer kernels compute the same bits (csrc/cpu_math.h).
        cflags = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
        # LEAPFROG_CPU_ISA=avx2 builds the AVX2 paths on a wider CPU (tests,
        # and measuring what an AVX2-only machine gets).
        cflags += ISA_FLAGS.get(os.environ.get("LEAPFROG_CPU_ISA", "native"), [])
        # Named by the sources' hash and path: other versions and other checkouts build side by
        # side. (torch's build file records the source path, so two checkouts sharing one build
        # folder would rebuild it over each other on every load, each taking minutes.)
        digest = hashlib.sha1(repr(cflags).encode() + str(csrc).encode())
        for f in sorted(csrc.iterdir()):
            if f.suffix in (".cpp", ".h"):
                digest.update(f.name.encode() + f.read_bytes())
        name = f"leapfrog_cpu_{digest.hexdigest()[:12]}"
        marker = _built_marker(name)
        _module = _import_built(name, marker)
        if _module is None:
            # deferred: cpp_extension (setuptools) loads only when the kernels are built
            from torch.utils.cpp_extension import load
            _clear_stale_lock(name)
            _module = load(name=name, sources=[str(s) for s in sources], extra_cflags=cflags,
                           extra_ldflags=["-fopenmp"], verbose=False)
            _remember_built(marker, _module)
    except Exception as e:  # no compiler, headers missing, ...: fall back to SDPA
        print(f"[leapfrog] CPU kernels unavailable, using the torch paths ({type(e).__name__}: {e})",
              file=sys.stderr)
        _module = None
    return _module


_NO_BITS = torch.empty(0, 0, dtype=torch.int32)
_NO_ROWS = torch.empty(0, dtype=torch.uint8)
NO_FLAG = torch.empty(0, dtype=torch.int32)    # DecodeLoop.run / forward without an interrupt flag


@dataclass(slots=True)
class LoopCall:
    """One call of the C++ decode loop (`DecodeLoop.run`, csrc/decode_loop.cpp), by name: B rows,
    each feeding `tokens[b]` at `positions[b]` over its block table, for up to `budgets[b]` of at
    most `steps` steps. Left out: greedy sampling, no stop or banned token ids, no tokens still
    owed before the end may be sampled, no captured layers, no coupled-position anchors."""
    tokens: torch.Tensor                        # [B] long
    positions: torch.Tensor                     # [B] long
    tables: torch.Tensor                        # [B, blocks] long
    budgets: torch.Tensor                       # [B] long
    steps: int = 1
    sampling: tuple[torch.Tensor, ...] | None = None   # Sampler.row_settings; None: greedy
    stop_ids: torch.Tensor | None = None        # [B, n] long, -1 padded: a row ends on these
    ban_ids: torch.Tensor | None = None         # [B, n] long, -1 padded: never sampled while min_left
    min_left: torch.Tensor | None = None        # [B] long: tokens before a stop or ban lifts
    return_logits: bool = False                 # one step; the logits back instead of sampling
    capture_layers: list[int] = field(default_factory=list)
    anchors: torch.Tensor | None = None         # [B] long: coupled positions' anchor index
    # structured outputs: (mask_bits [B, words] int32, mask_rows [B] uint8, mask_fn), mask_fn
    # called before each step's sampling with (tokens so far, produced) to fill the masked rows
    masks: tuple | None = None
    # int32 [1] set by another thread when new work arrives: the call stops before its next step
    # (with interrupt_mid_step, at its next barrier inside a step); the steps finished stand
    interrupt: torch.Tensor | None = None
    interrupt_mid_step: bool = False

    def run(self, loop) -> list[torch.Tensor]:
        """(tokens [B, steps], counts [B], logits or picked probabilities, captured rows)."""
        rows = self.tokens.numel()
        zeros = torch.zeros(rows, dtype=torch.long)
        none = torch.full((rows, 1), -1, dtype=torch.long)
        sampling = self.sampling or (torch.zeros(rows), zeros, torch.ones(rows), torch.zeros(rows), zeros, zeros)
        return loop.run(self.tokens, self.positions, self.tables, self.budgets, self.steps, *sampling,
                        none if self.stop_ids is None else self.stop_ids,
                        none if self.ban_ids is None else self.ban_ids,
                        zeros if self.min_left is None else self.min_left, self.return_logits,
                        list(self.capture_layers),
                        torch.empty(0, dtype=torch.long) if self.anchors is None else self.anchors,
                        *(self.masks or (_NO_BITS, _NO_ROWS, None)),
                        NO_FLAG if self.interrupt is None else self.interrupt, self.interrupt_mid_step)
