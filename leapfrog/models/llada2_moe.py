"""LLaDA2.0 / 2.1 (`LLaDA2MoeModelLM`, inclusionAI, the LLaDA2.0 technical report): the Ling-2.0 MoE
decoder, trained as a block-diffusion model.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

from leapfrog.models.llama import LlamaForCausalLM


def decoder_config(cfg: dict) -> dict:
    """config.json of LLaDA2 -> the keys llama.py reads; unsupported variants refused by name."""
    for key in ("use_bias", "norm_head", "use_linear_attention"):
        if cfg.get(key):
            raise ValueError(f"LLaDA2MoeModelLM with {key}=true is not supported")
    if (cfg.get("hidden_act") or "silu") != "silu":
        raise ValueError(f"LLaDA2MoeModelLM: unsupported hidden_act {cfg['hidden_act']!r}")
    out = dict(cfg)
    out["attention_bias"] = bool(cfg.get("use_qkv_bias", False))
    out["use_qk_norm"] = bool(cfg.get("use_qk_norm", True))
    # The reference code registers expert_bias whatever the flag says, so checkpoints carry it,
    # and renormalises the chosen weights whenever it picks more than one expert.
    out["moe_router_enable_expert_bias"] = True
    out["norm_topk_prob"] = cfg.get("num_experts_per_tok", 1) > 1
    out["score_function"] = cfg.get("score_function") or "sigmoid"
    return out


class LLaDA2MoeModelLM(LlamaForCausalLM):
    flavour = "qwen3"
    renamed_modules = {
        "model.word_embeddings.": "model.embed_tokens.",
        ".attention.query_key_value.": ".self_attn.qkv_proj.",
        ".attention.query_layernorm.": ".self_attn.q_norm.",
        ".attention.key_layernorm.": ".self_attn.k_norm.",
        ".attention.dense.": ".self_attn.o_proj.",
        ".mlp.gate.e_score_correction_bias": ".mlp.gate.expert_bias",   # Diffulex's name
    }

    def __init__(self, cfg: dict) -> None:
        super().__init__(decoder_config(cfg))
        self.config = cfg
