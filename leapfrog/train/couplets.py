"""Text formats the couplet model is trained on; the app and clients rely on both.

Pair mode (the default, no template needed by clients): the prompt is the raw 上联 and the
completion is the 下联. Trained as ``<s>上联<sep>下联</s>``: the model itself emits ``<sep>`` (a
special token, dropped by ``decode(skip_special_tokens=True)``) where the 上联 ends, so a client
that sends "天若有情天亦老" gets back "月如无恨月常圆". Sending "上联<sep>" is also fine.

Keyword mode: prompt ``关键词：春 福\\n`` (1-3 keywords of 1-2 characters, space separated),
completion ``上联：…\\n下联：…\\n横批：…``. Keywords are sampled from the couplet itself. Only
spring_festival.tsv has a real 横批 (170 items), so the other keyword examples get the 4-character
phrase from a pool (real 横批 + 4-character couplet sides) that shares most characters with the
couplet: the model learns "横批 = a four-character phrase on the same theme", not one fixed list.
"""
from __future__ import annotations

import hashlib
import random
from collections import defaultdict

SEP = "<sep>"
KEYWORD_PREFIX = "关键词："
UP, DOWN, SCROLL = "上联：", "下联：", "横批："
PUNCT = set("，。；：！？、,.;:!?")


def pair_text(up: str, down: str) -> str:
    """Body of a pair example (the tokenizer adds <s>, the caller appends </s>)."""
    return f"{up}{SEP}{down}"


def keyword_prompt(keywords: list[str]) -> str:
    return f"{KEYWORD_PREFIX}{' '.join(keywords)}\n"


def keyword_text(keywords: list[str], up: str, down: str, scroll: str) -> str:
    return f"{keyword_prompt(keywords)}{UP}{up}\n{DOWN}{down}\n{SCROLL}{scroll}"


def parse_keyword_completion(text: str) -> dict[str, str]:
    """Split a keyword-mode completion back into its three parts (missing parts are '')."""
    out = {"上联": "", "下联": "", "横批": ""}
    for line in text.splitlines():
        for label in out:
            if line.startswith(label + "："):
                out[label] = line[len(label) + 1:].strip()
    return out


def sample_keywords(up: str, down: str, rng: random.Random) -> list[str]:
    """1-3 keywords, each 1-2 consecutive non-punctuation characters of the couplet."""
    sides = [s for s in (up, down) if sum(c not in PUNCT for c in s) >= 2]
    keywords: list[str] = []
    for _ in range(rng.choice((1, 2, 2, 3))):
        side = rng.choice(sides or [up])
        start = rng.randrange(len(side))
        word = side[start:start + rng.choice((1, 2, 2))]
        word = "".join(c for c in word if c not in PUNCT)
        if word and word not in keywords:
            keywords.append(word)
    return keywords or [up[0]]


class ScrollPool:
    """4-character phrases to stand in as 横批 for couplets that have none (see module doc)."""

    def __init__(self, phrases: list[str]):
        self.phrases = sorted(set(p for p in phrases if len(p) == 4 and not PUNCT & set(p)))
        self.by_char: dict[str, list[int]] = defaultdict(list)
        for i, p in enumerate(self.phrases):
            for c in set(p):
                self.by_char[c].append(i)

    def pick(self, up: str, down: str) -> str:
        score: dict[int, int] = defaultdict(int)
        for c in set(up + down) - PUNCT:
            for i in self.by_char.get(c, ()):
                score[i] += 1
        # A phrase that repeats a whole side is no 横批; ties break by a hash, not by order.
        own = {up, down}
        key = lambda i: (score[i], _hash(up + self.phrases[i]))  # noqa: E731
        ranked = sorted((i for i in score if self.phrases[i] not in own), key=key, reverse=True)
        if ranked:
            return self.phrases[ranked[0]]
        return self.phrases[_hash(up) % len(self.phrases)]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:4], "big")


def build_examples(pairs: list[tuple[str, str]], spring: list[tuple[str, str, str]],
                   seed: int = 0, keyword_fraction: float = 0.25, spring_repeats: int = 20) -> list[str]:
    """All training texts: every pair in pair mode, a fraction also in keyword mode, and the
    spring-festival triples (real 横批) repeated with fresh keywords each time."""
    rng = random.Random(seed)
    pool = ScrollPool([s for _, _, s in spring] + [x for p in pairs for x in p])
    texts = [pair_text(u, d) for u, d in pairs] + [pair_text(u, d) for u, d, _ in spring]
    for u, d in pairs:
        if rng.random() < keyword_fraction and len(u) <= 32:
            texts.append(keyword_text(sample_keywords(u, d, rng), u, d, pool.pick(u, d)))
    for _ in range(spring_repeats):
        for u, d, s in spring:
            texts.append(keyword_text(sample_keywords(u, d, rng), u, d, s))
    rng.shuffle(texts)
    return texts
