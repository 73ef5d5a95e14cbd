"""The pieces of DSpark's hardware-aware prefix scheduler (Algorithm 1 of the DSpark paper),
which verify.ConfidencePolicy puts together: the algorithm, the step-cost model it prices
steps with, and the per-request feedback that corrects the confidences.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Callable

import torch



def survival(confidence: list[float]) -> list[float]:
    out, a = [], 1.0
    for c in confidence:
        a *= c
        out.append(a)
    return out


def schedule_prefix(surv: list[list[float]], sps: Callable[[int], float]) -> list[int]:
    """Algorithm 1: how many drafts to verify per request (ℓ_r), from survival rows."""
    lengths = [0] * len(surv)
    batch, tau = len(surv), float(len(surv))
    best = tau * sps(batch)
    cands = sorted(((a, j, r) for r, row in enumerate(surv) for j, a in enumerate(row, 1) if a > 0),
                   key=lambda t: (-t[0], t[1]))
    for a, j, r in cands:
        if j != lengths[r] + 1:      # only on ties that skip a position; keep prefixes contiguous
            break
        theta = (tau + a) * sps(batch + 1)
        if theta <= best:
            break
        lengths[r], batch, tau, best = j, batch + 1, tau + a, theta
    return lengths


@dataclass(slots=True)
class StepCostTable:
    """Seconds per target forward at B batch tokens, piecewise linear between profiled points
    (vLLM PR #47808 profiles such a curve at start-up)."""
    num_tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def cost(self, batch: int) -> float:
        i = bisect.bisect_left(self.num_tokens, batch)
        if i < len(self.num_tokens) and self.num_tokens[i] == batch:
            return self.seconds[i]
        if i == 0:
            return self.seconds[0]
        if i == len(self.num_tokens):   # beyond the table: extend the last segment's slope
            i -= 1
        x0, x1 = self.num_tokens[i - 1], self.num_tokens[i]
        y0, y1 = self.seconds[i - 1], self.seconds[i]
        return max(y0 + (y1 - y0) * (batch - x0) / (x1 - x0), 1e-9)

    def sps(self, batch: int) -> float:
        return 1.0 / self.cost(batch)

    @classmethod
    def from_mapping(cls, costs: dict) -> "StepCostTable":
        items = sorted((int(k), float(v)) for k, v in costs.items())
        if not items or any(v <= 0 for _, v in items):
            raise ValueError("step_costs: need {batch_tokens: seconds > 0, ...}")
        return cls([k for k, _ in items], [v for _, v in items])

    @classmethod
    @torch.inference_mode()
    def profile(cls, model: torch.nn.Module, device: torch.device, max_tokens: int = 64,
                repeats: int = 3, context: int = 64,
                step: Callable[[int, int], Callable[[], None]] | None = None) -> "StepCostTable":
        """Time forwards of B query tokens, best of `repeats`, at B = 1..4, 6, 8, 10, 12, 16,
        24, ... max_tokens (dense where verification lengths live). `step(B, context)` (the
        engine's timed_step) builds each as the engine runs it, after `context` cached positions,
        on scratch caches swapped into the model's attention layers for the duration, so the
        curve has the shape of the steps it prices; without it, a dense forward."""
        # The rows sit after `context` cached positions: keep both inside the model's positions
        # (a model with 256 of them cannot time 256 rows after 64).
        limit = int(getattr(model, "config", {}).get("max_position_embeddings", 1 << 30))
        max_tokens = min(max_tokens, max(1, limit // 2))
        context = max(0, min(context, limit - max_tokens))
        sizes = [b for b in (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
                 if b <= max_tokens]
        layers = getattr(model, "attention_layers", None) or []
        paged = step is not None and bool(layers) and all(a.k_cache is not None for a in layers)
        saved = [(a.k_cache, a.v_cache) for a in layers] if paged else []
        try:
            if paged:       # room for the widest step's blocks whatever the block size (<= 256)
                slots = context + max(sizes) + 256
                for a in layers:
                    a.k_cache = torch.zeros(slots, a.num_kv_heads, a.head_dim, dtype=a.k_cache.dtype, device=device)
                    a.v_cache = torch.zeros_like(a.k_cache)
            secs = []
            for b in sizes:
                run = step(b, context) if paged else \
                    (lambda ids=torch.zeros(1, b, dtype=torch.long, device=device): model.forward_dense(ids))
                run()                                      # warm-up: first-call allocations
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    run()
                    best = min(best, time.perf_counter() - t0)
                secs.append(best)
        finally:
            for a, (k, v) in zip(layers if paged else [], saved):
                a.k_cache, a.v_cache = k, v
        # A forward of more tokens never costs less: a width timed dearer than a wider one was
        # disturbed (noise only ever adds time), and a spike there would steer the scheduler
        # away from that width for good, since only the widths it runs get measured.
        for i in range(len(secs) - 2, -1, -1):
            secs[i] = min(secs[i], secs[i + 1])
        return cls(sizes, secs)


@dataclass(slots=True)
class LinearFit:
    """y ~ slope * x + intercept by exponentially weighted least squares (`decay` per sample).
    Until the samples' x spread enough to tell slope from intercept, the slope keeps its prior
    and only the intercept moves (to the weighted mean of y - slope * x)."""
    slope: float = 0.0
    intercept: float = 0.0
    decay: float = 0.97
    slope_range: tuple[float, float] = (0.0, 1.0)
    # Until the x spread: y proportional to x (intercept 0) instead of a constant (slope kept).
    # Drafting by an AR draft model costs per drafted token: one probe of 8 drafts must not
    # price a plan of 1 draft as dear.
    through_origin: bool = False
    num_samples: int = 0
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)    # Σw, Σwx, Σwy, Σwx², Σwxy

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept

    def add(self, x: float, y: float) -> None:
        s = self._sums
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            s[i] = self.decay * s[i] + v
        self.num_samples += 1
        w, mx, my = s[0], s[1] / s[0], s[2] / s[0]
        var = s[3] / w - mx * mx
        lo, hi = self.slope_range
        if var > (0.05 * mx) ** 2 and var > 1e-18:
            self.slope = min(max((s[4] / w - mx * my) / var, lo), hi)
        elif self.through_origin and mx > 0:
            self.slope, self.intercept = min(max(my / mx, lo), hi), 0.0
            return
        self.intercept = max(0.0, my - self.slope * mx)


@dataclass(slots=True)
class MeasuredCost:
    """Step and drafting costs as this engine measures them, the start-up profile filling in what
    is not measured yet. Verify steps (by batch tokens B) and plain decode steps, which draft
    nothing (by requests R), are priced apart; drafting for R requests is a `LinearFit` a + b * R.
    `alpha` weighs the running averages, `min_samples` steps make a width's average count, and a
    step outside [1/ratio, ratio] times its prediction is not a sample.
    (docs/architecture.md, "methods/confidence_schedule.py")"""
    table: StepCostTable
    alpha: float = 0.1
    min_samples: int = 3
    ratio: float = 10.0
    scale: float = 1.0                                                   # verify: measured / profiled
    plain_scale: float = 1.0                                             # plain: measured / profiled
    num_samples: int = 0
    seen: dict[int, tuple[float, int]] = field(default_factory=dict)    # B -> (average s, samples)
    plain: dict[int, tuple[float, int]] = field(default_factory=dict)   # R -> (average s, samples)
    num_plain_samples: int = 0
    draft: LinearFit = field(default_factory=LinearFit)                 # seconds ~ a + b * requests

    def cost(self, batch: int) -> float:
        """Seconds of a verify step at `batch` tokens."""
        return self._estimate(self.seen, self.scale, batch)

    def plain_cost(self, requests: int) -> float:
        """Seconds of a decode step of `requests` requests that drafts nothing."""
        return self._estimate(self.plain, self.plain_scale, requests)

    def _estimate(self, seen: dict[int, tuple[float, int]], scale: float, batch: int) -> float:
        avg, n = seen.get(batch, (0.0, 0))
        if n >= self.min_samples:
            return avg
        known = sorted(b for b, (_, k) in seen.items() if k >= self.min_samples)
        i = bisect.bisect_left(known, batch)
        if 0 < i < len(known):                 # between two measured widths: interpolate
            b0, b1 = known[i - 1], known[i]
            y0, y1 = seen[b0][0], seen[b1][0]
            return y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
        if known:                               # beyond them: the scaled profile's difference
            b = known[-1] if i else known[0]
            y = seen[b][0] + scale * (self.table.cost(batch) - self.table.cost(b))
            return max(y, 1e-9)
        return scale * self.table.cost(batch)

    def observe(self, batch: int, seconds: float) -> bool:
        """A verify step of `batch` tokens took `seconds`; False where it is not a sample."""
        if not 1 / self.ratio <= seconds / self.cost(batch) <= self.ratio:
            return False
        self.scale = self._add(self.seen, self.scale, self.num_samples, batch, seconds)
        self.num_samples += 1
        return True

    def observe_plain(self, requests: int, seconds: float) -> bool:
        """A plain decode step of `requests` requests took `seconds` (for steps of the decode
        loop: the mean over the call); False where it is not a sample."""
        if not 1 / self.ratio <= seconds / self.plain_cost(requests) <= self.ratio:
            return False
        self.plain_scale = self._add(self.plain, self.plain_scale, self.num_plain_samples, requests, seconds)
        self.num_plain_samples += 1
        return True

    def _add(self, seen: dict[int, tuple[float, int]], scale: float, count: int, batch: int,
             seconds: float) -> float:
        avg, n = seen.get(batch, (seconds, 0))
        seen[batch] = (avg + max(self.alpha, 1 / (n + 1)) * (seconds - avg), n + 1)
        r = seconds / self.table.cost(batch)
        return scale + max(self.alpha, 1 / (count + 1)) * (r - scale)


@dataclass(slots=True)
class AcceptanceFeedback:
    """What verification showed against what the confidences predicted, for one request.

    Per draft position j: decayed sums of the predicted survival a_j and of the outcome (were the
    first j drafts all accepted?); `correct` scales a row by (seen_j + prior) / (predicted_j + prior),
    non-increasing and <= 1. Only past steps enter it, so decisions stay non-anticipating (lossless).
    (docs/decisions.md, "Speculative decoding")"""
    decay: float = 0.9
    prior: float = 2.0
    predicted: list[float] = field(default_factory=list)
    seen: list[float] = field(default_factory=list)

    def observe(self, row: list[float], num_verified: int, num_accepted: int) -> None:
        for j in range(min(num_verified, len(row))):
            if j >= len(self.predicted):
                self.predicted.append(0.0)
                self.seen.append(0.0)
            self.predicted[j] = self.decay * self.predicted[j] + row[j]
            self.seen[j] = self.decay * self.seen[j] + (j < num_accepted)

    def ratio(self, j: int) -> float:
        """Positions never verified yet take the deepest verified position's ratio (a survival
        row that is low by a factor at j is at least as low beyond it)."""
        if not self.predicted:
            return 1.0
        j = min(j, len(self.predicted) - 1)
        return (self.seen[j] + self.prior) / (self.predicted[j] + self.prior)

    def correct(self, row: list[float]) -> list[float]:
        out, last = [], 1.0
        for j, a in enumerate(row):
            last = min(last, a * self.ratio(j))
            out.append(last)
        return out
