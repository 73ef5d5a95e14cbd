"""What the engine hands back for each request after a step: the text detokenized so far, stop
strings matched (the request finished there, tokens past the match dropped), the beginning of a
possible stop string held back until it is decided, and the request's statistics. vLLM keeps
this apart from its engine core in the same way (its OutputProcessor)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from leapfrog.outputs import RequestMetrics, RequestOutput
from leapfrog.sequence import Sequence
from leapfrog.tokenizer import IncrementalDetokenizer, Tokenizer

if TYPE_CHECKING:
    from leapfrog.engine.scheduler import Scheduler
    from leapfrog.methods.base import Method

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    prompt: str | None
    detok: IncrementalDetokenizer
    stream: bool = True                 # emit text deltas every step (else decode once at the end)
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    counted_tokens: int = 0             # output tokens already added to the engine's stats
    stop_after: int = 0                 # a stop string must end past this much text (min_tokens)


def _find_ending_after(text: str, stop: str, start: int, end_after: int) -> int:
    """The first index >= start of `stop` in `text` whose end is past `end_after`, or -1."""
    return text.find(stop, max(start, end_after - len(stop) + 1))


@dataclass(slots=True)
class EngineStats:
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    num_finished: int = 0
    num_interrupted_steps: int = 0      # background steps abandoned for live work, nothing kept
    finish_reasons: dict[str, int] = field(default_factory=dict)


class OutputProcessor:
    """The requests in flight by id, each with its detokenizer and what was sent of it."""

    def __init__(self, tokenizer: Tokenizer, scheduler: "Scheduler", method: "Method", stats: EngineStats):
        self.tokenizer, self.scheduler, self.method, self.stats = tokenizer, scheduler, method, stats
        self.requests: dict[str, RequestState] = {}

    def add(self, seq: Sequence, prompt: str | None, stream: bool) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, seq.token_ids[:seq.num_prompt_tokens],
                                       seq.params.skip_special_tokens)
        self.requests[seq.request_id] = RequestState(seq, prompt, detok, stream or bool(seq.params.stop))

    def process(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests that changed in a step (streamed ones, and every finished one)."""
        outs = []
        for seq in seqs:
            req = self.requests[seq.request_id]
            if req.stream or seq.is_finished:
                outs.append(self._output_or_error(seq))
            else:   # offline request: nothing to report until it finishes
                self.stats.num_generation_tokens += seq.num_output_tokens - req.counted_tokens
                req.counted_tokens = seq.num_output_tokens
        return outs

    def _output_or_error(self, seq: Sequence) -> RequestOutput:
        """_output, or for a request whose detokenizing or stop-string check raised, an
        error output for that request alone."""
        try:
            return self._output(seq)
        except Exception as exc:
            log.exception("request %s failed while emitting its output", seq.request_id)
            self.scheduler.finish(seq, "error")
            seq.finish_reason = f"error:{type(exc).__name__}: {exc}"   # also when it had finished
            req = self.requests.pop(seq.request_id, None)
            if req is not None:
                self.stats.num_finished += 1
            return RequestOutput(seq.request_id, req.prompt if req else None,
                                 seq.token_ids[:seq.num_prompt_tokens], "", list(seq.output_ids), True,
                                 seq.finish_reason, self.metrics(seq), "", [], None)

    def _output(self, seq: Sequence) -> RequestOutput:
        req = self.requests[seq.request_id]
        new_tokens = seq.output_ids[req.sent_tokens:]
        # A stop token id (or end of text) that ended the request stays in token_ids but adds
        # no text, unless include_stop_str_in_output (vLLM's rule, as for stop strings).
        silent = int(bool(seq.is_finished and seq.finish_reason == "stop" and new_tokens
                          and not seq.params.include_stop_str_in_output and seq.is_stop_token(new_tokens[-1])))
        if req.stream and seq.params.stop and len(new_tokens) > 1:
            kept = self._add_until_stop(req, new_tokens[:len(new_tokens) - silent])
            new_tokens = kept + new_tokens[-1:] if silent and len(kept) == len(new_tokens) - 1 else kept
        elif req.stream:
            req.text += req.detok.add(new_tokens[:len(new_tokens) - silent])
        elif seq.is_finished:    # offline request: one detokenizer call at the end is much cheaper
            req.text = req.detok.add_all(seq.output_ids[:len(seq.output_ids) - silent])
        self.stats.num_generation_tokens += seq.num_output_tokens - req.counted_tokens
        req.counted_tokens = seq.num_output_tokens
        self._check_stop_strings(req)
        if seq.is_finished:
            if seq.finish_reason == "length":
                # what is still held back: a character max_tokens cut in two is left out
                req.text += req.detok.flush().rstrip("\ufffd")
            self._check_stop_strings(req)
            self._finish_request(req)
        # Hold back a possible beginning of a stop string until it is decided.
        hold = 0 if seq.is_finished else max((len(s) - 1 for s in seq.params.stop), default=0)
        visible = len(req.text) - hold
        delta = req.text[req.sent_chars:visible] if visible > req.sent_chars else ""
        req.sent_chars = max(req.sent_chars, visible)
        out = RequestOutput(seq.request_id, req.prompt, seq.token_ids[:seq.num_prompt_tokens],
                            req.text[:visible] if not seq.is_finished else req.text,
                            list(seq.output_ids), seq.is_finished, seq.finish_reason,
                            self.metrics(seq), delta, new_tokens,
                            list(seq.logprobs) if seq.params.logprobs is not None else None,
                            list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None)
        req.sent_tokens = seq.num_output_tokens
        return out

    def _add_until_stop(self, req: RequestState, new_tokens: list[int]) -> list[int]:
        """Several new tokens of a request with stop strings (the decode loop's steps, accepted
        drafts): detokenized and matched one at a time, as single steps would have been; the
        tokens after the one that completes a stop string are dropped, and the request ends
        there with "stop". Returns the tokens kept."""
        seq = req.seq
        for i, token in enumerate(new_tokens):
            req.text += req.detok.add([token])
            if self._check_stop_strings(req, req.sent_tokens + i + 1):
                keep = req.sent_tokens + i + 1
                if i + 1 < len(new_tokens):
                    del seq.token_ids[seq.num_prompt_tokens + keep:]
                    del seq.logprobs[keep:]
                    seq.finish_reason = "stop"
                    if self.method.decode_loop:     # the loop's overrun: one forward a dropped token
                        seq.metrics.num_forwards -= len(new_tokens) - i - 1
                return new_tokens[:i + 1]
        return new_tokens

    def _check_stop_strings(self, req: RequestState, num_tokens: int | None = None) -> bool:
        """Cut the text at the first stop string and finish the request; True on a hit. Within
        min_tokens (`num_tokens` output tokens so far, default all) no stop string counts, and
        one ending in that text never does (vLLM's rule, as for stop tokens)."""
        seq = req.seq
        if not seq.params.stop:
            return False
        if (seq.num_output_tokens if num_tokens is None else num_tokens) <= seq.params.min_tokens:
            req.stop_after = len(req.text)
            return False
        window = max(len(s) for s in seq.params.stop) + 32
        start = max(0, req.sent_chars - window)
        hits = [(_find_ending_after(req.text, s, start, req.stop_after), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        req.text = req.text[:i + len(s)] if seq.params.include_stop_str_in_output else req.text[:i]
        if not seq.is_finished:
            self.scheduler.finish(seq, "stop")
        return True

    def _finish_request(self, req: RequestState) -> None:
        self.requests.pop(req.seq.request_id, None)
        self.stats.num_finished += 1
        reason = req.seq.finish_reason or "unknown"
        self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1

    def metrics(self, seq: Sequence) -> RequestMetrics:
        m = seq.metrics
        n = seq.num_output_tokens
        end = m.finished_time or time.perf_counter()
        drafts = self.method.draft_counts(seq)
        drafted, accepted, off = drafts if drafts is not None else (None, None, None)
        return RequestMetrics(
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=n, num_forwards=m.num_forwards,
            tokens_per_forward=n / m.num_forwards if m.num_forwards else 0.0,
            acceptance_length=self.method.acceptance_length(seq),
            time_to_first_token=(m.first_token_time - m.arrival_time) if m.first_token_time else None,
            total_time=end - m.arrival_time, num_cached_prompt_tokens=m.num_cached_prompt_tokens,
            num_preemptions=m.num_preemptions, num_drafted_tokens=drafted, num_accepted_tokens=accepted,
            drafting_off=off)
