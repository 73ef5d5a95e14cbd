"""`dflash` and `dspark`: speculative decoding with a parallel drafter (research/speculative.md).

The drafter (models/dflash.py) is conditioned on the target's hidden states at its tapped
layers: this method asks the runner to capture them (capture_layers), feeds the rows of each
sequence's kept positions to the drafter's per-sequence context cache (observe), and drafts one
block per sequence, batched, after every verify pass (propose). DSpark adds the sequential
Markov/RNN stage and confidence scores; `verify` chooses how many drafts to check:
"fixed" (all γ), "threshold" (the prefix whose cumulative confidence stays >= threshold) or
"confidence" (the brief's Algorithm 1, confidence_schedule.py).
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from leapfrog.loader import (CheckpointError, _check_complete, iter_tensors, read_config,
                             verify_manifest, weight_files)
from leapfrog.layers.linear import default_weight_loader
from leapfrog.methods.base import Batch, Commit, StepOutput
from leapfrog.methods.confidence_schedule import (AcceptanceFeedback, MeasuredCost, StepCostTable,
                                                  schedule_prefix, survival)
from leapfrog.methods.speculative import Anchor, Proposal, SpeculativeMethod, _draw
from leapfrog.models.dflash import ContextCache, DFlashDraftModel, DraftContext
from leapfrog.models.dflash_heads import sample_block
from leapfrog.sequence import Sequence

if TYPE_CHECKING:
    from leapfrog.methods.base import MethodContext

# Frozen copies of the target's tables that DeepSpec checkpoints carry (§2.8): the target's own
# embedding and LM head are used instead.
SHARED_TENSORS = {"embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight"}
VERIFY_MODES = ("fixed", "threshold", "confidence")


def find_drafter(ctx: "MethodContext", method: str = "") -> Path:
    """Where the drafter is: `draft_model` (a folder, a built-in model name, or a variant name
    under the model folder's `drafters/`); else the drafter the model folder's `leapfrog.json`
    names for this method ({"drafters": {"dspark": "drafters/..."}}); else `drafter/`."""
    import json

    model_dir = Path(ctx.model_path)
    if ctx.draft_model:
        variant = model_dir / "drafters" / str(ctx.draft_model)
        if variant.is_dir():
            return variant
        from leapfrog.config import resolve_model
        return resolve_model(ctx.draft_model)
    meta = model_dir / "leapfrog.json"
    if meta.is_file():
        named = (json.loads(meta.read_text()).get("drafters") or {}).get(method)
        if named:
            if not (model_dir / named).is_dir():
                raise ValueError(f"{meta}: drafter {named!r} for method {method!r} is missing")
            return model_dir / named
    folder = model_dir / "drafter"
    if folder.is_dir():
        return folder
    raise ValueError(f"{ctx.model_path}: no drafter for method {method!r}; pass draft_model=<folder> "
                     f"or ship one in {folder}")


def load_drafter(folder: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDraftModel:
    """A z-lab DFlash or DeepSpec DSpark checkpoint folder -> DFlashDraftModel."""
    folder = Path(folder)
    verify_manifest(folder)
    cfg = read_config(folder)
    try:
        with torch.device(device):
            model = DFlashDraftModel(cfg)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{folder / 'config.json'}: {e}") from None
    model.to(dtype)
    params = dict(model.named_parameters())
    files = weight_files(folder)
    loaded: set[str] = set()
    for f, name, tensor in iter_tensors(files):
        name = name.removeprefix("model.") if name.startswith("model.layers.") else name
        if name in SHARED_TENSORS or "rotary_emb" in name:
            continue
        target, shard = name, None
        for src, (dst, shard_id) in model.packed_modules.items():
            if name.startswith("layers.") and f".{src}." in name:   # not markov_head.gate_proj
                target, shard = name.replace(f".{src}.", f".{dst}."), shard_id
                break
        if target not in params:
            raise CheckpointError(f"{f}: unexpected tensor {name} for a {model.drafter.kind} drafter")
        param = params[target]
        try:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor.to(param.dtype), shard)
        except ValueError as e:
            raise CheckpointError(f"{f}: {name}: {e}") from None
        loaded.add(f"{target}:{shard}")
    _check_complete(model, model.packed_modules, loaded, files)
    return model.eval()


class DFlashMethod(SpeculativeMethod):
    name = "dflash"

    def __init__(self, ctx: "MethodContext", num_speculative_tokens: int | None = None,
                 draft_sampling: str = "argmax", verify: str = "fixed", threshold: float = 0.7,
                 step_costs: dict | None = None, fallback: str = "none",
                 drafter: DFlashDraftModel | None = None, **options: object) -> None:
        if options:
            raise ValueError(f"unknown option(s) for method {self.name!r}: {', '.join(sorted(options))}")
        if draft_sampling not in ("argmax", "sample"):
            raise ValueError(f"draft_sampling={draft_sampling!r}: expected argmax or sample")
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: expected one of {', '.join(VERIFY_MODES)}")
        self.draft_sampling, self.verify, self.threshold = draft_sampling, verify, float(threshold)
        self.context_cache = ContextCache()
        self._num_drafts = 0              # drafting calls so far (the first is a warm-up, not timed)
        self._surv_prior: list[float] | None = None   # running average survival row (all requests)
        self._skipped_steps = 0           # consecutive steps that skipped drafting
        self._reprobe_every = self.reprobe_steps     # set per batch size once drafting has paid
        self._waits: dict[int, int] = {}              # batch size -> the wait last set there
        self._decided_batch = -1          # batch size of the last drafting decision
        self._probing = False             # this step drafts only to re-probe: verify >= 1 draft each
        self.step_costs = StepCostTable.from_mapping(step_costs) if step_costs else None
        self.measured: MeasuredCost | None = None     # step and drafting costs as measured
        self._step_end: float | None = None           # when the previous step's verification ended
        self.drafter = drafter or self._load(ctx, fallback, self.name)
        if self.drafter is None:          # fallback="ar" without a drafter: plain ar decoding
            super().__init__(ctx, 0, fallback)
            return
        cfg = self.drafter.drafter
        gamma = cfg.num_draft_tokens if num_speculative_tokens is None else \
            min(int(num_speculative_tokens), cfg.num_draft_tokens)
        super().__init__(ctx, gamma, fallback)
        self._check_target(ctx.model)
        self.target = ctx.model
        self.capture_layers = tuple(sorted(set(cfg.target_layer_ids)))
        self._tap_order = [self.capture_layers.index(t) for t in cfg.target_layer_ids]
        if verify != "fixed" and self.drafter.confidence_head is None:
            raise ValueError(f"verify={verify!r} needs a drafter with a confidence head (dspark)")

    @staticmethod
    def _load(ctx: "MethodContext", fallback: str, method: str) -> DFlashDraftModel | None:
        """The drafter; when it cannot be found or loaded: with fallback="parallel" the model's
        pure parallel (DFlash) drafter, then with "ar" or "parallel" no drafter at all (ar)."""
        try:
            return load_drafter(find_drafter(ctx, method), ctx.device, ctx.dtype)
        except (ValueError, FileNotFoundError) as e:
            if fallback == "none":
                raise
            if fallback == "parallel" and method != "dflash" and not ctx.draft_model:
                try:
                    drafter = load_drafter(find_drafter(ctx, "dflash"), ctx.device, ctx.dtype)
                    warnings.warn(f"{e}; drafting with the parallel (dflash) drafter (fallback='parallel')",
                                  stacklevel=3)
                    return drafter
                except (ValueError, FileNotFoundError):
                    pass
            warnings.warn(f"{e}; decoding with ar (fallback={fallback!r})", stacklevel=3)
            return None

    def _check_target(self, model: torch.nn.Module) -> None:
        tcfg, dcfg = model.config, self.drafter.config
        if tcfg["hidden_size"] != dcfg["hidden_size"]:
            raise ValueError(f"drafter hidden_size {dcfg['hidden_size']} != target {tcfg['hidden_size']}")
        bad = [t for t in self.drafter.drafter.target_layer_ids if not 0 <= t < tcfg["num_hidden_layers"]]
        if bad:
            raise ValueError(f"drafter taps target layers {bad}; the target has {tcfg['num_hidden_layers']}")

    def on_finished(self, seq: Sequence) -> None:
        # Stored with its queued rows unprojected: they are projected only if a later request
        # reuses this prefix (ContextCache.get), not for every request that finishes.
        self.context_cache.put(seq.token_ids, seq.method_state.get("draft_ctx"))
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
            if getattr(s.seq.method_state.get("spec"), "drafting_off", False):
                continue                  # fallback: this request decodes as ar from now on
            ctx: DraftContext | None = s.seq.method_state.get("draft_ctx")
            if ctx is None or ctx.start + ctx.num_positions != s.start_pos:
                # First chunk. After a prefix-cache hit the target computes no features for the
                # cached prefix: reuse an earlier sequence's draft K/V for it when there is one
                # (else the drafter sees less context: lower acceptance, never wrong output).
                ctx = (self.context_cache.get(s.seq.token_ids, s.start_pos, self.drafter.flush_contexts)
                       if s.start_pos else None)
                ctx = s.seq.method_state["draft_ctx"] = ctx or DraftContext(s.start_pos)
            first = row - s.num_query
            self.drafter.queue_context(ctx, feats[first:first + c.num_kv_keep])

    def on_verified(self, batch: Batch) -> None:
        """Confidence scheduling: time the step just verified (from the end of the previous
        step's verification, or of its drafting: scheduling, the forward, sampling,
        verification; not drafting, which is timed on its own) and fit the cost model to it."""
        if self.verify != "confidence":
            return
        now = time.perf_counter()
        if self._step_end is not None and self.measured is not None:
            self.measured.observe(batch.num_tokens, now - self._step_end)
        self._step_end = now

    @torch.inference_mode()
    def propose(self, anchors: list[Anchor]) -> list[Proposal]:
        if self.num_speculative_tokens == 0:
            return [Proposal(a.pos, []) for a in anchors]
        if self.verify != "confidence":
            return self._draft(anchors)
        props = self._draft(anchors) if self._worth_drafting(anchors) else [Proposal(a.pos, []) for a in anchors]
        self._probing = False
        self._step_end = time.perf_counter()      # the next step's clock starts after drafting
        return props

    # A step that decided not to draft re-probes (drafts anyway, to refresh the predictions the
    # decision rests on) after reprobe_steps skipped steps (fewer below 8 requests: _first_wait);
    # each probe that still finds drafting not worth it doubles the wait, up to
    # max_reprobe_steps. A change of batch size re-plans at once (the costs depend on it) but
    # keeps the wait: the predictions a probe refreshes do not depend on the load, and with
    # requests finishing one by one a reset would probe (draft a whole batch for nothing) after
    # every finish.
    reprobe_steps = 16
    max_reprobe_steps = 256
    min_gain = 1.1

    def _worth_drafting(self, anchors: list[Anchor]) -> bool:
        """Decide before drafting (confidence scheduling): drafting costs time whether or not
        its tokens are verified, so under load, where Algorithm 1 would verify few or none, the
        step skips it. A request's survival row from its previous drafts (smoothed), or the
        method's running average for a request that has none yet, stands in for confidences
        not drawn yet; the step drafts when the expected tokens per second of the best schedule
        on those predictions, drafting time included, beat a plain decode step's by min_gain
        (10%: predictions and costs are estimates, and at 8 requests decisions predicted to gain
        ~1% were measured to lose; where drafting pays, at few requests, it gains 30-70%). The decision
        is for the whole batch (drafting's cost is mostly per step, not per request) and, once
        negative, holds while the batch size does, until the next re-probe."""
        if self.measured is None or not self.measured.draft.num_samples or self._surv_prior is None:
            return True                   # nothing measured yet
        batch = len(anchors)
        if batch != self._decided_batch:
            self._decided_batch = batch
            # Back at a batch size seen before: its own wait (with a few requests at the end of
            # a burst drafting pays and the wait restarts short; the next burst would otherwise
            # probe whole batches after 6, 12, 24, ... steps again). First visit: keep the wait.
            self._reprobe_every = self._waits.get(batch, self._reprobe_every)
        elif 0 < self._skipped_steps < self._reprobe_every:
            return self._skip(batch)      # same load, decided already: no need to re-plan
        preds = [a.seq.method_state.get("surv_pred") or self._surv_prior for a in anchors]
        table = self._cost_model()
        overhead = table.draft(batch)
        lengths = schedule_prefix(preds, lambda b: 1.0 / (table.cost(b) + overhead))
        gain = sum(sum(row[:n]) for row, n in zip(preds, lengths))
        with_drafts = (batch + gain) / (table.cost(batch + sum(lengths)) + overhead)
        if with_drafts > self.min_gain * batch / table.cost(batch):
            self._skipped_steps, self._reprobe_every = 0, self._first_wait(batch)
            self._waits[batch] = self._reprobe_every
            return True
        if self._skipped_steps >= self._reprobe_every:      # probe, then wait longer
            self._skipped_steps = 0
            self._reprobe_every = self._waits[batch] = min(2 * self._reprobe_every, self.max_reprobe_steps)
            self._probing = True
            return True
        return self._skip(batch)

    def _first_wait(self, batch: int) -> int:
        """Skipped steps before the first re-probe after drafting paid: reprobe_steps from 8
        requests on, proportionally fewer below. With few requests the predictions swing from
        step to step (one hard spot in one story), a probe costs little next to what drafting
        gains when it pays, and the doubling still bounds the probes when it never pays. (At
        one request the fixed 16-step wait drafted on 40-59% of steps in two bench runs, 1.32x
        and 1.57x ar where verifying every draft gave 1.71x and 1.54x; with this wait, 76% and
        1.54x against 1.66x in one run: within this VM's noise, not a shown gain.)"""
        return max(1, min(self.reprobe_steps, self.reprobe_steps * batch // 8))

    def _skip(self, batch: int) -> bool:
        self._skipped_steps += 1
        self.counters.num_skipped_drafts += batch
        return False

    def _draft(self, anchors: list[Anchor]) -> list[Proposal]:
        if self.verify == "confidence":
            self._cost_model()            # profiled once, before the drafting clock starts
        # Context rows queued while not drafting: projected now, outside both clocks. That work
        # is per row and paid once whenever drafting happens; timed with drafting, the first
        # draft after a long skip priced every later one as dear, drafting looked too costly at
        # one request and was skipped (drafting on 17-24% of steps in two of three runs, against
        # 59-93% without).
        self.drafter.flush_contexts([a.seq.method_state["draft_ctx"] for a in anchors])
        t0 = time.perf_counter()
        cfg, dev = self.drafter.drafter, self.ctx.device
        ids = torch.tensor([[a.token_id] + [cfg.mask_token_id] * (cfg.block_size - 1) for a in anchors],
                           dtype=torch.long, device=dev)
        embeds = F.embedding(ids, self.target.model.embed_tokens.weight)
        pos = torch.tensor([a.pos for a in anchors], dtype=torch.long, device=dev)
        hidden = self.drafter.forward(embeds, pos, [a.seq.method_state["draft_ctx"] for a in anchors])
        hidden = hidden[:, cfg.block_size - cfg.num_draft_tokens:][:, :self.num_speculative_tokens]
        base = self.target.compute_logits(hidden)                    # [B, γ, V] shared LM head
        seqs = [a.seq for a in anchors]
        temps = [self._draft_temperature(s) for s in seqs]
        # Fixed verification never reads the confidences: skip the head (γ small ops per step).
        conf_head = self.drafter.confidence_head if self.verify != "fixed" else None
        tokens, logits, conf = sample_block(base, hidden, ids[:, 0], self.drafter.markov_head,
                                            conf_head, self._chooser(seqs, temps))
        props = [self._proposal(a, tokens[i], logits[i], temps[i], conf[i] if conf is not None else None)
                 for i, a in enumerate(anchors)]
        if self.verify == "confidence":
            # Seconds per step = verify step at B tokens + drafting, whose cost does not depend on
            # how many drafts are verified (both as measured: MeasuredCost). Survival rows are
            # corrected by what verification showed for each request so far (AcceptanceFeedback).
            table = self._cost_model()
            overhead = table.draft(len(anchors))
            rows = [self._feedback(a.seq).correct(survival(p.confidence or [])) for a, p in zip(anchors, props)]
            lengths = schedule_prefix(rows, lambda b: 1.0 / (table.cost(b) + overhead))
            if self._probing:             # a re-probe learns nothing unless something is verified
                lengths = [max(n, min(1, len(p.token_ids))) for n, p in zip(lengths, props)]
            for a, p, n, row in zip(anchors, props, lengths, rows):
                p.num_verify = n
                # The prediction _worth_drafting uses next time: survival rows, smoothed over steps.
                old = a.seq.method_state.get("surv_pred")
                a.seq.method_state["surv_pred"] = row if not old or len(old) != len(row) else \
                    [0.5 * (x + y) for x, y in zip(old, row)]
                prior = self._surv_prior
                self._surv_prior = row if not prior or len(prior) != len(row) else \
                    [0.9 * x + 0.1 * y for x, y in zip(prior, row)]
        spent = time.perf_counter() - t0
        self._num_drafts += 1
        if self._num_drafts > 1 and self.measured is not None:   # the first pays one-off allocations
            self.measured.draft.add(len(anchors), spent)
        return props

    @staticmethod
    def _feedback(seq: Sequence) -> AcceptanceFeedback:
        fb = seq.method_state.get("accept_fb")
        if fb is None:
            fb = seq.method_state["accept_fb"] = AcceptanceFeedback()
        return fb

    def _record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        super()._record(seq, num_drafted, num_accepted)
        prop: Proposal | None = seq.method_state.get("proposal")
        if self.verify == "confidence" and prop is not None and prop.confidence:
            self._feedback(seq).observe(survival(prop.confidence), num_drafted, num_accepted)

    def _step_costs(self) -> StepCostTable:
        """The profiled cost curve (Algorithm 1's SPS), measured once on first use."""
        if self.step_costs is None:
            self.step_costs = StepCostTable.profile(self.target, self.ctx.device, max_tokens=256)
        return self.step_costs

    def _cost_model(self) -> MeasuredCost:
        """Step and drafting costs: measured, the profile filling in the rest."""
        if self.measured is None:
            self.measured = MeasuredCost(self._step_costs())
        return self.measured

    def _draft_temperature(self, seq: Sequence) -> float:
        """0 means argmax drafts (q one-hot); argmax proposals keep pure-parallel blocks
        coherent at T > 0 (§1.2, z-lab PR #169)."""
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
                    ids[i] = _draw((logits[i] / t).softmax(-1), seq.generator or self.sampler.generator)
            return ids
        return choose

    def _proposal(self, a: Anchor, tokens: torch.Tensor, logits: torch.Tensor, temp: float,
                  conf: torch.Tensor | None) -> Proposal:
        probs = (logits / temp).softmax(-1) if temp > 0 else None
        confidence = conf.tolist() if conf is not None else None
        return Proposal(a.pos, tokens.tolist(), probs, confidence, self._num_verify(confidence))

    def _num_verify(self, confidence: list[float] | None) -> int | None:
        """Threshold mode: the longest prefix whose survival Π c_i stays >= threshold. Whether
        draft j is verified depends on c_1..c_j only, which do not see x_j: non-anticipating,
        hence lossless (§2.4)."""
        if self.verify != "threshold" or confidence is None:
            return None
        survival, n = 1.0, 0
        for c in confidence:
            survival *= c
            if survival < self.threshold:
                break
            n += 1
        return n


class DSparkMethod(DFlashMethod):
    name = "dspark"
