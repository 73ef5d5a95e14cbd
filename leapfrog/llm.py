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
from leapfrog.tokenizer import encode_chat, open_final_message, tool_messages


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

    def get_tokenizer(self) -> "HFTokenizerView":
        """The model's tokenizer as vLLM returns it: called as a Hugging Face tokenizer is, with
        its defaults (HFTokenizerView)."""
        return HFTokenizerView(self.tokenizer)

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
        for key in ("messages", "add_generation_prompt", "continue_final_message", "tools"):
            if key in kwargs:
                raise ValueError(f"chat_template_kwargs[{key!r}]: set by LLM.chat's own argument")
        reads_tools = bool(getattr(self.tokenizer, "template_reads_tools", False))
        prompts, texts = [], []
        for conv in convs:
            conv, extra = plain_messages(conv), {}
            if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in conv):
                conv, extra = tool_messages(conv, tools, reads_tools)
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      **kwargs, **extra)
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


def plain_messages(messages: list[dict]) -> list[dict]:
    """A conversation as a template reads it (the server's rules): content as a string (OpenAI's
    text parts joined by newlines, as vLLM joins them; None only on an assistant turn with tool_calls, read as empty)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]: a message is a dict with a 'role'")
        content = m.get("content")
        if content is None:
            if not (m["role"] == "assistant" and m.get("tool_calls")):
                raise ValueError(f"messages[{i}]: a {m['role']} message needs content (None only on an "
                                 "assistant message with tool_calls)")
            content = ""
        elif isinstance(content, list):
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise ValueError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                 "can be read")
            content = "\n".join(p["text"] for p in content)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: a string or a list of text parts, not {type(content).__name__}")
        out.append({**m, "content": content})
    return out


class HFTokenizerView:
    """leapfrog's Tokenizer behind the calls and defaults of a Hugging Face tokenizer, which code
    written for vLLM's `llm.get_tokenizer()` expects: apply_chat_template tokenizes unless
    tokenize=False and adds no generation prompt unless asked, decode keeps special tokens unless
    skip_special_tokens=True, and the tokenizer is callable. Anything else is the Tokenizer's."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return int(self._tok.vocab_size)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict:
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens=add_special_tokens) for t in text]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: int | Seq[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(ids)] if isinstance(ids, int) else [int(i) for i in ids],
                                skip_special_tokens=skip_special_tokens)

    def batch_decode(self, batch: Seq[Seq[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    def convert_ids_to_tokens(self, ids: int | Seq[int]) -> str | list[str]:
        return self._tok.id_to_token(int(ids)) if isinstance(ids, int) else [self._tok.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Seq[str]) -> int | None | list[int | None]:
        return self._tok.token_to_id(tokens) if isinstance(tokens, str) else [self._tok.token_to_id(t) for t in tokens]

    @property
    def eos_token_id(self) -> int | None:
        ids = list(getattr(self._tok, "eos_token_ids", []) or [])
        return ids[0] if ids else None

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = False, tokenize: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str | list[int]:
        messages, extra = tool_messages(plain_messages(conversation), tools,
                                        bool(getattr(self._tok, "template_reads_tools", False)))
        text = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs, **extra)
        if continue_final_message:
            text = open_final_message(text, messages[-1].get("content") or "")
        return encode_chat(self._tok, text) if tokenize else text
