"""Request bodies (pydantic, strict) and the OpenAI error shape.

Bodies are strict (no "5" for 5) and closed (an unknown field is an error): a typo such as
`max_token` silently ignored would cost a user far more than a 400 does.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error with an HTTP status that says whose fault it was; rendered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class StrictModel(BaseModel):
    # NaN and infinity are not numbers a request can mean (Python's json accepts `NaN`)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SamplingFields(StrictModel):
    """Fields shared by /generate, /v1/completions and /v1/chat/completions."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0                    # extension (vLLM's): no end of text before this many
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None   # token id (a decimal string, as JSON keys are) -> bias
    allowed_token_ids: list[int] | None = None   # extension (vLLM's): only these may be sampled
    cache_salt: str | None = None          # extension (vLLM's): share cached prefixes only under this salt
    bad_words: list[str] | None = None     # extension (vLLM's): words that may not be written
    stream: bool = False
    priority: int = 0                      # extension (vLLM's): lower runs first
    user: str | None = None
    speculative: SpeculativeOptions | None = None   # extension: per-request drafting cap or off
    prediction: Prediction | None = None   # OpenAI's Predicted Outputs: text the output will repeat much of
    # Constrained decoding (vLLM's names; response_format is OpenAI's): at most one of them.
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None          # Lark, or GBNF (rules written `name ::= ...`)


class SpeculativeOptions(StrictModel):
    """A request's control of speculative decoding: verify at most this many drafts a step
    (0: no drafting for this request). Ignored by methods that do not draft."""
    num_speculative_tokens: int


class PredictionPart(StrictModel):
    type: Literal["text"]
    text: str


class Prediction(StrictModel):
    """OpenAI's `prediction`: {"type": "content", "content": text or text parts}."""
    type: Literal["content"]
    content: str | list[PredictionPart]


class StreamOptions(StrictModel):
    include_usage: bool = False


class StructuredOutputsField(StrictModel):
    """vLLM's structured_outputs: exactly one constraint."""
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(StrictModel):
    """OpenAI's response_format.json_schema. The schema is always enforced (`strict` or not)."""
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's response_format: text (the default), any JSON object, or JSON matching a schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerateRequest(SamplingFields):
    prompt: str | list[int] | None = None  # required (a guest may accept another form: couplet.py)
    max_length: int | None = None          # alias of max_tokens: new tokens, not prompt + new


class FaultRequest(StrictModel):
    """POST /admin/fault (only with --fault-injection)."""
    fault: str
    model: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    n: int = 1
    logprobs: int | None = None
    echo: bool = False                     # the prompt before the completion (and its logprobs, with logprobs)
    prompt_logprobs: int | None = None     # extension (vLLM's): each prompt token's logprob, top-k
    best_of: int | None = None
    suffix: str | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    truncate_prompt_tokens: int | None = None   # extension (vLLM's): keep only the prompt's last k tokens
    return_token_ids: bool = False         # extension (vLLM's): each choice's prompt_token_ids and token_ids


class ContentPart(StrictModel):
    # extra allowed so an image or audio part reaches chat_messages, which names it in its 400
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)   # tool_calls etc. pass through
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage]
    n: int = 1
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None     # extension (vLLM's): each prompt token's logprob, top-k
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    # extensions (vLLM's): the last (assistant) message left open for the model to continue;
    # keyword arguments for the chat template (e.g. a model's enable_thinking); keep only the
    # rendered prompt's last k tokens
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    truncate_prompt_tokens: int | None = None
    return_token_ids: bool = False         # extension (vLLM's): prompt_token_ids, each choice's token_ids
    # OpenAI's fields for its own service, taken so that clients sending them are served:
    # reasoning_effort reaches the chat template (as vLLM hands it on); the others change nothing
    # here (no completion is stored, there is one service tier, prefix caching needs no key)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[Literal["text"]] | None = Field(None, max_length=1)    # a text reply is what there is
    tools: list[dict] | None = Field(None, max_length=128)     # OpenAI's tool objects (serve/tools.py checks them)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None      # None: true, OpenAI's default


class TokenizeRequest(StrictModel):
    """POST /tokenize (vLLM's): a prompt, or chat messages rendered by the model's template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True        # the prompt form: BOS as a completion's prompt gets it
    # the messages form, with the chat request's own fields that change what is rendered
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = Field(None, max_length=128)
    return_token_strs: bool = False        # vLLM's: also each id's vocabulary entry


class DetokenizeRequest(StrictModel):
    """POST /detokenize (vLLM's): token ids -> text."""
    model: str | None = None
    tokens: list[int]


_TOO_DEEP = "request body nests arrays or objects too deeply"


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """JSON bytes -> validated model, or a 400 naming the first offending field."""
    try:
        data = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:          # e.g. an integer of more than 4,300 digits
        raise bad_request(f"request body has a number out of range: {exc}") from None
    except RecursionError:             # arrays or objects nested about a thousand deep
        raise bad_request(_TOO_DEEP) from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        _check_strings(data, "")
        return model.model_validate(data)
    except RecursionError:             # nesting the decoder took but the checks cannot walk
        raise bad_request(_TOO_DEEP) from None
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"] if not _is_type_tag(str(p)))
        if err["type"] == "extra_forbidden":
            raise bad_request(f"unknown field {loc!r}", loc, "unknown_field") from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field {loc!r}", loc, "missing_field") from None
        got = json.dumps(err.get("input"))[:80]
        raise bad_request(f"{loc}: {err['msg'].lower()} (got {got})", loc, "invalid_type") from None


def _check_strings(value: Any, path: str) -> None:
    """JSON may escape a lone UTF-16 surrogate (\\ud800); Python keeps it in the str, and it
    cannot be encoded (tokenizers, logs and responses fail on it). Reject it naming the field."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                name = path or "body"
                raise bad_request(f"{name}: contains a lone UTF-16 surrogate, which is not valid Unicode",
                                  name, "invalid_unicode") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, path or "body")
            _check_strings(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        for i, item in enumerate(value):
            _check_strings(item, f"{path}.{i}")


def _is_type_tag(part: str) -> bool:
    """Union errors put the tried type into `loc` ('prompt', 'list[int]', 0); drop those."""
    return "[" in part or part in _TYPE_TAGS or part.startswith("function-")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "ContentPart", "StreamOptions",
              "SpeculativeOptions", "StructuredOutputsField", "JsonSchemaFormat", "ResponseFormat"}
