"""`leapfrog bench --serve`: load against a running server, in the manner of `vllm bench serve`.

Per request (streamed /v1/completions with usage): TTFT (first text chunk), TPOT =
(e2e - TTFT) / (output tokens - 1) with the token count taken from the server's usage (a chunk
can carry several tokens), ITL = gaps between chunks, e2e. Per load level: mean / p50 / p99 of
each, request and token throughput. Load levels are fixed concurrencies (all requests sent at
once, at most C in flight) or Poisson arrival rates (gamma gaps with --burstiness; 1 = Poisson).
One asyncio client drives everything: on a small machine, client threads would compete with
the server for cores.
With --couplet the requests are the couplet terminal's (POST /couplet with a few festive
keywords, not streamed): per level, completed requests, requests shed with 429 (+ Retry-After:
load shedding, reported apart from errors; the client then waits Retry-After, as browsers and
SDKs do, before its next request), errors, req/s, latency p50/p99 as the client sees it and as
the server timed it (from the request's arrival in its handler), and the server's peak
resident memory (its `process_resident_memory_bytes`, polled while the level runs).
Writes <out>/<name>.json, <name>.md and <name>.png (latency against load).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PERCENTILES = (50, 99)


def log(msg: str) -> None:
    print(f"[bench --serve] {msg}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    num_chunks: int = 0
    shed: bool = False                 # 429 with Retry-After: the server shed load, not an error
    retry_after: float = 0.0
    server_s: float | None = None      # the server's own time for the request (couplets: timing.seconds)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def prompts(num: int, max_words: int, seed: int) -> list[str]:
    """Openings of held-out stories (our own split); synthetic sentences without the data."""
    try:
        from leapfrog.data.corpus import heldout
        texts = heldout("stories")
    except Exception:
        texts = []
    if not texts:
        texts = [f"Once upon a time there was a little {w} who liked to play in the {p}."
                 for w in ("cat", "dog", "girl", "boy", "bird", "fox") for p in ("sun", "park", "snow")]
    rng = random.Random(seed)
    return [" ".join(rng.choice(texts).split()[:max_words]) for _ in range(num)]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not _chunk_text(chunk):
                    continue
                res.num_chunks += 1
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        if res.output_tokens == 0:       # a server that sends no usage: one token per text chunk
            res.output_tokens = res.num_chunks
        res.ok = res.output_tokens > 0
        res.error = "" if res.ok else "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


# Keywords a festive crowd types: the couplet load test draws from these.
COUPLET_KEYWORDS = ("马年 吉祥", "春 福", "龙年 大吉", "平安 如意", "山 水", "月", "新春 快乐", "家和 万事兴",
                    "五谷 丰登", "花开 富贵", "福 寿", "春风 得意", "国泰 民安", "金 玉", "瑞雪 丰年")


async def one_couplet(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    try:
        r = await client.post(url, json=body)
        res.e2e = time.perf_counter() - start
        if r.status_code == 429 and r.headers.get("retry-after"):
            res.shed, res.error = True, "shed (429)"
            res.retry_after = float(r.headers["retry-after"]) if r.headers["retry-after"].isdigit() else 1.0
        elif r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {r.text[:200]!r}"
        else:
            data = r.json()
            res.ok = bool(data.get("upper")) and len(data["upper"]) == len(data.get("lower", ""))
            res.output_tokens = len(data.get("upper", "")) * 2 + len(data.get("horizontal", ""))
            res.ttft = res.e2e
            res.server_s = (data.get("timing") or {}).get("seconds")
            res.error = "" if res.ok else f"malformed couplet: {str(data)[:120]}"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def peak_memory(client: httpx.AsyncClient, base: str, stop: asyncio.Event) -> float:
    """The server's largest resident memory (bytes) seen while `stop` is unset, polled twice a second."""
    peak = 0.0
    while True:
        peak = max(peak, (await scrape(client, base)).get("process_resident_memory_bytes", 0.0))
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
            return peak
        except asyncio.TimeoutError:
            pass


def _chunk_text(chunk: dict) -> str:
    c = chunk["choices"][0]
    return c.get("text") or (c.get("delta") or {}).get("content") or ""


def _gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Arrival gaps: all zero for rate inf, else gamma(shape=burstiness, mean=1/rate)."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


async def run_level(args: argparse.Namespace, base: str, model: str, concurrency: int | None, rate: float,
                    num: int) -> dict:
    texts = prompts(num, args.prompt_words, args.seed)
    sem = asyncio.Semaphore(concurrency or num)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = base.rstrip("/") + ("/couplet" if args.couplet else "/v1/completions")
    limits = httpx.Limits(max_connections=(concurrency or num) + 4)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        before = await scrape(client, base)
        load_before = os.getloadavg()[0]
        stop = asyncio.Event()
        memory = asyncio.create_task(peak_memory(client, base, stop))

        async def go(i: int) -> RequestResult:
            if args.couplet:
                body = {"keywords": COUPLET_KEYWORDS[i % len(COUPLET_KEYWORDS)], "seed": args.seed + i}
                async with sem:
                    res = await one_couplet(client, url, body)
                    if res.shed:      # a client told to come back later waits before its next request
                        await asyncio.sleep(min(res.retry_after, 30.0))
                    return res
            body = {"model": model, "prompt": texts[i], "max_tokens": args.max_tokens, "stream": True,
                    "temperature": args.temperature, "ignore_eos": args.ignore_eos, "seed": args.seed + i,
                    "stream_options": {"include_usage": True}}
            async with sem:
                return await one_request(client, url, body)
        rng = random.Random(args.seed)
        tasks, t0 = [], time.perf_counter()
        for i, gap in enumerate(_gaps(num, rate, args.burstiness, rng)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(go(i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        stop.set()
        peak = await memory
        after = await scrape(client, base)
    summary = summarize(results, duration, concurrency, rate, before, after)
    summary["load_average_1m"] = load_before     # the machine's own load: context for the numbers
    summary["server_peak_rss_bytes"] = peak or None
    return summary


async def scrape(client: httpx.AsyncClient, base: str) -> dict[str, float]:
    """Server-side counters (tokens per forward comes from here, not from the client)."""
    try:
        text = (await client.get(base.rstrip("/") + "/metrics")).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("leapfrog:request_forwards_total", "leapfrog:generation_tokens_total",
                            "process_resident_memory_bytes")):
            name = line.split("{")[0].split(" ")[0].removeprefix("leapfrog:")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    s = sorted(values)

    def pct(p: float) -> float:      # linear interpolation between closest ranks
        k = (len(s) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)
    return {"mean": sum(s) / len(s), **{f"p{p}": pct(p) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float, concurrency: int | None, rate: float,
              before: dict, after: dict) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    fwd = after.get("request_forwards_total", 0) - before.get("request_forwards_total", 0)
    gen = after.get("generation_tokens_total", 0) - before.get("generation_tokens_total", 0)
    return {
        "concurrency": concurrency, "request_rate": None if math.isinf(rate) else rate,
        "num_requests": len(results), "completed": len(ok), "failed": sum(not r.ok and not r.shed for r in results),
        "shed": sum(r.shed for r in results), "errors": sorted({r.error for r in results if not r.ok and not r.shed})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "server_tokens_per_forward": gen / fwd if fwd else None,
        "ttft_s": _stats([r.ttft for r in ok]), "tpot_s": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_s": _stats([x for r in ok for x in r.itl]), "e2e_s": _stats([r.e2e for r in ok]),
        "server_s": _stats([r.server_s for r in ok if r.server_s is not None]),
    }


# --- reporting -------------------------------------------------------------------------------
def couplet_markdown(result: dict) -> str:
    rows = ["| concurrent clients | done/sent | shed (429) | errors | req/s | latency p50 / p99 (s) | "
            "server-side p50 / p99 (s) | server peak RSS (MiB) |", "|" + "---|" * 8]
    for lv in result["levels"]:
        rss = lv.get("server_peak_rss_bytes")
        rows.append(f"| {lv['concurrency']} | {lv['completed']}/{lv['num_requests']} | {lv['shed']} | {lv['failed']} | "
                    f"{lv['request_throughput']:.1f} | {lv['e2e_s']['p50']:.2f} / {lv['e2e_s']['p99']:.2f} | "
                    f"{lv['server_s']['p50']:.2f} / {lv['server_s']['p99']:.2f} | "
                    f"{'-' if not rss else f'{rss / 2**20:.0f}'} |")
    loads = ", ".join(f"{lv.get('load_average_1m', math.nan):.1f}" for lv in result["levels"])
    return "\n".join(rows) + (f"\nPOST /couplet at {result['config']['url']}; 1-min load average before each "
                              f"level: {loads}; {result['timestamp']}.")


def markdown(result: dict) -> str:
    if result["config"].get("couplet"):
        return couplet_markdown(result)
    head = ("| load | done/sent | req/s | out tok/s | total tok/s | TTFT mean / p50 / p99 (ms) | "
            "TPOT mean / p50 / p99 (ms) | ITL p50 / p99 (ms) | E2E mean / p50 / p99 (s) | tok/fwd |")
    rows = [head, "|" + "---|" * 10]
    for lv in result["levels"]:
        load = f"c={lv['concurrency']}" if lv["request_rate"] is None else f"{lv['request_rate']:g} req/s"
        e2e = " / ".join(f"{lv['e2e_s'][k]:.2f}" for k in ("mean", "p50", "p99"))
        tpf = lv["server_tokens_per_forward"]
        rows.append(f"| {load} | {lv['completed']}/{lv['num_requests']} | {lv['request_throughput']:.2f} | "
                    f"{lv['output_throughput']:.1f} | {lv['total_token_throughput']:.1f} | {_ms(lv['ttft_s'])} | "
                    f"{_ms(lv['tpot_s'])} | {_ms(lv['itl_s'], ('p50', 'p99'))} | {e2e} | "
                    f"{'-' if tpf is None else f'{tpf:.2f}'} |")
    cfg = result["config"]
    loads = ", ".join(f"{lv.get('load_average_1m', math.nan):.1f}" for lv in result["levels"])
    note = (f"\n{result['model']} at {cfg['url']}; {cfg['max_tokens']} output tokens per request "
            f"(ignore_eos={cfg['ignore_eos']}), prompts of <= {cfg['prompt_words']} words, "
            f"temperature {cfg['temperature']}; 1-min load average before each level: {loads}; "
            f"{result['timestamp']}.")
    off = result.get("offline")
    if off:
        first = result["levels"][0]
        note += (f"\nOffline engine ({off['model']}, {off['threads']} threads, in the bench's process, the same "
                 f"prompts one at a time): TPOT p50 {off['tpot_s']['p50'] * 1e3:.2f} ms; served TPOT p50 at "
                 f"{'c=' + str(first['concurrency']) if first['request_rate'] is None else 'the first level'} "
                 f"is {first['tpot_s']['p50'] / off['tpot_s']['p50']:.2f}x it.")
    return "\n".join(rows) + "\n" + note + compare(result)


def compare(result: dict) -> str:
    """leapfrog against the peer, level by level (empty without a peer)."""
    peer = result.get("peer")
    if not peer:
        return ""
    name = peer["name"]
    rows = ["", "", f"| load | leapfrog out tok/s | {name} out tok/s | leapfrog / {name} | TPOT p50 leapfrog (ms) | "
            f"TPOT p50 {name} (ms) | TTFT p50 leapfrog (ms) | TTFT p50 {name} (ms) |", "|" + "---|" * 8]
    for a, b in zip(result["levels"], peer["levels"]):
        load = f"c={a['concurrency']}" if a["request_rate"] is None else f"{a['request_rate']:g} req/s"
        ratio = a["output_throughput"] / b["output_throughput"] if b["output_throughput"] else float("nan")
        rows.append(f"| {load} | {a['output_throughput']:.1f} | {b['output_throughput']:.1f} | {ratio:.2f}x | "
                    f"{a['tpot_s']['p50'] * 1e3:.1f} | {b['tpot_s']['p50'] * 1e3:.1f} | "
                    f"{a['ttft_s']['p50'] * 1e3:.0f} | {b['ttft_s']['p50'] * 1e3:.0f} |")
    return "\n".join(rows) + f"\n{name} at {peer['url']} serving {peer['model']}."


def _ms(stats: dict, keys: tuple[str, ...] = ("mean", "p50", "p99")) -> str:
    return " / ".join(f"{stats[k] * 1e3:.1f}" for k in keys)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = result["levels"]
    by_rate = levels[0]["request_rate"] is not None
    x = [lv["request_rate"] if by_rate else lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        ax1.plot(x, [lv[key]["p50"] for lv in levels], marker="o", label=f"{label} p50")
        ax1.plot(x, [lv[key]["p99"] for lv in levels], marker="x", linestyle="--", label=f"{label} p99")
    ax1.set(xlabel="request rate (req/s)" if by_rate else "concurrent clients", ylabel="seconds",
            xscale="log", yscale="log", title="latency against load")
    ax1.legend(fontsize=7)
    ax2.plot(x, [lv["output_throughput"] for lv in levels], marker="o")
    ax2.set(xlabel=ax1.get_xlabel(), ylabel="output tokens/s", xscale="log", title="throughput")
    fig.suptitle(f"leapfrog serve: {result['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leapfrog bench --serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    p.add_argument("--model", default=None, help="model id (default: the server's first /v1/models entry)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels (default 1,8,32)")
    p.add_argument("--request-rate", default=None,
                   help="comma-separated Poisson arrival rates in req/s (replaces --concurrency; 'inf' = burst)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on in-flight requests with --request-rate")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    p.add_argument("--num-prompts", type=int, default=0, help="requests per level (default max(8, 2 x level))")
    p.add_argument("--warmup", type=int, default=8,
                   help="untimed requests to each server before the first level (8 at once), so that "
                        "neither the client's nor the server's first-use costs land in a level (default 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=24, help="words of each story opening used as prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: always generate --max-tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--couplet", action="store_true",
                   help="load the couplet terminal instead: POST /couplet with festive keywords (not streamed)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request client timeout (s)")
    p.add_argument("--out", default="bench_results", help="output folder")
    p.add_argument("--name", default="serve", help="file stem of the results")
    p.add_argument("--peer-url", default=None, help="a peer OpenAI-compatible server (llama-server, vLLM) "
                   "measured with the same client and prompts, level by level; one comparison table")
    p.add_argument("--peer-name", default="llama-server", help="the peer's name in the table")
    p.add_argument("--offline-model", default=None,
                   help="also decode the same prompts one at a time with this model in the bench's own "
                        "process (the server idle meanwhile): the offline TPOT that served TPOT at one client "
                        "is compared with")
    p.add_argument("--offline-threads", type=int, default=2, help="CPU threads of the offline engine")
    return p


def offline_reference(args: argparse.Namespace) -> dict:
    """TPOT of the offline engine on the first level's prompts, one request at a time, with the
    same settings, measured as the client measures it: (end - first token) / (tokens - 1)."""
    from leapfrog import LLM, SamplingParams
    llm = LLM(args.offline_model, num_threads=args.offline_threads)
    texts = prompts(max(8, args.num_prompts or 8), args.prompt_words, args.seed)
    llm.generate(texts[:1], SamplingParams(max_tokens=8, temperature=0))         # warm-up
    tpot = []
    for i, text in enumerate(texts):
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                ignore_eos=args.ignore_eos, seed=args.seed + i)
        m = llm.generate([text], params)[0].metrics
        if m.num_output_tokens > 1 and m.time_to_first_token is not None:
            tpot.append((m.total_time - m.time_to_first_token) / (m.num_output_tokens - 1))
    return {"model": args.offline_model, "threads": args.offline_threads, "tpot_s": _stats(tpot)}


def _levels(args: argparse.Namespace) -> list[tuple[int | None, float]]:
    if args.request_rate:
        return [(args.max_concurrency, float(r)) for r in args.request_rate.split(",")]
    return [(int(c), math.inf) for c in args.concurrency.split(",")]


async def first_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        return (await client.get(url.rstrip("/") + "/v1/models")).json()["data"][0]["id"]


async def _run(args: argparse.Namespace) -> dict:
    """Each load level against leapfrog and, with --peer-url, against the peer server with the
    same client, prompts and settings; the two alternate which goes first from level to level."""
    model = args.model or ("couplet terminal" if args.couplet else await first_model(args.url, args.api_key))
    targets = [("leapfrog", args.url, model)]
    if args.peer_url:
        targets.append((args.peer_name, args.peer_url, await first_model(args.peer_url, args.api_key)))
    levels: dict[str, list[dict]] = {name: [] for name, _, _ in targets}
    offline = None
    for name, url, target_model in targets:
        if args.warmup:
            log(f"{name}: {args.warmup} untimed warm-up requests")
            await run_level(args, url, target_model, min(args.warmup, 8), math.inf, args.warmup)
    for k, (concurrency, rate) in enumerate(_levels(args)):
        num = args.num_prompts or max(8, 2 * (concurrency or int(min(rate, 64)) or 1))
        for name, url, target_model in (targets if k % 2 == 0 else targets[::-1]):
            log(f"{name}: level concurrency={concurrency} rate={rate:g}: {num} requests")
            lv = await run_level(args, url, target_model, concurrency, rate, num)
            log(f"  {lv['completed']}/{num} ok, {lv['output_throughput']:.1f} out tok/s, "
                f"TTFT p50 {lv['ttft_s']['p50'] * 1e3:.0f} ms, TPOT p50 {lv['tpot_s']['p50'] * 1e3:.1f} ms")
            levels[name].append(lv)
        if k == 0 and args.offline_model:      # right after the level it is compared with
            log(f"offline reference: {args.offline_model}, one request at a time")
            offline = offline_reference(args)
    cfg = {k: v for k, v in vars(args).items() if k not in ("api_key", "serve")}
    result = {"model": model, "config": cfg, "levels": levels["leapfrog"],
              "timestamp": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.peer_url:
        result["peer"] = {"name": args.peer_name, "url": args.peer_url, "model": targets[1][2],
                          "levels": levels[args.peer_name]}
    if args.offline_model:
        result["offline"] = offline
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = asyncio.run(_run(args))
    except httpx.HTTPError as exc:
        print(f"leapfrog bench --serve: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / f"{args.name}.md").write_text(table + "\n")
    plot(result, out / f"{args.name}.png")
    print(table)
    log(f"wrote {out}/{args.name}.json, .md, .png")
    every = result["levels"] + result.get("peer", {}).get("levels", [])
    return 0 if all(lv["failed"] == 0 for lv in every) else 1
