"""Self-distillation data: a training stream of text the AR model wrote itself.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from leapfrog.data import corpus as data
from leapfrog.train.drafter_data import regenerate


@dataclass(slots=True)
class DistillSpec:
    parent: str                      # AR model folder that writes the text
    num_sequences: int = 4000        # continuations of distinct training-story openings
    max_tokens: int = 224            # generated tokens per continuation (prompt + this <= window)
    sampled_every: int = 3           # every n-th continuation at T=0.7 / top-p 0.9 (0: all greedy)


def _stamp(folder: Path) -> list[tuple[str, int, int]]:
    return [(p.name, p.stat().st_size, int(p.stat().st_mtime))
            for p in sorted(folder.glob("*.safetensors"))]


def _parent(folder: str, prep, name: str) -> Path:
    """The model folder that writes the text; it must share the stream's tokenizer."""
    # deferred: transformers is heavy and loads only to check a parent's tokenizer
    from transformers import AutoTokenizer

    parent = Path(folder)
    if not (parent / "config.json").is_file():
        raise FileNotFoundError(f"{parent}: no model to generate the {name} training text")
    if AutoTokenizer.from_pretrained(parent).get_vocab() != AutoTokenizer.from_pretrained(prep.tokenizer_dir).get_vocab():
        raise ValueError(f"{parent}: tokenizer differs from the {name} data's")
    return parent


def extended(prep, path: Path, make_docs):
    """`prep` with `make_docs()` (token-id lists, each <s> ... </s>) appended to its training
    stream, the result cached at `path` (made once; a resumed run reads it back)."""
    if not path.is_file():
        data.write_stream(path, [np.asarray(prep.train), *make_docs()])
    stream = data.load_stream(path)
    return replace(prep, train=stream, num_train_items=int((np.asarray(stream) == 1).sum()))


def prompts_for(name: str, spec: DistillSpec, seed: int, data_dir: str | None) -> list[str]:
    """Openings of `num_sequences` distinct training stories, chosen by `seed`."""
    # deferred: data.stories loads only when prompts are chosen
    from leapfrog.data.stories import story_opening

    stories = data.train_items(name, data_dir)["stories"]
    rng = np.random.default_rng([seed, 7])
    pick = rng.permutation(len(stories))[:spec.num_sequences]
    return [story_opening(stories[i]) for i in pick]


def distilled(prep, name: str, spec: DistillSpec, seed: int, data_dir: str | None):
    """`prep` (a train.prepare.Prepared) with its training stream replaced by the parent's text.
    The parent must share the stream's tokenizer (checked on the vocabulary)."""
    parent = _parent(spec.parent, prep, name)
    key = data.fingerprint(str(parent.resolve()), _stamp(parent), spec.num_sequences, spec.max_tokens,
                           spec.sampled_every, seed)
    path = data.CACHE_DIR / f"{name}-distill" / key / "train.bin"
    if not path.is_file():
        prompts = prompts_for(name, spec, seed, data_dir)
        print(f"distillation data: {len(prompts)} continuations by {parent}", file=sys.stderr, flush=True)
        # The drafters' regeneration: <s> prompt completion, </s> included when the story ended.
        docs = [d["ids"] for d in regenerate(parent, prompts, spec.max_tokens, spec.sampled_every, seed)]
        data.write_stream(path, docs)
    stream = data.load_stream(path)
    return replace(prep, train=stream, num_train_items=int((np.asarray(stream) == 1).sum()))
