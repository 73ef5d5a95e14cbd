"""`leapfrog bench --suite reliability` and `--suite soak`: the server under bad input, overload,
faults and time, measured against a real `leapfrog serve` process started here (built-in models,
loopback, a free port), read back through its own /metrics.
(What it does and why in full: docs/architecture.md, "Modules in detail".)"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from leapfrog.bench import batch_jobs
from leapfrog.bench.common import load_average, log
from leapfrog.layers.parallel import free_port

PARTS = ("fuzz", "overload", "recovery", "batch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("reliability and soak")
    g.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="reliability parts to run")
    g.add_argument("--fuzz-examples", type=int, default=500, help="schemathesis examples per operation and mode")
    g.add_argument("--burst-factor", type=int, default=10, help="overload burst, in multiples of the capacity")
    g.add_argument("--capacity", type=int, nargs=2, default=[8, 8], metavar=("BATCH", "QUEUE"),
                   help="max_batch_size and max_queue_size of the overloaded server (default 8 8)")
    g.add_argument("--duration", type=float, default=1800.0, help="soak seconds (default 1800)")
    g.add_argument("--clients", type=int, default=8, help="soak: concurrent clients")
    g.add_argument("--warmup", type=float, default=None, help="soak: seconds before memory is baselined "
                   "(default: from a tenth of the duration, at least 60 s, until resident memory grows under "
                   "1%% in a minute)")


# --- a `leapfrog serve` process -----------------------------------------------------------------
class Server:
    """`leapfrog serve` in a process of its own, on loopback."""

    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # files a benchmark uploads (the fuzzer's among them) stay out of the user's own store
        self.batch_dir = None if "--batch-dir" in flags else tempfile.mkdtemp(prefix="leapfrog-bench-batches-")
        store = ["--batch-dir", self.batch_dir] if self.batch_dir else []
        cmd = [sys.executable, "-m", "leapfrog", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *flags]
        self.command = "leapfrog serve " + " ".join(cmd[4:])
        cmd += store
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"leapfrog serve exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("leapfrog serve did not become ready")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        if self.batch_dir:
            shutil.rmtree(self.batch_dir, ignore_errors=True)
        return code

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def series(self, name: str, text: str | None = None) -> dict[str, float]:
        """Every sample of one series: labels string -> value."""
        text = text if text is not None else self.metrics()
        return {m.group(1) or "": float(m.group(2))
                for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M)}

    def rss(self) -> float:
        return self.series("process_resident_memory_bytes").get("", 0.0)

    def responses(self) -> dict[int, float]:
        return {int(re.search(r'status="(\d+)"', k).group(1)): v
                for k, v in self.series("leapfrog:http_responses_total").items()}

    def kv_used(self) -> float:
        return sum(self.series("leapfrog:kv_cache_used_blocks").values())

    def wait_idle(self, timeout: float = 30.0) -> float:
        deadline = time.time() + timeout
        used = self.kv_used()
        while used and time.time() < deadline:
            time.sleep(0.2)
            used = self.kv_used()
        return used


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


# --- fuzz ---------------------------------------------------------------------------------------

def fuzz_counts(report: str, returncode: int) -> tuple[int, int]:
    """(cases generated, unique failures) from schemathesis' summary ("2221 generated, 1 found 1
    unique failure"); failures -1 where it failed without saying how often."""
    generated = re.search(r"(\d+) generated", report)
    failures = re.search(r"(\d+) found (\d+) unique failures?\b", report)
    return (int(generated.group(1)) if generated else 0,
            int(failures.group(2)) if failures else (0 if returncode == 0 else -1))


def fuzz(args: argparse.Namespace, out: Path) -> dict:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    if st is None:
        raise SystemExit("leapfrog bench --suite reliability: the fuzz part needs schemathesis "
                         "(`make setup` installs it; or pip install schemathesis)")
    server = Server([], out / "fuzz-server.log")
    try:
        server.wait_ready()
        before = server.responses()
        cmd = [st, "run", server.url + "/openapi.json", "--checks", "all", "--exclude-checks",
               "positive_data_acceptance", "--max-examples", str(args.fuzz_examples), "--workers", "1",
               "--continue-on-failure", "--request-timeout", "120"]
        log(f"fuzz: {' '.join(cmd[1:])}")
        t0 = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        report = run.stdout + run.stderr
        (out / "fuzz-schemathesis.txt").write_text(report)
        after = server.responses()
    finally:
        code = server.stop()
    counted = {s: after.get(s, 0) - before.get(s, 0) for s in after}
    cases, failures = fuzz_counts(report, run.returncode)
    return {"cases": cases, "failures": failures,
            "schemathesis_exit": run.returncode, "seconds": seconds,
            "responses": {str(k): int(v) for k, v in sorted(counted.items()) if v},
            "server_5xx": int(sum(v for s, v in counted.items() if s >= 500)),
            "server_exit": code, "command": server.command}


# --- overload ----------------------------------------------------------------------------------
async def _one(client: httpx.AsyncClient, url: str, body: dict, stream: bool) -> dict:
    t0 = time.perf_counter()
    try:
        if stream:
            async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                first = time.perf_counter() - t0
                if r.status_code != 200:
                    await r.aread()
                    return {"status": r.status_code, "seconds": first, "first": first, "finished": False,
                            "error": None if r.status_code == 429 else r.text[:200],
                            "retry_after": r.headers.get("retry-after")}
                finished, error = False, None
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"]["message"]
                        elif chunk["choices"][0].get("finish_reason"):
                            finished = True
                return {"status": r.status_code, "seconds": time.perf_counter() - t0, "first": first,
                        "finished": finished, "error": error, "retry_after": r.headers.get("retry-after")}
        r = await client.post(url + "/v1/completions", json=body)
        finished = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] is not None
        return {"status": r.status_code, "seconds": time.perf_counter() - t0, "first": time.perf_counter() - t0,
                "finished": finished, "error": None if r.status_code in (200, 429) else r.text[:200],
                "retry_after": r.headers.get("retry-after")}
    except httpx.HTTPError as exc:
        return {"status": 0, "seconds": time.perf_counter() - t0, "first": None, "finished": False,
                "error": f"{type(exc).__name__}: {exc}", "retry_after": None}


async def _raw(port: int, body: dict, stream: bool) -> dict:
    """One request on a connection of its own, over asyncio streams: a client this light keeps
    the burst's own cost off the 2 cores the server has (httpx took ~5 ms of CPU a request, which
    put 1.8 s of client time into the 429s' latency; the server answers them in ~0.1 s)."""
    data = json.dumps({**body, "stream": stream}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + data)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        first = time.perf_counter() - t0
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        payload = await reader.read()
        writer.close()
    except (OSError, ValueError, IndexError) as exc:
        return {"status": 0, "seconds": time.perf_counter() - t0, "first": None, "finished": False,
                "error": f"{type(exc).__name__}: {exc}", "retry_after": None}
    finished = b'"finish_reason": "length"' in payload or b'"finish_reason":"length"' in payload
    error = None if status in (200, 429) and b'"error"' not in payload else payload[:200].decode(errors="replace")
    return {"status": status, "seconds": time.perf_counter() - t0, "first": first, "finished": finished,
            "error": error, "retry_after": headers.get("retry-after")}


async def _burst(url: str, n: int, body: dict) -> list[dict]:
    port = int(url.rsplit(":", 1)[1])
    return await asyncio.gather(*(_raw(port, body, stream=i % 2 == 1) for i in range(n)))


def overload(args: argparse.Namespace, out: Path) -> dict:
    batch, queue = args.capacity
    capacity = batch + queue
    n = args.burst_factor * capacity
    server = Server(["--model", "stories", "--max-batch-size", str(batch), "--max-queue-size", str(queue)],
                    out / "overload-server.log")
    body = {"prompt": "Once upon a time", "max_tokens": args.new_tokens, "ignore_eos": True, "temperature": 0.7}
    try:
        server.wait_ready()
        before = server.responses()           # the readiness polls' 503s are not the burst's
        asyncio.run(_burst(server.url, capacity, body))              # warm
        alone = max(r["seconds"] for r in asyncio.run(_burst(server.url, capacity, body)))
        rss0 = server.rss()
        log(f"overload: {capacity} requests alone take {alone:.2f}s; sending {n} at once")
        la = load_average()
        t0 = time.perf_counter()
        results = asyncio.run(_burst(server.url, n, body))
        wall = time.perf_counter() - t0
        rss1 = server.rss()
        kv_after = server.wait_idle()
        responses = {k: v - before.get(k, 0) for k, v in server.responses().items()}
        still = asyncio.run(_burst(server.url, 1, body))[0]
    finally:
        code = server.stop()
    admitted = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] == 429]
    other = [r for r in results if r["status"] not in (200, 429)]
    # The bound: the admitted requests finish within 1.5x the time the same number of requests
    # takes with no burst around them (measured just before), i.e. turning the rest away costs
    # them at most half again.
    bound = 1.5 * alone
    lat = [r["seconds"] for r in admitted]
    return {"burst": n, "capacity": capacity, "batch": batch, "queue": queue, "new_tokens": args.new_tokens,
            "admitted": len(admitted), "admitted_finished": sum(r["finished"] and not r["error"] for r in admitted),
            "rejected_429": len(rejected), "other": len(other),
            "other_examples": [f"{r['status']} {r['error']}" for r in other[:5]],
            "retry_after_on_all_429": all(r["retry_after"] for r in rejected),
            "reject_p50_s": _pct([r["first"] for r in rejected], 50),
            "reject_p99_s": _pct([r["first"] for r in rejected], 99),
            "admitted_p50_s": _pct(lat, 50), "admitted_p99_s": _pct(lat, 99), "admitted_max_s": max(lat or [0]),
            "capacity_alone_s": alone, "latency_bound_s": bound, "within_bound": max(lat or [0]) <= bound,
            "wall_s": wall, "rss_before_mb": rss0 / 2**20, "rss_after_mb": rss1 / 2**20,
            "kv_used_after": kv_after, "served_after": still["status"] == 200,
            "server_5xx": int(sum(v for s, v in responses.items() if s >= 500)),
            "server_exit": code, "load_average": la, "command": server.command}


# --- recovery ----------------------------------------------------------------------------------
RECOVERY_LIMIT_S = 120.0       # seconds after the crash within which the server must answer again


def recovery(args: argparse.Namespace, out: Path, repeats: int = 3) -> dict:
    server = Server(["--fault-injection"], out / "recovery-server.log")
    rows = []
    try:
        server.wait_ready()
        before = server.responses()
        cards = httpx.get(server.url + "/v1/models").json()["data"]
        for card in cards:
            model, max_tokens = card["id"], min(480, card["max_model_len"] - 32)
            for k in range(repeats):
                rows.append(asyncio.run(_crash_once(server.url, model, max_tokens)))
                log(f"recovery: {model} #{k + 1}: ready again after {rows[-1]['recovery_s']:.2f}s, "
                    f"{rows[-1]['in_flight']} in flight -> {rows[-1]['in_flight_outcomes']}")
        restarts = server.series("leapfrog:engine_restarts_total")
        responses = {k: v - before.get(k, 0) for k, v in server.responses().items()}
    finally:
        code = server.stop()
    return {"rows": rows, "max_recovery_s": max(r["recovery_s"] for r in rows),
            "restarts_counted": sum(restarts.values()), "hung": sum(r["hung"] for r in rows),
            "server_500": int(responses.get(500, 0)), "server_exit": code, "command": server.command}


async def _crash_once(url: str, model: str, max_tokens: int, streams: int = 4) -> dict:
    body = {"prompt": "春回大地" if model == "couplets" else "Once upon a time", "model": model,
            "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [asyncio.create_task(_one(client, url, body, stream=i % 2 == 0)) for i in range(streams)]
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        r = await client.post(url + "/admin/fault", json={"fault": "engine_crash", "model": model})
        assert r.status_code == 202, r.text
        done, pending = await asyncio.wait(tasks, timeout=30)
        recovered = False
        while time.perf_counter() - t0 < RECOVERY_LIMIT_S:     # a server that never answers again fails
            ready = (await client.get(url + "/ready")).status_code == 200
            if ready:
                probe = await client.post(url + "/generate", json={**body, "max_tokens": 4})
                if probe.status_code == 200:
                    recovered = True
                    break
            await asyncio.sleep(0.05)
        recovery_s = time.perf_counter() - t0 if recovered else float("inf")
        for t in pending:
            t.cancel()
    outcomes: dict[str, int] = {}
    for t in done:
        r = t.result()
        key = "finished" if r["finished"] and not r["error"] else f"{r['status']} error" if r["error"] else str(r["status"])
        outcomes[key] = outcomes.get(key, 0) + 1
    return {"model": model, "recovery_s": recovery_s, "in_flight": streams, "in_flight_outcomes": outcomes,
            "hung": len(pending)}


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"load_average_start": load_average(), "cpus": os.cpu_count()}
    for part in args.parts:
        log(f"reliability: {part}")
        if part == "batch":
            result[part] = batch_jobs.run(Server, args, out)
            continue
        result[part] = {"fuzz": fuzz, "overload": overload, "recovery": recovery}[part](args, out)
    result["load_average_end"] = load_average()
    return result


def markdown(result: dict) -> str:
    lines = [f"load average {result['load_average_start']:.2f} at the start, {result['load_average_end']:.2f} at "
             "the end", "", "| check | what was done | outcome |", "|---|---|---|"]
    if "fuzz" in result:
        f = result["fuzz"]
        lines.append(f"| schema fuzzing | {f['cases']} schemathesis cases, valid and invalid, every endpoint "
                     f"({f['seconds']:.0f} s) | {f['failures']} failed checks; {f['server_5xx']} responses 5xx "
                     f"by the server's count |")
    if "overload" in result:
        o = result["overload"]
        lines.append(f"| overload burst | {o['burst']} requests at once ({o['burst'] // o['capacity']}x capacity "
                     f"{o['capacity']}: batch {o['batch']} + queue {o['queue']}), {o['new_tokens']} tokens each | "
                     f"{o['admitted']} admitted, {o['admitted_finished']} finished; {o['rejected_429']} x 429 "
                     f"(Retry-After on all: {o['retry_after_on_all_429']}) in {o['reject_p99_s'] * 1000:.0f} ms "
                     f"p99; {o['other']} other; admitted p99 {o['admitted_p99_s']:.2f} s, max "
                     f"{o['admitted_max_s']:.2f} s against a bound of {o['latency_bound_s']:.2f} s (1.5x the "
                     f"{o['capacity_alone_s']:.2f} s that {o['capacity']} requests take alone); RSS "
                     f"{o['rss_before_mb']:.0f} -> {o['rss_after_mb']:.0f} MB; KV blocks after: "
                     f"{o['kv_used_after']:.0f}; {o['server_5xx']} x 5xx |")
    if "batch" in result:
        lines += batch_jobs.markdown_rows(result["batch"])
    if "recovery" in result:
        r = result["recovery"]
        ends: dict[str, int] = {}
        for row in r["rows"]:
            for k, n in row["in_flight_outcomes"].items():
                ends[k] = ends.get(k, 0) + n
        said = {"500 error": "500 with the error", "200 error": "the error in the stream", "finished": "finished"}
        how = ", ".join(f"{n} {said.get(k, k)}" for k, n in sorted(ends.items()))
        models = ", ".join(dict.fromkeys(row["model"] for row in r["rows"]))
        lines.append(f"| engine crash | {len(r['rows'])} crashes injected (POST /admin/fault) into {models}, each "
                     f"while 4 requests decode | ready and answering again within {r['max_recovery_s']:.2f} s "
                     f"(worst); requests in flight: {how}; {r['hung']} hung; restarts counted "
                     f"{r['restarts_counted']:.0f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    # deferred: matplotlib loads only when a plot is drawn
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result.get("recovery", {}).get("rows", [])
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(range(len(rows)), [r["recovery_s"] for r in rows],
           tick_label=[f"{r['model']}\n#{i % 3 + 1}" for i, r in enumerate(rows)])
    ax.axhline(10, color="red", linestyle="--", label="target 10 s")
    ax.set_ylabel("seconds to ready again")
    ax.set_title("recovery after an injected engine crash")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
