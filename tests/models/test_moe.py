"""Mixture of experts: the layer equals a naive per-token loop, Qwen2/3-MoE equal transformers,
the LLaDA2 layout equals a reference written from its description (research/diffusion.md §1.5),
broken checkpoints name the missing expert, parameter counts equal the real models', and a toy
MoE training run exports a folder that leapfrog and transformers read alike."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from conftest import VOCAB, _common, write_tokenizer
from leapfrog import LLM, SamplingParams
from leapfrog.layers.moe import MoESpec, SparseMoE
from leapfrog.models.loader import CheckpointError, load_model
from leapfrog.models.info import param_report
from test_parity import PROMPTS, hf_greedy, hf_model, record_logits

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- the layer vs a naive loop

def naive_moe(x, spec: MoESpec, router_w, expert, shared=None, router_b=None, expert_bias=None,
              shared_gate_w=None) -> torch.Tensor:
    """Token by token, routing in Python floats, straight from the description of each router."""
    out = []
    size = spec.num_experts // spec.num_groups
    for xt in x:
        logits = [float(router_w[e] @ xt) + (float(router_b[e]) if router_b is not None else 0.0)
                  for e in range(spec.num_experts)]
        if spec.scoring == "softmax":
            exps = [math.exp(v - max(logits)) for v in logits]
            scores = [v / sum(exps) for v in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        choice = [s + (float(expert_bias[e]) if expert_bias is not None else 0.0) for e, s in enumerate(scores)]
        allowed = list(range(spec.num_experts))
        if spec.num_groups > 1:       # a group's score: the sum of its two best experts
            group_score = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2])
                           for g in range(spec.num_groups)]
            kept = sorted(range(spec.num_groups), key=lambda g: -group_score[g])[:spec.topk_groups]
            allowed = [e for e in allowed if e // size in kept]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:spec.top_k]
        weights = [scores[e] for e in chosen]
        if spec.norm_topk_prob:
            weights = [w / sum(weights) for w in weights]
        y = sum(w * spec.routed_scaling_factor * expert(e, xt) for w, e in zip(weights, chosen))
        if shared is not None:
            gate = torch.sigmoid(shared_gate_w @ xt) if shared_gate_w is not None else 1.0
            y = y + gate * shared(xt)
        out.append(y)
    return torch.stack(out)


def swiglu(x, gate, up, down):
    return down @ (F.silu(gate @ x) * (up @ x))


SPECS = {
    "qwen3": MoESpec(num_experts=8, top_k=2, intermediate_size=12),
    "qwen2_shared_gate": MoESpec(num_experts=8, top_k=3, intermediate_size=12, norm_topk_prob=True,
                                 shared_intermediate_size=20, shared_gate=True),
    "llada2_groups": MoESpec(num_experts=8, top_k=2, intermediate_size=12, scoring="sigmoid",
                             norm_topk_prob=True, routed_scaling_factor=2.5, num_groups=4,
                             topk_groups=2, score_bias=True, shared_intermediate_size=12),
    "sigmoid_router_bias": MoESpec(num_experts=8, top_k=2, intermediate_size=12, scoring="sigmoid",
                                   router_bias=True),
}


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("num_tokens", [1, 3, 40])     # 1, 3: gathered experts; 40: sorted by expert
def test_layer_equals_naive_loop(name, num_tokens):
    spec = SPECS[name]
    torch.manual_seed(zlib.crc32(name.encode()))
    moe = SparseMoE(16, spec)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(num_tokens, 16)
    moe.requires_grad_(False)
    ex, i = moe.experts, spec.intermediate_size
    shared = getattr(moe, moe.shared_name) if moe.shared_name else None
    ref = naive_moe(
        x, spec, moe.gate.weight, lambda e, xt: swiglu(xt, ex.gate_up_proj[e, :i], ex.gate_up_proj[e, i:],
                                                      ex.down_proj[e]),
        shared=None if shared is None else lambda xt: shared.down_proj.weight @ (
            F.silu(shared.gate_up_proj.weight[:spec.shared_intermediate_size] @ xt)
            * (shared.gate_up_proj.weight[spec.shared_intermediate_size:] @ xt)),
        router_b=moe.gate.bias, expert_bias=moe.gate.expert_bias,
        shared_gate_w=None if moe.shared_expert_gate is None else moe.shared_expert_gate.weight[0])
    with torch.no_grad():
        torch.testing.assert_close(moe.forward(x.view(1, num_tokens, 16)), ref.view(1, num_tokens, 16),
                                   atol=1e-5, rtol=1e-5)


def test_group_limit_changes_the_choice():
    """The grouped case is not vacuous: without the group limit some tokens route elsewhere."""
    spec = SPECS["llada2_groups"]
    torch.manual_seed(0)
    moe = SparseMoE(16, spec)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        x = torch.randn(64, 16)
        grouped, _ = moe.gate.forward(x)
        moe.gate.spec = MoESpec(**{**{f: getattr(spec, f) for f in spec.__slots__}, "num_groups": 1})
        free, _ = moe.gate.forward(x)
    assert (grouped.sort(-1).values != free.sort(-1).values).any(-1).sum() > 0


# ---------------------------------------------------------------- Qwen2-MoE / Qwen3-MoE vs transformers

def build_moe(root: Path, family: str, **overrides) -> Path:
    cls_cfg, cls_model = {"qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
                          "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM)}[family]
    kw = _common(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 mlp_only_layers=[1])
    if family == "qwen3_moe":
        kw.update(head_dim=32, norm_topk_prob=True)
    else:
        kw.update(shared_expert_intermediate_size=48)
    kw.update(overrides)
    torch.manual_seed(zlib.crc32(family.encode()) % 1000)
    model = cls_model(cls_cfg(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:      # decisive routing (router) and non-tied logits (the rest)
                p.normal_(0, 0.5 if name.endswith("mlp.gate.weight") else 0.08)
    folder = root / family
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {f: build_moe(root, f) for f in ("qwen3_moe", "qwen2_moe")}


def test_transformers_writes_one_tensor_per_expert(moe_dirs):
    names = set(load_file(moe_dirs["qwen3_moe"] / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names          # mlp_only_layers: dense
    assert not any(n.endswith("experts.gate_up_proj") for n in names)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_logits_match_at_prefill_and_every_decode_step(moe_dirs, family):
    folder = moe_dirs[family]
    llm = LLM(str(folder), block_size=4)
    seen = record_logits(llm)
    outs = llm.generate(PROMPTS[:4], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ref = hf_model(folder)
    for out in outs:
        with torch.no_grad():
            ref_logits = ref(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0]
        n0 = len(out.prompt_token_ids)
        assert len(seen[out.request_id]) == 6
        for i, got in enumerate(seen[out.request_id]):
            torch.testing.assert_close(got, ref_logits[n0 - 1 + i], atol=1e-4, rtol=0)


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_matches_transformers_generate(moe_dirs, batch):
    folder = moe_dirs["qwen3_moe"]
    llm = LLM(str(folder), block_size=8, enable_prefix_caching=False)
    ref = hf_model(folder)
    outs = llm.generate(PROMPTS[:batch], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS[:batch], outs):
        assert out.token_ids == hf_greedy(ref, prompt, 12)


def test_fused_expert_tensors_load(moe_dirs, tmp_path):
    """transformers' in-memory layout (experts.gate_up_proj [E, 2I, H]) loads like the split one."""
    ref = hf_model(moe_dirs["qwen3_moe"])
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    (tmp_path / "config.json").write_text((moe_dirs["qwen3_moe"] / "config.json").read_text())
    save_file(state, str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path).forward_dense(ids), ref(ids).logits, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- LLaDA2 layout

LLADA2 = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "hidden_size": 64,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "intermediate_size": 96, "moe_intermediate_size": 24, "num_experts": 8, "num_experts_per_tok": 2,
    "n_group": 4, "topk_group": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 600000,
    "partial_rotary_factor": 0.5, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "router_dtype": "fp32",
    "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, "tie_word_embeddings": False,
    "vocab_size": VOCAB, "pad_token_id": 2, "hidden_act": "silu",
}


def llada2_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the names of the LLaDA2 HF release."""
    g = torch.Generator().manual_seed(seed)
    h, hd, i, mi, e = (cfg[k] for k in ("hidden_size", "head_dim", "intermediate_size",
                                        "moe_intermediate_size", "num_experts"))
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    rand = lambda *shape, std=0.08: torch.randn(*shape, generator=g) * std  # noqa: E731
    w = {"model.word_embeddings.weight": rand(cfg["vocab_size"], h, std=0.5),
         "model.norm.weight": 1 + rand(h), "lm_head.weight": rand(cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w.update({p + "input_layernorm.weight": 1 + rand(h), p + "post_attention_layernorm.weight": 1 + rand(h),
                  p + "attention.query_key_value.weight": rand(qkv, h, std=0.2),
                  p + "attention.query_layernorm.weight": 1 + rand(hd),
                  p + "attention.key_layernorm.weight": 1 + rand(hd),
                  p + "attention.dense.weight": rand(h, cfg["num_attention_heads"] * hd)})
        mlps = [(p + "mlp.", i)] if n < cfg["first_k_dense_replace"] else \
            [(p + f"mlp.experts.{x}.", mi) for x in range(e)] + [(p + "mlp.shared_experts.", mi)]
        for prefix, width in mlps:
            w.update({prefix + "gate_proj.weight": rand(width, h), prefix + "up_proj.weight": rand(width, h),
                      prefix + "down_proj.weight": rand(h, width)})
        if n >= cfg["first_k_dense_replace"]:
            w[p + "mlp.gate.weight"] = rand(e, h, std=0.5)
            w[p + "mlp.gate.expert_bias"] = rand(e, std=0.3)
    return w


def llada2_reference(w: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] for one sequence, causal, from the raw tensors (brief §1.5 semantics)."""
    nh, nkv, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    t = len(ids)
    rot = int(hd * cfg["partial_rotary_factor"])
    freqs = torch.outer(torch.arange(t).float(),
                        1 / cfg["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot))
    cos, sin = torch.cat([freqs, freqs], -1).cos()[:, None], torch.cat([freqs, freqs], -1).sin()[:, None]

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x):        # rotate-half on the first `rot` dims of each head, the rest passes
        r, rest = x[..., :rot], x[..., rot:]
        rotated = torch.cat([-r[..., rot // 2:], r[..., :rot // 2]], -1)
        return torch.cat([r * cos + rotated * sin, rest], -1)

    def mlp(prefix):
        return lambda xt: swiglu(xt, w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"],
                                 w[prefix + "down_proj.weight"])

    spec = MoESpec(num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
                   intermediate_size=cfg["moe_intermediate_size"], scoring=cfg.get("score_function", "sigmoid"),
                   norm_topk_prob=True, routed_scaling_factor=cfg["routed_scaling_factor"],
                   num_groups=cfg["n_group"], topk_groups=cfg["topk_group"])
    shared = cfg.get("num_shared_experts", 0)
    x = w["model.word_embeddings.weight"][ids]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        qkv = (rms(x, w[p + "input_layernorm.weight"]) @ w[p + "attention.query_key_value.weight"].T).view(t, -1, hd)
        q = rope(rms(qkv[:, :nh], w[p + "attention.query_layernorm.weight"]))
        k = rope(rms(qkv[:, nh:nh + nkv], w[p + "attention.key_layernorm.weight"])).repeat_interleave(nh // nkv, 1)
        v = qkv[:, nh + nkv:].repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        o = torch.einsum("hqk,khd->qhd", att.masked_fill(~causal, float("-inf")).softmax(-1), v)
        x = x + o.reshape(t, -1) @ w[p + "attention.dense.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        if n < cfg["first_k_dense_replace"]:
            x = x + torch.stack([mlp(p + "mlp.")(ht) for ht in h])
        else:
            x = x + naive_moe(h, spec, w[p + "mlp.gate.weight"], lambda e, xt: mlp(p + f"mlp.experts.{e}.")(xt),
                              shared=mlp(p + "mlp.shared_experts.") if shared else None,
                              expert_bias=w[p + "mlp.gate.expert_bias"])
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def write_checkpoint(folder: Path, cfg: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def merge_experts(tensors: dict, cfg: dict) -> dict:
    """The VeOmni/dFactory training layout: experts.{gate,up,down}_proj stacked [E, ...]."""
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for n in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"]):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            p = f"model.layers.{n}.mlp.experts."
            out[p + proj] = torch.stack([tensors[f"{p}{e}.{proj}.weight"] for e in range(cfg["num_experts"])])
    return out


@pytest.mark.parametrize("layout", ["per_expert", "merged"])
def test_llada2_layout_equals_reference(tmp_path, layout):
    tensors = llada2_tensors(LLADA2)
    stored = tensors if layout == "per_expert" else merge_experts(tensors, LLADA2)
    model = load_model(write_checkpoint(tmp_path / layout, LLADA2, stored))
    assert model.config["partial_rotary_factor"] == 0.5 and "block_size" not in model.config
    assert type(model.model.layers[0].mlp).__name__ == "MLP"
    assert type(model.model.layers[1].mlp).__name__ == "SparseMoE"
    ids = torch.randint(0, VOCAB, (1, 33))
    ref = llada2_reference(tensors, LLADA2, ids[0])
    torch.testing.assert_close(model.forward_dense(ids)[0], ref, atol=1e-4, rtol=1e-4)


def test_the_shipped_stories_clover_equals_the_reference():
    """The built-in block-diffusion MoE (LLaDA2-MoE layout, softmax routing, 32 experts, 2 a
    token, no shared expert) read by the loader computes the reference's logits from its raw
    tensors: expert routing token by token in Python floats."""
    folder = Path(__file__).resolve().parents[2] / "checkpoints" / "stories-clover"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDA2MoeModelLM"] and cfg["score_function"] == "softmax"
    tensors = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    model = load_model(folder)
    assert type(model.model.layers[0].mlp).__name__ == "SparseMoE"
    ids = torch.tensor([1, 436, 349, 261, 1005, 28, 319, 397, 262, 3074, 310, 269, 1177, 29, 2111, 16, 1])
    ref = llada2_reference(tensors, cfg, ids)
    torch.testing.assert_close(model.forward_dense(ids[None])[0], ref, atol=2e-4, rtol=2e-4)


def test_llada2_generates_through_the_engine(tmp_path):
    folder = write_checkpoint(tmp_path / "llada2", LLADA2, llada2_tensors(LLADA2))
    write_tokenizer(folder)
    out = LLM(str(folder)).generate([[1, 5, 9]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    ref = llada2_reference(llada2_tensors(LLADA2), LLADA2, torch.tensor([1, 5, 9]))
    assert out[0].token_ids[0] == ref[-1].argmax().item()


# ---------------------------------------------------------------- broken checkpoints

def test_missing_expert_tensor_is_named(tmp_path):
    tensors = llada2_tensors(LLADA2)
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    folder = write_checkpoint(tmp_path / "broken", LLADA2, tensors)
    with pytest.raises(CheckpointError, match=r"broken.*model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        load_model(folder)


def test_misshapen_expert_tensor_names_file_and_tensor(tmp_path):
    tensors = llada2_tensors(LLADA2)
    tensors["model.layers.1.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 23)
    folder = write_checkpoint(tmp_path / "misshapen", LLADA2, tensors)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: model\.layers\.1\.mlp\.experts\.3\.down_proj"
                                              r"\.weight: shape mismatch"):
        load_model(folder)


# ---------------------------------------------------------------- parameter report

def _hf_count(cls_cfg, cls_model, **kw) -> tuple[dict, int]:
    model = cls_model(cls_cfg(**kw))
    n = sum(p.numel() for p in model.parameters())
    n += sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
    return json.loads(model.config.to_json_string()), n


TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100)


@pytest.mark.parametrize("family,extra", [
    ("Llama", dict(tie_word_embeddings=True)),
    ("Llama", dict(attention_bias=True, mlp_bias=True)),
    ("Qwen2", dict(tie_word_embeddings=False)),
    ("Qwen3", dict(head_dim=16)),
    ("Qwen3Moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[0])),
    ("Qwen2Moe", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                      shared_expert_intermediate_size=12, decoder_sparse_step=2)),
    ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    ("DeepseekV3", dict(moe_intermediate_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                        topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)),
])
def test_total_equals_the_transformers_model(family, extra):
    cfg, real = _hf_count(getattr(transformers, f"{family}Config"),
                          getattr(transformers, f"{family}ForCausalLM"), **{**TINY, **extra})
    report = param_report(cfg)
    assert report.total == real and report.note == ""
    if not report.num_moe_layers:
        assert report.active == report.total
    assert report.tied_embeddings == cfg["tie_word_embeddings"]
    assert report.lm_head == (0 if cfg["tie_word_embeddings"] else 100 * 32)


def test_moe_active_by_hand():
    cfg, real = _hf_count(transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, **TINY, head_dim=16,
                          num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[0])
    r = param_report(cfg)
    one_expert = 3 * 32 * 8
    assert (r.num_moe_layers, r.num_experts, r.experts_per_token) == (2, 6, 2)
    assert r.active == real - 2 * (6 - 2) * one_expert
    assert r.active_ratio == pytest.approx(r.active / real)


def test_llada2_total_equals_our_model_and_published_sizes():
    from leapfrog.models.llada2_moe import LLaDA2MoeModelLM
    with torch.device("meta"):
        model = LLaDA2MoeModelLM(LLADA2)
    assert param_report(LLADA2).total == sum(p.numel() for p in model.parameters())
    # Published: LLaDA2.0-mini 16B total / 1.4B active; Qwen3-30B-A3B 30.5B / 3.3B.
    mini = {**LLADA2, "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120, "moe_intermediate_size": 512,
            "num_experts": 256, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "vocab_size": 157184}
    r = param_report(mini)
    assert r.total / 1e9 == pytest.approx(16, abs=0.5) and r.active / 1e9 == pytest.approx(1.4, abs=0.05)
    qwen = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                vocab_size=151936, tie_word_embeddings=False)
    r = param_report(qwen)
    assert r.total / 1e9 == pytest.approx(30.5, abs=0.05) and r.active / 1e9 == pytest.approx(3.3, abs=0.1)


def test_info_cli(moe_dirs, capsys):
    from leapfrog.cli import main
    assert main(["info", str(moe_dirs["qwen3_moe"]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architecture"] == "Qwen3MoeForCausalLM" and out["num_moe_layers"] == 2
    assert out["total"] == sum(p.numel() for p in hf_model(moe_dirs["qwen3_moe"]).parameters())
    assert main(["info", str(moe_dirs["qwen2_moe"] / "config.json")]) == 0
    table = capsys.readouterr().out
    assert "active per token" in table and "8 experts, top 2, shared expert width 48" in table
    assert main(["info", "no-such-model"]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_info_names_a_config_that_is_no_json_object(tmp_path, capsys):
    from leapfrog.cli import main
    for text, why in (("[1, 2]", "must hold a JSON object, not list"), ("{oops", "not valid JSON")):
        (tmp_path / "config.json").write_text(text)
        assert main(["info", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err


# ---------------------------------------------------------------- training an MoE

MOE_SHAPE = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                 max_position=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def test_moe_training_lowers_the_loss_with_the_balancing_term():
    from leapfrog.train.loop import ModelShape, build_model, loss_on, make_optimizer
    from leapfrog.train.recipes import tiny
    torch.manual_seed(0)
    model = build_model(ModelShape(**MOE_SHAPE), vocab_size=64)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    opt = make_optimizer(model, tiny())
    x = torch.randint(0, 64, (4, 17))
    losses = []
    for _ in range(20):
        loss = loss_on(model, x[:, :-1], x[:, 1:], "fp32")
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] - 1.0
    with torch.no_grad():       # training adds the load-balancing term; evaluation does not
        model.eval()
        ce = loss_on(model, x[:, :-1], x[:, 1:], "fp32").item()
        model.train()
        assert loss_on(model, x[:, :-1], x[:, 1:], "fp32").item() > ce


def test_moe_recipe_exports_a_folder_both_engines_read_alike(tmp_path, monkeypatch):
    from leapfrog.data import corpus as data
    from leapfrog.train.export import verify_sha256sums
    from leapfrog.train.loop import ModelShape, train
    from leapfrog.train.recipes import RECIPES, tiny
    monkeypatch.setattr(data, "CACHE_DIR", tmp_path / "cache")
    recipe = RECIPES["stories-moe"]()
    assert (recipe.name, recipe.tokenizer) == ("stories", RECIPES["stories"]().tokenizer)
    report = param_report({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                           "vocab_size": recipe.tokenizer.vocab_size, "hidden_size": 256,
                           "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "head_dim": 64, "intermediate_size": 704, "num_experts": 8,
                           "num_experts_per_tok": 2, "moe_intermediate_size": 192, "tie_word_embeddings": True})
    assert 6e6 < report.total < 10e6 and 3e6 < report.active < 5e6

    cfg = tiny("stories", tmp_path / "out", tmp_path / "run")
    cfg.model, cfg.max_steps, cfg.recipe = ModelShape(**MOE_SHAPE), 4, "stories-moe"
    summary = train(cfg)
    folder = Path(cfg.out_dir)
    from leapfrog.train.check import CheckResult
    from leapfrog.train.readme import render
    text = render(summary, CheckResult("stories"), folder)
    assert "Qwen3MoeForCausalLM" in text and "4 SwiGLU experts of width 16, 2 per token" in text
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert verify_sha256sums(folder) == []
    ours, ref = load_model(folder), hf_model(folder)
    ids = torch.randint(0, 400, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_dense(ids), ref(ids).logits, atol=1e-4, rtol=0)
    out = LLM(str(folder)).generate([[1, 5, 9]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(ref, [1, 5, 9], 8)
