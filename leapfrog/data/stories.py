"""Story text helpers shared by training checks, evaluation and benchmarks."""
from __future__ import annotations

import re


def story_opening(story: str) -> str:
    """The first sentence (at least ~6 words) of a story: the prompt to continue."""
    sentences = re.split(r"(?<=[.!?])\s+", story.split("\n")[0])
    opening = ""
    for s in sentences:
        opening = f"{opening} {s}".strip()
        if len(opening.split()) >= 6:
            break
    return opening
