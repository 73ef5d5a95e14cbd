"""The offline API: LLM(model, method, draft_model, **engine_options).generate(prompts, params)."""
from __future__ import annotations

import sys
import warnings
from typing import Sequence as Seq

from tqdm import tqdm

from leapfrog.engine.llm_engine import LLMEngine
from leapfrog.outputs import RequestOutput
from leapfrog.sampling_params import SamplingParams, defaults_for_model


class LLM:
    """`tensor_parallel_size=N` splits each layer over N ranks, `pipeline_parallel_size=M` cuts
    the layers into M stages (engine/distributed.py): N x M - 1 follower processes started here, or
    torchrun's processes, of which rank 0 returns from this call."""

    def __init__(self, model: str = "stories", method: str = "ar", draft_model: str | None = None,
                 **engine_options: object) -> None:
        # deferred: engine.distributed loads only when an LLM is built
        from leapfrog.engine.distributed import num_ranks, start
        if num_ranks(engine_options) > 1:
            self.engine = start(model, dict(method=method, draft_model=draft_model, **engine_options))
        else:
            self.engine = LLMEngine(model, method=method, draft_model=draft_model, **engine_options)
        self.tokenizer = self.engine.tokenizer
        self.model = model
        self._defaults: dict | None = None

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request that passes no SamplingParams gets (vLLM's name): the model's
        generation_config.json over SamplingParams' defaults, as the server and the CLI choose."""
        if self._defaults is None:       # a malformed file is a warning, as in the server
            self._defaults = defaults_for_model(self.model, lambda msg: warnings.warn(msg, stacklevel=3))
        return SamplingParams(**self._defaults)

    def shutdown(self) -> None:
        """Stop the follower ranks (tensor parallelism); also done at exit."""
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: int | Seq[int] = 0) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts may be strings or token-id lists."""
        if isinstance(prompts, (str, int)) or prompts is None or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or self.get_default_sampling_params()] * n
        prios = list(priority) if isinstance(priority, (list, tuple)) else [priority] * n
        if len(params_list) != n or len(prios) != n:
            raise ValueError("params and priority lists must have one entry per prompt")
        ids: list[str] = []
        try:        # add_request checks each prompt and its params (ValueError, TypeError naming it)
            for p, sp, pr in zip(prompts, params_list, prios):
                ids.append(self.engine.add_request(p, sp, priority=pr, stream=False))
        except BaseException:
            for rid in ids:       # a bad prompt refuses the whole call: none of it stays queued
                self.engine.abort(rid)
            raise
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, disable=not use_tqdm, file=sys.stderr, desc="generate")
        while len(results) < n:
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             **kwargs: object) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in convs]
        return self.generate(prompts, params, **kwargs)
