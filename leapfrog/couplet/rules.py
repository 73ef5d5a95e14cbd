"""The couplet rules (对联格律), as pure functions that both check a finished couplet and guide
constrained decoding. No torch, no model.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

RULES = ("equal_length", "no_repeat", "repeat_pattern", "keywords", "tone", "horizontal_4")
LABELS = {"equal_length": "字数相等", "no_repeat": "不重字", "repeat_pattern": "叠字相应",
          "keywords": "关键词", "tone": "仄起平收", "horizontal_4": "横批四字"}
LEVEL, OBLIQUE = (1, 2), (3, 4)

MAX_KEYWORDS, MAX_KEYWORD_CHARS, MAX_KEYWORD_TOTAL, MAX_INPUT = 8, 8, 16, 200
_SPLIT = re.compile(r"[\s,，、;；:：/|｜.。!！?？·・]+")
_CJK_RANGES = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x3134F))


def cjk_class() -> str:
    """A regular-expression character class of the characters is_cjk accepts."""
    return "[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _CJK_RANGES) + "]"


def is_cjk(char: str) -> bool:
    """One CJK unified ideograph (basic block, extensions A-G, compatibility ideographs)."""
    return len(char) == 1 and any(lo <= ord(char) <= hi for lo, hi in _CJK_RANGES)


def hanzi(text: str) -> str:
    """The characters that count for length: text less punctuation, symbols, whitespace and
    control characters (Unicode categories P*, S*, Z*, C*)."""
    return "".join(c for c in text if not c.isspace() and unicodedata.category(c)[0] not in "PSZC")


def _tone_of(syllable: str) -> int | None:
    return int(syllable[-1]) if syllable and syllable[-1] in "12345" else None


@lru_cache(maxsize=None)
def _default_tone(char: str) -> int | None:
    # deferred: pypinyin loads only when tones are read
    from pypinyin import Style, lazy_pinyin
    return _tone_of(lazy_pinyin(char, style=Style.TONE3, neutral_tone_with_five=True)[0])


def tones(line: str) -> list[int | None]:
    """The tone of each character of ``line`` read in context (one entry per character of
    ``line``, punctuation included): 1-4, 5 for the neutral tone, None for a non-CJK character or
    one pypinyin has no reading for. Each run of CJK characters is read as a whole, so pypinyin's
    phrase dictionary chooses among a heteronym's readings (长城 chang2, 生长 zhang3)."""
    # deferred: pypinyin loads only when tones are read
    from pypinyin import Style, lazy_pinyin
    out: list[int | None] = [None] * len(line)
    for run in re.finditer(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f]+", line):
        syllables = lazy_pinyin(run.group(), style=Style.TONE3, neutral_tone_with_five=True)
        if len(syllables) != len(run.group()):          # a character without a reading merged a run
            syllables = [lazy_pinyin(c, style=Style.TONE3, neutral_tone_with_five=True)[0] for c in run.group()]
        for k, syllable in enumerate(syllables):
            out[run.start() + k] = _tone_of(syllable)
    return out


def tone(char: str, context: str | None = None) -> int | None:
    """Tone of one CJK character: 1-4, 5 for the neutral tone, None for a non-CJK character.

    Without ``context``: pypinyin's default reading of the character alone (cached). With
    ``context`` (a line that contains ``char``): the reading of its *last* occurrence in that line,
    read as a whole (see ``tones``); the last because the rules care about line ends."""
    if not is_cjk(char):
        return None
    if context is None or char not in context:
        return _default_tone(char)
    return tones(context)[context.rindex(char)]


def is_level(char: str) -> bool:
    """平: the default reading (no context) is tone 1 or 2."""
    return tone(char) in LEVEL


def is_oblique(char: str) -> bool:
    """仄: the default reading (no context) is tone 3 or 4."""
    return tone(char) in OBLIQUE


def level_and_oblique(strings: list[str]) -> tuple[list[int], list[int]]:
    """For a vocabulary given as decoded token strings (index = token id): the ids whose text ends
    in a level-tone CJK character, and those ending in an oblique-tone one. Constrained decoding
    allows only these for the last character of the 下联 / 上联. A token that ends in anything else
    (punctuation, a Latin letter, a neutral-tone character) is in neither list. A single-character
    token gets the character's default reading (cached per character); a longer one is read as a
    phrase. A context reading of the finished line can still differ (天长 reads 长 chang2, alone it
    is zhang3), so ``check`` stays the judge."""
    level: list[int] = []
    oblique: list[int] = []
    for token_id, text in enumerate(strings):
        text = (text or "").rstrip()
        if not text or not is_cjk(text[-1]):
            continue
        t = _default_tone(text) if len(text) == 1 else tones(text)[-1]
        if t in LEVEL:
            level.append(token_id)
        elif t in OBLIQUE:
            oblique.append(token_id)
    return level, oblique


def repeat_violations(upper: str, lower: str) -> list[tuple[int, int]]:
    """Pairs of positions (i < j, over ``hanzi``, within the shorter line) where the 下联 repeats a
    character (lower[i] == lower[j]) but the 上联 does not (upper[i] != upper[j]). The reverse
    (the 上联 repeats, the 下联 does not) is a weaker fault and is not listed; ``allowed_next``
    asks for it while decoding all the same."""
    up, low = hanzi(upper), hanzi(lower)
    n = min(len(up), len(low))
    return [(i, j) for i in range(n) for j in range(i + 1, n) if low[i] == low[j] and up[i] != up[j]]


def allowed_next(upper: str, lower_prefix: str) -> tuple[str | None, set[str]]:
    """What the next 下联 character may be, given the whole 上联 and the 下联 written so far.

    Returns (must, banned) for position k = len(hanzi(lower_prefix)), facing u = hanzi(upper)[k].
    ``must``: where u appeared earlier in the 上联, the 下联's character at u's first position there
    (then the only one allowed); else None. ``banned``: u, and each prefix character whose 上联
    character differs from u. Past the 上联's end, (None, set()): the caller ends the line."""
    return next_rule(hanzi(upper), hanzi(lower_prefix))


def next_rule(up: str, low: str) -> tuple[str | None, set[str]]:
    """`allowed_next` for lines that are characters only already (no ``hanzi`` pass): the hot
    path of constrained decoding, called for every row at every step."""
    k = len(low)
    if k >= len(up):
        return None, set()
    u = up[k]
    banned = {u} | {low[i] for i in range(k) if up[i] != u}
    first = up.find(u)
    must = low[first] if first < k else None
    return must, banned


def _ends(line: str, wanted: tuple[int, int]) -> bool:
    chars = hanzi(line)
    return bool(chars) and tone(chars[-1], context=chars) in wanted


def check(upper: str, lower: str, horizontal: str, keywords: list[str]) -> dict[str, bool]:
    """Which rules a couplet keeps, one bool per name in ``RULES`` (see the module docstring).
    Line-end tones are read in the context of their whole line."""
    up, low = hanzi(upper), hanzi(lower)
    text = up + low + hanzi(horizontal)
    return {
        "equal_length": bool(up) and len(up) == len(low),
        "no_repeat": bool(low) and low != up and all(a != b for a, b in zip(up, low)),
        "repeat_pattern": not repeat_violations(up, low),
        "keywords": all(c in text for word in keywords for c in hanzi(word)),
        "tone": _ends(up, OBLIQUE) and _ends(low, LEVEL),
        "horizontal_4": len(hanzi(horizontal)) == 4,
    }


def all_hold(rules: dict[str, bool]) -> bool:
    """Every rule in the dict held (an empty dict holds trivially)."""
    return all(rules.values())


def split_keywords(text: str) -> list[str]:
    """The user's keywords: ``text`` split on whitespace and on separators (，,、；;：:/|。 …),
    empties dropped, duplicates dropped (first kept). Raises ValueError, with a message fit to show
    the user (Chinese, then English), when there are none, more than 8, one longer than 8
    characters, more than 16 characters in all, or a keyword with anything but Chinese characters
    in it (Latin, digits, markup: the couplet model writes Chinese only)."""
    if len(text) > MAX_INPUT:
        raise ValueError(f"关键词太长 / keywords are too long: at most {MAX_INPUT} characters in all")
    words = list(dict.fromkeys(w for w in _SPLIT.split(text) if w))
    if not words:
        raise ValueError("请输入关键词 / no keywords: type one to eight Chinese words, e.g. 马年 吉祥")
    if len(words) > MAX_KEYWORDS:
        raise ValueError(f"关键词太多 / too many keywords: {len(words)}, at most {MAX_KEYWORDS}")
    for word in words:
        if not any(is_cjk(c) for c in word):
            raise ValueError(f"关键词须为汉字 / keywords must be Chinese words: {word!r} has no Chinese character")
        other = "".join(dict.fromkeys(c for c in word if not is_cjk(c)))
        if other:
            raise ValueError(f"关键词只能含汉字 / keywords may hold Chinese characters only, not {other!r} (in {word!r})")
        if len(word) > MAX_KEYWORD_CHARS:
            raise ValueError(f"关键词太长 / keyword {word!r} is {len(word)} characters, at most {MAX_KEYWORD_CHARS}")
    total = sum(len(w) for w in words)
    if total > MAX_KEYWORD_TOTAL:
        raise ValueError(f"关键词字数太多 / too many characters: {total} in all, at most {MAX_KEYWORD_TOTAL}")
    return words
