"""`leapfrog info`: total parameters, parameters active per token and their ratio, from config.json
alone (no weights are read, so it answers for a 100B checkpoint before downloading it).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from leapfrog.layers.moe import MoESpec, is_moe_layer, moe_spec

EXACT_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
               "llada2_moe", "deepseek_v3", "gemma3_text"}


@dataclass(slots=True)
class ParamReport:
    architecture: str
    total: int
    active: int
    embedding: int              # input embedding matrix
    lm_head: int                # 0 when tied to the embedding
    tied_embeddings: bool
    num_layers: int
    num_moe_layers: int
    num_experts: int = 0
    experts_per_token: int = 0
    shared_expert_size: int = 0
    note: str = ""

    @property
    def active_ratio(self) -> float:
        return self.active / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "active_ratio": round(self.active_ratio, 6)}


def _attention(cfg: dict) -> int:
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank"):                # DeepSeek-V2/V3 multi-head latent attention
        rope, nope, v = cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        lora_q, lora_kv, bias = cfg.get("q_lora_rank"), cfg["kv_lora_rank"], bool(cfg.get("attention_bias"))
        q = h * lora_q + bias * lora_q + lora_q + lora_q * nh * (nope + rope) if lora_q else h * nh * (nope + rope)
        kv = h * (lora_kv + rope) + bias * (lora_kv + rope) + lora_kv + lora_kv * nh * (nope + v)
        return q + kv + nh * v * h + bias * h
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or h // nh
    qwen2 = cfg.get("model_type", "").startswith("qwen2")
    qkv_bias = cfg.get("attention_bias", cfg.get("qkv_bias", cfg.get("use_qkv_bias", qwen2)))
    o_bias = (cfg.get("attention_bias", False) and not qwen2) or cfg.get("use_bias", False)
    qk_norm = cfg.get("use_qk_norm", cfg.get("model_type") in ("qwen3", "qwen3_moe", "gemma3_text"))
    qkv = (nh + 2 * nkv) * hd
    return h * qkv + nh * hd * h + bool(qkv_bias) * qkv + bool(o_bias) * h + bool(qk_norm) * 2 * hd


def _swiglu(h: int, width: int, bias: bool = False) -> int:
    return 3 * h * width + bias * (2 * width + h)


def _moe(h: int, spec: MoESpec) -> tuple[int, int]:
    """(total, active) parameters of one MoE feed-forward."""
    fixed = spec.num_experts * h * (1 + spec.router_bias) + spec.score_bias * spec.num_experts
    fixed += _swiglu(h, spec.shared_intermediate_size) + spec.shared_gate * h
    expert = _swiglu(h, spec.intermediate_size)
    return fixed + spec.num_experts * expert, fixed + spec.top_k * expert


def param_report(cfg: dict) -> ParamReport:
    """Parameter counts of the model that `cfg` (a parsed config.json) describes."""
    if cfg.get("architectures", [""])[0] == "LLaDA2MoeModelLM":
        # deferred: the LLaDA2 model code loads only for its configs
        from leapfrog.models.llada2_moe import decoder_config
        cfg = decoder_config(cfg)
    h, v, num_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    spec = moe_spec(cfg)
    total = active = 0
    num_moe = 0
    for i in range(num_layers):
        # norms: before attention and the MLP; Gemma 3 also after each
        common = _attention(cfg) + (4 if cfg.get("model_type") == "gemma3_text" else 2) * h
        if spec is not None and is_moe_layer(cfg, i):
            t, a = _moe(h, spec)
            num_moe += 1
        else:
            t = a = _swiglu(h, cfg["intermediate_size"], bool(cfg.get("mlp_bias", False)))
        total, active = total + common + t, active + common + a
    embedding, lm_head = v * h, 0 if tied else v * h
    total, active = total + embedding + lm_head + h, active + embedding + lm_head + h
    kind = cfg.get("model_type", "")
    note = "" if kind in EXACT_TYPES else (f"model_type {kind!r} is counted as a Llama-shaped decoder; "
                                           "layers it adds are not included")
    return ParamReport(
        architecture=(cfg.get("architectures") or [kind or "?"])[0], total=total, active=active,
        embedding=embedding, lm_head=lm_head, tied_embeddings=tied, num_layers=num_layers,
        num_moe_layers=num_moe, num_experts=spec.num_experts if spec else 0,
        experts_per_token=spec.top_k if spec else 0,
        shared_expert_size=spec.shared_intermediate_size if spec else 0, note=note)


def read_model_config(model: str) -> tuple[Path, dict]:
    """A config.json path, a checkpoint folder or a built-in model name -> (path, parsed config)."""
    path = Path(model)
    if not path.is_file():
        if not path.is_dir():
            # deferred: config loads only when a name must be resolved
            from leapfrog.config import resolve_model
            path = resolve_model(model)
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (not a Hugging Face checkpoint folder?)")
    # deferred: the loader (its checks of a config.json) loads only when one is read
    from leapfrog.models.loader import read_config_file
    return path, read_config_file(path)


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def render(path: Path, r: ParamReport) -> str:
    if r.num_moe_layers:
        shared = f", shared expert width {r.shared_expert_size}" if r.shared_expert_size else ", no shared expert"
        layers = (f"{r.num_layers} ({r.num_moe_layers} MoE: {r.num_experts} experts, top "
                  f"{r.experts_per_token}{shared})")
    else:
        layers = f"{r.num_layers} (dense)"
    tie = ("tied: the output head reuses them" if r.tied_embeddings
           else f"untied: output head {r.lm_head:,} more")
    rows = [("config", str(path)), ("architecture", r.architecture), ("layers", layers),
            ("total parameters", f"{r.total:,} ({_human(r.total)})"),
            ("active per token", f"{r.active:,} ({_human(r.active)})"),
            ("active ratio", f"{100 * r.active_ratio:.1f}%"),
            ("embeddings", f"{r.embedding:,} ({tie})")]
    if r.note:
        rows.append(("note", r.note))
    return "\n".join(f"{k:18s}{v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="leapfrog info",
        description="Total parameters, parameters active per token and their ratio, computed from "
                    "config.json alone (no weights read). Embeddings are included in both.")
    p.add_argument("model", help="built-in model name, checkpoint folder, or a config.json file")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    try:
        path, cfg = read_model_config(args.model)
        report = param_report(cfg)
    except (OSError, ValueError, KeyError) as e:
        msg = f"missing key {e} in config.json" if isinstance(e, KeyError) else str(e)
        print(f"leapfrog info: {msg}", file=sys.stderr)
        return 2
    print(json.dumps({"config": str(path), **report.to_dict()}, indent=2) if args.json else render(path, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
