"""`draft`: speculative decoding with a small AR model of the target's family as the drafter
(Leviathan et al. 2023; vLLM's draft-model speculation), over a paged KV cache of its own. Its
cache, drafting loop and calibrated confidences: docs/architecture.md, "The methods in detail"."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from leapfrog.config import resolve_model
from leapfrog.layers.cpu_kernels import LoopCall
from leapfrog.methods.base import Batch, ScheduledSeq
from leapfrog.methods.confidence_schedule import StepCostTable
from leapfrog.methods.speculative import Anchor, Proposal, SpeculativeMethod
from leapfrog.methods.verify import make_policy
from leapfrog.models.loader import load_model, named_drafter, read_config
from leapfrog.sequence import Sequence
from leapfrog.tokenizer import Tokenizer

if TYPE_CHECKING:
    from leapfrog.methods.base import MethodContext

# A fixed text both tokenizers must cut the same way (with the same vocabulary size).
_PROBE = "Once upon a time, a fox said: \"Hello!\" 3 + 4 = 7.\n新春快乐，万事如意。"


@dataclass(slots=True)
class DraftEntry:
    """A request's share of the draft model's cache: what the runner and the block manager
    read of a Sequence (block_table, num_hashed_blocks, token_ids), and the tokens whose KV
    the cache holds."""
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    token_ids: list[int] = field(default_factory=list)
    rotary_anchor: int | None = None
    probs: list[float] = field(default_factory=list)     # the draft model's probabilities of its last drafts


class Calibration:
    """Draft probability -> conditional acceptance rate, learned from verification (pooled over
    requests). Probabilities fall in `bins` equal bins; a bin's estimate is its accepted count
    over its verified count, with `prior` pseudo-counts at the rate over all bins (which starts
    at 1/2), so an empty bin says what drafts in general do. A draft counts when every draft
    before it was accepted: accepted, or the first rejection. Counts are halved past `horizon`
    verified drafts, so the estimate follows a change of text."""

    def __init__(self, bins: int = 10, prior: float = 4.0, horizon: float = 2000.0) -> None:
        self.bins, self.prior, self.horizon = bins, prior, horizon
        self.hits = [0.0] * bins
        self.counts = [0.0] * bins

    def _bin(self, p: float) -> int:
        return min(self.bins - 1, max(0, int(p * self.bins)))

    def rate(self) -> float:
        return (sum(self.hits) + 1.0) / (sum(self.counts) + 2.0)

    def __call__(self, probs: list[float]) -> list[float]:
        base = self.rate()
        return [(self.hits[b] + self.prior * base) / (self.counts[b] + self.prior)
                for b in map(self._bin, probs)]

    def observe(self, probs: list[float], num_accepted: int) -> None:
        """The verified drafts' probabilities, of which the first `num_accepted` were accepted."""
        for j, p in enumerate(probs[:num_accepted + 1]):
            b = self._bin(p)
            self.hits[b] += j < num_accepted
            self.counts[b] += 1.0
        if sum(self.counts) > self.horizon:
            self.hits = [0.5 * h for h in self.hits]
            self.counts = [0.5 * c for c in self.counts]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelMethod(SpeculativeMethod):
    name = "draft"
    reads_draft_model = True
    block_size = 16

    def __init__(self, ctx: "MethodContext", num_speculative_tokens: int = 4, fallback: str = "none",
                 draft_kv_tokens: int = 16384, verify: str = "fixed", threshold: float = 0.7,
                 step_costs: dict | None = None, **options: object) -> None:
        if options:
            raise ValueError(f"unknown option(s) for method 'draft': {', '.join(sorted(options))}")
        policy = make_policy(verify, threshold, step_costs,
                             lambda: StepCostTable.profile(ctx.model, ctx.device, max_tokens=256,
                                                                   step=ctx.timed_step))
        policy.draft_cost_per_token = True       # each draft is a draft-model step
        super().__init__(ctx, num_speculative_tokens, fallback, policy)
        if int(draft_kv_tokens) < self.block_size:
            raise ValueError(f"method 'draft': draft_kv_tokens={draft_kv_tokens}: must be >= {self.block_size}")
        # The model given, else the one the target folder's leapfrog.json names for `draft`.
        folder = resolve_model(ctx.draft_model) if ctx.draft_model else named_drafter(ctx.model_path, "draft")
        if folder is None:
            raise ValueError("method 'draft' needs draft_model=<a model folder or built-in name sharing the "
                             "target's tokenizer>, e.g. LLM('stories-large', method='draft', draft_model='stories'), "
                             "or a model folder whose leapfrog.json names one (\"drafters\": {\"draft\": ...})")
        config = read_config(folder)
        target_vocab = int(getattr(ctx.model, "config", {}).get("vocab_size", 0))
        tok = Tokenizer.from_folder(folder)
        if (int(config.get("vocab_size", -1)) != target_vocab
                or tok.encode(_PROBE) != ctx.tokenizer.encode(_PROBE)):
            raise ValueError(f"draft model {folder}: its tokenizer is not the target's (vocabulary "
                             f"{config.get('vocab_size')} against {target_vocab}, or other token ids); "
                             "a draft model must share the target's tokenizer")
        self.draft = load_model(folder, ctx.device, ctx.dtype)
        self.draft_path = folder
        self.draft_max_positions = int(config.get("max_position_embeddings", 1 << 30))
        num_blocks = max(1, int(draft_kv_tokens) // self.block_size)
        if ctx.paged_runner is None:
            raise ValueError("method 'draft' runs inside an LLMEngine (it needs the engine's paged runner)")
        self.runner, self.blocks = ctx.paged_runner(self.draft, num_blocks, self.block_size)
        self.entries: dict[int, DraftEntry] = {}
        self.calibration = Calibration()
        self.num_loop_calls = 0                                   # drafting calls of the C++ decode loop

    def modules(self) -> list[torch.nn.Module]:
        return [self.draft]

    # --- drafting --------------------------------------------------------------------------
    def propose(self, anchors: list[Anchor]) -> list[Proposal]:
        gamma = self.num_speculative_tokens
        out = [Proposal(a.pos, []) for a in anchors]
        # Drafts per request: γ, or fewer where the verify policy's predictions say the later
        # ones would not be verified (each costs a draft-model step).
        plan = self.policy.draft_lengths([self.state(a.seq).verify for a in anchors], gamma)
        live: list[tuple[int, DraftEntry, list[int]]] = []        # (anchor index, entry, tokens to feed)
        for i, a in enumerate(anchors):
            text = a.seq.token_ids + a.new_token_ids              # ends with the anchor
            entry = self.entries.setdefault(a.seq.seq_id, DraftEntry())
            keep = min(common_prefix(entry.token_ids, text), len(text) - 1)   # feed the anchor at least
            self.blocks.truncate(entry, keep)
            del entry.token_ids[keep:]
            entry.probs = []
            if plan[i] < 1 or len(text) + plan[i] - 1 > self.draft_max_positions \
                    or not self.blocks.reserve(entry, len(text) + plan[i] - 1):
                continue                                          # no room: this step verifies no drafts
            live.append((i, entry, text[keep:]))
        self._catch_up(live)
        self.policy.begin_drafting()
        drafts: dict[int, list[int]] = {i: [] for i, _, _ in live}
        probs: dict[int, list[float]] = {i: [] for i, _, _ in live}
        step = 0
        while live:
            if step == 1 and self._loop_drafts(live, plan, drafts, probs):
                break
            seqs = [ScheduledSeq(entry, len(entry.token_ids), len(feed), query_ids=list(feed), num_logits=1)
                    for _, entry, feed in live]
            top = self.runner.run(Batch(seqs)).logits.float().softmax(-1).max(-1)
            nxt = []
            for (i, entry, feed), tok, p in zip(live, top.indices.tolist(), top.values.tolist()):
                entry.token_ids += feed
                drafts[i].append(int(tok))
                probs[i].append(float(p))
                if len(drafts[i]) < plan[i]:
                    nxt.append((i, entry, [int(tok)]))
            live, step = nxt, step + 1
        for i, d in drafts.items():
            out[i].token_ids = d
            out[i].confidence = self.calibration(probs[i]) if self.policy.needs_confidence else None
            self.entries[anchors[i].seq.seq_id].probs = probs[i]
        return self._verify_lengths(anchors, out, sum(len(p.token_ids) for p in out))

    def _catch_up(self, live: list[tuple[int, DraftEntry, list[int]]]) -> None:
        """Feed the draft model, before the drafting clock starts, the text it missed while the
        verify policy skipped drafting (a prompt, or the steps since the last draft), all but
        the anchor: that work is per token and paid once, and timed with drafting it would
        price every later draft as dear."""
        # A step's own feed is one or two tokens (the correction, or the last draft and the bonus).
        behind = [(j, entry, feed) for j, (_, entry, feed) in enumerate(live) if len(feed) > 2]
        if not behind:
            return
        self.runner.run(Batch([ScheduledSeq(entry, len(entry.token_ids), len(feed) - 1, query_ids=feed[:-1],
                                            num_logits=0) for _, entry, feed in behind]))
        for j, entry, feed in behind:
            entry.token_ids += feed[:-1]
            live[j] = (live[j][0], entry, feed[-1:])

    def _loop_drafts(self, live: list[tuple[int, DraftEntry, list[int]]], plan: list[int],
                     drafts: dict[int, list[int]], probs: dict[int, list[float]]) -> bool:
        """The remaining greedy drafts of every live request (up to its planned number) in one
        call of the draft model's C++ decode loop, each row feeding its last draft; False where
        the loop does not apply (not a CPU float32 dense model, too many rows), and nothing done."""
        loop = self.draft.decode_loop(self.block_size) if hasattr(self.draft, "decode_loop") else None
        if loop is None or not loop.supports_rows(len(live)):
            return False
        loop.set_pick_probs(True)                 # the drafts' probabilities: their confidences
        t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        budgets = [plan[i] - len(drafts[i]) for i, _, _ in live]
        width = max(len(entry.block_table) for _, entry, _ in live)
        tables = t([e.block_table + [0] * (width - len(e.block_table)) for _, e, _ in live])
        tokens, counts, picked, _ = LoopCall(t([feed[0] for _, _, feed in live]), t([len(e.token_ids) for _, e, _ in live]),
                                             tables, t(budgets), steps=max(budgets)).run(loop)
        self.num_loop_calls += 1
        for (i, entry, feed), row, p, n in zip(live, tokens.tolist(), picked.tolist(), counts.tolist()):
            got = [int(x) for x in row[:n]]
            entry.token_ids += feed + got[:-1]           # the loop fed the last draft and all but its own last
            drafts[i] += got
            probs[i] += p[:n]
        return True

    def _record(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        entry = self.entries.get(seq.seq_id)
        if entry is not None:
            self.calibration.observe(entry.probs[:num_drafted], num_accepted)
        super()._record(seq, num_drafted, num_accepted)

    def on_finished(self, seq: Sequence) -> None:
        super().on_finished(seq)
        entry = self.entries.pop(seq.seq_id, None)
        if entry is not None:
            self.blocks.free_seq(entry)
