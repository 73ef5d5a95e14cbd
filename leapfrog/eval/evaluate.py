"""`leapfrog eval`: quality and speed of one model + decoding method on our held-out split.

    leapfrog eval --model stories --method ar --num 64 --json out.json
    leapfrog eval --model couplets        # task inferred from the name; every held-out 上联
    leapfrog eval --model stories-diffusion --option num_blocks=3 --option threshold=0.9
                                          # its leapfrog.json makes `diffusion` the method

stories:  validation loss / perplexity (not for a `diffusion` model); continuations of held-out
          openings (T 0.7, top-p 0.9): rep-2 / rep-4 (and the stories' own rep-4), distinct-1/2,
          coherence (normalised: 1 = as coherent as the stories' own continuations, 0 = as
          another story's) and perplexity under a judge model.
couplets: validation loss / perplexity; greedy 下联 for held-out 上联 sent raw: share with the
          上联's length (all, and 16+ characters) and character BLEU-4 against the reference.
Both:     tokens per forward, acceptance length and output tokens/s.

The table goes to stdout, progress to stderr, everything (plus samples) to --json. Each prompt
has its own seed (seed + prompt index), so a method's text does not depend on batching and a
lossless method matches `ar` (greedy: the same text; sampled: the same distribution).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from leapfrog.sampling_params import SamplingParams

STORY_METRICS = ("val_loss", "val_ppl", "val_tokens", "rep_2", "rep_4", "rep_4_tokens",
                 "distinct_1", "distinct_2", "coherence", "coherence_human", "coherence_unrelated",
                 "coherence_normalised", "rep_4_human", "judge_ppl", "mean_output_words")
COUPLET_METRICS = ("val_loss", "val_ppl", "val_tokens", "length_match", "length_match_16plus",
                   "num_16plus", "bleu4_char", "bleu4_char_sentence", "distinct_1", "distinct_2",
                   "exact_match")
SPEED_METRICS = ("num_requests", "num_output_tokens", "num_forwards", "tokens_per_forward",
                 "acceptance_length", "output_tokens_per_s", "generate_s")
NUM_SAMPLES = 8
LONG_COUPLET = 16          # 上联 characters (punctuation aside) from which a pair counts as long


@dataclass(slots=True)
class EvalResult:
    task: str
    model: str
    method: str
    draft_model: str | None
    judge: str | None
    settings: dict
    metrics: dict = field(default_factory=dict)
    speed: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)


def log(msg: str) -> None:
    print(f"[eval] {msg}", file=sys.stderr, flush=True)


# --- teacher-forced loss --------------------------------------------------------------------


def sequence_nll(model, sequences: list[tuple[list[int], int]], device, batch_size: int = 16
                 ) -> tuple[float, int]:
    """Summed next-token NLL and the number of scored tokens.

    Each sequence is (ids, start): targets ids[start:] are scored, each from the logits one
    position earlier. Rows are right-padded: with causal attention padding after a token never
    changes its logits, so batches need no attention mask.
    """
    # deferred: torch loads only when texts are scored
    import torch
    import torch.nn.functional as F

    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    total, count = 0.0, 0
    for b in range(0, len(order), batch_size):
        batch = [sequences[i] for i in order[b:b + batch_size]]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width - 1, dtype=torch.bool)
        for r, (seq, start) in enumerate(batch):
            ids[r, :len(seq)] = torch.tensor(seq)
            mask[r, max(start, 1) - 1:len(seq) - 1] = True
        logits = model.forward_dense(ids.to(device))[:, :-1].float()
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:].to(device), reduction="none")
        total += float(nll[mask.to(device)].sum())
        count += int(mask.sum())
    return total, count


def load_scorer(name: str, device):
    """(model with forward_dense in fp32, leapfrog tokenizer, context length) for `name`."""
    # deferred: torch and the model code load only when a scorer is loaded
    import torch

    from leapfrog.config import resolve_model
    from leapfrog.models.loader import load_model, read_config
    from leapfrog.tokenizer import Tokenizer
    folder = resolve_model(name)
    model = load_model(folder, device, torch.float32, suppress=False)   # scores the prompt's markers too
    max_len = int(read_config(folder).get("max_position_embeddings", 2048))
    return model, Tokenizer.from_folder(folder), max_len


def document_ids(tok, text: str, max_len: int, end: bool = True) -> list[int]:
    """<s> text </s> as in training (leapfrog.train.prepare), cut to the model's context;
    end=False leaves out </s> (a prefix of a longer text)."""
    ids = [tok.bos_token_id] if tok.bos_token_id is not None else []
    ids += tok.encode(text, add_special_tokens=False) + (tok.eos_token_ids[:1] if end else [])
    return ids[:max_len]


def validation_loss(scorer, texts: list[str], device) -> dict:
    model, tok, max_len = scorer
    total, count = sequence_nll(model, [(document_ids(tok, t, max_len), 1) for t in texts], device)
    loss = total / max(count, 1)
    return {"val_loss": round(loss, 4), "val_ppl": round(math.exp(loss), 3), "val_tokens": count}


def judge_perplexity(scorer, prompts: list[str], continuations: list[str], device) -> float | None:
    """exp(mean NLL) of the continuation tokens given the prompt, under the judge's tokenizer."""
    model, tok, max_len = scorer
    seqs = []
    for prompt, text in zip(prompts, continuations):
        if not text.strip():
            continue
        head = document_ids(tok, prompt, max_len, end=False)
        full = document_ids(tok, prompt + text, max_len, end=False)
        start = next((i for i, (a, b) in enumerate(zip(head, full)) if a != b), len(head))
        if start < len(full):
            seqs.append((full, start))
    if not seqs:
        return None
    total, count = sequence_nll(model, seqs, device)
    return round(math.exp(total / count), 3)


# --- generation -----------------------------------------------------------------------------


def generate(llm, prompts: list[str], params: list) -> tuple[list, dict]:
    """Outputs in prompt order, and speed figures summed over the whole run."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - t0
    num_out = sum(o.metrics.num_output_tokens for o in outs)
    num_fwd = sum(o.metrics.num_forwards for o in outs)
    accept = [o.metrics.acceptance_length for o in outs if o.metrics.acceptance_length is not None]
    speed = {"num_requests": len(outs), "num_output_tokens": num_out, "num_forwards": num_fwd,
             "tokens_per_forward": round(num_out / max(num_fwd, 1), 3),
             "acceptance_length": round(sum(accept) / len(accept), 3) if accept else None,
             "output_tokens_per_s": round(num_out / wall, 1), "generate_s": round(wall, 2)}
    return outs, speed


def continuation_text(tok, out) -> str:
    """The completion as it reads after the prompt. Decoding output ids alone drops the
    SentencePiece word-boundary space of the first token ("She" for "▁She"), which would glue
    prompt and continuation together for the judge; decoding with the prompt keeps it."""
    head = tok.decode(out.prompt_token_ids)
    full = tok.decode(list(out.prompt_token_ids) + list(out.token_ids))
    return full[len(head):] if full.startswith(head) else out.text


def sampling(args: argparse.Namespace, index: int, max_tokens: int):
    # One seed per prompt: the text does not depend on batching, so methods compare fairly.
    return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=args.seed + index)


# --- tasks ----------------------------------------------------------------------------------


def eval_stories(args: argparse.Namespace, llm, res: EvalResult) -> None:
    # deferred: the metrics and the story data load only for a stories evaluation
    from leapfrog.eval import metrics as mt
    from leapfrog.data.stories import story_opening
    from leapfrog.data.corpus import heldout
    device = llm.engine.device
    stories = heldout("stories", args.data_dir)
    scorer = None
    if res.method == "diffusion":
        # A block-diffusion model is trained to fill masked blocks, not to predict the next token
        # under a causal mask: that loss would be a number about nothing. Judge ppl scores its text.
        log("validation loss skipped: the model decodes by block diffusion")
        res.metrics.update({"val_loss": None, "val_ppl": None, "val_tokens": 0})
    else:
        log(f"validation loss on {min(args.num_ppl, len(stories))} held-out stories")
        scorer = load_scorer(args.model, device)
        res.metrics.update(validation_loss(scorer, stories[:args.num_ppl], device))
    prompts = [story_opening(s) for s in stories[:args.num]]
    log(f"generating {len(prompts)} continuations with {res.method}")
    outs, res.speed = generate(llm, prompts, [sampling(args, i, args.max_tokens) for i in range(len(prompts))])
    texts = [continuation_text(llm.tokenizer, o) for o in outs]
    word_lists = [mt.words(t) for t in texts]
    res.metrics.update({
        "rep_2": round(mt.mean_rep_n(word_lists, 2), 4),
        "rep_4": round(mt.mean_rep_n(word_lists, 4), 4),
        "rep_4_tokens": round(mt.mean_rep_n([o.token_ids for o in outs], 4), 4),
        "distinct_1": round(mt.distinct_n(word_lists, 1), 4),
        "distinct_2": round(mt.distinct_n(word_lists, 2), 4),
        "mean_output_words": round(sum(map(len, word_lists)) / max(len(texts), 1), 1)})
    log("coherence (all-MiniLM-L6-v2), with the human and unrelated baselines")
    embedder = mt.SentenceEmbedder(str(device))
    mean = lambda xs: sum(xs) / max(len(xs), 1)  # noqa: E731
    coherence = mean(embedder.similarity(prompts, texts))
    res.metrics["coherence"] = round(coherence, 4)
    # Baselines on the same openings, as long as the model's continuation of each: the story's
    # own continuation, and the next story's (a text about something else).
    lengths = [len(w) for w in word_lists]
    human = [mt.story_rest(s, p, n) for s, p, n in zip(stories, prompts, lengths)]
    res.metrics["rep_4_human"] = round(mt.mean_rep_n([mt.words(h) for h in human], 4), 4)
    if len(prompts) > 1:
        other = [mt.story_rest(stories[(i + 1) % len(prompts)], prompts[(i + 1) % len(prompts)], n)
                 for i, n in enumerate(lengths)]
        h, u = mean(embedder.similarity(prompts, human)), mean(embedder.similarity(prompts, other))
        norm = mt.normalised_coherence(coherence, h, u)
        res.metrics.update({"coherence_human": round(h, 4), "coherence_unrelated": round(u, 4),
                            "coherence_normalised": None if norm is None else round(norm, 4)})
    else:
        res.metrics.update({"coherence_human": None, "coherence_unrelated": None, "coherence_normalised": None})
    res.metrics["judge_ppl"] = story_judge_ppl(args, prompts, texts, device, scorer)
    res.samples = [{"prompt": p, "completion": t} for p, t in zip(prompts, texts)][:NUM_SAMPLES]


def story_judge_ppl(args: argparse.Namespace, prompts: list[str], texts: list[str], device,
                    own_scorer) -> float | None:
    """Judge perplexity; the evaluated model's scorer is reused when it is also the judge."""
    # deferred: config (torch) loads only when the judge is resolved
    from leapfrog.config import resolve_model
    if not args.judge:
        return None
    log(f"perplexity of the generated text under judge {args.judge}")
    try:
        same = resolve_model(args.judge).resolve() == resolve_model(args.model).resolve()
        scorer = own_scorer if same and own_scorer else load_scorer(args.judge, device)
    except (FileNotFoundError, ValueError) as e:
        # The other metrics stay valid without a judge: report null rather than fail the run.
        log(f"judge unavailable, judge_ppl = null: {e}")
        return None
    return judge_perplexity(scorer, prompts, texts, device)


def eval_couplets(args: argparse.Namespace, llm, res: EvalResult) -> None:
    # deferred: the metrics and the couplet data load only for a couplets evaluation
    from leapfrog.eval import metrics as mt
    from leapfrog.data.couplets import pair_text
    from leapfrog.data.corpus import heldout
    device = llm.engine.device
    # A seeded shuffle rather than the first N: the file is grouped by source (SOURCE.md).
    pairs = heldout("couplets", args.data_dir)
    pairs = random.Random(args.seed).sample(pairs, len(pairs))
    log(f"validation loss on {min(args.num_ppl, len(pairs))} held-out pairs")
    texts = [pair_text(u, d) for u, d in pairs[:args.num_ppl]]
    res.metrics.update(validation_loss(load_scorer(args.model, device), texts, device))
    ups, refs = [u for u, _ in pairs[:args.num]], [d for _, d in pairs[:args.num]]
    # Room for one token per character plus slack; --max-tokens caps it.
    params = [sampling(args, i, min(args.max_tokens, len(u) + 8)) for i, u in enumerate(ups)]
    log(f"generating {len(ups)} 下联 with {res.method}")
    outs, res.speed = generate(llm, ups, params)
    downs = [o.text.strip() for o in outs]
    chars = [[c for c in d if not c.isspace()] for d in downs]
    n = max(len(downs), 1)
    long_share = mt.length_match_share(ups, downs, LONG_COUPLET)     # where a small model loses count
    res.metrics.update({
        "length_match": round(mt.length_match_share(ups, downs) or 0.0, 4),
        "length_match_16plus": None if long_share is None else round(long_share, 4),
        "num_16plus": sum(mt.hanzi_length(u) >= LONG_COUPLET for u in ups),
        "bleu4_char": round(mt.corpus_char_bleu(downs, refs), 4),
        "bleu4_char_sentence": round(sum(map(mt.char_bleu, downs, refs)) / n, 4),
        "distinct_1": round(mt.distinct_n(chars, 1), 4),
        "distinct_2": round(mt.distinct_n(chars, 2), 4),
        "exact_match": round(sum(d == r for d, r in zip(downs, refs)) / n, 4)})
    res.samples = [{"prompt": u, "completion": d, "reference": r}
                   for u, d, r in zip(ups, downs, refs)][:NUM_SAMPLES]


# --- command line ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    # deferred: options (config, torch) loads only when the parser is built
    from leapfrog.options import add_engine_args
    p = argparse.ArgumentParser(prog="leapfrog eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("evaluation")
    g.add_argument("--task", choices=["stories", "couplets"], default=None,
                   help="held-out set (default: couplets for a model named couplets*, else stories)")
    g.add_argument("--num", type=int, default=None, help="prompts to generate from (default 64 stories; every held-out 上联, 821, for couplets)")
    g.add_argument("--num-ppl", type=int, default=256, help="held-out texts for validation loss (default 256)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per continuation (default 128 for stories; 上联 length + 8 for couplets)")
    g.add_argument("--temperature", type=float, default=None, help="default 0.7 for stories, 0 (greedy) for couplets")
    g.add_argument("--top-p", type=float, default=None, help="default 0.9 for stories, 1.0 for couplets")
    g.add_argument("--seed", type=int, default=0, help="request i samples with seed + i (default 0)")
    g.add_argument("--judge", default="stories", help="model whose perplexity scores generated stories "
                   "(default: the built-in stories model; '' to skip)")
    g.add_argument("--data-dir", default=None, help="shared data folder (default ../shared/data)")
    g.add_argument("--json", default=None, metavar="PATH", help="write the full result as JSON here")
    return p


def fill_defaults(args: argparse.Namespace) -> None:
    # deferred: config (torch) and the corpus load only when defaults are filled
    from leapfrog.config import resolve_model
    from leapfrog.data.corpus import heldout
    if args.task is None:
        name = resolve_model(args.model).name
        args.task = "couplets" if name.startswith("couplet") else "stories"
    stories = args.task == "stories"
    if args.num is None:    # couplets: every held-out 上联 (a 300 sample ran up to 1.5 points high)
        args.num = 64 if stories else len(heldout("couplets", args.data_dir))
    if args.max_tokens is None:
        args.max_tokens = 128 if stories else 256
    if args.temperature is None:
        args.temperature = 0.7 if stories else 0.0
    if args.top_p is None:
        args.top_p = 0.9 if stories else 1.0
    if args.num < 1 or args.num_ppl < 1:
        raise ValueError("--num and --num-ppl must be at least 1")


def run(args: argparse.Namespace) -> EvalResult:
    # deferred: torch and the engine load only when an evaluation runs
    from leapfrog import LLM
    from leapfrog.options import engine_kwargs
    fill_defaults(args)
    kwargs = engine_kwargs(args)
    log(f"loading {args.model} with method {kwargs['method']}")
    llm = LLM(args.model, **kwargs)
    settings = {k: getattr(args, k) for k in ("num", "num_ppl", "max_tokens", "temperature", "top_p", "seed")}
    settings["options"] = {k: v for k, v in kwargs.items() if k not in ("method", "draft_model")}
    res = EvalResult(args.task, str(args.model), kwargs["method"], args.draft_model,
                     (args.judge or None) if args.task == "stories" else None, settings)
    (eval_stories if args.task == "stories" else eval_couplets)(args, llm, res)
    return res


def format_table(res: EvalResult) -> str:
    head = f"{res.task}: model={res.model} method={res.method}"
    if res.draft_model:
        head += f" draft={res.draft_model}"
    rows = [(k, v) for k, v in res.metrics.items()] + [(k, v) for k, v in res.speed.items()]
    width = max(len(k) for k, _ in rows)
    lines = [head, "-" * max(len(head), width + 14)]
    lines += [f"{k:<{width}}  {'-' if v is None else v}" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        res = run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(asdict(res), ensure_ascii=False, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
