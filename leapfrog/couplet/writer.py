"""The couplet writer: keywords in, a couplet (上联, 下联, 横批) out, with the couplet rules
enforced while the model decodes.

The built-in `couplets` model writes a whole couplet from keywords in its keyword mode
(leapfrog.data.couplets: prompt ``关键词：马年 吉祥\\n``, completion ``上联：…\\n下联：…\\n横批：…``);
its vocabulary is one token per Chinese character, so a rule on characters is a rule on tokens.
Constrained writing runs that mode in three rounds, each line a request of its own whose prompt
holds everything written so far, and each line's request carries a logits processor
(`LineRule`) that allows only what the rules allow:

* 上联: Chinese characters only, as many as the candidate's length (7 or 5: the lengths of
  most spring couplets; left free, the line could end only where an oblique character happened to
  come, and ran on past where the model meant to stop), its last one oblique-tone (仄).
* 下联: exactly as many characters as the 上联 (the end is banned before and forced at that
  length); never the 上联's character at the same position, no repeat the 上联 lacks, and a
  repeat where the 上联 has one (rules.allowed_next); its last character level-tone (平).
* 横批: exactly four characters, then the end of text.

Keywords are placed two ways, and the candidates compete: every line's processor raises the
logits of keyword characters not yet written (`boost`), and half of the candidates start the
上联 with the first keyword (and the 下联 with the second when it has the same length: 马年… /
吉祥…), and take the keywords as the 横批 when they are four characters in all. The candidates
(`num_candidates`, each sampled with its own seed) are reranked: most rules held first (the
tone rule is checked again with each line read in context), then the model's own mean
log-probability of the characters it chose (the raw distribution, before the processors).

Unconstrained writing (`constrained=False`) is the model alone: one sampled keyword-mode
completion, parsed, its rules checked, nothing enforced or reranked; the quality benchmark
compares the two.

The writer does not run the model itself: `plan()` is a generator that yields a round of jobs
(prompt token ids + SamplingParams), is sent their outputs, and returns the `Couplet`.
`write()` drives it with an `LLM`; the server drives it with its async engine, so a thousand
users' rounds share the engine's batches.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from leapfrog.couplet import rules
from leapfrog.data.couplets import DOWN, SCROLL, UP, keyword_prompt, parse_keyword_completion
from leapfrog.sampling_params import SamplingParams

UPPER_LENGTHS = (7, 7, 5, 7)      # candidate i's 上联 has UPPER_LENGTHS[i % 4] characters
HORIZONTAL = 4
BOOST = 1.0               # logit bonus of a keyword character not written yet
TEMPERATURE, TOP_P = 0.7, 0.9
FORMAT_CHARS = "关键词上联下联横批"     # the keyword format's own characters: a model without them was not trained on it


@dataclass(slots=True)
class Job:
    prompt: list[int]
    params: SamplingParams


@dataclass(slots=True)
class Couplet:
    upper: str
    lower: str
    horizontal: str
    keywords: list[str]
    rules: dict[str, bool]
    score: float                       # mean log-probability of the characters the model chose
    seconds: float = 0.0
    constrained: bool = True
    num_candidates: int = 1

    def as_dict(self) -> dict:
        return {"upper": self.upper, "lower": self.lower, "horizontal": self.horizontal,
                "keywords": self.keywords, "rules": self.rules, "all_rules_hold": rules.all_hold(self.rules),
                "score": self.score, "constrained": self.constrained, "num_candidates": self.num_candidates,
                "timing": {"seconds": self.seconds}}

    def text(self) -> str:
        return f"{UP}{self.upper}\n{DOWN}{self.lower}\n{SCROLL}{self.horizontal}"


class Vocab:
    """The tokenizer's ids seen as characters: which token is which single Chinese character,
    its tone class, the newline and end-of-text ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        size = tokenizer.vocab_size
        strings = [tokenizer.decode([i]) for i in range(size)]
        self.char_of: list[str | None] = [s if len(s) == 1 and rules.is_cjk(s) else None for s in strings]
        self.id_of = {c: i for i, c in enumerate(self.char_of) if c is not None}
        self.hanzi = torch.tensor([c is not None for c in self.char_of])
        level, oblique = rules.level_and_oblique([c or "" for c in self.char_of])
        self.level = torch.zeros(size, dtype=torch.bool)
        self.level[level] = True
        self.oblique = torch.zeros(size, dtype=torch.bool)
        self.oblique[oblique] = True
        newline = [i for i, s in enumerate(strings) if s == "\n"]
        missing = [c for c in rules.hanzi(FORMAT_CHARS) if c not in self.id_of]
        if not newline or missing:
            raise ValueError("the couplet writer needs a model trained on the keyword format (关键词：… → "
                             "上联：…, 下联：…, 横批：…) with one token per Chinese character and a newline token, "
                             "as the built-in `couplets` model has")
        self.newline = newline[0]
        self.eos = list(tokenizer.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        """Text continuing a prompt: no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chars(self, ids: list[int]) -> str:
        return "".join(self.char_of[t] or "" for t in ids if 0 <= t < len(self.char_of))


class LineRule:
    """Logits processor for one line of Chinese characters (see the module docstring). `prefix`
    is the part of the line already in the prompt (a forced keyword); `upper` makes it a 下联
    (position rules against that 上联); `end_tone` is the allowed class of the last character
    (vocab.level or vocab.oblique, or None); `end` the token that ends the line; `boost` the
    keyword characters to favour."""

    def __init__(self, vocab: Vocab, prefix: str, min_len: int, max_len: int, end: int,
                 end_tone: torch.Tensor | None = None, upper: str | None = None, boost: str = "",
                 written: str = "") -> None:
        self.vocab, self.prefix, self.min_len, self.max_len = vocab, prefix, min_len, max_len
        self.end, self.end_tone, self.upper = end, end_tone, upper
        # keyword characters not in the earlier lines (`written`) get BOOST until this line has them
        self.boost = [vocab.id_of[c] for c in dict.fromkeys(boost) if c in vocab.id_of and c not in written]

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        v = self.vocab
        line = self.prefix + v.chars(output_ids)
        n = len(line)
        allowed = torch.zeros_like(v.hanzi)
        if n < self.max_len:
            allowed |= v.hanzi
            if self.upper is not None:
                must, banned = rules.allowed_next(self.upper, line)
                if must is not None and must in v.id_of:
                    allowed.zero_()
                    allowed[v.id_of[must]] = True
                else:
                    allowed[[v.id_of[c] for c in banned if c in v.id_of]] = False
            if n >= 2 and line[-1] == line[-2] and line[-1] in v.id_of:
                allowed[v.id_of[line[-1]]] = False    # no character three times in a row
            if self.end_tone is not None and n == self.max_len - 1 and bool((allowed & self.end_tone).any()):
                allowed &= self.end_tone           # the last position: a character the line may end on
        if n >= self.min_len and (self.end_tone is None or bool(self.end_tone[v.id_of.get(line[-1], 0)])):
            allowed[self.end] = True
        if not bool(allowed.any()):                # nothing the rules allow: end the line (check() tells)
            allowed[self.end] = True
        if allowed.shape[0] < row.shape[0]:         # logits padded past the vocabulary
            allowed = torch.cat([allowed, allowed.new_zeros(row.shape[0] - allowed.shape[0])])
        row = row.masked_fill(~allowed[:row.shape[0]], float("-inf"))
        todo = [t for t in self.boost if v.char_of[t] not in line]
        if todo:
            row[todo] += BOOST
        return row


class CoupletWriter:
    def __init__(self, tokenizer: Any, num_candidates: int = 4) -> None:
        if num_candidates < 1:
            raise ValueError(f"num_candidates={num_candidates}: must be >= 1")
        self.vocab = Vocab(tokenizer)
        self.num_candidates = num_candidates

    # --- the plan ---------------------------------------------------------------------------
    def plan(self, keywords: list[str], seed: int | None = None, constrained: bool = True,
             num_candidates: int | None = None) -> Generator[list[Job], list[Any], Couplet]:
        """Yields rounds of jobs, is sent each round's outputs (RequestOutput-like: token_ids,
        logprobs), returns the Couplet."""
        seed = random.randrange(1 << 31) if seed is None else seed
        base = self.vocab.tokenizer.encode(keyword_prompt(keywords))
        if not constrained:
            outs = yield [Job(base, self._params(seed, 64, []))]
            parts = parse_keyword_completion(self.vocab.tokenizer.decode(outs[0].token_ids))
            up, low, hor = parts["上联"], parts["下联"], parts["横批"]
            return Couplet(up, low, hor, keywords, rules.check(up, low, hor, keywords), _score(outs),
                           constrained=False)
        v, k = self.vocab, num_candidates or self.num_candidates
        joined = "".join(keywords)
        plans = [self._placement(keywords, i) for i in range(k)]
        seeds = [(seed * 7919 + i) % (1 << 63) for i in range(k)]
        # round 1: the 上联s
        lengths = [max(UPPER_LENGTHS[i % len(UPPER_LENGTHS)], len(p[0]) + 2) for i, p in enumerate(plans)]
        jobs = [Job(base + v.encode(UP + up_pre),
                    self._params(s, n + 1, [LineRule(v, up_pre, n, n, v.newline, v.oblique, None, joined)]))
                for (up_pre, _, _), s, n in zip(plans, seeds, lengths)]
        outs = yield jobs
        uppers = [up_pre + v.chars(o.token_ids) for (up_pre, _, _), o in zip(plans, outs)]
        scored = [[o] for o in outs]          # every round's output of each candidate, for its score
        # round 2: the 下联s, as long as their 上联
        lows_pre = [lo if len(lo) < len(u) and not _clash(u, lo) else "" for (_, lo, _), u in zip(plans, uppers)]
        jobs = [Job(base + v.encode(f"{UP}{u}\n{DOWN}{lo}"),
                    self._params(s + 1, len(u) + 1, [LineRule(v, lo, len(u), len(u), v.newline, v.level, u,
                                                              joined, u)]))
                for u, lo, s in zip(uppers, lows_pre, seeds)]
        outs = yield jobs
        lowers = [lo + v.chars(o.token_ids) for lo, o in zip(lows_pre, outs)]
        for sc, o in zip(scored, outs):
            sc.append(o)
        # round 3: the 横批s
        end = v.eos[0] if v.eos else v.newline
        jobs = [Job(base + v.encode(f"{UP}{u}\n{DOWN}{lo}\n{SCROLL}{h}"),
                    self._params(s + 2, HORIZONTAL + 1, [LineRule(v, h, HORIZONTAL, HORIZONTAL, end, None, None,
                                                                  joined, u + lo)]))
                for u, lo, (_, _, h), s in zip(uppers, lowers, plans, seeds)]
        outs = yield jobs
        cands = []
        for i, (u, lo, (_, _, h), o) in enumerate(zip(uppers, lowers, plans, outs)):
            hor = h + v.chars(o.token_ids)
            score = _score(scored[i] + [o])
            held = rules.check(u, lo, hor, keywords)
            cands.append((sum(held.values()), score, -i, Couplet(u, lo, hor, keywords, held, score)))
        best = max(cands, key=lambda c: c[:3])[3]
        best.num_candidates = k
        return best

    def _placement(self, keywords: list[str], i: int) -> tuple[str, str, str]:
        """Forced starts of 上联, 下联 and 横批 for candidate i: odd candidates place the keywords."""
        if i % 2 == 0 or not keywords or len(keywords[0]) > 4:
            return "", "", ""
        first = keywords[0]
        second = keywords[1] if len(keywords) > 1 and len(keywords[1]) == len(first) else ""
        joined = "".join(keywords)
        return first, second, joined if len(joined) == HORIZONTAL else ""

    @staticmethod
    def _params(seed: int, max_tokens: int, processors: list[Callable]) -> SamplingParams:
        """A line's request: it stops at its end token (the newline, or the end of text)."""
        stop = sorted({p.end for p in processors if isinstance(p, LineRule)})
        return SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=seed,
                              logprobs=0, logits_processors=processors, stop_token_ids=stop)


def _clash(upper: str, lower_prefix: str) -> bool:
    """Whether a forced 下联 start breaks the position rules against its 上联."""
    for k in range(len(lower_prefix)):
        must, banned = rules.allowed_next(upper, lower_prefix[:k])
        c = lower_prefix[k]
        if (must is not None and c != must) or (must is None and c in banned):
            return True
    return False


def _score(outs: list[Any]) -> float:
    lps = [e["logprob"] for o in outs for e in (o.logprobs or []) if e]
    return sum(lps) / len(lps) if lps else 0.0


def write(llm: Any, keywords: list[str], seed: int | None = None, constrained: bool = True,
          writer: CoupletWriter | None = None) -> Couplet:
    """One couplet with an `LLM` (the command line, the benchmark)."""
    writer = writer or CoupletWriter(llm.tokenizer)
    t0 = time.perf_counter()
    plan = writer.plan(keywords, seed, constrained)
    try:
        jobs = next(plan)
        while True:
            outs = llm.generate([j.prompt for j in jobs], [j.params for j in jobs])
            jobs = plan.send(outs)
    except StopIteration as done:
        couplet: Couplet = done.value
    couplet.seconds = time.perf_counter() - t0
    return couplet


__all__ = ["Couplet", "CoupletWriter", "Job", "LineRule", "Vocab", "write"]
