"""Self-distillation data: a training stream of text the AR model wrote itself.

Used by `stories-diffusion-distill`: a block-diffusion model fine-tuned on its AR parent's own
continuations of training-story openings (most greedy, some sampled) learns that parent's
distribution rather than the raw corpus's. That distribution is sharper (the parent's own text
has a far lower perplexity under it than held-out stories), so the diffusion model grows
confident about several masked positions at once and parallel unmasking commits more than one
token per forward; it is also the text the quality judge (the same AR model) scores. This is
the data-side half of self-distillation recipes for parallel decoding (dParallel; CLLM, Kou et
al. 2024): the objective is unchanged (block-wise masked diffusion, MultiTF). Validation stays
on held-out human text, so the reported validation loss is comparable with the other stages.

Also here: rejection-sampled self-training for the couplets recipes (``rejection_sampled``).

The stream is cached under data_cache/<name>-distill/<key>/ (key: parent folder and its weights'
size and mtime, counts, seed), so a resumed run regenerates nothing.
"""
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


@dataclass(slots=True)
class RejectionSpec:
    """Rejection-sampled self-training for `couplets` (expert iteration on the length rule)."""
    parent: str                      # the couplets model that writes the candidates
    min_chars: int = 12              # training 上联 at least this long (where length slips)
    samples: int = 4                 # candidates per 上联 (sampled at `temperature`)
    temperature: float = 0.8
    keep: int = 1                    # distinct right-length candidates kept per 上联
    # Length-forced candidates: end-of-text banned before the 上联's length and the 下联 cut
    # there, kept when its punctuation sits where the 上联's does. Covers the 上联 for which no
    # free sample came out right (the hard ones rejection sampling leaves out).
    force_length: bool = False


def same_punctuation(up: str, down: str) -> bool:
    """Punctuation at the same places on both sides (the clause structure of a couplet)."""
    from leapfrog.data.couplets import PUNCT

    return len(up) == len(down) and all((a in PUNCT) == (b in PUNCT) for a, b in zip(up, down))


def rejection_sampled(prep, name: str, spec: RejectionSpec, seed: int, data_dir: str | None):
    """`prep` with its training stream extended by the parent's own 下联 for training 上联 of
    `min_chars`+ characters, `samples` candidates each, keeping up to `keep` distinct ones that
    end (</s>) with exactly the 上联's length. The model then trains on its own outputs that obey
    the rule it breaks on long 上联 (rejection-sampling fine-tuning / expert iteration), next to
    the original data. Cached like `distilled`."""
    parent = _parent(spec.parent, prep, name)
    key = data.fingerprint(str(parent.resolve()), _stamp(parent), spec.min_chars, spec.samples,
                           spec.temperature, spec.keep, seed, len(prep.train),
                           *(["forced"] if spec.force_length else []),
                           _stamp(Path(prep.tokenizer_dir)))
    return extended(prep, data.CACHE_DIR / f"{name}-rejection" / key / "train.bin",
                    lambda: _candidates(parent, name, spec, seed, data_dir, prep.tokenizer_dir))


def _candidates(parent: Path, name: str, spec: RejectionSpec, seed: int, data_dir: str | None,
                tokenizer_dir) -> list:
    """The kept candidates of `rejection_sampled`, as <s>上联<sep>下联</s> token ids, encoded by
    the stream's tokenizer (``tokenizer_dir``: same vocabulary as the parent's, but it may encode
    a rare character differently, see ``TokenizerSpec.byte_fallback``)."""
    from transformers import AutoTokenizer

    from leapfrog import LLM, SamplingParams
    from leapfrog.data.couplets import pair_text

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    ups = sorted({u for u, _ in data.train_items(name, data_dir)["pairs"] if len(u) >= spec.min_chars})
    print(f"rejection sampling: {len(ups)} 上联 x {spec.samples} candidates by {parent}",
          file=sys.stderr, flush=True)
    llm = LLM(str(parent), method="ar", max_batch_size=64)
    prompts = [u for u in ups for _ in range(spec.samples)]
    if spec.force_length:
        params = [SamplingParams(min_tokens=len(u), max_tokens=len(u), temperature=spec.temperature,
                                 seed=seed + i) for i, u in enumerate(prompts)]
    else:
        params = [SamplingParams(max_tokens=len(u) + 8, temperature=spec.temperature, seed=seed + i)
                  for i, u in enumerate(prompts)]
    outs = llm.generate(prompts, params, use_tqdm=True)
    kept: dict[str, list] = {}
    for u, o in zip(prompts, outs):
        mine = kept.setdefault(u, [])
        if spec.force_length:
            ok = len(o.text) == len(u) and same_punctuation(u, o.text)
        else:
            ok = o.finish_reason == "stop" and len(o.text) == len(u)
        if ok and len(mine) < spec.keep and all(o.text != t for t in mine):
            mine.append(o.text)
    body = [pair_text(u, t) for u, m in kept.items() for t in m]
    docs = [[tok.bos_token_id, *ids, tok.eos_token_id] for ids in tok(body, add_special_tokens=False).input_ids]
    print(f"rejection sampling: kept {len(docs)} 下联 for {sum(bool(m) for m in kept.values())} "
          f"of {len(ups)} 上联", file=sys.stderr, flush=True)
    return docs
