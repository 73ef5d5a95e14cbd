"""Quality checks of a built-in checkpoint with plain ``transformers`` (independent of the engine).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from leapfrog.data import couplets as fmt
from leapfrog.data.stories import story_opening
from leapfrog.eval.metrics import rep_n
from leapfrog.data.corpus import heldout


@dataclass(slots=True)
class CheckResult:
    name: str
    metrics: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)


def load(folder: str):
    # deferred: transformers is heavy and loads only when a checkpoint is checked
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"  # batched generation continues from the right edge
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    meta = Path(folder) / "leapfrog.json"
    anchor = json.loads(meta.read_text()).get("coupled_positions") if meta.is_file() else None
    # transformers' generate numbers positions 0..n-1; a model trained with coupled positions
    # is decoded by the loop below instead (generate)
    model.coupled_anchor = (tok.bos_token_id, tok.convert_tokens_to_ids(anchor)) if anchor else None
    return model, tok


def generate(model, tok, prompts: list[str], batch_size: int = 16, **kwargs) -> list[list[int]]:
    """New token ids per prompt (prompt and padding removed)."""
    if getattr(model, "coupled_anchor", None):
        return [_coupled_greedy(model, tok, p, **kwargs) for p in prompts]
    outs = []
    for i in range(0, len(prompts), batch_size):
        enc = tok(prompts[i:i + batch_size], return_tensors="pt", padding=True)
        with torch.no_grad():
            ids = model.generate(**enc, pad_token_id=tok.pad_token_id, **kwargs)
        outs += [row[enc.input_ids.shape[1]:].tolist() for row in ids]
    return outs


@torch.no_grad()
def _coupled_greedy(model, tok, prompt: str, max_new_tokens: int = 64, do_sample: bool = False) -> list[int]:
    """Greedy decoding of a model trained with coupled positions (leapfrog.json), one prompt at a
    time with transformers' cache and explicit position ids (leapfrog.layers.rotary)."""
    # deferred: layers.rotary loads only for coupled-position models
    from leapfrog.layers.rotary import coupled_positions
    if do_sample:
        raise ValueError("a model with coupled positions is checked greedily")
    prompt_ids = tok(prompt).input_ids
    anchor = model.coupled_anchor[1]
    a = prompt_ids.index(anchor) if anchor in prompt_ids else -1     # restart after it
    ids = torch.tensor([prompt_ids])
    out = model(input_ids=ids, position_ids=coupled_positions(ids, *model.coupled_anchor), use_cache=True)
    banned = list(getattr(model.generation_config, "suppress_tokens", None) or [])   # as generate() does
    new = []
    while len(new) < max_new_tokens:
        logits = out.logits[0, -1].clone()
        logits[banned] = float("-inf")
        nxt = int(logits.argmax())
        new.append(nxt)
        if nxt == tok.eos_token_id:
            break
        i = len(prompt_ids) + len(new) - 1              # the index of nxt in the sequence
        out = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[i - a if 0 <= a < i else i]]),
                    past_key_values=out.past_key_values, use_cache=True)
        if a < 0 and nxt == anchor:
            a = i
    return new


def _strip_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:ids.index(eos)] if eos in ids else ids


def _add_story(res: CheckResult, tok, prompt: str, ids: list[int], word_reps: list, token_reps: list) -> None:
    """One continuation: cut at end of text, rep-4 over words and tokens, kept as a sample."""
    ids = _strip_eos(ids, tok.eos_token_id)
    text = tok.decode(ids, skip_special_tokens=True)
    word_reps.append(rep_n(text.split()))
    token_reps.append(rep_n(ids))
    res.samples.append({"prompt": prompt, "completion": text})


def check_stories(folder: str, num: int = 64, max_new_tokens: int = 128, seed: int = 0,
                  data_dir: str | None = None) -> CheckResult:
    model, tok = load(folder)
    prompts = [story_opening(s) for s in heldout("stories", data_dir)[:num]]
    torch.manual_seed(seed)
    gens = generate(model, tok, prompts, do_sample=True, temperature=0.7, top_p=0.9,
                    max_new_tokens=max_new_tokens)
    res = CheckResult("stories")
    word_reps, token_reps = [], []
    for prompt, ids in zip(prompts, gens):
        _add_story(res, tok, prompt, ids, word_reps, token_reps)
    res.metrics = {"num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
                   "temperature": 0.7, "top_p": 0.9,
                   "rep4_words": round(sum(word_reps) / len(word_reps), 4),
                   "rep4_tokens": round(sum(token_reps) / len(token_reps), 4)}
    return res


def _bare(text: str) -> str:
    return "".join(c for c in text if c not in fmt.PUNCT)


def check_couplets(folder: str, num: int = 0, num_keywords: int = 40, seed: int = 0,
                   data_dir: str | None = None) -> CheckResult:
    model, tok = load(folder)
    pairs = heldout("couplets", data_dir)
    if num:       # 0: every held-out pair
        pairs = random.Random(seed).sample(pairs, min(num, len(pairs)))
    ups = [u for u, _ in pairs]
    gens = generate(model, tok, ups, batch_size=32, do_sample=False,
                    max_new_tokens=max(len(u) for u in ups) + 8)
    downs = [tok.decode(_strip_eos(g, tok.eos_token_id), skip_special_tokens=True) for g in gens]
    exact = sum(len(d) == len(u) for u, d in zip(ups, downs))
    by_chars: dict[str, list[int]] = {}      # 上联 length band -> [right length, pairs]
    for u, d in zip(ups, downs):
        n = len(u)
        band = "1-11" if n < 12 else "12-15" if n < 16 else "16-19" if n < 20 else "20+"
        hit = by_chars.setdefault(band, [0, 0])
        hit[0] += len(d) == len(u)
        hit[1] += 1
    bare = sum(len(_bare(d)) == len(_bare(u)) for u, d in zip(ups, downs))
    res = CheckResult("couplets")
    res.samples = [{"prompt": u, "completion": d, "reference": r}
                   for (u, r), d in list(zip(pairs, downs))[:12]]
    sep = tok.convert_tokens_to_ids(fmt.SEP)
    res.metrics = {"num_pairs": len(ups), "length_match": round(exact / len(ups), 4),
                   "length_match_ignoring_punct": round(bare / len(ups), 4),
                   "length_match_by_chars": {k: f"{a}/{b}" for k, (a, b) in sorted(by_chars.items())},
                   "differs_from_up": round(sum(d != u for u, d in zip(ups, downs)) / len(ups), 4),
                   # the tokenizer's own <sep> at the end of every raw prompt (1.0 expected)
                   "prompt_ends_with_sep": round(
                       sum(ids[-1] == sep for ids in tok(ups).input_ids) / len(ups), 4)}
    # The 上联 with "<sep>" written into the prompt text, as clients did before the tokenizer
    # added it: encoded as 上联<sep><sep>, which a few training examples carry.
    gens = generate(model, tok, [u + fmt.SEP for u in ups], batch_size=32, do_sample=False,
                    max_new_tokens=max(len(u) for u in ups) + 8)
    with_sep = [tok.decode(_strip_eos(g, tok.eos_token_id), skip_special_tokens=True) for g in gens]
    res.metrics["length_match_explicit_sep"] = round(
        sum(len(d) == len(u) for u, d in zip(ups, with_sep)) / len(ups), 4)
    res.metrics.update(_check_keywords(model, tok, pairs[:num_keywords], seed, res.samples))
    return res


def _check_keywords(model, tok, pairs, seed: int, samples: list[dict]) -> dict:
    rng = random.Random(seed)
    prompts = [fmt.keyword_prompt(fmt.sample_keywords(u, d, rng)) for u, d in pairs]
    prompts[:4] = [fmt.keyword_prompt(k) for k in (["春", "福"], ["月"], ["山", "水"], ["龙年"])]
    gens = generate(model, tok, prompts, batch_size=20, do_sample=False, max_new_tokens=80)
    good = 0
    for i, (prompt, g) in enumerate(zip(prompts, gens)):
        text = tok.decode(_strip_eos(g, tok.eos_token_id), skip_special_tokens=True)
        parts = fmt.parse_keyword_completion(text)
        ok = (parts["上联"] and len(parts["上联"]) == len(parts["下联"])
              and len(parts["横批"]) == 4)
        good += bool(ok)
        if i < 6:
            samples.append({"prompt": prompt, "completion": text})
    return {"num_keyword_prompts": len(prompts), "keyword_well_formed": round(good / len(prompts), 4)}


def is_diffusion_folder(folder: str) -> bool:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return "mask_token_id" in cfg and "block_size" in cfg


def check_stories_diffusion(folder: str, num: int = 16, max_new_tokens: int = 128,
                            threshold: float = 0.9, data_dir: str | None = None) -> CheckResult:
    # deferred: the diffusion trainer code loads only for diffusion checks
    from leapfrog.train.diffusion import reference_decode

    model, tok = load(folder)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    if cfg.get("diffusion_mask_stream"):       # transformers reads only the parent: add the stream
        # deferred: mask_stream loads only for two-stream checkpoints
        from leapfrog.train.mask_stream import from_folder
        model = from_folder(folder)
    prompts = [story_opening(s) for s in heldout("stories", data_dir)[:num]]
    res = CheckResult("stories-diffusion")
    word_reps, token_reps, new_tokens, forwards = [], [], 0, 0
    for prompt in prompts:
        ids, n = reference_decode(model, tok(prompt).input_ids, cfg, max_new_tokens, threshold,
                                  tok.eos_token_id)
        new_tokens, forwards = new_tokens + len(ids), forwards + n
        _add_story(res, tok, prompt, ids, word_reps, token_reps)
    res.metrics = {"num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
                   "decoder": "single-block reference (full recompute), greedy, leftmost floor",
                   "threshold": threshold,
                   "tokens_per_forward": round(new_tokens / max(forwards, 1), 3),
                   "rep4_words": round(sum(word_reps) / len(word_reps), 4),
                   "rep4_tokens": round(sum(token_reps) / len(token_reps), 4)}
    return res


def run_check(name: str, folder: str, data_dir: str | None = None, num_pairs: int = 0) -> CheckResult:
    if name.startswith("stories") and is_diffusion_folder(folder):
        return check_stories_diffusion(folder, data_dir=data_dir)
    if name == "stories":
        return check_stories(folder, data_dir=data_dir)
    if name == "couplets":
        return check_couplets(folder, num=num_pairs, data_dir=data_dir)
    raise ValueError(f"no check for {name!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Measure a built-in checkpoint with transformers.")
    p.add_argument("folder")
    p.add_argument("--name", choices=["stories", "couplets"], default=None,
                   help="which check (default: the folder's name)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-pairs", type=int, default=0,
                   help="couplets: held-out pairs to sample (default 0: every held-out pair, the "
                        "estimate the README states; a 300-pair sample ran up to 1.5 points high)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    name = args.name or args.folder.rstrip("/").split("/")[-1]
    res = run_check(name, args.folder, args.data_dir, args.num_pairs)
    print(json.dumps(asdict(res), ensure_ascii=False, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
