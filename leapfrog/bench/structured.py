"""`leapfrog bench --suite structured`: structured outputs on a served instruction model.

Against a `leapfrog serve` process per method: JSON Schema conformance with and without the
constraint, tool calls under tool_choice "required", constrained against free tokens/s (the
target ratio: >= 0.9), the constraint's own cost, and schema compile time.
(docs/architecture.md, "bench/structured.py")
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import threading
import time
from pathlib import Path

import httpx

from leapfrog.bench.common import load_average, log
from leapfrog.bench.reliability import Server
from leapfrog.sampling_params import StructuredOutputs

WORDS = ("name city country color animal fruit title author genre team planet river language tool "
         "food brand street season mood hobby").split()
ENUMS = [["red", "green", "blue"], ["low", "medium", "high"], ["cat", "dog", "bird", "fish"],
         ["yes", "no"], ["north", "south", "east", "west"], ["draft", "final"]]
PATTERNS = [("^[A-Z][a-z]{2,12}$", "a capitalized word"), ("^[0-9]{3}-[0-9]{4}$", "a code like 555-1234"),
            ("^[a-z]{2,8}(-[a-z]{2,8}){0,3}$", "lowercase words joined by hyphens"), ("^#[0-9a-f]{6}$", "a hex color")]
TOPICS = ["a library book", "a city trip", "a pet", "a football match", "a recipe", "a planet", "a song",
          "a weather report", "a shop order", "a school class", "a movie", "a garden"]


def _field(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "string", "integer", "number", "boolean", "enum", "pattern", "array",
                       "object" if depth < 2 else "integer"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([20, 40, 60])}
    if kind == "integer":
        lo = rng.choice([0, 1, 1900, -50])
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.choice([10, 100, 150])}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.choice(ENUMS)}
    if kind == "pattern":
        pattern, what = rng.choice(PATTERNS)
        return {"type": "string", "pattern": pattern, "description": what}
    if kind == "array":
        items = rng.choice([{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0, "maximum": 99},
                            {"enum": rng.choice(ENUMS)}])
        return {"type": "array", "items": items, "minItems": rng.choice([0, 1]), "maxItems": rng.choice([3, 5])}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth else 5))
    props = {n: _field(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schema_suite(num: int, seed: int = 0) -> list[dict]:
    """`num` JSON Schemas, the same for a seed."""
    rng = random.Random(seed)
    return [_object(rng) for _ in range(num)]


def prompt_for(schema: dict, k: int) -> str:
    return (f"Describe {TOPICS[k % len(TOPICS)]} as a JSON object that follows this JSON Schema:\n"
            f"{json.dumps(schema)}\nReply with the JSON object only.")


def valid(text: str, schema: dict) -> bool:
    # deferred: jsonschema is not a declared dependency; only the validity counts need it
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def first_json_block(text: str) -> str:
    """The first ```json fenced block, else the text from the first { to its last }."""
    m = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if m:
        return m.group(1)
    start, end = text.find("{"), text.rfind("}")
    return text[start:end + 1] if 0 <= start < end else text


def compile_times(tokenizer_folder: Path, vocab: int, schemas: list[dict]) -> dict:
    """Cold compile of each schema (a fresh compiler, so no cache), then one cache hit."""
    # deferred: the grammar compiler and tokenizer load only when compile times are measured
    from leapfrog.sample.grammar import GrammarCompiler
    from leapfrog.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(tokenizer_folder)
    compiler = GrammarCompiler(tok, vocab)
    cold = []
    for s in schemas:
        t0 = time.perf_counter()
        compiler.compile(StructuredOutputs(json=s))
        cold.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    compiler.matcher(StructuredOutputs(json=schemas[0]))
    hit = time.perf_counter() - t0
    q = statistics.quantiles(cold, n=100)
    return {"compile_ms_p50": 1e3 * statistics.median(cold), "compile_ms_p99": 1e3 * q[98],
            "compile_ms_max": 1e3 * max(cold), "cache_hit_ms": 1e3 * hit}


def _chat(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _parallel(url: str, bodies: list[dict], conc: int) -> tuple[list[dict], float]:
    """POST the bodies, `conc` at a time; (responses in order, wall seconds)."""
    out: list[dict | None] = [None] * len(bodies)
    nxt = iter(range(len(bodies)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            out[i] = _chat(url, bodies[i])
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def _body(model: str, schema: dict, k: int, new_tokens: int, constrained: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt_for(schema, k)}],
            "max_tokens": new_tokens, "temperature": 0}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema}}
    return body


def _tool_body(model: str, schema: dict, k: int, new_tokens: int) -> dict:
    tool = {"type": "function", "function": {"name": f"record_{TOPICS[k % len(TOPICS)].split()[-1]}",
                                             "description": f"Record {TOPICS[k % len(TOPICS)]}",
                                             "parameters": schema}}
    return {"model": model, "temperature": 0, "max_tokens": new_tokens, "tools": [tool], "tool_choice": "required",
            "messages": [{"role": "user", "content": f"Record {TOPICS[k % len(TOPICS)]} with the tool."}]}


def conformance(url: str, model: str, schemas: list[dict], new_tokens: int, conc: int, free: bool) -> dict:
    res, _ = _parallel(url, [_body(model, s, k, new_tokens, True) for k, s in enumerate(schemas)], conc)
    texts = [r["choices"][0]["message"]["content"] for r in res]
    cut = sum(r["choices"][0]["finish_reason"] == "length" for r in res)
    out = {"schemas": len(schemas), "constrained_valid": sum(valid(t, s) for t, s in zip(texts, schemas)),
           "constrained_cut_by_max_tokens": cut}
    if free:
        res, _ = _parallel(url, [_body(model, s, k, new_tokens, False) for k, s in enumerate(schemas)], conc)
        texts = [r["choices"][0]["message"]["content"] for r in res]
        out["free_valid"] = sum(valid(t, s) for t, s in zip(texts, schemas))
        out["free_valid_first_block"] = sum(valid(first_json_block(t), s) for t, s in zip(texts, schemas))
    res, _ = _parallel(url, [_tool_body(model, s, k, new_tokens) for k, s in enumerate(schemas)], conc)
    ok = 0
    for r, s in zip(res, schemas):
        calls = r["choices"][0]["message"].get("tool_calls") or []
        ok += bool(calls) and all(valid(c["function"]["arguments"], s) for c in calls)
    out["tool_calls_valid"] = ok
    return out


def speed(url: str, model: str, schemas: list[dict], new_tokens: int, conc: int, repeats: int) -> dict:
    """Output tokens/s over the same prompts and the same work, constrained and not: the free run
    of each prompt decodes as many tokens as its constrained reply had (`ignore_eos`), so both
    runs do the same prefills and decode steps and differ by the constraint only. Interleaved,
    best of repeats."""
    num = max(conc, 8)
    best = {True: 0.0, False: 0.0}
    lengths: list[int] | None = None
    for _ in range(repeats):
        constrained = [_body(model, s, k, new_tokens, True) for k, s in enumerate(schemas[:num])]
        res, wall = _parallel(url, constrained, conc)
        counts = [r["usage"]["completion_tokens"] for r in res]
        lengths = lengths or counts
        best[True] = max(best[True], sum(counts) / wall)
        free = [{**_body(model, s, k, n, False), "ignore_eos": True}
                for k, (s, n) in enumerate(zip(schemas[:num], lengths))]
        res, wall = _parallel(url, free, conc)
        best[False] = max(best[False], sum(r["usage"]["completion_tokens"] for r in res) / wall)
    return {"free_tok_s": best[False], "constrained_tok_s": best[True], "ratio": best[True] / best[False],
            "mean_tokens": sum(lengths or [0]) / max(1, len(lengths or []))}


PARTS = ("conformance", "speed", "overhead")
PERMISSIVE = r"[\s\S]*"        # any text: the constrained reply is the free one, token for token


def overhead(url: str, model: str, schemas: list[dict], new_tokens: int, conc: int, repeats: int) -> dict:
    """The constraint's cost alone, drafting included: a regex that allows any text, so both
    sides decode the same tokens (and a drafter gets the same drafts accepted) and end at the
    same end-of-text; tok/s each, best of interleaved repeats."""
    num = max(conc, 8)
    best = {True: 0.0, False: 0.0}
    same = True
    for _ in range(repeats):
        texts = {}
        for constrained in (True, False):
            bodies = [{"model": model, "messages": [{"role": "user", "content": f"Tell me about {TOPICS[k % len(TOPICS)]}."}],
                       "max_tokens": new_tokens, "temperature": 0,
                       **({"guided_regex": PERMISSIVE} if constrained else {})} for k in range(num)]
            res, wall = _parallel(url, bodies, conc)
            texts[constrained] = [r["choices"][0]["message"]["content"] for r in res]
            best[constrained] = max(best[constrained], sum(r["usage"]["completion_tokens"] for r in res) / wall)
        same = same and texts[True] == texts[False]
    return {"free_tok_s": best[False], "constrained_tok_s": best[True], "ratio": best[True] / best[False],
            "same_text": same}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured")
    g.add_argument("--num-schemas", type=int, default=200, help="structured: JSON Schemas in the suite")
    g.add_argument("--structured-methods", nargs="+", default=["ar", "ngram"],
                   help="structured: decoding methods to serve (each with its own server)")
    g.add_argument("--structured-parts", nargs="+", default=list(PARTS), choices=PARTS,
                   help="structured: what to measure (overhead alone suits a model with a short context)")


def run(args: argparse.Namespace) -> dict:
    # deferred: the model code loads only when this suite runs
    from leapfrog.config import resolve_model
    from leapfrog.models.loader import read_config
    model_dir = Path(resolve_model(args.model))
    vocab = int(read_config(model_dir)["vocab_size"])
    schemas = schema_suite(args.num_schemas)
    result = {"model": args.model, "num_schemas": len(schemas), "new_tokens": args.new_tokens,
              "load_average_start": load_average(), "compile": compile_times(model_dir, vocab, schemas),
              "methods": {}}
    concurrency = args.concurrency or [1, 32]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for method in args.structured_methods:
        flags = ["--model", args.model, "--method", method, "--max-batch-size", str(max(concurrency)),
                 "--served-model-name", "m"]
        if method == "ngram":
            flags += ["--option", "prompt_lookup_min=2"]
        log(f"structured: serving {args.model} with {method}")
        server = Server(flags, out / f"structured-{method}.log")
        try:
            server.wait_ready()
            row: dict = {}
            if "conformance" in args.structured_parts:
                row = conformance(server.url, "m", schemas, args.new_tokens, max(concurrency), free=method == "ar")
                log(f"structured: {method} conformance {row}")
            for part, fn in (("speed", speed), ("overhead", overhead)):
                if part in args.structured_parts:
                    row[part] = {str(c): fn(server.url, "m", schemas, args.new_tokens, c, args.repeats)
                                 for c in concurrency}
                    log(f"structured: {method} {part} {row[part]}")
        finally:
            server.stop()
        result["methods"][method] = row
    result["load_average_end"] = load_average()
    return result


def _ratio_cells(rows: dict) -> str:
    return " | ".join(f"{v['free_tok_s']:.0f} → {v['constrained_tok_s']:.0f} ({v['ratio']:.2f}x)" for v in rows.values())


def markdown(result: dict) -> str:
    c = result["compile"]
    methods = result["methods"]
    lines = [f"Structured outputs, {result['model']}, {result['num_schemas']} JSON Schemas, greedy, "
             f"max {result['new_tokens']} tokens. Schema compile (cold): p50 {c['compile_ms_p50']:.2f} ms, "
             f"p99 {c['compile_ms_p99']:.2f} ms, max {c['compile_ms_max']:.2f} ms; cache hit {c['cache_hit_ms']:.3f} ms."]
    with_conf = {m: r for m, r in methods.items() if "schemas" in r}
    if with_conf:
        lines += ["", "| method | constrained valid | free valid (whole / first block) | tool calls valid (required) |",
                  "|---|---|---|---|"]
        for m, r in with_conf.items():
            n = r["schemas"]
            free = f"{r['free_valid']}/{n} / {r['free_valid_first_block']}/{n}" if "free_valid" in r else "—"
            lines.append(f"| {m} | {r['constrained_valid']}/{n} (cut by max_tokens: "
                         f"{r['constrained_cut_by_max_tokens']}) | {free} | {r['tool_calls_valid']}/{n} |")
    for part, title in (("speed", "Constrained (response_format json_schema) against free, the same number of "
                                  "tokens each:"),
                        ("overhead", "The constraint's cost alone (a regex allowing any text: the same tokens both "
                                     "ways):")):
        rows = {m: r[part] for m, r in methods.items() if part in r}
        if not rows:
            continue
        keys = list(next(iter(rows.values())))
        extra = " same text |" if part == "overhead" else ""
        lines += ["", title, "", "| method | " + " | ".join(f"tok/s free → constrained @{k} (ratio)" for k in keys)
                  + " |" + extra, "|---|" + "---|" * (len(keys) + (part == "overhead"))]
        for m, r in rows.items():
            same = f" {all(v['same_text'] for v in r.values())} |" if part == "overhead" else ""
            lines.append(f"| {m} | {_ratio_cells(r)} |{same}")
    lines.append(f"\nload average {result['load_average_start']:.2f} → {result['load_average_end']:.2f}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = [(f"{m} {part}", r[part]) for m, r in result["methods"].items() for part in ("speed", "overhead")
            if part in r]
    if not bars:
        return
    concs = list(bars[0][1])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(bars)
    for i, (label, rows) in enumerate(bars):
        ax.bar([j + i * width for j in range(len(concs))], [rows[c]["ratio"] for c in concs], width, label=label)
    ax.axhline(0.9, color="gray", ls="--", lw=1)
    ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(concs))], [f"{c} concurrent" for c in concs])
    ax.set_ylabel("constrained / free tok/s")
    ax.set_title(f"structured outputs, {result['model']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
