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


def test_a_request_controls_drafting_and_its_usage_counts_the_drafts(llama_dir, one_thread):
    """`speculative: {"num_speculative_tokens": N}` caps a request's verified drafts (0: none);
    usage carries the request's drafted and accepted counts, in OpenAI's predicted-output
    fields and leapfrog's own; a bad value is a 400 naming the field."""
    srv = ServerThread(llama_dir, method="ngram", method_options={"verify": "fixed", "prompt_lookup_min": 1}).start()
    try:
        prompt = "a b c d a b c d a b c d a b c"
        want = LLM(str(llama_dir)).generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
        base = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        on = httpx.post(srv.url + "/v1/completions", json=base, timeout=60).json()
        assert on["choices"][0]["text"] == want.text
        spec = on["usage"]["speculative"]
        details = on["usage"]["completion_tokens_details"]
        assert spec["num_drafted_tokens"] > 0 and spec["drafting_off"] is None
        assert details == {"accepted_prediction_tokens": spec["num_accepted_tokens"],
                           "rejected_prediction_tokens": spec["num_drafted_tokens"] - spec["num_accepted_tokens"]}
        off = httpx.post(srv.url + "/v1/completions", json={**base, "speculative": {"num_speculative_tokens": 0}},
                         timeout=60).json()
        assert off["choices"][0]["text"] == want.text
        assert off["usage"]["speculative"] == {"num_drafted_tokens": 0, "num_accepted_tokens": 0,
                                               "drafting_off": "request"}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "stream": True, "stream_options": {"include_usage": True}, "speculative": {"num_speculative_tokens": 2}}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=chat, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        import json
        last = json.loads(events[-1][6:])
        assert last["usage"]["completion_tokens"] == 8 and "speculative" in last["usage"]
        for bad in ({"num_speculative_tokens": -1}, {"num_speculative_tokens": 65}, {"num_speculative_tokens": "3"},
                    {"gamma": 3}):
            r = httpx.post(srv.url + "/v1/completions", json={**base, "speculative": bad}, timeout=60)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"].startswith("speculative"), r.json()
        assert srv.wait_idle() == 0
    finally:
        srv.stop()
