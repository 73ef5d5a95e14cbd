"""The server with a speculative method: answers equal `ar` greedy, and /metrics carries the
drafted / accepted counters, τ and per-position acceptance rates (issue 5, observability)."""
from __future__ import annotations

import re

import httpx

from leapfrog import LLM, SamplingParams
from test_server_common import ServerThread
from test_speculative import write_drafter


def test_dspark_server_reports_acceptance_metrics(llama_dir, tmp_path, one_thread):
    drafter = write_drafter(tmp_path / "dspark", llama_dir, "dspark", num_layers=1, block_size=4)
    srv = ServerThread(llama_dir, method="dspark", draft_model=str(drafter)).start()
    try:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
        got = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        want = LLM(str(llama_dir)).generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0))[0]
        assert got["choices"][0]["text"] == want.text
        text = httpx.get(srv.url + "/metrics").text
        for series in ("method_num_drafted_tokens_total", "method_num_accepted_tokens_total",
                       "method_num_verify_steps_total", "method_acceptance_length", "method_acceptance_rate_pos1"):
            m = re.search(rf'^leapfrog:{series}{{method="dspark"[^}}]*}} (\S+)$', text, re.M)
            assert m, f"{series} missing from /metrics"
        drafted = float(re.search(r'^leapfrog:method_num_drafted_tokens_total\{[^}]*\} (\S+)$', text, re.M).group(1))
        assert drafted > 0
        assert srv.wait_idle() == 0
    finally:
        srv.stop()
