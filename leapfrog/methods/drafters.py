"""`dflash` and `dspark`: speculative decoding with a parallel drafter (DFlash: "DFlash: Block
Diffusion for Flash Speculative Decoding", Chen et al. 2026; DSpark).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from leapfrog.layers.parallel import whole
from leapfrog.models.loader import find_drafter, load_drafter
from leapfrog.methods.base import Batch, Commit, ScheduledSeq, StepOutput
from leapfrog.methods.confidence_schedule import StepCostTable
from leapfrog.methods.speculative import Anchor, Proposal, SpeculativeMethod, check_num_speculative_tokens
from leapfrog.sample.rejection import draw_token
from leapfrog.methods.verify import make_policy
from leapfrog.models.dflash import ContextCache, DFlashDraftModel, DraftContext
from leapfrog.models.dflash_heads import sample_block
from leapfrog.sequence import Sequence

if TYPE_CHECKING:
    from leapfrog.methods.base import MethodContext

__all__ = ["DFlashMethod", "DSparkMethod", "load_drafter"]   # load_drafter: re-exported from loader


class DFlashMethod(SpeculativeMethod):
    name = "dflash"
    reads_draft_model = True

    def __init__(self, ctx: "MethodContext", num_speculative_tokens: int | None = None,
                 draft_sampling: str = "argmax", verify: str = "fixed", threshold: float = 0.7,
                 step_costs: dict | None = None, fallback: str = "none",
                 drafter: DFlashDraftModel | None = None, **options: object) -> None:
        if options:
            raise ValueError(f"unknown option(s) for method {self.name!r}: {', '.join(sorted(options))}")
        if draft_sampling not in ("argmax", "sample"):
            raise ValueError(f"draft_sampling={draft_sampling!r}: expected argmax or sample")
        self.draft_sampling = draft_sampling
        policy = make_policy(verify, threshold, step_costs,
                             lambda: StepCostTable.profile(ctx.model, ctx.device, max_tokens=256,
                                                                   step=ctx.timed_step))
        self.context_cache = ContextCache()
        self.drafter = drafter or self._load(ctx, fallback, self.name)
        if self.drafter is None:          # fallback="ar" without a drafter: plain ar decoding
            super().__init__(ctx, 0, fallback, policy)
            return
        cfg = self.drafter.drafter
        gamma = cfg.num_draft_tokens if num_speculative_tokens is None else \
            min(check_num_speculative_tokens(num_speculative_tokens), cfg.num_draft_tokens)
        super().__init__(ctx, gamma, fallback, policy)
        self._check_target(ctx.model)
        self.target = ctx.model
        self.capture_layers = tuple(sorted(set(cfg.target_layer_ids)))
        self._tap_order = [self.capture_layers.index(t) for t in cfg.target_layer_ids]
        if policy.needs_confidence and self.drafter.confidence_head is None:
            raise ValueError(f"verify={verify!r} needs a drafter with a confidence head (dspark)")

    def modules(self) -> list[torch.nn.Module]:
        return [self.drafter] if self.drafter is not None else []

    @staticmethod
    def _load(ctx: "MethodContext", fallback: str, method: str) -> DFlashDraftModel | None:
        """The drafter; when it cannot be found or loaded: with fallback="parallel" the model's
        pure parallel (DFlash) drafter, then with "ar" or "parallel" no drafter at all (ar)."""
        try:
            with whole():                 # every rank runs the whole drafter (replicated)
                return load_drafter(find_drafter(ctx.model_path, method, ctx.draft_model), ctx.device, ctx.dtype)
        except (ValueError, FileNotFoundError) as e:
            if fallback == "none":
                raise
            if fallback == "parallel" and method != "dflash" and not ctx.draft_model:
                try:
                    with whole():
                        drafter = load_drafter(find_drafter(ctx.model_path, "dflash"), ctx.device, ctx.dtype)
                    warnings.warn(f"{e}; drafting with the parallel (dflash) drafter (fallback='parallel')",
                                  stacklevel=3)
                    return drafter
                except (ValueError, FileNotFoundError):
                    pass
            warnings.warn(f"{e}; decoding with ar (fallback={fallback!r})", stacklevel=3)
            return None

    def _check_target(self, model: torch.nn.Module) -> None:
        tcfg, dcfg = model.config, self.drafter.config
        if tcfg["hidden_size"] != self.drafter.target_hidden_size:
            raise ValueError(f"drafter reads features of width {self.drafter.target_hidden_size}; "
                             f"the target's hidden_size is {tcfg['hidden_size']}")
        if self.drafter.lm_head is not None and dcfg.get("vocab_size") != tcfg.get("vocab_size"):
            raise ValueError(f"drafter vocab_size {dcfg.get('vocab_size')} != target {tcfg.get('vocab_size')}")
        bad = [t for t in self.drafter.drafter.target_layer_ids if not 0 <= t < tcfg["num_hidden_layers"]]
        if bad:
            raise ValueError(f"drafter taps target layers {bad}; the target has {tcfg['num_hidden_layers']}")

    def on_finished(self, seq: Sequence) -> None:
        # Stored with its queued rows unprojected: they are projected only if a later request
        # reuses this prefix (ContextCache.get), not for every request that finishes.
        if seq.method_state is not None:
            self.context_cache.put(seq.token_ids, seq.method_state.context)
        super().on_finished(seq)

    # --- drafter hooks --------------------------------------------------------------------
    @torch.inference_mode()
    def observe(self, batch: Batch, out: StepOutput, commits: list[Commit]) -> None:
        if self.drafter is None:
            return
        feats = torch.cat([out.captured[j] for j in self._tap_order], dim=-1)
        row = 0
        for s, c in zip(batch.seqs, commits):
            row += s.num_query
            first = row - s.num_query
            self._queue(s, feats[first:first + c.num_kv_keep])

    def extend_contexts(self, batch: Batch, commits: list[Commit], captured: torch.Tensor) -> None:
        if self.drafter is None:
            return
        if self._tap_order != list(range(captured.shape[2])):      # else the rows are in order: no copy
            captured = captured[:, :, self._tap_order]
        feats = captured.flatten(2)                                  # [B, steps, taps * d]
        for i, (s, c) in enumerate(zip(batch.seqs, commits)):
            self._queue(s, feats[i, :c.num_kv_keep])

    def _context_reaches(self, seq: Sequence, anchor_pos: int) -> bool:
        st = seq.method_state
        ctx = st.context if st is not None else None
        return self.drafter is None or (ctx is not None and ctx.start + ctx.num_positions == anchor_pos)

    def _queue(self, s: ScheduledSeq, rows: torch.Tensor) -> None:
        """Queue the target features of `s`'s newly kept positions for its drafter context."""
        st = self.state(s.seq)
        if st.drafting_off:
            return                        # fallback: this request decodes as ar from now on
        ctx = st.context
        if ctx is None or ctx.start + ctx.num_positions != s.start_pos:
            # First chunk. After a prefix-cache hit the target computes no features for the
            # cached prefix: reuse an earlier sequence's draft K/V for it when there is one
            # (else the drafter sees less context: lower acceptance, never wrong output).
            ctx = (self.context_cache.get(s.seq.token_ids, s.start_pos, self.drafter.flush_contexts)
                   if s.start_pos else None)
            ctx = st.context = ctx or DraftContext(s.start_pos)
        self.drafter.queue_context(ctx, rows)

    @torch.inference_mode()
    def propose(self, anchors: list[Anchor]) -> list[Proposal]:
        # Context rows queued while not drafting: projected now, outside the drafting clock. That
        # work is per row and paid once whenever drafting happens; timed with drafting, the first
        # draft after a long skip would price every later one as dear.
        states = [self.state(a.seq) for a in anchors]
        self.drafter.flush_contexts([st.context for st in states])
        self.policy.begin_drafting()
        cfg, dev = self.drafter.drafter, self.ctx.device
        ids = torch.tensor([[a.token_id] + [cfg.mask_token_id] * (cfg.block_size - 1) for a in anchors],
                           dtype=torch.long, device=dev)
        embeds = self.drafter.embed(ids, self.target)
        pos = torch.tensor([a.pos for a in anchors], dtype=torch.long, device=dev)
        hidden = self.drafter.forward(embeds, pos, [st.context for st in states])
        hidden = hidden[:, cfg.block_size - cfg.num_draft_tokens:][:, :self.num_speculative_tokens]
        base = self.drafter.compute_logits(hidden, self.target)      # [B, γ, V]: the target's LM head
                                                                     # (or a narrow drafter's own)
        seqs = [a.seq for a in anchors]
        temps = [self._draft_temperature(s) for s in seqs]
        # A policy that never reads the confidences (fixed): skip the head (γ small ops per step).
        conf_head = self.drafter.confidence_head if self.policy.needs_confidence else None
        tokens, logits, conf = sample_block(base, hidden, ids[:, 0], self.drafter.markov_head,
                                            conf_head, self._chooser(seqs, temps))
        props = [self._proposal(a, tokens[i], logits[i], temps[i], conf[i] if conf is not None else None)
                 for i, a in enumerate(anchors)]
        return self._verify_lengths(anchors, props, len(anchors))

    def _draft_temperature(self, seq: Sequence) -> float:
        """0 means argmax drafts (q one-hot); argmax proposals keep pure-parallel blocks
        coherent at T > 0 (z-lab DFlash PR #169)."""
        if self.draft_sampling == "argmax" or seq.params.greedy:
            return 0.0
        return seq.params.temperature

    def _chooser(self, seqs: list[Sequence], temps: list[float]):
        if not any(t > 0 for t in temps):
            return None                   # argmax drafts (sample_block may run them as one C++ call)

        def choose(logits: torch.Tensor) -> torch.Tensor:
            ids = logits.argmax(-1)
            for i, (seq, t) in enumerate(zip(seqs, temps)):
                if t > 0:
                    ids[i] = draw_token((logits[i] / t).softmax(-1), seq.generator or self.sampler.generator)
            return ids
        return choose

    @staticmethod
    def _proposal(a: Anchor, tokens: torch.Tensor, logits: torch.Tensor, temp: float,
                  conf: torch.Tensor | None) -> Proposal:
        probs = (logits / temp).softmax(-1) if temp > 0 else None
        confidence = conf.tolist() if conf is not None else None
        return Proposal(a.pos, tokens.tolist(), probs, confidence)


class DSparkMethod(DFlashMethod):
    name = "dspark"
