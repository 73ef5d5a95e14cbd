"""How couplet training examples are built (pair and keyword mode; the formats themselves are
in leapfrog.data.couplets)."""
from __future__ import annotations

import hashlib
import random
from collections import defaultdict

from leapfrog.data.couplets import PUNCT, keyword_text, pair_text, sample_keywords


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
                   seed: int = 0, keyword_fraction: float = 0.25, spring_repeats: int = 20,
                   double_sep_fraction: float = 0.03, long_repeats: int = 0,
                   long_min: int = 8) -> list[str]:
    """All training texts: every pair in pair mode (a few with <sep><sep>, see the module doc), a
    fraction also in keyword mode, and the spring-festival triples (real 横批) repeated with
    fresh keywords each time. With `long_repeats`, pairs whose 上联 has at least `long_min`
    characters appear that many extra times in pair mode (where the model loses count)."""
    rng = random.Random(seed)
    pool = ScrollPool([s for _, _, s in spring] + [x for p in pairs for x in p])
    # The extra <sep>s come from their own generator: the keyword draws stay those of seed.
    doubled = random.Random(f"{seed}-double-sep")
    seps = lambda: 2 if doubled.random() < double_sep_fraction else 1  # noqa: E731
    texts = [pair_text(u, d, seps()) for u, d in pairs] + [pair_text(u, d, seps()) for u, d, _ in spring]
    for u, d in pairs:
        if rng.random() < keyword_fraction and len(u) <= 32:
            texts.append(keyword_text(sample_keywords(u, d, rng), u, d, pool.pick(u, d)))
    for _ in range(spring_repeats):
        for u, d, s in spring:
            texts.append(keyword_text(sample_keywords(u, d, rng), u, d, s))
    texts += [pair_text(u, d) for u, d in pairs if len(u) >= long_min] * long_repeats
    rng.shuffle(texts)
    return texts


def rare_char_pairs(pairs: list[tuple[str, str]], count: int, rng: random.Random,
                    in_vocab: set[str]) -> list[tuple[str, str]]:
    """``count`` pairs whose 上联 has 1-2 characters replaced by CJK characters outside the
    vocabulary (``in_vocab``: the characters that are pieces of their own), the 下联 unchanged.
    Rare characters are too few in the data for the model to learn how to answer them. With
    byte fallback such a character is its three UTF-8 bytes, and a model tends to answer the
    byte count instead of the character count; with a tokenizer that encodes it as one <unk>
    (``TokenizerSpec.byte_fallback`` False, recipe `couplets`) these pairs teach one 下联
    character per <unk>. Punctuation is never replaced; pairs whose sides differ in length are
    never used."""
    rare = [chr(c) for c in range(0x4E00, 0x9FA6) if chr(c) not in in_vocab]
    usable = [(u, d) for u, d in pairs if len(u) == len(d) and sum(c not in PUNCT for c in u) >= 2]
    out: list[tuple[str, str]] = []
    while rare and usable and len(out) < count:
        up, down = usable[rng.randrange(len(usable))]
        spots = [i for i, c in enumerate(up) if c not in PUNCT]
        chars = list(up)
        for i in rng.sample(spots, min(len(spots), rng.choice((1, 1, 2)))):
            chars[i] = rare[rng.randrange(len(rare))]
        out.append(("".join(chars), down))
    return out


def with_rare_chars(prep, name: str, count: int, seed: int, data_dir: str | None):
    """`prep` with ``count`` `rare_char_pairs` examples (pair mode, <s>上联<sep>下联</s>, from
    the training pairs) appended to its training stream. Cached under data_cache/."""
    # deferred: transformers (heavy) and distill load only when rare-character pairs are added
    from transformers import AutoTokenizer

    from leapfrog.data import corpus as data
    from leapfrog.train.distill import extended

    tok = AutoTokenizer.from_pretrained(prep.tokenizer_dir)

    def docs() -> list[list[int]]:
        in_vocab = {p for p in tok.get_vocab() if len(p) == 1}
        pairs = rare_char_pairs(data.train_items(name, data_dir)["pairs"], count,
                                random.Random(f"{seed}-rare"), in_vocab)
        ids = tok([pair_text(u, d) for u, d in pairs], add_special_tokens=False).input_ids
        return [[tok.bos_token_id, *x, tok.eos_token_id] for x in ids]

    key = data.fingerprint(str(prep.tokenizer_dir), len(prep.train), count, seed)
    return extended(prep, data.CACHE_DIR / f"{name}-rare" / key / "train.bin", docs)
