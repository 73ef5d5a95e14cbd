"""The lossless acceptance rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023),
shared by every method that verifies drafts (methods/speculative.py and its subclasses, verified
diffusion): accept draft d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection
draw from normalize(max(0, p_j - q_j)); when all survive, draw the bonus token from the last row.
Greedy requests reduce it to "accept while the draft is the target's argmax"."""
from __future__ import annotations

import torch


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` [V] by the exponential race, as Sampler.draw does."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def verify_drafts(p: torch.Tensor, draft_ids: torch.Tensor, q: torch.Tensor | None,
                  generator: torch.Generator | None = None) -> list[int]:
    """The lossless acceptance rule (Leviathan et al. 2023; Chen et al. 2023) for one sequence.

    p: [k+1, V] target distributions (row j: token after d_j); draft_ids: [k];
    q: [k, V] draft distributions, or None when the drafts were argmax picks (q one-hot).
    Returns accepted drafts + one token (the residual draw or the bonus): len = accepted + 1.
    """
    k = draft_ids.numel()
    if k == 0:
        return [draw_token(p[0], generator)]
    rows = torch.arange(k, device=p.device)
    px = p[rows, draft_ids]
    qx = q[rows, draft_ids] if q is not None else torch.ones_like(px)
    u = torch.rand(k, generator=generator, device=p.device, dtype=px.dtype)
    ok = u * qx < px                               # u < p/q without dividing by q
    n = int(ok.to(torch.int32).cumprod(0).sum())   # leading run of accepted drafts
    out = draft_ids[:n].tolist()
    if n == k:
        return out + [draw_token(p[k], generator)]
    qn = q[n] if q is not None else torch.zeros_like(p[n]).index_fill_(0, draft_ids[n:n + 1], 1.0)
    residual = (p[n] - qn).clamp_(min=0)
    if float(residual.sum()) <= 1e-12:             # p == q up to rounding: p itself is the residual
        residual = p[n]
    return out + [draw_token(residual, generator)]


def greedy_accept(target_ids: list[int], draft_ids: list[int]) -> list[int]:
    """Greedy special case of verify_drafts: accept while draft == target argmax."""
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_ids[n]:
        n += 1
    return draft_ids[:n] + [target_ids[n]]
