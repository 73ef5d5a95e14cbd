"""Batch jobs (serve/batches.py, serve/run_batch.py): the Batch API through the `openai` client,
malformed lines, per-key scoping, limits, a server killed with SIGKILL three times mid-batch,
and `leapfrog run-batch` resuming after a kill and agreeing with the server."""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from leapfrog.serve.batches import BatchStore, parse_lines
from test_server_common import ServerThread, free_port


def request_lines(n: int, max_tokens: int = 6, chat: bool = True) -> list[dict]:
    """Completions and (every other line, `chat`) chat completions, each seeded by its index."""
    out = []
    for i in range(n):
        if i % 2 and chat:
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"Tell story {i}"}],
                    "max_tokens": max_tokens, "temperature": 0.8, "seed": i}
            url = "/v1/chat/completions"
        else:
            body = {"model": "tiny", "prompt": f"Once upon a time {i}", "max_tokens": max_tokens,
                    "temperature": 0.8, "seed": i}
            url = "/v1/completions"
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return out


def jsonl(rows: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def text_of(result: dict) -> str:
    body = result["response"]["body"]
    choice = body["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_lines_are_parsed_and_malformed_ones_carry_their_error():
    rows = [request_lines(1)[0], "{not json", json.dumps([1, 2]), json.dumps({"custom_id": "x", "url": "/v1/embeddings",
                                                                               "body": {}}),
            json.dumps({"url": "/v1/completions", "body": {}}), json.dumps(request_lines(1)[0]),
            json.dumps({**request_lines(1)[0], "custom_id": "s", "body": {"prompt": "x", "stream": True}})]
    lines = parse_lines(jsonl(rows), None, 100)
    assert [ln.error["code"] if ln.error else None for ln in lines] == [
        None, "invalid_json", "invalid_request", "invalid_url", "missing_custom_id", "duplicate_custom_id", "invalid_body"]
    with pytest.raises(ValueError, match="at most 3"):
        parse_lines(jsonl(rows), None, 3)


def test_run_batch_refuses_an_output_it_could_not_write_before_running(tmp_path, capsys):
    from leapfrog.serve.run_batch import main as run_batch
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(jsonl(request_lines(1)))
    for out, why in ((tmp_path, "is a folder"), (inp, "is the input file"),
                     (tmp_path / "no" / "out.jsonl", "does not exist")):
        assert run_batch(["-i", str(inp), "-o", str(out), "--model", "stories"]) == 2
        assert why in capsys.readouterr().err
    assert inp.read_bytes() == jsonl(request_lines(1))
    # a model that is not there, or a folder that is no checkpoint: named before anything runs
    (tmp_path / "empty").mkdir()
    for model, why in (("no-such-model", "no-such-model"), (str(tmp_path / "empty"), "config.json: missing")):
        assert run_batch(["-i", str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", model]) == 2
        assert why in capsys.readouterr().err


def test_servers_sharing_a_store_each_run_the_batches_they_accepted(tmp_path):
    """Servers on one host share the default store: a batch runs on the server that accepted it
    (another one ran it too, and failed its lines for a model it does not serve); a batch from a
    store written before batches had a server is anyone's."""
    store = BatchStore(tmp_path / "batches.sqlite3")
    lines = parse_lines(jsonl(request_lines(2)), "/v1/chat/completions", 10)
    a = store.create_batch("", "file-a", "/v1/chat/completions", lines, None, server="host:8411")["id"]
    b = store.create_batch("", "file-b", "/v1/chat/completions", lines, None, server="host:8414")["id"]
    old = store.create_batch("", "file-c", "/v1/chat/completions", lines, None)["id"]
    assert set(store.unfinished("host:8411")) == {a, old} and set(store.unfinished("host:8414")) == {b, old}
    assert set(store.unfinished()) == {a, b, old}


def test_lines_end_at_newlines_only_and_errors_name_the_line_in_the_file():
    """A JSON string may hold U+2028, U+0085 or a form feed as written (json.dumps with
    ensure_ascii=False writes them): the line stays whole. CRLF files parse; a blank line
    still counts in the line numbers errors give."""
    body = {"model": "tiny", "prompt": "a\u2028b\u0085c\x0cd\u2029e", "max_tokens": 2}
    good = json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/completions", "body": body},
                      ensure_ascii=False)
    data = (good + "\r\n\r\n{broken\r\n").encode()
    lines = parse_lines(data, None, 100)
    assert len(lines) == 2 and lines[0].error is None and lines[0].body == body
    assert lines[1].error["code"] == "invalid_json" and lines[1].error["message"].startswith("line 3 ")


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    srv = ServerThread(llama_dir, batch_dir=str(tmp_path_factory.mktemp("batches")), api_key=["k1", "k2"],
                       max_file_bytes=200_000).start()
    yield srv
    srv.stop()


def wait_done(client, bid: str, timeout: float = 120) -> object:
    deadline = time.time() + timeout
    while time.time() < deadline:
        b = client.batches.retrieve(bid)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {bid} did not finish: {b.status}")


def test_the_batch_api_through_the_openai_client(server, tmp_path):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k1")
    rows = request_lines(12) + ["{broken", json.dumps({"custom_id": "odd", "method": "POST", "url": "/v1/nowhere",
                                                        "body": {}})]
    rows.append(json.dumps({"custom_id": "bad-temp", "method": "POST", "url": "/v1/completions",
                            "body": {"model": "tiny", "prompt": "x", "temperature": -1}}))
    # a model that is not a name is that line's error, not a runner stuck on it
    rows.append(json.dumps({"custom_id": "bad-model", "method": "POST", "url": "/v1/completions",
                            "body": {"model": ["tiny"], "prompt": "x"}}))
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(rows))
    f = client.files.create(file=path.open("rb"), purpose="batch")
    assert f.bytes == path.stat().st_size and f.purpose == "batch"
    assert client.files.content(f.id).content == path.read_bytes()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                              metadata={"job": "test"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "test"}
    b = wait_done(client, b.id)
    assert b.status == "completed"
    # the batch's endpoint is /v1/completions: its chat lines are errors, like the malformed ones
    out = [json.loads(x) for x in client.files.content(b.output_file_id).content.decode().splitlines()]
    err = [json.loads(x) for x in client.files.content(b.error_file_id).content.decode().splitlines()]
    assert b.request_counts.total == 16 and b.request_counts.completed == len(out) == 6
    assert b.request_counts.failed == len(err) == 10
    assert {r["custom_id"] for r in out} == {f"req-{i}" for i in range(0, 12, 2)}
    by_id = {r["custom_id"]: r for r in err}
    assert by_id["bad-temp"]["response"]["status_code"] == 400
    assert by_id["bad-temp"]["response"]["body"]["error"]["param"] == "temperature"
    assert by_id["bad-model"]["response"]["status_code"] == 400
    assert by_id["bad-model"]["response"]["body"]["error"]["param"] == "model"
    assert by_id[None]["error"]["code"] == "invalid_json"
    assert by_id["odd"]["error"]["code"] == "invalid_url"
    # each answer is what the endpoint gives for the same request and seed
    for r in out[:3]:
        i = int(r["custom_id"].split("-")[1])
        direct = httpx.post(server.url + "/v1/completions", json=request_lines(i + 1)[i]["body"],
                            headers={"Authorization": "Bearer k1"}, timeout=60).json()
        assert text_of(r) == direct["choices"][0]["text"]
    listed = client.batches.list()
    assert b.id in [x.id for x in listed.data]


def test_files_and_batches_belong_to_their_key(server):
    h1, h2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    r = httpx.post(server.url + "/v1/files", headers=h1, files={"file": ("a.jsonl", jsonl(request_lines(2)))},
                   data={"purpose": "batch"}, timeout=30)
    fid = r.json()["id"]
    assert httpx.get(server.url + f"/v1/files/{fid}", headers=h2).status_code == 404
    assert httpx.get(server.url + f"/v1/files/{fid}/content", headers=h2).status_code == 404
    assert httpx.post(server.url + "/v1/batches", headers=h2, json={
        "input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}).status_code == 404
    bid = httpx.post(server.url + "/v1/batches", headers=h1, json={
        "input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}).json()["id"]
    assert httpx.get(server.url + f"/v1/batches/{bid}", headers=h2).status_code == 404
    assert httpx.post(server.url + f"/v1/batches/{bid}/cancel", headers=h2).status_code == 404
    assert bid not in [b["id"] for b in httpx.get(server.url + "/v1/batches", headers=h2).json()["data"]]
    assert httpx.get(server.url + "/v1/batches").status_code == 401


@pytest.mark.parametrize("make,status,param", [
    (lambda: {"files": {"file": ("big.jsonl", b"x" * 300_000)}, "data": {"purpose": "batch"}}, 413, "file"),
    (lambda: {"files": {"file": ("a.jsonl", b"{}\n")}, "data": {"purpose": "fine-tune"}}, 400, "purpose"),
    (lambda: {"data": {"purpose": "batch"}}, 400, "file"),
])
def test_bad_uploads(server, make, status, param):
    r = httpx.post(server.url + "/v1/files", headers={"Authorization": "Bearer k1"}, timeout=30, **make())
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_bad_batch_requests(server):
    h = {"Authorization": "Bearer k1"}
    fid = httpx.post(server.url + "/v1/files", headers=h, files={"file": ("a.jsonl", jsonl(request_lines(1)))},
                     data={"purpose": "batch"}).json()["id"]
    for body, param in [({"input_file_id": fid, "endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
                        ({"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "1h"},
                         "completion_window"),
                        ({"input_file_id": "file_nope", "endpoint": "/v1/completions"}, "input_file_id"),
                        ({"input_file_id": fid, "endpoint": "/v1/completions", "bogus": 1}, "bogus")]:
        r = httpx.post(server.url + "/v1/batches", headers=h, json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


# --- crashes ---------------------------------------------------------------------------------------
def serve(llama_dir: Path, data_dir: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "leapfrog", "serve", "--model", str(llama_dir), "--served-model-name", "tiny",
           "--host", "127.0.0.1", "--port", str(port), "--batch-dir", str(data_dir), "--warmup-requests", "0",
           "--max-batch-size", "16", "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=log.open("a"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server not ready")


def done_results(db: Path, bid: str) -> dict[int, str]:
    with sqlite3.connect(db) as con:
        return dict(con.execute("SELECT idx, result FROM lines WHERE batch_id = ? AND state = 'done'", (bid,)).fetchall())


def test_a_batch_survives_three_sigkills(llama_dir, tmp_path):
    """1,000 lines; the server is killed with SIGKILL three times at random points and restarted:
    exactly 1,000 results, no duplicates, and every line finished before a kill unchanged."""
    n, port = 1000, free_port()
    url, db, log = f"http://127.0.0.1:{port}", tmp_path / "data" / "batches.sqlite3", tmp_path / "serve.log"
    proc = serve(llama_dir, tmp_path / "data", port, log)
    try:
        wait_ready(url, proc)
        fid = httpx.post(url + "/v1/files", files={"file": ("in.jsonl", jsonl(request_lines(n, 4, chat=False)))},
                         data={"purpose": "batch"}, timeout=60).json()["id"]
        bid = httpx.post(url + "/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                    "completion_window": "24h"}, timeout=60).json()["id"]
        rng = random.Random(7)
        seen: dict[int, str] = {}
        for kill in range(3):
            target = (kill + 1) * n // 4 + rng.randint(-60, 60)
            deadline = time.time() + 120
            while len(done_results(db, bid)) < target and time.time() < deadline:
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            now = done_results(db, bid)
            assert all(now[k] == v for k, v in seen.items())      # nothing finished was lost or changed
            assert len(now) >= len(seen) and len(now) < n, (len(now), n)
            seen = now
            proc = serve(llama_dir, tmp_path / "data", port, log)
            wait_ready(url, proc)
        deadline = time.time() + 180
        while time.time() < deadline:
            b = httpx.get(url + f"/v1/batches/{bid}").json()
            if b["status"] == "completed":
                break
            time.sleep(0.1)
        assert b["status"] == "completed", b
        assert b["request_counts"] == {"total": n, "completed": n, "failed": 0}
        out = httpx.get(url + f"/v1/files/{b['output_file_id']}/content").text.splitlines()
        ids = [json.loads(x)["custom_id"] for x in out]
        assert ids == [f"req-{i}" for i in range(n)]          # one result a line, in input order
        final = done_results(db, bid)
        assert all(final[k] == v for k, v in seen.items())
        assert [json.loads(final[i]) for i in range(n)] == [json.loads(x) for x in out]
    finally:
        proc.kill()


def test_run_batch_resumes_after_a_kill_and_agrees_with_the_server(llama_dir, tmp_path, server):
    rows = request_lines(400, 8)
    (tmp_path / "in.jsonl").write_bytes(jsonl(rows + ["{broken"]))
    cmd = [sys.executable, "-m", "leapfrog", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
           str(tmp_path / "out.jsonl"), "--model", str(llama_dir), "--served-model-name", "tiny",
           "--batch-dir", str(tmp_path / "data"), "--max-batch-size", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = next(iter((tmp_path / "data").glob("run-batch-*.sqlite3")), None)
    deadline = time.time() + 120
    while time.time() < deadline:
        db = next(iter((tmp_path / "data").glob("run-batch-*.sqlite3")), None)
        if db is not None:
            try:
                with sqlite3.connect(db) as con:
                    done = con.execute("SELECT COUNT(*) FROM lines WHERE state = 'done'").fetchone()[0]
            except sqlite3.OperationalError:       # the file made, its tables not yet
                done = 0
            if done > 40:
                break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "out.jsonl").exists()
    # an offline run has no completion window: resumed a day later (a progress file whose batch
    # carries the server's 24 h window), it still runs every line left
    with sqlite3.connect(db) as con:
        (bid, obj), = con.execute("SELECT id, obj FROM batches").fetchall()
        con.execute("UPDATE batches SET obj = ? WHERE id = ?", (json.dumps({**json.loads(obj), "expires_at": 1}), bid))
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == 401 and [r["custom_id"] for r in out[:400]] == [r["custom_id"] for r in rows]
    assert out[400]["error"]["code"] == "invalid_json"
    # the same answers as the server's Batch API for the same seeds
    h = {"Authorization": "Bearer k1"}
    fid = httpx.post(server.url + "/v1/files", headers=h, files={"file": ("in.jsonl", jsonl(rows[:20:2]))},
                     data={"purpose": "batch"}).json()["id"]
    bid = httpx.post(server.url + "/v1/batches", headers=h, json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                                  "completion_window": "24h"}).json()["id"]
    deadline = time.time() + 120
    while (b := httpx.get(server.url + f"/v1/batches/{bid}", headers=h).json())["status"] != "completed":
        assert time.time() < deadline
        time.sleep(0.1)
    served = [json.loads(x) for x in httpx.get(server.url + f"/v1/files/{b['output_file_id']}/content",
                                               headers=h).text.splitlines()]
    assert [text_of(r) for r in served] == [text_of(r) for r in out[:20:2]]


def test_batch_lines_yield_to_live_requests(server):
    """While a live request is in flight the batch's lines are left out of the engine's steps;
    the live answer is the one it gets alone, and the batch still ends with every line answered
    once."""
    h = {"Authorization": "Bearer k1"}
    n = 200
    rows = request_lines(n, 48, chat=False)
    fid = httpx.post(server.url + "/v1/files", headers=h, files={"file": ("in.jsonl", jsonl(rows))},
                     data={"purpose": "batch"}).json()["id"]
    live = {"model": "tiny", "prompt": "The cat", "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(server.url + "/v1/completions", headers=h, json=live, timeout=60).json()["choices"][0]["text"]
    runner = server.state.primary.guests["batches"][1]
    scheduler = server.state.primary.engine.engine.scheduler
    paused = scheduler.num_background_paused
    bid = httpx.post(server.url + "/v1/batches", headers=h, json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                                  "completion_window": "24h"}).json()["id"]
    texts = []
    deadline = time.time() + 60
    while scheduler.num_background_paused == paused and time.time() < deadline:
        while runner.num_running == 0 and time.time() < deadline:      # batch lines in flight first
            time.sleep(0.002)
        texts.append(httpx.post(server.url + "/v1/completions", headers=h, json=live,
                                timeout=60).json()["choices"][0]["text"])
    assert texts and texts == [alone] * len(texts)
    assert scheduler.num_background_paused > paused
    deadline = time.time() + 120
    while (b := httpx.get(server.url + f"/v1/batches/{bid}", headers=h).json())["status"] != "completed":
        assert time.time() < deadline
        time.sleep(0.1)
    assert b["request_counts"] == {"total": n, "completed": n, "failed": 0}


def test_the_scheduler_runs_background_work_only_without_live_work(llama_dir):
    """Background rows (batch priority) sit out every step while a live request runs or waits,
    and give up their place (preempted) when the batch is full; all finish with the tokens they
    get alone."""
    from leapfrog import LLM, SamplingParams
    from leapfrog.sampling_params import BACKGROUND_PRIORITY
    llm = LLM(str(llama_dir), max_batch_size=2)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = {p: llm.generate([p], greedy)[0].token_ids for p in ("The cat", "A dog", "Once upon")}
    eng = llm.engine
    bg = [eng.add_request(p, greedy, priority=BACKGROUND_PRIORITY) for p in ("The cat", "A dog")]
    eng.step()                                            # their prefills and first tokens
    live = eng.add_request("Once upon", greedy)
    outs, order = {}, []
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
                order.append(out.request_id)
    assert order[0] == live                               # the live request finished first
    assert outs[live] == alone["Once upon"]
    assert [outs[r] for r in bg] == [alone["The cat"], alone["A dog"]]
    assert eng.scheduler.num_background_paused > 0 and eng.scheduler.num_preemptions > 0


def test_only_live_requests_interrupt_the_engine():
    """The server's submit raises the engine's interrupt flag for live requests, not for batch lines."""
    import asyncio

    from leapfrog import SamplingParams
    from leapfrog.sampling_params import BACKGROUND_PRIORITY
    from leapfrog.serve.engine_thread import AsyncEngine
    from leapfrog.serve.metrics import ServerMetrics

    class Engine:
        calls = 0

        def interrupt_background(self):
            Engine.calls += 1

    eng = AsyncEngine(lambda: None, ServerMetrics("tiny"))
    eng.engine = Engine()
    sink: asyncio.Queue = asyncio.Queue()
    eng.submit([1, 2], SamplingParams(max_tokens=1), sink, priority=BACKGROUND_PRIORITY)
    assert Engine.calls == 0
    eng.submit([1, 2], SamplingParams(max_tokens=1), sink, priority=0)
    eng.submit([1, 2], SamplingParams(max_tokens=1), sink, priority=5)
    assert Engine.calls == 2
