"""Text formats the couplet model is trained on; training, evaluation and the app rely on them.

The couplets tokenizer marks the end of every prompt it encodes with ``<sep>``, as it marks the
start with ``<s>`` (tokenizer.json: ``<s> $A <sep>``; see leapfrog.train.tokenizer), so a client
that sends a raw prompt hands the model ``<s>prompt<sep>``; the texts below put ``<sep>`` where
that prompt ends. ``<sep>`` is a special token, dropped by ``decode(skip_special_tokens=True)``.

Pair mode (the default, no template needed by clients): the prompt is the raw 上联 and the
completion is the 下联, trained as ``<s>上联<sep>下联</s>``: a client that sends "天若有情天亦老"
gets back "月如无恨月常圆". A few pair examples carry ``<sep><sep>``, what a client that still
appends "<sep>" to the 上联 itself (the format before the tokenizer did it) now sends.

Keyword mode: prompt ``关键词：春 福\\n`` (1-3 keywords of 1-2 characters, space separated),
completion ``上联：…\\n下联：…\\n横批：…``, trained as ``<s>关键词：春 福\\n<sep>上联：…</s>``.
Keywords are sampled from the couplet itself. Only spring_festival.tsv has a real 横批 (170 items),
so the other keyword examples get the 4-character phrase from a pool (real 横批 + 4-character
couplet sides) that shares most characters with the couplet: the model learns "横批 = a
four-character phrase on the same theme", not one fixed list.
"""
from __future__ import annotations

import random

SEP = "<sep>"
KEYWORD_PREFIX = "关键词："
UP, DOWN, SCROLL = "上联：", "下联：", "横批："
PUNCT = set("，。；：！？、,.;:!?")


# The couplets checkpoint's chat template (chat_template.jinja, written by the export): a chat
# turn is a prompt of one of the two modes, so the conversation renders as its last user message
# (the tokenizer adds <s> and <sep> around it), and the reply is the 下联 or the keyword couplet.
CHAT_TEMPLATE = ("{%- for message in messages if message['role'] == 'user' -%}"
                 "{%- if loop.last -%}{{ message['content'] }}{%- endif -%}"
                 "{%- endfor -%}")


def pair_text(up: str, down: str, seps: int = 1) -> str:
    """Body of a pair example (the caller adds <s> and </s>)."""
    return f"{up}{SEP * seps}{down}"


def keyword_prompt(keywords: list[str]) -> str:
    return f"{KEYWORD_PREFIX}{' '.join(keywords)}\n"


def keyword_text(keywords: list[str], up: str, down: str, scroll: str) -> str:
    """Body of a keyword example: the prompt, the <sep> the tokenizer ends it with, the completion."""
    return f"{keyword_prompt(keywords)}{SEP}{keyword_completion(up, down, scroll)}"


def keyword_completion(up: str, down: str, scroll: str) -> str:
    return f"{UP}{up}\n{DOWN}{down}\n{SCROLL}{scroll}"


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
