"""The offline API, vLLM's: LLM(model, method, draft_model, **engine_options).generate(prompts,
sampling_params) and .chat(messages, sampling_params)."""
from __future__ import annotations

import sys
import warnings
from dataclasses import replace
from typing import Any
from typing import Sequence as Seq

from tqdm import tqdm

from leapfrog.engine.llm_engine import LLMEngine
from leapfrog.outputs import RequestOutput
from leapfrog.sampling_params import SamplingParams, choice_seed, defaults_for_model
from leapfrog.tokenizer import encode_chat, open_final_message


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

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's name)."""
        return self.tokenizer

    def generate(self, prompts: Any, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: int | Seq[int] = 0, *,
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string, a list of token ids, or
        vLLM's prompt dicts ({"prompt": text} or {"prompt_token_ids": ids}); one prompt or a list.
        `sampling_params` (or `params`, this API's older name): one for all, or one per prompt;
        with n > 1 a prompt's completions come back in RequestOutput.outputs."""
        if params is not None:
            if sampling_params is not None:
                raise TypeError("give sampling_params or params, not both")
            sampling_params = params
        if isinstance(prompts, (str, dict, int)) or prompts is None or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt_input(p, i) for i, p in enumerate(prompts)]
        n = len(prompts)
        sp = sampling_params
        params_list = list(sp) if isinstance(sp, (list, tuple)) else [sp or self.get_default_sampling_params()] * n
        prios = list(priority) if isinstance(priority, (list, tuple)) else [priority] * n
        if len(params_list) != n or len(prios) != n:
            raise ValueError("sampling_params and priority lists must have one entry per prompt")
        ids: list[list[str]] = []        # per prompt, its completions' request ids
        try:        # add_request checks each prompt and its params (ValueError, TypeError naming it)
            for p, one, pr in zip(prompts, params_list, prios):
                if not isinstance(one, SamplingParams):
                    raise TypeError(f"sampling_params must be SamplingParams, not {type(one).__name__}")
                ids.append([])
                for choice in _completions(one):
                    ids[-1].append(self.engine.add_request(p, choice, priority=pr, stream=False))
        except BaseException:
            for rid in (r for group in ids for r in group):   # a bad prompt refuses the whole call
                self.engine.abort(rid)
            raise
        group_of = {r: group for group in ids for r in group}
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, disable=not use_tqdm, file=sys.stderr, desc="generate")
        while len(results) < len(group_of):
            for out in self.engine.step():
                if out.finished and out.request_id in group_of:
                    results[out.request_id] = out
                    if all(r in results for r in group_of[out.request_id]):
                        bar.update(1)
        bar.close()
        outs = []
        for group in ids:
            first = results[group[0]]
            first.other_completions = [results[r] for r in group[1:]]
            outs.append(first)
        return outs

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = False,
             *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             params: SamplingParams | Seq[SamplingParams] | None = None,
             priority: int | Seq[int] = 0) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate (vLLM's
        LLM.chat: one conversation or a list). `tools` and `chat_template_kwargs` reach the
        template; continue_final_message (with add_generation_prompt=False) leaves the last
        assistant message open for the reply to continue."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False (the reply continues "
                             "the last message instead of starting a new one)")
        kwargs = dict(chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools
        prompts, texts = [], []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, **kwargs)
            if continue_final_message:
                if conv[-1].get("role") != "assistant":
                    raise ValueError("continue_final_message: only an assistant message can be continued")
                text = open_final_message(text, conv[-1].get("content") or "")
            prompts.append(encode_chat(self.tokenizer, text))
            texts.append(text)
        outs = self.generate(prompts, sampling_params, use_tqdm, priority, params=params)
        for out, text in zip(outs, texts):       # the rendered conversation, as vLLM reports it
            for one in (out, *out.other_completions):
                one.prompt = text
        return outs


def _prompt_input(prompt: Any, index: int) -> str | list[int]:
    """A prompt as add_request takes it: text or token ids (vLLM's TextPrompt and TokensPrompt
    dicts unwrapped); TypeError naming the prompt otherwise."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
            return list(prompt["prompt_token_ids"])
        raise TypeError(f"prompt {index}: a prompt dict holds either 'prompt' (text) or 'prompt_token_ids' "
                        f"(a list of ids), not {sorted(prompt)}")
    return prompt


def _completions(params: SamplingParams) -> list[SamplingParams]:
    """A prompt's n sequences: choice j of a seeded request draws with seed + j (in 64 bits)."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else choice_seed(params.seed, j))
            for j in range(params.n)]
