"""Block-diffusion objectives: turn an AR Llama into a block-diffusion LM, then post-train it for
multi-block decoding (BD3-LM, Arriola et al. 2025; SDAR; Fast-dLLM v2; MBD-LMs).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from leapfrog.train.precision import autocast

SINGLE, MULTI = 0, 1      # view kinds


@dataclass(slots=True)
class DiffusionSpec:
    block_size: int = 4
    shift: bool = True              # Fast-dLLM v2 token shift (see module doc)
    eps: float = 1e-3               # p = (1 - eps) t + eps for single-block views
    complementary: bool = True      # pair each training single-block view with its complement
    multi_views: int = 0            # MultiTF views per training row (0: single-block TF only)
    multi_weight: float = 0.0       # loss = (1 - w) single + w multi
    max_group: int = 4              # G_max: blocks per MultiTF group, 2..G_max
    t_low: float = 1e-3             # chain-uniform range (MBD Table 5)
    t_high: float = 1.0
    margin: float = 0.01            # rho in t_eff = t_high - rho (t_high - t_low)
    eval_multi_views: int = 2       # validation measures both losses, whatever the training mix
    # Two-stream model (train.mask_stream): known tokens run the frozen parent causally, mask
    # tokens a trained mask stream block-causally.
    mask_stream: bool = False


# ---------------------------------------------------------------------------------------------
# Layouts and noise (numpy, drawn from the loop's per-step generator, so a resume is exact)


def group_layout(num_blocks: int, max_group: int, rng: np.random.Generator) -> np.ndarray:
    """Group id per block for one MultiTF view (MBD §B.1): half the time a systematic layout
    (boundaries every g blocks, shifted by h), else consecutive groups of sizes ~ U{2..G_max}."""
    if rng.random() < 0.5:
        g = int(rng.integers(2, max_group + 1))
        h = int(rng.integers(0, g))
        return (np.arange(num_blocks) + g - h) // g
    sizes = rng.integers(2, max_group + 1, size=num_blocks)
    return np.repeat(np.arange(num_blocks), sizes)[:num_blocks]


def single_masks(num_blocks: int, block_size: int, eps: float, rng: np.random.Generator) -> np.ndarray:
    """[L] bool: per block t ~ U(0,1), each token masked with p = (1-eps) t + eps."""
    p = (1 - eps) * rng.random(num_blocks) + eps
    return (rng.random((num_blocks, block_size)) < p[:, None]).reshape(-1)


def chain_masks(groups: np.ndarray, block_size: int, spec: DiffusionSpec,
                rng: np.random.Generator) -> np.ndarray:
    """[L] bool: MBD's chain-uniform noise, ceil(B t_j) masked positions in block j."""
    t_eff = spec.t_high - spec.margin * (spec.t_high - spec.t_low)
    ratios = np.empty(len(groups))
    floor = 0.0
    for k in range(len(groups)):
        if k == 0 or groups[k] != groups[k - 1]:
            floor = rng.uniform(spec.t_low, t_eff)
        floor = rng.uniform(floor, t_eff)
        ratios[k] = floor
    counts = np.ceil(block_size * ratios).clip(1, block_size)
    rank = rng.random((len(groups), block_size)).argsort(1).argsort(1)   # a random order per block
    return (rank < counts[:, None]).reshape(-1)


# ---------------------------------------------------------------------------------------------
# One packed row: ids, attention mask, which hidden state predicts which masked token


def attention_mask(groups: list[np.ndarray], block_size: int,
                   masks: list[np.ndarray] | None = None) -> torch.Tensor:
    """[S, S] bool (True = may attend) for ``[view_1 ; ... ; view_V ; clean]``, S = (V+1) L;
    ``groups[v]`` is view v's group id per block (non-decreasing). With ``masks`` (view v's
    masked positions, the two-stream rule of train.mask_stream) a known token of a view and
    every token of the clean copy attend causally instead of to their whole block."""
    num_views, num_blocks = len(groups), len(groups[0])
    view = torch.arange(num_views + 1).repeat_interleave(num_blocks * block_size)
    block = torch.arange(num_blocks).repeat_interleave(block_size).repeat(num_views + 1)
    own = [torch.as_tensor(np.asarray(g)) for g in groups] + [torch.arange(num_blocks)]
    group = torch.cat([g.repeat_interleave(block_size) for g in own])
    # First block of each position's group: groups are runs, so it is where the id first occurs.
    first = torch.cat([torch.searchsorted(g, g).repeat_interleave(block_size) for g in own])
    clean_q, clean_k = (view == num_views)[:, None], (view == num_views)[None, :]
    earlier_or_same = block[None, :] <= block[:, None]
    if masks is not None:
        pos = torch.arange(num_blocks * block_size).repeat(num_views + 1)
        masked = torch.cat([torch.as_tensor(np.asarray(m, dtype=bool)) for m in masks]
                           + [torch.zeros(num_blocks * block_size, dtype=torch.bool)])
        earlier_or_same = earlier_or_same & (masked[:, None] | (pos[None, :] <= pos[:, None]))
    noisy_noisy = ~clean_q & (view[:, None] == view[None, :]) & (group[:, None] == group[None, :]) & earlier_or_same
    noisy_clean = ~clean_q & clean_k & (block[None, :] < first[:, None])
    return noisy_noisy | noisy_clean | (clean_q & clean_k & earlier_or_same)


def predictor_rows(groups: list[np.ndarray], block_size: int, shift: bool) -> np.ndarray:
    """[V, L]: the row of the packed sequence whose hidden state predicts token i of view v
    (-1: none). See the module doc for the shift rule."""
    num_views, length = len(groups), len(groups[0]) * block_size
    i = np.arange(length)
    rows = np.empty((num_views, length), dtype=np.int64)
    for v, g in enumerate(groups):
        if not shift:
            rows[v] = v * length + i
            continue
        g = np.asarray(g)
        same_group = g[np.maximum(i - 1, 0) // block_size] == g[i // block_size]
        rows[v] = np.where(same_group, v * length + i - 1, num_views * length + i - 1)
        rows[v, 0] = -1
    return rows


@dataclass(slots=True)
class DiffusionBatch:
    input_ids: torch.Tensor      # [R, S] views then the clean copy
    position_ids: torch.Tensor   # [R, S] 0..L-1 in every part
    attn_mask: torch.Tensor      # [R, 1, S, S] bool
    src: torch.Tensor            # [N] flat index r * S + s of the hidden state predicting a target
    targets: torch.Tensor        # [N] the clean token at that masked position
    kinds: torch.Tensor          # [N] SINGLE or MULTI


def pack(windows: torch.Tensor, masks: list[list[np.ndarray]], groups: list[list[np.ndarray]],
         kinds: list[int], spec: DiffusionSpec, mask_id: int) -> DiffusionBatch:
    """Rows from windows [R, L] and, per row, each view's mask [L] and groups [K]."""
    rows, length = windows.shape
    size = (len(kinds) + 1) * length
    ids, attn, src, tgt, kind = [], [], [], [], []
    for r in range(rows):
        x0 = windows[r]
        m = torch.as_tensor(np.stack(masks[r]))                                  # [V, L]
        ids.append(torch.cat([torch.where(m, mask_id, x0).reshape(-1), x0]))
        attn.append(attention_mask(groups[r], spec.block_size, masks[r] if spec.mask_stream else None))
        pred = torch.as_tensor(predictor_rows(groups[r], spec.block_size, spec.shift))
        keep = m & (pred >= 0)
        src.append(r * size + pred[keep])
        tgt.append(x0.expand_as(m)[keep])
        kind.append(torch.tensor(kinds).unsqueeze(1).expand_as(m)[keep])
    pos = torch.arange(length).repeat(len(kinds) + 1).expand(rows, size)
    return DiffusionBatch(torch.stack(ids), pos, torch.stack(attn).unsqueeze(1),
                          torch.cat(src), torch.cat(tgt), torch.cat(kind))


def make_batch(windows: torch.Tensor, spec: DiffusionSpec, mask_id: int, rng: np.random.Generator,
               multi_views: int, complementary: bool = True) -> DiffusionBatch:
    """Draw noise for every row: one single-block view (plus its complement) and `multi_views`
    MultiTF views."""
    num_blocks = windows.shape[1] // spec.block_size
    assert num_blocks * spec.block_size == windows.shape[1], "seq_len must be a multiple of block_size"
    num_single = 2 if complementary else 1
    kinds = [SINGLE] * num_single + [MULTI] * multi_views
    masks, groups = [], []
    for _ in range(windows.shape[0]):
        m = single_masks(num_blocks, spec.block_size, spec.eps, rng)
        row_m, row_g = [m, ~m][:num_single], [np.arange(num_blocks)] * num_single
        for _ in range(multi_views):
            g = group_layout(num_blocks, spec.max_group, rng)
            row_m.append(chain_masks(g, spec.block_size, spec, rng))
            row_g.append(g)
        masks.append(row_m)
        groups.append(row_g)
    return pack(windows, masks, groups, kinds, spec, mask_id)


def diffusion_loss(model, batch: DiffusionBatch, dtype: str = "fp32", multi_weight: float = 0.0,
                   mask_id: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked-token CE of a transformers Llama on a packed batch: (loss, parts). Parts hold the
    mean CE of each view kind and the number of targets it had (a kind with none is left out).
    A model with a mask stream (train.mask_stream) runs its two-stream forward (``mask_id``). A
    training MoE adds its router's load-balancing loss (router_aux_loss_coef), as next-token
    training does; the parts report it as ``balance``."""
    balance = model.training and getattr(model.config, "num_experts", 0) > 0 \
        and getattr(model, "mask_stream", None) is None
    with autocast(dtype):
        if getattr(model, "mask_stream", None) is not None:
            # deferred: mask_stream loads only for two-stream models
            from leapfrog.train import mask_stream
            hidden = mask_stream.hidden_states(model, batch.input_ids, batch.position_ids,
                                               batch.attn_mask, mask_id)
        else:
            out = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                              attention_mask=batch.attn_mask, use_cache=False,
                              **({"output_router_logits": True} if balance else {}))
            hidden = out.last_hidden_state
        logits = model.lm_head(hidden.flatten(0, 1)[batch.src])   # only rows that predict a target
    ce = F.cross_entropy(logits.float(), batch.targets, reduction="none")
    terms, parts = {}, {}
    for name, kind in (("single", SINGLE), ("multi", MULTI)):
        sel = batch.kinds == kind
        if sel.any():
            terms[name] = ce[sel].mean()
            parts[name], parts[f"{name}_targets"] = terms[name].item(), int(sel.sum())
    extra = 0.0
    if balance:
        # deferred: transformers is heavy and loads only when an MoE trains
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
        aux = load_balancing_loss_func(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok)
        extra = model.config.router_aux_loss_coef * aux
        parts["balance"] = aux.detach().item()
    if not terms:                                   # nothing masked: zero, still in the graph
        return hidden.sum() * 0.0 + extra, parts
    if len(terms) == 1:
        return next(iter(terms.values())) + extra, parts
    return (1 - multi_weight) * terms["single"] + multi_weight * terms["multi"] + extra, parts


class DiffusionObjective:
    """The loop's objective (see loop.NextToken): windows -> noisy packed batch -> masked CE."""

    def __init__(self, spec: DiffusionSpec, mask_id: int) -> None:
        self.spec, self.mask_id = spec, mask_id

    def batch(self, x: torch.Tensor, y: torch.Tensor, rng: np.random.Generator, train: bool = True):
        """Training follows the spec; validation always draws a complementary pair and
        `eval_multi_views` MultiTF views, so every recipe's numbers compare."""
        if train:
            return make_batch(x, self.spec, self.mask_id, rng, self.spec.multi_views, self.spec.complementary)
        return make_batch(x, self.spec, self.mask_id, rng, self.spec.eval_multi_views, True)

    def loss(self, model, batch: DiffusionBatch, dtype: str) -> tuple[torch.Tensor, dict[str, float]]:
        return diffusion_loss(model, batch, dtype, self.spec.multi_weight, self.mask_id)


# ---------------------------------------------------------------------------------------------
# Export contract and a slow reference decoder (READMEs; the engine's `diffusion` method is the
# fast one)


def contract(spec: DiffusionSpec, mask_id: int) -> dict:
    """config.json keys that tell a decoder how this model was trained."""
    keys = {"block_size": spec.block_size, "mask_token_id": mask_id, "diffusion_logit_shift": spec.shift}
    if spec.mask_stream:
        keys["diffusion_mask_stream"] = True
    return keys


def block_causal_mask(length: int, block_size: int) -> torch.Tensor:
    """[1, 1, T, T] bool: bidirectional inside a block, causal across blocks (absolute grid)."""
    block = torch.arange(length) // block_size
    return (block[None, :] <= block[:, None])[None, None]


@torch.no_grad()
def reference_decode(model, prompt_ids: list[int], cfg: dict, max_new_tokens: int,
                     threshold: float = 0.9, eos_id: int | None = None) -> tuple[list[int], int]:
    """Single-block decoding by full recompute: (new token ids, forwards). Each forward runs the
    whole canvas (prefix + current block, block-causal), predicts every masked position (shifted
    per the config), commits those whose top probability exceeds `threshold`, or when none does
    the leftmost masked one (the engine's default floor); a block ends when it has no mask,
    decoding when a block holds the eos."""
    bs, mask_id, shift = cfg["block_size"], cfg["mask_token_id"], cfg["diffusion_logit_shift"]
    ids, forwards, n0 = list(prompt_ids), 0, len(prompt_ids)
    while len(ids) - n0 < max_new_tokens and (eos_id is None or eos_id not in ids[n0:]):
        start = len(ids)
        ids += [mask_id] * ((start // bs + 1) * bs - start)
        while mask_id in ids[start:]:
            x = torch.tensor([ids])
            if getattr(model, "mask_stream", None) is not None:     # two-stream (train.mask_stream)
                # deferred: mask_stream loads only for two-stream models
                from leapfrog.train import mask_stream
                hidden = mask_stream.hidden_states(model, x, torch.arange(len(ids))[None],
                                                   mask_stream.block_rule_mask(x, bs, mask_id), mask_id)
                logits = model.lm_head(hidden)[0]
            else:
                logits = model(input_ids=x, attention_mask=block_causal_mask(len(ids), bs)).logits[0]
            forwards += 1
            rows = torch.arange(start, len(ids)) - int(shift)
            prob, tok = logits[rows].float().softmax(-1).max(-1)
            masked = torch.tensor(ids[start:]) == mask_id
            prob = torch.where(masked, prob, -1.0)
            commit = masked & (prob > threshold)
            if not commit.any():
                commit[masked.nonzero()[0, 0]] = True
            for j in commit.nonzero().flatten().tolist():
                ids[start + j] = int(tok[j])
    new = ids[n0:n0 + max_new_tokens]
    return (new[:new.index(eos_id) + 1] if eos_id in new else new), forwards


def notes(spec: DiffusionSpec) -> list[str]:
    """README lines that state the objective of a recipe."""
    lines = [f"Block-wise masked diffusion (BD3-LM, Arriola et al. 2025; SDAR; Fast-dLLM v2): "
             f"blocks of {spec.block_size} on the absolute position grid, per block "
             f"t ~ U(0,1) and each token masked with p = (1-{spec.eps}) t + {spec.eps}; "
             f"{'each view paired with its complementary mask; ' if spec.complementary else ''}"
             "a noisy block attends to itself (bidirectionally) and to the clean blocks before it "
             "(`[x_t ; x_0]` in one pass); loss = mean cross-entropy over masked positions."]
    if spec.shift:
        lines.append("Token shift (Fast-dLLM v2): the token at position i is predicted from the "
                     "hidden state at i-1; the first token of a block from the last position of "
                     "the clean prefix (or, in multi-block decoding, of the still-noisy previous "
                     "block of the same group).")
    if spec.mask_stream:
        lines.append("Two-stream model (`leapfrog.train.mask_stream`): every known token runs the "
                     "frozen AR parent (these weights' ordinary Llama tensors) with causal attention, "
                     "every mask token runs the mask stream (`mask_stream.*`: its own layers, final "
                     "norm and input vector) and attends to its whole block; only the mask stream "
                     "trains. Decoding at threshold 1.0 is then exactly the parent's greedy text. "
                     "transformers loads the folder as the parent alone (it ignores the "
                     "`mask_stream.*` tensors); leapfrog's `diffusion` method runs both streams.")
    if spec.multi_views:
        lines.append(f"Multi-block teacher forcing (MBD-LMs' MultiTF): {spec.multi_views} extra "
                     f"view{'s' if spec.multi_views > 1 else ''} per window whose blocks form groups of 2..{spec.max_group} "
                     "(systematic or random layouts), chain-uniform noise (later blocks of a group "
                     "noisier), each group seeing the clean blocks before it and the same-or-earlier "
                     f"noisy blocks of its group; loss = {1 - spec.multi_weight:g} x single-block + "
                     f"{spec.multi_weight:g} x multi-block.")
    return lines

