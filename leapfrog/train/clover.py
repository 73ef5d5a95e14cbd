"""`stories-clover`'s parts: a mixture of experts grown from `stories-moe` (sparse upcycling) and
its export in LLaDA2-MoE's layout, the public block-diffusion MoE's (docs/models.md, "stories-clover")."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from leapfrog.train.export import write_sha256sums

EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")   # transformers' fused [E, ...]


def grow_experts(model, num_experts: int, top_k: int, noise: float = 0.0, seed: int = 0):
    """A transformers Qwen3-MoE with `num_experts` experts, each a copy of one of the model's (copy
    j of expert e is expert j * E + e), the router's rows copied with them, `top_k` per token.
    `noise` perturbs the copies after the first (weights by a relative normal factor, router rows
    by an absolute one, scaled to the row's spread) so that training can tell them apart. With no
    noise and top_k = copies x the model's top_k, the grown model computes the model's function."""
    cfg = model.config
    old = cfg.num_experts
    if num_experts % old or num_experts < old:
        raise ValueError(f"grow_experts: {num_experts} experts must be a multiple of the model's {old}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"grow_experts: top_k={top_k} must be between 1 and {num_experts}")
    src = torch.arange(num_experts) % old
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, w in model.state_dict().items():
        if name.endswith(EXPERT_TENSORS) or name.endswith("mlp.gate.weight"):
            w = w[src].clone()
            if noise:
                eps = torch.randn(w[old:].shape, generator=g, dtype=w.dtype)
                if name.endswith("mlp.gate.weight"):
                    w[old:] += noise * w.std() * eps
                else:
                    w[old:] *= 1 + noise * eps
        state[name] = w
    grown_cfg = copy.deepcopy(cfg)
    grown_cfg.num_experts, grown_cfg.num_experts_per_tok = num_experts, top_k
    grown = type(model)(grown_cfg)
    grown.load_state_dict(state)
    return grown.to(next(model.parameters()).dtype)


def export_llada2(folder: str | Path, out: str | Path) -> Path:
    """Write a Qwen3-MoE folder (as `leapfrog train` saves it; block-diffusion keys kept) in
    LLaDA2-MoE's layout: `LLaDA2MoeModelLM` names (fused query_key_value, word_embeddings, dense),
    softmax routing without groups, shared experts or dense layers, a zero expert bias and an
    untied head. The same function under the reference's routing rule, which renormalises the
    chosen experts' weights only when it picks several: a top-1 model is refused."""
    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") != "qwen3_moe":
        raise ValueError(f"{folder}: export_llada2 takes a Qwen3-MoE folder, not {cfg.get('model_type')!r}")
    k = cfg["num_experts_per_tok"]
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))      # transformers 5 saves the latter
    if k < 2 or not cfg.get("norm_topk_prob", False):
        raise ValueError(f"{folder}: LLaDA2 renormalises the chosen experts' weights exactly when it picks "
                         f"several; a Qwen3-MoE with num_experts_per_tok={k} and norm_topk_prob="
                         f"{cfg.get('norm_topk_prob')} has no LLaDA2 equivalent")
    w = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update(load_file(str(f)))
    t = {"model.word_embeddings.weight": w["model.embed_tokens.weight"], "model.norm.weight": w["model.norm.weight"],
         "lm_head.weight": w.get("lm_head.weight", w["model.embed_tokens.weight"]).clone()}
    for n in range(cfg["num_hidden_layers"]):
        p, a = f"model.layers.{n}.", f"model.layers.{n}.self_attn."
        t[p + "input_layernorm.weight"] = w[p + "input_layernorm.weight"]
        t[p + "post_attention_layernorm.weight"] = w[p + "post_attention_layernorm.weight"]
        t[p + "attention.query_key_value.weight"] = torch.cat([w[a + f"{x}_proj.weight"] for x in "qkv"])
        t[p + "attention.query_layernorm.weight"] = w[a + "q_norm.weight"]
        t[p + "attention.key_layernorm.weight"] = w[a + "k_norm.weight"]
        t[p + "attention.dense.weight"] = w[a + "o_proj.weight"]
        t[p + "mlp.gate.weight"] = w[p + "mlp.gate.weight"]
        t[p + "mlp.gate.expert_bias"] = torch.zeros(experts, dtype=w[p + "mlp.gate.weight"].dtype)
        for e in range(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = p + f"mlp.experts.{e}.{proj}.weight"
                t[name] = w[name]
    rope = cfg.get("rope_parameters") or {}
    llada = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"], "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
        "intermediate_size": cfg["intermediate_size"], "moe_intermediate_size": cfg["moe_intermediate_size"],
        "num_experts": experts, "num_experts_per_tok": k, "n_group": 1, "topk_group": 1,
        "num_shared_experts": 0, "first_k_dense_replace": 0, "score_function": "softmax",
        "routed_scaling_factor": 1.0, "norm_topk_prob": True, "moe_router_enable_expert_bias": True,
        "router_dtype": "fp32", "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
        "partial_rotary_factor": 1.0, "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False,
        "tie_word_embeddings": False, "hidden_act": "silu",
        **{key: cfg[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id", "block_size", "mask_token_id",
                                      "diffusion_logit_shift", "dtype") if key in cfg},
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: v.contiguous() for name, v in t.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(llada, indent=2) + "\n")
    for f in folder.iterdir():            # tokenizer, generation config, model card, leapfrog.json
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "SHA256SUMS"):
            shutil.copy2(f, out / f.name)
    card = out / "README.md"
    if card.is_file():                    # the training's card describes the Qwen3-MoE it trained
        card.write_text(f"# {out.name}: a block-diffusion mixture of experts in LLaDA2-MoE's layout\n\n"
                        "Written by `leapfrog.train.clover.export_llada2` from the Qwen3-MoE folder its "
                        "training saved (card below): the same weights and function, "
                        "with LLaDA2-MoE's names (`LLaDA2MoeModelLM`: fused `query_key_value`, "
                        "`word_embeddings`, `dense`), softmax routing without groups or shared experts, "
                        "a zero expert bias and an untied head.\n\n"
                        + card.read_text().replace("# ", "## ", 1))
    write_sha256sums(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m leapfrog.train.clover QWEN3_MOE_FOLDER OUT`: export_llada2 from the command line
    (how `make models` ships stories-clover)."""
    # deferred: argparse and sys only for the command line
    import argparse
    import sys
    p = argparse.ArgumentParser(prog="python -m leapfrog.train.clover",
                                description="Write a trained Qwen3-MoE block-diffusion folder in LLaDA2-MoE's layout.")
    p.add_argument("folder", help="the Qwen3-MoE folder `leapfrog train` saved")
    p.add_argument("out", help="the LLaDA2-MoE folder to write")
    args = p.parse_args(argv)
    try:
        print(export_llada2(args.folder, args.out))
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
