"""Sequence: one request's tokens, its place in the KV cache, and its bookkeeping."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from leapfrog.sampling_params import BACKGROUND_PRIORITY, SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SequenceMetrics:
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_forwards: int = 0          # forward passes of the main model that produced output
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0


@dataclass(slots=True, eq=False)
class Sequence:
    """`token_ids` = prompt + committed output. `num_computed` tokens have their K/V in the
    cache; the rest (usually the last sampled token) are fed at the next step."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    priority: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    metrics: SequenceMetrics = field(default_factory=SequenceMetrics)
    method_state: Any = None       # the decoding method's record of this sequence (its own type)
    logprobs: list[dict] = field(default_factory=list)
    # params.prompt_logprobs: one entry per prompt token (None for the first), filled as its
    # prefill chunks run (engine/llm_engine.py)
    prompt_logprobs: list[dict | None] | None = None
    eos_token_ids: tuple[int, ...] = ()     # the engine's end tokens (min_tokens bans them)
    # The CPU sampler's counter-based generator: key (the seed, or one drawn from the engine's
    # seed) and the number of draws so far (sample/sampler.py).
    sample_key: int | None = None
    num_draws: int = 0
    # A model with coupled positions: the index of the first anchor token (-1: none; None: not
    # looked for yet). Rotary positions past it count from it.
    rotary_anchor: int | None = None
    # params.structured_outputs: the request's grammar matcher (sample/grammar.py GrammarMatch)
    grammar: Any = None
    # params.prediction as token ids (the engine tokenizes a text one without special tokens)
    prediction_ids: list[int] = field(default_factory=list)
    # params.bad_words as token sequences (the engine tokenizes each, with and without a leading space)
    bad_words_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if not self.metrics.arrival_time:
            self.metrics.arrival_time = time.perf_counter()

    @property
    def background(self) -> bool:
        """Background work (batch jobs): the scheduler runs it only in steps without live requests."""
        return self.priority >= BACKGROUND_PRIORITY

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def is_stop_token(self, token: int) -> bool:
        """Whether `token` ends this request: one of its stop token ids, or an end-of-text token
        unless it ignores them."""
        p = self.params
        return token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)

    def finishes_with(self, token_ids: list[int]) -> bool:
        """Whether committing `token_ids` ends this request (a stop token, or max_tokens)."""
        return (self.num_output_tokens + len(token_ids) >= self.params.max_tokens
                or any(self.is_stop_token(t) for t in token_ids))

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Lower runs first: priority class, then arrival (FIFO)."""
        return (self.priority, self.metrics.arrival_time, self.seq_id)
