"""DSpark's sequential heads and confidence head (research/speculative.md §2.1-2.2).

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

from leapfrog.layers.linear import Linear


class _Bias(Linear):
    """A Linear with a bias whose parameters load through the default weight loader."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=True)


class MarkovHead(nn.Module):
    """Vanilla: B = W1[x_{k-1}] W2 (rank r). Gated: W2 (g * W1[x]) with g = sigmoid(W_g [h; W1[x]]).
    RNN (Eq. 6): z = [s; W1[x]; h] -> gate, candidate, output; s' = sg*s + (1-sg)*tanh(c);
    B = W2 tanh(o). The split order gate/candidate/output is the brief's reading of DeepSpec."""

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
            return self.markov_w2.forward(e), e, None
        if self.kind == "gated":
            g = torch.sigmoid(self.gate_proj.forward(torch.cat([h, e], dim=-1)))
            return self.markov_w2.forward(g * e), e, None
        s = state if state is not None else h.new_zeros(h.shape[0], self.rank)
        gate, cand, out = self.joint_proj.forward(torch.cat([s, e, h], dim=-1)).chunk(3, dim=-1)
        sg = torch.sigmoid(gate)
        s = sg * s + (1 - sg) * torch.tanh(cand)
        return self.markov_w2.forward(torch.tanh(out)), e, s


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w^T [h_k; W1[x_{k-1}]] + b) (Eq. 7): P(position k survives | k-1 did)."""

    def __init__(self, hidden: int, rank: int, temperatures: list[float] | None = None) -> None:
        super().__init__()
        self.proj = _Bias(hidden + rank, 1)
        # Per-position STS temperatures (brief §2.3) from config key `confidence_temperatures`.
        self.temperatures = list(temperatures or [])

    def forward(self, h: torch.Tensor, e: torch.Tensor | None, position: int = 0) -> torch.Tensor:
        z = h if e is None else torch.cat([h, e], dim=-1)
        t = self.temperatures[position] if position < len(self.temperatures) else 1.0
        return torch.sigmoid(self.proj.forward(z) / t).squeeze(-1)


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
                 choose: Callable[[torch.Tensor], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The γ-step sequential stage (§2.2 inference loop). base_logits [B, γ, V], hidden [B, γ, d],
    choose(logits [B, V]) -> ids [B] (argmax or a seeded draw). Returns drafted ids [B, γ], the
    corrected logits [B, γ, V] (q for verification) and confidences [B, γ] (or None)."""
    prev, state = anchor_ids, None
    ids, logits, confs = [], [], []
    for k in range(base_logits.shape[1]):
        h = hidden[:, k]
        row, e = base_logits[:, k], None
        if markov is not None:
            bias, e, state = markov.step(prev, h, state)
            row = row + bias.float()
        if conf is not None:
            confs.append(conf.forward(h, e if conf.proj.in_features > h.shape[-1] else None, k))
        prev = choose(row)
        ids.append(prev)
        logits.append(row)
    return (torch.stack(ids, 1), torch.stack(logits, 1),
            torch.stack(confs, 1).float() if confs else None)
