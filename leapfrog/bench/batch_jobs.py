"""The batch part of `leapfrog bench --suite reliability` (`--parts batch`), against `leapfrog serve`
processes of the bench's model: a batch through repeated SIGKILLs and restarts (nothing lost,
duplicated or changed), and live clients' latency beside a running batch.
(docs/architecture.md, "bench/reliability.py")
"""
from __future__ import annotations

import json
import random
import shutil
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from leapfrog.bench.common import log


def _lines(n: int, max_tokens: int, offset: int = 0) -> bytes:
    rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"Once upon a time {i + offset}", "max_tokens": max_tokens, "temperature": 0.8,
                      "seed": i + offset}} for i in range(n)]
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _submit(url: str, data: bytes) -> str:
    fid = httpx.post(url + "/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"},
                     timeout=120).json()["id"]
    return httpx.post(url + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}, timeout=120).json()["id"]


def _done(db: Path, bid: str) -> dict[int, str]:
    with sqlite3.connect(db) as con:
        return dict(con.execute("SELECT idx, result FROM lines WHERE batch_id = ? AND state = 'done'", (bid,)))


def crash(server_cls, flags: list[str], out: Path, n: int = 1000, kills: int = 3, seed: int = 0) -> dict:
    data_dir = out / "batch-crash"
    db = data_dir / "batches.sqlite3"
    flags = [*flags, "--batch-dir", str(data_dir), "--warmup-requests", "0"]
    server = server_cls(flags, out / "batch-crash.log")
    server.wait_ready()
    t0 = time.perf_counter()
    bid = _submit(server.url, _lines(n, 8))
    rng = random.Random(seed)
    seen: dict[int, str] = {}
    changed, killed_at = 0, []
    for k in range(kills):
        target = (k + 1) * n // (kills + 1) + rng.randint(-n // 20, n // 20)
        deadline = time.time() + 600
        while len(_done(db, bid)) < target and time.time() < deadline:
            time.sleep(0.01)
        server.proc.kill()
        server.proc.wait()
        server.log.close()
        now = _done(db, bid)
        changed += sum(now.get(i) != r for i, r in seen.items())
        killed_at.append(len(now))
        seen = now
        server = server_cls(flags, out / f"batch-crash-{k + 1}.log")
        server.wait_ready()
    deadline = time.time() + 1800
    while (b := httpx.get(server.url + f"/v1/batches/{bid}", timeout=30).json())["status"] != "completed":
        if time.time() > deadline:
            break
        time.sleep(0.2)
    seconds = time.perf_counter() - t0
    lines = httpx.get(server.url + f"/v1/files/{b['output_file_id']}/content", timeout=60).text.splitlines() \
        if b.get("output_file_id") else []
    ids = [json.loads(x)["custom_id"] for x in lines]
    final = _done(db, bid)
    changed += sum(final.get(i) != r for i, r in seen.items())
    server.stop()
    res = {"lines": n, "kills": kills, "killed_at": killed_at, "status": b["status"], "results": len(lines),
           "duplicates": len(ids) - len(set(ids)), "in_order": ids == [f"req-{i}" for i in range(n)],
           "finished_lines_changed": changed, "seconds": seconds}
    res.update(run_batch_agrees(flags, out, _lines(n, 8), [json.loads(x) for x in lines]))
    return res


def _text(result: dict) -> str | None:
    body = (result.get("response") or {}).get("body") or {}
    choices = body.get("choices") or [{}]
    return choices[0].get("text", (choices[0].get("message") or {}).get("content"))


def run_batch_agrees(flags: list[str], out: Path, data: bytes, served: list[dict]) -> dict:
    """`leapfrog run-batch` on the same lines as a server's batch (the same seeds): how many of
    its answers carry the server's text, by custom_id."""
    src, dst = out / "run-batch-in.jsonl", out / "run-batch-out.jsonl"
    src.write_bytes(data)
    dst.unlink(missing_ok=True)
    shutil.rmtree(out / "run-batch", ignore_errors=True)
    model = flags[flags.index("--model") + 1]
    t0 = time.perf_counter()
    with open(out / "run-batch.log", "w") as logf:
        subprocess.run([sys.executable, "-m", "leapfrog", "run-batch", "-i", str(src), "-o", str(dst), "--model", model,
                        "--batch-dir", str(out / "run-batch")], check=True, stdout=logf, stderr=subprocess.STDOUT,
                       timeout=1800)
    seconds = time.perf_counter() - t0
    mine = {r["custom_id"]: _text(r) for r in map(json.loads, dst.read_text().splitlines())}
    theirs = {r["custom_id"]: _text(r) for r in served}
    same = sum(1 for cid, t in theirs.items() if t is not None and mine.get(cid) == t)
    return {"run_batch_lines": len(mine), "run_batch_same_text": same, "run_batch_seconds": seconds}


THINK_S = 0.5          # each live client's pause between its requests: the idle stretches a batch may use


def _live_client(url: str, stop: float, out: list, new_tokens: int, k: int, spans: list) -> None:
    """One client's requests, one after another over one kept-alive connection (a new client
    per request would add its own set-up to every TTFT)."""
    with httpx.Client(timeout=120) as client:
        _requests(client, url, stop, out, new_tokens, k, spans)


def _requests(client: httpx.Client, url: str, stop: float, out: list, new_tokens: int, k: int, spans: list) -> None:
    i = 0
    while time.perf_counter() < stop:
        if i:
            time.sleep(THINK_S)
        body = {"prompt": f"The little dog {k} {i}", "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0, first, last, tokens = time.perf_counter(), None, None, 0
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.append((None, r.status_code))
                i += 1
                continue
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = first or now
                    last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        if first is not None and tokens > 1:
            out.append((first - t0, (last - first) / (tokens - 1)))
        spans.append((t0, time.perf_counter()))
        i += 1


def _live(url: str, clients: int, seconds: float, new_tokens: int) -> tuple[list, float]:
    """(per live request (TTFT, TPOT) or (None, status), seconds with no live request in flight)."""
    out: list = []
    spans: list = []
    start = time.perf_counter()
    stop = start + seconds
    threads = [threading.Thread(target=_live_client, args=(url, stop, out, new_tokens, k, spans))
               for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    busy, end = 0.0, start
    for a, b in sorted(spans):
        a = max(a, end)
        if b > a:
            busy, end = busy + b - a, b
    return out, time.perf_counter() - start - busy


def live(server_cls, flags: list[str], out: Path, clients: int = 2, seconds: float = 60.0,
         new_tokens: int = 32, rounds: int = 3) -> dict:
    """Live clients alone and beside a running batch, in `rounds` alternations of `seconds` /
    `rounds` each (a batch submitted for each window beside it and cancelled after), so that the
    machine's drift over a minute lands on both sides of the ratio; then the batch alone."""
    data_dir = out / "batch-live"
    db = data_dir / "batches.sqlite3"
    server = server_cls([*flags, "--batch-dir", str(data_dir)], out / "batch-live.log")
    server.wait_ready()
    window = seconds / rounds
    alone: list = []
    mixed: list = []
    per_round = []
    idle = lines_beside = beside_s = 0.0
    for k in range(rounds):
        a, _ = _live(server.url, clients, window, new_tokens)
        bid = _submit(server.url, _lines(2000, 32, offset=2000 * k))     # more than a window can finish
        time.sleep(2.0)
        before, t0 = len(_done(db, bid)), time.perf_counter()
        m, free = _live(server.url, clients, window, new_tokens)
        lines_beside += len(_done(db, bid)) - before
        beside_s += time.perf_counter() - t0
        idle += free
        _cancel(server.url, bid)
        alone += a
        mixed += m
        per_round.append((_ratio(m, a, 0), _ratio(m, a, 1)))
    bid = _submit(server.url, _lines(2000, 32, offset=2000 * rounds))
    time.sleep(2.0)
    before, t0 = len(_done(db, bid)), time.perf_counter()
    time.sleep(window)
    batch_alone = (len(_done(db, bid)) - before) / (time.perf_counter() - t0)
    _cancel(server.url, bid)
    server.stop()

    errors = {"alone": [r[1] for r in alone if r[0] is None], "with_batch": [r[1] for r in mixed if r[0] is None]}
    alone, mixed = [r for r in alone if r[0] is not None], [r for r in mixed if r[0] is not None]
    res = {"clients": clients, "seconds": seconds, "rounds": rounds, "new_tokens": new_tokens,
           "live_requests_alone": len(alone), "live_requests_with_batch": len(mixed), "live_errors": errors,
           "ttft_p50_alone_s": _p50(alone, 0), "ttft_p50_with_batch_s": _p50(mixed, 0),
           "tpot_p50_alone_s": _p50(alone, 1), "tpot_p50_with_batch_s": _p50(mixed, 1),
           "round_ratios": per_round, "batch_lines_per_s_alone": batch_alone,
           "batch_lines_per_s_with_live": lines_beside / max(beside_s, 1e-9),
           "idle_s": idle, "batch_lines_per_idle_s": lines_beside / max(idle, 1e-9), "think_s": THINK_S}
    res["ttft_ratio"] = res["ttft_p50_with_batch_s"] / res["ttft_p50_alone_s"]
    res["tpot_ratio"] = res["tpot_p50_with_batch_s"] / res["tpot_p50_alone_s"]
    log(f"reliability: batch live {res}")
    return res


def _p50(rows: list, j: int) -> float:
    rows = [r for r in rows if r[0] is not None]
    return statistics.median(r[j] for r in rows) if rows else float("nan")


def _ratio(beside: list, alone: list, j: int) -> float:
    return _p50(beside, j) / _p50(alone, j)


def _cancel(url: str, bid: str, timeout: float = 60.0) -> None:
    """Cancel a batch and wait until it has let go of its lines."""
    httpx.post(url + f"/v1/batches/{bid}/cancel", timeout=30)
    deadline = time.time() + timeout
    while httpx.get(url + f"/v1/batches/{bid}", timeout=30).json()["status"] not in ("cancelled", "completed", "failed",
                                                                                    "expired"):
        if time.time() > deadline:
            raise RuntimeError(f"batch {bid} was not cancelled within {timeout:g} s")
        time.sleep(0.1)


def run(server_cls, args, out: Path) -> dict:
    flags = ["--model", args.model]
    log("reliability: batch crash (1,000 lines, 3 x SIGKILL)")
    result = {"crash": crash(server_cls, flags, out)}
    log(f"reliability: batch crash {result['crash']}")
    result["live"] = live(server_cls, flags, out)
    return result


def markdown_rows(r: dict) -> list[str]:
    c, lv = r["crash"], r["live"]
    rounds = ", ".join(f"{t:.2f}x / {p:.2f}x" for t, p in lv["round_ratios"])
    return [f"| batch crash | a {c['lines']}-line batch, the server killed with SIGKILL {c['kills']} times (at "
            f"{', '.join(map(str, c['killed_at']))} lines done) and restarted | {c['status']}: {c['results']} results, "
            f"{c['duplicates']} duplicates, in input order: {c['in_order']}, {c['finished_lines_changed']} finished "
            f"lines changed; {c['seconds']:.0f} s |",
            f"| `leapfrog run-batch` on the same lines | the same {c['lines']} requests (the same seeds) through the "
            f"command instead of the server | {c['run_batch_same_text']} of {c['run_batch_lines']} texts the server's; "
            f"{c['run_batch_seconds']:.0f} s |",
            f"| batch beside live traffic | {lv['clients']} live clients (streamed, {lv['new_tokens']} tokens, "
            f"{lv['think_s']:g} s between requests), {lv['rounds']} rounds of {lv['seconds'] / lv['rounds']:.0f} s alone "
            f"then {lv['seconds'] / lv['rounds']:.0f} s while a batch runs | TTFT p50 "
            f"{lv['ttft_p50_alone_s'] * 1000:.0f} → {lv['ttft_p50_with_batch_s'] * 1000:.0f} ms "
            f"({lv['ttft_ratio']:.2f}x), TPOT p50 {lv['tpot_p50_alone_s'] * 1000:.1f} → "
            f"{lv['tpot_p50_with_batch_s'] * 1000:.1f} ms ({lv['tpot_ratio']:.2f}x); by round (TTFT / TPOT) {rounds}; "
            f"{lv['live_requests_alone']} / {lv['live_requests_with_batch']} live requests answered, errors "
            f"{len(lv['live_errors']['alone'])} / {len(lv['live_errors']['with_batch'])}; batch "
            f"{lv['batch_lines_per_s_with_live']:.1f} lines/s beside live ({lv['batch_lines_per_idle_s']:.1f} per second "
            f"of the {lv['idle_s']:.1f} s without a live request), {lv['batch_lines_per_s_alone']:.1f} alone |"]
