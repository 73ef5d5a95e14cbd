"""The couplet writer: keywords in, a couplet (上联, 下联, 横批) out, with the couplet rules
enforced while the model decodes.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import itertools
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


NOT_A_COUPLET_MODEL = ("the couplet writer needs a model trained on the keyword format (关键词：… → 上联：…, "
                       "下联：…, 横批：…) with one token per Chinese character and a newline token, as the "
                       "built-in `couplets` model has")


class Vocab:
    """The tokenizer's ids seen as characters: which token is which single Chinese character,
    its tone class, the newline and end-of-text ids."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        newline = tokenizer.encode("\n", add_special_tokens=False)     # as the training text has it
        # Refused before the vocabulary is read and the tone dictionary loads (it stays loaded):
        # every model a server serves is asked whether it writes couplets.
        if len(newline) != 1 or any(len(tokenizer.encode(c, add_special_tokens=False)) != 1
                                    for c in rules.hanzi(FORMAT_CHARS)):
            raise ValueError(NOT_A_COUPLET_MODEL)
        size = tokenizer.vocab_size
        strings = [tokenizer.decode([i]) for i in range(size)]
        self.char_of: list[str | None] = [s if len(s) == 1 and rules.is_cjk(s) else None for s in strings]
        self.id_of = {c: i for i, c in enumerate(self.char_of) if c is not None}
        if any(c not in self.id_of for c in rules.hanzi(FORMAT_CHARS)):
            raise ValueError(NOT_A_COUPLET_MODEL)
        self.newline = newline[0]
        self.hanzi = torch.tensor([c is not None for c in self.char_of])
        level, oblique = rules.level_and_oblique([c or "" for c in self.char_of])
        self.level = torch.zeros(size, dtype=torch.bool)
        self.level[level] = True
        self.oblique = torch.zeros(size, dtype=torch.bool)
        self.oblique[oblique] = True
        self.eos = list(tokenizer.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        """Text continuing a prompt: no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chars(self, ids: list[int]) -> str:
        return "".join(self.char_of[t] or "" for t in ids if 0 <= t < len(self.char_of))


class CoupletRule:
    """The logits processor of one candidate: the whole completion after ``上联：`` laid out as
    slots, one per token: the 上联's characters, ``\n下联：``, the 下联's, ``\n横批：``, the 横批's
    four, the end of text. A fixed slot (the labels, a forced keyword) allows its one token; a
    character slot allows what the rules allow there (module docstring); keyword characters not
    written yet get BOOST. `prefixes` are the forced starts of the three lines; the 上联's is in
    the prompt already."""

    def __init__(self, vocab: "Vocab", length: int, prefixes: tuple[str, str, str], boost: str = "") -> None:
        up_pre, low_pre, hor_pre = prefixes
        self.vocab, self.length, self.up_pre = vocab, length, up_pre
        fixed = lambda text: [("fixed", t) for t in vocab.encode(text)]     # noqa: E731
        self.slots: list[tuple[str, int]] = (
            [("up", i) for i in range(len(up_pre), length)] + fixed("\n" + DOWN + low_pre)
            + [("low", i) for i in range(len(low_pre), length)] + fixed("\n" + SCROLL + hor_pre)
            + [("hor", i) for i in range(len(hor_pre), HORIZONTAL)] + [("fixed", vocab.eos[0])])
        self.boost = [vocab.id_of[c] for c in dict.fromkeys(boost) if c in vocab.id_of]

    def lines(self, output_ids: list[int]) -> tuple[str, str, str]:
        """The three lines of a completion this rule guided (as far as it got)."""
        parts = {"up": self.up_pre, "low": "", "hor": ""}
        fixed_low = fixed_hor = ""
        seen_low = False
        for (kind, tok), out in zip(self.slots, output_ids):
            c = self.vocab.char_of[out] or ""
            if kind == "fixed":
                if seen_low:
                    fixed_hor += c
                else:
                    fixed_low += c
            else:
                seen_low = seen_low or kind == "low"
                parts[kind] += c
        # forced characters after a label belong to the line that follows it
        low_pre = fixed_low.removeprefix("下联")
        hor_pre = fixed_hor.removeprefix("横批")
        return parts["up"], low_pre + parts["low"], hor_pre + parts["hor"]

    def __call__(self, output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
        v = self.vocab
        t = len(output_ids)
        kind, pos = self.slots[t] if t < len(self.slots) else ("fixed", v.eos[0])
        if kind == "fixed":
            allowed = torch.zeros_like(v.hanzi)
            allowed[pos] = True
        else:
            up, low, hor = self.lines(output_ids)
            line = {"up": up, "low": low, "hor": hor}[kind]
            allowed = v.hanzi.clone()
            banned: set[str] = set()
            must = None
            if kind == "low":                      # position rules against the 上联 (rules.next_rule)
                must, banned = rules.next_rule(up, low)
                if must is not None:
                    banned = set()
            if must is not None and must in v.id_of:
                allowed.zero_()
                allowed[v.id_of[must]] = True
            else:
                if pos >= 2 and line[-1] == line[-2]:
                    banned.add(line[-1])           # no character three times in a row
                if banned:
                    allowed[[v.id_of[c] for c in banned if c in v.id_of]] = False
                tone = v.oblique if kind == "up" else v.level if kind == "low" else None
                if tone is not None and pos == self.length - 1 and bool((allowed & tone).any()):
                    allowed &= tone                # 仄起平收: the line's last character
        if allowed.shape[0] < row.shape[0]:         # logits padded past the vocabulary
            allowed = torch.cat([allowed, allowed.new_zeros(row.shape[0] - allowed.shape[0])])
        row = row.masked_fill(~allowed[:row.shape[0]], float("-inf"))
        if kind != "fixed" and self.boost:
            written = "".join(self.lines(output_ids))
            todo = [i for i in self.boost if v.char_of[i] not in written]
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
        """Yields the jobs (one request per candidate), is sent their outputs (RequestOutput-like:
        token_ids, logprobs), returns the Couplet."""
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
        rules_of = []
        jobs = []
        for i in range(k):
            prefixes = self._placement(keywords, i)
            length = max(UPPER_LENGTHS[i % len(UPPER_LENGTHS)], len(prefixes[0]) + 2)
            rule = CoupletRule(v, length, prefixes, joined)
            rules_of.append(rule)
            jobs.append(Job(base + v.encode(UP + prefixes[0]),
                            self._params((seed * 7919 + i) % (1 << 63), len(rule.slots), [rule])))
        outs = yield jobs
        cands = []
        for i, (rule, o) in enumerate(zip(rules_of, outs)):
            up, low, hor = rule.lines(o.token_ids)
            held = rules.check(up, low, hor, keywords)
            score = _score([o])
            cands.append((sum(held.values()), score, -i, Couplet(up, low, hor, keywords, held, score)))
        best = max(cands, key=lambda c: c[:3])[3]
        best.num_candidates = k
        return best

    def _placement(self, keywords: list[str], i: int) -> tuple[str, str, str]:
        """Forced starts of 上联, 下联 and 横批 for candidate i. Even candidates: none (the model
        places the keywords, helped by BOOST). Odd ones: the 上联 starts with the first keyword,
        the 下联 with the second when it is as long (and keeps the position rules); the keywords
        left over start the 横批 when they fit in its four characters (all of them, 马年吉祥, when
        they are four characters in all)."""
        if i % 2 == 0 or not keywords or len(keywords[0]) > 4:
            return "", "", ""
        first, rest = keywords[0], keywords[1:]
        second = rest[0] if rest and len(rest[0]) == len(first) and not _clash(first, rest[0]) else ""
        if second:
            rest = rest[1:]
        joined = "".join(keywords)
        if len(joined) == HORIZONTAL:
            return first, second, joined
        left = "".join(rest)
        return first, second, left if len(left) <= HORIZONTAL else ""

    @staticmethod
    def _params(seed: int, max_tokens: int, processors: list[Callable]) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=seed,
                              logprobs=0, logits_processors=processors)


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


def couplets_per_second(engine: Any, writer: CoupletWriter, num: int, num_candidates: int) -> float:
    """Writes `num` couplets at once on an LLMEngine (each with `num_candidates`), the way a
    server under a crowd writes them, and returns how many it finished a second."""
    plans = [writer.plan(["春", "福"], seed, True, num_candidates) for seed in range(num)]
    t0 = time.perf_counter()
    jobs = {k: next(plan) for k, plan in enumerate(plans)}
    for round_ in itertools.count():
        if not jobs:
            break
        for k, batch in jobs.items():
            for i, job in enumerate(batch):
                engine.add_request(job.prompt, job.params, request_id=f"couplet-timing-{round_}-{k}-{i}")
        done: dict[str, Any] = {}
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        following = {}
        for k, batch in jobs.items():
            try:
                following[k] = plans[k].send([done[f"couplet-timing-{round_}-{k}-{i}"]
                                              for i in range(len(batch))])
            except StopIteration:
                pass
        jobs = following
    return num / (time.perf_counter() - t0)


__all__ = ["Couplet", "CoupletRule", "CoupletWriter", "Job", "Vocab", "couplets_per_second", "write"]
