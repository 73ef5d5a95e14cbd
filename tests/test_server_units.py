"""Server parts without a server: JWT, token bucket, Prometheus exposition."""
from __future__ import annotations

import base64
import json
import re

import pytest

from leapfrog.serve.auth import AuthError, Authenticator, RateLimiter, jwt_decode, jwt_encode
from leapfrog.serve.metrics import ServerMetrics


def test_jwt_roundtrip_and_rejections():
    tok = jwt_encode({"sub": "bob", "exp": 2000}, "k")
    assert jwt_decode(tok, "k", now=1000)["sub"] == "bob"
    with pytest.raises(AuthError, match="expired"):
        jwt_decode(tok, "k", now=3000)
    with pytest.raises(AuthError, match="signature"):
        jwt_decode(tok, "other", now=1000)
    # alg=none with the signature stripped must not pass
    head = base64.urlsafe_b64encode(json.dumps({"alg": "none"}).encode()).rstrip(b"=").decode()
    with pytest.raises(AuthError):
        jwt_decode(f"{head}.{tok.split('.')[1]}.", "k", now=1000)
    with pytest.raises(AuthError, match="malformed"):
        jwt_decode("a.b", "k")


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
