"""Built-in models made on first use from shipped small weights (a recipe folder's build.json).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BUILD_FILE = "build.json"
COPIED_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")


def cache_root() -> Path:
    return Path(os.environ.get("LEAPFROG_CACHE", Path.home() / ".cache" / "leapfrog"))


class BuildError(RuntimeError):
    pass


# --- growth -----------------------------------------------------------------------------------------
def widen(t: torch.Tensor, k: int, out_copies: bool, in_copies: bool) -> torch.Tensor:
    """A weight [out, in] (or a vector [out]) with its output side copied k times and its input
    side copied k times and divided by k, both copy-major."""
    if out_copies:
        t = t.repeat(k, *([1] * (t.dim() - 1)))
    if in_copies:
        t = t.repeat(1, k) / k
    return t


def grow_tensors(tensors: dict[str, torch.Tensor], cfg: dict, width: int, depth: int) -> tuple[dict, dict]:
    """(tensors, config) of the base model grown `width` times wider and `depth` times deeper."""
    if cfg.get("model_type") != "llama" or cfg.get("architectures") != ["LlamaForCausalLM"]:
        raise BuildError("growth supports Llama checkpoints (LlamaForCausalLM)")
    if width & (width - 1) or depth < 1:
        raise BuildError("width must be a power of two (exact division) and depth >= 1")
    k, tied = width, bool(cfg.get("tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    f32 = {name: t.float() for name, t in tensors.items()}
    out["model.embed_tokens.weight"] = f32["model.embed_tokens.weight"].repeat(1, k)
    norm = f32["model.norm.weight"].repeat(k)
    out["model.norm.weight"] = norm / k if tied else norm
    if not tied:
        out["lm_head.weight"] = widen(f32["lm_head.weight"], k, False, True)
    layers = cfg["num_hidden_layers"]
    for src in range(layers):
        p = f"model.layers.{src}."
        grown = {
            "input_layernorm.weight": f32[p + "input_layernorm.weight"].repeat(k),
            "post_attention_layernorm.weight": f32[p + "post_attention_layernorm.weight"].repeat(k),
        }
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            grown[name + ".weight"] = widen(f32[p + name + ".weight"], k, True, True)
            if p + name + ".bias" in f32:
                grown[name + ".bias"] = f32[p + name + ".bias"].repeat(k)
        for copy in range(depth):
            q = f"model.layers.{src * depth + copy}."
            for name, t in grown.items():
                silent = copy > 0 and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                                                "self_attn.o_proj.bias", "mlp.down_proj.bias")
                out[q + name] = torch.zeros_like(t) if silent else t.clone()
    new = dict(cfg)
    new["hidden_size"] = cfg["hidden_size"] * k
    new["intermediate_size"] = cfg["intermediate_size"] * k
    heads = cfg["num_attention_heads"]
    new["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // heads
    new["num_attention_heads"] = heads * k
    new["num_key_value_heads"] = (cfg.get("num_key_value_heads") or heads) * k
    new["num_hidden_layers"] = layers * depth
    return out, new


def _drafter_taps(cfg: dict) -> list[int]:
    sub = cfg.get("dflash_config") or {}
    taps = sub.get("target_layer_ids", cfg.get("target_layer_ids"))
    if taps is None:
        raise BuildError("drafter config.json names no target_layer_ids to grow")
    return taps


def _move_taps(new: dict, cfg: dict, taps: list[int], depth: int) -> None:
    """The taps of a target `depth` times deeper: the last layer of each grown group."""
    sub = cfg.get("dflash_config") or {}
    grown_taps = [t * depth + depth - 1 for t in taps]
    if "target_layer_ids" in sub:
        new["dflash_config"] = {**sub, "target_layer_ids": grown_taps}
    else:
        new["target_layer_ids"] = grown_taps


def grow_drafter_tensors(tensors: dict[str, torch.Tensor], cfg: dict, width: int, depth: int,
                         tied_target: bool) -> tuple[dict, dict]:
    """A DFlash/DSpark drafter of a base model, grown to match the base grown `width` wider and
    `depth` deeper: its fc reads the same taps of the deeper target (after each tapped layer's
    silent copy), its layers are widened as the target's are, and its final norm (the input of
    the target's LM head) is divided by `width` where the target ties its embeddings. The Markov
    head works on token ids and is kept; the confidence head's hidden-state weights are copied
    (divided by `width` where the target does not tie)."""
    k = width
    f = {name: t.float() for name, t in tensors.items()}
    taps = _drafter_taps(cfg)
    d = cfg["hidden_size"]
    fc = f["fc.weight"]                                     # [d, m*d], input block-major
    wide_in = fc.view(d, len(taps), 1, d).expand(d, len(taps), k, d).reshape(d, len(taps) * k * d) / k
    out = {"fc.weight": wide_in.repeat(k, 1), "hidden_norm.weight": f["hidden_norm.weight"].repeat(k)}
    norm = f["norm.weight"].repeat(k)
    out["norm.weight"] = norm / k if tied_target else norm
    for name, t in f.items():
        if name.startswith("layers."):
            leaf = name.split(".", 2)[2]
            if leaf.endswith(("q_norm.weight", "k_norm.weight")):
                out[name] = t.clone()                       # per head dimension: unchanged
            elif leaf.endswith("layernorm.weight"):
                out[name] = t.repeat(k)
            elif leaf.endswith(".weight"):
                out[name] = widen(t, k, True, True)
            else:
                raise BuildError(f"drafter tensor {name!r}: no growth rule")
        elif name.startswith("markov_head."):
            out[name] = t.clone()
        elif name == "confidence_head.proj.weight":
            hid = t[:, :d].repeat(1, k) / (1 if tied_target else k)
            out[name] = torch.cat([hid, t[:, d:]], dim=1)
        elif name == "confidence_head.proj.bias":
            out[name] = t.clone()
        elif name in ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight"):
            continue        # copies of the target's (DeepSpec layout): leapfrog uses the target's own
        elif name not in out and name not in ("fc.weight", "hidden_norm.weight", "norm.weight"):
            raise BuildError(f"drafter tensor {name!r}: no growth rule")
    new = dict(cfg)
    heads = cfg["num_attention_heads"]
    new.update(hidden_size=d * k, intermediate_size=cfg["intermediate_size"] * k,
               head_dim=cfg.get("head_dim") or d // heads, num_attention_heads=heads * k,
               num_key_value_heads=(cfg.get("num_key_value_heads") or heads) * k,
               num_target_layers=int(cfg["num_target_layers"]) * depth)
    _move_taps(new, cfg, taps, depth)
    return out, new


def narrow_drafter_tensors(tensors: dict[str, torch.Tensor], cfg: dict, width: int, depth: int,
                           base: dict[str, torch.Tensor], base_cfg: dict) -> tuple[dict, dict]:
    """A DFlash/DSpark drafter of a base model kept at its width for the base grown `width`
    wider and `depth` deeper: its fc reads the wider target's features (the same taps of the
    deeper target, each tapped unit's `width` copies averaged: the input side copied and
    divided by `width`), and it carries the base's embedding and LM head as its own
    (target_hidden_size in its config), since the target's are wider. Its layers, norms and
    heads are the base drafter's. A drafter's cost grows with its width, not its target's."""
    k = width
    f = {name: t.float() for name, t in tensors.items()}
    taps = _drafter_taps(cfg)
    d = cfg["hidden_size"]
    if base_cfg["hidden_size"] != d:
        raise BuildError(f"drafter hidden_size {d} != its base model's {base_cfg['hidden_size']}")
    out = {name: t.clone() for name, t in f.items()
           if name not in ("fc.weight", "embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight")}
    out["fc.weight"] = f["fc.weight"].view(d, len(taps), 1, d).expand(d, len(taps), k, d).reshape(d, -1) / k
    tied = bool(base_cfg.get("tie_word_embeddings", False))
    out["embed_tokens.weight"] = base["model.embed_tokens.weight"].float().clone()
    if not tied:
        out["lm_head.weight"] = base["lm_head.weight"].float().clone()
    new = dict(cfg)
    new.update(target_hidden_size=d * k, num_target_layers=int(cfg["num_target_layers"]) * depth,
               vocab_size=base_cfg["vocab_size"], tie_word_embeddings=tied)
    _move_taps(new, cfg, taps, depth)
    return out, new


def apply_delta(tensors: dict[str, torch.Tensor], delta: dict[str, torch.Tensor]) -> None:
    """W += B @ A for every `<name>.lora_B` / `<name>.lora_A` pair of the delta (in place)."""
    names = sorted({n.rsplit(".lora_", 1)[0] for n in delta})
    for name in names:
        if name not in tensors:
            raise BuildError(f"the delta names {name!r}, which the grown model does not have")
        b, a = delta[name + ".lora_B"].float(), delta[name + ".lora_A"].float()
        tensors[name] = tensors[name] + b @ a


# --- the recipe folder --------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(folder: Path | str) -> str:
    """One digest of a model folder's weights (every *.safetensors, by name and content): what a
    run trained from or against that folder records, so a retrained parent is noticed."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).glob("*.safetensors")):
        h.update(f"{p.name}:{sha256(p)}\n".encode())
    return h.hexdigest()[:16]


def read_sums(path: Path) -> dict[str, str]:
    sums = {}
    for line in path.read_text().splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            sums[name.strip().lstrip("*")] = digest
    return sums


def build(recipe_dir: Path, out_dir: Path, checkpoints: Path, check: bool = True,
          derived: bool = False) -> Path:
    """Build the recipe's model into out_dir (atomically: a temporary folder renamed at the end,
    removed if anything fails); ``check`` compares the result with the recipe's SHA256SUMS.
    ``derived``: a shipped drafter that records where it came from (``{"copy": ..., "from":
    ...}``) is derived from there instead, as it was before it was trained and shipped."""
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    try:
        return _build(recipe_dir, out_dir, checkpoints, tmp, check, derived)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_sums(recipe_dir: Path) -> Path:
    """Rebuild a recipe folder's model from the current base checkpoints and write its SHA256SUMS
    (the built weights and configs, the model's then each drafter's): after a base model or a
    drafter it grows from was retrained."""
    recipe = json.loads((recipe_dir / BUILD_FILE).read_text())
    with tempfile.TemporaryDirectory(prefix="leapfrog-build-") as scratch:
        out = build(recipe_dir, Path(scratch) / "model", recipe_dir.parent, check=False)
        names = ["model.safetensors", "config.json"]
        for dst in recipe.get("drafters", {}):
            names += [f"{dst}/model.safetensors", f"{dst}/config.json"]
        lines = [f"{sha256(out / name)}  {name}\n" for name in names]
    (recipe_dir / "SHA256SUMS").write_text("".join(lines))
    return recipe_dir / "SHA256SUMS"


def ship_drafter(recipe_dir: Path, dst: str) -> Path:
    """Make the recipe ship its own trained drafter at ``dst`` (a folder inside the recipe, e.g.
    distilled against the built model) instead of deriving it from the base's: build.json's
    entry becomes ``{"copy": dst}``; then SHA256SUMS are rewritten."""
    path = recipe_dir / BUILD_FILE
    recipe = json.loads(path.read_text())
    if not (recipe_dir / dst / "model.safetensors").is_file():
        raise BuildError(f"{recipe_dir / dst}: no drafter weights to ship")
    drafters = recipe.setdefault("drafters", {})
    spec = drafters.get(dst)                  # keep where it came from: `--derived` rebuilds that
    origin = {"from": spec} if isinstance(spec, str) else \
        {k: v for k, v in (spec or {}).items() if k in ("from", "narrow")}
    drafters[dst] = {"copy": dst, **origin}
    path.write_text(json.dumps(recipe, indent=2) + "\n")
    return write_sums(recipe_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m leapfrog.checkpoint.build``: refresh recipe folders' SHA256SUMS after what they grow from
    changed (--write-sums), ship a drafter trained for the built model (--ship-drafter), or print
    the built model's folder, building it if needed (--path)."""
    p = argparse.ArgumentParser(prog="python -m leapfrog.checkpoint.build", description=main.__doc__)
    p.add_argument("--write-sums", nargs="+", default=[], metavar="FOLDER",
                   help="recipe folders (with build.json) whose SHA256SUMS to rewrite")
    p.add_argument("--ship-drafter", nargs=2, metavar=("FOLDER", "DRAFTER"),
                   help="recipe folder and a drafter folder inside it (e.g. drafters/dflash-2l-narrow) to ship as is")
    p.add_argument("--path", metavar="FOLDER", help="print where FOLDER's model is built (building it now if needed)")
    p.add_argument("--derived", nargs=2, metavar=("FOLDER", "OUT"),
                   help="build FOLDER's model into OUT with each shipped drafter derived from where it "
                        "came from (the start a retrained drafter distils from) and print OUT")
    args = p.parse_args(argv)
    for folder in args.write_sums:
        print(f"wrote {write_sums(Path(folder))}")
    if args.ship_drafter:
        print(f"wrote {ship_drafter(Path(args.ship_drafter[0]), args.ship_drafter[1])}")
    if args.path:
        print(materialize(Path(args.path)))
    if args.derived:
        recipe_dir, out = Path(args.derived[0]), Path(args.derived[1])
        shutil.rmtree(out, ignore_errors=True)     # never an earlier derivation's leftovers
        print(build(recipe_dir, out, recipe_dir.parent, check=False, derived=True))
    return 0


def _build(recipe_dir: Path, out_dir: Path, checkpoints: Path, tmp: Path, check: bool = True,
           derived: bool = False) -> Path:
    recipe = json.loads((recipe_dir / BUILD_FILE).read_text())
    base = checkpoints / recipe["base"]
    if not (base / "model.safetensors").is_file():
        raise BuildError(f"{recipe_dir / BUILD_FILE}: base model {recipe['base']!r} not found at {base}")
    cfg = json.loads((base / "config.json").read_text())
    tensors, new_cfg = grow_tensors(load_file(str(base / "model.safetensors")), cfg,
                                    int(recipe.get("width", 1)), int(recipe.get("depth", 1)))
    if recipe.get("delta"):
        apply_delta(tensors, load_file(str(recipe_dir / recipe["delta"])))
    new_cfg.update(recipe.get("config", {}))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({n: t.to(torch.float16).contiguous() for n, t in sorted(tensors.items())},
              str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(new_cfg, indent=2, sort_keys=True) + "\n")
    for name in COPIED_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, tmp / name)
    for name in recipe.get("files", []):          # README, leapfrog.json, ... from the recipe folder
        shutil.copy2(recipe_dir / name, tmp / name)
    tied = bool(cfg.get("tie_word_embeddings", False))
    base_tensors = None
    for dst, spec in recipe.get("drafters", {}).items():   # drafters grown to match, kept narrow, or shipped
        if isinstance(spec, dict) and "copy" in spec and not (derived and "from" in spec):
            # a drafter trained for the grown model itself
            shutil.copytree(recipe_dir / spec["copy"], tmp / dst,
                            ignore=shutil.ignore_patterns("*.png", "README.md", "training.json", "SHA256SUMS"))
            continue
        src, narrow = (spec, False) if isinstance(spec, str) else (spec["from"], bool(spec.get("narrow")))
        src_dir = checkpoints / src
        dcfg = json.loads((src_dir / "config.json").read_text())
        width, depth = int(recipe.get("width", 1)), int(recipe.get("depth", 1))
        if narrow:
            base_tensors = base_tensors or load_file(str(base / "model.safetensors"))
            dt, dnew = narrow_drafter_tensors(load_file(str(src_dir / "model.safetensors")), dcfg, width, depth,
                                              base_tensors, cfg)
        else:
            dt, dnew = grow_drafter_tensors(load_file(str(src_dir / "model.safetensors")), dcfg, width, depth, tied)
        (tmp / dst).mkdir(parents=True)
        save_file({n: t.to(torch.float16).contiguous() for n, t in sorted(dt.items())},
                  str(tmp / dst / "model.safetensors"), metadata={"format": "pt"})
        (tmp / dst / "config.json").write_text(json.dumps(dnew, indent=2, sort_keys=True) + "\n")
    sums_file = recipe_dir / "SHA256SUMS"
    if check and sums_file.is_file():
        for name, digest in read_sums(sums_file).items():
            if not (tmp / name).is_file() or sha256(tmp / name) != digest:
                raise BuildError(f"{recipe_dir}: the built {name} does not match {sums_file} "
                                 "(a different torch or a changed base model?)")
    if (out_dir / "model.safetensors").is_file():     # another process finished the same build first
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)           # a partial folder (not ours to trust)
    tmp.rename(out_dir)
    return out_dir


def materialize(folder: Path) -> Path:
    """`folder` itself, or for a recipe folder the built model (built now if not yet)."""
    if not (folder / BUILD_FILE).is_file():
        return folder
    digest = hashlib.sha256()
    for f in sorted(folder.iterdir()):
        if f.is_file():
            digest.update(f.name.encode() + sha256(f).encode())
    out = cache_root() / f"{folder.name}-{digest.hexdigest()[:12]}"
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    print(f"[leapfrog] building {folder.name} from its recipe into {out} (once)", file=sys.stderr)
    built = build(folder, out, folder.parent)
    for old in out.parent.glob(f"{folder.name}-*"):      # builds of earlier versions of the recipe,
        stale_tmp = ".tmp" in old.name and time.time() - old.stat().st_mtime > 3600   # and killed ones
        if old != out and old.is_dir() and (stale_tmp or len(old.name) == len(out.name)):
            shutil.rmtree(old, ignore_errors=True)
    return built


if __name__ == "__main__":
    sys.exit(main())
