"""`leapfrog bench --suite soak`: a long mixed run against one `leapfrog serve` process (see
reliability.py for the server harness).
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from leapfrog.bench.common import load_average, log
from leapfrog.bench.reliability import Server

MODELS = ("stories", "couplets", "stories-diffusion")
FLAGS = ["--model", "stories", "--model", "couplets", "--model", "stories-diffusion", "--method", "dspark",
         "--max-batch-size", "16", "--max-queue-size", "64", "--request-timeout", "120"]
SAMPLING = [
    {"temperature": 0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.0, "top_k": 40, "repetition_penalty": 1.1, "presence_penalty": 0.5},
    {"temperature": 0.8, "seed": 7, "frequency_penalty": 0.3},
    {"temperature": 0.7, "stop": [".", "\n"], "min_p": 0.05},
]
PROMPTS = {"stories": ["Once upon a time", "The little dog", "One day, Lily found", "Tom and his mom"],
           "couplets": ["春回大地", "福满人间", "瑞雪兆丰年", "花开富贵"],
           "stories-diffusion": ["Once upon a time", "The sun was", "Ben had a red ball"]}
BAD = [  # (body or raw bytes, expected status)
    (b"{not json", 400), ({"prompt": "hi", "max_token": 5}, 400), ({"prompt": "hi", "temperature": -1}, 400),
    ({"prompt": "hi", "model": "/etc/passwd"}, 404), ({"prompt": "hi", "top_k": 2 ** 70}, 400),
    ({"prompt": "", "max_tokens": 4}, 400), ({"prompt": "x" * (5 << 20)}, 413),
]
KINDS = {"completion": 30, "completion_stream": 20, "chat": 10, "chat_stream": 10, "aborted_stream": 10,
         "couplet": 8, "bad": 10, "generate_n2_logprobs": 2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sample-interval", type=float, default=10.0, help="soak: seconds between memory samples")


class Tally:
    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {}
        self.unexpected: list[str] = []
        self.tokens = 0

    def add(self, kind: str, ok: bool, what: str) -> None:
        key = f"{kind}: {what}"
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if not ok and len(self.unexpected) < 50:
            self.unexpected.append(key)

    @property
    def num_unexpected(self) -> int:
        return sum(n for k, n in self.outcomes.items() if k.split(": ", 1)[1].startswith("UNEXPECTED"))


async def _request(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random, tally: Tally) -> None:
    model = rng.choice(MODELS)
    prompt = rng.choice(PROMPTS[model])
    params = {**rng.choice(SAMPLING), "max_tokens": rng.choice([16, 32, 64]), "model": model}
    if model == "stories-diffusion":        # block diffusion takes greedy-or-temperature sampling
        params = {"temperature": rng.choice([0, 0.7]), "max_tokens": rng.choice([16, 32]), "model": model}
    try:
        if kind == "bad":
            body, want = rng.choice(BAD)
            r = await (client.post(url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
                       if isinstance(body, bytes) else client.post(url + "/v1/completions", json=body))
            tally.add(kind, r.status_code == want, f"{r.status_code}" if r.status_code == want
                      else f"UNEXPECTED {r.status_code} (wanted {want})")
            return
        if kind == "couplet":
            r = await client.post(url + "/couplet", json={"keywords": rng.choice(["马年 吉祥", "春", "福 寿", "平安"])})
            _status(tally, kind, r.status_code, r.status_code == 200 and bool(r.json().get("upper")))
            return
        if kind in ("chat", "chat_stream"):
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **params}
        elif kind == "generate_n2_logprobs":
            path, body = "/v1/completions", {"prompt": prompt, "n": 2, "logprobs": 2, **params}
            if model == "stories-diffusion":
                body.pop("logprobs")
        else:
            path, body = "/v1/completions", {"prompt": prompt, **params}
        if kind.endswith("stream"):
            await _stream(client, url + path, body, kind, rng, tally)
            return
        r = await client.post(url + path, json=body)
        ok = r.status_code == 200 and all(c["finish_reason"] for c in r.json()["choices"])
        if ok:
            tally.tokens += r.json()["usage"]["completion_tokens"]
        _status(tally, kind, r.status_code, ok)
    except httpx.HTTPError as exc:
        tally.add(kind, False, f"UNEXPECTED {type(exc).__name__}")


async def _stream(client, url: str, body: dict, kind: str, rng: random.Random, tally: Tally) -> None:
    stop_after = rng.randint(1, 4) if kind == "aborted_stream" else None
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            await r.aread()
            _status(tally, kind, r.status_code, False)
            return
        events, finished, error = 0, False, None
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            events += 1
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
            elif chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                finished = True
            if stop_after is not None and events >= stop_after:
                break              # hang up mid-stream
    if stop_after is not None:
        tally.add(kind, True, "aborted by the client")
    else:
        tally.add(kind, finished and error is None, "200" if finished and error is None
                  else f"UNEXPECTED stream ended without finishing ({error})")


def _status(tally: Tally, kind: str, status: int, ok: bool) -> None:
    if status == 429:
        tally.add(kind, True, "429 at capacity")
    else:
        tally.add(kind, ok, str(status) if ok else f"UNEXPECTED {status}")


async def _worker(url: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items())
    async with httpx.AsyncClient(timeout=180) as client:
        while time.time() < deadline:
            await _request(client, url, rng.choices(kinds, weights)[0], rng, tally)


async def _sampler(server: Server, deadline: float, interval: float, samples: list, t0: float) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while time.time() < deadline:
            text = (await client.get(server.url + "/metrics")).text
            samples.append({"t": time.time() - t0, "rss_mb": server.series("process_resident_memory_bytes", text)
                            .get("", 0.0) / 2**20, "kv_used": sum(server.series("leapfrog:kv_cache_used_blocks",
                                                                                 text).values()),
                            "generated": sum(server.series("leapfrog:generation_tokens_total", text).values())})
            await asyncio.sleep(interval)


async def _soak(server: Server, args: argparse.Namespace, tally: Tally, samples: list) -> None:
    t0 = time.time()
    deadline = t0 + args.duration
    workers = [_worker(server.url, 1000 + i, deadline, tally) for i in range(args.clients)]
    progress = asyncio.create_task(_progress(deadline, tally, samples))
    await asyncio.gather(_sampler(server, deadline, args.sample_interval, samples, t0), *workers)
    progress.cancel()


async def _progress(deadline: float, tally: Tally, samples: list) -> None:
    while True:
        await asyncio.sleep(60)
        last = samples[-1] if samples else {"rss_mb": 0, "kv_used": 0}
        log(f"soak: {max(0, deadline - time.time()) / 60:.1f} min left, {sum(tally.outcomes.values())} requests, "
            f"{tally.num_unexpected} unexpected, RSS {last['rss_mb']:.0f} MB, KV blocks {last['kv_used']:.0f}")


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warmup = args.warmup if args.warmup is not None else max(60.0, args.duration / 10)
    server = Server(FLAGS, out / "soak-server.log")
    tally, samples = Tally(), []
    la0 = load_average()
    try:
        server.wait_ready()
        before = server.responses()           # the readiness polls' 503s are not the soak's
        log(f"soak: {args.duration:.0f} s, {args.clients} clients, warm-up {warmup:.0f} s")
        asyncio.run(_soak(server, args, tally, samples))
        kv_idle = server.wait_idle(60)
        responses = {k: v - before.get(k, 0) for k, v in server.responses().items()}
        restarts = sum(server.series("leapfrog:engine_restarts_total").values())
        rss_end = server.rss() / 2**20
    finally:
        code = server.stop()
    if args.warmup is None:
        warmup = settled(samples, warmup)
    after = [s["rss_mb"] for s in samples if s["t"] >= warmup]
    base = after[0] if after else 0.0
    fixed = [s["rss_mb"] for s in samples if s["t"] >= max(60.0, args.duration / 10)]
    return {"duration_s": args.duration, "clients": args.clients, "warmup_s": warmup, "models": list(MODELS),
            "rss_growth_from_tenth_pct": 100 * (rss_end - fixed[0]) / fixed[0] if fixed else 0.0,
            "requests": sum(tally.outcomes.values()), "unexpected": tally.num_unexpected,
            "unexpected_examples": tally.unexpected[:20], "outcomes": dict(sorted(tally.outcomes.items())),
            "responses": {str(k): int(v) for k, v in sorted(responses.items())},
            "server_5xx": int(sum(v for s, v in responses.items() if s >= 500)), "engine_restarts": restarts,
            "rss_after_warmup_mb": base, "rss_end_mb": rss_end, "rss_max_mb": max(after or [0.0]),
            "rss_growth_pct": 100 * (rss_end - base) / base if base else 0.0,
            "kv_used_idle": kv_idle, "samples": samples, "load_average_start": la0,
            "load_average_end": load_average(), "server_exit": code, "command": server.command}


def settled(samples: list[dict], at_least: float, window: float = 60.0, tolerance: float = 0.01) -> float:
    """The end of warm-up: the first time, no earlier than `at_least`, at which resident memory
    is within `tolerance` of what it was `window` seconds before (allocator pools and lazily
    built state have reached their size; what grows after that is what a leak would be)."""
    for s in samples:
        if s["t"] < at_least:
            continue
        before = [x for x in samples if x["t"] <= s["t"] - window]
        if before and s["rss_mb"] <= before[-1]["rss_mb"] * (1 + tolerance):
            return s["t"]
    return at_least


def markdown(result: dict) -> str:
    r = result
    return "\n".join([
        f"load average {r['load_average_start']:.2f} at the start, {r['load_average_end']:.2f} at the end", "",
        "| soak | value |", "|---|---|",
        f"| duration, clients | {r['duration_s'] / 60:.0f} min, {r['clients']} concurrent clients |",
        f"| served | {', '.join(r['models'])} (dspark, ar + couplet writer, diffusion) |",
        f"| requests | {r['requests']} ({r['unexpected']} unexpected outcomes; server 5xx: {r['server_5xx']}; "
        f"engine restarts: {r['engine_restarts']:.0f}) |",
        f"| resident memory | {r['rss_after_warmup_mb']:.0f} MB after warm-up (minute {r['warmup_s'] / 60:.1f}, "
        f"when it grew under 1% in a minute) -> {r['rss_end_mb']:.0f} MB at the end ({r['rss_growth_pct']:+.1f}%); "
        f"counted from minute {max(60.0, r['duration_s'] / 10) / 60:.0f}: {r.get('rss_growth_from_tenth_pct', 0):+.1f}%; "
        f"max {r['rss_max_mb']:.0f} MB |",
        f"| KV blocks in use when idle | {r['kv_used_idle']:.0f} |",
        f"| server exit on SIGTERM | {r['server_exit']} |"])


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["samples"]
    if not s:
        return
    t = [x["t"] / 60 for x in s]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    a.plot(t, [x["rss_mb"] for x in s], label="resident memory (MB)")
    a.axvline(result["warmup_s"] / 60, color="grey", linestyle=":", label="end of warm-up")
    base = result["rss_after_warmup_mb"]
    if base:
        a.axhline(base * 1.05, color="red", linestyle="--", label="+5% of post-warm-up")
    a.set_ylabel("MB")
    a.legend(fontsize=8)
    a.set_title(f"soak: {result['requests']} requests, {result['unexpected']} unexpected")
    b.plot(t, [x["kv_used"] for x in s], label="KV blocks in use", color="tab:orange")
    b.set_ylabel("blocks")
    b.set_xlabel("minutes")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
