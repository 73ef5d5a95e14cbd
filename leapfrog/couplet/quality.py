"""Quality measures for generated couplets: part-of-speech parallelism between the lines (jieba),
distinct-n, and a summary of rule checks over many couplets."""
from __future__ import annotations

import logging
import threading
from statistics import fmean

from leapfrog.couplet.rules import RULES, all_hold, hanzi

_jieba_lock = threading.Lock()
_posseg = None


def _cut():
    """jieba.posseg.cut, imported and its dictionary loaded on first use, quietly."""
    global _posseg
    with _jieba_lock:
        if _posseg is None:
            # deferred: jieba loads only when a line is first tagged
            import jieba
            import jieba.posseg
            jieba.setLogLevel(logging.WARNING)
            jieba.initialize()
            _posseg = jieba.posseg
    return _posseg.cut


def _char_tags(line: str) -> list[str]:
    """The part of speech of each character that counts (``hanzi``): the first letter of the jieba
    flag of the word holding it (n noun, v verb, a adjective, d adverb, m numeral, …). The whole line
    is segmented, punctuation included, so the words are the ones jieba sees."""
    tags = []
    for pair in _cut()(line):
        tag = pair.flag[:1] or "x"
        tags.extend(tag for c in pair.word if hanzi(c))
    return tags


def pos_parallelism(upper: str, lower: str) -> float:
    """Share of positions (over the shorter line, in ``hanzi``) where the 上联 and 下联 characters
    belong to words of the same part of speech; 0.0 when either line is empty."""
    up, low = _char_tags(upper), _char_tags(lower)
    n = min(len(up), len(low))
    return sum(a == b for a, b in zip(up, low)) / n if n else 0.0


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct character n-grams / all n-grams, over the ``hanzi`` of each text (n-grams do not
    cross texts); 0.0 when there are none."""
    grams = [h[i:i + n] for h in map(hanzi, texts) for i in range(len(h) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def summarise(results: list[dict]) -> dict:
    """Over a list of ``check()`` dicts (each may also carry ``pos``, a pos_parallelism, and
    ``seconds``): ``n``, the share keeping each rule in ``RULES`` that the dicts carry, ``all`` (the
    share keeping every one of them), and the mean ``pos`` and ``seconds`` where given."""
    out: dict = {"n": len(results)}
    if not results:
        return out
    names = [r for r in RULES if any(r in d for d in results)]
    for name in names:
        out[name] = fmean(bool(d.get(name)) for d in results)
    out["all"] = fmean(all_hold({k: bool(d.get(k)) for k in names}) for d in results)
    for key in ("pos", "seconds"):
        values = [d[key] for d in results if d.get(key) is not None]
        if values:
            out[key] = fmean(values)
    return out
