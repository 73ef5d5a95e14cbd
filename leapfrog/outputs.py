"""What generation returns: RequestOutput and its metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestMetrics:
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_forwards: int = 0                   # main-model forward passes that produced output
    tokens_per_forward: float = 0.0
    acceptance_length: float | None = None  # speculative methods: accepted + bonus per verify
    num_drafted_tokens: int | None = None   # speculative methods: drafts verified for the request
    num_accepted_tokens: int | None = None  # ... and accepted
    drafting_off: str | None = None         # why it drafted nothing more: "request" or "fallback"
    time_to_first_token: float | None = None
    total_time: float | None = None
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (vLLM's CompletionOutput): RequestOutput.outputs[j]."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None      # the sum of the chosen tokens' logprobs (with logprobs)
    logprobs: list[dict] | None
    finish_reason: str | None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    delta_text: str = ""                    # new text since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    # SamplingParams.prompt_logprobs: an entry per prompt token, None for the first
    prompt_logprobs: list[dict | None] | None = None
    # SamplingParams.n > 1 (LLM.generate): completions 1..n-1; this output is completion 0
    other_completions: list["RequestOutput"] = field(default_factory=list)

    @property
    def outputs(self) -> list[CompletionOutput]:
        """Every completion, vLLM's way (`outputs[0].text` is `text`)."""
        return [CompletionOutput(j, o.text, o.token_ids, None if o.logprobs is None else
                                 sum(entry["logprob"] for entry in o.logprobs if entry),
                                 o.logprobs, o.finish_reason)
                for j, o in enumerate([self, *self.other_completions])]
