"""`leapfrog bench --suite diffusion`: block-diffusion decoding against `ar`, one process, one run.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from leapfrog import SamplingParams
from leapfrog.bench.common import log
from leapfrog.bench.speculative import Contender
from leapfrog.config import DEFAULT_MODEL, resolve_model

MB_PPL, AR_SPEED, AR_PPL = 0.05, 1.3, 0.10     # the targets




def configs(args: argparse.Namespace) -> list[Contender]:
    out = [Contender("ar", "ar", model=args.ar_model)]
    semi = getattr(args, "semi_threshold", None)
    later = getattr(args, "later_threshold", None)
    add = getattr(args, "add_threshold", None)
    floors = getattr(args, "floors", None) or [None]
    modes = [False, True] if getattr(args, "verify", False) else [False]
    for verify, floor in ((v, f) for v in modes for f in floors):
        for n in args.num_blocks:
            for t in args.thresholds:
                if t <= 0 and not verify:      # threshold 0 means "draft everything": verified only
                    continue
                # verify always named: a two-stream folder's own default is verified
                opts = {"num_blocks": n, "threshold": t, "verify": verify}
                label = f"N={n} τ={t:g}" + (" verified" if verify else "")
                if semi is not None and n > 1:      # when a later block may be forced (τ_semi)
                    opts["semi_threshold"] = semi
                    label += f" τ_semi={semi:g}"
                if later is not None and n > 1 and not verify:
                    opts["later_threshold"] = later
                    label += f" τ_later={later:g}"
                if add is not None and n > 1:        # when the next block joins (MBD's τ_add)
                    opts["add_threshold"] = add
                    label += f" τ_add={add:g}"
                if floor is not None:
                    opts["floor"] = floor
                    label += f" {floor}" if len(floors) > 1 else ""
                out.append(Contender(label, "diffusion", opts, args.model))
    return out


def opening_prompts(num: int) -> list[str]:
    # deferred: the story data loads only when prompts are built
    from leapfrog.data.stories import story_opening
    from leapfrog.data.corpus import heldout
    return [story_opening(s) for s in heldout("stories")[:num]]


def run_latency(engines: list, prompts: list[str], new_tokens: int) -> tuple[list[list], list[float]]:
    """Batch 1, configs taking turns prompt by prompt: (outputs per config, wall per config)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    outs: list[list] = [[] for _ in engines]
    wall = [0.0] * len(engines)
    for i, p in enumerate(prompts):
        log(f"batch 1: prompt {i + 1}/{len(prompts)}")
        for j, llm in enumerate(engines):
            t0 = time.perf_counter()
            outs[j].append(llm.generate([p], params)[0])
            wall[j] += time.perf_counter() - t0
    return outs, wall


def run_batched(engines: list, prompts: list[str], new_tokens: int, repeats: int) -> list[float]:
    """All prompts as one batch: best output tokens/s of interleaved runs, per config."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    best = [0.0] * len(engines)
    for rep in range(repeats):
        log(f"batch {len(prompts)}: run {rep + 1}/{repeats}")
        for j, llm in enumerate(engines):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            best[j] = max(best[j], sum(o.metrics.num_output_tokens for o in outs) / (time.perf_counter() - t0))
    return best


def quality(texts: list[list[str]], prompts: list[str], judge: str, device) -> list[dict]:
    """Judge ppl, rep-4 and coherence of each config's texts (`leapfrog eval`'s functions)."""
    # deferred: the eval modules load only when quality is judged
    from leapfrog.eval import metrics as mt
    from leapfrog.eval.evaluate import judge_perplexity, load_scorer
    log(f"quality: perplexity under {judge}, rep-4, coherence (all-MiniLM-L6-v2)")
    scorer, embedder, out = load_scorer(judge, device), mt.SentenceEmbedder(str(device)), []
    for ts in texts:
        sims = embedder.similarity(prompts, ts)
        out.append({"judge_ppl": judge_perplexity(scorer, prompts, ts, device),
                    "rep_4": round(mt.mean_rep_n([mt.words(t) for t in ts], 4), 4),
                    "coherence": round(sum(sims) / max(len(sims), 1), 4)})
    return out


def _rel(a: float | None, b: float | None) -> float | None:
    return a / b - 1 if a is not None and b else None


def check_targets(rows: list[dict]) -> dict:
    """Per-row target fields, and the summary: which rows meet each target."""
    ar = rows[0]
    def key(r: dict) -> tuple:
        return r.get("floor"), r["threshold"], r.get("verify", False)

    single = {key(r): r for r in rows if r.get("num_blocks") == 1}
    for r in rows[1:]:
        d = _rel(r["judge_ppl"], ar["judge_ppl"])
        r["ppl_vs_ar"] = d
        r["meets_ar_target"] = r["speedup"] >= AR_SPEED and d is not None and d <= AR_PPL
        base = single.get(key(r))
        if r["num_blocks"] > 1 and base is not None:
            r["tpf_vs_single"] = r["tokens_per_forward"] / base["tokens_per_forward"]
            r["speed_vs_single"] = r["speedup"] / base["speedup"]
            d = r["ppl_vs_single"] = _rel(r["judge_ppl"], base["judge_ppl"])
            r["meets_multi_block_target"] = r["speed_vs_single"] > 1 and d is not None and d <= MB_PPL
    ok_ppl = [r for r in rows[1:] if r["ppl_vs_ar"] is not None and r["ppl_vs_ar"] <= AR_PPL]
    best = max(ok_ppl, key=lambda r: r["speedup"], default=None)
    return {"multi_block": [r["config"] for r in rows if r.get("meets_multi_block_target")],
            "vs_ar": [r["config"] for r in rows if r.get("meets_ar_target")],
            "fastest_within_ar_ppl": best and {"config": best["config"], "speedup": best["speedup"]}}


def run(args: argparse.Namespace) -> dict:
    # deferred: the engine and the eval modules load only when this suite runs
    from leapfrog import LLM
    from leapfrog.eval.evaluate import continuation_text
    from leapfrog.methods.diffusion import DiffusionCounters

    # --model's default is the AR model, which cannot decode by diffusion: this suite's is ours.
    args.model = str(resolve_model("stories-diffusion" if args.model == DEFAULT_MODEL else args.model))
    args.ar_model = str(resolve_model(args.ar_model))
    torch.set_num_threads(args.threads)
    prompts = opening_prompts(args.num_prompts)
    cfgs = configs(args)
    log(f"{args.model} against ar on {args.ar_model}: {len(cfgs)} configs, {len(prompts)} prompts, "
        f"up to {args.new_tokens} new tokens, {args.threads} threads")
    # every engine's (`ar`'s too; default: each model folder's own); the judge stays float32
    precision = {"matmul_precision": args.matmul_precision} if getattr(args, "matmul_precision", None) else {}
    engines = [LLM(c.model, method=c.method, max_batch_size=len(prompts), **{**precision, **c.options})
               for c in cfgs]
    for llm in engines:                       # warm-up, then count only the measured run
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0))
        if llm.engine.method.name == "diffusion":
            llm.engine.method.counters = DiffusionCounters()
    outs, wall = run_latency(engines, prompts, args.new_tokens)
    stats = [llm.engine.method.stats() for llm in engines]
    batched = run_batched(engines, prompts, args.new_tokens, args.repeats)
    texts = [[continuation_text(llm.tokenizer, o) for o in os_] for llm, os_ in zip(engines, outs)]
    qual = quality(texts, prompts, args.ar_model, engines[0].engine.device)
    rows = []
    for c, os_, w, st, b, q, ts in zip(cfgs, outs, wall, stats, batched, qual, texts):
        n = sum(o.metrics.num_output_tokens for o in os_)
        rows.append({"config": c.label, "method": c.method, **c.options, "output_tokens": n,
                     "mean_output_tokens": n / len(os_), "tokens_per_forward": n / max(1, sum(
                         o.metrics.num_forwards for o in os_)), "wall_s": w, "tokens_per_s": n / w,
                     "batched_tokens_per_s": b, "active_blocks_per_step": st.get("active_blocks_per_step"),
                     "same_as_ar": sum(o.token_ids == a.token_ids for o, a in zip(os_, outs[0])),
                     **q, "samples": ts[:2]})
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        r["batched_vs_ar"] = r["batched_tokens_per_s"] / rows[0]["batched_tokens_per_s"]
    targets = check_targets(rows)
    return {"suite": "diffusion", "model": args.model, "ar_model": args.ar_model, "judge": args.ar_model,
            "matmul_precision": [e.engine.config.matmul_precision for e in engines], "threads": args.threads,
            "new_tokens": args.new_tokens, "num_prompts": len(prompts),
            "torch": torch.__version__, "device": str(engines[0].engine.device), "rows": rows, "targets": targets}


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:+.1f}%"


def markdown(result: dict) -> str:
    head = (f"| config | tokens / forward | tok/s (batch 1) | speed-up vs ar | tok/s (batch {result['num_prompts']}) "
            f"| same as ar | judge ppl | rep-4 | coherence | vs N=1: speed, tokens/forward, ppl (>1x, ≤+{MB_PPL:.0%}) "
            f"| vs ar: ppl (≥{AR_SPEED:g}x, ≤+{AR_PPL:.0%}) |")
    lines = [head, "|---" * 11 + "|"]
    mark = lambda ok: " ✓" if ok else " ✗"
    for r in result["rows"]:
        ppl = "—" if r["judge_ppl"] is None else f"{r['judge_ppl']:.2f}"
        mb = (f"{r['speed_vs_single']:.2f}x, {r['tpf_vs_single']:.2f}x, {_pct(r['ppl_vs_single'])}"
              f"{mark(r['meets_multi_block_target'])}"
              if "tpf_vs_single" in r else "—")
        vs_ar = f"{_pct(r['ppl_vs_ar'])}{mark(r['meets_ar_target'])}" if "ppl_vs_ar" in r else "—"
        lines.append(f"| {r['config']} | {r['tokens_per_forward']:.2f} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f}x "
                     f"| {r['batched_tokens_per_s']:.0f} ({r['batched_vs_ar']:.2f}x) "
                     f"| {r.get('same_as_ar', '—')}/{result['num_prompts']} | {ppl} | {r['rep_4']:.3f} "
                     f"| {r['coherence']:.3f} | {mb} | {vs_ar} |")
    t = result["targets"]
    best = t["fastest_within_ar_ppl"]
    lines += ["", f"- multi-block faster than single-block at batch 1, judge ppl ≤ +{MB_PPL:.0%}: "
              + (", ".join(t["multi_block"]) if t["multi_block"] else "not met"),
              f"- ≥ {AR_SPEED:g}x `ar` at batch 1, judge ppl ≤ +{AR_PPL:.0%} of `ar`'s: "
              + (", ".join(t["vs_ar"]) if t["vs_ar"] else "not met")
              + (f" (fastest within the ppl bound: {best['config']}, {best['speedup']:.2f}x)" if best else "")]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["judge_ppl"] is not None]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    def group(r: dict) -> tuple:
        return r.get("num_blocks", 0), r.get("floor") or "", r.get("verify", False)

    for n, floor, verify in sorted({group(r) for r in rows}):
        pts = [r for r in rows if group(r) == (n, floor, verify)]
        name = "ar" if n == 0 else f"N={n} {floor} {'verified' if verify else ''}".replace("  ", " ").rstrip()
        ax.plot([r["speedup"] for r in pts], [r["judge_ppl"] for r in pts], "*" if n == 0 else "o-",
                ms=12 if n == 0 else 6, color="k" if n == 0 else None, label=name)
        for r in pts:
            ax.annotate(f"τ={r['threshold']:g}" if n else "ar", (r["speedup"], r["judge_ppl"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    ar = result["rows"][0]["judge_ppl"]
    if ar is not None:
        ax.axhline(ar * (1 + AR_PPL), color="gray", ls="--", lw=0.8, label=f"ar ppl +{AR_PPL:.0%}")
    ax.axvline(AR_SPEED, color="gray", ls=":", lw=0.8, label=f"{AR_SPEED:g}x ar")
    ax.set_xlabel("wall-clock speed-up over ar (batch 1, output tokens/s)")
    ax.set_ylabel(f"perplexity under {Path(result['judge']).name} (lower is better)")
    ax.set_title(f"{Path(result['model']).name}: quality against speed, {result['num_prompts']} openings")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("diffusion suite (--model defaults to stories-diffusion; --num-prompts, "
                             "--new-tokens, --repeats, --threads as above)")
    g.add_argument("--ar-model", default="stories", help="the ar baseline and the perplexity judge (default stories)")
    g.add_argument("--thresholds", type=float, nargs="+", default=[0.7, 0.8, 0.9])
    g.add_argument("--num-blocks", type=int, nargs="+", default=[1, 2, 3, 4], help="N; 1 is single-block")
    # deferred: the method code loads only when the parser is built
    from leapfrog.methods.diffusion import FLOORS
    g.add_argument("--floors", nargs="+", choices=FLOORS, default=None,
                   help="the progress floor's rule(s): which position a step forces when none clears "
                        "the threshold (default: the method's, leftmost); two values run every config twice")
    g.add_argument("--verify", action="store_true",
                   help="also run every diffusion config verified (verify=True; two-stream models only)")
    g.add_argument("--later-threshold", type=float, default=None,
                   help="τ_later for the N > 1 configs: the confidence a block after the first "
                        "unfinished one needs (default: the config's τ)")
    g.add_argument("--add-threshold", type=float, default=None,
                   help="τ_add for the N > 1 configs: the next block joins once the last active one is "
                        "this far decided (default: the method's, 0.1)")
    g.add_argument("--semi-threshold", type=float, default=None,
                   help="τ_semi for the N > 1 configs: a later block may be forced forward once its "
                        "predecessor is this far decided (default: the method's, 0.9)")
