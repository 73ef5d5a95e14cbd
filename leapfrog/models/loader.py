"""Load a Hugging Face checkpoint folder: config.json + *.safetensors (sharded index too).

Every failure names the file and the problem: an unsupported architecture, a missing or
truncated shard, a tensor whose shape does not match, a SHA256SUMS mismatch. Target models
load with load_model; the drafters of the speculative methods (z-lab DFlash and DeepSpec DSpark
checkpoints) with find_drafter and load_drafter.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from leapfrog.config import resolve_model
from leapfrog.checkpoint.gguf import CheckpointError, source_of
from leapfrog.checkpoint.gguf import read_tensors as read_gguf_tensors
from leapfrog.layers import parallel as tp
from leapfrog.layers.linear import default_weight_loader
from leapfrog.layers.moe import expert_target
from leapfrog.models import model_class
from leapfrog.models.dflash import DFlashDraftModel



def read_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (not a Hugging Face checkpoint folder?)")
    return read_config_file(path)


def read_config_file(path: Path) -> dict:
    """A config.json's object (CheckpointError naming the file when it is not one)."""
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, not {type(config).__name__}")
    return config


def verify_manifest(folder: str | os.PathLike) -> None:
    """Refuse a folder whose files differ from its SHA256SUMS manifest (when there is one)."""
    folder = Path(folder)
    manifest = folder / "SHA256SUMS"
    if not manifest.is_file():
        return
    for line in manifest.read_text().splitlines():
        if not line.strip():
            continue
        digest, name = line.split(maxsplit=1)
        name = name.lstrip("*").strip()
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in SHA256SUMS but missing")
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != digest.lower():
            raise CheckpointError(f"{path}: SHA256 mismatch with SHA256SUMS (file changed or corrupt)")


def weight_files(folder: str | os.PathLike) -> list[Path]:
    folder = Path(folder)
    gguf = source_of(folder)
    if gguf is not None:            # a folder made from a GGUF file: the weights are in the file
        return [gguf]
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: unreadable index (a JSON object whose weight_map maps tensor "
                                  f"names to files; {type(e).__name__}: {e})") from None
        if any(not isinstance(n, str) for n in names):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder}: no *.safetensors weights found")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{f}: weight shard missing")
    return files


def iter_tensors(files: list[Path], config: dict | None = None, blocks: dict | None = None):
    for f in files:
        if f.suffix == ".gguf":
            for name, tensor in read_gguf_tensors(f, config or {}, blocks):
                yield f, name, tensor
            continue
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own types for truncation / bad headers
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
        with handle:
            for name in handle.keys():
                try:
                    yield f, name, handle.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{f}: tensor {name} unreadable ({e})") from None


def load_weights(model: nn.Module, files: list[Path], config: dict | None = None, quantized: bool = True) -> None:
    """Every tensor of the files into the model's parameters. A GGUF file's blocks of the types
    the CPU kernels read quantized are also packed for them (layers/quant.py), unless
    `quantized` is False (training against the model: every weight stays a float tensor)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    gguf = any(f.suffix == ".gguf" for f in files)
    blocks: dict | None = {} if quantized and gguf and next(iter(params.values())).device.type == "cpu" else None
    for f, name, tensor in iter_tensors(files, config, blocks):
        if "rotary_emb" in name:
            continue
        target, shard = checkpoint_target(model, name)
        if target not in params and getattr(model, "elsewhere", None) and model.elsewhere(target):
            continue                     # another pipeline stage's layer
        if target not in params:
            if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
                continue
            raise CheckpointError(f"{f}: unexpected tensor {name} for {type(model).__name__}")
        param = params[target]
        try:
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor.to(param.dtype), shard)
        except ValueError as e:
            raise CheckpointError(f"{f}: {name}: {e}") from None
        loaded.add(f"{target}:{shard}")
    check_complete(model, packed, loaded, files)
    if blocks and next(iter(params.values())).dtype == torch.float32:
        # deferred: layers.quant loads only for GGUF blocks
        from leapfrog.layers.quant import attach_embedding_panels, attach_quant_panels
        attach_quant_panels(model, blocks)
        attach_embedding_panels(model, blocks)


def checkpoint_target(model: nn.Module, name: str) -> tuple[str, object]:
    """The parameter and shard id that checkpoint tensor `name` loads into: after the model's
    `renamed_modules` (checkpoint names of other layouts), stacked MoE experts, then packed
    linears (q/k/v, gate/up)."""
    for src, dst in getattr(model, "renamed_modules", {}).items():
        name = name.replace(src, dst)
    expert = expert_target(name)
    if expert is not None:
        return expert
    for src, (dst, shard_id) in getattr(model, "packed_modules", {}).items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard_id
    return name, None


def check_complete(model: nn.Module, packed: dict, loaded: set[str], files: list[Path]) -> None:
    """Refuse a model some of whose parameters no checkpoint tensor filled. `loaded` holds
    "param:shard" for every tensor loaded; `packed` is the model's packed_modules."""
    missing = []
    for pname, p in model.named_parameters():
        if hasattr(p, "missing_parts"):      # stacked experts know which expert tensors arrived
            stem = pname.rsplit(".", 1)[0]
            missing += [f"{stem}.{part}" for part in p.missing_parts()]
            continue
        if f"{pname}:None" in loaded:        # a packed matrix stored whole (LLaDA2's query_key_value)
            continue
        shards = {s for (dst, s) in packed.values() if f".{dst}." in pname}
        needed = {f"{pname}:{s}" for s in shards} or {f"{pname}:None"}
        if not needed <= loaded:
            missing.append(pname)
    if missing:
        raise CheckpointError(f"{files[0].parent}: weights missing from checkpoint: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")


def load_model(folder: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, suppress: bool = True, quantized: bool = True) -> nn.Module:
    """The folder's model, ready to decode. ``suppress=False`` keeps the raw distribution
    (no generation_config.json `suppress_tokens` ban), for scoring texts whose every token counts,
    prompt markers included. ``quantized=False``: a GGUF model's weights all dequantized
    (load_weights), as training against it needs."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    verify_manifest(folder)
    cfg = read_config(folder)
    archs = cfg.get("architectures") or []
    if not archs:
        raise CheckpointError(f"{folder / 'config.json'}: no 'architectures' entry")
    try:
        cls = model_class(archs[0])
        with torch.device(device):
            model = cls(cfg)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    model.to(dtype)
    load_weights(model, weight_files(folder), cfg, quantized)
    model.coupled_anchor = coupled_anchor(folder)
    if suppress:
        ban_tokens(model, suppressed_tokens(folder, int(cfg.get("vocab_size") or 0)))
    return model.eval()


def suppressed_tokens(folder: Path, vocab_size: int) -> list[int]:
    """The ids the folder's generation_config.json lists under `suppress_tokens` (transformers'
    key): tokens the model must never generate, whatever a request asks."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    try:
        ids = json.loads(path.read_text()).get("suppress_tokens")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a valid JSON object ({e})") from None
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            and 0 <= i < (vocab_size or 1 << 62) for i in ids):
        raise CheckpointError(f"{path}: suppress_tokens={ids!r}: expected a list of token ids "
                              f"below the vocabulary size {vocab_size}")
    return ids


def ban_tokens(model: nn.Module, ids: list[int]) -> None:
    """Make the LM head's logits of `ids` a large negative number through its bias, so that
    every decoding path (the C++ decode loop, speculative verification, diffusion, sampling)
    sees them as impossible. A pipeline stage without the head has nothing to do."""
    head = getattr(model, "lm_head", None)
    if not ids or head is None:
        return
    dtype = head.weight.dtype
    ban = torch.zeros(head.out_features * tp.tp_size(), dtype=dtype)
    ban[ids] = -min(1e9, torch.finfo(dtype).max / 2)       # finite: no inf * 0 downstream
    local = nn.Parameter(torch.zeros(head.out_features, dtype=dtype, device=head.weight.device),
                         requires_grad=False)
    loader = tp.rows_loader if tp.tp_size() > 1 else default_weight_loader    # the head is column-parallel
    loader(local, ban)
    if head.bias is None:
        head.bias = local
    else:
        head.bias.data.add_(local.data)


def coupled_anchor(folder: Path) -> tuple[int, int] | None:
    """(bos id, anchor id) when the folder's leapfrog.json declares coupled positions (the
    rotary positions restart after the first such token of a sequence, as it was trained)."""
    meta = folder / "leapfrog.json"
    name = model_meta(folder).get("coupled_positions")
    if not name:
        return None
    # deferred: the tokenizer loads only for coupled-position models
    from leapfrog.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    anchor = tok.token_to_id(name)
    if anchor is None or tok.bos_token_id is None:
        raise CheckpointError(f"{meta}: coupled_positions names {name!r}, which its tokenizer does not have "
                              "(or it has no <s>)")
    return tok.bos_token_id, anchor


# Frozen copies of the target's tables that DeepSpec checkpoints carry: the target's own
# embedding and LM head are used instead.
SHARED_TENSORS = {"embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight"}


def find_drafter(model_path: str | os.PathLike, method: str = "", draft_model: str | None = None) -> Path:
    """Where the drafter is: `draft_model` (a folder, a built-in model name, or a variant name
    under the model folder's `drafters/`); else the drafter the model folder's `leapfrog.json`
    names for this method ({"drafters": {"dspark": "drafters/..."}}); else `drafter/`."""
    model_dir = Path(model_path)
    if draft_model:
        variant = model_dir / "drafters" / str(draft_model)
        if variant.is_dir():
            return variant
        return resolve_model(draft_model)
    named = named_drafter(model_dir, method)
    if named is not None:
        return named
    folder = model_dir / "drafter"
    if folder.is_dir():
        return folder
    raise ValueError(f"{model_path}: no drafter for method {method!r}; pass draft_model=<folder> "
                     f"or ship one in {folder}")


def model_meta(model_dir: str | os.PathLike) -> dict:
    """A model folder's leapfrog.json (decoding contract, default method, drafters, method
    options), {} when it has none."""
    meta = Path(model_dir) / "leapfrog.json"
    if not meta.is_file():
        return {}
    try:
        data = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{meta}: expected a JSON object")
    check_meta(data, meta)
    return data


def check_meta(data: dict, meta: Path) -> None:
    """Refuse leapfrog.json values of the wrong shape (they were ignored, or failed inside the
    engine without the file's name). Keys it does not know are left alone, for newer folders."""
    def need(ok: bool, key: str, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{meta}: {key} must be {what}, not {json.dumps(data.get(key))[:80]}")
    if "default_method" in data:
        need(isinstance(data["default_method"], str) and bool(data["default_method"]), "default_method",
             "a method's name")
    if "coupled_positions" in data:
        need(data["coupled_positions"] is None or isinstance(data["coupled_positions"], str),
             "coupled_positions", "a token (a string)")
    if "drafters" in data:
        d = data["drafters"]
        need(d is None or (isinstance(d, dict) and all(isinstance(v, str) and v for v in d.values())),
             "drafters", "an object of method -> folder or model name")
    for key in ("engine_options", "method_options"):
        if key in data:
            need(data[key] is None or isinstance(data[key], dict), key, "an object")
    for method, options in (data.get("method_options") or {}).items():
        if options is not None and not isinstance(options, dict):
            raise CheckpointError(f"{meta}: method_options.{method} must be an object, not {json.dumps(options)[:80]}")


def named_drafter(model_dir: str | os.PathLike, method: str) -> Path | None:
    """The drafter the model folder's `leapfrog.json` names for `method`: a folder inside the
    model folder, or a model (a built-in name or a path; `draft`'s small AR model); None when
    it names none."""
    model_dir = Path(model_dir)
    named = (model_meta(model_dir).get("drafters") or {}).get(method)
    if not named:
        return None
    if (model_dir / named).is_dir():
        return model_dir / named
    try:
        return resolve_model(named)
    except FileNotFoundError:
        raise ValueError(f"{model_dir / 'leapfrog.json'}: drafter {named!r} for method {method!r} is "
                         "missing (neither a folder there nor a model)") from None


# Engine options a model folder may set by default: those that are about the model's numerics.
FOLDER_ENGINE_OPTIONS = ("matmul_precision",)


def model_engine_options(model_dir: str | os.PathLike) -> dict:
    """The engine options the model folder's `leapfrog.json` sets by default
    ({"engine_options": {"matmul_precision": "bfloat16"}}); the caller's own win."""
    meta = Path(model_dir) / "leapfrog.json"
    options = model_meta(Path(model_dir)).get("engine_options") or {}
    if not isinstance(options, dict):
        raise CheckpointError(f"{meta}: engine_options must be an object")
    unknown = sorted(set(options) - set(FOLDER_ENGINE_OPTIONS))
    if unknown:
        raise CheckpointError(f"{meta}: engine_options {unknown} cannot be set by a model folder "
                              f"(only {list(FOLDER_ENGINE_OPTIONS)})")
    return dict(options)


def model_method_options(model_dir: str | os.PathLike, method: str) -> dict:
    """The options the model folder's `leapfrog.json` sets for `method` by default
    ({"method_options": {"draft": {"verify": "confidence"}}}); the caller's own win."""
    options = (model_meta(Path(model_dir)).get("method_options") or {}).get(method) or {}
    if not isinstance(options, dict):
        raise CheckpointError(f"{Path(model_dir) / 'leapfrog.json'}: method_options.{method} must be an object")
    return dict(options)


def load_drafter(folder: str | os.PathLike, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """A z-lab DFlash or DeepSpec DSpark checkpoint folder -> DFlashDraftModel."""
    folder = Path(folder)
    verify_manifest(folder)
    cfg = read_config(folder)
    try:
        with torch.device(device):
            model = DFlashDraftModel(cfg)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    model.to(dtype)
    params = dict(model.named_parameters())
    files = weight_files(folder)
    loaded: set[str] = set()
    for f, name, tensor in iter_tensors(files):
        name = name.removeprefix("model.") if name.startswith(("model.layers.", "model.embed_tokens.")) else name
        if (name in SHARED_TENSORS and name not in params) or "rotary_emb" in name:
            continue                 # copies of the target's (DeepSpec layout): the target's own are used
        target, shard = name, None
        for src, (dst, shard_id) in model.packed_modules.items():
            if name.startswith("layers.") and f".{src}." in name:   # not markov_head.gate_proj
                target, shard = name.replace(f".{src}.", f".{dst}."), shard_id
                break
        if target not in params:
            raise CheckpointError(f"{f}: unexpected tensor {name} for a {model.drafter.kind} drafter")
        param = params[target]
        try:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor.to(param.dtype), shard)
        except ValueError as e:
            raise CheckpointError(f"{f}: {name}: {e}") from None
        loaded.add(f"{target}:{shard}")
    check_complete(model, model.packed_modules, loaded, files)
    return model.eval()
