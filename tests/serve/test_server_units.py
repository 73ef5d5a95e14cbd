"""Server parts without a server: JWT, token bucket, Prometheus exposition."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time

import pytest

from leapfrog.serve.auth import AuthError, Authenticator, RateLimiter, jwt_decode, jwt_encode
from leapfrog.serve.metrics import ServerMetrics


def _b64(obj: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()


def test_jwt_roundtrip_and_rejections():
    now = time.time()
    tok = jwt_encode({"sub": "bob", "exp": now + 60}, "k")
    assert jwt_decode(tok, "k")["sub"] == "bob"
    assert jwt_decode(jwt_encode({"sub": "bob", "exp": now - 10}, "k"), "k")["sub"] == "bob"   # 30 s leeway
    with pytest.raises(AuthError, match="expired"):
        jwt_decode(jwt_encode({"sub": "bob", "exp": now - 3600}, "k"), "k")
    with pytest.raises(AuthError, match="not valid yet"):
        jwt_decode(jwt_encode({"sub": "bob", "nbf": now + 3600}, "k"), "k")
    with pytest.raises(AuthError, match="signature"):
        jwt_decode(tok, "other")
    body = tok.split(".")[1]
    # the header's alg is not trusted: alg=none with the signature stripped, or another HMAC, must not pass
    for alg in ("none", "HS512"):
        with pytest.raises(AuthError, match="HS256"):
            jwt_decode(f"{_b64({'alg': alg, 'typ': 'JWT'})}.{body}.", "k")
    with pytest.raises(AuthError, match="malformed"):
        jwt_decode("a.b", "k")
    with pytest.raises(AuthError, match="malformed"):
        jwt_decode("a.b.c", "k")                       # the header is not base64 JSON
    signing_input = f"{_b64({'alg': 'HS256'})}.bm90IGpzb24"     # a correctly signed payload "not json"
    sig = base64.urlsafe_b64encode(hmac.new(b"k", signing_input.encode(), hashlib.sha256).digest())
    with pytest.raises(AuthError, match="malformed"):
        jwt_decode(f"{signing_input}.{sig.rstrip(b'=').decode()}", "k")


def test_authenticator_identities():
    auth = Authenticator(["k1"], jwt_secret="s")
    assert auth.check("Bearer k1").startswith("key:")
    assert auth.check(None, x_api_key="k1").startswith("key:")
    assert auth.check("Bearer " + jwt_encode({"sub": "ann"}, "s")) == "jwt:ann"
    for bad in (None, "Basic k1", "Bearer k2"):
        with pytest.raises(AuthError):
            auth.check(bad)
    assert Authenticator([]).check(None) is None       # auth off


def test_token_bucket():
    rl = RateLimiter(rate=2.0, burst=3)
    assert [rl.acquire("a", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rl.acquire("a", now=0.0) == pytest.approx(0.5)      # one token refills in 0.5 s
    assert rl.acquire("b", now=0.0) == 0.0                    # other clients are unaffected
    assert rl.acquire("a", now=0.5) == 0.0
    assert RateLimiter(rate=0).acquire("a") == 0.0             # off


def test_prometheus_exposition_is_well_formed():
    m = ServerMetrics('m"odel')
    for v in (0.003, 0.2, 30.0, 1000.0):
        m.observe("time_to_first_token_seconds", v)
    m.add("generation_tokens", 5)
    m.finished("stop")
    m.publish({"num_requests_running": 2, "kv_cache_usage_perc": 0.25}, "ar", {"num_steps": 4})
    text = m.render()
    sample = re.compile(r'^leapfrog:[a-z0-9_]+(\{[a-z_]+="(?:[^"\\]|\\.)*"(,[a-z_]+="(?:[^"\\]|\\.)*")*\})? \S+$')
    typed = set()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            typed.add(line.split()[2])
        elif not line.startswith("# HELP"):
            assert sample.match(line), line
            base = line.split("{")[0].split(" ")[0]
            assert any(base == t or base.startswith(t + "_") for t in typed), line
    buckets = [float(x) for x in re.findall(r'time_to_first_token_seconds_bucket\{.*?\} (\S+)', text)]
    assert buckets == sorted(buckets) and buckets[-1] == 4
    assert 'model_name="m\\"odel"' in text
    assert "leapfrog:num_requests_running{model_name=" in text
    assert 'leapfrog:method_num_steps_total{method="ar"' in text


def test_prometheus_series_names_are_stable():
    """Dashboards and scrapers know these names, types and labels (vLLM's, under `leapfrog:`)."""
    m = ServerMetrics("tiny")
    m.observe("request_tokens_per_forward", 1.0)
    m.finished("stop")
    m.reject("queue_full")
    m.publish({}, "dspark", {"num_drafted_tokens": 3, "acceptance-rate": 0.5})
    text = m.render()
    types = re.findall(r"^# TYPE leapfrog:(\S+) (\S+)$", text, re.M)
    assert types == [
        ("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"), ("kv_cache_usage_perc", "gauge"),
        ("kv_cache_num_blocks", "gauge"), ("kv_cache_used_blocks", "gauge"), ("tokens_per_forward", "gauge"),
        ("prefix_cache_queries_total", "counter"), ("prefix_cache_hits_total", "counter"),
        ("prefix_cache_tier2_hits_total", "counter"), ("prefix_cache_tier3_hits_total", "counter"),
        ("engine_steps_total", "counter"), ("engine_interrupted_steps_total", "counter"), ("prompt_tokens_total", "counter"),
        ("generation_tokens_total", "counter"), ("request_forwards_total", "counter"),
        ("num_preemptions_total", "counter"), ("engine_restarts_total", "counter"), ("request_success_total", "counter"),
        ("http_requests_rejected_total", "counter"),
        ("time_to_first_token_seconds", "histogram"), ("inter_token_latency_seconds", "histogram"),
        ("time_per_output_token_seconds", "histogram"), ("e2e_request_latency_seconds", "histogram"),
        ("request_tokens_per_forward", "histogram"),
        ("method_acceptance_rate", "gauge"), ("method_num_drafted_tokens_total", "counter")]
    assert "# HELP leapfrog:prompt_tokens_total Prompt tokens processed.\n" in text
    assert 'leapfrog:request_success_total{finished_reason="stop",model_name="tiny"} 1' in text
    assert 'leapfrog:http_requests_rejected_total{model_name="tiny",reason="queue_full"} 1' in text
    assert 'leapfrog:method_num_drafted_tokens_total{method="dspark",model_name="tiny"} 3' in text
    assert 'leapfrog:request_tokens_per_forward_bucket{le="1",model_name="tiny"} 1' in text   # not le="1.0"
    assert 'le="0.0025"' in text and 'le="+Inf"' in text
    assert "_created" not in text and "_total_total" not in text
    # the library's own parser reads it back
    from prometheus_client.parser import text_string_to_metric_families
    assert len(list(text_string_to_metric_families(text))) == len(types)


def test_prometheus_registries_are_per_server():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.add("generation_tokens", 7)
    assert 'leapfrog:generation_tokens_total{model_name="a"} 7' in a.render()
    text = b.render()
    assert 'model_name="a"' not in text and 'leapfrog:generation_tokens_total{model_name="b"} 0' in text


@pytest.mark.parametrize("depth", [50, 400, 700, 900, 990, 5000, 100_000])
@pytest.mark.parametrize("field", ["prompt", "logit_bias"])
def test_deeply_nested_bodies_are_400_not_500(depth, field):
    """A body nested about a thousand deep once raised RecursionError in the JSON decoder (a 500);
    shallower ones may pass the decoder and exhaust the stack in the checks after it."""
    import sys

    from leapfrog.serve.protocol import APIError, CompletionRequest, parse_body
    inner = "[" * depth + "]" * depth if field == "prompt" else '{"a":' * depth + "1" + "}" * depth
    raw = ('{"%s": %s}' % (field, inner)).encode()
    limit = sys.getrecursionlimit()
    for frames in (limit, 200):          # a server thread may start deeper in its stack than a test
        sys.setrecursionlimit(frames)
        try:
            with pytest.raises(APIError) as e:
                parse_body(raw, CompletionRequest)
        finally:
            sys.setrecursionlimit(limit)
        assert e.value.status == 400
