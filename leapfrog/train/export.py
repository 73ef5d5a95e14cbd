"""Write a trained model as a Hugging Face folder: weights, config, tokenizer, loss curve, README,
SHA256SUMS. The folder is what ``transformers`` and llama.cpp's converter load unchanged.

A block-diffusion model is the same folder plus its decoding contract: config.json carries
``block_size``, ``mask_token_id`` and ``diffusion_logit_shift`` (set by the loop), and
``leapfrog.json`` names ``diffusion`` as the model's default method."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from leapfrog.train.tokenizer import unknown_as_unk

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
GENERATION_DEFAULTS = {
    "stories": {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 256},
    "couplets": {"do_sample": False, "max_new_tokens": 64},
}


def save_checkpoint(model, tok, prep, cfg, history: dict) -> dict:
    """Export to cfg.out_dir; returns the summary that the README states."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    # Copy before casting: the live fp32 model may be trained further after an export.
    small = copy.deepcopy(model).to(DTYPES[cfg.save_dtype])
    small.config.dtype = cfg.save_dtype
    small.generation_config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.eos_token_id,
                                   **GENERATION_DEFAULTS.get(cfg.name, {}))
    if cfg.tokenizer.end_of_prompt:
        # The tokenizer ends every prompt with this marker and no completion holds one, so the
        # model must never emit it (a small model's spread first-token distribution can make the
        # marker the argmax); transformers' generate and leapfrog's loader honour the key.
        small.generation_config.suppress_tokens = [tok.convert_tokens_to_ids(cfg.tokenizer.end_of_prompt)]
    small.save_pretrained(out, safe_serialization=True)
    if cfg.init_from:      # the tokenizer the weights were trained with, byte for byte
        for name in TOKENIZER_FILES:
            if (Path(cfg.init_from) / name).is_file():
                shutil.copy(Path(cfg.init_from) / name, out / name)
        if not cfg.tokenizer.byte_fallback:    # the encoding rule the streams were made with
            unknown_as_unk(out)
    else:
        tok.save_pretrained(out)
        shutil.copy(Path(prep.tokenizer_dir) / "tokenizer.model", out / "tokenizer.model")
    if cfg.name == "couplets":
        # deferred: the couplet data loads only for the couplets recipe
        from leapfrog.data.couplets import CHAT_TEMPLATE
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    decoding = {}
    if cfg.diffusion is not None:
        decoding["default_method"] = "diffusion"
        if cfg.diffusion.mask_stream:   # the parent verifies the stream's drafts: its own text
            decoding["method_options"] = {"diffusion": {"verify": True}}
    if cfg.coupled_positions:       # the rotary positions restart after this token (train.fast)
        decoding["coupled_positions"] = cfg.coupled_positions
    if decoding:
        (out / "leapfrog.json").write_text(json.dumps(decoding, indent=2) + "\n")
    summary = summarize(model, cfg, history, prep)
    (out / "training.json").write_text(json.dumps(summary, indent=2, default=str))
    plot_loss(history, out / "loss.png", cfg.recipe or cfg.name)
    return summary


def summarize(model, cfg, history: dict, prep) -> dict:
    val = history["val"][-1][1] if history["val"] else float("nan")
    if "exported" in history:          # keep_best: the weights of the best validation loss
        val = history["exported"]["val"]
    return {
        "recipe": cfg.recipe or cfg.name,
        "num_params": sum(p.numel() for p in model.parameters()),
        "steps": history["train"][-1][0] if history["train"] else 0,
        "exported_step": history.get("exported", {}).get("step"),
        "tokens_seen": history["tokens"],
        "wall_s": round(history["wall_s"], 1),
        "val_loss": round(val, 4),
        "val_ppl": round(math.exp(val), 3) if val == val else None,
        "train_tokens": int(len(prep.train)),
        "val_tokens": int(len(prep.val)),
        "num_train_items": prep.num_train_items,
        "num_val_items": prep.num_val_items,
        "save_dtype": cfg.save_dtype,
        "val_parts": history["val_parts"][-1][1] if history.get("val_parts") else {},
        "init": _init_summary(cfg.init_from),
        "config": asdict(cfg),
    }


def _init_summary(folder: str | None) -> dict | None:
    """What the run started from: the folder and, when it has one, its own training summary."""
    if not folder:
        return None
    path = Path(folder) / "training.json"
    past = json.loads(path.read_text()) if path.is_file() else {}
    keep = ("recipe", "steps", "tokens_seen", "wall_s", "val_loss", "val_parts")
    # deferred: data.corpus loads only when a summary is started
    from leapfrog.data.corpus import REPO_ROOT
    try:
        folder = str(Path(folder).resolve().relative_to(REPO_ROOT))
    except ValueError:
        pass
    return {"folder": str(folder), **{k: past[k] for k in keep if k in past}}


def plot_loss(history: dict, path: Path, title: str) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")  # headless: no display on build machines
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    if history["train"]:
        steps, losses = zip(*history["train"])
        k = max(1, len(losses) // 200)  # smooth: one point per ~0.5% of the run
        smooth = [sum(losses[i:i + k]) / len(losses[i:i + k]) for i in range(0, len(losses), k)]
        ax.plot(steps[::k], smooth, label="train")
    if history["val"]:
        ax.plot(*zip(*history["val"]), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{title}: loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_sha256sums(folder: str | Path) -> Path:
    """sha256sum-format manifest of every file in the folder except itself."""
    folder = Path(folder)
    lines = []
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != "SHA256SUMS"):
        lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n")
    manifest = folder / "SHA256SUMS"
    manifest.write_text("".join(lines))
    return manifest


def verify_sha256sums(folder: str | Path) -> list[str]:
    """Names whose hash differs from the manifest (empty when all match)."""
    folder = Path(folder)
    bad = []
    for line in (folder / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        path = folder / name
        if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            bad.append(name)
    return bad
