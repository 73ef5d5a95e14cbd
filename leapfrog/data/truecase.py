"""Truecasing: restore the capitals of a lowercased story from the casing of cased ones.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import re
from collections import Counter, defaultdict

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")
MIN_SHARE = 0.75                 # a cased form must be the word's own this often to be used
_OPENING_QUOTES = ('"', "“")
_QUOTE_ENDS_IN_SPEECH = re.compile(r"[!?][\"”]\s+")     # '?" she asked': no new sentence


def _sentence_initial(text: str, start: int) -> bool:
    before = text[:start].rstrip(" \"“")
    return start == 0 or not before or before[-1] in ".!?\n" or text[start - 1] in _OPENING_QUOTES


class CasingTable:
    """lowercase word -> its usual cased form (only words whose usual form is not lowercase)."""

    def __init__(self, forms: dict[str, str], lower_counts: dict[str, int]) -> None:
        self.forms = forms
        self.lower_counts = lower_counts          # how often each word appears in lower case

    @classmethod
    def learn(cls, stories: list[str]) -> "CasingTable":
        seen: dict[str, Counter] = defaultdict(Counter)
        for story in stories:
            for m in WORD.finditer(story):
                if not _sentence_initial(story, m.start()):
                    seen[m.group(0).lower()][m.group(0)] += 1
        forms = {}
        for word, counts in seen.items():
            best, n = counts.most_common(1)[0]
            if best != word and n >= MIN_SHARE * sum(counts.values()):
                forms[word] = best
        forms["i"] = "I"
        return cls(forms, {w: c[w] for w, c in seen.items()})

    def apply(self, text: str) -> str:
        """``text`` (lowercased) with its capitals restored, paragraph by paragraph."""
        return "\n".join(self._paragraph(p) for p in text.split("\n"))

    def _paragraph(self, para: str) -> str:
        out, last, start, prev = [], 0, True, ""
        for m in WORD.finditer(para):
            gap = para[last:m.start()]
            if re.search(r"[.!?]", gap):
                start = not _QUOTE_ENDS_IN_SPEECH.fullmatch(gap)
            if gap.endswith(_OPENING_QUOTES) and ((last == 0 and len(gap) == 1) or gap[:-1][-1:].isspace()):
                start = True
            word = m.group(0)
            cased = self.forms.get(word, word)
            if prev == "named" and cased == word and self.lower_counts.get(word, 0) < 3:
                cased = word[0].upper() + word[1:]
            if start:
                cased = cased[0].upper() + cased[1:]
            out += [gap, cased]
            start, prev, last = False, word, m.end()
        out.append(para[last:])
        return "".join(out)
