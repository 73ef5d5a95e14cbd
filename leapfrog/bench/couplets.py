"""`leapfrog bench --suite couplets`: the couplet writer's quality with and without the rules
enforced, on keyword sets drawn from held-out couplets.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from leapfrog.bench.common import log

WAYS = ("free", "constrained")


def run(args: argparse.Namespace) -> dict:
    # deferred: torch, the engine and the couplet app load only when this suite runs
    import torch

    from leapfrog.config import DEFAULT_MODEL, resolve_model
    from leapfrog.couplet import quality, rules
    from leapfrog.couplet.writer import CoupletWriter, write
    from leapfrog.data.corpus import heldout
    from leapfrog.data.couplets import sample_keywords
    from leapfrog.llm import LLM

    torch.set_num_threads(args.threads)
    model = resolve_model("couplets" if args.model == DEFAULT_MODEL else args.model)
    pairs = heldout("couplets", args.data_dir)
    rng = random.Random(0)
    pairs = rng.sample(pairs, min(args.num_prompts, len(pairs)))
    cases = [(u, d, sample_keywords(u, d, rng)) for u, d in pairs]
    llm = LLM(str(model), method="ar")
    writer = CoupletWriter(llm.tokenizer, num_candidates=args.candidates)
    write(llm, ["春"], 0, True, writer)                  # warm-up
    human = []
    for u, d, kws in cases:
        held = rules.check(u, d, "", kws)
        held.pop("horizontal_4")
        human.append({**held, "pos": quality.pos_parallelism(u, d)})
    rows = [_row("held-out couplets", human, [x for u, d, _ in cases for x in (u, d)])]
    samples = []
    for way in WAYS:
        results, lines = [], []
        for i, (u, d, kws) in enumerate(cases):
            if i % 25 == 0:
                log(f"couplets: {way} {i + 1}/{len(cases)}")
            t0 = time.perf_counter()
            c = write(llm, kws, i, way == "constrained", writer)
            results.append({**c.rules, "pos": quality.pos_parallelism(c.upper, c.lower),
                            "seconds": time.perf_counter() - t0})
            lines += [c.upper, c.lower]
            if i < 8:
                samples.append({"way": way, "keywords": kws, "upper": c.upper, "lower": c.lower,
                                "horizontal": c.horizontal})
        rows.append(_row(way, results, lines))
    return {"suite": "couplets", "model": str(model), "threads": args.threads, "num_couplets": len(cases),
            "candidates": args.candidates, "rows": rows, "samples": samples}


def _row(name: str, results: list[dict], lines: list[str]) -> dict:
    # deferred: the couplet app loads only when this suite runs
    from leapfrog.couplet import quality
    out = {"way": name, **quality.summarise(results)}
    out["distinct_1"] = quality.distinct_n(lines, 1)
    out["distinct_2"] = quality.distinct_n(lines, 2)
    return out


def markdown(result: dict) -> str:
    # deferred: the couplet app loads only when this suite runs
    from leapfrog.couplet.rules import LABELS, RULES
    head = ["", "n"] + [LABELS[r] for r in RULES] + ["all rules", "POS parallelism", "distinct-1", "distinct-2",
                                                     "s / couplet"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [r["way"], str(r["n"])] + [f"{r[k]:.0%}" if k in r else "—" for k in RULES]
        cells += [f"{r['all']:.0%}", f"{r.get('pos', 0):.2f}", f"{r['distinct_1']:.2f}", f"{r['distinct_2']:.2f}",
                  f"{r['seconds']:.3f}" if "seconds" in r else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib and the couplet rules load only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from leapfrog.couplet.rules import RULES
    fig, ax = plt.subplots(figsize=(9, 3.6))
    width = 0.8 / len(result["rows"])
    for j, r in enumerate(result["rows"]):
        ax.bar([i + j * width for i in range(len(RULES) + 1)], [r.get(k, 0) for k in RULES] + [r["all"]],
               width, label=r["way"])
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(RULES) + 1)], list(RULES) + ["all"], rotation=20)
    ax.set_ylabel("share of couplets")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    ax.set_title(f"{Path(result['model']).name}: couplet rules held, {result['num_couplets']} keyword sets")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("couplets suite (--model defaults to couplets; --num-prompts keyword sets)")
    g.add_argument("--candidates", type=int, default=8, help="constrained writing: candidates reranked")
    g.add_argument("--data-dir", default=None, help="the data folder with the couplets (default ../shared/data)")
