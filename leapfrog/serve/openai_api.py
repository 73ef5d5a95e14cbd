"""Turning HTTP bodies into engine requests, and engine outputs into OpenAI-shaped responses.

Shared by /generate, /v1/completions and /v1/chat/completions: all checks that can fail do so
here, before anything is queued, so that a streaming response never starts with a bad request.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from leapfrog.outputs import RequestOutput
from leapfrog.sample.grammar import compiler_for
from leapfrog.sampling_params import (MAX_SPECULATIVE_TOKENS, ParamError, SamplingParams,
                                      StructuredOutputs, choice_seed, shorten)
from leapfrog.serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, SamplingFields,
                                    TokenizeRequest, bad_request)
from leapfrog.serve.tools import ToolPlan, check_history, check_tool_schemas, parse_reply, plan_tools, render_messages
from leapfrog.tokenizer import FALLBACK_REPLY, IncrementalDetokenizer, encode_chat, fallback_chat, open_final_message

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(slots=True)
class Limits:
    """What the HTTP layer needs to know about the engine and the server's defaults."""
    model_ids: set[str]
    max_model_len: int
    vocab_size: int
    default_max_tokens: int
    # SamplingParams fields for requests that leave them out: the model's generation_config.json
    # under the server's explicit defaults (always holds "temperature")
    defaults: dict
    max_n: int
    max_prompt_chars: int = 0       # 0: no limit
    # what the engine's decoding method can do (a diffusion method neither constrains its
    # output nor scores a prompt token by token): refused here, before a stream's headers go out
    method: str = ""
    constrains: bool = True
    scores_prompt: bool = True


@dataclass(slots=True)
class Prepared:
    prompts: list[list[int]]                    # token ids, one per prompt
    requests: list[tuple[list[int], SamplingParams]] = field(default_factory=list)   # prompt x n
    texts: list[str] = field(default_factory=list)   # /v1/completions with echo: each prompt's text
    tools: ToolPlan = field(default_factory=ToolPlan)   # a chat request's tools and tool_choice


def check_model(model: str | None, limits: Limits) -> None:
    if model is not None and model not in limits.model_ids:
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                       f"{sorted(limits.model_ids)[0]!r}", "invalid_request_error", "model", "model_not_found")


def check_prompt(ids: list[int], limits: Limits, param: str = "prompt") -> None:
    if not ids:
        raise bad_request("prompt is empty", param, "empty_prompt")
    if len(ids) >= limits.max_model_len:
        raise bad_request(f"prompt has {len(ids)} tokens but the model's context is {limits.max_model_len} "
                          "tokens, leaving no room to generate", param, "context_length_exceeded")
    if any(t < 0 or t >= limits.vocab_size for t in ids):
        raise bad_request(f"prompt token ids must be in [0, {limits.vocab_size})", param, "invalid_token_id")


def check_prompt_chars(text: str, limits: Limits, param: str = "prompt") -> None:
    if limits.max_prompt_chars and len(text) > limits.max_prompt_chars:
        raise bad_request(f"prompt has {len(text)} characters, more than can fit the model's context of "
                          f"{limits.max_model_len} tokens", param, "context_length_exceeded")


def truncation(keep: int | None) -> int | None:
    """truncate_prompt_tokens (vLLM's): None, or the number of a prompt's last tokens kept."""
    if keep is not None and keep < 1:
        raise bad_request(f"truncate_prompt_tokens={keep}: must be at least 1 (the prompt's last tokens kept)",
                          "truncate_prompt_tokens", "invalid_value")
    return keep


def truncated(ids: list[int], keep: int | None) -> list[int]:
    """The prompt's last `keep` tokens (vLLM truncates from the left), or all of them."""
    return ids[-keep:] if keep is not None and len(ids) > keep else ids


def encode_prompt(prompt: str | list[int], tokenizer: Any, limits: Limits, check_chars: bool = True) -> list[int]:
    """check_chars: refuse text longer than the context could hold before tokenizing it (not
    when the request truncates its prompt; the body limit still bounds it)."""
    if isinstance(prompt, str):
        if not prompt:      # encode("") is [BOS], which would pass as a prompt
            raise bad_request("prompt is empty", "prompt", "empty_prompt")
        if check_chars:
            check_prompt_chars(prompt, limits)
        return tokenizer.encode(prompt)
    return list(prompt)


GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def requested_constraint(req: SamplingFields) -> StructuredOutputs | None:
    """The request's output constraint, from whichever one of response_format (OpenAI's),
    structured_outputs or guided_* (vLLM's) it uses; two of them are a 400."""
    found: list[tuple[str, dict]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request("response_format: type json_schema needs json_schema.schema", "response_format.json_schema",
                              "missing_field")
        found.append(("response_format", {"json": rf.json_schema.schema_}))
    so = req.structured_outputs
    if so is not None:
        kw = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "json_object": bool(so.json_object)}
        found.append(("structured_outputs", kw))
    for name in GUIDED_FIELDS:
        value = getattr(req, name)
        if value is not None:
            found.append((name, {name.removeprefix("guided_"): value}))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"{found[1][0]}: only one of response_format, structured_outputs and guided_* may "
                          f"constrain a request (also given: {found[0][0]})", found[1][0], "invalid_value")
    field, kw = found[0]
    try:
        return StructuredOutputs(**kw, field=field)
    except ParamError as exc:
        raise bad_request(str(exc), exc.field, "invalid_value") from None


def compile_constraint(spec: StructuredOutputs | None, tokenizer: Any, limits: Limits) -> None:
    """Compile the constraint now (cached), so a bad schema or grammar is a 400 before anything
    is queued; the engine copies the compiled matcher."""
    if spec is None:
        return
    try:
        compiler_for(tokenizer, limits.vocab_size).compile(spec)
    except ParamError as exc:
        raise bad_request(str(exc), exc.field, "invalid_grammar") from None
    except ValueError as exc:           # a model whose tokenizer no grammar engine reads
        raise bad_request(f"{spec.field}: {exc}", spec.field, "unsupported") from None


def check_method(limits: Limits, constraint: StructuredOutputs | None, prompt_k: int | None,
                 prompt_field: str = "prompt_logprobs") -> None:
    """A request for what the engine's method cannot do is a 400 here, before anything is queued
    (and before a stream's headers go out): a constraint, or the prompt's logprobs."""
    if constraint is not None and not limits.constrains:
        raise bad_request(f"{constraint.field}: the {limits.method} method cannot constrain its output",
                          constraint.field, "unsupported")
    if prompt_k is not None and not limits.scores_prompt:
        what = "prompt_logprobs" if prompt_field == "prompt_logprobs" else "echo with logprobs (the prompt's logprobs)"
        raise bad_request(f"{what}: the {limits.method} method has no next-token distribution per prompt token",
                          prompt_field, "unsupported")


def sampling_params(req: SamplingFields, limits: Limits, prompt_len: int, max_tokens: int | None,
                    seed_offset: int = 0, logprobs: int | None = None,
                    prompt_logprobs: int | None = None,
                    constraint: StructuredOutputs | None = None, max_tokens_field: str = "max_tokens") -> SamplingParams:
    """`max_tokens_field`: the request field max_tokens came from, which its errors name."""
    room = limits.max_model_len - prompt_len
    explicit = max_tokens is not None
    if not explicit:
        max_tokens = min(limits.default_max_tokens, room)
    kw: dict[str, Any] = dict(max_tokens=max_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs,
                              min_tokens=req.min_tokens,
                              skip_special_tokens=req.skip_special_tokens,
                              include_stop_str_in_output=req.include_stop_str_in_output)
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is None:
            value = limits.defaults.get(name)
        if value is not None:
            kw[name] = value
    if req.seed is not None:
        kw["seed"] = choice_seed(req.seed, seed_offset)
    if req.speculative is not None:
        n = req.speculative.num_speculative_tokens
        if not 0 <= n <= MAX_SPECULATIVE_TOKENS:
            raise bad_request(f"speculative.num_speculative_tokens={n}: must be between 0 (no drafting) and "
                              f"{MAX_SPECULATIVE_TOKENS}", "speculative.num_speculative_tokens")
        kw["num_speculative_tokens"] = n
    kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kw["stop_token_ids"] = list(req.stop_token_ids or [])
    if any(not 0 <= t < limits.vocab_size for t in kw["stop_token_ids"]):
        raise bad_request(f"stop_token_ids must be token ids of this model, in [0, {limits.vocab_size})",
                          "stop_token_ids", "invalid_token_id")
    kw["logit_bias"] = logit_bias(req.logit_bias, limits.vocab_size)
    kw["cache_salt"] = req.cache_salt
    kw["bad_words"] = list(req.bad_words or [])
    if req.allowed_token_ids is not None:
        if any(not 0 <= t < limits.vocab_size for t in req.allowed_token_ids):
            raise bad_request(f"allowed_token_ids must be token ids of this model, in [0, {limits.vocab_size})",
                              "allowed_token_ids", "invalid_token_id")
        kw["allowed_token_ids"] = list(req.allowed_token_ids)
    kw["structured_outputs"] = constraint
    if req.prediction is not None:
        c = req.prediction.content
        kw["prediction"] = c if isinstance(c, str) else "".join(part.text for part in c)
        if limits.max_prompt_chars and len(kw["prediction"]) > limits.max_prompt_chars:
            raise bad_request(f"prediction.content has {len(kw['prediction'])} characters, more than the model's "
                              f"context of {limits.max_model_len} tokens could hold", "prediction.content",
                              "context_length_exceeded")
    try:
        params = SamplingParams(**kw)
    except ParamError as exc:
        if exc.field == "max_tokens" and max_tokens_field != "max_tokens":
            raise bad_request(str(exc).replace("max_tokens", max_tokens_field, 1), max_tokens_field,
                              "invalid_value") from None
        raise bad_request(str(exc), exc.field, "invalid_value") from None
    if explicit and max_tokens > room:
        raise bad_request(f"{max_tokens_field}={max_tokens} plus the prompt's {prompt_len} tokens exceeds the "
                          f"model's context of {limits.max_model_len} tokens", max_tokens_field,
                          "context_length_exceeded")
    return params


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's logit_bias (JSON keys are strings) -> {token id: bias}; a key that is not a
    token id of this model is a 400 naming logit_bias (the values' range is SamplingParams')."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 19 and int(key) < vocab_size):
            raise bad_request(f"logit_bias: key {shorten(key)} is not a token id of this model "
                              f"(a decimal integer in [0, {vocab_size}))", "logit_bias", "invalid_token_id")
        out[int(key)] = value
    return out


def check_n(n: int, limits: Limits) -> None:
    if not 1 <= n <= limits.max_n:
        raise bad_request(f"n={n}: must be between 1 and {limits.max_n}", "n", "invalid_value")


def check_stream_options(req: Any) -> None:
    """OpenAI's and vLLM's rule: stream_options only with stream: true (else usage a client asked
    for in a stream's last chunk would never come)."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options", "invalid_value")


# --- /v1/completions ------------------------------------------------------------------------
def prepare_completion(req: CompletionRequest, limits: Limits, tokenizer: Any) -> Prepared:
    check_model(req.model, limits)
    check_n(req.n, limits)
    check_stream_options(req)
    if req.best_of is not None and req.best_of < req.n:       # OpenAI's and vLLM's rule
        raise bad_request(f"best_of={req.best_of}: must be at least n={req.n}", "best_of", "invalid_value")
    if req.suffix or (req.best_of or 1) > req.n:
        name = next(k for k in ("suffix", "best_of") if getattr(req, k))
        raise bad_request(f"{name} is not supported", name, "unsupported")
    # echo with logprobs scores the prompt too: one engine run gives both, at the larger top-k
    wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    prompt_k = max(wanted) if wanted else None
    max_tokens = req.max_tokens
    if max_tokens == 0:       # OpenAI's scoring request: the prompt and its logprobs, no completion
        if not req.echo:
            raise bad_request("max_tokens=0 needs echo: true (it returns the prompt only)", "max_tokens",
                              "invalid_value")
        max_tokens = 1        # the engine decodes one token, which the response leaves out
    p = req.prompt
    prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not prompts:
        raise bad_request("prompt is empty", "prompt", "empty_prompt")
    keep = truncation(req.truncate_prompt_tokens)
    ids = [truncated(encode_prompt(x, tokenizer, limits, keep is None), keep) for x in prompts]
    prep = Prepared(ids)
    if req.echo:
        # the prompt the engine was fed: a truncated one decoded from its kept ids
        prep.texts = [x if isinstance(x, str) and keep is None else tokenizer.decode(i) for x, i in zip(prompts, ids)]
    constraint = requested_constraint(req)
    check_method(limits, constraint, prompt_k, "prompt_logprobs" if req.prompt_logprobs is not None else "echo")
    compile_constraint(constraint, tokenizer, limits)
    for prompt_ids in ids:
        check_prompt(prompt_ids, limits)
        for j in range(req.n):
            prep.requests.append((prompt_ids, sampling_params(req, limits, len(prompt_ids), max_tokens,
                                                              j, req.logprobs, prompt_k, constraint)))
    return prep


# --- /v1/chat/completions -------------------------------------------------------------------
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")     # OpenAI's ("function" is gone)


def chat_messages(req: Any) -> list[dict]:
    """The messages as {role, content} for a template, or a 400 naming the message: OpenAI's
    roles only, and content on every message (null only on an assistant turn that calls tools)."""
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise bad_request(f"messages.{i}.role: {shorten(m.role)} is not a chat role (expected one of "
                              f"{', '.join(CHAT_ROLES)})", f"messages.{i}.role", "invalid_value")
        content = m.content
        if content is None and not (m.role == "assistant" and getattr(m, "tool_calls", None)):
            raise bad_request(f"messages.{i}.content: a {m.role} message needs content (null only on an "
                              "assistant message with tool_calls)", f"messages.{i}.content", "missing_field")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise bad_request(f"messages.{i}.content.{j}.type: {shorten(part.type)} parts are not "
                                      "supported; this server's models read text parts only",
                                      f"messages.{i}.content.{j}.type", "unsupported")
                if part.text is None:
                    raise bad_request(f"messages.{i}.content.{j}.text: a text part needs its text",
                                      f"messages.{i}.content.{j}.text", "missing_field")
            content = "\n".join(part.text for part in content)     # vLLM's and llama-server's join
        message = {"role": m.role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(m, key, None) is not None:
                message[key] = getattr(m, key)
        messages.append(message)
    if not messages:
        raise bad_request("messages must not be empty", "messages", "empty_prompt")
    return messages


# Template arguments leapfrog sets itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "continue_final_message", "tools")


def render_chat(req: ChatRequest, tokenizer: Any, limits: Limits, tools: ToolPlan | None = None) -> list[int]:
    messages = chat_messages(req)
    keep = truncation(getattr(req, "truncate_prompt_tokens", None))
    if keep is None:
        check_prompt_chars("".join(m["content"] + m["role"] for m in messages), limits, "messages")
    cont = getattr(req, "continue_final_message", False)
    if cont and req.add_generation_prompt:      # vLLM's rule: the two contradict each other
        raise bad_request("continue_final_message needs add_generation_prompt: false (the reply continues the "
                          "last message instead of starting a new one)", "continue_final_message", "invalid_value")
    if cont and messages[-1]["role"] != "assistant":
        raise bad_request(f"continue_final_message: the last message is a {messages[-1]['role']} message; only "
                          "an assistant message can be continued", "continue_final_message", "invalid_value")
    if cont and not messages[-1]["content"].strip():
        raise bad_request("continue_final_message: the final message is empty, so there is nothing to continue "
                          "(add_generation_prompt starts a new reply)", "continue_final_message", "invalid_value")
    kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
    if getattr(req, "reasoning_effort", None) is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_request(f"chat_template_kwargs.{key}: set by the request's own fields",
                              f"chat_template_kwargs.{key}", "invalid_value")
    templated = getattr(tokenizer, "has_chat_template", False)
    messages, extra = render_messages(messages, tools or ToolPlan(), templated and tokenizer.template_reads_tools)
    if templated:
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                 **{**kwargs, **extra})
        except Exception as exc:        # templates raise on e.g. unsupported roles
            raise bad_request(f"chat template failed: {exc}", "messages", "invalid_messages") from None
        if cont:
            try:
                text = open_final_message(text, messages[-1]["content"])
            except ValueError as exc:
                raise bad_request(str(exc), "continue_final_message", "invalid_messages") from None
    else:
        if not can_spell_fallback_chat(tokenizer):
            raise bad_request("this model has no chat template, and its vocabulary cannot spell the plain "
                              "'role: content' lines used in its place; send the prompt to /v1/completions",
                              "messages", "no_chat_template")
        text = fallback_chat(messages, add_generation_prompt=False)
        if cont:
            text = text.removesuffix("\n")     # the last line left open (FALLBACK_CHAT ends each with one)
        text += FALLBACK_REPLY if req.add_generation_prompt else ""
    return truncated(encode_chat(tokenizer, text), keep)


def can_spell_fallback_chat(tokenizer: Any) -> bool:
    """Whether the fallback chat lines encode without unknown tokens (a character vocabulary,
    such as the couplet model's, has no Latin letters)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return True
    probe = fallback_chat([{"role": r, "content": ""} for r in CHAT_ROLES])
    return unk not in tokenizer.encode(probe, add_special_tokens=False)


def prepare_chat(req: ChatRequest, limits: Limits, tokenizer: Any) -> Prepared:
    check_model(req.model, limits)
    check_n(req.n, limits)
    check_stream_options(req)
    if req.max_tokens is not None and req.max_completion_tokens not in (None, req.max_tokens):
        raise bad_request("max_tokens and max_completion_tokens disagree", "max_completion_tokens")
    plan = plan_tools(req)
    check_history(req.messages)
    check_tool_schemas(plan, lambda spec: compile_constraint(spec, tokenizer, limits))
    constraint = requested_constraint(req)
    if constraint is not None and plan.constraint() is not None:
        raise bad_request(f"{constraint.field}: tool_choice {plan.mode} already constrains the reply to tool calls",
                          constraint.field, "invalid_value")
    constraint = constraint or plan.constraint()
    check_method(limits, constraint, req.prompt_logprobs)
    compile_constraint(constraint, tokenizer, limits)
    ids = render_chat(req, tokenizer, limits, plan)
    check_prompt(ids, limits, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    prep = Prepared([ids], tools=plan)
    for j in range(req.n):
        prep.requests.append((ids, sampling_params(req, limits, len(ids), max_tokens, j, logprobs,
                                                   req.prompt_logprobs, constraint, field)))
    return prep


# --- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(out: RequestOutput) -> str | None:
    return FINISH_REASONS.get(out.finish_reason or "", "stop") if out.finished else None


def usage(prep: Prepared, num_completion_tokens: int, outs: Any = ()) -> dict:
    """OpenAI's usage; under a speculative method also the drafts verified for the request's
    choices: OpenAI's `completion_tokens_details` (accepted / rejected prediction tokens, its
    names for predicted outputs) and `speculative` (leapfrog's: the same counts, and why drafting
    was off for a choice, if it was: "request" or "fallback")."""
    prompt = sum(len(p) for p in prep.prompts)
    body: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": num_completion_tokens,
                            "total_tokens": prompt + num_completion_tokens}
    metrics = [o.metrics for o in outs if o is not None and o.metrics.num_drafted_tokens is not None]
    if metrics:
        drafted = sum(m.num_drafted_tokens for m in metrics)
        accepted = sum(m.num_accepted_tokens for m in metrics)
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": drafted - accepted}
        off = sorted({m.drafting_off for m in metrics if m.drafting_off})
        body["speculative"] = {"num_drafted_tokens": drafted, "num_accepted_tokens": accepted,
                               "drafting_off": off[0] if len(off) == 1 else (off or None)}
    return body


class _Pieces:
    """How a logprob entry shows each token, after the tokens before it. A token whose bytes are
    whole characters shows the text it adds there, as the streamed text adds it (so it keeps its
    SentencePiece leading space); a token inside a multi-byte character (an emoji is several
    byte tokens) shows its own bytes as OpenAI does, "bytes:\\xf0\\x9f", and `bytes` gives them
    too, so a client joins the bytes of such tokens into the text. `piece` asks of any token
    (an alternative too), `advance` moves past the one taken and returns the text it added."""

    def __init__(self, tokenizer: Any, prompt: list[int], before: list[int] = ()) -> None:
        """After `prompt` (all of it text already, as the request's detokenizer takes it) and the
        output tokens `before`, of which the last few are replayed: the text of a character
        they began is still to come, as in the stream."""
        self.tokenizer = tokenizer
        cut = max(0, len(before) - IncrementalDetokenizer.MAX_PENDING - 1)
        self.detok = IncrementalDetokenizer(tokenizer, list(prompt) + list(before[:cut]))
        self.detok.add(list(before[cut:]))

    def raw(self, token_id: int) -> bytes | None:
        """The token's own bytes (None where the tokenizer cannot say)."""
        own = getattr(self.tokenizer, "token_bytes", None)
        return None if own is None else own(token_id)

    def piece(self, token_id: int) -> str:
        return self.show(token_id)[0]

    def show(self, token_id: int) -> tuple[str, bytes]:
        """(how the token is shown, its bytes as shown: the text's, or its own inside a character)."""
        raw = self.raw(token_id)
        if raw is not None and not _whole_characters(raw):
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw
        text = self.detok.fork().add([token_id])
        if not text:
            alone = self.tokenizer.decode([token_id], skip_special_tokens=False)
            special = not self.tokenizer.decode([token_id]) and alone     # e.g. </s>: shown by name
            text = alone if special else ""
        return text, text.encode()

    def advance(self, token_id: int) -> str:
        return self.detok.add([token_id])


def _whole_characters(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _pieces(entries: list[dict], tokenizer: Any, prompt: list[int], before: list[int]):
    """Per entry: (chosen piece, its bytes, [(alternative piece, its bytes, logprob), ...], the
    text the chosen token adds), each after its context."""
    reader = _Pieces(tokenizer, prompt, before)
    for e in entries:
        tops = [(*reader.show(i), lp) for i, lp in e["top"]]
        yield (*reader.show(e["token_id"]), tops, reader.advance(e["token_id"]))


def completion_logprobs(entries: list[dict], tokenizer: Any, offset: int, prompt: list[int],
                        before: list[int] = ()) -> dict:
    """OpenAI legacy shape: parallel lists, top alternatives as {token: logprob}; `prompt` and
    `before` are the token ids before the first entry (the prompt, earlier output), `offset`
    the text length within the completion. Each offset is where the token's text begins (a
    token inside a multi-byte character: where that character begins)."""
    tokens, lps, tops, offsets = [], [], [], []
    for e, (tok, _, alternatives, added) in zip(entries, _pieces(entries, tokenizer, prompt, before)):
        tokens.append(tok)
        lps.append(e["logprob"])
        tops.append({piece: lp for piece, _, lp in alternatives})
        offsets.append(offset)
        offset += len(added)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def echo_logprobs(entries: list[dict | None], ids: list[int], tokenizer: Any, k: int) -> dict:
    """The echoed prompt's share of a completion's legacy logprobs: its first token has no
    logprob (null, as OpenAI's), the others theirs with `k` alternatives. Offsets count the
    text's characters; a special token (<s>) is shown by name but takes no room in the text."""
    tokens, lps, tops, offsets, offset = [], [], [], [], 0
    reader = _Pieces(tokenizer, [])
    for token_id, e in zip(ids, entries):
        tokens.append(reader.piece(token_id))
        lps.append(None if e is None else e["logprob"])
        tops.append(None if e is None else {reader.piece(i): lp for i, lp in e["top"][:k]})
        offsets.append(offset)
        offset += len(reader.advance(token_id))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_body(entries: list[dict | None], ids: list[int], tokenizer: Any, k: int) -> list:
    """vLLM's `prompt_logprobs`: per prompt token null (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and the `k` most likely."""
    body: list = []
    reader = _Pieces(tokenizer, [])
    for token_id, e in zip(ids, entries):
        if e is None:
            body.append(None)
            reader.advance(token_id)
            continue
        row = {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": reader.piece(i)}
               for r, (i, lp) in enumerate(e["top"][:k])}
        row.setdefault(str(token_id), {"logprob": e["logprob"], "rank": e["rank"],
                                       "decoded_token": reader.piece(token_id)})
        reader.advance(token_id)
        body.append(row)
    return body


def echo_choice(out: RequestOutput, req: CompletionRequest, prep: Prepared, tok: Any, i: int) -> tuple[str, dict | None]:
    """(text, legacy logprobs) of a completion choice's first part: the echoed prompt when
    `echo`, else nothing; the completion's own logprobs follow at the returned text's length."""
    if not req.echo:
        return "", None
    text = prep.texts[i // req.n]
    if req.logprobs is None or out.prompt_logprobs is None:
        return text, None
    return text, echo_logprobs(out.prompt_logprobs, out.prompt_token_ids, tok, req.logprobs)


def join_logprobs(head: dict | None, tail: dict | None) -> dict | None:
    if head is None or tail is None:
        return tail if head is None else head
    return {key: head[key] + tail[key] for key in head}


def chat_logprobs(entries: list[dict], tokenizer: Any, prompt: list[int], before: list[int] = ()) -> dict:
    """OpenAI's chat shape; `bytes` are the token's text's, or its own inside a character."""
    def one(tok: str, raw: bytes, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(raw)}
    return {"content": [{**one(tok, raw, e["logprob"]), "top_logprobs": [one(*alt) for alt in alternatives]}
                        for e, (tok, raw, alternatives, _) in zip(entries, _pieces(entries, tokenizer, prompt, before))]}


def completion_body(final: dict[int, RequestOutput], req: CompletionRequest, prep: Prepared, tok: Any,
                    rid: str, created: int, model: str) -> dict:
    choices = []
    for i in range(len(prep.requests)):
        out = final[i]
        head_text, head_lp = echo_choice(out, req, prep, tok, i)
        lp = (completion_logprobs(out.logprobs or [], tok, len(head_text), out.prompt_token_ids)
              if req.logprobs is not None and req.max_tokens != 0 else None)
        text = out.text if req.max_tokens != 0 else ""
        choice = {"index": i, "text": head_text + text, "logprobs": join_logprobs(head_lp, lp),
                  "finish_reason": finish_reason(out)}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs or [], out.prompt_token_ids,
                                                             tok, req.prompt_logprobs)
        if req.return_token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = out.token_ids if req.max_tokens != 0 else []
        choices.append(choice)
    n_out = sum(len(o.token_ids) for o in final.values()) if req.max_tokens != 0 else 0
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prep, n_out, final.values())}


def chat_body(final: dict[int, RequestOutput], req: ChatRequest, prep: Prepared, tok: Any,
              rid: str, created: int, model: str) -> dict:
    choices = []
    for i in range(len(prep.requests)):
        out = final[i]
        lp = chat_logprobs(out.logprobs or [], tok, out.prompt_token_ids) if req.logprobs else None
        content, calls = parse_reply(out.text, prep.tools) if out.finish_reason != "abort" else (out.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choices.append({"index": i, "message": message, "logprobs": lp,
                        "finish_reason": "tool_calls" if calls and out.finish_reason == "stop" else finish_reason(out)})
        if req.return_token_ids:
            choices[-1]["token_ids"] = out.token_ids
    n_out = sum(len(o.token_ids) for o in final.values())
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(prep, n_out, final.values())}
    if req.return_token_ids:     # vLLM's: once for the request (every choice shares the prompt)
        body["prompt_token_ids"] = final[0].prompt_token_ids
    if req.prompt_logprobs is not None:     # vLLM's: one list for the request (all choices share the prompt)
        body["prompt_logprobs"] = prompt_logprobs_body(final[0].prompt_logprobs or [], final[0].prompt_token_ids,
                                                       tok, req.prompt_logprobs)
    return body


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def now() -> int:
    return int(time.time())


# --- /tokenize and /detokenize (vLLM's) --------------------------------------------------------
def tokenize_body(req: TokenizeRequest, limits: Limits, tokenizer: Any) -> dict:
    """The ids a completion (``prompt``) or a chat request (``messages``) would feed the model,
    with their count and the model's context."""
    check_model(req.model, limits)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either prompt or messages", "prompt", "missing_field")
    if req.prompt is not None:
        check_prompt_chars(req.prompt, limits)
        ids = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    else:
        # rendered as the chat request with the same fields would render it (its tools included)
        chat = ChatRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           chat_template_kwargs=req.chat_template_kwargs, tools=req.tools)
        plan = plan_tools(chat)
        check_history(chat.messages)
        ids = render_chat(chat, tokenizer, limits, plan)
    body = {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return body


def detokenize_body(req: DetokenizeRequest, limits: Limits, tokenizer: Any) -> dict:
    check_model(req.model, limits)
    if any(t < 0 or t >= limits.vocab_size for t in req.tokens):
        raise bad_request(f"token ids must be in [0, {limits.vocab_size})", "tokens", "invalid_token_id")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
