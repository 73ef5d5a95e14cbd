"""Structured outputs: a request's constraint (sampling_params.StructuredOutputs) compiled by
llguidance into a matcher, which gives before each sampled token the bitmask of the tokens that
keep the output inside the constraint.

The matcher follows a request's history lazily: `sync` rolls back what it consumed beyond the
common prefix with the history asked for and consumes the rest, so one matcher serves a plain
step, a verify step's rows (row j after drafts[:j]) and the next step after some drafts were
rejected. Compiled grammars are cached per tokenizer (a repeated schema costs a copy)."""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from leapfrog.sampling_params import ParamError, StructuredOutputs

# JSON is written compactly, with Python's separators: no free whitespace, which a small model
# may otherwise repeat until max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# For the same reason a JSON constraint ends a run of digits once it is this long and the grammar
# lets something else follow: a schema bounds a number's value, never its digits, and a small
# model may write "1.000..." until max_tokens. Twenty digits hold any int64 and more than a
# double's precision; a grammar that wants more digits (a pattern) still gets them.
MAX_DIGIT_RUN = 20
_DIGITS = b"0123456789"
CACHE_SIZE = 256                 # compiled grammars kept per tokenizer
MAX_ERROR_CHARS = 400
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$")


def _llguidance() -> Any:
    try:
        # deferred: llguidance loads only for structured outputs
        import llguidance
    except ImportError as exc:          # a dependency of the package: only a broken install lacks it
        raise RuntimeError(f"structured outputs need the llguidance package ({exc})") from None
    return llguidance


def escape_regex(text: str) -> str:
    """A regex matching `text` literally (only the characters with a meaning outside a class
    are escaped: the regex engine rejects escapes of others, such as a space)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint (its compile errors come later, from the matcher)."""
    llg = _llguidance()
    lm = llg.LLMatcher
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ParamError(spec.field, f"{spec.field}: the schema is not valid JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise ParamError(spec.field, f"{spec.field}: a JSON schema must be an object, not {type(schema).__name__}")
        try:
            return lm.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise ParamError(spec.field, f"{spec.field}: {_short(str(exc))}") from None
    if spec.regex is not None:         # \d and \w mean ASCII, as in JSON Schema patterns
        return lm.grammar_from_lark(f"start: /{llg.regex_to_lark(spec.regex, 'dw')}/")
    if spec.choice is not None:
        return lm.grammar_from_regex("|".join(f"({escape_regex(c)})" for c in spec.choice))
    text = spec.grammar
    if "::=" in text:                  # GBNF (llama.cpp's grammars): llguidance converts it to Lark
        # deferred: llguidance loads only for structured outputs
        from llguidance.gbnf_to_lark import gbnf_to_lark
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:       # the converter raises plain exceptions on a malformed rule
            raise ParamError(spec.field, f"{spec.field}: not a valid GBNF grammar ({_short(str(exc))})") from None
    return lm.grammar_from_lark(text)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def _cache_key(spec: StructuredOutputs) -> tuple:
    if spec.json is not None and not isinstance(spec.json, str):
        # not sorted: a schema's property order is the order its JSON is written in
        return "json", json.dumps(spec.json)
    return spec.kind, spec.json if spec.json is not None else (spec.regex or spec.grammar or spec.choice)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary width (the model's logits), with an
    LRU cache of compiled matchers to copy. Thread-safe: the server compiles a request's grammar
    when it is received (a bad one is a 400 before anything is queued), the engine copies it."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        llg = _llguidance()
        spec = getattr(tokenizer, "hf_json", lambda: None)()
        if spec is None:
            raise ValueError("structured outputs need a tokenizer.json (a Hugging Face fast tokenizer); "
                             "this model has none")
        eos = list(getattr(tokenizer, "eos_token_ids", []) or [])
        self.vocab_size = max(int(vocab_size), int(tokenizer.vocab_size))
        self.width = int(vocab_size)            # the model's logits: tokens past them cannot be sampled
        self.lltok = llg.LLTokenizer(spec, n_vocab=self.vocab_size, eos_token=eos or None)
        self.limits = llg.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compile_seconds: list[float] = []      # of each cache miss, for the benchmark's p50/p99
        self.num_hits = 0
        self.digits = DigitRuns(self.lltok, self.vocab_size)
        self.eos = frozenset(eos)
        # special tokens other than the end are never part of a constrained text (a SentencePiece
        # <unk> may otherwise stand in for text the vocabulary cannot spell)
        bits = np.ones(((self.vocab_size + 31) // 32) * 32, dtype=bool)
        banned = [t for t in getattr(tokenizer, "special_token_ids", ()) if t not in self.eos and 0 <= t < self.vocab_size]
        bits[banned] = False
        self.plain = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32))

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled matcher of `spec` (shared: copy it), or ParamError naming spec.field."""
        key = _cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.num_hits += 1
                return hit
        t0 = time.perf_counter()
        llg = _llguidance()
        matcher = llg.LLMatcher(self.lltok, grammar_text(spec), log_level=0, limits=self.limits)
        if not matcher.is_error():
            # some grammars fail only when their first mask is computed (a schema that refers
            # to itself and nothing else); a copy computes it, so those are a 400 too
            probe = matcher.deep_copy()
            first = torch.from_numpy(np.frombuffer(probe.compute_bitmask(), dtype=np.int32).copy())
            first = first[:self.plain.numel()] & self.plain[:first.numel()]
            if probe.is_error():
                matcher = probe
            elif not any_allowed(first, self.width):
                raise ParamError(spec.field, f"{spec.field}: no token of this model's vocabulary begins the "
                                 f"{spec.kind}")
        if matcher.is_error():
            raise ParamError(spec.field, f"{spec.field}: the {spec.kind} cannot be compiled: "
                             f"{_short(matcher.get_error())}")
        elapsed = time.perf_counter() - t0
        with self._lock:
            self.compile_seconds.append(elapsed)
            del self.compile_seconds[:-4096]
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutputs) -> "GrammarMatch":
        """A fresh matcher of `spec` for one request (JSON kinds with the digit-run cap)."""
        digits = self.digits if spec.kind in ("json", "json_object") else None
        return GrammarMatch(self.compile(spec).deep_copy(), self.vocab_size, digits, self.eos, spec, self.width,
                            self.plain)


class DigitRuns:
    """Per token of a vocabulary: how many ASCII digits its text ends with, whether it is all
    digits, and the bitmask words of the all-digit tokens (what MAX_DIGIT_RUN takes away)."""

    def __init__(self, lltok: Any, vocab_size: int) -> None:
        n = min(int(lltok.vocab_size), vocab_size)
        texts = [b"" if lltok.is_special_token(t) else lltok.decode_bytes([t]) for t in range(n)]
        trailing = [len(text) - len(text.rstrip(_DIGITS)) for text in texts]
        self.trailing = np.zeros(vocab_size, dtype=np.int32)
        self.trailing[:n] = trailing
        self.whole = np.zeros(vocab_size, dtype=bool)
        self.whole[:n] = [0 < k == len(text) for k, text in zip(trailing, texts)]
        bits = np.zeros(((vocab_size + 31) // 32) * 32, dtype=bool)
        bits[:vocab_size] = self.whole
        self.keep = torch.from_numpy(~np.packbits(bits, bitorder="little").view(np.int32))

    def run(self, tokens: list[int]) -> int:
        """The length of the digit run that `tokens`' text ends with (counted up to the cap)."""
        run = 0
        for t in reversed(tokens):
            run += int(self.trailing[t])
            if not self.whole[t] or run >= MAX_DIGIT_RUN:
                break
        return run


_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer: Any, vocab_size: int) -> GrammarCompiler:
    """The tokenizer's GrammarCompiler for logits `vocab_size` wide (made on first use, kept on
    the tokenizer object, so the server's and the engine's threads share one cache)."""
    with _COMPILERS_LOCK:
        table = getattr(tokenizer, "_grammar_compilers", None)
        if table is None:
            table = {}
            tokenizer._grammar_compilers = table
        if vocab_size not in table:
            table[vocab_size] = GrammarCompiler(tokenizer, vocab_size)
        return table[vocab_size]


class GrammarError(ParamError):
    """A constraint that compiled but cannot go on while decoding: past the grammar engine's
    limits (a row of the parser's items too long), or no token of the vocabulary continues it.
    The request fails with a 400 naming its field, rather than going on unconstrained."""


class GrammarMatch:
    """One request's matcher and the tokens it has consumed (its output, then perhaps drafts)."""
    __slots__ = ("matcher", "consumed", "vocab_size", "words", "digits", "eos", "spec", "width", "plain")

    def __init__(self, matcher: Any, vocab_size: int, digits: DigitRuns | None = None,
                 eos: frozenset = frozenset(), spec: StructuredOutputs | None = None,
                 width: int | None = None, plain: torch.Tensor | None = None) -> None:
        self.matcher = matcher
        self.consumed: list[int] = []
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.digits = digits            # JSON kinds: end digit runs at MAX_DIGIT_RUN
        self.eos = eos
        self.spec = spec
        self.width = vocab_size if width is None else width      # the logits a mask is applied to
        self.plain = plain              # the words of the tokens a constrained text may hold

    def _fail(self, why: str) -> None:
        field = self.spec.field if self.spec is not None else "structured_outputs"
        kind = self.spec.kind if self.spec is not None else "constraint"
        raise GrammarError(field, f"{field}: the {kind} {why}")

    def _check(self) -> None:
        """Raise GrammarError when the matcher has failed (it then allows every token)."""
        if self.matcher.is_error():
            self._fail(f"went past the grammar engine's limits while decoding: {_short(self.matcher.get_error())}")

    def sync(self, history: list[int]) -> bool:
        """Stand after `history` (the request's output tokens, then drafts); False when some of
        it breaks the constraint (the matcher then stands after its longest valid prefix). End
        tokens after the constraint has ended are allowed and not fed to the matcher."""
        n = 0
        limit = min(len(self.consumed), len(history))
        while n < limit and self.consumed[n] == history[n]:
            n += 1
        if n < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - n)
            del self.consumed[n:]
        rest = history[n:]
        if not rest:
            return True
        took = self.matcher.try_consume_tokens(rest)
        self.consumed.extend(rest[:took])
        self._check()
        if took == len(rest):
            return True
        # Past the constraint's end (ignore_eos keeps a request going): the mask of a stopped
        # matcher allows only the end tokens, and those change nothing.
        return self.matcher.is_stopped() and all(t in self.eos for t in rest[took:])

    def num_valid(self, output: list[int], drafts: list[int]) -> int:
        """How many of `drafts`, after `output`, the constraint allows in a row."""
        if not drafts or not self.sync(output):
            return 0
        return self.matcher.validate_tokens(drafts)

    def fill(self, row: torch.Tensor) -> None:
        """The allowed tokens of the current state, one bit each, into `row` (int32, contiguous).
        After MAX_DIGIT_RUN digits, a JSON constraint's all-digit tokens are taken away where the
        grammar allows anything else."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        self._check()
        if self.plain is not None:
            row &= self.plain[:row.numel()]
        if not any_allowed(row, self.width):
            self._fail(f"cannot go on after {len(self.consumed)} tokens: no token of this model's vocabulary "
                       "continues it")
        if self.digits is not None and self.digits.run(self.consumed) >= MAX_DIGIT_RUN:
            kept = row & self.digits.keep[:row.numel()]
            if bool(kept.any()):
                row.copy_(kept)

    def mask_rows(self, logits: torch.Tensor, output: list[int], drafts: list[int]) -> None:
        """Row j of `logits` (one request's verify step, or its one row) becomes the constrained
        distribution after output + drafts[:j], in place. Rows after a draft the constraint
        rejects are left as they are: verification never reaches them. Every row reached gets
        the whole mask, greedy ones too: llguidance's check of one token (validate_tokens) can
        pass a token its mask bans (a `"` where the mask wants `":`), so an unmasked argmax the
        check allows is not always the masked argmax."""
        rows = logits.shape[0]
        bits = torch.zeros(rows, self.words, dtype=torch.int32)
        reached = 0
        for j in range(rows):
            if not self.sync(output + drafts[:j]):
                if j == 0:      # every output token was sampled under the mask
                    raise RuntimeError(f"the output broke its {self.spec.kind if self.spec else 'constraint'} "
                                       f"after {len(self.consumed)} tokens")
                break
            self.fill(bits[j])
            reached += 1
        if reached:
            apply_bitmask(logits[:reached], bits[:reached])


class LoopMasks:
    """The grammar masks of one C++ decode-loop call (csrc/decode_loop.cpp): called before each
    step's sampling with the tokens the call has produced so far, it brings each constrained
    row's matcher up to date and writes that row's allowed tokens into `bits`."""

    def __init__(self, seqs: list[Any]) -> None:
        self.seqs = seqs
        self.outputs = [s.output_ids if s.grammar is not None else None for s in seqs]
        words = next(s.grammar.words for s in seqs if s.grammar is not None)
        self.bits = torch.full((len(seqs), words), -1, dtype=torch.int32)
        self.rows = torch.tensor([s.grammar is not None for s in seqs], dtype=torch.uint8)

    def __call__(self, out: torch.Tensor, produced: torch.Tensor) -> None:
        for b, seq in enumerate(self.seqs):
            if seq.grammar is None:
                continue
            n = int(produced[b])
            history = self.outputs[b] + out[b, :n].tolist() if n else self.outputs[b]
            if not seq.grammar.sync(history):
                raise RuntimeError(f"the output broke its constraint after {len(seq.grammar.consumed)} tokens")
            seq.grammar.fill(self.bits[b])

    def loop_args(self) -> tuple:
        """LoopCall.masks."""
        return self.bits, self.rows, self


def any_allowed(row: torch.Tensor, width: int) -> bool:
    """Whether a bitmask row (int32 words) allows some token below `width`."""
    full, rest = divmod(width, 32)
    if bool(row[:full].any()):
        return True
    return bool(rest) and full < row.numel() and bool(int(row[full]) & ((1 << rest) - 1))


def apply_bitmask(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in `bits` ([rows, words] int32, bit t % 32 of
    word t // 32) is 0; columns past the mask are disallowed too."""
    rows, vocab = logits.shape
    unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")
    width = min(vocab, unpacked.shape[1])
    banned = np.ones((rows, vocab), dtype=bool)
    banned[:, :width] = unpacked[:, :width] == 0
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        np.putmask(logits.numpy(), banned, -np.inf)        # in place, without torch's thread pool
    else:
        logits.masked_fill_(torch.from_numpy(banned).to(logits.device), float("-inf"))
