"""Helpers every benchmark suite shares: progress logging and held-out story prompts."""
from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def story_prompts(num: int, tokenizer, max_prompt_tokens: int = 32) -> list[list[int]]:
    """Openings of held-out stories (our own split); synthetic text if the data is absent."""
    try:
        from leapfrog.data.corpus import heldout
        texts = heldout("stories")
    except (FileNotFoundError, ImportError):
        texts = [f"Once upon a time there was a little {w} who liked to play."
                 for w in ("cat", "dog", "girl", "boy", "bird", "fish", "bear", "fox")]
    prompts = []
    for i in range(num):
        ids = tokenizer.encode(texts[i % len(texts)])
        prompts.append(ids[:max_prompt_tokens])
    return prompts
