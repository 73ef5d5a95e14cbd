"""The seam between the engine and a decoding method.

The scheduler, runner and engine know only the `Method` base class below: every member they
use is declared there, with its default. Each step a method says how many query tokens a
sequence needs beyond its known tokens (drafts, a diffusion canvas) and how the queries attend;
after the forward it says which tokens to commit and how many of the step's KV slots to keep
(the rest are rolled back). What a method remembers of a sequence between steps lives in
`Sequence.method_state`, a record of the method's own type.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from leapfrog.sample.sampler import Sampler
from leapfrog.sequence import Sequence
from leapfrog.tokenizer import Tokenizer


@dataclass(slots=True)
class MethodContext:
    """What a decoding method may use; methods build their own drafters from it."""
    model: torch.nn.Module
    model_path: Path
    tokenizer: Tokenizer
    sampler: Sampler
    device: torch.device
    dtype: torch.dtype
    draft_model: str | None = None
    # (model, num_blocks, block_size) -> (a ModelRunner over its own paged KV cache, a
    # BlockManager of those blocks): for a method that runs a second model step by step (the
    # engine supplies it; methods sit below the runner).
    paged_runner: Callable[[torch.nn.Module, int, int], tuple[Any, Any]] | None = None
    # (rows, context) -> a step of that many query rows as the engine runs it (the engine's
    # timed_step): what the confidence scheduler's cost profile times.
    timed_step: Callable[[int, int], Callable[[], None]] | None = None


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step."""
    seq: Sequence
    start_pos: int                 # position of the first query token (= seq.num_computed)
    num_known: int                 # committed tokens fed this step (a prefill chunk, or the last token)
    num_extra: int = 0             # method-owned query slots after them (drafts, masks)
    query_ids: list[int] = field(default_factory=list)   # filled by the method's prepare()
    num_logits: int = 0            # trailing query rows whose logits the method needs
    # leading query rows whose logits the engine needs for the prompt's own logprobs
    # (SamplingParams.prompt_logprobs); StepOutput holds only the method's rows
    num_prompt_logits: int = 0

    @property
    def num_query(self) -> int:
        return self.num_known + self.num_extra

    @property
    def reaches_end(self) -> bool:
        """True when this step feeds every committed token: the method may extend the sequence."""
        return self.start_pos + self.num_known == len(self.seq.token_ids)


@dataclass(slots=True)
class Batch:
    seqs: list[ScheduledSeq]
    attn_block_size: int = 1       # 1: causal; B: bidirectional within absolute blocks of B
    capture_layers: tuple[int, ...] = ()
    # With B > 1: only query rows holding this token attend to their whole block, the others
    # causally (a two-stream diffusion model's mask rows; None: every row block-wise).
    attn_bidir_token: int | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query for s in self.seqs)


@dataclass(slots=True)
class Commit:
    token_ids: list[int]           # appended to the sequence
    num_kv_keep: int               # of this step's query slots, how many stay in the cache
    logprobs: list[dict] | None = None
    counted_forward: bool = True   # this step produced output for the sequence
    forwards: int = 1              # forward passes it took (the decode loop runs several)


@dataclass(slots=True)
class StepOutput:
    logits: torch.Tensor                   # [sum(num_logits), V] fp32, in batch order
    captured: list[torch.Tensor] = field(default_factory=list)   # per capture layer [num_tokens, H]

    def split(self, batch: Batch) -> list[torch.Tensor]:
        return list(self.logits.split([s.num_logits for s in batch.seqs]))


class Method:
    """A decoding method: what the scheduler, runner and engine ask of one, with defaults.

    Subclasses implement prepare() and commit(); the rest has a default that suits a method
    whose steps feed only known tokens (`ar`)."""
    name: str = "method"
    attn_block_size: int = 1               # 1: causal; B: bidirectional within absolute blocks of B
    capture_layers: tuple[int, ...] = ()   # target layers whose hidden rows StepOutput.captured holds
    attn_bidir_token: int | None = None    # see Batch.attn_bidir_token
    # num_extra_tokens() is asked once at most this many known tokens are left to feed: 1, drafts
    # follow the last token; a diffusion canvas follows the prompt's partial block and any
    # committed blocks whose KV is not stored yet.
    max_known_with_extra: int = 1
    max_step_tokens: int = 1               # query tokens one decode step feeds per sequence
    eos_token_ids: tuple[int, ...] = ()    # end-of-text ids the engine stops on besides the tokenizer's
    # Whether its decode steps (one known token per sequence, no extra slots, one token sampled
    # from the last row) always may run in the C++ decode loop (engine/decode_loop.py): `ar`.
    decode_loop: bool = False
    # Whether requests with SamplingParams.logits_processors may use it (each row's processors
    # see the tokens before that row; a diffusion canvas has no such order).
    supports_logits_processors: bool = True
    # Whether a known token's row is the distribution of the token after it, so that requests
    # with SamplingParams.prompt_logprobs may use it (a diffusion model's rows are not: they read
    # their block both ways, and without a logit shift predict their own position).
    supports_prompt_logprobs: bool = True
    # Whether it reads MethodContext.draft_model (a drafter, or the small model it drafts with).
    reads_draft_model: bool = False

    def num_extra_tokens(self, seq: Sequence) -> int:
        """Query slots beyond the known tokens, for a sequence whose known tokens all fit."""
        return 0

    def prepare(self, batch: Batch) -> None:
        """Fill query_ids and num_logits of every ScheduledSeq."""
        raise NotImplementedError

    def commit(self, batch: Batch, out: StepOutput) -> list[Commit]:
        """Decide, per ScheduledSeq in order, what to append and what KV to keep."""
        raise NotImplementedError

    def on_finished(self, seq: Sequence) -> None:
        """Release per-sequence state (finished, aborted, or preempted: a preempted sequence
        restarts from scratch)."""
        seq.method_state = None

    def stats(self) -> dict[str, float]:
        """Method-specific counters for metrics (drafted/accepted tokens, ...)."""
        return {}

    def acceptance_length(self, seq: Sequence) -> float | None:
        """τ of a speculative method: tokens committed per verify step; None for the others."""
        return None

    def draft_counts(self, seq: Sequence) -> tuple[int, int, str | None] | None:
        """A speculative method's (drafts verified, drafts accepted, why drafting is off for the
        request: "request" (it asked), "fallback" (acceptance collapsed) or None) for `seq`;
        None for the others."""
        return None

    def loop_steps(self, batch: Batch) -> int:
        """How many decode steps of this batch (one known token per sequence, nothing else) may
        run in the C++ decode loop before the method needs Python again; 0: none. The loop
        samples with the CPU sampler and returns the rows of `capture_layers`."""
        return 1 << 30 if self.decode_loop else 0

    def loop_capture_layers(self, batch: Batch) -> tuple[int, ...]:
        """The target layers whose rows the decode loop returns for this batch (after_loop's
        `captured`): capture_layers, or none while nothing would use them."""
        return self.capture_layers

    def after_loop(self, batch: Batch, commits: list[Commit], captured: torch.Tensor) -> None:
        """The loop ran: `commits` are its tokens (not applied yet), `captured` [B, steps,
        len(loop_capture_layers), d] the rows of the captured layers at each fed position."""

    def modules(self) -> list[torch.nn.Module]:
        """Models the method runs besides the target (a drafter), for the engine to prepare
        their weights as it does the target's."""
        return []
