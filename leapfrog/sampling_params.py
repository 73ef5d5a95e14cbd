"""SamplingParams: what a request asks of the sampler and of the stopping rules."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MAX_TOKENS_LIMIT = 1 << 20
MAX_SPECULATIVE_TOKENS = 64              # drafts a request may ask to verify per step
MAX_STOP_STRINGS = 64              # stop strings are searched in the text every step
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024              # entries of logit_bias
MAX_ALLOWED_TOKEN_IDS = 1 << 20    # entries of allowed_token_ids
MAX_CACHE_SALT_CHARS = 1024
MAX_BAD_WORDS = 1024
MAX_PREDICTION = 1 << 20           # characters (or token ids) of a prediction
MAX_N = 1024                       # completions a prompt in LLM.generate
LOGIT_BIAS_RANGE = 100.0           # OpenAI's: -100 bans a token, +100 all but forces it
# Temperatures below this sample greedily: dividing logits by 1e-300 overflows to inf and NaN
# (vLLM's _SAMPLING_EPS has the same role).
GREEDY_BELOW_TEMPERATURE = 1e-5
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)      # what torch.Generator.manual_seed accepts
INT64_MAX = (1 << 63) - 1
# Requests that name no max_tokens, from every entry point (Python, HTTP, the CLI).
DEFAULT_MAX_TOKENS = 256
# Request priorities (lower runs first) at or past this are background work (batch jobs): the
# scheduler runs them only in steps without live requests (engine/scheduler.py).
BACKGROUND_PRIORITY = 1 << 30


@dataclass(frozen=True, slots=True)
class Bound:
    """A numeric request field's range: the one table that SamplingParams checks, the OpenAPI
    schema publishes and the CLI flags describe. `text` is what an error says about it."""
    minimum: float | None
    maximum: float | None
    text: str
    integer: bool = False
    exclusive_minimum: bool = False

    def holds(self, value: Any) -> bool:
        if not (_is_int(value) if self.integer else _is_finite(value)):
            return False
        low = self.minimum is None or (value > self.minimum if self.exclusive_minimum else value >= self.minimum)
        return low and (self.maximum is None or value <= self.maximum)

    def json_schema(self) -> dict:
        out: dict = {}
        if self.minimum is not None:
            out["exclusiveMinimum" if self.exclusive_minimum else "minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out


MAX_LOGPROBS = 20                  # alternatives per position (logprobs, prompt_logprobs, top_logprobs)
_LOGPROBS = Bound(0, MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]", integer=True)
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(1, MAX_TOKENS_LIMIT, f"must be between 1 and {MAX_TOKENS_LIMIT}", integer=True),
    "min_tokens": Bound(0, MAX_TOKENS_LIMIT, "must be an integer between 0 and max_tokens", integer=True),
    "temperature": Bound(0, None, "must be >= 0"),
    "top_k": Bound(-1, INT64_MAX, "must be -1, 0 (off) or a positive 64-bit integer", integer=True),
    "top_p": Bound(0, 1, "must be in (0, 1]", exclusive_minimum=True),
    "min_p": Bound(0, 1, "must be in [0, 1]"),
    "repetition_penalty": Bound(1e-3, 1e6, "must be in [0.001, 1e6]"),   # 1e-300 would divide logits to inf
    "presence_penalty": Bound(-2, 2, "must be in [-2, 2]"),
    "frequency_penalty": Bound(-2, 2, "must be in [-2, 2]"),
    "seed": Bound(SEED_RANGE[0], SEED_RANGE[1], "must be an integer in [-2^63, 2^64 - 1]", integer=True),
    "logprobs": _LOGPROBS,
    "prompt_logprobs": _LOGPROBS,
    "num_speculative_tokens": Bound(0, MAX_SPECULATIVE_TOKENS, "must be an integer between 0 (no drafting) and "
                                    f"{MAX_SPECULATIVE_TOKENS}", integer=True),
}
OPTIONAL = ("seed", "logprobs", "prompt_logprobs", "num_speculative_tokens",   # None: not asked for
            "max_tokens")                                                      # None: the context's room
MAX_GRAMMAR_CHARS = 100_000        # of a schema, regex, grammar or the choices together
MAX_CHOICES = 1024


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice j of a seeded request with n choices (the server's `n` and
    LLM.generate's alike): seed + j, wrapped into 64 bits; a seed already out of range is left
    so that validation names it."""
    s = seed + j
    return s % (1 << 64) if seed <= SEED_RANGE[1] < s else s


class ParamError(ValueError):
    """A request field's bad value: `field` names it (the HTTP error's `param`), the message
    quotes the value and says what it must be."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """A constraint on a request's output (vLLM's StructuredOutputsParams): exactly one of a JSON
    Schema (`json`, a dict or its text), any JSON object (`json_object`), a regular expression,
    a list of `choice` strings, or a `grammar` (Lark, or GBNF when it has `::=` rules). Decoding
    then only ever samples tokens the constraint allows (sample/grammar.py). `field` is the request
    field it came from, named by the errors."""
    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ParamError(self.field, f"{self.field}: give exactly one of json, json_object, regex, choice "
                             f"or grammar (got {', '.join(given) or 'none'})")
        kind = given[0]
        if kind in ("regex", "grammar") and not (isinstance(getattr(self, kind), str) and getattr(self, kind)):
            raise ParamError(self.field, f"{self.field}: {kind} must be a non-empty string")
        if kind == "choice":
            if not self.choice or len(self.choice) > MAX_CHOICES or any(
                    not isinstance(c, str) or not c for c in self.choice):
                raise ParamError(self.field, f"{self.field}: choice must be 1 to {MAX_CHOICES} non-empty strings")
        if kind == "json" and not isinstance(self.json, (str, dict)):
            raise ParamError(self.field, f"{self.field}: the JSON schema must be an object (or its JSON text)")
        if self.size() > MAX_GRAMMAR_CHARS:
            raise ParamError(self.field, f"{self.field}: the {kind} has {self.size()} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are accepted")

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None) \
            if not self.json_object else "json_object"

    def size(self) -> int:
        if self.json is not None:
            return len(self.json) if isinstance(self.json, str) else len(_json_text(self.json))
        if self.choice is not None:
            return sum(len(c) for c in self.choice)
        return len(self.regex or self.grammar or "")


def _json_text(value: Any) -> str:
    import json  # deferred: `import leapfrog` does not load json
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ParamError("structured_outputs", f"the JSON schema cannot be written as JSON ({exc})") from None


SHOWN_CHARS = 60      # of a rejected value, in an error message


def shorten(value: Any) -> str:
    """repr(value) cut to SHOWN_CHARS for an error message (a 100 KB stop string must not come
    back as a 100 KB error), with the count of items when a list or dict is cut."""
    text = repr(value)
    if len(text) <= SHOWN_CHARS:
        return text
    count = f" ({len(value)} items)" if isinstance(value, (list, tuple, dict)) else f" ({len(text)} characters)"
    return text[:SHOWN_CHARS] + "..." + count


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding parameters (vLLM-compatible names).

    temperature 0 means greedy. `seed` makes a request's sampling independent of whatever
    else shares its batch: each seeded request owns a torch.Generator.
    """
    max_tokens: int | None = DEFAULT_MAX_TOKENS    # None: as many as the model's context leaves
    temperature: float = 1.0
    top_k: int = 0                     # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0    # CTRL-style, > 1 discourages repeats
    presence_penalty: float = 0.0      # OpenAI-style, subtracted once per seen token
    frequency_penalty: float = 0.0     # OpenAI-style, subtracted per occurrence
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0                # end-of-text and stop_token_ids are banned before this many
    logprobs: int | None = None        # number of top alternatives to return, 0 = chosen only
    # log-probabilities of the prompt's own tokens (vLLM's prompt_logprobs), with this many top
    # alternatives each; the first token has none. Such a prompt skips the prefix cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> added to its logit before sampling, at every step (OpenAI's and vLLM's
    # logit_bias); a request with it samples in Python, like penalties (drafts verified row by row).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Only these token ids may be sampled (vLLM's allowed_token_ids): every other logit is -inf,
    # applied where logit_bias is (Python sampling; drafts verified row by row).
    allowed_token_ids: list[int] | None = None
    # Prefix-cache isolation (vLLM's cache_salt): cached blocks are shared only between requests
    # with the same salt (engine/block_manager.py, chain_root).
    cache_salt: str | None = None
    # Words that may not be written (vLLM's bad_words): each is tokenized as it is and after a
    # space, and the last token of such a sequence is banned wherever the output so far ends
    # with the rest of it. Applied where logit_bias is (Python sampling, every verified row).
    bad_words: list[str] = field(default_factory=list)
    # Called in order on each step's logits row of this request, as processor(output_ids, row)
    # -> row (vLLM's per-request logits processors): constrained decoding (the couplet rules).
    # A request with processors samples in Python (not in the decode loop); verified drafts get
    # them row by row; block diffusion refuses them. Not part of any HTTP request.
    logits_processors: list[Callable[[list[int], Any], Any]] = field(default_factory=list)
    # A speculative method verifies at most this many drafts a step for this request; 0 turns
    # drafting off for it (None: the method's own num_speculative_tokens). HTTP: the request's
    # `speculative` object, {"num_speculative_tokens": N}.
    num_speculative_tokens: int | None = None
    # Constrained decoding: JSON Schema, regex, choice or grammar (HTTP: response_format,
    # structured_outputs, guided_*). Drafting stays on: drafts are checked against it.
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's Predicted Outputs: text (or token ids) the output is expected to repeat much of, such
    # as a file being edited. The `ngram` method drafts from it as well as from the context; the
    # output stays what decoding gives (drafts are verified), and other methods ignore it.
    prediction: str | list[int] | None = None
    # Completions to sample for each prompt (vLLM's `n`): LLM.generate runs n sequences, choice j
    # of a seeded request with seed + j, and returns them in RequestOutput.outputs. The engine
    # and the server take one sequence a request (the server fans its own `n` out).
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, empty in (("stop", list), ("stop_token_ids", list), ("bad_words", list),
                            ("logits_processors", list), ("logit_bias", dict)):
            if getattr(self, name) is None:          # vLLM's default for each (Optional there)
                setattr(self, name, empty())
        self.validate()

    def validate(self) -> None:
        """Raise ParamError (a ValueError) naming the offending field. Every number is range-checked here (BOUNDS), so
        that no value can reach a tensor constructor (where an out-of-range int fails the
        whole batch's step, not just this request)."""
        def bad(name: str, why: str) -> None:
            raise ParamError(name, f"{name}={shorten(getattr(self, name))}: {why}")
        for name in ("max_tokens", "min_tokens", "top_k", "n"):
            if not _is_int(getattr(self, name)) and not (name == "max_tokens" and self.max_tokens is None):
                bad(name, "must be an integer")
        if not 1 <= self.n <= MAX_N:
            bad("n", f"must be between 1 and {MAX_N}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not _is_finite(getattr(self, name)):
                bad(name, "must be a finite number")
        for name, bound in BOUNDS.items():
            value = getattr(self, name)
            if not (value is None and name in OPTIONAL) and not bound.holds(value):
                bad(name, bound.text)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be an integer between 0 and max_tokens ({self.max_tokens})")
        self._validate_stops(bad)
        self._validate_logit_bias(bad)
        if not isinstance(self.bad_words, list) or len(self.bad_words) > MAX_BAD_WORDS or any(
                not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_CHARS for w in self.bad_words):
            bad("bad_words", f"must be at most {MAX_BAD_WORDS} non-blank strings of at most {MAX_STOP_CHARS} "
                             "characters")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt
                                            or len(self.cache_salt) > MAX_CACHE_SALT_CHARS):
            bad("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if self.allowed_token_ids is not None:
            a = self.allowed_token_ids
            if not isinstance(a, list) or not a or len(a) > MAX_ALLOWED_TOKEN_IDS or any(
                    not _is_int(t) or not 0 <= t <= INT64_MAX for t in a):
                bad("allowed_token_ids", f"must be a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} "
                                         "non-negative token ids")
            if self.structured_outputs is not None:
                bad("allowed_token_ids", "cannot be combined with a structured output constraint (the "
                                         "constraint decides which tokens may follow)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ParamError("structured_outputs", "structured_outputs must be a StructuredOutputs")
        if self.prediction is not None:
            p = self.prediction
            if not isinstance(p, (str, list)) or (isinstance(p, list) and any(
                    not _is_int(t) or not 0 <= t <= INT64_MAX for t in p)):
                bad("prediction", "must be a string or a list of non-negative token ids")
            if len(p) > MAX_PREDICTION:
                bad("prediction", f"at most {MAX_PREDICTION} characters or token ids")
        if any(not callable(f) for f in self.logits_processors):
            raise ParamError("logits_processors", "logits_processors must be callables (output_ids, logits) -> logits")

    def _validate_stops(self, bad) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            bad("stop", f"must be non-empty strings of at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            bad("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} token ids")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")

    def _validate_logit_bias(self, bad) -> None:
        if not isinstance(self.logit_bias, dict):
            bad("logit_bias", "must map token ids to numbers")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids")
        for token, value in self.logit_bias.items():
            if not _is_int(token) or not 0 <= token <= INT64_MAX:
                raise ParamError("logit_bias", f"logit_bias: token id {shorten(token)} must be a non-negative integer")
            if not _is_finite(value) or abs(value) > LOGIT_BIAS_RANGE:
                raise ParamError("logit_bias", f"logit_bias: the bias of token {token} is {shorten(value)}; it must be "
                                 f"a number in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def loop_samples(self) -> bool:
        """Whether the C++ decode loop can sample this request's tokens itself (min_tokens bans
        and grammar masks included); else its steps return logits to the Python sampler."""
        return (self.logprobs is None and self.repetition_penalty == 1.0 and not self.presence_penalty
                and not self.frequency_penalty and not self.logits_processors and not self.logit_bias
                and self.allowed_token_ids is None and not self.bad_words
                and (self.structured_outputs is None or self.min_tokens == 0))

    @property
    def needs_penalties(self) -> bool:
        """Anything that rewrites logits per request (min_tokens bans end tokens)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.min_tokens > 0 or bool(self.logits_processors)
                or bool(self.logit_bias) or self.structured_outputs is not None or self.allowed_token_ids is not None
                or bool(self.bad_words))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# generation_config.json keys that become request defaults (vLLM's `--generation-config auto`)
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(folder) -> dict:
    """The sampling defaults a checkpoint folder's generation_config.json asks for, as
    SamplingParams fields, for requests that leave them out: ``do_sample: false`` means greedy
    (temperature 0, as in transformers); otherwise temperature, top_p, top_k, min_p and
    repetition_penalty where given. No file: {}. A malformed file or value raises ValueError
    naming the file and the key."""
    import json  # deferred: `import leapfrog` does not load json

    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    out: dict = {}
    for key in GENERATION_CONFIG_KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"{path}: {key}={value!r}: expected a number")
        out[key] = int(value) if key == "top_k" else float(value)
    if cfg.get("do_sample") is False:       # greedy: the sampling knobs do not apply
        out = {k: v for k, v in out.items() if k == "repetition_penalty"}
        out["temperature"] = 0.0
    try:
        SamplingParams(**out)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return out


def defaults_for_model(model, warn) -> dict:
    """model_sampling_defaults for a built-in name or folder: {} when the model cannot be found
    or its file is broken (whoever loads it reports that), and {} after ``warn(message)`` for a malformed
    generation_config.json, so a bad file never stops serving."""
    # deferred: config loads torch, which `import leapfrog` must not
    from leapfrog.config import resolve_model
    try:
        path = resolve_model(model)
    except (FileNotFoundError, ValueError):      # not there, or a broken checkpoint file
        return {}
    try:
        return model_sampling_defaults(path)
    except ValueError as exc:
        warn(f"ignoring the model's sampling defaults: {exc}")
        return {}
