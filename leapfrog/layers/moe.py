"""Mixture-of-experts feed-forward (Shazeer et al. 2017) for any decoder model.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from leapfrog.layers import parallel as tp
from leapfrog.layers.linear import Linear, PackedLinear, default_weight_loader


@dataclass(slots=True, frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int                 # width of one routed expert
    scoring: str = "softmax"               # "softmax" or "sigmoid"
    norm_topk_prob: bool = False           # renormalise the chosen weights to sum to 1
    routed_scaling_factor: float = 1.0
    num_groups: int = 1                    # n_group: experts split into this many groups ...
    topk_groups: int = 1                   # ... of which topk_group are kept per token
    score_bias: bool = False               # per-expert selection bias (not in the weights)
    router_bias: bool = False              # bias of the router Linear itself
    shared_intermediate_size: int = 0      # always-on shared expert width (0: none)
    shared_gate: bool = False              # Qwen2-MoE: sigmoid(Linear(H, 1)) scales the shared expert


def num_experts(cfg: dict) -> int:
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)


def moe_spec(cfg: dict) -> MoESpec | None:
    """The MoE feed-forward that config.json describes (None for a dense model)."""
    n = num_experts(cfg)
    if not n:
        return None
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]   # Mixtral: no moe_ key
    scoring = cfg.get("score_function") or cfg.get("scoring_func") or "softmax"
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported MoE scoring function {scoring!r} (softmax, sigmoid)")
    shared = cfg.get("shared_expert_intermediate_size") or 0
    num_shared = cfg.get("num_shared_experts") or cfg.get("n_shared_experts") or 0
    return MoESpec(
        num_experts=n, top_k=int(cfg["num_experts_per_tok"]), intermediate_size=int(width),
        scoring=scoring, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
        # DeepSeek-V3 always has the bias; transformers 5 no longer writes its topk_method.
        score_bias=bool(cfg.get("moe_router_enable_expert_bias") or cfg.get("topk_method") == "noaux_tc"
                        or cfg.get("model_type") == "deepseek_v3"),
        shared_intermediate_size=int(shared or num_shared * width), shared_gate=bool(shared))


def is_moe_layer(cfg: dict, layer_idx: int) -> bool:
    """Which layers are sparse: Qwen's `mlp_only_layers` / `decoder_sparse_step`, DeepSeek's and
    LLaDA2's `first_k_dense_replace` (the first k layers stay dense)."""
    if not num_experts(cfg) or layer_idx in (cfg.get("mlp_only_layers") or ()):
        return False
    if layer_idx < (cfg.get("first_k_dense_replace") or 0):
        return False
    return (layer_idx + 1) % (cfg.get("decoder_sparse_step") or 1) == 0


def route(logits: torch.Tensor, spec: MoESpec, score_bias: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (fp32) -> (expert ids [T, k], weights [T, k] fp32)."""
    scores = logits.softmax(-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if score_bias is None else scores + score_bias.float()
    if spec.num_groups > 1:
        t = choice.shape[0]
        grouped = choice.view(t, spec.num_groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = group_scores.topk(spec.topk_groups, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).view(t, -1)
    ids = choice.topk(spec.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * spec.routed_scaling_factor


_EXPERT_NAME = re.compile(r"\.experts\.(?:(\d+)\.)?(gate_up_proj|gate_proj|up_proj|down_proj)(?:\.weight)?$")


def expert_target(name: str) -> tuple[str, object] | None:
    """Checkpoint name -> (stacked parameter name, shard id), or None when not an expert tensor.
    Shard ids: None = the whole stacked tensor; (expert or None for all, "gate" | "up" | "down")."""
    m = _EXPERT_NAME.search(name)
    if m is None:
        return None
    expert, proj = m.group(1), m.group(2)
    stem = name[:m.start()] + ".experts."
    if proj == "gate_up_proj":
        return stem + "gate_up_proj", None
    target = stem + ("down_proj" if proj == "down_proj" else "gate_up_proj")
    if proj == "down_proj" and expert is None:
        return target, None
    return target, (None if expert is None else int(expert), proj[:-5])


class Experts(nn.Module):
    """E SwiGLU experts stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    Under tensor parallelism a rank holds whole experts, E / tp_size of them (expert parallelism
    inside the tensor-parallel group: experts first .. first + num_local - 1); a token's pairs
    with other ranks' experts add nothing here, and the layer's all-reduce sums the ranks."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate = num_experts, intermediate
        self.first, self.num_local = tp.shard(num_experts, "num_experts")
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden, intermediate))
        self._arrived: dict[str, set] = {"gate_up_proj": set(), "down_proj": set()}
        for name, p in (("gate_up_proj", self.gate_up_proj), ("down_proj", self.down_proj)):
            p.weight_loader = self._load
            p.missing_parts = lambda name=name: self._missing(name)

    def _load(self, param: nn.Parameter, tensor: torch.Tensor, shard: object = None) -> None:
        key = "gate_up_proj" if param is self.gate_up_proj else "down_proj"
        experts = range(self.first, self.first + self.num_local)
        local = self.num_local != self.num_experts
        if shard is None:
            if local and tensor.shape[0] == self.num_experts:
                tensor = tensor.narrow(0, self.first, self.num_local)
            target, parts = param.data, {(e, p) for e in experts for p in ("gate", "up", "down")}
        else:
            expert, proj = shard
            if expert is not None and expert not in experts:
                return                    # another tensor-parallel rank's expert
            rows = param.data if proj == "down" else param.data.narrow(
                1, 0 if proj == "gate" else self.intermediate, self.intermediate)
            if expert is None and local and tensor.shape[0] == self.num_experts:
                tensor = tensor.narrow(0, self.first, self.num_local)
            target = rows if expert is None else rows[expert - self.first]
            parts = {(e, proj) for e in (experts if expert is None else [expert])}
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(target.shape)} vs checkpoint {tuple(tensor.shape)}")
        target.copy_(tensor)
        self._arrived[key] |= parts

    def _missing(self, key: str) -> list[str]:
        projs = ("down",) if key == "down_proj" else ("gate", "up")
        return [f"{e}.{p}_proj.weight" for e in range(self.first, self.first + self.num_local) for p in projs
                if (e, p) not in self._arrived[key]]

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids/weights [T, k] -> sum_j weights[:, j] * expert_{ids[:, j]}(x)."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        if self.num_local != self.num_experts:   # this rank's experts only: the others' pairs add 0
            flat = flat - self.first
            mine = (flat >= 0) & (flat < self.num_local)
            weights = weights * mine.view(t, k).to(weights.dtype)
            flat = torch.where(mine, flat, torch.full_like(flat, self.num_local))   # a bucket that never runs
        if t * k <= self.num_local:
            # Few pairs (decode): gathering their k matrices reads no more than all E experts once,
            # and needs no host sync.
            xs = x.unsqueeze(1).expand(t, k, x.shape[-1]).reshape(t * k, -1, 1)
            pick = flat.clamp(max=self.num_local - 1)           # another rank's pair: weight 0
            gate, up = torch.bmm(self.gate_up_proj[pick], xs).squeeze(-1).chunk(2, dim=-1)
            out = torch.bmm(self.down_proj[pick], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        else:
            order = flat.argsort(stable=True)                   # pairs grouped by expert
            counts = torch.bincount(flat, minlength=self.num_local + 1).tolist()
            xs = x.index_select(0, order // k)
            sorted_out = torch.zeros_like(xs)
            start = 0
            for e, n in enumerate(counts[:self.num_local]):
                if n:
                    rows = xs[start:start + n]
                    gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
                    sorted_out[start:start + n] = F.linear(F.silu(gate) * up, self.down_proj[e])
                start += n
            out = torch.empty_like(sorted_out).index_copy_(0, order, sorted_out)
        return (out.view(t, k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(1)


class SharedExpert(nn.Module):
    """SwiGLU MLP with the checkpoint's gate_proj/up_proj packed into one matmul; under tensor
    parallelism split as the dense MLP is (columns of gate/up, rows of down: a partial sum)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        split = tp.tp_size() > 1
        local = tp.shard(intermediate, "shared_expert_intermediate_size")[1]
        self.gate_up_proj = PackedLinear(hidden, {"0": local, "1": local}, column_parallel=split)
        self.down_proj = Linear(local, hidden, parallel="row" if split else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(F.silu(gate).mul_(up))


class Router(nn.Module):
    """weight [E, H] (+ optional bias), and the selection-only `expert_bias` [E]."""

    def __init__(self, hidden: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.router_bias else None
        self.expert_bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.score_bias else None
        for p in self.parameters():
            p.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Logits in fp32 whatever the model dtype: top-k is discontinuous, and bf16 logits flip
        # near-ties (LLaDA2 ships router_dtype fp32 for this reason).
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias)
        return route(logits, self.spec, self.expert_bias)


class SparseMoE(nn.Module):
    """Router + stacked experts (+ shared expert). Module names follow the checkpoints: mlp.gate,
    mlp.experts, and mlp.shared_expert + mlp.shared_expert_gate (Qwen) or mlp.shared_experts
    (DeepSeek, LLaDA2)."""

    def __init__(self, hidden: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.gate = Router(hidden, spec)
        self.experts = Experts(spec.num_experts, hidden, spec.intermediate_size)
        self.shared_name = None
        if spec.shared_intermediate_size:
            self.shared_name = "shared_expert" if spec.shared_gate else "shared_experts"
            setattr(self, self.shared_name, SharedExpert(hidden, spec.shared_intermediate_size))
        self.shared_expert_gate = Linear(hidden, 1) if spec.shared_gate else None
        self.split = tp.tp_size() > 1         # partial sums: this rank's experts and shared columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.gate.forward(flat)
        out = self.experts.forward(flat, ids, weights)
        if self.shared_name:
            shared = getattr(self, self.shared_name).forward(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate.forward(flat)) * shared
            out = out + shared
        if self.split:
            out = tp.all_reduce(out)
        return out.view(*lead, -1)
