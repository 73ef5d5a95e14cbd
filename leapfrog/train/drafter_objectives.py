"""Drafter distillation objectives (DFlash; DSpark; the DeepSpec reference code): the pieces
`leapfrog train drafter` is built from. No loop here: leapfrog.train.drafter feeds the target's
features and logits on regenerated text through these.

Conventions: draft j (1-based) of a block anchored at position a predicts the token at a + j,
for both drafters (DFlash reads it from slot j, DSpark from slot j-1).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from leapfrog.models.dflash import DFlashDraftModel, DraftContext
from leapfrog.models.dflash_heads import ConfidenceHead, MarkovHead


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """Up to `num_anchors` random positions whose token and next token are both supervised
    (DeepSpec's common.py), sorted."""
    ok = loss_mask[:-1].bool() & loss_mask[1:].bool()
    candidates = ok.nonzero().squeeze(-1)
    if candidates.numel() > num_anchors:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        candidates = candidates[pick]
    return candidates.sort().values


def block_labels(token_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 num_draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [A, γ] (token at anchor + j) and valid [A, γ]: a draft is supervised only while
    it extends a contiguous supervised prefix (DeepSpec's eval_mask cumprod)."""
    pos = anchors.unsqueeze(1) + torch.arange(1, num_draft + 1)
    inside = pos < token_ids.numel()
    safe = pos.clamp(max=token_ids.numel() - 1)
    valid = (inside & loss_mask[safe].bool()).to(torch.int64).cumprod(1).bool()
    return token_ids[safe], valid


def position_weights(num_draft: int, decay: float) -> torch.Tensor:
    """w_k = exp(-(k-1)/decay), k = 1..γ. The DFlash paper uses decay = γ (7 for B = 16);
    DeepSpec's code uses decay 4 with block 7."""
    return torch.tensor([math.exp(-k / decay) for k in range(num_draft)])


def _weighted_mean(per_pos: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    w = weights.to(per_pos.device).unsqueeze(0) * valid
    return (per_pos * w).sum() / w.sum().clamp(min=1e-9)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """Position-decayed cross-entropy (DFlash Eq. 4 as NeMo reproduces it)."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    return _weighted_mean(ce.view_as(labels), valid, weights)


def dspark_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, conf_logits: torch.Tensor | None,
                labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
                mix: tuple[float, float, float] = (0.1, 0.9, 1.0)) -> dict[str, torch.Tensor]:
    """L = 0.1 CE + 0.9 TV + 1.0 BCE(c, c*) (DSpark Eq. 9-12), with c* = 1 - ½‖p_d - p_t‖₁
    (Eq. 8) at T = 1, detached. draft_logits are the Markov-corrected, teacher-forced ones."""
    p_d, p_t = draft_logits.float().softmax(-1), target_logits.float().softmax(-1)
    l1 = (p_d - p_t).abs().sum(-1)
    parts = {"ce": dflash_loss(draft_logits, labels, valid, weights),
             "tv": _weighted_mean(l1, valid, weights)}
    if conf_logits is not None:
        c_star = (1 - 0.5 * l1).clamp(0, 1).detach()
        bce = F.binary_cross_entropy_with_logits(conf_logits.float(), c_star, reduction="none")
        parts["conf"] = _weighted_mean(bce, valid, weights)
    parts["loss"] = sum(m * parts[k] for m, k in zip(mix, ("ce", "tv", "conf")) if k in parts)
    return parts


def teacher_forced_heads(base_logits: torch.Tensor, hidden: torch.Tensor, prev_ids: torch.Tensor,
                         markov: MarkovHead | None, conf: ConfidenceHead | None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sequential stage with ground truth as x_{k-1} (prev_ids [A, γ] = [anchor, labels[:-1]]):
    corrected logits [A, γ, V] and confidence logits [A, γ] (pre-sigmoid, for BCE)."""
    state, rows, confs = None, [], []
    for k in range(base_logits.shape[1]):
        h, row, e = hidden[:, k], base_logits[:, k], None
        if markov is not None:
            bias, e, state = markov.step(prev_ids[:, k], h, state)
            row = row + bias
        if conf is not None:
            z = h if conf.proj.in_features == h.shape[-1] else torch.cat([h, e], dim=-1)
            confs.append(conf.proj.forward(z).squeeze(-1))
        rows.append(row)
    return torch.stack(rows, 1), (torch.stack(confs, 1) if confs else None)


def forward_blocks(model: DFlashDraftModel, features: torch.Tensor, embed: torch.Tensor,
                   token_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Training forward over many blocks of one sequence: features [T, m·d] of the target's
    taps, embed = the target's (frozen) embedding table. Block i sees context positions
    < anchors[i] and its own block (DFlash's attention mask). Returns the draft slots' hidden [A, γ, d]."""
    cfg = model.drafter
    full = DraftContext(0)
    model.extend_context(full, features)
    contexts = [DraftContext(0, [k[:a] for k in full.keys], [v[:a] for v in full.values])
                for a in anchors.tolist()]
    ids = torch.full((anchors.numel(), cfg.block_size), cfg.mask_token_id, dtype=torch.long)
    ids[:, 0] = token_ids[anchors]
    hidden = model.forward(F.embedding(ids, embed), anchors, contexts)
    return hidden[:, cfg.block_size - cfg.num_draft_tokens:]


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, num_bins: int = 10) -> float:
    """ECE with equal-width bins: Σ_b |B_b|/N · |mean(p) - mean(label)| over bin b."""
    bins = (probs.clamp(0, 1 - 1e-9) * num_bins).long()
    total, n = 0.0, probs.numel()
    for b in range(num_bins):
        sel = bins == b
        if bool(sel.any()):
            total += float(sel.sum()) / n * abs(float(probs[sel].mean() - labels[sel].float().mean()))
    return total


def fit_sequential_temperatures(conf_logits: torch.Tensor, survived: torch.Tensor,
                                grid: torch.Tensor | None = None) -> list[float]:
    """Sequential Temperature Scaling (DSpark §3.2.1): for k = 1..γ left to right,
    pick T_k minimising the ECE of the survival Π_{i<=k} σ(z_i / T_i) against the realised
    prefix label survived[:, k] (all drafts 1..k accepted), earlier T_i held fixed.
    conf_logits [N, γ] pre-sigmoid; returns γ temperatures (order-preserving per position)."""
    grid = grid if grid is not None else torch.logspace(-1, 1, 41)
    temps: list[float] = []
    prefix = torch.ones(conf_logits.shape[0])
    for k in range(conf_logits.shape[1]):
        errors = [expected_calibration_error(prefix * torch.sigmoid(conf_logits[:, k] / t), survived[:, k])
                  for t in grid.tolist()]
        best = grid[int(torch.tensor(errors).argmin())].item()
        temps.append(best)
        prefix = prefix * torch.sigmoid(conf_logits[:, k] / best)
    return temps
