"""A trained drafter's folder in the published layouts: z-lab DFlash (``DFlashDraftModel``,
block_size + dflash_config) or DeepSpec DSpark (``Qwen3DSparkModel``, flat keys) config.json,
weights under the published names (q/k/v and gate/up unpacked), SHA256SUMS, loss.png,
training.json and README.md."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from leapfrog.train.drafter_recipe import DrafterRecipe


# The shape keys a narrow drafter (own width, own embedding and LM head) keeps from its own config.
NARROW_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "target_hidden_size", "tie_word_embeddings")


def drafter_config(r: DrafterRecipe, target_cfg: dict, mask_id: int, temperatures: list[float] | None = None
                   ) -> dict:
    """config.json in the published layout: z-lab DFlash (block_size + dflash_config) or
    DeepSpec DSpark (Qwen3DSparkModel, flat keys); the rest is the target's Qwen3-style shape."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta",
            "bos_token_id", "eos_token_id")
    cfg = {k: target_cfg[k] for k in keep if k in target_cfg}
    if r.intermediate_size:
        cfg["intermediate_size"] = r.intermediate_size
    cfg.update(model_type="qwen3", head_dim=target_cfg.get("head_dim") or
               target_cfg["hidden_size"] // target_cfg["num_attention_heads"],
               num_hidden_layers=r.num_layers, num_target_layers=target_cfg["num_hidden_layers"],
               layer_types=["full_attention"] * r.num_layers, tie_word_embeddings=False,
               attention_bias=False, hidden_act="silu", torch_dtype="float16")
    if r.kind == "dflash":
        cfg.update(architectures=["DFlashDraftModel"], block_size=r.num_draft + 1,
                   dflash_config={"mask_token_id": mask_id, "target_layer_ids": list(r.taps)})
    else:
        masks = r.block == "masks"
        cfg.update(architectures=["Qwen3DSparkModel"], block_size=r.num_draft + masks, mask_token_id=mask_id,
                   target_layer_ids=list(r.taps), num_anchors=r.anchors, markov_rank=r.markov_rank,
                   markov_head_type=r.head, enable_confidence_head=True, confidence_head_with_markov=True)
        if masks:
            cfg["draft_from_anchor"] = False
        if temperatures:
            cfg["confidence_temperatures"] = [round(t, 4) for t in temperatures]
    return cfg


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The drafter's weights under the published names: packed qkv / gate_up split back."""
    out = {}
    a = model.layers[0].self_attn
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    for name, t in model.state_dict().items():
        if "rotary_emb" in name:
            continue
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", part)] = piece
        else:
            out[name] = t
    return {k: v.detach().to(torch.float16).contiguous() for k, v in out.items()}


def mask_token_id(target_dir: Path) -> int:
    # deferred: the tokenizer loads only when the mask token is looked up
    from leapfrog.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(target_dir)
    for name in MASK_TOKENS:
        mid = tok.token_to_id(name)
        if mid is not None:
            return mid
    raise ValueError(f"{target_dir}: the tokenizer has none of {', '.join(MASK_TOKENS)} for the drafter blocks")


# The drafter's block mask: the target's own <mask>, else a special token chat text never holds
# (SmolLM2's vocabulary has no <mask>; its <empty_output> marks empty notebook outputs).
MASK_TOKENS = ("<mask>", "<|mask|>", "<empty_output>")


def export(r: DrafterRecipe, drafter: nn.Module, tcfg: dict, mask_id: int, history: dict, summary: dict) -> Path:
    # deferred: safetensors and train.export load only when a drafter is exported
    from safetensors.torch import save_file

    from leapfrog.train.export import plot_loss, write_sha256sums

    out = Path(r.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    temps = (summary.get("calibration") or {}).get("temperatures")
    cfg = {**drafter_config(r, tcfg, mask_id, temps), **{k: drafter.config[k] for k in NARROW_KEYS
                                                          if k in drafter.config}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(hf_state_dict(drafter), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "training.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    plot_loss(history, out / "loss.png", f"{r.target} drafter {r.name}")
    (out / "README.md").write_text(render_readme(r, summary))
    write_sha256sums(out)
    return out


def render_readme(r: DrafterRecipe, s: dict) -> str:
    calib = s.get("calibration")
    lines = [
        f"# `{r.target}` drafter `{r.name}`", "",
        f"A {'DSpark' if r.kind == 'dspark' else 'DFlash'} drafter for the built-in `{r.target}` model, "
        f"distilled by `leapfrog train drafter` (leapfrog/train/drafter.py). "
        f"Layout: {'DeepSpec `Qwen3DSparkModel`' if r.kind == 'dspark' else 'z-lab `DFlashDraftModel`'} "
        "config keys and weight names; " + ("narrower than its target: its fc reads the target's wider "
        "features, and it carries its own embedding and LM head (frozen while it trained)."
        if s.get("narrow") else "the embedding and LM head are the target's and are not stored here."),
        "",
        "| | |", "|---|---|",
        f"| draft layers | {r.num_layers} (Qwen3 decoder layers, hidden {s.get('hidden', '')}) |".replace(", hidden )", ")"),
        f"| parameters | {s['num_params'] / 1e6:.2f}M |",
        f"| drafts per block γ | {r.num_draft}"
        + (" (DFlash's block: the anchor and γ masks)" if r.kind == "dspark" and r.block == "masks" else "") + " |",
        f"| target layers tapped | {r.taps} |",
        f"| sequential head | {r.head + ' (rank ' + str(r.markov_rank) + ')' if r.kind == 'dspark' else 'none'} |",
        f"| confidence head | {'yes, STS-calibrated' if r.kind == 'dspark' else 'no'} |",
        f"| training data | {s['num_train_sequences']} story openings from the training split, continued by "
        f"the target (half greedy, half T=0.7 / top-p 0.9), {r.regen_tokens} new tokens each |",
        f"| objective | {'0.1 CE + 0.9 TV + 1.0 confidence BCE' if r.kind == 'dspark' else 'CE'}, "
        f"position weights exp(-(k-1)/{r.decay:g}) |",
        f"| steps | {s['steps']} x {r.seqs_per_step} sequences x {r.anchors} anchors"
        + (f", continuing `{r.init_from}`" if r.init_from else "")
        + (f" with the heads of `{r.heads_from}`" if r.heads_from else "") + " |",
        f"| wall time | {s['wall_s'] / 60:.1f} min on {r.threads} CPU thread(s) |",
        f"| validation loss | {s['val_loss']} |",
        f"| offline τ (greedy, held-out) | {s['offline_tau']} |",
        f"| draft k accepted given 1..k-1 were (held-out, greedy) | "
        f"{' / '.join(f'{a:.2f}' for a in s.get('acceptance_by_position', []))} |", "",
        "Offline τ: on greedy continuations of held-out story openings, each block is drafted "
        "along the drafted path; its leading drafts equal to the target's greedy tokens are "
        "accepted, plus one bonus token, and the next block starts where the engine's would. "
        "It is the acceptance length greedy speculative decoding sees.", "",
    ]
    if calib:
        lines += ["Confidence calibration (sequential temperature scaling on "
                  f"{calib['num_blocks']} held-out blocks): ECE of the survival product per position",
                  "", "| position | " + " | ".join(str(k + 1) for k in range(len(calib['ece_after']))) + " |",
                  "|---|" + "---|" * len(calib["ece_after"]),
                  "| before | " + " | ".join(f"{e:.3f}" for e in calib["ece_before"]) + " |",
                  "| after | " + " | ".join(f"{e:.3f}" for e in calib["ece_after"]) + " |",
                  "| temperature | " + " | ".join(f"{t:.2f}" for t in calib["temperatures"]) + " |", ""]
    lines += ["Reproduce:", "", "```", r.command or f"leapfrog train drafter {r.name}", "```", "",
              "![loss](loss.png)", ""]
    return "\n".join(lines)
