"""A grown model (leapfrog.checkpoint.build) trained further as a low-rank delta, the form it ships in.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import parametrize

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DELTA_FILE = "delta.safetensors"


@dataclass(slots=True)
class LoraSpec:
    recipe: str                       # the recipe folder (build.json) whose model is trained
    rank: int = 16
    noise: float = 1e-3               # std of B at the start (breaks the copies' symmetry)
    targets: tuple[str, ...] = TARGETS


class LowRank(nn.Module):
    """The parametrization W -> W + B @ A."""

    def __init__(self, out_features: int, in_features: int, rank: int, noise: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.randn(rank, in_features) / math.sqrt(in_features))
        self.lora_B = nn.Parameter(torch.randn(out_features, rank) * noise)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.lora_B @ self.lora_A


def base_folder(spec: LoraSpec) -> Path:
    """The model folder the recipe grows from."""
    # deferred: checkpoint.build loads only when the base folder is looked up
    from leapfrog.checkpoint.build import BUILD_FILE
    folder = Path(spec.recipe)
    return folder.parent / json.loads((folder / BUILD_FILE).read_text())["base"]


def grown_model(spec: LoraSpec):
    """(model, base folder): the recipe's grown model in float32 (no delta), on the CPU."""
    # deferred: transformers (heavy), safetensors and checkpoint.build load only when a model is grown
    from transformers import LlamaConfig, LlamaForCausalLM
    from safetensors.torch import load_file

    from leapfrog.checkpoint.build import BUILD_FILE, BuildError, grow_tensors

    folder = Path(spec.recipe)
    recipe = json.loads((folder / BUILD_FILE).read_text())
    base = base_folder(spec)
    if not (base / "model.safetensors").is_file():
        raise BuildError(f"{folder / BUILD_FILE}: base model {recipe['base']!r} not found at {base}")
    cfg = json.loads((base / "config.json").read_text())
    tensors, new_cfg = grow_tensors(load_file(str(base / "model.safetensors")), cfg,
                                    int(recipe.get("width", 1)), int(recipe.get("depth", 1)))
    new_cfg.update(recipe.get("config", {}))
    config = LlamaConfig(**{k: v for k, v in new_cfg.items() if k not in ("architectures", "dtype")})
    model = LlamaForCausalLM(config)
    # fp16 values, as the build stores them, in float32 arithmetic
    state = {n: t.to(torch.float16).float() for n, t in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise BuildError(f"{folder}: grown weights do not fit the grown config ({(missing + unexpected)[:3]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.float(), base


def add_low_rank(model, spec: LoraSpec, seed: int) -> list[str]:
    """Freeze ``model`` and give each targeted projection its low-rank term; returns the weight
    names that got one."""
    for p in model.parameters():
        p.requires_grad_(False)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    names = []
    try:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in spec.targets:
                out_f, in_f = module.weight.shape
                parametrize.register_parametrization(module, "weight", LowRank(out_f, in_f, spec.rank, spec.noise))
                names.append(name + ".weight")
    finally:
        torch.random.set_rng_state(gen_state)
    return names


def delta_tensors(model) -> dict[str, torch.Tensor]:
    """``<weight name>.lora_A`` / ``.lora_B`` of every low-rank term, float16."""
    out = {}
    for name, module in model.named_modules():
        params = getattr(module, "parametrizations", None)
        if params is not None and "weight" in params:
            term = params["weight"][0]
            out[f"{name}.weight.lora_A"] = term.lora_A.detach().to(torch.float16).contiguous()
            out[f"{name}.weight.lora_B"] = term.lora_B.detach().to(torch.float16).contiguous()
    return out


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The parameters that train (the low-rank terms), by state-dict name."""
    keep = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: t for n, t in model.state_dict().items() if n in keep}


def export_delta(model, cfg, history: dict, prep) -> dict:
    """Write the delta into the recipe folder, point build.json at it, refresh SHA256SUMS, and
    record the run (training.json, loss.png); returns the summary."""
    # deferred: safetensors, checkpoint.build and train.export load only when a delta is exported
    from safetensors.torch import save_file

    from leapfrog.checkpoint.build import BUILD_FILE, write_sums
    from leapfrog.train.export import plot_loss, summarize

    folder = Path(cfg.lora.recipe)
    save_file(delta_tensors(model), str(folder / DELTA_FILE), metadata={"format": "pt"})
    recipe = json.loads((folder / BUILD_FILE).read_text())
    recipe["delta"] = DELTA_FILE
    (folder / BUILD_FILE).write_text(json.dumps(recipe, indent=2) + "\n")
    summary = summarize(model, cfg, history, prep)
    summary["delta"] = {"file": DELTA_FILE, "rank": cfg.lora.rank, "targets": list(cfg.lora.targets),
                        "parameters": sum(p.numel() for p in trainable_state(model).values()),
                        "bytes": (folder / DELTA_FILE).stat().st_size}
    (folder / "training.json").write_text(json.dumps(summary, indent=2, default=str))
    plot_loss(history, folder / "loss.png", cfg.recipe or cfg.name)
    write_sums(folder)
    return summary
