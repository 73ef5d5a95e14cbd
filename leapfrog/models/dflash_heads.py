"""DSpark's sequential heads and confidence head (the DSpark paper: Markov/RNN head, Eq. 4-7).

After one parallel backbone forward, the block's tokens are drawn left to right:
logits_k = U_k + B_k(x_{k-1}, ...), with x_0 = the anchor (Eq. 4). The per-position logits
stay plain softmaxes, so the corrected logits are the draft distribution q of rejection
sampling. Weight names follow DeepSpec (`markov_head.markov_w1`, `markov_w2`, `gate_proj`,
`joint_proj`, `confidence_head.proj`).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from leapfrog.layers.cpu_kernels import cpu_inference, cpu_kernels
from leapfrog.layers.linear import Linear


class _Bias(Linear):
    """A Linear with a bias whose parameters load through the default weight loader."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=True)


class MarkovHead(nn.Module):
    """Vanilla: B = W1[x_{k-1}] W2 (rank r). Gated: W2 (g * W1[x]) with g = sigmoid(W_g [h; W1[x]]).
    RNN (Eq. 6): z = [s; W1[x]; h] -> gate, candidate, output; s' = sg*s + (1-sg)*tanh(c);
    B = W2 tanh(o). The split order gate/candidate/output follows our reading of DeepSpec's code."""

    def __init__(self, kind: str, hidden: int, vocab: int, rank: int) -> None:
        super().__init__()
        kind = {"markov": "vanilla", "low_rank": "vanilla"}.get(kind, kind)
        if kind not in ("vanilla", "gated", "rnn"):
            raise ValueError(f"markov_head_type {kind!r}: expected vanilla, gated or rnn")
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = Linear(rank, vocab)
        if kind == "gated":
            self.gate_proj = _Bias(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = _Bias(2 * rank + hidden, 3 * rank)

    def step(self, prev_ids: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """prev_ids [B], h [B, d] -> (bias [B, V], W1[prev] [B, r], new RNN state)."""
        e = self.markov_w1.weight[prev_ids]
        if self.kind == "vanilla":
            return self._project(e), e, None
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj.forward(torch.cat([h, e], dim=-1)))
            return self._project(g * e), e, None
        s = state if state is not None else h.new_zeros(h.shape[0], self.rank)
        gate, cand, out = self.joint_proj.forward(torch.cat([s, e, h], dim=-1)).chunk(3, dim=-1)
        sg = torch.sigmoid(gate)
        s = sg * s + (1 - sg) * torch.tanh(cand)
        return self._project(torch.tanh(out)), e, s

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, r] -> x W2^T [B, V]. Outside training, from a transposed copy of W2 ([r, V],
        kept while the weight is unchanged): a few rows against a [V, r] weight with r = 64
        are V short dot products, and the [r, V] layout runs them as one contiguous
        row-times-matrix product."""
        w = self.markov_w2.weight
        if torch.is_grad_enabled() and w.requires_grad:
            return self.markov_w2.forward(x)
        return x.to(w.dtype) @ self._transposed()[0]

    def _transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W2^T [r, V], and the copy the C++ stage reads: float16 when W2 is exactly float16
        (checkpoints stored in float16 are; half the bytes per position), else the same."""
        w = self.markov_w2.weight
        cached = self.__dict__.get("_w2t")
        if cached is None or cached[1] is not w or cached[2] != w._version:
            wt = w.detach().t().contiguous()
            half = wt.half() if wt.dtype == torch.float32 else wt
            kernel = half if wt.dtype == torch.float32 and torch.equal(half.float(), wt) else wt
            cached = self.__dict__["_w2t"] = (wt, w, w._version, kernel)
        return cached[0], cached[3]

    def fused_argmax(self, logits: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor | None:
        """The whole argmax stage of the vanilla head as one C++ call (CPU float32 inference):
        logits [B, γ, V] float32 corrected in place, drafts [B, γ] returned; None where the
        kernel does not apply (other heads, devices, dtypes, autograd)."""
        w1 = self.markov_w1.weight
        if (self.kind != "vanilla" or not logits.is_contiguous() or not cpu_inference(logits, w1)
                or torch.is_grad_enabled() and self.markov_w2.weight.requires_grad):
            return None
        mod = cpu_kernels()
        if mod is None:
            return None
        _, w2t = self._transposed()
        if w2t.dtype not in (torch.float32, torch.float16):
            return None
        return mod.markov_argmax(logits, w1, w2t, anchor_ids, 0)


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w^T [h_k; W1[x_{k-1}]] + b) (Eq. 7): P(position k survives | k-1 did)."""

    def __init__(self, hidden: int, rank: int, temperatures: list[float] | None = None) -> None:
        super().__init__()
        self.proj = _Bias(hidden + rank, 1)
        # Per-position STS temperatures (DSpark's confidence calibration) from config key
        # `confidence_temperatures`.
        self.temperatures = list(temperatures or [])

    def forward(self, h: torch.Tensor, e: torch.Tensor | None, position: int = 0) -> torch.Tensor:
        z = h if e is None else torch.cat([h, e], dim=-1)
        t = self.temperatures[position] if position < len(self.temperatures) else 1.0
        return torch.sigmoid(self.proj.forward(z) / t).squeeze(-1)

    def block(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """All γ positions at once: h [B, γ, d], e [B, γ, r] (W1 of each position's previous
        token) or None -> c [B, γ]; the same numbers as `forward` position by position."""
        z = h if e is None else torch.cat([h, e], dim=-1)
        logit = torch.nn.functional.linear(z, self.proj.weight, self.proj.bias).squeeze(-1)
        g = h.shape[1]
        t = torch.tensor([self.temperatures[k] if k < len(self.temperatures) else 1.0 for k in range(g)],
                         dtype=logit.dtype, device=logit.device)
        return torch.sigmoid(logit / t)


def build_heads(drafter, hidden: int, vocab: int) -> tuple[MarkovHead | None, ConfidenceHead | None]:
    markov = MarkovHead(drafter.markov_head_type, hidden, vocab, drafter.markov_rank) \
        if drafter.markov_rank > 0 else None
    conf = None
    if drafter.enable_confidence_head:
        with_markov = drafter.confidence_head_with_markov and markov is not None
        conf = ConfidenceHead(hidden, drafter.markov_rank if with_markov else 0,
                              drafter.confidence_temperatures)
    return markov, conf


def sample_block(base_logits: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                 markov: MarkovHead | None, conf: ConfidenceHead | None,
                 choose: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The γ-step sequential stage (DSpark's inference loop). base_logits [B, γ, V], hidden [B, γ, d],
    choose(logits [B, V]) -> ids [B] (a seeded draw), or None for argmax drafts. Returns drafted ids [B, γ], the
    corrected logits [B, γ, V] (q for verification) and confidences [B, γ] (or None).

    Only what depends on the token just drawn stays in the loop (the Markov bias and the
    choice); the corrected logits are written in place into one [B, γ, V] tensor, and the
    confidences, which need each position's previous token but feed no later choice, are
    computed for the whole block after it: at γ = 8 and one request the loop's small ops, not
    its arithmetic, are what drafting costs on a CPU."""
    num = base_logits.shape[1]
    logits = base_logits.float().clone() if markov is not None else base_logits.float()
    fused = markov.fused_argmax(logits, anchor_ids) if markov is not None and choose is None else None
    if fused is not None:
        ids = fused
    else:
        choose = choose or (lambda row: row.argmax(-1))
        ids = torch.empty(base_logits.shape[0], num, dtype=torch.long, device=base_logits.device)
        prev, state = anchor_ids, None
        for k in range(num):
            row = logits[:, k]
            if markov is not None:
                bias, _, state = markov.step(prev, hidden[:, k], state)
                row.add_(bias.float())
            prev = choose(row)
            ids[:, k] = prev
    confs = None
    if conf is not None:
        e = None
        if conf.proj.in_features > hidden.shape[-1] and markov is not None:
            e = markov.markov_w1.weight[torch.cat([anchor_ids[:, None], ids[:, :-1]], dim=1)]
        confs = conf.block(hidden, e).float()
    return ids, logits, confs
