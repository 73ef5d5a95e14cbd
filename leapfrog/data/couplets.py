"""Text formats the couplet model is trained on; training, evaluation and the app rely on them.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
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
