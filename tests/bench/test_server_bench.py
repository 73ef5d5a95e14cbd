"""`leapfrog bench --serve` against the real server: every request completes, files are written,
and the numbers are self-consistent."""
from __future__ import annotations

import json

import pytest

from leapfrog.bench.cli import main as bench_main
from test_server_common import ServerThread


@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(llama_dir).start()
    yield s
    s.stop()


def test_bench_serve_concurrency_levels(server, tmp_path):
    rc = bench_main(["--serve", "--url", server.url, "--concurrency", "1,3", "--num-prompts", "3",
                     "--max-tokens", "6", "--out", str(tmp_path), "--name", "t"])
    assert rc == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["model"] == "tiny" and [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        assert lv["completed"] == 3 and lv["failed"] == 0
        assert lv["mean_output_tokens"] == 6                       # ignore_eos by default
        assert lv["ttft_s"]["p50"] <= lv["e2e_s"]["p50"]
        assert lv["server_tokens_per_forward"] == pytest.approx(1.0)
    assert (tmp_path / "t.png").stat().st_size > 0
    assert "| c=3 | 3/3 |" in (tmp_path / "t.md").read_text()


def test_bench_serve_poisson_rate(server, tmp_path):
    rc = bench_main(["--serve", "--url", server.url, "--request-rate", "50", "--max-concurrency", "2",
                     "--num-prompts", "3", "--max-tokens", "4", "--out", str(tmp_path), "--name", "r"])
    assert rc == 0
    lv = json.loads((tmp_path / "r.json").read_text())["levels"][0]
    assert lv["request_rate"] == 50 and lv["completed"] == 3


def test_bench_serve_against_a_peer_server(server, llama_dir, tmp_path):
    """The same client, prompts and settings against leapfrog and a peer; one comparison table."""
    peer = ServerThread(llama_dir, served_model_name="peer-model").start()
    try:
        rc = bench_main(["--serve", "--url", server.url, "--peer-url", peer.url, "--peer-name", "other",
                         "--concurrency", "1,2", "--num-prompts", "2", "--max-tokens", "5", "--out", str(tmp_path),
                         "--name", "p"])
    finally:
        peer.stop()
    assert rc == 0
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["peer"]["model"] == "peer-model" and result["peer"]["name"] == "other"
    assert [lv["completed"] for lv in result["peer"]["levels"]] == [2, 2]
    assert all(lv["mean_output_tokens"] == 5 for lv in result["peer"]["levels"])
    table = (tmp_path / "p.md").read_text()
    assert "| load | leapfrog out tok/s | other out tok/s | leapfrog / other |" in table
    assert table.count("| c=") == 4          # two levels in each of the two tables


def test_bench_serve_offline_reference(server, llama_dir, tmp_path):
    """--offline-model decodes the first level's prompts with the offline engine in the bench's
    process; the report compares served TPOT at one client with it."""
    rc = bench_main(["--serve", "--url", server.url, "--concurrency", "1", "--num-prompts", "2",
                     "--max-tokens", "6", "--offline-model", str(llama_dir), "--offline-threads", "1",
                     "--out", str(tmp_path), "--name", "o"])
    assert rc == 0
    off = json.loads((tmp_path / "o.json").read_text())["offline"]
    assert off["threads"] == 1 and 0 < off["tpot_s"]["p50"] < 1.0
    assert "Offline engine (" in (tmp_path / "o.md").read_text()


def test_bench_serve_sends_chat_prompt_sets_to_the_chat_endpoint(server, tmp_path):
    """--prompts open: chat requests to /v1/chat/completions (the tiny model chats through the
    plain role: content fallback), each completing with its usage counted."""
    rc = bench_main(["--serve", "--url", server.url, "--concurrency", "2", "--num-prompts", "2", "--warmup", "0",
                     "--max-tokens", "5", "--prompts", "open", "--out", str(tmp_path), "--name", "c"])
    assert rc == 0
    result = json.loads((tmp_path / "c.json").read_text())
    lv = result["levels"][0]
    assert lv["completed"] == 2 and lv["failed"] == 0 and lv["mean_output_tokens"] == 5
    assert "open chat prompts" in (tmp_path / "c.md").read_text()
