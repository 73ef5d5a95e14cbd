"""The prefix cache's third tier, shared between replicas through a Redis the tests start on a
port of their own: a prefix one replica computed is reused by another (prefill skipped, the same
tokens as an engine without the tier), in one process and across two `leapfrog serve` processes;
with Redis stopped both keep answering and say so once in their logs."""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time

import httpx
import pytest
import torch

from leapfrog import LLM, SamplingParams
from leapfrog.engine.kv_tiers import RedisKVTier, pack_block, unpack_tokens
from test_server_common import free_port, wait_ready

redis = pytest.importorskip("redis")
REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not on PATH (Debian: apt-get install "
                                 "redis-server; scripts/install.sh tries)")

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LONG = [1] + list(range(20, 60))                 # 41 tokens: ten full blocks of 4


class RedisProcess:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                if self.client.ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def redis_server():
    r = RedisProcess()
    yield r
    if r.proc.poll() is None:
        r.stop()


def _engine(llama_dir, **kw) -> LLM:
    return LLM(str(llama_dir), block_size=4, kv_cache_tokens=64, max_batch_size=1, **kw)


@needs_redis
def test_a_prefix_computed_by_one_replica_is_reused_by_another(llama_dir, redis_server):
    plain = _engine(llama_dir).generate([LONG], GREEDY)[0].token_ids
    first = _engine(llama_dir, kv_remote_url=redis_server.url)
    assert first.generate([LONG], GREEDY)[0].token_ids == plain
    first.engine.block_manager.remote.flush()
    assert first.engine.block_manager.remote.num_published >= 10
    assert len(redis_server.client.keys("leapfrog:kv:*")) >= 10
    second = _engine(llama_dir, kv_remote_url=redis_server.url)
    out = second.generate([LONG], GREEDY)[0]
    bm = second.engine.block_manager
    assert bm.num_remote_hits == 40 and out.metrics.num_cached_prompt_tokens == 40
    assert out.token_ids == plain                  # the shared rows change no output
    assert bm.remote.num_hits == 10


@needs_redis
def test_another_model_or_block_size_never_shares(llama_dir, family_dirs, redis_server):
    a = _engine(llama_dir, kv_remote_url=redis_server.url)
    a.generate([LONG], GREEDY)
    a.engine.block_manager.remote.flush()
    for other in (_engine(family_dirs["qwen3"], kv_remote_url=redis_server.url),
                  LLM(str(llama_dir), block_size=8, kv_cache_tokens=64, max_batch_size=1,
                      kv_remote_url=redis_server.url)):
        assert other.engine.kv_namespace() != a.engine.kv_namespace()
        other.generate([LONG], GREEDY)
        assert other.engine.block_manager.num_remote_hits == 0


@needs_redis
def test_redis_down_costs_only_the_hits(llama_dir, redis_server, caplog):
    plain = _engine(llama_dir).generate([LONG], GREEDY)[0].token_ids
    llm = _engine(llama_dir, kv_remote_url=redis_server.url)
    redis_server.stop()
    with caplog.at_level(logging.WARNING, logger="leapfrog.engine.kv_tiers"):
        for _ in range(3):
            t0 = time.perf_counter()
            assert llm.generate([LONG], GREEDY)[0].token_ids == plain
            assert time.perf_counter() - t0 < 5
        llm.engine.block_manager.remote.flush()
    said = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(said) == 1 and redis_server.url in said[0].getMessage()


def test_block_bytes_round_trip():
    rows = [torch.randn(4, 2, 8).to(torch.bfloat16), torch.randn(4, 2, 8)]
    payload = pack_block((5, 6, 7, 8), rows)
    tokens, offset = unpack_tokens(payload)
    assert tokens == (5, 6, 7, 8) and len(payload) - offset == 4 * 2 * 8 * (2 + 4)
    assert unpack_tokens(b"not a block") is None


def test_a_payload_of_another_layout_is_a_miss():
    k, v = torch.zeros(8, 1, 4), torch.zeros(8, 1, 4)

    class Fake:
        def __init__(self) -> None:
            self.store: dict = {}

        def get(self, key):
            return self.store.get(key)

        def set(self, key, value, ex=None):
            self.store[key] = value

        def ping(self):                 # the writer thread connects first
            return True
    client = Fake()
    tier = RedisKVTier(lambda: [(k, v)], 2, "redis://unused", "ns", client=client)
    client.store[tier._key(42)] = pack_block((1, 2), [torch.zeros(3, 1, 4)] * 2)   # 3 rows, not 2
    assert tier.has(42, (1, 2)) and not tier.load(42, (1, 2), 0)
    assert not tier.has(42, (1, 3))          # other tokens under the same hash: a miss


# --- two `leapfrog serve` processes sharing one Redis ------------------------------------------------
def _serve(llama_dir, url: str, log_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "leapfrog", "serve", "--model", str(llama_dir), "--host",
                             "127.0.0.1", "--port", str(port), "--kv-remote-url", url, "--block-size", "4",
                             "--warmup-requests", "0", "--log-level", "warning"],
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(proc, base)
    return proc, base


def _tier3_hits(base: str) -> float:
    import re
    m = re.search(r"^leapfrog:prefix_cache_tier3_hits_total\{[^}]*\} (\S+)$", httpx.get(base + "/metrics").text, re.M)
    return float(m.group(1))


@needs_redis
def test_two_server_processes_share_a_prefix(llama_dir, redis_server, tmp_path):
    servers = [_serve(llama_dir, redis_server.url, tmp_path / f"serve{i}.log") for i in range(2)]
    try:
        body = {"prompt": LONG, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        (_, a), (_, b) = servers
        first = httpx.post(a + "/v1/completions", json=body, timeout=60).json()
        deadline = time.time() + 10
        while len(redis_server.client.keys("leapfrog:kv:*")) < 10 and time.time() < deadline:
            time.sleep(0.05)
        second = httpx.post(b + "/v1/completions", json=body, timeout=60).json()
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        deadline = time.time() + 10               # /metrics is published after the response
        while _tier3_hits(b) < 40 and time.time() < deadline:
            time.sleep(0.05)
        assert _tier3_hits(b) == 40 and _tier3_hits(a) == 0
        redis_server.stop()                       # both replicas keep serving without it
        for base in (a, b):
            for _ in range(2):
                r = httpx.post(base + "/v1/completions", json=body, timeout=60)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)
    for i in range(2):
        log = (tmp_path / f"serve{i}.log").read_text()
        assert log.count("is unreachable") == 1, log
