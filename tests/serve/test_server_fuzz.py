"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI document, valid
and invalid, for every endpoint, and checks each answer: no 5xx, status codes, content types and
bodies as documented (the error shape included), invalid bodies rejected, the methods in `Allow`.
A bounded run (a few hundred cases); `leapfrog bench --suite fuzz` runs thousands against the
built-in models.

Not checked: that every schema-valid body is accepted. The schema over-approximates (see
leapfrog/serve/schema.py): a prompt longer than the context is valid JSON Schema and a 400."""
from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from leapfrog.sampling_params import SamplingParams  # noqa: E402
from leapfrog.serve.schema import BOUNDS  # noqa: E402
from test_server_common import ServerThread  # noqa: E402

KEY = "fuzz-key"
PROBES = ("/healthz", "/ready")
PAGES = ("/", "/couplet")      # static HTML, open to GET (their key boxes send the key)


def fuzz(url: str, examples: int, headers: dict | None = None) -> tuple[int, list[str]]:
    """Every operation of the server's schema, `examples` valid and `examples` invalid cases
    each; returns the number of cases and the failures (operation, mode: the check's report)."""
    doc = httpx.get(url + "/openapi.json", headers=headers).json()
    api = schemathesis.openapi.from_dict(doc)
    api.config.update(base_url=url)
    count, failures = 0, []
    for result in api.get_all_operations():
        operation = result.ok()
        has_body = "requestBody" in doc["paths"][operation.path][operation.method.lower()]
        for mode in GenerationMode if has_body else [GenerationMode.POSITIVE]:    # a GET has nothing to break
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None, phases=[Phase.generate], derandomize=True)
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal count
                count += 1
                try:
                    case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance], timeout=60)
                except AssertionError as exc:     # keep going: one report names every operation that failed
                    failures.append(f"{operation.label} ({mode.value}): {str(exc)[:2000]}")
                if headers and operation.path not in PROBES and not (     # never served without the key
                        operation.path in PAGES and operation.method.upper() in ("GET", "HEAD")):
                    assert case.call(headers={}, timeout=60).status_code == 401, operation.label
            run()
    return count, failures


@pytest.fixture(scope="module")
def fuzzed(llama_dir):
    # a tiny Llama first and the built-in couplets model second, as `leapfrog serve` serves two
    s = ServerThread(llama_dir, models=[str(llama_dir), "couplets"], served_model_name=None,
                     max_batch_size=8, max_queue_size=32, default_max_tokens=16).start()
    yield s
    s.stop()


def test_every_endpoint_holds_to_its_schema(fuzzed):
    count, failures = fuzz(fuzzed.url, 15)
    assert count >= 4 * 2 * 15 and not failures, "\n".join(failures)


def test_fuzzing_left_the_server_clean(fuzzed):
    assert fuzzed.wait_idle(30) == 0
    assert httpx.get(fuzzed.url + "/ready").status_code == 200
    assert httpx.post(fuzzed.url + "/generate", json={"prompt": "Once", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("field", sorted(set(BOUNDS) - {"max_length", "max_completion_tokens", "num_candidates",
                                                           "top_logprobs"}))
def test_schema_bounds_are_the_sampling_params_bounds(field):
    """Each documented bound is where SamplingParams starts refusing: the bound itself passes,
    a step beyond it fails."""
    bound = BOUNDS[field]
    base = {"max_tokens": 8} if field not in ("max_tokens", "min_tokens") else {}
    if field == "min_tokens":
        base = {"max_tokens": bound["maximum"]}
    step = 1 if field in ("max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs") else 1e-9
    for key, ok in (("minimum", True), ("exclusiveMinimum", False), ("maximum", True)):
        if key not in bound:
            continue
        edge = bound[key]
        beyond = edge - step if key != "maximum" else edge + step
        if key == "minimum" and isinstance(edge, float):
            beyond = edge * (1 - 1e-6) if edge > 0 else edge - step
        if ok:
            SamplingParams(**{**base, field: edge})
        else:
            with pytest.raises(ValueError):
                SamplingParams(**{**base, field: edge})
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{**base, field: beyond})


def test_fuzzing_with_authentication_on(llama_dir):
    """With a key configured: the same checks with the key, and every case sent again without it
    gets 401 (the probes excepted)."""
    s = ServerThread(llama_dir, api_key=[KEY], max_batch_size=4, default_max_tokens=8).start()
    try:
        count, failures = fuzz(s.url, 5, {"Authorization": f"Bearer {KEY}"})
        assert count >= 4 * 2 * 5 and not failures, "\n".join(failures)
    finally:
        s.stop()
